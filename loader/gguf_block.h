/* gguf_block.h — GGUF's quantized blocks (Q8_0, Q4_0, Q4_K, Q6_K) decoded as ggml's reference
 * to_float decodes them, in one place for host C and device code: every function is a static
 * inline marked REKV_HD, which nvcc compiles for both sides (__host__ __device__) and a C compiler
 * as plain static inline. Readers: loader/gguf_quant.c (the reference whole-row dequantization,
 * block by block), the cuda kernels (gpuworker/kernels_cuda.cu: a weight at a time, into the
 * GEMM's f16 scratch and the embedding's looked-up rows); the cpu GEMM's AVX2 decoding
 * (gpuworker/cpu_qgemm.c) is checked against these bit for bit (tests/test_qdecode.c).
 *
 * Each value is ggml's: the same products, in the same order, each rounded once — no fused
 * multiply-add (rekv_qb_mul keeps nvcc from contracting a product into the add after it, as the
 * host build's -std=c11 does not), so a dequantized tensor's checksums equal llama.cpp's on
 * either side. Block data is read with 2-byte alignment at most (every block's size is even).
 *
 * Layouts (ggml's block_q8_0, block_q4_0, block_q4_K, block_q6_K):
 * - Q8_0: 32 weights, 34 bytes: f16 d, int8 q[32]; w = q * d.
 * - Q4_0: 32 weights, 18 bytes: f16 d, 16 bytes of nibbles; weight j < 16 is the low nibble of
 *   byte j, weight j + 16 its high nibble; w = (nibble - 8) * d.
 * - Q4_K: 256 weights, 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins of 8
 *   sub-blocks of 32, 128 bytes of nibbles: each 32 bytes hold two sub-blocks (low nibbles the
 *   first, high the second); w = (d * scale) * nibble - dmin * min.
 * - Q6_K: 256 weights, 210 bytes: 128 bytes of low nibbles (ql), 64 of high 2-bit pairs (qh), 16
 *   int8 scales (one per 16 weights), f16 d. Each half of 128 weights takes 64 ql bytes and 32 qh
 *   bytes: weight l + 32g (g < 4) has its low bits from ql[l] (g even) or ql[l + 32] (g odd), low
 *   nibble for g < 2 and high for g >= 2, its high bits from qh[l] >> 2g; w = (d * scale) * (q -
 *   32). */
#ifndef REKV_LOADER_GGUF_BLOCK_H
#define REKV_LOADER_GGUF_BLOCK_H

#include <stdint.h>
#include <string.h>

#include "loader/gguf.h"

#if defined(__CUDACC__)
#define REKV_HD static inline __host__ __device__
#else
#define REKV_HD static inline
#endif

