/* premises.c — the premises of InfiniGen and CLO measured on the cpu engine (premises.h says
 * which). A tap on the engine's attention sees, per layer and step, the block input x, the
 * attention input h and the true q, k; it keeps every layer's keys (and their partial keys, the
 * skew's A[:, cols] of them) and, within a decode step, the layer before's x and h. At a decode
 * step of layer l it scores the past tokens twice — exactly (q·k) and as infinigen speculates
 * (the partial query, made from the attention input pl_ig_lookahead's rule names, against the
 * partial keys) — lets rekv_ig_select choose from the speculated scores and counts how many of
 * the exact top m it chose. Sums in double. */
#include "gpuworker/premises.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/cpu_ops.h"
#include "gpuworker/engine_internal.h"
#include "gpuworker/pipeline_internal.h"

typedef struct pm_tap {
    rekv_engine *e;
    const rekv_skew *sk;
    float alpha, max_fraction;
    int lookahead, cap;
    int *len;            /* [n_layers] keys kept */
    float *keys;         /* [n_layers][cap][kv_dim] */
    float *pkeys;        /* [n_layers][cap][n_kv][rk] */
    float *prev_q;       /* [n_layers][q_dim]: the query at the step before */
    int *has_prev;       /* [n_layers] */
    float *x_prev, *h_prev; /* [hidden]: the layer before's, this step */
    float *qs, *pq;      /* [q_dim] a speculated query; [n_heads][rk] its partial one */
    float *sc, *ex;      /* [n_heads][cap] speculated and exact scores */
    float *scratch;      /* [(n_kv + 1) * cap] */
    int32_t *sel, *top;  /* [n_kv][cap], [cap] */
    float *comb, *tmp;   /* [cap] each */
    uint8_t *mark;       /* [cap] */
    double *s_in, *s_spec, *s_adj, *s_rec; /* [n_layers] sums */
    uint64_t *n_in, *n_spec, *n_adj, *n_rec;
    int fail;
} pm_tap;

/* The partial vector of one head's row r (head_dim) through KV head g's A[:, cols] of layer l. */
static void partial(const pm_tap *t, int l, int g, const float *r, float *out)
{
    const rekv_skew *sk = t->sk;
    int hd = sk->head_dim, rk = sk->rk;
    const float *a = sk->a + ((size_t)l * sk->n_kv_heads + g) * (size_t)hd * hd;
    const int32_t *cols = sk->cols + ((size_t)l * sk->n_kv_heads + g) * (size_t)rk;
    for (int j = 0; j < rk; j++) {
        double s = 0;
        for (int d = 0; d < hd; d++)
            s += (double)r[d] * a[(size_t)d * hd + cols[j]];
        out[j] = (float)s;
    }
}

/* Layer l's query from attention input h (its own or the layer before's), as the speculation
 * makes it: W_Q h + b, rotated at this step's position. */
static void query_from(pm_tap *t, int l, const float *h, float *q)
{
    const rekv_engine *e = t->e;
    const rekv_model_config *c = &e->c;
    const layer_w *L = &e->layers[l];
    rekv_engine_gemm(e, q, h, L->wq, L->bq, 1, rekv_config_q_dim(c), c->hidden);
    if (c->rope != REKV_ROPE_NONE)
        cpu_rope(q, e->rope_cos, e->rope_sin, 1, c->n_heads, c->head_dim, c->rope);
}

/* Recall at layer l of this decode step: the speculated selection against the exact top m. */
static void recall_step(pm_tap *t, int l, const float *q, const float *h_own)
{
    const rekv_model_config *c = &t->e->c;
    int nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, rk = t->sk->rk;
    int group = nh / nkv, len = t->len[l], KV = rekv_config_kv_dim(c);
    float inv = 1.0f / sqrtf((float)hd);
    int la = l == 1 ? 0 : t->lookahead;
    query_from(t, l, la ? t->h_prev : h_own, t->qs);
    const float *keys = t->keys + (size_t)l * t->cap * KV;
    const float *pk = t->pkeys + (size_t)l * t->cap * nkv * rk;
    for (int h = 0; h < nh; h++) {
        int g = h / group;
        partial(t, l, g, t->qs + (size_t)h * hd, t->pq + (size_t)h * rk);
        for (int j = 0; j < len; j++) {
            const float *kp = pk + ((size_t)j * nkv + g) * rk, *kr = keys + (size_t)j * KV + g * hd;
            double s = 0, x = 0;
            for (int d = 0; d < rk; d++)
                s += (double)t->pq[(size_t)h * rk + d] * kp[d];
            for (int d = 0; d < hd; d++)
                x += (double)q[(size_t)h * hd + d] * kr[d];
            t->sc[(size_t)h * len + j] = (float)s * inv;
            t->ex[(size_t)h * len + j] = (float)x * inv;
        }
    }
    int m = rekv_ig_select(t->sc, nh, nkv, len, t->alpha, t->max_fraction, REKV_SELECT_SPECULATE,
                           0, t->sel, t->scratch);
    for (int g = 0; g < nkv; g++) {
        pl_ig_group_probs(t->ex, group, g, len, t->comb, t->tmp, NULL);
        pl_ig_top(t->comb, len, m, t->tmp, t->top);
        memset(t->mark, 0, (size_t)len);
        for (int j = 0; j < m; j++)
            t->mark[t->top[j]] = 1;
        int hit = 0;
        for (int j = 0; j < m; j++)
            hit += t->mark[t->sel[(size_t)g * len + j]];
        t->s_rec[l] += (double)hit / m;
        t->n_rec[l]++;
    }
}

