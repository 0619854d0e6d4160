/* test_backend.c — the cpu backend's runtime: copies land in order with the right bytes and exact
 * counters, events order work across streams (CUDA semantics for re-recording), link emulation
 * takes the time a link of that bandwidth would and shares each direction between streams, copies
 * overlap kernels, traces are valid Chrome trace JSON, and a bad copy is reported by stream_sync.
 *
 * Timing tests compare ratios with wide margins: this must never be flaky on a loaded 2-core
 * machine. Ordering tests use gates (a kernel that blocks until the test opens it) rather than
 * sleeps, so that they are deterministic. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "gpuworker/device/backend.h"
#include "gpuworker/kernels.h"
#include "tests/testutil.h"

#define MiB (1024u * 1024u)

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

static rekv_backend *make_backend(double gbps, double latency_us)
{
    rekv_backend *be = NULL;
    rekv_err err = {0};
    rekv_link_config link = {.gbps = gbps, .latency_us = latency_us};
    ck_assert_msg(rekv_backend_cpu_create(&link, &be, &err) == 0, "%s", err.msg);
    ck_assert_str_eq(be->iface->name, "cpu");
    ck_assert(rekv_kernels_of(be) != NULL);
    return be;
}

static rekv_stream *make_stream(rekv_backend *be, const char *name)
{
    rekv_stream *s = NULL;
    rekv_err err = {0};
    ck_assert_msg(be->iface->stream_create(be, name, &s, &err) == 0, "%s", err.msg);
    return s;
}

static rekv_event *make_event(rekv_backend *be)
{
    rekv_event *ev = NULL;
    rekv_err err = {0};
    ck_assert_msg(be->iface->event_create(be, &ev, &err) == 0, "%s", err.msg);
    return ev;
}

static void sync_ok(rekv_backend *be, rekv_stream *s)
{
    rekv_err err = {0};
    int rc = be->iface->stream_sync(s, &err);
    ck_assert_msg(rc == 0, "stream_sync: %d %s", rc, err.msg);
}

static void copy1(rekv_backend *be, rekv_stream *s, int h2d, void *dst, const void *src,
                  size_t bytes, rekv_xfer_kind kind)
{
    rekv_copy_piece p = {.dst = dst, .src = src, .bytes = bytes};
    if (h2d)
        be->iface->copy_h2d(s, &p, 1, kind);
    else
        be->iface->copy_d2h(s, &p, 1, kind);
}

static void sleep_ms(double ms)
{
    struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms * 1e6) % 1000000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* ---- host functions used as kernels ---- */

/* A gate: kernels block on it until the test opens it, to hold a stream at a known point. */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int open;
} gate;

static void gate_init(gate *g)
{
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->open = 0;
}

static void gate_open(gate *g)
{
    pthread_mutex_lock(&g->mu);
    g->open = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static void gate_free(gate *g)
{
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
}

/* argument of the kernels below (copied by launch_host) */
typedef struct kern_arg {
    gate *g;          /* wait for it to open first, when not NULL */
    double sleep_ms;  /* then sleep this long */
    atomic_int *flag; /* then store value here, when not NULL */
    int value;
    atomic_int *watch; /* ... after reading this into *seen, when not NULL */
    atomic_int *seen;
    const volatile uint8_t *await; /* first wait (10 s at most) until *await == await_value, */
    uint8_t await_value;           /* storing 1 in *seen when it came, 0 when it did not */
} kern_arg;

static void kern(void *p)
{
    kern_arg *a = p;
    if (a->await) {
        int came = 0;
        for (int i = 0; i < 10000 && !(came = *a->await == a->await_value); i++)
            sleep_ms(1);
        atomic_store(a->seen, came);
        return;
    }
    if (a->g) {
        pthread_mutex_lock(&a->g->mu);
        while (!a->g->open)
            pthread_cond_wait(&a->g->cv, &a->g->mu);
        pthread_mutex_unlock(&a->g->mu);
    }
    if (a->sleep_ms > 0)
        sleep_ms(a->sleep_ms);
    if (a->watch)
        atomic_store(a->seen, atomic_load(a->watch));
    if (a->flag)
        atomic_store(a->flag, a->value);
}

static void launch(rekv_backend *be, rekv_stream *s, const char *name, kern_arg a)
{
    be->iface->launch_host(s, name, kern, &a, sizeof(a));
}

/* ---- copies ---- */

START_TEST(copies_land_in_order_with_exact_counters)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s = make_stream(be, "copy");
    rekv_stream *s2 = make_stream(be, "copy2");
    be->iface->timing(be, true);
    const size_t size = 4 * MiB;
    uint8_t *host = malloc(size), *out = malloc(size), *want = malloc(size);
    uint8_t *dev = be->iface->dev_alloc(be, size), *dev2 = be->iface->dev_alloc(be, size);
    ck_assert(host && out && want && dev && dev2);
    ck_assert_uint_eq((uintptr_t)dev % 64, 0);
    for (size_t i = 0; i < size; i++)
        host[i] = (uint8_t)rnd();
    memset(dev, 0, size);
    memset(want, 0, size);

    uint64_t want_h2d[REKV_XFER_KINDS] = {0}, want_d2h[REKV_XFER_KINDS] = {0};
    uint64_t want_h2d_n = 0, want_d2h_n = 0;
    /* many gathers of random pieces with random kinds; later copies overwrite earlier ones where
     * they overlap, so the result checks the order too */
    for (int op = 0; op < 200; op++) {
        rekv_copy_piece pieces[64];
        size_t n = 1 + rnd() % 64;
        rekv_xfer_kind kind = (rekv_xfer_kind)(rnd() % REKV_XFER_KINDS);
        for (size_t i = 0; i < n; i++) {
            size_t len = rnd() % 8192;
            size_t so = rnd() % (size - len), d = rnd() % (size - len);
            pieces[i] = (rekv_copy_piece){.dst = dev + d, .src = host + so, .bytes = len};
            memcpy(want + d, host + so, len); /* pieces of one copy land in order too */
            want_h2d[kind] += len;
        }
        be->iface->copy_h2d(s, pieces, n, kind);
        want_h2d_n++;
    }
    sync_ok(be, s);
    ck_assert_msg(memcmp(dev, want, size) == 0, "h2d gathers: device bytes differ");

    /* d2d to a second buffer, then back in two d2h copies; d2d is not counted */
    rekv_copy_piece d2d = {.dst = dev2, .src = dev, .bytes = size};
    be->iface->copy_d2d(s, &d2d, 1);
    rekv_copy_piece back[2] = {{.dst = out, .src = dev2, .bytes = size / 2},
                               {.dst = out + size / 2, .src = dev2 + size / 2, .bytes = size / 2}};
    be->iface->copy_d2h(s, back, 2, REKV_XFER_ACT);
    want_d2h[REKV_XFER_ACT] += size;
    want_d2h_n++;
    copy1(be, s2, 0, out, dev, 100, REKV_XFER_OTHER); /* another stream counts in the same stats */
    want_d2h[REKV_XFER_OTHER] += 100;
    want_d2h_n++;
    sync_ok(be, s);
    sync_ok(be, s2);
    ck_assert_msg(memcmp(out, want, size) == 0, "d2d + d2h: host bytes differ");

    rekv_backend_stats st;
    be->iface->stats(be, &st);
    for (int k = 0; k < REKV_XFER_KINDS; k++) {
        ck_assert_uint_eq(st.h2d_bytes[k], want_h2d[k]);
        ck_assert_uint_eq(st.d2h_bytes[k], want_d2h[k]);
    }
    ck_assert_uint_eq(st.h2d_copies, want_h2d_n);
    ck_assert_uint_eq(st.d2h_copies, want_d2h_n);
    ck_assert(st.h2d_busy_s > 0 && st.d2h_busy_s > 0);
    ck_assert(st.compute_busy_s == 0);

    be->iface->stats_reset(be);
    be->iface->stats(be, &st);
    ck_assert_uint_eq(st.h2d_copies + st.d2h_copies, 0);
    for (int k = 0; k < REKV_XFER_KINDS; k++)
        ck_assert_uint_eq(st.h2d_bytes[k] + st.d2h_bytes[k], 0);
    ck_assert(st.h2d_busy_s == 0 && st.d2h_busy_s == 0 && st.compute_busy_s == 0);

    be->iface->stream_destroy(s2);
    be->iface->stream_destroy(s);
    be->iface->dev_free(be, dev);
    be->iface->dev_free(be, dev2);
    free(host), free(out), free(want);
    rekv_backend_destroy(be);
}
END_TEST

