/* test_evloop.c — the daemons' event loop (common/evloop.h) on real sockets and fds, by counts and
 * order, never by time: a ZeroMQ pair over inproc and a pipe ready in one round are called in the
 * order added; timers run earliest first, a periodic one exactly as often as it asks and a
 * one-shot one once; SIGTERM sent with kill() through the daemons' stop fd, and SIGINT through a
 * signalfd, reach the loop (stopping it, or the callback that decides); the before-sleep hook
 * runs once a round; an entry removed inside a callback is not called again, even later in the
 * same round; a stop ends the round and is honoured from another thread and before run; a socket
 * polled for nothing is left alone; the metrics server answers a scrape from inside the loop. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/daemon.h"
#include "common/evloop.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"

/* What the callbacks saw, in order. */
typedef struct trace {
    rekv_evloop *loop;
    char seq[256]; /* one letter per call */
    int n;
    int count[8];
    int stop_at; /* the count of seq at which a callback stops the loop; 0: never */
    int fds[4];  /* the fds a callback reads or removes */
    int ids[4];  /* entry or timer ids */
    void *sock;
    int signo;
} trace;

static void note(trace *t, char c)
{
    if (t->n + 1 < (int)sizeof(t->seq))
        t->seq[t->n++] = c;
    if (t->stop_at && t->n >= t->stop_at)
        rekv_evloop_stop(t->loop);
}

static rekv_evloop *loop_new(void)
{
    rekv_evloop *loop = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_evloop_create(&loop, &err) == 0, "%s", err.msg);
    return loop;
}

static void run_ok(rekv_evloop *loop)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_evloop_run(loop, &err) == 0, "%s", err.msg);
}

/* reads every message waiting on t->sock */
static void on_sock(rekv_evloop *loop, void *ctx, short revents)
{
    (void)loop;
    trace *t = ctx;
    ck_assert(revents & ZMQ_POLLIN);
    char buf[16];
    while (zmq_recv(t->sock, buf, sizeof(buf), ZMQ_DONTWAIT) >= 0) {
        t->count[0]++;
        note(t, 's');
    }
}

/* reads one byte from t->fds[0] */
static void on_pipe(rekv_evloop *loop, void *ctx, short revents)
{
    (void)loop;
    (void)revents;
    trace *t = ctx;
    char c;
    ck_assert_int_eq(read(t->fds[0], &c, 1), 1);
    t->count[1]++;
    note(t, 'p');
}

START_TEST(socket_and_pipe_in_order)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    void *zctx = zmq_ctx_new();
    void *a = zmq_socket(zctx, ZMQ_PAIR), *b = zmq_socket(zctx, ZMQ_PAIR);
    ck_assert_int_eq(zmq_bind(a, "inproc://evloop"), 0);
    ck_assert_int_eq(zmq_connect(b, "inproc://evloop"), 0);
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    t.fds[0] = p[0];
    t.sock = a;
    rekv_err err = {0};
    /* the pipe first: both are ready in the first round and are called in the order added */
    ck_assert_int_gt(rekv_evloop_add_fd(loop, p[0], ZMQ_POLLIN, on_pipe, &t, &err), 0);
    ck_assert_int_gt(rekv_evloop_add_socket(loop, a, ZMQ_POLLIN, on_sock, &t, &err), 0);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(zmq_send(b, "m", 1, 0), 1);
    ck_assert_int_eq(write(p[1], "x", 1), 1);
    t.stop_at = 4;
    run_ok(loop);
    ck_assert_str_eq(t.seq, "psss");
    ck_assert_int_eq(t.count[0], 3);
    ck_assert_int_eq(t.count[1], 1);
    rekv_evloop_free(loop);
    zmq_close(a);
    zmq_close(b);
    zmq_ctx_term(zctx);
    close(p[0]);
    close(p[1]);
}
END_TEST

static long timer_a(rekv_evloop *l, void *c)
{
    (void)l;
    note(c, 'a');
    return REKV_EVLOOP_TIMER_END;
}
static long timer_b(rekv_evloop *l, void *c)
{
    (void)l;
    note(c, 'b');
    return REKV_EVLOOP_TIMER_END;
}
static long timer_c(rekv_evloop *l, void *c)
{
    (void)l;
    note(c, 'c');
    return REKV_EVLOOP_TIMER_END;
}
static long timer_stop(rekv_evloop *l, void *c)
{
    note(c, 'z');
    rekv_evloop_stop(l);
    return REKV_EVLOOP_TIMER_END;
}

