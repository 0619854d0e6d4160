/* slots.c — the arena's host slots in two classes carved from one budget, so that a block costs
 * its real bytes: the arena is a row of big slots, each the larger block type's size (rounded up
 * to a page); a big slot holds one block of that type, or is split into per_big small slots of the
 * smaller type's size. For an MHA model an ACT block is half a KV block, so an arena of ACT blocks
 * holds twice the tokens of one of KV blocks (HybridServe's point: more sequences fit).
 *
 * Small blocks go first to split slots that have room, so big slots stay whole; a split slot whose
 * last small block goes is whole again. A slot number names a small slot: big * per_big + j (a big
 * block has j = 0), so it lies at big * big_bytes + j * small_bytes. With equal sizes (per_big 1)
 * this is the single-class arena it was. Where the larger type is not a whole number of the smaller
 * (kv_slots_sizes), a big slot may be n + 1 small ones, one big block wasting the rest. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/kv_internal.h"

#define KV_PAGE 4096ull

static uint64_t page_up(uint64_t x) { return (x + KV_PAGE - 1) / KV_PAGE * KV_PAGE; }

void kv_slots_sizes(uint64_t kv_bytes, uint64_t act_bytes, uint64_t *big, uint64_t *small,
                    uint32_t *per_big)
{
    uint64_t kb = page_up(kv_bytes), ab = page_up(act_bytes);
    uint64_t l = kb > ab ? kb : ab, s = kb < ab ? kb : ab, n = l / s;
    if (n > 64)
        n = 64; /* one used-mask word per big slot; the rest of it is left over */
    /* where the larger block is not a whole number of smaller ones (an int4 KV block beside a
     * 16-bit ACT block: 0.56 of it), a big slot of n + 1 small ones may waste less than a big
     * slot of the larger block's size holding n: the one whose blocks waste the smaller share */
    if (l % s != 0 && n < 64 && (double)((n + 1) * s) / (double)l < (double)l / (double)(n * s))
        l = ++n * s;
    *big = l;
    *small = n == 1 ? l : s;
    *per_big = (uint32_t)n;
}

int kv_slots_init(kv_slots *sl, uint64_t data_bytes, uint64_t kv_bytes, uint64_t act_bytes)
{
    memset(sl, 0, sizeof(*sl));
    uint64_t kb = page_up(kv_bytes), ab = page_up(act_bytes);
    kv_slots_sizes(kv_bytes, act_bytes, &sl->big_bytes, &sl->small_bytes, &sl->per_big);
    sl->small_type = kb < ab ? REKV_KV_BLOCK_KV : REKV_KV_BLOCK_ACT;
    uint64_t n = data_bytes / sl->big_bytes;
    if (n * sl->per_big > UINT32_MAX - 1)
        n = (UINT32_MAX - 1) / sl->per_big;
    sl->n_big = (uint32_t)n;
    size_t cells = n ? n : 1;
    sl->free_big = malloc(cells * sizeof(uint32_t));
    sl->used = calloc(cells, sizeof(uint64_t));
    sl->partial = malloc(cells * sizeof(uint32_t));
    sl->partial_pos = malloc(cells * sizeof(uint32_t));
    sl->split = calloc(cells, 1);
    if (!sl->free_big || !sl->used || !sl->partial || !sl->partial_pos || !sl->split) {
        kv_slots_destroy(sl);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < sl->n_big; i++) {
        sl->free_big[i] = sl->n_big - 1 - i; /* slot 0 first */
        sl->partial_pos[i] = UINT32_MAX;
    }
    sl->n_free_big = sl->n_big;
    return 0;
}

void kv_slots_destroy(kv_slots *sl)
{
    free(sl->free_big);
    free(sl->used);
    free(sl->partial);
    free(sl->partial_pos);
    free(sl->split);
    memset(sl, 0, sizeof(*sl));
}

int kv_slots_is_small(const kv_slots *sl, int type)
{
    return sl->per_big > 1 && type == sl->small_type;
}

uint64_t kv_slots_class_bytes(const kv_slots *sl, int type)
{
    return kv_slots_is_small(sl, type) ? sl->small_bytes : sl->big_bytes;
}

