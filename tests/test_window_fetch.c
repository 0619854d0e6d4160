/* test_window_fetch.c — a layer with a sliding window W moves only its window: in each streaming
 * mode (offload, act, kvpr, hybrid; with a device-resident part and ACT_GPU too) a step whose
 * first query is at position C serves a windowed layer exactly the tokens of
 * [C - W + 1, C + n) rounded out to whole 16-token blocks — fetched over the link, recomputed from
 * activations or copied from the device part, as the pipeline's per-layer counters count them, and
 * never one before — while a layer without a window is served its whole context; the tokens and
 * logits stay resident's bit for bit. Over a Mistral-style model (every layer windowed) and a
 * Gemma-2-style one (the even layers only), two sequences batched in one step (one past the
 * window, one inside it), a chunked prompt, and decode steps that slide the window across a block
 * boundary. The store frees the blocks behind every layer's window as it passes them (Mistral:
 * every layer windowed; Gemma-2 keeps them all). The planner prices a windowed layer's context as
 * min(context, W + 15). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/planner.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/pipeline.h"
#include "loader/loader.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

enum {
    V = 256,
    W = 20, /* not a multiple of 16: the window's start is rounded down to its block */
    LAYERS = 4,
    CHUNK = 40,  /* sequence A's prompt comes in two chunks: 40, then 30 tokens */
    LEN_A = 70,  /* past the window */
    LEN_B = 9,   /* inside it: served whole */
    DECODE = 14, /* A's context 70..83: its windowed layers' first block moves from 48 to 64 */
    STEPS = 2 + DECODE,
    BLK = 16,
};

/* A synthetic 4-layer Llama-family model (hidden 64, 4 heads over 2 KV heads, head_dim 16, fp32,
 * seed 7) with extra rekv-loader synth options, into dir/name. */
static void synth(const char *dir, const char *name, const char *opts)
{
    char *cmd = NULL;
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers %d --hidden 64 --heads 4 "
                              "--kv-heads 2 --ffn 128 --vocab %d --dtype f32 --seed 7 "
                              "--max-pos 128 %s %s/%s >/dev/null",
                              tu_bin("rekv-loader"), LAYERS, V, opts, dir, name),
                     0);
    tu_run_ok(cmd);
    free(cmd);
}

/* What the brief of the window asks, written here on its own: the first position a step's
 * queries at layer l can attend when the first of them is at position ctx, rounded down to its
 * block; 0 without a window at l. */
static int window_first(const rekv_model_config *c, int l, int ctx)
{
    int w = rekv_config_window(c, l);
    if (w <= 0 || ctx - w + 1 <= 0)
        return 0;
    return (ctx - w + 1) / BLK * BLK;
}

/* The schedule: item 0 is sequence A, item 1 sequence B; step k's tokens of each (a prompt chunk,
 * else the token resident chose at the step before). */
typedef struct run_log {
    float logits[STEPS][2][V];
    int32_t next[STEPS][2];
} run_log;

static const int32_t *step_tokens(const int32_t *pa, const int32_t *pb, const run_log *ref,
                                  int step, int item, int *n)
{
    if (item == 0 && step == 0)
        return *n = CHUNK, pa;
    if (item == 0 && step == 1)
        return *n = LEN_A - CHUNK, pa + CHUNK;
    if (item == 1 && step == 0)
        return *n = LEN_B, pb;
    *n = 1;
    return &ref->next[step - 1][item];
}

typedef struct mode_case {
    rekv_mode mode;
    int split, kv_parts, act_parts, device_tokens, act_gpu_blocks;
} mode_case;

/* After a step that left the two sequences at contexts ctx: the store holds every block of
 * theirs but those wholly behind the window of every layer (freed as the window passes; a model
 * with an unwindowed layer, and ACT_GPU, whose device copy counts ACT blocks from the first,
 * keep them all) — of both of kvpr's sequences (K,V and activations). */