/* Tasks of each stream run in order while several streams and threads run at once. */
typedef struct seq_arg {
    int *log; /* [n] positions written in order */
    int *len;
    int value;
} seq_arg;

static void seq_kern(void *p)
{
    seq_arg *a = p;
    a->log[(*a->len)++] = a->value;
}

/* Graphs: a capture runs nothing; each launch runs the kernels and copies again, in order, with
 * the arguments captured and the memory they point to as it is then, counting the copies again;
 * a capture that sees an event record is refused, and the event still completes. */
START_TEST(graph_capture_and_launch)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s = make_stream(be, "graph");
    rekv_err err = {0};
    int log[16], len = 0;
    uint8_t host[256], back[256], *dev = be->iface->dev_alloc(be, sizeof(host));
    ck_assert(dev != NULL);
    memset(host, 7, sizeof(host));
    ck_assert_int_eq(be->iface->graph_begin(s, &err), 0);
    ck_assert_int_eq(be->iface->graph_begin(s, &err), -EBUSY);
    err = (rekv_err){0};
    copy1(be, s, 1, dev, host, sizeof(host), REKV_XFER_KV);
    for (int v = 1; v <= 3; v++) {
        seq_arg a = {.log = log, .len = &len, .value = v};
        be->iface->launch_host(s, "seq", seq_kern, &a, sizeof(a));
    }
    copy1(be, s, 0, back, dev, sizeof(back), REKV_XFER_KV);
    rekv_graph *g = NULL;
    ck_assert_msg(be->iface->graph_end(s, &g, &err) == 0, "%s", err.msg);
    sync_ok(be, s);
    rekv_backend_stats st;
    be->iface->stats(be, &st);
    ck_assert_int_eq(len, 0);
    ck_assert_uint_eq(st.h2d_copies + st.d2h_copies, 0);
    for (int round = 1; round <= 2; round++) {
        memset(host, 10 + round, sizeof(host)); /* read when the launch runs */
        be->iface->graph_launch(s, g);
        sync_ok(be, s);
        ck_assert_int_eq(len, 3 * round);
        for (int i = 0; i < 3; i++)
            ck_assert_int_eq(log[3 * (round - 1) + i], i + 1);
        for (size_t i = 0; i < sizeof(back); i++)
            ck_assert_int_eq(back[i], 10 + round);
        be->iface->stats(be, &st);
        ck_assert_uint_eq(st.h2d_bytes[REKV_XFER_KV], round * sizeof(host));
        ck_assert_uint_eq(st.d2h_copies, (uint64_t)round);
    }
    be->iface->graph_destroy(g);
    /* an event recorded during a capture: refused, and the event completes */
    rekv_event *ev = make_event(be);
    ck_assert_int_eq(be->iface->graph_begin(s, &err), 0);
    be->iface->event_record(ev, s);
    ck_assert_int_eq(be->iface->graph_end(s, &g, &err), -ENOTSUP);
    ck_assert(g == NULL && strstr(err.msg, "capture") != NULL);
    be->iface->event_sync(ev);
    sync_ok(be, s);
    be->iface->event_destroy(ev);
    be->iface->dev_free(be, dev);
    be->iface->stream_destroy(s);
    rekv_backend_destroy(be);
}
END_TEST

/* Busy times count the work enqueued while timing is on or a trace records, and nothing else;
 * byte counters count everything. */
START_TEST(busy_only_while_timing)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s = make_stream(be, "busy");
    const size_t size = 1 * MiB;
    uint8_t *host = calloc(1, size), *dev = be->iface->dev_alloc(be, size);
    ck_assert(host && dev);
    rekv_backend_stats st;
    double seen[3] = {0, 0, 0}; /* compute, h2d, d2h busy after each phase */
    for (int phase = 0; phase < 4; phase++) {
        if (phase == 1)
            be->iface->timing(be, true);
        if (phase == 2)
            be->iface->timing(be, false);
        if (phase == 3)
            be->iface->trace_start(be);
        copy1(be, s, 1, dev, host, size, REKV_XFER_KV);
        launch(be, s, "sleep", (kern_arg){.sleep_ms = 2});
        copy1(be, s, 0, host, dev, size, REKV_XFER_KV);
        sync_ok(be, s);
        be->iface->stats(be, &st);
        ck_assert_uint_eq(st.h2d_bytes[REKV_XFER_KV], (phase + 1) * size);
        ck_assert_uint_eq(st.d2h_bytes[REKV_XFER_KV], (phase + 1) * size);
        double now[3] = {st.compute_busy_s, st.h2d_busy_s, st.d2h_busy_s};
        for (int k = 0; k < 3; k++) {
            if (phase == 0 || phase == 2)
                ck_assert_msg(now[k] == seen[k], "phase %d: busy time %d moved untimed", phase, k);
            else
                ck_assert_msg(now[k] > seen[k], "phase %d: busy time %d did not move", phase, k);
            seen[k] = now[k];
        }
    }
    ck_assert(st.compute_busy_s >= 4e-3);
    be->iface->dev_free(be, dev);
    free(host);
    be->iface->stream_destroy(s);
    rekv_backend_destroy(be);
}
END_TEST

