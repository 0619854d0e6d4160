/* mode_clo.c — the clo mode of the pipeline, all of it (CLO §3: a head-wise approximate cache
 * keyed by query similarity), built on infinigen's speculation (pipeline_infinigen.c, with whole
 * queries) for its misses; its entry in the pipeline's mode table at the end.
 *
 * Per sequence, on the device:
 *   - layer 0's whole cache (clo0): it cannot be speculated, so it stays, as the paper keeps it in
 *     HBM; filled from the arena once after a prefill, then only its new rows are written;
 *   - per layer > 0 a head cache of clo_slots positions in the KV layout (kvlayout.h):
 *       [0, K)               top-k region: KV head g's cached tokens in [K - k_g, K)
 *       [K, K + 4)           the attention sink, tokens 0..3
 *       [K + 4, K + 4 + 65)  a ring of the 64 recent tokens and the new one (t at K + 4 + t % 65)
 *     The attention kernel reads it in place: start = clo_slots - 1 and skip[g] = K - k_g (the
 *     slots of head g before its top-k are left out), so a hit moves nothing and a miss writes
 *     the fetched rows straight into their slots (the paper's "no redundant copy").
 * Also on the device, each query head's label (the query its KV head's top-k was chosen for);
 * each KV head's k_g in memory the host reads too (the plan: a fresh cache, persistent heads).
 *
 * A decode step, per (sequence, layer > 0, KV head g): the similarity of each query head of the
 * group to its label (cosine of the query the speculation computed — by default layer i's own,
 * as CLO's paper tests it; with --lookahead 1, layer i's query from layer i-1's input, as
 * infinigen speculates), aggregated by Eq. 10 with the
 * profile's importances; a hit when it is at least the head's tau (Eq. 7-9 from the group's largest
 * importance). A miss ranks the tokens between the sink and the ring by the group's summed softmax
 * of the speculated scores (as infinigen does), fetches the top k = max_fraction·len of them
 * into the top-k region, and makes the current queries the labels. The first sparse step of a
 * (sequence, layer) — and the first after a prefill — fills the sink and the ring and misses on
 * every head. A sequence is sparse once its context is longer than sink + recent window; before
 * that every layer > 0 fetches everything, as offload does.
 *
 * Persistent heads (§3.3, Eq. 11-13 with N_p from the caller, cfg.persist_np: the planner's
 * rekv_plan_persist_np from the measured link and forward rate, assigned by the coordinator, or the
 * user's): the hardest KV heads
 * of a layer keep the whole middle of the context in their top-k region (the layer's region is
 * then cap - sink - recent slots): fetched once, then the token leaving the recent window each
 * step is copied device to device from its ring slot (d2d_kv, on the h2d stream before the
 * unit's loads, i.e. before the new row overwrites it), so such a head attends the whole context
 * and moves nothing; its steps count neither as hits nor misses.
 *
 * GPU-centric synchronisation (§4.4), one step further: neither the step thread nor the device
 * waits for the host. What the plan knows when the unit is planned (a fresh cache's sink and
 * ring, persistent heads, the new row's store, the attention's descriptor) is enqueued then
 * (clo_item_plan); what depends on the speculation goes on the h2d stream behind a wait for it
 * (clo_unit_fetch): the clo_decide kernel (kernels.h; on cpu rekv_clo_decide for the unit's
 * sequences together on the pool, on cuda the same steps as kernels) makes the unit's decisions
 * — similarity and a miss's top-k — and writes each sequence's labels, k's, the attention's skip
 * and the misses' rows' copies, and a listed copy (copy_h2d_listed) moves those rows, which the
 * compute stream waits for as for any unit's loads. On cuda that copy is the backend's gather
 * kernel reading the registered arena (zero-copy, §4.3) from the list the decisions wrote, so
 * the device waits only on events: the paper's decisions and transfer threads are kernels, its
 * flags the stream order. The decisions' counts reach the counters after the step
 * (clo_step_done, from each head's k). The speculated scores are computed every step for every head
 * (the miss cannot wait for them); the paper computes them on a miss only. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "gpuworker/heads.h"
#include "gpuworker/pipeline_internal.h"

enum { RING = REKV_HEADS_RECENT + 1 };

static void clo_forget(rekv_pseq *s, int layer);
static int clo_sparse(const rekv_pipeline *p, const step *st, int i);

static int clo_create(rekv_pipeline *p, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    const rekv_heads *hp = p->cfg.heads;
    if (hp == NULL)
        return rekv_errf(err, -EINVAL, "pipeline: clo needs the model's head profile");
    if (hp->n_layers != c->n_layers || hp->n_heads != c->n_heads || hp->n_kv_heads != c->n_kv_heads)
        return rekv_errf(err, -EINVAL,
                         "pipeline: the head profile (%d layers, %d heads, %d KV heads) is not "
                         "this model's (%d, %d, %d)",
                         hp->n_layers, hp->n_heads, hp->n_kv_heads, c->n_layers, c->n_heads,
                         c->n_kv_heads);
    if (!(p->cfg.eta > -1 && p->cfg.eta <= 1) || !(p->cfg.power > 0) || !(p->cfg.persist_np >= 0))
        return rekv_errf(err, -EINVAL,
                         "pipeline: clo needs eta in (-1, 1], a power > 0 and N_p >= 0");
    if (p->cfg.push)
        return rekv_errf(err, -ENOTSUP, "pipeline: clo fetches by pull only");
    if (p->bi->copy_h2d_listed == NULL || p->k->clo_decide == NULL ||
        (p->store != NULL && p->arena_dev == NULL))
        return rekv_errf(err, -ENOTSUP,
                         "pipeline: clo decides on the device and fetches the rows its decisions "
                         "name with the device's own reads of the kvstore arena, which the %s "
                         "backend %s",
                         p->bi->name,
                         p->bi->copy_h2d_listed && p->k->clo_decide
                             ? "could not page-lock (raise the locked-memory limit: ulimit -l, "
                               "systemd LimitMEMLOCK)"
                             : "cannot do");
    int L = c->n_layers, nh = c->n_heads, nkv = c->n_kv_heads, group = nh / nkv;
    size_t bt = sizeof(double) * (size_t)L * (size_t)nkv,
           bi = sizeof(double) * (size_t)L * (size_t)nh, bp = (size_t)L * (size_t)nkv;
    double *tau = malloc(bt); /* computed here, kept on the device */
    p->clo.persist = calloc((size_t)L * (size_t)nkv, 1);
    p->clo.hits = calloc((size_t)L * (size_t)nkv, sizeof(uint64_t));
    p->clo.misses = calloc((size_t)L * (size_t)nkv, sizeof(uint64_t));
    if (tau == NULL || p->clo.persist == NULL || p->clo.hits == NULL || p->clo.misses == NULL) {
        free(tau);
        return rekv_errf(err, -ENOMEM, "pipeline: out of memory");
    }
    for (int l = 0; l < L; l++) {
        for (int g = 0; g < nkv; g++) {
            double imax = 0;
            for (int h = g * group; h < (g + 1) * group; h++)
                imax = fmax(imax, hp->importance[(size_t)l * (size_t)nh + (size_t)h]);
            tau[(size_t)l * (size_t)nkv + (size_t)g] =
                rekv_heads_tau(imax, p->cfg.eta, p->cfg.power);
        }
        if (l > 0) /* layer 0 stays on the device whole anyway */
            rekv_heads_persistent(hp, l, p->cfg.eta, p->cfg.power, REKV_HEADS_EPSILON,
                                  p->cfg.persist_np, p->clo.persist + (size_t)l * (size_t)nkv);
    }
    /* the decisions' constants on the device, which decides: tau, the profile's importances as
     * they are, the persistent heads (the plan reads those on the host too) */
    p->clo.tau = p->bi->dev_alloc(p->be, bt);
    p->clo.imp = p->bi->dev_alloc(p->be, bi);
    p->clo.persist_dev = p->bi->dev_alloc(p->be, bp);
    int rc = 0;
    if (p->clo.tau == NULL || p->clo.imp == NULL || p->clo.persist_dev == NULL) {
        rc = rekv_errf(err, -ENOMEM, "pipeline: out of device memory");
    } else {
        rekv_copy_piece pc[3] = {{p->clo.tau, tau, bt},
                                 {p->clo.imp, hp->importance, bi},
                                 {p->clo.persist_dev, p->clo.persist, bp}};
        p->bi->copy_h2d(p->s_h2d, pc, 3, REKV_XFER_WEIGHTS);
        rc = p->bi->stream_sync(p->s_h2d, err);
    }
    free(tau);
    return rc;
}

