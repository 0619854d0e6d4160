/* test_step_waits.c — how often a decode step blocks the step thread on the device (the backend's
 * host_syncs: every stream_sync and event_sync), on the cpu backend with a real kvstore process,
 * for every mode that streams or keeps its cache, GPU batches 1 and 2, both schedules:
 *   - every step waits once, at its end: one streams_sync of the streams it used (resident: the
 *     compute stream, where the sampled tokens come back, and with its weights offloaded the h2d
 *     stream; a streaming mode's three) — and never within the step: clo's decisions and
 *     infinigen's selection are kernels on the h2d stream, behind the speculation's event
 *     (clo_decide, ig_select), and the rows they name move by a copy whose list they wrote
 *     (copy_h2d_listed), so the device does not wait for the host either;
 *   - infinigen where the plan needs the selection (push, KVPR within the selection on an MHA
 *     model) still waits once per selecting unit, as it says; on GQA a split does not, nor does a
 *     KV pool (its counters and victims are updated on the device too);
 * and that infinigen's tokens did not move with its selection: selecting every token equals
 * resident bit for bit, and the selection the device makes gives the same logits and counters,
 * bit for bit, as the one the step thread makes (push; a split, whose recomputed rows carry the
 * same values; a KV pool that evicts). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

enum { B = 3, STEPS = 3 };
static const int g_lens[B] = {90, 75, 120}; /* clo: past its sink and recent window */

typedef struct env {
    tu_fixture f;
    rekv_skew sk;
    rekv_heads hp;
    char *dir;
    int32_t *prompts[B];
} env;

typedef struct run {
    float *logits;               /* [STEPS + 1][B][vocab] */
    uint64_t syncs[STEPS];       /* each decode step's blocking calls */
    rekv_layer_counters *layers; /* [n_layers] the decode steps' */
} run;

/* A synthetic MHA model (4 heads: a token's activation row is worth recomputing when 3 or 4 of
 * them selected it) */
static const rekv_synth_spec g_mha = {REKV_ARCH_OPT, 3, 64, 4, 4, 128, 300, 1100, REKV_DTYPE_F16,
                                      21, 1};
/* and a GQA one (8 heads, 2 KV heads: an activation row is as wide as a token's K,V of all its
 * heads, so no selected token is ever recomputed) */
static const rekv_synth_spec g_gqa = {REKV_ARCH_LLAMA, 3, 64, 8, 2, 160, 300, 1100,
                                      REKV_DTYPE_F16,  22, 0};

/* spec's model, its store (which can push), skew and a head profile (importance 0.5: clo's
 * heads both hit and miss). */
static void env_open(env *x, const rekv_synth_spec *sp)
{
    rekv_err err = {0};
    char path[4200];
    x->dir = tu_tmpdir();
    snprintf(path, sizeof(path), "%s/m", x->dir);
    ck_assert_msg(rekv_synth_write(sp, path, &err) == 0, "%s", err.msg);
    tu_fixture_open(&x->f, path, REKV_DTYPE_F32, "cpu");
    tu_skew_calibrate(&x->f, &x->sk);
    tu_heads_uniform(&x->f, 0.5, &x->hp);
    uint64_t r = 5;
    for (int b = 0; b < B; b++) {
        x->prompts[b] = malloc(sizeof(int32_t) * (size_t)g_lens[b]);
        for (int i = 0; i < g_lens[b]; i++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            x->prompts[b][i] = (int32_t)((r >> 33) % (uint64_t)sp->vocab);
        }
    }
}

static void env_close(env *x)
{
    for (int b = 0; b < B; b++)
        free(x->prompts[b]);
    rekv_heads_free(&x->hp);
    rekv_skew_free(&x->sk);
    tu_fixture_close(&x->f);
    tu_rmrf(x->dir);
    free(x->dir);
}

static void config(env *x, rekv_mode mode, int gpu_batches, rekv_schedule sched,
                   rekv_pipeline_config *cfg)
{
    rekv_pipeline_config_defaults(cfg);
    cfg->mode = mode;
    cfg->gpu_batches = gpu_batches;
    cfg->schedule = sched;
    cfg->skew = &x->sk;
    cfg->heads = &x->hp;
}

/* The prompts prefilled in one step, then STEPS greedy decode steps, each one's blocking calls
 * counted. */
