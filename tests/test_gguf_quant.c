/* test_gguf_quant.c — quantized GGUF weights (Q8_0, Q4_0, Q4_K, Q6_K) in the engine, kept as their
 * blocks and multiplied through cpu_qgemm_rowinv (test_gguf_forward checks their logits against
 * llama.cpp's and the float64 pass; test_gguf_qgemm the GEMM alone):
 * - the logits are, bit for bit, those of the same file with every matrix dequantized to F32 by
 *   the loader (ggml's values) — prefill rows and decode steps alike;
 * - prefill and decode, alone and batched, give the same bits (the engine's row invariance);
 * - free-running greedy generation reproduces llama.cpp's ids up to the first step where neither
 *   llama.cpp's margin (over llama_greedy_gate) nor the float64 pass (its gap over
 *   f64_greedy_gate, the same pick) makes the pick certain (../shared/gguf/README.md section 5):
 *   all 48 for llama-tiny-py;
 * - the weights are held at their quantized size (the engine's bytes are the file's blocks, a
 *   fraction of the F16 file's), and the planner prices offloaded layers by those bytes;
 * - the decode pipeline on the cpu backend, every exact mode, weights resident or offloaded, gives
 *   the engine's bits, and an offloaded step moves exactly the file's bytes for its layers
 *   (infinigen, not yet, is refused).
 * The files come from ../shared/gguf; with CI=true a missing one fails the test. */
#define _GNU_SOURCE
#include "coordinator/planner.h"
#include "gpuworker/gpuworker.h"
#include "loader/gguf.h"
#include "gpuworker/pipeline.h"
#include "tests/fixture.h"
#include "tests/gguf_edit.h"
#include "tests/testutil.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const k_files[] = {"llama-tiny-py-Q8_0", "llama-tiny-py-Q4_0",
                                      "synth-llama-Q8_0", "synth-llama-Q4_K_M", "synth-llama-Q4_0"};
#define N_FILES (sizeof(k_files) / sizeof(k_files[0]))

typedef struct run {
    rekv_model *m;
    rekv_engine *e;
    int vocab;
} run;

static void run_open(const char *path, run *r)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(path, &r->m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(r->m, &r->e, &err) == 0, "%s", err.msg);
    r->vocab = r->m->config.vocab;
}

static void run_close(run *r)
{
    rekv_engine_free(r->e);
    rekv_model_close(r->m);
}

/* ../shared/gguf/NAME.gguf and its ref.json (loaded into *ref); NULL when missing (not in CI). */
static const char *shared_file(const char *name, json_t **ref)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "gguf/%s.gguf", name);
    const char *path = tu_shared(rel);
    snprintf(rel, sizeof(rel), "gguf/%s.ref.json", name);
    const char *rpath = tu_shared(rel);
    if (path == NULL || rpath == NULL)
        return NULL;
    *ref = json_load_file(rpath, 0, NULL);
    ck_assert_ptr_nonnull(*ref);
    return path;
}

static json_t *gen_case(json_t *ref, size_t i)
{
    return json_array_get(json_object_get(json_object_get(ref, "generation"), "cases"), i);
}

