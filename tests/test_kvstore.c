/* test_kvstore.c — the kvstore daemon and its client library, end to end: the real rekv-kvstore
 * process on real sockets in a temporary directory, real io_uring on real spill files. Covers
 * CRC32C vectors, the block geometry, the API, forced spilling with every byte verified (through
 * an O_DIRECT spill file wherever the filesystem takes it), a byte
 * flipped in the spill file (that block's read-back fails with a CRC error, the rest is intact),
 * a spill device that fails every read with EIO (in a virtual machine: tests/vm.sh),
 * thousands of random operations from several clients, a spill file that cannot grow
 * (RLIMIT_FSIZE), a
 * client killed with -9 while holding pins, one client used from two threads (a pin held past the
 * lease while the other thread renews), sequence owners (DropOwner, an owner's sequences dropped
 * with its lease), malformed messages, and a clean SIGTERM. Push (--push-backend cpu): copies
 * into a buffer this test exports land where asked and signal the event; malformed pushes
 * (pieces outside the arena or the buffer, garbage or short handles, a freed buffer) get clear
 * errors and the store keeps serving; a store without a push backend says so. */
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

uint32_t rekv_crc32c_sw(uint32_t crc, const void *buf, size_t n);

/* ------------------------------------------------------------------ daemon helpers */

typedef struct kvd {
    char *dir; /* private temp dir */
    char endpoint[4200];
    char spill[4200]; /* spill dir */
    pid_t pid;
} kvd;

/* A block device kvd_start mounts on the spill directory (NULL: none). */
static const char *g_spill_fs;

/* Starts rekv-kvstore with the test geometry (2 layers, 2 kv heads, head dim 32, hidden 64, f16:
 * KV block 4096 bytes, ACT block 2048) and `slots` host slots. fsize > 0 sets RLIMIT_FSIZE. */
static void kvd_start(kvd *d, unsigned slots, const char *extra, rlim_t fsize)
{
    d->dir = tu_tmpdir();
    snprintf(d->endpoint, sizeof(d->endpoint), "ipc://%s/kv.sock", d->dir);
    snprintf(d->spill, sizeof(d->spill), "%s/spill", d->dir);
    ck_assert_int_eq(mkdir(d->spill, 0700), 0);
    if (g_spill_fs != NULL) { /* test_spill_eio_readback's file system */
        char cmd[8800], *out = NULL;
        snprintf(cmd, sizeof(cmd), "mount '%s' '%s' && rmdir '%s/lost+found' 2>&1", g_spill_fs,
                 d->spill, d->spill);
        ck_assert_msg(tu_run(cmd, &out) == 0, "%s: %s", cmd, out);
        free(out);
    }
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    char host[64], ready[32];
    snprintf(host, sizeof(host), "%u", 4096 + slots * 4096);
    snprintf(ready, sizeof(ready), "%d", pfd[1]);
    const char *args[40] = {tu_bin("rekv-kvstore"),
                            "--endpoint",
                            d->endpoint,
                            "--host-bytes",
                            host,
                            "--spill-dir",
                            d->spill,
                            "--layers",
                            "2",
                            "--kv-heads",
                            "2",
                            "--head-dim",
                            "32",
                            "--hidden",
                            "64",
                            "--ready-fd",
                            ready};
    int na = 17;
    char extra_buf[512];
    if (extra) {
        snprintf(extra_buf, sizeof(extra_buf), "%s", extra);
        for (char *t = strtok(extra_buf, " "); t && na < 38; t = strtok(NULL, " "))
            args[na++] = t;
    }
    args[na] = NULL;
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        if (fsize > 0) {
            struct rlimit rl = {fsize, fsize};
            setrlimit(RLIMIT_FSIZE, &rl);
        }
        signal(SIGXFSZ, SIG_IGN);
        execv(args[0], (char **)args);
        _exit(127);
    }
    close(pfd[1]);
    struct pollfd p = {.fd = pfd[0], .events = POLLIN};
    ck_assert_msg(poll(&p, 1, 10000) == 1, "rekv-kvstore did not become ready");
    char buf[16] = {0};
    ck_assert_int_eq(read(pfd[0], buf, sizeof(buf) - 1), 6);
    ck_assert_str_eq(buf, "READY\n");
    close(pfd[0]);
    d->pid = pid;
}

