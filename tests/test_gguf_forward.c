/* test_gguf_forward.c — GGUF models run end to end against llama.cpp's own outputs on them
 * (the ref.json files of ../shared/gguf, README section 5):
 * - teacher-forced: each case's prompt, then llama.cpp's greedy ids fed one at a time; at every
 *   step each of llama.cpp's top-5 logits within llama_top5_logit_abs, rekv's argmax equal to
 *   llama.cpp's pick wherever its margin exceeds llama_greedy_gate, and the exact tier (rekv's
 *   fp32 against the float64 forward pass on the same weights: f64_top5_logit_abs, and the argmax
 *   wherever the f64 top-1/top-2 gap exceeds f64_greedy_gate);
 * - the same for the quantized files (Q8_0, Q4_0, Q4_K_M with Q6_K), run with their weights
 *   kept quantized;
 * - the perplexity texts' first chunks scored by the README's protocol against chunk_nll_sum, for
 *   every file;
 * - F32 and BF16 GGUFs (the F16 file's matrices rewritten): the F32 copy gives the F16 file's
 *   logits bit for bit (both are the fp32 widening), and a BF16 file those of an F32 file holding
 *   the same bf16-rounded values;
 * - the CLI: `rekv generate --local --model FILE.gguf --prompt TEXT` tokenizes with the GGUF's
 *   tokenizer and reproduces llama.cpp's prompt ids and greedy ids. */
#define _GNU_SOURCE
#include "gpuworker/gpuworker.h"
#include "loader/gguf.h"
#include "tests/gguf_edit.h"
#include "tests/testutil.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const k_files[] = {"llama-tiny-py-F16", "synth-llama-F16"};
#define N_FILES (sizeof(k_files) / sizeof(k_files[0]))

typedef struct fixture {
    const char *path;
    json_t *ref;
    rekv_model *model;
    rekv_engine *eng;
    int vocab;
} fixture;

/* Opens ../shared/gguf/NAME.gguf as a model and an engine (0: the file is missing). */
static int fixture_open(const char *name, fixture *f)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "gguf/%s.gguf", name);
    f->path = tu_shared(rel);
    snprintf(rel, sizeof(rel), "gguf/%s.ref.json", name);
    const char *rpath = tu_shared(rel);
    if (f->path == NULL || rpath == NULL)
        return 0;
    f->ref = json_load_file(rpath, 0, NULL);
    ck_assert_ptr_nonnull(f->ref);
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(f->path, &f->model, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(f->model, &f->eng, &err) == 0, "%s", err.msg);
    f->vocab = f->model->config.vocab;
    return 1;
}

static void fixture_close(fixture *f)
{
    rekv_engine_free(f->eng);
    rekv_model_close(f->model);
    json_decref(f->ref);
}

static double tol(const fixture *f, const char *k)
{
    json_t *v = json_object_get(json_object_get(f->ref, "tolerance"), k);
    ck_assert_msg(json_is_number(v), "no tolerance %s", k);
    return json_number_value(v);
}

