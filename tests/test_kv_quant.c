/* test_kv_quant.c — the int8/int4 KV cache (--cache-dtype int8|int4, issue 39): the cpu
 * kv_scatter kernel's codes and scales, and the dequantized rows the attention reads, equal an
 * independent numpy implementation of the documented scheme (tests/kv_quant_ref.py) bit for bit,
 * edge cases included (groups of zeros, ties, huge and tiny values); every mode over a quantized
 * cache gives resident's logits over the same cache bit for bit (kvpr, act and hybrid recompute
 * K,V from fp32 activations and quantize them as resident does: the same codes; clo's head caches
 * sum the same rows in another order);
 * the store's arena holds an int4 token in at most 0.3x an f16 token's bytes; an unknown cache
 * dtype is refused with a clear error by the parser, the store and the CLI. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cost.h"
#include "common/dtype.h"
#include "coordinator/co_plan.h"
#include "coordinator/planner.h"
#include "gpuworker/kernels.h"
#include "gpuworker/kvlayout.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

#define REF "/usr/bin/python3 tests/kv_quant_ref.py"

static uint64_t g_x = 7;
static float urand(void) /* uniform in [-1, 1) */
{
    g_x = g_x * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_x >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

/* n rows of hd: random rows at magnitudes 1e-3..1e3, then the edge cases */
static float *test_rows(int n, int hd)
{
    float *x = malloc(sizeof(float) * (size_t)n * (size_t)hd);
    ck_assert_ptr_nonnull(x);
    for (int r = 0; r < n; r++) {
        float *row = x + (size_t)r * (size_t)hd, mag = powf(10.0f, (float)(r % 7 - 3));
        for (int j = 0; j < hd; j++)
            row[j] = urand() * mag;
        switch (r % 16) {
        case 1: /* a row of zeros */
            memset(row, 0, sizeof(float) * (size_t)hd);
            break;
        case 2: /* its first group zero, the rest not */
            memset(row, 0, sizeof(float) * (size_t)rekv_kvq_group(hd));
            break;
        case 3: /* int8 ties: max 127 so s = 1, values k + 0.5 */
        case 4: /* int4 ties: max 7 so s = 1 */
            for (int j = 0; j < hd; j++)
                row[j] = (float)(j % 9 - 4) + 0.5f;
            row[0] = r % 16 == 3 ? 127.0f : 7.0f;
            break;
        case 5: /* huge: the scale saturates at f16's largest */
            row[hd / 2] = 3.0e30f;
            row[1] = -1.0e7f;
            break;
        case 6: /* tiny: the scale is subnormal in f16, or 0 */
            for (int j = 0; j < hd; j++)
                row[j] = urand() * (r % 32 < 16 ? 1e-6f : 1e-12f);
            break;
        case 7: /* one sign only, max at the last element */
            for (int j = 0; j < hd; j++)
                row[j] = -fabsf(row[j]);
            row[hd - 1] = -2.0f * mag;
            break;
        }
    }
    return x;
}

static void write_floats(const char *path, const float *x, size_t n)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(x, sizeof(float), n, f), n);
    ck_assert_int_eq(fclose(f), 0);
}

/* The kv_scatter kernel of the cpu backend writes n rows (K: x's first n, V: the next n) of one KV
 * head into a buffer of dtype dt; each K and V row's bytes and its dequantized values equal
 * kv_quant_ref.py's. */
