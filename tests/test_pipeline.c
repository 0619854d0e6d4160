/* test_pipeline.c — every exact mode of the decode pipeline (offload, kvpr, act, hybrid; weights
 * resident or offloaded; row and column schedules; several GPU batch counts) gives logits
 * identical, bit for bit, to the resident pipeline over the same steps, for stories260K and
 * synthetic OPT and Llama models, with the KV cache in a real kvstore process; and with any split
 * into GPU batches, since the cpu backend's GEMM is row-invariant. The resident pipeline in turn
 * matches the reference forward pass bit for bit. Bytes moved per step equal the papers'
 * formulas. Push (the kvstore process writes the KV rows into the worker's shared attention
 * buffers, cpu backend IPC) gives the same bits and the same counters as pull; a store without a
 * push backend is refused at pipeline creation. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpuworker/pipeline.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

typedef tu_fixture fixture;

/* A run: prefill B prompts, then `steps` greedy decode steps; every step's logits recorded. */
typedef struct run {
    float *logits; /* [(steps + 1)][B][vocab] */
    int32_t *tokens;
    rekv_layer_counters total;
    rekv_layer_counters first_decode; /* the first decode step alone */
} run;

static uint64_t g_seed = 1;
static int32_t next_rand(int n)
{
    g_seed = g_seed * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((g_seed >> 33) % (uint64_t)n);
}

/* B prompts of lens[i] tokens below V, next_rand's; prompts_free frees them. */
static int32_t **random_prompts(int B, const int *lens, int V)
{
    int32_t **p = calloc((size_t)B, sizeof(*p));
    ck_assert(p != NULL);
    for (int i = 0; i < B; i++) {
        p[i] = malloc(sizeof(int32_t) * (size_t)lens[i]);
        ck_assert(p[i] != NULL);
        for (int t = 0; t < lens[i]; t++)
            p[i][t] = next_rand(V);
    }
    return p;
}

static void prompts_free(int32_t **p, int B)
{
    for (int i = 0; i < B; i++)
        free(p[i]);
    free(p);
}

/* chaos: before every decode step the planner's knobs change at random — split, block pattern,
 * GPU batch count and explicit mini-batches, schedule — which must not change a single bit. */
static int g_chaos;

static void do_run(fixture *f, const rekv_pipeline_config *cfg, int B, const int *lens,
                   int32_t *const *prompts, int steps, run *out)
{
    rekv_err err = {0};
    rekv_pipeline *p;
    int V = f->m->config.vocab;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be,
                                       cfg->mode == REKV_MODE_RESIDENT ? NULL : f->store, cfg, &p,
                                       &err) == 0,
                  "%s", err.msg);
    rekv_pseq **seqs = calloc((size_t)B, sizeof(*seqs));
    rekv_pipe_item *items = calloc((size_t)B, sizeof(*items));
    int32_t *next = calloc((size_t)B, sizeof(int32_t));
    out->logits = malloc(sizeof(float) * (size_t)(steps + 1) * B * V);
    for (int i = 0; i < B; i++) {
        ck_assert_msg(rekv_pseq_create(p, lens[i] + steps, &seqs[i], &err) == 0, "%s", err.msg);
        items[i] = (rekv_pipe_item){.seq = seqs[i],
                                    .tokens = prompts[i],
                                    .n_tokens = lens[i],
                                    .logits = out->logits + (size_t)i * V};
    }
    ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
    for (int s = 1; s <= steps; s++) {
        for (int i = 0; i < B; i++) {
            next[i] = rekv_argmax(out->logits + ((size_t)(s - 1) * B + i) * V, V);
            items[i] = (rekv_pipe_item){.seq = seqs[i],
                                        .tokens = &next[i],
                                        .n_tokens = 1,
                                        .logits = out->logits + ((size_t)s * B + i) * V};
        }
        if (s == 1)
            rekv_pipeline_counters_reset(p);
        if (g_chaos) {
            rekv_step_params sp = {next_rand(40), 1 + next_rand(3), next_rand(3), 1 + next_rand(3),
                                   next_rand(2) ? REKV_SCHED_COLUMN : REKV_SCHED_ROW};
            ck_assert_msg(rekv_pipeline_set_step(p, &sp, &err) == 0, "%s", err.msg);
            int explicit_batches = next_rand(2);
            for (int i = 0; i < B; i++)
                items[i].gpu_batch = explicit_batches ? 1 + next_rand(3) : 0;
        }
        ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
        if (s == 1) {
            rekv_pipeline_counters(p, &out->first_decode);
            size_t n_steps;
            const rekv_layer_counters *sc = rekv_pipeline_step_counters(p, &n_steps);
            ck_assert_uint_eq(n_steps, 1);
            ck_assert(memcmp(sc, &out->first_decode, sizeof(*sc)) == 0);
        }
    }
    if (cfg->mode != REKV_MODE_RESIDENT) { /* push: the KV rows came by the store's copies */
        rekv_backend_stats bs;
        rekv_layer_counters tot;
        f->be->iface->stats(f->be, &bs);
        rekv_pipeline_counters(p, &tot);
        if (cfg->push)
            ck_assert_uint_eq(bs.h2d_bytes[REKV_XFER_KV], 0);
        else
            ck_assert_uint_ge(bs.h2d_bytes[REKV_XFER_KV], tot.h2d_bytes[REKV_XFER_KV]);
    }
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    free(seqs);
    free(items);
    free(next);
    rekv_pipeline_free(p);
}

/* The bytes one decode step should move, from the papers' formulas, token by token: offload moves
 * every context token's K and V (2 * kv_dim * p per token per layer); KVPR moves X[0:l] and
 * KV[l:s] (Eq. 6–7, with GQA's kv_dim in place of h in Eq. 7); act moves every context token's X;
 * hybrid moves X for tokens in ACT blocks and K,V for tokens in KV blocks, the block types
 * following HybridServe's allocation rule; ACT_GPU's activations (the first act_gpu_blocks ACT
 * blocks) are recomputed without moving, and the device-resident part (the first device_tokens
 * tokens) neither moves nor is recomputed. New tokens go back the same way (the store stays
 * complete). Weights: one layer per load. */
