/* test_cpu_tile.c — the cpu GEMM's tile layout (cpu_gemm.c: each block of 8 weight rows
 * interleaved in chunks of 8 elements, so a one-row tile reads one sequential stream): over tiled
 * weights the GEMM gives the bits it gives over the row-major matrix, in every weight dtype, on
 * both code paths and at any thread count; packing is undone exactly; and the engine, which
 * tiles its matrices at load, computes the same logits tiled and untiled, in its reference
 * forward pass and in a cpu pipeline, and the model's fingerprint (skew files) is the same. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "gpuworker/cpu_ops.h"
#include "gpuworker/device/backend.h"
#include "gpuworker/engine_internal.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "tests/testutil.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
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

/* w [n][k] in dtype dt (random), x [m][k], bias [n]: the tiled GEMM of the packed copy against
 * the row-major GEMM, with and without bias, and the tiled portable path; then the copy
 * unpacked equals w byte for byte. */
static void check_shape(rekv_dtype dt, int m, int n, int k)
{
    size_t es = rekv_dtype_size(dt), nk = (size_t)n * k, bytes = nk * es;
    float *wf = malloc(sizeof(float) * nk), *x = malloc(sizeof(float) * (size_t)m * k);
    float *b = malloc(sizeof(float) * (size_t)n);
    float *y = malloc(sizeof(float) * (size_t)m * n), *yt = malloc(sizeof(float) * (size_t)m * n);
    void *w = malloc(bytes), *wt = malloc(bytes);
    void *scratch = malloc(cpu_tile_scratch_bytes(dt, k));
    ck_assert(wf && x && b && y && yt && w && wt && scratch);
    for (size_t i = 0; i < nk; i++)
        wf[i] = frand();
    for (size_t i = 0; i < (size_t)m * k; i++)
        x[i] = frand();
    for (int i = 0; i < n; i++)
        b[i] = frand();
    if (dt == REKV_DTYPE_F32)
        memcpy(w, wf, bytes);
    else
        rekv_from_f32(w, wf, dt, nk);
    memcpy(wt, w, bytes);
    cpu_tile_pack(wt, dt, n, k, scratch);
    if (n >= 8 && k >= 16)
        ck_assert_msg(memcmp(w, wt, bytes) != 0, "n=%d k=%d: packing moved nothing", n, k);
    for (int withb = 0; withb < 2; withb++) {
        const float *bias = withb ? b : NULL;
        cpu_gemm_rowinv(y, x, w, dt, bias, m, n, k);
        cpu_gemm_rowinv_tiled(yt, x, wt, dt, bias, m, n, k);
        ck_assert_msg(memcmp(y, yt, sizeof(float) * (size_t)m * n) == 0,
                      "%s m=%d n=%d k=%d bias=%d: tiled weights give other bits",
                      rekv_dtype_name(dt), m, n, k, withb);
    }
    cpu_gemm_rowinv_portable(y, x, w, dt, m, n, k);
    cpu_gemm_rowinv_tiled_portable(yt, x, wt, dt, m, n, k);
    ck_assert_msg(memcmp(y, yt, sizeof(float) * (size_t)m * n) == 0,
                  "%s m=%d n=%d k=%d: the tiled portable path gives other bits",
                  rekv_dtype_name(dt), m, n, k);
    cpu_gemm_rowinv(yt, x, w, dt, NULL, m, n, k);
    ck_assert_msg(memcmp(y, yt, sizeof(float) * (size_t)m * n) == 0,
                  "%s m=%d n=%d k=%d: portable and vector paths differ", rekv_dtype_name(dt), m, n,
                  k);
    cpu_tile_unpack(wt, dt, n, k, scratch);
    ck_assert_msg(memcmp(w, wt, bytes) == 0, "%s n=%d k=%d: unpacking does not restore the matrix",
                  rekv_dtype_name(dt), n, k);
    free(wf), free(x), free(b), free(y), free(yt), free(w), free(wt), free(scratch);
}

/* Every row count of the tiles (1..9 and past the 4-row blocks), n and k off every multiple of 8
 * (a partial last block, a k % 8 tail, fewer than 8 rows or elements), each dtype, at one thread
 * and at two (shapes large enough for the pool: its column chunks fall inside the layout). */
START_TEST(tiled_gemm_same_bits)
{
    static const rekv_dtype dts[] = {REKV_DTYPE_F32, REKV_DTYPE_F16, REKV_DTYPE_BF16};
    int prev = cpu_gemm_set_threads(1);
    for (int threads = 1; threads <= 2; threads++) {
        cpu_gemm_set_threads(threads);
        for (int trial = 0; trial < 90; trial++) {
            int m = trial % 10 == 9 ? 1 + irand(70) : 1 + trial % 9;
            int n = trial < 30 ? 1 + irand(40) : 1 + irand(700);
            int k = trial < 30 ? 1 + irand(40) : 1 + irand(600);
            check_shape(dts[trial % 3], m, n, k);
        }
        check_shape(REKV_DTYPE_F16, 1, 2816, 1024); /* a decode step's FFN, split by the pool */
        check_shape(REKV_DTYPE_BF16, 3, 1029, 515);
    }
    cpu_gemm_set_threads(prev);
}
END_TEST

/* A synthetic Llama whose every matrix is off the tile grid (hidden 52: k % 8 = 4; kv_dim 26, ffn
 * 60 and vocab 101: a partial last block), untied, in dtype dt, made in dir. */
