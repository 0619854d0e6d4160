/* test_cpu_ops.c — the cpu backend's kernels: the row-invariant GEMM gives the same bits for a row
 * whatever rows share the call, on either code path and at any thread count, and agrees with
 * OpenBLAS; dtype conversions round correctly. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "gpuworker/blas.h"
#include "gpuworker/cpu_ops.h"
#include "tests/testutil.h"

static uint64_t g_rng = 88172645463325252ull;
static float frand(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) / 16777216.0) - 0.5f;
}
static int irand(int n)
{
    return (int)((unsigned)((frand() + 0.5f) * 16777216.0f) % (unsigned)n);
}

START_TEST(gemm_rowinv_is_row_invariant)
{
    const rekv_blas *blas;
    rekv_err err = {0};
    ck_assert_msg(rekv_blas_load(&blas, &err) == 0, "%s", err.msg);
    for (int trial = 0; trial < 120; trial++) {
        int m = 1 + irand(150), n = 1 + irand(300), k = 1 + irand(700);
        float *x = malloc(sizeof(float) * (size_t)m * k),
              *w = malloc(sizeof(float) * (size_t)n * k);
        float *b = malloc(sizeof(float) * (size_t)n);
        float *y = malloc(sizeof(float) * (size_t)m * n),
              *y1 = malloc(sizeof(float) * (size_t)m * n);
        float *yp = malloc(sizeof(float) * (size_t)m * n),
              *yb = malloc(sizeof(float) * (size_t)m * n);
        for (size_t i = 0; i < (size_t)m * k; i++)
            x[i] = frand();
        for (size_t i = 0; i < (size_t)n * k; i++)
            w[i] = frand();
        for (int i = 0; i < n; i++)
            b[i] = frand();
        cpu_gemm_rowinv(y, x, w, REKV_DTYPE_F32, b, m, n, k);
        /* the same rows in random chunks, including single rows */
        for (int r0 = 0; r0 < m;) {
            int c = 1 + irand(9);
            if (r0 + c > m)
                c = m - r0;
            cpu_gemm_rowinv(y1, x + (size_t)r0 * k, w, REKV_DTYPE_F32, b, c, n, k);
            ck_assert_msg(memcmp(y1, y + (size_t)r0 * n, sizeof(float) * (size_t)c * n) == 0,
                          "m=%d n=%d k=%d: rows %d..%d differ when computed apart", m, n, k, r0,
                          r0 + c - 1);
            r0 += c;
        }
        /* the portable path gives the same bits */
        cpu_gemm_rowinv_portable(yp, x, w, REKV_DTYPE_F32, m, n, k);
        for (size_t i = 0; i < (size_t)m * n; i++)
            yp[i] += b[i % (size_t)n];
        ck_assert_msg(memcmp(yp, y, sizeof(float) * (size_t)m * n) == 0,
                      "m=%d n=%d k=%d: portable and vector paths differ", m, n, k);
        /* and it computes the product: close to OpenBLAS */
        blas->sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x, k, w, k, 0.0f, yb,
                    n);
        for (size_t i = 0; i < (size_t)m * n; i++)
            yb[i] += b[i % (size_t)n];
        for (size_t i = 0; i < (size_t)m * n; i++)
            ck_assert_msg(fabsf(yb[i] - y[i]) <= 1e-5f * (1.0f + sqrtf((float)k)),
                          "m=%d n=%d k=%d: %g vs OpenBLAS %g", m, n, k, y[i], yb[i]);
        free(x), free(w), free(b), free(y), free(y1), free(yp), free(yb);
    }
}
END_TEST

/* 16-bit weights give the bits of their fp32 widening, over shapes that cross the widening
 * panels, the two-thread split and the no-AVX tail, with and without bias. */
