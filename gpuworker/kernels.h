/* kernels.h — the forward pass's operations as a table per backend: every kernel is enqueued on
 * a stream of the device runtime (device/backend.h) and runs in stream order, on device pointers.
 * On the cpu backend they are the fp32 reference (cpu_ops.h) run as tasks on its stream threads
 * (kernels_cpu.c); on cuda, cuBLAS and CUDA kernels (kernels_cuda.cu). Activations are fp32 in
 * device memory; weight matrices are in the model file's dtype (f32, f16 or bf16, or a GGUF
 * file's quantized blocks, cpu_qgemm_wt), vectors (norms, biases) in fp32. Arrays passed by
 * pointer (positions, descriptors) are device memory and must stay valid until the kernel has
 * run. */
#ifndef REKV_GPUWORKER_KERNELS_H
#define REKV_GPUWORKER_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "gpuworker/device/backend.h"
#include "gpuworker/kvlayout.h"
#include "loader/loader.h"

/* One sequence's attention context for one layer: a KV buffer laid out as kvlayout.h says, in the
 * cache dtype (the dtype argument of kv_scatter and attention), holding positions 0..start+n-1
 * once the new rows are in; the sequence contributes n query rows, at positions
 * start..start+n-1. skip (clo: each KV head its own cached context) leaves the first skip[g] slots
 * of KV head g out of its query heads' attention. */
typedef struct rekv_attn_seq {
    void *kv;            /* blocks of K then V rows (kvlayout.h), cache dtype */
    int start;           /* positions before the new rows */
    int n;               /* new rows (queries) */
    int row0;            /* index of the sequence's first row in the stacked q/out matrices */
    const int32_t *skip; /* [n_kv] slots not attended, from slot 0, per KV head (memory the
                            device reads, like this struct); NULL: none */
    int window;          /* 0: none; W: the query at position p attends slots p - W + 1 .. p
                            only (the layer's sliding window; slot == position, so not with
                            infinigen's or clo's selections) */
    float scale;         /* the scores' scale; 0: 1/sqrt(head_dim) (Gemma-2: its
                            query_pre_attn_scalar^-0.5) */
    float softcap;       /* 0: none; c: each scaled score s becomes c * tanh(s / c) before the
                            softmax (Gemma-2's attn_logit_softcapping) */
} rekv_attn_seq;

/* A run of elements converted from a cache dtype into fp32: dst[i] = (float)src[i]. */
typedef struct rekv_convert_piece {
    float *dst;
    const void *src;
    uint32_t n; /* elements */
} rekv_convert_piece;

/* One sequence of an infinigen speculation (spec_scores): its partial keys and where its query
 * row and scores are. */
typedef struct rekv_spec_seq {
    const float *pk; /* [len][n_kv][rk] fp32: the skewed keys' selected columns (device) */
    int len;         /* context tokens scored */
    int row;         /* its query row in q */
    size_t out;      /* its scores: out + this, [n_heads][len] */
} rekv_spec_seq;

/* infinigen: which context tokens a decode step fetches per (sequence, layer > 0, KV head) */
typedef enum rekv_select {
    REKV_SELECT_SPECULATE = 0, /* InfiniGen: speculated score > max - alpha, the count averaged
                                  over the KV heads, capped at max_fraction of the context */
    REKV_SELECT_RANDOM = 1,    /* as many tokens as SPECULATE would take, chosen at random (a
                                  baseline for rekv eval, never for serving) */
    REKV_SELECT_ALL = 2,       /* every token (the exact limit: resident's tokens bit for bit) */
} rekv_select;

/* One sequence of infinigen's selection on the device (ig_select): where its scores are, what it
 * selects among, and where the selection goes. Memory the device reads and writes (host_alloc on
 * cuda: the host reads sel and *m after the step). */