static void clo_free(rekv_pipeline *p)
{
    if (p->clo.tau)
        p->bi->dev_free(p->be, p->clo.tau);
    if (p->clo.imp)
        p->bi->dev_free(p->be, p->clo.imp);
    if (p->clo.persist_dev)
        p->bi->dev_free(p->be, p->clo.persist_dev);
    free(p->clo.persist);
    free(p->clo.hits);
    free(p->clo.misses);
    memset(&p->clo, 0, sizeof(p->clo));
}

static int layer_persists(const rekv_pipeline *p, int layer)
{
    for (int g = 0; g < p->c->n_kv_heads; g++)
        if (p->clo.persist[(size_t)layer * (size_t)p->c->n_kv_heads + (size_t)g])
            return 1;
    return 0;
}

static int clo_seq_alloc(rekv_pipeline *p, rekv_pseq *s, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    int L = c->n_layers, nkv = c->n_kv_heads, hd = c->head_dim;
    size_t rb = p->kv_rowb, total = 0;
    int k = (int)ceil((double)p->cfg.max_fraction * s->cap),
        whole = s->cap - REKV_HEADS_SINK - REKV_HEADS_RECENT;
    s->hc_off = calloc((size_t)L, sizeof(size_t));
    s->hc_k = calloc((size_t)L, sizeof(int));
    if (s->hc_off == NULL || s->hc_k == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    for (int l = 1; l < L; l++) {
        s->hc_k[l] = k < 1 ? 1 : k;
        if (layer_persists(p, l) && whole > s->hc_k[l])
            s->hc_k[l] = whole;
        int slots = s->hc_k[l] + REKV_HEADS_SINK + RING;
        s->clo_slots = slots > s->clo_slots ? slots : s->clo_slots;
        s->hc_off[l] = total;
        total += rekv_kv_buffer_bytes(nkv, hd, slots, rb);
    }
    s->clo0_len = -1;
    s->clo0 = p->bi->dev_alloc(p->be, rekv_kv_buffer_bytes(nkv, hd, s->cap, rb));
    if (total)
        s->hc = p->bi->dev_alloc(p->be, total);
    s->label = p->bi->dev_alloc(p->be, sizeof(float) * (size_t)L * (size_t)c->n_heads * (size_t)hd);
    s->klen = rekv_host_alloc(p->be, sizeof(int32_t) * (size_t)L * (size_t)nkv);
    if (s->clo0 == NULL || (total && s->hc == NULL) || s->label == NULL || s->klen == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory for the clo caches of %d tokens", s->cap);
    for (int l = 0; l < L; l++)
        clo_forget(s, l);
    return 0;
}

static void clo_seq_free(rekv_pipeline *p, rekv_pseq *s)
{
    if (s->clo0)
        p->bi->dev_free(p->be, s->clo0);
    if (s->hc)
        p->bi->dev_free(p->be, s->hc);
    free(s->hc_off);
    free(s->hc_k);
    if (s->label)
        p->bi->dev_free(p->be, s->label);
    rekv_host_free(p->be, s->klen);
}

/* Whether item i uses the head caches at layers > 0: a decode row past sink + recent window. */
static int clo_sparse(const rekv_pipeline *p, const step *st, int i)
{
    (void)p;
    return st->items[i].n_tokens == 1 &&
           st->items[i].seq->len > REKV_HEADS_SINK + REKV_HEADS_RECENT;
}

/* The caches of (s, layer) no longer hold what they say (a step went the dense way). */
static void clo_forget(rekv_pseq *s, int layer)
{
    if (s->klen == NULL)
        return;
    if (layer == 0)
        s->clo0_len = -1;
    else
        for (int g = 0; g < s->p->c->n_kv_heads; g++)
            s->klen[(size_t)layer * (size_t)s->p->c->n_kv_heads + (size_t)g] = -1;
}

/* The copies of token t's K and V rows of KV head h from the arena to slot j of buf: out[0..1].
 * 0, or -EPROTO where the plan has no block for t. */
static int row_pieces(const rekv_pipeline *p, const range_ref *kr, uint8_t *buf, int h, int t,
                      int j, rekv_copy_piece *out)
{
    const rekv_model_config *c = p->c;
    int kvh = c->n_kv_heads, hd = c->head_dim;
    size_t row = p->kv_rowb;
    size_t vs = rekv_kv_off(rekv_kv_v_shift(kvh, hd), hd, row);
    const rekv_kv_plan_block *blk = pl_block_at(p, kr, t);
    if (blk == NULL)
        return -EPROTO;
    const uint8_t *src = p->arena + blk->offset +
                         rekv_kv_off(rekv_kv_row(kvh, hd, h, t % REKV_KV_BLOCK_TOKENS), hd, row);
    uint8_t *dst = buf + rekv_kv_off(rekv_kv_row(kvh, hd, h, j), hd, row);
    out[0] = (rekv_copy_piece){dst, src, row};
    out[1] = (rekv_copy_piece){dst + vs, src + vs, row};
    return 0;
}

/* Appends row_pieces' copies to io->h2d_kv. */
static int row_copy(rekv_pipeline *p, const range_ref *kr, uint8_t *buf, int h, int t, int j,
                    unit_io *io)
{
    if (RESERVE(&io->h2d_kv, 2))
        return -ENOMEM;
    int rc = row_pieces(p, kr, buf, h, t, j, io->h2d_kv.v + io->h2d_kv.n);
    if (rc == 0)
        io->h2d_kv.n += 2;
    return rc;
}

/* Layer 0 of a decode item: its device cache, filled once, then only appended to. */
static int layer0_plan(rekv_pipeline *p, rekv_pseq *s, const range_ref *kr, rekv_attn_seq *d,
                       unit_io *io)
{
    int kvh = p->c->n_kv_heads, rc = 0;
    size_t row = p->kv_rowb;
    rekv_layer_counters *cnt = &p->counters[0];
    if (s->clo0_len != s->len) {
        for (int t = 0; t < s->len; t++)
            for (int h = 0; h < kvh; h++)
                if ((rc = row_copy(p, kr, s->clo0, h, t, t, io)))
                    return rc;
        cnt->h2d_bytes[REKV_XFER_KV] += (uint64_t)s->len * 2 * (uint64_t)kvh * row;
        cnt->tokens_fetched += (uint64_t)s->len;
    }
    if ((rc = pl_ig_new_row_store(p, kr, s->clo0, s->len, s->len, io)))
        return rc;
    cnt->d2h_bytes[REKV_XFER_KV] += 2 * (uint64_t)kvh * row;
    d->kv = s->clo0; /* start, the new row's slot: its position */
    s->clo0_len = s->len + 1;
    return 0;
}

int rekv_clo_decide(const float *q, const float *label, const double *imp, double tau, int group,
                    int head_dim, const float *scores, int len, float frac, int kmax,
                    float *scratch, int32_t *out)
{
    if (label != NULL) {
        double sim[group];
        for (int h = 0; h < group; h++)
            sim[h] = cpu_cosine(q + (size_t)h * (size_t)head_dim, label + (size_t)h * (size_t)head_dim,
                            head_dim);
        if (rekv_heads_aggregate(imp, sim, group) >= tau)
            return 0;
    }
    int middle = len - REKV_HEADS_SINK - REKV_HEADS_RECENT; /* tokens [sink, len - recent) */
    int k = (int)lround((double)frac * len);
    if (k > kmax)
        k = kmax;
    if (k > middle)
        k = middle;
    if (k < 1)
        k = 1;
    float *comb = pl_ig_group_probs(scores, group, 0, len, scratch, scratch + len, NULL);
    pl_ig_top(comb + REKV_HEADS_SINK, middle, k, scratch + len, out);
    return k;
}

/* Unit (layer > 0) of batch g: its decisions' memory, when it has sparse items (io->clo): the
 * kernel's sequences, their outputs, and each one's blocks, which the decisions may fetch from
 * (the plan must hold every block of their contexts). */
static int clo_unit_prepare(rekv_pipeline *p, step *st, int g, int layer, unit_io *io)
{
    const rekv_model_config *c = p->c;
    int g0 = st->g_begin[g], nb = st->g_begin[g + 1] - g0, n = 0, nkv = c->n_kv_heads;
    int L = c->n_layers, nh = c->n_heads, hd = c->head_dim;
    size_t pieces = 0, Qd = (size_t)rekv_config_q_dim(c);
    for (int j = 0; j < nb; j++)
        if (clo_sparse(p, st, g0 + j)) {
            n++;
            pieces += 2 * (size_t)nkv * (size_t)st->items[g0 + j].seq->hc_k[layer];
        }
    io->clo = NULL;
    if (n == 0)
        return 0;
    clo_unit *cu = pl_smem_alloc(&st->mem, sizeof(*cu));
    if (cu == NULL)
        return -ENOMEM;
    *cu = (clo_unit){.g = g, .layer = layer, .max_pieces = pieces};
    cu->at = pl_smem_alloc(&st->mem, sizeof(int) * (size_t)nb);
    cu->seqs = pl_smem_alloc(&st->mem, sizeof(rekv_clo_seq) * (size_t)n);
    cu->rows0 = pl_smem_alloc(&st->mem, sizeof(uint64_t) * (size_t)n);
    cu->pieces = pl_smem_alloc(&st->mem, sizeof(rekv_copy_piece) * pieces);
    if (cu->at == NULL || cu->seqs == NULL || cu->rows0 == NULL || cu->pieces == NULL)
        return -ENOMEM;
    for (int j = 0; j < nb; j++) {
        int item = g0 + j;
        cu->at[j] = -1;
        if (!clo_sparse(p, st, item))
            continue;
        rekv_pseq *s = st->items[item].seq;
        const range_ref *kr = &st->kv_ref[item * L + layer];
        int len = s->len, K = s->hc_k[layer];
        uint64_t *blocks =
            pl_smem_alloc(&st->mem, sizeof(uint64_t) * (size_t)(len / REKV_KV_BLOCK_TOKENS + 1));
        int32_t *outs = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)nkv * (size_t)(K + 2));
        if (blocks == NULL || outs == NULL)
            return -ENOMEM;
        for (int t = 0; t < len; t += REKV_KV_BLOCK_TOKENS) {
            const rekv_kv_plan_block *kb = pl_block_at(p, kr, t);
            if (kb == NULL)
                return -EPROTO;
            blocks[t / REKV_KV_BLOCK_TOKENS] = kb->offset;
        }
        cu->seqs[cu->n] =
            (rekv_clo_seq){.scores = st->ig_off[item],
                           .q = (const float *)p->ig.q.p + (size_t)st->last[g][j] * Qd,
                           .label = s->label + (size_t)layer * (size_t)nh * (size_t)hd,
                           .klen = s->klen + (size_t)layer * (size_t)nkv,
                           .len = len,
                           .K = K,
                           .scratch = (float *)p->ig.sscr.p + st->ig_scr[item],
                           .head_k = outs,
                           .skip = outs + nkv,
                           .sel = outs + 2 * nkv,
                           .blocks = blocks,
                           .kv = s->hc + s->hc_off[layer]};
        cu->rows0[cu->n] = 0;
        for (int h = 0; h < nkv; h++) /* counted as nothing unless the decisions run */
            outs[h] = -1;
        cu->at[j] = cu->n++;
    }
    cu->next = st->clo_units;
    st->clo_units = cu;
    io->clo = cu;
    return 0;
}

