/* pipeline_infinigen.c — the speculation of the infinigen mode (InfiniGen, OSDI'24 §4.3):
 * speculate on layer i's attention at layer i-1 and fetch only the KV rows it selects. clo
 * (mode_clo.c) shares the speculation, with whole queries (ig.queries); infinigen's entry in the
 * mode table, and its unit plan, are mode_infinigen.c's.
 *
 * Data flow of a decode step. Every new K row also leaves, through the skew's A[:, cols] of its
 * layer (head_proj), as a partial key into the sequence's partial key cache on the device
 * ([n_layers][cap][n_kv][rk] fp32). At unit (layer i-1, batch g) the compute stream first makes
 * the attention input, then — before it waits for layer i-1's own KV — the partial query of layer
 * i from it (a partial weight W_Q·A[:, cols] for models without RoPE; for RoPE models the full
 * query of layer i, rotated, then A[:, cols]), scores it against layer i's partial keys
 * (spec_scores) and records ev[g]. Neither the step thread nor the device waits for the host
 * (CLO's "GPU-centric synchronisation", mode_clo.c, taken one step further: clo's decisions are
 * still a host function): the step thread plans unit (layer i, g) with what does not depend on
 * the selection — the device part's copy, the new row's stores, the descriptors — and enqueues
 * on the h2d stream, behind a wait for ev[g], the ig_select kernel (pl_ig_unit_fetch; kernels.h)
 * that selects per KV head the tokens to fetch (rekv_ig_select's count and ranking: on cpu that
 * function itself, on cuda the same steps in three kernels), writes each sequence's new-row slot
 * (the descriptor's start and kv_scatter's slot, memory the kernels read later in stream order)
 * and the selected rows' copies, then the listed copy (copy_h2d_listed; on cuda the gather kernel
 * reading the registered arena through its mapping, with the list the kernel wrote) that moves
 * those rows; ev_read[g], recorded between the two, lets the next layer's speculation overwrite
 * the scores. The compute stream waits for that as for any unit's loads: the fetch of layer i
 * overlaps layer i-1's attention and FFN, and nothing of it crosses back to the host but the
 * counts, read after the step (pl_ig_step_done).
 *
 * The step thread selects itself — the scores copied to the host, waiting for ev[g] when it plans
 * the unit — where what it enqueues depends on the selection or the selection on the host's state
 * (st->ig_wait, ig_step_waits): with push (the store is sent the rows to write), with KVPR within
 * the selection on an MHA model (below: which tokens a unit recomputes sets its GEMMs' size, an
 * argument fixed at enqueue; on GQA no selected token is ever recomputed, so a split does not make
 * it wait) and on a device that cannot select or read the arena itself (no ig_select kernel or
 * listed copy, or a cuda arena not page-locked). On cpu the selection and the rows are the same
 * either way, bit for bit.
 *
 * The selected rows are packed: the sequence's attention buffer holds, in slot dev + j of KV head
 * g, the j-th selected token of head g (tokens ascending), and the new row goes in slot dev + m.
 * Keys carry their RoPE already, so attention over slots is attention over the selected tokens;
 * with every token selected the slots are the positions and the bits are resident's. The new row
 * is also written at its position (layer_compute's second kv_scatter), from where it leaves for
 * the arena and the device part: the stores are enqueued before the selection is made, so their
 * source cannot be its slot. Layer 0 and prefill steps fetch everything.
 *
 * KVPR within the selection (cfg.split > 0, issue 14): the store keeps every token's attention
 * input beside its K,V, as for kvpr. A layer fetched whole recomputes [device part, split) as kvpr
 * does; a selecting layer gets the tokens most of its KV heads chose — whose activation row is
 * fewer bytes than their selected K,V rows — as activation rows, up to split of them, and
 * recomputes them on the compute stream into the slots of the heads that chose them
 * (kv_scatter's per-head slots; the other heads' slots are not written). Which tokens each head
 * attends is the selection's alone, so the values are those without a split, bit for bit.
 *
 * Selection (§4.3): the count is the paper's — per query head, the tokens scoring above its best
 * minus alpha, averaged over the query heads (every KV head fetches as many) and capped at
 * max_fraction of the context. The ranking deviates from the paper's per-head maximum: KV head g
 * ranks its tokens by the sum over its query group of each head's softmax of the speculated
 * scores (the attention the group would give them; rekv_ig_select says why), and takes its top m
 * (lowest position first on ties). With one query head per KV head the two are the same order.
 * REKV_SELECT_RANDOM takes as many at random, REKV_SELECT_ALL all of them.
 *
 * The KV pool limit (cfg.kv_pool_bytes, §4.4; kv_pool.h): each (sequence, layer > 0, KV head)
 * keeps at most a limit of entries; the selection sees only those (ig_select_pooled), counts
 * what it prefetched, and each new token's entry evicts one once the pool is full — on the
 * device too (the pools are host_alloc memory; the cuda kernels follow kv_pool.c). The evicted
 * rows are masked, not reclaimed: they stay in the store and the partial key cache (rekv's
 * blocks of 16 tokens may be shared with the prefix cache, which must not be overwritten), so
 * the limit bounds what is attended and fetched, not the store's bytes. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/pipeline_internal.h"
#include "gpuworker/skew.h"

/* ------------------------------------------------------------------ create / free */

/* cfg.kv_pool_bytes as entries per (layer > 0, KV head) into ig.pool_limit (0: none). The pool
 * covers the selecting layers only: layer 0 is fetched and attended whole every step, so its
 * counters would all rise together and name no victim. */
static int ig_pool_limit(rekv_pipeline *p, int queries, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    size_t bytes = p->cfg.kv_pool_bytes;
    p->ig.pool_limit = 0;
    if (bytes == 0)
        return 0;
    if (queries || p->cfg.device_tokens > 0 || c->n_layers < 2)
        return rekv_errf(err, -EINVAL,
                         "pipeline: a KV pool limit is infinigen's, with no device-resident part "
                         "and more than one layer");
    if ((unsigned)p->cfg.kv_pool_policy > REKV_KV_POOL_FIFO)
        return rekv_errf(err, -EINVAL, "pipeline: unknown KV pool policy %d",
                         (int)p->cfg.kv_pool_policy);
    size_t entry = (size_t)(c->n_layers - 1) * 2 * (size_t)c->n_kv_heads * p->kv_rowb;
    if (bytes / entry < REKV_KV_BLOCK_TOKENS)
        return rekv_errf(err, -EINVAL,
                         "pipeline: a KV pool of %zu bytes holds less than one block (%d tokens "
                         "of layers 1..%d: %zu bytes)",
                         bytes, REKV_KV_BLOCK_TOKENS, c->n_layers - 1,
                         (size_t)REKV_KV_BLOCK_TOKENS * entry);
    p->ig.pool_limit = bytes / entry > (size_t)c->max_pos ? c->max_pos : (int)(bytes / entry);
    return 0;
}

/* The speculation's weights for every layer; queries: the speculation also copies whole queries
 * to the host (clo's similarity test), so the partial query weight is never folded. */