/* SIGTERM, expect a clean exit, then check nothing is left behind. */
static void kvd_stop(kvd *d)
{
    ck_assert_int_eq(kill(d->pid, SIGTERM), 0);
    int st;
    ck_assert_int_eq(waitpid(d->pid, &st, 0), d->pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "daemon exit status %d", st);
    /* spill dir empty, no socket files left */
    DIR *dir = opendir(d->spill);
    ck_assert_ptr_nonnull(dir);
    struct dirent *e;
    int n = 0;
    while ((e = readdir(dir)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            n++;
    closedir(dir);
    ck_assert_int_eq(n, 0);
    dir = opendir(d->dir);
    n = 0;
    while ((e = readdir(dir)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "spill"))
            n++;
    closedir(dir);
    ck_assert_msg(n == 0, "socket files left behind in %s", d->dir);
    tu_rmrf(d->dir);
    free(d->dir);
}

static rekv_kvstore_client *kvd_client(kvd *d)
{
    rekv_kvstore_client *c = NULL;
    rekv_err err = {0};
    int rc = rekv_kvstore_client_connect(d->endpoint, NULL, 20000, &c, &err);
    ck_assert_msg(rc == 0, "connect: %s", err.msg);
    return c;
}

/* Deterministic contents of block (seq, layer, block) at generation gen. */
static void fill(uint8_t *p, size_t n, uint64_t seq, uint32_t layer, uint64_t block, uint32_t gen)
{
    uint64_t x = (seq * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)layer << 48) ^ (block << 20) ^ gen;
    x |= 1;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(p + i, &x, n - i < 8 ? n - i : 8);
    }
}

static int check(const uint8_t *p, size_t n, uint64_t seq, uint32_t layer, uint64_t block,
                 uint32_t gen)
{
    uint8_t *want = malloc(n);
    fill(want, n, seq, layer, block, gen);
    int ok = memcmp(p, want, n) == 0;
    free(want);
    return ok;
}

static size_t type_bytes(rekv_kvstore_client *c, uint32_t type)
{
    const rekv_kv_arena_header *h = rekv_kvstore_client_header(c);
    return type == REKV_KV_BLOCK_KV ? h->kv_block_bytes : h->act_block_bytes;
}

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
    fill(buf, sizeof(buf), 1, 2, 3, 4);
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
        fill(arena + pb[i].offset, type_bytes(c, pb[i].type), 7, r[pb[i].range].layer, pb[i].block,
             1);
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
    ck_assert(check(arena + pb[0].offset, type_bytes(c, pb[0].type), 7, 0, 1, 1));
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

/* Writes every block of seq in [b0, b1) of all layers, pinning a few at a time. */
static void write_blocks(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1,
                         uint32_t gen)
{
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    rekv_err err = {0};
    for (uint32_t l = 0; l < 2; l++)
        for (uint64_t b = b0; b < b1; b += 4) {
            uint64_t e = b + 4 < b1 ? b + 4 : b1;
            rekv_kv_range r = {seq, l, b * 16, e * 16};
            int rc = rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err);
            ck_assert_msg(rc == 0, "pin: %s", err.msg);
            for (size_t i = 0; i < n; i++)
                fill(arena + pb[i].offset, type_bytes(c, pb[i].type), seq, l, pb[i].block, gen);
            ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
        }
    free(pb);
}

static void verify_blocks(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1,
                          uint32_t gen)
{
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    rekv_err err = {0};
    for (uint32_t l = 0; l < 2; l++)
        for (uint64_t b = b0; b < b1; b += 8) {
            uint64_t e = b + 8 < b1 ? b + 8 : b1;
            rekv_kv_range r = {seq, l, b * 16, e * 16};
            int rc = rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err);
            ck_assert_msg(rc == 0, "pin: %s", err.msg);
            for (size_t i = 0; i < n; i++)
                ck_assert_msg(check(arena + pb[i].offset, type_bytes(c, pb[i].type), seq, l,
                                    pb[i].block, gen),
                              "seq %llu layer %u block %llu corrupt", (unsigned long long)seq, l,
                              (unsigned long long)pb[i].block);
            ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
        }
    free(pb);
}

/* Waits until the store has no spill I/O in flight (read-ahead's reads started and done). */
static void settle(rekv_kvstore_client *c)
{
    rekv_kv_stats st;
    for (;;) { /* Check's timeout is the guard */
        ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
        if (st.reads_in_flight == 0 && st.spills_in_flight == 0)
            return;
        usleep(1000);
    }
}

/* A sweep over layer windows, as a step bigger than the arena pins them: 16 windows of 4 KV blocks
 * (8 sequences x 2 layers) on a 32-slot arena, five sweeps, each window pinned with the next one
 * read ahead and unpinned as done. With the store's I/O settled between windows (the compute
 * time a real step gives it), only the first window ever waits for a read; and since the store
 * spills the windows just done rather than the least recently used (the next ones), a sweep
 * finds a part of its blocks still in memory. Every block is checked on every pin. */
