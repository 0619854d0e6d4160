/* test_prefix_pipeline.c — the prefix cache through the engine (stories260K, cpu backend, fp32,
 * a real kvstore process): the batcher's jobs start from the store's cached blocks of their
 * prompt and prefill only the rest, and their tokens and the logits before the first token are
 * rekv_generate's bit for bit — the same prompt twice, a prompt sharing a prefix with an earlier
 * one (diverging inside a block), a prompt that continues an earlier job's output (multi-turn),
 * with the device-resident part copied from the cached blocks, in act, hybrid and kvpr modes,
 * resident's device cache loaded from blocks offload cached, infinigen and clo with their cached
 * tokens' partial keys rebuilt (against the same mode without the cache), and with the cache off.
 * ACT_GPU's device copy taken from the cached blocks (act, hybrid, kvpr), act's and hybrid's
 * device part made by the first step from the cached activations. At the end every block is back:
 * after the jobs and the cache are dropped, every slot of the arena is free. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpuworker/batcher.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/heads.h"
#include "gpuworker/skew.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

#define MODEL_REL "models/stories260K/stories260K.bin"
#define TOP 4
#define MAX_NEW 12

typedef struct result {
    int32_t ids[MAX_NEW];
    float top[MAX_NEW * TOP]; /* the largest logits before each token */
    int n, cached;
} result;

static void prompt_make(int32_t *p, int n, uint64_t seed, int vocab)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (int32_t)((seed >> 33) % (uint64_t)vocab);
    }
}

static rekv_gen_params params(void)
{
    rekv_gen_params gp = {.max_new_tokens = MAX_NEW, .top_p = 1.0f, .top_logits = TOP};
    return gp;
}

static void reference(tu_fixture *f, const int32_t *prompt, int n, result *r)
{
    rekv_gen_params gp = params();
    rekv_gen_result g;
    rekv_err err = {0};
    ck_assert_msg(rekv_generate(f->e, prompt, n, &gp, &g, &err) == 0, "%s", err.msg);
    memset(r, 0, sizeof(*r));
    r->n = g.n;
    memcpy(r->ids, g.ids, sizeof(int32_t) * (size_t)g.n);
    memcpy(r->top, g.top_vals, sizeof(float) * (size_t)g.n * TOP);
    rekv_gen_result_free(&g);
}

/* Runs one job alone on b to its end. */
static void run_job(rekv_batcher *b, uint64_t job, const int32_t *prompt, int n, result *r)
{
    rekv_gen_params gp = params();
    rekv_err err = {0};
    memset(r, 0, sizeof(*r));
    ck_assert_msg(rekv_batcher_join(b, job, prompt, n, &gp, &err) == 0, "%s", err.msg);
    r->cached = rekv_batcher_cached_tokens(b, job);
    for (int done = 0; !done;) {
        const rekv_batch_event *ev;
        int ne;
        ck_assert_msg(rekv_batcher_step(b, &ev, &ne, &err) == 0, "%s", err.msg);
        ck_assert_int_eq(ne, 1);
        if (ev[0].token >= 0) {
            memcpy(r->top + r->n * TOP, ev[0].top_vals, sizeof(float) * TOP);
            r->ids[r->n++] = ev[0].token;
        }
        done = ev[0].finished;
    }
}

static void assert_same(const result *got, const result *want, const char *what)
{
    ck_assert_msg(got->n == want->n, "%s: %d tokens, rekv_generate %d", what, got->n, want->n);
    ck_assert_msg(memcmp(got->ids, want->ids, sizeof(int32_t) * (size_t)got->n) == 0,
                  "%s: tokens differ from the reference's", what);
    ck_assert_msg(memcmp(got->top, want->top, sizeof(float) * (size_t)got->n * TOP) == 0,
                  "%s: logits differ from the reference's (not bit for bit)", what);
}

typedef struct env {
    tu_fixture f;
    rekv_pipeline *p;
    rekv_batcher *b;
} env;

/* host_bytes 0: the fixture's 256 MiB arena; act_gpu: ACT_GPU's blocks per layer; cache: the
 * store's and the pipeline's cache dtype */
