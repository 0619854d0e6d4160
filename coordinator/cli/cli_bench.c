/* cli_bench.c — `rekv bench`: benchmarks that print one JSON object. Times mean something as ratios
 * measured in the same run, so every benchmark measures its baseline alongside. */
#include <errno.h>
#include <stdint.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/crc32c.h"
#include "common/progress.h"
#include "coordinator/cli/cli_daemon.h"
#include "coordinator/cli/cli_profile.h"
#include "coordinator/cli/cli_session.h"
#include "common/dtype.h"
#include "gpuworker/blas.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/kernels.h"
#include "kvstore/kvstore.h"
#include "loader/loader.h"

/* GFLOP/s at y[m][n] = x[m][k]·W[n][k]^T — the shape a linear layer runs — of OpenBLAS (sgemm,
 * or at one row sgemv: OpenBLAS's sgemm is at its worst there, so it would flatter rekv) or of
 * rekv's row-invariant GEMM with fp32 or 16-bit weights. */
typedef enum { GEMM_BLAS, GEMM_REKV_F32, GEMM_REKV_F16 } gemm_impl;

static const rekv_blas *g_blas; /* OpenBLAS, loaded by bench_forward (gpuworker/blas.h) */

static double gemm_gflops(gemm_impl impl, int m, int n, int k, double min_s)
{
    float *x = calloc((size_t)m * k, sizeof(float)), *w = calloc((size_t)n * k, sizeof(float));
    float *y = calloc((size_t)m * n, sizeof(float));
    uint16_t *wh = impl == GEMM_REKV_F16 ? calloc((size_t)n * k, sizeof(uint16_t)) : NULL;
    double gf = 0;
    if (x && w && y && (wh || impl != GEMM_REKV_F16)) {
        for (size_t i = 0; i < (size_t)m * k; i++)
            x[i] = (float)(i % 7) * 0.1f;
        for (size_t i = 0; i < (size_t)n * k; i++)
            w[i] = (float)(i % 5) * 0.1f;
        if (wh)
            rekv_from_f32(wh, w, REKV_DTYPE_F16, (size_t)n * k);
        int reps = -1;
        uint64_t t0 = 0, t;
        do {
            if (impl == GEMM_REKV_F32)
                cpu_gemm_rowinv(y, x, w, REKV_DTYPE_F32, NULL, m, n, k);
            else if (impl == GEMM_REKV_F16)
                cpu_gemm_rowinv(y, x, wh, REKV_DTYPE_F16, NULL, m, n, k);
            else if (m == 1)
                g_blas->sgemv(CblasRowMajor, CblasNoTrans, n, k, 1, w, k, x, 1, 0, y, 1);
            else
                g_blas->sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1, x, k, w, k, 0, y,
                              n);
            if (reps++ < 0) /* the first call warms up, untimed */
                t0 = rekv_now_ns();
            t = rekv_now_ns();
        } while ((double)(t - t0) * 1e-9 < min_s);
        gf = 2.0 * m * n * k * reps / ((double)(t - t0) * 1e-9) * 1e-9;
    }
    free(x);
    free(w);
    free(wh);
    free(y);
    return gf;
}