static void pm_tap_layer(void *ctx, int l, const float *x, const float *h, const float *q,
                         const float *k, const float *v, int rows)
{
    pm_tap *t = ctx;
    const rekv_model_config *c = &t->e->c;
    int nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, rk = t->sk->rk;
    int H = c->hidden, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c);
    if (t->len[l] + rows > t->cap) {
        t->fail = 1;
        return;
    }
    if (rows == 1) { /* a decode step */
        float *pq = t->prev_q + (size_t)l * Q;
        if (t->has_prev[l]) {
            double s = 0;
            for (int hh = 0; hh < nh; hh++)
                s += cpu_cosine(q + (size_t)hh * hd, pq + (size_t)hh * hd, hd);
            t->s_adj[l] += s / nh, t->n_adj[l]++;
        }
        memcpy(pq, q, sizeof(float) * (size_t)Q);
        t->has_prev[l] = 1;
        if (l > 0) {
            t->s_in[l] += cpu_cosine(x, t->x_prev, H), t->n_in[l]++;
            query_from(t, l, t->h_prev, t->qs);
            double s = 0;
            for (int hh = 0; hh < nh; hh++)
                s += cpu_cosine(t->qs + (size_t)hh * hd, q + (size_t)hh * hd, hd);
            t->s_spec[l] += s / nh, t->n_spec[l]++;
            if (t->len[l] > 0)
                recall_step(t, l, q, h);
        }
        memcpy(t->x_prev, x, sizeof(float) * (size_t)H);
        memcpy(t->h_prev, h, sizeof(float) * (size_t)H);
    }
    for (int r = 0; r < rows; r++) { /* keep the keys, and their partial keys */
        int j = t->len[l]++;
        float *dst = t->keys + ((size_t)l * t->cap + j) * KV;
        memcpy(dst, k + (size_t)r * KV, sizeof(float) * (size_t)KV);
        for (int g = 0; g < nkv; g++)
            partial(t, l, g, dst + (size_t)g * hd,
                    t->pkeys + (((size_t)l * t->cap + j) * nkv + g) * rk);
    }
}

static int pm_alloc(pm_tap *t, const rekv_model_config *c, int cap)
{
    size_t L = (size_t)c->n_layers, nh = (size_t)c->n_heads, nkv = (size_t)c->n_kv_heads;
    size_t Q = (size_t)rekv_config_q_dim(c), KV = (size_t)rekv_config_kv_dim(c), C = (size_t)cap;
    size_t rk = (size_t)t->sk->rk, H = (size_t)c->hidden;
    t->cap = cap;
    t->len = calloc(L, sizeof(int));
    t->keys = malloc(sizeof(float) * L * C * KV);
    t->pkeys = malloc(sizeof(float) * L * C * nkv * rk);
    t->prev_q = malloc(sizeof(float) * L * Q);
    t->has_prev = calloc(L, sizeof(int));
    t->x_prev = malloc(sizeof(float) * H);
    t->h_prev = malloc(sizeof(float) * H);
    t->qs = malloc(sizeof(float) * Q);
    t->pq = malloc(sizeof(float) * nh * rk);
    t->sc = malloc(sizeof(float) * nh * C);
    t->ex = malloc(sizeof(float) * nh * C);
    t->scratch = malloc(sizeof(float) * (nkv + 1) * C);
    t->sel = malloc(sizeof(int32_t) * nkv * C);
    t->top = malloc(sizeof(int32_t) * C);
    t->comb = malloc(sizeof(float) * C);
    t->tmp = malloc(sizeof(float) * C);
    t->mark = malloc(C);
    t->s_in = calloc(4 * L, sizeof(double));
    t->n_in = calloc(4 * L, sizeof(uint64_t));
    if (!t->len || !t->keys || !t->pkeys || !t->prev_q || !t->has_prev || !t->x_prev ||
        !t->h_prev || !t->qs || !t->pq || !t->sc || !t->ex || !t->scratch || !t->sel || !t->top ||
        !t->comb || !t->tmp || !t->mark || !t->s_in || !t->n_in)
        return -ENOMEM;
    t->s_spec = t->s_in + L, t->s_adj = t->s_in + 2 * L, t->s_rec = t->s_in + 3 * L;
    t->n_spec = t->n_in + L, t->n_adj = t->n_in + 2 * L, t->n_rec = t->n_in + 3 * L;
    return 0;
}

