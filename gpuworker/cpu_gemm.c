/* cpu_gemm.c — the cpu backend's GEMM: fp32, row-invariant — a row's result does not depend on
 * which other rows share the call.
 *
 * The exact modes recompute keys and values from stored activations (KVPR's prefix, HybridServe's
 * ACT blocks) and must reproduce, bit for bit, the K and V computed when the token was first seen —
 * in a call with other rows; and continuous batching must not change a sequence's tokens with the
 * company it keeps. OpenBLAS does not promise that: it picks other kernels for one row, for small
 * problems and for edge tiles, which sum in other orders (measured: 163 of 300 random shapes
 * differ between a whole-matrix call and the same rows in chunks; padding to fixed row tiles does
 * not cure it). So every projection uses this GEMM, and OpenBLAS stays as the yardstick that
 * `rekv bench forward` measures it against. Here every output
 * element is one dot product in a fixed order — eight fused multiply-add lanes over k in steps of
 * 8, the lanes summed pairwise in a fixed tree, then the k % 8 tail with fmaf — whatever the
 * blocking, the row count or the instruction set. The AVX2 path and the portable path give the
 * same bits. Weights may be fp32, fp16 or bf16 (the model file's dtype, kept as it is): 16-bit
 * weights are widened to fp32 in registers as they are loaded — exactly — so a model gives the
 * same bits whichever dtype its weights are held in, and moves half the bytes through memory. */
#include "gpuworker/cpu_ops.h"

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>

#include "common/dtype.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* The fixed lane-reduction tree shared by both paths. */
static inline float reduce8(const float l[8])
{
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* Element i of a weight row in dtype wt, widened (exact). */
static inline float w_at(const void *w, size_t i, rekv_dtype wt)
{
    if (wt == REKV_DTYPE_F32)
        return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    return wt == REKV_DTYPE_F16 ? rekv_f16_to_f32(h) : rekv_bf16_to_f32(h);
}

static float dot_portable(const float *a, const void *b, rekv_dtype wt, int k)
{
    float l[8] = {0};
    int k8 = k & ~7;
    for (int t = 0; t < k8; t += 8)
        for (int j = 0; j < 8; j++)
            l[j] = fmaf(a[t + j], w_at(b, (size_t)(t + j), wt), l[j]);
    float s = reduce8(l);
    for (int t = k8; t < k; t++)
        s = fmaf(a[t], w_at(b, (size_t)t, wt), s);
    return s;
}

void cpu_gemm_rowinv_portable(float *y, const float *x, const float *w, int m, int n, int k)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            y[(size_t)i * n + j] =
                dot_portable(x + (size_t)i * k, w + (size_t)j * k, REKV_DTYPE_F32, k);
}