START_TEST(gemm_rowinv_16bit_weights_equal_widened)
{
    static const rekv_dtype dts[] = {REKV_DTYPE_F16, REKV_DTYPE_BF16};
    for (int trial = 0; trial < 60; trial++) {
        rekv_dtype dt = dts[trial % 2];
        int m = 1 + irand(40), n = 1 + irand(trial < 50 ? 300 : 1200),
            k = 1 + irand(trial < 50 ? 700 : 3000);
        size_t nk = (size_t)n * k;
        float *x = malloc(sizeof(float) * (size_t)m * k), *w = malloc(sizeof(float) * nk);
        uint16_t *wh = malloc(sizeof(uint16_t) * nk);
        float *b = malloc(sizeof(float) * (size_t)n);
        float *y = malloc(sizeof(float) * (size_t)m * n),
              *yw = malloc(sizeof(float) * (size_t)m * n),
              *yp = malloc(sizeof(float) * (size_t)m * n);
        for (size_t i = 0; i < (size_t)m * k; i++)
            x[i] = frand();
        for (size_t i = 0; i < nk; i++)
            w[i] = frand();
        rekv_from_f32(wh, w, dt, nk);
        rekv_to_f32(w, wh, dt, nk); /* the widening of the 16-bit weights */
        for (int i = 0; i < n; i++)
            b[i] = frand();
        const float *bias = trial % 3 ? b : NULL;
        cpu_gemm_rowinv(y, x, wh, dt, bias, m, n, k);
        cpu_gemm_rowinv(yw, x, w, REKV_DTYPE_F32, bias, m, n, k);
        ck_assert_msg(memcmp(y, yw, sizeof(float) * (size_t)m * n) == 0,
                      "%s weights m=%d n=%d k=%d: differ from their fp32 widening",
                      rekv_dtype_name(dt), m, n, k);
        /* and the portable path widens them the same way */
        cpu_gemm_rowinv_portable(yp, x, wh, dt, m, n, k);
        for (size_t i = 0; bias && i < (size_t)m * n; i++)
            yp[i] += bias[i % (size_t)n];
        ck_assert_msg(memcmp(y, yp, sizeof(float) * (size_t)m * n) == 0,
                      "%s weights m=%d n=%d k=%d: the portable path differs", rekv_dtype_name(dt),
                      m, n, k);
        free(x), free(w), free(wh), free(b), free(y), free(yw), free(yp);
    }
}
END_TEST

static float *frands(size_t n)
{
    float *a = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++)
        a[i] = frand();
    return a;
}

/* Every row count from 1 to 70 — whole 4-row tiles and the 1-, 2- and 3-row kernels after them —
 * at odd k (k < 8, k % 8 != 0) and n off every tile width, then at a size the worker pool takes:
 * each row's bits are its own one-row call's and the portable path's, and chunks of rows agree. */
START_TEST(gemm_rowinv_rows_1_to_70)
{
    static const int ks[] = {1, 3, 7, 8, 9, 17, 100, 263, 300};
    static const int ns[] = {1, 2, 5, 7, 13, 50, 97, 200};
    for (int pass = 0; pass < 2; pass++)
        for (int m = 1; m <= 70; m++) {
            int k = pass ? 300 : ks[m % 8], n = pass ? 200 : ns[m % 7];
            float *x = frands((size_t)m * k), *w = frands((size_t)n * k);
            float *y = malloc(sizeof(float) * (size_t)m * n),
                  *y1 = malloc(sizeof(float) * (size_t)m * n),
                  *yp = malloc(sizeof(float) * (size_t)m * n);
            cpu_gemm_rowinv(y, x, w, REKV_DTYPE_F32, NULL, m, n, k);
            cpu_gemm_rowinv_portable(yp, x, w, REKV_DTYPE_F32, m, n, k);
            ck_assert_msg(memcmp(y, yp, sizeof(float) * (size_t)m * n) == 0,
                          "m=%d n=%d k=%d: portable and vector paths differ", m, n, k);
            for (int r = 0; r < m; r++) {
                cpu_gemm_rowinv(y1, x + (size_t)r * k, w, REKV_DTYPE_F32, NULL, 1, n, k);
                ck_assert_msg(memcmp(y1, y + (size_t)r * n, sizeof(float) * (size_t)n) == 0,
                              "m=%d n=%d k=%d: row %d differs alone", m, n, k, r);
            }
            for (int r0 = 0, c = 1 + m % 5; r0 < m; r0 += c, c = c % 6 + 1) {
                int rows = r0 + c > m ? m - r0 : c;
                cpu_gemm_rowinv(y1, x + (size_t)r0 * k, w, REKV_DTYPE_F32, NULL, rows, n, k);
                ck_assert_msg(memcmp(y1, y + (size_t)r0 * n, sizeof(float) * (size_t)rows * n) == 0,
                              "m=%d n=%d k=%d: rows %d..%d differ in a chunk", m, n, k, r0,
                              r0 + rows - 1);
            }
            free(x), free(w), free(y), free(y1), free(yp);
        }
}
END_TEST

