/* test_cli.c — `rekv generate` as a user runs it: the JSON it prints, and one clear line and a
 * non-zero exit (never a crash) for bad input. Runs the real programs from the build. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fixture.h"
#include "tests/testutil.h"

static char g_cmd[16384];

/* Runs `rekv ARGS` capturing stdout and stderr separately. Returns the exit code. */
static int rekv(const char *args, char **out, char **errtxt)
{
    char errpath[] = "/tmp/rekv-cli-err.XXXXXX";
    int fd = mkstemp(errpath);
    ck_assert_int_ge(fd, 0);
    snprintf(g_cmd, sizeof(g_cmd), "%s %s 2>%s", tu_bin("rekv"), args, errpath);
    int rc = tu_run(g_cmd, out);
    *errtxt = tu_read_file(errpath, NULL);
    unlink(errpath);
    return rc;
}

START_TEST(generate_json_stories)
{
    const char *m = tu_shared("models/stories260K/stories260K.bin");
    if (m == NULL)
        return;
    char args[4096], *out, *err;
    snprintf(args, sizeof(args),
             "generate --model %s --prompt-ids 1,306,2 --max-new-tokens 5 --top-logits 3 --json",
             m);
    int rc = rekv(args, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    json_error_t jerr;
    json_t *o = json_loads(out, 0, &jerr);
    ck_assert_msg(o != NULL, "stdout is not one JSON object: %s", out);
    ck_assert_int_eq(json_array_size(json_object_get(o, "prompt_ids")), 3);
    ck_assert_int_eq(json_array_size(json_object_get(o, "generated_ids")), 5);
    ck_assert(json_is_null(json_object_get(o, "text")));
    json_t *tl = json_object_get(o, "top_logits");
    ck_assert_int_eq(json_array_size(tl), 5);
    json_t *first = json_array_get(json_array_get(tl, 0), 0);
    /* the first top logit's id is the greedy pick */
    ck_assert_int_eq(json_integer_value(json_array_get(first, 0)),
                     json_integer_value(json_array_get(json_object_get(o, "generated_ids"), 0)));
    ck_assert(json_is_object(json_object_get(o, "stats")));
    json_decref(o);
    free(out);
    free(err);
}
END_TEST

START_TEST(generate_text_opt)
{
    const char *m = tu_shared("models/opt-tiny-py");
    if (m == NULL)
        return;
    char args[4096], *out, *err;
    snprintf(args, sizeof(args),
             "generate --model %s --prompt 'def main(' --max-new-tokens 8 --json", m);
    int rc = rekv(args, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_ptr_nonnull(o);
    ck_assert(json_is_string(json_object_get(o, "text")));
    json_t *pi = json_object_get(o, "prompt_ids");
    ck_assert_int_eq(json_integer_value(json_array_get(pi, 0)), 2); /* OPT's BOS */
    json_decref(o);
    free(out);
    free(err);
    /* sampling with a seed is reproducible */
    char *a, *b;
    snprintf(args, sizeof(args),
             "generate --model %s --prompt-ids 2,100,200 --max-new-tokens 12 --temperature 0.9 "
             "--top-p 0.95 --top-k 50 --seed 7 --json",
             m);
    ck_assert_int_eq(rekv(args, &a, &err), 0);
    free(err);
    ck_assert_int_eq(rekv(args, &b, &err), 0);
    free(err);
    json_t *ja = json_loads(a, 0, NULL), *jb = json_loads(b, 0, NULL);
    ck_assert(
        json_equal(json_object_get(ja, "generated_ids"), json_object_get(jb, "generated_ids")));
    json_decref(ja);
    json_decref(jb);
    free(a);
    free(b);
}
END_TEST

/* Through the coordinator (the default: a private trio is started for the call) and in this
 * process (--local), generate prints the same ids, text and top logits, greedy and sampled. On the
 * cpu backend: where "auto" is a GPU the trio keeps an fp16 cache and the local run fp32, which
 * agree only within rounding (test_cuda checks the cuda pipeline against the cpu's). */
START_TEST(generate_via_coordinator_matches_local)
{
    if (tu_skip_where_auto_is_gpu("generate_via_coordinator_matches_local",
                                  "the trio's cache is fp16, the local run's fp32"))
        return;
    const char *models[] = {"models/stories260K/stories260K.bin", "models/opt-tiny-py"};
    for (int mi = 0; mi < 2; mi++) {
        const char *path = tu_shared(models[mi]);
        if (path == NULL)
            return;
        const char *sampling[] = {"", "--temperature 0.9 --top-k 40 --top-p 0.9 --seed 11"};
        for (int si = 0; si < 2; si++) {
            char args[8192], *a, *b, *err;
            snprintf(args, sizeof(args),
                     "generate --model %s --prompt-ids %s --max-new-tokens 10 --top-logits 4 "
                     "--ignore-eos %s --json",
                     path, mi == 0 ? "1,306,400,20" : "2,100,200,300", sampling[si]);
            int rc = rekv(args, &a, &err);
            ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
            free(err);
            strcat(args, " --local");
            rc = rekv(args, &b, &err);
            ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
            free(err);
            json_t *ja = json_loads(a, 0, NULL), *jb = json_loads(b, 0, NULL);
            ck_assert_ptr_nonnull(ja);
            ck_assert_ptr_nonnull(jb);
            const char *keys[] = {"prompt_ids", "generated_ids", "text", "top_logits"};
            for (int k = 0; k < 4; k++)
                ck_assert_msg(
                    json_equal(json_object_get(ja, keys[k]), json_object_get(jb, keys[k])),
                    "%s (%s): \"%s\" differs between the coordinator and --local:\n%s\n%s",
                    models[mi], sampling[si], keys[k], a, b);
            ck_assert_str_eq(
                json_string_value(json_object_get(json_object_get(ja, "stats"), "via")),
                "coordinator");
            json_decref(ja);
            json_decref(jb);
            free(a);
            free(b);
        }
    }
}
END_TEST

/* clo served: a `rekv run --mode clo` worker (skew and head profile made on first use, cached)
 * gives the tokens of a run in this process, well past the point where the head caches start (68
 * tokens): the cache's decisions depend on the sequence alone, not on its batch. */
START_TEST(clo_served_matches_local)
{
    if (tu_skip_where_auto_is_gpu("clo_served_matches_local",
                                  "the trio's cache is fp16, the local run's fp32"))
        return;
    const char *m = tu_shared("models/stories260K/stories260K.bin");
    if (m == NULL)
        return;
    char model[4096], prog[4096];
    snprintf(model, sizeof(model), "%s", m);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv"));
    char *dir = tu_tmpdir(), args[8192], *a, *b, *err;
    setenv("XDG_CACHE_HOME", dir, 1);
    const char *run[] = {prog,     "run", "--model",   model, "--dir", dir,
                         "--mode", "clo", "--backend", "cpu", NULL};
    pid_t pid = tu_spawn(run, NULL, NULL);
    ck_assert_msg(pid > 0, "rekv run --mode clo did not start");
    const char *common = "--prompt-ids 1,306,400,20 --max-new-tokens 120 --ignore-eos --json";
    snprintf(args, sizeof(args), "generate --model %s --socket ipc://%s/control %s", model, dir,
             common);
    int rc = rekv(args, &a, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    free(err);
    snprintf(args, sizeof(args), "generate --model %s --local --mode clo %s", model, common);
    rc = rekv(args, &b, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    free(err);
    json_t *ja = json_loads(a, 0, NULL), *jb = json_loads(b, 0, NULL);
    ck_assert_ptr_nonnull(ja);
    ck_assert_ptr_nonnull(jb);
    ck_assert_int_eq((int)json_array_size(json_object_get(ja, "generated_ids")), 120);
    ck_assert_msg(
        json_equal(json_object_get(ja, "generated_ids"), json_object_get(jb, "generated_ids")),
        "clo: the served tokens differ from --local's:\n%s\n%s", a, b);
    json_decref(ja);
    json_decref(jb);
    free(a);
    free(b);
    ck_assert_int_eq(tu_stop(pid), 0);
    unsetenv("XDG_CACHE_HOME");
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* Copies a shared model directory into tmp so a test can break it. */
static char *copy_model(const char *src)
{
    char *d = tu_tmpdir();
    snprintf(g_cmd, sizeof(g_cmd), "cp -r '%s'/. '%s'/", src, d);
    ck_assert_int_eq(system(g_cmd), 0);
    return d;
}

/* One line on stderr naming `needle`, non-zero exit, nothing on stdout, no crash. */
static void expect_clear_error(const char *args, const char *needle)
{
    char *out, *err;
    int rc = rekv(args, &out, &err);
    ck_assert_msg(rc == 1 || rc == 2, "exit %d (want 1 or 2) for: %s\nstderr: %s", rc, args, err);
    ck_assert_msg(strstr(err, needle) != NULL, "stderr lacks \"%s\": %s", needle, err);
    ck_assert_msg(strchr(err, '\n') == strrchr(err, '\n'), "more than one line: %s", err);
    ck_assert_msg(out[0] == '\0', "stdout not empty: %s", out);
    free(out);
    free(err);
}

START_TEST(bad_input_clear_errors)
{
    const char *opt = tu_shared("models/opt-tiny-py");
    if (opt == NULL)
        return;
    char optdir[4096];
    snprintf(optdir, sizeof(optdir), "%s", opt);
    const char *st = tu_shared("models/stories260K/stories260K.bin");
    if (st == NULL)
        return;
    char stories[4096];
    snprintf(stories, sizeof(stories), "%s", st);
    char args[8192], path[4096];
    char *d = tu_tmpdir();

    /* truncated llama2.c checkpoint */
    snprintf(path, sizeof(path), "%s/trunc.bin", d);
    snprintf(g_cmd, sizeof(g_cmd), "head -c 100000 '%s' > '%s'", stories, path);
    ck_assert_int_eq(system(g_cmd), 0);
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids 1", path);
    expect_clear_error(args, "trunc.bin");

    /* prompt longer than the context (512) */
    char *ids = malloc(600 * 4 + 1), *p = ids;
    for (int i = 0; i < 600; i++)
        p += sprintf(p, "%s%d", i ? "," : "", 1 + i % 300);
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids %s", stories, ids);
    expect_clear_error(args, "longer than the context");
    free(ids);

    /* token id outside the vocabulary */
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids 1,99999", stories);
    expect_clear_error(args, "vocabulary");

    /* text prompt for a model without a tokenizer */
    snprintf(args, sizeof(args), "generate --model %s --prompt hello", stories);
    expect_clear_error(args, "no tokenizer");

    /* emulation: a bad size, and a device too small for the weights */
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids 1 --device-memory 12Q", stories);
    expect_clear_error(args, "--device-memory");
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids 1 --local --device-memory 64K",
             stories);
    expect_clear_error(args, "out of device memory");
    snprintf(args, sizeof(args),
             "generate --model %s --prompt-ids 1 --backend cuda "
             "--link-gbps 1",
             stories);
    expect_clear_error(args, "emulation");

    /* corrupted safetensors: a truncated file */
    char *m1 = copy_model(optdir);
    snprintf(g_cmd, sizeof(g_cmd), "truncate -s 1000000 '%s/model.safetensors'", m1);
    ck_assert_int_eq(system(g_cmd), 0);
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids 2", m1);
    expect_clear_error(args, "model.safetensors");
    tu_rmrf(m1);
    free(m1);

    /* unknown architecture */
    char *m2 = copy_model(optdir);
    snprintf(g_cmd, sizeof(g_cmd),
             "sed -i 's/\"model_type\": \"opt\"/\"model_type\": \"gpt9\"/' '%s/config.json'", m2);
    ck_assert_int_eq(system(g_cmd), 0);
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids 2", m2);
    expect_clear_error(args, "gpt9");
    tu_rmrf(m2);
    free(m2);

    /* a missing tensor: declare one more layer than the file has */
    char *m3 = copy_model(optdir);
    snprintf(g_cmd, sizeof(g_cmd),
             "sed -i 's/\"num_hidden_layers\": 6/\"num_hidden_layers\": 7/' '%s/config.json'", m3);
    ck_assert_int_eq(system(g_cmd), 0);
    snprintf(args, sizeof(args), "generate --model %s --prompt-ids 2", m3);
    expect_clear_error(args, "layers.6");
    tu_rmrf(m3);
    free(m3);

    /* a malformed tokenizer file */
    char *m4 = copy_model(optdir);
    snprintf(g_cmd, sizeof(g_cmd), "echo '{\"a\": ' > '%s/vocab.json'", m4);
    ck_assert_int_eq(system(g_cmd), 0);
    snprintf(args, sizeof(args), "generate --model %s --prompt hi", m4);
    expect_clear_error(args, "vocab.json");
    tu_rmrf(m4);
    free(m4);

    /* a missing model */
    snprintf(args, sizeof(args), "generate --model %s/nope --prompt-ids 1", d);
    expect_clear_error(args, "nope");
    tu_rmrf(d);
    free(d);
}
END_TEST

/* bench decode's JSON: every field of each mode's run, the link's peak, and the cache bytes the
 * recomputing modes move against offload's (the run's output in out) */
static void bench_decode_fields(char *out, char *err)
{
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(o != NULL, "not JSON: %s", out);
    json_t *modes = json_object_get(o, "modes");
    ck_assert_int_eq(json_array_size(modes), 5);
    double offload_bytes = 0;
    size_t i;
    json_t *m;
    json_array_foreach(modes, i, m)
    {
        ck_assert(json_is_true(json_object_get(m, "tokens_match_resident")));
        ck_assert(json_number_value(json_object_get(m, "decode_tokens_per_s")) > 0);
        ck_assert(json_number_value(json_object_get(m, "prefill_s")) > 0);
        ck_assert(json_is_number(json_object_get(m, "ratio_vs_offload")));
        /* the planner's prediction beside the measured step */
        ck_assert(json_number_value(json_object_get(m, "measured_step_s")) > 0);
        ck_assert(json_number_value(json_object_get(m, "predicted_step_s")) > 0);
        ck_assert(json_is_number(json_object_get(m, "prediction_error")));
        /* and corrected online by the run's earlier steps, as a served worker's planner is:
         * the weights are offloaded, so every mode, resident too, predicts link time and its
         * link scale moves from where it started */
        ck_assert(json_number_value(json_object_get(m, "online_predicted_step_s")) > 0);
        ck_assert(json_is_number(json_object_get(m, "online_prediction_error")));
        json_t *sc = json_object_get(m, "scales");
        ck_assert(json_number_value(json_object_get(sc, "compute")) > 0);
        ck_assert(json_number_value(json_object_get(sc, "pcie")) != 1);
        if (strcmp(json_string_value(json_object_get(m, "mode")), "offload") == 0)
            offload_bytes = json_number_value(json_object_get(m, "h2d_kv_bytes_per_token"));
        /* the prefill against the engine's GEMM on its shapes; no memory roofline where the
         * weights cross the link */
        ck_assert(json_number_value(json_object_get(m, "prefill_vs_gemm")) > 0);
        ck_assert(json_object_get(m, "roofline_frac") == NULL);
        /* weights crossing the link: no step is a graph */
        ck_assert(json_is_integer(json_object_get(m, "graph_steps")));
        ck_assert_int_eq(json_integer_value(json_object_get(m, "graph_steps")), 0);
        /* each step blocks its caller at least at its end */
        ck_assert(json_number_value(json_object_get(m, "host_syncs_per_step")) >= 1);
    }
    ck_assert(offload_bytes > 0);
    /* the link's peak, measured in the same run, from every kind of host memory, and each mode's
     * average: never above the emulated 2 Gbit/s = 0.25 GB/s (the emulation sleeps until a copy
     * is due, so it is never faster; how much slower a loaded machine makes it is the bench's) */
    ck_assert_str_eq(json_string_value(json_object_get(o, "weight_dtype")), "F16");
    json_t *lp = json_object_get(o, "link_peak");
    ck_assert_msg(lp != NULL, "no link_peak in %s", out);
    const char *kinds[] = {"h2d_gbps_pinned", "h2d_gbps_arena", "h2d_gbps_pageable"};
    for (int k = 0; k < 3; k++) {
        double g = json_number_value(json_object_get(lp, kinds[k]));
        ck_assert_msg(g > 0 && g < 0.26, "%s %g GB/s on a 0.25 GB/s link", kinds[k], g);
    }
    json_array_foreach(modes, i, m)
    {
        double g = json_number_value(json_object_get(m, "h2d_gbps"));
        ck_assert_msg(g >= 0 && g < 0.26, "%s: %g GB/s over a 0.25 GB/s link",
                      json_string_value(json_object_get(m, "mode")), g);
    }
    json_array_foreach(modes, i, m)
    {
        const char *name = json_string_value(json_object_get(m, "mode"));
        double cache = json_number_value(json_object_get(m, "h2d_kv_bytes_per_token")) +
                       json_number_value(json_object_get(m, "h2d_act_bytes_per_token"));
        if (strcmp(name, "kvpr") == 0 || strcmp(name, "hybrid") == 0 || strcmp(name, "act") == 0)
            ck_assert_msg(cache <= offload_bytes, "%s moves %g cache bytes per token, offload %g",
                          name, cache, offload_bytes);
    }
    json_decref(o);
    free(out);
    free(err);
}

static void bench_decode_push_and_splits(const char *d)
{
    char args[8192], *out, *err;
    int rc;
    json_t *o, *modes, *m;
    size_t i;
    /* pull and push side by side in one run, and kvpr at splits of our choosing: the same tokens,
     * each run says which it was */
    snprintf(args, sizeof(args),
             "bench decode --model %s/m --batch 2 --prompt-len 24 --gen-len 3 "
             "--modes resident,offload,offload+push,hybrid+push,kvpr@5,kvpr@24+push --json",
             d);
    rc = rekv(args, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    o = json_loads(out, 0, NULL);
    ck_assert_msg(o != NULL, "not JSON: %s", out);
    modes = json_object_get(o, "modes");
    ck_assert_int_eq(json_array_size(modes), 6);
    static const int pushed[] = {0, 0, 1, 1, 0, 1}, split[] = {-1, -1, -1, -1, 5, 24};
    json_array_foreach(modes, i, m)
    {
        ck_assert(json_is_true(json_object_get(m, "tokens_match_resident")));
        ck_assert_int_eq(json_is_true(json_object_get(m, "push")), pushed[i]);
        json_t *sp = json_object_get(m, "split");
        ck_assert_int_eq(sp ? json_integer_value(sp) : -1, split[i]);
    }
    json_decref(o);
    free(out);
    free(err);
}

static void bench_decode_auto(const char *d)
{
    char args[8192], *out, *err;
    int rc;
    json_t *o, *m;
    /* auto on a device that holds part of the cache (a deep, narrow model, so the KV outweighs a
     * step's buffers): a streaming technique with each sequence's first tokens on the device,
     * and resident's tokens (a run on an unbounded device) */
    snprintf(args, sizeof(args),
             "%s synth --arch opt --layers 24 --hidden 64 --heads 4 --ffn 128 "
             "--vocab 300 --max-pos 256 --dtype f16 --seed 6 %s/deep >/dev/null",
             tu_bin("rekv-loader"), d);
    ck_assert_int_eq(system(args), 0);
    uint32_t crc[2] = {0, 1};
    for (int bounded = 0; bounded < 3; bounded++) {
        snprintf(args, sizeof(args),
                 "bench decode --model %s/deep --batch 4 --prompt-len 64 --gen-len 4 "
                 "--prefill-chunk 16 --link-gbps 8 --modes %s --json",
                 d,
                 bounded == 2   ? "auto --device-memory 4300K --approximate"
                 : bounded == 1 ? "auto --device-memory 4300K"
                                : "resident");
        rc = rekv(args, &out, &err);
        ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
        o = json_loads(out, 0, NULL);
        ck_assert_msg(o != NULL, "not JSON: %s", out);
        m = json_array_get(json_object_get(o, "modes"), 0);
        if (bounded == 2) { /* --approximate: the pick was priced against infinigen too */
            const char *why = json_string_value(json_object_get(m, "auto"));
            ck_assert_msg(why && strstr(why, "infinigen (approximate)"), "%s", out);
            json_decref(o);
            free(out);
            free(err);
            continue;
        }
        crc[bounded] = (uint32_t)json_integer_value(json_object_get(m, "tokens_crc32c"));
        if (!bounded) { /* resident, weights on the device: against the memory roofline, with
                           the device's copy rate and GEMM (at a prefill step's 4 x 16 rows) */
            json_t *dp = json_object_get(o, "device_peak");
            ck_assert_msg(json_number_value(json_object_get(dp, "copy_gbps")) > 0 &&
                              json_number_value(json_object_get(dp, "gemm_flops_per_s")) > 0 &&
                              json_integer_value(json_object_get(dp, "gemm_rows")) == 64,
                          "%s", out);
            ck_assert(json_number_value(json_object_get(m, "roofline_step_s")) > 0);
            ck_assert(json_number_value(json_object_get(m, "roofline_frac")) > 0);
        }
        if (bounded) {
            /* the planner's line: the pick and its price, infinigen's only when allowed */
            const char *why = json_string_value(json_object_get(m, "auto"));
            ck_assert_msg(why && strstr(why, "step priced") && !strstr(why, "infinigen"), "%s",
                          out);
            const char *mode = json_string_value(json_object_get(m, "mode"));
            ck_assert_str_eq(json_string_value(json_object_get(m, "run")), "auto");
            ck_assert_msg(strcmp(mode, "resident") != 0, "the cache fits 4300K? %s", out);
            json_int_t dev = json_integer_value(json_object_get(m, "device_tokens"));
            ck_assert_msg(dev > 0 && dev < 68, "device part %lld of 68 tokens", (long long)dev);
            /* 3 decode steps, 24 layers, 4 sequences: the part taken from the device */
            ck_assert_int_eq(json_integer_value(json_object_get(m, "tokens_device")),
                             3 * 24 * 4 * dev);
        }
        json_decref(o);
        free(out);
        free(err);
    }
    ck_assert_uint_eq(crc[0], crc[1]);
}

static void bench_decode_bad_split(const char *d)
{
    char args[8192], *out, *err;
    /* a split only for kvpr, and a number */
    snprintf(args, sizeof(args), "bench decode --model %s/m --modes act@3 --json", d);
    ck_assert_int_eq(rekv(args, &out, &err), 2);
    ck_assert_msg(strstr(err, "act@3") != NULL, "%s", err);
    free(out);
    free(err);
}

/* `rekv bench decode`: one JSON object comparing every mode on the same prompts; every mode's
 * tokens equal resident's, each carries the planner's predicted step beside the measured one
 * (also corrected online: the modes that move bytes rescale its link side), and on an MHA model the
 * recomputing modes move fewer bytes. */
START_TEST(bench_decode_json)
{
    char *d = tu_tmpdir(), args[8192], *out, *err;
    snprintf(args, sizeof(args),
             "%s synth --arch opt --layers 2 --hidden 64 --heads 4 --ffn 128 "
             "--vocab 300 --max-pos 256 --dtype f16 --seed 5 %s/m >/dev/null",
             tu_bin("rekv-loader"), d);
    ck_assert_int_eq(system(args), 0);
    snprintf(args, sizeof(args),
             "bench decode --model %s/m --batch 3 --prompt-len 40 --gen-len 3 "
             "--link-gbps 2 --offload-weights --schedule column --gpu-batches 2 --json",
             d);
    int rc = rekv(args, &out, &err);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, err);
    bench_decode_fields(out, err);
    bench_decode_push_and_splits(d);
    bench_decode_auto(d);
    bench_decode_bad_split(d);
    tu_rmrf(d);
    free(d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cli");
    TCase *tc = tcase_create("cli");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, generate_json_stories);
    tcase_add_test(tc, generate_text_opt);
    tcase_add_test(tc, generate_via_coordinator_matches_local);
    tcase_add_test(tc, clo_served_matches_local);
    tcase_add_test(tc, bad_input_clear_errors);
    tcase_add_test(tc, bench_decode_json);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
