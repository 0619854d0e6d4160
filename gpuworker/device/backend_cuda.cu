/* backend_cuda.cu — the cuda backend's runtime (backend.h) on an NVIDIA GPU; its kernels are the
 * engine's (gpuworker/kernels_cuda.cu), which share this file's structures (cuda_internal.h).
 *
 * Runtime: device memory from cudaMalloc; host memory for per-step metadata from cudaHostAlloc
 * (pinned, mapped and portable), which kernels read through its host pointer (UVA); every
 * rekv_stream is a non-blocking CUDA stream; events are cudaEvent_t without timing. Nothing runs
 * on the default stream, and every launch is checked with cudaGetLastError.
 *
 * Errors: an enqueue that fails (a bad argument, a failed launch, a cuBLAS error) is kept by its
 * stream, first failure wins, and returned by the next stream_sync, with any error the CUDA
 * runtime reports there, as -EIO and the CUDA error's name and string — the same contract as the
 * cpu backend; a sticky error (cuda_error_is_sticky: the context is corrupt) as -ENODEV, device
 * lost (backend.h), which the runtime then reports for every later call anyway.
 *
 * Copies: a call's pieces are coalesced into as few DMA operations as they allow; many small rows
 * from mapped host memory go as one gather kernel instead, and listed copies always do
 * (backend_cuda_gather.cu).
 *
 * Stats and trace: byte and copy counters are exact and counted at enqueue. Busy times are
 * measured on the GPU while timing is on or a trace records (off otherwise: it costs two event
 * records per op on the host): every copy and kernel is then bracketed by a pair of timing events
 * (from a pool), resolved when its stream is synchronised; compute_busy_s sums kernel durations,
 * h2d and d2h busy sum copy durations (device-to-device copies are traced, not counted, as on cpu).
 * So busy times cover work up to each stream's last stream_sync. The trace is the same measurement:
 * one span per copy or kernel, on a track per stream, in GPU time relative to an event recorded at
 * trace_start; work enqueued before trace_start is not in it.
 *
 * Sharing with other processes (shared buffers, shared events) and flag waits are in
 * backend_cuda_ipc.cu; what the three files share is in backend_cuda_internal.h. */
#include "gpuworker/device/backend_cuda_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Trace spans kept at most; later ones are counted as dropped. */
#define CU_TRACE_MAX_SPANS (1u << 20)

/* Under the backend's lock: a host function may fail its stream from CUDA's callback thread
 * while the step thread may be failing the same stream at enqueue; the first one stays,
 * unless a later one is the device's loss (-ENODEV), which replaces it: what a caller must do
 * then (end the process) matters more than the first symptom (often a cuBLAS failure). */
void cuda_stream_fail(rekv_stream *s, int code, const char *fmt, ...)
{
    pthread_mutex_lock(&s->be->mu);
    if (s->err_code == 0 || (code == -ENODEV && s->err_code != -ENODEV)) {
        s->err_code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->err_msg, sizeof(s->err_msg), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&s->be->mu);
}

int cuda_error_is_sticky(cudaError_t e)
{
    /* the errors CUDA documents as "the process is left in an inconsistent state ... the process
     * must be terminated and relaunched" (driver_types.h, CUDA 13.0); the newer ones by number,
     * so that an older toolkit's header compiles too */
    switch ((int)e) {
    case cudaErrorECCUncorrectable:
    case 226: /* cudaErrorContained */
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case 721: /* cudaErrorTensorMemoryLeak */
    case 810: /* cudaErrorMpsClientTerminated */
    case 911: /* cudaErrorExternalDevice */
        return 1;
    default:
        return 0;
    }
}

int cuda_stream_check(rekv_stream *s, cudaError_t e, const char *what)
{
    cuda_enq_count(s);
    if (e == cudaSuccess)
        return 0;
    cudaGetLastError(); /* kept by the stream: not left for another stream's launch check */
    if (cuda_error_is_sticky(e))
        cuda_stream_fail(s, -ENODEV, "cuda stream %s: %s: %s (%s): device lost", s->name, what,
                         cudaGetErrorName(e), cudaGetErrorString(e));
    else
        cuda_stream_fail(s, -EIO, "cuda stream %s: %s: %s (%s)", s->name, what, cudaGetErrorName(e),
                         cudaGetErrorString(e));
    return 1;
}

