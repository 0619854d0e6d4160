/* test_kv_pool.c — InfiniGen's memory-limited KV cache pool (OSDI'24 §4.4; gpuworker/kv_pool.c
 * and its use in pipeline_infinigen.c, `--kv-pool-bytes`):
 *   - the victims of the counter policy and of FIFO on fixed selection traces (saturation and
 *     halving, the older-half candidates, a prompt longer than the pool, ties) equal an
 *     independent numpy model's (tests/kv_pool_ref.py, written from the paper's text and the
 *     authors' code);
 *   - in a pipeline (stories260K, a real kvstore, cpu backend) the pool of every (sequence,
 *     layer > 0, KV head) never holds more than its limit, layer 0 is not pooled, and a decode
 *     step selecting every token fetches exactly the pool's live entries — the evicted ones
 *     never cross the link or reach the attention again;
 *   - with a limit at least the context, the logits are infinigen's without a pool, bit for bit;
 *   - bad input is refused with a clear error: a limit under one block, a mode other than
 *     infinigen, a device part, a prompt longer than the pool (which loses nothing). */
#define _GNU_SOURCE /* asprintf */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/kv_pool.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

typedef tu_fixture fixture;

static uint64_t lcg(uint64_t *x)
{
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return *x >> 33;
}

/* ------------------------------------------------------------------ the policy alone */

/* One trace: len0 entries, then `steps` tokens; each step prefetches the live entry of rank 0 (a
 * sink: it saturates after 255 steps) and a few others, some ranks favoured (rank % 3 == 0 is
 * drawn twice as often), in random order. Runs rekv's pool and the numpy model on it and compares
 * every step's victims. */
static void check_trace(rekv_kv_pool_policy policy, int limit, int len0, int steps, uint64_t seed)
{
    int cap = len0 + steps;
    rekv_kv_pool kp;
    rekv_err err = {0};
    /* two pools: the second one is never touched and must not feel the first's halving */
    ck_assert_msg(rekv_kv_pool_init(&kp, NULL, 2, cap, limit, policy, &err) == 0, "%s", err.msg);
    char *dir = tu_tmpdir(), path[4200], *cmd = NULL, *out = NULL;
    snprintf(path, sizeof(path), "%s/trace.json", dir);
    json_t *jsteps = json_array();
    int32_t *live = malloc(sizeof(int32_t) * (size_t)cap), *pos = malloc(sizeof(int32_t) * 8);
    int32_t *victims = malloc(sizeof(int32_t) * (size_t)cap);
    int **mine = calloc((size_t)steps, sizeof(int *)), *n_mine = calloc((size_t)steps, sizeof(int));
    uint64_t x = seed;
    for (int k = 0; k < steps; k++) {
        int len = len0 + k, n = rekv_kv_pool_live(&kp, 0, len, live), m = 0;
        int ranks[8];
        ranks[m++] = 0;
        for (int tries = 0; tries < 12 && m < 6 && n > 1; tries++) {
            int r = 1 + (int)(lcg(&x) % (uint64_t)(n - 1)), dup = 0;
            if (r % 3 != 0 && lcg(&x) % 2)
                continue;
            for (int i = 0; i < m; i++)
                dup |= ranks[i] == r;
            if (!dup)
                ranks[m++] = r;
        }
        json_t *js = json_array();
        for (int i = 0; i < m; i++) {
            pos[i] = live[ranks[i]];
            json_array_append_new(js, json_integer(ranks[i]));
        }
        json_array_append_new(jsteps, js);
        rekv_kv_pool_touch(&kp, 0, pos, m);
        n_mine[k] = rekv_kv_pool_admit(&kp, 0, len, victims);
        mine[k] = malloc(sizeof(int) * (size_t)(n_mine[k] + 1));
        for (int i = 0; i < n_mine[k]; i++)
            mine[k][i] = victims[i];
        /* never more than the limit once the new entry is in */
        ck_assert_int_le(rekv_kv_pool_live(&kp, 0, len + 1, live), limit);
    }
    json_t *tr = json_pack("{s:s, s:i, s:i, s:o}", "policy",
                           policy == REKV_KV_POOL_FIFO ? "fifo" : "counter", "limit", limit, "len0",
                           len0, "steps", jsteps);
    ck_assert_int_eq(json_dump_file(tr, path, 0), 0);
    json_decref(tr);
    ck_assert_int_gt(asprintf(&cmd, "/usr/bin/python3 tests/kv_pool_ref.py %s", path), 0);
    ck_assert_msg(tu_run(cmd, &out) == 0, "%s failed", cmd);
    json_error_t jerr;
    json_t *ref = json_loads(out, 0, &jerr), *rv = json_object_get(ref, "victims");
    ck_assert_msg(ref != NULL && json_array_size(rv) == (size_t)steps, "%s: %s", cmd, out);
    int evicted = 0;
    for (int k = 0; k < steps; k++) {
        json_t *vk = json_array_get(rv, (size_t)k);
        ck_assert_msg(json_array_size(vk) == (size_t)n_mine[k],
                      "policy %d step %d: %d victims, the model %zu", (int)policy, k, n_mine[k],
                      json_array_size(vk));
        for (int i = 0; i < n_mine[k]; i++)
            ck_assert_msg(json_integer_value(json_array_get(vk, (size_t)i)) == mine[k][i],
                          "policy %d step %d: victim %d, the model's %lld", (int)policy, k,
                          mine[k][i], (long long)json_integer_value(json_array_get(vk, (size_t)i)));
        evicted += n_mine[k];
    }
    ck_assert_int_eq(evicted, len0 + steps > limit ? len0 + steps - limit : 0);
    /* the untouched pool: counters at 0, nothing evicted */
    for (int t = 0; t < cap; t++)
        ck_assert_int_eq(kp.count[(size_t)cap + (size_t)t], 0);
    ck_assert_int_eq(kp.n_gone[1], 0);
    for (int k = 0; k < steps; k++)
        free(mine[k]);
    free(mine), free(n_mine), free(live), free(pos), free(victims);
    json_decref(ref);
    free(out), free(cmd);
    rekv_kv_pool_free(&kp);
    tu_rmrf(dir);
    free(dir);
}

