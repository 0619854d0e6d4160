/* test_faults.c — whole-step failures, with the real rekv-kvstore, rekv-gpuworker and
 * rekv-coordinator on real sockets and a client that streams every job (Submit.stream) and checks
 * that each accepted job ends exactly once — one final event, DONE — with rekv_generate's tokens:
 * the kvstore killed with SIGKILL mid-run and restarted (the worker fails its step, says it is
 * unavailable, reconnects and serves again; the coordinator re-queues the step's jobs), then
 * killed again and not restarted (the worker still stops on SIGTERM); the worker killed mid-run
 * and a new one started under its name (it takes over at once, long before the worker timeout);
 * the worker stopped with SIGSTOP mid-step (the coordinator's step deadline re-queues its jobs,
 * and once continued the worker is reset and finishes them). Outcomes, counts and the order of
 * log lines are asserted; waits are only failure timeouts. Model: stories260K. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "coordinator/coordinator.h"
#include "gpuworker/gpuworker.h"
#include "kvstore/kvstore.h"
#include "tests/spill_fault.h"
#include "tests/testutil.h"

#define MODEL_REL "models/stories260K/stories260K.bin"
#define N_JOBS 8
#define MAX_NEW 160

typedef struct env {
    char *dir;
    char ctl[4200], wrk[4200], state[4200], kv[4200];
    char co_log[4200], wk_log[4200], kv_log[4200];
    char model[4096];
} env;

static int env_open(env *e)
{
    const char *m = tu_shared(MODEL_REL);
    if (m == NULL)
        return -1;
    snprintf(e->model, sizeof(e->model), "%s", m);
    e->dir = tu_tmpdir();
    snprintf(e->ctl, sizeof(e->ctl), "ipc://%s/control", e->dir);
    snprintf(e->wrk, sizeof(e->wrk), "ipc://%s/workers", e->dir);
    snprintf(e->state, sizeof(e->state), "%s/state", e->dir);
    snprintf(e->kv, sizeof(e->kv), "ipc://%s/kvstore", e->dir);
    snprintf(e->co_log, sizeof(e->co_log), "%s/coordinator.log", e->dir);
    snprintf(e->wk_log, sizeof(e->wk_log), "%s/worker.log", e->dir);
    snprintf(e->kv_log, sizeof(e->kv_log), "%s/kvstore.log", e->dir);
    return 0;
}

static void env_close(env *e)
{
    tu_rmrf(e->dir);
    free(e->dir);
}

/* The coordinator; extra: NULL-terminated options. */
static pid_t start_coordinator(env *e, const char *const *extra)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *args[32] = {prog,          "--control", e->ctl,   "--workers", e->wrk,
                            "--state-dir", e->state,    "--queue", "64"};
    int n = 9;
    for (int i = 0; extra && extra[i] && n < 30; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    pid_t p = tu_spawn(args, e->co_log, NULL);
    ck_assert_msg(p > 0, "rekv-coordinator exited at start");
    return p;
}

/* The kvstore; extra: NULL-terminated options (a later --host-bytes or --spill-dir wins). */
static pid_t start_kvstore_with(env *e, const char *const *extra)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *args[32] = {prog,           "--endpoint", e->kv,           "--model", e->model,
                            "--host-bytes", "64M",        "--cache-dtype", "f32",     "--spill-dir",
                            e->dir};
    int n = 11;
    for (int i = 0; extra && extra[i] && n < 30; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    pid_t p = tu_spawn(args, e->kv_log, NULL);
    ck_assert_msg(p > 0, "rekv-kvstore exited at start");
    return p;
}

static pid_t start_kvstore(env *e)
{
    return start_kvstore_with(e, NULL);
}

/* A worker named w0 on the cpu backend (tokens bit for bit rekv_generate's): offload mode with
 * the KV cache in e's kvstore, or resident without one. */
static pid_t start_worker_kv_timeout(env *e, int with_kvstore, const char *kv_timeout_ms);

