/* test_prefix_admission.c — admission with the prefix cache, and `rekv stats`' prefix counters
 * (issue 37 items 3-4): real rekv-kvstore, rekv-coordinator and an offload rekv-gpuworker
 * (stories260K: 5 layers, a 4 KiB K,V block per 16 tokens of a layer; an arena of 36 block
 * positions, no spill tier; an emulated slow link, so that a job's 200 steps outlast the test's
 * few calls — a bound from below only).
 *
 * Job A (a 200-token prompt, 200 new: 25 positions) runs; job B shares A's first 192 prompt
 * tokens (12 full blocks) and would take 19 positions at its full length: 25 + 19 is more than the
 * arena, so at full price B waits for A. With the prefix cache, once A has published its prompt's
 * blocks, B's sequence shares them: admission prices B at its 7 other positions and B runs beside
 * A, its status saying 192 prompt tokens came from the cache. With the worker's cache off, B
 * waits for A (held for room), as before. After both, `rekv stats` shows the store's prefix
 * counters: 2 lookups, 192 hit tokens, 60 host blocks (12 positions x 5 layers), none from disk,
 * no eviction, no bytes read back; and with a spill tier, hits from disk and the bytes read back
 * for them, as the store itself counts them. Admission is optimistic: a prefix gone from the cache
 * when the worker makes the sequence makes the store refuse room, and the jobs run again. */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/co_env.h"
#include "tests/testutil.h"

#define N_PROMPT 200
#define SHARED 192

static uint64_t submit(rekv_ctl *c, const int32_t *prompt, int n, int max_new)
{
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    smp.top_p = 1.0f;
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.n_prompt_ids = (size_t)n;
    s.prompt_ids = (int32_t *)prompt;
    s.sampling = &smp;
    s.max_new_tokens = (uint32_t)max_new;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "submit: %s", r->error);
    uint64_t id = r->submitted->job;
    rekv__control__response__free_unpacked(r, NULL);
    return id;
}

static void cancel(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__Cancel s = REKV__CONTROL__CANCEL__INIT;
    s.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    rq.cancel = &s;
    rekv__control__response__free_unpacked(tu_ctl_call(c, &rq), NULL);
}

/* Job id's state, its generated tokens so far, its cached tokens and whether it waits for room. */
static int job_state(rekv_ctl *c, uint64_t id, size_t *gen, uint32_t *cached, int *waits)
{
    Rekv__Control__Response *r = tu_ctl_status(c, id);
    int st = r->job->state;
    if (gen)
        *gen = r->job->n_generated_ids;
    if (cached)
        *cached = r->job->cached_tokens;
    if (waits)
        *waits = strstr(r->job->waiting, "waiting for kvstore room") != NULL;
    rekv__control__response__free_unpacked(r, NULL);
    return st;
}

static int ended(int st)
{
    return st != REKV__CONTROL__JOB_STATE__QUEUED && st != REKV__CONTROL__JOB_STATE__RUNNING;
}

static pid_t start_worker(env *e, const char *prefix_cache)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,          "--model", e->model,         "--coordinator", e->wrk,
                          "--max-batch", "8",       "--heartbeat-ms", "100",           "--kvstore",
                          e->kv,         "--mode",  "offload",        "--backend",     "cpu",
                          "--link-gbps", "0.1",     "--prefix-cache", prefix_cache,    "--name",
                          "w0",          NULL};
    return ct_spawn(args);
}

typedef struct run {
    env e;
    pid_t kv, co, wk;
    rekv_ctl *c;
    rekv_kvstore_client *k;
} run;

static int run_open(run *r, const char *prefix_cache)
{
    if (ct_env_open(&r->e))
        return 0;
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,       "--endpoint",   r->e.kv,  "--model",
                           r->e.model, "--host-bytes", "741376", "--cache-dtype",
                           "f32",      "--no-spill",   NULL};
    r->kv = ct_spawn(kargs);
    r->k = ct_kv_open(&r->e);
    rekv_kv_stats kst;
    ct_kv_stats(r->k, &kst);
    ck_assert_uint_eq(kst.host_bytes, 36 * 5 * 4096);
    r->co = ct_start_coordinator(&r->e, "64", "5000");
    r->wk = start_worker(&r->e, prefix_cache);
    r->c = ct_ctl_open(r->e.ctl);
    ct_wait_workers(r->c, 1);
    return 1;
}

