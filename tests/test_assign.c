/* test_assign.c — the coordinator decides what a worker is built with (worker.proto Hello, Assign,
 * Hello, Welcome): every worker's first Hello asks — with mode "auto" or its --mode — and carries
 * what the planner needs (its profile, the device's room, the model's shape, --device-tokens);
 * the Assign names the mode, the device-resident part (rekv_plan_device_tokens) and CLO's N_p
 * (rekv_plan_persist_np); the worker builds its pipeline with exactly those and says so in its
 * second Hello. The real rekv-kvstore and rekv-gpuworker run against a coordinator played here
 * (a ROUTER socket: it sees the Hellos and answers what it likes), and against the real
 * rekv-coordinator, whose `rekv stats` shows each worker's device part; the planner's sizing of
 * infinigen's partial keys is checked against the pipeline's and the skew's. */
#define _GNU_SOURCE
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/cost.h"
#include "coordinator/co_plan.h"
#include "coordinator/coordinator.h"
#include "coordinator/planner.h"
#include "gpuworker/device/backend.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "loader/loader.h"
#include "proto/worker.pb-c.h"
#include "tests/testutil.h"

#define MAX_BATCH "4"
#define DEVICE_MEMORY "6M"

/* A small OPT whose KV cache per token (8 layers) outweighs a step's streaming buffers per token,
 * so that a device between the two holds a part of each context without holding it all. */
static const rekv_synth_spec spec = {REKV_ARCH_OPT,  8, 64, 4, 4, 256, 512, 256,
                                     REKV_DTYPE_F32, 5, 1};

typedef struct env {
    char *dir;
    char model[4200], kv[4200], wrk[4200], ctl[4200], state[4200], log[4200];
    pid_t kvstore;
} env;

static pid_t start_kvstore(env *e)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *args[] = {prog,           "--endpoint", e->kv,           "--model", e->model,
                          "--host-bytes", "64M",        "--cache-dtype", "f32",     NULL};
    pid_t pid = tu_spawn(args, e->log, NULL);
    ck_assert_msg(pid > 0, "rekv-kvstore: %s", tu_log_end(e->log));
    return pid;
}

static void env_open(env *e)
{
    e->dir = tu_tmpdir();
    snprintf(e->model, sizeof(e->model), "%s/model", e->dir);
    snprintf(e->kv, sizeof(e->kv), "ipc://%s/kvstore", e->dir);
    snprintf(e->wrk, sizeof(e->wrk), "ipc://%s/workers", e->dir);
    snprintf(e->ctl, sizeof(e->ctl), "ipc://%s/control", e->dir);
    snprintf(e->state, sizeof(e->state), "%s/state", e->dir);
    snprintf(e->log, sizeof(e->log), "%s/log", e->dir);
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(&spec, e->model, &err) == 0, "%s", err.msg);
    e->kvstore = start_kvstore(e);
}

static void env_close(env *e)
{
    tu_stop(e->kvstore);
    tu_rmrf(e->dir);
    free(e->dir);
}

/* rekv-gpuworker on the cpu backend with an emulated device of DEVICE_MEMORY; mode NULL: auto;
 * dev_tokens NULL: the planner's part. */
static pid_t start_worker(env *e, const char *name, const char *mode, const char *dev_tokens)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[24] = {
        prog,      "--model",         e->model,      "--coordinator",  e->wrk, "--kvstore",
        e->kv,     "--backend",       "cpu",         "--name",         name,   "--max-batch",
        MAX_BATCH, "--device-memory", DEVICE_MEMORY, "--heartbeat-ms", "100",  NULL};
    int n = 17;
    args[n++] = "--mode";
    args[n++] = mode ? mode : "auto";
    if (dev_tokens) {
        args[n++] = "--device-tokens";
        args[n++] = dev_tokens;
    }
    pid_t pid = tu_spawn(args, e->log, NULL);
    ck_assert_msg(pid > 0, "rekv-gpuworker: %s", tu_log_end(e->log));
    return pid;
}

/* ---------------------------------------------------------------- the coordinator played here */

typedef struct fake {
    void *zctx, *sock;
    uint8_t id[256];
    size_t id_n;
} fake;

