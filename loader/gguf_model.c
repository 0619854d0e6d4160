/* gguf_model.c — a llama-architecture GGUF as a rekv model: the llama.* metadata as a
 * rekv_model_config, and the tensors (token_embd, blk.N.*, output_norm, output) as the rekv_weights
 * table, each pointing into the file's mapping with its shape checked against the metadata.
 *
 * Rope: llama.cpp's converter permutes the rows of attn_q and attn_k within each head so that
 * rotating adjacent pairs (x[2i], x[2i+1]) gives what HF's rotation of halves (x[i], x[i + d/2])
 * gives on the checkpoint's rows (GGUF row h*d + 2i + j is HF row h*d + j*d/2 + i). rekv has that
 * rotation (REKV_ROPE_ADJACENT, llama2.c's), so the rows are used as stored — no copy, no
 * un-permuting — and q.k is the same sum over the same products, in another order. V and every
 * other tensor are plain copies of the checkpoint's.
 *
 * Not loaded, each refused naming what: other architectures, mixture-of-experts llama files
 * (llama.expert_count), rope scaling other than linear and rope_freqs (read_rope_scaling), partial
 * rotary dims, attention biases, and block types other than Q8_0, Q4_0, Q4_K and Q6_K. Those four
 * stay quantized (rekv_tensor.qtype): the engine keeps the blocks and dequantizes inside its GEMM
 * (gpuworker/cpu_qgemm.c), never widening a whole matrix at load. */
#define _GNU_SOURCE
#include "loader/gguf.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A required (or, with dflt >= 0, optional) positive integer key, at most 1 << 30. */
static int get_dim(const rekv_gguf *g, const char *key, int64_t dflt, int *out, rekv_err *err)
{
    int64_t v;
    if (dflt >= 0 && rekv_gguf_kv_find(g, key) == NULL) {
        *out = (int)dflt;
        return 0;
    }
    int rc = rekv_gguf_get_i64(g, key, &v, err);
    if (rc)
        return rc;
    if (v < 1 || v > (1 << 30))
        return rekv_errf(err, -EINVAL, "%s: metadata \"%s\" = %lld is outside [1, 2^30]", g->path,
                         key, (long long)v);
    *out = (int)v;
    return 0;
}

/* Rope scaling as llama.cpp writes it: llama.rope.scaling.type "none" or "linear" (with
 * llama.rope.scaling.factor: positions divided by it, HF's linear), and the per-pair divisors of an
 * F32 tensor rope_freqs.weight (head_dim/2 values; llama.cpp's converter writes Llama 3.x's llama3
 * scaling so, and its rope divides each pair's frequency by them — REKV_ROPE_SCALING_FACTORS).
 * Other types (yarn, longrope: llama.cpp's forms have no reference here), a factor without
 * "linear", and both at once are refused naming the key. */
