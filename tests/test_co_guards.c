/* test_co_guards.c — what the coordinator refuses or bounds, with the real rekv-coordinator on
 * real ZeroMQ sockets and the test speaking worker.proto itself on a DEALER (a worker that says
 * and returns what a broken or hostile one would): a Hello with max_batch 2^32-1 is capped to
 * REKV_WORKER_MAX_BATCH, one with no vocabulary is told to shut down; token ids outside the
 * vocabulary fail the step (the job is re-queued and run again, or failed after --max-attempts,
 * never given the ids); a worker holds two Plans at once, and a job that joins in the second is
 * not taken as lost by the first's Progress; top_logits above 64, or top_logits x
 * max_new_tokens above 2^20, is a bad request; finished jobs are forgotten oldest first beyond
 * --keep-finished jobs or --keep-finished-bytes of results, and Status says so; a flood of
 * malformed worker messages logs at most a line a second, and the lines' "suppressed" counts add
 * up to the messages. */
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

/* ---------------------------------------------------------------- the coordinator */

typedef struct env {
    char *dir;
    char ctl[4200], wrk[4200], state[4200], log[4200];
    pid_t co;
} env;

/* Starts rekv-coordinator in a fresh directory with extra arguments (NULL-terminated). */
static void env_start(env *e, const char *const *extra)
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

static void env_stop(env *e)
{
    kill(e->co, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(e->co, &st, 0), e->co);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "coordinator status %d", st);
    tu_rmrf(e->dir);
    free(e->dir);
}

static rekv_ctl *ctl_open(const char *ep)
{
    rekv_ctl *c = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_connect(ep, NULL, &c, &err) == 0, "%s", err.msg);
    return c;
}

static Rekv__Control__Response *call(rekv_ctl *c, Rekv__Control__Request *rq)
{
    Rekv__Control__Response *r = NULL;
    rekv_err err = {0};
    rq->id = 0;
    ck_assert_msg(rekv_ctl_call(c, rq, 20000, &r, &err) == 0, "%s", err.msg);
    return r;
}

static Rekv__Control__Response *submit(rekv_ctl *c, uint32_t max_new, uint32_t top_logits)
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
    return call(c, &rq);
}

static uint64_t submit_ok(rekv_ctl *c, uint32_t max_new, uint32_t top_logits)
{
    Rekv__Control__Response *r = submit(c, max_new, top_logits);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "submit: %s", r->error);
    uint64_t id = r->submitted->job;
    rekv__control__response__free_unpacked(r, NULL);
    return id;
}

static Rekv__Control__Response *status(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__StatusRequest s = REKV__CONTROL__STATUS_REQUEST__INIT;
    s.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &s;
    return call(c, &rq);
}

static Rekv__Control__Response *stats(rekv_ctl *c)
{
    Rekv__Control__StatsRequest s = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &s;
    return call(c, &rq);
}

/* Waits until job has ended; returns its status. */
static Rekv__Control__Response *wait_end(rekv_ctl *c, uint64_t job)
{
    uint64_t deadline = rekv_now_ns() + 30000000000ull;
    for (;;) {
        Rekv__Control__Response *r = status(c, job);
        ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "status: %s", r->error);
        if (r->job->state != REKV__CONTROL__JOB_STATE__QUEUED &&
            r->job->state != REKV__CONTROL__JOB_STATE__RUNNING)
            return r;
        rekv__control__response__free_unpacked(r, NULL);
        ck_assert_msg(rekv_now_ns() < deadline, "job %llu did not end", (unsigned long long)job);
        usleep(10000);
    }
}

/* ---------------------------------------------------------------- a worker, by hand */

typedef struct fake {
    void *zctx, *sock;
} fake;

static void fake_open(fake *f, const char *ep)
{
    f->zctx = zmq_ctx_new();
    f->sock = zmq_socket(f->zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_connect(f->sock, ep), 0);
}

static void fake_close(fake *f)
{
    zmq_close(f->sock);
    zmq_ctx_term(f->zctx);
}

static void fake_send(fake *f, Rekv__Worker__WorkerMsg *m)
{
    m->version = REKV_WORKER_PROTO_VERSION;
    size_t n = rekv__worker__worker_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    rekv__worker__worker_msg__pack(m, buf);
    ck_assert_int_eq(zmq_send(f->sock, buf, n, 0), (int)n);
    free(buf);
}

/* The coordinator's next message (NULL after 20 s). */
static Rekv__Worker__CoordMsg *fake_recv(fake *f)
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

