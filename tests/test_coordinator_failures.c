/* test_coordinator_failures.c — daemons that stall, die and come back: steps longer than the
 * heartbeat and the kvstore's lease keep the worker and its pins; a worker killed with SIGKILL
 * mid-run (jobs re-run, the coordinator stays up, a new worker finishes them identically); a
 * killed worker's blocks, freed at once by a worker restarted under its name and by the store
 * itself after the lease when none is; a coordinator killed and restarted (journaled jobs
 * complete).
 * With real daemons and real sockets (tests/co_env.h starts them); the other coordinator suites:
 * test_coordinator_{serving,modes,failures,admission}. Model: stories260K (a bigger synthetic one
 * for long steps). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>
#include "common/clock.h"
#include "common/mode.h"
#include "coordinator/cli/cli_daemon.h"
#include "coordinator/coordinator.h"
#include "coordinator/planner.h"
#include "gpuworker/batcher.h"
#include "gpuworker/gpuworker.h"
#include "kvstore/kvstore.h"
#include "proto/worker.pb-c.h"
#include "tests/fixture.h"
#include "tests/testutil.h"
#define MODEL_REL "models/stories260K/stories260K.bin"
#include "tests/co_env.h"

static void kill9(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* A big model (e->model; steps of several tenths of a second on a slow machine) and n jobs of two
 * new tokens each with their reference tokens. The tests that need steps longer than a 0.5 s
 * timeout or lease make them so on any machine with an emulated link (kv_worker's gbps): the
 * link's sleeps are a lower bound on a step's time, however fast the cpu. */
static void slow_model_jobs(env *e, tjob *jobs, int n, uint64_t salt)
{
    rekv_synth_spec spec = {REKV_ARCH_OPT, 8, 1024, 16, 16, 4096, 512, 256, REKV_DTYPE_F16, 3, 1};
    snprintf(e->model, sizeof(e->model), "%s/big", e->dir);
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(&spec, e->model, &err) == 0, "%s", err.msg);
    ct_make_jobs(jobs, n, 1, 512, salt);
    for (int i = 0; i < n; i++)
        jobs[i].gp.max_new_tokens = 2;
    ct_reference(jobs, n, e->model);
}

/* rekv-kvstore on e->kv for e->model, fp32 cache (offload mode then equals rekv_generate). */
static pid_t start_kvstore(env *e, const char *lease_ms, const char *host_bytes)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *args[] = {prog,           "--endpoint", e->kv,           "--model", e->model,
                          "--host-bytes", host_bytes,   "--cache-dtype", "f32",     "--spill-dir",
                          e->dir,         "--lease-ms", lease_ms,        NULL};
    return ct_spawn(args);
}

/* ---------------------------------------------------------------- tests */

/* A step far longer than the coordinator's worker timeout (its KV over a slow emulated link):
 * the worker keeps heartbeating from its loop while the step runs on its own thread, so nobody
 * takes it for dead, nothing is re-queued, and the tokens are rekv_generate's. */
START_TEST(long_steps_keep_heartbeating)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    slow_model_jobs(&e, jobs, N, 3);
    pid_t kv = start_kvstore(&e, "60000", "128M");
    pid_t co = ct_start_coordinator(&e, "64", "500");
    /* each step's KV (the 16 prompts' 296 tokens and more, x 8 layers x 8 KiB: 19 MB, fetched
     * or, at the prefill, stored) over 0.12 Gbit/s: over 1 s */
    pid_t wk = ct_kv_worker(&e, "16", NULL, "0.12");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    ct_wait_and_check(c, jobs, N);
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_msg(r->stats->requeued == 0, "%llu jobs re-queued: the worker was taken for dead",
                  (unsigned long long)r->stats->requeued);
    /* the longest step is at least the mean: above the timeout, or the test proves nothing */
    ck_assert_msg(r->stats->worker_step_avg_s > 0.5,
                  "steps took %.2f s on average, not longer than the 0.5 s worker timeout: make "
                  "the model bigger",
                  r->stats->worker_step_avg_s);
    fprintf(stderr, "   %llu steps of %.2f s on average against a 0.5 s worker timeout\n",
            (unsigned long long)r->stats->steps, r->stats->worker_step_avg_s);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* The same with the KV cache in a kvstore whose lease (0.5 s) is shorter than a step: the
 * worker's loop renews it while the step thread holds the step's pins, so no pin is lost (the step
 * would fail unpinning them), nothing is reclaimed, and the tokens are rekv_generate's. */
