/* test_coordinator.c — the multi-process path end to end, with real daemons and real sockets:
 * `rekv run` (kvstore, gpuworker, coordinator) serving 64 concurrent jobs whose tokens equal
 * rekv_generate's in this process; a worker killed with SIGKILL mid-run (jobs re-run, the
 * coordinator stays up, a new worker finishes them identically); a coordinator killed and restarted
 * (journaled jobs complete); malformed, oversized and multi-frame requests (error replies); a burst
 * of submissions against a small queue (BUSY replies, every accepted job completes); and the
 * batcher alone against rekv_generate. With the KV cache in a real rekv-kvstore: steps longer than
 * its lease keep their pins; a worker killed with SIGKILL leaves blocks behind, which a worker
 * restarted under its name frees at once, and which the store frees itself after the lease when
 * none is. A worker that says Hello with mode "auto" gets its mode from the coordinator (Assign)
 * and is not served until it says Hello again with it. Model: stories260K (a bigger synthetic one
 * for long steps). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/mode.h"
#include "coordinator/cli/cli_daemon.h"
#include "coordinator/coordinator.h"
#include "coordinator/planner.h"
#include "gpuworker/batcher.h"
#include "gpuworker/gpuworker.h"
#include "kvstore/kvstore.h"
#include "proto/worker.pb-c.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

#define MODEL_REL "models/stories260K/stories260K.bin"

/* One job of the test mix and its expected output. */
typedef struct tjob {
    int32_t prompt[64];
    int n_prompt;
    rekv_gen_params gp;
    rekv_gen_result ref; /* rekv_generate in this process */
    uint64_t id;         /* the coordinator's job id */
} tjob;

/* A deterministic mix: prompt lengths 1..40, greedy and sampled, top-k, top-p, EOS on and off. */
static void make_jobs(tjob *jobs, int n, int max_new_base, int vocab, uint64_t salt)
{
    uint64_t s = 0x9e3779b97f4a7c15ull ^ salt;
    for (int i = 0; i < n; i++) {
        tjob *j = &jobs[i];
        memset(j, 0, sizeof(*j));
        j->n_prompt = 1 + (i * 7) % 40;
        for (int t = 0; t < j->n_prompt; t++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            j->prompt[t] = 1 + (int32_t)((s >> 33) % (uint64_t)(vocab - 1));
        }
        j->gp.max_new_tokens = max_new_base + (i * 13) % 24;
        j->gp.temperature = i % 3 == 0 ? 0.0f : 0.9f;
        j->gp.top_k = i % 4 == 1 ? 40 : 0;
        j->gp.top_p = i % 5 == 2 ? 0.9f : 1.0f;
        j->gp.seed = 1000 + (uint64_t)i + salt;
        j->gp.stop_at_eos = i % 2;
    }
}

static void reference(tjob *jobs, int n, const char *model)
{
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(model, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    for (int i = 0; i < n; i++)
        ck_assert_msg(rekv_generate(e, jobs[i].prompt, jobs[i].n_prompt, &jobs[i].gp, &jobs[i].ref,
                                    &err) == 0,
                      "%s", err.msg);
    rekv_engine_free(e);
    rekv_model_close(m);
}

static void free_jobs(tjob *jobs, int n)
{
    for (int i = 0; i < n; i++)
        rekv_gen_result_free(&jobs[i].ref);
}

static Rekv__Control__Response *call(rekv_ctl *c, Rekv__Control__Request *rq)
{
    Rekv__Control__Response *r = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_call(c, rq, 20000, &r, &err) == 0, "%s", err.msg);
    return r;
}

/* Submits without waiting for the reply (so that all jobs are in flight together). */
static uint64_t submit_async(rekv_ctl *c, const tjob *j)
{
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    smp.temperature = j->gp.temperature;
    smp.top_k = (uint32_t)j->gp.top_k;
    smp.top_p = j->gp.top_p;
    smp.seed = j->gp.seed;
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.n_prompt_ids = (size_t)j->n_prompt;
    s.prompt_ids = (int32_t *)j->prompt;
    s.sampling = &smp;
    s.max_new_tokens = (uint32_t)j->gp.max_new_tokens;
    s.stop_at_eos = j->gp.stop_at_eos;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    uint64_t id;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_send(c, &rq, &id, &err) == 0, "%s", err.msg);
    return id;
}

/* Submits all jobs at once, then collects the replies; returns how many were accepted (BUSY ones
 * get id 0). */
static int submit_all(rekv_ctl *c, tjob *jobs, int n)
{
    uint64_t *rq = calloc((size_t)n, sizeof(uint64_t));
    for (int i = 0; i < n; i++)
        rq[i] = submit_async(c, &jobs[i]);
    int got = 0, accepted = 0;
    while (got < n) {
        Rekv__Control__Response *r = NULL;
        rekv_err err = {0};
        ck_assert_msg(rekv_ctl_recv(c, 20000, &r, &err) == 0, "%s", err.msg);
        for (int i = 0; i < n; i++) {
            if (rq[i] != r->id)
                continue;
            if (r->code == REKV__CONTROL__CODE__OK) {
                ck_assert_int_eq(r->body_case, REKV__CONTROL__RESPONSE__BODY_SUBMITTED);
                jobs[i].id = r->submitted->job;
                accepted++;
            } else {
                ck_assert_msg(r->code == REKV__CONTROL__CODE__BUSY, "submit %d: %s", i, r->error);
                ck_assert_msg(strstr(r->error, "busy") != NULL, "%s", r->error);
                jobs[i].id = 0;
            }
            got++;
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
    free(rq);
    return accepted;
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

/* Waits until every accepted job has ended, then checks each one's tokens against the reference.
 * min_attempts: jobs whose attempts must be at least this (1 normally). */
static void wait_and_check(rekv_ctl *c, tjob *jobs, int n, double timeout_s)
{
    uint64_t deadline = rekv_now_ns() + (uint64_t)(timeout_s * 1e9);
    for (int i = 0; i < n; i++) {
        if (jobs[i].id == 0)
            continue;
        for (;;) {
            Rekv__Control__Response *r = status(c, jobs[i].id);
            ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "status of job %llu: %s",
                          (unsigned long long)jobs[i].id, r->error);
            const Rekv__Control__JobStatus *s = r->job;
            if (s->state == REKV__CONTROL__JOB_STATE__QUEUED ||
                s->state == REKV__CONTROL__JOB_STATE__RUNNING) {
                rekv__control__response__free_unpacked(r, NULL);
                ck_assert_msg(rekv_now_ns() < deadline, "job %d did not finish in %.0f s", i,
                              timeout_s);
                usleep(20000);
                continue;
            }
            ck_assert_msg(s->state == REKV__CONTROL__JOB_STATE__DONE, "job %d ended %s: %s", i,
                          rekv_ctl_state_name(s->state), s->error);
            ck_assert_msg((int)s->n_generated_ids == jobs[i].ref.n,
                          "job %d: %zu tokens, rekv_generate made %d", i, s->n_generated_ids,
                          jobs[i].ref.n);
            int at = 0;
            while (at < jobs[i].ref.n && s->generated_ids[at] == jobs[i].ref.ids[at])
                at++;
            ck_assert_msg(at == jobs[i].ref.n,
                          "job %d (temperature %g, top-k %d, top-p %g): token %d is %d, "
                          "rekv_generate made %d",
                          i, jobs[i].gp.temperature, jobs[i].gp.top_k, jobs[i].gp.top_p, at,
                          at < jobs[i].ref.n ? s->generated_ids[at] : -1,
                          at < jobs[i].ref.n ? jobs[i].ref.ids[at] : -1);
            ck_assert_str_eq(s->finish_reason, jobs[i].ref.finish_reason);
            rekv__control__response__free_unpacked(r, NULL);
            break;
        }
    }
}

/* Starts a program with --ready-fd and waits for READY. */
static pid_t spawn(const char *const *args)
{
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    const char *argv[48];
    int n = 0;
    for (; args[n]; n++)
        argv[n] = args[n];
    char fd[16];
    snprintf(fd, sizeof(fd), "%d", pfd[1]);
    argv[n++] = "--ready-fd";
    argv[n++] = fd;
    argv[n] = NULL;
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    struct pollfd p = {pfd[0], POLLIN, 0};
    ck_assert_msg(poll(&p, 1, 60000) == 1, "%s did not become ready", argv[0]);
    char buf[8] = {0};
    ck_assert_msg(read(pfd[0], buf, 7) == 6, "%s exited before it was ready", argv[0]);
    close(pfd[0]);
    return pid;
}

static int stop(pid_t pid)
{
    kill(pid, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return st;
}

static void kill9(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

typedef struct env {
    char *dir;
    char ctl[4200], wrk[4200], state[4200], kv[4200];
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
    return 0;
}

static void env_close(env *e)
{
    tu_rmrf(e->dir);
    free(e->dir);
}

/* A big model (e->model; steps of several tenths of a second on a slow machine) and n jobs of two
 * new tokens each with their reference tokens. The tests that need steps longer than a 0.25 s
 * timeout or lease make them so on any machine with an emulated link (kv_worker's gbps): the
 * link's sleeps are a lower bound on a step's time, however fast the cpu. */
static void slow_model_jobs(env *e, tjob *jobs, int n, uint64_t salt)
{
    rekv_synth_spec spec = {REKV_ARCH_OPT, 8, 1024, 16, 16, 4096, 512, 256, REKV_DTYPE_F16, 3, 1};
    snprintf(e->model, sizeof(e->model), "%s/big", e->dir);
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(&spec, e->model, &err) == 0, "%s", err.msg);
    make_jobs(jobs, n, 1, 512, salt);
    for (int i = 0; i < n; i++)
        jobs[i].gp.max_new_tokens = 2;
    reference(jobs, n, e->model);
}

static pid_t start_coordinator(env *e, const char *queue, const char *timeout_ms)
{
    const char *args[] = {tu_bin("rekv-coordinator"),
                          "--control",
                          e->ctl,
                          "--workers",
                          e->wrk,
                          "--state-dir",
                          e->state,
                          "--queue",
                          queue,
                          "--worker-timeout-ms",
                          timeout_ms,
                          NULL};
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", args[0]);
    args[0] = prog;
    return spawn(args);
}

/* Workers run the cpu backend: jobs are checked against rekv_generate bit for bit, and on a GPU
 * machine "auto" would be cuda. */
static pid_t start_worker(env *e, const char *max_batch)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,  "--model",     e->model,  "--coordinator",  e->wrk, "--backend",
                          "cpu", "--max-batch", max_batch, "--heartbeat-ms", "100",  NULL};
    return spawn(args);
}

/* rekv-kvstore on e->kv for e->model, fp32 cache (offload mode then equals rekv_generate). */
static pid_t start_kvstore(env *e, const char *lease_ms, const char *host_bytes)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *args[] = {prog,           "--endpoint", e->kv,           "--model", e->model,
                          "--host-bytes", host_bytes,   "--cache-dtype", "f32",     "--spill-dir",
                          e->dir,         "--lease-ms", lease_ms,        NULL};
    return spawn(args);
}