static int32_t *ids_of(json_t *a, int *n)
{
    *n = (int)json_array_size(a);
    int32_t *v = malloc((size_t)*n * sizeof(*v) + 1);
    ck_assert_ptr_nonnull(v);
    for (int i = 0; i < *n; i++)
        v[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return v;
}

static void forward(run *r, rekv_seq *s, const int32_t *ids, int n, int all, float *out)
{
    rekv_batch_item it = {.seq = s, .tokens = ids, .n_tokens = n, .all_logits = all, .logits = out};
    rekv_err err = {0};
    ck_assert_msg(rekv_engine_forward(r->e, &it, 1, &err) == 0, "%s", err.msg);
}

/* Case 0's prompt with every row's logits, then 3 decode steps of llama.cpp's greedy ids: the
 * logits of all of them, [(np + 3) * vocab], malloc'd. */
static float *case0_logits(run *r, json_t *ref, int *rows)
{
    int np, ng;
    int32_t *prompt = ids_of(json_object_get(gen_case(ref, 0), "prompt"), &np);
    int32_t *greedy = ids_of(json_object_get(gen_case(ref, 0), "greedy"), &ng);
    *rows = np + 3;
    float *out = malloc((size_t)*rows * (size_t)r->vocab * sizeof(float));
    ck_assert_ptr_nonnull(out);
    rekv_seq *s;
    ck_assert_int_eq(rekv_seq_create(r->e, 64, &s, NULL), 0);
    forward(r, s, prompt, np, 1, out);
    for (int i = 0; i < 3; i++)
        forward(r, s, &greedy[i], 1, 0, out + (size_t)(np + i) * r->vocab);
    rekv_seq_free(s);
    free(prompt);
    free(greedy);
    return out;
}

/* The quantized engine's logits are the fp32 engine's on the dequantized weights, bit for bit. */
START_TEST(bits_of_fp32_dequantization)
{
    json_t *ref;
    const char *path = shared_file(k_files[_i], &ref);
    if (path == NULL)
        return;
    run q, f;
    run_open(path, &q);
    ck_assert_uint_ne(q.m->weights.layers[0].w1->qtype, 0);
    int rows, rows_f;
    float *lq = case0_logits(&q, ref, &rows);
    size_t q_bytes = rekv_engine_weight_bytes(q.e);
    run_close(&q);
    char *dir = tu_tmpdir();
    run_open(tg_rewrite(path, NULL, 0, TG_DEQUANT_F32, dir), &f);
    ck_assert_uint_eq(f.m->weights.layers[0].w1->qtype, 0);
    float *lf = case0_logits(&f, ref, &rows_f);
    /* the F32 copy holds 4 bytes a weight; the quantized engine at most 8.5 bits */
    ck_assert_msg(q_bytes * 3 < rekv_engine_weight_bytes(f.e),
                  "quantized engine %zu bytes, F32 %zu", q_bytes, rekv_engine_weight_bytes(f.e));
    run_close(&f);
    ck_assert_int_eq(rows, rows_f);
    for (size_t i = 0; i < (size_t)rows * (size_t)f.vocab; i++)
        ck_assert_msg(memcmp(&lq[i], &lf[i], sizeof(float)) == 0,
                      "%s: row %zu logit %zu: %.9g, dequantized F32 %.9g", k_files[_i],
                      i / (size_t)f.vocab, i % (size_t)f.vocab, lq[i], lf[i]);
    free(lq);
    free(lf);
    tu_rmrf(dir);
    free(dir);
    json_decref(ref);
}
END_TEST

/* Prefill rows, decode steps and a batch of two sequences give a sequence the same bits. */
START_TEST(prefill_decode_batch_same_bits)
{
    json_t *ref;
    const char *path = shared_file(k_files[_i], &ref);
    if (path == NULL)
        return;
    run r;
    run_open(path, &r);
    int np, n2;
    int32_t *prompt = ids_of(json_object_get(gen_case(ref, 0), "prompt"), &np);
    int32_t *p2 = ids_of(json_object_get(gen_case(ref, 2), "prompt"), &n2);
    size_t V = (size_t)r.vocab;
    float *all = malloc((size_t)np * V * sizeof(float)), *one = malloc(V * sizeof(float));
    float *b1 = malloc(V * sizeof(float)), *b2 = malloc(V * sizeof(float));
    float *alone2 = malloc(V * sizeof(float));
    ck_assert(all && one && b1 && b2 && alone2);
    rekv_seq *s, *t;
    ck_assert_int_eq(rekv_seq_create(r.e, 64, &s, NULL), 0);
    forward(&r, s, prompt, np, 1, all);
    rekv_seq_free(s);
    ck_assert_int_eq(rekv_seq_create(r.e, 64, &s, NULL), 0);
    for (int i = 0; i < np; i++) { /* one token at a time: each row as in the prefill */
        forward(&r, s, &prompt[i], 1, 0, one);
        ck_assert_msg(memcmp(one, all + (size_t)i * V, V * sizeof(float)) == 0,
                      "%s: decode step %d differs from its prefill row", k_files[_i], i);
    }
    rekv_seq_free(s);
    ck_assert_int_eq(rekv_seq_create(r.e, 64, &t, NULL), 0);
    forward(&r, t, p2, n2, 0, alone2);
    rekv_seq_free(t);
    /* both prompts in one batch: each its own bits */
    ck_assert_int_eq(rekv_seq_create(r.e, 64, &s, NULL), 0);
    ck_assert_int_eq(rekv_seq_create(r.e, 64, &t, NULL), 0);
    rekv_batch_item it[2] = {{.seq = s, .tokens = prompt, .n_tokens = np, .logits = b1},
                             {.seq = t, .tokens = p2, .n_tokens = n2, .logits = b2}};
    rekv_err err = {0};
    ck_assert_msg(rekv_engine_forward(r.e, it, 2, &err) == 0, "%s", err.msg);
    ck_assert_mem_eq(b1, all + (size_t)(np - 1) * V, V * sizeof(float));
    ck_assert_mem_eq(b2, alone2, V * sizeof(float));
    rekv_seq_free(s);
    rekv_seq_free(t);
    free(all);
    free(one);
    free(b1);
    free(b2);
    free(alone2);
    free(prompt);
    free(p2);
    run_close(&r);
    json_decref(ref);
}
END_TEST

/* Free-running greedy ids follow llama.cpp's up to the first pick that is uncertain (a margin
 * within llama.cpp's own noise, README section 5, and no clear float64 pick agreeing). */
START_TEST(greedy_ids_past_the_gate)
{
    json_t *ref;
    const char *path = shared_file(k_files[_i], &ref);
    if (path == NULL)
        return;
    run r;
    run_open(path, &r);
    double gate =
        json_number_value(json_object_get(json_object_get(ref, "tolerance"), "llama_greedy_gate"));
    double gate64 =
        json_number_value(json_object_get(json_object_get(ref, "tolerance"), "f64_greedy_gate"));
    ck_assert(gate > 0 && gate64 > 0);
    float *logits = malloc((size_t)r.vocab * sizeof(float));
    int same = 0;
    for (size_t ci = 0; ci < 3; ci++) {
        json_t *c = gen_case(ref, ci);
        int np, ng;
        int32_t *prompt = ids_of(json_object_get(c, "prompt"), &np);
        int32_t *greedy = ids_of(json_object_get(c, "greedy"), &ng);
        rekv_seq *s;
        ck_assert_int_eq(rekv_seq_create(r.e, 64, &s, NULL), 0);
        forward(&r, s, prompt, np, 0, logits);
        for (int st = 0; st < ng; st++) {
            /* llama.cpp's pick is certain past its own noise (its margin over the gate) or where
             * the float64 pass, which rekv's fp32 tracks within 1e-5, picks it by a clear gap */
            json_t *f64 = json_array_get(json_object_get(c, "f64_top5"), (size_t)st);
            double gap = json_number_value(json_array_get(json_array_get(f64, 0), 1)) -
                         json_number_value(json_array_get(json_array_get(f64, 1), 1));
            int f64_pick = (int)json_integer_value(json_array_get(json_array_get(f64, 0), 0));
            double margin =
                json_number_value(json_array_get(json_object_get(c, "margin"), (size_t)st));
            if (!(margin > gate || (gap > gate64 && f64_pick == greedy[st])))
                break;
            int32_t pick = rekv_argmax(logits, r.vocab);
            ck_assert_msg(pick == greedy[st], "%s case %zu step %d: %d, llama.cpp %d", k_files[_i],
                          ci, st, pick, greedy[st]);
            same++;
            forward(&r, s, &pick, 1, 0, logits);
        }
        rekv_seq_free(s);
        free(prompt);
        free(greedy);
    }
    printf("  %s: %d of 48 greedy ids equal to llama.cpp's, up to the first uncertain pick\n",
           k_files[_i], same);
    /* llama-tiny-py's margins are wide: exact arithmetic reproduces every id (README) */
    if (strncmp(k_files[_i], "llama-tiny-py", 13) == 0)
        ck_assert_int_eq(same, 48);
    free(logits);
    run_close(&r);
    json_decref(ref);
}
END_TEST

/* The bytes of every tensor of the file, as GGUF stores them. */
static size_t file_tensor_bytes(const char *path, size_t *n_tensors)
{
    rekv_gguf *g;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(path, &g, &err) == 0, "%s", err.msg);
    size_t b = 0;
    for (size_t i = 0; i < g->n_tensors; i++)
        b += g->tensors[i].nbytes;
    *n_tensors = g->n_tensors;
    rekv_gguf_close(g);
    return b;
}