typedef struct gemm_caller {
    const float *x;
    const void *w;
    rekv_dtype wt;
    int m, n, k;
    float *y;
} gemm_caller;

static void *gemm_caller_run(void *arg)
{
    gemm_caller *c = arg;
    for (int i = 0; i < 20; i++)
        cpu_gemm_rowinv(c->y, c->x, c->w, c->wt, NULL, c->m, c->n, c->k);
    return NULL;
}

/* The thread count never changes a bit: one thread against two and three (until the pool's
 * workers have computed some of the columns), in every weight dtype, and callers on several
 * threads at once (the cpu backend's streams) get the same bits too. */
START_TEST(gemm_rowinv_threads_same_bits)
{
    static const int shapes[][3] = {{1, 768, 768},  {2, 1000, 257}, {3, 333, 300},
                                    {37, 500, 130}, {64, 200, 129}, {1, 100, 701}};
    static const rekv_dtype dts[] = {REKV_DTYPE_F32, REKV_DTYPE_F16, REKV_DTYPE_BF16};
    unsigned long chunks0 = cpu_gemm_pool_chunks();
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        for (int d = 0; d < 3; d++) {
            int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
            size_t nk = (size_t)n * k, mn = (size_t)m * n;
            float *x = frands((size_t)m * k), *w = frands(nk);
            uint16_t *wh = malloc(sizeof(uint16_t) * nk);
            const void *wd = w;
            if (dts[d] != REKV_DTYPE_F32) {
                rekv_from_f32(wh, w, dts[d], nk);
                wd = wh;
            }
            float *y1 = malloc(sizeof(float) * mn), *y = malloc(sizeof(float) * mn);
            cpu_gemm_set_threads(1);
            cpu_gemm_rowinv(y1, x, wd, dts[d], NULL, m, n, k);
            for (int t = 2; t <= 3; t++) {
                cpu_gemm_set_threads(t);
                unsigned long c0 = cpu_gemm_pool_chunks();
                for (int rep = 0; rep < 200 && (rep < 3 || cpu_gemm_pool_chunks() == c0); rep++) {
                    cpu_gemm_rowinv(y, x, wd, dts[d], NULL, m, n, k);
                    ck_assert_msg(memcmp(y, y1, sizeof(float) * mn) == 0,
                                  "%s m=%d n=%d k=%d: %d threads differ from one",
                                  rekv_dtype_name(dts[d]), m, n, k, t);
                }
            }
            /* two callers at once: one owns the pool, the other works alone */
            gemm_caller c[2] = {{x, wd, dts[d], m, n, k, malloc(sizeof(float) * mn)},
                                {x, wd, dts[d], m, n, k, malloc(sizeof(float) * mn)}};
            pthread_t th[2];
            for (int i = 0; i < 2; i++)
                ck_assert_int_eq(pthread_create(&th[i], NULL, gemm_caller_run, &c[i]), 0);
            for (int i = 0; i < 2; i++) {
                pthread_join(th[i], NULL);
                ck_assert_msg(memcmp(c[i].y, y1, sizeof(float) * mn) == 0,
                              "%s m=%d n=%d k=%d: concurrent caller %d differs",
                              rekv_dtype_name(dts[d]), m, n, k, i);
                free(c[i].y);
            }
            free(x), free(w), free(wh), free(y1), free(y);
        }
    cpu_gemm_set_threads(0);
    ck_assert_msg(cpu_gemm_pool_chunks() > chunks0, "the pool's workers never took part");
}
END_TEST

/* The attention as cpu_ops.h defines it, one query at a time: a key's score the sequential sum over
 * the head dimension (times the scale, then the soft-cap), the softmax's sum in 8 lanes over the
 * slots from the skip or the window's first on, the output the sequential sum over t. */
