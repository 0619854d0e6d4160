/* server_metrics.c — the kvstore's Prometheus exposition (rekv-kvstore --metrics): the arena's
 * and the spill tier's occupancy now (gauges), what went through them since start (counters:
 * bytes, I/O operations, errors, pins) and the latencies the store already keeps (its request and
 * spill I/O histograms, log2 nanosecond buckets, folded into Prometheus buckets). The same numbers
 * as the Stats reply (handlers.c h_stats); a new counter goes in both. Families are named
 * rekv_kvstore_*; README's "Metrics" section lists every one. */
#include <stdio.h>

#include "kvstore/remote.h"
#include "kvstore/server_internal.h"

/* The store's histograms keep [2^i, 2^(i+1)) ns buckets, i < REKV_KV_HIST_BUCKETS; Prometheus
 * gets every second power of two from 2^10 ns (~1 us) to 2^36 ns (~69 s): bucket i counts
 * towards le = 2^k ns for every k >= i + 1. */
#define FOLD_FIRST 10
#define FOLD_STEP 2
#define FOLD_N 14
_Static_assert(FOLD_N <= REKV_METRICS_MAX_BOUNDS, "too many bounds");
_Static_assert(FOLD_FIRST + FOLD_STEP * (FOLD_N - 1) < REKV_KV_HIST_BUCKETS,
               "bounds past the store's");

static double fold_bounds[FOLD_N];

/* The store's log2 histogram as a rekv_metrics_hist over fold_bounds, in seconds. */
static void fold(const rekv_kv_hist *in, rekv_metrics_hist *out)
{
    if (fold_bounds[0] == 0)
        for (int k = 0; k < FOLD_N; k++)
            fold_bounds[k] = (double)(1ull << (FOLD_FIRST + FOLD_STEP * k)) * 1e-9;
    rekv_metrics_hist_init(out, fold_bounds, FOLD_N);
    for (int i = 0; i < REKV_KV_HIST_BUCKETS; i++) {
        /* values below 2^(i+1) ns: the first bound at or above that */
        int k = 0;
        while (k < FOLD_N && FOLD_FIRST + FOLD_STEP * k < i + 1)
            k++;
        out->counts[k] += in->buckets[i];
    }
    out->count = in->count;
    out->sum = (double)in->sum_ns * 1e-9;
}

