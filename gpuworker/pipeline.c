/* pipeline.c — the decode pipeline (see pipeline.h): one forward pass written against the backend
 * and kernel tables, with the KV cache resident on the device or streamed from the kvstore arena.
 *
 * A step runs "units" — one layer of one GPU batch — in row or column order. Three streams:
 *   h2d      weight loads (W_K, W_V first) and the unit's context blocks: KV rows from the arena
 *            straight into the attention buffer, activation rows into staging;
 *   compute  recompute K,V from activations into the attention buffer, the layer;
 *   d2h      the new tokens' K,V (from the attention buffer, where kv_scatter put them in the
 *            blocks' layout) and activations (from staging) -> arena.
 * Attention buffers hold K,V in the cache dtype (fp16 halves device memory and the KV never needs
 * converting; attention widens it), as do resident caches. Staging, attention and output buffers
 * are double-buffered by unit parity, weight buffers by load parity; events order the streams, so
 * loads of unit i+1 overlap the compute of unit i and the stores of unit i-1 (KVPR's Algorithm 1;
 * HybridServe's double-buffered flow).
 *
 * Push (cfg.push): the KV rows do not come by the worker's own copies; the kvstore process writes
 * them (DESIGN.md, "Processes"). The parities' attention buffers are allocated shared
 * (dev_alloc_shared) and ev_attn_free[b] and ev_pushed[b] are shared events; per unit the step
 * thread sends the store one Push request — the buffers' handles, "wait for ev_attn_free[b]",
 * the pieces (arena offset -> buffer, offset), "then record ev_pushed[b]" — and once the store
 * has enqueued them (its reply), the compute stream waits on ev_pushed[b] GPU-side where it would
 * have waited on ev_loaded[b]. Activation rows still come by pull. The CPU never waits on GPU
 * work: the round trip only covers the enqueueing. A regrown attention buffer is released by the
 * store before it is freed. Counters are the same as pull's: the same bytes cross the link.
 *
 * Small per-step metadata (token ids, positions, attention descriptors, copy lists) lives in host
 * memory that kernels read directly: on the cpu backend that is device memory; the cuda backend
 * maps it (cudaHostAlloc mapped). */
#include "gpuworker/pipeline.h"

#include <errno.h>
#include <sys/random.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "gpuworker/engine_internal.h"
#include "gpuworker/kernels.h"

/* ------------------------------------------------------------------ small helpers */

static int reserve_bytes(void **v, size_t *cap, size_t need, size_t elem);

/* A grow-only device buffer (reallocated only between steps, after the streams are idle). */
typedef struct dbuf {
    void *p;
    size_t cap;
} dbuf;

/* Memory kernels read directly (positions, descriptors, convert lists): chunks of the backend's
 * host_alloc memory (pinned and mapped on cuda; malloc on cpu), kept across steps and handed out
 * again from the start of each step. */
typedef struct meta_chunk {
    uint8_t *p;
    size_t cap, used;
} meta_chunk;

typedef struct meta_arena {
    rekv_backend *be;
    meta_chunk *chunks;
    size_t n, cap;
    size_t cur; /* the chunk being handed out */
} meta_arena;

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
    if (reserve_bytes((void **)&a->chunks, &a->cap, a->n + 1, sizeof(meta_chunk)))
        return NULL;
    size_t cap = bytes > META_CHUNK ? bytes : META_CHUNK;
    uint8_t *p = rekv_host_alloc(a->be, cap);
    if (p == NULL)
        return NULL;
    a->chunks[a->n++] = (meta_chunk){p, cap, bytes};
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

static void meta_free(meta_arena *a)
{
    for (size_t i = 0; i < a->n; i++)
        rekv_host_free(a->be, a->chunks[i].p);
    free(a->chunks);
    memset(a, 0, sizeof(*a));
}

/* One step's memory: metadata from the arena, and host-only lists (copy pieces, which the backend
 * copies at enqueue) adopted from malloc; all of it released when the step ends. */
typedef struct step_mem {
    meta_arena *meta;
    void **blocks; /* adopted malloc'd lists */
    size_t n, cap;
    int failed;
} step_mem;

static void *smem_alloc(step_mem *m, size_t bytes)
{
    if (m->failed)
        return NULL;
    void *p = meta_alloc(m->meta, bytes ? bytes : 1);
    if (p == NULL)
        m->failed = 1;
    return p;
}

/* Makes ptr (malloc'd) part of the step's memory. */
static int smem_adopt(step_mem *m, void *ptr)
{
    if (ptr == NULL)
        return 0;
    if (reserve_bytes((void **)&m->blocks, &m->cap, m->n + 1, sizeof(void *))) {
        free(ptr);
        m->failed = 1;
        return -ENOMEM;
    }
    m->blocks[m->n++] = ptr;
    return 0;
}

static void smem_free(step_mem *m)
{
    for (size_t i = 0; i < m->n; i++)
        free(m->blocks[i]);
    free(m->blocks);
    if (m->meta)
        meta_reset(m->meta);
    memset(m, 0, sizeof(*m));
}

/* A growable array of copy pieces (host side, kept until the step ends). */
typedef struct piece_list {
    rekv_copy_piece *v;
    size_t n, cap;
} piece_list;

typedef struct conv_list {
    rekv_convert_piece *v;
    size_t n, cap;
} conv_list;

/* Makes room for `more` entries; 0 or -ENOMEM. */
#define RESERVE(list, more)                                                                        \
    reserve_bytes((void **)&(list)->v, &(list)->cap, (list)->n + (more), sizeof(*(list)->v))

static int reserve_bytes(void **v, size_t *cap, size_t need, size_t elem)
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

/* ------------------------------------------------------------------ the pipeline */

enum { MAX_GPU_BATCHES = 64 };

/* Buffers of one GPU batch, alive for a whole step. Sizes in rows T of the batch. */
typedef struct gbatch {
    dbuf x;      /* [T][max(hidden, embed)] residual stream */
    dbuf h;      /* [T][max(hidden, embed)] attention / FFN input */
    dbuf q;      /* [T][q_dim] */
    dbuf k, v;   /* [T][kv_dim] new rows */
    dbuf att;    /* [T][q_dim] */
    dbuf f1, f3; /* [T][ffn] */
    dbuf logits; /* [n_seqs][vocab] */
} gbatch;

/* Buffers of one unit parity. */
typedef struct parity {
    dbuf attn_kv;   /* attention buffers: per sequence its context's blocks (kvlayout.h), back
                       to back, in the cache dtype */
    dbuf act_stage; /* context activation rows as stored */
    dbuf out_stage; /* the new rows' attention input to store, [T][hidden] (cache dtype) */
} parity;

struct rekv_pipeline {
    rekv_engine *e;
    const rekv_model_config *c;
    rekv_backend *be;
    const rekv_backend_iface *bi;
    const rekv_kernel_iface *k;
    rekv_kvstore_client *store;
    rekv_kv_geometry geo;
    uint8_t *arena;
    rekv_pipeline_config cfg;
    rekv_stream *s_compute, *s_h2d, *s_d2h;
    /* by unit parity: activations / KV rows loaded, staging merged, new rows staged, stored */
    rekv_event *ev_act[2], *ev_loaded[2], *ev_stage_free[2], *ev_out[2], *ev_out_free[2];
    rekv_event *ev_attn_free[2]; /* the unit's attention has read the parity's buffers */
    /* by weight-buffer parity: W_K,W_V loaded, all loaded, buffer free again */
    rekv_event *ev_wkv[2], *ev_wall[2], *ev_wfree[2];
    layer_w *dev_layers; /* resident weights: [n_layers] device copies; NULL when offloaded */
    layer_w wbuf[2];     /* offloaded weights: two device layer buffers */
    void *wbuf_mem[2];
    void *d_embed, *d_proj_in, *d_proj_out, *d_head; /* matrices, in the engine's wdtype */
    float *d_pos, *d_fnorm_w, *d_fnorm_b;
    int head_tied;
    gbatch gb[MAX_GPU_BATCHES];
    parity par[2];
    dbuf act_f32;                  /* recomputation input rows [n][hidden] fp32 */
    dbuf kr, vr;                   /* recomputed K, V rows [n][kv_dim] */
    dbuf scores;                   /* attention scratch [max context] */
    rekv_layer_counters *counters; /* [n_layers] */
    rekv_layer_counters *step_log; /* [n_steps] each step's totals since the last reset */
    size_t n_steps, cap_steps;
    rekv_layer_counters logged; /* the totals at the end of the last logged step */
    uint64_t next_id;
    rekv_kv_plan_block *plan;
    size_t plan_n, plan_cap;
    meta_arena meta;        /* per-step metadata kernels read (see meta_alloc) */
    int arena_registered;   /* the backend page-locked the arena (host_register) */
    int weights_registered; /* ... and the engine's layer blocks (offloaded weights) */
    size_t arena_bytes;
    /* push: handles of the shared attention buffers and events; the store pushes KV rows */
    rekv_ipc_handle h_attn_kv[2], h_attn_free[2], h_pushed[2];
    rekv_event *ev_pushed[2]; /* the store's copies into the parity's buffers are done */
    rekv_kv_push_piece *push_pieces;
    size_t push_cap;
};

struct rekv_pseq {
    rekv_pipeline *p;
    uint64_t id; /* kvstore sequence (kvpr: id holds K,V and id + 1 the activations) */
    int len, cap;
    uint8_t *kv;      /* resident: [n_layers] caches of cap positions (kvlayout.h), cache dtype */
    uint8_t *act_dev; /* ACT_GPU: [n_layers][act_gpu_blocks * 16][hidden] in the cache dtype */
};

/* the device's KV buffers have the store's block layout (kvlayout.h), so blocks copy whole */
_Static_assert(REKV_KV_BLOCK_TOKENS == REKV_KV_ROWS_PER_BLOCK, "one block size");