static int read_rope_scaling(const rekv_gguf *g, rekv_model_config *c, rekv_err *err)
{
    const char *s = "none";
    size_t n = 4;
    double f = 1;
    if (rekv_gguf_kv_find(g, "llama.rope.scaling.type") &&
        rekv_gguf_get_str(g, "llama.rope.scaling.type", &s, &n, err))
        return -EINVAL;
    int linear = n == 6 && memcmp(s, "linear", 6) == 0;
    if (!linear && !(n == 4 && memcmp(s, "none", 4) == 0))
        return rekv_errf(err, -ENOTSUP,
                         "%s: metadata \"llama.rope.scaling.type\" = \"%.*s\": only \"none\" and "
                         "\"linear\" rope scaling (and rope_freqs.weight) are supported in GGUF",
                         g->path, (int)(n < 32 ? n : 32), s);
    if (rekv_gguf_kv_find(g, "llama.rope.scaling.factor") &&
        rekv_gguf_get_f64(g, "llama.rope.scaling.factor", &f, err))
        return -EINVAL;
    if (linear && !(f > 0 && isfinite(f)))
        return rekv_errf(err, -EINVAL,
                         "%s: metadata \"llama.rope.scaling.factor\" = %g must be positive with "
                         "linear scaling",
                         g->path, f);
    if (!linear && f != 0 && f != 1)
        return rekv_errf(err, -ENOTSUP,
                         "%s: metadata \"llama.rope.scaling.factor\" = %g without "
                         "\"llama.rope.scaling.type\" \"linear\"",
                         g->path, f);
    const rekv_gguf_tensor *ff = rekv_gguf_tensor_find(g, "rope_freqs.weight");
    int pairs = c->head_dim / 2;
    if (ff && linear)
        return rekv_errf(err, -ENOTSUP,
                         "%s: tensor \"rope_freqs.weight\" with linear rope scaling: one or the "
                         "other",
                         g->path);
    if (ff && (ff->type != REKV_GGML_F32 || ff->numel != (uint64_t)pairs ||
               pairs > REKV_ROPE_MAX_PAIRS))
        return rekv_errf(err, -EINVAL,
                         "%s: tensor \"rope_freqs.weight\" must be F32 with head_dim/2 = %d values "
                         "(it has %llu)",
                         g->path, pairs, (unsigned long long)ff->numel);
    if (ff) {
        c->rope_scaling.type = REKV_ROPE_SCALING_FACTORS;
        memcpy(c->rope_scaling.freq_factors, ff->data, sizeof(float) * (size_t)pairs);
    } else if (linear) {
        c->rope_scaling.type = REKV_ROPE_SCALING_LINEAR;
        c->rope_scaling.factor = f;
    }
    return 0;
}

static int read_token_ids(const rekv_gguf *g, rekv_model_config *c, rekv_err *err)
{
    static const char *const keys[] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                                       "tokenizer.ggml.padding_token_id"};
    int *dst[] = {&c->bos_id, &c->eos_id, &c->pad_id};
    for (int i = 0; i < 3; i++) {
        *dst[i] = -1;
        if (rekv_gguf_kv_find(g, keys[i]) == NULL)
            continue;
        int64_t v;
        int rc = rekv_gguf_get_i64(g, keys[i], &v, err);
        if (rc)
            return rc;
        if (v < 0 || v >= c->vocab)
            return rekv_errf(err, -EINVAL,
                             "%s: metadata \"%s\" = %lld is outside the vocabulary [0, %d)",
                             g->path, keys[i], (long long)v, c->vocab);
        *dst[i] = (int)v;
    }
    /* every id that ends a turn stops generation, as llama.cpp's llama_vocab_is_eog: EOS, and
     * the chat models' end-of-turn (Gemma's <end_of_turn>, Llama 3's <|eot_id|>) and
     * end-of-message ids */
    static const char *const ends[] = {"tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id"};
    c->n_eos_ids = 0;
    if (c->eos_id >= 0)
        c->eos_ids[c->n_eos_ids++] = c->eos_id;
    for (int i = 0; i < 2; i++) {
        int64_t v;
        if (rekv_gguf_kv_find(g, ends[i]) == NULL)
            continue;
        int rc = rekv_gguf_get_i64(g, ends[i], &v, err);
        if (rc)
            return rc;
        if (v < 0 || v >= c->vocab)
            return rekv_errf(err, -EINVAL,
                             "%s: metadata \"%s\" = %lld is outside the vocabulary [0, %d)",
                             g->path, ends[i], (long long)v, c->vocab);
        int seen = 0;
        for (int j = 0; j < c->n_eos_ids; j++)
            seen |= c->eos_ids[j] == (int)v;
        if (!seen)
            c->eos_ids[c->n_eos_ids++] = (int)v;
        if (c->eos_id < 0)
            c->eos_id = (int)v;
    }
    /* llama.cpp's default: SentencePiece vocabularies add BOS, BPE ones do not */
    const char *model;
    size_t n;
    c->add_bos = rekv_gguf_get_str(g, "tokenizer.ggml.model", &model, &n, NULL) == 0 && n == 5 &&
                 memcmp(model, "llama", 5) == 0;
    int ab;
    if (rekv_gguf_kv_find(g, "tokenizer.ggml.add_bos_token")) {
        int rc = rekv_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &ab, err);
        if (rc)
            return rc;
        c->add_bos = ab;
    }
    c->add_bos = c->add_bos && c->bos_id >= 0;
    return 0;
}

