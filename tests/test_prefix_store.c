/* test_prefix_store.c — the kvstore's prefix cache (kvstore/prefix.c) against a real
 * rekv-kvstore: published blocks shared by reference (one slot, several tables), a prefix that
 * diverges inside a block, the key's fingerprint and kind, eviction for running sequences with
 * and without a spill tier (a cached block spilled is still a hit, read back with its bytes
 * counted), the spill file at its limit giving cached blocks' slots back, a dead owner's
 * sequences dropped with the cache intact, and every count back to an empty store at the end. */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstore/kvstore.h"
#include "tests/kvd.h"
#include "tests/testutil.h"

#define FP 0x1234abcdull

static int32_t T[1024]; /* the shared prompt */

static void tokens_init(void)
{
    for (int i = 0; i < 1024; i++)
        T[i] = 1000 + i * 7;
}

static rekv_kv_prefix px(const int32_t *t, size_t n)
{
    return (rekv_kv_prefix){t, n, FP, 0, 0};
}

static rekv_kv_stats stats(rekv_kvstore_client *c)
{
    rekv_kv_stats st;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_stats(c, &st, &err) == 0, "stats: %s", err.msg);
    return st;
}

/* seq with n tokens of t written (contents of seq src_seq, generation gen) and published. */
static void make_published(rekv_kvstore_client *c, uint64_t seq, size_t n, uint32_t gen)
{
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, seq, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, seq, n, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    kvd_write_blocks(c, seq, 0, n / 16, gen); /* the full blocks: what is published */
    rekv_kv_prefix p = px(T, n);
    rekv_kv_prefix_hit h;
    ck_assert_msg(rekv_kvstore_publish(c, seq, &p, &h, &err) == 0, "publish: %s", err.msg);
    ck_assert_int_eq(h.blocks, n / 16);
}

/* Blocks [b0, b1) of seq hold what kvd_write_blocks wrote for src (gen). */
static void verify_as(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1,
                      uint64_t src, uint32_t gen)
{
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    rekv_err err = {0};
    for (uint32_t l = 0; l < 2; l++) {
        rekv_kv_range r = {seq, l, b0 * 16, b1 * 16};
        ck_assert_msg(rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err) == 0, "pin: %s",
                      err.msg);
        for (size_t i = 0; i < n; i++)
            ck_assert_msg(kvd_check(arena + pb[i].offset, kvd_type_bytes(c, pb[i].type), src, l,
                                    pb[i].block, gen),
                          "seq %llu layer %u block %llu is not seq %llu's",
                          (unsigned long long)seq, l, (unsigned long long)pb[i].block,
                          (unsigned long long)src);
        ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
    }
    free(pb);
}

/* Everything dropped and the cache cleared: every slot free, no block anywhere. */
static void assert_empty(rekv_kvstore_client *c)
{
    ck_assert_int_eq(rekv_kvstore_cache_clear(c, NULL), 0);
    rekv_kv_stats st;
    do /* a block freed while its spill write is in flight gives its slot back at completion */
        st = stats(c);
    while (st.spills_in_flight + st.reads_in_flight > 0);
    ck_assert_int_eq(st.sequences, 0);
    ck_assert_int_eq(st.prefix_entries, 0);
    ck_assert_int_eq(st.host_kv + st.host_act + st.disk_kv + st.disk_act, 0);
    ck_assert_int_eq(st.free_slots, st.total_slots);
    ck_assert_int_eq(st.spill_used_bytes, 0);
}

