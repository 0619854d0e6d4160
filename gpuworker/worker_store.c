/* worker_store.c — rekv-gpuworker's kvstore connection: connecting at start (waiting for a store
 * started beside it), the lease it keeps alive from the loop's thread (also while a step runs),
 * the store's room it tells the coordinator, and the loss of the store: the pipeline goes with
 * the client (its arena is the dead store's), the worker says it is unavailable, reconnects every
 * half second and, once the store answers, rebuilds the pipeline and says it is available. A
 * store that hangs is a lost one after one request's timeout: the client fails every later
 * request at once (no drop of each sequence waits the timeout again; the store's lease expiry or
 * our reconnect's DropOwner frees them), and each request also polls the stop eventfd, so SIGTERM
 * never waits for the store. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "gpuworker/worker_internal.h"

/* Takes the store's room from its Stats reply: the coordinator's admission prices jobs with it;
 * and its prefix cache counters, which `rekv stats` shows. */
static void kv_room_fetch(worker *w)
{
    rekv_kv_stats st;
    rekv_err err = {0};
    rekv__worker__store_room__init(&w->room);
    if (w->kv == NULL || rekv_kvstore_stats(w->kv, &st, &err)) {
        if (w->kv)
            rekv_log(REKV_LOG_WARN, "kvstore stats: %s; the coordinator admits jobs blind",
                     err.msg);
        return;
    }
    w->room.instance = st.instance;
    w->room.host_bytes = st.host_bytes;
    w->room.kv_block_bytes = st.kv_slot_bytes;
    w->room.act_block_bytes = st.act_slot_bytes;
    w->room.spill_bytes = st.spill_bytes;
    w->room.spill_room_bytes = st.spill_room_bytes;
    w->room.prefix_lookups = st.prefix_lookups; /* for `rekv stats` */
    w->room.prefix_hit_tokens = st.prefix_hit_tokens;
    w->room.prefix_hit_host_blocks = st.prefix_hit_host_blocks;
    w->room.prefix_hit_disk_blocks = st.prefix_hit_disk_blocks;
    w->room.prefix_evictions = st.prefix_evictions;
    w->room.prefix_hit_read_bytes = st.prefix_hit_read_bytes;
    w->room.host_busy_bytes = st.host_used_bytes - st.prefix_host_bytes;
    w->room_ns = rekv_now_ns();
}

void wk_kv_room_due(worker *w)
{
    if (w->kv == NULL || rekv_kvstore_client_lost(w->kv) ||
        rekv_now_ns() - w->room_ns < 1000000000ull)
        return;
    kv_room_fetch(w); /* every message carries it (StoreRoom): admission sees the disk as it is */
}

