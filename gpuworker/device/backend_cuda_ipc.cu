/* backend_cuda_ipc.cu — the cuda runtime's sharing with other processes and its flags in host
 * memory.
 *
 * Shared buffers are cudaMalloc'd and named by cudaIpcGetMemHandle, imported with
 * cudaIpcOpenMemHandle; shared events are created with cudaEventInterprocess and named by
 * cudaIpcGetEventHandle. Flag waits and writes are the driver's stream memory operations
 * (cuStreamWaitValue32 / cuStreamWriteValue32), looked up with cudaGetDriverEntryPoint* so that
 * the program does not link libcuda (it must start on machines without a driver); where they
 * are missing or refused, a one-thread kernel polls or stores the flag instead. A flag wait is
 * timed and traced like a copy ("wait flag >= N") but is not compute time.
 *
 * Liveness: a CUDA IPC event recorded by a process that dies before the recorded work completes
 * never completes, and a stream waiting on it would block its sync for ever (the kvstore's one
 * push stream would stall every worker). So each shared event has a page beside it (a memfd of
 * the exporter's, named in the handle) where every record writes its process; a stream keeps its
 * waits on other processes' records, and its sync polls them (cudaEventQuery) while the recorder
 * lives, failing -EPIPE once it has died with the record pending — as the cpu backend's wait
 * does. The device-side wait cannot be cancelled: that stream stays blocked, and says so. */
#include "gpuworker/device/backend_cuda_internal.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "gpuworker/device/ipc_memfd.h"

/* ---------------------------------------------------------------- sharing with other processes */

static_assert(sizeof(cudaIpcMemHandle_t) <= sizeof(((rekv_ipc_handle *)0)->payload),
              "cudaIpcMemHandle_t fits a handle's payload");
static_assert(sizeof(cudaIpcEventHandle_t) <= sizeof(((rekv_ipc_handle *)0)->payload),
              "cudaIpcEventHandle_t fits a handle's payload");