void rekv_pipeline_config_defaults(rekv_pipeline_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->mode = REKV_MODE_RESIDENT;
    cfg->schedule = REKV_SCHED_ROW;
    cfg->gpu_batches = 1;
    cfg->split = 0;
    cfg->kv_parts = 1;
    cfg->act_parts = 1;
    cfg->cache_dtype = REKV_DTYPE_F32;
}

const rekv_pipeline_config *rekv_pipeline_get_config(const rekv_pipeline *p)
{
    return &p->cfg;
}

static int dbuf_ensure(rekv_pipeline *p, dbuf *b, size_t bytes)
{
    if (bytes <= b->cap)
        return 0;
    size_t want = bytes + bytes / 4;
    void *n = p->bi->dev_alloc(p->be, want);
    if (n == NULL)
        return -ENOMEM;
    if (b->p)
        p->bi->dev_free(p->be, b->p);
    b->p = n;
    b->cap = want;
    return 0;
}

static void dbuf_free(rekv_pipeline *p, dbuf *b)
{
    if (b->p)
        p->bi->dev_free(p->be, b->p);
    b->p = NULL;
    b->cap = 0;
}

/* push: the store drops its imports of these handles (before the buffers are freed) */
static int push_release(rekv_pipeline *p, const rekv_ipc_handle *const *h, size_t n, rekv_err *err)
{
    const void *hs[8];
    size_t k = 0;
    for (size_t i = 0; i < n && k < 8; i++)
        if (h[i]->magic == REKV_IPC_MAGIC)
            hs[k++] = h[i];
    return k ? rekv_kvstore_release(p->store, hs, k, err) : 0;
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
        int rc = push_release(p, old, 1, err);
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

/* A layer's tensors in load order — W_K and W_V (with biases) first, so recomputation can start
 * before the rest arrives (KVPR §3.3). n_first: how many of them are the K/V group. */
enum { N_LAYER_TENSORS = 17, N_KV_TENSORS = 4 };

static void layer_tensors(const rekv_engine *e, layer_w *L, void ***slots, size_t *bytes)
{
    const rekv_model_config *c = &e->c;
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c);
    size_t KV = (size_t)rekv_config_kv_dim(c), F = (size_t)c->ffn;
    size_t w = rekv_dtype_size(e->wdtype), f = sizeof(float); /* matrices, vectors */
    void **s[N_LAYER_TENSORS] = {
        &L->wk, &L->bk, &L->wv,          &L->bv,          &L->wq,         &L->bq,
        &L->wo, &L->bo, &L->attn_norm_w, &L->attn_norm_b, &L->ffn_norm_w, &L->ffn_norm_b,
        &L->w1, &L->b1, &L->w3,          &L->w2,          &L->b2};
    size_t n[N_LAYER_TENSORS] = {KV * H * w, KV * f, KV * H * w, KV * f,    Q * H * w, Q * f,
                                 H * Q * w,  H * f,  H * f,      H * f,     H * f,     H * f,
                                 F * H * w,  F * f,  F * H * w,  H * F * w, H * f};
    memcpy(slots, s, sizeof(s));
    memcpy(bytes, n, sizeof(n));
}

/* Points dst's fields into mem laid out in load order, for the tensors src has. Returns bytes. */
static size_t layer_layout(const rekv_engine *e, const layer_w *src, layer_w *dst, char *mem)
{
    void **ss[N_LAYER_TENSORS], **ds[N_LAYER_TENSORS];
    size_t n[N_LAYER_TENSORS], off = 0;
    layer_tensors(e, (layer_w *)src, ss, n);
    layer_tensors(e, dst, ds, n);
    for (int i = 0; i < N_LAYER_TENSORS; i++) {
        if (*ss[i] == NULL) {
            *ds[i] = NULL;
            continue;
        }
        *ds[i] = mem ? mem + off : NULL;
        off += (n[i] + 63) & ~(size_t)63;
    }
    return off;
}

/* Enqueues host->device copies of a layer's tensors [from, to) in load order. Returns bytes. */
static size_t copy_layer(rekv_pipeline *p, rekv_stream *s, const layer_w *src, layer_w *dst,
                         int from, int to)
{
    void **ss[N_LAYER_TENSORS], **ds[N_LAYER_TENSORS];
    size_t n[N_LAYER_TENSORS], bytes = 0;
    rekv_copy_piece pieces[N_LAYER_TENSORS];
    size_t np = 0;
    layer_tensors(p->e, (layer_w *)src, ss, n);
    layer_tensors(p->e, dst, ds, n);
    for (int i = from; i < to; i++)
        if (*ss[i]) {
            pieces[np++] = (rekv_copy_piece){*ds[i], *ss[i], n[i]};
            bytes += n[i];
        }
    if (np)
        p->bi->copy_h2d(s, pieces, np, REKV_XFER_WEIGHTS);
    return bytes;
}

static void *dev_copy(rekv_pipeline *p, const void *src, size_t bytes, int *rc)
{
    if (src == NULL || *rc)
        return NULL;
    void *d = p->bi->dev_alloc(p->be, bytes);
    if (d == NULL) {
        *rc = -ENOMEM;
        return NULL;
    }
    rekv_copy_piece pc = {d, src, bytes};
    p->bi->copy_h2d(p->s_h2d, &pc, 1, REKV_XFER_WEIGHTS);
    return d;
}

void rekv_pipeline_free(rekv_pipeline *p)
{
    if (p == NULL)
        return;
    if (p->s_h2d)
        p->bi->stream_sync(p->s_h2d, NULL);
    if (p->s_compute)
        p->bi->stream_sync(p->s_compute, NULL);
    if (p->s_d2h)
        p->bi->stream_sync(p->s_d2h, NULL);
    if (p->dev_layers) {
        for (int l = 0; l < p->c->n_layers; l++) {
            void **ds[N_LAYER_TENSORS];
            size_t n[N_LAYER_TENSORS];
            layer_tensors(p->e, &p->dev_layers[l], ds, n);
            for (int i = 0; i < N_LAYER_TENSORS; i++)
                if (*ds[i])
                    p->bi->dev_free(p->be, *ds[i]);
        }
        free(p->dev_layers);
    }
    if (p->cfg.push && p->store) { /* the store lets go of our buffers and events first */
        const rekv_ipc_handle *hs[] = {&p->h_attn_kv[0],   &p->h_attn_kv[1], &p->h_attn_free[0],
                                       &p->h_attn_free[1], &p->h_pushed[0],  &p->h_pushed[1]};
        push_release(p, hs, 6, NULL);
    }
    for (int i = 0; i < 2; i++) {
        if (p->wbuf_mem[i])
            p->bi->dev_free(p->be, p->wbuf_mem[i]);
        dbuf_free(p, &p->par[i].attn_kv);
        dbuf_free(p, &p->par[i].act_stage);
        dbuf_free(p, &p->par[i].out_stage);
    }
    for (int g = 0; g < MAX_GPU_BATCHES; g++) {
        dbuf *b = (dbuf *)&p->gb[g];
        for (size_t i = 0; i < sizeof(gbatch) / sizeof(dbuf); i++)
            dbuf_free(p, &b[i]);
    }
    dbuf_free(p, &p->act_f32);
    dbuf_free(p, &p->kr);
    dbuf_free(p, &p->vr);
    dbuf_free(p, &p->scores);
    void *ds[] = {p->d_embed, p->d_pos, p->d_proj_in, p->d_proj_out, p->d_fnorm_w, p->d_fnorm_b};
    for (size_t i = 0; i < sizeof(ds) / sizeof(ds[0]); i++)
        if (ds[i])
            p->bi->dev_free(p->be, ds[i]);
    if (p->d_head && !p->head_tied)
        p->bi->dev_free(p->be, p->d_head);
    rekv_event **evs[] = {p->ev_attn_free, p->ev_act, p->ev_loaded, p->ev_stage_free, p->ev_out,
                          p->ev_out_free,  p->ev_wkv, p->ev_wall,   p->ev_wfree,      p->ev_pushed};
    for (size_t i = 0; i < sizeof(evs) / sizeof(evs[0]); i++)
        for (int j = 0; j < 2; j++)
            if (evs[i][j])
                p->bi->event_destroy(evs[i][j]);
    free(p->push_pieces);
    if (p->s_compute)
        p->bi->stream_destroy(p->s_compute);
    if (p->s_h2d)
        p->bi->stream_destroy(p->s_h2d);
    if (p->s_d2h)
        p->bi->stream_destroy(p->s_d2h);
    if (p->arena_registered && p->bi->host_unregister)
        p->bi->host_unregister(p->be, p->arena);
    for (int l = 0; l < p->weights_registered; l++)
        p->bi->host_unregister(p->be, p->e->layer_mem[l]);
    free(p->counters);
    free(p->step_log);
    meta_free(&p->meta);
    free(p->plan);
    free(p);
}

