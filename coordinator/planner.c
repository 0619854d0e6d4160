/* planner.c — the cost model and optimisers of planner.h: KVPR's split (papers/000 Eq. 6–12),
 * HybridServe's host allocation, request allocation rule and mini-batch packing (papers/003
 * Algorithm 1, Eq. 2–7), and the per-step technique chooser. Pure functions; see planner.h for the
 * decisions taken where the papers are vague. */
#include "coordinator/planner.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- profile */

static int check_profile(const rekv_cost_profile *prof, rekv_err *err)
{
    if (!prof)
        return rekv_errf(err, -EINVAL, "planner: NULL profile");
    if (!(prof->h2d_bw > 0) || !(prof->gemm_flops > 0) || !(prof->h2d_latency >= 0))
        return rekv_errf(err, -EINVAL,
                         "planner: profile needs h2d_bw > 0, gemm_flops > 0, h2d_latency >= 0");
    return 0;
}

/* One copy of bytes over the link: nothing when there is nothing to move. */
static double link_time(const rekv_cost_profile *prof, double bytes)
{
    return bytes > 0 ? bytes / prof->h2d_bw + prof->h2d_latency : 0.0;
}

/* The layer's forward pass for the step's new rows: its GEMMs at the rate for that many rows
 * (rekv_cost_fwd_rate_at), its attention at the attention kernel's measured rate where there is
 * one (on a cpu the scalar attention runs far below the GEMMs: pricing it as a GEMM predicted a
 * resident step 5-8x too fast). */
static double fwd_time(const rekv_cost_profile *prof, const rekv_kvpr_params *p)
{
    double attn = prof->attn_flops_rate > 0 ? fmin(fmax(p->attn_flops, 0.0), p->fwd_flops) : 0.0;
    return (p->fwd_flops - attn) / rekv_cost_fwd_rate_at(prof, (double)p->b) +
           (attn > 0 ? attn / prof->attn_flops_rate : 0.0);
}

/* ---------------------------------------------------------------- KVPR */

static int check_kvpr(const rekv_kvpr_params *p, rekv_err *err)
{
    if (!p)
        return rekv_errf(err, -EINVAL, "planner: kvpr: NULL params");
    if (p->s < 0 || p->b < 0 || p->hidden < 0 || p->kv_dim < 0 || !(p->elem_bytes > 0) ||
        !(p->fwd_flops >= 0) || !(p->weight_bytes >= 0))
        return rekv_errf(err, -EINVAL, "planner: kvpr: negative size or elem_bytes <= 0");
    return 0;
}

void rekv_plan_kvpr_eval(const rekv_cost_profile *prof, const rekv_kvpr_params *p, int64_t l,
                         rekv_kvpr_split *out)
{
    double b = (double)p->b, h = (double)p->hidden, kv = (double)p->kv_dim, pe = p->elem_bytes;
    out->l = l;
    out->bytes_x = b * (double)l * h * rekv_cost_act_elem_bytes(pe); /* Eq. 6 */
    out->bytes_kv = 2.0 * b * (double)(p->s - l) * kv * pe; /* Eq. 7, K and V rows of kv_dim */
    out->flops = 2.0 * b * (double)l * h * (2.0 * kv); /* Eq. 9: X[b*l, h] x W_KV[h, 2*kv_dim] */
    out->t_recomp = out->flops / prof->gemm_flops;     /* Eq. 10 */
    out->t_x = link_time(prof, out->bytes_x);
    out->t_kv = link_time(prof, out->bytes_kv);
    out->t_link = link_time(prof, p->weight_bytes) + out->t_x + out->t_kv;
    out->t_compute = fwd_time(prof, p) + out->t_recomp;
    out->t = fmax(out->t_link, out->t_compute); /* rekv's pipeline, not Eq. 11 (planner.h) */
}

/* Evaluates the candidates (any order, duplicates allowed) and keeps the smallest l whose t is
 * within a relative 1e-12 of the minimum: t(l) can be exactly flat in l (GQA with hidden ==
 * 2*kv_dim sends X as cheaply as the KV it replaces), and rounding must not pick an arbitrary
 * point of a flat stretch. */
static void kvpr_best(const rekv_cost_profile *prof, const rekv_kvpr_params *p, const int64_t *cand,
                      int n, rekv_kvpr_split *out)
{
    rekv_kvpr_split c[8];
    int m = 0;
    double tmin = INFINITY;
    for (int i = 0; i < n && m < 8; i++) {
        if (cand[i] < 0 || cand[i] > p->s)
            continue;
        rekv_plan_kvpr_eval(prof, p, cand[i], &c[m]);
        tmin = fmin(tmin, c[m].t);
        m++;
    }
    int best = -1;
    for (int i = 0; i < m; i++)
        if (c[i].t <= tmin * (1 + 1e-12) && (best < 0 || c[i].l < c[best].l))
            best = i;
    *out = c[best];
}

/* Inside (0, s) both copies and the weights' pay their latency, and t_link(l) = c_link +
 * (gamma - beta)*l, t_compute(l) = c_fwd + alpha*l (per token: alpha recompute, beta a K+V row,
 * gamma an X row on the link). Where the link time falls (beta > gamma: MHA, where an X row is half
 * a K+V row) t is smallest where the two cross; otherwise at l = 0. */
static double kvpr_kink(const rekv_cost_profile *prof, const rekv_kvpr_params *p)
{
    double b = (double)p->b;
    double alpha =
        4.0 * b * (double)p->hidden * (double)p->kv_dim / prof->gemm_flops;   /* s per token */
    double beta = 2.0 * b * (double)p->kv_dim * p->elem_bytes / prof->h2d_bw; /* s per token */
    double gamma = b * (double)p->hidden * rekv_cost_act_elem_bytes(p->elem_bytes) /
                   prof->h2d_bw; /* s per token */
    double c_link =
        link_time(prof, p->weight_bytes) + 2.0 * prof->h2d_latency + beta * (double)p->s;
    double c_fwd = fwd_time(prof, p);
    if (!(alpha + beta - gamma > 0))
        return 0.0;
    double ls = (c_link - c_fwd) / (alpha + beta - gamma);
    return fmin(fmax(ls, 0.0), (double)p->s);
}

