/* cpu_ops.c — see cpu_ops.h. Plain loops the compiler vectorises (the GEMM is cpu_gemm.c's). */
#include "gpuworker/cpu_ops.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

void cpu_norm(float *out, const float *in, const float *w, const float *b, int m, int d, float eps)
{
    for (int i = 0; i < m; i++) {
        const float *x = in + (size_t)i * d;
        float *y = out + (size_t)i * d;
        if (b) {
            float mean = 0;
            for (int j = 0; j < d; j++)
                mean += x[j];
            mean /= (float)d;
            float var = 0;
            for (int j = 0; j < d; j++)
                var += (x[j] - mean) * (x[j] - mean);
            var /= (float)d;
            float inv = 1.0f / sqrtf(var + eps);
            for (int j = 0; j < d; j++)
                y[j] = (x[j] - mean) * inv * w[j] + b[j];
        } else {
            float ss = 0;
            for (int j = 0; j < d; j++)
                ss += x[j] * x[j];
            float inv = 1.0f / sqrtf(ss / (float)d + eps);
            for (int j = 0; j < d; j++)
                y[j] = w[j] * (x[j] * inv);
        }
    }
}

void cpu_layernorm(float *x, const float *w, const float *b, int m, int d, float eps)
{
    cpu_norm(x, x, w, b, m, d, eps);
}

void cpu_rmsnorm(float *x, const float *w, int m, int d, float eps)
{
    cpu_norm(x, x, w, NULL, m, d, eps);
}

void cpu_rope_table(float *cos_t, float *sin_t, const int *pos, int m, const rekv_rope_freqs *f)
{
    int half = f->half;
    float dyn[REKV_ROPE_MAX_PAIRS];
    for (int i = 0; i < m; i++) {
        const float *inv_freq = f->inv_freq;
        if (pos[i] >= f->dyn_from || pos[i] >= f->long_from) { /* dynamic NTK, longrope's long */
            rekv_rope_freqs_at(f, pos[i], dyn);
            inv_freq = dyn;
        }
        /* attn_factor is 1 but for YaRN, and x * 1.0f is exact: plain RoPE keeps its bits */
        for (int j = 0; j < half; j++) {
            float a = (float)pos[i] * inv_freq[j];
            cos_t[(size_t)i * half + j] = cosf(a) * f->attn_factor;
            sin_t[(size_t)i * half + j] = sinf(a) * f->attn_factor;
        }
    }
}

void cpu_rope(float *x, const float *cos_t, const float *sin_t, int m, int n_heads, int head_dim,
              rekv_rope style)
{
    int half = head_dim / 2;
    for (int i = 0; i < m; i++) {
        const float *c = cos_t + (size_t)i * half, *s = sin_t + (size_t)i * half;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)i * n_heads + h) * head_dim;
            for (int j = 0; j < half; j++) {
                /* adjacent pairs (x[2j], x[2j+1]) or halves (x[j], x[j+half]) */
                float *a = style == REKV_ROPE_ADJACENT ? &v[2 * j] : &v[j];
                float *b = style == REKV_ROPE_ADJACENT ? &v[2 * j + 1] : &v[j + half];
                float x0 = *a, x1 = *b;
                *a = x0 * c[j] - x1 * s[j];
                *b = x0 * s[j] + x1 * c[j];
            }
        }
    }
}

void cpu_activation(float *a, const float *b, size_t n, rekv_act act)
{
    switch (act) {
    case REKV_ACT_RELU:
        for (size_t i = 0; i < n; i++)
            a[i] = a[i] > 0 ? a[i] : 0;
        break;
    case REKV_ACT_GELU:
        for (size_t i = 0; i < n; i++)
            a[i] = 0.5f * a[i] * (1.0f + erff(a[i] * 0.70710678118654752f));
        break;
    case REKV_ACT_SILU:
        for (size_t i = 0; i < n; i++) {
            float s = a[i] / (1.0f + expf(-a[i]));
            a[i] = b ? s * b[i] : s;
        }
        break;
    case REKV_ACT_GELU_TANH: /* PyTorch's approximate="tanh": sqrt(2/pi) (x + 0.044715 x^3) */
        for (size_t i = 0; i < n; i++) {
            float x = a[i], inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
            float g = 0.5f * x * (1.0f + tanhf(inner));
            a[i] = b ? g * b[i] : g;
        }
        break;
    }
}

