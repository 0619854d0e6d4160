/* test_co_guards_logs.c — log floods (tests/co_guard.h): the rate limiter itself, and a flood
 * of malformed worker messages (at the coordinator) or coordinator messages (at the worker) logs
 * at most a line a second, and the lines' "suppressed" counts add up to the messages. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>
#include "common/clock.h"
#include "common/ratelimit.h"
#include "coordinator/coordinator.h"
#include "proto/worker.pb-c.h"
#include "tests/testutil.h"
#include "tests/co_guard.h"

/* ---------------------------------------------------------------- log flood */

START_TEST(ratelimit_helper)
{
    rekv_ratelimit rl = REKV_RATELIMIT_INIT;
    uint64_t held = 99, s = 1000000000ull;
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 5 * s, s, &held), 1); /* the first one */
    ck_assert_uint_eq(held, 0);
    for (int i = 0; i < 10; i++)
        ck_assert_int_eq(rekv_ratelimit_allow(&rl, 5 * s + (uint64_t)i * (s / 20), s, &held), 0);
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 6 * s - 1, s, &held), 0);
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 6 * s, s, &held), 1);
    ck_assert_uint_eq(held, 11);
    ck_assert_int_eq(rekv_ratelimit_allow(&rl, 9 * s, s, &held), 1);
    ck_assert_uint_eq(held, 0);
}
END_TEST

/* The line every daemon's rate-limited log writes: the text, and the count held back since the
 * last one, which survives a text cut short. */
START_TEST(ratelimit_format)
{
    rekv_ratelimit rl = REKV_RATELIMIT_INIT;
    uint64_t s = REKV_RATELIMIT_INTERVAL_NS;
    char buf[48];
    ck_assert_int_eq(rekv_ratelimit_format(&rl, 5 * s, buf, sizeof(buf), "bad %s", "message"), 1);
    ck_assert_str_eq(buf, "bad message");
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(rekv_ratelimit_format(&rl, 5 * s + 1, buf, sizeof(buf), "x"), 0);
    ck_assert_int_eq(rekv_ratelimit_format(&rl, 6 * s, buf, sizeof(buf), "bad %d", 2), 1);
    ck_assert_str_eq(buf, "bad 2 (3 similar messages suppressed)");
    ck_assert_int_eq(rekv_ratelimit_format(&rl, 6 * s + 1, buf, sizeof(buf), "x"), 0);
    ck_assert_int_eq(rekv_ratelimit_format(&rl, 7 * s, buf, sizeof(buf), "%0100d", 7), 1);
    ck_assert_uint_eq(strlen(buf), sizeof(buf) - 1);
    ck_assert_str_eq(buf + strlen(buf) - strlen(" (1 similar messages suppressed)"),
                     " (1 similar messages suppressed)");
}
END_TEST

/* Counts the log's lines holding needle and the messages they say they held back. */
static void count_lines_of(const char *log, const char *needle, uint64_t *lines, uint64_t *held)
{
    *lines = *held = 0;
    char *t = tu_read_file(log, NULL);
    for (char *l = t ? strtok(t, "\n") : NULL; l; l = strtok(NULL, "\n")) {
        if (!strstr(l, needle))
            continue;
        (*lines)++;
        const char *p = strstr(l, "(");
        unsigned long long n;
        if (p && sscanf(p, "(%llu similar messages suppressed)", &n) == 1)
            *held += n;
    }
    free(t);
}

/* ... about malformed worker messages */
static void count_lines(const char *log, uint64_t *lines, uint64_t *held)
{
    count_lines_of(log, "worker socket: a malformed message", lines, held);
}

static uint64_t malformed_seen(rekv_ctl *c)
{
    Rekv__Control__Response *r = cg_stats(c);
    uint64_t n = r->stats->worker_messages_malformed;
    rekv__control__response__free_unpacked(r, NULL);
    return n;
}

/* 2000 malformed worker messages: every one is counted, a few lines are logged, and the lines
 * plus the counts of suppressed ones they carry add up to the messages. (Messages keep coming,
 * one at a time, until a line carrying a count appears: the last held-back ones are told by the
 * next line let through.) */
START_TEST(worker_warnings_rate_limited)
{
    env e;
    cg_env_start(&e, NULL);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    fake f;
    cg_fake_open(&f, e.wrk);
    enum { N = 2000 };
    static const char junk[] = "\xff\xff\xff not worker.proto";
    for (int i = 0; i < N; i++)
        ck_assert_int_eq(zmq_send(f.sock, junk, sizeof(junk) - 1, 0), (int)sizeof(junk) - 1);
    uint64_t sent = N;
    while (malformed_seen(c) < sent) /* Check's timeout is the guard */
        usleep(10000);
    uint64_t lines, held;
    count_lines(e.log, &lines, &held);
    ck_assert_uint_ge(lines, 1);
    ck_assert_uint_lt(lines, N / 4);
    while (lines + held < sent) {
        ck_assert_int_eq(zmq_send(f.sock, junk, sizeof(junk) - 1, 0), (int)sizeof(junk) - 1);
        sent++;
        while (malformed_seen(c) < sent)
            usleep(5000);
        count_lines(e.log, &lines, &held);
        usleep(100000);
    }
    ck_assert_uint_eq(lines + held, sent);
    ck_assert_uint_ge(held, N - N / 4);
    cg_fake_close(&f);
    rekv_ctl_close(c);
    cg_env_stop(&e);
}
END_TEST

/* The worker's side: a coordinator (here the test, on a ROUTER) sending 500 malformed messages
 * makes a few WARN lines, and the lines plus the counts they carry add up to the messages. */
START_TEST(gpuworker_warnings_rate_limited)
{
    fake_co f;
    if (cg_fake_co_start(&f))
        return;
    static const char junk[] = "\xff\xff\xff not worker.proto";
    enum { N = 500 };
    uint64_t sent = 0, lines = 0, held = 0;
    for (; sent < N; sent++)
        cg_fake_co_send(&f, junk, sizeof(junk) - 1);
    /* one at a time until the held-back ones are told (by the next line let through) */
    while (lines + held < sent) { /* Check's timeout is the guard */
        usleep(100000);
        cg_fake_co_send(&f, junk, sizeof(junk) - 1);
        sent++;
        usleep(100000);
        count_lines_of(f.log, "a malformed message from the coordinator", &lines, &held);
    }
    ck_assert_uint_ge(lines, 1);
    ck_assert_uint_lt(lines, N / 4);
    ck_assert_uint_ge(held, N - N / 4);
    cg_fake_co_stop(&f);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("co_guards_logs");
    TCase *tc;
    tc = tcase_create("co_guards");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, ratelimit_helper);
    tcase_add_test(tc, ratelimit_format);
    tcase_add_test(tc, worker_warnings_rate_limited);
    tcase_add_test(tc, gpuworker_warnings_rate_limited);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