/* A worker keeping its KV cache in e's kvstore (offload mode); name NULL: its default; gbps
 * non-NULL: behind an emulated link of that many Gbit/s, so every step's copies take at least
 * their bytes over it. */
static pid_t kv_worker(env *e, const char *max_batch, const char *name, const char *gbps)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[20] = {prog,      "--model",     e->model,  "--coordinator",
                            e->wrk,    "--max-batch", max_batch, "--heartbeat-ms",
                            "100",     "--kvstore",   e->kv,     "--mode",
                            "offload", "--backend",   "cpu",     NULL};
    int n = 15;
    if (name) {
        args[n++] = "--name";
        args[n++] = name;
    }
    if (gbps) {
        args[n++] = "--link-gbps";
        args[n++] = gbps;
    }
    return spawn(args);
}

static pid_t start_kv_worker(env *e, const char *max_batch, const char *name)
{
    return kv_worker(e, max_batch, name, NULL);
}

static rekv_kvstore_client *kv_open(env *e)
{
    rekv_kvstore_client *k = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_client_connect(e->kv, NULL, 20000, &k, &err) == 0, "%s", err.msg);
    return k;
}

static void kv_stats(rekv_kvstore_client *k, rekv_kv_stats *st)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_stats(k, st, &err) == 0, "%s", err.msg);
}

static rekv_ctl *ctl_open(const char *ep)
{
    rekv_ctl *c = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_connect(ep, NULL, &c, &err) == 0, "%s", err.msg);
    return c;
}

static Rekv__Control__Response *health(rekv_ctl *c)
{
    Rekv__Control__HealthRequest h = REKV__CONTROL__HEALTH_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_HEALTH;
    rq.health = &h;
    return call(c, &rq);
}

/* Waits until the coordinator sees n workers. */
static void wait_workers(rekv_ctl *c, uint32_t n)
{
    uint64_t deadline = rekv_now_ns() + 20000000000ull;
    for (;;) {
        Rekv__Control__Response *r = health(c);
        uint32_t w = r->health ? r->health->workers : 0;
        rekv__control__response__free_unpacked(r, NULL);
        if (w == n)
            return;
        ck_assert_msg(rekv_now_ns() < deadline, "the coordinator sees %u workers, not %u", w, n);
        usleep(20000);
    }
}

/* ---------------------------------------------------------------- tests */

/* The batcher alone, in pipeline mode `mode` with prefill chunks of `chunk` tokens (0: whole
 * prompts): jobs joining at different steps give rekv_generate's tokens, and a prompt longer than
 * the chunk spends a step per extra chunk without a token. */
static void batcher_run(const char *m, rekv_mode mode, int chunk)
{
    enum { N = 24 };
    static tjob jobs[N];
    make_jobs(jobs, N, 4, 512, 7);
    reference(jobs, N, m);
    rekv_err err = {0};
    tu_fixture f;
    tu_fixture_open(&f, m, REKV_DTYPE_F32, NULL);
    rekv_pipeline *p = NULL;
    rekv_batcher *b = NULL;
    rekv_pipeline_config pc;
    rekv_pipeline_config_defaults(&pc);
    pc.mode = mode;
    pc.split = 5;
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, mode == REKV_MODE_RESIDENT ? NULL : f.store, &pc,
                                       &p, &err) == 0,
                  "%s", err.msg);
    ck_assert_msg(rekv_batcher_create(p, rekv_engine_config(f.e), 8, &b, &err) == 0, "%s", err.msg);
    rekv_batcher_set_prefill_chunk(b, chunk);
    int32_t got[N][128];
    int n_got[N] = {0}, done[N] = {0}, next = 0, finished = 0, silent = 0, want_silent = 0;
    const char *reason[N] = {0};
    for (int j = 0; j < N; j++)
        if (chunk > 0 && jobs[j].gp.max_new_tokens > 0)
            want_silent += (jobs[j].n_prompt + chunk - 1) / chunk - 1;
    while (finished < N) {
        /* join one or two per step so that batches mix prefill and decode */
        for (int k = 0; k < 8 && next < N && rekv_batcher_running(b) < 8; k++, next++)
            ck_assert_msg(rekv_batcher_join(b, (uint64_t)next, jobs[next].prompt,
                                            jobs[next].n_prompt, &jobs[next].gp, &err) == 0,
                          "%s", err.msg);
        const rekv_batch_event *ev;
        int n_ev;
        ck_assert_msg(rekv_batcher_step(b, &ev, &n_ev, &err) == 0, "%s", err.msg);
        for (int i = 0; i < n_ev; i++) {
            int j = (int)ev[i].job;
            if (ev[i].token >= 0)
                got[j][n_got[j]++] = ev[i].token;
            else if (!ev[i].finished)
                silent++;
            if (ev[i].finished) {
                done[j] = 1;
                reason[j] = ev[i].finish_reason;
                finished++;
            }
        }
    }
    ck_assert_msg(silent == want_silent, "%s, chunk %d: %d steps ran a prompt chunk, not %d",
                  rekv_mode_name(mode), chunk, silent, want_silent);
    for (int j = 0; j < N; j++) {
        ck_assert(done[j]);
        ck_assert_msg(n_got[j] == jobs[j].ref.n,
                      "%s, chunk %d: job %d (prompt %d, temp %g, k %d, p %g, eos %d): %d tokens, "
                      "not %d",
                      rekv_mode_name(mode), chunk, j, jobs[j].n_prompt, jobs[j].gp.temperature,
                      jobs[j].gp.top_k, jobs[j].gp.top_p, jobs[j].gp.stop_at_eos, n_got[j],
                      jobs[j].ref.n);
        ck_assert_msg(memcmp(got[j], jobs[j].ref.ids, sizeof(int32_t) * (size_t)n_got[j]) == 0,
                      "%s, chunk %d: job %d differs", rekv_mode_name(mode), chunk, j);
        ck_assert_str_eq(reason[j], jobs[j].ref.finish_reason);
    }
    /* bad joins say why */
    int32_t bad = 100000;
    ck_assert_int_eq(rekv_batcher_join(b, 999, &bad, 1, &jobs[0].gp, &err), -EINVAL);
    ck_assert_int_eq(rekv_batcher_join(b, 999, &bad, 0, &jobs[0].gp, &err), -EINVAL);
    rekv_batcher_free(b);
    rekv_pipeline_free(p);
    tu_fixture_close(&f);
    free_jobs(jobs, N);
}

