/* kernels_cpu.c — the cpu backend's kernel table: each kernel packs its arguments and runs
 * the fp32 reference of cpu_ops.h as a task on the stream it was launched on. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/log.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/cpu_qgemm.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/heads.h"
#include "gpuworker/kernels.h"
#include "gpuworker/pipeline.h"
#include "loader/gguf.h"

/* the most threads the sample kernel shares its rows with */
#define CPU_SAMPLE_MAX_THREADS 64

/* The stream's backend iface is needed to launch; streams of the cpu backend all share it. */
#define LAUNCH(s, name, fn, args)                                                                  \
    rekv_cpu_backend_iface.launch_host((s), (name), (fn), &(args), sizeof(args))

typedef struct linear_args {
    float *y;
    const float *x;
    const void *w;
    rekv_dtype wt;
    const float *bias;
    int m, n, k;
    int tiled; /* w in the tile layout */
} linear_args;

static void run_linear(void *p)
{
    linear_args *a = p;
    uint32_t qt = cpu_qgemm_wt_type(a->wt); /* quantized blocks: the engine checked the type */
    if (qt)
        (void)cpu_qgemm_rowinv(a->y, a->x, a->w, qt, a->bias, a->m, a->n, a->k);
    else
        (a->tiled ? cpu_gemm_rowinv_tiled : cpu_gemm_rowinv)(a->y, a->x, a->w, a->wt, a->bias, a->m,
                                                             a->n, a->k);
}

static void k_linear(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                     const float *bias, int m, int n, int k)
{
    linear_args a = {y, x, w, wt, bias, m, n, k, 0};
    LAUNCH(s, "linear", run_linear, a);
}

static void k_linear_tiled(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                           const float *bias, int m, int n, int k)
{
    linear_args a = {y, x, w, wt, bias, m, n, k, 1};
    LAUNCH(s, "linear", run_linear, a);
}

typedef struct norm_args {
    float *out;
    const float *in, *w, *b;
    int m, d;
    float eps;
} norm_args;

static void run_norm(void *p)
{
    norm_args *a = p;
    cpu_norm(a->out, a->in, a->w, a->b, a->m, a->d, a->eps);
}

static void k_norm(rekv_stream *s, float *out, const float *in, const float *w, const float *b,
                   int m, int d, float eps)
{
    norm_args a = {out, in, w, b, m, d, eps};
    LAUNCH(s, "norm", run_norm, a);
}

typedef struct rope_args {
    float *x;
    const int32_t *pos;
    int m, n_heads, head_dim;
    const rekv_rope_freqs *f;
    rekv_rope style;
} rope_args;

static void run_rope(void *p)
{
    rope_args *a = p;
    enum { CHUNK = 16 };
    float c[CHUNK * 256], sn[CHUNK * 256]; /* head_dim <= 512: half <= 256 */
    int pos[CHUNK];
    size_t width = (size_t)a->n_heads * (size_t)a->head_dim;
    for (int i0 = 0; i0 < a->m; i0 += CHUNK) {
        int m = a->m - i0 < CHUNK ? a->m - i0 : CHUNK;
        for (int i = 0; i < m; i++)
            pos[i] = a->pos[i0 + i];
        cpu_rope_table(c, sn, pos, m, a->f);
        cpu_rope(a->x + (size_t)i0 * width, c, sn, m, a->n_heads, a->head_dim, a->style);
    }
}

static void k_rope(rekv_stream *s, float *x, const int32_t *pos, int m, int n_heads, int head_dim,
                   const rekv_rope_freqs *f, rekv_rope style)
{
    REKV_ASSERT(f->half * 2 == head_dim);
    rope_args a = {x, pos, m, n_heads, head_dim, f, style};
    LAUNCH(s, "rope", run_rope, a);
}

typedef struct act_args {
    float *a;
    const float *b;
    size_t n;
    rekv_act act;
} act_args;

static void run_act(void *p)
{
    act_args *a = p;
    cpu_activation(a->a, a->b, a->n, a->act);
}