static void check_kernel(rekv_dtype dt, int hd, int n)
{
    rekv_err err = {0};
    rekv_backend *be = NULL;
    ck_assert_msg(rekv_backend_cpu_create(NULL, &be, &err) == 0, "%s", err.msg);
    const rekv_kernel_iface *k = rekv_kernels_of(be);
    rekv_stream *s = NULL;
    ck_assert_msg(be->iface->stream_create(be, "q", &s, &err) == 0, "%s", err.msg);
    float *x = test_rows(2 * n, hd);
    size_t rb = rekv_kv_row_bytes(dt, hd);
    uint8_t *kv = calloc(1, rekv_kv_buffer_bytes(1, hd, n, rb));
    int32_t *seq = calloc((size_t)n, sizeof(int32_t)), *pos = malloc(sizeof(int32_t) * (size_t)n);
    ck_assert(kv && seq && pos);
    for (int t = 0; t < n; t++)
        pos[t] = t;
    rekv_attn_seq d = {.kv = kv};
    k->kv_scatter(s, x, x + (size_t)n * hd, n, seq, pos, NULL, &d, 1, hd, dt);
    ck_assert_msg(be->iface->stream_sync(s, &err) == 0, "%s", err.msg);

    char *dir = tu_tmpdir(), in[4200], codes[4200], deq[4200], *cmd = NULL, *out = NULL;
    snprintf(in, sizeof(in), "%s/in", dir);
    snprintf(codes, sizeof(codes), "%s/codes", dir);
    snprintf(deq, sizeof(deq), "%s/deq", dir);
    write_floats(in, x, (size_t)2 * n * hd);
    ck_assert_int_gt(asprintf(&cmd, REF " %s %d %s %s %s", dt == REKV_DTYPE_I8 ? "int8" : "int4",
                              hd, in, codes, deq),
                     0);
    ck_assert_msg(tu_run(cmd, &out) == 0, "%s failed", cmd);
    size_t nc = 0, nd = 0;
    uint8_t *want = (uint8_t *)tu_read_file(codes, &nc);
    float *want_x = (float *)tu_read_file(deq, &nd);
    ck_assert_uint_eq(nc, (size_t)2 * n * rb);
    ck_assert_uint_eq(nd, sizeof(float) * (size_t)2 * n * hd);
    float got_x[hd];
    for (int r = 0; r < 2 * n; r++) {
        int t = r % n;
        size_t off = rekv_kv_off(rekv_kv_row(1, hd, 0, t), hd, rb) +
                     (r >= n ? rekv_kv_off(rekv_kv_v_shift(1, hd), hd, rb) : 0);
        const uint8_t *got = kv + off, *w = want + (size_t)r * rb;
        for (size_t b = 0; b < rb; b++)
            ck_assert_msg(got[b] == w[b],
                          "%s hd %d row %d (%s of position %d): byte %zu is %02x, numpy's %02x",
                          rekv_dtype_name(dt), hd, r, r >= n ? "V" : "K", t, b, got[b], w[b]);
        rekv_kv_row_to_f32(got_x, got, dt, hd);
        ck_assert_msg(memcmp(got_x, want_x + (size_t)r * hd, sizeof(got_x)) == 0,
                      "%s hd %d row %d: dequantized row differs from numpy's", rekv_dtype_name(dt),
                      hd, r);
    }
    free(want);
    free(want_x);
    free(cmd);
    free(out);
    tu_rmrf(dir);
    free(dir);
    free(x);
    free(kv);
    free(seq);
    free(pos);
    be->iface->stream_destroy(s);
    rekv_backend_destroy(be);
}

START_TEST(kernel_codes_equal_numpy)
{
    static const int hds[] = {8, 32, 64, 96, 6};
    for (size_t i = 0; i < sizeof(hds) / sizeof(hds[0]); i++) {
        check_kernel(REKV_DTYPE_I8, hds[i], 48);
        check_kernel(REKV_DTYPE_I4, hds[i], 48);
    }
}
END_TEST

/* ---------------------------------------------------------------- modes against resident */

/* Mode m at its exact limit (test_modes.c's limit_config): a split, a KV:ACT pattern, a device
 * part, every token selected, every head cache missing. */
