/* kvstore.h — the public interface of rekv's host-memory block store.
 *
 * The kvstore daemon (rekv-kvstore) owns one shared-memory arena holding fixed-size blocks of the
 * KV cache and of activation checkpoints, per-sequence block tables, and a spill tier on NVMe
 * written and read with io_uring. Clients (the gpuworker, tests, the bench) talk to it over a
 * ZeroMQ ROUTER socket with protobuf-c messages (proto/kvstore.proto) and read and write block
 * contents straight in the arena, which they map.
 *
 * Arena sharing: the arena is a memfd (nothing to clean up after any exit, crash included). ZeroMQ
 * cannot pass file descriptors, so the daemon also listens on a UNIX stream socket (mode 0600) at
 * the endpoint's path plus ".fd" (for ipc:// endpoints; otherwise set fd_socket explicitly) and
 * sends the memfd with SCM_RIGHTS to every client that connects, then closes the connection.
 *
 * Contract for block contents: a client may read or write a block only while it holds a pin on it
 * (Plan with pin = true). Unpinned blocks may be spilled and their host memory reused at any time.
 * Pins are leased: every request renews the caller's lease; a client silent for longer than the
 * lease (lease_ms) loses all its pins. A client may name an owner (rekv_kvstore_client_set_owner;
 * the gpuworker uses its worker name): the sequences it creates belong to that owner, and once no
 * connection of the owner has been heard from for a lease (the owner died) they are dropped as
 * well, so a dead worker's blocks come back without restarting the store. A worker restarted under
 * the same name drops them at once with rekv_kvstore_drop_owner before it creates any. Sequences
 * of clients without an owner stay until dropped.
 *
 * Push (optional; rekv_kvstore_config.push_backend): a store started with a backend can copy
 * blocks into a client's device receive buffers itself, so that the client's GPU need not pull
 * them across (DESIGN.md, "Processes"). The client exports the buffers and two events with the
 * device runtime's IPC entries (gpuworker/device/backend.h: dev_alloc_shared,
 * event_create_shared) and sends their 128-byte handles with the pieces (rekv_kvstore_push);
 * the store imports them once per connection (cached by handle bytes), enqueues the copies arena
 * -> buffer on its own stream after a GPU-side wait on the first event, records the second event,
 * and replies — the client then
 * makes its stream wait on that event; nobody waits on the CPU for the copies. Every piece is
 * checked against the arena and the imported buffer's size. Imports are dropped on
 * rekv_kvstore_release (a client releases a buffer before freeing it), when the connection's
 * lease expires, and when the store stops. Each piece must lie inside one block the connection
 * pins (-EPERM otherwise): an unpinned block may be spilled and its slot reused mid-copy.
 *
 * Every library function returns 0 or a negative errno and, on failure, fills the rekv_err with
 * one line. Nothing here prints or exits; the server reports notable events through an optional
 * callback so that only the daemon's main decides what to log. */
#ifndef REKV_KVSTORE_H
#define REKV_KVSTORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/err.h"
#include "gpuworker/device/backend.h"
#include "loader/loader.h"

/* ---------------------------------------------------------------- block geometry */

#define REKV_KV_BLOCK_TOKENS 16
#define REKV_KVSTORE_PROTO_VERSION 1u
#define REKV_KV_OWNER_MAX 128 /* bytes of an owner name (rekv_kvstore_client_set_owner) */

typedef enum rekv_kv_block_type {
    REKV_KV_BLOCK_KV = 0,  /* K then V, each [kv_head][token][head_dim] */
    REKV_KV_BLOCK_ACT = 1, /* the layer's input activation, [token][hidden] */
} rekv_kv_block_type;

typedef enum rekv_kv_tier {
    REKV_KV_TIER_GPU = 0,  /* reserved for the gpuworker's own tables; the store never uses it */
    REKV_KV_TIER_HOST = 1, /* resident in the arena; phys is the host slot */
    REKV_KV_TIER_DISK = 2, /* spilled; phys is the spill-file slot */
    REKV_KV_TIER_FREE = 3, /* freed by a Free request; no contents */
} rekv_kv_tier;

