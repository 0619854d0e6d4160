/* test_coordinator_modes.c — the coordinator deciding modes: the planner in the serving
 * loop, an emulated GPU in auto mode, and a worker that says Hello with mode "auto" getting its
 * mode from the coordinator (Assign) and not served until it says Hello again with it (InfiniGen
 * only where allowed).
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

/* The planner in the loop: with the KV cache in the kvstore (kvpr and hybrid modes) the
 * coordinator chooses every step's split, pattern and mini-batches from the worker's profile and
 * adapts to its measured busy times — and the jobs' tokens stay exactly rekv_generate's. */
START_TEST(planner_in_the_loop)
{
    const char *modes[] = {"kvpr", "hybrid"};
    for (int mi = 0; mi < 2; mi++) {
        env e;
        if (ct_env_open(&e))
            return;
        enum { N = 24 };
        static tjob jobs[N];
        ct_make_jobs(jobs, N, 8, 512, 7 + (uint64_t)mi);
        ct_reference(jobs, N, e.model);
        pid_t pid = ct_rekv_run_start(&e, "64M", "16", modes[mi]);
        rekv_ctl *c = ct_ctl_open(e.ctl);
        ct_wait_workers(c, 1);
        ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
        ct_wait_and_check(c, jobs, N);
        Rekv__Control__Response *r = ct_stats(c);
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
        ct_rekv_run_stop(pid);
        ct_free_jobs(jobs, N);
        ct_env_close(&e);
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
    if (ct_env_open(&e))
        return;
    enum { N = 16 };
    static tjob jobs[N];
    ct_make_jobs(jobs, N, 8, 512, 11);
    ct_reference(jobs, N, e.model);
    const char *extra[] = {"--link-gbps", "1", "--device-memory", "3M", NULL};
    pid_t pid = ct_rekv_run_start_args(&e, "64M", "16", NULL, extra);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_int_eq(ct_submit_all(c, jobs, N), N);
    ct_wait_and_check(c, jobs, N);
    Rekv__Control__Response *r = ct_stats(c);
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
    ct_rekv_run_stop(pid);
    ct_free_jobs(jobs, N);
    ct_env_close(&e);
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
    if (ct_env_open(&e))
        return;
    pid_t co = ct_start_coordinator(&e, "64", "10000");
    rekv_ctl *c = ct_ctl_open(e.ctl);
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
    rekv_plan_model pm = {4096, 4096, 4096, 32, (double)h.layer_params, 2, 0, 0};
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
    ct_wait_workers(c, 0);                           /* asking for a mode does not make a worker */

    h.mode = (char *)by_tech[pick.tech];
    Rekv__Worker__CoordMsg *m = hello_answer(sock, &h);
    ck_assert(m != NULL && m->body_case == REKV__WORKER__COORD_MSG__BODY_WELCOME);
    rekv__worker__coord_msg__free_unpacked(m, NULL);
    ct_wait_workers(c, 1);
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_str_eq(r->stats->workers[0]->mode, by_tech[pick.tech]);
    rekv__control__response__free_unpacked(r, NULL);

    zmq_close(sock);
    zmq_ctx_term(zctx);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&e);
}
END_TEST

/* An approximate mode is opt-in: the same worker behind a slow link, asking for its mode, is
 * assigned infinigen when its Hello says approximate and an exact mode (the one the planner picks
 * without approximation) when it does not; a Hello with mode "infinigen" makes it a worker that
 * runs so. */
START_TEST(coordinator_assigns_infinigen_only_when_allowed)
{
    env e;
    if (ct_env_open(&e))
        return;
    pid_t co = ct_start_coordinator(&e, "64", "10000");
    rekv_ctl *c = ct_ctl_open(e.ctl);
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
    rekv_plan_model pm = {4096, 4096, 4096, 32, (double)h.layer_params, 2, 0, 0};
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
    ct_wait_workers(c, 0);

    h.mode = "infinigen"; /* the worker built its pipeline so and says Hello again */
    Rekv__Worker__CoordMsg *m = hello_answer(sock, &h);
    ck_assert(m != NULL && m->body_case == REKV__WORKER__COORD_MSG__BODY_WELCOME);
    rekv__worker__coord_msg__free_unpacked(m, NULL);
    ct_wait_workers(c, 1);
    Rekv__Control__Response *r = ct_stats(c);
    ck_assert_str_eq(r->stats->workers[0]->mode, "infinigen");
    rekv__control__response__free_unpacked(r, NULL);

    zmq_close(sock);
    zmq_ctx_term(zctx);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("coordinator_modes");
    TCase *tc;
    tc = tcase_create("coordinator");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, planner_in_the_loop);
    tcase_add_test(tc, emulated_gpu_auto_mode);
    tcase_add_test(tc, coordinator_assigns_worker_mode);
    tcase_add_test(tc, coordinator_assigns_infinigen_only_when_allowed);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
