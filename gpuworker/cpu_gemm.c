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
 * blocking, the row count, the thread count or the instruction set. The AVX2 path and the portable
 * path give the same bits. Weights may be fp32, fp16 or bf16 (the model file's dtype, kept as it
 * is): 16-bit weights are widened to fp32 in registers as they are loaded — exactly — so a model
 * gives the same bits whichever dtype its weights are held in, and moves half the bytes through
 * memory.
 *
 * Speed comes from the tiling around that fixed order, never from changing it. The AVX2 path runs
 * tiles of MR rows of x against NR rows of w, each element one 8-lane accumulator over the whole
 * k, kept in registers (MR x NR accumulators and NR widened weight vectors fill the 16 ymm
 * registers). MR is 4 where four rows are left and exactly the rows left otherwise (1, 2 or 3,
 * each with more weight rows per pass), so one row — a decode step at batch 1 — streams the
 * weights once with no work spent on missing rows. Rows go in blocks that stay in cache while the
 * weights stream past. Large calls split the output columns among a pool of worker threads
 * (started on first use, one fewer than the online cpus): each column's elements are the same
 * dot products wherever they are computed, so the split never changes a bit.
 *
 * The tile layout (cpu_tile_pack): a row alone is bound by memory, and a tile reading its eight
 * weight rows as eight strided streams reached half a plain read's bandwidth (12.4 of 24.4 GB/s
 * on one core); the engine therefore keeps the matrices only the GEMM reads with each block of 8
 * rows interleaved in chunks of 8 elements — row r's elements 8c..8c+7 at (8c * 8 + r * 8) of
 * its block, then each row's k % 8 tail, rows past the last whole block as they were — so a tile
 * reads one sequential stream. The layout is a permutation within each block: the same bytes,
 * the same elements multiplied in the same order, the same bits as the row-major matrix. With
 * many rows (a prefill) the tiles are 3 rows x 4 weight rows, half a block, and each such group
 * is copied contiguous into a buffer of the thread's once per block of rows (group_copy says
 * why), so the model still holds one copy of its weights, the packed one. */
#include "gpuworker/cpu_ops.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
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

/* A weight matrix [n][k] in dtype wt: rows below split are in the tile layout (the whole blocks
 * of a tiled matrix; 0 for a row-major one), the others row-major. */
typedef struct wmat {
    const char *w;
    rekv_dtype wt;
    size_t es; /* bytes per element */
    int n, k, k8, split;
} wmat;

static wmat wmat_of(const void *w, rekv_dtype wt, int n, int k, int tiled)
{
    return (wmat){w, wt, rekv_dtype_size(wt), n, k, k & ~7, tiled ? n & ~7 : 0};
}

/* Row j: its first chunk of 8 elements (the next ones every w_stride bytes), and its tail. */
static inline const char *w_chunk0(const wmat *W, int j)
{
    if (j < W->split)
        return W->w + ((size_t)(j & ~7) * (size_t)W->k + (size_t)(j & 7) * 8) * W->es;
    return W->w + (size_t)j * (size_t)W->k * W->es;
}

static inline size_t w_stride(const wmat *W, int j)
{
    return (j < W->split ? 64 : 8) * W->es;
}

static inline const char *w_tail(const wmat *W, int j)
{
    if (j < W->split)
        return W->w + ((size_t)(j & ~7) * (size_t)W->k + (size_t)W->k8 * 8 +
                       (size_t)(j & 7) * (size_t)(W->k - W->k8)) *
                          W->es;
    return W->w + ((size_t)j * (size_t)W->k + (size_t)W->k8) * W->es;
}

static float dot_portable(const float *a, const wmat *W, int j)
{
    float l[8] = {0};
    const char *b = w_chunk0(W, j);
    size_t cs = w_stride(W, j);
    for (int t = 0; t < W->k8; t += 8, b += cs)
        for (int i = 0; i < 8; i++)
            l[i] = fmaf(a[t + i], w_at(b, (size_t)i, W->wt), l[i]);
    float s = reduce8(l);
    const char *tl = w_tail(W, j);
    for (int t = W->k8; t < W->k; t++)
        s = fmaf(a[t], w_at(tl, (size_t)(t - W->k8), W->wt), s);
    return s;
}

