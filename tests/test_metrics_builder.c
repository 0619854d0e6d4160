/* test_metrics_builder.c — the Prometheus exposition builder: exact text, escaping, name
 * checks, sticky errors, growth, histograms. The scrape server: test_metrics_server. */
#define _GNU_SOURCE
#include "common/metrics.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>
#include "common/clock.h"

/* ---------------------------------------------------------------- the builder */

START_TEST(test_buf_format)
{
    rekv_metrics_buf b;
    rekv_metrics_buf_init(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "rekv_jobs", "gauge", "Jobs by state."), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "rekv_jobs", "state=\"queued\"", 3), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "rekv_jobs", "state=\"running\",x=\"a\\\"b\"", 0.5),
                     0);
    ck_assert_int_eq(rekv_metrics_family(&b, "rekv_jobs", "gauge", "again: nothing written"), 0);
    ck_assert_int_eq(rekv_metrics_family(&b, "rekv_tokens_total", "counter", "a\\b\nc \"q\""), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "rekv_tokens_total", NULL, 12345678901.0), 0);
    ck_assert_int_eq(rekv_metrics_family(&b, "odd:values", "untyped", NULL), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "odd:values", "", 0.1), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "odd:values", NULL, NAN), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "odd:values", NULL, INFINITY), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "odd:values", NULL, -INFINITY), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "odd:values", NULL, -2.5e-300), 0);
    ck_assert_int_eq(
        rekv_metrics_sample_kv(&b, "odd:values", 7, "worker", "w\"1\\\n", "kind", "kv", NULL), 0);
    const char *want = "# HELP rekv_jobs Jobs by state.\n"
                       "# TYPE rekv_jobs gauge\n"
                       "rekv_jobs{state=\"queued\"} 3\n"
                       "rekv_jobs{state=\"running\",x=\"a\\\"b\"} 0.5\n"
                       "# HELP rekv_tokens_total a\\\\b\\nc \"q\"\n"
                       "# TYPE rekv_tokens_total counter\n"
                       "rekv_tokens_total 12345678901\n"
                       "# HELP odd:values \n"
                       "# TYPE odd:values untyped\n"
                       "odd:values 0.1\n"
                       "odd:values NaN\n"
                       "odd:values +Inf\n"
                       "odd:values -Inf\n"
                       "odd:values -2.5e-300\n"
                       "odd:values{worker=\"w\\\"1\\\\\\n\",kind=\"kv\"} 7\n";
    ck_assert_str_eq(b.data, want);
    ck_assert_uint_eq(b.len, strlen(want));
    ck_assert_int_eq(b.err, 0);
    rekv_metrics_buf_free(&b);
    ck_assert_ptr_null(b.data);
    rekv_metrics_buf_free(&b); /* twice is fine */
}
END_TEST

/* Each bad call fails with -EINVAL, leaves the text as it was, and sticks. */
START_TEST(test_buf_errors)
{
    static const char *bad_names[] = {"", "1abc", "a-b", "a b", "é", "a{"};
    for (size_t i = 0; i < sizeof(bad_names) / sizeof(*bad_names); i++) {
        rekv_metrics_buf b = {0};
        ck_assert_int_eq(rekv_metrics_name_valid(bad_names[i]), 0);
        ck_assert_int_eq(rekv_metrics_family(&b, bad_names[i], "gauge", "h"), -EINVAL);
        ck_assert_ptr_null(b.data);
        rekv_metrics_buf_free(&b);
    }
    ck_assert_int_eq(rekv_metrics_name_valid("_a:b_9"), 1);
    ck_assert_int_eq(rekv_metrics_name_valid(NULL), 0);

    static const char *bad_labels[] = {
        "state",    "state=queued",   "state=\"queued", "=\"x\"",     "1a=\"x\"",  "__r=\"x\"",
        "a=\"x\",", "a=\"x\"b=\"y\"", "a=\"x\\t\"",     "a=\"x\ny\"", "a-b=\"x\"", "a=\"x\" ",
    };
    for (size_t i = 0; i < sizeof(bad_labels) / sizeof(*bad_labels); i++) {
        rekv_metrics_buf b = {0};
        ck_assert_int_eq(rekv_metrics_family(&b, "m", "gauge", "h"), 0);
        size_t len = b.len;
        ck_assert_msg(rekv_metrics_sample(&b, "m", bad_labels[i], 1) == -EINVAL, "labels %s",
                      bad_labels[i]);
        ck_assert_uint_eq(b.len, len);
        /* sticky: a good call now fails too */
        ck_assert_int_eq(rekv_metrics_sample(&b, "m", NULL, 1), -EINVAL);
        ck_assert_uint_eq(b.len, len);
        rekv_metrics_buf_free(&b);
    }

    rekv_metrics_buf b = {0};
    ck_assert_int_eq(rekv_metrics_sample(&b, "m", NULL, 1), -EINVAL); /* no family yet */
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "m", "summary", "h"), -EINVAL);
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "m", NULL, "h"), -EINVAL);
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "a", "gauge", "h"), 0);
    ck_assert_int_eq(rekv_metrics_sample(&b, "b", NULL, 1), -EINVAL); /* not the current one */
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "a", "gauge", "h"), 0);
    ck_assert_int_eq(rekv_metrics_family(&b, "b", "gauge", "h"), 0);
    ck_assert_int_eq(rekv_metrics_family(&b, "a", "gauge", "h"), -EINVAL); /* not grouped */
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "a", "gauge", "h"), 0);
    ck_assert_int_eq(rekv_metrics_sample_kv(&b, "a", 1, "__x", "v", NULL), -EINVAL);
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "a", "gauge", "h"), 0);
    ck_assert_int_eq(rekv_metrics_sample_kv(&b, "a", 1, "k", (const char *)NULL, "x", NULL),
                     -EINVAL);
    rekv_metrics_buf_free(&b);
}
END_TEST

