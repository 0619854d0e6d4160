/* handlers.c — the kvstore server's requests, from the ROUTER socket's frames to the reply: the
 * request is unpacked, its sender's client record found (renewing its lease), the body dispatched
 * to its handler (CreateSeq, DropSeq, DropOwner, Free, Append, GetTable, Plan and pin, Unpin,
 * Renew, Stats; Push and Release are push.c's, Lookup, Publish and ClearCache prefix.c's), and the
 * reply packed and sent in one frame.
 *
 * Requests that need I/O (a pin of spilled blocks, an append that needs room) are parked and run
 * again from the start whenever I/O completes; a parked request holds the blocks it found resident
 * so that its own progress is never spilled away. A request waits only while I/O it depends on is
 * in flight; otherwise it fails with -ENOMEM and a reason, so nothing waits forever. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"
#include "kvstore/server_internal.h"

#define MAX_PLAN_BLOCKS (1u << 22)

/* ------------------------------------------------------------------ request context */

void *srv_reply_alloc(kv_reply *r, size_t n, size_t elem)
{
    if (r->n_allocs == 8)
        return NULL;
    void *p = calloc(n ? n : 1, elem);
    if (p)
        r->allocs[r->n_allocs++] = p;
    return p;
}

int srv_fail(kv_reply *r, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err, sizeof(r->err), fmt, ap);
    va_end(ap);
    r->resp.status = code;
    r->resp.error = r->err;
    return 0;
}

#define WAIT 1

static void pending_release_holds(rekv_kvstore_server *s, kv_pending *p)
{
    for (size_t i = 0; i < p->n_holds; i++) {
        uint32_t id = p->holds[i];
        kv_block *b = &s->blocks[id];
        /* never freed while held: free_blocks and srv_owned_seq_busy refuse held blocks */
        REKV_ASSERT(b->holds > 0 && !b->doomed && b->state != BS_UNUSED);
        b->holds--;
        srv_lru_update(s, id, 0);
    }
    p->n_holds = 0;
}

static int pending_hold(rekv_kvstore_server *s, kv_pending *p, uint32_t id)
{
    if (srv_grow((void **)&p->holds, &p->cap_holds, p->n_holds + 1, sizeof(uint32_t)) < 0)
        return -ENOMEM;
    p->holds[p->n_holds++] = id;
    s->blocks[id].holds++;
    srv_lru_update(s, id, 0);
    return 0;
}

/* Resolves ranges into s->scratch (block ids, in order); *n_out: how many. */
static int resolve_ranges(rekv_kvstore_server *s, Rekv__Kvstore__Range **ranges, size_t n,
                          size_t *n_out, kv_reply *r)
{
    size_t total = 0;
    if (n > MAX_PLAN_BLOCKS)
        return srv_fail(r, -EINVAL, "too many ranges (%zu)", n), -EINVAL;
    for (size_t i = 0; i < n; i++) {
        Rekv__Kvstore__Range *rg = ranges[i];
        kv_seq *q = srv_seq_get(s, rg->seq);
        if (q == NULL)
            return srv_fail(r, -ENOENT, "range %zu: no sequence %llu", i,
                            (unsigned long long)rg->seq),
                   -ENOENT;
        if (rg->layer >= s->cfg.geometry.n_layers)
            return srv_fail(r, -EINVAL, "range %zu: layer %u out of range (%u layers)", i,
                            rg->layer, s->cfg.geometry.n_layers),
                   -EINVAL;
        if (rg->token_begin > rg->token_end || rg->token_end > q->n_tokens)
            return srv_fail(r, -EINVAL, "range %zu: tokens [%llu, %llu) outside [0, %llu)", i,
                            (unsigned long long)rg->token_begin, (unsigned long long)rg->token_end,
                            (unsigned long long)q->n_tokens),
                   -EINVAL;
        if (rg->token_begin == rg->token_end)
            continue;
        uint64_t b0 = rg->token_begin / REKV_KV_BLOCK_TOKENS;
        uint64_t b1 = (rg->token_end - 1) / REKV_KV_BLOCK_TOKENS + 1;
        if (total + (b1 - b0) > MAX_PLAN_BLOCKS)
            return srv_fail(r, -EINVAL, "request covers more than %u blocks", MAX_PLAN_BLOCKS),
                   -EINVAL;
        if (srv_grow((void **)&s->scratch, &s->cap_scratch, total + (b1 - b0), sizeof(uint32_t)) <
            0)
            return srv_fail(r, -ENOMEM, "out of memory"), -ENOMEM;
        for (uint64_t b = b0; b < b1; b++) {
            uint32_t id = q->blocks[rg->layer][b];
            if (id == NIL)
                return srv_fail(r, -ENOENT,
                                "range %zu: block %llu of sequence %llu layer %u was freed", i,
                                (unsigned long long)b, (unsigned long long)rg->seq, rg->layer),
                       -ENOENT;
            s->scratch[total++] = id;
        }
    }
    *n_out = total;
    return 0;
}

/* ------------------------------------------------------------------ handlers */