/* Columns [j0, j1) of y (row stride ldy), one dot product each. */
static void gemm_portable(float *y, const float *x, const wmat *W, int m, int j0, int j1, int ldy)
{
    for (int i = 0; i < m; i++)
        for (int j = j0; j < j1; j++)
            y[(size_t)i * ldy + j] = dot_portable(x + (size_t)i * W->k, W, j);
}

void cpu_gemm_rowinv_portable(float *y, const float *x, const void *w, rekv_dtype wt, int m, int n,
                              int k)
{
    wmat W = wmat_of(w, wt, n, k, 0);
    gemm_portable(y, x, &W, m, 0, n, n);
}

void cpu_gemm_rowinv_tiled_portable(float *y, const float *x, const void *w, rekv_dtype wt, int m,
                                    int n, int k)
{
    wmat W = wmat_of(w, wt, n, k, 1);
    gemm_portable(y, x, &W, m, 0, n, n);
}

#if defined(__x86_64__)
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Eight weights at w, widened in registers (exact). */
AVX2_INLINE __m256 load_w8(const char *w, rekv_dtype wt)
{
    if (wt == REKV_DTYPE_F32)
        return _mm256_loadu_ps((const float *)w);
    __m128i h = _mm_loadu_si128((const __m128i *)w);
    if (wt == REKV_DTYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The end of one element's dot product: its 8 lanes (stored), then the k % 8 tail (at tl). */
static inline float finish(const float l[8], const float *a, const char *tl, rekv_dtype wt, int k8,
                           int k)
{
    float s = reduce8(l);
    for (int t = k8; t < k; t++)
        s = fmaf(a[t], w_at(tl, (size_t)(t - k8), wt), s);
    return s;
}

/* NR weight rows as a tile reads them: the first row's first chunk of 8 elements at w0, the next
 * chunk every cs bytes, the next row's rstep bytes on; the rows' k % 8 tails at t0, tstep apart.
 * A tile's weight rows are evenly spaced in either layout (and in a group's copy, group_copy), so
 * its setup is one pointer computation, not one per row. */
typedef struct wpanel {
    const char *w0, *t0;
    size_t cs, rstep, tstep;
} wpanel;

static inline wpanel panel_of(const wmat *W, int j)
{
    wpanel P = {w_chunk0(W, j), w_tail(W, j), 8 * W->es, (size_t)W->k * W->es,
                (size_t)W->k * W->es};
    if (j < W->split) /* rows 8 elements apart in each chunk of 64, tails k % 8 apart */
        P.cs = 64 * W->es, P.rstep = 8 * W->es, P.tstep = (size_t)(W->k - W->k8) * W->es;
    return P;
}

/* One tile: MR rows of x (from x, row stride k) against the NR weight rows of panel P (all in
 * one layout and, in the tile layout, in one block: the callers' j and NR keep them so), written
 * to y[r * ldy + c] for the nc <= NR columns that exist; a missing column reads column 0 again and
 * is dropped. MR and NR are constants where this is inlined, so the accumulators live in
 * registers: with at least as many rows as weight rows the NR widened weight vectors stay in
 * registers and x is read from memory, else the MR x vectors stay and the weights stream (a row
 * alone: eight weight rows per pass, each read once — in the tile layout one sequential
 * stream). */
AVX2_INLINE void tile_avx2(float *y, int ldy, const float *x, const wmat *W, const wpanel *P,
                           const rekv_dtype wt, int nc, const int MR, const int NR, const int TL)
{
    int k = W->k, k8 = W->k8;
    /* TL: P is in the tile layout, its strides known here, so the weight rows are one pointer
     * and constant offsets (no register for each: the one-row tile's eight pointers spilled) */
    size_t es = rekv_dtype_size(wt), cs = TL ? 64 * es : P->cs, rstep = TL ? 8 * es : P->rstep;
    size_t tstep = P->tstep;
    const char *w0 = P->w0, *t0 = P->t0;
    const char *wc[8];
    const float *xr[4];
    __m256 acc[4][8];
#pragma GCC unroll 8
    for (int c = 0; c < NR; c++)
        wc[c] = w0 + (size_t)(c < nc ? c : 0) * rstep;
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) {
        xr[r] = x + (size_t)r * k;
#pragma GCC unroll 8
        for (int c = 0; c < NR; c++)
            acc[r][c] = _mm256_setzero_ps();
    }
    size_t off = 0;
    for (int t = 0; t < k8; t += 8, off += cs) {
        if (MR >= NR) {
            __m256 b[8];
#pragma GCC unroll 8
            for (int c = 0; c < NR; c++)
                b[c] = load_w8(wc[c] + off, wt);
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++) {
                __m256 a = _mm256_loadu_ps(xr[r] + t);
#pragma GCC unroll 8
                for (int c = 0; c < NR; c++)
                    acc[r][c] = _mm256_fmadd_ps(a, b[c], acc[r][c]);
            }
        } else {
            __m256 a[4];
#pragma GCC unroll 4
            for (int r = 0; r < MR; r++)
                a[r] = _mm256_loadu_ps(xr[r] + t);
#pragma GCC unroll 8
            for (int c = 0; c < NR; c++) {
                __m256 b = load_w8(wc[c] + off, wt);
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++)
                    acc[r][c] = _mm256_fmadd_ps(a[r], b, acc[r][c]);
            }
        }
    }
    /* all lanes to memory first: no accumulator may live across a call (it would be spilled
     * inside the loop too) */
    float l[4][8][8];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NR; c++)
            _mm256_storeu_ps(l[r][c], acc[r][c]);
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < nc; c++)
            y[(size_t)r * ldy + c] = finish(l[r][c], xr[r], t0 + (size_t)c * tstep, wt, k8, k);
}