/* Feeds n tokens to seq and leaves the last token's logits in out. */
static void feed(fixture *f, rekv_seq *seq, const int32_t *ids, int n, float *out)
{
    rekv_batch_item it = {.seq = seq, .tokens = ids, .n_tokens = n, .logits = out};
    rekv_err err = {0};
    ck_assert_msg(rekv_engine_forward(f->eng, &it, 1, &err) == 0, "%s", err.msg);
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

/* One step's checks against llama.cpp's top5/margin/greedy and the f64 top5. */
static void check_step(const fixture *f, const float *logits, json_t *c, size_t step, double *worst,
                       double *worst64)
{
    double t_abs = tol(f, "llama_top5_logit_abs"), gate = tol(f, "llama_greedy_gate");
    double t64 = tol(f, "f64_top5_logit_abs"), gate64 = tol(f, "f64_greedy_gate");
    json_t *top5 = json_array_get(json_object_get(c, "top5"), step);
    json_t *f64 = json_array_get(json_object_get(c, "f64_top5"), step);
    for (size_t k = 0; k < json_array_size(top5); k++) {
        json_t *p = json_array_get(top5, k);
        int id = (int)json_integer_value(json_array_get(p, 0));
        double want = json_number_value(json_array_get(p, 1)), d = fabs(logits[id] - want);
        *worst = d > *worst ? d : *worst;
        ck_assert_msg(d <= t_abs, "step %zu: logit[%d] = %.6f, llama.cpp %.6f (tolerance %g)", step,
                      id, (double)logits[id], want, t_abs);
        p = json_array_get(f64, k);
        id = (int)json_integer_value(json_array_get(p, 0));
        want = json_number_value(json_array_get(p, 1));
        d = fabs(logits[id] - want);
        *worst64 = d > *worst64 ? d : *worst64;
        ck_assert_msg(d <= t64, "step %zu: logit[%d] = %.6f, float64 %.6f (tolerance %g)", step, id,
                      (double)logits[id], want, t64);
    }
    int pick = rekv_argmax(logits, f->vocab);
    double margin = json_number_value(json_array_get(json_object_get(c, "margin"), step));
    int greedy = (int)json_integer_value(json_array_get(json_object_get(c, "greedy"), step));
    if (margin > gate)
        ck_assert_msg(pick == greedy, "step %zu: argmax %d, llama.cpp %d (margin %.4f)", step, pick,
                      greedy, margin);
    double g1 = json_number_value(json_array_get(json_array_get(f64, 0), 1));
    double g2 = json_number_value(json_array_get(json_array_get(f64, 1), 1));
    if (g1 - g2 > gate64)
        ck_assert_int_eq(pick, json_integer_value(json_array_get(json_array_get(f64, 0), 0)));
}

/* The three cases teacher-forced through f's engine, every step checked (check_step). */
static void teacher_forced(fixture *f, const char *label)
{
    json_t *cases = json_object_get(json_object_get(f->ref, "generation"), "cases");
    ck_assert_uint_eq(json_array_size(cases), 3);
    float *logits = malloc((size_t)f->vocab * sizeof(float));
    double worst = 0, worst64 = 0;
    size_t steps = 0;
    for (size_t ci = 0; ci < json_array_size(cases); ci++) {
        json_t *c = json_array_get(cases, ci);
        int np, ng;
        int32_t *prompt = ids_of(json_object_get(c, "prompt"), &np);
        int32_t *greedy = ids_of(json_object_get(c, "greedy"), &ng);
        rekv_seq *seq;
        ck_assert_int_eq(rekv_seq_create(f->eng, 256, &seq, NULL), 0);
        feed(f, seq, prompt, np, logits);
        for (int s = 0; s < ng; s++) {
            check_step(f, logits, c, (size_t)s, &worst, &worst64);
            steps++;
            if (s + 1 < ng)
                feed(f, seq, &greedy[s], 1, logits);
        }
        rekv_seq_free(seq);
        free(prompt);
        free(greedy);
    }
    ck_assert_uint_eq(steps, 48);
    printf("  %s: 48 steps, max |top5 - llama.cpp| %.2e, max |top5 - float64| %.2e\n", label, worst,
           worst64);
    free(logits);
}

START_TEST(teacher_forced_top5)
{
    fixture f = {0};
    if (!fixture_open(k_files[_i], &f))
        return;
    teacher_forced(&f, k_files[_i]);
    fixture_close(&f);
}
END_TEST

/* The quantized files run as they are (the engine keeps their blocks and dequantizes inside its
 * GEMM, cpu_qgemm.c): within each file's llama.cpp tolerance (llama.cpp also rounds the
 * activations to 8 bits) and at the exact tier against the float64 pass on the same weights.
 * test_gguf_quant checks these are the bits of the files' fp32 dequantization. */
static const char *const k_quant_files[] = {"llama-tiny-py-Q8_0", "llama-tiny-py-Q4_0",
                                            "synth-llama-Q8_0", "synth-llama-Q4_K_M",
                                            "synth-llama-Q4_0"};
#define N_QUANT (sizeof(k_quant_files) / sizeof(k_quant_files[0]))

START_TEST(quantized_files)
{
    fixture f = {0};
    if (fixture_open(k_quant_files[_i], &f)) {
        ck_assert_uint_ne(f.model->weights.layers[0].wq->qtype, 0);
        teacher_forced(&f, k_quant_files[_i]);
        fixture_close(&f);
    }
}
END_TEST

/* The first chunks of both perplexity texts, scored as llama-perplexity does (README section 3):
 * tokens[128c .. 128c+127] with the first replaced by BOS, positions 64..126 scored. */
static void perplexity(const char *name)
{
    fixture f = {0};
    if (!fixture_open(name, &f))
        return;
    double t_chunk = tol(&f, "llama_chunk_mean_nll_abs"),
           t_chunk64 = tol(&f, "f64_chunk_mean_nll_abs");
    json_t *ppl = json_object_get(f.ref, "perplexity");
    float *logits = malloc((size_t)128 * (size_t)f.vocab * sizeof(float));
    ck_assert_ptr_nonnull(logits);
    for (size_t ti = 0; ti < json_array_size(ppl); ti++) {
        json_t *p = json_array_get(ppl, ti);
        int n;
        int32_t *tokens = ids_of(json_object_get(p, "tokens"), &n);
        for (int c = 0; c < 3; c++) { /* 3 chunks per text keep the case short */
            int32_t chunk[128];
            memcpy(chunk, tokens + 128 * c, sizeof(chunk));
            chunk[0] = f.model->config.bos_id;
            rekv_seq *seq;
            ck_assert_int_eq(rekv_seq_create(f.eng, 128, &seq, NULL), 0);
            rekv_batch_item it = {
                .seq = seq, .tokens = chunk, .n_tokens = 128, .all_logits = 1, .logits = logits};
            rekv_err err = {0};
            ck_assert_msg(rekv_engine_forward(f.eng, &it, 1, &err) == 0, "%s", err.msg);
            double nll = 0;
            for (int pos = 64; pos < 127; pos++) {
                const float *x = logits + (size_t)pos * (size_t)f.vocab;
                double mx = -INFINITY, sum = 0;
                for (int v = 0; v < f.vocab; v++)
                    mx = x[v] > mx ? x[v] : mx;
                for (int v = 0; v < f.vocab; v++)
                    sum += exp(x[v] - mx);
                nll -= x[tokens[128 * c + pos + 1]] - mx - log(sum);
            }
            double want =
                json_number_value(json_array_get(json_object_get(p, "chunk_nll_sum"), (size_t)c));
            double want64 = json_number_value(
                json_array_get(json_object_get(p, "f64_chunk_nll_sum"), (size_t)c));
            ck_assert_msg(fabs(nll / 63 - want / 63) <= t_chunk,
                          "chunk %d: mean NLL %.6f, llama.cpp %.6f", c, nll / 63, want / 63);
            ck_assert_msg(fabs(nll / 63 - want64 / 63) <= t_chunk64,
                          "chunk %d: mean NLL %.6f, float64 %.6f", c, nll / 63, want64 / 63);
            rekv_seq_free(seq);
        }
        free(tokens);
    }
    free(logits);
    fixture_close(&f);
}

START_TEST(perplexity_chunks)
{
    perplexity(k_files[_i]);
}
END_TEST

START_TEST(perplexity_chunks_quantized)
{
    perplexity(k_quant_files[_i]);
}
END_TEST

/* The CLI with a text prompt: the GGUF's tokenizer and weights together. */
START_TEST(cli_generate_from_text)
{
    fixture f = {0};
    if (!fixture_open(k_files[_i], &f))
        return;
    json_t *c = json_array_get(json_object_get(json_object_get(f.ref, "generation"), "cases"), 1);
    const char *text = "The old lighthouse keeper climbed the stairs every evening";
    ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(c, "prompt_source")), text));
    char cmd[8192], *out = NULL;
    snprintf(cmd, sizeof(cmd),
             "%s generate --local --model %s --prompt '%s' --max-new-tokens 16 --ignore-eos "
             "--json",
             tu_bin("rekv"), f.path, text);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "rc %d: %s", rc, tu_log_end(out ? out : ""));
    json_t *res = json_loads(out, 0, NULL);
    ck_assert_msg(res != NULL, "not JSON: %s", tu_log_end(out));
    json_t *prompt = json_object_get(res, "prompt_ids"), *want = json_object_get(c, "prompt");
    ck_assert_msg(json_equal(prompt, want), "prompt ids differ from llama.cpp's");
    json_t *gen = json_object_get(res, "generated_ids"), *greedy = json_object_get(c, "greedy");
    /* rekv computes at the exact tier (teacher_forced_top5), so its free-running ids follow
     * llama.cpp's up to the first step where the float64 top-1/top-2 gap is under that tier's
     * gate — for these files, all 16 */
    double gate64 = tol(&f, "f64_greedy_gate");
    size_t same = 0;
    for (size_t s = 0; s < json_array_size(greedy); s++) {
        json_t *f64 = json_array_get(json_object_get(c, "f64_top5"), s);
        if (json_number_value(json_array_get(json_array_get(f64, 0), 1)) -
                json_number_value(json_array_get(json_array_get(f64, 1), 1)) <=
            gate64)
            break;
        ck_assert_int_eq(json_integer_value(json_array_get(gen, s)),
                         json_integer_value(json_array_get(greedy, s)));
        same++;
    }
    ck_assert_uint_eq(same, 16);
    json_decref(res);
    free(out);
    fixture_close(&f);
}
END_TEST