int pl_ig_create(rekv_pipeline *p, int queries, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    const rekv_skew *sk = p->cfg.skew;
    if (sk == NULL)
        return rekv_errf(err, -EINVAL, "pipeline: infinigen needs the model's skew");
    if (sk->n_layers != c->n_layers || sk->n_kv_heads != c->n_kv_heads ||
        sk->head_dim != c->head_dim || sk->rk < 1 || sk->rk > c->head_dim)
        return rekv_errf(err, -EINVAL,
                         "pipeline: the skew (%d layers, %d KV heads, head dim %d) is not this "
                         "model's (%d, %d, %d)",
                         sk->n_layers, sk->n_kv_heads, sk->head_dim, c->n_layers, c->n_kv_heads,
                         c->head_dim);
    if (p->cfg.lookahead < 0) /* the mode's: clo tests each head's own query */
        p->cfg.lookahead = queries ? 0 : 1;
    if (!(p->cfg.alpha > 0) || !(p->cfg.max_fraction > 0 && p->cfg.max_fraction <= 1) ||
        (unsigned)p->cfg.select > REKV_SELECT_ALL || (unsigned)p->cfg.lookahead > 1)
        return rekv_errf(err, -EINVAL,
                         "pipeline: infinigen needs alpha > 0, a fetch cap in (0, 1] and a "
                         "lookahead of 0 or 1 (alpha %g, cap %g)",
                         (double)p->cfg.alpha, (double)p->cfg.max_fraction);
    int L = c->n_layers, nkv = c->n_kv_heads, hd = c->head_dim, rk = sk->rk, nh = c->n_heads;
    int group = nh / nkv, Q = rekv_config_q_dim(c), H = c->hidden;
    int rc = ig_pool_limit(p, queries, err);
    if (rc)
        return rc;
    p->ig.rk = rk;
    /* whole queries need W_Q itself, not the folded partial weight */
    p->ig.queries = queries;
    p->ig.fold = c->rope == REKV_ROPE_NONE && !queries;
    p->ig.layers = calloc((size_t)L, sizeof(ig_layer));
    float *ac = malloc(sizeof(float) * (size_t)nkv * (size_t)hd * (size_t)rk);
    float *wq = NULL, *wp = NULL, *bp = NULL, *at = NULL, *wt = NULL;
    size_t wdsz = rekv_dtype_size(p->e->wdtype);
    if (p->ig.layers == NULL || ac == NULL)
        goto nomem;
    if (p->ig.fold) {
        wq = malloc(sizeof(float) * (size_t)Q * (size_t)H);
        wp = malloc(sizeof(float) * (size_t)nh * (size_t)rk * (size_t)H);
        bp = malloc(sizeof(float) * (size_t)nh * (size_t)rk);
        at = malloc(sizeof(float) * (size_t)rk * (size_t)hd);
        /* wt: a head's rows of W_Q transposed, and first the scratch that untiles W_Q */
        wt = malloc(sizeof(float) * (size_t)H * (size_t)(hd > 8 ? hd : 8));
        if (wq == NULL || wp == NULL || bp == NULL || at == NULL || wt == NULL)
            goto nomem;
    }
    for (int l = 0; l < L; l++) {
        ig_layer *il = &p->ig.layers[l];
        const layer_w *src = &p->e->layers[l];
        size_t nb = sizeof(float) * (size_t)H;
        if (c->pre_norm) { /* every layer's attention norm, the speculation's input */
            il->norm_w = p->bi->dev_alloc(p->be, nb);
            il->norm_b = src->attn_norm_b ? p->bi->dev_alloc(p->be, nb) : NULL;
            if (il->norm_w == NULL || (src->attn_norm_b && il->norm_b == NULL))
                goto nomem;
            rekv_copy_piece pn[2] = {{il->norm_w, src->attn_norm_w, nb},
                                     {il->norm_b, src->attn_norm_b, nb}};
            p->bi->copy_h2d(p->s_h2d, pn, src->attn_norm_b ? 2 : 1, REKV_XFER_WEIGHTS);
        }
        if (l == 0) /* never speculated */
            continue;
        for (int g = 0; g < nkv; g++)
            rekv_skew_partial(sk, l, g, ac + (size_t)g * (size_t)hd * (size_t)rk);
        size_t abytes = sizeof(float) * (size_t)nkv * (size_t)hd * (size_t)rk;
        if ((il->a = p->bi->dev_alloc(p->be, abytes)) == NULL)
            goto nomem;
        rekv_copy_piece pc = {il->a, ac, abytes};
        p->bi->copy_h2d(p->s_h2d, &pc, 1, REKV_XFER_WEIGHTS);
        if (p->ig.fold) {
            /* fold A[:, cols] into W_Q: Wp[h][c][:] = sum_d A[d][c] W_Q[h * hd + d][:] (and the
             * bias), so the partial query is one small GEMM of the attention input: rekv's GEMM
             * y = x·w^T with x = A[:, cols]^T and w = the head's rows of W_Q transposed */
            rekv_to_f32(wq, src->wq, p->e->wdtype, (size_t)Q * (size_t)H);
            if (rekv_engine_w_tiled(p->e, src->wq)) /* rows are read here: row-major */
                cpu_tile_unpack(wq, REKV_DTYPE_F32, Q, H, wt);
            for (int h = 0; h < nh; h++) {
                const float *a = ac + (size_t)(h / group) * (size_t)hd * (size_t)rk;
                const float *wh = wq + (size_t)h * (size_t)hd * (size_t)H;
                for (size_t d = 0; h % group == 0 && d < (size_t)hd; d++) /* a group's A, once */
                    for (size_t cc = 0; cc < (size_t)rk; cc++)
                        at[cc * (size_t)hd + d] = a[d * (size_t)rk + cc];
                for (size_t d = 0; d < (size_t)hd; d++)
                    for (size_t j = 0; j < (size_t)H; j++)
                        wt[j * (size_t)hd + d] = wh[d * (size_t)H + j];
                cpu_gemm_rowinv(wp + (size_t)h * (size_t)rk * (size_t)H, at, wt, REKV_DTYPE_F32,
                                NULL, rk, H, hd);
                for (int cc = 0; cc < rk; cc++) {
                    double acc = 0;
                    for (int d = 0; src->bq && d < hd; d++)
                        acc += (double)a[(size_t)d * (size_t)rk + (size_t)cc] *
                               ((const float *)src->bq)[(size_t)h * (size_t)hd + (size_t)d];
                    bp[(size_t)h * (size_t)rk + (size_t)cc] = (float)acc;
                }
            }
            size_t wb = sizeof(float) * (size_t)nh * (size_t)rk * (size_t)H;
            size_t bb = sizeof(float) * (size_t)nh * (size_t)rk;
            il->wp = p->bi->dev_alloc(p->be, wb);
            il->bp = p->bi->dev_alloc(p->be, bb);
            il->own_wp = 1;
            if (il->wp == NULL || il->bp == NULL)
                goto nomem;
            rekv_copy_piece pw[2] = {{il->wp, wp, wb}, {il->bp, bp, bb}};
            p->bi->copy_h2d(p->s_h2d, pw, 2, REKV_XFER_WEIGHTS);
            /* the host copies are reused for the next layer: wait for this one's */
            if ((rc = p->bi->stream_sync(p->s_h2d, err)))
                goto out;
        } else if (p->dev_layers) { /* the full W_Q of layer l, already on the device */
            il->wp = p->dev_layers[l].wq;
            il->bp = p->dev_layers[l].bq;
        } else { /* weights offloaded: a resident copy of every W_Q */
            size_t wb = (size_t)Q * (size_t)H * wdsz;
            il->wp = p->bi->dev_alloc(p->be, wb);
            il->own_wp = 1;
            if (il->wp == NULL)
                goto nomem;
            rekv_copy_piece pw = {il->wp, src->wq, wb};
            p->bi->copy_h2d(p->s_h2d, &pw, 1, REKV_XFER_WEIGHTS);
            if (src->bq) {
                if ((il->bp = p->bi->dev_alloc(p->be, sizeof(float) * (size_t)Q)) == NULL)
                    goto nomem;
                rekv_copy_piece pb = {il->bp, src->bq, sizeof(float) * (size_t)Q};
                p->bi->copy_h2d(p->s_h2d, &pb, 1, REKV_XFER_WEIGHTS);
            }
        }
        if ((rc = p->bi->stream_sync(p->s_h2d, err))) /* ac is reused */
            goto out;
    }
    goto out;
nomem:
    rc = rekv_errf(err, -ENOMEM, "pipeline: out of memory for infinigen's partial weights");
out:
    free(ac);
    free(wq);
    free(wp);
    free(bp);
    free(at);
    free(wt);
    return rc;
}