static void expected_counters(const rekv_pipeline_config *cfg, const rekv_model_config *c, int B,
                              const int *ctx, rekv_layer_counters *e)
{
    memset(e, 0, sizeof(*e));
    ck_assert_msg(!rekv_mode_approximate(cfg->mode), "approximate modes: tests/test_infinigen.c");
    uint64_t L = (uint64_t)c->n_layers, p = rekv_dtype_size(cfg->cache_dtype);
    uint64_t H = (uint64_t)c->hidden;
    uint64_t KVr = 2 * (uint64_t)rekv_config_kv_dim(c) * p, Xr = H * p; /* row bytes */
    uint64_t gpu_blocks = (uint64_t)cfg->act_gpu_blocks, dev = (uint64_t)cfg->device_tokens;
    for (int i = 0; i < B && cfg->mode != REKV_MODE_RESIDENT; i++) {
        uint64_t s = (uint64_t)ctx[i], x_tok = 0, kv_tok = 0, recomputed = 0;
        uint64_t l = (uint64_t)cfg->split < s ? (uint64_t)cfg->split : s;
        uint64_t nk = 0, na = 0; /* hybrid: the block types so far */
        rekv_kv_block_type type = REKV_KV_BLOCK_KV;
        for (uint64_t t = 0; t <= s; t++) {
            if (t % 16 == 0) { /* block t / 16's type, and whether ACT_GPU holds it */
                type = REKV_KV_BLOCK_KV;
                if (cfg->mode == REKV_MODE_ACT)
                    type = REKV_KV_BLOCK_ACT;
                else if (cfg->mode == REKV_MODE_HYBRID)
                    type = rekv_kv_next_block_type(nk, na, (uint32_t)cfg->kv_parts,
                                                   (uint32_t)cfg->act_parts);
                if (cfg->mode == REKV_MODE_HYBRID || cfg->mode == REKV_MODE_ACT)
                    type == REKV_KV_BLOCK_KV ? nk++ : na++;
            }
            if (t == s) { /* the new token: K,V into KV blocks, X into ACT blocks (kvpr: both) */
                int kv = type == REKV_KV_BLOCK_KV, x = !kv || cfg->mode == REKV_MODE_KVPR;
                e->d2h_bytes[REKV_XFER_KV] += L * (uint64_t)kv * KVr;
                e->d2h_bytes[REKV_XFER_ACT] += L * (uint64_t)x * Xr;
                break;
            }
            if (t < dev) {
                e->tokens_device += L;
                continue;
            }
            int recompute = cfg->mode == REKV_MODE_KVPR ? t < l : type == REKV_KV_BLOCK_ACT;
            /* ACT_GPU: the sequence's first act_gpu_blocks ACT blocks (kvpr: of its activation
             * sequence, whose blocks are all ACT) */
            uint64_t act_ord = cfg->mode == REKV_MODE_KVPR ? t / 16 : na - 1;
            if (recompute) {
                recomputed++;
                x_tok += act_ord >= gpu_blocks;
            } else {
                kv_tok++;
            }
        }
        e->h2d_bytes[REKV_XFER_KV] += L * kv_tok * KVr;
        e->h2d_bytes[REKV_XFER_ACT] += L * x_tok * Xr;
        e->tokens_recomputed += L * recomputed;
        e->tokens_fetched += L * kv_tok;
    }
    if (cfg->offload_weights) {
        uint64_t Q = (uint64_t)rekv_config_q_dim(c), KV = (uint64_t)rekv_config_kv_dim(c);
        uint64_t F = (uint64_t)c->ffn, ob = c->o_bias, qb = c->qkv_bias, fb = c->ffn_bias;
        uint64_t nb = c->norm_bias ? 2 : 1, gated = c->act == REKV_ACT_SILU;
        /* matrices as the file holds them, vectors in fp32 */
        uint64_t layer =
            rekv_dtype_size(c->dtype) * (Q * H + 2 * KV * H + H * Q + (2 + gated) * H * F) +
            4 * (qb * (Q + 2 * KV) + ob * H + fb * (F + H) + 2 * nb * H);
        int G = cfg->gpu_batches < B ? cfg->gpu_batches : B;
        e->h2d_bytes[REKV_XFER_WEIGHTS] =
            L * layer * (uint64_t)(cfg->schedule == REKV_SCHED_COLUMN ? 1 : G);
    }
}

static const char *cfg_name(const rekv_pipeline_config *c, char *buf, size_t n)
{
    snprintf(buf, n, "%s%s%s %s gpu_batches=%d split=%d pattern=%d:%d act_gpu=%d device=%d",
             rekv_mode_name(c->mode), c->offload_weights ? "+offload-weights" : "",
             c->push ? "+push" : "", c->schedule == REKV_SCHED_ROW ? "row" : "column",
             c->gpu_batches, c->split, c->kv_parts, c->act_parts, c->act_gpu_blocks,
             c->device_tokens);
    return buf;
}

/* Runs every mode against resident on one model, for the given batch shapes and cache dtype. With
 * an fp32 cache every mode equals resident bit for bit. With an fp16 cache resident and offload
 * round the same K,V the same way (equal bits); modes that recompute K,V from stored activations
 * see rounded activations and stay within a tolerance. */
