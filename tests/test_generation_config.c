/* test_generation_config.c — the chat models' stops: generation_config.json's eos_token_id (an
 * integer or a list) joins config.json's, as vLLM takes the union (Gemma-2-it's config says 1, its
 * generation_config [1, 107]), and a GGUF file's tokenizer.ggml.eot_token_id and eom_token_id join
 * its EOS. A greedy run stops at the second list's id, in rekv_generate and in the pipeline. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/gpuworker.h"
#include "gpuworker/pipeline.h"
#include "loader/gguf.h"
#include "loader/loader.h"
#include "tests/fixture.h"
#include "tests/gguf_edit.h"
#include "tests/testutil.h"

static void write_json(const char *dir, const char *name, const char *text)
{
    char path[700];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
}

/* config.json's eos_token_id set to a JSON value. */
static void set_config_eos(const char *dir, const char *value)
{
    char path[700];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    json_error_t jerr;
    json_t *c = json_load_file(path, 0, &jerr);
    ck_assert_msg(c != NULL, "%s", jerr.text);
    ck_assert_int_eq(
        json_object_set_new(c, "eos_token_id", json_loads(value, JSON_DECODE_ANY, NULL)), 0);
    ck_assert_int_eq(json_dump_file(c, path, JSON_INDENT(2)), 0);
    json_decref(c);
}

/* The greedy ids of a prompt; where the first new id past the first one is (*stop_at) and an id
 * never generated from 3 on (*unused). */
static void greedy_plan(rekv_engine *e, const int32_t *prompt, int n, int *stop_at, int *stop_tok,
                        int *unused)
{
    int V = rekv_engine_config(e)->vocab;
    rekv_gen_params gp = {.max_new_tokens = 12, .temperature = 0, .top_p = 1};
    rekv_gen_result r;
    rekv_err err = {0};
    ck_assert_msg(rekv_generate(e, prompt, n, &gp, &r, &err) == 0, "%s", err.msg);
    int *seen = calloc((size_t)V, sizeof(int));
    ck_assert_ptr_nonnull(seen);
    *stop_at = -1, *unused = -1;
    for (int i = 0; i < r.n; i++) {
        if (i > 0 && *stop_at < 0 && !seen[r.ids[i]])
            *stop_at = i;
        seen[r.ids[i]] = 1;
    }
    for (int t = 3; t < V && *unused < 0; t++)
        if (!seen[t])
            *unused = t;
    ck_assert_msg(*stop_at > 0 && *unused > 0, "the greedy ids repeat one token");
    *stop_tok = r.ids[*stop_at];
    rekv_gen_result_free(&r);
    free(seen);
}

/* A model directory whose config.json names one unused id and whose generation_config.json lists
 * [config's, the greedy run's second new id]: the greedy run ends there, "eos". */