START_TEST(victims_match_the_model)
{
    /* long enough for rank 0 to saturate (255 prefetches) and be halved, twice */
    check_trace(REKV_KV_POOL_COUNTER, 40, 20, 600, 1);
    check_trace(REKV_KV_POOL_COUNTER, 16, 10, 300, 2);
    check_trace(REKV_KV_POOL_COUNTER, 16, 30, 50, 3); /* a prompt past the limit */
    check_trace(REKV_KV_POOL_FIFO, 24, 10, 200, 4);
    check_trace(REKV_KV_POOL_FIFO, 16, 30, 20, 5);
}
END_TEST

/* ------------------------------------------------------------------ in the pipeline */

typedef struct pool_run {
    float *logits;        /* [steps + 1][B][vocab] */
    uint64_t *fetched;    /* [n_layers] tokens fetched by the decode steps */
    uint64_t live_decode; /* sum over decode steps and sequences of the live entries selected */
} pool_run;

/* B sequences prefilled, then `steps` greedy decode steps; after each step checks every pool:
 * at most `limit` live entries of [0, len) (limit 0: no pool), layer 0's untouched. */
static void pool_do_run(fixture *f, const rekv_pipeline_config *cfg, int B, const int *lens,
                        int32_t *const *prompts, int steps, int limit, pool_run *out)
{
    const rekv_model_config *c = &f->m->config;
    int V = c->vocab, L = c->n_layers, nkv = c->n_kv_heads;
    rekv_err err = {0};
    rekv_pipeline *p;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be, f->store, cfg, &p, &err) == 0, "%s", err.msg);
    rekv_pseq *seqs[4];
    rekv_pipe_item items[4];
    int32_t next[4];
    out->logits = malloc(sizeof(float) * (size_t)(steps + 1) * (size_t)B * (size_t)V);
    out->fetched = calloc((size_t)L, sizeof(uint64_t));
    out->live_decode = 0;
    for (int i = 0; i < B; i++) {
        ck_assert_msg(rekv_pseq_create(p, lens[i] + steps, &seqs[i], &err) == 0, "%s", err.msg);
        items[i] = (rekv_pipe_item){.seq = seqs[i],
                                    .tokens = prompts[i],
                                    .n_tokens = lens[i],
                                    .logits = out->logits + (size_t)i * V};
    }
    ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
    rekv_pipeline_counters_reset(p);
    for (int s = 1; s <= steps; s++) {
        for (int i = 0; i < B; i++) {
            next[i] = rekv_argmax(out->logits + ((size_t)(s - 1) * B + i) * V, V);
            int len = rekv_pseq_len(seqs[i]);
            /* what this step selects among: the live entries, at most the limit */
            out->live_decode += (uint64_t)(limit > 0 && len > limit ? limit : len);
            items[i] = (rekv_pipe_item){.seq = seqs[i],
                                        .tokens = &next[i],
                                        .n_tokens = 1,
                                        .logits = out->logits + ((size_t)s * B + i) * V};
        }
        ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
        for (int i = 0; i < B && limit > 0; i++) {
            const rekv_kv_pool *kp = rekv_pseq_kv_pool(seqs[i]);
            ck_assert_ptr_nonnull(kp);
            int len = rekv_pseq_len(seqs[i]);
            for (int pl = 0; pl < L * nkv; pl++) {
                int live = 0;
                for (int t = 0; t < len; t++)
                    live += !kp->gone[(size_t)pl * (size_t)kp->cap + (size_t)t];
                if (pl < nkv) /* layer 0 is fetched whole: not pooled */
                    ck_assert_int_eq(live, len);
                else
                    ck_assert_msg(live == (len < limit ? len : limit),
                                  "seq %d pool %d: %d live of %d, limit %d", i, pl, live, len,
                                  limit);
            }
        }
    }
    const rekv_layer_counters *lc = rekv_pipeline_counters(p, NULL);
    for (int l = 0; l < L; l++)
        out->fetched[l] = lc[l].tokens_fetched;
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
}

