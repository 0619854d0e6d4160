/* blocks.c — the kvstore server's blocks and where they live: block ids, host slots in the arena,
 * the LRU list of blocks that may be spilled, spilling to and reading back from the spill tier
 * (spill.c's io_uring engine), and the sequences' per-layer block tables.
 *
 * A block goes HOST -> SPILLING -> DISK when it reaches the LRU end and room is needed (an append,
 * a read-back) or the arena is above the high watermark, and DISK -> LOADING -> HOST when a Plan
 * asks for it (handlers.c starts the read). A block used while its spill is in flight keeps its
 * host copy; one freed while its I/O is in flight is released when the I/O completes. A failed
 * write keeps the block in memory and stops spilling until a probe write succeeds (the tier
 * fails: spill_failing); a full disk pauses spilling for a second; a failed read, or one whose
 * CRC32C does not match, leaves the block on disk with a sticky error. Each batch of completions
 * runs the parked requests again.
 *
 * The list of blocks that may be spilled is an LRU list with one exception: blocks a client
 * unpins as done (Unpin.done, a layer window of a step that sweeps every layer) go to its
 * spilled-first end, the last done first. For a cyclic sweep LRU is the worst order — the block
 * used longest ago is the one needed next — while the block just finished is needed last, so that
 * is the one to spill (Belady's choice for a cycle). Read-ahead (Plan.ahead) reads the next
 * window's spilled blocks back off the pin's critical path: they queue here, reads start as slots
 * and queue depth allow, and to make room it spills from the spilled-first end, never a block
 * read-ahead wants (nor does the watermark spiller). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvstore/server_internal.h"

size_t srv_blk_bytes(const rekv_kvstore_server *s, const kv_block *b)
{
    return b->type == REKV_KV_BLOCK_KV ? s->arena.hdr->kv_block_bytes
                                       : s->arena.hdr->act_block_bytes;
}

uint64_t srv_blk_offset(const rekv_kvstore_server *s, const kv_block *b)
{
    return s->arena.hdr->data_offset + kv_slots_offset(&s->hs, b->slot);
}

int srv_slot_take(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    uint32_t slot;
    if (kv_slots_alloc(&s->hs, b->type, &slot) < 0)
        return -ENOSPC;
    b->slot = slot;
    s->slot_block[slot] = id;
    return 0;
}

/* ------------------------------------------------------------------ LRU and block ids */

/* The two lists share the blocks' links: the running sequences' (LRU_MAIN) and the blocks only
 * the prefix cache holds (LRU_CACHE), which go first when room is needed. */
static uint32_t *lru_ends(rekv_kvstore_server *s, int list, uint32_t **tail)
{
    *tail = list == LRU_CACHE ? &s->cache_tail : &s->lru_tail;
    return list == LRU_CACHE ? &s->cache_head : &s->lru_head;
}

static void lru_remove(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    if (!b->in_lru)
        return;
    uint32_t *tail, *head = lru_ends(s, b->in_lru, &tail);
    if (b->prev != NIL)
        s->blocks[b->prev].next = b->next;
    else
        *head = b->next;
    if (b->next != NIL)
        s->blocks[b->next].prev = b->prev;
    else
        *tail = b->prev;
    if (b->in_lru == LRU_MAIN)
        s->lru_len--;
    b->in_lru = LRU_NONE;
    b->prev = b->next = NIL;
}

static void lru_push(rekv_kvstore_server *s, uint32_t id, int list, int at_head)
{
    kv_block *b = &s->blocks[id];
    uint32_t *tail, *head = lru_ends(s, list, &tail);
    if (at_head) {
        b->prev = NIL;
        b->next = *head;
        if (*head != NIL)
            s->blocks[*head].prev = id;
        else
            *tail = id;
        *head = id;
    } else {
        b->prev = *tail;
        b->next = NIL;
        if (*tail != NIL)
            s->blocks[*tail].next = id;
        else
            *head = id;
        *tail = id;
    }
    b->in_lru = (uint8_t)list;
    if (list == LRU_MAIN)
        s->lru_len++;
}

/* The list a block that may be spilled belongs on: the cache's when no sequence holds it. */
static int lru_list_of(const kv_block *b)
{
    return b->centry != NIL && b->refs == 1 ? LRU_CACHE : LRU_MAIN;
}

