/* test_metrics_server.c — the metrics scrape server, run the way the daemons run it: a zmq_poll
 * loop in a thread over the server's raw fds. Scraped with a minimal client written here (real
 * sockets) and with curl when installed: 200 with a well-formed exposition, 404 / 405 / 400 /
 * 431 / 500, HEAD, 100 concurrent connections against a bound of 32, garbage and mutated
 * requests, slow and silent clients, requests followed by junk, and no fd leaks over many
 * scrapes. */
#define _GNU_SOURCE
#include "common/metrics.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
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

/* ---------------------------------------------------------------- the server in a loop */

static int g_render_fail; /* render answers -EIO */
static int g_renders;     /* render calls (atomic) */

static int render(void *ctx, rekv_metrics_buf *b)
{
    __atomic_add_fetch(&g_renders, 1, __ATOMIC_RELAXED);
    if (g_render_fail)
        return -EIO;
    rekv_metrics_family(b, "rekv_jobs", "gauge", "Jobs by state.");
    rekv_metrics_sample_kv(b, "rekv_jobs", 3, "state", "queued", NULL);
    rekv_metrics_sample_kv(b, "rekv_jobs", 2, "state", "running", NULL);
    rekv_metrics_family(b, "rekv_tokens_total", "counter", "Generated tokens.");
    rekv_metrics_sample(b, "rekv_tokens_total", NULL, 123456);
    rekv_metrics_family(b, "rekv_tokens_per_second", "gauge", "Tokens/s, last ~5 s.");
    rekv_metrics_sample(b, "rekv_tokens_per_second", NULL, 41.25);
    rekv_metrics_family(b, "rekv_worker_steps_total", "counter", "Steps per worker.");
    rekv_metrics_sample_kv(b, "rekv_worker_steps_total", 17, "worker", "gpu\"0\\ \n", NULL);
    return 0;
}

typedef struct srv {
    rekv_metrics_server *s;
    int port;
    int stop_fd; /* eventfd: the loop returns */
    pthread_t thread;
    int max_conns_seen; /* most connections open after any handle call (atomic) */
    int conns_now;      /* connections open after the last handle call (atomic) */
    int poll_errno;     /* zmq_poll's errno when it failed, else 0 */
} srv;

static void *srv_main(void *arg)
{
    srv *t = arg;
    for (;;) {
        int fds[REKV_METRICS_MAX_FDS];
        short ev[REKV_METRICS_MAX_FDS], rev[REKV_METRICS_MAX_FDS];
        int n = rekv_metrics_server_fds(t->s, fds, ev, REKV_METRICS_MAX_FDS);
        zmq_pollitem_t it[1 + REKV_METRICS_MAX_FDS];
        it[0] = (zmq_pollitem_t){NULL, t->stop_fd, ZMQ_POLLIN, 0};
        for (int i = 0; i < n; i++)
            it[1 + i] = (zmq_pollitem_t){NULL, fds[i], ev[i], 0};
        int r = zmq_poll(it, n + 1, 100);
        if (r < 0 && errno != EINTR) {
            t->poll_errno = errno;
            return NULL;
        }
        if (r > 0 && it[0].revents)
            return NULL;
        for (int i = 0; i < n; i++)
            rev[i] = r > 0 ? it[1 + i].revents : 0;
        rekv_metrics_server_handle(t->s, fds, rev, n, render, t);
        int c = rekv_metrics_server_conns(t->s);
        __atomic_store_n(&t->conns_now, c, __ATOMIC_RELAXED);
        if (c > __atomic_load_n(&t->max_conns_seen, __ATOMIC_RELAXED))
            __atomic_store_n(&t->max_conns_seen, c, __ATOMIC_RELAXED);
    }
}