#if defined(__x86_64__)
/* Eight weights from element t of a row, widened in registers (exact). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256
load_w8(const void *w, size_t t, rekv_dtype wt)
{
    if (wt == REKV_DTYPE_F32)
        return _mm256_loadu_ps((const float *)w + t);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + t));
    if (wt == REKV_DTYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,fma,f16c"))) static inline float
finish_avx2(__m256 acc, const float *a, const void *b, rekv_dtype wt, int k8, int k)
{
    float l[8];
    _mm256_storeu_ps(l, acc);
    float s = reduce8(l);
    for (int t = k8; t < k; t++)
        s = fmaf(a[t], w_at(b, (size_t)t, wt), s);
    return s;
}

/* 4 rows of x against 3 rows of w per pass: 12 accumulators, each one element's dot product.
 * Inlined into one function per weight dtype, so the widening is decided at compile time. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
gemm_avx2_body(float *y, const float *x, const void *w, const rekv_dtype wt, int m, int n, int k,
               int ldy)
{
    enum { MR = 4, NR = 3, MB = 64 };
    size_t es = rekv_dtype_size(wt);
    int k8 = k & ~7;
    for (int i0 = 0; i0 < m; i0 += MB) { /* a block of x rows stays in cache while w streams */
        int i1 = i0 + MB < m ? i0 + MB : m;
        for (int j = 0; j < n; j += NR) {
            int nj = n - j < NR ? n - j : NR;
            const char *w0 = (const char *)w + (size_t)j * k * es;
            const char *w1 = nj > 1 ? w0 + (size_t)k * es : w0;
            const char *w2 = nj > 2 ? w0 + 2 * (size_t)k * es : w0;
            for (int i = i0; i < i1; i += MR) {
                int mi = i1 - i < MR ? i1 - i : MR;
                const float *xr[MR];
                for (int r = 0; r < MR; r++)
                    xr[r] = x + (size_t)(i + (r < mi ? r : 0)) * k;
                __m256 acc[MR][NR];
                for (int r = 0; r < MR; r++)
                    for (int c = 0; c < NR; c++)
                        acc[r][c] = _mm256_setzero_ps();
                for (int t = 0; t < k8; t += 8) {
                    __m256 b0 = load_w8(w0, (size_t)t, wt), b1 = load_w8(w1, (size_t)t, wt);
                    __m256 b2 = load_w8(w2, (size_t)t, wt);
                    for (int r = 0; r < MR; r++) {
                        __m256 a = _mm256_loadu_ps(xr[r] + t);
                        acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
                        acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
                    }
                }
                const void *wr[NR] = {w0, w1, w2};
                for (int r = 0; r < mi; r++)
                    for (int c = 0; c < nj; c++)
                        y[(size_t)(i + r) * ldy + j + c] =
                            finish_avx2(acc[r][c], xr[r], wr[c], wt, k8, k);
            }
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static void
gemm_avx2(float *y, const float *x, const void *w, rekv_dtype wt, int m, int n, int k, int ldy)
{
    if (wt == REKV_DTYPE_F16)
        gemm_avx2_body(y, x, w, REKV_DTYPE_F16, m, n, k, ldy);
    else if (wt == REKV_DTYPE_BF16)
        gemm_avx2_body(y, x, w, REKV_DTYPE_BF16, m, n, k, ldy);
    else
        gemm_avx2_body(y, x, w, REKV_DTYPE_F32, m, n, k, ldy);
}

static int have_avx2(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
#endif

/* Columns [j0, j1) of y (row stride n): the same elements whatever the split, so splitting the
 * columns across threads keeps the result bit-identical. */
typedef struct gemm_part {
    float *y;
    const float *x;
    const void *w;
    rekv_dtype wt;
    int m, n, k, j0, j1;
} gemm_part;

static void *gemm_part_run(void *arg)
{
    gemm_part *g = arg;
    size_t es = rekv_dtype_size(g->wt);
    const char *w = (const char *)g->w + (size_t)g->j0 * g->k * es;
    int nc = g->j1 - g->j0;
#if defined(__x86_64__)
    if (have_avx2()) {
        gemm_avx2(g->y + g->j0, g->x, w, g->wt, g->m, nc, g->k, g->n);
        return NULL;
    }
#endif
    for (int i = 0; i < g->m; i++)
        for (int j = 0; j < nc; j++)
            g->y[(size_t)i * g->n + g->j0 + j] =
                dot_portable(g->x + (size_t)i * g->k, w + (size_t)j * g->k * es, g->wt, g->k);
    return NULL;
}

void cpu_gemm_rowinv(float *y, const float *x, const void *w, rekv_dtype wt, const float *bias,
                     int m, int n, int k)
{
    /* large products use two threads, one per half of the output columns */
    int split = (double)m * n * k > 4e6 && n >= 64;
    gemm_part a = {y, x, w, wt, m, n, k, 0, split ? n / 2 : n};
    gemm_part b = {y, x, w, wt, m, n, k, n / 2, n};
    pthread_t t;
    int threaded = split && pthread_create(&t, NULL, gemm_part_run, &b) == 0;
    if (split && !threaded)
        a.j1 = n; /* no thread: do it all here */
    gemm_part_run(&a);
    if (threaded)
        pthread_join(t, NULL);
    if (bias)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++)
                y[(size_t)i * n + j] += bias[j];
}
