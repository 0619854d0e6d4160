/* test_push_isolation.c — the kvstore's push path (--push-backend cpu, the real rekv-kvstore;
 * tests/kvd.h) keeps each connection's pushes on a stream of its own: a worker whose push waits
 * on its "buffer free" event does not hold up another worker's pushes. That matters on cuda,
 * where a worker that dies with that record pending leaves the wait blocked on the device for
 * good (backend.h): on one shared stream every other worker's pushes would queue behind it. Here
 * worker A's wait is held open (a host task on its stream, released by a semaphore only after
 * worker B's push has completed); were the streams shared, B's wait for its push would never end
 * and Check's timeout would fail the test. No timing assertion. */
#define _GNU_SOURCE
#include <check.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/device/backend.h"
#include "kvstore/kvstore.h"
#include "tests/kvd.h"
#include "tests/testutil.h"

/* One worker's connection: a sequence of one pinned block, filled with its pattern; a buffer and
 * two events exported for the store to push into and signal. */
typedef struct pusher {
    rekv_kvstore_client *c;
    uint64_t seq;
    rekv_kv_plan_block *pb;
    void *buf;
    rekv_ipc_handle hb, hw, hd; /* buffer, "buffer free" (wait), "pushed" (done) */
    rekv_event *ew, *ed;
} pusher;

static void pusher_open(pusher *p, kvd *d, rekv_backend *be, uint64_t seq)
{
    rekv_err err = {0};
    const rekv_backend_iface *bi = be->iface;
    memset(p, 0, sizeof(*p));
    p->c = kvd_client(d);
    p->seq = seq;
    ck_assert_msg(rekv_kvstore_seq_create(p->c, seq, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_kvstore_append(p->c, seq, 16, 0, 0, NULL, &err) == 0, "%s", err.msg);
    rekv_kv_range r = {seq, 0, 0, 16};
    size_t n = 0, cap = 0, abytes = 0;
    ck_assert_msg(rekv_kvstore_plan(p->c, &r, 1, 1, &p->pb, &n, &cap, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(n, 1);
    uint8_t *arena = rekv_kvstore_client_arena(p->c, &abytes);
    kvd_fill(arena + p->pb[0].offset, 4096, seq, 0, 0, 1);
    p->buf = bi->dev_alloc_shared(be, 4096, &p->hb, &err);
    ck_assert_msg(p->buf != NULL, "%s", err.msg);
    memset(p->buf, 0, 4096);
    ck_assert_int_eq(bi->event_create_shared(be, &p->ew, &err), 0);
    ck_assert_int_eq(bi->event_create_shared(be, &p->ed, &err), 0);
    ck_assert_int_eq(bi->event_export(p->ew, &p->hw, &err), 0);
    ck_assert_int_eq(bi->event_export(p->ed, &p->hd, &err), 0);
}

static void pusher_push(pusher *p)
{
    rekv_err err = {0};
    const void *bufs[] = {&p->hb};
    rekv_kv_push_piece pc = {p->pb[0].offset, 0, 4096, 0};
    ck_assert_msg(rekv_kvstore_push(p->c, bufs, 1, &p->hw, &p->hd, &pc, 1, NULL, 0, &err) == 0,
                  "%s", err.msg);
}

static void pusher_close(pusher *p, rekv_backend *be)
{
    rekv_err err = {0};
    const rekv_backend_iface *bi = be->iface;
    rekv_kv_range r = {p->seq, 0, 0, 16};
    ck_assert_int_eq(rekv_kvstore_release(p->c, NULL, 0, &err), 0);
    ck_assert_int_eq(rekv_kvstore_unpin(p->c, &r, 1, &err), 0);
    bi->event_destroy(p->ew);
    bi->event_destroy(p->ed);
    bi->dev_free(be, p->buf);
    free(p->pb);
    rekv_kvstore_client_close(p->c);
}

/* Holds a stream until the test posts (a semaphore, not a sleep). */
static void gate(void *arg)
{
    sem_wait(*(sem_t **)arg);
}

START_TEST(a_held_push_does_not_hold_another_connections)
{
    kvd d;
    kvd_start(&d, 64, "--push-backend cpu", 0);
    rekv_err err = {0};
    rekv_backend *be;
    ck_assert_int_eq(rekv_backend_cpu_create(NULL, &be, &err), 0);
    const rekv_backend_iface *bi = be->iface;
    rekv_stream *sa, *sb;
    ck_assert_int_eq(bi->stream_create(be, "worker-a", &sa, &err), 0);
    ck_assert_int_eq(bi->stream_create(be, "worker-b", &sb, &err), 0);
    pusher a, b;
    pusher_open(&a, &d, be, 5);
    pusher_open(&b, &d, be, 6);

    /* A's buffer is "free" only once the gate opens; its push waits in the store */
    sem_t held;
    ck_assert_int_eq(sem_init(&held, 0, 0), 0);
    sem_t *hp = &held;
    bi->launch_host(sa, "gate", gate, &hp, sizeof(hp));
    bi->event_record(a.ew, sa);
    pusher_push(&a);
    /* B's push (its wait event never recorded: free at once) completes meanwhile */
    pusher_push(&b);
    bi->stream_wait_event(sb, b.ed);
    ck_assert_msg(bi->stream_sync(sb, &err) == 0, "%s", err.msg);
    ck_assert(kvd_check(b.buf, 4096, 6, 0, 0, 1));
    static const uint8_t zero8[8];
    ck_assert_msg(memcmp(a.buf, zero8, 8) == 0, "A's push ran before its buffer was free");
    /* then A's */
    sem_post(&held);
    bi->stream_wait_event(sa, a.ed);
    ck_assert_msg(bi->stream_sync(sa, &err) == 0, "%s", err.msg);
    ck_assert(kvd_check(a.buf, 4096, 5, 0, 0, 1));
    sem_destroy(&held);

    pusher_close(&a, be);
    pusher_close(&b, be);
    bi->stream_destroy(sa);
    bi->stream_destroy(sb);
    rekv_backend_destroy(be);
    kvd_stop(&d);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("push_isolation");
    TCase *tc = tcase_create("push_isolation");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, a_held_push_does_not_hold_another_connections);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
