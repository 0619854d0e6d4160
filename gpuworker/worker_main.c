/* worker_main.c — rekv-gpuworker: loads the model onto a backend, connects to the coordinator
 * (DEALER) and, for the offloaded modes, to the kvstore, and runs the coordinator's plans one step
 * at a time through a batcher (batcher.h), answering each with the tokens it produced. Heartbeats
 * to the coordinator and renews its kvstore lease from one zmq_poll loop, also while a step runs
 * on its own thread; says Hello again whenever the coordinator does not know it. Its kvstore
 * sequences belong to its name: at start it drops what a dead worker of the same name left.
 * With --mode auto the worker measures and reports, and the coordinator decides: the first Hello
 * says "auto" with the profile and the device's room, the coordinator answers Assign, and only then
 * does the worker build its pipeline (worker.proto).
 *
 * Failures: a step that fails as a whole reports every job that was in it, each to be run again
 * (retry: the kvstore went away or had no room, the worker is stopping) or failed with the reason
 * (anything else); when the store names the sequence whose block failed to read back (a CRC
 * mismatch, an I/O error), that sequence's job alone fails and the others run again. The kvstore
 * client notices the store's end at once (a socket monitor) or a request's timeout
 * (--kvstore-timeout-ms); the worker then
 * drops its pipeline (its arena is the dead store's), says it is unavailable on every message
 * (the coordinator sends it no Plan; a Plan already on its way is answered with every joining job
 * to be run again), reconnects every half second and, once the store answers, rebuilds the
 * pipeline and says it is available. SIGTERM during a step aborts the step's kvstore requests, so
 * the worker stops within a step's compute time whatever the store does. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/curve.h"
#include "common/daemon.h"
#include "common/cost.h"
#include "common/log.h"
#include "common/ratelimit.h"
#include "common/version.h"
#include "gpuworker/profile.h"
#include "gpuworker/batcher.h"
#include "gpuworker/heads.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "gpuworker/worker_metrics.h"
#include "kvstore/kvstore.h"
#include "proto/worker.pb-c.h"

#define WORKER_PROTO_VERSION 1u /* REKV_WORKER_PROTO_VERSION in coordinator.h */
#define KV_WAIT_MS 30000ull     /* how long a worker started beside its kvstore waits for it */
#define WORKER_TIMED_EVERY 8    /* one step in this many is timed (busy times for the planner) */

static void usage(FILE *f)
{
    fprintf(
        f, "usage: rekv-gpuworker --model PATH [--coordinator ENDPOINT] [--kvstore ENDPOINT]\n"
           "         [--backend auto|cpu|cuda]\n"
           "         [--mode auto|resident|offload|kvpr|act|hybrid|infinigen|clo] [--approximate]\n"
           "         [--max-batch N] [--name NAME] [--heartbeat-ms N]\n"
           "         [--link-gbps G] [--link-latency-us U] [--device-memory SIZE] [--push]\n"
           "         [--device-tokens N]\n"
           "         [--kvstore-timeout-ms N] [--metrics HOST:PORT [--metrics-public]]\n"
           "         [--ready-fd N] [--help] [--version]\n"
           "Defaults: coordinator ipc://$XDG_RUNTIME_DIR/rekv/workers (or /run/rekv/workers),\n"
           "mode auto, batch 64, name HOST-PID. Every mode but resident keeps the KV cache\n"
           "in the kvstore, under the worker's name (unique among the store's workers): a worker\n"
           "started with the name of a dead one frees what that one left there at once (else\n"
           "the store frees it when the dead one's lease runs out). A store that stops is noticed\n"
           "at once, one that does not answer after --kvstore-timeout-ms (30000); the worker then\n"
           "fails its step (the jobs run again), is unavailable to the coordinator and reconnects\n"
           "every half second until the store is back.\n"
           "auto: the coordinator chooses, from what this worker measures and reports: resident\n"
           "when the device holds the KV cache of a full batch of full contexts (always on the\n"
           "cpu backend, or without a kvstore), else the technique its planner prices cheapest\n"
           "with this machine's measured profile for what the device cannot keep: each\n"
           "sequence's first tokens stay on the device as far as its room holds them beside a\n"
           "step's buffers (--device-tokens N sets it, 0 none; every streaming mode but clo).\n"
           "--approximate: let the coordinator choose an approximate mode (infinigen) for --mode\n"
           "auto: it does when its planner prices it strictly cheaper than every exact mode.\n"
           "infinigen's and clo's tokens may differ from resident's; --mode infinigen or clo\n"
           "needs no flag (auto never answers clo).\n"
           "--link-gbps, --link-latency-us and --device-memory make the cpu backend behave like a\n"
           "GPU behind a link of that speed with that much memory (see rekv bench decode).\n"
           "--push: the kvstore (started with --push-backend) writes the KV rows into this\n"
           "worker's buffers instead of the worker copying them (modes other than resident).\n"
           "A step runs the whole batch at once; tokens equal `rekv generate --local`.\n"
           "--metrics serves Prometheus scrapes (GET /metrics) on a loopback address, also while\n"
           "a step runs; another address (or :PORT) needs --metrics-public: scrapes are not\n"
           "authenticated.\n");
}

/* The step thread (step_thread below). */
typedef struct stepper {
    pthread_t t;
    pthread_mutex_t mu;
    pthread_cond_t go;
    int started, pending, quit; /* pending: a step to run (set here, cleared by the thread) */
    rekv_batcher *batch;
    const rekv_batch_event *ev;
    int n_ev;
    rekv_err err;
    int rc;
    int done_fd; /* eventfd the thread writes when a step is over */
} stepper;

typedef struct worker {
    void *sock;          /* DEALER to the coordinator */
    rekv_pipeline *pipe; /* NULL until the mode is known (--mode auto: the coordinator's Assign) */
    rekv_batcher *batch;
    rekv_engine *eng;
    rekv_pipeline_config pc; /* the pipeline to build (pc.mode once known) */
    rekv_skew skew;          /* infinigen, clo: the model's (rekv_skew_prepare; cached) */
    rekv_heads heads;        /* clo: the model's head profile (rekv_heads_prepare; cached) */
    int push;                /* --push */
    int approximate;         /* --approximate: the coordinator may assign an approximate mode */
    const rekv_model_config *mc;
    const char *name, *mode, *model; /* mode: "auto" until the pipeline is built */
    int max_batch;
    uint64_t steps;
    uint64_t last_sent_ns;        /* for heartbeats */
    uint64_t hello_sent_ns;       /* when the Hello awaiting its Welcome went out */
    int awaiting_welcome;         /* a Hello is out: Resets and Plans before the Welcome are stale
                                   * (messages that crossed it) and are ignored */
    rekv_backend *be;             /* for the busy times each Progress reports */
    rekv_cost_profile cost;       /* measured at start (cached per machine/model), sent in Hello */
    double device_kv_room;        /* for the mode choice (Hello); < 0: no device limit */
    int device_tokens;            /* --device-tokens: each sequence's device-resident part;
                                     -1: what device_kv_room holds (rekv_cost_device_tokens) */
    uint64_t device_buffer_bytes; /* for the planner's mini-batches (Hello); 0: no limit */
    uint32_t hb_ms;               /* heartbeat period, also while a step runs */
    rekv_kvstore_client *kv;      /* NULL in resident mode without --kvstore, and while lost */
    uint64_t renew_ns;            /* kvstore lease renewal period: a quarter of its lease */
    uint64_t last_renew_ns;
    const char *kv_ep; /* --kvstore */
    int kv_timeout_ms; /* --kvstore-timeout-ms: the bound on one store request */
    int kv_lost;       /* the store went away: no client, no pipeline, reconnecting */
    int rebuild;       /* a pipeline was built before the loss: build it again */
    uint64_t next_reconnect_ns;
    int reconnect_tries;          /* since the loss (the first failure is logged, not each) */
    char unavailable[256];        /* sent with every message while non-empty (worker.proto) */
    Rekv__Worker__StoreRoom room; /* the kvstore's room (its Stats at connect), sent with every
                                   * message while w->kv is set; host_bytes 0: not known */
    int stop_fd;                  /* SIGTERM/SIGINT (common/daemon.h) */
    int stopping;                 /* a stop arrived during a step: its kvstore requests aborted */
    rekv_metrics_server *metrics; /* the scrape port; NULL without --metrics */
    rekv_worker_metrics wm;       /* what it serves */
    stepper stepper;              /* the step thread */
} worker;