START_TEST(generation_config_eos_stops_greedy)
{
    char *dir = tu_tmpdir(), *cmd = NULL, mdir[512], text[128];
    snprintf(mdir, sizeof(mdir), "%s/m", dir);
    ck_assert_int_gt(asprintf(&cmd,
                              "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
                              "--ffn 96 --vocab 128 --dtype f32 --max-pos 64 --seed 11 %s "
                              ">/dev/null",
                              tu_bin("rekv-loader"), mdir),
                     0);
    tu_run_ok(cmd);
    free(cmd);
    int32_t prompt[5] = {1, 17, 33, 9, 70};
    int stop_at, stop_tok, unused;
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mdir, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    greedy_plan(e, prompt, 5, &stop_at, &stop_tok, &unused);
    rekv_engine_free(e);
    rekv_model_close(m);
    snprintf(text, sizeof(text), "%d", unused);
    set_config_eos(mdir, text);
    snprintf(text, sizeof(text), "{\"bos_token_id\": 1, \"eos_token_id\": [%d, %d]}", unused,
             stop_tok);
    write_json(mdir, "generation_config.json", text);
    tu_fixture f;
    tu_fixture_open(&f, mdir, REKV_DTYPE_F32, NULL);
    ck_assert_int_eq(f.m->config.n_eos_ids, 2); /* the union: the config's id once */
    ck_assert_int_eq(f.m->config.eos_id, unused);
    ck_assert_int_eq(f.m->config.eos_ids[1], stop_tok);
    rekv_gen_params gp = {.max_new_tokens = 12, .temperature = 0, .top_p = 1, .stop_at_eos = 1};
    rekv_gen_result r;
    ck_assert_msg(rekv_generate(f.e, prompt, 5, &gp, &r, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(r.n, stop_at + 1);
    ck_assert_int_eq(r.ids[stop_at], stop_tok);
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
    /* a plain integer adds one id; an id past the vocabulary or a string names the file */
    rekv_model_config c;
    char path[600];
    snprintf(path, sizeof(path), "%s/config.json", mdir);
    write_json(mdir, "generation_config.json", "{\"eos_token_id\": 5}");
    ck_assert_msg(rekv_config_load_hf(path, &c, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(c.n_eos_ids, 2);
    ck_assert_int_eq(c.eos_ids[1], 5);
    ck_assert(rekv_config_is_eos(&c, 5) && rekv_config_is_eos(&c, unused));
    write_json(mdir, "generation_config.json", "{\"eos_token_id\": [2, 128]}");
    ck_assert_int_eq(rekv_config_load_hf(path, &c, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "generation_config.json") && strstr(err.msg, "eos_token_id"),
                  "%s", err.msg);
    write_json(mdir, "generation_config.json", "{\"eos_token_id\": \"2\"}");
    ck_assert_int_eq(rekv_config_load_hf(path, &c, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "generation_config.json"), "%s", err.msg);
    write_json(mdir, "generation_config.json", "{\"eos_token_id\": [1,");
    ck_assert_int_eq(rekv_config_load_hf(path, &c, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "generation_config.json"), "%s", err.msg);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* A GGUF file's end-of-turn and end-of-message ids end generation beside its EOS (llama.cpp's
 * end-of-generation set): the greedy run of llama.cpp's tiny file stops at its second new id
 * once that id is the file's eot_token_id. */
START_TEST(gguf_eot_id_stops_greedy)
{
    const char *src = tu_shared("gguf/synth-llama-F16.gguf");
    if (src == NULL)
        return;
    char *dir = tu_tmpdir();
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(src, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    int32_t prompt[5] = {1, 17, 33, 9, 70};
    int stop_at, stop_tok, unused;
    greedy_plan(e, prompt, 5, &stop_at, &stop_tok, &unused);
    int eos = m->config.eos_id;
    rekv_engine_free(e);
    rekv_model_close(m);
    tg_edit ed[2] = {
        {.key = "tokenizer.ggml.eot_token_id", .type = REKV_GGUF_U32, .u = (uint32_t)stop_tok},
        {.key = "tokenizer.ggml.eom_token_id", .type = REKV_GGUF_U32, .u = (uint32_t)unused}};
    const char *path = tg_rewrite(src, ed, 2, -1, dir);
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(m->config.eos_id, eos);
    ck_assert_int_eq(m->config.n_eos_ids, eos >= 0 ? 3 : 2);
    ck_assert(rekv_config_is_eos(&m->config, stop_tok) && rekv_config_is_eos(&m->config, unused));
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    rekv_gen_params gp = {.max_new_tokens = 12, .temperature = 0, .top_p = 1, .stop_at_eos = 1};
    rekv_gen_result r;
    ck_assert_msg(rekv_generate(e, prompt, 5, &gp, &r, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(r.n, stop_at + 1);
    ck_assert_str_eq(r.finish_reason, "eos");
    rekv_gen_result_free(&r);
    rekv_engine_free(e);
    rekv_model_close(m);
    /* an id past the vocabulary names the key */
    tg_edit bad = {.key = "tokenizer.ggml.eot_token_id", .type = REKV_GGUF_U32, .u = 1u << 30};
    path = tg_rewrite(src, &bad, 1, -1, dir);
    ck_assert_int_eq(rekv_model_open(path, &m, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "eot_token_id"), "%s", err.msg);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("generation_config");
    TCase *tc = tcase_create("stops");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, generation_config_eos_stops_greedy);
    tcase_add_test(tc, gguf_eot_id_stops_greedy);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