/* a * b rounded once and never fused into a following add (nvcc contracts by default). */
REKV_HD float rekv_qb_mul(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

/* The f16 at p (2-byte aligned), widened exactly: rekv_f16_to_f32's bits, NaN payloads too. */
REKV_HD float rekv_qb_f16(const uint8_t *p)
{
    uint16_t h;
#if defined(__CUDA_ARCH__)
    h = *(const uint16_t *)p;
#else
    memcpy(&h, p, 2);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) /* zero or subnormal: man * 2^-24, exact in float */
        return sign ? -((float)man * 5.9604644775390625e-8f) : (float)man * 5.9604644775390625e-8f;
    uint32_t u = exp == 31 ? sign | 0x7f800000u | (man << 13)
                           : sign | ((exp + 127 - 15) << 23) | (man << 13);
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* A type's block: weights and bytes; 0 for a type these functions do not decode. */
REKV_HD int rekv_qb_geometry(uint32_t type, uint32_t *elems, uint32_t *bytes)
{
    switch (type) {
    case REKV_GGML_Q8_0:
        *elems = 32, *bytes = 34;
        return 1;
    case REKV_GGML_Q4_0:
        *elems = 32, *bytes = 18;
        return 1;
    case REKV_GGML_Q4_K:
        *elems = 256, *bytes = 144;
        return 1;
    case REKV_GGML_Q6_K:
        *elems = 256, *bytes = 210;
        return 1;
    default:
        *elems = *bytes = 0;
        return 0;
    }
}

/* Q8_0 and Q4_0: weight i (< 32) of block b as its signed code; the weight is code * d. */
REKV_HD int rekv_qb_q8_0_code(const uint8_t *b, int i)
{
    return (int8_t)b[2 + i];
}
REKV_HD int rekv_qb_q4_0_code(const uint8_t *b, int i)
{
    return (i < 16 ? b[2 + i] & 0x0F : b[2 + i - 16] >> 4) - 8;
}

/* Weight i (< 32) of Q8_0 block b. */
REKV_HD float rekv_qb_q8_0(const uint8_t *b, int i)
{
    return rekv_qb_mul((float)rekv_qb_q8_0_code(b, i), rekv_qb_f16(b));
}

/* Weight i (< 32) of Q4_0 block b. */
REKV_HD float rekv_qb_q4_0(const uint8_t *b, int i)
{
    return rekv_qb_mul((float)rekv_qb_q4_0_code(b, i), rekv_qb_f16(b));
}

/* Q4_K block b's sub-block j (< 8): d times its 6-bit scale, dmin times its 6-bit min. Sub-blocks
 * 0-3 keep theirs in the low 6 bits of scale bytes j and j + 4; 4-7 split theirs over byte j + 4's
 * nibbles and the top 2 bits of bytes j - 4 and j. */
REKV_HD void rekv_qb_q4_k_sub(const uint8_t *b, int j, float *d1, float *m1)
{
    const uint8_t *q = b + 4;
    int sc, m;
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    *d1 = rekv_qb_mul(rekv_qb_f16(b), (float)sc);
    *m1 = rekv_qb_mul(rekv_qb_f16(b + 2), (float)m);
}

/* The nibble of weight l (< 32) of Q4_K block b's sub-block j. */
REKV_HD int rekv_qb_q4_k_nibble(const uint8_t *b, int j, int l)
{
    uint8_t v = b[16 + (j / 2) * 32 + l];
    return j & 1 ? v >> 4 : v & 0xF;
}

/* Weight i (< 256) of Q4_K block b. */
REKV_HD float rekv_qb_q4_k(const uint8_t *b, int i)
{
    float d1, m1;
    rekv_qb_q4_k_sub(b, i / 32, &d1, &m1);
    return rekv_qb_mul(d1, (float)rekv_qb_q4_k_nibble(b, i / 32, i % 32)) - m1;
}

/* Q6_K: weight i (< 256) of a block is weight l (< 32) of group g (< 4) of half h (< 2), i = 128 h
 * + 32 g + l. The scale of 16 of them: d times their int8 scale. */
REKV_HD float rekv_qb_q6_k_scale(const uint8_t *b, int h, int g, int l)
{
    int8_t sc = (int8_t)b[192 + h * 8 + l / 16 + 2 * g];
    return rekv_qb_mul(rekv_qb_f16(b + 208), (float)sc);
}

/* That weight's signed 6-bit code (q - 32). */
REKV_HD int rekv_qb_q6_k_code(const uint8_t *b, int h, int g, int l)
{
    const uint8_t *ql = b + h * 64, *qh = b + 128 + h * 32;
    uint8_t lo = ql[l + (g & 1) * 32];
    int q = (g < 2 ? lo & 0xF : lo >> 4) | (((qh[l] >> (2 * g)) & 3) << 4);
    return q - 32;
}

/* Weight i (< 256) of Q6_K block b. */
REKV_HD float rekv_qb_q6_k(const uint8_t *b, int i)
{
    int h = i / 128, g = i % 128 / 32, l = i % 32;
    return rekv_qb_mul(rekv_qb_q6_k_scale(b, h, g, l), (float)rekv_qb_q6_k_code(b, h, g, l));
}

/* Weight i of a row of whole blocks of type (one of rekv_qb_geometry's) starting at row. */
REKV_HD float rekv_qb_at(uint32_t type, const uint8_t *row, int64_t i)
{
    switch (type) {
    case REKV_GGML_Q8_0:
        return rekv_qb_q8_0(row + i / 32 * 34, (int)(i % 32));
    case REKV_GGML_Q4_0:
        return rekv_qb_q4_0(row + i / 32 * 18, (int)(i % 32));
    case REKV_GGML_Q4_K:
        return rekv_qb_q4_k(row + i / 256 * 144, (int)(i % 256));
    default:
        return rekv_qb_q6_k(row + i / 256 * 210, (int)(i % 256));
    }
}

/* Block b of type (one of rekv_qb_geometry's) decoded into y (its 32 or 256 weights): each weight
 * rekv_qb_at's, the per-sub-block factors computed once. */
REKV_HD void rekv_qb_decode(uint32_t type, const uint8_t *b, float *y)
{
    float d = rekv_qb_f16(b);
    switch (type) {
    case REKV_GGML_Q8_0:
        for (int i = 0; i < 32; i++)
            y[i] = rekv_qb_mul((float)rekv_qb_q8_0_code(b, i), d);
        break;
    case REKV_GGML_Q4_0:
        for (int i = 0; i < 16; i++) { /* a byte's two nibbles */
            y[i] = rekv_qb_mul((float)rekv_qb_q4_0_code(b, i), d);
            y[i + 16] = rekv_qb_mul((float)rekv_qb_q4_0_code(b, i + 16), d);
        }
        break;
    case REKV_GGML_Q4_K:
        for (int j = 0; j < 8; j++) {
            float d1, m1;
            rekv_qb_q4_k_sub(b, j, &d1, &m1);
            for (int l = 0; l < 32; l++)
                y[32 * j + l] = rekv_qb_mul(d1, (float)rekv_qb_q4_k_nibble(b, j, l)) - m1;
        }
        break;
    default:
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l0 = 0; l0 < 32; l0 += 16) { /* 16 weights share a scale */
                    float ds = rekv_qb_q6_k_scale(b, h, g, l0);
                    for (int l = l0; l < l0 + 16; l++)
                        y[128 * h + 32 * g + l] =
                            rekv_qb_mul(ds, (float)rekv_qb_q6_k_code(b, h, g, l));
                }
        break;
    }
}

#endif
