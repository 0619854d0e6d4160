/* map.c — a small u64 -> u64 open-addressing hash map (sequences by id, pins by block). */
#include <errno.h>
#include <stdlib.h>

#include "kvstore/kv_internal.h"

static size_t map_hash(uint64_t k, size_t mask)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k & mask;
}

void kv_map_init(kv_map *m)
{
    m->keys = NULL;
    m->vals = NULL;
    m->cap = 0;
    m->len = 0;
}

void kv_map_free(kv_map *m)
{
    free(m->keys);
    free(m->vals);
    kv_map_init(m);
}

uint64_t *kv_map_get(const kv_map *m, uint64_t key)
{
    if (m->cap == 0 || key == KV_MAP_EMPTY)
        return NULL;
    size_t mask = m->cap - 1;
    for (size_t i = map_hash(key, mask);; i = (i + 1) & mask) {
        if (m->keys[i] == key)
            return &m->vals[i];
        if (m->keys[i] == KV_MAP_EMPTY)
            return NULL;
    }
}

static int map_grow(kv_map *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 16;
    uint64_t *nk = malloc(ncap * sizeof(*nk));
    uint64_t *nv = malloc(ncap * sizeof(*nv));
    if (nk == NULL || nv == NULL) {
        free(nk);
        free(nv);
        return -ENOMEM;
    }
    for (size_t i = 0; i < ncap; i++)
        nk[i] = KV_MAP_EMPTY;
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] == KV_MAP_EMPTY)
            continue;
        size_t j = map_hash(m->keys[i], ncap - 1);
        while (nk[j] != KV_MAP_EMPTY)
            j = (j + 1) & (ncap - 1);
        nk[j] = m->keys[i];
        nv[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = nk;
    m->vals = nv;
    m->cap = ncap;
    return 0;
}

int kv_map_put(kv_map *m, uint64_t key, uint64_t val)
{
    if (key == KV_MAP_EMPTY)
        return -EINVAL;
    uint64_t *v = kv_map_get(m, key);
    if (v != NULL) {
        *v = val;
        return 0;
    }
    if ((m->len + 1) * 4 > m->cap * 3) {
        int rc = map_grow(m);
        if (rc < 0)
            return rc;
    }
    size_t mask = m->cap - 1;
    size_t i = map_hash(key, mask);
    while (m->keys[i] != KV_MAP_EMPTY)
        i = (i + 1) & mask;
    m->keys[i] = key;
    m->vals[i] = val;
    m->len++;
    return 0;
}

int kv_map_del(kv_map *m, uint64_t key)
{
    if (m->cap == 0 || key == KV_MAP_EMPTY)
        return 0;
    size_t mask = m->cap - 1;
    size_t i = map_hash(key, mask);
    while (m->keys[i] != key) {
        if (m->keys[i] == KV_MAP_EMPTY)
            return 0;
        i = (i + 1) & mask;
    }
    /* backward-shift deletion keeps probe chains intact without tombstones */
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (m->keys[j] == KV_MAP_EMPTY)
            break;
        size_t home = map_hash(m->keys[j], mask);
        /* move j into the hole at i when its home is not in (i, j] cyclically */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->keys[i] = KV_MAP_EMPTY;
    m->len--;
    return 1;
}
