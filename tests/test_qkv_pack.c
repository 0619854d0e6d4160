/* test_qkv_pack.c — the fused Q,K,V projection's cpu-side twin (issue 40 item 1). The cuda
 * pipeline concatenates a layer's W_Q, W_K, W_V and their biases at upload (pipeline_create.c,
 * pl_qkv_pack) and runs them as one GEMM whose output one kernel splits, adding the bias and
 * rotating q and k (kernels_cuda.cu k_qkv). What can be checked without a GPU is checked here:
 * - the packed matrix's rows are the model file's W_Q, W_K, W_V rows (read from a second,
 *   independent open of the file), row-major although the cpu engine tiles its matrices, and the
 *   packed bias is the file's b_Q, b_K, b_V (zeros where a model has none);
 * - quantized matrices (GGUF Q8_0) are packed as their blocks, the file's bytes (the kernels
 *   decode them on every backend);
 * - the contract k_qkv implements — one GEMM over the packed matrix, then per row bias, split and
 *   RoPE — emulated on the cpu gives the reference's three linears and two ropes bit for bit (the
 *   cpu GEMM computes each element in a fixed order whatever the other columns, and adds the bias
 *   after the sum, as the split kernel does);
 * - the other biases folded into the pass after their linear (cuda's bias_activation, bias_add)
 *   give, on the reference's terms, the bits of the linear with its bias then that pass.
 * The cuda kernel itself is checked against the cpu backend in test_cuda (kernel_qkv,
 * kernel_bias_fold, pipeline_qkv_fused) on a GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/pipeline_internal.h"
#include "loader/gguf.h"
#include "tests/testutil.h"

#define OPT_TINY "../shared/models/opt-tiny-py"
#define LLAMA_TINY "../shared/models/llama-tiny-py"
#define GGUF_Q8 "../shared/gguf/synth-llama-Q8_0.gguf"
#define GGUF_F16 "../shared/gguf/llama-tiny-py-F16.gguf"

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static float frand(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) / 16777216.0) - 0.5f;
}

typedef struct opened {
    rekv_model *m, *src; /* the engine's model; a second open of the file: the oracle */
    rekv_engine *e;
} opened;

static void open_model(opened *o, const char *path)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(path, &o->m, &err) == 0, "%s: %s", path, err.msg);
    ck_assert_msg(rekv_model_open(path, &o->src, &err) == 0, "%s: %s", path, err.msg);
    ck_assert_msg(rekv_engine_create(o->m, &o->e, &err) == 0, "%s: %s", path, err.msg);
}

static void close_model(opened *o)
{
    rekv_engine_free(o->e);
    rekv_model_close(o->m);
    rekv_model_close(o->src);
}

/* Row r of tensor t ([n][k]) as fp32, widened. */
static void tensor_row(const rekv_tensor *t, size_t r, size_t k, float *out)
{
    rekv_to_f32(out, (const uint8_t *)t->data + r * k * rekv_dtype_size(t->dtype), t->dtype, k);
}

/* Every layer of the model at path packed and compared with the file's tensors, row by row: in
 * the engine's dtype, or for quantized matrices (all of block type qt) their blocks. */
static void check_pack(const char *path, uint32_t qt)
{
    opened o;
    open_model(&o, path);
    rekv_dtype want_wt = qt ? cpu_qgemm_wt(qt) : o.e->wdtype;
    const rekv_model_config *c = &o.e->c;
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c);
    size_t KV = (size_t)rekv_config_kv_dim(c), n = Q + 2 * KV;
    float *got = malloc(H * sizeof(float)), *want = malloc(H * sizeof(float));
    float *b = malloc(n * sizeof(float));
    for (int l = 0; l < c->n_layers; l++) {
        rekv_dtype wt = REKV_DTYPE_F32;
        ck_assert_msg(pl_qkv_dtype(o.e, l, &wt) == 1, "%s layer %d: not fusable", path, l);
        ck_assert_msg(wt == want_wt, "%s layer %d: packed as %s, not %s", path, l,
                      rekv_dtype_name(wt), rekv_dtype_name(want_wt));
        uint8_t *w = malloc(pl_wt_bytes(wt, n, H));
        ck_assert_int_eq(pl_qkv_pack(o.e, l, wt, w, b), 0);
        const rekv_layer_weights *s = &o.src->weights.layers[l];
        const rekv_tensor *mats[3] = {s->wq, s->wk, s->wv}, *bs[3] = {s->bq, s->bk, s->bv};
        size_t rows[3] = {Q, KV, KV}, at = 0;
        for (int i = 0; i < 3; i++) {
            for (size_t r = 0; r < rows[i]; r++) {
                const uint8_t *pr = w + pl_wt_bytes(wt, at + r, H);
                if (qt) { /* the file's blocks, byte for byte */
                    size_t rb = pl_wt_bytes(wt, 1, H);
                    ck_assert_uint_eq(mats[i]->qtype, qt);
                    ck_assert_msg(memcmp(pr, (const uint8_t *)mats[i]->data + r * rb, rb) == 0,
                                  "%s layer %d: packed row %zu is not W_%c's row %zu", path, l,
                                  at + r, "QKV"[i], r);
                    continue;
                }
                rekv_to_f32(got, pr, wt, H);
                tensor_row(mats[i], r, H, want);
                ck_assert_msg(memcmp(got, want, H * sizeof(float)) == 0,
                              "%s layer %d: packed row %zu is not W_%c's row %zu", path, l, at + r,
                              "QKV"[i], r);
            }
            for (size_t r = 0; r < rows[i]; r++) {
                float bw = 0;
                if (bs[i])
                    rekv_to_f32(&bw,
                                (const uint8_t *)bs[i]->data + r * rekv_dtype_size(bs[i]->dtype),
                                bs[i]->dtype, 1);
                ck_assert_msg(memcmp(&b[at + r], &bw, sizeof(float)) == 0,
                              "%s layer %d: packed bias %zu is %g, not %g", path, l, at + r,
                              (double)b[at + r], (double)bw);
            }
            at += rows[i];
        }
        free(w);
    }
    free(got), free(want), free(b);
    close_model(&o);
}

