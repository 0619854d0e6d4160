/* events.h — the kvstore's KV events for KV-aware routers (rekv-kvstore --kv-events): what the
 * prefix cache holds, told as vLLM tells it (BlockStored, BlockRemoved, AllBlocksCleared over a
 * ZeroMQ publisher), so that llm-d's kv-cache indexer, NVIDIA Dynamo's KV router or any
 * subscriber written for vLLM reads rekv unchanged. Internal to the kvstore room. */
#ifndef REKV_KVSTORE_EVENTS_H
#define REKV_KVSTORE_EVENTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

typedef struct kv_events kv_events;

/* The events' encoding inside a batch: vLLM's current one (each event a msgpack map tagged by
 * "type", vLLM PR #42892) or the positional one before it (each event an array, tag first) that
 * older subscribers decode. */
typedef enum { KV_EVENTS_MAP = 0, KV_EVENTS_ARRAY } kv_events_format;

typedef struct kv_events_counts {
    uint64_t stored, removed, cleared; /* events (a BlockStored of n blocks counts n) */
    uint64_t batches_sent, batches_dropped;
} kv_events_counts;

/* A publisher on endpoint (tcp://HOST:PORT, ipc://PATH): bound when the endpoint has a wildcard
 * ('*', '::') or is ipc:// / inproc://, else connected, as vLLM decides; topic prefixes every
 * message ("" for none, vLLM's default). zctx: the ZeroMQ context to make the socket in. */
int kv_events_create(void *zctx, const char *endpoint, const char *topic, kv_events_format fmt,
                     kv_events **out, rekv_err *err);
/* Closes the socket (what was not sent is dropped); NULL is fine. */
void kv_events_free(kv_events *ev);

/* Block hash stored (16 tokens), its parent block's hash (has_parent 0: the first block of a
 * sequence, nil on the wire). Consecutive blocks of one chain become one BlockStored. */
int kv_events_stored(kv_events *ev, uint64_t hash, int has_parent, uint64_t parent,
                     const uint32_t *tokens);
int kv_events_removed(kv_events *ev, uint64_t hash);
int kv_events_cleared(kv_events *ev);
/* Sends what was told since the last flush as one batch (nothing when nothing was): never waits;
 * a batch a subscriber's queue has no room for is dropped and counted, its sequence number
 * spent, so that a subscriber sees the gap. */
void kv_events_flush(kv_events *ev);
/* Reads what subscribers sent (the socket is readable): 1 when one subscribed since. */
int kv_events_subscribed(kv_events *ev);
/* The ZeroMQ socket, for the loop to poll for subscriptions. */
void *kv_events_socket(kv_events *ev);
/* vLLM's replay socket (ZeroMQ ROUTER, bound on endpoint): the last 10,000 batches (vLLM's
 * buffer_steps; at most 64 MiB of them) kept, sent again from a sequence number on request. */
int kv_events_replay_open(kv_events *ev, void *zctx, const char *endpoint, rekv_err *err);
void *kv_events_replay_socket(kv_events *ev);
/* Answers the replay requests waiting (never waits: a reply a client cannot take is cut short,
 * the client asks again). */
void kv_events_replay_serve(kv_events *ev);
/* Marks this batch lost (something could not be told): it is dropped at the flush, its sequence
 * number spent. */
void kv_events_lose(kv_events *ev);
void kv_events_get_counts(const kv_events *ev, kv_events_counts *out);

#endif
