/* fingerprint.c — rekv_engine_fingerprint (gpuworker.h): which model an engine holds, for the
 * caches keyed by it — the skew and head profile files (skew.c, heads.c) and the kvstore's prefix
 * cache (its blocks' keys start from it). */
#include <stdint.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/dtype.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/engine_internal.h"

/* Two 32-bit halves over the same bytes. The high half is CRC32C. A second CRC with another seed
 * would add nothing (a CRC is affine in its seed: the two would differ by a constant for a given
 * length), so the low half is a multiplicative hash (FNV-1a over 64-bit words, with a shift so that
 * high bits reach low ones), folded to 32 bits. */
typedef struct fp_state {
    uint32_t crc;
    uint64_t mix;
} fp_state;

static void fp_add(fp_state *f, const void *p, size_t n)
{
    const unsigned char *b = p;
    size_t i = 0;
    f->crc = rekv_crc32c(f->crc, p, n);
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        f->mix = (f->mix ^ w) * 0x100000001b3ull;
        f->mix ^= f->mix >> 29;
    }
    for (; i < n; i++)
        f->mix = (f->mix ^ b[i]) * 0x100000001b3ull;
}

/* A tensor that may be absent: a presence byte, its size, then its bytes — all of them up to
 * FP_WHOLE bytes, past that the first FP_WHOLE and then FP_SAMPLE bytes of every FP_STRIDE (a
 * fine-tune, merged LoRA or other checkpoint of the same shape changes far more than one part in
 * 64 of a matrix; hashing a 7B model's every byte would cost seconds at each start). */
#define FP_WHOLE (1u << 20)
#define FP_SAMPLE 4096u
#define FP_STRIDE (64u * 4096u)

/* Where a tensor's bytes come from: as held, or — a matrix [n][k] the engine keeps in the cpu
 * GEMM's tile layout — gathered back into row-major order, so the fingerprint names the model,
 * not the layout (a cuda pipeline makes the engine row-major again). */
typedef struct fp_src {
    const unsigned char *p;
    int tiled, n, k;
    size_t es;
} fp_src;

/* The row-major bytes [off, off + len) of s (off and len whole elements), in pieces of FP_SAMPLE:
 * fp_add over them equals one call over the whole (each piece but the last a multiple of 8). */
static void fp_bytes(fp_state *f, const fp_src *s, size_t off, size_t len)
{
    if (!s->tiled) {
        fp_add(f, s->p + off, len);
        return;
    }
    unsigned char buf[FP_SAMPLE];
    while (len > 0) {
        size_t m = len < FP_SAMPLE ? len : FP_SAMPLE;
        for (size_t b = 0; b < m; b += s->es) {
            size_t el = (off + b) / s->es;
            size_t at = cpu_tile_index(s->n, s->k, (int)(el / (size_t)s->k), (int)(el % (size_t)s->k));
            memcpy(buf + b, s->p + at * s->es, s->es);
        }
        fp_add(f, buf, m);
        off += m;
        len -= m;
    }
}

static void fp_src_tensor(fp_state *f, const fp_src *s, size_t n)
{
    uint8_t present = s->p != NULL;
    fp_add(f, &present, 1);
    if (s->p == NULL)
        return;
    uint64_t size = n;
    fp_add(f, &size, sizeof(size));
    if (n <= FP_WHOLE) {
        fp_bytes(f, s, 0, n);
        return;
    }
    fp_bytes(f, s, 0, FP_WHOLE);
    for (size_t off = FP_WHOLE; off < n; off += FP_STRIDE)
        fp_bytes(f, s, off, n - off < FP_SAMPLE ? n - off : FP_SAMPLE);
}

static void fp_tensor(fp_state *f, const void *p, size_t n)
{
    fp_src s = {p, 0, 0, 0, 1};
    fp_src_tensor(f, &s, n);
}