static void limit_config(rekv_mode m, rekv_dtype dt, int device_tokens, const rekv_skew *sk,
                         const rekv_heads *hp, rekv_pipeline_config *cfg)
{
    const rekv_mode_info *mi = rekv_mode_info_of(m);
    rekv_pipeline_config_defaults(cfg);
    cfg->mode = m;
    cfg->cache_dtype = dt;
    cfg->split = mi->split != REKV_SPLIT_NONE ? 7 : 0;
    cfg->kv_parts = 2, cfg->act_parts = 1;
    cfg->device_tokens = mi->device_part ? device_tokens : 0;
    cfg->act_gpu_blocks = mi->act_gpu && device_tokens ? 1 : 0;
    if (mi->speculates) {
        cfg->skew = sk;
        cfg->max_fraction = 1;
        cfg->select = mi->head_caches ? REKV_SELECT_SPECULATE : REKV_SELECT_ALL;
    }
    if (mi->head_caches) {
        cfg->heads = hp;
        cfg->eta = 1;
    }
}

/* A prefill of prompts, then `steps` greedy decode steps: every step's logits. */
static float *run_mode(tu_fixture *f, const rekv_pipeline_config *cfg, int B, const int *lens,
                       int32_t *const *prompts, int steps)
{
    rekv_err err = {0};
    rekv_pipeline *p = NULL;
    int V = f->m->config.vocab;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be, rekv_mode_streams(cfg->mode) ? f->store : NULL,
                                       cfg, &p, &err) == 0,
                  "%s: %s", rekv_mode_name(cfg->mode), err.msg);
    float *logits = malloc(sizeof(float) * (size_t)(steps + 1) * (size_t)B * (size_t)V);
    rekv_pseq *seqs[4];
    rekv_pipe_item items[4];
    int32_t next[4];
    ck_assert(B <= 4 && logits != NULL);
    for (int s = 0; s <= steps; s++) {
        float *out = logits + (size_t)s * (size_t)B * (size_t)V;
        for (int i = 0; i < B; i++) {
            if (s == 0)
                ck_assert_msg(rekv_pseq_create(p, lens[i] + steps, &seqs[i], &err) == 0, "%s",
                              err.msg);
            else
                next[i] = rekv_argmax(out - (size_t)B * V + (size_t)i * V, V);
            items[i] = (rekv_pipe_item){.seq = seqs[i],
                                        .tokens = s == 0 ? prompts[i] : &next[i],
                                        .n_tokens = s == 0 ? lens[i] : 1,
                                        .logits = out + (size_t)i * V};
        }
        ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s step %d: %s",
                      rekv_mode_name(cfg->mode), s, err.msg);
    }
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
    return logits;
}

/* Every mode over a cache of dtype dt against resident over the same dtype. */
static void check_modes(const char *path, rekv_dtype dt)
{
    tu_fixture f;
    tu_fixture_open(&f, path, dt, "cpu"); /* a store that can push */
    rekv_skew sk;
    rekv_heads hp;
    tu_skew_calibrate(&f, &sk);
    tu_heads_uniform(&f, 1.0, &hp);
    enum { B = 3, STEPS = 4 };
    int lens[B] = {90, 40, 75};
    int32_t *prompts[B];
    for (int b = 0; b < B; b++) {
        prompts[b] = malloc(sizeof(int32_t) * (size_t)lens[b]);
        for (int i = 0; i < lens[b]; i++) {
            g_x = g_x * 6364136223846793005ull + 1442695040888963407ull;
            prompts[b][i] = (int32_t)((g_x >> 33) % (uint64_t)f.m->config.vocab);
        }
    }
    size_t n = (size_t)(STEPS + 1) * B * (size_t)f.m->config.vocab;
    rekv_pipeline_config cfg;
    limit_config(REKV_MODE_RESIDENT, dt, 0, &sk, &hp, &cfg);
    float *ref = run_mode(&f, &cfg, B, lens, prompts, STEPS);
    for (int m = 0; m < REKV_MODE_COUNT; m++)
        for (int dev = 0; dev <= 40; dev += 20) {
            const rekv_mode_info *mi = rekv_mode_info_of((rekv_mode)m);
            /* 20: a device part; 40: none, the store pushing the KV rows (the exact streaming
             * modes) */
            if ((dev == 20 && !mi->device_part && !mi->act_gpu) ||
                (dev == 40 && (mi->store == REKV_STORE_NONE || mi->approximate)))
                continue;
            limit_config((rekv_mode)m, dt, dev == 20 ? dev : 0, &sk, &hp, &cfg);
            cfg.push = dev == 40;
            const char *how = cfg.push ? "pushed" : dev ? "device part 20" : "pulled";
            float *got = run_mode(&f, &cfg, B, lens, prompts, STEPS);
            double worst = 0;
            for (size_t k = 0; k < n; k++) {
                if (mi->head_caches) /* the same rows in another order */
                    worst = fmax(worst, fabs((double)got[k] - ref[k]) / (1 + fabs((double)ref[k])));
                else if (memcmp(&got[k], &ref[k], sizeof(float)) != 0)
                    ck_abort_msg("%s, %s cache (%s): logit %zu is %.9g, resident's %.9g", mi->name,
                                 rekv_dtype_name(dt), how, k, (double)got[k], (double)ref[k]);
            }
            ck_assert_msg(worst < 1e-5, "%s, %s cache: logits differ by %g", mi->name,
                          rekv_dtype_name(dt), worst);
            free(got);
        }
    free(ref);
    for (int b = 0; b < B; b++)
        free(prompts[b]);
    rekv_heads_free(&hp);
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
}

