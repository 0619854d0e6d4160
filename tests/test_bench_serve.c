/* test_bench_serve.c — `rekv bench serve` as a user runs it: the real rekv starting its private
 * trio (kvstore, worker, coordinator) per mode. Asserts the JSON's shape and counts — every job
 * finished, none failed, every token streamed, the admitted concurrency between 1 and N and
 * smaller at a tiny arena than at a big one, failures counted and exit 1 — never a time. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

#define JOBS 6
#define NEW 16

static char g_cmd[16384];

/* Runs `rekv ARGS`, capturing stdout and stderr separately. Returns the exit code. */
static int rekv(const char *args, char **out, char **errtxt)
{
    char errpath[] = "/tmp/rekv-serve-err.XXXXXX";
    int fd = mkstemp(errpath);
    ck_assert_int_ge(fd, 0);
    close(fd);
    snprintf(g_cmd, sizeof(g_cmd), "%s %s 2>%s", tu_bin("rekv"), args, errpath);
    int rc = tu_run(g_cmd, out);
    *errtxt = tu_read_file(errpath, NULL);
    unlink(errpath);
    return rc;
}

/* A small MHA OPT (4 heads, 4 KV heads), made once by main before the tests fork: a job of 32 + 16
 * tokens takes 3 KV blocks per layer. */
static char g_model[4096];

static const char *model(void) { return g_model; }

/* Runs the bench, checks the exit code and returns its JSON. */
static json_t *bench(const char *extra, int want_rc)
{
    char args[8192], *out, *err;
    snprintf(args, sizeof(args),
             "bench serve --model %s --jobs %d --prompt-len 32 --max-new-tokens %d %s --json",
             model(), JOBS, NEW, extra);
    int rc = rekv(args, &out, &err);
    ck_assert_msg(rc == want_rc, "%s: exit %d (want %d): %s", args, rc, want_rc, err);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(o != NULL, "not one JSON object: %s (stderr %s)", out, err);
    ck_assert_str_eq(json_string_value(json_object_get(o, "bench")), "serve");
    ck_assert_int_eq(json_integer_value(json_object_get(o, "jobs")), JOBS);
    free(out);
    free(err);
    return o;
}

static json_int_t geti(json_t *m, const char *k)
{
    json_t *v = json_object_get(m, k);
    ck_assert_msg(json_is_integer(v), "no integer %s", k);
    return json_integer_value(v);
}

/* Every job done, none failed, the tokens of n_jobs_tokens jobs (the long prompt's included)
 * streamed, the latencies present and ordered, at most that many jobs running at once. */
static void check_all_done(json_t *m, int n_jobs_tokens)
{
    ck_assert_int_eq(geti(m, "jobs_done"), JOBS);
    ck_assert_int_eq(geti(m, "jobs_failed"), 0);
    ck_assert_int_eq(geti(m, "jobs_too_large"), 0);
    ck_assert_int_eq(geti(m, "tokens"), n_jobs_tokens * NEW);
    ck_assert(json_number_value(json_object_get(m, "tokens_per_s")) > 0);
    const char *lat[] = {"ttft_s", "itl_s"};
    for (int k = 0; k < 2; k++) {
        json_t *l = json_object_get(m, lat[k]);
        ck_assert_msg(json_is_real(json_object_get(l, "p50")) &&
                          json_is_real(json_object_get(l, "p99")),
                      "no %s p50/p99", lat[k]);
        ck_assert(json_real_value(json_object_get(l, "p50")) > 0);
        ck_assert(json_real_value(json_object_get(l, "p50")) <=
                  json_real_value(json_object_get(l, "p99")));
    }
    json_int_t a = geti(m, "admitted_concurrency");
    ck_assert_msg(a >= 1 && a <= n_jobs_tokens, "admitted concurrency %lld of %d jobs",
                  (long long)a, n_jobs_tokens);
}

/* Offload and hybrid at a big arena (everything fits) and at a tiny one (one job's KV): the same
 * jobs all finish, and the tiny arena admits fewer at once, holding the rest for room. */
START_TEST(serve_counts_and_admission)
{
    json_t *big = bench("--modes offload,hybrid --arena 64M", 0);
    json_t *tiny = bench("--modes offload,hybrid --arena 64K", 0);
    ck_assert_int_eq(json_integer_value(json_object_get(big, "arena_bytes")), 64 << 20);
    ck_assert_int_eq(json_integer_value(json_object_get(tiny, "arena_bytes")), 64 << 10);
    json_t *mb = json_object_get(big, "modes"), *mt = json_object_get(tiny, "modes");
    ck_assert_int_eq(json_array_size(mb), 2);
    ck_assert_int_eq(json_array_size(mt), 2);
    for (size_t i = 0; i < 2; i++) {
        json_t *b = json_array_get(mb, i), *t = json_array_get(mt, i);
        ck_assert_str_eq(json_string_value(json_object_get(b, "mode")), i ? "hybrid" : "offload");
        ck_assert_str_eq(json_string_value(json_object_get(t, "mode")), i ? "hybrid" : "offload");
        check_all_done(b, JOBS);
        check_all_done(t, JOBS);
        ck_assert_msg(geti(t, "admitted_concurrency") < geti(b, "admitted_concurrency"),
                      "%s: %lld running at once at 64 KiB, %lld at 64 MiB",
                      json_string_value(json_object_get(b, "mode")),
                      (long long)geti(t, "admitted_concurrency"),
                      (long long)geti(b, "admitted_concurrency"));
        ck_assert_int_eq(geti(b, "jobs_held_for_room"), 0);
        ck_assert_int_ge(geti(t, "jobs_held_for_room"), 1);
    }
    json_decref(big);
    json_decref(tiny);
}
END_TEST