void pl_ig_free(rekv_pipeline *p)
{
    if (p->ig.layers) {
        for (int l = 0; l < p->c->n_layers; l++) {
            ig_layer *il = &p->ig.layers[l];
            if (il->a)
                p->bi->dev_free(p->be, il->a);
            if (il->own_wp && il->wp)
                p->bi->dev_free(p->be, il->wp);
            if (il->own_wp && il->bp)
                p->bi->dev_free(p->be, il->bp);
            if (il->norm_w)
                p->bi->dev_free(p->be, il->norm_w);
            if (il->norm_b)
                p->bi->dev_free(p->be, il->norm_b);
        }
        free(p->ig.layers);
    }
    pl_dbuf_free(p, &p->ig.hn);
    pl_dbuf_free(p, &p->ig.q);
    pl_dbuf_free(p, &p->ig.qp);
    pl_dbuf_free(p, &p->ig.scores);
    pl_dbuf_free(p, &p->ig.sscr);
    if (p->ig.host)
        rekv_host_free(p->be, p->ig.host);
    for (int g = 0; g < MAX_GPU_BATCHES; g++) {
        if (p->ig.ev[g])
            p->bi->event_destroy(p->ig.ev[g]);
        if (p->ig.ev_read[g])
            p->bi->event_destroy(p->ig.ev_read[g]);
    }
    free(p->ig.scratch);
    free(p->ig.sel);
    memset(&p->ig, 0, sizeof(p->ig));
}

size_t rekv_ig_partial_key_bytes(const rekv_model_config *c, int rk, int cap)
{
    return sizeof(float) * (size_t)c->n_layers * (size_t)cap * (size_t)c->n_kv_heads * (size_t)rk;
}

static float *pk_at(const rekv_pipeline *p, const rekv_pseq *s, int layer, int pos)
{
    size_t w = (size_t)p->c->n_kv_heads * (size_t)p->ig.rk;
    return s->pk + ((size_t)layer * (size_t)s->cap + (size_t)pos) * w;
}

/* ------------------------------------------------------------------ the prefix cache */

/* Layer l's partial keys of s's first s->len tokens from the K rows of its store blocks (taken
 * from the prefix cache): the blocks copied whole into raw, a buffer in the KV layout
 * (kvlayout.h) that desc (device memory) describes, their K rows read back widened (kv_gather,
 * as the attention reads them) into kf ([len][n_kv][hd]) and projected as layer_compute projects
 * a new row's (the same kernels on the same values: the same bits), into the layer's partial keys
 * of positions 0..len-1 (consecutive rows of the cache). */
static int ig_prefix_layer(rekv_pipeline *p, rekv_pseq *s, int l, uint8_t *raw,
                           const rekv_attn_seq *desc, float *kf, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    int nkv = c->n_kv_heads, hd = c->head_dim, T = s->len;
    size_t blk = rekv_kv_block_bytes(&p->geo);
    rekv_kv_range r = {s->id, (uint32_t)l, 0, (uint64_t)T};
    rekv_kv_plan_block *pb = NULL;
    size_t n = 0, cap = 0;
    int rc = rekv_kvstore_plan(p->store, &r, 1, 1, &pb, &n, &cap, err);
    if (rc)
        return rc;
    rekv_copy_piece *pc = calloc(n ? n : 1, sizeof(*pc));
    if (pc == NULL)
        rc = rekv_errf(err, -ENOMEM, "out of memory");
    for (size_t i = 0; rc == 0 && i < n; i++)
        pc[i] = (rekv_copy_piece){raw + (size_t)pb[i].block * blk, p->arena + pb[i].offset, blk};
    if (rc == 0) {
        p->bi->copy_h2d(p->s_h2d, pc, n, REKV_XFER_KV);
        rc = p->bi->stream_sync(p->s_h2d, err);
    }
    int urc = rekv_kvstore_unpin(p->store, &r, 1, rc ? NULL : err);
    rc = rc ? rc : urc;
    if (rc == 0) {
        p->k->kv_gather(p->s_compute, kf, T, NULL, NULL, desc, nkv, hd, p->geo.dtype);
        p->k->head_proj(p->s_compute, pk_at(p, s, l, 0), NULL, kf, p->ig.layers[l].a, T, nkv, 1,
                        hd, p->ig.rk);
        rc = p->bi->stream_sync(p->s_compute, err); /* raw and kf are the next layer's */
    }
    free(pc);
    free(pb);
    return rc;
}

int pl_ig_prefix_fill(rekv_pipeline *p, rekv_pseq *s, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    int L = c->n_layers, nkv = c->n_kv_heads, T = s->len;
    size_t nblk = ((size_t)T + 15) / 16, blk = rekv_kv_block_bytes(&p->geo);
    if (T <= 0 || L < 2)
        return 0;
    uint8_t *raw = p->bi->dev_alloc(p->be, nblk * blk);
    float *kf =
        p->bi->dev_alloc(p->be, (size_t)T * (size_t)nkv * (size_t)c->head_dim * sizeof(float));
    rekv_attn_seq *desc = p->bi->dev_alloc(p->be, sizeof(*desc));
    rekv_attn_seq whole = {.kv = raw}; /* the buffer's positions 0..T-1 */
    int rc = 0;
    if (raw == NULL || kf == NULL || desc == NULL)
        rc = rekv_errf(err, -ENOMEM,
                       "out of device memory for the partial keys of %d cached "
                       "tokens",
                       T);
    if (rc == 0) {
        rekv_copy_piece pc = {desc, &whole, sizeof(whole)};
        p->bi->copy_h2d(p->s_h2d, &pc, 1, REKV_XFER_KV);
        rc = p->bi->stream_sync(p->s_h2d, err);
    }
    for (int l = 1; rc == 0 && l < L; l++) /* layer 0 is never speculated: it keeps none */
        rc = ig_prefix_layer(p, s, l, raw, desc, kf, err);
    if (desc)
        p->bi->dev_free(p->be, desc);
    if (kf)
        p->bi->dev_free(p->be, kf);
    if (raw)
        p->bi->dev_free(p->be, raw);
    return rc;
}

/* ------------------------------------------------------------------ a step */

/* infinigen: whether item i fetches sparsely at layers > 0: a decode row over a context. */
int pl_ig_sparse(const rekv_pipeline *p, const step *st, int i)
{
    (void)p;
    return st->items[i].n_tokens == 1 && st->items[i].seq->len > 0;
}

/* The partial keys of a sequence (infinigen, clo), and their release. */
int pl_ig_seq_alloc(rekv_pipeline *p, rekv_pseq *s, rekv_err *err)
{
    s->pk = p->bi->dev_alloc(p->be, rekv_ig_partial_key_bytes(p->c, p->ig.rk, s->cap));
    if (s->pk == NULL)
        return rekv_errf(err, -ENOMEM, "out of device memory for the partial keys of %d tokens",
                         s->cap);
    if (p->ig.pool_limit > 0) { /* in memory the device's selection reads and writes */
        int n = p->c->n_layers * p->c->n_kv_heads;
        if ((s->pool_mem = rekv_host_alloc(p->be, rekv_kv_pool_bytes(n, s->cap))) == NULL)
            return rekv_errf(err, -ENOMEM, "out of memory for the KV pool of %d tokens", s->cap);
        return rekv_kv_pool_init(&s->pool, s->pool_mem, n, s->cap, p->ig.pool_limit,
                                 p->cfg.kv_pool_policy, err);
    }
    return 0;
}

void pl_ig_seq_free(rekv_pipeline *p, rekv_pseq *s)
{
    if (s->pk)
        p->bi->dev_free(p->be, s->pk);
    s->pk = NULL;
    rekv_kv_pool_free(&s->pool);
    rekv_host_free(p->be, s->pool_mem);
    s->pool_mem = NULL;
}

const rekv_kv_pool *rekv_pseq_kv_pool(const rekv_pseq *s)
{
    return s->pool.count ? &s->pool : NULL;
}

/* Whether infinigen's step thread selects (st->ig_wait), waiting for each selecting unit's
 * scores, because what it enqueues depends on the selection: push (the store is sent the rows),
 * KVPR within the selection (how many rows the unit recomputes, the GEMMs' size; only where a
 * token's activation row can be fewer bytes than its selected K,V rows, ig_recompute_pick: MHA,
 * never GQA) or a device that cannot select and read
 * the arena itself (the ig_select kernel and copy_h2d_listed; on cuda the arena registered).
 * Else the device selects. */
