/* backend_cuda.cu — the cuda backend: both tables of backend.h and kernels.h on an NVIDIA GPU.
 *
 * Runtime: device memory from cudaMalloc; host memory for per-step metadata from cudaHostAlloc
 * (pinned, mapped and portable), which kernels read through its host pointer (UVA); every
 * rekv_stream is a non-blocking CUDA stream with a cuBLAS handle of its own (a handle's workspace
 * must not be shared by concurrent streams); events are cudaEvent_t without timing. Nothing runs
 * on the default stream, and every launch is checked with cudaGetLastError.
 *
 * Errors: an enqueue that fails (a bad argument, a failed launch, a cuBLAS error) is kept by its
 * stream, first failure wins, and returned by the next stream_sync, with any error the CUDA
 * runtime reports there, as -EIO and the CUDA error string — the same contract as the cpu backend.
 *
 * Stats and trace: byte and copy counters are exact and counted at enqueue. Busy times are
 * measured on the GPU: every copy and kernel is bracketed by a pair of timing events (from a
 * pool), resolved when its stream is synchronised; compute_busy_s sums kernel durations, h2d and
 * d2h busy sum copy durations (device-to-device copies are traced, not counted, as on cpu). So
 * busy times cover work up to each stream's last stream_sync. The trace is the same measurement:
 * one span per copy or kernel, on a track per stream, in GPU time relative to an event recorded at
 * trace_start; work enqueued before trace_start is not in it.
 *
 * Kernels (fp32 activations; weight matrices in the model file's dtype, as the engine holds them):
 * - linear: fp32 weights: cublasSgemm (full fp32, no TF32); f16/bf16 weights: x rounded to the
 *   weights' dtype into a per-stream scratch, then cublasGemmEx with fp32 accumulation and output
 *   (tensor cores). Then a bias kernel. Not row-invariant like cpu_gemm.c, so bits may depend on
 *   batching; results agree with the cpu reference within fp32 rounding (fp32 weights) or the
 *   16-bit rounding of x (16-bit weights).
 * - norm: one block per row, two-pass LayerNorm as cpu_norm does, reductions in shared memory.
 * - rope: angles as cpu_rope_table (the float exponent), with pow and cos/sin in double rounded to
 *   float, which matches glibc's correctly rounded powf/cosf/sinf almost always.
 * - attention: one block per (head, sequence, row slice); the block's warps split the context,
 *   each keeps an online softmax, and the block merges them (flash-decoding's split, within a
 *   block). The `scores` scratch is not used.
 * - the rest: element- or row-parallel; one block per row where a row reads mapped metadata, read
 *   once per block through shared memory.
 *
 * Sharing with other processes: shared buffers are cudaMalloc'd and named by cudaIpcGetMemHandle,
 * imported with cudaIpcOpenMemHandle; shared events are created with cudaEventInterprocess and
 * named by cudaIpcGetEventHandle. Flag waits and writes are the driver's stream memory operations
 * (cuStreamWaitValue32 / cuStreamWriteValue32), looked up with cudaGetDriverEntryPoint* so that
 * the program does not link libcuda (it must start on machines without a driver); where they
 * are missing or refused, a one-thread kernel polls or stores the flag instead. A flag wait is
 * timed and traced like a copy ("wait flag >= N") but is not compute time. */
#include <cublas_v2.h>
#include <cuda.h> /* the driver API's types and constants only: libcuda is not linked */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* nvcc does not get the C files' -DREKV_CUDA=1; this file is the CUDA build by definition */
#ifndef REKV_CUDA
#define REKV_CUDA 1
#endif

extern "C" {
#include "common/dtype.h"
#include "gpuworker/backend_cuda.h"
#include "gpuworker/kernels.h"
}

/* ------------------------------------------------------------------ runtime structures */

/* what an op is, for busy times: waits are traced but count as nothing */
enum { CU_OP_COMPUTE = 0, CU_OP_H2D = 1, CU_OP_D2H = 2, CU_OP_D2D = 3, CU_OP_WAIT = 4 };

/* cuStreamWaitValue32 and cuStreamWriteValue32 (v2, CUDA >= 12.0: the same signature) */
typedef CUresult(CUDAAPI *cu_value32_fn)(CUstream stream, CUdeviceptr addr, cuuint32_t value,
                                         unsigned int flags);

/* Trace spans kept at most; later ones are counted as dropped. */
#define CU_TRACE_MAX_SPANS (1u << 20)

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

typedef struct cuda_backend {
    rekv_backend base; /* iface, kernels, ctx (points back here); first, so casts work */
    int device;
    int sms;                     /* multiprocessors (how many blocks fill the device) */
    cu_value32_fn wait_value32;  /* the driver's stream memory operations; NULL where absent */
    cu_value32_fn write_value32; /* (flag waits and writes then run as kernels) */
    unsigned wait_flags;         /* CU_STREAM_WAIT_VALUE_GEQ, | FLUSH where the device can */

    pthread_mutex_t mu;       /* protects every field below */
    rekv_backend_stats stats; /* counters since creation or the last stats_reset */
    cudaEvent_t *pool;        /* free timing events */
    size_t n_pool, cap_pool;

    int tracing;               /* trace_start was called */
    cudaStream_t trace_stream; /* records the reference event */
    cudaEvent_t trace_ref;     /* GPU time 0 of the trace; NULL until the first trace_start */
    cu_span *spans;
    size_t n_spans, cap_spans;
    uint64_t dropped_spans;
    char **stream_names; /* every stream ever created; trace tracks outlive streams */
    size_t n_streams, cap_streams;
} cuda_backend;

struct rekv_stream {
    cuda_backend *be;
    cudaStream_t cs;
    cublasHandle_t blas; /* bound to cs */
    uint32_t tid;        /* trace track */
    const char *name;    /* be->stream_names[tid - 1] */
    cu_pending *pend;    /* ops enqueued since the last resolution, in order */
    void *xh;            /* linear with 16-bit weights: x rounded to the weights' dtype */
    size_t xh_cap;       /* bytes (stream-ordered allocation, grown on demand) */
    size_t n_pend, cap_pend;
    int err_code; /* first failure since the last stream_sync, 0 when none */
    char err_msg[512];
};

struct rekv_event {
    cuda_backend *be;
    cudaEvent_t ev;
    int shared;             /* created by event_create_shared, or imported */
    rekv_ipc_handle handle; /* shared: what event_export gives */
};

static cuda_backend *backend_of(rekv_backend *base)
{
    return (cuda_backend *)base->ctx;
}

/* Makes the backend's device current on the calling thread (a no-op when it already is). */
static void use_device(const cuda_backend *be)
{
    cudaSetDevice(be->device);
}

static void stream_fail(rekv_stream *s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void stream_fail(rekv_stream *s, int code, const char *fmt, ...)
{
    if (s->err_code != 0)
        return;
    s->err_code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err_msg, sizeof(s->err_msg), fmt, ap);
    va_end(ap);
}

/* Keeps a CUDA error as the stream's failure; returns 1 when there was one. */
static int stream_check(rekv_stream *s, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 0;
    stream_fail(s, -EIO, "cuda stream %s: %s: %s", s->name, what, cudaGetErrorString(e));
    return 1;
}

/* Checks a kernel launch. */
static void launch_check(rekv_stream *s, const char *kernel)
{
    stream_check(s, cudaGetLastError(), kernel);
}

/* ------------------------------------------------------------------ timing events */

static cudaEvent_t pool_get(cuda_backend *be)
{
    cudaEvent_t e = NULL;
    pthread_mutex_lock(&be->mu);
    if (be->n_pool > 0)
        e = be->pool[--be->n_pool];
    pthread_mutex_unlock(&be->mu);
    if (e == NULL && cudaEventCreate(&e) != cudaSuccess) {
        cudaGetLastError();
        e = NULL;
    }
    return e;
}

/* Called with be->mu held. */
static void pool_put_locked(cuda_backend *be, cudaEvent_t e)
{
    if (e == NULL)
        return;
    if (be->n_pool == be->cap_pool) {
        size_t cap = be->cap_pool ? be->cap_pool * 2 : 256;
        cudaEvent_t *np = (cudaEvent_t *)realloc(be->pool, cap * sizeof(*np));
        if (np == NULL) {
            cudaEventDestroy(e);
            return;
        }
        be->pool = np;
        be->cap_pool = cap;
    }
    be->pool[be->n_pool++] = e;
}

/* Starts timing an op on s: records its start event. Returns the pending index or -1 (the op then
 * goes untimed: timing is best effort, the op itself is not affected). */
