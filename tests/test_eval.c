/* test_eval.c — `rekv eval` as a user runs it, on the held-out stories260K samples of
 * ../shared/eval: the resident pipeline reproduces the NLL an independent float64 forward pass
 * computed (the definition there: prefill 32, only decode-step predictions count); every exact
 * mode gives resident's NLL bit for bit on the cpu backend in fp32, with full agreement and no
 * logit error against resident in step; offload moves exactly the bytes eval says offload moves;
 * windows score every token once; bad input is one clear error; on docs8L, where the papers'
 * premises hold, infinigen and clo meet their fidelity bars. Runs the real `rekv` program. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

#define MODEL_REL "models/stories260K/stories260K.bin"
#define SAMPLES_REL "eval/stories260K.samples.json"

static char g_cmd[16384];

/* The model's path into m (tu_shared's storage is reused); 0 when the test data is missing. */
static int model_path(char *m)
{
    const char *p = tu_shared(MODEL_REL);
    if (p == NULL)
        return 0;
    snprintf(m, 4096, "%s", p);
    return tu_shared(SAMPLES_REL) != NULL;
}

/* Runs `rekv eval ARGS --json`; returns the parsed object (the test fails on a non-zero exit). */
static json_t *eval_json(const char *args)
{
    char *out = NULL;
    snprintf(g_cmd, sizeof(g_cmd), "%s eval %s --json 2>/dev/null", tu_bin("rekv"), args);
    int rc = tu_run(g_cmd, &out);
    ck_assert_msg(rc == 0, "exit %d: %s", rc, g_cmd);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    ck_assert_msg(o != NULL, "not one JSON object: %s", out);
    free(out);
    return o;
}

static double num(const json_t *o, const char *k)
{
    json_t *v = json_object_get(o, k);
    ck_assert_msg(json_is_number(v), "no number \"%s\"", k);
    return json_number_value(v);
}

/* Writes sample i's ids as a JSON array into dir; returns the file's path and its NLL. */
static char *sample_file(const char *dir, size_t i, double *nll, size_t *n_ids)
{
    json_error_t je;
    json_t *all = json_load_file(tu_shared(SAMPLES_REL), 0, &je);
    ck_assert_msg(all != NULL, "%s: %s", SAMPLES_REL, je.text);
    ck_assert_int_eq(json_integer_value(json_object_get(all, "prefill")), 32);
    json_t *s = json_array_get(json_object_get(all, "samples"), i);
    ck_assert(s != NULL);
    *nll = json_number_value(json_object_get(s, "nll"));
    *n_ids = json_array_size(json_object_get(s, "ids"));
    char *path = malloc(4200);
    snprintf(path, 4200, "%s/sample%zu.json", dir, i);
    ck_assert_int_eq(json_dump_file(json_object_get(s, "ids"), path, 0), 0);
    json_decref(all);
    return path;
}