static int h_create(rekv_kvstore_server *s, kv_client *c, kv_pending *p,
                    Rekv__Kvstore__CreateSeq *m, kv_reply *r)
{
    if (m->seq == KV_MAP_EMPTY)
        return srv_fail(r, -EINVAL, "sequence id %llu is reserved", (unsigned long long)m->seq);
    if (srv_seq_get(s, m->seq))
        return srv_fail(r, -EEXIST, "sequence %llu exists", (unsigned long long)m->seq);
    if (m->prefix && srv_cache_fetch(s, p, m->prefix))
        return WAIT; /* the remote tier is asked for what is not here: made when it answers */
    kv_seq *q = calloc(1, sizeof(*q));
    if (q)
        q->blocks = calloc(s->cfg.geometry.n_layers, sizeof(uint32_t *));
    if (q && c->owner[0])
        q->owner = strdup(c->owner);
    if (q == NULL || q->blocks == NULL || (c->owner[0] && q->owner == NULL) ||
        kv_map_put(&s->seqs, m->seq, (uintptr_t)q) < 0) {
        srv_seq_free_mem(s, q);
        return srv_fail(r, -ENOMEM, "out of memory creating sequence");
    }
    q->id = m->seq;
    if (m->prefix && srv_cache_take(s, q, m->prefix, r) < 0) { /* took nothing */
        kv_map_del(&s->seqs, m->seq);
        srv_seq_free_mem(s, q);
    }
    return 0;
}

/* Frees blocks [b0, b1) of layers [l0, l1); refuses (-EBUSY) when someone else pins or holds one
 * that this sequence holds the last reference of. A block shared with other sequences or the
 * prefix cache only loses this sequence's reference, whoever pins it. Later positions first, so that a cached chain's end is spilled first. */
static int free_blocks(rekv_kvstore_server *s, kv_client *c, kv_seq *q, uint32_t l0, uint32_t l1,
                       uint64_t b0, uint64_t b1, kv_reply *r)
{
    if (b1 > q->n_blocks)
        b1 = q->n_blocks;
    for (uint32_t l = l0; l < l1; l++)
        for (uint64_t b = b0; b < b1; b++) {
            uint32_t id = q->blocks[l][b];
            if (id == NIL)
                continue;
            uint64_t *mine = c ? kv_map_get(&c->pins, id) : NULL;
            uint32_t own = mine ? (uint32_t)*mine : 0;
            if (s->blocks[id].refs == 1 && (s->blocks[id].pins > own || s->blocks[id].holds > 0))
                return srv_fail(r, -EBUSY,
                                "sequence %llu layer %u block %llu is pinned by another client",
                                (unsigned long long)q->id, l, (unsigned long long)b),
                       -EBUSY;
        }
    for (uint32_t l = l0; l < l1; l++)
        for (uint64_t b = b1; b-- > b0;) {
            uint32_t id = q->blocks[l][b];
            if (id == NIL)
                continue;
            /* the caller's pins go with the last reference; on a shared block they stay (it may
             * pin it through another sequence, and unpins it through that one) */
            uint64_t *mine = c && s->blocks[id].refs == 1 ? kv_map_get(&c->pins, id) : NULL;
            if (mine) {
                s->blocks[id].pins -= (uint32_t)*mine;
                kv_map_del(&c->pins, id);
            }
            srv_block_unref(s, id);
            q->blocks[l][b] = NIL;
        }
    return 0;
}

static int h_drop(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__DropSeq *m, kv_reply *r)
{
    kv_seq *q = srv_seq_get(s, m->seq);
    if (q == NULL)
        return srv_fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (free_blocks(s, c, q, 0, s->cfg.geometry.n_layers, 0, q->n_blocks, r) < 0)
        return 0;
    kv_map_del(&s->seqs, m->seq);
    srv_seq_free_mem(s, q);
    return 0;
}

static int h_drop_owner(rekv_kvstore_server *s, Rekv__Kvstore__DropOwner *m, kv_reply *r)
{
    const char *owner = m->owner ? m->owner : "";
    if (owner[0] == '\0' || strlen(owner) > MAX_OWNER)
        return srv_fail(r, -EINVAL, "drop owner: the owner name must have 1 to %d bytes",
                        MAX_OWNER);
    uint64_t *ids;
    size_t n;
    if (srv_owner_seqs(s, owner, &ids, &n) < 0)
        return srv_fail(r, -ENOMEM, "out of memory");
    /* a parked request holding one of the blocks goes first: it waits only for I/O in flight */
    for (size_t i = 0; i < n; i++)
        if (srv_owned_seq_busy(s, srv_seq_get(s, ids[i]), owner) == OWNED_HELD) {
            free(ids);
            return WAIT;
        }
    uint64_t seqs = 0, blocks = 0, busy = 0, busy_id = 0;
    for (size_t i = 0; i < n; i++) {
        kv_seq *q = srv_seq_get(s, ids[i]);
        if (srv_owned_seq_busy(s, q, owner) != OWNED_FREE) {
            if (busy++ == 0)
                busy_id = ids[i];
            continue;
        }
        blocks += srv_owned_seq_drop(s, q, owner);
        seqs++;
    }
    free(ids);
    if (seqs)
        srv_event(s, REKV_KV_EVENT_INFO,
                  "owner %s: dropped its sequences on request (%llu, %llu blocks)", owner,
                  (unsigned long long)seqs, (unsigned long long)blocks);
    if (busy)
        return srv_fail(r, -EBUSY,
                        "owner %s: dropped %llu sequences; %llu left because a client of another "
                        "owner pins them (sequence %llu)",
                        owner, (unsigned long long)seqs, (unsigned long long)busy,
                        (unsigned long long)busy_id);
    r->drop_owner.sequences = seqs;
    r->drop_owner.blocks = blocks;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_DROP_OWNER;
    r->resp.drop_owner = &r->drop_owner;
    return 0;
}