START_TEST(pack_rows_are_the_files)
{
    check_pack(OPT_TINY, 0);   /* biases on Q, K, V */
    check_pack(LLAMA_TINY, 0); /* GQA: 8 query heads, 2 KV heads */
    check_pack(GGUF_F16, 0);   /* a GGUF file's 16-bit matrices */
}
END_TEST

/* Quantized: packed as their blocks, which every backend's kernels decode (the cpu never fuses;
 * cuda's qkv takes them as linear does). */
START_TEST(pack_quantized)
{
    check_pack(GGUF_Q8, REKV_GGML_Q8_0);
}
END_TEST

/* k_qkv's split on the cpu: y [T][n] the packed GEMM's output without bias; q, k, v as the kernel
 * writes them before RoPE (the bias added after the sum, as bias_kernel and the cpu GEMM do). */
static void split(const float *y, const float *b, float *q, float *k, float *v, size_t T, size_t Q,
                  size_t KV)
{
    size_t n = Q + 2 * KV;
    for (size_t r = 0; r < T; r++)
        for (size_t j = 0; j < n; j++) {
            float t = y[r * n + j] + b[j];
            if (j < Q)
                q[r * Q + j] = t;
            else if (j < Q + KV)
                k[r * KV + j - Q] = t;
            else
                v[r * KV + j - Q - KV] = t;
        }
}

static void check_fused_forward(const char *path)
{
    opened o;
    open_model(&o, path);
    const rekv_model_config *c = &o.e->c;
    int T = 7;
    size_t H = (size_t)c->hidden, Q = (size_t)rekv_config_q_dim(c);
    size_t KV = (size_t)rekv_config_kv_dim(c), n = Q + 2 * KV, hd = (size_t)c->head_dim;
    float *x = malloc(sizeof(float) * T * H), *y = malloc(sizeof(float) * T * n);
    float *b = malloc(sizeof(float) * n);
    float *q0 = malloc(sizeof(float) * T * Q), *q1 = malloc(sizeof(float) * T * Q);
    float *k0 = malloc(sizeof(float) * T * KV), *k1 = malloc(sizeof(float) * T * KV);
    float *v0 = malloc(sizeof(float) * T * KV), *v1 = malloc(sizeof(float) * T * KV);
    float *cs = malloc(sizeof(float) * T * hd / 2), *sn = malloc(sizeof(float) * T * hd / 2);
    int pos[7] = {0, 1, 2, 30, 31, 100, 5};
    for (size_t i = 0; i < T * H; i++)
        x[i] = 4 * frand();
    if (c->rope != REKV_ROPE_NONE)
        cpu_rope_table(cs, sn, pos, T, &o.e->rope);
    for (int l = 0; l < c->n_layers; l++) {
        const layer_w *L = &o.e->layers[l];
        rekv_engine_gemm(o.e, q0, x, L->wq, L->bq, T, (int)Q, (int)H);
        rekv_engine_gemm(o.e, k0, x, L->wk, L->bk, T, (int)KV, (int)H);
        rekv_engine_gemm(o.e, v0, x, L->wv, L->bv, T, (int)KV, (int)H);
        rekv_dtype wt;
        ck_assert_int_eq(pl_qkv_dtype(o.e, l, &wt), 1);
        void *w = malloc(n * H * rekv_dtype_size(wt));
        ck_assert_int_eq(pl_qkv_pack(o.e, l, wt, w, b), 0);
        cpu_gemm_rowinv(y, x, w, wt, NULL, T, (int)n, (int)H);
        split(y, b, q1, k1, v1, (size_t)T, Q, KV);
        if (c->rope != REKV_ROPE_NONE) {
            cpu_rope(q0, cs, sn, T, c->n_heads, c->head_dim, c->rope);
            cpu_rope(k0, cs, sn, T, c->n_kv_heads, c->head_dim, c->rope);
            cpu_rope(q1, cs, sn, T, c->n_heads, c->head_dim, c->rope);
            cpu_rope(k1, cs, sn, T, c->n_kv_heads, c->head_dim, c->rope);
        }
        ck_assert_msg(memcmp(q0, q1, sizeof(float) * T * Q) == 0, "%s layer %d: q differs", path,
                      l);
        ck_assert_msg(memcmp(k0, k1, sizeof(float) * T * KV) == 0, "%s layer %d: k differs", path,
                      l);
        ck_assert_msg(memcmp(v0, v1, sizeof(float) * T * KV) == 0, "%s layer %d: v differs", path,
                      l);
        free(w);
    }
    free(x), free(y), free(b), free(q0), free(q1), free(k0), free(k1), free(v0), free(v1);
    free(cs), free(sn);
    close_model(&o);
}

