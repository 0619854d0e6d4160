/* spawn.c — a private kvstore: a forked child process running the server library, for programs
 * that need a store of their own (`rekv generate --local` in an offloaded mode, benchmarks, tests).
 * The child is the real store — its own process, arena, sockets and spill file. With a GPU push
 * backend the child execs the rekv-kvstore program instead (CUDA cannot be used in a process
 * forked after its parent started CUDA). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstore/kvstore.h"

/* The rekv-kvstore program: beside this program, or in ../bin (a test in build/tests). */
static int find_daemon(char *path, size_t cap)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0)
        return -1;
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash == NULL)
        return -1;
    *slash = '\0';
    static const char *const rel[] = {"/rekv-kvstore", "/../bin/rekv-kvstore"};
    for (size_t i = 0; i < 2; i++)
        if (snprintf(path, cap, "%s%s", self, rel[i]) < (int)cap && access(path, X_OK) == 0)
            return 0;
    return -1;
}

/* In the forked child: becomes the rekv-kvstore program with cfg as arguments, reporting on
 * ready_fd. Needed where the store's push backend is a GPU's: a process forked from one that has
 * started CUDA cannot use CUDA, an exec'd program can. Returns only on failure. */
static void exec_daemon(const rekv_kvstore_config *cfg, int ready_fd)
{
    char prog[PATH_MAX + 32];
    if (find_daemon(prog, sizeof(prog)) < 0) {
        const char *m = "cannot find the rekv-kvstore program beside this one";
        ssize_t w = write(ready_fd, m, strlen(m));
        (void)w;
        return;
    }
    int fd = dup(ready_fd); /* without O_CLOEXEC: the program writes READY on it */
    const rekv_kv_geometry *g = &cfg->geometry;
    char num[10][32];
    const char *argv[48];
    int a = 0;
    argv[a++] = prog;
#define NUM(i, v) (snprintf(num[i], sizeof(num[i]), "%llu", (unsigned long long)(v)), num[i])
    argv[a++] = "--endpoint", argv[a++] = cfg->endpoint;
    argv[a++] = "--host-bytes", argv[a++] = NUM(0, cfg->host_bytes);
    argv[a++] = "--layers", argv[a++] = NUM(1, g->n_layers);
    argv[a++] = "--kv-heads", argv[a++] = NUM(2, g->n_kv_heads);
    argv[a++] = "--head-dim", argv[a++] = NUM(3, g->head_dim);
    argv[a++] = "--hidden", argv[a++] = NUM(4, g->hidden);
    argv[a++] = "--cache-dtype", argv[a++] = rekv_dtype_name(g->dtype);
    argv[a++] = "--ready-fd", argv[a++] = NUM(5, fd);
    if (cfg->lease_ms)
        argv[a++] = "--lease-ms", argv[a++] = NUM(6, cfg->lease_ms);
    if (cfg->high_pct)
        argv[a++] = "--high-pct", argv[a++] = NUM(7, cfg->high_pct);
    if (cfg->low_pct)
        argv[a++] = "--low-pct", argv[a++] = NUM(8, cfg->low_pct);
    if (cfg->spill_bytes)
        argv[a++] = "--spill-bytes", argv[a++] = NUM(9, cfg->spill_bytes);
#undef NUM
    if (cfg->spill_dir)
        argv[a++] = "--spill-dir", argv[a++] = cfg->spill_dir;
    if (cfg->fd_socket)
        argv[a++] = "--fd-socket", argv[a++] = cfg->fd_socket;
    if (cfg->no_spill)
        argv[a++] = "--no-spill";
    if (cfg->huge_pages)
        argv[a++] = "--huge-pages";
    if (cfg->no_register_arena)
        argv[a++] = "--no-register-arena";
    argv[a++] = "--push-backend", argv[a++] = cfg->push_backend;
    char gbps[32], lat[32];
    if (cfg->push_link.gbps > 0) {
        snprintf(gbps, sizeof(gbps), "%.17g", cfg->push_link.gbps);
        snprintf(lat, sizeof(lat), "%.17g", cfg->push_link.latency_us);
        argv[a++] = "--push-link-gbps", argv[a++] = gbps;
        argv[a++] = "--push-link-latency-us", argv[a++] = lat;
    }
    argv[a] = NULL;
    setenv("REKV_LOG", "warn", 0); /* a private store is quiet unless asked */
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_UNBLOCK, &all, NULL); /* the program stops on SIGTERM through its handler */
    execv(prog, (char *const *)argv);
    char m[PATH_MAX + 64];
    snprintf(m, sizeof(m), "exec %s: %s", prog, strerror(errno));
    ssize_t w = write(ready_fd, m, strlen(m));
    (void)w;
}

int rekv_kvstore_spawn(const rekv_kvstore_config *cfg_in, pid_t *pid_out, rekv_err *err)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) < 0)
        return rekv_errf(err, -errno, "kvstore: pipe: %s", strerror(errno));
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        close(pfd[0]);
        close(pfd[1]);
        return rekv_errf(err, -e, "kvstore: fork: %s", strerror(e));
    }
    if (pid == 0) {
        close(pfd[0]);
        /* a private store lives no longer than the process that started it */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(1); /* the parent died before the prctl */
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGTERM);
        sigaddset(&set, SIGINT);
        sigprocmask(SIG_BLOCK, &set, NULL);
        if (cfg_in->push_backend && cfg_in->push_backend[0] &&
            strcmp(cfg_in->push_backend, "cpu") != 0) {
            exec_daemon(cfg_in, pfd[1]);
            _exit(1);
        }
        rekv_kvstore_config cfg = *cfg_in;
        cfg.signal_fd = signalfd(-1, &set, SFD_CLOEXEC);
        cfg.on_event = NULL;
        rekv_kvstore_server *s = NULL;
        rekv_err e = {0};
        if (rekv_kvstore_server_create(&cfg, &s, &e) < 0) {
            ssize_t w = write(pfd[1], e.msg, strlen(e.msg));
            (void)w;
            _exit(1);
        }
        ssize_t w = write(pfd[1], "", 1);
        (void)w;
        close(pfd[1]);
        int rc = rekv_kvstore_server_run(s, &e);
        rekv_kvstore_server_destroy(s);
        _exit(rc < 0 ? 1 : 0);
    }
    close(pfd[1]);
    char msg[1100] = {0};
    ssize_t n;
    do
        n = read(pfd[0], msg, sizeof(msg) - 1);
    while (n < 0 && errno == EINTR);
    close(pfd[0]);
    /* the library child sends one NUL byte, the exec'd program "READY\n"; else an error */
    if (n != 1 && !(n == 6 && memcmp(msg, "READY\n", 6) == 0)) {
        waitpid(pid, NULL, 0);
        return rekv_errf(err, -EIO, "kvstore: the private store did not start: %s",
                         n > 0 ? msg : "it exited");
    }
    *pid_out = pid;
    return 0;
}

int rekv_kvstore_reap(pid_t pid)
{
    if (pid <= 0)
        return 0;
    kill(pid, SIGTERM);
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -errno;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -EIO;
}
