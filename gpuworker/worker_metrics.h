/* worker_metrics.h — what rekv-gpuworker --metrics exports (Prometheus, common/metrics.h): the
 * steps it ran and their times (a histogram), the bytes its pipeline moved by kind and direction,
 * the tokens it generated, and its device's memory where the backend reports it. The daemon's
 * loop thread feeds it after each step and renders it on a scrape; nothing here is shared with
 * the step thread. Families are named rekv_gpuworker_*; README's "Metrics" section lists them. */
#ifndef REKV_GPUWORKER_WORKER_METRICS_H
#define REKV_GPUWORKER_WORKER_METRICS_H

#include <stdint.h>

#include "common/metrics.h"
#include "gpuworker/device/backend.h"
#include "gpuworker/pipeline.h"

typedef struct rekv_worker_metrics {
    rekv_backend *be;        /* for mem_info at each scrape (not owned) */
    const char *name;        /* the worker's name (not owned) */
    const char *const *mode; /* the worker's mode ("auto" until assigned), read at each scrape */
    rekv_metrics_hist step;  /* seconds per step that ran jobs, failed ones included */
    uint64_t steps;          /* steps that ran jobs */
    uint64_t steps_failed;   /* of those, steps that failed as a whole */
    uint64_t h2d[REKV_XFER_KINDS], d2h[REKV_XFER_KINDS]; /* bytes, by rekv_xfer_kind */
    uint64_t tokens;                                     /* tokens generated */
    uint64_t head_hits, head_misses; /* clo: (sequence, KV head) steps that reused / fetched */
    uint64_t tokens_recomputed, tokens_fetched; /* cached tokens whose K,V were recomputed,
                                                 * fetched (rekv_layer_counters) */
    int running;                                /* jobs in the batch after the last step */
    uint64_t graph_steps; /* steps that ran as one device graph (rekv_pipeline_graph_steps) */
    int page_locked;      /* rekv_pipeline_page_locked of the worker's pipeline (-1: none) */
} rekv_worker_metrics;

/* Zeroes m and keeps the pointers (not owned; they must outlive m). */
void rekv_worker_metrics_init(rekv_worker_metrics *m, rekv_backend *be, const char *name,
                              const char *const *mode);
/* Counts one step that ran jobs: its time, the pipeline's counters for it (NULL: none), the tokens
 * it generated, whether it failed, and the jobs left running. */
void rekv_worker_metrics_step(rekv_worker_metrics *m, double step_s, const rekv_layer_counters *c,
                              uint64_t tokens, int failed, int running);
/* The rekv_metrics_render_fn of the worker's scrape port (ctx: a rekv_worker_metrics). */
int rekv_worker_metrics_render(void *ctx, rekv_metrics_buf *b);

#endif