/* MR rows (x, y at row 0) against columns [j0, j1) of one layout, NR at a time. */
AVX2_INLINE void rows_avx2(float *y, int ldy, const float *x, const wmat *W, const rekv_dtype wt,
                           int j0, int j1, const int MR, const int NR, const int TL)
{
    for (int j = j0; j < j1; j += NR) {
        wpanel P = panel_of(W, j);
        if (j1 - j >= NR) /* nc a constant: the weight rows at constant offsets */
            tile_avx2(y + j, ldy, x, W, &P, wt, NR, MR, NR, TL);
        else
            tile_avx2(y + j, ldy, x, W, &P, wt, j1 - j, MR, NR, TL);
    }
}

/* The rows left after the whole tiles of MR rows (fewer than MR), against the nc columns of
 * panel P in one tile of the same NR. */
AVX2_INLINE void left_avx2(float *y, int ldy, const float *x, const wmat *W, const wpanel *P,
                           const rekv_dtype wt, int left, int nc, const int MR, const int NR)
{
    if (left == 1)
        tile_avx2(y, ldy, x, W, P, wt, nc, 1, NR, 0);
    else if (left == 2 && MR > 2)
        tile_avx2(y, ldy, x, W, P, wt, nc, 2, NR, 0);
    else if (left == 3 && MR > 3)
        tile_avx2(y, ldy, x, W, P, wt, nc, 3, NR, 0);
}

/* A group of 4 weight rows of the tile layout (half a block) is every other cache line at f16
 * (one line of each 128-byte chunk of the block), which maps it to half of L1's sets: at a long k
 * it does not stay in L1 from one tile of rows to the next (the down projection, k = ffn, ran
 * ~10% below row-major, with 26% more L1 misses). With many rows, each group is copied once per
 * block of rows into the calling thread's buffer (gemm_run's), contiguous — chunks of 4 rows x 8
 * elements after one another — and every tile of the block reads it there: a copy of 4 x k
 * elements against up to 16 tiles' work (BLIS's packed panel, here a permutation within the
 * panel). The elements and their order are unchanged: the same bits. A group that fits in its
 * half of a 32 KiB L1 with room for the rows of x (k = hidden = 1024 at f16: 8 KiB)
 * stays there as it is; copying it only costs instructions (cachegrind, f16 2816 x 1024: the
 * same L1 misses, 3.5% more instructions). */
enum { GROUP_COPY_MIN_ROWS = 8, GROUP_COPY_MIN_BYTES = 12 << 10 };

static size_t group_bytes(const wmat *W)
{
    return 4 * (size_t)W->k8 * W->es;
}

/* P (4 rows of a tiled block) copied contiguous into buf; returns the copy's panel. */
AVX2_INLINE wpanel group_copy(char *buf, const wmat *W, const wpanel *P, const rekv_dtype wt)
{
    size_t es = rekv_dtype_size(wt), line = 4 * 8 * es;
    const char *src = P->w0;
    for (int t = 0; t < W->k8; t += 8, src += P->cs)
        memcpy(buf + (size_t)(t / 8) * line, src, line);
    return (wpanel){buf, P->t0, line, 8 * es, P->tstep};
}

