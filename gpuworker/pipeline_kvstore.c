/* pipeline_kvstore.c — the pipeline's side of the kvstore: a step's plan round trips (append the
 * new tokens, pin every block the step reads or writes — in one round trip when they fit the
 * arena, else layer window by layer window, each asking the store to read the next one ahead —
 * and index the plan by (item, layer)); each
 * unit's copy lists from the plan — context KV rows from the arena straight into the attention
 * buffer, activation rows into staging (or from ACT_GPU's device copy), the new rows back into the
 * arena; and push, where the store makes those KV copies itself (pipeline.c's opening). With the
 * prefix cache, a sequence records the tokens it appends (published when it goes), and one that
 * starts from cached blocks gets its device-resident part (resident: its whole device cache)
 * copied from them once. */
#include "gpuworker/pipeline_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* The plan's block holding `token` of range r, or NULL outside it. */
const rekv_kv_plan_block *pl_block_at(const rekv_pipeline *p, const range_ref *r, int token)
{
    size_t b = (size_t)token / REKV_KV_BLOCK_TOKENS;
    return b >= r->b0 && b - r->b0 < r->count ? &p->plan[r->first + b - r->b0] : NULL;
}

/* Unit u of the step in schedule order: batch g, layer. */
void pl_unit_at(const rekv_pipeline *p, const step *st, int u, int *g, int *layer)
{
    int L = p->c->n_layers, G = st->n_g;
    if (p->cfg.schedule == REKV_SCHED_COLUMN)
        *layer = u / G, *g = u % G;
    else
        *g = u / L, *layer = u % L;
}

/* The step's ranges unit by unit: for each item of the unit's batch its (sequence, layer)
 * [lo, end), and kvpr's activation sequence beside it. lo is where the layer's sliding window
 * starts (pl_window_lo), so the store pins (and reads back from its spill tier) no block behind
 * it; 0 without a window, and with ACT_GPU, whose device copy is indexed by the ordinal of a
 * sequence's ACT blocks counted from its first (act_ordinal: the blocks before lo are only
 * counted, never copied). */
static int store_ranges(rekv_pipeline *p, step *st)
{
    int L = p->c->n_layers, kvpr = p->keep_act, U = L * st->n_g;
    size_t n = (size_t)st->n_items * (size_t)L * (kvpr ? 2 : 1);
    rekv_kv_range *r = pl_smem_alloc(&st->mem, n * sizeof(*r));
    st->unit_r0 = pl_smem_alloc(&st->mem, sizeof(size_t) * (size_t)(U + 1));
    if (r == NULL || st->unit_r0 == NULL)
        return -ENOMEM;
    size_t i = 0;
    for (int u = 0; u < U; u++) {
        int g, l;
        pl_unit_at(p, st, u, &g, &l);
        st->unit_r0[u] = i;
        for (int it = st->g_begin[g]; it < st->g_begin[g + 1]; it++) {
            rekv_pseq *s = st->items[it].seq;
            uint64_t end = (uint64_t)s->len + (uint64_t)st->items[it].n_tokens;
            uint64_t lo = p->cfg.act_gpu_blocks > 0 ? 0 : (uint64_t)pl_window_lo(p->c, s, l);
            r[i++] = (rekv_kv_range){s->id, (uint32_t)l, lo, end};
            if (kvpr)
                r[i++] = (rekv_kv_range){s->id + 1, (uint32_t)l, lo, end};
        }
    }
    st->unit_r0[U] = i;
    st->ranges = r;
    st->n_ranges = n;
    return 0;
}

/* The KV:ACT pattern s's blocks are appended with (the store types each block by it): K,V only,
 * activations only, or the sequence's own pattern (hybrid). */
void pl_store_pattern(const rekv_pipeline *p, const rekv_pseq *s, uint32_t *kv, uint32_t *act)
{
    switch (p->info->store) {
    case REKV_STORE_ACT:
        *kv = 0, *act = 1;
        break;
    case REKV_STORE_PATTERN:
        *kv = (uint32_t)s->kv_parts, *act = (uint32_t)s->act_parts;
        break;
    default:
        *kv = 1, *act = 0;
    }
}

/* What one layer of item it costs in the arena: its blocks, each its type's slot (the store's
 * allocation rule, as the pipeline appended them). */