static void k_activation(rekv_stream *s, float *x, const float *b, size_t n, rekv_act act)
{
    act_args a = {x, b, n, act};
    LAUNCH(s, "activation", run_act, a);
}

typedef struct add_args {
    float *x;
    const float *y;
    size_t n;
} add_args;

static void run_add(void *p)
{
    add_args *a = p;
    for (size_t i = 0; i < a->n; i++)
        a->x[i] += a->y[i];
}

static void k_add(rekv_stream *s, float *x, const float *y, size_t n)
{
    add_args a = {x, y, n};
    LAUNCH(s, "add", run_add, a);
}

typedef struct embed_args {
    float *x;
    const void *table;
    rekv_dtype tt;
    const float *pos_table;
    const int32_t *tokens, *pos;
    int pos_offset, m, e;
} embed_args;

static void run_embed(void *p)
{
    embed_args *a = p;
    uint32_t qt = cpu_qgemm_wt_type(a->tt); /* quantized rows: dequantized, as ggml's get_rows */
    size_t rb = qt ? cpu_qgemm_row_bytes(qt, a->e) : (size_t)a->e * rekv_dtype_size(a->tt);
    for (int i = 0; i < a->m; i++) {
        float *row = a->x + (size_t)i * a->e;
        const char *src = a->table ? (const char *)a->table + (size_t)a->tokens[i] * rb : NULL;
        if (src && qt)
            (void)rekv_ggml_dequant_row(qt, src, (uint64_t)a->e, row);
        else if (src)
            rekv_to_f32(row, src, a->tt, (size_t)a->e);
        if (a->pos_table) {
            const float *pr = a->pos_table + (size_t)(a->pos[i] + a->pos_offset) * a->e;
            for (int j = 0; j < a->e; j++)
                row[j] += pr[j];
        }
    }
}

static void k_embed(rekv_stream *s, float *x, const void *table, rekv_dtype tt,
                    const int32_t *tokens, const float *pos_table, const int32_t *pos,
                    int pos_offset, int m, int e)
{
    embed_args a = {x, table, tt, pos_table, tokens, pos, pos_offset, m, e};
    LAUNCH(s, "embed", run_embed, a);
}

typedef struct scatter_args {
    const float *k, *v;
    int rows;
    const int32_t *row_seq, *row_pos, *head_pos;
    const rekv_attn_seq *seqs;
    int n_kv, hd;
    rekv_dtype dt;
} scatter_args;

static void run_scatter(void *p)
{
    scatter_args *a = p;
    /* a row is quantized here, as it is made (int8/int4: rekv_kv_row_from_f32's scheme) */
    size_t hd = (size_t)a->hd, rb = rekv_kv_row_bytes(a->dt, a->hd);
    size_t vs = rekv_kv_off(rekv_kv_v_shift(a->n_kv, a->hd), a->hd, rb);
    for (int r = 0; r < a->rows; r++) {
        char *kv = a->seqs[a->row_seq[r]].kv;
        for (int g = 0; g < a->n_kv; g++) {
            int slot =
                a->head_pos ? a->head_pos[(size_t)r * (size_t)a->n_kv + (size_t)g] : a->row_pos[r];
            if (slot < 0)
                continue;
            size_t dst = rekv_kv_off(rekv_kv_row(a->n_kv, a->hd, g, slot), a->hd, rb);
            size_t src = ((size_t)r * (size_t)a->n_kv + (size_t)g) * hd;
            rekv_kv_row_from_f32(kv + dst, a->k + src, a->dt, a->hd);
            rekv_kv_row_from_f32(kv + dst + vs, a->v + src, a->dt, a->hd);
        }
    }
}

static void k_kv_scatter(rekv_stream *s, const float *k, const float *v, int rows,
                         const int32_t *row_seq, const int32_t *row_pos, const int32_t *head_pos,
                         const rekv_attn_seq *seqs, int n_kv, int head_dim, rekv_dtype dt)
{
    scatter_args a = {k, v, rows, row_seq, row_pos, head_pos, seqs, n_kv, head_dim, dt};
    LAUNCH(s, "kv_scatter", run_scatter, a);
}

