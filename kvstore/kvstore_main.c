/* kvstore_main.c — rekv-kvstore, the host-memory block store daemon: parses the command line,
 * stops on SIGTERM/SIGINT through common/daemon.h, runs the server loop, and reports readiness
 * (--ready-fd, sd_notify). Everything else is the kvstore library (its loop: kvstore/server.c). */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/conncap.h"
#include "common/daemon.h"
#include "common/log.h"
#include "common/version.h"
#include "kvstore/kvstore.h"
#include "kvstore/remote.h"
#include "loader/loader.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: rekv-kvstore --endpoint ipc:///path --host-bytes N [--spill-dir DIR]\n"
               "         [--spill-bytes N] [--no-spill] [--prefix-dir DIR]\n"
               "         [--model PATH | --layers N --kv-heads K\n"
               "         --head-dim D --hidden H] [--cache-dtype f16|f32|int8|int4]\n"
               "         [--huge-pages]\n"
               "         [--lease-ms N] [--fd-socket PATH] [--high-pct P] [--low-pct P]\n"
               "         [--no-register-arena] [--ready-fd N] [--push-backend cpu|cuda|auto]\n"
               "         [--push-link-gbps G] [--push-link-latency-us U]\n"
               "         [--metrics HOST:PORT [--metrics-public]] [--max-clients N]\n"
               "         [--remote redis://HOST:PORT[/DB] | unix:///PATH[?db=N]]\n"
               "         [--remote-timeout-ms N] [--remote-ttl-s N]\n"
               "         [--kv-events tcp://HOST:PORT|ipc://PATH [--kv-events-topic T]\n"
               "         [--kv-events-format map|array] [--kv-events-replay ENDPOINT]]\n"
               "         [--help] [--version]\n"
               "Sizes take K, M, G suffixes (powers of two). --prefix-dir: the prefix cache\n"
               "survives a restart (DIR/spill.rekv, DIR/index.rekv): a clean stop writes it to\n"
               "disk, a crash keeps what was there; each block is CRC32C-checked at the start.\n"
               "--push-link-gbps makes the cpu push backend's copies take the time a link of\n"
               "G Gbit/s (and U us per copy) would.\n"
               "--metrics serves Prometheus scrapes (GET /metrics) on a loopback address; another\n"
               "address (or :PORT, every interface) needs --metrics-public: scrapes are not\n"
               "authenticated.\n"
               "At most --max-clients connections (1024, less under a low RLIMIT_NOFILE) are\n"
               "served; requests on more are answered EBUSY, and past twice as many a connection\n"
               "is dropped as it comes.\n"
               "--remote: a Redis (or Valkey) that replicas of the same model share: prefix\n"
               "cache entries are written there in the background (SET with EX --remote-ttl-s,\n"
               "default 3600) and read back on a miss here; a read waits at most\n"
               "--remote-timeout-ms (default 50, at most 10000), and Redis down, slow or full\n"
               "costs a job only the blocks it computes.\n"
               "--kv-events publishes the prefix cache's blocks (BlockStored, BlockRemoved,\n"
               "AllBlocksCleared) in vLLM's KV events format for KV-aware routers (llm-d,\n"
               "Dynamo): bound when the endpoint has a wildcard (tcp://*:5557) or is ipc://,\n"
               "else connected. Events are tagged maps, as vLLM v0.26 sends them;\n"
               "--kv-events-format array: the positional events of vLLM before its PR #42892,\n"
               "for subscribers that decode only those. --kv-events-replay: vLLM's replay\n"
               "socket (ZeroMQ ROUTER, bound): the last 10,000 batches sent again on request.\n");
}

static void on_event(void *ctx, rekv_kv_event lvl, const char *msg)
{
    (void)ctx;
    rekv_log(lvl == REKV_KV_EVENT_ERROR  ? REKV_LOG_ERROR
             : lvl == REKV_KV_EVENT_WARN ? REKV_LOG_WARN
                                         : REKV_LOG_INFO,
             "%s", msg);
}

