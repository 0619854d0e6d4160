/* backend_cuda_internal.h — what the cuda runtime's three files share beyond cuda_internal.h (which
 * the engine's kernels share too): the event, and the functions one file calls in another.
 * backend_cuda.cu holds streams, events, graphs, memory, copies, stats and the interface table;
 * backend_cuda_gather.cu the gather kernel and deferred copies; backend_cuda_ipc.cu shared
 * buffers and events and the flags in host memory. Nothing outside them includes it. */
#ifndef REKV_GPUWORKER_DEVICE_BACKEND_CUDA_INTERNAL_H
#define REKV_GPUWORKER_DEVICE_BACKEND_CUDA_INTERNAL_H

#include "gpuworker/device/cuda_internal.h"

struct rekv_event {
    cuda_backend *be;
    cudaEvent_t ev;
    int shared;             /* created by event_create_shared, or imported */
    rekv_ipc_handle handle; /* shared: what event_export gives */
};

static inline cuda_backend *cuda_backend_of(rekv_backend *base)
{
    return (cuda_backend *)base->ctx;
}

/* ---- backend_cuda.cu ---- */

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
/* The interface's copy_h2d_deferred. */
void cuda_copy_h2d_deferred(rekv_stream *s, const rekv_copy_piece *pieces, const size_t *n,
                            size_t max, rekv_xfer_kind kind);

/* ---- backend_cuda_ipc.cu: the interface's sharing and flag entries ---- */

void *cuda_dev_alloc_shared(rekv_backend *base, size_t bytes, rekv_ipc_handle *out, rekv_err *err);
int cuda_dev_import(rekv_backend *base, const rekv_ipc_handle *h, void **dev, size_t *bytes,
                    rekv_err *err);
void cuda_dev_unimport(rekv_backend *base, void *dev);
int cuda_event_create_shared(rekv_backend *base, rekv_event **out, rekv_err *err);
int cuda_event_export(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err);
int cuda_event_import(rekv_backend *base, const rekv_ipc_handle *h, rekv_event **out,
                      rekv_err *err);
void cuda_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value);
void cuda_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value);
/* Looks up the driver's stream memory operations for be's flags (NULL where absent: the flag
 * kernels stand in) and the wait flags the device allows. */
void cuda_flags_probe(cuda_backend *be);

#endif
