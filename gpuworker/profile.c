/* profile.c — the profiler (profile.h): timed copies and kernels on a backend, least-squares fits
 * of the planner's time models, and the front door that loads a cached profile or measures one
 * (the cache file itself, its key, path and JSON, is profile_cache.c).
 *
 * Every timing enqueues the same operation `reps` times back to back on one stream and syncs once,
 * so that the cost of waking the stream and syncing (tens of microseconds on the cpu backend) is
 * spread over the reps instead of passing for link latency; the best of a few rounds is kept,
 * which on a shared machine is the estimate least disturbed by other work. Sizes and token counts
 * are chosen from a quick probe so that the largest sample is dominated by its per-byte (or
 * per-token) cost, whatever the link's speed, and the whole run stays near a second. */
#define _GNU_SOURCE
#include "gpuworker/profile.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/version.h"
#include "gpuworker/kernels.h"

#define PF_ROUNDS 5              /* timed rounds per sample; the fastest is kept */
#define PF_ROUND_S 0.004         /* aim of one round's duration, s */
#define PF_MAX_REPS 64           /* operations per round at most */
#define PF_GEMM_ROWS 128         /* rows of the measured FFN linear (a decode step's) */
#define PF_KV_GEMM_MAX_ROWS 8192 /* most rows of the measured K/V linear */
#define PF_KV_GEMM_S 0.001       /* the K/V linear grows its rows until it takes this long */
#define PF_ATTN_BATCH 8          /* sequences of the measured attention */
#define PF_ATTN_CTX 512          /* their context, tokens (less when the model's is shorter) */
#define PF_ATTN_CHUNK 64         /* query rows of the measured prefill-chunk attention */
#define PF_FIT_SAMPLES 4         /* token counts / copy sizes per fitted model */
#define PF_MAX_BYTES (64u << 20) /* largest buffer the measurement allocates, bytes */
/* The FFN linear's weights are read from at least this many bytes of copies, one after the other,
 * as a decode step reads each layer's weights once: from memory, not from a cache. One copy (8 MiB
 * for hidden 1024, f16) sits in this machine's 32 MiB L3 and ran ~2x faster than a real step
 * reads it; an H100's L2 is 50 MB. */
#define PF_COLD_BYTES (64u << 20)

/* ---------------------------------------------------------------- timing */

typedef void (*pf_enqueue_fn)(void *ctx, rekv_stream *s);

/* Seconds one fn(ctx, s) takes: a warm-up run sizes the reps, then the fastest of PF_ROUNDS. */
static int pf_time(rekv_backend *be, rekv_stream *s, pf_enqueue_fn fn, void *ctx, double *out,
                   rekv_err *err)
{
    int rc;
    uint64_t t0 = rekv_now_ns();
    fn(ctx, s);
    if ((rc = be->iface->stream_sync(s, err)))
        return rc;
    double one = (double)(rekv_now_ns() - t0) * 1e-9;
    int reps = one > 0 ? (int)(PF_ROUND_S / one) : PF_MAX_REPS;
    reps = reps < 1 ? 1 : reps > PF_MAX_REPS ? PF_MAX_REPS : reps;
    double best = INFINITY;
    for (int r = 0; r < PF_ROUNDS; r++) {
        t0 = rekv_now_ns();
        for (int i = 0; i < reps; i++)
            fn(ctx, s);
        if ((rc = be->iface->stream_sync(s, err)))
            return rc;
        double t = (double)(rekv_now_ns() - t0) * 1e-9 / reps;
        if (t < best)
            best = t;
    }
    *out = best;
    return 0;
}

/* Fits t = a + b*x, a >= 0: a negative intercept (cache effects make small samples relatively
 * fast) is replaced by a fit through the origin. b <= 0 means the samples carry no per-unit cost,
 * which no real copy or kernel has: an error rather than a model the planner would misuse. */
static int pf_fit(const double *xs, const double *ys, size_t n, const char *what, rekv_linear *out,
                  rekv_err *err)
{
    double a, b;
    int rc = rekv_linear_fit(xs, ys, n, &a, &b, err);
    if (rc)
        return rc;
    if (a < 0) {
        double sxy = 0, sxx = 0;
        for (size_t i = 0; i < n; i++) {
            sxy += xs[i] * ys[i];
            sxx += xs[i] * xs[i];
        }
        a = 0;
        b = sxx > 0 ? sxy / sxx : 0;
    }
    if (!(b > 0) && n > 0 && xs[n - 1] > 0) {
        /* noise (a loaded machine) can flatten the fit: fall back to the largest sample's rate */
        a = 0;
        b = ys[n - 1] / xs[n - 1];
    }
    if (!(b > 0) || !isfinite(b) || !isfinite(a))
        return rekv_errf(err, -EIO, "profile: %s: the samples give no per-unit cost (slope %g)",
                         what, b);
    out->a = a;
    out->b = b;
    return 0;
}

/* ---------------------------------------------------------------- the measured operations */

typedef struct pf_copy {
    const rekv_backend_iface *bi;
    void *dst;
    const void *src;
    size_t bytes;
    int d2h; /* direction: 0 host->device, 1 device->host */
} pf_copy;

