/* pipeline_buffers.c — the decode pipeline's memory: the metadata arena (host memory that kernels
 * read directly: positions, attention descriptors, convert lists), one step's memory (the arena's
 * chunks and the host-only copy lists, all released when the step ends), and the grow-only device
 * buffers that pl_ensure_buffers and pl_ensure_recompute size for each step while the streams are
 * idle — the attention buffers shared with the kvstore under push, which writes the KV rows into
 * them; the recomputation's last, and lowering a split the device cannot hold. */
#include "gpuworker/pipeline_internal.h"

#include "common/log.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

enum { META_CHUNK = 1 << 20 };

static void *meta_alloc(meta_arena *a, size_t bytes)
{
    bytes = (bytes + 63) & ~(size_t)63;
    for (; a->cur < a->n; a->cur++) {
        meta_chunk *c = &a->chunks[a->cur];
        if (c->cap - c->used >= bytes) {
            void *r = c->p + c->used;
            c->used += bytes;
            memset(r, 0, bytes);
            return r;
        }
    }
    if (pl_reserve_bytes((void **)&a->chunks, &a->cap, a->n + 1, sizeof(meta_chunk)))
        return NULL;
    size_t cap = bytes > META_CHUNK ? bytes : META_CHUNK;
    uint8_t *p = rekv_host_alloc(a->be, cap);
    if (p == NULL)
        return NULL;
    a->chunks[a->n++] = (meta_chunk){p, cap, bytes, NULL};
    a->cur = a->n - 1;
    memset(p, 0, bytes);
    return p;
}

static void meta_reset(meta_arena *a)
{
    for (size_t i = 0; i < a->n; i++)
        a->chunks[i].used = 0;
    a->cur = 0;
}

void pl_meta_free(meta_arena *a)
{
    for (size_t i = 0; i < a->n; i++) {
        rekv_host_free(a->be, a->chunks[i].p);
        if (a->chunks[i].dev)
            a->be->iface->dev_free(a->be, a->chunks[i].dev);
    }
    free(a->chunks);
    memset(a, 0, sizeof(*a));
}

void *pl_smem_alloc(step_mem *m, size_t bytes)
{
    if (m->failed)
        return NULL;
    void *p = meta_alloc(m->meta, bytes ? bytes : 1);
    if (p == NULL)
        m->failed = 1;
    return p;
}

/* Makes ptr (malloc'd) part of the step's memory. */
int pl_smem_adopt(step_mem *m, void *ptr)
{
    if (ptr == NULL)
        return 0;
    if (pl_reserve_bytes((void **)&m->blocks, &m->cap, m->n + 1, sizeof(void *))) {
        free(ptr);
        m->failed = 1;
        return -ENOMEM;
    }
    m->blocks[m->n++] = ptr;
    return 0;
}

void pl_smem_free(step_mem *m)
{
    for (size_t i = 0; i < m->n; i++)
        free(m->blocks[i]);
    free(m->blocks);
    if (m->meta)
        meta_reset(m->meta);
    memset(m, 0, sizeof(*m));
}

int pl_reserve_bytes(void **v, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap : 256;
    while (nc < need)
        nc *= 2;
    void *nv = realloc(*v, nc * elem);
    if (nv == NULL)
        return -ENOMEM;
    *v = nv;
    *cap = nc;
    return 0;
}

/* Grows b to hold bytes, a quarter more where the device has room for it (a buffer that grows
 * with the context is not made again every step), else exactly. Its contents are not kept: every
 * such buffer is a step's own, sized while the streams are idle, so the old one goes first and
 * the two are never on the device at once. */
int pl_dbuf_ensure(rekv_pipeline *p, dbuf *b, size_t bytes)
{
    if (bytes <= b->cap)
        return 0;
    pl_dbuf_free(p, b);
    size_t want = bytes + bytes / 4;
    void *n = p->bi->dev_alloc(p->be, want);
    if (n == NULL)
        n = p->bi->dev_alloc(p->be, want = bytes);
    if (n == NULL)
        return -ENOMEM;
    b->p = n;
    b->cap = want;
    return 0;
}

void pl_dbuf_free(rekv_pipeline *p, dbuf *b)
{
    if (b->p)
        p->bi->dev_free(p->be, b->p);
    b->p = NULL;
    b->cap = 0;
}

/* dbuf_ensure for a buffer the store imports (push): grown by a new shared buffer; the store drops
 * its import of the old one before it is freed. */
static int dbuf_ensure_shared(rekv_pipeline *p, dbuf *b, rekv_ipc_handle *h, size_t bytes,
                              rekv_err *err)
{
    if (bytes <= b->cap)
        return 0;
    size_t want = bytes + bytes / 4;
    rekv_ipc_handle nh;
    void *n = p->bi->dev_alloc_shared(p->be, want, &nh, err);
    if (n == NULL)
        return -ENOMEM;
    if (b->p) {
        const rekv_ipc_handle *old[] = {h};
        int rc = pl_push_release(p, old, 1, err);
        if (rc) {
            p->bi->dev_free(p->be, n);
            return rc;
        }
        p->bi->dev_free(p->be, b->p);
    }
    b->p = n;
    b->cap = want;
    *h = nh;
    return 0;
}

