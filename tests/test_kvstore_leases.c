/* test_kvstore_leases.c — the kvstore's pin leases and sequence owners, end to end (the real
 * rekv-kvstore; tests/kvd.h): a client killed with -9 while holding pins, one client used from two
 * threads (a pin held past the lease while the other thread renews), DropOwner, and an owner's
 * sequences dropped with its lease. No assertion is timed: "past the lease" is the store's own
 * expiry of a silent witness (wait_expiries), so load can only make these slower. */
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

/* ------------------------------------------------------------------ kill -9 a client */

/* Waits, asking through `by` (which keeps `by` itself alive), until the store has expired more
 * than `above` leases; returns the count then. No deadline of its own: Check's timeout is the
 * guard. A lease test measures "longer than the lease" by such an expiry — a silent witness's,
 * pinned after the pins under test — never by a sleep, so that load can only make it slower. */
static uint64_t wait_expiries(rekv_kvstore_client *by, uint64_t above)
{
    rekv_kv_stats st;
    for (;;) {
        ck_assert_int_eq(rekv_kvstore_stats(by, &st, NULL), 0);
        if (st.leases_expired > above)
            return st.leases_expired;
        usleep(10000);
    }
}

/* A client that pins range r and then says nothing: its lease's expiry is the witness that a
 * lease has passed since. */
static rekv_kvstore_client *witness_pin(kvd *d, rekv_kv_range r)
{
    rekv_kvstore_client *w = kvd_client(d);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(w, &r, 1, 1, &pb, &n, &cap, NULL), 0);
    free(pb);
    return w;
}

START_TEST(test_killed_client_loses_pins)
{
    kvd d;
    kvd_start(&d, 64, "--lease-ms 1000", 0);
    rekv_kvstore_client *c = kvd_client(&d);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 5, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 5, 64, 0, 0, NULL, NULL), 0);
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        rekv_kvstore_client *cc = NULL;
        if (rekv_kvstore_client_connect(d.endpoint, NULL, 5000, &cc, NULL) < 0)
            _exit(1);
        rekv_kv_range r = {5, 0, 0, 64};
        rekv_kv_plan_block *pb = NULL;
        size_t n, cap = 0;
        if (rekv_kvstore_plan(cc, &r, 1, 1, &pb, &n, &cap, NULL) < 0)
            _exit(1);
        ssize_t w = write(pfd[1], "P", 1);
        (void)w;
        for (;;) { /* keep renewing until killed */
            rekv_kvstore_renew(cc, NULL);
            usleep(20000);
        }
    }
    close(pfd[1]);
    char ch;
    ck_assert_int_eq(read(pfd[0], &ch, 1), 1);
    close(pfd[0]);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.pinned_blocks, 4);
    ck_assert_uint_eq(st.leases_expired, 0);
    /* a lease passes (the witness, pinned after the child, expires): the child's renewals keep
     * its pins */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 7, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 7, 16, 0, 0, NULL, NULL), 0);
    rekv_kvstore_client *w = witness_pin(&d, (rekv_kv_range){7, 0, 0, 16});
    ck_assert_uint_eq(wait_expiries(c, 0), 1);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.pinned_blocks, 4);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 5, &err), -EBUSY);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    for (;;) { /* the killed child's lease runs out (Check's timeout is the guard) */
        ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
        if (st.pinned_blocks == 0)
            break;
        usleep(20000);
    }
    ck_assert_uint_eq(st.leases_expired, 2);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 5, &err), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 6, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 6, 32, 0, 0, NULL, NULL), 0);
    rekv_kvstore_client_close(w);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* ------------------------------------------------------------------ two threads, one client */

typedef struct step_sim {
    rekv_kvstore_client *c;
    kvd *d;
    uint64_t expired;     /* leases expired before the step */
    int failures;         /* requests that failed */
    volatile int holding; /* set while the step holds its first pin past a lease */
    volatile int done;    /* set by the step thread when it is over */
} step_sim;