static void attention_ref(float *out, const float *q, const rekv_attn_seq *sq, int n_heads,
                          int n_kv, int hd, rekv_dtype dt)
{
    int group = n_heads / n_kv;
    size_t qd = (size_t)n_heads * hd, vs = rekv_kv_v_shift(n_kv, hd);
    float *sc = malloc(sizeof(float) * (size_t)(sq->start + sq->n)),
          *k = malloc(sizeof(float) * hd), *v = malloc(sizeof(float) * hd);
    for (int i = 0; i < sq->n; i++)
        for (int h = 0; h < n_heads; h++) {
            int g = h / group, t0 = sq->skip ? sq->skip[g] : 0, n_ctx = sq->start + i + 1;
            if (sq->window > 0 && n_ctx - sq->window > t0)
                t0 = n_ctx - sq->window;
            float scale = sq->scale > 0 ? sq->scale : 1.0f / sqrtf((float)hd);
            const float *qh = q + (size_t)(sq->row0 + i) * qd + (size_t)h * hd;
            float *oh = out + (size_t)(sq->row0 + i) * qd + (size_t)h * hd, mx = -INFINITY, sum = 0;
            for (int t = t0; t < n_ctx; t++) {
                rekv_to_f32(
                    k, (const char *)sq->kv + rekv_kv_row(n_kv, hd, g, t) * rekv_dtype_size(dt), dt,
                    (size_t)hd);
                float d = 0;
                for (int j = 0; j < hd; j++)
                    d += qh[j] * k[j];
                sc[t] = d * scale;
                if (sq->softcap > 0)
                    sc[t] = tanhf(sc[t] / sq->softcap) * sq->softcap;
                mx = sc[t] > mx ? sc[t] : mx;
            }
            float lane[8] = {0};
            for (int t = t0; t < n_ctx; t++) {
                sc[t] = cpu_expf(sc[t] - mx);
                lane[(t - t0) % 8] += sc[t];
            }
            for (int l = 0; l < 8; l++)
                sum += lane[l];
            float inv = 1.0f / sum;
            memset(oh, 0, sizeof(float) * hd);
            for (int t = t0; t < n_ctx; t++) {
                rekv_to_f32(v,
                            (const char *)sq->kv +
                                (rekv_kv_row(n_kv, hd, g, t) + vs) * rekv_dtype_size(dt),
                            dt, (size_t)hd);
                float p = sc[t] * inv;
                for (int j = 0; j < hd; j++)
                    oh[j] += p * v[j];
            }
        }
    free(sc), free(k), free(v);
}

/* cpu_attention against the one-query-at-a-time definition, bit for bit: MHA and GQA (groups
 * past ATT_QUERIES too), head_dim off the vector width, f32 and f16 caches, decode rows (swept
 * block by block across heads: short and long contexts, a batch of them alone in a call), prompts
 * and chunks after a context, skipped slots, a sliding window with a scale and a soft-cap of its
 * own (Gemma-2's), a context long enough that a thread's scratch holds fewer queries than a unit
 * has, one thread and two (until the pool's workers took part), and each sequence alone against
 * all in one call. */
