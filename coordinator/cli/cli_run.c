/* cli_run.c — `rekv run`: starts rekv-kvstore, rekv-gpuworker and rekv-coordinator as children on
 * private ipc sockets in one directory, all three at once (the worker waits for the store's
 * socket), waits until each says it is ready, then supervises them (a child that dies is started
 * again, a worker under the same name so that it frees the dead one's kvstore sequences; a dead
 * kvstore is started again alone: the worker reconnects to it as it does to a separately run
 * store, unavailable meanwhile, and its jobs wait without using an attempt) until SIGINT/SIGTERM,
 * and stops them in order: coordinator (no new work), worker, kvstore. */
#define _GNU_SOURCE
#include "coordinator/cli/cli_daemon.h"
#include "common/dtype.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "common/mode.h"
#include "coordinator/cli/cli.h"
#include "coordinator/coordinator.h"
#include "gpuworker/device/backend.h"

#define READY_TIMEOUT_MS 120000 /* loading a big model takes a while */
#define STOP_TIMEOUT_MS 15000
#define MAX_RESTARTS 5

enum { KV = 0, WORKER = 1, COORD = 2, N_CHILD = 3 };
static const char *const child_prog[N_CHILD] = {"rekv-kvstore", "rekv-gpuworker",
                                                "rekv-coordinator"};

typedef struct child {
    pid_t pid;          /* 0 when not running */
    int restarts;       /* times started again after dying */
    char *argv[40];     /* program and arguments; "--ready-fd" "N" appended at start */
    int argc;
} child;

static void run_usage(FILE *f)
{
    fprintf(f,
            "usage: rekv run --model PATH [--backend auto|cpu|cuda] [--dir DIR] [--mode MODE]\n"
            "                [--host-bytes N] [--spill-bytes N]\n"
            "                [--cache-dtype f16|f32|int8|int4] [--queue N] [--max-batch N]\n"
            "                [--state-dir DIR] [--approximate]\n"
            "                [--worker-timeout-ms N] [--bin-dir DIR] [--metrics HOST:PORT]\n"
            "                [--metrics-public] [--prefill-chunk N] [--ready-fd N]\n"
            "                [--http HOST:PORT [--http-public] [--api-key-file FILE]\n"
            "                 [--served-model-name NAME]] [--prefix-cache on|off]\n"
            "                [--prefix-dir DIR] [--remote URL [--remote-timeout-ms N]\n"
            "                 [--remote-ttl-s N]]\n"
            "                [--kv-events ENDPOINT [--kv-events-topic T]\n"
            "                 [--kv-events-replay ENDPOINT]]\n"
            "Starts the kvstore, a gpuworker and the coordinator on ipc sockets in DIR (default\n"
            "$XDG_RUNTIME_DIR/rekv or /run/rekv: where `rekv submit` looks) and serves until\n"
            "Ctrl-C. The journal lives in --state-dir (default DIR/state). --mode: auto (default:\n"
            "the worker picks, see rekv-gpuworker --help) or resident|offload|kvpr|act|hybrid|\n"
            "infinigen|clo. --approximate: let the coordinator choose an approximate mode (infinigen)\n"
            "for --mode auto; its tokens may differ from resident's.\n"
            "--cache-dtype: the kvstore's cache dtype; default f16 on a GPU, f32 (exact) on cpu;\n"
            "  int8/int4 quantize K,V per row (docs/design/engine.md).\n"
            "--spill-bytes: the kvstore's spill tier ($TMPDIR, else /var/tmp) holds at most N\n"
            "bytes; 0: no spill tier, the arena (--host-bytes) is all the room; default: what the\n"
            "filesystem has.\n"
            "--link-gbps G, --link-latency-us U, --device-memory SIZE: the worker's cpu backend\n"
            "behaves like a GPU of SIZE bytes behind a link of G Gbit/s (see rekv-gpuworker).\n"
            "--push: the kvstore writes the KV rows into the worker's buffers (the push path).\n"
            "--metrics: the coordinator's Prometheus port, loopback only unless --metrics-public.\n"
            "--http: the coordinator's OpenAI-compatible API (see rekv-coordinator --help).\n"
            "--prefix-cache on|off: jobs start from the KV the kvstore holds of their prompt's\n"
            "longest cached prefix (default on); --prefix-dir DIR: the kvstore keeps that cache in\n"
            "DIR across restarts (see rekv-kvstore --help).\n"
            "--remote redis://HOST:PORT[/DB] | unix:///PATH[?db=N]: the kvstore shares its prefix\n"
            "cache with other replicas of the model through that Redis (see rekv-kvstore --help).\n"
            "--kv-events tcp://*:5557: the kvstore publishes what its prefix cache holds in\n"
            "vLLM's KV events format for KV-aware routers (llm-d, Dynamo; see rekv-kvstore\n"
            "--help); --kv-events-topic: their topic (llm-d reads kv@POD@MODEL);\n"
            "--kv-events-replay tcp://*:5558: vLLM's replay socket for them.\n");
}

