/* test_ipc.c — sharing between processes on the cpu backend, the primitives of the push path: a
 * device buffer this process exports is written by another process, and the completion reaches
 * this process's stream as a shared event it waits on, or as a flag in shared memory it waits on
 * while the caller goes on; a buffer and event the other process exports are imported here;
 * garbage, wrong-kind and stale handles are refused with a message; a process that dies holding
 * an import leaves nothing behind; waits show in the trace and are not compute time.
 *
 * The other process is this program run again as the peer (ipc_peer.h), which test_cuda runs on
 * the cuda backend: `test_ipc --peer BACKEND SOCKET_FD FLAG_FD`. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/clock.h"
#include "gpuworker/device/backend.h"
#include "tests/ipc_peer.h"
#include "tests/testutil.h"

#define MiB (1024u * 1024u)

/* ------------------------------------------------------------------ the peer */

static void *host_buf(rekv_backend *be, size_t bytes)
{
    return be->iface->host_alloc ? be->iface->host_alloc(be, bytes) : malloc(bytes);
}

static void host_buf_free(rekv_backend *be, void *p)
{
    if (be->iface->host_free)
        be->iface->host_free(be, p);
    else
        free(p);
}

static void delay_fn(void *arg)
{
    usleep(*(const uint32_t *)arg * 1000u);
}

static void peer_reply(int sock, peer_msg *m, int rc, const rekv_err *err)
{
    m->rc = rc;
    snprintf(m->msg, sizeof(m->msg), "%s", rc < 0 ? err->msg : "");
    if (send(sock, m, sizeof(*m), MSG_NOSIGNAL) != (ssize_t)sizeof(*m))
        _exit(3); /* the test went away */
}

/* Copies the pattern into dev (bytes) on s; the source is returned for the caller to free after
 * the stream has run the copy. */
static uint8_t *peer_fill(rekv_backend *be, rekv_stream *s, void *dev, size_t bytes, uint32_t seed)
{
    uint8_t *src = host_buf(be, bytes);
    if (src == NULL)
        return NULL;
    for (size_t i = 0; i < bytes; i++)
        src[i] = peer_pattern(seed, i);
    rekv_copy_piece pc = {dev, src, bytes};
    be->iface->copy_h2d(s, &pc, 1, REKV_XFER_KV);
    return src;
}

/* One step of the peer; returns -1 when it should exit. */
static int peer_step(rekv_backend *be, rekv_stream *s, uint32_t *flag, int sock, peer_msg *m,
                     void **exp_buf, rekv_event **exp_ev)
{
    const rekv_backend_iface *bi = be->iface;
    rekv_err err = {0};
    void *dev = NULL;
    size_t bytes = 0;
    rekv_event *ev = NULL;
    uint8_t *src = NULL;
    int rc = 0;

    switch (m->op) {
    case PEER_PUSH_EVENT:
        rc = bi->dev_import(be, &m->buf, &dev, &bytes, &err);
        if (rc == 0)
            rc = bi->event_import(be, &m->ev, &ev, &err);
        if (rc == 0 && bytes != m->bytes)
            rc = rekv_errf(&err, -EIO, "imported %zu bytes, the test sent %llu", bytes,
                           (unsigned long long)m->bytes);
        if (rc == 0) {
            if (m->flag_value > 0) /* the test's go: its own enqueueing is over */
                bi->stream_wait_flag(s, flag, m->flag_value);
            if (m->delay_ms > 0)
                bi->launch_host(s, "delay", delay_fn, &m->delay_ms, sizeof(m->delay_ms));
            src = peer_fill(be, s, dev, bytes, m->seed);
            if (src == NULL)
                rc = rekv_errf(&err, -ENOMEM, "out of memory");
            else
                bi->event_record(ev, s);
        }
        peer_reply(sock, m, rc, &err); /* the work still runs: the test's stream waits for it */
        if (rc == 0)
            rc = bi->stream_sync(s, &err);
        peer_reply(sock, m, rc, &err);
        break;
    case PEER_PUSH_FLAG:
        rc = bi->dev_import(be, &m->buf, &dev, &bytes, &err);
        if (rc == 0) {
            src = peer_fill(be, s, dev, bytes, m->seed);
            if (src == NULL)
                rc = rekv_errf(&err, -ENOMEM, "out of memory");
            else
                bi->stream_write_flag(s, flag, m->flag_value);
            int rc2 = bi->stream_sync(s, &err);
            rc = rc ? rc : rc2;
        }
        peer_reply(sock, m, rc, &err);
        break;
    case PEER_HOLD:
        rc = bi->dev_import(be, &m->buf, &dev, &bytes, &err);
        if (rc == 0)
            rc = bi->event_import(be, &m->ev, &ev, &err);
        peer_reply(sock, m, rc, &err);
        for (;;)
            pause(); /* until killed */
    case PEER_EXPORT:
        if (*exp_buf != NULL)
            return -1; /* one export per peer */
        *exp_buf = bi->dev_alloc_shared(be, m->bytes, &m->buf, &err);
        rc = *exp_buf == NULL ? err.code : 0;
        if (rc == 0) {
            src = peer_fill(be, s, *exp_buf, m->bytes, m->seed);
            rc = bi->stream_sync(s, &err);
        }
        if (rc == 0)
            rc = bi->event_create_shared(be, exp_ev, &err);
        if (rc == 0)
            rc = bi->event_export(*exp_ev, &m->ev, &err);
        peer_reply(sock, m, rc, &err);
        break;
    default:
        return -1;
    }
    if (ev != NULL)
        bi->event_destroy(ev);
    if (dev != NULL)
        bi->dev_unimport(be, dev);
    if (src != NULL)
        host_buf_free(be, src);
    return 0;
}