static int h_free(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Free *m, kv_reply *r)
{
    kv_seq *q = srv_seq_get(s, m->seq);
    if (q == NULL)
        return srv_fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (m->layer_begin > m->layer_end || m->layer_end > s->cfg.geometry.n_layers ||
        m->block_begin > m->block_end)
        return srv_fail(r, -EINVAL, "free: bad layer or block range");
    free_blocks(s, c, q, m->layer_begin, m->layer_end, m->block_begin, m->block_end, r);
    return 0;
}

/* Bytes the spill tier can still take (spill.c kv_spill_room: --spill-bytes less what it holds,
 * never more than the filesystem's free space now plus what the file holds unused); none while
 * it fails (blocks.c spill_failing: nothing is spilled until a probe write succeeds). */
static uint64_t spill_room(const rekv_kvstore_server *s)
{
    return s->spill_fail ? 0 : kv_spill_room(s->spill);
}

static int h_append(rekv_kvstore_server *s, Rekv__Kvstore__Append *m, kv_reply *r)
{
    kv_seq *q = srv_seq_get(s, m->seq);
    if (q == NULL)
        return srv_fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (m->n_tokens > (1ull << 31) || q->n_tokens + m->n_tokens > (1ull << 31))
        return srv_fail(r, -EINVAL, "append of %llu tokens is too long",
                        (unsigned long long)m->n_tokens);
    if (m->kv_parts > 1024 || m->act_parts > 1024)
        return srv_fail(r, -EINVAL, "KV:ACT pattern %u:%u out of range", m->kv_parts, m->act_parts);
    uint32_t L = s->cfg.geometry.n_layers;
    uint64_t nb = (q->n_tokens + m->n_tokens + REKV_KV_BLOCK_TOKENS - 1) / REKV_KV_BLOCK_TOKENS;
    uint64_t add = nb - q->n_blocks;
    uint64_t need = add * L;
    /* block types by HybridServe's allocation rule, from the sequence's current counts; every
     * layer gets the same types, and each type its own slot class */
    uint64_t n_kv = q->n_kv, n_act = q->n_blocks - q->n_kv, kv_end = n_kv, act_end = n_act;
    for (uint64_t b = q->n_blocks; b < nb; b++) {
        if (rekv_kv_next_block_type(kv_end, act_end, m->kv_parts, m->act_parts) ==
            REKV_KV_BLOCK_KV)
            kv_end++;
        else
            act_end++;
    }
    uint64_t need_t[2] = {(kv_end - n_kv) * L, (act_end - n_act) * L};
    char why[512];
    int rc = srv_ensure_room(s, need_t, why, sizeof(why));
    if (rc == WAIT)
        return WAIT;
    /* no room in the arena now (pinned, or more than it holds): with a spill tier the new blocks
     * are made without a slot, which each takes when first planned (a step pinning layer windows
     * needs only its window resident, so the append must not need all layers at once) */
    int fresh = rc < 0;
    if (rc < 0) {
        if (s->spill == NULL || s->spill_err != 0 || s->spill_fail)
            return srv_fail(r, -ENOMEM, "append %llu tokens to sequence %llu: %s",
                            (unsigned long long)m->n_tokens, (unsigned long long)m->seq, why);
        uint64_t want = (need_t[0] + need_t[1]) * s->hs.big_bytes, room = spill_room(s);
        while (want > room && srv_cache_evict_disk(s)) /* running sequences win */
            room = spill_room(s);
        /* a block being read back holds its spill slot until the read completes: wait for it
         * rather than fail on room that is about to come back */
        if (want > room && s->reads_in_flight > 0)
            return WAIT;
        if (want > room)
            return srv_fail(r, -ENOMEM,
                            "append %llu tokens to sequence %llu: its %llu blocks need %llu bytes "
                            "on the spill tier, which has %llu free (%s)",
                            (unsigned long long)m->n_tokens, (unsigned long long)m->seq,
                            (unsigned long long)(need_t[0] + need_t[1]), (unsigned long long)want,
                            (unsigned long long)room, why);
    }
    if (nb > q->cap) {
        uint32_t ncap = q->cap ? q->cap : 8;
        while (ncap < nb)
            ncap *= 2;
        for (uint32_t l = 0; l < L; l++) {
            uint32_t *p = realloc(q->blocks[l], ncap * sizeof(uint32_t));
            if (p == NULL)
                return srv_fail(r, -ENOMEM, "out of memory growing a block table");
            q->blocks[l] = p;
        }
        q->cap = ncap;
    }
    /* take ids first so that a failure leaves nothing half done */
    if (srv_grow((void **)&s->scratch, &s->cap_scratch, need, sizeof(uint32_t)) < 0)
        return srv_fail(r, -ENOMEM, "out of memory");
    for (uint64_t i = 0; i < need; i++) {
        if (srv_block_new(s, &s->scratch[i]) < 0) {
            for (uint64_t j = 0; j < i; j++)
                srv_block_release_id(s, s->scratch[j]);
            return srv_fail(r, -ENOMEM, "out of memory for block records");
        }
    }
    uint64_t k = 0;
    for (uint32_t l = 0; l < L; l++) {
        uint64_t kv_l = n_kv, act_l = n_act;
        for (uint64_t b = q->n_blocks; b < nb; b++) {
            uint32_t id = s->scratch[k++];
            kv_block *blk = &s->blocks[id];
            blk->seq = q->id;
            blk->layer = l;
            blk->lblock = (uint32_t)b;
            blk->type = rekv_kv_next_block_type(kv_l, act_l, m->kv_parts, m->act_parts);
            if (blk->type == REKV_KV_BLOCK_KV)
                kv_l++;
            else
                act_l++;
            q->blocks[l][b] = id;
            if (fresh) {
                blk->state = BS_FRESH;
                s->disk_n[blk->type]++;
                continue;
            }
            blk->state = BS_HOST;
            int taken = srv_slot_take(s, id);
            REKV_ASSERT(taken == 0); /* srv_ensure_room said they fit */
            s->host_n[blk->type]++;
            srv_lru_update(s, id, 0);
        }
        if (l == 0)
            q->n_kv = (uint32_t)kv_l;
    }
    q->n_blocks = (uint32_t)nb;
    q->n_tokens += m->n_tokens;
    r->append.n_tokens = q->n_tokens;
    r->append.new_blocks = need;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_APPEND;
    r->resp.append = &r->append;
    return 0;
}