int srv_metrics_render(void *ctx, rekv_metrics_buf *b)
{
    rekv_kvstore_server *s = ctx;
    uint64_t slot = s->arena.slot_bytes; /* a file slot on the spill tier */
    uint64_t pinned = 0;
    for (uint32_t i = 0; i < s->n_block_ids; i++)
        if (s->blocks[i].state != BS_UNUSED && s->blocks[i].pins > 0)
            pinned++;
    uint64_t clients = 0;
    for (kv_client *c = s->clients; c; c = c->next)
        clients++;

    const struct {
        const char *name, *type, *help;
        double v;
    } one[] = {
        {"rekv_kvstore_arena_size_bytes", "gauge", "The arena's block slots, in bytes.",
         (double)((uint64_t)s->hs.n_big * s->hs.big_bytes)},
        {"rekv_kvstore_arena_used_bytes", "gauge",
         "Arena slots holding a block, in bytes (each block its type's slot).",
         (double)s->hs.used_bytes},
        {"rekv_kvstore_spill_used_bytes", "gauge",
         "Blocks on the spill tier now (spilled, not in memory), in bytes.",
         (double)((s->disk_n[0] + s->disk_n[1]) * slot)},
        {"rekv_kvstore_spill_written_bytes_total", "counter",
         "Bytes of blocks spilled (writes that left the block on disk).", (double)s->bytes_spilled},
        {"rekv_kvstore_spill_read_bytes_total", "counter",
         "Bytes of blocks read back from the spill tier intact.", (double)s->bytes_read_back},
        {"rekv_kvstore_spill_writes_total", "counter",
         "Spill writes completed (failed ones included).", (double)s->hist[H_SPILL_WRITE].count},
        {"rekv_kvstore_spill_reads_total", "counter",
         "Spill read-backs completed (failed ones included).", (double)s->hist[H_SPILL_READ].count},
        {"rekv_kvstore_spill_errors_total", "counter", "Spill writes that failed.",
         (double)s->spill_errors},
        {"rekv_kvstore_crc_errors_total", "counter",
         "Read-backs whose CRC32C did not match what was written (the block is lost).",
         (double)s->crc_errors},
        {"rekv_kvstore_read_errors_total", "counter",
         "Read-backs the device failed (an I/O error: the block is lost).", (double)s->read_errors},
        {"rekv_kvstore_pinned_blocks", "gauge", "Blocks with at least one pin.", (double)pinned},
        {"rekv_kvstore_sequences", "gauge", "Sequences stored.", (double)s->seqs.len},
        {"rekv_kvstore_clients", "gauge", "Connected clients.", (double)clients},
        {"rekv_kvstore_leases_expired_total", "counter", "Client leases that ran out.",
         (double)s->leases_expired},
        {"rekv_kvstore_sequences_reclaimed_total", "counter",
         "Sequences dropped by DropOwner or with their owner's lease.",
         (double)s->sequences_reclaimed},
        {"rekv_kvstore_prefix_lookups_total", "counter",
         "Prefix cache lookups (Lookup, CreateSeq with a prefix).", (double)s->px_lookups},
        {"rekv_kvstore_prefix_hit_tokens_total", "counter",
         "Prompt tokens sequences took from the prefix cache.", (double)s->px_hit_tokens},
        {"rekv_kvstore_prefix_evictions_total", "counter",
         "Cached blocks (all layers) evicted from the prefix cache to make room.",
         (double)s->px_evictions},
        {"rekv_kvstore_prefix_hit_read_bytes_total", "counter",
         "Bytes read back from the spill tier for blocks a prefix took.",
         (double)s->px_hit_read_bytes},
        {"rekv_kvstore_prefix_published_blocks_total", "counter",
         "Blocks (all layers) published to the prefix cache.", (double)s->px_published},
        {"rekv_kvstore_prefix_cached_blocks", "gauge",
         "Blocks (all layers) the prefix cache holds.",
         (double)s->ce_live * s->cfg.geometry.n_layers},
    };
    for (size_t i = 0; i < sizeof(one) / sizeof(*one); i++) {
        rekv_metrics_family(b, one[i].name, one[i].type, one[i].help);
        rekv_metrics_sample(b, one[i].name, NULL, one[i].v);
    }
    const rekv_conncap *caps[1] = {s->cap};
    static const char *const sockets[1] = {"clients"};
    rekv_conncap_metrics(b, "rekv_kvstore", caps, sockets, 1);
    rekv_metrics_family(b, "rekv_kvstore_blocks", "gauge", "Blocks stored, by tier and type.");
    static const char *const types[2] = {"kv", "act"};
    for (int t = 0; t < 2; t++) {
        rekv_metrics_sample_kv(b, "rekv_kvstore_blocks", (double)s->host_n[t], "tier", "host",
                               "type", types[t], NULL);
        rekv_metrics_sample_kv(b, "rekv_kvstore_blocks", (double)s->disk_n[t], "tier", "disk",
                               "type", types[t], NULL);
    }
    rekv_metrics_family(b, "rekv_kvstore_prefix_hit_blocks_total", "counter",
                        "Blocks (all layers) prefixes took from the cache, by where they were.");
    rekv_metrics_sample(b, "rekv_kvstore_prefix_hit_blocks_total", "tier=\"host\"",
                        (double)s->px_hit_host);
    rekv_metrics_sample(b, "rekv_kvstore_prefix_hit_blocks_total", "tier=\"disk\"",
                        (double)s->px_hit_disk);
    rekv_metrics_family(b, "rekv_kvstore_spill_in_flight", "gauge",
                        "Spill I/O submitted and not completed, by operation.");
    rekv_metrics_sample(b, "rekv_kvstore_spill_in_flight", "op=\"write\"",
                        (double)s->spills_in_flight);
    rekv_metrics_sample(b, "rekv_kvstore_spill_in_flight", "op=\"read\"",
                        (double)s->reads_in_flight);
    rekv_metrics_family(b, "rekv_kvstore_pins_total", "counter",
                        "Blocks pinned, by whether they were in memory (hit) or read back (miss).");
    rekv_metrics_sample(b, "rekv_kvstore_pins_total", "result=\"hit\"", (double)s->pin_hits);
    rekv_metrics_sample(b, "rekv_kvstore_pins_total", "result=\"miss\"", (double)s->pin_misses);
    rekv_metrics_family(b, "rekv_kvstore_spill_path_reads_total", "counter",
                        "Spill read-backs by path: blocks a pin found on disk or still being read "
                        "and waited for (critical), blocks read back ahead of their pin (ahead).");
    rekv_metrics_sample(b, "rekv_kvstore_spill_path_reads_total", "path=\"critical\"",
                        (double)s->pin_wait_blocks);
    rekv_metrics_sample(b, "rekv_kvstore_spill_path_reads_total", "path=\"ahead\"",
                        (double)s->read_ahead_blocks);
    rekv_metrics_family(
        b, "rekv_kvstore_spill_path_read_bytes_total", "counter",
        "Bytes of the spill read-backs by path (as rekv_kvstore_spill_path_reads_total).");
    rekv_metrics_sample(b, "rekv_kvstore_spill_path_read_bytes_total", "path=\"critical\"",
                        (double)s->pin_wait_bytes);
    rekv_metrics_sample(b, "rekv_kvstore_spill_path_read_bytes_total", "path=\"ahead\"",
                        (double)s->read_ahead_bytes);

    if (s->events) { /* --kv-events */
        kv_events_counts ec;
        kv_events_get_counts(s->events, &ec);
        rekv_metrics_family(b, "rekv_kvstore_kv_events_total", "counter",
                            "KV events told to routers (--kv-events), blocks for stored and "
                            "removed, by type.");
        rekv_metrics_sample(b, "rekv_kvstore_kv_events_total", "type=\"stored\"",
                            (double)ec.stored);
        rekv_metrics_sample(b, "rekv_kvstore_kv_events_total", "type=\"removed\"",
                            (double)ec.removed);
        rekv_metrics_sample(b, "rekv_kvstore_kv_events_total", "type=\"cleared\"",
                            (double)ec.cleared);
        rekv_metrics_family(b, "rekv_kvstore_kv_event_batches_total", "counter",
                            "KV event batches, sent or dropped (a subscriber's queue full).");
        rekv_metrics_sample(b, "rekv_kvstore_kv_event_batches_total", "outcome=\"sent\"",
                            (double)ec.batches_sent);
        rekv_metrics_sample(b, "rekv_kvstore_kv_event_batches_total", "outcome=\"dropped\"",
                            (double)ec.batches_dropped);
    }

    rekv_metrics_hist h;
    rekv_metrics_family(b, "rekv_kvstore_request_seconds", "histogram",
                        "Requests from receipt to reply (parked ones included), by kind.");
    for (int i = H_PLAN; i <= H_OTHER; i++) {
        char labels[64];
        snprintf(labels, sizeof(labels), "kind=\"%s\"", srv_hist_names[i]);
        fold(&s->hist[i], &h);
        rekv_metrics_histogram(b, "rekv_kvstore_request_seconds", labels, &h);
    }
    rekv_metrics_family(b, "rekv_kvstore_spill_io_seconds", "histogram",
                        "Spill I/O from submission to completion, by operation.");
    fold(&s->hist[H_SPILL_WRITE], &h);
    rekv_metrics_histogram(b, "rekv_kvstore_spill_io_seconds", "op=\"write\"", &h);
    fold(&s->hist[H_SPILL_READ], &h);
    rekv_metrics_histogram(b, "rekv_kvstore_spill_io_seconds", "op=\"read\"", &h);
    srv_remote_metrics(s, b); /* with --remote */
    return b->err;
}
