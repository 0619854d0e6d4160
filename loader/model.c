/* model.c — opening a whole model: HF directories (config.json + safetensors) and llama2.c files
 * (GGUF files: gguf_model.c), mapped onto the architecture-neutral rekv_weights table with every
 * shape checked. */
#include "loader/gguf.h"
#include "loader/loader.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void rekv_model_release(const rekv_model *m, const rekv_tensor *t)
{
    if (m == NULL || t == NULL || t->data == NULL || t->nbytes == 0)
        return;
    const void *map = m->map;
    size_t len = m->map_len;
    const char *c = t->data;
    int inside = map != NULL && c >= (const char *)map && t->nbytes <= len &&
                 (size_t)(c - (const char *)map) <= len - t->nbytes;
    if (!inside && !rekv_safetensors_mapping(m->st, t->data, t->nbytes, &map, &len))
        return; /* not the model's mapping (heap memory must never be MADV_DONTNEED'd) */
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)c & ~(pg - 1), hi = ((uintptr_t)c + t->nbytes + pg - 1) & ~(pg - 1);
    uintptr_t end = (uintptr_t)map + len; /* the mapping's last page may be partial */
    end = (end + pg - 1) & ~(pg - 1);
    if (hi > end)
        hi = end;
    (void)madvise((void *)lo, hi - lo, MADV_DONTNEED); /* advice: a failure only costs memory */
}

void rekv_model_close(rekv_model *m)
{
    if (m == NULL)
        return;
    if (m->st)
        rekv_safetensors_close(m->st);
    if (m->map)
        munmap(m->map, m->map_len);
    free(m->owned);
    free(m->weights.layers);
    free(m->path);
    free(m);
}

int rekv_model_open(const char *path, rekv_model **out, rekv_err *err)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode))
        return rekv_model_open_hf(path, out, err);
    if (rekv_gguf_is_gguf(path))
        return rekv_model_open_gguf(path, out, err);
    return rekv_model_open_llama2c(path, out, err);
}

/* Finds a tensor under any of the prefixes HF checkpoints use ("model.decoder." or "decoder." for
 * OPT — the original facebook/opt files lack "model."), checks its shape, and returns it.
 * d1 < 0 means a 1-d tensor. optional: a missing tensor is not an error. */
typedef struct lookup {
    const rekv_safetensors *st;
    const char *path;
    const char *const *prefixes;
    rekv_err *err;
    int rc;
    rekv_tensor *parts; /* descriptors of fused tensors' parts (the model's owned array) */
    size_t n_parts, cap_parts;
} lookup;

static const rekv_tensor *find(lookup *lk, const char *name, int64_t d0, int64_t d1, int optional)
{
    if (lk->rc)
        return NULL;
    char full[512];
    const rekv_tensor *t = NULL;
    for (const char *const *p = lk->prefixes; *p && t == NULL; p++) {
        snprintf(full, sizeof(full), "%s%s", *p, name);
        t = rekv_safetensors_find(lk->st, full);
    }
    if (t == NULL) {
        if (!optional)
            lk->rc = rekv_errf(lk->err, -EINVAL, "%s: tensor \"%s%s\" is missing", lk->path,
                               lk->prefixes[0], name);
        return NULL;
    }
    int want_ndim = d1 < 0 ? 1 : 2;
    if (t->ndim != want_ndim || t->shape[0] != d0 || (d1 >= 0 && t->shape[1] != d1)) {
        char got[128] = "", *g = got;
        for (int i = 0; i < t->ndim; i++)
            g += snprintf(g, sizeof(got) - (size_t)(g - got), "%s%lld", i ? ", " : "",
                          (long long)t->shape[i]);
        if (d1 < 0)
            lk->rc = rekv_errf(lk->err, -EINVAL, "%s: tensor \"%s\" has shape [%s], expected [%lld]",
                               lk->path, t->name, got, (long long)d0);
        else
            lk->rc = rekv_errf(lk->err, -EINVAL,
                               "%s: tensor \"%s\" has shape [%s], expected [%lld, %lld]", lk->path,
                               t->name, got, (long long)d0, (long long)d1);
        return NULL;
    }
    return t;
}