/* The last-token logits of case 0's prompt from the model at path (malloc'd, [vocab]). */
static float *prompt_logits(const char *path, json_t *ref, rekv_dtype want_dtype)
{
    rekv_model *m;
    rekv_engine *e;
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(m->weights.layers[0].wq->dtype, want_dtype);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    json_t *c = json_array_get(json_object_get(json_object_get(ref, "generation"), "cases"), 0);
    int n;
    int32_t *prompt = ids_of(json_object_get(c, "prompt"), &n);
    float *logits = malloc((size_t)m->config.vocab * sizeof(float));
    rekv_seq *seq;
    ck_assert_int_eq(rekv_seq_create(e, 256, &seq, NULL), 0);
    rekv_batch_item it = {.seq = seq, .tokens = prompt, .n_tokens = n, .logits = logits};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    rekv_seq_free(seq);
    free(prompt);
    rekv_engine_free(e);
    rekv_model_close(m);
    return logits;
}

START_TEST(f32_and_bf16_files)
{
    fixture f = {0};
    if (!fixture_open(k_files[_i], &f))
        return;
    char *dir = tu_tmpdir();
    float *f16 = prompt_logits(f.path, f.ref, REKV_DTYPE_F16);
    float *f32 = prompt_logits(tg_rewrite(f.path, NULL, 0, TG_TO_F32, dir), f.ref, REKV_DTYPE_F32);
    ck_assert_mem_eq(f16, f32, (size_t)f.vocab * sizeof(float));
    float *bf = prompt_logits(tg_rewrite(f.path, NULL, 0, TG_TO_BF16, dir), f.ref, REKV_DTYPE_BF16);
    float *bf32 =
        prompt_logits(tg_rewrite(f.path, NULL, 0, TG_TO_F32_VIA_BF16, dir), f.ref, REKV_DTYPE_F32);
    ck_assert_mem_eq(bf, bf32, (size_t)f.vocab * sizeof(float));
    free(f16);
    free(f32);
    free(bf);
    free(bf32);
    tu_rmrf(dir);
    free(dir);
    fixture_close(&f);
}
END_TEST

Suite *gguf_forward_suite(void);
Suite *gguf_forward_suite(void)
{
    Suite *s = suite_create("gguf_forward");
    TCase *tc = tcase_create("f16");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, teacher_forced_top5, 0, N_FILES);
    tcase_add_loop_test(tc, quantized_files, 0, N_QUANT);
    tcase_add_loop_test(tc, perplexity_chunks, 0, N_FILES);
    tcase_add_loop_test(tc, perplexity_chunks_quantized, 0, N_QUANT);
    tcase_add_loop_test(tc, cli_generate_from_text, 0, N_FILES);
    tcase_add_loop_test(tc, f32_and_bf16_files, 0, N_FILES);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(gguf_forward_suite());
}
