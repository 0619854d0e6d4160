/* test_device_lost.c — a device lost mid-run (backend.h's -ENODEV: on cuda a sticky error, the
 * context corrupt) ends the worker instead of leaving it to fail every later job on a broken
 * device. The cpu backend stands in for the GPU through its test hook, REKV_TEST_DEVICE_LOST=N
 * (the Nth compute-stream sync and every later sync fail -ENODEV, as a sticky CUDA error makes
 * every later call fail): the hook itself at the backend; then the real rekv-coordinator and
 * rekv-gpuworker on real sockets, where the worker loses its device a few steps into a batch of
 * jobs, exits 1 with the loss logged, and a new worker of its name — the test plays its
 * supervisor, as systemd's Restart=on-failure and `rekv run` do — finishes every job once, DONE,
 * with rekv_generate's tokens. Waits are on states and counts; Check's timeout is the guard.
 * Model: stories260K. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "coordinator/coordinator.h"
#include "gpuworker/device/backend.h"
#include "tests/co_env.h"
#include "tests/testutil.h"

#define N_JOBS 8
#define LOST_AFTER "4" /* compute syncs: a few steps into the jobs, past the worker's start */

/* The hook: the 2nd sync of a "compute" stream is the loss; from then on every stream's sync
 * fails -ENODEV, a failure the stream kept included; syncs of other streams never count. A bad
 * value is refused at creation. */
START_TEST(cpu_hook_loses_the_device_for_good)
{
    rekv_err err = {0};
    rekv_backend *be = NULL;
    rekv_stream *compute = NULL, *other = NULL;
    setenv("REKV_TEST_DEVICE_LOST", "2", 1);
    ck_assert_msg(rekv_backend_cpu_create(NULL, &be, &err) == 0, "%s", err.msg);
    unsetenv("REKV_TEST_DEVICE_LOST");
    const rekv_backend_iface *bi = be->iface;
    ck_assert_int_eq(bi->stream_create(be, "other", &other, &err), 0);
    ck_assert_int_eq(bi->stream_create(be, "compute", &compute, &err), 0);
    for (int i = 0; i < 3; i++)
        ck_assert_msg(bi->stream_sync(other, &err) == 0, "%s", err.msg);
    ck_assert_msg(bi->stream_sync(compute, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(bi->stream_sync(other, &err), 0);
    rekv_err_clear(&err);
    ck_assert_int_eq(bi->stream_sync(compute, &err), -ENODEV);
    ck_assert_msg(strstr(err.msg, "device lost") != NULL, "%s", err.msg);
    rekv_err_clear(&err);
    ck_assert_int_eq(bi->stream_sync(other, &err), -ENODEV);
    rekv_err_clear(&err);
    ck_assert_int_eq(bi->stream_sync(compute, &err), -ENODEV);
    bi->stream_destroy(compute);
    bi->stream_destroy(other);
    rekv_backend_destroy(be);

    const char *bad[] = {"0", "-1", "2x", "many"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        setenv("REKV_TEST_DEVICE_LOST", bad[i], 1);
        rekv_err_clear(&err);
        be = NULL;
        ck_assert_int_eq(rekv_backend_cpu_create(NULL, &be, &err), -EINVAL);
        ck_assert_ptr_null(be);
        ck_assert_msg(strstr(err.msg, "REKV_TEST_DEVICE_LOST") != NULL, "%s", err.msg);
    }
    unsetenv("REKV_TEST_DEVICE_LOST");
}
END_TEST

/* The end of a log file, for a message (static storage: one at a time). */
static const char *log_tail(const char *path)
{
    static char buf[2048];
    char *t = tu_read_file(path, NULL);
    snprintf(buf, sizeof(buf), "%s", t ? tu_log_end(t) : "(no log)");
    free(t);
    return buf;
}

/* Worker w0 on the cpu backend (tokens bit for bit rekv_generate's), resident, its stderr in log;
 * lost_after non-NULL: its device is lost at that compute sync. */
static pid_t start_worker(env *e, const char *log, const char *lost_after)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {
        prog,  "--model",     e->model, "--coordinator",  e->wrk, "--name", "w0",       "--backend",
        "cpu", "--max-batch", "8",      "--heartbeat-ms", "100",  "--mode", "resident", NULL};
    if (lost_after)
        setenv("REKV_TEST_DEVICE_LOST", lost_after, 1);
    pid_t p = tu_spawn(args, log, NULL);
    unsetenv("REKV_TEST_DEVICE_LOST");
    ck_assert_msg(p > 0, "rekv-gpuworker exited at start: %s", log_tail(log));
    return p;
}

START_TEST(worker_exits_and_its_successor_finishes_the_jobs)
{
    env e;
    if (ct_env_open(&e))
        return;
    static tjob jobs[N_JOBS];
    ct_make_jobs(jobs, N_JOBS, 24, 512, 40);
    ct_reference(jobs, N_JOBS, e.model);
    char log1[4200], log2[4200];
    snprintf(log1, sizeof(log1), "%s/worker1.log", e.dir);
    snprintf(log2, sizeof(log2), "%s/worker2.log", e.dir);
    pid_t co = ct_start_coordinator(&e, "64", "600000"); /* silence is not how a loss is seen */
    pid_t wk = start_worker(&e, log1, LOST_AFTER);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N_JOBS), N_JOBS);

    /* the worker ends by itself, 1, saying why; not by a signal, not at its start */
    int status = 0;
    ck_assert_int_eq(waitpid(wk, &status, 0), wk);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 1, "worker wait status 0x%x: %s",
                  (unsigned)status, log_tail(log1));
    ck_assert_msg(tu_file_has(log1, "device lost, exiting so that the worker is restarted"), "%s",
                  log_tail(log1));
    ck_assert_msg(tu_file_has(log1, "REKV_TEST_DEVICE_LOST=" LOST_AFTER), "%s", log_tail(log1));
    /* its step's jobs went back to the queue: the loss came with jobs running */
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_uint_ge(r->stats->requeued, 1);
    ck_assert_uint_eq(r->stats->failed, 0); /* run again, not failed (a job may have ended) */
    rekv__control__response__free_unpacked(r, NULL);

    /* the supervisor's restart: a new w0 with a working device */
    wk = start_worker(&e, log2, NULL);
    ct_wait_and_check(c, jobs, N_JOBS);
    r = ct_stats(c);
    ck_assert_uint_eq(r->stats->accepted, N_JOBS);
    ck_assert_uint_eq(r->stats->done, N_JOBS);
    ck_assert_uint_eq(r->stats->failed, 0);
    ck_assert_uint_eq(r->stats->queued + r->stats->running, 0);
    rekv__control__response__free_unpacked(r, NULL);
    ck_assert_msg(!tu_file_has(log2, "device lost"), "%s", log_tail(log2));

    rekv_ctl_close(c);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_free_jobs(jobs, N_JOBS);
    ct_env_close(&e);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("device_lost");
    TCase *tc = tcase_create("device_lost");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, cpu_hook_loses_the_device_for_good);
    tcase_add_test(tc, worker_exits_and_its_successor_finishes_the_jobs);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
