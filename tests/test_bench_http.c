/* test_bench_http.c — `rekv bench http` as a user runs it (issue 36's benchmark), tiny: the real
 * rekv starting its private trio with --http, 4 streaming HTTP clients and the same 4 jobs over
 * the control socket, two rounds. Asserts the JSON's shape and counts — every job done both ways,
 * the same generated ids and texts as the first control run's (no mismatch), bytes received, the
 * CPU and TTFT fields present, every job's TTFT split by the coordinator's first_token_s — never
 * a time. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

#define CLIENTS 4
#define NEW 4

static json_int_t geti(json_t *m, const char *k)
{
    json_t *v = json_object_get(m, k);
    ck_assert_msg(json_is_integer(v), "no integer %s", k);
    return json_integer_value(v);
}

static double getr(json_t *m, const char *k)
{
    json_t *v = json_object_get(m, k);
    ck_assert_msg(json_is_real(v), "no real %s", k);
    return json_real_value(v);
}

/* One way's report: every job done and none failed, CLIENTS x NEW tokens, latencies present. */
static void check_way(json_t *w, int rounds)
{
    ck_assert_msg(json_is_object(w), "no way report");
    ck_assert_int_eq(geti(w, "jobs_done"), CLIENTS * rounds);
    ck_assert_int_eq(geti(w, "jobs_failed"), 0);
    ck_assert_int_eq(geti(w, "tokens"), CLIENTS * NEW * rounds);
    ck_assert(json_object_get(w, "first_error") == NULL);
    /* the same generated ids and texts as the first control run's, job for job */
    json_t *mm = json_object_get(w, "mismatches");
    ck_assert_int_eq(geti(mm, "jobs"), 0);
    ck_assert_int_eq(geti(mm, "ids"), 0);
    ck_assert_int_eq(geti(mm, "texts"), 0);
    ck_assert(json_object_get(w, "first_mismatch") == NULL);
    ck_assert(getr(w, "tokens_per_s") > 0);
    ck_assert(getr(w, "coordinator_cpu_s") >= 0);
    ck_assert(getr(w, "worker_cpu_per_token_s") >= 0);
    /* every job's TTFT split: the coordinator's own (JobStatus.first_token_s) and the rest */
    json_t *sp = json_object_get(w, "ttft_split_s");
    ck_assert_msg(json_is_object(sp), "no ttft_split_s");
    ck_assert_int_eq(geti(sp, "jobs"), CLIENTS * rounds);
    ck_assert(getr(json_object_get(sp, "coordinator"), "p50") > 0);
    ck_assert(json_is_real(json_object_get(json_object_get(sp, "added"), "p50")));
    const char *lat[] = {"ttft_s", "itl_s"};
    for (int k = 0; k < 2; k++) {
        json_t *l = json_object_get(w, lat[k]);
        ck_assert(getr(l, "p50") > 0);
        ck_assert(getr(l, "p50") <= getr(l, "p90"));
    }
}

START_TEST(http_and_control_agree)
{
    const char *m = tu_shared("models/docs8L/docs8L.bin");
    if (m == NULL)
        return;
    char cmd[8192], *out = NULL;
    snprintf(cmd, sizeof(cmd),
             "%s bench http --model %s --clients %d --prompt-len 16 --max-new-tokens %d "
             "--rounds 2 --json",
             tu_bin("rekv"), m, CLIENTS, NEW);
    int rc = tu_run(cmd, &out);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(rc == 0 && o != NULL, "%s: exit %d: %s", cmd, rc, out);
    ck_assert_str_eq(json_string_value(json_object_get(o, "bench")), "http");
    ck_assert_int_eq(geti(o, "clients"), CLIENTS);
    ck_assert_int_eq(geti(o, "mismatches"), 0);
    check_way(json_object_get(o, "control"), 2);
    json_t *h = json_object_get(o, "http");
    check_way(h, 2);
    /* at least the SSE framing of every token: "data: " and a blank line each */
    ck_assert_int_ge(geti(h, "bytes"), CLIENTS * NEW * 2 * 8);
    ck_assert(getr(o, "ttft_p50_ratio") > 0);
    ck_assert(getr(o, "ttft_p90_ratio") > 0);
    ck_assert(json_is_real(json_object_get(o, "server_cpu_over_worker_cpu")));
    ck_assert(json_is_real(json_object_get(o, "ttft_http_extra_share")));
    json_decref(o);
    free(out);
}
END_TEST

/* A usage error: exit 2, nothing started. */
START_TEST(http_usage)
{
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s bench http --clients 0 --model x 2>/dev/null", tu_bin("rekv"));
    ck_assert_int_eq(tu_run(cmd, &out), 2);
    free(out);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("bench_http");
    TCase *tc = tcase_create("bench_http");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, http_and_control_agree);
    tcase_add_test(tc, http_usage);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
