/* forward.c — the reference forward pass (cpu, fp32 compute) for the OPT and Llama families
 * (Gemma's and Gemma-2's departures from Llama included: scaled embeddings, (1 + w) norms, GeGLU,
 * post-norms, soft-capping, windows on alternate layers).
 *
 * One call processes a batch of sequences with any number of new tokens each. Token rows of all
 * sequences are stacked into one [T][hidden] matrix so every projection is a single GEMM; only
 * attention runs per sequence, over that sequence's cache. */
#include "gpuworker/gpuworker.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/engine_internal.h"
#include "loader/gguf.h"

struct rekv_seq {
    rekv_engine *e;
    int len;   /* tokens in the cache */
    int cap;   /* capacity in tokens */
    float *kv; /* [n_layers] caches of cap positions (kvlayout.h) */
};

/* A tensor in dtype wt: copied as it is when the file has it in wt, else widened to fp32 — the
 * only other wt: vectors are always F32, and matrices are in wt unless weight_dtype() chose F32
 * because the file mixes dtypes, so nothing is ever rounded. */
static void convert_into(void *dst, const rekv_tensor *t, rekv_dtype wt)
{
    size_t n = (size_t)rekv_tensor_numel(t);
    if (t->qtype) /* GGUF blocks, kept as the file has them */
        memcpy(dst, t->data, t->nbytes);
    else if (t->dtype == wt)
        memcpy(dst, t->data, n * rekv_dtype_size(wt));
    else
        rekv_to_f32(dst, t->data, t->dtype, n);
}

/* A matrix t (in the engine's dtype wt) just converted into dst, into the cpu GEMM's tile layout
 * (engine_internal.h: tiled). */
static void tile(void *dst, const rekv_tensor *t, rekv_dtype wt, int *rc)
{
    if (dst == NULL || *rc || t->qtype) /* quantized blocks stay row-major */
        return;
    REKV_ASSERT(t->ndim == 2 && t->shape[0] <= INT32_MAX && t->shape[1] <= INT32_MAX);
    void *scratch = malloc(cpu_tile_scratch_bytes(wt, (int)t->shape[1]) + 1);
    if (scratch == NULL) {
        *rc = -ENOMEM;
        return;
    }
    cpu_tile_pack(dst, wt, (int)t->shape[0], (int)t->shape[1], scratch);
    free(scratch);
}

/* The bytes t takes in dtype wt (quantized blocks: as they are). */
static size_t held_bytes(const rekv_tensor *t, rekv_dtype wt)
{
    return t->qtype ? t->nbytes : (size_t)rekv_tensor_numel(t) * rekv_dtype_size(wt);
}

/* t's block type (0: a plain dtype), counted among e's quantized matrices. */
static uint32_t note_qt(rekv_engine *e, const rekv_tensor *t)
{
    if (t == NULL || t->qtype == 0)
        return 0;
    e->n_qmats++;
    return t->qtype;
}

/* t converted into a malloc'd copy; t's pages of m's file mapping then leave memory (one copy
 * of the weights in the process, not two). */
static void *to_wdtype(const rekv_model *m, const rekv_tensor *t, rekv_dtype wt, int *rc)
{
    if (t == NULL || *rc)
        return NULL;
    void *p = malloc(held_bytes(t, wt) + 1);
    if (p == NULL) {
        *rc = -ENOMEM;
        return NULL;
    }
    convert_into(p, t, wt);
    rekv_model_release(m, t);
    return p;
}

/* A layer's tensors packed into one block (one host registration per layer when the weights are
 * offloaded). With base NULL it only measures; packing releases each tensor's file pages (m). */
typedef struct wpack {
    char *base;
    size_t off;
    const rekv_model *m;
} wpack;

static void *place(wpack *p, const rekv_tensor *t, rekv_dtype dt)
{
    if (t == NULL)
        return NULL;
    size_t bytes = held_bytes(t, dt);
    void *dst = p->base ? p->base + p->off : NULL;
    p->off += (bytes + 63) & ~(size_t)63;
    if (dst) {
        convert_into(dst, t, dt);
        rekv_model_release(p->m, t);
    }
    return dst;
}