START_TEST(batcher_matches_generate)
{
    const char *path = tu_shared(MODEL_REL);
    if (path == NULL)
        return;
    batcher_run(path, REKV_MODE_RESIDENT, 0);
}
END_TEST

/* Chunked prefill: prompts of up to 40 tokens in chunks of 3 to 7, in every exact mode, give the
 * same tokens as whole prompts (the chunks' attention is causal over the cache so far). */
START_TEST(batcher_chunked_prefill)
{
    const char *path = tu_shared(MODEL_REL);
    if (path == NULL)
        return;
    batcher_run(path, REKV_MODE_RESIDENT, 5);
    batcher_run(path, REKV_MODE_OFFLOAD, 7);
    batcher_run(path, REKV_MODE_KVPR, 3);
    batcher_run(path, REKV_MODE_HYBRID, 6);
    batcher_run(path, REKV_MODE_ACT, 16);
}
END_TEST

/* `rekv run` serves 64 concurrent jobs; outputs equal rekv_generate's. */
/* `rekv run` (cli_run in a child) on e's private sockets; returns once it is ready. mode NULL:
 * the default. */
static pid_t rekv_run_start_args(env *e, const char *host_bytes, const char *max_batch,
                                 const char *mode, const char *const *extra);

static pid_t rekv_run_start(env *e, const char *host_bytes, const char *max_batch, const char *mode)
{
    return rekv_run_start_args(e, host_bytes, max_batch, mode, NULL);
}

/* rekv run with more arguments (extra: NULL-terminated, may be NULL), on the cpu backend (see
 * start_worker). */
static pid_t rekv_run_start_args(env *e, const char *host_bytes, const char *max_batch,
                                 const char *mode, const char *const *extra)
{
    char bindir[4096];
    snprintf(bindir, sizeof(bindir), "%s", tu_bin(""));
    bindir[strlen(bindir) - 1] = '\0';
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        char fd[16];
        snprintf(fd, sizeof(fd), "%d", pfd[1]);
        char *argv[32] = {"run",
                          "--model",
                          e->model,
                          "--dir",
                          e->dir,
                          "--bin-dir",
                          bindir,
                          "--host-bytes",
                          (char *)host_bytes,
                          "--max-batch",
                          (char *)max_batch,
                          "--ready-fd",
                          fd,
                          "--backend",
                          "cpu"};
        int argc = 15;
        if (mode) {
            argv[argc++] = "--mode";
            argv[argc++] = (char *)mode;
        }
        for (int i = 0; extra && extra[i] && argc < 31; i++)
            argv[argc++] = (char *)extra[i];
        argv[argc] = NULL;
        _exit(cli_run(argc, argv));
    }
    close(pfd[1]);
    struct pollfd p = {pfd[0], POLLIN, 0};
    ck_assert_msg(poll(&p, 1, 60000) == 1, "rekv run did not become ready");
    char buf[8] = {0};
    ck_assert_msg(read(pfd[0], buf, 7) == 6, "rekv run exited before it was ready");
    close(pfd[0]);
    return pid;
}

/* Ctrl-C: everything stops cleanly. */
static void rekv_run_stop(pid_t pid)
{
    kill(pid, SIGINT);
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rekv run exit status %d", status);
}

/* The coordinator's Stats (free with rekv__control__response__free_unpacked). */
static Rekv__Control__Response *stats(rekv_ctl *c)
{
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    return call(c, &rq);
}

START_TEST(run_64_jobs)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 64 };
    static tjob jobs[N];
    make_jobs(jobs, N, 8, 512, 1);
    reference(jobs, N, e.model);
    pid_t pid = rekv_run_start(&e, "16M", "32", NULL);
    /* the control socket is private to us */
    struct stat st;
    ck_assert_int_eq(stat(e.ctl + 6, &st), 0);
    ck_assert_int_eq(st.st_mode & 0777, 0600);
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    uint64_t t0 = rekv_now_ns();
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_and_check(c, jobs, N, 60);
    double dt = (double)(rekv_now_ns() - t0) * 1e-9;
    Rekv__Control__Response *r = stats(c);
    ck_assert_int_eq(r->stats->done, N);
    ck_assert_int_eq(r->stats->n_workers, 1);
    fprintf(stderr,
            "   64 jobs, %llu tokens in %.2f s over %llu steps; per step: worker %.3f ms, plan + "
            "progress round trip %.3f ms (control-plane cost %.3f ms)\n",
            (unsigned long long)r->stats->tokens, dt, (unsigned long long)r->stats->steps,
            r->stats->worker_step_avg_s * 1e3, r->stats->step_rtt_avg_s * 1e3,
            (r->stats->step_rtt_avg_s - r->stats->worker_step_avg_s) * 1e3);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    /* Ctrl-C: everything stops cleanly and the sockets are gone */
    rekv_run_stop(pid);
    ck_assert_int_ne(access(e.ctl + 6, F_OK), 0);
    free_jobs(jobs, N);
    env_close(&e);
}
END_TEST

/* Waits until some job of jobs[] has produced tokens; returns its index. */
/* Chunked prefill served: `rekv run --prefill-chunk 4` runs a 40-token prompt as ten steps of
 * four tokens (the tenth samples the first token), a 3-token one in one step, and the jobs get
 * rekv_generate's tokens; mixing chunks with running decodes is batcher_chunked_prefill's. */
START_TEST(chunked_prefill_served)
{
    env e;
    if (env_open(&e))
        return;
    static tjob jobs[2];
    make_jobs(jobs, 2, 4, 512, 21);
    jobs[0].n_prompt = 3, jobs[0].gp.max_new_tokens = 30, jobs[0].gp.stop_at_eos = 0;
    jobs[1].n_prompt = 40, jobs[1].gp.max_new_tokens = 5, jobs[1].gp.stop_at_eos = 0;
    reference(jobs, 2, e.model);
    const char *extra[] = {"--prefill-chunk", "4", NULL};
    pid_t pid = rekv_run_start_args(&e, "64M", "8", "offload", extra);
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    uint64_t steps[2];
    for (int j = 0; j < 2; j++) {
        ck_assert_int_eq(submit_all(c, &jobs[j], 1), 1);
        wait_and_check(c, &jobs[j], 1, 120);
        Rekv__Control__Response *r = stats(c);
        steps[j] = r->stats->workers[0]->steps;
        rekv__control__response__free_unpacked(r, NULL);
    }
    ck_assert_uint_eq(steps[0], 30);            /* one prompt step, 29 decode steps */
    ck_assert_uint_eq(steps[1] - steps[0], 14); /* ten chunks, 4 decode steps */
    rekv_ctl_close(c);
    rekv_run_stop(pid);
    free_jobs(jobs, 2);
    env_close(&e);
}
END_TEST

/* The device-resident part in serving: a hybrid worker on a device with room (the cpu backend's
 * --device-memory) keeps its sequences' first tokens' K,V there and moves fewer bytes over the
 * link than one without — neither more KV nor more activations — for the same jobs and
 * rekv_generate's tokens. (Which of the two a hybrid worker moves is its planner's pattern: on
 * the cpu backend without a link, recomputation is dear and the pattern all KV; test_pipeline's
 * mode table checks the part's byte counts for ACT blocks.) */
START_TEST(device_part_in_serving)
{
    uint64_t kv_bytes[2], act_bytes[2];
    for (int withdev = 0; withdev < 2; withdev++) {
        env e;
        if (env_open(&e))
            return;
        enum { N = 6 };
        static tjob jobs[N];
        make_jobs(jobs, N, 8, 512, 33);
        reference(jobs, N, e.model);
        const char *extra[] = {"--device-memory", "64M", NULL};
        pid_t pid = rekv_run_start_args(&e, "64M", "4", "hybrid", withdev ? extra : NULL);
        rekv_ctl *c = ctl_open(e.ctl);
        wait_workers(c, 1);
        ck_assert_int_eq(submit_all(c, jobs, N), N);
        wait_and_check(c, jobs, N, 120);
        Rekv__Control__Response *r = stats(c);
        act_bytes[withdev] = r->stats->h2d_bytes_act;
        kv_bytes[withdev] = r->stats->h2d_bytes_kv;
        /* the worker said how much it keeps (and rekv stats shows it) */
        ck_assert_int_eq(r->stats->n_workers, 1);
        ck_assert_msg((r->stats->workers[0]->device_tokens > 0) == withdev,
                      "device part %u tokens %s device room", r->stats->workers[0]->device_tokens,
                      withdev ? "with" : "without");
        rekv__control__response__free_unpacked(r, NULL);
        rekv_ctl_close(c);
        rekv_run_stop(pid);
        free_jobs(jobs, N);
        env_close(&e);
    }
    ck_assert_msg(act_bytes[0] + kv_bytes[0] > 0 &&
                      act_bytes[1] + kv_bytes[1] < act_bytes[0] + kv_bytes[0] &&
                      act_bytes[1] <= act_bytes[0] && kv_bytes[1] <= kv_bytes[0],
                  "bytes over the link with device room: KV %llu, activations %llu; without: "
                  "KV %llu, activations %llu",
                  (unsigned long long)kv_bytes[1], (unsigned long long)act_bytes[1],
                  (unsigned long long)kv_bytes[0], (unsigned long long)act_bytes[0]);
}
END_TEST

