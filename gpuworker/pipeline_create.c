/* pipeline_create.c — what a pipeline and a sequence own, and the weights' place on the device:
 * rekv_pipeline_create/free (the kvstore's arena and geometry, streams, events, the model's
 * tensors on the device: each layer resident — its W_Q, W_K, W_V as one matrix where the kernels
 * have qkv (pl_qkv_pack) — or, with weights offloaded, two device buffers in load order that each
 * step refills by pl_copy_layer) and rekv_pseq_create/free (a resident KV
 * cache, ACT_GPU's device copy, the kvstore sequences; with the prefix cache, a sequence made from
 * its prompt's cached blocks and its full blocks published when it goes). */
#include "gpuworker/pipeline_internal.h"

#include <errno.h>
#include <sys/random.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/crc32c.h"
#include "common/log.h"

/* Bytes of matrix `which` (LQT_*, [n][k]) of layer l as the engine holds it (quantized: its
 * blocks); l < 0: the most any layer's takes (a quantized file may mix block types by layer). */
static size_t mat_bytes(const rekv_engine *e, int l, int which, size_t n, size_t k)
{
    size_t most = 0;
    for (int i = l < 0 ? 0 : l; i < (l < 0 ? e->c.n_layers : l + 1); i++) {
        uint32_t qt = e->lqt[i][which];
        size_t b = pl_wt_bytes(qt ? cpu_qgemm_wt(qt) : e->wdtype, n, k);
        most = b > most ? b : most;
    }
    return most;
}

/* A layer's tensor slots and sizes, in load order (N_LAYER_TENSORS, pipeline_internal.h): layer
 * l's sizes, or with l < 0 the most any layer's takes. */
static void layer_tensors(const rekv_engine *e, int l, layer_w *L, void ***slots, size_t *bytes)
{
    const rekv_model_config *c = &e->c;
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c);
    size_t KV = (size_t)rekv_config_kv_dim(c), F = (size_t)c->ffn, f = sizeof(float);
    size_t wk = mat_bytes(e, l, LQT_WK, KV, H), wv = mat_bytes(e, l, LQT_WV, KV, H);
    size_t wq = mat_bytes(e, l, LQT_WQ, Q, H), wo = mat_bytes(e, l, LQT_WO, H, Q);
    size_t w1 = mat_bytes(e, l, LQT_W1, F, H), w3 = mat_bytes(e, l, LQT_W3, F, H);
    size_t w2 = mat_bytes(e, l, LQT_W2, H, F);
    void **s[N_LAYER_TENSORS] = {
        &L->wk, &L->bk, &L->wv,          &L->bv,          &L->wq,         &L->bq,
        &L->wo, &L->bo, &L->attn_norm_w, &L->attn_norm_b, &L->ffn_norm_w, &L->ffn_norm_b,
        &L->w1, &L->b1, &L->w3,          &L->w2,          &L->b2,
        &L->post_attn_norm_w, &L->post_ffn_norm_w};
    size_t n[N_LAYER_TENSORS] = {wk,    KV * f, wv,    KV * f, wq,    Q * f, wo,
                                 H * f, H * f,  H * f, H * f,  H * f, w1,    F * f,
                                 w3,    w2,     H * f, H * f,  H * f};
    memcpy(slots, s, sizeof(s));
    memcpy(bytes, n, sizeof(n));
}

/* Points dst's fields into mem laid out in load order, for the tensors src has, each slot as large
 * as any layer's. Returns bytes. */
static size_t layer_layout(const rekv_engine *e, const layer_w *src, layer_w *dst, char *mem)
{
    void **ss[N_LAYER_TENSORS], **ds[N_LAYER_TENSORS];
    size_t n[N_LAYER_TENSORS], off = 0;
    layer_tensors(e, -1, (layer_w *)src, ss, n);
    layer_tensors(e, -1, dst, ds, n);
    for (int i = 0; i < N_LAYER_TENSORS; i++) {
        if (*ss[i] == NULL) {
            *ds[i] = NULL;
            continue;
        }
        *ds[i] = mem ? mem + off : NULL;
        off += (n[i] + 63) & ~(size_t)63;
    }
    return off;
}

/* Enqueues host->device copies of a layer's tensors [from, to) in load order. Returns bytes. */
size_t pl_copy_layer(rekv_pipeline *p, rekv_stream *s, const layer_w *src, layer_w *dst, int from,
                     int to)
{
    void **ss[N_LAYER_TENSORS], **ds[N_LAYER_TENSORS];
    size_t n[N_LAYER_TENSORS], bytes = 0;
    rekv_copy_piece pieces[N_LAYER_TENSORS];
    size_t np = 0;
    int l = (int)(src - p->e->layers); /* src is the engine's layer l */
    REKV_ASSERT(l >= 0 && l < p->c->n_layers);
    layer_tensors(p->e, l, (layer_w *)src, ss, n);
    layer_tensors(p->e, l, dst, ds, n);
    for (int i = from; i < to; i++)
        if (*ss[i]) {
            pieces[np++] = (rekv_copy_piece){*ds[i], *ss[i], n[i]};
            bytes += n[i];
        }
    if (np)
        p->bi->copy_h2d(s, pieces, np, REKV_XFER_WEIGHTS);
    return bytes;
}

/* The weights src on the device: adopted in place where the device's memory is the host's (the
 * engine keeps src and never writes it), else a copy. */