static void check_modes(const char *model_path, rekv_dtype cache, const int *lens, int B, int steps)
{
    fixture f;
    tu_fixture_open(&f, model_path, cache, "cpu");
    const rekv_model_config *c = &f.m->config;
    int V = c->vocab;
    int32_t **prompts = random_prompts(B, lens, V);
    size_t n_logits = (size_t)(steps + 1) * B * V;
    /* one reference: resident, one GPU batch; batching never changes bits (row-invariant GEMM) */
    rekv_pipeline_config ref_cfg;
    rekv_pipeline_config_defaults(&ref_cfg);
    ref_cfg.cache_dtype = cache;
    run ref;
    do_run(&f, &ref_cfg, B, lens, prompts, steps, &ref);
    int gbs[] = {1, 2};
    for (int gi = 0; gi < 2; gi++) {
        int G = gbs[gi];
        if (G > B)
            continue;
        rekv_pipeline_config base = ref_cfg;
        base.gpu_batches = G;
        struct {
            rekv_mode mode;
            int split, kv, act, act_gpu, dev;
        } modes[] = {{REKV_MODE_RESIDENT, 0, 1, 1, 0, 0},
                     {REKV_MODE_OFFLOAD, 0, 1, 1, 0, 0},
                     {REKV_MODE_KVPR, 7, 1, 1, 0, 0},
                     {REKV_MODE_KVPR, 1000000, 1, 1, 1, 0},
                     {REKV_MODE_ACT, 0, 1, 1, 0, 0},
                     {REKV_MODE_ACT, 0, 1, 1, 2, 0},
                     {REKV_MODE_HYBRID, 0, 1, 1, 0, 0},
                     {REKV_MODE_HYBRID, 0, 3, 1, 1, 0},
                     {REKV_MODE_HYBRID, 0, 1, 2, 3, 0},
                     /* with a device-resident part: whole blocks, a block and a piece, every
                      * technique beside it (kvpr recomputes [dev, split)) */
                     {REKV_MODE_OFFLOAD, 0, 1, 1, 0, 16},
                     {REKV_MODE_KVPR, 30, 1, 1, 0, 21},
                     {REKV_MODE_ACT, 0, 1, 1, 1, 5},
                     {REKV_MODE_HYBRID, 0, 1, 2, 1, 35}};
        /* ow 2: weights resident, KV rows pushed by the store (push only changes who copies the
         * KV rows, so once over the weight placements is enough) */
        for (size_t mi = 0; mi < sizeof(modes) / sizeof(modes[0]); mi++)
            for (int ow = 0; ow < 3; ow++)
                for (int sched = 0; sched < 2; sched++) {
                    if (ow == 2 && modes[mi].mode == REKV_MODE_RESIDENT)
                        continue;
                    rekv_pipeline_config cfg = base;
                    cfg.push = ow == 2;
                    cfg.mode = modes[mi].mode;
                    cfg.split = modes[mi].split;
                    cfg.kv_parts = modes[mi].kv;
                    cfg.act_parts = modes[mi].act;
                    cfg.act_gpu_blocks = modes[mi].act_gpu;
                    cfg.device_tokens = modes[mi].dev;
                    cfg.offload_weights = ow == 1;
                    cfg.schedule = sched ? REKV_SCHED_COLUMN : REKV_SCHED_ROW;
                    run r;
                    do_run(&f, &cfg, B, lens, prompts, steps, &r);
                    char name[256];
                    rekv_layer_counters want;
                    expected_counters(&cfg, c, B, lens, &want);
                    ck_assert_msg(memcmp(&want, &r.first_decode, sizeof(want)) == 0,
                                  "%s, %s, B=%d: bytes moved by one decode step differ from the "
                                  "formulas: h2d kv %llu (want %llu) act %llu (want %llu) weights "
                                  "%llu (want %llu); d2h kv %llu (want %llu) act %llu (want %llu)",
                                  model_path, cfg_name(&cfg, name, sizeof(name)), B,
                                  (unsigned long long)r.first_decode.h2d_bytes[REKV_XFER_KV],
                                  (unsigned long long)want.h2d_bytes[REKV_XFER_KV],
                                  (unsigned long long)r.first_decode.h2d_bytes[REKV_XFER_ACT],
                                  (unsigned long long)want.h2d_bytes[REKV_XFER_ACT],
                                  (unsigned long long)r.first_decode.h2d_bytes[REKV_XFER_WEIGHTS],
                                  (unsigned long long)want.h2d_bytes[REKV_XFER_WEIGHTS],
                                  (unsigned long long)r.first_decode.d2h_bytes[REKV_XFER_KV],
                                  (unsigned long long)want.d2h_bytes[REKV_XFER_KV],
                                  (unsigned long long)r.first_decode.d2h_bytes[REKV_XFER_ACT],
                                  (unsigned long long)want.d2h_bytes[REKV_XFER_ACT]);
                    /* where an activation row is smaller than a K+V row (MHA), every technique
                     * that sends activations moves strictly fewer bytes than offload */
                    if (c->hidden < 2 * rekv_config_kv_dim(c) &&
                        (cfg.mode == REKV_MODE_KVPR || cfg.mode == REKV_MODE_ACT ||
                         cfg.mode == REKV_MODE_HYBRID)) {
                        rekv_pipeline_config oc = cfg;
                        oc.mode = REKV_MODE_OFFLOAD;
                        rekv_layer_counters off;
                        expected_counters(&oc, c, B, lens, &off);
                        uint64_t a = r.first_decode.h2d_bytes[REKV_XFER_KV] +
                                     r.first_decode.h2d_bytes[REKV_XFER_ACT];
                        uint64_t o = off.h2d_bytes[REKV_XFER_KV] + off.h2d_bytes[REKV_XFER_ACT];
                        ck_assert_msg(a < o, "%s: %llu cache bytes per step, offload %llu",
                                      cfg_name(&cfg, name, sizeof(name)), (unsigned long long)a,
                                      (unsigned long long)o);
                    }
                    /* with a 16-bit cache the stored activations are rounded, so what is
                     * recomputed from them differs slightly; moving K,V alone stays exact */
                    int exact = cache == REKV_DTYPE_F32 || cfg.mode == REKV_MODE_RESIDENT ||
                                cfg.mode == REKV_MODE_OFFLOAD;
                    for (size_t i = 0; i < n_logits && !exact; i++)
                        ck_assert_msg(fabsf(r.logits[i] - ref.logits[i]) <=
                                          2e-2f * (fabsf(ref.logits[i]) + 1.0f),
                                      "%s, %s, B=%d, %s cache: logit %zu is %.9g, resident %.9g",
                                      model_path, cfg_name(&cfg, name, sizeof(name)), B,
                                      rekv_dtype_name(cache), i, r.logits[i], ref.logits[i]);
                    for (size_t i = 0; i < n_logits && exact; i++)
                        if (memcmp(&r.logits[i], &ref.logits[i], sizeof(float)) != 0)
                            ck_abort_msg("%s, %s, B=%d: logit %zu (step %zu) is %.9g, resident "
                                         "gives %.9g",
                                         model_path, cfg_name(&cfg, name, sizeof(name)), B, i,
                                         i / ((size_t)B * V), r.logits[i], ref.logits[i]);
                    free(r.logits);
                }
    }
    free(ref.logits);
    prompts_free(prompts, B);
    tu_fixture_close(&f);
}

START_TEST(modes_stories260k)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    int lens1[] = {1};
    check_modes(path, REKV_DTYPE_F32, lens1, 1, 3);
    int lens3[] = {17, 1, 40};
    check_modes(path, REKV_DTYPE_F32, lens3, 3, 3);
}
END_TEST

/* f: a synthetic model of spec, written to a fresh directory, with its kvstore (fp32 cache).
 * Returns the directory, for synth_fixture_close. */
static char *synth_fixture(fixture *f, const rekv_synth_spec *spec)
{
    char *dir = tu_tmpdir(), path[4200];
    snprintf(path, sizeof(path), "%s/m", dir);
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(spec, path, &err) == 0, "%s", err.msg);
    tu_fixture_open(f, path, REKV_DTYPE_F32, NULL);
    return dir;
}

/* Closes f and removes dir, synth_fixture's model. */
static void synth_fixture_close(fixture *f, char *dir)
{
    tu_fixture_close(f);
    tu_rmrf(dir);
    free(dir);
}