/* Starts c with a ready pipe (its read end in *ready); 0, or -1 with a message printed. */
static int child_spawn(child *c, int *ready)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) < 0) {
        fprintf(stderr, "rekv run: pipe: %s\n", strerror(errno));
        return -1;
    }
    char fdnum[16];
    snprintf(fdnum, sizeof(fdnum), "%d", pfd[1]);
    c->argv[c->argc] = "--ready-fd";
    c->argv[c->argc + 1] = fdnum;
    c->argv[c->argc + 2] = NULL;
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "rekv run: fork: %s\n", strerror(errno));
        close(pfd[0]);
        close(pfd[1]);
        return -1;
    }
    if (pid == 0) {
        /* the child: its own process group (Ctrl-C reaches only us, and we stop children in
         * order), killed if we die, signals unblocked and at their defaults, the ready fd
         * inherited */
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        fcntl(pfd[1], F_SETFD, 0);
        close(pfd[0]);
        execv(c->argv[0], c->argv);
        fprintf(stderr, "rekv run: %s: %s\n", c->argv[0], strerror(errno));
        _exit(127);
    }
    close(pfd[1]);
    c->pid = pid;
    *ready = pfd[0];
    return 0;
}

/* Starts the children ch[which[0..n)] at once and waits until each says "READY\n"; 0, -1 with a
 * message printed (those started are left running for the caller to stop), or 1 when stop_fd (a
 * signalfd of SIGINT and SIGTERM, left unread) became readable first. The worker may start with
 * the store: it waits for the store's socket (worker_main.c). */
static int children_start(child *ch, const int *which, int n, int stop_fd)
{
    struct pollfd p[N_CHILD + 1];
    int rc = 0, left = 0;
    for (int k = 0; k < n; k++) {
        p[k] = (struct pollfd){-1, POLLIN, 0};
        if (child_spawn(&ch[which[k]], &p[k].fd)) {
            rc = -1;
            break;
        }
        left++;
    }
    p[n] = (struct pollfd){stop_fd, POLLIN, 0};
    uint64_t deadline = rekv_now_ns() + (uint64_t)READY_TIMEOUT_MS * 1000000ull;
    while (rc == 0 && left > 0) {
        uint64_t now = rekv_now_ns();
        int r = now < deadline ? poll(p, (nfds_t)n + 1, (int)((deadline - now) / 1000000ull) + 1)
                               : 0;
        if (r < 0 && errno == EINTR)
            continue;
        if (r > 0 && (p[n].revents & POLLIN)) { /* asked to stop while they start */
            rc = 1;
            break;
        }
        for (int k = 0; k < n && rc == 0; k++) {
            if (p[k].fd < 0 || (r > 0 && !(p[k].revents & (POLLIN | POLLHUP))))
                continue;
            char buf[8] = {0};
            ssize_t got = r > 0 ? read(p[k].fd, buf, sizeof(buf) - 1) : 0;
            if (got != 6 || strcmp(buf, "READY\n") != 0) {
                fprintf(stderr, "rekv run: %s did not become ready%s\n", child_prog[which[k]],
                        r == 0 ? " in time" : " (it exited; see its messages above)");
                rc = -1;
                break;
            }
            close(p[k].fd);
            p[k].fd = -1;
            left--;
        }
    }
    for (int k = 0; k < n; k++)
        if (p[k].fd >= 0)
            close(p[k].fd);
    return rc;
}