static void check_store_blocks(tu_fixture *f, const char *model, const mode_case *mc,
                               const int *ctx, int step)
{
    const rekv_model_config *c = &f->m->config;
    uint64_t want = 0;
    for (int i = 0; i < 2; i++) {
        int behind = mc->act_gpu_blocks ? 0 : ctx[i];
        for (int l = 0; l < LAYERS; l++)
            behind = window_first(c, l, ctx[i]) < behind ? window_first(c, l, ctx[i]) : behind;
        want += (uint64_t)((ctx[i] + BLK - 1) / BLK - behind / BLK);
    }
    want *= (uint64_t)LAYERS * (mc->mode == REKV_MODE_KVPR ? 2 : 1);
    rekv_kv_stats ks;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_stats(f->store, &ks, &err) == 0, "%s", err.msg);
    uint64_t got = ks.host_kv + ks.host_act + ks.disk_kv + ks.disk_act;
    ck_assert_msg(got == want,
                  "%s, mode %s (ACT_GPU %d), after step %d (contexts %d, %d): the store holds "
                  "%llu blocks, want %llu",
                  model, rekv_mode_name(mc->mode), mc->act_gpu_blocks, step, ctx[0], ctx[1],
                  (unsigned long long)got, (unsigned long long)want);
}

/* Runs the schedule through one pipeline. ref NULL: resident, recording into out (its logits and
 * greedy tokens); else a streaming mode fed ref's tokens, whose logits must be ref's bit for bit
 * and whose per-layer counters must show each layer served exactly its window's blocks. */
static void run_mode(tu_fixture *f, const char *model, const mode_case *mc, const run_log *ref,
                     run_log *out)
{
    const rekv_model_config *c = &f->m->config;
    static int32_t pa[LEN_A], pb[LEN_B];
    for (int i = 0; i < LEN_A; i++)
        pa[i] = (int32_t)((i * 53 + 3) % V);
    for (int i = 0; i < LEN_B; i++)
        pb[i] = (int32_t)((i * 31 + 7) % V);
    rekv_err err = {0};
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = mc->mode;
    cfg.split = mc->split;
    cfg.kv_parts = mc->kv_parts;
    cfg.act_parts = mc->act_parts;
    cfg.device_tokens = mc->device_tokens;
    cfg.act_gpu_blocks = mc->act_gpu_blocks;
    rekv_pipeline *p;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be, ref ? f->store : NULL, &cfg, &p, &err) == 0,
                  "%s: %s", rekv_mode_name(cfg.mode), err.msg);
    rekv_pseq *ps[2];
    for (int i = 0; i < 2; i++)
        ck_assert_msg(rekv_pseq_create(p, LEN_A + DECODE + 2, &ps[i], &err) == 0, "%s", err.msg);
    const run_log *toks = ref ? ref : out;
    size_t kv_row = 2 * (size_t)c->n_kv_heads * (size_t)c->head_dim * sizeof(float);
    int ctx[2] = {0, 0};
    for (int step = 0; step < STEPS; step++) {
        float lg[2][V];
        rekv_pipe_item pi[2];
        for (int i = 0; i < 2; i++) {
            int n;
            const int32_t *t = step_tokens(pa, pb, toks, step, i, &n);
            pi[i] = (rekv_pipe_item){.seq = ps[i], .tokens = t, .n_tokens = n, .logits = lg[i]};
        }
        rekv_pipeline_counters_reset(p);
        ck_assert_msg(rekv_pipeline_step(p, pi, 2, &err) == 0, "%s", err.msg);
        for (int i = 0; i < 2; i++) {
            if (ref == NULL) {
                memcpy(out->logits[step][i], lg[i], sizeof(lg[i]));
                out->next[step][i] = rekv_argmax(lg[i], V);
            } else {
                ck_assert_msg(memcmp(lg[i], ref->logits[step][i], sizeof(lg[i])) == 0,
                              "%s, mode %s (device tokens %d, ACT_GPU %d), step %d, sequence "
                              "%d: the logits differ from resident's",
                              model, rekv_mode_name(mc->mode), mc->device_tokens,
                              mc->act_gpu_blocks, step, i);
            }
        }
        const rekv_layer_counters *lc = rekv_pipeline_counters(p, NULL);
        for (int l = 0; ref && l < LAYERS; l++) {
            uint64_t want = 0;
            for (int i = 0; i < 2; i++)
                want += (uint64_t)(ctx[i] - window_first(c, l, ctx[i]));
            uint64_t got = lc[l].tokens_fetched + lc[l].tokens_recomputed + lc[l].tokens_device;
            ck_assert_msg(got == want,
                          "%s, mode %s (device tokens %d, ACT_GPU %d), step %d (contexts %d, %d), "
                          "layer %d (window %d): served %llu context tokens (fetched %llu, "
                          "recomputed %llu, device %llu), the window's blocks hold %llu",
                          model, rekv_mode_name(mc->mode), mc->device_tokens, mc->act_gpu_blocks,
                          step, ctx[0], ctx[1], l, rekv_config_window(c, l),
                          (unsigned long long)got, (unsigned long long)lc[l].tokens_fetched,
                          (unsigned long long)lc[l].tokens_recomputed,
                          (unsigned long long)lc[l].tokens_device, (unsigned long long)want);
            /* the link carries the fetched rows and nothing else of K,V */
            ck_assert_uint_eq(lc[l].h2d_bytes[REKV_XFER_KV], lc[l].tokens_fetched * kv_row);
            if (mc->act_gpu_blocks == 0) /* ... and the recomputed rows' activations */
                ck_assert_uint_eq(lc[l].h2d_bytes[REKV_XFER_ACT],
                                  lc[l].tokens_recomputed * (uint64_t)c->hidden * sizeof(float));
        }
        for (int i = 0; i < 2; i++)
            ctx[i] += pi[i].n_tokens;
        if (ref)
            check_store_blocks(f, model, mc, ctx, step);
    }
    for (int i = 0; i < 2; i++)
        rekv_pseq_free(ps[i]);
    rekv_pipeline_free(p);
}