/* The vocabulary size: llama.vocab_size, else the token list's length, else token_embd's rows. */
static int read_vocab(const rekv_gguf *g, rekv_model_config *c, rekv_err *err)
{
    const rekv_gguf_kv *tokens = rekv_gguf_kv_find(g, "tokenizer.ggml.tokens");
    const rekv_gguf_tensor *emb = rekv_gguf_tensor_find(g, "token_embd.weight");
    int64_t from_tokens = tokens && tokens->type == REKV_GGUF_ARRAY ? (int64_t)tokens->n : -1;
    int64_t from_emb = emb && emb->n_dims == 2 ? (int64_t)emb->ne[1] : -1;
    int64_t dflt = from_tokens > 0 ? from_tokens : from_emb > 0 ? from_emb : -1;
    int rc = get_dim(g, "llama.vocab_size", dflt, &c->vocab, err);
    if (rc)
        return rc;
    if (from_tokens > 0 && from_tokens != c->vocab)
        return rekv_errf(
            err, -EINVAL,
            "%s: metadata \"tokenizer.ggml.tokens\" has %lld tokens, but the vocabulary "
            "(llama.vocab_size) is %d",
            g->path, (long long)from_tokens, c->vocab);
    return 0;
}

int rekv_gguf_config(const rekv_gguf *g, rekv_model_config *out, rekv_err *err)
{
    rekv_model_config c;
    memset(&c, 0, sizeof(c));
    const char *arch;
    size_t n;
    int rc = rekv_gguf_get_str(g, "general.architecture", &arch, &n, err);
    if (rc)
        return rc;
    if (!(n == 5 && memcmp(arch, "llama", 5) == 0))
        return rekv_errf(err, -ENOTSUP,
                         "%s: metadata \"general.architecture\" = \"%.*s\" is not supported (llama "
                         "is)",
                         g->path, (int)(n < 64 ? n : 64), arch);
    int experts = 0, rope_dims, key_len, val_len;
    if ((rc = get_dim(g, "llama.expert_count", 0, &experts, NULL)) == 0 && experts > 0)
        return rekv_errf(err, -ENOTSUP,
                         "%s: metadata \"llama.expert_count\" = %d: mixture-of-experts models are "
                         "not supported",
                         g->path, experts);
    c.arch = REKV_ARCH_LLAMA;
    c.rope = REKV_ROPE_ADJACENT;
    c.act = REKV_ACT_SILU;
    c.pre_norm = c.final_norm = 1;
    if ((rc = get_dim(g, "llama.block_count", -1, &c.n_layers, err)) ||
        (rc = get_dim(g, "llama.embedding_length", -1, &c.hidden, err)) ||
        (rc = get_dim(g, "llama.feed_forward_length", -1, &c.ffn, err)) ||
        (rc = get_dim(g, "llama.attention.head_count", -1, &c.n_heads, err)) ||
        (rc = get_dim(g, "llama.attention.head_count_kv", c.n_heads, &c.n_kv_heads, err)) ||
        (rc = get_dim(g, "llama.context_length", -1, &c.max_pos, err)) ||
        (rc = read_vocab(g, &c, err)))
        return rc;
    /* every block has tensors of its own: a count past them names no model (and would size the
     * layer table by a number the file never backs) */
    if ((size_t)c.n_layers > g->n_tensors)
        return rekv_errf(err, -EINVAL,
                         "%s: metadata \"llama.block_count\" = %d, but the file holds %zu tensors",
                         g->path, c.n_layers, g->n_tensors);
    if (c.hidden % c.n_heads != 0 && rekv_gguf_kv_find(g, "llama.attention.key_length") == NULL)
        return rekv_errf(err, -EINVAL,
                         "%s: metadata \"llama.embedding_length\" %d is not a multiple of "
                         "\"llama.attention.head_count\" %d",
                         g->path, c.hidden, c.n_heads);
    if ((rc = get_dim(g, "llama.attention.key_length", c.hidden / c.n_heads, &key_len, err)) ||
        (rc = get_dim(g, "llama.attention.value_length", key_len, &val_len, err)) ||
        (rc = get_dim(g, "llama.rope.dimension_count", key_len, &rope_dims, err)))
        return rc;
    c.head_dim = key_len;
    if (val_len != key_len || rope_dims != key_len || key_len % 2 != 0)
        return rekv_errf(err, -ENOTSUP,
                         "%s: metadata \"llama.attention.value_length\" %d, "
                         "\"llama.rope.dimension_count\" %d and \"llama.attention.key_length\" %d "
                         "must be one even head dim",
                         g->path, val_len, rope_dims, key_len);
    if (c.n_kv_heads > c.n_heads || c.n_heads % c.n_kv_heads != 0)
        return rekv_errf(err, -EINVAL,
                         "%s: metadata \"llama.attention.head_count\" %d is not a multiple of "
                         "\"llama.attention.head_count_kv\" %d",
                         g->path, c.n_heads, c.n_kv_heads);
    c.embed_dim = c.hidden;
    double eps, theta = 10000.0;
    if ((rc = rekv_gguf_get_f64(g, "llama.attention.layer_norm_rms_epsilon", &eps, err)))
        return rc;
    if (rekv_gguf_kv_find(g, "llama.rope.freq_base") &&
        (rc = rekv_gguf_get_f64(g, "llama.rope.freq_base", &theta, err)))
        return rc;
    if (!(eps > 0 && eps < 1) || !(theta > 1 && theta < 1e12))
        return rekv_errf(err, -EINVAL,
                         "%s: metadata \"llama.attention.layer_norm_rms_epsilon\" %g or "
                         "\"llama.rope.freq_base\" %g is out of range",
                         g->path, eps, theta);
    c.norm_eps = (float)eps;
    c.rope_theta = (float)theta;
    if ((rc = read_rope_scaling(g, &c, err)) || (rc = read_token_ids(g, &c, err)))
        return rc;
    c.tied_head = rekv_gguf_tensor_find(g, "output.weight") == NULL;
    const rekv_gguf_tensor *emb = rekv_gguf_tensor_find(g, "token_embd.weight");
    c.dtype = emb && emb->type == REKV_GGML_BF16  ? REKV_DTYPE_BF16
              : emb && emb->type == REKV_GGML_F32 ? REKV_DTYPE_F32
                                                  : REKV_DTYPE_F16;
    *out = c;
    return 0;
}