typedef struct gather_k_args {
    float *k;
    int rows;
    const int32_t *row_seq, *row_pos;
    const rekv_attn_seq *seqs;
    int n_kv, hd;
    rekv_dtype dt;
} gather_k_args;

static void run_gather_k(void *p)
{
    gather_k_args *a = p;
    size_t hd = (size_t)a->hd, rb = rekv_kv_row_bytes(a->dt, a->hd);
    for (int r = 0; r < a->rows; r++) {
        const char *kv = a->seqs[a->row_seq ? a->row_seq[r] : 0].kv;
        int slot = a->row_pos ? a->row_pos[r] : r;
        for (int g = 0; g < a->n_kv; g++)
            rekv_kv_row_to_f32(a->k + ((size_t)r * (size_t)a->n_kv + (size_t)g) * hd,
                               kv + rekv_kv_off(rekv_kv_row(a->n_kv, a->hd, g, slot), a->hd, rb),
                               a->dt, a->hd);
    }
}

static void k_kv_gather(rekv_stream *s, float *k, int rows, const int32_t *row_seq,
                        const int32_t *row_pos, const rekv_attn_seq *seqs, int n_kv, int head_dim,
                        rekv_dtype dt)
{
    gather_k_args a = {k, rows, row_seq, row_pos, seqs, n_kv, head_dim, dt};
    LAUNCH(s, "kv_gather", run_gather_k, a);
}

typedef struct attn_args {
    float *out;
    const float *q;
    const rekv_attn_seq *seqs;
    int n_seqs, n_heads, n_kv, hd;
    float *scores;
    rekv_dtype dt;
} attn_args;

static void run_attention(void *p)
{
    attn_args *a = p;
    cpu_attention(a->out, a->q, a->seqs, a->n_seqs, a->n_heads, a->n_kv, a->hd, a->dt, a->scores);
}

static void k_attention(rekv_stream *s, float *out, const float *q, const rekv_attn_seq *seqs,
                        int n_seqs, int rows, int n_heads, int n_kv, int head_dim, float *scores,
                        rekv_dtype dt)
{
    (void)rows;
    attn_args a = {out, q, seqs, n_seqs, n_heads, n_kv, head_dim, scores, dt};
    LAUNCH(s, "attention", run_attention, a);
}

typedef struct convert_args {
    const rekv_convert_piece *pieces;
    size_t n;
    rekv_dtype dtype;
} convert_args;

static void run_convert(void *p)
{
    convert_args *a = p;
    for (size_t i = 0; i < a->n; i++)
        rekv_to_f32(a->pieces[i].dst, a->pieces[i].src, a->dtype, a->pieces[i].n);
}

static void k_convert(rekv_stream *s, const rekv_convert_piece *pieces, size_t n, rekv_dtype dtype)
{
    convert_args a = {pieces, n, dtype};
    LAUNCH(s, "merge", run_convert, a);
}

typedef struct convert_out_args {
    void *dst;
    const float *src;
    size_t n;
    rekv_dtype dtype;
} convert_out_args;

static void run_convert_out(void *p)
{
    convert_out_args *a = p;
    rekv_from_f32(a->dst, a->src, a->dtype, a->n);
}

static void k_convert_out(rekv_stream *s, void *dst, const float *src, size_t n, rekv_dtype dtype)
{
    convert_out_args a = {dst, src, n, dtype};
    LAUNCH(s, "convert_out", run_convert_out, a);
}

typedef struct gather_args {
    float *dst;
    const float *src;
    const int32_t *idx;
    int n, w;
} gather_args;

static void run_gather(void *p)
{
    gather_args *a = p;
    for (int i = 0; i < a->n; i++)
        memmove(a->dst + (size_t)i * a->w, a->src + (size_t)a->idx[i] * a->w,
                sizeof(float) * (size_t)a->w);
}

static void k_gather_rows(rekv_stream *s, float *dst, const float *src, const int32_t *idx, int n,
                          int w)
{
    gather_args a = {dst, src, idx, n, w};
    LAUNCH(s, "gather_rows", run_gather, a);
}