static void *dev_copy(rekv_pipeline *p, const void *src, size_t bytes, int *rc)
{
    if (src == NULL || *rc)
        return NULL;
    if (p->bi->dev_adopt != NULL) {
        void *d = p->bi->dev_adopt(p->be, src, bytes);
        if (d == NULL) {
            *rc = -ENOMEM;
            return NULL;
        }
        p->adopted[p->n_adopted].p = d;
        p->adopted[p->n_adopted++].bytes = bytes;
        return d;
    }
    void *d = p->bi->dev_alloc(p->be, bytes);
    if (d == NULL) {
        *rc = -ENOMEM;
        return NULL;
    }
    rekv_copy_piece pc = {d, src, bytes};
    p->bi->copy_h2d(p->s_h2d, &pc, 1, REKV_XFER_WEIGHTS);
    return d;
}

/* ------------------------------------------------------------------ the fused Q,K,V projection */

/* The first N_QKV_TENSORS slots of the load order (layer_tensors) are W_K, b_K, W_V, b_V, W_Q,
 * b_Q: what a fused layer keeps in its two allocations (struct pl_qkv) instead of six. */
enum { N_QKV_TENSORS = 6 };

size_t pl_wt_bytes(rekv_dtype wt, size_t n, size_t k)
{
    uint32_t qt = cpu_qgemm_wt_type(wt);
    return qt ? cpu_qgemm_row_bytes(qt, (int)k) * n : n * k * rekv_dtype_size(wt);
}

int pl_qkv_dtype(const rekv_engine *e, int l, rekv_dtype *wt)
{
    static const int mats[3] = {LQT_WQ, LQT_WK, LQT_WV};
    for (int i = 0; i < 3; i++) {
        uint32_t qt = e->lqt[l][mats[i]];
        rekv_dtype d = qt ? cpu_qgemm_wt(qt) : e->wdtype;
        if (i > 0 && d != *wt)
            return 0;
        *wt = d;
    }
    return 1;
}

/* Matrix w ([n][k], the engine's: blocks of type qt, row-major, or wdtype in the engine's
 * layout) into dst row-major in wt (pl_qkv_dtype's: the matrix's own). scratch:
 * cpu_tile_scratch_bytes(wdtype, k). */
static void pack_part(const rekv_engine *e, void *dst, const void *w, uint32_t qt, rekv_dtype wt,
                      size_t n, size_t k, void *scratch)
{
    REKV_ASSERT(wt == (qt ? cpu_qgemm_wt(qt) : e->wdtype));
    memcpy(dst, w, pl_wt_bytes(wt, n, k));
    if (!qt && rekv_engine_w_tiled(e, w))
        cpu_tile_unpack(dst, wt, (int)n, (int)k, scratch);
}

int pl_qkv_pack(const rekv_engine *e, int l, rekv_dtype wt, void *w, float *b)
{
    const rekv_model_config *c = &e->c;
    const layer_w *L = &e->layers[l];
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c);
    size_t KV = (size_t)rekv_config_kv_dim(c);
    const void *m[3] = {L->wq, L->wk, L->wv}, *bs[3] = {L->bq, L->bk, L->bv};
    const int which[3] = {LQT_WQ, LQT_WK, LQT_WV};
    size_t rows[3] = {Q, KV, KV}, at = 0;
    void *scratch = malloc(cpu_tile_scratch_bytes(e->wdtype, (int)H) + 1);
    if (scratch == NULL)
        return -ENOMEM;
    for (int i = 0; i < 3; i++) {
        pack_part(e, (uint8_t *)w + pl_wt_bytes(wt, at, H), m[i], e->lqt[l][which[i]], wt,
                  rows[i], H, scratch);
        if (b && bs[i])
            memcpy(b + at, bs[i], rows[i] * sizeof(float));
        else if (b)
            memset(b + at, 0, rows[i] * sizeof(float));
        at += rows[i];
    }
    free(scratch);
    return 0;
}

int rekv_pipeline_fused_layers(const rekv_pipeline *p)
{
    int n = 0;
    for (int l = 0; p->qkv && l < p->c->n_layers; l++)
        n += p->qkv[l].w != NULL && p->dev_layers && p->dev_layers[l].wq == p->qkv[l].w;
    return n;
}

/* Layer l of the resident weights fused (kernels.h qkv): its W_Q, W_K, W_V packed on the host and
 * copied into one device matrix (biases into one vector), dev_layers' six pointers set into them
 * so that every other reader (the recomputation's K and V, infinigen's W_Q) finds its matrix
 * where it looks. 0 (layers that cannot be fused are left to the per-tensor copies) or -ENOMEM. */
static int upload_qkv(rekv_pipeline *p, int l)
{
    const rekv_engine *e = p->e;
    const rekv_model_config *c = p->c;
    const layer_w *L = &e->layers[l];
    rekv_dtype wt;
    if (p->qkv == NULL || !pl_qkv_dtype(e, l, &wt))
        return 0;
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c);
    size_t KV = (size_t)rekv_config_kv_dim(c), n = Q + 2 * KV, wb = pl_wt_bytes(wt, n, H);
    int has_b = L->bq || L->bk || L->bv, rc = 0;
    void *hw = malloc(wb);
    float *hb = has_b ? malloc(n * sizeof(float)) : NULL;
    struct pl_qkv *f = &p->qkv[l];
    if (hw == NULL || (has_b && hb == NULL) || (rc = pl_qkv_pack(e, l, wt, hw, hb)) ||
        (f->w = p->bi->dev_alloc(p->be, wb)) == NULL ||
        (has_b && (f->b = p->bi->dev_alloc(p->be, n * sizeof(float))) == NULL)) {
        rc = -ENOMEM;
    } else {
        rekv_copy_piece pc[2] = {{f->w, hw, wb}, {f->b, hb, n * sizeof(float)}};
        p->bi->copy_h2d(p->s_h2d, pc, has_b ? 2 : 1, REKV_XFER_WEIGHTS);
        if (p->bi->stream_sync(p->s_h2d, NULL)) /* the copies have read hw, hb once done */
            rc = -EIO;
        f->wt = wt;
        layer_w *d = &p->dev_layers[l];
        d->wq = f->w;
        d->wk = (uint8_t *)f->w + pl_wt_bytes(wt, Q, H);
        d->wv = (uint8_t *)f->w + pl_wt_bytes(wt, Q + KV, H);
        d->bq = L->bq ? f->b : NULL;
        d->bk = L->bk ? f->b + Q : NULL;
        d->bv = L->bv ? f->b + Q + KV : NULL;
    }
    free(hw);
    free(hb);
    return rc;
}