static double blas_gflops(int m, int n, int k, double min_s)
{
    return gemm_gflops(GEMM_BLAS, m, n, k, min_s);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* rekv's GEMM (fp32 and fp16 weights) next to OpenBLAS at one shape: each measured five times in
 * a row, medians, with a pause before each: both libraries keep their worker threads spinning a
 * while after a call, and one's spinning threads slow the other's (up to 3x when they alternate
 * call by call on two cores). */
static json_t *gemm_compare(int m, int n, int k)
{
    enum { REPS = 5 };
    double g[3][REPS];
    for (int i = 0; i < 3; i++) {
        struct timespec pause = {0, 150000000}; /* past OpenBLAS's spin (~0.1 s) and rekv's */
        nanosleep(&pause, NULL);
        for (int r = 0; r < REPS; r++)
            g[i][r] = gemm_gflops((gemm_impl)i, m, n, k, 0.05);
    }
    for (int i = 0; i < 3; i++)
        qsort(g[i], REPS, sizeof(double), cmp_double);
    double b = g[GEMM_BLAS][REPS / 2], f = g[GEMM_REKV_F32][REPS / 2],
           h = g[GEMM_REKV_F16][REPS / 2];
    return json_pack("{s:i, s:i, s:i, s:s, s:f, s:f, s:f, s:f, s:f}", "rows", m, "n", n, "k", k,
                     "blas", m == 1 ? "sgemv" : "sgemm", "blas_gflops", b, "rekv_f32_gflops", f,
                     "rekv_f16_gflops", h, "rekv_f32_vs_blas", b > 0 ? f / b : 0,
                     "rekv_f16_vs_blas", b > 0 ? h / b : 0);
}

static int bench_forward(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"batches", required_argument, 0, 'b'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"decode-steps", required_argument, 0, 'd'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model_path = NULL, *batches = "1,2,4,8,16,32";
    long prompt_len = 64, steps = 8;
    int c, json = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm':
            model_path = optarg;
            break;
        case 'b':
            batches = optarg;
            break;
        case 'p':
            if (cli_parse_int("prompt-len", optarg, 1, 1 << 20, &prompt_len))
                return 2;
            break;
        case 'd':
            if (cli_parse_int("decode-steps", optarg, 1, 1 << 20, &steps))
                return 2;
            break;
        case 'j':
            json = 1; /* JSON is the only output; --json also keeps stderr quiet */
            break;
        case 'h':
        default:
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: rekv bench forward --model PATH [--batches 1,2,4,8,16,32]\n"
                    "                          [--prompt-len S] [--decode-steps N] [--json]\n"
                    "Prints prefill and decode tokens/s and GFLOP/s per batch size, next to\n"
                    "OpenBLAS's GFLOP/s at the model's shapes (sgemm; sgemv at one row), and\n"
                    "the GEMM alone (ffn x hidden, the batch's and the prefill's rows): rekv's\n"
                    "with fp32 and fp16 weights next to OpenBLAS, medians of 5, same run.\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (model_path == NULL) {
        fprintf(stderr, "rekv bench forward: --model is required\n");
        return 2;
    }
    int32_t *bs = NULL;
    int n_bs = 0;
    if (cli_parse_ids(batches, &bs, &n_bs)) {
        fprintf(stderr, "rekv bench forward: --batches: expected sizes like 1,2,4\n");
        return 2;
    }
    int rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    json_t *runs = json_array();
    if (rekv_blas_load(&g_blas, &err) || rekv_model_open(model_path, &model, &err) ||
        rekv_engine_create(model, &eng, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        goto out;
    }
    const rekv_model_config *cfg = &model->config;
    if (prompt_len + steps > cfg->max_pos) {
        fprintf(stderr, "rekv bench forward: prompt-len + decode-steps exceeds the context (%d)\n",
                cfg->max_pos);
        goto out;
    }
    double peak = blas_gflops(1024, 1024, 1024, 0.5);
    /* progress: each batch size's prefill and decode steps */
    rekv_progress pr;
    rekv_progress_begin(&pr, stderr, rekv_progress_style_for(stderr, json), "rekv bench forward",
                        "steps", (uint64_t)n_bs * (uint64_t)(steps + 1));
    for (int bi = 0; bi < n_bs; bi++) {
        int B = bs[bi], S = (int)prompt_len;
        if (B <= 0)
            continue;
        rekv_seq **seqs = calloc((size_t)B, sizeof(*seqs));
        rekv_batch_item *items = calloc((size_t)B, sizeof(*items));
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)B * (size_t)S);
        float *logits = malloc(sizeof(float) * (size_t)B * (size_t)cfg->vocab);
        if (!seqs || !items || !toks || !logits) {
            fprintf(stderr, "rekv: out of memory\n");
            free(seqs), free(items), free(toks), free(logits);
            goto out;
        }
        uint64_t x = 12345;
        for (size_t i = 0; i < (size_t)B * S; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            toks[i] = (int32_t)((x >> 33) % (uint64_t)cfg->vocab);
        }
        int ok = 1;
        for (int b = 0; b < B && ok; b++) {
            ok = rekv_seq_create(eng, S + (int)steps, &seqs[b], &err) == 0;
            items[b] = (rekv_batch_item){seqs[b], toks + (size_t)b * S, S, 0,
                                         logits + (size_t)b * cfg->vocab};
        }
        uint64_t t0 = rekv_now_ns(), base = (uint64_t)bi * (uint64_t)(steps + 1);
        ok = ok && rekv_engine_forward(eng, items, B, &err) == 0;
        uint64_t t1 = rekv_now_ns();
        rekv_progress_update(&pr, base + 1, NULL);
        for (long s = 0; s < steps && ok; s++) {
            for (int b = 0; b < B; b++)
                items[b] = (rekv_batch_item){seqs[b], toks + (size_t)b * S + (size_t)s % S, 1, 0,
                                             logits + (size_t)b * cfg->vocab};
            ok = rekv_engine_forward(eng, items, B, &err) == 0;
            rekv_progress_update(&pr, base + (uint64_t)s + 2, NULL);
        }
        uint64_t t2 = rekv_now_ns();
        for (int b = 0; b < B; b++)
            rekv_seq_free(seqs[b]);
        free(seqs), free(items), free(toks), free(logits);
        if (!ok) {
            rekv_progress_end(&pr);
            fprintf(stderr, "rekv: %s\n", err.msg);
            goto out;
        }
        double pre_s = (double)(t1 - t0) * 1e-9, dec_s = (double)(t2 - t1) * 1e-9;
        double ctx_pre = (double)B * S * (S + 1) / 2;
        double ctx_dec = (double)B * ((double)steps * S + (double)steps * (steps + 1) / 2);
        double pre_gf = rekv_engine_flops(eng, (double)B * S, ctx_pre, B) / pre_s * 1e-9;
        double dec_gf =
            rekv_engine_flops(eng, (double)B * steps, ctx_dec, (double)B * steps) / dec_s * 1e-9;
        /* OpenBLAS at the layer's largest shape for these row counts */
        double sg_pre = blas_gflops(B * S, cfg->ffn, cfg->hidden, 0.2);
        double sg_dec = blas_gflops(B, cfg->ffn, cfg->hidden, 0.2);
        /* the GEMM alone at that shape, at the decode step's rows and the prefill's */
        json_t *gemm = json_pack("[o, o]", gemm_compare(B, cfg->ffn, cfg->hidden),
                                 gemm_compare(B * S, cfg->ffn, cfg->hidden));
        json_array_append_new(
            runs, json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:o}", "batch", B,
                            "prefill_tokens_per_s", (double)B * S / pre_s, "decode_tokens_per_s",
                            (double)B * steps / dec_s, "prefill_gflops", pre_gf, "decode_gflops",
                            dec_gf, "blas_gflops_prefill_shape", sg_pre, "blas_gflops_decode_shape",
                            sg_dec, "prefill_vs_blas", pre_gf / sg_pre, "decode_vs_blas",
                            dec_gf / sg_dec, "gemm", gemm));
    }
    rekv_progress_end(&pr);
    json_t *o = json_pack(
        "{s:s, s:s, s:{s:i, s:i, s:i, s:i, s:s}, s:i, s:i, s:f, s:i, s:i, s:O}", "bench", "forward",
        "backend", "cpu", "model", "layers", cfg->n_layers, "hidden", cfg->hidden, "ffn", cfg->ffn,
        "vocab", cfg->vocab, "dtype", rekv_dtype_name(cfg->dtype), "prompt_len", (int)prompt_len,
        "decode_steps", (int)steps, "sgemm_gflops_1024", peak, "rekv_gemm_threads",
        cpu_gemm_threads(), "blas_threads", g_blas->get_num_threads(), "runs", runs);
    char *s = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", s);
    free(s);
    json_decref(o);
    rc = 0;
out:
    json_decref(runs);
    free(bs);
    rekv_engine_free(eng);
    rekv_model_close(model);
    return rc;
}

/* Best of `reps` timed passes of pass(arg) on s (one warm-up first), seconds. */
static int best_pass(rekv_backend *be, rekv_stream *s, int reps, void (*pass)(void *), void *arg,
                     double *best, rekv_err *err)
{
    *best = 0;
    for (int i = 0; i <= reps; i++) {
        uint64_t t0 = rekv_now_ns();
        pass(arg);
        int rc = be->iface->stream_sync(s, err);
        if (rc)
            return rc;
        double t = (double)(rekv_now_ns() - t0) * 1e-9;
        if (i > 0 && (*best == 0 || t < *best))
            *best = t;
    }
    return 0;
}

/* one copy: host to device (h2d), else device to device */
typedef struct copy_pass {
    rekv_backend *be;
    rekv_stream *s;
    rekv_copy_piece pc;
    int h2d;
} copy_pass;