static int child_start(child *ch, int which, int stop_fd)
{
    return children_start(ch, &which, 1, stop_fd);
}

/* SIGTERM, then SIGKILL after STOP_TIMEOUT_MS. Returns the exit status or -1. */
static int child_stop(child *c)
{
    if (c->pid <= 0)
        return 0;
    kill(c->pid, SIGTERM);
    uint64_t deadline = rekv_now_ns() + (uint64_t)STOP_TIMEOUT_MS * 1000000ull;
    int st = 0;
    for (;;) {
        pid_t w = waitpid(c->pid, &st, WNOHANG);
        if (w == c->pid)
            break;
        if (w < 0) {
            st = -1;
            break;
        }
        if (rekv_now_ns() > deadline) {
            fprintf(stderr, "rekv run: %s did not stop; killing it\n", c->argv[0]);
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &st, 0);
            break;
        }
        usleep(1000); /* a daemon stops in tens of milliseconds: notice it soon */
    }
    c->pid = 0;
    return st;
}

/* What `rekv run` was asked for; the daemons get the values as given (each checks its own). */
typedef struct run_opts {
    const char *model, *backend, *dir, *mode, *cache, *host_bytes, *spill, *queue, *max_batch,
        *state_dir, *timeout, *bin_dir, *metrics, *chunk;
    const char *http, *api_key_file, *served_name; /* the coordinator's HTTP server */
    const char *prefix_cache, *prefix_dir;          /* the worker's and the store's */
    const char *remote, *remote_timeout, *remote_ttl; /* the store's remote tier */
    const char *kv_events, *kv_events_topic, *kv_events_replay; /* the store's, for routers */
    const char *link_gbps, *link_lat, *devmem; /* the worker's emulation */
    int push, approximate, metrics_public, no_spill, http_public;
    long ready_fd; /* -1: none */
} run_opts;

