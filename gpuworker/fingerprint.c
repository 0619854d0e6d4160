/* fingerprint.c — rekv_engine_fingerprint (gpuworker.h): which model an engine holds, for the
 * caches keyed by it — the skew and head profile files (skew.c, heads.c) and the kvstore's prefix
 * cache (its blocks' keys start from it). */
#include <stdint.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/dtype.h"
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

static void fp_tensor(fp_state *f, const void *p, size_t n)
{
    uint8_t present = p != NULL;
    fp_add(f, &present, 1);
    if (p == NULL)
        return;
    uint64_t size = n;
    fp_add(f, &size, sizeof(size));
    const unsigned char *b = p;
    if (n <= FP_WHOLE) {
        fp_add(f, b, n);
        return;
    }
    fp_add(f, b, FP_WHOLE);
    for (size_t off = FP_WHOLE; off < n; off += FP_STRIDE)
        fp_add(f, b + off, n - off < FP_SAMPLE ? n - off : FP_SAMPLE);
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
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c), F = (size_t)c->ffn;
    size_t KV = (size_t)rekv_config_kv_dim(c), ws = rekv_dtype_size(e->wdtype), f4 = sizeof(float);
    size_t V = (size_t)c->vocab, E = (size_t)c->embed_dim;
    fp_tensor(&f, e->embed, V * E * ws);
    fp_tensor(&f, e->pos_embed, ((size_t)c->max_pos + 2) * H * f4);
    fp_tensor(&f, e->project_in, H * E * ws);
    fp_tensor(&f, e->project_out, E * H * ws);
    fp_tensor(&f, e->final_norm_w, H * f4);
    fp_tensor(&f, e->final_norm_b, H * f4);
    uint8_t tied = e->lm_head == e->embed;
    fp_add(&f, &tied, 1);
    if (!tied)
        fp_tensor(&f, e->lm_head, V * E * ws);
    for (int l = 0; l < c->n_layers; l++) {
        const layer_w *L = &e->layers[l];
        const struct {
            const void *p;
            size_t n;
        } t[] = {{L->attn_norm_w, H * f4}, {L->attn_norm_b, H * f4}, {L->wq, Q * H * ws},
                 {L->bq, Q * f4},          {L->wk, KV * H * ws},     {L->bk, KV * f4},
                 {L->wv, KV * H * ws},     {L->bv, KV * f4},         {L->wo, H * Q * ws},
                 {L->bo, H * f4},          {L->ffn_norm_w, H * f4},  {L->ffn_norm_b, H * f4},
                 {L->w1, F * H * ws},      {L->b1, F * f4},          {L->w2, H * F * ws},
                 {L->b2, H * f4},          {L->w3, F * H * ws}};
        for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
            fp_tensor(&f, t[i].p, t[i].n);
    }
    uint32_t lo = (uint32_t)(f.mix ^ (f.mix >> 32));
    return (uint64_t)f.crc << 32 | lo;
}