START_TEST(attention_fixed_order)
{
    static const int shapes[][3] = {{4, 4, 16}, {8, 2, 20}, {6, 3, 8}, {32, 1, 8}, {2, 2, 64}};
    /* start, n */
    static const int seqs_sn[][2] = {{100, 1}, {0, 37}, {50, 20}, {0, 1},
                                     {17, 3},  {20000, 16}, {1000, 1}, {15, 1}};
    static const rekv_dtype dts[] = {REKV_DTYPE_F32, REKV_DTYPE_F16};
    enum { NS = sizeof(seqs_sn) / sizeof(seqs_sn[0]) };
    unsigned long chunks0 = cpu_gemm_pool_chunks();
    for (size_t sh = 0; sh < sizeof(shapes) / sizeof(shapes[0]); sh++)
        for (int d = 0; d < 2; d++)
            for (int variant = 0; variant < 3; variant++) { /* none, skip, window */
                int with_skip = variant == 1, window = variant == 2 ? 40 : 0;
                int nh = shapes[sh][0], nkv = shapes[sh][1], hd = shapes[sh][2];
                rekv_dtype dt = dts[d];
                size_t qd = (size_t)nh * hd, es = rekv_dtype_size(dt);
                rekv_attn_seq sq[NS];
                int32_t skip[NS][32];
                int rows = 0, ctx = 0;
                for (int i = 0; i < NS; i++) {
                    int len = seqs_sn[i][0] + seqs_sn[i][1];
                    size_t elems = rekv_kv_buffer_elems(nkv, hd, len);
                    float *f = frands(elems);
                    void *kv = malloc(elems * es);
                    rekv_from_f32(kv, f, dt, elems);
                    free(f);
                    for (int g = 0; g < nkv; g++)
                        skip[i][g] = with_skip ? irand(seqs_sn[i][0] + 1) : 0;
                    sq[i] = (rekv_attn_seq){kv,
                                            seqs_sn[i][0],
                                            seqs_sn[i][1],
                                            rows,
                                            with_skip ? skip[i] : NULL,
                                            window,
                                            window ? 0.3f : 0,
                                            window ? 2.5f : 0};
                    rows += seqs_sn[i][1];
                    ctx = len > ctx ? len : ctx;
                }
                float *q = frands((size_t)rows * qd), *ref = malloc(sizeof(float) * rows * qd),
                      *out = malloc(sizeof(float) * rows * qd),
                      *scores = malloc(sizeof(float) * ctx);
                for (int i = 0; i < NS; i++)
                    attention_ref(ref, q, &sq[i], nh, nkv, hd, dt);
                for (int t = 1; t <= 2; t++) {
                    cpu_gemm_set_threads(t);
                    unsigned long c0 = cpu_gemm_pool_chunks();
                    for (int rep = 0;
                         rep < 50 && (rep < 1 || (t > 1 && cpu_gemm_pool_chunks() == c0)); rep++) {
                        memset(out, 0xff, sizeof(float) * rows * qd);
                        cpu_attention(out, q, sq, NS, nh, nkv, hd, dt, scores);
                        ck_assert_msg(memcmp(out, ref, sizeof(float) * rows * qd) == 0,
                                      "heads %d/%d hd %d %s variant %d, %d threads: differs", nh,
                                      nkv, hd, rekv_dtype_name(dt), variant, t);
                    }
                    for (int i = 0; i < NS; i++) { /* alone in a call */
                        memset(out, 0xff, sizeof(float) * rows * qd);
                        cpu_attention(out, q, &sq[i], 1, nh, nkv, hd, dt, scores);
                        size_t o = (size_t)sq[i].row0 * qd, n = (size_t)sq[i].n * qd;
                        ck_assert_msg(memcmp(out + o, ref + o, sizeof(float) * n) == 0,
                                      "heads %d/%d hd %d %s variant %d: sequence %d alone differs",
                                      nh, nkv, hd, rekv_dtype_name(dt), variant, i);
                    }
                    /* the decode rows alone in one call (every unit a sweep) */
                    rekv_attn_seq dec[NS];
                    int nd = 0;
                    for (int i = 0; i < NS; i++)
                        if (sq[i].n == 1)
                            dec[nd++] = sq[i];
                    memset(out, 0xff, sizeof(float) * rows * qd);
                    cpu_attention(out, q, dec, nd, nh, nkv, hd, dt, scores);
                    for (int i = 0; i < nd; i++)
                        ck_assert_msg(memcmp(out + (size_t)dec[i].row0 * qd,
                                             ref + (size_t)dec[i].row0 * qd,
                                             sizeof(float) * qd) == 0,
                                      "heads %d/%d hd %d %s variant %d, %d threads: decode row "
                                      "%d of %d differs",
                                      nh, nkv, hd, rekv_dtype_name(dt), variant, t, i, nd);
                }
                for (int i = 0; i < NS; i++)
                    free(sq[i].kv);
                free(q), free(ref), free(out), free(scores);
            }
    cpu_gemm_set_threads(0);
    ck_assert_msg(cpu_gemm_pool_chunks() > chunks0, "the pool's workers never took part");
}
END_TEST

static int ulps(float a, float b)
{
    int32_t x, y;
    memcpy(&x, &a, sizeof(x));
    memcpy(&y, &b, sizeof(y));
    return abs(x - y);
}

/* cpu_expf within 2 ulp of exp over its range, its edges as documented, and cpu_softmax_exp's
 * 8 lanes giving its bits, past e^-87 and for NaN too, and its sum in the documented order. */