static uint64_t item_layer_bytes(const rekv_pipeline *p, const step *st, int it)
{
    const rekv_pseq *s = st->items[it].seq;
    uint64_t nb = ((uint64_t)s->len + (uint64_t)st->items[it].n_tokens + REKV_KV_BLOCK_TOKENS - 1) /
                  REKV_KV_BLOCK_TOKENS;
    uint64_t kv = p->store_kv_slot, act = p->store_act_slot;
    if (p->keep_act) /* kvpr, infinigen keeping activations: both */
        return nb * (kv + act);
    uint32_t kp, ap;
    pl_store_pattern(p, s, &kp, &ap);
    uint64_t nk = 0, na = 0;
    for (uint64_t b = 0; b < nb; b++)
        if (rekv_kv_next_block_type(nk, na, kp, ap) == REKV_KV_BLOCK_KV)
            nk++;
        else
            na++;
    return nk * kv + na * act;
}

/* The context rows of item it that a layer recomputes from activations (the mode's). */
size_t pl_item_recompute_rows(const rekv_pipeline *p, const step *st, int it)
{
    return p->ops->recompute_rows ? p->ops->recompute_rows(p, st, it) : 0;
}

/* Cuts the step's units into layer windows: the whole step when its blocks fit the arena (one
 * pin, as before windows), else consecutive units whose blocks take at most half the arena less
 * two slots (the window pinned beside the next one read ahead; a slot of each class for the
 * rounding of small slots), at least one unit each. Approximate modes pin whole steps. */
static int plan_windows(rekv_pipeline *p, step *st, rekv_err *err)
{
    int L = p->c->n_layers, U = L * st->n_g;
    if (p->store_host_bytes == 0) {
        rekv_kv_stats ks;
        int rc = rekv_kvstore_stats(p->store, &ks, err);
        if (rc)
            return rc;
        p->store_host_bytes = ks.host_bytes;
        p->store_kv_slot = ks.kv_slot_bytes;
        p->store_act_slot = ks.act_slot_bytes;
    }
    uint64_t *item_b = pl_smem_alloc(&st->mem, sizeof(uint64_t) * (size_t)st->n_items);
    st->win_u0 = pl_smem_alloc(&st->mem, sizeof(int) * (size_t)(U + 1));
    if (item_b == NULL || st->win_u0 == NULL)
        return rekv_errf(err, -ENOMEM, "step: out of memory");
    uint64_t total = 0;
    for (int it = 0; it < st->n_items; it++)
        total += (item_b[it] = item_layer_bytes(p, st, it)) * (uint64_t)L;
    st->win = -1;
    st->win_u0[0] = 0;
    if (total <= p->store_host_bytes) {
        st->n_win = 1;
        st->win_u0[1] = U;
        return 0;
    }
    if (!p->info->layer_windows)
        return rekv_errf(err, -ENOMEM,
                         "step: the batch's KV (%llu bytes) does not fit the kvstore's arena "
                         "(%llu bytes), and %s pins a whole step (only the exact modes run a "
                         "step in layer windows)",
                         (unsigned long long)total, (unsigned long long)p->store_host_bytes,
                         rekv_mode_name(p->cfg.mode));
    uint64_t big = p->store_kv_slot > p->store_act_slot ? p->store_kv_slot : p->store_act_slot;
    uint64_t room = p->store_host_bytes > 2 * big ? p->store_host_bytes - 2 * big : 0;
    uint64_t cap = room / 2, in = 0;
    int n = 0;
    for (int u = 0; u < U; u++) {
        int g, l;
        pl_unit_at(p, st, u, &g, &l);
        uint64_t ub = 0;
        for (int it = st->g_begin[g]; it < st->g_begin[g + 1]; it++)
            ub += item_b[it];
        if (u > st->win_u0[n] && in + ub > cap)
            st->win_u0[++n] = u, in = 0;
        in += ub;
    }
    st->win_u0[++n] = U;
    st->n_win = n;
    return 0;
}