int rekv_pipeline_create(rekv_engine *e, rekv_backend *be, rekv_kvstore_client *store,
                         const rekv_pipeline_config *cfg, rekv_pipeline **out, rekv_err *err)
{
    const rekv_model_config *c = rekv_engine_config(e);
    if (cfg->mode != REKV_MODE_RESIDENT && store == NULL)
        return rekv_errf(err, -EINVAL, "pipeline: mode %s needs a kvstore",
                         rekv_mode_name(cfg->mode));
    if (cfg->gpu_batches < 1 || cfg->gpu_batches > MAX_GPU_BATCHES)
        return rekv_errf(err, -EINVAL, "pipeline: gpu batches must be 1..%d", MAX_GPU_BATCHES);
    if (cfg->cache_dtype != REKV_DTYPE_F32 && cfg->cache_dtype != REKV_DTYPE_F16)
        return rekv_errf(err, -EINVAL, "pipeline: the cache dtype must be F32 or F16");
    if (cfg->mode == REKV_MODE_KVPR && cfg->split < 0)
        return rekv_errf(err, -EINVAL, "pipeline: kvpr needs a split >= 0");
    if (cfg->mode == REKV_MODE_HYBRID &&
        (cfg->kv_parts < 0 || cfg->act_parts < 0 || cfg->kv_parts + cfg->act_parts == 0))
        return rekv_errf(err, -EINVAL, "pipeline: hybrid needs a kv:act pattern like 1:1");
    if (cfg->act_gpu_blocks < 0)
        return rekv_errf(err, -EINVAL, "pipeline: act_gpu_blocks must not be negative");
    if (rekv_kernels_of(be) == NULL)
        return rekv_errf(err, -EINVAL, "pipeline: backend %s has no kernels", be->iface->name);
    if (cfg->push && cfg->mode == REKV_MODE_RESIDENT)
        return rekv_errf(err, -EINVAL, "pipeline: push needs a mode that streams the KV cache");
    if (cfg->push && !rekv_backend_has_ipc(be))
        return rekv_errf(err, -ENOTSUP, "pipeline: push: backend %s cannot share buffers",
                         be->iface->name);
    if (cfg->push) { /* a cheap request: can the store push, and with our kind of handles? */
        char name[16] = "";
        rekv_err perr = {0};
        int prc = rekv_kvstore_push(store, NULL, 0, NULL, NULL, NULL, 0, name, sizeof(name), &perr);
        if (prc)
            return rekv_errf(err, prc, "pipeline: push: %s", perr.msg);
        if (strcmp(name, be->iface->name) != 0)
            return rekv_errf(err, -ENOTSUP,
                             "pipeline: push: the kvstore pushes with the %s backend, this worker "
                             "runs %s",
                             name, be->iface->name);
    }
    rekv_pipeline *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return rekv_errf(err, -ENOMEM, "pipeline: out of memory");
    int rc = 0;
    p->e = e;
    p->c = c;
    p->be = be;
    p->bi = be->iface;
    p->k = rekv_kernels_of(be);
    p->store = store;
    p->cfg = *cfg;
    p->meta.be = be;
    /* kvstore sequence ids are the caller's to choose and the store may outlive this pipeline
     * (a restarted worker, a second one): start at a random even base so that ids never meet */
    uint64_t base = 0;
    if (getrandom(&base, sizeof(base), 0) != (ssize_t)sizeof(base))
        base = rekv_now_ns() ^ ((uint64_t)getpid() << 32);
    p->next_id = (base & ~(uint64_t)1) | 2; /* even, never 0; kvpr uses id and id + 1 */
    p->counters = calloc((size_t)c->n_layers, sizeof(rekv_layer_counters));
    if (p->counters == NULL) {
        rc = rekv_errf(err, -ENOMEM, "pipeline: out of memory");
        goto fail;
    }
    if (store) {
        size_t bytes;
        p->arena = rekv_kvstore_client_arena(store, &bytes);
        p->arena_bytes = bytes;
        /* copies straight from the shared arena: page-locked where the backend can (cuda) */
        if (p->bi->host_register && p->bi->host_register(be, p->arena, bytes, err) == 0)
            p->arena_registered = 1;
        rekv_err_clear(err); /* unregistered only costs overlap, not correctness */
        rekv_kvstore_client_geometry(store, &p->geo);
        if (p->geo.n_layers != (uint32_t)c->n_layers ||
            p->geo.n_kv_heads != (uint32_t)c->n_kv_heads ||
            p->geo.head_dim != (uint32_t)c->head_dim || p->geo.hidden != (uint32_t)c->hidden ||
            p->geo.dtype != cfg->cache_dtype) {
            rc = rekv_errf(
                err, -EINVAL,
                "pipeline: the kvstore's block geometry (%u layers, %u kv heads, head dim "
                "%u, hidden %u, %s) does not match the model and cache dtype",
                p->geo.n_layers, p->geo.n_kv_heads, p->geo.head_dim, p->geo.hidden,
                rekv_dtype_name(p->geo.dtype));
            goto fail;
        }
    }
    if ((rc = p->bi->stream_create(be, "compute", &p->s_compute, err)) ||
        (rc = p->bi->stream_create(be, "h2d", &p->s_h2d, err)) ||
        (rc = p->bi->stream_create(be, "d2h", &p->s_d2h, err)))
        goto fail;
    rekv_event **evs[] = {p->ev_attn_free, p->ev_act, p->ev_loaded, p->ev_stage_free, p->ev_out,
                          p->ev_out_free,  p->ev_wkv, p->ev_wall,   p->ev_wfree};
    for (size_t i = 0; i < sizeof(evs) / sizeof(evs[0]); i++)
        for (int j = 0; j < 2; j++)
            if ((rc = (cfg->push && i == 0 ? p->bi->event_create_shared
                                           : p->bi->event_create)(be, &evs[i][j], err)))
                goto fail;
    for (int j = 0; j < 2 && cfg->push; j++) /* the store waits on ev_attn_free, records pushed */
        if ((rc = p->bi->event_create_shared(be, &p->ev_pushed[j], err)) ||
            (rc = p->bi->event_export(p->ev_attn_free[j], &p->h_attn_free[j], err)) ||
            (rc = p->bi->event_export(p->ev_pushed[j], &p->h_pushed[j], err)))
            goto fail;
    /* weights on the device: the model's non-layer tensors always; layers unless offloaded */
    size_t V = (size_t)c->vocab, E = (size_t)c->embed_dim, H = (size_t)c->hidden;
    size_t w = rekv_dtype_size(e->wdtype), f = sizeof(float);
    p->d_embed = dev_copy(p, e->embed, V * E * w, &rc);
    p->d_pos = dev_copy(p, e->pos_embed, ((size_t)c->max_pos + 2) * H * f, &rc);
    p->d_proj_in = dev_copy(p, e->project_in, H * E * w, &rc);
    p->d_proj_out = dev_copy(p, e->project_out, E * H * w, &rc);
    p->d_fnorm_w = dev_copy(p, e->final_norm_w, H * f, &rc);
    p->d_fnorm_b = dev_copy(p, e->final_norm_b, H * f, &rc);
    p->head_tied = e->lm_head == e->embed;
    p->d_head = p->head_tied ? p->d_embed : dev_copy(p, e->lm_head, V * E * w, &rc);
    if (rc == 0 && cfg->offload_weights && p->bi->host_register && p->bi->host_unregister) {
        /* the layers stream from the engine's blocks every step: page-locked where the backend
         * can, so the copies are DMA at the link's speed and overlap compute (best effort: a
         * second pipeline on the same engine finds them registered already and copies anyway) */
        int l = 0;
        while (l < c->n_layers &&
               p->bi->host_register(be, e->layer_mem[l], e->layer_bytes, err) == 0)
            l++;
        rekv_err_clear(err);
        if (l < c->n_layers)
            while (l > 0)
                p->bi->host_unregister(be, e->layer_mem[--l]);
        p->weights_registered = l;
    }
    if (rc == 0 && cfg->offload_weights) {
        size_t bytes = layer_layout(e, &e->layers[0], &p->wbuf[0], NULL);
        for (int i = 0; i < 2 && rc == 0; i++) {
            p->wbuf_mem[i] = p->bi->dev_alloc(be, bytes);
            if (p->wbuf_mem[i] == NULL)
                rc = -ENOMEM;
            else
                layer_layout(e, &e->layers[0], &p->wbuf[i], p->wbuf_mem[i]);
        }
    } else if (rc == 0) {
        p->dev_layers = calloc((size_t)c->n_layers, sizeof(layer_w));
        if (p->dev_layers == NULL)
            rc = -ENOMEM;
        for (int l = 0; l < c->n_layers && rc == 0; l++) {
            void **ss[N_LAYER_TENSORS], **ds[N_LAYER_TENSORS];
            size_t n[N_LAYER_TENSORS];
            layer_tensors(e, &e->layers[l], ss, n);
            layer_tensors(e, &p->dev_layers[l], ds, n);
            for (int i = 0; i < N_LAYER_TENSORS && rc == 0; i++)
                *ds[i] = dev_copy(p, *ss[i], n[i], &rc);
        }
    }
    if (rc) {
        rekv_errf(err, rc, "pipeline: out of device memory for the weights");
        goto fail;
    }
    if ((rc = p->bi->stream_sync(p->s_h2d, err)))
        goto fail;
    p->bi->stats_reset(be); /* the one-time weight upload is not part of any step */
    *out = p;
    return 0;
fail:
    rekv_pipeline_free(p);
    return rc;
}

/* ------------------------------------------------------------------ sequences */

int rekv_pseq_create(rekv_pipeline *p, int capacity, rekv_pseq **out, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    if (capacity <= 0 || capacity > c->max_pos)
        return rekv_errf(err, -E2BIG, "sequence capacity %d is outside the model's context (1..%d)",
                         capacity, c->max_pos);
    rekv_pseq *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    s->p = p;
    s->cap = capacity;
    int rc = 0;
    if (p->cfg.mode == REKV_MODE_RESIDENT) {
        size_t n = (size_t)c->n_layers * rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, capacity);
        s->kv = p->bi->dev_alloc(p->be, n * rekv_dtype_size(p->cfg.cache_dtype));
        if (s->kv == NULL) {
            rc = rekv_errf(err, -ENOMEM, "out of device memory for a KV cache of %d tokens",
                           capacity);
            goto fail;
        }
    } else {
        if (p->cfg.act_gpu_blocks > 0 && p->cfg.mode != REKV_MODE_OFFLOAD) {
            size_t n = (size_t)c->n_layers * (size_t)p->cfg.act_gpu_blocks * REKV_KV_BLOCK_TOKENS *
                       (size_t)c->hidden * rekv_dtype_size(p->cfg.cache_dtype);
            s->act_dev = p->bi->dev_alloc(p->be, n);
            if (s->act_dev == NULL) {
                rc = rekv_errf(err, -ENOMEM, "out of device memory for %d ACT blocks per layer",
                               p->cfg.act_gpu_blocks);
                goto fail;
            }
        }
        s->id = p->next_id;
        p->next_id += 2;
        if ((rc = rekv_kvstore_seq_create(p->store, s->id, err)))
            goto fail;
        if (p->cfg.mode == REKV_MODE_KVPR &&
            (rc = rekv_kvstore_seq_create(p->store, s->id + 1, err))) {
            rekv_kvstore_seq_drop(p->store, s->id, NULL);
            goto fail;
        }
    }
    *out = s;
    return 0;
