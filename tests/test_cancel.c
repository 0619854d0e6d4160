/* test_cancel.c — Cancel (issue 36) with real daemons: a running job's Cancel ends it at once
 * (CANCELLED in the reply, no token taken after it, its stream's last event says so), and its
 * worker stops running it after the step it is running: the coordinator sends a Drop at once, and
 * a worker taking a Plan reads the Drops already behind it before its step (checked against the
 * worker alone, with the coordinator played here); `rekv submit` cancels its job on Ctrl-C or
 * SIGTERM while it streams (exit 130 / 143), and shows --logprobs in its --json object. The worker
 * is held with SIGSTOP while a Cancel goes in, so that no job can finish first. */
#define _GNU_SOURCE
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "co_env.h"
#include "proto/worker.pb-c.h"
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
     * are that job's and at most two of the cancelled one's: the step it was running, and one
     * whose Progress may have been on its way when the Cancel was answered */
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

/* `rekv CMD --socket CTL [--model MODEL] EXTRA...` (model NULL: none); its stdout is read from
 * *out_fd. */
static pid_t spawn_rekv(const env *e, const char *cmd, const char *model, const char *const *extra,
                        int *out_fd)
{
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        dup2(pfd[1], 1);
        const char *argv[40] = {tu_bin("rekv"), cmd, "--socket", e->ctl};
        int n = 4;
        if (model) {
            argv[n++] = "--model";
            argv[n++] = model;
        }
        for (int i = 0; extra[i] && n < 39; i++)
            argv[n++] = extra[i];
        argv[n] = NULL;
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    *out_fd = pfd[0];
    return pid;
}

/* `rekv submit` streaming job 1.. of a fresh coordinator; its stdout is read from *out_fd. */
static pid_t submit_child(const env *e, const char *const *extra, int *out_fd)
{
    return spawn_rekv(e, "submit", NULL, extra, out_fd);
}

/* Ctrl-C (and SIGTERM) on a streaming `rekv submit`, and Ctrl-C on `rekv generate` through the
 * coordinator: the job is cancelled, the exit code says which signal. */