int pl_prefix_fill_device(rekv_pipeline *p, uint64_t seq, uint8_t *dev, int tokens, int upto,
                          rekv_err *err)
{
    int L = p->c->n_layers;
    size_t blk = rekv_kv_block_bytes(&p->geo);
    size_t layer_bytes = rekv_kv_buffer_bytes((int)p->geo.n_kv_heads, (int)p->geo.head_dim,
                                              tokens, p->kv_rowb);
    rekv_kv_range *r = calloc((size_t)L, sizeof(*r));
    if (r == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    for (int l = 0; l < L; l++)
        r[l] = (rekv_kv_range){seq, (uint32_t)l, 0, (uint64_t)upto};
    rekv_kv_plan_block *pb = NULL;
    size_t n = 0, cap = 0;
    int rc = rekv_kvstore_plan(p->store, r, (size_t)L, 1, &pb, &n, &cap, err), pinned = rc == 0;
    rekv_copy_piece *pc = rc ? NULL : calloc(n ? n : 1, sizeof(*pc));
    if (rc == 0 && pc == NULL)
        rc = rekv_errf(err, -ENOMEM, "out of memory");
    if (rc == 0) {
        /* one layout everywhere (kvlayout.h): a store block is a block of the device part */
        for (size_t i = 0; i < n; i++)
            pc[i] = (rekv_copy_piece){dev + (size_t)pb[i].range * layer_bytes +
                                          (size_t)pb[i].block * blk,
                                      p->arena + pb[i].offset, blk};
        p->bi->copy_h2d(p->s_h2d, pc, n, REKV_XFER_KV);
        rc = p->bi->stream_sync(p->s_h2d, err);
    }
    if (pinned) {
        int urc = rekv_kvstore_unpin(p->store, r, (size_t)L, rc ? NULL : err);
        rc = rc ? rc : urc;
    }
    free(pc);
    free(pb);
    free(r);
    return rc;
}

int pl_prefix_fill_act(rekv_pipeline *p, rekv_pseq *s, rekv_err *err)
{
    int L = p->c->n_layers, rc = 0;
    uint64_t seq = p->keep_act ? s->id + 1 : s->id, n_gpu = (uint64_t)p->cfg.act_gpu_blocks;
    size_t blk = REKV_KV_BLOCK_TOKENS * (size_t)p->geo.hidden * p->act_esz;
    rekv_kv_plan_block *pb = NULL;
    size_t n = 0, cap = 0;
    rekv_copy_piece *pc = calloc(n_gpu ? n_gpu : 1, sizeof(*pc));
    if (pc == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    for (int l = 0; rc == 0 && l < L; l++) {
        rekv_kv_range r = {seq, (uint32_t)l, 0, (uint64_t)s->len};
        if ((rc = rekv_kvstore_plan(p->store, &r, 1, 1, &pb, &n, &cap, err)))
            break;
        uint64_t ord = 0; /* the blocks come in order; ACT_GPU holds the first ACT ones */
        for (size_t i = 0; i < n && ord < n_gpu; i++)
            if (pb[i].type == REKV_KV_BLOCK_ACT) {
                size_t at = ((size_t)l * n_gpu + ord) * blk;
                pc[ord++] = (rekv_copy_piece){
                    s->act_dev + at, p->arena + pb[i].offset + rekv_kv_act_offset(&p->geo, 0), blk};
            }
        p->bi->copy_h2d(p->s_h2d, pc, (size_t)ord, REKV_XFER_ACT);
        rc = p->bi->stream_sync(p->s_h2d, err);
        int urc = rekv_kvstore_unpin(p->store, &r, 1, rc ? NULL : err);
        rc = rc ? rc : urc;
    }
    free(pc);
    free(pb);
    return rc;
}

/* Appends the step's new tokens to the store and cuts the step into layer windows (pinned by
 * pl_window_pin). */
int pl_store_prepare(rekv_pipeline *p, step *st, rekv_err *err)
{
    int rc, kvpr = p->keep_act, L = p->c->n_layers;
    for (int it = 0; it < st->n_items; it++) {
        rekv_pseq *s = st->items[it].seq;
        uint32_t kv, act;
        pl_store_pattern(p, s, &kv, &act);
        if (s->toks) { /* the prefix cache publishes them once a step has written their rows */
            pl_prefix_publish(p, s); /* the blocks the last steps filled: later jobs share them */
            memcpy(s->toks + s->len, st->items[it].tokens,
                   sizeof(int32_t) * (size_t)st->items[it].n_tokens);
        }
        uint64_t after;
        if ((rc = rekv_kvstore_append(p->store, s->id, (uint64_t)st->items[it].n_tokens, kv, act,
                                      &after, err)))
            return rc;
        if (kvpr && (rc = rekv_kvstore_append(p->store, s->id + 1, (uint64_t)st->items[it].n_tokens,
                                              0, 1, &after, err)))
            return rc;
    }
    st->kv_ref = pl_smem_alloc(&st->mem, sizeof(range_ref) * (size_t)st->n_items * (size_t)L);
    st->act_ref = pl_smem_alloc(&st->mem, sizeof(range_ref) * (size_t)st->n_items * (size_t)L);
    if (st->kv_ref == NULL || st->act_ref == NULL || store_ranges(p, st))
        return rekv_errf(err, -ENOMEM, "pipeline: out of memory");
    return plan_windows(p, st, err);
}

/* The ranges of window w: [*r0, *r1). */
static void window_ranges(const step *st, int w, size_t *r0, size_t *r1)
{
    *r0 = st->unit_r0[st->win_u0[w]];
    *r1 = st->unit_r0[st->win_u0[w + 1]];
}

/* Pins window w's blocks in one round trip (asking the store to read the next window — after the
 * last, the first, which the next step of the same batch starts with — back meanwhile), and
 * indexes its plan by (item, layer). */
int pl_window_pin(rekv_pipeline *p, step *st, int w, rekv_err *err)
{
    int L = p->c->n_layers, kvpr = p->keep_act, rc;
    size_t r0, r1, a0 = 0, a1 = 0;
    window_ranges(st, w, &r0, &r1);
    if (st->n_win > 1 && p->read_ahead)
        window_ranges(st, (w + 1) % st->n_win, &a0, &a1);
    if ((rc = rekv_kvstore_pin_ahead(p->store, st->ranges + r0, r1 - r0, st->ranges + a0, a1 - a0,
                                     &p->plan, &p->plan_n, &p->plan_cap, err)))
        return rc;
    st->win = w;
    size_t bi = 0;
    for (int u = st->win_u0[w]; u < st->win_u0[w + 1]; u++) {
        int g, l;
        pl_unit_at(p, st, u, &g, &l);
        size_t r = st->unit_r0[u];
        for (int item = st->g_begin[g]; item < st->g_begin[g + 1]; item++)
            for (int a = 0; a < (kvpr ? 2 : 1); a++, r++) {
                size_t first = bi;
                while (bi < p->plan_n && p->plan[bi].range == r - r0)
                    bi++;
                uint64_t end = st->ranges[r].token_end;
                range_ref ref = {first, bi - first,
                                 st->ranges[r].token_begin / REKV_KV_BLOCK_TOKENS};
                if (a)
                    st->act_ref[item * L + l] = ref;
                else
                    st->kv_ref[item * L + l] = ref;
                if (ref.count != (end + REKV_KV_BLOCK_TOKENS - 1) / REKV_KV_BLOCK_TOKENS - ref.b0)
                    return rekv_errf(err, -EPROTO,
                                     "pipeline: the kvstore's plan for sequence %llu layer "
                                     "%d has %zu blocks for %llu tokens",
                                     (unsigned long long)st->ranges[r].seq, l, ref.count,
                                     (unsigned long long)end);
            }
    }
    return 0;
}

/* After a step of s: frees in the store the blocks wholly behind the sliding window of every
 * layer, which no later step reads (s->len only grows; pl_window_lo) — none while a layer has no
 * window. Not where anything else reads them: the prefix cache (its blocks are published as they
 * fill, and shared), ACT_GPU (its ordinals count a sequence's ACT blocks from its first). A
 * failure keeps them, which only costs the store's room. */
void pl_window_drop(rekv_pipeline *p, rekv_pseq *s)
{
    if (s->toks || p->cfg.act_gpu_blocks > 0 || p->info->store == REKV_STORE_NONE)
        return;
    int L = p->c->n_layers, lo = s->len;
    for (int l = 0; l < L; l++) {
        int w = pl_window_lo(p->c, s, l);
        lo = w < lo ? w : lo;
    }
    int b = lo / REKV_KV_BLOCK_TOKENS;
    if (b <= s->dropped)
        return;
    if (rekv_kvstore_free(p->store, s->id, 0, (uint32_t)L, (uint64_t)s->dropped, (uint64_t)b,
                          NULL) == 0 &&
        (!p->keep_act || rekv_kvstore_free(p->store, s->id + 1, 0, (uint32_t)L,
                                           (uint64_t)s->dropped, (uint64_t)b, NULL) == 0))
        s->dropped = b;
}

/* Unpins the pinned window, if any; a window of several is done until the next step's sweep, so
 * the store spills it first. */
int pl_window_unpin(rekv_pipeline *p, step *st, rekv_err *err)
{
    if (st->win < 0)
        return 0;
    size_t r0, r1;
    window_ranges(st, st->win, &r0, &r1);
    st->win = -1;
    return st->n_win > 1 ? rekv_kvstore_unpin_done(p->store, st->ranges + r0, r1 - r0, err)
                         : rekv_kvstore_unpin(p->store, st->ranges + r0, r1 - r0, err);
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

/* Appends the copy of rows [in_blk, in_blk + n) of one KV block between two buffers in the block
 * layout (kvlayout.h; the arena's blocks, the device's attention buffers): a whole block is one
 * piece (adjacent ones merge), a part of one a piece per head of K and V, all at one stride (one
 * strided copy). Returns the bytes, 0 when out of memory. */
static size_t block_rows_copy(piece_list *l, uint8_t *dst, const uint8_t *src, int in_blk, int n,
                              int kvh, size_t rowb)
{
    size_t head = REKV_KV_BLOCK_TOKENS * rowb; /* one head's rows */
    size_t row0 = (size_t)in_blk * rowb, bytes = (size_t)n * rowb;
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

/* Layer `layer`'s device-resident part of sequence s (kvlayout.h, s->dev_tokens positions). */
static uint8_t *dev_layer(const rekv_pipeline *p, const rekv_pseq *s, int layer)
{
    const rekv_kv_geometry *g = &p->geo;
    return s->kv_dev + (size_t)layer * rekv_kv_buffer_bytes((int)g->n_kv_heads, (int)g->head_dim,
                                                            s->dev_tokens, p->kv_rowb);
}

int pl_dev_part_load(rekv_pipeline *p, const rekv_pseq *s, int layer, uint8_t *buf, int lo,
                     int dev, unit_io *io)
{
    int kvh = (int)p->geo.n_kv_heads, hd = (int)p->geo.head_dim;
    size_t rb = p->kv_rowb;
    const uint8_t *kv_dev = dev > lo ? dev_layer(p, s, layer) : NULL;
    if (lo >= dev)
        return 0;
    for (int t0 = lo; t0 < dev; t0 += REKV_KV_BLOCK_TOKENS) {
        int n = dev - t0 < REKV_KV_BLOCK_TOKENS ? dev - t0 : REKV_KV_BLOCK_TOKENS;
        size_t row = rekv_kv_off(rekv_kv_row(kvh, hd, 0, t0), hd, rb);
        if (block_rows_copy(&io->d2d_kv, buf + row, kv_dev + row, 0, n, kvh, rb) == 0)
            return -ENOMEM;
    }
    p->counters[layer].tokens_device += (uint64_t)(dev - lo);
    return 0;
}

int pl_dev_part_store(rekv_pipeline *p, const rekv_pseq *s, int layer, const uint8_t *buf, int t,
                      int n, unit_io *io)
{
    if (t >= s->dev_tokens)
        return 0;
    int kvh = (int)p->geo.n_kv_heads, hd = (int)p->geo.head_dim;
    size_t rb = p->kv_rowb;
    int in_blk = t % REKV_KV_BLOCK_TOKENS, m = s->dev_tokens - t < n ? s->dev_tokens - t : n;
    size_t row = rekv_kv_off(rekv_kv_row(kvh, hd, 0, t - in_blk), hd, rb);
    if (block_rows_copy(&io->d2d_new, dev_layer(p, s, layer) + row, buf + row, in_blk, m, kvh,
                        rb) == 0)
        return -ENOMEM;
    return 0;
}

/* The unit's recomputed rows' lists (io->act_seq, act_pos; slots: act_slot, each KV head's slot
 * of a row) for every context token of batch g up to its split (all of it without activations
 * kept beside K,V). 0 or -ENOMEM. */
int pl_unit_act_alloc(rekv_pipeline *p, step *st, int g, int slots, unit_io *io)
{
    int nb = st->g_begin[g + 1] - st->g_begin[g], kvpr = p->keep_act, total_act = 0;
    for (int j = 0; j < nb; j++) {
        int item = st->g_begin[g] + j;
        int ctx = st->items[item].seq->len;
        total_act += kvpr ? (st->split[item] < ctx ? st->split[item] : ctx) : ctx;
    }
    io->act_seq = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)(total_act + 1));
    io->act_pos = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)(total_act + 1));
    if (io->act_seq == NULL || io->act_pos == NULL)
        return -ENOMEM;
    if (slots) {
        io->act_slot = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)(total_act + 1) *
                                                   (size_t)p->c->n_kv_heads);
        if (io->act_slot == NULL)
            return -ENOMEM;
    }
    return 0;
}

