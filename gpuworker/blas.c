/* blas.c — see blas.h. */
#define _GNU_SOURCE
#include "gpuworker/blas.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static rekv_blas table;
static _Atomic(const rekv_blas *) loaded;
static rekv_err load_err;

/* Opens lib (RTLD_LOCAL: the symbols stay out of the process's namespace); NULL with load_err. */
static void *open_lib(const char *lib, const char *package)
{
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        const char *why = dlerror();
        rekv_errf(&load_err, -ELIBBAD, "cannot load %s (Debian package %s): %s", lib, package,
                  why ? why : "dlopen failed");
    }
    return h;
}

/* dlsym of name into *slot; 0, or -1 with load_err. */
static int sym(void *h, const char *lib, const char *name, void *slot)
{
    void *p = dlsym(h, name);
    if (p == NULL) {
        rekv_errf(&load_err, -ELIBACC, "%s has no %s", lib, name);
        return -1;
    }
    *(void **)slot = p;
    return 0;
}

static void load(void)
{
    void *ob = open_lib(REKV_OPENBLAS_LIBRARY, "libopenblas0");
    void *lp = ob ? open_lib(REKV_LAPACKE_LIBRARY, "liblapacke") : NULL;
    if (lp == NULL)
        return;
    if (sym(ob, REKV_OPENBLAS_LIBRARY, "cblas_sgemm", &table.sgemm) ||
        sym(ob, REKV_OPENBLAS_LIBRARY, "cblas_sgemv", &table.sgemv) ||
        sym(ob, REKV_OPENBLAS_LIBRARY, "openblas_get_num_threads", &table.get_num_threads) ||
        sym(lp, REKV_LAPACKE_LIBRARY, "LAPACKE_dgesvd", &table.dgesvd))
        return;
    atomic_store(&loaded, &table); /* never unloaded */
}

int rekv_blas_load(const rekv_blas **out, rekv_err *err)
{
    pthread_once(&load_once, load);
    *out = atomic_load(&loaded);
    if (*out == NULL)
        return rekv_errf(err, load_err.code ? load_err.code : -ELIBBAD, "%s", load_err.msg);
    return 0;
}
