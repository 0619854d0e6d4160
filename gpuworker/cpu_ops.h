/* cpu_ops.h — the cpu backend's kernels: the fp32 reference for every operation of the forward
 * pass. Row-major throughout; a linear layer's weight W is [out][in] as HF stores it. */
#ifndef REKV_GPUWORKER_CPU_OPS_H
#define REKV_GPUWORKER_CPU_OPS_H

#include "gpuworker/kernels.h"
#include "gpuworker/kvlayout.h"
#include "loader/loader.h"

/* y[m][n] = x[m][k] · W[n][k]^T (+ bias[n] when not NULL), each output element computed in a
 * fixed order that does not depend on m or on which rows share the call, so recomputing some rows
 * later, or batching them otherwise, gives the same bits. Every projection of the engine uses it
 * (cpu_gemm.c says why). w is [n][k] in dtype wt (f32, f16 or bf16; 16-bit weights are widened to
 * fp32 exactly, so the bits are those of the widened fp32 weights). */
void cpu_gemm_rowinv(float *y, const float *x, const void *w, rekv_dtype wt, const float *bias,
                     int m, int n, int k);
/* The portable path of cpu_gemm_rowinv (no bias, one thread), for tests: it must give the same
 * bits. */
void cpu_gemm_rowinv_portable(float *y, const float *x, const void *w, rekv_dtype wt, int m, int n,
                              int k);
/* cpu_gemm_rowinv over w in the tile layout (cpu_gemm.c; cpu_tile_pack made it): the same bits
 * as cpu_gemm_rowinv over the row-major matrix, from one sequential stream per tile. */
void cpu_gemm_rowinv_tiled(float *y, const float *x, const void *w, rekv_dtype wt,
                           const float *bias, int m, int n, int k);
void cpu_gemm_rowinv_tiled_portable(float *y, const float *x, const void *w, rekv_dtype wt, int m,
                                    int n, int k);
/* cpu_gemm_rowinv's products over n row-major fp32 weight rows on the calling thread alone,
 * no bias, into y with row stride ldy: the kernel cpu_qgemm_rowinv runs on each tile of weight
 * rows it has dequantized, so a quantized matrix gives the bits of its fp32 dequantization. */
void cpu_gemm_rowinv_f32_cols(float *y, int ldy, const float *x, const float *w, int m, int n,
                              int k);
/* w [n][k] in dtype wt from row-major into the tile layout, in place (each whole block of 8 rows
 * interleaved in chunks of 8 elements, then its rows' k % 8 tails; the n % 8 rows past the last
 * block stay as they are: the same bytes, permuted); cpu_tile_unpack undoes it. scratch: memory
 * of cpu_tile_scratch_bytes(wt, k) (one block) that the call may overwrite. */
size_t cpu_tile_scratch_bytes(rekv_dtype wt, int k);
/* Where element (i, j) of the row-major [n][k] matrix sits in its tile layout, in elements. */
size_t cpu_tile_index(int n, int k, int i, int j);
void cpu_tile_pack(void *w, rekv_dtype wt, int n, int k, void *scratch);
void cpu_tile_unpack(void *w, rekv_dtype wt, int n, int k, void *scratch);
/* Threads a large cpu_gemm_rowinv call may use: the caller and workers of a pool that lives for
 * the process (started on first use). n > 0 caps them at n, 0 restores the default (the online
 * cpus); returns the previous setting. The bits never depend on it (tests set it to check that).
 * cpu_gemm_threads: the threads a large call would use now; cpu_gemm_pool_chunks: the column
 * chunks the pool's workers have computed so far (tests check the threads did take part). */
int cpu_gemm_set_threads(int n);
int cpu_gemm_threads(void);
unsigned long cpu_gemm_pool_chunks(void);
/* Runs fn(arg, c, slot) once for every chunk c in [0, chunks) on the caller and the pool's workers,
 * each claiming one chunk at a time, and returns when all are done; slot, in [0, threads), names
 * the thread that runs it (0: the caller), for scratch of its own. All on the caller, slot 0,
 * when threads or chunks are below 2, chunks above 65535, or another thread's call holds the
 * pool. */
