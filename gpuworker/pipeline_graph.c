/* pipeline_graph.c — a resident decode step as one device graph (issue 15 item 4: CUDA graphs
 * for the decode step where they pay). A resident step with the weights on the device is a few
 * hundred small kernels (a 32-layer model: ~550) whose launches can cost as much host time as
 * the step's device time at small batches; replayed as a graph they are one launch.
 *
 * A graph replays its kernels with the arguments they were captured with, so a step may run as
 * the graph only if it would have launched exactly those calls. That is checked, not assumed:
 * such a step enqueues its work into a recording (the kernel table and the stream operations
 * replaced by recorders that keep each call's arguments by value, copy pieces included) while
 * the host does its part of the step as always (metadata into the step's memory, which kernels
 * read when they run); then
 * - the recording equals the graph's, byte for byte: the graph is launched;
 * - it equals the last step's (a shape that repeats: consecutive decode steps of one batch, the
 *   metadata at the same addresses, the buffers not grown): it is captured as the graph
 *   (graph_begin, the recorded calls, graph_end) and launched;
 * - otherwise its calls are issued as recorded.
 * Only recordings whose every call is a kernel or a copy on the compute stream are captured. A
 * capture the backend refuses (cuBLAS or the driver may refuse one) turns graphs off for the
 * pipeline, with a warning; the step's calls then run as recorded. Either way the same calls run
 * in the same order, so a graph changes no bit (tests/test_pipeline.c graph_steps). REKV_GRAPHS=0
 * turns graphs off, for benchmarks (`rekv bench decode` reports graph_steps per mode).
 *
 * The metadata once per step (issue 40): kernels read the step's metadata (positions, descriptors,
 * sampling rows) from the arena's host memory, pinned and mapped on cuda, over the link. A graph
 * instead begins with one copy of the arena's chunks in use to a device copy of each (meta_chunk
 * dev), and its kernels are issued with their metadata arguments pointing there (log_to_device:
 * the arguments a kernel reads, never those it writes, such as the sampled tokens the host takes
 * back). By the end of the step's recording the host has written all of it, and a graph holds no
 * host function that could write more, so the copy is what the kernels would have read. A step
 * issued call by call (a shape seen once) reads the host memory as before. Pointers inside the
 * metadata stay as written: a resident step's point at device buffers (the KV, partial keys),
 * never back into the arena (clo's skip lists would, and clo never runs as a graph). */
#include "gpuworker/pipeline_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

enum {
    OP_LINEAR,
    OP_NORM,
    OP_ROPE,
    OP_ACT,
    OP_ADD,
    OP_EMBED,
    OP_SCATTER,
    OP_KV_GATHER,
    OP_ATTN,
    OP_CONVERT,
    OP_CONVERT_OUT,
    OP_GATHER,
    OP_HEAD_PROJ,
    OP_SPEC,
    OP_SAMPLE,
    OP_QKV,
    OP_BIAS_ACT,
    OP_BIAS_ADD,
    OP_SCALE,
    OP_SOFTCAP,
    OP_H2D, /* the copies: kernels and copies are what a graph may hold */
    OP_D2H,
    OP_D2D,
    OP_HOST, /* the rest run in order but are never captured */
    OP_RECORD,
    OP_WAIT,
    OP_WAIT_FLAG,
    OP_WRITE_FLAG,
};

/* One recorded call: its header, then its arguments (a struct per op, zeroed before filling, so
 * two recordings of the same calls are the same bytes), then any copy pieces or argument bytes. */
typedef struct rec_hdr {
    uint32_t op, bytes; /* bytes: what follows the header */
    rekv_stream *s;
    const void *obj; /* the event (RECORD, WAIT) */
} rec_hdr;

/* The recording of the step in progress on this thread (a step runs on its caller's thread). */
static _Thread_local pl_log *tl_log;

static void *rec_add(uint32_t op, rekv_stream *s, const void *obj, size_t bytes)
{
    pl_log *l = tl_log;
    size_t need = sizeof(rec_hdr) + ((bytes + 7) & ~(size_t)7);
    if (l->failed)
        return NULL;
    if (l->len + need > l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 1u << 16;
        while (cap < l->len + need)
            cap *= 2;
        uint8_t *np = realloc(l->p, cap);
        if (np == NULL) {
            l->failed = 1;
            return NULL;
        }
        l->p = np;
        l->cap = cap;
    }
    rec_hdr *h = (rec_hdr *)(l->p + l->len);
    memset(h, 0, need);
    h->op = op;
    h->bytes = (uint32_t)(need - sizeof(rec_hdr));
    h->s = s;
    h->obj = obj;
    l->len += need;
    return h + 1;
}