START_TEST(expf_accurate_and_lanes_agree)
{
    int worst = 0;
    for (int i = 0; i <= 4000000; i++) {
        float x = -87.0f + 175.0f * (float)i / 4000000.0f;
        int u = ulps(cpu_expf(x), (float)exp((double)x));
        ck_assert_msg(u <= 2, "cpu_expf(%.9g) is %d ulp from exp", x, u);
        worst = u > worst ? u : worst;
    }
    ck_assert_float_eq(cpu_expf(0.0f), 1.0f);
    ck_assert_float_eq(cpu_expf(-0.0f), 1.0f);
    ck_assert_float_eq(cpu_expf(-87.001f), 0.0f);
    ck_assert_float_eq(cpu_expf(-INFINITY), 0.0f);
    ck_assert(isinf(cpu_expf(88.001f)));
    ck_assert(isnan(cpu_expf(NAN)));

    /* cpu_softmax_exp's lanes against cpu_expf, scores 250 apart (past e^-87) and a NaN */
    static const int lens[] = {1, 7, 8, 9, 16, 23, 64, 1000};
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++)
        for (int with_nan = 0; with_nan < 2; with_nan++) {
            int n = lens[li];
            float *s = malloc(sizeof(float) * n), *e = malloc(sizeof(float) * n), mx = -INFINITY,
                  got_mx, lane[8] = {0}, sum = 0;
            for (int t = 0; t < n; t++)
                s[t] = frand() * 250.0f;
            if (with_nan)
                s[n / 2] = NAN;
            for (int t = 0; t < n; t++)
                mx = s[t] > mx ? s[t] : mx; /* NaN never is */
            float got = cpu_softmax_exp(e, s, n, &got_mx);
            ck_assert_float_eq(got_mx, mx);
            for (int t = 0; t < n; t++) {
                float want = cpu_expf(s[t] - mx);
                ck_assert_msg(memcmp(&e[t], &want, sizeof(want)) == 0,
                              "n %d: e[%d] = %a, cpu_expf gives %a", n, t, e[t], want);
                lane[t % 8] += want;
            }
            for (int l = 0; l < 8; l++)
                sum += lane[l];
            ck_assert_msg(memcmp(&got, &sum, sizeof(sum)) == 0, "n %d: sum %a, lanes give %a", n,
                          got, sum);
            free(s), free(e);
        }
}
END_TEST

/* cpu_spec_scores against its definition, one score at a time (the sequential sum over the
 * columns, times scale), bit for bit: MHA and GQA, column counts off the lanes, contexts shorter
 * than and not a multiple of 8, one thread and two (until the pool's workers took part). */
START_TEST(spec_scores_fixed_order)
{
    static const int shapes[][3] = {{4, 1, 3}, {8, 2, 19}, {16, 1, 20}, {6, 3, 32}, {2, 2, 1}};
    static const int lens[] = {1, 7, 8, 9, 300, 1537};
    enum { NS = sizeof(lens) / sizeof(lens[0]) };
    unsigned long chunks0 = cpu_gemm_pool_chunks();
    for (size_t sh = 0; sh < sizeof(shapes) / sizeof(shapes[0]); sh++) {
        int nh = shapes[sh][0], group = shapes[sh][1], rk = shapes[sh][2], nkv = nh / group;
        rekv_spec_seq sq[NS];
        size_t total = 0;
        for (int i = 0; i < NS; i++) {
            sq[i] = (rekv_spec_seq){frands((size_t)lens[i] * nkv * rk), lens[i], NS - 1 - i, total};
            total += (size_t)nh * lens[i];
        }
        float *q = frands((size_t)NS * nh * rk), *ref = malloc(sizeof(float) * total),
              *out = malloc(sizeof(float) * total), scale = 0.37f;
        for (int i = 0; i < NS; i++)
            for (int h = 0; h < nh; h++)
                for (int t = 0; t < lens[i]; t++) {
                    const float *qh = q + ((size_t)sq[i].row * nh + h) * rk;
                    const float *k = sq[i].pk + ((size_t)t * nkv + h / group) * rk;
                    float acc = 0;
                    for (int c = 0; c < rk; c++)
                        acc += qh[c] * k[c];
                    ref[sq[i].out + (size_t)h * lens[i] + t] = scale * acc;
                }
        for (int th = 1; th <= 2; th++) {
            cpu_gemm_set_threads(th);
            unsigned long c0 = cpu_gemm_pool_chunks();
            for (int rep = 0; rep < 50 && (rep < 1 || (th > 1 && cpu_gemm_pool_chunks() == c0));
                 rep++) {
                memset(out, 0xff, sizeof(float) * total);
                cpu_spec_scores(out, q, sq, NS, nh, group, rk, scale);
                ck_assert_msg(memcmp(out, ref, sizeof(float) * total) == 0,
                              "heads %d group %d rk %d, %d threads: differs", nh, group, rk, th);
            }
        }
        for (int i = 0; i < NS; i++)
            free((void *)sq[i].pk);
        free(q), free(ref), free(out);
    }
    cpu_gemm_set_threads(0);
    ck_assert_msg(cpu_gemm_pool_chunks() > chunks0, "the pool's workers never took part");
}
END_TEST