static pid_t start_worker(env *e, int with_kvstore)
{
    /* a request timeout of ten minutes: the store's end must be seen, not timed out */
    return start_worker_kv_timeout(e, with_kvstore, "600000");
}

static pid_t start_worker_kv_timeout(env *e, int with_kvstore, const char *kv_timeout_ms)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[22] = {prog,     "--model",  e->model, "--coordinator", e->wrk,
                            "--name", "w0",       "--backend", "cpu",        "--max-batch",
                            "8",      "--heartbeat-ms", "100", "--mode",
                            with_kvstore ? "offload" : "resident"};
    if (with_kvstore) {
        args[15] = "--kvstore";
        args[16] = e->kv;
        args[17] = "--kvstore-timeout-ms";
        args[18] = kv_timeout_ms;
    }
    pid_t p = tu_spawn(args, e->wk_log, NULL);
    ck_assert_msg(p > 0, "rekv-gpuworker exited at start");
    return p;
}

/* ---------------------------------------------------------------- jobs and their client */

typedef struct fjob {
    int32_t prompt[16];
    int n_prompt;
    rekv_gen_params gp;
    rekv_gen_result ref; /* rekv_generate in this process */
    char key[32];
    uint64_t id;
    int32_t got[MAX_NEW]; /* tokens streamed so far, by offset */
    uint32_t n_got;
    int ends;             /* final events (done) seen */
} fjob;

static void make_jobs(fjob *jobs, const char *model)
{
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *en = NULL;
    ck_assert_msg(rekv_model_open(model, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &en, &err) == 0, "%s", err.msg);
    for (int i = 0; i < N_JOBS; i++) {
        fjob *j = &jobs[i];
        memset(j, 0, sizeof(*j));
        j->n_prompt = 1 + i;
        for (int t = 0; t < j->n_prompt; t++)
            j->prompt[t] = 1 + (int32_t)((i * 37 + t * 11) % 500);
        j->gp.max_new_tokens = MAX_NEW - 4 * i;
        j->gp.temperature = i % 2 ? 0.8f : 0.0f;
        j->gp.top_p = 1.0f;
        j->gp.seed = 77 + (uint64_t)i;
        snprintf(j->key, sizeof(j->key), "fault-job-%d", i);
        ck_assert_msg(rekv_generate(en, j->prompt, j->n_prompt, &j->gp, &j->ref, &err) == 0, "%s",
                      err.msg);
    }
    rekv_engine_free(en);
    rekv_model_close(m);
}

static void free_jobs(fjob *jobs)
{
    for (int i = 0; i < N_JOBS; i++)
        rekv_gen_result_free(&jobs[i].ref);
}

static void take_event(fjob *jobs, const Rekv__Control__StreamEvent *ev);

/* Submits every job streamed, under its key, and waits for the replies (taking in the stream
 * events that come meanwhile). */