static int run_parse(int argc, char **argv, run_opts *o)
{
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},      {"backend", required_argument, 0, 'b'},
        {"dir", required_argument, 0, 'd'},        {"mode", required_argument, 0, 'M'},
        {"host-bytes", required_argument, 0, 'H'}, {"queue", required_argument, 0, 'q'},
        {"spill-bytes", required_argument, 0, 'S'},
        {"max-batch", required_argument, 0, 'B'},  {"state-dir", required_argument, 0, 's'},
        {"worker-timeout-ms", required_argument, 0, 'T'},
        {"bin-dir", required_argument, 0, 'x'},    {"ready-fd", required_argument, 0, 'R'},
        {"metrics", required_argument, 0, 'P'},    {"help", no_argument, 0, 'h'},
        {"cache-dtype", required_argument, 0, 'C'},
        {"link-gbps", required_argument, 0, 'L'},
        {"link-latency-us", required_argument, 0, 'U'},
        {"device-memory", required_argument, 0, 'D'},
        {"push", no_argument, 0, 'p'},
        {"approximate", no_argument, 0, 'A'},
        {"metrics-public", no_argument, 0, 'Q'},
        {"prefill-chunk", required_argument, 0, 'c'},
        {"http", required_argument, 0, 'W'},
        {"http-public", no_argument, 0, 'w'},
        {"api-key-file", required_argument, 0, 'K'},
        {"served-model-name", required_argument, 0, 'N'},
        {"prefix-cache", required_argument, 0, 'X'},
        {"prefix-dir", required_argument, 0, 'Y'},
        {"remote", required_argument, 0, 'r'},
        {"remote-timeout-ms", required_argument, 0, 'o'},
        {"remote-ttl-s", required_argument, 0, 'l'},
        {"kv-events", required_argument, 0, 'E'},
        {"kv-events-topic", required_argument, 0, 'G'},
        {"kv-events-replay", required_argument, 0, 'J'},
        {0, 0, 0, 0}};
    *o = (run_opts){.backend = "auto", .mode = "auto", .host_bytes = "256M", .queue = "256",
                    .max_batch = "64", .timeout = "30000", .ready_fd = -1};
    long v;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'b': o->backend = optarg; break;
        case 'd': o->dir = optarg; break;
        case 'M': o->mode = optarg; break;
        case 'H': o->host_bytes = optarg; break;
        case 'S': o->spill = optarg; break;
        case 'q': if (cli_parse_int("queue", optarg, 1, 1 << 24, &v)) return 2; o->queue = optarg; break;
        case 'B': if (cli_parse_int("max-batch", optarg, 1, 4096, &v)) return 2; o->max_batch = optarg; break;
        case 's': o->state_dir = optarg; break;
        case 'T': if (cli_parse_int("worker-timeout-ms", optarg, 1, INT32_MAX, &v)) return 2; o->timeout = optarg; break;
        case 'x': o->bin_dir = optarg; break;
        case 'P': o->metrics = optarg; break;
        case 'C': o->cache = optarg; break;
        case 'L': o->link_gbps = optarg; break;
        case 'U': o->link_lat = optarg; break;
        case 'D': o->devmem = optarg; break;
        case 'p': o->push = 1; break;
        case 'A': o->approximate = 1; break;
        case 'Q': o->metrics_public = 1; break;
        case 'W': o->http = optarg; break;
        case 'w': o->http_public = 1; break;
        case 'K': o->api_key_file = optarg; break;
        case 'N': o->served_name = optarg; break;
        case 'X': o->prefix_cache = optarg; break;
        case 'Y': o->prefix_dir = optarg; break;
        case 'r': o->remote = optarg; break;
        case 'o': if (cli_parse_int("remote-timeout-ms", optarg, 1, 10000, &v)) return 2; o->remote_timeout = optarg; break;
        case 'l': if (cli_parse_int("remote-ttl-s", optarg, 1, INT32_MAX, &v)) return 2; o->remote_ttl = optarg; break;
        case 'E': o->kv_events = optarg; break;
        case 'G': o->kv_events_topic = optarg; break;
        case 'J': o->kv_events_replay = optarg; break;
        case 'c': if (cli_parse_int("prefill-chunk", optarg, 0, INT32_MAX, &v)) return 2; o->chunk = optarg; break;
        case 'R': if (cli_parse_int("ready-fd", optarg, 0, INT32_MAX, &o->ready_fd)) return 2; break;
        case 'h': run_usage(stdout); return 0;
        default: run_usage(stderr); return 2;
        }
    }
    if (cli_no_operands(argc, argv) || o->model == NULL) {
        run_usage(stderr);
        return 2;
    }
    return CLI_PARSED;
}

/* What the daemons would refuse, refused here as a usage error (not as a daemon that did not
 * start); 0 or 2. */
static int run_check(run_opts *o)
{
    if (strcmp(o->backend, "auto") != 0 && strcmp(o->backend, "cpu") != 0 &&
        strcmp(o->backend, "cuda") != 0) {
        fprintf(stderr, "rekv run: --backend %s: expected auto, cpu or cuda\n", o->backend);
        return 2;
    }
    rekv_dtype cache_v;
    if (o->cache && rekv_cache_dtype_parse(o->cache, &cache_v) != 0) {
        fprintf(stderr, "rekv run: --cache-dtype %s: expected f16, f32, int8 or int4\n", o->cache);
        return 2;
    }
    rekv_mode mode_v;
    uint64_t size_v;
    if (strcmp(o->mode, "auto") != 0 && rekv_mode_parse(o->mode, &mode_v)) {
        fprintf(stderr, "rekv run: --mode %s: expected auto, resident, offload, kvpr, act, hybrid, "
                        "infinigen or clo\n", o->mode);
        return 2;
    }
    if (rekv_parse_size(o->host_bytes, &size_v) || size_v == 0) {
        fprintf(stderr, "rekv run: --host-bytes %s: expected bytes, e.g. 64G\n", o->host_bytes);
        return 2;
    }
    if (o->spill && rekv_parse_size(o->spill, &size_v)) {
        fprintf(stderr, "rekv run: --spill-bytes %s: expected bytes, e.g. 4G, or 0\n", o->spill);
        return 2;
    }
    o->no_spill = o->spill && size_v == 0;
    rekv_link_config link_check = REKV_LINK_NONE; /* the values go to the worker as given */
    if ((o->devmem && cli_parse_link(&link_check, "device-memory", o->devmem)) ||
        (o->link_gbps && cli_parse_link(&link_check, "link-gbps", o->link_gbps)) ||
        (o->link_lat && cli_parse_link(&link_check, "link-latency-us", o->link_lat)))
        return 2;
    return 0;
}

