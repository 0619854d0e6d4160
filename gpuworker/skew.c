/* skew.c — InfiniGen's skewing matrices (skew.h): calibration through the reference engine's tap,
 * the model fingerprint, the file, and the cache rekv_skew_prepare keeps.
 *
 * Data flow: one prefill of the calibration ids through rekv_engine_forward with the engine's tap
 * (engine_internal.h) set; the tap sees each layer's post-bias, post-RoPE q and k rows while the
 * layer runs and does that layer's work at once (the SVD of each KV head's stacked query rows, the
 * column scores, the top rk), so only one layer's rows are ever held besides the engine's own
 * scratch. The SVD runs in double (LAPACKE_dgesvd: cheap at these sizes, and A rounded to fp32 is
 * then orthogonal to a few ulps; LAPACK is loaded on first use, gpuworker/blas.h) and every sum is
 * accumulated in double.
 *
 * The file, host byte order (little-endian everywhere rekv runs), no padding:
 *   skew_header, 40 bytes: "REKVSKEW", u32 version 1, i32 n_layers, n_kv_heads, head_dim, rk,
 *     u32 CRC32C of the header (with this field 0), u64 fingerprint;
 *   float a[n_layers][n_kv_heads][head_dim][head_dim];
 *   int32_t cols[n_layers][n_kv_heads][rk];
 *   u32 CRC32C of every byte before it.
 * The header's own CRC tells a damaged header from a short file, so a truncated file is called
 * truncated and a flipped byte corrupt. The model's other shape fields (hidden, n_heads, rope) are
 * not stored apart (rekv_skew does not carry them): the fingerprint covers them. */
#define _GNU_SOURCE
#include "gpuworker/skew.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/cost.h"
#include "common/crc32c.h"
#include "common/version.h"
#include "gpuworker/blas.h"
#include "gpuworker/engine_internal.h"

#define SKEW_MAGIC "REKVSKEW"
#define SKEW_VERSION 1u
#define SKEW_SEED 0x5eedull

typedef struct skew_header {
    char magic[8];
    uint32_t version;
    int32_t n_layers, n_kv_heads, head_dim, rk;
    uint32_t header_crc; /* CRC32C of these 40 bytes with this field 0 */
    uint64_t fingerprint;
} skew_header;
_Static_assert(sizeof(skew_header) == 40, "skew_header is the file's first 40 bytes");

/* ceil(ratio * head_dim) in [1, head_dim]; the epsilon keeps 0.3 * 10 (3.0000000000000004) at 3.
 * The planner sizes the partial keys by the same rule (common/cost.h). */
static int skew_rk(double ratio, int hd)
{
    return rekv_cost_partial_cols(ratio, hd);
}

static int skew_check_ratio(double ratio, rekv_err *err)
{
    if (!(ratio > 0 && ratio <= 1))
        return rekv_errf(err, -EINVAL, "skew: ratio %g is outside (0, 1]", ratio);
    return 0;
}

/* ---------------------------------------------------------------- calibration */

/* The per-layer work the tap does, with its scratch; the first failure is kept in rc/err. */
typedef struct skew_tap {
    const rekv_model_config *c;
    const rekv_blas *blas;      /* calibrating: LAPACK's SVD */
    int rows;                   /* the calibration's token rows */
    rekv_skew *s;               /* calibrating: filled; measuring: read */
    double *skewed;             /* measuring: [n_layers] outputs; NULL when calibrating */
    double *plain;              /* measuring: [n_layers] */
    double *m;                  /* [rows * group][hd]: the group's query rows */
    double *mk;                 /* [rows][hd]: the KV head's key rows */
    double *svd_in;             /* [rows * group][hd]: dgesvd's input, destroyed by it */
    double *sv;                 /* [hd] singular values */
    double *vt;                 /* [hd][hd] V^T */
    double *superb;             /* [hd] */
    double *a;                  /* [hd][hd] the A in use, double */
    double *abs_q, *abs_k, *sq; /* [hd] column sums of |Q·A|, |K·A| and (Q·A)^2 */
    double *score;              /* [hd] */
    int32_t *cols;              /* [hd] */
    int rc;
    rekv_err err;
} skew_tap;