/* Hybrid against offload at one small arena with no spill tier (the arena is all the room,
 * 160 KiB: three jobs' KV, six jobs' activations), behind an emulated 0.5 Gbit/s link where moving
 * a token's K,V costs more than rebuilding it: offload holds jobs back for room, hybrid's
 * demand-aware pattern admits at least 1.5x as many at once (all ACT: all six), and admission
 * charged each job at the pattern its sequence was made with — no step failed for room, so
 * nothing was re-queued. */
START_TEST(serve_hybrid_admits_more)
{
    json_t *o = bench("--modes offload,hybrid --arena 160K --spill-bytes 0 --link-gbps 0.5", 0);
    ck_assert_int_eq(json_integer_value(json_object_get(o, "spill_bytes")), 0);
    json_t *ms = json_object_get(o, "modes");
    json_t *off = json_array_get(ms, 0), *hyb = json_array_get(ms, 1);
    ck_assert_str_eq(json_string_value(json_object_get(hyb, "mode")), "hybrid");
    for (int i = 0; i < 2; i++) {
        json_t *m = i ? hyb : off;
        check_all_done(m, JOBS);
        ck_assert_int_eq(geti(m, "requeued"), 0);
    }
    ck_assert_int_ge(geti(off, "jobs_held_for_room"), 1);
    json_int_t a_off = geti(off, "admitted_concurrency"), a_hyb = geti(hyb, "admitted_concurrency");
    ck_assert_msg(2 * a_hyb >= 3 * a_off, "admitted at once: hybrid %lld, offload %lld",
                  (long long)a_hyb, (long long)a_off);
    json_decref(o);
}
END_TEST

/* --long-prompt: one more job, of 160 prompt tokens, joins while the others decode; it finishes
 * too and the report says the others' ITL p99 before it and while it ran. */
START_TEST(serve_long_prompt)
{
    json_t *o = bench("--modes offload --arena 64M --long-prompt 160", 0);
    ck_assert_int_eq(json_integer_value(json_object_get(o, "long_prompt")), 160);
    json_t *m = json_array_get(json_object_get(o, "modes"), 0);
    check_all_done(m, JOBS + 1);
    json_t *lp = json_object_get(m, "long_prompt");
    ck_assert_msg(json_is_object(lp), "no long_prompt report");
    ck_assert(json_real_value(json_object_get(lp, "ttft_s")) > 0);
    ck_assert(json_real_value(json_object_get(lp, "itl_p99_before_s")) > 0);
    ck_assert(json_real_value(json_object_get(lp, "itl_p99_during_s")) > 0);
    ck_assert(json_is_real(json_object_get(lp, "itl_p99_ratio")));
    json_decref(o);
}
END_TEST

/* An arena smaller than one job's KV: every job fails at once (never admitted), the bench counts
 * them, says why, and exits 1. */
START_TEST(serve_counts_failures)
{
    json_t *o = bench("--modes offload --arena 32K", 1);
    json_t *m = json_array_get(json_object_get(o, "modes"), 0);
    ck_assert_int_eq(geti(m, "jobs_failed"), JOBS);
    ck_assert_int_eq(geti(m, "jobs_done"), 0);
    ck_assert_int_eq(geti(m, "jobs_too_large"), JOBS);
    ck_assert_int_eq(geti(m, "tokens"), 0);
    const char *why = json_string_value(json_object_get(m, "first_error"));
    ck_assert_msg(why && strstr(why, "kvstore host memory"), "first_error: %s", why ? why : "-");
    json_decref(o);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("bench_serve");
    TCase *tc = tcase_create("bench_serve");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, serve_counts_and_admission);
    tcase_add_test(tc, serve_hybrid_admits_more);
    tcase_add_test(tc, serve_long_prompt);
    tcase_add_test(tc, serve_counts_failures);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    char dir[2048];
    return tu_run_suite_synth(suite,
                              "--arch opt --layers 2 --hidden 64 --heads 4 "
                              "--ffn 128 --vocab 300 --max-pos 256 --dtype f16 --seed 5",
                              dir, sizeof(dir), g_model, sizeof(g_model));
}