typedef struct head_proj_args {
    float *out;
    float *const *out_rows;
    const float *in, *a;
    int rows, n_heads, group, hd, rk;
} head_proj_args;

static void run_head_proj(void *p)
{
    head_proj_args *a = p;
    cpu_head_proj(a->out, a->out_rows, a->in, a->a, a->rows, a->n_heads, a->group, a->hd, a->rk);
}

static void k_head_proj(rekv_stream *s, float *out, float *const *out_rows, const float *in,
                        const float *a, int rows, int n_heads, int group, int hd, int rk)
{
    head_proj_args x = {out, out_rows, in, a, rows, n_heads, group, hd, rk};
    LAUNCH(s, "head_proj", run_head_proj, x);
}

typedef struct spec_args {
    float *out;
    const float *q;
    const rekv_spec_seq *seqs;
    int n, n_heads, group, rk;
    float scale;
} spec_args;

static void run_spec(void *p)
{
    spec_args *a = p;
    cpu_spec_scores(a->out, a->q, a->seqs, a->n, a->n_heads, a->group, a->rk, a->scale);
}

static void k_spec_scores(rekv_stream *s, float *out, const float *q, const rekv_spec_seq *seqs,
                          int n, int n_heads, int group, int rk, float scale)
{
    spec_args a = {out, q, seqs, n, n_heads, group, rk, scale};
    LAUNCH(s, "spec_scores", run_spec, a);
}

typedef struct sample_args {
    int32_t *ids, *top_ids;
    float *top_vals;
    rekv_sample_lp *lp;
    const float *logits;
    const rekv_sample_row *rows;
    int n, vocab;
    void *scratch;
} sample_args;

/* one row: its draw and its top logits */
static void sample_row(const sample_args *a, int r, void *scratch)
{
    const rekv_sample_row *w = &a->rows[r];
    const float *lg = a->logits + (size_t)r * (size_t)a->vocab;
    rekv_sampler smp = {w->temperature, w->top_k, w->top_p, 0};
    a->ids[r] = rekv_sample_drawn(&smp, w->u, lg, a->vocab, scratch);
    if (w->n_top > 0)
        rekv_top_logits(lg, a->vocab, w->n_top, a->top_ids + w->top_at, a->top_vals + w->top_at);
    if (w->logprob)
        a->lp[r] =
            (rekv_sample_lp){rekv_logsumexp(lg, a->vocab), a->ids[r] >= 0 ? lg[a->ids[r]] : NAN, 0};
}

typedef struct sample_pool {
    const sample_args *a;
    void *scratch[CPU_SAMPLE_MAX_THREADS]; /* by slot: slot 0 the caller's */
} sample_pool;

static void sample_chunk(void *arg, int row, int slot)
{
    sample_pool *sp = arg;
    sample_row(sp->a, row, sp->scratch[slot]);
}

/* Rows that sample (not greedy) sort and select over the vocabulary: they share the pool, each
 * thread with scratch of its own (the kernel's for the caller); without that memory, the caller
 * draws them all. Every row is the same whatever thread draws it. */
static void run_sample(void *p)
{
    sample_args *a = p;
    int sampled = 0, threads = cpu_gemm_threads();
    for (int r = 0; r < a->n; r++)
        sampled += a->rows[r].temperature > 0.0f;
    if (threads > CPU_SAMPLE_MAX_THREADS)
        threads = CPU_SAMPLE_MAX_THREADS;
    if (threads > a->n)
        threads = a->n;
    sample_pool sp = {a, {a->scratch}};
    for (int t = 1; t < threads && sampled > 1; t++)
        if ((sp.scratch[t] = malloc(8 * (size_t)a->vocab)) == NULL)
            threads = t;
    if (sampled > 1 && threads > 1)
        cpu_pool_run(sample_chunk, &sp, a->n, threads);
    else
        for (int r = 0; r < a->n; r++)
            sample_row(a, r, a->scratch);
    for (int t = 1; t < CPU_SAMPLE_MAX_THREADS; t++)
        free(sp.scratch[t]);
}