fail:
    if (s->kv)
        p->bi->dev_free(p->be, s->kv);
    if (s->act_dev)
        p->bi->dev_free(p->be, s->act_dev);
    free(s);
    return rc;
}

void rekv_pseq_free(rekv_pseq *s)
{
    if (s == NULL)
        return;
    rekv_pipeline *p = s->p;
    if (s->kv)
        p->bi->dev_free(p->be, s->kv);
    if (s->act_dev)
        p->bi->dev_free(p->be, s->act_dev);
    if (p->cfg.mode != REKV_MODE_RESIDENT) {
        rekv_kvstore_seq_drop(p->store, s->id, NULL);
        if (p->cfg.mode == REKV_MODE_KVPR)
            rekv_kvstore_seq_drop(p->store, s->id + 1, NULL);
    }
    free(s);
}

int rekv_pseq_len(const rekv_pseq *s)
{
    return s->len;
}

const rekv_layer_counters *rekv_pipeline_counters(const rekv_pipeline *p, rekv_layer_counters *t)
{
    if (t) {
        memset(t, 0, sizeof(*t));
        for (int l = 0; l < p->c->n_layers; l++) {
            const rekv_layer_counters *c = &p->counters[l];
            for (int k = 0; k < REKV_XFER_KINDS; k++) {
                t->h2d_bytes[k] += c->h2d_bytes[k];
                t->d2h_bytes[k] += c->d2h_bytes[k];
            }
            t->tokens_recomputed += c->tokens_recomputed;
            t->tokens_fetched += c->tokens_fetched;
        }
    }
    return p->counters;
}

const rekv_layer_counters *rekv_pipeline_step_counters(const rekv_pipeline *p, size_t *n_steps)
{
    *n_steps = p->n_steps;
    return p->step_log;
}

void rekv_pipeline_counters_reset(rekv_pipeline *p)
{
    p->n_steps = 0;
    memset(&p->logged, 0, sizeof(p->logged));
    memset(p->counters, 0, sizeof(rekv_layer_counters) * (size_t)p->c->n_layers);
}

/* ------------------------------------------------------------------ one step */

/* What the kvstore plan says about one (item, layer): where its blocks are. The plan's blocks of
 * a range [0, end) come in order, so block b of the range is blocks[first + b]. */
typedef struct range_ref {
    size_t first; /* index into the plan of the range's block 0 */
    size_t count;
} range_ref;

typedef struct step {
    rekv_pipe_item *items;
    int n_items;
    int n_g;                          /* GPU batches */
    int g_begin[MAX_GPU_BATCHES + 1]; /* items of batch g: [g_begin[g], g_begin[g+1]) */
    int g_rows[MAX_GPU_BATCHES];      /* new rows of batch g */
    int *row0;                        /* [n_items] first row of the item within its batch */
    int32_t *tok[MAX_GPU_BATCHES], *pos[MAX_GPU_BATCHES]; /* [rows] */
    int32_t *row_seq[MAX_GPU_BATCHES];                    /* [rows] item index within the batch */
    int32_t *last[MAX_GPU_BATCHES]; /* [items of batch] index of each item's last row */
    range_ref *kv_ref, *act_ref;    /* [n_items][n_layers]; act_ref only for kvpr */
    int *split;                     /* [n_items] context tokens recomputed (kvpr) */
    step_mem mem;
} step;

static const rekv_kv_plan_block *block_at(rekv_pipeline *p, const range_ref *r, int token)
{
    size_t b = (size_t)token / REKV_KV_BLOCK_TOKENS;
    return b < r->count ? &p->plan[r->first + b] : NULL;
}

static int store_ranges(rekv_pipeline *p, step *st, rekv_kv_range **out, size_t *n_out)
{
    int L = p->c->n_layers, kvpr = p->cfg.mode == REKV_MODE_KVPR;
    size_t n = (size_t)st->n_items * (size_t)L * (kvpr ? 2 : 1);
    rekv_kv_range *r = smem_alloc(&st->mem, n * sizeof(*r));
    if (r == NULL)
        return -ENOMEM;
    size_t i = 0;
    for (int it = 0; it < st->n_items; it++) {
        rekv_pseq *s = st->items[it].seq;
        uint64_t end = (uint64_t)s->len + (uint64_t)st->items[it].n_tokens;
        for (int l = 0; l < L; l++) {
            r[i++] = (rekv_kv_range){s->id, (uint32_t)l, 0, end};
            if (kvpr)
                r[i++] = (rekv_kv_range){s->id + 1, (uint32_t)l, 0, end};
        }
    }
    *out = r;
    *n_out = n;
    return 0;
}

/* Appends the step's new tokens to the store, then one plan round trip pins every block of every
 * (sequence, layer) the step reads or writes. */
static int store_prepare(rekv_pipeline *p, step *st, rekv_kv_range **ranges, size_t *n_ranges,
                         rekv_err *err)
{
    int rc, L = p->c->n_layers, kvpr = p->cfg.mode == REKV_MODE_KVPR;
    uint32_t kv = 1, act = 0; /* offload: all KV */
    if (p->cfg.mode == REKV_MODE_ACT)
        kv = 0, act = 1;
    else if (p->cfg.mode == REKV_MODE_HYBRID)
        kv = (uint32_t)p->cfg.kv_parts, act = (uint32_t)p->cfg.act_parts;
    for (int it = 0; it < st->n_items; it++) {
        rekv_pseq *s = st->items[it].seq;
        uint64_t after;
        if ((rc = rekv_kvstore_append(p->store, s->id, (uint64_t)st->items[it].n_tokens, kv, act,
                                      &after, err)))
            return rc;
        if (kvpr && (rc = rekv_kvstore_append(p->store, s->id + 1, (uint64_t)st->items[it].n_tokens,
                                              0, 1, &after, err)))
            return rc;
    }
    if ((rc = store_ranges(p, st, ranges, n_ranges)))
        return rekv_errf(err, rc, "pipeline: out of memory");
    if ((rc = rekv_kvstore_plan(p->store, *ranges, *n_ranges, 1, &p->plan, &p->plan_n, &p->plan_cap,
                                err)))
        return rc;
    /* index the plan by range */
    size_t per_item = (size_t)L * (kvpr ? 2 : 1);
    st->kv_ref = smem_alloc(&st->mem, sizeof(range_ref) * (size_t)st->n_items * (size_t)L);
    st->act_ref = smem_alloc(&st->mem, sizeof(range_ref) * (size_t)st->n_items * (size_t)L);
    if (st->kv_ref == NULL || st->act_ref == NULL)
        return rekv_errf(err, -ENOMEM, "pipeline: out of memory");
    size_t bi = 0;
    for (size_t r = 0; r < *n_ranges; r++) {
        size_t first = bi;
        while (bi < p->plan_n && p->plan[bi].range == r)
            bi++;
        int item = (int)(r / per_item), l = (int)((r % per_item) / (kvpr ? 2 : 1));
        range_ref ref = {first, bi - first};
        if (kvpr && r % 2 == 1)
            st->act_ref[item * L + l] = ref;
        else
            st->kv_ref[item * L + l] = ref;
        uint64_t end = (*ranges)[r].token_end;
        if (ref.count != (end + REKV_KV_BLOCK_TOKENS - 1) / REKV_KV_BLOCK_TOKENS)
            return rekv_errf(err, -EPROTO,
                             "pipeline: the kvstore's plan for sequence %llu layer "
                             "%d has %zu blocks for %llu tokens",
                             (unsigned long long)(*ranges)[r].seq, l, ref.count,
                             (unsigned long long)end);
    }
    return 0;
}

/* Sizes every buffer for this step; called while the streams are idle. */
static int ensure_buffers(rekv_pipeline *p, step *st, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    size_t W = (size_t)(c->hidden > c->embed_dim ? c->hidden : c->embed_dim);
    size_t Q = (size_t)rekv_config_q_dim(c), KV = (size_t)rekv_config_kv_dim(c);
    size_t F = (size_t)c->ffn, H = (size_t)c->hidden, f = sizeof(float);
    size_t dsz = rekv_dtype_size(p->cfg.cache_dtype);
    size_t max_ctx_g = 0, max_kv_g = 0, max_rows = 0, max_ctx = 1;
    int rc = 0;
    for (int g = 0; g < st->n_g; g++) {
        size_t T = (size_t)st->g_rows[g], ns = (size_t)(st->g_begin[g + 1] - st->g_begin[g]);
        size_t ctx = 0, kv_elems = 0;
        for (int i = st->g_begin[g]; i < st->g_begin[g + 1]; i++) {
            size_t tot = (size_t)st->items[i].seq->len + (size_t)st->items[i].n_tokens;
            ctx += tot;
            kv_elems += rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, (int)tot);
            if (tot > max_ctx)
                max_ctx = tot;
        }
        if (ctx > max_ctx_g)
            max_ctx_g = ctx;
        if (kv_elems > max_kv_g)
            max_kv_g = kv_elems;
        if (T > max_rows)
            max_rows = T;
        gbatch *b = &p->gb[g];
        rc |= dbuf_ensure(p, &b->x, T * W * f) | dbuf_ensure(p, &b->h, T * W * f) |
              dbuf_ensure(p, &b->q, T * Q * f) | dbuf_ensure(p, &b->k, T * KV * f) |
              dbuf_ensure(p, &b->v, T * KV * f) | dbuf_ensure(p, &b->att, T * Q * f) |
              dbuf_ensure(p, &b->f1, T * F * f) | dbuf_ensure(p, &b->f3, T * F * f) |
              dbuf_ensure(p, &b->logits, ns * (size_t)c->vocab * f);
    }
    rc |= dbuf_ensure(p, &p->scores, max_ctx * f);
    if (p->cfg.mode != REKV_MODE_RESIDENT) {
        for (int b = 0; b < 2; b++) {
            parity *pr = &p->par[b];
            if (p->cfg.push) { /* shared with the store, which writes the KV rows */
                rekv_err e = {0};
                int src = dbuf_ensure_shared(p, &pr->attn_kv, &p->h_attn_kv[b], max_kv_g * dsz, &e);
                if (src)
                    return rekv_errf(err, src, "step: push attention buffers: %s", e.msg);
            } else {
                rc |= dbuf_ensure(p, &pr->attn_kv, max_kv_g * dsz);
            }
            rc |= dbuf_ensure(p, &pr->act_stage, max_ctx_g * H * dsz) |
                  dbuf_ensure(p, &pr->out_stage, max_rows * H * dsz);
        }
        rc |= dbuf_ensure(p, &p->act_f32, max_ctx_g * H * f) |
              dbuf_ensure(p, &p->kr, max_ctx_g * KV * f) |
              dbuf_ensure(p, &p->vr, max_ctx_g * KV * f);
    }
    if (rc)
        return rekv_errf(err, -ENOMEM, "step: out of device memory for a batch of %d sequences",
                         st->n_items);
    return 0;
}

