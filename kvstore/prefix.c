/* prefix.c — the kvstore's prefix cache: full blocks addressed by their content, shared by
 * reference count between every sequence that starts with the same tokens.
 *
 * A block position b (16 tokens, every layer) of a sequence is published under a chain key:
 * a hash of the key of position b - 1 (for b = 0 a root of the model's fingerprint, the store's
 * geometry and cache dtype), the block's kind (KV or ACT) and its 16 token ids — so the key names
 * the block's tokens and everything before them. An entry holds the position's block of every
 * layer, each with one reference (kv_block.refs counts the sequence tables holding a block plus
 * the cache's). A sequence made from a prefix (CreateSeq.prefix) takes references to the longest
 * run of cached entries its tokens match, in the request that looks them up, so nothing can
 * evict them in between; it appends only past them (whole blocks), so a shared block is never
 * written, and a sequence that diverges inside a block computes that block itself. Each match
 * checks the entry's parent key and tokens, so a hash collision is a miss, never a wrong block.
 *
 * Eviction: blocks only the cache holds sit on their own list (blocks.c LRU_CACHE), which goes
 * before any running sequence's blocks when room is needed: spilled while the spill tier takes
 * them (a cached block on disk is still a hit), else evicted — the entry's references dropped,
 * its blocks freed. A spill of a sequence's block that finds the spill file at its limit evicts
 * the least recently used entry holding a cached block on disk first. Entries are touched deepest
 * first, so a chain is evicted from its end. An entry one of whose blocks only the cache holds but
 * a client still pins (through a sequence it dropped) or a parked request holds is not evicted
 * until they let go: a freed block must have no pins.
 *
 * With a remote tier (remote.c, --remote): each new entry is queued to be written to Redis, and a
 * CreateSeq or Lookup whose chain stops at a key not held here first asks Redis for the keys that
 * follow (srv_cache_fetch, the request parked until the answer or the timeout); what comes back
 * intact is adopted as entries with blocks in the arena (srv_cache_adopt_host), and the request
 * runs again and matches it like any local entry. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvstore/remote.h"
#include "kvstore/server_internal.h"

#define MAX_PREFIX_TOKENS (1u << 24)

/* ------------------------------------------------------------------ keys */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t hash_words(uint64_t h, const uint64_t *w, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h = mix64(h ^ mix64(w[i] + 0x9e3779b97f4a7c15ull * (i + 1)));
    return h == KV_MAP_EMPTY ? h - 1 : h; /* the map's empty mark is no key */
}

static uint64_t key_root(const rekv_kvstore_server *s, uint64_t fingerprint)
{
    const rekv_kv_geometry *g = &s->cfg.geometry;
    uint64_t w[] = {0x72656b76ull /* "rekv" */, fingerprint, g->n_layers, g->n_kv_heads,
                    g->head_dim,    g->hidden,   (uint64_t)g->dtype,       g->block_tokens};
    return hash_words(0, w, sizeof(w) / sizeof(w[0]));
}

static uint64_t key_chain(uint64_t parent, int kind, const uint32_t *tokens)
{
    uint64_t w[2 + REKV_KV_BLOCK_TOKENS / 2];
    w[0] = parent;
    w[1] = (uint64_t)kind;
    for (int i = 0; i < REKV_KV_BLOCK_TOKENS / 2; i++)
        w[2 + i] = (uint64_t)tokens[2 * i] << 32 | tokens[2 * i + 1];
    return hash_words(parent, w, sizeof(w) / sizeof(w[0]));
}

/* ------------------------------------------------------------------ entries */

void srv_cache_init(rekv_kvstore_server *s)
{
    kv_map_init(&s->cindex);
    s->cache_head = s->cache_tail = NIL;
    s->ce_head = s->ce_tail = NIL;
}

void srv_cache_free(rekv_kvstore_server *s)
{
    for (uint32_t i = 0; i < s->n_centries; i++)
        free(s->centries[i].ids);
    free(s->centries);
    free(s->free_centries);
    kv_map_free(&s->cindex);
}