/* A matrix, placed and tiled. */
static void *place_mat(wpack *p, const rekv_tensor *t, rekv_dtype wt, int *rc)
{
    void *dst = place(p, t, wt);
    tile(dst, t, wt, rc);
    return dst;
}

/* Gemma's RMSNorm multiplies by (1 + w), the 1 added to the fp32 weight (HF: 1.0 +
 * weight.float()): done once here, so that every backend's norm multiplies by what it holds. */
static void add_one(float *w, const rekv_tensor *t, int add)
{
    if (w == NULL || !add)
        return;
    for (int64_t i = 0, n = rekv_tensor_numel(t); i < n; i++)
        w[i] += 1.0f;
}

/* A norm's weight, placed (in fp32) and made a factor. */
static void *place_norm(wpack *p, const rekv_tensor *t, int add)
{
    void *w = place(p, t, REKV_DTYPE_F32);
    add_one(w, t, add);
    return w;
}

static void load_layer(wpack *p, const rekv_layer_weights *s, layer_w *d, rekv_dtype wt,
                       int norm_add_one, int *rc)
{
    const rekv_dtype f = REKV_DTYPE_F32;
    const int a1 = norm_add_one;
    d->attn_norm_w = place_norm(p, s->attn_norm_w, a1);
    d->attn_norm_b = place(p, s->attn_norm_b, f);
    d->wq = place_mat(p, s->wq, wt, rc);
    d->bq = place(p, s->bq, f);
    d->wk = place_mat(p, s->wk, wt, rc);
    d->bk = place(p, s->bk, f);
    d->wv = place_mat(p, s->wv, wt, rc);
    d->bv = place(p, s->bv, f);
    d->wo = place_mat(p, s->wo, wt, rc);
    d->bo = place(p, s->bo, f);
    d->ffn_norm_w = place_norm(p, s->ffn_norm_w, a1);
    d->ffn_norm_b = place(p, s->ffn_norm_b, f);
    d->w1 = place_mat(p, s->w1, wt, rc);
    d->b1 = place(p, s->b1, f);
    d->w2 = place_mat(p, s->w2, wt, rc);
    d->b2 = place(p, s->b2, f);
    d->w3 = place_mat(p, s->w3, wt, rc);
    d->post_attn_norm_w = place_norm(p, s->post_attn_norm_w, a1);
    d->post_ffn_norm_w = place_norm(p, s->post_ffn_norm_w, a1);
}

/* The tiled matrices of one layer (or, for l < 0, the model's own) with their shapes. */
static int tiled_mats(const rekv_engine *e, int l, void **w, int *n, int *k)
{
    const rekv_model_config *c = &e->c;
    int H = c->hidden, E = c->embed_dim, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c);
    int F = c->ffn, i = 0;
    if (l < 0) {
        void *m[] = {e->project_in, e->project_out, e->lm_head != e->embed ? e->lm_head : NULL};
        int mn[] = {H, E, c->vocab}, mk[] = {E, H, E};
        for (int j = 0; j < 3; j++)
            if (m[j])
                w[i] = m[j], n[i] = mn[j], k[i++] = mk[j];
        return i;
    }
    const layer_w *L = &e->layers[l];
    void *m[] = {L->wq, L->wk, L->wv, L->wo, L->w1, L->w2, L->w3};
    int mn[] = {Q, KV, KV, H, F, H, F}, mk[] = {H, H, H, Q, H, F, H};
    for (int j = 0; j < 7; j++)
        if (m[j])
            w[i] = m[j], n[i] = mn[j], k[i++] = mk[j];
    return i;
}