/* Unit (layer) of sparse item `item` (index j in its batch), when the unit is planned: the copies
 * of the sink and ring (a fresh cache) and of the persistent heads, the new row's store, and
 * the attention's descriptor; the other heads wait for the unit's decisions (clo_item_decided).
 * Layer 0: its whole cache. */
static int clo_item_plan(rekv_pipeline *p, step *st, int item, int j, int layer,
                         const range_ref *kr, rekv_attn_seq *d, unit_io *io)
{
    const rekv_model_config *c = p->c;
    rekv_pseq *s = st->items[item].seq;
    if (layer == 0)
        return layer0_plan(p, s, kr, d, io);
    int nkv = c->n_kv_heads, hd = c->head_dim;
    int len = s->len, K = s->hc_k[layer], ring0 = K + REKV_HEADS_SINK, S = ring0 + RING, rc = 0;
    size_t row = p->kv_rowb;
    size_t vs = rekv_kv_off(rekv_kv_v_shift(nkv, hd), hd, row);
    uint8_t *buf = s->hc + s->hc_off[layer];
    int32_t *klen = s->klen + (size_t)layer * (size_t)nkv;
    int32_t *skip = io->clo->seqs[io->clo->at[j]].skip;
    const uint8_t *persist = p->clo.persist + (size_t)layer * (size_t)nkv;
    uint64_t rows = 0;
    int fresh = klen[0] < 0;
    if (fresh) { /* the sink and the ring, once */
        for (int h = 0; h < nkv; h++) {
            for (int t = 0; t < REKV_HEADS_SINK; t++)
                if ((rc = row_copy(p, kr, buf, h, t, K + t, io)))
                    return rc;
            for (int t = len - REKV_HEADS_RECENT; t < len; t++)
                if ((rc = row_copy(p, kr, buf, h, t, ring0 + t % RING, io)))
                    return rc;
        }
        rows += (uint64_t)nkv * (REKV_HEADS_SINK + REKV_HEADS_RECENT);
    }
    rekv_layer_counters *cnt = &p->counters[layer];
    int middle = len - REKV_HEADS_SINK - REKV_HEADS_RECENT; /* tokens [sink, len - recent) */
    int slot = ring0 + len % RING; /* the new row's, where the token leaving the window was */
    for (int g = 0; g < nkv; g++) {
        if (!persist[g])
            continue;
        /* the whole middle: fetched once, then grown on the device */
        if (fresh) {
            for (int t = 0; t < middle; t++)
                if ((rc = row_copy(p, kr, buf, g, REKV_HEADS_SINK + t, K - middle + t, io)))
                    return rc;
            rows += (uint64_t)middle;
        } else {
            /* the token leaving the window (len - 1 - recent) joins the region, copied from its
             * ring slot before this unit's new row takes it */
            if (RESERVE(&io->d2d_kv, 2))
                return -ENOMEM;
            const uint8_t *src = buf + rekv_kv_off(rekv_kv_row(nkv, hd, g, slot), hd, row);
            uint8_t *dst = buf + rekv_kv_off(rekv_kv_row(nkv, hd, g, K - middle), hd, row);
            io->d2d_kv.v[io->d2d_kv.n++] = (rekv_copy_piece){dst, src, row};
            io->d2d_kv.v[io->d2d_kv.n++] = (rekv_copy_piece){dst + vs, src + vs, row};
        }
        klen[g] = middle;
        skip[g] = K - middle;
    }
    if ((rc = pl_ig_new_row_store(p, kr, buf, len, slot, io)))
        return rc;
    io->clo->rows0[io->clo->at[j]] = rows;
    d->kv = buf;
    d->start = S - 1;
    d->skip = skip;
    io->kv_pos[d->row0] = slot;
    cnt->d2h_bytes[REKV_XFER_KV] += 2 * (uint64_t)nkv * row;
    cnt->tokens_considered += (uint64_t)len;
    return 0;
}

