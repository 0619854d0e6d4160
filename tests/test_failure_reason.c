/* test_failure_reason.c — a failed step carries its own reason. Two blocks lost on read-back
 * (a byte flipped in the spill file, CRC32C mismatch), of two different jobs' kvstore sequences at
 * two different steps, with the real rekv-kvstore, rekv-gpuworker and rekv-coordinator on real
 * sockets: the worker's line for each victim's failed step names its own sequence, layer and block
 * (not the first failure's: the worker's step error is cleared per step); each victim runs again
 * from its prompt using an attempt, and every job ends once, DONE, with rekv_generate's tokens. The
 * spill file is corrupted as test_faults' crc_mismatch_reruns_its_job does it (which corrupts one block; tests/spill_fault.c). Outcomes and
 * counts are asserted; waits are only failure timeouts. Model: stories260K. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
    char ctl[4200], wrk[4200], state[4200], kv[4200], spill[4200];
    char co_log[4200], wk_log[4200], kv_log[4200];
    char model[4096];
} env;

/* The three daemons: a store with a small arena spilling down to 5% between steps once above
 * 10% (blocks go to disk), a coordinator with attempts to spare (the others of each failed step
 * run again), a worker w0 on the cpu backend in offload mode whose debug log names each job's
 * kvstore sequence. */
static void start_all(env *e, pid_t *kv, pid_t *co, pid_t *wk)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *ka[] = {prog, "--endpoint",    e->kv,    "--model",     e->model, "--host-bytes",
                        "2M", "--cache-dtype", "f32",    "--high-pct",  "10",     "--low-pct",
                        "5",  "--lease-ms",    "600000", "--spill-dir", e->spill, NULL};
    *kv = tu_spawn(ka, e->kv_log, NULL);
    ck_assert_msg(*kv > 0, "rekv-kvstore exited at start");
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *ca[] = {
        prog,          "--control",      e->ctl,    "--workers", e->wrk,
        "--state-dir", e->state,         "--queue", "64",        "--worker-timeout-ms",
        "600000",      "--max-attempts", "8",       NULL};
    *co = tu_spawn(ca, e->co_log, NULL);
    ck_assert_msg(*co > 0, "rekv-coordinator exited at start");
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *wa[] = {
        prog,     "--model",   e->model,  "--coordinator", e->wrk, "--name",
        "w0",     "--backend", "cpu",     "--max-batch",   "8",    "--heartbeat-ms",
        "100",    "--mode",    "offload", "--kvstore",     e->kv,  "--kvstore-timeout-ms",
        "600000", NULL};
    setenv("REKV_LOG", "debug", 1);
    *wk = tu_spawn(wa, e->wk_log, NULL);
    unsetenv("REKV_LOG");
    ck_assert_msg(*wk > 0, "rekv-gpuworker exited at start");
}

/* ---------------------------------------------------------------- jobs and their client */

typedef struct fjob {
    int32_t prompt[16];
    int n_prompt;
    rekv_gen_params gp;
    rekv_gen_result ref; /* rekv_generate in this process */
    uint64_t id;
    int32_t got[MAX_NEW]; /* tokens streamed so far, by offset */
    uint32_t n_got;
    int ends; /* final events seen */
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
        j->gp.seed = 91 + (uint64_t)i;
        ck_assert_msg(rekv_generate(en, j->prompt, j->n_prompt, &j->gp, &j->ref, &err) == 0, "%s",
                      err.msg);
    }
    rekv_engine_free(en);
    rekv_model_close(m);
}