static long op_begin(rekv_stream *s, int what, const char *label)
{
    cuda_backend *be = s->be;
    if (s->n_pend == s->cap_pend) {
        size_t cap = s->cap_pend ? s->cap_pend * 2 : 256;
        cu_pending *np = (cu_pending *)realloc(s->pend, cap * sizeof(*np));
        if (np == NULL)
            return -1;
        s->pend = np;
        s->cap_pend = cap;
    }
    cudaEvent_t a = pool_get(be), b = pool_get(be);
    if (a == NULL || b == NULL || cudaEventRecord(a, s->cs) != cudaSuccess) {
        cudaGetLastError();
        pthread_mutex_lock(&be->mu);
        pool_put_locked(be, a);
        pool_put_locked(be, b);
        pthread_mutex_unlock(&be->mu);
        return -1;
    }
    cu_pending *p = &s->pend[s->n_pend];
    p->a = a;
    p->b = b;
    p->what = what;
    pthread_mutex_lock(&be->mu);
    p->traced = be->tracing;
    pthread_mutex_unlock(&be->mu);
    snprintf(p->label, sizeof(p->label), "%s", label);
    return (long)s->n_pend++;
}

static void op_end(rekv_stream *s, long i)
{
    if (i < 0)
        return;
    if (cudaEventRecord(s->pend[i].b, s->cs) != cudaSuccess) {
        /* unresolvable: give the events back and forget the op */
        cudaGetLastError();
        cuda_backend *be = s->be;
        pthread_mutex_lock(&be->mu);
        pool_put_locked(be, s->pend[i].a);
        pool_put_locked(be, s->pend[i].b);
        pthread_mutex_unlock(&be->mu);
        s->n_pend--; /* i is the last one: nothing was enqueued after it */
    }
}

/* After the stream has synchronised: adds the ops' durations to the stats and their spans to the
 * trace, and returns their events to the pool. */
static void stream_resolve(rekv_stream *s)
{
    cuda_backend *be = s->be;
    pthread_mutex_lock(&be->mu);
    for (size_t i = 0; i < s->n_pend; i++) {
        cu_pending *p = &s->pend[i];
        float ms = 0, t0 = 0;
        if (cudaEventElapsedTime(&ms, p->a, p->b) == cudaSuccess && ms >= 0) {
            double sec = (double)ms * 1e-3;
            if (p->what == CU_OP_COMPUTE)
                be->stats.compute_busy_s += sec;
            else if (p->what == CU_OP_H2D)
                be->stats.h2d_busy_s += sec;
            else if (p->what == CU_OP_D2H)
                be->stats.d2h_busy_s += sec;
            if (p->traced && be->tracing && be->trace_ref != NULL &&
                cudaEventElapsedTime(&t0, be->trace_ref, p->a) == cudaSuccess) {
                if (be->n_spans == CU_TRACE_MAX_SPANS) {
                    be->dropped_spans++;
                } else {
                    if (be->n_spans == be->cap_spans) {
                        size_t cap = be->cap_spans ? be->cap_spans * 2 : 4096;
                        cu_span *ns = (cu_span *)realloc(be->spans, cap * sizeof(*ns));
                        if (ns != NULL) {
                            be->spans = ns;
                            be->cap_spans = cap;
                        }
                    }
                    if (be->n_spans < be->cap_spans) {
                        cu_span *sp = &be->spans[be->n_spans++];
                        sp->start_ms = t0 < 0 ? 0 : t0;
                        sp->dur_ms = ms;
                        sp->tid = s->tid;
                        memcpy(sp->label, p->label, sizeof(sp->label));
                    } else {
                        be->dropped_spans++;
                    }
                }
            }
        }
        cudaGetLastError(); /* a failed query must not surface as a later launch's error */
        pool_put_locked(be, p->a);
        pool_put_locked(be, p->b);
    }
    s->n_pend = 0;
    pthread_mutex_unlock(&be->mu);
}

/* ------------------------------------------------------------------ memory */

static void *cu_dev_alloc(rekv_backend *base, size_t bytes)
{
    cuda_backend *be = backend_of(base);
    void *p = NULL;
    use_device(be);
    /* a zero-byte request still gets a unique pointer, as on the cpu backend */
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError(); /* out of memory is not sticky; do not let it fail a later launch */
        return NULL;
    }
    return p;
}

static void cu_dev_free(rekv_backend *base, void *p)
{
    if (p == NULL)
        return;
    use_device(backend_of(base));
    cudaFree(p); /* implicitly waits for the device: callers free only idle buffers anyway */
}

