/* ipc_memfd.c — memory shared with other processes by memfd (ipc_memfd.h). */
#define _GNU_SOURCE
#include "gpuworker/device/ipc_memfd.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"

uint64_t rekv_ipc_nonce(void)
{
    static atomic_uint_fast64_t counter;
    uint64_t n = 0;
    if (getrandom(&n, sizeof(n), GRND_NONBLOCK) != (ssize_t)sizeof(n))
        n = rekv_now_ns() ^ ((uint64_t)getpid() << 32);
    return n ^ atomic_fetch_add(&counter, 0x9e3779b97f4a7c15ull);
}

int rekv_ipc_memfd_create(const char *backend, const char *prefix, uint64_t nonce, size_t len,
                          void **map, rekv_err *err)
{
    char name[64];
    int fd, rc;
    snprintf(name, sizeof(name), "%s%016llx", prefix, (unsigned long long)nonce);
    fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0)
        return rekv_errf(err, -errno, "%s backend: memfd_create: %s", backend, strerror(errno));
    if (ftruncate(fd, (off_t)len) != 0) {
        rc = rekv_errf(err, -errno, "%s backend: cannot size shared memory to %zu bytes: %s",
                       backend, len, strerror(errno));
        goto out_close;
    }
    *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (*map == MAP_FAILED) {
        rc = rekv_errf(err, -errno, "%s backend: cannot map %zu bytes of shared memory: %s",
                       backend, len, strerror(errno));
        goto out_close;
    }
    return fd;

out_close:
    close(fd);
    return rc;
}

int rekv_ipc_memfd_open(const char *backend, const rekv_ipc_memfd_ref *ref, const char *prefix,
                        size_t len, const char *what, rekv_err *err)
{
    char path[64], want[64], link[256];
    struct stat st;
    int fd, rc;

    if (ref->pid <= 0 || ref->fd < 0)
        return rekv_errf(err, -EINVAL,
                         "%s backend: %s: the handle names no process (pid %d, fd %d)", backend,
                         what, (int)ref->pid, (int)ref->fd);
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)ref->pid, (int)ref->fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (kill(ref->pid, 0) != 0 && errno == ESRCH)
            return rekv_errf(err, -ESRCH, "%s backend: %s: the exporting process %d has exited",
                             backend, what, (int)ref->pid);
        if (e == ENOENT)
            return rekv_errf(err, -ENOENT,
                             "%s backend: %s: process %d no longer exports it (freed, or the "
                             "process is exiting)",
                             backend, what, (int)ref->pid);
        return rekv_errf(err, -e, "%s backend: %s: cannot open %s (the exporter's memory): %s%s",
                         backend, what, path, strerror(e),
                         e == EACCES ? " (another user's process, or one made undumpable)" : "");
    }
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    link[n > 0 ? n : 0] = '\0';
    int wn =
        snprintf(want, sizeof(want), "/memfd:%s%016llx", prefix, (unsigned long long)ref->nonce);
    if (strncmp(link, want, (size_t)wn) != 0 || (link[wn] != '\0' && link[wn] != ' ')) {
        rc = rekv_errf(err, -ESTALE,
                       "%s backend: %s: stale handle: fd %d of process %d is no longer what was "
                       "exported (it is %s)",
                       backend, what, (int)ref->fd, (int)ref->pid, link[0] ? link : "unreadable");
        goto out_close;
    }
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != (uint64_t)len) {
        rc = rekv_errf(err, -ESTALE,
                       "%s backend: %s: the exported memory has %lld bytes, the handle says %zu",
                       backend, what, (long long)st.st_size, len);
        goto out_close;
    }
    return fd;

out_close:
    close(fd);
    return rc;
}