static void pf_copy_run(void *ctx, rekv_stream *s)
{
    pf_copy *c = ctx;
    rekv_copy_piece pc = {c->dst, c->src, c->bytes};
    if (c->d2h)
        c->bi->copy_d2h(s, &pc, 1, REKV_XFER_OTHER);
    else
        c->bi->copy_h2d(s, &pc, 1, REKV_XFER_OTHER);
}

typedef struct pf_linear {
    const rekv_kernel_iface *k;
    float *y;
    const float *x;
    const void *w;
    rekv_dtype wt;
    const float *bias;
    int m, n, kdim;
    int n_w, next; /* copies of the weights at w, w_stride bytes apart, used in turn (0: one) */
    size_t w_stride;
} pf_linear;

static void pf_linear_run(void *ctx, rekv_stream *s)
{
    pf_linear *l = ctx;
    const void *w = l->n_w > 1 ? (const char *)l->w + (size_t)l->next * l->w_stride : l->w;
    if (l->n_w > 1)
        l->next = (l->next + 1) % l->n_w;
    l->k->linear(s, l->y, l->x, w, l->wt, l->bias, l->m, l->n, l->kdim);
}

typedef struct pf_attn {
    const rekv_kernel_iface *k;
    float *out;
    const float *q;
    const rekv_attn_seq *seqs; /* device */
    int n_seqs, n_heads, n_kv, head_dim;
    float *scores;
    int rows; /* query rows of the sequences together (0: one each) */
} pf_attn;

static void pf_attn_run(void *ctx, rekv_stream *s)
{
    pf_attn *a = ctx;
    a->k->attention(s, a->out, a->q, a->seqs, a->n_seqs, a->rows ? a->rows : a->n_seqs, a->n_heads,
                    a->n_kv, a->head_dim, a->scores, REKV_DTYPE_F32);
}

/* T_load_kv (gen = 0) or T_kv_gen (gen = 1) at n tokens, for one cache dtype. */
typedef struct pf_kv {
    const rekv_backend_iface *bi;
    const rekv_kernel_iface *k;
    const rekv_model_config *c;
    int gen;
    int no_copy; /* gen: the rows are on the device already (the recomputation alone) */
    int n;
    rekv_dtype dtype;
    const void *host_k, *host_v; /* host cache rows ([n][kv_dim] each), or host_x [n][hidden] */
    const void *host_x;
    void *stage_k, *stage_v; /* device landing buffers in dtype (fp32: the final ones) */
    void *stage_x;
    float *dev_k, *dev_v;           /* fp32 K,V [n][kv_dim] */
    float *dev_x;                   /* fp32 X [n][hidden] */
    const rekv_convert_piece *conv; /* device: the convert pieces of this sample */
    size_t n_conv;
    const void *wk, *wv; /* device weights in wt */
    rekv_dtype wt;
    const float *bk, *bv;
    const int32_t *pos;        /* device positions [n] */
    const int32_t *row_seq;    /* device zeros [n]: every row is the one sequence's */
    const rekv_attn_seq *seqs; /* device: one sequence whose buffer takes the rows (dtype) */
    rekv_rope_freqs rope;      /* the model's RoPE frequencies, when it has RoPE */
} pf_kv;

static void pf_kv_run(void *ctx, rekv_stream *s)
{
    pf_kv *t = ctx;
    const rekv_model_config *c = t->c;
    size_t es = rekv_dtype_size(t->dtype), kvd = (size_t)rekv_config_kv_dim(c);
    if (!t->gen) { /* KV rows land in the attention buffers as they are (no conversion) */
        rekv_copy_piece pc[2] = {{t->stage_k, t->host_k, (size_t)t->n * kvd * es},
                                 {t->stage_v, t->host_v, (size_t)t->n * kvd * es}};
        t->bi->copy_h2d(s, pc, 2, REKV_XFER_KV);
        return;
    }
    rekv_copy_piece pc = {t->stage_x, t->host_x, (size_t)t->n * (size_t)c->hidden * es};
    if (!t->no_copy)
        t->bi->copy_h2d(s, &pc, 1, REKV_XFER_ACT);
    if (t->dtype != REKV_DTYPE_F32)
        t->k->convert(s, t->conv, t->n_conv, t->dtype);
    t->k->linear(s, t->dev_k, t->dev_x, t->wk, t->wt, t->bk, t->n, (int)kvd, c->hidden);
    t->k->linear(s, t->dev_v, t->dev_x, t->wv, t->wt, t->bv, t->n, (int)kvd, c->hidden);
    if (c->rope != REKV_ROPE_NONE)
        t->k->rope(s, t->dev_k, t->pos, t->n, c->n_kv_heads, c->head_dim, &t->rope, c->rope);
    t->k->kv_scatter(s, t->dev_k, t->dev_v, t->n, t->row_seq, t->pos, NULL, t->seqs, c->n_kv_heads,
                     c->head_dim, t->dtype);
}

/* ---------------------------------------------------------------- buffers */

/* Device buffers the measurement allocates, freed together. */
#define PF_MAX_DEV 32
typedef struct pf_mem {
    rekv_backend *be;
    void *dev[PF_MAX_DEV];
    int n_dev;
    void *host[PF_MAX_DEV];
    int n_host;
} pf_mem;

static void *pf_dev(pf_mem *m, size_t bytes)
{
    if (m->n_dev == PF_MAX_DEV)
        return NULL;
    void *p = m->be->iface->dev_alloc(m->be, bytes ? bytes : 1);
    if (p)
        m->dev[m->n_dev++] = p;
    return p;
}