static void run_close(run *r)
{
    rekv_ctl_close(r->c);
    rekv_kvstore_client_close(r->k);
    ck_assert_int_eq(ct_stop(r->wk), 0);
    ck_assert_int_eq(ct_stop(r->co), 0);
    ck_assert_int_eq(ct_stop(r->kv), 0);
    ct_env_close(&r->e);
}

static void prompts(int32_t *a, int32_t *b)
{
    uint64_t x = 5;
    for (int i = 0; i < N_PROMPT; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        a[i] = (int32_t)((x >> 33) % 512);
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        b[i] = i < SHARED ? a[i] : (int32_t)((x >> 33) % 512);
    }
}

/* Submits A, waits until it has made 3 tokens (its prompt's blocks published), then submits B.
 * Returns 1 when B was admitted while A ran, 0 when B waited for room while A ran; cancels both
 * and waits for their ends. */
static int a_then_b(run *r, uint32_t *b_cached)
{
    int32_t a[N_PROMPT], b[N_PROMPT];
    prompts(a, b);
    uint64_t ja = submit(r->c, a, N_PROMPT, 200);
    size_t gen = 0;
    while (gen < 3) {
        int st = job_state(r->c, ja, &gen, NULL, NULL);
        ck_assert_msg(!ended(st), "job A ended before it made 3 tokens");
        usleep(1000);
    }
    uint64_t jb = submit(r->c, b, N_PROMPT, 100);
    int admitted;
    for (;;) {
        int waits, sb = job_state(r->c, jb, NULL, NULL, &waits);
        if (sb != REKV__CONTROL__JOB_STATE__QUEUED || waits) {
            admitted = sb != REKV__CONTROL__JOB_STATE__QUEUED;
            break;
        }
        usleep(1000);
    }
    /* whichever it was, A was still running then (200 steps behind a slow link) */
    ck_assert_int_eq(job_state(r->c, ja, NULL, NULL, NULL), REKV__CONTROL__JOB_STATE__RUNNING);
    if (admitted) /* its first step came back: the worker says what B's sequence took */
        while (job_state(r->c, jb, &gen, b_cached, NULL) == REKV__CONTROL__JOB_STATE__RUNNING &&
               gen == 0)
            usleep(1000);
    cancel(r->c, ja);
    cancel(r->c, jb);
    while (!ended(job_state(r->c, ja, NULL, NULL, NULL)) ||
           !ended(job_state(r->c, jb, NULL, NULL, NULL)))
        usleep(2000);
    return admitted;
}

static Rekv__Control__Response *stats_when(rekv_ctl *c, uint64_t lookups)
{
    for (;;) { /* the worker reports its store's counters about once a second */
        Rekv__Control__Response *r = ct_stats(c);
        if (r->stats->prefix_cache && r->stats->prefix_cache->lookups >= lookups)
            return r;
        rekv__control__response__free_unpacked(r, NULL);
        usleep(20000);
    }
}

static json_int_t geti(json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    ck_assert_msg(json_is_integer(v), "no integer %s in rekv stats' output", k);
    return json_integer_value(v);
}

START_TEST(shared_prefix_priced_once)
{
    run r;
    if (!run_open(&r, "on"))
        return;
    uint32_t cached = 0;
    ck_assert_msg(a_then_b(&r, &cached), "job B waited for room though A holds its prefix");
    ck_assert_uint_eq(cached, SHARED);
    Rekv__Control__Response *s = stats_when(r.c, 2);
    ck_assert_uint_eq(s->stats->jobs_held_for_room, 0);
    ck_assert_uint_eq(s->stats->jobs_prefix_priced, 1);
    const Rekv__Control__PrefixCacheStats *pc = s->stats->prefix_cache;
    ck_assert_uint_eq(pc->stores, 1);
    ck_assert_uint_eq(pc->lookups, 2);
    ck_assert_uint_eq(pc->hit_tokens, SHARED);
    ck_assert_uint_eq(pc->hit_host_blocks, SHARED / 16 * 5);
    ck_assert_uint_eq(pc->hit_disk_blocks, 0);
    ck_assert_uint_eq(pc->evictions, 0);
    ck_assert_uint_eq(pc->hit_read_bytes, 0);
    rekv__control__response__free_unpacked(s, NULL);

    /* the CLI prints them */
    char cmd[8192], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s stats --socket %s", tu_bin("rekv"), r.e.ctl);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(o != NULL, "rekv stats: not JSON: %s", out);
    free(out);
    json_t *p = json_object_get(o, "prefix_cache");
    ck_assert_msg(p != NULL, "rekv stats shows no prefix_cache");
    ck_assert_int_eq(geti(p, "stores"), 1);
    ck_assert_int_eq(geti(p, "lookups"), 2);
    ck_assert_int_eq(geti(p, "hit_tokens"), SHARED);
    json_t *hb = json_object_get(p, "hit_blocks");
    ck_assert_int_eq(geti(hb, "host"), SHARED / 16 * 5);
    ck_assert_int_eq(geti(hb, "disk"), 0);
    ck_assert_int_eq(geti(p, "evictions"), 0);
    ck_assert_int_eq(geti(p, "hit_read_bytes"), 0);
    ck_assert_int_eq(geti(o, "jobs_prefix_priced"), 1);
    json_decref(o);
    run_close(&r);
}
END_TEST