START_TEST(fused_projection_is_the_reference)
{
    check_fused_forward(OPT_TINY);   /* biases, no RoPE */
    check_fused_forward(LLAMA_TINY); /* RoPE, GQA */
    check_fused_forward(GGUF_F16);   /* 16-bit matrices */
    /* Qwen2's attention: biases and RoPE, the split's both halves at once */
    rekv_synth_spec spec = {REKV_ARCH_LLAMA, 2, 128, 8, 2, 256, 300, 1100, REKV_DTYPE_BF16, 5, 0};
    rekv_synth_llama qwen = {.qwen2 = 1};
    char *dir = tu_tmpdir();
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write_llama(&spec, &qwen, dir, NULL, NULL, &err) == 0, "%s", err.msg);
    check_fused_forward(dir);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* The other biases folded into the pass after their linear (cuda's bias_activation, bias_add): on
 * the reference's terms a GEMM without its bias, then the bias added in that pass, gives what the
 * GEMM with its bias then the pass gives, bit for bit — the cpu GEMM adds the bias after the sum,
 * as the folded kernels do. OPT's W_1 (ReLU) and W_O, W_2 (residual adds), every layer. */
START_TEST(bias_fold_is_the_reference)
{
    opened o;
    open_model(&o, OPT_TINY);
    const rekv_model_config *c = &o.e->c;
    int T = 5, H = c->hidden, F = c->ffn;
    size_t nf = (size_t)T * F, nh = (size_t)T * H;
    float *x = malloc(sizeof(float) * T * (size_t)(F > H ? F : H));
    float *a = malloc(sizeof(float) * nf), *b = malloc(sizeof(float) * nf);
    float *r0 = malloc(sizeof(float) * nh), *r1 = malloc(sizeof(float) * nh);
    for (size_t i = 0; i < (size_t)T * (size_t)(F > H ? F : H); i++)
        x[i] = 2 * frand();
    for (int l = 0; l < c->n_layers; l++) {
        const layer_w *L = &o.e->layers[l];
        ck_assert(L->b1 && L->bo && L->b2);
        rekv_engine_gemm(o.e, a, x, L->w1, L->b1, T, F, H);
        cpu_activation(a, NULL, nf, c->act);
        rekv_engine_gemm(o.e, b, x, L->w1, NULL, T, F, H);
        for (size_t i = 0; i < nf; i++)
            b[i] = b[i] + ((const float *)L->b1)[i % (size_t)F];
        cpu_activation(b, NULL, nf, c->act);
        ck_assert_msg(memcmp(a, b, sizeof(float) * nf) == 0, "layer %d: b_1 folded differs", l);
        const void *w[2] = {L->wo, L->w2}, *bs[2] = {L->bo, L->b2};
        int k[2] = {rekv_config_q_dim(c), F};
        for (int j = 0; j < 2; j++) {
            for (size_t i = 0; i < nh; i++)
                r0[i] = r1[i] = x[i];
            rekv_engine_gemm(o.e, a, x, w[j], bs[j], T, H, k[j]);
            for (size_t i = 0; i < nh; i++) /* add(x, h) */
                r0[i] += a[i];
            rekv_engine_gemm(o.e, b, x, w[j], NULL, T, H, k[j]);
            for (size_t i = 0; i < nh; i++) /* bias_add(x, h, bias) */
                r1[i] += b[i] + ((const float *)bs[j])[i % (size_t)H];
            ck_assert_msg(memcmp(r0, r1, sizeof(float) * nh) == 0, "layer %d: %s folded differs", l,
                          j ? "b_2" : "b_O");
        }
    }
    free(x), free(a), free(b), free(r0), free(r1);
    close_model(&o);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("qkv_pack");
    TCase *tc = tcase_create("pack");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, pack_rows_are_the_files);
    tcase_add_test(tc, pack_quantized);
    tcase_add_test(tc, fused_projection_is_the_reference);
    tcase_add_test(tc, bias_fold_is_the_reference);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