START_TEST(dtype_conversions)
{
    /* f16: exact values, rounding to nearest even, subnormals, overflow, NaN */
    ck_assert_float_eq(rekv_f16_to_f32(0x3c00), 1.0f);
    ck_assert_float_eq(rekv_f16_to_f32(0xc000), -2.0f);
    ck_assert_float_eq(rekv_f16_to_f32(0x0001), ldexpf(1, -24));
    ck_assert_float_eq(rekv_f16_to_f32(0x7bff), 65504.0f);
    ck_assert(isinf(rekv_f16_to_f32(0x7c00)));
    ck_assert(isnan(rekv_f16_to_f32(0x7e00)));
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = rekv_f16_to_f32((uint16_t)h);
        if (isnan(f))
            continue;
        ck_assert_msg(rekv_f32_to_f16(f) == h, "f16 %04x does not round-trip", h);
    }
    ck_assert_uint_eq(rekv_f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00);     /* tie to even */
    ck_assert_uint_eq(rekv_f32_to_f16(1.0f + 3 * ldexpf(1, -11)), 0x3c02); /* tie to even */
    ck_assert_uint_eq(rekv_f32_to_f16(65520.0f), 0x7c00);                  /* overflow */
    ck_assert_uint_eq(rekv_f32_to_f16(ldexpf(1, -25)), 0x0000);            /* tie to zero */
    ck_assert_uint_eq(rekv_f32_to_f16(ldexpf(3, -26)), 0x0001);
    /* bf16 */
    ck_assert_float_eq(rekv_bf16_to_f32(0x3f80), 1.0f);
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = rekv_bf16_to_f32((uint16_t)h);
        if (!isnan(f))
            ck_assert_uint_eq(rekv_f32_to_bf16(f), h);
    }
    ck_assert_uint_eq(rekv_f32_to_bf16(1.0f + ldexpf(1, -8)), 0x3f80); /* tie to even */
    /* the array conversions (vectorised where the cpu can) give the scalar bits for every value,
     * NaN payloads included, at every alignment and tail length */
    uint16_t *all = malloc(sizeof(uint16_t) * 0x10003);
    float *a = malloc(sizeof(float) * 0x10003);
    for (uint32_t h = 0; h < 0x10003; h++)
        all[h] = (uint16_t)(h * 40503u); /* a permutation of 0..65535, then three more */
    static const rekv_dtype dts[] = {REKV_DTYPE_F16, REKV_DTYPE_BF16};
    for (int d = 0; d < 2; d++)
        for (size_t off = 0; off < 3; off++) {
            size_t n = 0x10000 + off;
            rekv_to_f32(a, all + off, dts[d], n);
            for (size_t i = 0; i < n; i++) {
                uint16_t h = all[off + i];
                float want = dts[d] == REKV_DTYPE_F16 ? rekv_f16_to_f32(h) : rekv_bf16_to_f32(h);
                ck_assert_msg(memcmp(&a[i], &want, 4) == 0, "%s %04x at %zu",
                              rekv_dtype_name(dts[d]), h, i);
            }
        }
    free(all);
    free(a);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cpu_ops");
    TCase *tc = tcase_create("cpu_ops");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, gemm_rowinv_is_row_invariant);
    tcase_add_test(tc, gemm_rowinv_16bit_weights_equal_widened);
    tcase_add_test(tc, gemm_rowinv_rows_1_to_70);
    tcase_add_test(tc, gemm_rowinv_threads_same_bits);
    tcase_add_test(tc, attention_fixed_order);
    tcase_add_test(tc, expf_accurate_and_lanes_agree);
    tcase_add_test(tc, spec_scores_fixed_order);
    tcase_add_test(tc, dtype_conversions);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