/* ------------------------------------------------------------------ the kernels' recorders */

typedef struct a_linear {
    float *y;
    const float *x;
    const void *w;
    const float *bias;
    rekv_dtype wt;
    int m, n, k;
    int tiled; /* linear_tiled */
} a_linear;

static void r_linear(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                     const float *bias, int m, int n, int k)
{
    a_linear *a = rec_add(OP_LINEAR, s, NULL, sizeof(*a));
    if (a)
        a->y = y, a->x = x, a->w = w, a->bias = bias, a->wt = wt, a->m = m, a->n = n, a->k = k,
        a->tiled = 0;
}

static void r_linear_tiled(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                           const float *bias, int m, int n, int k)
{
    a_linear *a = rec_add(OP_LINEAR, s, NULL, sizeof(*a));
    if (a)
        a->y = y, a->x = x, a->w = w, a->bias = bias, a->wt = wt, a->m = m, a->n = n, a->k = k,
        a->tiled = 1;
}

typedef struct a_norm {
    float *out;
    const float *in, *w, *b;
    int m, d;
    float eps;
} a_norm;

static void r_norm(rekv_stream *s, float *out, const float *in, const float *w, const float *b,
                   int m, int d, float eps)
{
    a_norm *a = rec_add(OP_NORM, s, NULL, sizeof(*a));
    if (a)
        a->out = out, a->in = in, a->w = w, a->b = b, a->m = m, a->d = d, a->eps = eps;
}

typedef struct a_rope {
    float *x;
    const int32_t *pos;
    int m, n_heads, head_dim;
    const rekv_rope_freqs *f; /* the engine's, which outlives the pipeline's graphs */
    rekv_rope style;
} a_rope;

static void r_rope(rekv_stream *s, float *x, const int32_t *pos, int m, int n_heads, int head_dim,
                   const rekv_rope_freqs *f, rekv_rope style)
{
    a_rope *a = rec_add(OP_ROPE, s, NULL, sizeof(*a));
    if (a)
        a->x = x, a->pos = pos, a->m = m, a->n_heads = n_heads, a->head_dim = head_dim, a->f = f,
        a->style = style;
}

typedef struct a_act {
    float *x;
    const float *b;
    size_t n;
    rekv_act act;
} a_act;

static void r_activation(rekv_stream *s, float *x, const float *b, size_t n, rekv_act act)
{
    a_act *a = rec_add(OP_ACT, s, NULL, sizeof(*a));
    if (a)
        a->x = x, a->b = b, a->n = n, a->act = act;
}

typedef struct a_add {
    float *x;
    const float *y;
    size_t n;
} a_add;

static void r_add(rekv_stream *s, float *x, const float *y, size_t n)
{
    a_add *a = rec_add(OP_ADD, s, NULL, sizeof(*a));
    if (a)
        a->x = x, a->y = y, a->n = n;
}

typedef struct a_embed {
    float *x;
    const void *table;
    const int32_t *tokens;
    const float *pos_table;
    const int32_t *pos;
    rekv_dtype tt;
    int pos_offset, m, e;
} a_embed;

static void r_embed(rekv_stream *s, float *x, const void *table, rekv_dtype tt,
                    const int32_t *tokens, const float *pos_table, const int32_t *pos,
                    int pos_offset, int m, int e)
{
    a_embed *a = rec_add(OP_EMBED, s, NULL, sizeof(*a));
    if (a)
        a->x = x, a->table = table, a->tokens = tokens, a->pos_table = pos_table, a->pos = pos,
        a->tt = tt, a->pos_offset = pos_offset, a->m = m, a->e = e;
}

typedef struct a_scatter {
    const float *k, *v;
    const int32_t *row_seq, *row_pos, *head_pos;
    const rekv_attn_seq *seqs;
    int rows, n_kv, head_dim;
    rekv_dtype dt;
} a_scatter;

static void r_kv_scatter(rekv_stream *s, const float *k, const float *v, int rows,
                         const int32_t *row_seq, const int32_t *row_pos, const int32_t *head_pos,
                         const rekv_attn_seq *seqs, int n_kv, int head_dim, rekv_dtype dt)
{
    a_scatter *a = rec_add(OP_SCATTER, s, NULL, sizeof(*a));
    if (a)
        a->k = k, a->v = v, a->row_seq = row_seq, a->row_pos = row_pos, a->head_pos = head_pos,
        a->seqs = seqs, a->rows = rows, a->n_kv = n_kv, a->head_dim = head_dim, a->dt = dt;
}

