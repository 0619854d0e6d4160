/* blas.h — OpenBLAS and LAPACKE, loaded on first use.
 *
 * rekv's own GEMM (cpu_gemm_rowinv) runs every projection of the engine; OpenBLAS serves only the
 * SVD that skewing needs (LAPACKE_dgesvd), the benchmarks' baselines and the tests' reference
 * product. So no program links it: the first of those uses loads it with dlopen. A process that
 * links OpenBLAS pays at start for relocating its 36 MB and for its thread pool, which its
 * constructor starts and which spins (sched_yield) for ~2^28 cycles before it sleeps: on a 2-core
 * machine, the worker's and the CLI's spinning threads took the cores the rest of a fresh trio
 * needed (`rekv generate` of 32 tokens on opt-tiny-py: 67 ms linked, 58 ms with
 * OPENBLAS_NUM_THREADS=1; 128 tokens: 154 vs 108 ms; median of 25). Loaded once per process and
 * never unloaded; a load that failed fails the same way again. */
#ifndef REKV_GPUWORKER_BLAS_H
#define REKV_GPUWORKER_BLAS_H

#include <cblas.h>
#include <lapacke.h>

#include "common/err.h"

#define REKV_OPENBLAS_LIBRARY "libopenblas.so.0"
#define REKV_LAPACKE_LIBRARY "liblapacke.so.3"

/* The entry points rekv calls, typed by the libraries' own headers. */
typedef struct rekv_blas {
    __typeof__(&cblas_sgemm) sgemm;
    __typeof__(&cblas_sgemv) sgemv;
    __typeof__(&openblas_get_num_threads) get_num_threads;
    __typeof__(&LAPACKE_dgesvd) dgesvd;
} rekv_blas;

/* Loads the libraries (once per process): 0 with *out, or -ELIBBAD (one cannot be loaded) or
 * -ELIBACC (an entry point is missing), err naming the library and dlerror's words. */
int rekv_blas_load(const rekv_blas **out, rekv_err *err);

#endif