static void srv_start_at(srv *t, const char *listen, int timeout_ms)
{
    memset(t, 0, sizeof(*t));
    rekv_metrics_server_opts o = {.max_conns = 0, .timeout_ms = timeout_ms, .allow_remote = 1};
    rekv_err err = {0};
    int rc = rekv_metrics_server_create_opts(listen, &o, &t->s, &err);
    ck_assert_msg(rc == 0, "create %s: %s", listen, err.msg);
    t->port = rekv_metrics_server_port(t->s);
    ck_assert_int_gt(t->port, 0);
    t->stop_fd = eventfd(0, EFD_CLOEXEC);
    ck_assert_int_ge(t->stop_fd, 0);
    ck_assert_int_eq(pthread_create(&t->thread, NULL, srv_main, t), 0);
}

static void srv_start(srv *t, int timeout_ms)
{
    srv_start_at(t, "127.0.0.1:0", timeout_ms);
}

/* Waits until the loop reports `want` open connections (Check's timeout is the guard: load makes
 * it slower, never red); returns that count. */
static int srv_wait_conns(srv *t, int want)
{
    int c;
    while ((c = __atomic_load_n(&t->conns_now, __ATOMIC_RELAXED)) != want)
        usleep(10000);
    return c;
}

static void srv_stop(srv *t)
{
    uint64_t one = 1;
    ck_assert_int_eq(write(t->stop_fd, &one, sizeof(one)), (ssize_t)sizeof(one));
    pthread_join(t->thread, NULL);
    ck_assert_int_eq(t->poll_errno, 0);
    rekv_metrics_server_free(t->s);
    close(t->stop_fd);
}

/* ---------------------------------------------------------------- a minimal client */

static int connect_port(int port, int rcv_timeout_ms)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(fd, 0);
    struct timeval tv = {rcv_timeout_ms / 1000, (rcv_timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_msg(connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0, "connect: %s",
                  strerror(errno));
    return fd;
}

static void send_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return; /* the server may close on us (oversized, garbage): the answer tells */
        c += w;
        n -= (size_t)w;
    }
}