START_TEST(cli_signal_cancels)
{
    env e;
    if (ct_env_open(&e))
        return;
    /* with --model: `rekv generate --socket` takes only a coordinator of its model */
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *co_args[] = {prog,          "--control", e.ctl,     "--workers", e.wrk,
                             "--state-dir", e.state,     "--model", e.model,     NULL};
    pid_t co = ct_spawn(co_args), wk = ct_start_worker(&e, "4");
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
    /* `rekv generate` through the same coordinator: interrupted, it cancels its job (3) too */
    {
        int fd;
        char mp[4096];
        snprintf(mp, sizeof(mp), "%s", e.model);
        const char *gen[] = {"--prompt-ids", "1,403,407",    "--max-new-tokens",
                             "400",          "--ignore-eos", NULL};
        pid_t cli = spawn_rekv(&e, "generate", mp, gen, &fd);
        for (int running = 0; !running;) { /* its job has tokens: it waits on them */
            ck_assert_msg(waitpid(cli, NULL, WNOHANG) == 0, "rekv generate ended early");
            Rekv__Control__Response *r = tu_ctl_status(c, 3);
            running = r->code == REKV__CONTROL__CODE__OK && r->job->n_generated_ids > 0;
            rekv__control__response__free_unpacked(r, NULL);
            if (!running)
                usleep(10000);
        }
        ck_assert_int_eq(kill(wk, SIGSTOP), 0);
        ck_assert_int_eq(kill(cli, SIGINT), 0);
        int st;
        ck_assert_int_eq(waitpid(cli, &st, 0), cli);
        close(fd);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 130, "rekv generate ended %#x", st);
        Rekv__Control__Response *r = tu_ctl_status(c, 3);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
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

/* ---------------------------------------------------------------- a worker's Drop */

/* The coordinator played here (a ROUTER, as test_assign's): the worker's messages, and ours. */
typedef struct fake {
    void *zctx, *sock;
    uint8_t id[256];
    size_t id_n;
} fake;

static Rekv__Worker__WorkerMsg *fake_expect(fake *f, Rekv__Worker__WorkerMsg__BodyCase body)
{
    for (;;) { /* Check's timeout is the guard */
        zmq_msg_t id, msg;
        zmq_msg_init(&id);
        zmq_msg_init(&msg);
        ck_assert(zmq_msg_recv(&id, f->sock, 0) >= 0 && zmq_msg_more(&id));
        ck_assert(zmq_msg_recv(&msg, f->sock, 0) >= 0);
        f->id_n = zmq_msg_size(&id);
        memcpy(f->id, zmq_msg_data(&id), f->id_n);
        Rekv__Worker__WorkerMsg *m =
            rekv__worker__worker_msg__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
        zmq_msg_close(&id);
        zmq_msg_close(&msg);
        ck_assert(m != NULL);
        if (m->body_case == body)
            return m;
        rekv__worker__worker_msg__free_unpacked(m, NULL);
    }
}

static void fake_send(fake *f, Rekv__Worker__CoordMsg *m)
{
    m->version = REKV_WORKER_PROTO_VERSION;
    size_t n = rekv__worker__coord_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    rekv__worker__coord_msg__pack(m, buf);
    ck_assert_int_eq(zmq_send(f->sock, f->id, f->id_n, ZMQ_SNDMORE), (int)f->id_n);
    ck_assert_int_eq(zmq_send(f->sock, buf, n, 0), (int)n);
    free(buf);
}

static void fake_plan(fake *f, uint64_t step, Rekv__Worker__JobSpec **join, size_t n_join)
{
    Rekv__Worker__Plan plan = REKV__WORKER__PLAN__INIT;
    plan.step = step;
    plan.n_join = n_join;
    plan.join = join;
    Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
    m.body_case = REKV__WORKER__COORD_MSG__BODY_PLAN;
    m.plan = &plan;
    fake_send(f, &m);
}

/* 1 when the step's Progress names the job */
static int progress_names(const Rekv__Worker__Progress *p, uint64_t job)
{
    for (size_t i = 0; i < p->n_jobs; i++)
        if (p->jobs[i]->job == job)
            return 1;
    return 0;
}

/* A Drop that comes behind a Plan the worker holds takes effect before that Plan's step: job 1
 * (running) and job 4 (joining in that Plan) never run in it; jobs 2 and 3 run on. The Plan and
 * the Drop go out as soon as step 2 starts (its Plan sent ahead, as the coordinator does, it starts
 * when step 1's Progress goes out), and step 2 prefills a prompt of 480 tokens of docs8L, so they
 * wait in the worker's socket when step 2 ends. */
START_TEST(worker_drops_ahead_of_plan)
{
    char *dir = tu_tmpdir(), ep[4200];
    const char *model = tu_shared("models/docs8L/docs8L.bin");
    if (model == NULL)
        return;
    snprintf(ep, sizeof(ep), "ipc://%s/workers", dir);
    fake f = {0};
    f.zctx = zmq_ctx_new();
    f.sock = zmq_socket(f.zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f.sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_bind(f.sock, ep), 0);
    char prog[4096], mp[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    snprintf(mp, sizeof(mp), "%s", model);
    const char *args[] = {prog,       "--model",   mp,    "--coordinator", ep,  "--mode",
                          "resident", "--backend", "cpu", "--max-batch",   "4", "--heartbeat-ms",
                          "100",      NULL};
    pid_t wk = ct_spawn(args);
    Rekv__Worker__WorkerMsg *m = fake_expect(&f, REKV__WORKER__WORKER_MSG__BODY_HELLO);
    ck_assert(m->hello->ask);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    Rekv__Worker__Assign a = REKV__WORKER__ASSIGN__INIT;
    a.mode = "resident";
    a.reason = "test_cancel";
    a.persist_np = INFINITY;
    Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_ASSIGN;
    cm.assign = &a;
    fake_send(&f, &cm);
    m = fake_expect(&f, REKV__WORKER__WORKER_MSG__BODY_HELLO);
    ck_assert(!m->hello->ask);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    Rekv__Worker__Welcome wel = REKV__WORKER__WELCOME__INIT;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_WELCOME;
    cm.welcome = &wel;
    fake_send(&f, &cm);
    int32_t prompt[480];
    for (int i = 0; i < 480; i++)
        prompt[i] = 97 + i % 26; /* a..z: docs8L's ids are bytes */
    Rekv__Worker__JobSpec js[4];
    Rekv__Worker__JobSpec *jp[4];
    for (int i = 0; i < 4; i++) {
        rekv__worker__job_spec__init(&js[i]);
        js[i].job = (uint64_t)i + 1;
        js[i].n_prompt = i == 2 ? 480 : 3;
        js[i].prompt = prompt;
        js[i].max_new_tokens = 20;
        js[i].top_p = 1;
        jp[i] = &js[i];
    }
    fake_plan(&f, 1, jp, 2);     /* jobs 1 and 2 */
    fake_plan(&f, 2, jp + 2, 1); /* job 3's long prefill */
    m = fake_expect(&f, REKV__WORKER__WORKER_MSG__BODY_PROGRESS);
    ck_assert_uint_eq(m->progress->step, 1);
    ck_assert(progress_names(m->progress, 1) && progress_names(m->progress, 2));
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    /* step 2 runs: step 3 (job 4 joins), then a Drop of jobs 1 and 4 */
    fake_plan(&f, 3, jp + 3, 1);
    uint64_t drop_ids[] = {1, 4};
    Rekv__Worker__Drop d = REKV__WORKER__DROP__INIT;
    d.n_jobs = 2;
    d.jobs = drop_ids;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_DROP;
    cm.drop = &d;
    fake_send(&f, &cm);
    m = fake_expect(&f, REKV__WORKER__WORKER_MSG__BODY_PROGRESS);
    ck_assert_uint_eq(m->progress->step, 2);
    ck_assert(progress_names(m->progress, 1) && progress_names(m->progress, 2) &&
              progress_names(m->progress, 3));
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    m = fake_expect(&f, REKV__WORKER__WORKER_MSG__BODY_PROGRESS);
    ck_assert_uint_eq(m->progress->step, 3);
    ck_assert_msg(!progress_names(m->progress, 1) && !progress_names(m->progress, 4),
                  "a dropped job ran in the step its Drop came before");
    ck_assert(progress_names(m->progress, 2) && progress_names(m->progress, 3));
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    ck_assert_int_eq(ct_stop(wk), 0);
    zmq_close(f.sock);
    zmq_ctx_term(f.zctx);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *cancel_suite(void)
{
    Suite *s = suite_create("cancel");
    TCase *tc = tcase_create("cancel");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, cancel_running_job);
    tcase_add_test(tc, cli_signal_cancels);
    tcase_add_test(tc, worker_drops_ahead_of_plan);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(cancel_suite());
}
