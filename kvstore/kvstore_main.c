/* kvstore_main.c — rekv-kvstore, the host-memory block store daemon: parses the command line,
 * stops on SIGTERM/SIGINT through common/daemon.h, runs the server loop, and reports readiness
 * (--ready-fd, sd_notify). Everything else is the kvstore library. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/daemon.h"
#include "common/log.h"
#include "common/version.h"
#include "kvstore/kvstore.h"
#include "loader/loader.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: rekv-kvstore --endpoint ipc:///path --host-bytes N [--spill-dir DIR]\n"
               "         [--spill-bytes N] [--no-spill] [--model PATH | --layers N --kv-heads K\n"
               "         --head-dim D --hidden H] [--cache-dtype f16|f32] [--huge-pages]\n"
               "         [--lease-ms N] [--fd-socket PATH] [--high-pct P] [--low-pct P]\n"
               "         [--no-register-arena] [--ready-fd N] [--push-backend cpu|cuda|auto]\n"
               "         [--push-link-gbps G] [--push-link-latency-us U]\n"
               "         [--metrics HOST:PORT [--metrics-public]] [--max-clients N] [--help]\n"
               "         [--version]\n"
               "Sizes take K, M, G suffixes (powers of two). --push-link-gbps makes the cpu push\n"
               "backend's copies take the time a link of G Gbit/s (and U us per copy) would.\n"
               "--metrics serves Prometheus scrapes (GET /metrics) on a loopback address; another\n"
               "address (or :PORT, every interface) needs --metrics-public: scrapes are not\n"
               "authenticated.\n"
               "At most --max-clients connections (1024, less under a low RLIMIT_NOFILE) are\n"
               "served; requests on more are answered EBUSY, and past twice as many a connection\n"
               "is dropped as it comes.\n");
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

int main(int argc, char **argv)
{
    rekv_log_init_from_env();
    rekv_kvstore_config cfg;
    rekv_kvstore_config_defaults(&cfg);
    const char *model = NULL, *dtype = "f16";
    uint64_t layers = 0, kv_heads = 0, head_dim = 0, hidden = 0, host_bytes = 0, v;
    int ready_fd = -1;
    enum {
        O_ENDPOINT = 1000,
        O_HOST,
        O_SPILL_DIR,
        O_SPILL_BYTES,
        O_NO_SPILL,
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
        O_METRICS_PUBLIC, O_MAX_CLIENTS,
        O_HELP,
        O_VERSION
    };
    static const struct option opts[] = {
        {"endpoint", required_argument, 0, O_ENDPOINT},
        {"host-bytes", required_argument, 0, O_HOST},
        {"spill-dir", required_argument, 0, O_SPILL_DIR},
        {"spill-bytes", required_argument, 0, O_SPILL_BYTES},
        {"no-spill", no_argument, 0, O_NO_SPILL},
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
        {"help", no_argument, 0, O_HELP},
        {"version", no_argument, 0, O_VERSION},
        {0, 0, 0, 0},
    };
    int o, opt_i = 0;
    while ((o = getopt_long(argc, argv, "", opts, &opt_i)) != -1) {
        int bad = 0;
        switch (o) {
        case O_ENDPOINT:
            cfg.endpoint = optarg;
            break;
        case O_PUSH:
            cfg.push_backend = optarg;
            bad = strcmp(optarg, "cpu") && strcmp(optarg, "cuda") && strcmp(optarg, "auto");
            break;
        case O_PUSH_GBPS:
        case O_PUSH_LAT: {
            rekv_err lerr = {0};
            if (rekv_link_parse(&cfg.push_link, opts[opt_i].name + strlen("push-"), optarg, &lerr)) {
                fprintf(stderr, "rekv-kvstore: --push-%s\n", lerr.msg + 2);
                return 2;
            }
            break;
        }
        case O_METRICS:
            cfg.metrics_listen = optarg;
            break;
        case O_METRICS_PUBLIC:
            cfg.metrics_public = 1;
            break;
        case O_MAX_CLIENTS:
            bad = rekv_parse_u32(optarg, &cfg.max_clients) || cfg.max_clients == 0;
            break;
        case O_HOST:
            bad = rekv_parse_size(optarg, &host_bytes);
            break;
        case O_SPILL_DIR:
            cfg.spill_dir = optarg;
            break;
        case O_SPILL_BYTES:
            bad = rekv_parse_size(optarg, &cfg.spill_bytes);
            break;
        case O_NO_SPILL:
            cfg.no_spill = 1;
            break;
        case O_MODEL:
            model = optarg;
            break;
        case O_LAYERS:
            bad = rekv_parse_size(optarg, &layers);
            break;
        case O_KV_HEADS:
            bad = rekv_parse_size(optarg, &kv_heads);
            break;
        case O_HEAD_DIM:
            bad = rekv_parse_size(optarg, &head_dim);
            break;
        case O_HIDDEN:
            bad = rekv_parse_size(optarg, &hidden);
            break;
        case O_DTYPE:
            dtype = optarg;
            break;
        case O_HUGE:
            cfg.huge_pages = 1;
            break;
        case O_LEASE:
            bad = rekv_parse_size(optarg, &v);
            cfg.lease_ms = (uint32_t)v;
            break;
        case O_FD_SOCKET:
            cfg.fd_socket = optarg;
            break;
        case O_HIGH:
            bad = rekv_parse_size(optarg, &v);
            cfg.high_pct = (uint32_t)v;
            break;
        case O_LOW:
            bad = rekv_parse_size(optarg, &v);
            cfg.low_pct = (uint32_t)v;
            break;
        case O_NO_REG:
            cfg.no_register_arena = 1;
            break;
        case O_READY:
            bad = rekv_parse_size(optarg, &v);
            ready_fd = (int)v;
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
            fprintf(stderr, "rekv-kvstore: bad value '%s'\n", optarg);
            return 2;
        }
    }
    if (cfg.endpoint == NULL || host_bytes == 0 || optind != argc) {
        usage(stderr);
        return 2;
    }
    cfg.host_bytes = host_bytes;
    rekv_dtype cd;
    if (strcmp(dtype, "f16") == 0 || strcmp(dtype, "F16") == 0)
        cd = REKV_DTYPE_F16;
    else if (strcmp(dtype, "f32") == 0 || strcmp(dtype, "F32") == 0)
        cd = REKV_DTYPE_F32;
    else {
        fprintf(stderr, "rekv-kvstore: --cache-dtype must be f16 or f32\n");
        return 2;
    }
    rekv_err err = {0};
    if (model) {
        rekv_model *m = NULL;
        if (rekv_model_open(model, &m, &err) < 0 ||
            rekv_kv_geometry_from_config(&m->config, cd, &cfg.geometry, &err) < 0) {
            rekv_log(REKV_LOG_ERROR, "%s", err.msg);
            rekv_model_close(m);
            return 1;
        }
        rekv_model_close(m);
    } else if (rekv_kv_geometry_init(&cfg.geometry, (uint32_t)layers, (uint32_t)kv_heads,
                                     (uint32_t)head_dim, (uint32_t)hidden, cd, &err) < 0) {
        rekv_log(REKV_LOG_ERROR,
                 "%s (give --model or all of --layers --kv-heads --head-dim "
                 "--hidden)",
                 err.msg);
        return 2;
    }
    /* a spill file over RLIMIT_FSIZE must be EFBIG, not death */
    signal(SIGXFSZ, SIG_IGN);
    int sfd = rekv_daemon_stop_fd();
    if (sfd < 0) {
        rekv_log(REKV_LOG_ERROR, "stop eventfd: %s", strerror(-sfd));
        return 1;
    }
    cfg.signal_fd = sfd;
    cfg.on_event = on_event;
    cfg.on_tick = on_tick;
    rekv_kvstore_server *srv = NULL;
    int rc = rekv_kvstore_server_create(&cfg, &srv, &err);
    if (rc < 0) {
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
        close(sfd);
        return 1;
    }
    rekv_log(REKV_LOG_INFO,
             "serving %s: %llu host bytes, %u layers x %u kv heads x %u head dim, hidden %u, %s",
             cfg.endpoint, (unsigned long long)host_bytes, cfg.geometry.n_layers,
             cfg.geometry.n_kv_heads, cfg.geometry.head_dim, cfg.geometry.hidden,
             rekv_dtype_name(cfg.geometry.dtype));
    if (cfg.metrics_listen)
        rekv_log(REKV_LOG_INFO, "metrics on %s (GET /metrics)", cfg.metrics_listen);
    rekv_daemon_ready(ready_fd);
    rc = rekv_kvstore_server_run(srv, &err);
    if (rc < 0)
        rekv_log(REKV_LOG_ERROR, "%s", err.msg);
    rekv_daemon_stopping();
    rekv_kvstore_server_destroy(srv);
    close(sfd);
    rekv_log(REKV_LOG_INFO, "stopped");
    return rc < 0 ? 1 : 0;
}