int wk_kv_connect(worker *w, rekv_err *err)
{
    /* started beside the store (`rekv run` starts the daemons at once): wait for its socket
     * while there is none or nobody listens yet, up to KV_WAIT_MS, stopping on a signal */
    uint64_t start = rekv_now_ns(), until = start + KV_WAIT_MS * 1000000ull;
    rekv_kvstore_client *kv = NULL;
    int crc, said = 0;
    while ((crc = rekv_kvstore_client_connect(w->kv_ep, NULL, w->kv_timeout_ms, &kv, err)) ==
               -ENOENT ||
           crc == -ECONNREFUSED) {
        struct pollfd sp = {w->stop_fd, POLLIN, 0};
        uint64_t now = rekv_now_ns();
        if (now > until)
            break;
        if (!said && now - start > KV_SAY_WAIT_MS * 1000000ull) { /* not silently */
            rekv_log(REKV_LOG_WARN, "waiting for the kvstore at %s (%s); up to %llu s more",
                     w->kv_ep, err->msg, (unsigned long long)((until - now) / 1000000000ull));
            said = 1;
        }
        if (poll(&sp, 1, 20) > 0) /* asked to stop */
            return 1;
        rekv_err_clear(err);
    }
    if (crc == -EINTR) { /* a signal cut a wait on a store that does not answer (hung) */
        struct pollfd sp = {w->stop_fd, POLLIN, 0};
        if (poll(&sp, 1, 0) > 0) /* it was the stop: asked to stop, not a failure */
            return 1;
    }
    if (crc)
        return crc;
    rekv_kvstore_client_set_stop_fd(kv, w->stop_fd);
    rekv_kv_geometry g;
    rekv_kvstore_client_geometry(kv, &g);
    w->pc.cache_dtype = g.dtype; /* the store's arena decides the cache dtype */
    /* our sequences are ours by name; what a dead worker of this name left goes once the
     * coordinator has welcomed us (wk_kv_drop_leftovers): a second live worker started under a
     * taken name is refused before it can drop the first one's */
    int rc;
    if ((rc = rekv_kvstore_client_set_owner(kv, w->name, err))) {
        rekv_kvstore_client_close(kv);
        return rc;
    }
    uint64_t lease_ms = rekv_kvstore_client_header(kv)->lease_ms;
    w->renew_ns = lease_ms / 4 * 1000000ull;
    if (w->renew_ns < 10000000ull)
        w->renew_ns = 10000000ull;
    if (w->renew_ns > 1000000000ull)
        w->renew_ns = 1000000000ull;
    w->kv = kv; /* the loop may replace it (wk_kv_reconnect) */
    w->last_renew_ns = rekv_now_ns();
    kv_room_fetch(w);
    return 0;
}

void wk_kv_drop_leftovers(worker *w)
{
    if (w->kv == NULL || w->leftovers_dropped)
        return;
    uint64_t n_seqs = 0, n_blocks = 0;
    rekv_err err = {0};
    if (rekv_kvstore_drop_owner(w->kv, w->name, &n_seqs, &n_blocks, &err)) {
        /* the store's lease expiry frees them instead; a lost store is the loop's (wk_kv_lose) */
        rekv_log(REKV_LOG_WARN, "kvstore: dropping what a previous worker named %s left: %s",
                 w->name, err.msg);
        return;
    }
    w->leftovers_dropped = 1;
    if (n_seqs)
        rekv_log(REKV_LOG_WARN,
                 "kvstore: dropped %llu sequences (%llu blocks) that a previous "
                 "worker named %s left",
                 (unsigned long long)n_seqs, (unsigned long long)n_blocks, w->name);
}

/* From the loop's thread, also while the step thread uses the same client: that one's requests
 * renew the lease themselves, so this never waits for them. */
void wk_kv_renew_due(worker *w)
{
    uint64_t now = rekv_now_ns();
    if (w->kv == NULL || now - w->last_renew_ns < w->renew_ns || rekv_kvstore_client_lost(w->kv))
        return; /* a lost client: the loop drops it (wk_kv_lose) once no step runs */
    rekv_err err = {0};
    int rc = rekv_kvstore_renew_nowait(w->kv, &err);
    if (rc && rc != -ECANCELED) /* -ECANCELED: a stop came while it waited */
        rekv_log(REKV_LOG_WARN, "kvstore lease: %s", err.msg);
    w->last_renew_ns = now;
}

/* They do when the failure passes — the kvstore is gone (its client says so, or a request timed
 * out: *lost is set), it had no room (-ENOMEM, -ENOSPC: other jobs end and free it), a cached
 * block failed its read-back and left the prefix cache (-EAGAIN), or we are stopping. Anything else (a CRC mismatch or I/O error on read-back, a device error, a bad
 * request) fails them with the reason: running them again would meet it again. */