static void k_sample(rekv_stream *s, int32_t *ids, int32_t *top_ids, float *top_vals,
                     rekv_sample_lp *lp, const float *logits, const rekv_sample_row *rows, int n,
                     int vocab, void *scratch)
{
    sample_args a = {ids, top_ids, top_vals, lp, logits, rows, n, vocab, scratch};
    LAUNCH(s, "sample", run_sample, a);
}

typedef struct scale_args {
    float *x;
    size_t n;
    float a;
} scale_args;

static void run_scale(void *p)
{
    scale_args *a = p;
    cpu_scale(a->x, a->n, a->a);
}

static void run_softcap(void *p)
{
    scale_args *a = p;
    cpu_softcap(a->x, a->n, a->a);
}

static void k_scale(rekv_stream *s, float *x, size_t n, float f)
{
    scale_args a = {x, n, f};
    LAUNCH(s, "scale", run_scale, a);
}

static void k_softcap(rekv_stream *s, float *x, size_t n, float cap)
{
    scale_args a = {x, n, cap};
    LAUNCH(s, "softcap", run_softcap, a);
}

typedef struct ig_args {
    const float *scores;
    const rekv_ig_seq *seqs;
    int n;
    rekv_ig_shape shape;
    const uint8_t *arena;
    rekv_copy_piece *pieces;
    size_t *n_pieces;
} ig_args;

/* sequence j's selection (rekv_ig_select_seq: past its device part, or among its pool's live
 * entries) */
static void ig_seq(void *arg, int j, int slot)
{
    (void)slot;
    const ig_args *a = arg;
    rekv_ig_select_seq(a->scores, &a->seqs[j], &a->shape);
}

static void run_ig_select(void *p)
{
    ig_args *a = p;
    const rekv_ig_shape *sh = &a->shape;
    int kvh = sh->n_kv, hd = sh->head_dim;
    size_t row = sh->row_bytes, vs = rekv_kv_off(rekv_kv_v_shift(kvh, hd), hd, row), n = 0;
    cpu_pool_run(ig_seq, a, a->n, a->n > 1 ? cpu_gemm_threads() : 1);
    for (int j = 0; j < a->n; j++) {
        const rekv_ig_seq *q = &a->seqs[j];
        int m = *q->m, rest = q->len - q->dev;
        for (int half = 0; half < 2; half++)
            for (int g = 0; g < kvh; g++)
                for (int i = 0; i < m; i++) {
                    int t = q->dev + q->sel[(size_t)g * (size_t)rest + (size_t)i];
                    size_t so =
                        rekv_kv_off(rekv_kv_row(kvh, hd, g, t % REKV_KV_ROWS_PER_BLOCK), hd, row);
                    size_t dof = rekv_kv_off(rekv_kv_row(kvh, hd, g, q->dev + i), hd, row);
                    a->pieces[n++] = (rekv_copy_piece){
                        (uint8_t *)q->kv + dof + (half ? vs : 0),
                        a->arena + q->blocks[t / REKV_KV_ROWS_PER_BLOCK] + so + (half ? vs : 0),
                        row};
                }
        *q->start = q->dev + m;
        *q->slot = q->dev + m;
    }
    *a->n_pieces = n;
}

static void k_ig_select(rekv_stream *s, const float *scores, const rekv_ig_seq *seqs, int n,
                        const rekv_ig_shape *shape, const uint8_t *arena, rekv_copy_piece *pieces,
                        size_t *n_pieces)
{
    ig_args a = {scores, seqs, n, *shape, arena, pieces, n_pieces};
    LAUNCH(s, "ig_select", run_ig_select, a);
}

typedef struct clo_args {
    const float *scores;
    const rekv_clo_seq *seqs;
    int n;
    rekv_clo_shape shape;
    const uint8_t *arena;
    rekv_copy_piece *pieces;
    size_t *n_pieces;
} clo_args;