START_TEST(streams_run_in_order_concurrently)
{
    enum { STREAMS = 4, TASKS = 2000 };
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s[STREAMS];
    static int log[STREAMS][TASKS];
    int len[STREAMS] = {0};
    char name[16];
    for (int i = 0; i < STREAMS; i++) {
        snprintf(name, sizeof(name), "s%d", i);
        s[i] = make_stream(be, name);
    }
    be->iface->timing(be, true);
    for (int t = 0; t < TASKS; t++)
        for (int i = 0; i < STREAMS; i++) {
            seq_arg a = {.log = log[i], .len = &len[i], .value = t};
            be->iface->launch_host(s[i], "seq", seq_kern, &a, sizeof(a));
        }
    for (int i = 0; i < STREAMS; i++) {
        sync_ok(be, s[i]);
        ck_assert_int_eq(len[i], TASKS);
        for (int t = 0; t < TASKS; t++)
            ck_assert_int_eq(log[i][t], t);
    }
    rekv_backend_stats st;
    be->iface->stats(be, &st);
    ck_assert(st.compute_busy_s > 0);
    for (int i = 0; i < STREAMS; i++)
        be->iface->stream_destroy(s[i]);
    rekv_backend_destroy(be);
}
END_TEST

START_TEST(stream_destroy_waits_for_its_work)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s = make_stream(be, "s");
    atomic_int flag = 0;
    launch(be, s, "slow", (kern_arg){.sleep_ms = 20, .flag = &flag, .value = 1});
    be->iface->stream_destroy(s);
    ck_assert_int_eq(atomic_load(&flag), 1);
    rekv_backend_destroy(be);
}
END_TEST

/* ---- events ---- */

START_TEST(event_orders_work_across_streams)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *a = make_stream(be, "a"), *b = make_stream(be, "b");
    rekv_event *ev = make_event(be);
    atomic_int flag = 0, seen = -1;

    /* a slow kernel on a, then b waits for it and reads what it wrote */
    launch(be, a, "produce", (kern_arg){.sleep_ms = 30, .flag = &flag, .value = 1});
    be->iface->event_record(ev, a);
    be->iface->stream_wait_event(b, ev);
    launch(be, b, "consume", (kern_arg){.watch = &flag, .seen = &seen});
    sync_ok(be, b);
    ck_assert_int_eq(atomic_load(&seen), 1);
    sync_ok(be, a);

    be->iface->event_destroy(ev);
    be->iface->stream_destroy(a);
    be->iface->stream_destroy(b);
    rekv_backend_destroy(be);
}
END_TEST

START_TEST(event_rerecord_semantics)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *a = make_stream(be, "a"), *b = make_stream(be, "b"), *c = make_stream(be, "c");
    rekv_event *ev = make_event(be);
    atomic_int flag = 0, seen = -1, b_done = 0;
    gate g;
    gate_init(&g);

    /* 1. a wait enqueued before a re-record waits for the record it saw: b waits on a's
     *    (gated) work even though ev is then re-recorded on idle c */
    launch(be, a, "gated", (kern_arg){.g = &g, .flag = &flag, .value = 1});
    be->iface->event_record(ev, a);
    be->iface->stream_wait_event(b, ev);
    launch(be, b, "after-wait",
           (kern_arg){.watch = &flag, .seen = &seen, .flag = &b_done, .value = 1});
    be->iface->event_record(ev, c);
    sync_ok(be, c);
    be->iface->event_sync(ev); /* now waits for c's record only: returns with a still gated */
    sleep_ms(20);
    ck_assert_msg(atomic_load(&b_done) == 0, "b ran before the event it waited for completed");
    gate_open(&g);
    sync_ok(be, b);
    ck_assert_int_eq(atomic_load(&seen), 1);

    /* 2. a wait enqueued after a re-record waits for the new record only */
    gate g2;
    gate_init(&g2);
    atomic_int flag2 = 0, seen2 = -1;
    launch(be, a, "gated2", (kern_arg){.g = &g2, .flag = &flag2, .value = 1});
    be->iface->event_record(ev, a);
    be->iface->event_record(ev, c); /* replaces the record on a */
    be->iface->stream_wait_event(b, ev);
    launch(be, b, "reads", (kern_arg){.watch = &flag2, .seen = &seen2});
    sync_ok(be, b); /* would hang if b waited for a */
    ck_assert_int_eq(atomic_load(&seen2), 0);
    gate_open(&g2);
    sync_ok(be, a);

    be->iface->event_destroy(ev);
    be->iface->stream_destroy(a);
    be->iface->stream_destroy(b);
    be->iface->stream_destroy(c);
    gate_free(&g);
    gate_free(&g2);
    rekv_backend_destroy(be);
}
END_TEST

static void *open_later(void *p)
{
    sleep_ms(20);
    gate_open(p);
    return NULL;
}

START_TEST(event_sync_and_never_recorded)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *a = make_stream(be, "a"), *b = make_stream(be, "b");
    rekv_event *ev = make_event(be), *never = make_event(be);
    atomic_int flag = 0, seen = -1;
    gate g;
    gate_init(&g);

    /* never recorded: neither event_sync nor a stream wait blocks */
    be->iface->event_sync(never);
    be->iface->stream_wait_event(b, never);
    launch(be, b, "free", (kern_arg){.watch = &flag, .seen = &seen});
    sync_ok(be, b);
    ck_assert_int_eq(atomic_load(&seen), 0);

    /* event_sync blocks the caller until the recorded work is done */
    launch(be, a, "gated", (kern_arg){.g = &g, .flag = &flag, .value = 7});
    be->iface->event_record(ev, a);
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, open_later, &g), 0);
    uint64_t t0 = rekv_now_ns();
    be->iface->event_sync(ev);
    ck_assert_int_eq(atomic_load(&flag), 7);
    ck_assert(rekv_now_ns() - t0 >= 15000000ull);
    pthread_join(th, NULL);
    /* a completed event stays complete */
    be->iface->event_sync(ev);
    be->iface->event_destroy(ev);
    be->iface->event_destroy(never);
    be->iface->stream_destroy(a);
    be->iface->stream_destroy(b);
    gate_free(&g);
    rekv_backend_destroy(be);
}
END_TEST

START_TEST(event_destroyed_while_awaited)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *a = make_stream(be, "a"), *b = make_stream(be, "b");
    rekv_event *ev = make_event(be);
    atomic_int flag = 0, seen = -1;
    launch(be, a, "slow", (kern_arg){.sleep_ms = 20, .flag = &flag, .value = 1});
    be->iface->event_record(ev, a);
    be->iface->stream_wait_event(b, ev);
    be->iface->event_destroy(ev); /* the enqueued record and wait still hold */
    launch(be, b, "reads", (kern_arg){.watch = &flag, .seen = &seen});
    sync_ok(be, b);
    ck_assert_int_eq(atomic_load(&seen), 1);
    be->iface->stream_destroy(a);
    be->iface->stream_destroy(b);
    rekv_backend_destroy(be);
}
END_TEST

/* ---- link emulation ---- */

