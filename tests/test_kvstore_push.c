/* test_kvstore_push.c — the kvstore's push (--push-backend cpu), end to end (the real
 * rekv-kvstore; tests/kvd.h): copies into a buffer this test exports land where asked and signal
 * the event; malformed pushes (pieces outside the arena or the buffer, garbage or short handles, a
 * freed buffer) get clear errors and the store keeps serving; a store without a push backend says
 * so; an emulated link makes a push take at least its time. */
#define _GNU_SOURCE
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>
#include "common/clock.h"
#include "common/crc32c.h"
#include "gpuworker/device/backend.h"
#include "kvstore/kv_internal.h"
#include "kvstore/kvstore.h"
#include "proto/kvstore.pb-c.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"
#include "tests/kvd.h"

/* ------------------------------------------------------------------ push */

static void expect_push_error(rekv_kvstore_client *c, const void *const *bufs, size_t nb,
                              const rekv_kv_push_piece *pc, size_t n, int want, const char *says)
{
    rekv_err err = {0};
    int rc = rekv_kvstore_push(c, bufs, nb, NULL, NULL, pc, n, NULL, 0, &err);
    ck_assert_msg(rc == want, "rc %d, want %d (%s)", rc, want, err.msg);
    ck_assert_msg(strstr(err.msg, says) != NULL, "\"%s\" does not say \"%s\"", err.msg, says);
}

/* Holds the test's stream until the test has looked (a semaphore, not a sleep). */
static void push_gate(void *arg)
{
    sem_wait(arg);
}

