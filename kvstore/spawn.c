/* spawn.c — a private kvstore: a forked child process running the server library, for programs
 * that need a store of their own (`rekv generate --local` in an offloaded mode, benchmarks, tests).
 * The child is the real store — its own process, arena, sockets and spill file. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstore/kvstore.h"

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
    if (n != 1) {
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