/* host_bytes: the store's arena (0: the fixture's 256 MiB). */
static void window_fetch_model(const char *opts, const char *name, int windowed_layers,
                               uint64_t host_bytes)
{
    static const mode_case modes[] = {
        {REKV_MODE_OFFLOAD, 0, 0, 0, 0, 0}, {REKV_MODE_OFFLOAD, 0, 0, 0, 64, 0},
        {REKV_MODE_ACT, 0, 0, 0, 0, 0},     {REKV_MODE_ACT, 0, 0, 0, 0, 2},
        {REKV_MODE_KVPR, 56, 0, 0, 0, 0},   {REKV_MODE_KVPR, 56, 0, 0, 32, 0},
        {REKV_MODE_HYBRID, 0, 1, 1, 0, 0},  {REKV_MODE_HYBRID, 0, 1, 1, 64, 0},
    };
    char *dir = tu_tmpdir(), mdir[600];
    synth(dir, name, opts);
    snprintf(mdir, sizeof(mdir), "%s/%s", dir, name);
    tu_fixture f;
    tu_fixture_open_host(&f, mdir, REKV_DTYPE_F32, NULL, host_bytes ? host_bytes : 256ull << 20);
    int n = 0;
    for (int l = 0; l < LAYERS; l++)
        n += rekv_config_window(&f.m->config, l) == W;
    ck_assert_int_eq(n, windowed_layers);
    run_log *ref = calloc(1, sizeof(*ref));
    ck_assert_ptr_nonnull(ref);
    static const mode_case resident = {REKV_MODE_RESIDENT, 0, 0, 0, 0, 0};
    run_mode(&f, name, &resident, NULL, ref);
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++)
        run_mode(&f, name, &modes[i], ref, NULL);
    if (host_bytes) { /* the arena was small enough: blocks went to disk and came back */
        rekv_kv_stats ks;
        rekv_err err = {0};
        ck_assert_msg(rekv_kvstore_stats(f.store, &ks, &err) == 0, "%s", err.msg);
        ck_assert_msg(ks.bytes_spilled > 0 && ks.bytes_read_back > 0,
                      "spilled %llu bytes, read back %llu", (unsigned long long)ks.bytes_spilled,
                      (unsigned long long)ks.bytes_read_back);
    }
    free(ref);
    tu_fixture_close(&f);
    tu_rmrf(dir);
    free(dir);
}