static int peer_main(const char *backend, int sock, int flag_fd)
{
    rekv_backend *be = NULL;
    rekv_stream *s = NULL;
    rekv_err err = {0};
    void *exp_buf = NULL;
    rekv_event *exp_ev = NULL;
    peer_msg m;
    int rc = 2;

    uint32_t *flag = mmap(NULL, PEER_FLAG_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, flag_fd, 0);
    if (flag == MAP_FAILED) {
        fprintf(stderr, "peer: cannot map the flag: %s\n", strerror(errno));
        return 2;
    }
    if (rekv_backend_create(backend, NULL, &be, NULL, 0, &err) < 0 ||
        be->iface->stream_create(be, "peer", &s, &err) < 0 ||
        (be->iface->host_register &&
         be->iface->host_register(be, flag, PEER_FLAG_BYTES, &err) < 0)) {
        fprintf(stderr, "peer: %s\n", err.msg);
        goto out;
    }
    while (recv(sock, &m, sizeof(m), 0) == (ssize_t)sizeof(m) && m.op != PEER_QUIT)
        if (peer_step(be, s, flag, sock, &m, &exp_buf, &exp_ev) < 0)
            goto out;
    rc = 0;
out:
    if (be != NULL) {
        if (exp_ev != NULL)
            be->iface->event_destroy(exp_ev);
        if (exp_buf != NULL)
            be->iface->dev_free(be, exp_buf);
        if (s != NULL)
            be->iface->stream_destroy(s);
        if (be->iface->host_unregister)
            be->iface->host_unregister(be, flag);
        rekv_backend_destroy(be);
    }
    munmap(flag, PEER_FLAG_BYTES);
    return rc;
}

/* ------------------------------------------------------------------ helpers */

static rekv_backend *g_be;
static rekv_stream *g_s;
static const rekv_backend_iface *g_bi;

static void open_backend(void)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_backend_cpu_create(NULL, &g_be, &err) == 0, "%s", err.msg);
    ck_assert(rekv_backend_has_ipc(g_be) && rekv_backend_has_flags(g_be));
    g_bi = g_be->iface;
    ck_assert_msg(g_bi->stream_create(g_be, "consumer", &g_s, &err) == 0, "%s", err.msg);
}

static void close_backend(void)
{
    g_bi->stream_destroy(g_s);
    rekv_backend_destroy(g_be);
    g_be = NULL;
}

static void sync_ok(rekv_stream *s)
{
    rekv_err err = {0};
    ck_assert_msg(g_bi->stream_sync(s, &err) == 0, "%s", err.msg);
}

static void expect_pattern(const uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != peer_pattern(seed, i))
            ck_abort_msg("byte %zu of %zu: %u, want %u", i, n, p[i], peer_pattern(seed, i));
}