START_TEST(long_steps_keep_kvstore_pins)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    slow_model_jobs(&e, jobs, N, 5);
    pid_t kv = start_kvstore(&e, "500", "128M");
    rekv_kvstore_client *k = ct_kv_open(&e);
    pid_t co = ct_start_coordinator(&e, "64", "5000");
    /* each step's KV (the 16 prompts' 296 tokens and more, x 8 layers x 8 KiB: 19 MB, fetched
     * or, at the prefill, stored) over 0.12 Gbit/s: over 1 s */
    pid_t wk = ct_kv_worker(&e, "16", NULL, "0.12");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    ct_wait_and_check(c, jobs, N);
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_msg(r->stats->worker_step_avg_s > 0.5,
                  "steps took %.2f s on average, not longer than the 0.5 s lease: make the model "
                  "bigger",
                  r->stats->worker_step_avg_s);
    fprintf(stderr, "   %llu steps of %.2f s on average against a 0.5 s kvstore lease\n",
            (unsigned long long)r->stats->steps, r->stats->worker_step_avg_s);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_cache_clear(k, NULL), 0); /* the prefix cache's blocks, */
    do /* whose slots a spill write in flight gives back at its completion */
        ct_kv_stats(k, &st);
    while (st.spills_in_flight > 0);
    ck_assert_msg(st.leases_expired == 0, "the worker lost its pins %llu times",
                  (unsigned long long)st.leases_expired);
    ck_assert_uint_eq(st.sequences_reclaimed, 0);
    ck_assert_uint_eq(st.sequences, 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    ck_assert_uint_eq(st.free_slots, st.total_slots);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

static int wait_some_tokens(rekv_ctl *c, tjob *jobs, int n)
{
    for (;;) { /* Check's timeout is the guard */
        for (int i = 0; i < n; i++) {
            Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
            int has = r->job && r->job->state == REKV__CONTROL__JOB_STATE__RUNNING &&
                      r->job->n_generated_ids > 0;
            rekv__control__response__free_unpacked(r, NULL);
            if (has)
                return i;
        }
        usleep(2000);
    }
}

/* SIGKILL the worker mid-run: the coordinator stays up, notices (heartbeat), re-queues the jobs
 * in flight, and a new worker runs them to the same tokens. */
START_TEST(worker_killed)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 400, 512, 2);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0; /* long runs, so that the kill lands mid-run */
    ct_reference(jobs, N, e.model);
    pid_t co = ct_start_coordinator(&e, "256", "1000");
    pid_t wk = ct_start_worker(&e, "16");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    int i = wait_some_tokens(c, jobs, N);
    kill9(wk);
    /* the coordinator answers throughout and drops the worker after the timeout */
    ct_wait_workers(c, 0);
    Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
    ck_assert_msg(r->job->state == REKV__CONTROL__JOB_STATE__QUEUED,
                  "job state %s after the "
                  "worker died",
                  rekv_ctl_state_name(r->job->state));
    ck_assert_int_eq(r->job->attempts, 1);
    rekv__control__response__free_unpacked(r, NULL);
    wk = ct_start_worker(&e, "16");
    ct_wait_and_check(c, jobs, N);
    r = tu_ctl_status(c, jobs[i].id);
    ck_assert_int_eq(r->job->attempts, 2);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* SIGKILL a worker whose KV cache is in the kvstore: its sequences stay there (the lease is a
 * minute, longer than this test), a worker started under the same name drops them once the
 * coordinator welcomes it, before it serves, re-runs the jobs to the same tokens, and the store's
 * block usage is back to what it was before any job. */