static void run_copy_pass(void *arg)
{
    copy_pass *a = arg;
    if (a->h2d)
        a->be->iface->copy_h2d(a->s, &a->pc, 1, REKV_XFER_OTHER);
    else
        a->be->iface->copy_d2d(a->s, &a->pc, 1);
}

/* Host->device bandwidth of plain copies of `bytes` from src into device memory, GB/s: one
 * warm-up copy, then the best of 5 (each synchronised). */
static int measure_h2d(rekv_backend *be, const void *src, size_t bytes, double *gbps, rekv_err *err)
{
    const rekv_backend_iface *bi = be->iface;
    rekv_stream *s = NULL;
    void *d = bi->dev_alloc(be, bytes);
    int rc = d ? bi->stream_create(be, "bandwidth", &s, err)
               : rekv_errf(err, -ENOMEM, "bench: out of device memory for %zu bytes", bytes);
    double t = 0;
    copy_pass cp = {be, s, {d, src, bytes}, 1};
    if (rc == 0)
        rc = best_pass(be, s, 5, run_copy_pass, &cp, &t, err);
    if (s)
        bi->stream_destroy(s);
    if (d)
        bi->dev_free(be, d);
    *gbps = rc == 0 ? (double)bytes / t * 1e-9 : 0;
    return rc;
}

/* The link's peak in this run, three ways: from the kvstore's arena as the pipeline copies from it
 * (page-locked by the backend where it can: cudaHostRegister), from the backend's own pinned host
 * memory (cudaHostAlloc), and from ordinary pageable memory. */
typedef struct link_peak {
    double arena_gbps, pinned_gbps, pageable_gbps;
    size_t bytes;
} link_peak;

static int measure_link(rekv_backend *be, rekv_kvstore_client *store, link_peak *out, rekv_err *err)
{
    size_t ab = 0;
    char *arena = rekv_kvstore_client_arena(store, &ab);
    size_t max = ab > (2u << 20) ? ab - 4096 : 0;
    if (max > (256u << 20))
        max = 256u << 20;
    size_t fr = 0, tot = 0; /* a device of little memory (--device-memory): what the run left */
    rekv_err me = {0};
    if (be->iface->mem_info && be->iface->mem_info(be, &fr, &tot, &me) == 0 && fr / 2 < max)
        max = fr / 2 & ~(size_t)4095;
    if (max == 0)
        return rekv_errf(err, -EINVAL, "bench: the kvstore's arena is too small to measure");
    void *pinned = rekv_host_alloc(be, max);
    char *pageable = malloc(max);
    int rc = pinned && pageable ? 0 : rekv_errf(err, -ENOMEM, "bench: out of host memory");
    if (rc == 0) {
        memset(pinned, 1, max);
        memset(pageable, 1, max);
        /* copies of ~0.1 s at the probed rate (a slow emulated link needs small ones) */
        double probe = 0;
        size_t least = max < (1u << 20) ? max : 1u << 20;
        rc = measure_h2d(be, pinned, least, &probe, err);
        double want = probe * 1e9 * 0.1;
        out->bytes = want >= (double)max ? max : want < (double)least ? least : (size_t)want;
        out->bytes &= ~(size_t)4095;
    }
    if (rc == 0)
        rc = measure_h2d(be, arena + 4096, out->bytes, &out->arena_gbps, err);
    if (rc == 0)
        rc = measure_h2d(be, pinned, out->bytes, &out->pinned_gbps, err);
    if (rc == 0)
        rc = measure_h2d(be, pageable, out->bytes, &out->pageable_gbps, err);
    rekv_host_free(be, pinned);
    free(pageable);
    return rc;
}

/* The device's own rates in this run, the yardsticks of issue 15's goals: a device-to-device copy
 * (GB/s counting the bytes read and the bytes written: the memory's rate a decode step's reads
 * share) and the engine's GEMM (the kernel table's linear, as the pipeline calls it) over one
 * layer's projections at the rows of a prefill step (at most DEVICE_GEMM_ROWS), FLOP/s. */
enum { DEVICE_GEMM_ROWS = 2048 };
typedef struct device_peak {
    double copy_gbps, gemm_flops;
    size_t copy_bytes;
    int gemm_rows;
} device_peak;

typedef struct gemm_pass {
    const rekv_kernel_iface *k;
    rekv_stream *s;
    float *x, *y;
    void *w;
    rekv_dtype wt;
    int rows, n_shapes, shape[7][2]; /* (n, k) */
} gemm_pass;

static void run_gemm_pass(void *arg)
{
    gemm_pass *a = arg;
    for (int i = 0; i < a->n_shapes; i++)
        a->k->linear(a->s, a->y, a->x, a->w, a->wt, NULL, a->rows, a->shape[i][0], a->shape[i][1]);
}

