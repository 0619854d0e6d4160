/* server.c — the kvstore daemon's engine: block tables, slot allocation, LRU spilling, pin leases,
 * sequence owners, and the one event loop (zmq_poll over the ROUTER socket, the io_uring eventfd,
 * the fd-passing socket, a stop eventfd and an optional signalfd; no threads, no busy waiting).
 *
 * Leases are per connection (ZeroMQ routing id): every request renews its sender's. A connection
 * silent for a lease loses its pins. Requests may name an owner (a worker's name); a sequence
 * belongs to the owner of the connection that created it, and once no connection of an owner is
 * left (all silent for a lease: the owner died) its sequences are dropped too, so that a dead
 * worker's blocks come back without a restart of the store. A worker restarted under the same
 * name does not wait for that: it sends DropOwner with its name first.
 *
 * Requests that need I/O (a pin of spilled blocks, an append that needs room) are parked and run
 * again from the start whenever I/O completes; a parked request holds the blocks it found resident
 * so that its own progress is never spilled away. A request waits only while I/O it depends on is
 * in flight; otherwise it fails with -ENOMEM and a reason, so nothing waits forever.
 *
 * Push (cfg.push_backend): the server holds a backend (its arena registered with it where the
 * backend can) and one stream. A Push imports the client's buffers and events once (kept per
 * connection, keyed by the handle's bytes), checks every piece, and enqueues wait, copies and
 * record on that stream; the reply leaves once they are enqueued. Imports are dropped, after the
 * stream has drained, on Release, when the connection's lease expires (ZeroMQ does not report a
 * disconnect; a silent connection is a gone one), and on destroy. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "gpuworker/device/backend.h"
#include "kvstore/kv_internal.h"
#include "proto/kvstore.pb-c.h"

#define NIL UINT32_MAX
#define MAX_PLAN_BLOCKS (1u << 22)
#define MAX_IDENT 256
#define MAX_OWNER REKV_KV_OWNER_MAX

enum { BS_UNUSED = 0, BS_HOST, BS_SPILLING, BS_DISK, BS_LOADING };
enum { H_PLAN = 0, H_PIN, H_APPEND, H_OTHER, H_SPILL_WRITE, H_SPILL_READ, H_COUNT };
static const char *const hist_names[H_COUNT] = {"plan",  "pin",         "append",
                                                "other", "spill_write", "spill_read"};

typedef struct kv_block {
    uint64_t seq;        /* owning sequence */
    uint32_t layer;      /* layer */
    uint32_t lblock;     /* logical block number */
    uint8_t type;        /* rekv_kv_block_type */
    uint8_t state;       /* BS_* */
    uint8_t touched;     /* used while its spill was in flight: keep the host copy */
    uint8_t doomed;      /* freed while I/O was in flight: release on completion */
    uint8_t in_lru;      /* on the LRU list (resident, unpinned, unheld) */
    int32_t load_err;    /* sticky read-back failure (-EIO on CRC mismatch), 0 when none */
    uint32_t slot;       /* host slot (HOST, SPILLING, LOADING) */
    uint32_t fslot;      /* spill-file slot (SPILLING, DISK, LOADING) */
    uint32_t crc;        /* CRC32C of the spilled bytes */
    uint32_t pins;       /* pins held by clients */
    uint32_t holds;      /* holds of parked requests */
    uint32_t prev, next; /* LRU links (block ids) */
} kv_block;

typedef struct kv_seq {
    uint64_t id;       /* caller-chosen id */
    uint64_t n_tokens; /* tokens appended */
    uint32_t n_blocks; /* logical blocks per layer */
    uint32_t n_kv;     /* of those, allocated as KV blocks (freeing does not change it) */
    uint32_t cap;      /* capacity of each per-layer array */
    uint32_t **blocks; /* [n_layers][cap] block ids, NIL where freed */
    char *owner;       /* owner name of the connection that created it; NULL for none */
} kv_seq;

/* A buffer or event a client exported and the push path imported. */
typedef struct kv_import {
    uint8_t handle[REKV_KV_IPC_HANDLE_BYTES]; /* as the client sent it */
    void *dev;                                /* a buffer: the mapping, its size */
    size_t bytes;
    rekv_event *ev; /* an event */
    struct kv_import *next;
} kv_import;

#define MAX_IMPORTS 64 /* per connection; beyond it the connection's imports are dropped */
#define MAX_PUSH_BUFFERS 16

typedef struct kv_client {
    uint8_t ident[MAX_IDENT]; /* ZeroMQ routing id */
    size_t ident_len;
    uint64_t last_seen;        /* ns of the last request */
    kv_map pins;               /* block id -> pin count */
    char owner[MAX_OWNER + 1]; /* the owner name its last request carried; "" for none */
    kv_import *imports;        /* the push path's imports for it */
    size_t n_imports;
    struct kv_client *next;
} kv_client;

typedef struct kv_pending {
    uint8_t ident[MAX_IDENT]; /* who asked */
    size_t ident_len;
    int delim;                   /* the peer sent an empty delimiter frame (REQ) */
    Rekv__Kvstore__Request *req; /* unpacked request */
    uint64_t t0;                 /* receive time, ns */
    uint32_t *holds;             /* block ids held for it */
    size_t n_holds, cap_holds;
    uint64_t misses; /* blocks it had to read back */
    struct kv_pending *next;
} kv_pending;

struct rekv_kvstore_server {
    rekv_kvstore_config cfg; /* copy; strings below are owned copies */
    char *endpoint;          /* ZeroMQ endpoint */
    char *ipc_path;          /* filesystem path of an ipc:// endpoint, or NULL */
    char *fd_path;           /* fd-passing socket path */
    char *spill_dir;
    kv_arena arena;
    kv_spill *spill;    /* NULL with no_spill */
    void *zctx, *zsock; /* ZeroMQ context and ROUTER socket */
    int fd_listen;      /* UNIX socket handing out the memfd */
    int stop_fd;        /* eventfd written by server_stop */
    int stop;           /* loop exit flag */
    kv_block *blocks;   /* [n_block_ids] */
    uint32_t n_block_ids, cap_block_ids;
    uint32_t *free_ids; /* recycled block ids */
    uint32_t n_free_ids, cap_free_ids;
    uint32_t *free_slots; /* [n_slots] stack of free host slots */
    uint32_t *slot_block; /* [n_slots] the block last given each slot (push checks pins) */
    uint32_t n_free_slots;
    uint32_t lru_head, lru_tail; /* least / most recently used */
    uint64_t lru_len;
    kv_map seqs; /* seq id -> kv_seq * */
    kv_client *clients;
    kv_pending *pending, *pending_tail;
    uint32_t spills_in_flight, reads_in_flight;
    int spill_err;         /* last spill write failure; spilling paused while set */
    uint64_t spill_err_ns; /* when it happened */
    uint64_t now;          /* ns, refreshed per loop iteration */
    uint64_t next_lease_check;
    uint32_t *scratch; /* resolved block ids of the current request */
    size_t cap_scratch;
    uint64_t host_n[2], disk_n[2];
    uint64_t bytes_spilled, bytes_read_back, pin_hits, pin_misses;
    uint64_t spill_errors, crc_errors, leases_expired;
    uint64_t sequences_reclaimed; /* dropped by DropOwner or with their owner's lease */
    int orphans_left;             /* a dead owner's sequence was busy: sweep again at next check */
    rekv_kv_hist hist[H_COUNT];
    rekv_backend *pbe;    /* push backend, or NULL */
    rekv_stream *pstream; /* its stream: every push's wait, copies and record */
    int push_registered;  /* the arena is registered with it (host_register) */
};

/* ------------------------------------------------------------------ small helpers */