static void ce_unlink(rekv_kvstore_server *s, uint32_t i)
{
    kv_centry *e = &s->centries[i];
    if (e->prev == NIL && e->next == NIL && s->ce_head != i)
        return; /* not on the list */
    if (e->prev != NIL)
        s->centries[e->prev].next = e->next;
    else
        s->ce_head = e->next;
    if (e->next != NIL)
        s->centries[e->next].prev = e->prev;
    else
        s->ce_tail = e->prev;
    e->prev = e->next = NIL;
}

/* Makes entry i the most recently used. */
static void ce_touch(rekv_kvstore_server *s, uint32_t i)
{
    kv_centry *e = &s->centries[i];
    ce_unlink(s, i);
    e->prev = s->ce_tail;
    if (s->ce_tail != NIL)
        s->centries[s->ce_tail].next = i;
    else
        s->ce_head = i;
    s->ce_tail = i;
}

/* Touches a matched run deepest first, so that its root is the last of it evicted. */
static void ce_touch_run(rekv_kvstore_server *s, const uint32_t *run, size_t n)
{
    for (size_t k = n; k-- > 0;)
        ce_touch(s, run[k]);
}

static int ce_new(rekv_kvstore_server *s, uint32_t *out)
{
    uint32_t i;
    if (s->n_free_centries > 0) {
        i = s->free_centries[--s->n_free_centries];
    } else {
        size_t cap = s->cap_centries;
        if (s->n_centries == NIL - 1 ||
            srv_grow((void **)&s->centries, &cap, (size_t)s->n_centries + 1, sizeof(kv_centry)) <
                0)
            return -ENOMEM;
        s->cap_centries = (uint32_t)cap;
        i = s->n_centries;
        memset(&s->centries[i], 0, sizeof(kv_centry));
        s->centries[i].ids = malloc(sizeof(uint32_t) * s->cfg.geometry.n_layers);
        if (s->centries[i].ids == NULL)
            return -ENOMEM;
        s->n_centries++;
    }
    kv_centry *e = &s->centries[i];
    e->prev = e->next = NIL;
    *out = i;
    return 0;
}

static void ce_release(rekv_kvstore_server *s, uint32_t i)
{
    s->centries[i].live = 0;
    size_t cap = s->cap_free_centries;
    if (srv_grow((void **)&s->free_centries, &cap, (size_t)s->n_free_centries + 1,
                 sizeof(uint32_t)) < 0)
        return; /* the index is lost to reuse; harmless */
    s->cap_free_centries = (uint32_t)cap;
    s->free_centries[s->n_free_centries++] = i;
}

void srv_cache_evict(rekv_kvstore_server *s, uint32_t i)
{
    kv_centry *e = &s->centries[i];
    REKV_ASSERT(e->live && srv_cache_evictable(s, i)); /* a freed block has no pins */
    srv_events_removed(s, i);
    ce_unlink(s, i);
    kv_map_del(&s->cindex, e->key);
    s->ce_live--;
    ce_release(s, i);
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++) {
        uint32_t id = e->ids[l];
        s->blocks[id].centry = NIL;
        srv_block_unref(s, id); /* the last reference frees it */
    }
}

int srv_cache_evictable(const rekv_kvstore_server *s, uint32_t i)
{
    const kv_centry *e = &s->centries[i];
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++) {
        const kv_block *b = &s->blocks[e->ids[l]];
        if (b->refs == 1 && (b->pins || b->holds))
            return 0;
    }
    return 1;
}

int srv_cache_evict_host(rekv_kvstore_server *s)
{
    for (uint32_t id = s->cache_head; id != NIL; id = s->blocks[id].next) {
        uint32_t i = s->blocks[id].centry;
        if (!srv_cache_evictable(s, i))
            continue; /* another layer's block is pinned through a dropped sequence */
        srv_cache_evict(s, i);
        s->px_evictions += s->cfg.geometry.n_layers;
        return 1;
    }
    return 0;
}