/* The ACT block ord of item j's layer at token t0 + [0, n) as a recomputation input: from the
 * device copy (ACT_GPU) or the arena into staging, converted into act_f32. */
static int act_rows_load(rekv_pipeline *p, const rekv_pseq *s, int j, int layer, int b,
                         const uint8_t *base, uint64_t ord, int t0, int n, unit_io *io)
{
    const rekv_kv_geometry *geo = &p->geo;
    size_t dsz = p->act_esz, H = geo->hidden;
    size_t gpu_layer_rows = (size_t)p->cfg.act_gpu_blocks * REKV_KV_BLOCK_TOKENS;
    int in_blk = t0 % REKV_KV_BLOCK_TOKENS, kvh = (int)geo->n_kv_heads;
    uint8_t *act_stage = p->par[b].act_stage.p;
    if (RESERVE(&io->h2d_act, 1) || RESERVE(&io->conv_act, 1))
        return -ENOMEM;
    size_t bytes = (size_t)n * H * dsz;
    const uint8_t *src;
    if (ord < (uint64_t)p->cfg.act_gpu_blocks) { /* ACT_GPU: already on the device */
        src = s->act_dev + ((size_t)layer * gpu_layer_rows + (size_t)ord * REKV_KV_BLOCK_TOKENS +
                            (size_t)in_blk) *
                               H * dsz;
    } else {
        io->h2d_act.v[io->h2d_act.n++] = (rekv_copy_piece){
            act_stage + io->act_off, base + rekv_kv_act_offset(geo, (uint32_t)in_blk), bytes};
        src = act_stage + io->act_off;
        io->act_off += bytes;
        p->counters[layer].h2d_bytes[REKV_XFER_ACT] += bytes;
    }
    io->conv_act.v[io->conv_act.n++] = (rekv_convert_piece){
        (float *)p->act_f32.p + (size_t)io->n_act * H, src, (uint32_t)((size_t)n * H)};
    for (int i = 0; i < n; i++) {
        for (int h = 0; io->act_slot && h < kvh; h++)
            io->act_slot[(size_t)io->n_act * (size_t)kvh + (size_t)h] = t0 + i;
        io->act_seq[io->n_act] = j;
        io->act_pos[io->n_act++] = t0 + i;
    }
    p->counters[layer].tokens_recomputed += (uint64_t)n;
    return 0;
}