/* Puts a block where it belongs: on a list (most recent end) iff it can be spilled. */
void srv_lru_update(rekv_kvstore_server *s, uint32_t id, int touch)
{
    kv_block *b = &s->blocks[id];
    int want = b->state == BS_HOST && b->pins == 0 && b->holds == 0 && !b->doomed;
    if (b->in_lru && (!want || touch || b->in_lru != lru_list_of(b)))
        lru_remove(s, id);
    if (want && !b->in_lru)
        lru_push(s, id, lru_list_of(b), 0);
}

void srv_lru_done(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    lru_remove(s, id);
    if (b->ahead != AH_READING)
        b->ahead = AH_NONE;
    if (b->state == BS_HOST && b->pins == 0 && b->holds == 0 && !b->doomed)
        lru_push(s, id, lru_list_of(b), 1);
}

int srv_block_new(rekv_kvstore_server *s, uint32_t *out)
{
    uint32_t id;
    if (s->n_free_ids > 0) {
        id = s->free_ids[--s->n_free_ids];
    } else {
        size_t cap = s->cap_block_ids;
        if (s->n_block_ids == NIL - 1 ||
            srv_grow((void **)&s->blocks, &cap, (size_t)s->n_block_ids + 1, sizeof(kv_block)) < 0)
            return -ENOMEM;
        s->cap_block_ids = (uint32_t)cap;
        id = s->n_block_ids++;
    }
    memset(&s->blocks[id], 0, sizeof(kv_block));
    s->blocks[id].prev = s->blocks[id].next = NIL;
    s->blocks[id].centry = NIL;
    s->blocks[id].refs = 1; /* the sequence it is made for */
    *out = id;
    return 0;
}

void srv_block_release_id(rekv_kvstore_server *s, uint32_t id)
{
    s->blocks[id].state = BS_UNUSED;
    size_t cap = s->cap_free_ids;
    if (srv_grow((void **)&s->free_ids, &cap, (size_t)s->n_free_ids + 1, sizeof(uint32_t)) < 0)
        return; /* the id is lost to reuse; harmless */
    s->cap_free_ids = (uint32_t)cap;
    s->free_ids[s->n_free_ids++] = id;
}

static void slot_put(rekv_kvstore_server *s, const kv_block *b)
{
    kv_slots_put(&s->hs, b->type, b->slot);
}

static void fslot_put(rekv_kvstore_server *s, uint32_t fslot)
{
    kv_spill_slot_free(s->spill, fslot);
    s->spill_err = 0; /* room on disk again: spilling may resume */
}

/* Frees a block now, or when its I/O completes. */
void srv_block_free(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    lru_remove(s, id);
    switch (b->state) {
    case BS_HOST:
        s->host_n[b->type]--;
        slot_put(s, b);
        srv_block_release_id(s, id);
        break;
    case BS_DISK:
        s->disk_n[b->type]--;
        srv_persist_drop(s, b);
        fslot_put(s, b->fslot);
        srv_block_release_id(s, id);
        break;
    case BS_FRESH:
        s->disk_n[b->type]--;
        srv_block_release_id(s, id);
        break;
    case BS_SPILLING:
        s->host_n[b->type]--;
        b->doomed = 1;
        break;
    case BS_LOADING:
        s->disk_n[b->type]--;
        b->doomed = 1;
        break;
    default:
        break;
    }
}

void srv_block_unref(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    REKV_ASSERT(b->refs > 0 && b->state != BS_UNUSED);
    if (--b->refs == 0)
        srv_block_free(s, id);
    else
        srv_lru_update(s, id, 0); /* maybe now only the cache's: its list */
}

/* ------------------------------------------------------------------ spilling */

/* A file slot for a spill: for a sequence's block, when the spill file is at --spill-bytes or
 * the disk is full, blocks only the prefix cache holds on disk give theirs back first (running
 * jobs win, also in background spilling: else a full disk would pause spilling for all). */
static int fslot_alloc(rekv_kvstore_server *s, int for_seq, uint32_t *fslot)
{
    int arc;
    while ((arc = kv_spill_slot_alloc(s->spill, fslot)) == -ENOSPC && for_seq &&
           srv_cache_evict_disk(s))
        ;
    return arc;
}

/* Whether a failure to grow the spill file is the disk's room (full, a quota, a size limit: it
 * passes as files shrink; spilling pauses) rather than the tier failing. */
static int grow_is_room(int rc)
{
    return rc == -ENOSPC || rc == -EDQUOT || rc == -EFBIG;
}

