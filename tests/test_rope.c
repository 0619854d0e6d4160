/* test_rope.c — RoPE scaling (linear, dynamic NTK, llama3, YaRN) and today's Llama-family configs
 * against an independent numpy reference, tests/rope_ref.py, written from HF's published formulas:
 * the frequency tables of real-shaped configs, and the logits of synthetic models of each kind at
 * positions well past the original context. Plain RoPE must keep the bits it had before the table
 * existed; dynamic NTK must not depend on how a sequence is cut; bad rope_scaling fields get one
 * error naming the field. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/cpu_ops.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/pipeline.h"
#include "loader/loader.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

#define REF "/usr/bin/python3 tests/rope_ref.py"

/* Runs the reference; its stdout as JSON. */
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

/* ---------------------------------------------------------------- plain RoPE keeps its bits */

/* The table's plain RoPE gives exactly the angles, cos and sin of the expression the kernels used
 * before the table (kept here verbatim as the oracle). */
START_TEST(plain_rope_keeps_bits)
{
    static const int dims[] = {2, 16, 64, 128, 512};
    static const float thetas[] = {10000.0f, 500000.0f, 1000000.0f};
    static const int pos[] = {0, 1, 7, 1000, 4095, 8191, 131071};
    enum { M = sizeof(pos) / sizeof(pos[0]) };
    for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
        for (size_t ti = 0; ti < sizeof(thetas) / sizeof(thetas[0]); ti++) {
            int d = dims[di], half = d / 2;
            rekv_model_config c = {.head_dim = d, .rope_theta = thetas[ti]};
            rekv_rope_freqs f;
            ck_assert_int_eq(rekv_rope_freqs_init(&f, &c, NULL), 0);
            float cs[M * 256], sn[M * 256];
            cpu_rope_table(cs, sn, pos, M, &f);
            for (int j = 0; j < half; j++) {
                float inv_freq = 1.0f / powf(thetas[ti], (float)(2 * j) / (float)d);
                for (int i = 0; i < M; i++) {
                    float a = (float)pos[i] * inv_freq, wc = cosf(a), ws = sinf(a);
                    ck_assert_msg(memcmp(&wc, &cs[i * half + j], 4) == 0 &&
                                      memcmp(&ws, &sn[i * half + j], 4) == 0,
                                  "d %d theta %g pos %d pair %d: %a/%a, was %a/%a", d,
                                  (double)thetas[ti], pos[i], j, (double)cs[i * half + j],
                                  (double)sn[i * half + j], (double)wc, (double)ws);
                }
            }
        }
}
END_TEST

/* Per-pair divisors (GGUF's rope_freqs.weight, llama.cpp's form of Llama 3.1's scaling) divide
 * plain RoPE's frequencies, pair by pair. */
START_TEST(factors_divide_plain)
{
    rekv_model_config c = {.head_dim = 64, .rope_theta = 500000.0f};
    rekv_rope_freqs plain, f;
    ck_assert_int_eq(rekv_rope_freqs_init(&plain, &c, NULL), 0);
    c.rope_scaling.type = REKV_ROPE_SCALING_FACTORS;
    for (int j = 0; j < 32; j++)
        c.rope_scaling.freq_factors[j] = j < 8 ? 1.0f : j < 24 ? 1.0f + (float)j / 4 : 8.0f;
    ck_assert_int_eq(rekv_rope_freqs_init(&f, &c, NULL), 0);
    for (int j = 0; j < 32; j++)
        ck_assert_float_eq(f.inv_freq[j], plain.inv_freq[j] / c.rope_scaling.freq_factors[j]);
    ck_assert_float_eq(f.attn_factor, 1.0f);
    c.rope_scaling.freq_factors[5] = 0;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_rope_freqs_init(&f, &c, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "freq_factors[5]") != NULL, "%s", err.msg);
}
END_TEST

/* ---------------------------------------------------------------- tables */