static int measure_device(rekv_backend *be, const rekv_engine *eng, int rows, device_peak *out,
                          rekv_err *err)
{
    const rekv_backend_iface *bi = be->iface;
    const rekv_model_config *c = rekv_engine_config(eng);
    rekv_dtype wt = rekv_engine_weight_dtype(eng);
    int H = c->hidden, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c), F = c->ffn;
    gemm_pass g = {.k = rekv_kernels_of(be),
                   .wt = wt,
                   .rows = rows < DEVICE_GEMM_ROWS ? rows : DEVICE_GEMM_ROWS};
    int shapes[7][2] = {{Q, H}, {KV, H}, {KV, H}, {H, Q}, {F, H}, {H, F}, {F, H}};
    g.n_shapes = c->act == REKV_ACT_SILU ? 7 : 6;
    memcpy(g.shape, shapes, sizeof(shapes));
    size_t big = (size_t)(F > Q ? F : Q), wide = big > (size_t)H ? big : (size_t)H;
    size_t ws = rekv_dtype_size(wt), w_elems = (size_t)H * big; /* the largest of the shapes */
    size_t xy = sizeof(float) * (size_t)g.rows * wide, wb = ws * w_elems;
    size_t fr = 0, tot = 0, cb = 256u << 20;
    rekv_err me = {0};
    if (bi->mem_info && bi->mem_info(be, &fr, &tot, &me) == 0 && fr / 4 < cb)
        cb = fr / 4 & ~(size_t)4095;
    float *hx = malloc(xy), pat[1024];
    char *hw = malloc(wb), tab[1024 * 4];
    void *d1 = bi->dev_alloc(be, cb), *d2 = bi->dev_alloc(be, cb);
    g.x = bi->dev_alloc(be, xy), g.y = bi->dev_alloc(be, xy), g.w = bi->dev_alloc(be, wb);
    rekv_stream *s = NULL;
    int rc = hx && hw && d1 && d2 && g.x && g.y && g.w
                 ? bi->stream_create(be, "device peak", &s, err)
                 : rekv_errf(err, -ENOMEM, "bench: out of memory measuring the device");
    if (rc == 0) { /* small, varied values: a GEMM of zeros runs faster than one of data */
        for (int i = 0; i < 1024; i++)
            pat[i] = (float)((i * 2654435761u) % 2001) * 1e-3f - 1.0f;
        rekv_from_f32(tab, pat, wt, 1024);
        for (size_t i = 0; i < xy / sizeof(float); i++)
            hx[i] = pat[i % 1021];
        for (size_t i = 0; i < w_elems; i++)
            memcpy(hw + i * ws, tab + (i % 1019) * ws, ws);
        rekv_copy_piece pc[3] = {{g.x, hx, xy}, {g.y, hx, xy}, {g.w, hw, wb}};
        bi->copy_h2d(s, pc, 3, REKV_XFER_OTHER);
        /* the copy's source holds data too (untouched host pages would read as the zero page) */
        for (size_t at = 0; at < cb; at += xy) {
            rekv_copy_piece fill = {(char *)d1 + at, g.x, cb - at < xy ? cb - at : xy};
            bi->copy_d2d(s, &fill, 1);
        }
        rc = bi->stream_sync(s, err);
    }
    g.s = s;
    copy_pass cp = {be, s, {d2, d1, cb}, 0};
    double t = 0;
    if (rc == 0 && (rc = best_pass(be, s, 5, run_copy_pass, &cp, &t, err)) == 0) {
        out->copy_bytes = cb;
        out->copy_gbps = 2.0 * (double)cb / t * 1e-9;
    }
    if (rc == 0 && (rc = best_pass(be, s, 3, run_gemm_pass, &g, &t, err)) == 0) {
        double flops = 0;
        for (int i = 0; i < g.n_shapes; i++)
            flops += 2.0 * g.rows * (double)g.shape[i][0] * (double)g.shape[i][1];
        out->gemm_rows = g.rows;
        out->gemm_flops = flops / t;
    }
    if (s)
        bi->stream_destroy(s);
    void *bufs[] = {d1, d2, g.x, g.y, g.w};
    for (int i = 0; i < 5; i++)
        if (bufs[i])
            bi->dev_free(be, bufs[i]);
    free(hx);
    free(hw);
    return rc;
}

/* One mode's decode run: prefill the prompts, at most `chunk` tokens of each per step (serving's
 * chunked prefill; timed: prefill_s), then gen_len - 1
 * greedy decode steps timed alone, with counters and busy times taken over the decode steps only.
 * With link != NULL (a mode that uses the kvstore), the link's peak is measured afterwards in the
 * same session. */
typedef struct decode_result {
    double prefill_s, decode_s, compute_busy_s, h2d_busy_s, d2h_busy_s;
    uint64_t gathered;    /* h2d rows a device-side gather read (the backend's h2d_gathered) */
    uint64_t graph_steps; /* decode steps that ran as one device graph */
    uint64_t host_syncs;  /* the decode steps' calls that blocked on the device (backend stats) */
    rekv_layer_counters counters;
    double
        selected; /* infinigen's selected fraction f (rekv_pipeline_selected_fraction), 0: none */
    int32_t *tokens; /* [gen_len][batch] */
    /* each decode step's compute busy and link (h2d) busy time, s: [gen_len - 1][2] */
    double *step;
    rekv_pipeline_config cfg;
    char backend[16];       /* the backend it ran on */
    int has_store;          /* the kvstore's counters over the decode steps: */
    rekv_kv_stats ks0, ks1; /* at their start and end */
} decode_result;

/* One mode's run: N steps (the prefill, then N - 1 decode steps), reported to pr as done + 1 ..
 * done + N; note names the run. */