/* The attention descriptors of batch g for one unit: resident caches or the parity's buffer. */
static rekv_attn_seq *unit_seqs(rekv_pipeline *p, step *st, int g, int layer, int b)
{
    int n = st->g_begin[g + 1] - st->g_begin[g];
    rekv_attn_seq *d = smem_alloc(&st->mem, sizeof(*d) * (size_t)n);
    if (d == NULL)
        return NULL;
    const rekv_model_config *c = p->c;
    size_t off = 0, dsz = rekv_dtype_size(p->cfg.cache_dtype);
    for (int j = 0; j < n; j++) {
        rekv_pipe_item *it = &st->items[st->g_begin[g] + j];
        rekv_pseq *s = it->seq;
        d[j].start = s->len;
        d[j].n = it->n_tokens;
        d[j].row0 = st->row0[st->g_begin[g] + j];
        if (p->cfg.mode == REKV_MODE_RESIDENT) {
            d[j].kv = s->kv + (size_t)layer *
                                  rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, s->cap) * dsz;
        } else {
            d[j].kv = (uint8_t *)p->par[b].attn_kv.p + off;
            off += rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, s->len + it->n_tokens) * dsz;
        }
    }
    return d;
}

/* Counts a range's ACT blocks before block b, for b that only grow (ACT_GPU keeps a sequence's
 * first N ACT blocks on the device). */
typedef struct act_counter {
    const range_ref *r;
    size_t next;    /* blocks [0, next) counted */
    uint64_t n_act; /* ACT blocks among them */
} act_counter;

static uint64_t act_ordinal(const rekv_pipeline *p, act_counter *c, size_t b)
{
    for (; c->next < b && c->next < c->r->count; c->next++)
        if (p->plan[c->r->first + c->next].type == REKV_KV_BLOCK_ACT)
            c->n_act++;
    return c->n_act;
}

/* Host-side lists of one unit's context loads and new-row stores. */
typedef struct unit_io {
    piece_list h2d_kv, h2d_act, d2h_kv, d2h_act;
    piece_list d2d_act; /* ACT_GPU: new activation rows into the device copy */
    conv_list conv_act;
    int32_t *act_seq, *act_pos; /* [n_act] recomputed rows: item within batch, position */
    int n_act;
} unit_io;

/* Appends the copy of rows [in_blk, in_blk + n) of one KV block between two buffers in the block
 * layout (kvlayout.h; the arena's blocks, the device's attention buffers): a whole block is one
 * piece (adjacent ones merge), a part of one a piece per head of K and V, all at one stride (one
 * strided copy). Returns the bytes, 0 when out of memory. */
static size_t block_rows_copy(piece_list *l, uint8_t *dst, const uint8_t *src, int in_blk, int n,
                              int kvh, int hd, size_t dsz)
{
    size_t head = REKV_KV_BLOCK_TOKENS * (size_t)hd * dsz; /* one head's rows */
    size_t row0 = (size_t)in_blk * (size_t)hd * dsz, bytes = (size_t)n * (size_t)hd * dsz;
    int np = n == REKV_KV_BLOCK_TOKENS ? 1 : 2 * kvh;
    if (RESERVE(l, (size_t)np))
        return 0;
    if (np == 1)
        l->v[l->n++] = (rekv_copy_piece){dst, src, 2 * (size_t)kvh * head};
    else
        for (int h = 0; h < np; h++)
            l->v[l->n++] = (rekv_copy_piece){dst + (size_t)h * head + row0,
                                             src + (size_t)h * head + row0, bytes};
    return 2 * (size_t)kvh * bytes;
}

/* Builds the loads of unit (layer, g): every context token's K,V rows (KV) or activation row
 * (ACT), from the arena into the parity's staging buffers, and the merge into the attention
 * buffer; and the stores of the new rows into the arena. */
static int unit_plan(rekv_pipeline *p, step *st, int g, int layer, int b, const rekv_attn_seq *d,
                     unit_io *io)
{
    const rekv_kv_geometry *geo = &p->geo;
    int L = p->c->n_layers, kvh = (int)geo->n_kv_heads, hd = (int)geo->head_dim;
    size_t dsz = rekv_dtype_size(p->cfg.cache_dtype), H = geo->hidden;
    uint8_t *act_stage = p->par[b].act_stage.p;
    uint8_t *out = p->par[b].out_stage.p;
    size_t act_off = 0;
    int nb = st->g_begin[g + 1] - st->g_begin[g], kvpr = p->cfg.mode == REKV_MODE_KVPR;
    int total_act = 0;
    for (int j = 0; j < nb; j++) {
        int item = st->g_begin[g] + j;
        int ctx = st->items[item].seq->len;
        total_act += kvpr ? (st->split[item] < ctx ? st->split[item] : ctx) : ctx;
    }
    io->act_seq = smem_alloc(&st->mem, sizeof(int32_t) * (size_t)(total_act + 1));
    io->act_pos = smem_alloc(&st->mem, sizeof(int32_t) * (size_t)(total_act + 1));
    if (io->act_seq == NULL || io->act_pos == NULL)
        return -ENOMEM;
    rekv_layer_counters *cnt = &p->counters[layer];
    for (int j = 0; j < nb; j++) {
        int item = st->g_begin[g] + j;
        rekv_pseq *s = st->items[item].seq;
        const range_ref *kr = &st->kv_ref[item * L + layer], *ar = &st->act_ref[item * L + layer];
        int ctx = s->len, l_split = kvpr ? (st->split[item] < ctx ? st->split[item] : ctx) : 0;
        act_counter ac = {kvpr ? ar : kr, 0, 0};
        uint64_t n_gpu = (uint64_t)p->cfg.act_gpu_blocks;
        size_t gpu_row_bytes = H * dsz, gpu_layer_rows = (size_t)n_gpu * REKV_KV_BLOCK_TOKENS;
        /* context: walk the blocks of the range [0, ctx) */
        for (int t0 = 0; t0 < ctx;) {
            int use_act = kvpr && t0 < l_split;
            const rekv_kv_plan_block *blk = block_at(p, use_act ? ar : kr, t0);
            if (blk == NULL)
                return -EPROTO;
            int in_blk = t0 % REKV_KV_BLOCK_TOKENS;
            int n = REKV_KV_BLOCK_TOKENS - in_blk;
            int lim = use_act ? l_split : ctx;
            if (t0 + n > lim)
                n = lim - t0;
            const uint8_t *base = p->arena + blk->offset;
            if (blk->type == REKV_KV_BLOCK_ACT) {
                if (RESERVE(&io->h2d_act, 1) || RESERVE(&io->conv_act, 1))
                    return -ENOMEM;
                size_t bytes = (size_t)n * H * dsz;
                uint64_t ord = act_ordinal(p, &ac, (size_t)(t0 / REKV_KV_BLOCK_TOKENS));
                const uint8_t *src;
                if (ord < n_gpu) { /* ACT_GPU: already on the device */
                    src = s->act_dev + ((size_t)layer * gpu_layer_rows +
                                        (size_t)ord * REKV_KV_BLOCK_TOKENS + (size_t)in_blk) *
                                           gpu_row_bytes;
                } else {
                    io->h2d_act.v[io->h2d_act.n++] =
                        (rekv_copy_piece){act_stage + act_off,
                                          base + rekv_kv_act_offset(geo, (uint32_t)in_blk), bytes};
                    src = act_stage + act_off;
                    act_off += bytes;
                    cnt->h2d_bytes[REKV_XFER_ACT] += bytes;
                }
                io->conv_act.v[io->conv_act.n++] = (rekv_convert_piece){
                    (float *)p->act_f32.p + (size_t)io->n_act * H, src, (uint32_t)((size_t)n * H)};
                for (int i = 0; i < n; i++) {
                    io->act_seq[io->n_act] = j;
                    io->act_pos[io->n_act++] = t0 + i;
                }
                cnt->tokens_recomputed += (uint64_t)n;
            } else {
                /* straight into the attention buffer: the block's layout and dtype */
                uint8_t *dst = (uint8_t *)d[j].kv + rekv_kv_row(kvh, hd, 0, t0 - in_blk) * dsz;
                size_t bytes = block_rows_copy(&io->h2d_kv, dst, base, in_blk, n, kvh, hd, dsz);
                if (bytes == 0)
                    return -ENOMEM;
                cnt->h2d_bytes[REKV_XFER_KV] += bytes;
                cnt->tokens_fetched += (uint64_t)n;
            }
            t0 += n;
        }
        /* new rows, a block's worth at a time: K,V from the attention buffer (where kv_scatter
         * put them, in the block's layout) into KV blocks, the attention input from the output
         * staging into ACT blocks (kvpr: both) */
        for (int i = 0; i < st->items[item].n_tokens;) {
            int t = s->len + i, r = st->row0[item] + i, in_blk = t % REKV_KV_BLOCK_TOKENS;
            int n = REKV_KV_BLOCK_TOKENS - in_blk;
            if (n > st->items[item].n_tokens - i)
                n = st->items[item].n_tokens - i;
            i += n;
            const rekv_kv_plan_block *kb = block_at(p, kr, t);
            const rekv_kv_plan_block *ab = kvpr ? block_at(p, ar, t) : NULL;
            if (kb == NULL || (kvpr && ab == NULL))
                return -EPROTO;
            if (kb->type == REKV_KV_BLOCK_ACT && !kvpr)
                ab = kb, kb = NULL;
            if (kb) {
                const uint8_t *src =
                    (const uint8_t *)d[j].kv + rekv_kv_row(kvh, hd, 0, t - in_blk) * dsz;
                size_t bytes = block_rows_copy(&io->d2h_kv, p->arena + kb->offset, src, in_blk, n,
                                               kvh, hd, dsz);
                if (bytes == 0)
                    return -ENOMEM;
                cnt->d2h_bytes[REKV_XFER_KV] += bytes;
            }
            if (ab) {
                if (RESERVE(&io->d2h_act, 1))
                    return -ENOMEM;
                size_t bytes = (size_t)n * H * dsz;
                const uint8_t *rows_h = out + (size_t)r * H * dsz;
                io->d2h_act.v[io->d2h_act.n++] = (rekv_copy_piece){
                    p->arena + ab->offset + rekv_kv_act_offset(geo, (uint32_t)in_blk), rows_h,
                    bytes};
                cnt->d2h_bytes[REKV_XFER_ACT] += bytes;
                uint64_t ord = act_ordinal(p, &ac, (size_t)(t / REKV_KV_BLOCK_TOKENS));
                if (ord < n_gpu) { /* ACT_GPU: the device copy too (the store stays complete) */
                    if (RESERVE(&io->d2d_act, 1))
                        return -ENOMEM;
                    io->d2d_act.v[io->d2d_act.n++] = (rekv_copy_piece){
                        s->act_dev + ((size_t)layer * gpu_layer_rows +
                                      (size_t)ord * REKV_KV_BLOCK_TOKENS + (size_t)in_blk) *
                                         gpu_row_bytes,
                        rows_h, bytes};
                }
            }
        }
    }
    return 0;
}