void cuda_launch_check(rekv_stream *s, const char *kernel)
{
    cuda_stream_check(s, cudaGetLastError(), kernel);
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

long cuda_op_begin(rekv_stream *s, int what, const char *label)
{
    cuda_backend *be = s->be;
    pthread_mutex_lock(&be->mu);
    int traced = be->tracing, timed = be->timing || traced;
    pthread_mutex_unlock(&be->mu);
    if (!timed || s->capturing)
        return -1;
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
    p->traced = traced;
    snprintf(p->label, sizeof(p->label), "%s", label);
    return (long)s->n_pend++;
}

void cuda_op_end(rekv_stream *s, long i)
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
    cuda_backend *be = cuda_backend_of(base);
    void *p = NULL;
    cuda_use_device(be);
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
    cuda_use_device(cuda_backend_of(base));
    /* implicitly waits for the device: callers free only idle buffers anyway; a failure (a bad
     * pointer) is not left for another stream's launch check to find */
    if (cudaFree(p) != cudaSuccess)
        cudaGetLastError();
}

static void *cu_host_alloc(rekv_backend *base, size_t bytes)
{
    void *p = NULL;
    cuda_use_device(cuda_backend_of(base));
    if (cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cu_host_free(rekv_backend *base, void *p)
{
    if (p != NULL && cudaFreeHost(p) != cudaSuccess)
        cudaGetLastError(); /* as dev_free */
}

/* ------------------------------------------------------------------ streams and events */

static int cu_stream_create(rekv_backend *base, const char *name, rekv_stream **out, rekv_err *err)
{
    cuda_backend *be = cuda_backend_of(base);
    const char *nm0 = name ? name : "stream";
    rekv_stream *s = NULL;
    char *nm = NULL;
    cudaError_t ce;
    int rc = 0;

    *out = NULL;
    cuda_use_device(be);
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

    pthread_mutex_lock(&be->mu);
    if (be->n_streams == be->cap_streams) {
        size_t cap = be->cap_streams ? be->cap_streams * 2 : 16;
        char **nn = (char **)realloc(be->stream_names, cap * sizeof(*nn));
        if (nn == NULL) {
            pthread_mutex_unlock(&be->mu);
            rc = rekv_errf(err, -ENOMEM, "cuda backend: out of memory creating stream %s", nm0);
            goto out_stream;
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

out_stream:
    cudaStreamDestroy(s->cs);
out_free:
    free(nm);
    free(s);
    return rc;
}

/* A call that blocks its caller on device work (stats.host_syncs). */
void cuda_count_host_sync(cuda_backend *be)
{
    pthread_mutex_lock(&be->mu);
    be->stats.host_syncs++;
    pthread_mutex_unlock(&be->mu);
}

/* stream_sync's wait and report, not counted */
static int stream_drain(rekv_stream *s, rekv_err *err)
{
    cuda_use_device(s->be);
    /* a wait on a dead process's record never completes: cudaStreamSynchronize would block for
     * ever, so such a stream is polled first and, blocked for good, never waited on again */
    if (s->peer_died || cuda_stream_live_wait(s) < 0) {
        int rc = rekv_errf(err, -EPIPE, "%s", s->peer_msg);
        s->err_code = 0;
        s->err_msg[0] = '\0';
        return rc;
    }
    cudaError_t e = cudaStreamSynchronize(s->cs);
    if (e == cudaSuccess)
        e = cudaGetLastError();
    cuda_stream_check(s, e, "synchronize");
    cuda_stream_waits_clear(s);
    if (e == cudaSuccess)
        s->gather.n_busy = 0; /* every gather has finished */
    cuda_listed_resolve(s, e == cudaSuccess && s->err_code == 0);
    stream_resolve(s); /* ops whose events cannot be read (after a fault) are dropped */
    int rc = 0;
    if (s->err_code != 0) {
        rc = rekv_errf(err, s->err_code, "%s", s->err_msg);
        s->err_code = 0;
        s->err_msg[0] = '\0';
    }
    return rc;
}

static int cu_stream_sync(rekv_stream *s, rekv_err *err)
{
    cuda_count_host_sync(s->be);
    return stream_drain(s, err);
}

static int cu_streams_sync(rekv_stream *const *s, int n, rekv_err *err)
{
    int rc = 0;
    if (n > 0)
        cuda_count_host_sync(s[0]->be);
    for (int i = 0; i < n; i++) {
        int r = stream_drain(s[i], rc ? NULL : err);
        rc = rc ? rc : r;
    }
    return rc;
}

/* ------------------------------------------------------------------ graphs */

struct rekv_graph {
    cuda_backend *be;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    rekv_backend_stats counts; /* its copies' counters, added at each launch */
};

static int cu_graph_begin(rekv_stream *s, rekv_err *err)
{
    if (s->capturing)
        return rekv_errf(err, -EBUSY, "cuda stream %s: already capturing a graph", s->name);
    cuda_use_device(s->be);
    cudaError_t e = cudaStreamBeginCapture(s->cs, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return rekv_errf(err, -EIO, "cuda stream %s: capture: %s", s->name, cudaGetErrorString(e));
    }
    s->capturing = 1;
    cuda_enq_count(s); /* nothing tagged before the capture is the graph's */
    memset(&s->captured, 0, sizeof(s->captured));
    /* a failure pending from before: kept aside, so that the capture's own are told apart */
    s->pre_capture_code = s->err_code;
    memcpy(s->pre_capture_msg, s->err_msg, sizeof(s->err_msg));
    s->err_code = 0;
    s->err_msg[0] = 0;
    return 0;
}

static void cu_graph_destroy(rekv_graph *g)
{
    if (g == NULL)
        return;
    cuda_use_device(g->be);
    if (g->exec != NULL)
        cudaGraphExecDestroy(g->exec);
    if (g->graph != NULL)
        cudaGraphDestroy(g->graph);
    free(g);
}

/* A capture that failed leaves nothing to run: the stream's failures since graph_begin were the
 * capture's (nothing was enqueued to run), so they are cleared with it. */
static int cu_graph_end(rekv_stream *s, rekv_graph **out, rekv_err *err)
{
    *out = NULL;
    if (!s->capturing)
        return rekv_errf(err, -EINVAL, "cuda stream %s: graph_end without graph_begin", s->name);
    cuda_use_device(s->be);
    rekv_graph *g = (rekv_graph *)calloc(1, sizeof(*g));
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(s->cs, &graph);
    s->capturing = 0;
    cuda_enq_count(s);
    int failed = s->err_code;
    char why[512];
    snprintf(why, sizeof(why), "%s", failed ? s->err_msg : "");
    s->err_code = s->pre_capture_code; /* the capture's failures go; an earlier one stays */
    memcpy(s->err_msg, s->pre_capture_msg, sizeof(s->err_msg));
    if (e == cudaSuccess && !failed && g != NULL)
        e = cudaGraphInstantiate(&g->exec, graph, 0);
    if (e != cudaSuccess || failed || g == NULL) {
        cudaGetLastError();
        if (graph != NULL)
            cudaGraphDestroy(graph);
        free(g);
        return rekv_errf(err, g == NULL ? -ENOMEM : -EIO, "cuda stream %s: graph: %s", s->name,
                         failed ? why : cudaGetErrorString(e));
    }
    g->be = s->be;
    g->graph = graph;
    g->counts = s->captured;
    *out = g;
    return 0;
}

static void cu_graph_launch(rekv_stream *s, rekv_graph *g)
{
    cuda_backend *be = s->be;
    cuda_use_device(be);
    pthread_mutex_lock(&be->mu);
    for (int k = 0; k < REKV_XFER_KINDS; k++) {
        be->stats.h2d_bytes[k] += g->counts.h2d_bytes[k];
        be->stats.d2h_bytes[k] += g->counts.d2h_bytes[k];
    }
    be->stats.h2d_copies += g->counts.h2d_copies;
    be->stats.d2h_copies += g->counts.d2h_copies;
    pthread_mutex_unlock(&be->mu);
    long op = cuda_op_begin(s, CU_OP_COMPUTE, "graph");
    cuda_stream_check(s, cudaGraphLaunch(g->exec, s->cs), "graph launch");
    cuda_op_end(s, op);
}

static void cu_stream_destroy(rekv_stream *s)
{
    if (s == NULL)
        return;
    if (s->capturing) {
        rekv_graph *g = NULL;
        cu_graph_end(s, &g, NULL);
        cu_graph_destroy(g);
    }
    cu_stream_sync(s, NULL);
    cuda_backend *be = s->be;
    pthread_mutex_lock(&be->mu);
    for (size_t i = 0; i < s->n_pend; i++) { /* left when the sync failed */
        pool_put_locked(be, s->pend[i].a);
        pool_put_locked(be, s->pend[i].b);
    }
    pthread_mutex_unlock(&be->mu);
    free(s->pend);
    free(s->listed);
    cuda_stream_waits_clear(s);
    if (s->peer_died) {
        /* blocked for good on a dead process's record: what its enqueued work would read is left
         * allocated (a leak per dead peer), never freed under it */
        cudaStreamDestroy(s->cs);
        free(s);
        return;
    }
    if (s->gather.host != NULL) { /* idle: synchronised above */
        for (int i = 0; i < CU_GATHER_INFLIGHT; i++)
            cudaEventDestroy(s->gather.busy[i].ev);
        cudaFreeHost(s->gather.host);
    }
    if (s->kstate_free != NULL)
        s->kstate_free(s->kstate); /* the stream is idle: synchronised above */
    cudaStreamDestroy(s->cs);
    free(s); /* the name belongs to the backend */
}

static int cu_event_create(rekv_backend *base, rekv_event **out, rekv_err *err)
{
    cuda_backend *be = cuda_backend_of(base);
    *out = NULL;
    cuda_use_device(be);
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
    ev->page_fd = -1;
    ev->refs = 1;
    *out = ev;
    return 0;
}

void cuda_event_unref(rekv_event *ev)
{
    pthread_mutex_lock(&ev->be->mu);
    int last = --ev->refs == 0;
    pthread_mutex_unlock(&ev->be->mu);
    if (!last)
        return;
    /* CUDA keeps an event alive until enqueued work that uses it has run */
    if (cudaEventDestroy(ev->ev) != cudaSuccess)
        cudaGetLastError(); /* as dev_free */
    if (ev->page != NULL)
        munmap(ev->page, CU_EV_PAGE_BYTES);
    if (ev->page_fd >= 0)
        close(ev->page_fd);
    free(ev);
}

static void cu_event_destroy(rekv_event *ev)
{
    if (ev != NULL)
        cuda_event_unref(ev); /* a stream's pending wait may still poll it */
}

/* Only kernels and copies may be captured (backend.h): anything else enqueued during a capture
 * fails it (and does not run). 1 when s is capturing. */
int cuda_refused_in_capture(rekv_stream *s, const char *what)
{
    if (!s->capturing)
        return 0;
    cuda_stream_fail(s, -ENOTSUP, "cuda stream %s: %s during a graph capture", s->name, what);
    return 1;
}

static void cu_event_record(rekv_event *ev, rekv_stream *s)
{
    if (cuda_refused_in_capture(s, "an event record"))
        return;
    cuda_use_device(s->be);
    cuda_event_note_record(ev);
    cuda_stream_check(s, cudaEventRecord(ev->ev, s->cs), "event record");
}

static void cu_stream_wait_event(rekv_stream *s, rekv_event *ev)
{
    if (cuda_refused_in_capture(s, "an event wait"))
        return;
    cuda_use_device(s->be);
    /* an event never recorded is complete, as on the cpu backend */
    if (!cuda_stream_check(s, cudaStreamWaitEvent(s->cs, ev->ev, 0), "wait for event"))
        cuda_stream_note_wait(s, ev);
}

static void cu_event_sync(rekv_event *ev)
{
    /* void by contract: a failure here is a device fault, which is sticky and surfaces at the
     * next stream_sync */
    cuda_count_host_sync(ev->be);
    cuda_use_device(ev->be);
    if (!cuda_event_live_sync(ev))
        cudaEventSynchronize(ev->ev);
}

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
        cuda_stream_fail(s, -EINVAL, "stream %s: %s", s->name, why);
        return;
    }
    cuda_backend *be = s->be;
    if (dir != CU_OP_D2D) { /* a capture's count when its graph is launched */
        pthread_mutex_lock(&be->mu);
        rekv_backend_stats *st = s->capturing ? &s->captured : &be->stats;
        if (dir == CU_OP_H2D) {
            st->h2d_bytes[kind] += bytes;
            st->h2d_copies++;
        } else {
            st->d2h_bytes[kind] += bytes;
            st->d2h_copies++;
        }
        pthread_mutex_unlock(&be->mu);
    }
    cuda_use_device(be);
    char label[64];
    rekv_copy_label(label, sizeof(label), dir_names[dir], kind, bytes);
    /* as few DMA operations as the pieces allow: each costs microseconds whatever its size */
    rekv_copy_run one[16], *runs = n <= 16 ? one : (rekv_copy_run *)malloc(n * sizeof(*runs));
    if (runs == NULL) {
        cuda_stream_fail(s, -ENOMEM, "stream %s: out of memory for a copy of %zu pieces", s->name,
                         n);
        return;
    }
    size_t nr = rekv_copy_coalesce(pieces, n, runs), rows = 0;
    long lo = -1;
    /* a gather's host work (its slice, its descriptors) before the op's start is recorded: its
     * span is the device's */
    int gathered =
        dir == CU_OP_H2D && !s->capturing && cuda_gather_prepare(s, runs, nr, bytes, &lo, &rows);
    long op = cuda_op_begin(s, dir, label);
    if (gathered) {
        if (lo >= 0)
            cuda_gather_launch(s, lo, rows);
        nr = 0;
    }
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
        if (cuda_stream_check(s, rc, dir_names[dir]))
            break;
    }
    cuda_op_end(s, op);
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
    if (cuda_refused_in_capture(s, "a host function"))
        return;
    if (fn == NULL) {
        cuda_stream_fail(s, -EINVAL, "stream %s: launch of host function %s with a NULL function",
                         s->name, nm);
        return;
    }
    if (arg_bytes > 0 && arg == NULL) {
        cuda_stream_fail(s, -EINVAL, "stream %s: host function %s: NULL argument of %zu bytes",
                         s->name, nm, arg_bytes);
        return;
    }
    host_call *c = (host_call *)malloc(sizeof(*c) + arg_bytes);
    if (c == NULL) {
        cuda_stream_fail(s, -ENOMEM, "stream %s: out of memory launching host function %s", s->name,
                         nm);
        return;
    }
    c->fn = fn;
    if (arg_bytes > 0) {
        memcpy(c->payload, arg, arg_bytes);
        c->arg = c->payload;
    } else {
        c->arg = (void *)arg;
    }
    cuda_use_device(s->be);
    long op = cuda_op_begin(s, CU_OP_WAIT, nm); /* the host's work: traced, not compute */
    if (cuda_stream_check(s, cudaLaunchHostFunc(s->cs, host_trampoline, c), nm))
        free(c);
    cuda_op_end(s, op);
}

/* ------------------------------------------------------------------ stats and trace */

static void cu_stats(rekv_backend *base, rekv_backend_stats *out)
{
    cuda_backend *be = cuda_backend_of(base);
    pthread_mutex_lock(&be->mu);
    *out = be->stats;
    pthread_mutex_unlock(&be->mu);
}

static void cu_stats_reset(rekv_backend *base)
{
    cuda_backend *be = cuda_backend_of(base);
    pthread_mutex_lock(&be->mu);
    memset(&be->stats, 0, sizeof(be->stats));
    pthread_mutex_unlock(&be->mu);
}

static void cu_timing(rekv_backend *base, bool on)
{
    cuda_backend *be = cuda_backend_of(base);
    pthread_mutex_lock(&be->mu);
    be->timing = on;
    pthread_mutex_unlock(&be->mu);
}

static void cu_trace_start(rekv_backend *base)
{
    cuda_backend *be = cuda_backend_of(base);
    cuda_use_device(be);
    pthread_mutex_lock(&be->mu);
    be->n_spans = 0;
    be->dropped_spans = 0;
    be->tracing = 0;
    if (be->trace_ref == NULL && cudaEventCreate(&be->trace_ref) != cudaSuccess)
        be->trace_ref = NULL;
    cudaEvent_t ref = be->trace_ref;
    pthread_mutex_unlock(&be->mu);
    /* the trace stream is idle: the reference completes at once, and waiting for it makes every
     * later span's offset from it readable; not under the lock, which a host function on a
     * stream the trace stream may queue behind could be waiting for */
    int ok = ref != NULL && cudaEventRecord(ref, be->trace_stream) == cudaSuccess &&
             cudaEventSynchronize(ref) == cudaSuccess;
    cudaGetLastError();
    pthread_mutex_lock(&be->mu);
    be->tracing = ok;
    pthread_mutex_unlock(&be->mu);
}

/* Spans of ops whose streams have not been synchronised since are not in the file yet. */
static int cu_trace_write(rekv_backend *base, const char *path, rekv_err *err)
{
    cuda_backend *be = cuda_backend_of(base);
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
    cuda_backend *be = cuda_backend_of(base);
    cuda_use_device(be);
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
    free(be->regs);
    pthread_mutex_destroy(&be->mu);
    free(be);
}

/* Page-locks the kvstore arena (or any host range) so that copies from it are DMA and async. */
static int cu_host_register(rekv_backend *base, void *p, size_t bytes, rekv_err *err)
{
    cuda_backend *be = cuda_backend_of(base);
    cuda_use_device(be);
    /* mapped too, so that a flag in it can be waited on (cudaHostGetDevicePointer) and the
     * gather kernel can read rows from it */
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    void *d = NULL;
    if (e == cudaSuccess && (e = cudaHostGetDevicePointer(&d, p, 0)) != cudaSuccess)
        cudaHostUnregister(p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return rekv_errf(err, -EIO, "cuda backend: cudaHostRegister of %zu bytes: %s", bytes,
                         cudaGetErrorString(e));
    }
    pthread_mutex_lock(&be->mu);
    if (be->n_regs == be->cap_regs) {
        size_t cap = be->cap_regs ? be->cap_regs * 2 : 4;
        cu_host_reg *nr = (cu_host_reg *)realloc(be->regs, cap * sizeof(*nr));
        if (nr == NULL) {
            pthread_mutex_unlock(&be->mu);
            cudaHostUnregister(p);
            return rekv_errf(err, -ENOMEM, "cuda backend: out of memory registering host memory");
        }
        be->regs = nr;
        be->cap_regs = cap;
    }
    be->regs[be->n_regs++] = (cu_host_reg){(const char *)p, (const char *)d, bytes};
    pthread_mutex_unlock(&be->mu);
    return 0;
}

static void cu_host_unregister(rekv_backend *base, void *p)
{
    cuda_backend *be = cuda_backend_of(base);
    pthread_mutex_lock(&be->mu);
    for (size_t i = 0; i < be->n_regs; i++)
        if (be->regs[i].host == (const char *)p) {
            be->regs[i] = be->regs[--be->n_regs];
            break;
        }
    pthread_mutex_unlock(&be->mu);
    cuda_use_device(be);
    if (cudaHostUnregister(p) != cudaSuccess)
        cudaGetLastError();
}

static int cu_mem_info(rekv_backend *base, size_t *free_bytes, size_t *total_bytes, rekv_err *err)
{
    cuda_use_device(cuda_backend_of(base));
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
    "cuda",                   /* name */
    cu_destroy,               /* destroy */
    cu_dev_alloc,             /* dev_alloc */
    cu_dev_free,              /* dev_free */
    cu_host_alloc,            /* host_alloc */
    cu_host_free,             /* host_free */
    cu_stream_create,         /* stream_create */
    cu_stream_destroy,        /* stream_destroy */
    cu_stream_sync,           /* stream_sync */
    cu_event_create,          /* event_create */
    cu_event_destroy,         /* event_destroy */
    cu_event_record,          /* event_record */
    cu_stream_wait_event,     /* stream_wait_event */
    cu_event_sync,            /* event_sync */
    cu_copy_h2d,              /* copy_h2d */
    cu_copy_d2h,              /* copy_d2h */
    cu_copy_d2d,              /* copy_d2d */
    cuda_copy_h2d_listed,     /* copy_h2d_listed */
    cu_launch_host,           /* launch_host */
    cu_stats,                 /* stats */
    cu_stats_reset,           /* stats_reset */
    cu_timing,                /* timing */
    cu_trace_start,           /* trace_start */
    cu_trace_write,           /* trace_write */
    cu_host_register,         /* host_register */
    cu_host_unregister,       /* host_unregister */
    cuda_dev_alloc_shared,    /* dev_alloc_shared */
    cuda_dev_import,          /* dev_import */
    cuda_dev_unimport,        /* dev_unimport */
    cuda_event_create_shared, /* event_create_shared */
    cuda_event_export,        /* event_export */
    cuda_event_import,        /* event_import */
    cuda_stream_wait_flag,    /* stream_wait_flag */
    cuda_stream_write_flag,   /* stream_write_flag */
    cu_mem_info,              /* mem_info */
    NULL,                     /* dev_adopt */
    NULL,                     /* dev_unadopt */
    cu_graph_begin,           /* graph_begin */
    cu_graph_end,             /* graph_end */
    cu_graph_launch,          /* graph_launch */
    cu_graph_destroy,         /* graph_destroy */
    cuda_host_mapped,         /* host_mapped */
    cu_streams_sync,          /* streams_sync */
};

int cuda_backend_create(int device, rekv_backend **out, rekv_err *err)
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
    cuda_flags_probe(be);
    pthread_mutex_init(&be->mu, NULL);
    *out = &be->base;
    return 0;
}