static void *cu_host_alloc(rekv_backend *base, size_t bytes)
{
    void *p = NULL;
    use_device(backend_of(base));
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cu_host_free(rekv_backend *base, void *p)
{
    if (p != NULL)
        cudaFreeHost(p);
}

/* ------------------------------------------------------------------ streams and events */

static int cu_stream_create(rekv_backend *base, const char *name, rekv_stream **out, rekv_err *err)
{
    cuda_backend *be = backend_of(base);
    const char *nm0 = name ? name : "stream";
    rekv_stream *s = NULL;
    char *nm = NULL;
    cudaError_t ce;
    cublasStatus_t bs;
    int rc = 0;

    *out = NULL;
    use_device(be);
    s = (rekv_stream *)calloc(1, sizeof(*s));
    nm = strdup(nm0);
    if (s == NULL || nm == NULL) {
        rc = rekv_errf(err, -ENOMEM, "cuda backend: out of memory creating stream %s", nm0);
        goto out_free;
    }
    s->be = be;
    if ((ce = cudaStreamCreateWithFlags(&s->cs, cudaStreamNonBlocking)) != cudaSuccess) {
        rc = rekv_errf(err, -EIO, "cuda backend: cannot create stream %s: %s", nm0,
                       cudaGetErrorString(ce));
        goto out_free;
    }
    if ((bs = cublasCreate(&s->blas)) != CUBLAS_STATUS_SUCCESS) {
        rc = rekv_errf(err, bs == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO,
                       "cuda backend: cannot create a cuBLAS handle for stream %s: %s", nm0,
                       cublasGetStatusString(bs));
        goto out_stream;
    }
    /* full fp32 products (no TF32), as the cpu reference computes them */
    if (cublasSetStream(s->blas, s->cs) != CUBLAS_STATUS_SUCCESS ||
        cublasSetMathMode(s->blas, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS) {
        rc = rekv_errf(err, -EIO, "cuda backend: cannot bind cuBLAS to stream %s", nm0);
        goto out_blas;
    }

    pthread_mutex_lock(&be->mu);
    if (be->n_streams == be->cap_streams) {
        size_t cap = be->cap_streams ? be->cap_streams * 2 : 16;
        char **nn = (char **)realloc(be->stream_names, cap * sizeof(*nn));
        if (nn == NULL) {
            pthread_mutex_unlock(&be->mu);
            rc = rekv_errf(err, -ENOMEM, "cuda backend: out of memory creating stream %s", nm0);
            goto out_blas;
        }
        be->stream_names = nn;
        be->cap_streams = cap;
    }
    be->stream_names[be->n_streams++] = nm;
    s->tid = (uint32_t)be->n_streams;
    s->name = nm;
    pthread_mutex_unlock(&be->mu);
    *out = s;
    return 0;

out_blas:
    cublasDestroy(s->blas);
out_stream:
    cudaStreamDestroy(s->cs);
out_free:
    free(nm);
    free(s);
    return rc;
}

static int cu_stream_sync(rekv_stream *s, rekv_err *err)
{
    use_device(s->be);
    cudaError_t e = cudaStreamSynchronize(s->cs);
    if (e == cudaSuccess)
        e = cudaGetLastError();
    stream_check(s, e, "synchronize");
    stream_resolve(s); /* ops whose events cannot be read (after a fault) are dropped */
    int rc = 0;
    if (s->err_code != 0) {
        rc = rekv_errf(err, s->err_code, "%s", s->err_msg);
        s->err_code = 0;
        s->err_msg[0] = '\0';
    }
    return rc;
}

static void cu_stream_destroy(rekv_stream *s)
{
    if (s == NULL)
        return;
    cu_stream_sync(s, NULL);
    cuda_backend *be = s->be;
    pthread_mutex_lock(&be->mu);
    for (size_t i = 0; i < s->n_pend; i++) { /* left when the sync failed */
        pool_put_locked(be, s->pend[i].a);
        pool_put_locked(be, s->pend[i].b);
    }
    pthread_mutex_unlock(&be->mu);
    free(s->pend);
    if (s->xh != NULL)
        cudaFree(s->xh); /* the stream is idle: synchronised above */
    cublasDestroy(s->blas);
    cudaStreamDestroy(s->cs);
    free(s); /* the name belongs to the backend */
}

static int cu_event_create(rekv_backend *base, rekv_event **out, rekv_err *err)
{
    cuda_backend *be = backend_of(base);
    *out = NULL;
    use_device(be);
    rekv_event *ev = (rekv_event *)calloc(1, sizeof(*ev));
    if (ev == NULL)
        return rekv_errf(err, -ENOMEM, "cuda backend: out of memory creating an event");
    cudaError_t e = cudaEventCreateWithFlags(&ev->ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        free(ev);
        return rekv_errf(err, -EIO, "cuda backend: cannot create an event: %s",
                         cudaGetErrorString(e));
    }
    ev->be = be;
    *out = ev;
    return 0;
}

static void cu_event_destroy(rekv_event *ev)
{
    if (ev == NULL)
        return;
    /* CUDA keeps an event alive until enqueued work that uses it has run */
    cudaEventDestroy(ev->ev);
    free(ev);
}

static void cu_event_record(rekv_event *ev, rekv_stream *s)
{
    use_device(s->be);
    stream_check(s, cudaEventRecord(ev->ev, s->cs), "event record");
}

static void cu_stream_wait_event(rekv_stream *s, rekv_event *ev)
{
    use_device(s->be);
    /* an event never recorded is complete, as on the cpu backend */
    stream_check(s, cudaStreamWaitEvent(s->cs, ev->ev, 0), "wait for event");
}

static void cu_event_sync(rekv_event *ev)
{
    /* void by contract: a failure here is a device fault, which is sticky and surfaces at the
     * next stream_sync */
    use_device(ev->be);
    cudaEventSynchronize(ev->ev);
}

/* ---------------------------------------------------------------- sharing with other processes */

static_assert(sizeof(cudaIpcMemHandle_t) <= sizeof(((rekv_ipc_handle *)0)->payload),
              "cudaIpcMemHandle_t fits a handle's payload");
static_assert(sizeof(cudaIpcEventHandle_t) <= sizeof(((rekv_ipc_handle *)0)->payload),
              "cudaIpcEventHandle_t fits a handle's payload");

/* A cudaMalloc allocation of its own (IPC names whole allocations), named by its IPC handle. */
static void *cu_dev_alloc_shared(rekv_backend *base, size_t bytes, rekv_ipc_handle *out,
                                 rekv_err *err)
{
    cuda_backend *be = backend_of(base);
    cudaIpcMemHandle_t mh;
    void *p = NULL;
    cudaError_t e;

    use_device(be);
    if ((e = cudaMalloc(&p, bytes ? bytes : 1)) != cudaSuccess) {
        cudaGetLastError();
        rekv_errf(err, e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO,
                  "cuda backend: cannot allocate %zu bytes of shared device memory: %s", bytes,
                  cudaGetErrorString(e));
        return NULL;
    }
    if ((e = cudaIpcGetMemHandle(&mh, p)) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(p);
        rekv_errf(err, -EIO, "cuda backend: cudaIpcGetMemHandle: %s", cudaGetErrorString(e));
        return NULL;
    }
    rekv_ipc_handle_init(out, REKV_IPC_MEM, "cuda", bytes);
    memcpy(out->payload, &mh, sizeof(mh));
    return p;
}

static int cu_dev_import(rekv_backend *base, const rekv_ipc_handle *h, void **dev, size_t *bytes,
                         rekv_err *err)
{
    cudaIpcMemHandle_t mh;
    cudaError_t e;
    int rc;

    *dev = NULL;
    if ((rc = rekv_ipc_handle_check(h, REKV_IPC_MEM, "cuda", "cuda backend: dev_import", err)) < 0)
        return rc;
    memcpy(&mh, h->payload, sizeof(mh));
    use_device(backend_of(base));
    if ((e = cudaIpcOpenMemHandle(dev, mh, cudaIpcMemLazyEnablePeerAccess)) != cudaSuccess) {
        cudaGetLastError();
        *dev = NULL;
        return rekv_errf(err, -EIO,
                         "cuda backend: dev_import: cudaIpcOpenMemHandle: %s (has the exporting "
                         "process exited or freed the buffer? the exporter must be another "
                         "process)",
                         cudaGetErrorString(e));
    }
    if (bytes)
        *bytes = (size_t)h->bytes;
    return 0;
}

static void cu_dev_unimport(rekv_backend *base, void *dev)
{
    if (dev == NULL)
        return;
    use_device(backend_of(base));
    if (cudaIpcCloseMemHandle(dev) != cudaSuccess)
        cudaGetLastError();
}

static int cu_event_create_shared(rekv_backend *base, rekv_event **out, rekv_err *err)
{
    cuda_backend *be = backend_of(base);
    cudaIpcEventHandle_t eh;
    cudaError_t e;

    *out = NULL;
    use_device(be);
    rekv_event *ev = (rekv_event *)calloc(1, sizeof(*ev));
    if (ev == NULL)
        return rekv_errf(err, -ENOMEM, "cuda backend: out of memory creating an event");
    /* CUDA requires both flags of an event another process opens */
    e = cudaEventCreateWithFlags(&ev->ev, cudaEventDisableTiming | cudaEventInterprocess);
    if (e != cudaSuccess) {
        cudaGetLastError();
        free(ev);
        return rekv_errf(err, -EIO, "cuda backend: cannot create an interprocess event: %s",
                         cudaGetErrorString(e));
    }
    if ((e = cudaIpcGetEventHandle(&eh, ev->ev)) != cudaSuccess) {
        cudaGetLastError();
        cudaEventDestroy(ev->ev);
        free(ev);
        return rekv_errf(err, -EIO, "cuda backend: cudaIpcGetEventHandle: %s",
                         cudaGetErrorString(e));
    }
    ev->be = be;
    ev->shared = 1;
    rekv_ipc_handle_init(&ev->handle, REKV_IPC_EVENT, "cuda", 0);
    memcpy(ev->handle.payload, &eh, sizeof(eh));
    *out = ev;
    return 0;
}

static int cu_event_export(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err)
{
    if (!ev->shared)
        return rekv_errf(err, -EINVAL,
                         "cuda backend: event_export: the event was made by "
                         "event_create; only event_create_shared's can be exported");
    *out = ev->handle;
    return 0;
}

/* The opened event behaves as one created with cudaEventDisableTiming: record, wait, sync and
 * destroy work on it as on any other. */
static int cu_event_import(rekv_backend *base, const rekv_ipc_handle *h, rekv_event **out,
                           rekv_err *err)
{
    cuda_backend *be = backend_of(base);
    cudaIpcEventHandle_t eh;
    cudaError_t e;
    int rc;

    *out = NULL;
    rc = rekv_ipc_handle_check(h, REKV_IPC_EVENT, "cuda", "cuda backend: event_import", err);
    if (rc < 0)
        return rc;
    rekv_event *ev = (rekv_event *)calloc(1, sizeof(*ev));
    if (ev == NULL)
        return rekv_errf(err, -ENOMEM, "cuda backend: out of memory importing an event");
    memcpy(&eh, h->payload, sizeof(eh));
    use_device(be);
    if ((e = cudaIpcOpenEventHandle(&ev->ev, eh)) != cudaSuccess) {
        cudaGetLastError();
        free(ev);
        return rekv_errf(err, -EIO,
                         "cuda backend: event_import: cudaIpcOpenEventHandle: %s (has the "
                         "exporting process exited?)",
                         cudaGetErrorString(e));
    }
    ev->be = be;
    ev->shared = 1;
    ev->handle = *h;
    *out = ev;
    return 0;
}

/* ------------------------------------------------------------------ copies */

/* One cudaMemcpyAsync per piece; cudaMemcpyDefault lets UVA tell pinned, pageable and device
 * memory apart (the kvstore arena is pageable unless registered; pageable copies are correct but
 * synchronous with respect to the host). Counted exactly at enqueue. */
static void copy_enqueue(rekv_stream *s, int dir, const rekv_copy_piece *pieces, size_t n,
                         rekv_xfer_kind kind)
{
    static const char *const dir_names[] = {"", "h2d", "d2h", "d2d"};
    size_t bytes = 0;
    char why[160];
    if (rekv_copy_check(dir_names[dir], pieces, n, kind, &bytes, why, sizeof(why)) < 0) {
        stream_fail(s, -EINVAL, "stream %s: %s", s->name, why);
        return;
    }
    cuda_backend *be = s->be;
    if (dir != CU_OP_D2D) {
        pthread_mutex_lock(&be->mu);
        if (dir == CU_OP_H2D) {
            be->stats.h2d_bytes[kind] += bytes;
            be->stats.h2d_copies++;
        } else {
            be->stats.d2h_bytes[kind] += bytes;
            be->stats.d2h_copies++;
        }
        pthread_mutex_unlock(&be->mu);
    }
    use_device(be);
    char label[64];
    rekv_copy_label(label, sizeof(label), dir_names[dir], kind, bytes);
    /* as few DMA operations as the pieces allow: each costs microseconds whatever its size */
    rekv_copy_run one[16], *runs = n <= 16 ? one : (rekv_copy_run *)malloc(n * sizeof(*runs));
    if (runs == NULL) {
        stream_fail(s, -ENOMEM, "stream %s: out of memory for a copy of %zu pieces", s->name, n);
        return;
    }
    size_t nr = rekv_copy_coalesce(pieces, n, runs);
    long op = op_begin(s, dir, label);
    for (size_t i = 0; i < nr; i++) {
        const rekv_copy_run *r = &runs[i];
        cudaError_t rc = r->height == 1
                             ? cudaMemcpyAsync(r->dst, r->src, r->width, cudaMemcpyDefault, s->cs)
                             : cudaMemcpy2DAsync(r->dst, r->dpitch, r->src, r->spitch, r->width,
                                                 r->height, cudaMemcpyDefault, s->cs);
        if (rc == cudaErrorInvalidValue && r->count > 1) {
            /* merged across two allocations that touch: copy its pieces one by one */
            (void)cudaGetLastError();
            rc = cudaSuccess;
            for (size_t j = r->first; j < r->first + r->count && rc == cudaSuccess; j++)
                if (pieces[j].bytes)
                    rc = cudaMemcpyAsync(pieces[j].dst, pieces[j].src, pieces[j].bytes,
                                         cudaMemcpyDefault, s->cs);
        }
        if (stream_check(s, rc, dir_names[dir]))
            break;
    }
    op_end(s, op);
    if (runs != one)
        free(runs);
}

static void cu_copy_h2d(rekv_stream *s, const rekv_copy_piece *pieces, size_t n,
                        rekv_xfer_kind kind)
{
    copy_enqueue(s, CU_OP_H2D, pieces, n, kind);
}

static void cu_copy_d2h(rekv_stream *s, const rekv_copy_piece *pieces, size_t n,
                        rekv_xfer_kind kind)
{
    copy_enqueue(s, CU_OP_D2H, pieces, n, kind);
}

static void cu_copy_d2d(rekv_stream *s, const rekv_copy_piece *pieces, size_t n)
{
    copy_enqueue(s, CU_OP_D2D, pieces, n, REKV_XFER_OTHER);
}

/* ------------------------------------------------------------------ host functions */

typedef struct host_call {
    rekv_host_fn fn;
    void *arg; /* the copy below, or the caller's pointer when arg_bytes was 0 */
    int owned; /* free this call (and its copy) after running */
    max_align_t payload[];
} host_call;

static void CUDART_CB host_trampoline(void *p)
{
    host_call *c = (host_call *)p;
    c->fn(c->arg);
    free(c);
}

/* fn runs on a CUDA runtime thread once the stream reaches it; it must not call CUDA. A copy of
 * arg is kept on the heap until then; arg_bytes == 0 passes arg itself, as on cpu. */
static void cu_launch_host(rekv_stream *s, const char *name, rekv_host_fn fn, const void *arg,
                           size_t arg_bytes)
{
    const char *nm = name ? name : "host";
    if (fn == NULL) {
        stream_fail(s, -EINVAL, "stream %s: launch of host function %s with a NULL function",
                    s->name, nm);
        return;
    }
    if (arg_bytes > 0 && arg == NULL) {
        stream_fail(s, -EINVAL, "stream %s: host function %s: NULL argument of %zu bytes", s->name,
                    nm, arg_bytes);
        return;
    }
    host_call *c = (host_call *)malloc(sizeof(*c) + arg_bytes);
    if (c == NULL) {
        stream_fail(s, -ENOMEM, "stream %s: out of memory launching host function %s", s->name, nm);
        return;
    }
    c->fn = fn;
    if (arg_bytes > 0) {
        memcpy(c->payload, arg, arg_bytes);
        c->arg = c->payload;
    } else {
        c->arg = (void *)arg;
    }
    use_device(s->be);
    long op = op_begin(s, CU_OP_COMPUTE, nm);
    if (stream_check(s, cudaLaunchHostFunc(s->cs, host_trampoline, c), nm))
        free(c);
    op_end(s, op);
}

/* ------------------------------------------------------------------ flags in host memory */

/* Fallbacks where the driver's stream memory operations are missing or refused: one thread that
 * polls, or stores, the flag through the device's mapping of the host memory. */
__global__ static void flag_wait_kernel(const volatile uint32_t *flag, uint32_t value)
{
    while ((int32_t)(*flag - value) < 0)
        __nanosleep(2000);
}

__global__ static void flag_write_kernel(volatile uint32_t *flag, uint32_t value)
{
    __threadfence_system(); /* what the stream's earlier work wrote is visible first */
    *flag = value;
    __threadfence_system();
}

/* The device's address of a flag in mapped host memory; fails the stream when there is none. */
static int flag_device_ptr(rekv_stream *s, const uint32_t *flag, const char *what, CUdeviceptr *out)
{
    void *d = NULL;
    if (flag == NULL || ((uintptr_t)flag & 3u) != 0) {
        stream_fail(s, -EINVAL, "cuda stream %s: %s: flag %p is %s", s->name, what,
                    (const void *)flag, flag == NULL ? "NULL" : "not 4-byte aligned");
        return -1;
    }
    cudaError_t e = cudaHostGetDevicePointer(&d, (void *)flag, 0);
    if (e != cudaSuccess) {
        cudaGetLastError();
        stream_fail(s, -EINVAL,
                    "cuda stream %s: %s: flag %p is not in host memory the device can read "
                    "(host_alloc it, or host_register what holds it): %s",
                    s->name, what, (const void *)flag, cudaGetErrorString(e));
        return -1;
    }
    *out = (CUdeviceptr)(uintptr_t)d;
    return 0;
}

static void cu_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value)
{
    cuda_backend *be = s->be;
    CUdeviceptr d;
    char label[48];

    use_device(be);
    if (flag_device_ptr(s, flag, "wait for flag", &d) < 0)
        return;
    snprintf(label, sizeof(label), "wait flag >= %u", (unsigned)value);
    long op = op_begin(s, CU_OP_WAIT, label);
    if (be->wait_value32 == NULL ||
        be->wait_value32(s->cs, d, value, be->wait_flags) != CUDA_SUCCESS) {
        flag_wait_kernel<<<1, 1, 0, s->cs>>>((const volatile uint32_t *)(uintptr_t)d, value);
        launch_check(s, "wait flag");
    }
    op_end(s, op);
}

static void cu_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value)
{
    cuda_backend *be = s->be;
    CUdeviceptr d;

    use_device(be);
    if (flag_device_ptr(s, flag, "write flag", &d) < 0)
        return;
    /* the default flags fence the stream's earlier writes before the store */
    if (be->write_value32 == NULL ||
        be->write_value32(s->cs, d, value, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
        flag_write_kernel<<<1, 1, 0, s->cs>>>((volatile uint32_t *)(uintptr_t)d, value);
        launch_check(s, "write flag");
    }
}

/* A driver function by name, without linking libcuda; NULL when the driver lacks it. */
static void *driver_entry(const char *symbol)
{
    void *fn = NULL;
#if CUDART_VERSION >= 12000
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    /* 12.0: the ABI (the _v2 functions) that cu_value32_fn describes */
    cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &q);
#else
    cudaError_t e = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault, &q);