/* The scrape port's fds after the n items of it (raw fds); returns how many were added. */
static int metrics_items(const worker *w, zmq_pollitem_t *it, int n, int *fds)
{
    short ev[REKV_METRICS_MAX_FDS];
    int m = w->metrics ? rekv_metrics_server_fds(w->metrics, fds, ev, REKV_METRICS_MAX_FDS) : 0;
    for (int k = 0; k < m; k++)
        it[n + k] = (zmq_pollitem_t){NULL, fds[k], ev[k], 0};
    return m;
}

/* Answers scrapes after a poll whose items from index n on are the m the port asked for. */
static void metrics_serve(worker *w, const zmq_pollitem_t *it, int n, const int *fds, int m)
{
    if (w->metrics == NULL)
        return;
    short rev[REKV_METRICS_MAX_FDS];
    for (int k = 0; k < m; k++)
        rev[k] = it[n + k].revents;
    rekv_metrics_server_handle(w->metrics, fds, rev, m, rekv_worker_metrics_render, &w->wm);
}

/* Takes the store's room from its Stats reply: the coordinator's admission prices jobs with it. */
static void kv_room_fetch(worker *w)
{
    rekv_kv_stats st;
    rekv_err err = {0};
    rekv__worker__store_room__init(&w->room);
    if (w->kv == NULL || rekv_kvstore_stats(w->kv, &st, &err)) {
        if (w->kv)
            rekv_log(REKV_LOG_WARN, "kvstore stats: %s; the coordinator admits jobs blind",
                     err.msg);
        return;
    }
    w->room.instance = st.instance;
    w->room.host_bytes = st.host_bytes;
    w->room.kv_block_bytes = st.kv_slot_bytes;
    w->room.act_block_bytes = st.act_slot_bytes;
    w->room.spill_bytes = st.spill_bytes;
    w->room.spill_room_bytes = st.spill_room_bytes;
}

/* A WARN a peer can cause once per message: at most one a second per call site (rl), the next one
 * saying how many were held back (the coordinator's co_event_rl, here). */
static void warn_rl(rekv_ratelimit *rl, const char *what, const char *detail)
{
    uint64_t held = 0;
    if (!rekv_ratelimit_allow(rl, rekv_now_ns(), REKV_RATELIMIT_INTERVAL_NS, &held))
        return;
    if (held)
        rekv_log(REKV_LOG_WARN, "%s%s (%llu similar messages suppressed)", what, detail,
                 (unsigned long long)held);
    else
        rekv_log(REKV_LOG_WARN, "%s%s", what, detail);
}

static int send_msg(worker *w, Rekv__Worker__WorkerMsg *m)
{
    m->version = WORKER_PROTO_VERSION;
    m->unavailable = w->unavailable;
    m->store = w->kv && w->room.host_bytes ? &w->room : NULL;
    size_t n = rekv__worker__worker_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL)
        return -ENOMEM;
    rekv__worker__worker_msg__pack(m, buf);
    int rc = zmq_send(w->sock, buf, n, 0) < 0 ? -errno : 0;
    free(buf);
    w->last_sent_ns = rekv_now_ns();
    static rekv_ratelimit rl = REKV_RATELIMIT_INIT;
    if (rc)
        warn_rl(&rl, "send to the coordinator: ", zmq_strerror(-rc));
    return rc;
}

static void send_hello(worker *w)
{
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.name = (char *)w->name;
    h.backend = (char *)w->be->iface->name;
    h.mode = (char *)w->mode;
    h.max_batch = (uint32_t)w->max_batch;
    h.vocab = (uint32_t)w->mc->vocab;
    h.max_pos = (uint32_t)w->mc->max_pos;
    h.eos_id = w->mc->eos_id;
    h.model = (char *)w->model;
    h.pid = (uint64_t)getpid();
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = w->cost.h2d_bw;
    cp.h2d_latency = w->cost.h2d_latency;
    cp.gemm_flops = w->cost.gemm_flops;
    cp.fwd_flops_rate = w->cost.fwd_flops_rate;
    cp.fwd_gemm_a = w->cost.fwd_gemm.a;
    cp.fwd_gemm_b = w->cost.fwd_gemm.b;
    cp.attn_flops_rate = w->cost.attn_flops_rate;
    cp.attn_chunk_flops_rate = w->cost.attn_chunk_flops_rate;
    cp.load_kv_a = w->cost.load_kv.a;
    cp.load_kv_b = w->cost.load_kv.b;
    cp.kv_gen_a = w->cost.kv_gen.a;
    cp.kv_gen_b = w->cost.kv_gen.b;
    cp.t_load_w = w->cost.t_load_w;
    h.profile = &cp;
    h.hidden = (uint32_t)w->mc->hidden;
    h.kv_dim = (uint32_t)rekv_config_kv_dim(w->mc);
    h.n_layers = (uint32_t)w->mc->n_layers;
    h.cache_elem_bytes = (uint32_t)rekv_dtype_size(w->pc.cache_dtype);
    h.offload_weights = w->pc.offload_weights;
    h.device_buffer_bytes = w->device_buffer_bytes;
    {
        const rekv_model_config *c = w->mc;
        h.layer_params = (uint64_t)rekv_config_layer_params(c);
        h.q_dim = (uint32_t)rekv_config_q_dim(c);
        h.weight_elem_bytes = (uint32_t)rekv_dtype_size(c->dtype);
    }
    h.device_kv_room = w->device_kv_room;
    h.kvstore = w->kv != NULL;
    h.approximate = w->approximate;
    h.device_tokens = (uint32_t)w->pc.device_tokens;
    h.split = w->pc.split > 0 ? (uint32_t)w->pc.split : 0;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_HELLO;
    m.hello = &h;
    send_msg(w, &m);
    w->awaiting_welcome = 1;
    w->hello_sent_ns = rekv_now_ns();
}

/* Steps run on a thread of their own, so that the loop's thread keeps the coordinator informed
 * (a long prefill on the cpu backend can outlast the coordinator's worker timeout). One thread for
 * the worker's life: with a thread started per step, the worker's own step on opt-tiny-py took
 * 1.13 and 1.74 ms where it takes 0.92 and 1.28 ms now (two A/B rounds, 2-core machine). */

