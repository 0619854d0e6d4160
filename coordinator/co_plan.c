/* co_plan.c — see co_plan.h. */
#include "coordinator/co_plan.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The worker's mode's properties (common/mode.h; ps->mode is a parsed mode or resident's 0). */
static const rekv_mode_info *mode_of(const co_plan_state *ps)
{
    return rekv_mode_info_of((rekv_mode)ps->mode);
}

/* The profile a Hello carries, into *out: 0, or -EINVAL when it has none or one the planner cannot
 * use (*out then holds what it sent, zeros where it sent nothing). */
static int hello_profile(const Rekv__Worker__Hello *h, rekv_cost_profile *out)
{
    const Rekv__Worker__CostProfile *c = h->profile;
    memset(out, 0, sizeof(*out));
    if (c == NULL)
        return -EINVAL;
    out->h2d_bw = c->h2d_bw;
    out->h2d_latency = c->h2d_latency;
    out->gemm_flops = c->gemm_flops;
    out->fwd_flops_rate = c->fwd_flops_rate;
    out->fwd_gemm = (rekv_linear){c->fwd_gemm_a, c->fwd_gemm_b};
    out->attn_flops_rate = c->attn_flops_rate;
    out->attn_chunk_flops_rate = c->attn_chunk_flops_rate;
    out->load_kv = (rekv_linear){c->load_kv_a, c->load_kv_b};
    out->kv_gen = (rekv_linear){c->kv_gen_a, c->kv_gen_b};
    out->t_load_w = c->t_load_w;
    return c->h2d_bw > 0 && c->gemm_flops > 0 ? 0 : -EINVAL;
}

/* Bytes per cached K or V element as a Hello reports them: its row's bytes over the head's width
 * (an int8/int4 row holds its scales too), or cache_elem_bytes from a worker that sends no row. */
static double hello_elem_bytes(const Rekv__Worker__Hello *h)
{
    return h->cache_row_bytes && h->head_dim ? (double)h->cache_row_bytes / (double)h->head_dim
                                             : (double)h->cache_elem_bytes;
}

rekv_plan_model co_plan_hello_model(const Rekv__Worker__Hello *h)
{
    return (rekv_plan_model){.hidden = h->hidden,
                             .q_dim = h->q_dim,
                             .kv_dim = h->kv_dim,
                             .n_layers = (int)h->n_layers,
                             .layer_params = (double)h->layer_params,
                             .weight_elem_bytes = h->weight_elem_bytes,
                             .window = h->window,
                             .windowed_layers = (int)h->windowed_layers};
}

/* Mode "auto": the planner's pick (rekv_plan_pick_mode), infinigen's layer-0 split into *split,
 * and why; resident without a kvstore or a usable profile. */