static void map_opt(lookup *lk, const rekv_model_config *c, rekv_weights *w)
{
    int64_t H = c->hidden, E = c->embed_dim, F = c->ffn, V = c->vocab;
    int b = c->qkv_bias;
    w->embed_tokens = find(lk, "embed_tokens.weight", V, E, 0);
    w->embed_positions = find(lk, "embed_positions.weight", (int64_t)c->max_pos + 2, H, 0);
    if (E != H) {
        w->project_in = find(lk, "project_in.weight", H, E, 0);
        w->project_out = find(lk, "project_out.weight", E, H, 0);
    }
    if (c->final_norm) {
        w->final_norm_w = find(lk, "final_layer_norm.weight", H, -1, 0);
        w->final_norm_b = find(lk, "final_layer_norm.bias", H, -1, 0);
    }
    for (int l = 0; l < c->n_layers && lk->rc == 0; l++) {
        rekv_layer_weights *lw = &w->layers[l];
        char n[128];
#define T(field, suffix, d0, d1, opt)                                                              \
    (snprintf(n, sizeof(n), "layers.%d.%s", l, suffix), lw->field = find(lk, n, d0, d1, opt))
        T(attn_norm_w, "self_attn_layer_norm.weight", H, -1, 0);
        T(attn_norm_b, "self_attn_layer_norm.bias", H, -1, 0);
        T(wq, "self_attn.q_proj.weight", H, H, 0);
        T(wk, "self_attn.k_proj.weight", H, H, 0);
        T(wv, "self_attn.v_proj.weight", H, H, 0);
        T(wo, "self_attn.out_proj.weight", H, H, 0);
        T(ffn_norm_w, "final_layer_norm.weight", H, -1, 0);
        T(ffn_norm_b, "final_layer_norm.bias", H, -1, 0);
        T(w1, "fc1.weight", F, H, 0);
        T(w2, "fc2.weight", H, F, 0);
        if (b) {
            T(bq, "self_attn.q_proj.bias", H, -1, 0);
            T(bk, "self_attn.k_proj.bias", H, -1, 0);
            T(bv, "self_attn.v_proj.bias", H, -1, 0);
            T(bo, "self_attn.out_proj.bias", H, -1, 0);
            T(b1, "fc1.bias", F, -1, 0);
            T(b2, "fc2.bias", H, -1, 0);
        }
#undef T
    }
}

/* Whether the checkpoint has a tensor of that name (under any prefix). */
static int has(const lookup *lk, const char *name)
{
    char full[512];
    for (const char *const *p = lk->prefixes; *p; p++) {
        snprintf(full, sizeof(full), "%s%s", *p, name);
        if (rekv_safetensors_find(lk->st, full) != NULL)
            return 1;
    }
    return 0;
}

/* A fused [sum rows[i]][cols] matrix (Phi-3's qkv_proj, gate_up_proj) as n row-blocks, in order:
 * descriptors of the same dtype pointing into the fused tensor's mapped rows, so nothing is
 * copied and the engine sees the plain Llama's Q/K/V and gate/up. */
static void find_split(lookup *lk, const char *name, const int64_t *rows, int n, int64_t cols,
                       const rekv_tensor **out)
{
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        total += rows[i];
    const rekv_tensor *t = find(lk, name, total, cols, 0);
    if (t == NULL)
        return;
    if (t->qtype != 0 || lk->n_parts + (size_t)n > lk->cap_parts) {
        lk->rc =
            rekv_errf(lk->err, -EINVAL, "%s: tensor \"%s\" cannot be split", lk->path, t->name);
        return;
    }
    size_t row_bytes = t->nbytes / (size_t)total, off = 0;
    for (int i = 0; i < n; i++) {
        rekv_tensor *p = &lk->parts[lk->n_parts++];
        *p = *t;
        p->shape[0] = rows[i];
        p->data = (const char *)t->data + off;
        p->nbytes = row_bytes * (size_t)rows[i];
        off += p->nbytes;
        out[i] = p;
    }
}

