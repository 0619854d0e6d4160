/* engine_internal.h — the engine's weights, shared by the reference forward pass
 * (forward.c) and the decode pipeline (pipeline.c). Private to gpuworker. */
#ifndef REKV_GPUWORKER_ENGINE_INTERNAL_H
#define REKV_GPUWORKER_ENGINE_INTERNAL_H

#include <stddef.h>

#include "common/log.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/cpu_qgemm.h"
#include "gpuworker/gpuworker.h"

/* One decoder layer's weights; NULL where the architecture has none. Shapes as in
 * rekv_layer_weights ([out][in] for linear layers). The matrices (wq, wk, wv, wo, w1, w2, w3) are
 * in the engine's weight dtype (rekv_engine.wdtype), the vectors (norms, biases) in fp32. Every
 * field is a void * so that code can walk a layer's tensors as an array (see pipeline_create.c). */
typedef struct layer_w {
    void *attn_norm_w, *attn_norm_b; /* [hidden] */
    void *wq, *bq;                   /* [q_dim][hidden], [q_dim] */
    void *wk, *bk;                   /* [kv_dim][hidden], [kv_dim] */
    void *wv, *bv;                   /* [kv_dim][hidden], [kv_dim] */
    void *wo, *bo;                   /* [hidden][q_dim], [hidden] */
    void *ffn_norm_w, *ffn_norm_b;   /* [hidden] */
    void *w1, *b1;                   /* [ffn][hidden], [ffn] */
    void *w2, *b2;                   /* [hidden][ffn], [hidden] */
    void *w3;                        /* [ffn][hidden] */
    void *post_attn_norm_w;          /* Gemma-2: [hidden] fp32, or NULL */
    void *post_ffn_norm_w;           /* Gemma-2: [hidden] fp32, or NULL */
} layer_w;

/* A layer's matrices, as indices into rekv_engine.lqt. */
enum { LQT_WQ, LQT_WK, LQT_WV, LQT_WO, LQT_W1, LQT_W2, LQT_W3, LQT_N };

/* The weights are held in the model file's dtype (matrices) — an f16 model takes half the memory
 * of its fp32 widening and moves half the bytes — and every GEMM widens them exactly, so results
 * are those of the fp32 widening. */
struct rekv_engine {
    rekv_model_config c;
    rekv_dtype wdtype; /* dtype of the matrices: the file's when all share one, else F32 */
    void *embed;       /* [vocab][embed_dim], wdtype */
    float *pos_embed;  /* OPT: [max_pos + 2][hidden] */
    void *project_in;  /* [hidden][embed_dim] or NULL, wdtype */
    void *project_out; /* [embed_dim][hidden] or NULL, wdtype */
    float *final_norm_w, *final_norm_b; /* [hidden] */
    rekv_rope_freqs rope;               /* RoPE's frequencies (c.rope != NONE), made once here */
    void *lm_head;                      /* [vocab][embed_dim], wdtype; aliases embed when tied */
    /* 1: the matrices only a GEMM reads — the layers', project_in/out and an untied lm_head —
     * are in the cpu GEMM's tile layout (cpu_tile_pack: the same bytes, permuted within blocks of
     * 8 rows), so a decode step's tiles read one sequential stream; embed, whose rows are looked
     * up, and so a head tied to it, stay row-major. Set at creation; rekv_engine_untile (a
     * backend whose kernels have no linear_tiled) makes every matrix row-major again. Either way
     * the cpu GEMM gives the same bits. */
    int tiled;
    layer_w *layers;  /* [n_layers], each layer's tensors packed in layer_mem[l] */
    void **layer_mem; /* [n_layers] blocks of layer_bytes */
    size_t layer_bytes;  /* the largest layer's (a quantized file may mix block types by layer) */
    size_t layers_bytes; /* every layer's tensors, summed */
    size_t embed_bytes, head_bytes; /* embed's and an untied lm_head's bytes, as held */
    /* Matrices kept in GGUF blocks as the file holds them (rekv_tensor.qtype: Q8_0, Q4_0, Q4_K,
     * Q6_K): their block types, 0 for a matrix in wdtype. Such a matrix stays row-major (never
     * tiled); rekv_engine_gemm, and the cpu kernels' linear (a wdtype of cpu_qgemm_wt), multiply
     * with it through cpu_qgemm_rowinv; embed's rows are dequantized as they are looked up. */
    uint32_t (*lqt)[LQT_N];     /* [n_layers][LQT_*] */
    uint32_t embed_qt, head_qt; /* head_qt == embed_qt when tied */
    int n_qmats;                /* quantized matrices in all (0: none) */
    /* scratch, grown on demand to the largest pass seen (T token rows: at most forward.c's
     * FWD_ROWS, but for a call with a tap) */
    size_t cap_rows;
    float *x;                   /* [T][hidden] residual stream */
    float *h;                   /* [T][max(hidden, embed_dim)] normalised input */
    float *q;                   /* [T][q_dim] */
    float *k;                   /* [T][kv_dim] */
    float *v;                   /* [T][kv_dim] */
    float *att;                 /* [T][q_dim] */
    float *f1;                  /* [T][ffn] */
    float *f3;                  /* [T][ffn] */
    float *rope_cos, *rope_sin; /* [T][head_dim/2] */
    int *pos;                   /* [T] */
    float *scores;              /* [max_pos] */
    /* A measuring tap (skew.c, heads.c, premises.c), NULL by default: when set,
     * attention_block calls it once per layer per forward step, after the projections' biases
     * and RoPE, with the step's rows of every batch item stacked in item order: x the block's
     * input (the residual stream) and h the attention input [rows][hidden], q [rows][q_dim], k
     * and v [rows][kv_dim], fp32 (the engine's scratch, valid only during the call; its RoPE
     * tables rope_cos/rope_sin hold the rows' positions). It must not call back into the
     * engine. */
    void (*tap)(void *ctx, int layer, const float *x, const float *h, const float *q,
                const float *k, const float *v, int rows);
    void *tap_ctx;
};

