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

/* This file: the step (rekv_pipeline_step) — its GPU batches, its units in row or column order on
 * the three streams, one layer's compute — and the config, step parameters and counters. The rest:
 * pipeline_create.c (create/free, the weights on the device, sequences), pipeline_buffers.c (the
 * metadata arena, step memory, device buffers), pipeline_kvstore.c (the plan round trip, each
 * unit's fetch and store lists, push), pipeline_generate.c; what differs by mode is the mode's
 * entry in the mode table (p->ops: mode_*.c, pipeline_modes.c) and its properties (p->info,
 * common/mode.h), never a test of the mode; the structs in pipeline_internal.h. */
#include "gpuworker/pipeline.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "gpuworker/engine_internal.h"
#include "gpuworker/heads.h"
#include "gpuworker/kernels.h"
#include "gpuworker/pipeline_internal.h"

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
    cfg->alpha = 4.0f;
    cfg->max_fraction = 0.2f;
    cfg->select = REKV_SELECT_SPECULATE;
    cfg->lookahead = -1; /* the mode's: pl_ig_create */
    cfg->eta = (float)REKV_HEADS_ETA;
    cfg->power = (float)REKV_HEADS_POWER;
    cfg->persist_np = INFINITY;
}

int rekv_pipeline_keeps_act(const rekv_pipeline_config *cfg)
{
    return rekv_mode_keeps_act(cfg->mode, cfg->split);
}

const rekv_pipeline_config *rekv_pipeline_get_config(const rekv_pipeline *p)
{
    return &p->cfg;
}

int rekv_pipeline_page_locked(const rekv_pipeline *p)
{
    return p->page_locked;
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
            t->tokens_device += c->tokens_device;
            t->tokens_considered += c->tokens_considered;
            t->head_hits += c->head_hits;
            t->head_misses += c->head_misses;
        }
    }
    return p->counters;
}

double rekv_pipeline_selected_fraction(const rekv_layer_counters *per, int n_layers,
                                       uint64_t *considered, uint64_t *selected)
{
    uint64_t c = 0, s = 0;
    for (int l = 1; l < n_layers; l++)
        c += per[l].tokens_considered, s += per[l].tokens_fetched;
    if (considered)
        *considered = c;
    if (selected)
        *selected = s;
    return c ? (double)s / (double)c : 0.0;
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
    if (p->clo.hits) {
        size_t n = (size_t)p->c->n_layers * (size_t)p->c->n_kv_heads;
        memset(p->clo.hits, 0, sizeof(uint64_t) * n);
        memset(p->clo.misses, 0, sizeof(uint64_t) * n);
    }
}

/* ------------------------------------------------------------------ one step */

/* The attention descriptors of batch g for one unit: resident caches or the parity's buffer. */
static rekv_attn_seq *unit_seqs(rekv_pipeline *p, step *st, int g, int layer, int b)
{
    int n = st->g_begin[g + 1] - st->g_begin[g];
    rekv_attn_seq *d = pl_smem_alloc(&st->mem, sizeof(*d) * (size_t)n);
    if (d == NULL)
        return NULL;
    const rekv_model_config *c = p->c;
    size_t off = 0, rb = p->kv_rowb;
    for (int j = 0; j < n; j++) {
        rekv_pipe_item *it = &st->items[st->g_begin[g] + j];
        rekv_pseq *s = it->seq;
        d[j].start = s->len;
        d[j].n = it->n_tokens;
        d[j].row0 = st->row0[st->g_begin[g] + j];
        d[j].skip = NULL;
        /* slot == position here; infinigen, clo refuse a window */
        d[j].window = rekv_config_window(c, layer);
        d[j].scale = c->attn_scale;
        d[j].softcap = c->attn_softcap;
        if (p->info->store == REKV_STORE_NONE) { /* resident: its own cache, in place */
            d[j].kv = s->kv +
                      (size_t)layer * rekv_kv_buffer_bytes(c->n_kv_heads, c->head_dim, s->cap, rb);
        } else {
            d[j].kv = (uint8_t *)p->par[b].attn_kv.p + off;
            off += rekv_kv_buffer_bytes(c->n_kv_heads, c->head_dim, s->len + it->n_tokens, rb);
        }
    }
    return d;
}

rekv_dtype pl_wt(const rekv_pipeline *p, uint32_t qt)
{
    return qt == 0 ? p->e->wdtype : cpu_qgemm_wt(qt);
}

