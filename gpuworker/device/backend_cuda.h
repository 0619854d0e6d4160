/* backend_cuda.h — the cuda backend, which lives in a shared object of its own.
 *
 * librekv_cuda.so holds the cuda runtime (device/backend_cuda.cu: cudaMalloc, CUDA streams and
 * events, CUDA IPC) and the engine's CUDA kernels (gpuworker/kernels_cuda.cu), and it alone links
 * cudart and cuBLAS. No program does: the first use of the cuda backend (`--backend cuda`, or
 * `auto` where the machine has an NVIDIA device node) loads the object with dlopen and takes its
 * one entry point, rekv_cuda_module_get, which gives the backend's constructor and the kernel
 * table. So the processes that never drive a GPU — the coordinator, the CLI's client commands,
 * a store without a push backend, any program on a machine without a GPU — start without the CUDA
 * libraries (~220 MB of RSS and ~0.6 s of start-up each), and a machine without them runs them.
 *
 * Where the object is: $REKV_CUDA_LIBRARY when set (a path), else beside the program,
 * DIR/../lib/rekv/librekv_cuda.so for a program in DIR (build/bin and build/tests in a build,
 * PREFIX/bin once installed: `make install` puts the object in PREFIX/lib/rekv). The object is
 * loaded once per process and never unloaded; a load that failed fails the same way again. */
#ifndef REKV_GPUWORKER_DEVICE_BACKEND_CUDA_H
#define REKV_GPUWORKER_DEVICE_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "gpuworker/device/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The engine's kernel table (gpuworker/kernels.h); the device room passes it on unread. */
struct rekv_kernel_iface;

/* Raised whenever rekv_cuda_module changes. */
#define REKV_CUDA_MODULE_ABI 1
#define REKV_CUDA_MODULE_SYMBOL "rekv_cuda_module_get"
#define REKV_CUDA_LIBRARY_NAME "librekv_cuda.so"

/* What the object's entry point gives: the same static table on every call. */
typedef struct rekv_cuda_module {
    uint32_t abi;                /* REKV_CUDA_MODULE_ABI of the build that made the object */
    uint32_t backend_iface_size; /* sizeof(rekv_backend_iface) there */
    uint32_t kernel_iface_size;  /* sizeof(rekv_kernel_iface) there (the engine checks it) */
    uint32_t reserved;
    /* creates the backend on device `device`: 0, -ENODEV when the machine has no CUDA device (or
     * not that one; err says which and why), another negative errno when CUDA cannot be set up */
    int (*backend_create)(int device, rekv_backend **out, rekv_err *err);
    const struct rekv_kernel_iface *kernels; /* the kernels that run on its streams */
} rekv_cuda_module;

typedef const rekv_cuda_module *(*rekv_cuda_module_get_fn)(void);

/* The path the object is loaded from ($REKV_CUDA_LIBRARY or beside the program): 0, or a
 * negative errno when it cannot be told (the program's own path unreadable, cap too small). */
int rekv_cuda_module_path(char *buf, size_t cap, rekv_err *err);

/* Loads the object (once per process) and checks its entry point and ABI: 0 with *out, or
 * -ENOENT (no such file), -ELIBBAD (dlopen refused it: a missing CUDA library, a bad file; err
 * has dlerror's words), -ELIBACC (no entry point, or another ABI), -ENOTSUP (a build without
 * CUDA). err names the path. */
int rekv_cuda_module_load(const rekv_cuda_module **out, rekv_err *err);

/* The module once a load succeeded, else NULL; never loads. */
const rekv_cuda_module *rekv_cuda_module_loaded(void);

/* Loads the module and creates the cuda backend on device `device` (0 for the first GPU): 0, the
 * load's error, or the constructor's (-ENODEV: no CUDA device or not that one). */
int rekv_backend_cuda_create(int device, rekv_backend **out, rekv_err *err);

#ifdef __cplusplus
}
#endif

#endif
