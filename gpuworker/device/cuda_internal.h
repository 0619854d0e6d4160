/* cuda_internal.h — the cuda backend's runtime structures, shared by the runtime
 * (device/backend_cuda*.cu) and the engine's CUDA kernels (gpuworker/kernels_cuda.cu), which launch
 * on a rekv_stream's CUDA stream, time their launches with the runtime's events and fail the stream
 * as the runtime does. Nothing else includes it: the device room's public face is backend.h.
 *
 * A stream carries one slot for the kernels' own per-stream state (kstate: kernels_cuda.cu keeps a
 * cuBLAS handle bound to the stream and the GEMM's input scratch there), created by the kernels
 * on first use and freed through kstate_free when the stream is destroyed, after it is idle — so
 * the runtime never calls cuBLAS. Both files are linked into librekv_cuda.so, whose entry point
 * (kernels_cuda.cu) joins the runtime's constructor and the kernel table (backend_cuda.h). */
#ifndef REKV_GPUWORKER_DEVICE_CUDA_INTERNAL_H
#define REKV_GPUWORKER_DEVICE_CUDA_INTERNAL_H

#include <cuda.h> /* the driver API's types and constants only: libcuda is not linked */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>

/* nvcc does not get the C files' -DREKV_CUDA=1; a .cu file is the CUDA build by definition */
#ifndef REKV_CUDA
#define REKV_CUDA 1
#endif

extern "C" {
#include "gpuworker/device/backend_cuda.h"
}

/* what an op is, for busy times: waits are traced but count as nothing */
enum { CU_OP_COMPUTE = 0, CU_OP_H2D = 1, CU_OP_D2H = 2, CU_OP_D2D = 3, CU_OP_WAIT = 4 };

/* cuStreamWaitValue32 and cuStreamWriteValue32 (v2, CUDA >= 12.0: the same signature) */
typedef CUresult(CUDAAPI *cu_value32_fn)(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                         unsigned int flags);

/* One op awaiting resolution: its timing events, what it was, and its label. */
typedef struct cu_pending {
    cudaEvent_t a, b; /* recorded just before and just after the op on its stream */
    int what;         /* CU_OP_* */
    int traced;       /* enqueued while tracing: becomes a span */
    char label[52];
} cu_pending;

/* A resolved span of the trace, in ms from the trace's reference event. */
typedef struct cu_span {
    double start_ms, dur_ms;
    uint32_t tid; /* index in stream_names + 1 */
    char label[52];
} cu_span;

/* A host range host_register page-locked and mapped, and where the device sees it. */
typedef struct cu_host_reg {
    const char *host, *dev;
    size_t bytes;
} cu_host_reg;

/* One row of a gather (backend_cuda_gather.cu): src is the device address of mapped host memory. */
typedef struct cu_gather_desc {
    const char *src;
    char *dst;
    size_t bytes;
} cu_gather_desc;

/* A stream's gather descriptors: a ring in mapped pinned memory that the gather kernels read; a
 * slice [lo, hi) is in use until the event recorded after its kernel completes. */
enum { CU_GATHER_RING = 1 << 16, CU_GATHER_INFLIGHT = 128 }; /* a step's units, and more */
typedef struct cu_gather_ring {
    cu_gather_desc *host; /* NULL until the stream's first gather */
    const cu_gather_desc *dev;
    size_t cap;  /* descriptors it holds: CU_GATHER_RING, or 4x the largest gather */
    size_t head; /* where the next slice starts, unless it must wrap */
    struct {
        cudaEvent_t ev;
        size_t lo, hi;
    } busy[CU_GATHER_INFLIGHT];
    int n_busy;
} cu_gather_ring;

/* A gather whose list a kernel wrote (copy_h2d_listed), counted at its stream's next sync. */
typedef struct cu_listed {
    const rekv_copy_piece *pieces; /* host_alloc memory, read by the host at the sync */
    const size_t *n;
    size_t max;
    rekv_xfer_kind kind;
} cu_listed;

/* A stream's wait on a shared event that another process recorded (cu_stream_wait_event), kept
 * until the stream's next sync, which polls it while its recorder lives (backend_cuda_ipc.cu). */
typedef struct cu_shared_wait {
    rekv_event *ev; /* holds a reference (backend_cuda_internal.h) */
    int32_t pid;    /* the process of the record the wait orders against */
} cu_shared_wait;