/* The context loads of item (batch index j) at one layer, whole — from where its sliding window
 * starts (pl_window_lo; 0 without one): the device-resident part's [lo, dev) copied on the device,
 * then each block of [max(lo, dev), ctx) — activation rows to recompute from (ACT blocks, the
 * split's [dev, split) where activations are kept) or K,V rows straight into the attention buffer.
 * considered: count what the link serves as tokens_considered (the modes that select, at a layer
 * or step they fetch whole). */
static int item_loads(rekv_pipeline *p, step *st, int item, int j, int layer, int b,
                      const rekv_attn_seq *dj, int considered, unit_io *io, act_counter *ac)
{
    const rekv_kv_geometry *geo = &p->geo;
    int L = p->c->n_layers, kvh = (int)geo->n_kv_heads, hd = (int)geo->head_dim, kvpr = p->keep_act;
    size_t rb = p->kv_rowb;
    rekv_pseq *s = st->items[item].seq;
    const range_ref *kr = &st->kv_ref[item * L + layer], *ar = &st->act_ref[item * L + layer];
    rekv_layer_counters *cnt = &p->counters[layer];
    int ctx = s->len, l_split = kvpr ? (st->split[item] < ctx ? st->split[item] : ctx) : 0, rc;
    /* the device-resident part [lo, dev): a device copy into the attention buffer */
    int dev = pl_dev_part(s, ctx), lo = pl_window_lo(p->c, s, layer);
    if ((rc = pl_dev_part_load(p, s, layer, dj->kv, lo, dev, io)))
        return rc;
    if (considered) /* what the link serves (layer 0, a prefill's context) */
        cnt->tokens_considered += (uint64_t)(ctx - dev);
    /* the rest: walk the blocks of the range [max(lo, dev), ctx) */
    for (int t0 = lo > dev ? lo : dev; t0 < ctx;) {
        int use_act = kvpr && t0 < l_split;
        const rekv_kv_plan_block *blk = pl_block_at(p, use_act ? ar : kr, t0);
        if (blk == NULL)
            return -EPROTO;
        int in_blk = t0 % REKV_KV_BLOCK_TOKENS;
        int n = REKV_KV_BLOCK_TOKENS - in_blk;
        int lim = use_act ? l_split : ctx;
        if (t0 + n > lim)
            n = lim - t0;
        const uint8_t *base = p->arena + blk->offset;
        if (blk->type == REKV_KV_BLOCK_ACT) {
            uint64_t ord = act_ordinal(p, ac, (size_t)(t0 / REKV_KV_BLOCK_TOKENS));
            if ((rc = act_rows_load(p, s, j, layer, b, base, ord, t0, n, io)))
                return rc;
        } else {
            /* straight into the attention buffer: the block's layout and dtype */
            uint8_t *dst =
                (uint8_t *)dj->kv + rekv_kv_off(rekv_kv_row(kvh, hd, 0, t0 - in_blk), hd, rb);
            size_t bytes = block_rows_copy(&io->h2d_kv, dst, base, in_blk, n, kvh, rb);
            if (bytes == 0)
                return -ENOMEM;
            cnt->h2d_bytes[REKV_XFER_KV] += bytes;
            cnt->tokens_fetched += (uint64_t)n;
        }
        t0 += n;
    }
    return 0;
}

