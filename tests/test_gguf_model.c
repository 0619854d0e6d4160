/* test_gguf_model.c — a llama GGUF as a rekv model: the config of every file of ../shared/gguf
 * against llama.cpp's reading of it (the ref.json's model and tokenizer_meta), quantized files
 * refused naming the type, and metadata edits (a GGUF rewritten here with one key changed, added
 * or dropped) refused naming the key or tensor: an architecture rekv does not run, a MoE llama,
 * scaled rope, dims that disagree with the tensors, a layer count that leaves a layer out. */
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

static const char *const k_files[] = {
    "llama-tiny-py-F16", "llama-tiny-py-Q8_0", "llama-tiny-py-Q4_0", "synth-llama-F16",
    "synth-llama-Q8_0",  "synth-llama-Q4_K_M", "synth-llama-Q4_0",
};
#define N_FILES (sizeof(k_files) / sizeof(k_files[0]))

static const char *shared_gguf(const char *name, json_t **ref)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "gguf/%s.gguf", name);
    const char *path = tu_shared(rel);
    snprintf(rel, sizeof(rel), "gguf/%s.ref.json", name);
    const char *rpath = tu_shared(rel);
    if (path == NULL || rpath == NULL)
        return NULL;
    if (ref != NULL) {
        json_error_t je;
        *ref = json_load_file(rpath, 0, &je);
        ck_assert_msg(*ref != NULL, "%s: %s", rpath, je.text);
    }
    return path;
}

static long long jint(json_t *o, const char *k)
{
    return json_integer_value(json_object_get(o, k));
}

START_TEST(config_as_llama_cpp_reads_it)
{
    json_t *ref;
    const char *path = shared_gguf(k_files[_i], &ref);
    if (path == NULL)
        return;
    rekv_gguf *g;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(path, &g, &err) == 0, "%s", err.msg);
    rekv_model_config c;
    ck_assert_msg(rekv_gguf_config(g, &c, &err) == 0, "%s", err.msg);
    json_t *m = json_object_get(ref, "model"), *t = json_object_get(ref, "tokenizer_meta");
    ck_assert_int_eq(c.arch, REKV_ARCH_LLAMA);
    ck_assert_int_eq(c.rope, REKV_ROPE_ADJACENT); /* the converter's row order: see gguf_model.c */
    ck_assert_int_eq(c.n_layers, jint(m, "n_layer"));
    ck_assert_int_eq(c.hidden, jint(m, "n_embd"));
    ck_assert_int_eq(c.n_heads, jint(m, "n_head"));
    ck_assert_int_eq(c.n_kv_heads, jint(m, "n_head_kv"));
    ck_assert_int_eq(c.head_dim, jint(m, "head_dim"));
    ck_assert_int_eq(c.ffn, jint(m, "n_ff"));
    ck_assert_int_eq(c.vocab, jint(m, "n_vocab"));
    ck_assert_int_eq(c.max_pos, jint(m, "context_length"));
    ck_assert(c.rope_theta == (float)json_number_value(json_object_get(m, "rope_theta")));
    ck_assert(c.norm_eps == (float)json_number_value(json_object_get(m, "rms_norm_eps")));
    ck_assert_int_eq(c.tied_head, json_is_true(json_object_get(m, "tied_output")));
    ck_assert_int_eq(c.bos_id, jint(t, "bos"));
    ck_assert_int_eq(c.eos_id, jint(t, "eos"));
    ck_assert_int_eq(c.pad_id, jint(t, "pad"));
    ck_assert_int_eq(c.add_bos, json_is_true(json_object_get(t, "add_bos")));
    rekv_gguf_close(g);
    /* the whole model: F16 files load with every tensor in place, quantized ones too, their
     * matrices kept in their blocks (qtype), never widened at load */
    rekv_model *model = NULL;
    int rc = rekv_model_open(path, &model, &err);
    if (strstr(k_files[_i], "F16") != NULL) {
        ck_assert_msg(rc == 0, "%s", err.msg);
        ck_assert_int_eq(model->weights.embed_tokens->shape[0], c.vocab);
        ck_assert_int_eq(model->weights.embed_tokens->shape[1], c.hidden);
        ck_assert_int_eq(model->weights.embed_tokens->dtype, REKV_DTYPE_F16);
        ck_assert_int_eq(model->weights.layers[0].attn_norm_w->dtype, REKV_DTYPE_F32);
        ck_assert_int_eq(model->weights.layers[0].w2->shape[0], c.hidden);
        ck_assert_int_eq(model->weights.layers[0].w2->shape[1], c.ffn);
        ck_assert_ptr_ne(model->weights.lm_head, model->weights.embed_tokens);
        rekv_model_close(model);
    } else { /* quantized: loaded, every matrix keeping its GGUF block type */
        ck_assert_msg(rc == 0, "%s", err.msg);
        json_t *ts = json_object_get(ref, "tensors");
        const rekv_tensor *mats[] = {model->weights.embed_tokens, model->weights.lm_head,
                                     model->weights.layers[0].wq, model->weights.layers[0].w2};
        for (size_t i = 0; i < sizeof(mats) / sizeof(mats[0]); i++) {
            const char *want =
                json_string_value(json_object_get(json_object_get(ts, mats[i]->name), "type"));
            ck_assert_ptr_nonnull(want);
            ck_assert_uint_ne(mats[i]->qtype, 0);
            ck_assert_str_eq(rekv_ggml_type_name(mats[i]->qtype), want);
        }
        ck_assert_uint_eq(model->weights.layers[0].attn_norm_w->qtype, 0);
        rekv_model_close(model);
    }
    json_decref(ref);
}
END_TEST