/* Moves a convert list, which kernels read, into the step's metadata memory. */
static int keep_conv(step *st, conv_list *l)
{
    if (l->v == NULL)
        return 0;
    rekv_convert_piece *a = smem_alloc(&st->mem, sizeof(*a) * (l->n ? l->n : 1));
    if (a)
        memcpy(a, l->v, sizeof(*a) * l->n);
    free(l->v);
    l->v = a;
    return a ? 0 : -ENOMEM;
}

/* Hands unit_io's lists to the step's memory: the streams read them until the step ends. */
static int unit_io_keep(step *st, unit_io *io)
{
    int rc = keep_conv(st, &io->conv_act);
    void *ptrs[] = {io->h2d_kv.v, io->h2d_act.v, io->d2h_kv.v, io->d2h_act.v, io->d2d_act.v};
    for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++)
        rc |= smem_adopt(&st->mem, ptrs[i]);
    return rc ? -ENOMEM : 0;
}

/* One layer for the rows of batch g (the same operations, in the same order, as forward.c). */
static void layer_compute(rekv_pipeline *p, step *st, int g, int layer, const layer_w *L,
                          const rekv_attn_seq *d, int b, int store)
{
    const rekv_model_config *c = p->c;
    const rekv_kernel_iface *k = p->k;
    rekv_stream *s = p->s_compute;
    gbatch *gb = &p->gb[g];
    int T = st->g_rows[g], H = c->hidden, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c);
    int F = c->ffn, nb = st->g_begin[g + 1] - st->g_begin[g];
    float *x = gb->x.p, *h = gb->h.p, *q = gb->q.p, *kk = gb->k.p, *vv = gb->v.p;
    float *att = gb->att.p, *f1 = gb->f1.p, *f3 = gb->f3.p;
    size_t n = (size_t)T * (size_t)H;
    if (c->pre_norm) {
        k->norm(s, h, x, L->attn_norm_w, L->attn_norm_b, T, H, c->norm_eps);
    } else {
        rekv_copy_piece pc = {h, x, n * sizeof(float)};
        p->bi->copy_d2d(s, &pc, 1);
    }
    k->linear(s, q, h, L->wq, p->e->wdtype, L->bq, T, Q, H);
    k->linear(s, kk, h, L->wk, p->e->wdtype, L->bk, T, KV, H);
    k->linear(s, vv, h, L->wv, p->e->wdtype, L->bv, T, KV, H);
    if (c->rope != REKV_ROPE_NONE) {
        k->rope(s, q, st->pos[g], T, c->n_heads, c->head_dim, c->rope_theta, c->rope);
        k->rope(s, kk, st->pos[g], T, c->n_kv_heads, c->head_dim, c->rope_theta, c->rope);
    }
    rekv_dtype cdt = p->cfg.cache_dtype;
    if (store) { /* the attention input leaves for the arena (K, V leave from the attention
                    buffer, once scattered into it) */
        p->bi->stream_wait_event(s, p->ev_out_free[b]);
        k->convert_out(s, p->par[b].out_stage.p, h, (size_t)T * (size_t)H, cdt);
    }
    k->kv_scatter(s, kk, vv, T, st->row_seq[g], st->pos[g], d, c->n_kv_heads, c->head_dim, cdt);
    k->attention(s, att, q, d, nb, T, c->n_heads, c->n_kv_heads, c->head_dim, p->scores.p, cdt);
    if (store) /* the new rows are ready to leave, and attention has read the buffers */
        p->bi->event_record(p->ev_out[b], s);
    k->linear(s, h, att, L->wo, p->e->wdtype, L->bo, T, H, Q);
    k->add(s, x, h, n);
    if (!c->pre_norm)
        k->norm(s, x, x, L->attn_norm_w, L->attn_norm_b, T, H, c->norm_eps);
    if (c->pre_norm) {
        k->norm(s, h, x, L->ffn_norm_w, L->ffn_norm_b, T, H, c->norm_eps);
    } else {
        rekv_copy_piece pc = {h, x, n * sizeof(float)};
        p->bi->copy_d2d(s, &pc, 1);
    }
    k->linear(s, f1, h, L->w1, p->e->wdtype, L->b1, T, F, H);
    if (L->w3) {
        k->linear(s, f3, h, L->w3, p->e->wdtype, NULL, T, F, H);
        k->activation(s, f1, f3, (size_t)T * (size_t)F, c->act);
    } else {
        k->activation(s, f1, NULL, (size_t)T * (size_t)F, c->act);
    }
    k->linear(s, h, f1, L->w2, p->e->wdtype, L->b2, T, H, F);
    k->add(s, x, h, n);
    if (!c->pre_norm)
        k->norm(s, x, x, L->ffn_norm_w, L->ffn_norm_b, T, H, c->norm_eps);
}

static int item_batch_cmp(const void *a, const void *b)
{
    const rekv_pipe_item *x = a, *y = b;
    return (x->gpu_batch > y->gpu_batch) - (x->gpu_batch < y->gpu_batch);
}

static int setup_batches(rekv_pipeline *p, step *st)
{
    int n = st->n_items, G;
    st->row0 = smem_alloc(&st->mem, sizeof(int) * (size_t)n);
    st->split = smem_alloc(&st->mem, sizeof(int) * (size_t)n);
    if (st->row0 == NULL || st->split == NULL)
        return -ENOMEM;
    if (st->items[0].gpu_batch > 0) {
        /* the planner's mini-batches: group the items (a copy; logits pointers travel along) */
        rekv_pipe_item *sorted = smem_alloc(&st->mem, sizeof(*sorted) * (size_t)n);
        if (sorted == NULL)
            return -ENOMEM;
        memcpy(sorted, st->items, sizeof(*sorted) * (size_t)n);
        /* insertion sort: stable, and batches are small */
        for (int i = 1; i < n; i++)
            for (int j = i; j > 0 && item_batch_cmp(&sorted[j - 1], &sorted[j]) > 0; j--) {
                rekv_pipe_item t = sorted[j];
                sorted[j] = sorted[j - 1];
                sorted[j - 1] = t;
            }
        st->items = sorted;
        G = 0;
        for (int i = 0; i < n; i++)
            if (i == 0 || sorted[i].gpu_batch != sorted[i - 1].gpu_batch) {
                if (G == MAX_GPU_BATCHES)
                    return -E2BIG;
                st->g_begin[G++] = i;
            }
        st->g_begin[G] = n;
    } else {
        G = p->cfg.gpu_batches < n ? p->cfg.gpu_batches : n;
        for (int g = 0; g <= G; g++)
            st->g_begin[g] = (int)((int64_t)n * g / G);
    }
    st->n_g = G;
    for (int g = 0; g < G; g++) {
        int rows = 0;
        for (int i = st->g_begin[g]; i < st->g_begin[g + 1]; i++) {
            st->row0[i] = rows;
            rows += st->items[i].n_tokens;
            st->split[i] = p->cfg.split;
        }
        st->g_rows[g] = rows;
        int nb = st->g_begin[g + 1] - st->g_begin[g];
        st->tok[g] = smem_alloc(&st->mem, sizeof(int32_t) * (size_t)rows);
        st->pos[g] = smem_alloc(&st->mem, sizeof(int32_t) * (size_t)rows);
        st->row_seq[g] = smem_alloc(&st->mem, sizeof(int32_t) * (size_t)rows);
        st->last[g] = smem_alloc(&st->mem, sizeof(int32_t) * (size_t)nb);
        if (!st->tok[g] || !st->pos[g] || !st->row_seq[g] || !st->last[g])
            return -ENOMEM;
        for (int j = 0; j < nb; j++) {
            rekv_pipe_item *it = &st->items[st->g_begin[g] + j];
            int r0 = st->row0[st->g_begin[g] + j];
            for (int i = 0; i < it->n_tokens; i++) {
                st->tok[g][r0 + i] = it->tokens[i];
                st->pos[g][r0 + i] = it->seq->len + i;
                st->row_seq[g][r0 + i] = j;
            }
            st->last[g][j] = r0 + it->n_tokens - 1;
        }
    }
    return 0;
}