/* Seconds to run one copy of `bytes` on each of the given streams/directions at once. */
static double timed_copies(rekv_backend *be, rekv_stream **s, const int *h2d, int n, void **dst,
                           void **src, size_t bytes)
{
    uint64_t t0 = rekv_now_ns();
    for (int i = 0; i < n; i++)
        copy1(be, s[i], h2d[i], dst[i], src[i], bytes, REKV_XFER_KV);
    for (int i = 0; i < n; i++)
        sync_ok(be, s[i]);
    return (double)(rekv_now_ns() - t0) * 1e-9;
}

/* A span's start and duration are written to 0.001 us (rekv_trace_span): an end read back as
 * start + duration may pass the next span's start by that much where the two are adjacent. */
#define SPAN_EPS_US 0.0025

/* The copy spans of the trace recorded since trace_start whose label starts with dir ("h2d",
 * "d2h"), at most n; returns how many there were. */
static int copy_spans(rekv_backend *be, const char *dir, tu_span *out, int n)
{
    size_t ns;
    tu_span *all = tu_trace_spans(be, &ns);
    int k = 0;
    for (size_t i = 0; i < ns; i++)
        if (strncmp(all[i].label, dir, 3) == 0 && k++ < n)
            out[k - 1] = all[i];
    free(all);
    return k;
}

START_TEST(link_emulation_timing)
{
    const size_t bytes = 16 * MiB;
    /* gbps 8 = 1 GB/s: 16 MiB takes 16.78 ms + 0.1 ms latency */
    const double expect = 100e-6 + (double)bytes / 1e9;
    rekv_backend *be = make_backend(8, 100);
    rekv_stream *s[2] = {make_stream(be, "x"), make_stream(be, "y")};
    uint8_t *h[2], *d[2];
    for (int i = 0; i < 2; i++) {
        h[i] = malloc(bytes);
        d[i] = be->iface->dev_alloc(be, bytes);
        ck_assert(h[i] && d[i]);
        memset(h[i], i + 1, bytes);
        memset(d[i], i + 3, bytes);
    }
    void *dst_h2d[2] = {d[0], d[1]}, *src_h2d[2] = {h[0], h[1]};
    int both_h2d[2] = {1, 1}, duplex[2] = {1, 0};
    void *dst_dup[2] = {d[0], h[1]}, *src_dup[2] = {h[0], d[1]};

    /* Lower bounds are deterministic (the link sleeps until a copy is due); no upper bounds. */
    timed_copies(be, s, both_h2d, 1, dst_h2d, src_h2d, bytes); /* warm the pages */
    be->iface->stats_reset(be);
    be->iface->timing(be, true);
    double one = timed_copies(be, s, both_h2d, 1, dst_h2d, src_h2d, bytes);
    rekv_backend_stats st;
    be->iface->stats(be, &st);
    ck_assert_msg(one >= expect * 0.995, "copy took %.2f ms, link model says %.2f ms", one * 1e3,
                  expect * 1e3);
    ck_assert_msg(st.h2d_busy_s >= expect * 0.995 && st.h2d_busy_s <= one * 1.001,
                  "h2d busy %.3f ms", st.h2d_busy_s * 1e3);
    ck_assert_uint_eq(st.h2d_bytes[REKV_XFER_KV], bytes);
    ck_assert_uint_eq(st.h2d_copies, 1);
    /* two streams copying h2d at once share the link: at least twice as long, and their spans
     * never overlap; h2d and d2h at once: full duplex, their spans overlap. Orders, not
     * durations (an upper bound on a time fails on a loaded machine): the link holds each
     * direction while a copy is due, so a shared link could never show two copies at once. */
    be->iface->trace_start(be);
    double t2 = timed_copies(be, s, both_h2d, 2, dst_h2d, src_h2d, bytes);
    ck_assert_msg(t2 >= 2 * expect * 0.995, "two shared copies took %.2f ms, model %.2f ms",
                  t2 * 1e3, 2 * expect * 1e3);
    tu_span two[2];
    ck_assert_int_eq(copy_spans(be, "h2d", two, 2), 2);
    ck_assert_msg(two[0].end <= two[1].start + SPAN_EPS_US ||
                      two[1].end <= two[0].start + SPAN_EPS_US,
                  "two h2d copies ran at once on one link: [%.0f, %.0f] and [%.0f, %.0f] us",
                  two[0].start, two[0].end, two[1].start, two[1].end);
    timed_copies(be, s, duplex, 2, dst_dup, src_dup, bytes);
    ck_assert_msg(memcmp(d[0], h[0], bytes) == 0 && memcmp(h[1], d[1], bytes) == 0,
                  "throttled copies moved the wrong bytes");
    for (int i = 0; i < 2; i++) {
        be->iface->stream_destroy(s[i]);
        be->iface->dev_free(be, d[i]);
        free(h[i]);
    }
    rekv_backend_destroy(be);

    /* the duplex overlap on a link whose copies take 0.4 s each (latency), so that both stream
     * threads surely start within one copy's time even on a loaded machine */
    be = make_backend(8, 400e3);
    s[0] = make_stream(be, "x");
    s[1] = make_stream(be, "y");
    static uint8_t small[4][4096];
    void *dst2[2] = {small[0], small[2]}, *src2[2] = {small[1], small[3]};
    be->iface->trace_start(be);
    timed_copies(be, s, duplex, 2, dst2, src2, sizeof(small[0]));
    tu_span up, down;
    ck_assert_int_eq(copy_spans(be, "h2d", &up, 1), 1);
    ck_assert_int_eq(copy_spans(be, "d2h", &down, 1), 1);
    ck_assert_msg(up.start < down.end && down.start < up.end,
                  "h2d [%.0f, %.0f] and d2h [%.0f, %.0f] us did not overlap: the directions "
                  "share the link",
                  up.start, up.end, down.start, down.end);
    for (int i = 0; i < 2; i++)
        be->iface->stream_destroy(s[i]);
    rekv_backend_destroy(be);
}
END_TEST

/* The emulated link is a DMA engine (backend_cpu_internal.h, cpu_link): copies queued back to back
 * follow each other with no gap on the link, whenever the stream's thread gets to start the next
 * (it was after the thread woke from the first: a gap as long as the machine kept it from a CPU,
 * a layer's compute when the GEMM pool held the cores); and a copy behind a wait still starts
 * only once what it waited for is done. Orders and equalities of the link's own times. */
