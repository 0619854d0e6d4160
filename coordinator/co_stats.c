/* co_stats.c — what the coordinator reports about itself: the Stats reply (job counts, tokens/s,
 * bytes moved, each worker with its planner's last choices) and the Prometheus exposition of the
 * same numbers for the metrics port (common/metrics.h). A new counter goes in both, here. */
#include "coordinator/co_internal.h"

#include "common/clock.h"

static double tokens_per_s(rekv_coordinator *co)
{
    uint32_t oldest = (co->rate_i + 1) % RATE_SLOTS, newest = co->rate_i;
    if (co->rate_ns[oldest] == 0 || co->rate_ns[newest] <= co->rate_ns[oldest])
        return 0;
    return (double)(co->rate_tokens[newest] - co->rate_tokens[oldest]) /
           ((double)(co->rate_ns[newest] - co->rate_ns[oldest]) * 1e-9);
}

/* The prefix cache counters of the kvstores the workers use, each store (instance) once. */
static void prefix_stats(const rekv_coordinator *co, Rekv__Control__PrefixCacheStats *ps)
{
    for (int i = 0; i < MAX_WORKERS; i++) {
        const worker *w = &co->workers[i];
        if (!w->active || w->plan.store_instance == 0)
            continue;
        int seen = 0;
        for (int k = 0; k < i && !seen; k++)
            seen = co->workers[k].active &&
                   co->workers[k].plan.store_instance == w->plan.store_instance;
        if (seen)
            continue;
        ps->stores++;
        ps->lookups += w->store_prefix[0];
        ps->hit_tokens += w->store_prefix[1];
        ps->hit_host_blocks += w->store_prefix[2];
        ps->hit_disk_blocks += w->store_prefix[3];
        ps->evictions += w->store_prefix[4];
        ps->hit_read_bytes += w->store_prefix[5];
    }
}

void co_do_stats(rekv_coordinator *co, const rid *from, uint64_t rq)
{
    Rekv__Control__PrefixCacheStats pcs = REKV__CONTROL__PREFIX_CACHE_STATS__INIT;
    prefix_stats(co, &pcs);
    Rekv__Control__Stats s = REKV__CONTROL__STATS__INIT;
    s.queued = co->n_queue;
    s.running = co->n_running;
    s.done = co->n_done;
    s.cancelled = co->n_cancelled;
    s.failed = co->n_failed;
    s.accepted = co->accepted;
    s.rejected_busy = co->rejected_busy;
    s.finished_forgotten = co->evicted;
    s.worker_messages_malformed = co->worker_malformed;
    s.worker_results_rejected = co->worker_rejected;
    s.steps_failed = co->steps_failed;
    s.jobs_held_for_room = co->held_for_room;
    s.jobs_prefix_priced = co->prefix_priced;
    s.jobs_too_large = co->too_large;
    s.bad_requests = co->bad_requests;
    s.requeued = co->requeued;
    s.tokens = co->tokens;
    s.tokens_per_s = tokens_per_s(co);
    s.steps = co->steps;
    s.step_rtt_avg_s = co->steps ? co->rtt_sum / (double)co->steps : 0;
    s.worker_step_avg_s = co->steps ? co->wstep_sum / (double)co->steps : 0;
    s.queue_limit = co->cfg.queue_limit;
    s.prefix_cache = &pcs;
    s.uptime_s = (double)(rekv_now_ns() - co->start_ns) * 1e-9;
    s.h2d_bytes_weights = co->counters[0];
    s.h2d_bytes_kv = co->counters[1];
    s.h2d_bytes_act = co->counters[2];
    s.d2h_bytes = co->counters[3];
    s.tokens_recomputed = co->counters[4];
    s.tokens_fetched = co->counters[5];
    s.tokens_considered = co->counters[6];
    s.tokens_selected = co->counters[7];
    Rekv__Control__ConnStats cs[2];
    const rekv_conncap *caps[2] = {co->ctl_cap, co->wrk_cap};
    for (int i = 0; i < 2; i++) {
        rekv_conncap_stats st;
        rekv_conncap_get_stats(caps[i], &st);
        rekv__control__conn_stats__init(&cs[i]);
        cs[i].open = st.live;
        cs[i].max = st.max;
        cs[i].accepted = st.accepted;
        cs[i].busy = st.busy;
        cs[i].shed = st.shed;
    }
    s.control_connections = &cs[0];
    s.worker_connections = &cs[1];
    Rekv__Control__WorkerInfo wi[MAX_WORKERS], *wp[MAX_WORKERS];
    size_t nw = 0;
    uint64_t now = rekv_now_ns();
    for (int i = 0; i < MAX_WORKERS; i++) {
        worker *w = &co->workers[i];
        if (!w->active)
            continue;
        rekv__control__worker_info__init(&wi[nw]);
        wi[nw].name = w->name;
        wi[nw].backend = w->backend;
        wi[nw].mode = w->mode;
        wi[nw].running = w->n_run;
        wi[nw].max_batch = w->max_batch;
        wi[nw].steps = w->steps;
        wi[nw].tokens = w->tokens;
        wi[nw].idle_s = (double)(now - w->last_seen_ns) * 1e-9;
        wi[nw].unavailable = (char *)w->unavailable;
        wi[nw].plan_split = w->plan.split;
        wi[nw].device_tokens = (uint32_t)w->plan.device_tokens;
        wi[nw].store_spill_room_bytes = w->plan.store_spill_bytes;
        wi[nw].plan_kv_parts = (uint32_t)w->plan.kv_parts;
        wi[nw].plan_act_parts = (uint32_t)w->plan.act_parts;
        wi[nw].plan_gpu_batches = (uint32_t)w->plan.gpu_batches;
        wi[nw].plan_column = w->plan.column;
        wi[nw].plan_predicted_step_s = w->plan.pred_step_s;
        wi[nw].plan_pcie_scale = w->plan.scales.pcie;
        wi[nw].plan_compute_scale = w->plan.scales.compute;
        wi[nw].plan_steps = w->plan.steps;
        wi[nw].plan_multi_batch_steps = w->plan.multi_batch_steps;
        wi[nw].plan_selected_fraction = co_plan_selected_fraction(&w->plan);
        wp[nw] = &wi[nw];
        nw++;
    }
    s.n_workers = nw;
    s.workers = wp;
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_STATS;
    r.stats = &s;
    co_reply_add(co, from, &r, NULL);
}