static int env_open_dt(env *v, rekv_mode mode, int prefix, int device_tokens, int act_gpu,
                       uint64_t host_bytes, rekv_dtype cache)
{
    const char *m = tu_shared(MODEL_REL);
    if (m == NULL)
        return 0;
    tu_fixture_open_host(&v->f, m, cache, NULL, host_bytes ? host_bytes : 256ull << 20);
    rekv_pipeline_config pc;
    rekv_pipeline_config_defaults(&pc);
    pc.mode = mode;
    pc.cache_dtype = cache;
    pc.prefix_cache = prefix;
    pc.device_tokens = device_tokens;
    pc.split = 20; /* kvpr: recomputes tokens [0, 20) from the cached activations */
    pc.act_gpu_blocks = act_gpu;
    rekv_err err = {0};
    ck_assert_msg(rekv_pipeline_create(v->f.e, v->f.be, v->f.store, &pc, &v->p, &err) == 0, "%s",
                  err.msg);
    ck_assert_msg(rekv_batcher_create(v->p, rekv_engine_config(v->f.e), 4, &v->b, &err) == 0, "%s",
                  err.msg);
    return 1;
}

static int env_open_cfg(env *v, rekv_mode mode, int prefix, int device_tokens, int act_gpu,
                        uint64_t host_bytes)
{
    return env_open_dt(v, mode, prefix, device_tokens, act_gpu, host_bytes, REKV_DTYPE_F32);
}

static int env_open_host(env *v, rekv_mode mode, int prefix, int device_tokens, uint64_t host_bytes)
{
    return env_open_cfg(v, mode, prefix, device_tokens, 0, host_bytes);
}

static int env_open(env *v, rekv_mode mode, int prefix, int device_tokens)
{
    return env_open_host(v, mode, prefix, device_tokens, 0);
}

/* Frees the jobs and the pipeline, clears the cache: every block back (no leaked reference). */
static void env_close(env *v)
{
    rekv_batcher_free(v->b);
    rekv_pipeline_free(v->p);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_cache_clear(v->f.store, NULL), 0);
    do /* a block freed while its spill write is in flight gives its slot back at completion */
        ck_assert_int_eq(rekv_kvstore_stats(v->f.store, &st, NULL), 0);
    while (st.spills_in_flight + st.reads_in_flight > 0);
    ck_assert_int_eq(st.sequences, 0);
    ck_assert_int_eq(st.host_kv + st.host_act + st.disk_kv + st.disk_act, 0);
    ck_assert_int_eq(st.free_slots, st.total_slots);
    tu_fixture_close(&v->f);
}

static rekv_kv_stats store_stats(env *v)
{
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(v->f.store, &st, NULL), 0);
    return st;
}

/* The same prompt twice, then one sharing its first 40 tokens (diverging inside block 2). */
static void same_and_shared_act(rekv_mode mode, int device_tokens, int act_gpu)
{
    env v;
    if (!env_open_cfg(&v, mode, 1, device_tokens, act_gpu, 0))
        return;
    int vocab = rekv_engine_config(v.f.e)->vocab;
    int32_t a[70], c[55];
    prompt_make(a, 70, 11, vocab);
    memcpy(c, a, sizeof(int32_t) * 40);
    prompt_make(c + 40, 15, 12, vocab);
    result ra, rc, got;
    reference(&v.f, a, 70, &ra);
    reference(&v.f, c, 55, &rc);
    run_job(v.b, 1, a, 70, &got);
    ck_assert_int_eq(got.cached, 0);
    assert_same(&got, &ra, "first run");
    rekv_pipeline_counters_reset(v.p);
    run_job(v.b, 2, a, 70, &got);
    ck_assert_int_eq(got.cached, 64); /* 4 full blocks of the 69 before the last token */
    assert_same(&got, &ra, "the same prompt again");
    rekv_layer_counters tot;
    rekv_pipeline_counters(v.p, &tot);
    if (device_tokens) /* the device part, made from the cache, served the context */
        ck_assert_uint_gt(tot.tokens_device, 0);
    run_job(v.b, 3, c, 55, &got);
    ck_assert_int_eq(got.cached, 32);
    assert_same(&got, &rc, "a shared prefix");
    rekv_kv_stats st = store_stats(&v);
    int seqs = mode == REKV_MODE_KVPR ? 2 : 1; /* kvpr: K,V and activations, each from the cache */
    ck_assert_int_eq(st.prefix_hit_tokens, 96 * seqs);
    ck_assert_int_eq(st.prefix_lookups, 3 * seqs);
    env_close(&v);
}