static rekv_mode pick_mode(const Rekv__Worker__Hello *h, int *split, char *reason,
                           size_t reason_len)
{
    *split = 0;
    if (!h->kvstore) {
        snprintf(reason, reason_len, "no kvstore to keep the cache in");
        return REKV_MODE_RESIDENT;
    }
    rekv_cost_profile prof;
    rekv_plan_model pm = co_plan_hello_model(h);
    rekv_mode_pick mp;
    rekv_err e = {0};
    if (hello_profile(h, &prof)) {
        snprintf(reason, reason_len, "the worker sent no usable profile");
        return REKV_MODE_RESIDENT;
    }
    /* approximate modes only when the user allowed them; f is the prior: a worker asking for
     * its mode has run no step yet (its measured fraction, co_plan_state, comes later) */
    rekv_plan_approx ap = {.infinigen_recompute = 1};
    if (rekv_plan_pick_mode(&prof, &pm, h->max_batch, h->max_pos, hello_elem_bytes(h),
                            h->device_kv_room, h->offload_weights, h->approximate ? &ap : NULL, &mp,
                            &e)) {
        snprintf(reason, reason_len, "%.400s", e.msg);
        return REKV_MODE_RESIDENT;
    }
    rekv_mode m = mp.resident ? REKV_MODE_RESIDENT : rekv_plan_tech_mode(mp.tech);
    if (!mp.resident && mp.tech == REKV_TECH_INFINIGEN) /* layer 0's split */
        *split = (int)mp.costs[REKV_TECH_INFINIGEN].kvpr_l;
    if (h->device_kv_room < 0) {
        snprintf(reason, reason_len, "the %s backend's device memory is the host's",
                 h->backend ? h->backend : "worker's");
        return m;
    }
    int n = snprintf(reason, reason_len,
                     "the KV cache of %u sequences of %u tokens is %.2f GB, the device has room "
                     "for %.2f GB; priced per layer and step: offload %.3g ms, kvpr %.3g ms, act "
                     "%.3g ms, hybrid %.3g ms",
                     h->max_batch, h->max_pos, mp.kv_bytes * 1e-9, h->device_kv_room * 1e-9,
                     mp.costs[REKV_TECH_KV].t_step * 1e3, mp.costs[REKV_TECH_KVPR].t_step * 1e3,
                     mp.costs[REKV_TECH_ACT].t_step * 1e3, mp.costs[REKV_TECH_HYBRID].t_step * 1e3);
    if (mp.device_tokens > 0 && n >= 0 && (size_t)n < reason_len)
        n += snprintf(reason + n, reason_len - (size_t)n,
                      ", each with its first %lld tokens' K,V on the device",
                      (long long)mp.device_tokens);
    if (mp.approximate && n >= 0 && (size_t)n < reason_len)
        snprintf(reason + n, reason_len - (size_t)n,
                 ", infinigen (approximate) %.3g ms at f %.2f, layer 0's split %lld%s",
                 mp.costs[REKV_TECH_INFINIGEN].t_step * 1e3, mp.infinigen_fraction,
                 (long long)mp.costs[REKV_TECH_INFINIGEN].kvpr_l,
                 mp.infinigen_fits ? "" : ", but its partial keys do not fit the device");
    return m;
}

int co_plan_assign(const Rekv__Worker__Hello *h, co_assign *out)
{
    memset(out, 0, sizeof(*out));
    out->persist_np = INFINITY;
    size_t len = sizeof(out->reason);
    if (h->mode && strcmp(h->mode, "auto") == 0) {
        out->mode = pick_mode(h, &out->split, out->reason, len);
    } else if (rekv_mode_parse(h->mode, &out->mode)) {
        snprintf(out->reason, len, "it asks for mode \"%s\", which is not one",
                 h->mode ? h->mode : "");
        return -EINVAL;
    } else {
        snprintf(out->reason, len, "the mode it was started with");
    }
    /* what its pipeline keeps on the device, at its largest batch and the model's context */
    rekv_plan_model pm = co_plan_hello_model(h);
    out->device_tokens = (int)rekv_plan_device_tokens(&pm, h->head_dim, out->mode, h->max_batch,
                                                      h->max_pos, hello_elem_bytes(h),
                                                      h->device_kv_room, h->device_tokens_asked);
    const rekv_mode_info *mi = rekv_mode_info_of(out->mode);
    if (mi->head_caches) {
        rekv_cost_profile prof;
        hello_profile(h, &prof); /* none measured: no link limits N_p (INFINITY) */
        out->persist_np = rekv_plan_persist_np(&prof, &pm, h->head_dim, h->max_batch, h->max_pos,
                                               h->fetch_cap, hello_elem_bytes(h));
    }
    size_t n = strlen(out->reason);
    snprintf(out->reason + n, len - n, "; device part %d tokens%s", out->device_tokens,
             h->device_tokens_asked >= 0 ? " (--device-tokens)" : "");
    n = strlen(out->reason);
    if (mi->head_caches)
        snprintf(out->reason + n, len - n, "; N_p %.1f KV heads per layer (Eq. 12)",
                 out->persist_np);
    return 0;
}