START_TEST(link_is_a_dma_engine)
{
    const size_t bytes = MiB; /* over an emulated 1 GB/s link with 100 us latency: ~1.1 ms */
    rekv_backend *be = make_backend(8, 100);
    rekv_stream *sh = make_stream(be, "h2d"), *sc = make_stream(be, "compute");
    rekv_event *ev = NULL;
    rekv_err err = {0};
    ck_assert_msg(be->iface->event_create(be, &ev, &err) == 0, "%s", err.msg);
    uint8_t *h = malloc(3 * bytes), *d = be->iface->dev_alloc(be, 3 * bytes);
    ck_assert(h && d);
    memset(h, 7, 3 * bytes);
    be->iface->trace_start(be);
    be->iface->timing(be, true);
    be->iface->stats_reset(be);
    copy1(be, sh, 1, d, h, bytes, REKV_XFER_KV);
    copy1(be, sh, 1, d + bytes, h + bytes, bytes, REKV_XFER_KV);
    launch(be, sc, "busy", (kern_arg){.sleep_ms = 20}); /* what the third copy waits for */
    be->iface->event_record(ev, sc);
    be->iface->stream_wait_event(sh, ev);
    copy1(be, sh, 1, d + 2 * bytes, h + 2 * bytes, bytes, REKV_XFER_KV);
    sync_ok(be, sh);
    sync_ok(be, sc);
    ck_assert(memcmp(d, h, 3 * bytes) == 0);
    tu_span c[3];
    ck_assert_int_eq(copy_spans(be, "h2d", c, 3), 3);
    size_t ns;
    tu_span *all = tu_trace_spans(be, &ns), busy = {0};
    for (size_t i = 0; i < ns; i++)
        if (strcmp(all[i].label, "busy") == 0)
            busy = all[i];
    free(all);
    ck_assert_msg(fabs(c[1].start - c[0].end) < SPAN_EPS_US,
                  "a gap on the link between two queued copies: "
                  "[%.3f, %.3f] then [%.3f, %.3f] us",
                  c[0].start, c[0].end, c[1].start, c[1].end);
    ck_assert_msg(c[2].start >= busy.end - SPAN_EPS_US && busy.end > 0,
                  "a copy began at %.3f us, before what it waited for ended (%.3f us)", c[2].start,
                  busy.end);
    /* busy: three times the model's duration, each copy its own */
    rekv_backend_stats st;
    be->iface->stats(be, &st);
    double one = (c[0].end - c[0].start) * 1e-6;
    ck_assert_msg(fabs(st.h2d_busy_s - 3 * one) < 1e-7, "h2d busy %.6f s, three copies of %.6f s",
                  st.h2d_busy_s, one);
    be->iface->event_destroy(ev);
    be->iface->stream_destroy(sh);
    be->iface->stream_destroy(sc);
    be->iface->dev_free(be, d);
    free(h);
    rekv_backend_destroy(be);
}
END_TEST

/* A copy on one stream runs while a kernel on another does: the kernel, launched first, waits for
 * the copy's last byte to land (with a 10 s guard) — streams run one after another would leave it
 * waiting. Order, not time. */
START_TEST(copy_overlaps_kernel)
{
    const size_t bytes = 4 * MiB; /* over an emulated 1 GB/s link: ~4 ms */
    rekv_backend *be = make_backend(8, 100);
    rekv_stream *comp = make_stream(be, "compute"), *h2d = make_stream(be, "h2d");
    uint8_t *h = malloc(bytes), *d = be->iface->dev_alloc(be, bytes);
    ck_assert(h && d);
    memset(h, 5, bytes);
    memset(d, 0, bytes);
    atomic_int came = -1;
    be->iface->stats_reset(be);
    be->iface->timing(be, true);
    launch(be, comp, "await-copy",
           (kern_arg){.await = d + bytes - 1, .await_value = 5, .seen = &came});
    copy1(be, h2d, 1, d, h, bytes, REKV_XFER_WEIGHTS);
    sync_ok(be, comp);
    sync_ok(be, h2d);
    ck_assert_msg(atomic_load(&came) == 1,
                  "the kernel never saw the copy land: the streams did not "
                  "run together");
    rekv_backend_stats st;
    be->iface->stats(be, &st);
    ck_assert(st.compute_busy_s > 0 && st.h2d_busy_s > 0);
    ck_assert_uint_eq(st.h2d_bytes[REKV_XFER_WEIGHTS], bytes);
    be->iface->stream_destroy(comp);
    be->iface->stream_destroy(h2d);
    be->iface->dev_free(be, d);
    free(h);
    rekv_backend_destroy(be);
}
END_TEST

/* ---- trace ---- */

START_TEST(trace_is_chrome_json)
{
    rekv_backend *be = make_backend(0, 0);
    const char *odd = "odd \"name\"\\\t";
    rekv_stream *comp = make_stream(be, "compute"), *io = make_stream(be, odd);
    rekv_stream *unused = make_stream(be, "before");
    rekv_event *ev = make_event(be);
    uint8_t *h = malloc(MiB), *d = be->iface->dev_alloc(be, MiB);
    memset(h, 1, MiB);

    launch(be, unused, "not-traced", (kern_arg){0});
    sync_ok(be, unused);
    be->iface->trace_start(be);
    /* io blocks on a wait for compute's 20 ms kernel: a "wait" span */
    launch(be, comp, "slow", (kern_arg){.sleep_ms = 20});
    be->iface->event_record(ev, comp);
    be->iface->stream_wait_event(io, ev);
    copy1(be, io, 1, d, h, MiB, REKV_XFER_KV);
    copy1(be, io, 0, h, d, 4096, REKV_XFER_ACT);
    launch(be, comp, "attention \"q\"", (kern_arg){0});
    be->iface->event_record(ev, comp);
    be->iface->stream_wait_event(io, ev);
    launch(be, io, "after-wait", (kern_arg){0});
    sync_ok(be, comp);
    sync_ok(be, io);

    char *dir = tu_tmpdir(), path[4200];
    snprintf(path, sizeof(path), "%s/trace.json", dir);
    rekv_err err = {0};
    ck_assert_msg(be->iface->trace_write(be, path, &err) == 0, "%s", err.msg);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    ck_assert_msg(root != NULL, "trace is not JSON: %s line %d", jerr.text, jerr.line);
    ck_assert_str_eq(json_string_value(json_object_get(root, "displayTimeUnit")), "ms");
    json_t *evs = json_object_get(root, "traceEvents");
    ck_assert(json_is_array(evs));

    json_int_t tid_comp = -1, tid_io = -1;
    int n_comp = 0, n_io = 0, saw_h2d = 0, saw_d2h = 0, saw_wait = 0, saw_quote = 0;
    size_t i;
    json_t *e;
    json_array_foreach(evs, i, e)
    {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        const char *name = json_string_value(json_object_get(e, "name"));
        ck_assert(ph && name);
        if (strcmp(ph, "M") == 0 && strcmp(name, "thread_name") == 0) {
            const char *tn = json_string_value(json_object_get(json_object_get(e, "args"), "name"));
            ck_assert(tn);
            if (strcmp(tn, "compute") == 0)
                tid_comp = json_integer_value(json_object_get(e, "tid"));
            if (strcmp(tn, odd) == 0)
                tid_io = json_integer_value(json_object_get(e, "tid"));
        }
    }
    ck_assert_msg(tid_comp > 0 && tid_io > 0 && tid_comp != tid_io, "thread_name metadata");
    json_array_foreach(evs, i, e)
    {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        if (strcmp(ph, "X") != 0)
            continue;
        const char *name = json_string_value(json_object_get(e, "name"));
        json_int_t tid = json_integer_value(json_object_get(e, "tid"));
        double ts = json_number_value(json_object_get(e, "ts"));
        double dur = json_number_value(json_object_get(e, "dur"));
        ck_assert_msg(ts >= 0 && dur >= 0, "span %s: ts %g dur %g", name, ts, dur);
        ck_assert_msg(strcmp(name, "not-traced") != 0, "span from before trace_start");
        n_comp += tid == tid_comp;
        n_io += tid == tid_io;
        saw_h2d |= tid == tid_io && strcmp(name, "h2d KV 1.0 MiB") == 0;
        saw_d2h |= tid == tid_io && strcmp(name, "d2h ACT 4.0 KiB") == 0;
        saw_wait |= tid == tid_io && strcmp(name, "wait") == 0 && dur >= 1;
        saw_quote |= tid == tid_comp && strcmp(name, "attention \"q\"") == 0;
    }
    ck_assert_msg(n_comp == 2, "compute spans: %d", n_comp);
    ck_assert_msg(n_io >= 3, "io spans: %d", n_io);
    ck_assert(saw_h2d && saw_d2h && saw_quote);
    ck_assert_msg(saw_wait, "no wait span on the io stream for the 20 ms kernel");
    json_decref(root);

    /* trace_start again clears the spans */
    be->iface->trace_start(be);
    ck_assert_msg(be->iface->trace_write(be, path, &err) == 0, "%s", err.msg);
    root = json_load_file(path, 0, &jerr);
    ck_assert(root != NULL);
    int n_x = 0;
    json_array_foreach(json_object_get(root, "traceEvents"), i, e) n_x +=
        strcmp(json_string_value(json_object_get(e, "ph")), "X") == 0;
    ck_assert_int_eq(n_x, 0);
    json_decref(root);

    /* an unwritable path is an error, not a crash */
    rekv_err_clear(&err);
    ck_assert_int_lt(be->iface->trace_write(be, "/nonexistent/dir/t.json", &err), 0);
    ck_assert(strstr(err.msg, "/nonexistent/dir/t.json") != NULL);

    tu_rmrf(dir);
    free(dir);
    be->iface->event_destroy(ev);
    be->iface->stream_destroy(comp);
    be->iface->stream_destroy(io);
    be->iface->stream_destroy(unused);
    be->iface->dev_free(be, d);
    free(h);
    rekv_backend_destroy(be);
}
END_TEST