/* A gpuworker step: pins, computes past the lease (until a witness, pinned after it and silent,
 * has lost its lease; the step sends nothing on its client meanwhile), then pins and unpins many
 * times (so that its requests meet the other thread's renewals), and unpins what it pinned
 * first. */
static void *step_sim_thread(void *arg)
{
    step_sim *sim = arg;
    rekv_kv_range r = {3, 1, 0, 64};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    if (rekv_kvstore_plan(sim->c, &r, 1, 1, &pb, &n, &cap, NULL) != 0)
        sim->failures++;
    sim->holding = 1;
    rekv_kvstore_client *ask = kvd_client(sim->d);
    rekv_kvstore_client *w = witness_pin(sim->d, (rekv_kv_range){3, 0, 0, 16});
    wait_expiries(ask, sim->expired);
    sim->holding = 0;
    rekv_kv_range r0 = {3, 0, 0, 64};
    for (int i = 0; i < 300; i++) {
        if (rekv_kvstore_plan(sim->c, &r0, 1, 1, &pb, &n, &cap, NULL) != 0 || n != 4)
            sim->failures++;
        if (rekv_kvstore_unpin(sim->c, &r0, 1, NULL) != 0)
            sim->failures++;
    }
    if (rekv_kvstore_unpin(sim->c, &r, 1, NULL) != 0) /* -EINVAL if the lease had expired */
        sim->failures++;
    free(pb);
    rekv_kvstore_client_close(w);
    rekv_kvstore_client_close(ask);
    sim->done = 1;
    return NULL;
}

/* A worker's loop renews the lease with renew_nowait while its step thread holds pins on the same
 * client for longer than the lease; without the renewals the pins go (the control case). "Longer
 * than the lease" is counted, not timed: the store expires a silent witness's lease meanwhile
 * (wait_expiries), and only that one. */
START_TEST(test_renew_from_another_thread)
{
    kvd d;
    kvd_start(&d, 64, "--lease-ms 1000", 0);
    rekv_kvstore_client *c = kvd_client(&d), *ctl = kvd_client(&d), *ask = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_client_header(c)->lease_ms, 1000);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 3, 64, 0, 0, NULL, NULL), 0);
    /* control: a pin held with nobody renewing is lost once the store expires its lease */
    rekv_kv_range r = {3, 1, 0, 64};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(ctl, &r, 1, 1, &pb, &n, &cap, NULL), 0);
    uint64_t expired = wait_expiries(ask, 0);
    ck_assert_uint_eq(expired, 1);
    ck_assert_int_eq(rekv_kvstore_unpin(ctl, &r, 1, &err), -EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "not pinned"));
    /* the step on its thread, renewals from this one every 20 ms */
    step_sim sim = {c, &d, expired, 0, 0, 0};
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, step_sim_thread, &sim), 0);
    int while_holding = 0; /* renewals while the step held its pin past the lease */
    while (!sim.done) {
        ck_assert_int_eq(rekv_kvstore_renew_nowait(c, &err), 0);
        while_holding += sim.holding;
        usleep(20000);
    }
    pthread_join(t, NULL);
    ck_assert_msg(sim.failures == 0, "%d requests of the step failed", sim.failures);
    ck_assert_int_gt(while_holding, 0);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.leases_expired, expired + 1); /* the witness's, not the step's */
    ck_assert_uint_eq(st.pinned_blocks, 0);
    free(pb);
    rekv_kvstore_client_close(ask);
    rekv_kvstore_client_close(ctl);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* ------------------------------------------------------------------ sequence owners */

static void create_seq(rekv_kvstore_client *c, uint64_t seq, uint64_t tokens)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_seq_create(c, seq, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_kvstore_append(c, seq, tokens, 0, 0, NULL, &err) == 0, "%s", err.msg);
}

/* DropOwner drops every sequence of an owner, whichever of its connections created it, with the
 * pins those connections hold (a dead predecessor's); leaves other owners' and ownerless ones; and
 * leaves (-EBUSY) one that a client of another owner pins. */
