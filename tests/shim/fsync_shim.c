/* fsync_shim.c — an LD_PRELOAD library for test_journal_fsync: it logs, in the order the process
 * makes them, the calls that decide whether the coordinator's journal is durable before anyone
 * hears of it — write() and fsync()/fdatasync()/sync_file_range() on a file under one directory,
 * and zmq_send() of each message's last frame (what a client receives) — so the test can check
 * by order, with no timing, that a record was written and synced before its reply or end event
 * was sent. It can also make those syncs fail with EIO, as a failing disk would.
 *
 *   REKV_SHIM_DIR   the directory whose files are watched (the coordinator's --state-dir)
 *   REKV_SHIM_LOG   the log, appended one line per call (one write() each, so lines stay whole):
 *                     start PID
 *                     write PATH HEX          the bytes written (after the write returned)
 *                     sync FN PATH RC         after the call returned (RC 0 or -errno)
 *                     send SOCKET HEX         a zmq_send without ZMQ_SNDMORE (before sending)
 *   REKV_SHIM_FAIL  a file: while it exists, a watched sync fails with EIO and syncs nothing
 *
 * Built alone (the Makefile's rule for build/tests/libfsync_shim.so); it links nothing of rekv. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define SHIM_SNDMORE 2 /* ZMQ_SNDMORE */

static ssize_t (*real_write)(int, const void *, size_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_sync_file_range)(int, off64_t, off64_t, unsigned int);
static int (*real_zmq_send)(void *, const void *, size_t, int);

static int log_fd = -1;
static char dir[4096];
static size_t dir_len;
static const char *fail_file;

static void shim_log(const char *line, size_t n)
{
    if (log_fd >= 0 && real_write)
        (void)real_write(log_fd, line, n);
}

__attribute__((constructor)) static void shim_init(void)
{
    real_write = (ssize_t(*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    real_sync_file_range =
        (int (*)(int, off64_t, off64_t, unsigned int))dlsym(RTLD_NEXT, "sync_file_range");
    /* libzmq may load after us; looked up again on first use when absent here */
    real_zmq_send = (int (*)(void *, const void *, size_t, int))dlsym(RTLD_NEXT, "zmq_send");
    const char *d = getenv("REKV_SHIM_DIR"), *l = getenv("REKV_SHIM_LOG");
    fail_file = getenv("REKV_SHIM_FAIL");
    if (d && (dir_len = strlen(d)) < sizeof(dir))
        memcpy(dir, d, dir_len + 1);
    else
        dir_len = 0;
    if (l)
        log_fd = open(l, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    char line[64];
    int n = snprintf(line, sizeof(line), "start %d\n", (int)getpid());
    shim_log(line, (size_t)n);
}

/* The path of fd when it lies under REKV_SHIM_DIR (into path), else 0. */
static int watched(int fd, char *path, size_t cap)
{
    if (dir_len == 0 || log_fd < 0 || fd == log_fd)
        return 0;
    char link[64];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
    int saved = errno;
    ssize_t n = readlink(link, path, cap - 1);
    errno = saved;
    if (n <= 0)
        return 0;
    path[n] = '\0';
    return strncmp(path, dir, dir_len) == 0 && (path[dir_len] == '/' || path[dir_len] == '\0');
}

/* Logs "PREFIX HEX-OF-BUF\n". */
static void log_hex(const char *prefix, const void *buf, size_t len)
{
    size_t pre = strlen(prefix), n = pre + 2 * len + 1;
    char *line = malloc(n);
    if (line == NULL)
        return;
    memcpy(line, prefix, pre);
    static const char hx[] = "0123456789abcdef";
    const unsigned char *b = buf;
    for (size_t i = 0; i < len; i++) {
        line[pre + 2 * i] = hx[b[i] >> 4];
        line[pre + 2 * i + 1] = hx[b[i] & 15];
    }
    line[n - 1] = '\n';
    shim_log(line, n);
    free(line);
}

ssize_t write(int fd, const void *buf, size_t count)
{
    ssize_t w = real_write(fd, buf, count);
    char path[4096];
    if (w > 0 && watched(fd, path, sizeof(path))) {
        int saved = errno;
        char prefix[4200];
        snprintf(prefix, sizeof(prefix), "write %s ", path);
        log_hex(prefix, buf, (size_t)w);
        errno = saved;
    }
    return w;
}

/* A watched sync: fails with EIO while REKV_SHIM_FAIL exists, else calls the real one; logged
 * after it returned. */
static int sync_call(const char *fn, int fd, int (*real)(int, off64_t, off64_t, unsigned int),
                     int (*real1)(int), off64_t off, off64_t n, unsigned int flags)
{
    char path[4096];
    if (!watched(fd, path, sizeof(path)))
        return real ? real(fd, off, n, flags) : real1(fd);
    int rc;
    if (fail_file && access(fail_file, F_OK) == 0) {
        errno = EIO;
        rc = -1;
    } else {
        rc = real ? real(fd, off, n, flags) : real1(fd);
    }
    int saved = errno;
    char line[4300];
    int k = snprintf(line, sizeof(line), "sync %s %s %d\n", fn, path, rc < 0 ? -saved : 0);
    shim_log(line, (size_t)k < sizeof(line) ? (size_t)k : sizeof(line) - 1);
    errno = saved;
    return rc;
}

int fsync(int fd)
{
    return sync_call("fsync", fd, NULL, real_fsync, 0, 0, 0);
}
int fdatasync(int fd)
{
    return sync_call("fdatasync", fd, NULL, real_fdatasync, 0, 0, 0);
}
int sync_file_range(int fd, off64_t off, off64_t n, unsigned int flags)
{
    return sync_call("sync_file_range", fd, real_sync_file_range, NULL, off, n, flags);
}

int zmq_send(void *s, const void *buf, size_t len, int flags)
{
    if (real_zmq_send == NULL)
        real_zmq_send = (int (*)(void *, const void *, size_t, int))dlsym(RTLD_NEXT, "zmq_send");
    if (real_zmq_send == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if (!(flags & SHIM_SNDMORE) && log_fd >= 0) {
        int saved = errno;
        char prefix[64];
        snprintf(prefix, sizeof(prefix), "send %p ", s);
        log_hex(prefix, buf, len);
        errno = saved;
    }
    return real_zmq_send(s, buf, len, flags);
}