/* synthetic models: OPT (MHA, biases, learned positions) and Llama (GQA, untied head) */
START_TEST(modes_synthetic)
{
    static const rekv_synth_spec specs[] = {
        {REKV_ARCH_OPT, 2, 64, 4, 4, 128, 300, 1100, REKV_DTYPE_F16, 11, 1},
        {REKV_ARCH_LLAMA, 3, 64, 8, 2, 160, 300, 1100, REKV_DTYPE_BF16, 12, 0},
    };
    char *dir = tu_tmpdir();
    for (size_t i = 0; i < 2; i++) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/m%zu", dir, i);
        rekv_err err = {0};
        ck_assert_msg(rekv_synth_write(&specs[i], path, &err) == 0, "%s", err.msg);
        int lens4[] = {5, 33, 16, 70};
        check_modes(path, REKV_DTYPE_F32, lens4, 4, 2);
        check_modes(path, REKV_DTYPE_F16, lens4, 4, 2);
        int lens1[] = {1000};
        check_modes(path, REKV_DTYPE_F32, lens1, 1, 2);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* The planner's per-step knobs never change results: every mode under chaos equals resident. */
START_TEST(step_params_change_nothing)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, "cpu");
    int B = 5, lens[] = {3, 40, 17, 1, 33}, V = f.m->config.vocab, steps = 6;
    int32_t **prompts = random_prompts(B, lens, V);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    run ref;
    do_run(&f, &cfg, B, lens, prompts, steps, &ref);
    rekv_mode modes[] = {REKV_MODE_RESIDENT, REKV_MODE_OFFLOAD, REKV_MODE_KVPR, REKV_MODE_ACT,
                         REKV_MODE_HYBRID};
    g_chaos = 1;
    for (int m = 0; m < 5; m++)
        for (int ow = 0; ow < 3; ow++) { /* ow 2: weights resident, KV rows pushed */
            if (ow == 2 && modes[m] == REKV_MODE_RESIDENT)
                continue;
            cfg.mode = modes[m];
            cfg.offload_weights = ow == 1;
            cfg.push = ow == 2;
            run r;
            do_run(&f, &cfg, B, lens, prompts, steps, &r);
            ck_assert_msg(
                memcmp(r.logits, ref.logits, sizeof(float) * (size_t)(steps + 1) * B * V) == 0,
                "%s%s: changing step parameters changed the logits", rekv_mode_name(cfg.mode),
                ow == 1   ? "+offload-weights"
                : ow == 2 ? "+push"
                          : "");
            free(r.logits);
        }
    g_chaos = 0;
    free(ref.logits);
    prompts_free(prompts, B);
    tu_fixture_close(&f);
}
END_TEST

/* hybrid: a sequence's blocks keep the KV:ACT pattern in force when it was made (what the
 * coordinator admitted it at); a later pattern applies to the sequences made after it */
START_TEST(hybrid_pattern_per_sequence)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, NULL);
    rekv_err err = {0};
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_HYBRID; /* 1:1 */
    rekv_pipeline *p;
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err) == 0, "%s", err.msg);
    rekv_pseq *a, *b;
    ck_assert_msg(rekv_pseq_create(p, 200, &a, &err) == 0, "%s", err.msg);
    rekv_step_params sp = {0, 1, 0, 1, REKV_SCHED_ROW}; /* all KV from now on */
    ck_assert_msg(rekv_pipeline_set_step(p, &sp, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_pseq_create(p, 200, &b, &err) == 0, "%s", err.msg);
    int32_t prompt[128];
    for (int i = 0; i < 128; i++)
        prompt[i] = 1 + i % 300;
    float *logits = malloc(sizeof(float) * 2 * (size_t)f.m->config.vocab);
    rekv_pipe_item items[2] = {
        {.seq = a, .tokens = prompt, .n_tokens = 128, .logits = logits},
        {.seq = b, .tokens = prompt, .n_tokens = 128, .logits = logits + f.m->config.vocab}};
    ck_assert_msg(rekv_pipeline_step(p, items, 2, &err) == 0, "%s", err.msg);
    for (int k = 0; k < 2; k++) {
        rekv_kv_table_entry *t = NULL;
        size_t n = 0;
        uint64_t toks = 0;
        ck_assert_msg(rekv_kvstore_table(f.store, rekv_pseq_store_seq(k ? b : a), 1, &t, &n, &toks,
                                         &err) == 0,
                      "%s", err.msg);
        ck_assert_uint_eq(n, 8);
        int n_act = 0;
        for (size_t i = 0; i < n; i++)
            n_act += t[i].type == REKV_KV_BLOCK_ACT;
        ck_assert_int_eq(n_act, k ? 0 : 4); /* a: 1:1, b: all KV */
        free(t);
    }
    free(logits);
    rekv_pseq_free(a);
    rekv_pseq_free(b);
    rekv_pipeline_free(p);
    tu_fixture_close(&f);
}
END_TEST

/* The resident pipeline is the reference forward pass, bit for bit. */
START_TEST(resident_matches_forward)
{
    const char *path = tu_shared("models/llama-tiny-py");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, "cpu");
    int V = f.m->config.vocab, len = 50;
    int32_t *prompt = malloc(sizeof(int32_t) * len);
    for (int i = 0; i < len; i++)
        prompt[i] = next_rand(V);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    run r;
    do_run(&f, &cfg, 1, &len, &prompt, 4, &r);
    rekv_err err = {0};
    rekv_seq *s;
    float *lg = malloc(sizeof(float) * V);
    ck_assert_int_eq(rekv_seq_create(f.e, len + 4, &s, &err), 0);
    rekv_batch_item it = {s, prompt, len, 0, lg};
    for (int step = 0; step <= 4; step++) {
        ck_assert_msg(rekv_engine_forward(f.e, &it, 1, &err) == 0, "%s", err.msg);
        ck_assert_msg(memcmp(lg, r.logits + (size_t)step * V, sizeof(float) * V) == 0,
                      "step %d: pipeline and forward.c differ", step);
        prompt[0] = rekv_argmax(lg, V);
        it = (rekv_batch_item){s, prompt, 1, 0, lg};
    }
    rekv_seq_free(s);
    free(lg);
    free(prompt);
    free(r.logits);
    tu_fixture_close(&f);
}
END_TEST

/* A store without a push backend: a push pipeline is refused at creation, saying why; push makes
 * no sense in resident mode. */
START_TEST(push_needs_a_store_that_pushes)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, NULL); /* a store that cannot push */
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_OFFLOAD;
    cfg.push = 1;
    rekv_pipeline *pl = NULL;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &pl, &err), -ENOTSUP);
    ck_assert_ptr_null(pl);
    ck_assert_msg(strstr(err.msg, "no push backend") != NULL, "%s", err.msg);
    cfg.mode = REKV_MODE_RESIDENT;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, NULL, &cfg, &pl, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "push") != NULL, "%s", err.msg);
    /* the store still serves pull */
    cfg.mode = REKV_MODE_OFFLOAD;
    cfg.push = 0;
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &pl, &err) == 0, "%s", err.msg);
    rekv_pipeline_free(pl);
    /* a device-resident part is for the modes that stream the cache: clo refuses it */
    cfg.mode = REKV_MODE_CLO;
    cfg.device_tokens = 16;
    pl = NULL;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &pl, &err), -EINVAL);
    ck_assert_ptr_null(pl);
    ck_assert_msg(strstr(err.msg, "device-resident part") != NULL, "%s", err.msg);
    tu_fixture_close(&f);
}
END_TEST

/* Page-locking: the cpu backend locks nothing (-1); a backend that locks says 1 once the arena
 * and the offloaded weights are locked; one that refuses (cudaHostRegister failing: here the cpu
 * backend with its host_register made to fail, as a GPU cannot be had) leaves the pipeline
 * working — the same logits — but says 0 (and logs a warning), never silently. */