typedef struct a_kv_gather {
    float *k;
    const int32_t *row_seq, *row_pos;
    const rekv_attn_seq *seqs;
    int rows, n_kv, head_dim;
    rekv_dtype dt;
} a_kv_gather;

static void r_kv_gather(rekv_stream *s, float *k, int rows, const int32_t *row_seq,
                        const int32_t *row_pos, const rekv_attn_seq *seqs, int n_kv, int head_dim,
                        rekv_dtype dt)
{
    a_kv_gather *a = rec_add(OP_KV_GATHER, s, NULL, sizeof(*a));
    if (a)
        a->k = k, a->row_seq = row_seq, a->row_pos = row_pos, a->seqs = seqs, a->rows = rows,
        a->n_kv = n_kv, a->head_dim = head_dim, a->dt = dt;
}

typedef struct a_attn {
    float *out;
    const float *q;
    const rekv_attn_seq *seqs;
    float *scores;
    int n_seqs, rows, n_heads, n_kv, head_dim;
    rekv_dtype dt;
} a_attn;

static void r_attention(rekv_stream *s, float *out, const float *q, const rekv_attn_seq *seqs,
                        int n_seqs, int rows, int n_heads, int n_kv, int head_dim, float *scores,
                        rekv_dtype dt)
{
    a_attn *a = rec_add(OP_ATTN, s, NULL, sizeof(*a));
    if (a)
        a->out = out, a->q = q, a->seqs = seqs, a->scores = scores, a->n_seqs = n_seqs,
        a->rows = rows, a->n_heads = n_heads, a->n_kv = n_kv, a->head_dim = head_dim, a->dt = dt;
}

typedef struct a_convert {
    const rekv_convert_piece *pieces;
    size_t n;
    rekv_dtype dtype;
} a_convert;

static void r_convert(rekv_stream *s, const rekv_convert_piece *pieces, size_t n, rekv_dtype dtype)
{
    a_convert *a = rec_add(OP_CONVERT, s, NULL, sizeof(*a));
    if (a)
        a->pieces = pieces, a->n = n, a->dtype = dtype;
}

typedef struct a_convert_out {
    void *dst;
    const float *src;
    size_t n;
    rekv_dtype dtype;
} a_convert_out;

static void r_convert_out(rekv_stream *s, void *dst, const float *src, size_t n, rekv_dtype dtype)
{
    a_convert_out *a = rec_add(OP_CONVERT_OUT, s, NULL, sizeof(*a));
    if (a)
        a->dst = dst, a->src = src, a->n = n, a->dtype = dtype;
}

typedef struct a_gather {
    float *dst;
    const float *src;
    const int32_t *idx;
    int n, w;
} a_gather;

static void r_gather_rows(rekv_stream *s, float *dst, const float *src, const int32_t *idx, int n,
                          int w)
{
    a_gather *a = rec_add(OP_GATHER, s, NULL, sizeof(*a));
    if (a)
        a->dst = dst, a->src = src, a->idx = idx, a->n = n, a->w = w;
}

typedef struct a_head_proj {
    float *out;
    float *const *out_rows;
    const float *in, *a;
    int rows, n_heads, group, hd, rk;
} a_head_proj;

static void r_head_proj(rekv_stream *s, float *out, float *const *out_rows, const float *in,
                        const float *am, int rows, int n_heads, int group, int hd, int rk)
{
    a_head_proj *a = rec_add(OP_HEAD_PROJ, s, NULL, sizeof(*a));
    if (a)
        a->out = out, a->out_rows = out_rows, a->in = in, a->a = am, a->rows = rows,
        a->n_heads = n_heads, a->group = group, a->hd = hd, a->rk = rk;
}

typedef struct a_spec {
    float *out;
    const float *q;
    const rekv_spec_seq *seqs;
    int n, n_heads, group, rk;
    float scale;
} a_spec;

static void r_spec_scores(rekv_stream *s, float *out, const float *q, const rekv_spec_seq *seqs,
                          int n, int n_heads, int group, int rk, float scale)
{
    a_spec *a = rec_add(OP_SPEC, s, NULL, sizeof(*a));
    if (a)
        a->out = out, a->q = q, a->seqs = seqs, a->n = n, a->n_heads = n_heads, a->group = group,
        a->rk = rk, a->scale = scale;
}

typedef struct a_sample {
    int32_t *ids, *top_ids;
    float *top_vals;
    rekv_sample_lp *lp;
    const float *logits;
    const rekv_sample_row *rows;
    void *scratch;
    int n, vocab;
} a_sample;