/* The planner in the loop: with the KV cache in the kvstore (kvpr and hybrid modes) the
 * coordinator chooses every step's split, pattern and mini-batches from the worker's profile and
 * adapts to its measured busy times — and the jobs' tokens stay exactly rekv_generate's. */
START_TEST(planner_in_the_loop)
{
    const char *modes[] = {"kvpr", "hybrid"};
    for (int mi = 0; mi < 2; mi++) {
        env e;
        if (env_open(&e))
            return;
        enum { N = 24 };
        static tjob jobs[N];
        make_jobs(jobs, N, 8, 512, 7 + (uint64_t)mi);
        reference(jobs, N, e.model);
        pid_t pid = rekv_run_start(&e, "64M", "16", modes[mi]);
        rekv_ctl *c = ctl_open(e.ctl);
        wait_workers(c, 1);
        ck_assert_int_eq(submit_all(c, jobs, N), N);
        wait_and_check(c, jobs, N, 120);
        Rekv__Control__Response *r = stats(c);
        ck_assert_int_eq(r->stats->n_workers, 1);
        const Rekv__Control__WorkerInfo *w = r->stats->workers[0];
        ck_assert_str_eq(w->mode, modes[mi]);
        ck_assert_msg(w->plan_steps > 0, "%s: the planner chose nothing", modes[mi]);
        ck_assert_msg(w->plan_multi_batch_steps > 0, "%s: never more than one mini-batch",
                      modes[mi]);
        ck_assert_msg(w->plan_predicted_step_s > 0 && w->plan_pcie_scale > 0 &&
                          w->plan_compute_scale > 0 && isfinite(w->plan_compute_scale),
                      "%s: prediction %g, scales %g %g", modes[mi], w->plan_predicted_step_s,
                      w->plan_pcie_scale, w->plan_compute_scale);
        /* the worker timed some steps (one in eight) and the planner corrected its prices */
        ck_assert_msg(w->plan_compute_scale != 1, "%s: the compute scale never moved", modes[mi]);
        fprintf(stderr,
                "   %s: %llu steps planned, %llu as several mini-batches; last: split %d, "
                "pattern %u:%u, %u GPU batches; scales link %.2f compute %.2f\n",
                modes[mi], (unsigned long long)w->plan_steps,
                (unsigned long long)w->plan_multi_batch_steps, w->plan_split, w->plan_kv_parts,
                w->plan_act_parts, w->plan_gpu_batches, w->plan_pcie_scale, w->plan_compute_scale);
        rekv__control__response__free_unpacked(r, NULL);
        rekv_ctl_close(c);
        rekv_run_stop(pid);
        free_jobs(jobs, N);
        env_close(&e);
    }
}
END_TEST

/* A cpu backend that behaves like a small GPU behind a slow link (rekv run --link-gbps,
 * --device-memory): the worker's --mode auto finds that a full batch's KV cache does not fit the
 * device and picks an offloading mode, the coordinator plans its steps with the device's room,
 * and the jobs' tokens are still exactly rekv_generate's. */
START_TEST(emulated_gpu_auto_mode)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    make_jobs(jobs, N, 8, 512, 11);
    reference(jobs, N, e.model);
    const char *extra[] = {"--link-gbps", "1", "--device-memory", "3M", NULL};
    pid_t pid = rekv_run_start_args(&e, "64M", "16", NULL, extra);
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_and_check(c, jobs, N, 120);
    Rekv__Control__Response *r = stats(c);
    ck_assert_int_eq(r->stats->n_workers, 1);
    const Rekv__Control__WorkerInfo *w = r->stats->workers[0];
    ck_assert_msg(strcmp(w->mode, "resident") != 0,
                  "16 x 512 tokens of KV cannot fit a 3 MiB device, yet the worker runs resident");
    ck_assert_msg(w->plan_steps > 0, "%s: the planner chose nothing", w->mode);
    fprintf(stderr,
            "   emulated 3 MiB device at 1 Gbit/s: the worker picked %s; %llu steps planned\n",
            w->mode, (unsigned long long)w->plan_steps);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    rekv_run_stop(pid);
    free_jobs(jobs, N);
    env_close(&e);
}
END_TEST

/* Sends a Hello on a worker's DEALER socket; returns the coordinator's answer (NULL after 10 s). */
static Rekv__Worker__CoordMsg *hello_answer(void *sock, Rekv__Worker__Hello *h)
{
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.version = REKV_WORKER_PROTO_VERSION;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_HELLO;
    m.hello = h;
    uint8_t buf[1024];
    size_t n = rekv__worker__worker_msg__get_packed_size(&m);
    ck_assert(n <= sizeof(buf));
    rekv__worker__worker_msg__pack(&m, buf);
    ck_assert_int_eq(zmq_send(sock, buf, n, 0), (int)n);
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 10000) != 1)
        return NULL;
    int got = zmq_recv(sock, buf, sizeof(buf), 0);
    ck_assert(got > 0 && (size_t)got <= sizeof(buf));
    return rekv__worker__coord_msg__unpack(NULL, (size_t)got, buf);
}

/* The mode is the coordinator's decision: a worker (here a bare DEALER socket speaking
 * worker.proto) that says Hello with mode "auto" is answered Assign with the mode
 * rekv_plan_pick_mode gives for what it reports — resident without a kvstore or when the KV cache
 * fits its device, else the cheapest technique — and is not a worker yet; a Hello with that mode
 * is answered Welcome and makes it one. */
START_TEST(coordinator_assigns_worker_mode)
{
    env e;
    if (env_open(&e))
        return;
    pid_t co = start_coordinator(&e, "64", "10000");
    rekv_ctl *c = ctl_open(e.ctl);
    void *zctx = zmq_ctx_new();
    void *sock = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_connect(sock, e.wrk), 0);

    /* an OPT-6.7B-like worker: 64 sequences of 544 tokens, fp16 cache, fast GPU, PCIe-bound */
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = 25e9;
    cp.h2d_latency = 5e-6;
    cp.gemm_flops = 300e12;
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.name = "bare";
    h.backend = "cuda";
    h.mode = "auto";
    h.max_batch = 64;
    h.vocab = 512;
    h.max_pos = 544;
    h.profile = &cp;
    h.hidden = h.q_dim = h.kv_dim = 4096;
    h.n_layers = 32;
    h.cache_elem_bytes = 2;
    h.weight_elem_bytes = 2;
    h.layer_params = 2ull * 4096 * 4096 * 2 + 2ull * 4096 * 16384;
    double kv = 2.0 * 4096 * 2 * 64 * 544 * 32; /* the whole batch's KV cache, bytes */
    rekv_plan_model pm = {4096, 4096, 4096, 32, (double)h.layer_params, 2};
    rekv_cost_profile prof = {.h2d_bw = 25e9, .h2d_latency = 5e-6, .gemm_flops = 300e12};
    /* a room the cache does not fit, too small for a device-resident part beside a step's
     * buffers (0.1875 of the cache), and one that holds a part */
    double room = 0.16 * kv, part_room = 0.5 * kv;
    rekv_mode_pick pick, part;
    ck_assert_int_eq(rekv_plan_pick_mode(&prof, &pm, 64, 544, 2, room, 0, NULL, &pick, NULL), 0);
    ck_assert(!pick.resident && pick.device_tokens == 0);
    ck_assert_int_eq(rekv_plan_pick_mode(&prof, &pm, 64, 544, 2, part_room, 0, NULL, &part, NULL),
                     0);
    ck_assert(!part.resident && part.device_tokens > 0);
    static const char *const by_tech[REKV_TECH_COUNT] = {"offload", "kvpr", "act", "hybrid"};
    struct {
        int kvstore;
        double room;
        const char *want;
    } cases[] = {
        {0, room, "resident"},              /* no kvstore: nowhere else to keep the cache */
        {1, kv, "resident"},                /* it fits the device */
        {1, -1, "resident"},                /* the device's memory is the host's */
        {1, room, by_tech[pick.tech]},      /* it does not: the planner's cheapest technique */
        {1, part_room, by_tech[part.tech]}, /* ... beside each sequence's device part */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        h.kvstore = cases[i].kvstore;
        h.device_kv_room = cases[i].room;
        Rekv__Worker__CoordMsg *m = hello_answer(sock, &h);
        ck_assert_msg(m != NULL, "no answer to Hello auto");
        ck_assert_msg(m->body_case == REKV__WORKER__COORD_MSG__BODY_ASSIGN,
                      "Hello auto answered with body %d, not Assign", (int)m->body_case);
        ck_assert_str_eq(m->assign->mode, cases[i].want);
        ck_assert(m->assign->reason && m->assign->reason[0]);
        ck_assert_msg((strstr(m->assign->reason, "on the device") != NULL) == (i == 4),
                      "the reason names the device part exactly when there is one: %s",
                      m->assign->reason);
        rekv__worker__coord_msg__free_unpacked(m, NULL);
    }
    ck_assert_str_ne(by_tech[pick.tech], "offload"); /* MHA behind PCIe: recomputation pays */
    wait_workers(c, 0);                              /* asking for a mode does not make a worker */

    h.mode = (char *)by_tech[pick.tech];
    Rekv__Worker__CoordMsg *m = hello_answer(sock, &h);
    ck_assert(m != NULL && m->body_case == REKV__WORKER__COORD_MSG__BODY_WELCOME);
    rekv__worker__coord_msg__free_unpacked(m, NULL);
    wait_workers(c, 1);
    Rekv__Control__Response *r = stats(c);
    ck_assert_str_eq(r->stats->workers[0]->mode, by_tech[pick.tech]);
    rekv__control__response__free_unpacked(r, NULL);

    zmq_close(sock);
    zmq_ctx_term(zctx);
    rekv_ctl_close(c);
    ck_assert_int_eq(stop(co), 0);
    env_close(&e);
}
END_TEST