START_TEST(resident_reproduces_reference_nll)
{
    char m[4096];
    if (!model_path(m))
        return;
    char *dir = tu_tmpdir(), args[8400];
    for (size_t i = 0; i < 3; i++) {
        double want;
        size_t n;
        char *ids = sample_file(dir, i, &want, &n);
        snprintf(args, sizeof(args), "--model %s --ids %s --backend cpu", m, ids);
        json_t *o = eval_json(args);
        ck_assert_str_eq(json_string_value(json_object_get(o, "mode")), "resident");
        ck_assert_int_eq((long)num(o, "tokens"), (long)n - 32 - 1);
        double got = num(o, "nll");
        ck_assert_msg(fabs(got - want) <= 1e-5 * want, "sample %zu: nll %.7f, reference %.7f", i,
                      got, want);
        ck_assert(fabs(num(o, "ppl") - exp(got)) <= 1e-9 * exp(got));
        json_decref(o);
        free(ids);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

START_TEST(exact_modes_equal_resident)
{
    char m[4096];
    if (!model_path(m))
        return;
    char *dir = tu_tmpdir(), args[8400];
    double ref;
    size_t n;
    char *ids = sample_file(dir, 1, &ref, &n);
    snprintf(args, sizeof(args), "--model %s --ids %s --backend cpu", m, ids);
    json_t *res = eval_json(args);
    double nll = num(res, "nll");
    /* the same NLL bit for bit; kvpr and hybrid with recomputation in the mix */
    static const char *const modes[] = {"offload", "kvpr --split 100", "act", "hybrid --ratio 1:1"};
    for (size_t k = 0; k < sizeof(modes) / sizeof(modes[0]); k++) {
        snprintf(args, sizeof(args),
                 "--model %s --ids %s --backend cpu --cache-dtype f32 --compare resident --mode %s",
                 m, ids, modes[k]);
        json_t *o = eval_json(args);
        ck_assert_msg(num(o, "nll") == nll, "%s: nll %.17g, resident %.17g", modes[k],
                      num(o, "nll"), nll);
        ck_assert_msg(num(o, "agreement") == 1.0, "%s: agreement %g", modes[k],
                      num(o, "agreement"));
        ck_assert_msg(num(o, "max_logit_error") == 0.0, "%s: max logit error %g", modes[k],
                      num(o, "max_logit_error"));
        ck_assert(num(o, "tokens_considered") == num(res, "tokens_considered"));
        ck_assert(num(o, "kv_bytes_offload") == num(res, "kv_bytes_offload"));
        if (k == 0) { /* offload moves every context token's K,V: what eval prices it at */
            ck_assert(num(o, "h2d_kv_bytes") == num(o, "kv_bytes_offload"));
            ck_assert(num(o, "tokens_fetched") == num(o, "tokens_considered"));
            ck_assert(num(o, "h2d_act_bytes") == 0);
        } else { /* the others recompute part of it from activations */
            ck_assert(num(o, "tokens_recomputed") > 0);
            ck_assert(num(o, "h2d_act_bytes") > 0);
            ck_assert(num(o, "h2d_kv_bytes") < num(o, "kv_bytes_offload"));
        }
        json_decref(o);
    }
    json_decref(res);
    free(ids);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* infinigen in eval: selecting every token is resident bit for bit; the speculation moves at most
 * layer 0's KV and the cap's share of the others', and scores better than a random selection of
 * the same size (stories260K is trained: its attention matters). The skew is made once, into a
 * private cache. */
/* What the approximate modes' eval tests share: stories260K, sample 0 of ../shared/eval, a private
 * skew/profile cache, and the resident run's JSON. 0: the model is missing (skipped). */
typedef struct approx_fixture {
    char m[4096];
    char *dir, *ids;
    json_t *res; /* resident */
} approx_fixture;

/* `rekv eval --json` on the fixture's model and sample with the cpu backend and more args. */
static json_t *approx_eval(const approx_fixture *x, const char *more)
{
    char args[8400];
    snprintf(args, sizeof(args), "--model %s --ids %s --backend cpu %s", x->m, x->ids, more);
    return eval_json(args);
}

static int approx_open(approx_fixture *x)
{
    if (!model_path(x->m))
        return 0;
    x->dir = tu_tmpdir();
    setenv("XDG_CACHE_HOME", x->dir, 1);
    double ref;
    size_t n;
    x->ids = sample_file(x->dir, 0, &ref, &n);
    x->res = approx_eval(x, "");
    return 1;
}

static void approx_close(approx_fixture *x)
{
    json_decref(x->res);
    unsetenv("XDG_CACHE_HOME");
    free(x->ids);
    tu_rmrf(x->dir);
    free(x->dir);
}

START_TEST(infinigen_in_eval)
{
    approx_fixture x;
    if (!approx_open(&x))
        return;
    json_t *all = approx_eval(&x, "--mode infinigen --select all --compare resident");
    ck_assert(num(all, "nll") == num(x.res, "nll"));
    ck_assert(num(all, "agreement") == 1.0 && num(all, "max_logit_error") == 0.0);
    ck_assert(num(all, "h2d_kv_bytes") == num(all, "kv_bytes_offload"));
    json_t *sp = approx_eval(&x, "--mode infinigen");
    json_t *rnd = approx_eval(&x, "--mode infinigen --select random");
    double off = num(sp, "kv_bytes_offload"), L = 5;
    ck_assert_msg(num(sp, "h2d_kv_bytes") <= off * (1 + (L - 1) * 0.2) / L,
                  "infinigen moved %g of offload's %g", num(sp, "h2d_kv_bytes"), off);
    ck_assert(num(sp, "alpha") == 4 && num(sp, "fetch_cap") > 0.19 && num(sp, "lookahead") == 1);
    json_t *fr = json_object_get(sp, "layer_fetched_fraction");
    ck_assert_int_eq((int)json_array_size(fr), 5);
    ck_assert(json_number_value(json_array_get(fr, 0)) == 1.0); /* layer 0: everything */
    for (int l = 1; l < 5; l++)
        ck_assert(json_number_value(json_array_get(fr, (size_t)l)) <= 0.2);
    ck_assert_msg(num(sp, "nll") < num(rnd, "nll"), "speculated %g, random %g", num(sp, "nll"),
                  num(rnd, "nll"));
    json_decref(all), json_decref(sp), json_decref(rnd);
    approx_close(&x);
}
END_TEST

START_TEST(clo_in_eval)
{
    approx_fixture x;
    if (!approx_open(&x))
        return;
    json_t *all = approx_eval(&x, "--mode clo --fetch-cap 1 --eta 1 --power 1e-6");
    ck_assert_msg(fabs(num(all, "nll") - num(x.res, "nll")) < 1e-4, "clo, all: %.9g, resident %.9g",
                  num(all, "nll"), num(x.res, "nll"));
    ck_assert(num(all, "head_hits") == 0 && num(all, "head_misses") > 0);
    json_t *d = approx_eval(&x, "--mode clo");
    ck_assert(num(d, "head_hits") > 0 && num(d, "head_misses") > 0);
    ck_assert(num(d, "hit_ratio") ==
              num(d, "head_hits") / (num(d, "head_hits") + num(d, "head_misses")));
    /* per layer and KV head: layer 0 decides nothing (nor would a persistent head); the others'
     * ratios in [0, 1], and their mean (each decides once per step) the whole run's */
    json_t *hr = json_object_get(d, "head_hit_ratio");
    ck_assert_int_eq(json_array_size(hr), 5);
    double sum = 0;
    size_t n = 0, l, g;
    json_t *row, *v;
    json_array_foreach(hr, l, row)
    {
        ck_assert_int_eq(json_array_size(row), 4);
        json_array_foreach(row, g, v)
        {
            ck_assert(l == 0 ? json_is_null(v) : json_is_number(v) || json_is_null(v));
            if (l > 0 && json_is_number(v)) {
                ck_assert(json_number_value(v) >= 0 && json_number_value(v) <= 1);
                sum += json_number_value(v), n++;
            }
        }
    }
    ck_assert_msg(n > 0 && fabs(sum / (double)n - num(d, "hit_ratio")) < 1e-9,
                  "mean of the heads' ratios %g, the run's %g", n ? sum / (double)n : 0,
                  num(d, "hit_ratio"));
    ck_assert_msg(num(d, "h2d_kv_bytes") < 0.2 * num(d, "kv_bytes_offload"),
                  "clo moved %g of offload's %g", num(d, "h2d_kv_bytes"),
                  num(d, "kv_bytes_offload"));
    ck_assert(num(d, "eta") > 0.94 && num(d, "eta") < 0.96 && num(d, "power") == 2);
    /* N_p by default from the measured link (Eq. 12): a count, not "none" */
    ck_assert(json_is_number(json_object_get(d, "persist_np")) && num(d, "persist_np") >= 0);
    json_decref(all), json_decref(d);
    approx_close(&x);
}
END_TEST

/* Where the papers' premises hold — docs8L, trained on English text, its first held-out sample
 * (prefill 64, as ../shared/eval/docs8L.samples.json scores it) — the approximate modes meet
 * issue 44's bars: infinigen within +1% of resident's NLL at no more than 30% of offload's KV
 * bytes (layer 1 speculated from its own input: from layer 0's, +3.3%), clo within +0.5% with at
 * least 88% of its head-steps reused (each head tested on its own query: with layer i-1's, +0.6%
 * on this sample and +1.05% on the third). */
START_TEST(docs8l_approximate_modes_meet_their_bars)
{
    const char *m = tu_shared("models/docs8L/docs8L.bin");
    const char *sp = tu_shared("eval/docs8L.samples.json");
    if (m == NULL || sp == NULL)
        return;
    char model[4096], *dir = tu_tmpdir(), ids[4200], args[12000];
    snprintf(model, sizeof(model), "%s", m);
    setenv("XDG_CACHE_HOME", dir, 1);
    json_error_t je;
    json_t *all = json_load_file(tu_shared("eval/docs8L.samples.json"), 0, &je);
    ck_assert_msg(all != NULL, "%s", je.text);
    json_t *s0 = json_array_get(json_object_get(all, "samples"), 0);
    double oracle = json_number_value(json_object_get(s0, "oracle_top20_nll"));
    snprintf(ids, sizeof(ids), "%s/ids.json", dir);
    ck_assert_int_eq(json_dump_file(json_object_get(s0, "ids"), ids, 0), 0);
    json_decref(all);
    const char *modes[] = {"resident", "infinigen --bounds", "clo"};
    json_t *o[3];
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof(args), "--model %s --ids %s --backend cpu --prefill 64 --mode %s",
                 model, ids, modes[i]);
        o[i] = eval_json(args);
    }
    double res = num(o[0], "nll"), ig = num(o[1], "nll"), clo = num(o[2], "nll");
    double ig_bytes = num(o[1], "h2d_kv_bytes") / num(o[1], "kv_bytes_offload");
    fprintf(stderr, "   docs8L sample 0: resident %.4f, infinigen %.4f (%+.2f%%, %.3f of the bytes), "
                    "clo %.4f (%+.2f%%, %.3f reused)\n",
            res, ig, 100 * (ig / res - 1), ig_bytes, clo, 100 * (clo / res - 1),
            num(o[2], "hit_ratio"));
    ck_assert_msg(ig <= res * 1.01, "infinigen %g against resident %g", ig, res);
    ck_assert_msg(ig_bytes <= 0.30, "infinigen moved %g of offload's bytes", ig_bytes);
    ck_assert_msg(clo <= res * 1.005, "clo %g against resident %g", clo, res);
    ck_assert_msg(num(o[2], "hit_ratio") >= 0.88, "clo reused %g", num(o[2], "hit_ratio"));
    ck_assert(num(o[1], "lookahead") == 1 && num(o[2], "lookahead") == 0);
    /* --bounds: the exact selection at the cap is the sample file's independent oracle (float64
     * numpy, top floor(0.2 p) keys per head, layer 0 whole: 3 decimals), and the speculation
     * closes at least 95% of the gap from a random selection to it */
    ck_assert_msg(fabs(num(o[1], "nll_exact") - oracle) < 0.002, "exact %.5f, the oracle %.3f",
                  num(o[1], "nll_exact"), oracle);
    ck_assert(num(o[1], "nll_random") > num(o[1], "nll") + 1);
    ck_assert_msg(num(o[1], "gap_closed") >= 0.95, "gap closed %g", num(o[1], "gap_closed"));
    /* the premises (first window): layer 0 to 1 unlike, later layers alike (docs8L's README and
     * issue 44: cosine -0.05..-0.01, then 0.9+); every layer's recall a share */
    for (int i = 1; i < 3; i++) {
        json_t *pm = json_object_get(o[i], "premises");
        ck_assert_msg(pm != NULL, "%s: no premises", modes[i]);
        json_t *in = json_object_get(pm, "layer_input_cosine");
        json_t *rc = json_object_get(pm, "recall");
        ck_assert_int_eq(json_array_size(in), 8);
        ck_assert(json_is_null(json_array_get(in, 0)) && json_is_null(json_array_get(rc, 0)));
        ck_assert_msg(json_number_value(json_array_get(in, 1)) < 0.2, "layer 0 to 1: %g",
                      json_number_value(json_array_get(in, 1)));
        for (size_t l = 2; l < 6; l++)
            ck_assert_msg(json_number_value(json_array_get(in, l)) > 0.9, "layer %zu: %g", l,
                          json_number_value(json_array_get(in, l)));
        for (size_t l = 1; l < 8; l++) {
            double r = json_number_value(json_array_get(rc, l));
            ck_assert_msg(r > 0.5 && r <= 1, "recall of layer %zu: %g", l, r);
        }
        ck_assert_uint_eq((unsigned)num(pm, "steps"), 447);
    }
    for (int i = 0; i < 3; i++)
        json_decref(o[i]);
    unsetenv("XDG_CACHE_HOME");
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* Windows of 200 over 501 tokens: three windows, and still every token after the first 33 scored
 * once; with less context than the whole text the NLL is not the full-context one. */
START_TEST(windows_score_every_token_once)
{
    char m[4096];
    if (!model_path(m))
        return;
    char *dir = tu_tmpdir(), args[8400];
    double ref;
    size_t n;
    char *ids = sample_file(dir, 0, &ref, &n);
    snprintf(args, sizeof(args), "--model %s --ids %s --backend cpu --window 200", m, ids);
    json_t *o = eval_json(args);
    ck_assert_int_eq((long)num(o, "tokens"), (long)n - 33);
    ck_assert_int_eq((long)num(o, "windows"), 3);
    ck_assert_int_eq((long)num(o, "window"), 200);
    ck_assert(isfinite(num(o, "nll")) && num(o, "nll") > 0);
    ck_assert_msg(fabs(num(o, "nll") - ref) > 1e-6, "windowed nll equals the full-context one");
    json_decref(o);
    free(ids);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* One line on stderr naming `needle`, a non-zero exit, nothing on stdout. */
static void expect_clear_error(const char *args, const char *needle)
{
    char errpath[] = "/tmp/rekv-eval-err.XXXXXX";
    int fd = mkstemp(errpath);
    ck_assert_int_ge(fd, 0);
    close(fd);
    char *out = NULL;
    snprintf(g_cmd, sizeof(g_cmd), "%s eval %s 2>%s", tu_bin("rekv"), args, errpath);
    int rc = tu_run(g_cmd, &out);
    char *err = tu_read_file(errpath, NULL);
    unlink(errpath);
    ck_assert_msg(rc == 1 || rc == 2, "exit %d for: %s\nstderr: %s", rc, args, err);
    ck_assert_msg(strstr(err, needle) != NULL, "stderr lacks \"%s\": %s", needle, err);
    ck_assert_msg(strchr(err, '\n') == strrchr(err, '\n'), "more than one line: %s", err);
    ck_assert_msg(out[0] == '\0', "stdout not empty: %s", out);
    free(out);
    free(err);
}

START_TEST(bad_input_clear_errors)
{
    char m[4096];
    if (!model_path(m))
        return;
    char *dir = tu_tmpdir(), path[4200], args[8400];
    struct {
        const char *content, *needle;
    } cases[] = {
        {"{\"ids\": [1, 2]}", "expected a JSON array of token ids"},
        {"[1, 2, \"x\"]", "element 2 is not a token id"},
        {"[1, 2, -3]", "element 2 is not a token id"},
        {"[1, 2, 99999]", "outside the vocabulary"},
        {"[1, 2, 3]", "leave nothing to score"},
        {"[1, 2", "sample.json"},
    };
    snprintf(path, sizeof(path), "%s/sample.json", dir);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        FILE *f = fopen(path, "w");
        ck_assert(f != NULL);
        fputs(cases[i].content, f);
        fclose(f);
        snprintf(args, sizeof(args), "--model %s --ids %s --backend cpu", m, path);
        expect_clear_error(args, cases[i].needle);
    }
    FILE *f = fopen(path, "w");
    ck_assert(f != NULL);
    fputs("[1, 2, 3]", f);
    fclose(f);
    snprintf(args, sizeof(args), "--model %s --ids %s --window 20 --prefill 32", m, path);
    expect_clear_error(args, "--window >= prefill + 2");
    snprintf(args, sizeof(args), "--model %s --text %s", m, path);
    expect_clear_error(args, "has no tokenizer");
    snprintf(args, sizeof(args), "--model %s --ids %s --compare offload", m, path);
    expect_clear_error(args, "only resident can be compared");
    snprintf(args, sizeof(args), "--model %s --ids %s --mode clo --bounds", m, path);
    expect_clear_error(args, "--bounds needs --mode infinigen");
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("eval");
    TCase *tc = tcase_create("eval");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, resident_reproduces_reference_nll);
    tcase_add_test(tc, exact_modes_equal_resident);
    tcase_add_test(tc, windows_score_every_token_once);
    tcase_add_test(tc, bad_input_clear_errors);
    tcase_add_test(tc, infinigen_in_eval);
    tcase_add_test(tc, clo_in_eval);
    tcase_add_test(tc, docs8l_approximate_modes_meet_their_bars);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
