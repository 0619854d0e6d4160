/* test_kvstore_api.c — the kvstore daemon and its client library, end to end (the real
 * rekv-kvstore process on real sockets in a temporary directory; tests/kvd.h starts it): CRC32C
 * vectors, the block geometry, the API (sequences, appends, plans, pins, frees, errors), ACT
 * blocks costing their real bytes, thousands of random operations from several clients, and
 * malformed messages; each store ends with a clean SIGTERM. The other kvstore suites:
 * test_kvstore_spill (the spill tier), test_kvstore_leases (pin leases and owners),
 * test_kvstore_push (copies into a client's buffer). */
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

uint32_t rekv_crc32c_sw(uint32_t crc, const void *buf, size_t n);

/* ------------------------------------------------------------------ unit pieces */

START_TEST(test_crc32c)
{
    const char *s = "123456789";
    ck_assert_uint_eq(rekv_crc32c(0, s, 9), 0xE3069283u);
    ck_assert_uint_eq(rekv_crc32c_sw(0, s, 9), 0xE3069283u);
    uint8_t z[32] = {0}, ff[32], inc[32];
    memset(ff, 0xff, sizeof(ff));
    for (int i = 0; i < 32; i++)
        inc[i] = (uint8_t)i;
    /* RFC 3720 B.4 vectors */
    ck_assert_uint_eq(rekv_crc32c(0, z, 32), 0x8A9136AAu);
    ck_assert_uint_eq(rekv_crc32c(0, ff, 32), 0x62A8AB43u);
    ck_assert_uint_eq(rekv_crc32c(0, inc, 32), 0x46DD794Eu);
    ck_assert_uint_eq(rekv_crc32c_sw(0, inc, 32), 0x46DD794Eu);
    /* chaining and odd lengths agree with the table path */
    uint8_t buf[1000];
    kvd_fill(buf, sizeof(buf), 1, 2, 3, 4);
    for (size_t n = 0; n < sizeof(buf); n += 37) {
        uint32_t a = rekv_crc32c(rekv_crc32c(0, buf, n / 2), buf + n / 2, n - n / 2);
        ck_assert_uint_eq(a, rekv_crc32c_sw(0, buf, n));
    }
}
END_TEST

START_TEST(test_geometry_and_map)
{
    rekv_kv_geometry g;
    rekv_model_config mc = {0};
    mc.n_layers = 32;
    mc.n_kv_heads = 8;
    mc.head_dim = 128;
    mc.hidden = 4096;
    ck_assert_int_eq(rekv_kv_geometry_from_config(&mc, REKV_DTYPE_F16, &g, NULL), 0);
    ck_assert_uint_eq(rekv_kv_block_bytes(&g), 2u * 8 * 16 * 128 * 2);
    ck_assert_uint_eq(rekv_kv_act_block_bytes(&g), 16u * 4096 * 2);
    ck_assert_uint_eq(rekv_kv_k_offset(&g, 1, 2), ((1u * 16 + 2) * 128) * 2);
    ck_assert_uint_eq(rekv_kv_v_offset(&g, 0, 0), 8u * 16 * 128 * 2);
    ck_assert_uint_eq(rekv_kv_act_offset(&g, 3), 3u * 4096 * 2);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kv_geometry_from_config(&mc, REKV_DTYPE_BF16, &g, &err), -EINVAL);
    kv_map m;
    kv_map_init(&m);
    for (uint64_t i = 0; i < 5000; i++)
        ck_assert_int_eq(kv_map_put(&m, i * 7919, i), 0);
    for (uint64_t i = 0; i < 5000; i += 2)
        ck_assert_int_eq(kv_map_del(&m, i * 7919), 1);
    for (uint64_t i = 0; i < 5000; i++) {
        uint64_t *v = kv_map_get(&m, i * 7919);
        if (i % 2)
            ck_assert(v && *v == i);
        else
            ck_assert_ptr_null(v);
    }
    ck_assert_uint_eq(m.len, 2500);
    kv_map_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ API */