/* ---------------------------------------------------------------- weights */

typedef struct lookup {
    const rekv_gguf *g;
    rekv_tensor *owned; /* [g->n_tensors], parallel to g->tensors */
    rekv_err *err;
    int rc;
} lookup;

/* "Q4_0" for q4_0: the spelling users know from file names. */
static const char *type_upper(uint32_t type, char *buf, size_t cap)
{
    const char *s = rekv_ggml_type_name(type);
    size_t i = 0;
    for (; s && s[i] && i + 1 < cap; i++)
        buf[i] = (char)toupper((unsigned char)s[i]);
    buf[i] = '\0';
    return buf;
}

/* The tensor named name with ne [d0] (d1 < 0) or [d0, d1], in a dtype rekv computes with; keys
 * names the metadata the expected dims come from, for the message. */
static const rekv_tensor *find(lookup *lk, const char *name, int64_t d0, int64_t d1,
                               const char *keys, int optional)
{
    if (lk->rc)
        return NULL;
    const rekv_gguf_tensor *t = rekv_gguf_tensor_find(lk->g, name);
    if (t == NULL) {
        if (!optional)
            lk->rc = rekv_errf(lk->err, -EINVAL, "%s: tensor \"%s\" is missing", lk->g->path, name);
        return NULL;
    }
    int want = d1 < 0 ? 1 : 2;
    if (t->n_dims != want || (int64_t)t->ne[0] != d0 || (d1 >= 0 && (int64_t)t->ne[1] != d1)) {
        char got[96];
        size_t k = 0;
        for (int d = 0; d < t->n_dims && k < sizeof(got); d++)
            k += (size_t)snprintf(got + k, sizeof(got) - k, "%s%llu", d ? ", " : "",
                                  (unsigned long long)t->ne[d]);
        if (d1 < 0)
            lk->rc = rekv_errf(lk->err, -EINVAL,
                               "%s: tensor \"%s\" has ne [%s], but the metadata (%s) says [%lld]",
                               lk->g->path, name, got, keys, (long long)d0);
        else
            lk->rc = rekv_errf(lk->err, -EINVAL,
                               "%s: tensor \"%s\" has ne [%s], but the metadata (%s) says "
                               "[%lld, %lld]",
                               lk->g->path, name, got, keys, (long long)d0, (long long)d1);
        return NULL;
    }
    int plain = t->type == REKV_GGML_F32 || t->type == REKV_GGML_F16 || t->type == REKV_GGML_BF16;
    if (!plain && !(d1 >= 0 && rekv_gguf_matrix_type(t->type))) {
        char up[16];
        lk->rc = rekv_errf(lk->err, -ENOTSUP, "%s: tensor \"%s\": %s %s are not supported; %s are",
                           lk->g->path, name, type_upper(t->type, up, sizeof(up)),
                           d1 >= 0 ? "weights" : "vectors",
                           d1 >= 0 ? "F32/F16/BF16/Q8_0/Q4_0/Q4_K/Q6_K" : "F32/F16/BF16");
        return NULL;
    }
    uint32_t be, bb;
    rekv_ggml_type_block(t->type, &be, &bb);
    if (t->ne[0] % be != 0) {
        char up[16];
        lk->rc = rekv_errf(lk->err, -EINVAL,
                           "%s: tensor \"%s\": rows of %llu elements are not whole %s blocks of %u",
                           lk->g->path, name, (unsigned long long)t->ne[0],
                           type_upper(t->type, up, sizeof(up)), be);
        return NULL;
    }
    return &lk->owned[t - lk->g->tensors];
}