void co_plan_init(co_plan_state *ps, const Rekv__Worker__Hello *h)
{
    memset(ps, 0, sizeof(*ps));
    ps->scales = (rekv_plan_scales){1, 1};
    rekv_mode m;
    if (h->mode == NULL || rekv_mode_parse(h->mode, &m) || h->hidden == 0 || h->n_layers == 0 ||
        h->cache_elem_bytes == 0 || hello_profile(h, &ps->prof))
        return;
    ps->mode = (int)m;
    ps->keeps_act = rekv_mode_keeps_act(m, (int)h->split);
    ps->hidden = h->hidden;
    ps->kv_dim = h->kv_dim;
    ps->q_dim = h->q_dim;
    ps->n_layers = h->n_layers;
    ps->elem_bytes = hello_elem_bytes(h);
    ps->layer_params = h->layer_params;
    ps->offload_weights = h->offload_weights;
    ps->device_buffer_bytes = h->device_buffer_bytes;
    ps->device_tokens = h->device_tokens;
    ps->prefix_cache = h->prefix_cache;
    ps->have_profile = 1;
}

void co_plan_store(co_plan_state *ps, const Rekv__Worker__StoreRoom *room)
{
    ps->store_instance = room ? room->instance : 0;
    ps->store_host_bytes = room ? room->host_bytes : 0;
    ps->store_kv_bytes = room ? room->kv_block_bytes : 0;
    ps->store_act_bytes = room ? room->act_block_bytes : 0;
    ps->store_spill_bytes = room ? room->spill_room_bytes : 0;
    ps->store_busy_bytes = room ? room->host_busy_bytes : 0;
}

uint64_t co_plan_job_store_bytes(const co_plan_state *ps, uint64_t tokens, int kv_parts,
                                 int act_parts)
{
    const rekv_mode_info *mi = mode_of(ps);
    if (ps->store_host_bytes == 0 || mi->store == REKV_STORE_NONE)
        return 0;
    uint64_t nb = (tokens + REKV_PLAN_BLOCK_TOKENS - 1) / REKV_PLAN_BLOCK_TOKENS, n_kv = nb,
             n_act = 0;
    if (mi->store == REKV_STORE_PATTERN) {
        if (kv_parts + act_parts <= 0) /* the worker's pattern before any Plan's */
            kv_parts = act_parts = 1;
        return (uint64_t)ceil(
            rekv_plan_hybrid_job_bytes((int64_t)nb, kv_parts, act_parts, (int)ps->n_layers,
                                       (double)ps->store_kv_bytes, (double)ps->store_act_bytes));
    }
    if (mi->store == REKV_STORE_ACT)
        n_kv = 0, n_act = nb;
    else if (ps->keeps_act)
        n_act = nb;
    return (uint64_t)ps->n_layers * (n_kv * ps->store_kv_bytes + n_act * ps->store_act_bytes);
}

uint64_t co_plan_store_budget(const co_plan_state *ps)
{
    uint64_t host = ps->store_host_bytes;
    uint64_t spill = mode_of(ps)->layer_windows ? ps->store_spill_bytes : 0;
    if (spill == 0)
        return host;
    uint64_t big =
        ps->store_kv_bytes > ps->store_act_bytes ? ps->store_kv_bytes : ps->store_act_bytes;
    uint64_t win = host > 2 * big ? (host - 2 * big) / 2 : 0;
    uint64_t L = ps->n_layers > 0 ? (uint64_t)ps->n_layers : 1;
    uint64_t by_window = win * L + L - 1; /* all / L <= win */
    uint64_t b = host + spill < by_window ? host + spill : by_window;
    return b > host ? b : host;
}

/* The profile as the last steps measured it. */
static rekv_cost_profile scaled(const co_plan_state *ps)
{
    rekv_cost_profile p;
    rekv_plan_scaled_profile(&ps->prof, &ps->scales, &p);
    return p;
}

int64_t co_plan_block_capacity(const co_plan_state *ps)
{
    if (ps->device_buffer_bytes == 0 || ps->elem_bytes == 0)
        return 0;
    /* per context token of a GPU batch (pipeline.c): K and V and the activation row in the cache
     * dtype, in both parities' buffers, plus the fp32 recomputation input and K,V */
    double per_token = rekv_cost_stream_token_bytes(ps->hidden, ps->kv_dim, ps->elem_bytes);
    int64_t blocks =
        (int64_t)((double)ps->device_buffer_bytes / per_token) / REKV_PLAN_BLOCK_TOKENS;
    return blocks > 0 ? blocks : 1;
}