void rekv_pipeline_free(rekv_pipeline *p)
{
    if (p == NULL)
        return;
    if (p->s_h2d)
        p->bi->stream_sync(p->s_h2d, NULL);
    if (p->s_compute)
        p->bi->stream_sync(p->s_compute, NULL);
    if (p->s_d2h)
        p->bi->stream_sync(p->s_d2h, NULL);
    pl_graph_free(p);
    if (p->dev_layers) {
        for (int l = 0; l < p->c->n_layers; l++) {
            void **ds[N_LAYER_TENSORS];
            size_t n[N_LAYER_TENSORS];
            layer_tensors(p->e, l, &p->dev_layers[l], ds, n);
            struct pl_qkv *f = p->qkv ? &p->qkv[l] : NULL;
            for (int i = f && f->w ? N_QKV_TENSORS : 0; i < N_LAYER_TENSORS; i++)
                if (*ds[i] && p->adopted == NULL)
                    p->bi->dev_free(p->be, *ds[i]);
            if (f && f->w)
                p->bi->dev_free(p->be, f->w);
            if (f && f->b)
                p->bi->dev_free(p->be, f->b);
        }
        free(p->dev_layers);
    }
    free(p->qkv);
    for (int i = 0; i < p->n_adopted; i++)
        p->bi->dev_unadopt(p->be, p->adopted[i].p, p->adopted[i].bytes);
    free(p->adopted);
    if (p->cfg.push && p->store) { /* the store lets go of our buffers and events first */
        const rekv_ipc_handle *hs[] = {&p->h_attn_kv[0],   &p->h_attn_kv[1], &p->h_attn_free[0],
                                       &p->h_attn_free[1], &p->h_pushed[0],  &p->h_pushed[1]};
        pl_push_release(p, hs, 6, NULL);
    }
    for (int i = 0; i < 2; i++) {
        if (p->wbuf_mem[i])
            p->bi->dev_free(p->be, p->wbuf_mem[i]);
        pl_dbuf_free(p, &p->par[i].attn_kv);
        pl_dbuf_free(p, &p->par[i].out_stage);
    }
    for (int g = 0; g < MAX_GPU_BATCHES; g++) {
        dbuf *b = (dbuf *)&p->gb[g];
        for (size_t i = 0; i < sizeof(gbatch) / sizeof(dbuf); i++)
            pl_dbuf_free(p, &b[i]);
    }
    pl_recompute_free(p);
    pl_dbuf_free(p, &p->scores);
    void *ds[] = {p->d_embed, p->d_pos, p->d_proj_in, p->d_proj_out, p->d_fnorm_w, p->d_fnorm_b};
    for (size_t i = 0; i < sizeof(ds) / sizeof(ds[0]) && p->adopted == NULL; i++)
        if (ds[i])
            p->bi->dev_free(p->be, ds[i]);
    if (p->d_head && !p->head_tied && p->adopted == NULL)
        p->bi->dev_free(p->be, p->d_head);
    rekv_event **evs[] = {p->ev_attn_free, p->ev_act, p->ev_loaded, p->ev_stage_free, p->ev_out,
                          p->ev_out_free,  p->ev_wkv, p->ev_wall,   p->ev_wfree,      p->ev_pushed};
    for (size_t i = 0; i < sizeof(evs) / sizeof(evs[0]); i++)
        for (int j = 0; j < 2; j++)
            if (evs[i][j])
                p->bi->event_destroy(evs[i][j]);
    free(p->push_pieces);
    if (p->s_compute)
        p->bi->stream_destroy(p->s_compute);
    if (p->s_h2d)
        p->bi->stream_destroy(p->s_h2d);
    if (p->s_d2h)
        p->bi->stream_destroy(p->s_d2h);
    if (p->arena_registered && p->bi->host_unregister)
        p->bi->host_unregister(p->be, p->arena);
    for (int l = 0; l < p->weights_registered; l++)
        p->bi->host_unregister(p->be, p->e->layer_mem[l]);
    if (p->ops && p->ops->free)
        p->ops->free(p);
    free(p->counters);
    free(p->step_log);
    pl_meta_free(&p->meta);
    free(p->plan);
    free(p);
}

/* The backend could not page-lock host memory the pipeline copies from: the copies still work,
 * from pageable memory, at a fraction of the link (measured on an H100: 8.3 vs 55 GB/s), so it is
 * logged and reported (rekv_pipeline_page_locked, the worker's metrics), never silent. */
static void not_page_locked(rekv_pipeline *p, const char *what, size_t bytes, rekv_err *err)
{
    p->page_locked = 0;
    rekv_log(REKV_LOG_WARN,
             "pipeline: %s (%.1f MiB) could not be page-locked (%s); host-to-device copies "
             "from it run from pageable memory, at a fraction of the link's speed — raise "
             "LimitMEMLOCK / ulimit -l, or free host memory",
             what, (double)bytes / (1 << 20), err->msg[0] ? err->msg : "no reason given");
    rekv_err_clear(err);
}