static void r_sample(rekv_stream *s, int32_t *ids, int32_t *top_ids, float *top_vals,
                     rekv_sample_lp *lp, const float *logits, const rekv_sample_row *rows, int n,
                     int vocab, void *scratch)
{
    a_sample *a = rec_add(OP_SAMPLE, s, NULL, sizeof(*a));
    if (a)
        a->ids = ids, a->top_ids = top_ids, a->top_vals = top_vals, a->lp = lp, a->logits = logits,
        a->rows = rows, a->scratch = scratch, a->n = n, a->vocab = vocab;
}

typedef struct a_qkv {
    float *q, *k, *v;
    const float *x, *bias;
    const void *w;
    const int32_t *pos;
    const rekv_rope_freqs *f; /* the engine's, as a_rope's */
    rekv_dtype wt;
    rekv_rope style;
    int m, kdim, n_heads, n_kv, head_dim;
} a_qkv;

static void r_qkv(rekv_stream *s, float *q, float *k, float *v, const float *x, const void *w,
                  rekv_dtype wt, const float *bias, int m, int kdim, int n_heads, int n_kv,
                  int head_dim, const int32_t *pos, const rekv_rope_freqs *f, rekv_rope style)
{
    a_qkv *a = rec_add(OP_QKV, s, NULL, sizeof(*a));
    if (a)
        a->q = q, a->k = k, a->v = v, a->x = x, a->w = w, a->wt = wt, a->bias = bias, a->m = m,
        a->kdim = kdim, a->n_heads = n_heads, a->n_kv = n_kv, a->head_dim = head_dim, a->pos = pos,
        a->f = f, a->style = style;
}

typedef struct a_bias_op {
    float *x;
    const float *y, *bias, *b;
    int m, n;
    rekv_act act;
} a_bias_op;

static void r_bias_activation(rekv_stream *s, float *a, const float *bias, const float *b, int m,
                              int n, rekv_act act)
{
    a_bias_op *r = rec_add(OP_BIAS_ACT, s, NULL, sizeof(*r));
    if (r)
        r->x = a, r->bias = bias, r->b = b, r->m = m, r->n = n, r->act = act;
}

static void r_bias_add(rekv_stream *s, float *x, const float *y, const float *bias, int m, int n)
{
    a_bias_op *r = rec_add(OP_BIAS_ADD, s, NULL, sizeof(*r));
    if (r)
        r->x = x, r->y = y, r->bias = bias, r->m = m, r->n = n;
}

typedef struct a_scale {
    float *x;
    size_t n;
    float a;
} a_scale; /* scale's factor or softcap's cap */

static void r_scale(rekv_stream *s, float *x, size_t n, float f)
{
    a_scale *a = rec_add(OP_SCALE, s, NULL, sizeof(*a));
    if (a)
        a->x = x, a->n = n, a->a = f;
}

static void r_softcap(rekv_stream *s, float *x, size_t n, float cap)
{
    a_scale *a = rec_add(OP_SOFTCAP, s, NULL, sizeof(*a));
    if (a)
        a->x = x, a->n = n, a->a = cap;
}

const rekv_kernel_iface pl_rec_kernels = {
    .linear = r_linear,
    .norm = r_norm,
    .rope = r_rope,
    .activation = r_activation,
    .add = r_add,
    .embed = r_embed,
    .kv_scatter = r_kv_scatter,
    .kv_gather = r_kv_gather,
    .attention = r_attention,
    .convert = r_convert,
    .convert_out = r_convert_out,
    .gather_rows = r_gather_rows,
    .head_proj = r_head_proj,
    .spec_scores = r_spec_scores,
    .sample = r_sample,
    .linear_tiled = r_linear_tiled,
    .qkv = r_qkv,
    .bias_activation = r_bias_activation,
    .bias_add = r_bias_add,
    .scale = r_scale,
    .softcap = r_softcap,
};

/* ------------------------------------------------------------------ the stream operations' */

typedef struct a_copy {
    size_t n;
    rekv_xfer_kind kind;
} a_copy; /* then the pieces: a copy's are taken at enqueue, so they are part of the call */

static void rec_copy(uint32_t op, rekv_stream *s, const rekv_copy_piece *pieces, size_t n,
                     rekv_xfer_kind kind)
{
    a_copy *a = rec_add(op, s, NULL, sizeof(*a) + n * sizeof(rekv_copy_piece));
    if (a) {
        a->n = n, a->kind = kind;
        if (n)
            memcpy(a + 1, pieces, n * sizeof(rekv_copy_piece));
    }
}

static void r_copy_h2d(rekv_stream *s, const rekv_copy_piece *pc, size_t n, rekv_xfer_kind kind)
{
    rec_copy(OP_H2D, s, pc, n, kind);
}