#define REKV_PLAN_CHUNK_STEP 0.5 /* a chunk's share of a predicted decode step */

uint32_t co_plan_prefill_chunk(const co_plan_state *ps, uint32_t cap, uint32_t prompt)
{
    if (cap == 0 || !ps->have_profile || !(ps->pred_step_s > 0))
        return cap;
    rekv_cost_profile prof = scaled(ps);
    /* a prompt token's prefill: the layers' GEMMs for one row, and its attention over the
     * prompt before it at a chunk's rate, priced at the prompt's end (the dearest place) */
    double per_token = 2.0 * (double)ps->layer_params * (double)ps->n_layers / prof.gemm_flops;
    double attn_rate =
        prof.attn_chunk_flops_rate > 0 ? prof.attn_chunk_flops_rate : prof.attn_flops_rate;
    if (attn_rate > 0)
        per_token += 4.0 * (double)ps->q_dim * (double)prompt * (double)ps->n_layers / attn_rate;
    if (!(per_token > 0))
        return cap;
    double t = REKV_PLAN_CHUNK_STEP * ps->pred_step_s / per_token;
    return t >= cap ? cap : t >= 16 ? (uint32_t)t / 16 * 16 : t >= 1 ? (uint32_t)t : 1;
}

/* The worker's model as the cost model sees it (its Hello). */
static rekv_plan_model plan_model(const co_plan_state *ps)
{
    return (rekv_plan_model){.hidden = ps->hidden,
                             .q_dim = ps->q_dim,
                             .kv_dim = ps->kv_dim,
                             .n_layers = (int)ps->n_layers,
                             .layer_params = (double)ps->layer_params};
}

/* One layer of a decode step of n sequences of s tokens on this worker (rekv_plan_shape), with
 * the weights the worker streams (at the profile's load time) and its device-resident part. */
static void step_shape(const co_plan_state *ps, const rekv_cost_profile *prof, int64_t n, int64_t s,
                       rekv_step_shape *sh)
{
    rekv_plan_model m = plan_model(ps);
    rekv_plan_shape(&m, n, s, ps->elem_bytes, 0, sh);
    sh->kv.weight_bytes = ps->offload_weights ? prof->t_load_w * prof->h2d_bw : 0;
    sh->device_tokens = ps->device_tokens;
}

/* The step-time pattern of a batch of n sequences of `tokens` context tokens in all
 * (rekv_plan_hybrid_pattern at their mean context); 1:1 when it finds none. */
static void step_pattern(const co_plan_state *ps, const rekv_cost_profile *prof, int64_t n,
                         int64_t tokens, int *kv_parts, int *act_parts)
{
    rekv_step_shape sh;
    int64_t s = n > 0 && tokens / n > 0 ? tokens / n : 1;
    step_shape(ps, prof, n > 0 ? n : 1, s, &sh);
    if (rekv_plan_hybrid_pattern(prof, &sh, 0, kv_parts, act_parts, NULL, NULL))
        *kv_parts = *act_parts = 1;
}

void co_plan_join_pattern(co_plan_state *ps, const rekv_hybrid_seq *running, size_t n_running,
                          const rekv_hybrid_seq *waiting, size_t n_waiting, uint64_t room_bytes,
                          int *kv_parts, int *act_parts)
{
    *kv_parts = *act_parts = 1; /* no profile: no Plan carries a pattern, the worker keeps 1:1 */
    ps->join_binding = 0;
    if (mode_of(ps)->store != REKV_STORE_PATTERN || !ps->have_profile)
        return;
    rekv_cost_profile prof = scaled(ps);
    int64_t tokens = 0;
    for (size_t i = 0; i < n_running; i++)
        tokens += running[i].tokens;
    for (size_t i = 0; i < n_waiting; i++)
        tokens += waiting[i].tokens;
    step_pattern(ps, &prof, (int64_t)(n_running + n_waiting), tokens, kv_parts, act_parts);
    if (ps->store_host_bytes == 0 || n_waiting == 0)
        return; /* no room known, or nobody to admit */
    rekv_hybrid_demand d = {
        .model = plan_model(ps),
        .cache_elem_bytes = ps->elem_bytes,
        .layer_weight_bytes = ps->offload_weights ? prof.t_load_w * prof.h2d_bw : 0,
        .device_tokens = ps->device_tokens,
        .kv_block_bytes = (double)ps->store_kv_bytes,
        .act_block_bytes = (double)ps->store_act_bytes,
        .room_bytes = (double)room_bytes,
        .running = running,
        .n_running = n_running,
        .waiting = waiting,
        .n_waiting = n_waiting,
        .kv_parts = *kv_parts,
        .act_parts = *act_parts,
    };
    rekv_hybrid_choice c;
    if (rekv_plan_hybrid_demand(&prof, &d, &c, NULL) == 0) {
        *kv_parts = c.kv_parts;
        *act_parts = c.act_parts;
        ps->join_binding = c.binding;
    }
}