static int h_table(rekv_kvstore_server *s, Rekv__Kvstore__GetTable *m, kv_reply *r)
{
    kv_seq *q = srv_seq_get(s, m->seq);
    if (q == NULL)
        return srv_fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (m->layer >= s->cfg.geometry.n_layers)
        return srv_fail(r, -EINVAL, "layer %u out of range", m->layer);
    size_t n = q->n_blocks;
    uint32_t *type = srv_reply_alloc(r, n, sizeof(uint32_t));
    uint32_t *tier = srv_reply_alloc(r, n, sizeof(uint32_t));
    uint64_t *phys = srv_reply_alloc(r, n, sizeof(uint64_t));
    if (!type || !tier || !phys)
        return srv_fail(r, -ENOMEM, "out of memory");
    for (size_t b = 0; b < n; b++) {
        uint32_t id = q->blocks[m->layer][b];
        if (id == NIL) {
            type[b] = 0;
            tier[b] = REKV_KV_TIER_FREE;
            phys[b] = 0;
            continue;
        }
        kv_block *k = &s->blocks[id];
        type[b] = k->type;
        int host = k->state == BS_HOST || k->state == BS_SPILLING;
        tier[b] = host ? REKV_KV_TIER_HOST : REKV_KV_TIER_DISK;
        phys[b] = host ? k->slot : k->fslot;
    }
    r->table.n_tokens = q->n_tokens;
    r->table.n_type = r->table.n_tier = r->table.n_phys = n;
    r->table.type = type;
    r->table.tier = tier;
    r->table.phys = phys;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_TABLE;
    r->resp.table = &r->table;
    return 0;
}

/* Undoes the pins a plan recorded for its first n blocks (s->scratch[0..n)). */
static void unpin_first(rekv_kvstore_server *s, kv_client *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t id = s->scratch[i];
        uint64_t *v = kv_map_get(&c->pins, id);
        if (v && --*v == 0)
            kv_map_del(&c->pins, id);
        s->blocks[id].pins--;
    }
}

/* The sequence of the range that block i of a plan (s->scratch's order) belongs to. */
static uint64_t range_seq_of(Rekv__Kvstore__Range **ranges, size_t n, size_t i)
{
    for (size_t k = 0; k < n; k++) {
        const Rekv__Kvstore__Range *rg = ranges[k];
        uint64_t nb = rg->token_begin == rg->token_end
                          ? 0
                          : (rg->token_end - 1) / REKV_KV_BLOCK_TOKENS + 1 -
                                rg->token_begin / REKV_KV_BLOCK_TOKENS;
        if (i < nb)
            return rg->seq;
        i -= nb;
    }
    return 0;
}

/* A plan that met its i-th block b lost (its read-back failed): fails, naming the sequence. */
static int plan_lost_block(rekv_kvstore_server *s, Rekv__Kvstore__Plan *m, size_t i, kv_block *b,
                           kv_reply *r)
{
    const char *why = b->load_err == -EBADMSG ? "CRC32C mismatch" : strerror(-b->load_err);
    const kv_seq *q = srv_seq_get(s, range_seq_of(m->ranges, m->n_ranges, i));
    if (q && b->lblock < q->n_taken) {
        /* a block the sequence took from the prefix cache: dropped from it (blocks.c), so the
         * sequences that took it run again and compute it (-EAGAIN: a failure that passes); a
         * block a sequence computed itself fails its owner, as any lost block */
        if (b->centry != NIL && srv_cache_evictable(s, b->centry))
            srv_cache_evict(s, b->centry);
        r->resp.lost_seq = q->id;
        return srv_fail(r, -EAGAIN,
                        "a cached block (layer %u) failed its read-back (%s): dropped from the "
                        "prefix cache; run the sequences that took it again",
                        b->layer, why);
    }
    r->resp.lost_seq = b->seq; /* the client fails that sequence's owner, not the rest */
    return srv_fail(r, b->load_err, "sequence %llu layer %u block %u: read-back failed: %s",
                    (unsigned long long)b->seq, b->layer, b->lblock, why);
}

