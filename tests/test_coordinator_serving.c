/* test_coordinator_serving.c — the multi-process path end to end: `rekv run` (kvstore,
 * gpuworker, coordinator) serving 64 concurrent jobs whose tokens equal rekv_generate's in this
 * process; the batcher alone against rekv_generate (chunked prefill too); prefill chunks and a
 * device part in serving; a push between processes; malformed, oversized and multi-frame requests
 * (error replies); a burst of submissions against a small queue (BUSY replies, every accepted job
 * completes).
 * With real daemons and real sockets (tests/co_env.h starts them); the other coordinator suites:
 * test_coordinator_{serving,modes,failures,admission}. Model: stories260K (a bigger synthetic one
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
#include "tests/co_env.h"

/* ---------------------------------------------------------------- tests */

/* The batcher alone, in pipeline mode `mode` with prefill chunks of `chunk` tokens (0: whole
 * prompts): jobs joining at different steps give rekv_generate's tokens, and a prompt longer than
 * the chunk spends a step per extra chunk without a token. */
static void batcher_run(const char *m, rekv_mode mode, int chunk)
{
    enum { N = 24 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 4, 512, 7);
    ct_reference(jobs, N, m);
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
    ct_free_jobs(jobs, N);
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
START_TEST(run_64_jobs)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 64 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 8, 512, 1);
    ct_reference(jobs, N, e.model);
    pid_t pid = ct_rekv_run_start(&e, "16M", "32", NULL);
    /* the control socket is our group's at most (its directory, $XDG_RUNTIME_DIR, is ours) */
    struct stat st;
    ck_assert_int_eq(stat(e.ctl + 6, &st), 0);
    ck_assert_int_eq(st.st_mode & 0777, 0660);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    uint64_t t0 = rekv_now_ns();
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    ct_wait_and_check(c, jobs, N);
    double dt = (double)(rekv_now_ns() - t0) * 1e-9;
    Rekv__Control__Response *r = ct_stats(c);
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
    ct_rekv_run_stop(pid);
    ck_assert_int_ne(access(e.ctl + 6, F_OK), 0);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
}
END_TEST

/* Waits until some job of jobs[] has produced tokens; returns its index. */

/* Chunked prefill served: `rekv run --prefill-chunk 4` runs a 40-token prompt as ten steps of
 * four tokens (the tenth samples the first token), a 3-token one in one step, and the jobs get
 * rekv_generate's tokens; mixing chunks with running decodes is batcher_chunked_prefill's. */