static void r_copy_d2h(rekv_stream *s, const rekv_copy_piece *pc, size_t n, rekv_xfer_kind kind)
{
    rec_copy(OP_D2H, s, pc, n, kind);
}

static void r_copy_d2d(rekv_stream *s, const rekv_copy_piece *pc, size_t n)
{
    rec_copy(OP_D2D, s, pc, n, REKV_XFER_OTHER);
}

typedef struct a_host {
    const char *name;
    rekv_host_fn fn;
    const void *arg; /* arg_bytes == 0: passed through; else the bytes follow */
    size_t arg_bytes;
} a_host;

static void r_launch_host(rekv_stream *s, const char *name, rekv_host_fn fn, const void *arg,
                          size_t arg_bytes)
{
    a_host *a = rec_add(OP_HOST, s, NULL, sizeof(*a) + arg_bytes);
    if (a) {
        a->name = name, a->fn = fn, a->arg = arg_bytes ? NULL : arg, a->arg_bytes = arg_bytes;
        if (arg_bytes)
            memcpy(a + 1, arg, arg_bytes);
    }
}

static void r_event_record(rekv_event *ev, rekv_stream *s)
{
    rec_add(OP_RECORD, s, ev, 0);
}

static void r_stream_wait_event(rekv_stream *s, rekv_event *ev)
{
    rec_add(OP_WAIT, s, ev, 0);
}

typedef struct a_flag {
    uint32_t *flag;
    uint32_t value;
} a_flag;

static void r_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value)
{
    a_flag *a = rec_add(OP_WAIT_FLAG, s, NULL, sizeof(*a));
    if (a)
        a->flag = (uint32_t *)flag, a->value = value;
}

static void r_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value)
{
    a_flag *a = rec_add(OP_WRITE_FLAG, s, NULL, sizeof(*a));
    if (a)
        a->flag = flag, a->value = value;
}

/* A wait for work that is recorded, not enqueued, could only wait for the wrong work. */
static int r_stream_sync(rekv_stream *s, rekv_err *err)
{
    (void)s;
    tl_log->failed = 1;
    return rekv_errf(err, -EPROTO, "pipeline: a stream synchronised while a step was recorded");
}

static int r_streams_sync(rekv_stream *const *s, int n, rekv_err *err)
{
    return r_stream_sync(n > 0 ? s[0] : NULL, err);
}

/* ------------------------------------------------------------------ replay */

/* A recorded kernel launch (an op before OP_H2D), issued through the real kernel table. */
static void issue_kernel(const rekv_kernel_iface *k, const rec_hdr *h, const void *arg)
{
    rekv_stream *s = h->s;
    switch (h->op) {
    case OP_LINEAR: {
        const a_linear *a = arg;
        (a->tiled ? k->linear_tiled : k->linear)(s, a->y, a->x, a->w, a->wt, a->bias, a->m,
                                                 a->n, a->k);
        break;
    }
    case OP_NORM: {
        const a_norm *a = arg;
        k->norm(s, a->out, a->in, a->w, a->b, a->m, a->d, a->eps);
        break;
    }
    case OP_ROPE: {
        const a_rope *a = arg;
        k->rope(s, a->x, a->pos, a->m, a->n_heads, a->head_dim, a->f, a->style);
        break;
    }
    case OP_ACT: {
        const a_act *a = arg;
        k->activation(s, a->x, a->b, a->n, a->act);
        break;
    }
    case OP_ADD: {
        const a_add *a = arg;
        k->add(s, a->x, a->y, a->n);
        break;
    }
    case OP_EMBED: {
        const a_embed *a = arg;
        k->embed(s, a->x, a->table, a->tt, a->tokens, a->pos_table, a->pos, a->pos_offset, a->m,
                 a->e);
        break;
    }
    case OP_SCATTER: {
        const a_scatter *a = arg;
        k->kv_scatter(s, a->k, a->v, a->rows, a->row_seq, a->row_pos, a->head_pos, a->seqs,
                      a->n_kv, a->head_dim, a->dt);
        break;
    }
    case OP_KV_GATHER: {
        const a_kv_gather *a = arg;
        k->kv_gather(s, a->k, a->rows, a->row_seq, a->row_pos, a->seqs, a->n_kv, a->head_dim,
                     a->dt);
        break;
    }
    case OP_ATTN: {
        const a_attn *a = arg;
        k->attention(s, a->out, a->q, a->seqs, a->n_seqs, a->rows, a->n_heads, a->n_kv,
                     a->head_dim, a->scores, a->dt);
        break;
    }
    case OP_CONVERT: {
        const a_convert *a = arg;
        k->convert(s, a->pieces, a->n, a->dtype);
        break;
    }
    case OP_CONVERT_OUT: {
        const a_convert_out *a = arg;
        k->convert_out(s, a->dst, a->src, a->n, a->dtype);
        break;
    }
    case OP_GATHER: {
        const a_gather *a = arg;
        k->gather_rows(s, a->dst, a->src, a->idx, a->n, a->w);
        break;
    }
    case OP_HEAD_PROJ: {
        const a_head_proj *a = arg;
        k->head_proj(s, a->out, a->out_rows, a->in, a->a, a->rows, a->n_heads, a->group, a->hd,
                     a->rk);
        break;
    }
    case OP_SPEC: {
        const a_spec *a = arg;
        k->spec_scores(s, a->out, a->q, a->seqs, a->n, a->n_heads, a->group, a->rk, a->scale);
        break;
    }
    case OP_SAMPLE: {
        const a_sample *a = arg;
        k->sample(s, a->ids, a->top_ids, a->top_vals, a->lp, a->logits, a->rows, a->n, a->vocab,
                  a->scratch);
        break;
    }
    case OP_QKV: {
        const a_qkv *a = arg;
        k->qkv(s, a->q, a->k, a->v, a->x, a->w, a->wt, a->bias, a->m, a->kdim, a->n_heads,
               a->n_kv, a->head_dim, a->pos, a->f, a->style);
        break;
    }
    case OP_BIAS_ACT: {
        const a_bias_op *a = arg;
        k->bias_activation(s, a->x, a->bias, a->b, a->m, a->n, a->act);
        break;
    }
    case OP_BIAS_ADD: {
        const a_bias_op *a = arg;
        k->bias_add(s, a->x, a->y, a->bias, a->m, a->n);
        break;
    }
    case OP_SCALE:
    case OP_SOFTCAP: {
        const a_scale *a = arg;
        (h->op == OP_SCALE ? k->scale : k->softcap)(s, a->x, a->n, a->a);
        break;
    }
    }
}