/* Host memory filled with small deterministic values (touched, so no page faults are timed),
 * page-locked where the backend can (host_alloc), as the kvstore arena is for the pipeline:
 * copies from pageable memory run at a fraction of the link (8 of 55 GB/s on an H100), which
 * would price every fetch wrong. */
static void *pf_host(pf_mem *m, size_t bytes)
{
    if (m->n_host == PF_MAX_DEV)
        return NULL;
    float *p = rekv_host_alloc(m->be, bytes ? bytes : 1);
    if (p) {
        m->host[m->n_host++] = p;
        for (size_t i = 0; i < bytes / sizeof(float); i++)
            p[i] = (float)((int)(i * 2654435761u % 2001u) - 1000) * 1e-4f;
    }
    return p;
}

static void pf_mem_free(pf_mem *m)
{
    for (int i = 0; i < m->n_dev; i++)
        m->be->iface->dev_free(m->be, m->dev[i]);
    for (int i = 0; i < m->n_host; i++)
        rekv_host_free(m->be, m->host[i]);
    m->n_dev = m->n_host = 0;
}

/* A device buffer holding a copy of host bytes (untimed setup). */
static void *pf_upload(pf_mem *m, rekv_stream *s, const void *src, size_t bytes, rekv_err *err)
{
    void *d = pf_dev(m, bytes);
    if (!d) {
        rekv_errf(err, -ENOMEM, "profile: out of device memory (%zu bytes)", bytes);
        return NULL;
    }
    rekv_copy_piece pc = {d, src, bytes};
    m->be->iface->copy_h2d(s, &pc, 1, REKV_XFER_OTHER);
    if (m->be->iface->stream_sync(s, err))
        return NULL;
    return d;
}

/* ---------------------------------------------------------------- link */

/* Fits one direction of the link: a probe sizes the samples, then PF_FIT_SAMPLES sizes from 64
 * bytes (latency alone) to a size whose transfer takes several latencies and milliseconds. */
static int pf_measure_link(rekv_backend *be, rekv_stream *s, void *host, void *dev, int d2h,
                           double *bw, double *lat, rekv_err *err)
{
    pf_copy cp = {be->iface, d2h ? host : dev, d2h ? dev : host, 0, d2h};
    double t_small, t_big;
    const size_t small = 4096, big = 256u << 10;
    int rc;
    cp.bytes = small;
    if ((rc = pf_time(be, s, pf_copy_run, &cp, &t_small, err)))
        return rc;
    cp.bytes = big;
    if ((rc = pf_time(be, s, pf_copy_run, &cp, &t_big, err)))
        return rc;
    double bw0 = t_big > t_small ? (double)(big - small) / (t_big - t_small) : (double)big / t_big;
    double lat0 = t_small - (double)small / bw0;
    if (lat0 < 0)
        lat0 = 0;
    double want_s = 8 * lat0 > 0.002 ? 8 * lat0 : 0.002;
    double smax = bw0 * want_s;
    if (smax < (double)big)
        smax = (double)big;
    if (smax > (double)PF_MAX_BYTES)
        smax = (double)PF_MAX_BYTES;
    double xs[PF_FIT_SAMPLES], ys[PF_FIT_SAMPLES];
    size_t sizes[PF_FIT_SAMPLES] = {64, (size_t)(smax / 16), (size_t)(smax / 4), (size_t)smax};
    for (int i = 0; i < PF_FIT_SAMPLES; i++) {
        cp.bytes = sizes[i];
        if ((rc = pf_time(be, s, pf_copy_run, &cp, &ys[i], err)))
            return rc;
        xs[i] = (double)sizes[i];
    }
    rekv_linear fit;
    if ((rc = pf_fit(xs, ys, PF_FIT_SAMPLES, d2h ? "device->host copies" : "host->device copies",
                     &fit, err)))
        return rc;
    *bw = 1.0 / fit.b;
    *lat = fit.a;
    return 0;
}

/* ---------------------------------------------------------------- measure */

/* One layer's weights as the engine holds them: matrices in the file's dtype (or quantized
 * blocks), vectors in fp32. */
static double pf_layer_weight_bytes(const rekv_model_config *c)
{
    double H = c->hidden, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c), F = c->ffn;
    double m = rekv_config_layer_params(c);
    double norms = (c->norm_bias ? 4 : 2) * H;
    double bias = (c->qkv_bias ? Q + 2 * KV : 0) + (c->o_bias ? H : 0) + (c->ffn_bias ? F + H : 0);
    return m * rekv_config_weight_elem_bytes(c) + (norms + bias) * sizeof(float);
}

/* Token counts for a fitted model whose cost is per_tok s per token plus lat: the largest makes
 * the per-token part dominate (a few ms and 8 latencies), capped by memory. */
static void pf_token_counts(double per_tok, double lat, double row_bytes, int *ns)
{
    double want_s = 8 * lat > 0.003 ? 8 * lat : 0.003;
    double n = per_tok > 0 ? want_s / per_tok : 4096;
    double cap = (double)PF_MAX_BYTES / row_bytes;
    if (n > cap)
        n = cap;
    if (n > 8192)
        n = 8192;
    int nmax = ((int)n / 16) * 16;
    if (nmax < 128)
        nmax = 128;
    for (int i = 0; i < PF_FIT_SAMPLES; i++) {
        int v = (nmax >> (PF_FIT_SAMPLES - 1 - i)) / 16 * 16;
        ns[i] = v < 16 ? 16 : v;
    }
}