START_TEST(test_api_basics)
{
    kvd d;
    kvd_start(&d, 64, "--spill-bytes 4194304", 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    rekv_kv_geometry g;
    rekv_kvstore_client_geometry(c, &g);
    ck_assert_uint_eq(g.n_layers, 2);
    ck_assert_uint_eq(rekv_kvstore_client_header(c)->kv_block_bytes, 4096);
    ck_assert_uint_eq(rekv_kvstore_client_header(c)->act_block_bytes, 2048);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 7, &err), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 7, &err), -EEXIST);
    ck_assert_ptr_nonnull(strstr(err.msg, "exists"));
    uint64_t nt;
    ck_assert_int_eq(rekv_kvstore_append(c, 7, 40, 1, 1, &nt, NULL), 0); /* 3 blocks/layer */
    ck_assert_uint_eq(nt, 40);
    ck_assert_int_eq(rekv_kvstore_append(c, 7, 10, 1, 1, &nt, NULL), 0); /* 50: 4 blocks */
    rekv_kv_table_entry *t;
    size_t nb;
    ck_assert_int_eq(rekv_kvstore_table(c, 7, 1, &t, &nb, &nt, NULL), 0);
    ck_assert_uint_eq(nb, 4);
    ck_assert_uint_eq(nt, 50);
    for (size_t i = 0; i < nb; i++) {
        ck_assert_uint_eq(t[i].type,
                          i % 2 ? REKV_KV_BLOCK_KV : REKV_KV_BLOCK_ACT); /* 1:1, ties ACT */
        ck_assert_uint_eq(t[i].tier, REKV_KV_TIER_HOST);
    }
    free(t);
    /* plan two ranges in one round trip */
    rekv_kv_range r[2] = {{7, 0, 5, 37}, {7, 1, 48, 50}};
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    ck_assert_int_eq(rekv_kvstore_plan(c, r, 2, 1, &pb, &n, &cap, &err), 0);
    ck_assert_uint_eq(n, 4);
    ck_assert_uint_eq(pb[0].first, 5);
    ck_assert_uint_eq(pb[0].count, 11);
    ck_assert_uint_eq(pb[2].block, 2);
    ck_assert_uint_eq(pb[2].count, 5);
    ck_assert_uint_eq(pb[3].range, 1);
    ck_assert_uint_eq(pb[3].block, 3);
    ck_assert_uint_eq(pb[3].first, 0);
    ck_assert_uint_eq(pb[3].count, 2);
    size_t abytes;
    uint8_t *arena = rekv_kvstore_client_arena(c, &abytes);
    for (size_t i = 0; i < n; i++) {
        ck_assert_uint_lt(pb[i].offset, abytes);
        kvd_fill(arena + pb[i].offset, kvd_type_bytes(c, pb[i].type), 7, r[pb[i].range].layer,
                 pb[i].block, 1);
    }
    /* offsets are distinct */
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            ck_assert_uint_ne(pb[i].offset, pb[j].offset);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.pinned_blocks, 4);
    ck_assert_uint_eq(st.host_kv + st.host_act, 8);
    ck_assert_uint_eq(st.sequences, 1);
    /* unpinning what is not pinned fails and changes nothing */
    rekv_kv_range bad = {7, 1, 0, 16};
    ck_assert_int_eq(rekv_kvstore_unpin(c, &bad, 1, NULL), -EINVAL);
    ck_assert_int_eq(rekv_kvstore_unpin(c, r, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    /* errors */
    rekv_kv_range oob = {7, 0, 0, 51};
    ck_assert_int_eq(rekv_kvstore_plan(c, &oob, 1, 0, &pb, &n, &cap, NULL), -EINVAL);
    rekv_kv_range nolayer = {7, 2, 0, 1};
    ck_assert_int_eq(rekv_kvstore_plan(c, &nolayer, 1, 0, &pb, &n, &cap, NULL), -EINVAL);
    rekv_kv_range noseq = {8, 0, 0, 1};
    ck_assert_int_eq(rekv_kvstore_plan(c, &noseq, 1, 0, &pb, &n, &cap, NULL), -ENOENT);
    /* more than the arena and the spill tier hold together */
    ck_assert_int_eq(rekv_kvstore_append(c, 7, 1u << 20, 0, 0, NULL, &err), -ENOMEM);
    /* free the first block of layer 0: its range is gone, the rest stays */
    ck_assert_int_eq(rekv_kvstore_free(c, 7, 0, 1, 0, 1, NULL), 0);
    rekv_kv_range first = {7, 0, 0, 16};
    ck_assert_int_eq(rekv_kvstore_plan(c, &first, 1, 0, &pb, &n, &cap, NULL), -ENOENT);
    ck_assert_int_eq(rekv_kvstore_table(c, 7, 0, &t, &nb, NULL, NULL), 0);
    ck_assert_uint_eq(t[0].tier, REKV_KV_TIER_FREE);
    free(t);
    rekv_kv_range rest = {7, 0, 16, 37};
    ck_assert_int_eq(rekv_kvstore_plan(c, &rest, 1, 1, &pb, &n, &cap, NULL), 0);
    ck_assert(kvd_check(arena + pb[0].offset, kvd_type_bytes(c, pb[0].type), 7, 0, 1, 1));
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 7, NULL), 0); /* own pins do not block a drop */
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.free_slots, st.total_slots);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    free(pb);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* ------------------------------------------------------------------ spilling */

