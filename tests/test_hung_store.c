/* test_hung_store.c — a kvstore that hangs (SIGSTOP: a stuck process or disk) costs its clients
 * one request timeout in all and never holds up a stop (issue 41). The client: a request that
 * times out leaves it lost, so the next request fails at once instead of waiting again; a request
 * waiting on the hung store ends as soon as the stop fd it polls is readable. The worker, with the
 * real rekv-kvstore, rekv-coordinator and rekv-gpuworker: the store stopped under a full batch of
 * running jobs costs one timeout (not one per sequence the failed step drops), the worker says it
 * is unavailable, and SIGTERM ends it while the store is still stopped; once the store runs again
 * a new worker of the same name serves every job with rekv_generate's tokens. Waits have no
 * deadline of their own: Check's timeout is the guard, and the old per-sequence wait (jobs × the
 * store timeout) outlasts it. A worker started against a store that is not there yet says so,
 * naming the endpoint, instead of waiting in silence, and one whose store hung before it came stops
 * on SIGTERM during that first connect. Model: stories260K. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstore/kvstore.h"
#include "tests/co_env.h"
#include "tests/kvd.h"
#include "tests/testutil.h"

/* ---------------------------------------------------------------- the client */

/* One request times out on the stopped store; the next fails at once although the client would
 * now wait ten minutes, and so does a drop (what a worker's failed step does per sequence). */
START_TEST(client_timeout_is_loss)
{
    kvd d;
    kvd_start(&d, 64, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_seq_create(c, 1, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_kvstore_client_lost(c), 0);
    rekv_kvstore_client_set_timeout(c, 500);
    kill(d.pid, SIGSTOP);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, &err), -ETIMEDOUT);
    ck_assert_msg(strstr(err.msg, "no reply from"), "%s", err.msg);
    ck_assert_int_eq(rekv_kvstore_client_lost(c), -ETIMEDOUT);
    rekv_kvstore_client_set_timeout(c, 600000);
    rekv_err e2 = {0};
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, &e2), -ETIMEDOUT);
    ck_assert_msg(strstr(e2.msg, "the connection is given up"), "%s", e2.msg);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, &e2), -ETIMEDOUT);
    kill(d.pid, SIGCONT);
    /* the store itself is fine: a new client is served (the old one stays lost) */
    rekv_kvstore_client *c2 = kvd_client(&d);
    ck_assert_msg(rekv_kvstore_stats(c2, &st, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_kvstore_client_lost(c), -ETIMEDOUT);
    rekv_kvstore_client_close(c2);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

typedef struct waiter {
    rekv_kvstore_client *c;
    int rc;
    rekv_err err;
} waiter;

static void *stats_thread(void *arg)
{
    waiter *w = arg;
    rekv_kv_stats st;
    w->rc = rekv_kvstore_stats(w->c, &st, &w->err);
    return NULL;
}

/* A request waiting ten minutes on the stopped store ends when the stop fd becomes readable, and
 * later requests fail at once; the fd is polled, not read. */
START_TEST(client_stop_fd_ends_the_wait)
{
    kvd d;
    kvd_start(&d, 64, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    int sfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ck_assert_int_ge(sfd, 0);
    rekv_kvstore_client_set_stop_fd(c, sfd);
    rekv_kvstore_client_set_timeout(c, 600000);
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_seq_create(c, 1, &err) == 0, "%s", err.msg); /* fd not readable */
    kill(d.pid, SIGSTOP);
    waiter w = {.c = c};
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, stats_thread, &w), 0);
    uint64_t one = 1;
    ck_assert_int_eq(write(sfd, &one, sizeof(one)), sizeof(one));
    ck_assert_int_eq(pthread_join(t, NULL), 0);
    ck_assert_msg(w.rc == -ECANCELED, "%d: %s", w.rc, w.err.msg);
    ck_assert_int_eq(rekv_kvstore_client_lost(c), -ECANCELED);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, &err), -ECANCELED);
    uint64_t v = 0;
    ck_assert_int_eq(read(sfd, &v, sizeof(v)), sizeof(v)); /* still there for its owner */
    ck_assert_uint_eq(v, 1);
    kill(d.pid, SIGCONT);
    rekv_kvstore_client_close(c);
    close(sfd);
    kvd_stop(&d);
}
END_TEST

/* ---------------------------------------------------------------- the worker */

#define N_JOBS 32

/* How many times needle is in the file. */
static int count_in(const char *path, const char *needle)
{
    char *t = tu_read_file(path, NULL);
    int n = 0;
    for (const char *p = t ? strstr(t, needle) : NULL; p; p = strstr(p + 1, needle))
        n++;
    free(t);
    return n;
}

/* The end of a log file, for a failure's message. */
static const char *log_end(const char *path)
{
    static char buf[2100];
    char *t = tu_read_file(path, NULL);
    snprintf(buf, sizeof(buf), "%s", t ? tu_log_end(t) : "(no log)");
    free(t);
    return buf;
}