static void sweep(int ahead, rekv_kv_stats *out)
{
    kvd d;
    kvd_start(&d, 32, NULL, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    enum { SEQS = 8, WIN = SEQS * 2, SWEEPS = 5 };
    rekv_kv_range w[WIN];
    for (int i = 0; i < WIN; i++)
        w[i] = (rekv_kv_range){(uint64_t)(i / 2 + 1), (uint32_t)(i % 2), 0, 64};
    for (uint64_t s = 1; s <= SEQS; s++) {
        ck_assert_int_eq(rekv_kvstore_seq_create(c, s, NULL), 0);
        ck_assert_msg(rekv_kvstore_append(c, s, 64, 0, 0, NULL, &err) == 0, "%s", err.msg);
        write_blocks(c, s, 0, 4, (uint32_t)s);
    }
    settle(c);
    rekv_kv_stats st0;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st0, NULL), 0);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    for (int k = 0; k < SWEEPS * WIN; k++) {
        const rekv_kv_range *r = &w[k % WIN], *next = &w[(k + 1) % WIN];
        int rc = rekv_kvstore_pin_ahead(c, r, 1, next, ahead, &pb, &n, &cap, &err);
        ck_assert_msg(rc == 0, "pin: %s", err.msg);
        ck_assert_uint_eq(n, 4);
        for (size_t i = 0; i < n; i++)
            ck_assert_msg(
                check(arena + pb[i].offset, 4096, r->seq, r->layer, pb[i].block, (uint32_t)r->seq),
                "window %d block %zu corrupt", k, i);
        settle(c);
        ck_assert_int_eq(rekv_kvstore_unpin_done(c, r, 1, NULL), 0);
    }
    free(pb);
    ck_assert_int_eq(rekv_kvstore_stats(c, out, NULL), 0);
    out->pin_wait_blocks -= st0.pin_wait_blocks;
    out->read_ahead_blocks -= st0.read_ahead_blocks;
    out->bytes_read_back -= st0.bytes_read_back;
    out->pin_misses -= st0.pin_misses;
    ck_assert_uint_eq(out->crc_errors, 0);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}

START_TEST(test_sweep_read_ahead)
{
    rekv_kv_stats on, off;
    sweep(1, &on);
    sweep(0, &off);
    uint64_t reads = on.bytes_read_back / 4096;
    fprintf(stderr,
            "   sweep: read-ahead on: %llu read back, %llu ahead, %llu waited for; off: %llu "
            "read back, %llu waited for\n",
            (unsigned long long)reads, (unsigned long long)on.read_ahead_blocks,
            (unsigned long long)on.pin_wait_blocks,
            (unsigned long long)(off.bytes_read_back / 4096),
            (unsigned long long)off.pin_wait_blocks);
    /* on: the first window (4 blocks) at most waits; everything else was read ahead */
    ck_assert_uint_le(on.pin_wait_blocks, 4);
    ck_assert_uint_eq(on.read_ahead_blocks + on.pin_misses, reads);
    ck_assert_uint_ge(on.read_ahead_blocks, reads - 4);
    /* off: every read-back is a pin's */
    ck_assert_uint_eq(off.read_ahead_blocks, 0);
    ck_assert_uint_eq(off.pin_wait_blocks * 4096, off.bytes_read_back);
    /* eviction: 64 blocks swept through 32 slots; spilling the windows just done keeps about
     * the arena less the windows in flight in memory from one sweep to the next, about 16 blocks
     * (LRU would spill exactly the blocks needed next and read all 64 every sweep) */
    ck_assert_uint_le(off.bytes_read_back / 4096, 5 * (64 - 8));
    ck_assert_uint_le(reads, 5 * (64 - 8));
}
END_TEST

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
    ck_assert_uint_eq(type_bytes(c, REKV_KV_BLOCK_KV), 8192);
    ck_assert_uint_eq(type_bytes(c, REKV_KV_BLOCK_ACT), 4096);
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
    write_blocks(c, 1, 0, 16, 1); /* the small slots do not overlap */
    verify_blocks(c, 1, 0, 16, 1);
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
        write_blocks(c, 4, (uint64_t)i * 8, (uint64_t)i * 8 + 8, 7);
    }
    verify_blocks(c, 4, 0, 48, 7);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_gt(st.bytes_read_back, 0);
    ck_assert_uint_eq(st.crc_errors, 0);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* The store's metrics port against its Stats reply: the same bytes and blocks, the spill I/O
 * histograms' counts as the spill write and read counters, and a clean promtool check. */