int rekv_engine_untile(rekv_engine *e, rekv_err *err)
{
    if (!e->tiled)
        return 0;
    const rekv_model_config *c = &e->c;
    int kmax = c->hidden > c->ffn ? c->hidden : c->ffn;
    int q = rekv_config_q_dim(c);
    kmax = kmax > q ? kmax : q;
    kmax = kmax > c->embed_dim ? kmax : c->embed_dim;
    void *scratch = malloc(cpu_tile_scratch_bytes(e->wdtype, kmax));
    if (scratch == NULL)
        return rekv_errf(err, -ENOMEM, "engine: out of memory to untile the weights");
    for (int l = -1; l < c->n_layers; l++) {
        void *w[7];
        int n[7], k[7], nm = tiled_mats(e, l, w, n, k);
        for (int j = 0; j < nm; j++)
            if (rekv_engine_qtype(e, w[j]) == 0) /* quantized blocks were never tiled */
                cpu_tile_unpack(w[j], e->wdtype, n[j], k[j], scratch);
    }
    free(scratch);
    e->tiled = 0;
    return 0;
}

/* The dtype the engine keeps its matrices in: the file's, when every matrix has the same one.
 * Quantized matrices (kept as blocks) do not count; when all are, F32 (unused). */
static rekv_dtype weight_dtype(const rekv_weights *w, int n_layers)
{
    const rekv_tensor *ts[] = {w->embed_tokens, w->project_in, w->project_out, w->lm_head};
    int have = 0;
    rekv_dtype d = REKV_DTYPE_F32;
    for (int l = -1; l < n_layers; l++) {
        const rekv_layer_weights *s = l >= 0 ? &w->layers[l] : NULL;
        const rekv_tensor *lm[] = {s ? s->wq : NULL, s ? s->wk : NULL, s ? s->wv : NULL,
                                   s ? s->wo : NULL, s ? s->w1 : NULL, s ? s->w2 : NULL,
                                   s ? s->w3 : NULL};
        const rekv_tensor *const *m = l < 0 ? ts : lm;
        int nm = l < 0 ? 4 : 7;
        for (int i = 0; i < nm; i++) {
            if (m[i] == NULL || m[i]->qtype)
                continue;
            if (have && m[i]->dtype != d)
                return REKV_DTYPE_F32;
            d = m[i]->dtype, have = 1;
        }
    }
    return d;
}

void rekv_engine_free(rekv_engine *e)
{
    if (e == NULL)
        return;
    if (e->layer_mem)
        for (int l = 0; l < e->c.n_layers; l++)
            free(e->layer_mem[l]);
    free(e->layer_mem);
    free(e->layers);
    free(e->lqt);
    if (e->lm_head != e->embed)
        free(e->lm_head);
    free(e->embed);
    free(e->pos_embed);
    free(e->project_in);
    free(e->project_out);
    free(e->final_norm_w);
    free(e->final_norm_b);
    free(e->x);
    free(e->h);
    free(e->q);
    free(e->k);
    free(e->v);
    free(e->att);
    free(e->f1);
    free(e->f3);
    free(e->rope_cos);
    free(e->rope_sin);
    free(e->pos);
    free(e->scores);
    free(e);
}

