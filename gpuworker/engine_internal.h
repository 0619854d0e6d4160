/* engine_internal.h — the engine's fp32 weights, shared by the reference forward pass
 * (forward.c) and the decode pipeline (pipeline.c). Private to gpuworker. */
#ifndef REKV_GPUWORKER_ENGINE_INTERNAL_H
#define REKV_GPUWORKER_ENGINE_INTERNAL_H

#include <stddef.h>

#include "gpuworker/gpuworker.h"

/* One decoder layer's weights in fp32; NULL where the architecture has none. Shapes as in
 * rekv_layer_weights ([out][in] for linear layers). */
typedef struct layer_f32 {
    float *attn_norm_w, *attn_norm_b; /* [hidden] */
    float *wq, *bq;                   /* [q_dim][hidden], [q_dim] */
    float *wk, *bk;                   /* [kv_dim][hidden], [kv_dim] */
    float *wv, *bv;                   /* [kv_dim][hidden], [kv_dim] */
    float *wo, *bo;                   /* [hidden][q_dim], [hidden] */
    float *ffn_norm_w, *ffn_norm_b;   /* [hidden] */
    float *w1, *b1;                   /* [ffn][hidden], [ffn] */
    float *w2, *b2;                   /* [hidden][ffn], [hidden] */
    float *w3;                        /* [ffn][hidden] */
} layer_f32;

struct rekv_engine {
    rekv_model_config c;
    float *embed;        /* [vocab][embed_dim] */
    float *pos_embed;    /* OPT: [max_pos + 2][hidden] */
    float *project_in;   /* [hidden][embed_dim] or NULL */
    float *project_out;  /* [embed_dim][hidden] or NULL */
    float *final_norm_w, *final_norm_b; /* [hidden] */
    float *lm_head;      /* [vocab][embed_dim]; aliases embed when tied */
    layer_f32 *layers;   /* [n_layers] */
    /* scratch, grown on demand to the largest batch seen (T token rows) */
    size_t cap_rows;
    float *x;      /* [T][hidden] residual stream */
    float *h;      /* [T][max(hidden, embed_dim)] normalised input */
    float *q;      /* [T][q_dim] */
    float *k;      /* [T][kv_dim] */
    float *v;      /* [T][kv_dim] */
    float *att;    /* [T][q_dim] */
    float *f1;     /* [T][ffn] */
    float *f3;     /* [T][ffn] */
    float *rope_cos, *rope_sin; /* [T][head_dim/2] */
    int *pos;      /* [T] */
    float *scores; /* [max_pos] */
};

#endif