START_TEST(chunked_prefill_served)
{
    env e;
    if (ct_env_open(&e))
        return;
    static tjob jobs[2];
    ct_make_jobs(jobs, 2, 4, 512, 21);
    jobs[0].n_prompt = 3, jobs[0].gp.max_new_tokens = 30, jobs[0].gp.stop_at_eos = 0;
    jobs[1].n_prompt = 40, jobs[1].gp.max_new_tokens = 5, jobs[1].gp.stop_at_eos = 0;
    ct_reference(jobs, 2, e.model);
    const char *extra[] = {"--prefill-chunk", "4", NULL};
    pid_t pid = ct_rekv_run_start_args(&e, "64M", "8", "offload", extra);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    uint64_t steps[2];
    for (int j = 0; j < 2; j++) {
        ck_assert_int_eq(ct_submit_all(c, &jobs[j], 1), 1);
        ct_wait_and_check(c, &jobs[j], 1);
        Rekv__Control__Response *r = ct_stats(c);
        steps[j] = r->stats->workers[0]->steps;
        rekv__control__response__free_unpacked(r, NULL);
    }
    ck_assert_uint_eq(steps[0], 30);            /* one prompt step, 29 decode steps */
    ck_assert_uint_eq(steps[1] - steps[0], 14); /* ten chunks, 4 decode steps */
    rekv_ctl_close(c);
    ct_rekv_run_stop(pid);
    ct_free_jobs(jobs, 2);
    ct_env_close(&e);
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
        if (ct_env_open(&e))
            return;
        enum { N = 6 };
        static tjob jobs[N];
        ct_make_jobs(jobs, N, 8, 512, 33);
        ct_reference(jobs, N, e.model);
        const char *extra[] = {"--device-memory", "64M", NULL};
        pid_t pid = ct_rekv_run_start_args(&e, "64M", "4", "hybrid", withdev ? extra : NULL);
        rekv_ctl *c = ct_ctl_open(e.ctl);
        ct_wait_workers(c, 1);
        ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
        ct_wait_and_check(c, jobs, N);
        Rekv__Control__Response *r = ct_stats(c);
        act_bytes[withdev] = r->stats->h2d_bytes_act;
        kv_bytes[withdev] = r->stats->h2d_bytes_kv;
        /* the worker said how much it keeps (and rekv stats shows it) */
        ck_assert_int_eq(r->stats->n_workers, 1);
        ck_assert_msg((r->stats->workers[0]->device_tokens > 0) == withdev,
                      "device part %u tokens %s device room", r->stats->workers[0]->device_tokens,
                      withdev ? "with" : "without");
        rekv__control__response__free_unpacked(r, NULL);
        rekv_ctl_close(c);
        ct_rekv_run_stop(pid);
        ct_free_jobs(jobs, N);
        ct_env_close(&e);
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

/* The push path between the real daemons: rekv run --push starts the kvstore with a push backend
 * and the worker in push mode, so the store process writes every KV row into the worker's
 * exported buffers; the jobs' tokens are exactly rekv_generate's. */
START_TEST(push_between_processes)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 12 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 8, 512, 13);
    ct_reference(jobs, N, e.model);
    const char *extra[] = {"--push", NULL};
    pid_t pid = ct_rekv_run_start_args(&e, "64M", "8", "kvpr", extra);
    rekv_kvstore_client *k = ct_kv_open(&e);
    char name[16] = "";
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_push(k, NULL, 0, NULL, NULL, NULL, 0, name, sizeof(name), &err) == 0,
                  "the store cannot push: %s", err.msg);
    ck_assert_str_eq(name, "cpu");
    rekv_kvstore_client_close(k);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    ct_wait_and_check(c, jobs, N);
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_str_eq(r->stats->workers[0]->mode, "kvpr");
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ct_rekv_run_stop(pid);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
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
    if (ct_env_open(&e))
        return;
    pid_t co = ct_start_coordinator(&e, "256", "2000");
    rekv_ctl *c = ct_ctl_open(e.ctl);
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
    Rekv__Control__Response *r = tu_ctl_call(c, &rs);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    rekv__control__response__free_unpacked(r, NULL);
    s.prompt_text = "hello";
    rs.id = 0;
    r = tu_ctl_call(c, &rs);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__BAD_REQUEST && strstr(r->error, "tokenizer"),
                  "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    r = tu_ctl_status(c, 123456);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    rekv__control__response__free_unpacked(r, NULL);
    /* a frame above the transport limit cuts that connection, nothing more */
    size_t huge = 20u << 20;
    char *hb = calloc(1, huge);
    const void *f5[] = {hb};
    ck_assert_int_eq(rekv_ctl_send_raw(c, f5, &huge, 1, &err), 0);
    free(hb);
    rekv_ctl_close(c);
    c = ct_ctl_open(e.ctl);
    r = ct_health(c);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    ck_assert(r->health->serving);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&e);
}
END_TEST

/* 10,000 submissions at once against a queue of 256: BUSY replies, bounded memory, and every
 * accepted job completes with rekv_generate's tokens. */
START_TEST(busy_queue)
{
    env e;
    if (ct_env_open(&e))
        return;
    enum { N = 10000 };
    tjob *jobs = calloc(N, sizeof(tjob));
    ct_make_jobs(jobs, N, 1, 512, 4);
    for (int i = 0; i < N; i++)
        jobs[i].gp.max_new_tokens = 1 + i % 4;
    pid_t co = ct_start_coordinator(&e, "256", "5000");
    pid_t wk = ct_start_worker(&e, "32");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    int acc = ct_submit_all(c, jobs, N);
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
    ct_reference(a, acc, e.model);
    ct_wait_and_check(c, a, acc);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_free_jobs(a, acc);
    free(a);
    free(jobs);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("coordinator_serving");
    TCase *tc;
    tc = tcase_create("coordinator");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, batcher_matches_generate);
    tcase_add_test(tc, batcher_chunked_prefill);
    tcase_add_test(tc, chunked_prefill_served);
    tcase_add_test(tc, device_part_in_serving);
    tcase_add_test(tc, run_64_jobs);
    tcase_add_test(tc, push_between_processes);
    tcase_add_test(tc, malformed_requests);
    tcase_add_test(tc, busy_queue);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
