/* worker_main.c — rekv-gpuworker: loads the model onto a backend, connects to the coordinator
 * (DEALER) and, for the offloaded modes, to the kvstore, and runs the coordinator's plans one step
 * at a time through a batcher (batcher.h), answering each with the tokens it produced. This file
 * is the program: its command line, its event loop (common/evloop.h) and its end. The loop
 * heartbeats to the coordinator and renews the kvstore lease, also while a step runs on its own
 * thread; says Hello again whenever the coordinator does not know it (worker_proto.c); runs Plans
 * (worker_plan.c); keeps the kvstore connection (worker_store.c: a lost store makes the worker
 * unavailable until it is back). What it holds is built by worker_start.c; the state they share
 * is worker_internal.h. SIGTERM or SIGINT stop it at once, or during a step once the step is over
 * (its kvstore requests aborted, so that is within its compute time). */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "common/log.h"
#include "common/version.h"
#include "gpuworker/worker_internal.h"

static void usage(FILE *f)
{
    fprintf(
        f, "usage: rekv-gpuworker --model PATH [--coordinator ENDPOINT] [--kvstore ENDPOINT]\n"
           "         [--backend auto|cpu|cuda]\n"
           "         [--mode auto|resident|offload|kvpr|act|hybrid|infinigen|clo] [--approximate]\n"
           "         [--max-batch N] [--name NAME] [--heartbeat-ms N]\n"
           "         [--link-gbps G] [--link-latency-us U] [--device-memory SIZE] [--push]\n"
           "         [--device-tokens N] [--prefix-cache on|off]\n"
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
           "In every mode the worker builds its pipeline once the coordinator has answered its\n"
           "first Hello: the device part and clo's persistent heads are the coordinator's.\n"
           "--link-gbps, --link-latency-us and --device-memory make the cpu backend behave like a\n"
           "GPU behind a link of that speed with that much memory (see rekv bench decode).\n"
           "--prefix-cache (on by default): a job starts from the kvstore's cached blocks of\n"
           "its prompt's longest cached prefix and prefills only the rest; jobs publish\n"
           "their full blocks as they fill. Every mode takes cached prefixes (resident loads\n"
           "their K,V into its device cache and publishes nothing of its own).\n"
           "--push: the kvstore (started with --push-backend) writes the KV rows into this\n"
           "worker's buffers instead of the worker copying them (modes other than resident).\n"
           "A step runs the whole batch at once; tokens equal `rekv generate --local`.\n"
           "--metrics serves Prometheus scrapes (GET /metrics) on a loopback address, also while\n"
           "a step runs; another address (or :PORT) needs --metrics-public: scrapes are not\n"
           "authenticated.\n");
}

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
    O_PREFIX,
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
    {"prefix-cache", required_argument, 0, O_PREFIX},
    {"push", no_argument, 0, O_PUSH},
    {"approximate", no_argument, 0, O_APPROX},
    {"kvstore-timeout-ms", required_argument, 0, O_KV_TIMEOUT},
    {"metrics", required_argument, 0, O_METRICS},
    {"metrics-public", no_argument, 0, O_METRICS_PUBLIC},
    {"help", no_argument, 0, O_HELP},
    {"version", no_argument, 0, O_VERSION},
    {0, 0, 0, 0},
};

/* What the command line says beyond the worker's own fields. */
typedef struct worker_args {
    wk_start_args start;
    const char *mode;
    uint32_t max_batch, hb_ms, ready_fd, kv_timeout_ms;
    char def_ep[4200], def_name[64];
} worker_args;

/* One option: -1 to go on, else the exit code (0 after --help and --version). */
static int parse_option(worker *w, worker_args *a, int o, const char *name, const char *arg)
{
    int bad = 0;
    uint32_t v = 0;
    switch (o) {
    case O_LINK_GBPS:
    case O_LINK_LAT:
    case O_DEVMEM: {
        rekv_err lerr = {0};
        if (rekv_link_parse(&a->start.link, name, arg, &lerr)) {
            fprintf(stderr, "rekv-gpuworker: %s\n", lerr.msg);
            return 2;
        }
        break;
    }
    case O_PUSH:
        w->push = 1;
        break;
    case O_APPROX:
        w->approximate = 1;
        break;
    case O_METRICS:
        a->start.metrics_listen = arg;
        break;
    case O_METRICS_PUBLIC:
        a->start.metrics_public = 1;
        break;
    case O_PREFIX:
        bad = strcmp(arg, "on") != 0 && strcmp(arg, "off") != 0;
        w->pc.prefix_cache = strcmp(arg, "on") == 0;
        break;
    case O_DEVTOK:
        bad = rekv_parse_u32(arg, &v) || v > (1u << 24);
        w->device_tokens = (int)v;
        break;
    case O_MODEL:
        a->start.model_path = arg;
        break;
    case O_COORD:
        a->start.coord = arg;
        break;
    case O_KV:
        w->kv_ep = arg;
        break;
    case O_BACKEND:
        a->start.backend = arg;
        break;
    case O_MODE:
        a->mode = arg;
        break;
    case O_BATCH:
        bad = rekv_parse_u32(arg, &a->max_batch) || a->max_batch == 0 || a->max_batch > 4096;
        break;
    case O_NAME:
        /* the kvstore's owner name: non-empty (empty is no owner) and within its limit */
        bad = *arg == '\0' || strlen(arg) > REKV_KV_OWNER_MAX;
        w->name = arg;
        break;
    case O_HB:
        bad = rekv_parse_u32(arg, &a->hb_ms) || a->hb_ms == 0;
        break;
    case O_READY:
        bad = rekv_parse_u32(arg, &a->ready_fd);
        break;
    case O_KV_TIMEOUT:
        bad = rekv_parse_u32(arg, &a->kv_timeout_ms) || a->kv_timeout_ms == 0 ||
              a->kv_timeout_ms > 3600000;
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
        if (o == O_NAME)
            fprintf(stderr, "rekv-gpuworker: --name: bad value '%s' (1 to %d bytes)\n", arg,
                    REKV_KV_OWNER_MAX);
        else
            fprintf(stderr, "rekv-gpuworker: --%s: bad value '%s'\n", name, arg);
        return 2;
    }
    return -1;
}