/* Takes in one stream event: tokens agree with what came before, one final event a job. */
static void take_event(fjob *jobs, const Rekv__Control__StreamEvent *ev)
{
    fjob *j = NULL;
    for (int i = 0; i < N_JOBS; i++)
        if (jobs[i].id == ev->job)
            j = &jobs[i];
    ck_assert_msg(j != NULL, "an event for job %llu, not ours", (unsigned long long)ev->job);
    ck_assert_msg(ev->offset <= j->n_got, "job %llu: tokens from %u, we have %u",
                  (unsigned long long)ev->job, ev->offset, j->n_got);
    for (size_t t = 0; t < ev->n_tokens; t++) {
        uint32_t at = ev->offset + (uint32_t)t;
        ck_assert(at < MAX_NEW);
        if (at < j->n_got)
            ck_assert_int_eq(j->got[at], ev->tokens[t]);
        else
            j->got[j->n_got++] = ev->tokens[t];
    }
    if (!ev->done)
        return;
    ck_assert_msg(++j->ends == 1, "job %llu ended twice", (unsigned long long)ev->job);
    ck_assert_msg(ev->state == REKV__CONTROL__JOB_STATE__DONE, "job %llu ended %s: %s",
                  (unsigned long long)ev->job, rekv_ctl_state_name(ev->state), ev->error);
}

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
        Rekv__Control__Request r = REKV__CONTROL__REQUEST__INIT;
        r.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
        r.submit = &s;
        rekv_err err = {0};
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
                jobs[i].id = r->submitted->job;
                got++;
            } else if (r->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT) {
                take_event(jobs, r->event);
            }
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
}

/* Reads stream events until `tokens` tokens in all have come, or (tokens 0) until every job
 * ended. */