static int ig_step_waits(const rekv_pipeline *p, const step *st)
{
    const rekv_model_config *c = p->c;
    if (p->cfg.push || p->k->ig_select == NULL || p->bi->copy_h2d_listed == NULL ||
        p->arena_dev == NULL)
        return 1;
    int recomputes = p->keep_act && 2 * c->n_kv_heads * c->head_dim > c->hidden;
    for (int i = 0; recomputes && i < st->n_items; i++)
        if (st->ig_off[i] != SIZE_MAX && st->split[i] > 0)
            return 1;
    return 0;
}

/* The step's speculation memory: each sparse item's scores at st->ig_off[i]. */
int pl_ig_prepare(rekv_pipeline *p, step *st, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    int nh = c->n_heads, rk = p->ig.rk;
    st->ig_off = pl_smem_alloc(&st->mem, sizeof(size_t) * (size_t)st->n_items);
    st->ig_scr = pl_smem_alloc(&st->mem, sizeof(size_t) * (size_t)st->n_items);
    if (st->ig_off == NULL || st->ig_scr == NULL)
        return rekv_errf(err, -ENOMEM, "step: out of memory");
    size_t total = 0, max_rows = 0, max_len = 1, scr = 0;
    for (int i = 0; i < st->n_items; i++) {
        const rekv_pseq *s = st->items[i].seq;
        /* a whole step attends every token: it must find them all still in the pool */
        if (s->pool.count && !p->ops->sparse(p, st, i) &&
            s->len + st->items[i].n_tokens > s->pool.limit)
            return rekv_errf(err, -EINVAL,
                             "step: %d tokens after %d do not fit the KV pool of %d tokens (a "
                             "step of several tokens attends them all; past the pool's limit "
                             "only decode steps)",
                             st->items[i].n_tokens, s->len, s->pool.limit);
        st->ig_off[i] = SIZE_MAX;
        if (p->ops->sparse(p, st, i)) {
            st->ig_off[i] = total;
            total += (size_t)nh * (size_t)st->items[i].seq->len;
            st->ig_scr[i] = scr;
            scr += rekv_ig_scratch_floats(st->items[i].seq->len, nh, c->n_kv_heads);
            if ((size_t)st->items[i].seq->len > max_len)
                max_len = (size_t)st->items[i].seq->len;
        }
    }
    for (int g = 0; g < st->n_g; g++)
        if ((size_t)st->g_rows[g] > max_rows)
            max_rows = (size_t)st->g_rows[g];
    int rc = pl_dbuf_ensure(p, &p->ig.qp, max_rows * (size_t)nh * (size_t)rk * sizeof(float)) |
             pl_dbuf_ensure(p, &p->ig.hn, max_rows * (size_t)c->hidden * sizeof(float)) |
             pl_dbuf_ensure(p, &p->ig.scores, (total ? total : 1) * sizeof(float));
    st->ig_wait = !p->ig.queries && ig_step_waits(p, st); /* clo: always the device */
    if (!st->ig_wait)
        rc |= pl_dbuf_ensure(p, &p->ig.sscr, (scr ? scr : 1) * sizeof(float));
    if (!p->ig.fold)
        rc |= pl_dbuf_ensure(p, &p->ig.q, max_rows * (size_t)rekv_config_q_dim(c) * sizeof(float));
    if (rc)
        return rekv_errf(err, -ENOMEM, "step: out of device memory for infinigen's speculation");
    if (total > p->ig.host_cap) {
        if (p->ig.host)
            rekv_host_free(p->be, p->ig.host);
        p->ig.host_cap = total + total / 4;
        p->ig.host = rekv_host_alloc(p->be, p->ig.host_cap * sizeof(float));
        if (p->ig.host == NULL) {
            p->ig.host_cap = 0;
            return rekv_errf(err, -ENOMEM, "step: out of host memory for infinigen's scores");
        }
    }
    /* per thread of the unit's selection (ig_unit_select): rekv_ig_select's scratch, then the
     * scores of the tokens past a device-resident part */
    size_t need =
        rekv_ig_scratch_floats((int)max_len, nh, c->n_kv_heads) * (size_t)cpu_gemm_threads();
    if (need > p->ig.scratch_cap) {
        float *sc = realloc(p->ig.scratch, need * sizeof(float));
        if (sc != NULL)
            p->ig.scratch = sc;
        int32_t *sel = realloc(p->ig.sel, max_len * (size_t)(c->n_kv_heads + 1) * sizeof(int32_t));
        if (sel != NULL)
            p->ig.sel = sel;
        if (sc == NULL || sel == NULL)
            return rekv_errf(err, -ENOMEM, "step: out of memory");
        p->ig.scratch_cap = need;
    }
    for (int g = 0; g < st->n_g; g++) {
        int erc = 0;
        if ((p->ig.ev[g] == NULL && (erc = p->bi->event_create(p->be, &p->ig.ev[g], err))) ||
            (p->ig.ev_read[g] == NULL &&
             (erc = p->bi->event_create(p->be, &p->ig.ev_read[g], err))))
            return erc;
    }
    return 0;
}

/* Whether unit (layer, g) speculates for layer + 1. */
int pl_ig_speculates(const rekv_pipeline *p, const step *st, int g, int layer)
{
    if (p->ig.layers == NULL || layer + 1 >= p->c->n_layers) /* a mode that does not speculate */
        return 0;
    for (int i = st->g_begin[g]; i < st->g_begin[g + 1]; i++)
        if (st->ig_off[i] != SIZE_MAX)
            return 1;
    return 0;
}

int pl_ig_lookahead(const rekv_pipeline *p, int layer)
{
    return layer == 1 ? 0 : p->cfg.lookahead;
}

/* On the compute stream, with batch g's residual stream in gb->x at the input of layer - lookahead:
 * the speculated scores of layer `layer` for the batch's sparse items (copied to the host where the
 * step thread selects, st->ig_wait), and clo's whole queries (ig.q); records ig.ev[g]. The query's
 * input is that layer's attention input (InfiniGen §3.3: consecutive layers'
 * attention inputs are alike; with lookahead 0 it is layer `layer`'s own). */
int pl_ig_speculate(rekv_pipeline *p, step *st, int g, int layer)
{
    const rekv_model_config *c = p->c;
    const rekv_kernel_iface *k = p->k;
    rekv_stream *s = p->s_compute;
    const ig_layer *il = &p->ig.layers[layer];
    int T = st->g_rows[g], nh = c->n_heads, hd = c->head_dim, rk = p->ig.rk;
    int group = nh / c->n_kv_heads, H = c->hidden;
    const float *h = p->gb[g].x.p;
    float *qp = p->ig.qp.p;
    /* the scores and queries are free once the last layer's decisions have read them (on the
     * h2d stream: the step thread does not wait for them) */
    p->bi->stream_wait_event(s, p->ig.ev_read[g]);
    if (c->pre_norm) {
        const ig_layer *nl = &p->ig.layers[layer - pl_ig_lookahead(p, layer)];
        k->norm(s, p->ig.hn.p, h, nl->norm_w, nl->norm_b, T, H, c->norm_eps);
        h = p->ig.hn.p;
    }
    float *q = p->ig.q.p;
    if (p->ig.fold) {
        k->linear(s, qp, h, il->wp, REKV_DTYPE_F32, il->bp, T, nh * rk, H);
    } else {
        pl_linear(p, s, q, h, il->wp, 0, 1, il->bp, T, rekv_config_q_dim(c), H);
        if (c->rope != REKV_ROPE_NONE)
            k->rope(s, q, st->pos[g], T, nh, hd, &p->e->rope, c->rope);
        k->head_proj(s, qp, NULL, q, il->a, T, nh, group, hd, rk);
    }
    int nb = st->g_begin[g + 1] - st->g_begin[g], n = 0;
    rekv_spec_seq *sq = pl_smem_alloc(&st->mem, sizeof(*sq) * (size_t)nb);
    if (sq == NULL)
        return -ENOMEM;
    size_t lo = SIZE_MAX, hi = 0;
    for (int j = 0; j < nb; j++) {
        int i = st->g_begin[g] + j;
        if (st->ig_off[i] == SIZE_MAX)
            continue;
        rekv_pseq *sqn = st->items[i].seq;
        sq[n++] = (rekv_spec_seq){pk_at(p, sqn, layer, 0), sqn->len, st->last[g][j], st->ig_off[i]};
        if (st->ig_off[i] < lo)
            lo = st->ig_off[i];
        size_t end = st->ig_off[i] + (size_t)nh * (size_t)sqn->len;
        if (end > hi)
            hi = end;
    }
    k->spec_scores(s, p->ig.scores.p, qp, sq, n, nh, group, rk, 1.0f / sqrtf((float)hd));
    if (st->ig_wait) { /* the step thread selects: the scores go to the host */
        rekv_copy_piece pc = {p->ig.host + lo, (float *)p->ig.scores.p + lo,
                              (hi - lo) * sizeof(float)};
        p->bi->copy_d2h(s, &pc, 1, REKV_XFER_OTHER);
    }
    p->bi->event_record(p->ig.ev[g], s);
    return 0;
}