START_TEST(timers_earliest_first)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    rekv_err err = {0};
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 30, timer_c, &t, &err), 0);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 10, timer_a, &t, &err), 0);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 60, timer_stop, &t, &err), 0);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 20, timer_b, &t, &err), 0);
    int gone = rekv_evloop_timer_add(loop, 5, timer_c, &t, &err);
    ck_assert_int_eq(rekv_evloop_timer_del(loop, gone), 0); /* ended before it was due */
    run_ok(loop);
    ck_assert_str_eq(t.seq, "abcz");
    ck_assert_int_eq(rekv_evloop_timer_del(loop, gone), -ENOENT);
    rekv_evloop_free(loop);
}
END_TEST

/* runs every round (returns 0) until its fifth run, then stops the loop */
static long every_round(rekv_evloop *l, void *c)
{
    trace *t = c;
    note(t, 'r');
    if (++t->count[3] == 5) {
        rekv_evloop_stop(l);
        return REKV_EVLOOP_TIMER_END;
    }
    return 0;
}

/* periodic (1 ms) for three runs, then ends and starts every_round */
static long periodic(rekv_evloop *l, void *c)
{
    trace *t = c;
    note(t, 'P');
    if (++t->count[2] < 3)
        return 1;
    rekv_err err = {0};
    ck_assert_int_gt(rekv_evloop_timer_add(l, 0, every_round, t, &err), 0);
    return REKV_EVLOOP_TIMER_END;
}

START_TEST(periodic_timer_counts)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    rekv_err err = {0};
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 1, periodic, &t, &err), 0);
    run_ok(loop);
    ck_assert_str_eq(t.seq, "PPPrrrrr");
    rekv_evloop_free(loop);
}
END_TEST

static long send_sigterm(rekv_evloop *l, void *c)
{
    (void)l;
    (void)c;
    ck_assert_int_eq(kill(getpid(), SIGTERM), 0);
    return REKV_EVLOOP_TIMER_END;
}

START_TEST(sigterm_stops_the_loop)
{
    /* the daemons' way: a handler writes rekv_daemon_stop_fd's eventfd */
    int sfd = rekv_daemon_stop_fd();
    ck_assert_int_ge(sfd, 0);
    rekv_evloop *loop = loop_new();
    rekv_err err = {0};
    ck_assert_int_gt(rekv_evloop_add_signal_fd(loop, sfd, NULL, NULL, &err), 0);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 0, send_sigterm, NULL, &err), 0);
    run_ok(loop); /* returns: the signal stopped it */
    ck_assert_int_ge(rekv_evloop_rounds(loop), 1);
    rekv_evloop_free(loop);
}
END_TEST

/* the callback decides: the first SIGINT is noted, the second stops */
static void on_signal(rekv_evloop *l, void *c, int signo)
{
    trace *t = c;
    t->signo = signo;
    note(t, 'S');
    if (t->n == 2)
        rekv_evloop_stop(l);
}

static long send_sigint(rekv_evloop *l, void *c)
{
    (void)l;
    trace *t = c;
    if (t->count[0]++ == 2) /* one signal now, then one a round after it was seen */
        return REKV_EVLOOP_TIMER_END;
    ck_assert_int_eq(kill(getpid(), SIGINT), 0);
    return 0;
}

START_TEST(signalfd_callback_decides)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    ck_assert_int_eq(sigprocmask(SIG_BLOCK, &set, NULL), 0);
    int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    ck_assert_int_ge(sfd, 0);
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    rekv_err err = {0};
    ck_assert_int_gt(rekv_evloop_add_signal_fd(loop, sfd, on_signal, &t, &err), 0);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 0, send_sigint, &t, &err), 0);
    run_ok(loop);
    ck_assert_str_eq(t.seq, "SS");
    ck_assert_int_eq(t.signo, SIGINT);
    rekv_evloop_free(loop);
    close(sfd);
}
END_TEST