START_TEST(shared_by_reference)
{
    kvd d;
    kvd_start(&d, 64, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    make_published(c, 1, 40, 7); /* 2 full blocks and a partial one */
    rekv_kv_stats st = stats(c);
    ck_assert_int_eq(st.prefix_entries, 2);
    ck_assert_int_eq(st.prefix_cached_blocks, 4);
    ck_assert_int_eq(st.prefix_published_blocks, 4);
    ck_assert_int_eq(st.host_kv, 6);

    /* all but the last prompt token: the two full blocks, taken by reference */
    rekv_kv_prefix p = px(T, 39);
    rekv_kv_prefix_hit h;
    ck_assert_msg(rekv_kvstore_seq_create_prefix(c, 2, &p, &h, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(h.tokens, 32);
    ck_assert_int_eq(h.blocks, 2);
    ck_assert_int_eq(h.host_blocks, 4);
    ck_assert_int_eq(h.disk_blocks, 0);
    ck_assert_int_eq(stats(c).host_kv, 6); /* nothing copied */
    uint64_t after;
    ck_assert_int_eq(rekv_kvstore_append(c, 2, 10, 0, 0, &after, NULL), 0);
    ck_assert_int_eq(after, 42);
    for (uint32_t l = 0; l < 2; l++) {
        rekv_kv_table_entry *t1, *t2;
        size_t n1, n2;
        ck_assert_int_eq(rekv_kvstore_table(c, 1, l, &t1, &n1, NULL, NULL), 0);
        ck_assert_int_eq(rekv_kvstore_table(c, 2, l, &t2, &n2, NULL, NULL), 0);
        ck_assert_int_eq(n2, 3);
        for (int b = 0; b < 2; b++)
            ck_assert_int_eq(t1[b].phys, t2[b].phys); /* one slot, two tables */
        ck_assert_int_ne(t1[2].phys, t2[2].phys); /* its own third block */
        free(t1);
        free(t2);
    }
    verify_as(c, 2, 0, 2, 1, 7);

    /* diverging inside block 1: block 0 only; another model or the ACT kind: nothing */
    int32_t u[39];
    memcpy(u, T, sizeof(u));
    u[20]++;
    p = px(u, 39);
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 3, &p, &h, NULL), 0);
    ck_assert_int_eq(h.tokens, 16);
    p = px(T, 39);
    p.fingerprint = FP + 1;
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 0);
    p = px(T, 39);
    p.act_parts = 1;
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 0);
    p = px(T, 128);
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 2);
    st = stats(c);
    ck_assert_int_eq(st.prefix_lookups, 5);
    ck_assert_int_eq(st.prefix_hit_tokens, 48);
    ck_assert_int_eq(st.prefix_hit_host_blocks, 6);

    /* seq 3 publishing its own block 1 cannot replace the cached one's chain: block 0 is the
     * cached one (its own), block 1 a new position of its own tokens */
    ck_assert_int_eq(rekv_kvstore_append(c, 3, 23, 0, 0, NULL, NULL), 0);
    kvd_write_blocks(c, 3, 1, 2, 9);
    p = px(u, 39);
    ck_assert_int_eq(rekv_kvstore_publish(c, 3, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 2);
    ck_assert_int_eq(h.published, 1);
    ck_assert_int_eq(stats(c).prefix_entries, 3);

    /* the same client pins seq 2's shared blocks through seq 1 while seq 1 is dropped */
    rekv_kv_range r = {2, 0, 0, 32};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, NULL), 0);
    free(pb);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
    verify_as(c, 2, 0, 2, 1, 7);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);
    st = stats(c);
    ck_assert_int_eq(st.prefix_entries, 3);
    ck_assert_int_eq(st.host_kv, 6); /* only the cache's */
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* No spill tier, 8 slots (4 positions of 2 layers): cached blocks give way to a running
 * sequence's append; a block a sequence took from the cache is never evicted from under it. */
START_TEST(evicted_for_running_sequences)
{
    kvd d;
    kvd_start(&d, 8, "--no-spill", 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    make_published(c, 1, 32, 5);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    rekv_kv_prefix p = px(T, 31);
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 3, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 1);
    /* 6 slots: the 4 free and the cache-only position 1 */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 4, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 4, 48, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    rekv_kv_stats st = stats(c);
    ck_assert_int_eq(st.prefix_evictions, 2);
    ck_assert_int_eq(st.prefix_entries, 1);
    /* no more room: seq 3's shared block stays */
    ck_assert_int_eq(rekv_kvstore_append(c, 4, 16, 0, 0, NULL, &err), -ENOMEM);
    verify_as(c, 3, 0, 1, 1, 5);
    p = px(T, 64);
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 1);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 4, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* With a spill tier the cached blocks go to disk first, stay hits there, and come back with
 * their bytes counted as read back for hits. */
START_TEST(spilled_first_still_a_hit)
{
    kvd d;
    kvd_start(&d, 8, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    make_published(c, 1, 32, 3);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 2, 64, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    kvd_write_blocks(c, 2, 0, 4, 4);
    rekv_kv_stats st = stats(c);
    ck_assert_int_eq(st.prefix_evictions, 0);
    rekv_kv_prefix p = px(T, 33);
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.disk_blocks, 4); /* the cache's went first */
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 3, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 2);
    ck_assert_int_eq(h.disk_blocks, 4);
    verify_as(c, 3, 0, 2, 1, 3);
    st = stats(c);
    ck_assert_int_eq(st.prefix_hit_disk_blocks, 4);
    ck_assert_int_eq(st.prefix_hit_read_bytes, 4 * 4096);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* More cached blocks than the spill queue's depth (64) go to disk when a sequence needs their
 * room: a full queue is waited for, not a reason to evict. */