/* Configs shaped as the checkpoints people run (their rope fields as published). */
static const char *const table_cfgs[] = {
    /* Llama-3.1-8B */
    "{\"model_type\":\"llama\",\"hidden_size\":4096,\"num_hidden_layers\":32,"
    "\"intermediate_size\":14336,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
    "\"vocab_size\":128256,\"max_position_embeddings\":131072,\"rope_theta\":500000.0,"
    "\"rope_scaling\":{\"factor\":8.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,"
    "\"original_max_position_embeddings\":8192,\"rope_type\":\"llama3\"},"
    "\"bos_token_id\":128000,\"eos_token_id\":[128001,128008,128009]}",
    /* Llama-3.2-1B: factor 32, head_dim 64, tied */
    "{\"model_type\":\"llama\",\"hidden_size\":2048,\"num_hidden_layers\":16,"
    "\"intermediate_size\":8192,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
    "\"head_dim\":64,\"vocab_size\":128256,\"max_position_embeddings\":131072,"
    "\"rope_theta\":500000.0,\"tie_word_embeddings\":true,\"rope_scaling\":{\"factor\":32.0,"
    "\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192,"
    "\"rope_type\":\"llama3\"}}",
    /* linear (SuperHOT-style), the older "type" key */
    "{\"model_type\":\"llama\",\"hidden_size\":4096,\"num_hidden_layers\":2,"
    "\"intermediate_size\":11008,\"num_attention_heads\":32,\"vocab_size\":32000,"
    "\"max_position_embeddings\":8192,\"rope_scaling\":{\"type\":\"linear\",\"factor\":4.0}}",
    /* dynamic NTK on a Llama-2 */
    "{\"model_type\":\"llama\",\"hidden_size\":4096,\"num_hidden_layers\":2,"
    "\"intermediate_size\":11008,\"num_attention_heads\":32,\"vocab_size\":32000,"
    "\"max_position_embeddings\":4096,\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":2.0}}",
    /* Qwen2.5-7B with its documented YaRN */
    "{\"model_type\":\"qwen2\",\"hidden_size\":3584,\"num_hidden_layers\":2,"
    "\"intermediate_size\":18944,\"num_attention_heads\":28,\"num_key_value_heads\":4,"
    "\"vocab_size\":152064,\"max_position_embeddings\":32768,\"rope_theta\":1000000.0,"
    "\"rope_scaling\":{\"factor\":4.0,\"original_max_position_embeddings\":32768,"
    "\"type\":\"yarn\"}}",
    /* YaRN with DeepSeek's mscale pair, no truncation, custom betas */
    "{\"model_type\":\"llama\",\"hidden_size\":1024,\"num_hidden_layers\":2,"
    "\"intermediate_size\":2048,\"num_attention_heads\":16,\"vocab_size\":1000,"
    "\"max_position_embeddings\":16384,\"rope_theta\":10000.0,\"rope_scaling\":{"
    "\"rope_type\":\"yarn\",\"factor\":40,\"original_max_position_embeddings\":4096,"
    "\"beta_fast\":16,\"beta_slow\":2,\"mscale\":0.707,\"mscale_all_dim\":1.0,"
    "\"truncate\":false}}",
    /* YaRN with an explicit attention_factor and the defaults */
    "{\"model_type\":\"mistral\",\"hidden_size\":512,\"num_hidden_layers\":2,"
    "\"intermediate_size\":1024,\"num_attention_heads\":4,\"vocab_size\":1000,"
    "\"max_position_embeddings\":2048,\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":2.5,"
    "\"attention_factor\":1.25}}",
    /* transformers 5: rope_parameters holds the theta */
    "{\"model_type\":\"llama\",\"hidden_size\":512,\"num_hidden_layers\":2,"
    "\"intermediate_size\":1024,\"num_attention_heads\":4,\"vocab_size\":1000,"
    "\"max_position_embeddings\":2048,\"rope_parameters\":{\"rope_type\":\"default\","
    "\"rope_theta\":1000000.0}}",
};

static int ulps_apart(float a, double want)
{
    float w = (float)want;
    if (a == w)
        return 0;
    return (int)(fabs((double)a - want) / (nextafterf(fabsf(w), INFINITY) - fabsf(w)) + 0.5);
}

