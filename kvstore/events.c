/* events.c — KV events for KV-aware routers (rekv-kvstore --kv-events): the prefix cache's
 * changes published in vLLM's wire format, so that a router written for vLLM (llm-d's kv-cache
 * indexer, NVIDIA Dynamo's KV router, vLLM's own examples/online_serving/kv_events_subscriber.py)
 * consumes rekv unchanged.
 *
 * The format matched is vLLM v0.26's (vllm/distributed/kv_events.py after PR #42892, the current
 * release line in November 2026): a message is three ZeroMQ frames — the topic, an 8-byte
 * big-endian sequence number (0, 1, 2, ... per publisher) and a msgpack payload. The payload is
 * the batch, positional (msgspec array_like): [ts (float64, Unix seconds), [event, ...],
 * data_parallel_rank (0)]. Each event is a msgpack map tagged by "type" (msgspec tagged union,
 * fields in vLLM's declaration order, defaults omitted as omit_defaults does):
 *   {"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash": u64 | nil,
 *    "token_ids": [16 per block], "block_size": 16, "lora_id": nil, "medium": "CPU",
 *    "lora_name": nil}
 *   {"type": "BlockRemoved", "block_hashes": [u64...], "medium": "CPU"}
 *   {"type": "AllBlocksCleared"}
 * --kv-events-format array emits the positional events of vLLM before #42892 (["BlockStored",
 * hashes, parent, tokens, 16, nil, "CPU", nil]) for subscribers that decode only those; llm-d
 * (llm-d-kv-cache >= v0.9) and Dynamo decode both.
 *
 * The block hash is the prefix cache's chain key (prefix.c): it names the block's 16 tokens, its
 * kind and everything before it, rooted in the model's fingerprint — what vLLM's block hash is.
 * medium is "CPU" for every block: vLLM's mediums are "GPU" and "CPU" (vllm/v1/kv_offload), the
 * store is host memory, and its spill file is the same cache's extension (a Lookup serves a
 * block on disk as a hit with no prefill): telling every spill and read-back as a removal and a
 * store in another medium would flood routers for no routing difference.
 *
 * Batching and never blocking: events told during a round of the store's loop are kept here and
 * sent as one batch from the loop's before-sleep hook (one batch a round at most, as vLLM sends
 * one per engine step). The socket is an XPUB with XPUB_NODROP (a SUB subscriber sees a PUB), so
 * that a send a subscriber's full queue (SNDHWM) cannot take fails at once with EAGAIN instead of
 * being dropped unseen: the batch is dropped and counted, and its sequence number is spent as
 * vLLM spends it, so a subscriber sees the gap.
 *
 * A subscriber that joins late (or a router restarted, or a store restarted under its router)
 * would hold a wrong picture, and a PUB socket drops what is sent before a subscription arrives
 * (ZeroMQ's slow joiner). The XPUB sees each subscription (XPUB_VERBOSE): the store then tells
 * AllBlocksCleared and every block it holds, parents first, to every subscriber — each of them
 * ends with the store's picture (a batch sent as the subscription arrives may reach it just
 * before). vLLM's answer to lost batches is its replay socket, which rekv also has
 * (--kv-events-replay, the end of the file): a ROUTER that sends the last batches again.
 *
 * The store evicts by its blocks' LRU, so a chain may lose a block before its children: a
 * BlockRemoved of a parent whose children stay. A router matching a prompt from its first block
 * stops there, as the store's Lookup does. */
#include <errno.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <zmq.h>

#include "kvstore/events.h"
#include "kvstore/server_internal.h"

#define EV_HWM 100000              /* vLLM's default hwm */
#define REPLAY_BATCHES 10000       /* vLLM's default buffer_steps */
#define REPLAY_BYTES (64ull << 20) /* and at most this much of them */

/* The packers' writer: a failed write (out of memory) marks the buffer's owner. */
typedef struct ev_out {
    msgpack_sbuffer *sb;
    int *oom;
} ev_out;