void pl_linear(const rekv_pipeline *p, rekv_stream *s, float *y, const float *x, const void *w,
               uint32_t qt, int tileable, const float *bias, int m, int n, int k)
{
    if (qt) {
        p->k->linear(s, y, x, w, pl_wt(p, qt), bias, m, n, k);
    } else if (tileable && p->e->tiled) {
        /* a backend without the tile layout untiled the engine (rekv_pipeline_create) */
        REKV_ASSERT(p->k->linear_tiled != NULL);
        p->k->linear_tiled(s, y, x, w, p->e->wdtype, bias, m, n, k);
    } else {
        p->k->linear(s, y, x, w, p->e->wdtype, bias, m, n, k);
    }
}

/* A linear's bias, unless the kernels fold it into the pass after the linear (p->fold_bias). */
static const float *fold(const rekv_pipeline *p, const void *bias)
{
    return p->fold_bias ? NULL : bias;
}

/* x += h (m rows of width n) on the compute stream, with the bias of the linear that made h when
 * the kernels fold it here (fold). */
static void residual_add(rekv_pipeline *p, float *x, const float *h, const void *bias, int m, int n)
{
    if (p->fold_bias && bias)
        p->k->bias_add(p->s_compute, x, h, bias, m, n);
    else
        p->k->add(p->s_compute, x, h, (size_t)m * (size_t)n);
}

/* x += in (T x K) projected by w (+ bias b) into h (T x N): the attention's output projection
 * and the FFN's down projection. A layer with a post-norm (Gemma-2) normalises h before the add,
 * so its bias goes in the projection, never folded into the add. */
static void project_add(rekv_pipeline *p, rekv_stream *s, float *x, float *h, const float *in,
                        const void *w, uint32_t qt, const void *b, const float *post_norm_w, int T,
                        int N, int K)
{
    if (post_norm_w) {
        pl_linear(p, s, h, in, w, qt, 1, b, T, N, K);
        p->k->norm(s, h, h, post_norm_w, NULL, T, N, p->c->norm_eps);
        residual_add(p, x, h, NULL, T, N);
    } else {
        pl_linear(p, s, h, in, w, qt, 1, fold(p, b), T, N, K);
        residual_add(p, x, h, b, T, N);
    }
}

/* One layer for the rows of batch g (the same operations, in the same order, as forward.c).
 * io: where kv_scatter puts the new rows (kv_pos) and their partial keys (pk_rows). */
