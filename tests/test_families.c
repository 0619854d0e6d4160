/* test_families.c — the model families beyond Llama/Qwen2: Phi-3 (fused qkv_proj and
 * gate_up_proj split at load; LongRoPE) and the sliding window of Mistral and Phi-3, against the
 * independent numpy reference tests/rope_ref.py (frequency tables from HF's published LongRoPE
 * formula; a float64 forward with HF's window mask) and against the plain Llama the fused model
 * is made of (bit for bit). The window is checked in the reference forward, in the pipeline's
 * kernels in resident and the exact streaming modes, and refused by infinigen and clo. */
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

#define REF "/usr/bin/python3 tests/rope_ref.py"

static json_t *run_ref(const char *args)
{
    char *cmd = NULL, *out = NULL;
    ck_assert_int_gt(asprintf(&cmd, REF " %s", args), 0);
    int st = tu_run(cmd, &out);
    ck_assert_msg(st == 0, "%s: exit %d", cmd, st);
    json_error_t jerr;
    json_t *j = json_loads(out, 0, &jerr);
    ck_assert_msg(j != NULL, "%s: %s", cmd, jerr.text);
    free(cmd);
    free(out);
    return j;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/* A synthetic Llama-family model (2 layers, hidden 128, 4 heads over 2 KV heads, head_dim 32,
 * fp32, seed 7) with extra rekv-loader synth options, into dir/name. */
static void synth(const char *dir, const char *name, int max_pos, const char *opts)
{
    char *cmd = NULL;
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers 2 --hidden 128 --heads 4 "
                              "--kv-heads 2 --ffn 192 --vocab 256 --dtype f32 --seed 7 "
                              "--max-pos %d %s %s/%s >/dev/null",
                              tu_bin("rekv-loader"), max_pos, opts, dir, name),
                     0);
    tu_run_ok(cmd);
    free(cmd);
}

/* The engine's logits (rekv_engine_forward, one prompt at once) of T tokens of model dir/name. */
static float *engine_logits(const char *dir, const char *name, const int32_t *tok, int T,
                            rekv_model_config *cfg)
{
    char mdir[600];
    snprintf(mdir, sizeof(mdir), "%s/%s", dir, name);
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    if (cfg)
        *cfg = m->config;
    float *lg = malloc(sizeof(float) * (size_t)T * (size_t)m->config.vocab);
    rekv_seq *s;
    ck_assert_int_eq(rekv_seq_create(e, T, &s, &err), 0);
    rekv_batch_item it = {s, tok, T, 1, lg};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    rekv_seq_free(s);
    rekv_engine_free(e);
    rekv_model_close(m);
    return lg;
}

static int32_t *tokens(int T, int V)
{
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
    for (int i = 0; i < T; i++)
        tok[i] = (int32_t)((i * 97 + 13) % V);
    return tok;
}

/* The largest |engine - reference| over T x V logits of model dir/name. */
static double vs_reference(const char *dir, const char *name, int T)
{
    enum { V = 256 };
    int32_t *tok = tokens(T, V);
    float *lg = engine_logits(dir, name, tok, T, NULL);
    size_t cap = 700 + (size_t)T * 8;
    char *args = malloc(cap);
    size_t n = (size_t)snprintf(args, cap, "forward %s/%s", dir, name);
    for (int i = 0; i < T; i++)
        n += (size_t)snprintf(args + n, cap - n, " %d", tok[i]);
    json_t *ref = run_ref(args), *rl = json_object_get(ref, "logits");
    ck_assert_int_eq((int)json_array_size(rl), T);
    double worst = tu_max_abs_error(lg, rl, T, V, NULL);
    printf("   %-20s %d positions: max |logit error| %.3g\n", name, T, worst);
    json_decref(ref);
    free(args);
    free(lg);
    free(tok);
    return worst;
}

/* fp32 against float64, two layers, up to 160 positions: test_rope measures up to 7e-6; a wrong
 * factor table, attention factor or window moves logits by 0.01 to 1 */
#define LOGIT_TOL 1e-4

/* ---------------------------------------------------------------- LongRoPE's tables */

/* A Phi-3.5-mini-shaped config (head_dim 96: 48 pairs, original 4096 at the top level, 128K),
 * its factor lists of Phi-3's shape: short ones near 1, long ones rising to ~40. */
