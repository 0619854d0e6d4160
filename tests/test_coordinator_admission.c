/* test_coordinator_admission.c — admission against the kvstore's room: a job waits until
 * the store can hold it, and the spill tier counts.
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

/* ---------------------------------------------------------------- tests */

/* Waits until job id leaves the queue (admitted), failing the test if it fails instead. */
static void wait_admitted(rekv_ctl *c, uint64_t id)
{
    for (;;) {
        Rekv__Control__Response *r = tu_ctl_status(c, id);
        int st = r->job->state;
        rekv__control__response__free_unpacked(r, NULL);
        ck_assert_int_ne(st, REKV__CONTROL__JOB_STATE__FAILED);
        if (st != REKV__CONTROL__JOB_STATE__QUEUED)
            return;
        usleep(1000);
    }
}

/* Admission against the kvstore's room (issue 14 item 3, issue 16's "a full arena while
 * serving"): a store of 100 blocks and no spill tier, offload mode (stories260K: 5 layers, a
 * 4 KiB block each per 16 tokens). A job whose KV fits only alone runs while the next one waits in
 * the queue, saying so in its status; twelve jobs whose KV together is twice the store all finish
 * with rekv_generate's tokens, no step fails; a job larger than the whole store fails at once. */
START_TEST(admission_waits_for_kvstore_room)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 12 };
    static tjob jobs[N], ab[2];
    ct_make_jobs(jobs, N, 16, 512, 11);
    ct_reference(jobs, N, e.model);
    /* A: 300 tokens = 19 blocks a layer, 95 of the 100; B: 17 tokens, 10 blocks */
    ct_make_jobs(ab, 2, 16, 512, 12);
    ab[0].n_prompt = 4, ab[0].gp.max_new_tokens = 296, ab[0].gp.stop_at_eos = 0;
    ab[1].n_prompt = 1, ab[1].gp.max_new_tokens = 16;
    ct_reference(ab, 2, e.model);
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,     "--endpoint",    e.kv,  "--model",    e.model, "--host-bytes",
                           "413696", "--cache-dtype", "f32", "--no-spill", NULL};
    pid_t kv = ct_spawn(kargs);
    rekv_kvstore_client *k = ct_kv_open(&e);
    rekv_kv_stats kst;
    ct_kv_stats(k, &kst);
    ck_assert_uint_eq(kst.host_bytes, 100 * 4096);
    pid_t co = ct_start_coordinator(&e, "64", "5000");
    pid_t wk = ct_start_kv_worker(&e, "8", "w0");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);

    ck_assert_int_eq(ct_submit_all(c, &ab[0], 1), 1);
    wait_admitted(c, ab[0].id); /* A runs: it fits alone */
    ck_assert_int_eq(ct_submit_all(c, &ab[1], 1), 1);
    int seen = 0;
    for (;;) { /* B cannot start before A ends: it waits, and says why */
        Rekv__Control__Response *r = tu_ctl_status(c, ab[1].id);
        int queued = r->job->state == REKV__CONTROL__JOB_STATE__QUEUED;
        seen = queued && strstr(r->job->waiting, "waiting for kvstore room") != NULL;
        rekv__control__response__free_unpacked(r, NULL);
        if (seen || !queued)
            break;
    }
    ck_assert_msg(seen, "job B started without waiting for A's kvstore room");
    Rekv__Control__Response *ra = tu_ctl_status(c, ab[0].id);
    ck_assert_int_eq(ra->job->state, REKV__CONTROL__JOB_STATE__RUNNING); /* B waited on it */
    rekv__control__response__free_unpacked(ra, NULL);
    ct_wait_and_check(c, ab, 2);

    /* twelve at once, and one that can never fit: 410 tokens = 26 blocks a layer */
    static tjob big[1];
    ct_make_jobs(big, 1, 16, 512, 13);
    big[0].n_prompt = 10, big[0].gp.max_new_tokens = 400;
    ck_assert_int_eq(ct_submit_all(c, big, 1), 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    ct_wait_and_check(c, jobs, N);
    Rekv__Control__Response *r = tu_ctl_status(c, big[0].id);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__FAILED);
    ck_assert_msg(strstr(r->job->error, "kvstore host memory") != NULL, "%s", r->job->error);
    ck_assert_uint_eq(r->job->attempts, 0); /* failed before it ever ran */
    rekv__control__response__free_unpacked(r, NULL);
    r = ct_stats(c);
    ck_assert_uint_eq(r->stats->done, N + 2);
    ck_assert_uint_eq(r->stats->failed, 1);
    ck_assert_uint_eq(r->stats->steps_failed, 0);
    ck_assert_uint_eq(r->stats->requeued, 0);
    ck_assert_uint_eq(r->stats->jobs_too_large, 1);
    ck_assert_uint_ge(r->stats->jobs_held_for_room, 2); /* B, and some of the twelve */
    fprintf(stderr, "   %llu jobs held for kvstore room, %llu steps\n",
            (unsigned long long)r->stats->jobs_held_for_room, (unsigned long long)r->stats->steps);
    rekv__control__response__free_unpacked(r, NULL);
    ck_assert_int_eq(rekv_kvstore_cache_clear(k, NULL), 0); /* the prefix cache's blocks, */
    do /* whose slots a spill write in flight gives back at its completion */
        ct_kv_stats(k, &kst);
    while (kst.spills_in_flight > 0);
    ck_assert_uint_eq(kst.sequences, 0);
    ck_assert_uint_eq(kst.host_free_bytes, kst.host_bytes);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_free_jobs(ab, 2);
    ct_env_close(&e);
}
END_TEST

