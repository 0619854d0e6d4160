/* test_co_guards_worker.c — what the coordinator refuses from a worker, with the real
 * rekv-coordinator on real ZeroMQ sockets and the test speaking worker.proto itself on a DEALER
 * (a worker that says and returns what a broken or hostile one would; tests/co_guard.h): a Hello
 * with max_batch 2^32-1 is capped to REKV_WORKER_MAX_BATCH, one with no vocabulary is told to shut
 * down; token ids outside the vocabulary fail the step (the job is re-queued and run again, or
 * failed after --max-attempts, never given the ids); a worker holds two Plans at once, and a job
 * that joins in the second is not taken as lost by the first's Progress; and the worker's side: a
 * coordinator that died before its Welcome makes the worker say Hello again. */
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

/* ---------------------------------------------------------------- Hello */

/* max_batch 2^32-1 is capped (no 32 GiB table; the coordinator serves the worker); a Hello
 * without a vocabulary is answered Shutdown and makes no worker. */
START_TEST(hello_validated)
{
    env e;
    cg_env_start(&e, NULL);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    fake bad;
    cg_fake_open(&bad, e.wrk);
    Rekv__Worker__CoordMsg *cm = cg_fake_hello(&bad, 8, 0);
    ck_assert_int_eq(cm->body_case, REKV__WORKER__COORD_MSG__BODY_SHUTDOWN);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    cg_fake_close(&bad);

    fake f;
    cg_fake_welcomed(&f, e.wrk, UINT32_MAX, 512);
    Rekv__Control__Response *r = cg_stats(c);
    ck_assert_uint_eq(r->stats->n_workers, 1);
    ck_assert_uint_eq(r->stats->workers[0]->max_batch, REKV_WORKER_MAX_BATCH);
    rekv__control__response__free_unpacked(r, NULL);
    /* and it is served */
    uint64_t j = cg_submit_ok(c, 1, 0);
    cm = cg_fake_plan(&f);
    ck_assert_ptr_nonnull(cm);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    ck_assert_uint_eq(cm->plan->join[0]->job, j);
    int32_t t[] = {42};
    cg_fake_progress(&f, cm->plan->step, j, t, 1, 1, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    r = cg_wait_end(c, j);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
    rekv__control__response__free_unpacked(r, NULL);
    cg_fake_close(&f);
    rekv_ctl_close(c);
    char *log = tu_read_file(e.log, NULL);
    ck_assert_msg(log && strstr(log, "says max_batch 4294967295; it gets at most 4096"), "%s", log);
    ck_assert_msg(strstr(log, "refused: its vocabulary of 0 tokens"), "%s", log);
    free(log);
    cg_env_stop(&e);
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
    cg_env_start(&e, extra);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    fake f;
    cg_fake_welcomed(&f, e.wrk, 4, 512);

    uint64_t j = cg_submit_ok(c, 4, 0);
    Rekv__Worker__CoordMsg *cm = cg_fake_plan(&f);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    int32_t bad[] = {512};
    cg_fake_progress(&f, cm->plan->step, j, bad, 1, 0, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    cg_fake_empty(&f); /* the next step's Plan went out with the first: j was still good */
    int dropped = 0;   /* dropped in the next, and joins again once its backoff is over */
    cm = cg_fake_plan_join(&f, j, &dropped);
    ck_assert_int_eq(dropped, 1);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    ck_assert_uint_eq(cm->plan->join[0]->job, j);
    int32_t good[] = {7, 8};
    cg_fake_progress(&f, cm->plan->step, j, good, 2, 1, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    cg_fake_empty(&f); /* made before j had finished */
    Rekv__Control__Response *r = cg_wait_end(c, j);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
    ck_assert_uint_eq(r->job->attempts, 2);
    ck_assert_uint_eq(r->job->n_generated_ids, 2);
    ck_assert_int_eq(r->job->generated_ids[0], 7);
    ck_assert_int_eq(r->job->generated_ids[1], 8);
    rekv__control__response__free_unpacked(r, NULL);

    /* every attempt bad (a negative id, then one among good ones): failed, no ids */
    uint64_t k = cg_submit_ok(c, 4, 0);
    cm = cg_fake_plan(&f);
    int32_t neg[] = {-1};
    cg_fake_progress(&f, cm->plan->step, k, neg, 1, 0, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    cg_fake_empty(&f);
    dropped = 0;
    cm = cg_fake_plan_join(&f, k, &dropped);
    ck_assert_int_eq(dropped, 1);
    ck_assert_uint_eq(cm->plan->n_join, 1);
    int32_t mixed[] = {3, 100000, 4};
    cg_fake_progress(&f, cm->plan->step, k, mixed, 3, 1, 0);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    r = cg_wait_end(c, k);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__FAILED);
    ck_assert_msg(strstr(r->job->error, "token id 100000, outside the vocabulary of 512"), "%s",
                  r->job->error);
    ck_assert_uint_eq(r->job->n_generated_ids, 0);
    rekv__control__response__free_unpacked(r, NULL);
    r = cg_stats(c);
    ck_assert_uint_eq(r->stats->worker_results_rejected, 3);
    ck_assert_uint_eq(r->stats->done, 1);
    ck_assert_uint_eq(r->stats->failed, 1);
    rekv__control__response__free_unpacked(r, NULL);
    cg_fake_close(&f);
    rekv_ctl_close(c);
    cg_env_stop(&e);
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
    cg_env_start(&e, NULL);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    fake f;
    cg_fake_welcomed(&f, e.wrk, 2, 512);

    uint64_t a = cg_submit_ok(c, 1, 0);
    Rekv__Worker__CoordMsg *p1 = cg_fake_plan(&f), *p2 = cg_fake_plan(&f);
    ck_assert_msg(p1 && p2, "the second Plan did not come before the first's Progress");
    ck_assert_uint_eq(p1->plan->n_join, 1);
    ck_assert_uint_eq(p1->plan->join[0]->job, a);
    ck_assert_uint_eq(p2->plan->step, p1->plan->step + 1);
    ck_assert_uint_eq(p2->plan->n_join, 0);
    uint64_t b = cg_submit_ok(c, 1, 0);
    Rekv__Control__Response *r = tu_ctl_status(c, b);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__QUEUED);
    rekv__control__response__free_unpacked(r, NULL);

    int32_t t[] = {42};
    cg_fake_progress(&f, p1->plan->step, a, t, 1, 1, 0);
    Rekv__Worker__CoordMsg *p3 = cg_fake_plan(&f);
    ck_assert_ptr_nonnull(p3);
    ck_assert_uint_eq(p3->plan->step, p2->plan->step + 1);
    ck_assert_uint_eq(p3->plan->n_join, 1);
    ck_assert_uint_eq(p3->plan->join[0]->job, b);
    cg_fake_no_job(&f, p2->plan->step, NULL); /* step 2: no job */
    int32_t u[] = {43};
    cg_fake_progress(&f, p3->plan->step, b, u, 1, 1, 0);
    for (int i = 0; i < 2; i++) {
        r = cg_wait_end(c, i ? b : a);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
        ck_assert_uint_eq(r->job->attempts, 1);
        ck_assert_uint_eq(r->job->n_generated_ids, 1);
        ck_assert_int_eq(r->job->generated_ids[0], i ? 43 : 42);
        rekv__control__response__free_unpacked(r, NULL);
    }
    r = cg_stats(c);
    ck_assert_uint_eq(r->stats->requeued, 0);
    ck_assert_uint_eq(r->stats->steps_failed, 0);
    ck_assert_uint_eq(r->stats->steps, 2); /* that ran a job */
    rekv__control__response__free_unpacked(r, NULL);
    rekv__worker__coord_msg__free_unpacked(p1, NULL);
    rekv__worker__coord_msg__free_unpacked(p2, NULL);
    rekv__worker__coord_msg__free_unpacked(p3, NULL);
    cg_fake_close(&f);
    rekv_ctl_close(c);
    cg_env_stop(&e);
}
END_TEST

/* ---------------------------------------------------------------- a store lost between steps */

/* Job a submitted and joined by the fake worker's first Plan, which reports a token for it; the
 * second Plan is out. *p1, *p2: the two Plans (the caller frees them). */
static uint64_t a_runs_with_a_plan_out(rekv_ctl *c, fake *f, Rekv__Worker__CoordMsg **p1,
                                       Rekv__Worker__CoordMsg **p2)
{
    uint64_t a = cg_submit_ok(c, 4, 0);
    *p1 = cg_fake_plan(f);
    *p2 = cg_fake_plan(f);
    ck_assert_msg(*p1 && *p2, "the second Plan did not come before the first's Progress");
    ck_assert_uint_eq((*p1)->plan->n_join, 1);
    int32_t t[] = {42};
    cg_fake_progress(f, (*p1)->plan->step, a, t, 1, 0, 0); /* a runs on */
    return a;
}

/* Waits for the coordinator to put a job back (Check's timeout is the guard): exactly one. */
static void requeued_once(rekv_ctl *c)
{
    Rekv__Control__Response *r = NULL;
    for (int tries = 0; tries < 2000; tries++) {
        if (r)
            rekv__control__response__free_unpacked(r, NULL);
        r = cg_stats(c);
        if (r->stats->requeued > 0)
            break;
        usleep(5000);
    }
    ck_assert_uint_eq(r->stats->requeued, 1);
    rekv__control__response__free_unpacked(r, NULL);
}

/* A worker whose kvstore went between two steps dropped its batch with the store and refuses the
 * Plan that crossed its word (wk_refuse_plan): the Progress names none of the running jobs and
 * says it is unavailable. Such a job runs again without using an attempt, as after a loss under a
 * step (was: "did not report it", an attempt used, so a few store crashes could fail a job). */
START_TEST(store_lost_between_steps)
{
    env e;
    cg_env_start(&e, NULL);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    fake f;
    cg_fake_welcomed(&f, e.wrk, 2, 512);
    Rekv__Worker__CoordMsg *p1, *p2;
    uint64_t a = a_runs_with_a_plan_out(c, &f, &p1, &p2);
    /* step 2 refused: no job */
    cg_fake_no_job(&f, p2->plan->step, "its kvstore at ipc:///nowhere is gone; reconnecting");
    requeued_once(c);
    Rekv__Control__Response *r = tu_ctl_status(c, a);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__QUEUED);
    ck_assert_uint_eq(r->job->attempts, 0); /* the loss used none */
    rekv__control__response__free_unpacked(r, NULL);
    rekv__worker__coord_msg__free_unpacked(p1, NULL);
    rekv__worker__coord_msg__free_unpacked(p2, NULL);
    cg_fake_close(&f);
    rekv_ctl_close(c);
    cg_env_stop(&e);
}
END_TEST

/* The same loss, but the store comes back before the worker reads the Plan that crossed its word:
 * it says it is unavailable, then available again, then runs that Plan without the job it dropped
 * with the store. The job goes back to the queue as a store loss (no attempt), as when the Plan is
 * refused (was: "did not report it", an attempt — test_attempts store_losses_are_limited failed
 * when its kill landed so). With --max-attempts 1 an attempt used would fail the job. */
START_TEST(store_back_before_the_plan)
{
    env e;
    /* one attempt: a loss that used it fails the job at once */
    static const char *const one[] = {"--max-attempts", "1", NULL};
    cg_env_start(&e, one);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    fake f;
    cg_fake_welcomed(&f, e.wrk, 2, 512);
    Rekv__Worker__CoordMsg *p1, *p2;
    uint64_t a = a_runs_with_a_plan_out(c, &f, &p1, &p2);
    Rekv__Worker__Heartbeat hb = REKV__WORKER__HEARTBEAT__INIT;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    m.unavailable = "its kvstore at ipc:///nowhere is gone; reconnecting";
    cg_fake_send(&f, &m); /* the store lost between steps, the batch with it */
    m.unavailable = "";
    cg_fake_send(&f, &m); /* back before the Plan is read */
    cg_fake_no_job(&f, p2->plan->step, NULL); /* step 2 ran without a */
    requeued_once(c);
    Rekv__Control__Response *r = tu_ctl_status(c, a);
    /* the loss used no attempt: with one allowed, one used would have failed the job */
    ck_assert_msg(r->job->state != REKV__CONTROL__JOB_STATE__FAILED, "failed: %s", r->job->error);
    rekv__control__response__free_unpacked(r, NULL);
    rekv__worker__coord_msg__free_unpacked(p1, NULL);
    rekv__worker__coord_msg__free_unpacked(p2, NULL);
    cg_fake_close(&f);
    rekv_ctl_close(c);
    cg_env_stop(&e);
}
END_TEST

/* ---------------------------------------------------------------- log flood */

/* A coordinator that got a worker's Hello and died before its Welcome: the next one knows the
 * worker only by its heartbeats and answers them Reset; the worker, long past its Hello, says
 * Hello again (was: it ignored every Reset while awaiting a Welcome that could never come). */
START_TEST(gpuworker_hello_lost_with_its_coordinator)
{
    fake_co f;
    if (cg_fake_co_start(&f))
        return;
    /* the coordinator dies unanswered; another takes the endpoint */
    zmq_close(f.sock);
    f.sock = cg_fake_co_bind(&f);
    Rekv__Worker__Reset rs = REKV__WORKER__RESET__INIT;
    Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
    cm.version = REKV_WORKER_PROTO_VERSION;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_RESET;
    cm.reset = &rs;
    uint8_t buf[64];
    size_t n = rekv__worker__coord_msg__pack(&cm, buf);
    int hellos = 0, resets = 0;
    while (!hellos) { /* Check's timeout is the guard */
        Rekv__Worker__WorkerMsg *wm = cg_router_recv(f.sock, f.id, &f.idn);
        ck_assert_msg(wm != NULL, "the worker went silent");
        if (wm->body_case == REKV__WORKER__WORKER_MSG__BODY_HELLO) {
            hellos++;
        } else { /* as the coordinator answers a worker it does not know */
            cg_fake_co_send(&f, buf, n);
            resets++;
        }
        rekv__worker__worker_msg__free_unpacked(wm, NULL);
    }
    ck_assert_msg(hellos == 1, "no Hello again after %d Resets", resets);
    ck_assert_int_ge(resets, 1);
    cg_fake_co_stop(&f);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("co_guards_worker");
    TCase *tc;
    tc = tcase_create("co_guards");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, hello_validated);
    tcase_add_test(tc, out_of_vocab_tokens_refused);
    tcase_add_test(tc, two_plans_out);
    tcase_add_test(tc, store_lost_between_steps);
    tcase_add_test(tc, store_back_before_the_plan);
    tcase_add_test(tc, gpuworker_hello_lost_with_its_coordinator);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