static void pm_free(pm_tap *t)
{
    free(t->len), free(t->keys), free(t->pkeys), free(t->prev_q), free(t->has_prev);
    free(t->x_prev), free(t->h_prev), free(t->qs), free(t->pq), free(t->sc), free(t->ex);
    free(t->scratch), free(t->sel), free(t->top), free(t->comb), free(t->tmp), free(t->mark);
    free(t->s_in), free(t->n_in);
}

/* The teacher-forced run: a prefill step, then one step per token. */
static int pm_run(rekv_engine *e, const int32_t *ids, int n, int prefill, rekv_err *err)
{
    rekv_seq *seq = NULL;
    float *logits = malloc(sizeof(float) * (size_t)e->c.vocab);
    int rc = logits ? rekv_seq_create(e, n, &seq, err) : rekv_errf(err, -ENOMEM, "out of memory");
    rekv_batch_item it = {seq, ids, prefill, 0, logits};
    if (rc == 0)
        rc = rekv_engine_forward(e, &it, 1, err);
    for (int p = prefill; rc == 0 && p + 1 < n; p++) {
        it = (rekv_batch_item){seq, ids + p, 1, 0, logits};
        rc = rekv_engine_forward(e, &it, 1, err);
    }
    rekv_seq_free(seq);
    free(logits);
    return rc;
}

int rekv_premises_measure(rekv_engine *e, const rekv_skew *sk, const int32_t *ids, int n,
                          int prefill, float alpha, float max_fraction, int lookahead,
                          rekv_premises *out, rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    memset(out, 0, sizeof(*out));
    if (n > c->max_pos || prefill < 1 || n < prefill + 2)
        return rekv_errf(err, -EINVAL, "premises: %d tokens with a prefill of %d (context %d)",
                         n, prefill, c->max_pos);
    if (sk->n_layers != c->n_layers || sk->n_kv_heads != c->n_kv_heads ||
        sk->head_dim != c->head_dim || (unsigned)lookahead > 1)
        return rekv_errf(err, -EINVAL, "premises: the skew is not this model's");
    pm_tap t = {.e = e, .sk = sk, .alpha = alpha, .max_fraction = max_fraction,
                .lookahead = lookahead};
    int rc = pm_alloc(&t, c, n);
    if (rc == 0) {
        e->tap = pm_tap_layer;
        e->tap_ctx = &t;
        rc = pm_run(e, ids, n, prefill, err);
        e->tap = NULL;
        e->tap_ctx = NULL;
        if (rc == 0 && t.fail)
            rc = rekv_errf(err, -E2BIG, "premises: more rows than the run holds");
    } else {
        rekv_errf(err, rc, "premises: out of memory");
    }
    int L = c->n_layers;
    out->n_layers = L;
    out->input_cos = rc ? NULL : malloc(sizeof(double) * 4 * (size_t)L);
    if (rc == 0 && out->input_cos == NULL)
        rc = rekv_errf(err, -ENOMEM, "premises: out of memory");
    if (rc == 0) {
        out->spec_q_cos = out->input_cos + L, out->adj_q_cos = out->input_cos + 2 * L;
        out->recall = out->input_cos + 3 * L;
        for (int i = 0; i < 4 * L; i++)
            out->input_cos[i] = t.n_in[i] ? t.s_in[i] / (double)t.n_in[i] : NAN;
        out->steps = (uint64_t)(n - 1 - prefill);
    }
    pm_free(&t);
    return rc;
}

void rekv_premises_free(rekv_premises *p)
{
    free(p->input_cos);
    memset(p, 0, sizeof(*p));
}
