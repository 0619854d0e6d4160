/* cli_bench_forward.c — `rekv bench forward`: the engine's forward pass on the cpu backend, prefill
 * and decode per batch size, in tokens/s and GFLOP/s next to OpenBLAS's GFLOP/s at the model's
 * shapes, and the GEMM alone (rekv's with fp32 and fp16 weights beside OpenBLAS), measured in the
 * same run; the one-row GEMM's GB/s over weights that are not in cache, in the engine's tile
 * layout and row-major, beside a plain read of as many bytes (issue 42: decode at one row is
 * bound by the memory) and the same over quantized blocks (Q8_0, Q4_0, Q4_K, Q6_K), the weight
 * bytes a decode step reads per second (f16 or a quantized GGUF's blocks, as held), and the
 * process's peak resident memory. Prints one JSON object. */
#include <getopt.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/dtype.h"
#include "common/progress.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_bench.h"
#include "gpuworker/blas.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/cpu_qgemm.h"
#include "gpuworker/gpuworker.h"
#include "loader/gguf.h"
#include "loader/loader.h"

/* GFLOP/s at y[m][n] = x[m][k]·W[n][k]^T — the shape a linear layer runs — of OpenBLAS (sgemm,
 * or at one row sgemv: OpenBLAS's sgemm is at its worst there, so it would flatter rekv) or of
 * rekv's row-invariant GEMM with fp32 or 16-bit weights. */
typedef enum { GEMM_BLAS, GEMM_REKV_F32, GEMM_REKV_F16 } gemm_impl;

static const rekv_blas *g_blas; /* OpenBLAS, loaded by cli_bench_forward (gpuworker/blas.h) */

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
        qsort(g[i], REPS, sizeof(double), cli_cmp_double);
    double b = g[GEMM_BLAS][REPS / 2], f = g[GEMM_REKV_F32][REPS / 2],
           h = g[GEMM_REKV_F16][REPS / 2];
    return json_pack("{s:i, s:i, s:i, s:s, s:f, s:f, s:f, s:f, s:f}", "rows", m, "n", n, "k", k,
                     "blas", m == 1 ? "sgemv" : "sgemm", "blas_gflops", b, "rekv_f32_gflops", f,
                     "rekv_f16_gflops", h, "rekv_f32_vs_blas", b > 0 ? f / b : 0,
                     "rekv_f16_vs_blas", b > 0 ? h / b : 0);
}

/* ------------------------------------------------------------------ the one-row GEMM's GB/s */

/* Weights the one-row GEMM streams per measurement: 8x the 32 MiB last-level cache of the machine
 * the issue measured on, so the copies it cycles through come from memory. */
enum { GEMV_BYTES = 256 << 20, GEMV_REPS = 5, READ_MAX_CHUNKS = 64 };

/* A plain read of words [0, n) in chunks claimed by the GEMM's pool: the yardstick. */
typedef struct read_job {
    const uint64_t *p;
    size_t n;
    int chunks;
    uint64_t sum[READ_MAX_CHUNKS]; /* kept, so the reads are not optimised away */
} read_job;

static void read_chunk(void *arg, int c, int slot)
{
    (void)slot;
    read_job *r = arg;
    size_t a = r->n * (size_t)c / (size_t)r->chunks, b = r->n * (size_t)(c + 1) / (size_t)r->chunks;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = a; i + 4 <= b; i += 4)
        s0 += r->p[i], s1 += r->p[i + 1], s2 += r->p[i + 2], s3 += r->p[i + 3];
    r->sum[c] = s0 ^ s1 ^ s2 ^ s3;
}

/* One pass over the copies (n_w of them, `per` weights each) in seconds: 0 a plain read, 1 the
 * GEMM over the row-major copies, 2 over the tiled ones. */
static double gemv_pass(int what, const uint16_t *rm, const uint16_t *tl, int n_w, size_t per,
                        const float *x, float *y, int n, int k)
{
    uint64_t t0 = rekv_now_ns();
    if (what == 0) {
        int threads = cpu_gemm_threads();
        read_job r = {(const uint64_t *)rm, per * (size_t)n_w / 4, threads * 4, {0}};
        if (r.chunks > READ_MAX_CHUNKS)
            r.chunks = READ_MAX_CHUNKS;
        cpu_pool_run(read_chunk, &r, r.chunks, threads);
    }
    for (int c = 0; what > 0 && c < n_w; c++)
        (what == 1 ? cpu_gemm_rowinv : cpu_gemm_rowinv_tiled)(
            y, x, (what == 1 ? rm : tl) + (size_t)c * per, REKV_DTYPE_F16, NULL, 1, n, k);
    return (double)(rekv_now_ns() - t0) * 1e-9;
}