#endif
    int found = e == cudaSuccess && q == cudaDriverEntryPointSuccess;
#else
    cudaError_t e = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault);
    int found = e == cudaSuccess;
#endif
    if (!found) {
        cudaGetLastError();
        return NULL;
    }
    return fn;
}

/* ------------------------------------------------------------------ stats and trace */

static void cu_stats(rekv_backend *base, rekv_backend_stats *out)
{
    cuda_backend *be = backend_of(base);
    pthread_mutex_lock(&be->mu);
    *out = be->stats;
    pthread_mutex_unlock(&be->mu);
}

static void cu_stats_reset(rekv_backend *base)
{
    cuda_backend *be = backend_of(base);
    pthread_mutex_lock(&be->mu);
    memset(&be->stats, 0, sizeof(be->stats));
    pthread_mutex_unlock(&be->mu);
}

static void cu_trace_start(rekv_backend *base)
{
    cuda_backend *be = backend_of(base);
    use_device(be);
    pthread_mutex_lock(&be->mu);
    be->n_spans = 0;
    be->dropped_spans = 0;
    be->tracing = 0;
    if (be->trace_ref == NULL && cudaEventCreate(&be->trace_ref) != cudaSuccess)
        be->trace_ref = NULL;
    /* the trace stream is idle: the reference completes at once, and waiting for it makes every
     * later span's offset from it readable */
    if (be->trace_ref != NULL && cudaEventRecord(be->trace_ref, be->trace_stream) == cudaSuccess &&
        cudaEventSynchronize(be->trace_ref) == cudaSuccess)
        be->tracing = 1;
    cudaGetLastError();
    pthread_mutex_unlock(&be->mu);
}