static void same_and_shared(rekv_mode mode, int device_tokens)
{
    same_and_shared_act(mode, device_tokens, 0);
}

START_TEST(offload_same_and_shared)
{
    same_and_shared(REKV_MODE_OFFLOAD, 0);
}
END_TEST

/* The device-resident part (the first 24 tokens' K,V on the device) comes from the cached
 * blocks. */
START_TEST(offload_device_part)
{
    same_and_shared(REKV_MODE_OFFLOAD, 24);
}
END_TEST

START_TEST(act_same_and_shared)
{
    same_and_shared(REKV_MODE_ACT, 0);
}
END_TEST

START_TEST(hybrid_same_and_shared)
{
    same_and_shared(REKV_MODE_HYBRID, 0);
}
END_TEST

/* kvpr's two sequences (K,V and activations) from the same cached run, with a device part. */
START_TEST(kvpr_same_and_shared)
{
    same_and_shared(REKV_MODE_KVPR, 8);
}
END_TEST

/* ACT_GPU (the first 2 ACT blocks of every layer kept on the device) copied from the cached
 * blocks: act, hybrid (whose pattern interleaves KV and ACT blocks) and kvpr (with a device part
 * too). */
START_TEST(act_gpu_same_and_shared)
{
    same_and_shared_act(REKV_MODE_ACT, 0, 2);
    same_and_shared_act(REKV_MODE_HYBRID, 0, 2);
    same_and_shared_act(REKV_MODE_KVPR, 8, 2);
}
END_TEST

/* Act's and hybrid's device part (the first 24 tokens' K,V on the device) is made by the first
 * step of a job from the cache, which recomputes the context from the cached activations; then
 * with ACT_GPU too. */
START_TEST(act_device_part_same_and_shared)
{
    same_and_shared(REKV_MODE_ACT, 24);
    same_and_shared(REKV_MODE_HYBRID, 24);
    same_and_shared_act(REKV_MODE_HYBRID, 24, 2);
}
END_TEST

/* Resident keeps its KV cache on the device and nothing in the store, so it publishes nothing:
 * its jobs take the K,V blocks another mode's jobs cached on the same store, loaded into the
 * device cache instead of prefilled. An offload pipeline beside it publishes. */
START_TEST(resident_from_cached_blocks)
{
    env v;
    if (!env_open(&v, REKV_MODE_RESIDENT, 1, 0))
        return;
    rekv_pipeline_config pc;
    rekv_pipeline_config_defaults(&pc);
    pc.mode = REKV_MODE_OFFLOAD;
    pc.prefix_cache = 1;
    rekv_pipeline *po;
    rekv_batcher *bo;
    rekv_err err = {0};
    ck_assert_msg(rekv_pipeline_create(v.f.e, v.f.be, v.f.store, &pc, &po, &err) == 0, "%s",
                  err.msg);
    ck_assert_msg(rekv_batcher_create(po, rekv_engine_config(v.f.e), 4, &bo, &err) == 0, "%s",
                  err.msg);
    int vocab = rekv_engine_config(v.f.e)->vocab;
    int32_t a[70], c[55];
    prompt_make(a, 70, 71, vocab);
    memcpy(c, a, sizeof(int32_t) * 40);
    prompt_make(c + 40, 15, 72, vocab);
    result ra, rc, got;
    reference(&v.f, a, 70, &ra);
    reference(&v.f, c, 55, &rc);
    run_job(v.b, 1, a, 70, &got); /* resident alone: nothing cached, nothing published */
    ck_assert_int_eq(got.cached, 0);
    assert_same(&got, &ra, "resident, first run");
    run_job(v.b, 2, a, 70, &got);
    ck_assert_int_eq(got.cached, 0);
    run_job(bo, 3, a, 70, &got); /* offload publishes the prompt's blocks */
    ck_assert_int_eq(got.cached, 0);
    run_job(v.b, 4, a, 70, &got);
    ck_assert_int_eq(got.cached, 64);
    assert_same(&got, &ra, "resident, the same prompt from offload's blocks");
    run_job(v.b, 5, c, 55, &got);
    ck_assert_int_eq(got.cached, 32);
    assert_same(&got, &rc, "resident, a shared prefix");
    rekv_batcher_free(bo);
    rekv_pipeline_free(po);
    rekv_kv_stats st = store_stats(&v);
    ck_assert_int_eq(st.prefix_hit_tokens, 96);
    env_close(&v);
}
END_TEST

