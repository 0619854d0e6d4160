/* cpu_qgemm.h — the cpu backend's reference GEMM over quantized weights (GGUF block formats). */
#ifndef REKV_GPUWORKER_CPU_QGEMM_H
#define REKV_GPUWORKER_CPU_QGEMM_H

#include <stdint.h>

/* y[m][n] = x[m][k] · W[n][k]^T with W's rows stored in a GGUF tensor type (loader/gguf.h's
 * rekv_ggml_type: Q8_0, Q4_0, Q4_K, Q6_K, or F32/F16/BF16), each row k elements in whole blocks.
 * Every output element is cpu_gemm_rowinv's dot product, in its order, over the row's dequantized
 * values: the same bits as cpu_gemm_rowinv on the dequantized fp32 matrix, whatever m and
 * whichever rows share the call. Returns 0, -ENOTSUP for a type it cannot read, -EINVAL when k is
 * not whole blocks, -ENOMEM. */
int cpu_qgemm_rowinv_ref(float *y, const float *x, const void *w, uint32_t type, int m, int n,
                         int k);

#endif