/* The spill tier failed (what: the operation, rc its -errno): spilling stops until a probe write
 * succeeds (srv_spill_probe). Said once, when it starts failing; later failures are counted. */
static void spill_failing(rekv_kvstore_server *s, int rc, const char *what)
{
    s->spill_errors++;
    if (s->spill_fail)
        return;
    s->spill_fail = rc;
    s->spill_probe_ns = s->now;
    snprintf(s->spill_fail_why, sizeof(s->spill_fail_why), "the spill tier is failing (%s: %s)",
             what, strerror(-rc));
    srv_event(s, REKV_KV_EVENT_ERROR,
              "%s: %s; spilling stopped, the %llu-byte arena serves alone (admission is told the "
              "spill tier has no room) until a probe write, once a second, succeeds",
              what, strerror(-rc), (unsigned long long)s->hs.n_big * s->hs.big_bytes);
}

/* Starts spilling a block that may be spilled: first the blocks only the prefix cache holds (a
 * cached block the spill tier cannot take — none, paused, failing, full — is evicted instead:
 * its room is free at once), then the running sequences' from the spilled-first end
 * (keep_ahead: unless read-ahead wants it). 1 started (or evicted), 0 nothing to spill, <0
 * cannot. */
static int spill_one(rekv_kvstore_server *s, const char **why, int keep_ahead)
{
    int cached = s->cache_head != NIL;
    /* no spill tier, spilling paused by a full disk or the tier failing: a cached block just
     * goes (a full queue is waited for, below: it drains) */
    int can_spill = s->spill != NULL && !s->spill_fail &&
                    (s->spill_err == 0 || s->now - s->spill_err_ns >= 1000000000ull);
    if (cached && !can_spill)
        return srv_cache_evict_host(s);
    if (s->spill == NULL) {
        *why = "the arena is full and there is no spill tier";
        return -ENOMEM;
    }
    if (s->spill_fail) {
        *why = s->spill_fail_why;
        return s->spill_fail;
    }
    if (s->spill_err != 0) {
        if (s->now - s->spill_err_ns < 1000000000ull) {
            *why = strerror(-s->spill_err);
            return s->spill_err;
        }
        s->spill_err = 0; /* retry once a second */
    }
    uint32_t id = cached ? s->cache_head : s->lru_head;
    if (id == NIL) {
        *why = "every resident block is pinned or in use";
        return 0;
    }
    if (!cached && keep_ahead && s->blocks[id].ahead != AH_NONE)
        return 0;
    if (kv_spill_in_flight(s->spill) >= kv_spill_depth(s->spill))
        return 0;
    uint32_t fslot;
    int arc = fslot_alloc(s, !cached, &fslot);
    if (arc == -ENOSPC && cached)
        return srv_cache_evict_host(s); /* the spill file is full: a cached block just goes */
    if (arc == -ENOSPC && kv_spill_at_limit(s->spill) && kv_spill_slots_used(s->spill) > 0) {
        *why = "the spill file is full (--spill-bytes)";
        return arc;
    }
    if (arc < 0 && !grow_is_room(arc)) { /* EIO, a read-only file system: the tier fails */
        spill_failing(s, arc, "spill file cannot grow");
        *why = s->spill_fail_why;
        return cached ? srv_cache_evict_host(s) : arc;
    }
    if (arc < 0) {
        /* the disk is full: spilling pauses (a second, or until a slot is freed); a cached block
         * goes, a running sequence's stays in memory */
        s->spill_errors++;
        srv_event_rl(s, SRV_RL_SPILL_GROW, REKV_KV_EVENT_ERROR,
                     "spill file cannot grow: %s; %s, spilling paused", strerror(-arc),
                     cached ? "cached blocks are evicted" : "blocks stay in memory");
        s->spill_err = arc;
        s->spill_err_ns = s->now;
        *why = strerror(-arc);
        return cached ? srv_cache_evict_host(s) : arc;
    }
    kv_block *b = &s->blocks[id];
    uint32_t crc = 0;
    int rc = kv_spill_write(s->spill, kv_slots_offset(&s->hs, b->slot), fslot, srv_blk_bytes(s, b),
                            id, &crc);
    if (rc < 0) {
        kv_spill_slot_free(s->spill, fslot);
        return cached ? srv_cache_evict_host(s) : 0; /* a cached block goes instead */
    }
    lru_remove(s, id);
    b->state = BS_SPILLING;
    b->fslot = fslot;
    b->crc = crc;
    b->touched = 0;
    s->spills_in_flight++;
    s->spilling_n[b->type]++;
    return 1;
}