static void *step_thread(void *arg)
{
    stepper *st = arg;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->pending && !st->quit)
            pthread_cond_wait(&st->go, &st->mu);
        if (st->quit)
            break;
        pthread_mutex_unlock(&st->mu);
        st->rc = rekv_batcher_step(st->batch, &st->ev, &st->n_ev, &st->err);
        pthread_mutex_lock(&st->mu);
        st->pending = 0;
        uint64_t one = 1;
        ssize_t wr = write(st->done_fd, &one, sizeof(one));
        (void)wr;
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

/* Starts the step thread; -errno when it cannot (steps then run on the loop's thread). */
static int stepper_start(stepper *st)
{
    memset(st, 0, sizeof(*st));
    st->done_fd = eventfd(0, EFD_CLOEXEC);
    if (st->done_fd < 0)
        return -errno;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->go, NULL);
    int rc = pthread_create(&st->t, NULL, step_thread, st);
    if (rc) {
        close(st->done_fd);
        st->done_fd = -1;
        return -rc;
    }
    st->started = 1;
    return 0;
}

static void stepper_stop(stepper *st)
{
    if (!st->started)
        return;
    pthread_mutex_lock(&st->mu);
    st->quit = 1;
    pthread_cond_signal(&st->go);
    pthread_mutex_unlock(&st->mu);
    pthread_join(st->t, NULL);
    close(st->done_fd);
    st->started = 0;
}

/* Renews the kvstore lease when due. From the loop's thread, also while the step thread uses the
 * same client: that one's requests renew the lease themselves, so this never waits for them. */
static void kv_renew_due(worker *w)
{
    uint64_t now = rekv_now_ns();
    if (w->kv == NULL || now - w->last_renew_ns < w->renew_ns)
        return;
    rekv_err err = {0};
    if (rekv_kvstore_renew_nowait(w->kv, &err))
        rekv_log(REKV_LOG_WARN, "kvstore lease: %s", err.msg);
    w->last_renew_ns = now;
}

/* How long the loop may sleep: until the next heartbeat or lease renewal is due (rounded up). */
static long loop_timeout_ms(const worker *w)
{
    uint64_t now = rekv_now_ns(), due = w->last_sent_ns + (uint64_t)w->hb_ms * 1000000ull;
    if (w->kv && w->last_renew_ns + w->renew_ns < due)
        due = w->last_renew_ns + w->renew_ns;
    if (w->kv_lost && w->next_reconnect_ns < due)
        due = w->next_reconnect_ns;
    return due > now ? (long)((due - now + 999999) / 1000000) : 0;
}

static void send_heartbeat(worker *w)
{
    Rekv__Worker__Heartbeat hb = REKV__WORKER__HEARTBEAT__INIT;
    hb.steps = w->steps;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    send_msg(w, &m);
}

/* Runs one batcher step on the step thread while this one heartbeats every hb_ms and keeps the
 * kvstore lease (the step's pins) alive; messages from the coordinator wait in the socket until
 * the step is over. Without the thread, runs it here. */
static int step_with_heartbeats(worker *w, const rekv_batch_event **ev, int *n_ev, rekv_err *err)
{
    stepper *st = &w->stepper;
    if (!st->started)
        return rekv_batcher_step(w->batch, ev, n_ev, err);
    pthread_mutex_lock(&st->mu);
    st->batch = w->batch;
    st->pending = 1;
    pthread_cond_signal(&st->go);
    pthread_mutex_unlock(&st->mu);
    for (;;) {
        int n0 = w->stopping ? 1 : 2; /* the stop fd stays readable: the loop stops after */
        zmq_pollitem_t it[2 + REKV_METRICS_MAX_FDS] = {{NULL, st->done_fd, ZMQ_POLLIN, 0},
                                                       {NULL, w->stop_fd, ZMQ_POLLIN, 0}};
        int m_fds[REKV_METRICS_MAX_FDS], m_n = metrics_items(w, it, n0, m_fds);
        int r = zmq_poll(it, n0 + m_n, loop_timeout_ms(w));
        metrics_serve(w, it, n0, m_fds, r > 0 ? m_n : 0); /* scrapes while the step runs */
        if (r > 0 && (it[0].revents & ZMQ_POLLIN))
            break;
        if (r > 0 && n0 == 2 && (it[1].revents & ZMQ_POLLIN)) {
            /* stopping: the step's compute ends by itself, its kvstore waits are cut short */
            w->stopping = 1;
            rekv_log(REKV_LOG_INFO, "signal: stopping after this step");
            if (w->kv)
                rekv_kvstore_client_abort(w->kv);
        }
        if (rekv_now_ns() - w->last_sent_ns >= (uint64_t)w->hb_ms * 1000000ull)
            send_heartbeat(w);
        kv_renew_due(w);
        rekv_daemon_watchdog();
    }
    uint64_t n;
    ssize_t rd = read(st->done_fd, &n, sizeof(n));
    (void)rd;
    pthread_mutex_lock(&st->mu); /* the thread's writes before its signal are ours */
    *ev = st->ev;
    *n_ev = st->n_ev;
    int rc = st->rc;
    pthread_mutex_unlock(&st->mu);
    if (rc)
        rekv_errf(err, rc, "%s", st->err.msg);
    return rc;
}

/* Whether a failed step's (or join's) jobs run again: they do when the failure passes — the
 * kvstore is gone (its client says so, or a request timed out: *lost is set), it had no room
 * (-ENOMEM, -ENOSPC: other jobs end and free it), or we are stopping. Anything else (a CRC
 * mismatch or I/O error on read-back, a device error, a bad request) fails them with the reason:
 * running them again would meet it again. */
static int step_error_retry(worker *w, int code, int *lost)
{
    *lost = 0;
    if (w->stopping || code == -ECANCELED)
        return 1;
    if (w->kv && (rekv_kvstore_client_lost(w->kv) || code == -ETIMEDOUT || code == -EPIPE)) {
        *lost = 1;
        return 1;
    }
    return code == -ENOMEM || code == -ENOSPC;
}

/* The kvstore is gone: the pipeline goes with its client (its arena is the dead store's); the
 * loop reconnects (kv_reconnect). w->unavailable says so to the coordinator. */
static void kv_lose(worker *w)
{
    rekv_log(REKV_LOG_WARN, "kvstore %s: lost; unavailable until it is back", w->kv_ep);
    if (w->unavailable[0] == '\0')
        snprintf(w->unavailable, sizeof(w->unavailable), "its kvstore at %s is gone; reconnecting",
                 w->kv_ep);
    w->rebuild = w->pipe != NULL;
    if (w->batch)
        rekv_batcher_clear(w->batch); /* the client fails at once: nothing waits */
    rekv_batcher_free(w->batch);
    rekv_pipeline_free(w->pipe);
    w->batch = NULL;
    w->pipe = NULL;
    rekv_kvstore_client_close(w->kv);
    w->kv = NULL;
    w->kv_lost = 1;
    w->reconnect_tries = 0;
    w->next_reconnect_ns = rekv_now_ns();
    send_heartbeat(w);
}

static int start_pipeline(worker *w, rekv_err *err);

/* Connects to the store again (every half second while it is not there), drops what a worker of
 * our name left in it, rebuilds the pipeline and says we are available. */