/* Stacks the rows of the q heads sharing KV head g into t->m and g's key rows into t->mk. */
static void tap_stack(skew_tap *t, const float *q, const float *k, int g)
{
    const rekv_model_config *c = t->c;
    int hd = c->head_dim, group = c->n_heads / c->n_kv_heads;
    size_t Q = (size_t)rekv_config_q_dim(c), KV = (size_t)rekv_config_kv_dim(c);
    double *m = t->m;
    for (int r = 0; r < t->rows; r++)
        for (int j = 0; j < group; j++)
            for (int d = 0; d < hd; d++)
                *m++ = q[(size_t)r * Q + (size_t)(g * group + j) * hd + d];
    for (int r = 0; r < t->rows; r++)
        for (int d = 0; d < hd; d++)
            t->mk[(size_t)r * hd + d] = k[(size_t)r * KV + (size_t)g * hd + d];
}

/* Column sums of |x·A| over the rows of x ([n][hd]) into abs_sum, and of (x·A)^2 into sq_sum
 * (may be NULL). */
static void tap_project(const double *x, int n, const double *a, int hd, double *abs_sum,
                        double *sq_sum)
{
    memset(abs_sum, 0, sizeof(double) * (size_t)hd);
    if (sq_sum)
        memset(sq_sum, 0, sizeof(double) * (size_t)hd);
    for (int r = 0; r < n; r++) {
        const double *row = x + (size_t)r * hd;
        for (int col = 0; col < hd; col++) {
            double v = 0;
            for (int d = 0; d < hd; d++)
                v += row[d] * a[(size_t)d * hd + col];
            abs_sum[col] += fabs(v);
            if (sq_sum)
                sq_sum[col] += v * v;
        }
    }
}

/* Every column by score, largest first, the lower index first on ties: the first rk are the
 * selection. */
static void top_cols(const double *score, int hd, int32_t *cols)
{
    for (int i = 0; i < hd; i++)
        cols[i] = i;
    for (int i = 1; i < hd; i++) { /* insertion sort: stable, so ties keep index order */
        int32_t x = cols[i];
        int j = i;
        for (; j > 0 && score[cols[j - 1]] < score[x]; j--)
            cols[j] = cols[j - 1];
        cols[j] = x;
    }
}

/* Column scores of the group under t->a: sum |Q·A| + sum |K·A|; t->sq gets sum (Q·A)^2. */
static void tap_scores(skew_tap *t, int hd, int group)
{
    tap_project(t->m, t->rows * group, t->a, hd, t->abs_q, t->sq);
    tap_project(t->mk, t->rows, t->a, hd, t->abs_k, NULL);
    for (int col = 0; col < hd; col++)
        t->score[col] = t->abs_q[col] + t->abs_k[col];
}

/* The fraction of the group's squared query norm in the given columns (t->sq after tap_scores). */
static double tap_fraction(const skew_tap *t, const int32_t *cols, int rk, int hd)
{
    double sel = 0, all = 0;
    for (int col = 0; col < hd; col++)
        all += t->sq[col];
    for (int j = 0; j < rk; j++)
        sel += t->sq[cols[j]];
    return all > 0 ? sel / all : 1.0;
}