static int h_plan(rekv_kvstore_server *s, kv_client *c, kv_pending *p, Rekv__Kvstore__Plan *m,
                  kv_reply *r)
{
    pending_release_holds(s, p);
    size_t n;
    if (resolve_ranges(s, m->ranges, m->n_ranges, &n, r) < 0)
        return 0;
    /* hold everything resident, start reads for what is on disk */
    uint64_t need_slots[2] = {0, 0};
    size_t not_ready = 0;
    int first_run = p->runs++ == 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = s->scratch[i];
        kv_block *b = &s->blocks[id];
        if (m->pin && b->ahead != AH_READING)
            b->ahead = AH_NONE; /* pinned now: read-ahead is done with it */
        if (first_run && m->pin && (b->state == BS_DISK || b->state == BS_LOADING)) {
            p->waits++; /* this pin waits for its read: on the critical path */
            p->wait_bytes += srv_blk_bytes(s, b);
        }
        if (b->state == BS_FRESH) { /* never written: a slot, no read */
            if (srv_slot_take(s, id) < 0) {
                need_slots[b->type]++;
                not_ready++;
                continue;
            }
            b->state = BS_HOST;
            s->disk_n[b->type]--;
            s->host_n[b->type]++;
        }
        if (b->state == BS_DISK && b->load_err)
            return plan_lost_block(s, m, i, b, r);
        if (b->state == BS_DISK && s->spill != NULL) {
            if (kv_spill_in_flight(s->spill) < kv_spill_depth(s->spill) &&
                srv_slot_take(s, id) == 0) {
                if (kv_spill_read(s->spill, kv_slots_offset(&s->hs, b->slot), b->fslot,
                                  srv_blk_bytes(s, b), id) != 0) {
                    kv_slots_put(&s->hs, b->type, b->slot);
                } else {
                    b->state = BS_LOADING;
                    s->reads_in_flight++;
                    p->misses++;
                }
            }
        }
        if (b->state == BS_DISK) {
            need_slots[b->type]++;
            not_ready++;
            continue;
        }
        if (b->state == BS_LOADING)
            not_ready++;
        /* held until the reply: neither spilled nor freed while the rest arrives */
        if (pending_hold(s, p, id) < 0)
            return srv_fail(r, -ENOMEM, "out of memory");
    }
    if (not_ready) {
        if (need_slots[0] + need_slots[1]) {
            char why[512];
            int rc = srv_ensure_room(s, need_slots, why, sizeof(why));
            if (rc < 0 && s->reads_in_flight == 0)
                return srv_fail(r, -ENOMEM, "pin: %s", why);
        }
        return WAIT;
    }
    /* all resident: answer */
    size_t n_ranges = m->n_ranges;
    uint32_t *rc_arr = srv_reply_alloc(r, n_ranges, sizeof(uint32_t));
    uint64_t *blk = srv_reply_alloc(r, n, sizeof(uint64_t));
    uint32_t *type = srv_reply_alloc(r, n, sizeof(uint32_t));
    uint64_t *off = srv_reply_alloc(r, n, sizeof(uint64_t));
    uint32_t *first = srv_reply_alloc(r, n, sizeof(uint32_t));
    uint32_t *count = srv_reply_alloc(r, n, sizeof(uint32_t));
    if (!rc_arr || !blk || !type || !off || !first || !count)
        return srv_fail(r, -ENOMEM, "out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n_ranges; i++) {
        Rekv__Kvstore__Range *rg = m->ranges[i];
        uint32_t cnt = 0;
        if (rg->token_begin < rg->token_end) {
            uint64_t b0 = rg->token_begin / REKV_KV_BLOCK_TOKENS;
            uint64_t b1 = (rg->token_end - 1) / REKV_KV_BLOCK_TOKENS + 1;
            for (uint64_t b = b0; b < b1; b++, k++, cnt++) {
                kv_block *kb = &s->blocks[s->scratch[k]];
                uint64_t t0 = b * REKV_KV_BLOCK_TOKENS, t1 = t0 + REKV_KV_BLOCK_TOKENS;
                uint64_t a = rg->token_begin > t0 ? rg->token_begin : t0;
                uint64_t e = rg->token_end < t1 ? rg->token_end : t1;
                blk[k] = b;
                type[k] = kb->type;
                off[k] = srv_blk_offset(s, kb);
                first[k] = (uint32_t)(a - t0);
                count[k] = (uint32_t)(e - a);
            }
        }
        rc_arr[i] = cnt;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t id = s->scratch[i];
        kv_block *b = &s->blocks[id];
        if (b->state == BS_SPILLING)
            b->touched = 1;
        if (m->pin) {
            uint64_t *v = kv_map_get(&c->pins, id);
            if (v) {
                (*v)++;
            } else if (kv_map_put(&c->pins, id, 1) < 0) {
                unpin_first(s, c, i); /* the plan fails whole: none of its pins stay */
                return srv_fail(r, -ENOMEM, "out of memory recording pins");
            }
            b->pins++;
        }
        srv_lru_update(s, id, 1);
    }
    if (m->pin) {
        s->pin_misses += p->misses;
        s->pin_hits += n > p->misses ? n - p->misses : 0;
        s->pin_wait_blocks += p->waits;
        s->pin_wait_bytes += p->wait_bytes;
    }
    if (m->n_ahead) { /* the next window: read back while the caller computes this one */
        size_t na;
        kv_reply ra;
        srv_reply_init(&ra, 0);
        if (resolve_ranges(s, m->ahead, m->n_ahead, &na, &ra) == 0) {
            srv_ahead_add(s, s->scratch, na);
            srv_ahead_pump(s);
        } /* else a hint that names what is gone: ignored */
    }
    r->plan.n_range_count = n_ranges;
    r->plan.range_count = rc_arr;
    r->plan.n_block = r->plan.n_type = r->plan.n_offset = r->plan.n_first = r->plan.n_count = n;
    r->plan.block = blk;
    r->plan.type = type;
    r->plan.offset = off;
    r->plan.first = first;
    r->plan.count = count;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_PLAN;
    r->resp.plan = &r->plan;
    return 0;
}