int rekv_plan_kvpr_solve(const rekv_cost_profile *prof, const rekv_kvpr_params *p,
                         rekv_kvpr_split *out, rekv_err *err)
{
    int rc = check_profile(prof, err);
    if (rc == 0)
        rc = check_kvpr(p, err);
    if (rc)
        return rc;
    double ls = kvpr_kink(prof, p);
    int64_t lo = p->s >= 2 ? 1 : 0, hi = p->s >= 2 ? p->s - 1 : p->s;
    int64_t fl = (int64_t)floor(ls), cl = (int64_t)ceil(ls);
    fl = fl < lo ? lo : fl > hi ? hi : fl;
    cl = cl < lo ? lo : cl > hi ? hi : cl;
    int64_t cand[6] = {0, lo, fl, cl, hi, p->s};
    kvpr_best(prof, p, cand, 6, out);
    return 0;
}

int rekv_plan_kvpr_choose(const rekv_cost_profile *prof, const rekv_kvpr_params *p,
                          rekv_kvpr_split *out, rekv_err *err)
{
    rekv_kvpr_split best, c;
    int rc = rekv_plan_kvpr_solve(prof, p, &best, err);
    if (rc)
        return rc;
    double lim = best.t * (1 + REKV_PLAN_MARGIN);
    *out = best;
    rekv_plan_kvpr_eval(prof, p, 0, &c);
    if (c.t <= lim) {
        *out = c;
        return 0;
    }
    /* t is convex and piecewise linear on [1, s - 1] (planner.h), so non-increasing up to l*:
     * the smallest l in [1, l*] within the limit, by bisection */
    int64_t lo = 1, hi = best.l;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        rekv_plan_kvpr_eval(prof, p, mid, &c);
        if (c.t <= lim)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (hi < best.l)
        rekv_plan_kvpr_eval(prof, p, hi, out);
    return 0;
}

/* ---------------------------------------------------------------- HybridServe allocation */

/* "find #blocks s.t. T(#blocks) = target" (Algorithm 1 lines 15 and 17): the continuous solution of
 * the affine model, then the integer of {0, floor, ceil} (capped at max_blocks) with the smallest
 * |T - target|, ties to the smaller count. */
static int64_t hybrid_find_count(const rekv_linear *m, int bt, double target, int64_t max_blocks)
{
    if (!(target > 0) || max_blocks <= 0)
        return 0;
    double x = (target - m->a) / (m->b * bt);
    x = fmin(fmax(x, 0.0), (double)max_blocks);
    int64_t cand[3] = {0, (int64_t)floor(x), (int64_t)ceil(x)};
    int64_t best = 0;
    double best_d = INFINITY;
    for (int i = 0; i < 3; i++) {
        int64_t c = cand[i] > max_blocks ? max_blocks : cand[i];
        double d = fabs(rekv_linear_eval(m, (double)c * bt) - target);
        if (d < best_d || (d == best_d && c < best)) {
            best = c;
            best_d = d;
        }
    }
    return best;
}

/* The small integers kv_parts:act_parts (each <= max_parts) nearest to kv:act, compared exactly as
 * fractions of KV, ties to the smallest kv_parts + act_parts. */
static void hybrid_small_ratio(int64_t kv, int64_t act, int max_parts, int *kv_parts,
                               int *act_parts)
{
    *kv_parts = *act_parts = 0;
    if (kv + act <= 0)
        return;
    __int128 T = (__int128)kv + act;
    __int128 best_e = -1;
    int best_s = 0;
    for (int k = 0; k <= max_parts; k++) {
        for (int a = 0; a <= max_parts; a++) {
            int s = k + a;
            if (s == 0)
                continue;
            /* |k/s - kv/T| = |k*T - kv*s| / (s*T); compare e/s across candidates by
             * cross-multiplying. */
            __int128 e = (__int128)k * T - (__int128)kv * s;
            if (e < 0)
                e = -e;
            if (best_e < 0 || e * best_s < best_e * s || (e * best_s == best_e * s && s < best_s)) {
                best_e = e;
                best_s = s;
                *kv_parts = k;
                *act_parts = a;
            }
        }
    }
}