static int pf_check_config(const rekv_model_config *c, rekv_err *err)
{
    if (c->hidden <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 || c->head_dim <= 0 ||
        c->ffn <= 0 || c->n_layers <= 0 || c->max_pos <= 1 || c->head_dim > 512)
        return rekv_errf(err, -EINVAL, "profile: the model config has a non-positive size");
    return 0;
}

/* The measurements reported to a progress callback: the link each way, the GEMMs, attention,
 * and every sample of the T_load_kv / T_kv_gen fits. */
#define PF_STEPS (4 + REKV_PROFILE_DTYPES * 2 * PF_FIT_SAMPLES)

/* One measurement in progress: what every stage reads, the profile it fills and the buffers it
 * allocates. */
typedef struct pf_run {
    const rekv_model_config *c;
    rekv_backend *be;
    const rekv_backend_iface *bi;
    const rekv_kernel_iface *k;
    rekv_stream *s;
    pf_mem m; /* every buffer of the run, freed together */
    rekv_profile p;
    rekv_progress_fn progress; /* NULL: none */
    void *arg;
    uint64_t step; /* measurements done, of PF_STEPS */
    /* pf_measure_gemm's weights, reused by pf_measure_kv_fits: the K/V linear's ([KV][H] in wt,
     * on the device) and a bias of max(KV, F) floats */
    void *dw;
    float *db;
    rekv_dtype wt;
} pf_run;

static void pf_progress(pf_run *r)
{
    if (r->progress)
        r->progress(r->arg, ++r->step, PF_STEPS);
}

/* The link, each way. */
static int pf_measure_links(pf_run *r, rekv_err *err)
{
    int rc;
    void *hbuf = pf_host(&r->m, PF_MAX_BYTES), *dbuf = pf_dev(&r->m, PF_MAX_BYTES);
    if (!hbuf || !dbuf)
        return rekv_errf(err, -ENOMEM, "profile: out of memory for %u-byte copy buffers",
                         PF_MAX_BYTES);
    if ((rc = pf_measure_link(r->be, r->s, hbuf, dbuf, 0, &r->p.h2d_bw, &r->p.h2d_latency, err)))
        return rc;
    pf_progress(r);
    if ((rc = pf_measure_link(r->be, r->s, hbuf, dbuf, 1, &r->p.d2h_bw, &r->p.d2h_latency, err)))
        return rc;
    pf_progress(r);
    return 0;
}

/* GEMM at the FFN shape over PF_GEMM_ROWS rows (a decode step's forward pass), and at the K/V
 * projection shape over as many rows as take PF_KV_GEMM_S: recomputation runs over batch x
 * context rows, where a GPU runs several times faster than over 128 (101 vs ~600 TFLOP/s on an
 * H100), and the planner prices recomputation with this rate. */
static int pf_measure_gemm(pf_run *r, rekv_err *err)
{
    const rekv_model_config *c = r->c;
    rekv_profile *p = &r->p;
    pf_mem *m = &r->m;
    rekv_stream *s = r->s;
    const int H = c->hidden, KV = rekv_config_kv_dim(c), F = c->ffn;
    int rc;
    p->gemm_rows = PF_GEMM_ROWS;
    const int R = PF_GEMM_ROWS;
    size_t wmax = (size_t)(KV > F ? KV : F) * H;
    size_t rmax = PF_MAX_BYTES / (sizeof(float) * (size_t)(H > KV ? H : KV));
    int RK = (int)(rmax < PF_KV_GEMM_MAX_ROWS ? rmax : PF_KV_GEMM_MAX_ROWS);
    if (RK < R)
        RK = R;
    float *hw = pf_host(m, wmax * sizeof(float)), *hx = pf_host(m, (size_t)RK * H * sizeof(float));
    if (!hw || !hx)
        return rekv_errf(err, -ENOMEM, "profile: out of host memory");
    /* the weights in the dtype the engine holds them in (the file's) */
    rekv_dtype wt = c->dtype;
    void *hwt = wt == REKV_DTYPE_F32 ? (void *)hw : pf_host(m, wmax * rekv_dtype_size(wt));
    if (hwt == NULL)
        return rekv_errf(err, -ENOMEM, "profile: out of host memory");
    if (hwt != hw)
        rekv_from_f32(hwt, hw, wt, wmax);
    void *dw = pf_upload(m, s, hwt, wmax * rekv_dtype_size(wt), err);
    float *db = dw ? pf_upload(m, s, hw, (size_t)(KV > F ? KV : F) * sizeof(float), err) : NULL;
    float *dx = db ? pf_upload(m, s, hx, (size_t)RK * H * sizeof(float), err) : NULL;
    size_t ymax = (size_t)R * F > (size_t)RK * KV ? (size_t)R * F : (size_t)RK * KV;
    float *dy = dx ? pf_dev(m, ymax * sizeof(float)) : NULL;
    if (!dy)
        return rekv_errf(err, -ENOMEM, "profile: out of device memory");
    r->dw = dw;
    r->db = db;
    r->wt = wt;
    double t;
    pf_linear lin = {r->k, dy, dx, dw, wt, c->qkv_bias ? db : NULL, R, KV, H, 1, 0, 0};
    for (;;) {
        if ((rc = pf_time(r->be, s, pf_linear_run, &lin, &t, err)))
            return rc;
        if (t >= PF_KV_GEMM_S || 2 * lin.m > RK)
            break;
        lin.m *= 2;
    }
    p->gemm_kv_rows = lin.m;
    p->gemm_kv_flops = 2.0 * lin.m * KV * H / t;
    /* the FFN linear as a step reads it: its weights from memory (PF_COLD_BYTES) */
    size_t fw = (size_t)F * H * rekv_dtype_size(wt);
    int n_w = (int)((PF_COLD_BYTES + fw - 1) / fw);
    if ((size_t)n_w * fw > PF_MAX_BYTES)
        n_w = fw < PF_MAX_BYTES ? (int)(PF_MAX_BYTES / fw) : 1;
    char *dwc = n_w > 1 ? pf_dev(m, (size_t)n_w * fw) : NULL;
    for (int i = 0; dwc && i < n_w; i++) {
        rekv_copy_piece pc = {dwc + (size_t)i * fw, hwt, fw};
        r->bi->copy_h2d(s, &pc, 1, REKV_XFER_OTHER);
    }
    if (dwc && (rc = r->bi->stream_sync(s, err)))
        return rc;
    lin = (pf_linear){r->k, dy, dx, dwc ? dwc : dw, wt, c->ffn_bias ? db : NULL,
                      R,    F,  H,  dwc ? n_w : 1,  0,  fw};
    if ((rc = pf_time(r->be, s, pf_linear_run, &lin, &t, err)))
        return rc;
    p->gemm_ffn_flops = 2.0 * R * F * H / t;
    lin.m = 1;
    if ((rc = pf_time(r->be, s, pf_linear_run, &lin, &t, err)))
        return rc;
    p->gemm_ffn_1_flops = 2.0 * F * H / t;
    pf_progress(r);
    return 0;
}