/* Where the partial keys of unit (layer, g)'s new rows go: [rows] device pointers, in step
 * memory; NULL when the layer keeps none (layer 0) or out of memory (*rc). */
float **pl_ig_pk_rows(rekv_pipeline *p, step *st, int g, int layer, int *rc)
{
    if (layer == 0)
        return NULL;
    int T = st->g_rows[g];
    float **rows = pl_smem_alloc(&st->mem, sizeof(float *) * (size_t)T);
    if (rows == NULL) {
        *rc = -ENOMEM;
        return NULL;
    }
    for (int r = 0; r < T; r++)
        rows[r] = pk_at(p, st->items[st->g_begin[g] + st->row_seq[g][r]].seq, layer, st->pos[g][r]);
    return rows;
}

/* The start of a speculating mode's unit plan: the new rows go where the selection leaves room
 * (io->kv_pos, their positions until it moves them), their partial keys are kept (io->pk_rows).
 * 0 or -ENOMEM. */
int pl_ig_unit_begin(rekv_pipeline *p, step *st, int g, int layer, unit_io *io)
{
    int rc = 0;
    io->kv_pos = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)st->g_rows[g]);
    if (io->kv_pos == NULL)
        return -ENOMEM;
    memcpy(io->kv_pos, st->pos[g], sizeof(int32_t) * (size_t)st->g_rows[g]);
    io->pk_rows = pl_ig_pk_rows(p, st, g, layer, &rc);
    return rc;
}

/* ------------------------------------------------------------------ selection */

static uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The k-th largest (k >= 1) of v[0..n-1], reordering v (quickselect). */
static float kth_largest(float *v, int n, int k)
{
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = v[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot)
                i++;
            while (v[j] < pivot)
                j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return v[want];
    }
    return v[want];
}

int rekv_ig_select(const float *scores, int n_heads, int nkv, int len, float alpha,
                   float max_fraction, rekv_select how, uint64_t key, int32_t *sel, float *scratch)
{
    int group = n_heads / nkv;
    if (how == REKV_SELECT_ALL) {
        for (int g = 0; g < nkv; g++)
            for (int t = 0; t < len; t++)
                sel[(size_t)g * (size_t)len + (size_t)t] = t;
        return len;
    }
    /* KV head g ranks its tokens by the attention its query group would give them: the sum
     * over the group of each head's softmax of the speculated scores. (The best raw score over
     * the group lets the head with the widest score range choose for both: on stories260K with
     * exact scores that costs +8% NLL at 20% kept, the probability sum +2%.) The count is the
     * paper's: per query head the tokens within alpha of its best, averaged over heads. */
    float *comb = scratch, *tmp = scratch + (size_t)nkv * (size_t)len, best[group];
    double counted = 0;
    for (int g = 0; g < nkv; g++) {
        pl_ig_group_probs(scores, group, g, len, comb + (size_t)g * (size_t)len, tmp, best);
        for (int j = 0; j < group; j++) {
            const float *sh = scores + (size_t)(g * group + j) * (size_t)len;
            float above = best[j] - alpha;
            int cnt = 0;
            for (int t = 0; t < len; t++)
                cnt += sh[t] > above;
            counted += cnt ? cnt : 1;
        }
    }
    int m = (int)lround(counted / n_heads);
    int cap = (int)((double)max_fraction * len);
    if (m > cap)
        m = cap;
    if (m < 1)
        m = 1;
    if (m > len)
        m = len;
    for (int g = 0; g < nkv; g++) {
        int32_t *sg = sel + (size_t)g * (size_t)len;
        const float *cg = comb + (size_t)g * (size_t)len;
        int n = 0;
        if (how == REKV_SELECT_RANDOM) {
            /* Floyd's sample of m distinct positions, marked in tmp, read in order */
            uint64_t x = key ^ ((uint64_t)g * 0x2545f4914f6cdd1dull);
            memset(tmp, 0, sizeof(float) * (size_t)len);
            for (int j = len - m; j < len; j++) {
                int t = (int)(splitmix(&x) % (uint64_t)(j + 1));
                tmp[tmp[t] != 0 ? j : t] = 1;
            }
            for (int t = 0; t < len; t++)
                if (tmp[t] != 0)
                    sg[n++] = t;
            continue;
        }
        pl_ig_top(cg, len, m, tmp, sg);
    }
    return m;
}

float *pl_ig_group_probs(const float *scores, int group, int g, int len, float *out, float *tmp,
                         float *best)
{
    for (int j = 0; j < group; j++) {
        const float *sh = scores + (size_t)(g * group + j) * (size_t)len;
        float *e = j == 0 ? out : tmp;
        float inv = 1.0f / cpu_softmax_exp(e, sh, len, best ? &best[j] : NULL);
        if (j == 0)
            for (int t = 0; t < len; t++)
                out[t] *= inv;
        else
            for (int t = 0; t < len; t++)
                out[t] += tmp[t] * inv;
    }
    return out;
}

/* v's bits in an order that sorts as the floats do, equal where they are equal (-0 is made +0;
 * NaN aside) */