/* Mistral: every layer windowed. */
START_TEST(mistral_fetches_only_the_window)
{
    window_fetch_model("--sliding-window 20", "mistral", LAYERS, 0);
}
END_TEST

/* The same through a store whose arena holds less than a step's blocks: steps pinned in layer
 * windows, blocks spilled and read back — from where each layer's window starts. */
START_TEST(mistral_window_through_a_small_arena)
{
    window_fetch_model("--sliding-window 20", "mistral", LAYERS, 64 << 10);
}
END_TEST

/* Gemma-2: the even layers windowed, the odd ones served whole. */
START_TEST(gemma2_fetches_only_the_even_layers_window)
{
    window_fetch_model("--gemma2 --sliding-window 20", "gemma2", LAYERS / 2, 0);
}
END_TEST

/* Logits of prompt then `steps` greedy tokens (resident's, in want; NULL: record them there)
 * through a pipeline of cfg: a first sequence over `first` (published to the prefix cache when
 * freed), then one over prompt made with rekv_pseq_create_prefix, which must start from the
 * cache. */
enum { PX_LEN = 70, PX_STEPS = 6 };
static void prefix_run(tu_fixture *f, const rekv_pipeline_config *cfg, const int32_t *first,
                       const int32_t *prompt, float (*want)[V], float (*out)[V])
{
    rekv_err err = {0};
    rekv_pipeline *p;
    int resident = cfg->mode == REKV_MODE_RESIDENT;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be, resident ? NULL : f->store, cfg, &p, &err) == 0,
                  "%s: %s", rekv_mode_name(cfg->mode), err.msg);
    rekv_pseq *s;
    float lg[V];
    if (!resident) { /* the first sequence fills the cache */
        ck_assert_msg(rekv_pseq_create(p, PX_LEN + 1, &s, &err) == 0, "%s", err.msg);
        rekv_pipe_item pi = {.seq = s, .tokens = first, .n_tokens = PX_LEN, .logits = lg};
        ck_assert_msg(rekv_pipeline_step(p, &pi, 1, &err) == 0, "%s", err.msg);
        rekv_pseq_free(s);
    }
    ck_assert_msg(rekv_pseq_create_prefix(p, PX_LEN + PX_STEPS, prompt, PX_LEN, &s, &err) == 0,
                  "%s", err.msg);
    int at = rekv_pseq_len(s);
    if (!resident)
        ck_assert_int_ge(at, 48); /* the shared blocks came from the cache */
    int32_t next = 0;
    for (int step = 0; step <= PX_STEPS; step++) {
        rekv_pipe_item pi = {.seq = s,
                             .tokens = step ? &next : prompt + at,
                             .n_tokens = step ? 1 : PX_LEN - at,
                             .logits = out[step]};
        ck_assert_msg(rekv_pipeline_step(p, &pi, 1, &err) == 0, "%s", err.msg);
        if (want)
            ck_assert_msg(memcmp(out[step], want[step], sizeof(out[step])) == 0,
                          "mode %s (device tokens %d, ACT_GPU %d) from the prefix cache (%d "
                          "tokens), step %d: the logits differ from resident's",
                          rekv_mode_name(cfg->mode), cfg->device_tokens, cfg->act_gpu_blocks, at,
                          step);
        next = rekv_argmax(want ? want[step] : out[step], V);
    }
    rekv_pseq_free(s);
    rekv_pipeline_free(p);
}

/* A sequence that starts from the prefix cache's blocks (shared with the sequence that made
 * them, so never freed: the cache keeps every block) takes the window as any other: resident's
 * logits in every streaming mode, with a device part made from the cached blocks (offload, kvpr)
 * or by the first step from the cached activations (act, hybrid: the whole context once), and
 * ACT_GPU's copy. */