/* Spans of ops whose streams have not been synchronised since are not in the file yet. */
static int cu_trace_write(rekv_backend *base, const char *path, rekv_err *err)
{
    cuda_backend *be = backend_of(base);
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return rekv_errf(err, -errno, "%s: cannot create trace file: %s", path, strerror(errno));
    char extra[64];
    snprintf(extra, sizeof(extra), "\"device\": %d, \"clock\": \"gpu events\", ", be->device);
    pthread_mutex_lock(&be->mu);
    rekv_trace_begin(f, "cuda", extra, be->n_spans, be->dropped_spans, be->stream_names,
                     be->n_streams);
    for (size_t i = 0; i < be->n_spans; i++) {
        const cu_span *sp = &be->spans[i];
        rekv_trace_span(f, sp->tid, sp->start_ms * 1e3, sp->dur_ms * 1e3, sp->label);
    }
    pthread_mutex_unlock(&be->mu);
    return rekv_trace_end(f, path, err);
}

static void cu_destroy(rekv_backend *base)
{
    cuda_backend *be = backend_of(base);
    use_device(be);
    for (size_t i = 0; i < be->n_pool; i++)
        cudaEventDestroy(be->pool[i]);
    free(be->pool);
    if (be->trace_ref != NULL)
        cudaEventDestroy(be->trace_ref);
    if (be->trace_stream != NULL)
        cudaStreamDestroy(be->trace_stream);
    for (size_t i = 0; i < be->n_streams; i++)
        free(be->stream_names[i]);
    free(be->stream_names);
    free(be->spans);
    pthread_mutex_destroy(&be->mu);
    free(be);
}

/* ------------------------------------------------------------------ kernels */

enum { EW_THREADS = 256, ROW_THREADS = 256, ATT_WARPS = 8, ATT_ROW_SLICES = 16 };
/* split attention: at most this many chunks of a context, each at least this many positions */
enum { ATT_MAX_SPLITS = 32, ATT_MIN_CHUNK = 64 };
/* head_dim <= 512 (kernels.h): an attention lane holds up to 16 elements of its output */
enum { ATT_MAX_PER_LANE = 16 };

static unsigned ew_blocks(size_t n)
{
    size_t b = (n + EW_THREADS - 1) / EW_THREADS;
    return (unsigned)(b > 65536 ? 65536 : b ? b : 1);
}

/* A kernel op: timed and traced, launch checked. */
#define KLAUNCH(s, name, kernel, grid, block, shmem, ...)                                          \
    do {                                                                                           \
        use_device((s)->be);                                                                       \
        long op_ = op_begin((s), CU_OP_COMPUTE, (name));                                           \
        kernel<<<(grid), (block), (shmem), (s)->cs>>>(__VA_ARGS__);                                \
        launch_check((s), (name));                                                                 \
        op_end((s), op_);                                                                          \
    } while (0)

__device__ __forceinline__ static float load_as_f32(const void *p, size_t i, int dtype)
{
    if (dtype == REKV_DTYPE_F16)
        return __half2float(((const __half *)p)[i]);
    if (dtype == REKV_DTYPE_BF16)
        return __uint_as_float((uint32_t)((const uint16_t *)p)[i] << 16);
    return ((const float *)p)[i];
}

/* p[i] = f in dtype: f16 and bf16 round to nearest even (bf16 as rekv_f32_to_bf16, bit for bit) */
__device__ __forceinline__ static void store_from_f32(void *p, size_t i, float f, int dtype)
{
    if (dtype == REKV_DTYPE_F16) {
        ((__half *)p)[i] = __float2half_rn(f); /* nearest even, overflow to inf */
    } else if (dtype == REKV_DTYPE_BF16) {
        uint32_t u = __float_as_uint(f);
        uint16_t r;
        if ((u & 0x7fffffffu) > 0x7f800000u)
            r = (uint16_t)((u >> 16) | 0x40);
        else
            r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        ((uint16_t *)p)[i] = r;
    } else {
        ((float *)p)[i] = f;
    }
}

__global__ static void convert_out_kernel(void *dst, const float *src, size_t n, int dtype)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        store_from_f32(dst, i, src[i], dtype);
}

/* Sum over the block; every thread gets the result. red: blockDim.x / 32 floats of shared. */
__device__ static float block_sum(float v, float *red)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* red may still be read from a previous call */
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    float t = 0;
    for (int i = 0; i < nw; i++)
        t += red[i];
    return t;
}

__global__ static void bias_kernel(float *y, const float *bias, size_t total, int n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] += bias[i % (size_t)n];
}

/* s->xh holds at least bytes (stream-ordered: the old buffer is freed after the work that uses
 * it). 0, or -ENOMEM with the stream failed. */
static int stream_scratch(rekv_stream *s, size_t bytes)
{
    if (bytes <= s->xh_cap)
        return 0;
    size_t want = bytes + bytes / 4;
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, want, s->cs);
    if (e != cudaSuccess) {
        cudaGetLastError();
        stream_fail(s, -ENOMEM, "cuda stream %s: out of device memory for %zu bytes of scratch: %s",
                    s->name, want, cudaGetErrorString(e));
        return -ENOMEM;
    }
    if (s->xh != NULL)
        cudaFreeAsync(s->xh, s->cs);
    s->xh = p;
    s->xh_cap = want;
    return 0;
}

static void k_linear(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                     const float *bias, int m, int n, int k)
{
    if (m <= 0 || n <= 0)
        return;
    use_device(s->be);
    const float one = 1.0f, zero = 0.0f;
    long op = op_begin(s, CU_OP_COMPUTE, "linear");
    /* cuBLAS is column-major: row-major y[m][n] is y^T (n x m, ld n) = op_T(w) · x, where w's
     * rows [n][k] are a k x n matrix (ld k), transposed to n x k, and x is k x m (ld k) */
    cublasStatus_t st;
    if (wt == REKV_DTYPE_F32) {
        st = cublasSgemm(s->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, (const float *)w, k, x,
                         k, &zero, y, n);
    } else {
        /* 16-bit weights: x rounded to the same dtype, products on tensor cores, fp32 sums */
        size_t xe = (size_t)m * (size_t)k;
        if (stream_scratch(s, xe * 2) != 0) {
            op_end(s, op);
            return;
        }
        convert_out_kernel<<<ew_blocks(xe), EW_THREADS, 0, s->cs>>>(s->xh, x, xe, (int)wt);
        launch_check(s, "linear x");
        cudaDataType dt = wt == REKV_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
        st = cublasGemmEx(s->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, dt, k, s->xh, dt, k,
                          &zero, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
        stream_fail(s, -EIO, "cuda stream %s: %s GEMM (m %d, n %d, k %d): %s", s->name,
                    rekv_dtype_name(wt), m, n, k, cublasGetStatusString(st));
    else
        launch_check(s, "linear");
    if (bias != NULL && st == CUBLAS_STATUS_SUCCESS) {
        size_t total = (size_t)m * (size_t)n;
        bias_kernel<<<ew_blocks(total), EW_THREADS, 0, s->cs>>>(y, bias, total, n);
        launch_check(s, "linear bias");
    }
    op_end(s, op);
}

__global__ static void norm_kernel(float *out, const float *in, const float *w, const float *b,
                                   int d, float eps)
{
    __shared__ float red[ROW_THREADS / 32];
    const float *x = in + (size_t)blockIdx.x * d;
    float *y = out + (size_t)blockIdx.x * d;
    if (b != NULL) {
        float sum = 0;
        for (int j = threadIdx.x; j < d; j += blockDim.x)
            sum += x[j];
        float mean = block_sum(sum, red) / (float)d;
        float var = 0;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            float c = x[j] - mean;
            var += c * c;
        }
        var = block_sum(var, red) / (float)d;
        float inv = 1.0f / sqrtf(var + eps);
        /* each thread writes only what it read, after both reductions: out may equal in */
        for (int j = threadIdx.x; j < d; j += blockDim.x)
            y[j] = (x[j] - mean) * inv * w[j] + b[j];
    } else {
        float ss = 0;
        for (int j = threadIdx.x; j < d; j += blockDim.x)
            ss += x[j] * x[j];
        float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)d + eps);
        for (int j = threadIdx.x; j < d; j += blockDim.x)
            y[j] = w[j] * (x[j] * inv);
    }
}