int rekv_plan_hybrid_alloc(const rekv_cost_profile *prof, const rekv_hybrid_params *p,
                           rekv_hybrid_alloc *out, rekv_err *err)
{
    if (!prof || !p || !out)
        return rekv_errf(err, -EINVAL, "planner: hybrid: NULL argument");
    if (!(prof->load_kv.b > 0) || !(prof->kv_gen.b > 0) || !(prof->t_load_w >= 0) ||
        !isfinite(prof->load_kv.a) || !isfinite(prof->kv_gen.a))
        return rekv_errf(err, -EINVAL,
                         "planner: hybrid: time models need positive slopes, t_load_w >= 0");
    if (p->n_layers < 1 || !(p->kv_block_bytes > 0) || !(p->act_block_bytes > 0) ||
        p->act_gpu_blocks < 0 || p->block_tokens < 1 || p->max_parts < 0 ||
        !(p->weight_bytes >= 0) || !(p->host_bytes >= 0))
        return rekv_errf(err, -EINVAL, "planner: hybrid: bad parameters");
    double cache = p->host_bytes - p->weight_bytes;
    if (cache < 0)
        return rekv_errf(err, -ENOSPC,
                         "planner: hybrid: weights (%.0f bytes) exceed host memory (%.0f bytes)",
                         p->weight_bytes, p->host_bytes);
    int bt = p->block_tokens;
    /* host bytes of one block in every layer: what one more per-layer block count costs */
    double col_act = (double)p->n_layers * p->act_block_bytes;
    double col_kv = (double)p->n_layers * p->kv_block_bytes;
    *out = (rekv_hybrid_alloc){0};

    /* Step 1, init_cache_alloc (lines 11–18), capped at what host memory holds. */
    double t_budget =
        prof->t_load_w - rekv_linear_eval(&prof->kv_gen, (double)p->act_gpu_blocks * bt);
    if (t_budget >= 0)
        out->act_init =
            hybrid_find_count(&prof->kv_gen, bt, t_budget, (int64_t)floor(cache / col_act));
    else
        out->kv_init =
            hybrid_find_count(&prof->load_kv, bt, -t_budget, (int64_t)floor(cache / col_kv));

    /* Step 2, alloc_remain (lines 20–26): col_act*x + col_kv*y = M_remaining and
     * a_gen + d*x = a_load + e*y (d, e per block), solved for y by substituting x. */
    double m_rem = cache - col_act * (double)out->act_init - col_kv * (double)out->kv_init;
    if (m_rem < 0)
        m_rem = 0; /* cannot happen given the caps; guards rounding */
    double d = prof->kv_gen.b * bt, e = prof->load_kv.b * bt;
    double y =
        (d * m_rem / col_act - (prof->load_kv.a - prof->kv_gen.a)) / (d * col_kv / col_act + e);
    double y_max = floor(m_rem / col_kv);
    y = fmin(fmax(y, 0.0), y_max);
    double best_d = INFINITY;
    for (int i = 0; i < 2; i++) {
        double yc = i == 0 ? floor(y) : ceil(y);
        if (yc > y_max)
            continue;
        double xc = floor((m_rem - col_kv * yc) / col_act);
        if (xc < 0)
            xc = 0;
        double dd = fabs(rekv_linear_eval(&prof->kv_gen, xc * bt) -
                         rekv_linear_eval(&prof->load_kv, yc * bt));
        if (dd < best_d) { /* i == 0 first: ties keep fewer KV blocks */
            best_d = dd;
            out->act_remain = (int64_t)xc;
            out->kv_remain = (int64_t)yc;
        }
    }

    out->act_host = out->act_init + out->act_remain;
    out->kv_host = out->kv_init + out->kv_remain;
    int64_t tot = out->act_host + out->kv_host;
    out->kv_fraction = tot > 0 ? (double)out->kv_host / (double)tot : 0.0;
    hybrid_small_ratio(out->kv_host, out->act_host, p->max_parts ? p->max_parts : 8, &out->kv_parts,
                       &out->act_parts);
    out->bytes_used =
        p->weight_bytes + col_act * (double)out->act_host + col_kv * (double)out->kv_host;
    out->t_pcie =
        prof->t_load_w + rekv_linear_eval(&prof->load_kv, (double)out->kv_host * bt); /* Eq. 2 */
    out->t_compute = rekv_linear_eval(&prof->kv_gen,
                                      (double)(out->act_host + p->act_gpu_blocks) * bt); /* Eq. 3 */
    return 0;
}

/* ---------------------------------------------------------------- mini-batch formation */

double rekv_plan_mb_fb(const rekv_cost_profile *prof, int block_tokens, int64_t n_act, int64_t n_kv)
{
    double g =
        rekv_linear_eval(&prof->kv_gen, (double)n_act * block_tokens); /* T_kv_gen(#ACT_mb) */
    double l =
        rekv_linear_eval(&prof->load_kv, (double)n_kv * block_tokens); /* T_load_kv(#KV_mb) */
    if (g <= 0 && l <= 0)
        return 1.0;
    if (g <= 0 || l <= 0)
        return INFINITY;
    double bal = g / l;          /* Eq. 6 */
    return fmax(bal, 1.0 / bal); /* Eq. 7 */
}

/* How much worse F_b gets by the move before -> after (negative: better); inf - inf counts as no
 * change. */
static double fb_delta(double before, double after)
{
    if (isinf(before) && isinf(after))
        return 0.0;
    return after - before;
}

int rekv_plan_mb_pack(const rekv_cost_profile *prof, int block_tokens, rekv_mb_policy policy,
                      const rekv_mb_request *reqs, size_t n, int64_t kv_max, int64_t act_max,
                      int *assign, size_t *n_batches, rekv_err *err)
{
    if (!prof || (n && (!reqs || !assign)) || !n_batches || block_tokens < 1 || kv_max < 0 ||
        act_max < 0 || policy < REKV_MB_GREEDY_DELTA || policy > REKV_MB_FIRST_FIT)
        return rekv_errf(err, -EINVAL, "planner: mb_pack: bad arguments");
    for (size_t i = 0; i < n; i++)
        if (reqs[i].n_kv < 0 || reqs[i].n_act < 0 || reqs[i].n_kv > kv_max ||
            reqs[i].n_act > act_max)
            return rekv_errf(
                err, -EINVAL,
                "planner: mb_pack: request %zu (%lld KV, %lld ACT blocks) exceeds a mini-batch "
                "(%lld KV, %lld ACT)",
                i, (long long)reqs[i].n_kv, (long long)reqs[i].n_act, (long long)kv_max,
                (long long)act_max);
    *n_batches = 0;
    if (n == 0)
        return 0;
    int64_t *kv = calloc(n, sizeof *kv), *act = calloc(n, sizeof *act); /* per mini-batch totals */
    if (!kv || !act) {
        free(kv);
        free(act);
        return rekv_errf(err, -ENOMEM, "planner: mb_pack: out of memory for %zu requests", n);
    }
    size_t nb = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pick = nb;
        double best = INFINITY;
        for (size_t j = 0; j < nb; j++) {
            if (kv[j] + reqs[i].n_kv > kv_max || act[j] + reqs[i].n_act > act_max)
                continue;
            if (policy == REKV_MB_FIRST_FIT) {
                pick = j;
                break;
            }
            double after =
                rekv_plan_mb_fb(prof, block_tokens, act[j] + reqs[i].n_act, kv[j] + reqs[i].n_kv);
            double score =
                policy == REKV_MB_GREEDY_MIN_AFTER
                    ? after
                    : fb_delta(rekv_plan_mb_fb(prof, block_tokens, act[j], kv[j]), after);
            if (pick == nb || score < best) {
                pick = j;
                best = score;
            }
        }
        if (pick == nb)
            nb++; /* fits nowhere: open a new mini-batch */
        kv[pick] += reqs[i].n_kv;
        act[pick] += reqs[i].n_act;
        assign[i] = (int)pick;
    }
    free(kv);
    free(act);
    *n_batches = nb;
    return 0;
}

