/* leases.c — the kvstore server's connections (clients), their pins and leases, and sequence
 * owners.
 *
 * Leases are per connection (ZeroMQ routing id): every request renews its sender's. A connection
 * silent for a lease loses its pins (and its push imports, push.c). Requests may name an owner (a
 * worker's name); a sequence belongs to the owner of the connection that created it, and once no
 * connection of an owner is left (all silent for a lease: the owner died) its sequences are dropped
 * too, so that a dead worker's blocks come back without a restart of the store. A worker restarted
 * under the same name does not wait for that: it sends DropOwner (handlers.c) first. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/server_internal.h"

/* ------------------------------------------------------------------ clients */

kv_client *srv_client_get(rekv_kvstore_server *s, const uint8_t *ident, size_t len, int create)
{
    for (kv_client *c = s->clients; c; c = c->next)
        if (c->ident_len == len && memcmp(c->ident, ident, len) == 0)
            return c;
    if (!create)
        return NULL;
    kv_client *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    memcpy(c->ident, ident, len);
    c->ident_len = len;
    kv_map_init(&c->pins);
    c->next = s->clients;
    s->clients = c;
    return c;
}

/* Drops every pin a client holds; returns how many. */
static uint64_t client_release_pins(rekv_kvstore_server *s, kv_client *c)
{
    uint64_t n = 0;
    for (size_t i = 0; i < c->pins.cap; i++) {
        if (c->pins.keys[i] == KV_MAP_EMPTY)
            continue;
        uint32_t id = (uint32_t)c->pins.keys[i];
        uint32_t cnt = (uint32_t)c->pins.vals[i];
        s->blocks[id].pins -= cnt;
        n += cnt;
        srv_lru_update(s, id, 0);
    }
    kv_map_free(&c->pins);
    kv_map_init(&c->pins);
    return n;
}

/* ------------------------------------------------------------------ owners */

static int owner_alive(const rekv_kvstore_server *s, const char *owner)
{
    for (const kv_client *c = s->clients; c; c = c->next)
        if (strcmp(c->owner, owner) == 0)
            return 1;
    return 0;
}

/* Pins on block id that connections of owner hold. */
static uint64_t owner_pins(const rekv_kvstore_server *s, const char *owner, uint32_t id)
{
    uint64_t n = 0;
    for (const kv_client *c = s->clients; c; c = c->next)
        if (strcmp(c->owner, owner) == 0) {
            const uint64_t *v = kv_map_get(&c->pins, id);
            n += v ? *v : 0;
        }
    return n;
}

/* The ids of owner's sequences in *ids (malloc'd; caller frees): dropping them changes the map, so
 * callers collect first. */
int srv_owner_seqs(const rekv_kvstore_server *s, const char *owner, uint64_t **ids, size_t *n)
{
    size_t cap = 0;
    *ids = NULL;
    *n = 0;
    for (size_t i = 0; i < s->seqs.cap; i++) {
        if (s->seqs.keys[i] == KV_MAP_EMPTY)
            continue;
        const kv_seq *q = (const kv_seq *)(uintptr_t)s->seqs.vals[i];
        if (q->owner == NULL || strcmp(q->owner, owner) != 0)
            continue;
        if (srv_grow((void **)ids, &cap, *n + 1, sizeof(uint64_t)) < 0) {
            free(*ids);
            *ids = NULL;
            *n = 0;
            return -ENOMEM;
        }
        (*ids)[(*n)++] = q->id;
    }
    return 0;
}

/* Whether owner may drop q now: OWNED_HELD when a parked request holds one of its blocks,
 * OWNED_PINNED when a client of another owner pins one. Blocks shared with other sequences or the
 * prefix cache do not count: dropping q only drops its reference to them. */
int srv_owned_seq_busy(const rekv_kvstore_server *s, const kv_seq *q, const char *owner)
{
    int pinned = 0;
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++)
        for (uint32_t b = 0; b < q->n_blocks; b++) {
            uint32_t id = q->blocks[l][b];
            if (id == NIL || s->blocks[id].refs > 1)
                continue;
            if (s->blocks[id].holds > 0)
                return OWNED_HELD;
            if (!pinned && s->blocks[id].pins > 0 && s->blocks[id].pins > owner_pins(s, owner, id))
                pinned = 1;
        }
    return pinned ? OWNED_PINNED : OWNED_FREE;
}

/* Drops q (not busy, see above), releasing the pins that connections of owner hold on it; returns
 * the blocks freed. */