static void k_norm(rekv_stream *s, float *out, const float *in, const float *w, const float *b,
                   int m, int d, float eps)
{
    if (m <= 0 || d <= 0)
        return;
    KLAUNCH(s, "norm", norm_kernel, m, ROW_THREADS, 0, out, in, w, b, d, eps);
}

/* One block per row; threads over (head, pair). */
__global__ static void rope_kernel(float *x, const int32_t *pos, int n_heads, int head_dim,
                                   float theta, int adjacent)
{
    __shared__ float p;
    if (threadIdx.x == 0)
        p = (float)pos[blockIdx.x]; /* mapped host memory: read once per block */
    __syncthreads();
    int half = head_dim / 2;
    float *row = x + (size_t)blockIdx.x * (size_t)n_heads * (size_t)head_dim;
    for (int i = threadIdx.x; i < n_heads * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        /* as cpu_rope_table, with pow/cos/sin in double rounded to float so that the angles and
         * their cos/sin are those of glibc's correctly rounded float functions */
        float e = (float)(2 * j) / (float)head_dim;
        float inv_freq = 1.0f / (float)pow((double)theta, (double)e);
        float a = p * inv_freq;
        float c = (float)cos((double)a), sn = (float)sin((double)a);
        float *v = row + (size_t)h * head_dim;
        float *pa = adjacent ? &v[2 * j] : &v[j];
        float *pb = adjacent ? &v[2 * j + 1] : &v[j + half];
        float x0 = *pa, x1 = *pb;
        *pa = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
        *pb = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
    }
}

static void k_rope(rekv_stream *s, float *x, const int32_t *pos, int m, int n_heads, int head_dim,
                   float theta, rekv_rope style)
{
    if (m <= 0 || n_heads <= 0 || head_dim < 2 || style == REKV_ROPE_NONE)
        return;
    if (head_dim > 512) {
        stream_fail(s, -EINVAL, "cuda stream %s: rope with head_dim %d > 512", s->name, head_dim);
        return;
    }
    KLAUNCH(s, "rope", rope_kernel, m, ROW_THREADS, 0, x, pos, n_heads, head_dim, theta,
            style == REKV_ROPE_ADJACENT);
}

__global__ static void act_kernel(float *a, const float *b, size_t n, int act)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = a[i];
        if (act == REKV_ACT_RELU) {
            a[i] = v > 0 ? v : 0;
        } else if (act == REKV_ACT_GELU) {
            a[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
        } else {
            float sv = v / (1.0f + expf(-v));
            a[i] = b ? sv * b[i] : sv;
        }
    }
}

static void k_activation(rekv_stream *s, float *x, const float *b, size_t n, rekv_act act)
{
    if (n == 0)
        return;
    KLAUNCH(s, "activation", act_kernel, ew_blocks(n), EW_THREADS, 0, x, b, n, (int)act);
}

__global__ static void add_kernel(float *x, const float *y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static void k_add(rekv_stream *s, float *x, const float *y, size_t n)
{
    if (n == 0)
        return;
    KLAUNCH(s, "add", add_kernel, ew_blocks(n), EW_THREADS, 0, x, y, n);
}

__global__ static void embed_kernel(float *x, const void *table, int tdtype, const int32_t *tokens,
                                    const float *pos_table, const int32_t *pos, int pos_offset,
                                    int e)
{
    __shared__ int tok, ps;
    if (threadIdx.x == 0) {
        tok = table ? tokens[blockIdx.x] : 0;
        ps = pos_table ? pos[blockIdx.x] + pos_offset : 0;
    }
    __syncthreads();
    float *row = x + (size_t)blockIdx.x * e;
    const float *pr = pos_table ? pos_table + (size_t)ps * e : NULL;
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        float v = table ? load_as_f32(table, (size_t)tok * e + j, tdtype) : row[j];
        if (pr)
            v += pr[j];
        row[j] = v;
    }
}

static void k_embed(rekv_stream *s, float *x, const void *table, rekv_dtype tt,
                    const int32_t *tokens, const float *pos_table, const int32_t *pos,
                    int pos_offset, int m, int e)
{
    if (m <= 0 || e <= 0 || (table == NULL && pos_table == NULL))
        return;
    KLAUNCH(s, "embed", embed_kernel, m, ROW_THREADS, 0, x, table, (int)tt, tokens, pos_table, pos,
            pos_offset, e);
}

/* One block per row r: its K and V heads go to seqs[row_seq[r]] at position row_pos[r], stored in
 * the cache dtype. */
__global__ static void scatter_kernel(const float *k, const float *v, const int32_t *row_seq,
                                      const int32_t *row_pos, const rekv_attn_seq *seqs, int n_kv,
                                      int hd, int dtype)
{
    __shared__ void *kv;
    __shared__ int p;
    if (threadIdx.x == 0) {
        kv = seqs[row_seq[blockIdx.x]].kv;
        p = row_pos[blockIdx.x];
    }
    __syncthreads();
    size_t src0 = (size_t)blockIdx.x * (size_t)n_kv * (size_t)hd, vs = rekv_kv_v_shift(n_kv, hd);
    for (int i = threadIdx.x; i < n_kv * hd; i += blockDim.x) {
        int g = i / hd, j = i % hd;
        size_t dst = rekv_kv_row(n_kv, hd, g, p) + (size_t)j;
        store_from_f32(kv, dst, k[src0 + i], dtype);
        store_from_f32(kv, dst + vs, v[src0 + i], dtype);
    }
}

static void k_kv_scatter(rekv_stream *s, const float *k, const float *v, int rows,
                         const int32_t *row_seq, const int32_t *row_pos, const rekv_attn_seq *seqs,
                         int n_kv, int head_dim, rekv_dtype dt)
{
    if (rows <= 0 || n_kv <= 0 || head_dim <= 0)
        return;
    KLAUNCH(s, "kv_scatter", scatter_kernel, rows, ROW_THREADS, 0, k, v, row_seq, row_pos, seqs,
            n_kv, head_dim, (int)dt);
}

/* Attention is a block per (head h, sequence y, z). Per query row, warp w takes context
 * positions w, w + ATT_WARPS, ... of the block's range; a position's score is a warp dot product;
 * each warp keeps a running max, sum and output (lane-strided over head_dim), and the block then
 * merges its warps' partial softmaxes (attn_merge). Plain (attention_kernel): z is a slice of the
 * rows — rows z, z + ATT_ROW_SLICES, ... — each over its whole context. Split, flash-decoding
 * style (attention_split_kernel, for decode batches too small to fill the device): every sequence
 * has one row and z is a chunk of its context; each block writes its unnormalised partial
 * (max, sum, output) and attention_combine_kernel merges the chunks. Shared: q [hd],
 * acc [ATT_WARPS][hd], m and l [ATT_WARPS] each. */

/* The warp's pass over positions t0 + warp, t0 + warp + ATT_WARPS, ... < t1 of kv head kvh. */
template <int DT>
__device__ static void attn_warp_pass(const float *qs, const void *kv, int n_kv, int hd, int kvh,
                                      int t0, int t1, float scale, float &m, float &l, float *acc)
{
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    size_t vs = rekv_kv_v_shift(n_kv, hd);
    m = -INFINITY;
    l = 0;
#pragma unroll
    for (int c = 0; c < ATT_MAX_PER_LANE; c++)
        acc[c] = 0;
    for (int t = t0 + warp; t < t1; t += ATT_WARPS) {
        size_t row = rekv_kv_row(n_kv, hd, kvh, t);
        float d = 0;
        for (int j = lane; j < hd; j += 32)
            d += qs[j] * load_as_f32(kv, row + j, DT);
        for (int o = 16; o > 0; o >>= 1)
            d += __shfl_xor_sync(0xffffffffu, d, o);
        d *= scale;
        float m_new = fmaxf(m, d);
        float corr = expf(m - m_new), p = expf(d - m_new);
        l = l * corr + p;
#pragma unroll
        for (int c = 0; c < ATT_MAX_PER_LANE; c++) {
            int j = c * 32 + lane;
            if (j < hd)
                acc[c] = acc[c] * corr + p * load_as_f32(kv, vs + row + j, DT);
        }
        m = m_new;
    }
}

/* Merges the block's warps (warp 0 saw position t0, so the max is finite; a warp that saw nothing
 * has m = -inf and weighs exp(-inf) = 0): o[j] = the merged output, divided by the merged sum
 * when normalise, else left with *mx and *sum for a later merge. */