static void do_run(env *x, const rekv_pipeline_config *cfg, run *out)
{
    tu_fixture *f = &x->f;
    rekv_err err = {0};
    rekv_pipeline *p = NULL;
    int V = f->m->config.vocab, L = f->m->config.n_layers;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be,
                                       cfg->mode == REKV_MODE_RESIDENT ? NULL : f->store, cfg, &p,
                                       &err) == 0,
                  "%s", err.msg);
    rekv_pseq *seqs[B];
    rekv_pipe_item items[B];
    int32_t next[B];
    out->logits = malloc(sizeof(float) * (size_t)(STEPS + 1) * B * (size_t)V);
    out->layers = calloc((size_t)L, sizeof(rekv_layer_counters));
    ck_assert(out->logits && out->layers);
    for (int i = 0; i < B; i++) {
        ck_assert_msg(rekv_pseq_create(p, g_lens[i] + STEPS, &seqs[i], &err) == 0, "%s", err.msg);
        items[i] = (rekv_pipe_item){.seq = seqs[i],
                                    .tokens = x->prompts[i],
                                    .n_tokens = g_lens[i],
                                    .logits = out->logits + (size_t)i * V};
    }
    ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
    rekv_pipeline_counters_reset(p);
    for (int s = 1; s <= STEPS; s++) {
        for (int i = 0; i < B; i++) {
            next[i] = rekv_argmax(out->logits + ((size_t)(s - 1) * B + i) * V, V);
            items[i] = (rekv_pipe_item){.seq = seqs[i],
                                        .tokens = &next[i],
                                        .n_tokens = 1,
                                        .logits = out->logits + ((size_t)s * B + i) * V};
        }
        rekv_backend_stats b0, b1;
        f->be->iface->stats(f->be, &b0);
        ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
        f->be->iface->stats(f->be, &b1);
        out->syncs[s - 1] = b1.host_syncs - b0.host_syncs;
    }
    memcpy(out->layers, rekv_pipeline_counters(p, NULL), sizeof(rekv_layer_counters) * (size_t)L);
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
}

static void run_free(run *r)
{
    free(r->logits);
    free(r->layers);
}

static void expect_syncs(const run *r, uint64_t want, const char *what, int G, rekv_schedule sc)
{
    for (int s = 0; s < STEPS; s++)
        ck_assert_msg(r->syncs[s] == want,
                      "%s, %d GPU batches, %s schedule: decode step %d blocked %llu times, not %llu",
                      what, G, sc == REKV_SCHED_ROW ? "row" : "column", s + 1,
                      (unsigned long long)r->syncs[s], (unsigned long long)want);
}

/* r's logits are ref's, bit for bit, and with counters its selection per selecting layer: the
 * tokens selected (fetched, or recomputed within a split) of those considered */
static void expect_same(const env *x, const run *r, const run *ref, int counters, const char *what)
{
    size_t n = (size_t)(STEPS + 1) * B * (size_t)x->f.m->config.vocab;
    for (size_t k = 0; k < n; k++)
        if (memcmp(&r->logits[k], &ref->logits[k], sizeof(float)) != 0)
            ck_abort_msg("%s: logit %zu is %.9g, the reference's %.9g", what, k,
                         (double)r->logits[k], (double)ref->logits[k]);
    for (int l = 1; counters && l < x->f.m->config.n_layers; l++) {
        const rekv_layer_counters *a = &r->layers[l], *b = &ref->layers[l];
        ck_assert_msg(a->tokens_fetched == b->tokens_fetched &&
                          a->tokens_considered == b->tokens_considered,
                      "%s: layer %d selected %llu of %llu tokens, the reference %llu of %llu", what,
                      l, (unsigned long long)a->tokens_fetched,
                      (unsigned long long)a->tokens_considered,
                      (unsigned long long)b->tokens_fetched,
                      (unsigned long long)b->tokens_considered);
    }
}

static const rekv_schedule g_scheds[] = {REKV_SCHED_ROW, REKV_SCHED_COLUMN};

START_TEST(decode_step_waits)
{
    env x;
    env_open(&x, &g_mha);
    int L = x.f.m->config.n_layers;
    struct {
        const char *name;
        rekv_mode mode;
        int split, push, offload_w, pool;
        uint64_t waits; /* per selecting unit, besides the end's */
    } m[] = {
        {"resident", REKV_MODE_RESIDENT, 0, 0, 0, 0, 0},
        {"resident, weights offloaded", REKV_MODE_RESIDENT, 0, 0, 1, 0, 0},
        {"offload", REKV_MODE_OFFLOAD, 0, 0, 0, 0, 0},
        {"kvpr", REKV_MODE_KVPR, 30, 0, 0, 0, 0},
        {"clo", REKV_MODE_CLO, 0, 0, 0, 0, 0},
        {"infinigen", REKV_MODE_INFINIGEN, 0, 0, 0, 0, 0},
        /* the step thread's own selection, where the plan needs it */
        {"infinigen with push", REKV_MODE_INFINIGEN, 0, 1, 0, 0, 1},
        {"infinigen with a split", REKV_MODE_INFINIGEN, 40, 0, 0, 0, 1},
        {"infinigen with a KV pool", REKV_MODE_INFINIGEN, 0, 0, 0, 1, 0},
    };
    const rekv_model_config *c = &x.f.m->config;
    for (int G = 1; G <= 2; G++)
        for (size_t si = 0; si < 2; si++)
            for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++) {
                rekv_pipeline_config cfg;
                config(&x, m[i].mode, G, g_scheds[si], &cfg);
                cfg.split = m[i].split;
                cfg.push = m[i].push;
                cfg.offload_weights = m[i].offload_w;
                if (m[i].pool) /* one that never fills: the longest prompt and its steps fit */
                    cfg.kv_pool_bytes = (size_t)(g_lens[2] + STEPS) * (size_t)(L - 1) * 2 *
                                        (size_t)c->n_kv_heads * (size_t)c->head_dim * sizeof(float);
                run r;
                do_run(&x, &cfg, &r);
                expect_syncs(&r, 1 + m[i].waits * (uint64_t)(L - 1) * (uint64_t)G, m[i].name, G,
                             g_scheds[si]);
                run_free(&r);
            }
    env_close(&x);
}
END_TEST

