/* test_attempts.c — what a job's attempts count (issue 41): a worker killed under a job uses one,
 * and the count survives a kill -9 of the coordinator (journaled, replayed); a kvstore killed
 * with SIGKILL under running jobs and started again (as `rekv run` does, here driving `rekv run`
 * itself, whose worker rides the loss out) uses none: the jobs wait for the store and end with
 * rekv_generate's tokens and one attempt — up to --max-attempts such losses a job; one more fails
 * it. With real daemons and sockets (tests/co_env.h); no step
 * is timed, states and counts are waited for (Check's timeout is the guard). Model: stories260K. */
#define _GNU_SOURCE
#include <dirent.h>
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

static void kill9(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* Index of a job running with tokens (after the store came back, one that started again). */
static int wait_some_tokens(rekv_ctl *c, tjob *jobs, int n)
{
    for (;;) {
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

static uint32_t job_attempts(rekv_ctl *c, uint64_t id, Rekv__Control__JobState *state)
{
    Rekv__Control__Response *r = tu_ctl_status(c, id);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK && r->job, "status of job %llu: %s",
                  (unsigned long long)id, r->error);
    uint32_t a = r->job->attempts;
    if (state)
        *state = r->job->state;
    rekv__control__response__free_unpacked(r, NULL);
    return a;
}

static uint64_t stats_requeued(rekv_ctl *c)
{
    Rekv__Control__Response *r = ct_stats(c);
    uint64_t n = r->stats->requeued;
    rekv__control__response__free_unpacked(r, NULL);
    return n;
}

/* The pid of parent's child running prog (0: none), from /proc. */
static pid_t child_of(pid_t parent, const char *prog)
{
    DIR *d = opendir("/proc");
    ck_assert_ptr_nonnull(d);
    pid_t found = 0;
    struct dirent *de;
    while (!found && (de = readdir(d)) != NULL) {
        char path[300], buf[512];
        if (de->d_name[0] < '0' || de->d_name[0] > '9')
            continue;
        snprintf(path, sizeof(path), "/proc/%s/stat", de->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = '\0';
        /* pid (comm) state ppid ... */
        char *open = strchr(buf, '('), *close = strrchr(buf, ')');
        int ppid = 0;
        char st;
        if (open && close && sscanf(close + 1, " %c %d", &st, &ppid) == 2 && ppid == parent &&
            (size_t)(close - open - 1) == strlen(prog) &&
            strncmp(open + 1, prog, strlen(prog)) == 0 && st != 'Z')
            found = (pid_t)atoi(de->d_name);
    }
    closedir(d);
    return found;
}

/* ---------------------------------------------------------------- tests */

/* A worker killed under a job uses its first attempt (and the job backs off before its next,
 * saying so); the coordinator killed with SIGKILL while
 * the job waits in the queue replays it with that attempt used (twice: the second replay reads
 * the journal the first one compacted), and its run on a new worker is its second. */
START_TEST(attempts_survive_coordinator_restart)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 8 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 400, 512, 41);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0; /* long runs, so that the kill lands mid-run */
    ct_reference(jobs, N, e.model);
    pid_t co = ct_start_coordinator(&e, "256", "1000");
    pid_t wk = ct_start_worker(&e, "8");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    int i = wait_some_tokens(c, jobs, N);
    kill9(wk);
    ct_wait_workers(c, 0);
    Rekv__Control__JobState state;
    ck_assert_uint_eq(job_attempts(c, jobs[i].id, &state), 1);
    ck_assert_int_eq(state, REKV__CONTROL__JOB_STATE__QUEUED);
    /* the failed attempt backs off before the next, and says so */
    Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
    ck_assert_msg(strstr(r->job->waiting, "attempt 1 of 3 failed; retrying in 100 ms") != NULL,
                  "waiting: \"%s\"", r->job->waiting);
    rekv__control__response__free_unpacked(r, NULL);
    kill9(co);
    rekv_ctl_close(c);
    co = ct_start_coordinator(&e, "256", "1000");
    c = ct_ctl_open(e.ctl);
    ck_assert_uint_eq(job_attempts(c, jobs[i].id, &state), 1); /* not 0: journaled */
    ck_assert_int_eq(state, REKV__CONTROL__JOB_STATE__QUEUED);
    /* once more: the start's compacted journal carries it too */
    kill9(co);
    rekv_ctl_close(c);
    co = ct_start_coordinator(&e, "256", "1000");
    c = ct_ctl_open(e.ctl);
    ck_assert_uint_eq(job_attempts(c, jobs[i].id, &state), 1);
    ck_assert_int_eq(state, REKV__CONTROL__JOB_STATE__QUEUED);
    wk = ct_start_worker(&e, "8");
    ct_wait_and_check(c, jobs, N);
    ck_assert_uint_eq(job_attempts(c, jobs[i].id, NULL), 2);
    for (int k = 0; k < N; k++)
        ck_assert_uint_le(job_attempts(c, jobs[k].id, NULL), 2);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* `rekv run` (offload mode: the KV cache is in its kvstore) whose kvstore is killed with SIGKILL
 * under running jobs, twice: rekv run starts it again, the worker reconnects, and every job
 * completes with rekv_generate's tokens having used one attempt (the losses used none). */
START_TEST(store_loss_uses_no_attempt)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 8 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 400, 512, 42);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0;
    ct_reference(jobs, N, e.model);
    pid_t run = ct_rekv_run_start(&e, "64M", "8", "offload");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    pid_t wk = child_of(run, "rekv-gpuworker");
    ck_assert_int_gt(wk, 0);
    for (int round = 0; round < 2; round++) {
        uint64_t before = stats_requeued(c);
        wait_some_tokens(c, jobs, N); /* a job running (again) with the current store */
        pid_t kv = child_of(run, "rekv-kvstore");
        ck_assert_int_gt(kv, 0);
        /* rekv run reaps it and starts another */
        kill(kv, SIGKILL);
        while (stats_requeued(c) == before) /* the coordinator saw the loss */
            usleep(2000);
        fprintf(stderr, "   store loss %d: %llu jobs re-queued\n", round + 1,
                (unsigned long long)(stats_requeued(c) - before));
    }
    ct_wait_and_check(c, jobs, N);
    /* the worker rode both losses out (stopping it with the store made the jobs' runs end on
     * its stop too, a race that could count) */
    ck_assert_int_eq(child_of(run, "rekv-gpuworker"), wk);
    for (int k = 0; k < N; k++)
        ck_assert_msg(job_attempts(c, jobs[k].id, NULL) == 1, "job %d used %u attempts", k,
                      job_attempts(c, jobs[k].id, NULL));
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_uint_eq(r->stats->failed, 0);
    ck_assert_uint_eq(r->stats->n_workers, 1);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ct_rekv_run_stop(run);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* A kvstore that dies under the same job again and again (as if the job crashed it): its first
 * --max-attempts (3) losses use no attempt, the 4th fails the job, saying so, instead of running it
 * (and crashing the store) for ever. */
START_TEST(store_losses_are_limited)
{
    env e;
    if (ct_env_open(&e))
        return;
    static tjob jobs[1];
    ct_make_jobs(jobs, 1, 400, 512, 7);
    jobs[0].gp.stop_at_eos = 0;
    pid_t run = ct_rekv_run_start(&e, "64M", "8", "offload");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, 1), 1);
    for (int loss = 1; loss <= 4; loss++) {
        uint64_t before = stats_requeued(c);
        wait_some_tokens(c, jobs, 1);
        pid_t kv = child_of(run, "rekv-kvstore");
        ck_assert_int_gt(kv, 0);
        kill(kv, SIGKILL);
        Rekv__Control__JobState state = REKV__CONTROL__JOB_STATE__RUNNING;
        while (stats_requeued(c) == before && state != REKV__CONTROL__JOB_STATE__FAILED)
            job_attempts(c, jobs[0].id, &state), usleep(2000);
        uint32_t a = job_attempts(c, jobs[0].id, &state);
        fprintf(stderr, "   store loss %d: attempts %u, state %d\n", loss, a, (int)state);
        ck_assert_uint_le(a, 1); /* the losses used none */
        ck_assert_int_eq(state == REKV__CONTROL__JOB_STATE__FAILED, loss == 4);
    }
    Rekv__Control__Response *r = tu_ctl_status(c, jobs[0].id);
    ck_assert_msg(strstr(r->job->error, "the kvstore was lost under it 4 times: given up"), "%s",
                  r->job->error);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ct_rekv_run_stop(run);
    ct_free_jobs(jobs, 1);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("attempts");
    TCase *tc = tcase_create("attempts");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, attempts_survive_coordinator_restart);
    tcase_add_test(tc, store_loss_uses_no_attempt);
    tcase_add_test(tc, store_losses_are_limited);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