/* The recomputation's buffers (both parities' activation staging, the fp32 input, the recomputed
 * K and V) for rows context rows of a GPU batch. */
static int recompute_buffers(rekv_pipeline *p, size_t rows)
{
    const rekv_model_config *c = p->c;
    size_t H = (size_t)c->hidden, KV = (size_t)rekv_config_kv_dim(c), f = sizeof(float);
    size_t dsz = p->act_esz;
    return pl_dbuf_ensure(p, &p->par[0].act_stage, rows * H * dsz) |
           pl_dbuf_ensure(p, &p->par[1].act_stage, rows * H * dsz) |
           pl_dbuf_ensure(p, &p->act_f32, rows * H * f) | pl_dbuf_ensure(p, &p->kr, rows * KV * f) |
           pl_dbuf_ensure(p, &p->vr, rows * KV * f);
}

void pl_recompute_free(rekv_pipeline *p)
{
    pl_dbuf_free(p, &p->par[0].act_stage);
    pl_dbuf_free(p, &p->par[1].act_stage);
    pl_dbuf_free(p, &p->act_f32);
    pl_dbuf_free(p, &p->kr);
    pl_dbuf_free(p, &p->vr);
}

/* Lowers the split of step st's items so that no GPU batch recomputes more than rows context
 * rows: each batch's items in order take what is left. kvpr's tokens [device part, split) and
 * infinigen's up to split tokens are then recomputed only in part, and the rest of them come as
 * K,V — which the store keeps for every token in both modes, so the values are the same. */
static void lower_splits(rekv_pipeline *p, step *st, size_t rows)
{
    for (int g = 0; g < st->n_g; g++) {
        size_t left = rows;
        for (int i = st->g_begin[g]; i < st->g_begin[g + 1]; i++) {
            size_t want = pl_item_recompute_rows(p, st, i);
            if (want <= left) {
                left -= want;
                continue;
            }
            const rekv_pseq *s = st->items[i].seq;
            int dev = pl_dev_part(s, s->len);
            /* a prefix split counts from the context's start, a selection's from none */
            st->split[i] = (p->info->split == REKV_SPLIT_PREFIX ? dev : 0) + (int)left;
            left = 0;
        }
    }
}

/* The recomputation's buffers for a step whose GPU batches recompute at most *rows context rows.
 * Where the device cannot hold them and the split is the pipeline's choice (kvpr, infinigen with
 * a split: the modes whose store keeps K,V beside the activations), the rows are seven eighths of
 * the most that fit (bisection) — found once: later steps keep to them, act_rows_cap, unless the
 * device holds no longer even those (the step's other buffers grew with the context: the cap is
 * found again, lower) — and the step's split is lowered to them. 0, or -ENOMEM. */
static int recompute_fit(rekv_pipeline *p, step *st, size_t *rows)
{
    int lowerable = p->keep_act;
    size_t want = *rows, r = want;
    if (lowerable && p->act_rows_cap > 0 && r > p->act_rows_cap)
        r = p->act_rows_cap;
    if (recompute_buffers(p, r) != 0) {
        if (!lowerable)
            return -ENOMEM;
        /* the most rows that fit, to within 1/64: lo fits (0: nothing does), hi does not; the
         * buffers are idle (so are the streams), freed before each try */
        size_t lo = 0, hi = r;
        while (hi - lo > 1 + hi / 64) {
            size_t mid = lo + (hi - lo) / 2;
            pl_recompute_free(p);
            if (recompute_buffers(p, mid) == 0)
                lo = mid;
            else
                hi = mid;
        }
        /* an eighth of them kept back for what kernels allocate as they run (cuda: stream-
         * ordered scratch) */
        pl_recompute_free(p);
        r = lo - lo / 8;
        if (r == 0 || recompute_buffers(p, r) != 0)
            return -ENOMEM;
        if (p->act_rows_cap == 0 || r < p->act_rows_cap)
            rekv_log(REKV_LOG_WARN,
                     "pipeline: the device holds the recomputation of %zu context rows per GPU "
                     "batch, not the %zu the split asks; the rest come as K,V (the same values, "
                     "more bytes on the link)",
                     r, want);
        p->act_rows_cap = r;
    }
    if (r < want)
        lower_splits(p, st, r);
    *rows = r;
    return 0;
}

static int ensure_buffers(rekv_pipeline *p, step *st, rekv_err *err);