/* The KV cache usage of the kvstores the workers keep their cache in, each store once (workers
 * sharing one see the same instance): the arena's bytes in use less those of blocks only the
 * prefix cache holds, over the arena's bytes — vLLM's kv_cache_usage_perc, which counts cached
 * blocks no request holds as free. 0 with no store (resident workers keep their KV on the
 * device, which the coordinator does not see). */
static double kv_usage(const rekv_coordinator *co)
{
    double busy = 0, size = 0;
    for (int i = 0; i < MAX_WORKERS; i++) {
        const co_plan_state *ps = &co->workers[i].plan;
        int seen = !co->workers[i].active || ps->store_host_bytes == 0;
        for (int j = 0; j < i && !seen; j++)
            seen = co->workers[j].active && co->workers[j].plan.store_host_bytes > 0 &&
                   co->workers[j].plan.store_instance == ps->store_instance;
        if (!seen) {
            busy += (double)ps->store_busy_bytes;
            size += (double)ps->store_host_bytes;
        }
    }
    return size > 0 ? busy / size : 0;
}

/* The gauges the Gateway API Inference Extension's model-server protocol reads (its endpoint
 * picker scrapes them for every model server: docs/proposals/003-model-server-protocol), named
 * as vLLM names them, which the protocol lists and its vLLM defaults scrape: requests waiting
 * (TotalQueuedRequests), running (TotalRunningRequests), KV cache usage as a fraction 0..1
 * (KVCacheUtilization). rekv has no LoRA adapters: no vllm:lora_requests_info. */
static void gie_metrics(rekv_coordinator *co, rekv_metrics_buf *b)
{
    rekv_metrics_family(b, "vllm:num_requests_waiting", "gauge",
                        "Requests waiting to be processed (rekv_jobs{state=\"queued\"}).");
    rekv_metrics_sample(b, "vllm:num_requests_waiting", NULL, (double)co->n_queue);
    rekv_metrics_family(b, "vllm:num_requests_running", "gauge",
                        "Requests running (rekv_jobs{state=\"running\"}).");
    rekv_metrics_sample(b, "vllm:num_requests_running", NULL, (double)co->n_running);
    rekv_metrics_family(b, "vllm:kv_cache_usage_perc", "gauge",
                        "KV cache usage, 1 = full: the kvstores' arenas in use, less the blocks "
                        "only the prefix cache holds.");
    rekv_metrics_sample(b, "vllm:kv_cache_usage_perc", NULL, kv_usage(co));
}