static inline uint32_t float_key(float v)
{
    uint32_t b;
    v += 0.0f;
    memcpy(&b, &v, sizeof(b));
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

void pl_ig_top(const float *v, int len, int m, float *tmp, int32_t *out)
{
    /* the m-th largest: a histogram of the keys' top bits finds its bucket, a quickselect among
     * that bucket's values the value (three passes whatever the values; a quickselect over all
     * of them took 3-12 ns a token) */
    enum { TOP_BITS = 11 };
    int hist[1 << TOP_BITS] = {0}, b = (1 << TOP_BITS) - 1, c = 0, have = 0;
    for (int t = 0; t < len; t++)
        hist[float_key(v[t]) >> (32 - TOP_BITS)]++;
    for (; have + hist[b] < m; b--)
        have += hist[b];
    for (int t = 0; t < len; t++) { /* branch-free: a fifth of the tokens at random go */
        tmp[c] = v[t];
        c += float_key(v[t]) >> (32 - TOP_BITS) == (uint32_t)b;
    }
    float kth = kth_largest(tmp, c, m - have);
    int above = have, n = 0; /* the higher buckets', and the bucket's own */
    for (int i = 0; i < c; i++)
        above += tmp[i] > kth;
    int ties = m - above; /* of the tokens equal to the m-th score, the first ones */
    for (int t = 0; t < len; t++) {
        int tie = v[t] == kth && ties > 0;
        out[n] = t;
        n += v[t] > kth || tie;
        ties -= tie;
    }
}

/* ------------------------------------------------------------------ one item's copies */

/* The new row of (item, layer), at slot `slot` of buf, leaves for its position in the arena. */
int pl_ig_new_row_store(rekv_pipeline *p, const range_ref *kr, const uint8_t *buf, int len,
                        int slot, unit_io *io)
{
    const rekv_model_config *c = p->c;
    int kvh = c->n_kv_heads, hd = c->head_dim;
    size_t row = p->kv_rowb;
    size_t vs = rekv_kv_off(rekv_kv_v_shift(kvh, hd), hd, row);
    const rekv_kv_plan_block *kb = pl_block_at(p, kr, len);
    if (kb == NULL)
        return -EPROTO;
    if (RESERVE(&io->d2h_kv, 2 * (size_t)kvh))
        return -ENOMEM;
    for (int half = 0; half < 2; half++)
        for (int h = 0; h < kvh; h++)
            io->d2h_kv.v[io->d2h_kv.n++] = (rekv_copy_piece){
                p->arena + kb->offset +
                    rekv_kv_off(rekv_kv_row(kvh, hd, h, len % REKV_KV_BLOCK_TOKENS), hd, row) +
                    (half ? vs : 0),
                (uint8_t *)buf + rekv_kv_off(rekv_kv_row(kvh, hd, h, slot), hd, row) +
                    (half ? vs : 0),
                row};
    return 0;
}

/* keep_act: which of the selection's tokens come as activation rows (recomputed) rather than as
 * their K,V rows. votes[t] (t of [0, rest)) counts the KV heads that selected token dev + t; a
 * token's activation row (hidden elements) replaces its selected K,V rows (2 head_dim each), so it
 * is worth it only where it is fewer bytes — more than hidden / (2 head_dim) heads chose the
 * token (more than half of them on MHA; never on GQA, whose row is as wide as all its K,V). Of
 * those, up to `most` — the most voted first, then the earliest — are marked: votes[t] = -1.
 * Returns how many. */
static int ig_recompute_pick(int32_t *votes, int rest, int kvh, int hd, int hidden, int most)
{
    int r = 0;
    for (int v = kvh; v > 0 && r < most && 2 * v * hd > hidden; v--)
        for (int t = 0; t < rest && r < most; t++)
            if (votes[t] == v)
                votes[t] = -1, r++;
    return r;
}

/* With a KV pool (no device part): each KV head selects among the entries still in its pool —
 * the scores of its query group gathered at the live positions, the selection mapped back to
 * positions (ascending, as slots want) — the selected entries' counters go up, and then each pool
 * makes room for the new token's entry, evicting as its policy says. The prefetch comes first as
 * in the paper (the victim may be attended this step, its last); the new entry is attended from
 * its slot whatever happens. With nothing evicted yet the scores are used as they are: the
 * selection is the pool-less one bit for bit. */
static int ig_select_pooled(const float *scores, const rekv_ig_seq *q, const rekv_ig_shape *sh)
{
    int nh = sh->n_heads, kvh = sh->n_kv, group = nh / kvh, len = q->len, n = len - q->n_gone[0];
    rekv_kv_pool kp = {kvh,      q->cap,  q->limit,  (rekv_kv_pool_policy)q->policy,
                       q->count, q->gone, q->n_gone, NULL}; /* the layer's pools */
    int32_t *sel = q->sel, m;
    if (n < len) {
        float *sub = q->scratch + (size_t)(kvh + 1) * (size_t)len;
        int32_t *live = (int32_t *)(sub + (size_t)nh * (size_t)len); /* [kvh][len] */
        for (int g = 0; g < kvh; g++)
            rekv_kv_pool_live(&kp, g, len, live + (size_t)g * (size_t)len);
        for (int h = 0; h < nh; h++) {
            const int32_t *lg = live + (size_t)(h / group) * (size_t)len;
            const float *s = scores + (size_t)h * (size_t)len;
            for (int i = 0; i < n; i++)
                sub[(size_t)h * (size_t)n + (size_t)i] = s[lg[i]];
        }
        m = rekv_ig_select(sub, nh, kvh, n, sh->alpha, sh->max_fraction, sh->how, q->key, sel,
                           q->scratch);
        /* [kvh][n] indices -> [kvh][len] positions, in place: from the last head and slot down,
         * every write lands at or past what is still to be read */
        for (int g = kvh - 1; g >= 0; g--)
            for (int jj = m - 1; jj >= 0; jj--)
                sel[(size_t)g * (size_t)len + (size_t)jj] =
                    live[(size_t)g * (size_t)len + (size_t)sel[(size_t)g * (size_t)n + (size_t)jj]];
    } else {
        m = rekv_ig_select(scores, nh, kvh, len, sh->alpha, sh->max_fraction, sh->how, q->key, sel,
                           q->scratch);
    }
    for (int g = 0; g < kvh; g++) {
        rekv_kv_pool_touch(&kp, g, sel + (size_t)g * (size_t)len, m);
        rekv_kv_pool_admit(&kp, g, len, NULL);
    }
    return m;
}

int rekv_ig_select_seq(const float *scores, const rekv_ig_seq *q, const rekv_ig_shape *sh)
{
    int nh = sh->n_heads, len = q->len, rest = len - q->dev;
    const float *sc = scores + q->scores;
    if (q->count != NULL) /* no device part with a pool: rest = len */
        return *q->m = ig_select_pooled(sc, q, sh);
    if (rest <= 0)
        return *q->m = 0;
    /* the device-resident part [0, dev) is attended whole, from the device; the selection is
     * among the tokens the link serves, [dev, len), on their own scores */
    if (q->dev > 0) {
        float *sub = q->scratch + (size_t)(sh->n_kv + 1) * (size_t)len;
        for (int h = 0; h < nh; h++)
            memcpy(sub + (size_t)h * (size_t)rest, sc + (size_t)h * (size_t)len + q->dev,
                   sizeof(float) * (size_t)rest);
        sc = sub;
    }
    return *q->m = rekv_ig_select(sc, nh, sh->n_kv, rest, sh->alpha, sh->max_fraction, sh->how,
                                  q->key, q->sel, q->scratch);
}

/* REKV_SELECT_RANDOM's draw for (item, layer) at a context of len */
static uint64_t ig_key(const rekv_pipeline *p, int item, int layer, int len)
{
    return p->cfg.select_seed ^ ((uint64_t)item * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)layer << 32) ^
           (uint64_t)len;
}

static rekv_ig_shape ig_shape(const rekv_pipeline *p)
{
    const rekv_model_config *c = p->c;
    return (rekv_ig_shape){c->n_heads,   c->n_kv_heads,       c->head_dim,  p->kv_rowb,
                           p->cfg.alpha, p->cfg.max_fraction, p->cfg.select};
}

/* Sequence `item`'s selection at a unit of layer `layer`: its scores' offset, its key, its pool's
 * layer (with one) and where the selection goes (sel, m); the caller sets the scratch and, for
 * the kernel, where the rows go. */
static rekv_ig_seq ig_seq_of(const rekv_pipeline *p, const step *st, int item, int layer,
                             int32_t *sel, int *m)
{
    const rekv_pseq *s = st->items[item].seq;
    int len = s->len;
    rekv_ig_seq q = {.scores = st->ig_off[item],
                     .len = len,
                     .dev = pl_dev_part(s, len),
                     .key = ig_key(p, item, layer, len),
                     .sel = sel,
                     .m = m};
    if (s->pool.count) {
        size_t base = (size_t)layer * (size_t)p->c->n_kv_heads;
        q.count = s->pool.count + base * (size_t)s->pool.cap;
        q.gone = s->pool.gone + base * (size_t)s->pool.cap;
        q.n_gone = s->pool.n_gone + base;
        q.cap = s->pool.cap;
        q.limit = s->pool.limit;
        q.policy = (int)s->pool.policy;
    }
    return q;
}

/* The pool's chunk of a unit's selection by the step thread: batch item iu->items[chunk], a pure
 * function of its speculated scores on the host (~0.3 ms per sequence and layer on a 7B model),
 * with its thread's scratch. */