static void kv_reconnect(worker *w)
{
    if (!w->kv_lost || rekv_now_ns() < w->next_reconnect_ns)
        return;
    w->next_reconnect_ns = rekv_now_ns() + 500000000ull;
    rekv_err err = {0};
    rekv_kvstore_client *kv = NULL;
    uint64_t n_seqs = 0, n_blocks = 0;
    /* a short bound on the connect itself: this loop heartbeats and watches for SIGTERM */
    if (rekv_kvstore_client_connect(w->kv_ep, NULL, 1000, &kv, &err) == 0) {
        rekv_kvstore_client_set_timeout(kv, w->kv_timeout_ms);
        rekv_kv_geometry g;
        rekv_kvstore_client_geometry(kv, &g);
        if (g.dtype != w->pc.cache_dtype)
            rekv_errf(&err, -EINVAL, "kvstore %s: its cache dtype is now %s, not %s", w->kv_ep,
                      rekv_dtype_name(g.dtype), rekv_dtype_name(w->pc.cache_dtype));
        else if (rekv_kvstore_client_set_owner(kv, w->name, &err) == 0 &&
                 rekv_kvstore_drop_owner(kv, w->name, &n_seqs, &n_blocks, &err) == 0) {
            w->kv = kv;
            w->kv_lost = 0;
            w->last_renew_ns = rekv_now_ns();
            kv_room_fetch(w); /* a restarted store may be another size */
            if (!w->rebuild || start_pipeline(w, &err) == 0) {
                rekv_log(REKV_LOG_INFO, "kvstore %s: connected again%s", w->kv_ep,
                         n_seqs ? " (dropped what we left there)" : "");
                w->unavailable[0] = '\0';
                send_heartbeat(w);
                return;
            }
            rekv_batcher_free(w->batch);
            rekv_pipeline_free(w->pipe);
            w->batch = NULL;
            w->pipe = NULL;
            w->kv = NULL;
            w->kv_lost = 1;
        }
        rekv_kvstore_client_close(kv);
    }
    if (w->reconnect_tries++ == 0)
        rekv_log(REKV_LOG_WARN, "kvstore %s: not back yet: %s", w->kv_ep, err.msg);
}

/* A Plan while we cannot run steps (crossed our word that we are unavailable): every joining job
 * runs again; there are no running ones (they were reported with the failed step). */
static void refuse_plan(worker *w, const Rekv__Worker__Plan *plan)
{
    size_t nj = plan->n_join;
    Rekv__Worker__JobProgress *jp = calloc(nj ? nj : 1, sizeof(*jp));
    Rekv__Worker__JobProgress **pp = calloc(nj ? nj : 1, sizeof(*pp));
    if (jp == NULL || pp == NULL) {
        rekv_log(REKV_LOG_ERROR, "out of memory refusing a plan");
        goto out;
    }
    for (size_t i = 0; i < nj; i++) {
        rekv__worker__job_progress__init(&jp[i]);
        jp[i].job = plan->join[i]->job;
        jp[i].error = -EAGAIN;
        jp[i].error_msg = w->unavailable;
        jp[i].retry = 1;
        pp[i] = &jp[i];
    }
    Rekv__Worker__Progress pr = REKV__WORKER__PROGRESS__INIT;
    pr.step = plan->step;
    pr.n_jobs = nj;
    pr.jobs = pp;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &pr;
    send_msg(w, &m);
out:
    free(jp);
    free(pp);
}