static void on_tick(void *ctx)
{
    (void)ctx;
    rekv_daemon_watchdog();
}

/* What the command line says. */
typedef struct kv_args {
    rekv_kvstore_config cfg;
    const char *model, *dtype;
    uint64_t layers, kv_heads, head_dim, hidden, host_bytes;
    int ready_fd;
    int high_given, low_given;
} kv_args;

enum {
    O_ENDPOINT = 1000,
    O_HOST,
    O_SPILL_DIR,
    O_SPILL_BYTES,
    O_NO_SPILL,
    O_PREFIX_DIR,
    O_MODEL,
    O_LAYERS,
    O_KV_HEADS,
    O_HEAD_DIM,
    O_HIDDEN,
    O_DTYPE,
    O_HUGE,
    O_LEASE,
    O_FD_SOCKET,
    O_HIGH,
    O_LOW,
    O_NO_REG,
    O_READY,
    O_PUSH,
    O_PUSH_GBPS,
    O_PUSH_LAT,
    O_METRICS,
    O_METRICS_PUBLIC,
    O_MAX_CLIENTS,
    O_REMOTE,
    O_REMOTE_TIMEOUT,
    O_REMOTE_TTL,
    O_KV_EVENTS,
    O_KV_EVENTS_TOPIC,
    O_KV_EVENTS_FORMAT,
    O_KV_EVENTS_REPLAY,
    O_HELP,
    O_VERSION
};

static const struct option opts[] = {
    {"endpoint", required_argument, 0, O_ENDPOINT},
    {"host-bytes", required_argument, 0, O_HOST},
    {"spill-dir", required_argument, 0, O_SPILL_DIR},
    {"spill-bytes", required_argument, 0, O_SPILL_BYTES},
    {"no-spill", no_argument, 0, O_NO_SPILL},
    {"prefix-dir", required_argument, 0, O_PREFIX_DIR},
    {"model", required_argument, 0, O_MODEL},
    {"layers", required_argument, 0, O_LAYERS},
    {"kv-heads", required_argument, 0, O_KV_HEADS},
    {"head-dim", required_argument, 0, O_HEAD_DIM},
    {"hidden", required_argument, 0, O_HIDDEN},
    {"cache-dtype", required_argument, 0, O_DTYPE},
    {"huge-pages", no_argument, 0, O_HUGE},
    {"lease-ms", required_argument, 0, O_LEASE},
    {"fd-socket", required_argument, 0, O_FD_SOCKET},
    {"high-pct", required_argument, 0, O_HIGH},
    {"low-pct", required_argument, 0, O_LOW},
    {"no-register-arena", no_argument, 0, O_NO_REG},
    {"ready-fd", required_argument, 0, O_READY},
    {"push-backend", required_argument, 0, O_PUSH},
    {"push-link-gbps", required_argument, 0, O_PUSH_GBPS},
    {"push-link-latency-us", required_argument, 0, O_PUSH_LAT},
    {"metrics", required_argument, 0, O_METRICS},
    {"metrics-public", no_argument, 0, O_METRICS_PUBLIC},
    {"max-clients", required_argument, 0, O_MAX_CLIENTS},
    {"remote", required_argument, 0, O_REMOTE},
    {"remote-timeout-ms", required_argument, 0, O_REMOTE_TIMEOUT},
    {"remote-ttl-s", required_argument, 0, O_REMOTE_TTL},
    {"kv-events", required_argument, 0, O_KV_EVENTS},
    {"kv-events-topic", required_argument, 0, O_KV_EVENTS_TOPIC},
    {"kv-events-format", required_argument, 0, O_KV_EVENTS_FORMAT},
    {"kv-events-replay", required_argument, 0, O_KV_EVENTS_REPLAY},
    {"help", no_argument, 0, O_HELP},
    {"version", no_argument, 0, O_VERSION},
    {0, 0, 0, 0},
};