/* On the h2d stream, after the unit's planned copies: once batch g's speculation is done, the
 * decisions (the clo_decide kernel), then the misses' rows (a copy whose pieces the decisions
 * wrote); ev_read[g], once the decisions ran, lets the next layer's speculation overwrite the
 * scores and queries. The step thread enqueues and goes on, and the device waits for nothing on
 * the host (CLO §4.4, one step further: the paper's decisions are the CPU's). */
static void clo_unit_fetch(rekv_pipeline *p, clo_unit *cu)
{
    const rekv_model_config *c = p->c;
    size_t L = (size_t)cu->layer;
    rekv_clo_shape shape = {c->n_heads,
                            c->n_kv_heads,
                            c->head_dim,
                            p->kv_rowb,
                            p->cfg.max_fraction,
                            p->clo.imp + L * (size_t)c->n_heads,
                            p->clo.tau + L * (size_t)c->n_kv_heads,
                            p->clo.persist_dev + L * (size_t)c->n_kv_heads};
    rekv_stream *sh = p->s_h2d;
    p->bi->stream_wait_event(sh, p->ig.ev[cu->g]);
    p->k->clo_decide(sh, p->ig.scores.p, cu->seqs, cu->n, &shape, p->arena_dev, cu->pieces,
                     &cu->n_pieces);
    p->bi->event_record(p->ig.ev_read[cu->g], sh);
    p->bi->copy_h2d_listed(sh, cu->pieces, &cu->n_pieces, cu->max_pieces, REKV_XFER_KV);
}