static void pool_run_free(pool_run *r)
{
    free(r->logits);
    free(r->fetched);
}

static int32_t **make_prompts(const fixture *f, int B, const int *lens)
{
    int32_t **pr = calloc((size_t)B, sizeof(*pr));
    uint64_t x = 3;
    for (int b = 0; b < B; b++) {
        pr[b] = malloc(sizeof(int32_t) * (size_t)lens[b]);
        for (int i = 0; i < lens[b]; i++)
            pr[b][i] = (int32_t)(lcg(&x) % (uint64_t)f->m->config.vocab);
    }
    return pr;
}

/* bytes of `tokens` entries of layers 1.. at the fp32 cache: the pool's unit */
static size_t pool_bytes(const rekv_model_config *c, int tokens)
{
    return (size_t)tokens * (size_t)(c->n_layers - 1) * 2 * (size_t)c->n_kv_heads *
           (size_t)c->head_dim * sizeof(float);
}

typedef struct pool_fixture {
    fixture f;
    rekv_skew sk;
    rekv_pipeline_config cfg; /* infinigen, no pool */
} pool_fixture;

static int pool_open(pool_fixture *x)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return 0;
    tu_fixture_open(&x->f, path, REKV_DTYPE_F32, "cpu");
    tu_skew_calibrate(&x->f, &x->sk);
    rekv_pipeline_config_defaults(&x->cfg);
    x->cfg.mode = REKV_MODE_INFINIGEN;
    x->cfg.skew = &x->sk;
    return 1;
}

static void pool_close(pool_fixture *x)
{
    rekv_skew_free(&x->sk);
    tu_fixture_close(&x->f);
}

START_TEST(pool_at_least_the_context_changes_nothing)
{
    pool_fixture x;
    if (!pool_open(&x))
        return;
    int lens[] = {40, 25}, steps = 10;
    int32_t **pr = make_prompts(&x.f, 2, lens);
    size_t n = (size_t)(steps + 1) * 2 * (size_t)x.f.m->config.vocab;
    pool_run ref, r;
    pool_do_run(&x.f, &x.cfg, 2, lens, pr, steps, 0, &ref);
    rekv_pipeline_config cfg = x.cfg;
    cfg.kv_pool_bytes = pool_bytes(&x.f.m->config, lens[0] + steps); /* the longest context */
    for (int pol = 0; pol < 2; pol++) {
        cfg.kv_pool_policy = pol ? REKV_KV_POOL_FIFO : REKV_KV_POOL_COUNTER;
        pool_do_run(&x.f, &cfg, 2, lens, pr, steps, lens[0] + steps, &r);
        ck_assert_msg(memcmp(r.logits, ref.logits, n * sizeof(float)) == 0,
                      "policy %d: a pool that holds the context changed the logits", pol);
        pool_run_free(&r);
    }
    pool_run_free(&ref);
    free(pr[0]), free(pr[1]), free(pr);
    pool_close(&x);
}
END_TEST