static void fake_open(fake *f, const char *ep)
{
    memset(f, 0, sizeof(*f));
    f->zctx = zmq_ctx_new();
    f->sock = zmq_socket(f->zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(f->sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_bind(f->sock, ep), 0);
}

static void fake_close(fake *f)
{
    zmq_close(f->sock);
    zmq_ctx_term(f->zctx);
}

/* The worker's next message within ms milliseconds, or NULL; the caller frees it. */
static Rekv__Worker__WorkerMsg *fake_recv(fake *f, int ms)
{
    zmq_pollitem_t it = {f->sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, ms) != 1)
        return NULL;
    zmq_msg_t id, body;
    zmq_msg_init(&id);
    zmq_msg_init(&body);
    ck_assert(zmq_msg_recv(&id, f->sock, 0) >= 0 && zmq_msg_more(&id));
    ck_assert(zmq_msg_recv(&body, f->sock, 0) >= 0);
    ck_assert(zmq_msg_size(&id) <= sizeof(f->id));
    f->id_n = zmq_msg_size(&id);
    memcpy(f->id, zmq_msg_data(&id), f->id_n);
    Rekv__Worker__WorkerMsg *m =
        rekv__worker__worker_msg__unpack(NULL, zmq_msg_size(&body), zmq_msg_data(&body));
    zmq_msg_close(&id);
    zmq_msg_close(&body);
    ck_assert(m != NULL);
    return m;
}

/* The worker's next message of this body (others skipped), within 120 s (a clo pipeline profiles
 * the model's heads first); the caller frees it. */
static Rekv__Worker__WorkerMsg *fake_expect(fake *f, Rekv__Worker__WorkerMsg__BodyCase body)
{
    for (int tries = 0; tries < 2400; tries++) {
        Rekv__Worker__WorkerMsg *m = fake_recv(f, 50);
        if (m && m->body_case == body)
            return m;
        if (m)
            rekv__worker__worker_msg__free_unpacked(m, NULL);
    }
    ck_abort_msg("no message %d from the worker", (int)body);
    return NULL;
}

static Rekv__Worker__WorkerMsg *fake_hello(fake *f)
{
    return fake_expect(f, REKV__WORKER__WORKER_MSG__BODY_HELLO);
}