static void map_llama(lookup *lk, const rekv_model_config *c, rekv_weights *w)
{
    int64_t H = c->hidden, F = c->ffn, V = c->vocab;
    int64_t Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c);
    w->embed_tokens = find(lk, "embed_tokens.weight", V, H, 0);
    w->final_norm_w = find(lk, "norm.weight", H, -1, 0);
    for (int l = 0; l < c->n_layers && lk->rc == 0; l++) {
        rekv_layer_weights *lw = &w->layers[l];
        char n[128];
#define T(field, suffix, d0, d1)                                                                   \
    (snprintf(n, sizeof(n), "layers.%d.%s", l, suffix), lw->field = find(lk, n, d0, d1, 0))
        T(attn_norm_w, "input_layernorm.weight", H, -1);
        /* Phi-3 fuses Q, K, V (in that order) and gate, up: split where the fused one is */
        snprintf(n, sizeof(n), "layers.%d.self_attn.qkv_proj.weight", l);
        if (has(lk, n)) {
            const rekv_tensor *qkv[3];
            find_split(lk, n, (const int64_t[]){Q, KV, KV}, 3, H, qkv);
            lw->wq = qkv[0], lw->wk = qkv[1], lw->wv = qkv[2];
        } else {
            T(wq, "self_attn.q_proj.weight", Q, H);
            T(wk, "self_attn.k_proj.weight", KV, H);
            T(wv, "self_attn.v_proj.weight", KV, H);
        }
        T(wo, "self_attn.o_proj.weight", H, Q);
        if (c->post_norms) { /* Gemma-2: its post_attention_layernorm is the attention's own */
            T(post_attn_norm_w, "post_attention_layernorm.weight", H, -1);
            T(ffn_norm_w, "pre_feedforward_layernorm.weight", H, -1);
            T(post_ffn_norm_w, "post_feedforward_layernorm.weight", H, -1);
        } else {
            T(ffn_norm_w, "post_attention_layernorm.weight", H, -1);
        }
        snprintf(n, sizeof(n), "layers.%d.mlp.gate_up_proj.weight", l);
        if (has(lk, n)) {
            const rekv_tensor *gu[2];
            find_split(lk, n, (const int64_t[]){F, F}, 2, H, gu);
            lw->w1 = gu[0], lw->w3 = gu[1];
        } else {
            T(w1, "mlp.gate_proj.weight", F, H);
            T(w3, "mlp.up_proj.weight", F, H);
        }
        T(w2, "mlp.down_proj.weight", H, F);
        if (c->qkv_bias) {
            T(bq, "self_attn.q_proj.bias", Q, -1);
            T(bk, "self_attn.k_proj.bias", KV, -1);
            T(bv, "self_attn.v_proj.bias", KV, -1);
        }
        if (c->o_bias)
            T(bo, "self_attn.o_proj.bias", H, -1);
        if (c->ffn_bias) {
            T(b1, "mlp.gate_proj.bias", F, -1);
            T(b2, "mlp.down_proj.bias", H, -1);
        }
#undef T
    }
}

/* tokenizer_config.json's add_bos_token, when present, overrides the family default. */
static void read_add_bos(const char *dir, rekv_model_config *c)
{
    char p[4096];
    snprintf(p, sizeof(p), "%s/tokenizer_config.json", dir);
    json_t *root = json_load_file(p, 0, NULL);
    if (root == NULL)
        return;
    json_t *v = json_object_get(root, "add_bos_token");
    if (json_is_boolean(v))
        c->add_bos = json_is_true(v) && c->bos_id >= 0;
    json_decref(root);
}

int rekv_model_open_hf(const char *dir, rekv_model **out, rekv_err *err)
{
    int rc;
    char p[4096];
    rekv_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", dir);
    m->path = strdup(dir);
    snprintf(p, sizeof(p), "%s/config.json", dir);
    if ((rc = rekv_config_load_hf(p, &m->config, err)))
        goto fail;
    rekv_model_config *c = &m->config;
    read_add_bos(dir, c);
    if ((rc = rekv_safetensors_open(dir, &m->st, err)))
        goto fail;
    m->weights.layers = calloc((size_t)c->n_layers, sizeof(rekv_layer_weights));
    if (m->weights.layers == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", dir);
        goto fail;
    }
    static const char *const opt_prefixes[] = {"model.decoder.", "decoder.", NULL};
    static const char *const llama_prefixes[] = {"model.", NULL};
    static const char *const head_prefixes[] = {"", NULL};
    const char *const *prefixes = c->arch == REKV_ARCH_OPT ? opt_prefixes : llama_prefixes;
    lookup lk = {m->st, dir, prefixes, err, 0, NULL, 0, 0};
    if (c->arch == REKV_ARCH_LLAMA) { /* room for every layer's fused parts (Phi-3) */
        lk.cap_parts = (size_t)c->n_layers * 5;
        m->owned = lk.parts = calloc(lk.cap_parts, sizeof(rekv_tensor));
        if (m->owned == NULL) {
            rc = rekv_errf(err, -ENOMEM, "%s: out of memory", dir);
            goto fail;
        }
    }
    if (c->arch == REKV_ARCH_OPT)
        map_opt(&lk, c, &m->weights);
    else
        map_llama(&lk, c, &m->weights);
    m->n_owned = lk.n_parts;
    if ((rc = lk.rc))
        goto fail;
    lookup head = {m->st, dir, head_prefixes, err, 0, NULL, 0, 0};
    const rekv_tensor *lm = find(&head, "lm_head.weight", c->vocab, c->embed_dim, c->tied_head);
    if ((rc = head.rc))
        goto fail;
    m->weights.lm_head = lm ? lm : m->weights.embed_tokens;
    c->dtype = m->weights.embed_tokens->dtype;
    *out = m;
    return 0;
fail:
    rekv_model_close(m);
    return rc;
}