static void map_weights(lookup *lk, const rekv_model_config *c, rekv_weights *w)
{
    int64_t H = c->hidden, F = c->ffn, V = c->vocab;
    int64_t Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c);
    const char *kH = "llama.embedding_length", *kQ = "head_count x head dim",
               *kKV = "head_count_kv x head dim", *kF = "llama.feed_forward_length";
    char keys[160];
    w->embed_tokens = find(lk, "token_embd.weight", H, V, "llama.embedding_length, vocabulary", 0);
    w->final_norm_w = find(lk, "output_norm.weight", H, -1, kH, 0);
    w->lm_head = find(lk, "output.weight", H, V, "llama.embedding_length, vocabulary", 1);
    if (w->lm_head == NULL)
        w->lm_head = w->embed_tokens;
    for (int l = 0; l < c->n_layers && lk->rc == 0; l++) {
        rekv_layer_weights *lw = &w->layers[l];
        char n[96];
#define T(field, suffix, d0, k0, d1, k1)                                                           \
    (snprintf(n, sizeof(n), "blk.%d.%s", l, suffix),                                               \
     snprintf(keys, sizeof(keys), "%s%s%s", k0, d1 >= 0 ? ", " : "", d1 >= 0 ? k1 : ""),           \
     lw->field = find(lk, n, d0, d1, keys, 0))
        T(attn_norm_w, "attn_norm.weight", H, kH, -1, "");
        T(wq, "attn_q.weight", H, kH, Q, kQ);
        T(wk, "attn_k.weight", H, kH, KV, kKV);
        T(wv, "attn_v.weight", H, kH, KV, kKV);
        T(wo, "attn_output.weight", Q, kQ, H, kH);
        T(ffn_norm_w, "ffn_norm.weight", H, kH, -1, "");
        T(w1, "ffn_gate.weight", H, kH, F, kF);
        T(w2, "ffn_down.weight", F, kF, H, kH);
        T(w3, "ffn_up.weight", H, kH, F, kF);
#undef T
        static const char *const biases[] = {"attn_q.bias", "attn_k.bias", "attn_v.bias",
                                             "attn_output.bias"};
        for (int b = 0; b < 4 && lk->rc == 0; b++) {
            snprintf(n, sizeof(n), "blk.%d.%s", l, biases[b]);
            if (rekv_gguf_tensor_find(lk->g, n))
                lk->rc = rekv_errf(lk->err, -ENOTSUP,
                                   "%s: tensor \"%s\": attention biases are not supported in a "
                                   "llama GGUF",
                                   lk->g->path, n);
        }
    }
    if (lk->rc == 0) {
        char n[64];
        snprintf(n, sizeof(n), "blk.%d.attn_norm.weight", c->n_layers);
        if (rekv_gguf_tensor_find(lk->g, n))
            lk->rc = rekv_errf(lk->err, -EINVAL,
                               "%s: tensor \"%s\" exists, but the metadata (llama.block_count) "
                               "says %d layers",
                               lk->g->path, n, c->n_layers);
    }
}