static int run_decode(rekv_engine *eng, const cli_pipeline_opts *po, rekv_mode mode, int B, int S,
                      int N, int chunk, int32_t *const *prompts, decode_result *out,
                      link_peak *link, device_peak *dev, rekv_progress *pr, uint64_t done,
                      const char *note, rekv_err *err)
{
    const rekv_model_config *c = rekv_engine_config(eng);
    int rc;
    out->cfg = po->cfg;
    out->cfg.mode = mode;
    if ((rc = cli_session_choose(c, po->backend, &po->link, B, S, &out->cfg, err)))
        return rc;
    cli_session ses;
    if ((rc = cli_session_open(&ses, eng, po, &out->cfg, B, S + N, err)))
        return rc;
    snprintf(out->backend, sizeof(out->backend), "%s", ses.be->iface->name);
    rekv_pseq **seqs = calloc((size_t)B, sizeof(*seqs));
    rekv_pipe_item *items = calloc((size_t)B, sizeof(*items));
    out->tokens = malloc(sizeof(int32_t) * (size_t)B * (size_t)N);
    out->step = calloc((size_t)(N - 1) * 2, sizeof(double));
    if (!seqs || !items || !out->tokens || !out->step) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto out;
    }
    for (int b = 0; b < B && rc == 0; b++)
        rc = rekv_pseq_create(ses.p, S + N, &seqs[b], err);
    /* greedy, drawn on the device as a served worker draws: only the ids cross back */
    rekv_sampler greedy;
    rekv_sampler_init(&greedy, 0, 0, 1, 0);
    uint64_t t_pre = rekv_now_ns();
    for (int t0 = 0; t0 < S && rc == 0; t0 += chunk) {
        for (int b = 0; b < B; b++)
            items[b] = (rekv_pipe_item){.seq = seqs[b],
                                        .tokens = prompts[b] + t0,
                                        .n_tokens = S - t0 < chunk ? S - t0 : chunk,
                                        .smp = &greedy,
                                        .token = &out->tokens[b]};
        rc = rekv_pipeline_step(ses.p, items, B, err);
    }
    if (rc)
        goto out;
    out->prefill_s = (double)(rekv_now_ns() - t_pre) * 1e-9;
    rekv_progress_update(pr, done + 1, note);
    rekv_pipeline_counters_reset(ses.p);
    ses.be->iface->stats_reset(ses.be);
    ses.be->iface->timing(ses.be, true); /* the decode steps' busy times: every op timed */
    if (po->trace)
        ses.be->iface->trace_start(ses.be);
    out->has_store = ses.store && rekv_kvstore_stats(ses.store, &out->ks0, NULL) == 0;
    uint64_t t0 = rekv_now_ns();
    for (int step = 0; step + 1 < N; step++) {
        for (int b = 0; b < B; b++)
            items[b] = (rekv_pipe_item){.seq = seqs[b],
                                        .tokens = &out->tokens[(size_t)step * B + b],
                                        .n_tokens = 1,
                                        .smp = &greedy,
                                        .token = &out->tokens[(size_t)(step + 1) * B + b]};
        rekv_backend_stats b0, b1;
        ses.be->iface->stats(ses.be, &b0);
        if ((rc = rekv_pipeline_step(ses.p, items, B, err)))
            goto out;
        ses.be->iface->stats(ses.be, &b1);
        out->step[(size_t)step * 2] = b1.compute_busy_s - b0.compute_busy_s;
        out->step[(size_t)step * 2 + 1] = b1.h2d_busy_s - b0.h2d_busy_s;
        out->host_syncs += b1.host_syncs - b0.host_syncs;
        rekv_progress_update(pr, done + (uint64_t)step + 2, note);
    }
    out->decode_s = (double)(rekv_now_ns() - t0) * 1e-9;
    out->graph_steps = rekv_pipeline_graph_steps(ses.p, NULL); /* the prefill never is one */
    if (out->has_store)
        out->has_store = rekv_kvstore_stats(ses.store, &out->ks1, NULL) == 0;
    out->selected = rekv_pipeline_selected_fraction(rekv_pipeline_counters(ses.p, &out->counters),
                                                    rekv_engine_config(eng)->n_layers, NULL, NULL);
    rekv_backend_stats bst;
    ses.be->iface->stats(ses.be, &bst);
    out->compute_busy_s = bst.compute_busy_s;
    out->h2d_busy_s = bst.h2d_busy_s;
    out->d2h_busy_s = bst.d2h_busy_s;
    out->gathered = bst.h2d_gathered;
    if (po->trace) /* this run's own file (bench_decode names it) */
        rc = ses.be->iface->trace_write(ses.be, po->trace, err);
    if (rc == 0 && link && ses.store)
        rc = measure_link(ses.be, ses.store, link, err);
    if (rc == 0 && dev)
        rc = measure_device(ses.be, eng, B * chunk, dev, err);
out:
    if (seqs)
        for (int b = 0; b < B; b++)
            rekv_pseq_free(seqs[b]);
    free(seqs);
    free(items);
    cli_session_close(&ses);
    return rc;
}

/* The planner's prediction of run r's decode steps (step k at context S + k) beside what they
 * measured (their mean: measured, > 0), into o: "predicted_step_s" with the cached profile as it
 * is, "online_predicted_step_s" with it corrected by the run's steps before (rekv_plan_scales from
 * 1, updated by each step's busy times, as a served worker's planner corrects it), each a mean over
 * the steps, with its relative error against the measured mean, and the scales the run ended with.
 * infinigen and clo are priced at the fraction the run's selecting layers fetched. */
static void predict_run(const rekv_profile *pf, const rekv_model_config *c, const decode_result *r,
                        int B, int S, int N, double measured, json_t *o)
{
    rekv_plan_scales sc = {1, 1};
    rekv_cost_profile prof, now;
    rekv_profile_to_cost(pf, r->cfg.cache_dtype, &prof);
    double f = r->selected > 0 ? r->selected : REKV_PLAN_INFINIGEN_PRIOR;
    double plain = 0, online = 0;
    for (int k = 0; k < N - 1; k++) {
        const double *st = r->step + (size_t)k * 2; /* compute, link busy */
        rekv_step_cost p0, p1;
        rekv_plan_scaled_profile(&prof, &sc, &now);
        if (cli_plan_predict_step(&prof, c, &r->cfg, B, S + k, f > 1 ? 1 : f, &p0, NULL) ||
            cli_plan_predict_step(&now, c, &r->cfg, B, S + k, f > 1 ? 1 : f, &p1, NULL))
            return;
        plain += p0.t_step;
        online += p1.t_step;
        rekv_plan_scales_observe(&sc, st[1], p1.t_pcie, st[0], p1.t_compute);
    }
    plain /= N - 1, online /= N - 1;
    json_object_set_new(o, "predicted_step_s", json_real(plain));
    json_object_set_new(o, "prediction_error", json_real(plain / measured - 1));
    json_object_set_new(o, "online_predicted_step_s", json_real(online));
    json_object_set_new(o, "online_prediction_error", json_real(online / measured - 1));
    json_object_set_new(o, "scales",
                        json_pack("{s:f, s:f}", "pcie", sc.pcie, "compute", sc.compute));
}

