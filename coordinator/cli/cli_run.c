/* cli_run.c — `rekv run`: starts rekv-kvstore, rekv-gpuworker and rekv-coordinator as children on
 * private ipc sockets in one directory, all three at once (the worker waits for the store's
 * socket), waits until each says it is ready, then supervises them (a child that dies is started
 * again, a worker under the same name so that it frees the dead one's kvstore sequences; a dead
 * kvstore takes the worker with it, since the worker's arena mapping is gone) until
 * SIGINT/SIGTERM, and stops them in order: coordinator (no new work), worker, kvstore. */
#define _GNU_SOURCE
#include "coordinator/cli/cli_daemon.h"

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
            "                [--host-bytes N] [--spill-bytes N] [--cache-dtype f16|f32]\n"
            "                [--queue N] [--max-batch N] [--state-dir DIR] [--approximate]\n"
            "                [--worker-timeout-ms N] [--bin-dir DIR] [--metrics HOST:PORT]\n"
            "                [--metrics-public] [--prefill-chunk N] [--ready-fd N]\n"
            "Starts the kvstore, a gpuworker and the coordinator on ipc sockets in DIR (default\n"
            "$XDG_RUNTIME_DIR/rekv or /run/rekv: where `rekv submit` looks) and serves until\n"
            "Ctrl-C. The journal lives in --state-dir (default DIR/state). --mode: auto (default:\n"
            "the worker picks, see rekv-gpuworker --help) or resident|offload|kvpr|act|hybrid|\n"
            "infinigen|clo. --approximate: let the coordinator choose an approximate mode (infinigen)\n"
            "for --mode auto; its tokens may differ from resident's.\n"
            "--cache-dtype: the kvstore's cache dtype; default f16 on a GPU, f32 (exact) on cpu.\n"
            "--spill-bytes: the kvstore's spill tier ($TMPDIR, else /var/tmp) holds at most N\n"
            "bytes; 0: no spill tier, the arena (--host-bytes) is all the room; default: what the\n"
            "filesystem has.\n"
            "--link-gbps G, --link-latency-us U, --device-memory SIZE: the worker's cpu backend\n"
            "behaves like a GPU of SIZE bytes behind a link of G Gbit/s (see rekv-gpuworker).\n"
            "--push: the kvstore writes the KV rows into the worker's buffers (the push path).\n"
            "--metrics: the coordinator's Prometheus port, loopback only unless --metrics-public.\n");
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

