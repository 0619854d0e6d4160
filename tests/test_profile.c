/* test_profile.c — the profiler (gpuworker/profile.h) on the cpu backend: with link emulation the
 * measured link is the configured one, the fitted T_load_kv and T_kv_gen grow with n, the cache
 * round-trips exactly and never trusts a corrupted, truncated, wrong-version or foreign file, the
 * cache file depends on the model and the link; and `rekv profile --json` as a program. */
#include "common/version.h"
#include "gpuworker/profile.h"
#include "tests/testutil.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A small OPT-shaped model (the shapes of shared/models/opt-tiny-py): no file needed. */
static rekv_model_config opt_config(void)
{
    rekv_model_config c;
    memset(&c, 0, sizeof(c));
    c.arch = REKV_ARCH_OPT;
    c.rope = REKV_ROPE_NONE;
    c.act = REKV_ACT_RELU;
    c.n_layers = 6;
    c.hidden = 256;
    c.n_heads = 8;
    c.n_kv_heads = 8;
    c.head_dim = 32;
    c.ffn = 1024;
    c.vocab = 4096;
    c.max_pos = 1024;
    c.embed_dim = 256;
    c.qkv_bias = c.o_bias = c.ffn_bias = c.norm_bias = 1;
    c.dtype = REKV_DTYPE_F16;
    return c;
}

/* A Llama-shaped one with GQA and RoPE (the T_kv_gen path that rotates K). */
static rekv_model_config llama_config(void)
{
    rekv_model_config c = opt_config();
    c.arch = REKV_ARCH_LLAMA;
    c.rope = REKV_ROPE_HALF;
    c.act = REKV_ACT_SILU;
    c.hidden = 128;
    c.n_heads = 8;
    c.n_kv_heads = 2;
    c.head_dim = 16;
    c.ffn = 384;
    c.rope_theta = 10000;
    c.qkv_bias = c.o_bias = c.ffn_bias = c.norm_bias = 0;
    c.dtype = REKV_DTYPE_BF16;
    return c;
}