/* A pipeline of mode m on v's fixture and store, with the prefix cache or not, and its batcher;
 * sk: the skew (the modes that speculate). */
static void pipe_open(env *v, rekv_mode m, int prefix, const rekv_skew *sk, const rekv_heads *hp,
                      rekv_pipeline **p, rekv_batcher **b)
{
    rekv_pipeline_config pc;
    rekv_pipeline_config_defaults(&pc);
    pc.mode = m;
    pc.cache_dtype = rekv_pipeline_get_config(v->p)->cache_dtype; /* the store's */
    pc.prefix_cache = prefix;
    pc.skew = sk;
    pc.heads = hp;
    rekv_err err = {0};
    ck_assert_msg(rekv_pipeline_create(v->f.e, v->f.be, v->f.store, &pc, p, &err) == 0, "%s",
                  err.msg);
    ck_assert_msg(rekv_batcher_create(*p, rekv_engine_config(v->f.e), 4, b, &err) == 0, "%s",
                  err.msg);
}

/* InfiniGen and clo speculate over each context token's partial key: a job from the cache gets
 * those of its cached tokens rebuilt from their K rows, and then selects as without the cache —
 * a real selection (the default cap: a fifth of the context fetched; clo's heads all hitting once
 * their caches are built, so its labels decide) — so its tokens and logits are the same mode's
 * without the cache, bit for bit, in every cache dtype (a partial key is made from the K row as
 * the cache holds it, new or cached). */
static void speculating_same_and_shared(rekv_mode mode, rekv_dtype cache)
{
    env v; /* the fixture and store; its offload pipeline unused */
    if (!env_open_dt(&v, REKV_MODE_OFFLOAD, 0, 0, 0, 0, cache))
        return;
    rekv_skew sk;
    rekv_heads hp;
    tu_skew_calibrate(&v.f, &sk);
    tu_heads_uniform(&v.f, 0, &hp);
    rekv_pipeline *p0, *p1;
    rekv_batcher *b0, *b1;
    pipe_open(&v, mode, 0, &sk, &hp, &p0, &b0);
    pipe_open(&v, mode, 1, &sk, &hp, &p1, &b1);
    int vocab = rekv_engine_config(v.f.e)->vocab;
    /* contexts long enough that the selection chooses (clo: more tokens between the sink and
     * the recent window than its top-k holds) */
    int32_t a[200], c[150];
    prompt_make(a, 200, 81, vocab);
    memcpy(c, a, sizeof(int32_t) * 100);
    prompt_make(c + 100, 50, 82, vocab);
    result ra, rc, got;
    run_job(b0, 1, a, 200, &ra); /* the cache off: the references */
    run_job(b0, 2, c, 150, &rc);
    ck_assert_int_eq(ra.cached + rc.cached, 0);
    run_job(b1, 3, a, 200, &got);
    ck_assert_int_eq(got.cached, 0);
    assert_same(&got, &ra, "first run");
    run_job(b1, 4, a, 200, &got);
    ck_assert_int_eq(got.cached, 192);
    assert_same(&got, &ra, "the same prompt from the cache");
    run_job(b1, 5, c, 150, &got);
    ck_assert_int_eq(got.cached, 96);
    assert_same(&got, &rc, "a shared prefix");
    /* a's first 193 tokens: 192 are cached, but a one-row step would run sparsely, so the
     * cache gives 176 and the first step prefills 17, as without the cache */
    result rd;
    run_job(b0, 6, a, 193, &rd);
    run_job(b1, 7, a, 193, &got);
    ck_assert_int_eq(got.cached, 176);
    assert_same(&got, &rd, "one token past the cached blocks");
    uint64_t considered, selected;
    rekv_pipeline_selected_fraction(rekv_pipeline_counters(p1, NULL),
                                    rekv_engine_config(v.f.e)->n_layers, &considered, &selected);
    ck_assert_uint_lt(selected, considered); /* it selected */
    rekv_layer_counters tot;
    rekv_pipeline_counters(p1, &tot);
    if (rekv_mode_info_of(mode)->head_caches) /* clo's labels decided */
        ck_assert_uint_gt(tot.head_hits, 0);
    rekv_batcher_free(b1);
    rekv_pipeline_free(p1);
    rekv_batcher_free(b0);
    rekv_pipeline_free(p0);
    rekv_heads_free(&hp);
    rekv_skew_free(&sk);
    env_close(&v);
}

