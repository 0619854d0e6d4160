/* spill_fault.c — corrupting a kvstore's spill file under a test (spill_fault.h). */
#define _GNU_SOURCE
#include "tests/spill_fault.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

int sf_job_store_seq(const char *wk_log, uint64_t job, uint64_t *seq)
{
    char needle[96];
    snprintf(needle, sizeof(needle), "job %llu's cache is kvstore sequence ",
             (unsigned long long)job);
    char *t = tu_read_file(wk_log, NULL);
    int n = 0;
    *seq = 0;
    for (const char *p = t; p && (p = strstr(p, needle)); p++, n++)
        *seq = strtoull(p + strlen(needle), NULL, 10);
    free(t);
    return n;
}

void sf_kv_quiet(rekv_kvstore_client *kc, rekv_kv_stats *st)
{
    for (;;) {
        rekv_kv_stats a, b;
        rekv_err err = {0};
        ck_assert_msg(rekv_kvstore_stats(kc, &a, &err) == 0, "%s", err.msg);
        usleep(100000);
        ck_assert_msg(rekv_kvstore_stats(kc, &b, &err) == 0, "%s", err.msg);
        if (a.reads_in_flight + a.spills_in_flight + b.reads_in_flight + b.spills_in_flight == 0 &&
            a.bytes_read_back == b.bytes_read_back && a.bytes_spilled == b.bytes_spilled) {
            *st = b;
            return;
        }
    }
}

int sf_flip_disk_block(rekv_kvstore_client *kc, int fd, uint64_t seq, uint32_t *layer,
                       uint64_t *block)
{
    rekv_kv_geometry g;
    rekv_kvstore_client_geometry(kc, &g);
    size_t slot = rekv_kvstore_client_header(kc)->slot_bytes;
    rekv_kv_stats before, after;
    sf_kv_quiet(kc, &before);
    for (uint32_t l = 0; l < g.n_layers; l++) {
        rekv_kv_table_entry *t = NULL;
        size_t n = 0;
        uint64_t n_tok = 0;
        rekv_err err = {0};
        ck_assert_msg(rekv_kvstore_table(kc, seq, l, &t, &n, &n_tok, &err) == 0, "%s", err.msg);
        for (size_t b = 0; b < n; b++) {
            if (t[b].tier != REKV_KV_TIER_DISK || t[b].type != REKV_KV_BLOCK_KV)
                continue;
            uint64_t phys = t[b].phys;
            free(t);
            uint8_t byte;
            off_t off = (off_t)(phys * slot + 100);
            ck_assert_int_eq(pread(fd, &byte, 1, off), 1);
            byte ^= 0xff;
            ck_assert_int_eq(pwrite(fd, &byte, 1, off), 1);
            ck_assert_int_eq(fdatasync(fd), 0);
            sf_kv_quiet(kc, &after);
            ck_assert_msg(rekv_kvstore_table(kc, seq, l, &t, &n, &n_tok, &err) == 0, "%s", err.msg);
            int still = b < n && t[b].tier == REKV_KV_TIER_DISK && t[b].phys == phys &&
                        after.bytes_read_back == before.bytes_read_back;
            free(t);
            *layer = l;
            *block = b;
            return still;
        }
        free(t);
    }
    return 0;
}