START_TEST(prefix_cache_keeps_the_window_exact)
{
    static const mode_case modes[] = {
        {REKV_MODE_OFFLOAD, 0, 0, 0, 0, 0}, {REKV_MODE_OFFLOAD, 0, 0, 0, 32, 0},
        {REKV_MODE_ACT, 0, 0, 0, 0, 0},     {REKV_MODE_ACT, 0, 0, 0, 32, 0},
        {REKV_MODE_ACT, 0, 0, 0, 0, 2},     {REKV_MODE_KVPR, 56, 0, 0, 32, 0},
        {REKV_MODE_HYBRID, 0, 1, 1, 32, 0},
    };
    char *dir = tu_tmpdir(), mdir[600];
    synth(dir, "mistral", "--sliding-window 20");
    snprintf(mdir, sizeof(mdir), "%s/mistral", dir);
    tu_fixture f;
    tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
    int32_t first[PX_LEN], prompt[PX_LEN];
    for (int i = 0; i < PX_LEN; i++) { /* the same first 52 tokens, then apart */
        first[i] = (int32_t)((i * 53 + 3) % V);
        prompt[i] = i < 52 ? first[i] : (int32_t)((i * 29 + 11) % V);
    }
    float(*want)[V] = calloc(PX_STEPS + 1, sizeof(*want));
    float(*out)[V] = calloc(PX_STEPS + 1, sizeof(*out));
    ck_assert(want && out);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    prefix_run(&f, &cfg, first, prompt, NULL, want);
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
        rekv_pipeline_config_defaults(&cfg);
        cfg.mode = modes[i].mode;
        cfg.split = modes[i].split;
        cfg.kv_parts = modes[i].kv_parts;
        cfg.act_parts = modes[i].act_parts;
        cfg.device_tokens = modes[i].device_tokens;
        cfg.act_gpu_blocks = modes[i].act_gpu_blocks;
        cfg.prefix_cache = 1;
        prefix_run(&f, &cfg, first, prompt, want, out);
    }
    free(want);
    free(out);
    tu_fixture_close(&f);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* The planner prices the mean layer: a windowed one at min(context, W + 15) tokens. */
START_TEST(planner_prices_the_window)
{
    rekv_model_config c;
    memset(&c, 0, sizeof(c));
    c.hidden = 64, c.n_heads = 4, c.n_kv_heads = 2, c.head_dim = 16, c.ffn = 128;
    c.n_layers = LAYERS, c.vocab = V, c.sliding_window = W;
    rekv_plan_model m;
    rekv_step_shape sh;
    rekv_plan_model_from_config(&c, &m);
    rekv_plan_shape(&m, 1, 1000, 2, 0, &sh);
    ck_assert_int_eq(sh.kv.s, W + 15); /* every layer windowed */
    rekv_plan_shape(&m, 1, 30, 2, 0, &sh);
    ck_assert_int_eq(sh.kv.s, 30); /* inside the window: the whole context */
    c.window_even_layers = 1;
    rekv_plan_model_from_config(&c, &m);
    rekv_plan_shape(&m, 1, 1000, 2, 0, &sh);
    ck_assert_int_eq(sh.kv.s, 518); /* half the layers windowed: (2 * 35 + 2 * 1000) / 4, rounded */
    c.sliding_window = 0;
    rekv_plan_model_from_config(&c, &m);
    rekv_plan_shape(&m, 1, 1000, 2, 0, &sh);
    ck_assert_int_eq(sh.kv.s, 1000);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("window_fetch");
    TCase *tc = tcase_create("window_fetch");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, mistral_fetches_only_the_window);
    tcase_add_test(tc, gemma2_fetches_only_the_even_layers_window);
    tcase_add_test(tc, mistral_window_through_a_small_arena);
    tcase_add_test(tc, prefix_cache_keeps_the_window_exact);
    tcase_add_test(tc, planner_prices_the_window);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