void cpu_scale(float *x, size_t n, float a)
{
    for (size_t i = 0; i < n; i++)
        x[i] *= a;
}

void cpu_softcap(float *x, size_t n, float cap)
{
    for (size_t i = 0; i < n; i++)
        x[i] = tanhf(x[i] / cap) * cap;
}

/* The row at element index i of a cache in dtype dt as fp32: the row itself, or widened into buf
 * (an int8/int4 row dequantized: one row at a time, never a copy of the context). */
static inline const float *cache_row(const void *kv, size_t i, int hd, rekv_dtype dt, float *buf)
{
    const void *r = (const char *)kv + rekv_kv_off(i, hd, rekv_kv_row_bytes(dt, hd));
    if (dt == REKV_DTYPE_F32)
        return r;
    rekv_kv_row_to_f32(buf, r, dt, hd);
    return buf;
}

/* cpu_attention's work is cut into units — one sequence, one KV head and as many of its query rows
 * as keep the unit within ATT_QUERIES queries (the group's heads per row; at least one row) — that
 * share each K and V row, widened once; the pool runs them. Keys go in tiles of ATT_TILE,
 * transposed, so that the dot products of a tile run in vector lanes, one key per lane, each the
 * sequential sum over the head dimension that a scalar loop makes: the same bits, 8 at a time. */
enum { ATT_TILE = 64, ATT_QUERIES = 16, ATT_CHUNKS_PER_THREAD = 8 };
#define ATT_SLOT_FLOATS (1u << 18) /* a thread's scores scratch: ATT_QUERIES * context, capped */

typedef float att_v8 __attribute__((vector_size(32)));
typedef int32_t att_i8 __attribute__((vector_size(32)));
typedef uint32_t att_u8 __attribute__((vector_size(32)));

/* cpu_expf's steps (Cephes' expf: n = round(x log2 e) by the 1.5 * 2^23 trick, r = x - n ln 2 in
 * two parts, e^r = 1 + r + r^2 P(r), P of degree 5, times 2^n in the exponent bits). Above EXP_HI
 * the answer is +inf, below EXP_LO 0: from there on n = -126 needs e^r >= 1 to stay normal. */
#define EXP_HI 88.0f
#define EXP_LO (-87.0f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_ROUND 12582912.0f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* The steps cpu_expf and its lanes share, on x a float or an att_v8 (n, r, p of its type; all
 * four plain variables): n = round(x log2 e), r = x - n ln 2, p = e^r. One text, so the same
 * operations in the same order. */
#define EXP_REDUCE_POLY(x, n, r, p)                                                                \
    do {                                                                                           \
        n = x * EXP_LOG2E + EXP_ROUND;                                                             \
        n = n - EXP_ROUND;                                                                         \
        r = x - n * EXP_LN2_HI;                                                                    \
        r = r - n * EXP_LN2_LO;                                                                    \
        p = EXP_P0 * r + EXP_P1;                                                                   \
        p = p * r + EXP_P2;                                                                        \
        p = p * r + EXP_P3;                                                                        \
        p = p * r + EXP_P4;                                                                        \
        p = p * r + EXP_P5;                                                                        \
        p = p * (r * r) + r + 1.0f;                                                                \
    } while (0)

float cpu_expf(float x)
{
    if (x != x)
        return x;
    if (x > EXP_HI)
        return INFINITY;
    if (x < EXP_LO)
        return 0.0f;
    float n, r, p;
    EXP_REDUCE_POLY(x, n, r, p);
    uint32_t b;
    memcpy(&b, &p, sizeof(b));
    b += (uint32_t)(int32_t)n << 23;
    memcpy(&p, &b, sizeof(b));
    return p;
}

/* a where mask m is set, else b (att_v8s; m an att_i8 of comparisons) */
#define ATT_SEL(m, a, b) ((att_v8)(((att_i8)(a) & (m)) | ((att_i8)(b) & ~(m))))