int rekv_engine_create(const rekv_model *m, rekv_engine **out, rekv_err *err)
{
    rekv_engine *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return rekv_errf(err, -ENOMEM, "engine: out of memory");
    e->c = m->config;
    const rekv_weights *w = &m->weights;
    int rc = 0;
    rekv_err rerr = {0};
    if (e->c.rope != REKV_ROPE_NONE && (rc = rekv_rope_freqs_init(&e->rope, &e->c, &rerr))) {
        free(e);
        return rekv_errf(err, rc, "%s: %s", m->path, rerr.msg);
    }
    e->layers = calloc((size_t)e->c.n_layers, sizeof(layer_w));
    if (e->layers == NULL)
        rc = -ENOMEM;
    rekv_dtype wt = e->wdtype = weight_dtype(w, e->c.n_layers);
    e->embed = to_wdtype(m, w->embed_tokens, wt, &rc);
    e->embed_qt = e->head_qt = note_qt(e, w->embed_tokens);
    if (rc == 0)
        e->embed_bytes = held_bytes(w->embed_tokens, wt);
    e->pos_embed = to_wdtype(m, w->embed_positions, REKV_DTYPE_F32, &rc);
    e->project_in = to_wdtype(m, w->project_in, wt, &rc);
    tile(e->project_in, w->project_in, wt, &rc);
    e->project_out = to_wdtype(m, w->project_out, wt, &rc);
    tile(e->project_out, w->project_out, wt, &rc);
    e->final_norm_w = to_wdtype(m, w->final_norm_w, REKV_DTYPE_F32, &rc);
    add_one(e->final_norm_w, w->final_norm_w, e->c.norm_add_one);
    e->final_norm_b = to_wdtype(m, w->final_norm_b, REKV_DTYPE_F32, &rc);
    if (w->lm_head == w->embed_tokens) {
        e->lm_head = e->embed;
    } else {
        e->lm_head = to_wdtype(m, w->lm_head, wt, &rc);
        tile(e->lm_head, w->lm_head, wt, &rc);
        e->head_qt = note_qt(e, w->lm_head);
        if (rc == 0)
            e->head_bytes = held_bytes(w->lm_head, wt);
    }
    e->tiled = 1;
    e->layer_mem = calloc((size_t)e->c.n_layers, sizeof(void *));
    e->lqt = calloc((size_t)e->c.n_layers, sizeof(*e->lqt));
    if (e->layer_mem == NULL || e->lqt == NULL)
        rc = -ENOMEM;
    for (int l = 0; l < e->c.n_layers && rc == 0; l++) {
        const rekv_layer_weights *s = &w->layers[l];
        const rekv_tensor *mt[LQT_N] = {s->wq, s->wk, s->wv, s->wo, s->w1, s->w2, s->w3};
        for (int i = 0; i < LQT_N; i++)
            e->lqt[l][i] = note_qt(e, mt[i]);
    }
    /* every layer's block as large as the largest (a quantized file may mix block types by
     * layer), so that a pipeline handles each the same */
    for (int l = 0; l < e->c.n_layers && rc == 0; l++) {
        wpack size = {NULL, 0, NULL};
        load_layer(&size, &w->layers[l], &e->layers[l], wt, e->c.norm_add_one, &rc);
        e->layer_bytes = size.off > e->layer_bytes ? size.off : e->layer_bytes;
        e->layers_bytes += size.off;
    }
    for (int l = 0; l < e->c.n_layers && rc == 0; l++) {
        /* whole pages of their own: a pipeline that streams the layers page-locks each block
         * (host_register), and CUDA refuses a block whose first or last page another has */
        size_t page = (size_t)sysconf(_SC_PAGESIZE);
        size_t bytes = (e->layer_bytes + page) / page * page;
        wpack pk = {aligned_alloc(page, bytes), 0, m};
        if (pk.base == NULL) {
            rc = -ENOMEM;
            break;
        }
        e->layer_mem[l] = pk.base;
        load_layer(&pk, &w->layers[l], &e->layers[l], wt, e->c.norm_add_one, &rc);
    }
    e->scores = malloc(sizeof(float) * (size_t)e->c.max_pos);
    if (rc == 0 && e->scores == NULL)
        rc = -ENOMEM;
    if (rc) {
        rekv_engine_free(e);
        return rekv_errf(err, rc, "%s: out of memory for the weights", m->path);
    }
    *out = e;
    return 0;
}

const rekv_model_config *rekv_engine_config(const rekv_engine *e)
{
    return &e->c;
}

rekv_dtype rekv_engine_weight_dtype(const rekv_engine *e)
{
    return e->wdtype;
}

size_t rekv_engine_weight_bytes(const rekv_engine *e)
{
    const rekv_model_config *c = &e->c;
    size_t w = rekv_dtype_size(e->wdtype), E = (size_t)c->embed_dim;
    size_t H = (size_t)c->hidden;
    size_t b = e->layers_bytes + e->embed_bytes + e->head_bytes;
    if (e->project_in)
        b += 2 * H * E * w; /* project_in and project_out */
    if (e->pos_embed)
        b += ((size_t)c->max_pos + 2) * H * sizeof(float);
    return b + 2 * H * sizeof(float); /* the final norm */
}

double rekv_engine_weight_elem_bytes(const rekv_engine *e)
{
    return e->n_qmats ? rekv_config_weight_elem_bytes(&e->c) : (double)rekv_dtype_size(e->wdtype);
}