/* A block costs its type's bytes: with KV blocks of 8 KiB and ACT blocks of 4 KiB (MHA: the
 * activation is half of K and V), an ACT block takes a 4 KiB slot, so an arena holds twice the
 * tokens as ACT as it does as KV; the Stats reply counts the bytes. Then, with a spill tier, a
 * 1:1 mix larger than the arena spills and reads back both classes intact. */
START_TEST(test_act_costs_real_bytes)
{
    kvd d;
    /* 16 big slots of 8 KiB; no spill tier, so a full arena is out of memory */
    kvd_start(&d, 32, "--kv-heads 2 --head-dim 64 --hidden 128 --no-spill", 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(kvd_type_bytes(c, REKV_KV_BLOCK_KV), 8192);
    ck_assert_uint_eq(kvd_type_bytes(c, REKV_KV_BLOCK_ACT), 4096);
    ck_assert_uint_eq(st.kv_slot_bytes, 8192);
    ck_assert_uint_eq(st.act_slot_bytes, 4096);
    ck_assert_uint_eq(st.host_bytes, 16 * 8192);
    ck_assert_uint_eq(st.host_free_bytes, st.host_bytes);
    ck_assert_uint_eq(st.spill_bytes, 0);
    ck_assert_uint_ne(st.instance, 0);
    /* one ACT block per layer: 2 x 4 KiB */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 1, 16, 0, 1, NULL, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.host_used_bytes, 2 * 4096);
    ck_assert_uint_eq(st.host_free_bytes, st.host_bytes - 2 * 4096);
    ck_assert_uint_eq(st.free_slots, 15); /* both in one big slot */
    /* ACT blocks until the arena is full: 32 of them, 16 tokens each per layer */
    uint64_t nt = 16;
    while (rekv_kvstore_append(c, 1, 16, 0, 1, &nt, &err) == 0)
        ;
    ck_assert_ptr_nonnull(strstr(err.msg, "out of host memory"));
    ck_assert_uint_eq(nt, 16 * 16);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.host_act, 32);
    ck_assert_uint_eq(st.host_free_bytes, 0);
    kvd_write_blocks(c, 1, 0, 16, 1); /* the small slots do not overlap */
    kvd_verify_blocks(c, 1, 0, 16, 1);
    /* the same arena as KV holds half the tokens */
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.host_free_bytes, st.host_bytes);
    ck_assert_uint_eq(st.free_slots, 16);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    nt = 0;
    while (rekv_kvstore_append(c, 2, 16, 0, 0, &nt, &err) == 0)
        ;
    ck_assert_uint_eq(nt, 8 * 16);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    /* 1:1 (ACT first, then alternating): 11 blocks a layer (6 ACT, 5 KV) fill the 16 slots */
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 3, 10 * 16, 1, 1, NULL, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 3, 16, 1, 1, NULL, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.host_used_bytes, 2 * (5 * 8192 + 6 * 4096));
    ck_assert_uint_eq(st.host_free_bytes, 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 3, 16, 1, 1, NULL, NULL), -ENOMEM);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);

    /* with a spill tier: 48 blocks a layer of a 1:1 mix through 16 big slots */
    kvd_start(&d, 32, "--kv-heads 2 --head-dim 64 --hidden 128", 0);
    c = kvd_client(&d);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 4, NULL), 0);
    for (int i = 0; i < 6; i++) {
        ck_assert_int_eq(rekv_kvstore_append(c, 4, 8 * 16, 1, 1, NULL, &err), 0);
        kvd_write_blocks(c, 4, (uint64_t)i * 8, (uint64_t)i * 8 + 8, 7);
    }
    kvd_verify_blocks(c, 4, 0, 48, 7);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_gt(st.bytes_read_back, 0);
    ck_assert_uint_eq(st.crc_errors, 0);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* ------------------------------------------------------------------ random operations */

