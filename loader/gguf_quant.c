/* gguf_quant.c — dequantization of GGUF tensor data to float32: F32, F16, BF16, Q8_0, Q4_0, Q4_K
 * and Q6_K, block layouts as ggml defines them.
 *
 * The blocks are decoded by gguf_block.h, the one decoding host and device code share, which
 * reproduces ggml's reference to_float bit for bit, so a dequantized tensor's checksums equal
 * llama.cpp's (tests/test_gguf.c checks every tensor of ../shared/gguf). This is the reference
 * path: a whole-tensor dequantization for checks, inspection and the embedding's looked-up rows;
 * the cpu GEMM decodes its tiles with AVX2 (gpuworker/cpu_qgemm.c). */
#include "loader/gguf.h"

#include <errno.h>
#include <string.h>

#include "common/dtype.h"
#include "loader/gguf_block.h"

/* nb blocks of a quantized type at b decoded into y (gguf_block.h, ggml's values). */
static void deq_blocks(uint32_t type, const uint8_t *b, uint64_t nb, float *y)
{
    uint32_t be, bb;
    (void)rekv_qb_geometry(type, &be, &bb);
    for (uint64_t i = 0; i < nb; i++, b += bb, y += be)
        rekv_qb_decode(type, b, y);
}

int rekv_ggml_dequant_row(uint32_t type, const void *src, uint64_t n, float *dst)
{
    uint32_t be, bb;
    rekv_ggml_type_block(type, &be, &bb);
    if (!rekv_ggml_type_dequantizable(type))
        return -ENOTSUP;
    if (n % be)
        return -EINVAL;
    uint64_t nb = n / be;
    switch (type) {
    case REKV_GGML_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case REKV_GGML_F16:
        rekv_to_f32(dst, src, REKV_DTYPE_F16, (size_t)n);
        break;
    case REKV_GGML_BF16:
        rekv_to_f32(dst, src, REKV_DTYPE_BF16, (size_t)n);
        break;
    case REKV_GGML_Q8_0:
    case REKV_GGML_Q4_0:
    case REKV_GGML_Q4_K:
    case REKV_GGML_Q6_K:
        deq_blocks(type, src, nb, dst);
        break;
    }
    return 0;
}

int rekv_gguf_dequant(const rekv_gguf_tensor *t, uint64_t first, uint64_t n, float *dst,
                      rekv_err *err)
{
    uint32_t be, bb;
    rekv_ggml_type_block(t->type, &be, &bb);
    if (!rekv_ggml_type_dequantizable(t->type))
        return rekv_errf(err, -ENOTSUP, "tensor \"%s\": dequantizing %s is not supported", t->name,
                         be ? rekv_ggml_type_name(t->type) : "an unknown type");
    if (first % be || n % be || first > t->numel || n > t->numel - first)
        return rekv_errf(err, -EINVAL,
                         "tensor \"%s\": elements [%llu, +%llu) are not whole %s blocks inside "
                         "its %llu",
                         t->name, (unsigned long long)first, (unsigned long long)n,
                         rekv_ggml_type_name(t->type), (unsigned long long)t->numel);
    return rekv_ggml_dequant_row(t->type, (const uint8_t *)t->data + first / be * bb, n, dst);
}
