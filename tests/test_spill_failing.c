/* test_spill_failing.c — issue 41's failing spill tier, without a virtual machine: the kvstore's
 * spill file on a device that fails every write (the test hook REKV_TEST_SPILL_FAIL: while its
 * file exists, each write and growth of the spill file fails with EIO — what ext4 gives once it
 * has aborted its journal on a failed disk, as tests/bench/soak-vm.sh's first run found). The
 * store stops spilling, says so once, and reports no spill room, so the coordinator's admission
 * prices the arena alone; the steps that met the failure before admission knew hand their jobs
 * back without using an attempt; every job ends with rekv_generate's tokens. Once the file is
 * gone (the device mended) a probe write brings the tier back and later jobs spill again. Before
 * the fix the store went on reporting its spill room (the slots of failed writes counted as
 * room), admission started a batch the arena cannot hold, and every such step failed, each using
 * an attempt: jobs failed within a second. Real daemons and sockets (tests/co_env.h); no step is
 * timed, states and counts are waited for (Check's timeout is the guard). Model: stories260K (5
 * layers, a 4 KiB block each per 16 tokens). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/coordinator.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"
#define MODEL_REL "models/stories260K/stories260K.bin"
#include "tests/co_env.h"

#define N_JOBS 32

/* Every job of jobs[0, n) ended DONE having used one attempt: the failures it met used none. */
static void check_one_attempt(rekv_ctl *c, const tjob *jobs, int n)
{
    for (int i = 0; i < n; i++) {
        Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
        ck_assert_msg(r->job && r->job->state == REKV__CONTROL__JOB_STATE__DONE, "job %d", i);
        ck_assert_msg(r->job->attempts == 1, "job %d used %u attempts", i, r->job->attempts);
        rekv__control__response__free_unpacked(r, NULL);
    }
}


/* An arena of 63 blocks and a spill tier of 256: 32 jobs of up to 25 blocks each spill when it
 * works. The tier fails from the start: its first growth fails, the store stops spilling, its
 * spill room is 0 to the store's Stats and to the coordinator, and the 32 jobs all end with
 * rekv_generate's tokens on one attempt each, none failed. The file removed, a probe brings the
 * tier back: room again, and 32 more jobs end the same with blocks spilled to it. */
START_TEST(spill_tier_failing_serves_from_arena)
{
    env e;
    if (ct_env_open(&e))
        return;
    static tjob a[N_JOBS], b[N_JOBS];
    ct_make_jobs(a, N_JOBS, 4, 512, 41);
    ct_make_jobs(b, N_JOBS, 4, 512, 42);
    ct_reference(a, N_JOBS, e.model);
    ct_reference(b, N_JOBS, e.model);
    char fail[4200];
    snprintf(fail, sizeof(fail), "%s/spill-fails", e.dir);
    int fd = open(fail, O_WRONLY | O_CREAT, 0600);
    ck_assert_int_ge(fd, 0);
    close(fd);
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,     "--endpoint",    e.kv,  "--model",     e.model,
                           "--host-bytes", "262144", "--cache-dtype", "f32", "--spill-dir",
                           e.dir,    "--spill-bytes", "1M",  NULL};
    setenv("REKV_TEST_SPILL_FAIL", fail, 1); /* the store alone reads it */
    pid_t kv = ct_spawn(kargs);
    unsetenv("REKV_TEST_SPILL_FAIL");
    rekv_kvstore_client *k = ct_kv_open(&e);
    rekv_kv_stats kst;
    ct_kv_stats(k, &kst);
    ck_assert_uint_eq(kst.host_bytes, 63 * 4096); /* less the header's page */
    ck_assert_uint_gt(kst.spill_room_bytes, 0); /* nothing has failed yet */
    pid_t co = ct_start_coordinator(&e, "64", "5000");
    pid_t wk = ct_start_kv_worker(&e, "32", "w0");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);

    ck_assert_int_eq(ct_submit_all(c, a, N_JOBS), N_JOBS);
    ct_wait_and_check(c, a, N_JOBS);
    check_one_attempt(c, a, N_JOBS);
    ct_kv_stats(k, &kst);
    ck_assert_uint_gt(kst.spill_errors, 0); /* the failing tier was met */
    ck_assert_uint_eq(kst.bytes_spilled, 0);
    ck_assert_uint_eq(kst.spill_room_bytes, 0); /* still failing: no room to price */
    while (ct_worker_spill_room(c) != 0) /* the worker's next read of the room tells it */
        usleep(20000);

    ck_assert_int_eq(unlink(fail), 0); /* mended */
    do { /* a probe write, once a second, finds it works */
        usleep(20000);
        ct_kv_stats(k, &kst);
    } while (kst.spill_room_bytes == 0);
    while (ct_worker_spill_room(c) == 0)
        usleep(20000);
    ck_assert_int_eq(ct_submit_all(c, b, N_JOBS), N_JOBS);
    ct_wait_and_check(c, b, N_JOBS);
    check_one_attempt(c, b, N_JOBS);
    ct_kv_stats(k, &kst);
    ck_assert_uint_gt(kst.bytes_spilled, 0); /* spilling again */
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_uint_eq(r->stats->done, 2 * N_JOBS);
    ck_assert_uint_eq(r->stats->failed, 0);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(a, N_JOBS);
    ct_free_jobs(b, N_JOBS);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("spill_failing");
    TCase *tc = tcase_create("daemons");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, spill_tier_failing_serves_from_arena);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