double rekv_plan_mb_mean_fb(const rekv_cost_profile *prof, int block_tokens,
                            const rekv_mb_request *reqs, size_t n, const int *assign,
                            size_t n_batches)
{
    if (n_batches == 0)
        return 1.0;
    double sum = 0;
    /* O(n * n_batches) without scratch memory, so this cannot fail; planner sizes are small. */
    for (size_t j = 0; j < n_batches; j++) {
        int64_t kv = 0, act = 0;
        for (size_t i = 0; i < n; i++)
            if (assign[i] == (int)j) {
                kv += reqs[i].n_kv;
                act += reqs[i].n_act;
            }
        sum += rekv_plan_mb_fb(prof, block_tokens, act, kv);
    }
    return sum / (double)n_batches;
}

/* ---------------------------------------------------------------- chooser */

/* The cost of one step's link and compute sides from its bytes and FLOP. */
static void step_times(const rekv_cost_profile *prof, const rekv_kvpr_params *p, double x_bytes,
                       double kv_bytes, double recomp, double spec, rekv_step_cost *out)
{
    out->bytes_h2d = p->weight_bytes + x_bytes + kv_bytes;
    out->recompute_flops = recomp;
    out->speculate_flops = spec;
    out->t_pcie =
        link_time(prof, p->weight_bytes) + link_time(prof, x_bytes) + link_time(prof, kv_bytes);
    /* the forward pass and the speculation's GEMV over the batch's rows at the decode rate, the
     * recomputation over batch x context rows at the GEMM rate */
    out->t_compute = fwd_time(prof, p) + spec / rekv_cost_fwd_rate_at(prof, (double)p->b) +
                     recomp / prof->gemm_flops;
    out->t_step = fmax(out->t_pcie, out->t_compute);
}

/* InfiniGen's mean layer (planner.h): layer 0, fetched whole, priced as KVPR at split l of the
 * moved context p (l = 0: all KV), each of the other n_layers - 1 fetching f of it and paying the
 * speculation; the step is the layers one after another, so t_step is the mean of each layer's
 * max(link, compute) and t_pcie, t_compute the means of its sides. */
static void infinigen_at(const rekv_cost_profile *prof, const rekv_step_shape *shape,
                         const rekv_kvpr_params *p, int64_t l, rekv_step_cost *out)
{
    double f = shape->infinigen_fraction, n = shape->n_layers, b = (double)p->b;
    double rq = REKV_PLAN_INFINIGEN_PARTIAL * (double)shape->q_dim; /* partial query width */
    rekv_kvpr_split k0;
    rekv_plan_kvpr_eval(prof, p, l, &k0);
    double kv = f * b * (double)p->s * 2.0 * (double)p->kv_dim * p->elem_bytes;
    /* the speculation scores the whole context, the device part's tokens too */
    double spec = 2.0 * rq * (b * (double)p->hidden + b * (double)shape->kv.s);
    rekv_step_cost sel;
    step_times(prof, p, 0, kv, 0, spec, &sel);
    *out = (rekv_step_cost){
        .t_pcie = (k0.t_link + (n - 1) * sel.t_pcie) / n,
        .t_compute = (k0.t_compute + (n - 1) * sel.t_compute) / n,
        .t_step = (k0.t + (n - 1) * sel.t_step) / n,
        .bytes_h2d = (p->weight_bytes + k0.bytes_x + k0.bytes_kv + (n - 1) * sel.bytes_h2d) / n,
        .recompute_flops = k0.flops / n,
        .speculate_flops = (n - 1) / n * spec,
        .kvpr_l = l,
    };
}

int rekv_plan_step_cost(const rekv_cost_profile *prof, const rekv_step_shape *shape,
                        rekv_technique tech, rekv_step_cost *out, rekv_err *err)
{
    int rc = check_profile(prof, err);
    if (rc)
        return rc;
    if (!shape || !out)
        return rekv_errf(err, -EINVAL, "planner: step_cost: NULL argument");
    if ((rc = check_kvpr(&shape->kv, err)))
        return rc;
    if (!(shape->hybrid_kv_fraction >= 0) || !(shape->hybrid_kv_fraction <= 1) ||
        shape->act_gpu_tokens < 0 || shape->device_tokens < 0)
        return rekv_errf(err, -EINVAL, "planner: step_cost: bad step shape");
    /* every technique moves (or recomputes, or selects among) only what the device does not
     * keep */
    rekv_kvpr_params moved = shape->kv;
    int64_t dev = shape->device_tokens < moved.s ? shape->device_tokens : moved.s;
    moved.s -= dev;
    const rekv_kvpr_params *p = &moved;
    double tokens = (double)p->b * (double)p->s;             /* context tokens of the batch */
    double x_row = (double)p->hidden * rekv_cost_act_elem_bytes(p->elem_bytes); /* one X */
    double kv_row = 2.0 * (double)p->kv_dim * p->elem_bytes; /* bytes of one token's K and V */
    double flops_tok = 4.0 * (double)p->hidden * (double)p->kv_dim; /* Eq. 9 per token */
    double x_bytes = 0, kv_bytes = 0, recomp = 0, spec = 0, rebuilt = 0; /* tokens recomputed */
    *out = (rekv_step_cost){.kvpr_l = -1};

    switch (tech) {
    case REKV_TECH_KV:
        kv_bytes = tokens * kv_row;
        break;
    case REKV_TECH_KVPR: { /* the split this very step would run */
        rekv_kvpr_split sp;
        if ((rc = rekv_plan_kvpr_choose(prof, p, &sp, err)))
            return rc;
        x_bytes = sp.bytes_x;
        kv_bytes = sp.bytes_kv;
        recomp = sp.flops;
        out->kvpr_l = dev + sp.l;
        break;
    }
    case REKV_TECH_ACT:
        x_bytes = tokens * x_row;
        rebuilt = tokens;
        recomp = rebuilt * flops_tok;
        break;
    case REKV_TECH_HYBRID: {
        double gpu = fmin((double)shape->act_gpu_tokens, tokens);
        double host = tokens - gpu;
        double kv_tok = round(shape->hybrid_kv_fraction * host);
        x_bytes = (host - kv_tok) * x_row;
        kv_bytes = kv_tok * kv_row;
        rebuilt = host - kv_tok + gpu;
        recomp = rebuilt * flops_tok;
        break;
    }
    case REKV_TECH_INFINIGEN: { /* the mean layer: layer 0 fetches all, the others f (planner.h) */
        double f = shape->infinigen_fraction;
        if (!(f >= 0) || !(f <= 1) || shape->n_layers < 1 || shape->q_dim < 0)
            return rekv_errf(err, -EINVAL, "planner: step_cost: bad infinigen shape");
        /* layer 0's split: KVPR's for that layer alone, as the other layers do not depend on it */
        int64_t l = shape->infinigen_split - dev;
        if (shape->infinigen_split < 0) {
            rekv_kvpr_split sp;
            if ((rc = rekv_plan_kvpr_choose(prof, p, &sp, err)))
                return rc;
            l = sp.l;
        }
        infinigen_at(prof, shape, p, l < 0 ? 0 : l > p->s ? p->s : l, out);
        out->kvpr_l = out->kvpr_l > 0 ? dev + out->kvpr_l : 0;
        return 0;
    }
    default:
        return rekv_errf(err, -EINVAL, "planner: step_cost: unknown technique %d", (int)tech);
    }
    step_times(prof, p, x_bytes, kv_bytes, recomp, spec, out);
    /* act's and hybrid's recomputed tokens: all of them must fit the device's buffers */
    if (shape->act_room_fraction > 0 && rebuilt > (shape->act_room_fraction + 1e-9) * tokens)
        out->t_step = INFINITY;
    return 0;
}