/* An approximate mode is opt-in: the same worker behind a slow link, asking for its mode, is
 * assigned infinigen when its Hello says approximate and an exact mode (the one the planner picks
 * without approximation) when it does not; a Hello with mode "infinigen" makes it a worker that
 * runs so. */
START_TEST(coordinator_assigns_infinigen_only_when_allowed)
{
    env e;
    if (env_open(&e))
        return;
    pid_t co = start_coordinator(&e, "64", "10000");
    rekv_ctl *c = ctl_open(e.ctl);
    void *zctx = zmq_ctx_new();
    void *sock = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_connect(sock, e.wrk), 0);

    /* OPT-6.7B-like, 64 sequences of 544 tokens, fp16 cache, behind a 2 GB/s link */
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = 2e9;
    cp.h2d_latency = 5e-6;
    cp.gemm_flops = 300e12;
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.name = "bare";
    h.backend = "cuda";
    h.mode = "auto";
    h.max_batch = 64;
    h.vocab = 512;
    h.max_pos = 544;
    h.profile = &cp;
    h.hidden = h.q_dim = h.kv_dim = 4096;
    h.n_layers = 32;
    h.cache_elem_bytes = 2;
    h.weight_elem_bytes = 2;
    h.layer_params = 2ull * 4096 * 4096 * 2 + 2ull * 4096 * 16384;
    h.kvstore = 1;
    /* the cache does not fit, nor a device-resident part beside a step's buffers; the partial
     * keys (fp32, 0.3 of this fp16 cache) and a step's attention buffers (0.0625) do */
    h.device_kv_room = 0.38 * (2.0 * 4096 * 2 * 64 * 544 * 32);
    rekv_plan_model pm = {4096, 4096, 4096, 32, (double)h.layer_params, 2};
    rekv_cost_profile prof = {.h2d_bw = 2e9, .h2d_latency = 5e-6, .gemm_flops = 300e12};
    rekv_mode_pick exact;
    ck_assert_int_eq(
        rekv_plan_pick_mode(&prof, &pm, 64, 544, 2, h.device_kv_room, 0, NULL, &exact, NULL), 0);
    static const char *const by_tech[REKV_TECH_COUNT] = {"offload", "kvpr", "act", "hybrid"};
    ck_assert(!exact.resident && exact.tech < REKV_TECH_COUNT);
    for (int approximate = 0; approximate <= 1; approximate++) {
        h.approximate = approximate;
        Rekv__Worker__CoordMsg *m = hello_answer(sock, &h);
        ck_assert_msg(m != NULL && m->body_case == REKV__WORKER__COORD_MSG__BODY_ASSIGN,
                      "Hello auto not answered with Assign");
        ck_assert_str_eq(m->assign->mode, approximate ? "infinigen" : by_tech[exact.tech]);
        /* infinigen with layer 0's split, the planner's (capped by the room) */
        rekv_plan_approx rec = {0, 1};
        rekv_mode_pick ap;
        ck_assert_int_eq(
            rekv_plan_pick_mode(&prof, &pm, 64, 544, 2, h.device_kv_room, 0, &rec, &ap, NULL), 0);
        ck_assert_int_eq(m->assign->split, approximate ? ap.costs[REKV_TECH_INFINIGEN].kvpr_l : 0);
        ck_assert(!approximate || m->assign->split > 0);
        ck_assert_msg((strstr(m->assign->reason, "infinigen") != NULL) == approximate,
                      "the reason names infinigen's price exactly when it was allowed: %s",
                      m->assign->reason);
        rekv__worker__coord_msg__free_unpacked(m, NULL);
    }
    wait_workers(c, 0);

    h.mode = "infinigen"; /* the worker built its pipeline so and says Hello again */
    Rekv__Worker__CoordMsg *m = hello_answer(sock, &h);
    ck_assert(m != NULL && m->body_case == REKV__WORKER__COORD_MSG__BODY_WELCOME);
    rekv__worker__coord_msg__free_unpacked(m, NULL);
    wait_workers(c, 1);
    Rekv__Control__Response *r = stats(c);
    ck_assert_str_eq(r->stats->workers[0]->mode, "infinigen");
    rekv__control__response__free_unpacked(r, NULL);

    zmq_close(sock);
    zmq_ctx_term(zctx);
    rekv_ctl_close(c);
    ck_assert_int_eq(stop(co), 0);
    env_close(&e);
}
END_TEST

/* The push path between the real daemons: rekv run --push starts the kvstore with a push backend
 * and the worker in push mode, so the store process writes every KV row into the worker's
 * exported buffers; the jobs' tokens are exactly rekv_generate's. */
START_TEST(push_between_processes)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 12 };
    static tjob jobs[N];
    make_jobs(jobs, N, 8, 512, 13);
    reference(jobs, N, e.model);
    const char *extra[] = {"--push", NULL};
    pid_t pid = rekv_run_start_args(&e, "64M", "8", "kvpr", extra);
    rekv_kvstore_client *k = kv_open(&e);
    char name[16] = "";
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_push(k, NULL, 0, NULL, NULL, NULL, 0, name, sizeof(name), &err) == 0,
                  "the store cannot push: %s", err.msg);
    ck_assert_str_eq(name, "cpu");
    rekv_kvstore_client_close(k);
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_and_check(c, jobs, N, 120);
    Rekv__Control__Response *r = stats(c);
    ck_assert_str_eq(r->stats->workers[0]->mode, "kvpr");
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    rekv_run_stop(pid);
    free_jobs(jobs, N);
    env_close(&e);
}
END_TEST

/* A step far longer than the coordinator's worker timeout (its KV over a slow emulated link):
 * the worker keeps heartbeating from its loop while the step runs on its own thread, so nobody
 * takes it for dead, nothing is re-queued, and the tokens are rekv_generate's. */
START_TEST(long_steps_keep_heartbeating)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    slow_model_jobs(&e, jobs, N, 3);
    pid_t kv = start_kvstore(&e, "60000", "128M");
    pid_t co = start_coordinator(&e, "64", "250");
    /* each step's KV (the 16 prompts' 296 tokens and more, x 8 layers x 8 KiB: 19 MB, fetched
     * or, at the prefill, stored) over 0.25 Gbit/s: over 0.6 s */
    pid_t wk = kv_worker(&e, "16", NULL, "0.25");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_and_check(c, jobs, N, 120);
    Rekv__Control__Response *r = stats(c);
    ck_assert_msg(r->stats->requeued == 0, "%llu jobs re-queued: the worker was taken for dead",
                  (unsigned long long)r->stats->requeued);
    /* the longest step is at least the mean: above the timeout, or the test proves nothing */
    ck_assert_msg(r->stats->worker_step_avg_s > 0.25,
                  "steps took %.2f s on average, not longer than the 0.25 s worker timeout: make "
                  "the model bigger",
                  r->stats->worker_step_avg_s);
    fprintf(stderr, "   %llu steps of %.2f s on average against a 0.25 s worker timeout\n",
            (unsigned long long)r->stats->steps, r->stats->worker_step_avg_s);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    ck_assert_int_eq(stop(kv), 0);
    free_jobs(jobs, N);
    env_close(&e);
}
END_TEST

