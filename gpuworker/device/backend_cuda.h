/* backend_cuda.h — the cuda backend's runtime: device memory from cudaMalloc, CUDA streams and
 * events, CUDA IPC (its kernels are the engine's, gpuworker/kernels_cuda.cu). Declared only in
 * builds with CUDA (the Makefile defines REKV_CUDA=1 when nvcc is present); backend_cuda.cu says
 * what each entry does and what the stats and trace measure. */
#ifndef REKV_GPUWORKER_DEVICE_BACKEND_CUDA_H
#define REKV_GPUWORKER_DEVICE_BACKEND_CUDA_H

#include "gpuworker/device/backend.h"

#if REKV_CUDA
#ifdef __cplusplus
extern "C" {
#endif

/* Creates the cuda backend on device `device` (0 for the first GPU). Returns 0, -ENODEV when the
 * machine has no CUDA device (or no device of that number; err says which and why), or another
 * negative errno when the CUDA runtime cannot be set up. */
int rekv_backend_cuda_create(int device, rekv_backend **out, rekv_err *err);

#ifdef __cplusplus
}
#endif
#endif

#endif