static int bench_decode(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"batch", required_argument, 0, 'b'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"gen-len", required_argument, 0, 'g'},
                                         {"modes", required_argument, 0, 'M'},
                                         {"prefill-chunk", required_argument, 0, 'P'},
                                         {"json", no_argument, 0, 'j'},
                                         {"approximate", no_argument, 0, 'A'},
                                         {"help", no_argument, 0, 'h'},
                                         CLI_PIPELINE_OPTIONS,
                                         {0, 0, 0, 0}};
    const char *model_path = NULL, *modes = "resident,offload,kvpr,act,hybrid";
    long B = 8, S = 128, N = 8, PB = 0;
    int json = 0, approximate = 0;
    cli_pipeline_opts po;
    cli_pipeline_opts_defaults(&po);
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int pr = cli_parse_pipeline_opt(c, optarg, &po);
        if (pr < 0)
            return 2;
        if (pr > 0)
            continue;
        switch (c) {
        case 'm':
            model_path = optarg;
            break;
        case 'b':
            if (cli_parse_int("batch", optarg, 1, 4096, &B))
                return 2;
            break;
        case 'p':
            if (cli_parse_int("prompt-len", optarg, 1, 1 << 20, &S))
                return 2;
            break;
        case 'g':
            if (cli_parse_int("gen-len", optarg, 2, 1 << 20, &N))
                return 2;
            break;
        case 'M':
            modes = optarg;
            break;
        case 'P':
            if (cli_parse_int("prefill-chunk", optarg, 1, 1 << 20, &PB))
                return 2;
            break;
        case 'j':
            json = 1; /* JSON is the only output; --json also keeps stderr quiet */
            break;
        case 'A':
            approximate = 1;
            break;
        case 'h':
        default:
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: rekv bench decode --model PATH [--batch B] [--prompt-len S]\n"
                    "                         [--gen-len N] [--modes "
                    "resident,offload,kvpr+push,kvpr@300,auto,...]\n"
                    "                         [--prefill-chunk T] [--approximate] [pipeline "
                    "options] [--json]\n"
                    "Prints JSON; progress goes to stderr (none with --json).\n"
                    "Runs every mode on the same prompts in one process and prints its prefill\n"
                    "time, decode tokens/s, its ratio to offload, host->device bytes per\n"
                    "generated token, achieved host->device GB/s next to the link's peak\n"
                    "measured in the same run (from pinned, kvstore-arena and pageable memory)\n"
                    "and the busy fractions of compute and link. kvpr@L runs kvpr with split L\n"
                    "(e.g. --modes kvpr,kvpr@300,kvpr@450 against the planner's), infinigen@L\n"
                    "infinigen recomputing up to L of what it fetches. auto runs what\n"
                    "a served worker with --mode auto would: the mode the planner prices\n"
                    "cheapest, with each sequence's first tokens kept on the device where the\n"
                    "device has room for them but not for the whole cache (--device-memory on\n"
                    "the cpu backend); with --approximate it may pick infinigen, as a worker\n"
                    "started with --approximate may. --prefill-chunk T prefills at most T\n"
                    "tokens of each prompt per step, as serving does (default: whole prompts in\n"
                    "one step; a chunk needs less device memory for the prefill's rows, same\n"
                    "tokens).\n"
                    "Pipeline options:\n" CLI_PIPELINE_USAGE
                    "(--mode is ignored. --trace F with several runs writes one trace per run,\n"
                    "F with the run's name before its extension: --trace t.json --modes\n"
                    "offload,kvpr@300 writes t.offload.json and t.kvpr@300.json)\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (model_path == NULL) {
        fprintf(stderr, "rekv bench decode: --model is required\n");
        return 2;
    }
    if (PB == 0 || PB > S) /* whole prompts in one prefill step */
        PB = S;
    int rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    int32_t **prompts = NULL;
    enum { MAX_RUNS = 16 };
    decode_result res[MAX_RUNS];
    rekv_mode mlist[MAX_RUNS];
    int mpush[MAX_RUNS];       /* "MODE+push": this run pushes (--push: every streaming run does) */
    int msplit[MAX_RUNS];      /* "kvpr@L": this run's split; -1: --split's, or the planner's */
    int mauto[MAX_RUNS];       /* "auto": the planner picks the mode and the device part */
    char mname[MAX_RUNS][112]; /* the run as given ("kvpr@300"), "-2"... added when repeated */
    char mwhy[MAX_RUNS][256];  /* "auto": the planner's line on its pick */
    int n_modes = 0;
    memset(res, 0, sizeof(res));
    char *mdup = strdup(modes), *save = NULL;
    for (char *t = strtok_r(mdup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char run_name[96];
        snprintf(run_name, sizeof(run_name), "%s", t);
        char *plus = strchr(t, '+'), *at = strchr(t, '@'), *end = NULL;
        int push = plus != NULL && strcmp(plus, "+push") == 0, bad = plus && !push;
        if (plus)
            *plus = '\0';
        long split = -1;
        if (at) {
            *at = '\0';
            split = strtol(at + 1, &end, 10);
            bad |= end == at + 1 || *end || split < 0 || split > INT32_MAX;
        }
        mauto[n_modes] = strcmp(t, "auto") == 0 && !at;
        if (mauto[n_modes])
            mlist[n_modes] = REKV_MODE_OFFLOAD; /* until the planner picks */
        if (n_modes == MAX_RUNS || bad ||
            (!mauto[n_modes] && rekv_mode_parse(t, &mlist[n_modes])) ||
            (push && mlist[n_modes] == REKV_MODE_RESIDENT) ||
            (at && mlist[n_modes] != REKV_MODE_KVPR && mlist[n_modes] != REKV_MODE_INFINIGEN)) {
            fprintf(stderr,
                    "rekv bench decode: --modes: unknown or too many runs (\"%s\"; MODE, "
                    "kvpr@SPLIT, infinigen@SPLIT or auto, each optionally +push, at most %d; "
                    "resident never pushes)\n",
                    run_name, MAX_RUNS);
            free(mdup);
            return 2;
        }
        mpush[n_modes] = push || (po.cfg.push && mlist[n_modes] != REKV_MODE_RESIDENT);
        msplit[n_modes] = (int)split;
        int seen = 1;
        for (int k = 0; k < n_modes; k++)
            seen += strncmp(mname[k], run_name, strlen(run_name)) == 0 &&
                    (mname[k][strlen(run_name)] == '\0' || mname[k][strlen(run_name)] == '-');
        if (seen > 1)
            snprintf(mname[n_modes], sizeof(mname[n_modes]), "%s-%d", run_name, seen);
        else
            snprintf(mname[n_modes], sizeof(mname[n_modes]), "%s", run_name);
        n_modes++;
    }
    free(mdup);
    if (rekv_model_open(model_path, &model, &err) || rekv_engine_create(model, &eng, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        goto out;
    }
    const rekv_model_config *cfg = &model->config;
    if (S + N > cfg->max_pos) {
        fprintf(stderr, "rekv bench decode: prompt-len + gen-len exceeds the context (%d)\n",
                cfg->max_pos);
        goto out;
    }
    prompts = calloc((size_t)B, sizeof(*prompts));
    uint64_t x = 777;
    for (long b = 0; b < B; b++) {
        prompts[b] = malloc(sizeof(int32_t) * (size_t)S);
        for (long i = 0; i < S; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            prompts[b][i] = (int32_t)((x >> 33) % (uint64_t)cfg->vocab);
        }
    }
    link_peak lp = {0};
    device_peak dp = {0};
    int have_lp = 0;
    rekv_progress pr;
    rekv_progress_begin(&pr, stderr, rekv_progress_style_for(stderr, json), "rekv bench decode",
                        "steps", (uint64_t)n_modes * (uint64_t)N);
    for (int i = 0; i < n_modes; i++) {
        int measure = !have_lp && mlist[i] != REKV_MODE_RESIDENT;
        cli_pipeline_opts run = po;
        char trace[4400];
        if (po.trace && n_modes > 1) {
            if (cli_trace_path(po.trace, mname[i], trace, sizeof(trace))) {
                fprintf(stderr, "rekv bench decode: --trace %s: path too long\n", po.trace);
                goto out;
            }
            run.trace = trace;
        }
        if (mauto[i]) { /* what a served worker with --mode auto would run as */
            if (cli_session_auto(eng, &run, (int)B, (int)(S + N), approximate, &run.cfg, mwhy[i],
                                 sizeof(mwhy[i]), &err)) {
                rekv_progress_end(&pr);
                fprintf(stderr, "rekv: auto: %s\n", err.msg);
                goto out;
            }
            mlist[i] = run.cfg.mode;
            mpush[i] = mpush[i] && mlist[i] != REKV_MODE_RESIDENT;
            if (!json)
                fprintf(stderr, "rekv bench decode: auto: %s\n", mwhy[i]);
        }
        run.cfg.push = mpush[i];
        if (msplit[i] >= 0)
            run.cfg.split = msplit[i];
        if (run_decode(eng, &run, mlist[i], (int)B, (int)S, (int)N, (int)PB, prompts, &res[i],
                       measure ? &lp : NULL, i == 0 ? &dp : NULL, &pr, (uint64_t)i * (uint64_t)N,
                       mname[i], &err)) {
            rekv_progress_end(&pr);
            fprintf(stderr, "rekv: %s%s: %s\n", rekv_mode_name(mlist[i]), mpush[i] ? "+push" : "",
                    err.msg);
            goto out;
        }
        have_lp |= measure;
    }
    rekv_progress_end(&pr);
    double offload_tps = 0;
    int ref = -1;
    for (int i = 0; i < n_modes; i++) {
        if (mlist[i] == REKV_MODE_OFFLOAD && (offload_tps == 0 || !mpush[i]))
            offload_tps = (double)B * (N - 1) / res[i].decode_s; /* pull's when both ran */
        if (mlist[i] == REKV_MODE_RESIDENT)
            ref = i;
    }
    /* the planner's prediction of each run's decode steps, beside the measured ones (the profile is
     * this machine's, cached; measured once when missing): the profile's own, and the profile
     * corrected online by the run's steps before each one, as a served worker's planner corrects
     * it (a worker's mode is fixed for its life: each run starts from the profile) */
    rekv_profile pf;
    rekv_err perr = {0};
    int have_pf = rekv_profile_get(cfg, po.backend, &po.link, NULL, 0, &pf, NULL, &perr) == 0;
    json_t *arr = json_array();
    for (int i = 0; i < n_modes; i++) {
        decode_result *r = &res[i];
        double toks = (double)B * (N - 1), tps = toks / r->decode_s; /* tokens of decode steps */
        uint64_t h2d = 0;
        for (int k = 0; k < REKV_XFER_KINDS; k++)
            h2d += r->counters.h2d_bytes[k];
        json_t *o = json_pack(
            "{s:s, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:I, s:I}", "mode",
            rekv_mode_name(mlist[i]), "decode_s", r->decode_s, "decode_tokens_per_s", tps,
            "h2d_bytes_per_token", (double)h2d / toks, "h2d_kv_bytes_per_token",
            (double)r->counters.h2d_bytes[REKV_XFER_KV] / toks, "h2d_act_bytes_per_token",
            (double)r->counters.h2d_bytes[REKV_XFER_ACT] / toks, "h2d_weight_bytes_per_token",
            (double)r->counters.h2d_bytes[REKV_XFER_WEIGHTS] / toks, "compute_busy_frac",
            r->compute_busy_s / r->decode_s, "link_busy_frac", r->h2d_busy_s / r->decode_s,
            "tokens_recomputed", (json_int_t)r->counters.tokens_recomputed, "tokens_fetched",
            (json_int_t)r->counters.tokens_fetched);
        json_object_set_new(o, "push", json_boolean(mpush[i]));
        json_object_set_new(o, "run", json_string(mname[i]));
        if (mauto[i])
            json_object_set_new(o, "auto", json_string(mwhy[i]));
        json_object_set_new(o, "device_tokens", json_integer(r->cfg.device_tokens));
        json_object_set_new(o, "tokens_device",
                            json_integer((json_int_t)r->counters.tokens_device));
        /* the generated ids' CRC32C: runs compare across invocations too */
        json_object_set_new(
            o, "tokens_crc32c",
            json_integer(rekv_crc32c(0, r->tokens, sizeof(int32_t) * (size_t)B * (size_t)N)));
        double measured = N > 1 ? r->decode_s / (N - 1) : 0;
        json_object_set_new(o, "measured_step_s", json_real(measured));
        if (have_pf && measured > 0)
            predict_run(&pf, cfg, r, B, S, N, measured, o);
        json_object_set_new(o, "prefill_s", json_real(r->prefill_s));
        if (r->has_store && r->ks1.bytes_read_back > r->ks0.bytes_read_back) {
            /* the decode steps' spill reads: a pin waited for them (critical) or not (ahead) */
            const rekv_kv_stats *a = &r->ks0, *z = &r->ks1;
            json_object_set_new(
                o, "spill",
                json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}", "arena_bytes",
                          (json_int_t)z->host_bytes, "read_back_bytes",
                          (json_int_t)(z->bytes_read_back - a->bytes_read_back), "spilled_bytes",
                          (json_int_t)(z->bytes_spilled - a->bytes_spilled), "critical_blocks",
                          (json_int_t)(z->pin_wait_blocks - a->pin_wait_blocks), "ahead_blocks",
                          (json_int_t)(z->read_ahead_blocks - a->read_ahead_blocks),
                          "critical_bytes", (json_int_t)(z->pin_wait_bytes - a->pin_wait_bytes)));
        }
        json_object_set_new(o, "prefill_tokens_per_s", json_real((double)B * S / r->prefill_s));
        /* issue 15's yardsticks: the prefill's FLOP/s against the engine's GEMM on its shapes,
         * and resident decode against the memory roofline (the weights and the KV each step
         * reads, at the device copy's rate) */
        double pre_flops = rekv_engine_flops(eng, (double)B * S, (double)B * S * (S + 1) / 2,
                                             (double)B * (double)((S + PB - 1) / PB));
        json_object_set_new(o, "prefill_flops_per_s", json_real(pre_flops / r->prefill_s));
        if (dp.gemm_flops > 0)
            json_object_set_new(o, "prefill_vs_gemm",
                                json_real(pre_flops / r->prefill_s / dp.gemm_flops));
        if (mlist[i] == REKV_MODE_RESIDENT && !r->cfg.offload_weights && dp.copy_gbps > 0 &&
            measured > 0) {
            double kv_row = 2.0 * cfg->n_layers * rekv_config_kv_dim(cfg) *
                            (double)rekv_dtype_size(r->cfg.cache_dtype),
                   bytes = 0;
            for (long k = 0; k + 1 < N; k++)
                bytes +=
                    (double)rekv_engine_step_weight_bytes(eng) + (double)B * (S + k + 1) * kv_row;
            double roof = bytes / (N - 1) / (dp.copy_gbps * 1e9);
            json_object_set_new(o, "roofline_step_s", json_real(roof));
            json_object_set_new(o, "roofline_frac", json_real(roof / measured));
        }
        /* host->device GB/s over the decode (all kinds), and while the link was busy (not for
         * push: the store's copies of KV rows do not show in the worker's link busy time) */
        json_object_set_new(o, "h2d_gbps", json_real((double)h2d / r->decode_s * 1e-9));
        /* rows the cuda backend's gather kernel read from the registered arena (prefill too) */
        json_object_set_new(o, "h2d_gathered_rows", json_integer((json_int_t)r->gathered));
        json_object_set_new(o, "graph_steps", json_integer((json_int_t)r->graph_steps));
        /* how often a step's caller blocked on the device (the drain at its end, and any wait
         * within: infinigen's per unit; clo's none, CLO §4.4) */
        json_object_set_new(o, "host_syncs_per_step",
                            json_real(N > 1 ? (double)r->host_syncs / (N - 1) : 0));
        if (r->h2d_busy_s > 0 && !mpush[i])
            json_object_set_new(o, "h2d_gbps_while_busy",
                                json_real((double)h2d / r->h2d_busy_s * 1e-9));
        if (have_lp && lp.pinned_gbps > 0)
            json_object_set_new(o, "h2d_vs_pinned_peak",
                                json_real((double)h2d / r->decode_s * 1e-9 / lp.pinned_gbps));
        if (offload_tps > 0)
            json_object_set_new(o, "ratio_vs_offload", json_real(tps / offload_tps));
        if (rekv_pipeline_keeps_act(&r->cfg))
            json_object_set_new(o, "split", json_integer(r->cfg.split));
        if (mlist[i] == REKV_MODE_HYBRID)
            json_object_set_new(o, "ratio", json_pack("[i, i]", r->cfg.kv_parts, r->cfg.act_parts));
        if (mlist[i] == REKV_MODE_CLO) {
            uint64_t hits = r->counters.head_hits, hm = hits + r->counters.head_misses;
            json_object_set_new(o, "head_hits", json_integer((json_int_t)hits));
            json_object_set_new(o, "head_misses", json_integer((json_int_t)(hm - hits)));
            json_object_set_new(o, "hit_ratio", json_real(hm ? (double)hits / (double)hm : 0.0));
        }
        if (ref >= 0)
            json_object_set_new(o, "tokens_match_resident",
                                json_boolean(memcmp(r->tokens, res[ref].tokens,
                                                    sizeof(int32_t) * (size_t)B * N) == 0));
        json_array_append_new(arr, o);
    }
    json_t *out = json_pack(
        "{s:s, s:s, s:{s:i, s:i, s:i, s:i, s:i, s:i}, s:i, s:i, s:i, s:f, s:f, s:b, s:s, "
        "s:i, s:s, s:o}",
        "bench", "decode", "backend", res[0].backend, "model", "layers", cfg->n_layers, "hidden",
        cfg->hidden, "heads", cfg->n_heads, "kv_heads", cfg->n_kv_heads, "ffn", cfg->ffn, "vocab",
        cfg->vocab, "batch", (int)B, "prompt_len", (int)S, "gen_len", (int)N, "link_gbps",
        po.link.gbps, "link_latency_us", po.link.latency_us, "offload_weights",
        po.cfg.offload_weights, "schedule", po.cfg.schedule == REKV_SCHED_ROW ? "row" : "column",
        "gpu_batches", po.cfg.gpu_batches, "cache_dtype", rekv_dtype_name(po.cfg.cache_dtype),
        "modes", arr);
    json_object_set_new(out, "push", json_boolean(po.cfg.push));
    /* the prompts' CRC32C (int32 ids, prompt after prompt): deploy/hf_bench.py prints its own */
    uint32_t pcrc = 0;
    for (long b = 0; b < B; b++)
        pcrc = rekv_crc32c(pcrc, prompts[b], sizeof(int32_t) * (size_t)S);
    json_object_set_new(out, "prompts_crc32c", json_integer(pcrc));
    json_object_set_new(out, "weight_dtype",
                        json_string(rekv_dtype_name(rekv_engine_weight_dtype(eng))));
    if (dp.copy_gbps > 0)
        json_object_set_new(
            out, "device_peak",
            json_pack("{s:I, s:f, s:i, s:f}", "copy_bytes", (json_int_t)dp.copy_bytes, "copy_gbps",
                      dp.copy_gbps, "gemm_rows", dp.gemm_rows, "gemm_flops_per_s", dp.gemm_flops));
    if (have_lp)
        json_object_set_new(out, "link_peak",
                            json_pack("{s:I, s:f, s:f, s:f}", "copy_bytes", (json_int_t)lp.bytes,
                                      "h2d_gbps_pinned", lp.pinned_gbps, "h2d_gbps_arena",
                                      lp.arena_gbps, "h2d_gbps_pageable", lp.pageable_gbps));
    char *str = json_dumps(out, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", str);
    free(str);
    json_decref(out);
    rc = 0;
out:
    for (int i = 0; i < n_modes; i++)
        free(res[i].tokens), free(res[i].step);
    if (prompts)
        for (long b = 0; b < B; b++)
            free(prompts[b]);
    free(prompts);
    rekv_engine_free(eng);
    rekv_model_close(model);
    return rc;
}

int cli_bench(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "forward") == 0)
        return bench_forward(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "decode") == 0)
        return bench_decode(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "serve") == 0)
        return cli_bench_serve(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "kvstore") == 0)
        return rekv_kvstore_bench_main(argc - 1, argv + 1);
    int help = argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0);
    fprintf(help ? stdout : stderr,
            "usage: rekv bench forward|decode|serve|kvstore [options] --json\n"
            "Run `rekv bench BENCH --help` for a benchmark's options.\n");
    return help ? 0 : 2;
}
