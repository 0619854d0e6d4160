/* test_bench_decode.c — `rekv bench decode` as a user runs it when a mode cannot run: a device
 * (the cpu backend's emulated --device-memory) too small for resident's whole KV cache but big
 * enough for the streaming modes' layer buffers. The failing run's entry carries its error, the
 * others still run and report (exit 0); when every run fails, each says why and the exit is 1.
 * Every run that ran reports its peak resident memory. A device the recomputation fills keeps
 * running as the context grows; a yardstick the run left no room for is lost, not the run.
 * Asserts the JSON's shape, never a time. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

static char g_cmd[16384];
static char g_model[4096];

/* Runs `rekv bench decode` on the model with extra, checks the exit code, returns the JSON. */
static json_t *bench(const char *extra, int want_rc)
{
    char *out = NULL;
    snprintf(g_cmd, sizeof(g_cmd),
             "%s bench decode --model %s --backend cpu --batch 8 --prompt-len 200 "
             "--prefill-chunk 16 --gen-len 3 --json %s",
             tu_bin("rekv"), g_model, extra);
    int rc = tu_run(g_cmd, &out);
    ck_assert_msg(rc == want_rc, "%s: exit %d, want %d: %s", g_cmd, rc, want_rc, out);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(o != NULL, "not JSON: %s", out);
    free(out);
    return o;
}

static json_t *run_of(json_t *o, size_t i)
{
    json_t *m = json_array_get(json_object_get(o, "modes"), i);
    ck_assert(m != NULL);
    return m;
}

/* Run m ran: no error, and a decode rate. */
static void assert_ran(json_t *m)
{
    ck_assert_msg(json_object_get(m, "error") == NULL, "%s failed: %s",
                  json_string_value(json_object_get(m, "run")),
                  json_string_value(json_object_get(m, "error")));
    ck_assert(json_number_value(json_object_get(m, "decode_tokens_per_s")) > 0);
}

/* 8 layers of a 64-wide OPT, 8 sequences of 203 tokens: resident's fp32 KV cache is 6.6 MB, more
 * than a 5 MiB device; offload and kvpr hold two layers' worth. */
START_TEST(failing_mode_reported_others_run)
{
    json_t *o = bench("--device-memory 5M --modes resident,offload,kvpr", 0);
    ck_assert_int_eq(json_array_size(json_object_get(o, "modes")), 3);
    json_t *res = run_of(o, 0);
    ck_assert_str_eq(json_string_value(json_object_get(res, "run")), "resident");
    const char *why = json_string_value(json_object_get(res, "error"));
    ck_assert_msg(why && strstr(why, "out of device memory"), "resident's error: %s",
                  why ? why : "(none)");
    ck_assert(json_object_get(res, "decode_tokens_per_s") == NULL);
    for (size_t i = 1; i < 3; i++) {
        json_t *m = run_of(o, i);
        assert_ran(m);
        ck_assert(json_integer_value(json_object_get(m, "peak_rss_bytes")) > 0);
        /* no resident to compare with; offload, which ran, is kvpr's baseline */
        ck_assert(json_object_get(m, "tokens_match_resident") == NULL);
        ck_assert(json_number_value(json_object_get(m, "ratio_vs_offload")) > 0);
    }
    ck_assert(json_integer_value(json_object_get(o, "peak_rss_bytes")) > 0);
    json_decref(o);
}
END_TEST

/* A device too small for the weights: every run fails, each with its error, exit 1. */
START_TEST(every_mode_failing_exits_1)
{
    json_t *o = bench("--device-memory 1M --modes offload,hybrid", 1);
    ck_assert_int_eq(json_array_size(json_object_get(o, "modes")), 2);
    for (size_t i = 0; i < 2; i++) {
        const char *why = json_string_value(json_object_get(run_of(o, i), "error"));
        ck_assert_msg(why && strstr(why, "out of device memory"), "run %zu: %s", i,
                      why ? why : "(none)");
    }
    json_decref(o);
}
END_TEST

/* kvpr over a slow link on a device its recomputation's buffers fill (pipeline_buffers.c): as the
 * context grows a step's other buffers must grow too, and the recomputation gives way (its split
 * lowered to what still fits) instead of the step failing — offload ran where kvpr died, and at
 * 4 MiB both died of buffers grown a quarter past their need beside the old ones. */
START_TEST(recomputation_gives_way_as_the_context_grows)
{
    json_t *o = bench("--device-memory 5M --link-gbps 0.4 --gen-len 50 --modes kvpr,offload", 0);
    for (size_t i = 0; i < 2; i++)
        assert_ran(run_of(o, i));
    ck_assert_int_gt(json_integer_value(json_object_get(run_of(o, 0), "split_first")), 0);
    json_decref(o);
}
END_TEST

/* Offload on a device of `bytes`: its JSON, whether it ran or not (exit 0 or 1). */
static json_t *offload_on(long bytes)
{
    char extra[128];
    snprintf(extra, sizeof(extra), "--device-memory %ld --modes offload", bytes);
    snprintf(g_cmd, sizeof(g_cmd),
             "%s bench decode --model %s --backend cpu --batch 8 --prompt-len 200 "
             "--prefill-chunk 16 --gen-len 3 --json %s",
             tu_bin("rekv"), g_model, extra);
    char *out = NULL;
    int rc = tu_run(g_cmd, &out);
    ck_assert_msg(rc == 0 || rc == 1, "%s: exit %d: %s", g_cmd, rc, out);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(o != NULL, "not JSON: %s", out);
    free(out);
    return o;
}

/* The link's peak is a yardstick measured after the run, with copies in what device memory the
 * run left: on the smallest device offload runs on (found to within 1 KiB) none is left, and the
 * peak is lost — said in link_peak.error — not the run (was: the run's result too, "the kvstore's
 * arena is too small to measure"). */
START_TEST(link_peak_lost_not_the_run)
{
    long lo = 1l << 20, hi = 8l << 20; /* offload fails on lo (above), runs on hi */
    while (hi - lo > 1024) {
        long mid = lo + (hi - lo) / 2;
        json_t *o = offload_on(mid);
        int ran = json_object_get(run_of(o, 0), "error") == NULL;
        json_decref(o);
        *(ran ? &hi : &lo) = mid;
    }
    json_t *o = offload_on(hi);
    assert_ran(run_of(o, 0));
    const char *why = json_string_value(json_object_get(json_object_get(o, "link_peak"), "error"));
    ck_assert_msg(why && strstr(why, "too small"), "on %ld bytes, link_peak: %s", hi,
                  json_dumps(json_object_get(o, "link_peak"), 0));
    json_decref(o);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("bench_decode");
    TCase *tc = tcase_create("bench_decode");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, failing_mode_reported_others_run);
    tcase_add_test(tc, every_mode_failing_exits_1);
    tcase_add_test(tc, recomputation_gives_way_as_the_context_grows);
    tcase_add_test(tc, link_peak_lost_not_the_run);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    char dir[2048];
    return tu_run_suite_synth(suite,
                              "--arch opt --layers 8 --hidden 64 --heads 4 --ffn 128 --vocab 300 "
                              "--max-pos 256 --dtype f16 --seed 5",
                              dir, sizeof(dir), g_model, sizeof(g_model));
}