static int h_unpin(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Unpin *m, kv_reply *r)
{
    size_t n;
    if (resolve_ranges(s, m->ranges, m->n_ranges, &n, r) < 0)
        return 0;
    size_t done = 0;
    for (; done < n; done++) {
        uint32_t id = s->scratch[done];
        uint64_t *v = kv_map_get(&c->pins, id);
        if (v == NULL || *v == 0)
            break;
        (*v)--;
    }
    if (done < n) {
        kv_block *b = &s->blocks[s->scratch[done]];
        for (size_t i = 0; i < done; i++)
            (*kv_map_get(&c->pins, s->scratch[i]))++;
        return srv_fail(r, -EINVAL,
                        "unpin: sequence %llu layer %u block %u is not pinned by this client",
                        (unsigned long long)b->seq, b->layer, b->lblock);
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t id = s->scratch[i];
        uint64_t *v = kv_map_get(&c->pins, id);
        if (v && *v == 0)
            kv_map_del(&c->pins, id);
        s->blocks[id].pins--;
        if (m->done)
            srv_lru_done(s, id);
        else
            srv_lru_update(s, id, 0);
    }
    if (m->done)
        srv_ahead_pump(s); /* what is done may make room for what read-ahead waits for */
    return 0;
}

static int h_stats(rekv_kvstore_server *s, kv_reply *r)
{
    Rekv__Kvstore__StatsReply *st = &r->stats;
    st->host_kv = s->host_n[0];
    st->host_act = s->host_n[1];
    st->disk_kv = s->disk_n[0];
    st->disk_act = s->disk_n[1];
    st->free_slots = s->hs.n_free_big;
    st->total_slots = s->hs.n_big;
    st->host_bytes = (uint64_t)s->hs.n_big * s->hs.big_bytes;
    st->host_free_bytes = kv_slots_free_bytes(&s->hs);
    st->host_used_bytes = s->hs.used_bytes;
    st->kv_slot_bytes = kv_slots_class_bytes(&s->hs, REKV_KV_BLOCK_KV);
    st->act_slot_bytes = kv_slots_class_bytes(&s->hs, REKV_KV_BLOCK_ACT);
    st->spill_bytes = s->spill == NULL ? 0 : s->cfg.spill_bytes ? s->cfg.spill_bytes : UINT64_MAX;
    st->spill_used_bytes =
        s->spill ? kv_spill_slots_used(s->spill) * (uint64_t)s->hs.big_bytes : 0;
    st->instance = s->instance;
    st->pin_wait_blocks = s->pin_wait_blocks;
    st->pin_wait_bytes = s->pin_wait_bytes;
    st->read_ahead_blocks = s->read_ahead_blocks;
    st->read_ahead_bytes = s->read_ahead_bytes;
    /* a failing tier can take nothing more: admission prices the arena alone */
    st->spill_room_bytes =
        s->spill == NULL || s->spill_fail ? 0 : st->spill_used_bytes + spill_room(s);
    uint64_t pinned = 0;
    for (uint32_t i = 0; i < s->n_block_ids; i++)
        if (s->blocks[i].state != BS_UNUSED && s->blocks[i].pins > 0)
            pinned++;
    st->pinned_blocks = pinned;
    st->bytes_spilled = s->bytes_spilled;
    st->bytes_read_back = s->bytes_read_back;
    st->pin_hits = s->pin_hits;
    st->pin_misses = s->pin_misses;
    st->spill_errors = s->spill_errors;
    st->crc_errors = s->crc_errors;
    st->read_errors = s->read_errors;
    st->sequences = s->seqs.len;
    uint64_t nc = 0;
    for (kv_client *c = s->clients; c; c = c->next)
        nc++;
    st->clients = nc;
    st->leases_expired = s->leases_expired;
    st->direct_io = s->spill ? kv_spill_direct(s->spill) : 0;
    st->registered_arena = s->spill ? kv_spill_registered(s->spill) : 0;
    st->spills_in_flight = s->spills_in_flight;
    st->reads_in_flight = s->reads_in_flight;
    st->sequences_reclaimed = s->sequences_reclaimed;
    st->prefix_lookups = s->px_lookups;
    st->prefix_hit_tokens = s->px_hit_tokens;
    st->prefix_hit_host_blocks = s->px_hit_host;
    st->prefix_hit_disk_blocks = s->px_hit_disk;
    st->prefix_evictions = s->px_evictions;
    st->prefix_hit_read_bytes = s->px_hit_read_bytes;
    st->prefix_published_blocks = s->px_published;
    st->prefix_entries = s->ce_live;
    st->prefix_cached_blocks = s->ce_live * s->cfg.geometry.n_layers;
    uint64_t cache_only = 0; /* the cache's list: resident, unpinned, only the cache holds them */
    for (uint32_t id = s->cache_head; id != NIL; id = s->blocks[id].next)
        cache_only += kv_slots_class_bytes(&s->hs, s->blocks[id].type);
    st->prefix_host_bytes = cache_only;
    for (int i = 0; i < H_COUNT; i++) {
        Rekv__Kvstore__Histogram init = REKV__KVSTORE__HISTOGRAM__INIT;
        r->hists[i] = init;
        r->hists[i].name = (char *)srv_hist_names[i];
        r->hists[i].n_buckets = REKV_KV_HIST_BUCKETS;
        r->hists[i].buckets = s->hist[i].buckets;
        r->hists[i].count = s->hist[i].count;
        r->hists[i].sum_ns = s->hist[i].sum_ns;
        r->hist_ptrs[i] = &r->hists[i];
    }
    st->n_histograms = H_COUNT;
    st->histograms = r->hist_ptrs;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_STATS;
    r->resp.stats = st;
    return 0;
}