/* The one-row f16 GEMM at shape [n][k] in GB/s of weights read, row-major and tiled, beside a
 * plain read of as many bytes, on the GEMM's threads: medians of GEMV_REPS passes of each,
 * interleaved (the machine's other load meets all three alike). NULL when out of memory. */
static json_t *gemv_bandwidth(int n, int k)
{
    size_t per = (size_t)n * (size_t)k, bytes = per * sizeof(uint16_t);
    int n_w = (int)((GEMV_BYTES + bytes - 1) / bytes);
    size_t all = bytes * (size_t)n_w;
    uint16_t *rm = malloc(all), *tl = malloc(all);
    void *scratch = malloc(cpu_tile_scratch_bytes(REKV_DTYPE_F16, k));
    float *x = malloc(sizeof(float) * (size_t)k), *y = malloc(sizeof(float) * (size_t)n);
    json_t *o = NULL;
    if (rm && tl && scratch && x && y) {
        for (size_t i = 0; i < per * (size_t)n_w; i++)
            rm[i] = rekv_f32_to_f16((float)(i % 5) * 0.1f);
        for (int i = 0; i < k; i++)
            x[i] = (float)(i % 7) * 0.1f;
        memcpy(tl, rm, all);
        for (int c = 0; c < n_w; c++)
            cpu_tile_pack(tl + (size_t)c * per, REKV_DTYPE_F16, n, k, scratch);
        double t[3][GEMV_REPS];
        for (int i = 0; i < 3; i++) /* warm: every page touched, the pool's threads started */
            gemv_pass(i, rm, tl, n_w, per, x, y, n, k);
        for (int r = 0; r < GEMV_REPS; r++)
            for (int i = 0; i < 3; i++)
                t[i][r] = gemv_pass(i, rm, tl, n_w, per, x, y, n, k);
        double g[3];
        for (int i = 0; i < 3; i++) {
            qsort(t[i], GEMV_REPS, sizeof(double), cli_cmp_double);
            g[i] = (double)all / t[i][GEMV_REPS / 2] * 1e-9;
        }
        o = json_pack("{s:i, s:i, s:I, s:i, s:f, s:f, s:f, s:f, s:f}", "n", n, "k", k, "bytes",
                      (json_int_t)all, "threads", cpu_gemm_threads(), "read_gbps", g[0],
                      "row_major_gbps", g[1], "tiled_gbps", g[2], "row_major_vs_read", g[1] / g[0],
                      "tiled_vs_read", g[2] / g[0]);
    }
    free(rm), free(tl), free(scratch), free(x), free(y);
    return o;
}

/* ------------------------------------------------------------------ quantized one-row GEMM */

/* The one-row GEMM over quantized weights (cpu_qgemm_rowinv) at shape [n][k], as many weights
 * as gemv_bandwidth's f16 copies (GEMV_BYTES of f16), in random blocks with sane scales: GB/s of
 * the blocks read and billions of weights per second, medians of GEMV_REPS passes, one entry per
 * type (Q8_0, Q4_0, Q4_K, Q6_K); NULL when out of memory or k is not whole blocks. */