START_TEST(worker_restart_frees_kvstore_blocks)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 400, 512, 6);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0; /* long runs, so that the kill lands mid-run */
    ct_reference(jobs, N, e.model);
    pid_t kv = start_kvstore(&e, "60000", "64M");
    rekv_kvstore_client *k = ct_kv_open(&e);
    rekv_kv_stats st0, st;
    ct_kv_stats(k, &st0);
    pid_t co = ct_start_coordinator(&e, "256", "1000");
    pid_t wk = ct_start_kv_worker(&e, "16", "w0");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N);
    kill9(wk);
    ct_wait_workers(c, 0);
    ct_kv_stats(k, &st);
    uint64_t left = st.sequences;
    ck_assert_msg(left > 0 && st.free_slots < st0.free_slots,
                  "the killed worker left nothing in the kvstore (%llu sequences, %llu of %llu "
                  "slots free)",
                  (unsigned long long)left, (unsigned long long)st.free_slots,
                  (unsigned long long)st0.free_slots);
    ck_assert_uint_eq(st.sequences_reclaimed, 0);
    wk = ct_start_kv_worker(&e, "16", "w0");
    do { /* dropped at its Welcome (Check's timeout is the guard) */
        usleep(20000);
        ct_kv_stats(k, &st);
    } while (st.sequences_reclaimed < left);
    ck_assert_uint_eq(st.sequences_reclaimed, left);
    ct_wait_and_check(c, jobs, N);
    ck_assert_int_eq(rekv_kvstore_cache_clear(k, NULL), 0); /* the prefix cache's blocks, */
    do /* whose slots a spill write in flight gives back at its completion */
        ct_kv_stats(k, &st);
    while (st.spills_in_flight > 0);
    ck_assert_uint_eq(st.sequences, 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    ck_assert_uint_eq(st.free_slots, st0.free_slots);
    fprintf(stderr, "   the restarted worker dropped the %llu sequences the killed one left\n",
            (unsigned long long)left);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* SIGKILL a worker (default name, so no successor claims its sequences) with a 1 s kvstore
 * lease: while it lives, its renewals keep everything (a lease passes: a silent witness, pinned
 * after the worker is running, loses its lease, and only it); once dead, the store drops its
 * sequences after the lease and its block usage is back to what it was. Counted, not timed. */
START_TEST(dead_worker_blocks_return_after_lease)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 400, 512, 8);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0;
    pid_t kv = start_kvstore(&e, "1000", "64M");
    rekv_kvstore_client *k = ct_kv_open(&e);
    rekv_kv_stats st0, st;
    ct_kv_stats(k, &st0);
    pid_t co = ct_start_coordinator(&e, "256", "1000");
    pid_t wk = ct_start_kv_worker(&e, "16", NULL);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N);
    /* the witness: a sequence of its own, pinned, then silence */
    rekv_kvstore_client *w = ct_kv_open(&e);
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_seq_create(w, 1u << 30, &err) == 0 &&
                      rekv_kvstore_append(w, 1u << 30, 1, 0, 0, NULL, &err) == 0,
                  "%s", err.msg);
    rekv_kv_range wr = {1u << 30, 0, 0, 1};
    rekv_kv_plan_block *pb = NULL;
    size_t npb, cap = 0;
    ck_assert_msg(rekv_kvstore_plan(w, &wr, 1, 1, &pb, &npb, &cap, &err) == 0, "%s", err.msg);
    free(pb);
    for (;;) { /* until the witness's lease has run out (Check's timeout is the guard) */
        ct_kv_stats(k, &st);
        if (st.leases_expired > 0)
            break;
        usleep(20000);
    }
    ck_assert_msg(st.sequences > 1 && st.sequences_reclaimed == 0 && st.leases_expired == 1,
                  "a live worker lost something: %llu sequences, %llu reclaimed, %llu leases "
                  "expired",
                  (unsigned long long)st.sequences, (unsigned long long)st.sequences_reclaimed,
                  (unsigned long long)st.leases_expired);
    ck_assert_int_eq(rekv_kvstore_seq_drop(w, 1u << 30, NULL), 0);
    rekv_kvstore_client_close(w);
    kill9(wk);
    for (;;) { /* Check's timeout is the guard */
        /* what its jobs published as their blocks filled stays cached: dropped to count */
        ck_assert_int_eq(rekv_kvstore_cache_clear(k, NULL), 0);
        ct_kv_stats(k, &st);
        if (st.sequences == 0 && st.free_slots == st0.free_slots)
            break;
        usleep(20000);
    }
    ck_assert_uint_gt(st.sequences_reclaimed, 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_env_close(&e);
}
END_TEST

/* SIGKILL the coordinator mid-run, once jobs have produced tokens: a new one replays the journal,
 * the worker is reset and says Hello again, and every acknowledged job completes exactly once —
 * with the right tokens, and the new coordinator counts each job accepted once and done once. */
START_TEST(coordinator_restart)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 24 };
    static tjob jobs[N + 1];
    ct_make_jobs(jobs, N + 1, 200, 512, 3);
    ct_reference(jobs, N + 1, e.model);
    pid_t co = ct_start_coordinator(&e, "256", "2000");
    pid_t wk = ct_start_worker(&e, "8");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N); /* mid-run */
    kill9(co);
    rekv_ctl_close(c);
    co = ct_start_coordinator(&e, "256", "2000");
    c = ct_ctl_open(e.ctl);
    /* ids go on after the replayed ones */
    ck_assert_int_eq(ct_submit_all(c, jobs + N, 1), 1);
    ck_assert_uint_gt(jobs[N].id, jobs[N - 1].id);
    ct_wait_and_check(c, jobs, N + 1);
    Rekv__Control__Response *st = ct_stats(c);
    ck_assert_uint_eq(st->stats->accepted, N + 1);
    ck_assert_uint_eq(st->stats->done + st->stats->failed, N + 1);
    ck_assert_uint_eq(st->stats->failed, 0);
    rekv__control__response__free_unpacked(st, NULL);
    /* and once more: finished jobs are remembered across a clean restart */
    ck_assert_int_eq(ct_stop(co), 0);
    rekv_ctl_close(c);
    co = ct_start_coordinator(&e, "256", "2000");
    c = ct_ctl_open(e.ctl);
    ct_wait_and_check(c, jobs, N + 1);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_free_jobs(jobs, N + 1);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("coordinator_failures");
    TCase *tc;
    tc = tcase_create("coordinator");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, long_steps_keep_heartbeating);
    tcase_add_test(tc, long_steps_keep_kvstore_pins);
    tcase_add_test(tc, worker_killed);
    tcase_add_test(tc, worker_restart_frees_kvstore_blocks);
    tcase_add_test(tc, dead_worker_blocks_return_after_lease);
    tcase_add_test(tc, coordinator_restart);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
