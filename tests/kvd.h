/* kvd.h — a rekv-kvstore daemon for the kvstore suites
 * (test_kvstore_*.c): started with the test geometry in a private temporary directory, stopped
 * with SIGTERM and checked to leave nothing behind; deterministic block contents. */
#ifndef REKV_TESTS_KVD_H
#define REKV_TESTS_KVD_H

#include <stdint.h>
#include <sys/resource.h>
#include <sys/types.h>
#include "kvstore/kvstore.h"

typedef struct kvd {
    char *dir; /* private temp dir */
    char endpoint[4200];
    char spill[4200]; /* spill dir */
    pid_t pid;
} kvd;

/* A block device kvd_start mounts on the spill directory (NULL: none). */
extern const char *kvd_spill_fs;

/* Starts rekv-kvstore with the test geometry (2 layers, 2 kv heads, head dim 32, hidden 64, f16:
 * KV block 4096 bytes, ACT block 2048) and `slots` host slots. fsize > 0 sets RLIMIT_FSIZE. */
void kvd_start(kvd *d, unsigned slots, const char *extra, rlim_t fsize);

/* SIGTERM, expect a clean exit, then check nothing is left behind. */
void kvd_stop(kvd *d);

rekv_kvstore_client *kvd_client(kvd *d);

/* Deterministic contents of block (seq, layer, block) at generation gen. */
void kvd_fill(uint8_t *p, size_t n, uint64_t seq, uint32_t layer, uint64_t block, uint32_t gen);

int kvd_check(const uint8_t *p, size_t n, uint64_t seq, uint32_t layer, uint64_t block,
              uint32_t gen);

size_t kvd_type_bytes(rekv_kvstore_client *c, uint32_t type);

/* Writes every block of seq in [b0, b1) of all layers, pinning a few at a time. */
void kvd_write_blocks(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1, uint32_t gen);

void kvd_verify_blocks(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1,
                       uint32_t gen);

#endif