static Rekv__Worker__CoordMsg *fake_hello(fake *f, uint32_t max_batch, uint32_t vocab)
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
    fake_send(f, &m);
    Rekv__Worker__CoordMsg *cm = fake_recv(f);
    ck_assert_msg(cm != NULL, "no answer to Hello");
    return cm;
}

/* Connects a worker to ep and says Hello, which must be answered Welcome. */
static void fake_welcomed(fake *f, const char *ep, uint32_t max_batch, uint32_t vocab)
{
    fake_open(f, ep);
    Rekv__Worker__CoordMsg *cm = fake_hello(f, max_batch, vocab);
    ck_assert_int_eq(cm->body_case, REKV__WORKER__COORD_MSG__BODY_WELCOME);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
}

/* The next Plan (NULL when none comes). */
static Rekv__Worker__CoordMsg *fake_plan(fake *f)
{
    for (;;) {
        Rekv__Worker__CoordMsg *cm = fake_recv(f);
        if (cm == NULL || cm->body_case == REKV__WORKER__COORD_MSG__BODY_PLAN)
            return cm;
        rekv__worker__coord_msg__free_unpacked(cm, NULL);
    }
}

/* Answers step with one job's tokens (and k top logits per token, ids 0..k-1, when k > 0). */
static void fake_progress(fake *f, uint64_t step, uint64_t job, const int32_t *tokens, size_t n,
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
    fake_send(f, &m);
    free(ti);
    free(tv);
}

/* Reads the next Plan, which must join nothing, and answers it with a Progress naming no job
 * (what a worker says of a step whose jobs the coordinator no longer runs there). */
static void fake_empty(fake *f)
{
    Rekv__Worker__CoordMsg *cm = fake_plan(f);
    ck_assert_msg(cm != NULL, "no Plan");
    ck_assert_uint_eq(cm->plan->n_join, 0);
    Rekv__Worker__Progress p = REKV__WORKER__PROGRESS__INIT;
    p.step = cm->plan->step;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &p;
    fake_send(f, &m);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
}

/* ---------------------------------------------------------------- Hello */

/* max_batch 2^32-1 is capped (no 32 GiB table; the coordinator serves the worker); a Hello
 * without a vocabulary is answered Shutdown and makes no worker. */