typedef struct rekv_kv_geometry {
    uint32_t n_layers;     /* decoder layers */
    uint32_t n_kv_heads;   /* key/value heads */
    uint32_t head_dim;     /* elements per head */
    uint32_t hidden;       /* model width (ACT block row length) */
    rekv_dtype dtype;      /* cache dtype: REKV_DTYPE_F16 or REKV_DTYPE_F32 */
    uint32_t block_tokens; /* always REKV_KV_BLOCK_TOKENS */
} rekv_kv_geometry;

/* HybridServe's request block allocation rule (003 Eq. 5, 001 Eq. 11): a sequence holding n_kv
 * KV blocks and n_act ACT blocks allocates next the type that leaves its KV count closest to
 * kv_parts:act_parts, i.e. KV iff |n_kv + 1 - f(n+1)| < |n_kv - f(n+1)|, f = kv/(kv+act),
 * n = n_kv + n_act; exact ties go to ACT (fewer PCIe bytes). 0:0 means all KV. Integer
 * arithmetic, so exact. The paper's example: KV:ACT = 1:3 holding two KV and five ACT -> ACT. */
rekv_kv_block_type rekv_kv_next_block_type(uint64_t n_kv, uint64_t n_act, uint32_t kv_parts,
                                           uint32_t act_parts);

/* Fills g from a model config; cache_dtype must be F16 or F32. Returns 0 or -EINVAL. */
int rekv_kv_geometry_from_config(const rekv_model_config *cfg, rekv_dtype cache_dtype,
                                 rekv_kv_geometry *g, rekv_err *err);
/* Fills g from explicit sizes (validated like the above). */
int rekv_kv_geometry_init(rekv_kv_geometry *g, uint32_t n_layers, uint32_t n_kv_heads,
                          uint32_t head_dim, uint32_t hidden, rekv_dtype cache_dtype,
                          rekv_err *err);
/* Bytes of one KV block: 2 * n_kv_heads * block_tokens * head_dim * dtype size. */
size_t rekv_kv_block_bytes(const rekv_kv_geometry *g);
/* Bytes of one ACT block: block_tokens * hidden * dtype size. */
size_t rekv_kv_act_block_bytes(const rekv_kv_geometry *g);
/* Byte offset inside a KV block of K[kv_head][token][0] and V[kv_head][token][0]. */
size_t rekv_kv_k_offset(const rekv_kv_geometry *g, uint32_t kv_head, uint32_t token);
size_t rekv_kv_v_offset(const rekv_kv_geometry *g, uint32_t kv_head, uint32_t token);
/* Byte offset inside an ACT block of row `token`. */
size_t rekv_kv_act_offset(const rekv_kv_geometry *g, uint32_t token);

/* ---------------------------------------------------------------- shared arena header */

#define REKV_KV_ARENA_MAGIC 0x414b5652u /* "RVKA" little-endian */
#define REKV_KV_ARENA_VERSION 2u

/* The first bytes of the arena (offset 0). Written once by the daemon before any client maps the
 * arena; read-only afterwards. Blocks live in slots of two classes carved from one budget, so a
 * block costs its real bytes: big slot s starts at data_offset + s * slot_bytes and holds one block
 * of the larger type, or small_slot_bytes-sized blocks of the smaller one (kvstore/slots.c); the
 * offsets a Plan returns say where each block is. */
typedef struct rekv_kv_arena_header {
    uint32_t magic;           /* REKV_KV_ARENA_MAGIC */
    uint32_t version;         /* REKV_KV_ARENA_VERSION */
    uint64_t arena_bytes;     /* size of the whole mapping */
    uint64_t data_offset;     /* offset of slot 0 (page aligned) */
    uint64_t slot_bytes;      /* bytes per big slot: max(KV, ACT block) rounded up to 4096 */
    uint64_t n_slots;         /* big slots in the arena */
    uint64_t kv_block_bytes;  /* rekv_kv_block_bytes() */
    uint64_t act_block_bytes; /* rekv_kv_act_block_bytes() */
    uint32_t n_layers;        /* geometry, as rekv_kv_geometry */
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t hidden;
    uint32_t dtype;           /* rekv_dtype */
    uint32_t block_tokens;    /* REKV_KV_BLOCK_TOKENS */
    uint32_t lease_ms;        /* pin lease; clients renew well within it */
    uint32_t huge_pages;      /* 1 when the arena is backed by hugetlb pages */
    uint64_t small_slot_bytes; /* bytes per small slot: min(KV, ACT block) rounded up to 4096;
                                * slot_bytes when a big slot holds only one of them */
    uint8_t reserved[32];     /* zero; pads the header to 128 bytes */
} rekv_kv_arena_header;
_Static_assert(sizeof(rekv_kv_arena_header) == 128, "arena header is 128 bytes");