START_TEST(tables_match_reference)
{
    char *dir = tu_tmpdir();
    for (size_t ci = 0; ci < sizeof(table_cfgs) / sizeof(table_cfgs[0]); ci++) {
        char path[512], args[1024];
        snprintf(path, sizeof(path), "%s/config%zu.json", dir, ci);
        write_text(path, table_cfgs[ci]);
        rekv_model_config c;
        rekv_err err = {0};
        ck_assert_msg(rekv_config_load_hf(path, &c, &err) == 0, "%s", err.msg);
        rekv_rope_freqs f;
        ck_assert_msg(rekv_rope_freqs_init(&f, &c, &err) == 0, "%s", err.msg);
        int o = c.rope_scaling.original_max_pos > 0 ? c.rope_scaling.original_max_pos : 4096;
        int pos[] = {0, 1, o - 1, o, o + 1, 2 * o + 3, c.max_pos - 1};
        enum { NP = sizeof(pos) / sizeof(pos[0]) };
        snprintf(args, sizeof(args), "freqs %s %d %d %d %d %d %d %d", path, pos[0], pos[1], pos[2],
                 pos[3], pos[4], pos[5], pos[6]);
        json_t *ref = run_ref(args);
        double att = json_number_value(json_object_get(ref, "attention_factor"));
        ck_assert_msg(fabs(f.attn_factor - att) <= 1e-6 * att,
                      "config %zu: attention factor %.9g, "
                      "reference %.9g",
                      ci, (double)f.attn_factor, att);
        int worst = 0;
        for (int i = 0; i < NP; i++) {
            float got[REKV_ROPE_MAX_PAIRS];
            rekv_rope_freqs_at(&f, pos[i], got);
            json_t *row = json_array_get(json_object_get(ref, "inv_freq"), (size_t)i);
            ck_assert_int_eq((int)json_array_size(row), f.half);
            for (int j = 0; j < f.half; j++) {
                double want = json_number_value(json_array_get(row, (size_t)j));
                int u = ulps_apart(got[j], want);
                worst = u > worst ? u : worst;
                /* one rounding to float (the scaled types, in double) or powf's (plain) */
                ck_assert_msg(u <= 2,
                              "config %zu (%s) pos %d pair %d: %.9g, reference %.9g (%d ulp)", ci,
                              rekv_rope_scaling_name(c.rope_scaling.type), pos[i], j,
                              (double)got[j], want, u);
            }
        }
        printf("   config %zu (%s): %d pairs, worst %d ulp, attention factor %.6g\n", ci,
               rekv_rope_scaling_name(c.rope_scaling.type), f.half, worst, att);
        json_decref(ref);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- logits of synthetic models */

typedef struct synth_case {
    const char *name;
    const char *opts; /* rekv-loader synth options beyond the common shape */
    int max_pos;      /* --max-pos (max_position_embeddings) */
    int T;            /* tokens run, positions 0..T-1 */
} synth_case;

/* Tiny models (2 layers, hidden 128, 4 heads over 2 KV heads, head_dim 32) in fp32, each run past
 * its original context: the reference is a float64 forward of the same safetensors. */
static const synth_case synth_cases[] = {
    {"llama3.2", "--rope-theta 500000 --tied", 64, 60},
    {"llama3.1-scaled",
     "--rope-theta 500000 --tied --rope-scaling "
     "llama3:factor=8,low_freq_factor=1,high_freq_factor=4,"
     "original_max_position_embeddings=24",
     256, 200},
    {"linear", "--rope-scaling linear:factor=4", 256, 200},
    {"dynamic", "--rope-scaling dynamic:factor=4", 48, 180},
    {"yarn", "--rope-scaling yarn:factor=8,original_max_position_embeddings=24", 24, 180},
    {"yarn-mscale",
     "--rope-scaling yarn:factor=6,mscale=0.8,mscale_all_dim=1,beta_fast=8,"
     "beta_slow=2,truncate=0",
     32, 180},
    {"qwen2.5-yarn", "--qwen2 --tied --rope-theta 1000000 --rope-scaling yarn:factor=4", 48, 180},
};

static double logits_vs_reference(const char *dir, const synth_case *sc)
{
    char *cmd = NULL, mdir[512];
    snprintf(mdir, sizeof(mdir), "%s/%s", dir, sc->name);
    ck_assert_int_gt(
        asprintf(&cmd,
                 "%s synth --arch llama --layers 2 --hidden 128 --heads 4 --kv-heads 2 "
                 "--ffn 192 --vocab 256 --dtype f32 --seed 7 --max-pos %d %s %s "
                 ">/dev/null",
                 tu_bin("rekv-loader"), sc->max_pos, sc->opts, mdir),
        0);
    tu_run_ok(cmd);
    free(cmd);
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    int T = sc->T, V = m->config.vocab;
    ck_assert_int_le(T, m->config.max_pos);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)T);
    size_t cap = 64 + (size_t)T * 8;
    char *args = malloc(cap);
    size_t n = (size_t)snprintf(args, cap, "forward %s", mdir);
    for (int i = 0; i < T; i++) {
        tok[i] = (int32_t)((i * 97 + 13) % V);
        n += (size_t)snprintf(args + n, cap - n, " %d", tok[i]);
    }
    float *lg = malloc(sizeof(float) * (size_t)T * V);
    rekv_seq *s;
    ck_assert_int_eq(rekv_seq_create(e, T, &s, &err), 0);
    rekv_batch_item it = {s, tok, T, 1, lg};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    json_t *ref = run_ref(args), *rl = json_object_get(ref, "logits");
    ck_assert_int_eq((int)json_array_size(rl), T);
    double scale, worst = tu_max_abs_error(lg, rl, T, V, &scale);
    printf("   %-16s max_pos %d (original %d), %d positions: max |logit error| %.3g (logits up to "
           "%.3g)\n",
           sc->name, m->config.max_pos,
           m->config.rope_scaling.original_max_pos ? m->config.rope_scaling.original_max_pos
                                                   : sc->max_pos,
           T, worst, scale);
    json_decref(ref);
    rekv_seq_free(s);
    free(lg);
    free(args);
    free(tok);
    rekv_engine_free(e);
    rekv_model_close(m);
    return worst;
}