/* sequence j's decisions, head by head: rekv_clo_decide (reads the state only) */
static void clo_seq(void *arg, int j, int slot)
{
    (void)slot;
    const clo_args *a = arg;
    const rekv_clo_seq *q = &a->seqs[j];
    const rekv_clo_shape *sh = &a->shape;
    int nkv = sh->n_kv, group = sh->n_heads / nkv, hd = sh->head_dim, len = q->len;
    for (int g = 0; g < nkv; g++) {
        size_t h0 = (size_t)g * (size_t)group;
        q->head_k[g] =
            sh->persist[g]
                ? -1
                : rekv_clo_decide(
                      q->q + h0 * (size_t)hd, q->klen[g] >= 0 ? q->label + h0 * (size_t)hd : NULL,
                      sh->imp + h0, sh->tau[g], group, hd, a->scores + q->scores + h0 * (size_t)len,
                      len, sh->frac, q->K, q->scratch, q->sel + (size_t)g * (size_t)q->K);
    }
}

/* The decisions on the pool, then each sequence's state and its misses' rows, in order. */
static void run_clo_decide(void *p)
{
    clo_args *a = p;
    const rekv_clo_shape *sh = &a->shape;
    int nkv = sh->n_kv, hd = sh->head_dim, group = sh->n_heads / nkv;
    size_t row = sh->row_bytes, vs = rekv_kv_off(rekv_kv_v_shift(nkv, hd), hd, row), n = 0;
    cpu_pool_run(clo_seq, a, a->n, a->n > 1 ? cpu_gemm_threads() : 1);
    for (int j = 0; j < a->n; j++) {
        const rekv_clo_seq *q = &a->seqs[j];
        for (int g = 0; g < nkv; g++) {
            int k = q->head_k[g];
            if (k < 0) /* persistent: the plan's */
                continue;
            for (int i = 0; i < k; i++) {
                int t = REKV_HEADS_SINK + q->sel[(size_t)g * (size_t)q->K + (size_t)i];
                const uint8_t *src =
                    a->arena + q->blocks[t / REKV_KV_ROWS_PER_BLOCK] +
                    rekv_kv_off(rekv_kv_row(nkv, hd, g, t % REKV_KV_ROWS_PER_BLOCK), hd, row);
                uint8_t *dst =
                    (uint8_t *)q->kv + rekv_kv_off(rekv_kv_row(nkv, hd, g, q->K - k + i), hd, row);
                a->pieces[n++] = (rekv_copy_piece){dst, src, row};
                a->pieces[n++] = (rekv_copy_piece){dst + vs, src + vs, row};
            }
            if (k > 0) { /* a miss: its queries are the labels */
                size_t h0 = (size_t)g * (size_t)group * (size_t)hd;
                memcpy(q->label + h0, q->q + h0, sizeof(float) * (size_t)group * (size_t)hd);
                q->klen[g] = k;
            }
            q->skip[g] = q->K - q->klen[g];
        }
    }
    *a->n_pieces = n;
}

static void k_clo_decide(rekv_stream *s, const float *scores, const rekv_clo_seq *seqs, int n,
                         const rekv_clo_shape *shape, const uint8_t *arena, rekv_copy_piece *pieces,
                         size_t *n_pieces)
{
    clo_args a = {scores, seqs, n, *shape, arena, pieces, n_pieces};
    LAUNCH(s, "clo_decide", run_clo_decide, a);
}

const rekv_kernel_iface rekv_cpu_kernels = {
    .linear = k_linear,
    .norm = k_norm,
    .rope = k_rope,
    .activation = k_activation,
    .add = k_add,
    .embed = k_embed,
    .kv_scatter = k_kv_scatter,
    .kv_gather = k_kv_gather,
    .attention = k_attention,
    .convert = k_convert,
    .convert_out = k_convert_out,
    .gather_rows = k_gather_rows,
    .head_proj = k_head_proj,
    .spec_scores = k_spec_scores,
    .sample = k_sample,
    .linear_tiled = k_linear_tiled,
    .scale = k_scale,
    .softcap = k_softcap,
    .ig_select = k_ig_select,
    .clo_decide = k_clo_decide,
};