/* Checks a mapped arena's header (magic, version, sizes against map_bytes). */
int rekv_kv_arena_header_check(const rekv_kv_arena_header *h, size_t map_bytes, rekv_err *err);

/* Copies n blocks of `bytes` bytes from arena + offsets[i] to dst + i * bytes (non-temporal
 * stores for large gathers). */
void rekv_kv_gather(void *dst, const void *arena, const uint64_t *offsets, size_t n, size_t bytes);

/* ---------------------------------------------------------------- server */

typedef enum rekv_kv_event {
    REKV_KV_EVENT_INFO = 0,
    REKV_KV_EVENT_WARN = 1,
    REKV_KV_EVENT_ERROR = 2,
} rekv_kv_event;

typedef struct rekv_kvstore_config {
    const char *endpoint;  /* ZeroMQ endpoint to bind, e.g. "ipc:///run/rekv/kvstore" */
    const char *fd_socket; /* UNIX socket path for the memfd; NULL: endpoint path + ".fd" */
    uint64_t host_bytes;   /* arena size (header included) */
    const char *spill_dir; /* NULL: $TMPDIR, else /var/tmp */
    uint64_t spill_bytes;  /* spill-file capacity; 0: no limit other than the filesystem */
    int no_spill;          /* 1: no spill tier at all (a full arena is out of memory) */
    /* The prefix cache kept across restarts: the spill tier's file is DIR/spill.rekv (named,
     * kept) and DIR/index.rekv says which of its slots hold cached blocks (kvstore/persist.c); a
     * clean stop writes the cache in memory there first. NULL: an unnamed spill file, the cache
     * lost at a restart. Needs the spill tier. */
    const char *prefix_dir;
    rekv_kv_geometry geometry;
    int huge_pages;        /* try MFD_HUGETLB, fall back to normal pages (reported via events) */
    uint32_t lease_ms;     /* pin lease; 0: 5000 */
    uint32_t high_pct;     /* start spilling above this occupancy (percent of slots); 0: 90 */
    uint32_t low_pct;      /* spill down to this occupancy; 0: 80 */
    int no_register_arena; /* 1: never register the arena with io_uring (use bounce buffers) */
    int signal_fd;         /* a signalfd or eventfd the loop also polls; readable stops it; -1 */
    /* Called from the loop for notable events (fallbacks, spill failures, expired leases). */
    void (*on_event)(void *ctx, rekv_kv_event level, const char *msg);
    /* Called from the loop at least once a second (e.g. to pet systemd's watchdog); NULL. */
    void (*on_tick)(void *ctx);
    void *event_ctx;       /* passed to on_event and on_tick */
    /* Push support: the backend the store copies into clients' device buffers with ("cpu",
     * "cuda", "auto": cuda when there is a device); NULL or "": none (Push answers -ENOTSUP). */
    const char *push_backend;
    /* With the cpu push backend: the link it emulates (gbps and latency_us, as the worker's
     * --link-gbps; device_bytes unused), so that pushed rows take the time the link would; gbps 0:
     * none. The store's link is its own: a mode that also pulls (ACT rows) gets two links' worth. */
    rekv_link_config push_link;
    /* Prometheus scrapes (GET /metrics, common/metrics.h) on "HOST:PORT", served from the loop;
     * NULL: none. A non-loopback address needs metrics_public (else -EPERM). */
    const char *metrics_listen;
    int metrics_public;
    /* connections served at once; requests on more are answered -EBUSY, and past twice as many
     * a connection is dropped as it comes (common/conncap.h). 0: 1024; lowered to fit
     * RLIMIT_NOFILE */
    uint32_t max_clients;
    /* The remote tier (kvstore/remote.c): redis://HOST:PORT[/DB] or unix:///PATH[?db=N]; NULL:
     * none. Reads wait at most remote_timeout_ms (0: 50), entries live remote_ttl_s (0: 3600). */
    const char *remote;
    uint32_t remote_timeout_ms, remote_ttl_s;
    /* KV events for KV-aware routers (kvstore/events.h): the prefix cache's BlockStored,
     * BlockRemoved and AllBlocksCleared published in vLLM's wire format on this ZeroMQ endpoint
     * (tcp://HOST:PORT or ipc://PATH; bound when it has a wildcard or is ipc://, else connected,
     * as vLLM does); NULL: none. kv_events_topic: the messages' topic (NULL: "", vLLM's default);
     * kv_events_array: 1 for the positional events of vLLM before its tagged maps (#42892).
     * kv_events_replay: vLLM's replay ROUTER socket, bound there (NULL: none). */
    const char *kv_events;
    const char *kv_events_replay;
    const char *kv_events_topic;
    int kv_events_array;
} rekv_kvstore_config;