static void tap_layer(void *ctx, int layer, const float *x, const float *h, const float *q,
                      const float *k, const float *v, int rows)
{
    (void)v;
    skew_tap *t = ctx;
    const rekv_model_config *c = t->c;
    rekv_skew *s = t->s;
    int hd = c->head_dim, G = c->n_kv_heads, group = c->n_heads / G, rk = s->rk;
    if (t->rc)
        return;
    if (rows != t->rows) {
        t->rc =
            rekv_errf(&t->err, -EINVAL, "skew: the tap saw %d rows, expected %d", rows, t->rows);
        return;
    }
    if (t->skewed)
        t->skewed[layer] = t->plain[layer] = 0;
    for (int g = 0; g < G; g++) {
        size_t ag = ((size_t)layer * G + g) * (size_t)hd * hd;
        int32_t *sel = s->cols + ((size_t)layer * G + g) * (size_t)rk;
        tap_stack(t, q, k, g);
        if (t->skewed) {
            /* measuring: the skew's A and columns, then the identity and its own columns */
            for (size_t i = 0; i < (size_t)hd * hd; i++)
                t->a[i] = s->a[ag + i];
            tap_scores(t, hd, group);
            t->skewed[layer] += tap_fraction(t, sel, rk, hd) / G;
            memset(t->a, 0, sizeof(double) * (size_t)hd * hd);
            for (int d = 0; d < hd; d++)
                t->a[(size_t)d * hd + d] = 1;
            tap_scores(t, hd, group);
            top_cols(t->score, hd, t->cols);
            t->plain[layer] += tap_fraction(t, t->cols, rk, hd) / G;
            continue;
        }
        int mrows = rows * group;
        memcpy(t->svd_in, t->m, sizeof(double) * (size_t)mrows * hd);
        lapack_int info = t->blas->dgesvd(LAPACK_ROW_MAJOR, 'N', 'A', mrows, hd, t->svd_in, hd,
                                          t->sv, NULL, 1, t->vt, hd, t->superb);
        if (info != 0) {
            t->rc = rekv_errf(&t->err, info < 0 ? -EINVAL : -EDOM,
                              "skew: the SVD of layer %d, KV head %d failed (LAPACK info %d%s)",
                              layer, g, (int)info,
                              info > 0 ? ": did not converge; non-finite activations?" : "");
            return;
        }
        /* A = V: column c is the c-th right singular vector, A[d][c] = V^T[c][d] */
        for (int d = 0; d < hd; d++)
            for (int col = 0; col < hd; col++)
                t->a[(size_t)d * hd + col] = t->vt[(size_t)col * hd + d];
        for (size_t i = 0; i < (size_t)hd * hd; i++)
            s->a[ag + i] = (float)t->a[i];
        tap_scores(t, hd, group);
        top_cols(t->score, hd, t->cols);
        memcpy(sel, t->cols, sizeof(int32_t) * (size_t)rk);
    }
}

static void tap_free(skew_tap *t)
{
    free(t->m);
    free(t->mk);
    free(t->svd_in);
    free(t->sv);
    free(t->vt);
    free(t->superb);
    free(t->a);
    free(t->abs_q);
    free(t->abs_k);
    free(t->sq);
    free(t->score);
    free(t->cols);
}

/* One prefill of ids through e with the tap t set; t->rc / t->err carry the tap's failure. */
static int tap_run(rekv_engine *e, skew_tap *t, const int32_t *ids, int n, rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    int hd = c->head_dim, group = c->n_heads / c->n_kv_heads;
    size_t mrows = (size_t)n * group, h = (size_t)hd;
    int rc = 0;
    rekv_seq *seq = NULL;
    float *logits = malloc(sizeof(float) * (size_t)c->vocab);
    t->c = c;
    t->rows = n;
    t->m = malloc(sizeof(double) * mrows * h);
    t->mk = malloc(sizeof(double) * (size_t)n * h);
    t->svd_in = t->skewed ? NULL : malloc(sizeof(double) * mrows * h);
    t->sv = malloc(sizeof(double) * h);
    t->vt = malloc(sizeof(double) * h * h);
    t->superb = malloc(sizeof(double) * h);
    t->a = malloc(sizeof(double) * h * h);
    t->abs_q = malloc(sizeof(double) * h);
    t->abs_k = malloc(sizeof(double) * h);
    t->sq = malloc(sizeof(double) * h);
    t->score = malloc(sizeof(double) * h);
    t->cols = malloc(sizeof(int32_t) * h);
    if (!logits || !t->m || !t->mk || (!t->skewed && !t->svd_in) || !t->sv || !t->vt ||
        !t->superb || !t->a || !t->abs_q || !t->abs_k || !t->sq || !t->score || !t->cols) {
        rc = rekv_errf(err, -ENOMEM, "skew: out of memory for %d calibration rows", n);
        goto out;
    }
    if ((rc = rekv_seq_create(e, n, &seq, err)))
        goto out;
    rekv_batch_item it = {seq, ids, n, 0, logits};
    e->tap = tap_layer;
    e->tap_ctx = t;
    rc = rekv_engine_forward(e, &it, 1, err);
    e->tap = NULL;
    e->tap_ctx = NULL;
    if (rc == 0 && t->rc)
        rc = rekv_errf(err, t->rc, "%s", t->err.msg);
out:
    rekv_seq_free(seq);
    free(logits);
    return rc;
}

