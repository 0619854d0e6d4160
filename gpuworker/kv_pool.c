/* kv_pool.c — InfiniGen's KV cache pool bookkeeping (kv_pool.h says what and why). The pools are
 * small ([layers][KV heads][capacity] bytes twice) and scanned whole: a victim is one pass over a
 * pool's positions, as cheap as the selection's own pass over the scores. */
#include "gpuworker/kv_pool.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* one block: the evictions' counts, then the counters, then the evicted flags */
size_t rekv_kv_pool_bytes(int n_pools, int cap)
{
    return (size_t)n_pools * (sizeof(int) + 2 * (size_t)cap);
}

int rekv_kv_pool_init(rekv_kv_pool *kp, void *mem, int n_pools, int cap, int limit,
                      rekv_kv_pool_policy policy, rekv_err *err)
{
    *kp = (rekv_kv_pool){0};
    if (n_pools < 1 || cap < 1 || limit < 1 ||
        (policy != REKV_KV_POOL_COUNTER && policy != REKV_KV_POOL_FIFO))
        return rekv_errf(err, -EINVAL, "kv pool: %d pools of %d positions, limit %d, policy %d",
                         n_pools, cap, limit, (int)policy);
    size_t bytes = rekv_kv_pool_bytes(n_pools, cap), n = (size_t)n_pools * (size_t)cap;
    if (mem == NULL && (mem = kp->own = malloc(bytes)) == NULL)
        return rekv_errf(err, -ENOMEM, "kv pool: out of memory");
    memset(mem, 0, bytes);
    kp->n_gone = mem;
    kp->count = (uint8_t *)mem + (size_t)n_pools * sizeof(int);
    kp->gone = kp->count + n;
    kp->n_pools = n_pools, kp->cap = cap, kp->limit = limit, kp->policy = policy;
    return 0;
}

void rekv_kv_pool_free(rekv_kv_pool *kp)
{
    free(kp->own);
    *kp = (rekv_kv_pool){0};
}

int rekv_kv_pool_live(const rekv_kv_pool *kp, int pool, int len, int32_t *live)
{
    const uint8_t *gone = kp->gone + (size_t)pool * (size_t)kp->cap;
    int n = 0;
    for (int t = 0; t < len; t++) {
        live[n] = t;
        n += !gone[t];
    }
    return n;
}

void rekv_kv_pool_touch(rekv_kv_pool *kp, int pool, const int32_t *pos, int m)
{
    uint8_t *cnt = kp->count + (size_t)pool * (size_t)kp->cap;
    for (int j = 0; j < m; j++)
        if (++cnt[pos[j]] == REKV_KV_POOL_COUNT_MAX)
            for (int t = 0; t < kp->cap; t++) /* saturated: the pool's ranks kept, halved */
                cnt[t] >>= 1;
}

int rekv_kv_pool_admit(rekv_kv_pool *kp, int pool, int len, int32_t *victims)
{
    size_t o = (size_t)pool * (size_t)kp->cap;
    uint8_t *cnt = kp->count + o, *gone = kp->gone + o;
    int n = 0;
    while (len - kp->n_gone[pool] + 1 > kp->limit) {
        /* counter: among the older half of the live entries (the newer ones have had no time to
         * be prefetched), the least counted, the first on ties; fifo: the first live one */
        int v = -1, half = (len - kp->n_gone[pool] + 1) / 2;
        for (int t = 0, r = 0; t < len && r < half; t++)
            if (!gone[t]) {
                if (v < 0 || (kp->policy == REKV_KV_POOL_COUNTER && cnt[t] < cnt[v]))
                    v = t;
                r++;
            }
        if (v < 0) /* limit < 1: refused at init */
            break;
        gone[v] = 1;
        kp->n_gone[pool]++;
        if (victims)
            victims[n] = v;
        n++;
    }
    if (len < kp->cap)
        cnt[len] = 0, gone[len] = 0;
    return n;
}
