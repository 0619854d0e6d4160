/* test_gemma.c — Gemma and Gemma-2: synthetic models (rekv-loader synth --gemma / --gemma2) against
 * the independent float64 reference tests/gemma_ref.py (HF's published formulas: scaled
 * embeddings, (1 + w) norms, GeGLU with the tanh GELU, Gemma-2's four norms per layer,
 * query_pre_attn_scalar, soft-capped scores and logits, the window on the even layers); the
 * pipeline's kernels in resident and the exact streaming modes, infinigen at its exact limit and
 * resident steps replayed as graphs, against forward.c bit for bit; chunking; bad config fields. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/gpuworker.h"
#include "gpuworker/pipeline.h"
#include "loader/loader.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

#define REF "/usr/bin/python3 tests/gemma_ref.py"
enum { V = 256 };

/* fp32 against float64 over two or three layers: a wrong scale, cap, norm or window moves the
 * logits by 1e-3 to 1 (test_families' bound for the same sizes) */
#define LOGIT_TOL 1e-4

/* A synthetic Gemma-family model (hidden 128, 4 heads over 2 KV heads, head_dim 48 so that
 * n_heads * head_dim != hidden, fp32, seed 7) with extra synth options, into dir/name. */
static void synth(const char *dir, const char *name, int layers, const char *opts)
{
    char *cmd = NULL;
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers %d --hidden 128 --heads 4 "
                              "--kv-heads 2 --head-dim 48 --ffn 192 --vocab %d --dtype f32 "
                              "--seed 7 --max-pos 128 %s %s/%s >/dev/null",
                              tu_bin("rekv-loader"), layers, V, opts, dir, name),
                     0);
    tu_run_ok(cmd);
    free(cmd);
}

/* Sets config.json's key to a JSON value. */
static void set_field(const char *dir, const char *name, const char *key, const char *value)
{
    char path[700];
    snprintf(path, sizeof(path), "%s/%s/config.json", dir, name);
    json_error_t jerr;
    json_t *c = json_load_file(path, 0, &jerr);
    ck_assert_msg(c != NULL, "%s", jerr.text);
    ck_assert_int_eq(json_object_set_new(c, key, json_loads(value, JSON_DECODE_ANY, NULL)), 0);
    ck_assert_int_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);
}

static int32_t *tokens(int T)
{
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
    for (int i = 0; i < T; i++)
        tok[i] = (int32_t)((i * 97 + 13) % V);
    return tok;
}

/* rekv_engine_forward's logits of T tokens, the prompt at once. */
static float *engine_logits(const char *mdir, const int32_t *tok, int T, rekv_model_config *cfg)
{
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    if (cfg)
        *cfg = m->config;
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    rekv_seq *s;
    ck_assert_int_eq(rekv_seq_create(e, T, &s, &err), 0);
    rekv_batch_item it = {s, tok, T, 1, lg};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    rekv_seq_free(s);
    rekv_engine_free(e);
    rekv_model_close(m);
    return lg;
}

/* The largest |engine - reference| over T x V logits of model dir/name. */
static double vs_reference(const char *dir, const char *name, int T)
{
    char mdir[600];
    snprintf(mdir, sizeof(mdir), "%s/%s", dir, name);
    int32_t *tok = tokens(T);
    float *lg = engine_logits(mdir, tok, T, NULL);
    size_t cap = 700 + (size_t)T * 8, n;
    char *cmd = malloc(cap), *out = NULL;
    n = (size_t)snprintf(cmd, cap, REF " forward %s", mdir);
    for (int i = 0; i < T; i++)
        n += (size_t)snprintf(cmd + n, cap - n, " %d", tok[i]);
    int st = tu_run(cmd, &out);
    ck_assert_msg(st == 0, "%s: exit %d", cmd, st);
    json_error_t jerr;
    json_t *ref = json_loads(out, 0, &jerr), *rl = json_object_get(ref, "logits");
    ck_assert_msg(ref != NULL, "%s", jerr.text);
    ck_assert_int_eq((int)json_array_size(rl), T);
    double worst = tu_max_abs_error(lg, rl, T, V, NULL);
    printf("   %-24s %d positions: max |logit error| %.3g\n", name, T, worst);
    json_decref(ref);
    free(out);
    free(cmd);
    free(lg);
    free(tok);
    return worst;
}