/* The stores of item's new rows at one layer, a block's worth at a time: K,V from the attention
 * buffer (where kv_scatter put them, in the block's layout) into KV blocks, the attention input
 * from the output staging into ACT blocks (activations kept beside K,V: both); the device-resident
 * part's and ACT_GPU's device copies too. */
static int item_stores(rekv_pipeline *p, step *st, int item, int layer, int b,
                       const rekv_attn_seq *dj, unit_io *io, act_counter *ac)
{
    const rekv_kv_geometry *geo = &p->geo;
    int L = p->c->n_layers, kvh = (int)geo->n_kv_heads, hd = (int)geo->head_dim, kvpr = p->keep_act;
    size_t dsz = p->act_esz, rb = p->kv_rowb, H = geo->hidden;
    rekv_pseq *s = st->items[item].seq;
    const range_ref *kr = &st->kv_ref[item * L + layer], *ar = &st->act_ref[item * L + layer];
    rekv_layer_counters *cnt = &p->counters[layer];
    const uint8_t *out = p->par[b].out_stage.p;
    uint64_t n_gpu = (uint64_t)p->cfg.act_gpu_blocks;
    size_t gpu_layer_rows = (size_t)n_gpu * REKV_KV_BLOCK_TOKENS;
    int rc, dctx = s->dev_tokens < s->len ? s->dev_tokens : s->len;
    /* a stale device part (pl_dev_part): the context this unit made whole in the attention
     * buffer — fetched, recomputed — fills it, after the layer as the new rows */
    for (int t0 = 0; s->dev_stale && t0 < dctx; t0 += REKV_KV_BLOCK_TOKENS)
        if ((rc = pl_dev_part_store(
                 p, s, layer, dj->kv, t0,
                 dctx - t0 < REKV_KV_BLOCK_TOKENS ? dctx - t0 : REKV_KV_BLOCK_TOKENS, io)))
            return rc;
    for (int i = 0; i < st->items[item].n_tokens;) {
        int t = s->len + i, r = st->row0[item] + i, in_blk = t % REKV_KV_BLOCK_TOKENS;
        int n = REKV_KV_BLOCK_TOKENS - in_blk;
        if (n > st->items[item].n_tokens - i)
            n = st->items[item].n_tokens - i;
        i += n;
        const rekv_kv_plan_block *kb = pl_block_at(p, kr, t);
        const rekv_kv_plan_block *ab = kvpr ? pl_block_at(p, ar, t) : NULL;
        if (kb == NULL || (kvpr && ab == NULL))
            return -EPROTO;
        if (kb->type == REKV_KV_BLOCK_ACT && !kvpr)
            ab = kb, kb = NULL;
        /* the device-resident part keeps its K,V too */
        if ((rc = pl_dev_part_store(p, s, layer, dj->kv, t, n, io)))
            return rc;
        if (kb) {
            const uint8_t *src =
                (const uint8_t *)dj->kv + rekv_kv_off(rekv_kv_row(kvh, hd, 0, t - in_blk), hd, rb);
            size_t bytes =
                block_rows_copy(&io->d2h_kv, p->arena + kb->offset, src, in_blk, n, kvh, rb);
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
                p->arena + ab->offset + rekv_kv_act_offset(geo, (uint32_t)in_blk), rows_h, bytes};
            cnt->d2h_bytes[REKV_XFER_ACT] += bytes;
            uint64_t ord = act_ordinal(p, ac, (size_t)(t / REKV_KV_BLOCK_TOKENS));
            if (ord < n_gpu) { /* ACT_GPU: the device copy too (the store stays complete) */
                if (RESERVE(&io->d2d_new, 1))
                    return -ENOMEM;
                io->d2d_new.v[io->d2d_new.n++] = (rekv_copy_piece){
                    s->act_dev + ((size_t)layer * gpu_layer_rows +
                                  (size_t)ord * REKV_KV_BLOCK_TOKENS + (size_t)in_blk) *
                                     H * dsz,
                    rows_h, bytes};
            }
        }
    }
    return 0;
}