/* Where the trio lives: its directory, the journal's, the daemons' programs and the sockets. */
typedef struct run_paths {
    char dir[2048], state[2200], bin[PATH_MAX], ep_ctl[2300], ep_wrk[2300], ep_kv[2300];
    char progs[N_CHILD][PATH_MAX + 64];
} run_paths;

/* Fills in what was not given: the cache dtype (the worker's backend decides) and the paths,
 * making the directory; 0, or 1 with a message printed. */
static int run_resolve(run_opts *o, run_paths *p)
{
    rekv_err err = {0};
    if (o->cache == NULL && (o->link_gbps || o->devmem))
        o->cache = "f32"; /* an emulated GPU is the cpu backend: exact */
    if (o->cache == NULL) {
        /* a GPU keeps fp16 (half the bytes), cpu fp32 (exact: tokens equal `rekv generate
         * --local`) */
        rekv_backend *probe = NULL;
        char note[1200];
        o->cache = "f32";
        if (rekv_backend_create(o->backend, NULL, &probe, note, sizeof(note), &err) == 0 &&
            strcmp(probe->iface->name, "cpu") != 0)
            o->cache = "f16";
        rekv_backend_destroy(probe);
        rekv_err_clear(&err);
    }
    if (o->dir)
        snprintf(p->dir, sizeof(p->dir), "%s", o->dir);
    else if (rekv_runtime_dir(p->dir, sizeof(p->dir), &err)) {
        fprintf(stderr, "rekv run: %s\n", err.msg);
        return 1;
    }
    if (mkdir(p->dir, 0700) < 0 && errno != EEXIST) {
        fprintf(stderr, "rekv run: %s: %s\n", p->dir, strerror(errno));
        return 1;
    }
    snprintf(p->state, sizeof(p->state), "%s", o->state_dir ? o->state_dir : p->dir);
    if (!o->state_dir)
        strncat(p->state, "/state", sizeof(p->state) - strlen(p->state) - 1);
    if (o->bin_dir) {
        snprintf(p->bin, sizeof(p->bin), "%s", o->bin_dir);
    } else {
        /* the daemons sit beside the rekv binary */
        ssize_t n = readlink("/proc/self/exe", p->bin, sizeof(p->bin) - 1);
        if (n <= 0) {
            fprintf(stderr, "rekv run: cannot find my own binary: %s\n", strerror(errno));
            return 1;
        }
        p->bin[n] = '\0';
        char *slash = strrchr(p->bin, '/');
        *slash = '\0';
    }
    snprintf(p->ep_ctl, sizeof(p->ep_ctl), "ipc://%s/control", p->dir);
    snprintf(p->ep_wrk, sizeof(p->ep_wrk), "ipc://%s/workers", p->dir);
    snprintf(p->ep_kv, sizeof(p->ep_kv), "ipc://%s/kvstore", p->dir);
    for (int i = 0; i < N_CHILD; i++)
        snprintf(p->progs[i], sizeof(p->progs[i]), "%s/%s", p->bin, child_prog[i]);
    return 0;
}