/* Waits (up to 60 s) until the worker's messages say it is unavailable, or that it is not. */
static void fake_wait_available(fake *f, int available)
{
    for (int tries = 0; tries < 1200; tries++) {
        Rekv__Worker__WorkerMsg *m = fake_recv(f, 50);
        int is = m && (m->unavailable == NULL || m->unavailable[0] == '\0');
        if (m)
            rekv__worker__worker_msg__free_unpacked(m, NULL);
        if (m && is == available)
            return;
    }
    ck_abort_msg("the worker never said it is %s", available ? "available" : "unavailable");
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

static void fake_assign(fake *f, const char *mode, uint32_t device_tokens, double persist_np)
{
    Rekv__Worker__Assign a = REKV__WORKER__ASSIGN__INIT;
    a.mode = (char *)mode;
    a.reason = "test_assign";
    a.device_tokens = device_tokens;
    a.persist_np = persist_np;
    Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
    m.body_case = REKV__WORKER__COORD_MSG__BODY_ASSIGN;
    m.assign = &a;
    fake_send(f, &m);
}

/* What the worker's device has room for: the cpu backend with the same emulated device, less the
 * model's weights (gpuworker's start_backend). */
static double device_room(const env *e, rekv_plan_model *pm, int *head_dim, int *max_pos)
{
    rekv_err err = {0};
    rekv_link_config link = REKV_LINK_NONE;
    ck_assert_msg(rekv_link_parse(&link, "device-memory", DEVICE_MEMORY, &err) == 0, "%s", err.msg);
    rekv_backend *be = NULL;
    rekv_model *m = NULL;
    rekv_engine *eng = NULL;
    ck_assert_msg(rekv_backend_create("cpu", &link, &be, NULL, 0, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_model_open(e->model, &m, &err) == 0 &&
                      rekv_engine_create(m, &eng, &err) == 0,
                  "%s", err.msg);
    const rekv_model_config *c = rekv_engine_config(eng);
    rekv_plan_model_from_config(c, pm);
    *head_dim = c->head_dim;
    *max_pos = c->max_pos;
    double room = rekv_backend_kv_room(be, (double)rekv_engine_weight_bytes(eng));
    rekv_engine_free(eng);
    rekv_model_close(m);
    rekv_backend_destroy(be);
    return room;
}

/* The planner's part for a worker of this test in mode (f32 cache, MAX_BATCH sequences). */
static int planned_part(const env *e, rekv_mode mode)
{
    rekv_plan_model pm;
    int hd, max_pos;
    double room = device_room(e, &pm, &hd, &max_pos);
    return (int)rekv_plan_device_tokens(&pm, hd, mode, atoi(MAX_BATCH), max_pos, 4, room, -1);
}

/* A worker started with --mode offload asks (it has no pipeline yet) with what the planner needs;
 * the coordinator's planner gives the device part of its room; the worker builds with what the
 * Assign says — here a part other than the planner's, which its second Hello reports — and not
 * before the Assign. The same for --device-tokens: asked in the Hello, the Assign's built. */
START_TEST(explicit_mode_built_as_assigned)
{
    env e;
    env_open(&e);
    fake f;
    fake_open(&f, e.wrk);
    for (int given = 0; given <= 1; given++) {
        char name[32];
        snprintf(name, sizeof(name), "w%d", given);
        pid_t w = start_worker(&e, name, "offload", given ? "7" : NULL);
        Rekv__Worker__WorkerMsg *m = fake_hello(&f);
        const Rekv__Worker__Hello *h = m->hello;
        ck_assert_msg(h->ask, "the first Hello does not ask for an Assign");
        ck_assert_str_eq(h->mode, "offload");
        ck_assert_int_eq(h->device_tokens_asked, given ? 7 : -1);
        ck_assert_uint_eq(h->device_tokens, 0); /* nothing built yet */
        ck_assert_uint_eq(h->head_dim, 16);
        ck_assert(fabs(h->fetch_cap - 0.2) < 1e-6);
        ck_assert_msg(h->device_kv_room > 0, "room %g", h->device_kv_room);
        co_assign as;
        ck_assert_int_eq(co_plan_assign(h, &as), 0);
        ck_assert_int_eq(as.mode, REKV_MODE_OFFLOAD);
        ck_assert(isinf(as.persist_np));
        int part = planned_part(&e, REKV_MODE_OFFLOAD);
        ck_assert_msg(part > 0 && part < spec.max_pos, "a part of each context: %d", part);
        ck_assert_int_eq(as.device_tokens, given ? 7 : part);
        /* the worker takes the Assign's part, whatever it is */
        uint32_t sent = (uint32_t)as.device_tokens + 3;
        fake_assign(&f, "offload", sent, INFINITY);
        rekv__worker__worker_msg__free_unpacked(m, NULL);
        m = fake_hello(&f);
        h = m->hello;
        ck_assert_msg(!h->ask, "the Hello after the Assign asks again");
        ck_assert_str_eq(h->mode, "offload");
        ck_assert_uint_eq(h->device_tokens, sent);
        ck_assert(h->device_buffer_bytes > 0); /* measured once the pipeline was built */
        rekv__worker__worker_msg__free_unpacked(m, NULL);
        ck_assert_int_eq(tu_stop(w), 0);
    }
    fake_close(&f);
    env_close(&e);
}
END_TEST

/* A clo worker is assigned N_p by Eq. 12 at its max batch and the model's context, from the
 * profile and shape its Hello reports (the planner's rule over the model's config gives the same
 * count), no device part; it builds with the Assign's N_p. */
START_TEST(clo_built_with_assigned_np)
{
    env e;
    env_open(&e);
    fake f;
    fake_open(&f, e.wrk);
    pid_t w = start_worker(&e, "clo", "clo", NULL);
    Rekv__Worker__WorkerMsg *m = fake_hello(&f);
    const Rekv__Worker__Hello *h = m->hello;
    ck_assert(h->ask);
    ck_assert_str_eq(h->mode, "clo");
    co_assign as;
    ck_assert_int_eq(co_plan_assign(h, &as), 0);
    ck_assert_int_eq(as.mode, REKV_MODE_CLO);
    ck_assert_int_eq(as.device_tokens, 0);
    rekv_plan_model pm;
    int hd, max_pos;
    device_room(&e, &pm, &hd, &max_pos);
    rekv_cost_profile prof = {.h2d_bw = h->profile->h2d_bw,
                              .gemm_flops = h->profile->gemm_flops,
                              .fwd_flops_rate = h->profile->fwd_flops_rate,
                              .fwd_gemm = {h->profile->fwd_gemm_a, h->profile->fwd_gemm_b},
                              .attn_flops_rate = h->profile->attn_flops_rate};
    double np = rekv_plan_persist_np(&prof, &pm, hd, atoi(MAX_BATCH), max_pos, 0.2f, 4);
    ck_assert_msg(isfinite(np) && np > 0, "N_p %g", np);
    ck_assert_msg(as.persist_np == np, "N_p assigned %g, by the model's config %g", as.persist_np,
                  np);
    fake_assign(&f, "clo", 0, 1.5);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    m = fake_hello(&f);
    ck_assert(!m->hello->ask);
    ck_assert_str_eq(m->hello->mode, "clo");
    ck_assert_msg(m->hello->persist_np == 1.5, "built with N_p %g", m->hello->persist_np);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    ck_assert_int_eq(tu_stop(w), 0);
    fake_close(&f);
    env_close(&e);
}
END_TEST

/* A worker holding quantized weights (llama.cpp's Q4_0 GGUF: 18 bytes a block of 32) reports
 * their real bytes per element in its Hello, what the coordinator's planner prices an offloaded
 * layer by — not its config's integer dtype size. */
START_TEST(hello_reports_quantized_weight_bytes)
{
    const char *gguf = tu_shared("gguf/synth-llama-Q4_0.gguf");
    if (gguf == NULL)
        return;
    env e;
    env_open(&e);
    fake f;
    fake_open(&f, e.wrk);
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,        "--model",   gguf,        "--coordinator", e.wrk,
                          "--backend", "cpu",       "--name",    "q4",            "--mode",
                          "resident",  "--max-batch", MAX_BATCH, "--heartbeat-ms", "100", NULL};
    pid_t w = tu_spawn(args, e.log, NULL);
    ck_assert_msg(w > 0, "rekv-gpuworker: %s", tu_log_end(e.log));
    Rekv__Worker__WorkerMsg *m = fake_hello(&f);
    ck_assert_msg(fabs(m->hello->weight_elem_bytes - 18.0 / 32.0) < 0.02,
                  "the Hello prices a Q4_0 weight at %g bytes", m->hello->weight_elem_bytes);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    ck_assert_int_eq(tu_stop(w), 0);
    fake_close(&f);
    env_close(&e);
}
END_TEST

/* A worker of a Gemma-2-style model (a window on the even layers) says its window in its Hello,
 * and the coordinator's planner model made from that Hello is the one the config gives (the
 * planner prices a windowed layer's context as its window's blocks). */
START_TEST(hello_reports_the_window)
{
    env e;
    env_open(&e);
    fake f;
    fake_open(&f, e.wrk);
    char model[4300];
    snprintf(model, sizeof(model), "%s/gemma2", e.dir);
    const rekv_synth_spec sp = {REKV_ARCH_LLAMA, 4, 64, 4, 2, 128, 256, 256, REKV_DTYPE_F32, 3, 0};
    const rekv_synth_llama ll = {.gemma = 2, .sliding_window = 32};
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write_llama(&sp, &ll, model, NULL, NULL, &err) == 0, "%s", err.msg);
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,        "--model",   model,       "--coordinator", e.wrk,
                          "--backend", "cpu",       "--name",    "g2",            "--mode",
                          "resident",  "--max-batch", MAX_BATCH, "--heartbeat-ms", "100", NULL};
    pid_t w = tu_spawn(args, e.log, NULL);
    ck_assert_msg(w > 0, "rekv-gpuworker: %s", tu_log_end(e.log));
    Rekv__Worker__WorkerMsg *m = fake_hello(&f);
    ck_assert_uint_eq(m->hello->window, 32);
    ck_assert_uint_eq(m->hello->windowed_layers, 2);
    rekv_model *rm = NULL;
    rekv_engine *eng = NULL;
    ck_assert_msg(rekv_model_open(model, &rm, &err) == 0 && rekv_engine_create(rm, &eng, &err) == 0,
                  "%s", err.msg);
    rekv_plan_model want;
    rekv_plan_model_from_config(rekv_engine_config(eng), &want);
    rekv_plan_model got = co_plan_hello_model(m->hello);
    ck_assert_int_eq(got.window, want.window);
    ck_assert_int_eq(got.windowed_layers, want.windowed_layers);
    rekv_engine_free(eng);
    rekv_model_close(rm);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    ck_assert_int_eq(tu_stop(w), 0);
    fake_close(&f);
    env_close(&e);
}
END_TEST

