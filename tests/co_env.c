/* co_env.c — see co_env.h. */
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
#include "tests/co_env.h"

void ct_make_jobs(tjob *jobs, int n, int max_new_base, int vocab, uint64_t salt)
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

void ct_reference(tjob *jobs, int n, const char *model)
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

void ct_free_jobs(tjob *jobs, int n)
{
    for (int i = 0; i < n; i++)
        rekv_gen_result_free(&jobs[i].ref);
}

uint64_t ct_submit_async(rekv_ctl *c, const tjob *j)
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

int ct_submit_all(rekv_ctl *c, tjob *jobs, int n)
{
    uint64_t *rq = calloc((size_t)n, sizeof(uint64_t));
    for (int i = 0; i < n; i++)
        rq[i] = ct_submit_async(c, &jobs[i]);
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

void ct_wait_and_check(rekv_ctl *c, tjob *jobs, int n)
{
    for (int i = 0; i < n; i++) {
        if (jobs[i].id == 0)
            continue;
        for (;;) {
            Rekv__Control__Response *r = tu_ctl_status(c, jobs[i].id);
            ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "status of job %llu: %s",
                          (unsigned long long)jobs[i].id, r->error);
            const Rekv__Control__JobStatus *s = r->job;
            if (s->state == REKV__CONTROL__JOB_STATE__QUEUED ||
                s->state == REKV__CONTROL__JOB_STATE__RUNNING) {
                rekv__control__response__free_unpacked(r, NULL);
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

void ct_make_salted_job(tjob *j, const char *model, int salt)
{
    memset(j, 0, sizeof(*j));
    j->n_prompt = 40;
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(salt + 1);
    for (int i = 0; i < 40; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        j->prompt[i] = 1 + (int32_t)((x >> 33) % 500);
    }
    j->gp = (rekv_gen_params){.max_new_tokens = 8, .top_p = 1.0f};
    ct_reference(j, 1, model);
}

uint32_t ct_run_cached(rekv_ctl *c, const tjob *proto)
{
    tjob j = *proto;
    ck_assert_int_eq(ct_submit_all(c, &j, 1), 1);
    ct_wait_and_check(c, &j, 1);
    Rekv__Control__Response *r = tu_ctl_status(c, j.id);
    uint32_t cached = r->job->cached_tokens;
    rekv__control__response__free_unpacked(r, NULL);
    return cached;
}

pid_t ct_spawn(const char *const *args)
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

int ct_stop(pid_t pid)
{
    kill(pid, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return st;
}

int ct_env_open(env *e)
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

void ct_env_close(env *e)
{
    tu_rmrf(e->dir);
    free(e->dir);
}

pid_t ct_start_coordinator(env *e, const char *queue, const char *timeout_ms)
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
    return ct_spawn(args);
}

pid_t ct_start_worker(env *e, const char *max_batch)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,  "--model",     e->model,  "--coordinator",  e->wrk, "--backend",
                          "cpu", "--max-batch", max_batch, "--heartbeat-ms", "100",  NULL};
    return ct_spawn(args);
}

pid_t ct_kv_worker(env *e, const char *max_batch, const char *name, const char *gbps)
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
    return ct_spawn(args);
}

pid_t ct_start_kv_worker(env *e, const char *max_batch, const char *name)
{
    return ct_kv_worker(e, max_batch, name, NULL);
}

rekv_kvstore_client *ct_kv_open(env *e)
{
    rekv_kvstore_client *k = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_client_connect(e->kv, NULL, 20000, &k, &err) == 0, "%s", err.msg);
    return k;
}

void ct_kv_stats(rekv_kvstore_client *k, rekv_kv_stats *st)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_stats(k, st, &err) == 0, "%s", err.msg);
}

rekv_ctl *ct_ctl_open(const char *ep)
{
    rekv_ctl *c = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_connect(ep, NULL, &c, &err) == 0, "%s", err.msg);
    return c;
}

Rekv__Control__Response *ct_health(rekv_ctl *c)
{
    Rekv__Control__HealthRequest h = REKV__CONTROL__HEALTH_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_HEALTH;
    rq.health = &h;
    return tu_ctl_call(c, &rq);
}

void ct_wait_workers(rekv_ctl *c, uint32_t n)
{
    for (;;) {
        Rekv__Control__Response *r = ct_health(c);
        uint32_t w = r->health ? r->health->workers : 0;
        rekv__control__response__free_unpacked(r, NULL);
        if (w == n)
            return;
        usleep(20000);
    }
}

pid_t ct_rekv_run_start(env *e, const char *host_bytes, const char *max_batch, const char *mode)
{
    return ct_rekv_run_start_args(e, host_bytes, max_batch, mode, NULL);
}

pid_t ct_rekv_run_start_args(env *e, const char *host_bytes, const char *max_batch,
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

void ct_rekv_run_stop(pid_t pid)
{
    kill(pid, SIGINT);
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rekv run exit status %d", status);
}

Rekv__Control__Response *ct_stats(rekv_ctl *c)
{
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    return tu_ctl_call(c, &rq);
}

uint64_t ct_worker_spill_room(rekv_ctl *c)
{
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_uint_eq(r->stats->n_workers, 1);
    uint64_t room = r->stats->workers[0]->store_spill_room_bytes;
    rekv__control__response__free_unpacked(r, NULL);
    return room;
}