static int g_register_calls, g_register_fails;
static int register_counted(rekv_backend *be, void *p, size_t bytes, rekv_err *err)
{
    (void)be, (void)p, (void)bytes;
    if (g_register_fails)
        return rekv_errf(err, -ENOMEM, "locked memory limit reached");
    g_register_calls++; /* ranges locked now */
    return 0;
}
static void unregister_counted(rekv_backend *be, void *p)
{
    (void)be, (void)p;
    g_register_calls--;
}

START_TEST(page_lock_refusal_is_reported)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, NULL);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_OFFLOAD;
    cfg.offload_weights = 1;
    rekv_pipeline *pl = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &pl, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_pipeline_page_locked(pl), -1); /* cpu: nothing to lock */
    rekv_pipeline_free(pl);

    const rekv_backend_iface *real = f.be->iface;
    rekv_backend_iface locking = *real;
    locking.host_register = register_counted;
    locking.host_unregister = unregister_counted;
    f.be->iface = &locking;
    for (g_register_fails = 0; g_register_fails < 2; g_register_fails++) {
        g_register_calls = 0;
        ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &pl, &err) == 0, "%s",
                      err.msg);
        ck_assert_int_eq(rekv_pipeline_page_locked(pl), !g_register_fails);
        ck_assert_int_eq(err.code, 0); /* a refusal is not the caller's error */
        /* and it still runs: a prefill and a decode step */
        rekv_pseq *s = NULL;
        ck_assert_msg(rekv_pseq_create(pl, 64, &s, &err) == 0, "%s", err.msg);
        int32_t toks[4] = {1, 2, 3, 4};
        float *logits = malloc(512 * sizeof(float));
        rekv_pipe_item it = {.seq = s, .tokens = toks, .n_tokens = 4, .logits = logits};
        ck_assert_msg(rekv_pipeline_step(pl, &it, 1, &err) == 0, "%s", err.msg);
        it.n_tokens = 1;
        ck_assert_msg(rekv_pipeline_step(pl, &it, 1, &err) == 0, "%s", err.msg);
        free(logits);
        rekv_pseq_free(s);
        rekv_pipeline_free(pl);
        ck_assert_int_eq(g_register_calls, 0); /* every lock undone */
    }
    f.be->iface = real;
    tu_fixture_close(&f);
}
END_TEST

/* Token selection on the device: items with a sampler get the token rekv_sample picks from the
 * step's logits (greedy, top-k with top-p, plain temperature), the top logits rekv_top_logits
 * ranks, and their sampler advanced as rekv_sample advances it — and when they ask for no logits,
 * only those cross back (the step's d2h bytes of kind "other" are exactly ids and top logits). An
 * item that asks for nothing (a prompt chunk) gets nothing. */
START_TEST(draws_on_device)
{
    rekv_synth_spec spec = {REKV_ARCH_LLAMA, 2, 128, 4, 2, 256, 300, 256, REKV_DTYPE_F32, 11, 0};
    fixture f;
    char *mdir = synth_fixture(&f, &spec);
    rekv_err err = {0};
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_OFFLOAD;
    rekv_pipeline *pl = NULL;
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &pl, &err) == 0, "%s", err.msg);
    enum { B = 4, V = 300, STEPS = 12 };
    /* greedy with 5 top logits; top-k and top-p with 3; plain temperature; nothing at all */
    const float temp[B] = {0, 0.8f, 1.3f, 0};
    const int top_k[B] = {0, 20, 0, 0}, n_top[B] = {5, 3, 0, 0};
    const float top_p[B] = {1, 0.9f, 1, 1};
    rekv_sampler smp[B];
    rekv_pseq *seqs[B];
    int32_t prompt[B][9], last[B], tok[B], top_ids[B][5], want_ids[5];
    float top_vals[B][5], want_vals[5];
    float *logits = malloc(sizeof(float) * B * V), *scratch = malloc(8 * V);
    ck_assert(logits && scratch);
    for (int i = 0; i < B; i++) {
        ck_assert_msg(rekv_pseq_create(pl, 64, &seqs[i], &err) == 0, "%s", err.msg);
        rekv_sampler_init(&smp[i], temp[i], top_k[i], top_p[i], 100 + (uint64_t)i);
        for (int t = 0; t < 9; t++)
            prompt[i][t] = 1 + (7 * t + 31 * i) % (V - 1);
    }
    int differ = 0;
    for (int step = 0; step <= STEPS; step++) {
        int with_logits = step < STEPS; /* the last step: draws only */
        rekv_pipe_item items[B];
        rekv_sampler before[B];
        for (int i = 0; i < B; i++) {
            items[i] = (rekv_pipe_item){
                .seq = seqs[i], .tokens = step ? &last[i] : prompt[i], .n_tokens = step ? 1 : 9};
            if (i == 3)
                continue; /* asks for nothing */
            items[i].logits = with_logits ? logits + (size_t)i * V : NULL;
            items[i].smp = &smp[i];
            items[i].token = &tok[i];
            items[i].n_top = n_top[i];
            items[i].top_ids = top_ids[i];
            items[i].top_vals = top_vals[i];
            before[i] = smp[i];
        }
        rekv_backend_stats b0, b1;
        f.be->iface->stats(f.be, &b0);
        ck_assert_msg(rekv_pipeline_step(pl, items, B, &err) == 0, "%s", err.msg);
        f.be->iface->stats(f.be, &b1);
        uint64_t other = b1.d2h_bytes[REKV_XFER_OTHER] - b0.d2h_bytes[REKV_XFER_OTHER];
        if (!with_logits) /* ids of the batch (the idle item's too) and 8 tokens' top logits */
            ck_assert_uint_eq(other, 4 * B + 8 * (5 + 3));
        for (int i = 0; i < 3 && with_logits; i++) {
            const float *lg = logits + (size_t)i * V;
            int32_t want = rekv_sample(&before[i], lg, V, scratch);
            ck_assert_msg(tok[i] == want, "step %d item %d: drew %d, rekv_sample %d", step, i,
                          tok[i], want);
            ck_assert_msg(smp[i].state == before[i].state, "step %d item %d: sampler state", step,
                          i);
            rekv_top_logits(lg, V, n_top[i], want_ids, want_vals);
            for (int t = 0; t < n_top[i]; t++)
                ck_assert(top_ids[i][t] == want_ids[t] && top_vals[i][t] == want_vals[t]);
            differ += i > 0 && want != rekv_argmax(lg, V);
        }
        for (int i = 0; i < 3; i++)
            last[i] = tok[i];
        last[3] = 5 + step;
    }
    ck_assert_msg(differ > 0, "sampling never left the greedy choice");
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    free(logits);
    free(scratch);
    rekv_pipeline_free(pl);
    synth_fixture_close(&f, mdir);
}
END_TEST