/* A worker refuses an Assign of another mode than its --mode asked, and stops. */
START_TEST(explicit_mode_refuses_another)
{
    env e;
    env_open(&e);
    fake f;
    fake_open(&f, e.wrk);
    pid_t w = start_worker(&e, "w", "offload", NULL);
    Rekv__Worker__WorkerMsg *m = fake_hello(&f);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    fake_assign(&f, "kvpr", 0, INFINITY);
    int st;
    ck_assert_int_eq(waitpid(w, &st, 0), w);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d", st);
    ck_assert(tu_file_has(e.log, "to a worker started with --mode offload"));
    fake_close(&f);
    env_close(&e);
}
END_TEST

/* The Assign comes while the worker's kvstore is gone: it says Hello with what it was assigned
 * (and that it is unavailable) and builds the pipeline once the store is back, then runs a step. */
START_TEST(assign_while_kvstore_gone)
{
    env e;
    env_open(&e);
    fake f;
    fake_open(&f, e.wrk);
    pid_t w = start_worker(&e, "w", "offload", NULL);
    Rekv__Worker__WorkerMsg *m = fake_hello(&f);
    ck_assert(m->hello->ask);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    tu_kill9(e.kvstore);
    fake_wait_available(&f, 0);
    fake_assign(&f, "offload", 5, INFINITY);
    m = fake_hello(&f);
    ck_assert(!m->hello->ask && m->hello->device_tokens == 5);
    ck_assert(m->unavailable && m->unavailable[0]);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    Rekv__Worker__Welcome wel = REKV__WORKER__WELCOME__INIT;
    Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_WELCOME;
    cm.welcome = &wel;
    fake_send(&f, &cm);
    e.kvstore = start_kvstore(&e);
    fake_wait_available(&f, 1);
    /* a step: one job of a 3-token prompt, one new token */
    int32_t prompt[] = {1, 2, 3};
    Rekv__Worker__JobSpec js = REKV__WORKER__JOB_SPEC__INIT;
    js.job = 1;
    js.n_prompt = 3;
    js.prompt = prompt;
    js.max_new_tokens = 1;
    js.top_k = 1;
    Rekv__Worker__JobSpec *jp = &js;
    Rekv__Worker__Plan plan = REKV__WORKER__PLAN__INIT;
    plan.step = 1;
    plan.n_join = 1;
    plan.join = &jp;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_PLAN;
    cm.plan = &plan;
    fake_send(&f, &cm);
    m = fake_expect(&f, REKV__WORKER__WORKER_MSG__BODY_PROGRESS);
    ck_assert_uint_eq(m->progress->n_jobs, 1);
    ck_assert_msg(m->progress->jobs[0]->error == 0, "%s", m->progress->jobs[0]->error_msg);
    ck_assert_uint_eq(m->progress->jobs[0]->n_tokens, 1);
    rekv__worker__worker_msg__free_unpacked(m, NULL);
    ck_assert_int_eq(tu_stop(w), 0);
    fake_close(&f);
    env_close(&e);
}
END_TEST