/* The same with the KV cache in a kvstore whose lease (0.25 s) is shorter than a step: the
 * worker's loop renews it while the step thread holds the step's pins, so no pin is lost (the step
 * would fail unpinning them), nothing is reclaimed, and the tokens are rekv_generate's. */
START_TEST(long_steps_keep_kvstore_pins)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    slow_model_jobs(&e, jobs, N, 5);
    pid_t kv = start_kvstore(&e, "250", "128M");
    rekv_kvstore_client *k = kv_open(&e);
    pid_t co = start_coordinator(&e, "64", "5000");
    /* each step's KV (the 16 prompts' 296 tokens and more, x 8 layers x 8 KiB: 19 MB, fetched
     * or, at the prefill, stored) over 0.25 Gbit/s: over 0.6 s */
    pid_t wk = kv_worker(&e, "16", NULL, "0.25");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_and_check(c, jobs, N, 120);
    Rekv__Control__Response *r = stats(c);
    ck_assert_msg(r->stats->worker_step_avg_s > 0.25,
                  "steps took %.2f s on average, not longer than the 0.25 s lease: make the model "
                  "bigger",
                  r->stats->worker_step_avg_s);
    fprintf(stderr, "   %llu steps of %.2f s on average against a 0.25 s kvstore lease\n",
            (unsigned long long)r->stats->steps, r->stats->worker_step_avg_s);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_kv_stats st;
    kv_stats(k, &st);
    ck_assert_msg(st.leases_expired == 0, "the worker lost its pins %llu times",
                  (unsigned long long)st.leases_expired);
    ck_assert_uint_eq(st.sequences_reclaimed, 0);
    ck_assert_uint_eq(st.sequences, 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    ck_assert_uint_eq(st.free_slots, st.total_slots);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    ck_assert_int_eq(stop(kv), 0);
    free_jobs(jobs, N);
    env_close(&e);
}
END_TEST

static int wait_some_tokens(rekv_ctl *c, tjob *jobs, int n)
{
    uint64_t deadline = rekv_now_ns() + 30000000000ull;
    for (;;) {
        for (int i = 0; i < n; i++) {
            Rekv__Control__Response *r = status(c, jobs[i].id);
            int has = r->job && r->job->state == REKV__CONTROL__JOB_STATE__RUNNING &&
                      r->job->n_generated_ids > 0;
            rekv__control__response__free_unpacked(r, NULL);
            if (has)
                return i;
        }
        ck_assert_msg(rekv_now_ns() < deadline, "no job produced tokens");
        usleep(2000);
    }
}

/* SIGKILL the worker mid-run: the coordinator stays up, notices (heartbeat), re-queues the jobs
 * in flight, and a new worker runs them to the same tokens. */
START_TEST(worker_killed)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    make_jobs(jobs, N, 400, 512, 2);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0; /* long runs, so that the kill lands mid-run */
    reference(jobs, N, e.model);
    pid_t co = start_coordinator(&e, "256", "1000");
    pid_t wk = start_worker(&e, "16");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    int i = wait_some_tokens(c, jobs, N);
    kill9(wk);
    /* the coordinator answers throughout and drops the worker after the timeout */
    wait_workers(c, 0);
    Rekv__Control__Response *r = status(c, jobs[i].id);
    ck_assert_msg(r->job->state == REKV__CONTROL__JOB_STATE__QUEUED,
                  "job state %s after the "
                  "worker died",
                  rekv_ctl_state_name(r->job->state));
    ck_assert_int_eq(r->job->attempts, 1);
    rekv__control__response__free_unpacked(r, NULL);
    wk = start_worker(&e, "16");
    wait_and_check(c, jobs, N, 60);
    r = status(c, jobs[i].id);
    ck_assert_int_eq(r->job->attempts, 2);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    free_jobs(jobs, N);
    env_close(&e);
}
END_TEST

/* SIGKILL a worker whose KV cache is in the kvstore: its sequences stay there (the lease is a
 * minute, longer than this test), a worker started under the same name drops them before it
 * serves, re-runs the jobs to the same tokens, and the store's block usage is back to what it was
 * before any job. */
START_TEST(worker_restart_frees_kvstore_blocks)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    make_jobs(jobs, N, 400, 512, 6);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0; /* long runs, so that the kill lands mid-run */
    reference(jobs, N, e.model);
    pid_t kv = start_kvstore(&e, "60000", "64M");
    rekv_kvstore_client *k = kv_open(&e);
    rekv_kv_stats st0, st;
    kv_stats(k, &st0);
    pid_t co = start_coordinator(&e, "256", "1000");
    pid_t wk = start_kv_worker(&e, "16", "w0");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N);
    kill9(wk);
    wait_workers(c, 0);
    kv_stats(k, &st);
    uint64_t left = st.sequences;
    ck_assert_msg(left > 0 && st.free_slots < st0.free_slots,
                  "the killed worker left nothing in the kvstore (%llu sequences, %llu of %llu "
                  "slots free)",
                  (unsigned long long)left, (unsigned long long)st.free_slots,
                  (unsigned long long)st0.free_slots);
    ck_assert_uint_eq(st.sequences_reclaimed, 0);
    wk = start_kv_worker(&e, "16", "w0"); /* ready only once it dropped them */
    kv_stats(k, &st);
    ck_assert_uint_eq(st.sequences_reclaimed, left);
    wait_and_check(c, jobs, N, 60);
    kv_stats(k, &st);
    ck_assert_uint_eq(st.sequences, 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    ck_assert_uint_eq(st.free_slots, st0.free_slots);
    fprintf(stderr, "   the restarted worker dropped the %llu sequences the killed one left\n",
            (unsigned long long)left);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    ck_assert_int_eq(stop(kv), 0);
    free_jobs(jobs, N);
    env_close(&e);
}
END_TEST

/* SIGKILL a worker (default name, so no successor claims its sequences) with a 0.5 s kvstore
 * lease: while it lives, its renewals keep everything; once dead, the store drops its sequences
 * after the lease and its block usage is back to what it was. */
START_TEST(dead_worker_blocks_return_after_lease)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    make_jobs(jobs, N, 400, 512, 8);
    for (int i = 0; i < N; i++)
        jobs[i].gp.stop_at_eos = 0;
    pid_t kv = start_kvstore(&e, "500", "64M");
    rekv_kvstore_client *k = kv_open(&e);
    rekv_kv_stats st0, st;
    kv_stats(k, &st0);
    pid_t co = start_coordinator(&e, "256", "1000");
    pid_t wk = start_kv_worker(&e, "16", NULL);
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N);
    usleep(1200000); /* more than two leases of running */
    kv_stats(k, &st);
    ck_assert_msg(st.sequences > 0 && st.sequences_reclaimed == 0 && st.leases_expired == 0,
                  "a live worker lost something: %llu sequences, %llu reclaimed, %llu leases "
                  "expired",
                  (unsigned long long)st.sequences, (unsigned long long)st.sequences_reclaimed,
                  (unsigned long long)st.leases_expired);
    kill9(wk);
    uint64_t t0 = rekv_now_ns();
    for (;;) {
        kv_stats(k, &st);
        if (st.sequences == 0 && st.free_slots == st0.free_slots)
            break;
        ck_assert_msg(rekv_now_ns() - t0 < 5000000000ull,
                      "5 s after the kill: %llu sequences, %llu of %llu slots free",
                      (unsigned long long)st.sequences, (unsigned long long)st.free_slots,
                      (unsigned long long)st0.free_slots);
        usleep(20000);
    }
    ck_assert_uint_gt(st.sequences_reclaimed, 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(stop(co), 0);
    ck_assert_int_eq(stop(kv), 0);
    env_close(&e);
}
END_TEST

/* SIGKILL the coordinator mid-run, once jobs have produced tokens: a new one replays the journal,
 * the worker is reset and says Hello again, and every acknowledged job completes exactly once —
 * with the right tokens, and the new coordinator counts each job accepted once and done once. */
