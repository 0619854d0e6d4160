/* test_prefix_serving.c — the prefix cache in serving: real rekv-kvstore, rekv-coordinator and two
 * offload rekv-gpuworkers (prefix cache on, their default). Jobs sharing prefixes of a common
 * prompt run, publish their blocks, and later jobs start from them (JobStatus.cached_tokens,
 * the store's hit counters); cancels and a worker killed mid-run leave every reference count
 * right: the tokens of every job that finished are rekv_generate's, and once the dead worker's
 * sequences are reclaimed and the cache cleared, every slot of the arena is free. The same after
 * the store is killed mid-run and started again. */
#include <check.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/co_env.h"
#include "tests/testutil.h"

static void cancel(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__Cancel s = REKV__CONTROL__CANCEL__INIT;
    s.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    rq.cancel = &s;
    rekv__control__response__free_unpacked(tu_ctl_call(c, &rq), NULL); /* it may have ended */
}

/* Waits for every job's end: a cancelled one may end either way, the others DONE with
 * rekv_generate's tokens. Returns how many took prompt tokens from the cache. */
static int wait_jobs(rekv_ctl *c, tjob *jobs, int n, const int *cancelled)
{
    int cached = 0;
    for (int i = 0; i < n; i++) {
        for (;;) {
            Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
            const Rekv__Control__JobStatus *s = r->job;
            if (s->state == REKV__CONTROL__JOB_STATE__QUEUED ||
                s->state == REKV__CONTROL__JOB_STATE__RUNNING) {
                rekv__control__response__free_unpacked(r, NULL);
                usleep(20000);
                continue;
            }
            ck_assert_uint_lt(s->cached_tokens, s->prompt_tokens);
            cached += s->cached_tokens > 0;
            if (!cancelled[i] || s->state == REKV__CONTROL__JOB_STATE__DONE) {
                ck_assert_msg(s->state == REKV__CONTROL__JOB_STATE__DONE, "job %d ended %s: %s", i,
                              rekv_ctl_state_name(s->state), s->error);
                ck_assert_int_eq((int)s->n_generated_ids, jobs[i].ref.n);
                ck_assert_msg(memcmp(s->generated_ids, jobs[i].ref.ids,
                                     sizeof(int32_t) * (size_t)jobs[i].ref.n) == 0,
                              "job %d (%u of its %u prompt tokens from the cache): tokens differ "
                              "from rekv_generate's",
                              i, s->cached_tokens, s->prompt_tokens);
            }
            rekv__control__response__free_unpacked(r, NULL);
            break;
        }
    }
    return cached;
}

/* n jobs of the test mix whose prompts are 0..59 tokens of one common prompt, then a few of
 * their own, with rekv_generate's output. */
static void shared_jobs(env *e, tjob *jobs, int n, uint64_t salt)
{
    ct_make_jobs(jobs, n, 6, 512, salt);
    int32_t base[64];
    uint64_t x = 99;
    for (int i = 0; i < 64; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        base[i] = (int32_t)((x >> 33) % 512);
    }
    for (int i = 0; i < n; i++) {
        int shared = (i * 13) % 60, own = jobs[i].n_prompt % 5;
        memmove(jobs[i].prompt + shared, jobs[i].prompt, sizeof(int32_t) * (size_t)own);
        memcpy(jobs[i].prompt, base, sizeof(int32_t) * (size_t)shared);
        jobs[i].n_prompt = shared + own > 0 ? shared + own : 1;
    }
    ct_reference(jobs, n, e->model);
}

static pid_t start_kvstore(env *e)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,          "--endpoint",  e->kv,  "--model",      e->model,
                           "--host-bytes", "64M",        "--cache-dtype", "f32", "--spill-dir",
                           e->dir,        "--lease-ms",  "1000", NULL};
    return ct_spawn(kargs);
}

/* Every sequence gone and the cache cleared: every slot of k's arena free. */
static void assert_all_back(rekv_kvstore_client *k)
{
    rekv_kv_stats st;
    for (;;) { /* a dead worker's sequences go after its lease (Check's timeout is the guard) */
        ct_kv_stats(k, &st);
        if (st.sequences == 0)
            break;
        usleep(20000);
    }
    ck_assert_uint_eq(st.pinned_blocks, 0);
    ck_assert_uint_gt(st.prefix_hit_tokens, 0);
    ck_assert_uint_gt(st.prefix_entries, 0);
    ck_assert_int_eq(rekv_kvstore_cache_clear(k, NULL), 0);
    do /* a block freed while its spill write is in flight gives its slot back at completion */
        ct_kv_stats(k, &st);
    while (st.spills_in_flight + st.reads_in_flight > 0);
    ck_assert_uint_eq(st.host_kv + st.host_act + st.disk_kv + st.disk_act, 0);
    ck_assert_uint_eq(st.free_slots, st.total_slots);
    ck_assert_uint_eq(st.prefix_entries, 0);
}

START_TEST(mixed_jobs_keep_counts)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 1000, FIRST = 100 };
    static tjob jobs[N];
    static int cancelled[N];
    shared_jobs(&e, jobs, N, 77);
    pid_t kv = start_kvstore(&e);
    rekv_kvstore_client *k = ct_kv_open(&e);
    pid_t co = ct_start_coordinator(&e, "2048", "1000");
    pid_t w0 = ct_start_kv_worker(&e, "8", "w0");
    pid_t w1 = ct_start_kv_worker(&e, "8", "w1");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 2);
    /* the first jobs publish the common prompt's blocks */
    ck_assert_int_eq(ct_submit_all(c, jobs, FIRST), FIRST);
    wait_jobs(c, jobs, FIRST, cancelled);
    /* the rest: every fifth cancelled as it is submitted, w1 killed while they run */
    ck_assert_int_eq(ct_submit_all(c, jobs + FIRST, N - FIRST), N - FIRST);
    for (int i = FIRST; i < N; i += 5) {
        cancel(c, jobs[i].id);
        cancelled[i] = 1;
    }
    kill(w1, SIGKILL);
    waitpid(w1, NULL, 0);
    int cached = wait_jobs(c, jobs, N, cancelled);
    ck_assert_int_gt(cached, 0);
    assert_all_back(k);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(w0), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* The store killed while jobs run and started again (a new arena, an empty cache): the worker
 * reconnects, the jobs run again, later ones hit what the new store's jobs published, and the
 * new store's counts come back whole. */
START_TEST(store_restart_keeps_counts)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 24, FIRST = 12 };
    static tjob jobs[N];
    static int cancelled[N];
    shared_jobs(&e, jobs, N, 78);
    pid_t kv = start_kvstore(&e);
    pid_t co = ct_start_coordinator(&e, "2048", "1000");
    pid_t w0 = ct_start_kv_worker(&e, "8", "w0");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, FIRST), FIRST);
    kill(kv, SIGKILL);
    waitpid(kv, NULL, 0);
    kv = start_kvstore(&e);
    rekv_kvstore_client *k = ct_kv_open(&e);
    ck_assert_int_eq(ct_submit_all(c, jobs + FIRST, N - FIRST), N - FIRST);
    ck_assert_int_gt(wait_jobs(c, jobs, N, cancelled), 0);
    assert_all_back(k);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(w0), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("prefix_serving");
    TCase *tc = tcase_create("prefix_serving");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, mixed_jobs_keep_counts);
    tcase_add_test(tc, store_restart_keeps_counts);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
