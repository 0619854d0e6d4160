/* test_worker_names.c — a worker's --name is its identity at the coordinator: a second live
 * worker started under a taken name is refused (Shutdown; the coordinator's log says why) and the
 * first goes on serving every job, none re-run; a worker killed with SIGKILL and restarted under
 * its name still takes over from its dead predecessor (the worker timeout is ten minutes: only
 * the name can make it), and the jobs it had run again to their reference tokens.
 * Real daemons on private sockets: rekv-coordinator, rekv-gpuworker on the cpu backend (tokens
 * equal rekv_generate's), and for the restart rekv-kvstore (offload mode). Model: stories260K. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "coordinator/coordinator.h"
#include "tests/testutil.h"
#define MODEL_REL "models/stories260K/stories260K.bin"
#include "tests/co_env.h"

#define NAME "gpuworker"

typedef struct logs {
    char co[4300], wk[4300], kv[4300];
} logs;

static void logs_open(const env *e, logs *l)
{
    snprintf(l->co, sizeof(l->co), "%s/coordinator.log", e->dir);
    snprintf(l->wk, sizeof(l->wk), "%s/workers.log", e->dir);
    snprintf(l->kv, sizeof(l->kv), "%s/kvstore.log", e->dir);
}

static pid_t start_daemon(const char *const *args, const char *log)
{
    pid_t p = tu_spawn(args, log, NULL);
    ck_assert_msg(p > 0, "%s exited at start: %s", args[0], tu_log_end(log));
    return p;
}

static pid_t start_kvstore(env *e, const logs *l)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *args[] = {prog,  "--endpoint",    e->kv, "--model",     e->model, "--host-bytes",
                          "64M", "--cache-dtype", "f32", "--spill-dir", e->dir,   NULL};
    return start_daemon(args, l->kv);
}

/* The worker timeout is ten minutes: a worker is never dropped for its silence in these tests. */
static pid_t start_coordinator(env *e, const logs *l)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *args[] = {prog,   "--control",           e->ctl,   "--workers",
                          e->wrk, "--state-dir",         e->state, "--queue",
                          "256",  "--worker-timeout-ms", "600000", NULL};
    return start_daemon(args, l->co);
}

/* A worker named NAME; with_kv: offload mode, its KV cache in e's kvstore, else resident. Returns
 * once it said Hello. */
static pid_t start_worker(env *e, const logs *l, int with_kv)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[20] = {
        prog,  "--model",     e->model, "--coordinator",  e->wrk, "--name", NAME,      "--backend",
        "cpu", "--max-batch", "16",     "--heartbeat-ms", "100",  "--mode", "resident"};
    if (with_kv) {
        args[14] = "offload";
        args[15] = "--kvstore";
        args[16] = e->kv;
    }
    return start_daemon(args, l->wk);
}

/* n long jobs (no EOS stop, so that they run while the test acts) with rekv_generate's tokens. */
static void long_jobs(env *e, tjob *jobs, int n, uint64_t salt)
{
    ct_make_jobs(jobs, n, 400, 512, salt);
    for (int i = 0; i < n; i++)
        jobs[i].gp.stop_at_eos = 0;
    ct_reference(jobs, n, e->model);
}

/* Waits until some job has tokens (Check's timeout is the guard). */
static void wait_some_tokens(rekv_ctl *c, tjob *jobs, int n)
{
    for (;;) {
        for (int i = 0; i < n; i++) {
            Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
            int has = r->job && r->job->n_generated_ids > 0;
            rekv__control__response__free_unpacked(r, NULL);
            if (has)
                return;
        }
        usleep(2000);
    }
}

/* Jobs that ended DONE, and the most attempts any job took. */
static int count_done(rekv_ctl *c, tjob *jobs, int n, uint32_t *max_attempts)
{
    int done = 0;
    *max_attempts = 0;
    for (int i = 0; i < n; i++) {
        Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
        ck_assert_ptr_nonnull(r->job);
        done += r->job->state == REKV__CONTROL__JOB_STATE__DONE;
        if (r->job->attempts > *max_attempts)
            *max_attempts = r->job->attempts;
        rekv__control__response__free_unpacked(r, NULL);
    }
    return done;
}

/* Waits for pid to exit, failing at once should a job fail meanwhile (as it does when the two
 * workers replace each other); returns its wait status. */
