/* coordinator_main.c — rekv-coordinator: parses the command line, blocks SIGTERM/SIGINT into a
 * stop eventfd (common/daemon.h), runs the coordinator loop, reports readiness (--ready-fd, sd_notify) and pets the
 * systemd watchdog. Everything else is coordinator.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/conncap.h"
#include "common/daemon.h"
#include "common/log.h"
#include "common/version.h"
#include "coordinator/coordinator.h"
#include "coordinator/http.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: rekv-coordinator [--control ENDPOINT] [--workers ENDPOINT] [--state-dir DIR]\n"
            "         [--model PATH] [--queue N] [--keep-finished N] [--keep-finished-bytes N]\n"
            "         [--worker-timeout-ms N] [--step-timeout-ms N] [--max-clients N]\n"
            "         [--max-attempts N] [--prefill-chunk N] [--curve-secret-file FILE]\n"
            "         [--ready-fd N]\n"
            "         [--metrics HOST:PORT [--metrics-public]]\n"
            "         [--http HOST:PORT [--http-public] [--api-key-file FILE]\n"
            "          [--served-model-name NAME]] [--help] [--version]\n"
            "Defaults: control ipc://$XDG_RUNTIME_DIR/rekv/control (or /run/rekv/control), workers\n"
            "beside it, no journal unless --state-dir (or $STATE_DIRECTORY) is given, queue 256.\n"
            "Finished jobs are remembered for Status (and their client keys honoured) up to\n"
            "--keep-finished jobs (1024) and --keep-finished-bytes of results (64 MiB), oldest\n"
            "forgotten first.\n"
            "A worker silent for --worker-timeout-ms (30000) is taken as dead, one whose step is\n"
            "not answered within --step-timeout-ms (300000) as hung: its jobs run again (failed\n"
            "after --max-attempts starts, 3) and it must say Hello again.\n"
            "A prompt runs at most --prefill-chunk tokens per step (512; the planner may choose\n"
            "fewer, about a decode step's worth; 0: whole prompts), so the running jobs keep\n"
            "streaming while it prefills.\n"
            "At most --max-clients connections (1024, less under a low RLIMIT_NOFILE) per socket\n"
            "are served; requests on more are answered BUSY, and past twice as many a connection\n"
            "is dropped as it comes.\n"
            "--model gives the tokenizer for text prompts. tcp:// endpoints off loopback need\n"
            "--curve-secret-file (a Z85 CurveZMQ secret key), which guards tcp:// endpoints\n"
            "only: ipc:// sockets (files: control 0660, its directory decides who may submit; workers\n"
            "0600) serve local clients and workers as before.\n"
            "--metrics serves Prometheus scrapes (GET /metrics) on a loopback address; another\n"
            "address (or :PORT, every interface) needs --metrics-public: scrapes are not\n"
            "authenticated.\n"
            "--http serves the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models,\n"
            "/health, /tokenize, /detokenize) as another client of the control socket, on a\n"
            "loopback address unless --http-public. --api-key-file: requests must carry\n"
            "'Authorization: Bearer KEY' (the file's first line). The model's name is --model's\n"
            "base name (a file's without extension) unless --served-model-name.\n");
}

static void on_event(void *ctx, rekv_co_event lvl, const char *msg)
{
    (void)ctx;
    rekv_log(lvl == REKV_CO_EVENT_ERROR  ? REKV_LOG_ERROR
             : lvl == REKV_CO_EVENT_WARN ? REKV_LOG_WARN
                                         : REKV_LOG_INFO,
             "%s", msg);
}

static void on_tick(void *ctx)
{
    (void)ctx;
    rekv_daemon_watchdog();
}

static void on_http_log(void *ctx, int level, const char *msg)
{
    (void)ctx;
    rekv_log((rekv_log_level)level, "http: %s", msg);
}

/* The key's first line (a trailing newline and spaces dropped); 0 or -1 after logging. */
static int read_api_key(const char *path, char *key, size_t n)
{
    FILE *f = fopen(path, "r");
    if (f == NULL || fgets(key, (int)n, f) == NULL) {
        rekv_log(REKV_LOG_ERROR, "%s: cannot read an API key: %s", path,
                 f ? "the file is empty" : strerror(errno));
        if (f)
            fclose(f);
        return -1;
    }
    fclose(f);
    size_t l = strlen(key);
    while (l && (key[l - 1] == '\n' || key[l - 1] == '\r' || key[l - 1] == ' '))
        key[--l] = '\0';
    if (l == 0) {
        rekv_log(REKV_LOG_ERROR, "%s: the API key is empty", path);
        return -1;
    }
    return 0;
}

/* The HTTP server, a client of the control socket through its in-process endpoint (a message
 * per streamed token: no socket and no I/O thread between the two). */