/* fp32 against float64 over two layers and up to 200 positions: the measured worst is 7e-6
 * (logits up to ~20); 1e-4 leaves room for another summation order and still fails a frequency
 * table or attention factor that is off (dropping YaRN's factor or dynamic's growth moves logits
 * by 0.1 to 1). */
#define LOGIT_TOL 1e-4

START_TEST(logits_match_reference)
{
    char *dir = tu_tmpdir();
    const synth_case *sc = &synth_cases[_i];
    double worst = logits_vs_reference(dir, sc);
    ck_assert_msg(worst <= LOGIT_TOL, "%s: logits differ from the reference by %g", sc->name,
                  worst);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- dynamic NTK and the cache */

/* Dynamic NTK past the original length, three ways: the whole prompt at once, one token at a
 * time, and two uneven chunks. Each position's rotation depends on that position only, so the
 * logits are identical bits (HF's per-forward table would make them differ). */
START_TEST(dynamic_does_not_depend_on_chunking)
{
    char *dir = tu_tmpdir(), *cmd = NULL, mdir[512];
    snprintf(mdir, sizeof(mdir), "%s/dyn", dir);
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
                              "--ffn 96 --vocab 128 --dtype f32 --max-pos 16 --rope-scaling "
                              "dynamic:factor=8 %s >/dev/null",
                              tu_bin("rekv-loader"), mdir),
                     0);
    tu_run_ok(cmd);
    free(cmd);
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(m->config.max_pos, 128);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    enum { T = 100, V = 128 };
    int32_t tok[T];
    for (int i = 0; i < T; i++)
        tok[i] = (int32_t)((i * 31 + 5) % V);
    tu_forward_cut_invariant(e, tok, T, V, 37);
    rekv_engine_free(e);
    rekv_model_close(m);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- the pipeline's kernels */

/* The decode pipeline on the cpu backend (the kernels' rope, not forward.c's) in resident and the
 * exact streaming modes — act among them: every K recomputed from activations, rotated at its
 * cached position (tu_pipeline_matches_forward) — gives the reference forward's logits bit for bit,
 * for dynamic NTK and YaRN past the original length. */
START_TEST(pipeline_matches_forward)
{
    static const char *const scalings[] = {"dynamic:factor=8", "yarn:factor=8"};
    char *dir = tu_tmpdir(), *cmd = NULL, mdir[512];
    snprintf(mdir, sizeof(mdir), "%s/m%d", dir, _i);
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
                              "--ffn 96 --vocab 128 --dtype f32 --max-pos 16 --rope-scaling %s %s "
                              ">/dev/null",
                              tu_bin("rekv-loader"), scalings[_i], mdir),
                     0);
    tu_run_ok(cmd);
    free(cmd);
    tu_fixture f;
    tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
    enum { LEN = 90, STEPS = 4, V = 128 };
    int32_t prompt[LEN];
    for (int i = 0; i < LEN; i++)
        prompt[i] = (int32_t)((i * 53 + 3) % V);
    tu_pipeline_matches_forward(&f, scalings[_i], prompt, LEN, STEPS, V);
    tu_fixture_close(&f);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- Llama 3.x's EOS list */