/* One plan: drop the cancelled, add the joining, run a step, report. */
static void run_plan(worker *w, const Rekv__Worker__Plan *plan)
{
    for (size_t i = 0; i < plan->n_cancel; i++)
        rekv_batcher_cancel(w->batch, plan->cancel[i]);
    rekv_batcher_set_prefill_chunk(w->batch, (int)plan->prefill_chunk);
    size_t cap = plan->n_join + (size_t)rekv_batcher_running(w->batch);
    Rekv__Worker__JobProgress *jp = calloc(cap ? cap : 1, sizeof(*jp));
    Rekv__Worker__JobProgress **pp = calloc(cap ? cap : 1, sizeof(*pp));
    int32_t *toks = calloc(cap ? cap : 1, sizeof(int32_t));
    rekv_err *errs = calloc(cap ? cap : 1, sizeof(rekv_err));
    if (!jp || !pp || !toks || !errs) {
        rekv_log(REKV_LOG_ERROR, "out of memory running a plan");
        goto out;
    }
    size_t n = 0;
    int lost = 0; /* the kvstore is gone (the client says so, or a request timed out) */
    /* the planner's choices for this step (any of them gives the same tokens), before the joins:
     * their sequences are made with its KV:ACT pattern, the one the coordinator admitted them at
     * (and a sequence keeps it) */
    if (plan->params) {
        const Rekv__Worker__StepParams *sp = plan->params;
        rekv_step_params st = {sp->split, (int)sp->kv_parts, (int)sp->act_parts,
                               sp->gpu_batches ? (int)sp->gpu_batches : 1,
                               sp->column ? REKV_SCHED_COLUMN : REKV_SCHED_ROW};
        rekv_err perr = {0};
        static rekv_ratelimit rl = REKV_RATELIMIT_INIT;
        if (rekv_pipeline_set_step(w->pipe, &st, &perr))
            warn_rl(&rl, "a Plan's step parameters refused: ", perr.msg);
    }
    for (size_t i = 0; i < plan->n_join; i++) {
        const Rekv__Worker__JobSpec *s = plan->join[i];
        rekv_gen_params gp = {(int)s->max_new_tokens,
                              s->temperature,
                              (int)s->top_k,
                              s->top_p > 0 ? s->top_p : 1.0f,
                              s->seed,
                              (int)s->top_logits,
                              s->stop_at_eos};
        rekv_log(REKV_LOG_DEBUG,
                 "step %llu: job %llu joins: %zu prompt tokens, temperature %g, "
                 "top-k %u, top-p %g, seed %llu, max %u, eos %d",
                 (unsigned long long)plan->step, (unsigned long long)s->job, s->n_prompt,
                 (double)s->temperature, s->top_k, (double)s->top_p, (unsigned long long)s->seed,
                 s->max_new_tokens, s->stop_at_eos);
        int rc = rekv_batcher_join(w->batch, s->job, s->prompt, (int)s->n_prompt, &gp, &errs[n]);
        if (rc) {
            int join_lost = 0; /* a join makes the job's kvstore sequence */
            rekv__worker__job_progress__init(&jp[n]);
            jp[n].job = s->job;
            jp[n].error = rc;
            jp[n].error_msg = errs[n].msg;
            jp[n].retry = step_error_retry(w, rc, &join_lost);
            lost |= join_lost;
            pp[n] = &jp[n];
            n++;
        } else if (w->kv) {
            rekv_log(REKV_LOG_DEBUG, "step %llu: job %llu's cache is kvstore sequence %llu",
                     (unsigned long long)plan->step, (unsigned long long)s->job,
                     (unsigned long long)rekv_batcher_store_seq(w->batch, s->job));
        }
    }
    /* the planner's mini-batches, once the joining jobs are in the batch */
    if (plan->params) {
        size_t nm = plan->params->n_mb_job < plan->params->n_mb_index ? plan->params->n_mb_job
                                                                      : plan->params->n_mb_index;
        rekv_batcher_set_mini_batches(w->batch, plan->params->mb_job, plan->params->mb_index, nm);
    }
    rekv_pipeline_counters_reset(w->pipe);
    /* the planner corrects its prices by measured busy times; timing costs two events per op on
     * cuda, so one step in WORKER_TIMED_EVERY is timed and only its busy times are reported */
    int timed = w->steps % WORKER_TIMED_EVERY == 0;
    w->be->iface->timing(w->be, timed);
    rekv_backend_stats bs0;
    w->be->iface->stats(w->be, &bs0);
    uint64_t t0 = rekv_now_ns();
    const rekv_batch_event *ev = NULL;
    int n_ev = 0;
    rekv_err serr = {0};
    int running = rekv_batcher_running(w->batch), ran = running > 0;
    char other_msg[160] = "";
    if (w->kv)
        rekv_kvstore_client_take_lost_seq(w->kv); /* only this step's */
    if (running > 0 && step_with_heartbeats(w, &ev, &n_ev, &serr)) {
        /* the step failed as a whole: every job in it is reported, to run again or failed */
        int retry = step_error_retry(w, serr.code, &lost);
        /* a block lost on read-back (CRC mismatch, I/O error) is one sequence's: its job fails,
         * the others' caches are intact and they run again */
        uint64_t lost_seq = w->kv ? rekv_kvstore_client_take_lost_seq(w->kv) : 0, owner = 0;
        int scoped = !retry && lost_seq != 0 &&
                     rekv_batcher_job_of_store_seq(w->batch, lost_seq, &owner) == 0;
        if (scoped) {
            snprintf(other_msg, sizeof(other_msg),
                     "step %llu failed on job %llu's lost kvstore blocks; this job runs again",
                     (unsigned long long)plan->step, (unsigned long long)owner);
            rekv_log(REKV_LOG_ERROR, "step %llu failed (job %llu fails, the others run again): %s",
                     (unsigned long long)plan->step, (unsigned long long)owner, serr.msg);
        } else {
            rekv_log(retry ? REKV_LOG_WARN : REKV_LOG_ERROR, "step %llu failed (%s): %s",
                     (unsigned long long)plan->step, retry ? "its jobs run again" : "its jobs fail",
                     serr.msg);
        }
        uint64_t *ids = calloc((size_t)running, sizeof(uint64_t));
        int n_ids = ids ? rekv_batcher_job_ids(w->batch, ids, running) : 0;
        for (int i = 0; i < n_ids && i < running && n < cap; i++) {
            int other = scoped && ids[i] != owner;
            rekv__worker__job_progress__init(&jp[n]);
            jp[n].job = ids[i];
            jp[n].error = other ? -EAGAIN : serr.code;
            jp[n].error_msg = other ? other_msg : serr.msg;
            jp[n].retry = other ? 1 : retry;
            pp[n] = &jp[n];
            n++;
        }
        free(ids);
        rekv_batcher_clear(w->batch);
        n_ev = 0;
        running = 0;
    }
    double step_s = (double)(rekv_now_ns() - t0) * 1e-9;
    if (lost && !w->stopping) /* said in this Progress: no Plan comes until we are back */
        snprintf(w->unavailable, sizeof(w->unavailable), "its kvstore at %s is gone; reconnecting",
                 w->kv_ep);
    for (int i = 0; i < n_ev && n < cap; i++) {
        rekv__worker__job_progress__init(&jp[n]);
        jp[n].job = ev[i].job;
        if (ev[i].token >= 0) {
            rekv_log(REKV_LOG_DEBUG, "step %llu: job %llu token %d%s%s",
                     (unsigned long long)plan->step, (unsigned long long)ev[i].job, ev[i].token,
                     ev[i].finished ? ", finished: " : "",
                     ev[i].finished ? ev[i].finish_reason : "");
            toks[n] = ev[i].token;
            jp[n].n_tokens = 1;
            jp[n].tokens = &toks[n];
            if (ev[i].n_top > 0) { /* valid until the next batcher step, after the send */
                jp[n].n_top_ids = jp[n].n_top_vals = (size_t)ev[i].n_top;
                jp[n].top_ids = (int32_t *)ev[i].top_ids;
                jp[n].top_vals = (float *)ev[i].top_vals;
            }
        }
        jp[n].finished = ev[i].finished;
        jp[n].finish_reason = ev[i].finished ? (char *)ev[i].finish_reason : "";
        pp[n] = &jp[n];
        n++;
    }
    rekv_layer_counters tot;
    const rekv_layer_counters *per = rekv_pipeline_counters(w->pipe, &tot);
    if (ran) {
        uint64_t n_tok = 0;
        for (int i = 0; i < n_ev; i++)
            n_tok += ev[i].token >= 0;
        rekv_worker_metrics_step(&w->wm, step_s, &tot, n_tok, serr.code != 0,
                                 rekv_batcher_running(w->batch));
        w->wm.graph_steps = rekv_pipeline_graph_steps(w->pipe, NULL);
    }
    Rekv__Worker__Counters c = REKV__WORKER__COUNTERS__INIT;
    c.h2d_weights = tot.h2d_bytes[REKV_XFER_WEIGHTS];
    c.h2d_kv = tot.h2d_bytes[REKV_XFER_KV];
    c.h2d_act = tot.h2d_bytes[REKV_XFER_ACT];
    for (int k = 0; k < REKV_XFER_KINDS; k++)
        c.d2h += tot.d2h_bytes[k];
    c.tokens_recomputed = tot.tokens_recomputed;
    c.tokens_fetched = tot.tokens_fetched;
    /* infinigen's selected fraction: what the selecting layers selected of what they could have
     * fetched (layer 0 fetches whole: left out) */
    if (per)
        rekv_pipeline_selected_fraction(per, w->mc->n_layers, &c.tokens_considered,
                                        &c.tokens_selected);
    rekv_backend_stats bs1;
    w->be->iface->stats(w->be, &bs1);
    w->be->iface->timing(w->be, false);
    if (timed) {
        c.compute_busy_s = bs1.compute_busy_s - bs0.compute_busy_s;
        c.h2d_busy_s = bs1.h2d_busy_s - bs0.h2d_busy_s;
    }
    Rekv__Worker__Progress pr = REKV__WORKER__PROGRESS__INIT;
    pr.step = plan->step;
    pr.n_jobs = n;
    pr.jobs = pp;
    pr.running = (uint32_t)rekv_batcher_running(w->batch);
    pr.step_s = step_s;
    pr.counters = &c;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &pr;
    send_msg(w, &m);
    w->steps++;
    if (lost && !w->stopping)
        kv_lose(w);
out:
    free(jp);
    free(pp);
    free(toks);
    free(errs);
}

/* The device memory free for this worker's buffers: what is free less a tenth of the device for
 * activations and workspaces; -1 when the backend's memory is the host's (no mem_info). */
/* Builds the pipeline and the batcher in w->pc.mode (the weights go onto the device here), and
 * measures the room they leave for a step's buffers. */