START_TEST(test_drop_owner)
{
    kvd d;
    kvd_start(&d, 64, NULL, 0);
    rekv_kvstore_client *old = kvd_client(&d), *fresh = kvd_client(&d), *other = kvd_client(&d),
                        *anon = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_client_set_owner(old, "worker-a", NULL), 0);
    ck_assert_int_eq(rekv_kvstore_client_set_owner(fresh, "worker-a", NULL), 0);
    ck_assert_int_eq(rekv_kvstore_client_set_owner(other, "worker-b", NULL), 0);
    create_seq(old, 10, 32); /* 2 blocks x 2 layers */
    create_seq(old, 11, 48); /* 3 x 2 */
    create_seq(other, 20, 16);
    create_seq(anon, 30, 16);
    rekv_kv_range r = {10, 0, 0, 32};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(old, &r, 1, 1, &pb, &n, &cap, NULL), 0);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(anon, &st, NULL), 0);
    ck_assert_uint_eq(st.sequences, 4);
    ck_assert_uint_eq(st.pinned_blocks, 2);
    ck_assert_uint_eq(st.free_slots, st.total_slots - 14);
    /* the restarted worker drops what its predecessor (still connected, pinning) left */
    uint64_t ns = 0, nb = 0;
    ck_assert_msg(rekv_kvstore_drop_owner(fresh, "worker-a", &ns, &nb, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(ns, 2);
    ck_assert_uint_eq(nb, 10);
    ck_assert_int_eq(rekv_kvstore_stats(anon, &st, NULL), 0);
    ck_assert_uint_eq(st.sequences, 2);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    ck_assert_uint_eq(st.free_slots, st.total_slots - 4);
    ck_assert_uint_eq(st.sequences_reclaimed, 2);
    ck_assert_int_eq(rekv_kvstore_unpin(old, &r, 1, NULL), -ENOENT); /* gone with its pins */
    ck_assert_int_eq(rekv_kvstore_drop_owner(fresh, "worker-a", &ns, &nb, NULL), 0);
    ck_assert_uint_eq(ns, 0);
    /* a client of another owner pinning one: that one stays, the rest goes */
    create_seq(fresh, 12, 16);
    create_seq(fresh, 13, 16);
    rekv_kv_range r12 = {12, 1, 0, 16};
    ck_assert_int_eq(rekv_kvstore_plan(other, &r12, 1, 1, &pb, &n, &cap, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_drop_owner(fresh, "worker-a", &ns, &nb, &err), -EBUSY);
    ck_assert_msg(strstr(err.msg, "another owner") && strstr(err.msg, "sequence 12"), "%s",
                  err.msg);
    ck_assert_int_eq(rekv_kvstore_unpin(other, &r12, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_drop_owner(fresh, "worker-a", &ns, &nb, NULL), 0);
    ck_assert_uint_eq(ns, 1);
    ck_assert_int_eq(rekv_kvstore_stats(anon, &st, NULL), 0);
    ck_assert_uint_eq(st.sequences, 2); /* worker-b's and the ownerless one */
    ck_assert_uint_eq(st.free_slots, st.total_slots - 4);
    /* bad names */
    ck_assert_int_eq(rekv_kvstore_drop_owner(fresh, "", NULL, NULL, &err), -EINVAL);
    char longname[200];
    memset(longname, 'x', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = '\0';
    ck_assert_int_eq(rekv_kvstore_client_set_owner(fresh, longname, &err), -EINVAL);
    ck_assert_int_eq(rekv_kvstore_drop_owner(fresh, longname, NULL, NULL, &err), -EINVAL);
    free(pb);
    rekv_kvstore_client_close(old);
    rekv_kvstore_client_close(fresh);
    rekv_kvstore_client_close(other);
    rekv_kvstore_client_close(anon);
    kvd_stop(&d);
}
END_TEST

/* An owner none of whose connections is heard from for a lease (a worker killed with -9 and not
 * restarted, or restarted under another name) loses its sequences; an ownerless client's and a
 * live owner's stay. */
START_TEST(test_owner_lease_expiry)
{
    kvd d;
    kvd_start(&d, 64, "--lease-ms 1000", 0);
    rekv_kvstore_client *live = kvd_client(&d), *anon = kvd_client(&d);
    ck_assert_int_eq(rekv_kvstore_client_set_owner(live, "alive", NULL), 0);
    create_seq(live, 1, 16);
    create_seq(anon, 2, 16);
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) { /* a worker: creates and pins, then renews until killed */
        close(pfd[0]);
        rekv_kvstore_client *cc = NULL;
        if (rekv_kvstore_client_connect(d.endpoint, NULL, 5000, &cc, NULL) < 0 ||
            rekv_kvstore_client_set_owner(cc, "doomed", NULL) < 0 ||
            rekv_kvstore_seq_create(cc, 5, NULL) < 0 ||
            rekv_kvstore_append(cc, 5, 64, 0, 0, NULL, NULL) < 0 ||
            rekv_kvstore_seq_create(cc, 6, NULL) < 0)
            _exit(1);
        rekv_kv_range r = {5, 0, 0, 64};
        rekv_kv_plan_block *pb = NULL;
        size_t n, cap = 0;
        if (rekv_kvstore_plan(cc, &r, 1, 1, &pb, &n, &cap, NULL) < 0)
            _exit(1);
        ssize_t w = write(pfd[1], "P", 1);
        (void)w;
        for (;;) {
            rekv_kvstore_renew(cc, NULL);
            usleep(20000);
        }
    }
    close(pfd[1]);
    char ch;
    ck_assert_int_eq(read(pfd[0], &ch, 1), 1);
    close(pfd[0]);
    rekv_kv_stats st;
    /* a lease passes (the witness, pinned after the worker, expires; `live` asks meanwhile):
     * renewals keep pins and sequences */
    rekv_kvstore_client *w = witness_pin(&d, (rekv_kv_range){2, 0, 0, 16});
    ck_assert_uint_eq(wait_expiries(live, 0), 1);
    ck_assert_int_eq(rekv_kvstore_stats(live, &st, NULL), 0);
    ck_assert_uint_eq(st.sequences, 4);
    ck_assert_uint_eq(st.pinned_blocks, 4);
    ck_assert_uint_eq(st.free_slots, st.total_slots - 12);
    ck_assert_uint_eq(st.sequences_reclaimed, 0);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    for (;;) { /* these requests keep `live` alive; `anon` stays silent (Check's timeout is the
                * guard) */
        ck_assert_int_eq(rekv_kvstore_stats(live, &st, NULL), 0);
        if (st.sequences == 2)
            break;
        usleep(20000);
    }
    ck_assert_uint_eq(st.sequences_reclaimed, 2);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    ck_assert_uint_eq(st.free_slots, st.total_slots - 4);
    ck_assert_uint_eq(st.leases_expired, 2); /* the witness's and the dead worker's */
    /* both survivors are usable: the silent ownerless client's sequence was kept */
    rekv_kv_table_entry *t;
    size_t nb;
    ck_assert_int_eq(rekv_kvstore_table(anon, 2, 1, &t, &nb, NULL, NULL), 0);
    ck_assert_uint_eq(nb, 1);
    free(t);
    ck_assert_int_eq(rekv_kvstore_seq_drop(live, 1, NULL), 0);
    rekv_kvstore_client_close(w);
    rekv_kvstore_client_close(live);
    rekv_kvstore_client_close(anon);
    kvd_stop(&d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstore_leases");
    TCase *tc;
    tc = tcase_create("daemon");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_killed_client_loses_pins);
    tcase_add_test(tc, test_renew_from_another_thread);
    tcase_add_test(tc, test_drop_owner);
    tcase_add_test(tc, test_owner_lease_expiry);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