static int skew_check_ids(const rekv_engine *e, const int32_t *ids, int n, rekv_err *err)
{
    if (ids == NULL || n < 2)
        return rekv_errf(err, -EINVAL, "skew: calibration needs at least 2 tokens, got %d",
                         ids ? n : 0);
    if (n > e->c.max_pos)
        return rekv_errf(err, -E2BIG,
                         "skew: %d calibration tokens are longer than the model's context of %d", n,
                         e->c.max_pos);
    return 0;
}

int rekv_skew_calibrate(rekv_engine *e, const int32_t *ids, int n, double ratio, rekv_skew *out,
                        rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    int rc;
    memset(out, 0, sizeof(*out));
    if ((rc = skew_check_ratio(ratio, err)) || (rc = skew_check_ids(e, ids, n, err)))
        return rc;
    const rekv_blas *blas;
    if ((rc = rekv_blas_load(&blas, err)))
        return rc;
    rekv_skew s = {c->n_layers,
                   c->n_kv_heads,
                   c->head_dim,
                   skew_rk(ratio, c->head_dim),
                   rekv_engine_fingerprint(e),
                   NULL,
                   NULL};
    size_t lg = (size_t)c->n_layers * c->n_kv_heads;
    s.a = malloc(sizeof(float) * lg * c->head_dim * c->head_dim);
    s.cols = malloc(sizeof(int32_t) * lg * s.rk);
    if (!s.a || !s.cols) {
        rekv_skew_free(&s);
        return rekv_errf(err, -ENOMEM, "skew: out of memory for the skewing matrices");
    }
    skew_tap t = {0};
    t.s = &s;
    t.blas = blas;
    rc = tap_run(e, &t, ids, n, err);
    tap_free(&t);
    if (rc) {
        rekv_skew_free(&s);
        return rc;
    }
    *out = s;
    return 0;
}

/* The skew fits e: same shape and the fingerprint of e's weights. */
static int skew_fits(const rekv_skew *s, const rekv_engine *e)
{
    return s->n_layers == e->c.n_layers && s->n_kv_heads == e->c.n_kv_heads &&
           s->head_dim == e->c.head_dim && s->fingerprint == rekv_engine_fingerprint(e);
}

int rekv_skew_concentration(rekv_engine *e, const rekv_skew *s, const int32_t *ids, int n,
                            double *skewed, double *plain, rekv_err *err)
{
    int rc;
    if ((rc = skew_check_ids(e, ids, n, err)))
        return rc;
    if (s->n_layers != e->c.n_layers || s->n_kv_heads != e->c.n_kv_heads ||
        s->head_dim != e->c.head_dim)
        return rekv_errf(err, -EINVAL, "skew: the skew's shape is not the model's");
    skew_tap t = {0};
    t.s = (rekv_skew *)s; /* read only when measuring */
    t.skewed = skewed;
    t.plain = plain;
    rc = tap_run(e, &t, ids, n, err);
    tap_free(&t);
    return rc;
}

void rekv_skew_partial(const rekv_skew *s, int layer, int g, float *dst)
{
    int hd = s->head_dim, rk = s->rk;
    const float *a = s->a + ((size_t)layer * s->n_kv_heads + g) * (size_t)hd * hd;
    const int32_t *cols = s->cols + ((size_t)layer * s->n_kv_heads + g) * (size_t)rk;
    for (int d = 0; d < hd; d++)
        for (int j = 0; j < rk; j++)
            dst[(size_t)d * rk + j] = a[(size_t)d * hd + cols[j]];
}

void rekv_skew_free(rekv_skew *s)
{
    if (s == NULL)
        return;
    free(s->a);
    free(s->cols);
    memset(s, 0, sizeof(*s));
}

/* ---------------------------------------------------------------- the file */

static size_t skew_a_elems(const rekv_skew *s)
{
    return (size_t)s->n_layers * s->n_kv_heads * s->head_dim * s->head_dim;
}

static size_t skew_cols_elems(const rekv_skew *s)
{
    return (size_t)s->n_layers * s->n_kv_heads * s->rk;
}

/* mkdir -p; 0 when the directory exists afterwards. */
static int mkdir_p(const char *dir)
{
    char b[4096];
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof(b))
        return -ENAMETOOLONG;
    memcpy(b, dir, n + 1);
    for (char *p = b + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(b, 0755) && errno != EEXIST)
                return -errno;
            *p = '/';
        }
    if (mkdir(b, 0755) && errno != EEXIST)
        return -errno;
    return 0;
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? -errno : -EIO;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

