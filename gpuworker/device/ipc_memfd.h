/* ipc_memfd.h — memory shared with other processes by memfd, as both backends use it: the cpu
 * backend's shared buffers and event pages, and the page beside each of the cuda backend's shared
 * events that names its last recorder (backend_cuda_ipc.cu). The exporter keeps the memfd open;
 * an importer opens it through /proc/PID/fd/FD and checks that it is still the one exported (its
 * name carries a random nonce), so nothing is named in /dev/shm and nothing outlives the
 * processes. C linkage, for the cuda runtime too. */
#ifndef REKV_GPUWORKER_DEVICE_IPC_MEMFD_H
#define REKV_GPUWORKER_DEVICE_IPC_MEMFD_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where an exported memfd is: what a handle carries (host byte order, same machine only). */
typedef struct rekv_ipc_memfd_ref {
    int32_t pid;    /* the exporting process */
    int32_t fd;     /* its memfd */
    uint64_t nonce; /* in the memfd's name: PREFIX<nonce>, 16 hex digits */
} rekv_ipc_memfd_ref;

/* A random number naming one export, so that a handle whose fd number has since been reused for
 * something else is told apart. */
uint64_t rekv_ipc_nonce(void);

/* A new memfd of len bytes named prefix + nonce, mapped shared into *map. Returns the fd, or a
 * negative errno with err filled ("BACKEND backend: ..."). */
int rekv_ipc_memfd_create(const char *backend, const char *prefix, uint64_t nonce, size_t len,
                          void **map, rekv_err *err);

/* Opens the memfd ref names, through /proc/PID/fd/FD, and checks that it is the one that was
 * exported (its name is prefix + ref's nonce) and has len bytes. Returns the new fd, or a negative
 * errno with err saying why: -EINVAL (no process named), -ESRCH (the exporter has exited),
 * -ENOENT (no longer exported), -ESTALE (the fd is something else now, or another size), another
 * errno from open. what names the call, e.g. "event_import". */
int rekv_ipc_memfd_open(const char *backend, const rekv_ipc_memfd_ref *ref, const char *prefix,
                        size_t len, const char *what, rekv_err *err);

#ifdef __cplusplus
}
#endif

#endif