typedef struct rekv_ig_seq {
    size_t scores;          /* its speculated scores: scores + this, [n_heads][len] */
    float *scratch;         /* device memory: rekv_ig_scratch_floats(len, n_heads, n_kv) floats */
    int len;                /* context tokens */
    int dev;                /* [0, dev) is attended whole from the device: it selects among
                               [dev, len) */
    uint64_t key;           /* REKV_SELECT_RANDOM's draw */
    int32_t *sel;           /* [n_kv][len - dev]: KV head g's m tokens, as offsets past dev,
                               ascending, from g * (len - dev) */
    int *m;                 /* the tokens each KV head takes */
    const uint64_t *blocks; /* [block] the arena offset of the layer's block b (t / 16), read
                               from b = dev / 16 */
    void *kv;               /* its attention buffer (kvlayout.h): the j-th token head g selected
                               goes to slot dev + j */
    int *start;             /* set to dev + m: its descriptor's start (rekv_attn_seq) */
    int32_t *slot;          /* set to dev + m: its new row's slot (kv_scatter's row_pos) */
    /* InfiniGen's KV pool (kv_pool.h), with dev = 0; count NULL: none. The layer's pools, one per
     * KV head: counters and evicted flags [n_kv][cap] and evictions [n_kv], memory the device
     * reads and writes. Each KV head selects among its live positions only (sel then names
     * positions), its selected entries' counters go up and it admits the new token, evicting as
     * the policy says (rekv_kv_pool_touch, rekv_kv_pool_admit). */
    uint8_t *count, *gone;
    int *n_gone;
    int cap, limit;
    int policy; /* rekv_kv_pool_policy */
} rekv_ig_seq;

/* What every sequence of a selection shares. */
typedef struct rekv_ig_shape {
    int n_heads, n_kv, head_dim;
    size_t row_bytes;          /* a K or V row of the cache (rekv_kv_row_bytes) */
    float alpha, max_fraction; /* rekv_ig_select's */
    rekv_select how;
} rekv_ig_shape;

/* ig_select's scratch per sequence: the group sums and one more row, the scores a pool leaves
 * ([n_heads][len]), the pool's live positions ([n_kv][len]), the heads' statistics */
static inline size_t rekv_ig_scratch_floats(int len, int n_heads, int n_kv)
{
    return (size_t)(2 * n_kv + 1 + n_heads) * (size_t)len + 3 * (size_t)n_heads;
}

/* One sequence of clo's decisions on the device (clo_decide) at a layer > 0 (mode_clo.c): its
 * speculation, its state and where the decisions go. */
typedef struct rekv_clo_seq {
    size_t scores;          /* its speculated scores: scores + this, [n_heads][len] */
    const float *q;         /* its speculated queries, [n_heads][head_dim] (device) */
    float *label;           /* [n_heads][head_dim] each query head's label, the query its KV
                               head's top-k was chosen for (device memory the decisions keep) */
    int32_t *klen;          /* [n_kv] each KV head's cached tokens, -1: none (the plan reads it,
                               and sets a persistent head's) */
    int len, K;             /* context tokens; the top-k region's slots */
    float *scratch;         /* device memory: rekv_ig_scratch_floats(len, n_heads, n_kv) floats */
    int32_t *head_k;        /* out, [n_kv]: 0 a hit, k a miss, -1 a persistent head */
    int32_t *sel;           /* out, [n_kv][K]: a miss's k tokens, as offsets past the sink,
                               ascending */
    int32_t *skip;          /* out, [n_kv]: K - klen, the attention's skip (a persistent head's
                               is the plan's) */
    const uint64_t *blocks; /* [block] the arena offset of the layer's block b (t / 16) */
    void *kv;               /* its head cache at the layer: a miss's j-th token of k goes to
                               slot K - k + j */
} rekv_clo_seq;

/* What every sequence of clo's decisions shares (one layer's). */
typedef struct rekv_clo_shape {
    int n_heads, n_kv, head_dim;
    size_t row_bytes;       /* a K or V row of the cache */
    float frac;             /* a miss fetches round(frac * len) tokens (at most K and the middle) */
    const double *imp;      /* [n_heads] the query heads' importances (device) */
    const double *tau;      /* [n_kv] the KV heads' reuse thresholds (device) */
    const uint8_t *persist; /* [n_kv] the persistent heads (device) */
} rekv_clo_shape;

/* One row of a draw on the device (sample): a sampler's parameters and the number it drew
 * (gpuworker.h: rekv_sampler_draw, rekv_sample_drawn), and the top logits to report. */
