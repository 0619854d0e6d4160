/* co_guard.c — see co_guard.h. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>
#include "common/clock.h"
#include "common/ratelimit.h"
#include "coordinator/coordinator.h"
#include "proto/worker.pb-c.h"
#include "tests/testutil.h"
#include "tests/co_guard.h"

void cg_env_start(env *e, const char *const *extra)
{
    e->dir = tu_tmpdir();
    snprintf(e->ctl, sizeof(e->ctl), "ipc://%s/control", e->dir);
    snprintf(e->wrk, sizeof(e->wrk), "ipc://%s/workers", e->dir);
    snprintf(e->state, sizeof(e->state), "%s/state", e->dir);
    snprintf(e->log, sizeof(e->log), "%s/coordinator.log", e->dir);
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    char prog[4096], fd[16];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    snprintf(fd, sizeof(fd), "%d", pfd[1]);
    const char *argv[40] = {prog,          "--control", e->ctl,       "--workers", e->wrk,
                            "--state-dir", e->state,    "--ready-fd", fd};
    int n = 9;
    for (int i = 0; extra && extra[i] && n < 38; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        int lf = open(e->log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (lf >= 0)
            dup2(lf, 2);
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    struct pollfd p = {pfd[0], POLLIN, 0};
    ck_assert_msg(poll(&p, 1, 60000) == 1, "rekv-coordinator did not become ready");
    char buf[8] = {0};
    ck_assert_msg(read(pfd[0], buf, 7) == 6, "rekv-coordinator exited at start");
    close(pfd[0]);
    e->co = pid;
}

void cg_env_stop(env *e)
{
    kill(e->co, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(e->co, &st, 0), e->co);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "coordinator status %d", st);
    tu_rmrf(e->dir);
    free(e->dir);
}

rekv_ctl *cg_ctl_open(const char *ep)
{
    rekv_ctl *c = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_connect(ep, NULL, &c, &err) == 0, "%s", err.msg);
    return c;
}

Rekv__Control__Response *cg_submit(rekv_ctl *c, uint32_t max_new, uint32_t top_logits)
{
    static int32_t prompt[] = {1, 2, 3};
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.n_prompt_ids = 3;
    s.prompt_ids = prompt;
    s.max_new_tokens = max_new;
    s.top_logits = top_logits;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    return tu_ctl_call(c, &rq);
}

uint64_t cg_submit_ok(rekv_ctl *c, uint32_t max_new, uint32_t top_logits)
{
    Rekv__Control__Response *r = cg_submit(c, max_new, top_logits);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "submit: %s", r->error);
    uint64_t id = r->submitted->job;
    rekv__control__response__free_unpacked(r, NULL);
    return id;
}

Rekv__Control__Response *cg_stats(rekv_ctl *c)
{
    Rekv__Control__StatsRequest s = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &s;
    return tu_ctl_call(c, &rq);
}

Rekv__Control__Response *cg_wait_end(rekv_ctl *c, uint64_t job)
{
    for (;;) {
        Rekv__Control__Response *r = tu_ctl_status(c, job);
        ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "status: %s", r->error);
        if (r->job->state != REKV__CONTROL__JOB_STATE__QUEUED &&
            r->job->state != REKV__CONTROL__JOB_STATE__RUNNING)
            return r;
        rekv__control__response__free_unpacked(r, NULL);
        usleep(10000);
    }
}

void cg_fake_open(fake *f, const char *ep)
{
    f->zctx = zmq_ctx_new();
    f->sock = zmq_socket(f->zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_connect(f->sock, ep), 0);
}

void cg_fake_close(fake *f)
{
    zmq_close(f->sock);
    zmq_ctx_term(f->zctx);
}

void cg_fake_send(fake *f, Rekv__Worker__WorkerMsg *m)
{
    m->version = REKV_WORKER_PROTO_VERSION;
    size_t n = rekv__worker__worker_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    rekv__worker__worker_msg__pack(m, buf);
    ck_assert_int_eq(zmq_send(f->sock, buf, n, 0), (int)n);
    free(buf);
}

Rekv__Worker__CoordMsg *cg_fake_recv(fake *f)
{
    zmq_pollitem_t it = {f->sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 20000) != 1)
        return NULL;
    zmq_msg_t m;
    zmq_msg_init(&m);
    ck_assert_int_ge(zmq_msg_recv(&m, f->sock, 0), 0);
    Rekv__Worker__CoordMsg *cm =
        rekv__worker__coord_msg__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
    zmq_msg_close(&m);
    ck_assert_ptr_nonnull(cm);
    return cm;
}

Rekv__Worker__CoordMsg *cg_fake_hello(fake *f, uint32_t max_batch, uint32_t vocab)
{
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.name = "by-hand";
    h.backend = "cpu";
    h.mode = "resident";
    h.max_batch = max_batch;
    h.vocab = vocab;
    h.max_pos = 512;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_HELLO;
    m.hello = &h;
    cg_fake_send(f, &m);
    Rekv__Worker__CoordMsg *cm = cg_fake_recv(f);
    ck_assert_msg(cm != NULL, "no answer to Hello");
    return cm;
}

void cg_fake_welcomed(fake *f, const char *ep, uint32_t max_batch, uint32_t vocab)
{
    cg_fake_open(f, ep);
    Rekv__Worker__CoordMsg *cm = cg_fake_hello(f, max_batch, vocab);
    ck_assert_int_eq(cm->body_case, REKV__WORKER__COORD_MSG__BODY_WELCOME);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
}

Rekv__Worker__CoordMsg *cg_fake_plan(fake *f)
{
    for (;;) {
        Rekv__Worker__CoordMsg *cm = cg_fake_recv(f);
        if (cm == NULL || cm->body_case == REKV__WORKER__COORD_MSG__BODY_PLAN)
            return cm;
        rekv__worker__coord_msg__free_unpacked(cm, NULL);
    }
}

void cg_fake_progress(fake *f, uint64_t step, uint64_t job, const int32_t *tokens, size_t n,
                      int finished, uint32_t k)
{
    Rekv__Worker__JobProgress jp = REKV__WORKER__JOB_PROGRESS__INIT;
    jp.job = job;
    jp.n_tokens = n;
    jp.tokens = (int32_t *)tokens;
    jp.finished = finished;
    jp.finish_reason = finished ? "length" : "";
    int32_t *ti = NULL;
    float *tv = NULL;
    if (k) {
        ti = calloc(n * k, sizeof(int32_t));
        tv = calloc(n * k, sizeof(float));
        for (size_t i = 0; i < n * k; i++) {
            ti[i] = (int32_t)(i % k);
            tv[i] = (float)(k - i % k);
        }
        jp.n_top_ids = jp.n_top_vals = n * k;
        jp.top_ids = ti;
        jp.top_vals = tv;
    }
    Rekv__Worker__JobProgress *jps[] = {&jp};
    Rekv__Worker__Progress p = REKV__WORKER__PROGRESS__INIT;
    p.step = step;
    p.n_jobs = 1;
    p.jobs = jps;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &p;
    cg_fake_send(f, &m);
    free(ti);
    free(tv);
}

/* Answers step's Plan with a Progress that names no job. */
void cg_fake_no_job(fake *f, uint64_t step, const char *unavailable)
{
    Rekv__Worker__Progress p = REKV__WORKER__PROGRESS__INIT;
    p.step = step;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &p;
    m.unavailable = (char *)unavailable;
    cg_fake_send(f, &m);
}