/* rekv_tensor descriptors for every GGUF tensor, names copied into the same allocation (one
 * free). Shapes are reversed: GGUF's ne[0] is the fastest dim, rekv's shape[ndim - 1]. A block
 * type the engine multiplies with keeps it in qtype (labelled F32: it dequantizes to fp32); any
 * other type is labelled F32 too, but only descriptors find() accepted are ever handed out. */
static rekv_tensor *describe(const rekv_gguf *g)
{
    size_t names = 0;
    for (size_t i = 0; i < g->n_tensors; i++)
        names += strlen(g->tensors[i].name) + 1;
    rekv_tensor *ts = calloc(1, g->n_tensors * sizeof(*ts) + names + 1);
    if (ts == NULL)
        return NULL;
    char *nm = (char *)(ts + g->n_tensors);
    for (size_t i = 0; i < g->n_tensors; i++) {
        const rekv_gguf_tensor *t = &g->tensors[i];
        size_t len = strlen(t->name) + 1;
        memcpy(nm, t->name, len);
        ts[i].name = nm;
        nm += len;
        ts[i].dtype = t->type == REKV_GGML_BF16  ? REKV_DTYPE_BF16
                      : t->type == REKV_GGML_F16 ? REKV_DTYPE_F16
                                                 : REKV_DTYPE_F32;
        ts[i].qtype = rekv_gguf_matrix_type(t->type) ? t->type : 0;
        ts[i].ndim = t->n_dims;
        for (int d = 0; d < t->n_dims; d++)
            ts[i].shape[d] = (int64_t)t->ne[t->n_dims - 1 - d];
        ts[i].data = t->data;
        ts[i].nbytes = t->nbytes;
    }
    return ts;
}

/* The bytes of every layer's matrices as the file stores them (quantized: their blocks). */
static double layer_matrix_bytes(const rekv_model_config *c, const rekv_weights *w)
{
    double b = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const rekv_layer_weights *s = &w->layers[l];
        const rekv_tensor *m[] = {s->wq, s->wk, s->wv, s->wo, s->w1, s->w2, s->w3};
        for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++)
            b += m[i] ? (double)m[i]->nbytes : 0;
    }
    return b;
}

int rekv_model_open_gguf(const char *path, rekv_model **out, rekv_err *err)
{
    *out = NULL;
    rekv_gguf *g = NULL;
    int rc = rekv_gguf_open(path, &g, err);
    if (rc)
        return rc;
    rekv_model *m = calloc(1, sizeof(*m));
    if (m == NULL || (m->path = strdup(path)) == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    if ((rc = rekv_gguf_config(g, &m->config, err)))
        goto fail;
    m->owned = describe(g);
    m->n_owned = g->n_tensors;
    m->weights.layers = calloc((size_t)m->config.n_layers, sizeof(rekv_layer_weights));
    if (m->owned == NULL || m->weights.layers == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    lookup lk = {g, m->owned, err, 0};
    map_weights(&lk, &m->config, &m->weights);
    if ((rc = lk.rc))
        goto fail;
    m->config.weight_elem_bytes = layer_matrix_bytes(&m->config, &m->weights) /
                                  (rekv_config_layer_params(&m->config) * m->config.n_layers);
    /* the model keeps the mapping (rekv_model_close unmaps it, rekv_model_release advises on it);
     * the parsed metadata goes */
    m->map = (void *)g->map;
    m->map_len = g->len;
    g->map = NULL;
    g->len = 0;
    rekv_gguf_close(g);
    *out = m;
    return 0;
fail:
    rekv_model_close(m);
    rekv_gguf_close(g);
    return rc;
}