/* ---------------------------------------------------------------- against the reference */

/* Gemma (3 layers), and Gemma-2 with its window of 12 on layers 0 and 2 over 40 positions, at
 * HF's caps (50, 30) and at caps that bite (attention 0.5, logits 3): the reference's logits. */
START_TEST(gemma_logits_match_reference)
{
    char *dir = tu_tmpdir();
    synth(dir, "gemma", 3, "--gemma");
    ck_assert_double_le(vs_reference(dir, "gemma", 40), LOGIT_TOL);
    synth(dir, "gemma2", 3, "--gemma2 --sliding-window 12");
    ck_assert_double_le(vs_reference(dir, "gemma2", 40), LOGIT_TOL);
    synth(dir, "gemma2-caps", 3, "--gemma2 --sliding-window 12");
    set_field(dir, "gemma2-caps", "attn_logit_softcapping", "0.5");
    set_field(dir, "gemma2-caps", "final_logit_softcapping", "3.0");
    ck_assert_double_le(vs_reference(dir, "gemma2-caps", 40), LOGIT_TOL);
    /* null caps: none (HF reads None), and the window on every even layer */
    set_field(dir, "gemma2-caps", "attn_logit_softcapping", "null");
    set_field(dir, "gemma2-caps", "final_logit_softcapping", "null");
    ck_assert_double_le(vs_reference(dir, "gemma2-caps", 40), LOGIT_TOL);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* The config: Gemma-2's fields as HF's Gemma2Config reads them, and the window only on the even
 * layers: Gemma-2's layer 1 attends in full, layer 0 only the last 12. */
START_TEST(gemma2_config_fields)
{
    char *dir = tu_tmpdir(), path[600];
    synth(dir, "g", 2, "--gemma2 --sliding-window 12");
    snprintf(path, sizeof(path), "%s/g/config.json", dir);
    rekv_model_config c;
    rekv_err err = {0};
    ck_assert_msg(rekv_config_load_hf(path, &c, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(c.act, REKV_ACT_GELU_TANH);
    ck_assert(rekv_config_gated(&c));
    ck_assert_int_eq(c.head_dim, 48);
    ck_assert_int_eq(c.tied_head, 1);
    ck_assert(c.norm_add_one && c.post_norms);
    ck_assert_float_eq(c.embed_scale, sqrtf(128.0f));
    ck_assert_float_eq(c.attn_scale, (float)(1.0 / sqrt(32.0)));
    ck_assert_float_eq(c.attn_softcap, 50.0f);
    ck_assert_float_eq(c.final_softcap, 30.0f);
    ck_assert_int_eq(rekv_config_window(&c, 0), 12);
    ck_assert_int_eq(rekv_config_window(&c, 1), 0);
    /* a null window is HF's None: none on any layer */
    set_field(dir, "g", "sliding_window", "null");
    ck_assert_msg(rekv_config_load_hf(path, &c, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_config_window(&c, 0), 0);
    ck_assert_int_eq(c.window_even_layers, 0);
    /* bf16: HF's normalizer sqrt(3072) = 55.43 is 55.5 in the model's dtype */
    set_field(dir, "g", "hidden_size", "3072");
    set_field(dir, "g", "torch_dtype", "\"bfloat16\"");
    ck_assert_msg(rekv_config_load_hf(path, &c, &err) == 0, "%s", err.msg);
    ck_assert_float_eq(c.embed_scale, 55.5f);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- the pipeline */

/* The exact modes against forward.c (tu_pipeline_matches_forward) on f's model: a prompt of 30,
 * then 5 decode steps. */
static void modes_match_forward(tu_fixture *f, const char *name)
{
    enum { LEN = 30, STEPS = 5 };
    int32_t prompt[LEN];
    for (int i = 0; i < LEN; i++)
        prompt[i] = (int32_t)((i * 53 + 3) % V);
    tu_pipeline_matches_forward(f, name, prompt, LEN, STEPS, V);
}

/* Every exact mode on Gemma-2 with a window of 8 on its even layers and caps that bite (f32 and
 * f16 weights) and on Gemma (f16); infinigen and clo cannot honour the window: refused. */
START_TEST(pipeline_gemma_matches_forward)
{
    static const struct {
        const char *name, *opts;
    } models[] = {{"gemma2", "--gemma2 --sliding-window 8"},
                  {"gemma2-f16", "--gemma2 --sliding-window 8 --dtype f16"},
                  {"gemma-f16", "--gemma --dtype f16"}};
    char *dir = tu_tmpdir(), mdir[600];
    for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
        synth(dir, models[i].name, 3, models[i].opts);
        if (strstr(models[i].opts, "--gemma2")) {
            set_field(dir, models[i].name, "attn_logit_softcapping", "0.5");
            set_field(dir, models[i].name, "final_logit_softcapping", "3.0");
        }
        snprintf(mdir, sizeof(mdir), "%s/%s", dir, models[i].name);
        tu_fixture f;
        tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
        modes_match_forward(&f, models[i].name);
        static const rekv_mode refused[] = {REKV_MODE_INFINIGEN, REKV_MODE_CLO};
        for (int r = 0; r < 2 && f.m->config.sliding_window > 0; r++) {
            rekv_err err = {0};
            rekv_pipeline_config cfg;
            rekv_pipeline_config_defaults(&cfg);
            cfg.mode = refused[r];
            rekv_pipeline *p = NULL;
            ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -ENOTSUP);
            ck_assert_msg(strstr(err.msg, "sliding window") != NULL, "%s", err.msg);
        }
        tu_fixture_close(&f);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* A pipeline's logits over a prompt then greedy decode steps (forward.c's tokens fed back). */
static void pipe_logits(tu_fixture *f, const rekv_pipeline_config *cfg, const int32_t *prompt,
                        int len, int steps, float *out)
{
    rekv_err err = {0};
    rekv_pipeline *p;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be,
                                       cfg->mode == REKV_MODE_RESIDENT ? NULL : f->store, cfg, &p,
                                       &err) == 0,
                  "%s: %s", rekv_mode_name(cfg->mode), err.msg);
    rekv_pseq *ps;
    ck_assert_msg(rekv_pseq_create(p, len + steps, &ps, &err) == 0, "%s", err.msg);
    int32_t next = 0;
    for (int step = 0; step <= steps; step++) {
        rekv_pipe_item pi = {.seq = ps,
                             .tokens = step == 0 ? prompt : &next,
                             .n_tokens = step == 0 ? len : 1,
                             .logits = out + (size_t)step * V};
        ck_assert_msg(rekv_pipeline_step(p, &pi, 1, &err) == 0, "%s", err.msg);
        next = rekv_argmax(out + (size_t)step * V, V);
    }
    rekv_pseq_free(ps);
    rekv_pipeline_free(p);
}

/* Without a window in reach (sliding_window past the context), infinigen takes Gemma-2 too: at
 * its exact limit (every token selected) its logits are forward.c's bit for bit, the scale and
 * the soft-cap applied to the selected rows as to the whole cache. */
START_TEST(infinigen_exact_limit_gemma2)
{
    char *dir = tu_tmpdir(), mdir[600];
    synth(dir, "m", 2, "--gemma2");
    set_field(dir, "m", "attn_logit_softcapping", "0.5");
    set_field(dir, "m", "final_logit_softcapping", "3.0");
    snprintf(mdir, sizeof(mdir), "%s/m", dir);
    tu_fixture f;
    tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
    ck_assert_int_eq(f.m->config.sliding_window, 0); /* 4096 past 128 positions: none */
    rekv_skew sk;
    tu_skew_calibrate(&f, &sk);
    enum { LEN = 40, STEPS = 4 };
    int32_t prompt[LEN];
    for (int i = 0; i < LEN; i++)
        prompt[i] = (int32_t)((i * 31 + 5) % V);
    static float ref[(STEPS + 1) * V], got[(STEPS + 1) * V];
    rekv_err err = {0};
    rekv_seq *s;
    ck_assert_int_eq(rekv_seq_create(f.e, LEN + STEPS, &s, &err), 0);
    int32_t next = 0;
    for (int step = 0; step <= STEPS; step++) { /* forward.c's, as the pipeline feeds back */
        rekv_batch_item it = {s, step == 0 ? prompt : &next, step == 0 ? LEN : 1, 0,
                              ref + (size_t)step * V};
        ck_assert_msg(rekv_engine_forward(f.e, &it, 1, &err) == 0, "%s", err.msg);
        next = rekv_argmax(ref + (size_t)step * V, V);
    }
    rekv_seq_free(s);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_INFINIGEN;
    cfg.skew = &sk;
    cfg.select = REKV_SELECT_ALL;
    pipe_logits(&f, &cfg, prompt, LEN, STEPS, got);
    ck_assert_msg(memcmp(ref, got, sizeof(ref)) == 0, "infinigen's logits differ from forward.c's");
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* Resident decode steps that take only draws back run as recorded graphs (pipeline_graph.c): the
 * recording replays Gemma's scale and softcap kernels, so a graphed run draws the same tokens with
 * the same log-probabilities (the soft-capped logits') as a run that takes its logits back and is
 * never graphed. */
START_TEST(graphed_steps_keep_gemma_ops)
{
    char *dir = tu_tmpdir(), mdir[600];
    synth(dir, "m", 2, "--gemma2 --sliding-window 8");
    set_field(dir, "m", "final_logit_softcapping", "3.0");
    snprintf(mdir, sizeof(mdir), "%s/m", dir);
    tu_fixture f;
    tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
    enum { LEN = 12, STEPS = 8 };
    int32_t prompt[LEN], tok[2][STEPS + 1];
    float lp[2][STEPS + 1], logits[V];
    uint64_t graphed[2];
    for (int i = 0; i < LEN; i++)
        prompt[i] = (int32_t)((i * 41 + 7) % V);
    for (int r = 0; r < 2; r++) { /* run 0: logits too (never graphed); run 1: draws only */
        rekv_err err = {0};
        rekv_pipeline_config cfg;
        rekv_pipeline_config_defaults(&cfg);
        rekv_pipeline *p;
        ck_assert_msg(rekv_pipeline_create(f.e, f.be, NULL, &cfg, &p, &err) == 0, "%s", err.msg);
        rekv_pseq *ps;
        ck_assert_msg(rekv_pseq_create(p, LEN + STEPS + 1, &ps, &err) == 0, "%s", err.msg);
        rekv_sampler greedy;
        rekv_sampler_init(&greedy, 0, 0, 1, 0);
        for (int step = 0; step <= STEPS; step++) {
            rekv_pipe_item it = {.seq = ps,
                                 .tokens = step ? &tok[r][step - 1] : prompt,
                                 .n_tokens = step ? 1 : LEN,
                                 .logits = r == 0 ? logits : NULL,
                                 .smp = &greedy,
                                 .token = &tok[r][step],
                                 .logprob = &lp[r][step]};
            ck_assert_msg(rekv_pipeline_step(p, &it, 1, &err) == 0, "%s", err.msg);
        }
        graphed[r] = rekv_pipeline_graph_steps(p, NULL);
        rekv_pseq_free(ps);
        rekv_pipeline_free(p);
    }
    ck_assert_uint_eq(graphed[0], 0);
    ck_assert_uint_gt(graphed[1], 0);
    for (int step = 0; step <= STEPS; step++) {
        ck_assert_int_eq(tok[1][step], tok[0][step]);
        ck_assert_msg(memcmp(&lp[1][step], &lp[0][step], sizeof(float)) == 0,
                      "step %d: log-probability %.9g graphed, %.9g not", step, (double)lp[1][step],
                      (double)lp[0][step]);
    }
    tu_fixture_close(&f);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* The window masks by position and nothing else depends on the cut: the prompt at once, a token
 * at a time and two uneven chunks across the window give Gemma-2 the same bits. */
START_TEST(gemma2_does_not_depend_on_chunking)
{
    char *dir = tu_tmpdir(), mdir[600];
    synth(dir, "m", 2, "--gemma2 --sliding-window 10");
    snprintf(mdir, sizeof(mdir), "%s/m", dir);
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    enum { T = 40 };
    int32_t *tok = tokens(T);
    tu_forward_cut_invariant(e, tok, T, V, 11);
    free(tok);
    rekv_engine_free(e);
    rekv_model_close(m);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- bad input */

START_TEST(bad_gemma_fields_name_the_field)
{
    static const struct {
        const char *fields; /* appended to a small Gemma config */
        int code;
        const char *needle;
    } bad[] = {
        {"\"model_type\":\"gemma\",\"hidden_activation\":\"gelu\"", -ENOTSUP,
         "hidden_activation \"gelu\""},
        {"\"model_type\":\"gemma\",\"hidden_activation\":3", -EINVAL, "\"hidden_activation\""},
        {"\"model_type\":\"gemma2\",\"attn_logit_softcapping\":\"50\"", -EINVAL,
         "\"attn_logit_softcapping\""},
        {"\"model_type\":\"gemma2\",\"final_logit_softcapping\":-1", -EINVAL,
         "\"final_logit_softcapping\""},
        {"\"model_type\":\"gemma2\",\"query_pre_attn_scalar\":0", -EINVAL,
         "\"query_pre_attn_scalar\""},
        {"\"model_type\":\"gemma2\",\"sliding_window\":0", -EINVAL, "\"sliding_window\""},
        {"\"model_type\":\"gemma2\",\"layer_types\":[\"full_attention\",\"sliding_attention\"]",
         -ENOTSUP, "\"layer_types\"[0]"},
        {"\"model_type\":\"gemma2\",\"layer_types\":[\"sliding_attention\"]", -EINVAL,
         "\"layer_types\" must be a list of 2"},
    };
    char *dir = tu_tmpdir(), path[512], text[2048];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(text, sizeof(text),
                 "{\"hidden_size\":64,\"num_hidden_layers\":2,\"intermediate_size\":96,"
                 "\"num_attention_heads\":4,\"head_dim\":16,\"vocab_size\":100,"
                 "\"max_position_embeddings\":128,%s}",
                 bad[i].fields);
        FILE *fp = fopen(path, "w");
        ck_assert_ptr_nonnull(fp);
        fputs(text, fp);
        ck_assert_int_eq(fclose(fp), 0);
        rekv_model_config c;
        rekv_err err = {0};
        int rc = rekv_config_load_hf(path, &c, &err);
        ck_assert_msg(rc == bad[i].code, "case %zu: rc %d, want %d (%s)", i, rc, bad[i].code,
                      err.msg);
        ck_assert_msg(strstr(err.msg, bad[i].needle) != NULL && strstr(err.msg, path) != NULL,
                      "case %zu: \"%s\" does not name %s", i, err.msg, bad[i].needle);
    }
    /* synth refuses what no checkpoint has */
    char *cmd = NULL, *out = NULL;
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --ffn 96 "
                              "--vocab 100 --gemma --sliding-window 8 %s/x 2>&1",
                              tu_bin("rekv-loader"), dir),
                     0);
    ck_assert_int_ne(tu_run(cmd, &out), 0);
    ck_assert_msg(strstr(out, "Gemma has no window") != NULL, "%s", out);
    free(out);
    free(cmd);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("gemma");
    TCase *tc = tcase_create("gemma");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, gemma_logits_match_reference);
    tcase_add_test(tc, gemma2_config_fields);
    tcase_add_test(tc, pipeline_gemma_matches_forward);
    tcase_add_test(tc, infinigen_exact_limit_gemma2);
    tcase_add_test(tc, graphed_steps_keep_gemma_ops);
    tcase_add_test(tc, gemma2_does_not_depend_on_chunking);
    tcase_add_test(tc, bad_gemma_fields_name_the_field);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