int srv_cache_evict_disk(rekv_kvstore_server *s)
{
    for (uint32_t i = s->ce_head; i != NIL; i = s->centries[i].next) {
        const kv_centry *e = &s->centries[i];
        for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++) {
            const kv_block *b = &s->blocks[e->ids[l]];
            if (b->refs == 1 && b->state == BS_DISK && srv_cache_evictable(s, i)) {
                srv_cache_evict(s, i);
                s->px_evictions += s->cfg.geometry.n_layers;
                return 1;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ matching */

static int prefix_check(const Rekv__Kvstore__Prefix *px, kv_reply *r)
{
    if (px == NULL)
        return srv_fail(r, -EINVAL, "prefix: missing"), -EINVAL;
    if (px->n_tokens > MAX_PREFIX_TOKENS)
        return srv_fail(r, -EINVAL, "prefix of %zu tokens is too long", px->n_tokens), -EINVAL;
    if (px->kv_parts > 1024 || px->act_parts > 1024)
        return srv_fail(r, -EINVAL, "prefix: KV:ACT pattern %u:%u out of range", px->kv_parts,
                        px->act_parts),
               -EINVAL;
    return 0;
}

/* The entry of (parent, kind, tokens), or NIL: the key, then the entry's own record of them. */
static uint32_t ce_find(const rekv_kvstore_server *s, uint64_t key, uint64_t parent, int kind,
                        const uint32_t *tokens)
{
    const uint64_t *v = kv_map_get(&s->cindex, key);
    if (v == NULL)
        return NIL;
    const kv_centry *e = &s->centries[*v];
    if (e->parent != parent || e->kind != kind ||
        memcmp(e->tokens, tokens, sizeof(e->tokens)) != 0)
        return NIL; /* a hash collision: a miss */
    return (uint32_t)*v;
}

/* The longest cached run of px's full blocks, their kinds by px's pattern: entry indices into
 * run[] (malloc'd, caller frees), their count returned (<0: out of memory). An entry with a block
 * whose read-back failed ends the run and is evicted. */
static int64_t cache_match(rekv_kvstore_server *s, const Rekv__Kvstore__Prefix *px,
                           uint32_t **run)
{
    size_t n = px->n_tokens / REKV_KV_BLOCK_TOKENS, k = 0;
    *run = malloc(sizeof(uint32_t) * (n ? n : 1));
    if (*run == NULL)
        return -ENOMEM;
    uint64_t key = key_root(s, px->fingerprint), n_kv = 0, n_act = 0;
    for (; k < n; k++) {
        int kind = rekv_kv_next_block_type(n_kv, n_act, px->kv_parts, px->act_parts);
        const uint32_t *tok = px->tokens + k * REKV_KV_BLOCK_TOKENS;
        uint64_t next = key_chain(key, kind, tok);
        uint32_t i = ce_find(s, next, key, kind, tok);
        if (i == NIL)
            break;
        int bad = 0;
        for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++)
            bad |= s->blocks[s->centries[i].ids[l]].load_err != 0;
        if (bad) {
            if (srv_cache_evictable(s, i))
                srv_cache_evict(s, i);
            break;
        }
        (*run)[k] = i;
        key = next;
        if (kind == REKV_KV_BLOCK_KV)
            n_kv++;
        else
            n_act++;
    }
    return (int64_t)k;
}

/* Counts the run's blocks (all layers) by where they are now. */
static void run_tiers(const rekv_kvstore_server *s, const uint32_t *run, size_t n, uint64_t *host,
                      uint64_t *disk)
{
    *host = *disk = 0;
    for (size_t k = 0; k < n; k++)
        for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++) {
            uint8_t st = s->blocks[s->centries[run[k]].ids[l]].state;
            if (st == BS_HOST || st == BS_SPILLING)
                (*host)++;
            else
                (*disk)++;
        }
}

static void reply_prefix(kv_reply *r, uint64_t blocks, uint64_t host, uint64_t disk,
                         uint64_t published)
{
    r->prefix.blocks = blocks;
    r->prefix.tokens = blocks * REKV_KV_BLOCK_TOKENS;
    r->prefix.host_blocks = host;
    r->prefix.disk_blocks = disk;
    r->prefix.published = published;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_PREFIX;
    r->resp.prefix = &r->prefix;
}

/* ------------------------------------------------------------------ the remote tier */

int srv_cache_fetch(rekv_kvstore_server *s, kv_pending *p, const Rekv__Kvstore__Prefix *px)
{
    if (s->remote == NULL || p == NULL || px == NULL || px->n_tokens > MAX_PREFIX_TOKENS ||
        px->kv_parts > 1024 || px->act_parts > 1024)
        return 0;
    if (p->remote_asked) /* asked on an earlier run: wait for it, else answer from what is here */
        return srv_remote_waiting(s, p);
    p->remote_asked = 1;
    size_t n = px->n_tokens / REKV_KV_BLOCK_TOKENS, nw = 0;
    kv_remote_want *want = malloc(sizeof(*want) * (n ? n : 1));
    if (want == NULL)
        return 0;
    uint64_t root = key_root(s, px->fingerprint), key = root, first = 0, n_kv = 0, n_act = 0;
    for (size_t k = 0; k < n; k++) {
        int kind = rekv_kv_next_block_type(n_kv, n_act, px->kv_parts, px->act_parts);
        const uint32_t *tok = px->tokens + k * REKV_KV_BLOCK_TOKENS;
        uint64_t next = key_chain(key, kind, tok);
        if (k == 0)
            first = next;
        if (nw > 0 || ce_find(s, next, key, kind, tok) == NIL) { /* past the local run */
            kv_remote_want *w = &want[nw++];
            w->key = next;
            w->parent = key;
            w->kind = kind;
            memcpy(w->tokens, tok, sizeof(w->tokens));
        }
        key = next;
        if (kind == REKV_KV_BLOCK_KV)
            n_kv++;
        else
            n_act++;
    }
    int rc = nw ? srv_remote_get(s, p, root, first, want, nw) : 0;
    free(want);
    return rc;
}

int srv_cache_adopt_host(rekv_kvstore_server *s, const kv_remote_want *w, const uint8_t *data,
                         size_t layer_bytes)
{
    uint32_t L = s->cfg.geometry.n_layers, i, l;
    if (kv_map_get(&s->cindex, w->key) != NULL)
        return -EEXIST;
    uint32_t *ids = malloc(sizeof(uint32_t) * L);
    if (ids == NULL)
        return -ENOMEM;
    int rc = 0;
    for (l = 0; l < L; l++) {
        if ((rc = srv_block_new(s, &ids[l])) < 0)
            break;
        s->blocks[ids[l]].type = (uint8_t)w->kind;
        if ((rc = srv_slot_take(s, ids[l])) < 0) { /* only free room: nothing is spilled for it */
            srv_block_release_id(s, ids[l]);
            break;
        }
    }
    if (rc == 0 && (rc = ce_new(s, &i)) == 0 && (rc = kv_map_put(&s->cindex, w->key, i)) < 0)
        ce_release(s, i);
    if (rc < 0) {
        for (uint32_t k = 0; k < l; k++) {
            kv_slots_put(&s->hs, s->blocks[ids[k]].type, s->blocks[ids[k]].slot);
            srv_block_release_id(s, ids[k]);
        }
        free(ids);
        return rc;
    }
    kv_centry *e = &s->centries[i];
    e->key = w->key;
    e->parent = w->parent;
    e->kind = (uint8_t)w->kind;
    e->live = 1;
    memcpy(e->tokens, w->tokens, sizeof(e->tokens));
    for (l = 0; l < L; l++) {
        kv_block *b = &s->blocks[ids[l]]; /* refs 1: the cache's */
        b->state = BS_HOST;
        b->layer = l;
        b->centry = i;
        memcpy(s->arena.slots + kv_slots_offset(&s->hs, b->slot), data + (size_t)l * layer_bytes,
               layer_bytes);
        e->ids[l] = ids[l];
        s->host_n[w->kind]++;
        srv_lru_update(s, ids[l], 0); /* the cache's list: spilled or evicted first */
    }
    s->ce_live++;
    ce_touch(s, i);
    free(ids);
    return 0;
}

/* ------------------------------------------------------------------ requests */

int srv_cache_take(rekv_kvstore_server *s, kv_seq *q, Rekv__Kvstore__Prefix *px, kv_reply *r)
{
    if (prefix_check(px, r) < 0)
        return -EINVAL;
    uint32_t *run;
    int64_t n = cache_match(s, px, &run);
    if (n < 0)
        return srv_fail(r, -ENOMEM, "out of memory"), -ENOMEM;
    s->px_lookups++;
    uint32_t L = s->cfg.geometry.n_layers;
    if (n > 0) {
        uint32_t cap = 8;
        while (cap < n)
            cap *= 2;
        for (uint32_t l = 0; l < L; l++)
            if ((q->blocks[l] = malloc(sizeof(uint32_t) * cap)) == NULL) {
                free(run);
                return srv_fail(r, -ENOMEM, "out of memory"), -ENOMEM;
            }
        q->cap = cap;
    }
    uint64_t host, disk;
    run_tiers(s, run, (size_t)n, &host, &disk);
    for (int64_t k = 0; k < n; k++) {
        const kv_centry *e = &s->centries[run[k]];
        for (uint32_t l = 0; l < L; l++) {
            uint32_t id = e->ids[l];
            kv_block *b = &s->blocks[id];
            b->refs++;
            if (b->state == BS_DISK || b->state == BS_LOADING)
                b->hit_read = 1; /* its read-back is the hit's */
            q->blocks[l][k] = id;
            srv_lru_update(s, id, 1); /* a sequence's now: off the cache's list */
        }
        q->n_kv += e->kind == REKV_KV_BLOCK_KV;
    }
    q->n_blocks = q->n_taken = (uint32_t)n;
    q->n_tokens = (uint64_t)n * REKV_KV_BLOCK_TOKENS;
    ce_touch_run(s, run, (size_t)n);
    free(run);
    s->px_hit_tokens += q->n_tokens;
    s->px_hit_host += host;
    s->px_hit_disk += disk;
    reply_prefix(r, (uint64_t)n, host, disk, 0);
    return 0;
}

int srv_h_lookup(rekv_kvstore_server *s, kv_pending *p, Rekv__Kvstore__Lookup *m, kv_reply *r)
{
    if (prefix_check(m->prefix, r) < 0)
        return 0;
    if (srv_cache_fetch(s, p, m->prefix))
        return 1; /* parked until Redis answers or the timeout passes */
    uint32_t *run;
    int64_t n = cache_match(s, m->prefix, &run);
    if (n < 0)
        return srv_fail(r, -ENOMEM, "out of memory");
    s->px_lookups++;
    uint64_t host, disk;
    run_tiers(s, run, (size_t)n, &host, &disk);
    free(run);
    reply_prefix(r, (uint64_t)n, host, disk, 0);
    return 0;
}

/* Whether position b of q may be published: a block in every layer, each of one kind, written
 * (pinned once: not FRESH), readable, and in no entry yet. */
static int publishable(const rekv_kvstore_server *s, const kv_seq *q, uint32_t b)
{
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++) {
        uint32_t id = q->blocks[l][b];
        if (id == NIL)
            return 0;
        const kv_block *k = &s->blocks[id];
        if (k->state == BS_FRESH || k->load_err || k->doomed || k->centry != NIL ||
            k->type != s->blocks[q->blocks[0][b]].type)
            return 0;
    }
    return 1;
}