void cpu_pool_run(void (*fn)(void *arg, int chunk, int slot), void *arg, int chunks, int threads);
/* Below this many multiply-adds a call runs on its caller alone: handing work to a spinning
 * worker costs about a microsecond, to a sleeping one tens. */
#define CPU_POOL_MIN_MACS 65536.0

/* In place over m rows of width d: LayerNorm (bias != NULL) or RMSNorm (bias == NULL). */
void cpu_layernorm(float *x, const float *w, const float *b, int m, int d, float eps);
void cpu_rmsnorm(float *x, const float *w, int m, int d, float eps);
/* out = in normalised (out may equal in) */
void cpu_norm(float *out, const float *in, const float *w, const float *b, int m, int d, float eps);

/* cos/sin tables for m rows at positions pos[m]: [m][f->half] each, the angle of pair j at
 * position p being p * f's frequency j for p (rekv_rope_freqs_at), both times f->attn_factor. */
void cpu_rope_table(float *cos_t, float *sin_t, const int *pos, int m, const rekv_rope_freqs *f);
/* Rotates each of n_heads heads of m rows of x ([m][n_heads*head_dim]). */
void cpu_rope(float *x, const float *cos_t, const float *sin_t, int m, int n_heads, int head_dim,
              rekv_rope style);

/* In place: relu / gelu (erf) / silu / gelu (tanh) over n elements; gated (b not NULL, silu and
 * tanh gelu): a[i] = act(a[i]) * b[i]. */
void cpu_activation(float *a, const float *b, size_t n, rekv_act act);
/* x[i] *= a over n elements. */
void cpu_scale(float *x, size_t n, float a);
/* x[i] = cap * tanh(x[i] / cap) over n elements (Gemma-2's soft-capping, as HF computes it). */
void cpu_softcap(float *x, size_t n, float cap);

/* e^x as the cpu attention's softmax computes it (x <= 0 there): Cephes' expf in multiplies and
 * adds only, so vector lanes give the same bits; within 2 ulp of exp over [-87, 88], 0 below -87
 * (e^-87 is 1.4 FLT_MIN) and +inf above 88, NaN for NaN. The same on every machine (no libm). */
float cpu_expf(float x);
/* A softmax's numerators: e[t] = cpu_expf(s[t] - m) for t < n, m = the largest s[t] (into *max
 * unless NULL); e may be s. Returns their sum, in 8 lanes: t in lane t % 8, each lane in order,
 * then lanes 0..7 in order. */
float cpu_softmax_exp(float *e, const float *s, int n, float *max);
/* The cosine of a and b (n floats), summed in double in order; 0 when either is zero. */
double cpu_cosine(const float *a, const float *b, int n);

/* Causal attention of n_seqs sequences (kernels.h rekv_attn_seq: each one's new rows at
 * positions start..start+n-1 over its cache kv, kvlayout.h, in dtype dt, 16-bit rows widened
 * exactly; skip: each KV head's slots left out): q, out [rows][n_heads*hd], each sequence's at its
 * row0. Each output is computed in one fixed order — a query's score of key t is the sequential
 * sum over the head dimension, the softmax cpu_softmax_exp's over the keys attended, the output
 * the sequential sum over t of p_t * v_t — whatever the rows, the company or the threads (the
 * pool's: units of a KV head and a few rows share each widened K and V row). scores: scratch of
 * max(start + n) floats, used when per-thread scratch cannot be allocated. */
void cpu_attention(float *out, const float *q, const rekv_attn_seq *seqs, int n_seqs, int n_heads,
                   int n_kv, int hd, rekv_dtype dt, float *scores);

/* infinigen (kernels.h head_proj, spec_scores): the reference loops */
void cpu_head_proj(float *out, float *const *out_rows, const float *in, const float *a, int rows,
                   int n_heads, int group, int hd, int rk);
void cpu_spec_scores(float *out, const float *q, const rekv_spec_seq *seqs, int n, int n_heads,
                     int group, int rk, float scale);

#endif
