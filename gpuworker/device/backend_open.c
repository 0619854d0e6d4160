/* backend_open.c — choosing a backend by name, and loading the cuda one from its shared object
 * (backend_cuda.h says why it is one and where it is found).
 *
 * `auto` asks for the object only where a GPU can be: an NVIDIA device node (/dev/nvidiactl, or
 * /dev/dxg under WSL) exists. Elsewhere it is the cpu backend without touching CUDA, so a worker,
 * a local run or a test on a machine without a GPU starts as fast and as small as the programs
 * that never drive one; `--backend cuda` always tries the object and says why it could not. */
#define _GNU_SOURCE
#include "gpuworker/device/backend_cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpuworker/device/backend.h"

/* The load's outcome, decided once per process. */
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static const rekv_cuda_module *loaded;
static rekv_err load_err;

int rekv_cuda_module_path(char *buf, size_t cap, rekv_err *err)
{
    const char *env = getenv("REKV_CUDA_LIBRARY");
    if (env && env[0]) {
        if ((size_t)snprintf(buf, cap, "%s", env) >= cap)
            return rekv_errf(err, -ENAMETOOLONG, "REKV_CUDA_LIBRARY: path too long");
        return 0;
    }
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0 || (size_t)n >= sizeof(exe) - 1)
        return rekv_errf(err, n < 0 ? -errno : -ENAMETOOLONG,
                         "cuda backend: cannot tell where this program is (/proc/self/exe): %s",
                         n < 0 ? strerror(errno) : "path too long");
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = '\0';
    if ((size_t)snprintf(buf, cap, "%s/../lib/rekv/%s", exe, REKV_CUDA_LIBRARY_NAME) >= cap)
        return rekv_errf(err, -ENAMETOOLONG, "cuda backend: %s/../lib/rekv: path too long", exe);
    return 0;
}

#if REKV_CUDA
static void load(void)
{
    char path[4200];
    if (rekv_cuda_module_path(path, sizeof(path), &load_err))
        return;
    struct stat st;
    if (stat(path, &st) < 0) {
        rekv_errf(&load_err, -errno, "cuda backend: %s: %s", path, strerror(errno));
        return;
    }
    /* RTLD_LOCAL: its symbols (its own copies of common/ and device/ helpers) stay its own */
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *why = dlerror();
        rekv_errf(&load_err, -ELIBBAD, "cuda backend: cannot load %s: %s", path,
                  why ? why : "dlopen failed");
        return;
    }
    rekv_cuda_module_get_fn get = (rekv_cuda_module_get_fn)dlsym(h, REKV_CUDA_MODULE_SYMBOL);
    const rekv_cuda_module *m = get ? get() : NULL;
    if (m == NULL) {
        rekv_errf(&load_err, -ELIBACC, "cuda backend: %s has no %s", path, REKV_CUDA_MODULE_SYMBOL);
        dlclose(h);
        return;
    }
    if (m->abi != REKV_CUDA_MODULE_ABI || m->backend_iface_size != sizeof(rekv_backend_iface) ||
        m->backend_create == NULL || m->kernels == NULL) {
        rekv_errf(&load_err, -ELIBACC,
                  "cuda backend: %s is of another build (module ABI %u, this program's %d)", path,
                  (unsigned)m->abi, REKV_CUDA_MODULE_ABI);
        dlclose(h);
        return;
    }
    loaded = m; /* never unloaded: backends, streams and kernel tables point into it */
}
#endif

int rekv_cuda_module_load(const rekv_cuda_module **out, rekv_err *err)
{
    *out = NULL;
#if REKV_CUDA
    pthread_once(&load_once, load);
    if (loaded == NULL)
        return rekv_errf(err, load_err.code ? load_err.code : -ELIBBAD, "%s", load_err.msg);
    *out = loaded;
    return 0;
#else
    (void)load_once;
    (void)load_err;
    return rekv_errf(err, -ENOTSUP, "this build of rekv has no cuda backend (nvcc was absent)");
#endif
}

const rekv_cuda_module *rekv_cuda_module_loaded(void)
{
    return loaded;
}

int rekv_backend_cuda_create(int device, rekv_backend **out, rekv_err *err)
{
    const rekv_cuda_module *m;
    int rc;
    *out = NULL;
    if ((rc = rekv_cuda_module_load(&m, err)))
        return rc;
    return m->backend_create(device, out, err);
}

/* Whether an NVIDIA GPU can be here at all: its driver's device node. */
static int gpu_node_present(void)
{
    return access("/dev/nvidiactl", F_OK) == 0 || access("/dev/dxg", F_OK) == 0;
}

int rekv_backend_create(const char *which, const rekv_link_config *link, rekv_backend **out,
                        char *note, size_t note_len, rekv_err *err)
{
    if (note && note_len)
        note[0] = '\0';
    int emulate = rekv_link_emulates(link);
    if (which == NULL || strcmp(which, "auto") == 0) {
        if (emulate) { /* a GPU's link or memory to emulate: that is the cpu backend's job */
            if (note)
                snprintf(note, note_len,
                         "link or device-memory emulation asked: running on the "
                         "cpu backend");
            return rekv_backend_cpu_create(link, out, err);
        }
#if REKV_CUDA
        rekv_err cerr = {0};
        if (!gpu_node_present()) {
            if (note)
                snprintf(note, note_len, "no GPU (no /dev/nvidiactl): running on the cpu backend");
        } else if (rekv_backend_cuda_create(0, out, &cerr) == 0) {
            if (note)
                snprintf(note, note_len, "cuda backend on device 0");
            return 0;
        } else if (note) {
            snprintf(note, note_len, "no usable GPU (%s): running on the cpu backend", cerr.msg);
        }
#else
        (void)gpu_node_present;
        if (note)
            snprintf(note, note_len, "built without CUDA: running on the cpu backend");
#endif
        return rekv_backend_cpu_create(link, out, err);
    }
    if (strcmp(which, "cpu") == 0)
        return rekv_backend_cpu_create(link, out, err);
    if (strcmp(which, "cuda") == 0) {
        if (emulate)
            return rekv_errf(err, -EINVAL,
                             "link and device-memory emulation are the cpu "
                             "backend's: drop --link-gbps/--device-memory, or use "
                             "--backend cpu");
        return rekv_backend_cuda_create(0, out, err);
    }
    return rekv_errf(err, -EINVAL, "unknown backend \"%s\" (auto, cpu, cuda)", which);
}

double rekv_backend_kv_room(rekv_backend *be, double place_bytes)
{
    size_t fr = 0, tot = 0;
    rekv_err e = {0};
    if (!be->iface->mem_info || be->iface->mem_info(be, &fr, &tot, &e) != 0)
        return -1;
    double room = (double)fr - 0.1 * (double)tot - place_bytes;
    return room < 0 ? 0 : room;
}