static void measure(const rekv_model_config *c, const rekv_link_config *link, rekv_profile *p)
{
    rekv_err err = {0};
    rekv_backend *be = NULL;
    ck_assert_msg(rekv_backend_cpu_create(link, &be, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_profile_measure(c, be, link, p, &err) == 0, "%s", err.msg);
    rekv_backend_destroy(be);
}

static void check_models(const rekv_profile *p)
{
    for (int d = 0; d < REKV_PROFILE_DTYPES; d++) {
        const rekv_linear *ms[2] = {&p->load_kv[d], &p->kv_gen[d]};
        for (int i = 0; i < 2; i++) {
            ck_assert(ms[i]->a >= 0 && isfinite(ms[i]->a));
            ck_assert(ms[i]->b > 0 && isfinite(ms[i]->b));
            double prev = 0;
            for (int n = 16; n <= 4096; n *= 4) {
                double t = rekv_linear_eval(ms[i], n);
                ck_assert_msg(t > prev, "model %d/%d not increasing at n=%d", d, i, n);
                prev = t;
            }
        }
    }
    ck_assert(p->gemm_kv_flops > 1e6 && p->gemm_ffn_flops > 1e6 && p->attn_flops > 1e6);
    ck_assert(p->recomp_flops[REKV_PROFILE_F32] > 1e6 && p->recomp_flops[REKV_PROFILE_F16] > 1e6);
    ck_assert(p->attn_chunk_flops > 1e6);
    ck_assert(p->h2d_bw > 0 && p->d2h_bw > 0 && p->h2d_latency >= 0 && p->d2h_latency >= 0);
    ck_assert(p->t_load_w > 0 && p->layer_weight_bytes > 0);
}

static int within(double got, double want, double rel)
{
    return fabs(got - want) <= rel * want;
}

/* A fixed cost the emulated link imposes, as the profile measured it: never less than configured
 * (the emulation cannot make a copy faster), and no more than a quarter over plus 2 ms — a timed
 * sleep on a loaded machine wakes late by an absolute amount, which lands in the fixed cost. */
static int latency_like(double got, double want)
{
    return got >= 0.9 * want && got <= 1.25 * want + 2e-3;
}

/* 2 Gbit/s each way and 400 us per copy. The cpu backend's copies end by sleeping until their
 * due time, and on a virtual machine a timed sleep wakes 20-50 us late, which the profile rightly
 * reports as latency; at 400 us that stays well inside the tolerance. */
#define LINK_LAT_US 400.0

START_TEST(test_emulated_link)
{
    rekv_model_config c = opt_config();
    rekv_link_config link = {.gbps = 2.0, .latency_us = LINK_LAT_US};
    rekv_profile p;
    measure(&c, &link, &p);
    double bw = 2e9 / 8;
    ck_assert_msg(within(p.h2d_bw, bw, 0.25), "h2d %g B/s, configured %g", p.h2d_bw, bw);
    ck_assert_msg(within(p.d2h_bw, bw, 0.25), "d2h %g B/s, configured %g", p.d2h_bw, bw);
    ck_assert_msg(latency_like(p.h2d_latency, LINK_LAT_US * 1e-6), "h2d latency %g s",
                  p.h2d_latency);
    ck_assert_msg(latency_like(p.d2h_latency, LINK_LAT_US * 1e-6), "d2h latency %g s",
                  p.d2h_latency);
    /* loading fp32 K,V rows is the link: slope = row bytes / bandwidth, intercept one latency */
    double row = 2.0 * 256 * 4;
    ck_assert_msg(within(p.load_kv[REKV_PROFILE_F32].b, row / bw, 0.25), "T_load_kv slope %g",
                  p.load_kv[REKV_PROFILE_F32].b);
    ck_assert_msg(latency_like(p.load_kv[REKV_PROFILE_F32].a, LINK_LAT_US * 1e-6),
                  "T_load_kv intercept %g", p.load_kv[REKV_PROFILE_F32].a);
    /* an fp16 cache moves half the bytes over this slow link */
    ck_assert(p.load_kv[REKV_PROFILE_F16].b < p.load_kv[REKV_PROFILE_F32].b);
    ck_assert(within(p.t_load_w, p.h2d_latency + p.layer_weight_bytes / p.h2d_bw, 1e-9));
    ck_assert_str_eq(p.backend, "cpu");
    ck_assert(p.link.gbps == 2.0 && p.link.latency_us == LINK_LAT_US);
    check_models(&p);
    ck_assert_msg(p.measure_s < 30.0, "measuring took %.2f s", p.measure_s); /* no runaway */

    rekv_cost_profile cp;
    rekv_profile_to_cost(&p, REKV_DTYPE_F16, &cp);
    ck_assert(cp.h2d_bw == p.h2d_bw && cp.h2d_latency == p.h2d_latency);
    /* recomputation priced at the rate of its whole path for the cache dtype */
    ck_assert(cp.gemm_flops == p.recomp_flops[REKV_PROFILE_F16] && cp.t_load_w == p.t_load_w);
    ck_assert(cp.load_kv.b == p.load_kv[REKV_PROFILE_F16].b);
    ck_assert(cp.kv_gen.a == p.kv_gen[REKV_PROFILE_F16].a);
}
END_TEST

START_TEST(test_unthrottled_gqa)
{
    rekv_model_config c = llama_config();
    rekv_profile p;
    measure(&c, NULL, &p);
    check_models(&p);
    ck_assert(p.link.gbps == 0);
    ck_assert_int_eq(p.attn_ctx, 512);
    /* host memory copies run at gigabytes per second */
    ck_assert_msg(p.h2d_bw > 3e8, "h2d %g B/s", p.h2d_bw);
    ck_assert_msg(p.measure_s < 30.0, "measuring took %.2f s", p.measure_s); /* no runaway */
}
END_TEST

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* Rewrites one top-level field of the JSON file at path (NULL value: deletes it). */
static void edit_json(const char *path, const char *field, json_t *value)
{
    json_error_t je;
    json_t *o = json_load_file(path, 0, &je);
    ck_assert_ptr_nonnull(o);
    if (value)
        json_object_set_new(o, field, value);
    else
        json_object_del(o, field);
    ck_assert_int_eq(json_dump_file(o, path, JSON_REAL_PRECISION(17)), 0);
    json_decref(o);
}

START_TEST(test_cache)
{
    char *dir = tu_tmpdir();
    char sub[4200];
    snprintf(sub, sizeof(sub), "%s/a/b", dir); /* directories are created */
    rekv_model_config c = opt_config();
    rekv_link_config link = {.gbps = 0, .latency_us = 10};
    rekv_err err = {0};
    rekv_backend *be = NULL;
    ck_assert(rekv_backend_cpu_create(&link, &be, &err) == 0);

    rekv_profile p1, p2;
    rekv_profile_origin o;
    ck_assert_msg(rekv_profile_load_or_measure(&c, be, &link, sub, 0, &p1, &o, &err) == 0, "%s",
                  err.msg);
    ck_assert(!o.loaded && o.saved);
    ck_assert_msg(strstr(o.reason, "no such file") != NULL, "%s", o.reason);
    ck_assert(strncmp(o.path, sub, strlen(sub)) == 0);
    ck_assert_int_eq(access(o.path, R_OK), 0);
    char tmpname[4300];
    snprintf(tmpname, sizeof(tmpname), "%s.tmp.%ld", o.path, (long)getpid());
    ck_assert(access(tmpname, F_OK) != 0); /* renamed into place */

    /* loaded back: the same values, bit for bit */
    ck_assert(rekv_profile_load_or_measure(&c, be, &link, sub, 0, &p2, &o, &err) == 0);
    ck_assert(o.loaded && !o.saved && o.reason[0] == '\0');
    ck_assert(memcmp(&p1, &p2, sizeof(p1)) == 0);

    char key[2048], path[4096];
    ck_assert(rekv_profile_key(&c, "cpu", &link, key, sizeof(key), &err) == 0);
    /* the build is in the key: another rekv (other kernels) measures again */
    ck_assert_msg(strstr(key, rekv_version()) != NULL, "%s", key);
    ck_assert(rekv_profile_load(o.path, key, &p2, &err) == 0);
    ck_assert(memcmp(&p1, &p2, sizeof(p1)) == 0);
    strcpy(path, o.path);

    /* another key (machine, model, link) is refused even when its file is read directly */
    rekv_err e2 = {0};
    ck_assert_int_eq(rekv_profile_load(path, "another key", &p2, &e2), -EINVAL);
    ck_assert_msg(strstr(e2.msg, "key") != NULL, "%s", e2.msg);

    /* a wrong version, a missing field, a bad value, a corrupted file: re-measured and rewritten */
    struct {
        const char *field;
        json_t *value;
        const char *text; /* whole file instead, when not NULL */
        const char *why;
    } bad[] = {
        {"version", json_integer(REKV_PROFILE_VERSION + 1), NULL, "version"},
        {"attn_flops_per_s", NULL, NULL, "attn_flops_per_s"},
        {"h2d_bw_bytes_per_s", json_real(-5), NULL, "h2d_bw_bytes_per_s"},
        {"gemm_rows", json_string("many"), NULL, "gemm_rows"},
        {"load_kv", json_object(), NULL, "load_kv"},
        {NULL, NULL, "{\"version\": 1, \"key\": \"trunc", "line"},
        {NULL, NULL, "", ""},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        if (bad[i].text)
            write_text(path, bad[i].text);
        else
            edit_json(path, bad[i].field, bad[i].value);
        rekv_err le = {0};
        ck_assert_int_eq(rekv_profile_load(path, key, &p2, &le), -EINVAL);
        ck_assert_msg(strstr(le.msg, bad[i].why) != NULL, "case %zu: %s", i, le.msg);
        ck_assert(rekv_profile_load_or_measure(&c, be, &link, sub, 0, &p2, &o, &err) == 0);
        ck_assert_msg(!o.loaded && o.saved, "case %zu trusted", i);
        ck_assert(rekv_profile_load(path, key, &p2, &err) == 0); /* valid again */
    }

    /* --reprofile: measured although the file is valid */
    ck_assert(rekv_profile_load_or_measure(&c, be, &link, sub, 1, &p2, &o, &err) == 0);
    ck_assert(!o.loaded && o.saved && strstr(o.reason, "asked") != NULL);

    /* a different model or link gives a different file; the latency of no emulation does not */
    char other[4096];
    rekv_model_config c2 = c;
    c2.hidden = 512;
    ck_assert(rekv_profile_path(&c2, "cpu", &link, sub, other, sizeof(other), &err) == 0);
    ck_assert_str_ne(other, path);
    c2 = c;
    c2.n_kv_heads = 4;
    ck_assert(rekv_profile_path(&c2, "cpu", &link, sub, other, sizeof(other), &err) == 0);
    ck_assert_str_ne(other, path);
    rekv_link_config l2 = {.gbps = 1.0, .latency_us = 10};
    ck_assert(rekv_profile_path(&c, "cpu", &l2, sub, other, sizeof(other), &err) == 0);
    ck_assert_str_ne(other, path);
    char other2[4096];
    l2.latency_us = 20;
    ck_assert(rekv_profile_path(&c, "cpu", &l2, sub, other2, sizeof(other2), &err) == 0);
    ck_assert_str_ne(other, other2);
    l2 = (rekv_link_config){.gbps = 0, .latency_us = 99};
    ck_assert(rekv_profile_path(&c, "cpu", &l2, sub, other, sizeof(other), &err) == 0);
    ck_assert_str_eq(other, path);
    ck_assert(rekv_profile_path(&c, "cuda", &link, sub, other, sizeof(other), &err) == 0);
    ck_assert_str_ne(other, path);

    /* the default directory follows XDG_CACHE_HOME */
    setenv("XDG_CACHE_HOME", dir, 1);
    ck_assert(rekv_profile_path(&c, "cpu", &link, NULL, other, sizeof(other), &err) == 0);
    char want[4200];
    snprintf(want, sizeof(want), "%s/rekv/profiles/", dir);
    ck_assert_msg(strncmp(other, want, strlen(want)) == 0, "%s", other);

    /* an unwritable cache still gives a profile */
    snprintf(other, sizeof(other), "%s/file", dir);
    write_text(other, "x");
    ck_assert(rekv_profile_load_or_measure(&c, be, &link, other, 0, &p2, &o, &err) == 0);
    ck_assert(!o.loaded && !o.saved && strstr(o.reason, "not saved") != NULL);

    rekv_backend_destroy(be);
    tu_rmrf(dir);
}
END_TEST

/* `rekv profile --json` as a program, once the CLI has the command. */
START_TEST(test_cli)
{
    const char *model = tu_shared("models/opt-tiny-py");
    if (!model)
        return;
    char *help = NULL;
    char cmd[8192];
    snprintf(cmd, sizeof(cmd), "%s profile --help 2>&1", tu_bin("rekv"));
    int st = tu_run(cmd, &help);
    int wired = st == 0 && help && strstr(help, "--reprofile") != NULL;
    ck_assert_msg(wired, "%s profile --help does not describe --reprofile: %s", tu_bin("rekv"),
                  help ? help : "(nothing)");
    free(help);
    char *dir = tu_tmpdir();
    for (int run = 0; run < 2; run++) {
        snprintf(cmd, sizeof(cmd),
                 "XDG_CACHE_HOME=%s %s profile --model %s --link-gbps 1 --link-latency-us 50 "
                 "--json",
                 dir, tu_bin("rekv"), model);
        char *out = NULL;
        ck_assert_int_eq(tu_run(cmd, &out), 0);
        json_error_t je;
        json_t *o = json_loads(out, 0, &je);
        ck_assert_msg(o != NULL, "not JSON: %s", out);
        json_t *cache = json_object_get(o, "cache"), *prof = json_object_get(o, "profile");
        ck_assert(json_is_true(json_object_get(cache, "loaded")) == (run == 1));
        double bw = json_number_value(json_object_get(prof, "h2d_bw_bytes_per_s"));
        ck_assert_msg(within(bw, 1e9 / 8, 0.25), "%g", bw);
        json_t *plans = json_object_get(o, "planner");
        ck_assert_int_eq(json_array_size(plans), 3);
        for (size_t i = 0; i < 3; i++) {
            json_t *r = json_array_get(plans, i);
            ck_assert(json_is_string(json_object_get(r, "best")));
            ck_assert(json_integer_value(json_object_get(r, "kvpr_split")) >= 0);
            ck_assert(json_integer_value(json_object_get(r, "kvpr_split")) <=
                      json_integer_value(json_object_get(r, "ctx")));
        }
        json_decref(o);
        free(out);
    }
    tu_rmrf(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("profile");
    TCase *tc = tcase_create("profile");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_emulated_link);
    tcase_add_test(tc, test_unthrottled_gqa);
    tcase_add_test(tc, test_cache);
    tcase_add_test(tc, test_cli);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