/* A numeric option: 1 when its value is bad. */
static int parse_number(kv_args *a, int o, const char *arg)
{
    uint64_t v = 0;
    int bad;
    switch (o) {
    case O_MAX_CLIENTS:
        return rekv_parse_u32(arg, &a->cfg.max_clients) || a->cfg.max_clients == 0;
    case O_REMOTE_TIMEOUT: /* 0 would be the library's default: refused; a parked request waits
                            * this long, and a client gives up on the store after its own */
        return rekv_parse_u32(arg, &a->cfg.remote_timeout_ms) || a->cfg.remote_timeout_ms == 0 ||
               a->cfg.remote_timeout_ms > 10000;
    case O_REMOTE_TTL:
        return rekv_parse_u32(arg, &a->cfg.remote_ttl_s) || a->cfg.remote_ttl_s == 0;
    case O_HOST:
        return rekv_parse_size(arg, &a->host_bytes);
    case O_SPILL_BYTES:
        return rekv_parse_size(arg, &a->cfg.spill_bytes);
    case O_LAYERS:
        return rekv_parse_size(arg, &a->layers);
    case O_KV_HEADS:
        return rekv_parse_size(arg, &a->kv_heads);
    case O_HEAD_DIM:
        return rekv_parse_size(arg, &a->head_dim);
    case O_HIDDEN:
        return rekv_parse_size(arg, &a->hidden);
    }
    bad = rekv_parse_size(arg, &v);
    /* the library reads 0 (and a percentage over 100) as its default: refused here instead */
    if (o == O_LEASE) {
        bad |= v == 0 || v > UINT32_MAX;
        a->cfg.lease_ms = (uint32_t)v;
    } else if (o == O_HIGH || o == O_LOW) {
        bad |= v == 0 || v > 100;
        *(o == O_HIGH ? &a->cfg.high_pct : &a->cfg.low_pct) = (uint32_t)v;
        *(o == O_HIGH ? &a->high_given : &a->low_given) = 1;
    } else {
        bad |= v > INT32_MAX;
        a->ready_fd = (int)v;
    }
    return bad;
}