/* The command line into w and a: -1 to go on, else the exit code. */
static int parse_args(worker *w, worker_args *a, int argc, char **argv)
{
    a->start.backend = "auto";
    a->start.link = REKV_LINK_NONE;
    a->mode = "auto";
    a->max_batch = 64;
    a->hb_ms = 500;
    a->ready_fd = UINT32_MAX;
    a->kv_timeout_ms = 30000;
    w->device_tokens = -1;
    rekv_pipeline_config_defaults(&w->pc);
    w->pc.prefix_cache = 1;
    int o, opt_i = 0, rc;
    while ((o = getopt_long(argc, argv, "", opts, &opt_i)) != -1)
        if ((rc = parse_option(w, a, o, opts[opt_i].name, optarg)) >= 0)
            return rc;
    if (a->start.model_path == NULL || optind != argc) {
        usage(stderr);
        return 2;
    }
    const char *be = a->start.backend;
    if (strcmp(be, "auto") != 0 && strcmp(be, "cpu") != 0 && strcmp(be, "cuda") != 0) {
        fprintf(stderr, "rekv-gpuworker: --backend %s: expected auto, cpu or cuda\n", be);
        return 2;
    }
    a->start.auto_mode = strcmp(a->mode, "auto") == 0;
    if (!a->start.auto_mode && rekv_mode_parse(a->mode, &w->pc.mode)) {
        fprintf(stderr, "rekv-gpuworker: --mode %s: unknown mode\n", a->mode);
        return 2;
    }
    if (a->start.coord == NULL) {
        const char *x = getenv("XDG_RUNTIME_DIR");
        snprintf(a->def_ep, sizeof(a->def_ep), "ipc://%s/rekv/workers", x && *x ? x : "/run");
        a->start.coord = a->def_ep;
    }
    if (w->name == NULL) {
        char host[32] = "host";
        gethostname(host, sizeof(host) - 1);
        snprintf(a->def_name, sizeof(a->def_name), "%s-%d", host, (int)getpid());
        w->name = a->def_name;
    }
    w->model = a->start.model_path;
    w->max_batch = (int)a->max_batch;
    w->hb_ms = a->hb_ms;
    w->mode = "auto";
    w->kv_timeout_ms = (int)a->kv_timeout_ms;
    return -1;
}

/* How long the loop may sleep: until the next heartbeat, lease renewal or reconnection is due
 * (rounded up). */
static long loop_timeout_ms(const worker *w)
{
    uint64_t now = rekv_now_ns(), due = w->last_sent_ns + (uint64_t)w->hb_ms * 1000000ull;
    if (w->kv && w->last_renew_ns + w->renew_ns < due)
        due = w->last_renew_ns + w->renew_ns;
    if (w->kv_lost && w->next_reconnect_ns < due)
        due = w->next_reconnect_ns;
    return due > now ? (long)((due - now + 999999) / 1000000) : 0;
}

/* The end of every round: a heartbeat when due, the kvstore lease (the step's pins too), and,
 * unless a step runs, the store's loss and the reconnection; then the wake-up is set for what is
 * due next. */
static void before_sleep(rekv_evloop *loop, void *ctx)
{
    worker *w = ctx;
    if (rekv_now_ns() - w->last_sent_ns >= (uint64_t)w->hb_ms * 1000000ull)
        wk_send_heartbeat(w);
    /* the kvstore drops a silent client's pins, and a silent owner's sequences, after its
     * lease; stay known to it */
    wk_kv_renew_due(w);
    if (w->cur.msg == NULL) {
        if (w->kv && rekv_kvstore_client_lost(w->kv))
            wk_kv_lose(w);
        wk_kv_reconnect(w);
        wk_kv_room_due(w);
    }
    rekv_daemon_watchdog();
    rekv_evloop_timer_set(loop, w->wake_timer, loop_timeout_ms(w));
}

/* Only bounds the sleep: before_sleep does what is due. */
static long on_wake(rekv_evloop *loop, void *ctx)
{
    return loop_timeout_ms(ctx);
}