/* ------------------------------------------------------------------ running requests */

/* Runs one request; WAIT when parked, else the reply is in r. */
static int dispatch(rekv_kvstore_server *s, kv_pending *p, kv_reply *r, int *hist)
{
    Rekv__Kvstore__Request *q = p->req;
    kv_client *c = srv_client_get(s, p->ident, p->ident_len, 1);
    *hist = H_OTHER;
    if (c == NULL)
        return srv_fail(r, -ENOMEM, "out of memory for client record");
    c->last_seen = s->now;
    if (q->version != REKV_KVSTORE_PROTO_VERSION)
        return srv_fail(r, -EPROTO, "protocol version %u, this server speaks %u", q->version,
                        REKV_KVSTORE_PROTO_VERSION);
    const char *owner = q->owner ? q->owner : "";
    size_t owner_len = strlen(owner);
    if (owner_len > MAX_OWNER)
        return srv_fail(r, -EINVAL, "owner name of %zu bytes: at most %d", owner_len, MAX_OWNER);
    if (strcmp(c->owner, owner) != 0)
        memcpy(c->owner, owner, owner_len + 1);
    switch (q->body_case) {
    case REKV__KVSTORE__REQUEST__BODY_CREATE_SEQ:
        return h_create(s, c, p, q->create_seq, r);
    case REKV__KVSTORE__REQUEST__BODY_DROP_SEQ:
        return h_drop(s, c, q->drop_seq, r);
    case REKV__KVSTORE__REQUEST__BODY_APPEND:
        *hist = H_APPEND;
        return h_append(s, q->append, r);
    case REKV__KVSTORE__REQUEST__BODY_GET_TABLE:
        return h_table(s, q->get_table, r);
    case REKV__KVSTORE__REQUEST__BODY_PLAN:
        *hist = q->plan->pin ? H_PIN : H_PLAN;
        return h_plan(s, c, p, q->plan, r);
    case REKV__KVSTORE__REQUEST__BODY_UNPIN:
        return h_unpin(s, c, q->unpin, r);
    case REKV__KVSTORE__REQUEST__BODY_FREE:
        return h_free(s, c, q->free, r);
    case REKV__KVSTORE__REQUEST__BODY_RENEW:
        return 0;
    case REKV__KVSTORE__REQUEST__BODY_STATS:
        return h_stats(s, r);
    case REKV__KVSTORE__REQUEST__BODY_DROP_OWNER:
        return h_drop_owner(s, q->drop_owner, r);
    case REKV__KVSTORE__REQUEST__BODY_PUSH:
        return srv_h_push(s, c, q->push, r);
    case REKV__KVSTORE__REQUEST__BODY_RELEASE:
        return srv_h_release(s, c, q->release, r);
    case REKV__KVSTORE__REQUEST__BODY_LOOKUP:
        return srv_h_lookup(s, p, q->lookup, r);
    case REKV__KVSTORE__REQUEST__BODY_PUBLISH:
        return srv_h_publish(s, q->publish, r);
    case REKV__KVSTORE__REQUEST__BODY_CLEAR_CACHE:
        return srv_h_clear_cache(s, r);
    default:
        return srv_fail(r, -EBADMSG, "request %llu has no body", (unsigned long long)q->id);
    }
}

