/* cpu_qgemm.c — the cpu backend's GEMM over quantized weights (GGUF blocks: Q8_0, Q4_0, Q4_K,
 * Q6_K), row-invariant, and its plain reference.
 *
 * The weights stay in their GGUF blocks in memory (a Q4_K matrix holds 0.5625 bytes a weight,
 * ~0.28 of its f16 bytes). A call dequantizes a tile of weight rows at a time — ggml's exact
 * values (loader/gguf_block.h's, the decoding the cuda kernels share, or the AVX2 versions here,
 * which make the same products with no fused multiply-add and are checked against it,
 * tests/test_qdecode.c) — into a small fp32 scratch of its thread (kept per thread), and runs
 * cpu_gemm.c's own tile kernel (cpu_gemm_rowinv_f32_cols) over it: every output element is
 * cpu_gemm_rowinv's dot product in its fixed order over the row's dequantized values, so a
 * quantized model's products are, bit for bit, those of the fp32 engine on its dequantized weights,
 * whatever the rows, the company and the threads (tests/test_gguf_qgemm.c,
 * tests/test_gguf_quant.c).
 *
 * Why dequantize the weights rather than round the activations to 8-bit blocks as llama.cpp's
 * vec_dot does: the fp32 products stay exact (llama.cpp's ggml rounding moves the synthetic
 * quantized files' logits by up to ~0.1, ../shared/gguf/README.md section 5), the engine's
 * row-invariance and the exact modes' bit-equality hold unchanged, and a decode step is bound by
 * reading the weights, which this path reads once at their quantized size; the cost is the
 * dequantization's arithmetic (a prefill tile's is shared by all its rows), and an integer dot
 * product (VNNI) would be faster at prefill. Columns split among cpu_gemm's worker pool as its
 * own GEMM's do; the split never changes a bit. */
#include "gpuworker/cpu_qgemm.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "gpuworker/cpu_ops.h"
#include "loader/gguf.h"
#include "loader/gguf_block.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

size_t cpu_qgemm_row_bytes(uint32_t type, int k)
{
    uint32_t be, bb;
    rekv_ggml_type_block(type, &be, &bb);
    return be ? (size_t)k / be * bb : 0;
}

/* ---------------------------------------------------------------- dequantization, AVX2 */

#if defined(__x86_64__)
/* No "fma" in the target: the compiler may not fuse a multiply and an add here (the build's
 * gnu11 allows contraction), so each value is gguf_quant.c's two roundings. */
#define DEQ_FN __attribute__((target("avx2,f16c")))

/* F16C's conversion: exact, as rekv_f16_to_f32 is, without its call per block. */
__attribute__((target("f16c"), always_inline)) static inline float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

DEQ_FN static void deq8_q8_0(const uint8_t *b, uint64_t nb, float *y)
{
    for (uint64_t i = 0; i < nb; i++, b += 34, y += 32) {
        __m256 d = _mm256_set1_ps(f16_at(b));
        for (int c = 0; c < 4; c++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c));
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            _mm256_storeu_ps(y + 8 * c, _mm256_mul_ps(v, d));
        }
    }
}

DEQ_FN static void deq8_q4_0(const uint8_t *b, uint64_t nb, float *y)
{
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    const __m256i eight = _mm256_set1_epi32(8);
    for (uint64_t i = 0; i < nb; i++, b += 18, y += 32) {
        __m256 d = _mm256_set1_ps(f16_at(b));
        __m128i v = _mm_loadu_si128((const __m128i *)(b + 2));
        __m128i half[2] = {_mm_and_si128(v, lo4), _mm_and_si128(_mm_srli_epi16(v, 4), lo4)};
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 2; c++) {
                __m128i q = c ? _mm_srli_si128(half[h], 8) : half[h];
                __m256i qi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), eight);
                _mm256_storeu_ps(y + 16 * h + 8 * c, _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d));
            }
    }
}