/* ---------------------------------------------------------------- rewritten files */

/* The F16 file with one edit must be refused by rekv_model_open with code and a message holding
 * needle. */
static void expect_refused(const tg_edit *e, int code, const char *needle)
{
    const char *src = shared_gguf("synth-llama-F16", NULL);
    if (src == NULL)
        return;
    char *dir = tu_tmpdir();
    const char *path = tg_rewrite(src, e, 1, -1, dir);
    rekv_model *m = NULL;
    rekv_err err = {0};
    int rc = rekv_model_open(path, &m, &err);
    ck_assert_msg(rc == -code, "want -%d (%s), got %d: %s", code, needle, rc, err.msg);
    ck_assert_msg(strstr(err.msg, needle) != NULL && strstr(err.msg, "edited.gguf") != NULL,
                  "the message \"%s\" should name \"%s\" and the file", err.msg, needle);
    tu_rmrf(dir);
    free(dir);
}

START_TEST(rewritten_unchanged_loads)
{
    const char *src = shared_gguf("synth-llama-F16", NULL);
    if (src == NULL)
        return;
    char *dir = tu_tmpdir();
    tg_edit none = {0};
    const char *path = tg_rewrite(src, &none, 0, -1, dir);
    rekv_model *m = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    rekv_model_close(m);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

START_TEST(bad_metadata_named)
{
    tg_edit e = {.key = "general.architecture", .type = REKV_GGUF_STRING, .s = "qwen2"};
    expect_refused(&e, ENOTSUP, "\"general.architecture\" = \"qwen2\" is not supported");
    e = (tg_edit){.key = "llama.expert_count", .type = REKV_GGUF_U32, .u = 8};
    expect_refused(&e, ENOTSUP, "\"llama.expert_count\" = 8: mixture-of-experts");
    e = (tg_edit){.key = "llama.rope.scaling.type", .type = REKV_GGUF_STRING, .s = "yarn"};
    expect_refused(&e, ENOTSUP, "\"llama.rope.scaling.type\" = \"yarn\": only \"none\"");
    e = (tg_edit){.key = "llama.rope.scaling.factor", .type = REKV_GGUF_F32, .f = 8.0f};
    expect_refused(&e, ENOTSUP, "\"llama.rope.scaling.factor\" = 8 without");
    e = (tg_edit){.rename_tensor = "blk.3.ffn_norm.weight", .new_name = "rope_freqs.weight"};
    expect_refused(&e, EINVAL, "\"rope_freqs.weight\" must be F32 with head_dim/2 = 32 values");
    e = (tg_edit){.key = "llama.embedding_length", .type = REKV_GGUF_U32, .u = 512};
    expect_refused(&e, EINVAL,
                   "tensor \"token_embd.weight\" has ne [256, 4096], but the metadata "
                   "(llama.embedding_length, vocabulary) says [512, 4096]");
    e = (tg_edit){.key = "llama.feed_forward_length", .type = REKV_GGUF_U32, .u = 1024};
    expect_refused(&e, EINVAL, "tensor \"blk.0.ffn_gate.weight\" has ne [256, 768]");
    e = (tg_edit){.key = "llama.attention.head_count_kv", .type = REKV_GGUF_U32, .u = 4};
    expect_refused(&e, EINVAL,
                   "tensor \"blk.0.attn_k.weight\" has ne [256, 128], but the metadata "
                   "(llama.embedding_length, head_count_kv x head dim) says [256, 256]");
    e = (tg_edit){.key = "llama.attention.head_count_kv", .type = REKV_GGUF_U32, .u = 3};
    expect_refused(&e, EINVAL, "\"llama.attention.head_count\" 4 is not a multiple");
    e = (tg_edit){.key = "llama.block_count", .type = REKV_GGUF_U32, .u = 3};
    expect_refused(&e, EINVAL,
                   "tensor \"blk.3.attn_norm.weight\" exists, but the metadata "
                   "(llama.block_count) says 3 layers");
    e = (tg_edit){.key = "llama.block_count", .type = REKV_GGUF_U32, .u = 5};
    expect_refused(&e, EINVAL, "tensor \"blk.4.attn_norm.weight\" is missing");
    /* found by the fuzzer at a larger scale: a count that would size the layer table at 150 GB */
    e = (tg_edit){.key = "llama.block_count", .type = REKV_GGUF_U32, .u = 740000000};
    expect_refused(&e, EINVAL, "\"llama.block_count\" = 740000000, but the file holds");
    e = (tg_edit){.key = "llama.vocab_size", .type = REKV_GGUF_U32, .u = 4000};
    expect_refused(&e, EINVAL, "\"tokenizer.ggml.tokens\" has 4096 tokens, but the vocabulary");
    e = (tg_edit){.key = "llama.block_count", .type = -1};
    expect_refused(&e, ENOENT, "metadata \"llama.block_count\" is missing");
    e = (tg_edit){.key = "llama.context_length", .type = REKV_GGUF_STRING, .s = "1024"};
    expect_refused(&e, EINVAL, "metadata \"llama.context_length\" is a string, not an integer");
    e = (tg_edit){.key = "tokenizer.ggml.bos_token_id", .type = REKV_GGUF_U32, .u = 5000};
    expect_refused(&e, EINVAL, "\"tokenizer.ggml.bos_token_id\" = 5000 is outside the vocabulary");
    e = (tg_edit){.key = "llama.rope.dimension_count", .type = REKV_GGUF_U32, .u = 32};
    expect_refused(&e, ENOTSUP, "\"llama.rope.dimension_count\" 32");
}
END_TEST

/* 1 when some line of out holds every one of the pieces (NULL-terminated), in order. */
static int line_has(const char *out, const char *const *pieces)
{
    for (const char *l = out; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        const char *end = strchr(l, '\n'), *at = l;
        size_t len = end ? (size_t)(end - l) : strlen(l);
        char line[1024];
        snprintf(line, sizeof(line), "%.*s", (int)len, l);
        at = line;
        const char *const *p = pieces;
        for (; *p && (at = strstr(at, *p)) != NULL; p++)
            at += strlen(*p);
        if (*p == NULL)
            return 1;
    }
    return 0;
}

/* rekv-loader inspect lists a GGUF's metadata and tensors (type, dims, bytes), and loads a
 * quantized file's weights. */
/* The last logits of a prompt of 40 tokens through the model at path (the engine, cpu). */
static void last_logits(const char *path, float *out)
{
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    rekv_seq *seq = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_seq_create(e, 64, &seq, &err) == 0, "%s", err.msg);
    int32_t ids[40];
    for (int i = 0; i < 40; i++)
        ids[i] = (i * 37 + 11) % 4096;
    rekv_batch_item it = {seq, ids, 40, 0, out};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    rekv_seq_free(seq);
    rekv_engine_free(e);
    rekv_model_close(m);
}