/* Resident decode steps as one graph: a step that repeats its predecessor's calls exactly is
 * captured and launched as a graph, and later steps that repeat it launch the graph, with the
 * tokens of a run that is never graphed (its items take their logits back); a sequence leaving
 * the batch changes the step, which then runs call by call until it repeats and is captured
 * anew. Nothing else may break the repetition (a buffer growing with the context did). A graphed
 * step copies its metadata to the device once, and its kernels read that copy: one copy more
 * than the same step call by call, the same bytes each step of a batch (the tokens being the
 * ungraphed run's says the kernels found the copy's positions, tokens and descriptors). */
START_TEST(graph_steps)
{
    rekv_synth_spec spec = {REKV_ARCH_OPT, 3, 64, 4, 4, 128, 300, 256, REKV_DTYPE_F32, 21, 1};
    fixture f;
    char *mdir = synth_fixture(&f, &spec);
    rekv_err err = {0};
    enum { B = 3, V = 300, STEPS = 10, LEAVE = 6 };
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_RESIDENT;
    int32_t tok[2][STEPS + 1][B];
    uint64_t gsteps[2], captures[2], graphed[2][STEPS + 1], back[2][STEPS + 1];
    uint64_t meta[2][STEPS + 1], copies[2][STEPS + 1];
    float *logits = malloc(sizeof(float) * (STEPS + 1) * B * V);
    for (int r = 0; r < 2; r++) { /* run 0: logits too (never graphed); run 1: draws only */
        rekv_pipeline *pl = NULL;
        ck_assert_msg(rekv_pipeline_create(f.e, f.be, NULL, &cfg, &pl, &err) == 0, "%s", err.msg);
        rekv_pseq *seqs[B];
        rekv_sampler greedy;
        rekv_sampler_init(&greedy, 0, 0, 1, 0);
        int32_t prompt[B][5];
        for (int i = 0; i < B; i++) {
            ck_assert_msg(rekv_pseq_create(pl, 64, &seqs[i], &err) == 0, "%s", err.msg);
            for (int t = 0; t < 5; t++)
                prompt[i][t] = 1 + (11 * t + 37 * i) % (V - 1);
        }
        for (int step = 0; step <= STEPS; step++) {
            rekv_pipe_item items[B];
            int n = step > LEAVE ? B - 1 : B; /* the last sequence leaves */
            for (int i = 0; i < n; i++)
                items[i] =
                    (rekv_pipe_item){.seq = seqs[i],
                                     .tokens = step ? &tok[r][step - 1][i] : prompt[i],
                                     .n_tokens = step ? 1 : 5,
                                     .logits = r == 0 ? logits + ((size_t)step * B + i) * V : NULL,
                                     .smp = &greedy,
                                     .token = &tok[r][step][i]};
            uint64_t before = rekv_pipeline_graph_steps(pl, NULL);
            rekv_backend_stats b0, b1;
            f.be->iface->stats(f.be, &b0);
            ck_assert_msg(rekv_pipeline_step(pl, items, n, &err) == 0, "%s", err.msg);
            f.be->iface->stats(f.be, &b1);
            graphed[r][step] = rekv_pipeline_graph_steps(pl, NULL) - before;
            back[r][step] = b1.d2h_bytes[REKV_XFER_OTHER] - b0.d2h_bytes[REKV_XFER_OTHER];
            meta[r][step] = b1.h2d_bytes[REKV_XFER_OTHER] - b0.h2d_bytes[REKV_XFER_OTHER];
            copies[r][step] = b1.h2d_copies - b0.h2d_copies;
        }
        gsteps[r] = rekv_pipeline_graph_steps(pl, &captures[r]);
        for (int i = 0; i < B; i++)
            rekv_pseq_free(seqs[i]);
        rekv_pipeline_free(pl);
    }
    for (int step = 0; step <= STEPS; step++)
        for (int i = 0; i < (step > LEAVE ? B - 1 : B); i++)
            ck_assert_msg(tok[1][step][i] == tok[0][step][i], "step %d seq %d: %d, not %d", step, i,
                          tok[1][step][i], tok[0][step][i]);
    ck_assert_uint_eq(gsteps[0], 0);
    /* a step is graphed once it repeats its predecessor: every decode step but the first of
     * each batch (whose predecessor was the prefill, or a bigger batch); one capture per batch */
    for (int step = 0; step <= STEPS; step++)
        ck_assert_msg(graphed[1][step] == (step >= 2 && step != LEAVE + 1), "step %d graphed %llu",
                      step, (unsigned long long)graphed[1][step]);
    ck_assert_uint_eq(captures[1], 2);
    /* a graphed step does the work of one step: the same bytes back as one run call by call */
    ck_assert_uint_eq(back[1][STEPS], back[1][LEAVE + 1]);
    ck_assert_uint_eq(back[1][STEPS], 4 * (B - 1));
    ck_assert_uint_eq(gsteps[1], STEPS - 2);
    for (int step = 2; step <= STEPS; step++) {
        int g = graphed[1][step] != 0;
        ck_assert_msg(copies[1][step] == copies[0][step] + (uint64_t)g,
                      "step %d (graphed %d): %llu copies to the device, the ungraphed run %llu", step,
                      g, (unsigned long long)copies[1][step], (unsigned long long)copies[0][step]);
        ck_assert_msg(g ? meta[1][step] > meta[0][step] : meta[1][step] == meta[0][step],
                      "step %d (graphed %d): %llu bytes to the device, the ungraphed run %llu", step,
                      g, (unsigned long long)meta[1][step], (unsigned long long)meta[0][step]);
    }
    /* the metadata of a batch is the same bytes every step */
    ck_assert_uint_eq(meta[1][STEPS] - meta[0][STEPS], meta[1][LEAVE + 2] - meta[0][LEAVE + 2]);
    ck_assert_uint_eq(meta[1][LEAVE] - meta[0][LEAVE], meta[1][2] - meta[0][2]);
    free(logits);
    synth_fixture_close(&f, mdir);
}
END_TEST

/* The overlap that is the point of the pipeline: a layer's compute runs while the next layer's
 * KV rows cross the link. On a link whose every copy takes 0.2 s (latency), with a step whose
 * compute takes tens of milliseconds per layer (256 new tokens of a 512-wide model), the trace
 * shows compute-stream work (kernels, not waits) running during the h2d KV copies of layers
 * 1..L-1 — an order, not a time: a pipeline that fetched layer l+1 only after computing layer
 * l would show none, however fast or slow the machine. (Layer 0's copy is left out: the step's
 * embedding runs beside it in any pipeline.) */