static json_t *gemv_quant(int n, int k)
{
    static const uint32_t types[] = {REKV_GGML_Q8_0, REKV_GGML_Q4_0, REKV_GGML_Q4_K,
                                     REKV_GGML_Q6_K};
    size_t per = (size_t)n * (size_t)k;
    int n_w = (int)((GEMV_BYTES + per * 2 - 1) / (per * 2));
    float *x = malloc(sizeof(float) * (size_t)k), *y = malloc(sizeof(float) * (size_t)n);
    json_t *arr = json_array();
    for (int i = 0; x && i < k; i++)
        x[i] = (float)(i % 7) * 0.1f;
    for (size_t ti = 0; x && y && arr && ti < sizeof(types) / sizeof(types[0]); ti++) {
        uint32_t be, bb;
        rekv_ggml_type_block(types[ti], &be, &bb);
        if ((size_t)k % be)
            continue;
        size_t row = cpu_qgemm_row_bytes(types[ti], k), bytes = row * (size_t)n;
        size_t all = bytes * (size_t)n_w, blocks = all / bb;
        uint8_t *w = malloc(all);
        if (w == NULL)
            break;
        uint32_t r = 1;
        for (size_t i = 0; i < all; i++)
            w[i] = (uint8_t)((r = r * 1103515245u + 12345u) >> 16);
        uint16_t d = rekv_f32_to_f16(0.01f);
        size_t d_at = types[ti] == REKV_GGML_Q6_K ? 208 : 0; /* the f16 scale(s) of a block */
        for (size_t b = 0; b < blocks; b++) {
            memcpy(w + b * bb + d_at, &d, 2);
            if (types[ti] == REKV_GGML_Q4_K) /* dmin */
                memcpy(w + b * bb + 2, &d, 2);
        }
        double t[GEMV_REPS + 1];
        for (int rep = 0; rep <= GEMV_REPS; rep++) { /* the first warms up */
            uint64_t t0 = rekv_now_ns();
            for (int c = 0; c < n_w; c++)
                (void)cpu_qgemm_rowinv(y, x, w + (size_t)c * bytes, types[ti], NULL, 1, n, k);
            t[rep] = (double)(rekv_now_ns() - t0) * 1e-9;
        }
        free(w);
        qsort(t + 1, GEMV_REPS, sizeof(double), cli_cmp_double);
        double sec = t[1 + GEMV_REPS / 2];
        json_array_append_new(arr, json_pack("{s:s, s:I, s:f, s:f}", "type",
                                             rekv_ggml_type_name(types[ti]), "bytes",
                                             (json_int_t)all, "gbps", (double)all / sec * 1e-9,
                                             "gweights_per_s", (double)per * n_w / sec * 1e-9));
    }
    free(x), free(y);
    if (arr && json_array_size(arr) == 0) {
        json_decref(arr);
        return NULL;
    }
    return arr;
}

typedef struct forward_opts {
    const char *model_path;
    const char *batches; /* "1,2,4": the batch sizes */
    long prompt_len, steps;
    long threads; /* the GEMM's threads; 0: the online cpus */
    int json;
    int row_major; /* the engine's weights untiled (rekv_engine_untile): what the layout gives */
} forward_opts;

static void forward_usage(FILE *f)
{
    fprintf(f, "usage: rekv bench forward --model PATH [--batches 1,2,4,8,16,32]\n"
               "                          [--prompt-len S] [--decode-steps N] [--threads T]\n"
               "                          [--row-major] [--json]\n"
               "Prints prefill and decode tokens/s and GFLOP/s per batch size, next to\n"
               "OpenBLAS's GFLOP/s at the model's shapes (sgemm; sgemv at one row), and\n"
               "the GEMM alone (ffn x hidden, the batch's and the prefill's rows): rekv's\n"
               "with fp32 and fp16 weights next to OpenBLAS, medians of 5, same run; the\n"
               "one-row f16 GEMM's GB/s over 256 MiB of weights, tiled and row-major,\n"
               "next to a plain read of the same bytes (gemv_f16), and over as many\n"
               "quantized weights (gemv_quant: Q8_0, Q4_0, Q4_K, Q6_K); the peak resident\n"
               "memory. --threads: the GEMM's threads (default: the online cpus);\n"
               "--row-major: the engine's weights as the file has them, not in the\n"
               "GEMM's tile layout (the same bits; to measure what the layout gives).\n");
}

static int forward_parse(int argc, char **argv, forward_opts *o)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"batches", required_argument, 0, 'b'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"decode-steps", required_argument, 0, 'd'},
                                         {"threads", required_argument, 0, 't'},
                                         {"row-major", no_argument, 0, 'r'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    *o = (forward_opts){.batches = "1,2,4,8,16,32", .prompt_len = 64, .steps = 8};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm':
            o->model_path = optarg;
            break;
        case 'b':
            o->batches = optarg;
            break;
        case 'p':
            if (cli_parse_int("prompt-len", optarg, 1, 1 << 20, &o->prompt_len))
                return 2;
            break;
        case 'd':
            if (cli_parse_int("decode-steps", optarg, 1, 1 << 20, &o->steps))
                return 2;
            break;
        case 't':
            if (cli_parse_int("threads", optarg, 1, 256, &o->threads))
                return 2;
            break;
        case 'r':
            o->row_major = 1;
            break;
        case 'j':
            o->json = 1; /* JSON is the only output; --json also keeps stderr quiet */
            break;
        case 'h':
            forward_usage(stdout);
            return 0;
        default:
            forward_usage(stderr);
            return 2;
        }
    }
    if (cli_no_operands(argc, argv)) {
        forward_usage(stderr);
        return 2;
    }
    if (o->model_path == NULL) {
        fprintf(stderr, "rekv bench forward: --model is required\n");
        return 2;
    }
    return CLI_PARSED;
}