/* The config's checks before anything is made: the common ones from the mode's properties, then
 * the mode's own (ops->check), then push's (a cheap request: can the store push, and with our
 * kind of handles?). */
static int create_check(rekv_backend *be, rekv_kvstore_client *store,
                        const rekv_pipeline_config *cfg, rekv_err *err)
{
    const rekv_mode_info *mi = rekv_mode_info_of(cfg->mode);
    const pl_mode_ops *ops = pl_mode_ops_of(cfg->mode);
    if (mi == NULL || ops == NULL)
        return rekv_errf(err, -EINVAL, "pipeline: mode %d is not a mode", (int)cfg->mode);
    if (mi->store != REKV_STORE_NONE && store == NULL)
        return rekv_errf(err, -EINVAL, "pipeline: mode %s needs a kvstore", mi->name);
    if (cfg->gpu_batches < 1 || cfg->gpu_batches > MAX_GPU_BATCHES)
        return rekv_errf(err, -EINVAL, "pipeline: gpu batches must be 1..%d", MAX_GPU_BATCHES);
    if (cfg->cache_dtype != REKV_DTYPE_F32 && cfg->cache_dtype != REKV_DTYPE_F16 &&
        !rekv_dtype_quantized(cfg->cache_dtype))
        return rekv_errf(err, -EINVAL, "pipeline: the cache dtype must be F32, F16, INT8 or INT4");
    int rc;
    if (ops->check && (rc = ops->check(cfg, err)))
        return rc;
    if (cfg->act_gpu_blocks < 0 || (cfg->act_gpu_blocks > 0 && mi->approximate))
        return rekv_errf(err, -EINVAL,
                         "pipeline: ACT blocks on the device (%d) are for the exact modes that "
                         "recompute (act, hybrid, kvpr), not %s",
                         cfg->act_gpu_blocks, mi->name);
    if (cfg->kv_pool_bytes > 0 && cfg->mode != REKV_MODE_INFINIGEN)
        return rekv_errf(err, -EINVAL,
                         "pipeline: a KV pool limit (InfiniGen's, %zu bytes) is for infinigen, "
                         "not %s",
                         cfg->kv_pool_bytes, mi->name);
    if (cfg->device_tokens < 0 ||
        (cfg->device_tokens > 0 && mi->store != REKV_STORE_NONE && !mi->device_part))
        return rekv_errf(err, -EINVAL,
                         "pipeline: a device-resident part (%d tokens) is for the modes that "
                         "stream the cache (offload, kvpr, act, hybrid, infinigen), not %s",
                         cfg->device_tokens, mi->name);
    if (rekv_kernels_of(be) == NULL)
        return rekv_errf(err, -EINVAL, "pipeline: backend %s has no kernels", be->iface->name);
    if (cfg->push && mi->store == REKV_STORE_NONE)
        return rekv_errf(err, -EINVAL, "pipeline: push needs a mode that streams the KV cache");
    if (cfg->push && !rekv_backend_has_ipc(be))
        return rekv_errf(err, -ENOTSUP, "pipeline: push: backend %s cannot share buffers",
                         be->iface->name);
    if (cfg->push) {
        char name[16] = "";
        rekv_err perr = {0};
        int prc = rekv_kvstore_push(store, NULL, 0, NULL, NULL, NULL, 0, name, sizeof(name), &perr);
        if (prc)
            return rekv_errf(err, prc, "pipeline: push: %s", perr.msg);
        if (strcmp(name, be->iface->name) != 0)
            return rekv_errf(err, -ENOTSUP,
                             "pipeline: push: the kvstore pushes with the %s backend, this worker "
                             "runs %s",
                             name, be->iface->name);
    }
    return 0;
}

/* The kvstore's arena (page-locked where the backend can) and its block geometry, which must be
 * the model's at the cache dtype. */
static int attach_store(rekv_pipeline *p, rekv_kvstore_client *store, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    size_t bytes;
    p->arena = rekv_kvstore_client_arena(store, &bytes);
    p->arena_bytes = bytes;
    /* copies straight from the shared arena: page-locked where the backend can (cuda);
     * unregistered only costs speed, not correctness — but most of the link (pageable
     * copies are staged by the driver and do not overlap), so it is said loudly */
    if (p->bi->host_register) {
        p->page_locked = 1;
        if (p->bi->host_register(p->be, p->arena, bytes, err) == 0)
            p->arena_registered = 1;
        else
            not_page_locked(p, "the kvstore arena", bytes, err);
    }
    /* the device's selections (infinigen's ig_select) write its rows' sources as it reads them */
    p->arena_dev = p->bi->host_register == NULL || p->arena_registered
                       ? rekv_host_mapped(p->be, p->arena)
                       : NULL;
    rekv_kvstore_client_geometry(store, &p->geo);
    if (p->geo.n_layers != (uint32_t)c->n_layers || p->geo.n_kv_heads != (uint32_t)c->n_kv_heads ||
        p->geo.head_dim != (uint32_t)c->head_dim || p->geo.hidden != (uint32_t)c->hidden ||
        p->geo.dtype != p->cfg.cache_dtype)
        return rekv_errf(err, -EINVAL,
                         "pipeline: the kvstore's block geometry (%u layers, %u kv heads, head dim "
                         "%u, hidden %u, %s) does not match the model and cache dtype",
                         p->geo.n_layers, p->geo.n_kv_heads, p->geo.head_dim, p->geo.hidden,
                         rekv_dtype_name(p->geo.dtype));
    return 0;
}

/* The three streams and the events that order them (push: ev_attn_free and ev_pushed shared,
 * exported for the store). */