int cli_run(int argc, char **argv)
{
    /* progress lines are information: REKV_LOG=warn (as `rekv generate` sets) silences them */
    const char *lv = getenv("REKV_LOG");
    int chatty = !(lv && (strcmp(lv, "warn") == 0 || strcmp(lv, "error") == 0));
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
        {0, 0, 0, 0}};
    const char *link_gbps = NULL, *link_lat = NULL, *devmem = NULL; /* the worker's emulation */
    int push = 0, approximate = 0, metrics_public = 0;
    const char *model = NULL, *backend = "auto", *dir_arg = NULL, *mode = "auto", *cache = NULL,
               *host_bytes = "256M", *queue = "256", *max_batch = "64", *state_arg = NULL,
               *timeout = "30000", *bin_arg = NULL, *metrics = NULL, *chunk = NULL,
               *spill = NULL;
    long ready_fd = -1, v;
    int o;
    optind = 1;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'm': model = optarg; break;
        case 'b': backend = optarg; break;
        case 'd': dir_arg = optarg; break;
        case 'M': mode = optarg; break;
        case 'H': host_bytes = optarg; break;
        case 'S': spill = optarg; break;
        case 'q': if (cli_parse_int("queue", optarg, 1, 1 << 24, &v)) return 2; queue = optarg; break;
        case 'B': if (cli_parse_int("max-batch", optarg, 1, 4096, &v)) return 2; max_batch = optarg; break;
        case 's': state_arg = optarg; break;
        case 'T': if (cli_parse_int("worker-timeout-ms", optarg, 1, INT32_MAX, &v)) return 2; timeout = optarg; break;
        case 'x': bin_arg = optarg; break;
        case 'P': metrics = optarg; break;
        case 'C': cache = optarg; break;
        case 'L': link_gbps = optarg; break;
        case 'U': link_lat = optarg; break;
        case 'D': devmem = optarg; break;
        case 'p': push = 1; break;
        case 'A': approximate = 1; break;
        case 'Q': metrics_public = 1; break;
        case 'c': if (cli_parse_int("prefill-chunk", optarg, 0, INT32_MAX, &v)) return 2; chunk = optarg; break;
        case 'R': if (cli_parse_int("ready-fd", optarg, 0, INT32_MAX, &ready_fd)) return 2; break;
        case 'h': run_usage(stdout); return 0;
        default: run_usage(stderr); return 2;
        }
    }
    if (model == NULL || optind != argc) {
        run_usage(stderr);
        return 2;
    }
    if (strcmp(backend, "auto") != 0 && strcmp(backend, "cpu") != 0 &&
        strcmp(backend, "cuda") != 0) {
        fprintf(stderr, "rekv run: --backend %s: expected auto, cpu or cuda\n", backend);
        return 2;
    }
    if (cache && strcmp(cache, "f16") != 0 && strcmp(cache, "f32") != 0) {
        fprintf(stderr, "rekv run: --cache-dtype %s: expected f16 or f32\n", cache);
        return 2;
    }
    /* what the daemons would refuse, refused here as a usage error (not as a daemon that did
     * not start) */
    rekv_mode mode_v;
    uint64_t size_v;
    if (strcmp(mode, "auto") != 0 && rekv_mode_parse(mode, &mode_v)) {
        fprintf(stderr, "rekv run: --mode %s: expected auto, resident, offload, kvpr, act, hybrid, "
                        "infinigen or clo\n", mode);
        return 2;
    }
    if (rekv_parse_size(host_bytes, &size_v) || size_v == 0) {
        fprintf(stderr, "rekv run: --host-bytes %s: expected bytes, e.g. 64G\n", host_bytes);
        return 2;
    }
    if (spill && rekv_parse_size(spill, &size_v)) {
        fprintf(stderr, "rekv run: --spill-bytes %s: expected bytes, e.g. 4G, or 0\n", spill);
        return 2;
    }
    int no_spill = spill && size_v == 0;
    rekv_link_config link_check = REKV_LINK_NONE; /* the values go to the worker as given */
    if ((devmem && cli_parse_link(&link_check, "device-memory", devmem)) ||
        (link_gbps && cli_parse_link(&link_check, "link-gbps", link_gbps)) ||
        (link_lat && cli_parse_link(&link_check, "link-latency-us", link_lat)))
        return 2;
    char dir[2048], state[2200], bin[PATH_MAX], ep_ctl[2300], ep_wrk[2300], ep_kv[2300];
    rekv_err err = {0};
    if (cache == NULL && (link_gbps || devmem))
        cache = "f32"; /* an emulated GPU is the cpu backend: exact */
    if (cache == NULL) {
        /* the worker's backend decides: a GPU keeps fp16 (half the bytes), cpu fp32 (exact:
         * tokens equal `rekv generate --local`) */
        rekv_backend *probe = NULL;
        char note[1200];
        cache = "f32";
        if (rekv_backend_create(backend, NULL, &probe, note, sizeof(note), &err) == 0 &&
            strcmp(probe->iface->name, "cpu") != 0)
            cache = "f16";
        rekv_backend_destroy(probe);
        rekv_err_clear(&err);
    }
    if (dir_arg)
        snprintf(dir, sizeof(dir), "%s", dir_arg);
    else if (rekv_runtime_dir(dir, sizeof(dir), &err)) {
        fprintf(stderr, "rekv run: %s\n", err.msg);
        return 1;
    }
    if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
        fprintf(stderr, "rekv run: %s: %s\n", dir, strerror(errno));
        return 1;
    }
    snprintf(state, sizeof(state), "%s", state_arg ? state_arg : dir);
    if (!state_arg)
        strncat(state, "/state", sizeof(state) - strlen(state) - 1);
    if (bin_arg) {
        snprintf(bin, sizeof(bin), "%s", bin_arg);
    } else {
        /* the daemons sit beside the rekv binary */
        ssize_t n = readlink("/proc/self/exe", bin, sizeof(bin) - 1);
        if (n <= 0) {
            fprintf(stderr, "rekv run: cannot find my own binary: %s\n", strerror(errno));
            return 1;
        }
        bin[n] = '\0';
        char *slash = strrchr(bin, '/');
        *slash = '\0';
    }
    snprintf(ep_ctl, sizeof(ep_ctl), "ipc://%s/control", dir);
    snprintf(ep_wrk, sizeof(ep_wrk), "ipc://%s/workers", dir);
    snprintf(ep_kv, sizeof(ep_kv), "ipc://%s/kvstore", dir);
    char progs[N_CHILD][PATH_MAX + 64];
    child ch[N_CHILD];
    memset(ch, 0, sizeof(ch));
    for (int i = 0; i < N_CHILD; i++) {
        snprintf(progs[i], sizeof(progs[i]), "%s/%s", bin, child_prog[i]);
        ch[i].argv[ch[i].argc++] = progs[i];
    }
