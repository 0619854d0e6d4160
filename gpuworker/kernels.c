/* kernels.c — which kernel table runs on a backend's streams. The device runtime knows nothing of
 * the forward pass, so the engine pairs them here, by the runtime's name. */
#include "gpuworker/kernels.h"

#include <string.h>

#include "gpuworker/device/backend_cuda.h"

const rekv_kernel_iface *rekv_kernels_of(const rekv_backend *be)
{
    if (be == NULL)
        return NULL;
    if (strcmp(be->iface->name, "cpu") == 0)
        return &rekv_cpu_kernels;
    if (strcmp(be->iface->name, "cuda") == 0) {
        /* a cuda backend exists only once its module has loaded */
        const rekv_cuda_module *m = rekv_cuda_module_loaded();
        return m && m->kernel_iface_size == sizeof(rekv_kernel_iface) ? m->kernels : NULL;
    }
    return NULL;
}