void cg_fake_empty(fake *f)
{
    Rekv__Worker__CoordMsg *cm = cg_fake_plan(f);
    ck_assert_msg(cm != NULL, "no Plan");
    ck_assert_uint_eq(cm->plan->n_join, 0);
    cg_fake_no_job(f, cm->plan->step, NULL);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
}

Rekv__Worker__CoordMsg *cg_fake_plan_join(fake *f, uint64_t job, int *cancelled)
{
    for (;;) {
        Rekv__Worker__CoordMsg *cm = cg_fake_plan(f);
        ck_assert_msg(cm != NULL, "no Plan");
        for (size_t i = 0; i < cm->plan->n_cancel; i++)
            *cancelled += cm->plan->cancel[i] == job;
        if (cm->plan->n_join > 0)
            return cm;
        cg_fake_no_job(f, cm->plan->step, NULL);
        rekv__worker__coord_msg__free_unpacked(cm, NULL);
    }
}

Rekv__Worker__WorkerMsg *cg_router_recv(void *sock, char *id, int *idn)
{
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 20000) != 1)
        return NULL;
    *idn = zmq_recv(sock, id, 256, 0);
    ck_assert_int_gt(*idn, 0);
    zmq_msg_t m;
    zmq_msg_init(&m);
    ck_assert_int_ge(zmq_msg_recv(&m, sock, 0), 0);
    Rekv__Worker__WorkerMsg *wm =
        rekv__worker__worker_msg__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
    zmq_msg_close(&m);
    ck_assert_ptr_nonnull(wm);
    return wm;
}

void *cg_fake_co_bind(fake_co *f)
{
    void *sock = zmq_socket(f->ctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_bind(sock, f->ep), 0);
    return sock;
}

int cg_fake_co_start(fake_co *f)
{
    const char *mp = tu_shared("models/stories260K/stories260K.bin");
    if (mp == NULL)
        return -1;
    char model[4096], prog[4096];
    snprintf(model, sizeof(model), "%s", mp);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    f->dir = tu_tmpdir();
    snprintf(f->ep, sizeof(f->ep), "ipc://%s/workers", f->dir);
    snprintf(f->log, sizeof(f->log), "%s/worker.log", f->dir);
    f->ctx = zmq_ctx_new();
    f->sock = cg_fake_co_bind(f);
    const char *args[] = {prog,  "--model",   model, "--coordinator", f->ep,      "--name",
                          "w0",  "--backend", "cpu", "--mode",        "resident", "--heartbeat-ms",
                          "100", NULL};
    f->pid = tu_spawn(args, f->log, NULL);
    ck_assert_msg(f->pid > 0, "rekv-gpuworker exited at start");
    Rekv__Worker__WorkerMsg *wm = cg_router_recv(f->sock, f->id, &f->idn);
    ck_assert_msg(wm && wm->body_case == REKV__WORKER__WORKER_MSG__BODY_HELLO, "no Hello");
    rekv__worker__worker_msg__free_unpacked(wm, NULL);
    return 0;
}

void cg_fake_co_send(fake_co *f, const void *body, size_t n)
{
    ck_assert_int_eq(zmq_send(f->sock, f->id, (size_t)f->idn, ZMQ_SNDMORE), f->idn);
    ck_assert_int_eq(zmq_send(f->sock, body, n, 0), (int)n);
}

void cg_fake_co_stop(fake_co *f)
{
    ck_assert_int_eq(tu_stop(f->pid), 0);
    zmq_close(f->sock);
    zmq_ctx_term(f->ctx);
    tu_rmrf(f->dir);
    free(f->dir);
}