static int create_streams(rekv_pipeline *p, rekv_err *err)
{
    rekv_backend *be = p->be;
    int rc, push = p->cfg.push;
    if ((rc = p->bi->stream_create(be, "compute", &p->s_compute, err)) ||
        (rc = p->bi->stream_create(be, "h2d", &p->s_h2d, err)) ||
        (rc = p->bi->stream_create(be, "d2h", &p->s_d2h, err)))
        return rc;
    rekv_event **evs[] = {p->ev_attn_free, p->ev_act, p->ev_loaded, p->ev_stage_free, p->ev_out,
                          p->ev_out_free,  p->ev_wkv, p->ev_wall,   p->ev_wfree};
    for (size_t i = 0; i < sizeof(evs) / sizeof(evs[0]); i++)
        for (int j = 0; j < 2; j++)
            if ((rc = (push && i == 0 ? p->bi->event_create_shared
                                      : p->bi->event_create)(be, &evs[i][j], err)))
                return rc;
    for (int j = 0; j < 2 && push; j++) /* the store waits on ev_attn_free, records pushed */
        if ((rc = p->bi->event_create_shared(be, &p->ev_pushed[j], err)) ||
            (rc = p->bi->event_export(p->ev_attn_free[j], &p->h_attn_free[j], err)) ||
            (rc = p->bi->event_export(p->ev_pushed[j], &p->h_pushed[j], err)))
            return rc;
    return 0;
}

/* Weights on the device: the model's non-layer tensors always; the layers unless offloaded, else
 * two layer buffers (the engine's blocks page-locked where the backend can). 0 or -ENOMEM. */
static int upload_weights(rekv_pipeline *p, rekv_err *err)
{
    rekv_engine *e = p->e;
    rekv_backend *be = p->be;
    const rekv_model_config *c = p->c;
    int rc = 0;
    size_t E = (size_t)c->embed_dim, H = (size_t)c->hidden;
    size_t w = rekv_dtype_size(e->wdtype), f = sizeof(float);
    if (p->bi->dev_adopt != NULL && (p->adopted = calloc(7 + (size_t)c->n_layers * N_LAYER_TENSORS,
                                                         sizeof(*p->adopted))) == NULL)
        rc = -ENOMEM;
    p->d_embed = dev_copy(p, e->embed, e->embed_bytes, &rc); /* quantized: its blocks */
    p->d_pos = dev_copy(p, e->pos_embed, ((size_t)c->max_pos + 2) * H * f, &rc);
    p->d_proj_in = dev_copy(p, e->project_in, H * E * w, &rc);
    p->d_proj_out = dev_copy(p, e->project_out, E * H * w, &rc);
    p->d_fnorm_w = dev_copy(p, e->final_norm_w, H * f, &rc);
    p->d_fnorm_b = dev_copy(p, e->final_norm_b, H * f, &rc);
    p->head_tied = e->lm_head == e->embed;
    p->d_head = p->head_tied ? p->d_embed : dev_copy(p, e->lm_head, e->head_bytes, &rc);
    if (rc == 0 && p->cfg.offload_weights && p->bi->host_register && p->bi->host_unregister) {
        /* the layers stream from the engine's blocks every step: page-locked where the backend
         * can, so the copies are DMA at the link's speed and overlap compute (best effort: a
         * second pipeline on the same engine finds them registered already and copies anyway) */
        int l = 0;
        while (l < c->n_layers &&
               p->bi->host_register(be, e->layer_mem[l], e->layer_bytes, err) == 0)
            l++;
        if (l < c->n_layers) {
            not_page_locked(p, "the offloaded weights", (size_t)c->n_layers * e->layer_bytes, err);
            while (l > 0)
                p->bi->host_unregister(be, e->layer_mem[--l]);
        }
        p->weights_registered = l;
        if (p->page_locked < 0)
            p->page_locked = 1;
    }
    if (rc == 0 && p->cfg.offload_weights) {
        size_t bytes = layer_layout(e, &e->layers[0], &p->wbuf[0], NULL);
        for (int i = 0; i < 2 && rc == 0; i++) {
            p->wbuf_mem[i] = p->bi->dev_alloc(be, bytes);
            if (p->wbuf_mem[i] == NULL)
                rc = -ENOMEM;
            else
                layer_layout(e, &e->layers[0], &p->wbuf[i], p->wbuf_mem[i]);
        }
    } else if (rc == 0) {
        p->dev_layers = calloc((size_t)c->n_layers, sizeof(layer_w));
        /* W_Q, W_K, W_V as one matrix where the kernels can take it (one GEMM, kernels.h qkv);
         * not where the device adopts the engine's own copies (they stay apart, the cpu
         * reference's) */
        if (p->k->qkv && p->bi->dev_adopt == NULL)
            p->qkv = calloc((size_t)c->n_layers, sizeof(*p->qkv));
        if (p->dev_layers == NULL || (p->k->qkv && p->bi->dev_adopt == NULL && p->qkv == NULL))
            rc = -ENOMEM;
        for (int l = 0; l < c->n_layers && rc == 0; l++) {
            void **ss[N_LAYER_TENSORS], **ds[N_LAYER_TENSORS];
            size_t n[N_LAYER_TENSORS];
            layer_tensors(e, l, &e->layers[l], ss, n);
            layer_tensors(e, l, &p->dev_layers[l], ds, n);
            rc = upload_qkv(p, l);
            int fused = p->qkv && p->qkv[l].w;
            for (int i = fused ? N_QKV_TENSORS : 0; i < N_LAYER_TENSORS && rc == 0; i++)
                *ds[i] = dev_copy(p, *ss[i], n[i], &rc); /* quantized: their blocks */
        }
    }
    if (rc)
        return rekv_errf(err, rc, "pipeline: out of device memory for the weights");
    return 0;
}