size_t rekv_engine_step_weight_bytes(const rekv_engine *e)
{
    const rekv_model_config *c = &e->c;
    size_t w = rekv_dtype_size(e->wdtype), E = (size_t)c->embed_dim;
    size_t b = e->layers_bytes + (e->lm_head == e->embed ? e->embed_bytes : e->head_bytes);
    return e->project_out ? b + (size_t)c->hidden * E * w : b;
}

int rekv_seq_create(rekv_engine *e, int capacity, rekv_seq **out, rekv_err *err)
{
    if (capacity <= 0 || capacity > e->c.max_pos)
        return rekv_errf(err, -E2BIG, "sequence capacity %d is outside the model's context (1..%d)",
                         capacity, e->c.max_pos);
    rekv_seq *s = calloc(1, sizeof(*s));
    size_t n =
        (size_t)e->c.n_layers * rekv_kv_buffer_elems(e->c.n_kv_heads, e->c.head_dim, capacity);
    if (s == NULL || (s->kv = malloc(n * sizeof(float))) == NULL) {
        rekv_seq_free(s);
        return rekv_errf(err, -ENOMEM, "out of memory for a KV cache of %d tokens", capacity);
    }
    s->e = e;
    s->cap = capacity;
    *out = s;
    return 0;
}

void rekv_seq_free(rekv_seq *s)
{
    if (s == NULL)
        return;
    free(s->kv);
    free(s);
}

int rekv_seq_len(const rekv_seq *s)
{
    return s->len;
}

void rekv_seq_truncate(rekv_seq *s, int len)
{
    if (len >= 0 && len < s->len)
        s->len = len;
}

static int grow(float **p, size_t n)
{
    float *q = realloc(*p, n * sizeof(float));
    if (q == NULL)
        return -ENOMEM;
    *p = q;
    return 0;
}

static int reserve(rekv_engine *e, size_t T)
{
    if (T <= e->cap_rows)
        return 0;
    const rekv_model_config *c = &e->c;
    size_t H = (size_t)(c->hidden > c->embed_dim ? c->hidden : c->embed_dim);
    size_t Q = (size_t)rekv_config_q_dim(c), KV = (size_t)rekv_config_kv_dim(c);
    int rc = grow(&e->x, T * H) | grow(&e->h, T * H) | grow(&e->q, T * Q) | grow(&e->k, T * KV) |
             grow(&e->v, T * KV) | grow(&e->att, T * Q) | grow(&e->f1, T * (size_t)c->ffn) |
             grow(&e->f3, T * (size_t)c->ffn) | grow(&e->rope_cos, T * (size_t)c->head_dim / 2) |
             grow(&e->rope_sin, T * (size_t)c->head_dim / 2);
    int *pos = realloc(e->pos, T * sizeof(int));
    if (pos)
        e->pos = pos;
    if (rc || pos == NULL)
        return -ENOMEM;
    e->cap_rows = T;
    return 0;
}

/* The layer's cache (kvlayout.h). */
static float *layer_cache(rekv_seq *s, int layer)
{
    const rekv_model_config *c = &s->e->c;
    return s->kv + (size_t)layer * rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, s->cap);
}

/* Copies the new tokens' K and V rows ([m][kv_dim]) into the cache at positions start.. */
static void cache_store(rekv_seq *s, int layer, const float *k, const float *v, int m, int start)
{
    const rekv_model_config *c = &s->e->c;
    int hd = c->head_dim, n_kv = c->n_kv_heads;
    float *kv = layer_cache(s, layer);
    size_t vs = rekv_kv_v_shift(n_kv, hd);
    for (int i = 0; i < m; i++)
        for (int g = 0; g < n_kv; g++) {
            size_t dst = rekv_kv_row(n_kv, hd, g, start + i);
            memcpy(kv + dst, k + ((size_t)i * n_kv + g) * hd, sizeof(float) * (size_t)hd);
            memcpy(kv + dst + vs, v + ((size_t)i * n_kv + g) * hd, sizeof(float) * (size_t)hd);
        }
}

static void add_into(float *x, const float *y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
}