/* The Prometheus exposition of what Stats reports (a rekv_metrics_render_fn). Families are
 * named rekv_* (beside them the vllm:* gauges routers read, gie_metrics); what accumulates is a
 * counter (_total) and rates are left to rate(): no tokens/s here (Stats keeps its own for `rekv
 * stats`); what is true now is a gauge; latencies are histograms in seconds. README's "Metrics"
 * section lists every family. */
int co_metrics_render(void *ctx, rekv_metrics_buf *b)
{
    rekv_coordinator *co = ctx;
    uint64_t now = rekv_now_ns();
    rekv_metrics_family(b, "rekv_jobs", "gauge", "Jobs now, by state (queued, running).");
    rekv_metrics_sample(b, "rekv_jobs", "state=\"queued\"", (double)co->n_queue);
    rekv_metrics_sample(b, "rekv_jobs", "state=\"running\"", (double)co->n_running);
    gie_metrics(co, b);

    /* one sample each, no labels */
    const struct {
        const char *name, *type, *help;
        double v;
    } one[] = {
        {"rekv_queue_limit", "gauge", "Most jobs waiting; beyond it Submit gets BUSY.",
         (double)co->cfg.queue_limit},
        {"rekv_jobs_submitted_total", "counter",
         "Jobs accepted (a journal's replayed ones included).", (double)co->accepted},
        {"rekv_jobs_finished_total", "counter", "Jobs that ended done (eos, length, context).",
         (double)co->n_done},
        {"rekv_jobs_failed_total", "counter", "Jobs that ended failed.", (double)co->n_failed},
        {"rekv_jobs_cancelled_total", "counter", "Jobs that ended cancelled.",
         (double)co->n_cancelled},
        {"rekv_jobs_rejected_busy_total", "counter", "Submits answered BUSY.",
         (double)co->rejected_busy},
        {"rekv_bad_requests_total", "counter", "Requests answered BAD_REQUEST.",
         (double)co->bad_requests},
        {"rekv_jobs_requeued_total", "counter",
         "Jobs put back after their worker died, hung, lost them or failed their step.",
         (double)co->requeued},
        {"rekv_steps_failed_total", "counter",
         "Steps that failed as a whole or were never answered (--step-timeout-ms).",
         (double)co->steps_failed},
        {"rekv_jobs_forgotten_total", "counter",
         "Finished jobs forgotten (--keep-finished, --keep-finished-bytes).", (double)co->evicted},
        {"rekv_worker_messages_malformed_total", "counter",
         "Messages on the worker socket that could not be read.", (double)co->worker_malformed},
        {"rekv_worker_results_rejected_total", "counter",
         "Job results refused from workers (token ids outside the vocabulary).",
         (double)co->worker_rejected},
        {"rekv_tokens_generated_total", "counter",
         "Generated tokens, all workers (rate() of it is tokens/s).", (double)co->tokens},
        {"rekv_steps_total", "counter", "Plans executed, all workers.", (double)co->steps},
        {"rekv_uptime_seconds", "gauge", "Seconds since the coordinator started.",
         (double)(now - co->start_ns) * 1e-9},
    };
    for (size_t i = 0; i < sizeof(one) / sizeof(*one); i++) {
        rekv_metrics_family(b, one[i].name, one[i].type, one[i].help);
        rekv_metrics_sample(b, one[i].name, NULL, one[i].v);
    }

    const struct {
        const char *name, *help;
        const rekv_metrics_hist *h;
    } hist[] = {
        {"rekv_time_to_first_token_seconds",
         "A job's acceptance to its first generated token (re-runs not counted again).",
         &co->h_ttft},
        {"rekv_inter_token_latency_seconds",
         "Between a job's consecutive generated tokens (tokens of one step after the first: 0).",
         &co->h_itl},
        {"rekv_queue_wait_seconds", "A job's acceptance to its first start on a worker.",
         &co->h_queue},
        {"rekv_step_seconds", "A step as its worker timed it.", &co->h_step},
        {"rekv_step_round_trip_seconds",
         "A step's Progress received, from its Plan sent or the step before's Progress "
         "(the later).",
         &co->h_step_rtt},
    };
    for (size_t i = 0; i < sizeof(hist) / sizeof(*hist); i++) {
        rekv_metrics_family(b, hist[i].name, "histogram", hist[i].help);
        rekv_metrics_histogram(b, hist[i].name, NULL, hist[i].h);
    }

    const rekv_conncap *caps[2] = {co->ctl_cap, co->wrk_cap};
    static const char *const sockets[2] = {"control", "workers"};
    rekv_conncap_metrics(b, "rekv", caps, sockets, 2);
    rekv_metrics_family(b, "rekv_bytes_total", "counter",
                        "Bytes the workers moved, by direction and kind.");
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"h2d\",kind=\"weights\"",
                        (double)co->counters[0]);
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"h2d\",kind=\"kv\"", (double)co->counters[1]);
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"h2d\",kind=\"act\"", (double)co->counters[2]);
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"d2h\",kind=\"all\"", (double)co->counters[3]);
    rekv_metrics_family(b, "rekv_kv_tokens_total", "counter",
                        "Cached tokens whose K,V were recomputed or fetched.");
    rekv_metrics_sample(b, "rekv_kv_tokens_total", "how=\"recomputed\"", (double)co->counters[4]);
    rekv_metrics_sample(b, "rekv_kv_tokens_total", "how=\"fetched\"", (double)co->counters[5]);
    rekv_metrics_family(b, "rekv_kv_tokens_selecting_total", "counter",
                        "infinigen: cached tokens its selecting layers could fetch, and fetched.");
    rekv_metrics_sample(b, "rekv_kv_tokens_selecting_total", "how=\"considered\"",
                        (double)co->counters[6]);
    rekv_metrics_sample(b, "rekv_kv_tokens_selecting_total", "how=\"selected\"",
                        (double)co->counters[7]);

    /* per worker; rekv_worker_info's mode label is the mode the worker runs (the planner's) */
    static const struct {
        const char *name, *type, *help;
    } wf[] = {
        {"rekv_worker_info", "gauge", "A connected worker (always 1), its backend and mode."},
        {"rekv_worker_running", "gauge", "Jobs in the worker's batch."},
        {"rekv_worker_max_batch", "gauge", "Largest batch the worker takes."},
        {"rekv_worker_steps_total", "counter", "Steps the worker ran."},
        {"rekv_worker_tokens_total", "counter", "Tokens the worker generated."},
        {"rekv_worker_idle_seconds", "gauge", "Seconds since the worker's last message."},
        {"rekv_worker_plan_split", "gauge", "The planner's KVPR split (tokens) for the last step."},
        {"rekv_worker_plan_gpu_batches", "gauge", "Mini-batches (GPU batches) of the last step."},
        {"rekv_worker_plan_kv_parts", "gauge", "KV part of the hybrid block pattern."},
        {"rekv_worker_plan_act_parts", "gauge", "ACT part of the hybrid block pattern."},
        {"rekv_worker_plan_predicted_step_seconds", "gauge", "Predicted time of the last step."},
        {"rekv_worker_plan_pcie_scale", "gauge", "Measured / predicted link time, smoothed."},
        {"rekv_worker_plan_compute_scale", "gauge", "Measured / predicted compute time, smoothed."},
        {"rekv_worker_plan_selected_fraction", "gauge",
         "infinigen: selected / considered tokens so far (0: none)."},
    };
    for (size_t f = 0; f < sizeof(wf) / sizeof(*wf); f++) {
        rekv_metrics_family(b, wf[f].name, wf[f].type, wf[f].help);
        for (int i = 0; i < MAX_WORKERS; i++) {
            const worker *w = &co->workers[i];
            if (!w->active)
                continue;
            const double v[] = {1,
                                w->n_run,
                                w->max_batch,
                                (double)w->steps,
                                (double)w->tokens,
                                (double)(now - w->last_seen_ns) * 1e-9,
                                w->plan.split,
                                w->plan.gpu_batches,
                                w->plan.kv_parts,
                                w->plan.act_parts,
                                w->plan.pred_step_s,
                                w->plan.scales.pcie,
                                w->plan.scales.compute,
                                co_plan_selected_fraction(&w->plan)};
            if (f == 0)
                rekv_metrics_sample_kv(b, wf[f].name, v[f], "worker", w->name, "backend",
                                       w->backend, "mode", w->mode, NULL);
            else
                rekv_metrics_sample_kv(b, wf[f].name, v[f], "worker", w->name, NULL);
        }
    }
    return b->err;
}