/* w0 on the cpu backend in offload mode, its KV cache in e's kvstore, its log in log. */
static pid_t start_worker(env *e, const char *kv_timeout_ms, const char *log)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {
        prog,          "--model",   e->model,  "--coordinator", e->wrk, "--name",
        "w0",          "--backend", "cpu",     "--max-batch",   "64",   "--heartbeat-ms",
        "100",         "--mode",    "offload", "--kvstore",     e->kv,  "--kvstore-timeout-ms",
        kv_timeout_ms, NULL};
    pid_t p = tu_spawn(args, log, NULL);
    ck_assert_msg(p > 0, "rekv-gpuworker exited at start: %s", log_end(log));
    return p;
}

/* The coordinator's stats once every job runs (then the store is stopped under all of them), or
 * once w0 says it is unavailable with none running; polled, no deadline. */
static void wait_stats(rekv_ctl *c, int want_unavailable)
{
    for (;;) {
        Rekv__Control__Response *r = tu_ctl_stats(c);
        const Rekv__Control__Stats *s = r->stats;
        int ok = want_unavailable
                     ? s->n_workers == 1 && s->workers[0]->unavailable[0] != '\0' && s->running == 0
                     : s->running == N_JOBS;
        rekv__control__response__free_unpacked(r, NULL);
        if (ok)
            return;
        usleep(want_unavailable ? 20000 : 1000);
    }
}

/* SIGSTOP the store under 32 running jobs, with a 2 s store timeout: at most one timeout in the
 * worker's log, one loss, the coordinator told it is unavailable (the old worker first dropped each
 * sequence with a request that waited 2 s: 64 s and more, past Check's 60), and SIGTERM ends it
 * cleanly while the store is still stopped. SIGCONT: a new w0 drops what the old one left and
 * every job ends DONE with rekv_generate's tokens. */
START_TEST(worker_store_hangs)
{
    env e;
    if (ct_env_open(&e))
        return;
    static tjob jobs[N_JOBS];
    ct_make_jobs(jobs, N_JOBS, 200, 512, 41);
    for (int i = 0; i < N_JOBS; i++)
        jobs[i].gp.stop_at_eos = 0; /* all still running when the store stops */
    ct_reference(jobs, N_JOBS, e.model);
    char kv_log[4300], wk_log[4300], wk2_log[4300], prog[4096];
    snprintf(kv_log, sizeof(kv_log), "%s/kvstore.log", e.dir);
    snprintf(wk_log, sizeof(wk_log), "%s/worker.log", e.dir);
    snprintf(wk2_log, sizeof(wk2_log), "%s/worker2.log", e.dir);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,  "--endpoint",    e.kv,  "--model",    e.model, "--host-bytes",
                           "64M", "--cache-dtype", "f32", "--no-spill", NULL};
    pid_t kv = tu_spawn(kargs, kv_log, NULL);
    ck_assert_msg(kv > 0, "rekv-kvstore exited at start");
    pid_t co = ct_start_coordinator(&e, "64", "600000"); /* the worker is never timed out */
    pid_t wk = start_worker(&e, "2000", wk_log);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N_JOBS), N_JOBS);
    wait_stats(c, 0);
    kill(kv, SIGSTOP);
    wait_stats(c, 1);
    int st = tu_stop(wk); /* the store is still stopped */
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %d: %s", st,
                  log_end(wk_log));
    /* one loss; the request that timed out is the step's or the lease's (logged: "no reply
     * from") or a join's (told the coordinator, not logged); every later one failed at once */
    int timeouts = count_in(wk_log, "no reply from");
    int losses = count_in(wk_log, "lost; unavailable until it is back");
    ck_assert_msg(timeouts <= 1 && losses == 1,
                  "the worker's log has %d store timeouts and %d losses, not one: %s", timeouts,
                  losses, log_end(wk_log));
    ck_assert_msg(tu_file_has(wk_log, "signal: stopping"), "%s", log_end(wk_log));
    kill(kv, SIGCONT);
    wk = start_worker(&e, "30000", wk2_log);
    ct_wait_and_check(c, jobs, N_JOBS);
    rekv_ctl_close(c);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    ct_free_jobs(jobs, N_JOBS);
    ct_env_close(&e);
}
END_TEST

/* The store stops under an idle worker whose store timeout is ten minutes: its loop's next lease
 * renewal waits on the store (the coordinator hears nothing from it for a second: its heartbeat
 * is 100 ms), and SIGTERM ends that wait and the worker, cleanly. */