/* Between the real daemons: an explicit-mode worker and an auto one get the planner's device part
 * (rekv stats shows what they built with), and --device-tokens is honoured in both. */
START_TEST(coordinator_assigns_device_part)
{
    env e;
    env_open(&e);
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *args[] = {prog,  "--control",   e.ctl,   "--workers",
                          e.wrk, "--state-dir", e.state, NULL};
    pid_t co = tu_spawn(args, e.log, NULL);
    ck_assert_msg(co > 0, "rekv-coordinator: %s", tu_log_end(e.log));
    rekv_ctl *c = tu_ctl_open(e.ctl);
    struct {
        const char *name, *mode, *dev;
    } ws[] = {{"hybrid", "hybrid", NULL},
              {"auto", NULL, NULL},
              {"asked", "kvpr", "9"},
              {"auto-asked", NULL, "11"}};
    enum { NW = sizeof(ws) / sizeof(ws[0]) };
    pid_t pid[NW];
    for (int i = 0; i < NW; i++)
        pid[i] = start_worker(&e, ws[i].name, ws[i].mode, ws[i].dev);
    tu_ctl_wait_workers(c, NW);
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_uint_eq(r->stats->n_workers, NW);
    int checked = 0;
    for (size_t k = 0; k < r->stats->n_workers; k++) {
        const Rekv__Control__WorkerInfo *wi = r->stats->workers[k];
        for (int i = 0; i < NW; i++) {
            if (strcmp(wi->name, ws[i].name) != 0)
                continue;
            rekv_mode mode;
            ck_assert_int_eq(rekv_mode_parse(wi->mode, &mode), 0);
            ck_assert_msg(mode != REKV_MODE_RESIDENT, "%s runs resident", wi->name);
            int want = ws[i].dev ? atoi(ws[i].dev) : planned_part(&e, mode);
            ck_assert_msg(want > 0, "%s: no device part to check", wi->name);
            ck_assert_msg(wi->device_tokens == (uint32_t)want, "%s (%s): device part %u, want %d",
                          wi->name, wi->mode, wi->device_tokens, want);
            checked++;
        }
    }
    ck_assert_int_eq(checked, NW);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    for (int i = 0; i < NW; i++)
        tu_stop(pid[i]);
    tu_stop(co);
    env_close(&e);
}
END_TEST