static void attention_block(rekv_engine *e, const layer_w *L, int layer, rekv_batch_item *items,
                            int n_items, int T)
{
    const rekv_model_config *c = &e->c;
    int H = c->hidden, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c);
    rekv_engine_gemm(e, e->q, e->h, L->wq, L->bq, T, Q, H);
    rekv_engine_gemm(e, e->k, e->h, L->wk, L->bk, T, KV, H);
    rekv_engine_gemm(e, e->v, e->h, L->wv, L->bv, T, KV, H);
    if (c->rope != REKV_ROPE_NONE) {
        cpu_rope(e->q, e->rope_cos, e->rope_sin, T, c->n_heads, c->head_dim, c->rope);
        cpu_rope(e->k, e->rope_cos, e->rope_sin, T, c->n_kv_heads, c->head_dim, c->rope);
    }
    if (e->tap)
        e->tap(e->tap_ctx, layer, e->x, e->h, e->q, e->k, e->v, T);
    rekv_attn_seq sq[n_items];
    int row = 0;
    for (int b = 0; b < n_items; b++) {
        rekv_seq *s = items[b].seq;
        int m = items[b].n_tokens;
        cache_store(s, layer, e->k + (size_t)row * KV, e->v + (size_t)row * KV, m, s->len);
        sq[b] = (rekv_attn_seq){.kv = layer_cache(s, layer),
                                .start = s->len,
                                .n = m,
                                .row0 = row,
                                .window = rekv_config_window(c, layer),
                                .scale = c->attn_scale,
                                .softcap = c->attn_softcap};
        row += m;
    }
    cpu_attention(e->att, e->q, sq, n_items, c->n_heads, c->n_kv_heads, c->head_dim, REKV_DTYPE_F32,
                  e->scores);
    rekv_engine_gemm(e, e->h, e->att, L->wo, L->bo, T, H, Q);
}

static void ffn_block(rekv_engine *e, const layer_w *L, int T)
{
    const rekv_model_config *c = &e->c;
    int H = c->hidden, F = c->ffn;
    rekv_engine_gemm(e, e->f1, e->h, L->w1, L->b1, T, F, H);
    if (L->w3) {
        rekv_engine_gemm(e, e->f3, e->h, L->w3, NULL, T, F, H);
        cpu_activation(e->f1, e->f3, (size_t)T * F, c->act);
    } else {
        cpu_activation(e->f1, NULL, (size_t)T * F, c->act);
    }
    rekv_engine_gemm(e, e->h, e->f1, L->w2, L->b2, T, H, F);
}

static int forward_pass(rekv_engine *e, rekv_batch_item *items, int n_items, size_t T,
                        rekv_err *err);

/* Rows a forward pass holds (llama.cpp's default micro-batch): a longer batch runs as passes of at
 * most this many, in order, so the scratch is sized by the pass, not by the batch (8 prompts of
 * 512 tokens: 24 MB of activations on a 1024-wide model, not 190). The bits are the same: a row's
 * products never depend on the other rows (cpu_gemm.c), and its attention reads the cache rows
 * before it, which the earlier passes wrote. A tap (skew, heads, premises) sees every row of a
 * call at once, so a call with one runs as one pass. */
enum { FWD_ROWS = 512 };