/* The numbers a scrape and a Stats reply share; background spilling may still change them. */
static void shared_numbers(const rekv_kv_stats *st, uint64_t out[14])
{
    const uint64_t v[14] = {st->host_kv,         st->host_act,         st->disk_kv,
                            st->disk_act,        st->free_slots,       st->bytes_spilled,
                            st->bytes_read_back, st->pin_misses,       st->crc_errors,
                            st->spill_errors,    st->spills_in_flight, st->reads_in_flight,
                            st->hists[4].count,  st->hists[5].count};
    memcpy(out, v, sizeof(v));
}

static void check_metrics_match_stats(int port, rekv_kvstore_client *c)
{
    /* a scrape between two equal Stats replies with no spill I/O in flight: the store was still
     * (nothing else talks to it), so the scrape saw what they say */
    rekv_kv_stats st, st2;
    char *m = NULL;
    uint64_t a[14], b[14];
    for (;;) { /* until it settles; Check's timeout is the guard */
        ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
        if (st.spills_in_flight || st.reads_in_flight) {
            usleep(10000);
            continue;
        }
        m = ms_scrape(port);
        ck_assert_int_eq(rekv_kvstore_stats(c, &st2, NULL), 0);
        shared_numbers(&st, a);
        shared_numbers(&st2, b);
        if (memcmp(a, b, sizeof(a)) == 0)
            break;
        free(m);
        usleep(10000);
    }
    uint64_t slot = rekv_kvstore_client_header(c)->slot_bytes;
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_arena_size_bytes"),
                        (double)(st.total_slots * slot));
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_arena_used_bytes"),
                        (double)((st.total_slots - st.free_slots) * slot));
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_spill_used_bytes"),
                        (double)((st.disk_kv + st.disk_act) * slot));
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_blocks{tier=\"disk\",type=\"kv\"}"),
                        (double)st.disk_kv);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_blocks{tier=\"host\",type=\"act\"}"),
                        (double)st.host_act);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_spill_written_bytes_total"),
                        (double)st.bytes_spilled);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_spill_read_bytes_total"),
                        (double)st.bytes_read_back);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_crc_errors_total"), (double)st.crc_errors);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_read_errors_total"), (double)st.read_errors);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_spill_errors_total"), (double)st.spill_errors);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_pins_total{result=\"miss\"}"),
                        (double)st.pin_misses);
    uint64_t writes = 0, reads = 0;
    for (int i = 0; i < 8; i++) {
        if (strcmp(st.hists[i].name, "spill_write") == 0)
            writes = st.hists[i].count;
        if (strcmp(st.hists[i].name, "spill_read") == 0)
            reads = st.hists[i].count;
    }
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_spill_writes_total"), (double)writes);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_spill_reads_total"), (double)reads);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_spill_io_seconds_count{op=\"write\"}"),
                        (double)writes);
    ck_assert_double_eq(
        ms_value(m, "rekv_kvstore_spill_io_seconds_bucket{op=\"read\",le=\"+Inf\"}"),
        (double)reads);
    ms_promtool(m);
    free(m);
}

/* The open flags (/proc/PID/fdinfo) of the daemon's spill file; -1 when it has none open. */
static long spill_file_flags(const kvd *d)
{
    int n = tu_spill_fd_number(d->pid, d->spill);
    long flags = -1;
    char path[64], line[128];
    snprintf(path, sizeof(path), "/proc/%d/fdinfo/%d", (int)d->pid, n);
    FILE *f = n >= 0 ? fopen(path, "r") : NULL;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "flags: %lo", &flags) == 1)
            break;
    if (f)
        fclose(f);
    return flags;
}

/* Whether the filesystem of dir takes O_DIRECT (a probe file, removed). */
static int dir_takes_o_direct(const char *dir)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/o_direct_probe", dir);
    int fd = open(path, O_CREAT | O_RDWR | O_DIRECT, 0600);
    if (fd >= 0) {
        close(fd);
        unlink(path);
    }
    return fd >= 0;
}

