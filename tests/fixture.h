/* fixture.h — a model loaded for compute with a private kvstore beside it: what the pipeline
 * tests (test_pipeline on cpu, test_cuda on cuda) run every mode against. Header-only, like
 * ipc_peer.h: a .c file beside the tests would be linked into every test and pull the backends (and
 * the CUDA libraries) into tests that measure their own memory. */
#ifndef REKV_TESTS_FIXTURE_H
#define REKV_TESTS_FIXTURE_H

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "gpuworker/gpuworker.h"
#include "gpuworker/heads.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"

/* For a test that needs a program's "auto" backend to be cpu: where it is a GPU, prints
 * "skip: NAME: ... (WHY)" and returns 1. */
static inline int tu_skip_where_auto_is_gpu(const char *name, const char *why)
{
    rekv_backend *be = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_backend_create("auto", NULL, &be, NULL, 0, &err) == 0, "%s", err.msg);
    int gpu = strcmp(be->iface->name, "cpu") != 0;
    rekv_backend_destroy(be);
    if (gpu)
        printf("   skip: %s: \"auto\" is this machine's GPU (%s)\n", name, why);
    return gpu;
}

typedef struct tu_fixture {
    rekv_model *m;
    rekv_engine *e;
    rekv_backend *be; /* a cpu backend */
    pid_t store_pid;
    rekv_kvstore_client *store;
    char *dir;
} tu_fixture;

/* Opens model_path, creates its engine and a cpu backend, and spawns a private kvstore (256 MiB,
 * cache dtype `cache`, push backend push_backend: NULL for a store that cannot push) in a fresh
 * temporary directory, connected. Fails the test on any error. */