/* Fills the defaults above (lease 5000 ms, watermarks 90/80, signal_fd -1, push link latency
 * 10 us). */
void rekv_kvstore_config_defaults(rekv_kvstore_config *cfg);

typedef struct rekv_kvstore_server rekv_kvstore_server;

/* Creates the arena, the spill file (O_TMPFILE, or unlinked right after open), the io_uring, and
 * binds the ZeroMQ and fd sockets (removing stale socket files a crash left). */
int rekv_kvstore_server_create(const rekv_kvstore_config *cfg, rekv_kvstore_server **out,
                               rekv_err *err);
/* Runs the event loop until rekv_kvstore_server_stop() or a signal on cfg->signal_fd. */
int rekv_kvstore_server_run(rekv_kvstore_server *srv, rekv_err *err);
/* Makes run() return soon; async-signal-safe (writes an eventfd). */
void rekv_kvstore_server_stop(rekv_kvstore_server *srv);
/* Waits for in-flight I/O, closes everything, removes the socket files. NULL is fine. */
void rekv_kvstore_server_destroy(rekv_kvstore_server *srv);

/* Starts a private store: a forked child running the server library with cfg (its signal_fd and
 * on_event are replaced; the child stops on SIGTERM). Returns once it serves, with its pid. */
#include <sys/types.h>
int rekv_kvstore_spawn(const rekv_kvstore_config *cfg, pid_t *pid, rekv_err *err);
/* Stops a spawned store (SIGTERM) and waits for it; 0 when it exited cleanly. */
int rekv_kvstore_reap(pid_t pid);

/* ---------------------------------------------------------------- client */

typedef struct rekv_kvstore_client rekv_kvstore_client;

/* Connects to the daemon, receives and maps the arena, and checks its header. fd_socket NULL:
 * derived from the ipc endpoint. timeout_ms bounds every request (0: 30000); a request that
 * outlasts it leaves the client lost (rekv_kvstore_client_lost). Requests on one client may come
 * from several threads: they are serialised (one socket, one lease, one set of pins). */
int rekv_kvstore_client_connect(const char *endpoint, const char *fd_socket, int timeout_ms,
                                rekv_kvstore_client **out, rekv_err *err);
void rekv_kvstore_client_close(rekv_kvstore_client *c);
/* 0 while the connection is good; else the negative errno every request now fails with at once:
 * -EPIPE once the store's connection ended (it died or restarted: a restarted store has a new
 * arena and none of our sequences, so the client never reconnects by itself — connect a new
 * one), -ETIMEDOUT once a request got no reply in time (the store hangs: each later request
 * would wait as long; its lease expiry, or a new client's DropOwner under the same owner, frees
 * what this one held), -ECANCELED after rekv_kvstore_client_abort or once the stop fd was
 * readable. Any thread; never waits. */
int rekv_kvstore_client_lost(rekv_kvstore_client *c);
/* The sequence the last failed pin or plan named as lost — one of its blocks failed to read back
 * (CRC32C mismatch or I/O error) and is gone; the store's other sequences are intact — and clears
 * it; 0 when none since the last call. Lets a caller fail that sequence's owner alone. */
uint64_t rekv_kvstore_client_take_lost_seq(rekv_kvstore_client *c);
/* Makes the request in flight on another thread, and every later one, fail at once with
 * -ECANCELED (a worker stopping while its step waits on a store that does not answer). */
void rekv_kvstore_client_abort(rekv_kvstore_client *c);
/* A file descriptor each request also polls (a daemon's stop eventfd; never read): once it is
 * readable the request in flight and every later one fail at once with -ECANCELED, as after
 * rekv_kvstore_client_abort — a stop never waits for a store that does not answer. -1: none. */