void srv_send_reply(rekv_kvstore_server *s, const uint8_t *ident, size_t ident_len, int delim,
                    Rekv__Kvstore__Response *resp)
{
    size_t len = rekv__kvstore__response__get_packed_size(resp);
    uint8_t stackbuf[512];
    uint8_t *buf = len <= sizeof(stackbuf) ? stackbuf : malloc(len);
    if (buf == NULL)
        return;
    rekv__kvstore__response__pack(resp, buf);
    if (zmq_send(s->zsock, ident, ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0) {
        if (delim)
            zmq_send(s->zsock, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(s->zsock, buf, len, ZMQ_DONTWAIT);
    }
    if (buf != stackbuf)
        free(buf);
}

void srv_reply_init(kv_reply *r, uint64_t id)
{
    memset(r, 0, sizeof(*r));
    Rekv__Kvstore__Response ri = REKV__KVSTORE__RESPONSE__INIT;
    Rekv__Kvstore__AppendReply ai = REKV__KVSTORE__APPEND_REPLY__INIT;
    Rekv__Kvstore__TableReply ti = REKV__KVSTORE__TABLE_REPLY__INIT;
    Rekv__Kvstore__PlanReply pi = REKV__KVSTORE__PLAN_REPLY__INIT;
    Rekv__Kvstore__StatsReply si = REKV__KVSTORE__STATS_REPLY__INIT;
    Rekv__Kvstore__DropOwnerReply di = REKV__KVSTORE__DROP_OWNER_REPLY__INIT;
    Rekv__Kvstore__PushReply pu = REKV__KVSTORE__PUSH_REPLY__INIT;
    Rekv__Kvstore__PrefixReply px = REKV__KVSTORE__PREFIX_REPLY__INIT;
    r->resp = ri;
    r->prefix = px;
    r->push = pu;
    r->drop_owner = di;
    r->append = ai;
    r->table = ti;
    r->plan = pi;
    r->stats = si;
    r->resp.id = id;
}

static void reply_done(kv_reply *r)
{
    for (int i = 0; i < r->n_allocs; i++)
        free(r->allocs[i]);
    r->n_allocs = 0;
}

void srv_pending_free(kv_pending *p)
{
    if (p == NULL)
        return;
    if (p->req)
        rekv__kvstore__request__free_unpacked(p->req, NULL);
    free(p->holds);
    free(p);
}

/* Runs p; replies and returns 1 when finished, 0 when it stays parked. */
static int run_request(rekv_kvstore_server *s, kv_pending *p)
{
    kv_reply *r = malloc(sizeof(*r));
    if (r == NULL)
        return 0; /* try again on the next wakeup */
    srv_reply_init(r, p->req->id);
    int hist;
    int rc = dispatch(s, p, r, &hist);
    if (rc == WAIT) {
        reply_done(r);
        free(r);
        return 0;
    }
    pending_release_holds(s, p);
    srv_send_reply(s, p->ident, p->ident_len, p->delim, &r->resp);
    reply_done(r);
    free(r);
    srv_hist_add(&s->hist[hist], rekv_now_ns() - p->t0);
    return 1;
}

void srv_run_pending(rekv_kvstore_server *s)
{
    kv_pending **pp = &s->pending;
    s->pending_tail = NULL;
    while (*pp) {
        kv_pending *p = *pp;
        if (run_request(s, p)) {
            *pp = p->next;
            srv_pending_free(p);
            continue;
        }
        s->pending_tail = p;
        pp = &p->next;
    }
}

void srv_handle_message(rekv_kvstore_server *s)
{
    zmq_msg_t frames[4];
    size_t nf = 0;
    int more = 1, extra = 0;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->zsock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (nf < 4)
            frames[nf++] = m;
        else {
            zmq_msg_close(&m);
            extra = 1;
        }
    }
    if (nf == 0)
        return;
    kv_pending *p = calloc(1, sizeof(*p));
    size_t il = zmq_msg_size(&frames[0]);
    if (p == NULL || il > MAX_IDENT)
        goto out;
    memcpy(p->ident, zmq_msg_data(&frames[0]), il);
    p->ident_len = il;
    p->t0 = rekv_now_ns();
    size_t body = 1;
    if (nf == 3 && zmq_msg_size(&frames[1]) == 0) {
        p->delim = 1;
        body = 2;
    }
    if (rekv_conncap_over(s->cap, &frames[nf - 1])) {
        /* never served, whatever it asks: the client closes and tries again later */
        rekv_conncap_stats cs;
        rekv_conncap_get_stats(s->cap, &cs);
        kv_reply r;
        srv_reply_init(&r, 0);
        Rekv__Kvstore__Request *rq = rekv__kvstore__request__unpack(
            NULL, zmq_msg_size(&frames[nf - 1]), zmq_msg_data(&frames[nf - 1]));
        if (rq) { /* its id, so that the client takes the answer as this request's */
            r.resp.id = rq->id;
            rekv__kvstore__request__free_unpacked(rq, NULL);
        }
        srv_fail(&r, -EBUSY,
                 "busy: the kvstore serves at most %u connections (--max-clients) and %u are "
                 "open; retry later",
                 cs.max, cs.live);
        srv_send_reply(s, p->ident, p->ident_len, p->delim, &r.resp);
        goto out;
    }
    if (nf != body + 1 || extra) {
        kv_reply r;
        srv_reply_init(&r, 0);
        srv_fail(&r, -EPROTO, "expected one frame per request, got %zu", nf - 1 + (size_t)extra);
        srv_send_reply(s, p->ident, p->ident_len, p->delim, &r.resp);
        goto out;
    }
    p->req = rekv__kvstore__request__unpack(NULL, zmq_msg_size(&frames[body]),
                                            zmq_msg_data(&frames[body]));
    if (p->req == NULL) {
        kv_reply r;
        srv_reply_init(&r, 0);
        srv_fail(&r, -EBADMSG, "malformed request (%zu bytes): not a kvstore Request",
                 zmq_msg_size(&frames[body]));
        srv_send_reply(s, p->ident, p->ident_len, p->delim, &r.resp);
        goto out;
    }
    if (run_request(s, p))
        goto out;
    if (s->pending_tail)
        s->pending_tail->next = p;
    else
        s->pending = p;
    s->pending_tail = p;
    p = NULL;
out:
    srv_pending_free(p);
    for (size_t i = 0; i < nf; i++)
        zmq_msg_close(&frames[i]);
}