START_TEST(test_spill_readback)
{
    kvd d;
    int port = ms_free_port();
    char extra[64];
    snprintf(extra, sizeof(extra), "--metrics 127.0.0.1:%d", port);
    kvd_start(&d, 48, extra, 0); /* 48 slots; we store 4 x 2 x 40 = 320 blocks */
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    for (uint64_t s = 1; s <= 4; s++) {
        ck_assert_int_eq(rekv_kvstore_seq_create(c, s, NULL), 0);
        for (int k = 0; k < 10; k++) {
            int rc = rekv_kvstore_append(c, s, 64, s % 2 ? 3 : 0, s % 2 ? 1 : 0, NULL, &err);
            ck_assert_msg(rc == 0, "append: %s", err.msg);
            write_blocks(c, s, (uint64_t)k * 4, (uint64_t)k * 4 + 4, (uint32_t)s);
        }
    }
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_gt(st.disk_kv + st.disk_act, 200);
    ck_assert_uint_gt(st.bytes_spilled, 0);
    for (uint64_t s = 1; s <= 4; s++)
        verify_blocks(c, s, 0, 40, (uint32_t)s);
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_gt(st.bytes_read_back, 0);
    ck_assert_uint_gt(st.pin_misses, 0);
    ck_assert_uint_eq(st.crc_errors, 0);
    ck_assert_uint_eq(st.spill_errors, 0);
    ck_assert_uint_eq(st.host_kv + st.host_act + st.disk_kv + st.disk_act, 320);
    /* the spill I/O bypasses the page cache (O_DIRECT) wherever the filesystem takes it */
    long flags = spill_file_flags(&d);
    ck_assert_msg(flags >= 0, "no spill file among the daemon's open files");
    int direct = dir_takes_o_direct(d.spill);
    ck_assert_msg(((flags & O_DIRECT) != 0) == direct, "spill file flags %lo: O_DIRECT %s, but %s",
                  flags, flags & O_DIRECT ? "set" : "not set",
                  direct ? "the filesystem takes it" : "the filesystem refuses it");
    /* the metrics port says the same; every block spilled and read back counts */
    check_metrics_match_stats(port, c);
    char *m = ms_scrape(port);
    ck_assert_double_ge(ms_value(m, "rekv_kvstore_spill_writes_total"), 200);
    ck_assert_double_gt(ms_value(m, "rekv_kvstore_spill_reads_total"), 0);
    ck_assert_double_gt(ms_value(m, "rekv_kvstore_spill_read_bytes_total"), 0);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_crc_errors_total"), 0);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_clients"), 1);
    free(m);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* The spill file of the daemon d, opened read-write. */
static int spill_file_fd(kvd *d)
{
    int fd = tu_spill_fd(d->pid, d->spill);
    ck_assert_msg(fd >= 0, "no spill file among the daemon's open files");
    return fd;
}

/* A store that has not spilled has not registered its arena with io_uring: registering pins, and
 * so faults in, every page (~0.4 s per 256 MiB here, and all of a 64 GiB arena's memory before
 * the first request). A 256 MiB arena with a few blocks written holds a few MiB. */
START_TEST(test_arena_untouched_until_spill)
{
    kvd d;
    kvd_start(&d, 65536, NULL, 0); /* 256 MiB of slots */
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 1, 64, 0, 0, NULL, &err), 0);
    write_blocks(c, 1, 0, 4, 1);
    verify_blocks(c, 1, 0, 4, 1);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_int_eq(st.registered_arena, 0);
    long kb = tu_proc_status_kb(d.pid, "RssShmem");
    ck_assert_msg(kb >= 0 && kb < 32 * 1024, "the idle store holds %ld kB of its arena", kb);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* Sequence 1 (4 blocks a layer) written first, then sequences 2-4 (40 blocks a layer each) into
 * a 48-slot store, so that sequence 1 is spilled once and never read back; returns the file slot
 * of one of its blocks (found by content: each has one copy) and that block's layer and number. */
static int64_t spill_seq1(kvd *d, rekv_kvstore_client *c, uint32_t *layer, uint64_t *block)
{
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 1, 64, 0, 0, NULL, &err), 0);
    write_blocks(c, 1, 0, 4, 1);
    for (uint64_t s = 2; s <= 4; s++) {
        ck_assert_int_eq(rekv_kvstore_seq_create(c, s, NULL), 0);
        for (int k = 0; k < 10; k++) {
            int rc = rekv_kvstore_append(c, s, 64, 0, 0, NULL, &err);
            ck_assert_msg(rc == 0, "append: %s", err.msg);
            write_blocks(c, s, (uint64_t)k * 4, (uint64_t)k * 4 + 4, (uint32_t)s);
        }
    }
    size_t slot = rekv_kvstore_client_header(c)->slot_bytes;
    size_t kvb = type_bytes(c, REKV_KV_BLOCK_KV);
    int fd = spill_file_fd(d);
    uint8_t *buf = malloc(slot), *want = malloc(kvb);
    int64_t at = -1;
    while (at < 0) { /* until the store has spilled one; Check's timeout is the guard */
        struct stat st;
        ck_assert_int_eq(fstat(fd, &st), 0);
        for (int64_t f = 0; at < 0 && (f + 1) * (int64_t)slot <= st.st_size; f++) {
            if (pread(fd, buf, slot, f * (off_t)slot) != (ssize_t)slot)
                continue;
            for (uint32_t l = 0; l < 2 && at < 0; l++)
                for (uint64_t b = 0; b < 4 && at < 0; b++) {
                    fill(want, kvb, 1, l, b, 1);
                    if (memcmp(buf, want, kvb) == 0) {
                        at = f;
                        *layer = l;
                        *block = b;
                    }
                }
        }
        if (at < 0)
            usleep(10000);
    }
    close(fd);
    free(buf);
    free(want);
    return at;
}