/* Batch size B: a prefill of S tokens per sequence, then `steps` decode steps, timed into
 * *pre_s, *dec_s. Progress steps base + 1 .. base + steps + 1. 0, or -1 with a message printed. */
static int forward_batch(rekv_engine *eng, const rekv_model_config *cfg, int B, int S, long steps,
                         rekv_progress *pr, uint64_t base, double *pre_s, double *dec_s)
{
    rekv_err err = {0};
    rekv_seq **seqs = calloc((size_t)B, sizeof(*seqs));
    rekv_batch_item *items = calloc((size_t)B, sizeof(*items));
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)B * (size_t)S);
    float *logits = malloc(sizeof(float) * (size_t)B * (size_t)cfg->vocab);
    if (!seqs || !items || !toks || !logits) {
        rekv_progress_end(pr);
        fprintf(stderr, "rekv: out of memory\n");
        free(seqs), free(items), free(toks), free(logits);
        return -1;
    }
    uint64_t x = 12345;
    cli_random_tokens(&x, toks, (size_t)B * S, cfg->vocab);
    int ok = 1;
    for (int b = 0; b < B && ok; b++) {
        ok = rekv_seq_create(eng, S + (int)steps, &seqs[b], &err) == 0;
        items[b] =
            (rekv_batch_item){seqs[b], toks + (size_t)b * S, S, 0, logits + (size_t)b * cfg->vocab};
    }
    uint64_t t0 = rekv_now_ns();
    ok = ok && rekv_engine_forward(eng, items, B, &err) == 0;
    uint64_t t1 = rekv_now_ns();
    rekv_progress_update(pr, base + 1, NULL);
    for (long s = 0; s < steps && ok; s++) {
        for (int b = 0; b < B; b++)
            items[b] = (rekv_batch_item){seqs[b], toks + (size_t)b * S + (size_t)s % S, 1, 0,
                                         logits + (size_t)b * cfg->vocab};
        ok = rekv_engine_forward(eng, items, B, &err) == 0;
        rekv_progress_update(pr, base + (uint64_t)s + 2, NULL);
    }
    uint64_t t2 = rekv_now_ns();
    for (int b = 0; b < B; b++)
        rekv_seq_free(seqs[b]);
    free(seqs), free(items), free(toks), free(logits);
    if (!ok) {
        rekv_progress_end(pr);
        fprintf(stderr, "rekv: %s\n", err.msg);
        return -1;
    }
    *pre_s = (double)(t1 - t0) * 1e-9;
    *dec_s = (double)(t2 - t1) * 1e-9;
    return 0;
}

/* Batch size B's entry of "runs": its times (forward_batch) in tokens/s and GFLOP/s, beside
 * OpenBLAS and the GEMM alone at the same shapes (after every forward pass: OpenBLAS's buffers
 * stay resident, and are not the engine's memory). */
static json_t *forward_run(rekv_engine *eng, const rekv_model_config *cfg, int B, int S, long steps,
                           double pre_s, double dec_s)
{
    json_t *run;
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
    run = json_pack("{s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:o}", "batch", B,
                     "prefill_tokens_per_s", (double)B * S / pre_s, "decode_tokens_per_s",
                     (double)B * steps / dec_s, "prefill_gflops", pre_gf, "decode_gflops", dec_gf,
                     "blas_gflops_prefill_shape", sg_pre, "blas_gflops_decode_shape", sg_dec,
                     "prefill_vs_blas", pre_gf / sg_pre, "decode_vs_blas", dec_gf / sg_dec, "gemm",
                     gemm);
    /* each decode step reads every weight once, whatever the batch: the bytes as held (f16, or
     * a quantized file's blocks) over the step's time */
    json_object_set_new(
        run, "decode_weight_gbps",
        json_real((double)rekv_engine_step_weight_bytes(eng) * (double)steps / dec_s * 1e-9));
    return run;
}

