/* heads.c — CLO's head profile (heads.h): adjacent-query cosine and streaming-loss importance per
 * (layer, query head) from the reference engine's calibration tap, Eq. 7–11, and the JSON file. */
#include "gpuworker/heads.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/engine_internal.h"
#include "gpuworker/skew.h"

#define HEADS_VERSION 1

typedef struct heads_tap {
    const rekv_model_config *c;
    int rows;
    double *err_sum, *norm_sum; /* [n_layers][n_heads]: streaming error and output energy */
    double *cos_sum;            /* [n_layers][n_heads] */
    double *p_full, *p_str;     /* [rows]: one row's softmax, full and streaming */
} heads_tap;

static double dot(const float *a, const float *b, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += (double)a[i] * b[i];
    return s;
}

/* pr[0..p] = softmax over t <= p of pr[t] in place; -INFINITY entries (left out) get 0 */
static void row_softmax(int p, double *pr)
{
    double mx = -INFINITY, sum = 0;
    for (int t = 0; t <= p; t++)
        mx = pr[t] > mx ? pr[t] : mx;
    for (int t = 0; t <= p; t++)
        sum += pr[t] = pr[t] == -INFINITY ? 0 : exp(pr[t] - mx);
    for (int t = 0; t <= p; t++)
        pr[t] /= sum;
}

static void tap_layer(void *ctx, int layer, const float *x_in, const float *h_in, const float *q,
                      const float *k, const float *v, int rows)
{
    heads_tap *t = ctx;
    const rekv_model_config *c = t->c;
    int hd = c->head_dim, H = c->n_heads, group = H / c->n_kv_heads;
    size_t Q = (size_t)rekv_config_q_dim(c), KV = (size_t)rekv_config_kv_dim(c);
    for (int h = 0; h < H; h++) {
        size_t i = (size_t)layer * H + (size_t)h;
        const float *kh = k + (size_t)(h / group) * hd, *vh = v + (size_t)(h / group) * hd;
        for (int p = REKV_HEADS_FROM; p < rows; p++) {
            const float *qp = q + (size_t)p * Q + (size_t)h * hd, *q0 = qp - Q;
            if (p > REKV_HEADS_FROM) { /* adjacent decode queries: both at FROM or later */
                double n0 = dot(q0, q0, hd), n1 = dot(qp, qp, hd);
                t->cos_sum[i] += n0 > 0 && n1 > 0 ? dot(q0, qp, hd) / sqrt(n0 * n1) : 0;
            }
            if (p + 1 <= REKV_HEADS_SINK + REKV_HEADS_RECENT)
                continue; /* streaming sees everything: no loss */
            /* the row's scores once; streaming keeps the sink and the recent window of them */
            double scale = 1.0 / sqrt((double)hd);
            for (int s = 0; s <= p; s++) {
                t->p_full[s] = dot(qp, kh + (size_t)s * KV, hd) * scale;
                int keep = s < REKV_HEADS_SINK || s > p - REKV_HEADS_RECENT;
                t->p_str[s] = keep ? t->p_full[s] : -INFINITY;
            }
            row_softmax(p, t->p_full);
            row_softmax(p, t->p_str);
            for (int d = 0; d < hd; d++) {
                double of = 0, os = 0;
                for (int s = 0; s <= p; s++) {
                    double x = vh[(size_t)s * KV + (size_t)d];
                    of += t->p_full[s] * x;
                    os += t->p_str[s] * x;
                }
                t->err_sum[i] += (of - os) * (of - os);
                t->norm_sum[i] += of * of;
            }
        }
    }
}