void rekv_kvstore_client_set_stop_fd(rekv_kvstore_client *c, int fd);
/* The bound on each later request (0: 30000 ms). */
void rekv_kvstore_client_set_timeout(rekv_kvstore_client *c, int timeout_ms);

/* The mapped arena (base address, bytes) and its header. Valid until close. */
void *rekv_kvstore_client_arena(const rekv_kvstore_client *c, size_t *bytes);
const rekv_kv_arena_header *rekv_kvstore_client_header(const rekv_kvstore_client *c);
/* The geometry from the arena header. */
void rekv_kvstore_client_geometry(const rekv_kvstore_client *c, rekv_kv_geometry *g);

int rekv_kvstore_seq_create(rekv_kvstore_client *c, uint64_t seq, rekv_err *err);
/* -EBUSY when another client holds pins on the sequence; the caller's own pins are released. */
int rekv_kvstore_seq_drop(rekv_kvstore_client *c, uint64_t seq, rekv_err *err);
/* Appends n_tokens to every layer; new blocks follow the kv_parts:act_parts pattern (0:0 = all
 * KV). -ENOMEM (with the reason) when neither free slots nor spilling can make room. */
int rekv_kvstore_append(rekv_kvstore_client *c, uint64_t seq, uint64_t n_tokens,
                        uint32_t kv_parts, uint32_t act_parts, uint64_t *n_tokens_after,
                        rekv_err *err);

/* ---- the prefix cache (kvstore.proto Prefix; kvstore/prefix.c) ---- */

/* A sequence's tokens from position 0, the model they were computed by, and the block pattern
 * (as rekv_kvstore_append's; 0:0 all KV) that gives each block its kind. */
typedef struct rekv_kv_prefix {
    const int32_t *tokens; /* [n_tokens] ids, >= 0 */
    size_t n_tokens;
    uint64_t fingerprint; /* identifies the model's weights */
    uint32_t kv_parts, act_parts;
} rekv_kv_prefix;

/* What a prefix request found: leading full blocks (per layer) and their tokens; the blocks of all
 * layers by where they are (host: the arena, disk: the spill tier); Publish: positions added. */
typedef struct rekv_kv_prefix_hit {
    uint64_t blocks, tokens, host_blocks, disk_blocks, published;
} rekv_kv_prefix_hit;

/* Creates seq starting with the longest cached run of px's full blocks, taken by reference in the
 * same request (shared, never copied: the sequence appends past them); *hit (may be NULL) says how
 * many tokens that is. A caller that must compute the last token leaves it out of px. The blocks
 * taken are shared with every sequence that took them: a client reads them (pinned, as any
 * block) and never writes them. */
int rekv_kvstore_seq_create_prefix(rekv_kvstore_client *c, uint64_t seq, const rekv_kv_prefix *px,
                                   rekv_kv_prefix_hit *hit, rekv_err *err);
/* How much of px is cached, taking nothing. */
int rekv_kvstore_lookup(rekv_kvstore_client *c, const rekv_kv_prefix *px, rekv_kv_prefix_hit *hit,
                        rekv_err *err);
/* Publishes seq's full blocks of the known tokens px->tokens (the sequence's, from position 0);
 * only blocks a finished step wrote. hit->blocks: the leading positions now cached. */
int rekv_kvstore_publish(rekv_kvstore_client *c, uint64_t seq, const rekv_kv_prefix *px,
                         rekv_kv_prefix_hit *hit, rekv_err *err);
/* Drops the cache's reference on every cached block (what no sequence holds is freed). */
int rekv_kvstore_cache_clear(rekv_kvstore_client *c, rekv_err *err);

typedef struct rekv_kv_table_entry {
    uint32_t type; /* rekv_kv_block_type */
    uint32_t tier; /* rekv_kv_tier */
    uint64_t phys; /* host slot or spill-file slot */
} rekv_kv_table_entry;

/* Block table of (seq, layer): *entries (malloc'd, caller frees) has *n_blocks entries. */
int rekv_kvstore_table(rekv_kvstore_client *c, uint64_t seq, uint32_t layer,
                       rekv_kv_table_entry **entries, size_t *n_blocks, uint64_t *n_tokens,
                       rekv_err *err);

typedef struct rekv_kv_range {
    uint64_t seq;
    uint32_t layer;
    uint64_t token_begin, token_end; /* [begin, end) */
} rekv_kv_range;