/* Sizes every buffer for this step but the recomputation's (pl_ensure_recompute, which sizes those
 * in what is left); called while the streams are idle. Where they do not fit beside the
 * recomputation's buffers of an earlier step (they grow with the context; those took what was
 * left then), those are freed first: pl_ensure_recompute makes them again, lowering the split to
 * what fits now (a longer context used to fail its step where offload still ran). */
int pl_ensure_buffers(rekv_pipeline *p, step *st, rekv_err *err)
{
    if (ensure_buffers(p, st, NULL) == 0)
        return 0;
    pl_recompute_free(p);
    return ensure_buffers(p, st, err);
}

static int ensure_buffers(rekv_pipeline *p, step *st, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    size_t W = (size_t)(c->hidden > c->embed_dim ? c->hidden : c->embed_dim);
    size_t Q = (size_t)rekv_config_q_dim(c), KV = (size_t)rekv_config_kv_dim(c);
    size_t F = (size_t)c->ffn, H = (size_t)c->hidden, f = sizeof(float);
    size_t max_kv_g = 0, max_rows = 0, max_ctx = 1;
    int rc = 0;
    for (int g = 0; g < st->n_g; g++) {
        size_t T = (size_t)st->g_rows[g], ns = (size_t)(st->g_begin[g + 1] - st->g_begin[g]);
        size_t kv_elems = 0, tops = 0;
        for (int i = st->g_begin[g]; i < st->g_begin[g + 1]; i++) {
            size_t tot = (size_t)st->items[i].seq->len + (size_t)st->items[i].n_tokens;
            tops += st->items[i].smp ? (size_t)st->items[i].n_top : 0;
            kv_elems += rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, (int)tot);
            if (tot > max_ctx)
                max_ctx = tot;
            if ((size_t)st->items[i].seq->clo_slots > max_ctx) /* clo: its head caches */
                max_ctx = (size_t)st->items[i].seq->clo_slots;
        }
        if (kv_elems > max_kv_g)
            max_kv_g = kv_elems;
        if (T > max_rows)
            max_rows = T;
        gbatch *b = &p->gb[g];
        rc |= pl_dbuf_ensure(p, &b->x, T * W * f) | pl_dbuf_ensure(p, &b->h, T * W * f) |
              pl_dbuf_ensure(p, &b->q, T * Q * f) | pl_dbuf_ensure(p, &b->k, T * KV * f) |
              pl_dbuf_ensure(p, &b->v, T * KV * f) | pl_dbuf_ensure(p, &b->att, T * Q * f) |
              pl_dbuf_ensure(p, &b->f1, T * F * f) | pl_dbuf_ensure(p, &b->f3, T * F * f) |
              pl_dbuf_ensure(p, &b->logits, ns * (size_t)c->vocab * f) |
              pl_dbuf_ensure(p, &b->picks,
                             8 * (size_t)c->vocab + 4 * ns + 8 * tops + 8 +
                                 sizeof(rekv_sample_lp) * ns);
    }
    /* the attention's scratch for the model's whole context at once (a few KiB): a buffer that
     * grew with the context would change a decode step's arguments, which a graph must repeat */
    rc |= pl_dbuf_ensure(p, &p->scores,
                         (max_ctx > (size_t)c->max_pos ? max_ctx : (size_t)c->max_pos) * f);
    if (p->info->store != REKV_STORE_NONE) {
        for (int b = 0; b < 2; b++) {
            parity *pr = &p->par[b];
            size_t kvb = rekv_kv_off(max_kv_g, c->head_dim, p->kv_rowb);
            if (p->cfg.push) { /* shared with the store, which writes the KV rows */
                rekv_err e = {0};
                int src = dbuf_ensure_shared(p, &pr->attn_kv, &p->h_attn_kv[b], kvb, &e);
                if (src)
                    return rekv_errf(err, src, "step: push attention buffers: %s", e.msg);
            } else {
                rc |= pl_dbuf_ensure(p, &pr->attn_kv, kvb);
            }
            rc |= pl_dbuf_ensure(p, &pr->out_stage, max_rows * H * p->act_esz);
        }
    }
    if (rc)
        return rekv_errf(err, -ENOMEM, "step: out of device memory for a batch of %d sequences",
                         st->n_items);
    return 0;
}

int pl_ensure_recompute(rekv_pipeline *p, step *st, rekv_err *err)
{
    if (p->info->store == REKV_STORE_NONE)
        return 0;
    size_t rows = 1; /* a GPU batch's: only the context it rebuilds (none for offload) */
    for (int g = 0; g < st->n_g; g++) {
        size_t act = 0;
        for (int i = st->g_begin[g]; i < st->g_begin[g + 1]; i++)
            act += pl_item_recompute_rows(p, st, i);
        if (act > rows)
            rows = act;
    }
    if (recompute_fit(p, st, &rows))
        return rekv_errf(err, -ENOMEM,
                         "step: out of device memory for the recomputation of %zu context rows",
                         rows);
    return 0;
}