int co_plan_step(co_plan_state *ps, const uint64_t *jobs, const int64_t *ctx, const double *kv_frac,
                 int n, int kv_parts, int act_parts, Rekv__Worker__StepParams *out,
                 uint64_t *mb_job, uint32_t *mb_index)
{
    const rekv_mode_info *mi = mode_of(ps);
    if (!ps->have_profile || mi->store == REKV_STORE_NONE || n <= 0)
        return 0;
    rekv_cost_profile prof = scaled(ps);
    int64_t sum = 0, dev = ps->device_tokens;
    for (int i = 0; i < n; i++)
        sum += ctx[i];
    int64_t s = sum / n > 0 ? sum / n : 1;
    rekv_step_shape sh;
    step_shape(ps, &prof, n, s, &sh);
    /* KVPR's split for the batch's mean context (rekv_plan_kvpr_choose) */
    int split = 0;
    /* the split of what the device-resident part leaves: tokens [dev, split) are recomputed */
    rekv_kvpr_params moved = sh.kv;
    moved.s = s > dev ? s - dev : 0;
    rekv_kvpr_split ks;
    if (mi->split == REKV_SPLIT_PREFIX && rekv_plan_kvpr_choose(&prof, &moved, &ks, NULL) == 0)
        split = (int)(dev + ks.l);
    /* the pattern of the sequences this step makes: the caller's (admission charged the joining
     * jobs at it), else the step-time one */
    if (mi->store != REKV_STORE_PATTERN)
        kv_parts = act_parts = 1;
    else if (kv_parts < 0 || act_parts < 0 || kv_parts + act_parts == 0)
        step_pattern(ps, &prof, n, sum, &kv_parts, &act_parts);
    double f_step = (double)kv_parts / (kv_parts + act_parts), kv_tok = 0;
    for (int i = 0; i < n; i++) /* each job's blocks keep the pattern it was made with */
        kv_tok += (kv_frac ? kv_frac[i] : f_step) * (double)ctx[i];
    /* mini-batches: each job's KV and ACT blocks this step, packed by F_b (003 Eq. 6-7) into
     * GPU buffers of half the batch's blocks (so there is something to overlap) */
    rekv_mb_request *req = calloc((size_t)n, sizeof(*req));
    int *assign = calloc((size_t)n, sizeof(int));
    size_t n_batches = 1;
    int64_t kv_tot = 0, act_tot = 0, kv_big = 0, act_big = 0;
    for (int i = 0; req && assign && i < n; i++) {
        double f_kv = kv_frac ? kv_frac[i] : f_step;
        /* the blocks that move: past the device-resident part */
        int64_t moved_i = ctx[i] > dev ? ctx[i] - dev : 0;
        int64_t b = (moved_i + REKV_PLAN_BLOCK_TOKENS - 1) / REKV_PLAN_BLOCK_TOKENS, a = 0;
        if (mi->store == REKV_STORE_ACT)
            a = b;
        else if (mi->split == REKV_SPLIT_PREFIX)
            a = ((ctx[i] < split ? ctx[i] : split) - (ctx[i] < dev ? ctx[i] : dev) +
                 REKV_PLAN_BLOCK_TOKENS - 1) /
                REKV_PLAN_BLOCK_TOKENS;
        else if (mi->store == REKV_STORE_PATTERN)
            a = b - (int64_t)llround((double)b * f_kv);
        req[i] = (rekv_mb_request){b - a, a};
        kv_tot += b - a, act_tot += a;
        kv_big = req[i].n_kv > kv_big ? req[i].n_kv : kv_big;
        act_big = req[i].n_act > act_big ? req[i].n_act : act_big;
    }
    int packed = 0;
    int64_t cap = co_plan_block_capacity(ps);
    if (req && assign && n >= 2) {
        int64_t kv_max = (kv_tot + 1) / 2 > kv_big ? (kv_tot + 1) / 2 : kv_big;
        int64_t act_max = (act_tot + 1) / 2 > act_big ? (act_tot + 1) / 2 : act_big;
        if (cap > 0) { /* the device's room, but never below one job's blocks */
            kv_max = kv_max < cap ? kv_max : cap > kv_big ? cap : kv_big;
            act_max = act_max < cap ? act_max : cap > act_big ? cap : act_big;
        }
        packed = rekv_plan_mb_pack(&prof, REKV_PLAN_BLOCK_TOKENS, REKV_MB_GREEDY_DELTA, req,
                                   (size_t)n, kv_max > 0 ? kv_max : 1, act_max > 0 ? act_max : 1,
                                   assign, &n_batches, NULL) == 0;
    }
    if (!packed || n_batches > 64)
        n_batches = 1;
    for (int i = 0; i < n && packed && n_batches > 1; i++) {
        mb_job[i] = jobs[i];
        mb_index[i] = (uint32_t)assign[i];
    }
    free(req);
    free(assign);
    /* the prediction this step will be measured against */
    sh.hybrid_kv_fraction = sum > 0 ? fmin(fmax(kv_tok / (double)sum, 0.0), 1.0) : f_step;
    double f_sel = co_plan_selected_fraction(ps);
    if (f_sel > 0)
        sh.infinigen_fraction = f_sel;
    sh.infinigen_split = ps->keeps_act ? -1 : 0; /* infinigen: its layer 0's split, chosen */
    /* clo is priced as infinigen is, with the fraction its misses fetched (hits fetch none) */
    rekv_technique tech = rekv_plan_mode_tech((rekv_mode)ps->mode);
    rekv_step_cost cost;
    if (rekv_plan_step_cost(&prof, &sh, tech, &cost, NULL) == 0) {
        if (tech == REKV_TECH_INFINIGEN)
            split = (int)cost.kvpr_l;
        ps->pred_pcie_s = cost.t_pcie * ps->n_layers;
        ps->pred_compute_s = cost.t_compute * ps->n_layers;
        ps->pred_step_s = cost.t_step * ps->n_layers;
    } else {
        ps->pred_pcie_s = ps->pred_compute_s = ps->pred_step_s = 0;
    }
    ps->split = split;
    ps->kv_parts = kv_parts;
    ps->act_parts = act_parts;
    ps->gpu_batches = (int)n_batches;
    ps->column = ps->offload_weights && n_batches > 1; /* weights once per layer for all batches */
    ps->steps++;
    ps->multi_batch_steps += n_batches > 1;
    rekv__worker__step_params__init(out);
    out->split = split;
    out->kv_parts = (uint32_t)kv_parts;
    out->act_parts = (uint32_t)act_parts;
    out->gpu_batches = (uint32_t)n_batches;
    out->column = ps->column;
    if (n_batches > 1) {
        out->n_mb_job = out->n_mb_index = (size_t)n;
        out->mb_job = mb_job;
        out->mb_index = mb_index;
    }
    return 1;
}

void co_plan_observe(co_plan_state *ps, const Rekv__Worker__Counters *c, const co_plan_pred *pred)
{
    ps->tokens_considered += c->tokens_considered;
    ps->tokens_selected += c->tokens_selected;
    if (!ps->have_profile)
        return;
    rekv_plan_scales_observe(&ps->scales, c->h2d_busy_s, pred->pcie_s, c->compute_busy_s,
                             pred->compute_s);
}

double co_plan_selected_fraction(const co_plan_state *ps)
{
    return ps->tokens_considered ? (double)ps->tokens_selected / (double)ps->tokens_considered
                                 : 0.0;
}
