/* test_gguf_qgemm.c — cpu_qgemm_rowinv_ref, the cpu backend's reference GEMM over quantized
 * weights: for every matrix of every file of ../shared/gguf (Q8_0, Q4_0, Q4_K, Q6_K, F16), its
 * products equal, bit for bit, the engine's GEMM (cpu_gemm_rowinv) on the matrix dequantized to
 * fp32 (whose logits test_gguf_forward checks against llama.cpp), and each row of x gets the same
 * bits alone as in a call with others; and the engine's fast path (cpu_qgemm_rowinv) gives the
 * reference's bits on 1 and 2 threads, with 7 rows and with one. */
#define _GNU_SOURCE
#include "gpuworker/cpu_ops.h"
#include "gpuworker/cpu_qgemm.h"
#include "loader/gguf.h"
#include "tests/testutil.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const k_files[] = {
    "llama-tiny-py-F16", "llama-tiny-py-Q8_0", "llama-tiny-py-Q4_0", "synth-llama-F16",
    "synth-llama-Q8_0",  "synth-llama-Q4_K_M", "synth-llama-Q4_0",
};
#define N_FILES (sizeof(k_files) / sizeof(k_files[0]))
#define M 7 /* a row tile of 4 and one of 3 in the fast path */

START_TEST(matches_fp32_gemm_on_dequantized)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "gguf/%s.gguf", k_files[_i]);
    const char *path = tu_shared(rel);
    if (path == NULL)
        return;
    rekv_gguf *g;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(path, &g, &err) == 0, "%s", err.msg);
    int checked = 0;
    for (size_t ti = 0; ti < g->n_tensors; ti++) {
        const rekv_gguf_tensor *t = &g->tensors[ti];
        if (t->n_dims != 2)
            continue;
        int k = (int)t->ne[0], n = (int)t->ne[1];
        float *x = malloc((size_t)M * k * sizeof(float)), *wf = malloc(t->numel * sizeof(float));
        float *yq = malloc((size_t)M * n * sizeof(float)),
              *yf = malloc((size_t)M * n * sizeof(float));
        float *y1 = malloc((size_t)n * sizeof(float));
        ck_assert(x && wf && yq && yf && y1);
        uint32_t s = 12345u + (uint32_t)ti;
        for (int i = 0; i < M * k; i++) {
            s = s * 1664525u + 1013904223u;
            x[i] = (float)((int)(s >> 9) - (1 << 22)) / (float)(1 << 22);
        }
        ck_assert_int_eq(rekv_gguf_dequant(t, 0, t->numel, wf, &err), 0);
        ck_assert_int_eq(cpu_qgemm_rowinv_ref(yq, x, t->data, t->type, M, n, k), 0);
        cpu_gemm_rowinv(yf, x, wf, REKV_DTYPE_F32, NULL, M, n, k);
        for (int i = 0; i < M * n; i++)
            ck_assert_msg(memcmp(&yq[i], &yf[i], 4) == 0, "%s %s (%s): y[%d] %.9g, fp32 GEMM %.9g",
                          k_files[_i], t->name, rekv_ggml_type_name(t->type), i, yq[i], yf[i]);
        /* the engine's path (cpu_qgemm_rowinv: AVX2 dequantization into cpu_gemm's tiles, on
         * the pool): the same bits with all rows, on 1 and on 2 threads */
        for (int th = 1; th <= 2; th++) {
            int was = cpu_gemm_set_threads(th);
            memset(yf, 0, (size_t)M * n * sizeof(float));
            ck_assert_int_eq(cpu_qgemm_rowinv(yf, x, t->data, t->type, NULL, M, n, k), 0);
            cpu_gemm_set_threads(was);
            for (int i = 0; i < M * n; i++)
                ck_assert_msg(memcmp(&yq[i], &yf[i], 4) == 0,
                              "%s %s (%s), %d threads: y[%d] %.9g, reference %.9g", k_files[_i],
                              t->name, rekv_ggml_type_name(t->type), th, i, yf[i], yq[i]);
        }
        for (int r = 0; r < M; r++) { /* a row alone: the same bits */
            ck_assert_int_eq(cpu_qgemm_rowinv_ref(y1, x + (size_t)r * k, t->data, t->type, 1, n, k),
                             0);
            ck_assert_mem_eq(y1, yq + (size_t)r * n, (size_t)n * sizeof(float));
            ck_assert_int_eq(
                cpu_qgemm_rowinv(y1, x + (size_t)r * k, t->data, t->type, NULL, 1, n, k), 0);
            ck_assert_mem_eq(y1, yq + (size_t)r * n, (size_t)n * sizeof(float));
        }
        free(x);
        free(wf);
        free(yq);
        free(yf);
        free(y1);
        checked++;
    }
    ck_assert_int_ge(checked, 28);
    rekv_gguf_close(g);
}
END_TEST

START_TEST(refuses_what_it_cannot_read)
{
    float x[64] = {0}, y[2];
    uint8_t w[2 * 34] = {0};
    ck_assert_int_eq(cpu_qgemm_rowinv_ref(y, x, w, REKV_GGML_Q5_K, 1, 1, 256), -ENOTSUP);
    ck_assert_int_eq(cpu_qgemm_rowinv_ref(y, x, w, 99, 1, 1, 32), -ENOTSUP);
    ck_assert_int_eq(cpu_qgemm_rowinv_ref(y, x, w, REKV_GGML_Q8_0, 1, 1, 48), -EINVAL);
    ck_assert_int_eq(cpu_qgemm_rowinv_ref(y, x, w, REKV_GGML_Q8_0, 1, 2, 32), 0);
    ck_assert(y[0] == 0 && y[1] == 0);
    ck_assert_int_eq(cpu_qgemm_rowinv(y, x, w, REKV_GGML_Q5_K, NULL, 1, 1, 256), -ENOTSUP);
    ck_assert_int_eq(cpu_qgemm_rowinv(y, x, w, REKV_GGML_Q8_0, NULL, 1, 1, 48), -EINVAL);
    float b[2] = {1, 2};
    ck_assert_int_eq(cpu_qgemm_rowinv(y, x, w, REKV_GGML_Q8_0, b, 1, 2, 32), 0);
    ck_assert(y[0] == 1 && y[1] == 2);
}
END_TEST

Suite *gguf_qgemm_suite(void);
Suite *gguf_qgemm_suite(void)
{
    Suite *s = suite_create("gguf_qgemm");
    TCase *tc = tcase_create("qgemm");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, matches_fp32_gemm_on_dequantized, 0, N_FILES);
    tcase_add_test(tc, refuses_what_it_cannot_read);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(gguf_qgemm_suite());
}