/* y[m][j0..j1) (row stride ldy) over columns of one layout in tiles of MR x NR, the rows in
 * blocks that stay in cache while the weights stream; the rows left after the last whole tile
 * take each group of NR columns while it is in cache, so the weights stream from memory once.
 * buf (the tile layout's 3 x 4 tiles, or NULL): each group is copied there first (group_copy). */
AVX2_INLINE void blocks_avx2(float *y, const float *x, const wmat *W, const rekv_dtype wt, int m,
                             int j0, int j1, int ldy, const int MR, const int NR, char *buf)
{
    int k = W->k, mm = m - m % MR, MB = 16 * MR;
    for (int i0 = 0; i0 < mm; i0 += MB) {
        int i1 = i0 + MB < mm ? i0 + MB : mm, last = i1 == mm;
        for (int j = j0; j < j1; j += NR) {
            int nc = j1 - j < NR ? j1 - j : NR;
            wpanel P = panel_of(W, j);
            if (buf && nc == NR)
                P = group_copy(buf, W, &P, wt);
            for (int i = i0; i < i1; i += MR)
                tile_avx2(y + (size_t)i * ldy + j, ldy, x + (size_t)i * k, W, &P, wt, nc, MR, NR,
                          0);
            if (last)
                left_avx2(y + (size_t)mm * ldy + j, ldy, x + (size_t)mm * k, W, &P, wt, m - mm, nc,
                          MR, NR);
        }
    }
}

/* y[m][j0..j1) for one weight dtype, inlined once per dtype so the widening is decided at compile
 * time: the tiled columns, then the row-major ones (a tile never mixes layouts). Row-major: tiles
 * of 4 rows x 3 weight rows; tiled: 3 x 4, so that a tile's weight rows are half a block of 8 —
 * one of its cache lines in each chunk — and every line is read once per tile of rows (3 weight
 * rows of 8 left lines half read and read them twice). Fewer rows than a tile's (a decode step at
 * a small batch) go with no work spent on missing ones: 1 x 8 (one sequential stream in the tile
 * layout), 2 x 6 or 2 x 4, 3 x 4. */
AVX2_INLINE void gemm_avx2_body(float *y, const float *x, const wmat *W, const rekv_dtype wt, int m,
                                int j0, int j1, int ldy, char *buf)
{
    int s = W->split < j0 ? j0 : W->split > j1 ? j1 : W->split;
    if (j0 < s) {
        if (m >= 3)
            blocks_avx2(y, x, W, wt, m, j0, s, ldy, 3, 4, buf);
        else if (m == 2)
            rows_avx2(y, ldy, x, W, wt, j0, s, 2, 4, 1);
        else
            rows_avx2(y, ldy, x, W, wt, j0, s, 1, 8, 1);
    }
    if (s < j1) {
        switch (m) {
        case 1:
            rows_avx2(y, ldy, x, W, wt, s, j1, 1, 8, 0);
            break;
        case 2:
            rows_avx2(y, ldy, x, W, wt, s, j1, 2, 6, 0);
            break;
        case 3:
            rows_avx2(y, ldy, x, W, wt, s, j1, 3, 4, 0);
            break;
        default:
            blocks_avx2(y, x, W, wt, m, s, j1, ldy, 4, 3, NULL);
        }
    }
}

AVX2_FN static void gemm_avx2(float *y, const float *x, const wmat *W, int m, int j0, int j1,
                              int ldy, char *buf)
{
    if (W->wt == REKV_DTYPE_F16)
        gemm_avx2_body(y, x, W, REKV_DTYPE_F16, m, j0, j1, ldy, buf);
    else if (W->wt == REKV_DTYPE_BF16)
        gemm_avx2_body(y, x, W, REKV_DTYPE_BF16, m, j0, j1, ldy, buf);
    else
        gemm_avx2_body(y, x, W, REKV_DTYPE_F32, m, j0, j1, ldy, buf);
}