START_TEST(fetch_overlaps_compute)
{
    rekv_synth_spec spec = {REKV_ARCH_OPT, 4, 512, 8, 8, 2048, 300, 1100, REKV_DTYPE_F32, 5, 1};
    fixture f;
    char *mdir = synth_fixture(&f, &spec);
    rekv_err err = {0};
    rekv_link_config link = {.gbps = 1000, .latency_us = 200e3};
    rekv_backend *be = NULL;
    ck_assert_msg(rekv_backend_cpu_create(&link, &be, &err) == 0, "%s", err.msg);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_OFFLOAD;
    rekv_pipeline *pl = NULL;
    ck_assert_msg(rekv_pipeline_create(f.e, be, f.store, &cfg, &pl, &err) == 0, "%s", err.msg);
    rekv_pseq *s = NULL;
    ck_assert_msg(rekv_pseq_create(pl, 512, &s, &err) == 0, "%s", err.msg);
    int32_t toks[256];
    for (int t = 0; t < 256; t++)
        toks[t] = 3 + t % 290;
    float *logits = malloc(300 * sizeof(float));
    rekv_pipe_item it = {.seq = s, .tokens = toks, .n_tokens = 32, .logits = logits};
    ck_assert_msg(rekv_pipeline_step(pl, &it, 1, &err) == 0, "%s", err.msg);
    be->iface->trace_start(be);
    it.n_tokens = 256; /* the 32 in the store cross the link, per layer */
    ck_assert_msg(rekv_pipeline_step(pl, &it, 1, &err) == 0, "%s", err.msg);
    size_t ns;
    tu_span *sp = tu_trace_spans(be, &ns);
    int copies = 0, overlapped = 0;
    for (size_t i = 0; i < ns; i++) {
        if (strncmp(sp[i].label, "h2d KV", 6) != 0 || copies++ == 0)
            continue;
        int any = 0;
        for (size_t j = 0; j < ns; j++)
            if (strcmp(sp[j].stream, "compute") == 0 && strncmp(sp[j].label, "wait", 4) != 0 &&
                sp[j].start < sp[i].end && sp[j].end > sp[i].start)
                any = 1;
        overlapped += any;
    }
    ck_assert_int_eq(copies, spec.n_layers); /* a KV copy per layer */
    ck_assert_msg(overlapped >= 1,
                  "no compute ran while layers 1..%d's KV crossed the link: the fetch does not "
                  "overlap the compute",
                  spec.n_layers - 1);
    free(sp);
    free(logits);
    rekv_pseq_free(s);
    rekv_pipeline_free(pl);
    rekv_backend_destroy(be);
    synth_fixture_close(&f, mdir);
}
END_TEST

/* A device with room for the step but not for the recomputation its split asks (kvpr): the step
 * recomputes what the device holds and fetches the rest of the split as K,V — resident's logits
 * bit for bit, with fewer activation bytes and more KV bytes than the same split where the
 * device has room. */
START_TEST(split_lowered_to_device_memory)
{
    rekv_synth_spec spec = {REKV_ARCH_OPT, 2, 64, 4, 4, 128, 300, 1100, REKV_DTYPE_F16, 11, 1};
    fixture f;
    char *mdir = synth_fixture(&f, &spec);
    int B = 2, lens[] = {300, 200}, steps = 3, V = spec.vocab;
    int32_t **prompts = random_prompts(B, lens, V);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    run ref, roomy, tight;
    do_run(&f, &cfg, B, lens, prompts, steps, &ref);
    cfg.mode = REKV_MODE_KVPR;
    cfg.split = 0;
    size_t base = tu_device_use(&f, &cfg, B, lens, prompts);
    cfg.split = 1 << 20; /* every token */
    do_run(&f, &cfg, B, lens, prompts, steps, &roomy);
    /* room for about 300 of the 500 context rows the split recomputes (1280 bytes each here,
     * less the buffers' growth slack) */
    rekv_err err = {0};
    rekv_link_config link = {.device_bytes = base + 300 * 1600};
    rekv_backend *roomy_be = f.be;
    ck_assert_msg(rekv_backend_cpu_create(&link, &f.be, &err) == 0, "%s", err.msg);
    do_run(&f, &cfg, B, lens, prompts, steps, &tight);
    rekv_backend_destroy(f.be);
    f.be = roomy_be;
    size_t n = sizeof(float) * (size_t)(steps + 1) * (size_t)B * (size_t)V;
    ck_assert_msg(memcmp(tight.logits, ref.logits, n) == 0, "the lowered split changed the logits");
    ck_assert_msg(memcmp(roomy.logits, ref.logits, n) == 0, "kvpr changed the logits");
    const uint64_t *ta = tight.first_decode.h2d_bytes, *ra = roomy.first_decode.h2d_bytes;
    ck_assert_msg(ta[REKV_XFER_ACT] > 0 && ta[REKV_XFER_ACT] < ra[REKV_XFER_ACT],
                  "activation bytes %llu, %llu with room", (unsigned long long)ta[REKV_XFER_ACT],
                  (unsigned long long)ra[REKV_XFER_ACT]);
    ck_assert_uint_gt(ta[REKV_XFER_KV], ra[REKV_XFER_KV]);
    free(ref.logits), free(roomy.logits), free(tight.logits);
    prompts_free(prompts, B);
    synth_fixture_close(&f, mdir);
}
END_TEST

/* A store whose push backend is not cpu ("auto") is the exec'd rekv-kvstore program, not a forked
 * library child (CUDA cannot be used in a child forked after the parent started it): it pushes the
 * same bytes, so the logits equal pull's. The worker here is cpu, so this runs where "auto" is cpu
 * too; where it is a GPU, test_cuda's pipeline test pushes through the program with cuda. */
START_TEST(push_store_is_the_program)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    if (tu_skip_where_auto_is_gpu("push_store_is_the_program",
                                  "test_cuda pushes through the program"))
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, "auto");
    int lens[] = {37, 5};
    int32_t **prompts = random_prompts(2, lens, f.m->config.vocab);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_HYBRID;
    run pull, push;
    do_run(&f, &cfg, 2, lens, prompts, 3, &pull);
    cfg.push = 1;
    do_run(&f, &cfg, 2, lens, prompts, 3, &push);
    size_t n = (size_t)4 * 2 * f.m->config.vocab;
    ck_assert_msg(memcmp(pull.logits, push.logits, n * sizeof(float)) == 0,
                  "push through the exec'd store differs from pull");
    free(pull.logits), free(push.logits);
    prompts_free(prompts, 2);
    tu_fixture_close(&f);
}
END_TEST

/* ------------------------------------------------------------------ a step bigger than the arena
 */

/* stories260K with an fp32 cache: a KV block and an ACT block are 4 KiB, one page each */
#define SPILL_SLOTS 28
#define SPILL_HOST (4096ull + SPILL_SLOTS * 4096ull)

/* Runs cfg on a fresh store of SPILL_SLOTS slots (a batch whose KV is 3.4x the arena, kvpr's
 * 6.8x: the steps run in layer windows and every sweep spills and reads back); the logits must be
 * resident's bit for bit. *ks gets the store's Stats at the end. */