static void srv_event(rekv_kvstore_server *s, rekv_kv_event lvl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void srv_event(rekv_kvstore_server *s, rekv_kv_event lvl, const char *fmt, ...)
{
    if (s->cfg.on_event == NULL)
        return;
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    s->cfg.on_event(s->cfg.event_ctx, lvl, msg);
}

static void hist_add(rekv_kv_hist *h, uint64_t ns)
{
    int b = 0;
    while (b + 1 < REKV_KV_HIST_BUCKETS && (ns >> (b + 1)) != 0)
        b++;
    h->buckets[b]++;
    h->count++;
    h->sum_ns += ns;
}

static size_t blk_bytes(const rekv_kvstore_server *s, const kv_block *b)
{
    return b->type == REKV_KV_BLOCK_KV ? s->arena.hdr->kv_block_bytes
                                       : s->arena.hdr->act_block_bytes;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *q = realloc(*p, n * elem);
    if (q == NULL)
        return -ENOMEM;
    *p = q;
    *cap = n;
    return 0;
}

/* ------------------------------------------------------------------ LRU and block ids */

static void lru_remove(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    if (!b->in_lru)
        return;
    if (b->prev != NIL)
        s->blocks[b->prev].next = b->next;
    else
        s->lru_head = b->next;
    if (b->next != NIL)
        s->blocks[b->next].prev = b->prev;
    else
        s->lru_tail = b->prev;
    b->in_lru = 0;
    b->prev = b->next = NIL;
    s->lru_len--;
}

static void lru_push_tail(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    b->prev = s->lru_tail;
    b->next = NIL;
    if (s->lru_tail != NIL)
        s->blocks[s->lru_tail].next = id;
    else
        s->lru_head = id;
    s->lru_tail = id;
    b->in_lru = 1;
    s->lru_len++;
}

/* Puts a block where it belongs: on the LRU list (most recent end) iff it can be spilled. */
static void lru_update(rekv_kvstore_server *s, uint32_t id, int touch)
{
    kv_block *b = &s->blocks[id];
    int want = b->state == BS_HOST && b->pins == 0 && b->holds == 0 && !b->doomed;
    if (b->in_lru && (!want || touch))
        lru_remove(s, id);
    if (want && !b->in_lru)
        lru_push_tail(s, id);
}

static int block_new(rekv_kvstore_server *s, uint32_t *out)
{
    uint32_t id;
    if (s->n_free_ids > 0) {
        id = s->free_ids[--s->n_free_ids];
    } else {
        size_t cap = s->cap_block_ids;
        if (s->n_block_ids == NIL - 1 ||
            grow((void **)&s->blocks, &cap, (size_t)s->n_block_ids + 1, sizeof(kv_block)) < 0)
            return -ENOMEM;
        s->cap_block_ids = (uint32_t)cap;
        id = s->n_block_ids++;
    }
    memset(&s->blocks[id], 0, sizeof(kv_block));
    s->blocks[id].prev = s->blocks[id].next = NIL;
    *out = id;
    return 0;
}

static void block_release_id(rekv_kvstore_server *s, uint32_t id)
{
    s->blocks[id].state = BS_UNUSED;
    size_t cap = s->cap_free_ids;
    if (grow((void **)&s->free_ids, &cap, (size_t)s->n_free_ids + 1, sizeof(uint32_t)) < 0)
        return; /* the id is lost to reuse; harmless */
    s->cap_free_ids = (uint32_t)cap;
    s->free_ids[s->n_free_ids++] = id;
}

static void slot_put(rekv_kvstore_server *s, uint32_t slot)
{
    s->free_slots[s->n_free_slots++] = slot;
}

static void fslot_put(rekv_kvstore_server *s, uint32_t fslot)
{
    kv_spill_slot_free(s->spill, fslot);
    s->spill_err = 0; /* room on disk again: spilling may resume */
}

/* Frees a block now, or when its I/O completes. */
static void block_free(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    lru_remove(s, id);
    switch (b->state) {
    case BS_HOST:
        s->host_n[b->type]--;
        slot_put(s, b->slot);
        block_release_id(s, id);
        break;
    case BS_DISK:
        s->disk_n[b->type]--;
        fslot_put(s, b->fslot);
        block_release_id(s, id);
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

/* ------------------------------------------------------------------ spilling */

/* Starts spilling the least recently used block. 1 started, 0 nothing to spill, <0 cannot. */
static int spill_one(rekv_kvstore_server *s, const char **why)
{
    if (s->spill == NULL) {
        *why = "the arena is full and there is no spill tier";
        return -ENOMEM;
    }
    if (s->spill_err != 0) {
        if (s->now - s->spill_err_ns < 1000000000ull) {
            *why = strerror(-s->spill_err);
            return s->spill_err;
        }
        s->spill_err = 0; /* retry once a second */
    }
    if (s->lru_head == NIL) {
        *why = "every resident block is pinned or in use";
        return 0;
    }
    if (kv_spill_in_flight(s->spill) >= kv_spill_depth(s->spill))
        return 0;
    uint32_t fslot;
    int arc = kv_spill_slot_alloc(s->spill, &fslot);
    if (arc == -ENOSPC && kv_spill_slots_used(s->spill) > 0 && s->cfg.spill_bytes) {
        *why = "the spill file is full (--spill-bytes)";
        return arc;
    }
    if (arc < 0) {
        /* the filesystem refused to grow the spill file: same as a failed write */
        s->spill_errors++;
        if (s->spill_err == 0)
            srv_event(s, REKV_KV_EVENT_ERROR,
                      "spill file cannot grow: %s; blocks stay in memory, spilling paused",
                      strerror(-arc));
        s->spill_err = arc;
        s->spill_err_ns = s->now;
        *why = strerror(-arc);
        return arc;
    }
    uint32_t id = s->lru_head;
    kv_block *b = &s->blocks[id];
    uint32_t crc = 0;
    int rc = kv_spill_write(s->spill, b->slot, fslot, blk_bytes(s, b), id, &crc);
    if (rc < 0) {
        kv_spill_slot_free(s->spill, fslot);
        return 0;
    }
    lru_remove(s, id);
    b->state = BS_SPILLING;
    b->fslot = fslot;
    b->crc = crc;
    b->touched = 0;
    s->spills_in_flight++;
    return 1;
}

/* Makes sure `need` free slots exist or are coming. 0: there now; 1: wait for spills; <0 with
 * *why: impossible. */
static int ensure_room(rekv_kvstore_server *s, uint64_t need, char *why, size_t why_len)
{
    if (s->n_free_slots >= need)
        return 0;
    if (need > s->arena.n_slots) {
        snprintf(why, why_len, "needs %llu blocks at once, the arena holds %llu",
                 (unsigned long long)need, (unsigned long long)s->arena.n_slots);
        return -ENOMEM;
    }
    uint64_t coming = s->n_free_slots + s->spills_in_flight;
    const char *reason = "every resident block is pinned or in use";
    int err = 0;
    while (coming < need) {
        int rc = spill_one(s, &reason);
        if (rc <= 0) {
            err = rc;
            break;
        }
        coming++;
    }
    if (s->spills_in_flight > 0)
        return 1;
    snprintf(why, why_len, "out of host memory: %llu free blocks, %llu needed; cannot spill: %s",
             (unsigned long long)s->n_free_slots, (unsigned long long)need, reason);
    (void)err;
    return -ENOMEM;
}

/* Background spilling between the watermarks. */
static void spill_watermark(rekv_kvstore_server *s)
{
    if (s->spill == NULL || s->arena.n_slots == 0)
        return;
    uint64_t n = s->arena.n_slots;
    uint64_t used = n - s->n_free_slots;
    if (used * 100 <= n * s->cfg.high_pct)
        return;
    const char *why;
    while ((used - s->spills_in_flight) * 100 > n * s->cfg.low_pct) {
        if (spill_one(s, &why) <= 0)
            break;
    }
}

/* ------------------------------------------------------------------ sequences and clients */

static kv_seq *seq_get(rekv_kvstore_server *s, uint64_t id)
{
    uint64_t *v = kv_map_get(&s->seqs, id);
    return v ? (kv_seq *)(uintptr_t)*v : NULL;
}

static void seq_free_mem(rekv_kvstore_server *s, kv_seq *q)
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

static kv_client *client_get(rekv_kvstore_server *s, const uint8_t *ident, size_t len, int create)
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
        lru_update(s, id, 0);
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
static int owner_seqs(const rekv_kvstore_server *s, const char *owner, uint64_t **ids, size_t *n)
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
        if (grow((void **)ids, &cap, *n + 1, sizeof(uint64_t)) < 0) {
            free(*ids);
            *ids = NULL;
            *n = 0;
            return -ENOMEM;
        }
        (*ids)[(*n)++] = q->id;
    }
    return 0;
}

enum { OWNED_FREE = 0, OWNED_HELD, OWNED_PINNED };

/* Whether owner may drop q now: OWNED_HELD when a parked request holds one of its blocks,
 * OWNED_PINNED when a client of another owner pins one. */
static int owned_seq_busy(const rekv_kvstore_server *s, const kv_seq *q, const char *owner)
{
    int pinned = 0;
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++)
        for (uint32_t b = 0; b < q->n_blocks; b++) {
            uint32_t id = q->blocks[l][b];
            if (id == NIL)
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
static uint64_t owned_seq_drop(rekv_kvstore_server *s, kv_seq *q, const char *owner)
{
    uint64_t n = 0;
    for (uint32_t l = 0; l < s->cfg.geometry.n_layers; l++)
        for (uint32_t b = 0; b < q->n_blocks; b++) {
            uint32_t id = q->blocks[l][b];
            if (id == NIL)
                continue;
            if (s->blocks[id].pins > 0)
                for (kv_client *c = s->clients; c; c = c->next)
                    if (strcmp(c->owner, owner) == 0)
                        kv_map_del(&c->pins, id);
            s->blocks[id].pins = 0;
            block_free(s, id);
            n++;
        }
    kv_map_del(&s->seqs, q->id);
    seq_free_mem(s, q);
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
        if (dup == NULL || grow((void **)&owners, &cap, n_owners + 1, sizeof(char *)) < 0) {
            free(dup);
            s->orphans_left = 1; /* out of memory: try again later */
            break;
        }
        owners[n_owners++] = dup;
    }
    for (size_t k = 0; k < n_owners; k++) {
        uint64_t *ids;
        size_t n;
        if (owner_seqs(s, owners[k], &ids, &n) < 0) {
            s->orphans_left = 1;
            continue;
        }
        uint64_t seqs = 0, blocks = 0, busy = 0;
        for (size_t i = 0; i < n; i++) {
            kv_seq *q = seq_get(s, ids[i]);
            if (owned_seq_busy(s, q, owners[k]) != OWNED_FREE) {
                busy++;
                continue;
            }
            blocks += owned_seq_drop(s, q, owners[k]);
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

/* ------------------------------------------------------------------ push imports */

/* Drops c's imports whose handle is one of handles[n] (handles NULL: all of them), once the push
 * stream has finished the work that uses them. */
static void client_drop_imports(rekv_kvstore_server *s, kv_client *c, ProtobufCBinaryData *handles,
                                size_t n)
{
    if (c->imports == NULL)
        return;
    s->pbe->iface->stream_sync(s->pstream, NULL);
    kv_import **pp = &c->imports;
    while (*pp) {
        kv_import *im = *pp;
        int drop = handles == NULL;
        for (size_t i = 0; i < n && !drop; i++)
            drop = handles[i].len == sizeof(im->handle) &&
                   memcmp(handles[i].data, im->handle, sizeof(im->handle)) == 0;
        if (!drop) {
            pp = &im->next;
            continue;
        }
        *pp = im->next;
        if (im->ev)
            s->pbe->iface->event_destroy(im->ev);
        else
            s->pbe->iface->dev_unimport(s->pbe, im->dev);
        free(im);
        c->n_imports--;
    }
}

static void client_free(rekv_kvstore_server *s, kv_client *c)
{
    if (s->pbe)
        client_drop_imports(s, c, NULL, 0);
    kv_map_free(&c->pins);
    free(c);
}

static void leases_check(rekv_kvstore_server *s)
{
    uint64_t lease = (uint64_t)s->cfg.lease_ms * 1000000ull;
    /* a client whose request is parked (waiting for I/O) is not silent */
    for (kv_pending *p = s->pending; p; p = p->next) {
        kv_client *c = client_get(s, p->ident, p->ident_len, 0);
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

/* ------------------------------------------------------------------ request context */

typedef struct kv_reply {
    Rekv__Kvstore__Response resp;
    Rekv__Kvstore__AppendReply append;
    Rekv__Kvstore__TableReply table;
    Rekv__Kvstore__PlanReply plan;
    Rekv__Kvstore__StatsReply stats;
    Rekv__Kvstore__DropOwnerReply drop_owner;
    Rekv__Kvstore__PushReply push;
    Rekv__Kvstore__Histogram hists[H_COUNT];
    Rekv__Kvstore__Histogram *hist_ptrs[H_COUNT];
    char err[768];
    void *allocs[8]; /* arrays to free after packing */
    int n_allocs;
} kv_reply;

static void *reply_alloc(kv_reply *r, size_t n, size_t elem)
{
    if (r->n_allocs == 8)
        return NULL;
    void *p = calloc(n ? n : 1, elem);
    if (p)
        r->allocs[r->n_allocs++] = p;
    return p;
}

static int fail(kv_reply *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(kv_reply *r, int code, const char *fmt, ...)
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
        b->holds--;
        if (b->doomed && b->holds == 0 && (b->state == BS_HOST)) {
            /* freed while held cannot happen (free refuses held blocks); kept for safety */
        }
        lru_update(s, id, 0);
    }
    p->n_holds = 0;
}

static int pending_hold(rekv_kvstore_server *s, kv_pending *p, uint32_t id)
{
    if (grow((void **)&p->holds, &p->cap_holds, p->n_holds + 1, sizeof(uint32_t)) < 0)
        return -ENOMEM;
    p->holds[p->n_holds++] = id;
    s->blocks[id].holds++;
    lru_update(s, id, 0);
    return 0;
}

/* Resolves ranges into s->scratch (block ids, in order); counts per range into *counts. */
static int resolve_ranges(rekv_kvstore_server *s, Rekv__Kvstore__Range **ranges, size_t n,
                          size_t *n_out, kv_reply *r)
{
    size_t total = 0;
    if (n > MAX_PLAN_BLOCKS)
        return fail(r, -EINVAL, "too many ranges (%zu)", n), -EINVAL;
    for (size_t i = 0; i < n; i++) {
        Rekv__Kvstore__Range *rg = ranges[i];
        kv_seq *q = seq_get(s, rg->seq);
        if (q == NULL)
            return fail(r, -ENOENT, "range %zu: no sequence %llu", i, (unsigned long long)rg->seq),
                   -ENOENT;
        if (rg->layer >= s->cfg.geometry.n_layers)
            return fail(r, -EINVAL, "range %zu: layer %u out of range (%u layers)", i, rg->layer,
                        s->cfg.geometry.n_layers),
                   -EINVAL;
        if (rg->token_begin > rg->token_end || rg->token_end > q->n_tokens)
            return fail(r, -EINVAL, "range %zu: tokens [%llu, %llu) outside [0, %llu)", i,
                        (unsigned long long)rg->token_begin, (unsigned long long)rg->token_end,
                        (unsigned long long)q->n_tokens),
                   -EINVAL;
        if (rg->token_begin == rg->token_end)
            continue;
        uint64_t b0 = rg->token_begin / REKV_KV_BLOCK_TOKENS;
        uint64_t b1 = (rg->token_end - 1) / REKV_KV_BLOCK_TOKENS + 1;
        if (total + (b1 - b0) > MAX_PLAN_BLOCKS)
            return fail(r, -EINVAL, "request covers more than %u blocks", MAX_PLAN_BLOCKS), -EINVAL;
        if (grow((void **)&s->scratch, &s->cap_scratch, total + (b1 - b0), sizeof(uint32_t)) < 0)
            return fail(r, -ENOMEM, "out of memory"), -ENOMEM;
        for (uint64_t b = b0; b < b1; b++) {
            uint32_t id = q->blocks[rg->layer][b];
            if (id == NIL)
                return fail(r, -ENOENT, "range %zu: block %llu of sequence %llu layer %u was freed",
                            i, (unsigned long long)b, (unsigned long long)rg->seq, rg->layer),
                       -ENOENT;
            s->scratch[total++] = id;
        }
    }
    *n_out = total;
    return 0;
}

/* ------------------------------------------------------------------ handlers */

static int h_create(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__CreateSeq *m, kv_reply *r)
{
    if (m->seq == KV_MAP_EMPTY)
        return fail(r, -EINVAL, "sequence id %llu is reserved", (unsigned long long)m->seq);
    if (seq_get(s, m->seq))
        return fail(r, -EEXIST, "sequence %llu exists", (unsigned long long)m->seq);
    kv_seq *q = calloc(1, sizeof(*q));
    if (q)
        q->blocks = calloc(s->cfg.geometry.n_layers, sizeof(uint32_t *));
    if (q && c->owner[0])
        q->owner = strdup(c->owner);
    if (q == NULL || q->blocks == NULL || (c->owner[0] && q->owner == NULL) ||
        kv_map_put(&s->seqs, m->seq, (uintptr_t)q) < 0) {
        seq_free_mem(s, q);
        return fail(r, -ENOMEM, "out of memory creating sequence");
    }
    q->id = m->seq;
    return 0;
}

/* Frees blocks [b0, b1) of layers [l0, l1); refuses (-EBUSY) when someone else pins or holds one.
 */
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
            if (s->blocks[id].pins > own || s->blocks[id].holds > 0)
                return fail(r, -EBUSY,
                            "sequence %llu layer %u block %llu is pinned by another client",
                            (unsigned long long)q->id, l, (unsigned long long)b),
                       -EBUSY;
        }
    for (uint32_t l = l0; l < l1; l++)
        for (uint64_t b = b0; b < b1; b++) {
            uint32_t id = q->blocks[l][b];
            if (id == NIL)
                continue;
            if (c && kv_map_del(&c->pins, id))
                s->blocks[id].pins = 0;
            block_free(s, id);
            q->blocks[l][b] = NIL;
        }
    return 0;
}

static int h_drop(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__DropSeq *m, kv_reply *r)
{
    kv_seq *q = seq_get(s, m->seq);
    if (q == NULL)
        return fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (free_blocks(s, c, q, 0, s->cfg.geometry.n_layers, 0, q->n_blocks, r) < 0)
        return 0;
    kv_map_del(&s->seqs, m->seq);
    seq_free_mem(s, q);
    return 0;
}

static int h_drop_owner(rekv_kvstore_server *s, Rekv__Kvstore__DropOwner *m, kv_reply *r)
{
    const char *owner = m->owner ? m->owner : "";
    if (owner[0] == '\0' || strlen(owner) > MAX_OWNER)
        return fail(r, -EINVAL, "drop owner: the owner name must have 1 to %d bytes", MAX_OWNER);
    uint64_t *ids;
    size_t n;
    if (owner_seqs(s, owner, &ids, &n) < 0)
        return fail(r, -ENOMEM, "out of memory");
    /* a parked request holding one of the blocks goes first: it waits only for I/O in flight */
    for (size_t i = 0; i < n; i++)
        if (owned_seq_busy(s, seq_get(s, ids[i]), owner) == OWNED_HELD) {
            free(ids);
            return WAIT;
        }
    uint64_t seqs = 0, blocks = 0, busy = 0, busy_id = 0;
    for (size_t i = 0; i < n; i++) {
        kv_seq *q = seq_get(s, ids[i]);
        if (owned_seq_busy(s, q, owner) != OWNED_FREE) {
            if (busy++ == 0)
                busy_id = ids[i];
            continue;
        }
        blocks += owned_seq_drop(s, q, owner);
        seqs++;
    }
    free(ids);
    if (seqs)
        srv_event(s, REKV_KV_EVENT_INFO,
                  "owner %s: dropped its sequences on request (%llu, %llu blocks)", owner,
                  (unsigned long long)seqs, (unsigned long long)blocks);
    if (busy)
        return fail(r, -EBUSY,
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
    kv_seq *q = seq_get(s, m->seq);
    if (q == NULL)
        return fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (m->layer_begin > m->layer_end || m->layer_end > s->cfg.geometry.n_layers ||
        m->block_begin > m->block_end)
        return fail(r, -EINVAL, "free: bad layer or block range");
    free_blocks(s, c, q, m->layer_begin, m->layer_end, m->block_begin, m->block_end, r);
    return 0;
}

static int h_append(rekv_kvstore_server *s, Rekv__Kvstore__Append *m, kv_reply *r)
{
    kv_seq *q = seq_get(s, m->seq);
    if (q == NULL)
        return fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (m->n_tokens > (1ull << 31) || q->n_tokens + m->n_tokens > (1ull << 31))
        return fail(r, -EINVAL, "append of %llu tokens is too long",
                    (unsigned long long)m->n_tokens);
    if (m->kv_parts > 1024 || m->act_parts > 1024)
        return fail(r, -EINVAL, "KV:ACT pattern %u:%u out of range", m->kv_parts, m->act_parts);
    uint32_t L = s->cfg.geometry.n_layers;
    uint64_t nb = (q->n_tokens + m->n_tokens + REKV_KV_BLOCK_TOKENS - 1) / REKV_KV_BLOCK_TOKENS;
    uint64_t add = nb - q->n_blocks;
    uint64_t need = add * L;
    char why[512];
    int rc = ensure_room(s, need, why, sizeof(why));
    if (rc == WAIT)
        return WAIT;
    if (rc < 0)
        return fail(r, -ENOMEM, "append %llu tokens to sequence %llu: %s",
                    (unsigned long long)m->n_tokens, (unsigned long long)m->seq, why);
    if (nb > q->cap) {
        uint32_t ncap = q->cap ? q->cap : 8;
        while (ncap < nb)
            ncap *= 2;
        for (uint32_t l = 0; l < L; l++) {
            uint32_t *p = realloc(q->blocks[l], ncap * sizeof(uint32_t));
            if (p == NULL)
                return fail(r, -ENOMEM, "out of memory growing a block table");
            q->blocks[l] = p;
        }
        q->cap = ncap;
    }
    /* take ids first so that a failure leaves nothing half done */
    if (grow((void **)&s->scratch, &s->cap_scratch, need, sizeof(uint32_t)) < 0)
        return fail(r, -ENOMEM, "out of memory");
    for (uint64_t i = 0; i < need; i++) {
        if (block_new(s, &s->scratch[i]) < 0) {
            for (uint64_t j = 0; j < i; j++)
                block_release_id(s, s->scratch[j]);
            return fail(r, -ENOMEM, "out of memory for block records");
        }
    }
    /* block types by HybridServe's allocation rule, from the sequence's current counts; every
     * layer gets the same types */
    uint64_t n_kv = q->n_kv, n_act = q->n_blocks - q->n_kv;
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
            blk->state = BS_HOST;
            blk->slot = s->free_slots[--s->n_free_slots];
            s->slot_block[blk->slot] = id;
            s->host_n[blk->type]++;
            q->blocks[l][b] = id;
            lru_update(s, id, 0);
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
    kv_seq *q = seq_get(s, m->seq);
    if (q == NULL)
        return fail(r, -ENOENT, "no sequence %llu", (unsigned long long)m->seq);
    if (m->layer >= s->cfg.geometry.n_layers)
        return fail(r, -EINVAL, "layer %u out of range", m->layer);
    size_t n = q->n_blocks;
    uint32_t *type = reply_alloc(r, n, sizeof(uint32_t));
    uint32_t *tier = reply_alloc(r, n, sizeof(uint32_t));
    uint64_t *phys = reply_alloc(r, n, sizeof(uint64_t));
    if (!type || !tier || !phys)
        return fail(r, -ENOMEM, "out of memory");
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

static int h_plan(rekv_kvstore_server *s, kv_client *c, kv_pending *p, Rekv__Kvstore__Plan *m,
                  kv_reply *r)
{
    pending_release_holds(s, p);
    size_t n;
    if (resolve_ranges(s, m->ranges, m->n_ranges, &n, r) < 0)
        return 0;
    /* hold everything resident, start reads for what is on disk */
    size_t need_slots = 0, not_ready = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t id = s->scratch[i];
        kv_block *b = &s->blocks[id];
        if (b->state == BS_DISK && b->load_err)
            return fail(r, b->load_err, "sequence %llu layer %u block %u: read-back failed: %s",
                        (unsigned long long)b->seq, b->layer, b->lblock,
                        b->load_err == -EBADMSG ? "CRC32C mismatch" : strerror(-b->load_err));
        if (b->state == BS_DISK && s->spill != NULL) {
            if (s->n_free_slots > 0 && kv_spill_in_flight(s->spill) < kv_spill_depth(s->spill)) {
                uint32_t slot = s->free_slots[s->n_free_slots - 1];
                if (kv_spill_read(s->spill, slot, b->fslot, blk_bytes(s, b), id) == 0) {
                    s->n_free_slots--;
                    b->slot = slot;
                    s->slot_block[slot] = id;
                    b->state = BS_LOADING;
                    s->reads_in_flight++;
                    p->misses++;
                }
            }
        }
        if (b->state == BS_DISK) {
            need_slots++;
            not_ready++;
            continue;
        }
        if (b->state == BS_LOADING)
            not_ready++;
        /* held until the reply: neither spilled nor freed while the rest arrives */
        if (pending_hold(s, p, id) < 0)
            return fail(r, -ENOMEM, "out of memory");
    }
    if (not_ready) {
        if (need_slots) {
            char why[512];
            int rc = ensure_room(s, need_slots, why, sizeof(why));
            if (rc < 0 && s->reads_in_flight == 0)
                return fail(r, -ENOMEM, "pin: %s", why);
        }
        return WAIT;
    }
    /* all resident: answer */
    size_t n_ranges = m->n_ranges;
    uint32_t *rc_arr = reply_alloc(r, n_ranges, sizeof(uint32_t));
    uint64_t *blk = reply_alloc(r, n, sizeof(uint64_t));
    uint32_t *type = reply_alloc(r, n, sizeof(uint32_t));
    uint64_t *off = reply_alloc(r, n, sizeof(uint64_t));
    uint32_t *first = reply_alloc(r, n, sizeof(uint32_t));
    uint32_t *count = reply_alloc(r, n, sizeof(uint32_t));
    if (!rc_arr || !blk || !type || !off || !first || !count)
        return fail(r, -ENOMEM, "out of memory");
    size_t k = 0;
    uint64_t base = s->arena.hdr->data_offset, sb = s->arena.slot_bytes;
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
                off[k] = base + (uint64_t)kb->slot * sb;
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
            if (v)
                (*v)++;
            else if (kv_map_put(&c->pins, id, 1) < 0)
                return fail(r, -ENOMEM, "out of memory recording pins"); /* holds undo below */
            b->pins++;
        }
        lru_update(s, id, 1);
    }
    if (m->pin) {
        s->pin_misses += p->misses;
        s->pin_hits += n > p->misses ? n - p->misses : 0;
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
        return fail(r, -EINVAL,
                    "unpin: sequence %llu layer %u block %u is not pinned by this client",
                    (unsigned long long)b->seq, b->layer, b->lblock);
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t id = s->scratch[i];
        uint64_t *v = kv_map_get(&c->pins, id);
        if (v && *v == 0)
            kv_map_del(&c->pins, id);
        s->blocks[id].pins--;
        lru_update(s, id, 0);
    }
    return 0;
}

static int h_stats(rekv_kvstore_server *s, kv_reply *r)
{
    Rekv__Kvstore__StatsReply *st = &r->stats;
    st->host_kv = s->host_n[0];
    st->host_act = s->host_n[1];
    st->disk_kv = s->disk_n[0];
    st->disk_act = s->disk_n[1];
    st->free_slots = s->n_free_slots;
    st->total_slots = s->arena.n_slots;
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
    for (int i = 0; i < H_COUNT; i++) {
        Rekv__Kvstore__Histogram init = REKV__KVSTORE__HISTOGRAM__INIT;
        r->hists[i] = init;
        r->hists[i].name = (char *)hist_names[i];
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

/* c's import of handle h (a buffer, or an event when is_event), importing it on first use. */
static int import_get(rekv_kvstore_server *s, kv_client *c, const ProtobufCBinaryData *h,
                      int is_event, kv_import **out, kv_reply *r, const char *what)
{
    if (h->len != REKV_KV_IPC_HANDLE_BYTES)
        return fail(r, -EINVAL, "push: %s handle of %zu bytes, not %d", what, h->len,
                    REKV_KV_IPC_HANDLE_BYTES);
    for (kv_import *im = c->imports; im; im = im->next)
        if (memcmp(im->handle, h->data, sizeof(im->handle)) == 0 && (im->ev != NULL) == is_event) {
            *out = im;
            return 0;
        }
    kv_import *im = calloc(1, sizeof(*im));
    if (im == NULL)
        return fail(r, -ENOMEM, "push: out of memory");
    rekv_ipc_handle hd;
    memcpy(&hd, h->data, sizeof(hd));
    memcpy(im->handle, h->data, sizeof(im->handle));
    rekv_err e = {0};
    const rekv_backend_iface *bi = s->pbe->iface;
    int rc = is_event ? bi->event_import(s->pbe, &hd, &im->ev, &e)
                      : bi->dev_import(s->pbe, &hd, &im->dev, &im->bytes, &e);
    if (rc < 0) {
        free(im);
        return fail(r, rc, "push: %s: %s", what, e.msg[0] ? e.msg : "import failed");
    }
    im->next = c->imports;
    c->imports = im;
    c->n_imports++;
    *out = im;
    return 0;
}

static int h_push(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Push *m, kv_reply *r)
{
    if (s->pbe == NULL)
        return fail(r, -ENOTSUP, "this kvstore has no push backend (start it with --push-backend)");
    size_t n = m->n_src;
    if (m->n_dst != n || m->n_bytes != n || m->n_buffer != n)
        return fail(r, -EINVAL, "push: piece arrays of different lengths (%zu, %zu, %zu, %zu)",
                    m->n_src, m->n_buffer, m->n_dst, m->n_bytes);
    if (m->n_buffers > MAX_PUSH_BUFFERS)
        return fail(r, -EINVAL, "push: %zu buffers, at most %d", m->n_buffers, MAX_PUSH_BUFFERS);
    r->push.backend = (char *)s->pbe->iface->name;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_PUSH;
    r->resp.push = &r->push;
    if (n == 0 && m->n_buffers == 0 && m->wait_event.len == 0 && m->done_event.len == 0)
        return 0; /* a probe */
    if (c->n_imports + m->n_buffers + 2 > MAX_IMPORTS)
        client_drop_imports(s, c, NULL, 0);
    kv_import *bufs[MAX_PUSH_BUFFERS], *wait = NULL, *done = NULL;
    for (size_t i = 0; i < m->n_buffers; i++) {
        bufs[i] = NULL;
        if (import_get(s, c, &m->buffers[i], 0, &bufs[i], r, "buffer") || bufs[i] == NULL)
            return 0;
    }
    if (m->wait_event.len && (import_get(s, c, &m->wait_event, 1, &wait, r, "wait event") || !wait))
        return 0;
    if (m->done_event.len && (import_get(s, c, &m->done_event, 1, &done, r, "done event") || !done))
        return 0;
    rekv_copy_piece *pc = reply_alloc(r, n, sizeof(*pc));
    if (pc == NULL)
        return fail(r, -ENOMEM, "push: out of memory for %zu pieces", n);
    uint64_t lo = s->arena.hdr->data_offset, hi = s->arena.bytes;
    for (size_t i = 0; i < n; i++) {
        uint64_t src = m->src[i], dst = m->dst[i], bytes = m->bytes[i];
        if (m->buffer[i] >= m->n_buffers)
            return fail(r, -EINVAL, "push: piece %zu names buffer %u of %zu", i, m->buffer[i],
                        m->n_buffers);
        if (src < lo || src > hi || bytes > hi - src)
            return fail(
                r, -EINVAL,
                "push: piece %zu reads [%llu, +%llu) outside the arena's blocks [%llu, %llu)", i,
                (unsigned long long)src, (unsigned long long)bytes, (unsigned long long)lo,
                (unsigned long long)hi);
        kv_import *b = bufs[m->buffer[i]];
        if (dst > b->bytes || bytes > b->bytes - dst)
            return fail(r, -EINVAL,
                        "push: piece %zu writes [%llu, +%llu) outside buffer %u of %zu bytes", i,
                        (unsigned long long)dst, (unsigned long long)bytes, m->buffer[i], b->bytes);
        /* within one block this connection pins: anything else may be spilled and its slot
         * given to another sequence while the copy runs */
        uint64_t rel = src - lo, slot = rel / s->arena.slot_bytes;
        uint32_t id = slot < s->arena.n_slots ? s->slot_block[slot] : 0;
        if (bytes > 0 &&
            (slot >= s->arena.n_slots || rel % s->arena.slot_bytes + bytes > s->arena.slot_bytes ||
             id >= s->n_block_ids || s->blocks[id].state != BS_HOST || s->blocks[id].slot != slot ||
             kv_map_get(&c->pins, id) == NULL))
            return fail(r, -EPERM,
                        "push: piece %zu reads [%llu, +%llu), not inside one block this connection "
                        "has pinned",
                        i, (unsigned long long)src, (unsigned long long)bytes);
        pc[i] = (rekv_copy_piece){(uint8_t *)b->dev + dst, (uint8_t *)s->arena.base + src,
                                  (size_t)bytes};
    }
    const rekv_backend_iface *bi = s->pbe->iface;
    if (wait)
        bi->stream_wait_event(s->pstream, wait->ev);
    if (n)
        bi->copy_h2d(s->pstream, pc, n, REKV_XFER_KV);
    if (done)
        bi->event_record(done->ev, s->pstream);
    return 0;
}

static int h_release(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Release *m, kv_reply *r)
{
    if (s->pbe == NULL)
        return fail(r, -ENOTSUP, "this kvstore has no push backend (start it with --push-backend)");
    client_drop_imports(s, c, m->n_handles ? m->handles : NULL, m->n_handles);
    return 0;
}

/* Runs one request; WAIT when parked, else the reply is in r. */
static int dispatch(rekv_kvstore_server *s, kv_pending *p, kv_reply *r, int *hist)
{
    Rekv__Kvstore__Request *q = p->req;
    kv_client *c = client_get(s, p->ident, p->ident_len, 1);
    *hist = H_OTHER;
    if (c == NULL)
        return fail(r, -ENOMEM, "out of memory for client record");
    c->last_seen = s->now;
    if (q->version != REKV_KVSTORE_PROTO_VERSION)
        return fail(r, -EPROTO, "protocol version %u, this server speaks %u", q->version,
                    REKV_KVSTORE_PROTO_VERSION);
    const char *owner = q->owner ? q->owner : "";
    size_t owner_len = strlen(owner);
    if (owner_len > MAX_OWNER)
        return fail(r, -EINVAL, "owner name of %zu bytes: at most %d", owner_len, MAX_OWNER);
    if (strcmp(c->owner, owner) != 0)
        memcpy(c->owner, owner, owner_len + 1);
    switch (q->body_case) {
    case REKV__KVSTORE__REQUEST__BODY_CREATE_SEQ:
        return h_create(s, c, q->create_seq, r);
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
        return h_push(s, c, q->push, r);
    case REKV__KVSTORE__REQUEST__BODY_RELEASE:
        return h_release(s, c, q->release, r);
    default:
        return fail(r, -EBADMSG, "request %llu has no body", (unsigned long long)q->id);
    }
}

static void send_reply(rekv_kvstore_server *s, const uint8_t *ident, size_t ident_len, int delim,
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

static void reply_init(kv_reply *r, uint64_t id)
{
    memset(r, 0, sizeof(*r));
    Rekv__Kvstore__Response ri = REKV__KVSTORE__RESPONSE__INIT;
    Rekv__Kvstore__AppendReply ai = REKV__KVSTORE__APPEND_REPLY__INIT;
    Rekv__Kvstore__TableReply ti = REKV__KVSTORE__TABLE_REPLY__INIT;
    Rekv__Kvstore__PlanReply pi = REKV__KVSTORE__PLAN_REPLY__INIT;
    Rekv__Kvstore__StatsReply si = REKV__KVSTORE__STATS_REPLY__INIT;
    Rekv__Kvstore__DropOwnerReply di = REKV__KVSTORE__DROP_OWNER_REPLY__INIT;
    Rekv__Kvstore__PushReply pu = REKV__KVSTORE__PUSH_REPLY__INIT;
    r->resp = ri;
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

static void pending_free(kv_pending *p)
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
    reply_init(r, p->req->id);
    int hist;
    int rc = dispatch(s, p, r, &hist);
    if (rc == WAIT) {
        reply_done(r);
        free(r);
        return 0;
    }
    pending_release_holds(s, p);
    send_reply(s, p->ident, p->ident_len, p->delim, &r->resp);
    reply_done(r);
    free(r);
    hist_add(&s->hist[hist], rekv_now_ns() - p->t0);
    return 1;
}

static void run_pending(rekv_kvstore_server *s)
{
    kv_pending **pp = &s->pending;
    s->pending_tail = NULL;
    while (*pp) {
        kv_pending *p = *pp;
        if (run_request(s, p)) {
            *pp = p->next;
            pending_free(p);
            continue;
        }
        s->pending_tail = p;
        pp = &p->next;
    }
}

/* ------------------------------------------------------------------ I/O completions */

static void on_completions(rekv_kvstore_server *s)
{
    kv_spill_done d[64];
    int n;
    int any = 0;
    while ((n = kv_spill_reap(s->spill, d, 64, 0)) > 0) {
        any = 1;
        for (int i = 0; i < n; i++) {
            uint32_t id = (uint32_t)d[i].tag;
            kv_block *b = &s->blocks[id];
            size_t bytes = blk_bytes(s, b);
            if (!d[i].is_read) {
                s->spills_in_flight--;
                hist_add(&s->hist[H_SPILL_WRITE], d[i].ns);
                if (b->doomed) {
                    slot_put(s, b->slot);
                    if (d[i].res == 0)
                        fslot_put(s, b->fslot);
                    else
                        kv_spill_slot_bad(s->spill, b->fslot);
                    block_release_id(s, id);
                } else if (d[i].res < 0) {
                    kv_spill_slot_bad(s->spill, b->fslot);
                    b->state = BS_HOST;
                    s->spill_errors++;
                    if (s->spill_err == 0)
                        srv_event(s, REKV_KV_EVENT_ERROR,
                                  "spill write failed: %s; block kept in memory, spilling paused",
                                  strerror(-d[i].res));
                    s->spill_err = d[i].res;
                    s->spill_err_ns = s->now;
                    lru_update(s, id, 1);
                } else if (b->touched || b->pins || b->holds) {
                    fslot_put(s, b->fslot);
                    b->state = BS_HOST;
                    lru_update(s, id, 1);
                } else {
                    b->state = BS_DISK;
                    slot_put(s, b->slot);
                    s->host_n[b->type]--;
                    s->disk_n[b->type]++;
                    s->bytes_spilled += bytes;
                }
            } else {
                s->reads_in_flight--;
                hist_add(&s->hist[H_SPILL_READ], d[i].ns);
                if (b->doomed) {
                    slot_put(s, b->slot);
                    fslot_put(s, b->fslot);
                    block_release_id(s, id);
                } else if (d[i].res < 0 || d[i].crc != b->crc) {
                    slot_put(s, b->slot);
                    b->state = BS_DISK;
                    b->load_err = d[i].res < 0 ? d[i].res : -EBADMSG;
                    if (d[i].res == 0)
                        s->crc_errors++;
                    srv_event(s, REKV_KV_EVENT_ERROR,
                              "read-back of sequence %llu layer %u block %u failed: %s",
                              (unsigned long long)b->seq, b->layer, b->lblock,
                              d[i].res < 0 ? strerror(-d[i].res) : "CRC32C mismatch");
                } else {
                    fslot_put(s, b->fslot);
                    b->state = BS_HOST;
                    s->disk_n[b->type]--;
                    s->host_n[b->type]++;
                    s->bytes_read_back += bytes;
                    lru_update(s, id, 1);
                }
            }
        }
    }
    if (any)
        run_pending(s);
}

/* ------------------------------------------------------------------ sockets */

static void serve_fd_socket(rekv_kvstore_server *s)
{
    for (;;) {
        int c = accept4(s->fd_listen, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0)
            return;
        char byte = 'A';
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } u;
        memset(&u, 0, sizeof(u));
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = u.buf,
                            .msg_controllen = sizeof(u.buf)};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &s->arena.fd, sizeof(int));
        (void)sendmsg(c, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        close(c);
    }
}

static void handle_message(rekv_kvstore_server *s)
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
    if (nf != body + 1 || extra) {
        kv_reply r;
        reply_init(&r, 0);
        fail(&r, -EPROTO, "expected one frame per request, got %zu", nf - 1 + (size_t)extra);
        send_reply(s, p->ident, p->ident_len, p->delim, &r.resp);
        goto out;
    }
    p->req = rekv__kvstore__request__unpack(NULL, zmq_msg_size(&frames[body]),
                                            zmq_msg_data(&frames[body]));
    if (p->req == NULL) {
        kv_reply r;
        reply_init(&r, 0);
        fail(&r, -EBADMSG, "malformed request (%zu bytes): not a kvstore Request",
             zmq_msg_size(&frames[body]));
        send_reply(s, p->ident, p->ident_len, p->delim, &r.resp);
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
    pending_free(p);
    for (size_t i = 0; i < nf; i++)
        zmq_msg_close(&frames[i]);
}

static char *ipc_path_of(const char *endpoint)
{
    if (strncmp(endpoint, "ipc://", 6) != 0)
        return NULL;
    return strdup(endpoint + 6);
}

/* Removes a stale socket file a crash left; -EADDRINUSE when a live server answers on it. */
static int unlink_stale_socket(const char *path, rekv_err *err)
{
    struct stat st;
    if (lstat(path, &st) < 0)
        return 0;
    if (!S_ISSOCK(st.st_mode))
        return rekv_errf(err, -EEXIST, "kvstore: %s exists and is not a socket", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        int live = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        close(fd);
        if (live)
            return rekv_errf(err, -EADDRINUSE, "kvstore: another server is serving on %s", path);
    }
    unlink(path);
    return 0;
}

/* ------------------------------------------------------------------ lifecycle */

void rekv_kvstore_config_defaults(rekv_kvstore_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->lease_ms = 5000;
    cfg->high_pct = 90;
    cfg->low_pct = 80;
    cfg->signal_fd = -1;
    cfg->push_link_latency_us = 10; /* as the worker's emulated link */
}

static void spill_event_cb(void *ctx, rekv_kv_event lvl, const char *msg)
{
    rekv_kvstore_server *s = ctx;
    srv_event(s, lvl, "%s", msg);
}

int rekv_kvstore_server_create(const rekv_kvstore_config *cfg, rekv_kvstore_server **out,
                               rekv_err *err)
{
    int rc = 0;
    *out = NULL;
    rekv_kvstore_server *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore: out of memory");
    s->cfg = *cfg;
    s->fd_listen = -1;
    s->stop_fd = -1;
    s->arena.fd = -1;
    s->arena.base = NULL;
    s->lru_head = s->lru_tail = NIL;
    kv_map_init(&s->seqs);
    for (int i = 0; i < H_COUNT; i++)
        snprintf(s->hist[i].name, sizeof(s->hist[i].name), "%s", hist_names[i]);
    if (s->cfg.lease_ms == 0)
        s->cfg.lease_ms = 5000;
    if (s->cfg.high_pct == 0 || s->cfg.high_pct > 100)
        s->cfg.high_pct = 90;
    if (s->cfg.low_pct == 0 || s->cfg.low_pct > s->cfg.high_pct)
        s->cfg.low_pct = s->cfg.high_pct > 10 ? s->cfg.high_pct - 10 : s->cfg.high_pct;
    if (cfg->endpoint == NULL) {
        rc = rekv_errf(err, -EINVAL, "kvstore: no endpoint");
        goto fail;
    }
    rekv_kv_geometry g = cfg->geometry;
    if ((rc = rekv_kv_geometry_init(&s->cfg.geometry, g.n_layers, g.n_kv_heads, g.head_dim,
                                    g.hidden, g.dtype, err)) < 0)
        goto fail;
    s->endpoint = strdup(cfg->endpoint);
    s->ipc_path = ipc_path_of(cfg->endpoint);
    if (cfg->fd_socket) {
        s->fd_path = strdup(cfg->fd_socket);
    } else if (s->ipc_path) {
        if (asprintf(&s->fd_path, "%s.fd", s->ipc_path) < 0)
            s->fd_path = NULL;
    } else {
        rc = rekv_errf(err, -EINVAL, "kvstore: endpoint %s is not ipc://; give an fd socket path",
                       cfg->endpoint);
        goto fail;
    }
    const char *dir = cfg->spill_dir ? cfg->spill_dir : getenv("TMPDIR");
    s->spill_dir = strdup(dir && *dir ? dir : "/var/tmp");
    if (s->endpoint == NULL || s->fd_path == NULL || s->spill_dir == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore: out of memory");
        goto fail;
    }
    if (strlen(s->fd_path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        rc = rekv_errf(err, -ENAMETOOLONG, "kvstore: socket path %s is too long", s->fd_path);
        goto fail;
    }
    /* arena */
    char notice[256];
    rc = kv_arena_create(&s->arena, cfg->host_bytes, &s->cfg.geometry, cfg->huge_pages,
                         s->cfg.lease_ms, notice, sizeof(notice), err);
    if (rc < 0)
        goto fail;
    if (notice[0])
        srv_event(s, REKV_KV_EVENT_WARN, "%s", notice);
    /* push backend */
    if (cfg->push_backend && cfg->push_backend[0]) {
        char note[256] = "";
        rekv_link_config link = {cfg->push_link_gbps, cfg->push_link_latency_us, 0};
        if ((rc = rekv_backend_create(cfg->push_backend, link.gbps > 0 ? &link : NULL, &s->pbe,
                                      note, sizeof(note), err)))
            goto fail;
        if (!rekv_backend_has_ipc(s->pbe)) {
            rc =
                rekv_errf(err, -ENOTSUP, "kvstore: the %s backend cannot import buffers to push to",
                          s->pbe->iface->name);
            goto fail;
        }
        if ((rc = s->pbe->iface->stream_create(s->pbe, "push", &s->pstream, err)))
            goto fail;
        if (s->pbe->iface->host_register && s->pbe->iface->host_unregister) {
            rekv_err e = {0};
            if (s->pbe->iface->host_register(s->pbe, s->arena.base, s->arena.bytes, &e) == 0)
                s->push_registered = 1;
            else
                srv_event(s, REKV_KV_EVENT_WARN, "push: arena not page-locked: %s", e.msg);
        }
        char over[96] = "";
        if (link.gbps > 0)
            snprintf(over, sizeof(over), " over an emulated link of %g Gbit/s, %g us per copy",
                     link.gbps, link.latency_us);
        srv_event(s, REKV_KV_EVENT_INFO, "push backend: %s%s%s%s", s->pbe->iface->name, over,
                  note[0] ? " — " : "", note);
    }
    s->free_slots = malloc(s->arena.n_slots * sizeof(uint32_t));
    s->slot_block = calloc(s->arena.n_slots ? s->arena.n_slots : 1, sizeof(uint32_t));
    if (s->free_slots == NULL || s->slot_block == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore: out of memory for the slot list");
        goto fail;
    }
    for (uint64_t i = 0; i < s->arena.n_slots; i++)
        s->free_slots[s->n_free_slots++] = (uint32_t)(s->arena.n_slots - 1 - i);
    /* spill tier */
    if (!cfg->no_spill) {
        kv_spill_config sc = {
            .dir = s->spill_dir,
            .max_bytes = cfg->spill_bytes,
            .slots = s->arena.slots,
            .n_slots = s->arena.n_slots,
            .slot_bytes = s->arena.slot_bytes,
            .depth = 64,
            .register_arena = !cfg->no_register_arena,
            .on_event = spill_event_cb,
            .event_ctx = s,
        };
        rc = kv_spill_open(&sc, &s->spill, err);
        if (rc < 0)
            goto fail;
    }
    /* stop eventfd */
    s->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->stop_fd < 0) {
        rc = rekv_errf(err, -errno, "kvstore: eventfd: %s", strerror(errno));
        goto fail;
    }
    /* fd-passing socket */
    if ((rc = unlink_stale_socket(s->fd_path, err)) < 0)
        goto fail;
    s->fd_listen = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->fd_listen < 0) {
        rc = rekv_errf(err, -errno, "kvstore: socket: %s", strerror(errno));
        goto fail;
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s->fd_path);
    mode_t old = umask(077);
    int brc = bind(s->fd_listen, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (brc < 0 || listen(s->fd_listen, 64) < 0) {
        rc = rekv_errf(err, -errno, "kvstore: bind %s: %s", s->fd_path, strerror(errno));
        close(s->fd_listen);
        s->fd_listen = -1;
        goto fail;
    }
    /* ZeroMQ */
    if (s->ipc_path && (rc = unlink_stale_socket(s->ipc_path, err)) < 0)
        goto fail;
    s->zctx = zmq_ctx_new();
    s->zsock = s->zctx ? zmq_socket(s->zctx, ZMQ_ROUTER) : NULL;
    if (s->zsock == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore: zmq socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int zero = 0, hwm = 100000;
    int64_t maxmsg = 64ll << 20;
    zmq_setsockopt(s->zsock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s->zsock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s->zsock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s->zsock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    old = umask(077);
    brc = zmq_bind(s->zsock, s->endpoint);
    umask(old);
    if (brc < 0) {
        rc = rekv_errf(err, -zmq_errno(), "kvstore: bind %s: %s", s->endpoint,
                       zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (s->ipc_path)
        chmod(s->ipc_path, 0600);
    *out = s;
    return 0;
fail:
    rekv_kvstore_server_destroy(s);
    return rc;
}

int rekv_kvstore_server_run(rekv_kvstore_server *s, rekv_err *err)
{
    zmq_pollitem_t items[5];
    int n = 0;
    int i_z = n;
    items[n++] = (zmq_pollitem_t){.socket = s->zsock, .events = ZMQ_POLLIN};
    int i_fd = n;
    items[n++] = (zmq_pollitem_t){.fd = s->fd_listen, .events = ZMQ_POLLIN};
    int i_stop = n;
    items[n++] = (zmq_pollitem_t){.fd = s->stop_fd, .events = ZMQ_POLLIN};
    int i_io = -1, i_sig = -1;
    if (s->spill) {
        i_io = n;
        items[n++] = (zmq_pollitem_t){.fd = kv_spill_event_fd(s->spill), .events = ZMQ_POLLIN};
    }
    if (s->cfg.signal_fd >= 0) {
        i_sig = n;
        items[n++] = (zmq_pollitem_t){.fd = s->cfg.signal_fd, .events = ZMQ_POLLIN};
    }
    uint64_t lease_period = (uint64_t)s->cfg.lease_ms * 1000000ull / 4;
    if (lease_period < 1000000)
        lease_period = 1000000;
    s->now = rekv_now_ns();
    s->next_lease_check = s->now + lease_period;
    while (!s->stop) {
        if (s->spill)
            (void)kv_spill_submit(s->spill);
        s->now = rekv_now_ns();
        long timeout = s->next_lease_check > s->now
                           ? (long)((s->next_lease_check - s->now) / 1000000ull) + 1
                           : 0;
        if (timeout > 1000)
            timeout = 1000; /* on_tick at least once a second */
        if (s->cfg.on_tick)
            s->cfg.on_tick(s->cfg.event_ctx);
        int pr = zmq_poll(items, n, timeout);
        if (pr < 0) {
            if (zmq_errno() == EINTR)
                continue;
            return rekv_errf(err, -zmq_errno(), "kvstore: zmq_poll: %s", zmq_strerror(zmq_errno()));
        }
        s->now = rekv_now_ns();
        if (items[i_stop].revents & ZMQ_POLLIN)
            s->stop = 1;
        if (i_sig >= 0 && (items[i_sig].revents & ZMQ_POLLIN)) {
            struct signalfd_siginfo si; /* or an eventfd's 8-byte count */
            ssize_t r = read(s->cfg.signal_fd, &si, sizeof(si));
            if (r == (ssize_t)sizeof(si))
                srv_event(s, REKV_KV_EVENT_INFO, "signal %u: shutting down", si.ssi_signo);
            else if (r > 0)
                srv_event(s, REKV_KV_EVENT_INFO, "stop requested: shutting down");
            if (r > 0)
                s->stop = 1;
        }
        if (i_io >= 0 && (items[i_io].revents & ZMQ_POLLIN))
            on_completions(s);
        if (items[i_fd].revents & ZMQ_POLLIN)
            serve_fd_socket(s);
        if (items[i_z].revents & ZMQ_POLLIN) {
            for (int k = 0; k < 256; k++) {
                int ev = 0;
                size_t el = sizeof(ev);
                if (zmq_getsockopt(s->zsock, ZMQ_EVENTS, &ev, &el) < 0 || !(ev & ZMQ_POLLIN))
                    break;
                handle_message(s);
                s->now = rekv_now_ns();
            }
        }
        if (s->now >= s->next_lease_check) {
            leases_check(s);
            s->next_lease_check = s->now + lease_period;
            if (s->pending)
                run_pending(s); /* a paused spill tier may have resumed */
        }
        spill_watermark(s);
    }
    return 0;
}

void rekv_kvstore_server_stop(rekv_kvstore_server *s)
{
    uint64_t one = 1;
    ssize_t w = write(s->stop_fd, &one, sizeof(one));
    (void)w;
}

void rekv_kvstore_server_destroy(rekv_kvstore_server *s)
{
    if (s == NULL)
        return;
    /* parked requests get an answer rather than a timeout */
    while (s->pending) {
        kv_pending *p = s->pending;
        s->pending = p->next;
        kv_reply r;
        reply_init(&r, p->req->id);
        fail(&r, -ESHUTDOWN, "kvstore is shutting down");
        send_reply(s, p->ident, p->ident_len, p->delim, &r.resp);
        pending_free(p);
    }
    kv_spill_close(s->spill); /* waits for in-flight I/O before the arena goes */
    if (s->zsock)
        zmq_close(s->zsock);
    if (s->zctx)
        zmq_ctx_term(s->zctx);
    if (s->fd_listen >= 0) {
        close(s->fd_listen);
        unlink(s->fd_path);
    }
    if (s->ipc_path && s->zsock)
        unlink(s->ipc_path);
    if (s->stop_fd >= 0)
        close(s->stop_fd);
    if (s->pbe) { /* imports unmapped, then the stream and the backend, before the arena goes */
        for (kv_client *c = s->clients; c; c = c->next)
            client_drop_imports(s, c, NULL, 0);
        if (s->pstream)
            s->pbe->iface->stream_destroy(s->pstream);
        if (s->push_registered)
            s->pbe->iface->host_unregister(s->pbe, s->arena.base);
        rekv_backend_destroy(s->pbe);
    }
    if (s->arena.base != NULL)
        kv_arena_destroy(&s->arena);
    for (size_t i = 0; i < s->seqs.cap; i++)
        if (s->seqs.keys[i] != KV_MAP_EMPTY)
            seq_free_mem(s, (kv_seq *)(uintptr_t)s->seqs.vals[i]);
    kv_map_free(&s->seqs);
    while (s->clients) {
        kv_client *c = s->clients;
        s->clients = c->next;
        kv_map_free(&c->pins);
        free(c);
    }
    free(s->blocks);
    free(s->free_ids);
    free(s->free_slots);
    free(s->slot_block);
    free(s->scratch);
    free(s->endpoint);
    free(s->ipc_path);
    free(s->fd_path);
    free(s->spill_dir);
    free(s);
}