static int ev_write(void *data, const char *buf, size_t len)
{
    const ev_out *o = data;
    if (msgpack_sbuffer_write(o->sb, buf, len) == 0)
        return 0;
    *o->oom = 1;
    return -1;
}

/* A batch kept for replay: its sequence number and payload (malloc'd). */
typedef struct ev_kept {
    uint64_t seq;
    char *data;
    size_t len;
} ev_kept;

/* The event being gathered: consecutive blocks of one chain (stored), or removals. */
enum { OPEN_NONE = 0, OPEN_STORED, OPEN_REMOVED };

struct kv_events {
    void *sock; /* XPUB */
    char *topic;
    kv_events_format fmt;
    msgpack_sbuffer evbuf; /* this batch's closed events, each a msgpack value */
    ev_out out;            /* evbuf and oom, for pk */
    msgpack_packer pk;     /* writes evbuf (ev_write: a failed write marks oom) */
    uint32_t n_events;
    int open;         /* OPEN_* */
    uint64_t *hashes; /* the open event's block hashes [n_hashes] */
    uint32_t *tokens; /* its token ids [n_hashes * 16] (stored) */
    size_t n_hashes, cap_hashes;
    int has_parent;
    uint64_t parent;
    uint64_t seq; /* the next batch's sequence number */
    int oom;      /* an allocation failed this batch: it is dropped whole */
    kv_events_counts counts;
    void *replay;  /* ROUTER answering replay requests, or NULL */
    ev_kept *kept; /* [REPLAY_BATCHES] ring of the last batches, oldest at kept_head */
    size_t kept_head, n_kept, kept_bytes;
};

/* ------------------------------------------------------------------ encoding */