DEQ_FN static void deq8_q4_k(const uint8_t *b, uint64_t nb, float *y)
{
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (uint64_t i = 0; i < nb; i++, b += 144) {
        const uint8_t *q = b + 16;
        for (int j = 0; j < 8; j += 2, q += 32) {
            for (int h = 0; h < 2; h++) { /* sub-block j + h: low nibbles, then high */
                float d1, m1;
                rekv_qb_q4_k_sub(b, j + h, &d1, &m1);
                __m256 dv = _mm256_set1_ps(d1), mv = _mm256_set1_ps(m1);
                for (int c = 0; c < 2; c++) {
                    __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * c));
                    v = _mm_and_si128(h ? _mm_srli_epi16(v, 4) : v, lo4);
                    for (int e = 0; e < 2; e++) {
                        __m128i qq = e ? _mm_srli_si128(v, 8) : v;
                        __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qq));
                        _mm256_storeu_ps(y + 16 * c + 8 * e,
                                         _mm256_sub_ps(_mm256_mul_ps(dv, f), mv));
                    }
                }
                y += 32;
            }
        }
    }
}

DEQ_FN static void deq8_q6_k(const uint8_t *b, uint64_t nb, float *y)
{
    const __m256i m4 = _mm256_set1_epi32(0xF), m3 = _mm256_set1_epi32(3),
                  off = _mm256_set1_epi32(32);
    for (uint64_t i = 0; i < nb; i++, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = f16_at(b + 208);
        for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l += 8) {
                int is = l / 16;
                __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + l)));
                __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + l + 32)));
                __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + l)));
                __m256i q[4] = {
                    _mm256_or_si256(_mm256_and_si256(a, m4),
                                    _mm256_slli_epi32(_mm256_and_si256(h, m3), 4)),
                    _mm256_or_si256(
                        _mm256_and_si256(c, m4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 2), m3), 4)),
                    _mm256_or_si256(
                        _mm256_srli_epi32(a, 4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4), m3), 4)),
                    _mm256_or_si256(
                        _mm256_srli_epi32(c, 4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 6), m3), 4))};
                for (int g = 0; g < 4; g++) {
                    __m256 ds = _mm256_set1_ps(d * sc[is + 2 * g]);
                    __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[g], off));
                    _mm256_storeu_ps(y + l + 32 * g, _mm256_mul_ps(ds, f));
                }
            }
        }
    }
}