/* One of e's matrices [n][k], by its row-major bytes whatever its layout. */
static void fp_matrix(fp_state *f, const rekv_engine *e, const void *w, size_t n, size_t k)
{
    uint32_t qt = rekv_engine_qtype(e, w);
    if (qt) { /* quantized blocks, row-major: their bytes, and the type they are read as */
        fp_add(f, &qt, sizeof(qt));
        fp_tensor(f, w, cpu_qgemm_row_bytes(qt, (int)k) * n);
        return;
    }
    fp_src s = {w, w != NULL && rekv_engine_w_tiled(e, w), (int)n, (int)k,
                rekv_dtype_size(e->wdtype)};
    fp_src_tensor(f, &s, n * k * s.es);
}

uint64_t rekv_engine_fingerprint(const rekv_engine *e)
{
    const rekv_model_config *c = &e->c;
    fp_state f = {0, 0xcbf29ce484222325ull};
    int32_t shape[] = {c->n_layers,     c->hidden,     c->n_heads, c->n_kv_heads,
                       c->head_dim,     (int32_t)c->rope, (int32_t)e->wdtype, c->ffn,
                       c->vocab,        c->embed_dim,  c->max_pos, (int32_t)c->arch};
    fp_add(&f, shape, sizeof(shape));
    fp_add(&f, &c->rope_theta, sizeof(c->rope_theta));
    if (c->rope_scaling.type != REKV_ROPE_SCALING_NONE) /* the rotation the calibration saw */
        fp_add(&f, &e->rope, sizeof(e->rope));          /* (zeroed padding: rekv_rope_freqs_init) */
    if (c->sliding_window > 0) /* K,V past the first layer depend on it; none keeps old values */
        fp_add(&f, &c->sliding_window, sizeof(c->sliding_window));
    if (c->norm_add_one) { /* Gemma's forward (its norms are in the weights below, 1 added) */
        float g[] = {c->embed_scale, c->attn_scale, c->attn_softcap, c->final_softcap,
                     (float)c->act, (float)c->post_norms, (float)c->window_even_layers};
        fp_add(&f, g, sizeof(g));
    }
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c), F = (size_t)c->ffn;
    size_t KV = (size_t)rekv_config_kv_dim(c), f4 = sizeof(float);
    size_t V = (size_t)c->vocab, E = (size_t)c->embed_dim;
    fp_matrix(&f, e, e->embed, V, E);
    fp_tensor(&f, e->pos_embed, ((size_t)c->max_pos + 2) * H * f4);
    fp_matrix(&f, e, e->project_in, H, E);
    fp_matrix(&f, e, e->project_out, E, H);
    fp_tensor(&f, e->final_norm_w, H * f4);
    fp_tensor(&f, e->final_norm_b, H * f4);
    uint8_t tied = e->lm_head == e->embed;
    fp_add(&f, &tied, 1);
    if (!tied)
        fp_matrix(&f, e, e->lm_head, V, E);
    for (int l = 0; l < c->n_layers; l++) {
        const layer_w *L = &e->layers[l];
        const struct {
            const void *p;
            size_t n, k; /* k 0: a vector of n floats; else a matrix [n][k] */
        } t[] = {{L->attn_norm_w, H, 0}, {L->attn_norm_b, H, 0},  {L->wq, Q, H},  {L->bq, Q, 0},
                 {L->wk, KV, H},         {L->bk, KV, 0},          {L->wv, KV, H}, {L->bv, KV, 0},
                 {L->wo, H, Q},          {L->bo, H, 0},           {L->ffn_norm_w, H, 0},
                 {L->ffn_norm_b, H, 0},  {L->w1, F, H},           {L->b1, F, 0},  {L->w2, H, F},
                 {L->b2, H, 0},          {L->w3, F, H}};
        for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
            if (t[i].k)
                fp_matrix(&f, e, t[i].p, t[i].n, t[i].k);
            else
                fp_tensor(&f, t[i].p, t[i].n * f4);
        }
        if (L->post_attn_norm_w) { /* Gemma-2's; absent, the others' values stay as they were */
            fp_tensor(&f, L->post_attn_norm_w, H * f4);
            fp_tensor(&f, L->post_ffn_norm_w, H * f4);
        }
    }
    uint32_t lo = (uint32_t)(f.mix ^ (f.mix >> 32));
    return (uint64_t)f.crc << 32 | lo;
}