/* Reads until EOF, reset or timeout. Returns the bytes (malloc'd, NUL-terminated). */
static char *read_all(int fd, size_t *len, int *timed_out)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    ck_assert_ptr_nonnull(buf);
    *timed_out = 0;
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            ck_assert_ptr_nonnull(buf);
        }
        ssize_t r = recv(fd, buf + n, cap - n - 1, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            *timed_out = 1;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

typedef struct resp {
    int status;       /* the status code; -1 when the connection closed without an answer */
    char ctype[128];  /* Content-Type */
    long clen;        /* Content-Length, -1 when absent */
    int conn_close;   /* a "Connection: close" header was there */
    int allow_get;    /* an Allow header naming GET was there */
    const char *body; /* into raw */
    size_t n_body;
    char *raw;     /* the whole answer (malloc'd) */
    int timed_out; /* the read ended on the receive timeout, not EOF */
} resp;

/* Parses raw as one HTTP/1.1 answer; a malformed one fails the test. */
static void resp_parse(resp *r, char *raw, size_t n)
{
    memset(r, 0, sizeof(*r));
    r->raw = raw;
    r->clen = -1;
    r->status = -1;
    if (n == 0)
        return;
    ck_assert_msg(strncmp(raw, "HTTP/1.1 ", 9) == 0, "status line: %.40s", raw);
    r->status = atoi(raw + 9);
    char *eoh = strstr(raw, "\r\n\r\n");
    ck_assert_msg(eoh != NULL, "no end of headers in %.200s", raw);
    r->body = eoh + 4;
    r->n_body = n - (size_t)(r->body - raw);
    for (char *line = strstr(raw, "\r\n") + 2; line < eoh; line = strstr(line, "\r\n") + 2) {
        if (strncasecmp(line, "Content-Type: ", 14) == 0)
            snprintf(r->ctype, sizeof(r->ctype), "%.*s", (int)(strstr(line, "\r\n") - line - 14),
                     line + 14);
        else if (strncasecmp(line, "Content-Length: ", 16) == 0)
            r->clen = atol(line + 16);
        else if (strncasecmp(line, "Connection: close\r\n", 19) == 0)
            r->conn_close = 1;
        else if (strncasecmp(line, "Allow: ", 7) == 0 && strstr(line, "GET") < strstr(line, "\r\n"))
            r->allow_get = 1;
    }
}

/* One exchange: connect, send, optionally shut down our side, read the whole answer. */
static resp exchange(int port, const void *req, size_t n, int shut_wr)
{
    int fd = connect_port(port, 30000);
    send_all(fd, req, n);
    if (shut_wr)
        shutdown(fd, SHUT_WR);
    size_t len;
    int to;
    char *raw = read_all(fd, &len, &to);
    close(fd);
    resp r;
    resp_parse(&r, raw, len);
    r.timed_out = to;
    return r;
}

static resp get(int port, const char *req)
{
    return exchange(port, req, strlen(req), 0);
}

static void check_metrics_answer(const resp *r)
{
    ck_assert_int_eq(r->status, 200);
    ck_assert_str_eq(r->ctype, "text/plain; version=0.0.4; charset=utf-8");
    ck_assert_int_eq(r->clen, (long)r->n_body);
    ck_assert(r->conn_close);
    ck_assert_int_eq(ms_check_exposition(r->body, r->n_body), 5);
    ck_assert_ptr_nonnull(strstr(r->body, "rekv_jobs{state=\"queued\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(r->body, "rekv_tokens_per_second 41.25\n"));
    ck_assert_ptr_nonnull(
        strstr(r->body, "rekv_worker_steps_total{worker=\"gpu\\\"0\\\\ \\n\"} 17\n"));
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    int n = 0;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* ---------------------------------------------------------------- server tests */

START_TEST(test_listen_addresses)
{
    static const char *bad[] = {
        "",       "9464", "127.0.0.1", "127.0.0.1:",       "1.2.3.4:x", "127.0.0.1:65536",
        "[::1:0", "[]:0", "::1:0",     "127.0.0.1:123456", ":-1",       "[::1]0"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++) {
        rekv_metrics_server *s = (rekv_metrics_server *)1;
        rekv_err err = {0};
        ck_assert_msg(rekv_metrics_server_create(bad[i], &s, &err) == -EINVAL, "'%s'", bad[i]);
        ck_assert_ptr_null(s);
        ck_assert_int_ne(err.msg[0], 0);
    }
    rekv_metrics_server *s = NULL;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_metrics_server_create(NULL, &s, &err), -EINVAL);
    rekv_metrics_server_opts o = {.max_conns = 33};
    ck_assert_int_eq(rekv_metrics_server_create_opts("127.0.0.1:0", &o, &s, &err), -EINVAL);

    /* all interfaces (asked for), and a port in use */
    rekv_metrics_server_opts any = {.allow_remote = 1};
    ck_assert_int_eq(rekv_metrics_server_create_opts(":0", &any, &s, &err), 0);
    int port = rekv_metrics_server_port(s);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
    rekv_metrics_server *s2 = NULL;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_metrics_server_create(addr, &s2, &err), -EADDRINUSE);
    ck_assert_ptr_nonnull(strstr(err.msg, addr));
    rekv_metrics_server_free(s);
    rekv_metrics_server_free(NULL);

    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_metrics_server_create("localhost:0", &s, &err), 0);
    rekv_metrics_server_free(s);
}
END_TEST

/* Loopback only unless asked: every interface and a host's own non-loopback address are refused
 * with -EPERM (naming --metrics-public), nothing left listening; loopback names and addresses
 * are fine. */
START_TEST(test_loopback_only)
{
    rekv_metrics_server *s = NULL;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_metrics_server_create(":0", &s, &err), -EPERM);
    ck_assert_ptr_null(s);
    ck_assert_msg(strstr(err.msg, "--metrics-public") != NULL, "%s", err.msg);
    rekv_metrics_server_opts local = {.allow_remote = 0};
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_metrics_server_create_opts("0.0.0.0:0", &local, &s, &err), -EPERM);
    const char *ok[] = {"127.0.0.1:0", "127.3.4.5:0", "localhost:0"};
    for (size_t i = 0; i < sizeof(ok) / sizeof(*ok); i++) {
        rekv_err_clear(&err);
        ck_assert_msg(rekv_metrics_server_create(ok[i], &s, &err) == 0, "%s: %s", ok[i], err.msg);
        rekv_metrics_server_free(s);
    }
    if (rekv_metrics_server_create("[::1]:0", &s, NULL) == 0)
        rekv_metrics_server_free(s);
    rekv_err_clear(&err);
    int rc = rekv_metrics_server_create("[::]:0", &s, &err); /* refused, or no IPv6 here */
    ck_assert_msg(rc == -EPERM || rc == -EADDRNOTAVAIL || rc == -EAFNOSUPPORT, "[::]: %s", err.msg);
}
END_TEST

