/* kv_pool.h — InfiniGen's memory-limited KV cache pool (OSDI'24 §4.4), the bookkeeping half:
 * which of a sequence's KV entries are still in the pool and which one goes when a new token's
 * K,V would pass the limit. One pool per (layer, KV head) of a sequence, each holding at most
 * `limit` entries (an entry: one token's K and V rows of one KV head). The victim is chosen by
 * the paper's counter policy — a counter per entry, incremented each time the entry is
 * prefetched (selected), the victim the smallest count (the oldest position among equals), every
 * counter of the pool halved when one saturates — or by FIFO (the oldest entry), the paper's
 * Table 2 baseline. The counter's victim is taken from the older half of the live entries only,
 * as the authors' code does (snu-comparch/InfiniGen accuracy/src/modeling_opt_ours.py,
 * kv_cache_mask: candidates [0, i/2), "avoid evicting recently added ones"): an entry just
 * admitted has a count of 0 and, with every entry a candidate, goes before it could be
 * prefetched — on docs8L that cost +12…18% NLL at a pool of 80% (FIFO: +0.01%). An evicted token is
 * never selected again (pipeline_infinigen.c gives the selection only the live positions). Plain
 * memory, no backend: the pipeline keeps one per sequence in memory the device reads and writes
 * too (its selection kernel, kernels.h ig_select, follows these functions), and
 * tests/test_kv_pool.c checks the victims against tests/kv_pool_ref.py. */
#ifndef REKV_GPUWORKER_KV_POOL_H
#define REKV_GPUWORKER_KV_POOL_H

#include <stdint.h>

#include "common/err.h"

typedef enum rekv_kv_pool_policy {
    REKV_KV_POOL_COUNTER = 0, /* InfiniGen's: the least prefetched entry goes */
    REKV_KV_POOL_FIFO = 1,    /* the oldest entry goes */
} rekv_kv_pool_policy;

/* The counters are 8 bits (the paper leaves the width open): when an increment makes one 255,
 * every counter of its pool is halved (255 -> 127). */
#define REKV_KV_POOL_COUNT_MAX 255

typedef struct rekv_kv_pool {
    int n_pools; /* (layer, KV head) pairs: pool = layer * n_kv + head */
    int cap;     /* positions a pool can name: the sequence's capacity */
    int limit;   /* entries a pool holds at most (>= 1) */
    rekv_kv_pool_policy policy;
    uint8_t *count; /* [n_pools][cap] prefetch counters */
    uint8_t *gone;  /* [n_pools][cap] 1: evicted */
    int *n_gone;    /* [n_pools] evicted so far */
    void *own;      /* the memory rekv_kv_pool_free frees (NULL: the caller's) */
} rekv_kv_pool;

/* Bytes of the state of n_pools pools of cap positions (rekv_kv_pool_init's mem). */
size_t rekv_kv_pool_bytes(int n_pools, int cap);
/* mem: rekv_kv_pool_bytes(n_pools, cap) of the caller's, zeroed here and kept by the caller past
 * rekv_kv_pool_free; or NULL: the pool allocates its own. 0 or -EINVAL / -ENOMEM with err set. */
int rekv_kv_pool_init(rekv_kv_pool *kp, void *mem, int n_pools, int cap, int limit,
                      rekv_kv_pool_policy policy, rekv_err *err);
void rekv_kv_pool_free(rekv_kv_pool *kp);
/* The positions of [0, len) still in pool `pool`, ascending, into live (room for len); returns
 * how many. */
int rekv_kv_pool_live(const rekv_kv_pool *kp, int pool, int len, int32_t *live);
/* Entries pos[0..m-1] (live positions) were prefetched: their counters go up by one. */
void rekv_kv_pool_touch(rekv_kv_pool *kp, int pool, const int32_t *pos, int m);
/* Room for the entry of position len (positions [0, len) were admitted before): evicts until the
 * live ones and the new one fit the limit (the counter's victim among the older ceil(n/2) of the
 * n live entries), the victims' positions into victims (NULL: not
 * wanted); returns how many went. The new entry starts with a count of 0. */
int rekv_kv_pool_admit(rekv_kv_pool *kp, int pool, int len, int32_t *victims);

#endif