static int have_avx2(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
#endif

/* One call's work, split by output columns into chunks; bias is added per chunk. gbuf: a
 * group_bytes buffer per thread slot for the tile layout's group copies, or NULL (none). */
typedef struct gemm_job {
    float *y;
    const float *x;
    wmat W;
    const float *bias;
    char *gbuf;
    int m, n, chunks;
} gemm_job;

static void gemm_job_chunk(void *arg, int p, int slot)
{
    const gemm_job *g = arg;
    /* chunk boundaries on multiples of 24 columns (whole tiles of 3, 4, 6 and 8, and whole
     * blocks of the tile layout): speed only */
    int j0 = (int)((long)g->n * p / g->chunks / 24 * 24);
    int j1 = p + 1 == g->chunks ? g->n : (int)((long)g->n * (p + 1) / g->chunks / 24 * 24);
    if (j1 <= j0)
        return;
#if defined(__x86_64__)
    if (have_avx2())
        gemm_avx2(g->y, g->x, &g->W, g->m, j0, j1, g->n,
                  g->gbuf ? g->gbuf + (size_t)slot * group_bytes(&g->W) : NULL);
    else
#endif
        gemm_portable(g->y, g->x, &g->W, g->m, j0, j1, g->n);
    if (g->bias)
        for (int i = 0; i < g->m; i++)
            for (int j = j0; j < j1; j++)
                g->y[(size_t)i * g->n + j] += g->bias[j];
}

/* The worker pool (cpu_pool_run): threads that live for the process (started on first use; a
 * forked child starts its own). A call is cut into chunks (a GEMM's: columns) that the caller and
 * the workers claim one at a time, so a worker that is slow to wake (asleep, or off its cpu on a
 * busy machine) leaves its chunks to the caller instead of holding the call up. One caller at a
 * time owns the pool (busy); a caller that finds it taken — the cpu backend's streams are threads,
 * so calls come from several threads at once — does its whole call itself. Workers spin a short
 * while after each call, since a forward pass's GEMMs come microseconds apart, and then sleep.
 *
 * ticket holds the call's generation (bits 32..63), the next chunk to claim (16..31) and the
 * chunk count (0..15): a claim is a compare-and-swap on it, so a worker still holding an older
 * call's ticket can never claim a chunk of the new one, and job is read only after a claim (the
 * caller does not return, nor rewrite job, until every claimed chunk is done). */
enum { GEMM_MAX_THREADS = 16, GEMM_CHUNKS_PER_THREAD = 4, GEMM_SPIN_NS = 100000 };

static struct {
    pthread_mutex_t busy; /* held by the caller that owns the pool for one call */
    pthread_mutex_t mu;   /* guards sleepers and the wake-up */
    pthread_cond_t wake;
    _Atomic uint64_t ticket;      /* generation | next chunk | chunks */
    atomic_int done;              /* chunks of the current call finished */
    atomic_int allowed;           /* workers that may take part in the current call */
    atomic_ulong worker_chunks;   /* chunks the workers have run, ever (cpu_gemm_pool_chunks) */
    int sleepers;                 /* workers waiting on wake (under mu) */
    int workers;                  /* threads started (under busy) */
    void (*fn)(void *, int, int); /* the current call (written under busy before ticket) */
    void *arg;
} g_pool = {.busy = PTHREAD_MUTEX_INITIALIZER,
            .mu = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER};

static atomic_int g_threads_set; /* cpu_gemm_set_threads: 0 = the online cpus */
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static inline void cpu_relax(void)
{
#if defined(__x86_64__)
    _mm_pause();
#else
    sched_yield();
#endif
}

/* Claims and runs chunks of the call in ticket t until none is left, as thread `slot`; returns
 * how many it ran. */
static unsigned pool_drain(uint64_t t, int slot)
{
    for (unsigned ran = 0;; ran++) {
        uint64_t next = (t >> 16) & 0xffff, chunks = t & 0xffff;
        if (next >= chunks)
            return ran;
        if (atomic_compare_exchange_weak_explicit(&g_pool.ticket, &t, t + (1u << 16),
                                                  memory_order_acquire, memory_order_relaxed)) {
            g_pool.fn(g_pool.arg, (int)next, slot);
            atomic_fetch_add_explicit(&g_pool.done, 1, memory_order_release);
            t = atomic_load_explicit(&g_pool.ticket, memory_order_acquire);
        }
    }
}

static void *pool_main(void *arg)
{
    int idx = (int)(intptr_t)arg;
    uint64_t seen = 0; /* generations start at 1 */
    for (;;) {
        uint64_t t0 = rekv_now_ns(), t;
        for (unsigned i = 0;
             (t = atomic_load_explicit(&g_pool.ticket, memory_order_acquire)) >> 32 == seen; i++) {
            cpu_relax();
            if ((i & 63) == 63 && rekv_now_ns() - t0 > GEMM_SPIN_NS) {
                pthread_mutex_lock(&g_pool.mu);
                g_pool.sleepers++;
                while (atomic_load(&g_pool.ticket) >> 32 == seen)
                    pthread_cond_wait(&g_pool.wake, &g_pool.mu);
                g_pool.sleepers--;
                pthread_mutex_unlock(&g_pool.mu);
            }
        }
        seen = t >> 32;
        if (idx < atomic_load_explicit(&g_pool.allowed, memory_order_relaxed))
            atomic_fetch_add_explicit(&g_pool.worker_chunks, pool_drain(t, idx + 1),
                                      memory_order_relaxed);
    }
    return NULL;
}

/* A forked child has none of the parent's workers (and maybe a copy of a held lock). */
static void pool_atfork_child(void)
{
    pthread_mutex_init(&g_pool.busy, NULL);
    pthread_mutex_init(&g_pool.mu, NULL);
    pthread_cond_init(&g_pool.wake, NULL);
    g_pool.sleepers = 0;
    g_pool.workers = 0;
    /* a call another thread had under way is not this process's: nothing left to claim */
    uint64_t gen = (atomic_load(&g_pool.ticket) >> 32) + 1;
    atomic_store(&g_pool.ticket, gen << 32);
}

static void pool_atfork_register(void)
{
    pthread_atfork(NULL, NULL, pool_atfork_child);
}

/* Starts workers up to n (under busy); returns how many there are. */
static int pool_grow(int n)
{
    pthread_once(&g_atfork_once, pool_atfork_register);
    while (g_pool.workers < n) {
        pthread_attr_t at;
        pthread_t t;
        int rc = pthread_attr_init(&at);
        if (rc == 0) {
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            rc = pthread_create(&t, &at, pool_main, (void *)(intptr_t)g_pool.workers);
            pthread_attr_destroy(&at);
        }
        if (rc)
            break; /* fewer workers: the callers do their share */
        g_pool.workers++;
    }
    return g_pool.workers;
}

int cpu_gemm_set_threads(int n)
{
    return atomic_exchange(&g_threads_set, n > 0 ? n : 0);
}

unsigned long cpu_gemm_pool_chunks(void)
{
    return atomic_load(&g_pool.worker_chunks);
}

/* The online cpus, asked once: glibc's sysconf reads /sys/devices/system/cpu/online at every
 * call, which at a GEMM call each cost a small model's decode step ~8% of its time. */
static int online_cpus(void)
{
    static atomic_int n;
    int v = atomic_load_explicit(&n, memory_order_relaxed);
    if (v <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        v = c > 0 ? (int)c : 1;
        atomic_store_explicit(&n, v, memory_order_relaxed);
    }
    return v;
}

int cpu_gemm_threads(void)
{
    int n = atomic_load(&g_threads_set);
    if (n <= 0)
        n = online_cpus();
    return n < GEMM_MAX_THREADS ? n : GEMM_MAX_THREADS;
}

void cpu_pool_run(void (*fn)(void *arg, int chunk, int slot), void *arg, int chunks, int threads)
{
    /* the ticket counts chunks in 16 bits: more (never: callers keep to a few per thread) run
     * on the caller rather than be lost */
    if (threads < 2 || chunks < 2 || chunks > 0xffff || pthread_mutex_trylock(&g_pool.busy) != 0) {
        for (int c = 0; c < chunks; c++)
            fn(arg, c, 0);
        return;
    }
    int workers = pool_grow(threads - 1);
    atomic_store_explicit(&g_pool.allowed, workers < threads - 1 ? workers : threads - 1,
                          memory_order_relaxed);
    g_pool.fn = fn;
    g_pool.arg = arg;
    atomic_store_explicit(&g_pool.done, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load_explicit(&g_pool.ticket, memory_order_relaxed) >> 32) + 1;
    uint64_t t = gen << 32 | (uint64_t)chunks;
    atomic_store_explicit(&g_pool.ticket, t, memory_order_release);
    pthread_mutex_lock(&g_pool.mu);
    if (g_pool.sleepers)
        pthread_cond_broadcast(&g_pool.wake);
    pthread_mutex_unlock(&g_pool.mu);
    pool_drain(t, 0);
    for (unsigned i = 0; atomic_load_explicit(&g_pool.done, memory_order_acquire) < chunks; i++)
        if ((i & 255) == 255)
            sched_yield(); /* a worker's chunk, its thread maybe off its cpu */
        else
            cpu_relax();
    pthread_mutex_unlock(&g_pool.busy);
}

static void gemm_run(float *y, const float *x, const void *w, rekv_dtype wt, int tiled,
                     const float *bias, int m, int n, int k)
{
    gemm_job g = {y, x, wmat_of(w, wt, n, k, tiled), bias, NULL, m, n, 1};
    int threads = cpu_gemm_threads();
    g.chunks = threads * GEMM_CHUNKS_PER_THREAD;
    if (g.chunks > n / 24)
        g.chunks = n / 24; /* at least a few tiles of columns each */
    if (threads < 2 || g.chunks < 2 || (double)m * n * k < CPU_POOL_MIN_MACS)
        g.chunks = 1, threads = 1; /* one chunk: the rows stream the weights once */
    /* a buffer per thread for the group copies (blocks_avx2); without it the groups are read in
     * place, the same bits */
    if (g.W.split > 0 && m >= GROUP_COPY_MIN_ROWS && group_bytes(&g.W) > GROUP_COPY_MIN_BYTES)
        g.gbuf = malloc((size_t)threads * group_bytes(&g.W));
    if (g.chunks == 1)
        gemm_job_chunk(&g, 0, 0);
    else
        cpu_pool_run(gemm_job_chunk, &g, g.chunks, threads);
    free(g.gbuf);
}

void cpu_gemm_rowinv_f32_cols(float *y, int ldy, const float *x, const float *w, int m, int n,
                              int k)
{
    wmat W = wmat_of(w, REKV_DTYPE_F32, n, k, 0);
#if defined(__x86_64__)
    if (have_avx2()) {
        gemm_avx2(y, x, &W, m, 0, n, ldy, NULL);
        return;
    }
#endif
    gemm_portable(y, x, &W, m, 0, n, ldy);
}

void cpu_gemm_rowinv(float *y, const float *x, const void *w, rekv_dtype wt, const float *bias,
                     int m, int n, int k)
{
    gemm_run(y, x, w, wt, 0, bias, m, n, k);
}

void cpu_gemm_rowinv_tiled(float *y, const float *x, const void *w, rekv_dtype wt,
                           const float *bias, int m, int n, int k)
{
    gemm_run(y, x, w, wt, 1, bias, m, n, k);
}

/* Permutes each whole block of 8 rows of w ([n][k], es bytes an element) between row-major and
 * the tile layout, in place, through a copy of one block in scratch. */
static void tile_permute(void *w, rekv_dtype wt, int n, int k, void *scratch, int pack)
{
    size_t es = rekv_dtype_size(wt), K = (size_t)k, k8 = K & ~(size_t)7, tail = K - k8;
    size_t block = 8 * K * es;
    char *tmp = scratch;
    for (int b = 0; b + 8 <= n; b += 8) {
        char *blk = (char *)w + (size_t)b * K * es;
        memcpy(tmp, blk, block);
        for (size_t r = 0; r < 8; r++) {
            for (size_t c = 0; c < k8; c += 8) {
                size_t rm = (r * K + c) * es, tl = (c * 8 + r * 8) * es; /* row-major, tiled */
                memcpy(blk + (pack ? tl : rm), tmp + (pack ? rm : tl), 8 * es);
            }
            size_t rm = (r * K + k8) * es, tl = (k8 * 8 + r * tail) * es;
            memcpy(blk + (pack ? tl : rm), tmp + (pack ? rm : tl), tail * es);
        }
    }
}

size_t cpu_tile_index(int n, int k, int i, int j)
{
    size_t K = (size_t)k, k8 = K & ~(size_t)7, tail = K - k8, J = (size_t)j;
    if (i >= (n & ~7)) /* past the last whole block: row-major */
        return (size_t)i * K + J;
    size_t base = (size_t)(i & ~7) * K, r = (size_t)(i & 7);
    return base + (J < k8 ? (J & ~(size_t)7) * 8 + r * 8 + (J & 7) : k8 * 8 + r * tail + (J - k8));
}

size_t cpu_tile_scratch_bytes(rekv_dtype wt, int k)
{
    return 8 * (size_t)k * rekv_dtype_size(wt);
}

void cpu_tile_pack(void *w, rekv_dtype wt, int n, int k, void *scratch)
{
    tile_permute(w, wt, n, k, scratch, 1);
}

void cpu_tile_unpack(void *w, rekv_dtype wt, int n, int k, void *scratch)
{
    tile_permute(w, wt, n, k, scratch, 0);
}