/* Replaces "eos_token_id": 2 in dir's config.json with the given JSON value. */
static void set_eos(const char *dir, const char *value)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    json_error_t jerr;
    json_t *c = json_load_file(path, 0, &jerr);
    ck_assert_msg(c != NULL, "%s", jerr.text);
    ck_assert_int_eq(
        json_object_set_new(c, "eos_token_id", json_loads(value, JSON_DECODE_ANY, NULL)), 0);
    ck_assert_int_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);
}

/* eos_token_id as a list (Llama 3.x Instruct: [<|end_of_text|>, <|eom_id|>, <|eot_id|>]): any of
 * its ids ends generation, not only the first — in rekv_generate and in the pipeline's. */
START_TEST(eos_list_stops_generation)
{
    char *dir = tu_tmpdir(), *cmd = NULL, mdir[512];
    snprintf(mdir, sizeof(mdir), "%s/m", dir);
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
                              "--ffn 96 --vocab 128 --dtype f32 --max-pos 64 --seed 3 "
                              "--rope-theta 500000 %s >/dev/null",
                              tu_bin("rekv-loader"), mdir),
                     0);
    tu_run_ok(cmd);
    free(cmd);
    enum { N = 12, V = 128 };
    int32_t prompt[5] = {1, 17, 33, 9, 70};
    rekv_gen_params gp = {.max_new_tokens = N, .temperature = 1.0f, .top_p = 1, .seed = 5};
    /* sampled, seeded: the same ids each run */
    rekv_gen_result r;
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_generate(e, prompt, 5, &gp, &r, &err) == 0, "%s", err.msg);
    /* the stop: the first generated id not seen before it, past the first; the list's first id:
     * one never generated */
    int stop_at = -1, unused = -1, seen[V] = {0};
    for (int i = 0; i < r.n; i++) {
        if (i > 0 && stop_at < 0 && !seen[r.ids[i]])
            stop_at = i;
        seen[r.ids[i]] = 1;
    }
    for (int t = 3; t < V && unused < 0; t++)
        if (!seen[t])
            unused = t;
    ck_assert_msg(stop_at > 0 && unused > 0, "the generated ids repeat one token");
    int stop_tok = r.ids[stop_at];
    rekv_gen_result_free(&r);
    rekv_engine_free(e);
    rekv_model_close(m);
    char list[64];
    snprintf(list, sizeof(list), "[%d, %d]", unused, stop_tok);
    set_eos(mdir, list);
    tu_fixture f;
    tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
    ck_assert_int_eq(f.m->config.n_eos_ids, 2);
    ck_assert_int_eq(f.m->config.eos_id, unused);
    gp.stop_at_eos = 1;
    ck_assert_msg(rekv_generate(f.e, prompt, 5, &gp, &r, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(r.n, stop_at + 1);
    ck_assert_str_eq(r.finish_reason, "eos");
    rekv_gen_result_free(&r);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    rekv_pipeline *p;
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, NULL, &cfg, &p, &err) == 0, "%s", err.msg);
    const int32_t *prompts[1] = {prompt};
    int lens[1] = {5};
    ck_assert_msg(rekv_pipeline_generate(p, prompts, lens, 1, &gp, &r, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(r.n, stop_at + 1);
    ck_assert_str_eq(r.finish_reason, "eos");
    rekv_gen_result_free(&r);
    rekv_pipeline_free(p);
    tu_fixture_close(&f);
    /* an id past the vocabulary is named */
    set_eos(mdir, "[2, 128]");
    rekv_model_config c;
    char path[600];
    snprintf(path, sizeof(path), "%s/config.json", mdir);
    ck_assert_int_eq(rekv_config_load_hf(path, &c, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "\"eos_token_id\"[1]") != NULL, "%s", err.msg);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- bad input */

START_TEST(bad_rope_scaling_names_the_field)
{
    static const struct {
        const char *scaling; /* the rope_scaling value */
        int code;
        const char *needle;
    } bad[] = {
        {"{\"rope_type\":\"mrope\",\"factor\":4}", -ENOTSUP, "rope_scaling.rope_type \"mrope\""},
        {"{\"factor\":4}", -EINVAL, "rope_scaling.rope_type"},
        {"{\"rope_type\":\"linear\"}", -EINVAL, "\"rope_scaling.factor\" is missing"},
        {"{\"rope_type\":\"linear\",\"factor\":\"4\"}", -EINVAL, "\"rope_scaling.factor\" must be"},
        {"{\"rope_type\":\"dynamic\",\"factor\":0}", -EINVAL, "\"rope_scaling.factor\" = 0"},
        {"{\"rope_type\":\"llama3\",\"factor\":8,\"high_freq_factor\":4,"
         "\"original_max_position_embeddings\":8192}",
         -EINVAL, "\"rope_scaling.low_freq_factor\" is missing"},
        {"{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":4,\"high_freq_factor\":4,"
         "\"original_max_position_embeddings\":8192}",
         -EINVAL, "high_freq_factor"},
        {"{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,\"high_freq_factor\":4}",
         -EINVAL, "\"rope_scaling.original_max_position_embeddings\" is missing"},
        {"{\"rope_type\":\"yarn\",\"factor\":4,\"original_max_position_embeddings\":10.5}", -EINVAL,
         "\"rope_scaling.original_max_position_embeddings\" = 10.5"},
        {"{\"rope_type\":\"yarn\",\"factor\":4,\"beta_fast\":-1}", -EINVAL,
         "\"rope_scaling.beta_fast\""},
        {"{\"rope_type\":\"yarn\",\"factor\":4,\"truncate\":3}", -EINVAL,
         "\"rope_scaling.truncate\""},
        {"[\"linear\",4]", -EINVAL, "\"rope_scaling\" must be an object"},
    };
    char *dir = tu_tmpdir(), path[512], text[1024];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(text, sizeof(text),
                 "{\"model_type\":\"llama\",\"hidden_size\":64,\"num_hidden_layers\":1,"
                 "\"intermediate_size\":96,\"num_attention_heads\":4,\"vocab_size\":100,"
                 "\"max_position_embeddings\":64,\"rope_scaling\":%s}",
                 bad[i].scaling);
        write_text(path, text);
        rekv_model_config c;
        rekv_err err = {0};
        int rc = rekv_config_load_hf(path, &c, &err);
        ck_assert_msg(rc == bad[i].code, "case %zu: rc %d, want %d (%s)", i, rc, bad[i].code,
                      err.msg);
        ck_assert_msg(strstr(err.msg, bad[i].needle) != NULL && strstr(err.msg, path) != NULL,
                      "case %zu: \"%s\" does not name %s", i, err.msg, bad[i].needle);
        ck_assert_ptr_null(strchr(err.msg, '\n'));
    }
    /* a rotation over part of each head is refused, not computed over the whole */
    snprintf(text, sizeof(text),
             "{\"model_type\":\"llama\",\"hidden_size\":64,\"num_hidden_layers\":1,"
             "\"intermediate_size\":96,\"num_attention_heads\":4,\"vocab_size\":100,"
             "\"max_position_embeddings\":64,\"partial_rotary_factor\":0.5}");
    write_text(path, text);
    rekv_model_config pc;
    rekv_err perr = {0};
    ck_assert_int_eq(rekv_config_load_hf(path, &pc, &perr), -ENOTSUP);
    ck_assert_msg(strstr(perr.msg, "\"partial_rotary_factor\"") != NULL, "%s", perr.msg);
    /* a config built by code (GGUF, tests) gets the same checks from rekv_rope_freqs_init */
    rekv_model_config c = {.head_dim = 64, .rope_theta = 10000.0f};
    c.rope_scaling = (rekv_rope_scaling){.type = REKV_ROPE_SCALING_YARN, .factor = 4};
    rekv_rope_freqs f;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_rope_freqs_init(&f, &c, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "original_max_position_embeddings") != NULL, "%s", err.msg);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("rope");
    TCase *tc = tcase_create("rope");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, plain_rope_keeps_bits);
    tcase_add_test(tc, factors_divide_plain);
    tcase_add_test(tc, tables_match_reference);
    tcase_add_loop_test(tc, logits_match_reference, 0,
                        (int)(sizeof(synth_cases) / sizeof(synth_cases[0])));
    tcase_add_test(tc, dynamic_does_not_depend_on_chunking);
    tcase_add_loop_test(tc, pipeline_matches_forward, 0, 2);
    tcase_add_test(tc, eos_list_stops_generation);
    tcase_add_test(tc, bad_rope_scaling_names_the_field);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
