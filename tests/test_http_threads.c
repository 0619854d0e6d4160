/* test_http_threads.c — the HTTP server's threads do not grow with its connections: 200 open at
 * once (100 idle after an answer, 50 streaming and 50 non-streaming completions waiting in the
 * coordinator's queue, no worker running them) leave the coordinator's thread count
 * (/proc/PID/status Threads) where it was; /health is still answered beside them; and when those
 * clients go away, each waiting request's job is cancelled (its connection was suspended, out of
 * libmicrohttpd's sight: the server watches its socket itself). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/http_env.h"
#include "tests/testutil.h"

#define N_IDLE 100
#define N_WAIT 100

/* Threads of process pid, from /proc/PID/status. */
static int threads_of(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    int n = -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "Threads: %d", &n) == 1)
            break;
    fclose(f);
    ck_assert_int_gt(n, 0);
    return n;
}

static Rekv__Control__Stats *stats(rekv_ctl *c, Rekv__Control__Response **keep)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    *keep = tu_ctl_call(c, &rq);
    ck_assert_int_eq((*keep)->body_case, REKV__CONTROL__RESPONSE__BODY_STATS);
    return (*keep)->stats;
}

/* Waits until the coordinator has queued jobs queued and cancelled cancelled. */
static void wait_counts(rekv_ctl *c, uint64_t queued, uint64_t cancelled)
{
    for (;;) {
        Rekv__Control__Response *keep;
        Rekv__Control__Stats *st = stats(c, &keep);
        int there = st->queued == queued && st->cancelled == cancelled;
        rekv__control__response__free_unpacked(keep, NULL);
        if (there)
            return;
        usleep(10000);
    }
}

static void send_str(int fd, const char *s)
{
    ck_assert_int_eq(send(fd, s, strlen(s), MSG_NOSIGNAL), (ssize_t)strlen(s));
}

START_TEST(connections_cost_no_threads)
{
    hx_env x;
    if (hx_start(&x, NULL, 0))
        return;
    rekv_ctl *c = hx_ctl(&x);
    int before = threads_of(x.co);
    int fds[N_IDLE + N_WAIT];
    /* idle: each answered once (keep-alive), then silent */
    for (int i = 0; i < N_IDLE; i++) {
        fds[i] = hx_connect(x.port);
        send_str(fds[i], "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
        char b;
        ck_assert_int_eq(recv(fds[i], &b, 1, 0), 1);
    }
    /* waiting: completions queued in the coordinator (no worker), half of them streams */
    for (int i = 0; i < N_WAIT; i++) {
        char body[256], req[512];
        snprintf(body, sizeof(body), "{\"prompt\": \"The\", \"max_tokens\": 5, \"stream\": %s}",
                 i % 2 ? "true" : "false");
        snprintf(req, sizeof(req),
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                 strlen(body), body);
        fds[N_IDLE + i] = hx_connect(x.port);
        send_str(fds[N_IDLE + i], req);
    }
    wait_counts(c, N_WAIT, 0);
    int during = threads_of(x.co);
    ck_assert_msg(during <= before + 2,
                  "the coordinator runs %d threads with %d HTTP connections open (%d before)",
                  during, N_IDLE + N_WAIT, before);
    /* still answering beside them (503: no worker serves) */
    hx_resp r;
    hx_request(x.port, "GET", "/health", NULL, NULL, &r);
    hx_expect_error(&r, 503, NULL);
    hx_resp_free(&r);
    /* the waiting requests' clients go: every job is cancelled */
    for (int i = 0; i < N_IDLE + N_WAIT; i++)
        close(fds[i]);
    wait_counts(c, 0, N_WAIT);
    rekv_ctl_close(c);
    hx_stop(&x);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("http_threads");
    TCase *tc = tcase_create("threads");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, connections_cost_no_threads);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
