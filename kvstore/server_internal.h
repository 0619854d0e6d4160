/* server_internal.h — the kvstore server's state and the functions its files share: server.c
 * (create, destroy, the event loop), blocks.c (blocks, slots, LRU spilling and read-back),
 * leases.c (connections, pin leases, owners), handlers.c (the requests) and push.c (the push
 * path). Not part of the public interface. */
#ifndef REKV_KVSTORE_SERVER_INTERNAL_H
#define REKV_KVSTORE_SERVER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/conncap.h"
#include "common/evloop.h"
#include "common/metrics.h"
#include "common/ratelimit.h"
#include "kvstore/events.h"
#include "kvstore/kv_internal.h"
#include "proto/kvstore.pb-c.h"

/* The push backend's handles (gpuworker/device/backend.h); only push.c looks inside them. */
typedef struct rekv_backend rekv_backend;
typedef struct rekv_stream rekv_stream;
typedef struct rekv_event rekv_event;

#define NIL UINT32_MAX
#define MAX_IDENT 256
#define MAX_OWNER REKV_KV_OWNER_MAX

/* BS_FRESH: appended when the arena had no room for it; no slot and nothing written yet, it takes
 * a slot (and no read) when first planned. Counted with the blocks on disk (not in memory). */
enum { BS_UNUSED = 0, BS_HOST, BS_SPILLING, BS_DISK, BS_LOADING, BS_FRESH };
/* kv_block.ahead: read-ahead (Plan.ahead) wants it read back / is reading it / it is resident
 * and not pinned yet (then the read-ahead and the watermark spiller leave it alone) */
enum { AH_NONE = 0, AH_QUEUED, AH_READING, AH_READY };
enum { H_PLAN = 0, H_PIN, H_APPEND, H_OTHER, H_SPILL_WRITE, H_SPILL_READ, H_COUNT };

typedef struct kv_block {
    uint64_t seq;        /* owning sequence */
    uint32_t layer;      /* layer */
    uint32_t lblock;     /* logical block number */
    uint8_t type;        /* rekv_kv_block_type */
    uint8_t state;       /* BS_* */
    uint8_t touched;     /* used while its spill was in flight: keep the host copy */
    uint8_t doomed;      /* freed while I/O was in flight: release on completion */
    uint8_t in_lru;      /* LRU_*: on a list that may be spilled (resident, unpinned, unheld) */
    uint8_t hit_read;    /* taken by a prefix while on disk: its read-back counts as a hit's */
    uint8_t persisted;   /* its slot's record is in the prefix cache's index (persist.c) */
    uint8_t ahead;       /* AH_*: where read-ahead stands with it */
    int32_t load_err;    /* sticky read-back failure, 0 when none: -EBADMSG (CRC), else errno */
    uint32_t slot;       /* host slot (HOST, SPILLING, LOADING) */
    uint32_t fslot;      /* spill-file slot (SPILLING, DISK, LOADING) */
    uint32_t crc;        /* CRC32C of the spilled bytes */
    uint32_t pins;       /* pins held by clients */
    uint32_t holds;      /* holds of parked requests */
    uint32_t prev, next; /* LRU links (block ids) */
    uint32_t refs;       /* sequence tables holding it, plus 1 while the prefix cache does */
    uint32_t centry;     /* its prefix cache entry (prefix.c), NIL when not cached */
} kv_block;

/* kv_block.in_lru: which list — the running sequences' (LRU, done first) or the cache's (blocks
 * only the prefix cache holds: spilled, or evicted, before any sequence's block) */
enum { LRU_NONE = 0, LRU_MAIN, LRU_CACHE };

/* A cached block position (prefix.c): the chain key of 16 tokens and everything before them, and
 * that position's block in every layer. Entries form an LRU list, the deepest of a run touched
 * first so that a chain is evicted from its end. */
typedef struct kv_centry {
    uint64_t key, parent;                   /* chain key; the previous position's (or the root) */
    uint32_t tokens[REKV_KV_BLOCK_TOKENS];  /* checked on every match: a hash collision misses */
    uint8_t kind;                           /* rekv_kv_block_type of every layer's block */
    uint8_t live;                           /* in use (else on the free list) */
    uint32_t *ids;                          /* [n_layers] block ids, each holding a reference */
    uint32_t prev, next;                    /* entry LRU links (entry indices) */
} kv_centry;