/* Attention: a decode batch, one query per sequence over ctx cached positions, and a prefill
 * chunk's shape. */
static int pf_measure_attn(pf_run *r, rekv_err *err)
{
    const rekv_model_config *c = r->c;
    rekv_profile *p = &r->p;
    pf_mem *m = &r->m;
    rekv_stream *s = r->s;
    const int Q = rekv_config_q_dim(c);
    int rc;
    double t;
    int B = PF_ATTN_BATCH, S = c->max_pos - 1 < PF_ATTN_CTX ? c->max_pos - 1 : PF_ATTN_CTX;
    int cap = S + 1;
    size_t kvb = rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, cap) * sizeof(float);
    float *hkv = pf_host(m, kvb), *hq = pf_host(m, (size_t)B * Q * sizeof(float));
    if (!hkv || !hq)
        return rekv_errf(err, -ENOMEM, "profile: out of host memory");
    /* each sequence its own context, as in a real batch, unless that is too much memory */
    int distinct = (double)kvb * B <= (double)PF_MAX_BYTES;
    size_t seq_stride = distinct ? kvb / sizeof(float) : 0;
    float *dkv = pf_dev(m, distinct ? kvb * B : kvb);
    for (int i = 0; dkv && i < (distinct ? B : 1); i++) {
        rekv_copy_piece pc = {dkv + i * seq_stride, hkv, kvb};
        r->bi->copy_h2d(s, &pc, 1, REKV_XFER_OTHER);
    }
    if (dkv && (rc = r->bi->stream_sync(s, err)))
        return rc;
    float *dq = dkv ? pf_upload(m, s, hq, (size_t)B * Q * sizeof(float), err) : NULL;
    float *dout = dq ? pf_dev(m, (size_t)B * Q * sizeof(float)) : NULL;
    float *dsc = dout ? pf_dev(m, (size_t)cap * c->n_heads * B * sizeof(float)) : NULL;
    rekv_attn_seq seqs[PF_ATTN_BATCH];
    for (int i = 0; i < B; i++)
        seqs[i] = (rekv_attn_seq){dkv + i * seq_stride, S, 1, i, NULL, 0, 0, 0};
    rekv_attn_seq *dseqs = dsc ? pf_upload(m, s, seqs, sizeof(seqs), err) : NULL;
    if (!dseqs)
        return err && err->code ? err->code : rekv_errf(err, -ENOMEM, "profile: out of memory");
    pf_attn at = {r->k, dout, dq, dseqs, B, c->n_heads, c->n_kv_heads, c->head_dim, dsc, 0};
    if ((rc = pf_time(r->be, s, pf_attn_run, &at, &t, err)))
        return rc;
    p->attn_batch = B;
    p->attn_ctx = S;
    p->attn_flops = 4.0 * B * c->n_heads * c->head_dim * (double)(S + 1) / t;
    /* and a prefill chunk's shape: PF_ATTN_CHUNK rows of one sequence at the end of its S + 1
     * positions, causal (row i over start + i + 1 of them) */
    int n = PF_ATTN_CHUNK < S ? PF_ATTN_CHUNK : S, start = S + 1 - n;
    float *hq2 = pf_host(m, (size_t)n * Q * sizeof(float));
    float *dq2 = hq2 ? pf_upload(m, s, hq2, (size_t)n * Q * sizeof(float), err) : NULL;
    float *dout2 = dq2 ? pf_dev(m, (size_t)n * Q * sizeof(float)) : NULL;
    float *dsc2 = dout2 ? pf_dev(m, (size_t)cap * c->n_heads * n * sizeof(float)) : NULL;
    rekv_attn_seq chunk = {dkv, start, n, 0, NULL, 0, 0, 0};
    rekv_attn_seq *dchunk = dsc2 ? pf_upload(m, s, &chunk, sizeof(chunk), err) : NULL;
    if (!dchunk)
        return err && err->code ? err->code : rekv_errf(err, -ENOMEM, "profile: out of memory");
    at = (pf_attn){r->k, dout2, dq2, dchunk, 1, c->n_heads, c->n_kv_heads, c->head_dim, dsc2, n};
    if ((rc = pf_time(r->be, s, pf_attn_run, &at, &t, err)))
        return rc;
    p->attn_chunk_flops =
        4.0 * c->n_heads * c->head_dim * ((double)n * start + (double)n * (n + 1) / 2) / t;
    pf_progress(r);
    return 0;
}