static int validate(rekv_pipeline *p, rekv_pipe_item *items, int n, rekv_err *err)
{
    if (n <= 0)
        return rekv_errf(err, -EINVAL, "step: empty batch");
    for (int b = 0; b < n; b++) {
        rekv_pipe_item *it = &items[b];
        if (it->seq == NULL || it->seq->p != p || it->n_tokens <= 0 || it->tokens == NULL ||
            it->logits == NULL)
            return rekv_errf(err, -EINVAL, "step: batch item %d is malformed", b);
        if ((int64_t)it->seq->len + it->n_tokens > it->seq->cap)
            return rekv_errf(err, -E2BIG,
                             "step: %d tokens after %d cached is longer than the context (%d)",
                             it->n_tokens, it->seq->len, it->seq->cap);
        for (int i = 0; i < it->n_tokens; i++)
            if (it->tokens[i] < 0 || it->tokens[i] >= p->c->vocab)
                return rekv_errf(err, -EINVAL,
                                 "step: token id %d is outside the vocabulary (0..%d)",
                                 it->tokens[i], p->c->vocab - 1);
        for (int j = 0; j < b; j++)
            if (items[j].seq == it->seq)
                return rekv_errf(err, -EINVAL, "step: a sequence appears twice in one batch");
        if (it->gpu_batch < 0 || (it->gpu_batch > 0) != (items[0].gpu_batch > 0))
            return rekv_errf(err, -EINVAL, "step: every item or none must name its GPU batch");
    }
    return 0;
}

int rekv_pipeline_set_step(rekv_pipeline *p, const rekv_step_params *sp, rekv_err *err)
{
    if (sp->split < 0 || sp->kv_parts < 0 || sp->act_parts < 0 ||
        (p->cfg.mode == REKV_MODE_HYBRID && sp->kv_parts + sp->act_parts == 0) ||
        sp->gpu_batches < 1 || sp->gpu_batches > MAX_GPU_BATCHES ||
        (sp->schedule != REKV_SCHED_ROW && sp->schedule != REKV_SCHED_COLUMN))
        return rekv_errf(err, -EINVAL,
                         "pipeline: bad step parameters (split %d, pattern %d:%d, "
                         "%d GPU batches)",
                         sp->split, sp->kv_parts, sp->act_parts, sp->gpu_batches);
    p->cfg.split = sp->split;
    p->cfg.kv_parts = sp->kv_parts;
    p->cfg.act_parts = sp->act_parts;
    p->cfg.gpu_batches = sp->gpu_batches;
    p->cfg.schedule = sp->schedule;
    return 0;
}

/* push: has the store write the unit's KV rows (io->h2d_kv, as pull would copy them) into parity
 * b's attention buffers once ev_attn_free[b] allows, then record ev_pushed[b]; returns once the
 * store has enqueued that. */
static int push_unit(rekv_pipeline *p, int b, const unit_io *io, rekv_err *err)
{
    if (reserve_bytes((void **)&p->push_pieces, &p->push_cap, io->h2d_kv.n,
                      sizeof(rekv_kv_push_piece)))
        return rekv_errf(err, -ENOMEM, "step: out of memory");
    const uint8_t *kv = p->par[b].attn_kv.p;
    for (size_t i = 0; i < io->h2d_kv.n; i++) {
        const rekv_copy_piece *c = &io->h2d_kv.v[i];
        p->push_pieces[i] = (rekv_kv_push_piece){
            .src = (uint64_t)((const uint8_t *)c->src - p->arena),
            .dst = (uint64_t)((const uint8_t *)c->dst - kv),
            .bytes = c->bytes,
            .buffer = 0,
        };
    }
    const void *bufs[] = {&p->h_attn_kv[b]};
    rekv_err e = {0};
    int rc = rekv_kvstore_push(p->store, bufs, 1, &p->h_attn_free[b], &p->h_pushed[b],
                               p->push_pieces, io->h2d_kv.n, NULL, 0, &e);
    if (rc)
        return rekv_errf(err, rc, "step: push: %s", e.msg);
    return 0;
}

int rekv_pipeline_step(rekv_pipeline *p, rekv_pipe_item *items, int n_items, rekv_err *err)
{
    int rc;
    if ((rc = validate(p, items, n_items, err)))
        return rc;
    const rekv_model_config *c = p->c;
    const rekv_kernel_iface *k = p->k;
    int resident = p->cfg.mode == REKV_MODE_RESIDENT, L = c->n_layers;
    step st = {.items = items, .n_items = n_items, .mem = {.meta = &p->meta}};
    rekv_kv_range *ranges = NULL;
    size_t n_ranges = 0;
    int pinned = 0;
    if ((rc = setup_batches(p, &st))) {
        rekv_errf(err, rc, rc == -E2BIG ? "step: more than 64 GPU batches" : "step: out of memory");
        goto out;
    }
    if (!resident) {
        if ((rc = store_prepare(p, &st, &ranges, &n_ranges, err)))
            goto out;
        pinned = 1;
    }
    if ((rc = ensure_buffers(p, &st, err)))
        goto out;
    rekv_stream *sc = p->s_compute, *sh = p->s_h2d, *sd = p->s_d2h;
    int E = c->embed_dim, H = c->hidden;
    for (int g = 0; g < st.n_g; g++) {
        gbatch *gb = &p->gb[g];
        int T = st.g_rows[g];
        if (p->d_proj_in) {
            k->embed(sc, gb->h.p, p->d_embed, p->e->wdtype, st.tok[g], NULL, NULL, 0, T, E);
            k->linear(sc, gb->x.p, gb->h.p, p->d_proj_in, p->e->wdtype, NULL, T, H, E);
            if (p->d_pos)
                k->embed(sc, gb->x.p, NULL, p->e->wdtype, st.tok[g], p->d_pos, st.pos[g], 2, T, H);
        } else {
            k->embed(sc, gb->x.p, p->d_embed, p->e->wdtype, st.tok[g], p->d_pos, st.pos[g], 2, T,
                     E);
        }
    }
    /* units in schedule order */
    int G = st.n_g, n_units = L * G, w_loads = 0;
    for (int u = 0; u < n_units; u++) {
        int layer, g;
        if (p->cfg.schedule == REKV_SCHED_COLUMN)
            layer = u / G, g = u % G;
        else
            g = u / L, layer = u % L;
        int b = u & 1;
        /* weights: column schedule loads a layer once for all its GPU batches, row once per
         * unit; two buffers alternate */
        int load = p->cfg.offload_weights && (p->cfg.schedule == REKV_SCHED_COLUMN ? g == 0 : 1);
        int wb = (w_loads - (load ? 0 : 1)) & 1;
        const layer_w *W = p->cfg.offload_weights ? &p->wbuf[wb] : &p->dev_layers[layer];
        rekv_attn_seq *d = unit_seqs(p, &st, g, layer, b);
        unit_io io = {0};
        if (d == NULL) {
            rc = rekv_errf(err, -ENOMEM, "step: out of memory");
            goto drain;
        }
        if (!resident) {
            rc = unit_plan(p, &st, g, layer, b, d, &io);
            int krc = unit_io_keep(&st, &io);
            if (rc || krc) {
                rc = rekv_errf(err, rc ? rc : krc, "step: %s",
                               rc == -EPROTO ? "the kvstore's plan does not cover the context"
                                             : "out of memory");
                goto drain;
            }
        }
        /* h2d, in the order the compute needs it (KVPR's fine-grained pipeline): W_K and W_V,
         * the activations to recompute from, the rest of the weights, then the KV rows — so the
         * recomputation runs while the rest streams */
        if (load) {
            p->bi->stream_wait_event(sh, p->ev_wfree[wb]);
            p->counters[layer].h2d_bytes[REKV_XFER_WEIGHTS] +=
                copy_layer(p, sh, &p->e->layers[layer], &p->wbuf[wb], 0, N_KV_TENSORS);
            p->bi->event_record(p->ev_wkv[wb], sh);
        }
        if (!resident) {
            /* staging is free once the compute of unit u-2 has converted it */
            p->bi->stream_wait_event(sh, p->ev_stage_free[b]);
            if (io.h2d_act.n)
                p->bi->copy_h2d(sh, io.h2d_act.v, io.h2d_act.n, REKV_XFER_ACT);
            p->bi->event_record(p->ev_act[b], sh);
        }
        if (load) {
            p->counters[layer].h2d_bytes[REKV_XFER_WEIGHTS] += copy_layer(
                p, sh, &p->e->layers[layer], &p->wbuf[wb], N_KV_TENSORS, N_LAYER_TENSORS);
            p->bi->event_record(p->ev_wall[wb], sh);
            w_loads++;
        }
        if (!resident) {
            /* into the attention buffers, once the unit two back has read them: by our own
             * copies (pull), or by the store's (push: it waits for ev_attn_free[b] itself) */
            if (p->cfg.push) {
                if (io.h2d_kv.n && (rc = push_unit(p, b, &io, err)))
                    goto drain;
            } else {
                p->bi->stream_wait_event(sh, p->ev_attn_free[b]);
                if (io.h2d_kv.n)
                    p->bi->copy_h2d(sh, io.h2d_kv.v, io.h2d_kv.n, REKV_XFER_KV);
                p->bi->event_record(p->ev_loaded[b], sh);
            }
            /* compute: recompute K,V from activations into the attention buffers, once the
             * stores of the unit two back have read them (they may hold another batch's rows) */
            p->bi->stream_wait_event(sc, p->ev_attn_free[b]);
            if (io.n_act) {
                p->bi->stream_wait_event(sc, p->ev_act[b]);
                k->convert(sc, io.conv_act.v, io.conv_act.n, p->cfg.cache_dtype);
                if (p->cfg.offload_weights)
                    p->bi->stream_wait_event(sc, p->ev_wkv[wb]);
                k->linear(sc, p->kr.p, p->act_f32.p, W->wk, p->e->wdtype, W->bk, io.n_act,
                          rekv_config_kv_dim(c), H);
                k->linear(sc, p->vr.p, p->act_f32.p, W->wv, p->e->wdtype, W->bv, io.n_act,
                          rekv_config_kv_dim(c), H);
                if (c->rope != REKV_ROPE_NONE)
                    k->rope(sc, p->kr.p, io.act_pos, io.n_act, c->n_kv_heads, c->head_dim,
                            c->rope_theta, c->rope);
                k->kv_scatter(sc, p->kr.p, p->vr.p, io.n_act, io.act_seq, io.act_pos, d,
                              c->n_kv_heads, c->head_dim, p->cfg.cache_dtype);
            }
            p->bi->event_record(p->ev_stage_free[b], sc);
            if (!p->cfg.push)
                p->bi->stream_wait_event(sc, p->ev_loaded[b]);
            else if (io.h2d_kv.n)
                p->bi->stream_wait_event(sc, p->ev_pushed[b]);
        }
        if (p->cfg.offload_weights)
            p->bi->stream_wait_event(sc, p->ev_wall[wb]);
        layer_compute(p, &st, g, layer, W, d, b, !resident);
        if (io.d2d_act.n) /* after the rows were staged by layer_compute, on the same stream */
            p->bi->copy_d2d(sc, io.d2d_act.v, io.d2d_act.n);
        if (!resident) {
            /* d2h: the new rows, from this parity's attention buffer and output staging; then
             * the buffers may take the next unit's rows */
            p->bi->stream_wait_event(sd, p->ev_out[b]);
            if (io.d2h_kv.n)
                p->bi->copy_d2h(sd, io.d2h_kv.v, io.d2h_kv.n, REKV_XFER_KV);
            if (io.d2h_act.n)
                p->bi->copy_d2h(sd, io.d2h_act.v, io.d2h_act.n, REKV_XFER_ACT);
            p->bi->event_record(p->ev_out_free[b], sd);
            p->bi->event_record(p->ev_attn_free[b], sd);
        }
        if (p->cfg.offload_weights)
            p->bi->event_record(p->ev_wfree[wb], sc);
    }
    /* the head: each sequence's last row -> logits -> host */
    for (int g = 0; g < G; g++) {
        gbatch *gb = &p->gb[g];
        int nb = st.g_begin[g + 1] - st.g_begin[g];
        float *rows = gb->h.p; /* h is free after the last layer */
        k->gather_rows(sc, rows, gb->x.p, st.last[g], nb, H);
        if (p->d_fnorm_w)
            k->norm(sc, rows, rows, p->d_fnorm_w, p->d_fnorm_b, nb, H, c->norm_eps);
        if (p->d_proj_out) {
            k->linear(sc, gb->q.p, rows, p->d_proj_out, p->e->wdtype, NULL, nb, E, H);
            rows = gb->q.p;
        }
        k->linear(sc, gb->logits.p, rows, p->d_head, p->e->wdtype, NULL, nb, c->vocab, E);
        rekv_copy_piece *pc = smem_alloc(&st.mem, sizeof(rekv_copy_piece) * (size_t)nb);
        if (pc == NULL) {
            rc = rekv_errf(err, -ENOMEM, "step: out of memory");
            goto drain;
        }
        for (int j = 0; j < nb; j++)
            pc[j] = (rekv_copy_piece){st.items[st.g_begin[g] + j].logits,
                                      (float *)gb->logits.p + (size_t)j * c->vocab,
                                      sizeof(float) * (size_t)c->vocab};
        p->bi->copy_d2h(sc, pc, (size_t)nb, REKV_XFER_OTHER);
    }
drain : {
    /* every enqueued task refers to step memory: wait for all of it, whatever happened */
    int r1 = p->bi->stream_sync(sh, rc ? NULL : err);
    int r2 = p->bi->stream_sync(sc, rc ? NULL : err);
    int r3 = p->bi->stream_sync(sd, rc ? NULL : err);
    if (rc == 0)
        rc = r1 ? r1 : r2 ? r2 : r3;
}
    if (rc == 0) {
        for (int i = 0; i < n_items; i++)
            items[i].seq->len += items[i].n_tokens;
        /* this step's totals: the running totals minus those at the end of the last step */
        rekv_layer_counters now, *log = p->step_log;
        rekv_pipeline_counters(p, &now);
        if (reserve_bytes((void **)&log, &p->cap_steps, p->n_steps + 1, sizeof(*log)) == 0) {
            p->step_log = log;
            rekv_layer_counters d = now;
            for (int x = 0; x < REKV_XFER_KINDS; x++) {
                d.h2d_bytes[x] -= p->logged.h2d_bytes[x];
                d.d2h_bytes[x] -= p->logged.d2h_bytes[x];
            }
            d.tokens_recomputed -= p->logged.tokens_recomputed;
            d.tokens_fetched -= p->logged.tokens_fetched;
            log[p->n_steps++] = d;
        }
        p->logged = now;
    }
out:
    if (pinned) {
        rekv_err uerr = {0};
        int urc = rekv_kvstore_unpin(p->store, ranges, n_ranges, &uerr);
        if (rc == 0 && urc) {
            rc = urc;
            rekv_errf(err, urc, "%s", uerr.msg);
        }
    }
    smem_free(&st.mem);
    return rc;
}