typedef struct kv_seq {
    uint64_t id;       /* caller-chosen id */
    uint64_t n_tokens; /* tokens appended */
    uint32_t n_blocks; /* logical blocks per layer */
    uint32_t n_kv;     /* of those, allocated as KV blocks (freeing does not change it) */
    uint32_t n_taken;  /* of those, the first taken from the prefix cache when it was made */
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

typedef struct kv_client {
    uint8_t ident[MAX_IDENT]; /* ZeroMQ routing id */
    size_t ident_len;
    uint64_t last_seen;        /* ns of the last request */
    kv_map pins;               /* block id -> pin count */
    char owner[MAX_OWNER + 1]; /* the owner name its last request carried; "" for none */
    kv_import *imports;        /* the push path's imports for it */
    size_t n_imports;
    rekv_stream *pstream; /* the push path's stream for it (its waits, copies, records), made at
                             its first push: one per connection, so that a dead worker's pending
                             wait blocks only its own (on cuda it never completes) */
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
    uint64_t misses;            /* blocks it had to read back */
    uint64_t waits, wait_bytes; /* a pin: blocks on disk or being read when it came */
    int runs;                   /* times it ran (parked requests run again) */
    int remote_asked;           /* it asked the remote tier (remote.c) for its prefix */
    uint64_t remote_job;        /* that read's id */
    struct kv_pending *next;
} kv_pending;

/* Log lines a fault can repeat per request or per block: srv_event_rl lets one a second through. */
typedef enum {
    SRV_RL_SPILL_GROW,
    SRV_RL_SPILL_WRITE,
    SRV_RL_READ_BACK,
    SRV_RL_REMOTE, /* remote.c */
    SRV_RL_COUNT
} srv_rl_site;

struct rekv_kvstore_server {
    rekv_kvstore_config cfg; /* copy; strings below are owned copies */
    char *endpoint;          /* ZeroMQ endpoint */
    char *ipc_path;          /* filesystem path of an ipc:// endpoint, or NULL */
    char *fd_path;           /* fd-passing socket path */
    char *spill_dir;
    kv_arena arena;
    kv_spill *spill;    /* NULL with no_spill */
    void *zctx, *zsock; /* ZeroMQ context and ROUTER socket */
    rekv_conncap *cap;  /* zsock's connection count (common/conncap.h) */
    int fd_listen;      /* UNIX socket handing out the memfd */
    rekv_evloop *loop;  /* the event loop (server.c); rekv_kvstore_server_stop stops it */
    kv_block *blocks;   /* [n_block_ids] */
    uint32_t n_block_ids, cap_block_ids;
    uint32_t *free_ids; /* recycled block ids */
    uint32_t n_free_ids, cap_free_ids;
    kv_slots hs;          /* the arena's host slots, two classes (slots.c) */
    uint32_t *slot_block; /* [n_big * per_big] the block last given each slot (push checks) */
    uint64_t instance;    /* random, per store: clients tell stores apart by it (Stats) */
    uint32_t lru_head, lru_tail; /* spilled first (least recently used, or done) / last */
    uint64_t lru_len;
    kv_map seqs; /* seq id -> kv_seq * */
    kv_client *clients;
    kv_pending *pending, *pending_tail;
    uint32_t spills_in_flight, reads_in_flight;
    uint32_t spilling_n[2]; /* of the spills in flight, by block type */
    rekv_ratelimit rl[SRV_RL_COUNT]; /* srv_event_rl's limits */
    int spill_err;         /* the disk was full (the file could not grow): spilling paused a
                            * second, or until a file slot is freed */
    uint64_t spill_err_ns; /* when it happened */
    /* The spill tier fails (a write, or growing the file, failed other than for room: EIO, a file
     * system gone read-only): -errno, 0 when it works. Nothing is spilled, the arena serves (a
     * cached block is evicted instead), admission is told the tier has no room (Stats), and
     * once a second a probe write (srv_spill_probe) tries it; the first that succeeds ends it. */
    int spill_fail;
    char spill_fail_why[160]; /* spill_one's reason while failing */
    uint64_t spill_probe_ns;  /* the last probe's start */
    int spill_probing;        /* a probe write is in flight, to file slot spill_probe_slot */
    uint32_t spill_probe_slot;
    uint64_t now;          /* ns, refreshed by each of the loop's callbacks */
    uint32_t *scratch; /* resolved block ids of the current request */
    size_t cap_scratch;
    uint64_t host_n[2], disk_n[2];
    uint64_t bytes_spilled, bytes_read_back, pin_hits, pin_misses;
    uint32_t *ahead_q; /* read-ahead: block ids to read back, in the order asked */
    size_t ahead_n, ahead_cap;
    uint64_t pin_wait_blocks, pin_wait_bytes, read_ahead_blocks, read_ahead_bytes;
    uint64_t spill_errors, crc_errors, read_errors, leases_expired;
    uint64_t sequences_reclaimed; /* dropped by DropOwner or with their owner's lease */
    int orphans_left;             /* a dead owner's sequence was busy: sweep again at next check */
    rekv_kv_hist hist[H_COUNT];
    rekv_backend *pbe;    /* push backend, or NULL (each connection has its stream) */
    int push_registered;  /* the arena is registered with it (host_register) */
    rekv_metrics_server *metrics; /* the scrape port (server_metrics.c); NULL when none */
    /* the prefix cache (prefix.c) */
    uint32_t cache_head, cache_tail; /* blocks only the cache holds, resident: spilled first */
    kv_centry *centries;             /* [n_centries] */
    uint32_t n_centries, cap_centries;
    uint32_t *free_centries;         /* recycled entry indices */
    uint32_t n_free_centries, cap_free_centries;
    kv_map cindex;                   /* chain key -> entry index */
    uint32_t ce_head, ce_tail;       /* entry LRU: least / most recently used */
    uint64_t ce_live;                /* entries in use */
    uint64_t px_lookups, px_hit_tokens, px_hit_host, px_hit_disk, px_evictions, px_hit_read_bytes,
        px_published;
    /* kept across restarts (persist.c; --prefix-dir): the named spill file, the index's log and
     * the directory's lock; -1 / NULL when not */
    char *spill_path, *idx_path;
    int idx_fd, idx_lock;
    struct kv_remote *remote; /* the remote tier (remote.c; --remote), NULL when none */
    /* KV events for routers (events.c; --kv-events): NULL when not published; events_mute while
     * ClearCache evicts (one AllBlocksCleared tells it) */
    kv_events *events;
    int events_mute;
};

/* What stops an owner from dropping one of its sequences (srv_owned_seq_busy). */
enum { OWNED_FREE = 0, OWNED_HELD, OWNED_PINNED };

/* ------------------------------------------------------------------ request context */

typedef struct kv_reply {
    Rekv__Kvstore__Response resp;
    Rekv__Kvstore__AppendReply append;
    Rekv__Kvstore__TableReply table;
    Rekv__Kvstore__PlanReply plan;
    Rekv__Kvstore__StatsReply stats;
    Rekv__Kvstore__DropOwnerReply drop_owner;
    Rekv__Kvstore__PushReply push;
    Rekv__Kvstore__PrefixReply prefix;
    Rekv__Kvstore__Histogram hists[H_COUNT];
    Rekv__Kvstore__Histogram *hist_ptrs[H_COUNT];
    char err[768];
    void *allocs[8]; /* arrays to free after packing */
    int n_allocs;
} kv_reply;

/* ------------------------------------------------------------------ server.c */

extern const char *const srv_hist_names[H_COUNT];

/* ------------------------------------------------------------------ server_metrics.c */

/* The rekv_metrics_render_fn of the scrape port (ctx: the server). */
int srv_metrics_render(void *ctx, rekv_metrics_buf *b);
/* Reports one line through cfg.on_event, when set. */
void srv_event(rekv_kvstore_server *s, rekv_kv_event lvl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* srv_event, at most one line a second for the call site; the next line let through says how many
 * were held back ("(N similar messages suppressed)"). */
void srv_event_rl(rekv_kvstore_server *s, srv_rl_site site, rekv_kv_event lvl, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void srv_hist_add(rekv_kv_hist *h, uint64_t ns);
/* Grows *p (of *cap elements of elem bytes) to hold need, doubling; 0 or -ENOMEM. */
int srv_grow(void **p, size_t *cap, size_t need, size_t elem);

/* ------------------------------------------------------------------ blocks.c */

size_t srv_blk_bytes(const rekv_kvstore_server *s, const kv_block *b);
/* Byte offset of a block's host slot in the arena. */
uint64_t srv_blk_offset(const rekv_kvstore_server *s, const kv_block *b);
/* A host slot for block id (of its type): 0, or -ENOSPC. */
int srv_slot_take(rekv_kvstore_server *s, uint32_t id);
void srv_lru_update(rekv_kvstore_server *s, uint32_t id, int touch);
/* Like srv_lru_update, but a block that may be spilled goes to the end spilled first (a client is
 * done with it until its next sweep: Unpin.done). */
void srv_lru_done(rekv_kvstore_server *s, uint32_t id);
/* Queues the blocks ids[0..n) for read-ahead (marks the resident ones as wanted soon). */
void srv_ahead_add(rekv_kvstore_server *s, const uint32_t *ids, size_t n);
/* Starts the read-backs read-ahead can start now, and spills what may be spilled (never a block
 * read-ahead wants) to make room for the rest. */
void srv_ahead_pump(rekv_kvstore_server *s);
int srv_block_new(rekv_kvstore_server *s, uint32_t *out);
void srv_block_release_id(rekv_kvstore_server *s, uint32_t id);
void srv_block_free(rekv_kvstore_server *s, uint32_t id);
/* Drops one reference (a sequence's, or the cache's); the last frees the block (srv_block_free). */
void srv_block_unref(rekv_kvstore_server *s, uint32_t id);
/* Makes sure need[type] blocks (KV, ACT) fit the free slots or will once spills in flight end.
 * 0: they fit now; 1: wait for spills; <0 with *why: impossible. */
int srv_ensure_room(rekv_kvstore_server *s, const uint64_t need[2], char *why, size_t why_len);
void srv_spill_watermark(rekv_kvstore_server *s);
/* While the spill tier fails: a probe write once a second (called every round). */
void srv_spill_probe(rekv_kvstore_server *s);
/* At a clean stop with --prefix-dir: writes every resident block only the prefix cache holds to
 * the spill tier (logged in the index as each write completes) while it has room, and waits for
 * the writes. */
void srv_cache_flush(rekv_kvstore_server *s);
kv_seq *srv_seq_get(rekv_kvstore_server *s, uint64_t id);
void srv_seq_free_mem(rekv_kvstore_server *s, kv_seq *q);
/* Handles the spill tier's finished I/O, then reruns the parked requests. */
void srv_on_completions(rekv_kvstore_server *s);

/* ------------------------------------------------------------------ prefix.c */

void srv_cache_init(rekv_kvstore_server *s);
void srv_cache_free(rekv_kvstore_server *s);
/* Evicts the cache entry of the block at the cache list's head (resident blocks only the cache
 * holds): 1 when it freed something, 0 when the list is empty. */
int srv_cache_evict_host(rekv_kvstore_server *s);
/* Evicts the least recently used entry holding a spilled block only the cache holds (its file
 * slot comes back): 1 when it did, 0 when none. */
int srv_cache_evict_disk(rekv_kvstore_server *s);
/* 1 when entry i may be evicted: none of its blocks that only the cache holds is pinned or held. */
int srv_cache_evictable(const rekv_kvstore_server *s, uint32_t i);
/* Drops entry i from the cache (its blocks' cache references); i must be evictable. */
void srv_cache_evict(rekv_kvstore_server *s, uint32_t i);
/* CreateSeq's prefix: makes q start with the longest cached run of px's full blocks. */
int srv_cache_take(rekv_kvstore_server *s, kv_seq *q, Rekv__Kvstore__Prefix *px, kv_reply *r);
/* p: the request (parked while the remote tier is asked) */
int srv_h_lookup(rekv_kvstore_server *s, kv_pending *p, Rekv__Kvstore__Lookup *m, kv_reply *r);
/* With a remote tier: asks it for px's full blocks past the local run, once per request p.
 * 1 when p must wait (park it and run it again), 0 to answer from what is local. */
int srv_cache_fetch(rekv_kvstore_server *s, kv_pending *p, const Rekv__Kvstore__Prefix *px);
struct kv_remote_want;
/* A position read back from the remote tier (w: its key, parent, kind and tokens, already
 * checked): an entry whose blocks take free arena slots and get data's bytes, layer by layer
 * (layer_bytes each). 0, or -EEXIST (already here), -ENOSPC (no free room), -ENOMEM. */
int srv_cache_adopt_host(rekv_kvstore_server *s, const struct kv_remote_want *w,
                         const uint8_t *data, size_t layer_bytes);
int srv_h_publish(rekv_kvstore_server *s, Rekv__Kvstore__Publish *m, kv_reply *r);
int srv_h_clear_cache(rekv_kvstore_server *s, kv_reply *r);
/* A position read back from the index at start: its blocks on disk (file slot fslots[l] of layer
 * l, their CRC32C crcs[l], each already logged) and its entry. 0, or -ENOMEM / -EEXIST. */
int srv_cache_adopt(rekv_kvstore_server *s, uint64_t key, uint64_t parent, int kind,
                    const uint32_t *tokens, const uint32_t *fslots, const uint32_t *crcs);

/* ------------------------------------------------------------------ persist.c */

/* Opens (creating) dir's index, keeps what of it is intact as cached blocks on disk (the spill
 * tier, already open on dir's spill file, adopts their slots) and starts a new log. */
int srv_persist_open(rekv_kvstore_server *s, const char *dir, rekv_err *err);
void srv_persist_close(rekv_kvstore_server *s);
/* Logs that cached block id is on disk (once its spill write completed, or it was published
 * there); nothing without an index, for a block not cached or already logged. */
void srv_persist_block(rekv_kvstore_server *s, uint32_t id);
/* Logs that b's slot no longer holds it (before the slot can be reused). */
void srv_persist_drop(rekv_kvstore_server *s, kv_block *b);

/* ------------------------------------------------------------------ events.c */

/* Entry i was published (its BlockStored) / is evicted (its BlockRemoved). */
void srv_events_stored(rekv_kvstore_server *s, uint32_t i);
void srv_events_removed(rekv_kvstore_server *s, uint32_t i);
/* AllBlocksCleared, then every entry the cache holds, parents first: what a router must believe
 * after a start (the cache kept on disk) or a ClearCache (what pins kept). */
void srv_events_announce(rekv_kvstore_server *s);
/* The publisher's socket is readable: a subscriber that joined gets the whole picture (an
 * rekv_evloop_io_fn; ctx: the server). */
void srv_events_on_subscribe(rekv_evloop *loop, void *ctx, short revents);
/* The replay socket is readable: answers the requests (an rekv_evloop_io_fn). */
void srv_events_on_replay(rekv_evloop *loop, void *ctx, short revents);
/* Sends the round's events as one batch (the loop's before-sleep hook). */
void srv_events_flush(rekv_kvstore_server *s);

/* ------------------------------------------------------------------ leases.c */

kv_client *srv_client_get(rekv_kvstore_server *s, const uint8_t *ident, size_t len, int create);
int srv_owner_seqs(const rekv_kvstore_server *s, const char *owner, uint64_t **ids, size_t *n);
int srv_owned_seq_busy(const rekv_kvstore_server *s, const kv_seq *q, const char *owner);
uint64_t srv_owned_seq_drop(rekv_kvstore_server *s, kv_seq *q, const char *owner);
/* Expires silent connections' pins and drops the sequences of owners none of whose connections
 * is left. */
void srv_leases_check(rekv_kvstore_server *s);

/* ------------------------------------------------------------------ handlers.c */

void *srv_reply_alloc(kv_reply *r, size_t n, size_t elem);
/* Fills r with an error reply (status code, message); returns 0, the handlers' "answered". */
int srv_fail(kv_reply *r, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void srv_reply_init(kv_reply *r, uint64_t id);
void srv_send_reply(rekv_kvstore_server *s, const uint8_t *ident, size_t ident_len, int delim,
                    Rekv__Kvstore__Response *resp);
void srv_pending_free(kv_pending *p);
/* Runs the parked requests again, in arrival order; those that finish are answered and freed. */
void srv_run_pending(rekv_kvstore_server *s);
/* Receives one request from the ROUTER socket and runs it, or parks it. */
void srv_handle_message(rekv_kvstore_server *s);

/* ------------------------------------------------------------------ push.c */

int srv_push_open(rekv_kvstore_server *s, const rekv_kvstore_config *cfg, rekv_err *err);
void srv_push_close(rekv_kvstore_server *s);
void srv_client_drop_imports(rekv_kvstore_server *s, kv_client *c, ProtobufCBinaryData *handles,
                             size_t n);
/* The connection is gone (its lease expired, or the store stops): its imports and its stream. */
void srv_client_push_end(rekv_kvstore_server *s, kv_client *c);
int srv_h_push(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Push *m, kv_reply *r);
int srv_h_release(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Release *m, kv_reply *r);

#endif