typedef struct cuda_backend {
    rekv_backend base; /* iface, ctx (points back here); first, so casts work */
    int device;
    int sms;                     /* multiprocessors (how many blocks fill the device) */
    cu_value32_fn wait_value32;  /* the driver's stream memory operations; NULL where absent */
    cu_value32_fn write_value32; /* (flag waits and writes then run as kernels) */
    unsigned wait_flags;         /* CU_STREAM_WAIT_VALUE_GEQ, | FLUSH where the device can */

    pthread_mutex_t mu;       /* protects every field below */
    rekv_backend_stats stats; /* counters since creation or the last stats_reset */
    cudaEvent_t *pool;        /* free timing events */
    size_t n_pool, cap_pool;

    int timing;                /* timing(on): ops enqueued now are timed */
    int tracing;               /* trace_start was called (ops are timed and traced) */
    cudaStream_t trace_stream; /* records the reference event */
    cudaEvent_t trace_ref;     /* GPU time 0 of the trace; NULL until the first trace_start */
    cu_span *spans;
    size_t n_spans, cap_spans;
    uint64_t dropped_spans;
    char **stream_names; /* every stream ever created; trace tracks outlive streams */
    size_t n_streams, cap_streams;
    cu_host_reg *regs; /* host_register's ranges */
    size_t n_regs, cap_regs;
} cuda_backend;

struct rekv_stream {
    cuda_backend *be;
    cudaStream_t cs;
    uint32_t tid;     /* trace track */
    const char *name; /* be->stream_names[tid - 1] */
    cu_pending *pend; /* ops enqueued since the last resolution, in order */
    size_t n_pend, cap_pend;
    void *kstate;                      /* the kernels' state for this stream; NULL until set */
    void (*kstate_free)(void *kstate); /* frees it, called once the stream is idle */
    int err_code;                      /* first failure since the last stream_sync, 0 when none */
    char err_msg[512];
    cu_gather_ring gather;
    cu_listed *listed; /* listed gathers since the last sync */
    size_t n_listed, cap_listed;
    int capturing;               /* between graph_begin and graph_end (CUDA stream capture) */
    rekv_backend_stats captured; /* the copies' counters of the capture, for its graph */
    int pre_capture_code;        /* a failure pending at graph_begin, restored at graph_end */
    char pre_capture_msg[512];
    cu_shared_wait *waits; /* waits on other processes' records since the last sync */
    size_t n_waits, cap_waits;
    int32_t peer_died; /* a recorder it waits on died first: blocked for good on the device */
    char peer_msg[256];
    /* operations enqueued so far: every cuda_stream_check (each enqueue checks its call) and
     * cuda_launch_check counts one, as do a capture's begin and end (more counted than enqueued
     * is harmless). The kernels' 16-bit GEMM input is tagged with it (kernels_cuda.cu cu_x16):
     * a tag whose count is still the stream's has had nothing enqueued after it. Atomic: a host
     * function's check may run on CUDA's thread. */
    uint64_t enq;
};

/* s->enq now, and one more enqueued */
static inline uint64_t cuda_enq_now(rekv_stream *s)
{
    return __atomic_load_n(&s->enq, __ATOMIC_RELAXED);
}
static inline void cuda_enq_count(rekv_stream *s)
{
    __atomic_add_fetch(&s->enq, 1, __ATOMIC_RELAXED);
}

/* Creates the runtime on device `device` (the module's backend_create, backend_cuda.h). */
int cuda_backend_create(int device, rekv_backend **out, rekv_err *err);

/* Makes the backend's device current on the calling thread (a no-op when it already is). */
static inline void cuda_use_device(const cuda_backend *be)
{
    cudaSetDevice(be->device);
}

/* Keeps the first failure of a stream until its next stream_sync. */
void cuda_stream_fail(rekv_stream *s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Whether e is one of the errors CUDA documents as sticky: the context is corrupt, every later
 * call fails, only a new process gets a working device. */
int cuda_error_is_sticky(cudaError_t e);
/* Keeps a CUDA error as the stream's failure (-ENODEV for a sticky one: device lost, backend.h;
 * -EIO otherwise, with the error's name); returns 1 when there was one. */
int cuda_stream_check(rekv_stream *s, cudaError_t e, const char *what);
/* Checks a kernel launch. */
void cuda_launch_check(rekv_stream *s, const char *kernel);
/* Starts timing an op on s (CU_OP_*) when timing or tracing (never inside a graph capture): records
 * its start event. Returns the pending index, or -1 when the op goes untimed (not timing; or no
 * event: timing is best effort, the op itself is not affected). */
long cuda_op_begin(rekv_stream *s, int what, const char *label);
/* Ends the op cuda_op_begin started (i < 0: nothing). */
void cuda_op_end(rekv_stream *s, long i);

#endif
