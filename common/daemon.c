/* daemon.c — see daemon.h. */
#define _GNU_SOURCE
#include "common/daemon.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include "common/clock.h"

static int g_stop_fd = -1;
static uint64_t g_wd_usec, g_wd_last_ns;

static void on_stop_signal(int sig)
{
    uint64_t one = 1;
    ssize_t w = write(g_stop_fd, &one, sizeof(one));
    (void)w;
    (void)sig;
}

int rekv_daemon_stop_fd(void)
{
    if (g_stop_fd >= 0)
        return g_stop_fd;
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0)
        return -errno;
    g_stop_fd = fd;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGTERM, &sa, NULL) < 0 || sigaction(SIGINT, &sa, NULL) < 0) {
        int e = errno;
        close(fd);
        g_stop_fd = -1;
        return -e;
    }
    signal(SIGPIPE, SIG_IGN);
    /* every client, worker and store connection is a file descriptor: the soft limit (often
     * 1024) goes up to the hard one, which the units raise (LimitNOFILE=) */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        (void)setrlimit(RLIMIT_NOFILE, &rl); /* best effort: a daemon still runs at the lower */
    }
    return fd;
}

void rekv_daemon_ready(int ready_fd)
{
    if (ready_fd >= 0) {
        ssize_t w = write(ready_fd, "READY\n", 6);
        (void)w;
        close(ready_fd);
    }
    const char *ns = getenv("NOTIFY_SOCKET");
    if (ns && *ns) {
        sd_notify(0, "READY=1");
        if (sd_watchdog_enabled(0, &g_wd_usec) <= 0)
            g_wd_usec = 0;
        g_wd_last_ns = rekv_now_ns();
    }
}

void rekv_daemon_watchdog(void)
{
    if (g_wd_usec == 0)
        return;
    uint64_t now = rekv_now_ns();
    if (now - g_wd_last_ns >= g_wd_usec * 1000ull / 3) {
        sd_notify(0, "WATCHDOG=1");
        g_wd_last_ns = now;
    }
}

void rekv_daemon_stopping(void)
{
    const char *ns = getenv("NOTIFY_SOCKET");
    if (ns && *ns)
        sd_notify(0, "STOPPING=1");
}

int rekv_parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    if (*s < '0' || *s > '9')
        return -1;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    int shift = 0;
    if (*end == 'K' || *end == 'k')
        shift = 10;
    else if (*end == 'M' || *end == 'm')
        shift = 20;
    else if (*end == 'G' || *end == 'g')
        shift = 30;
    else if (*end != '\0')
        return -1;
    if (shift && end[1] != '\0')
        return -1;
    if (shift && v > (UINT64_MAX >> shift))
        return -1;
    *out = (uint64_t)v << shift;
    return 0;
}

int rekv_parse_u32(const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end || *s == '-' || v > UINT32_MAX)
        return -1;
    *out = (uint32_t)v;
    return 0;
}