static int start_http(rekv_http_config *h, const rekv_coordinator_config *cfg,
                      rekv_coordinator *co, rekv_http **out)
{
    h->control_endpoint = rekv_coordinator_inproc_endpoint(co);
    h->zctx = rekv_coordinator_zctx(co);
    h->model_path = cfg->model_path;
    h->on_log = on_http_log;
    rekv_err err = {0};
    if (rekv_http_start(h, out, &err)) {
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
        return -1;
    }
    rekv_log(REKV_LOG_INFO, "http: OpenAI API on %s (port %d)%s", h->listen, rekv_http_port(*out),
             h->api_key ? ", API key required" : "");
    return 0;
}

/* --curve-secret-file: the 40-character Z85 secret key into key, its public key into pub; 0, or
 * 1 with an ERROR logged. */
static int read_curve_key(const char *path, char key[64], char pub[41])
{
    FILE *f = fopen(path, "r");
    if (f == NULL || fread(key, 1, 40, f) != 40) {
        rekv_log(REKV_LOG_ERROR, "%s: cannot read a 40-character Z85 key", path);
        if (f)
            fclose(f);
        return 1;
    }
    fclose(f);
    if (zmq_curve_public(pub, key) != 0) {
        rekv_log(REKV_LOG_ERROR, "%s: not a Z85 CurveZMQ secret key", path);
        return 1;
    }
    rekv_log(REKV_LOG_INFO, "CurveZMQ on tcp:// endpoints: clients need REKV_CURVE_SERVER_KEY=%s",
             pub);
    return 0;
}