static void follow(rekv_ctl *c, fjob *jobs, uint32_t tokens)
{
    for (;;) {
        uint32_t have = 0;
        int n_ended = 0;
        for (int i = 0; i < N_JOBS; i++) {
            have += jobs[i].n_got;
            n_ended += jobs[i].ends;
        }
        if (tokens ? have >= tokens : n_ended == N_JOBS)
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

static uint32_t tokens_in_all(const fjob *jobs)
{
    uint32_t have = 0;
    for (int i = 0; i < N_JOBS; i++)
        have += jobs[i].n_got;
    return have;
}

/* ---------------------------------------------------------------- corrupting a job's block */

/* 1 when a line of the file at path holds both a and b. */
static int log_line_has(const char *path, const char *a, const char *b)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    char buf[4096];
    int found = 0;
    while (!found && fgets(buf, sizeof(buf), f))
        found = strstr(buf, a) && strstr(buf, b);
    fclose(f);
    return found;
}

/* Corrupts a block of victim's current sequence (its joins-th join: it ran again after an earlier
 * failure) and runs until the worker said the victim runs again, naming the sequence, layer and
 * block. */
static void corrupt_and_rerun(env *e, rekv_ctl *s, fjob *jobs, fjob *victim, int joins, pid_t kv,
                             pid_t wk, rekv_kvstore_client *kc)
{
    uint64_t seq = 0;
    while (sf_job_store_seq(e->wk_log, victim->id, &seq) < joins) /* Check's timeout guards */
        follow(s, jobs, tokens_in_all(jobs) + 1);
    int fd = tu_spill_fd(kv, e->spill);
    ck_assert_msg(fd >= 0, "no spill file among the kvstore's open files");
    uint32_t layer = 0;
    uint64_t block = 0;
    for (int tries = 0;; tries++) {
        ck_assert_msg(tries < 200, "job %llu never had a block on disk",
                      (unsigned long long)victim->id);
        kill(wk, SIGSTOP);
        ck_assert_msg(victim->ends == 0 && (int)victim->n_got + 8 < victim->ref.n,
                      "job %llu is about to end before its block was corrupted",
                      (unsigned long long)victim->id);
        if (sf_flip_disk_block(kc, fd, seq, &layer, &block))
            break;
        kill(wk, SIGCONT);
        follow(s, jobs, tokens_in_all(jobs) + N_JOBS);
    }
    close(fd);
    kill(wk, SIGCONT);
    char want[160], line[96];
    snprintf(want, sizeof(want),
             "sequence %llu layer %u block %llu: read-back failed: CRC32C "
             "mismatch",
             (unsigned long long)seq, layer, (unsigned long long)block);
    snprintf(line, sizeof(line), "job %llu runs again from its prompt, using an attempt",
             (unsigned long long)victim->id);
    while (!log_line_has(e->wk_log, line, want)) { /* Check's timeout guards */
        ck_assert_msg(victim->ends == 0, "job %llu ended before the worker said \"%s\" with \"%s\"",
                      (unsigned long long)victim->id, line, want);
        follow(s, jobs, tokens_in_all(jobs) + 1);
    }
}

/* Job 2's block is corrupted first, job 5's once job 2's step failed (job 5 runs again on a new
 * sequence by then): the worker's line for each names its own block (not the first failure's),
 * each runs again using an attempt, every job ends DONE with rekv_generate's tokens (the victims'
 * re-runs recompute what was lost) and the store counted two CRC errors. */
START_TEST(two_lost_blocks_two_reasons)
{
    env e;
    const char *m = tu_shared(MODEL_REL);
    if (m == NULL)
        return;
    snprintf(e.model, sizeof(e.model), "%s", m);
    e.dir = tu_tmpdir();
    snprintf(e.ctl, sizeof(e.ctl), "ipc://%s/control", e.dir);
    snprintf(e.wrk, sizeof(e.wrk), "ipc://%s/workers", e.dir);
    snprintf(e.state, sizeof(e.state), "%s/state", e.dir);
    snprintf(e.kv, sizeof(e.kv), "ipc://%s/kvstore", e.dir);
    snprintf(e.spill, sizeof(e.spill), "%s/spill", e.dir);
    snprintf(e.co_log, sizeof(e.co_log), "%s/coordinator.log", e.dir);
    snprintf(e.wk_log, sizeof(e.wk_log), "%s/worker.log", e.dir);
    snprintf(e.kv_log, sizeof(e.kv_log), "%s/kvstore.log", e.dir);
    ck_assert_int_eq(mkdir(e.spill, 0700), 0);
    static fjob jobs[N_JOBS];
    make_jobs(jobs, e.model);
    fjob *a = &jobs[2], *b = &jobs[5];
    pid_t kv, co, wk;
    start_all(&e, &kv, &co, &wk);
    rekv_ctl *c = tu_ctl_open(e.ctl), *s = tu_ctl_open(e.ctl);
    tu_ctl_wait_workers(c, 1);
    submit_all(s, jobs);
    follow(s, jobs, 24 * N_JOBS); /* two blocks a layer: above the high watermark */
    rekv_kvstore_client *kc = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_client_connect(e.kv, NULL, 20000, &kc, &err) == 0, "%s", err.msg);
    corrupt_and_rerun(&e, s, jobs, a, 1, kv, wk, kc);
    ck_assert_msg(b->ends == 0, "job %llu ended with job %llu's failure", (unsigned long long)b->id,
                  (unsigned long long)a->id);
    corrupt_and_rerun(&e, s, jobs, b, 2, kv, wk, kc);
    follow(s, jobs, 0);
    for (int i = 0; i < N_JOBS; i++) {
        fjob *j = &jobs[i];
        ck_assert_int_eq(j->ends, 1);
        ck_assert_msg((int)j->n_got == j->ref.n &&
                          memcmp(j->got, j->ref.ids, sizeof(int32_t) * (size_t)j->ref.n) == 0,
                      "job %d: the streamed tokens are not rekv_generate's", i);
        Rekv__Control__Response *r = tu_ctl_status(c, j->id);
        ck_assert_msg(r->job->attempts == (j == a || j == b ? 2u : 1u), "job %d used %u attempts",
                      i, r->job->attempts);
        rekv__control__response__free_unpacked(r, NULL);
    }
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_uint_eq(r->stats->accepted, N_JOBS);
    ck_assert_uint_eq(r->stats->done, N_JOBS);
    ck_assert_uint_eq(r->stats->failed, 0);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_kv_stats st;
    ck_assert_msg(rekv_kvstore_stats(kc, &st, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(st.crc_errors, 2);
    rekv_kvstore_client_close(kc);
    rekv_ctl_close(c);
    rekv_ctl_close(s);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    ck_assert_int_eq(tu_stop(kv), 0);
    for (int i = 0; i < N_JOBS; i++)
        rekv_gen_result_free(&jobs[i].ref);
    tu_rmrf(e.dir);
    free(e.dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("failure_reason");
    TCase *tc = tcase_create("failure_reason");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, two_lost_blocks_two_reasons);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