static int start_pipeline(worker *w, rekv_err *err)
{
    /* the kvstore writes the KV rows into our buffers (it must run --push-backend) */
    w->pc.push = w->push && w->pc.mode != REKV_MODE_RESIDENT;
    w->mode = rekv_mode_name(w->pc.mode);
    int rc;
    if ((w->pc.mode == REKV_MODE_INFINIGEN || w->pc.mode == REKV_MODE_CLO) && w->pc.skew == NULL) {
        int cached = 0;
        if ((rc = rekv_skew_prepare(w->eng, REKV_SKEW_DEFAULT_RATIO, &w->skew, &cached, err)))
            return rc;
        rekv_log(REKV_LOG_INFO, "%s: the model's skew %s", w->mode,
                 cached ? "from the cache" : "made and cached");
        w->pc.skew = &w->skew;
    }
    if (w->pc.mode == REKV_MODE_CLO && w->pc.heads == NULL) {
        int cached = 0;
        if ((rc = rekv_heads_prepare(w->eng, &w->heads, &cached, err)))
            return rc;
        rekv_log(REKV_LOG_INFO, "clo: the model's head profile %s",
                 cached ? "from the cache" : "made and cached");
        w->pc.heads = &w->heads;
        /* Eq. 12 at the worker's largest batch and context, from its measured profile */
        w->pc.persist_np = rekv_heads_np(w->mc, &w->cost, w->max_batch, w->mc->max_pos,
                                         w->pc.max_fraction, w->pc.cache_dtype);
        rekv_log(REKV_LOG_INFO,
                 "clo: N_p %.1f KV heads per layer (Eq. 12): harder heads beyond it keep their "
                 "whole KV on the device",
                 w->pc.persist_np);
    }
    /* the device-resident part in serving: the device's room for the KV cache (none where the
     * device's memory is the host's) keeps each sequence's first tokens' K,V there, so they
     * cross the link neither as KV nor as activations (every mode that streams but clo; it saves
     * what ACT_GPU's activations would per byte of device memory, and their recomputation;
     * infinigen attends it whole, beside what it selects, in the room its partial keys leave) */
    if ((w->device_kv_room > 0 || w->device_tokens > 0) && w->pc.mode != REKV_MODE_RESIDENT &&
        w->pc.mode != REKV_MODE_CLO) {
        double room = (double)w->device_kv_room;
        if (w->pc.mode == REKV_MODE_INFINIGEN)
            room -= (double)w->max_batch *
                    (double)rekv_ig_partial_key_bytes(w->mc, w->pc.skew->rk, w->mc->max_pos);
        w->pc.device_tokens =
            w->device_tokens >= 0
                ? w->device_tokens
                : rekv_cost_device_tokens_of(room, w->max_batch, w->mc->max_pos, w->mc->hidden,
                                             rekv_config_kv_dim(w->mc), w->mc->n_layers,
                                             (double)rekv_dtype_size(w->pc.cache_dtype));
        rekv_log(REKV_LOG_INFO,
                 "each sequence keeps its first %d tokens' K,V on the device (of its room, for "
                 "%d sequences, beside a step's buffers)",
                 w->pc.device_tokens, w->max_batch);
    }
    if ((rc = rekv_pipeline_create(w->eng, w->be, w->kv, &w->pc, &w->pipe, err)) ||
        (rc = rekv_batcher_create(w->pipe, w->mc, w->max_batch, &w->batch, err)))
        return rc;
    w->wm.page_locked = rekv_pipeline_page_locked(w->pipe);
    double room = rekv_backend_kv_room(w->be, 0); /* what the weights (now there) leave */
    w->device_buffer_bytes = room > 0 ? (uint64_t)room : 0;
    return 0;
}

/* The coordinator chose our mode (we said Hello with "auto"): build the pipeline in it and say
 * Hello again with it. 0, or a negative errno with err filled when the worker cannot run so. */
static int take_assign(worker *w, const Rekv__Worker__Assign *a, rekv_err *err)
{
    rekv_mode m;
    if (a->mode == NULL || rekv_mode_parse(a->mode, &m))
        return rekv_errf(err, -EPROTO, "the coordinator assigned an unknown mode \"%s\"",
                         a->mode ? a->mode : "");
    if (m != REKV_MODE_RESIDENT && w->kv == NULL)
        return rekv_errf(err, -EPROTO,
                         "the coordinator assigned mode %s, which needs a kvstore, and this "
                         "worker has none",
                         a->mode);
    if (rekv_mode_approximate(m) && !w->approximate)
        return rekv_errf(err, -EPROTO,
                         "the coordinator assigned the approximate mode %s, and this worker was "
                         "not started with --approximate",
                         a->mode);
    rekv_log(REKV_LOG_INFO, "mode auto: the coordinator chose %s (%s)", a->mode,
             a->reason && *a->reason ? a->reason : "no reason given");
    w->pc.mode = m;
    if (m == REKV_MODE_INFINIGEN) /* layer 0's split: it decides whether activations are kept */
        w->pc.split = (int)a->split;
    int rc = start_pipeline(w, err);
    if (rc == 0)
        send_hello(w);
    return rc;
}