/* A recorded copy, host function, event or flag (OP_H2D and after), issued through the real
 * backend. */
static void issue_stream_op(const rekv_backend_iface *bi, const rec_hdr *h, const void *arg)
{
    rekv_stream *s = h->s;
    switch (h->op) {
    case OP_H2D:
    case OP_D2H:
    case OP_D2D: {
        const a_copy *a = arg;
        const rekv_copy_piece *pc = (const rekv_copy_piece *)(a + 1);
        if (h->op == OP_H2D)
            bi->copy_h2d(s, pc, a->n, a->kind);
        else if (h->op == OP_D2H)
            bi->copy_d2h(s, pc, a->n, a->kind);
        else
            bi->copy_d2d(s, pc, a->n);
        break;
    }
    case OP_HOST: {
        const a_host *a = arg;
        bi->launch_host(s, a->name, a->fn, a->arg_bytes ? (const void *)(a + 1) : a->arg,
                        a->arg_bytes);
        break;
    }
    case OP_RECORD:
        bi->event_record((rekv_event *)h->obj, s);
        break;
    case OP_WAIT:
        bi->stream_wait_event(s, (rekv_event *)h->obj);
        break;
    case OP_WAIT_FLAG: {
        const a_flag *a = arg;
        bi->stream_wait_flag(s, a->flag, a->value);
        break;
    }
    case OP_WRITE_FLAG: {
        const a_flag *a = arg;
        bi->stream_write_flag(s, a->flag, a->value);
        break;
    }
    }
}

/* ------------------------------------------------------------------ the metadata on the device */

/* ptr's place in the device copy of the arena's chunk that holds it (in use), or ptr */
static const void *meta_dev(const meta_arena *a, const void *ptr)
{
    const uint8_t *q = ptr;
    for (size_t i = 0; q != NULL && i < a->n; i++) {
        const meta_chunk *c = &a->chunks[i];
        if (c->dev != NULL && q >= c->p && q < c->p + c->used)
            return (const uint8_t *)c->dev + (q - c->p);
    }
    return ptr;
}

#define TO_DEV(a, field) ((field) = (__typeof__(field))meta_dev((a), (field)))

/* out: the recording l with each kernel's metadata arguments — what it reads — in the arena's
 * device copies. -ENOMEM. */