START_TEST(many_cached_spilled_not_evicted)
{
    kvd d;
    kvd_start(&d, 160, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    make_published(c, 1, 640, 4); /* 40 positions, 80 blocks */
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 2, 1280, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    rekv_kv_stats st = stats(c);
    ck_assert_int_eq(st.prefix_evictions, 0);
    ck_assert_int_eq(st.prefix_entries, 40);
    rekv_kv_prefix p = px(T, 641);
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 40);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* A spill file at --spill-bytes full of cached blocks: a running sequence's spill evicts them. */
START_TEST(full_spill_file_evicts_cached)
{
    kvd d;
    kvd_start(&d, 4, "--spill-bytes 16384 --high-pct 100 --low-pct 90", 0); /* spills on demand */
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    make_published(c, 1, 32, 2);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 2, 32, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    kvd_write_blocks(c, 2, 0, 2, 6);
    ck_assert_int_eq(stats(c).disk_kv, 4); /* the spill file is full of the cache's blocks */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 3, 16, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    kvd_write_blocks(c, 3, 0, 1, 8);
    rekv_kv_stats st = stats(c);
    ck_assert_int_eq(st.prefix_evictions, 2); /* one position's blocks gave their slots */
    ck_assert_int_eq(st.prefix_entries, 1);
    kvd_verify_blocks(c, 2, 0, 2, 6);
    kvd_verify_blocks(c, 3, 0, 1, 8);
    ck_assert_int_eq(stats(c).prefix_evictions, 4); /* reading seq 2 back took the other's */
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* An append that finds the arena pinned full makes its blocks without a slot (FRESH), which need
 * room on the spill tier: cached blocks on disk give it. */
START_TEST(fresh_append_evicts_cached)
{
    kvd d;
    kvd_start(&d, 4, "--spill-bytes 16384 --high-pct 100 --low-pct 90", 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    make_published(c, 1, 32, 2);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 2, 32, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    ck_assert_int_eq(stats(c).disk_kv, 4); /* the cache's, filling the spill file */
    rekv_kv_range r[2] = {{2, 0, 0, 32}, {2, 1, 0, 32}};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(c, r, 2, 1, &pb, &n, &cap, NULL), 0); /* arena pinned */
    free(pb);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 3, 16, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    rekv_kv_stats st = stats(c);
    ck_assert_int_eq(st.prefix_evictions, 2);
    ck_assert_int_eq(st.prefix_entries, 1);
    ck_assert_int_eq(rekv_kvstore_unpin(c, r, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* A dead worker's sequences (DropOwner, as its successor sends) go; the blocks it published stay
 * cached, and the references of a sequence it made from the cache are given back. */
START_TEST(dead_owner_keeps_cache)
{
    kvd d;
    kvd_start(&d, 64, NULL, 0);
    rekv_kvstore_client *w = kvd_client(&d), *c = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_client_set_owner(w, "w1", NULL), 0);
    make_published(w, 10, 48, 1);
    rekv_kv_prefix p = px(T, 40);
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(w, 11, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 2);
    ck_assert_int_eq(rekv_kvstore_append(w, 11, 8, 0, 0, NULL, NULL), 0);
    /* another client's sequence from the same prefix, pinned by it while w1's go */
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 20, &p, &h, NULL), 0);
    rekv_kv_range r = {20, 1, 0, 32};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, NULL), 0);
    free(pb);
    rekv_kvstore_client_close(w); /* died */
    uint64_t seqs, blocks;
    ck_assert_msg(rekv_kvstore_drop_owner(c, "w1", &seqs, &blocks, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(seqs, 2);
    rekv_kv_stats st = stats(c);
    ck_assert_int_eq(st.prefix_entries, 3);
    ck_assert_int_eq(st.host_kv, 6); /* the cache's 3 positions; seq 11's own block went */
    ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
    verify_as(c, 20, 0, 2, 10, 1);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 20, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* ---------------------------------------------------------------- across restarts */

/* A store on prefix directory dir (spilling on demand only). */
static rekv_kvstore_client *persist_start(kvd *d, const char *dir, const char *more)
{
    char extra[1024];
    snprintf(extra, sizeof(extra), "--prefix-dir %s --high-pct 100 --low-pct 90%s%s", dir,
             more ? " " : "", more ? more : "");
    kvd_start(d, 8, extra, 0);
    return kvd_client(d);
}

/* The store dies (SIGKILL: no clean stop) and its own directories go. */
static void crash(kvd *d, rekv_kvstore_client *c)
{
    rekv_kvstore_client_close(c);
    ck_assert_int_eq(kill(d->pid, SIGKILL), 0);
    ck_assert_int_eq(waitpid(d->pid, NULL, 0), d->pid);
    tu_rmrf(d->dir);
    free(d->dir);
}

/* Two cached positions pushed to disk (a sequence filling the arena), and the file slot of
 * position 1's layer-1 block. */
static uint64_t cache_on_disk(rekv_kvstore_client *c)
{
    rekv_err err = {0};
    make_published(c, 1, 32, 3);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 2, 64, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    rekv_kv_prefix p = px(T, 33);
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 9, &p, &h, NULL), 0);
    ck_assert_int_eq(h.disk_blocks, 4);
    rekv_kv_table_entry *t;
    size_t n;
    ck_assert_int_eq(rekv_kvstore_table(c, 9, 1, &t, &n, NULL, NULL), 0);
    ck_assert_int_eq(t[1].tier, REKV_KV_TIER_DISK);
    uint64_t fslot = t[1].phys;
    free(t);
    return fslot;
}

/* The cached blocks on disk survive a crash of the store (a torn record at the index's end too);
 * a byte flipped in one of them drops that position alone; a clean stop writes the cache in
 * memory to disk first; an index made for another geometry is ignored. */
START_TEST(kept_across_restart)
{
    char *dir = tu_tmpdir(), path[4200];
    kvd d;
    rekv_kvstore_client *c = persist_start(&d, dir, NULL);
    uint64_t fslot = cache_on_disk(c);
    crash(&d, c);
    snprintf(path, sizeof(path), "%s/index.rekv", dir);
    int fd = open(path, O_WRONLY | O_APPEND);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(write(fd, "a torn record", 13), 13);
    close(fd);

    c = persist_start(&d, dir, NULL);
    rekv_kv_prefix p = px(T, 33);
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 3, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 2);
    ck_assert_int_eq(h.disk_blocks, 4);
    verify_as(c, 3, 0, 2, 1, 3); /* read back: CRC32C checked again */
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);
    /* again on disk for the next crash: a sequence fills the arena */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 4, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 4, 64, 0, 0, NULL, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.disk_blocks, 4);
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 9, &p, &h, NULL), 0);
    rekv_kv_table_entry *t;
    size_t n;
    ck_assert_int_eq(rekv_kvstore_table(c, 9, 1, &t, &n, NULL, NULL), 0);
    fslot = t[1].phys;
    free(t);
    crash(&d, c);

    /* a byte flipped in position 1's layer-1 block */
    snprintf(path, sizeof(path), "%s/spill.rekv", dir);
    fd = open(path, O_RDWR);
    ck_assert_int_ge(fd, 0);
    uint8_t byte;
    off_t at = (off_t)fslot * 4096 + 100;
    ck_assert_int_eq(pread(fd, &byte, 1, at), 1);
    byte ^= 0x40;
    ck_assert_int_eq(pwrite(fd, &byte, 1, at), 1);
    close(fd);
    c = persist_start(&d, dir, NULL);
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 5, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 1);
    verify_as(c, 5, 0, 1, 1, 3);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 5, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);

    /* a clean stop writes the cache in memory to disk first */
    c = persist_start(&d, dir, NULL);
    make_published(c, 1, 48, 5);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(stats(c).host_kv, 6);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
    c = persist_start(&d, dir, NULL);
    ck_assert_int_eq(rekv_kvstore_seq_create_prefix(c, 6, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 2);
    ck_assert_int_eq(h.disk_blocks, 4);
    verify_as(c, 6, 0, 2, 1, 5);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 6, NULL), 0);
    assert_empty(c);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);

    /* another geometry: the index is ignored, and the cache starts empty */
    c = persist_start(&d, dir, NULL);
    cache_on_disk(c);
    crash(&d, c);
    c = persist_start(&d, dir, "--hidden 128");
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(h.blocks, 0);
    ck_assert_int_eq(stats(c).disk_kv, 0);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    tokens_init();
    Suite *s = suite_create("prefix_store");
    TCase *tc = tcase_create("prefix_store");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, shared_by_reference);
    tcase_add_test(tc, evicted_for_running_sequences);
    tcase_add_test(tc, spilled_first_still_a_hit);
    tcase_add_test(tc, many_cached_spilled_not_evicted);
    tcase_add_test(tc, full_spill_file_evicts_cached);
    tcase_add_test(tc, fresh_append_evicts_cached);
    tcase_add_test(tc, dead_owner_keeps_cache);
    tcase_add_test(tc, kept_across_restart);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