/* Admission counts the spill tier (issue 14 items 3-4): an arena of 60 blocks and a spill tier of
 * 80 (--spill-bytes), offload. Job A (400 tokens: 25 blocks a layer, 125 in all) is twice the
 * arena and is admitted — its steps run in layer windows, the blocks of the layers not running
 * spilled — and finishes with rekv_generate's tokens; B, the same size, waits for A (125 + 125 is
 * more than arena and spill together), saying so, and then finishes; C (504 tokens, 160 blocks)
 * is larger than arena and spill together and fails at once. */
START_TEST(admission_counts_spill)
{
    env e;
    if (ct_env_open(&e))
        return;
    static tjob ab[2], big[1];
    ct_make_jobs(ab, 2, 16, 512, 14);
    for (int i = 0; i < 2; i++)
        ab[i].n_prompt = 4, ab[i].gp.max_new_tokens = 396, ab[i].gp.stop_at_eos = 0;
    ct_reference(ab, 2, e.model);
    ct_make_jobs(big, 1, 16, 512, 15);
    big[0].n_prompt = 4, big[0].gp.max_new_tokens = 500;
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    char *dir = tu_tmpdir();
    const char *kargs[] = {prog,     "--endpoint",
                           e.kv,     "--model",
                           e.model,  "--host-bytes",
                           "249856", "--cache-dtype",
                           "f32",    "--spill-dir",
                           dir,      "--spill-bytes",
                           "327680", NULL};
    pid_t kv = ct_spawn(kargs);
    rekv_kvstore_client *k = ct_kv_open(&e);
    rekv_kv_stats kst;
    ct_kv_stats(k, &kst);
    ck_assert_uint_eq(kst.host_bytes, 60 * 4096);
    ck_assert_uint_eq(kst.spill_room_bytes, 80 * 4096);
    pid_t co = ct_start_coordinator(&e, "64", "5000");
    pid_t wk = ct_start_kv_worker(&e, "8", "w0");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, big, 1), 1);
    ck_assert_int_eq(ct_submit_all(c, &ab[0], 1), 1);
    wait_admitted(c, ab[0].id); /* A runs: it fits arena and spill */
    ck_assert_int_eq(ct_submit_all(c, &ab[1], 1), 1);
    int seen = 0;
    for (;;) { /* B waits for A, and says why */
        Rekv__Control__Response *r = tu_ctl_status(c, ab[1].id);
        int queued = r->job->state == REKV__CONTROL__JOB_STATE__QUEUED;
        seen = queued && strstr(r->job->waiting, "waiting for kvstore room") != NULL &&
               strstr(r->job->waiting, "spill") != NULL;
        rekv__control__response__free_unpacked(r, NULL);
        if (seen || !queued)
            break;
    }
    ck_assert_msg(seen, "job B started without waiting for A's room in arena and spill");
    ct_wait_and_check(c, ab, 2);
    Rekv__Control__Response *r = tu_ctl_status(c, big[0].id);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__FAILED);
    ck_assert_msg(strstr(r->job->error, "kvstore host memory and spill") != NULL, "%s",
                  r->job->error);
    ck_assert_uint_eq(r->job->attempts, 0); /* failed before it ever ran */
    rekv__control__response__free_unpacked(r, NULL);
    r = ct_stats(c);
    ck_assert_uint_eq(r->stats->done, 2);
    ck_assert_uint_eq(r->stats->failed, 1);
    ck_assert_uint_eq(r->stats->steps_failed, 0);
    ck_assert_uint_eq(r->stats->requeued, 0);
    ck_assert_uint_eq(r->stats->jobs_too_large, 1);
    rekv__control__response__free_unpacked(r, NULL);
    ct_kv_stats(k, &kst);
    fprintf(stderr, "   admission_counts_spill: %llu bytes spilled, %llu read back, %llu ahead\n",
            (unsigned long long)kst.bytes_spilled, (unsigned long long)kst.bytes_read_back,
            (unsigned long long)kst.read_ahead_bytes);
    ck_assert_uint_gt(kst.bytes_read_back, 0); /* the jobs' KV did live on the spill tier */
    ck_assert_uint_eq(kst.sequences, 0);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(ab, 2);
    tu_rmrf(dir);
    free(dir);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("coordinator_admission");
    TCase *tc;
    tc = tcase_create("coordinator");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, admission_waits_for_kvstore_room);
    tcase_add_test(tc, admission_counts_spill);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