/* The device buffers of the T_load_kv / T_kv_gen samples, sized for the largest. */
typedef struct pf_kv_bufs {
    void *hk, *hv;             /* host rows [nmax][max(H, KV)] */
    void *sk, *sv;             /* device landing buffers, as large */
    float *fk, *fv, *fx;       /* fp32 K, V [nmax][KV] and X [nmax][H] */
    int32_t *dpos;             /* positions [nmax] */
    int32_t *dzero;            /* zeros [nmax] */
    rekv_attn_seq *dseq;       /* one sequence of nmax positions */
    rekv_convert_piece *dconv; /* [PF_FIT_SAMPLES]: the convert piece of each T_kv_gen sample */
} pf_kv_bufs;

static int pf_kv_bufs_alloc(pf_run *r, int nmax, const int *ng, pf_kv_bufs *b, rekv_err *err)
{
    const rekv_model_config *c = r->c;
    pf_mem *m = &r->m;
    rekv_stream *s = r->s;
    const int H = c->hidden, KV = rekv_config_kv_dim(c);
    size_t xrow = (size_t)(H > KV ? H : KV) * sizeof(float);
    b->hk = pf_host(m, (size_t)nmax * xrow);
    b->hv = pf_host(m, (size_t)nmax * xrow);
    int32_t *hpos = pf_host(m, (size_t)nmax * sizeof(int32_t));
    b->sk = pf_dev(m, (size_t)nmax * xrow);
    b->sv = pf_dev(m, (size_t)nmax * xrow);
    b->fk = pf_dev(m, (size_t)nmax * KV * sizeof(float));
    b->fv = pf_dev(m, (size_t)nmax * KV * sizeof(float));
    b->fx = pf_dev(m, (size_t)nmax * H * sizeof(float));
    if (!b->hk || !b->hv || !hpos || !b->sk || !b->sv || !b->fk || !b->fv || !b->fx)
        return rekv_errf(err, -ENOMEM, "profile: out of memory for %d-token samples", nmax);
    for (int i = 0; i < nmax; i++)
        hpos[i] = i % c->max_pos;
    b->dpos = pf_upload(m, s, hpos, (size_t)nmax * sizeof(int32_t), err);
    /* the attention buffer the recomputed rows are scattered into, as the pipeline does:
     * one sequence of nmax positions (every position above is below nmax) */
    memset(hpos, 0, (size_t)nmax * sizeof(int32_t));
    b->dzero = b->dpos ? pf_upload(m, s, hpos, (size_t)nmax * sizeof(int32_t), err) : NULL;
    void *dkvb =
        b->dzero ? pf_dev(m, rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, nmax) * sizeof(float))
                 : NULL;
    rekv_attn_seq hseq = {dkvb, 0, 0, 0, NULL, 0, 0, 0};
    b->dseq = dkvb ? pf_upload(m, s, &hseq, sizeof(hseq), err) : NULL;
    /* the convert piece of every T_kv_gen sample (dtype-agnostic) */
    rekv_convert_piece hconv[PF_FIT_SAMPLES];
    for (int i = 0; i < PF_FIT_SAMPLES; i++)
        hconv[i] = (rekv_convert_piece){b->fx, b->sk, (uint32_t)((size_t)ng[i] * H)};
    b->dconv = b->dseq ? pf_upload(m, s, hconv, sizeof(hconv), err) : NULL;
    if (!b->dconv)
        return err && err->code ? err->code : -ENOMEM;
    return 0;
}

/* One fit of T_load_kv (gen 0) or T_kv_gen (gen 1) for cache dtype d over the token counts ns, and
 * for T_kv_gen the recomputation's rate at the largest. */