/* A probe's tag: block ids are 32 bits. */
#define PROBE_TAG UINT64_MAX

void srv_spill_probe(rekv_kvstore_server *s)
{
    if (s->spill == NULL || !s->spill_fail || s->spill_probing ||
        s->now - s->spill_probe_ns < 1000000000ull ||
        kv_spill_in_flight(s->spill) >= kv_spill_depth(s->spill))
        return;
    s->spill_probe_ns = s->now;
    uint32_t fslot;
    if (kv_spill_slot_probe(s->spill, &fslot) < 0) /* the file cannot grow: still failing */
        return;
    /* a page of the arena's first slot (whatever it holds) to a slot nothing uses */
    if (kv_spill_write(s->spill, 0, fslot, 4096, PROBE_TAG, NULL) < 0) {
        kv_spill_slot_bad(s->spill, fslot);
        return;
    }
    s->spill_probing = 1;
    s->spill_probe_slot = fslot;
}

/* A probe write completed with res: the tier works again (its slots whose writes failed come back
 * into use), or still fails. */
static void probe_done(rekv_kvstore_server *s, int res)
{
    s->spill_probing = 0;
    if (res < 0) {
        kv_spill_slot_bad(s->spill, s->spill_probe_slot);
        return;
    }
    kv_spill_slot_free(s->spill, s->spill_probe_slot);
    size_t back = kv_spill_slots_revive(s->spill);
    srv_event(s, REKV_KV_EVENT_INFO,
              "the spill tier works again (a probe write succeeded after %s): spilling resumes, "
              "%zu file slots whose writes failed are back in use",
              strerror(-s->spill_fail), back);
    s->spill_fail = 0;
    s->spill_err = 0;
}

int srv_ensure_room(rekv_kvstore_server *s, const uint64_t need[2], char *why, size_t why_len)
{
    if (kv_slots_fit(&s->hs, need, NULL))
        return 0;
    if (!kv_slots_fit(&s->hs, need, (uint64_t[2]){s->host_n[0], s->host_n[1]})) {
        snprintf(why, why_len,
                 "needs %llu KV and %llu ACT blocks at once, more than the arena holds (%llu "
                 "bytes)",
                 (unsigned long long)need[0], (unsigned long long)need[1],
                 (unsigned long long)s->hs.n_big * s->hs.big_bytes);
        return -ENOMEM;
    }
    /* spill until the slots that spills in flight free make it fit (counted as if each freed
     * slot stayed a slot of its class: a small one may also complete a whole big slot, so this
     * can spill a little more than needed, never too little) */
    const char *reason = "every resident block is pinned or in use";
    while (!kv_slots_fit(&s->hs, need, (uint64_t[2]){s->spilling_n[0], s->spilling_n[1]})) {
        if (spill_one(s, &reason, 0) <= 0)
            break;
    }
    if (kv_slots_fit(&s->hs, need, NULL)) /* cached blocks evicted: room now */
        return 0;
    if (s->spills_in_flight > 0)
        return 1;
    snprintf(why, why_len,
             "out of host memory: %llu bytes free, %llu KV and %llu ACT blocks needed; cannot "
             "spill: %s",
             (unsigned long long)kv_slots_free_bytes(&s->hs), (unsigned long long)need[0],
             (unsigned long long)need[1], reason);
    return -ENOMEM;
}

/* Background spilling between the watermarks (of the arena's bytes). */
void srv_spill_watermark(rekv_kvstore_server *s)
{
    if (s->spill == NULL || s->hs.n_big == 0)
        return;
    uint64_t total = (uint64_t)s->hs.n_big * s->hs.big_bytes;
    uint64_t used = total - kv_slots_free_bytes(&s->hs);
    if (used * 100 <= total * s->cfg.high_pct)
        return;
    const char *why;
    for (;;) {
        used = total - kv_slots_free_bytes(&s->hs); /* an eviction frees at once */
        uint64_t coming = (uint64_t)s->spilling_n[0] * kv_slots_class_bytes(&s->hs, 0) +
                          (uint64_t)s->spilling_n[1] * kv_slots_class_bytes(&s->hs, 1);
        uint64_t after = used > coming ? used - coming : 0;
        if (after * 100 <= total * s->cfg.low_pct)
            break;
        if (spill_one(s, &why, 1) <= 0)
            break;
    }
}