/* The worker's cache off: the same B waits for A, as at full price. */
START_TEST(cache_off_full_price)
{
    run r;
    if (!run_open(&r, "off"))
        return;
    uint32_t cached = 0;
    ck_assert_msg(!a_then_b(&r, &cached), "job B ran beside A at less than its full price");
    Rekv__Control__Response *s = ct_stats(r.c);
    ck_assert_uint_eq(s->stats->jobs_held_for_room, 1);
    ck_assert_uint_eq(s->stats->jobs_prefix_priced, 0);
    ck_assert_uint_eq(s->stats->prefix_cache->lookups, 0);
    rekv__control__response__free_unpacked(s, NULL);
    run_close(&r);
}
END_TEST

/* Job id's tokens are rekv_generate's for its prompt (greedy, as submit() submits). */
static void assert_generated(rekv_ctl *c, uint64_t id, const char *model, const int32_t *prompt,
                             int n, int max_new)
{
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(model, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    rekv_gen_params gp = {.max_new_tokens = max_new, .top_p = 1.0f};
    rekv_gen_result g;
    ck_assert_msg(rekv_generate(e, prompt, n, &gp, &g, &err) == 0, "%s", err.msg);
    Rekv__Control__Response *r = tu_ctl_status(c, id);
    ck_assert_int_eq((int)r->job->n_generated_ids, g.n);
    ck_assert_msg(memcmp(r->job->generated_ids, g.ids, sizeof(int32_t) * (size_t)g.n) == 0,
                  "job %llu: tokens differ from rekv_generate's", (unsigned long long)id);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_gen_result_free(&g);
    rekv_engine_free(e);
    rekv_model_close(m);
}

/* Admission is optimistic: the prefix it counted on may be gone when the worker makes the
 * sequence. Here the test clears the store's cache once A has published (A keeps its blocks, the
 * cache forgets them): B is still priced as sharing A's prompt, but its sequence computes its
 * own, so A and B together outgrow the arena. The store's refusal fails a step, whose jobs run
 * again (held for room as at full price: the worker said B took nothing), and both finish. */
START_TEST(lost_prefix_falls_back)
{
    run r;
    if (!run_open(&r, "on"))
        return;
    int32_t a[N_PROMPT], b[N_PROMPT];
    prompts(a, b);
    uint64_t ja = submit(r.c, a, N_PROMPT, 200);
    size_t gen = 0;
    while (gen < 3) {
        ck_assert_msg(!ended(job_state(r.c, ja, &gen, NULL, NULL)), "A ended early");
        usleep(1000);
    }
    ck_assert_int_eq(rekv_kvstore_cache_clear(r.k, NULL), 0);
    uint64_t jb = submit(r.c, b, N_PROMPT, 100);
    int sa, sb;
    while (!ended(sa = job_state(r.c, ja, NULL, NULL, NULL)) |
           !ended(sb = job_state(r.c, jb, NULL, NULL, NULL)))
        usleep(2000);
    ck_assert_int_eq(sa, REKV__CONTROL__JOB_STATE__DONE);
    ck_assert_int_eq(sb, REKV__CONTROL__JOB_STATE__DONE);
    assert_generated(r.c, ja, r.e.model, a, N_PROMPT, 200);
    assert_generated(r.c, jb, r.e.model, b, N_PROMPT, 100);
    Rekv__Control__Response *s = ct_stats(r.c);
    ck_assert_uint_ge(s->stats->jobs_prefix_priced, 1);
    ck_assert_uint_ge(s->stats->requeued, 1);
    ck_assert_uint_eq(s->stats->failed, 0);
    rekv__control__response__free_unpacked(s, NULL);
    run_close(&r);
}
END_TEST

/* Submits a job and waits for its end (DONE). */
static void run_done(rekv_ctl *c, const int32_t *prompt, int n, int max_new)
{
    uint64_t id = submit(c, prompt, n, max_new);
    int st;
    while (!ended(st = job_state(c, id, NULL, NULL, NULL)))
        usleep(2000);
    ck_assert_int_eq(st, REKV__CONTROL__JOB_STATE__DONE);
}

/* The disk tier in `rekv stats`: an arena of 20 positions with a spill tier. Job A (64 tokens)
 * publishes 4 positions; job F (300 tokens, nothing in common) pushes them to disk; job C shares
 * A's 64 and takes them back. `rekv stats` then shows the store's own counters (read here from
 * the store itself), hits on disk and bytes read back among them. */
START_TEST(stats_show_disk_hits)
{
    env e;
    if (ct_env_open(&e))
        return;
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,     "--endpoint",    e.kv,  "--model",     e.model, "--host-bytes",
                           "413696", "--cache-dtype", "f32", "--spill-dir", e.dir,   NULL};
    pid_t kv = ct_spawn(kargs);
    rekv_kvstore_client *k = ct_kv_open(&e);
    pid_t co = ct_start_coordinator(&e, "64", "5000");
    pid_t wk = ct_start_kv_worker(&e, "8", "w0");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    int32_t a[80], f[200];
    uint64_t x = 17;
    for (int i = 0; i < 200; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        f[i] = (int32_t)((x >> 33) % 512);
        if (i < 80)
            a[i] = (f[i] * 7 + 3) % 512;
    }
    run_done(c, a, 64, 1);
    run_done(c, f, 200, 100);
    run_done(c, a, 80, 1); /* C: A's 64 tokens, then 16 of its own */
    rekv_kv_stats st;
    ct_kv_stats(k, &st);
    ck_assert_uint_eq(st.prefix_lookups, 3);
    ck_assert_uint_eq(st.prefix_hit_tokens, 64);
    ck_assert_uint_gt(st.prefix_hit_disk_blocks, 0);
    ck_assert_uint_gt(st.prefix_hit_read_bytes, 0);
    Rekv__Control__Response *r;
    for (;;) { /* the worker's report after C's read-back (counters only grow) */
        r = stats_when(c, 3);
        if (r->stats->prefix_cache->hit_read_bytes >= st.prefix_hit_read_bytes)
            break;
        rekv__control__response__free_unpacked(r, NULL);
        usleep(20000);
    }
    const Rekv__Control__PrefixCacheStats *pc = r->stats->prefix_cache;
    ck_assert_uint_eq(pc->lookups, st.prefix_lookups);
    ck_assert_uint_eq(pc->hit_tokens, st.prefix_hit_tokens);
    ck_assert_uint_eq(pc->hit_host_blocks, st.prefix_hit_host_blocks);
    ck_assert_uint_eq(pc->hit_disk_blocks, st.prefix_hit_disk_blocks);
    ck_assert_uint_eq(pc->hit_host_blocks + pc->hit_disk_blocks, 4 * 5);
    ck_assert_uint_eq(pc->evictions, st.prefix_evictions);
    ck_assert_uint_eq(pc->hit_read_bytes, st.prefix_hit_read_bytes);
    rekv__control__response__free_unpacked(r, NULL);

    char cmd[8192], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s stats --socket %s", tu_bin("rekv"), e.ctl);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(o != NULL, "rekv stats: not JSON: %s", out);
    free(out);
    json_t *p = json_object_get(o, "prefix_cache");
    ck_assert_int_eq(geti(json_object_get(p, "hit_blocks"), "disk"),
                     (json_int_t)st.prefix_hit_disk_blocks);
    ck_assert_int_eq(geti(p, "hit_read_bytes"), (json_int_t)st.prefix_hit_read_bytes);
    ck_assert_int_eq(geti(p, "evictions"), (json_int_t)st.prefix_evictions);
    json_decref(o);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("prefix_admission");
    TCase *tc = tcase_create("prefix_admission");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, shared_prefix_priced_once);
    tcase_add_test(tc, cache_off_full_price);
    tcase_add_test(tc, stats_show_disk_hits);
    tcase_add_test(tc, lost_prefix_falls_back);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