static void longrope_config(const char *path, const char *type, const char *extra)
{
    char sf[2048] = "", lf[2048] = "";
    size_t ns = 0, nl = 0;
    for (int j = 0; j < 48; j++) {
        double x = j / 47.0;
        ns += (size_t)snprintf(sf + ns, sizeof(sf) - ns, "%s%.6f", j ? "," : "", 1.0 + 0.08 * x);
        nl += (size_t)snprintf(lf + nl, sizeof(lf) - nl, "%s%.6f", j ? "," : "",
                               1.0 + 39.0 * x * x * x);
    }
    char text[8192];
    snprintf(text, sizeof(text),
             "{\"model_type\":\"phi3\",\"architectures\":[\"Phi3ForCausalLM\"],"
             "\"hidden_size\":3072,\"num_hidden_layers\":32,\"intermediate_size\":8192,"
             "\"num_attention_heads\":32,\"num_key_value_heads\":32,\"vocab_size\":32064,"
             "\"max_position_embeddings\":131072,\"original_max_position_embeddings\":4096,"
             "\"rope_theta\":10000.0,\"sliding_window\":262144,\"hidden_act\":\"silu\","
             "\"rope_scaling\":{\"type\":\"%s\",\"short_factor\":[%s],\"long_factor\":[%s]%s},"
             "\"bos_token_id\":1,\"eos_token_id\":32000}",
             type, sf, lf, extra);
    write_text(path, text);
}

static int ulps_apart(float a, double want)
{
    float w = (float)want;
    if (a == w)
        return 0;
    return (int)(fabs((double)a - want) / (nextafterf(fabsf(w), INFINITY) - fabsf(w)) + 0.5);
}

/* The short table below the original length, the long one from it, each pair within 2 ulp of the
 * reference, and the attention factor sqrt(1 + ln 32 / ln 4096) (or the config's). */