/* The bytes of the file's layer matrices (blk.N.*, two dims). */
static double file_layer_matrix_bytes(const char *path)
{
    rekv_gguf *g;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(path, &g, &err) == 0, "%s", err.msg);
    double b = 0;
    for (size_t i = 0; i < g->n_tensors; i++)
        if (strncmp(g->tensors[i].name, "blk.", 4) == 0 && g->tensors[i].n_dims == 2)
            b += (double)g->tensors[i].nbytes;
    rekv_gguf_close(g);
    return b;
}

/* The engine holds the file's blocks (its bytes within the 64-byte alignment of each tensor),
 * never a widened copy: Q8_0 about 0.53 of the F16 file's weight bytes, Q4_0 and Q4_K_M about
 * 0.3; and the planner prices an offloaded layer by those bytes. */
START_TEST(weights_held_and_priced_quantized)
{
    json_t *ref, *ref16;
    const char *path = shared_file(k_files[_i], &ref);
    if (path == NULL)
        return;
    char f16name[64];
    snprintf(f16name, sizeof(f16name), "%.*s-F16", (int)(strrchr(k_files[_i], '-') - k_files[_i]),
             k_files[_i]);
    const char *path16 = shared_file(f16name, &ref16);
    if (path16 == NULL)
        return;
    run q, h;
    run_open(path, &q);
    run_open(path16, &h);
    size_t nt, file_b = file_tensor_bytes(path, &nt), eb = rekv_engine_weight_bytes(q.e);
    ck_assert_msg(eb >= file_b && eb <= file_b + 64 * nt,
                  "%s: engine %zu bytes, file's tensors %zu", k_files[_i], eb, file_b);
    double ratio = (double)eb / (double)rekv_engine_weight_bytes(h.e);
    double want = strstr(k_files[_i], "Q8_0")   ? 34.0 / 64
                  : strstr(k_files[_i], "Q4_0") ? 18.0 / 64
                                                : 0;
    printf("  %s: %zu weight bytes, %.3f of the F16 file's\n", k_files[_i], eb, ratio);
    if (want > 0) /* the norms (F32) and a Q6_K output move it a little */
        ck_assert_msg(fabs(ratio - want) < 0.05, "%s: ratio %.3f, blocks alone %.3f", k_files[_i],
                      ratio, want);
    else
        ck_assert_msg(ratio < 0.36, "%s: ratio %.3f", k_files[_i], ratio);

    /* the planner: an offloaded layer's weights priced at the file's bytes for them (the
     * layers' matrices, summed from the GGUF's tensor table), as the local runs and the
     * profile see them */
    const rekv_model_config *c = &q.m->config;
    rekv_plan_model pm, pm16;
    rekv_plan_model_from_config(c, &pm);
    rekv_plan_model_from_config(&h.m->config, &pm16);
    ck_assert(pm.weight_elem_bytes == rekv_engine_weight_elem_bytes(q.e));
    ck_assert(pm16.weight_elem_bytes == 2.0);
    rekv_step_shape sh, sh16;
    rekv_plan_shape(&pm, 1, 256, 2.0, 1, &sh);
    rekv_plan_shape(&pm16, 1, 256, 2.0, 1, &sh16);
    double layer = file_layer_matrix_bytes(path) / c->n_layers;
    ck_assert_msg(fabs(sh.kv.weight_bytes - layer) <= 1e-9 * layer,
                  "priced %.0f bytes a layer, the file's layers hold %.0f", sh.kv.weight_bytes,
                  layer);
    ck_assert(sh16.kv.weight_bytes == 2.0 * rekv_config_layer_params(c));
    printf("  %s: an offloaded layer priced at %.0f bytes, %.3f of F16's %.0f\n", k_files[_i],
           sh.kv.weight_bytes, sh.kv.weight_bytes / sh16.kv.weight_bytes, sh16.kv.weight_bytes);
    run_close(&q);
    run_close(&h);
    json_decref(ref);
    json_decref(ref16);
}
END_TEST