/* Each daemon's command line (pointing into o and p, which outlive the children). */
static void run_children_argv(const run_opts *o, const run_paths *p, child *ch)
{
    memset(ch, 0, sizeof(*ch) * N_CHILD);
    for (int i = 0; i < N_CHILD; i++)
        ch[i].argv[ch[i].argc++] = (char *)p->progs[i];
#define ARG(i, s) (ch[i].argv[ch[i].argc++] = (char *)(s))
    ARG(KV, "--endpoint"); ARG(KV, p->ep_kv);
    ARG(KV, "--host-bytes"); ARG(KV, o->host_bytes);
    ARG(KV, "--model"); ARG(KV, o->model);
    ARG(KV, "--cache-dtype"); ARG(KV, o->cache);
    if (o->no_spill)
        ARG(KV, "--no-spill");
    else if (o->spill) {
        ARG(KV, "--spill-bytes"); ARG(KV, o->spill);
    }
    if (o->prefix_dir) {
        ARG(KV, "--prefix-dir"); ARG(KV, o->prefix_dir);
    }
    if (o->remote) {
        ARG(KV, "--remote"); ARG(KV, o->remote);
    }
    if (o->remote_timeout) {
        ARG(KV, "--remote-timeout-ms"); ARG(KV, o->remote_timeout);
    }
    if (o->remote_ttl) {
        ARG(KV, "--remote-ttl-s"); ARG(KV, o->remote_ttl);
    }
    if (o->prefix_cache) {
        ARG(WORKER, "--prefix-cache"); ARG(WORKER, o->prefix_cache);
    }
    if (o->kv_events) {
        ARG(KV, "--kv-events"); ARG(KV, o->kv_events);
    }
    if (o->kv_events_topic) {
        ARG(KV, "--kv-events-topic"); ARG(KV, o->kv_events_topic);
    }
    if (o->kv_events_replay) {
        ARG(KV, "--kv-events-replay"); ARG(KV, o->kv_events_replay);
    }
    if (o->push) { /* the store writes KV rows into the worker's buffers, on the worker's backend */
        /* the worker's kind: an emulated GPU is the cpu backend */
        ARG(KV, "--push-backend"); ARG(KV, o->link_gbps || o->devmem ? "cpu" : o->backend);
        ARG(WORKER, "--push");
        if (o->link_gbps) { /* and copies over a link like the worker's */
            ARG(KV, "--push-link-gbps"); ARG(KV, o->link_gbps);
        }
        if (o->link_gbps && o->link_lat) {
            ARG(KV, "--push-link-latency-us"); ARG(KV, o->link_lat);
        }
    }
    /* the store's own lease (5 s): the worker renews it while a step runs; a worker we start
     * again keeps its name, and so frees what the dead one left in the store at once */
    ARG(WORKER, "--name"); ARG(WORKER, "gpuworker");
    ARG(WORKER, "--model"); ARG(WORKER, o->model);
    ARG(WORKER, "--coordinator"); ARG(WORKER, p->ep_wrk);
    ARG(WORKER, "--kvstore"); ARG(WORKER, p->ep_kv);
    ARG(WORKER, "--mode"); ARG(WORKER, o->mode);
    ARG(WORKER, "--max-batch"); ARG(WORKER, o->max_batch);
    ARG(WORKER, "--backend"); ARG(WORKER, o->backend);
    if (o->approximate)
        ARG(WORKER, "--approximate");
    if (o->link_gbps) {
        ARG(WORKER, "--link-gbps"); ARG(WORKER, o->link_gbps);
    }
    if (o->link_lat) {
        ARG(WORKER, "--link-latency-us"); ARG(WORKER, o->link_lat);
    }
    if (o->devmem) {
        ARG(WORKER, "--device-memory"); ARG(WORKER, o->devmem);
    }
    ARG(COORD, "--control"); ARG(COORD, p->ep_ctl);
    ARG(COORD, "--workers"); ARG(COORD, p->ep_wrk);
    ARG(COORD, "--state-dir"); ARG(COORD, p->state);
    ARG(COORD, "--model"); ARG(COORD, o->model);
    ARG(COORD, "--queue"); ARG(COORD, o->queue);
    ARG(COORD, "--worker-timeout-ms"); ARG(COORD, o->timeout);
    if (o->chunk) {
        ARG(COORD, "--prefill-chunk"); ARG(COORD, o->chunk);
    }
    if (o->metrics) {
        ARG(COORD, "--metrics"); ARG(COORD, o->metrics);
        if (o->metrics_public)
            ARG(COORD, "--metrics-public");
    }
    if (o->http) {
        ARG(COORD, "--http"); ARG(COORD, o->http);
        if (o->http_public)
            ARG(COORD, "--http-public");
        if (o->api_key_file) {
            ARG(COORD, "--api-key-file"); ARG(COORD, o->api_key_file);
        }
        if (o->served_name) {
            ARG(COORD, "--served-model-name"); ARG(COORD, o->served_name);
        }
    }
#undef ARG
}