static void submit_all(rekv_ctl *c, fjob *jobs)
{
    uint64_t rq[N_JOBS];
    for (int i = 0; i < N_JOBS; i++) {
        fjob *j = &jobs[i];
        Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
        smp.temperature = j->gp.temperature;
        smp.top_p = j->gp.top_p;
        smp.seed = j->gp.seed;
        Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
        s.n_prompt_ids = (size_t)j->n_prompt;
        s.prompt_ids = j->prompt;
        s.sampling = &smp;
        s.max_new_tokens = (uint32_t)j->gp.max_new_tokens;
        s.stream = 1;
        s.client_key = j->key;
        Rekv__Control__Request r = REKV__CONTROL__REQUEST__INIT;
        r.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
        r.submit = &s;
        rekv_err err = {0};
        rq[i] = 0;
        ck_assert_msg(rekv_ctl_send(c, &r, &rq[i], &err) == 0, "%s", err.msg);
    }
    for (int got = 0; got < N_JOBS;) {
        Rekv__Control__Response *r = NULL;
        rekv_err err = {0};
        ck_assert_msg(rekv_ctl_recv(c, 20000, &r, &err) == 0, "%s", err.msg);
        for (int i = 0; i < N_JOBS; i++) {
            if (rq[i] != r->id)
                continue;
            if (r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
                ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "submit: %s", r->error);
                ck_assert(jobs[i].id == 0 || jobs[i].id == r->submitted->job);
                jobs[i].id = r->submitted->job;
                got++;
            } else if (r->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT) {
                /* tokens of a job whose reply came, before the other replies */
                ck_assert(jobs[i].id == r->event->job);
                take_event(jobs, r->event);
            }
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
}

/* Takes in one stream event: its tokens must agree with what came before (a re-run resends none,
 * a re-subscription resends the same ones), and a final event must be the only one. */
static void take_event(fjob *jobs, const Rekv__Control__StreamEvent *ev)
{
    fjob *j = NULL;
    for (int i = 0; i < N_JOBS; i++)
        if (jobs[i].id == ev->job)
            j = &jobs[i];
    ck_assert_msg(j != NULL, "an event for job %llu, which is not ours",
                  (unsigned long long)ev->job);
    ck_assert_msg(ev->offset <= j->n_got, "job %llu: tokens from %u, we have %u",
                  (unsigned long long)ev->job, ev->offset, j->n_got);
    for (size_t t = 0; t < ev->n_tokens; t++) {
        uint32_t at = ev->offset + (uint32_t)t;
        ck_assert_msg(at < MAX_NEW, "job %llu: more than %d tokens", (unsigned long long)ev->job,
                      MAX_NEW);
        if (at < j->n_got)
            ck_assert_msg(j->got[at] == ev->tokens[t], "job %llu: token %u streamed twice, "
                          "as %d and as %d", (unsigned long long)ev->job, at, j->got[at],
                          ev->tokens[t]);
        else
            j->got[j->n_got++] = ev->tokens[t];
    }
    if (ev->done) {
        j->ends++;
        ck_assert_msg(j->ends == 1, "job %llu ended twice", (unsigned long long)ev->job);
        ck_assert_msg(ev->state == REKV__CONTROL__JOB_STATE__DONE, "job %llu ended %s: %s",
                      (unsigned long long)ev->job, rekv_ctl_state_name(ev->state), ev->error);
    }
}

/* Reads stream events until `tokens` tokens have come in all (0: until every job ended); Check's
 * timeout is the guard. */
static void follow(rekv_ctl *c, fjob *jobs, uint32_t tokens)
{
    for (;;) {
        uint32_t have = 0;
        int ended = 0;
        for (int i = 0; i < N_JOBS; i++) {
            have += jobs[i].n_got;
            ended += jobs[i].ends;
        }
        if (tokens ? have >= tokens : ended == N_JOBS)
            return;
        Rekv__Control__Response *r = NULL;
        rekv_err err = {0};
        int rc = rekv_ctl_recv(c, 1000, &r, &err);
        if (rc == -ETIMEDOUT)
            continue;
        ck_assert_msg(rc == 0, "%s", err.msg);
        if (r->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT)
            take_event(jobs, r->event);
        rekv__control__response__free_unpacked(r, NULL);
    }
}

/* Every job streamed exactly rekv_generate's tokens and ended once, DONE; the coordinator holds
 * exactly these jobs, each DONE with those tokens. */
static void check_exactly_once(rekv_ctl *c, fjob *jobs)
{
    for (int i = 0; i < N_JOBS; i++) {
        fjob *j = &jobs[i];
        ck_assert_int_eq(j->ends, 1);
        ck_assert_msg((int)j->n_got == j->ref.n, "job %d: %u tokens streamed, rekv_generate "
                      "made %d", i, j->n_got, j->ref.n);
        ck_assert_msg(memcmp(j->got, j->ref.ids, sizeof(int32_t) * (size_t)j->ref.n) == 0,
                      "job %d: the streamed tokens are not rekv_generate's", i);
        Rekv__Control__Response *r = tu_ctl_status(c, j->id);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
        ck_assert_int_eq((int)r->job->n_generated_ids, j->ref.n);
        ck_assert_int_eq(memcmp(r->job->generated_ids, j->ref.ids,
                                sizeof(int32_t) * (size_t)j->ref.n), 0);
        rekv__control__response__free_unpacked(r, NULL);
    }
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_uint_eq(r->stats->accepted, N_JOBS);
    ck_assert_uint_eq(r->stats->done, N_JOBS);
    ck_assert_uint_eq(r->stats->failed, 0);
    ck_assert_uint_eq(r->stats->queued + r->stats->running, 0);
    rekv__control__response__free_unpacked(r, NULL);
}

/* Waits (up to 60 s) until the file holds needle. */
static void wait_log(const char *path, const char *needle)
{
    while (!tu_file_has(path, needle)) {
        usleep(20000);
    }
}

/* The offset of needle in the file (-1: absent): for the order of log lines. */
static long log_at(const char *path, const char *needle)
{
    char *t = tu_read_file(path, NULL);
    const char *p = t ? strstr(t, needle) : NULL;
    long at = p ? (long)(p - t) : -1;
    free(t);
    return at;
}

static void stats_at_least(rekv_ctl *c, uint64_t requeued, uint64_t steps_failed)
{
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_msg(r->stats->requeued >= requeued && r->stats->steps_failed >= steps_failed,
                  "%llu jobs re-queued, %llu steps failed", (unsigned long long)r->stats->requeued,
                  (unsigned long long)r->stats->steps_failed);
    rekv__control__response__free_unpacked(r, NULL);
}

/* ---------------------------------------------------------------- the kvstore */

/* SIGKILL the kvstore mid-run: the worker's step fails (the store's connection ended), the
 * worker says it is unavailable, the coordinator re-queues the step's jobs; a new store comes up
 * on the same endpoint, the worker connects again, rebuilds its pipeline, says it is available,
 * and every job ends once with its clean tokens — the worker process never restarted. The
 * worker timeout is a minute: silence is not how anything here is noticed. Then the store is
 * killed again with the worker idle: the worker notices, and still stops at once on SIGTERM. */
START_TEST(kvstore_killed)
{
    env e;
    if (env_open(&e))
        return;
    static fjob jobs[N_JOBS];
    make_jobs(jobs, e.model);
    pid_t kv = start_kvstore(&e);
    const char *co_args[] = {"--worker-timeout-ms", "60000", NULL};
    pid_t co = start_coordinator(&e, co_args);
    pid_t wk = start_worker(&e, 1);
    /* s streams (rekv_ctl_call on it would drop the events that come meanwhile), c asks */
    rekv_ctl *c = tu_ctl_open(e.ctl), *s = tu_ctl_open(e.ctl);
    tu_ctl_wait_workers(c, 1);
    submit_all(s, jobs);
    follow(s, jobs, 2 * N_JOBS); /* mid-run */
    tu_kill9(kv);
    wait_log(e.co_log, "worker w0 is unavailable: its kvstore at");
    kv = start_kvstore(&e);
    follow(s, jobs, 0);
    check_exactly_once(c, jobs);
    stats_at_least(c, 1, 1);
    /* in this order: the step failed, the store was lost, the worker came back */
    long failed = log_at(e.wk_log, "failed (its jobs run again)");
    long lost = log_at(e.wk_log, "lost; unavailable until it is back");
    long back = log_at(e.wk_log, "connected again");
    ck_assert_msg(lost >= 0 && back > lost, "worker log: lost at %ld, back at %ld", lost, back);
    ck_assert_msg(failed < 0 || failed < lost, "worker log: step failed at %ld, lost at %ld",
                  failed, lost);
    long unav = log_at(e.co_log, "worker w0 is unavailable");
    long avail = log_at(e.co_log, "worker w0 is available again");
    ck_assert_msg(unav >= 0 && avail > unav, "coordinator log: unavailable at %ld, available at %ld",
                  unav, avail);
    ck_assert_int_eq(waitpid(wk, NULL, WNOHANG), 0); /* the same worker all along */

    /* the store dies under an idle worker, for good: the worker notices and stops on SIGTERM */
    int n_unav = 0;
    for (long at = 0;;) {
        char *t = tu_read_file(e.co_log, NULL);
        const char *p = t ? strstr(t + at, "worker w0 is unavailable") : NULL;
        if (p == NULL) {
            free(t);
            break;
        }
        at = (long)(p - t) + 1;
        n_unav++;
        free(t);
    }
    tu_kill9(kv);
    for (;;) { /* a second "unavailable" line */
        int n = 0;
        char *t = tu_read_file(e.co_log, NULL);
        for (const char *p = t; p && (p = strstr(p, "worker w0 is unavailable")); p++)
            n++;
        free(t);
        if (n > n_unav)
            break;
        usleep(20000);
    }
    int st = tu_stop(wk);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker status %d", st);
    rekv_ctl_close(c);
    rekv_ctl_close(s);
    ck_assert_int_eq(tu_stop(co), 0);
    free_jobs(jobs);
    env_close(&e);
}
END_TEST

/* SIGSTOP the kvstore mid-run: the worker's request gets no reply within --kvstore-timeout-ms
 * (2 s), so it takes the store as lost — the step fails, its jobs are re-queued, the worker says
 * it is unavailable and tries to connect again, which the stopped store cannot answer. SIGCONT:
 * the store serves again, the worker connects, drops what its name left, rebuilds its pipeline,
 * and every job ends once with its clean tokens; no process restarted. */
START_TEST(kvstore_stopped_times_out)
{
    env e;
    if (env_open(&e))
        return;
    static fjob jobs[N_JOBS];
    make_jobs(jobs, e.model);
    pid_t kv = start_kvstore(&e);
    const char *co_args[] = {"--worker-timeout-ms", "600000", NULL};
    pid_t co = start_coordinator(&e, co_args);
    pid_t wk = start_worker_kv_timeout(&e, 1, "2000");
    rekv_ctl *c = tu_ctl_open(e.ctl), *s = tu_ctl_open(e.ctl);
    tu_ctl_wait_workers(c, 1);
    submit_all(s, jobs);
    follow(s, jobs, 2 * N_JOBS);
    kill(kv, SIGSTOP);
    wait_log(e.co_log, "worker w0 is unavailable: its kvstore at");
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_uint_eq(r->stats->running, 0); /* nothing left RUNNING on the worker */
    rekv__control__response__free_unpacked(r, NULL);
    kill(kv, SIGCONT);
    follow(s, jobs, 0);
    check_exactly_once(c, jobs);
    stats_at_least(c, 1, 1);
    long timed_out = log_at(e.wk_log, "no reply from");
    long lost = log_at(e.wk_log, "lost; unavailable until it is back");
    long back = log_at(e.wk_log, "connected again");
    ck_assert_msg(timed_out >= 0 && lost > timed_out && back > lost,
                  "worker log: timed out at %ld, lost at %ld, back at %ld", timed_out, lost, back);
    ck_assert_int_eq(waitpid(wk, NULL, WNOHANG), 0); /* the same worker all along */
    ck_assert_int_eq(waitpid(kv, NULL, WNOHANG), 0); /* and the same store */
    rekv_ctl_close(c);
    rekv_ctl_close(s);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    free_jobs(jobs);
    env_close(&e);
}
END_TEST

/* ---------------------------------------------------------------- a full spill disk */

#define UNSHARE "/usr/bin/unshare"

/* The spill directory on a tmpfs of 128 KiB (32 slots) mounted in the kvstore's own user and
 * mount namespaces (unshare -rm), with a small arena spilling down to 5% between steps: the spill
 * file fills the tmpfs and cannot grow (ENOSPC from fallocate, before any block leaves memory).
 * The store says so, keeps the blocks in memory, stays up, and every job ends once with
 * rekv_generate's tokens. Skipped, saying why, where unprivileged user namespaces (and so the
 * mount) are not allowed. */
START_TEST(kvstore_spill_disk_full)
{
    char *out = NULL;
    const char *try_mount = UNSHARE " -rm sh -c 'mount -t tmpfs -o size=64k tmpfs /tmp' 2>&1";
    int probe = access(UNSHARE, X_OK) == 0 ? tu_run(try_mount, &out) : -1;
    if (probe != 0) {
        printf("skip kvstore_spill_disk_full: cannot mount a tmpfs in a user namespace (%s): %s\n",
               UNSHARE " -rm", out ? out : "no unshare");
        free(out);
        return;
    }
    free(out);
    env e;
    if (env_open(&e))
        return;
    static fjob jobs[N_JOBS];
    make_jobs(jobs, e.model);
    char spill[4300], prog[4096];
    snprintf(spill, sizeof(spill), "%s/spill", e.dir);
    ck_assert_int_eq(mkdir(spill, 0700), 0);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    /* sh mounts the tmpfs on $0 and becomes the store (same pid); tu_spawn adds --ready-fd */
    const char *kv_args[] = {UNSHARE, "-rm", "sh", "-c",
                             "mount -t tmpfs -o size=128k tmpfs \"$0\" && exec \"$@\"", spill,
                             prog, "--endpoint", e.kv, "--model", e.model, "--host-bytes", "2M",
                             "--cache-dtype", "f32", "--spill-dir", spill, "--high-pct", "10",
                             "--low-pct", "5", NULL};
    pid_t kv = tu_spawn(kv_args, e.kv_log, NULL);
    ck_assert_msg(kv > 0, "rekv-kvstore on a tmpfs exited at start");
    const char *co_args[] = {"--worker-timeout-ms", "600000", NULL};
    pid_t co = start_coordinator(&e, co_args);
    pid_t wk = start_worker(&e, 1);
    rekv_ctl *c = tu_ctl_open(e.ctl), *s = tu_ctl_open(e.ctl);
    tu_ctl_wait_workers(c, 1);
    submit_all(s, jobs);
    follow(s, jobs, 0);
    check_exactly_once(c, jobs);
    ck_assert_msg(tu_file_has(e.kv_log, "spill file cannot grow: No space left on device"),
                  "the kvstore never said its spill disk was full");
    rekv_kvstore_client *kc = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_client_connect(e.kv, NULL, 20000, &kc, &err) == 0, "%s", err.msg);
    rekv_kv_stats st;
    ck_assert_msg(rekv_kvstore_stats(kc, &st, &err) == 0, "%s", err.msg);
    ck_assert_uint_ge(st.spill_errors, 1);
    ck_assert_uint_gt(st.bytes_spilled, 0); /* what fitted went to disk */
    ck_assert_uint_eq(st.crc_errors, 0);
    rekv_kvstore_client_close(kc);
    rekv_ctl_close(c);
    rekv_ctl_close(s);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    free_jobs(jobs);
    env_close(&e);
}
END_TEST