/* A histogram: cumulative buckets with le (bounds as the shortest decimal, then +Inf), _sum and
 * _count, labels before le; an observation on a bound counts in that bound's bucket; misuse is
 * -EINVAL. */
START_TEST(test_histogram)
{
    static const double bounds[] = {0.001, 0.5, 2};
    rekv_metrics_hist h;
    ck_assert_int_eq(rekv_metrics_hist_init(&h, bounds, 3), 0);
    rekv_metrics_hist_observe(&h, 0.0005);
    rekv_metrics_hist_observe(&h, 0.5); /* le: on the bound is in */
    rekv_metrics_hist_observe(&h, 0.25);
    rekv_metrics_hist_observe(&h, 7);
    rekv_metrics_hist_observe(&h, NAN); /* ignored */
    rekv_metrics_buf b = {0};
    ck_assert_int_eq(rekv_metrics_family(&b, "t_seconds", "histogram", "T."), 0);
    ck_assert_int_eq(rekv_metrics_histogram(&b, "t_seconds", NULL, &h), 0);
    ck_assert_int_eq(rekv_metrics_histogram(&b, "t_seconds", "op=\"r\"", &h), 0);
    const char *want = "# HELP t_seconds T.\n"
                       "# TYPE t_seconds histogram\n"
                       "t_seconds_bucket{le=\"0.001\"} 1\n"
                       "t_seconds_bucket{le=\"0.5\"} 3\n"
                       "t_seconds_bucket{le=\"2\"} 3\n"
                       "t_seconds_bucket{le=\"+Inf\"} 4\n"
                       "t_seconds_sum 7.7505\n"
                       "t_seconds_count 4\n"
                       "t_seconds_bucket{op=\"r\",le=\"0.001\"} 1\n"
                       "t_seconds_bucket{op=\"r\",le=\"0.5\"} 3\n"
                       "t_seconds_bucket{op=\"r\",le=\"2\"} 3\n"
                       "t_seconds_bucket{op=\"r\",le=\"+Inf\"} 4\n"
                       "t_seconds_sum{op=\"r\"} 7.7505\n"
                       "t_seconds_count{op=\"r\"} 4\n";
    ck_assert_str_eq(b.data, want);
    ck_assert_int_eq(ms_check_exposition(b.data, b.len), 12);
    /* a plain sample in a histogram family, a histogram in a gauge family, le among the labels */
    ck_assert_int_eq(rekv_metrics_sample(&b, "t_seconds", NULL, 1), -EINVAL);
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "g", "gauge", "G."), 0);
    ck_assert_int_eq(rekv_metrics_histogram(&b, "g", NULL, &h), -EINVAL);
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "t", "histogram", "T."), 0);
    ck_assert_int_eq(rekv_metrics_histogram(&b, "t", "le=\"1\"", &h), -EINVAL);
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "t", "histogram", "T."), 0);
    ck_assert_int_eq(rekv_metrics_histogram(&b, "t", "a=\"x\",le=\"1\"", &h), -EINVAL);
    rekv_metrics_buf_free(&b);
    ck_assert_int_eq(rekv_metrics_family(&b, "t", "histogram", "T."), 0);
    ck_assert_int_eq(rekv_metrics_family(&b, "t", "gauge", "T."), -EINVAL); /* retyped */
    rekv_metrics_buf_free(&b);
    static const double unordered[] = {1, 1};
    ck_assert_int_eq(rekv_metrics_hist_init(&h, unordered, 2), -EINVAL);
    ck_assert_int_eq(rekv_metrics_hist_init(&h, bounds, 0), -EINVAL);
    ck_assert_int_eq(
        rekv_metrics_hist_init(&h, rekv_metrics_latency_bounds, rekv_metrics_latency_n_bounds), 0);
}
END_TEST

/* Many families and samples: the buffer grows and stays exact. */
START_TEST(test_buf_grows)
{
    rekv_metrics_buf b = {0};
    char name[32];
    for (int f = 0; f < 300; f++) {
        snprintf(name, sizeof(name), "fam_%d", f);
        ck_assert_int_eq(rekv_metrics_family(&b, name, f % 2 ? "counter" : "gauge", "h"), 0);
        for (int k = 0; k < 20; k++) {
            char v[16];
            snprintf(v, sizeof(v), "%d", k);
            ck_assert_int_eq(rekv_metrics_sample_kv(&b, name, k, "k", v, NULL), 0);
        }
    }
    ck_assert_uint_eq(strlen(b.data), b.len);
    ck_assert_ptr_nonnull(strstr(b.data, "fam_299{k=\"19\"} 19\n"));
    rekv_metrics_buf_free(&b);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("metrics_builder");
    TCase *tc;
    tc = tcase_create("builder");
    tcase_add_test(tc, test_buf_format);
    tcase_add_test(tc, test_buf_errors);
    tcase_add_test(tc, test_buf_grows);
    tcase_add_test(tc, test_histogram);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