/* After the step's work has finished: the decisions' counts into the layers' counters. */
static int clo_step_done(rekv_pipeline *p, step *st, rekv_err *err)
{
    (void)err; /* the device's decisions fail their stream, which the step's drain reports */
    int nkv = p->c->n_kv_heads;
    for (clo_unit *cu = st->clo_units; cu != NULL; cu = cu->next) {
        rekv_layer_counters *cnt = &p->counters[cu->layer];
        uint64_t rows = 0;
        for (int i = 0; i < cu->n; i++) {
            const int32_t *head_k = cu->seqs[i].head_k;
            uint64_t r = cu->rows0[i];
            for (int g = 0; g < nkv; g++) {
                size_t at = (size_t)cu->layer * (size_t)nkv + (size_t)g;
                if (head_k[g] == 0) {
                    cnt->head_hits++;
                    p->clo.hits[at]++;
                } else if (head_k[g] > 0) {
                    cnt->head_misses++;
                    p->clo.misses[at]++;
                    r += (uint64_t)head_k[g];
                }
            }
            rows += r;
            cnt->tokens_fetched += r / (uint64_t)nkv;
        }
        cnt->h2d_bytes[REKV_XFER_KV] += rows * 2 * p->kv_rowb;
    }
    return 0;
}

int rekv_pipeline_head_cache_counts(const rekv_pipeline *p, const uint64_t **hits,
                                    const uint64_t **misses)
{
    *hits = p->clo.hits;
    *misses = p->clo.misses;
    return p->clo.hits ? 0 : -EINVAL;
}