/* llama.cpp's rope scaling: "linear" with its factor, and rope_freqs.weight's per-pair divisors
 * (how its converter writes Llama 3.x's llama3 scaling; its rope divides pair j's frequency by
 * the j-th value) reach the config and the frequency table, and change the logits; both at once
 * are refused. */
START_TEST(rope_scaling_read)
{
    const char *src = shared_gguf("synth-llama-F16", NULL);
    if (src == NULL)
        return;
    char *dir = tu_tmpdir();
    rekv_model *m = NULL;
    rekv_err err = {0};
    rekv_rope_freqs plain, f;
    ck_assert_msg(rekv_model_open(src, &m, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(m->config.rope_scaling.type, REKV_ROPE_SCALING_NONE);
    ck_assert_int_eq(rekv_rope_freqs_init(&plain, &m->config, &err), 0);
    int half = m->config.head_dim / 2;
    rekv_model_close(m);
    static float base[4096], scaled[4096];
    last_logits(src, base);

    tg_edit lin[2] = {{.key = "llama.rope.scaling.type", .type = REKV_GGUF_STRING, .s = "linear"},
                      {.key = "llama.rope.scaling.factor", .type = REKV_GGUF_F32, .f = 2.0f}};
    const char *path = tg_rewrite(src, lin, 2, -1, dir);
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(m->config.rope_scaling.type, REKV_ROPE_SCALING_LINEAR);
    ck_assert(m->config.rope_scaling.factor == 2.0);
    ck_assert_int_eq(rekv_rope_freqs_init(&f, &m->config, &err), 0);
    for (int j = 0; j < half; j++) /* the scaled table is computed in double: within an ulp */
        ck_assert(fabs(f.inv_freq[j] - plain.inv_freq[j] / 2) <= 2e-7 * plain.inv_freq[j]);
    rekv_model_close(m);

    float ff[32];
    for (int j = 0; j < 32; j++) /* llama3's shape: high frequencies kept, low ones divided */
        ff[j] = j < 12 ? 1.0f : j < 20 ? 1.0f + (float)(j - 11) : 8.0f;
    tg_edit fr = {.add_tensor = "rope_freqs.weight", .add_f32 = ff, .add_n = 32};
    path = tg_rewrite(src, &fr, 1, -1, dir);
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(half, 32);
    ck_assert_int_eq(m->config.rope_scaling.type, REKV_ROPE_SCALING_FACTORS);
    ck_assert_int_eq(rekv_rope_freqs_init(&f, &m->config, &err), 0);
    for (int j = 0; j < half; j++)
        ck_assert(f.inv_freq[j] == plain.inv_freq[j] / ff[j]);
    rekv_model_close(m);
    last_logits(path, scaled);
    double d = 0;
    for (int i = 0; i < 4096; i++)
        d = fmax(d, fabs((double)scaled[i] - base[i]));
    ck_assert_msg(d > 1e-3, "the divisors did not reach the forward pass (%g)", d);

    tg_edit both[3] = {lin[0], lin[1], fr};
    path = tg_rewrite(src, both, 3, -1, dir);
    ck_assert_int_eq(rekv_model_open(path, &m, &err), -ENOTSUP);
    ck_assert_msg(strstr(err.msg, "\"rope_freqs.weight\" with linear") != NULL, "%s", err.msg);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

START_TEST(inspect_lists_metadata_and_tensors)
{
    const char *path = shared_gguf("synth-llama-Q4_K_M", NULL);
    if (path == NULL)
        return;
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s inspect %s 2>&1", tu_bin("rekv-loader"), path);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "rc %d: %s", rc, tu_log_end(out));
    static const char *const want[][6] = {
        {"GGUF version 3, alignment 32", NULL},
        {"tokenizer.ggml.model ", " string ", "\"gpt2\"", NULL},
        {"tokenizer.ggml.tokens ", "string[4096] [\"<s>\", \"<pad>\", \"</s>\"", NULL},
        {"llama.attention.layer_norm_rms_epsilon ", " float32 ", " 9.99999975e-06", NULL},
        {"tokenizer.ggml.add_bos_token ", " bool ", " true", NULL},
        {"  output.weight ", " q6_K ", " [256, 4096] ", " 860160 bytes at 129696", NULL},
        {"  blk.0.ffn_down.weight ", " q4_K ", " [768, 256] ", " 110592 bytes", NULL},
        {"tensors: 39", NULL},
        {"  layers ", " 4", NULL},
        {"weights: every tensor the config needs is present", NULL}};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        ck_assert_msg(line_has(out, want[i]), "no line with \"%s\"... in:\n%s", want[i][0],
                      tu_log_end(out));
    free(out);
}
END_TEST

/* A valid GGUF of an architecture rekv does not run is listed, with the reason, not failed; a
 * corrupt one fails with its error. */
START_TEST(inspect_unsupported_and_corrupt)
{
    const char *src = shared_gguf("synth-llama-F16", NULL);
    if (src == NULL)
        return;
    char *dir = tu_tmpdir();
    tg_edit e = {.key = "general.architecture", .type = REKV_GGUF_STRING, .s = "gemma2"};
    const char *path = tg_rewrite(src, &e, 1, TG_KEEP, dir);
    char cmd[8192], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s inspect %s 2>&1", tu_bin("rekv-loader"), path);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "rc %d: %s", rc, tu_log_end(out));
    ck_assert_ptr_nonnull(strstr(out, "config: not supported: "));
    ck_assert_ptr_nonnull(strstr(out, "\"general.architecture\" = \"gemma2\" is not supported"));
    ck_assert_ptr_nonnull(strstr(out, "tensors: 39"));
    free(out);
    snprintf(cmd, sizeof(cmd), "head -c 1000 %s > %s/cut.gguf && %s inspect %s/cut.gguf 2>&1", src,
             dir, tu_bin("rekv-loader"), dir);
    rc = tu_run(cmd, &out);
    ck_assert_int_eq(rc, 1);
    ck_assert_msg(strstr(out, "cut.gguf: ") && strstr(out, "truncated"), "%s", tu_log_end(out));
    free(out);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

Suite *gguf_model_suite(void);
Suite *gguf_model_suite(void)
{
    Suite *s = suite_create("gguf_model");
    TCase *tc = tcase_create("config");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, config_as_llama_cpp_reads_it, 0, N_FILES);
    tcase_add_test(tc, rewritten_unchanged_loads);
    tcase_add_test(tc, bad_metadata_named);
    tcase_add_test(tc, rope_scaling_read);
    tcase_add_test(tc, inspect_lists_metadata_and_tensors);
    tcase_add_test(tc, inspect_unsupported_and_corrupt);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(gguf_model_suite());
}