static void pack_cstr(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* An event's head: a map of n_fields + 1 entries whose "type" is tag, or an array of n_fields + 1
 * whose first item is tag. */
static void ev_begin(const kv_events *ev, msgpack_packer *pk, const char *tag, size_t n_fields)
{
    if (ev->fmt == KV_EVENTS_MAP) {
        msgpack_pack_map(pk, n_fields + 1);
        pack_cstr(pk, "type");
    } else {
        msgpack_pack_array(pk, n_fields + 1);
    }
    pack_cstr(pk, tag);
}

/* A field's name (map encoding only; the value follows). */
static void ev_key(const kv_events *ev, msgpack_packer *pk, const char *name)
{
    if (ev->fmt == KV_EVENTS_MAP)
        pack_cstr(pk, name);
}

static void pack_hashes(const kv_events *ev, msgpack_packer *pk)
{
    ev_key(ev, pk, "block_hashes");
    msgpack_pack_array(pk, ev->n_hashes);
    for (size_t i = 0; i < ev->n_hashes; i++)
        msgpack_pack_uint64(pk, ev->hashes[i]);
}

/* Encodes the open event into the batch. */
static void ev_close(kv_events *ev)
{
    if (ev->open == OPEN_NONE)
        return;
    msgpack_packer *pk = &ev->pk;
    if (ev->open == OPEN_STORED) {
        ev_begin(ev, pk, "BlockStored", 7);
        pack_hashes(ev, pk);
        ev_key(ev, pk, "parent_block_hash");
        if (ev->has_parent)
            msgpack_pack_uint64(pk, ev->parent);
        else
            msgpack_pack_nil(pk);
        ev_key(ev, pk, "token_ids");
        msgpack_pack_array(pk, ev->n_hashes * REKV_KV_BLOCK_TOKENS);
        for (size_t i = 0; i < ev->n_hashes * REKV_KV_BLOCK_TOKENS; i++)
            msgpack_pack_uint32(pk, ev->tokens[i]);
        ev_key(ev, pk, "block_size");
        msgpack_pack_uint32(pk, REKV_KV_BLOCK_TOKENS);
        ev_key(ev, pk, "lora_id");
        msgpack_pack_nil(pk);
        ev_key(ev, pk, "medium");
        pack_cstr(pk, "CPU");
        ev_key(ev, pk, "lora_name");
        msgpack_pack_nil(pk);
    } else {
        ev_begin(ev, pk, "BlockRemoved", 2);
        pack_hashes(ev, pk);
        ev_key(ev, pk, "medium");
        pack_cstr(pk, "CPU");
    }
    ev->n_events++;
    ev->open = OPEN_NONE;
    ev->n_hashes = 0;
}

/* Room for one more hash (and its 16 tokens) in the open event; -ENOMEM marks the batch lost. */
static int ev_grow(kv_events *ev)
{
    if (ev->n_hashes < ev->cap_hashes)
        return 0;
    size_t cap = ev->cap_hashes ? ev->cap_hashes * 2 : 64;
    uint64_t *h = realloc(ev->hashes, cap * sizeof(*h));
    if (h != NULL)
        ev->hashes = h;
    uint32_t *t = realloc(ev->tokens, cap * REKV_KV_BLOCK_TOKENS * sizeof(*t));
    if (t != NULL)
        ev->tokens = t;
    if (h == NULL || t == NULL) {
        ev->oom = 1;
        return -ENOMEM;
    }
    ev->cap_hashes = cap;
    return 0;
}

int kv_events_stored(kv_events *ev, uint64_t hash, int has_parent, uint64_t parent,
                     const uint32_t *tokens)
{
    /* the next block of the open chain joins it, as vLLM tells a request's new blocks at once */
    int joins = ev->open == OPEN_STORED && has_parent && ev->n_hashes > 0 &&
                ev->hashes[ev->n_hashes - 1] == parent;
    if (!joins) {
        ev_close(ev);
        ev->open = OPEN_STORED;
        ev->has_parent = has_parent;
        ev->parent = parent;
    }
    if (ev_grow(ev) < 0)
        return -ENOMEM;
    ev->hashes[ev->n_hashes] = hash;
    memcpy(ev->tokens + ev->n_hashes * REKV_KV_BLOCK_TOKENS, tokens,
           sizeof(uint32_t) * REKV_KV_BLOCK_TOKENS);
    ev->n_hashes++;
    ev->counts.stored++;
    return 0;
}

int kv_events_removed(kv_events *ev, uint64_t hash)
{
    if (ev->open != OPEN_REMOVED) {
        ev_close(ev);
        ev->open = OPEN_REMOVED;
    }
    if (ev_grow(ev) < 0)
        return -ENOMEM;
    ev->hashes[ev->n_hashes++] = hash;
    ev->counts.removed++;
    return 0;
}

int kv_events_cleared(kv_events *ev)
{
    ev_close(ev);
    ev_begin(ev, &ev->pk, "AllBlocksCleared", 0);
    ev->n_events++;
    ev->counts.cleared++;
    return 0;
}

/* ------------------------------------------------------------------ sending */

static void batch_reset(kv_events *ev)
{
    msgpack_sbuffer_clear(&ev->evbuf);
    ev->n_events = 0;
    ev->open = OPEN_NONE;
    ev->n_hashes = 0;
    ev->oom = 0;
}

/* Keeps a copy of the payload for replay; the oldest batches go past REPLAY_BATCHES or
 * REPLAY_BYTES. */
static void ev_keep(kv_events *ev, uint64_t seq, msgpack_sbuffer *pay)
{
    while (ev->n_kept > 0 &&
           (ev->n_kept == REPLAY_BATCHES || ev->kept_bytes + pay->size > REPLAY_BYTES)) {
        ev_kept *o = &ev->kept[ev->kept_head];
        ev->kept_bytes -= o->len;
        free(o->data);
        ev->kept_head = (ev->kept_head + 1) % REPLAY_BATCHES;
        ev->n_kept--;
    }
    if (pay->size > REPLAY_BYTES)
        return; /* too big to keep: a replay will not have it */
    char *copy = malloc(pay->size);
    if (copy == NULL)
        return;
    memcpy(copy, pay->data, pay->size);
    ev_kept *k = &ev->kept[(ev->kept_head + ev->n_kept) % REPLAY_BATCHES];
    *k = (ev_kept){seq, copy, pay->size};
    ev->kept_bytes += pay->size;
    ev->n_kept++;
}

void kv_events_flush(kv_events *ev)
{
    ev_close(ev);
    if (ev->n_events == 0 && !ev->oom)
        return;
    uint64_t seq = ev->seq++;
    if (ev->oom) { /* a batch with an event missing would mislead: none at all, the gap seen */
        ev->counts.batches_dropped++;
        batch_reset(ev);
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    msgpack_sbuffer pay;
    msgpack_sbuffer_init(&pay);
    int bad = 0;
    ev_out po = {&pay, &bad};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &po, ev_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9);
    msgpack_pack_array(&pk, ev->n_events);
    ev_write(&po, ev->evbuf.data, ev->evbuf.size); /* the events, already packed */
    msgpack_pack_uint32(&pk, 0);                   /* data_parallel_rank: a store is one rank */
    uint8_t be[8];
    for (int i = 0; i < 8; i++)
        be[i] = (uint8_t)(seq >> (56 - 8 * i));
    /* ZeroMQ takes a message's frames all or none: EAGAIN can only come on the first */
    if (!bad && ev->replay) /* kept sent or not: a subscriber that saw the gap asks for it */
        ev_keep(ev, seq, &pay);
    if (bad || pay.data == NULL ||
        zmq_send(ev->sock, ev->topic, strlen(ev->topic), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(ev->sock, be, sizeof(be), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(ev->sock, pay.data, pay.size, ZMQ_DONTWAIT) < 0)
        ev->counts.batches_dropped++;
    else
        ev->counts.batches_sent++;
    msgpack_sbuffer_destroy(&pay);
    batch_reset(ev);
}

int kv_events_subscribed(kv_events *ev)
{
    int any = 0;
    uint8_t msg[256];
    int n;
    while ((n = zmq_recv(ev->sock, msg, sizeof(msg), ZMQ_DONTWAIT)) >= 0)
        any |= n >= 1 && msg[0] == 1; /* 1: subscribe, 0: unsubscribe */
    return any;
}

void *kv_events_socket(kv_events *ev)
{
    return ev->sock;
}

void kv_events_lose(kv_events *ev)
{
    ev->oom = 1;
}

void kv_events_get_counts(const kv_events *ev, kv_events_counts *out)
{
    *out = ev->counts;
}

/* ------------------------------------------------------------------ lifecycle */

/* vLLM's rule (ZmqEventPublisher._socket_setup): bind a wildcard or a local endpoint, connect to
 * anything else (a router's bound SUB: llm-d's centralized mode). */
static int binds(const char *endpoint)
{
    return strchr(endpoint, '*') != NULL || strstr(endpoint, "::") != NULL ||
           strncmp(endpoint, "ipc://", 6) == 0 || strncmp(endpoint, "inproc://", 9) == 0;
}

int kv_events_create(void *zctx, const char *endpoint, const char *topic, kv_events_format fmt,
                     kv_events **out, rekv_err *err)
{
    *out = NULL;
    if (strncmp(endpoint, "tcp://", 6) != 0 && strncmp(endpoint, "ipc://", 6) != 0)
        return rekv_errf(err, -EINVAL, "kvstore: --kv-events %s: tcp://HOST:PORT or ipc://PATH",
                         endpoint);
    kv_events *ev = calloc(1, sizeof(*ev));
    if (ev == NULL || (ev->topic = strdup(topic ? topic : "")) == NULL) {
        free(ev);
        return rekv_errf(err, -ENOMEM, "kvstore: out of memory");
    }
    ev->fmt = fmt;
    msgpack_sbuffer_init(&ev->evbuf);
    ev->out = (ev_out){&ev->evbuf, &ev->oom};
    msgpack_packer_init(&ev->pk, &ev->out, ev_write);
    int rc = 0;
    ev->sock = zmq_socket(zctx, ZMQ_XPUB);
    if (ev->sock == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore: kv events socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int zero = 0, one = 1, hwm = EV_HWM;
    zmq_setsockopt(ev->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(ev->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(ev->sock, ZMQ_XPUB_NODROP, &one, sizeof(one));
    zmq_setsockopt(ev->sock, ZMQ_XPUB_VERBOSE, &one, sizeof(one)); /* every subscriber's */
    mode_t old =
        umask(077); /* an ipc socket file: the owner's alone (events carry prompts' tokens) */
    int brc = binds(endpoint) ? zmq_bind(ev->sock, endpoint) : zmq_connect(ev->sock, endpoint);
    umask(old);
    if (brc < 0) {
        rc = rekv_errf(err, -zmq_errno(), "kvstore: --kv-events %s: %s", endpoint,
                       zmq_strerror(zmq_errno()));
        goto fail;
    }
    *out = ev;
    return 0;
fail:
    kv_events_free(ev);
    return rc;
}

/* ------------------------------------------------------------------ replay */

static void be64(uint8_t *out, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        out[i] = (uint8_t)(v >> (56 - 8 * i));
}

/* One frame of a reply to client id (more: frames follow). */
static int replay_send(kv_events *ev, const void *p, size_t n, int more)
{
    return zmq_send(ev->replay, p, n, ZMQ_DONTWAIT | (more ? ZMQ_SNDMORE : 0)) < 0 ? -1 : 0;
}

/* vLLM's replay (ZmqEventPublisher._service_replay, v0.26): a request is [identity, "", start
 * (8 bytes, big-endian)]; the answer, each kept batch from start on as [identity, "", topic,
 * seq, payload], then [identity, "", "", -1 (8 bytes), ""]. A malformed request is dropped. */
static void replay_one(kv_events *ev)
{
    uint8_t fr[3][256];
    int len[3], n = 0, more = 1;
    while (more) {
        int r = zmq_recv(ev->replay, fr[n < 3 ? n : 2], sizeof(fr[0]), ZMQ_DONTWAIT);
        if (r < 0)
            return;
        if (n < 3)
            len[n] = r;
        n++;
        size_t ml = sizeof(more);
        if (zmq_getsockopt(ev->replay, ZMQ_RCVMORE, &more, &ml) < 0)
            return;
    }
    if (n != 3 || len[0] > (int)sizeof(fr[0]) || len[1] != 0 || len[2] != 8)
        return;
    uint64_t start = 0;
    for (int i = 0; i < 8; i++)
        start = start << 8 | fr[2][i];
    size_t tl = strlen(ev->topic);
    for (size_t k = 0; k < ev->n_kept; k++) {
        const ev_kept *b = &ev->kept[(ev->kept_head + k) % REPLAY_BATCHES];
        uint8_t seq[8];
        be64(seq, b->seq);
        if (b->seq >= start && (replay_send(ev, fr[0], (size_t)len[0], 1) ||
                                replay_send(ev, "", 0, 1) || replay_send(ev, ev->topic, tl, 1) ||
                                replay_send(ev, seq, 8, 1) || replay_send(ev, b->data, b->len, 0)))
            return; /* the client is gone, or its queue full: it asks again */
    }
    uint8_t end[8];
    be64(end, UINT64_MAX); /* -1, signed */
    (void)(replay_send(ev, fr[0], (size_t)len[0], 1) || replay_send(ev, "", 0, 1) ||
           replay_send(ev, "", 0, 1) || replay_send(ev, end, 8, 1) || replay_send(ev, "", 0, 0));
}

void kv_events_replay_serve(kv_events *ev)
{
    int evs = 0;
    size_t el = sizeof(evs);
    while (zmq_getsockopt(ev->replay, ZMQ_EVENTS, &evs, &el) == 0 && (evs & ZMQ_POLLIN))
        replay_one(ev);
}

void *kv_events_replay_socket(kv_events *ev)
{
    return ev->replay;
}

int kv_events_replay_open(kv_events *ev, void *zctx, const char *endpoint, rekv_err *err)
{
    ev->kept = calloc(REPLAY_BATCHES, sizeof(ev_kept));
    ev->replay = ev->kept ? zmq_socket(zctx, ZMQ_ROUTER) : NULL;
    if (ev->replay == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore: kv events replay socket: out of memory");
    int zero = 0, hwm = REPLAY_BATCHES + 1; /* a whole replay fits a client's queue */
    zmq_setsockopt(ev->replay, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(ev->replay, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    mode_t old = umask(077);
    int brc = zmq_bind(ev->replay, endpoint);
    umask(old);
    if (brc < 0)
        return rekv_errf(err, -zmq_errno(), "kvstore: --kv-events-replay %s: %s", endpoint,
                         zmq_strerror(zmq_errno()));
    return 0;
}

void kv_events_free(kv_events *ev)
{
    if (ev == NULL)
        return;
    if (ev->sock)
        zmq_close(ev->sock);
    if (ev->replay)
        zmq_close(ev->replay);
    for (size_t k = 0; ev->kept && k < ev->n_kept; k++)
        free(ev->kept[(ev->kept_head + k) % REPLAY_BATCHES].data);
    free(ev->kept);
    msgpack_sbuffer_destroy(&ev->evbuf);
    free(ev->hashes);
    free(ev->tokens);
    free(ev->topic);
    free(ev);
}

/* ------------------------------------------------------------------ the store's side */

/* Entry i as a BlockStored: its parent is a block when the parent's key is a cached entry, else
 * the chain's root (the fingerprint's key, no block: nil, as vLLM's first block of a request). */
static void ev_entry_stored(rekv_kvstore_server *s, uint32_t i)
{
    const kv_centry *e = &s->centries[i];
    int has_parent = kv_map_get(&s->cindex, e->parent) != NULL;
    (void)kv_events_stored(s->events, e->key, has_parent, e->parent, e->tokens);
}

void srv_events_stored(rekv_kvstore_server *s, uint32_t i)
{
    if (s->events && !s->events_mute)
        ev_entry_stored(s, i);
}

void srv_events_removed(rekv_kvstore_server *s, uint32_t i)
{
    if (s->events && !s->events_mute)
        (void)kv_events_removed(s->events, s->centries[i].key);
}

/* The parent of entry i when it is a live entry, else NIL. */
static uint32_t ev_parent_entry(const rekv_kvstore_server *s, uint32_t i)
{
    const uint64_t *v = kv_map_get(&s->cindex, s->centries[i].parent);
    return v != NULL && s->centries[*v].live ? (uint32_t)*v : NIL;
}

void srv_events_announce(rekv_kvstore_server *s)
{
    if (s->events == NULL)
        return;
    (void)kv_events_cleared(s->events);
    /* every entry after its parent (a router places a block under its parent), each chain told
     * root first: walk up to the first entry already told, then tell the path down */
    uint8_t *told = calloc(s->n_centries + 1, 1);
    uint32_t *path = malloc(sizeof(uint32_t) * (s->n_centries + 1));
    if (told == NULL || path == NULL) {
        free(told);
        free(path);
        kv_events_lose(s->events); /* a partial picture would mislead: the batch goes unsent */
        return;
    }
    for (uint32_t i = 0; i < s->n_centries; i++) {
        size_t n = 0;
        for (uint32_t j = i; j != NIL && s->centries[j].live && !told[j] && n <= s->n_centries;
             j = ev_parent_entry(s, j)) {
            path[n++] = j;
            told[j] = 1;
        }
        while (n > 0)
            ev_entry_stored(s, path[--n]);
    }
    free(told);
    free(path);
}

void srv_events_on_subscribe(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_kvstore_server *s = ctx;
    (void)loop;
    (void)revents;
    if (kv_events_subscribed(s->events))
        srv_events_announce(s); /* sent with this round's batch */
}

void srv_events_on_replay(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_kvstore_server *s = ctx;
    (void)loop;
    (void)revents;
    kv_events_replay_serve(s->events);
}

void srv_events_flush(rekv_kvstore_server *s)
{
    if (s->events == NULL)
        return;
    /* a subscriber that came since the poll gets its picture before this batch can reach it */
    if (kv_events_subscribed(s->events))
        srv_events_announce(s);
    kv_events_flush(s->events);
}