int rekv_cache_write(const char *path, const void *buf, size_t size, rekv_err *err)
{
    int rc = 0, fd = -1;
    char dir[4096], tmp[4200];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if ((rc = mkdir_p(dir))) {
            rc = rekv_errf(err, rc, "%s: cannot create the directory %s: %s", path, dir,
                           strerror(-rc));
            goto out;
        }
    }
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof(tmp)) {
        rc = rekv_errf(err, -ENAMETOOLONG, "%s: path too long", path);
        goto out;
    }
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = rekv_errf(err, -errno, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    if ((rc = write_all(fd, buf, size)) || (fsync(fd) && (rc = -errno))) {
        rc = rekv_errf(err, rc, "%s: write failed: %s", tmp, strerror(-rc));
        goto out_unlink;
    }
    if (close(fd)) {
        fd = -1;
        rc = rekv_errf(err, -errno, "%s: close failed: %s", tmp, strerror(errno));
        goto out_unlink;
    }
    fd = -1;
    if (rename(tmp, path)) {
        rc = rekv_errf(err, -errno, "%s: cannot rename %s into place: %s", path, tmp,
                       strerror(errno));
        goto out_unlink;
    }
    if (slash) { /* make the rename durable; a directory that cannot be synced is no failure */
        int dfd = open(slash == dir ? "/" : dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            (void)fsync(dfd);
            close(dfd);
        }
    }
    goto out;
out_unlink:
    if (fd >= 0)
        close(fd);
    unlink(tmp);
out:
    return rc;
}