static void layer_compute(rekv_pipeline *p, step *st, int g, int layer, const layer_w *L,
                          const rekv_attn_seq *d, int b, int store, const unit_io *io)
{
    const rekv_model_config *c = p->c;
    const rekv_kernel_iface *k = p->k;
    rekv_stream *s = p->s_compute;
    gbatch *gb = &p->gb[g];
    int T = st->g_rows[g], H = c->hidden, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c);
    int F = c->ffn, nb = st->g_begin[g + 1] - st->g_begin[g];
    float *x = gb->x.p, *h = gb->h.p, *q = gb->q.p, *kk = gb->k.p, *vv = gb->v.p;
    float *att = gb->att.p, *f1 = gb->f1.p, *f3 = gb->f3.p;
    const uint32_t *qt = p->e->lqt[layer];
    size_t n = (size_t)T * (size_t)H;
    if (c->pre_norm) {
        k->norm(s, h, x, L->attn_norm_w, L->attn_norm_b, T, H, c->norm_eps);
    } else {
        rekv_copy_piece pc = {h, x, n * sizeof(float)};
        p->bi->copy_d2d(s, &pc, 1);
    }
    const struct pl_qkv *fq = p->qkv ? &p->qkv[layer] : NULL;
    if (fq && fq->w && fq->w == L->wq) { /* resident, concatenated at upload: one GEMM */
        k->qkv(s, q, kk, vv, h, fq->w, fq->wt, fq->b, T, H, c->n_heads, c->n_kv_heads, c->head_dim,
               st->pos[g], &p->e->rope, c->rope);
    } else {
        pl_linear(p, s, q, h, L->wq, qt[LQT_WQ], 1, L->bq, T, Q, H);
        pl_linear(p, s, kk, h, L->wk, qt[LQT_WK], 1, L->bk, T, KV, H);
        pl_linear(p, s, vv, h, L->wv, qt[LQT_WV], 1, L->bv, T, KV, H);
        if (c->rope != REKV_ROPE_NONE) {
            k->rope(s, q, st->pos[g], T, c->n_heads, c->head_dim, &p->e->rope, c->rope);
            k->rope(s, kk, st->pos[g], T, c->n_kv_heads, c->head_dim, &p->e->rope, c->rope);
        }
    }
    rekv_dtype cdt = p->cfg.cache_dtype;
    if (store) { /* the attention input leaves for the arena (K, V leave from the attention
                    buffer, once scattered into it) */
        p->bi->stream_wait_event(s, p->ev_out_free[b]);
        k->convert_out(s, p->par[b].out_stage.p, h, (size_t)T * (size_t)H, rekv_act_dtype(cdt));
    }
    const int32_t *slots = io->kv_pos ? io->kv_pos : st->pos[g];
    if (io->ig) /* infinigen: also at their positions, where their stores read them (the slots
                   the selection gives them are decided on the h2d stream) */
        k->kv_scatter(s, kk, vv, T, st->row_seq[g], st->pos[g], NULL, d, c->n_kv_heads,
                      c->head_dim, cdt);
    k->kv_scatter(s, kk, vv, T, st->row_seq[g], slots, NULL, d, c->n_kv_heads, c->head_dim, cdt);
    if (io->pk_rows) { /* the partial keys, of the K rows as the cache holds them: a cached
                          block's rebuild them the same (pl_ig_prefix_fill) */
        const float *kc = kk;
        if (cdt != REKV_DTYPE_F32) { /* read back widened into vv, free once scattered */
            k->kv_gather(s, vv, T, st->row_seq[g], slots, d, c->n_kv_heads, c->head_dim, cdt);
            kc = vv;
        }
        k->head_proj(s, NULL, io->pk_rows, kc, p->ig.layers[layer].a, T, c->n_kv_heads, 1,
                     c->head_dim, p->ig.rk);
    }
    k->attention(s, att, q, d, nb, T, c->n_heads, c->n_kv_heads, c->head_dim, p->scores.p, cdt);
    if (store) /* the new rows are ready to leave, and attention has read the buffers */
        p->bi->event_record(p->ev_out[b], s);
    project_add(p, s, x, h, att, L->wo, qt[LQT_WO], L->bo, L->post_attn_norm_w, T, H, Q);
    if (!c->pre_norm)
        k->norm(s, x, x, L->attn_norm_w, L->attn_norm_b, T, H, c->norm_eps);
    if (c->pre_norm) {
        k->norm(s, h, x, L->ffn_norm_w, L->ffn_norm_b, T, H, c->norm_eps);
    } else {
        rekv_copy_piece pc = {h, x, n * sizeof(float)};
        p->bi->copy_d2d(s, &pc, 1);
    }
    pl_linear(p, s, f1, h, L->w1, qt[LQT_W1], 1, fold(p, L->b1), T, F, H);
    if (L->w3)
        pl_linear(p, s, f3, h, L->w3, qt[LQT_W3], 1, NULL, T, F, H);
    if (p->fold_bias && L->b1)
        k->bias_activation(s, f1, L->b1, L->w3 ? f3 : NULL, T, F, c->act);
    else
        k->activation(s, f1, L->w3 ? f3 : NULL, (size_t)T * (size_t)F, c->act);
    project_add(p, s, x, h, f1, L->w2, qt[LQT_W2], L->b2, L->post_ffn_norm_w, T, H, F);
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
    st->row0 = pl_smem_alloc(&st->mem, sizeof(int) * (size_t)n);
    st->split = pl_smem_alloc(&st->mem, sizeof(int) * (size_t)n);
    if (st->row0 == NULL || st->split == NULL)
        return -ENOMEM;
    if (st->items[0].gpu_batch > 0) {
        /* the planner's mini-batches: group the items (a copy; logits pointers travel along) */
        rekv_pipe_item *sorted = pl_smem_alloc(&st->mem, sizeof(*sorted) * (size_t)n);
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
        st->tok[g] = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)rows);
        st->pos[g] = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)rows);
        st->row_seq[g] = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)rows);
        st->last[g] = pl_smem_alloc(&st->mem, sizeof(int32_t) * (size_t)nb);
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
            (it->smp && (it->token == NULL || it->n_top < 0 || it->n_top > p->c->vocab ||
                         (it->n_top > 0 && (it->top_ids == NULL || it->top_vals == NULL)) ||
                         (it->logprob && it->n_top > 0 && it->top_lp == NULL))))
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
        (p->info->store == REKV_STORE_PATTERN && sp->kv_parts + sp->act_parts == 0) ||
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

typedef struct top_pair {
    float v;
    int32_t id;
} top_pair;

/* Where the draws' log-sum-exps (rekv_sample_lp [nb]) start in a draw's copy of nb ids and tops
 * top ids and logits: past them, 8-aligned. */
static size_t picks_lp_at(int nb, size_t tops)
{
    return (4 * (size_t)nb + 8 * tops + 7) & ~(size_t)7;
}