int wk_step_error_retry(worker *w, int code, int *lost)
{
    *lost = 0;
    /* -ENODEV: the device is lost; the worker exits and its restart runs them (worker_plan.c) */
    if (w->stopping || code == -ECANCELED || code == -ENODEV)
        return 1;
    if (w->kv && (rekv_kvstore_client_lost(w->kv) || code == -ETIMEDOUT || code == -EPIPE)) {
        *lost = 1;
        return 1;
    }
    /* -EAGAIN: a block a job took from the prefix cache failed its read-back and the store
     * dropped it from the cache; run again, the job computes it */
    return code == -ENOMEM || code == -ENOSPC || code == -EAGAIN;
}

void wk_kv_lose(worker *w)
{
    if (w->kv && rekv_kvstore_client_lost(w->kv) == -ECANCELED)
        return; /* its request saw the stop eventfd: the loop stops next (a stop, not a loss) */
    rekv_log(REKV_LOG_WARN, "kvstore %s: lost; unavailable until it is back", w->kv_ep);
    if (w->unavailable[0] == '\0')
        snprintf(w->unavailable, sizeof(w->unavailable), "its kvstore at %s is gone; reconnecting",
                 w->kv_ep);
    w->rebuild = w->pipe != NULL;
    if (w->batch)
        rekv_batcher_clear(w->batch); /* the client fails at once: nothing waits */
    rekv_batcher_free(w->batch);
    rekv_pipeline_free(w->pipe);
    w->batch = NULL;
    w->pipe = NULL;
    rekv_kvstore_client_close(w->kv);
    w->kv = NULL;
    w->kv_lost = 1;
    w->reconnect_tries = 0;
    w->next_reconnect_ns = rekv_now_ns();
    wk_send_heartbeat(w);
}

/* Drops what a worker of our name left in the store, rebuilds the pipeline and says we are
 * available. */
void wk_kv_reconnect(worker *w)
{
    if (!w->kv_lost || rekv_now_ns() < w->next_reconnect_ns)
        return;
    w->next_reconnect_ns = rekv_now_ns() + 500000000ull;
    rekv_err err = {0};
    rekv_kvstore_client *kv = NULL;
    uint64_t n_seqs = 0, n_blocks = 0;
    /* a short bound on the connect itself: this loop heartbeats and watches for SIGTERM */
    if (rekv_kvstore_client_connect(w->kv_ep, NULL, 1000, &kv, &err) == 0) {
        rekv_kvstore_client_set_timeout(kv, w->kv_timeout_ms);
        rekv_kvstore_client_set_stop_fd(kv, w->stop_fd);
        rekv_kv_geometry g;
        rekv_kvstore_client_geometry(kv, &g);
        if (g.dtype != w->pc.cache_dtype)
            rekv_errf(&err, -EINVAL, "kvstore %s: its cache dtype is now %s, not %s", w->kv_ep,
                      rekv_dtype_name(g.dtype), rekv_dtype_name(w->pc.cache_dtype));
        else if (rekv_kvstore_client_set_owner(kv, w->name, &err) == 0 &&
                 rekv_kvstore_drop_owner(kv, w->name, &n_seqs, &n_blocks, &err) == 0) {
            w->kv = kv;
            w->kv_lost = 0;
            w->last_renew_ns = rekv_now_ns();
            kv_room_fetch(w); /* a restarted store may be another size */
            if (!w->rebuild || wk_start_pipeline(w, &err) == 0) {
                rekv_log(REKV_LOG_INFO, "kvstore %s: connected again%s", w->kv_ep,
                         n_seqs ? " (dropped what we left there)" : "");
                w->unavailable[0] = '\0';
                wk_send_heartbeat(w);
                return;
            }
            rekv_batcher_free(w->batch);
            rekv_pipeline_free(w->pipe);
            w->batch = NULL;
            w->pipe = NULL;
            w->kv = NULL;
            w->kv_lost = 1;
        }
        rekv_kvstore_client_close(kv);
    }
    if (w->reconnect_tries++ == 0)
        rekv_log(REKV_LOG_WARN, "kvstore %s: not back yet: %s", w->kv_ep, err.msg);
}