int rekv_plan_choose(const rekv_cost_profile *prof, const rekv_step_shape *shape,
                     rekv_technique *best, rekv_step_cost *costs, rekv_err *err)
{
    if (!best)
        return rekv_errf(err, -EINVAL, "planner: choose: NULL argument");
    rekv_step_cost local[REKV_TECH_COUNT];
    rekv_step_cost *c = costs ? costs : local;
    for (int t = 0; t < REKV_TECH_COUNT; t++) {
        int rc = rekv_plan_step_cost(prof, shape, (rekv_technique)t, &c[t], err);
        if (rc)
            return rc;
    }
    /* ties to fewer moving parts: KV alone, ACT alone (KVPR at l = s moves what ACT does but
     * stores both), KVPR, hybrid */
    static const rekv_technique pref[REKV_TECH_COUNT] = {REKV_TECH_KV, REKV_TECH_ACT,
                                                         REKV_TECH_KVPR, REKV_TECH_HYBRID};
    rekv_technique b = pref[0];
    for (int i = 1; i < REKV_TECH_COUNT; i++)
        if (c[pref[i]].t_step < c[b].t_step)
            b = pref[i];
    *best = b;
    return 0;
}

/* ---------------------------------------------------------------- online correction */

void rekv_plan_scaled_profile(const rekv_cost_profile *p, const rekv_plan_scales *s,
                              rekv_cost_profile *out)
{
    *out = *p;
    out->h2d_bw /= s->pcie;
    out->h2d_latency *= s->pcie;
    out->load_kv.a *= s->pcie;
    out->load_kv.b *= s->pcie;
    out->t_load_w *= s->pcie;
    out->gemm_flops /= s->compute;
    out->fwd_flops_rate /= s->compute;
    out->fwd_gemm.a *= s->compute;
    out->fwd_gemm.b *= s->compute;
    out->attn_flops_rate /= s->compute;
    out->attn_chunk_flops_rate /= s->compute;
    out->kv_gen.a *= s->compute;
    out->kv_gen.b *= s->compute;
}

static double rescale(double scale, double measured, double predicted)
{
    if (!(predicted > 1e-6) || !(measured > 0))
        return scale;
    double r = measured / (predicted / scale); /* against the unscaled prediction */
    r = r < 0.01 ? 0.01 : r > 100 ? 100 : r;
    return (1 - REKV_PLAN_SMOOTH) * scale + REKV_PLAN_SMOOTH * r;
}

void rekv_plan_scales_observe(rekv_plan_scales *s, double pcie_busy_s, double pcie_pred_s,
                              double compute_busy_s, double compute_pred_s)
{
    s->pcie = rescale(s->pcie, pcie_busy_s, pcie_pred_s);
    s->compute = rescale(s->compute, compute_busy_s, compute_pred_s);
}

/* ---------------------------------------------------------------- hybrid's pattern */

static int gcd_int(int a, int b)
{
    while (b) {
        int t = a % b;
        a = b;
        b = t;
    }
    return a;
}

int rekv_plan_hybrid_pattern(const rekv_cost_profile *prof, const rekv_step_shape *shape,
                             int max_parts, int *kv_parts, int *act_parts, rekv_step_cost *cost,
                             rekv_err *err)
{
    if (!shape || !kv_parts || !act_parts || max_parts < 0)
        return rekv_errf(err, -EINVAL, "planner: hybrid pattern: bad arguments");
    int maxp = max_parts ? max_parts : 8, bk = 1, ba = 0;
    rekv_step_cost best = {0}, c;
    double t_min = INFINITY, best_f = -1;
    /* the fastest, then the largest KV share priced within the margin of it */
    for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k <= maxp; k++)
            for (int a = 0; a <= maxp; a++) {
                if (gcd_int(k, a) != 1) /* lowest terms; gcd(k, 0) = k keeps 1:0, 0:1 only */
                    continue;
                rekv_step_shape sh = *shape;
                sh.hybrid_kv_fraction = (double)k / (k + a);
                int rc = rekv_plan_step_cost(prof, &sh, REKV_TECH_HYBRID, &c, err);
                if (rc)
                    return rc;
                double f = sh.hybrid_kv_fraction;
                if (pass == 0) {
                    t_min = fmin(t_min, c.t_step);
                } else if (c.t_step <= t_min * (1 + REKV_PLAN_MARGIN) && f > best_f) {
                    best = c, best_f = f, bk = k, ba = a;
                }
            }
    *kv_parts = bk;
    *act_parts = ba;
    if (cost)
        *cost = best;
    return 0;
}