START_TEST(longrope_tables_match_reference)
{
    static const struct {
        const char *type, *extra;
    } cases[] = {{"longrope", ""}, {"su", ""}, {"longrope", ",\"attention_factor\":1.5"}};
    char *dir = tu_tmpdir(), path[512], args[1024];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        longrope_config(path, cases[ci].type, cases[ci].extra);
        rekv_model_config c;
        rekv_err err = {0};
        ck_assert_msg(rekv_config_load_hf(path, &c, &err) == 0, "%s", err.msg);
        ck_assert_int_eq(c.rope_scaling.type, REKV_ROPE_SCALING_LONGROPE);
        ck_assert_int_eq(c.max_pos, 131072);
        ck_assert_int_eq(c.sliding_window, 0); /* 262144 is past the context: no window */
        rekv_rope_freqs f;
        ck_assert_msg(rekv_rope_freqs_init(&f, &c, &err) == 0, "%s", err.msg);
        int pos[] = {0, 1, 4094, 4095, 4096, 4097, 100000, 131071};
        enum { NP = sizeof(pos) / sizeof(pos[0]) };
        snprintf(args, sizeof(args), "freqs %s %d %d %d %d %d %d %d %d", path, pos[0], pos[1],
                 pos[2], pos[3], pos[4], pos[5], pos[6], pos[7]);
        json_t *ref = run_ref(args);
        double att = json_number_value(json_object_get(ref, "attention_factor"));
        ck_assert_msg(fabs(f.attn_factor - att) <= 1e-6 * att,
                      "case %zu: attention factor %.9g, "
                      "reference %.9g",
                      ci, (double)f.attn_factor, att);
        if (ci < 2)
            ck_assert_msg(fabs(att - sqrt(1 + log(32.0) / log(4096.0))) < 1e-12, "%.9g", att);
        int worst = 0;
        for (int i = 0; i < NP; i++) {
            float got[REKV_ROPE_MAX_PAIRS];
            rekv_rope_freqs_at(&f, pos[i], got);
            json_t *row = json_array_get(json_object_get(ref, "inv_freq"), (size_t)i);
            ck_assert_int_eq((int)json_array_size(row), 48);
            for (int j = 0; j < 48; j++) {
                double want = json_number_value(json_array_get(row, (size_t)j));
                int u = ulps_apart(got[j], want);
                worst = u > worst ? u : worst;
                ck_assert_msg(u <= 2, "case %zu pos %d pair %d: %.9g, reference %.9g (%d ulp)", ci,
                              pos[i], j, (double)got[j], want, u);
            }
        }
        printf("   longrope case %zu: 48 pairs, worst %d ulp, attention factor %.6g\n", ci, worst,
               att);
        json_decref(ref);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- Phi-3 */

/* A synthetic Phi-3 holds the plain Llama's weights of the same seed in fused tensors: split at
 * load, its logits are the Llama's bit for bit (f32 and f16 weights). */
START_TEST(phi3_equals_unfused_llama)
{
    static const char *const dtypes[] = {"f32", "f16"};
    char *dir = tu_tmpdir(), opts[128];
    enum { T = 40, V = 256 };
    int32_t *tok = tokens(T, V);
    for (int d = 0; d < 2; d++) {
        snprintf(opts, sizeof(opts), "--dtype %s --phi3", dtypes[d]);
        synth(dir, "phi3", 64, opts);
        snprintf(opts, sizeof(opts), "--dtype %s", dtypes[d]);
        synth(dir, "llama", 64, opts);
        char p[600];
        snprintf(p, sizeof(p), "%s/phi3/config.json", dir);
        rekv_model_config c;
        rekv_err err = {0};
        ck_assert_msg(rekv_config_load_hf(p, &c, &err) == 0, "%s", err.msg);
        /* the file holds the fused names only */
        rekv_safetensors *st;
        snprintf(p, sizeof(p), "%s/phi3", dir);
        ck_assert_msg(rekv_safetensors_open(p, &st, &err) == 0, "%s", err.msg);
        ck_assert_ptr_nonnull(
            rekv_safetensors_find(st, "model.layers.1.self_attn.qkv_proj.weight"));
        ck_assert_ptr_nonnull(rekv_safetensors_find(st, "model.layers.1.mlp.gate_up_proj.weight"));
        ck_assert_ptr_null(rekv_safetensors_find(st, "model.layers.1.self_attn.q_proj.weight"));
        rekv_safetensors_close(st);
        float *a = engine_logits(dir, "phi3", tok, T, NULL);
        float *b = engine_logits(dir, "llama", tok, T, NULL);
        ck_assert_msg(memcmp(a, b, sizeof(float) * T * V) == 0,
                      "%s: Phi-3's logits differ from the plain Llama's", dtypes[d]);
        free(a);
        free(b);
        char rm[700];
        snprintf(rm, sizeof(rm), "rm -rf %s/phi3 %s/llama", dir, dir);
        tu_run_ok(rm);
    }
    free(tok);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* Phi-3 with LongRoPE (original 32 of 256) and Phi-3 with its window, past both: the reference's
 * float64 forward of the same file (its own split of the fused tensors). */
START_TEST(phi3_logits_match_reference)
{
    char *dir = tu_tmpdir();
    synth(dir, "phi3-longrope", 256,
          "--phi3 --rope-scaling longrope:original_max_position_embeddings=32");
    ck_assert_double_le(vs_reference(dir, "phi3-longrope", 120), LOGIT_TOL);
    synth(dir, "phi3-window", 256,
          "--phi3 --sliding-window 24 --rope-scaling longrope:original_max_position_embeddings=64");
    ck_assert_double_le(vs_reference(dir, "phi3-window", 100), LOGIT_TOL);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- the sliding window */

/* Mistral's window (W 16 of 64 positions) and Qwen2's (use_sliding_window on every layer): the
 * reference's window mask. */
START_TEST(window_logits_match_reference)
{
    char *dir = tu_tmpdir();
    synth(dir, "mistral-w16", 256, "--sliding-window 16");
    ck_assert_double_le(vs_reference(dir, "mistral-w16", 64), LOGIT_TOL);
    synth(dir, "qwen2-w9", 256, "--qwen2 --sliding-window 9");
    ck_assert_double_le(vs_reference(dir, "qwen2-w9", 40), LOGIT_TOL);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* A window no shorter than the context masks nothing: Mistral with W 100 over 60 positions gives
 * the plain Llama's logits bit for bit, while W 20 changes them. */
START_TEST(window_past_context_is_full_attention)
{
    char *dir = tu_tmpdir();
    enum { T = 60, V = 256 };
    int32_t *tok = tokens(T, V);
    synth(dir, "llama", 256, "");
    synth(dir, "w100", 256, "--sliding-window 100");
    synth(dir, "w20", 256, "--sliding-window 20");
    rekv_model_config c;
    float *a = engine_logits(dir, "llama", tok, T, NULL);
    float *b = engine_logits(dir, "w100", tok, T, &c);
    ck_assert_int_eq(c.sliding_window, 100);
    float *w = engine_logits(dir, "w20", tok, T, &c);
    ck_assert_int_eq(c.sliding_window, 20);
    ck_assert_msg(memcmp(a, b, sizeof(float) * T * V) == 0, "W 100 over 60 positions masked");
    ck_assert_msg(memcmp(a, w, sizeof(float) * 20 * V) == 0, "W 20 changed the first 20 rows");
    ck_assert_msg(memcmp(a + 20 * V, w + 20 * V, sizeof(float) * V) != 0,
                  "W 20 changed nothing at position 20");
    free(a);
    free(b);
    free(w);
    free(tok);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* The pipeline's kernels (cpu backend) in resident and the exact streaming modes (offload, with
 * and without a device-resident part, act, kvpr, hybrid: the KV fetched or recomputed whole, the
 * window a mask), a prompt of 50 in one chunk then decode steps, on a Phi-3 with a window of 12 and
 * LongRoPE past 32: forward.c's logits bit for bit at every step. */
START_TEST(pipeline_window_matches_forward)
{
    char *dir = tu_tmpdir(), mdir[600];
    synth(dir, "m", 128,
          "--phi3 --sliding-window 12 --rope-scaling longrope:original_max_position_embeddings=32");
    snprintf(mdir, sizeof(mdir), "%s/m", dir);
    tu_fixture f;
    tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
    enum { LEN = 50, STEPS = 6, V = 256 };
    int32_t prompt[LEN];
    for (int i = 0; i < LEN; i++)
        prompt[i] = (int32_t)((i * 53 + 3) % V);
    tu_pipeline_matches_forward(&f, "phi3 window 12", prompt, LEN, STEPS, V);
    /* infinigen's and clo's selections are not positions: refused, naming the mode */
    static const rekv_mode refused[] = {REKV_MODE_INFINIGEN, REKV_MODE_CLO};
    for (int i = 0; i < 2; i++) {
        rekv_err err = {0};
        rekv_pipeline_config cfg;
        rekv_pipeline_config_defaults(&cfg);
        cfg.mode = refused[i];
        rekv_pipeline *p = NULL;
        ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -ENOTSUP);
        ck_assert_msg(strstr(err.msg, rekv_mode_name(refused[i])) != NULL &&
                          strstr(err.msg, "sliding window") != NULL,
                      "%s", err.msg);
    }
    tu_fixture_close(&f);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* LongRoPE switches tables by position and the window masks by position, so how a sequence is
 * cut never matters: the prompt at once, a token at a time and two uneven chunks across the
 * original length and the window give the same bits. */
START_TEST(longrope_does_not_depend_on_chunking)
{
    char *dir = tu_tmpdir(), mdir[600];
    synth(dir, "m", 128,
          "--phi3 --sliding-window 10 --rope-scaling longrope:original_max_position_embeddings=16");
    snprintf(mdir, sizeof(mdir), "%s/m", dir);
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    enum { T = 60, V = 256 };
    int32_t *tok = tokens(T, V);
    tu_forward_cut_invariant(e, tok, T, V, 11);
    free(tok);
    rekv_engine_free(e);
    rekv_model_close(m);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- bad input */

START_TEST(bad_family_fields_name_the_field)
{
    static const struct {
        const char *fields; /* appended to a small Phi-3 / Qwen2 config */
        int code;
        const char *needle;
    } bad[] = {
        {"\"model_type\":\"phi3\",\"original_max_position_embeddings\":32,\"rope_scaling\":"
         "{\"type\":\"longrope\",\"short_factor\":[1,1,1],\"long_factor\":[1,1,1,1,1,1,1,1]}",
         -EINVAL, "\"rope_scaling.short_factor\" must be a list of 8"},
        {"\"model_type\":\"phi3\",\"original_max_position_embeddings\":32,\"rope_scaling\":"
         "{\"type\":\"longrope\",\"short_factor\":[1,1,1,1,1,1,1,1]}",
         -EINVAL, "\"rope_scaling.long_factor\" is missing"},
        {"\"model_type\":\"phi3\",\"original_max_position_embeddings\":32,\"rope_scaling\":"
         "{\"type\":\"longrope\",\"short_factor\":[1,1,1,1,1,1,1,1],"
         "\"long_factor\":[1,1,1,0,1,1,1,1]}",
         -EINVAL, "\"rope_scaling.long_factor\"[3]"},
        {"\"model_type\":\"phi3\",\"original_max_position_embeddings\":0,\"rope_scaling\":"
         "{\"type\":\"longrope\",\"short_factor\":[1,1,1,1,1,1,1,1],"
         "\"long_factor\":[1,1,1,1,1,1,1,1]}",
         -EINVAL, "\"original_max_position_embeddings\" = 0"},
        {"\"model_type\":\"phi3\",\"partial_rotary_factor\":0.75", -ENOTSUP,
         "\"partial_rotary_factor\""},
        {"\"model_type\":\"qwen2\",\"use_sliding_window\":true,\"sliding_window\":16,"
         "\"max_window_layers\":1",
         -ENOTSUP, "1 of 2 layers full"},
        {"\"model_type\":\"mistral\",\"sliding_window\":16,\"layer_types\":[\"full_attention\","
         "\"sliding_attention\"]",
         -ENOTSUP, "1 of 2 layers full"},
        {"\"model_type\":\"mistral\",\"sliding_window\":16,\"layer_types\":[\"full_attention\"]",
         -EINVAL, "\"layer_types\" must be a list of 2"},
        {"\"model_type\":\"mistral\",\"sliding_window\":-4", -EINVAL, "\"sliding_window\""},
    };
    char *dir = tu_tmpdir(), path[512], text[2048];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(text, sizeof(text),
                 "{\"hidden_size\":64,\"num_hidden_layers\":2,\"intermediate_size\":96,"
                 "\"num_attention_heads\":4,\"vocab_size\":100,\"max_position_embeddings\":128,%s}",
                 bad[i].fields);
        write_text(path, text);
        rekv_model_config c;
        rekv_err err = {0};
        int rc = rekv_config_load_hf(path, &c, &err);
        ck_assert_msg(rc == bad[i].code, "case %zu: rc %d, want %d (%s)", i, rc, bad[i].code,
                      err.msg);
        ck_assert_msg(strstr(err.msg, bad[i].needle) != NULL && strstr(err.msg, path) != NULL,
                      "case %zu: \"%s\" does not name %s", i, err.msg, bad[i].needle);
    }
    /* HF's Llama has no window: a llama config's sliding_window is not one */
    write_text(path, "{\"model_type\":\"llama\",\"hidden_size\":64,\"num_hidden_layers\":2,"
                     "\"intermediate_size\":96,\"num_attention_heads\":4,\"vocab_size\":100,"
                     "\"max_position_embeddings\":128,\"sliding_window\":16}");
    rekv_model_config c;
    ck_assert_int_eq(rekv_config_load_hf(path, &c, NULL), 0);
    ck_assert_int_eq(c.sliding_window, 0);
    ck_assert_int_eq(c.max_pos, 128);
    /* Qwen2's per-layer list windowing every layer: a window */
    write_text(path, "{\"model_type\":\"qwen2\",\"hidden_size\":64,\"num_hidden_layers\":2,"
                     "\"intermediate_size\":96,\"num_attention_heads\":4,\"vocab_size\":100,"
                     "\"max_position_embeddings\":128,\"sliding_window\":16,"
                     "\"use_sliding_window\":true,\"layer_types\":[\"sliding_attention\","
                     "\"sliding_attention\"]}");
    ck_assert_int_eq(rekv_config_load_hf(path, &c, NULL), 0);
    ck_assert_int_eq(c.sliding_window, 16);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("families");
    TCase *tc = tcase_create("families");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, longrope_tables_match_reference);
    tcase_add_test(tc, phi3_equals_unfused_llama);
    tcase_add_test(tc, phi3_logits_match_reference);
    tcase_add_test(tc, window_logits_match_reference);
    tcase_add_test(tc, window_past_context_is_full_attention);
    tcase_add_test(tc, pipeline_window_matches_forward);
    tcase_add_test(tc, longrope_does_not_depend_on_chunking);
    tcase_add_test(tc, bad_family_fields_name_the_field);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