void srv_cache_flush(rekv_kvstore_server *s)
{
    uint64_t flushed = 0;
    for (;;) {
        const char *why;
        s->now = rekv_now_ns();
        while (s->cache_head != NIL && s->spill_err == 0 && !s->spill_fail &&
               spill_one(s, &why, 0) > 0)
            flushed++; /* a cached block the tier cannot take (full) is evicted instead */
        kv_spill_submit(s->spill);
        if (s->spills_in_flight == 0)
            break;
        struct pollfd pf = {kv_spill_event_fd(s->spill), POLLIN, 0};
        poll(&pf, 1, 1000); /* the completions' eventfd (srv_on_completions drains it) */
        srv_on_completions(s);
    }
    if (flushed)
        srv_event(s, REKV_KV_EVENT_INFO, "prefix cache: %llu cached blocks written to disk to "
                                         "outlast the stop",
                  (unsigned long long)flushed);
}

/* ------------------------------------------------------------------ read-ahead */

void srv_ahead_add(rekv_kvstore_server *s, const uint32_t *ids, size_t n)
{
    /* at most the arena's slots wait: more could not be resident at once anyway */
    size_t max = (size_t)s->hs.n_big * s->hs.per_big;
    for (size_t i = 0; i < n; i++) {
        kv_block *b = &s->blocks[ids[i]];
        if (b->ahead != AH_NONE || b->doomed)
            continue;
        if (b->state == BS_HOST || b->state == BS_SPILLING) {
            b->ahead = AH_READY; /* resident: keep it */
            if (b->state == BS_SPILLING)
                b->touched = 1;
            srv_lru_update(s, ids[i], 1);
            continue;
        }
        if ((b->state != BS_DISK && b->state != BS_FRESH) || b->load_err || s->ahead_n >= max)
            continue;
        size_t cap = s->ahead_cap;
        if (srv_grow((void **)&s->ahead_q, &cap, s->ahead_n + 1, sizeof(uint32_t)) < 0)
            return; /* a hint: dropped */
        s->ahead_cap = cap;
        s->ahead_q[s->ahead_n++] = ids[i];
        b->ahead = AH_QUEUED;
    }
}

void srv_ahead_pump(rekv_kvstore_server *s)
{
    if (s->ahead_n == 0)
        return;
    uint64_t need[2] = {0, 0};
    size_t k = 0;
    for (size_t i = 0; i < s->ahead_n; i++) {
        uint32_t id = s->ahead_q[i];
        kv_block *b = &s->blocks[id];
        if (b->ahead != AH_QUEUED) /* pinned meanwhile, or the id was freed and reused */
            continue;
        if ((b->state != BS_DISK && b->state != BS_FRESH) || b->load_err || b->doomed ||
            s->spill == NULL) {
            b->ahead = AH_NONE;
            continue;
        }
        if (b->state == BS_FRESH) { /* nothing to read: a slot is all it needs */
            if (srv_slot_take(s, id) == 0) {
                b->state = BS_HOST;
                b->ahead = AH_READY;
                s->disk_n[b->type]--;
                s->host_n[b->type]++;
                srv_lru_update(s, id, 1);
                continue;
            }
        } else if (kv_spill_in_flight(s->spill) < kv_spill_depth(s->spill) &&
                   srv_slot_take(s, id) == 0) {
            if (kv_spill_read(s->spill, kv_slots_offset(&s->hs, b->slot), b->fslot,
                              srv_blk_bytes(s, b), id) == 0) {
                b->state = BS_LOADING;
                b->ahead = AH_READING;
                s->reads_in_flight++;
                continue;
            }
            kv_slots_put(&s->hs, b->type, b->slot);
        }
        need[b->type]++;
        s->ahead_q[k++] = id;
    }
    s->ahead_n = k;
    if (s->spill)
        kv_spill_submit(s->spill);
    /* room for the rest, from what may be spilled (what read-ahead itself wants stays) */
    const char *why;
    while (k && !kv_slots_fit(&s->hs, need, (uint64_t[2]){s->spilling_n[0], s->spilling_n[1]}))
        if (spill_one(s, &why, 1) <= 0)
            break;
    if (s->spill)
        kv_spill_submit(s->spill);
}

/* ------------------------------------------------------------------ sequences */