/* One flipped byte in the spill file, in a block of sequence 1: reading that block back fails
 * with a CRC32C error (again on a second try: the block is lost, never handed out), every other
 * block of sequence 1 and every block of sequences 2-4 comes back intact, and the store counts
 * one CRC error. Which file slot holds which block is found by content (sequence 1 is written
 * first, spilled once and never read back before the flip, so each of its blocks has one copy). */
START_TEST(test_spill_corrupt_readback)
{
    kvd d;
    int port = ms_free_port();
    char extra[64];
    snprintf(extra, sizeof(extra), "--metrics 127.0.0.1:%d", port);
    kvd_start(&d, 48, extra, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    uint32_t bad_layer = 0;
    uint64_t bad_block = 0;
    int64_t at = spill_seq1(&d, c, &bad_layer, &bad_block);
    size_t slot = rekv_kvstore_client_header(c)->slot_bytes;
    size_t kvb = type_bytes(c, REKV_KV_BLOCK_KV);
    int fd = spill_file_fd(&d);
    uint8_t byte;
    off_t off = (off_t)at * (off_t)slot + 100;
    ck_assert_int_eq(pread(fd, &byte, 1, off), 1);
    byte ^= 0xff;
    ck_assert_int_eq(pwrite(fd, &byte, 1, off), 1);
    ck_assert_int_eq(fdatasync(fd), 0);
    close(fd);

    /* sequence 1, block by block */
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t l = 0; l < 2; l++)
            for (uint64_t b = 0; b < 4; b++) {
                rekv_kv_range r = {1, l, b * 16, (b + 1) * 16};
                rekv_err_clear(&err);
                int rc = rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err);
                if (l == bad_layer && b == bad_block) {
                    ck_assert_msg(rc < 0, "the corrupt block was handed out");
                    ck_assert_msg(strstr(err.msg, "CRC32C mismatch") &&
                                      strstr(err.msg, "sequence 1"),
                                  "error: %s", err.msg);
                    continue;
                }
                ck_assert_msg(rc == 0, "layer %u block %llu: %s", l, (unsigned long long)b,
                              err.msg);
                ck_assert_uint_eq(n, 1);
                ck_assert_msg(check(arena + pb[0].offset, kvb, 1, l, b, 1),
                              "seq 1 layer %u block %llu corrupt", l, (unsigned long long)b);
                ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
            }
    free(pb);
    for (uint64_t s = 2; s <= 4; s++)
        verify_blocks(c, s, 0, 40, (uint32_t)s);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.crc_errors, 1);
    ck_assert_uint_eq(st.spill_errors, 0);
    /* the metrics port counts the one CRC error (the block is lost: asked twice, read once) */
    check_metrics_match_stats(port, c);
    char *m = ms_scrape(port);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_crc_errors_total"), 1);
    free(m);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
}
END_TEST

/* RLIMIT_FSIZE on the daemon limits every file it grows, the memfd arena included, so the limit
 * is the arena's size: the spill file may then hold 33 slots and writes beyond fail with EFBIG.
 * The append that needed room gets a clear -ENOMEM; nothing stored is lost. */
