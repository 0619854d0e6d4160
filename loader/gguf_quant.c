/* gguf_quant.c — dequantization of GGUF tensor data to float32: F32, F16, BF16, Q8_0, Q4_0, Q4_K
 * and Q6_K, block layouts as ggml defines them.
 *
 * Each function reproduces ggml's reference to_float bit for bit: the same products in the same
 * order, in float, with no fused multiply-add (the build's -std=c11 keeps contraction off), so a
 * dequantized tensor's checksums equal llama.cpp's (tests/test_gguf.c checks every tensor of
 * ../shared/gguf). This is the reference path: a whole-tensor dequantization for checks and
 * inspection, not the GEMM's, which is to read the blocks where they lie. */
#include "loader/gguf.h"

#include <errno.h>
#include <string.h>

#include "common/dtype.h"

static uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static float f16_at(const uint8_t *p)
{
    return rekv_f16_to_f32(rd16(p));
}

/* Q8_0: 32 weights, 34 bytes: f16 scale d, int8 q[32]; w = q * d. */
static void deq_q8_0(const uint8_t *b, uint64_t nb, float *y)
{
    for (uint64_t i = 0; i < nb; i++, b += 34, y += 32) {
        float d = f16_at(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++)
            y[j] = q[j] * d;
    }
}

/* Q4_0: 32 weights, 18 bytes: f16 scale d, 16 bytes of nibbles; weight j < 16 is the low nibble
 * of byte j, weight j + 16 its high nibble; w = (nibble - 8) * d. */
static void deq_q4_0(const uint8_t *b, uint64_t nb, float *y)
{
    for (uint64_t i = 0; i < nb; i++, b += 18, y += 32) {
        float d = f16_at(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = ((qs[j] & 0x0F) - 8) * d;
            y[j + 16] = ((qs[j] >> 4) - 8) * d;
        }
    }
}

/* Q4_K's 6-bit scale and min of sub-block j (of 8) from its 12 packed bytes: sub-blocks 0-3 keep
 * theirs in the low 6 bits of bytes j and j + 4; 4-7 split theirs over byte j + 4's nibbles and
 * the top 2 bits of bytes j - 4 and j. */
static void k4_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K: 256 weights, 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins for 8
 * sub-blocks of 32, 128 bytes of nibbles. Each 32 bytes of nibbles hold two sub-blocks (low
 * nibbles the first, high the second); w = d * scale * nibble - dmin * min. */
static void deq_q4_k(const uint8_t *b, uint64_t nb, float *y)
{
    for (uint64_t i = 0; i < nb; i++, b += 144) {
        float d = f16_at(b), dmin = f16_at(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int j = 0; j < 8; j += 2, q += 32) {
            uint8_t sc, m;
            k4_scale_min(j, scales, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            k4_scale_min(j + 1, scales, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++)
                *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

/* Q6_K: 256 weights, 210 bytes: 128 bytes of low nibbles (ql), 64 bytes of high 2-bit pairs (qh),
 * 16 int8 scales (one per 16 weights), f16 d. Each half of 128 weights takes 64 ql bytes and 32
 * qh bytes: weight l + 32k (k < 4) has low bits from ql[l] (k even) or ql[l + 32] (k odd), low
 * nibble for k < 2 and high for k >= 2, and high bits from qh[l] >> 2k; w = d * scale * (q - 32).
 */
static void deq_q6_k(const uint8_t *b, uint64_t nb, float *y)
{
    for (uint64_t i = 0; i < nb; i++, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = f16_at(b + 208);
        for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * sc[is] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
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
        deq_q8_0(src, nb, dst);
        break;
    case REKV_GGML_Q4_0:
        deq_q4_0(src, nb, dst);
        break;
    case REKV_GGML_Q4_K:
        deq_q4_k(src, nb, dst);
        break;
    case REKV_GGML_Q6_K:
        deq_q6_k(src, nb, dst);
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