/* The same with an arena of host_bytes (a store whose blocks spill). */
static inline void tu_fixture_open_host(tu_fixture *f, const char *model_path, rekv_dtype cache,
                                        const char *push_backend, uint64_t host_bytes)
{
    rekv_err err = {0};
    memset(f, 0, sizeof(*f));
    ck_assert_msg(rekv_model_open(model_path, &f->m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(f->m, &f->e, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_backend_cpu_create(NULL, &f->be, &err) == 0, "%s", err.msg);
    f->dir = tu_tmpdir();
    char ep[4200];
    snprintf(ep, sizeof(ep), "ipc://%s/kv.sock", f->dir);
    rekv_kvstore_config cfg;
    rekv_kvstore_config_defaults(&cfg);
    cfg.endpoint = ep;
    cfg.host_bytes = host_bytes;
    cfg.spill_dir = f->dir;
    cfg.push_backend = push_backend;
    ck_assert_msg(rekv_kv_geometry_from_config(&f->m->config, cache, &cfg.geometry, &err) == 0,
                  "%s", err.msg);
    ck_assert_msg(rekv_kvstore_spawn(&cfg, &f->store_pid, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_kvstore_client_connect(ep, NULL, 30000, &f->store, &err) == 0, "%s",
                  err.msg);
}

static inline void tu_fixture_open(tu_fixture *f, const char *model_path, rekv_dtype cache,
                                   const char *push_backend)
{
    tu_fixture_open_host(f, model_path, cache, push_backend, 256ull << 20);
}

/* Stops the store (which must exit cleanly; store_pid 0: a test ended it already) and frees
 * everything. */
static inline void tu_fixture_close(tu_fixture *f)
{
    rekv_kvstore_client_close(f->store);
    if (f->store_pid > 0)
        ck_assert_int_eq(rekv_kvstore_reap(f->store_pid), 0);
    rekv_backend_destroy(f->be);
    rekv_engine_free(f->e);
    rekv_model_close(f->m);
    tu_rmrf(f->dir);
    free(f->dir);
}

/* f's model's skew, calibrated on a short sample of pseudo-random tokens (gpuworker/skew.h):
 * what infinigen and clo need. */
static inline void tu_skew_calibrate(tu_fixture *f, rekv_skew *sk)
{
    rekv_err err = {0};
    const rekv_model_config *c = &f->m->config;
    int n = c->max_pos < 96 ? c->max_pos : 96;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    uint64_t x = 7;
    for (int i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((x >> 33) % (uint64_t)c->vocab);
    }
    ck_assert_msg(rekv_skew_calibrate(f->e, ids, n, REKV_SKEW_DEFAULT_RATIO, sk, &err) == 0, "%s",
                  err.msg);
    free(ids);
}

/* A head profile of f's model with every head's importance imp and adjacent-query cosine 0.5 (the
 * thresholds follow: 1 with eta 1 -> tau 1, every head misses; 0 -> tau -1, every head hits once
 * its cache is built): what clo needs. rekv_heads_free frees it. */
static inline void tu_heads_uniform(const tu_fixture *f, double imp, rekv_heads *h)
{
    const rekv_model_config *c = &f->m->config;
    memset(h, 0, sizeof(*h));
    h->n_layers = c->n_layers;
    h->n_heads = c->n_heads;
    h->n_kv_heads = c->n_kv_heads;
    size_t n = (size_t)c->n_layers * (size_t)c->n_heads;
    h->importance = malloc(sizeof(double) * n);
    h->adjacent_cos = malloc(sizeof(double) * n);
    for (size_t i = 0; i < n; i++) {
        h->importance[i] = imp;
        h->adjacent_cos[i] = 0.5;
    }
}

/* The device bytes a pipeline of cfg holds once it has prefilled prompts and run one decode
 * step, on f's store and a cpu backend emulating a device of 1 GiB. */
static inline size_t tu_device_use(tu_fixture *f, const rekv_pipeline_config *cfg, int B,
                                   const int *lens, int32_t *const *prompts)
{
    rekv_err err = {0};
    rekv_link_config link = {.device_bytes = 1ull << 30};
    rekv_backend *be = NULL;
    ck_assert_msg(rekv_backend_cpu_create(&link, &be, &err) == 0, "%s", err.msg);
    rekv_pipeline *p = NULL;
    ck_assert_msg(rekv_pipeline_create(f->e, be, f->store, cfg, &p, &err) == 0, "%s", err.msg);
    rekv_pseq *seqs[8];
    rekv_pipe_item items[8];
    float *logits = malloc(sizeof(float) * (size_t)B * (size_t)f->m->config.vocab);
    int32_t one = 3;
    ck_assert(B <= 8 && logits != NULL);
    for (int i = 0; i < B; i++) {
        ck_assert_msg(rekv_pseq_create(p, lens[i] + 1, &seqs[i], &err) == 0, "%s", err.msg);
        items[i] = (rekv_pipe_item){.seq = seqs[i],
                                    .tokens = prompts[i],
                                    .n_tokens = lens[i],
                                    .logits = logits + (size_t)i * f->m->config.vocab};
    }
    for (int k = 0; k < 2; k++) { /* the prefill, one decode step */
        ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
        for (int i = 0; i < B; i++)
            items[i].tokens = &one, items[i].n_tokens = 1;
    }
    size_t fr = 0, tot = 0;
    ck_assert_msg(be->iface->mem_info(be, &fr, &tot, &err) == 0, "%s", err.msg);
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
    rekv_backend_destroy(be);
    free(logits);
    return tot - fr;
}

/* The engine's logits of tok[0..T) (vocabulary V) do not depend on how the prompt is cut: the
 * prompt at once, a token at a time, and two chunks at cut give the same bits. */
static inline void tu_forward_cut_invariant(rekv_engine *e, const int32_t *tok, int T, int V,
                                            int cut)
{
    rekv_err err = {0};
    size_t n = (size_t)T * (size_t)V;
    float *all = malloc(n * sizeof(float)), *one = malloc(n * sizeof(float)),
          *two = malloc(n * sizeof(float));
    ck_assert(all && one && two);
    rekv_seq *a, *b, *c;
    ck_assert_int_eq(rekv_seq_create(e, T, &a, &err), 0);
    ck_assert_int_eq(rekv_seq_create(e, T, &b, &err), 0);
    ck_assert_int_eq(rekv_seq_create(e, T, &c, &err), 0);
    rekv_batch_item it = {a, tok, T, 1, all};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    for (int i = 0; i < T; i++) {
        it = (rekv_batch_item){b, tok + i, 1, 1, one + (size_t)i * V};
        ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    }
    it = (rekv_batch_item){c, tok, cut, 1, two};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    it = (rekv_batch_item){c, tok + cut, T - cut, 1, two + (size_t)cut * V};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    ck_assert_msg(memcmp(all, one, n * sizeof(float)) == 0, "prefill and decode differ");
    ck_assert_msg(memcmp(all, two, n * sizeof(float)) == 0, "one chunk and two differ");
    rekv_seq_free(a);
    rekv_seq_free(b);
    rekv_seq_free(c);
    free(all);
    free(one);
    free(two);
}

/* The pipeline's kernels (cpu backend) on f's model, in resident and the exact streaming modes
 * (offload with and without a device-resident part of 16 tokens, act, kvpr at split 20, hybrid
 * 1:1), against forward.c bit for bit at every step: the prompt (len tokens) in one chunk, then
 * `steps` greedy decode steps over a vocabulary of V. what names the model in a failure. */
static inline void tu_pipeline_matches_forward(tu_fixture *f, const char *what,
                                               const int32_t *prompt, int len, int steps, int V)
{
    static const struct {
        rekv_mode mode;
        int split, kv_parts, act_parts, device_tokens;
    } modes[] = {{REKV_MODE_RESIDENT, 0, 0, 0, 0}, {REKV_MODE_OFFLOAD, 0, 0, 0, 0},
                 {REKV_MODE_OFFLOAD, 0, 0, 0, 16}, {REKV_MODE_ACT, 0, 0, 0, 0},
                 {REKV_MODE_KVPR, 20, 0, 0, 0},    {REKV_MODE_HYBRID, 0, 1, 1, 0}};
    float *lp = malloc(sizeof(float) * (size_t)V), *lf = malloc(sizeof(float) * (size_t)V);
    ck_assert(lp && lf);
    for (size_t mi = 0; mi < sizeof(modes) / sizeof(modes[0]); mi++) {
        rekv_err err = {0};
        rekv_pipeline_config cfg;
        rekv_pipeline_config_defaults(&cfg);
        cfg.mode = modes[mi].mode;
        cfg.split = modes[mi].split;
        cfg.kv_parts = modes[mi].kv_parts;
        cfg.act_parts = modes[mi].act_parts;
        cfg.device_tokens = modes[mi].device_tokens;
        rekv_pipeline *p;
        ck_assert_msg(rekv_pipeline_create(f->e, f->be,
                                           cfg.mode == REKV_MODE_RESIDENT ? NULL : f->store, &cfg,
                                           &p, &err) == 0,
                      "%s: %s", rekv_mode_name(cfg.mode), err.msg);
        rekv_pseq *ps;
        rekv_seq *s;
        ck_assert_msg(rekv_pseq_create(p, len + steps, &ps, &err) == 0, "%s", err.msg);
        ck_assert_int_eq(rekv_seq_create(f->e, len + steps, &s, &err), 0);
        int32_t next = 0;
        for (int k = 0; k <= steps; k++) {
            const int32_t *tok = k == 0 ? prompt : &next;
            int n = k == 0 ? len : 1;
            rekv_pipe_item pi = {.seq = ps, .tokens = tok, .n_tokens = n, .logits = lp};
            ck_assert_msg(rekv_pipeline_step(p, &pi, 1, &err) == 0, "%s", err.msg);
            rekv_batch_item it = {s, tok, n, 0, lf};
            ck_assert_msg(rekv_engine_forward(f->e, &it, 1, &err) == 0, "%s", err.msg);
            ck_assert_msg(memcmp(lp, lf, sizeof(float) * (size_t)V) == 0,
                          "%s, mode %s (device tokens %d), step %d: the pipeline and forward.c "
                          "differ",
                          what, rekv_mode_name(cfg.mode), cfg.device_tokens, k);
            next = rekv_argmax(lf, V);
        }
        rekv_seq_free(s);
        rekv_pseq_free(ps);
        rekv_pipeline_free(p);
    }
    free(lp);
    free(lf);
}

/* The largest |got - want| over rows x cols, want a JSON array of rows of numbers (a NaN counts
 * as the largest); the largest |want| into *scale where scale is not NULL. */
static inline double tu_max_abs_error(const float *got, json_t *want, int rows, int cols,
                                      double *scale)
{
    double worst = 0, big = 0;
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < cols; v++) {
            double w =
                json_number_value(json_array_get(json_array_get(want, (size_t)i), (size_t)v));
            double d = fabs((double)got[(size_t)i * cols + v] - w);
            worst = d > worst || isnan(d) ? d : worst;
            big = fabs(w) > big ? fabs(w) : big;
        }
    if (scale)
        *scale = big;
    return worst;
}

#endif