/* One option: -1 to go on, else the exit code (0 after --help and --version). */
static int parse_option(kv_args *a, int o, const char *name, const char *arg)
{
    int bad = 0;
    switch (o) {
    case O_ENDPOINT:
        a->cfg.endpoint = arg;
        break;
    case O_PUSH:
        a->cfg.push_backend = arg;
        bad = strcmp(arg, "cpu") && strcmp(arg, "cuda") && strcmp(arg, "auto");
        break;
    case O_PUSH_GBPS:
    case O_PUSH_LAT: {
        rekv_err lerr = {0};
        if (rekv_link_parse(&a->cfg.push_link, name + strlen("push-"), arg, &lerr)) {
            fprintf(stderr, "rekv-kvstore: --push-%s\n", lerr.msg + 2);
            return 2;
        }
        break;
    }
    case O_METRICS:
        a->cfg.metrics_listen = arg;
        break;
    case O_REMOTE: {
        kv_remote_url u;
        rekv_err rerr = {0};
        if (kv_remote_url_parse(arg, &u, &rerr) < 0) {
            fprintf(stderr, "rekv-kvstore: %s\n", rerr.msg);
            return 2;
        }
        a->cfg.remote = arg;
        break;
    }
    case O_METRICS_PUBLIC:
        a->cfg.metrics_public = 1;
        break;
    case O_KV_EVENTS:
        a->cfg.kv_events = arg;
        bad = strncmp(arg, "tcp://", 6) && strncmp(arg, "ipc://", 6);
        break;
    case O_KV_EVENTS_TOPIC:
        a->cfg.kv_events_topic = arg;
        break;
    case O_KV_EVENTS_REPLAY:
        a->cfg.kv_events_replay = arg;
        bad = strncmp(arg, "tcp://", 6) && strncmp(arg, "ipc://", 6);
        break;
    case O_KV_EVENTS_FORMAT:
        a->cfg.kv_events_array = strcmp(arg, "array") == 0;
        bad = strcmp(arg, "map") && strcmp(arg, "array");
        break;
    case O_SPILL_DIR:
        a->cfg.spill_dir = arg;
        break;
    case O_NO_SPILL:
        a->cfg.no_spill = 1;
        break;
    case O_PREFIX_DIR:
        a->cfg.prefix_dir = arg;
        break;
    case O_MODEL:
        a->model = arg;
        break;
    case O_DTYPE:
        a->dtype = arg;
        break;
    case O_HUGE:
        a->cfg.huge_pages = 1;
        break;
    case O_FD_SOCKET:
        a->cfg.fd_socket = arg;
        break;
    case O_NO_REG:
        a->cfg.no_register_arena = 1;
        break;
    case O_MAX_CLIENTS:
    case O_REMOTE_TIMEOUT:
    case O_REMOTE_TTL:
    case O_HOST:
    case O_SPILL_BYTES:
    case O_LAYERS:
    case O_KV_HEADS:
    case O_HEAD_DIM:
    case O_HIDDEN:
    case O_LEASE:
    case O_HIGH:
    case O_LOW:
    case O_READY:
        bad = parse_number(a, o, arg);
        break;
    case O_HELP:
        usage(stdout);
        return 0;
    case O_VERSION:
        printf("rekv-kvstore %s\n", rekv_version());
        return 0;
    default:
        usage(stderr);
        return 2;
    }
    if (bad) {
        fprintf(stderr, "rekv-kvstore: --%s: bad value '%s'%s\n", name, arg,
                o == O_LEASE                ? " (1 ms or more)"
                : o == O_REMOTE_TIMEOUT     ? " (1 to 10000 ms)"
                : o == O_HIGH || o == O_LOW ? " (a percentage, 1 to 100)"
                                            : "");
        return 2;
    }
    return -1;
}

/* What no single option shows: the watermarks' order, the arena against the machine's memory.
 * -1 to go on, else 2 after a message naming the options. */
static int check_args(const kv_args *a)
{
    uint32_t high = a->cfg.high_pct; /* given, or rekv_kvstore_config_defaults' */
    if (a->cfg.kv_events_replay && a->cfg.kv_events == NULL) {
        fprintf(stderr, "rekv-kvstore: --kv-events-replay replays --kv-events: give both\n");
        return 2;
    }
    if (a->low_given && a->cfg.low_pct > high) {
        fprintf(stderr, "rekv-kvstore: --low-pct %u is above --high-pct %u%s\n", a->cfg.low_pct,
                high, a->high_given ? "" : " (the default)");
        return 2;
    }
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0 && a->host_bytes / (uint64_t)page > (uint64_t)pages) {
        fprintf(stderr,
                "rekv-kvstore: --host-bytes %llu is more than this machine's memory (%llu "
                "bytes)\n",
                (unsigned long long)a->host_bytes, (unsigned long long)pages * (uint64_t)page);
        return 2;
    }
    return -1;
}

/* The command line into a: -1 to go on, else the exit code. */
static int parse_args(kv_args *a, int argc, char **argv)
{
    memset(a, 0, sizeof(*a));
    rekv_kvstore_config_defaults(&a->cfg);
    a->dtype = "f16";
    a->ready_fd = -1;
    int o, opt_i = 0, rc;
    while ((o = getopt_long(argc, argv, "", opts, &opt_i)) != -1)
        if ((rc = parse_option(a, o, opts[opt_i].name, optarg)) >= 0)
            return rc;
    if (a->cfg.endpoint == NULL || a->host_bytes == 0 || optind != argc) {
        usage(stderr);
        return 2;
    }
    a->cfg.host_bytes = a->host_bytes;
    return check_args(a);
}