/* Makes position b of q the entry of key (parent, tokens): every layer's block gains the cache's
 * reference. */
static int publish_new(rekv_kvstore_server *s, const kv_seq *q, uint32_t b, uint64_t key,
                       uint64_t parent, const uint32_t *tokens, uint64_t root, uint64_t first,
                       uint32_t *out)
{
    uint32_t i;
    if (ce_new(s, &i) < 0)
        return -ENOMEM;
    if (kv_map_put(&s->cindex, key, i) < 0) {
        ce_release(s, i);
        return -ENOMEM;
    }
    kv_centry *e = &s->centries[i];
    e->key = key;
    e->parent = parent;
    e->kind = s->blocks[q->blocks[0][b]].type;
    e->live = 1;
    memcpy(e->tokens, tokens, sizeof(e->tokens));
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++) {
        uint32_t id = q->blocks[l][b];
        e->ids[l] = id;
        s->blocks[id].refs++;
        s->blocks[id].centry = i;
    }
    s->ce_live++;
    ce_touch(s, i);
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++)
        srv_persist_block(s, e->ids[l]); /* those already on disk */
    if (s->remote)
        srv_remote_put(s, i, root, first);
    srv_events_stored(s, i);
    *out = i;
    return 0;
}

int srv_h_publish(rekv_kvstore_server *s, Rekv__Kvstore__Publish *m, kv_reply *r)
{
    kv_seq *q = srv_seq_get(s, m->seq);
    if (q == NULL)
        return srv_fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (prefix_check(m->prefix, r) < 0)
        return 0;
    const Rekv__Kvstore__Prefix *px = m->prefix;
    uint64_t known = px->n_tokens < q->n_tokens ? px->n_tokens : q->n_tokens;
    uint64_t n = known / REKV_KV_BLOCK_TOKENS;
    if (n > q->n_blocks)
        n = q->n_blocks;
    uint32_t *run = malloc(sizeof(uint32_t) * (n ? n : 1));
    if (run == NULL)
        return srv_fail(r, -ENOMEM, "out of memory");
    uint64_t root = key_root(s, px->fingerprint), key = root, first = 0, added = 0, b = 0;
    for (; b < n; b++) {
        const uint32_t *tok = px->tokens + b * REKV_KV_BLOCK_TOKENS;
        uint32_t id0 = q->blocks[0][b];
        if (id0 == NIL)
            break;
        int kind = s->blocks[id0].type;
        uint64_t next = key_chain(key, kind, tok);
        if (b == 0)
            first = next;
        uint32_t i = ce_find(s, next, key, kind, tok);
        if (i == NIL && kv_map_get(&s->cindex, next) != NULL)
            break; /* a collision with another chain's entry: that one stays */
        /* already cached (this sequence's or another's copy): that entry stays */
        if (i == NIL) {
            if (!publishable(s, q, (uint32_t)b) ||
                publish_new(s, q, (uint32_t)b, next, key, tok, root, first, &i) < 0)
                break;
            added++;
        }
        run[b] = i;
        key = next;
    }
    ce_touch_run(s, run, (size_t)b);
    free(run);
    s->px_published += added * s->cfg.geometry.n_layers;
    reply_prefix(r, b, 0, 0, added);
    return 0;
}