static void spill_run(const char *path, const rekv_pipeline_config *cfg, const run *ref, int B,
                      const int *lens, int32_t *const *prompts, int steps,
                      const rekv_link_config *link, rekv_kv_stats *ks)
{
    fixture f;
    tu_fixture_open_host(&f, path, REKV_DTYPE_F32, "cpu", SPILL_HOST);
    if (link) { /* a slower device: a window computes while the next one is read */
        rekv_err err = {0};
        rekv_backend_destroy(f.be);
        ck_assert_msg(rekv_backend_cpu_create(link, &f.be, &err) == 0, "%s", err.msg);
    }
    run r;
    do_run(&f, cfg, B, lens, prompts, steps, &r);
    char name[256];
    ck_assert_msg(memcmp(r.logits, ref->logits,
                         sizeof(float) * (size_t)(steps + 1) * B * f.m->config.vocab) == 0,
                  "%s on a small arena: the logits differ from resident's",
                  cfg_name(cfg, name, sizeof(name)));
    ck_assert_int_eq(rekv_kvstore_stats(f.store, ks, NULL), 0);
    ck_assert_msg(ks->bytes_read_back > 0 && ks->bytes_spilled > 0,
                  "%s: nothing spilled (read back %llu bytes)", name,
                  (unsigned long long)ks->bytes_read_back);
    ck_assert_uint_eq(ks->pinned_blocks, 0);
    free(r.logits);
    tu_fixture_close(&f);
}

static void spill_batch(int V, int *B, int **lens, int32_t ***prompts, int *steps)
{
    static int L[] = {20, 9, 33, 14};
    *B = 4, *lens = L, *steps = 50;
    *prompts = random_prompts(4, L, V);
}

/* What the spill tests share: stories260K's path, the batch (spill_batch) and resident's run of it
 * (its own arena holds it all). 0: the model is missing (skipped). */
static int spill_reference(const char **model, int *B, int **lens, int32_t ***prompts, int *steps,
                           run *ref)
{
    const char *path = *model = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return 0;
    rekv_model *m;
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    int V = m->config.vocab;
    rekv_model_close(m);
    spill_batch(V, B, lens, prompts, steps);
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, NULL);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    do_run(&f, &cfg, *B, *lens, *prompts, *steps, ref);
    tu_fixture_close(&f);
    return 1;
}

/* Every exact mode with the batch's KV 3.4x the arena (layer windows, spilled layers read back
 * a window ahead) gives resident's logits bit for bit: row and column schedules, pushed KV rows,
 * one sequence per GPU batch (a unit is one sequence's layer) and all in one. */
START_TEST(spill_windows_exact)
{
    const char *path;
    int B, *lens, steps;
    int32_t **prompts;
    run ref;
    if (!spill_reference(&path, &B, &lens, &prompts, &steps, &ref))
        return;
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    const struct {
        rekv_mode mode;
        int gpu_batches, column, push;
    } runs[] = {
        {REKV_MODE_OFFLOAD, 4, 0, 0}, {REKV_MODE_OFFLOAD, 1, 1, 0}, {REKV_MODE_OFFLOAD, 4, 1, 1},
        {REKV_MODE_KVPR, 4, 0, 0},    {REKV_MODE_ACT, 4, 0, 0},     {REKV_MODE_HYBRID, 4, 1, 0},
    };
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        rekv_pipeline_config_defaults(&cfg);
        cfg.mode = runs[i].mode;
        cfg.gpu_batches = runs[i].gpu_batches;
        cfg.schedule = runs[i].column ? REKV_SCHED_COLUMN : REKV_SCHED_ROW;
        cfg.push = runs[i].push;
        cfg.split = 24;
        rekv_kv_stats ks;
        spill_run(path, &cfg, &ref, B, lens, prompts, steps, NULL, &ks);
    }
    free(ref.logits);
    prompts_free(prompts, B);
}
END_TEST

/* Read-ahead takes the spill reads off the critical path: of the blocks read back, those a pin
 * had to wait for (found on disk or still being read) are a small part — about the first window
 * of the first step, plus reads a pin catches in flight — and the rest were read ahead. */
START_TEST(spill_read_ahead_counts)
{
    const char *path;
    int B, *lens, steps;
    int32_t **prompts;
    run ref;
    if (!spill_reference(&path, &B, &lens, &prompts, &steps, &ref))
        return;
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_OFFLOAD;
    cfg.gpu_batches = 4;
    rekv_kv_stats ks;
    /* each copy takes 1 ms, so a window (two units) computes for milliseconds, as on a GPU with
     * a real model, while its successor's blocks are read (a few 4 KiB reads and writes) */
    rekv_link_config link = {.gbps = 1000, .latency_us = 1000};
    spill_run(path, &cfg, &ref, B, lens, prompts, steps, &link, &ks);
    uint64_t reads = ks.bytes_read_back / 4096;
    fprintf(stderr,
            "   spill_read_ahead_counts: %llu blocks read back, %llu ahead, %llu waited for by a "
            "pin\n",
            (unsigned long long)reads, (unsigned long long)ks.read_ahead_blocks,
            (unsigned long long)ks.pin_wait_blocks);
    ck_assert_uint_gt(reads, 1000);
    ck_assert_msg(ks.pin_wait_blocks * 10 <= reads,
                  "%llu of %llu read-backs were on a pin's critical path",
                  (unsigned long long)ks.pin_wait_blocks, (unsigned long long)reads);
    ck_assert_uint_ge(ks.read_ahead_blocks * 10, reads * 9);
    ck_assert_uint_eq(ks.pin_wait_bytes, ks.pin_wait_blocks * 4096);
    ck_assert_uint_eq(ks.read_ahead_bytes, ks.read_ahead_blocks * 4096);
    free(ref.logits);
    prompts_free(prompts, B);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("pipeline");
    TCase *tc = tcase_create("pipeline");
    tcase_set_timeout(tc, 900);
    tcase_add_test(tc, resident_matches_forward);
    tcase_add_test(tc, step_params_change_nothing);
    tcase_add_test(tc, hybrid_pattern_per_sequence);
    tcase_add_test(tc, modes_stories260k);
    tcase_add_test(tc, modes_synthetic);
    tcase_add_test(tc, push_needs_a_store_that_pushes);
    tcase_add_test(tc, page_lock_refusal_is_reported);
    tcase_add_test(tc, fetch_overlaps_compute);
    tcase_add_test(tc, split_lowered_to_device_memory);
    tcase_add_test(tc, draws_on_device);
    tcase_add_test(tc, graph_steps);
    tcase_add_test(tc, push_store_is_the_program);
    suite_add_tcase(s, tc);
    TCase *ts = tcase_create("spill");
    tcase_set_timeout(ts, 900);
    tcase_add_test(ts, spill_windows_exact);
    tcase_add_test(ts, spill_read_ahead_counts);
    suite_add_tcase(s, ts);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