static int wait_exit_no_job_failed(pid_t pid, rekv_ctl *c, tjob *jobs, int n)
{
    for (;;) { /* Check's timeout is the guard */
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return st;
        for (int i = 0; i < n; i++) {
            Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
            ck_assert_msg(r->job->state != REKV__CONTROL__JOB_STATE__FAILED,
                          "job %d failed while a second worker was under the name: %s", i,
                          r->job->error);
            rekv__control__response__free_unpacked(r, NULL);
        }
        usleep(20000);
    }
}

/* Two live offload workers under one name, their KV caches in one kvstore: the second is refused
 * and exits, the coordinator's log and its own say why (naming the first one's pid), and the first
 * serves every job to its reference tokens, each in one attempt — it was never replaced, and the
 * second never dropped its sequences (a worker drops what its name left only once welcomed). */
START_TEST(second_live_worker_refused)
{
    env e;
    if (ct_env_open(&e))
        return;
    logs l;
    logs_open(&e, &l);
    enum { N = 16 };
    static tjob jobs[N];
    long_jobs(&e, jobs, N, 41);
    pid_t kv = start_kvstore(&e, &l);
    pid_t co = start_coordinator(&e, &l);
    pid_t first = start_worker(&e, &l, 1);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N);
    pid_t second = start_worker(&e, &l, 1);
    int st = wait_exit_no_job_failed(second, c, jobs, N);
    ck_assert_msg(WIFEXITED(st), "the refused worker did not exit (status %#x)", st);
    char why[256];
    snprintf(why, sizeof(why),
             "worker %s refused: another live worker (pid %d) is serving under the name %s; give "
             "each worker its own --name",
             NAME, (int)first, NAME);
    ck_assert_msg(tu_file_has(l.co, why), "the coordinator's log does not say \"%s\": %s", why,
                  tu_log_end(l.co));
    /* and the refused worker's own log says why (Shutdown's reason) */
    snprintf(why, sizeof(why),
             "the coordinator refused this worker: another live worker (pid %d) is serving under "
             "the name %s",
             (int)first, NAME);
    ck_assert_msg(tu_file_has(l.wk, why), "the workers' log does not say \"%s\": %s", why,
                  tu_log_end(l.wk));
    ck_assert_int_eq(kill(first, 0), 0); /* the first one still runs */
    ct_wait_and_check(c, jobs, N);
    uint32_t attempts;
    int done = count_done(c, jobs, N, &attempts);
    fprintf(stderr, "   %d of %d jobs done, at most %u attempts each\n", done, N, attempts);
    ck_assert_int_eq(done, N);
    ck_assert_uint_eq(attempts, 1);
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_uint_eq(r->stats->n_workers, 1);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(first), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* A worker killed with SIGKILL mid-run and restarted under its name takes over from the dead one
 * (silent since the newcomer's Hello): the jobs it ran run again and finish with their reference
 * tokens, and the coordinator knows one worker. */
START_TEST(restart_under_name_takes_over)
{
    env e;
    if (ct_env_open(&e))
        return;
    logs l;
    logs_open(&e, &l);
    enum { N = 16 };
    static tjob jobs[N];
    long_jobs(&e, jobs, N, 42);
    pid_t kv = start_kvstore(&e, &l);
    pid_t co = start_coordinator(&e, &l);
    pid_t wk = start_worker(&e, &l, 1);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N);
    tu_kill9(wk);
    wk = start_worker(&e, &l, 1);
    ct_wait_and_check(c, jobs, N);
    uint32_t attempts;
    int done = count_done(c, jobs, N, &attempts);
    fprintf(stderr, "   %d of %d jobs done after the restart, at most %u attempts each\n", done, N,
            attempts);
    ck_assert_int_eq(done, N);
    ck_assert_uint_ge(attempts, 2); /* some ran on the killed one and again */
    ck_assert_msg(tu_file_has(l.co, "worker " NAME " is replaced by a new worker of its name"),
                  "the coordinator's log does not say the killed worker was replaced: %s",
                  tu_log_end(l.co));
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_uint_eq(r->stats->n_workers, 1);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ck_assert_int_eq(ct_stop(kv), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("worker_names");
    TCase *tc = tcase_create("names");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, second_live_worker_refused);
    tcase_add_test(tc, restart_under_name_takes_over);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