START_TEST(worker_idle_stops_while_store_hangs)
{
    env e;
    if (ct_env_open(&e))
        return;
    char kv_log[4300], wk_log[4300], prog[4096];
    snprintf(kv_log, sizeof(kv_log), "%s/kvstore.log", e.dir);
    snprintf(wk_log, sizeof(wk_log), "%s/worker.log", e.dir);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,  "--endpoint",    e.kv,  "--model",    e.model, "--host-bytes",
                           "64M", "--cache-dtype", "f32", "--no-spill", NULL};
    pid_t kv = tu_spawn(kargs, kv_log, NULL);
    ck_assert_msg(kv > 0, "rekv-kvstore exited at start");
    pid_t co = ct_start_coordinator(&e, "64", "600000");
    pid_t wk = start_worker(&e, "600000", wk_log);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    kill(kv, SIGSTOP);
    for (;;) { /* the worker's loop waits on the store: no heartbeat for a second */
        Rekv__Control__Response *r = tu_ctl_stats(c);
        int stuck = r->stats->n_workers == 1 && r->stats->workers[0]->idle_s >= 1.0;
        rekv__control__response__free_unpacked(r, NULL);
        if (stuck)
            break;
        usleep(20000);
    }
    int st = tu_stop(wk);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %d: %s", st,
                  log_end(wk_log));
    ck_assert_msg(tu_file_has(wk_log, "signal: stopping"), "%s", log_end(wk_log));
    kill(kv, SIGCONT);
    rekv_ctl_close(c);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    ct_env_close(&e);
}
END_TEST

/* A worker started against a kvstore that is not there yet says so after a moment, naming the
 * endpoint, rather than waiting in silence (issue 41); it still stops cleanly on SIGTERM. */
START_TEST(worker_says_it_waits_for_the_store)
{
    env e;
    if (ct_env_open(&e))
        return;
    char wk_log[4300];
    snprintf(wk_log, sizeof(wk_log), "%s/worker.log", e.dir);
    pid_t co = ct_start_coordinator(&e, "64", "600000");
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,      "--model",   e.model, "--coordinator", e.wrk, "--name", "w0",
                          "--backend", "cpu",     "--mode", "offload",   "--kvstore", e.kv, NULL};
    pid_t wk = fork(); /* not tu_spawn: it is not ready, and must not be */
    ck_assert_int_ge(wk, 0);
    if (wk == 0) {
        int fd = open(wk_log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd < 0 || dup2(fd, 2) < 0)
            _exit(126);
        execv(prog, (char *const *)args);
        _exit(127);
    }
    while (!tu_file_has(wk_log, "waiting for the kvstore at")) /* e.kv: nobody serves it */
        usleep(20000);
    ck_assert_msg(tu_file_has(wk_log, e.kv), "the line names the endpoint: %s", log_end(wk_log));
    int st = tu_stop(wk);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %d: %s", st,
                  log_end(wk_log));
    ck_assert_int_eq(tu_stop(co), 0);
    ct_env_close(&e);
}
END_TEST

/* A worker started against a kvstore that is already hung (SIGSTOPped before the worker came:
 * its socket accepts, the arena never comes), with a store timeout of ten minutes: SIGTERM during
 * that first connect ends the worker cleanly — exit 0, no ERROR — long before the timeout
 * (Check's 60 s guard). */
START_TEST(worker_first_connect_to_hung_store_stops)
{
    env e;
    if (ct_env_open(&e))
        return;
    char kv_log[4300], wk_log[4300], prog[4096];
    snprintf(kv_log, sizeof(kv_log), "%s/kvstore.log", e.dir);
    snprintf(wk_log, sizeof(wk_log), "%s/worker.log", e.dir);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,  "--endpoint",    e.kv,  "--model",    e.model, "--host-bytes",
                           "64M", "--cache-dtype", "f32", "--no-spill", NULL};
    pid_t kv = tu_spawn(kargs, kv_log, NULL);
    ck_assert_msg(kv > 0, "rekv-kvstore exited at start");
    kill(kv, SIGSTOP);
    pid_t co = ct_start_coordinator(&e, "64", "600000");
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,        "--model",  e.model,   "--coordinator",
                          e.wrk,       "--name",   "w0",      "--backend",
                          "cpu",       "--mode",   "offload", "--kvstore",
                          e.kv,        "--kvstore-timeout-ms", "600000", NULL};
    pid_t wk = fork(); /* not tu_spawn: it is not ready, and must not be */
    ck_assert_int_ge(wk, 0);
    if (wk == 0) {
        int fd = open(wk_log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd < 0 || dup2(fd, 2) < 0)
            _exit(126);
        execv(prog, (char *const *)args);
        _exit(127);
    }
    /* its first connect waits for the arena the stopped store never sends (the line before it
     * is the model's fingerprint; a moment more to be inside the wait) */
    while (!tu_file_has(wk_log, "the model's fingerprint is"))
        usleep(20000);
    usleep(300000);
    int st = tu_stop(wk);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %d: %s", st,
                  log_end(wk_log));
    ck_assert_msg(!tu_file_has(wk_log, "ERROR"), "a stop is no error: %s", log_end(wk_log));
    kill(kv, SIGCONT);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("hung_store");
    TCase *tc = tcase_create("client");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, client_timeout_is_loss);
    tcase_add_test(tc, client_stop_fd_ends_the_wait);
    suite_add_tcase(s, tc);
    tc = tcase_create("worker");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, worker_store_hangs);
    tcase_add_test(tc, worker_idle_stops_while_store_hangs);
    tcase_add_test(tc, worker_says_it_waits_for_the_store);
    tcase_add_test(tc, worker_first_connect_to_hung_store_stops);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