/* The GGUF block type of w, one of e's own matrices, or 0 when it is in e->wdtype. */
static inline uint32_t rekv_engine_qtype(const rekv_engine *e, const void *w)
{
    if (e->n_qmats == 0 || w == NULL)
        return 0;
    if (w == e->embed)
        return e->embed_qt;
    if (w == e->lm_head)
        return e->head_qt;
    for (int l = 0; l < e->c.n_layers; l++) {
        const layer_w *L = &e->layers[l];
        const void *m[LQT_N] = {L->wq, L->wk, L->wv, L->wo, L->w1, L->w2, L->w3};
        for (int i = 0; i < LQT_N; i++)
            if (m[i] == w)
                return e->lqt[l][i];
    }
    return 0;
}

/* The weight dtype a kernel is given for a matrix of block type qt (0: e->wdtype). */
static inline rekv_dtype rekv_engine_wt(const rekv_engine *e, uint32_t qt)
{
    return qt ? cpu_qgemm_wt(qt) : e->wdtype;
}

/* The GEMM's layout of w, one of e's matrices: tiled (1) or row-major (0). */
static inline int rekv_engine_w_tiled(const rekv_engine *e, const void *w)
{
    return e->tiled && w != e->embed && rekv_engine_qtype(e, w) == 0;
}

/* y = x·w^T (+ bias) over one of e's matrices, by its type (quantized blocks: cpu_qgemm_rowinv;
 * wdtype: cpu_gemm_rowinv) and in the layout e keeps it. Every path gives the bits of the fp32
 * GEMM over the matrix's fp32 values. */
static inline void rekv_engine_gemm(const rekv_engine *e, float *y, const float *x, const void *w,
                                    const float *bias, int m, int n, int k)
{
    uint32_t qt = rekv_engine_qtype(e, w);
    if (qt) {
        /* the type and the row length were checked at load: nothing left to refuse */
        int rc = cpu_qgemm_rowinv(y, x, w, qt, bias, m, n, k);
        REKV_ASSERT(rc == 0);
        return;
    }
    (rekv_engine_w_tiled(e, w) ? cpu_gemm_rowinv_tiled : cpu_gemm_rowinv)(y, x, w, e->wdtype, bias,
                                                                          m, n, k);
}

#endif