__device__ static void attn_merge(float *accs, float *ms, float *ls, int hd, float m, float l,
                                  const float *acc, float *o, int normalise, float *mx_out,
                                  float *sum_out)
{
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < ATT_MAX_PER_LANE; c++) {
        int j = c * 32 + lane;
        if (j < hd)
            accs[warp * hd + j] = acc[c];
    }
    if (lane == 0) {
        ms[warp] = m;
        ls[warp] = l;
    }
    __syncthreads();
    float mx = ms[0];
    for (int w = 1; w < ATT_WARPS; w++)
        mx = fmaxf(mx, ms[w]);
    float sum = 0, wt[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; w++) {
        wt[w] = expf(ms[w] - mx);
        sum += ls[w] * wt[w];
    }
    float inv = normalise ? 1.0f / sum : 1.0f;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        float v = 0;
        for (int w = 0; w < ATT_WARPS; w++)
            v += accs[w * hd + j] * wt[w];
        o[j] = v * inv;
    }
    *mx_out = mx;
    *sum_out = sum;
}

template <int DT>
__global__ static void __launch_bounds__(ATT_WARPS * 32)
    attention_kernel(float *out, const float *q, const rekv_attn_seq *seqs, int n_heads, int n_kv,
                     int hd, float scale)
{
    extern __shared__ float sh[];
    float *qs = sh, *accs = sh + hd, *ms = accs + ATT_WARPS * hd, *ls = ms + ATT_WARPS;
    __shared__ rekv_attn_seq sq;
    if (threadIdx.x == 0)
        sq = seqs[blockIdx.y]; /* mapped host memory: read once per block */
    __syncthreads();
    int h = blockIdx.x, kvh = h / (n_heads / n_kv);
    size_t qd = (size_t)n_heads * (size_t)hd;
    for (int i = blockIdx.z; i < sq.n; i += gridDim.z) {
        size_t r = (size_t)sq.row0 + (size_t)i;
        const float *qh = q + r * qd + (size_t)h * hd;
        __syncthreads(); /* the previous row's merge has read the shared arrays */
        for (int j = threadIdx.x; j < hd; j += blockDim.x)
            qs[j] = qh[j];
        __syncthreads();
        float m, l, acc[ATT_MAX_PER_LANE], mx, sum;
        attn_warp_pass<DT>(qs, sq.kv, n_kv, hd, kvh, 0, sq.start + i + 1, scale, m, l, acc);
        attn_merge(accs, ms, ls, hd, m, l, acc, out + r * qd + (size_t)h * hd, 1, &mx, &sum);
    }
}

/* A partial of (row r, head h, chunk z): max, sum, then hd outputs. */
__device__ __forceinline__ static float *attn_partial(float *part, size_t r, int h, int z,
                                                      int n_heads, int splits, int hd)
{
    return part + ((r * (size_t)n_heads + (size_t)h) * (size_t)splits + (size_t)z) * (hd + 2);
}

template <int DT>
__global__ static void __launch_bounds__(ATT_WARPS * 32)
    attention_split_kernel(float *part, const float *q, const rekv_attn_seq *seqs, int n_heads,
                           int n_kv, int hd, float scale)
{
    extern __shared__ float sh[];
    float *qs = sh, *accs = sh + hd, *ms = accs + ATT_WARPS * hd, *ls = ms + ATT_WARPS;
    __shared__ rekv_attn_seq sq;
    if (threadIdx.x == 0)
        sq = seqs[blockIdx.y];
    __syncthreads();
    int h = blockIdx.x, kvh = h / (n_heads / n_kv), z = blockIdx.z, splits = gridDim.z;
    int n_ctx = sq.start + 1; /* the sequence's one row */
    int chunk = (n_ctx + splits - 1) / splits;
    if (chunk < ATT_MIN_CHUNK)
        chunk = ATT_MIN_CHUNK;
    int t0 = z * chunk, t1 = min(n_ctx, t0 + chunk);
    size_t r = (size_t)sq.row0;
    float *pp = attn_partial(part, r, h, z, n_heads, splits, hd);
    if (t0 >= t1) { /* past the context: an empty partial */
        for (int j = threadIdx.x; j < hd; j += blockDim.x)
            pp[2 + j] = 0;
        if (threadIdx.x == 0) {
            pp[0] = -INFINITY;
            pp[1] = 0;
        }
        return;
    }
    const float *qh = q + r * (size_t)n_heads * hd + (size_t)h * hd;
    for (int j = threadIdx.x; j < hd; j += blockDim.x)
        qs[j] = qh[j];
    __syncthreads();
    float m, l, acc[ATT_MAX_PER_LANE], mx, sum;
    attn_warp_pass<DT>(qs, sq.kv, n_kv, hd, kvh, t0, t1, scale, m, l, acc);
    attn_merge(accs, ms, ls, hd, m, l, acc, pp + 2, 0, &mx, &sum);
    if (threadIdx.x == 0) {
        pp[0] = mx;
        pp[1] = sum;
    }
}

/* Block (row r, head h): merges the chunks' partials (chunk 0 is never empty: a finite max). */
__global__ static void attention_combine_kernel(float *out, const float *part, int n_heads,
                                                int splits, int hd)
{
    size_t r = blockIdx.x;
    int h = blockIdx.y;
    const float *p0 = attn_partial((float *)part, r, h, 0, n_heads, splits, hd);
    size_t stride = (size_t)hd + 2;
    float mx = p0[0];
    for (int z = 1; z < splits; z++)
        mx = fmaxf(mx, p0[z * stride]);
    float sum = 0;
    for (int z = 0; z < splits; z++)
        sum += p0[z * stride + 1] * expf(p0[z * stride] - mx);
    float inv = 1.0f / sum;
    float *o = out + (r * (size_t)n_heads + (size_t)h) * hd;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        float v = 0;
        for (int z = 0; z < splits; z++)
            v += p0[z * stride + 2 + j] * expf(p0[z * stride] - mx);
        o[j] = v * inv;
    }
}

#define ATT_LAUNCH(s, dt, kernel, grid, shmem, ...)                                                \
    do {                                                                                           \
        if ((dt) == REKV_DTYPE_F16)                                                                \
            KLAUNCH(s, "attention", kernel<REKV_DTYPE_F16>, grid, ATT_WARPS * 32, shmem,           \
                    __VA_ARGS__);                                                                  \
        else if ((dt) == REKV_DTYPE_BF16)                                                          \
            KLAUNCH(s, "attention", kernel<REKV_DTYPE_BF16>, grid, ATT_WARPS * 32, shmem,          \
                    __VA_ARGS__);                                                                  \
        else                                                                                       \
            KLAUNCH(s, "attention", kernel<REKV_DTYPE_F32>, grid, ATT_WARPS * 32, shmem,           \
                    __VA_ARGS__);                                                                  \
    } while (0)

static void k_attention(rekv_stream *s, float *out, const float *q, const rekv_attn_seq *seqs,
                        int n_seqs, int rows, int n_heads, int n_kv, int head_dim, float *scores,
                        rekv_dtype dt)
{
    (void)scores;
    if (n_seqs <= 0 || n_heads <= 0)
        return;
    if (head_dim <= 0 || head_dim > 32 * ATT_MAX_PER_LANE || n_kv <= 0 || n_heads % n_kv != 0) {
        stream_fail(s, -EINVAL,
                    "cuda stream %s: attention with head_dim %d (1..%d), %d heads, "
                    "%d kv heads",
                    s->name, head_dim, 32 * ATT_MAX_PER_LANE, n_heads, n_kv);
        return;
    }
    if (n_seqs > 65535) {
        stream_fail(s, -EINVAL, "cuda stream %s: attention over %d sequences (at most 65535)",
                    s->name, n_seqs);
        return;
    }
    size_t shmem = sizeof(float) * ((size_t)head_dim * (1 + ATT_WARPS) + 2 * ATT_WARPS);
    float scale = 1.0f / sqrtf((float)head_dim);
    /* a decode batch (one row per sequence) of fewer blocks than fill the device twice: split
     * each context into chunks (at least ATT_MIN_CHUNK positions each, decided per sequence) */
    int blocks = n_heads * n_seqs, fill = 2 * s->be->sms;
    if (rows == n_seqs && blocks < fill) {
        int splits = (fill + blocks - 1) / blocks;
        if (splits > ATT_MAX_SPLITS)
            splits = ATT_MAX_SPLITS;
        size_t bytes = sizeof(float) * (size_t)rows * (size_t)n_heads * (size_t)splits *
                       ((size_t)head_dim + 2);
        float *part = NULL;
        use_device(s->be);
        if (stream_check(s, cudaMallocAsync((void **)&part, bytes, s->cs), "attention scratch"))
            return;
        dim3 grid((unsigned)n_heads, (unsigned)n_seqs, (unsigned)splits);
        ATT_LAUNCH(s, dt, attention_split_kernel, grid, shmem, part, q, seqs, n_heads, n_kv,
                   head_dim, scale);
        KLAUNCH(s, "attention", attention_combine_kernel, dim3((unsigned)rows, (unsigned)n_heads),
                128, 0, out, part, n_heads, splits, head_dim);
        stream_check(s, cudaFreeAsync(part, s->cs), "attention scratch");
        return;
    }
    dim3 grid((unsigned)n_heads, (unsigned)n_seqs, ATT_ROW_SLICES);
    ATT_LAUNCH(s, dt, attention_kernel, grid, shmem, out, q, seqs, n_heads, n_kv, head_dim, scale);
}

