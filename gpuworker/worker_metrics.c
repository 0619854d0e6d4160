/* worker_metrics.c — rekv-gpuworker's Prometheus exposition (worker_metrics.h). Counters only
 * accumulate (rates are left to rate()); device memory is asked of the backend at each scrape
 * (the cpu backend reports it only with --device-memory; absent otherwise, not 0). */
#include "gpuworker/worker_metrics.h"

#include <string.h>

void rekv_worker_metrics_init(rekv_worker_metrics *m, rekv_backend *be, const char *name,
                              const char *const *mode)
{
    memset(m, 0, sizeof(*m));
    m->be = be;
    m->name = name;
    m->mode = mode;
    m->page_locked = -1;
    rekv_metrics_hist_init(&m->step, rekv_metrics_latency_bounds, rekv_metrics_latency_n_bounds);
}

void rekv_worker_metrics_step(rekv_worker_metrics *m, double step_s, const rekv_layer_counters *c,
                              uint64_t tokens, int failed, int running)
{
    m->steps++;
    m->steps_failed += failed ? 1 : 0;
    rekv_metrics_hist_observe(&m->step, step_s);
    if (c) {
        for (int k = 0; k < REKV_XFER_KINDS; k++) {
            m->h2d[k] += c->h2d_bytes[k];
            m->d2h[k] += c->d2h_bytes[k];
        }
        m->tokens_recomputed += c->tokens_recomputed;
        m->tokens_fetched += c->tokens_fetched;
        m->head_hits += c->head_hits;
        m->head_misses += c->head_misses;
    }
    m->tokens += tokens;
    m->running = running;
}

int rekv_worker_metrics_render(void *ctx, rekv_metrics_buf *b)
{
    rekv_worker_metrics *m = ctx;
    rekv_metrics_family(b, "rekv_gpuworker_info", "gauge",
                        "This worker (always 1): its name, backend and mode.");
    rekv_metrics_sample_kv(b, "rekv_gpuworker_info", 1, "worker", m->name ? m->name : "", "backend",
                           m->be ? m->be->iface->name : "", "mode",
                           m->mode && *m->mode ? *m->mode : "", NULL);
    const struct {
        const char *name, *type, *help;
        double v;
    } one[] = {
        {"rekv_gpuworker_steps_total", "counter", "Steps that ran jobs.", (double)m->steps},
        {"rekv_gpuworker_steps_failed_total", "counter",
         "Steps that failed as a whole (their jobs failed).", (double)m->steps_failed},
        {"rekv_gpuworker_tokens_generated_total", "counter", "Tokens generated.",
         (double)m->tokens},
        {"rekv_gpuworker_running_jobs", "gauge", "Jobs in the batch after the last step.",
         (double)m->running},
        {"rekv_gpuworker_graph_steps_total", "counter",
         "Steps that ran as one device graph (resident decode steps that repeat the last).",
         (double)m->graph_steps},
    };
    for (size_t i = 0; i < sizeof(one) / sizeof(*one); i++) {
        rekv_metrics_family(b, one[i].name, one[i].type, one[i].help);
        rekv_metrics_sample(b, one[i].name, NULL, one[i].v);
    }
    rekv_metrics_family(b, "rekv_gpuworker_step_seconds", "histogram",
                        "A step's time, from its start to its tokens (failed steps included).");
    rekv_metrics_histogram(b, "rekv_gpuworker_step_seconds", NULL, &m->step);

    static const char *const kinds[REKV_XFER_KINDS] = {"weights", "kv", "act", "other"};
    rekv_metrics_family(b, "rekv_gpuworker_transfer_bytes_total", "counter",
                        "Bytes the pipeline moved between host and device, by direction and "
                        "kind.");
    for (int dir = 0; dir < 2; dir++)
        for (int k = 0; k < REKV_XFER_KINDS; k++)
            rekv_metrics_sample_kv(b, "rekv_gpuworker_transfer_bytes_total",
                                   (double)(dir == 0 ? m->h2d[k] : m->d2h[k]), "dir",
                                   dir == 0 ? "h2d" : "d2h", "kind", kinds[k], NULL);
    rekv_metrics_family(b, "rekv_gpuworker_kv_tokens_total", "counter",
                        "Cached tokens whose K,V were recomputed or fetched.");
    rekv_metrics_sample(b, "rekv_gpuworker_kv_tokens_total", "how=\"recomputed\"",
                        (double)m->tokens_recomputed);
    rekv_metrics_sample(b, "rekv_gpuworker_kv_tokens_total", "how=\"fetched\"",
                        (double)m->tokens_fetched);
    rekv_metrics_family(b, "rekv_gpuworker_head_cache_total", "counter",
                        "clo: (sequence, layer, KV head) decode steps that reused their cached "
                        "top-k (hit) or fetched a new one (miss).");
    rekv_metrics_sample(b, "rekv_gpuworker_head_cache_total", "result=\"hit\"",
                        (double)m->head_hits);
    rekv_metrics_sample(b, "rekv_gpuworker_head_cache_total", "result=\"miss\"",
                        (double)m->head_misses);

    if (m->page_locked >= 0) {
        rekv_metrics_family(b, "rekv_gpuworker_host_memory_page_locked", "gauge",
                            "1 when the host memory the pipeline copies from (the kvstore "
                            "arena, offloaded weights) is page-locked; 0 when the backend "
                            "refused (copies then run from pageable memory, far below the "
                            "link's speed).");
        rekv_metrics_sample(b, "rekv_gpuworker_host_memory_page_locked", NULL, m->page_locked);
    }

    /* the device's memory, when the backend knows it (a GPU; the cpu backend with a limit) */
    size_t fr = 0, tot = 0;
    rekv_err e = {0};
    if (m->be && m->be->iface->mem_info && m->be->iface->mem_info(m->be, &fr, &tot, &e) == 0) {
        rekv_metrics_family(b, "rekv_gpuworker_device_memory_size_bytes", "gauge",
                            "The device's memory.");
        rekv_metrics_sample(b, "rekv_gpuworker_device_memory_size_bytes", NULL, (double)tot);
        rekv_metrics_family(b, "rekv_gpuworker_device_memory_used_bytes", "gauge",
                            "The device's memory in use (by every process, on a GPU).");
        rekv_metrics_sample(b, "rekv_gpuworker_device_memory_used_bytes", NULL,
                            (double)(tot > fr ? tot - fr : 0));
    }
    return b->err;
}