START_TEST(hello_validated)
{
    env e;
    env_start(&e, NULL);
    rekv_ctl *c = ctl_open(e.ctl);
    fake bad;
    fake_open(&bad, e.wrk);
    Rekv__Worker__CoordMsg *cm = fake_hello(&bad, 8, 0);
    ck_assert_int_eq(cm->body_case, REKV__WORKER__COORD_MSG__BODY_SHUTDOWN);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    fake_close(&bad);

    fake f;
    fake_welcomed(&f, e.wrk, UINT32_MAX, 512);
    Rekv__Control__Response *r = stats(c);
    ck_assert_uint_eq(r->stats->n_workers, 1);
    ck_assert_uint_eq(r->stats->workers[0]->max_batch, REKV_WORKER_MAX_BATCH);
    rekv__control__response__free_unpacked(r, NULL);
    /* and it is served */
    uint64_t j = submit_ok(c, 1, 0);
    cm = fake_plan(&f);
    ck_assert_ptr_nonnull(cm);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    ck_assert_uint_eq(cm->plan->join[0]->job, j);
    int32_t t[] = {42};
    fake_progress(&f, cm->plan->step, j, t, 1, 1, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    r = wait_end(c, j);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
    rekv__control__response__free_unpacked(r, NULL);
    fake_close(&f);
    rekv_ctl_close(c);
    char *log = tu_read_file(e.log, NULL);
    ck_assert_msg(log && strstr(log, "says max_batch 4294967295; it gets at most 4096"), "%s", log);
    ck_assert_msg(strstr(log, "refused: its vocabulary of 0 tokens"), "%s", log);
    free(log);
    env_stop(&e);
}
END_TEST

/* ---------------------------------------------------------------- results */

/* Token ids outside the vocabulary (512): the step's output is refused, the job is dropped on
 * the worker (the next Plan cancels it) and re-queued; run again with good ids it is DONE with
 * those and nothing else. With every attempt bad it FAILS with the reason and no ids. */
START_TEST(out_of_vocab_tokens_refused)
{
    env e;
    const char *extra[] = {"--max-attempts", "2", NULL};
    env_start(&e, extra);
    rekv_ctl *c = ctl_open(e.ctl);
    fake f;
    fake_welcomed(&f, e.wrk, 4, 512);

    uint64_t j = submit_ok(c, 4, 0);
    Rekv__Worker__CoordMsg *cm = fake_plan(&f);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    int32_t bad[] = {512};
    fake_progress(&f, cm->plan->step, j, bad, 1, 0, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    fake_empty(&f);     /* the next step's Plan went out with the first: j was still good */
    cm = fake_plan(&f); /* dropped here, and joins again */
    ck_assert_ptr_nonnull(cm);
    ck_assert_uint_eq(cm->plan->n_cancel, 1);
    ck_assert_uint_eq(cm->plan->cancel[0], j);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    ck_assert_uint_eq(cm->plan->join[0]->job, j);
    int32_t good[] = {7, 8};
    fake_progress(&f, cm->plan->step, j, good, 2, 1, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    fake_empty(&f); /* made before j had finished */
    Rekv__Control__Response *r = wait_end(c, j);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
    ck_assert_uint_eq(r->job->attempts, 2);
    ck_assert_uint_eq(r->job->n_generated_ids, 2);
    ck_assert_int_eq(r->job->generated_ids[0], 7);
    ck_assert_int_eq(r->job->generated_ids[1], 8);
    rekv__control__response__free_unpacked(r, NULL);

    /* every attempt bad (a negative id, then one among good ones): failed, no ids */
    uint64_t k = submit_ok(c, 4, 0);
    cm = fake_plan(&f);
    int32_t neg[] = {-1};
    fake_progress(&f, cm->plan->step, k, neg, 1, 0, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    fake_empty(&f);
    cm = fake_plan(&f);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    int32_t mixed[] = {3, 100000, 4};
    fake_progress(&f, cm->plan->step, k, mixed, 3, 1, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    r = wait_end(c, k);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__FAILED);
    ck_assert_msg(strstr(r->job->error, "token id 100000, outside the vocabulary of 512"), "%s",
                  r->job->error);
    ck_assert_uint_eq(r->job->n_generated_ids, 0);
    rekv__control__response__free_unpacked(r, NULL);
    r = stats(c);
    ck_assert_uint_eq(r->stats->worker_results_rejected, 3);
    ck_assert_uint_eq(r->stats->done, 1);
    ck_assert_uint_eq(r->stats->failed, 1);
    rekv__control__response__free_unpacked(r, NULL);
    fake_close(&f);
    rekv_ctl_close(c);
    env_stop(&e);
}
END_TEST

/* ---------------------------------------------------------------- two Plans out */

/* A worker holds two Plans: the one it runs and the next, sent before the first's Progress is in
 * (so the worker never waits for the round trip). Job a joins in Plan 1 and Plan 2 (a's next
 * step) comes without a Progress; b, submitted meanwhile, waits for a Plan slot (two are out) and
 * joins in Plan 3, sent once Progress 1 is in. Progress 2 names no job (a finished in step 1, b is
 * not in step 2): neither is lost, nothing is re-queued, each job runs once. */
START_TEST(two_plans_out)
{
    env e;
    env_start(&e, NULL);
    rekv_ctl *c = ctl_open(e.ctl);
    fake f;
    fake_welcomed(&f, e.wrk, 2, 512);

    uint64_t a = submit_ok(c, 1, 0);
    Rekv__Worker__CoordMsg *p1 = fake_plan(&f), *p2 = fake_plan(&f);
    ck_assert_msg(p1 && p2, "the second Plan did not come before the first's Progress");
    ck_assert_uint_eq(p1->plan->n_join, 1);
    ck_assert_uint_eq(p1->plan->join[0]->job, a);
    ck_assert_uint_eq(p2->plan->step, p1->plan->step + 1);
    ck_assert_uint_eq(p2->plan->n_join, 0);
    uint64_t b = submit_ok(c, 1, 0);
    Rekv__Control__Response *r = status(c, b);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__QUEUED);
    rekv__control__response__free_unpacked(r, NULL);

    int32_t t[] = {42};
    fake_progress(&f, p1->plan->step, a, t, 1, 1, 0);
    Rekv__Worker__CoordMsg *p3 = fake_plan(&f);
    ck_assert_ptr_nonnull(p3);
    ck_assert_uint_eq(p3->plan->step, p2->plan->step + 1);
    ck_assert_uint_eq(p3->plan->n_join, 1);
    ck_assert_uint_eq(p3->plan->join[0]->job, b);
    Rekv__Worker__Progress pr = REKV__WORKER__PROGRESS__INIT; /* step 2: no job */
    pr.step = p2->plan->step;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &pr;
    fake_send(&f, &m);
    int32_t u[] = {43};
    fake_progress(&f, p3->plan->step, b, u, 1, 1, 0);
    for (int i = 0; i < 2; i++) {
        r = wait_end(c, i ? b : a);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
        ck_assert_uint_eq(r->job->attempts, 1);
        ck_assert_uint_eq(r->job->n_generated_ids, 1);
        ck_assert_int_eq(r->job->generated_ids[0], i ? 43 : 42);
        rekv__control__response__free_unpacked(r, NULL);
    }
    r = stats(c);
    ck_assert_uint_eq(r->stats->requeued, 0);
    ck_assert_uint_eq(r->stats->steps_failed, 0);
    ck_assert_uint_eq(r->stats->steps, 2); /* that ran a job */
    rekv__control__response__free_unpacked(r, NULL);
    rekv__worker__coord_msg__free_unpacked(p1, NULL);
    rekv__worker__coord_msg__free_unpacked(p2, NULL);
    rekv__worker__coord_msg__free_unpacked(p3, NULL);
    fake_close(&f);
    rekv_ctl_close(c);
    env_stop(&e);
}
END_TEST

/* ---------------------------------------------------------------- caps */

START_TEST(top_logits_capped)
{
    env e;
    env_start(&e, NULL);
    rekv_ctl *c = ctl_open(e.ctl);
    Rekv__Control__Response *r = submit(c, 8, REKV_TOP_LOGITS_MAX + 1);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    ck_assert_msg(strstr(r->error, "top_logits 65 is above the limit of 64"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    uint32_t most = REKV_TOP_LOGITS_MAX_ENTRIES / REKV_TOP_LOGITS_MAX;
    r = submit(c, most + 1, REKV_TOP_LOGITS_MAX);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    ck_assert_msg(strstr(r->error, "top_logits x max_new_tokens"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    submit_ok(c, most, REKV_TOP_LOGITS_MAX);
    submit_ok(c, 8, REKV_TOP_LOGITS_MAX);
    rekv_ctl_close(c);
    env_stop(&e);
}
END_TEST

/* Beyond --keep-finished jobs the oldest finished job is forgotten: its Status says so, the
 * others answer. */
START_TEST(finished_jobs_capped_by_count)
{
    env e;
    const char *extra[] = {"--keep-finished", "2", NULL};
    env_start(&e, extra);
    rekv_ctl *c = ctl_open(e.ctl);
    uint64_t id[3];
    for (int i = 0; i < 3; i++) {
        id[i] = submit_ok(c, 4, 0);
        Rekv__Control__Cancel cn = REKV__CONTROL__CANCEL__INIT;
        cn.job = id[i];
        Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
        rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
        rq.cancel = &cn;
        Rekv__Control__Response *r = call(c, &rq);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        rekv__control__response__free_unpacked(r, NULL);
    }
    Rekv__Control__Response *r = status(c, id[0]);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    ck_assert_msg(strstr(r->error, "no longer remembered") && strstr(r->error, "last 2 finished"),
                  "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    for (int i = 1; i < 3; i++) {
        r = status(c, id[i]);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
        rekv__control__response__free_unpacked(r, NULL);
    }
    r = status(c, id[2] + 1000);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    ck_assert_msg(strstr(r->error, "no job"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    r = stats(c);
    ck_assert_uint_eq(r->stats->finished_forgotten, 1);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    env_stop(&e);
}
END_TEST

/* Results with 64 top logits per token (16 tokens: ~8 KiB each in memory) under a 24 KiB cap:
 * two are remembered, the third finished job makes the coordinator forget the first. */
START_TEST(finished_jobs_capped_by_bytes)
{
    env e;
    const char *extra[] = {"--keep-finished-bytes", "24576", NULL};
    env_start(&e, extra);
    rekv_ctl *c = ctl_open(e.ctl);
    fake f;
    fake_welcomed(&f, e.wrk, 1, 512);
    int32_t toks[16];
    for (int i = 0; i < 16; i++)
        toks[i] = 100 + i;
    uint64_t id[3];
    for (int i = 0; i < 3; i++) {
        id[i] = submit_ok(c, 16, 64);
        Rekv__Worker__CoordMsg *cm = fake_plan(&f);
        ck_assert_ptr_nonnull(cm);
        ck_assert_uint_eq(cm->plan->join[0]->top_logits, 64);
        fake_progress(&f, cm->plan->step, id[i], toks, 16, 1, 64);
        rekv__worker__coord_msg__free_unpacked(cm, NULL);
        fake_empty(&f); /* the Plan made before the job had finished */
        Rekv__Control__Response *r = wait_end(c, id[i]);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
        ck_assert_uint_eq(r->job->n_top_ids, 16 * 64);
        rekv__control__response__free_unpacked(r, NULL);
    }
    Rekv__Control__Response *r = status(c, id[0]);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    ck_assert_msg(strstr(r->error, "no longer remembered"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    for (int i = 1; i < 3; i++) {
        r = status(c, id[i]);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        ck_assert_uint_eq(r->job->n_generated_ids, 16);
        ck_assert_uint_eq(r->job->n_top_ids, 16 * 64);
        rekv__control__response__free_unpacked(r, NULL);
    }
    r = stats(c);
    ck_assert_uint_eq(r->stats->finished_forgotten, 1);
    rekv__control__response__free_unpacked(r, NULL);
    fake_close(&f);
    rekv_ctl_close(c);
    env_stop(&e);
}
END_TEST

/* ---------------------------------------------------------------- log flood */

START_TEST(ratelimit_helper)
{
    rekv_ratelimit rl = REKV_RATELIMIT_INIT;
    uint64_t held = 99, s = 1000000000ull;
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 5 * s, s, &held), 1); /* the first one */
    ck_assert_uint_eq(held, 0);
    for (int i = 0; i < 10; i++)
        ck_assert_int_eq(rekv_ratelimit_allow(&rl, 5 * s + (uint64_t)i * (s / 20), s, &held), 0);
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 6 * s - 1, s, &held), 0);
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 6 * s, s, &held), 1);
    ck_assert_uint_eq(held, 11);
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 9 * s, s, &held), 1);
    ck_assert_uint_eq(held, 0);
}
END_TEST

/* Counts the log's lines holding needle and the messages they say they held back. */
static void count_lines_of(const char *log, const char *needle, uint64_t *lines, uint64_t *held)
{
    *lines = *held = 0;
    char *t = tu_read_file(log, NULL);
    for (char *l = t ? strtok(t, "\n") : NULL; l; l = strtok(NULL, "\n")) {
        if (!strstr(l, needle))
            continue;
        (*lines)++;
        const char *p = strstr(l, "(");
        unsigned long long n;
        if (p && sscanf(p, "(%llu similar messages suppressed)", &n) == 1)
            *held += n;
    }
    free(t);
}

/* ... about malformed worker messages */
static void count_lines(const char *log, uint64_t *lines, uint64_t *held)
{
    count_lines_of(log, "worker socket: a malformed message", lines, held);
}

static uint64_t malformed_seen(rekv_ctl *c)
{
    Rekv__Control__Response *r = stats(c);
    uint64_t n = r->stats->worker_messages_malformed;
    rekv__control__response__free_unpacked(r, NULL);
    return n;
}

/* 2000 malformed worker messages: every one is counted, a few lines are logged, and the lines
 * plus the counts of suppressed ones they carry add up to the messages. (Messages keep coming,
 * one at a time, until a line carrying a count appears: the last held-back ones are told by the
 * next line let through.) */
START_TEST(worker_warnings_rate_limited)
{
    env e;
    env_start(&e, NULL);
    rekv_ctl *c = ctl_open(e.ctl);
    fake f;
    fake_open(&f, e.wrk);
    enum { N = 2000 };
    static const char junk[] = "\xff\xff\xff not worker.proto";
    for (int i = 0; i < N; i++)
        ck_assert_int_eq(zmq_send(f.sock, junk, sizeof(junk) - 1, 0), (int)sizeof(junk) - 1);
    uint64_t sent = N, deadline = rekv_now_ns() + 60000000000ull;
    while (malformed_seen(c) < sent) {
        ck_assert_msg(rekv_now_ns() < deadline, "the coordinator did not read them");
        usleep(10000);
    }
    uint64_t lines, held;
    count_lines(e.log, &lines, &held);
    ck_assert_uint_ge(lines, 1);
    ck_assert_uint_lt(lines, N / 4);
    while (lines + held < sent) {
        ck_assert_msg(rekv_now_ns() < deadline, "%llu lines, %llu held back, %llu sent",
                      (unsigned long long)lines, (unsigned long long)held,
                      (unsigned long long)sent);
        ck_assert_int_eq(zmq_send(f.sock, junk, sizeof(junk) - 1, 0), (int)sizeof(junk) - 1);
        sent++;
        while (malformed_seen(c) < sent)
            usleep(5000);
        count_lines(e.log, &lines, &held);
        usleep(100000);
    }
    ck_assert_uint_eq(lines + held, sent);
    ck_assert_uint_ge(held, N - N / 4);
    fake_close(&f);
    rekv_ctl_close(c);
    env_stop(&e);
}
END_TEST

/* Reads one worker message from a ROUTER (its routing id into id, idn bytes); NULL after 20 s. */
static Rekv__Worker__WorkerMsg *router_recv(void *sock, char *id, int *idn)
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

/* The test as a worker's coordinator: a ROUTER on a fresh ipc endpoint and rekv-gpuworker
 * (stories260K, cpu, resident, heartbeats every 100 ms) connected to it, its Hello read (the
 * worker's routing id in id/idn). */
typedef struct fake_co {
    char *dir;
    char ep[4200], log[4200], id[256];
    int idn;
    void *ctx, *sock;
    pid_t pid;
} fake_co;

static void *fake_co_bind(fake_co *f)
{
    void *sock = zmq_socket(f->ctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_bind(sock, f->ep), 0);
    return sock;
}

/* 0, or -1 when the model is missing (the test skips, tu_shared said why) */
static int fake_co_start(fake_co *f)
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
    f->sock = fake_co_bind(f);
    const char *args[] = {prog,  "--model",   model, "--coordinator", f->ep,      "--name",
                          "w0",  "--backend", "cpu", "--mode",        "resident", "--heartbeat-ms",
                          "100", NULL};
    f->pid = tu_spawn(args, f->log, NULL);
    ck_assert_msg(f->pid > 0, "rekv-gpuworker exited at start");
    Rekv__Worker__WorkerMsg *wm = router_recv(f->sock, f->id, &f->idn);
    ck_assert_msg(wm && wm->body_case == REKV__WORKER__WORKER_MSG__BODY_HELLO, "no Hello");
    rekv__worker__worker_msg__free_unpacked(wm, NULL);
    return 0;
}

/* sends one message (body, n bytes) to the worker */
static void fake_co_send(fake_co *f, const void *body, size_t n)
{
    ck_assert_int_eq(zmq_send(f->sock, f->id, (size_t)f->idn, ZMQ_SNDMORE), f->idn);
    ck_assert_int_eq(zmq_send(f->sock, body, n, 0), (int)n);
}

static void fake_co_stop(fake_co *f)
{
    ck_assert_int_eq(tu_stop(f->pid), 0);
    zmq_close(f->sock);
    zmq_ctx_term(f->ctx);
    tu_rmrf(f->dir);
    free(f->dir);
}

/* The worker's side: a coordinator (here the test, on a ROUTER) sending 500 malformed messages
 * makes a few WARN lines, and the lines plus the counts they carry add up to the messages. */
START_TEST(gpuworker_warnings_rate_limited)
{
    fake_co f;
    if (fake_co_start(&f))
        return;
    static const char junk[] = "\xff\xff\xff not worker.proto";
    enum { N = 500 };
    uint64_t sent = 0, lines = 0, held = 0, deadline = rekv_now_ns() + 60000000000ull;
    for (; sent < N; sent++)
        fake_co_send(&f, junk, sizeof(junk) - 1);
    /* one at a time until the held-back ones are told (by the next line let through) */
    while (lines + held < sent) {
        ck_assert_msg(rekv_now_ns() < deadline, "%llu lines, %llu held back, %llu sent",
                      (unsigned long long)lines, (unsigned long long)held,
                      (unsigned long long)sent);
        usleep(100000);
        fake_co_send(&f, junk, sizeof(junk) - 1);
        sent++;
        usleep(100000);
        count_lines_of(f.log, "a malformed message from the coordinator", &lines, &held);
    }
    ck_assert_uint_ge(lines, 1);
    ck_assert_uint_lt(lines, N / 4);
    ck_assert_uint_ge(held, N - N / 4);
    fake_co_stop(&f);
}
END_TEST

/* A coordinator that got a worker's Hello and died before its Welcome: the next one knows the
 * worker only by its heartbeats and answers them Reset; the worker, long past its Hello, says
 * Hello again (was: it ignored every Reset while awaiting a Welcome that could never come). */
START_TEST(gpuworker_hello_lost_with_its_coordinator)
{
    fake_co f;
    if (fake_co_start(&f))
        return;
    /* the coordinator dies unanswered; another takes the endpoint */
    zmq_close(f.sock);
    f.sock = fake_co_bind(&f);
    Rekv__Worker__Reset rs = REKV__WORKER__RESET__INIT;
    Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
    cm.version = REKV_WORKER_PROTO_VERSION;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_RESET;
    cm.reset = &rs;
    uint8_t buf[64];
    size_t n = rekv__worker__coord_msg__pack(&cm, buf);
    int hellos = 0, resets = 0;
    uint64_t deadline = rekv_now_ns() + 30000000000ull;
    while (!hellos && rekv_now_ns() < deadline) {
        Rekv__Worker__WorkerMsg *wm = router_recv(f.sock, f.id, &f.idn);
        ck_assert_msg(wm != NULL, "the worker went silent");
        if (wm->body_case == REKV__WORKER__WORKER_MSG__BODY_HELLO) {
            hellos++;
        } else { /* as the coordinator answers a worker it does not know */
            fake_co_send(&f, buf, n);
            resets++;
        }
        rekv__worker__worker_msg__free_unpacked(wm, NULL);
    }
    ck_assert_msg(hellos == 1, "no Hello again after %d Resets", resets);
    ck_assert_int_ge(resets, 1);
    fake_co_stop(&f);
}
END_TEST

/* --curve-secret-file guards tcp:// endpoints only: on ipc:// sockets (a file, mode 0600) a local
 * client and a local worker, which hold no keys, are served as without it. */
START_TEST(curve_leaves_ipc_alone)
{
    char pub[41], sec[41];
    if (zmq_curve_keypair(pub, sec) != 0) {
        fprintf(stderr, "   skip: this libzmq has no CURVE (%s)\n", zmq_strerror(errno));
        return;
    }
    const char *model = tu_shared("models/stories260K/stories260K.bin");
    if (model == NULL)
        return;
    char *dir = tu_tmpdir(), key[4200], ctl[4200], wrk[4200], log[4200];
    snprintf(key, sizeof(key), "%s/secret", dir);
    snprintf(ctl, sizeof(ctl), "ipc://%s/control", dir);
    snprintf(wrk, sizeof(wrk), "ipc://%s/workers", dir);
    snprintf(log, sizeof(log), "%s/log", dir);
    FILE *f = fopen(key, "w");
    ck_assert_ptr_nonnull(f);
    fputs(sec, f);
    fclose(f);
    const char *co_args[] = {tu_bin("rekv-coordinator"), "--control", ctl, "--workers", wrk,
                             "--curve-secret-file",      key,         NULL};
    pid_t co = tu_spawn(co_args, log, NULL);
    ck_assert_int_gt(co, 0);
    const char *wk_args[] = {tu_bin("rekv-gpuworker"),
                             "--model",
                             model,
                             "--coordinator",
                             wrk,
                             "--backend",
                             "cpu",
                             "--name",
                             "w0",
                             NULL};
    pid_t wk = tu_spawn(wk_args, log, NULL);
    ck_assert_int_gt(wk, 0);
    rekv_ctl *c = tu_ctl_open(ctl);
    tu_ctl_wait_workers(c, 1); /* the worker joined over ipc, and a plain client asks */
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* On a tcp:// endpoint with --curve-secret-file, the worker and the CLI given the coordinator's
 * public key ($REKV_CURVE_SERVER_KEY) are served; a client without it gets no answer. */
START_TEST(curve_on_tcp)
{
    char pub[41], sec[41];
    if (zmq_curve_keypair(pub, sec) != 0) {
        fprintf(stderr, "   skip: this libzmq has no CURVE (%s)\n", zmq_strerror(errno));
        return;
    }
    const char *model = tu_shared("models/stories260K/stories260K.bin");
    if (model == NULL)
        return;
    char *dir = tu_tmpdir(), key[4200], ctl[64], wrk[64], log[4200], cmd[8192];
    int port = 20000 + (int)(getpid() % 20000);
    snprintf(key, sizeof(key), "%s/secret", dir);
    snprintf(ctl, sizeof(ctl), "tcp://127.0.0.1:%d", port);
    snprintf(wrk, sizeof(wrk), "tcp://127.0.0.1:%d", port + 1);
    snprintf(log, sizeof(log), "%s/log", dir);
    FILE *f = fopen(key, "w");
    ck_assert_ptr_nonnull(f);
    fputs(sec, f);
    fclose(f);
    const char *co_args[] = {tu_bin("rekv-coordinator"), "--control", ctl, "--workers", wrk,
                             "--curve-secret-file",      key,         NULL};
    pid_t co = tu_spawn(co_args, log, NULL);
    ck_assert_int_gt(co, 0);
    char want[128];
    snprintf(want, sizeof(want), "REKV_CURVE_SERVER_KEY=%s", pub); /* the key it logs is ours */
    ck_assert(tu_file_has(log, want));
    setenv("REKV_CURVE_SERVER_KEY", pub, 1);
    const char *wk_args[] = {tu_bin("rekv-gpuworker"),
                             "--model",
                             model,
                             "--coordinator",
                             wrk,
                             "--backend",
                             "cpu",
                             "--name",
                             "w0",
                             NULL};
    pid_t wk = tu_spawn(wk_args, log, NULL);
    ck_assert_int_gt(wk, 0);
    /* the CLI with the key: the worker has joined */
    char *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s stats --socket %s", tu_bin("rekv"), ctl);
    int joined = 0;
    for (int i = 0; i < 300 && !joined; i++) {
        ck_assert_int_eq(tu_run(cmd, &out), 0);
        joined = strstr(out, "\"w0\"") != NULL;
        free(out);
        if (!joined)
            usleep(100000);
    }
    ck_assert_msg(joined, "the worker never joined over CURVE");
    /* a malformed key is a clear error */
    setenv("REKV_CURVE_SERVER_KEY", "short", 1);
    snprintf(cmd, sizeof(cmd), "%s stats --socket %s 2>&1", tu_bin("rekv"), ctl);
    ck_assert_int_ne(tu_run(cmd, &out), 0);
    ck_assert_msg(strstr(out, "40 Z85") != NULL, "%s", out);
    free(out);
    unsetenv("REKV_CURVE_SERVER_KEY");
    /* without the key: no answer */
    rekv_ctl *c = NULL;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_ctl_connect(ctl, NULL, &c, &err), 0);
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    Rekv__Control__Response *r = NULL;
    ck_assert_int_eq(rekv_ctl_call(c, &rq, 1000, &r, &err), -ETIMEDOUT);
    rekv_ctl_close(c);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* A daemon lifts its open-file soft limit to the hard one (every connection is a descriptor):
 * started with a soft limit of 256, the coordinator runs with the hard limit. */
START_TEST(daemon_raises_nofile)
{
    struct rlimit old, low;
    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
    if (old.rlim_max <= 256) {
        fprintf(stderr, "   skip: the hard open-file limit is %llu, nothing to raise to\n",
                (unsigned long long)old.rlim_max);
        return;
    }
    low = old;
    low.rlim_cur = 256;
    ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
    char *dir = tu_tmpdir(), ctl[4200], wrk[4200], path[64], line[256];
    snprintf(ctl, sizeof(ctl), "ipc://%s/control", dir);
    snprintf(wrk, sizeof(wrk), "ipc://%s/workers", dir);
    const char *args[] = {tu_bin("rekv-coordinator"), "--control", ctl, "--workers", wrk, NULL};
    pid_t co = tu_spawn(args, NULL, NULL);
    ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
    ck_assert_int_gt(co, 0);
    snprintf(path, sizeof(path), "/proc/%d/limits", (int)co);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    unsigned long long soft = 0, hard = 0;
    int found = 0;
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, "Max open files", 14) == 0)
            found = sscanf(line + 14, "%llu %llu", &soft, &hard) == 2;
    fclose(f);
    ck_assert_msg(found, "no open-file limit in %s", path);
    ck_assert_msg(soft == hard && soft > 256, "the coordinator runs with %llu of %llu", soft, hard);
    ck_assert_int_eq(tu_stop(co), 0);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("co_guards");
    TCase *tc = tcase_create("co_guards");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, ratelimit_helper);
    tcase_add_test(tc, hello_validated);
    tcase_add_test(tc, out_of_vocab_tokens_refused);
    tcase_add_test(tc, two_plans_out);
    tcase_add_test(tc, top_logits_capped);
    tcase_add_test(tc, finished_jobs_capped_by_count);
    tcase_add_test(tc, finished_jobs_capped_by_bytes);
    tcase_add_test(tc, worker_warnings_rate_limited);
    tcase_add_test(tc, gpuworker_warnings_rate_limited);
    tcase_add_test(tc, gpuworker_hello_lost_with_its_coordinator);
    tcase_add_test(tc, curve_leaves_ipc_alone);
    tcase_add_test(tc, curve_on_tcp);
    tcase_add_test(tc, daemon_raises_nofile);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
