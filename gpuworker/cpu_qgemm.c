/* cpu_qgemm.c — a reference-speed GEMM over quantized weights for the cpu backend: plain C, one
 * thread, row-invariant.
 *
 * The weights stay in their GGUF blocks; each weight row is dequantized (loader/gguf_quant.c,
 * ggml's exact values) into a scratch row when it is used, and multiplied with every row of x in
 * cpu_gemm_rowinv's fixed order — eight fused multiply-add lanes over k in steps of 8, the lanes
 * summed in cpu_gemm.c's tree, then the k % 8 tail — so a quantized model's products are, bit for
 * bit, those of the fp32 engine on its dequantized weights (tests/test_gguf_qgemm.c checks it).
 * This is the oracle the fast kernels (dequantizing inside the micro-kernel's tiles) are to be
 * checked against, not one of them. */
#include "gpuworker/cpu_qgemm.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "loader/gguf.h"

/* cpu_gemm.c's lane-reduction tree. */
static inline float reduce8(const float l[8])
{
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static float dot(const float *a, const float *b, int k)
{
    float l[8] = {0};
    int k8 = k & ~7;
    for (int t = 0; t < k8; t += 8)
        for (int j = 0; j < 8; j++)
            l[j] = fmaf(a[t + j], b[t + j], l[j]);
    float s = reduce8(l);
    for (int t = k8; t < k; t++)
        s = fmaf(a[t], b[t], s);
    return s;
}

int cpu_qgemm_rowinv_ref(float *y, const float *x, const void *w, uint32_t type, int m, int n,
                         int k)
{
    uint32_t be, bb;
    rekv_ggml_type_block(type, &be, &bb);
    if (!rekv_ggml_type_dequantizable(type))
        return -ENOTSUP;
    if (k <= 0 || (uint32_t)k % be != 0)
        return -EINVAL;
    size_t row_bytes = (size_t)k / be * bb;
    float *row = malloc((size_t)k * sizeof(float));
    if (row == NULL)
        return -ENOMEM;
    for (int j = 0; j < n; j++) {
        int rc = rekv_ggml_dequant_row(type, (const uint8_t *)w + (size_t)j * row_bytes,
                                       (uint64_t)k, row);
        if (rc) {
            free(row);
            return rc;
        }
        for (int i = 0; i < m; i++)
            y[(size_t)i * n + j] = dot(x + (size_t)i * k, row, k);
    }
    free(row);
    return 0;
}