/* ---- errors ---- */

/* The emulated device's memory: allocations beyond it fail, frees give it back, mem_info tells;
 * without a limit mem_info says there is none. */
START_TEST(device_memory_emulation)
{
    rekv_backend *be = make_backend(0, 0);
    size_t fr = 0, tot = 0;
    rekv_err err = {0};
    ck_assert_int_eq(be->iface->mem_info(be, &fr, &tot, &err), -ENOTSUP);
    rekv_backend_destroy(be);
    rekv_link_config link = {.gbps = 0, .latency_us = 0, .device_bytes = 1 << 20};
    ck_assert_int_eq(rekv_backend_cpu_create(&link, &be, &err), 0);
    ck_assert_int_eq(be->iface->mem_info(be, &fr, &tot, &err), 0);
    ck_assert_uint_eq(tot, 1 << 20);
    ck_assert_uint_eq(fr, 1 << 20);
    void *a = be->iface->dev_alloc(be, 600 << 10);
    ck_assert(a != NULL);
    ck_assert_int_eq(be->iface->mem_info(be, &fr, &tot, &err), 0);
    ck_assert(fr <= (1 << 20) - (600 << 10) && fr > (1 << 20) - (700 << 10));
    ck_assert(be->iface->dev_alloc(be, 600 << 10) == NULL); /* does not fit */
    void *b = be->iface->dev_alloc(be, 100 << 10);          /* does */
    ck_assert(b != NULL);
    be->iface->dev_free(be, a);
    void *c = be->iface->dev_alloc(be, 600 << 10); /* fits again */
    ck_assert(c != NULL);
    be->iface->dev_free(be, b);
    be->iface->dev_free(be, c);
    ck_assert_int_eq(be->iface->mem_info(be, &fr, &tot, &err), 0);
    ck_assert_uint_eq(fr, 1 << 20);
    rekv_backend_destroy(be);
}
END_TEST

START_TEST(bad_copy_is_reported_by_sync)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s = make_stream(be, "kv-in");
    uint8_t src[64], dst[64];
    memset(src, 9, sizeof(src));
    memset(dst, 0, sizeof(dst));
    rekv_copy_piece bad[2] = {{.dst = dst, .src = src, .bytes = 8},
                              {.dst = dst, .src = NULL, .bytes = 8}};
    be->iface->copy_h2d(s, bad, 2, REKV_XFER_KV);
    rekv_err err = {0};
    ck_assert_int_eq(be->iface->stream_sync(s, &err), -EINVAL);
    ck_assert_int_eq(err.code, -EINVAL);
    ck_assert_msg(strstr(err.msg, "kv-in") && strstr(err.msg, "NULL"), "message: %s", err.msg);
    ck_assert_msg(dst[0] == 0, "a rejected copy moved bytes");

    /* the error is reported once, and the stream keeps working */
    sync_ok(be, s);
    copy1(be, s, 1, dst, src, sizeof(src), REKV_XFER_KV);
    sync_ok(be, s);
    ck_assert(memcmp(dst, src, sizeof(src)) == 0);

    /* a NULL kernel and a NULL piece array too */
    be->iface->launch_host(s, "nothing", NULL, NULL, 0);
    rekv_err_clear(&err);
    ck_assert_int_eq(be->iface->stream_sync(s, &err), -EINVAL);
    ck_assert(strstr(err.msg, "nothing") != NULL);
    be->iface->copy_d2h(s, NULL, 3, REKV_XFER_OTHER);
    rekv_err_clear(&err);
    ck_assert_int_eq(be->iface->stream_sync(s, &err), -EINVAL);

    rekv_backend_stats st;
    be->iface->stats(be, &st);
    ck_assert_uint_eq(st.h2d_copies, 1);
    ck_assert_uint_eq(st.h2d_bytes[REKV_XFER_KV], sizeof(src));
    be->iface->stream_destroy(s);
    rekv_backend_destroy(be);
}
END_TEST

/* A listed copy's list, written by a kernel on the stream (as infinigen's selection and clo's
 * decisions are; on cpu a kernel is a task on the stream). */
typedef struct defer_list {
    rekv_copy_piece pieces[4];
    size_t n;
    rekv_copy_piece write[4]; /* what the kernel writes */
    size_t write_n;
} defer_list;

static void defer_fill(void *arg)
{
    defer_list *l = arg;
    memcpy(l->pieces, l->write, sizeof(l->pieces));
    l->n = l->write_n;
}