START_TEST(coordinator_restart)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 24 };
    static tjob jobs[N + 1];
    make_jobs(jobs, N + 1, 200, 512, 3);
    reference(jobs, N + 1, e.model);
    pid_t co = start_coordinator(&e, "256", "2000");
    pid_t wk = start_worker(&e, "8");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_some_tokens(c, jobs, N); /* mid-run */
    kill9(co);
    rekv_ctl_close(c);
    co = start_coordinator(&e, "256", "2000");
    c = ctl_open(e.ctl);
    /* ids go on after the replayed ones */
    ck_assert_int_eq(submit_all(c, jobs + N, 1), 1);
    ck_assert_uint_gt(jobs[N].id, jobs[N - 1].id);
    wait_and_check(c, jobs, N + 1, 60);
    Rekv__Control__Response *st = stats(c);
    ck_assert_uint_eq(st->stats->accepted, N + 1);
    ck_assert_uint_eq(st->stats->done + st->stats->failed, N + 1);
    ck_assert_uint_eq(st->stats->failed, 0);
    rekv__control__response__free_unpacked(st, NULL);
    /* and once more: finished jobs are remembered across a clean restart */
    ck_assert_int_eq(stop(co), 0);
    rekv_ctl_close(c);
    co = start_coordinator(&e, "256", "2000");
    c = ctl_open(e.ctl);
    wait_and_check(c, jobs, N + 1, 10);
    rekv_ctl_close(c);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    free_jobs(jobs, N + 1);
    env_close(&e);
}
END_TEST

static void expect_error(rekv_ctl *c, Rekv__Control__Code code, const char *needle)
{
    Rekv__Control__Response *r = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_recv(c, 10000, &r, &err) == 0, "%s", err.msg);
    ck_assert_msg(r->code == code, "code %d (%s), expected %d", r->code, r->error, code);
    ck_assert_msg(strstr(r->error, needle) != NULL, "\"%s\" does not say \"%s\"", r->error, needle);
    rekv__control__response__free_unpacked(r, NULL);
}

/* Malformed, oversized, multi-frame, wrong-version and invalid requests get error replies; the
 * coordinator carries on. */
START_TEST(malformed_requests)
{
    env e;
    if (env_open(&e))
        return;
    pid_t co = start_coordinator(&e, "256", "2000");
    rekv_ctl *c = ctl_open(e.ctl);
    rekv_err err = {0};
    const char junk[] = "\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01 not protobuf";
    const void *f1[] = {junk};
    size_t l1[] = {sizeof(junk)};
    ck_assert_int_eq(rekv_ctl_send_raw(c, f1, l1, 1, &err), 0);
    expect_error(c, REKV__CONTROL__CODE__BAD_REQUEST, "not a rekv.control.Request");
    const void *f2[] = {"a", "b", "c"};
    size_t l2[] = {1, 1, 1};
    ck_assert_int_eq(rekv_ctl_send_raw(c, f2, l2, 3, &err), 0);
    expect_error(c, REKV__CONTROL__CODE__BAD_REQUEST, "exactly one frame");
    size_t big = 2u << 20;
    char *buf = calloc(1, big);
    const void *f3[] = {buf};
    ck_assert_int_eq(rekv_ctl_send_raw(c, f3, &big, 1, &err), 0);
    expect_error(c, REKV__CONTROL__CODE__BAD_REQUEST, "larger than the limit");
    free(buf);
    ck_assert_int_eq(rekv_ctl_send_raw(c, f3, (size_t[]){0}, 1, &err), 0);
    expect_error(c, REKV__CONTROL__CODE__BAD_REQUEST, "version 0"); /* empty: no version */
    /* another protocol version */
    Rekv__Control__HealthRequest h = REKV__CONTROL__HEALTH_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.version = 99;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_HEALTH;
    rq.health = &h;
    uint8_t pk[64];
    size_t pn = rekv__control__request__pack(&rq, pk);
    const void *f4[] = {pk};
    ck_assert_int_eq(rekv_ctl_send_raw(c, f4, &pn, 1, &err), 0);
    expect_error(c, REKV__CONTROL__CODE__BAD_REQUEST, "version 99");
    /* invalid submits */
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    Rekv__Control__Request rs = REKV__CONTROL__REQUEST__INIT;
    rs.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rs.submit = &s;
    Rekv__Control__Response *r = call(c, &rs);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    rekv__control__response__free_unpacked(r, NULL);
    s.prompt_text = "hello";
    rs.id = 0;
    r = call(c, &rs);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__BAD_REQUEST && strstr(r->error, "tokenizer"),
                  "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    r = status(c, 123456);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    rekv__control__response__free_unpacked(r, NULL);
    /* a frame above the transport limit cuts that connection, nothing more */
    size_t huge = 20u << 20;
    char *hb = calloc(1, huge);
    const void *f5[] = {hb};
    ck_assert_int_eq(rekv_ctl_send_raw(c, f5, &huge, 1, &err), 0);
    free(hb);
    rekv_ctl_close(c);
    c = ctl_open(e.ctl);
    r = health(c);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    ck_assert(r->health->serving);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(stop(co), 0);
    env_close(&e);
}
END_TEST

/* 10,000 submissions at once against a queue of 256: BUSY replies, bounded memory, and every
 * accepted job completes with rekv_generate's tokens. */
START_TEST(busy_queue)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 10000 };
    tjob *jobs = calloc(N, sizeof(tjob));
    make_jobs(jobs, N, 1, 512, 4);
    for (int i = 0; i < N; i++)
        jobs[i].gp.max_new_tokens = 1 + i % 4;
    pid_t co = start_coordinator(&e, "256", "5000");
    pid_t wk = start_worker(&e, "32");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    int acc = submit_all(c, jobs, N);
    fprintf(stderr,
            "   %d of %d submissions accepted, the rest answered busy; coordinator peak "
            "RSS %ld KiB\n",
            acc, N, tu_proc_status_kb(co, "VmHWM"));
    ck_assert_int_ge(acc, 256);
    ck_assert_int_lt(acc, N);
    ck_assert_int_lt(tu_proc_status_kb(co, "VmHWM"), 256 * 1024);
    /* references only for the accepted ones */
    tjob *a = calloc((size_t)acc, sizeof(tjob));
    int k = 0;
    for (int i = 0; i < N; i++)
        if (jobs[i].id)
            a[k++] = jobs[i];
    reference(a, acc, e.model);
    wait_and_check(c, a, acc, 90);
    rekv_ctl_close(c);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    free_jobs(a, acc);
    free(a);
    free(jobs);
    env_close(&e);
}
END_TEST

/* Waits until job id leaves the queue (admitted), failing the test if it fails instead. */
static void wait_admitted(rekv_ctl *c, uint64_t id)
{
    for (;;) {
        Rekv__Control__Response *r = status(c, id);
        int st = r->job->state;
        rekv__control__response__free_unpacked(r, NULL);
        ck_assert_int_ne(st, REKV__CONTROL__JOB_STATE__FAILED);
        if (st != REKV__CONTROL__JOB_STATE__QUEUED)
            return;
        usleep(1000);
    }
}

/* Admission against the kvstore's room (issue 14 item 3, issue 16's "a full arena while
 * serving"): a store of 100 blocks and no spill tier, offload mode (stories260K: 5 layers, a
 * 4 KiB block each per 16 tokens). A job whose KV fits only alone runs while the next one waits in
 * the queue, saying so in its status; twelve jobs whose KV together is twice the store all finish
 * with rekv_generate's tokens, no step fails; a job larger than the whole store fails at once. */