/* The planner sizes infinigen's partial keys as the pipeline allocates them (the skew's rk
 * columns of each KV head, fp32, every layer) over shapes where 0.3 head_dim is not whole, and
 * the skew calibrated for a model has that rk; the device part: the operator's where the mode
 * keeps one, none for resident and clo, infinigen's in what the keys leave. */
START_TEST(planner_sizes_what_the_pipeline_allocates)
{
    const int shapes[][3] = {{8, 4, 5}, {10, 2, 3}, {16, 4, 8}, {64, 8, 32}, {128, 8, 32}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        rekv_model_config c = {.arch = REKV_ARCH_LLAMA, .act = REKV_ACT_SILU};
        c.head_dim = shapes[i][0];
        c.n_kv_heads = shapes[i][1];
        c.n_heads = 2 * c.n_kv_heads;
        c.n_layers = shapes[i][2];
        c.hidden = c.n_heads * c.head_dim;
        c.ffn = 4 * c.hidden;
        rekv_plan_model pm;
        rekv_plan_model_from_config(&c, &pm);
        int rk = rekv_cost_partial_cols(REKV_PLAN_INFINIGEN_PARTIAL, c.head_dim);
        ck_assert_int_eq(rk, (int)ceil(0.3 * c.head_dim - 1e-9));
        ck_assert(rekv_plan_ig_partial_key_bytes(&pm, c.head_dim, 300) ==
                  (double)rekv_ig_partial_key_bytes(&c, rk, 300));
    }
    env e;
    env_open(&e);
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *eng = NULL;
    ck_assert_msg(rekv_model_open(e.model, &m, &err) == 0 && rekv_engine_create(m, &eng, &err) == 0,
                  "%s", err.msg);
    int32_t ids[24];
    for (int i = 0; i < 24; i++)
        ids[i] = 1 + (i * 37) % 500;
    rekv_skew sk = {0};
    ck_assert_msg(rekv_skew_calibrate(eng, ids, 24, REKV_SKEW_DEFAULT_RATIO, &sk, &err) == 0, "%s",
                  err.msg);
    ck_assert_int_eq(sk.rk, rekv_cost_partial_cols(REKV_PLAN_INFINIGEN_PARTIAL, spec.hidden / 4));
    rekv_skew_free(&sk);
    rekv_engine_free(eng);
    rekv_model_close(m);

    rekv_plan_model pm;
    int hd, max_pos;
    double room = device_room(&e, &pm, &hd, &max_pos);
    int b = atoi(MAX_BATCH);
    ck_assert_int_eq(rekv_plan_device_tokens(&pm, hd, REKV_MODE_RESIDENT, b, max_pos, 4, room, 9),
                     0);
    ck_assert_int_eq(rekv_plan_device_tokens(&pm, hd, REKV_MODE_CLO, b, max_pos, 4, room, 9), 0);
    ck_assert_int_eq(rekv_plan_device_tokens(&pm, hd, REKV_MODE_HYBRID, b, max_pos, 4, room, 9), 9);
    ck_assert_int_eq(rekv_plan_device_tokens(&pm, hd, REKV_MODE_INFINIGEN, b, max_pos, 4, room, 0),
                     0);
    int64_t off = rekv_plan_device_tokens(&pm, hd, REKV_MODE_OFFLOAD, b, max_pos, 4, room, -1);
    int64_t ig = rekv_plan_device_tokens(&pm, hd, REKV_MODE_INFINIGEN, b, max_pos, 4, room, -1);
    ck_assert_int_eq(
        off, rekv_cost_device_tokens_of(room, b, max_pos, pm.hidden, pm.kv_dim, pm.n_layers, 4));
    ck_assert_int_eq(
        ig, rekv_cost_device_tokens_of(room - b * rekv_plan_ig_partial_key_bytes(&pm, hd, max_pos),
                                       b, max_pos, pm.hidden, pm.kv_dim, pm.n_layers, 4));
    ck_assert_msg(ig > 0 && ig < off, "infinigen's part %lld, offload's %lld", (long long)ig,
                  (long long)off);
    ck_assert_int_eq(rekv_plan_device_tokens(&pm, hd, REKV_MODE_OFFLOAD, b, max_pos, 4, -1, -1), 0);
    env_close(&e);
}
END_TEST

