/* cpu_qgemm.h — the cpu backend's GEMM over quantized weights (GGUF block formats), and its plain
 * reference. */
#ifndef REKV_GPUWORKER_CPU_QGEMM_H
#define REKV_GPUWORKER_CPU_QGEMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

/* A GGUF block type where a kernel takes a weight dtype (kernels.h: linear, embed, qkv): the
 * matrix stays in its blocks on every backend. The cpu kernels read such weights through
 * cpu_qgemm_rowinv and rekv_ggml_dequant_row; the cuda kernels decode the blocks on the device
 * (loader/gguf_block.h) into an f16 scratch for cuBLAS (kernels_cuda.cu). */
#define CPU_QGEMM_WT_BASE 0x100u
static inline rekv_dtype cpu_qgemm_wt(uint32_t type)
{
    return (rekv_dtype)(CPU_QGEMM_WT_BASE | type);
}
/* The block type a weight dtype carries, 0 for a plain dtype. */
static inline uint32_t cpu_qgemm_wt_type(rekv_dtype wt)
{
    return (uint32_t)wt >= CPU_QGEMM_WT_BASE ? (uint32_t)wt - CPU_QGEMM_WT_BASE : 0;
}

/* y[m][n] = x[m][k] · W[n][k]^T (+ bias[n] when not NULL) with W's rows stored in a GGUF block
 * type (loader/gguf.h's rekv_ggml_type: Q8_0, Q4_0, Q4_K, Q6_K; F32/F16/BF16 too), each row k
 * elements in whole blocks. Every output element is cpu_gemm_rowinv's dot product, in its order,
 * over the row's dequantized values (ggml's): the same bits as cpu_gemm_rowinv on the dequantized
 * fp32 matrix, whatever m, whichever rows share the call, whatever the threads. Threaded on
 * cpu_gemm's pool. Returns 0, -ENOTSUP for a type it cannot read, -EINVAL when k is not whole
 * blocks (memory short for its per-thread scratch, it goes a block at a time instead). */
int cpu_qgemm_rowinv(float *y, const float *x, const void *w, uint32_t type, const float *bias,
                     int m, int n, int k);
/* The same products, plain C, one thread, a row at a time: the oracle the fast path is checked
 * against (tests/test_gguf_qgemm.c). No bias. */
int cpu_qgemm_rowinv_ref(float *y, const float *x, const void *w, uint32_t type, int m, int n,
                         int k);
/* rows weight rows of k elements (whole blocks, row_bytes apart) at w dequantized into dst
 * ([rows][k] fp32) as the GEMM decodes its tiles — AVX2 where the cpu has it, else
 * loader/gguf_block.h's decoders: ggml's values either way (tests/test_qdecode.c). */
void cpu_qgemm_dequant_rows(uint32_t type, const void *w, size_t row_bytes, int rows, int k,
                            float *dst);
/* Bytes of one row of k elements (whole blocks) in the type; 0 for a type rekv does not know. */
size_t cpu_qgemm_row_bytes(uint32_t type, int k);

#endif