void rekv_plan_model_from_config(const rekv_model_config *cfg, rekv_plan_model *out)
{
    *out = (rekv_plan_model){
        .hidden = cfg->hidden,
        .q_dim = rekv_config_q_dim(cfg),
        .kv_dim = rekv_config_kv_dim(cfg),
        .n_layers = cfg->n_layers,
        .layer_params = rekv_config_layer_params(cfg),
        .weight_elem_bytes = rekv_config_weight_elem_bytes(cfg),
    };
    int window;
    out->windowed_layers = rekv_config_windowed_layers(cfg, &window);
    out->window = window;
}

void rekv_plan_shape(const rekv_plan_model *m, int64_t b, int64_t s, double cache_elem_bytes,
                     int weights_offloaded, rekv_step_shape *out)
{
    double q = (double)m->q_dim, params = m->layer_params;
    *out = (rekv_step_shape){0};
    if (m->window > 0 && m->windowed_layers > 0 && m->n_layers > 0) {
        /* the mean layer's context: a windowed layer fetches (and attends) only the blocks of
         * its window (pipeline_kvstore.c, pl_window_lo) */
        int64_t w = s < m->window + 15 ? s : m->window + 15, nw = m->windowed_layers;
        s = (nw * w + (m->n_layers - nw) * s + m->n_layers / 2) / m->n_layers;
    }
    out->kv = (rekv_kvpr_params){
        .s = s, .b = b, .hidden = m->hidden, .kv_dim = m->kv_dim, .elem_bytes = cache_elem_bytes};
    out->kv.weight_bytes = weights_offloaded ? params * m->weight_elem_bytes : 0.0;
    out->infinigen_fraction = REKV_PLAN_INFINIGEN_PRIOR;
    out->n_layers = m->n_layers;
    out->q_dim = m->q_dim;
    /* one new token per sequence: 2 FLOP per weight, plus Q.K^T and P.V over s cached tokens */
    out->kv.attn_flops = 4.0 * (double)b * (double)s * q;
    out->kv.fwd_flops = 2.0 * (double)b * params + out->kv.attn_flops;
}

void rekv_plan_hybrid_params_for_batch(rekv_hybrid_params *hp, int64_t hidden, int64_t kv_dim,
                                       int n_layers, double elem_bytes, double layer_weight_bytes,
                                       double blocks)
{
    memset(hp, 0, sizeof(*hp));
    hp->kv_block_bytes = 2.0 * (double)kv_dim * elem_bytes * REKV_PLAN_BLOCK_TOKENS;
    hp->act_block_bytes =
        (double)hidden * rekv_cost_act_elem_bytes(elem_bytes) * REKV_PLAN_BLOCK_TOKENS;
    hp->n_layers = n_layers;
    hp->weight_bytes = layer_weight_bytes * n_layers;
    hp->host_bytes = hp->weight_bytes + blocks * hp->kv_block_bytes * n_layers;
    hp->block_tokens = REKV_PLAN_BLOCK_TOKENS;
}

int rekv_plan_pick_mode(const rekv_cost_profile *prof, const rekv_plan_model *m, int64_t b,
                        int64_t s_max, double cache_elem_bytes, double device_kv_bytes,
                        int weights_offloaded, const rekv_plan_approx *approx, rekv_mode_pick *out,
                        rekv_err *err)
{
    if (!prof || !m || !out || b < 1 || s_max < 1 || !(cache_elem_bytes > 0))
        return rekv_errf(err, -EINVAL, "planner: pick_mode: bad arguments");
    memset(out, 0, sizeof(*out));
    out->kv_bytes =
        2.0 * (double)m->kv_dim * cache_elem_bytes * (double)b * (double)s_max * m->n_layers;
    if (device_kv_bytes < 0 || out->kv_bytes <= device_kv_bytes) {
        out->resident = 1;
        return 0;
    }
    rekv_step_shape shape;
    rekv_plan_shape(m, b, s_max / 2 > 0 ? s_max / 2 : 1, cache_elem_bytes, weights_offloaded,
                    &shape);
    shape.device_tokens = out->device_tokens = rekv_plan_device_tokens(
        m, 0, REKV_MODE_OFFLOAD, b, s_max, cache_elem_bytes, device_kv_bytes, -1);
    /* act and hybrid as far as the device holds their recomputation; hybrid at the pattern it
     * would run */
    shape.act_room_fraction = rekv_plan_act_room_fraction(m, b, s_max, shape.device_tokens,
                                                          cache_elem_bytes, device_kv_bytes);
    int kvp, actp, rc;
    if ((rc = rekv_plan_hybrid_pattern(prof, &shape, 0, &kvp, &actp, NULL, err)))
        return rc;
    out->hybrid_kv_parts = kvp, out->hybrid_act_parts = actp;
    out->hybrid_kv_fraction = shape.hybrid_kv_fraction = (double)kvp / (kvp + actp);
    /* a windowed model: not infinigen where it cannot honour the window (pipeline_create.c) */
    if ((rc = rekv_plan_choose(prof, &shape, &out->tech, out->costs, err)) || !approx ||
        (m->window > 0 && rekv_mode_info_of(REKV_MODE_INFINIGEN)->selects))
        return rc;
    /* approximate modes allowed: infinigen, at the measured f (else the prior), must be strictly
     * cheaper than the best exact technique, and its partial keys must fit on the device */
    double fi = approx->infinigen_fraction;
    shape.infinigen_fraction = !(fi > 0) ? REKV_PLAN_INFINIGEN_PRIOR : fi > 1 ? 1 : fi;
    shape.infinigen_split = approx->infinigen_recompute ? -1 : 0;
    out->infinigen_fraction = shape.infinigen_fraction;
    /* its partial keys first (fp32, rk = 0.3 head_dim columns of every K row) and a step's
     * attention buffers (both parities, the whole context: layer 0 fetches it whole), then a
     * device part in the room the keys leave (the streaming modes' rule, whose buffers cover the
     * recomputation too), which it attends whole and selects past */
    double pk_bytes = REKV_PLAN_INFINIGEN_PARTIAL * (double)m->kv_dim * 4.0 * (double)b *
                      (double)s_max * m->n_layers;
    double att_tok = 4.0 * (double)m->kv_dim * cache_elem_bytes;
    double rec_tok =
        rekv_cost_stream_token_bytes((double)m->hidden, (double)m->kv_dim, cache_elem_bytes) -
        att_tok; /* a recomputed token's rows: activation staging, fp32 input, K and V */
    double left = device_kv_bytes - pk_bytes - (double)b * (double)s_max * att_tok;
    out->infinigen_fits = left >= 0;
    int64_t ig_dev = rekv_cost_device_tokens_of(
        device_kv_bytes - pk_bytes, (double)b, s_max > INT32_MAX ? INT32_MAX : (int)s_max,
        (double)m->hidden, (double)m->kv_dim, m->n_layers, cache_elem_bytes);
    shape.device_tokens = ig_dev;
    rekv_step_cost *ig = &out->costs[REKV_TECH_INFINIGEN];
    if ((rc = rekv_plan_step_cost(prof, &shape, REKV_TECH_INFINIGEN, ig, err)))
        return rc;
    /* layer 0's split recomputes no more tokens than the room left holds the rows of */
    int64_t cap = left > 0 ? (int64_t)fmin(left / ((double)b * rec_tok), (double)s_max) : 0;
    if (ig->kvpr_l - ig_dev > cap) {
        shape.infinigen_split = cap > 0 ? ig_dev + cap : 0;
        if ((rc = rekv_plan_step_cost(prof, &shape, REKV_TECH_INFINIGEN, ig, err)))
            return rc;
    }
    out->approximate = 1;
    if (out->infinigen_fits && ig->t_step < out->costs[out->tech].t_step) {
        out->tech = REKV_TECH_INFINIGEN;
        out->device_tokens = ig_dev;
    }
    return 0;
}

