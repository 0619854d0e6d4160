/* spill_fault.h — corrupting a kvstore's spill file under a test: which kvstore sequence holds a
 * job's cache (from the worker's debug log), the store at rest, and one byte flipped in a block of
 * that sequence on disk. Shared by test_faults and test_failure_reason. */
#ifndef REKV_TESTS_SPILL_FAULT_H
#define REKV_TESTS_SPILL_FAULT_H

#include <stdint.h>

#include "kvstore/kvstore.h"

/* How many times the worker's debug log (wk_log) says job's cache is a kvstore sequence (its
 * joins), *seq the last one named (0 when none). */
int sf_job_store_seq(const char *wk_log, uint64_t job, uint64_t *seq);

/* The store at rest: no spill write or read-back in flight and none completed over 100 ms (the
 * worker is stopped, so nothing starts one but a parked request, which this waits out; Check's
 * timeout is the guard); *st its stats then. */
void sf_kv_quiet(rekv_kvstore_client *kc, rekv_kv_stats *st);

/* With the worker stopped: flips one byte of a KV block of sequence seq that is on disk now (the
 * store's block table says where; fd the spill file, opened read-write) and still there after the
 * flip with nothing read back meanwhile, its layer and block in *layer, *block; 0 when none of its
 * blocks is on disk (or one was read back meanwhile). */
int sf_flip_disk_block(rekv_kvstore_client *kc, int fd, uint64_t seq, uint32_t *layer,
                       uint64_t *block);

#endif