START_TEST(modes_match_resident_stories)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    check_modes(path, REKV_DTYPE_I8);
    check_modes(path, REKV_DTYPE_I4);
}
END_TEST

/* A synthetic GQA Llama of head dim 64 (two groups of 32 a row), written to dir/m. */
static void synth_llama(const char *dir, char *path, size_t len)
{
    rekv_synth_spec spec = {REKV_ARCH_LLAMA, 2, 256, 4, 2, 320, 300, 1100, REKV_DTYPE_F32, 5, 0};
    snprintf(path, len, "%s/m", dir);
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(&spec, path, &err) == 0, "%s", err.msg);
}

START_TEST(modes_match_resident_gqa64)
{
    char *dir = tu_tmpdir(), path[4200];
    synth_llama(dir, path, sizeof(path));
    check_modes(path, REKV_DTYPE_I8);
    check_modes(path, REKV_DTYPE_I4);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* Quantized blocks spilled to disk and read back, a step in layer windows (the batch's KV 4x an
 * arena of 28 slots): offload and kvpr over int4 still give resident's logits bit for bit. */
START_TEST(spilled_blocks_read_back_exact)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    enum { B = 4, STEPS = 50 };
    int lens[B] = {20, 9, 33, 14};
    int32_t *prompts[B];
    tu_fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_I4, NULL);
    for (int b = 0; b < B; b++) {
        prompts[b] = malloc(sizeof(int32_t) * (size_t)lens[b]);
        for (int i = 0; i < lens[b]; i++)
            prompts[b][i] = (int32_t)((b * 131 + i * 17) % f.m->config.vocab);
    }
    size_t n = (size_t)(STEPS + 1) * B * (size_t)f.m->config.vocab;
    rekv_pipeline_config cfg;
    limit_config(REKV_MODE_RESIDENT, REKV_DTYPE_I4, 0, NULL, NULL, &cfg);
    float *ref = run_mode(&f, &cfg, B, lens, prompts, STEPS);
    tu_fixture_close(&f);
    static const rekv_mode modes[] = {REKV_MODE_OFFLOAD, REKV_MODE_KVPR};
    for (size_t m = 0; m < 2; m++) {
        tu_fixture_open_host(&f, path, REKV_DTYPE_I4, NULL, 4096 + 28 * 4096);
        limit_config(modes[m], REKV_DTYPE_I4, 0, NULL, NULL, &cfg);
        cfg.gpu_batches = 4; /* a unit is one sequence's layer: it fits beside the next window */
        float *got = run_mode(&f, &cfg, B, lens, prompts, STEPS);
        ck_assert_msg(memcmp(got, ref, n * sizeof(float)) == 0,
                      "%s over int4 on a small arena: the logits differ from resident's",
                      rekv_mode_name(modes[m]));
        rekv_kv_stats ks;
        rekv_err err = {0};
        ck_assert_msg(rekv_kvstore_stats(f.store, &ks, &err) == 0, "%s", err.msg);
        ck_assert_msg(ks.bytes_spilled > 0 && ks.bytes_read_back > 0, "%s: nothing spilled",
                      rekv_mode_name(modes[m]));
        free(got);
        tu_fixture_close(&f);
    }
    free(ref);
    for (int b = 0; b < B; b++)
        free(prompts[b]);
}
END_TEST