/* ------------------------------------------------------------------ generation */

int rekv_pipeline_generate(rekv_pipeline *p, const int32_t *const *prompts, const int *n_prompts,
                           int n, const rekv_gen_params *gp, rekv_gen_result *res, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    int rc = 0, V = c->vocab, k = gp->top_logits < V ? gp->top_logits : V;
    int max_new = gp->max_new_tokens;
    memset(res, 0, sizeof(*res) * (size_t)n);
    if (max_new < 0 || gp->top_logits < 0)
        return rekv_errf(err, -EINVAL, "max_new_tokens and top_logits must not be negative");
    for (int i = 0; i < n; i++)
        if ((rc = rekv_prompt_check(c, prompts[i], n_prompts[i], err)))
            return rc;
    rekv_pseq **seqs = calloc((size_t)n, sizeof(*seqs));
    rekv_sampler *smp = calloc((size_t)n, sizeof(*smp));
    rekv_pipe_item *items = calloc((size_t)n, sizeof(*items));
    int *idx = calloc((size_t)n, sizeof(int));
    float *logits = malloc(sizeof(float) * (size_t)V * (size_t)n);
    void *scratch = malloc(sizeof(float) * 2 * (size_t)V);
    if (!seqs || !smp || !items || !idx || !logits || !scratch) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < n && rc == 0; i++) {
        int64_t want = (int64_t)n_prompts[i] + (max_new > 0 ? max_new - 1 : 0);
        int cap = want < c->max_pos ? (int)want : c->max_pos;
        res[i].ids = malloc(sizeof(int32_t) * (size_t)(max_new + 1));
        if (k > 0) {
            res[i].top_ids = malloc(sizeof(int32_t) * (size_t)k * (size_t)(max_new + 1));
            res[i].top_vals = malloc(sizeof(float) * (size_t)k * (size_t)(max_new + 1));
        }
        if (!res[i].ids || (k > 0 && (!res[i].top_ids || !res[i].top_vals)))
            rc = rekv_errf(err, -ENOMEM, "out of memory");
        else
            rc = rekv_pseq_create(p, cap, &seqs[i], err);
        rekv_sampler_init(&smp[i], gp->temperature, gp->top_k, gp->top_p, gp->seed + (uint64_t)i);
        res[i].finish_reason = "length";
        items[i] = (rekv_pipe_item){seqs[i], prompts[i], n_prompts[i], logits + (size_t)i * V, 0};
        idx[i] = i;
    }
    if (rc || max_new == 0)
        goto out;
    uint64_t t0 = rekv_now_ns();
    if ((rc = rekv_pipeline_step(p, items, n, err)))
        goto out;
    uint64_t t1 = rekv_now_ns();
    for (int i = 0; i < n; i++)
        res[i].prefill_s = (double)(t1 - t0) * 1e-9;
    int running = n;
    while (running > 0) {
        int m = 0;
        for (int a = 0; a < running; a++) {
            int i = idx[a];
            rekv_gen_result *r = &res[i];
            const float *lg = logits + (size_t)a * V;
            if (k > 0)
                rekv_top_logits(lg, V, k, r->top_ids + (size_t)r->n * k,
                                r->top_vals + (size_t)r->n * k);
            int32_t tok = rekv_sample(&smp[i], lg, V, scratch);
            r->ids[r->n++] = tok;
            if (gp->stop_at_eos && tok == c->eos_id)
                r->finish_reason = "eos";
            else if (r->n < max_new && rekv_pseq_len(seqs[i]) >= c->max_pos)
                r->finish_reason = "context";
            else if (r->n < max_new)
                idx[m++] = i; /* still running */
        }
        /* logits rows follow the running order; rebuild the items compactly */
        running = m;
        for (int a = 0; a < running; a++) {
            int i = idx[a];
            items[a] =
                (rekv_pipe_item){seqs[i], &res[i].ids[res[i].n - 1], 1, logits + (size_t)a * V, 0};
        }
        if (running > 0 && (rc = rekv_pipeline_step(p, items, running, err)))
            goto out;
    }
    double dec = (double)(rekv_now_ns() - t1) * 1e-9;
    for (int i = 0; i < n; i++)
        res[i].decode_s = dec;
out:
    if (seqs)
        for (int i = 0; i < n; i++)
            rekv_pseq_free(seqs[i]);
    if (rc)
        for (int i = 0; i < n; i++)
            rekv_gen_result_free(&res[i]);
    free(seqs);
    free(smp);
    free(items);
    free(idx);
    free(logits);
    free(scratch);
    return rc;
}