int rekv_pipeline_create(rekv_engine *e, rekv_backend *be, rekv_kvstore_client *store,
                         const rekv_pipeline_config *cfg, rekv_pipeline **out, rekv_err *err)
{
    int rc = create_check(be, store, cfg, err);
    if (rc)
        return rc;
    /* quantized matrices stay in their blocks on every backend, resident or offloaded: the
     * kernels get them as cpu_qgemm_wt and decode them in the GEMM; infinigen's speculation
     * widens W_Q by the engine's dtype */
    if (e->n_qmats && cfg->mode == REKV_MODE_INFINIGEN)
        return rekv_errf(err, -ENOTSUP,
                         "pipeline: quantized (GGUF Q8_0/Q4_0/Q4_K/Q6_K) weights: not yet in "
                         "infinigen");
    /* a sliding window masks by position */
    if (e->c.sliding_window > 0 && rekv_mode_info_of(cfg->mode)->selects)
        return rekv_errf(err, -ENOTSUP,
                         "pipeline: mode %s cannot honour the model's sliding window of %d "
                         "positions (its selection picks tokens by score, not by position); use "
                         "an exact mode",
                         rekv_mode_name(cfg->mode), e->c.sliding_window);
    /* Gemma's ops: a backend whose kernel table lacks one cannot run the model */
    const rekv_kernel_iface *kt = rekv_kernels_of(be);
    if (kt && ((e->c.embed_scale != 0 && kt->scale == NULL) ||
               (e->c.final_softcap > 0 && kt->softcap == NULL)))
        return rekv_errf(err, -ENOTSUP,
                         "pipeline: the %s backend's kernels have no %s (Gemma's); run the model "
                         "on the cpu backend",
                         be->iface->name, kt->scale == NULL ? "scale" : "softcap");
    rekv_pipeline *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return rekv_errf(err, -ENOMEM, "pipeline: out of memory");
    p->e = e;
    p->c = rekv_engine_config(e);
    p->be = be;
    p->page_locked = -1;
    p->bi = be->iface;
    p->k = rekv_kernels_of(be);
    p->fold_bias = p->k && p->k->bias_activation && p->k->bias_add;
    pl_graph_init(p);
    p->store = store;
    /* read-ahead of the next layer window; REKV_READ_AHEAD=0 turns it off (for benchmarks) */
    const char *ra = getenv("REKV_READ_AHEAD");
    p->read_ahead = ra == NULL || strcmp(ra, "0") != 0;
    p->cfg = *cfg;
    p->kv_rowb = rekv_kv_row_bytes(cfg->cache_dtype, e->c.head_dim);
    p->act_esz = rekv_dtype_size(rekv_act_dtype(cfg->cache_dtype));
    if (p->cfg.prefix_cache && p->cfg.fingerprint == 0)
        p->cfg.fingerprint = rekv_engine_fingerprint(e);
    p->info = rekv_mode_info_of(cfg->mode);
    p->ops = pl_mode_ops_of(cfg->mode);
    p->keep_act = rekv_pipeline_keeps_act(cfg);
    p->meta.be = be;
    /* kvstore sequence ids are the caller's to choose and the store may outlive this pipeline
     * (a restarted worker, a second one): start at a random even base so that ids never meet */
    uint64_t base = 0;
    if (getrandom(&base, sizeof(base), 0) != (ssize_t)sizeof(base))
        base = rekv_now_ns() ^ ((uint64_t)getpid() << 32);
    p->next_id = (base & ~(uint64_t)1) | 2; /* even, never 0; kvpr uses id and id + 1 */
    p->counters = calloc((size_t)p->c->n_layers, sizeof(rekv_layer_counters));
    if (p->counters == NULL) {
        rc = rekv_errf(err, -ENOMEM, "pipeline: out of memory");
        goto fail;
    }
    /* a backend whose kernels read row-major weights only: the engine's tiled matrices become
     * row-major (the cpu backend reads either, with the same bits) */
    if (p->k && p->k->linear_tiled == NULL && (rc = rekv_engine_untile(e, err)))
        goto fail;
    if ((store && (rc = attach_store(p, store, err))) || (rc = create_streams(p, err)) ||
        (rc = upload_weights(p, err)) || (p->ops->create && (rc = p->ops->create(p, err))) ||
        (rc = p->bi->stream_sync(p->s_h2d, err)))
        goto fail;
    p->bi->stats_reset(be); /* the one-time weight upload is not part of any step */
    *out = p;
    return 0;
fail:
    rekv_pipeline_free(p);
    return rc;
}

/* ------------------------------------------------------------------ the prefix cache */

/* Whether sequences may start from cached blocks: what of their context lives on the device must
 * come from the store's blocks — resident's whole cache and the device-resident part of an all-KV
 * store (offload, kvpr's K,V sequence, infinigen) and ACT_GPU's copy of the first ACT blocks are
 * copied from them; act's and hybrid's device part is made by the sequence's next step, which
 * makes the context whole (recomputing it from the cached activations) and keeps its first tokens
 * (rekv_pseq.dev_stale); an approximate mode's per-token device state is rebuilt from them
 * (ops->prefix_fill: the partial keys of infinigen and clo; clo's head caches start forgotten, as
 * after any prefill). Every mode may, then, in every cache dtype: a partial key is made from
 * its K row as the cache holds it, new or cached (kv_gather). */
int rekv_pipeline_takes_prefix(const rekv_pipeline_config *cfg)
{
    const rekv_mode_info *mi = rekv_mode_info_of(cfg->mode);
    return cfg->prefix_cache && (!mi->approximate || pl_mode_ops_of(cfg->mode)->prefix_fill);
}

/* The pipeline's own rule: a store, and resident's cache in the store's dtype (its blocks copy
 * as they are). */