int rekv_engine_forward(rekv_engine *e, rekv_batch_item *items, int n_items, rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    size_t T = 0;
    if (n_items <= 0)
        return rekv_errf(err, -EINVAL, "forward: empty batch");
    for (int b = 0; b < n_items; b++) {
        rekv_batch_item *it = &items[b];
        if (it->seq == NULL || it->seq->e != e || it->n_tokens <= 0 || it->tokens == NULL ||
            it->logits == NULL)
            return rekv_errf(err, -EINVAL, "forward: batch item %d is malformed", b);
        if ((int64_t)it->seq->len + it->n_tokens > it->seq->cap)
            return rekv_errf(err, -E2BIG,
                             "forward: %d tokens after %d cached is longer than the context (%d)",
                             it->n_tokens, it->seq->len, it->seq->cap);
        for (int i = 0; i < it->n_tokens; i++)
            if (it->tokens[i] < 0 || it->tokens[i] >= c->vocab)
                return rekv_errf(err, -EINVAL,
                                 "forward: token id %d is outside the vocabulary (0..%d)",
                                 it->tokens[i], c->vocab - 1);
        for (int j = 0; j < b; j++)
            if (items[j].seq == it->seq)
                return rekv_errf(err, -EINVAL, "forward: a sequence appears twice in one batch");
        T += (size_t)it->n_tokens;
    }
    if (T <= FWD_ROWS || e->tap)
        return forward_pass(e, items, n_items, T, err);
    /* passes of FWD_ROWS rows across the items in order; an item's logits come from the pass with
     * its last token (every pass's rows of an all_logits item) */
    rekv_batch_item sub[n_items];
    int len0[n_items];
    for (int j = 0; j < n_items; j++)
        len0[j] = items[j].seq->len;
    int b = 0, done = 0; /* item b's first done tokens have run */
    while (b < n_items) {
        int n = 0, room = FWD_ROWS;
        for (int j = b, from = done; j < n_items && room > 0; j++, from = 0) {
            const rekv_batch_item *it = &items[j];
            int take = it->n_tokens - from < room ? it->n_tokens - from : room;
            int last = from + take == it->n_tokens;
            sub[n++] = (rekv_batch_item){
                it->seq, it->tokens + from, take, it->all_logits,
                it->all_logits ? it->logits + (size_t)from * (size_t)c->vocab
                               : last ? it->logits : NULL};
            room -= take;
            if (last)
                b = j + 1, done = 0;
            else
                done = from + take;
        }
        int rc = forward_pass(e, sub, n, FWD_ROWS - (size_t)room, err);
        if (rc) { /* out of memory: every sequence as it was */
            for (int j = 0; j < n_items; j++)
                rekv_seq_truncate(items[j].seq, len0[j]);
            return rc;
        }
    }
    return 0;
}

/* One pass over T rows (checked by rekv_engine_forward); an item whose logits is NULL gets
 * none (an earlier pass of a longer prompt). */