static int log_to_device(const pl_log *l, pl_log *out, const meta_arena *m)
{
    if (pl_reserve_bytes((void **)&out->p, &out->cap, l->len, 1))
        return -ENOMEM;
    memcpy(out->p, l->p, l->len);
    out->len = l->len;
    for (size_t at = 0; at < out->len;) {
        rec_hdr *h = (rec_hdr *)(out->p + at);
        void *arg = h + 1;
        at += sizeof(*h) + h->bytes;
        switch (h->op) {
        case OP_ROPE:
            TO_DEV(m, ((a_rope *)arg)->pos);
            break;
        case OP_EMBED:
            TO_DEV(m, ((a_embed *)arg)->tokens);
            TO_DEV(m, ((a_embed *)arg)->pos);
            break;
        case OP_SCATTER: {
            a_scatter *a = arg;
            TO_DEV(m, a->row_seq), TO_DEV(m, a->row_pos), TO_DEV(m, a->head_pos);
            TO_DEV(m, a->seqs);
            break;
        }
        case OP_KV_GATHER: {
            a_kv_gather *a = arg;
            TO_DEV(m, a->row_seq), TO_DEV(m, a->row_pos), TO_DEV(m, a->seqs);
            break;
        }
        case OP_ATTN:
            TO_DEV(m, ((a_attn *)arg)->seqs);
            break;
        case OP_CONVERT:
            TO_DEV(m, ((a_convert *)arg)->pieces);
            break;
        case OP_GATHER:
            TO_DEV(m, ((a_gather *)arg)->idx);
            break;
        case OP_HEAD_PROJ:
            TO_DEV(m, ((a_head_proj *)arg)->out_rows);
            break;
        case OP_SPEC:
            TO_DEV(m, ((a_spec *)arg)->seqs);
            break;
        case OP_SAMPLE:
            TO_DEV(m, ((a_sample *)arg)->rows);
            break;
        case OP_QKV:
            TO_DEV(m, ((a_qkv *)arg)->pos);
            break;
        }
    }
    return 0;
}

/* The copy of the arena's chunks in use to their device copies (made here on first use) into
 * p->gr.meta_copy; -ENOMEM when one cannot be made (the step then reads the host memory). */
static int meta_copy_make(rekv_pipeline *p)
{
    meta_arena *a = &p->meta;
    const rekv_backend_iface *bi = p->gr.real_bi;
    p->gr.n_meta_copy = 0;
    for (size_t i = 0; i < a->n; i++) {
        meta_chunk *c = &a->chunks[i];
        if (c->used == 0)
            continue;
        if (c->dev == NULL && (c->dev = bi->dev_alloc(p->be, c->cap)) == NULL)
            return -ENOMEM;
        if (pl_reserve_bytes((void **)&p->gr.meta_copy, &p->gr.cap_meta_copy,
                             p->gr.n_meta_copy + 1, sizeof(rekv_copy_piece)))
            return -ENOMEM;
        p->gr.meta_copy[p->gr.n_meta_copy++] = (rekv_copy_piece){c->dev, c->p, c->used};
    }
    return 0;
}

/* Whether the arena's chunks in use are those the graph copies. */
static int meta_copy_same(const rekv_pipeline *p)
{
    const meta_arena *a = &p->meta;
    size_t k = 0;
    for (size_t i = 0; i < a->n; i++) {
        const meta_chunk *c = &a->chunks[i];
        if (c->used == 0)
            continue;
        if (k == p->gr.n_meta_copy || p->gr.meta_copy[k].src != c->p ||
            p->gr.meta_copy[k].bytes != c->used)
            return 0;
        k++;
    }
    return k == p->gr.n_meta_copy;
}

/* Issues the recorded calls, in order, through the real kernel table and backend. */
static void log_issue(const rekv_kernel_iface *k, const rekv_backend_iface *bi, const pl_log *l)
{
    for (size_t at = 0; at < l->len;) {
        const rec_hdr *h = (const rec_hdr *)(l->p + at);
        at += sizeof(*h) + h->bytes;
        if (h->op < OP_H2D)
            issue_kernel(k, h, h + 1);
        else
            issue_stream_op(bi, h, h + 1);
    }
}

/* A graph may hold it: every call a kernel or a copy, on the compute stream. */
static int log_capturable(const pl_log *l, rekv_stream *sc)
{
    for (size_t at = 0; at < l->len;) {
        const rec_hdr *h = (const rec_hdr *)(l->p + at);
        if (h->s != sc || h->op > OP_D2D)
            return 0;
        at += sizeof(*h) + h->bytes;
    }
    return l->len > 0;
}

static int log_equal(const pl_log *a, const pl_log *b)
{
    return a->len == b->len && a->len > 0 && memcmp(a->p, b->p, a->len) == 0;
}

static void log_swap(pl_log *a, pl_log *b)
{
    pl_log t = *a;
    *a = *b;
    *b = t;
}

/* ------------------------------------------------------------------ the step's side */