static void on_signal(rekv_evloop *loop, void *ctx, int signo)
{
    worker *w = ctx;
    if (w->cur.msg == NULL) {
        rekv_log(REKV_LOG_INFO, "signal: stopping");
        rekv_evloop_stop(loop);
    } else if (!w->stopping) {
        /* stopping: the step's compute ends by itself, its kvstore waits are cut short */
        w->stopping = 1;
        rekv_log(REKV_LOG_INFO, "signal: stopping after this step");
        if (w->kv)
            rekv_kvstore_client_abort(w->kv);
    }
}

/* The loop: the step thread's done fd first (a step's end before a stop that came with it), the
 * stop signals, the coordinator's socket; the wake-up timer; the scrape port. */
static int loop_setup(worker *w, rekv_err *err)
{
    int rc;
    if ((rc = rekv_evloop_create(&w->loop, err)))
        return rc;
    if (w->stepper.started && (rc = rekv_evloop_add_fd(w->loop, w->stepper.done_fd, ZMQ_POLLIN,
                                                       wk_on_step_done, w, err)) < 0)
        return rc;
    if ((rc = rekv_evloop_add_signal_fd(w->loop, w->stop_fd, on_signal, w, err)) < 0 ||
        (rc = w->sock_id =
             rekv_evloop_add_socket(w->loop, w->sock, ZMQ_POLLIN, wk_on_coordinator, w, err)) < 0 ||
        (rc = w->wake_timer = rekv_evloop_timer_add(w->loop, 0, on_wake, w, err)) < 0)
        return rc;
    rekv_evloop_before_sleep(w->loop, before_sleep, w);
    rekv_evloop_serve_metrics(w->loop, w->metrics, rekv_worker_metrics_render, &w->wm);
    return 0;
}

/* Everything the worker holds, in the reverse order of its making. */
static void worker_close(worker *w, rekv_model *model, void *zctx)
{
    wk_stepper_stop(&w->stepper);
    if (w->ahead)
        rekv__worker__coord_msg__free_unpacked(w->ahead, NULL);
    rekv_evloop_free(w->loop);
    rekv_metrics_server_free(w->metrics);
    if (w->sock)
        zmq_close(w->sock);
    if (zctx)
        zmq_ctx_term(zctx);
    /* the sequences' drops: quick on a healthy store; on one that hangs, a stop waits at most a
     * second for the first (which then marks the client lost: the rest fail at once), and the
     * store's lease expiry frees what is left */
    if (w->kv)
        rekv_kvstore_client_set_timeout(w->kv, 1000);
    rekv_batcher_free(w->batch);
    rekv_pipeline_free(w->pipe);
    rekv_skew_free(&w->skew);
    rekv_heads_free(&w->heads);
    rekv_backend_destroy(w->be);
    rekv_kvstore_client_close(w->kv); /* NULL while lost */
    rekv_engine_free(w->eng);
    rekv_model_close(model);
}

int main(int argc, char **argv)
{
    rekv_log_init_from_env();
    worker w = {0};
    worker_args a = {0};
    int rc = parse_args(&w, &a, argc, argv);
    if (rc >= 0)
        return rc;
    int sfd = rekv_daemon_stop_fd();
    if (sfd < 0) {
        rekv_log(REKV_LOG_ERROR, "stop eventfd: %s", strerror(-sfd));
        return 1;
    }
    w.stop_fd = sfd;
    int src = wk_stepper_start(&w.stepper);
    if (src)
        rekv_log(REKV_LOG_WARN,
                 "no step thread (%s): steps run on the loop's thread, without "
                 "heartbeats during a step",
                 strerror(-src));
    rekv_err err = {0};
    rekv_model *model = NULL;
    void *zctx = NULL;
    rc = wk_start(&w, &a.start, &model, &zctx, &err);
    if (rc == 0)
        rc = loop_setup(&w, &err);
    if (rc == 0) {
        wk_send_hello(&w);
        rekv_log(REKV_LOG_INFO,
                 "%s: %s, %d layers, vocab %d, context %d; %s backend, %s mode%s, batch "
                 "of %u; coordinator %s%s%s",
                 w.name, w.model, w.mc->n_layers, w.mc->vocab, w.mc->max_pos, w.be->iface->name,
                 w.mode, a.start.auto_mode ? " (the coordinator chooses)" : "", a.max_batch,
                 a.start.coord, w.kv_ep ? ", kvstore " : "", w.kv_ep ? w.kv_ep : "");
        rekv_daemon_ready(a.ready_fd == UINT32_MAX ? -1 : (int)a.ready_fd);
        rc = rekv_evloop_run(w.loop, &err);
    }
    if (rc < 0)
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
    rekv_daemon_stopping();
    worker_close(&w, model, zctx);
    close(sfd);
    if (rc == 1) /* asked to stop while waiting for the kvstore */
        rc = 0;
    if (rc == 0 && w.exit_code == 0)
        rekv_log(REKV_LOG_INFO, "stopped");
    return rc < 0 ? 1 : w.exit_code;
}