START_TEST(test_spill_file_full)
{
    kvd d;
    kvd_start(&d, 32, "--no-register-arena", 33 * 4096);
    rekv_kvstore_client *c = kvd_client(&d);
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 1, NULL), 0);
    uint64_t blocks = 0;
    int rc = 0;
    for (int k = 0; k < 60; k++) {
        rekv_err_clear(&err);
        rc = rekv_kvstore_append(c, 1, 32, 0, 0, NULL, &err); /* 2 blocks x 2 layers */
        if (rc < 0)
            break;
        write_blocks(c, 1, blocks, blocks + 2, 9);
        blocks += 2;
    }
    ck_assert_int_eq(rc, -ENOMEM);
    ck_assert_msg(strstr(err.msg, "out of host memory") && strstr(err.msg, "File too large"),
                  "error: %s", err.msg);
    ck_assert_uint_ge(blocks, 32);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_gt(st.spill_errors, 0);
    ck_assert_uint_le(st.disk_kv, 33);
    ck_assert_uint_gt(st.disk_kv, 0);
    /* every stored byte is intact, the ones on disk included */
    verify_blocks(c, 1, 0, blocks, 9);
    /* dropping frees room: the store serves again */
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(c, 2, 64, 0, 0, NULL, &err), 0);
    write_blocks(c, 2, 0, 4, 3);
    verify_blocks(c, 2, 0, 4, 3);
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
                size_t bytes = type_bytes(c, pb[i].type);
                if (gg) {
                    ck_assert_msg(check(arena[ci] + pb[i].offset, bytes, m->id, l, b, gg),
                                  "op %d: seq %llu layer %u block %llu (gen %u) corrupt", op,
                                  (unsigned long long)m->id, l, (unsigned long long)b, gg);
                    verified++;
                }
                if (rewrite || !gg) {
                    fill(arena[ci] + pb[i].offset, bytes, m->id, l, b, gen);
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
    for (int s = 0; s < NS; s++) {
        model_seq *m = &ms[s];
        if (!m->live)
            continue;
        for (uint32_t l = 0; l < 2; l++)
            for (uint64_t b = 0; b < (m->n_tokens + 15) / 16; b++) {
                if (m->freed[l * CAP + b] || !m->gen[l * CAP + b])
                    continue;
                uint64_t t1 = (b + 1) * 16 < m->n_tokens ? (b + 1) * 16 : m->n_tokens;
                rekv_kv_range r = {m->id, l, b * 16, t1};
                int rc = rekv_kvstore_plan(cl[0], &r, 1, 1, &pb, &n, &cap, &err);
                ck_assert_msg(rc == 0, "final pin: %s", err.msg);
                ck_assert(check(arena[0] + pb[0].offset, type_bytes(cl[0], pb[0].type), m->id, l, b,
                                m->gen[l * CAP + b]));
                ck_assert_int_eq(rekv_kvstore_unpin(cl[0], &r, 1, NULL), 0);
            }
    }
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
    uint64_t expired;        /* leases expired before the step */
    int failures;            /* requests that failed */
    volatile int holding;    /* set while the step holds its first pin past a lease */
    volatile int done;       /* set by the step thread when it is over */
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
static void push_gate(void *arg) { sem_wait(arg); }

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
        fill(arena + pb[i].offset, 4096, 3, 1, i, 1);
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
    ck_assert(check(buf + 100, 4096, 3, 1, 1, 1));
    uint8_t *want = malloc(4096);
    fill(want, 4096, 3, 1, 0, 1);
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
    ck_assert(check(buf + 100, 4096, 3, 1, 1, 1));

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

    /* a store without a push backend says so */
    kvd_start(&d, 64, NULL, 0);
    c = kvd_client(&d);
    rekv_err_clear(&err);
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

/* ------------------------------------------------ EIO: a spill device that fails */

/* A real block device that fails under the spill file: in a virtual machine (tests/vm.sh with a
 * disk), the spill directory is an ext4 on a device-mapper device; once sequence 1 is spilled the
 * device's table is swapped for dm's `error` target, so every read of it returns EIO from the
 * kernel. Reading sequence 1 back then fails with a clear error naming the sequence and the I/O
 * error — never a block handed out with wrong bytes — and blocks still in memory (the last ones
 * written) come back intact; the store keeps serving (stats). On the host this test boots the
 * machine and runs itself there (REKV_TEST_EIO_DISK names the disk); skipped, saying why, where a
 * machine cannot boot — a failure instead when CI=true. */
START_TEST(test_spill_eio_readback)
{
    const char *disk = getenv("REKV_TEST_EIO_DISK");
    if (disk == NULL) {
        char *w = tu_tmpdir();
        if (tu_vm_self(w, "REKV_TEST_EIO_DISK=/dev/vda", "kvstore", "eio")) {
            char *grc = tu_vm_out(w, "rc"), *log = tu_vm_out(w, "log");
            ck_assert_msg(strcmp(grc, "0\n") == 0 &&
                              strstr(log, "100%: Checks: 1, Failures: 0, Errors: 0"),
                          "in the machine, the test failed (exit '%s'):\n%s", grc, tu_log_end(log));
            free(grc);
            free(log);
        }
        tu_rmrf(w);
        free(w);
        return;
    }
    /* in the machine, as root */
    char cmd[4096];
    snprintf(cmd, sizeof(cmd),
             "modprobe dm_mod && dmsetup create rekv-eio --table \"0 $(blockdev --getsz %s) "
             "linear %s 0\" && mkfs.ext4 -q /dev/mapper/rekv-eio",
             disk, disk);
    tu_run_ok(cmd);
    g_spill_fs = "/dev/mapper/rekv-eio";
    kvd d;
    kvd_start(&d, 48, NULL, 0);
    g_spill_fs = NULL;
    long fl = spill_file_flags(&d);
    ck_assert_msg(fl >= 0 && (fl & O_DIRECT), "the spill file on ext4 is not O_DIRECT: "
                                              "reads could come from the page cache");
    rekv_kvstore_client *c = kvd_client(&d);
    uint32_t layer = 0;
    uint64_t block = 0;
    (void)spill_seq1(&d, c, &layer, &block);
    tu_run_ok("dmsetup suspend rekv-eio && dmsetup load rekv-eio --table \"0 $(blockdev --getsz "
              "/dev/mapper/rekv-eio) error\" && dmsetup resume rekv-eio");

    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    size_t kvb = type_bytes(c, REKV_KV_BLOCK_KV);
    rekv_kv_plan_block *pb = NULL;
    size_t n, cap = 0;
    rekv_err err = {0};
    int failed = 0;
    for (uint32_t l = 0; l < 2; l++)
        for (uint64_t b = 0; b < 4; b++) {
            rekv_kv_range r = {1, l, b * 16, (b + 1) * 16};
            rekv_err_clear(&err);
            int rc = rekv_kvstore_plan(c, &r, 1, 1, &pb, &n, &cap, &err);
            if (rc < 0) {
                ck_assert_msg(strstr(err.msg, "Input/output error") &&
                                  strstr(err.msg, "sequence 1"),
                              "layer %u block %llu: %s", l, (unsigned long long)b, err.msg);
                failed++;
                continue;
            }
            ck_assert_msg(l != layer || b != block, "a block read from a failed device was "
                                                    "handed out");
            ck_assert_msg(check(arena + pb[0].offset, kvb, 1, l, b, 1),
                          "seq 1 layer %u block %llu corrupt", l, (unsigned long long)b);
            ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
        }
    free(pb);
    ck_assert_int_ge(failed, 1);
    /* the last blocks written are in memory, and the store serves */
    verify_blocks(c, 4, 36, 40, 4);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(c, &st, NULL), 0);
    ck_assert_uint_eq(st.crc_errors, 0);
    ck_assert_uint_ge(st.read_errors, (uint64_t)failed); /* counted, not only logged */
    rekv_kvstore_client_close(c);
    ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
    int ws;
    ck_assert_int_eq(waitpid(d.pid, &ws, 0), d.pid);
    ck_assert_msg(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "daemon exit status %d", ws);
    char fin[4400];
    snprintf(fin, sizeof(fin), "umount -l '%s'; dmsetup remove --force rekv-eio", d.spill);
    (void)tu_run(fin, NULL);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstore");
    TCase *tc = tcase_create("unit");
    tcase_add_test(tc, test_crc32c);
    tcase_add_test(tc, test_geometry_and_map);
    suite_add_tcase(s, tc);
    /* a virtual machine boots (emulated: about a minute on two cores, more when loaded) */
    tc = tcase_create("eio");
    tcase_set_timeout(tc, 900);
    tcase_add_test(tc, test_spill_eio_readback);
    suite_add_tcase(s, tc);
    tc = tcase_create("daemon");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_api_basics);
    tcase_add_test(tc, test_spill_readback);
    tcase_add_test(tc, test_arena_untouched_until_spill);
    tcase_add_test(tc, test_sweep_read_ahead);
    tcase_add_test(tc, test_act_costs_real_bytes);
    tcase_add_test(tc, test_spill_corrupt_readback);
    tcase_add_test(tc, test_spill_file_full);
    tcase_add_test(tc, test_random_ops);
    tcase_add_test(tc, test_killed_client_loses_pins);
    tcase_add_test(tc, test_renew_from_another_thread);
    tcase_add_test(tc, test_drop_owner);
    tcase_add_test(tc, test_owner_lease_expiry);
    tcase_add_test(tc, test_fuzz_messages);
    tcase_add_test(tc, test_push);
    tcase_add_test(tc, test_push_link);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