uint64_t kv_slots_offset(const kv_slots *sl, uint32_t slot)
{
    return (uint64_t)(slot / sl->per_big) * sl->big_bytes +
           (uint64_t)(slot % sl->per_big) * sl->small_bytes;
}

uint64_t kv_slots_free_bytes(const kv_slots *sl)
{
    return (uint64_t)sl->n_free_big * sl->big_bytes + sl->free_small * sl->small_bytes;
}

static uint64_t full_mask(const kv_slots *sl)
{
    return sl->per_big >= 64 ? UINT64_MAX : (1ull << sl->per_big) - 1;
}

static void partial_add(kv_slots *sl, uint32_t big)
{
    sl->partial_pos[big] = sl->n_partial;
    sl->partial[sl->n_partial++] = big;
}

static void partial_del(kv_slots *sl, uint32_t big)
{
    uint32_t i = sl->partial_pos[big], last = sl->partial[--sl->n_partial];
    sl->partial[i] = last;
    sl->partial_pos[last] = i;
    sl->partial_pos[big] = UINT32_MAX;
}

int kv_slots_alloc(kv_slots *sl, int type, uint32_t *slot)
{
    if (!kv_slots_is_small(sl, type)) {
        if (sl->n_free_big == 0)
            return -ENOSPC;
        uint32_t big = sl->free_big[--sl->n_free_big];
        *slot = big * sl->per_big;
        sl->used_bytes += sl->big_bytes;
        return 0;
    }
    uint32_t big;
    if (sl->n_partial > 0) {
        big = sl->partial[sl->n_partial - 1];
    } else if (sl->n_free_big > 0) {
        big = sl->free_big[--sl->n_free_big];
        sl->used[big] = 0;
        sl->split[big] = 1;
        sl->free_small += sl->per_big;
        partial_add(sl, big);
    } else {
        return -ENOSPC;
    }
    uint32_t j = (uint32_t)__builtin_ctzll(~sl->used[big]);
    sl->used[big] |= 1ull << j;
    sl->free_small--;
    if (sl->used[big] == full_mask(sl))
        partial_del(sl, big);
    *slot = big * sl->per_big + j;
    sl->used_bytes += sl->small_bytes;
    return 0;
}

void kv_slots_put(kv_slots *sl, int type, uint32_t slot)
{
    uint32_t big = slot / sl->per_big, j = slot % sl->per_big;
    if (!kv_slots_is_small(sl, type)) {
        sl->free_big[sl->n_free_big++] = big;
        sl->used_bytes -= sl->big_bytes;
        return;
    }
    int was_full = sl->used[big] == full_mask(sl);
    sl->used[big] &= ~(1ull << j);
    sl->free_small++;
    sl->used_bytes -= sl->small_bytes;
    if (sl->used[big] == 0) { /* whole again */
        if (!was_full)
            partial_del(sl, big);
        sl->free_small -= sl->per_big;
        sl->split[big] = 0;
        sl->free_big[sl->n_free_big++] = big;
    } else if (was_full) {
        partial_add(sl, big);
    }
}

int kv_slots_fit(const kv_slots *sl, const uint64_t need[2], const uint64_t gain[2])
{
    uint64_t big_need = 0, small_need = 0, big_have = sl->n_free_big, small_have = sl->free_small;
    for (int t = 0; t < 2; t++) {
        uint64_t g = gain ? gain[t] : 0;
        if (kv_slots_is_small(sl, t))
            small_need += need[t], small_have += g;
        else
            big_need += need[t], big_have += g;
    }
    if (big_need > big_have)
        return 0;
    return small_need <= small_have + (big_have - big_need) * sl->per_big;
}

int kv_slots_find(const kv_slots *sl, uint64_t rel, uint32_t *slot, uint64_t *start)
{
    uint64_t big = rel / sl->big_bytes, in = rel % sl->big_bytes;
    if (big >= sl->n_big)
        return -ERANGE;
    uint32_t j = sl->split[big] ? (uint32_t)(in / sl->small_bytes) : 0;
    if (j >= sl->per_big)
        return -ERANGE; /* the leftover at the end of a split slot */
    *slot = (uint32_t)big * sl->per_big + j;
    *start = kv_slots_offset(sl, *slot);
    return 0;
}
