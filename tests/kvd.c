/* kvd.c — see kvd.h. */
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

#include "tests/kvd.h"
#include "tests/testutil.h"

const char *kvd_spill_fs;

void kvd_start(kvd *d, unsigned slots, const char *extra, rlim_t fsize)
{
    d->dir = tu_tmpdir();
    snprintf(d->endpoint, sizeof(d->endpoint), "ipc://%s/kv.sock", d->dir);
    snprintf(d->spill, sizeof(d->spill), "%s/spill", d->dir);
    ck_assert_int_eq(mkdir(d->spill, 0700), 0);
    if (kvd_spill_fs != NULL) { /* test_spill_eio_readback's file system */
        char cmd[8800], *out = NULL;
        snprintf(cmd, sizeof(cmd), "mount '%s' '%s' && rmdir '%s/lost+found' 2>&1", kvd_spill_fs,
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

void kvd_stop(kvd *d)
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

rekv_kvstore_client *kvd_client(kvd *d)
{
    rekv_kvstore_client *c = NULL;
    rekv_err err = {0};
    int rc = rekv_kvstore_client_connect(d->endpoint, NULL, 20000, &c, &err);
    ck_assert_msg(rc == 0, "connect: %s", err.msg);
    return c;
}

void kvd_fill(uint8_t *p, size_t n, uint64_t seq, uint32_t layer, uint64_t block, uint32_t gen)
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

int kvd_check(const uint8_t *p, size_t n, uint64_t seq, uint32_t layer, uint64_t block,
              uint32_t gen)
{
    uint8_t *want = malloc(n);
    kvd_fill(want, n, seq, layer, block, gen);
    int ok = memcmp(p, want, n) == 0;
    free(want);
    return ok;
}

size_t kvd_type_bytes(rekv_kvstore_client *c, uint32_t type)
{
    const rekv_kv_arena_header *h = rekv_kvstore_client_header(c);
    return type == REKV_KV_BLOCK_KV ? h->kv_block_bytes : h->act_block_bytes;
}

void kvd_write_blocks(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1, uint32_t gen)
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
                kvd_fill(arena + pb[i].offset, kvd_type_bytes(c, pb[i].type), seq, l, pb[i].block,
                         gen);
            ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
        }
    free(pb);
}

void kvd_verify_blocks(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1, uint32_t gen)
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
                ck_assert_msg(kvd_check(arena + pb[i].offset, kvd_type_bytes(c, pb[i].type), seq, l,
                                        pb[i].block, gen),
                              "seq %llu layer %u block %llu corrupt", (unsigned long long)seq, l,
                              (unsigned long long)pb[i].block);
            ck_assert_int_eq(rekv_kvstore_unpin(c, &r, 1, NULL), 0);
        }
    free(pb);
}