typedef struct rekv_kv_plan_block {
    uint64_t block;  /* logical block number in its (seq, layer) */
    uint64_t offset; /* byte offset of the block in the arena */
    uint32_t type;   /* rekv_kv_block_type */
    uint32_t range;  /* index of the range it belongs to */
    uint32_t first;  /* first token of the range inside the block */
    uint32_t count;  /* tokens of the range inside the block */
} rekv_kv_plan_block;

/* One round trip for a whole decode step: every block covering the ranges, in order. With pin, the
 * blocks are pinned for this client (read back from disk first when spilled). *blocks is malloc'd
 * and grown as needed (*cap tracks its capacity), so a caller can reuse it across steps. */
int rekv_kvstore_plan(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                      int pin, rekv_kv_plan_block **blocks, size_t *n_blocks, size_t *cap,
                      rekv_err *err);
/* Pins = plan with pin = 1; unpin releases one pin per block covering the ranges. */
int rekv_kvstore_unpin(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                       rekv_err *err);
/* A window of a step that sweeps its layers: pins ranges as rekv_kvstore_plan(pin = 1) does, and
 * asks the store to read the `ahead` ranges (the next window) back from disk meanwhile, unpinned
 * (kvstore.proto Plan.ahead). */
int rekv_kvstore_pin_ahead(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                           const rekv_kv_range *ahead, size_t n_ahead, rekv_kv_plan_block **blocks,
                           size_t *n_blocks, size_t *cap, rekv_err *err);
/* Unpins as rekv_kvstore_unpin does, saying the caller is done with these blocks until its next
 * sweep: the store spills them first (kvstore.proto Unpin.done). */
int rekv_kvstore_unpin_done(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                            rekv_err *err);
/* Frees blocks [block_begin, block_end) of layers [layer_begin, layer_end). */
int rekv_kvstore_free(rekv_kvstore_client *c, uint64_t seq, uint32_t layer_begin,
                      uint32_t layer_end, uint64_t block_begin, uint64_t block_end, rekv_err *err);
/* Renews this client's pin lease; call at least every lease_ms / 3 (the arena header's lease_ms)
 * while holding pins or owning sequences idle. */
int rekv_kvstore_renew(rekv_kvstore_client *c, rekv_err *err);
/* The same, for a thread that must not wait behind another thread's request on this client (a
 * worker's loop while its step thread pins blocks): when one is in flight it returns 0 at once,
 * since that request renews the lease itself (the store counts a parked request as a sign of
 * life). */
int rekv_kvstore_renew_nowait(rekv_kvstore_client *c, rekv_err *err);

/* Sets the owner name sent with every later request ("" or NULL: none; at most
 * REKV_KV_OWNER_MAX bytes, else -EINVAL). Sequences created afterwards belong to it (see the top
 * of this file). */
int rekv_kvstore_client_set_owner(rekv_kvstore_client *c, const char *owner, rekv_err *err);
/* Drops every sequence of owner (non-empty), releasing the pins its connections hold on them (a
 * dead predecessor's); waits while a parked request holds one of their blocks. -EBUSY (after
 * dropping the rest) when a client of another owner pins one. Counts of what went, either may be
 * NULL. */
int rekv_kvstore_drop_owner(rekv_kvstore_client *c, const char *owner, uint64_t *n_seqs,
                            uint64_t *n_blocks, rekv_err *err);

/* ---- push (see the top of this file) ---- */

#define REKV_KV_IPC_HANDLE_BYTES 128 /* sizeof(rekv_ipc_handle), gpuworker/device/backend.h */

/* One piece of a push: bytes from arena offset src into buffers[buffer] at offset dst. */
typedef struct rekv_kv_push_piece {
    uint64_t src;
    uint64_t dst;
    uint64_t bytes;
    uint32_t buffer;
} rekv_kv_push_piece;

/* Has the store enqueue the pieces on its push stream, after a GPU-side wait on wait_event (NULL:
 * none) and followed by a record of done_event (NULL: none); returns once they are enqueued.
 * buffers[n_buffers] and the events point at REKV_KV_IPC_HANDLE_BYTES-byte IPC handles. With no
 * buffers, events or pieces it only asks whether the store can push: *backend (may be NULL, cap
 * bytes) receives the store's push backend name ("cpu", "cuda"), whose handles it imports.
 * -ENOTSUP when the store has no push backend; -EINVAL with the reason for a bad handle or a
 * piece outside the arena or its buffer, -EPERM for a piece not inside one block this connection
 * pins (nothing is enqueued then). */