typedef struct model_seq {
    uint64_t id;
    uint64_t n_tokens;
    uint32_t *gen;  /* [2][cap] generation written per block, 0 = never written */
    uint8_t *freed; /* [2][cap] */
    int *pinned_by; /* [2][cap] client index holding a pin, -1 none */
    size_t cap;
    int live;
} model_seq;

/* Every block of m (a live sequence of the random ops' model: cap blocks a layer) that was
 * written and not freed holds what was written last: pinned, checked, unpinned. */
static void check_written_blocks(rekv_kvstore_client *c, uint8_t *arena, const model_seq *m,
                                 int cap, rekv_kv_plan_block **pb, size_t *pb_cap)
{
    if (!m->live)
        return;
    rekv_err err = {0};
    size_t n;
    for (uint32_t l = 0; l < 2; l++)
        for (uint64_t b = 0; b < (m->n_tokens + 15) / 16; b++) {
            if (m->freed[l * cap + b] || !m->gen[l * cap + b])
                continue;
            uint64_t t1 = (b + 1) * 16 < m->n_tokens ? (b + 1) * 16 : m->n_tokens;
            rekv_kv_range r = {m->id, l, b * 16, t1};
            int rc = rekv_kvstore_plan(c, &r, 1, 1, pb, &n, pb_cap, &err);
            ck_assert_msg(rc == 0, "final pin: %s", err.msg);
            ck_assert(kvd_check(arena + (*pb)[0].offset, kvd_type_bytes(c, (*pb)[0].type), m->id, l,
                                b, m->gen[l * cap + b]));
            ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
        }
}