int rekv_heads_profile(rekv_engine *e, const int32_t *ids, int n, rekv_heads *out, rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    memset(out, 0, sizeof(*out));
    if (n < 2)
        return rekv_errf(err, -EINVAL, "heads: a profile needs at least 2 tokens, got %d", n);
    if (n > c->max_pos)
        return rekv_errf(err, -E2BIG, "heads: %d tokens exceed the model's context of %d", n,
                         c->max_pos);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab)
            return rekv_errf(err, -EINVAL, "heads: token %d at %d is outside the vocabulary (%d)",
                             ids[i], i, c->vocab);
    size_t nh = (size_t)c->n_layers * (size_t)c->n_heads;
    heads_tap t = {c,
                   n,
                   calloc(nh, sizeof(double)),
                   calloc(nh, sizeof(double)),
                   calloc(nh, sizeof(double)),
                   malloc(sizeof(double) * (size_t)n),
                   malloc(sizeof(double) * (size_t)n)};
    float *logits = malloc(sizeof(float) * (size_t)c->vocab);
    out->importance = calloc(nh, sizeof(double));
    out->adjacent_cos = calloc(nh, sizeof(double));
    rekv_seq *seq = NULL;
    int rc = 0;
    if (!t.err_sum || !t.norm_sum || !t.cos_sum || !t.p_full || !t.p_str || !logits ||
        !out->importance || !out->adjacent_cos) {
        rc = rekv_errf(err, -ENOMEM, "heads: out of memory for %d calibration rows", n);
        goto out;
    }
    if ((rc = rekv_seq_create(e, n, &seq, err)))
        goto out;
    rekv_batch_item it = {seq, ids, n, 0, logits};
    e->tap = tap_layer;
    e->tap_ctx = &t;
    rc = rekv_engine_forward(e, &it, 1, err);
    e->tap = NULL;
    e->tap_ctx = NULL;
    if (rc)
        goto out;
    out->n_layers = c->n_layers;
    out->n_heads = c->n_heads;
    out->n_kv_heads = c->n_kv_heads;
    out->fingerprint = rekv_engine_fingerprint(e);
    out->sample_tokens = n;
    double mx = 0;
    int pairs = n > REKV_HEADS_FROM + 1 ? n - REKV_HEADS_FROM - 1 : 0;
    for (size_t i = 0; i < nh; i++) {
        double r = t.norm_sum[i] > 0 ? t.err_sum[i] / t.norm_sum[i] : 0;
        out->importance[i] = r;
        mx = r > mx ? r : mx;
        out->adjacent_cos[i] = pairs ? t.cos_sum[i] / pairs : 0;
    }
    for (size_t i = 0; i < nh; i++)
        out->importance[i] = mx > 0 ? out->importance[i] / mx : 0;
out:
    rekv_seq_free(seq);
    free(logits);
    free(t.err_sum);
    free(t.norm_sum);
    free(t.cos_sum);
    free(t.p_full);
    free(t.p_str);
    if (rc)
        rekv_heads_free(out);
    return rc;
}

void rekv_heads_free(rekv_heads *h)
{
    if (h == NULL)
        return;
    free(h->importance);
    free(h->adjacent_cos);
    memset(h, 0, sizeof(*h));
}

/* ---------------------------------------------------------------- Eq. 7–11 */

double rekv_heads_tau(double importance, double eta, double p)
{
    double lambda = pow(importance < 0 ? 0 : importance > 1 ? 1 : importance, p);
    double theta = lambda * acos(eta) + (1 - lambda) * M_PI;
    return cos(theta);
}

double rekv_heads_aggregate(const double *importance, const double *sim, int m)
{
    double num = 0, den = 0, w_all = 0;
    for (int j = 0; j < m; j++)
        w_all += importance[j];
    for (int j = 0; j < m; j++) {
        double w = w_all > 0 ? importance[j] : 1;
        if (w == 0)
            continue;
        if (!(sim[j] > 0))
            return -1;
        num += w;
        den += w / sim[j];
    }
    return den > 0 ? num / den : -1;
}