/* The decode pipeline on the cpu backend with the file's weights quantized: every exact mode,
 * weights resident or offloaded, gives the reference engine's logits bit for bit (prefill and
 * three decode steps), and an offloaded decode step moves exactly the file's bytes for its layers
 * (blk.* tensors: quantized blocks and F32 norms) — what the planner prices. */
static const char *const k_pipe_files[] = {"synth-llama-Q4_K_M", "llama-tiny-py-Q4_0"};

START_TEST(pipeline_modes_same_bits)
{
    json_t *ref;
    const char *path = shared_file(k_pipe_files[_i], &ref);
    if (path == NULL)
        return;
    tu_fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, NULL);
    run r = {f.m, f.e, f.m->config.vocab};
    int rows;
    float *want = case0_logits(&r, ref, &rows);
    int np, ng;
    int32_t *prompt = ids_of(json_object_get(gen_case(ref, 0), "prompt"), &np);
    int32_t *greedy = ids_of(json_object_get(gen_case(ref, 0), "greedy"), &ng);
    size_t V = (size_t)r.vocab;
    double layer_bytes = 0; /* every blk.* tensor of the file */
    rekv_gguf *g;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(path, &g, &err) == 0, "%s", err.msg);
    for (size_t i = 0; i < g->n_tensors; i++)
        if (strncmp(g->tensors[i].name, "blk.", 4) == 0)
            layer_bytes += (double)g->tensors[i].nbytes;
    rekv_gguf_close(g);
    static const struct {
        rekv_mode mode;
        int offload_weights, split;
    } modes[] = {{REKV_MODE_RESIDENT, 0, 0}, {REKV_MODE_RESIDENT, 1, 0}, {REKV_MODE_OFFLOAD, 1, 0},
                 {REKV_MODE_KVPR, 1, 20},    {REKV_MODE_ACT, 0, 0},      {REKV_MODE_HYBRID, 1, 0}};
    float *got = malloc(V * sizeof(float));
    for (size_t mi = 0; mi < sizeof(modes) / sizeof(modes[0]); mi++) {
        rekv_pipeline_config cfg;
        rekv_pipeline_config_defaults(&cfg);
        cfg.mode = modes[mi].mode;
        cfg.offload_weights = modes[mi].offload_weights;
        cfg.split = modes[mi].split;
        cfg.kv_parts = cfg.act_parts = 1;
        rekv_pipeline *pl;
        ck_assert_msg(rekv_pipeline_create(f.e, f.be,
                                           cfg.mode == REKV_MODE_RESIDENT ? NULL : f.store, &cfg,
                                           &pl, &err) == 0,
                      "%s", err.msg);
        rekv_pseq *sq;
        ck_assert_msg(rekv_pseq_create(pl, np + 4, &sq, &err) == 0, "%s", err.msg);
        for (int st = 0; st < 4; st++) {
            rekv_pipe_item it = {.seq = sq,
                                 .tokens = st ? &greedy[st - 1] : prompt,
                                 .n_tokens = st ? 1 : np,
                                 .logits = got};
            if (st == 1)
                rekv_pipeline_counters_reset(pl);
            ck_assert_msg(rekv_pipeline_step(pl, &it, 1, &err) == 0, "%s", err.msg);
            const float *w = want + (size_t)(np - 1 + st) * V;
            ck_assert_msg(memcmp(got, w, V * sizeof(float)) == 0,
                          "%s, mode %d%s, step %d: logits differ from the engine's",
                          k_pipe_files[_i], (int)cfg.mode, cfg.offload_weights ? " offloaded" : "",
                          st);
        }
        rekv_layer_counters tot;
        rekv_pipeline_counters(pl, &tot);
        double moved = (double)tot.h2d_bytes[REKV_XFER_WEIGHTS] / 3; /* per decode step */
        ck_assert_msg(moved == (cfg.offload_weights ? layer_bytes : 0),
                      "mode %d: %.0f weight bytes a step, the file's layers %.0f", (int)cfg.mode,
                      moved, layer_bytes);
        rekv_pseq_free(sq);
        rekv_pipeline_free(pl);
    }
    /* infinigen widens W_Q by the engine's one dtype: refused, saying so */
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_INFINIGEN;
    rekv_pipeline *pl = NULL;
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &pl, &err), -ENOTSUP);
    ck_assert_msg(strstr(err.msg, "quantized") && strstr(err.msg, "infinigen"), "%s", err.msg);
    free(got);
    free(want);
    free(prompt);
    free(greedy);
    tu_fixture_close(&f);
    json_decref(ref);
}
END_TEST

Suite *gguf_quant_suite(void);
Suite *gguf_quant_suite(void)
{
    Suite *s = suite_create("gguf_quant");
    TCase *tc = tcase_create("quant");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, bits_of_fp32_dequantization, 0, N_FILES);
    tcase_add_loop_test(tc, prefill_decode_batch_same_bits, 0, N_FILES);
    tcase_add_loop_test(tc, greedy_ids_past_the_gate, 0, N_FILES);
    tcase_add_loop_test(tc, weights_held_and_priced_quantized, 0, N_FILES);
    tcase_add_loop_test(tc, pipeline_modes_same_bits, 0,
                        sizeof(k_pipe_files) / sizeof(k_pipe_files[0]));
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(gguf_quant_suite());
}