#define ARG(i, s) (ch[i].argv[ch[i].argc++] = (char *)(s))
    ARG(KV, "--endpoint"); ARG(KV, ep_kv);
    ARG(KV, "--host-bytes"); ARG(KV, host_bytes);
    ARG(KV, "--model"); ARG(KV, model);
    ARG(KV, "--cache-dtype"); ARG(KV, cache);
    if (no_spill)
        ARG(KV, "--no-spill");
    else if (spill) {
        ARG(KV, "--spill-bytes"); ARG(KV, spill);
    }
    if (push) { /* the store writes KV rows into the worker's buffers, on the worker's backend */
        /* the worker's kind: an emulated GPU is the cpu backend */
        ARG(KV, "--push-backend"); ARG(KV, link_gbps || devmem ? "cpu" : backend);
        ARG(WORKER, "--push");
        if (link_gbps) { /* and copies over a link like the worker's */
            ARG(KV, "--push-link-gbps"); ARG(KV, link_gbps);
        }
        if (link_gbps && link_lat) {
            ARG(KV, "--push-link-latency-us"); ARG(KV, link_lat);
        }
    }
    /* the store's own lease (5 s): the worker renews it while a step runs; a worker we start
     * again keeps its name, and so frees what the dead one left in the store at once */
    ARG(WORKER, "--name"); ARG(WORKER, "gpuworker");
    ARG(WORKER, "--model"); ARG(WORKER, model);
    ARG(WORKER, "--coordinator"); ARG(WORKER, ep_wrk);
    ARG(WORKER, "--kvstore"); ARG(WORKER, ep_kv);
    ARG(WORKER, "--mode"); ARG(WORKER, mode);
    ARG(WORKER, "--max-batch"); ARG(WORKER, max_batch);
    ARG(WORKER, "--backend"); ARG(WORKER, backend);
    if (approximate)
        ARG(WORKER, "--approximate");
    if (link_gbps) {
        ARG(WORKER, "--link-gbps"); ARG(WORKER, link_gbps);
    }
    if (link_lat) {
        ARG(WORKER, "--link-latency-us"); ARG(WORKER, link_lat);
    }
    if (devmem) {
        ARG(WORKER, "--device-memory"); ARG(WORKER, devmem);
    }
    ARG(COORD, "--control"); ARG(COORD, ep_ctl);
    ARG(COORD, "--workers"); ARG(COORD, ep_wrk);
    ARG(COORD, "--state-dir"); ARG(COORD, state);
    ARG(COORD, "--model"); ARG(COORD, model);
    ARG(COORD, "--queue"); ARG(COORD, queue);
    ARG(COORD, "--worker-timeout-ms"); ARG(COORD, timeout);
    if (chunk) {
        ARG(COORD, "--prefill-chunk"); ARG(COORD, chunk);
    }
    if (metrics) {
        ARG(COORD, "--metrics"); ARG(COORD, metrics);
        if (metrics_public)
            ARG(COORD, "--metrics-public");
    }
#undef ARG
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
    int rc = 1;
    static const int all[N_CHILD] = {KV, COORD, WORKER};
    int started = children_start(ch, all, N_CHILD, stop_fd);
    if (started) {
        rc = started > 0 ? 0 : 1;
        goto stop;
    }
    if (chatty)
        fprintf(stderr, "rekv run: serving on %s (kvstore, gpuworker and coordinator in %s); Ctrl-C "
                    "stops\n", ep_ctl, dir);
    if (ready_fd >= 0) {
        ssize_t w = write((int)ready_fd, "READY\n", 6);
        (void)w;
        close((int)ready_fd);
    }
    for (;;) {
        struct signalfd_siginfo si;
        ssize_t n = read(sfd, &si, sizeof(si));
        if (n != sizeof(si)) {
            if (n < 0 && errno == EINTR)
                continue;
            break;
        }
        if (si.ssi_signo != SIGCHLD) {
            if (chatty)
                fprintf(stderr, "rekv run: stopping\n");
            rc = 0;
            break;
        }
        int st;
        pid_t pid;
        int failed = 0;
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
                if (i == KV) /* the worker's arena mapping died with the store */
                    child_stop(&ch[WORKER]);
                int s1 = child_start(ch, i, stop_fd);
                if (s1 == 0 && i == KV && ch[WORKER].pid == 0)
                    s1 = child_start(ch, WORKER, stop_fd);
                if (s1 > 0) /* asked to stop meanwhile */
                    rc = 0;
                if (s1)
                    failed = 1;
            }
        }
        if (failed)
            break;
    }
stop:
    /* no new work first, then the worker, then the store it uses */
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
    close(stop_fd);
    close(sfd);
    return rc;
}