void pl_graph_init(rekv_pipeline *p)
{
    p->gr.bi = *p->bi;
    p->gr.bi.copy_h2d = r_copy_h2d;
    p->gr.bi.copy_d2h = r_copy_d2h;
    p->gr.bi.copy_d2d = r_copy_d2d;
    p->gr.bi.launch_host = r_launch_host;
    p->gr.bi.copy_h2d_listed = NULL; /* infinigen's alone: never in a recorded (resident) step */
    p->gr.bi.event_record = r_event_record;
    p->gr.bi.stream_wait_event = r_stream_wait_event;
    p->gr.bi.stream_wait_flag = r_stream_wait_flag;
    p->gr.bi.stream_write_flag = r_stream_write_flag;
    p->gr.bi.stream_sync = r_stream_sync;
    p->gr.bi.streams_sync = r_streams_sync;
    p->gr.real_bi = p->bi;
    p->gr.real_k = p->k;
    /* REKV_GRAPHS=0 launches every step call by call (to measure what the graphs give) */
    const char *env = getenv("REKV_GRAPHS");
    p->gr.off = env != NULL && strcmp(env, "0") == 0;
}

void pl_graph_free(rekv_pipeline *p)
{
    if (p->gr.graph && p->gr.real_bi)
        p->gr.real_bi->graph_destroy(p->gr.graph);
    for (int i = 0; i < PL_LOGS; i++)
        free(p->gr.log[i].p);
    free(p->gr.meta_copy);
}

int pl_graph_begin(rekv_pipeline *p, const rekv_pipe_item *items, int n)
{
    if (p->gr.off || p->gr.real_bi->graph_begin == NULL || p->info->store != REKV_STORE_NONE ||
        p->cfg.offload_weights)
        return 0;
    /* decode steps whose items take only draws back (a logits row goes to the caller's memory,
     * pageable on a GPU, which a graph may not copy into) */
    for (int i = 0; i < n; i++)
        if (items[i].n_tokens != 1 || items[i].logits != NULL)
            return 0;
    pl_log *rec = &p->gr.log[PL_LOG_STEP];
    rec->len = 0;
    rec->failed = 0;
    tl_log = rec;
    p->k = &pl_rec_kernels;
    p->bi = &p->gr.bi;
    return 1;
}

int pl_graph_end(rekv_pipeline *p, int issue, rekv_err *err)
{
    const rekv_backend_iface *bi = p->gr.real_bi;
    const rekv_kernel_iface *k = p->gr.real_k;
    p->k = k;
    p->bi = bi;
    tl_log = NULL;
    pl_log *rec = &p->gr.log[PL_LOG_STEP], *last = &p->gr.log[PL_LOG_LAST],
           *glog = &p->gr.log[PL_LOG_GRAPH];
    rekv_stream *sc = p->s_compute;
    if (!issue) /* the step failed before its work was complete: none of it runs */
        return 0;
    if (rec->failed)
        return rekv_errf(err, -ENOMEM, "step: out of memory recording its work");
    if (p->gr.graph && log_equal(rec, glog) && meta_copy_same(p)) {
        bi->graph_launch(sc, p->gr.graph);
        p->gr.steps++;
        return 0;
    }
    pl_log *dlog = &p->gr.log[PL_LOG_DEV];
    if (log_equal(rec, last) && log_capturable(rec, sc) && meta_copy_make(p) == 0 &&
        log_to_device(rec, dlog, &p->meta) == 0) {
        rekv_err gerr = {0};
        rekv_graph *g = NULL;
        int rc = bi->graph_begin(sc, &gerr);
        if (rc == 0) {
            bi->copy_h2d(sc, p->gr.meta_copy, p->gr.n_meta_copy, REKV_XFER_OTHER);
            log_issue(k, bi, dlog);
            rc = bi->graph_end(sc, &g, &gerr);
        }
        if (rc == 0) {
            if (p->gr.graph)
                bi->graph_destroy(p->gr.graph);
            p->gr.graph = g;
            log_swap(glog, rec);
            bi->graph_launch(sc, g);
            p->gr.steps++;
            p->gr.captures++;
            return 0;
        }
        p->gr.off = 1;
        rekv_log(REKV_LOG_WARN,
                 "pipeline: the %s backend refused to capture a decode step as a graph (%s); "
                 "steps launch their kernels one by one",
                 bi->name, gerr.msg);
    }
    log_issue(k, bi, rec);
    log_swap(last, rec);
    return 0;
}

uint64_t rekv_pipeline_graph_steps(const rekv_pipeline *p, uint64_t *captures)
{
    if (captures)
        *captures = p->gr.captures;
    return p->gr.steps;
}