/* ---------------------------------------------------------------- bytes in the arena */

/* The store's used bytes per token of one offloaded sequence of n tokens (whole blocks). */
static double arena_bytes_per_token(const char *path, rekv_dtype dt, int n)
{
    tu_fixture f;
    tu_fixture_open(&f, path, dt, NULL);
    rekv_err err = {0};
    rekv_kv_stats before, after;
    ck_assert_msg(rekv_kvstore_stats(f.store, &before, &err) == 0, "%s", err.msg);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_OFFLOAD;
    cfg.cache_dtype = dt;
    rekv_pipeline *p = NULL;
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err) == 0, "%s", err.msg);
    rekv_pseq *s = NULL;
    ck_assert_msg(rekv_pseq_create(p, n, &s, &err) == 0, "%s", err.msg);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n);
    float *logits = malloc(sizeof(float) * (size_t)f.m->config.vocab);
    for (int i = 0; i < n; i++)
        tok[i] = i % f.m->config.vocab;
    rekv_pipe_item it = {.seq = s, .tokens = tok, .n_tokens = n, .logits = logits};
    ck_assert_msg(rekv_pipeline_step(p, &it, 1, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_kvstore_stats(f.store, &after, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(after.host_kv - before.host_kv,
                      (uint64_t)f.m->config.n_layers * (uint64_t)(n / REKV_KV_BLOCK_TOKENS));
    /* a block's bytes are its real size: K and V rows of codes and scales */
    ck_assert_uint_eq(after.kv_slot_bytes, 2ull * (uint64_t)f.m->config.n_kv_heads *
                                               REKV_KV_BLOCK_TOKENS *
                                               rekv_kv_row_bytes(dt, f.m->config.head_dim));
    double per = (double)(after.host_used_bytes - before.host_used_bytes) / n;
    rekv_pseq_free(s);
    rekv_pipeline_free(p);
    free(tok);
    free(logits);
    tu_fixture_close(&f);
    return per;
}

/* An OPT-6.7B-like attention width (16 heads of 128, one layer), so that blocks are whole pages
 * as a real model's are: an int4 KV block 36 KiB, f16 128 KiB (a small model's blocks are rounded
 * up to a 4 KiB page each, which no cache dtype changes). */
START_TEST(int4_arena_bytes_per_token)
{
    char *dir = tu_tmpdir(), path[4200];
    rekv_synth_spec spec = {REKV_ARCH_LLAMA, 1, 2048, 16, 16, 64, 300, 256, REKV_DTYPE_F16, 5, 0};
    snprintf(path, sizeof(path), "%s/m", dir);
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(&spec, path, &err) == 0, "%s", err.msg);
    double f16 = arena_bytes_per_token(path, REKV_DTYPE_F16, 64);
    double i8 = arena_bytes_per_token(path, REKV_DTYPE_I8, 64);
    double i4 = arena_bytes_per_token(path, REKV_DTYPE_I4, 64);
    ck_assert_msg(f16 > 0 && i4 <= 0.3 * f16, "int4 %.1f bytes per token, f16 %.1f", i4, f16);
    ck_assert_msg(i8 <= 0.55 * f16, "int8 %.1f bytes per token, f16 %.1f", i8, f16);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- the planner's prices */

/* The planner prices an int8/int4 KV row at its real bytes (codes and scales) and activations at
 * fp32 beside it: OPT-6.7B's shape (hidden 4096, 32 heads of 128) */
START_TEST(planner_prices_real_bytes)
{
    const int64_t H = 4096, KV = 4096;
    double f16 = rekv_kv_elem_bytes(REKV_DTYPE_F16, 128),
           i8 = rekv_kv_elem_bytes(REKV_DTYPE_I8, 128), i4 = rekv_kv_elem_bytes(REKV_DTYPE_I4, 128);
    ck_assert(f16 == 2.0 && i8 == 1.0625 && i4 == 0.5625); /* 128 + 8 and 64 + 8 bytes a row */
    rekv_hybrid_params hp;
    rekv_plan_hybrid_params_for_batch(&hp, H, KV, 32, i4, 0, 64);
    ck_assert(hp.kv_block_bytes == 2.0 * KV * 0.5625 * REKV_PLAN_BLOCK_TOKENS);
    ck_assert(hp.act_block_bytes == (double)H * 4.0 * REKV_PLAN_BLOCK_TOKENS);
    rekv_plan_hybrid_params_for_batch(&hp, H, KV, 32, f16, 0, 64);
    ck_assert(hp.kv_block_bytes == 2.0 * KV * 2.0 * REKV_PLAN_BLOCK_TOKENS);
    ck_assert(hp.act_block_bytes == (double)H * 2.0 * REKV_PLAN_BLOCK_TOKENS);
    /* a kvpr split: the KV suffix moves at the real bytes, so int4 moves 0.28x f16's; the split
     * recomputes nothing where a K+V row is cheaper than an fp32 activation row */
    rekv_cost_profile prof = {.h2d_bw = 25e9, .gemm_flops = 50e12};
    rekv_kvpr_params p = {.s = 2048, .b = 8, .hidden = H, .kv_dim = KV, .elem_bytes = f16};
    rekv_kvpr_split a, b;
    rekv_plan_kvpr_eval(&prof, &p, 0, &a);
    p.elem_bytes = i4;
    rekv_plan_kvpr_eval(&prof, &p, 0, &b);
    ck_assert_msg(b.bytes_kv <= 0.3 * a.bytes_kv, "%g vs %g", b.bytes_kv, a.bytes_kv);
    rekv_plan_kvpr_eval(&prof, &p, 100, &b);
    ck_assert(b.bytes_x == 8.0 * 100 * H * 4.0);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_plan_kvpr_solve(&prof, &p, &b, &err), 0);
    ck_assert_int_eq(b.l, 0);
    /* the coordinator's: a worker's Hello says its row's bytes (an older one, whole elements) */
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = 2e9;
    cp.gemm_flops = 1e12;
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.mode = (char *)"offload";
    h.profile = &cp;
    h.hidden = h.kv_dim = h.q_dim = 4096;
    h.n_layers = 32;
    h.head_dim = 128;
    h.cache_elem_bytes = 4;
    h.cache_row_bytes = (uint32_t)rekv_kv_row_bytes(REKV_DTYPE_I4, 128);
    h.layer_params = 12ull * 4096 * 4096;
    co_plan_state ps;
    co_plan_init(&ps, &h);
    ck_assert(ps.elem_bytes == 0.5625);
    h.cache_row_bytes = 0;
    h.cache_elem_bytes = 2;
    co_plan_init(&ps, &h);
    ck_assert(ps.elem_bytes == 2.0);
}
END_TEST

/* ---------------------------------------------------------------- side by side in one bench */

/* rekv bench decode runs offload at the process's cache dtype and at int4 (RUN:DTYPE) side by
 * side: each run reports its dtype, and int4's KV bytes per token are f32's times the rows' ratio
 * (stories260K's head dim 8: a row of 4 code bytes and one f16 scale, 6 bytes, against 32). */
START_TEST(bench_side_by_side)
{
    const char *model = tu_shared("models/stories260K/stories260K.bin");
    if (model == NULL)
        return;
    char *cmd = NULL, *out = NULL;
    ck_assert_int_gt(asprintf(&cmd,
                              "%s bench decode --model %s --batch 2 --prompt-len 48 --gen-len 4 "
                              "--modes offload,offload:int4 --json",
                              tu_bin("rekv"), model),
                     0);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    json_error_t jerr;
    json_t *j = json_loads(out, 0, &jerr), *modes = json_object_get(j, "modes");
    ck_assert_msg(j != NULL && json_array_size(modes) == 2, "%s", out);
    json_t *f = json_array_get(modes, 0), *q = json_array_get(modes, 1);
    ck_assert_str_eq(json_string_value(json_object_get(f, "cache_dtype")), "F32");
    ck_assert_str_eq(json_string_value(json_object_get(q, "cache_dtype")), "INT4");
    double bf = json_number_value(json_object_get(f, "h2d_kv_bytes_per_token")),
           bq = json_number_value(json_object_get(q, "h2d_kv_bytes_per_token"));
    ck_assert_msg(bf > 0 && bq * 32 == bf * 6, "int4 %g KV bytes per token, f32 %g", bq, bf);
    json_decref(j);
    free(cmd);
    free(out);
}
END_TEST

/* ---------------------------------------------------------------- bad input */

START_TEST(unknown_dtype_refused)
{
    rekv_dtype t = REKV_DTYPE_F32;
    ck_assert_int_eq(rekv_cache_dtype_parse("int3", &t), -EINVAL);
    ck_assert_int_eq(rekv_cache_dtype_parse("bf16", &t), -EINVAL);
    ck_assert_int_eq(t, REKV_DTYPE_F32);
    ck_assert_int_eq(rekv_cache_dtype_parse("INT4", &t), 0);
    ck_assert_int_eq(t, REKV_DTYPE_I4);
    rekv_kv_geometry g;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kv_geometry_init(&g, 2, 2, 7, 14, REKV_DTYPE_I4, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "even head dim") != NULL, "%s", err.msg);
    char *cmd = NULL, *out = NULL;
    ck_assert_int_gt(
        asprintf(&cmd,
                 "%s --endpoint ipc:///nonexistent/x --host-bytes 1M --layers 2 --kv-heads 2 "
                 "--head-dim 8 --hidden 16 --cache-dtype int3 2>&1",
                 tu_bin("rekv-kvstore")),
        0);
    ck_assert_int_eq(tu_run(cmd, &out), 2);
    ck_assert_msg(strstr(out, "--cache-dtype int3: expected f16, f32, int8 or int4") != NULL, "%s",
                  out);
    free(cmd);
    free(out);
    const char *model = tu_shared("models/stories260K/stories260K.bin");
    if (model == NULL)
        return;
    ck_assert_int_gt(asprintf(&cmd, "%s eval --model %s --ids /dev/null --cache-dtype q8 2>&1",
                              tu_bin("rekv"), model),
                     0);
    ck_assert_int_eq(tu_run(cmd, &out), 2);
    ck_assert_msg(strstr(out, "--cache-dtype q8: expected f16, f32, int8 or int4") != NULL, "%s",
                  out);
    free(cmd);
    free(out);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("kv_quant");
    TCase *tc = tcase_create("format");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, kernel_codes_equal_numpy);
    tcase_add_test(tc, unknown_dtype_refused);
    tcase_add_test(tc, int4_arena_bytes_per_token);
    tcase_add_test(tc, planner_prices_real_bytes);
    tcase_add_test(tc, bench_side_by_side);
    suite_add_tcase(s, tc);
    TCase *run = tcase_create("modes");
    tcase_set_timeout(run, 120);
    tcase_add_test(run, modes_match_resident_stories);
    tcase_add_test(run, modes_match_resident_gqa64);
    tcase_add_test(run, spilled_blocks_read_back_exact);
    suite_add_tcase(s, run);
    return tu_run_suite(s);
}