START_TEST(test_random_ops)
{
    kvd d;
    kvd_start(&d, 96, "--lease-ms 60000", 0);
    enum { NC = 3, NS = 6, CAP = 64 };
    rekv_kvstore_client *cl[NC];
    for (int i = 0; i < NC; i++)
        cl[i] = kvd_client(&d);
    uint8_t *arena[NC];
    for (int i = 0; i < NC; i++)
        arena[i] = rekv_kvstore_client_arena(cl[i], NULL);
    model_seq ms[NS];
    memset(ms, 0, sizeof(ms));
    for (int s = 0; s < NS; s++) {
        ms[s].id = 100 + (uint64_t)s;
        ms[s].gen = calloc(2 * CAP, sizeof(uint32_t));
        ms[s].freed = calloc(2 * CAP, 1);
        ms[s].pinned_by = malloc(2 * CAP * sizeof(int));
        for (int i = 0; i < 2 * CAP; i++)
            ms[s].pinned_by[i] = -1;
    }
    srand(12345);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    rekv_err err = {0};
    uint32_t gen = 1;
    int verified = 0, ops = 3000;
    for (int op = 0; op < ops; op++) {
        int ci = rand() % NC, s = rand() % NS;
        rekv_kvstore_client *c = cl[ci];
        model_seq *m = &ms[s];
        int kind = rand() % 10;
        rekv_err_clear(&err);
        if (!m->live) {
            ck_assert_int_eq(rekv_kvstore_seq_create(c, m->id, &err), 0);
            m->live = 1;
            m->n_tokens = 0;
            memset(m->gen, 0, 2 * CAP * sizeof(uint32_t));
            memset(m->freed, 0, 2 * CAP);
            continue;
        }
        uint64_t nb = (m->n_tokens + 15) / 16;
        if (kind <= 2) { /* append */
            uint64_t add = 1 + (uint64_t)(rand() % 40);
            if ((m->n_tokens + add + 15) / 16 > CAP)
                continue;
            int rc = rekv_kvstore_append(c, m->id, add, 2, 1, NULL, &err);
            ck_assert_msg(rc == 0 || rc == -ENOMEM, "append: %s", err.msg);
            if (rc == 0)
                m->n_tokens += add;
        } else if (kind <= 6 && nb > 0) { /* pin a range, verify, maybe rewrite, unpin or keep */
            uint32_t l = (uint32_t)(rand() % 2);
            uint64_t b0 = (uint64_t)rand() % nb, b1 = b0 + 1 + (uint64_t)rand() % 6;
            if (b1 > nb)
                b1 = nb;
            int skip = 0;
            for (uint64_t b = b0; b < b1; b++)
                if (m->freed[l * CAP + b] || (m->pinned_by[l * CAP + b] >= 0))
                    skip = 1;
            if (skip)
                continue;
            uint64_t t1 = b1 * 16 < m->n_tokens ? b1 * 16 : m->n_tokens;
            rekv_kv_range r = {m->id, l, b0 * 16, t1};
            int rc = rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err);
            ck_assert_msg(rc == 0 || rc == -ENOMEM, "pin: %s", err.msg);
            if (rc < 0)
                continue;
            ck_assert_uint_eq(n, b1 - b0);
            int rewrite = rand() % 2;
            for (size_t i = 0; i < n; i++) {
                uint64_t b = pb[i].block;
                uint32_t gg = m->gen[l * CAP + b];
                size_t bytes = kvd_type_bytes(c, pb[i].type);
                if (gg) {
                    ck_assert_msg(kvd_check(arena[ci] + pb[i].offset, bytes, m->id, l, b, gg),
                                  "op %d: seq %llu layer %u block %llu (gen %u) corrupt", op,
                                  (unsigned long long)m->id, l, (unsigned long long)b, gg);
                    verified++;
                }
                if (rewrite || !gg) {
                    kvd_fill(arena[ci] + pb[i].offset, bytes, m->id, l, b, gen);
                    m->gen[l * CAP + b] = gen++;
                }
            }
            if (rand() % 4 == 0) {
                for (uint64_t b = b0; b < b1; b++)
                    m->pinned_by[l * CAP + b] = ci;
            } else {
                ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, &err), 0);
            }
        } else if (kind == 7) { /* release every pin this client keeps */
            for (int t = 0; t < NS; t++)
                for (uint32_t l = 0; l < 2; l++)
                    for (uint64_t b = 0; b < CAP; b++)
                        if (ms[t].live && ms[t].pinned_by[l * CAP + b] == ci) {
                            rekv_kv_range r = {ms[t].id, l, b * 16,
                                               (b + 1) * 16 < ms[t].n_tokens ? (b + 1) * 16
                                                                             : ms[t].n_tokens};
                            ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, &err), 0);
                            ms[t].pinned_by[l * CAP + b] = -1;
                        }
        } else if (kind == 8 && nb > 0) { /* free one block */
            uint32_t l = (uint32_t)(rand() % 2);
            uint64_t b = (uint64_t)rand() % nb;
            int other = m->pinned_by[l * CAP + b] >= 0 && m->pinned_by[l * CAP + b] != ci;
            int rc = rekv_kvstore_free(c, m->id, l, l + 1, b, b + 1, &err);
            ck_assert_int_eq(rc, other ? -EBUSY : 0);
            if (rc == 0) {
                m->freed[l * CAP + b] = 1;
                m->pinned_by[l * CAP + b] = -1;
            }
        } else if (kind == 9 && rand() % 8 == 0) { /* drop */
            int other = 0;
            for (int i = 0; i < 2 * CAP; i++)
                if (m->pinned_by[i] >= 0 && m->pinned_by[i] != ci)
                    other = 1;
            int rc = rekv_kvstore_seq_drop(c, m->id, &err);
            ck_assert_int_eq(rc, other ? -EBUSY : 0);
            if (rc == 0) {
                m->live = 0;
                for (int i = 0; i < 2 * CAP; i++)
                    m->pinned_by[i] = -1;
            }
        }
    }
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(cl[0], &st, NULL), 0);
    ck_assert_uint_gt(st.bytes_spilled, 0);
    ck_assert_uint_gt(st.bytes_read_back, 0);
    ck_assert_uint_eq(st.crc_errors, 0);
    ck_assert_int_gt(verified, 500);
    /* finally every written block of every live sequence, once more */
    for (int s = 0; s < NS; s++)
        check_written_blocks(cl[0], arena[0], &ms[s], CAP, &pb, &cap);
    for (int s = 0; s < NS; s++) {
        free(ms[s].gen);
        free(ms[s].freed);
        free(ms[s].pinned_by);
    }
    free(pb);
    for (int i = 0; i < NC; i++)
        rekv_kvstore_client_close(cl[i]);
    kvd_stop(&d);
}
END_TEST

