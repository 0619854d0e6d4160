/* test_cancel.c — Cancel (issue 36) with real daemons: a running job's Cancel ends it at once
 * (CANCELLED in the reply, no token taken after it, its stream's last event says so) and its worker
 * stops running it within the steps already handed to it (the step it is running and the one
 * queued behind it, CO_PLANS_OUT); and `rekv submit` cancels its job on Ctrl-C or SIGTERM while it
 * streams (exit 130 / 143), and shows --logprobs in its --json object. The worker is held with
 * SIGSTOP while the Cancel goes in, so that no job can finish first: nothing here waits on time. */
#define _GNU_SOURCE
#include <check.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "co_env.h"
#include "testutil.h"

static Rekv__Control__Response *cancel(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__Cancel cn = REKV__CONTROL__CANCEL__INIT;
    cn.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    rq.cancel = &cn;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
    return r;
}

static uint64_t stats_steps(rekv_ctl *c)
{
    Rekv__Control__Response *r = tu_ctl_stats(c);
    uint64_t s = r->stats->steps;
    rekv__control__response__free_unpacked(r, NULL);
    return s;
}

/* A long job, cancelled while it streams; then a job that needs its worker's only slot. */
START_TEST(cancel_running_job)
{
    env e;
    if (ct_env_open(&e))
        return;
    pid_t co = ct_start_coordinator(&e, "64", "60000"), wk = ct_start_worker(&e, "1");
    rekv_ctl *c = ct_ctl_open(e.ctl), *c2 = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    int32_t prompt[] = {1, 403, 407};
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.prompt_ids = prompt;
    s.n_prompt_ids = 3;
    s.max_new_tokens = 400; /* with no EOS stop: runs until cancelled */
    s.stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    uint64_t id, job = 0, n_seen = 0, steps_at_ack = 0;
    size_t n_ack = 0;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_send(c, &rq, &id, &err) == 0, "%s", err.msg);
    for (int done = 0; !done;) {
        Rekv__Control__Response *r = NULL;
        ck_assert_msg(rekv_ctl_recv(c, 60000, &r, &err) == 0, "%s", err.msg);
        ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
        if (r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
            job = r->submitted->job;
        } else {
            const Rekv__Control__StreamEvent *ev = r->event;
            ck_assert_uint_eq(ev->offset, n_seen);
            n_seen += ev->n_tokens;
            if (n_ack == 0 && n_seen >= 3) {
                /* the worker holds still: the job cannot end by itself meanwhile */
                ck_assert_int_eq(kill(wk, SIGSTOP), 0);
                Rekv__Control__Response *cr = cancel(c2, job);
                ck_assert_int_eq(cr->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
                ck_assert_str_eq(cr->job->finish_reason, "cancelled");
                n_ack = cr->job->n_generated_ids;
                ck_assert_uint_ge(n_ack, 3);
                rekv__control__response__free_unpacked(cr, NULL);
                steps_at_ack = stats_steps(c2);
                ck_assert_int_eq(kill(wk, SIGCONT), 0);
            }
            if (ev->done) {
                ck_assert_int_eq(ev->state, REKV__CONTROL__JOB_STATE__CANCELLED);
                done = 1;
            }
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
    ck_assert_uint_gt(n_ack, 0);
    ck_assert_uint_le(n_seen, n_ack); /* no token after the Cancel was answered */
    Rekv__Control__Response *r = tu_ctl_status(c, job);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
    ck_assert_uint_eq(r->job->n_generated_ids, n_ack);
    rekv__control__response__free_unpacked(r, NULL);
    /* the worker (one slot) dropped it: the next job runs there, and the steps since the Cancel
     * are that job's and at most the two the cancelled one was handed before it */
    tjob b[1];
    ct_make_jobs(b, 1, 10, 512, 3);
    b[0].gp.stop_at_eos = 0;
    b[0].gp.max_new_tokens = 10;
    ct_reference(b, 1, e.model);
    ck_assert_int_eq(ct_submit_all(c, b, 1), 1);
    ct_wait_and_check(c, b, 1);
    uint64_t steps = stats_steps(c) - steps_at_ack;
    ck_assert_msg(steps <= 10 + 2, "%llu steps since the Cancel, for a job of 10 tokens",
                  (unsigned long long)steps);
    ct_free_jobs(b, 1);
    rekv_ctl_close(c);
    rekv_ctl_close(c2);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&e);
}
END_TEST

/* `rekv submit` streaming job 1.. of a fresh coordinator; its stdout is read from *out_fd. */
static pid_t submit_child(const env *e, const char *const *extra, int *out_fd)
{
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        dup2(pfd[1], 1);
        const char *argv[32] = {tu_bin("rekv"), "submit", "--socket", e->ctl};
        int n = 4;
        for (; extra[n - 4]; n++)
            argv[n] = extra[n - 4];
        argv[n] = NULL;
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    *out_fd = pfd[0];
    return pid;
}

/* Ctrl-C (and SIGTERM) on a streaming `rekv submit`: the job is cancelled, the exit code says
 * which signal. */
START_TEST(cli_signal_cancels)
{
    env e;
    if (ct_env_open(&e))
        return;
    pid_t co = ct_start_coordinator(&e, "64", "60000"), wk = ct_start_worker(&e, "4");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    const int sigs[2] = {SIGINT, SIGTERM};
    for (int i = 0; i < 2; i++) {
        const char *extra[] = {"--prompt-ids", "1,403,407",    "--max-new-tokens",
                               "400",          "--ignore-eos", NULL};
        int fd;
        pid_t cli = submit_child(&e, extra, &fd);
        char ch;
        ck_assert_int_eq(read(fd, &ch, 1), 1); /* a token id printed: it streams */
        ck_assert_int_eq(kill(wk, SIGSTOP), 0);
        ck_assert_int_eq(kill(cli, sigs[i]), 0);
        int st;
        ck_assert_int_eq(waitpid(cli, &st, 0), cli);
        close(fd);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 128 + sigs[i],
                      "rekv submit ended with status %#x", st);
        Rekv__Control__Response *r = tu_ctl_status(c, (uint64_t)i + 1);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
        ck_assert_uint_lt(r->job->n_generated_ids, 400);
        rekv__control__response__free_unpacked(r, NULL);
        ck_assert_int_eq(kill(wk, SIGCONT), 0);
    }
    /* --json with --logprobs and --top-logprobs: a value per token, K ids per token */
    const char *extra[] = {"--prompt-ids",
                           "1,403,407",
                           "--max-new-tokens",
                           "6",
                           "--ignore-eos",
                           "--json",
                           "--top-logprobs",
                           "2",
                           NULL};
    int fd;
    pid_t cli = submit_child(&e, extra, &fd);
    char buf[65536];
    size_t n = 0;
    ssize_t k;
    while ((k = read(fd, buf + n, sizeof(buf) - 1 - n)) > 0)
        n += (size_t)k;
    buf[n] = '\0';
    close(fd);
    int st;
    ck_assert_int_eq(waitpid(cli, &st, 0), cli);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %#x: %s", st, buf);
    json_error_t jerr;
    json_t *o = json_loads(buf, 0, &jerr);
    ck_assert_msg(o != NULL, "%s: %s", jerr.text, buf);
    json_t *ids = json_object_get(o, "generated_ids"), *lp = json_object_get(o, "logprobs"),
           *top = json_object_get(o, "top_logprobs");
    ck_assert_uint_eq(json_array_size(ids), 6);
    ck_assert_uint_eq(json_array_size(lp), 6);
    ck_assert_uint_eq(json_array_size(top), 6);
    for (size_t t = 0; t < 6; t++) {
        double v = json_number_value(json_array_get(lp, t));
        ck_assert(v <= 0 && v > -100);
        ck_assert_uint_eq(json_array_size(json_array_get(top, t)), 2);
        /* greedy: the token is the most likely one */
        json_t *first = json_array_get(json_array_get(top, t), 0);
        ck_assert_int_eq(json_integer_value(json_object_get(first, "id")),
                         json_integer_value(json_array_get(ids, t)));
    }
    json_decref(o);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&e);
}
END_TEST

static Suite *cancel_suite(void)
{
    Suite *s = suite_create("cancel");
    TCase *tc = tcase_create("cancel");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, cancel_running_job);
    tcase_add_test(tc, cli_signal_cancels);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(cancel_suite());
}