/* copy_h2d_listed copies the pieces its stream's earlier work wrote — not those there at
 * enqueue — counted when it runs; a list longer than its room or with a NULL piece fails the
 * stream. Every blocking call counts in host_syncs, nothing else does. */
START_TEST(listed_copy_reads_its_list_when_it_runs)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s = make_stream(be, "kv-in");
    uint8_t src[64], dst[64];
    for (int i = 0; i < 64; i++)
        src[i] = (uint8_t)(i + 1);
    memset(dst, 0, sizeof(dst));
    gate g;
    gate_init(&g);
    defer_list l = {.n = 1, .pieces = {{dst, src, 64}}}; /* at enqueue: the whole buffer */
    l.write[0] = (rekv_copy_piece){dst, src + 8, 8};
    l.write[1] = (rekv_copy_piece){dst + 32, src, 4};
    l.write_n = 2;
    launch(be, s, "hold", (kern_arg){.g = &g});
    be->iface->launch_host(s, "decide", defer_fill, &l, 0);
    be->iface->copy_h2d_listed(s, l.pieces, &l.n, 4, REKV_XFER_KV);
    rekv_backend_stats st;
    be->iface->stats(be, &st);
    ck_assert_uint_eq(st.h2d_copies, 0);
    ck_assert_uint_eq(st.host_syncs, 0); /* enqueueing never blocks */
    gate_open(&g);
    sync_ok(be, s);
    for (int i = 0; i < 64; i++)
        ck_assert_uint_eq(dst[i], i < 8 ? src[8 + i] : i >= 32 && i < 36 ? src[i - 32] : 0);
    be->iface->stats(be, &st);
    ck_assert_uint_eq(st.h2d_copies, 1);
    ck_assert_uint_eq(st.h2d_bytes[REKV_XFER_KV], 12);
    ck_assert_uint_eq(st.host_syncs, 1);

    /* more pieces than its room, a NULL source: the stream fails, nothing is copied */
    rekv_err err = {0};
    memset(dst, 0, sizeof(dst));
    l.write_n = 3;
    be->iface->launch_host(s, "decide", defer_fill, &l, 0);
    be->iface->copy_h2d_listed(s, l.pieces, &l.n, 2, REKV_XFER_KV);
    ck_assert_int_eq(be->iface->stream_sync(s, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "kv-in") && strstr(err.msg, "room for 2"), "message: %s",
                  err.msg);
    l.write[1].src = NULL;
    l.write_n = 2;
    be->iface->launch_host(s, "decide", defer_fill, &l, 0);
    be->iface->copy_h2d_listed(s, l.pieces, &l.n, 4, REKV_XFER_KV);
    rekv_err_clear(&err);
    ck_assert_int_eq(be->iface->stream_sync(s, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "NULL"), "message: %s", err.msg);
    for (int i = 0; i < 64; i++)
        ck_assert_uint_eq(dst[i], 0);
    rekv_event *ev = make_event(be);
    be->iface->event_record(ev, s);
    be->iface->event_sync(ev);
    be->iface->stats(be, &st);
    ck_assert_uint_eq(st.h2d_copies, 1);
    ck_assert_uint_eq(st.host_syncs, 4);
    be->iface->event_destroy(ev);
    gate_free(&g);
    be->iface->stream_destroy(s);
    rekv_backend_destroy(be);
}
END_TEST

/* streams_sync: the streams' work waited for as one blocking call (one host sync); the first
 * failure in the order given is returned with its message, and every stream's failures are
 * cleared, as stream_sync clears them. */
START_TEST(streams_sync_is_one_wait)
{
    rekv_backend *be = make_backend(0, 0);
    rekv_stream *s[3] = {make_stream(be, "h2d"), make_stream(be, "compute"),
                         make_stream(be, "d2h")};
    uint8_t src[64] = {1, 2, 3}, dst[64] = {0};
    rekv_copy_piece pc = {dst, src, sizeof(src)}, bad = {dst, NULL, 8};
    size_t one = 1;
    gate g;
    gate_init(&g);
    launch(be, s[1], "hold", (kern_arg){.g = &g});
    be->iface->copy_h2d(s[0], &pc, 1, REKV_XFER_KV);
    be->iface->stats_reset(be);
    gate_open(&g);
    rekv_err err = {0};
    ck_assert_int_eq(be->iface->streams_sync(s, 3, &err), 0);
    ck_assert_int_eq(dst[2], 3);
    rekv_backend_stats st;
    be->iface->stats(be, &st);
    ck_assert_uint_eq(st.host_syncs, 1);
    /* compute's failure and d2h's: compute's is reported, both cleared */
    be->iface->copy_h2d_listed(s[1], &bad, &one, 1, REKV_XFER_KV);
    be->iface->copy_h2d_listed(s[2], &pc, &one, 0, REKV_XFER_KV);
    ck_assert_int_eq(be->iface->streams_sync(s, 3, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "compute") && strstr(err.msg, "NULL"), "message: %s", err.msg);
    rekv_err_clear(&err);
    ck_assert_int_eq(be->iface->streams_sync(s, 3, &err), 0);
    be->iface->stats(be, &st);
    ck_assert_uint_eq(st.host_syncs, 3);
    gate_free(&g);
    for (int i = 0; i < 3; i++)
        be->iface->stream_destroy(s[i]);
    rekv_backend_destroy(be);
}
END_TEST

/* Applies runs row by row, as a DMA engine would. */
static void apply_runs(const rekv_copy_run *r, size_t n)
{
    for (size_t i = 0; i < n; i++)
        for (size_t y = 0; y < r[i].height; y++)
            memcpy((char *)r[i].dst + y * r[i].dpitch, (const char *)r[i].src + y * r[i].spitch,
                   r[i].width);
}

/* rekv_copy_coalesce: the shapes the pipeline makes become one run each (adjacent whole blocks,
 * a part of a block's heads, a new row's heads), and over random lists of such shapes, split and
 * mixed with odd pieces, the runs copy exactly what the pieces copy. */