double rekv_plan_act_room_fraction(const rekv_plan_model *m, int64_t b, int64_t s_max,
                                   int64_t device_tokens, double elem, double room)
{
    if (!(room > 0) || b < 1 || s_max <= device_tokens || !(elem > 0))
        return 0;
    double att = 4.0 * (double)m->kv_dim * elem; /* K and V, both parities */
    double rec = rekv_cost_stream_token_bytes((double)m->hidden, (double)m->kv_dim, elem) - att;
    double dev = 2.0 * (double)m->kv_dim * elem * m->n_layers * (double)device_tokens;
    double rows = (room - (double)b * ((double)s_max * att + dev)) / rec;
    double share = rows / ((double)b * (double)(s_max - device_tokens));
    if (share >= 1)
        return 0;
    share *= 7.0 / 8.0;
    return share > 1e-9 ? share : 1e-9;
}

/* ---------------------------------------------------------------- what a worker is built with */

double rekv_plan_ig_partial_key_bytes(const rekv_plan_model *m, int64_t head_dim, int64_t tokens)
{
    int64_t hd = head_dim > 0 ? head_dim : m->kv_dim;
    if (hd <= 0 || tokens <= 0)
        return 0;
    int rk = rekv_cost_partial_cols(REKV_PLAN_INFINIGEN_PARTIAL, (int)hd);
    return 4.0 * (double)m->n_layers * (double)tokens * (double)(m->kv_dim / hd) * rk;
}

/* Which modes keep a device part (the property device_part) and which partial keys beside it
 * (speculates). */
int64_t rekv_plan_device_tokens(const rekv_plan_model *m, int64_t head_dim, rekv_mode mode,
                                int64_t b, int64_t s_max, double cache_elem_bytes,
                                double device_kv_bytes, int64_t asked)
{
    const rekv_mode_info *mi = rekv_mode_info_of(mode);
    if (mi == NULL || !mi->device_part)
        return 0;
    if (asked >= 0)
        return asked;
    if (b < 1 || s_max < 1)
        return 0;
    double room = device_kv_bytes;
    if (mi->speculates) /* its partial keys come first in the room */
        room -= (double)b * rekv_plan_ig_partial_key_bytes(m, head_dim, s_max);
    return rekv_cost_device_tokens_of(room, (double)b, s_max > INT32_MAX ? INT32_MAX : (int)s_max,
                                      (double)m->hidden, (double)m->kv_dim, m->n_layers,
                                      cache_elem_bytes);
}

double rekv_plan_persist_np(const rekv_cost_profile *prof, const rekv_plan_model *m,
                            int64_t head_dim, int64_t batch, int64_t ctx, double fetch_cap,
                            double cache_elem_bytes)
{
    double gemm = 2 * (double)batch * m->layer_params;
    double attn = 4 * (double)batch * (double)ctx * (double)m->q_dim; /* QK^T, PV */
    double rate = rekv_cost_fwd_rate_at(prof, (double)batch);
    double attn_rate = prof->attn_flops_rate > 0 ? prof->attn_flops_rate : rate;
    double head_bytes =
        (double)batch * ceil(fetch_cap * (double)ctx) * 2 * (double)head_dim * cache_elem_bytes;
    if (!(prof->h2d_bw > 0) || !(rate > 0) || !(head_bytes > 0))
        return INFINITY;
    return (gemm / rate + attn / attn_rate) * prof->h2d_bw / head_bytes;
}

rekv_mode rekv_plan_tech_mode(rekv_technique tech)
{
    static const rekv_mode by_tech[REKV_TECH_INFINIGEN + 1] = {
        REKV_MODE_OFFLOAD, REKV_MODE_KVPR, REKV_MODE_ACT, REKV_MODE_HYBRID, REKV_MODE_INFINIGEN};
    return tech >= 0 && tech <= REKV_TECH_INFINIGEN ? by_tech[tech] : REKV_MODE_OFFLOAD;
}

rekv_technique rekv_plan_mode_tech(rekv_mode m)
{
    static const rekv_technique by_mode[REKV_MODE_COUNT] = {
        [REKV_MODE_RESIDENT] = REKV_TECH_KV,   [REKV_MODE_OFFLOAD] = REKV_TECH_KV,
        [REKV_MODE_KVPR] = REKV_TECH_KVPR,     [REKV_MODE_ACT] = REKV_TECH_ACT,
        [REKV_MODE_HYBRID] = REKV_TECH_HYBRID, [REKV_MODE_INFINIGEN] = REKV_TECH_INFINIGEN,
        [REKV_MODE_CLO] = REKV_TECH_INFINIGEN,
    };
    return (unsigned)m < REKV_MODE_COUNT ? by_mode[m] : REKV_TECH_KV;
}