/* The spans of a trace with this label prefix: how many, and the longest (µs). */
static int trace_spans(const char *prefix, double *longest_us)
{
    char *dir = tu_tmpdir(), path[4200];
    rekv_err err = {0};
    snprintf(path, sizeof(path), "%s/trace.json", dir);
    ck_assert_msg(g_bi->trace_write(g_be, path, &err) == 0, "%s", err.msg);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    ck_assert_msg(root != NULL, "trace is not JSON: %s", je.text);
    int n = 0;
    size_t i;
    json_t *e;
    *longest_us = 0;
    json_array_foreach(json_object_get(root, "traceEvents"), i, e)
    {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        const char *nm = json_string_value(json_object_get(e, "name"));
        if (ph && strcmp(ph, "X") == 0 && nm && strncmp(nm, prefix, strlen(prefix)) == 0) {
            double d = json_number_value(json_object_get(e, "dur"));
            n++;
            *longest_us = d > *longest_us ? d : *longest_us;
        }
    }
    json_decref(root);
    tu_rmrf(dir);
    free(dir);
    return n;
}

/* Lines of /proc/self/maps naming a rekv memfd (a leak shows here). */
static int rekv_mappings(void)
{
    char *maps = tu_read_file("/proc/self/maps", NULL);
    ck_assert(maps != NULL);
    int n = 0;
    for (const char *p = maps; (p = strstr(p, "/memfd:rekv-")) != NULL; p++)
        n++;
    free(maps);
    return n;
}

/* Open file descriptors of this process. */
static int open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    ck_assert(d != NULL);
    int n = 0;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

/* The names in /dev/shm, sorted and joined (empty when it does not exist). */
static char *dev_shm_listing(void)
{
    char *out = NULL;
    ck_assert(tu_run("ls -A /dev/shm 2>/dev/null | sort", &out) >= 0);
    return out;
}

/* ------------------------------------------------------------------ the push path */

/* The peer writes into our exported buffer and records our exported event after 150 ms of other
 * work; our stream waits on the event (the caller is not blocked: the peer's work waits for our go,
 * given once our enqueueing returned, so an enqueue that waited for the record would never return
 * and Check's timeout would fail the case) and copies the buffer back. */
START_TEST(push_with_event)
{
    const size_t n = 3 * MiB + 5;
    uint32_t *flag;
    int flag_fd = peer_flag_create(&flag);
    peer p;
    peer_start(&p, "/proc/self/exe", "cpu", flag_fd);
    open_backend();
    rekv_err err = {0};
    peer_msg m = {.op = PEER_PUSH_EVENT, .seed = 7, .delay_ms = 150, .flag_value = 1, .bytes = n};
    void *buf = g_bi->dev_alloc_shared(g_be, n, &m.buf, &err);
    ck_assert_msg(buf != NULL, "%s", err.msg);
    rekv_event *ev;
    ck_assert_msg(g_bi->event_create_shared(g_be, &ev, &err) == 0, "%s", err.msg);
    ck_assert_msg(g_bi->event_export(ev, &m.ev, &err) == 0, "%s", err.msg);
    uint8_t *dst = calloc(1, n);
    ck_assert(dst != NULL);

    g_bi->stats_reset(g_be);
    g_bi->trace_start(g_be);
    peer_call(&p, &m); /* the peer has enqueued its copy and the record, not run them */
    uint64_t t0 = rekv_now_ns();
    g_bi->stream_wait_event(g_s, ev);
    rekv_copy_piece down = {dst, buf, n};
    g_bi->copy_d2h(g_s, &down, 1, REKV_XFER_KV);
    __atomic_store_n(flag, 1, __ATOMIC_RELEASE); /* the peer's go */
    sync_ok(g_s);
    uint64_t t2 = rekv_now_ns();
    expect_pattern(dst, n, 7);
    ck_assert_msg(t2 - t0 > 50000000ull, "the stream did not wait for the peer (%.1f ms)",
                  (double)(t2 - t0) * 1e-6);
    peer_recv(&p, &m); /* the peer's own sync */
    ck_assert_msg(m.rc == 0, "peer: %s", m.msg);
    g_bi->event_sync(ev); /* complete: returns */

    /* the wait is traced and is not compute; the copy is counted */
    rekv_backend_stats st;
    g_bi->stats(g_be, &st);
    ck_assert(st.compute_busy_s == 0.0);
    ck_assert_uint_eq(st.d2h_bytes[REKV_XFER_KV], n);
    ck_assert_uint_eq(st.h2d_copies, 0); /* the peer's copy is the peer's */
    double longest;
    ck_assert_int_eq(trace_spans("wait ipc event", &longest), 1);
    ck_assert_msg(longest > 50000, "wait span %.0f us", longest);

    /* again, with the event re-recorded: the wait is for the new record */
    m = (peer_msg){
        .op = PEER_PUSH_EVENT, .seed = 8, .delay_ms = 100, .bytes = n, .buf = m.buf, .ev = m.ev};
    peer_call(&p, &m);
    g_bi->stream_wait_event(g_s, ev);
    g_bi->copy_d2h(g_s, &down, 1, REKV_XFER_KV);
    sync_ok(g_s);
    expect_pattern(dst, n, 8);
    peer_recv(&p, &m);
    ck_assert_msg(m.rc == 0, "peer: %s", m.msg);

    peer_stop(&p);
    g_bi->event_destroy(ev);
    g_bi->dev_free(g_be, buf);
    free(dst);
    close_backend();
    munmap(flag, PEER_FLAG_BYTES);
    close(flag_fd);
    ck_assert_int_eq(rekv_mappings(), 0);
}
END_TEST

