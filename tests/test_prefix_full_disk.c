/* test_prefix_full_disk.c — issue 37 item 5's "a full disk stops caching, never serving", against
 * a real rekv-kvstore whose spill file cannot grow: RLIMIT_FSIZE on the daemon (as a quota or a
 * full file system would, the file system refuses to grow the file; here with EFBIG, where
 * --spill-bytes' own limit gives ENOSPC, which tests/test_prefix_store.c covers). With the spill
 * file full of a running sequence's blocks and the cache's blocks in the arena, a sequence that
 * needs room gets it from the cache (its blocks evicted, not spilled: caching stops) instead of
 * an error, every stored block is intact, and what is still cached still serves a prefix. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvstore/kvstore.h"
#include "tests/kvd.h"
#include "tests/testutil.h"

#define FP 0x5eedull

static int32_t T[64];

static rekv_kv_stats stats(rekv_kvstore_client *c)
{
    rekv_kv_stats st;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_stats(c, &st, &err) == 0, "stats: %s", err.msg);
    return st;
}

static void append(rekv_kvstore_client *c, uint64_t seq, uint64_t tokens)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_append(c, seq, tokens, 0, 0, NULL, &err) == 0, "append: %s",
                  err.msg);
}

/* Blocks [b0, b1) of seq hold what kvd_write_blocks wrote for sequence src (gen). */
static void verify_as(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1, uint64_t src,
                      uint32_t gen)
{
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    rekv_err err = {0};
    for (uint32_t l = 0; l < 2; l++) {
        rekv_kv_range r = {seq, l, b0 * 16, b1 * 16};
        ck_assert_msg(rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err) == 0, "pin: %s", err.msg);
        for (size_t i = 0; i < n; i++)
            ck_assert_msg(kvd_check(arena + pb[i].offset, kvd_type_bytes(c, pb[i].type), src, l,
                                    pb[i].block, gen),
                          "seq %llu layer %u block %llu is not seq %llu's", (unsigned long long)seq,
                          l, (unsigned long long)pb[i].block, (unsigned long long)src);
        ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
    }
    free(pb);
}

START_TEST(full_disk_stops_caching_not_serving)
{
    for (int i = 0; i < 64; i++)
        T[i] = 300 + 11 * i;
    kvd d;
    /* 8 arena slots (2 layers: 4 block positions); the limit is the arena's memfd (a page of
     * header and the slots), so the spill file holds at most 9 */
    kvd_start(&d, 8, "--no-register-arena --high-pct 100 --low-pct 100", 9 * 4096);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    /* sequence 1: 6 positions, 12 blocks (4 of them spilled) */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 1, NULL), 0);
    append(c, 1, 96);
    kvd_write_blocks(c, 1, 0, 6, 1);
    /* sequence 2: 2 positions published, then dropped: 4 blocks only the cache holds, in the
     * arena; making room for them spilled 4 more of sequence 1's: one file slot is left */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    append(c, 2, 32);
    kvd_write_blocks(c, 2, 0, 2, 2);
    rekv_kv_prefix px = {T, 32, FP, 0, 0};
    rekv_kv_prefix_hit h;
    ck_assert_msg(rekv_kvstore_publish(c, 2, &px, &h, &err) == 0, "publish: %s", err.msg);
    ck_assert_int_eq(h.blocks, 2);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    rekv_kv_stats st = stats(c);
    ck_assert_uint_eq(st.disk_kv, 8);
    ck_assert_uint_eq(st.prefix_cached_blocks, 4);
    ck_assert_uint_eq(st.prefix_evictions, 0);

    /* sequence 3 needs a position: a cached block takes the last file slot, the next cannot go
     * to disk (spilling pauses for a second); the spill in flight frees room, or a cached
     * position goes */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 3, 16, 0, 0, NULL, &err) == 0,
                  "a full disk failed a running sequence's append: %s", err.msg);
    kvd_write_blocks(c, 3, 0, 1, 3);
    do /* the cached block's spill write completes */
        st = stats(c);
    while (st.spills_in_flight > 0);
    ck_assert_uint_eq(st.disk_kv, 9); /* the spill file is full */
    ck_assert_uint_eq(st.spill_errors, 1);
    uint64_t ev = st.prefix_evictions;
    ck_assert_uint_gt(st.prefix_cached_blocks, 0); /* a cached block is still in the arena */

    /* past the one-second pause (a bound from below), spilling is tried again: sequence 5's
     * position finds the spill file full and no spill in flight; the cached blocks go, not the
     * append */
    usleep(1100000);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 5, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 5, 16, 0, 0, NULL, &err) == 0,
                  "a full disk failed a running sequence's append: %s", err.msg);
    kvd_write_blocks(c, 5, 0, 1, 5);
    st = stats(c);
    ck_assert_uint_gt(st.prefix_evictions, ev);
    verify_as(c, 1, 0, 6, 1, 1);
    verify_as(c, 3, 0, 1, 3, 3);
    verify_as(c, 5, 0, 1, 5, 5);

    /* the cache still serves: sequence 5's block published, a sequence made from it */
    int32_t t5[17];
    for (int i = 0; i < 17; i++)
        t5[i] = 7 + i;
    rekv_kv_prefix p5 = {t5, 16, FP, 0, 0};
    ck_assert_msg(rekv_kvstore_publish(c, 5, &p5, &h, &err) == 0, "publish: %s", err.msg);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);
    p5.n_tokens = 17;
    ck_assert_msg(rekv_kvstore_seq_create_prefix(c, 4, &p5, &h, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(h.tokens, 16);
    verify_as(c, 4, 0, 1, 5, 5);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 4, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 5, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_cache_clear(c, NULL), 0);
    do
        st = stats(c);
    while (st.spills_in_flight + st.reads_in_flight > 0);
    ck_assert_uint_eq(st.free_slots, st.total_slots);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("prefix_full_disk");
    TCase *tc = tcase_create("prefix_full_disk");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, full_disk_stops_caching_not_serving);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
