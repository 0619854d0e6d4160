/* kernels.c — which kernel table runs on a backend's streams. The device runtime knows nothing of
 * the forward pass, so the engine pairs them here, by the runtime's name. */
#include "gpuworker/kernels.h"

#include <string.h>

const rekv_kernel_iface *rekv_kernels_of(const rekv_backend *be)
{
    if (be == NULL)
        return NULL;
    if (strcmp(be->iface->name, "cpu") == 0)
        return &rekv_cpu_kernels;
#if REKV_CUDA
    if (strcmp(be->iface->name, "cuda") == 0)
        return &rekv_cuda_kernels;
#endif
    return NULL;
}