/* The recording process dies before its recorded work finishes: our stream, waiting on the
 * event, gives up with a clear error instead of waiting for ever (a dead worker must not hang the
 * store, nor a dead store the worker). */
START_TEST(dead_recorder_fails_the_wait)
{
    const size_t n = 1 * MiB;
    uint32_t *flag;
    int flag_fd = peer_flag_create(&flag);
    peer p;
    peer_start(&p, "/proc/self/exe", "cpu", flag_fd);
    open_backend();
    rekv_err err = {0};
    peer_msg m = {.op = PEER_PUSH_EVENT, .seed = 9, .delay_ms = 60000, .bytes = n};
    void *buf = g_bi->dev_alloc_shared(g_be, n, &m.buf, &err);
    ck_assert_msg(buf != NULL, "%s", err.msg);
    rekv_event *ev;
    ck_assert_msg(g_bi->event_create_shared(g_be, &ev, &err) == 0, "%s", err.msg);
    ck_assert_msg(g_bi->event_export(ev, &m.ev, &err) == 0, "%s", err.msg);
    peer_call(&p, &m); /* recorded, behind a minute of work */
    g_bi->stream_wait_event(g_s, ev);
    uint64_t t0 = rekv_now_ns();
    peer_kill(&p);
    rekv_err se = {0};
    ck_assert_int_eq(g_bi->stream_sync(g_s, &se), -EPIPE);
    double ms = (double)(rekv_now_ns() - t0) * 1e-6;
    ck_assert_msg(strstr(se.msg, "died") != NULL, "%s", se.msg);
    /* noticed: the event would be recorded only after a minute, and never by a dead peer (a wait
     * that did not notice would outlast Check's timeout) */
    printf("   the wait noticed the death in %.0f ms\n", ms);
    sync_ok(g_s); /* the stream goes on */
    g_bi->event_destroy(ev);
    g_bi->dev_free(g_be, buf);
    close_backend();
    munmap(flag, PEER_FLAG_BYTES);
    close(flag_fd);
}
END_TEST

/* Our stream waits on a flag before the peer has even started: the caller goes on at once, the
 * stream holds until the peer's copy is in and its stream writes the flag. */
START_TEST(push_with_flag)
{
    const size_t n = 2 * MiB;
    uint32_t *flag;
    int flag_fd = peer_flag_create(&flag);
    peer p;
    peer_start(&p, "/proc/self/exe", "cpu", flag_fd);
    open_backend();
    rekv_err err = {0};
    peer_msg m = {.op = PEER_PUSH_FLAG, .seed = 11, .flag_value = 1, .bytes = n};
    void *buf = g_bi->dev_alloc_shared(g_be, n, &m.buf, &err);
    ck_assert_msg(buf != NULL, "%s", err.msg);
    uint8_t *dst = malloc(n);
    ck_assert(dst != NULL);
    memset(dst, 0xa5, n);

    g_bi->stats_reset(g_be);
    g_bi->trace_start(g_be);
    g_bi->stream_wait_flag(g_s, flag, 1);
    rekv_copy_piece down = {dst, buf, n};
    g_bi->copy_d2h(g_s, &down, 1, REKV_XFER_KV);
    /* enqueued without waiting: the flag is set only after this, by the peer we start below */
    usleep(60000);
    ck_assert_msg(dst[0] == 0xa5 && dst[n - 1] == 0xa5, "the copy ran before the flag was set");
    peer_call(&p, &m);
    sync_ok(g_s);
    expect_pattern(dst, n, 11);
    ck_assert_uint_eq(__atomic_load_n(flag, __ATOMIC_ACQUIRE), 1);

    rekv_backend_stats st;
    g_bi->stats(g_be, &st);
    ck_assert(st.compute_busy_s == 0.0);
    ck_assert_uint_eq(st.d2h_bytes[REKV_XFER_KV], n);
    ck_assert_uint_eq(st.d2h_copies, 1);
    double longest;
    ck_assert_int_eq(trace_spans("wait flag >= 1", &longest), 1);
    ck_assert_msg(longest > 50000, "wait span %.0f us", longest);

    peer_stop(&p);
    g_bi->dev_free(g_be, buf);
    free(dst);
    close_backend();
    munmap(flag, PEER_FLAG_BYTES);
    close(flag_fd);
}
END_TEST