static int pf_measure_kv_fit(pf_run *r, const pf_kv_bufs *b, int d, int gen, const int *ns,
                             rekv_err *err)
{
    const rekv_model_config *c = r->c;
    rekv_profile *p = &r->p;
    const int H = c->hidden, KV = rekv_config_kv_dim(c);
    rekv_dtype dt = d == REKV_PROFILE_F32 ? REKV_DTYPE_F32 : REKV_DTYPE_F16;
    double xs[PF_FIT_SAMPLES], ys[PF_FIT_SAMPLES];
    int f32 = dt == REKV_DTYPE_F32, rc;
    pf_kv job = {.bi = r->bi,
                 .k = r->k,
                 .c = c,
                 .gen = gen,
                 .dtype = dt,
                 .host_k = b->hk,
                 .host_v = b->hv,
                 .host_x = b->hk,
                 .stage_k = f32 ? (void *)b->fk : b->sk,
                 .stage_v = f32 ? (void *)b->fv : b->sv,
                 .stage_x = f32 ? (void *)b->fx : b->sk,
                 .dev_k = b->fk,
                 .dev_v = b->fv,
                 .dev_x = b->fx,
                 .n_conv = 1,
                 .wk = r->dw,
                 .wv = r->dw,
                 .wt = r->wt,
                 .bk = c->qkv_bias ? r->db : NULL,
                 .bv = c->qkv_bias ? r->db : NULL,
                 .pos = b->dpos,
                 .row_seq = b->dzero,
                 .seqs = b->dseq};
    if (c->rope != REKV_ROPE_NONE && (rc = rekv_rope_freqs_init(&job.rope, c, err)))
        return rc;
    for (int i = 0; i < PF_FIT_SAMPLES; i++) {
        job.n = ns[i];
        job.conv = &b->dconv[i];
        if ((rc = pf_time(r->be, r->s, pf_kv_run, &job, &ys[i], err)))
            return rc;
        xs[i] = job.n;
        pf_progress(r);
    }
    if ((rc = pf_fit(xs, ys, PF_FIT_SAMPLES, gen ? "T_kv_gen" : "T_load_kv",
                     gen ? &p->kv_gen[d] : &p->load_kv[d], err)))
        return rc;
    if (gen) { /* the largest sample again, its rows on the device already */
        job.no_copy = 1;
        double tr;
        if ((rc = pf_time(r->be, r->s, pf_kv_run, &job, &tr, err)))
            return rc;
        p->recomp_flops[d] = 4.0 * H * KV * job.n / tr;
    }
    return 0;
}

/* T_load_kv(n) and T_kv_gen(n), per cache dtype. */
static int pf_measure_kv_fits(pf_run *r, rekv_err *err)
{
    const rekv_model_config *c = r->c;
    rekv_profile *p = &r->p;
    const int H = c->hidden, KV = rekv_config_kv_dim(c);
    int nl[PF_FIT_SAMPLES], ng[PF_FIT_SAMPLES], rc;
    double kv_row = 2.0 * KV * sizeof(float), act_row = (double)H * sizeof(float);
    pf_token_counts(kv_row / p->h2d_bw, p->h2d_latency, kv_row, nl);
    pf_token_counts(act_row / p->h2d_bw + 4.0 * H * KV / p->gemm_kv_flops, p->h2d_latency,
                    act_row + 2.0 * KV * sizeof(float), ng);
    int nmax = nl[PF_FIT_SAMPLES - 1] > ng[PF_FIT_SAMPLES - 1] ? nl[PF_FIT_SAMPLES - 1]
                                                               : ng[PF_FIT_SAMPLES - 1];
    p->fit_tokens_max = nmax;
    pf_kv_bufs b = {0};
    if ((rc = pf_kv_bufs_alloc(r, nmax, ng, &b, err)))
        return rc;
    for (int d = 0; d < REKV_PROFILE_DTYPES; d++)
        for (int gen = 0; gen < 2; gen++)
            if ((rc = pf_measure_kv_fit(r, &b, d, gen, gen ? ng : nl, err)))
                return rc;
    return 0;
}

static int pf_measure(const rekv_model_config *c, rekv_backend *be, const rekv_link_config *link,
                      rekv_profile *out, rekv_progress_fn progress, void *arg, rekv_err *err)
{
    int rc;
    if (!c || !be || !out)
        return rekv_errf(err, -EINVAL, "profile: NULL argument");
    if ((rc = pf_check_config(c, err)))
        return rc;
    if (!rekv_kernels_of(be))
        return rekv_errf(err, -EINVAL, "profile: backend %s has no kernels", be->iface->name);
    uint64_t t_start = rekv_now_ns();
    pf_run r = {.c = c,
                .be = be,
                .bi = be->iface,
                .k = rekv_kernels_of(be),
                .m = {.be = be},
                .progress = progress,
                .arg = arg};
    memset(&r.p, 0, sizeof(r.p));
    r.p.version = REKV_PROFILE_VERSION;
    snprintf(r.p.backend, sizeof(r.p.backend), "%s", r.bi->name);
    if (link && link->gbps > 0)
        r.p.link = *link;
    if ((rc = r.bi->stream_create(be, "profile", &r.s, err)))
        return rc;

    if ((rc = pf_measure_links(&r, err)) || (rc = pf_measure_gemm(&r, err)) ||
        (rc = pf_measure_attn(&r, err)))
        goto out;
    /* one layer's weights over the link, from the fitted link model */
    r.p.layer_weight_bytes = pf_layer_weight_bytes(c);
    r.p.t_load_w = r.p.h2d_latency + r.p.layer_weight_bytes / r.p.h2d_bw;
    if ((rc = pf_measure_kv_fits(&r, err)))
        goto out;
    r.p.measure_s = (double)(rekv_now_ns() - t_start) * 1e-9;
    *out = r.p;
    rc = 0;
out:
    r.bi->stream_destroy(r.s);
    pf_mem_free(&r.m);
    return rc;
}