static void hook(rekv_evloop *l, void *c)
{
    (void)l;
    trace *t = c;
    t->count[4]++;
    note(t, 'h');
}

START_TEST(before_sleep_once_a_round)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    rekv_err err = {0};
    rekv_evloop_before_sleep(loop, hook, &t);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 0, every_round, &t, &err), 0);
    run_ok(loop);
    /* the hook before each poll, the timer after it, five rounds */
    ck_assert_str_eq(t.seq, "hrhrhrhrhr");
    ck_assert_int_eq(t.count[4], 5);
    ck_assert_uint_eq(rekv_evloop_rounds(loop), 5);
    rekv_evloop_free(loop);
}
END_TEST

/* removes itself and the second pipe's entry; never reads, so both stay readable */
static void remover(rekv_evloop *l, void *c, short revents)
{
    (void)revents;
    trace *t = c;
    note(t, '1');
    ck_assert_int_eq(rekv_evloop_del(l, t->ids[1]), 0);
    ck_assert_int_eq(rekv_evloop_del(l, t->ids[0]), 0);
    ck_assert_int_eq(rekv_evloop_del(l, t->ids[0]), -ENOENT);
}

static void removed(rekv_evloop *l, void *c, short revents)
{
    (void)l;
    (void)revents;
    note(c, '2');
}

static long stop_third_round(rekv_evloop *l, void *c)
{
    trace *t = c;
    if (++t->count[5] < 3)
        return 0;
    rekv_evloop_stop(l);
    return REKV_EVLOOP_TIMER_END;
}

START_TEST(remove_inside_a_callback)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    int p[2], q[2];
    ck_assert_int_eq(pipe(p), 0);
    ck_assert_int_eq(pipe(q), 0);
    ck_assert_int_eq(write(p[1], "x", 1), 1);
    ck_assert_int_eq(write(q[1], "x", 1), 1);
    rekv_err err = {0};
    t.ids[0] = rekv_evloop_add_fd(loop, p[0], ZMQ_POLLIN, remover, &t, &err);
    t.ids[1] = rekv_evloop_add_fd(loop, q[0], ZMQ_POLLIN, removed, &t, &err);
    ck_assert_int_gt(t.ids[1], t.ids[0]);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 0, stop_third_round, &t, &err), 0);
    run_ok(loop);
    /* both ready in the first round; the second was removed before its turn */
    ck_assert_str_eq(t.seq, "1");
    ck_assert_int_eq(t.count[5], 3);
    rekv_evloop_free(loop);
    close(p[0]), close(p[1]), close(q[0]), close(q[1]);
}
END_TEST

static void stopper(rekv_evloop *l, void *c, short revents)
{
    (void)revents;
    note(c, '1');
    rekv_evloop_stop(l);
}

static void *stop_later(void *arg)
{
    rekv_evloop_stop(arg);
    return NULL;
}

START_TEST(stop_ends_the_round)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    int p[2], q[2];
    ck_assert_int_eq(pipe(p), 0);
    ck_assert_int_eq(pipe(q), 0);
    ck_assert_int_eq(write(p[1], "x", 1), 1);
    ck_assert_int_eq(write(q[1], "x", 1), 1);
    rekv_err err = {0};
    ck_assert_int_gt(rekv_evloop_add_fd(loop, p[0], ZMQ_POLLIN, stopper, &t, &err), 0);
    ck_assert_int_gt(rekv_evloop_add_fd(loop, q[0], ZMQ_POLLIN, removed, &t, &err), 0);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 0, timer_a, &t, &err), 0);
    rekv_evloop_before_sleep(loop, hook, &t);
    run_ok(loop);
    /* neither the second fd, nor the due timer, nor another hook */
    ck_assert_str_eq(t.seq, "h1");
    /* a stop before run returns at once: no round */
    unsigned long long rounds = rekv_evloop_rounds(loop);
    rekv_evloop_stop(loop);
    run_ok(loop);
    ck_assert_uint_eq(rekv_evloop_rounds(loop), rounds);
    ck_assert_int_eq(t.count[4], 1);
    /* from another thread, into a loop asleep without timers (nothing readable is polled) */
    rekv_evloop_before_sleep(loop, NULL, NULL);
    rekv_evloop_free(loop);
    loop = loop_new();
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, stop_later, loop), 0);
    run_ok(loop);
    pthread_join(th, NULL);
    rekv_evloop_free(loop);
    close(p[0]), close(p[1]), close(q[0]), close(q[1]);
}
END_TEST

