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
 * weights are widened to fp32 panel by panel — exactly — so a model gives the same bits whichever
 * dtype its weights are held in. */
#include "gpuworker/cpu_ops.h"

#include <errno.h>
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

static float dot_portable(const float *a, const float *b, int k)
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

void cpu_gemm_rowinv_portable(float *y, const float *x, const float *w, int m, int n, int k)
{
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            y[(size_t)i * n + j] = dot_portable(x + (size_t)i * k, w + (size_t)j * k, k);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static inline float finish_avx2(__m256 acc, const float *a,
                                                                    const float *b, int k8, int k)
{
    float l[8];
    _mm256_storeu_ps(l, acc);
    float s = reduce8(l);
    for (int t = k8; t < k; t++)
        s = fmaf(a[t], b[t], s);
    return s;
}

/* 4 rows of x against 3 rows of w per pass: 12 accumulators, each one element's dot product. */
__attribute__((target("avx2,fma"))) static void gemm_avx2(float *y, const float *x, const float *w,
                                                          int m, int n, int k, int ldy)
{
    enum { MR = 4, NR = 3, MB = 64 };
    int k8 = k & ~7;
    for (int i0 = 0; i0 < m; i0 += MB) { /* a block of x rows stays in cache while w streams */
        int i1 = i0 + MB < m ? i0 + MB : m;
        for (int j = 0; j < n; j += NR) {
            int nj = n - j < NR ? n - j : NR;
            const float *w0 = w + (size_t)j * k;
            const float *w1 = nj > 1 ? w0 + k : w0, *w2 = nj > 2 ? w0 + 2 * (size_t)k : w0;
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
                    __m256 b0 = _mm256_loadu_ps(w0 + t), b1 = _mm256_loadu_ps(w1 + t);
                    __m256 b2 = _mm256_loadu_ps(w2 + t);
                    for (int r = 0; r < MR; r++) {
                        __m256 a = _mm256_loadu_ps(xr[r] + t);
                        acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
                        acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
                        acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
                    }
                }
                const float *wr[NR] = {w0, w1, w2};
                for (int r = 0; r < mi; r++)
                    for (int c = 0; c < nj; c++)
                        y[(size_t)(i + r) * ldy + j + c] =
                            finish_avx2(acc[r][c], xr[r], wr[c], k8, k);
            }
        }
    }
}
#endif

/* Rows [j0, j1) of a 16-bit w converted to fp32 (exactly: every f16 and bf16 value is an fp32
 * value), so a 16-bit weight gives the same bits as its fp32 widening would. */
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) static void widen_f16_avx2(float *dst, const uint16_t *src,
                                                                size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = rekv_f16_to_f32(src[i]);
}
#endif

static void widen(float *dst, const void *src, rekv_dtype t, size_t n);

/* dot_portable with a 16-bit b widened 8 elements at a time into buf[8] (the same bits). */
static float dot_widen(const float *a, const void *b, rekv_dtype t, int k, float *buf)
{
    size_t es = rekv_dtype_size(t);
    float l[8] = {0};
    int k8 = k & ~7;
    for (int u = 0; u < k8; u += 8) {
        rekv_to_f32(buf, (const char *)b + (size_t)u * es, t, 8);
        for (int j = 0; j < 8; j++)
            l[j] = fmaf(a[u + j], buf[j], l[j]);
    }
    float s = reduce8(l);
    for (int u = k8; u < k; u++) {
        rekv_to_f32(buf, (const char *)b + (size_t)u * es, t, 1);
        s = fmaf(a[u], buf[0], s);
    }
    return s;
}

static void widen(float *dst, const void *src, rekv_dtype t, size_t n)
{
#if defined(__x86_64__)
    if (t == REKV_DTYPE_F16 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        widen_f16_avx2(dst, src, n);
        return;
    }
#endif
    rekv_to_f32(dst, src, t, n);
}

/* Columns [j0, j1) of y (row stride n): the same elements whatever the split, so splitting the
 * columns across threads keeps the result bit-identical. */
typedef struct gemm_part {
    float *y;
    const float *x;
    const void *w;
    rekv_dtype wt;
    int m, n, k, j0, j1;
} gemm_part;

static void gemm_cols(float *y, const float *x, const float *w, int m, int ncols, int k, int ldy)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        gemm_avx2(y, x, w, m, ncols, k, ldy);
        return;
    }
#endif
    for (int i = 0; i < m; i++)
        for (int j = 0; j < ncols; j++)
            y[(size_t)i * ldy + j] = dot_portable(x + (size_t)i * k, w + (size_t)j * k, k);
}

static void *gemm_part_run(void *arg)
{
    gemm_part *g = arg;
    if (g->wt == REKV_DTYPE_F32) {
        gemm_cols(g->y + g->j0, g->x, (const float *)g->w + (size_t)g->j0 * g->k, g->m,
                  g->j1 - g->j0, g->k, g->n);
        return NULL;
    }
    /* 16-bit weights: widen a panel of w rows (~1 MiB) at a time and run every x row over it */
    size_t es = rekv_dtype_size(g->wt);
    int panel = (int)((1u << 18) / (size_t)g->k);
    panel = panel < 3 ? 3 : panel - panel % 3;
    float *buf = malloc(sizeof(float) * (size_t)panel * (size_t)g->k);
    if (buf == NULL) { /* no memory: one row at a time through a small buffer, same bits */
        float row[8];
        for (int j = g->j0; j < g->j1; j++)
            for (int i = 0; i < g->m; i++)
                g->y[(size_t)i * g->n + j] =
                    dot_widen(g->x + (size_t)i * g->k, (const char *)g->w + (size_t)j * g->k * es,
                              g->wt, g->k, row);
        return NULL;
    }
    for (int j = g->j0; j < g->j1; j += panel) {
        int nc = g->j1 - j < panel ? g->j1 - j : panel;
        widen(buf, (const char *)g->w + (size_t)j * g->k * es, g->wt, (size_t)nc * g->k);
        gemm_cols(g->y + j, g->x, buf, g->m, nc, g->k, g->n);
    }
    free(buf);
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