/* Item (batch index j) of unit (layer, g) fetched whole: every context token's K,V rows (KV) or
 * activation row (ACT), from the device part, the arena or ACT_GPU's copy, and the stores of its
 * new rows into the arena (item_loads, item_stores). */
int pl_item_plan_whole(rekv_pipeline *p, step *st, int item, int j, int layer, int b,
                       rekv_attn_seq *d, int considered, unit_io *io)
{
    int L = p->c->n_layers, rc;
    const range_ref *kr = &st->kv_ref[item * L + layer], *ar = &st->act_ref[item * L + layer];
    act_counter ac = {p->keep_act ? ar : kr, 0, 0};
    if ((rc = item_loads(p, st, item, j, layer, b, &d[j], considered, io, &ac)))
        return rc;
    return item_stores(p, st, item, layer, b, &d[j], io, &ac);
}

/* The streaming exact modes' unit plan (offload, kvpr, act, hybrid): every item whole. */
int pl_unit_plan_whole(rekv_pipeline *p, step *st, int g, int layer, int b, rekv_attn_seq *d,
                       unit_io *io)
{
    int rc = pl_unit_act_alloc(p, st, g, 0, io);
    for (int j = 0; rc == 0 && j < st->g_begin[g + 1] - st->g_begin[g]; j++)
        rc = pl_item_plan_whole(p, st, st->g_begin[g] + j, j, layer, b, d, 0, io);
    return rc;
}