/* Serves until SIGINT/SIGTERM (0) or a child that cannot be kept running (1): reads sfd (a
 * signalfd of SIGINT, SIGTERM and SIGCHLD) and starts again a child that died. A dead store's
 * worker is left running: it drops the dead store's client and reconnects (stopping it too made
 * its jobs' runs end twice, on the store's loss and on the worker's stop: 2 attempts a crash). */
static int run_supervise(child *ch, int sfd, int stop_fd, int chatty)
{
    for (;;) {
        struct signalfd_siginfo si;
        ssize_t n = read(sfd, &si, sizeof(si));
        if (n != sizeof(si)) {
            if (n < 0 && errno == EINTR)
                continue;
            return 1;
        }
        if (si.ssi_signo != SIGCHLD) {
            if (chatty)
                fprintf(stderr, "rekv run: stopping\n");
            return 0;
        }
        int st, rc = 1, failed = 0;
        pid_t pid;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
            for (int i = 0; i < N_CHILD; i++) {
                if (ch[i].pid != pid)
                    continue;
                ch[i].pid = 0;
                fprintf(stderr, "rekv run: %s exited (%s %d)\n", child_prog[i],
                        WIFSIGNALED(st) ? "signal" : "status",
                        WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
                if (ch[i].restarts++ >= MAX_RESTARTS) {
                    fprintf(stderr, "rekv run: %s died %d times; giving up\n", child_prog[i],
                            MAX_RESTARTS + 1);
                    failed = 1;
                    break;
                }
                int s1 = child_start(ch, i, stop_fd);
                if (s1 > 0) /* asked to stop meanwhile */
                    rc = 0;
                if (s1)
                    failed = 1;
            }
        }
        if (failed)
            return rc;
    }
}

/* No new work first, then the worker, then the store it uses. */
static void run_stop_children(child *ch, int rc)
{
    int bad = 0;
    static const int stop_order[N_CHILD] = {COORD, WORKER, KV};
    for (int k = 0; k < N_CHILD; k++) {
        int st = child_stop(&ch[stop_order[k]]);
        if (st != 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            bad = 1;
    }
    if (bad && rc == 0)
        fprintf(stderr, "rekv run: a daemon did not exit cleanly\n");
}

int cli_run(int argc, char **argv)
{
    /* progress lines are information: REKV_LOG=warn (as `rekv generate` sets) silences them */
    const char *lv = getenv("REKV_LOG");
    int chatty = !(lv && (strcmp(lv, "warn") == 0 || strcmp(lv, "error") == 0));
    run_opts o;
    int rc = run_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    if ((rc = run_check(&o)))
        return rc;
    run_paths p;
    child ch[N_CHILD];
    if (run_resolve(&o, &p))
        return 1;
    run_children_argv(&o, &p, ch);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    int sfd = signalfd(-1, &set, SFD_CLOEXEC);
    /* SIGINT/SIGTERM alone, polled (not read) while a child starts: stop without waiting for it */
    sigdelset(&set, SIGCHLD);
    int stop_fd = sfd >= 0 ? signalfd(-1, &set, SFD_CLOEXEC) : -1;
    if (sfd < 0 || stop_fd < 0) {
        fprintf(stderr, "rekv run: signalfd: %s\n", strerror(errno));
        if (sfd >= 0)
            close(sfd);
        return 1;
    }
    static const int all[N_CHILD] = {KV, COORD, WORKER};
    int started = children_start(ch, all, N_CHILD, stop_fd);
    if (started) {
        rc = started > 0 ? 0 : 1;
    } else {
        if (chatty)
            fprintf(stderr, "rekv run: serving on %s (kvstore, gpuworker and coordinator in %s); "
                            "Ctrl-C stops\n", p.ep_ctl, p.dir);
        if (o.ready_fd >= 0) {
            ssize_t w = write((int)o.ready_fd, "READY\n", 6);
            (void)w;
            close((int)o.ready_fd);
        }
        rc = run_supervise(ch, sfd, stop_fd, chatty);
    }
    run_stop_children(ch, rc);
    close(stop_fd);
    close(sfd);
    return rc;
}
