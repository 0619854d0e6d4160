/* test_http_conns.c — the HTTP server under clients that do not behave: thousands of idle
 * connections (2,000, or as many as the open-file limit allows) and a client that takes its stream
 * a byte at a time, while a normal client's requests are answered as usual; the slow client's job
 * is not lost (its stream arrives whole once it reads) and no job failed. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/http_env.h"
#include "tests/testutil.h"

/* How many idle connections this machine allows: 2,000, fewer under a low open-file limit (ours,
 * and the coordinator's, which serves (limit - 128) / 2 connections). */
static int idle_count(void)
{
    struct rlimit rl;
    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
    long room = rl.rlim_cur == RLIM_INFINITY ? 1 << 20 : ((long)rl.rlim_cur - 128) / 2 - 64;
    int n = room < 2000 ? (int)room : 2000;
    ck_assert_msg(n >= 300, "the open-file limit (%ld) leaves room for %d connections only",
                  (long)rl.rlim_cur, n);
    return n;
}

START_TEST(idle_and_slow_clients_disturb_nobody)
{
    int n_idle = idle_count();
    hx_env x;
    if (hx_start(&x, NULL, 1))
        return;
    /* the slow reader: a stream of 16 x 400 tokens (more than the sockets' buffers hold, so the
     * server's writes wait on it) that it reads a byte at a time */
    int slow = hx_connect(x.port);
    const char *body = "{\"prompt\": \"The\", \"max_tokens\": 400, \"temperature\": 0, \"n\": 16, "
                       "\"logprobs\": 20, \"stream\": true, "
                       "\"stream_options\": {\"include_usage\": true}}";
    char req[1024];
    int len = snprintf(req, sizeof(req),
                       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       "Content-Length: %zu\r\n\r\n%s",
                       strlen(body), body);
    ck_assert_int_eq(send(slow, req, (size_t)len, MSG_NOSIGNAL), len);
    char one;
    ck_assert_int_eq(recv(slow, &one, 1, 0), 1);

    /* the idle ones: connected (all at once, as a crowd of clients would), half of them with
     * half a request line */
    int *idle = malloc(sizeof(int) * (size_t)n_idle);
    struct pollfd *pf = calloc((size_t)n_idle, sizeof(*pf));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)x.port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < n_idle; i++) {
        idle[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(idle[i], 0);
        int rc = connect(idle[i], (struct sockaddr *)&a, sizeof(a));
        ck_assert_msg(rc == 0 || errno == EINPROGRESS, "connect: %s", strerror(errno));
        pf[i] = (struct pollfd){.fd = idle[i], .events = POLLOUT};
    }
    for (int left = n_idle; left > 0;) {
        ck_assert_int_ge(poll(pf, (nfds_t)n_idle, -1), 0);
        for (int i = 0; i < n_idle; i++) {
            if (pf[i].fd < 0 || !pf[i].revents)
                continue;
            int e = 0;
            socklen_t el = sizeof(e);
            getsockopt(idle[i], SOL_SOCKET, SO_ERROR, &e, &el);
            ck_assert_msg(e == 0, "idle connection %d: %s", i, strerror(e));
            if (i % 2)
                send(idle[i], "POST /v1/compl", 14, MSG_NOSIGNAL);
            pf[i].fd = -1;
            left--;
        }
    }
    free(pf);

    /* a normal client is served, more than once, while they hang on */
    for (int k = 0; k < 3; k++) {
        int st;
        json_t *j = hx_post(x.port, "/v1/completions",
                            "{\"prompt\": \"apt\", \"max_tokens\": 8, \"temperature\": 0}", &st);
        ck_assert_msg(st == 200, "a normal request beside %d idle connections: %d", n_idle, st);
        json_decref(j);
        hx_resp r;
        hx_request(x.port, "GET", "/health", NULL, NULL, &r);
        ck_assert_int_eq(r.status, 200);
        hx_resp_free(&r);
        ck_assert_int_eq(recv(slow, &one, 1, 0), 1); /* one byte more, now and then */
    }

    /* it stops reading until its jobs have all ended (their events pile up in the server, more
     * than a ZeroMQ queue holds: the server asks again for what was dropped) */
    rekv_ctl *c = hx_ctl(&x);
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    for (;;) {
        Rekv__Control__Response *s = tu_ctl_call(c, &rq);
        int done = s->stats->done + s->stats->failed + s->stats->cancelled >= 16 + 3;
        rekv__control__response__free_unpacked(s, NULL);
        if (done)
            break;
        usleep(20000);
    }

    /* the slow client's stream is whole once it reads: 16 x 400 tokens, then [DONE] */
    hx_resp r;
    hx_read_answer(slow, &r);
    close(slow);
    ck_assert_ptr_nonnull(strstr(r.body, "\"completion_tokens\":6400"));
    ck_assert_ptr_nonnull(strstr(r.body, "data: [DONE]\n\n"));
    hx_resp_free(&r);
    for (int i = 0; i < n_idle; i++)
        close(idle[i]);
    free(idle);

    Rekv__Control__Response *s = tu_ctl_call(c, &rq);
    ck_assert_int_eq(s->stats->failed, 0);
    ck_assert_int_eq(s->stats->cancelled, 0);
    ck_assert_int_eq(s->stats->done, 16 + 3);
    rekv__control__response__free_unpacked(s, NULL);
    rekv_ctl_close(c);
    hx_stop(&x);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("http_conns");
    TCase *tc = tcase_create("conns");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, idle_and_slow_clients_disturb_nobody);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