static int forward_pass(rekv_engine *e, rekv_batch_item *items, int n_items, size_t T,
                        rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    int H = c->hidden, E = c->embed_dim;
    if (reserve(e, T))
        return rekv_errf(err, -ENOMEM, "forward: out of memory for a batch of %zu tokens", T);

    /* embeddings (and positions) of every new token */
    size_t row = 0;
    for (int b = 0; b < n_items; b++)
        for (int i = 0; i < items[b].n_tokens; i++, row++) {
            e->pos[row] = items[b].seq->len + i;
            float *dst = (e->project_in ? e->h : e->x) + row * E;
            size_t tok = (size_t)items[b].tokens[i];
            uint32_t qt = e->embed_qt;
            if (qt) /* the row's blocks, dequantized as ggml's get_rows does */
                (void)rekv_ggml_dequant_row(
                    qt, (const char *)e->embed + tok * cpu_qgemm_row_bytes(qt, (int)E), (uint64_t)E,
                    dst);
            else
                rekv_to_f32(dst, (const char *)e->embed + tok * E * rekv_dtype_size(e->wdtype),
                            e->wdtype, (size_t)E);
        }
    if (c->embed_scale != 0) /* Gemma: the embeddings times sqrt(hidden) */
        cpu_scale(e->project_in ? e->h : e->x, T * (size_t)E, c->embed_scale);
    if (e->project_in)
        rekv_engine_gemm(e, e->x, e->h, e->project_in, NULL, (int)T, H, E);
    if (e->pos_embed)
        for (row = 0; row < T; row++)
            add_into(e->x + row * H, e->pos_embed + (size_t)(e->pos[row] + 2) * H, (size_t)H);
    if (c->rope != REKV_ROPE_NONE)
        cpu_rope_table(e->rope_cos, e->rope_sin, e->pos, (int)T, &e->rope);

    for (int l = 0; l < c->n_layers; l++) {
        const layer_w *L = &e->layers[l];
        size_t n = T * (size_t)H;
        /* pre-norm: x += f(norm(x)); post-norm (OPT-350m): x = norm(x + f(x)) */
        if (c->pre_norm)
            cpu_norm(e->h, e->x, L->attn_norm_w, L->attn_norm_b, (int)T, H, c->norm_eps);
        else
            memcpy(e->h, e->x, n * sizeof(float));
        attention_block(e, L, l, items, n_items, (int)T);
        if (L->post_attn_norm_w) /* Gemma-2: the attention's output normalised, then added */
            cpu_norm(e->h, e->h, L->post_attn_norm_w, NULL, (int)T, H, c->norm_eps);
        add_into(e->x, e->h, n);
        if (!c->pre_norm)
            cpu_norm(e->x, e->x, L->attn_norm_w, L->attn_norm_b, (int)T, H, c->norm_eps);
        if (c->pre_norm)
            cpu_norm(e->h, e->x, L->ffn_norm_w, L->ffn_norm_b, (int)T, H, c->norm_eps);
        else
            memcpy(e->h, e->x, n * sizeof(float));
        ffn_block(e, L, (int)T);
        if (L->post_ffn_norm_w)
            cpu_norm(e->h, e->h, L->post_ffn_norm_w, NULL, (int)T, H, c->norm_eps);
        add_into(e->x, e->h, n);
        if (!c->pre_norm)
            cpu_norm(e->x, e->x, L->ffn_norm_w, L->ffn_norm_b, (int)T, H, c->norm_eps);
    }
    for (int b = 0; b < n_items; b++)
        items[b].seq->len += items[b].n_tokens;

    /* head: gather the rows that need logits, normalise, project out, lm_head */
    size_t n_out = 0;
    row = 0;
    for (int b = 0; b < n_items; b++) {
        int m = items[b].n_tokens;
        int first = items[b].logits == NULL ? m : items[b].all_logits ? 0 : m - 1;
        memmove(e->x + n_out * H, e->x + (row + (size_t)first) * H,
                sizeof(float) * (size_t)(m - first) * H);
        n_out += (size_t)(m - first);
        row += (size_t)m;
    }
    if (n_out == 0)
        return 0;
    if (e->final_norm_w)
        cpu_norm(e->x, e->x, e->final_norm_w, e->final_norm_b, (int)n_out, H, c->norm_eps);
    const float *hin = e->x;
    if (e->project_out) {
        rekv_engine_gemm(e, e->h, e->x, e->project_out, NULL, (int)n_out, E, H);
        hin = e->h;
    }
    /* one GEMM for every row, so the head's weights are read once per step, not once per item */
    if (n_items == 1) {
        rekv_engine_gemm(e, items[0].logits, hin, e->lm_head, NULL, (int)n_out, c->vocab, E);
        if (c->final_softcap > 0) /* Gemma-2 */
            cpu_softcap(items[0].logits, n_out * (size_t)c->vocab, c->final_softcap);
        return 0;
    }
    float *all = malloc(sizeof(float) * n_out * (size_t)c->vocab);
    if (all == NULL)
        return rekv_errf(err, -ENOMEM, "forward: out of memory for %zu rows of logits", n_out);
    rekv_engine_gemm(e, all, hin, e->lm_head, NULL, (int)n_out, c->vocab, E);
    if (c->final_softcap > 0)
        cpu_softcap(all, n_out * (size_t)c->vocab, c->final_softcap);
    size_t r = 0;
    for (int b = 0; b < n_items; b++) {
        if (items[b].logits == NULL)
            continue;
        size_t rows = items[b].all_logits ? (size_t)items[b].n_tokens : 1;
        memcpy(items[b].logits, all + r * c->vocab, sizeof(float) * rows * (size_t)c->vocab);
        r += rows;
    }
    free(all);
    return 0;
}

double rekv_engine_flops(const rekv_engine *e, double n_tokens, double ctx_sum, double n_logits)
{
    const rekv_model_config *c = &e->c;
    double per_token = 2 * rekv_config_layer_params(c);
    double attn = 4 * ctx_sum * rekv_config_q_dim(c); /* QK^T and PV */
    return c->n_layers * (n_tokens * per_token + attn) + 2 * n_logits * c->embed_dim * c->vocab;
}