/* The other direction: the peer exports a buffer holding a pattern and an event; we import and
 * read them; once the peer has exited its handles are refused. */
START_TEST(import_from_peer)
{
    const size_t n = 100000;
    uint32_t *flag;
    int flag_fd = peer_flag_create(&flag);
    peer p;
    peer_start(&p, "/proc/self/exe", "cpu", flag_fd);
    open_backend();
    rekv_err err = {0};
    peer_msg m = {.op = PEER_EXPORT, .seed = 3, .bytes = n};
    peer_call(&p, &m);
    void *dev = NULL;
    size_t got = 0;
    ck_assert_msg(g_bi->dev_import(g_be, &m.buf, &dev, &got, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(got, n);
    uint8_t *dst = malloc(n);
    rekv_copy_piece down = {dst, dev, n};
    g_bi->copy_d2h(g_s, &down, 1, REKV_XFER_OTHER);
    sync_ok(g_s);
    expect_pattern(dst, n, 3);
    rekv_event *ev;
    ck_assert_msg(g_bi->event_import(g_be, &m.ev, &ev, &err) == 0, "%s", err.msg);
    g_bi->event_record(ev, g_s); /* an imported event is recorded like any other */
    g_bi->stream_wait_event(g_s, ev);
    sync_ok(g_s);
    g_bi->event_sync(ev);
    rekv_ipc_handle again;
    ck_assert_int_eq(g_bi->event_export(ev, &again, &err), 0); /* the handle it came from */
    ck_assert(memcmp(&again, &m.ev, sizeof(again)) == 0);
    g_bi->event_destroy(ev);
    g_bi->dev_unimport(g_be, dev);

    /* the peer exits: its handles name nothing any more */
    peer_stop(&p);
    rekv_err e1 = {0}, e2 = {0};
    ck_assert_int_eq(g_bi->dev_import(g_be, &m.buf, &dev, &got, &e1), -ESRCH);
    ck_assert_msg(strstr(e1.msg, "has exited") != NULL, "%s", e1.msg);
    ck_assert_ptr_null(dev);
    ck_assert_int_eq(g_bi->event_import(g_be, &m.ev, &ev, &e2), -ESRCH);
    ck_assert_ptr_null(ev);

    free(dst);
    close_backend();
    munmap(flag, PEER_FLAG_BYTES);
    close(flag_fd);
}
END_TEST

/* ------------------------------------------------------------------ within one process */

static void gate_fn(void *arg)
{
    usleep(*(const int *)arg * 1000);
}

static void mark_fn(void *arg)
{
    __atomic_store_n((int *)arg, 1, __ATOMIC_RELEASE);
}

/* What a task on the waiting stream saw of the producer's mark. */
typedef struct order_probe {
    const int *marked;
    int seen;
} order_probe;

static void probe_fn(void *arg)
{
    order_probe *p = arg;
    p->seen = __atomic_load_n(p->marked, __ATOMIC_ACQUIRE);
}

/* A shared event and its import in one process, on two streams: the same ordering as a local
 * event. A plain event cannot be exported. */
START_TEST(shared_event_between_streams)
{
    open_backend();
    rekv_err err = {0};
    rekv_stream *s2;
    ck_assert_msg(g_bi->stream_create(g_be, "producer", &s2, &err) == 0, "%s", err.msg);
    rekv_event *ev, *imp, *plain;
    rekv_ipc_handle h;
    ck_assert_msg(g_bi->event_create_shared(g_be, &ev, &err) == 0, "%s", err.msg);
    ck_assert_msg(g_bi->event_export(ev, &h, &err) == 0, "%s", err.msg);
    ck_assert_msg(g_bi->event_import(g_be, &h, &imp, &err) == 0, "%s", err.msg);

    /* never recorded: complete */
    g_bi->stream_wait_event(g_s, imp);
    g_bi->event_sync(imp);
    sync_ok(g_s);

    for (int round = 0; round < 4; round++) {
        int ms = 60, marked = 0;
        order_probe probe = {&marked, -1};
        g_bi->launch_host(s2, "gate", gate_fn, &ms, sizeof(ms));
        g_bi->launch_host(s2, "mark", mark_fn, &marked, 0);
        g_bi->event_record(round % 2 ? imp : ev, s2); /* either side records, or waits */
        g_bi->stream_wait_event(g_s, round % 2 ? ev : imp);
        g_bi->launch_host(g_s, "probe", probe_fn, &probe, 0);
        sync_ok(g_s);
        ck_assert_int_eq(probe.seen, 1);
        g_bi->event_sync(round < 2 ? ev : imp);
        sync_ok(s2);
    }

    ck_assert_msg(g_bi->event_create(g_be, &plain, &err) == 0, "%s", err.msg);
    rekv_err e1 = {0};
    ck_assert_int_eq(g_bi->event_export(plain, &h, &e1), -EINVAL);
    ck_assert_msg(strstr(e1.msg, "event_create_shared") != NULL, "%s", e1.msg);
    g_bi->event_destroy(plain);
    /* destroying the exporter's event while the import lives: the import still works */
    g_bi->event_destroy(ev);
    g_bi->event_record(imp, s2);
    g_bi->stream_wait_event(g_s, imp);
    sync_ok(g_s);
    g_bi->event_destroy(imp);
    g_bi->stream_destroy(s2);
    close_backend();
    ck_assert_int_eq(rekv_mappings(), 0);
}
END_TEST

/* Flags: a write on one stream releases a wait on another; a plain store (no wake) is seen too;
 * the comparison is cyclic as CUDA's; bad flags are reported by stream_sync. */
START_TEST(flags_within_a_process)
{
    open_backend();
    rekv_err err = {0};
    rekv_stream *s2;
    ck_assert_msg(g_bi->stream_create(g_be, "writer", &s2, &err) == 0, "%s", err.msg);
    uint32_t *flag = g_bi->host_alloc ? g_bi->host_alloc(g_be, 64) : aligned_alloc(64, 64);
    int seen = 0, ms = 50;

    *flag = 0;
    g_bi->stream_wait_flag(g_s, flag, 5);
    g_bi->launch_host(g_s, "after", mark_fn, &seen, 0);
    g_bi->launch_host(s2, "gate", gate_fn, &ms, sizeof(ms));
    g_bi->stream_write_flag(s2, flag, 4); /* not enough */
    usleep(100000);
    ck_assert_int_eq(__atomic_load_n(&seen, __ATOMIC_ACQUIRE), 0);
    g_bi->stream_write_flag(s2, flag, 5);
    sync_ok(g_s);
    ck_assert_int_eq(seen, 1);
    sync_ok(s2);

    /* a plain store from this thread, no futex wake: the wait polls */
    seen = 0;
    g_bi->stream_wait_flag(g_s, flag, 6);
    g_bi->launch_host(g_s, "after", mark_fn, &seen, 0);
    usleep(20000);
    ck_assert_int_eq(__atomic_load_n(&seen, __ATOMIC_ACQUIRE), 0);
    __atomic_store_n(flag, 7, __ATOMIC_RELEASE);
    sync_ok(g_s);
    ck_assert_int_eq(seen, 1);

    /* cyclic: 0xfffffff0 is "before" 5, and 5 is "after" 0xfffffff0 */
    *flag = 0xfffffff0u;
    seen = 0;
    g_bi->stream_wait_flag(g_s, flag, 0xffffffe0u); /* holds already */
    g_bi->stream_wait_flag(g_s, flag, 5);
    g_bi->launch_host(g_s, "after", mark_fn, &seen, 0);
    usleep(20000);
    ck_assert_int_eq(__atomic_load_n(&seen, __ATOMIC_ACQUIRE), 0);
    g_bi->stream_write_flag(s2, flag, 5);
    sync_ok(g_s);
    ck_assert_int_eq(seen, 1);
    g_bi->stream_wait_flag(g_s, flag, 0xfffffff0u); /* 5 is after it: holds */
    sync_ok(g_s);

    /* bad flags */
    rekv_err e1 = {0}, e2 = {0};
    g_bi->stream_wait_flag(g_s, NULL, 1);
    ck_assert_int_eq(g_bi->stream_sync(g_s, &e1), -EINVAL);
    ck_assert_msg(strstr(e1.msg, "NULL") != NULL, "%s", e1.msg);
    g_bi->stream_write_flag(g_s, (uint32_t *)((char *)flag + 2), 1);
    ck_assert_int_eq(g_bi->stream_sync(g_s, &e2), -EINVAL);
    ck_assert_msg(strstr(e2.msg, "aligned") != NULL, "%s", e2.msg);
    sync_ok(g_s);

    if (g_bi->host_free)
        g_bi->host_free(g_be, flag);
    else
        free(flag);
    g_bi->stream_destroy(s2);
    close_backend();
}
END_TEST

/* ------------------------------------------------------------------ bad handles */

static void expect_refused(int rc, int want, const rekv_err *err, const char *says)
{
    ck_assert_msg(rc == want, "rc %d, want %d (%s)", rc, want, err->msg);
    ck_assert_msg(strstr(err->msg, says) != NULL, "\"%s\" does not say \"%s\"", err->msg, says);
}

START_TEST(bad_handles_are_refused)
{
    open_backend();
    rekv_err err = {0};
    rekv_ipc_handle hb, he, bad;
    void *dev = (void *)1;
    size_t got;
    rekv_event *ev = NULL, *imp = (rekv_event *)1;
    void *buf = g_bi->dev_alloc_shared(g_be, 4096, &hb, &err);
    ck_assert_msg(buf != NULL, "%s", err.msg);
    ck_assert_msg(g_bi->event_create_shared(g_be, &ev, &err) == 0, "%s", err.msg);
    ck_assert_msg(g_bi->event_export(ev, &he, &err) == 0, "%s", err.msg);

    /* garbage */
    for (size_t i = 0; i < sizeof(bad); i++)
        ((uint8_t *)&bad)[i] = (uint8_t)(i * 37 + 1);
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &bad, &dev, &got, &err), -EINVAL, &err,
                   "not a rekv IPC handle");
    ck_assert_ptr_null(dev);
    rekv_err_clear(&err);
    expect_refused(g_bi->event_import(g_be, &bad, &imp, &err), -EINVAL, &err,
                   "not a rekv IPC handle");
    ck_assert_ptr_null(imp);
    /* wrong kind, both ways */
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &he, &dev, &got, &err), -EINVAL, &err,
                   "an event's, not a buffer's");
    rekv_err_clear(&err);
    expect_refused(g_bi->event_import(g_be, &hb, &imp, &err), -EINVAL, &err,
                   "a buffer's, not an event's");
    /* another backend's, another version */
    bad = hb;
    memcpy(bad.backend, "cuda", 5);
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &bad, &dev, &got, &err), -EINVAL, &err,
                   "the cuda backend's");
    bad = hb;
    bad.version = 9;
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &bad, &dev, &got, &err), -EINVAL, &err, "version 9");
    /* a live process's fd that is something else */
    int other = open("/dev/null", O_RDWR | O_CLOEXEC);
    ck_assert_int_ge(other, 0);
    bad = hb;
    memcpy(bad.payload + 4, &(int32_t){other}, 4);
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &bad, &dev, &got, &err), -ESTALE, &err, "stale handle");
    close(other);
    /* the wrong size */
    bad = hb;
    bad.bytes = 8192;
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &bad, &dev, &got, &err), -ESTALE, &err, "8192");
    /* a right handle imports (in the same process, on cpu) */
    ck_assert_msg(g_bi->dev_import(g_be, &hb, &dev, &got, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(got, 4096);
    g_bi->dev_unimport(g_be, dev);
    g_bi->dev_unimport(g_be, buf); /* not an import: ignored, the buffer still exported */
    ck_assert_msg(g_bi->dev_import(g_be, &hb, &dev, &got, &err) == 0, "%s", err.msg);
    g_bi->dev_unimport(g_be, dev);

    /* freed: the fd is closed; then reused by a new buffer: the name tells them apart */
    g_bi->dev_free(g_be, buf);
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &hb, &dev, &got, &err), -ENOENT, &err,
                   "no longer exports it");
    rekv_ipc_handle hb2;
    buf = g_bi->dev_alloc_shared(g_be, 4096, &hb2, &err);
    ck_assert_msg(buf != NULL, "%s", err.msg);
    ck_assert_msg(memcmp(hb2.payload, hb.payload, 8) == 0, "the fd number was not reused");
    rekv_err_clear(&err);
    expect_refused(g_bi->dev_import(g_be, &hb, &dev, &got, &err), -ESTALE, &err, "stale handle");
    /* a destroyed event */
    g_bi->event_destroy(ev);
    rekv_err_clear(&err);
    expect_refused(g_bi->event_import(g_be, &he, &imp, &err), -ENOENT, &err,
                   "no longer exports it");
    ck_assert_ptr_null(imp);

    g_bi->dev_free(g_be, buf);
    close_backend();
    ck_assert_int_eq(rekv_mappings(), 0);
}
END_TEST