static const rekv_dtype cache_dtypes[] = {REKV_DTYPE_F32, REKV_DTYPE_F16, REKV_DTYPE_I8,
                                          REKV_DTYPE_I4};

START_TEST(infinigen_same_and_shared)
{
    speculating_same_and_shared(REKV_MODE_INFINIGEN, cache_dtypes[_i]);
}
END_TEST

START_TEST(clo_same_and_shared)
{
    speculating_same_and_shared(REKV_MODE_CLO, cache_dtypes[_i]);
}
END_TEST

/* Multi-turn: the second prompt is the first, its answer and more; the first job published its
 * generated tokens' blocks too. */
START_TEST(offload_next_turn)
{
    env v;
    if (!env_open(&v, REKV_MODE_OFFLOAD, 1, 0))
        return;
    int vocab = rekv_engine_config(v.f.e)->vocab;
    int32_t a[40], t2[40 + MAX_NEW + 9];
    prompt_make(a, 40, 21, vocab);
    result r1, ref, got;
    run_job(v.b, 1, a, 40, &r1);
    memcpy(t2, a, sizeof(a));
    memcpy(t2 + 40, r1.ids, sizeof(int32_t) * MAX_NEW);
    prompt_make(t2 + 40 + MAX_NEW, 9, 22, vocab);
    int n2 = 40 + MAX_NEW + 9;
    reference(&v.f, t2, n2, &ref);
    run_job(v.b, 2, t2, n2, &got);
    /* job 1 held 40 + 11 tokens (the last one drawn is never fed back): 3 full blocks */
    ck_assert_int_eq(got.cached, 48);
    assert_same(&got, &ref, "the next turn");
    env_close(&v);
}
END_TEST

/* A running job's blocks are published as they fill: a job with the same prompt joining while
 * the first still decodes starts from them, and both give rekv_generate's tokens. */
START_TEST(offload_published_as_filled)
{
    env v;
    if (!env_open(&v, REKV_MODE_OFFLOAD, 1, 0))
        return;
    int vocab = rekv_engine_config(v.f.e)->vocab;
    int32_t a[70];
    prompt_make(a, 70, 61, vocab);
    result ref, got[2];
    reference(&v.f, a, 70, &ref);
    rekv_gen_params gp = params();
    rekv_err err = {0};
    memset(got, 0, sizeof(got));
    ck_assert_msg(rekv_batcher_join(v.b, 0, a, 70, &gp, &err) == 0, "%s", err.msg);
    int live = 1;
    for (int step = 0; live > 0; step++) {
        if (step == 2) { /* job 0 prefilled, then decoded once (publishing its 4 full blocks) */
            ck_assert_msg(rekv_batcher_join(v.b, 1, a, 70, &gp, &err) == 0, "%s", err.msg);
            ck_assert_int_eq(rekv_batcher_cached_tokens(v.b, 1), 64);
            live++;
        }
        const rekv_batch_event *ev;
        int ne;
        ck_assert_msg(rekv_batcher_step(v.b, &ev, &ne, &err) == 0, "%s", err.msg);
        for (int i = 0; i < ne; i++) {
            result *r = &got[ev[i].job];
            if (ev[i].token >= 0) {
                memcpy(r->top + r->n * TOP, ev[i].top_vals, sizeof(float) * TOP);
                r->ids[r->n++] = ev[i].token;
            }
            live -= ev[i].finished;
        }
    }
    assert_same(&got[0], &ref, "the first job");
    assert_same(&got[1], &ref, "a job joining while it runs");
    env_close(&v);
}
END_TEST