static void ig_select_chunk(void *arg, int chunk, int slot)
{
    ig_unit *iu = arg;
    int j = iu->items[chunk];
    rekv_ig_seq q = ig_seq_of(iu->p, iu->st, iu->g0 + j, iu->layer, iu->sel[j], &iu->sel_m[j]);
    rekv_ig_shape sh = ig_shape(iu->p);
    q.scratch = iu->p->ig.scratch + (size_t)slot * iu->per;
    rekv_ig_select_seq(iu->p->ig.host, &q, &sh);
}

/* The unit's selection, every sparse item's, on the pool (its scores on the host). 0, or -ENOMEM
 * when not even one thread's scratch fits. */
static int ig_unit_select(ig_unit *iu)
{
    if (iu->n == 0)
        return 0;
    /* each thread's scratch (pl_ig_prepare sized it for the threads there were then) */
    size_t fit = iu->per ? iu->p->ig.scratch_cap / iu->per : 0;
    int threads = cpu_gemm_threads();
    if ((size_t)threads > fit)
        threads = (int)fit;
    if (threads == 0)
        return -ENOMEM;
    cpu_pool_run(ig_select_chunk, iu, iu->n, threads);
    return 0;
}

/* The most tokens per KV head rekv_ig_select takes of `rest` (its count, capped) */
static int ig_most(const rekv_pipeline *p, int rest)
{
    int cap = (int)((double)p->cfg.max_fraction * rest);
    if (p->cfg.select == REKV_SELECT_ALL || cap > rest)
        return rest;
    return cap < 1 ? (rest < 1 ? rest : 1) : cap;
}

int pl_ig_unit_prepare(rekv_pipeline *p, step *st, int g, int layer, rekv_attn_seq *d,
                       unit_io *io)
{
    const rekv_model_config *c = p->c;
    int g0 = st->g_begin[g], nb = st->g_begin[g + 1] - g0, n = 0, kvh = c->n_kv_heads;
    int L = c->n_layers;
    io->ig = NULL;
    for (int j = 0; j < nb; j++)
        n += pl_ig_sparse(p, st, g0 + j);
    if (n == 0)
        return 0;
    ig_unit *iu = pl_smem_alloc(&st->mem, sizeof(*iu));
    if (iu == NULL)
        return -ENOMEM;
    *iu = (ig_unit){.p = p, .st = st, .g = g, .g0 = g0, .layer = layer, .d = d,
                    .kv_pos = io->kv_pos};
    iu->items = pl_smem_alloc(&st->mem, sizeof(int) * (size_t)n);
    iu->sel = pl_smem_alloc(&st->mem, sizeof(int32_t *) * (size_t)nb);
    iu->sel_m = pl_smem_alloc(&st->mem, sizeof(int) * (size_t)nb);
    if (!st->ig_wait)
        iu->seqs = pl_smem_alloc(&st->mem, sizeof(rekv_ig_seq) * (size_t)n);
    if (iu->items == NULL || iu->sel == NULL || iu->sel_m == NULL ||
        (!st->ig_wait && iu->seqs == NULL))
        return -ENOMEM;
    size_t pieces = 0;
    for (int j = 0; j < nb; j++) {
        iu->sel[j] = NULL;
        iu->sel_m[j] = 0;
        if (!pl_ig_sparse(p, st, g0 + j))
            continue;
        const rekv_pseq *s = st->items[g0 + j].seq;
        int len = s->len, dev = pl_dev_part(s, len);
        if ((iu->sel[j] = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)kvh * (size_t)len)) ==
            NULL)
            return -ENOMEM;
        size_t need = rekv_ig_scratch_floats(len, c->n_heads, kvh); /* the step thread's */
        iu->per = need > iu->per ? need : iu->per;
        pieces += 2 * (size_t)kvh * (size_t)ig_most(p, len - dev);
        if (!st->ig_wait) { /* the device's selection may fetch from any block past dev */
            int item = g0 + j;
            const range_ref *kr = &st->kv_ref[item * L + layer];
            uint64_t *blocks = pl_smem_alloc(
                &st->mem, sizeof(uint64_t) * (size_t)(len / REKV_KV_BLOCK_TOKENS + 1));
            if (blocks == NULL)
                return -ENOMEM;
            for (int t = dev; t < len; t += REKV_KV_BLOCK_TOKENS - t % REKV_KV_BLOCK_TOKENS) {
                const rekv_kv_plan_block *kb = pl_block_at(p, kr, t);
                if (kb == NULL)
                    return -EPROTO;
                blocks[t / REKV_KV_BLOCK_TOKENS] = kb->offset;
            }
            /* the descriptor's fields are set once the unit's plan has made them (unit_fetch) */
            rekv_ig_seq *q = &iu->seqs[iu->n];
            *q = ig_seq_of(p, st, item, layer, iu->sel[j], &iu->sel_m[j]);
            q->scratch = (float *)p->ig.sscr.p + st->ig_scr[item];
            q->blocks = blocks;
        }
        iu->items[iu->n++] = j;
    }
    if (!st->ig_wait) {
        iu->max_pieces = pieces;
        if ((iu->pieces = pl_smem_alloc(&st->mem, sizeof(rekv_copy_piece) * pieces)) == NULL)
            return -ENOMEM;
    }
    iu->next = st->ig_units;
    st->ig_units = iu;
    io->ig = iu;
    if (!st->ig_wait)
        return 0;
    p->bi->event_sync(p->ig.ev[g]); /* the unit's scores on the host: the step thread waits */
    return ig_unit_select(iu);
}

/* Item j of unit iu, selected: the copies of its selected rows from the arena into slots dev,
 * dev + 1, .. of its attention buffer (K rows, then V rows: runs stay adjacent) into out (room
 * for 2 n_kv m pieces), and the new row's slot after them (d->start, kv_pos) — the layout the
 * file's opening comment describes; the counts into iu. Tokens recomputed (votes[t] <= -2:
 * pl_ig_item_plan's, with r of them) are not copied: each head that chose one gets its row's
 * slot in act_slot. Returns the pieces written, or -EPROTO. */
static long ig_item_rows(ig_unit *iu, int j, const int32_t *votes, int r, int32_t *act_slot,
                         rekv_copy_piece *out)
{
    rekv_pipeline *p = iu->p;
    const rekv_model_config *c = p->c;
    int item = iu->g0 + j, kvh = c->n_kv_heads, hd = c->head_dim;
    const rekv_pseq *s = iu->st->items[item].seq;
    int len = s->len, dev = pl_dev_part(s, len), rest = len - dev, m = iu->sel_m[j];
    const range_ref *kr = &iu->st->kv_ref[item * c->n_layers + iu->layer];
    const int32_t *sel = iu->sel[j];
    rekv_attn_seq *d = &iu->d[j];
    uint8_t *buf = d->kv;
    size_t row = p->kv_rowb, vs = rekv_kv_off(rekv_kv_v_shift(kvh, hd), hd, row);
    long n = 0;
    for (int half = 0; half < 2; half++)
        for (int hh = 0; hh < kvh; hh++)
            for (int jj = 0; jj < m; jj++) {
                int t = sel[(size_t)hh * (size_t)rest + (size_t)jj];
                if (r > 0 && votes[t] <= -2) { /* recomputed: this head's slot for its row */
                    act_slot[(size_t)(-2 - votes[t]) * (size_t)kvh + (size_t)hh] = dev + jj;
                    continue;
                }
                const rekv_kv_plan_block *blk = pl_block_at(p, kr, dev + t);
                if (blk == NULL)
                    return -EPROTO;
                size_t so = rekv_kv_off(rekv_kv_row(kvh, hd, hh, (dev + t) % REKV_KV_BLOCK_TOKENS),
                                        hd, row);
                size_t doff = rekv_kv_off(rekv_kv_row(kvh, hd, hh, dev + jj), hd, row);
                out[n++] = (rekv_copy_piece){buf + doff + (half ? vs : 0),
                                             p->arena + blk->offset + so + (half ? vs : 0), row};
            }
    d->start = dev + m;
    iu->kv_pos[d->row0] = dev + m;
    iu->rows += (uint64_t)n / 2;
    iu->tokens += (uint64_t)m;
    return n;
}