int srv_cache_adopt(rekv_kvstore_server *s, uint64_t key, uint64_t parent, int kind,
                    const uint32_t *tokens, const uint32_t *fslots, const uint32_t *crcs)
{
    uint32_t L = s->cfg.geometry.n_layers, i;
    if (kv_map_get(&s->cindex, key) != NULL)
        return -EEXIST;
    uint32_t *ids = malloc(sizeof(uint32_t) * L);
    if (ids == NULL)
        return -ENOMEM;
    for (uint32_t l = 0; l < L; l++)
        if (srv_block_new(s, &ids[l]) < 0) {
            for (uint32_t k = 0; k < l; k++)
                srv_block_release_id(s, ids[k]);
            free(ids);
            return -ENOMEM;
        }
    if (ce_new(s, &i) < 0 || kv_map_put(&s->cindex, key, i) < 0) {
        for (uint32_t k = 0; k < L; k++)
            srv_block_release_id(s, ids[k]);
        free(ids);
        return -ENOMEM;
    }
    kv_centry *e = &s->centries[i];
    e->key = key;
    e->parent = parent;
    e->kind = (uint8_t)kind;
    e->live = 1;
    memcpy(e->tokens, tokens, sizeof(e->tokens));
    for (uint32_t l = 0; l < L; l++) {
        kv_block *b = &s->blocks[ids[l]];
        b->type = (uint8_t)kind; /* refs 1: the cache's */
        b->state = BS_DISK;
        b->layer = l;
        b->fslot = fslots[l];
        b->crc = crcs[l];
        b->persisted = 1;
        b->centry = i;
        e->ids[l] = ids[l];
        s->disk_n[kind]++;
    }
    s->ce_live++;
    ce_touch(s, i);
    free(ids);
    return 0;
}

int srv_h_clear_cache(rekv_kvstore_server *s, kv_reply *r)
{
    s->events_mute = 1; /* told as one AllBlocksCleared and what stays, not block by block */
    for (uint32_t i = s->ce_head, next; i != NIL; i = next) {
        next = s->centries[i].next;
        if (srv_cache_evictable(s, i)) /* else its pins' client lets go first */
            srv_cache_evict(s, i);
    }
    s->events_mute = 0;
    srv_events_announce(s);
    (void)r;
    return 0;
}