START_TEST(infinigen_tokens_unchanged)
{
    env x;
    env_open(&x, &g_mha);
    for (int G = 1; G <= 2; G++)
        for (size_t si = 0; si < 2; si++) {
            rekv_pipeline_config cfg;
            char what[96];
            run ref, all, sel, push, split, pool, pool_push;
            /* every token selected: resident's bits */
            config(&x, REKV_MODE_RESIDENT, G, g_scheds[si], &cfg);
            do_run(&x, &cfg, &ref);
            config(&x, REKV_MODE_INFINIGEN, G, g_scheds[si], &cfg);
            cfg.select = REKV_SELECT_ALL;
            do_run(&x, &cfg, &all);
            snprintf(what, sizeof(what), "every token selected, %d GPU batches, schedule %zu", G,
                     si);
            expect_same(&x, &all, &ref, 0, what);
            /* the speculated selection, made on the stream and by the step thread */
            config(&x, REKV_MODE_INFINIGEN, G, g_scheds[si], &cfg);
            do_run(&x, &cfg, &sel);
            ck_assert_msg(memcmp(sel.logits, ref.logits,
                                 sizeof(float) * (STEPS + 1) * B * (size_t)x.f.m->config.vocab),
                          "the speculated selection took every token");
            cfg.push = 1;
            do_run(&x, &cfg, &push);
            snprintf(what, sizeof(what), "push's selection, %d GPU batches, schedule %zu", G, si);
            expect_same(&x, &push, &sel, 1, what);
            cfg.push = 0;
            cfg.split = 40;
            do_run(&x, &cfg, &split);
            snprintf(what, sizeof(what), "the split's selection, %d GPU batches, schedule %zu", G,
                     si);
            expect_same(&x, &split, &sel, 1, what);
            uint64_t recomputed = 0;
            for (int l = 1; l < x.f.m->config.n_layers; l++)
                recomputed += split.layers[l].tokens_recomputed;
            ck_assert_msg(recomputed > 0, "the split recomputed no selected token");
            /* a KV pool one token past the longest prompt (a prefill attends every token): the
             * longest sequence evicts from its second decode step on, and the counters and
             * victims move on the device as on the step thread */
            const rekv_model_config *c = &x.f.m->config;
            cfg.split = 0;
            cfg.kv_pool_bytes = (size_t)(g_lens[2] + 1) * (size_t)(c->n_layers - 1) * 2 *
                                (size_t)c->n_kv_heads * (size_t)c->head_dim * sizeof(float);
            do_run(&x, &cfg, &pool);
            cfg.push = 1;
            do_run(&x, &cfg, &pool_push);
            snprintf(what, sizeof(what), "a KV pool's selection, %d GPU batches, schedule %zu", G,
                     si);
            expect_same(&x, &pool_push, &pool, 1, what);
            run_free(&ref), run_free(&all), run_free(&sel), run_free(&push), run_free(&split);
            run_free(&pool), run_free(&pool_push);
        }
    env_close(&x);
}
END_TEST

/* KVPR within the selection on GQA: the split recomputes layer 0's [0, split) as kvpr does and
 * never a selected token, so the selection stays on the stream — no wait of its own — with the
 * step thread's bits (push) */
START_TEST(gqa_split_does_not_wait)
{
    env x;
    env_open(&x, &g_gqa);
    for (int G = 1; G <= 2; G++)
        for (size_t si = 0; si < 2; si++) {
            rekv_pipeline_config cfg;
            char what[96];
            run r, push;
            config(&x, REKV_MODE_INFINIGEN, G, g_scheds[si], &cfg);
            cfg.split = 40;
            do_run(&x, &cfg, &r);
            expect_syncs(&r, 1, "GQA infinigen with a split", G, g_scheds[si]);
            ck_assert_uint_gt(r.layers[0].tokens_recomputed, 0);
            for (int l = 1; l < x.f.m->config.n_layers; l++)
                ck_assert_uint_eq(r.layers[l].tokens_recomputed, 0);
            cfg.push = 1;
            do_run(&x, &cfg, &push);
            snprintf(what, sizeof(what), "GQA, a split, %d GPU batches, schedule %zu", G, si);
            expect_same(&x, &r, &push, 1, what);
            run_free(&r), run_free(&push);
        }
    env_close(&x);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("step_waits");
    TCase *tc = tcase_create("step_waits");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, decode_step_waits);
    tcase_add_test(tc, infinigen_tokens_unchanged);
    tcase_add_test(tc, gqa_split_does_not_wait);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