int main(int argc, char **argv)
{
    rekv_log_init_from_env();
    rekv_coordinator_config cfg;
    rekv_coordinator_config_defaults(&cfg);
    const char *curve_file = NULL;
    uint32_t ready_fd = UINT32_MAX;
    rekv_http_config hcfg = {0};
    const char *api_key_file = NULL;
    enum { O_CONTROL = 1000, O_WORKERS, O_STATE, O_MODEL, O_QUEUE, O_KEEP, O_KEEP_BYTES, O_TIMEOUT,
           O_STEP_TIMEOUT, O_ATTEMPTS, O_CHUNK, O_MAX_CLIENTS, O_CURVE, O_READY, O_METRICS,
           O_METRICS_PUBLIC, O_HTTP, O_HTTP_PUBLIC, O_API_KEY, O_SERVED_NAME, O_HELP, O_VERSION };
    static const struct option opts[] = {
        {"control", required_argument, 0, O_CONTROL},
        {"workers", required_argument, 0, O_WORKERS},
        {"state-dir", required_argument, 0, O_STATE},
        {"model", required_argument, 0, O_MODEL},
        {"queue", required_argument, 0, O_QUEUE},
        {"keep-finished", required_argument, 0, O_KEEP},
        {"keep-finished-bytes", required_argument, 0, O_KEEP_BYTES},
        {"worker-timeout-ms", required_argument, 0, O_TIMEOUT},
        {"step-timeout-ms", required_argument, 0, O_STEP_TIMEOUT},
        {"max-attempts", required_argument, 0, O_ATTEMPTS},
        {"prefill-chunk", required_argument, 0, O_CHUNK},
        {"max-clients", required_argument, 0, O_MAX_CLIENTS},
        {"curve-secret-file", required_argument, 0, O_CURVE},
        {"ready-fd", required_argument, 0, O_READY},
        {"metrics", required_argument, 0, O_METRICS},
        {"metrics-public", no_argument, 0, O_METRICS_PUBLIC},
        {"http", required_argument, 0, O_HTTP},
        {"http-public", no_argument, 0, O_HTTP_PUBLIC},
        {"api-key-file", required_argument, 0, O_API_KEY},
        {"served-model-name", required_argument, 0, O_SERVED_NAME},
        {"help", no_argument, 0, O_HELP},
        {"version", no_argument, 0, O_VERSION},
        {0, 0, 0, 0},
    };
    int o, opt_i = 0;
    while ((o = getopt_long(argc, argv, "", opts, &opt_i)) != -1) {
        int bad = 0;
        switch (o) {
        case O_CONTROL: cfg.control_endpoint = optarg; break;
        case O_WORKERS: cfg.worker_endpoint = optarg; break;
        case O_STATE: cfg.state_dir = optarg; break;
        case O_MODEL: cfg.model_path = optarg; break;
        case O_QUEUE: bad = rekv_parse_u32(optarg, &cfg.queue_limit) || cfg.queue_limit == 0; break;
        case O_KEEP: bad = rekv_parse_u32(optarg, &cfg.keep_finished) || cfg.keep_finished == 0; break;
        case O_KEEP_BYTES: {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(optarg, &end, 10);
            bad = errno || end == optarg || *end || v == 0 || *optarg == '-';
            cfg.keep_finished_bytes = v;
            break;
        }
        /* the library reads 0 as its default: refused here instead */
        case O_TIMEOUT:
            bad = rekv_parse_u32(optarg, &cfg.worker_timeout_ms) || cfg.worker_timeout_ms == 0;
            break;
        case O_STEP_TIMEOUT:
            bad = rekv_parse_u32(optarg, &cfg.step_timeout_ms) || cfg.step_timeout_ms == 0;
            break;
        case O_ATTEMPTS:
            bad = rekv_parse_u32(optarg, &cfg.max_attempts) || cfg.max_attempts == 0;
            break;
        case O_CHUNK: bad = rekv_parse_u32(optarg, &cfg.prefill_chunk); break;
        case O_MAX_CLIENTS:
            bad = rekv_parse_u32(optarg, &cfg.max_clients) || cfg.max_clients == 0;
            break;
        case O_CURVE: curve_file = optarg; break;
        case O_READY: bad = rekv_parse_u32(optarg, &ready_fd); break;
        case O_METRICS: cfg.metrics_listen = optarg; break;
        case O_METRICS_PUBLIC: cfg.metrics_public = 1; break;
        case O_HTTP: hcfg.listen = optarg; break;
        case O_HTTP_PUBLIC: hcfg.allow_remote = 1; break;
        case O_API_KEY: api_key_file = optarg; break;
        case O_SERVED_NAME: bad = *optarg == '\0'; hcfg.served_model_name = optarg; break;
        case O_HELP: usage(stdout); return 0;
        case O_VERSION: printf("rekv-coordinator %s\n", rekv_version()); return 0;
        default: usage(stderr); return 2;
        }
        if (bad) {
            fprintf(stderr, "rekv-coordinator: --%s: bad value '%s'%s\n", opts[opt_i].name, optarg,
                    o == O_TIMEOUT || o == O_ATTEMPTS ? " (1 or more)" : "");
            return 2;
        }
    }
    if (optind != argc) {
        usage(stderr);
        return 2;
    }
    if (hcfg.listen == NULL && (hcfg.allow_remote || api_key_file || hcfg.served_model_name)) {
        fprintf(stderr, "rekv-coordinator: --http-public, --api-key-file and --served-model-name "
                        "go with --http\n");
        return 2;
    }
    char api_key[512];
    if (api_key_file && read_api_key(api_key_file, api_key, sizeof(api_key)))
        return 1;
    hcfg.api_key = api_key_file ? api_key : NULL;
    /* systemd's StateDirectory= */
    if (cfg.state_dir == NULL && getenv("STATE_DIRECTORY") && *getenv("STATE_DIRECTORY"))
        cfg.state_dir = getenv("STATE_DIRECTORY");
    char key[64] = {0}, curve_pub[41] = {0};
    if (curve_file && read_curve_key(curve_file, key, curve_pub))
        return 1;
    if (curve_file)
        cfg.curve_secret = key;
    int sfd = rekv_daemon_stop_fd();
    if (sfd < 0) {
        rekv_log(REKV_LOG_ERROR, "stop eventfd: %s", strerror(-sfd));
        return 1;
    }
    cfg.signal_fd = sfd;
    char why[320];
    if (rekv_conncap_lowered(cfg.max_clients, why, sizeof(why))) /* after the soft limit was raised */
        rekv_log(REKV_LOG_WARN, "%s", why);
    cfg.on_event = on_event;
    cfg.on_tick = on_tick;
    rekv_err err = {0};
    rekv_coordinator *co = NULL;
    if (rekv_coordinator_create(&cfg, &co, &err) < 0) {
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
        close(sfd);
        return 1;
    }
    rekv_log(REKV_LOG_INFO, "serving %s (workers on %s), queue %u, journal %s",
             rekv_coordinator_control_endpoint(co), rekv_coordinator_worker_endpoint(co),
             cfg.queue_limit, cfg.state_dir ? cfg.state_dir : "off");
    rekv_http *http = NULL;
    if (hcfg.listen && start_http(&hcfg, &cfg, co, &http)) {
        rekv_coordinator_destroy(co);
        close(sfd);
        return 1;
    }
    rekv_daemon_ready(ready_fd == UINT32_MAX ? -1 : (int)ready_fd);
    int rc = rekv_coordinator_run(co, &err);
    if (rc < 0)
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
    rekv_daemon_stopping();
    rekv_http_stop(http);
    rekv_coordinator_destroy(co);
    close(sfd);
    rekv_log(REKV_LOG_INFO, "stopped");
    return rc < 0 ? 1 : 0;
}