typedef struct rekv_sample_row {
    float temperature; /* <= 0: greedy */
    float top_p;
    float u; /* in [0, 1) */
    int top_k;
    int n_top;  /* also the n_top largest logits (0: none) ... */
    int top_at; /* ... at top_ids / top_vals + top_at */
    int logprob; /* 1: also lp[r], what the drawn token's log-probability takes */
} rekv_sample_row;

/* A row's draw, for log-probabilities (rekv_sample_row.logprob): logit - lse is a token's. */
typedef struct rekv_sample_lp {
    double lse;  /* rekv_logsumexp of the row: log(sum exp(logits)), in double */
    float logit; /* the drawn token's logit */
    float pad;
} rekv_sample_lp;

typedef struct rekv_kernel_iface {
    /* y[m][n] = x[m][k] · w[n][k]^T (+ bias), w in dtype wt (f32, f16 or bf16, or GGUF blocks:
     * cpu_qgemm_wt, decoded inside the GEMM), accumulated in fp32. On the cpu backend every
     * element is computed in a fixed order whatever rows share the call, and 16-bit and
     * quantized weights are widened exactly (cpu_gemm.c, cpu_qgemm.c), so results never depend on
     * batching: recomputed K,V equal the originals and a sequence's tokens do not depend on its
     * batch. The cuda backend rounds x to wt for 16-bit weights (tensor cores) and uses cuBLAS;
     * quantized weights it decodes into f16 first, and rounds x to f16. */
    void (*linear)(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                   const float *bias, int m, int n, int k);
    /* out = LayerNorm (b != NULL) or RMSNorm of m rows of width d */
    void (*norm)(rekv_stream *s, float *out, const float *in, const float *w, const float *b, int m,
                 int d, float eps);
    /* rotates m rows of n_heads heads at positions pos[m] (device); head_dim <= 512, == 2 *
     * f->half. f (host memory, the engine's table; read at the call, not kept) gives the
     * frequencies and the cos/sin factor (loader.h, rekv_rope_freqs) */
    void (*rope)(rekv_stream *s, float *x, const int32_t *pos, int m, int n_heads, int head_dim,
                 const rekv_rope_freqs *f, rekv_rope style);
    /* a = act(a) (* b for the gated ones: SiLU, tanh GELU) over n elements */
    void (*activation)(rekv_stream *s, float *a, const float *b, size_t n, rekv_act act);
    /* x += y over n elements */
    void (*add)(rekv_stream *s, float *x, const float *y, size_t n);
    /* x[i] = table[tokens[i]] (width e, table in dtype tt, widened; quantized rows decoded to
     * ggml's values) for m rows (skipped when table is NULL); then, when pos_table, x[i] +=
     * pos_table[pos[i] + pos_offset] (width e, fp32) — OPT's learned positions */
    void (*embed)(rekv_stream *s, float *x, const void *table, rekv_dtype tt, const int32_t *tokens,
                  const float *pos_table, const int32_t *pos, int pos_offset, int m, int e);
    /* writes fp32 rows of K and V ([rows][n_kv*head_dim]) into sequences' buffers in dtype dt
     * (rounded to nearest even): row r goes to seqs[row_seq[r]] at position row_pos[r]; or, when
     * head_pos is not NULL ([rows][n_kv]), KV head g of row r to slot head_pos[r * n_kv + g] (not
     * written where negative; infinigen's recomputed rows, each head its own selection's slot) */
    void (*kv_scatter)(rekv_stream *s, const float *k, const float *v, int rows,
                       const int32_t *row_seq, const int32_t *row_pos, const int32_t *head_pos,
                       const rekv_attn_seq *seqs, int n_kv, int head_dim, rekv_dtype dt);
    /* kv_scatter's K half backwards: k[r][g * head_dim + j] = element j of KV head g's K row at
     * slot row_pos[r] of seqs[row_seq[r]]'s buffer (dtype dt), widened to fp32 exactly as
     * attention reads it (int8/int4 dequantized); row_seq NULL: every row from seqs[0]; row_pos
     * NULL: row r from slot r. A K row as the cache holds it, for what is derived from it
     * (infinigen's partial keys), so that the same token gives the same bits from a new row and
     * from a cached block. */
    void (*kv_gather)(rekv_stream *s, float *k, int rows, const int32_t *row_seq,
                      const int32_t *row_pos, const rekv_attn_seq *seqs, int n_kv, int head_dim,
                      rekv_dtype dt);
    /* causal attention of every sequence's new rows over its buffer (dtype dt, widened exactly);
     * q/out [rows][n_heads*hd] fp32, rows the sum of the sequences' n; scores: device scratch of
     * max(start + n) floats. The cuda backend splits the contexts of a small decode batch over
     * the device (flash-decoding) */
    void (*attention)(rekv_stream *s, float *out, const float *q, const rekv_attn_seq *seqs,
                      int n_seqs, int rows, int n_heads, int n_kv, int head_dim, float *scores,
                      rekv_dtype dt);
    /* converts pieces from dtype into fp32 */
    void (*convert)(rekv_stream *s, const rekv_convert_piece *pieces, size_t n, rekv_dtype dtype);
    /* dst = src converted from fp32 to dtype, n elements (for storing into the cache) */
    void (*convert_out)(rekv_stream *s, void *dst, const float *src, size_t n, rekv_dtype dtype);
    /* dst[i] = src[idx[i]] rows of width w */
    void (*gather_rows)(rekv_stream *s, float *dst, const float *src, const int32_t *idx, int n,
                        int w);
    /* infinigen's skew (gpuworker/skew.h): per row r and head h, the rk columns
     * out[r][h][c] = sum_d in[r][h * hd + d] * a[h / group][d][c] (a: [n_heads / group][hd][rk]
     * fp32, i.e. A[:, cols] per KV head). Row r goes to out_rows[r] when out_rows is not NULL (a
     * device array of device pointers), else to out + r * n_heads * rk. */
    void (*head_proj)(rekv_stream *s, float *out, float *const *out_rows, const float *in,
                      const float *a, int rows, int n_heads, int group, int hd, int rk);
    /* infinigen's speculated attention scores: for seqs[j] and head h, over t < len,
     * out[seqs[j].out + h * len + t] = scale * sum_c q[row][h][c] * pk[t][h / group][c]
     * (q: [rows][n_heads][rk]) */
    void (*spec_scores)(rekv_stream *s, float *out, const float *q, const rekv_spec_seq *seqs,
                        int n, int n_heads, int group, int rk, float scale);
    /* token selection on the device, so that only the choices cross back: for each of n rows of
     * logits ([n][vocab]), ids[r] = rekv_sample_drawn's choice with rows[r] (the cpu backend
     * calls it; cuda follows its definition with sums in fixed point: the same greedy choice and,
     * sampling, the same distribution), and the rows[r].n_top largest logits as (id, logit) pairs
     * in any order (rekv_top_logits' set: lower id first on ties), and for rows[r].logprob
     * lp[r]. rows: memory the device reads; scratch: device memory of 8 * vocab bytes (the cpu
     * backend's) */
    void (*sample)(rekv_stream *s, int32_t *ids, int32_t *top_ids, float *top_vals,
                   rekv_sample_lp *lp, const float *logits, const rekv_sample_row *rows, int n,
                   int vocab, void *scratch);
    /* linear over w in the cpu GEMM's tile layout (cpu_gemm.c: each block of 8 rows interleaved
     * in chunks of 8 elements; the engine keeps its matrices so, engine_internal.h): the same
     * bits as linear over the row-major matrix. NULL where linear reads row-major weights only
     * (cuda): a pipeline there makes the engine's weights row-major (rekv_engine_untile). */
    void (*linear_tiled)(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                         const float *bias, int m, int n, int k);
    /* The attention's input projection as one GEMM: w is a layer's W_Q, W_K, W_V concatenated
     * by rows ([n_heads + 2 n_kv heads][head_dim][k] in dtype wt, row-major), bias their biases
     * likewise (fp32, NULL: none). q ([m][n_heads * head_dim]), k and v ([m][n_kv * head_dim])
     * get what linear would put there for each matrix, bias added, and q and k are then rotated
     * as rope does (pos, f, style; REKV_ROPE_NONE: not rotated): three linears and two ropes in
     * one GEMM and one kernel. NULL where the backend runs those separately (cpu: the reference,
     * whose matrices stay apart); the pipeline concatenates a layer's matrices at upload only
     * for a backend that has it (pipeline_create.c, pl_qkv_pack). */
    void (*qkv)(rekv_stream *s, float *q, float *k, float *v, const float *x, const void *w,
                rekv_dtype wt, const float *bias, int m, int kdim, int n_heads, int n_kv,
                int head_dim, const int32_t *pos, const rekv_rope_freqs *f, rekv_rope style);
    /* The bias of the linear before them folded into the next pass, so that it costs no pass
     * of its own: a[r][c] = act(a[r][c] + bias[c]) (* b[r][c] for gated SiLU), and x[r][c] +=
     * y[r][c] + bias[c] (the residual add), m rows of width n — what linear with the bias and
     * then activation or add give, the same sums in the same order. NULL where linear adds the
     * bias (cpu); the pipeline folds biases only where both exist. */
    void (*bias_activation)(rekv_stream *s, float *a, const float *bias, const float *b, int m,
                            int n, rekv_act act);
    void (*bias_add)(rekv_stream *s, float *x, const float *y, const float *bias, int m, int n);
    /* x *= a over n elements (Gemma's embeddings times sqrt(hidden)) */
    void (*scale)(rekv_stream *s, float *x, size_t n, float a);
    /* x = cap * tanh(x / cap) over n elements (Gemma-2's final_logit_softcapping) */
    void (*softcap)(rekv_stream *s, float *x, size_t n, float cap);
    /* infinigen's selection on the device (pipeline_infinigen.c), so that no host function
     * stands between a layer's speculation and its fetch: for each of n sequences, rekv_ig_select's
     * count m and each KV head's top m tokens of [dev, len) by its query group's summed softmax
     * of the speculated scores (lowest position first on ties; or m at random, or all, as
     * shape->how says) into sel and *m, and *start = *slot = dev + m; then the selected rows'
     * copies for copy_h2d_listed: pieces[0..*n_pieces), sequence by sequence, K rows then V rows,
     * head by head, token by token, each from arena (where the device reads the kvstore's arena:
     * rekv_host_mapped) plus its block's offset and row, to its slot in kv. pieces: room for
     * 2 n_kv m rows of every sequence; shape is read at the call. The cpu backend runs
     * rekv_ig_select (the step thread's selection, bit for bit); cuda the same steps with its own
     * exponential and sums, so a near-tie may rank otherwise. NULL: not on this backend. */
    void (*ig_select)(rekv_stream *s, const float *scores, const rekv_ig_seq *seqs, int n,
                      const rekv_ig_shape *shape, const uint8_t *arena, rekv_copy_piece *pieces,
                      size_t *n_pieces);
    /* clo's decisions on the device (mode_clo.c), so that no host function stands between a
     * layer's speculation and its fetch: for each of n sequences and each KV head g that is not
     * persistent, rekv_clo_decide — a hit when the group's similarity of its queries to their
     * labels (Eq. 10, importances imp) reaches tau[g] (head_k[g] = 0), else a miss: its top k
     * tokens between the sink and the recent window by the group's summed softmax into sel
     * (head_k[g] = k), its queries the labels, klen[g] = k — then skip[g] = K - klen[g]; and a
     * miss's rows' copies for copy_h2d_listed: pieces[0..*n_pieces), sequence by sequence, head by
     * head, token by token, each K row then V row, from arena (rekv_host_mapped) plus its block's
     * offset to slot K - k + j of kv. pieces: room for 2 k of every KV head; shape is read at the
     * call. The cpu backend runs rekv_clo_decide (the host's decisions, bit for bit); cuda the
     * same steps with its own exponential and sums (a near-tie may rank otherwise; the
     * similarities in double, as the host's). NULL: not on this backend. */
    void (*clo_decide)(rekv_stream *s, const float *scores, const rekv_clo_seq *seqs, int n,
                       const rekv_clo_shape *shape, const uint8_t *arena, rekv_copy_piece *pieces,
                       size_t *n_pieces);
} rekv_kernel_iface;

extern const rekv_kernel_iface rekv_cpu_kernels;

/* The kernels that run on be's streams (by its runtime's name): cpu's, or cuda's from the module
 * the cuda backend was loaded from (device/backend_cuda.h); NULL for a backend with none. */
const rekv_kernel_iface *rekv_kernels_of(const rekv_backend *be);

#endif