/* The real coordinator refuses (Shutdown) a Hello that asks for a mode that is not one. */
START_TEST(coordinator_refuses_unknown_mode)
{
    env e;
    env_open(&e);
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *args[] = {prog,  "--control",   e.ctl,   "--workers",
                          e.wrk, "--state-dir", e.state, NULL};
    pid_t co = tu_spawn(args, e.log, NULL);
    ck_assert(co > 0);
    void *zctx = zmq_ctx_new(), *sock = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_connect(sock, e.wrk), 0);
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.name = "bogus";
    h.mode = "bogus";
    h.ask = 1;
    h.vocab = 512;
    h.max_batch = 1;
    Rekv__Worker__WorkerMsg wm = REKV__WORKER__WORKER_MSG__INIT;
    wm.version = REKV_WORKER_PROTO_VERSION;
    wm.body_case = REKV__WORKER__WORKER_MSG__BODY_HELLO;
    wm.hello = &h;
    uint8_t buf[512];
    size_t n = rekv__worker__worker_msg__get_packed_size(&wm);
    ck_assert(n <= sizeof(buf));
    rekv__worker__worker_msg__pack(&wm, buf);
    ck_assert_int_eq(zmq_send(sock, buf, n, 0), (int)n);
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    ck_assert_int_eq(zmq_poll(&it, 1, 20000), 1);
    int got = zmq_recv(sock, buf, sizeof(buf), 0);
    ck_assert(got > 0);
    Rekv__Worker__CoordMsg *cm = rekv__worker__coord_msg__unpack(NULL, (size_t)got, buf);
    ck_assert(cm != NULL);
    ck_assert_int_eq(cm->body_case, REKV__WORKER__COORD_MSG__BODY_SHUTDOWN);
    rekv__worker__coord_msg__free_unpacked(cm, NULL);
    zmq_close(sock);
    zmq_ctx_term(zctx);
    ck_assert_int_eq(tu_stop(co), 0);
    env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("assign");
    TCase *tc = tcase_create("assign");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, planner_sizes_what_the_pipeline_allocates);
    tcase_add_test(tc, explicit_mode_built_as_assigned);
    tcase_add_test(tc, clo_built_with_assigned_np);
    tcase_add_test(tc, explicit_mode_refuses_another);
    tcase_add_test(tc, hello_reports_quantized_weight_bytes);
    tcase_add_test(tc, hello_reports_the_window);
    tcase_add_test(tc, assign_while_kvstore_gone);
    tcase_add_test(tc, coordinator_assigns_device_part);
    tcase_add_test(tc, coordinator_refuses_unknown_mode);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