/* One block per piece (the piece read once, through shared memory), threads over its elements. */
__global__ static void convert_kernel(const rekv_convert_piece *pieces, int dtype)
{
    __shared__ rekv_convert_piece pc;
    if (threadIdx.x == 0)
        pc = pieces[blockIdx.x];
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < pc.n; i += blockDim.x)
        pc.dst[i] = load_as_f32(pc.src, i, dtype);
}

static void k_convert(rekv_stream *s, const rekv_convert_piece *pieces, size_t n, rekv_dtype dtype)
{
    if (n == 0)
        return;
    /* grid.x may be up to 2^31 - 1; launch in chunks anyway so that the index stays an int */
    for (size_t off = 0; off < n; off += 1u << 30) {
        size_t c = n - off < (1u << 30) ? n - off : (1u << 30);
        KLAUNCH(s, "merge", convert_kernel, (unsigned)c, ROW_THREADS, 0, pieces + off, (int)dtype);
    }
}

static void k_convert_out(rekv_stream *s, void *dst, const float *src, size_t n, rekv_dtype dtype)
{
    if (n == 0)
        return;
    KLAUNCH(s, "convert_out", convert_out_kernel, ew_blocks(n), EW_THREADS, 0, dst, src, n,
            (int)dtype);
}

/* dst and src must not overlap (the cpu backend's memmove allows it; nothing relies on it). */
__global__ static void gather_kernel(float *dst, const float *src, const int32_t *idx, int w)
{
    __shared__ int r;
    if (threadIdx.x == 0)
        r = idx[blockIdx.x];
    __syncthreads();
    const float *sr = src + (size_t)r * w;
    float *dr = dst + (size_t)blockIdx.x * w;
    for (int j = threadIdx.x; j < w; j += blockDim.x)
        dr[j] = sr[j];
}

static void k_gather_rows(rekv_stream *s, float *dst, const float *src, const int32_t *idx, int n,
                          int w)
{
    if (n <= 0 || w <= 0)
        return;
    KLAUNCH(s, "gather_rows", gather_kernel, n, ROW_THREADS, 0, dst, src, idx, w);
}

/* ------------------------------------------------------------------ tables and creation */

static const rekv_kernel_iface cuda_kernels = {
    k_linear,      /* linear */
    k_norm,        /* norm */
    k_rope,        /* rope */
    k_activation,  /* activation */
    k_add,         /* add */
    k_embed,       /* embed */
    k_kv_scatter,  /* kv_scatter */
    k_attention,   /* attention */
    k_convert,     /* convert */
    k_convert_out, /* convert_out */
    k_gather_rows, /* gather_rows */
};

/* Page-locks the kvstore arena (or any host range) so that copies from it are DMA and async. */
static int cu_host_register(rekv_backend *be, void *p, size_t bytes, rekv_err *err)
{
    (void)be;
    /* mapped too, so that a flag in it can be waited on (cudaHostGetDevicePointer) */
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return rekv_errf(err, -EIO, "cuda backend: cudaHostRegister of %zu bytes: %s", bytes,
                         cudaGetErrorString(e));
    }
    return 0;
}

static void cu_host_unregister(rekv_backend *be, void *p)
{
    (void)be;
    if (cudaHostUnregister(p) != cudaSuccess)
        cudaGetLastError();
}

static int cu_mem_info(rekv_backend *base, size_t *free_bytes, size_t *total_bytes, rekv_err *err)
{
    use_device(backend_of(base));
    size_t f = 0, t = 0;
    cudaError_t e = cudaMemGetInfo(&f, &t);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return rekv_errf(err, -EIO, "cuda backend: cudaMemGetInfo: %s", cudaGetErrorString(e));
    }
    *free_bytes = f;
    *total_bytes = t;
    return 0;
}

static const rekv_backend_iface cuda_iface = {
    "cuda",                 /* name */
    cu_destroy,             /* destroy */
    cu_dev_alloc,           /* dev_alloc */
    cu_dev_free,            /* dev_free */
    cu_host_alloc,          /* host_alloc */
    cu_host_free,           /* host_free */
    cu_stream_create,       /* stream_create */
    cu_stream_destroy,      /* stream_destroy */
    cu_stream_sync,         /* stream_sync */
    cu_event_create,        /* event_create */
    cu_event_destroy,       /* event_destroy */
    cu_event_record,        /* event_record */
    cu_stream_wait_event,   /* stream_wait_event */
    cu_event_sync,          /* event_sync */
    cu_copy_h2d,            /* copy_h2d */
    cu_copy_d2h,            /* copy_d2h */
    cu_copy_d2d,            /* copy_d2d */
    cu_launch_host,         /* launch_host */
    cu_stats,               /* stats */
    cu_stats_reset,         /* stats_reset */
    cu_trace_start,         /* trace_start */
    cu_trace_write,         /* trace_write */
    cu_host_register,       /* host_register */
    cu_host_unregister,     /* host_unregister */
    cu_dev_alloc_shared,    /* dev_alloc_shared */
    cu_dev_import,          /* dev_import */
    cu_dev_unimport,        /* dev_unimport */
    cu_event_create_shared, /* event_create_shared */
    cu_event_export,        /* event_export */
    cu_event_import,        /* event_import */
    cu_stream_wait_flag,    /* stream_wait_flag */
    cu_stream_write_flag,   /* stream_write_flag */
    cu_mem_info,            /* mem_info */
};

extern "C" int rekv_backend_cuda_create(int device, rekv_backend **out, rekv_err *err)
{
    int count = 0;
    cudaError_t e;
    *out = NULL;
    if ((e = cudaGetDeviceCount(&count)) != cudaSuccess) {
        cudaGetLastError();
        return rekv_errf(err, -ENODEV, "cuda backend: no CUDA device (cudaGetDeviceCount: %s)",
                         cudaGetErrorString(e));
    }
    if (count == 0)
        return rekv_errf(err, -ENODEV, "cuda backend: no CUDA device");
    if (device < 0 || device >= count)
        return rekv_errf(err, -ENODEV, "cuda backend: no CUDA device %d (this machine has %d)",
                         device, count);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return rekv_errf(err, -EIO, "cuda backend: cannot use device %d: %s", device,
                         cudaGetErrorString(e));
    cuda_backend *be = (cuda_backend *)calloc(1, sizeof(*be));
    if (be == NULL)
        return rekv_errf(err, -ENOMEM, "cuda backend: out of memory");
    if ((e = cudaStreamCreateWithFlags(&be->trace_stream, cudaStreamNonBlocking)) != cudaSuccess) {
        free(be);
        return rekv_errf(err, -EIO, "cuda backend: cannot create a stream on device %d: %s", device,
                         cudaGetErrorString(e));
    }
    be->base.iface = &cuda_iface;
    be->base.kernels = &cuda_kernels;
    be->base.ctx = be;
    be->device = device;
    if (cudaDeviceGetAttribute(&be->sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        be->sms <= 0)
        be->sms = 1;
    /* the split attention's scratch comes from the stream-ordered pool: keep what it frees
     * instead of returning it at every synchronisation (best effort) */
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
        uint64_t keep = UINT64_MAX;
        (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    }
    (void)cudaGetLastError();
    be->wait_value32 = (cu_value32_fn)driver_entry("cuStreamWaitValue32");
    be->write_value32 = (cu_value32_fn)driver_entry("cuStreamWriteValue32");
    be->wait_flags = CU_STREAM_WAIT_VALUE_GEQ;
    int flush = 0;
    if (cudaDeviceGetAttribute(&flush, cudaDevAttrCanFlushRemoteWrites, device) == cudaSuccess &&
        flush)
        be->wait_flags |= CU_STREAM_WAIT_VALUE_FLUSH; /* writes from a peer device land first */
    cudaGetLastError();
    pthread_mutex_init(&be->mu, NULL);
    *out = &be->base;
    return 0;
}