int rekv_kvstore_push(rekv_kvstore_client *c, const void *const *buffers, size_t n_buffers,
                      const void *wait_event, const void *done_event,
                      const rekv_kv_push_piece *pieces, size_t n_pieces, char *backend, size_t cap,
                      rekv_err *err);
/* Drops the store's imports of these handles (n == 0: all of this connection's) once the work
 * using them has finished; call before freeing an exported buffer. Unknown handles are fine. */
int rekv_kvstore_release(rekv_kvstore_client *c, const void *const *handles, size_t n,
                         rekv_err *err);

#define REKV_KV_HIST_BUCKETS 40
typedef struct rekv_kv_hist {
    char name[32];                          /* e.g. "plan", "spill_write" */
    uint64_t buckets[REKV_KV_HIST_BUCKETS]; /* [2^i, 2^(i+1)) nanoseconds */
    uint64_t count, sum_ns;
} rekv_kv_hist;

typedef struct rekv_kv_stats {
    uint64_t host_kv, host_act;     /* resident blocks by type */
    uint64_t disk_kv, disk_act;     /* spilled blocks by type */
    uint64_t free_slots, total_slots;
    uint64_t pinned_blocks;         /* blocks with at least one pin */
    uint64_t bytes_spilled, bytes_read_back;
    uint64_t pin_hits, pin_misses;  /* pinned blocks found resident / read back */
    uint64_t spill_errors, crc_errors;
    uint64_t read_errors; /* read-backs the device failed (the block is lost) */
    uint64_t sequences, clients, leases_expired;
    uint64_t spills_in_flight, reads_in_flight;
    uint64_t sequences_reclaimed; /* dropped by DropOwner or because their owner's lease expired */
    /* the arena in bytes (blocks cost their type's slot: kvstore.proto StatsReply) */
    uint64_t host_bytes, host_free_bytes, host_used_bytes;
    uint64_t kv_slot_bytes, act_slot_bytes; /* what one KV / ACT block costs in the arena */
    uint64_t spill_bytes;                   /* 0: no spill tier; UINT64_MAX: the filesystem's */
    uint64_t spill_used_bytes;
    uint64_t instance; /* random per store process */
    /* spill reads a pin waited for (on its critical path) and reads done ahead (off it) */
    uint64_t pin_wait_blocks, pin_wait_bytes, read_ahead_blocks, read_ahead_bytes;
    uint64_t spill_room_bytes; /* what the spill tier can hold in all (kvstore.proto) */
    /* the prefix cache (kvstore.proto StatsReply): lookups, prompt tokens served, the blocks
     * (all layers) those took by tier, blocks evicted, bytes read back for hits, blocks
     * published, blocks and positions cached now */
    uint64_t prefix_lookups, prefix_hit_tokens, prefix_hit_host_blocks, prefix_hit_disk_blocks;
    uint64_t prefix_evictions, prefix_hit_read_bytes, prefix_published_blocks;
    uint64_t prefix_cached_blocks, prefix_entries;
    uint64_t prefix_host_bytes; /* arena bytes of blocks only the cache holds, evicted on demand */
    int direct_io, registered_arena;
    size_t n_hists;
    rekv_kv_hist hists[8];
} rekv_kv_stats;

int rekv_kvstore_stats(rekv_kvstore_client *c, rekv_kv_stats *out, rekv_err *err);

/* Sends raw bytes as one request frame and waits for one reply frame (tests fuzz with it). On
 * success *status and (when err_msg) the reply's error line are filled. */
int rekv_kvstore_client_raw(rekv_kvstore_client *c, const void *req, size_t len, int32_t *status,
                            char *err_msg, size_t err_len, rekv_err *err);

/* ---------------------------------------------------------------- bench */

/* `rekv bench kvstore [--json] [--blocks N] [--host-mib N] [--spill-dir DIR] [--no-fio]`:
 * starts a private store (a forked child running the server library), then measures in one run
 * (a) gather of N random blocks vs memcpy, (b) spill write / read-back at QD32 vs fio, (c) plan
 * round trips for 1, 64, 4096 blocks. Prints one JSON object on stdout; returns a process exit
 * code. */
int rekv_kvstore_bench_main(int argc, char **argv);

#endif