/* The arena's geometry from --model or the four numbers: -1 to go on, else the exit code. */
static int geometry_of(kv_args *a)
{
    rekv_dtype cd;
    if (rekv_cache_dtype_parse(a->dtype, &cd) != 0) {
        fprintf(stderr, "rekv-kvstore: --cache-dtype %s: expected f16, f32, int8 or int4\n",
                a->dtype);
        return 2;
    }
    rekv_err err = {0};
    if (a->model) {
        rekv_model *m = NULL;
        if (rekv_model_open(a->model, &m, &err) < 0 ||
            rekv_kv_geometry_from_config(&m->config, cd, &a->cfg.geometry, &err) < 0) {
            rekv_log(REKV_LOG_ERROR, "%s", err.msg);
            rekv_model_close(m);
            return 1;
        }
        rekv_model_close(m);
    } else if (rekv_kv_geometry_init(&a->cfg.geometry, (uint32_t)a->layers, (uint32_t)a->kv_heads,
                                     (uint32_t)a->head_dim, (uint32_t)a->hidden, cd, &err) < 0) {
        rekv_log(REKV_LOG_ERROR,
                 "%s (give --model or all of --layers --kv-heads --head-dim "
                 "--hidden)",
                 err.msg);
        return 2;
    }
    return -1;
}

/* Creates the server, says it is ready, runs its loop until a stop signal; the exit code. */
static int serve(kv_args *a)
{
    rekv_kvstore_config *cfg = &a->cfg;
    /* a spill file over RLIMIT_FSIZE must be EFBIG, not death */
    signal(SIGXFSZ, SIG_IGN);
    int sfd = rekv_daemon_stop_fd();
    if (sfd < 0) {
        rekv_log(REKV_LOG_ERROR, "stop eventfd: %s", strerror(-sfd));
        return 1;
    }
    cfg->signal_fd = sfd;
    char why[320];
    if (rekv_conncap_lowered(cfg->max_clients, why,
                             sizeof(why))) /* after the soft limit was raised */
        rekv_log(REKV_LOG_WARN, "%s", why);
    cfg->on_event = on_event;
    cfg->on_tick = on_tick;
    rekv_err err = {0};
    rekv_kvstore_server *srv = NULL;
    int rc = rekv_kvstore_server_create(cfg, &srv, &err);
    if (rc < 0) {
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
        close(sfd);
        return 1;
    }
    rekv_log(REKV_LOG_INFO,
             "serving %s: %llu host bytes, %u layers x %u kv heads x %u head dim, hidden %u, %s",
             cfg->endpoint, (unsigned long long)a->host_bytes, cfg->geometry.n_layers,
             cfg->geometry.n_kv_heads, cfg->geometry.head_dim, cfg->geometry.hidden,
             rekv_dtype_name(cfg->geometry.dtype));
    if (cfg->metrics_listen)
        rekv_log(REKV_LOG_INFO, "metrics on %s (GET /metrics)", cfg->metrics_listen);
    if (cfg->kv_events)
        rekv_log(REKV_LOG_INFO, "KV events on %s (vLLM's format, %s events)", cfg->kv_events,
                 cfg->kv_events_array ? "positional" : "tagged-map");
    rekv_daemon_ready(a->ready_fd);
    rc = rekv_kvstore_server_run(srv, &err);
    if (rc < 0)
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
    rekv_daemon_stopping();
    rekv_kvstore_server_destroy(srv);
    close(sfd);
    rekv_log(REKV_LOG_INFO, "stopped");
    return rc < 0 ? 1 : 0;
}

int main(int argc, char **argv)
{
    rekv_log_init_from_env();
    kv_args a;
    int rc = parse_args(&a, argc, argv);
    if (rc < 0)
        rc = geometry_of(&a);
    if (rc < 0)
        rc = serve(&a);
    return rc;
}