START_TEST(admission_waits_for_kvstore_room)
{
    env e;
    if (env_open(&e))
        return;
    enum { N = 12 };
    static tjob jobs[N], ab[2];
    make_jobs(jobs, N, 16, 512, 11);
    reference(jobs, N, e.model);
    /* A: 300 tokens = 19 blocks a layer, 95 of the 100; B: 17 tokens, 10 blocks */
    make_jobs(ab, 2, 16, 512, 12);
    ab[0].n_prompt = 4, ab[0].gp.max_new_tokens = 296, ab[0].gp.stop_at_eos = 0;
    ab[1].n_prompt = 1, ab[1].gp.max_new_tokens = 16;
    reference(ab, 2, e.model);
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *kargs[] = {prog,     "--endpoint",    e.kv,  "--model",    e.model, "--host-bytes",
                           "413696", "--cache-dtype", "f32", "--no-spill", NULL};
    pid_t kv = spawn(kargs);
    rekv_kvstore_client *k = kv_open(&e);
    rekv_kv_stats kst;
    kv_stats(k, &kst);
    ck_assert_uint_eq(kst.host_bytes, 100 * 4096);
    pid_t co = start_coordinator(&e, "64", "5000");
    pid_t wk = start_kv_worker(&e, "8", "w0");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);

    ck_assert_int_eq(submit_all(c, &ab[0], 1), 1);
    wait_admitted(c, ab[0].id); /* A runs: it fits alone */
    ck_assert_int_eq(submit_all(c, &ab[1], 1), 1);
    int seen = 0;
    for (;;) { /* B cannot start before A ends: it waits, and says why */
        Rekv__Control__Response *r = status(c, ab[1].id);
        int queued = r->job->state == REKV__CONTROL__JOB_STATE__QUEUED;
        seen = queued && strstr(r->job->waiting, "waiting for kvstore room") != NULL;
        rekv__control__response__free_unpacked(r, NULL);
        if (seen || !queued)
            break;
    }
    ck_assert_msg(seen, "job B started without waiting for A's kvstore room");
    Rekv__Control__Response *ra = status(c, ab[0].id);
    ck_assert_int_eq(ra->job->state, REKV__CONTROL__JOB_STATE__RUNNING); /* B waited on it */
    rekv__control__response__free_unpacked(ra, NULL);
    wait_and_check(c, ab, 2, 60);

    /* twelve at once, and one that can never fit: 410 tokens = 26 blocks a layer */
    static tjob big[1];
    make_jobs(big, 1, 16, 512, 13);
    big[0].n_prompt = 10, big[0].gp.max_new_tokens = 400;
    ck_assert_int_eq(submit_all(c, big, 1), 1);
    ck_assert_int_eq(submit_all(c, jobs, N), N);
    wait_and_check(c, jobs, N, 60);
    Rekv__Control__Response *r = status(c, big[0].id);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__FAILED);
    ck_assert_msg(strstr(r->job->error, "kvstore host memory") != NULL, "%s", r->job->error);
    ck_assert_uint_eq(r->job->attempts, 0); /* failed before it ever ran */
    rekv__control__response__free_unpacked(r, NULL);
    r = stats(c);
    ck_assert_uint_eq(r->stats->done, N + 2);
    ck_assert_uint_eq(r->stats->failed, 1);
    ck_assert_uint_eq(r->stats->steps_failed, 0);
    ck_assert_uint_eq(r->stats->requeued, 0);
    ck_assert_uint_eq(r->stats->jobs_too_large, 1);
    ck_assert_uint_ge(r->stats->jobs_held_for_room, 2); /* B, and some of the twelve */
    fprintf(stderr, "   %llu jobs held for kvstore room, %llu steps\n",
            (unsigned long long)r->stats->jobs_held_for_room, (unsigned long long)r->stats->steps);
    rekv__control__response__free_unpacked(r, NULL);
    kv_stats(k, &kst);
    ck_assert_uint_eq(kst.sequences, 0);
    ck_assert_uint_eq(kst.host_free_bytes, kst.host_bytes);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    ck_assert_int_eq(stop(kv), 0);
    free_jobs(jobs, N);
    free_jobs(ab, 2);
    env_close(&e);
}
END_TEST

/* Admission counts the spill tier (issue 14 items 3-4): an arena of 60 blocks and a spill tier of
 * 80 (--spill-bytes), offload. Job A (400 tokens: 25 blocks a layer, 125 in all) is twice the
 * arena and is admitted — its steps run in layer windows, the blocks of the layers not running
 * spilled — and finishes with rekv_generate's tokens; B, the same size, waits for A (125 + 125 is
 * more than arena and spill together), saying so, and then finishes; C (504 tokens, 160 blocks)
 * is larger than arena and spill together and fails at once. */
START_TEST(admission_counts_spill)
{
    env e;
    if (env_open(&e))
        return;
    static tjob ab[2], big[1];
    make_jobs(ab, 2, 16, 512, 14);
    for (int i = 0; i < 2; i++)
        ab[i].n_prompt = 4, ab[i].gp.max_new_tokens = 396, ab[i].gp.stop_at_eos = 0;
    reference(ab, 2, e.model);
    make_jobs(big, 1, 16, 512, 15);
    big[0].n_prompt = 4, big[0].gp.max_new_tokens = 500;
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    char *dir = tu_tmpdir();
    const char *kargs[] = {prog,     "--endpoint",
                           e.kv,     "--model",
                           e.model,  "--host-bytes",
                           "249856", "--cache-dtype",
                           "f32",    "--spill-dir",
                           dir,      "--spill-bytes",
                           "327680", NULL};
    pid_t kv = spawn(kargs);
    rekv_kvstore_client *k = kv_open(&e);
    rekv_kv_stats kst;
    kv_stats(k, &kst);
    ck_assert_uint_eq(kst.host_bytes, 60 * 4096);
    ck_assert_uint_eq(kst.spill_room_bytes, 80 * 4096);
    pid_t co = start_coordinator(&e, "64", "5000");
    pid_t wk = start_kv_worker(&e, "8", "w0");
    rekv_ctl *c = ctl_open(e.ctl);
    wait_workers(c, 1);
    ck_assert_int_eq(submit_all(c, big, 1), 1);
    ck_assert_int_eq(submit_all(c, &ab[0], 1), 1);
    wait_admitted(c, ab[0].id); /* A runs: it fits arena and spill */
    ck_assert_int_eq(submit_all(c, &ab[1], 1), 1);
    int seen = 0;
    for (;;) { /* B waits for A, and says why */
        Rekv__Control__Response *r = status(c, ab[1].id);
        int queued = r->job->state == REKV__CONTROL__JOB_STATE__QUEUED;
        seen = queued && strstr(r->job->waiting, "waiting for kvstore room") != NULL &&
               strstr(r->job->waiting, "spill") != NULL;
        rekv__control__response__free_unpacked(r, NULL);
        if (seen || !queued)
            break;
    }
    ck_assert_msg(seen, "job B started without waiting for A's room in arena and spill");
    wait_and_check(c, ab, 2, 120);
    Rekv__Control__Response *r = status(c, big[0].id);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__FAILED);
    ck_assert_msg(strstr(r->job->error, "kvstore host memory and spill") != NULL, "%s",
                  r->job->error);
    ck_assert_uint_eq(r->job->attempts, 0); /* failed before it ever ran */
    rekv__control__response__free_unpacked(r, NULL);
    r = stats(c);
    ck_assert_uint_eq(r->stats->done, 2);
    ck_assert_uint_eq(r->stats->failed, 1);
    ck_assert_uint_eq(r->stats->steps_failed, 0);
    ck_assert_uint_eq(r->stats->requeued, 0);
    ck_assert_uint_eq(r->stats->jobs_too_large, 1);
    rekv__control__response__free_unpacked(r, NULL);
    kv_stats(k, &kst);
    fprintf(stderr, "   admission_counts_spill: %llu bytes spilled, %llu read back, %llu ahead\n",
            (unsigned long long)kst.bytes_spilled, (unsigned long long)kst.bytes_read_back,
            (unsigned long long)kst.read_ahead_bytes);
    ck_assert_uint_gt(kst.bytes_read_back, 0); /* the jobs' KV did live on the spill tier */
    ck_assert_uint_eq(kst.sequences, 0);
    rekv_ctl_close(c);
    rekv_kvstore_client_close(k);
    ck_assert_int_eq(stop(wk), 0);
    ck_assert_int_eq(stop(co), 0);
    ck_assert_int_eq(stop(kv), 0);
    free_jobs(ab, 2);
    tu_rmrf(dir);
    free(dir);
    env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("coordinator");
    TCase *tc = tcase_create("coordinator");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, batcher_matches_generate);
    tcase_add_test(tc, batcher_chunked_prefill);
    tcase_add_test(tc, chunked_prefill_served);
    tcase_add_test(tc, device_part_in_serving);
    tcase_add_test(tc, run_64_jobs);
    tcase_add_test(tc, planner_in_the_loop);
    tcase_add_test(tc, emulated_gpu_auto_mode);
    tcase_add_test(tc, coordinator_assigns_worker_mode);
    tcase_add_test(tc, coordinator_assigns_infinigen_only_when_allowed);
    tcase_add_test(tc, push_between_processes);
    tcase_add_test(tc, long_steps_keep_heartbeating);
    tcase_add_test(tc, long_steps_keep_kvstore_pins);
    tcase_add_test(tc, worker_killed);
    tcase_add_test(tc, worker_restart_frees_kvstore_blocks);
    tcase_add_test(tc, dead_worker_blocks_return_after_lease);
    tcase_add_test(tc, coordinator_restart);
    tcase_add_test(tc, malformed_requests);
    tcase_add_test(tc, busy_queue);
    tcase_add_test(tc, admission_waits_for_kvstore_room);
    tcase_add_test(tc, admission_counts_spill);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