/* counts rounds; at the fourth, asks for the socket again */
static long watch_rounds(rekv_evloop *l, void *c)
{
    trace *t = c;
    if (++t->count[5] == 4)
        ck_assert_int_eq(rekv_evloop_set_events(l, t->ids[0], ZMQ_POLLIN), 0);
    return 0;
}

START_TEST(socket_polled_for_nothing)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop, .stop_at = 2};
    void *zctx = zmq_ctx_new();
    void *a = zmq_socket(zctx, ZMQ_PAIR), *b = zmq_socket(zctx, ZMQ_PAIR);
    ck_assert_int_eq(zmq_bind(a, "inproc://nothing"), 0);
    ck_assert_int_eq(zmq_connect(b, "inproc://nothing"), 0);
    ck_assert_int_eq(zmq_send(b, "m", 1, 0), 1);
    ck_assert_int_eq(zmq_send(b, "m", 1, 0), 1);
    t.sock = a;
    rekv_err err = {0};
    t.ids[0] = rekv_evloop_add_socket(loop, a, 0, on_sock, &t, &err);
    ck_assert_int_gt(t.ids[0], 0);
    ck_assert_int_gt(rekv_evloop_timer_add(loop, 0, watch_rounds, &t, &err), 0);
    run_ok(loop);
    /* read only once asked for: the rounds before left the messages waiting */
    ck_assert_str_eq(t.seq, "ss");
    ck_assert_int_eq(t.count[5], 4);
    ck_assert_int_eq(rekv_evloop_set_events(loop, 999, 0), -ENOENT);
    rekv_evloop_free(loop);
    zmq_close(a);
    zmq_close(b);
    zmq_ctx_term(zctx);
}
END_TEST

static int render(void *ctx, rekv_metrics_buf *b)
{
    trace *t = ctx;
    t->count[6]++;
    rekv_metrics_family(b, "evloop_test_renders_total", "counter", "scrapes answered");
    rekv_metrics_sample(b, "evloop_test_renders_total", NULL, t->count[6]);
    return 0;
}

typedef struct scrape_arg {
    int port;
    char *body;
    rekv_evloop *loop;
} scrape_arg;

static void *scrape_then_stop(void *arg)
{
    scrape_arg *s = arg;
    s->body = ms_scrape(s->port);
    rekv_evloop_stop(s->loop);
    return NULL;
}

START_TEST(metrics_scrape_from_the_loop)
{
    rekv_evloop *loop = loop_new();
    trace t = {.loop = loop};
    rekv_metrics_server *srv = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_metrics_server_create("127.0.0.1:0", &srv, &err) == 0, "%s", err.msg);
    rekv_evloop_serve_metrics(loop, srv, render, &t);
    scrape_arg s = {.port = rekv_metrics_server_port(srv), .loop = loop};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, scrape_then_stop, &s), 0);
    run_ok(loop);
    pthread_join(th, NULL);
    ck_assert_ptr_nonnull(s.body);
    ck_assert_int_eq(t.count[6], 1);
    ck_assert_ptr_nonnull(strstr(s.body, "evloop_test_renders_total 1"));
    free(s.body);
    rekv_evloop_free(loop);
    rekv_metrics_server_free(srv);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("evloop");
    TCase *tc = tcase_create("evloop");
    tcase_add_test(tc, socket_and_pipe_in_order);
    tcase_add_test(tc, timers_earliest_first);
    tcase_add_test(tc, periodic_timer_counts);
    tcase_add_test(tc, sigterm_stops_the_loop);
    tcase_add_test(tc, signalfd_callback_decides);
    tcase_add_test(tc, before_sleep_once_a_round);
    tcase_add_test(tc, remove_inside_a_callback);
    tcase_add_test(tc, stop_ends_the_round);
    tcase_add_test(tc, socket_polled_for_nothing);
    tcase_add_test(tc, metrics_scrape_from_the_loop);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