/* Moves a convert list, which kernels read, into the step's metadata memory. */
static int keep_conv(step *st, conv_list *l)
{
    if (l->v == NULL)
        return 0;
    rekv_convert_piece *a = pl_smem_alloc(&st->mem, sizeof(*a) * (l->n ? l->n : 1));
    if (a)
        memcpy(a, l->v, sizeof(*a) * l->n);
    free(l->v);
    l->v = a;
    return a ? 0 : -ENOMEM;
}

/* Hands unit_io's lists to the step's memory: the streams read them until the step ends. */
int pl_unit_io_keep(step *st, unit_io *io)
{
    int rc = keep_conv(st, &io->conv_act);
    void *ptrs[] = {io->h2d_kv.v,  io->h2d_act.v, io->d2h_kv.v,
                    io->d2h_act.v, io->d2d_new.v, io->d2d_kv.v};
    for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++)
        rc |= pl_smem_adopt(&st->mem, ptrs[i]);
    return rc ? -ENOMEM : 0;
}

/* push: the store drops its imports of these handles (before the buffers are freed) */
int pl_push_release(rekv_pipeline *p, const rekv_ipc_handle *const *h, size_t n, rekv_err *err)
{
    const void *hs[8];
    size_t k = 0;
    for (size_t i = 0; i < n && k < 8; i++)
        if (h[i]->magic == REKV_IPC_MAGIC)
            hs[k++] = h[i];
    return k ? rekv_kvstore_release(p->store, hs, k, err) : 0;
}

/* push: has the store write the unit's KV rows (io->h2d_kv, as pull would copy them) into parity
 * b's attention buffers once ev_attn_free[b] allows, then record ev_pushed[b]; returns once the
 * store has enqueued that. */
int pl_push_unit(rekv_pipeline *p, int b, const unit_io *io, rekv_err *err)
{
    if (pl_reserve_bytes((void **)&p->push_pieces, &p->push_cap, io->h2d_kv.n,
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