int cli_bench_forward(int argc, char **argv)
{
    forward_opts o;
    int prc = forward_parse(argc, argv, &o);
    if (prc != CLI_PARSED)
        return prc;
    int32_t *bs = NULL;
    int n_bs = 0;
    if (cli_parse_ids(o.batches, &bs, &n_bs)) {
        fprintf(stderr, "rekv bench forward: --batches: expected sizes like 1,2,4\n");
        return 2;
    }
    int rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    json_t *runs = json_array();
    if (rekv_blas_load(&g_blas, &err) || rekv_model_open(o.model_path, &model, &err) ||
        rekv_engine_create(model, &eng, &err) || (o.row_major && rekv_engine_untile(eng, &err))) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        goto out;
    }
    if (o.threads > 0)
        cpu_gemm_set_threads((int)o.threads);
    const rekv_model_config *cfg = &model->config;
    if (o.prompt_len + o.steps > cfg->max_pos) {
        fprintf(stderr, "rekv bench forward: prompt-len + decode-steps exceeds the context (%d)\n",
                cfg->max_pos);
        goto out;
    }
    /* progress: each batch size's prefill and decode steps */
    rekv_progress pr;
    rekv_progress_begin(&pr, stderr, rekv_progress_style_for(stderr, o.json), "rekv bench forward",
                        "steps", (uint64_t)n_bs * (uint64_t)(o.steps + 1));
    double *secs = calloc(2 * (size_t)n_bs, sizeof(double));
    if (secs == NULL) {
        rekv_progress_end(&pr);
        fprintf(stderr, "rekv: out of memory\n");
        goto out;
    }
    for (int bi = 0; bi < n_bs; bi++)
        if (bs[bi] > 0 && forward_batch(eng, cfg, bs[bi], (int)o.prompt_len, o.steps, &pr,
                                        (uint64_t)bi * (uint64_t)(o.steps + 1), &secs[2 * bi],
                                        &secs[2 * bi + 1])) {
            free(secs);
            goto out;
        }
    rekv_progress_end(&pr);
    /* the peak of the model's load and the forward passes: the engine's, before any comparison's
     * buffers (OpenBLAS keeps its own once it has run) */
    unsigned long long rss = cli_peak_rss_bytes();
    for (int bi = 0; bi < n_bs; bi++)
        if (bs[bi] > 0)
            json_array_append_new(runs, forward_run(eng, cfg, bs[bi], (int)o.prompt_len, o.steps,
                                                    secs[2 * bi], secs[2 * bi + 1]));
    free(secs);
    double peak = blas_gflops(1024, 1024, 1024, 0.5);
    json_t *gemv = gemv_bandwidth(cfg->ffn, cfg->hidden);
    if (gemv == NULL) {
        fprintf(stderr, "rekv: out of memory for the one-row GEMM's weights\n");
        goto out;
    }
    json_t *out = json_pack(
        "{s:s, s:s, s:{s:i, s:i, s:i, s:i, s:s}, s:i, s:i, s:f, s:i, s:i, s:O}", "bench", "forward",
        "backend", "cpu", "model", "layers", cfg->n_layers, "hidden", cfg->hidden, "ffn", cfg->ffn,
        "vocab", cfg->vocab, "dtype", rekv_dtype_name(cfg->dtype), "prompt_len", (int)o.prompt_len,
        "decode_steps", (int)o.steps, "sgemm_gflops_1024", peak, "rekv_gemm_threads",
        cpu_gemm_threads(), "blas_threads", g_blas->get_num_threads(), "runs", runs);
    json_object_set_new(out, "weights_layout", json_string(o.row_major ? "row-major" : "tiled"));
    json_object_set_new(out, "weight_elem_bytes", json_real(rekv_engine_weight_elem_bytes(eng)));
    json_object_set_new(out, "step_weight_bytes",
                        json_integer((json_int_t)rekv_engine_step_weight_bytes(eng)));
    json_object_set_new(out, "peak_rss_bytes", json_integer((json_int_t)rss));
    json_object_set_new(out, "gemv_f16", gemv);
    json_t *gq = gemv_quant(cfg->ffn, cfg->hidden);
    if (gq)
        json_object_set_new(out, "gemv_quant", gq);
    char *s = json_dumps(out, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", s);
    free(s);
    json_decref(out);
    rc = 0;
out:
    json_decref(runs);
    free(bs);
    rekv_engine_free(eng);
    rekv_model_close(model);
    return rc;
}