int rekv_profile_measure(const rekv_model_config *c, rekv_backend *be, const rekv_link_config *link,
                         rekv_profile *out, rekv_err *err)
{
    return pf_measure(c, be, link, out, NULL, NULL, err);
}

void rekv_profile_to_cost(const rekv_profile *p, rekv_dtype cache_dtype, rekv_cost_profile *out)
{
    int d = cache_dtype == REKV_DTYPE_F32 ? REKV_PROFILE_F32 : REKV_PROFILE_F16;
    memset(out, 0, sizeof(*out));
    out->h2d_bw = p->h2d_bw;
    out->h2d_latency = p->h2d_latency;
    /* recomputation at the rate of what it runs: the cache dtype's conversion, the K and V
     * linears, RoPE (a profile without it: the K/V linear's) */
    out->gemm_flops = p->recomp_flops[d] > 0 ? p->recomp_flops[d] : p->gemm_kv_flops;
    out->fwd_flops_rate = p->gemm_ffn_flops; /* the FFN's GEMM over a decode batch's rows */
    /* ... and its time against the rows, through the two measured row counts: a GEMM at few rows
     * streams its weights for little work, so its rate falls with the rows (rekv_cost_fwd_rate_at)
     */
    double t1 = 1.0 / p->gemm_ffn_1_flops, tr = (double)p->gemm_rows / p->gemm_ffn_flops;
    if (p->gemm_ffn_1_flops > 0 && p->gemm_ffn_flops > 0 && p->gemm_rows > 1) {
        double slope = fmax((tr - t1) / (p->gemm_rows - 1), 0.0);
        out->fwd_gemm = (rekv_linear){t1 - slope, slope}; /* s per FLOP-of-one-row, see cost.h */
    }
    out->attn_flops_rate = p->attn_flops;
    out->attn_chunk_flops_rate = p->attn_chunk_flops;
    out->load_kv = p->load_kv[d];
    out->kv_gen = p->kv_gen[d];
    out->t_load_w = p->t_load_w;
}

static int pf_load_or_measure(const rekv_model_config *c, rekv_backend *be,
                              const rekv_link_config *link, const char *dir, int force,
                              rekv_profile *out, rekv_profile_origin *origin,
                              rekv_progress_fn progress, void *arg, rekv_err *err)
{
    rekv_profile_origin o;
    memset(&o, 0, sizeof(o));
    char key[2048];
    int rc;
    if (!c || !be || !out)
        return rekv_errf(err, -EINVAL, "profile: NULL argument");
    if ((rc = rekv_profile_key(c, be->iface->name, link, key, sizeof(key), err)) ||
        (rc = rekv_profile_path(c, be->iface->name, link, dir, o.path, sizeof(o.path), err)))
        return rc;
    if (force) {
        snprintf(o.reason, sizeof(o.reason), "measuring was asked for");
    } else {
        rekv_err lerr = {0};
        if (rekv_profile_load(o.path, key, out, &lerr) == 0) {
            o.loaded = 1;
            goto done;
        }
        snprintf(o.reason, sizeof(o.reason), "%s", lerr.msg);
    }
    if ((rc = pf_measure(c, be, link, out, progress, arg, err)))
        return rc;
    rekv_err serr = {0};
    if (rekv_profile_save(o.path, key, out, &serr) == 0)
        o.saved = 1;
    else
        snprintf(o.reason, sizeof(o.reason), "not saved: %s", serr.msg);
done:
    if (origin)
        *origin = o;
    return 0;
}

int rekv_profile_load_or_measure(const rekv_model_config *c, rekv_backend *be,
                                 const rekv_link_config *link, const char *dir, int force,
                                 rekv_profile *out, rekv_profile_origin *origin, rekv_err *err)
{
    return pf_load_or_measure(c, be, link, dir, force, out, origin, NULL, NULL, err);
}

int rekv_profile_get(const rekv_model_config *c, const char *backend, const rekv_link_config *link,
                     const char *dir, int force, rekv_profile *out, rekv_profile_origin *origin,
                     rekv_err *err)
{
    return rekv_profile_get_progress(c, backend, link, dir, force, out, origin, NULL, NULL, err);
}

int rekv_profile_get_progress(const rekv_model_config *c, const char *backend,
                              const rekv_link_config *link, const char *dir, int force,
                              rekv_profile *out, rekv_profile_origin *origin,
                              rekv_progress_fn progress, void *arg, rekv_err *err)
{
    rekv_link_config l = REKV_LINK_NONE;
    if (link)
        l = *link;
    /* emulation of any kind means the cpu backend (as rekv_backend_create decides), then the
     * memory limit goes */
    if ((backend == NULL || strcmp(backend, "auto") == 0) && rekv_link_emulates(&l))
        backend = "cpu";
    l.device_bytes = 0;
    rekv_backend *be = NULL;
    char note[1200];
    int rc = rekv_backend_create(backend, &l, &be, note, sizeof(note), err);
    if (rc)
        return rc;
    rc = pf_load_or_measure(c, be, &l, dir, force, out, origin, progress, arg, err);
    rekv_backend_destroy(be);
    return rc;
}
