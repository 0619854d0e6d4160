/* backend_cuda_internal.h — what the cuda runtime's three files share beyond cuda_internal.h (which
 * the engine's kernels share too): the event, and the functions one file calls in another.
 * backend_cuda.cu holds streams, events, graphs, memory, copies, stats and the interface table;
 * backend_cuda_gather.cu the gather kernels and listed copies; backend_cuda_ipc.cu shared
 * buffers and events and the flags in host memory. Nothing outside them includes it. */
#ifndef REKV_GPUWORKER_DEVICE_BACKEND_CUDA_INTERNAL_H
#define REKV_GPUWORKER_DEVICE_BACKEND_CUDA_INTERNAL_H

#include "gpuworker/device/cuda_internal.h"

/* The page beside a shared event: a memfd of the exporter's (ipc_memfd.h, rekv-cuev-<nonce>,
 * named in the handle's extra), where every record writes its process. A CUDA IPC event recorded
 * by a process that dies before the work completes never completes, so a waiter in another
 * process watches the recorder (backend_cuda_ipc.cu). Accessed with atomics only. */
#define CU_EV_PAGE_BYTES 4096u
#define CU_EV_PAGE_MAGIC 0x56455543u /* "CUEV" */
typedef struct cu_ev_page {
    uint32_t magic;   /* CU_EV_PAGE_MAGIC */
    uint32_t version; /* 1 */
    uint64_t nonce;   /* the handle's */
    int32_t recorder; /* the process of the latest event_record; 0: never recorded */
} cu_ev_page;

struct rekv_event {
    cuda_backend *be;
    cudaEvent_t ev;
    int shared;             /* created by event_create_shared, or imported */
    rekv_ipc_handle handle; /* shared: what event_export gives */
    cu_ev_page *page;       /* shared: mapped (CU_EV_PAGE_BYTES); NULL otherwise */
    int page_fd;            /* exported here: the page's memfd, open while the event lives; -1 */
    int refs;               /* under be->mu: its owner's, and one per stream's pending wait */
};

static inline cuda_backend *cuda_backend_of(rekv_backend *base)
{
    return (cuda_backend *)base->ctx;
}

/* ---- backend_cuda.cu ---- */

/* Drops a reference to ev (its owner's at event_destroy, a stream's wait's once resolved); the
 * last frees it. */
void cuda_event_unref(rekv_event *ev);

/* A call that blocks its caller on device work (stats.host_syncs). */
void cuda_count_host_sync(cuda_backend *be);
/* Only kernels and copies may be captured (backend.h): anything else enqueued during a capture
 * fails it (and does not run). 1 when s is capturing. */
int cuda_refused_in_capture(rekv_stream *s, const char *what);

/* ---- backend_cuda_gather.cu ---- */

/* The h2d runs as a gather when they are many small rows all in host_register's mapped ranges:
 * returns 1 with their descriptors in the ring at *lo_out (*rows_out of them; *lo_out < 0: the
 * stream failed), or 0 to leave them to DMA. */
int cuda_gather_prepare(rekv_stream *s, const rekv_copy_run *runs, size_t nr, size_t bytes,
                        long *lo_out, size_t *rows_out);
/* The launch and the ring's bookkeeping of a gather of n rows whose descriptors are at slice lo.
 * Returns 1 (done, or the stream failed). */
int cuda_gather_launch(rekv_stream *s, long lo, size_t n);
/* The interface's copy_h2d_listed and host_mapped. */
void cuda_copy_h2d_listed(rekv_stream *s, const rekv_copy_piece *pieces, const size_t *n,
                          size_t max, rekv_xfer_kind kind);
const void *cuda_host_mapped(rekv_backend *base, const void *p);
/* At a stream_sync: counts the listed gathers since the last one, when the stream ran them (ran;
 * else they are forgotten, as a failed stream's work is). */
void cuda_listed_resolve(rekv_stream *s, int ran);

/* ---- backend_cuda_ipc.cu: the interface's sharing and flag entries ---- */

void *cuda_dev_alloc_shared(rekv_backend *base, size_t bytes, rekv_ipc_handle *out, rekv_err *err);
int cuda_dev_import(rekv_backend *base, const rekv_ipc_handle *h, void **dev, size_t *bytes,
                    rekv_err *err);
void cuda_dev_unimport(rekv_backend *base, void *dev);
int cuda_event_create_shared(rekv_backend *base, rekv_event **out, rekv_err *err);
int cuda_event_export(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err);
int cuda_event_import(rekv_backend *base, const rekv_ipc_handle *h, rekv_event **out,
                      rekv_err *err);
/* Liveness of the push path's waits: event_record writes this process into a shared event's
 * page; stream_wait_event keeps, on the stream, a wait on a record made by another process. */
void cuda_event_note_record(rekv_event *ev);
void cuda_stream_note_wait(rekv_stream *s, rekv_event *ev);
/* Before a blocking sync of s: polls until every wait s keeps has completed (0), or one's
 * recorder has died first: then s is blocked for good on the device, marked so (peer_died,
 * peer_msg), and -EPIPE is returned. */
int cuda_stream_live_wait(rekv_stream *s);
/* Drops the waits s keeps (s is idle, or blocked for good). */
void cuda_stream_waits_clear(rekv_stream *s);
/* event_sync of a shared event another process recorded: polls while the recorder lives; 1 when
 * it did (the event completed or its recorder died), 0 when a blocking sync is safe. */
int cuda_event_live_sync(rekv_event *ev);
void cuda_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value);
void cuda_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value);
/* Looks up the driver's stream memory operations for be's flags (NULL where absent: the flag
 * kernels stand in) and the wait flags the device allows. */
void cuda_flags_probe(cuda_backend *be);

#endif