void pl_ig_unit_fetch(rekv_pipeline *p, const unit_io *io)
{
    ig_unit *iu = io->ig;
    if (iu == NULL || iu->st->ig_wait) /* no selection, or one the plan made */
        return;
    for (int i = 0; i < iu->n; i++) { /* where the plan put each item's buffer and new row */
        rekv_attn_seq *d = &iu->d[iu->items[i]];
        iu->seqs[i].kv = d->kv;
        iu->seqs[i].start = &d->start;
        iu->seqs[i].slot = &iu->kv_pos[d->row0];
    }
    rekv_ig_shape shape = ig_shape(p);
    rekv_stream *sh = p->s_h2d;
    p->bi->stream_wait_event(sh, p->ig.ev[iu->g]);
    p->k->ig_select(sh, p->ig.scores.p, iu->seqs, iu->n, &shape, p->arena_dev, iu->pieces,
                    &iu->n_pieces);
    /* the scores are read: the next layer's speculation need not wait for these rows' copy */
    p->bi->event_record(p->ig.ev_read[iu->g], sh);
    p->bi->copy_h2d_listed(sh, iu->pieces, &iu->n_pieces, iu->max_pieces, REKV_XFER_KV);
}

int pl_ig_step_done(rekv_pipeline *p, step *st, rekv_err *err)
{
    (void)err; /* the device's selection fails its stream, which the step's drain reports */
    for (ig_unit *iu = st->ig_units; iu != NULL; iu = iu->next) {
        rekv_layer_counters *cnt = &p->counters[iu->layer];
        for (int i = 0; !st->ig_wait && i < iu->n; i++) { /* what the device selected */
            int m = iu->sel_m[iu->items[i]];
            iu->rows += (uint64_t)p->c->n_kv_heads * (uint64_t)m;
            iu->tokens += (uint64_t)m;
        }
        cnt->h2d_bytes[REKV_XFER_KV] += iu->rows * 2 * p->kv_rowb;
        cnt->tokens_fetched += iu->tokens;
    }
    return 0;
}

/* Unit (layer > 0) of sparse item `item` (index j in its batch), its selection's memory made by
 * pl_ig_unit_prepare: the device part's copy, the new row's stores — from its position, where
 * layer_compute puts it besides its slot — and the attention's descriptor with the new row in
 * slot dev (d->start; io->kv_pos) until the selection moves it past the selected rows. With
 * st->ig_wait the selection is made: its rows' copies go into io->h2d_kv, and with ar (keep_act:
 * the item's activations, else NULL) the tokens ig_recompute_pick takes come as activation rows
 * into parity b's staging and are recomputed into the slots of the heads that selected them
 * (io->act_slot); the new row's activation is stored beside its K,V. */
int pl_ig_item_plan(rekv_pipeline *p, step *st, int item, int j, int layer, const range_ref *kr,
                    const range_ref *ar, int b, rekv_attn_seq *d, unit_io *io)
{
    const rekv_model_config *c = p->c;
    int kvh = c->n_kv_heads, hd = c->head_dim, H = c->hidden;
    rekv_pseq *s = st->items[item].seq;
    int len = s->len, dev = pl_dev_part(s, len), rest = len - dev;
    size_t row = p->kv_rowb, xrow = (size_t)H * p->act_esz;
    ig_unit *iu = io->ig;
    int32_t *sel = iu->sel[j], *votes = p->ig.sel;
    int m = iu->sel_m[j]; /* 0 until selected, unless st->ig_wait */
    /* keep_act: the tokens recomputed, rows n_act0.. of the unit's recomputation, in position
     * order (adjacent ones one copy); votes[t] becomes the row's index */
    int r = 0, n_act0 = io->n_act;
    if (ar != NULL && st->split[item] > 0 && m > 0) {
        memset(votes, 0, sizeof(int32_t) * (size_t)rest);
        for (int hh = 0; hh < kvh; hh++)
            for (int jj = 0; jj < m; jj++)
                votes[sel[(size_t)hh * (size_t)rest + (size_t)jj]]++;
        r = ig_recompute_pick(votes, rest, kvh, hd, H, st->split[item]);
    }
    if (r > 0 && (RESERVE(&io->h2d_act, (size_t)r) || RESERVE(&io->conv_act, (size_t)r)))
        return -ENOMEM;
    uint8_t *act_stage = p->par[b].act_stage.p;
    for (int t = 0, k = 0; k < r; t++) {
        if (votes[t] != -1)
            continue;
        int pos = dev + t, in_blk = pos % REKV_KV_BLOCK_TOKENS, ri = n_act0 + k++;
        const rekv_kv_plan_block *ab = pl_block_at(p, ar, pos);
        if (ab == NULL)
            return -EPROTO;
        const uint8_t *src = p->arena + ab->offset + rekv_kv_act_offset(&p->geo, (uint32_t)in_blk);
        rekv_copy_piece *last = io->h2d_act.n ? &io->h2d_act.v[io->h2d_act.n - 1] : NULL;
        if (k > 1 &&
            (const uint8_t *)last->src + last->bytes == src) /* the previous token's, extended */
            last->bytes += xrow, io->conv_act.v[io->conv_act.n - 1].n += (uint32_t)H;
        else {
            io->h2d_act.v[io->h2d_act.n++] = (rekv_copy_piece){act_stage + io->act_off, src, xrow};
            io->conv_act.v[io->conv_act.n++] =
                (rekv_convert_piece){(float *)p->act_f32.p + (size_t)ri * (size_t)H,
                                     act_stage + io->act_off, (uint32_t)H};
        }
        io->act_off += xrow;
        votes[t] = -2 - ri;
        io->act_seq[ri] = j;
        io->act_pos[ri] = pos; /* RoPE's; the slots are each head's */
        for (int hh = 0; hh < kvh; hh++)
            io->act_slot[(size_t)ri * (size_t)kvh + (size_t)hh] = -1;
    }
    io->n_act = n_act0 + r;
    uint8_t *buf = d->kv;
    int rc = pl_dev_part_load(p, s, layer, buf, 0, dev, io);
    if (rc)
        return rc;
    d->start = dev;
    io->kv_pos[d->row0] = dev;
    if (st->ig_wait) {
        if (RESERVE(&io->h2d_kv, 2 * (size_t)kvh * (size_t)m))
            return -ENOMEM;
        long n = ig_item_rows(iu, j, votes, r, io->act_slot, io->h2d_kv.v + io->h2d_kv.n);
        if (n < 0)
            return (int)n;
        io->h2d_kv.n += (size_t)n;
    }
    /* the new row, from its position -> the arena; and into the device part while the context
     * is shorter than it (then dev = len: no selection) */
    if ((rc = pl_ig_new_row_store(p, kr, buf, len, len, io)) ||
        (rc = pl_dev_part_store(p, s, layer, buf, len, 1, io)))
        return rc;
    rekv_layer_counters *cnt = &p->counters[layer];
    if (ar != NULL) { /* and its activation (the attention input, in the output staging) */
        const rekv_kv_plan_block *ab = pl_block_at(p, ar, len);
        if (ab == NULL)
            return -EPROTO;
        if (RESERVE(&io->d2h_act, 1))
            return -ENOMEM;
        io->d2h_act.v[io->d2h_act.n++] = (rekv_copy_piece){
            p->arena + ab->offset +
                rekv_kv_act_offset(&p->geo, (uint32_t)(len % REKV_KV_BLOCK_TOKENS)),
            (uint8_t *)p->par[b].out_stage.p + (size_t)d->row0 * xrow, xrow};
        cnt->d2h_bytes[REKV_XFER_ACT] += xrow;
    }
    cnt->h2d_bytes[REKV_XFER_ACT] += (uint64_t)r * xrow;
    cnt->d2h_bytes[REKV_XFER_KV] += 2 * (uint64_t)kvh * row;
    cnt->tokens_recomputed += (uint64_t)r;
    cnt->tokens_considered += (uint64_t)rest;
    return 0;
}