uint64_t srv_owned_seq_drop(rekv_kvstore_server *s, kv_seq *q, const char *owner)
{
    uint64_t n = 0;
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++)
        for (uint32_t b = q->n_blocks; b-- > 0;) { /* a cached chain's end spills first */
            uint32_t id = q->blocks[l][b];
            if (id == NIL)
                continue;
            if (s->blocks[id].pins > 0) /* the owner's pins go; another's on a shared block stay */
                for (kv_client *c = s->clients; c; c = c->next) {
                    uint64_t *v = strcmp(c->owner, owner) == 0 ? kv_map_get(&c->pins, id) : NULL;
                    if (v) {
                        s->blocks[id].pins -= (uint32_t)*v;
                        kv_map_del(&c->pins, id);
                    }
                }
            n += s->blocks[id].refs == 1;
            srv_block_unref(s, id);
        }
    kv_map_del(&s->seqs, q->id);
    srv_seq_free_mem(s, q);
    s->sequences_reclaimed++;
    return n;
}

/* Drops the sequences of owners that no connection is left of: each connection of theirs was
 * silent for a lease, so the owner died (or hung, and lost its pins already). A sequence still
 * busy (pinned by another owner's client, held by a parked request) is tried again at the next
 * lease check. */
static void orphans_sweep(rekv_kvstore_server *s)
{
    char **owners = NULL; /* copies: the sequences holding the names go */
    size_t n_owners = 0, cap = 0;
    s->orphans_left = 0;
    for (size_t i = 0; i < s->seqs.cap; i++) {
        if (s->seqs.keys[i] == KV_MAP_EMPTY)
            continue;
        const kv_seq *q = (const kv_seq *)(uintptr_t)s->seqs.vals[i];
        if (q->owner == NULL || owner_alive(s, q->owner))
            continue;
        size_t k = 0;
        while (k < n_owners && strcmp(owners[k], q->owner) != 0)
            k++;
        if (k < n_owners)
            continue;
        char *dup = strdup(q->owner);
        if (dup == NULL || srv_grow((void **)&owners, &cap, n_owners + 1, sizeof(char *)) < 0) {
            free(dup);
            s->orphans_left = 1; /* out of memory: try again later */
            break;
        }
        owners[n_owners++] = dup;
    }
    for (size_t k = 0; k < n_owners; k++) {
        uint64_t *ids;
        size_t n;
        if (srv_owner_seqs(s, owners[k], &ids, &n) < 0) {
            s->orphans_left = 1;
            continue;
        }
        uint64_t seqs = 0, blocks = 0, busy = 0;
        for (size_t i = 0; i < n; i++) {
            kv_seq *q = srv_seq_get(s, ids[i]);
            if (srv_owned_seq_busy(s, q, owners[k]) != OWNED_FREE) {
                busy++;
                continue;
            }
            blocks += srv_owned_seq_drop(s, q, owners[k]);
            seqs++;
        }
        if (busy)
            s->orphans_left = 1;
        if (seqs) /* a retry that still finds all busy says nothing */
            srv_event(s, REKV_KV_EVENT_WARN,
                      "owner %s silent for %u ms (its lease): dropped its sequences (%llu, %llu "
                      "blocks); %llu still in use, tried again later",
                      owners[k], s->cfg.lease_ms, (unsigned long long)seqs,
                      (unsigned long long)blocks, (unsigned long long)busy);
        free(ids);
        free(owners[k]);
    }
    free(owners);
}

/* ------------------------------------------------------------------ leases */

static void client_free(rekv_kvstore_server *s, kv_client *c)
{
    if (s->pbe)
        srv_client_push_end(s, c);
    kv_map_free(&c->pins);
    free(c);
}

void srv_leases_check(rekv_kvstore_server *s)
{
    uint64_t lease = (uint64_t)s->cfg.lease_ms * 1000000ull;
    /* a client whose request is parked (waiting for I/O) is not silent */
    for (kv_pending *p = s->pending; p; p = p->next) {
        kv_client *c = srv_client_get(s, p->ident, p->ident_len, 0);
        if (c)
            c->last_seen = s->now;
    }
    int owned_gone = 0;
    kv_client **pp = &s->clients;
    while (*pp) {
        kv_client *c = *pp;
        if (s->now - c->last_seen > lease) {
            uint64_t n = client_release_pins(s, c);
            if (n > 0) {
                s->leases_expired++;
                srv_event(s, REKV_KV_EVENT_WARN,
                          "client lease expired after %u ms of silence: released %llu pins",
                          s->cfg.lease_ms, (unsigned long long)n);
            }
            owned_gone |= c->owner[0] != '\0';
            *pp = c->next;
            client_free(s, c);
            continue;
        }
        pp = &c->next;
    }
    if (owned_gone || s->orphans_left)
        orphans_sweep(s);
}
