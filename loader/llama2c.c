/* llama2c.c — llama2.c legacy checkpoints (shared/models/stories260K/FORMAT.md).
 *
 * The file is mmap'd; the weights table points straight into it (fp32). Every size is checked
 * against the file length before any tensor is described, so a truncated or corrupt header is an
 * error, never an out-of-bounds read. */
#include "loader/loader.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static rekv_tensor *add(rekv_model *m, const char *name, const float **cursor, int ndim, int64_t d0,
                        int64_t d1, int64_t d2)
{
    rekv_tensor *t = &m->owned[m->n_owned++];
    t->name = name;
    t->dtype = REKV_DTYPE_F32;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->shape[2] = d2;
    t->data = *cursor;
    t->nbytes = (size_t)rekv_tensor_numel(t) * 4;
    *cursor += rekv_tensor_numel(t);
    return t;
}

/* A view of row `layer` of a [n_layers][...] tensor, as its own tensor. */
static const rekv_tensor *slice(rekv_model *m, const rekv_tensor *all, int layer)
{
    rekv_tensor *t = &m->owned[m->n_owned++];
    *t = *all;
    t->ndim = all->ndim - 1;
    memmove(t->shape, all->shape + 1, sizeof(int64_t) * (size_t)t->ndim);
    t->nbytes = all->nbytes / (size_t)all->shape[0];
    t->data = (const char *)all->data + t->nbytes * (size_t)layer;
    return t;
}

int rekv_model_open_llama2c(const char *path, rekv_model **out, rekv_err *err)
{
    int rc = 0;
    rekv_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    m->path = strdup(path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
        goto fail;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        rc = rekv_errf(err, -EINVAL, "%s: not a regular file", path);
        close(fd);
        goto fail;
    }
    if (st.st_size < 28) {
        rc = rekv_errf(err, -EINVAL, "%s: truncated llama2.c checkpoint (%lld bytes, header needs 28)",
                       path, (long long)st.st_size);
        close(fd);
        goto fail;
    }
    m->map_len = (size_t)st.st_size;
    m->map = mmap(NULL, m->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m->map == MAP_FAILED) {
        m->map = NULL;
        rc = rekv_errf(err, -errno, "%s: mmap: %s", path, strerror(errno));
        goto fail;
    }
    int32_t h[7];
    memcpy(h, m->map, sizeof(h));
    int dim = h[0], hidden_dim = h[1], n_layers = h[2], n_heads = h[3], n_kv = h[4];
    int vocab = abs(h[5]), seq_len = h[6];
    int shared = h[5] > 0;
    if (dim <= 0 || hidden_dim <= 0 || n_layers <= 0 || n_heads <= 0 || n_kv <= 0 || h[5] == 0 ||
        h[5] == INT32_MIN || seq_len <= 0 || dim % n_heads != 0 || n_heads % n_kv != 0 ||
        (dim / n_heads) % 2 != 0 || dim / n_heads > 512 || dim > (1 << 20) || hidden_dim > (1 << 22) ||
        n_layers > 4096 || vocab > (1 << 22)) {
        rc = rekv_errf(err, -EINVAL,
                       "%s: invalid llama2.c header (dim %d, hidden_dim %d, layers %d, heads %d, "
                       "kv_heads %d, vocab %d, seq_len %d)",
                       path, h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
        goto fail;
    }
    int head = dim / n_heads, kv_dim = dim / n_heads * n_kv;
    int64_t L = n_layers;
    /* floats the format requires, in order (see FORMAT.md) */
    int64_t need = (int64_t)vocab * dim + L * dim + L * dim * dim + 2 * L * kv_dim * dim +
                   L * dim * dim + L * dim + 3 * L * hidden_dim * dim + dim +
                   (int64_t)seq_len * head + (shared ? 0 : (int64_t)vocab * dim);
    int64_t have = (int64_t)(m->map_len - 28) / 4;
    if (have != need) {
        rc = rekv_errf(err, -EINVAL,
                       "%s: %s llama2.c checkpoint: the header's shapes need %lld bytes, the file "
                       "has %zu",
                       path, have < need ? "truncated" : "oversized", (long long)(28 + need * 4),
                       m->map_len);
        goto fail;
    }
    rekv_model_config *c = &m->config;
    c->arch = REKV_ARCH_LLAMA;
    c->rope = REKV_ROPE_ADJACENT;
    c->act = REKV_ACT_SILU;
    c->n_layers = n_layers;
    c->hidden = dim;
    c->n_heads = n_heads;
    c->n_kv_heads = n_kv;
    c->head_dim = head;
    c->ffn = hidden_dim;
    c->vocab = vocab;
    c->max_pos = seq_len;
    c->embed_dim = dim;
    c->norm_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    c->pre_norm = 1;
    c->final_norm = 1;
    c->tied_head = shared;
    c->bos_id = 1;
    c->eos_id = 2;
    c->eos_ids[0] = 2;
    c->n_eos_ids = 1;
    c->pad_id = -1;
    c->add_bos = 1;
    c->dtype = REKV_DTYPE_F32;

    /* 10 stacked tensors + 11 per-layer slices + 4 model tensors */
    m->owned = calloc((size_t)(16 + 11 * n_layers), sizeof(rekv_tensor));
    m->weights.layers = calloc((size_t)n_layers, sizeof(rekv_layer_weights));
    if (m->owned == NULL || m->weights.layers == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    const float *cur = (const float *)((const char *)m->map + 28);
    rekv_weights *w = &m->weights;
    w->embed_tokens = add(m, "token_embedding", &cur, 2, vocab, dim, 0);
    const rekv_tensor *rms_att = add(m, "rms_att_weight", &cur, 2, L, dim, 0);
    const rekv_tensor *wq = add(m, "wq", &cur, 3, L, dim, dim);
    const rekv_tensor *wk = add(m, "wk", &cur, 3, L, kv_dim, dim);
    const rekv_tensor *wv = add(m, "wv", &cur, 3, L, kv_dim, dim);
    const rekv_tensor *wo = add(m, "wo", &cur, 3, L, dim, dim);
    const rekv_tensor *rms_ffn = add(m, "rms_ffn_weight", &cur, 2, L, dim, 0);
    const rekv_tensor *w1 = add(m, "w1", &cur, 3, L, hidden_dim, dim);
    const rekv_tensor *w2 = add(m, "w2", &cur, 3, L, dim, hidden_dim);
    const rekv_tensor *w3 = add(m, "w3", &cur, 3, L, hidden_dim, dim);
    w->final_norm_w = add(m, "rms_final_weight", &cur, 1, dim, 0, 0);
    cur += (int64_t)seq_len * head; /* freq_cis_real and freq_cis_imag: unused */
    w->lm_head = shared ? w->embed_tokens : add(m, "classifier", &cur, 2, vocab, dim, 0);
    for (int l = 0; l < n_layers; l++) {
        rekv_layer_weights *lw = &w->layers[l];
        lw->attn_norm_w = slice(m, rms_att, l);
        lw->wq = slice(m, wq, l);
        lw->wk = slice(m, wk, l);
        lw->wv = slice(m, wv, l);
        lw->wo = slice(m, wo, l);
        lw->ffn_norm_w = slice(m, rms_ffn, l);
        lw->w1 = slice(m, w1, l);
        lw->w2 = slice(m, w2, l);
        lw->w3 = slice(m, w3, l);
    }
    *out = m;
    return 0;
fail:
    rekv_model_close(m);
    return rc;
}