int rekv_skew_save(const rekv_skew *s, const char *path, rekv_err *err)
{
    size_t na = skew_a_elems(s), nc = skew_cols_elems(s);
    size_t size = sizeof(skew_header) + na * sizeof(float) + nc * sizeof(int32_t) + 4;
    char *buf = malloc(size);
    if (buf == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory for %zu bytes", path, size);
    skew_header h = {0};
    memcpy(h.magic, SKEW_MAGIC, 8);
    h.version = SKEW_VERSION;
    h.n_layers = s->n_layers;
    h.n_kv_heads = s->n_kv_heads;
    h.head_dim = s->head_dim;
    h.rk = s->rk;
    h.fingerprint = s->fingerprint;
    h.header_crc = rekv_crc32c(0, &h, sizeof(h));
    char *p = buf;
    memcpy(p, &h, sizeof(h));
    p += sizeof(h);
    memcpy(p, s->a, na * sizeof(float));
    p += na * sizeof(float);
    memcpy(p, s->cols, nc * sizeof(int32_t));
    p += nc * sizeof(int32_t);
    uint32_t crc = rekv_crc32c(0, buf, size - 4);
    memcpy(p, &crc, 4);

    int rc = rekv_cache_write(path, buf, size, err);
    free(buf);
    return rc;
}

/* Reads the whole file into *buf; its size in *n. */
static int read_file(const char *path, char **buf, size_t *n, rekv_err *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
    struct stat st;
    int rc = 0;
    char *b = NULL;
    if (fstat(fd, &st)) {
        rc = rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        rc = rekv_errf(err, -EINVAL, "%s: not a regular file", path);
        goto out;
    }
    size_t size = (size_t)st.st_size, got = 0;
    if ((b = malloc(size ? size : 1)) == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory for %zu bytes", path, size);
        goto out;
    }
    while (got < size) {
        ssize_t r = read(fd, b + got, size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = rekv_errf(err, -errno, "%s: read failed: %s", path, strerror(errno));
            goto out;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    *buf = b;
    *n = got;
    b = NULL;
out:
    free(b);
    close(fd);
    return rc;
}

int rekv_skew_load(const char *path, const rekv_engine *e, rekv_skew *out, rekv_err *err)
{
    memset(out, 0, sizeof(*out));
    char *buf = NULL;
    size_t size = 0;
    int rc = read_file(path, &buf, &size, err);
    if (rc)
        return rc;
    skew_header h;
    rekv_skew s = {0};
    if (size < sizeof(h)) {
        rc = rekv_errf(err, -EINVAL, "%s: truncated skew file (%zu bytes, the header alone is %zu)",
                       path, size, sizeof(h));
        goto fail;
    }
    memcpy(&h, buf, sizeof(h));
    if (memcmp(h.magic, SKEW_MAGIC, 8) != 0) {
        rc = rekv_errf(err, -EINVAL, "%s: not a rekv skew file (bad magic)", path);
        goto fail;
    }
    if (h.version != SKEW_VERSION) {
        rc = rekv_errf(err, -EINVAL, "%s: skew file version %u, this rekv reads version %u", path,
                       h.version, SKEW_VERSION);
        goto fail;
    }
    uint32_t hcrc = h.header_crc;
    h.header_crc = 0;
    if (rekv_crc32c(0, &h, sizeof(h)) != hcrc) {
        rc = rekv_errf(err, -EINVAL, "%s: corrupt skew file (header CRC mismatch)", path);
        goto fail;
    }
    s.n_layers = h.n_layers;
    s.n_kv_heads = h.n_kv_heads;
    s.head_dim = h.head_dim;
    s.rk = h.rk;
    s.fingerprint = h.fingerprint;
    if (!(h.n_layers > 0 && h.n_layers <= 4096 && h.n_kv_heads > 0 && h.n_kv_heads <= 4096 &&
          h.head_dim > 0 && h.head_dim <= 4096 && h.rk > 0 && h.rk <= h.head_dim)) {
        rc =
            rekv_errf(err, -EINVAL, "%s: corrupt skew file (impossible shape in the header)", path);
        goto fail;
    }
    size_t want =
        sizeof(h) + skew_a_elems(&s) * sizeof(float) + skew_cols_elems(&s) * sizeof(int32_t) + 4;
    if (size < want) {
        rc = rekv_errf(err, -EINVAL, "%s: truncated skew file (%zu bytes, its header says %zu)",
                       path, size, want);
        goto fail;
    }
    if (size > want) {
        rc = rekv_errf(err, -EINVAL, "%s: corrupt skew file (%zu bytes after its end)", path,
                       size - want);
        goto fail;
    }
    uint32_t crc_file;
    memcpy(&crc_file, buf + size - 4, 4);
    if (rekv_crc32c(0, buf, size - 4) != crc_file) {
        rc = rekv_errf(err, -EINVAL, "%s: corrupt skew file (CRC mismatch)", path);
        goto fail;
    }
    if (s.n_layers != e->c.n_layers || s.n_kv_heads != e->c.n_kv_heads ||
        s.head_dim != e->c.head_dim || s.fingerprint != rekv_engine_fingerprint(e)) {
        rc = rekv_errf(err, -EINVAL,
                       "%s: skew made for another model (%d layers, %d KV heads of %d, fingerprint "
                       "%016llx; this model: %d, %d of %d, %016llx)",
                       path, s.n_layers, s.n_kv_heads, s.head_dim,
                       (unsigned long long)s.fingerprint, e->c.n_layers, e->c.n_kv_heads,
                       e->c.head_dim, (unsigned long long)rekv_engine_fingerprint(e));
        goto fail;
    }
    size_t na = skew_a_elems(&s), nc = skew_cols_elems(&s);
    s.a = malloc(sizeof(float) * na);
    s.cols = malloc(sizeof(int32_t) * nc);
    if (!s.a || !s.cols) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    memcpy(s.a, buf + sizeof(h), sizeof(float) * na);
    memcpy(s.cols, buf + sizeof(h) + sizeof(float) * na, sizeof(int32_t) * nc);
    for (size_t i = 0; i < nc; i++) {
        size_t first = i - i % (size_t)s.rk;
        int bad = s.cols[i] < 0 || s.cols[i] >= s.head_dim;
        for (size_t j = first; j < i && !bad; j++)
            bad = s.cols[j] == s.cols[i];
        if (bad) {
            rc = rekv_errf(err, -EINVAL,
                           "%s: column %d of layer %zu, KV head %zu is out of range or repeated",
                           path, s.cols[i], i / ((size_t)s.rk * s.n_kv_heads),
                           i / (size_t)s.rk % (size_t)s.n_kv_heads);
            goto fail;
        }
    }
    free(buf);
    *out = s;
    return 0;
fail:
    free(buf);
    rekv_skew_free(&s);
    return rc;
}

/* ---------------------------------------------------------------- the cache */

int rekv_cache_dir(char *dir, size_t cap, rekv_err *err)
{
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (xdg && *xdg == '/')
        n = snprintf(dir, cap, "%s/rekv", xdg);
    else if (home && *home)
        n = snprintf(dir, cap, "%s/.cache/rekv", home);
    else
        return rekv_errf(err, -ENOENT, "cache: neither XDG_CACHE_HOME nor HOME is set");
    if (n < 0 || (size_t)n >= cap)
        return rekv_errf(err, -ENAMETOOLONG, "cache: directory name too long");
    return 0;
}

uint32_t rekv_cache_build_tag(void)
{
    const char *v = rekv_version();
    return rekv_crc32c(0, v, strlen(v));
}

int rekv_skew_cache_path(const rekv_engine *e, double ratio, char *path, size_t cap, rekv_err *err)
{
    int rc;
    if ((rc = skew_check_ratio(ratio, err)))
        return rc;
    char dir[4096];
    if ((rc = rekv_cache_dir(dir, sizeof(dir), err)))
        return rc;
    int n = snprintf(path, cap, "%s/skew-%016llx-r%ld-%08x.bin", dir,
                     (unsigned long long)rekv_engine_fingerprint(e), lround(ratio * 1000),
                     rekv_cache_build_tag());
    if (n < 0 || (size_t)n >= cap)
        return rekv_errf(err, -ENAMETOOLONG, "skew: cache path too long under %s", dir);
    return 0;
}

int rekv_skew_sample(rekv_engine *e, int32_t **ids, int *n, rekv_err *err)
{
    const rekv_model_config *c = &e->c;
    if (c->max_pos < 2)
        return rekv_errf(err, -EINVAL, "skew: a context of %d tokens is too short to calibrate",
                         c->max_pos);
    /* llama2.c's BOS is 1; a model that names none starts from 1 as well (0 if the vocabulary
     * has no 1), which is only a start for the sample, not a claim about the tokenizer */
    int32_t bos = c->bos_id >= 0 ? c->bos_id : c->vocab > 1 ? 1 : 0;
    int max_new =
        REKV_SKEW_SAMPLE_TOKENS < c->max_pos - 1 ? REKV_SKEW_SAMPLE_TOKENS : c->max_pos - 1;
    rekv_gen_params gp = {max_new, 1.0f, 0, 1.0f, SKEW_SEED, 0, 0, 0, 0};
    rekv_gen_result r;
    int rc = rekv_generate(e, &bos, 1, &gp, &r, err);
    if (rc)
        return rc;
    int32_t *v = malloc(sizeof(int32_t) * (size_t)(r.n + 1));
    if (v == NULL) {
        rekv_gen_result_free(&r);
        return rekv_errf(err, -ENOMEM, "skew: out of memory");
    }
    v[0] = bos;
    memcpy(v + 1, r.ids, sizeof(int32_t) * (size_t)r.n);
    *ids = v;
    *n = r.n + 1;
    rekv_gen_result_free(&r);
    return 0;
}

int rekv_skew_prepare(rekv_engine *e, double ratio, rekv_skew *out, int *from_cache, rekv_err *err)
{
    char path[4300];
    rekv_err cerr = {0};
    int rc, cached = 0;
    *from_cache = 0;
    memset(out, 0, sizeof(*out));
    if ((rc = skew_check_ratio(ratio, err)))
        return rc;
    /* no cache directory (no HOME) only means calibrating every time */
    int have_path = rekv_skew_cache_path(e, ratio, path, sizeof(path), &cerr) == 0;
    if (have_path && rekv_skew_load(path, e, out, &cerr) == 0) {
        if (out->rk == skew_rk(ratio, e->c.head_dim) && skew_fits(out, e))
            cached = 1;
        else
            rekv_skew_free(out);
    }
    if (cached) {
        *from_cache = 1;
        return 0;
    }
    int32_t *ids = NULL;
    int n = 0;
    if ((rc = rekv_skew_sample(e, &ids, &n, err)))
        return rc;
    rc = rekv_skew_calibrate(e, ids, n, ratio, out, err);
    free(ids);
    if (rc)
        return rc;
    if (have_path) {
        rekv_err_clear(&cerr);
        (void)rekv_skew_save(out, path, &cerr); /* a cache that cannot be written is no error */
    }
    return 0;
}