START_TEST(test_push)
{
    kvd d;
    kvd_start(&d, 64, "--push-backend cpu", 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, &err), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 3, 32, 0, 0, NULL, &err), 0);
    rekv_kv_range r = {3, 1, 0, 32};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0, abytes;
    ck_assert_int_eq(rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err), 0);
    ck_assert_uint_eq(n, 2);
    uint8_t *arena = rekv_kvstore_client_arena(c, &abytes);
    for (size_t i = 0; i < n; i++)
        kvd_fill(arena + pb[i].offset, 4096, 3, 1, i, 1);
    char name[16];
    ck_assert_int_eq(rekv_kvstore_push(c, NULL, 0, NULL, NULL, NULL, 0, name, sizeof(name), &err),
                     0);
    ck_assert_str_eq(name, "cpu");

    rekv_backend *be;
    ck_assert_int_eq(rekv_backend_cpu_create(NULL, &be, &err), 0);
    const rekv_backend_iface *bi = be->iface;
    rekv_stream *s;
    ck_assert_int_eq(bi->stream_create(be, "test", &s, &err), 0);
    rekv_ipc_handle hb, hw, hd;
    uint8_t *buf = bi->dev_alloc_shared(be, 10000, &hb, &err);
    ck_assert_msg(buf != NULL, "%s", err.msg);
    memset(buf, 0, 10000);
    rekv_event *ew, *ed;
    ck_assert_int_eq(bi->event_create_shared(be, &ew, &err), 0);
    ck_assert_int_eq(bi->event_create_shared(be, &ed, &err), 0);
    ck_assert_int_eq(bi->event_export(ew, &hw, &err), 0);
    ck_assert_int_eq(bi->event_export(ed, &hd, &err), 0);

    /* the store's copies wait for our event, land where asked, then record its event */
    const void *bufs[] = {&hb};
    rekv_kv_push_piece pc[2] = {{pb[1].offset, 100, 4096, 0}, {pb[0].offset + 2048, 5000, 2048, 0}};
    sem_t gate;
    ck_assert_int_eq(sem_init(&gate, 0, 0), 0);
    bi->launch_host(s, "gate", push_gate, &gate, 0);
    bi->event_record(ew, s);
    ck_assert_msg(rekv_kvstore_push(c, bufs, 1, &hw, &hd, pc, 2, NULL, 0, &err) == 0, "%s",
                  err.msg);
    static const uint8_t zero8[8];
    ck_assert_msg(memcmp(buf + 100, zero8, 8) == 0, "the store copied before our event");
    sem_post(&gate);
    bi->stream_wait_event(s, ed);
    ck_assert_int_eq(bi->stream_sync(s, &err), 0);
    sem_destroy(&gate);
    ck_assert(kvd_check(buf + 100, 4096, 3, 1, 1, 1));
    uint8_t *want = malloc(4096);
    kvd_fill(want, 4096, 3, 1, 0, 1);
    ck_assert(memcmp(buf + 5000, want + 2048, 2048) == 0);
    free(want);
    ck_assert(buf[99] == 0 && buf[7048] == 0);

    /* malformed pieces: nothing is enqueued, the reason is given */
    const rekv_kv_arena_header *h = rekv_kvstore_client_header(c);
    rekv_kv_push_piece bad = {abytes - 10, 0, 100, 0};
    expect_push_error(c, bufs, 1, &bad, 1, -EINVAL, "outside the arena");
    bad = (rekv_kv_push_piece){UINT64_MAX - 10, 0, 100, 0};
    expect_push_error(c, bufs, 1, &bad, 1, -EINVAL, "outside the arena");
    bad = (rekv_kv_push_piece){0, 0, 128, 0}; /* the header is not a block */
    expect_push_error(c, bufs, 1, &bad, 1, -EINVAL, "outside the arena");
    bad = (rekv_kv_push_piece){h->data_offset, 9000, 1001, 0};
    expect_push_error(c, bufs, 1, &bad, 1, -EINVAL, "outside buffer 0");
    bad = (rekv_kv_push_piece){h->data_offset, UINT64_MAX, 2, 0};
    expect_push_error(c, bufs, 1, &bad, 1, -EINVAL, "outside buffer 0");
    bad = (rekv_kv_push_piece){h->data_offset, 0, 16, 1};
    expect_push_error(c, bufs, 1, &bad, 1, -EINVAL, "names buffer 1");
    /* only from blocks this connection pins, one block a piece: not another sequence's block
     * (planned, not pinned), not across the end of a pinned one, not the pinned ones once unpinned
     */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 4, &err), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 4, 16, 0, 0, NULL, &err), 0);
    rekv_kv_range r4 = {4, 0, 0, 16};
    rekv_kv_plan_block *pb4 = NULL;
    size_t n4, cap4 = 0;
    ck_assert_int_eq(rekv_kvstore_plan(c, &r4, 1, 0, &pb4, &n4, &cap4, &err), 0);
    ck_assert_uint_eq(n4, 1);
    bad = (rekv_kv_push_piece){pb4[0].offset, 0, 64, 0};
    expect_push_error(c, bufs, 1, &bad, 1, -EPERM, "has pinned");
    bad = (rekv_kv_push_piece){pb[1].offset + h->slot_bytes - 32, 0, 64, 0};
    expect_push_error(c, bufs, 1, &bad, 1, -EPERM, "has pinned");
    ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, &err), 0);
    bad = (rekv_kv_push_piece){pb[1].offset, 100, 64, 0};
    expect_push_error(c, bufs, 1, &bad, 1, -EPERM, "has pinned");
    ck_assert_int_eq(rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err), 0);
    free(pb4);
    /* garbage handles: a buffer's, an event's, one of the wrong kind */
    uint8_t junk[REKV_KV_IPC_HANDLE_BYTES];
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (uint8_t)(i * 53 + 7);
    const void *jb[] = {junk};
    bad = (rekv_kv_push_piece){h->data_offset, 0, 16, 0};
    expect_push_error(c, jb, 1, &bad, 1, -EINVAL, "not a rekv IPC handle");
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_kvstore_push(c, bufs, 1, junk, NULL, &bad, 1, NULL, 0, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "wait event") != NULL, "%s", err.msg);
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_kvstore_push(c, bufs, 1, NULL, &hb, &bad, 1, NULL, 0, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "not an event's") != NULL, "%s", err.msg);
    /* a short handle (raw request) */
    Rekv__Kvstore__Push pm = REKV__KVSTORE__PUSH__INIT;
    ProtobufCBinaryData shortb = {5, junk};
    pm.n_buffers = 1;
    pm.buffers = &shortb;
    Rekv__Kvstore__Request rq = REKV__KVSTORE__REQUEST__INIT;
    rq.version = REKV_KVSTORE_PROTO_VERSION;
    rq.id = 77;
    rq.body_case = REKV__KVSTORE__REQUEST__BODY_PUSH;
    rq.push = &pm;
    uint8_t raw[256];
    size_t rl = rekv__kvstore__request__pack(&rq, raw);
    int32_t status;
    char msg[256];
    ck_assert_int_eq(rekv_kvstore_client_raw(c, raw, rl, &status, msg, sizeof(msg), NULL), 0);
    ck_assert_int_eq(status, -EINVAL);
    ck_assert_msg(strstr(msg, "handle of 5 bytes") != NULL, "%s", msg);

    /* still serving: the same push again works */
    memset(buf, 0, 10000);
    ck_assert_msg(rekv_kvstore_push(c, bufs, 1, NULL, &hd, pc, 2, NULL, 0, &err) == 0, "%s",
                  err.msg);
    bi->stream_wait_event(s, ed);
    ck_assert_int_eq(bi->stream_sync(s, &err), 0);
    ck_assert(kvd_check(buf + 100, 4096, 3, 1, 1, 1));

    /* released, then freed: the old handle is refused, not mapped */
    ck_assert_int_eq(rekv_kvstore_release(c, bufs, 1, &err), 0);
    bi->dev_free(be, buf);
    expect_push_error(c, bufs, 1, pc, 1, -ENOENT, "no longer exports it");
    ck_assert_int_eq(rekv_kvstore_release(c, NULL, 0, &err), 0);
    ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, &err), 0);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, &err), 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);

    bi->event_destroy(ew);
    bi->event_destroy(ed);
    bi->stream_destroy(s);
    rekv_backend_destroy(be);
    free(pb);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* A store without a push backend says so. */