/* The bytes of a draw's copy back: the ids and top logits, and the log-sum-exps only when an
 * item asks for log-probabilities (lps). */
static size_t picks_bytes(int nb, size_t tops, int lps)
{
    return lps ? picks_lp_at(nb, tops) + sizeof(rekv_sample_lp) * (size_t)nb
               : 4 * (size_t)nb + 8 * tops;
}

/* What batch g's head sends back, on sc after its logits: the logits rows items ask for, and the
 * device's draws for the items with a sampler (ids, top logits and log-sum-exps in one copy, into
 * st->picks[g]). Each draw uses the number its sampler draws next, from a copy of the state. */
static int head_back(rekv_pipeline *p, step *st, int g, rekv_stream *sc, rekv_err *err)
{
    gbatch *gb = &p->gb[g];
    int V = p->c->vocab, b0 = st->g_begin[g], nb = st->g_begin[g + 1] - b0, draws = 0, lps = 0;
    size_t tops = 0, n_pc = 0;
    rekv_copy_piece *pc = pl_smem_alloc(&st->mem, sizeof(rekv_copy_piece) * (size_t)(nb + 1));
    rekv_sample_row *sr = pl_smem_alloc(&st->mem, sizeof(rekv_sample_row) * (size_t)nb);
    if (pc == NULL || sr == NULL)
        return rekv_errf(err, -ENOMEM, "step: out of memory");
    for (int j = 0; j < nb; j++) {
        const rekv_pipe_item *it = &st->items[b0 + j];
        if (it->logits)
            pc[n_pc++] = (rekv_copy_piece){it->logits, (float *)gb->logits.p + (size_t)j * V,
                                           sizeof(float) * (size_t)V};
        sr[j] = (rekv_sample_row){.temperature = 0};
        if (it->smp) {
            rekv_sampler next = *it->smp;
            sr[j] = (rekv_sample_row){next.temperature,   next.top_p, rekv_sampler_draw(&next),
                                      next.top_k,         it->n_top,  (int)tops,
                                      it->logprob != NULL};
            tops += (size_t)it->n_top;
            draws++;
            lps += it->logprob != NULL;
        }
    }
    if (draws) {
        /* the copy's bytes, then room for take_draws to rank the top logits in */
        size_t bytes = picks_bytes(nb, tops, lps);
        int32_t *host = pl_smem_alloc(&st->mem, bytes + sizeof(top_pair) * tops);
        if (host == NULL)
            return rekv_errf(err, -ENOMEM, "step: out of memory");
        int32_t *ids = (int32_t *)((char *)gb->picks.p + 8 * (size_t)V), *top_ids = ids + nb;
        p->k->sample(sc, ids, top_ids, (float *)(top_ids + tops),
                     (rekv_sample_lp *)((char *)ids + picks_lp_at(nb, tops)), gb->logits.p, sr, nb,
                     V, gb->picks.p);
        pc[n_pc++] = (rekv_copy_piece){host, ids, bytes};
        st->picks[g] = host;
    }
    if (n_pc)
        p->bi->copy_d2h(sc, pc, n_pc, REKV_XFER_OTHER);
    return 0;
}