/* ------------------------------------------------------------------ malformed messages */

START_TEST(test_fuzz_messages)
{
    kvd d;
    kvd_start(&d, 64, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 1, 100, 1, 1, NULL, NULL), 0);
    /* a few valid requests to mutate */
    uint8_t valid[4][256];
    size_t vlen[4];
    Rekv__Kvstore__Range rg = REKV__KVSTORE__RANGE__INIT, *rgp = &rg;
    rg.seq = 1;
    rg.layer = 1;
    rg.token_begin = 3;
    rg.token_end = 90;
    Rekv__Kvstore__Plan pl = REKV__KVSTORE__PLAN__INIT;
    pl.n_ranges = 1;
    pl.ranges = &rgp;
    Rekv__Kvstore__Append ap = REKV__KVSTORE__APPEND__INIT;
    ap.seq = 1;
    ap.n_tokens = 3;
    Rekv__Kvstore__Free fr = REKV__KVSTORE__FREE__INIT;
    fr.seq = 1;
    fr.layer_end = 2;
    fr.block_begin = 100;
    fr.block_end = 200;
    Rekv__Kvstore__GetTable gt = REKV__KVSTORE__GET_TABLE__INIT;
    gt.seq = 1;
    for (int i = 0; i < 4; i++) {
        Rekv__Kvstore__Request rq = REKV__KVSTORE__REQUEST__INIT;
        rq.version = REKV_KVSTORE_PROTO_VERSION;
        rq.id = 1000 + (uint64_t)i;
        if (i == 0) {
            rq.body_case = REKV__KVSTORE__REQUEST__BODY_PLAN;
            rq.plan = &pl;
        } else if (i == 1) {
            rq.body_case = REKV__KVSTORE__REQUEST__BODY_APPEND;
            rq.append = &ap;
        } else if (i == 2) {
            rq.body_case = REKV__KVSTORE__REQUEST__BODY_FREE;
            rq.free = &fr;
        } else {
            rq.body_case = REKV__KVSTORE__REQUEST__BODY_GET_TABLE;
            rq.get_table = &gt;
        }
        vlen[i] = rekv__kvstore__request__pack(&rq, valid[i]);
    }
    srand(777);
    int32_t status;
    char msg[256];
    int errors = 0;
    uint8_t buf[300];
    for (int it = 0; it < 3000; it++) {
        int v = rand() % 4;
        size_t len = vlen[v];
        memcpy(buf, valid[v], len);
        switch (it % 4) {
        case 0: /* truncate */
            len = (size_t)rand() % (len + 1);
            break;
        case 1: /* flip bytes */
            for (int k = 0; k < 1 + rand() % 4; k++)
                buf[rand() % len] ^= (uint8_t)(1 + rand() % 255);
            break;
        case 2: /* random garbage */
            len = (size_t)rand() % sizeof(buf);
            for (size_t k = 0; k < len; k++)
                buf[k] = (uint8_t)rand();
            break;
        default: /* append junk */
            for (int k = 0; k < 1 + rand() % 20 && len < sizeof(buf); k++)
                buf[len++] = (uint8_t)rand();
        }
        rekv_err err = {0};
        int rc = rekv_kvstore_client_raw(c, buf, len, &status, msg, sizeof(msg), &err);
        ck_assert_msg(rc == 0, "iteration %d: no reply: %s", it, err.msg);
        if (status != 0) {
            ck_assert_int_lt(status, 0);
            ck_assert_msg(msg[0] != '\0', "error reply without a message");
            errors++;
        }
    }
    ck_assert_int_gt(errors, 500);
    /* wrong version, no body */
    Rekv__Kvstore__Request rq = REKV__KVSTORE__REQUEST__INIT;
    rq.version = 99;
    size_t l = rekv__kvstore__request__pack(&rq, buf);
    ck_assert_int_eq(rekv_kvstore_client_raw(c, buf, l, &status, msg, sizeof(msg), NULL), 0);
    ck_assert_int_eq(status, -EPROTO);
    rq.version = 1;
    l = rekv__kvstore__request__pack(&rq, buf);
    ck_assert_int_eq(rekv_kvstore_client_raw(c, buf, l, &status, msg, sizeof(msg), NULL), 0);
    ck_assert_int_eq(status, -EBADMSG);
    /* a peer sending multi-part junk gets an error, the store keeps serving */
    void *zc = zmq_ctx_new(), *zs = zmq_socket(zc, ZMQ_DEALER);
    int zero = 0, tmo = 5000;
    zmq_setsockopt(zs, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(zs, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
    ck_assert_int_eq(zmq_connect(zs, d.endpoint), 0);
    for (int parts = 2; parts <= 6; parts++) {
        for (int k = 0; k < parts; k++)
            zmq_send(zs, valid[0], vlen[0], k + 1 < parts ? ZMQ_SNDMORE : 0);
        uint8_t rb[512];
        int got = zmq_recv(zs, rb, sizeof(rb), 0);
        ck_assert_int_gt(got, 0);
        Rekv__Kvstore__Response *resp = rekv__kvstore__response__unpack(NULL, (size_t)got, rb);
        ck_assert_ptr_nonnull(resp);
        ck_assert_int_eq(resp->status, -EPROTO);
        rekv__kvstore__response__free_unpacked(resp, NULL);
    }
    zmq_close(zs);
    zmq_ctx_term(zc);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_ge(st.sequences, 0);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstore_api");
    TCase *tc;
    tc = tcase_create("unit");
    tcase_add_test(tc, test_crc32c);
    tcase_add_test(tc, test_geometry_and_map);
    suite_add_tcase(s, tc);
    tc = tcase_create("daemon");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_api_basics);
    tcase_add_test(tc, test_act_costs_real_bytes);
    tcase_add_test(tc, test_random_ops);
    tcase_add_test(tc, test_fuzz_messages);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