/* The ":PORT" server answers on IPv4 loopback (dual-stack or IPv4-only). */
START_TEST(test_all_interfaces_serves_v4)
{
    srv t;
    srv_start_at(&t, ":0", 0);
    resp r = get(t.port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    check_metrics_answer(&r);
    free(r.raw);
    srv_stop(&t);
}
END_TEST

START_TEST(test_get_metrics)
{
    srv t;
    srv_start(&t, 0);
    resp r = get(t.port, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n");
    check_metrics_answer(&r);
    free(r.raw);

    static const char *ok[] = {
        "GET /metrics HTTP/1.0\r\n\r\n",                         /* 1.0, no headers */
        "GET /metrics?x=1&y=%20 HTTP/1.1\r\nHost: h\r\n\r\n",    /* a query string */
        "GET http://h:9464/metrics HTTP/1.1\r\nHost: h\r\n\r\n", /* absolute form */
        "GET /metrics HTTP/1.1\nHost: h\n\n",                    /* bare LF line ends */
        "\r\nGET /metrics HTTP/1.1\r\nHost: h\r\nX-Empty:\r\nX-Tab:\t v \x80\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(*ok); i++) {
        r = get(t.port, ok[i]);
        ck_assert_msg(r.status == 200, "request %zu: status %d", i, r.status);
        check_metrics_answer(&r);
        free(r.raw);
    }

    r = get(t.port, "HEAD /metrics HTTP/1.1\r\nHost: h\r\n\r\n");
    ck_assert_int_eq(r.status, 200);
    ck_assert_int_gt(r.clen, 100);
    ck_assert_uint_eq(r.n_body, 0);
    free(r.raw);

    /* the request and its end of stream together */
    const char *req = "GET /metrics HTTP/1.1\r\n\r\n";
    r = exchange(t.port, req, strlen(req), 1);
    check_metrics_answer(&r);
    free(r.raw);
    srv_stop(&t);
}
END_TEST

/* Malformed in ways libmicrohttpd reads leniently (as most servers do): any well-formed answer
 * that closes the connection will do. */
#define TOLERATED (-2)

START_TEST(test_error_answers)
{
    srv t;
    srv_start(&t, 0);
    static const struct {
        const char *req;
        int status;
    } cases[] = {
        {"GET / HTTP/1.1\r\n\r\n", 404},
        {"GET /metricsx HTTP/1.1\r\n\r\n", 404},
        {"GET /metrics/ HTTP/1.1\r\n\r\n", 404},
        {"POST /nope HTTP/1.1\r\n\r\n", 404},
        {"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 405},
        {"DELETE /metrics HTTP/1.1\r\n\r\n", 405},
        {"get /metrics HTTP/1.1\r\n\r\n", 405}, /* methods are case-sensitive */
        {"GET /metrics HTTP/2.0\r\n\r\n", 505},
        {"GET /metrics\r\n\r\n", 400},
        {"GET  /metrics HTTP/1.1\r\n\r\n", TOLERATED},
        {"GET metrics HTTP/1.1\r\n\r\n", TOLERATED},
        {"GET /metrics HTTP/1.1 \r\n\r\n", 400},
        {"G(T /metrics HTTP/1.1\r\n\r\n", TOLERATED},
        {"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", 400},
        {"GET /metrics HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", TOLERATED},
        {"GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n", TOLERATED},
        {"GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n", TOLERATED},
        {"GET /metrics HTTP/1.1\r\nX: a\rb\r\n\r\n", TOLERATED},
        {"GET /met\x01rics HTTP/1.1\r\n\r\n", TOLERATED},
        {"GET /m\xc3\xa9trics HTTP/1.1\r\n\r\n", TOLERATED},
        {"\r\n\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n", TOLERATED},
        {"GET http://host HTTP/1.1\r\n\r\n", 400},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        resp r = get(t.port, cases[i].req);
        if (cases[i].status == TOLERATED)
            ck_assert_msg(r.status == 200 || r.status == 400 || r.status == 404 ||
                              r.status == 405,
                          "'%s': %d", cases[i].req, r.status);
        else
            ck_assert_msg(r.status == cases[i].status, "'%s': %d, want %d", cases[i].req,
                          r.status, cases[i].status);
        ck_assert_int_eq(r.clen, (long)r.n_body);
        ck_assert(r.conn_close);
        if (r.status == 405)
            ck_assert(r.allow_get);
        free(r.raw);
    }

    /* render failing answers 500 */
    int before = __atomic_load_n(&g_renders, __ATOMIC_RELAXED);
    g_render_fail = 1; /* read by the server thread after the request arrives */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    resp r = get(t.port, "GET /metrics HTTP/1.1\r\n\r\n");
    ck_assert_int_eq(r.status, 500);
    free(r.raw);
    g_render_fail = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    ck_assert_int_eq(__atomic_load_n(&g_renders, __ATOMIC_RELAXED), before + 1);
    r = get(t.port, "GET /metrics HTTP/1.1\r\n\r\n");
    check_metrics_answer(&r);
    free(r.raw);
    srv_stop(&t);
}
END_TEST

START_TEST(test_oversized)
{
    srv t;
    srv_start(&t, 0);
    /* libmicrohttpd's bound: past twice REKV_METRICS_MAX_REQUEST at most */
    size_t sizes[] = {2 * REKV_METRICS_MAX_REQUEST + 1024, 100000, 4u << 20};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(*sizes); i++) {
        size_t n = sizes[i];
        char *req = malloc(n);
        const char *start = "GET /metrics HTTP/1.1\r\nX-Big: ";
        memcpy(req, start, strlen(start));
        memset(req + strlen(start), 'a', n - strlen(start));
        resp r = exchange(t.port, req, n, 0);
        ck_assert_msg(r.status == 431, "%zu bytes: status %d", n, r.status);
        ck_assert(!r.timed_out);
        free(r.raw);
        free(req);
    }
    /* a request line alone over the limit */
    char *req = malloc(20000);
    memcpy(req, "GET /", 5);
    memset(req + 5, 'a', 20000 - 5);
    resp r = exchange(t.port, req, 20000, 0);
    ck_assert_int_eq(r.status, 414);
    free(r.raw);
    free(req);
    /* just under the limit is fine */
    char ok[REKV_METRICS_MAX_REQUEST];
    int h = snprintf(ok, sizeof(ok), "GET /metrics HTTP/1.1\r\nX-Big: ");
    memset(ok + h, 'b', sizeof(ok) - (size_t)h - 4);
    memcpy(ok + sizeof(ok) - 4, "\r\n\r\n", 4);
    r = exchange(t.port, ok, sizeof(ok), 0);
    check_metrics_answer(&r);
    free(r.raw);
    srv_stop(&t);
}
END_TEST

/* 100 connections open at once: at most 32 are served at a time, the others wait (unread, in the
 * listen backlog) and are served as answers close the first ones; every one gets 200. */
START_TEST(test_100_open_at_once)
{
    srv t;
    srv_start(&t, 0);
    enum { N = 100 };
    int fds[N];
    for (int i = 0; i < N; i++)
        fds[i] = connect_port(t.port, 30000);
    ck_assert_int_eq(srv_wait_conns(&t, REKV_METRICS_MAX_CONNS), REKV_METRICS_MAX_CONNS);
    const char *req = "GET /metrics HTTP/1.1\r\nHost: h\r\n\r\n";
    for (int i = 0; i < N; i++)
        send_all(fds[i], req, strlen(req));
    for (int i = 0; i < N; i++) {
        size_t len;
        int to;
        char *raw = read_all(fds[i], &len, &to);
        ck_assert(!to);
        resp r;
        resp_parse(&r, raw, len);
        check_metrics_answer(&r);
        free(raw);
        close(fds[i]);
    }
    ck_assert_int_le(__atomic_load_n(&t.max_conns_seen, __ATOMIC_RELAXED), REKV_METRICS_MAX_CONNS);
    resp r = get(t.port, req);
    check_metrics_answer(&r);
    free(r.raw);
    srv_stop(&t);
}
END_TEST

typedef struct scraper {
    int port;
    int n200, nother; /* answers seen */
} scraper;

static void *scraper_main(void *arg)
{
    scraper *sc = arg;
    const char *req = "GET /metrics HTTP/1.1\r\nHost: h\r\n\r\n";
    for (int k = 0; k < 5; k++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct timeval tv = {30, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)sc->port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
            send(fd, req, strlen(req), MSG_NOSIGNAL);
            char buf[4096];
            size_t n = 0;
            ssize_t r;
            while (n < sizeof(buf) - 1 && (r = recv(fd, buf + n, sizeof(buf) - 1 - n, 0)) > 0)
                n += (size_t)r;
            buf[n] = '\0';
            if (strncmp(buf, "HTTP/1.1 200 ", 13) == 0 && strstr(buf, "rekv_tokens_total 123456\n"))
                sc->n200++;
            else
                sc->nother++;
        } else {
            sc->nother++;
        }
        close(fd);
    }
    return NULL;
}

/* 100 clients scraping concurrently, 5 times each: every answer is 200 or a refusal, most are
 * 200, and the connection bound holds. */
START_TEST(test_100_concurrent_scrapers)
{
    srv t;
    srv_start(&t, 0);
    enum { N = 100 };
    pthread_t th[N];
    scraper sc[N];
    for (int i = 0; i < N; i++) {
        sc[i] = (scraper){.port = t.port};
        ck_assert_int_eq(pthread_create(&th[i], NULL, scraper_main, &sc[i]), 0);
    }
    int n200 = 0, nother = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        n200 += sc[i].n200;
        nother += sc[i].nother;
    }
    ck_assert_int_eq(n200 + nother, 5 * N);
    ck_assert_int_ge(n200, N); /* refusals happen only while 32 are open at once */
    ck_assert_int_le(__atomic_load_n(&t.max_conns_seen, __ATOMIC_RELAXED), REKV_METRICS_MAX_CONNS);
    resp r = get(t.port, "GET /metrics HTTP/1.1\r\n\r\n");
    check_metrics_answer(&r);
    free(r.raw);
    srv_stop(&t);
}
END_TEST