/* Off: nothing looked up or published, the same tokens. */
START_TEST(offload_cache_off)
{
    env v;
    if (!env_open(&v, REKV_MODE_OFFLOAD, 0, 0))
        return;
    int vocab = rekv_engine_config(v.f.e)->vocab;
    int32_t a[50];
    prompt_make(a, 50, 31, vocab);
    result ref, got;
    reference(&v.f, a, 50, &ref);
    for (uint64_t j = 1; j <= 2; j++) {
        run_job(v.b, j, a, 50, &got);
        ck_assert_int_eq(got.cached, 0);
        assert_same(&got, &ref, "cache off");
    }
    rekv_kv_stats st = store_stats(&v);
    ck_assert_int_eq(st.prefix_lookups, 0);
    ck_assert_int_eq(st.prefix_published_blocks, 0);
    env_close(&v);
}
END_TEST

/* Jobs sharing prefixes joining together and cancelled mid-prefill or mid-decode (chunked
 * prefill of 8 tokens): the survivors' tokens are rekv_generate's and no reference leaks. */
START_TEST(offload_mixed_cancels)
{
    env v;
    if (!env_open(&v, REKV_MODE_OFFLOAD, 1, 0))
        return;
    int vocab = rekv_engine_config(v.f.e)->vocab;
    enum { J = 12 };
    int32_t base[64], pr[J][80];
    int n[J];
    prompt_make(base, 64, 41, vocab);
    result ref[J];
    for (int j = 0; j < J; j++) {
        int shared = (j % 4) * 16 + (j % 3) * 5; /* 0..63 tokens of base, then their own */
        n[j] = shared + 10 + j % 7;
        memcpy(pr[j], base, sizeof(int32_t) * (size_t)shared);
        prompt_make(pr[j] + shared, n[j] - shared, 100 + (uint64_t)j, vocab);
        reference(&v.f, pr[j], n[j], &ref[j]);
    }
    rekv_batcher_set_prefill_chunk(v.b, 8);
    rekv_gen_params gp = params();
    rekv_err err = {0};
    result got[J];
    memset(got, 0, sizeof(got));
    int next = 0, live = 0, step = 0;
    while (next < J || live > 0) {
        while (next < J && rekv_batcher_running(v.b) < 4) {
            ck_assert_msg(rekv_batcher_join(v.b, (uint64_t)next, pr[next], n[next], &gp, &err) == 0,
                          "%s", err.msg);
            got[next].cached = rekv_batcher_cached_tokens(v.b, (uint64_t)next);
            next++, live++;
        }
        const rekv_batch_event *ev;
        int ne;
        ck_assert_msg(rekv_batcher_step(v.b, &ev, &ne, &err) == 0, "%s", err.msg);
        for (int i = 0; i < ne; i++) {
            result *r = &got[ev[i].job];
            if (ev[i].token >= 0) {
                memcpy(r->top + r->n * TOP, ev[i].top_vals, sizeof(float) * TOP);
                r->ids[r->n++] = ev[i].token;
            }
            live -= ev[i].finished;
        }
        /* every third job is cancelled a few steps after it joined */
        if (++step % 5 == 0 && next > 0 && (next - 1) % 3 == 2 &&
            rekv_batcher_cancel(v.b, (uint64_t)(next - 1)) == 0) {
            got[next - 1].n = -1;
            live--;
        }
    }
    int hits = 0;
    for (int j = 0; j < J; j++) {
        hits += got[j].cached > 0;
        if (got[j].n >= 0)
            assert_same(&got[j], &ref[j], "a mixed job");
    }
    ck_assert_int_gt(hits, 0);
    env_close(&v);
}
END_TEST