static int prefix_ok(const rekv_pipeline *p)
{
    if (p->store == NULL || !rekv_pipeline_takes_prefix(&p->cfg))
        return 0;
    return p->info->store != REKV_STORE_NONE || p->geo.dtype == p->cfg.cache_dtype;
}

static rekv_kv_prefix prefix_of(const rekv_pipeline *p, const rekv_pseq *s, const int32_t *tok,
                                size_t n)
{
    uint32_t kv, act;
    pl_store_pattern(p, s, &kv, &act);
    return (rekv_kv_prefix){tok, n, p->cfg.fingerprint, kv, act};
}

/* kvpr's two sequences from the same run: K,V in id, the activations (all ACT) in id + 1. The
 * second may find less than the first (evicted in between by another client's request): then
 * both start over from the shorter run, and from none if that too comes out uneven. */
static int seq_create_prefix_pair(rekv_pipeline *p, rekv_pseq *s, rekv_kv_prefix px,
                                  uint64_t *tokens, rekv_err *err)
{
    int rc;
    for (int round = 0; round < 3; round++) {
        rekv_kv_prefix pa = px;
        rekv_kv_prefix_hit h0 = {0}, h1 = {0};
        pa.kv_parts = 0, pa.act_parts = 1;
        if ((rc = rekv_kvstore_seq_create_prefix(p->store, s->id, &px, &h0, err)))
            return rc;
        pa.n_tokens = (size_t)h0.tokens;
        if ((rc = rekv_kvstore_seq_create_prefix(p->store, s->id + 1, &pa, &h1, err))) {
            rekv_kvstore_seq_drop(p->store, s->id, NULL);
            return rc;
        }
        if (h1.tokens == h0.tokens) {
            *tokens = h0.tokens;
            return 0;
        }
        rekv_kvstore_seq_drop(p->store, s->id, NULL);
        rekv_kvstore_seq_drop(p->store, s->id + 1, NULL);
        px.n_tokens = round == 0 ? (size_t)h1.tokens : 0;
    }
    return rekv_errf(err, -EPROTO, "kvstore: the prefix cache gave kvpr's sequences uneven runs");
}

/* Makes s's kvstore sequences from the cache's longest run of prompt's full blocks (all but its
 * last token), and its device state from them: the device part, ACT_GPU's copy, the mode's. */
static int seq_create_prefix(rekv_pipeline *p, rekv_pseq *s, const int32_t *prompt, int n_prompt,
                             rekv_err *err)
{
    /* the last token's logits are computed; a mode that speculates (ops->sparse) runs a one-row
     * step sparsely, so at least two are left to prefill, as without the cache */
    int keep = p->ops->sparse ? 2 : 1;
    int n = n_prompt - keep < s->cap ? n_prompt - keep : s->cap;
    rekv_kv_prefix px = prefix_of(p, s, prompt, n > 0 ? (size_t)n : 0);
    rekv_kv_prefix_hit hit = {0};
    int rc = p->keep_act ? seq_create_prefix_pair(p, s, px, &hit.tokens, err)
                         : rekv_kvstore_seq_create_prefix(p->store, s->id, &px, &hit, err);
    if (rc)
        return rc;
    s->len = s->cached = (int)hit.tokens;
    s->published = s->len / REKV_KV_BLOCK_TOKENS;
    memcpy(s->toks, prompt, sizeof(int32_t) * (size_t)s->len);
    /* the device part: copied from K,V blocks, or made by the next step from what it recomputes
     * (a store that keeps activations for it: act, hybrid) */
    int upto = s->dev_tokens < s->len ? s->dev_tokens : s->len;
    if (upto > 0 && p->info->store != REKV_STORE_KV)
        s->dev_stale = 1;
    else if (upto > 0)
        rc = pl_prefix_fill_device(p, s->id, s->kv_dev, s->dev_tokens, upto, err);
    if (rc == 0 && s->len > 0 && s->act_dev)
        rc = pl_prefix_fill_act(p, s, err);
    if (rc == 0 && s->len > 0 && p->ops->prefix_fill)
        rc = p->ops->prefix_fill(p, s, err);
    if (rc) {
        rekv_kvstore_seq_drop(p->store, s->id, NULL);
        if (p->keep_act)
            rekv_kvstore_seq_drop(p->store, s->id + 1, NULL);
    }
    return rc;
}

void pl_prefix_publish(rekv_pipeline *p, rekv_pseq *s)
{
    if (s->toks == NULL || s->len / REKV_KV_BLOCK_TOKENS <= s->published ||
        rekv_kvstore_client_lost(p->store))
        return;
    rekv_kv_prefix px = prefix_of(p, s, s->toks, (size_t)s->len);
    rekv_kvstore_publish(p->store, s->id, &px, NULL, NULL);
    if (p->keep_act) /* kvpr's activations */
        rekv_kvstore_publish(p->store, s->id + 1, &px, NULL, NULL);
    s->published = s->len / REKV_KV_BLOCK_TOKENS;
}

/* Resident's s from the cache's longest run of prompt's full blocks (all but its last token):
 * a store sequence made from them for as long as their K,V are copied into s's device cache,
 * then dropped (the store's references go with it; resident publishes nothing, its K,V never
 * being in the store). */