static uint64_t g_rng = 0x1234567887654321ull;

static uint64_t rnd(void)
{
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Random bytes and mutated requests: every answer is a well-formed HTTP answer or a close, and the
 * server still serves afterwards. */
START_TEST(test_garbage)
{
    srv t;
    srv_start(&t, 300);
    static const int allowed[] = {-1, 200, 400, 404, 405, 408, 414, 431, 505};
    char buf[16384];
    const char *valid =
        "GET /metrics HTTP/1.1\r\nHost: localhost:9464\r\nAccept: text/plain\r\n\r\n";
    for (int it = 0; it < 400; it++) {
        size_t n;
        if (it % 2 == 0) { /* random bytes */
            n = 1 + rnd() % (it % 10 == 0 ? sizeof(buf) : 256);
            for (size_t i = 0; i < n; i++)
                buf[i] = (char)rnd();
        } else { /* a valid request with a few bytes flipped, cut or inserted */
            n = strlen(valid);
            memcpy(buf, valid, n);
            int edits = 1 + (int)(rnd() % 4);
            for (int e = 0; e < edits; e++) {
                size_t at = rnd() % n;
                switch (rnd() % 3) {
                case 0:
                    buf[at] = (char)rnd();
                    break;
                case 1:
                    n = at + 1;
                    break;
                default:
                    memmove(buf + at + 1, buf + at, n - at);
                    buf[at] = (char)rnd();
                    n++;
                }
            }
        }
        resp r = exchange(t.port, buf, n, 1);
        int ok = 0;
        for (size_t k = 0; k < sizeof(allowed) / sizeof(*allowed); k++)
            ok |= r.status == allowed[k];
        ck_assert_msg(ok, "iteration %d: status %d", it, r.status);
        ck_assert(!r.timed_out);
        if (r.status == 200)
            ck_assert_int_eq(ms_check_exposition(r.body, r.n_body), 5);
        free(r.raw);
    }
    resp r = get(t.port, valid);
    check_metrics_answer(&r);
    free(r.raw);
    srv_stop(&t);
}
END_TEST

/* A client that connects and says nothing is closed after the timeout, and so is one that stops
 * halfway; others are served meanwhile. */
START_TEST(test_silent_clients)
{
    srv t;
    srv_start(&t, 300);
    uint64_t t0 = rekv_now_ns();
    int silent = connect_port(t.port, 30000);
    int partial = connect_port(t.port, 30000);
    send_all(partial, "GET /metr", 9);
    resp r = get(t.port, "GET /metrics HTTP/1.1\r\n\r\n");
    check_metrics_answer(&r);
    free(r.raw);
    size_t len;
    int to;
    char *raw = read_all(silent, &len, &to);
    double waited = (double)(rekv_now_ns() - t0) * 1e-9;
    ck_assert(!to);
    ck_assert_uint_eq(len, 0);
    ck_assert_msg(waited > 0.25, "closed after %.3f s, before its timeout", waited);
    free(raw);
    raw = read_all(partial, &len, &to);
    ck_assert(!to);
    resp_parse(&r, raw, len);
    ck_assert_int_eq(r.status, -1);
    free(raw);
    close(silent);
    close(partial);
    ck_assert_int_eq(srv_wait_conns(&t, 0), 0);

    /* the server fills up with silent clients; the next waits until their timeout frees a
     * place, and is served */
    int fds[REKV_METRICS_MAX_CONNS];
    for (int i = 0; i < REKV_METRICS_MAX_CONNS; i++)
        fds[i] = connect_port(t.port, 30000);
    ck_assert_int_eq(srv_wait_conns(&t, REKV_METRICS_MAX_CONNS), REKV_METRICS_MAX_CONNS);
    r = get(t.port, "GET /metrics HTTP/1.1\r\n\r\n");
    check_metrics_answer(&r);
    free(r.raw);
    r = get(t.port, "GET /metrics HTTP/1.1\r\n\r\n");
    check_metrics_answer(&r);
    free(r.raw);
    for (int i = 0; i < REKV_METRICS_MAX_CONNS; i++)
        close(fds[i]);
    srv_stop(&t);
}
END_TEST

/* A request trickling in byte by byte is answered; a request followed by a second one and junk is
 * answered in full (the lingering close keeps the answer from being reset). */
START_TEST(test_slow_and_pipelined)
{
    srv t;
    srv_start(&t, 0);
    const char *req = "GET /metrics HTTP/1.1\r\nHost: h\r\n\r\n";
    int fd = connect_port(t.port, 30000);
    for (const char *p = req; *p; p++) {
        send_all(fd, p, 1);
        usleep(2000);
    }
    size_t len;
    int to;
    char *raw = read_all(fd, &len, &to);
    close(fd);
    resp r;
    resp_parse(&r, raw, len);
    check_metrics_answer(&r);
    free(raw);

    size_t n = 200000;
    char *big = malloc(n);
    memset(big, 'z', n);
    size_t l = strlen(req);
    memcpy(big, req, l);
    memcpy(big + l, req, l);
    r = exchange(t.port, big, n, 0);
    check_metrics_answer(&r);
    free(r.raw);
    free(big);
    srv_stop(&t);
}
END_TEST

/* Many scrapes leave no descriptors behind, and the server frees open connections. */
START_TEST(test_no_leaks)
{
    int before = count_fds();
    srv t;
    srv_start(&t, 0);
    for (int i = 0; i < 300; i++) {
        resp r = get(t.port, i % 3 ? "GET /metrics HTTP/1.1\r\n\r\n" : "GET /x HTTP/1.1\r\n\r\n");
        ck_assert_int_eq(r.status, i % 3 ? 200 : 404);
        free(r.raw);
    }
    int open1 = connect_port(t.port, 30000), open2 = connect_port(t.port, 30000);
    send_all(open2, "GET /", 5);
    usleep(50000);
    srv_stop(&t); /* frees the server with two connections open */
    close(open1);
    close(open2);
    ck_assert_int_eq(count_fds(), before);
}
END_TEST

START_TEST(test_curl)
{
    if (system("command -v curl >/dev/null 2>&1") != 0) {
        printf("test_metrics: curl not installed, skipping the curl scrape\n");
        return;
    }
    srv t;
    srv_start(&t, 0);
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof(cmd), "curl -sS -i --max-time 5 http://127.0.0.1:%d/metrics", t.port);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    resp r;
    resp_parse(&r, out, strlen(out));
    check_metrics_answer(&r);
    free(out);

    static const struct {
        const char *args;
        const char *code;
    } cases[] = {{"", "200"},
                 {"-I", "200"},
                 {"-X POST", "405"},
                 {"--http1.0", "200"},
                 {"-H 'Accept: application/openmetrics-text'", "200"}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        snprintf(
            cmd, sizeof(cmd),
            "curl -s -o /dev/null -w '%%{http_code}' --max-time 5 %s http://127.0.0.1:%d/metrics",
            cases[i].args, t.port);
        out = NULL;
        ck_assert_int_eq(tu_run(cmd, &out), 0);
        ck_assert_msg(strcmp(out, cases[i].code) == 0, "curl %s: %s", cases[i].args, out);
        free(out);
    }
    snprintf(cmd, sizeof(cmd), "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/",
             t.port);
    out = NULL;
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    ck_assert_str_eq(out, "404");
    free(out);
    srv_stop(&t);

    /* IPv6 loopback, where the host has it */
    rekv_metrics_server *s6 = NULL;
    if (rekv_metrics_server_create("[::1]:0", &s6, NULL) != 0) {
        printf("test_metrics: no IPv6 loopback, skipping the [::1] scrape\n");
        return;
    }
    rekv_metrics_server_free(s6);
    srv_start_at(&t, "[::1]:0", 0);
    snprintf(cmd, sizeof(cmd), "curl -sS --max-time 5 'http://[::1]:%d/metrics'", t.port);
    out = NULL;
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    ck_assert_int_eq(ms_check_exposition(out, strlen(out)), 5);
    free(out);
    srv_stop(&t);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("metrics_server");
    TCase *tc;
    tc = tcase_create("server");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_listen_addresses);
    tcase_add_test(tc, test_loopback_only);
    tcase_add_test(tc, test_all_interfaces_serves_v4);
    tcase_add_test(tc, test_get_metrics);
    tcase_add_test(tc, test_error_answers);
    tcase_add_test(tc, test_oversized);
    tcase_add_test(tc, test_100_open_at_once);
    tcase_add_test(tc, test_100_concurrent_scrapers);
    tcase_add_test(tc, test_garbage);
    tcase_add_test(tc, test_silent_clients);
    tcase_add_test(tc, test_slow_and_pipelined);
    tcase_add_test(tc, test_no_leaks);
    tcase_add_test(tc, test_curl);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