START_TEST(copy_coalesce)
{
    enum { N = 1 << 16 };
    static char src[N], dst[N], want[N];
    for (size_t i = 0; i < N; i++)
        src[i] = (char)rnd();
    rekv_copy_piece p[256];
    rekv_copy_run r[256];
    /* three adjacent blocks: one row */
    for (int i = 0; i < 3; i++)
        p[i] = (rekv_copy_piece){dst + 100 + i * 512, src + 7 + i * 512, 512};
    ck_assert_uint_eq(rekv_copy_coalesce(p, 3, r), 1);
    ck_assert(r[0].width == 1536 && r[0].height == 1 && r[0].dst == dst + 100);
    ck_assert(r[0].first == 0 && r[0].count == 3);
    /* 2 x 4 heads, rows 5..9 of 16 (head stride 16 * 32 bytes on both sides), an empty piece
     * between: one strided run */
    int np = 0;
    for (int h = 0; h < 8; h++) {
        p[np++] = (rekv_copy_piece){dst + h * 512 + 5 * 32, src + 4096 + h * 512 + 5 * 32, 4 * 32};
        if (h == 3)
            p[np++] = (rekv_copy_piece){dst, src, 0};
    }
    ck_assert_uint_eq(rekv_copy_coalesce(p, (size_t)np, r), 1);
    ck_assert(r[0].height == 8 && r[0].width == 128 && r[0].dpitch == 512 && r[0].spitch == 512);
    /* a new row's 4 heads: contiguous source, strided destination */
    for (int h = 0; h < 4; h++)
        p[h] = (rekv_copy_piece){dst + 8192 + h * 512, src + 64 * h, 64};
    ck_assert_uint_eq(rekv_copy_coalesce(p, 4, r), 1);
    ck_assert(r[0].height == 4 && r[0].dpitch == 512 && r[0].spitch == 64);
    /* overlapping rows (stride below the width) and a changed stride start new runs (greedy:
     * [0], [1 2], [3 4]) */
    p[0] = (rekv_copy_piece){dst, src, 100};
    p[1] = (rekv_copy_piece){dst + 50, src + 200, 100};
    p[2] = (rekv_copy_piece){dst + 1000, src + 1000, 100};
    p[3] = (rekv_copy_piece){dst + 2000, src + 2000, 100};
    p[4] = (rekv_copy_piece){dst + 3500, src + 3000, 100};
    ck_assert_uint_eq(rekv_copy_coalesce(p, 5, r), 3);
    ck_assert(r[1].first == 1 && r[1].count == 2 && r[2].first == 3 && r[2].count == 2);
    for (int round = 0; round < 300; round++) {
        /* disjoint destinations: shapes placed one after another in dst */
        size_t at = 0;
        np = 0;
        while (np < 200) {
            size_t w = 1 + rnd() % 200, rows = 1 + rnd() % 8;
            size_t dp = w + rnd() % 3 * (rnd() % 64), sp = w + rnd() % 64;
            if (rnd() % 4 == 0) /* contiguous, split anywhere */
                dp = sp = w;
            if (at + rows * dp + w >= N || (rows - 1) * sp + w >= N)
                break;
            size_t s0 = rnd() % (N - (rows - 1) * sp - w);
            for (size_t y = 0; y < rows && np < 200; y++)
                p[np++] = (rekv_copy_piece){dst + at + y * dp, src + s0 + y * sp,
                                            rnd() % 16 == 0 ? 0 : w};
            at += rows * dp + rnd() % 2 * (rnd() % 100);
        }
        memset(dst, 0, N);
        for (int i = 0; i < np; i++)
            if (p[i].bytes)
                memcpy(p[i].dst, p[i].src, p[i].bytes);
        memcpy(want, dst, N);
        memset(dst, 0, N);
        size_t nr = rekv_copy_coalesce(p, (size_t)np, r);
        ck_assert_uint_le(nr, (size_t)np);
        apply_runs(r, nr);
        ck_assert_msg(memcmp(dst, want, N) == 0, "round %d: %zu runs copy otherwise than %d pieces",
                      round, nr, np);
        /* each run covers the pieces after the last run's (but empty ones), and copies what
         * they do */
        for (size_t i = 0, next = 0; i < nr; i++) {
            ck_assert_uint_ge(r[i].first, next);
            for (; next < r[i].first; next++)
                ck_assert_uint_eq(p[next].bytes, 0);
            next = r[i].first + r[i].count;
            memset(dst, 0, N);
            memset(want, 0, N);
            for (size_t j = r[i].first; j < next; j++)
                memcpy(want + ((char *)p[j].dst - dst), p[j].src, p[j].bytes);
            apply_runs(&r[i], 1);
            ck_assert_msg(memcmp(dst, want, N) == 0, "round %d run %zu", round, i);
        }
    }
}
END_TEST

/* The link emulation options parse by one rule in every program: numbers 0..1e6, sizes with a
 * suffix, and an error that names the option. */
START_TEST(link_options_parse)
{
    rekv_link_config l = REKV_LINK_NONE;
    rekv_err err = {0};
    ck_assert_double_eq(l.gbps, 0);
    ck_assert_double_eq(l.latency_us, 10);
    ck_assert_int_eq(rekv_link_emulates(&l), 0);
    ck_assert_int_eq(rekv_link_parse(&l, "link-gbps", "2.5", &err), 0);
    ck_assert_int_eq(rekv_link_parse(&l, "link-latency-us", "0", &err), 0);
    ck_assert_int_eq(rekv_link_parse(&l, "device-memory", "64M", &err), 0);
    ck_assert_double_eq(l.gbps, 2.5);
    ck_assert_double_eq(l.latency_us, 0);
    ck_assert_uint_eq(l.device_bytes, 64ull << 20);
    ck_assert_int_eq(rekv_link_emulates(&l), 1);
    const char *bad[][2] = {{"link-gbps", "-1"}, {"link-gbps", "2x"}, {"link-gbps", ""},
                            {"link-latency-us", "nan"}, {"link-gbps", "1e7"},
                            {"device-memory", "lots"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        rekv_link_config b = l;
        err = (rekv_err){0};
        ck_assert_int_eq(rekv_link_parse(&b, bad[i][0], bad[i][1], &err), -EINVAL);
        ck_assert_msg(strncmp(err.msg + 2, bad[i][0], strlen(bad[i][0])) == 0, "%s", err.msg);
        ck_assert_mem_eq(&b, &l, sizeof(l)); /* a bad value changes nothing */
    }
    err = (rekv_err){0};
    ck_assert_int_eq(rekv_link_parse(&l, "push-link-gbps", "1", &err), -ENOENT);
}
END_TEST

static Suite *backend_suite(void)
{
    Suite *s = suite_create("backend");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, copies_land_in_order_with_exact_counters);
    tcase_add_test(tc, busy_only_while_timing);
    tcase_add_test(tc, graph_capture_and_launch);
    tcase_add_test(tc, streams_run_in_order_concurrently);
    tcase_add_test(tc, stream_destroy_waits_for_its_work);
    tcase_add_test(tc, event_orders_work_across_streams);
    tcase_add_test(tc, event_rerecord_semantics);
    tcase_add_test(tc, event_sync_and_never_recorded);
    tcase_add_test(tc, event_destroyed_while_awaited);
    tcase_add_test(tc, link_emulation_timing);
    tcase_add_test(tc, link_is_a_dma_engine);
    tcase_add_test(tc, copy_overlaps_kernel);
    tcase_add_test(tc, trace_is_chrome_json);
    tcase_add_test(tc, bad_copy_is_reported_by_sync);
    tcase_add_test(tc, listed_copy_reads_its_list_when_it_runs);
    tcase_add_test(tc, streams_sync_is_one_wait);
    tcase_add_test(tc, device_memory_emulation);
    tcase_add_test(tc, copy_coalesce);
    tcase_add_test(tc, link_options_parse);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(backend_suite());
}
