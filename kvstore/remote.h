/* remote.h — the kvstore's remote tier on Redis (remote.c): cached prefix blocks written through
 * to a Redis shared by several replicas, read back on a miss in the host and disk tiers. The
 * store's own parts call it; not part of the public interface. */
#ifndef REKV_KVSTORE_REMOTE_H
#define REKV_KVSTORE_REMOTE_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/metrics.h"
#include "kvstore/kv_internal.h"

typedef struct rekv_kvstore_server rekv_kvstore_server;
typedef struct kv_pending kv_pending;
typedef struct kv_remote kv_remote;

/* Where Redis is: redis://HOST:PORT[/DB] or unix:///PATH[?db=N]. */
typedef struct kv_remote_url {
    int is_unix;    /* 1: path, else host and port */
    char host[256]; /* a name or an address (IPv6 in brackets in the URL, without here) */
    int port;
    char path[108]; /* sun_path's size */
    int db;         /* SELECT db after connecting when not 0 */
} kv_remote_url;

/* Parses url into *out: 0, or -EINVAL with a line naming what is wrong. */
int kv_remote_url_parse(const char *url, kv_remote_url *out, rekv_err *err);

/* One cached position the store wants from Redis, as a local match would check it. */
typedef struct kv_remote_want {
    uint64_t key, parent;
    int kind;
    uint32_t tokens[REKV_KV_BLOCK_TOKENS];
} kv_remote_want;

/* Starts the reader and writer threads on s->cfg.remote (no connection yet: each thread
 * connects when it first has work) and adds their completion eventfd and the deadline timer to
 * s's loop. 0 or a negative errno. */
int srv_remote_open(rekv_kvstore_server *s, rekv_err *err);
/* Stops the threads (each ends within the timeout of the call it is in) and frees everything
 * queued. NULL s->remote is fine. */
void srv_remote_close(rekv_kvstore_server *s);
/* Queues cache entry i (every layer resident) to be written under root/first (the model's
 * root and its chain's first key, the hash tag): its bytes are copied now, the write happens on
 * the writer thread; dropped (counted) when the queue is full or a layer is not in memory. */
void srv_remote_put(rekv_kvstore_server *s, uint32_t i, uint64_t root, uint64_t first);
/* Asks Redis for want[0..n) (one chain, in order, after what is local) for the parked request
 * p: 1 when p now waits for the answer (or the timeout), 0 when it should answer from what is
 * local (Redis known to be down, nothing to ask, or out of memory). */
int srv_remote_get(rekv_kvstore_server *s, kv_pending *p, uint64_t root, uint64_t first,
                   const kv_remote_want *want, size_t n);
/* 1 while p's read (srv_remote_get) is in flight and within its timeout. */
int srv_remote_waiting(const rekv_kvstore_server *s, const kv_pending *p);
/* The remote tier's counters for the scrape port. */
void srv_remote_metrics(const rekv_kvstore_server *s, rekv_metrics_buf *b);

#endif