/* A cached block on disk corrupted under the store: the job that took it fails its step with
 * -EAGAIN (a failure that passes: the worker runs it again), the block has left the cache, and
 * the job run again prefills and gives rekv_generate's tokens. */
START_TEST(offload_corrupt_cached_block)
{
    env v;
    if (!env_open_host(&v, REKV_MODE_OFFLOAD, 1, 0, 512 << 10))
        return;
    rekv_kvstore_client *k = v.f.store;
    int vocab = rekv_engine_config(v.f.e)->vocab, L = rekv_engine_config(v.f.e)->n_layers;
    int32_t a[70];
    prompt_make(a, 70, 51, vocab);
    result ref, got;
    reference(&v.f, a, 70, &ref);
    run_job(v.b, 1, a, 70, &got);
    /* a sequence as big as the arena: the cache's blocks go to disk first */
    rekv_kv_stats st = store_stats(&v);
    uint64_t fill = 1ull << 40, probe = fill + 2;
    ck_assert_int_eq(rekv_kvstore_seq_create(k, fill, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(k, fill, st.total_slots / (uint64_t)L * 16, 0, 0, NULL,
                                         NULL),
                     0);
    rekv_kv_prefix px = {a, 69, rekv_pipeline_get_config(v.p)->fingerprint, 1, 0};
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(k, probe, &px, &h, NULL), 0);
    ck_assert_int_eq(h.tokens, 64);
    rekv_kv_table_entry *t;
    size_t n;
    ck_assert_int_eq(rekv_kvstore_table(k, probe, 0, &t, &n, NULL, NULL), 0);
    ck_assert_int_eq(t[0].tier, REKV_KV_TIER_DISK);
    int fd = tu_spill_fd(v.f.store_pid, v.f.dir);
    ck_assert_int_ge(fd, 0);
    uint64_t slot = st.kv_slot_bytes > st.act_slot_bytes ? st.kv_slot_bytes : st.act_slot_bytes;
    off_t at = (off_t)(t[0].phys * slot + 64);
    free(t);
    uint8_t byte;
    ck_assert_int_eq(pread(fd, &byte, 1, at), 1);
    byte ^= 0x10;
    ck_assert_int_eq(pwrite(fd, &byte, 1, at), 1);
    close(fd);
    ck_assert_int_eq(rekv_kvstore_seq_drop(k, probe, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(k, fill, NULL), 0);

    rekv_gen_params gp = params();
    rekv_err err = {0};
    ck_assert_msg(rekv_batcher_join(v.b, 2, a, 70, &gp, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_batcher_cached_tokens(v.b, 2), 64);
    const rekv_batch_event *ev;
    int ne;
    int src = rekv_batcher_step(v.b, &ev, &ne, &err);
    ck_assert_msg(src == -EAGAIN, "step: %d %s", src, err.msg);
    rekv_batcher_clear(v.b); /* the worker's way: the job runs again */
    run_job(v.b, 3, a, 70, &got);
    ck_assert_int_eq(got.cached, 0);
    assert_same(&got, &ref, "run again after a corrupted cached block");
    env_close(&v);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("prefix_pipeline");
    TCase *tc = tcase_create("prefix_pipeline");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, offload_same_and_shared);
    tcase_add_test(tc, offload_device_part);
    tcase_add_test(tc, act_same_and_shared);
    tcase_add_test(tc, hybrid_same_and_shared);
    tcase_add_test(tc, kvpr_same_and_shared);
    tcase_add_test(tc, act_gpu_same_and_shared);
    tcase_add_test(tc, act_device_part_same_and_shared);
    tcase_add_test(tc, resident_from_cached_blocks);
    tcase_add_loop_test(tc, infinigen_same_and_shared, 0, 4);
    tcase_add_loop_test(tc, clo_same_and_shared, 0, 4);
    tcase_add_test(tc, offload_next_turn);
    tcase_add_test(tc, offload_published_as_filled);
    tcase_add_test(tc, offload_cache_off);
    tcase_add_test(tc, offload_mixed_cancels);
    tcase_add_test(tc, offload_corrupt_cached_block);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