double rekv_heads_difficulty(const rekv_heads *h, int layer, int g, double eta, double p,
                             double epsilon)
{
    int group = h->n_heads / h->n_kv_heads;
    const double *imp = h->importance + (size_t)layer * h->n_heads + (size_t)g * group;
    const double *cs = h->adjacent_cos + (size_t)layer * h->n_heads + (size_t)g * group;
    double top = 0;
    for (int j = 0; j < group; j++)
        top = imp[j] > top ? imp[j] : top;
    return rekv_heads_tau(top, eta, p) - (rekv_heads_aggregate(imp, cs, group) - epsilon);
}

int rekv_heads_persistent(const rekv_heads *h, int layer, double eta, double p, double epsilon,
                          double n_p, uint8_t *persist)
{
    int nkv = h->n_kv_heads, n_d = 0;
    double d[nkv > 0 ? nkv : 1];
    for (int g = 0; g < nkv; g++) {
        d[g] = rekv_heads_difficulty(h, layer, g, eta, p, epsilon);
        n_d += d[g] > 0;
        persist[g] = 0;
    }
    double want = (double)n_d - n_p;
    int n = want > 0 ? (int)ceil(want) : 0;
    for (int k = 0; k < n; k++) { /* the hardest first; ties: the lower head */
        int best = -1;
        for (int g = 0; g < nkv; g++)
            if (!persist[g] && d[g] > 0 && (best < 0 || d[g] > d[best]))
                best = g;
        persist[best] = 1;
    }
    return n;
}

/* ---------------------------------------------------------------- the file */

static json_t *matrix(const double *v, int rows, int cols)
{
    json_t *a = json_array();
    for (int r = 0; r < rows; r++) {
        json_t *row = json_array();
        for (int j = 0; j < cols; j++)
            json_array_append_new(row, json_real(v[(size_t)r * cols + j]));
        json_array_append_new(a, row);
    }
    return a;
}

int rekv_heads_save(const rekv_heads *h, const char *path, rekv_err *err)
{
    char fp[17];
    snprintf(fp, sizeof(fp), "%016llx", (unsigned long long)h->fingerprint);
    json_t *o = json_pack(
        "{s:i, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:o, s:o}", "version", HEADS_VERSION,
        "fingerprint", fp, "layers", h->n_layers, "heads", h->n_heads, "kv_heads", h->n_kv_heads,
        "sample_tokens", h->sample_tokens, "from", REKV_HEADS_FROM, "sink", REKV_HEADS_SINK,
        "recent", REKV_HEADS_RECENT, "importance", matrix(h->importance, h->n_layers, h->n_heads),
        "adjacent_cos", matrix(h->adjacent_cos, h->n_layers, h->n_heads));
    char *s = o ? json_dumps(o, JSON_INDENT(1) | JSON_REAL_PRECISION(9)) : NULL;
    json_decref(o);
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    int rc = rekv_cache_write(path, s, strlen(s), err);
    free(s);
    return rc;
}

static int read_matrix(json_t *a, int rows, int cols, double *out)
{
    if (!json_is_array(a) || (int)json_array_size(a) != rows)
        return -1;
    for (int r = 0; r < rows; r++) {
        json_t *row = json_array_get(a, (size_t)r);
        if (!json_is_array(row) || (int)json_array_size(row) != cols)
            return -1;
        for (int j = 0; j < cols; j++) {
            json_t *x = json_array_get(row, (size_t)j);
            if (!json_is_number(x) || !isfinite(json_number_value(x)))
                return -1;
            out[(size_t)r * cols + j] = json_number_value(x);
        }
    }
    return 0;
}