/* A cudaMalloc allocation of its own (IPC names whole allocations), named by its IPC handle. */
void *cuda_dev_alloc_shared(rekv_backend *base, size_t bytes, rekv_ipc_handle *out, rekv_err *err)
{
    cuda_backend *be = cuda_backend_of(base);
    cudaIpcMemHandle_t mh;
    void *p = NULL;
    cudaError_t e;

    cuda_use_device(be);
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

int cuda_dev_import(rekv_backend *base, const rekv_ipc_handle *h, void **dev, size_t *bytes,
                    rekv_err *err)
{
    cudaIpcMemHandle_t mh;
    cudaError_t e;
    int rc;

    *dev = NULL;
    if ((rc = rekv_ipc_handle_check(h, REKV_IPC_MEM, "cuda", "cuda backend: dev_import", err)) < 0)
        return rc;
    memcpy(&mh, h->payload, sizeof(mh));
    cuda_use_device(cuda_backend_of(base));
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

void cuda_dev_unimport(rekv_backend *base, void *dev)
{
    if (dev == NULL)
        return;
    cuda_use_device(cuda_backend_of(base));
    if (cudaIpcCloseMemHandle(dev) != cudaSuccess)
        cudaGetLastError();
}

int cuda_event_create_shared(rekv_backend *base, rekv_event **out, rekv_err *err)
{
    cuda_backend *be = cuda_backend_of(base);
    cudaIpcEventHandle_t eh;
    cudaError_t e;

    *out = NULL;
    cuda_use_device(be);
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
    rekv_ipc_memfd_ref ref = {(int32_t)getpid(), -1, rekv_ipc_nonce()};
    void *map = NULL;
    ref.fd = rekv_ipc_memfd_create("cuda", "rekv-cuev-", ref.nonce, CU_EV_PAGE_BYTES, &map, err);
    if (ref.fd < 0) {
        cudaEventDestroy(ev->ev);
        free(ev);
        return ref.fd;
    }
    ev->page = (cu_ev_page *)map; /* zero-filled: never recorded */
    ev->page->version = 1;
    ev->page->nonce = ref.nonce;
    __atomic_store_n(&ev->page->magic, CU_EV_PAGE_MAGIC, __ATOMIC_RELEASE);
    ev->page_fd = ref.fd;
    ev->be = be;
    ev->shared = 1;
    ev->refs = 1;
    rekv_ipc_handle_init(&ev->handle, REKV_IPC_EVENT, "cuda", 0);
    memcpy(ev->handle.payload, &eh, sizeof(eh));
    static_assert(sizeof(ref) <= sizeof(ev->handle.extra), "the page's place fits extra");
    memcpy(ev->handle.extra, &ref, sizeof(ref));
    *out = ev;
    return 0;
}

int cuda_event_export(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err)
{
    if (!ev->shared)
        return rekv_errf(err, -EINVAL,
                         "cuda backend: event_export: the event was made by "
                         "event_create; only event_create_shared's can be exported");
    *out = ev->handle;
    return 0;
}

/* Maps the page beside an imported event (the handle's extra names it). */
static int import_page(const rekv_ipc_handle *h, rekv_event *ev, rekv_err *err)
{
    rekv_ipc_memfd_ref ref;
    memcpy(&ref, h->extra, sizeof(ref));
    int fd = rekv_ipc_memfd_open("cuda", &ref, "rekv-cuev-", CU_EV_PAGE_BYTES, "event_import", err);
    if (fd < 0)
        return fd;
    void *map = mmap(NULL, CU_EV_PAGE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = map == MAP_FAILED ? errno : 0;
    close(fd); /* the mapping keeps the page */
    if (e != 0)
        return rekv_errf(err, -e, "cuda backend: event_import: cannot map the event's page: %s",
                         strerror(e));
    ev->page = (cu_ev_page *)map;
    if (__atomic_load_n(&ev->page->magic, __ATOMIC_ACQUIRE) != CU_EV_PAGE_MAGIC ||
        ev->page->nonce != ref.nonce) {
        munmap(map, CU_EV_PAGE_BYTES);
        ev->page = NULL;
        return rekv_errf(err, -ESTALE,
                         "cuda backend: event_import: stale handle: process %d's memory is not "
                         "the exported event's",
                         (int)ref.pid);
    }
    return 0;
}

/* The opened event behaves as one created with cudaEventDisableTiming: record, wait, sync and
 * destroy work on it as on any other. */
int cuda_event_import(rekv_backend *base, const rekv_ipc_handle *h, rekv_event **out, rekv_err *err)
{
    cuda_backend *be = cuda_backend_of(base);
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
    if ((rc = import_page(h, ev, err)) < 0) {
        free(ev);
        return rc;
    }
    memcpy(&eh, h->payload, sizeof(eh));
    cuda_use_device(be);
    if ((e = cudaIpcOpenEventHandle(&ev->ev, eh)) != cudaSuccess) {
        cudaGetLastError();
        munmap(ev->page, CU_EV_PAGE_BYTES);
        free(ev);
        return rekv_errf(err, -EIO,
                         "cuda backend: event_import: cudaIpcOpenEventHandle: %s (has the "
                         "exporting process exited?)",
                         cudaGetErrorString(e));
    }
    ev->be = be;
    ev->shared = 1;
    ev->handle = *h;
    ev->page_fd = -1;
    ev->refs = 1;
    *out = ev;
    return 0;
}

/* ------------------------------------------------------------------ liveness of shared waits */

/* Waits above this many are first pruned of those already complete (a stream, such as the
 * kvstore's push stream, may wait many times between its syncs). */
#define CU_WAITS_PRUNE 64

void cuda_event_note_record(rekv_event *ev)
{
    if (ev->page != NULL) /* before the record: the consumer hears of it only after this call */
        __atomic_store_n(&ev->page->recorder, (int32_t)getpid(), __ATOMIC_RELEASE);
}

/* Whether ev's latest record is complete: 1 yes (or the device failed: the blocking sync then
 * reports it), 0 not yet. */
static int event_done(rekv_event *ev)
{
    cudaError_t q = cudaEventQuery(ev->ev);
    if (q == cudaErrorNotReady) {
        if (cudaPeekAtLastError() == cudaErrorNotReady)
            cudaGetLastError(); /* "not yet" is no failure for a later launch check to find */
        return 0;
    }
    if (q != cudaSuccess && !cuda_error_is_sticky(q))
        cudaGetLastError();
    return 1;
}

static int process_dead(int32_t pid)
{
    return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

/* Keeps, of s's waits, those not yet complete. */
static void waits_prune(rekv_stream *s)
{
    size_t k = 0;
    for (size_t i = 0; i < s->n_waits; i++) {
        if (event_done(s->waits[i].ev))
            cuda_event_unref(s->waits[i].ev);
        else
            s->waits[k++] = s->waits[i];
    }
    s->n_waits = k;
}

void cuda_stream_note_wait(rekv_stream *s, rekv_event *ev)
{
    if (ev->page == NULL)
        return;
    int32_t rec = __atomic_load_n(&ev->page->recorder, __ATOMIC_ACQUIRE);
    if (rec <= 0 || rec == (int32_t)getpid())
        return; /* never recorded (no wait), or by this process (alive while it waits) */
    if (s->n_waits >= CU_WAITS_PRUNE)
        waits_prune(s);
    if (s->n_waits == s->cap_waits) {
        size_t cap = s->cap_waits ? 2 * s->cap_waits : 16;
        cu_shared_wait *nw = (cu_shared_wait *)realloc(s->waits, cap * sizeof(*nw));
        if (nw == NULL)
            return; /* out of memory: this wait goes unwatched, as before liveness existed */
        s->waits = nw;
        s->cap_waits = cap;
    }
    pthread_mutex_lock(&s->be->mu);
    ev->refs++;
    pthread_mutex_unlock(&s->be->mu);
    s->waits[s->n_waits++] = (cu_shared_wait){ev, rec};
}

void cuda_stream_waits_clear(rekv_stream *s)
{
    for (size_t i = 0; i < s->n_waits; i++)
        cuda_event_unref(s->waits[i].ev);
    s->n_waits = 0;
    if (s->peer_died || s->cap_waits > CU_WAITS_PRUNE) { /* a burst's array is not kept */
        free(s->waits);
        s->waits = NULL;
        s->cap_waits = 0;
    }
}

/* Sleeps between polls: from 20 us, doubling up to 200 us — a push step's sync then ends at most
 * ~0.2 ms after its last wait completes, for a few event queries per poll. */
static void poll_nap(long *ns)
{
    struct timespec ts = {0, *ns};
    nanosleep(&ts, NULL);
    *ns = *ns * 2 > 200000 ? 200000 : *ns * 2;
}

int cuda_stream_live_wait(rekv_stream *s)
{
    long nap = 20000;
    for (;;) {
        waits_prune(s);
        if (s->n_waits == 0)
            return 0;
        for (size_t i = 0; i < s->n_waits; i++) {
            cu_shared_wait *w = &s->waits[i];
            /* dead, and the record still pending after its death was seen: it never completes */
            if (process_dead(w->pid) && !event_done(w->ev)) {
                s->peer_died = w->pid;
                snprintf(s->peer_msg, sizeof(s->peer_msg),
                         "cuda stream %s: a shared event's recording process (pid %d) died before "
                         "the recorded work finished; the stream stays blocked on the device "
                         "(make a new one)",
                         s->name, (int)w->pid);
                cuda_stream_waits_clear(s);
                return -EPIPE;
            }
        }
        poll_nap(&nap);
    }
}

int cuda_event_live_sync(rekv_event *ev)
{
    int32_t rec = ev->page ? __atomic_load_n(&ev->page->recorder, __ATOMIC_ACQUIRE) : 0;
    if (rec <= 0 || rec == (int32_t)getpid())
        return 0;
    long nap = 20000;
    while (!event_done(ev) && !process_dead(rec))
        poll_nap(&nap);
    return 1;
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
        cuda_stream_fail(s, -EINVAL, "cuda stream %s: %s: flag %p is %s", s->name, what,
                         (const void *)flag, flag == NULL ? "NULL" : "not 4-byte aligned");
        return -1;
    }
    cudaError_t e = cudaHostGetDevicePointer(&d, (void *)flag, 0);
    if (e != cudaSuccess) {
        cudaGetLastError();
        cuda_stream_fail(s, -EINVAL,
                         "cuda stream %s: %s: flag %p is not in host memory the device can read "
                         "(host_alloc it, or host_register what holds it): %s",
                         s->name, what, (const void *)flag, cudaGetErrorString(e));
        return -1;
    }
    *out = (CUdeviceptr)(uintptr_t)d;
    return 0;
}

void cuda_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value)
{
    if (cuda_refused_in_capture(s, "a flag operation"))
        return;
    cuda_backend *be = s->be;
    CUdeviceptr d;
    char label[48];

    cuda_use_device(be);
    if (flag_device_ptr(s, flag, "wait for flag", &d) < 0)
        return;
    snprintf(label, sizeof(label), "wait flag >= %u", (unsigned)value);
    long op = cuda_op_begin(s, CU_OP_WAIT, label);
    cuda_enq_count(s);
    if (be->wait_value32 == NULL ||
        be->wait_value32(s->cs, d, value, be->wait_flags) != CUDA_SUCCESS) {
        flag_wait_kernel<<<1, 1, 0, s->cs>>>((const volatile uint32_t *)(uintptr_t)d, value);
        cuda_launch_check(s, "wait flag");
    }
    cuda_op_end(s, op);
}

void cuda_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value)
{
    if (cuda_refused_in_capture(s, "a flag operation"))
        return;
    cuda_backend *be = s->be;
    CUdeviceptr d;

    cuda_use_device(be);
    if (flag_device_ptr(s, flag, "write flag", &d) < 0)
        return;
    /* the default flags fence the stream's earlier writes before the store */
    cuda_enq_count(s);
    if (be->write_value32 == NULL ||
        be->write_value32(s->cs, d, value, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
        flag_write_kernel<<<1, 1, 0, s->cs>>>((volatile uint32_t *)(uintptr_t)d, value);
        cuda_launch_check(s, "write flag");
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

void cuda_flags_probe(cuda_backend *be)
{
    be->wait_value32 = (cu_value32_fn)driver_entry("cuStreamWaitValue32");
    be->write_value32 = (cu_value32_fn)driver_entry("cuStreamWriteValue32");
    be->wait_flags = CU_STREAM_WAIT_VALUE_GEQ;
    int flush = 0;
    if (cudaDeviceGetAttribute(&flush, cudaDevAttrCanFlushRemoteWrites, be->device) ==
            cudaSuccess &&
        flush)
        be->wait_flags |= CU_STREAM_WAIT_VALUE_FLUSH; /* writes from a peer device land first */
    cudaGetLastError();
}