START_TEST(pool_never_exceeds_its_limit)
{
    pool_fixture x;
    if (!pool_open(&x))
        return;
    const rekv_model_config *c = &x.f.m->config;
    int lens[] = {20, 9}, steps = 40, limit = 24;
    int32_t **pr = make_prompts(&x.f, 2, lens);
    size_t n = (size_t)(steps + 1) * 2 * (size_t)c->vocab;
    rekv_pipeline_config cfg = x.cfg;
    /* every live entry selected (alpha inf, no cap): what a step fetches is the pool exactly */
    cfg.alpha = INFINITY;
    cfg.max_fraction = 1;
    pool_run whole, r;
    pool_do_run(&x.f, &cfg, 2, lens, pr, steps, 0, &whole);
    /* a few bytes short of limit + 1 entries: the limit rounds down */
    cfg.kv_pool_bytes = pool_bytes(c, limit + 1) - 1;
    for (int pol = 0; pol < 2; pol++) {
        cfg.kv_pool_policy = pol ? REKV_KV_POOL_FIFO : REKV_KV_POOL_COUNTER;
        pool_do_run(&x.f, &cfg, 2, lens, pr, steps, limit, &r);
        ck_assert_uint_eq(r.fetched[0], whole.fetched[0]); /* layer 0 whole */
        for (int l = 1; l < c->n_layers; l++)
            ck_assert_msg(r.fetched[l] == r.live_decode,
                          "policy %d layer %d: %llu tokens fetched, %llu live", pol, l,
                          (unsigned long long)r.fetched[l], (unsigned long long)r.live_decode);
        ck_assert_uint_lt(r.live_decode, whole.fetched[1]); /* it did evict */
        /* and the evicted tokens are gone from the attention: other logits */
        ck_assert(memcmp(r.logits, whole.logits, n * sizeof(float)) != 0);
        pool_run_free(&r);
    }
    pool_run_free(&whole);
    free(pr[0]), free(pr[1]), free(pr);
    pool_close(&x);
}
END_TEST

START_TEST(bad_input_refused)
{
    pool_fixture x;
    if (!pool_open(&x))
        return;
    const rekv_model_config *c = &x.f.m->config;
    rekv_pipeline *p = NULL;
    rekv_err err = {0};
    rekv_pipeline_config cfg = x.cfg;
    /* less than one block of 16 tokens */
    cfg.kv_pool_bytes = pool_bytes(c, 16) - 1;
    ck_assert_int_eq(rekv_pipeline_create(x.f.e, x.f.be, x.f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "less than one block") != NULL, "%s", err.msg);
    /* not infinigen */
    cfg.kv_pool_bytes = pool_bytes(c, 32);
    cfg.mode = REKV_MODE_OFFLOAD;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(x.f.e, x.f.be, x.f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "for infinigen, not offload") != NULL, "%s", err.msg);
    /* a device part */
    cfg.mode = REKV_MODE_INFINIGEN;
    cfg.device_tokens = 16;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(x.f.e, x.f.be, x.f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "no device-resident part") != NULL, "%s", err.msg);
    cfg.device_tokens = 0;
    /* a prompt longer than the pool: refused, and the sequence loses nothing */
    ck_assert_msg(rekv_pipeline_create(x.f.e, x.f.be, x.f.store, &cfg, &p, &err) == 0, "%s",
                  err.msg);
    int lens[] = {40};
    int32_t **pr = make_prompts(&x.f, 1, lens);
    rekv_pseq *s;
    float *logits = malloc(sizeof(float) * (size_t)c->vocab);
    ck_assert_msg(rekv_pseq_create(p, 64, &s, &err) == 0, "%s", err.msg);
    rekv_pipe_item it = {.seq = s, .tokens = pr[0], .n_tokens = 40, .logits = logits};
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_step(p, &it, 1, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "do not fit the KV pool of 32 tokens") != NULL, "%s", err.msg);
    ck_assert_int_eq(rekv_pseq_len(s), 0);
    it.n_tokens = 30;
    ck_assert_msg(rekv_pipeline_step(p, &it, 1, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_pseq_len(s), 30);
    rekv_pseq_free(s);
    rekv_pipeline_free(p);
    free(logits);
    free(pr[0]), free(pr);
    pool_close(&x);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kv_pool");
    TCase *tc = tcase_create("kv_pool");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, victims_match_the_model);
    tcase_add_test(tc, bad_input_refused);
    tcase_add_test(tc, pool_at_least_the_context_changes_nothing);
    tcase_add_test(tc, pool_never_exceeds_its_limit);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