static int have_avx2(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

typedef void (*deq_fn)(const uint8_t *b, uint64_t nb, float *y);

static deq_fn deq_of(uint32_t type)
{
    return type == REKV_GGML_Q8_0   ? deq8_q8_0
           : type == REKV_GGML_Q4_0 ? deq8_q4_0
           : type == REKV_GGML_Q4_K ? deq8_q4_k
           : type == REKV_GGML_Q6_K ? deq8_q6_k
                                    : NULL;
}

#endif

void cpu_qgemm_dequant_rows(uint32_t type, const void *w, size_t row_bytes, int rows, int k,
                            float *dst)
{
    const uint8_t *src = (const uint8_t *)w;
#if defined(__x86_64__)
    if (have_avx2()) {
        deq_fn f = deq_of(type);
        if (f) {
            uint64_t nb =
                (uint64_t)k / (type == REKV_GGML_Q4_K || type == REKV_GGML_Q6_K ? 256 : 32);
            for (int r = 0; r < rows; r++)
                f(src + (size_t)r * row_bytes, nb, dst + (size_t)r * k);
            return;
        }
    }
#endif
    for (int r = 0; r < rows; r++)
        (void)rekv_ggml_dequant_row(type, src + (size_t)r * row_bytes, (uint64_t)k,
                                    dst + (size_t)r * k);
}

/* ---------------------------------------------------------------- the GEMM */

enum { QG_CHUNKS_PER_THREAD = 4, QG_SCRATCH_FLOATS = 16384 };

/* Each thread's scratch for dequantized rows, grown on demand and freed when the thread exits
 * (pool workers live for the process; callers may be short-lived stream threads). */
typedef struct qscratch {
    size_t cap;
    float *p;
} qscratch;

static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;
static int g_scratch_key_ok;

static void scratch_free(void *v)
{
    qscratch *s = v;
    free(s->p);
    free(s);
}

static void scratch_key_init(void)
{
    g_scratch_key_ok = pthread_key_create(&g_scratch_key, scratch_free) == 0;
}

/* The calling thread's scratch of at least floats, or NULL when memory is short. */
static float *thread_scratch(size_t floats)
{
    pthread_once(&g_scratch_once, scratch_key_init);
    if (!g_scratch_key_ok)
        return NULL;
    qscratch *s = pthread_getspecific(g_scratch_key);
    if (s == NULL) {
        if ((s = calloc(1, sizeof(*s))) == NULL)
            return NULL;
        if (pthread_setspecific(g_scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->cap < floats) {
        float *p = malloc(floats * sizeof(float));
        if (p == NULL)
            return NULL;
        free(s->p);
        s->p = p;
        s->cap = floats;
    }
    return s->p;
}

typedef struct qgemm_job {
    float *y;
    const float *x;
    const uint8_t *w;
    uint32_t type;
    const float *bias;
    int m, n, k, tile, chunks;
    size_t row_bytes;
} qgemm_job;

/* Without scratch (memory short): the same dot products, a block dequantized on the stack at a
 * time for each output element; slow, but the same bits and nothing to fail. */
static void chunk_unbuffered(const qgemm_job *g, int j0, int j1)
{
    uint32_t be, bb;
    rekv_ggml_type_block(g->type, &be, &bb);
    float blk[256];
    for (int i = 0; i < g->m; i++)
        for (int j = j0; j < j1; j++) {
            const float *a = g->x + (size_t)i * g->k;
            const uint8_t *w = g->w + (size_t)j * g->row_bytes;
            float l[8] = {0};
            for (int t0 = 0; t0 < g->k; t0 += (int)be, w += bb) {
                (void)rekv_ggml_dequant_row(g->type, w, be, blk);
                for (int t = 0; t < (int)be; t += 8)
                    for (int c = 0; c < 8; c++)
                        l[c] = fmaf(a[t0 + t + c], blk[t + c], l[c]);
            }
            g->y[(size_t)i * g->n + j] = reduce8(l); /* whole blocks: no k % 8 tail */
        }
}

static void qgemm_chunk(void *arg, int p, int slot)
{
    (void)slot;
    const qgemm_job *g = arg;
    /* boundaries on whole tiles: speed only */
    int tiles = (g->n + g->tile - 1) / g->tile;
    int j0 = (int)((long)tiles * p / g->chunks) * g->tile;
    int j1 = (int)((long)tiles * (p + 1) / g->chunks) * g->tile;
    j1 = j1 < g->n ? j1 : g->n;
    float *buf = thread_scratch((size_t)g->tile * (size_t)g->k);
    if (buf == NULL)
        chunk_unbuffered(g, j0, j1);
    for (int j = j0; j < j1 && buf; j += g->tile) {
        int nr = j1 - j < g->tile ? j1 - j : g->tile;
        cpu_qgemm_dequant_rows(g->type, g->w + (size_t)j * g->row_bytes, g->row_bytes, nr, g->k,
                               buf);
        cpu_gemm_rowinv_f32_cols(g->y + j, g->n, g->x, buf, g->m, nr, g->k);
    }
    if (g->bias)
        for (int i = 0; i < g->m; i++)
            for (int j = j0; j < j1; j++)
                g->y[(size_t)i * g->n + j] += g->bias[j];
}

int cpu_qgemm_rowinv(float *y, const float *x, const void *w, uint32_t type, const float *bias,
                     int m, int n, int k)
{
    uint32_t be, bb;
    rekv_ggml_type_block(type, &be, &bb);
    if (!rekv_ggml_type_dequantizable(type))
        return -ENOTSUP;
    if (k <= 0 || (uint32_t)k % be != 0 || m <= 0 || n <= 0)
        return -EINVAL;
    /* a tile of weight rows fills ~64 KiB of fp32 (L2), in whole blocks of 8 rows */
    int tile = QG_SCRATCH_FLOATS / k / 8 * 8;
    tile = tile < 8 ? 8 : tile > 64 ? 64 : tile;
    int threads = cpu_gemm_threads(), tiles = (n + tile - 1) / tile;
    int chunks = threads * QG_CHUNKS_PER_THREAD;
    chunks = chunks < tiles ? chunks : tiles;
    if (threads < 2 || chunks < 2 || (double)m * n * k < CPU_POOL_MIN_MACS)
        threads = chunks = 1;
    qgemm_job g = {y, x, w, type, bias, m, n, k, tile, chunks, (size_t)k / be * bb};
    if (chunks == 1)
        qgemm_chunk(&g, 0, 0);
    else
        cpu_pool_run(qgemm_chunk, &g, chunks, threads);
    return 0;
}