/* ------------------------------------------------------------------ dying processes */

/* The peer imports our buffer and event and is killed holding them: /dev/shm is as before, our
 * buffer and event still work, and freeing them leaves no mapping or descriptor behind. */
START_TEST(dead_importer_leaves_nothing)
{
    char *shm_before = dev_shm_listing();
    int fds_before = open_fds();
    const size_t n = 1 * MiB;
    uint32_t *flag;
    int flag_fd = peer_flag_create(&flag);
    open_backend();
    rekv_err err = {0};
    for (int round = 0; round < 2; round++) {
        peer p;
        peer_start(&p, "/proc/self/exe", "cpu", flag_fd);
        peer_msg m = {.op = PEER_HOLD, .bytes = n};
        void *buf = g_bi->dev_alloc_shared(g_be, n, &m.buf, &err);
        ck_assert_msg(buf != NULL, "%s", err.msg);
        rekv_event *ev;
        ck_assert_msg(g_bi->event_create_shared(g_be, &ev, &err) == 0, "%s", err.msg);
        ck_assert_msg(g_bi->event_export(ev, &m.ev, &err) == 0, "%s", err.msg);
        peer_call(&p, &m);
        peer_kill(&p);

        uint8_t *src = malloc(n), *dst = calloc(1, n);
        for (size_t i = 0; i < n; i++)
            src[i] = peer_pattern(5, i);
        rekv_copy_piece up = {buf, src, n}, down = {dst, buf, n};
        g_bi->copy_h2d(g_s, &up, 1, REKV_XFER_OTHER);
        g_bi->event_record(ev, g_s);
        g_bi->stream_wait_event(g_s, ev);
        g_bi->copy_d2h(g_s, &down, 1, REKV_XFER_OTHER);
        sync_ok(g_s);
        g_bi->event_sync(ev);
        expect_pattern(dst, n, 5);
        free(src);
        free(dst);
        if (round == 0) { /* freed by us; on round 1 by destroying the backend */
            g_bi->event_destroy(ev);
            g_bi->dev_free(g_be, buf);
        } else {
            g_bi->event_destroy(ev);
        }
    }
    close_backend();
    munmap(flag, PEER_FLAG_BYTES);
    close(flag_fd);
    ck_assert_int_eq(rekv_mappings(), 0);
    ck_assert_int_eq(open_fds(), fds_before);
    char *shm_after = dev_shm_listing();
    ck_assert_str_eq(shm_after, shm_before);
    free(shm_before);
    free(shm_after);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("ipc");
    TCase *tc = tcase_create("cpu");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, push_with_event);
    tcase_add_test(tc, dead_recorder_fails_the_wait);
    tcase_add_test(tc, push_with_flag);
    tcase_add_test(tc, import_from_peer);
    tcase_add_test(tc, shared_event_between_streams);
    tcase_add_test(tc, flags_within_a_process);
    tcase_add_test(tc, bad_handles_are_refused);
    tcase_add_test(tc, dead_importer_leaves_nothing);
    suite_add_tcase(s, tc);
    return s;
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--peer") == 0)
        return peer_main(argv[2], atoi(argv[3]), atoi(argv[4]));
    return tu_run_suite(suite());
}