static void synth(const char *dir, const char *dt)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 2 --hidden 52 --heads 2 --kv-heads 1 --ffn 60 "
             "--vocab 101 --max-pos 64 --dtype %s --untied %s >/dev/null",
             tu_bin("rekv-loader"), dt, dir);
    tu_run_ok(cmd);
}

enum { PROMPT = 9, STEPS = 4 };

/* The logits of a prompt and STEPS greedy steps, by the reference forward pass ([STEPS + 1][V]). */
static void forward_logits(rekv_engine *e, const int32_t *prompt, float *out)
{
    rekv_err err = {0};
    rekv_seq *s;
    int V = e->c.vocab;
    ck_assert_msg(rekv_seq_create(e, PROMPT + STEPS, &s, &err) == 0, "%s", err.msg);
    int32_t tok;
    for (int st = 0; st <= STEPS; st++) {
        float *lg = out + (size_t)st * V;
        rekv_batch_item it = {s, st ? &tok : prompt, st ? 1 : PROMPT, 0, lg};
        ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
        tok = rekv_argmax(lg, V);
    }
    rekv_seq_free(s);
}

/* The same by a resident pipeline on the cpu backend. */
static void pipeline_logits(rekv_engine *e, const int32_t *prompt, float *out)
{
    rekv_err err = {0};
    rekv_backend *be;
    rekv_pipeline *p;
    rekv_pseq *s;
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    int V = e->c.vocab;
    ck_assert_msg(rekv_backend_cpu_create(NULL, &be, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_pipeline_create(e, be, NULL, &cfg, &p, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_pseq_create(p, PROMPT + STEPS, &s, &err) == 0, "%s", err.msg);
    int32_t tok;
    for (int st = 0; st <= STEPS; st++) {
        float *lg = out + (size_t)st * V;
        rekv_pipe_item it = {
            .seq = s, .tokens = st ? &tok : prompt, .n_tokens = st ? 1 : PROMPT, .logits = lg};
        ck_assert_msg(rekv_pipeline_step(p, &it, 1, &err) == 0, "%s", err.msg);
        tok = rekv_argmax(lg, V);
    }
    rekv_pseq_free(s);
    rekv_pipeline_free(p);
    rekv_backend_destroy(be);
}

/* The engine tiles its matrices at load (the bytes of W_Q are not the file's), and untiling it
 * changes no logit of the forward pass or of a cpu pipeline, in each dtype the loader keeps. */
START_TEST(engine_tiled_same_logits)
{
    static const char *dts[] = {"f32", "f16", "bf16"};
    char *dir = tu_tmpdir();
    for (int d = 0; d < 3; d++) {
        char path[512];
        snprintf(path, sizeof(path), "%s/m-%s", dir, dts[d]);
        synth(path, dts[d]);
        rekv_err err = {0};
        rekv_model *m;
        rekv_engine *e;
        ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
        const rekv_tensor *wq = m->weights.layers[0].wq;
        ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
        int V = e->c.vocab;
        ck_assert_msg(e->tiled, "%s: the engine did not tile its weights", dts[d]);
        /* the file's bytes were released (MADV_DONTNEED): compare with a fresh open */
        rekv_model *m2;
        ck_assert_msg(rekv_model_open(path, &m2, &err) == 0, "%s", err.msg);
        wq = m2->weights.layers[0].wq;
        ck_assert_msg(memcmp(e->layers[0].wq, wq->data, wq->nbytes) != 0,
                      "%s: W_Q is held row-major", dts[d]);
        int32_t prompt[PROMPT];
        for (int i = 0; i < PROMPT; i++)
            prompt[i] = irand(V);
        size_t nl = (size_t)(STEPS + 1) * V;
        float *ft = malloc(sizeof(float) * nl), *fu = malloc(sizeof(float) * nl);
        float *pt = malloc(sizeof(float) * nl), *pu = malloc(sizeof(float) * nl);
        forward_logits(e, prompt, ft);
        pipeline_logits(e, prompt, pt);
        uint64_t fp = rekv_engine_fingerprint(e);
        ck_assert_msg(rekv_engine_untile(e, &err) == 0, "%s", err.msg);
        ck_assert_msg(rekv_engine_fingerprint(e) == fp,
                      "%s: the model's fingerprint depends on the layout", dts[d]);
        ck_assert(!e->tiled);
        ck_assert_msg(memcmp(e->layers[0].wq, wq->data, wq->nbytes) == 0,
                      "%s: untiled W_Q is not the file's", dts[d]);
        forward_logits(e, prompt, fu);
        pipeline_logits(e, prompt, pu);
        ck_assert_msg(memcmp(ft, fu, sizeof(float) * nl) == 0,
                      "%s: the forward pass's logits depend on the layout", dts[d]);
        ck_assert_msg(memcmp(pt, pu, sizeof(float) * nl) == 0,
                      "%s: the cpu pipeline's logits depend on the layout", dts[d]);
        free(ft), free(fu), free(pt), free(pu);
        rekv_engine_free(e);
        rekv_model_close(m);
        rekv_model_close(m2);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cpu_tile");
    TCase *tc = tcase_create("gemm");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, tiled_gemm_same_bits);
    suite_add_tcase(s, tc);
    tc = tcase_create("engine");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, engine_tiled_same_logits);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
