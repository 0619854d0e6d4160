/* backend_cuda_ipc.cu — the cuda runtime's sharing with other processes and its flags in host
 * memory.
 *
 * Shared buffers are cudaMalloc'd and named by cudaIpcGetMemHandle, imported with
 * cudaIpcOpenMemHandle; shared events are created with cudaEventInterprocess and named by
 * cudaIpcGetEventHandle. Flag waits and writes are the driver's stream memory operations
 * (cuStreamWaitValue32 / cuStreamWriteValue32), looked up with cudaGetDriverEntryPoint* so that
 * the program does not link libcuda (it must start on machines without a driver); where they
 * are missing or refused, a one-thread kernel polls or stores the flag instead. A flag wait is
 * timed and traced like a copy ("wait flag >= N") but is not compute time. */
#include "gpuworker/device/backend_cuda_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    ev->be = be;
    ev->shared = 1;
    rekv_ipc_handle_init(&ev->handle, REKV_IPC_EVENT, "cuda", 0);
    memcpy(ev->handle.payload, &eh, sizeof(eh));
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
    memcpy(&eh, h->payload, sizeof(eh));
    cuda_use_device(be);
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