kv_seq *srv_seq_get(rekv_kvstore_server *s, uint64_t id)
{
    uint64_t *v = kv_map_get(&s->seqs, id);
    return v ? (kv_seq *)(uintptr_t)*v : NULL;
}

void srv_seq_free_mem(rekv_kvstore_server *s, kv_seq *q)
{
    if (q == NULL)
        return;
    if (q->blocks)
        for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++)
            free(q->blocks[l]);
    free(q->blocks);
    free(q->owner);
    free(q);
}

/* ------------------------------------------------------------------ I/O completions */

void srv_on_completions(rekv_kvstore_server *s)
{
    kv_spill_done d[64];
    int n;
    int any = 0;
    while ((n = kv_spill_reap(s->spill, d, 64, 0)) > 0) {
        any = 1;
        for (int i = 0; i < n; i++) {
            if (d[i].tag == PROBE_TAG) {
                probe_done(s, d[i].res);
                continue;
            }
            uint32_t id = (uint32_t)d[i].tag;
            kv_block *b = &s->blocks[id];
            size_t bytes = srv_blk_bytes(s, b);
            if (!d[i].is_read) {
                s->spills_in_flight--;
                s->spilling_n[b->type]--;
                srv_hist_add(&s->hist[H_SPILL_WRITE], d[i].ns);
                if (b->doomed) {
                    slot_put(s, b);
                    if (d[i].res == 0)
                        fslot_put(s, b->fslot);
                    else
                        kv_spill_slot_bad(s->spill, b->fslot);
                    srv_block_release_id(s, id);
                } else if (d[i].res < 0) {
                    kv_spill_slot_bad(s->spill, b->fslot);
                    b->state = BS_HOST; /* kept in memory */
                    spill_failing(s, d[i].res, "spill write failed");
                    srv_lru_update(s, id, 1);
                } else if (b->touched || b->pins || b->holds) {
                    fslot_put(s, b->fslot);
                    b->state = BS_HOST;
                    srv_lru_update(s, id, 1);
                } else {
                    b->state = BS_DISK;
                    slot_put(s, b);
                    s->host_n[b->type]--;
                    s->disk_n[b->type]++;
                    s->bytes_spilled += bytes;
                    srv_persist_block(s, id); /* a cached block on disk survives a restart */
                }
            } else {
                s->reads_in_flight--;
                srv_hist_add(&s->hist[H_SPILL_READ], d[i].ns);
                if (b->doomed) {
                    slot_put(s, b);
                    srv_persist_drop(s, b);
                    fslot_put(s, b->fslot);
                    srv_block_release_id(s, id);
                } else if (d[i].res < 0 || d[i].crc != b->crc) {
                    slot_put(s, b);
                    b->state = BS_DISK;
                    b->ahead = AH_NONE;
                    b->load_err = d[i].res < 0 ? d[i].res : -EBADMSG;
                    if (d[i].res == 0)
                        s->crc_errors++;
                    else
                        s->read_errors++;
                    srv_event_rl(s, SRV_RL_READ_BACK, REKV_KV_EVENT_ERROR,
                                 "read-back of sequence %llu layer %u block %u failed: %s",
                                 (unsigned long long)b->seq, b->layer, b->lblock,
                                 d[i].res < 0 ? strerror(-d[i].res) : "CRC32C mismatch");
                    b->hit_read = 0;
                    if (b->centry != NIL && srv_cache_evictable(s, b->centry))
                        srv_cache_evict(s, b->centry); /* no later prefix may take it */
                } else {
                    srv_persist_drop(s, b); /* in memory now: its slot goes back */
                    fslot_put(s, b->fslot);
                    b->state = BS_HOST;
                    s->disk_n[b->type]--;
                    s->host_n[b->type]++;
                    s->bytes_read_back += bytes;
                    if (b->hit_read) {
                        s->px_hit_read_bytes += bytes;
                        b->hit_read = 0;
                    }
                    if (b->ahead == AH_READING) {
                        s->read_ahead_blocks++;
                        s->read_ahead_bytes += bytes;
                        /* a pin waiting for it has it now; else keep it for the pin to come */
                        b->ahead = b->pins || b->holds ? AH_NONE : AH_READY;
                    }
                    srv_lru_update(s, id, 1);
                }
            }
        }
    }
    if (any) {
        srv_run_pending(s);
        srv_ahead_pump(s); /* after the pins: they come first for the slots freed */
    }
}