START_TEST(test_push_needs_a_backend)
{
    kvd d;
    kvd_start(&d, 64, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_push(c, NULL, 0, NULL, NULL, NULL, 0, NULL, 0, &err), -ENOTSUP);
    ck_assert_msg(strstr(err.msg, "no push backend") != NULL, "%s", err.msg);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* --push-link-gbps: the cpu push backend's copies take at least what the emulated link needs
 * (a lower bound, so never flaky): two blocks at 0.01 Gbit/s, milliseconds where an
 * unthrottled push takes a fraction of one. */
START_TEST(test_push_link)
{
    kvd d;
    kvd_start(&d, 64, "--push-backend cpu --push-link-gbps 0.01 --push-link-latency-us 0", 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, &err), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 3, 32, 0, 0, NULL, &err), 0);
    rekv_kv_range r = {3, 0, 0, 32};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err), 0);
    ck_assert_uint_eq(n, 2);
    rekv_backend *be;
    ck_assert_int_eq(rekv_backend_cpu_create(NULL, &be, &err), 0);
    const rekv_backend_iface *bi = be->iface;
    rekv_stream *s;
    ck_assert_int_eq(bi->stream_create(be, "test", &s, &err), 0);
    rekv_ipc_handle hb, hd;
    const rekv_kv_arena_header *h = rekv_kvstore_client_header(c);
    size_t piece = h->kv_block_bytes < 32768 ? h->kv_block_bytes : 32768;
    uint8_t *buf = bi->dev_alloc_shared(be, 2 * piece, &hb, &err);
    ck_assert_msg(buf != NULL, "%s", err.msg);
    rekv_event *ed;
    ck_assert_int_eq(bi->event_create_shared(be, &ed, &err), 0);
    ck_assert_int_eq(bi->event_export(ed, &hd, &err), 0);
    const void *bufs[] = {&hb};
    rekv_kv_push_piece pc[2] = {{pb[0].offset, 0, piece, 0}, {pb[1].offset, piece, piece, 0}};
    uint64_t t0 = rekv_now_ns();
    ck_assert_msg(rekv_kvstore_push(c, bufs, 1, NULL, &hd, pc, 2, NULL, 0, &err) == 0, "%s",
                  err.msg);
    bi->stream_wait_event(s, ed);
    ck_assert_int_eq(bi->stream_sync(s, &err), 0);
    double took = (double)(rekv_now_ns() - t0) * 1e-9, link = 2.0 * (double)piece * 8 / 0.01e9;
    ck_assert_msg(took >= link,
                  "%zu bytes pushed in %.4f s, faster than the emulated link's %.4f s", 2 * piece,
                  took, link);
    bi->event_destroy(ed);
    bi->dev_free(be, buf);
    bi->stream_destroy(s);
    rekv_backend_destroy(be);
    free(pb);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstore_push");
    TCase *tc;
    tc = tcase_create("daemon");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_push);
    tcase_add_test(tc, test_push_needs_a_backend);
    tcase_add_test(tc, test_push_link);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