/* cpu_expf in 8 lanes, in place, for x <= 0 or NaN (a softmax's): the same operations, so the
 * same bits in each */
static inline __attribute__((always_inline)) void att_exp8(float *xs)
{
    att_v8 x;
    memcpy(&x, xs, sizeof(x));
    const att_v8 zero = {0}, lo = zero + EXP_LO;
    att_i8 nan = x != x, under = x < lo;
    att_v8 xc = ATT_SEL(under, lo, ATT_SEL(nan, zero, x)), n, r, p;
    EXP_REDUCE_POLY(xc, n, r, p);
    att_u8 b = (att_u8)p + ((att_u8) __builtin_convertvector(n, att_i8) << 23);
    p = ATT_SEL(under, zero, (att_v8)b);
    p = ATT_SEL(nan, x, p);
    memcpy(xs, &p, sizeof(p));
}

double cpu_cosine(const float *a, const float *b, int n)
{
    double ab = 0, aa = 0, bb = 0;
    for (int i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    return aa > 0 && bb > 0 ? ab / sqrt(aa * bb) : 0;
}

/* Built for AVX2 and for the baseline, picked at load (an ifunc): the same bits either way. */
__attribute__((target_clones("avx2", "default"))) float cpu_softmax_exp(float *e, const float *s,
                                                                        int n, float *max)
{
    float mx = -INFINITY, sum = 0;
    int i = 0;
    att_v8 m8 = {0}, s8 = {0}, v;
    m8 += -INFINITY;
    for (; i + 8 <= n; i += 8) {
        memcpy(&v, s + i, sizeof(v));
        m8 = ATT_SEL(v > m8, v, m8);
    }
    for (int l = 0; l < 8; l++)
        mx = m8[l] > mx ? m8[l] : mx;
    for (; i < n; i++)
        mx = s[i] > mx ? s[i] : mx;
    for (i = 0; i + 8 <= n; i += 8) {
        memcpy(&v, s + i, sizeof(v));
        v -= mx;
        memcpy(e + i, &v, sizeof(v));
        att_exp8(e + i);
        memcpy(&v, e + i, sizeof(v));
        s8 += v;
    }
    for (; i < n; i++) {
        e[i] = cpu_expf(s[i] - mx);
        s8[i % 8] += e[i];
    }
    for (int l = 0; l < 8; l++)
        sum += s8[l];
    if (max)
        *max = mx;
    return sum;
}

typedef struct att_call {
    float *out;
    const float *q;
    const rekv_attn_seq *seqs;
    const int *first; /* [n_seqs + 1]: each sequence's first unit */
    int n_heads, n_kv, hd, rows_per_unit, units, chunks;
    rekv_dtype dt;
    float *scratch; /* per slot: cap * ctx floats */
    size_t slot_floats;
    int cap; /* queries whose scores a slot holds at once */
} att_call;

/* kt[j * ATT_TILE + tt] = element j of KV head g's K row at position t + tt, widened, for tt <
 * w (a multiple of 8, at most ATT_TILE); 0 past nt */
static void att_tile_portable(float *kt, const void *kv, rekv_dtype dt, int n_kv, int hd, int g,
                              int t, int nt, float *buf, int w)
{
    for (int tt = 0; tt < w; tt++) {
        const float *kr =
            tt < nt ? cache_row(kv, rekv_kv_row(n_kv, hd, g, t + tt), hd, dt, buf) : NULL;
        for (int j = 0; j < hd; j++)
            kt[j * ATT_TILE + tt] = kr ? kr[j] : 0.0f;
    }
}

#if defined(__x86_64__)
/* The same in 8x8 transposes in registers (an fp16 cache widened by F16C, exactly). */
__attribute__((target("avx2,f16c"))) static void att_tile_avx2(float *kt, const void *kv,
                                                               rekv_dtype dt, int n_kv, int hd,
                                                               int g, int t, int nt, float *buf,
                                                               int w)
{
    if ((dt != REKV_DTYPE_F32 && dt != REKV_DTYPE_F16) || hd % 8 != 0) {
        att_tile_portable(kt, kv, dt, n_kv, hd, g, t, nt, buf, w);
        return;
    }
    size_t es = rekv_dtype_size(dt);
    for (int t8 = 0; t8 < w; t8 += 8) {
        const char *row[8];
        for (int i = 0; i < 8; i++)
            row[i] =
                t8 + i < nt ? (const char *)kv + rekv_kv_row(n_kv, hd, g, t + t8 + i) * es : NULL;
        for (int j = 0; j < hd; j += 8) {
            __m256 r[8], u[8], v[8];
            for (int i = 0; i < 8; i++)
                r[i] = row[i] == NULL         ? _mm256_setzero_ps()
                       : dt == REKV_DTYPE_F16 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                                    (const __m128i *)(row[i] + (size_t)j * 2)))
                                              : _mm256_loadu_ps((const float *)row[i] + j);
            for (int i = 0; i < 8; i += 2) {
                u[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                u[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                v[i] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
                v[i + 1] = _mm256_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
                v[i + 2] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
                v[i + 3] = _mm256_shuffle_ps(u[i + 1], u[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
            }
            for (int l = 0; l < 4; l++) { /* column l from the low halves, l + 4 the high */
                _mm256_storeu_ps(kt + (size_t)(j + l) * ATT_TILE + t8,
                                 _mm256_permute2f128_ps(v[l], v[l + 4], 0x20));
                _mm256_storeu_ps(kt + (size_t)(j + l + 4) * ATT_TILE + t8,
                                 _mm256_permute2f128_ps(v[l], v[l + 4], 0x31));
            }
        }
    }
}
#endif

/* The tile of keys t.. (nt of them, w lanes) of KV head g: att_tile_avx2 or att_tile_portable */
static inline __attribute__((always_inline)) void att_tile(float *kt, const att_call *a,
                                                           const rekv_attn_seq *sq, int g, int t,
                                                           int nt, float *buf, int w, int avx2)
{
#if defined(__x86_64__)
    if (avx2) {
        att_tile_avx2(kt, sq->kv, a->dt, a->n_kv, a->hd, g, t, nt, buf, w);
        return;
    }
#else
    (void)avx2;
#endif
    att_tile_portable(kt, sq->kv, a->dt, a->n_kv, a->hd, g, t, nt, buf, w);
}

/* Query q's scores of the tile's nt keys into sc: in lane tt % 8 of acc[tt / 8] key tt's sequential
 * sum over the head dimension, times the scale, then the soft-cap (Gemma-2: tanh(s / c) * c, as
 * HF's eager attention). */
static inline __attribute__((always_inline)) void att_scores(float *sc, const float *kt,
                                                             const float *q, int hd, int w, int nt,
                                                             float scale, float softcap)
{
    att_v8 acc[ATT_TILE / 8] = {0};
    for (int j = 0; j < hd; j++) {
        float qj = q[j];
#pragma GCC unroll 8
        for (int i = 0; i < w / 8; i++) {
            att_v8 kv;
            memcpy(&kv, kt + j * ATT_TILE + 8 * i, sizeof(kv));
            acc[i] += qj * kv;
        }
    }
    for (int tt = 0; tt < nt; tt++)
        sc[tt] = acc[tt / 8][tt % 8] * scale;
    if (softcap > 0)
        for (int tt = 0; tt < nt; tt++)
            sc[tt] = tanhf(sc[tt] / softcap) * softcap;
}

/* oh[j] += p * vt[j], 8 lanes at a time (two SSE halves without AVX2) */
static inline __attribute__((always_inline)) void att_axpy(float *oh, const float *vt, float p,
                                                           int hd)
{
    int j = 0;
    for (; j + 8 <= hd; j += 8) {
        att_v8 o, v;
        memcpy(&o, oh + j, sizeof(o));
        memcpy(&v, vt + j, sizeof(v));
        o += p * v;
        memcpy(oh + j, &o, sizeof(o));
    }
    for (; j < hd; j++)
        oh[j] += p * vt[j];
}

/* Unit queries k0..k0+nq-1 of rows r0.. of sequence sq, KV head g: query k is row r0 + k / group,
 * head g * group + k % group. */
static inline __attribute__((always_inline)) void att_unit_body(const att_call *a,
                                                                const rekv_attn_seq *sq, int g,
                                                                int r0, int nq, float *scores,
                                                                int cap, int avx2)
{
    int hd = a->hd, n_kv = a->n_kv, group = a->n_heads / a->n_kv;
    size_t qd = (size_t)a->n_heads * (size_t)hd, vs = rekv_kv_v_shift(n_kv, hd);
    float scale = sq->scale > 0 ? sq->scale : 1.0f / sqrtf((float)hd);
    float softcap = sq->softcap;
    int t0 = sq->skip ? sq->skip[g] : 0;
    float kt[hd * ATT_TILE], buf[hd], inv[cap];
    for (int q0 = 0; q0 < nq; q0 += cap) {
        int nb = nq - q0 < cap ? nq - q0 : cap;
        int tend = sq->start + r0 + (q0 + nb - 1) / group + 1; /* the batch's longest context */
        const float *qv[nb];
        float *ov[nb];
        int nctx[nb], lo[nb];
        for (int k = 0; k < nb; k++) {
            int r = r0 + (q0 + k) / group, h = g * group + (q0 + k) % group;
            qv[k] = a->q + ((size_t)(sq->row0 + r)) * qd + (size_t)h * hd;
            ov[k] = a->out + ((size_t)(sq->row0 + r)) * qd + (size_t)h * hd;
            nctx[k] = sq->start + r + 1; /* causal: positions 0..start+r */
            /* a sliding window: positions start+r-W+1..start+r (the softmax's lanes from lo) */
            lo[k] = sq->window > 0 && nctx[k] - sq->window > t0 ? nctx[k] - sq->window : t0;
        }
        for (int t = lo[0]; t < tend; t += ATT_TILE) { /* lo[0]: the batch's first key */
            int nt = tend - t < ATT_TILE ? tend - t : ATT_TILE;
            att_tile(kt, a, sq, g, t, nt, buf, ATT_TILE, avx2);
            for (int k = 0; k < nb; k++)
                att_scores(scores + (size_t)k * tend + t, kt, qv[k], hd, ATT_TILE, nt, scale,
                           softcap);
        }
        for (int k = 0; k < nb; k++) {
            float *sc = scores + (size_t)k * tend + lo[k];
            float sum = cpu_softmax_exp(sc, sc, nctx[k] - lo[k], NULL);
            inv[k] = 1.0f / sum;
            memset(ov[k], 0, sizeof(float) * (size_t)hd);
        }
        for (int t = lo[0]; t < tend; t++) {
            const float *vt = cache_row(sq->kv, rekv_kv_row(n_kv, hd, g, t) + vs, hd, a->dt, buf);
            for (int k = 0; k < nb; k++) {
                if (t >= nctx[k] || t < lo[k])
                    continue;
                att_axpy(ov[k], vt, scores[(size_t)k * tend + t] * inv[k], hd);
            }
        }
    }
}

static void att_unit_portable(const att_call *a, const rekv_attn_seq *sq, int g, int r0, int nq,
                              float *scores, int cap)
{
    att_unit_body(a, sq, g, r0, nq, scores, cap, 0);
}

#if defined(__x86_64__)
/* the same loops in AVX2's 8 lanes (no FMA: a multiply and an add, each rounded, as above) */
__attribute__((target("avx2,f16c"))) static void att_unit_avx2(const att_call *a,
                                                               const rekv_attn_seq *sq, int g,
                                                               int r0, int nq, float *scores,
                                                               int cap)
{
    att_unit_body(a, sq, g, r0, nq, scores, cap, 1);
}
#endif

/* A decode row (sq->n == 1): the queries of KV heads ga..gb-1 ((gb - ga) * group of them, at most
 * cap), block by block of the cache across the heads: a block's K rows of those heads lie together,
 * and so do its V rows (kvlayout.h), where att_unit_body reads one head's 16 rows of a block and
 * jumps to the next block — per head, runs of 16 rows 2 n_kv runs apart, on which the hardware's
 * prefetchers start cold again and again (a decode step's attention read its cache at ~6 GB/s on
 * this 2-core machine, where the same bytes block by block read at ~18 GB/s). Every query's
 * numbers are att_unit_body's: each score the same sequential sum over the head dimension (a
 * key's lane of its block's tile), the same softmax over the same slots, each output the sum over
 * t ascending. */
static inline __attribute__((always_inline)) void att_sweep_body(const att_call *a,
                                                                 const rekv_attn_seq *sq, int ga,
                                                                 int gb, float *scores, int avx2)
{
    enum { B = REKV_KV_ROWS_PER_BLOCK };
    int hd = a->hd, n_kv = a->n_kv, group = a->n_heads / a->n_kv, nq = (gb - ga) * group;
    size_t qd = (size_t)a->n_heads * (size_t)hd, vs = rekv_kv_v_shift(n_kv, hd);
    float scale = sq->scale > 0 ? sq->scale : 1.0f / sqrtf((float)hd);
    float softcap = sq->softcap;
    int tend = sq->start + 1, first = tend; /* the row's context: positions 0..start */
    float kt[hd * ATT_TILE], buf[hd], inv[nq];
    const float *qv[nq];
    float *ov[nq];
    int lo[nq];
    for (int k = 0; k < nq; k++) {
        int g = ga + k / group, h = g * group + k % group, t0 = sq->skip ? sq->skip[g] : 0;
        qv[k] = a->q + (size_t)sq->row0 * qd + (size_t)h * hd;
        ov[k] = a->out + (size_t)sq->row0 * qd + (size_t)h * hd;
        lo[k] = sq->window > 0 && tend - sq->window > t0 ? tend - sq->window : t0;
        first = lo[k] < first ? lo[k] : first;
    }
    for (int tb = first - first % B; tb < tend; tb += B) {
        int nt = tend - tb < B ? tend - tb : B;
        for (int g = ga; g < gb; g++) {
            int k0 = (g - ga) * group;
            if (tb + nt <= lo[k0]) /* the block is before the head's first slot */
                continue;
            att_tile(kt, a, sq, g, tb, nt, buf, B, avx2);
            for (int k = k0; k < k0 + group; k++)
                att_scores(scores + (size_t)k * tend + tb, kt, qv[k], hd, B, nt, scale, softcap);
        }
    }
    for (int k = 0; k < nq; k++) {
        float *sc = scores + (size_t)k * tend + lo[k];
        inv[k] = 1.0f / cpu_softmax_exp(sc, sc, tend - lo[k], NULL);
        memset(ov[k], 0, sizeof(float) * (size_t)hd);
    }
    for (int tb = first - first % B; tb < tend; tb += B)
        for (int g = ga; g < gb; g++) {
            int k0 = (g - ga) * group, t1 = tb + B < tend ? tb + B : tend;
            for (int t = tb > lo[k0] ? tb : lo[k0]; t < t1; t++) {
                const float *vt =
                    cache_row(sq->kv, rekv_kv_row(n_kv, hd, g, t) + vs, hd, a->dt, buf);
                for (int k = k0; k < k0 + group; k++)
                    att_axpy(ov[k], vt, scores[(size_t)k * tend + t] * inv[k], hd);
            }
        }
}

static void att_sweep_portable(const att_call *a, const rekv_attn_seq *sq, int ga, int gb,
                               float *scores)
{
    att_sweep_body(a, sq, ga, gb, scores, 0);
}

#if defined(__x86_64__)
/* the same in AVX2's 8 lanes (no FMA), as att_unit_avx2 */
__attribute__((target("avx2,f16c"))) static void att_sweep_avx2(const att_call *a,
                                                                const rekv_attn_seq *sq, int ga,
                                                                int gb, float *scores)
{
    att_sweep_body(a, sq, ga, gb, scores, 1);
}
#endif

static void att_chunk(void *arg, int c, int slot)
{
    const att_call *a = arg;
    int group = a->n_heads / a->n_kv;
    int u0 = (int)((long)a->units * c / a->chunks),
        u1 = (int)((long)a->units * (c + 1) / a->chunks);
    float *scores = a->scratch + (size_t)slot * a->slot_floats;
    void (*unit)(const att_call *, const rekv_attn_seq *, int, int, int, float *, int) =
        att_unit_portable;
    void (*sweep)(const att_call *, const rekv_attn_seq *, int, int, float *) =
        att_sweep_portable;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        unit = att_unit_avx2;
        sweep = att_sweep_avx2;
    }
#endif
    int i = 0, heads = a->cap / group; /* the KV heads whose scores a sweep's scratch holds */
    for (int u = u0; u < u1;) {
        while (u >= a->first[i + 1])
            i++;
        const rekv_attn_seq *sq = &a->seqs[i];
        int blocks = (sq->n + a->rows_per_unit - 1) / a->rows_per_unit, local = u - a->first[i];
        int g = local / blocks, r0 = local % blocks * a->rows_per_unit;
        if (sq->n == 1 && heads > 0) { /* a decode row: its heads in this chunk, swept */
            int gb = g + heads < a->n_kv ? g + heads : a->n_kv;
            gb = gb - g > u1 - u ? g + (u1 - u) : gb;
            sweep(a, sq, g, gb, scores);
            u += gb - g;
            continue;
        }
        int rows = sq->n - r0 < a->rows_per_unit ? sq->n - r0 : a->rows_per_unit;
        unit(a, sq, g, r0, rows * group, scores, a->cap);
        u++;
    }
}

/* The threads (1 below CPU_POOL_MIN_MACS) and chunks (a few per thread, at most units) of a pooled
 * call of units that take macs multiply-adds in all. */
static int pool_split(double macs, int units, int *chunks)
{
    int threads = macs < CPU_POOL_MIN_MACS ? 1 : cpu_gemm_threads();
    *chunks = threads > 1 ? threads * ATT_CHUNKS_PER_THREAD : 1;
    if (*chunks > units)
        *chunks = units;
    return threads;
}

/* A thread's own growing scratch (freed with the thread), or NULL. */
static pthread_key_t g_scratch_key;
static int g_scratch_key_ok;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

static void scratch_key_make(void)
{
    g_scratch_key_ok = pthread_key_create(&g_scratch_key, free) == 0;
}

static float *thread_scratch(size_t n)
{
    pthread_once(&g_scratch_once, scratch_key_make);
    if (!g_scratch_key_ok)
        return NULL;
    size_t *b = pthread_getspecific(g_scratch_key); /* b[0]: floats it holds, then the floats */
    if (b && b[0] >= n)
        return (float *)(b + 1);
    size_t *nb = malloc(sizeof(size_t) + n * sizeof(float));
    if (nb == NULL || pthread_setspecific(g_scratch_key, nb) != 0) {
        free(nb);
        return NULL;
    }
    free(b);
    nb[0] = n;
    return (float *)(nb + 1);
}

void cpu_attention(float *out, const float *q, const rekv_attn_seq *seqs, int n_seqs, int n_heads,
                   int n_kv, int hd, rekv_dtype dt, float *scores)
{
    int group = n_heads / n_kv;
    int rows_per_unit = ATT_QUERIES / group > 1 ? ATT_QUERIES / group : 1;
    int first[n_seqs + 1], ctx = 1;
    double macs = 0;
    first[0] = 0;
    for (int i = 0; i < n_seqs; i++) {
        int blocks = (seqs[i].n + rows_per_unit - 1) / rows_per_unit;
        first[i + 1] = first[i] + blocks * n_kv;
        if (seqs[i].start + seqs[i].n > ctx)
            ctx = seqs[i].start + seqs[i].n;
        macs += 2.0 * seqs[i].n * (seqs[i].start + seqs[i].n) * n_heads * hd;
    }
    att_call a = {.out = out,
                  .q = q,
                  .seqs = seqs,
                  .first = first,
                  .n_heads = n_heads,
                  .n_kv = n_kv,
                  .hd = hd,
                  .rows_per_unit = rows_per_unit,
                  .units = first[n_seqs],
                  .dt = dt};
    if (a.units == 0)
        return;
    int threads = pool_split(macs, a.units, &a.chunks), decode = 1;
    for (int i = 0; i < n_seqs; i++)
        decode &= seqs[i].n == 1;
    /* decode rows: chunks of 8 heads or more, which each sweep together (att_sweep_body); still a
     * chunk a thread at least */
    if (decode && threads > 1 && a.chunks > a.units / 8)
        a.chunks = a.units / 8 > threads ? a.units / 8 : threads < a.units ? threads : a.units;
    a.cap = (int)(ATT_SLOT_FLOATS / (size_t)ctx);
    a.cap = a.cap < 1 ? 1 : a.cap > ATT_QUERIES ? ATT_QUERIES : a.cap;
    a.slot_floats = (size_t)a.cap * (size_t)ctx;
    a.scratch = thread_scratch((size_t)threads * a.slot_floats);
    if (a.scratch == NULL) { /* one query at a time in the caller's scratch */
        a.scratch = scores;
        a.cap = 1;
        a.slot_floats = 0;
        threads = 1;
    }
    cpu_pool_run(att_chunk, &a, a.chunks, threads);
}

void cpu_head_proj(float *out, float *const *out_rows, const float *in, const float *a, int rows,
                   int n_heads, int group, int hd, int rk)
{
    for (int r = 0; r < rows; r++) {
        float *o = out_rows ? out_rows[r] : out + (size_t)r * (size_t)n_heads * (size_t)rk;
        for (int h = 0; h < n_heads; h++) {
            const float *x = in + ((size_t)r * (size_t)n_heads + (size_t)h) * (size_t)hd;
            const float *ah = a + (size_t)(h / group) * (size_t)hd * (size_t)rk;
            for (int c = 0; c < rk; c++) {
                float acc = 0;
                for (int d = 0; d < hd; d++)
                    acc += x[d] * ah[(size_t)d * (size_t)rk + (size_t)c];
                o[(size_t)h * (size_t)rk + (size_t)c] = acc;
            }
        }
    }
}

/* cpu_spec_scores' work: units of one sequence and one query head, on the pool; in a unit eight
 * tokens at a time, each its own sequential sum over the columns (eight independent chains instead
 * of one: the same bits, without waiting on each add). */
typedef struct spec_call {
    float *out;
    const float *q;
    const rekv_spec_seq *seqs;
    int n_heads, group, rk, chunks, units;
    float scale;
} spec_call;

static void spec_unit(const spec_call *a, int u)
{
    const rekv_spec_seq *sq = &a->seqs[u / a->n_heads];
    int h = u % a->n_heads, rk = a->rk, n_kv = a->n_heads / a->group;
    const float *qh = a->q + ((size_t)sq->row * (size_t)a->n_heads + (size_t)h) * (size_t)rk;
    const float *kh = sq->pk + (size_t)(h / a->group) * (size_t)rk;
    size_t stride = (size_t)n_kv * (size_t)rk;
    float *o = a->out + sq->out + (size_t)h * (size_t)sq->len;
    int t = 0;
    for (; t + 8 <= sq->len; t += 8) {
        float acc[8] = {0};
        const float *k = kh + (size_t)t * stride;
        for (int c = 0; c < rk; c++)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                acc[i] += qh[c] * k[(size_t)i * stride + (size_t)c];
        for (int i = 0; i < 8; i++)
            o[t + i] = a->scale * acc[i];
    }
    for (; t < sq->len; t++) {
        const float *k = kh + (size_t)t * stride;
        float acc = 0;
        for (int c = 0; c < rk; c++)
            acc += qh[c] * k[c];
        o[t] = a->scale * acc;
    }
}

static void spec_chunk(void *arg, int c, int slot)
{
    (void)slot;
    const spec_call *a = arg;
    int u0 = (int)((long)a->units * c / a->chunks),
        u1 = (int)((long)a->units * (c + 1) / a->chunks);
    for (int u = u0; u < u1; u++)
        spec_unit(a, u);
}

void cpu_spec_scores(float *out, const float *q, const rekv_spec_seq *seqs, int n, int n_heads,
                     int group, int rk, float scale)
{
    spec_call a = {out, q, seqs, n_heads, group, rk, 1, n * n_heads, scale};
    double macs = 0;
    for (int j = 0; j < n; j++)
        macs += (double)seqs[j].len * n_heads * rk;
    if (a.units == 0)
        return;
    int threads = pool_split(macs, a.units, &a.chunks);
    cpu_pool_run(spec_chunk, &a, a.chunks, threads);
}