/* ---------------------------------------------------------------- a block lost on read-back */

/* A byte flipped in the spill file, in a block of one job's sequence on disk while the worker is
 * stopped (a small arena spilling down to 5% between steps forces blocks out): the next step's
 * read-back fails its CRC32C; the worker says so, naming the job and the store's reason (the
 * sequence, layer and block), and reports that job to run again from its prompt using an attempt,
 * the other jobs of the step to run again using none; each job ends once, DONE, with
 * rekv_generate's tokens — the victim's re-run recomputes what was lost. The worker's debug log
 * says which sequence is the job's, the store's block table where its blocks are. */
START_TEST(crc_mismatch_reruns_its_job)
{
    env e;
    if (env_open(&e))
        return;
    static fjob jobs[N_JOBS];
    make_jobs(jobs, e.model);
    fjob *victim = &jobs[3]; /* mid-batch: not the first job of a step, nor the last */
    char spill[4300];
    snprintf(spill, sizeof(spill), "%s/spill", e.dir);
    ck_assert_int_eq(mkdir(spill, 0700), 0);
    /* 512 slots: room for the whole batch's blocks (a step pins them all), spilled down to 5%
     * between steps once above 10% */
    const char *kv_args[] = {"--host-bytes", "2M",        "--high-pct", "10",          "--low-pct",
                             "5",            "--lease-ms", "600000",     "--spill-dir", spill,
                             NULL};
    pid_t kv = start_kvstore_with(&e, kv_args);
    const char *co_args[] = {"--worker-timeout-ms", "600000", NULL};
    pid_t co = start_coordinator(&e, co_args);
    setenv("REKV_LOG", "debug", 1);
    pid_t wk = start_worker(&e, 1);
    unsetenv("REKV_LOG");
    rekv_ctl *c = tu_ctl_open(e.ctl), *s = tu_ctl_open(e.ctl);
    tu_ctl_wait_workers(c, 1);
    submit_all(s, jobs);
    follow(s, jobs, 24 * N_JOBS); /* two blocks a layer: above the high watermark */
    uint64_t seq = 0;
    sf_job_store_seq(e.wk_log, victim->id, &seq);
    ck_assert_msg(seq != 0, "the worker's log does not name job %llu's kvstore sequence",
                  (unsigned long long)victim->id);
    rekv_kvstore_client *kc = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_client_connect(e.kv, NULL, 20000, &kc, &err) == 0, "%s", err.msg);
    int fd = tu_spill_fd(kv, spill);
    ck_assert_msg(fd >= 0, "no spill file among the kvstore's open files");
    uint32_t layer = 0;
    uint64_t block = 0;
    for (int tries = 0;; tries++) {
        ck_assert_msg(tries < 100, "job %llu never had a block on disk",
                      (unsigned long long)victim->id);
        kill(wk, SIGSTOP);
        ck_assert_msg(victim->ends == 0 && (int)victim->n_got + 8 < victim->ref.n,
                      "job %llu is about to end before its block was corrupted",
                      (unsigned long long)victim->id);
        if (sf_flip_disk_block(kc, fd, seq, &layer, &block))
            break;
        kill(wk, SIGCONT);
        uint32_t have = 0;
        for (int i = 0; i < N_JOBS; i++)
            have += jobs[i].n_got;
        follow(s, jobs, have + N_JOBS);
    }
    close(fd);
    kill(wk, SIGCONT);
    follow(s, jobs, 0);
    check_exactly_once(c, jobs); /* DONE with rekv_generate's tokens, the victim too */
    stats_at_least(c, 1, 1);
    /* the victim's failed run used an attempt, the step that failed on its block none of the
     * others' */
    for (int i = 0; i < N_JOBS; i++) {
        Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
        ck_assert_msg(r->job->attempts == (&jobs[i] == victim ? 2u : 1u), "job %d used %u attempts",
                      i, r->job->attempts);
        rekv__control__response__free_unpacked(r, NULL);
    }
    rekv_kv_stats st;
    ck_assert_msg(rekv_kvstore_stats(kc, &st, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(st.crc_errors, 1);
    ck_assert_uint_gt(st.bytes_spilled, 0);
    rekv_kvstore_client_close(kc);
    char line[400];
    snprintf(line, sizeof(line),
             "job %llu runs again from its prompt, using an attempt; the others run again): "
             "kvstore: sequence %llu layer %u block %llu: read-back failed: CRC32C mismatch",
             (unsigned long long)victim->id, (unsigned long long)seq, layer,
             (unsigned long long)block);
    ck_assert_msg(tu_file_has(e.wk_log, line), "the worker's log does not say \"%s\"", line);
    rekv_ctl_close(c);
    rekv_ctl_close(s);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    free_jobs(jobs);
    env_close(&e);
}
END_TEST

/* ---------------------------------------------------------------- the worker */

/* SIGKILL the worker mid-run and start a new one under its name: the coordinator drops the old
 * one as soon as the new one says Hello (the worker timeout is ten minutes) and its jobs run
 * again on the new one, each ending once with its clean tokens. */
START_TEST(worker_killed_successor_takes_over)
{
    env e;
    if (env_open(&e))
        return;
    static fjob jobs[N_JOBS];
    make_jobs(jobs, e.model);
    pid_t kv = start_kvstore(&e);
    const char *co_args[] = {"--worker-timeout-ms", "600000", NULL};
    pid_t co = start_coordinator(&e, co_args);
    pid_t wk = start_worker(&e, 1);
    /* s streams (rekv_ctl_call on it would drop the events that come meanwhile), c asks */
    rekv_ctl *c = tu_ctl_open(e.ctl), *s = tu_ctl_open(e.ctl);
    tu_ctl_wait_workers(c, 1);
    submit_all(s, jobs);
    follow(s, jobs, 2 * N_JOBS);
    tu_kill9(wk);
    wk = start_worker(&e, 1);
    follow(s, jobs, 0);
    check_exactly_once(c, jobs);
    stats_at_least(c, 1, 0);
    ck_assert_msg(tu_file_has(e.co_log, "worker w0 is replaced by a new worker of its name"),
                  "the coordinator log does not say the old w0 was replaced");
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_uint_eq(r->stats->n_workers, 1);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    rekv_ctl_close(s);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    free_jobs(jobs);
    env_close(&e);
}
END_TEST

/* SIGSTOP the worker mid-run: its step never comes back; the coordinator's step deadline
 * (--step-timeout-ms 1500; the worker timeout is ten minutes) drops it and re-queues its jobs.
 * SIGCONT: the worker's late Progress is answered Reset, it says Hello again and runs the jobs,
 * each ending once with its clean tokens. */
START_TEST(worker_stopped_step_deadline)
{
    env e;
    if (env_open(&e))
        return;
    static fjob jobs[N_JOBS];
    make_jobs(jobs, e.model);
    const char *co_args[] = {"--worker-timeout-ms", "600000", "--step-timeout-ms", "1500", NULL};
    pid_t co = start_coordinator(&e, co_args);
    pid_t wk = start_worker(&e, 0);
    /* s streams (rekv_ctl_call on it would drop the events that come meanwhile), c asks */
    rekv_ctl *c = tu_ctl_open(e.ctl), *s = tu_ctl_open(e.ctl);
    tu_ctl_wait_workers(c, 1);
    submit_all(s, jobs);
    follow(s, jobs, 2 * N_JOBS);
    kill(wk, SIGSTOP);
    wait_log(e.co_log, "worker w0 has not finished step");
    tu_ctl_wait_workers(c, 0);
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_uint_eq(r->stats->running, 0); /* nothing left RUNNING on the hung worker */
    ck_assert_uint_ge(r->stats->requeued, 1);
    ck_assert_uint_ge(r->stats->steps_failed, 1);
    rekv__control__response__free_unpacked(r, NULL);
    /* and `rekv stats` says so */
    char cmd[8192], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s stats --socket '%s'", tu_bin("rekv"), e.ctl);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    json_error_t je;
    json_t *st = json_loads(out, 0, &je);
    ck_assert_msg(st != NULL, "rekv stats: %s: %s", je.text, out);
    ck_assert_int_ge(json_integer_value(json_object_get(st, "steps_failed")), 1);
    ck_assert_ptr_nonnull(json_object_get(st, "worker_results_rejected"));
    json_decref(st);
    free(out);
    kill(wk, SIGCONT);
    follow(s, jobs, 0);
    check_exactly_once(c, jobs);
    ck_assert_int_eq(tu_stop(wk), 0);
    rekv_ctl_close(c);
    rekv_ctl_close(s);
    ck_assert_int_eq(tu_stop(co), 0);
    free_jobs(jobs);
    env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("faults");
    TCase *tc = tcase_create("faults");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, kvstore_killed);
    tcase_add_test(tc, kvstore_stopped_times_out);
    tcase_add_test(tc, crc_mismatch_reruns_its_job);
    tcase_add_test(tc, kvstore_spill_disk_full);
    tcase_add_test(tc, worker_killed_successor_takes_over);
    tcase_add_test(tc, worker_stopped_step_deadline);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