static int resident_take_prefix(rekv_pipeline *p, rekv_pseq *s, const int32_t *prompt, int n_prompt,
                                rekv_err *err)
{
    int n = n_prompt - 1 < s->cap ? n_prompt - 1 : s->cap;
    uint64_t id = p->next_id;
    p->next_id += 2;
    rekv_kv_prefix px = {prompt, n > 0 ? (size_t)n : 0, p->cfg.fingerprint, 1, 0};
    rekv_kv_prefix_hit hit = {0};
    int rc = rekv_kvstore_seq_create_prefix(p->store, id, &px, &hit, err);
    if (rc)
        return rc;
    if (hit.tokens > 0 &&
        (rc = pl_prefix_fill_device(p, id, s->kv, s->cap, (int)hit.tokens, err)) == 0)
        s->len = s->cached = (int)hit.tokens;
    int drc = rekv_kvstore_seq_drop(p->store, id, rc ? NULL : err);
    return rc ? rc : drc;
}

int rekv_pseq_cached(const rekv_pseq *s)
{
    return s->cached;
}

/* ------------------------------------------------------------------ sequences */

/* A streaming mode's part of a sequence: ACT_GPU's device copy, the device-resident part, and
 * (after the mode's own, ops->seq_alloc) its kvstore sequences — from the prompt's cached blocks
 * when prompt is given and the prefix cache allows it. */
static int seq_alloc_stream(rekv_pipeline *p, rekv_pseq *s, const int32_t *prompt, int n_prompt,
                            rekv_err *err)
{
    const rekv_model_config *c = p->c;
    if (p->cfg.act_gpu_blocks > 0 && p->info->act_gpu) {
        size_t n = (size_t)c->n_layers * (size_t)p->cfg.act_gpu_blocks * REKV_KV_BLOCK_TOKENS *
                   (size_t)c->hidden * p->act_esz;
        s->act_dev = p->bi->dev_alloc(p->be, n);
        if (s->act_dev == NULL)
            return rekv_errf(err, -ENOMEM, "out of device memory for %d ACT blocks per layer",
                             p->cfg.act_gpu_blocks);
    }
    s->dev_tokens = p->cfg.device_tokens < s->cap ? p->cfg.device_tokens : s->cap;
    if (s->dev_tokens > 0) {
        size_t n = (size_t)c->n_layers *
                   rekv_kv_buffer_bytes(c->n_kv_heads, c->head_dim, s->dev_tokens, p->kv_rowb);
        s->kv_dev = p->bi->dev_alloc(p->be, n);
        if (s->kv_dev == NULL)
            return rekv_errf(err, -ENOMEM,
                             "out of device memory for the device-resident part (%d tokens)",
                             s->dev_tokens);
    }
    int rc;
    if (p->ops->seq_alloc && (rc = p->ops->seq_alloc(p, s, err)))
        return rc;
    s->id = p->next_id;
    p->next_id += 2;
    if (prefix_ok(p)) {
        if ((s->toks = malloc(sizeof(int32_t) * (size_t)s->cap)) == NULL)
            return rekv_errf(err, -ENOMEM, "out of memory");
        if (prompt) /* kvpr's pair too */
            return seq_create_prefix(p, s, prompt, n_prompt, err);
    }
    if ((rc = rekv_kvstore_seq_create(p->store, s->id, err)))
        return rc;
    if (p->keep_act && (rc = rekv_kvstore_seq_create(p->store, s->id + 1, err))) {
        rekv_kvstore_seq_drop(p->store, s->id, NULL);
        return rc;
    }
    return 0;
}

/* The device memory of s (whatever of it was made). */
static void seq_free_device(rekv_pipeline *p, rekv_pseq *s)
{
    if (s->act_dev)
        p->bi->dev_free(p->be, s->act_dev);
    if (s->kv_dev)
        p->bi->dev_free(p->be, s->kv_dev);
    if (p->ops->seq_free)
        p->ops->seq_free(p, s);
}

int rekv_pseq_create(rekv_pipeline *p, int capacity, rekv_pseq **out, rekv_err *err)
{
    return rekv_pseq_create_prefix(p, capacity, NULL, 0, out, err);
}

int rekv_pseq_create_prefix(rekv_pipeline *p, int capacity, const int32_t *prompt, int n_prompt,
                            rekv_pseq **out, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    if (capacity <= 0 || capacity > c->max_pos)
        return rekv_errf(err, -E2BIG, "sequence capacity %d is outside the model's context (1..%d)",
                         capacity, c->max_pos);
    rekv_pseq *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    s->p = p;
    s->cap = capacity;
    s->kv_parts = p->cfg.kv_parts;
    s->act_parts = p->cfg.act_parts;
    int rc = p->info->store != REKV_STORE_NONE ? seq_alloc_stream(p, s, prompt, n_prompt, err)
             : p->ops->seq_alloc               ? p->ops->seq_alloc(p, s, err)
                                               : 0;
    if (rc == 0 && p->info->store == REKV_STORE_NONE && prompt && prefix_ok(p))
        rc = resident_take_prefix(p, s, prompt, n_prompt, err);
    if (rc) {
        seq_free_device(p, s);
        free(s->toks);
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

void rekv_pseq_free(rekv_pseq *s)
{
    if (s == NULL)
        return;
    rekv_pipeline *p = s->p;
    seq_free_device(p, s);
    if (p->info->store != REKV_STORE_NONE) {
        pl_prefix_publish(p, s); /* what the last steps filled */
        rekv_kvstore_seq_drop(p->store, s->id, NULL);
        if (p->keep_act)
            rekv_kvstore_seq_drop(p->store, s->id + 1, NULL);
    }
    free(s->toks);
    free(s);
}

int rekv_pseq_len(const rekv_pseq *s)
{
    return s->len;
}

uint64_t rekv_pseq_store_seq(const rekv_pseq *s)
{
    return s->id;
}

int rekv_pseq_uses_store_seq(const rekv_pseq *s, uint64_t store_seq)
{
    if (s->id == 0 || store_seq == 0) /* resident: no store sequence */
        return 0;
    return store_seq == s->id || (s->p->keep_act && store_seq == s->id + 1);
}