/* ---------------------------------------------------------------- hybrid pattern under demand */

double rekv_plan_hybrid_job_bytes(int64_t blocks, int kv_parts, int act_parts, int n_layers,
                                  double kv_block_bytes, double act_block_bytes)
{
    if (blocks <= 0)
        return 0;
    int64_t lo = blocks, hi = blocks; /* 0:0 is all KV, as the store has it */
    if (kv_parts + act_parts > 0) {
        __int128 num = (__int128)blocks * kv_parts, den = kv_parts + act_parts;
        lo = (int64_t)(num / den);
        hi = (int64_t)((num + den - 1) / den);
    }
    double a = (double)lo * kv_block_bytes + (double)(blocks - lo) * act_block_bytes;
    double b = (double)hi * kv_block_bytes + (double)(blocks - hi) * act_block_bytes;
    return (double)n_layers * fmax(a, b);
}

static int64_t blocks_of(int64_t tokens)
{
    return (tokens + REKV_PLAN_BLOCK_TOKENS - 1) / REKV_PLAN_BLOCK_TOKENS;
}

/* The waiting sequences admitted at kv:act, a prefix of the queue; what the rule prices. */
static size_t demand_admits(const rekv_hybrid_demand *d, int kv, int act)
{
    double used = 0;
    size_t n = 0;
    for (; n < d->n_waiting; n++) {
        used +=
            rekv_plan_hybrid_job_bytes(blocks_of(d->waiting[n].full_tokens), kv, act,
                                       d->model.n_layers, d->kv_block_bytes, d->act_block_bytes);
        if (used > d->room_bytes)
            break;
    }
    return n;
}

/* One layer of a decode step of the running sequences and the first n_join waiting ones made at
 * KV share f: batch, mean context, token-weighted KV share. */
static int demand_step(const rekv_cost_profile *prof, const rekv_hybrid_demand *d, size_t n_join,
                       double f, double *t_step, rekv_err *err)
{
    double tokens = 0, kv_tokens = 0;
    for (size_t i = 0; i < d->n_running; i++) {
        tokens += (double)d->running[i].tokens;
        kv_tokens += d->running[i].kv_fraction * (double)d->running[i].tokens;
    }
    for (size_t i = 0; i < n_join; i++) {
        tokens += (double)d->waiting[i].tokens;
        kv_tokens += f * (double)d->waiting[i].tokens;
    }
    int64_t b = (int64_t)(d->n_running + n_join);
    *t_step = 0;
    if (b == 0)
        return 0;
    int64_t s = (int64_t)llround(tokens / (double)b);
    rekv_step_shape sh;
    rekv_plan_shape(&d->model, b, s > 0 ? s : 1, d->cache_elem_bytes, 0, &sh);
    sh.kv.weight_bytes = d->layer_weight_bytes;
    sh.device_tokens = d->device_tokens;
    sh.hybrid_kv_fraction = tokens > 0 ? fmin(fmax(kv_tokens / tokens, 0.0), 1.0) : 1.0;
    rekv_step_cost c;
    int rc = rekv_plan_step_cost(prof, &sh, REKV_TECH_HYBRID, &c, err);
    if (rc == 0)
        *t_step = c.t_step;
    return rc;
}

/* The choice at kv:act: admitted, step time, throughput. */
static int demand_eval(const rekv_cost_profile *prof, const rekv_hybrid_demand *d, int kv, int act,
                       rekv_hybrid_choice *c, rekv_err *err)
{
    *c = (rekv_hybrid_choice){.kv_parts = kv, .act_parts = act};
    c->n_join = demand_admits(d, kv, act);
    int rc = demand_step(prof, d, c->n_join, (double)kv / (kv + act), &c->t_step, err);
    if (rc == 0 && c->t_step > 0)
        c->throughput =
            (double)(d->n_running + c->n_join) / ((double)d->model.n_layers * c->t_step);
    return rc;
}

int rekv_plan_hybrid_demand(const rekv_cost_profile *prof, const rekv_hybrid_demand *d,
                            rekv_hybrid_choice *out, rekv_err *err)
{
    if (!prof || !d || !out || (d->n_running && !d->running) || (d->n_waiting && !d->waiting))
        return rekv_errf(err, -EINVAL, "planner: hybrid demand: NULL argument");
    if (d->kv_parts < 0 || d->act_parts < 0 || d->kv_parts + d->act_parts == 0 ||
        d->max_parts < 0 || d->model.n_layers < 1 || !(d->kv_block_bytes > 0) ||
        !(d->act_block_bytes > 0) || !(d->room_bytes >= 0) || !(d->cache_elem_bytes > 0) ||
        !(d->layer_weight_bytes >= 0) || d->device_tokens < 0)
        return rekv_errf(err, -EINVAL, "planner: hybrid demand: bad parameters");
    int rc = demand_eval(prof, d, d->kv_parts, d->act_parts, out, err);
    if (rc || out->n_join == d->n_waiting)
        return rc; /* the room does not bind: the step-time pattern stands */
    out->binding = 1;
    int maxp = d->max_parts ? d->max_parts : 8;
    for (int k = 0; k <= maxp; k++) {
        for (int a = 1; a <= maxp; a++) {
            /* in lowest terms, strictly ACT-heavier: k/(k+a) < kv/(kv+act) */
            if (gcd_int(k, a) != 1 ||
                (int64_t)k * (d->kv_parts + d->act_parts) >= (int64_t)d->kv_parts * (k + a))
                continue;
            rekv_hybrid_choice c;
            if ((rc = demand_eval(prof, d, k, a, &c, err)))
                return rc;
            int better = c.throughput > out->throughput * (1 + 1e-9);
            int tie = !better && c.throughput >= out->throughput * (1 - 1e-9);
            if (better || (tie && (int64_t)k * (out->kv_parts + out->act_parts) >
                                      (int64_t)out->kv_parts * (k + a))) {
                c.binding = 1;
                *out = c;
            }
        }
    }
    return 0;
}