static int top_desc(const void *a, const void *b)
{
    const top_pair *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* 1 when a draw of the step gave -1 (rekv_sample_drawn: a NaN logit) */
static int draws_nan(const step *st)
{
    for (int g = 0; g < st->n_g; g++) {
        int b0 = st->g_begin[g], nb = st->g_begin[g + 1] - b0;
        const int32_t *ids = st->picks[g];
        for (int j = 0; ids && j < nb; j++)
            if (st->items[b0 + j].smp && ids[j] < 0)
                return 1;
    }
    return 0;
}

/* After a step that succeeded: each drawing item's token and top logits (ranked as
 * rekv_top_logits ranks them) from the copied-back draws, and its sampler's state advanced. */
static void take_draws(step *st)
{
    for (int g = 0; g < st->n_g; g++) {
        int b0 = st->g_begin[g], nb = st->g_begin[g + 1] - b0;
        const int32_t *ids = st->picks[g];
        if (ids == NULL)
            continue;
        size_t tops = 0, at = 0;
        int lps = 0;
        for (int j = 0; j < nb; j++) {
            const rekv_pipe_item *it = &st->items[b0 + j];
            tops += it->smp ? (size_t)it->n_top : 0;
            lps += it->smp && it->logprob;
        }
        const int32_t *top_ids = ids + nb;
        const float *top_vals = (const float *)(top_ids + tops);
        const rekv_sample_lp *lp =
            (const rekv_sample_lp *)((const char *)ids + picks_lp_at(nb, tops));
        top_pair *tp = (top_pair *)((char *)ids + picks_bytes(nb, tops, lps));
        for (int j = 0; j < nb; j++) {
            rekv_pipe_item *it = &st->items[b0 + j];
            if (it->smp == NULL)
                continue;
            *it->token = ids[j];
            rekv_sampler_draw(it->smp);
            if (it->logprob) /* one rounding, of the exact difference */
                *it->logprob = (float)((double)lp[j].logit - lp[j].lse);
            if (it->n_top == 0)
                continue;
            for (int t = 0; t < it->n_top; t++)
                tp[t] = (top_pair){top_vals[at + t], top_ids[at + t]};
            qsort(tp, (size_t)it->n_top, sizeof(top_pair), top_desc);
            for (int t = 0; t < it->n_top; t++) {
                it->top_ids[t] = tp[t].id;
                it->top_vals[t] = tp[t].v;
                if (it->logprob)
                    it->top_lp[t] = (float)((double)tp[t].v - lp[j].lse);
            }
            at += (size_t)it->n_top;
        }
    }
}

/* Every GPU batch's token (and position) embeddings into its residual stream. */
static void step_embed(rekv_pipeline *p, const step *st)
{
    const rekv_kernel_iface *k = p->k;
    rekv_stream *sc = p->s_compute;
    int E = p->c->embed_dim, H = p->c->hidden;
    for (int g = 0; g < st->n_g; g++) {
        gbatch *gb = &p->gb[g];
        int T = st->g_rows[g];
        if (p->d_proj_in) {
            k->embed(sc, gb->h.p, p->d_embed, pl_wt(p, p->e->embed_qt), st->tok[g], NULL, NULL, 0,
                     T, E);
            if (p->c->embed_scale != 0)
                k->scale(sc, gb->h.p, (size_t)T * (size_t)E, p->c->embed_scale);
            pl_linear(p, sc, gb->x.p, gb->h.p, p->d_proj_in, 0, 1, NULL, T, H, E);
            if (p->d_pos)
                k->embed(sc, gb->x.p, NULL, p->e->wdtype, st->tok[g], p->d_pos, st->pos[g], 2, T,
                         H);
        } else {
            k->embed(sc, gb->x.p, p->d_embed, pl_wt(p, p->e->embed_qt), st->tok[g], p->d_pos,
                     st->pos[g], 2, T, E);
            if (p->c->embed_scale != 0) /* Gemma */
                k->scale(sc, gb->x.p, (size_t)T * (size_t)E, p->c->embed_scale);
        }
    }
}

/* One unit as the step runs it: where it is, its weights, its attention descriptors and its
 * planned copies. */
typedef struct unit_run {
    int g, layer, b;  /* batch, layer, parity */
    int load, wb;     /* whether it loads its layer's weights, and into which buffer */
    const layer_w *W; /* the weights it computes with */
    rekv_attn_seq *d;
    unit_io io;
} unit_run;

/* A unit's h2d work, in the order the compute needs it (KVPR's fine-grained pipeline): W_K and
 * W_V, the activations to recompute from, the rest of the weights, then the KV rows — so the
 * recomputation runs while the rest streams. */
static int unit_loads(rekv_pipeline *p, unit_run *u, int *w_loads, rekv_err *err)
{
    rekv_stream *sh = p->s_h2d;
    int streams = p->info->store != REKV_STORE_NONE, b = u->b, wb = u->wb, rc;
    const unit_io *io = &u->io;
    if (u->load) {
        p->bi->stream_wait_event(sh, p->ev_wfree[wb]);
        p->counters[u->layer].h2d_bytes[REKV_XFER_WEIGHTS] +=
            pl_copy_layer(p, sh, &p->e->layers[u->layer], &p->wbuf[wb], 0, N_KV_TENSORS);
        p->bi->event_record(p->ev_wkv[wb], sh);
    }
    if (streams) {
        /* staging is free once the compute of unit u-2 has converted it */
        p->bi->stream_wait_event(sh, p->ev_stage_free[b]);
        if (io->h2d_act.n)
            p->bi->copy_h2d(sh, io->h2d_act.v, io->h2d_act.n, REKV_XFER_ACT);
        p->bi->event_record(p->ev_act[b], sh);
    }
    if (u->load) {
        p->counters[u->layer].h2d_bytes[REKV_XFER_WEIGHTS] += pl_copy_layer(
            p, sh, &p->e->layers[u->layer], &p->wbuf[wb], N_KV_TENSORS, N_LAYER_TENSORS);
        p->bi->event_record(p->ev_wall[wb], sh);
        (*w_loads)++;
    }
    if (!streams)
        return 0;
    /* into the attention buffers, once the unit two back has read them: by our own copies
     * (pull), or by the store's (push: it waits for ev_attn_free[b] itself) */
    if (p->cfg.push && io->h2d_kv.n && (rc = pl_push_unit(p, b, io, err)))
        return rc;
    if (!p->cfg.push || io->d2d_kv.n) { /* our own copies (push: the device part's) */
        p->bi->stream_wait_event(sh, p->ev_attn_free[b]);
        /* the device part; clo: before this unit's new row takes the slot */
        if (io->d2d_kv.n)
            p->bi->copy_d2d(sh, io->d2d_kv.v, io->d2d_kv.n);
        if (!p->cfg.push && io->h2d_kv.n)
            p->bi->copy_h2d(sh, io->h2d_kv.v, io->h2d_kv.n, REKV_XFER_KV);
        if (p->ops->unit_fetch) /* what the mode fetches after the plan's copies (clo) */
            p->ops->unit_fetch(p, io);
        p->bi->event_record(p->ev_loaded[b], sh);
    }
    return 0;
}

/* On the compute stream, once the stores of the unit two back have read the attention buffers
 * (they may hold another batch's rows): K,V recomputed from the unit's activation rows into
 * them; then the wait for the unit's loads. */
static void unit_recompute(rekv_pipeline *p, const unit_run *u)
{
    const rekv_model_config *c = p->c;
    const rekv_kernel_iface *k = p->k;
    rekv_stream *sc = p->s_compute;
    const unit_io *io = &u->io;
    const layer_w *W = u->W;
    int b = u->b;
    p->bi->stream_wait_event(sc, p->ev_attn_free[b]);
    if (io->n_act) {
        p->bi->stream_wait_event(sc, p->ev_act[b]);
        k->convert(sc, io->conv_act.v, io->conv_act.n, rekv_act_dtype(p->cfg.cache_dtype));
        if (p->cfg.offload_weights)
            p->bi->stream_wait_event(sc, p->ev_wkv[u->wb]);
        pl_linear(p, sc, p->kr.p, p->act_f32.p, W->wk, p->e->lqt[u->layer][LQT_WK], 1, W->bk,
                  io->n_act, rekv_config_kv_dim(c), c->hidden);
        pl_linear(p, sc, p->vr.p, p->act_f32.p, W->wv, p->e->lqt[u->layer][LQT_WV], 1, W->bv,
                  io->n_act, rekv_config_kv_dim(c), c->hidden);
        if (c->rope != REKV_ROPE_NONE)
            k->rope(sc, p->kr.p, io->act_pos, io->n_act, c->n_kv_heads, c->head_dim, &p->e->rope,
                    c->rope);
        k->kv_scatter(sc, p->kr.p, p->vr.p, io->n_act, io->act_seq, io->act_pos, io->act_slot, u->d,
                      c->n_kv_heads, c->head_dim, p->cfg.cache_dtype);
    }
    p->bi->event_record(p->ev_stage_free[b], sc);
    if (!p->cfg.push || io->d2d_kv.n)
        p->bi->stream_wait_event(sc, p->ev_loaded[b]);
    if (p->cfg.push && io->h2d_kv.n)
        p->bi->stream_wait_event(sc, p->ev_pushed[b]);
}

/* d2h: the unit's new rows, from its parity's attention buffer and output staging; then the
 * buffers may take the next unit's rows. */
static void unit_stores(rekv_pipeline *p, const unit_run *u)
{
    rekv_stream *sd = p->s_d2h;
    const unit_io *io = &u->io;
    int b = u->b;
    p->bi->stream_wait_event(sd, p->ev_out[b]);
    if (io->d2h_kv.n)
        p->bi->copy_d2h(sd, io->d2h_kv.v, io->d2h_kv.n, REKV_XFER_KV);
    if (io->d2h_act.n)
        p->bi->copy_d2h(sd, io->d2h_act.v, io->d2h_act.n, REKV_XFER_ACT);
    if (io->d2d_new.n) /* the device copies of the new rows (ACT_GPU, device part) */
        p->bi->copy_d2d(sd, io->d2d_new.v, io->d2d_new.n);
    p->bi->event_record(p->ev_out_free[b], sd);
    p->bi->event_record(p->ev_attn_free[b], sd);
}

/* Unit number un of the step in schedule order: the next layer window where this one ends, the
 * mode's plan (streaming modes), the loads, the speculation for the next layer, the
 * recomputation, the layer, the stores. */
static int unit_step(rekv_pipeline *p, step *st, int un, int *w_loads, rekv_err *err)
{
    int streams = p->info->store != REKV_STORE_NONE, rc;
    unit_run u = {.b = un & 1};
    pl_unit_at(p, st, un, &u.g, &u.layer);
    /* the next layer window: once every unit of this one is done (its blocks read and its new
     * rows stored), it is unpinned and the next pinned — its blocks read ahead while this one
     * ran */
    if (streams && st->win >= 0 && un == st->win_u0[st->win + 1]) {
        int next = st->win + 1;
        rekv_stream *all[3] = {p->s_h2d, p->s_compute, p->s_d2h};
        if ((rc = p->bi->streams_sync(all, 3, err)) || (rc = pl_window_unpin(p, st, err)) ||
            (rc = pl_window_pin(p, st, next, err)))
            return rc;
    }
    /* weights: column schedule loads a layer once for all its GPU batches, row once per unit;
     * two buffers alternate */
    u.load = p->cfg.offload_weights && (p->cfg.schedule == REKV_SCHED_COLUMN ? u.g == 0 : 1);
    u.wb = (*w_loads - (u.load ? 0 : 1)) & 1;
    u.W = p->cfg.offload_weights ? &p->wbuf[u.wb] : &p->dev_layers[u.layer];
    if ((u.d = unit_seqs(p, st, u.g, u.layer, u.b)) == NULL)
        return rekv_errf(err, -ENOMEM, "step: out of memory");
    /* speculation without lookahead: this layer's, from its own input */
    if (u.layer > 0 && pl_ig_lookahead(p, u.layer) == 0 &&
        pl_ig_speculates(p, st, u.g, u.layer - 1) &&
        (rc = pl_ig_speculate(p, st, u.g, u.layer)))
        return rekv_errf(err, rc, "step: out of memory");
    if (streams) {
        rc = p->ops->unit_plan(p, st, u.g, u.layer, u.b, u.d, &u.io);
        int krc = pl_unit_io_keep(st, &u.io);
        if (rc || krc)
            return rekv_errf(err, rc ? rc : krc, "step: %s",
                             rc == -EPROTO ? "the kvstore's plan does not cover the context"
                                           : "out of memory");
    }
    if ((rc = unit_loads(p, &u, w_loads, err)))
        return rc;
    if (streams) {
        /* the speculation for the next layer, from this layer's input, before this unit's KV or
         * weights are waited for */
        if (pl_ig_lookahead(p, u.layer + 1) == 1 && pl_ig_speculates(p, st, u.g, u.layer) &&
            (rc = pl_ig_speculate(p, st, u.g, u.layer + 1)))
            return rekv_errf(err, rc, "step: out of memory");
        unit_recompute(p, &u);
    }
    if (p->cfg.offload_weights)
        p->bi->stream_wait_event(p->s_compute, p->ev_wall[u.wb]);
    layer_compute(p, st, u.g, u.layer, u.W, u.d, u.b, streams, &u.io);
    if (streams)
        unit_stores(p, &u);
    if (p->cfg.offload_weights)
        p->bi->event_record(p->ev_wfree[u.wb], p->s_compute);
    return 0;
}

/* The head: each sequence's last row -> logits -> what goes back (head_back). */
static int step_head(rekv_pipeline *p, step *st, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    const rekv_kernel_iface *k = p->k;
    rekv_stream *sc = p->s_compute;
    int E = c->embed_dim, H = c->hidden, rc;
    for (int g = 0; g < st->n_g; g++) {
        gbatch *gb = &p->gb[g];
        int nb = st->g_begin[g + 1] - st->g_begin[g];
        float *rows = gb->h.p; /* h is free after the last layer */
        k->gather_rows(sc, rows, gb->x.p, st->last[g], nb, H);
        if (p->d_fnorm_w)
            k->norm(sc, rows, rows, p->d_fnorm_w, p->d_fnorm_b, nb, H, c->norm_eps);
        if (p->d_proj_out) {
            pl_linear(p, sc, gb->q.p, rows, p->d_proj_out, 0, 1, NULL, nb, E, H);
            rows = gb->q.p;
        }
        pl_linear(p, sc, gb->logits.p, rows, p->d_head, p->e->head_qt, !p->head_tied, NULL, nb,
                  c->vocab, E);
        if (c->final_softcap > 0) /* Gemma-2 */
            k->softcap(sc, gb->logits.p, (size_t)nb * (size_t)c->vocab, c->final_softcap);
        if ((rc = head_back(p, st, g, sc, err)))
            return rc;
    }
    return 0;
}

/* This step's totals into the step log: the running totals minus those at the end of the last
 * step. */
static void step_log(rekv_pipeline *p)
{
    rekv_layer_counters now, *log = p->step_log;
    rekv_pipeline_counters(p, &now);
    if (pl_reserve_bytes((void **)&log, &p->cap_steps, p->n_steps + 1, sizeof(*log)) == 0) {
        p->step_log = log;
        rekv_layer_counters d = now;
        for (int x = 0; x < REKV_XFER_KINDS; x++) {
            d.h2d_bytes[x] -= p->logged.h2d_bytes[x];
            d.d2h_bytes[x] -= p->logged.d2h_bytes[x];
        }
        d.tokens_recomputed -= p->logged.tokens_recomputed;
        d.tokens_fetched -= p->logged.tokens_fetched;
        d.tokens_device -= p->logged.tokens_device;
        d.tokens_considered -= p->logged.tokens_considered;
        d.head_hits -= p->logged.head_hits;
        d.head_misses -= p->logged.head_misses;
        log[p->n_steps++] = d;
    }
    p->logged = now;
}

/* Before the first unit: the step's batches, the store's plan (streaming modes), every buffer,
 * the mode's step memory, the recomputation's buffers last. */
static int step_prepare(rekv_pipeline *p, step *st, rekv_err *err)
{
    int rc;
    if ((rc = setup_batches(p, st)))
        return rekv_errf(err, rc,
                         rc == -E2BIG ? "step: more than 64 GPU batches" : "step: out of memory");
    if (p->info->store != REKV_STORE_NONE &&
        ((rc = pl_store_prepare(p, st, err)) || (rc = pl_window_pin(p, st, 0, err))))
        return rc;
    if ((rc = pl_ensure_buffers(p, st, err)) ||
        (p->ops->step_prepare && (rc = p->ops->step_prepare(p, st, err))))
        return rc;
    return pl_ensure_recompute(p, st, err);
}

int rekv_pipeline_step(rekv_pipeline *p, rekv_pipe_item *items, int n_items, rekv_err *err)
{
    int rc, graphed = 0;
    if ((rc = validate(p, items, n_items, err)))
        return rc;
    step st = {.items = items, .n_items = n_items, .mem = {.meta = &p->meta}, .win = -1};
    if ((rc = step_prepare(p, &st, err)))
        goto out;
    /* a resident decode step is recorded, to run as one graph where it repeats */
    graphed = pl_graph_begin(p, items, n_items);
    step_embed(p, &st);
    /* units in schedule order */
    for (int u = 0, w_loads = 0; u < p->c->n_layers * st.n_g && rc == 0; u++)
        rc = unit_step(p, &st, u, &w_loads, err);
    if (rc == 0)
        rc = step_head(p, &st, err);
    if (graphed) { /* the recorded work runs now: as the graph, captured, or call by call */
        int grc = pl_graph_end(p, rc == 0, rc ? NULL : err);
        rc = rc ? rc : grc;
    }
    /* every enqueued task refers to step memory: wait for all of it, whatever happened — on
     * each stream the step used (a stream's failures are read by its sync alone), as one
     * blocking call: the step's one wait. h2d carries a step's loads
     * (the store's rows, offloaded weights), d2h its stores. */
    int streams = p->info->store != REKV_STORE_NONE, n_used = 0;
    rekv_stream *used[3];
    if (streams || p->cfg.offload_weights)
        used[n_used++] = p->s_h2d;
    used[n_used++] = p->s_compute;
    if (streams)
        used[n_used++] = p->s_d2h;
    int rs = p->bi->streams_sync(used, n_used, rc ? NULL : err);
    if (rc == 0)
        rc = rs;
    if (p->ops->step_done) {
        int drc = p->ops->step_done(p, &st, rc ? NULL : err);
        rc = rc ? rc : drc;
    }
    if (rc == 0 && draws_nan(&st))
        rc = rekv_errf(err, -EDOM, "%s", REKV_NAN_LOGITS);
    if (rc == 0) {
        take_draws(&st);
        for (int i = 0; i < n_items; i++) {
            items[i].seq->len += items[i].n_tokens;
            items[i].seq->dev_stale = 0; /* the step filled it (pipeline_kvstore.c item_stores) */
        }
        step_log(p);
    }
out:
    if (st.win >= 0) {
        rekv_err uerr = {0};
        int urc = pl_window_unpin(p, &st, &uerr);
        if (rc == 0 && urc) {
            rc = urc;
            rekv_errf(err, urc, "%s", uerr.msg);
        }
    }
    /* after the unpin, so the blocks it frees are nobody's pins */
    for (int i = 0; rc == 0 && i < n_items; i++)
        pl_window_drop(p, items[i].seq);
    pl_smem_free(&st.mem);
    return rc;
}