/* ------------------------------------------------------------------ the mode's table entry */

/* infinigen's speculation with whole queries (the similarity test needs them), then the head
 * profile's thresholds and persistent heads */
static int clo_mode_create(rekv_pipeline *p, rekv_err *err)
{
    int rc = pl_ig_create(p, 1, err);
    return rc ? rc : clo_create(p, err);
}

static void clo_mode_free(rekv_pipeline *p)
{
    pl_ig_free(p);
    clo_free(p);
}

/* the head caches, then the partial keys */
static int clo_mode_seq_alloc(rekv_pipeline *p, rekv_pseq *s, rekv_err *err)
{
    int rc = clo_seq_alloc(p, s, err);
    return rc ? rc : pl_ig_seq_alloc(p, s, err);
}

static void clo_mode_seq_free(rekv_pipeline *p, rekv_pseq *s)
{
    pl_ig_seq_free(p, s);
    clo_seq_free(p, s);
}

/* A unit: at layers > 0 the decisions' memory (clo_unit_prepare); each sparse item (a decode row
 * past sink + window; at layer 0 any decode row) from its device caches (clo_item_plan), any
 * other fetched whole, its caches forgotten. */
static int clo_unit_plan(rekv_pipeline *p, step *st, int g, int layer, int b, rekv_attn_seq *d,
                         unit_io *io)
{
    int rc = pl_ig_unit_begin(p, st, g, layer, io), L = p->c->n_layers;
    if (rc || (layer > 0 && (rc = clo_unit_prepare(p, st, g, layer, io))) ||
        (rc = pl_unit_act_alloc(p, st, g, 0, io)))
        return rc;
    for (int j = 0; j < st->g_begin[g + 1] - st->g_begin[g]; j++) {
        int item = st->g_begin[g] + j;
        rekv_pseq *s = st->items[item].seq;
        if (layer > 0 ? clo_sparse(p, st, item) : st->items[item].n_tokens == 1 && s->len > 0) {
            rc = clo_item_plan(p, st, item, j, layer, &st->kv_ref[item * L + layer], &d[j], io);
        } else {
            clo_forget(s, layer);
            rc = pl_item_plan_whole(p, st, item, j, layer, b, d, 1, io);
        }
        if (rc)
            return rc;
    }
    return 0;
}

static void clo_mode_unit_fetch(rekv_pipeline *p, const unit_io *io)
{
    if (io->clo) /* a unit with sparse items: what the speculation decides, decided and fetched */
        clo_unit_fetch(p, io->clo);
}

const pl_mode_ops pl_mode_clo = {
    .mode = REKV_MODE_CLO,
    .create = clo_mode_create,
    .free = clo_mode_free,
    .seq_alloc = clo_mode_seq_alloc,
    .seq_free = clo_mode_seq_free,
    /* from the cache, the partial keys; the caches start forgotten, as after a prefill (the
     * rest of the prompt is one, at least two rows: pipeline_create.c seq_create_prefix) */
    .prefix_fill = pl_ig_prefix_fill,
    .step_prepare = pl_ig_prepare,
    .sparse = clo_sparse,
    .unit_plan = clo_unit_plan,
    .unit_fetch = clo_mode_unit_fetch,
    .step_done = clo_step_done,
};