int main(int argc, char **argv)
{
    rekv_log_init_from_env();
    const char *model_path = NULL, *coord = NULL, *kv_ep = NULL, *backend = "auto",
               *mode_s = "auto", *name = NULL;
    uint32_t max_batch = 64, hb_ms = 500, ready_fd = UINT32_MAX, kv_timeout_ms = 30000;
    enum {
        O_MODEL = 1000,
        O_COORD,
        O_KV,
        O_BACKEND,
        O_MODE,
        O_BATCH,
        O_NAME,
        O_HB,
        O_READY,
        O_LINK_GBPS,
        O_LINK_LAT,
        O_DEVMEM,
        O_DEVTOK,
        O_PUSH,
        O_APPROX,
        O_KV_TIMEOUT,
        O_METRICS,
        O_METRICS_PUBLIC,
        O_HELP,
        O_VERSION
    };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL},
        {"coordinator", required_argument, 0, O_COORD},
        {"kvstore", required_argument, 0, O_KV},
        {"backend", required_argument, 0, O_BACKEND},
        {"mode", required_argument, 0, O_MODE},
        {"max-batch", required_argument, 0, O_BATCH},
        {"name", required_argument, 0, O_NAME},
        {"heartbeat-ms", required_argument, 0, O_HB},
        {"ready-fd", required_argument, 0, O_READY},
        {"link-gbps", required_argument, 0, O_LINK_GBPS},
        {"link-latency-us", required_argument, 0, O_LINK_LAT},
        {"device-memory", required_argument, 0, O_DEVMEM},
        {"device-tokens", required_argument, 0, O_DEVTOK},
        {"push", no_argument, 0, O_PUSH},
        {"approximate", no_argument, 0, O_APPROX},
        {"kvstore-timeout-ms", required_argument, 0, O_KV_TIMEOUT},
        {"metrics", required_argument, 0, O_METRICS},
        {"metrics-public", no_argument, 0, O_METRICS_PUBLIC},
        {"help", no_argument, 0, O_HELP},
        {"version", no_argument, 0, O_VERSION},
        {0, 0, 0, 0},
    };
    rekv_link_config link = REKV_LINK_NONE;
    int push = 0, approximate = 0, metrics_public = 0, device_tokens = -1;
    const char *metrics_listen = NULL;
    int o;
    int opt_i = 0;
    while ((o = getopt_long(argc, argv, "", opts, &opt_i)) != -1) {
        int bad = 0;
        switch (o) {
        case O_LINK_GBPS:
        case O_LINK_LAT:
        case O_DEVMEM: {
            rekv_err lerr = {0};
            if (rekv_link_parse(&link, opts[opt_i].name, optarg, &lerr)) {
                fprintf(stderr, "rekv-gpuworker: %s\n", lerr.msg);
                return 2;
            }
            break;
        }
        case O_PUSH:
            push = 1;
            break;
        case O_APPROX:
            approximate = 1;
            break;
        case O_METRICS:
            metrics_listen = optarg;
            break;
        case O_METRICS_PUBLIC:
            metrics_public = 1;
            break;
        case O_DEVTOK: {
            uint32_t v = 0;
            bad = rekv_parse_u32(optarg, &v) || v > (1u << 24);
            device_tokens = (int)v;
            break;
        }
        case O_MODEL:
            model_path = optarg;
            break;
        case O_COORD:
            coord = optarg;
            break;
        case O_KV:
            kv_ep = optarg;
            break;
        case O_BACKEND:
            backend = optarg;
            break;
        case O_MODE:
            mode_s = optarg;
            break;
        case O_BATCH:
            bad = rekv_parse_u32(optarg, &max_batch) || max_batch == 0 || max_batch > 4096;
            break;
        case O_NAME:
            name = optarg;
            break;
        case O_HB:
            bad = rekv_parse_u32(optarg, &hb_ms) || hb_ms == 0;
            break;
        case O_READY:
            bad = rekv_parse_u32(optarg, &ready_fd);
            break;
        case O_KV_TIMEOUT:
            bad = rekv_parse_u32(optarg, &kv_timeout_ms) || kv_timeout_ms == 0 ||
                  kv_timeout_ms > 3600000;
            break;
        case O_HELP:
            usage(stdout);
            return 0;
        case O_VERSION:
            printf("rekv-gpuworker %s\n", rekv_version());
            return 0;
        default:
            usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "rekv-gpuworker: bad value '%s'\n", optarg);
            return 2;
        }
    }
    if (model_path == NULL || optind != argc) {
        usage(stderr);
        return 2;
    }
    if (strcmp(backend, "auto") != 0 && strcmp(backend, "cpu") != 0 &&
        strcmp(backend, "cuda") != 0) {
        fprintf(stderr, "rekv-gpuworker: --backend %s: expected auto, cpu or cuda\n", backend);
        return 2;
    }
    worker w = {0};
    rekv_pipeline_config *pc = &w.pc;
    rekv_pipeline_config_defaults(pc);
    int auto_mode = strcmp(mode_s, "auto") == 0;
    if (!auto_mode && rekv_mode_parse(mode_s, &pc->mode)) {
        fprintf(stderr, "rekv-gpuworker: --mode %s: unknown mode\n", mode_s);
        return 2;
    }
    char def_ep[4200], def_name[64];
    if (coord == NULL) {
        const char *x = getenv("XDG_RUNTIME_DIR");
        snprintf(def_ep, sizeof(def_ep), "ipc://%s/rekv/workers", x && *x ? x : "/run");
        coord = def_ep;
    }
    if (name == NULL) {
        char host[32] = "host";
        gethostname(host, sizeof(host) - 1);
        snprintf(def_name, sizeof(def_name), "%s-%d", host, (int)getpid());
        name = def_name;
    }
    int sfd = rekv_daemon_stop_fd();
    if (sfd < 0) {
        rekv_log(REKV_LOG_ERROR, "stop eventfd: %s", strerror(-sfd));
        return 1;
    }
    int rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    rekv_backend *be = NULL;
    rekv_kvstore_client *kv = NULL;
    void *zctx = NULL;
    w.name = name;
    w.model = model_path;
    w.max_batch = (int)max_batch;
    w.hb_ms = hb_ms;
    w.push = push;
    w.approximate = approximate;
    w.device_tokens = device_tokens;
    w.mode = "auto";
    w.kv_ep = kv_ep;
    w.kv_timeout_ms = (int)kv_timeout_ms;
    w.stop_fd = sfd;
    int src = stepper_start(&w.stepper);
    if (src)
        rekv_log(REKV_LOG_WARN,
                 "no step thread (%s): steps run on the loop's thread, without "
                 "heartbeats during a step",
                 strerror(-src));
    if (rekv_model_open(model_path, &model, &err) || rekv_engine_create(model, &eng, &err))
        goto fail;
    w.eng = eng;
    w.mc = rekv_engine_config(eng);
    if (kv_ep) {
        /* started beside the store (`rekv run` starts the daemons at once): wait for its socket
         * while there is none or nobody listens yet, up to KV_WAIT_MS, stopping on a signal */
        uint64_t until = rekv_now_ns() + KV_WAIT_MS * 1000000ull;
        int crc;
        while ((crc = rekv_kvstore_client_connect(kv_ep, NULL, (int)kv_timeout_ms, &kv, &err)) ==
                   -ENOENT ||
               crc == -ECONNREFUSED) {
            struct pollfd sp = {sfd, POLLIN, 0};
            if (rekv_now_ns() > until)
                break;
            if (poll(&sp, 1, 20) > 0) { /* asked to stop */
                rc = 0;
                goto out;
            }
            rekv_err_clear(&err);
        }
        if (crc)
            goto fail;
        rekv_kv_geometry g;
        rekv_kvstore_client_geometry(kv, &g);
        pc->cache_dtype = g.dtype; /* the store's arena decides the cache dtype */
        /* our sequences are ours by name: what a dead worker of this name left goes now (one of
         * another name loses its sequences when its lease runs out) */
        uint64_t n_seqs = 0, n_blocks = 0;
        if (rekv_kvstore_client_set_owner(kv, name, &err) ||
            rekv_kvstore_drop_owner(kv, name, &n_seqs, &n_blocks, &err))
            goto fail;
        if (n_seqs)
            rekv_log(REKV_LOG_WARN,
                     "kvstore: dropped %llu sequences (%llu blocks) that a previous "
                     "worker named %s left",
                     (unsigned long long)n_seqs, (unsigned long long)n_blocks, name);
        uint64_t lease_ms = rekv_kvstore_client_header(kv)->lease_ms;
        w.renew_ns = lease_ms / 4 * 1000000ull;
        if (w.renew_ns < 10000000ull)
            w.renew_ns = 10000000ull;
        if (w.renew_ns > 1000000000ull)
            w.renew_ns = 1000000000ull;
        w.kv = kv; /* w.kv from here on: the loop may replace it (kv_reconnect) */
        kv = NULL;
        w.last_renew_ns = rekv_now_ns();
        kv_room_fetch(&w);
    } else if (!auto_mode && pc->mode != REKV_MODE_RESIDENT) {
        rekv_log(REKV_LOG_ERROR, "--mode %s keeps the KV cache in the kvstore: give --kvstore",
                 mode_s);
        goto out;
    }
    char note[1200];
    if (rekv_backend_create(backend, &link, &be, note, sizeof(note), &err))
        goto fail;
    if (note[0])
        rekv_log(REKV_LOG_INFO, "%s", note);
    w.be = be;
    rekv_worker_metrics_init(&w.wm, be, name, &w.mode);
    if (metrics_listen) {
        rekv_metrics_server_opts mo = {.allow_remote = metrics_public};
        if (rekv_metrics_server_create_opts(metrics_listen, &mo, &w.metrics, &err))
            goto fail;
        rekv_log(REKV_LOG_INFO, "metrics on %s (GET /metrics)", metrics_listen);
    }
    {
        /* the planner prices this worker's steps with what it measures here (cached on disk) */
        rekv_profile prof;
        rekv_profile_origin origin;
        if (rekv_profile_get(w.mc, be->iface->name, &link, NULL, 0, &prof, &origin, &err))
            goto fail;
        rekv_profile_to_cost(&prof, pc->cache_dtype, &w.cost);
        if (!pc->offload_weights)
            w.cost.t_load_w = 0;
    }
    /* the device's room for the KV cache, for the coordinator's mode choice: what is free less
     * the weights when they will live on the device (they are not there yet) */
    w.device_kv_room =
        rekv_backend_kv_room(be, pc->offload_weights ? 0 : (double)rekv_engine_weight_bytes(eng));
    if (!auto_mode && start_pipeline(&w, &err))
        goto fail;
    zctx = zmq_ctx_new();
    w.sock = zctx ? zmq_socket(zctx, ZMQ_DEALER) : NULL;
    int linger = 0, ivl = 100;
    if (w.sock == NULL) {
        rekv_log(REKV_LOG_ERROR, "zmq socket: %s", zmq_strerror(errno));
        goto out;
    }
    zmq_setsockopt(w.sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(w.sock, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
    const char *ckey = NULL;
    if (rekv_curve_server_key(coord, &ckey, &err) ||
        (ckey && rekv_curve_client(w.sock, ckey, &err))) {
        rekv_log(REKV_LOG_ERROR, "%s: %s", coord, err.msg);
        goto out;
    }
    if (zmq_connect(w.sock, coord) != 0) {
        rekv_log(REKV_LOG_ERROR, "%s: connect: %s", coord, zmq_strerror(errno));
        goto out;
    }
    send_hello(&w);
    rekv_log(REKV_LOG_INFO,
             "%s: %s, %d layers, vocab %d, context %d; %s backend, %s mode%s, batch "
             "of %u; coordinator %s%s%s",
             name, model_path, w.mc->n_layers, w.mc->vocab, w.mc->max_pos, be->iface->name, w.mode,
             w.pipe ? "" : " (the coordinator chooses)", max_batch, coord,
             kv_ep ? ", kvstore " : "", kv_ep ? kv_ep : "");
    rekv_daemon_ready(ready_fd == UINT32_MAX ? -1 : (int)ready_fd);
    for (;;) {
        zmq_pollitem_t it[2 + REKV_METRICS_MAX_FDS] = {{w.sock, 0, ZMQ_POLLIN, 0},
                                                       {NULL, sfd, ZMQ_POLLIN, 0}};
        int m_fds[REKV_METRICS_MAX_FDS], m_n = metrics_items(&w, it, 2, m_fds);
        int r = zmq_poll(it, 2 + m_n, loop_timeout_ms(&w));
        if (r < 0 && errno != EINTR) {
            rekv_log(REKV_LOG_ERROR, "zmq_poll: %s", zmq_strerror(errno));
            goto out;
        }
        metrics_serve(&w, it, 2, m_fds, r > 0 ? m_n : 0);
        if (r > 0 && (it[1].revents & ZMQ_POLLIN)) {
            rekv_log(REKV_LOG_INFO, "signal: stopping");
            break;
        }
        int stop = 0;
        while (!stop) {
            zmq_msg_t msg;
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, w.sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&msg);
                break;
            }
            Rekv__Worker__CoordMsg *m =
                rekv__worker__coord_msg__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
            zmq_msg_close(&msg);
            if (m == NULL || m->version != WORKER_PROTO_VERSION) {
                static rekv_ratelimit rl = REKV_RATELIMIT_INIT;
                warn_rl(&rl, "a malformed message from the coordinator; ignored", "");
                if (m)
                    rekv__worker__coord_msg__free_unpacked(m, NULL);
                continue;
            }
            switch (m->body_case) {
            case REKV__WORKER__COORD_MSG__BODY_ASSIGN:
                if (w.pipe != NULL || !w.awaiting_welcome)
                    break; /* an answer to an earlier Hello: our mode is set */
                w.awaiting_welcome = 0;
                if (take_assign(&w, m->assign, &err)) {
                    rekv__worker__coord_msg__free_unpacked(m, NULL);
                    goto fail;
                }
                break;
            case REKV__WORKER__COORD_MSG__BODY_WELCOME:
                w.awaiting_welcome = 0;
                rekv_log(REKV_LOG_INFO, "the coordinator accepted us (session %llu)",
                         (unsigned long long)m->welcome->session);
                break;
            case REKV__WORKER__COORD_MSG__BODY_RESET:
                /* our Hello is on its way already: one answer per Hello — unless it went out four
                 * heartbeats ago, when the coordinator that got it died before answering and the
                 * one answering now never will (a live one answers within a loop round) */
                if (w.awaiting_welcome &&
                    rekv_now_ns() - w.hello_sent_ns < 4ull * w.hb_ms * 1000000ull)
                    break;
                if (w.batch) {
                    if (rekv_batcher_running(w.batch))
                        rekv_log(REKV_LOG_WARN, "the coordinator reset us: dropping %d jobs",
                                 rekv_batcher_running(w.batch));
                    rekv_batcher_clear(w.batch);
                }
                send_hello(&w);
                break;
            case REKV__WORKER__COORD_MSG__BODY_PLAN:
                /* not a Plan for the session our Hello ended, nor one before we have a mode */
                if (!w.awaiting_welcome && w.pipe != NULL)
                    run_plan(&w, m->plan);
                else if (!w.awaiting_welcome && w.kv_lost)
                    refuse_plan(&w, m->plan);
                break;
            case REKV__WORKER__COORD_MSG__BODY_SHUTDOWN:
                stop = 2;
                break;
            default:
                break;
            }
            rekv__worker__coord_msg__free_unpacked(m, NULL);
        }
        if (stop == 2) {
            rekv_log(REKV_LOG_INFO, "the coordinator asked us to stop");
            break;
        }
        if (rekv_now_ns() - w.last_sent_ns >= (uint64_t)hb_ms * 1000000ull)
            send_heartbeat(&w);
        /* the kvstore drops a silent client's pins, and a silent owner's sequences, after its
         * lease; stay known to it */
        kv_renew_due(&w);
        if (w.kv && rekv_kvstore_client_lost(w.kv))
            kv_lose(&w);
        kv_reconnect(&w);
        rekv_daemon_watchdog();
    }
    rc = 0;
    goto out;
fail:
    rekv_log(REKV_LOG_ERROR, "%s", err.msg);
out:
    rekv_daemon_stopping();
    stepper_stop(&w.stepper);
    rekv_metrics_server_free(w.metrics);
    if (w.sock)
        zmq_close(w.sock);
    if (zctx)
        zmq_ctx_term(zctx);
    rekv_batcher_free(w.batch);
    rekv_pipeline_free(w.pipe);
    rekv_skew_free(&w.skew);
    rekv_heads_free(&w.heads);
    rekv_backend_destroy(be);
    rekv_kvstore_client_close(w.kv); /* NULL while lost */
    rekv_kvstore_client_close(kv);   /* a start that failed before handing it to w */
    rekv_engine_free(eng);
    rekv_model_close(model);
    close(sfd);
    if (rc == 0)
        rekv_log(REKV_LOG_INFO, "stopped");
    return rc;
}