int rekv_heads_load(const char *path, const rekv_engine *e, rekv_heads *out, rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    memset(out, 0, sizeof(*out));
    json_error_t je;
    json_t *o = json_load_file(path, 0, &je);
    if (o == NULL)
        return rekv_errf(err, -EINVAL, "%s: not a head profile: %s (line %d)", path, je.text,
                         je.line);
    int rc = 0, version = 0, sample = 0;
    const char *fp = NULL;
    json_t *imp = NULL, *cs = NULL;
    if (json_unpack(o, "{s:i, s:s, s:i, s:i, s:i, s:i, s:o, s:o}", "version", &version,
                    "fingerprint", &fp, "layers", &out->n_layers, "heads", &out->n_heads,
                    "kv_heads", &out->n_kv_heads, "sample_tokens", &sample, "importance", &imp,
                    "adjacent_cos", &cs) != 0 ||
        version != HEADS_VERSION) {
        rc = rekv_errf(err, -EINVAL, "%s: not a version %d head profile", path, HEADS_VERSION);
        goto out;
    }
    if (out->n_layers != c->n_layers || out->n_heads != c->n_heads ||
        out->n_kv_heads != c->n_kv_heads) {
        rc = rekv_errf(err, -EINVAL,
                       "%s: a profile of %d layers x %d heads (%d KV), the model has %d x %d (%d)",
                       path, out->n_layers, out->n_heads, out->n_kv_heads, c->n_layers, c->n_heads,
                       c->n_kv_heads);
        goto out;
    }
    char want[17];
    snprintf(want, sizeof(want), "%016llx", (unsigned long long)rekv_engine_fingerprint(e));
    if (strcmp(fp, want) != 0) {
        rc = rekv_errf(err, -EINVAL, "%s: made for another model (fingerprint %s, this one %s)",
                       path, fp, want);
        goto out;
    }
    out->fingerprint = strtoull(fp, NULL, 16);
    out->sample_tokens = sample;
    size_t nh = (size_t)c->n_layers * (size_t)c->n_heads;
    out->importance = malloc(sizeof(double) * nh);
    out->adjacent_cos = malloc(sizeof(double) * nh);
    if (!out->importance || !out->adjacent_cos) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    if (read_matrix(imp, c->n_layers, c->n_heads, out->importance) ||
        read_matrix(cs, c->n_layers, c->n_heads, out->adjacent_cos)) {
        rc = rekv_errf(err, -EINVAL, "%s: importance and adjacent_cos must be %d x %d numbers",
                       path, c->n_layers, c->n_heads);
        goto out;
    }
    for (size_t i = 0; i < nh; i++)
        if (out->importance[i] < 0 || out->importance[i] > 1 || out->adjacent_cos[i] < -1 ||
            out->adjacent_cos[i] > 1) {
            rc = rekv_errf(err, -EINVAL, "%s: a value outside its range ([0,1], [-1,1])", path);
            goto out;
        }
out:
    json_decref(o);
    if (rc)
        rekv_heads_free(out);
    return rc;
}

int rekv_heads_cache_path(const rekv_engine *e, char *path, size_t cap, rekv_err *err)
{
    char dir[4096];
    int rc = rekv_cache_dir(dir, sizeof(dir), err);
    if (rc)
        return rc;
    int n = snprintf(path, cap, "%s/heads-%016llx-%08x.json", dir,
                     (unsigned long long)rekv_engine_fingerprint(e), rekv_cache_build_tag());
    if (n < 0 || (size_t)n >= cap)
        return rekv_errf(err, -ENAMETOOLONG, "heads: cache path too long under %s", dir);
    return 0;
}

int rekv_heads_prepare(rekv_engine *e, rekv_heads *out, int *from_cache, rekv_err *err)
{
    char path[4300];
    rekv_err cerr = {0};
    *from_cache = 0;
    int have_path = rekv_heads_cache_path(e, path, sizeof(path), &cerr) == 0;
    if (have_path && rekv_heads_load(path, e, out, &cerr) == 0) {
        *from_cache = 1;
        return 0;
    }
    int32_t *ids = NULL;
    int n = 0, rc = rekv_skew_sample(e, &ids, &n, err);
    if (rc)
        return rc;
    rc = rekv_heads_profile(e, ids, n, out, err);
    free(ids);
    if (rc == 0 && have_path) {
        rekv_err_clear(&cerr);
        (void)rekv_heads_save(out, path, &cerr); /* a cache that cannot be written is no error */
    }
    return rc;
}
