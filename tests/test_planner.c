/* test_planner.c — the planner's cost model and optimisers against brute force, hand-worked
 * examples from the papers' algorithms, and invariants: KVPR's split (papers/000 Eq. 6–12),
 * HybridServe's Algorithm 1, request block allocation rule and mini-batch packing (papers/003),
 * the technique chooser, and the least-squares fit. */
#include "coordinator/co_plan.h"
#include "coordinator/planner.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* splitmix64: deterministic across platforms, so a failing case can be replayed. */
static uint64_t g_rng;
static uint64_t rnd(void)
{
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double urand(void)
{
    return (double)(rnd() >> 11) / 9007199254740992.0;
} /* [0, 1) */
static int64_t irand(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}
static double logrand(double lo, double hi)
{
    return lo * pow(hi / lo, urand());
}

static int close_rel(double x, double y, double rel)
{
    return fabs(x - y) <= rel * fmax(fabs(x), fabs(y));
}

/* OPT-6.7B's shape, the papers' model */
static const rekv_model_config opt_6_7b = {.arch = REKV_ARCH_OPT,
                                           .act = REKV_ACT_RELU,
                                           .n_layers = 32,
                                           .hidden = 4096,
                                           .n_heads = 32,
                                           .n_kv_heads = 32,
                                           .head_dim = 128,
                                           .ffn = 16384,
                                           .dtype = REKV_DTYPE_F16};

/* The synthetic OPT the benches run (8 layers, hidden 1024, fp16). */
static const rekv_model_config opt8_config = {.arch = REKV_ARCH_OPT,
                                              .act = REKV_ACT_RELU,
                                              .n_layers = 8,
                                              .hidden = 1024,
                                              .n_heads = 16,
                                              .n_kv_heads = 16,
                                              .head_dim = 64,
                                              .ffn = 4096,
                                              .dtype = REKV_DTYPE_F16};

/* ---------------------------------------------------------------- fit_linear */

/* A step shape for one layer of a config (rekv_plan_model_from_config, rekv_plan_shape). */
static void shape_from_config(const rekv_model_config *cfg, int64_t b, int64_t s, double elem,
                              int weights_offloaded, rekv_step_shape *out)
{
    rekv_plan_model m;
    rekv_plan_model_from_config(cfg, &m);
    rekv_plan_shape(&m, b, s, elem, weights_offloaded, out);
}

START_TEST(test_fit_exact)
{
    double xs[50], ys[50], a, b;
    for (int i = 0; i < 50; i++) {
        xs[i] = 16.0 * (i + 1) + (i % 3); /* token counts, not evenly spaced */
        ys[i] = 3.7e-5 + 2.1e-7 * xs[i];
    }
    ck_assert_int_eq(rekv_linear_fit(xs, ys, 50, &a, &b, NULL), 0);
    ck_assert_msg(close_rel(a, 3.7e-5, 1e-9), "a = %.17g", a);
    ck_assert_msg(close_rel(b, 2.1e-7, 1e-9), "b = %.17g", b);

    rekv_err err = {0};
    ck_assert_int_eq(rekv_linear_fit(xs, ys, 1, &a, &b, &err), -EINVAL);
    double same[3] = {5, 5, 5};
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_linear_fit(same, ys, 3, &a, &b, &err), -EINVAL);
    ck_assert_int_eq(err.code, -EINVAL);
}
END_TEST

START_TEST(test_fit_noisy)
{
    g_rng = 7;
    enum { N = 400 };
    double xs[N], ys[N], a, b;
    const double a0 = 5e-5, b0 = 3e-7; /* T(n) for n up to 8192 tokens: 5e-5 .. 2.5e-3 s */
    for (int i = 0; i < N; i++) {
        xs[i] = (double)irand(16, 8192);
        ys[i] = (a0 + b0 * xs[i]) * (1.0 + 0.02 * (urand() - 0.5)); /* +-1% multiplicative noise */
    }
    ck_assert_int_eq(rekv_linear_fit(xs, ys, N, &a, &b, NULL), 0);
    ck_assert_msg(fabs(b - b0) < 0.01 * b0, "b = %g", b);
    ck_assert_msg(fabs(a - a0) < 0.2 * a0, "a = %g", a);
}
END_TEST

/* ---------------------------------------------------------------- KVPR */

/* A split's time in rekv's pipeline (planner.h), from Eq. 6–10 written out independently of
 * planner.c: the larger of everything the layer moves over the link and everything it computes;
 * a copy that moves bytes pays h2d_latency once. */
static double t_split(const rekv_cost_profile *pr, const rekv_kvpr_params *p, int64_t l)
{
    double mx = (double)p->b * l * p->hidden * p->elem_bytes;
    double mkv = 2.0 * p->b * (double)(p->s - l) * p->kv_dim * p->elem_bytes;
    double n = 2.0 * p->b * l * p->hidden * 2.0 * p->kv_dim; /* 4*b*l*h^2 when kv_dim == h */
    double tx = mx / pr->h2d_bw + (mx > 0 ? pr->h2d_latency : 0);
    double tkv = mkv / pr->h2d_bw + (mkv > 0 ? pr->h2d_latency : 0);
    double tw = p->weight_bytes / pr->h2d_bw + (p->weight_bytes > 0 ? pr->h2d_latency : 0);
    /* the forward pass: GEMMs at the rate for b rows (rows / (a + b*rows) where measured), the
     * attention at its own rate where measured */
    double fwd_rate = pr->fwd_flops_rate > 0 ? pr->fwd_flops_rate : pr->gemm_flops;
    if (pr->fwd_gemm.b > 0)
        fwd_rate = (double)p->b / (pr->fwd_gemm.a + pr->fwd_gemm.b * (double)p->b);
    double attn = pr->attn_flops_rate > 0 ? p->attn_flops : 0;
    double fwd = (p->fwd_flops - attn) / fwd_rate + (attn > 0 ? attn / pr->attn_flops_rate : 0);
    double link = tw + tx + tkv, comp = fwd + n / pr->gemm_flops;
    return link > comp ? link : comp;
}

static void random_kvpr(rekv_cost_profile *pr, rekv_kvpr_params *p, int gqa_only)
{
    static const int64_t hs[] = {64, 256, 1024, 2048, 4096, 5120, 7168, 9216};
    *pr = (rekv_cost_profile){0};
    pr->h2d_bw = logrand(1e9, 64e9);
    pr->gemm_flops = logrand(1e11, 1e15);
    pr->h2d_latency = (rnd() & 1) ? 0.0 : logrand(1e-7, 1e-3);
    /* a decode step's forward pass often runs far below the GEMM rate of recomputation */
    pr->fwd_flops_rate = (rnd() & 1) ? 0.0 : pr->gemm_flops * logrand(0.01, 1.0);
    p->s = irand(0, 2500);
    p->b = irand(1, 64);
    p->hidden = hs[irand(0, 7)];
    int64_t div =
        gqa_only ? (int64_t)2 << irand(0, 3) : (int64_t)1 << irand(0, 3); /* MHA or GQA 2..8 */
    p->kv_dim = p->hidden / div;
    p->elem_bytes = (rnd() & 1) ? 2.0 : 4.0;
    /* the layer's own work: none, or a forward pass of a few hidden^2 per sequence (and weights
     * on the link) */
    p->fwd_flops = (rnd() & 1) ? 0.0 : logrand(1.0, 30.0) * 2.0 * p->b * p->hidden * p->hidden;
    p->weight_bytes = (rnd() & 3) ? 0.0 : 12.0 * p->hidden * p->hidden * 2.0;
    /* a rate that falls with fewer rows, and attention at its own (lower) rate, or neither */
    if (rnd() & 1)
        pr->fwd_gemm = (rekv_linear){logrand(1e-13, 1e-10), logrand(1e-15, 1e-12)};
    if (rnd() & 1) {
        pr->attn_flops_rate = pr->gemm_flops * logrand(0.001, 0.5);
        p->attn_flops = p->fwd_flops * logrand(0.01, 1.0);
    }
}

/* The forward pass's price: its GEMMs at the rate for the step's rows (a + b*rows per FLOP of
 * one row: rows / (a + b*rows)), its attention at the attention rate. */
START_TEST(test_fwd_rates)
{
    rekv_cost_profile pr = {.h2d_bw = 1e9, .gemm_flops = 1e12, .fwd_flops_rate = 5e11};
    ck_assert(rekv_cost_fwd_rate_at(&pr, 8) == 5e11); /* not measured: fwd_flops_rate */
    pr.fwd_gemm = (rekv_linear){9e-12, 1e-12};        /* 1 row: 1e11 FLOP/s; many: -> 1e12 */
    ck_assert(fabs(rekv_cost_fwd_rate_at(&pr, 1) - 1e11) < 1);
    ck_assert(fabs(rekv_cost_fwd_rate_at(&pr, 9) - 5e11) < 1);
    ck_assert(rekv_cost_fwd_rate_at(&pr, 1000) > 9.9e11);
    rekv_kvpr_params p = {.s = 100,
                          .b = 9,
                          .hidden = 64,
                          .kv_dim = 64,
                          .elem_bytes = 2,
                          .fwd_flops = 1e9,
                          .attn_flops = 2e8};
    rekv_kvpr_split sp;
    rekv_plan_kvpr_eval(&pr, &p, 0, &sp);
    ck_assert(fabs(sp.t_compute - 1e9 / 5e11) < 1e-12); /* no attention rate: all as GEMM */
    pr.attn_flops_rate = 1e10;
    rekv_plan_kvpr_eval(&pr, &p, 0, &sp);
    ck_assert(fabs(sp.t_compute - (8e8 / 5e11 + 2e8 / 1e10)) < 1e-12);
}
END_TEST

START_TEST(test_kvpr_brute_force)
{
    g_rng = 11;
    int exact = 0, interior = 0;
    const int cases = 3000;
    for (int c = 0; c < cases; c++) {
        rekv_cost_profile pr;
        rekv_kvpr_params p;
        random_kvpr(&pr, &p, 0);
        rekv_kvpr_split sp;
        ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, NULL), 0);
        /* brute force: the minimum, then the smallest l within rounding (1e-12) of it */
        double bt = INFINITY;
        for (int64_t l = 0; l <= p.s; l++)
            bt = fmin(bt, t_split(&pr, &p, l));
        int64_t bl = 0;
        while (t_split(&pr, &p, bl) > bt * (1 + 1e-12))
            bl++;
        ck_assert(sp.l >= 0 && sp.l <= p.s);
        /* The returned t is t_split at the returned l, and it is the minimum; l is the brute-force
         * argmin, smallest on ties (ties to 1e-12: a GQA layer with hidden == 2*kv_dim is flat). */
        ck_assert_msg(close_rel(sp.t, t_split(&pr, &p, sp.l), 1e-12), "t %.17g vs %.17g", sp.t,
                      t_split(&pr, &p, sp.l));
        ck_assert_msg(sp.t <= bt * (1 + 1e-12), "case %d: l=%lld t=%.17g, brute l=%lld t=%.17g", c,
                      (long long)sp.l, sp.t, (long long)bl, bt);
        exact += sp.l == bl;
        interior += sp.l > 0 && sp.l < p.s;
        /* the byte and FLOP counts are Eq. 6, 7, 9 */
        ck_assert(close_rel(sp.bytes_x, (double)p.b * sp.l * p.hidden * p.elem_bytes, 1e-15) ||
                  sp.bytes_x == 0);
        ck_assert(
            close_rel(sp.bytes_kv, 2.0 * p.b * (p.s - sp.l) * p.kv_dim * p.elem_bytes, 1e-15) ||
            sp.bytes_kv == 0);
    }
    ck_assert_msg(exact == cases, "only %d of %d exact", exact, cases);
    ck_assert_msg(interior > cases / 10, "only %d interior optima: the sweep is too one-sided",
                  interior);
}
END_TEST

/* The split a step runs: the smallest l priced within REKV_PLAN_MARGIN of the optimum (brute
 * force over random layers), never past it; on this machine's cpu backend at 8 Gbit/s (batch 8,
 * 512 tokens, OPT 8 layers hidden 1024), where the optimum l = 11-12 is priced ~1% faster than
 * offload's l = 0 and ran 6% slower, it is 0. */
START_TEST(test_kvpr_choose)
{
    g_rng = 14;
    int pulled = 0;
    for (int c = 0; c < 2000; c++) {
        rekv_cost_profile pr;
        rekv_kvpr_params p;
        random_kvpr(&pr, &p, 0);
        if (p.s > 4000)
            p.s = 4000; /* brute force below */
        rekv_kvpr_split opt, ch;
        ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &opt, NULL), 0);
        ck_assert_int_eq(rekv_plan_kvpr_choose(&pr, &p, &ch, NULL), 0);
        double lim = opt.t * (1 + REKV_PLAN_MARGIN);
        int64_t bl = 0;
        while (t_split(&pr, &p, bl) > lim)
            bl++;
        ck_assert_msg(ch.l == bl && ch.l <= opt.l && ch.t <= lim,
                      "case %d: l %lld (t %g), brute %lld, optimum %lld (t %g)", c, (long long)ch.l,
                      ch.t, (long long)bl, (long long)opt.l, opt.t);
        ck_assert(close_rel(ch.t, t_split(&pr, &p, ch.l), 1e-12) || ch.t == 0);
        pulled += ch.l < opt.l;
    }
    ck_assert_msg(pulled > 100, "only %d pulled toward less recomputation", pulled);
    rekv_cost_profile pr = {.h2d_bw = 1e9,
                            .h2d_latency = 1e-5,
                            .gemm_flops = 1.48e11,
                            .fwd_flops_rate = 2.7e10,
                            .attn_flops_rate = 2.56e9};
    double attn = 4.0 * 8 * 512 * 1024;
    rekv_kvpr_params p = {.s = 512,
                          .b = 8,
                          .hidden = 1024,
                          .kv_dim = 1024,
                          .elem_bytes = 2,
                          .fwd_flops = 2.0 * 8 * 12.0 * 1024 * 1024 + attn,
                          .attn_flops = attn};
    rekv_kvpr_split opt, ch, zero;
    ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &opt, NULL), 0);
    ck_assert_int_eq(rekv_plan_kvpr_choose(&pr, &p, &ch, NULL), 0);
    rekv_plan_kvpr_eval(&pr, &p, 0, &zero);
    ck_assert_msg(opt.l > 0 && opt.t < zero.t && zero.t < opt.t * (1 + REKV_PLAN_MARGIN),
                  "optimum %lld at %g s, l = 0 %g s", (long long)opt.l, opt.t, zero.t);
    ck_assert_int_eq(ch.l, 0);
}
END_TEST

/* InfiniGen with layer 0's split (rekv_step_shape.infinigen_split < 0): the split chosen is KVPR's
 * for that layer alone (rekv_plan_kvpr_choose of the moved context), counted from the context's
 * start past the device part, and its step within REKV_PLAN_MARGIN of the best over every l
 * (brute force); a split given is priced as given; 0 is the price without recomputation. On GQA
 * (an activation row no smaller than a K+V row) never a split. */
START_TEST(test_infinigen_split)
{
    g_rng = 21;
    int used = 0;
    for (int c = 0; c < 600; c++) {
        rekv_cost_profile pr;
        rekv_step_shape sh = {0};
        int gqa = c % 3 == 0;
        random_kvpr(&pr, &sh.kv, gqa);
        if (sh.kv.s > 1200)
            sh.kv.s = 1200;
        sh.infinigen_fraction = logrand(0.02, 1.0);
        sh.n_layers = (int)irand(1, 40);
        sh.q_dim = sh.kv.hidden;
        sh.device_tokens = (rnd() & 1) ? 0 : irand(0, sh.kv.s);
        sh.infinigen_split = -1;
        rekv_step_cost ch, at;
        ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_INFINIGEN, &ch, NULL), 0);
        int64_t dev = sh.device_tokens, moved = sh.kv.s - dev;
        double *t = malloc(sizeof(double) * (size_t)(moved + 1)), best = INFINITY;
        for (int64_t l = 0; l <= moved; l++) {
            rekv_step_shape g = sh;
            g.infinigen_split = l ? dev + l : 0;
            ck_assert_int_eq(rekv_plan_step_cost(&pr, &g, REKV_TECH_INFINIGEN, &at, NULL), 0);
            ck_assert_int_eq(at.kvpr_l, g.infinigen_split);
            t[l] = at.t_step;
            best = fmin(best, t[l]);
        }
        rekv_kvpr_params mv = sh.kv;
        mv.s = moved;
        rekv_kvpr_split ks;
        ck_assert_int_eq(rekv_plan_kvpr_choose(&pr, &mv, &ks, NULL), 0);
        ck_assert_msg(ch.kvpr_l == (ks.l ? dev + ks.l : 0) && ch.t_step == t[ks.l] &&
                          ch.t_step <= best * (1 + REKV_PLAN_MARGIN) * (1 + 1e-12),
                      "case %d: split %lld (t %g), KVPR's %lld, best %g", c, (long long)ch.kvpr_l,
                      ch.t_step, (long long)ks.l, best);
        ck_assert(!gqa || ch.kvpr_l == 0);
        used += ks.l > 0;
        free(t);
    }
    ck_assert_msg(used > 30, "only %d cases recompute", used);
    /* split 0: InfiniGen's price as before (layer 0 all of KV's bytes, the others f of them) */
    rekv_cost_profile pr = {
        .h2d_bw = 5e7, .h2d_latency = 1e-5, .gemm_flops = 1.5e11, .fwd_flops_rate = 2.7e10};
    const rekv_model_config opt = opt8_config;
    rekv_plan_model pm;
    rekv_plan_model_from_config(&opt, &pm);
    pm.weight_elem_bytes = 2;
    rekv_step_shape sh;
    rekv_plan_shape(&pm, 8, 512, 2, 0, &sh);
    ck_assert_int_eq(sh.infinigen_split, 0);
    rekv_step_cost kv, none, chosen;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_KV, &kv, NULL), 0);
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_INFINIGEN, &none, NULL), 0);
    ck_assert(close_rel(none.bytes_h2d, kv.bytes_h2d * (1 + 7 * 0.2) / 8, 1e-12));
    ck_assert(none.kvpr_l == 0 && none.recompute_flops == 0);
    /* at 0.4 Gbit/s the link binds: layer 0 recomputes, fewer bytes, a cheaper step */
    sh.infinigen_split = -1;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_INFINIGEN, &chosen, NULL), 0);
    ck_assert(chosen.kvpr_l > 0 && chosen.t_step < none.t_step &&
              chosen.bytes_h2d < none.bytes_h2d && chosen.recompute_flops > 0);
}
END_TEST

START_TEST(test_kvpr_gqa_zero)
{
    /* An X row (hidden elements) is not smaller than a K+V row (2*kv_dim): sending X can only cost
     * more than sending the KV it replaces, so l = 0 whatever the GPU speed. */
    g_rng = 12;
    for (int c = 0; c < 2000; c++) {
        rekv_cost_profile pr;
        rekv_kvpr_params p;
        random_kvpr(&pr, &p, 1);
        pr.gemm_flops = logrand(1e12, 1e18); /* even an absurdly fast GPU */
        rekv_kvpr_split sp;
        ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, NULL), 0);
        ck_assert_msg(sp.l == 0, "hidden %lld kv_dim %lld: l = %lld", (long long)p.hidden,
                      (long long)p.kv_dim, (long long)sp.l);
    }
    /* Llama-3-8B-like layer: hidden 4096, 8 KV heads of 128. */
    rekv_cost_profile pr = {.h2d_bw = 25e9, .gemm_flops = 400e12};
    rekv_kvpr_params p = {.s = 4096, .b = 8, .hidden = 4096, .kv_dim = 1024, .elem_bytes = 2};
    rekv_kvpr_split sp;
    ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, NULL), 0);
    ck_assert_int_eq(sp.l, 0);
    ck_assert(sp.bytes_x == 0 && sp.bytes_kv == 2.0 * 8 * 4096 * 1024 * 2);
}
END_TEST

START_TEST(test_kvpr_mha_closed_form)
{
    /* Hand-worked: MHA, h = 4096, p = 2, v_com = 16e9 B/s, v_gpu = 6.5536e13 FLOP/s, s = 1000, b
     * = 4. Per token: recompute 4*b*h^2/v_gpu = 4*4*4096^2/6.5536e13 = 4.096e-6 s; a K+V row
     * 2*b*h*p/v_com = 4.096e-6 s; an X row half that. Link 2.048e-6*(2s - l), compute 4.096e-6*l:
     * they meet at l = 2s/3 = 666.7, where both 666 and 667 take 2.732032e-3 s (Eq. 11 would have
     * said l = 500, where this pipeline takes 3.072e-3). */
    rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 6.5536e13};
    rekv_kvpr_params p = {.s = 1000, .b = 4, .hidden = 4096, .kv_dim = 4096, .elem_bytes = 2};
    rekv_kvpr_split sp;
    ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, NULL), 0);
    ck_assert_int_eq(sp.l, 666);
    ck_assert_msg(close_rel(sp.t, 2.732032e-3, 1e-12), "t = %.17g", sp.t);
    ck_assert(close_rel(sp.t_link, sp.t_x + sp.t_kv, 1e-15) && sp.t_compute == sp.t_recomp);
    rekv_plan_kvpr_eval(&pr, &p, 500, &sp);
    ck_assert_msg(close_rel(sp.t, 3.072e-3, 1e-12), "t(500) = %.17g", sp.t);

    /* Random MHA profiles without latency, forward pass or weights: l is floor or ceil of the
     * crossing l* = s * (2p/v_com) / (4h/v_gpu + p/v_com), or s when that lies beyond it. */
    g_rng = 13;
    for (int c = 0; c < 3000; c++) {
        rekv_cost_profile q;
        rekv_kvpr_params k;
        random_kvpr(&q, &k, 0);
        q.h2d_latency = 0;
        k.kv_dim = k.hidden;
        k.fwd_flops = k.weight_bytes = 0;
        double tr = 2.0 * k.elem_bytes / q.h2d_bw, rc = 4.0 * (double)k.hidden / q.gemm_flops;
        double ls = (double)k.s * tr / (rc + tr / 2);
        ck_assert_int_eq(rekv_plan_kvpr_solve(&q, &k, &sp, NULL), 0);
        if (ls > (double)k.s) /* they never meet: recomputing everything is cheapest */
            ls = (double)k.s;
        ck_assert_msg(sp.l == (int64_t)floor(ls) || sp.l == (int64_t)ceil(ls),
                      "l = %lld, l* = %.6f", (long long)sp.l, ls);
    }
}
END_TEST

START_TEST(test_kvpr_edges)
{
    rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 1e14, .h2d_latency = 1e-5};
    rekv_kvpr_params p = {.s = 0, .b = 4, .hidden = 1024, .kv_dim = 1024, .elem_bytes = 2};
    rekv_kvpr_split sp;
    ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, NULL), 0);
    ck_assert(sp.l == 0 && sp.t == 0);
    p.s = 1;
    ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, NULL), 0);
    ck_assert(sp.t == fmin(t_split(&pr, &p, 0), t_split(&pr, &p, 1)));
    rekv_err err = {0};
    p.s = -1;
    ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, &err), -EINVAL);
    p.s = 10;
    pr.h2d_bw = 0;
    ck_assert_int_eq(rekv_plan_kvpr_solve(&pr, &p, &sp, NULL), -EINVAL);
    pr.h2d_bw = 1e9;
}
END_TEST

/* ---------------------------------------------------------------- HybridServe Algorithm 1 */

/* Shared by the hand-worked examples: 16-token blocks, one layer, S_KV = 2000 B, S_ACT = 1000 B,
 * 100 kB of weights, #ACT_GPU = 50. Per block, T_kv_gen = c + 16e-6*n and T_load_kv = a + 32e-6*n
 * (slopes 1e-6 and 2e-6 s per token): loading a KV block takes twice regenerating one. */
static rekv_hybrid_params hand_params(double host)
{
    return (rekv_hybrid_params){.host_bytes = host,
                                .weight_bytes = 100000,
                                .n_layers = 1,
                                .kv_block_bytes = 2000,
                                .act_block_bytes = 1000,
                                .act_gpu_blocks = 50,
                                .block_tokens = 16,
                                .max_parts = 8};
}

START_TEST(test_hybrid_hand_act_init)
{
    /* Example 1, T_budget >= 0. No intercepts. T_load_w = 1.6e-3 s.
     *   line 13: T_budget = 1.6e-3 - T_kv_gen(50) = 1.6e-3 - 50*16e-6 = 0.8e-3 s >= 0
     *   line 15: ACT_init = 0.8e-3 / 16e-6 = 50, KV_init = 0
     *   line 22: M_occupied = 1000*50 = 50,000 B
     *   line 23: M_remaining = 1,110,000 - 100,000 - 50,000 = 960,000 B
     *   lines 24–26: 1000x + 2000y = 960,000 and 16e-6 x = 32e-6 y  =>  x = 2y, 4000y = 960,000,
     *                y = 240, x = 480
     *   #ACT_Host = 530, #KV_Host = 240; KV fraction 240/770 = 0.3117; nearest pattern with parts
     *   <= 8 is 3:7 (0.3; 1:2 = 0.333, 2:5 = 0.286, 5:11 is out of range). */
    rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 1e14, .t_load_w = 1.6e-3};
    pr.kv_gen = (rekv_linear){0, 1e-6};
    pr.load_kv = (rekv_linear){0, 2e-6};
    rekv_hybrid_params p = hand_params(1110000);
    rekv_hybrid_alloc a;
    ck_assert_int_eq(rekv_plan_hybrid_alloc(&pr, &p, &a, NULL), 0);
    ck_assert_int_eq(a.act_init, 50);
    ck_assert_int_eq(a.kv_init, 0);
    ck_assert_int_eq(a.act_remain, 480);
    ck_assert_int_eq(a.kv_remain, 240);
    ck_assert_int_eq(a.act_host, 530);
    ck_assert_int_eq(a.kv_host, 240);
    ck_assert_int_eq(a.kv_parts, 3);
    ck_assert_int_eq(a.act_parts, 7);
    ck_assert(close_rel(a.kv_fraction, 240.0 / 770.0, 1e-15));
    ck_assert(a.bytes_used == 1110000);
    /* Eq. 2–3: T_PCIe = 1.6e-3 + 240*32e-6 = 9.28e-3 = T_comp = (530+50)*16e-6: balanced. */
    ck_assert(close_rel(a.t_pcie, 9.28e-3, 1e-12));
    ck_assert(close_rel(a.t_compute, 9.28e-3, 1e-12));
}
END_TEST

START_TEST(test_hybrid_hand_kv_init)
{
    /* Example 2, T_budget < 0. No intercepts. T_load_w = 0.32e-3 s.
     *   line 13: T_budget = 0.32e-3 - 0.8e-3 = -0.48e-3 s
     *   line 17: KV_init = 0.48e-3 / 32e-6 = 15
     *   M_occupied = 2000*15 = 30,000; M_remaining = 1,090,000 - 100,000 - 30,000 = 960,000
     *   remaining as in example 1: ACT 480, KV 240. #ACT_Host = 480, #KV_Host = 255. */
    rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 1e14, .t_load_w = 0.32e-3};
    pr.kv_gen = (rekv_linear){0, 1e-6};
    pr.load_kv = (rekv_linear){0, 2e-6};
    rekv_hybrid_params p = hand_params(1090000);
    rekv_hybrid_alloc a;
    ck_assert_int_eq(rekv_plan_hybrid_alloc(&pr, &p, &a, NULL), 0);
    ck_assert_int_eq(a.act_init, 0);
    ck_assert_int_eq(a.kv_init, 15);
    ck_assert_int_eq(a.act_remain, 480);
    ck_assert_int_eq(a.kv_remain, 240);
    ck_assert_int_eq(a.act_host, 480);
    ck_assert_int_eq(a.kv_host, 255);
    ck_assert(a.bytes_used <= p.host_bytes);
}
END_TEST

START_TEST(test_hybrid_hand_intercepts)
{
    /* Example 3, intercepts and rounding. T_kv_gen(n tok) = 100e-6 + 1e-6 n, T_load_kv(n tok) =
     * 50e-6 + 2e-6 n; T_load_w = 1.9e-3.
     *   line 13: T_budget = 1.9e-3 - (100e-6 + 800e-6) = 1.0e-3
     *   line 15: 100e-6 + 16e-6 x = 1.0e-3  =>  x = 56.25; T(56) = 0.996e-3 (off 4e-6),
     *            T(57) = 1.012e-3 (off 12e-6)  =>  ACT_init = 56
     *   M_remaining = 1,156,000 - 100,000 - 56,000 = 1,000,000
     *   line 26 (in us): 100 + 16x = 50 + 32y, with 1000x + 2000y = 1,000,000
     *            =>  4000y = 1,003,125, y = 250.78125
     *     y = 250: x = 500, T_kv_gen = 8100 us, T_load_kv = 8050 us, off 50 us
     *     y = 251: x = 498, T_kv_gen = 8068 us, T_load_kv = 8082 us, off 14 us  <= chosen
     *   #ACT_Host = 56 + 498 = 554, #KV_Host = 251. */
    rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 1e14, .t_load_w = 1.9e-3};
    pr.kv_gen = (rekv_linear){100e-6, 1e-6};
    pr.load_kv = (rekv_linear){50e-6, 2e-6};
    rekv_hybrid_params p = hand_params(1156000);
    rekv_hybrid_alloc a;
    ck_assert_int_eq(rekv_plan_hybrid_alloc(&pr, &p, &a, NULL), 0);
    ck_assert_int_eq(a.act_init, 56);
    ck_assert_int_eq(a.kv_init, 0);
    ck_assert_int_eq(a.act_remain, 498);
    ck_assert_int_eq(a.kv_remain, 251);
    ck_assert_int_eq(a.act_host, 554);
    ck_assert_int_eq(a.kv_host, 251);
    ck_assert(a.bytes_used <= p.host_bytes);
}
END_TEST

START_TEST(test_hybrid_capacity)
{
    /* Random profiles and memories: never more than host memory, never negative counts, and when
     * memory is plentiful the two pipelines come out balanced (Eq. 4) to within a block's time. */
    g_rng = 21;
    for (int c = 0; c < 5000; c++) {
        rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 1e14};
        pr.t_load_w = (rnd() & 7) ? logrand(1e-5, 0.1) : 0.0;
        pr.kv_gen = (rekv_linear){(rnd() & 1) ? logrand(1e-7, 1e-4) : 0.0, logrand(1e-9, 1e-5)};
        pr.load_kv = (rekv_linear){(rnd() & 1) ? logrand(1e-7, 1e-4) : 0.0, logrand(1e-9, 1e-5)};
        rekv_hybrid_params p = {.n_layers = (int)irand(1, 80),
                                .kv_block_bytes = (double)irand(1, 1 << 20),
                                .block_tokens = 16,
                                .act_gpu_blocks = irand(0, 5000),
                                .max_parts = (int)irand(0, 12)};
        p.act_block_bytes = (rnd() & 1) ? p.kv_block_bytes / 2 : (double)irand(1, 1 << 20);
        p.weight_bytes = (rnd() & 1) ? 0.0 : logrand(1e3, 1e11);
        p.host_bytes = p.weight_bytes + ((rnd() & 7) ? logrand(1e3, 1e12) : 0.0);
        rekv_hybrid_alloc a;
        ck_assert_int_eq(rekv_plan_hybrid_alloc(&pr, &p, &a, NULL), 0);
        ck_assert(a.act_init >= 0 && a.kv_init >= 0 && a.act_remain >= 0 && a.kv_remain >= 0);
        ck_assert(a.act_init == 0 || a.kv_init == 0);
        ck_assert_int_eq(a.act_host, a.act_init + a.act_remain);
        ck_assert_int_eq(a.kv_host, a.kv_init + a.kv_remain);
        double used = p.weight_bytes + p.n_layers * (p.act_block_bytes * (double)a.act_host +
                                                     p.kv_block_bytes * (double)a.kv_host);
        ck_assert_msg(used <= p.host_bytes, "case %d: %.0f > %.0f", c, used, p.host_bytes);
        ck_assert(close_rel(a.bytes_used, used, 1e-12) || used == 0);
        int mp = p.max_parts ? p.max_parts : 8;
        ck_assert(a.kv_parts >= 0 && a.kv_parts <= mp && a.act_parts >= 0 && a.act_parts <= mp);
        ck_assert(a.act_host + a.kv_host == 0 || a.kv_parts + a.act_parts > 0);
        /* memory left unused is less than one ACT block column plus one KV block column */
        if (a.act_init + a.kv_init < 1000000)
            ck_assert(p.host_bytes - used <
                      p.n_layers * (p.act_block_bytes + p.kv_block_bytes) + 1e-6 * p.host_bytes);
    }
    rekv_cost_profile pr = {
        .h2d_bw = 16e9, .gemm_flops = 1e14, .kv_gen = {0, 1e-6}, .load_kv = {0, 2e-6}};
    rekv_hybrid_params p = hand_params(50000); /* weights 100 kB > host 50 kB */
    rekv_hybrid_alloc a;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_plan_hybrid_alloc(&pr, &p, &a, &err), -ENOSPC);
    ck_assert_int_eq(err.code, -ENOSPC);
}
END_TEST

START_TEST(test_hybrid_next_block)
{
    /* 003 Sec. IV-C2: "if the ratio of #ACT_Host and #KV_Host is 3:1 when a request has five ACT
     * blocks and two KV blocks, the next block allocated would be an ACT block". */
    ck_assert_int_eq(rekv_kv_next_block_type(2, 5, 1, 3), REKV_KV_BLOCK_ACT);
    /* at exactly 3:1 (6 ACT, 2 KV) the next is still ACT: 7:2 is closer to 3:1 than 6:3 */
    ck_assert_int_eq(rekv_kv_next_block_type(2, 6, 1, 3), REKV_KV_BLOCK_ACT);
    ck_assert_int_eq(rekv_kv_next_block_type(2, 4, 1, 3), REKV_KV_BLOCK_ACT);
    ck_assert_int_eq(rekv_kv_next_block_type(1, 5, 1, 3), REKV_KV_BLOCK_KV);
    ck_assert_int_eq(rekv_kv_next_block_type(0, 0, 1, 0), REKV_KV_BLOCK_KV);  /* all KV */
    ck_assert_int_eq(rekv_kv_next_block_type(7, 0, 0, 1), REKV_KV_BLOCK_ACT); /* all ACT */
    ck_assert_int_eq(rekv_kv_next_block_type(0, 0, 1, 1), REKV_KV_BLOCK_ACT); /* tie goes to ACT */
    ck_assert_int_eq(rekv_kv_next_block_type(0, 1, 1, 1), REKV_KV_BLOCK_KV);

    /* Long runs from an empty request, with host counts as the ratio: every prefix keeps its KV
     * count within half a block of f*n, so within one block of the target at all times. */
    g_rng = 31;
    for (int c = 0; c < 300; c++) {
        int64_t kr = irand(0, 1000), ar = irand(0, 1000);
        if (kr + ar == 0)
            ar = 1;
        if (c < 20) { /* large host counts too (the store takes 32-bit parts) */
            kr = irand(0, UINT32_MAX);
            ar = irand(1, UINT32_MAX);
        }
        double f = (double)kr / ((double)kr + (double)ar);
        int64_t nk = 0, na = 0;
        for (int i = 0; i < 5000; i++) {
            if (rekv_kv_next_block_type(nk, na, kr, ar) == REKV_KV_BLOCK_KV)
                nk++;
            else
                na++;
            double dev = (double)nk - f * (double)(nk + na);
            ck_assert_msg(fabs(dev) <= 0.5 + 1e-9,
                          "ratio %lld:%lld after %d blocks: KV %lld (dev %.3f)", (long long)kr,
                          (long long)ar, i + 1, (long long)nk, dev);
        }
    }
    /* A 3:1 (ACT:KV) pattern repeats every 4 blocks with exactly one KV block. */
    int64_t nk = 0, na = 0;
    for (int i = 0; i < 400; i++) {
        if (rekv_kv_next_block_type(nk, na, 1, 3) == REKV_KV_BLOCK_KV)
            nk++;
        else
            na++;
        if ((i + 1) % 4 == 0)
            ck_assert(nk == (i + 1) / 4 && na == 3 * (i + 1) / 4);
    }
}
END_TEST

/* ---------------------------------------------------------------- hybrid pattern under demand */

/* Admission's reservation of a hybrid sequence is never less than what the store's block rule
 * (rekv_kv_next_block_type, one block at a time) gives it, and at most one block of the dearer
 * type more, whichever type that is (MHA: KV; a GQA model can have the larger ACT block). */
START_TEST(test_hybrid_job_bytes)
{
    const double costs[2][2] = {{32768, 16384}, {8192, 24576}}; /* KV, ACT bytes */
    for (int c = 0; c < 2; c++)
        for (int k = 0; k <= 8; k++)
            for (int a = 0; a <= 8; a++) {
                int64_t nk = 0, na = 0;
                for (int64_t nb = 1; nb <= 80; nb++) {
                    if (rekv_kv_next_block_type(nk, na, k, a) == REKV_KV_BLOCK_KV)
                        nk++;
                    else
                        na++;
                    double held = 3.0 * (nk * costs[c][0] + na * costs[c][1]);
                    double r = rekv_plan_hybrid_job_bytes(nb, k, a, 3, costs[c][0], costs[c][1]);
                    ck_assert_msg(r >= held && r <= held + 3.0 * fabs(costs[c][0] - costs[c][1]),
                                  "%d:%d, %lld blocks: reserved %.0f, the store holds %.0f", k, a,
                                  (long long)nb, r, held);
                }
            }
    ck_assert(rekv_plan_hybrid_job_bytes(18, 1, 1, 4, 32768, 16384) == 4 * 9 * 49152.0);
    ck_assert(rekv_plan_hybrid_job_bytes(18, 1, 3, 4, 32768, 16384) ==
              4 * (5 * 32768.0 + 13 * 16384.0)); /* 4.5 KV blocks: the dearer 5 */
    ck_assert(rekv_plan_hybrid_job_bytes(0, 1, 1, 4, 32768, 16384) == 0);
}
END_TEST

/* One candidate's batch priced the way the rule says it prices it, independently: the running
 * sequences and the first n_join waiting ones at KV share f; tokens/s. */
static double demand_throughput(const rekv_cost_profile *pr, const rekv_hybrid_demand *d,
                                size_t n_join, double f)
{
    double tok = 0, kv = 0;
    for (size_t i = 0; i < d->n_running; i++) {
        tok += (double)d->running[i].tokens;
        kv += d->running[i].kv_fraction * (double)d->running[i].tokens;
    }
    for (size_t i = 0; i < n_join; i++) {
        tok += (double)d->waiting[i].tokens;
        kv += f * (double)d->waiting[i].tokens;
    }
    int64_t b = (int64_t)(d->n_running + n_join);
    if (b == 0)
        return 0;
    rekv_step_shape sh;
    rekv_plan_shape(&d->model, b, (int64_t)llround(tok / (double)b), d->cache_elem_bytes, 0, &sh);
    sh.kv.weight_bytes = d->layer_weight_bytes;
    sh.hybrid_kv_fraction = kv / tok;
    rekv_step_cost c;
    ck_assert_int_eq(rekv_plan_step_cost(pr, &sh, REKV_TECH_HYBRID, &c, NULL), 0);
    return (double)b / (d->model.n_layers * c.t_step);
}

/* The waiting sequences whose reservations at k:a fit the room, a prefix of the queue. */
static size_t demand_prefix(const rekv_hybrid_demand *d, int k, int a)
{
    double used = 0;
    size_t n = 0;
    while (n < d->n_waiting) {
        used +=
            rekv_plan_hybrid_job_bytes((d->waiting[n].full_tokens + 15) / 16, k, a,
                                       d->model.n_layers, d->kv_block_bytes, d->act_block_bytes);
        if (used > d->room_bytes)
            break;
        n++;
    }
    return n;
}

/* The rule's choice is the candidate (the step-time pattern, or any ACT-heavier one in lowest
 * terms) of highest throughput, brute force. */
static void check_demand_argmax(const rekv_cost_profile *pr, const rekv_hybrid_demand *d,
                                const rekv_hybrid_choice *c)
{
    double f0 = (double)d->kv_parts / (d->kv_parts + d->act_parts);
    double fc = (double)c->kv_parts / (c->kv_parts + c->act_parts);
    ck_assert(fc <= f0);
    ck_assert_uint_eq(c->n_join, demand_prefix(d, c->kv_parts, c->act_parts));
    ck_assert(close_rel(c->throughput, demand_throughput(pr, d, c->n_join, fc), 1e-9));
    for (int k = 0; k <= 8; k++)
        for (int a = 0; a <= 8; a++) {
            if (k + a == 0 || (double)k / (k + a) > f0)
                continue;
            double t = demand_throughput(pr, d, demand_prefix(d, k, a), (double)k / (k + a));
            ck_assert_msg(t <= c->throughput * (1 + 1e-9),
                          "%d:%d makes %.1f tokens/s, the choice %d:%d %.1f", k, a, t, c->kv_parts,
                          c->act_parts, c->throughput);
        }
}

/* HybridServe's setting (OPT-6.7B, fp16 cache, weights streamed over a 16 GB/s link each step):
 * 64 jobs of 512 + 32 tokens wait. With room for all of them at the step-time pattern (1:1) it
 * stands, though an ACT-heavier one would make each step faster; with 2 GiB of room left it
 * binds (10 jobs at 1:1), and the rule picks an ACT-heavier pattern that admits more and makes
 * more tokens per second (a step's weights are shared by more sequences). Where recomputation is
 * dear (the cpu backend's profile without a link) the room binds too, but the all-KV step-time
 * pattern stands: an ACT block admits more sequences and each step then costs more than they
 * gain. */
START_TEST(test_hybrid_demand)
{
    enum { N = 64 };
    rekv_hybrid_seq wait[N], run[3];
    for (int i = 0; i < N; i++)
        wait[i] = (rekv_hybrid_seq){.tokens = 512, .full_tokens = 544};
    rekv_plan_model m;
    rekv_plan_model_from_config(&opt_6_7b, &m);
    rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 100e12};
    rekv_hybrid_demand d = {.model = m,
                            .cache_elem_bytes = 2,
                            .layer_weight_bytes = m.layer_params * 2,
                            .kv_block_bytes = 2.0 * 4096 * 16 * 2,
                            .act_block_bytes = 4096.0 * 16 * 2,
                            .room_bytes = 1e12,
                            .waiting = wait,
                            .n_waiting = N,
                            .kv_parts = 1,
                            .act_parts = 1};
    rekv_hybrid_choice c;
    ck_assert_int_eq(rekv_plan_hybrid_demand(&pr, &d, &c, NULL), 0);
    ck_assert_int_eq(c.kv_parts, 1);
    ck_assert_int_eq(c.act_parts, 1);
    ck_assert_uint_eq(c.n_join, N);
    ck_assert_int_eq(c.binding, 0);
    ck_assert_msg(demand_throughput(&pr, &d, N, 0) > c.throughput,
                  "the case needs an ACT-heavier pattern faster at the same batch");

    d.room_bytes = 2.0 * 1024 * 1024 * 1024;
    size_t at_base = demand_prefix(&d, 1, 1);
    ck_assert_uint_eq(at_base, 10); /* 17 KV + 17 ACT blocks of 32 layers: 204 MiB a job */
    ck_assert_int_eq(rekv_plan_hybrid_demand(&pr, &d, &c, NULL), 0);
    ck_assert_int_eq(c.binding, 1);
    ck_assert_msg(c.kv_parts < c.act_parts && c.n_join > at_base,
                  "room binds: %d:%d admits %zu (1:1: %zu)", c.kv_parts, c.act_parts, c.n_join,
                  at_base);
    ck_assert(c.throughput > demand_throughput(&pr, &d, at_base, 0.5));
    check_demand_argmax(&pr, &d, &c);

    /* with running sequences (1:1, mid-decode) the room left is the caller's; the same rule */
    for (int i = 0; i < 3; i++)
        run[i] = (rekv_hybrid_seq){.tokens = 530, .kv_fraction = 0.5};
    d.running = run;
    d.n_running = 3;
    d.room_bytes = 1.0 * 1024 * 1024 * 1024;
    ck_assert_int_eq(rekv_plan_hybrid_demand(&pr, &d, &c, NULL), 0);
    ck_assert(c.binding && c.kv_parts < c.act_parts && c.n_join > demand_prefix(&d, 1, 1));
    check_demand_argmax(&pr, &d, &c);

    /* recomputation dear (a cpu's 65 GFLOP/s, a 14 GB/s memcpy "link", weights resident) on
     * the bench's MHA shape, 16 MiB of fp32 cache: all KV stands, though ACT would admit more */
    rekv_cost_profile cpu = {.h2d_bw = 14e9, .gemm_flops = 65e9};
    rekv_hybrid_seq w2[32];
    for (int i = 0; i < 32; i++)
        w2[i] = (rekv_hybrid_seq){.tokens = 256, .full_tokens = 288};
    rekv_hybrid_demand e = {.model = {.hidden = 256,
                                      .q_dim = 256,
                                      .kv_dim = 256,
                                      .n_layers = 4,
                                      .layer_params = 12 * 256 * 256},
                            .cache_elem_bytes = 4,
                            .kv_block_bytes = 32768,
                            .act_block_bytes = 16384,
                            .room_bytes = 16 * 1024 * 1024,
                            .waiting = w2,
                            .n_waiting = 32,
                            .kv_parts = 1,
                            .act_parts = 0};
    ck_assert_int_eq(rekv_plan_hybrid_demand(&cpu, &e, &c, NULL), 0);
    ck_assert_int_eq(c.binding, 1);
    ck_assert_int_eq(c.kv_parts, 1);
    ck_assert_int_eq(c.act_parts, 0);
    ck_assert_uint_eq(c.n_join, 7);
    ck_assert_uint_eq(demand_prefix(&e, 0, 1), 14);
    check_demand_argmax(&cpu, &e, &c);
    /* the same shape behind a 3 Gbit/s link (0.375 GB/s): moving a token's K,V now costs more
     * than rebuilding it, and the rule admits 1.5x or more */
    rekv_cost_profile slow = {.h2d_bw = 0.375e9, .gemm_flops = 65e9};
    ck_assert_int_eq(rekv_plan_hybrid_demand(&slow, &e, &c, NULL), 0);
    ck_assert_msg(2 * c.n_join >= 3 * 7, "3 Gbit/s: %d:%d admits %zu", c.kv_parts, c.act_parts,
                  c.n_join);
    check_demand_argmax(&slow, &e, &c);

    rekv_err err = {0};
    e.kv_parts = e.act_parts = 0;
    ck_assert_int_eq(rekv_plan_hybrid_demand(&cpu, &e, &c, &err), -EINVAL);
}
END_TEST

/* ---------------------------------------------------------------- mini-batch formation */

static const rekv_cost_profile mb_prof = {
    .h2d_bw = 16e9, .gemm_flops = 1e14, .kv_gen = {2e-6, 1e-6}, .load_kv = {3e-6, 2e-6}};

static void check_packing(const rekv_mb_request *r, size_t n, int64_t kv_max, int64_t act_max,
                          const int *assign, size_t nb)
{
    int64_t kv[256] = {0}, act[256] = {0};
    int used[256] = {0};
    ck_assert(nb <= n && nb <= 256);
    for (size_t i = 0; i < n; i++) {
        ck_assert(assign[i] >= 0 &&
                  (size_t)assign[i] < nb); /* every request in exactly one batch */
        kv[assign[i]] += r[i].n_kv;
        act[assign[i]] += r[i].n_act;
        used[assign[i]] = 1;
    }
    for (size_t j = 0; j < nb; j++) {
        ck_assert(used[j]); /* dense: no empty batches */
        ck_assert_msg(kv[j] <= kv_max && act[j] <= act_max, "batch %zu: %lld KV, %lld ACT", j,
                      (long long)kv[j], (long long)act[j]);
    }
}

START_TEST(test_mb_fb)
{
    /* Eq. 6–7 with 16-token blocks: T_kv_gen(4 blocks) = 2e-6 + 64e-6 = 66e-6,
     * T_load_kv(2 blocks) = 3e-6 + 64e-6 = 67e-6, F_b = 67/66. */
    ck_assert(close_rel(rekv_plan_mb_fb(&mb_prof, 16, 4, 2), 67.0 / 66.0, 1e-14));
    ck_assert(close_rel(rekv_plan_mb_fb(&mb_prof, 16, 2, 4), (3.0 + 128.0) / (2.0 + 32.0), 1e-14));
    ck_assert(rekv_plan_mb_fb(&mb_prof, 16, 0, 0) == 1.0);
    ck_assert(isinf(rekv_plan_mb_fb(&mb_prof, 16, 3, 0)));
    ck_assert(isinf(rekv_plan_mb_fb(&mb_prof, 16, 0, 3)));
}
END_TEST

START_TEST(test_mb_constructed)
{
    /* Per-token slopes equal, no intercepts, 1-token blocks: F_b = max(ACT/KV, KV/ACT). Capacity
     * 10/10. A (5 KV, 5 ACT) -> batch 0.   B (6, 1) does not fit batch 0 (11 KV) -> batch 1. C (1,
     * 4): first fit puts it in batch 0 -> (6, 9) F 1.5, leaving batch 1 at (6, 1) F 6: mean 3.75.
     *             greedy: batch 0 would go 1 -> 1.5 (+0.5), batch 1 6 -> 1.4 (-4.6): batch 1,
     *             giving (5, 5) F 1 and (7, 5) F 1.4: mean 1.2. */
    const rekv_cost_profile pr = {
        .h2d_bw = 1e9, .gemm_flops = 1e12, .kv_gen = {0, 1}, .load_kv = {0, 1}};
    const rekv_mb_request r[3] = {{5, 5}, {6, 1}, {1, 4}};
    int ff[3], gd[3], gm[3];
    size_t nff, ngd, ngm;
    ck_assert_int_eq(rekv_plan_mb_pack(&pr, 1, REKV_MB_FIRST_FIT, r, 3, 10, 10, ff, &nff, NULL), 0);
    ck_assert_int_eq(rekv_plan_mb_pack(&pr, 1, REKV_MB_GREEDY_DELTA, r, 3, 10, 10, gd, &ngd, NULL),
                     0);
    ck_assert_int_eq(
        rekv_plan_mb_pack(&pr, 1, REKV_MB_GREEDY_MIN_AFTER, r, 3, 10, 10, gm, &ngm, NULL), 0);
    ck_assert(nff == 2 && ngd == 2 && ngm == 2);
    ck_assert(ff[0] == 0 && ff[1] == 1 && ff[2] == 0);
    ck_assert(gd[0] == 0 && gd[1] == 1 && gd[2] == 1);
    double mff = rekv_plan_mb_mean_fb(&pr, 1, r, 3, ff, nff),
           mgd = rekv_plan_mb_mean_fb(&pr, 1, r, 3, gd, ngd);
    ck_assert_msg(close_rel(mff, 3.75, 1e-14), "first fit %.17g", mff);
    ck_assert_msg(close_rel(mgd, 1.2, 1e-14), "greedy %.17g", mgd);
    ck_assert(mgd < mff);

    /* errors: a request bigger than a batch; empty input */
    const rekv_mb_request big[1] = {{11, 0}};
    rekv_err err = {0};
    ck_assert_int_eq(
        rekv_plan_mb_pack(&pr, 1, REKV_MB_GREEDY_DELTA, big, 1, 10, 10, ff, &nff, &err), -EINVAL);
    ck_assert_int_eq(
        rekv_plan_mb_pack(&pr, 1, REKV_MB_GREEDY_DELTA, NULL, 0, 10, 10, NULL, &nff, NULL), 0);
    ck_assert(nff == 0);
}
END_TEST

START_TEST(test_mb_random)
{
    /* Three request mixes: independent, bimodal (KV-heavy and ACT-heavy requests), ACT-heavy.
     * Every packing respects the capacities and assigns each request once; averaged over many
     * sets, the greedy's mean F_b is no worse than first fit's. */
    g_rng = 41;
    enum { SETS = 400, MAXN = 80 };
    rekv_mb_request r[MAXN];
    int assign[MAXN];
    for (int mix = 0; mix < 3; mix++) {
        double sum_ff = 0, sum_gd = 0;
        int better = 0, worse = 0;
        for (int s = 0; s < SETS; s++) {
            size_t n = (size_t)irand(5, MAXN);
            for (size_t i = 0; i < n; i++) {
                if (mix == 0)
                    r[i] = (rekv_mb_request){irand(1, 20), irand(1, 20)};
                else if (mix == 1)
                    r[i] = (rnd() & 1) ? (rekv_mb_request){irand(1, 30), irand(1, 10)}
                                       : (rekv_mb_request){irand(1, 10), irand(1, 30)};
                else
                    r[i] = (rekv_mb_request){irand(1, 8), irand(1, 40)};
            }
            int64_t kv_max = 100, act_max = 100;
            size_t nb;
            double m[3];
            for (int pol = 0; pol < 3; pol++) {
                ck_assert_int_eq(rekv_plan_mb_pack(&mb_prof, 16, (rekv_mb_policy)pol, r, n, kv_max,
                                                   act_max, assign, &nb, NULL),
                                 0);
                check_packing(r, n, kv_max, act_max, assign, nb);
                m[pol] = rekv_plan_mb_mean_fb(&mb_prof, 16, r, n, assign, nb);
                ck_assert(isfinite(m[pol]) && m[pol] >= 1.0);
            }
            sum_gd += m[REKV_MB_GREEDY_DELTA];
            sum_ff += m[REKV_MB_FIRST_FIT];
            better += m[REKV_MB_GREEDY_DELTA] < m[REKV_MB_FIRST_FIT] - 1e-12;
            worse += m[REKV_MB_GREEDY_DELTA] > m[REKV_MB_FIRST_FIT] + 1e-12;
        }
        ck_assert_msg(sum_gd <= sum_ff, "mix %d: greedy mean F_b %.4f > first fit %.4f", mix,
                      sum_gd / SETS, sum_ff / SETS);
        ck_assert_msg(better > worse, "mix %d: greedy better on %d sets, worse on %d", mix, better,
                      worse);
    }
}
END_TEST

/* The forward pass at the decode rate, recomputation and nothing else at the GEMM rate. */
START_TEST(test_step_cost_two_rates)
{
    const rekv_model_config opt = opt8_config;
    rekv_step_shape sh;
    shape_from_config(&opt, 8, 512, 2, 0, &sh);
    sh.hybrid_kv_fraction = 0.5;
    rekv_cost_profile pr = {.h2d_bw = 1e9, .gemm_flops = 1e12, .fwd_flops_rate = 1e11};
    rekv_step_cost c;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_KV, &c, NULL), 0);
    ck_assert(close_rel(c.t_compute, sh.kv.fwd_flops / 1e11, 1e-12));
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_ACT, &c, NULL), 0);
    ck_assert(c.recompute_flops > 0);
    ck_assert(close_rel(c.t_compute, sh.kv.fwd_flops / 1e11 + c.recompute_flops / 1e12, 1e-12));
    pr.fwd_flops_rate = 0; /* unmeasured: the GEMM rate */
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_KV, &c, NULL), 0);
    ck_assert(close_rel(c.t_compute, sh.kv.fwd_flops / 1e12, 1e-12));
}
END_TEST

/* The online correction: steps that measure their compute at 1.5x and their link at 0.8x of the
 * prediction move the scales there (smoothed: 1 - 0.7^k of the way after k steps), and the
 * corrected profile then prices every technique's compute and link times by exactly those factors
 * (weights offloaded: the load time too) — what the coordinator plans with and `rekv bench decode`
 * prints as its online prediction. A side with nothing predicted keeps its scale. */
START_TEST(test_scales_correct_profile)
{
    const rekv_model_config opt = opt8_config;
    rekv_step_shape sh;
    shape_from_config(&opt, 8, 512, 2, 1, &sh);
    sh.hybrid_kv_fraction = 0.5;
    sh.device_tokens = 100;
    rekv_cost_profile pr = {.h2d_bw = 1e9,
                            .h2d_latency = 1e-5,
                            .gemm_flops = 1e12,
                            .fwd_flops_rate = 1e11,
                            .fwd_gemm = {2e-12, 1e-12},
                            .attn_flops_rate = 5e10,
                            .load_kv = {1e-5, 1e-6},
                            .kv_gen = {2e-5, 3e-6},
                            .t_load_w = 0.02};
    rekv_plan_scales sc = {1, 1};
    rekv_cost_profile now;
    for (int k = 1; k <= 60; k++) {
        rekv_plan_scaled_profile(&pr, &sc, &now);
        rekv_step_cost c;
        ck_assert_int_eq(rekv_plan_step_cost(&now, &sh, REKV_TECH_KV, &c, NULL), 0);
        rekv_plan_scales_observe(&sc, 0.8 * c.t_pcie / sc.pcie, c.t_pcie,
                                 1.5 * c.t_compute / sc.compute, c.t_compute);
        if (k == 1 || k == 2) {
            double w = 1 - pow(1 - REKV_PLAN_SMOOTH, k);
            ck_assert(close_rel(sc.compute, 1 + 0.5 * w, 1e-12));
            ck_assert(close_rel(sc.pcie, 1 - 0.2 * w, 1e-12));
        }
    }
    ck_assert(close_rel(sc.compute, 1.5, 1e-6) && close_rel(sc.pcie, 0.8, 1e-6));
    rekv_plan_scaled_profile(&pr, &sc, &now);
    for (int t = 0; t <= REKV_TECH_INFINIGEN; t++) {
        rekv_step_cost c0, c1;
        ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, (rekv_technique)t, &c0, NULL), 0);
        ck_assert_int_eq(rekv_plan_step_cost(&now, &sh, (rekv_technique)t, &c1, NULL), 0);
        if (t == REKV_TECH_KVPR) /* the split moves with the rates: compare at the same split */
            continue;
        ck_assert_msg(close_rel(c1.t_compute, sc.compute * c0.t_compute, 1e-12), "tech %d", t);
        ck_assert_msg(close_rel(c1.t_pcie, sc.pcie * c0.t_pcie, 1e-12), "tech %d", t);
    }
    rekv_kvpr_split a, b;
    rekv_plan_kvpr_eval(&pr, &sh.kv, 200, &a);
    rekv_plan_kvpr_eval(&now, &sh.kv, 200, &b);
    ck_assert(close_rel(b.t_compute, sc.compute * a.t_compute, 1e-12));
    ck_assert(close_rel(b.t_link, sc.pcie * a.t_link, 1e-12));
    /* HybridServe's fitted models and the weights' load time scale with their side */
    ck_assert(close_rel(rekv_linear_eval(&now.kv_gen, 64),
                        sc.compute * rekv_linear_eval(&pr.kv_gen, 64), 1e-12));
    ck_assert(close_rel(rekv_linear_eval(&now.load_kv, 64),
                        sc.pcie * rekv_linear_eval(&pr.load_kv, 64), 1e-12));
    ck_assert(close_rel(now.t_load_w, sc.pcie * pr.t_load_w, 1e-12));
    /* nothing predicted on a side (resident's link): its scale stays */
    rekv_plan_scales r = {1, 1};
    rekv_plan_scales_observe(&r, 0.3, 0, 0.2, 0.1);
    ck_assert(r.pcie == 1 && close_rel(r.compute, 0.7 + 0.3 * 2, 1e-12));
}
END_TEST

/* Hybrid's pattern is, of the patterns a worker runs (both parts <= 8, lowest terms), the one
 * with the largest KV share priced within REKV_PLAN_MARGIN of the fastest by the step model,
 * brute force; never priced above 1:0 (all KV: offload's bytes). Where
 * the forward pass is most of the compute side and the link is fast (the cpu backend at 8
 * Gbit/s), it is 1:0, though Algorithm 1 — which balances recomputation against KV loads alone —
 * mixes in ACT blocks there (8:1, which ran at 0.58x offload); at 2 Gbit/s a mix beats both
 * ends. */
START_TEST(test_hybrid_pattern)
{
    const rekv_model_config opt = opt8_config;
    rekv_step_shape sh;
    shape_from_config(&opt, 1, 1536, 2, 0, &sh);
    /* the cpu backend's rates (this machine's profile of the model behind an 8 Gbit/s link) */
    rekv_cost_profile pr = {.h2d_bw = 1e9,
                            .h2d_latency = 1e-5,
                            .gemm_flops = 1.48e11,
                            .fwd_flops_rate = 2.7e10,
                            .attn_flops_rate = 2.56e9,
                            .load_kv = {3.6e-5, 4.1e-6},
                            .kv_gen = {4.6e-5, 3.0e-5}};
    for (int gbps = 0; gbps < 3; gbps++) {
        pr.h2d_bw = gbps == 0 ? 1e9 : gbps == 1 ? 0.25e9 : 0.05e9; /* 8, 2, 0.4 Gbit/s */
        int kv, act;
        rekv_step_cost c, any;
        ck_assert_int_eq(rekv_plan_hybrid_pattern(&pr, &sh, 0, &kv, &act, &c, NULL), 0);
        ck_assert(kv >= 0 && act >= 0 && kv <= 8 && act <= 8 && kv + act > 0);
        /* brute force: the fastest pattern's time, then the largest KV share within the margin */
        double f = (double)kv / (kv + act), t_min = INFINITY, f_best = -1;
        for (int pass = 0; pass < 2; pass++)
            for (int k = 0; k <= 8; k++)
                for (int a = 0; a <= 8; a++) {
                    if (k + a == 0)
                        continue;
                    sh.hybrid_kv_fraction = (double)k / (k + a);
                    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_HYBRID, &any, NULL),
                                     0);
                    if (pass == 0)
                        t_min = fmin(t_min, any.t_step);
                    else if (any.t_step <= t_min * (1 + REKV_PLAN_MARGIN))
                        f_best = fmax(f_best, sh.hybrid_kv_fraction);
                }
        ck_assert_msg(f == f_best && c.t_step <= t_min * (1 + REKV_PLAN_MARGIN),
                      "pattern %d:%d (%g s); the fastest %g s, the largest share within the "
                      "margin %g",
                      kv, act, c.t_step, t_min, f_best);
        rekv_step_cost kvc;
        ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_KV, &kvc, NULL), 0);
        ck_assert(c.t_step <= kvc.t_step);
        /* Algorithm 1 over the batch's context as all-KV */
        rekv_hybrid_params hp;
        rekv_plan_hybrid_params_for_batch(&hp, 1024, 1024, 8, 2, 0, 1536 / 16);
        rekv_hybrid_alloc ha;
        ck_assert_int_eq(rekv_plan_hybrid_alloc(&pr, &hp, &ha, NULL), 0);
        if (gbps == 0) { /* 8 Gbit/s: all KV, where Algorithm 1 recomputes some */
            ck_assert_msg(kv == 1 && act == 0, "8 Gbit/s: %d:%d", kv, act);
            ck_assert(c.t_step == kvc.t_step);
            ck_assert_msg(ha.act_parts > 0, "Algorithm 1 %d:%d", ha.kv_parts, ha.act_parts);
        }
        if (gbps == 1) { /* 2 Gbit/s: a mix beats both ends */
            ck_assert_msg(kv > 0 && act > 0, "2 Gbit/s: %d:%d", kv, act);
            rekv_step_cost all_act;
            sh.hybrid_kv_fraction = 0;
            ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_HYBRID, &all_act, NULL), 0);
            ck_assert(c.t_step < kvc.t_step && c.t_step < all_act.t_step);
        }
    }
    int kv, act;
    rekv_err e = {0};
    ck_assert_int_eq(rekv_plan_hybrid_pattern(&pr, &sh, -1, &kv, &act, NULL, &e), -EINVAL);
}
END_TEST

/* ---------------------------------------------------------------- chooser */

START_TEST(test_choose)
{
    rekv_step_cost c[REKV_TECH_COUNT];
    rekv_technique best;
    rekv_model_config opt = {.arch = REKV_ARCH_OPT,
                             .act = REKV_ACT_RELU,
                             .n_layers = 40,
                             .hidden = 5120,
                             .n_heads = 40,
                             .n_kv_heads = 40,
                             .head_dim = 128,
                             .ffn = 20480,
                             .dtype = REKV_DTYPE_F16};
    rekv_model_config llama = {.arch = REKV_ARCH_LLAMA,
                               .act = REKV_ACT_SILU,
                               .n_layers = 32,
                               .hidden = 4096,
                               .n_heads = 32,
                               .n_kv_heads = 8,
                               .head_dim = 128,
                               .ffn = 14336,
                               .dtype = REKV_DTYPE_BF16};
    rekv_step_shape sh;
    /* Llama-3-8B-like layer: 2*4096*4096 + 2*4096*1024 + 3*4096*14336 = 218,103,808 params. */
    shape_from_config(&llama, 8, 1024, 2, 1, &sh);
    ck_assert(sh.kv.weight_bytes == 2.0 * 218103808.0);
    ck_assert(sh.kv.fwd_flops == 2.0 * 8 * 218103808.0 + 4.0 * 8 * 1024 * 4096);
    ck_assert(sh.kv.kv_dim == 1024 && sh.kv.hidden == 4096);

    /* GQA, weights resident, fast GPU: activations are bigger than KV, so plain KV wins. */
    rekv_cost_profile pr = {.h2d_bw = 25e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    shape_from_config(&llama, 8, 1024, 2, 0, &sh);
    ck_assert_int_eq(rekv_plan_choose(&pr, &sh, &best, c, NULL), 0);
    ck_assert_int_eq(best, REKV_TECH_KV);
    ck_assert_int_eq(c[REKV_TECH_KVPR].kvpr_l, 0);

    /* OPT-13B-like MHA, big batch and context, weights resident, slow link: recompute pays, and
     * KVPR (a mix) is at least as good as either pure technique on PCIe-bound steps. */
    pr = (rekv_cost_profile){.h2d_bw = 16e9, .gemm_flops = 150e12};
    shape_from_config(&opt, 32, 2048, 2, 0, &sh);
    ck_assert_int_eq(rekv_plan_choose(&pr, &sh, &best, c, NULL), 0);
    ck_assert(best != REKV_TECH_KV);
    ck_assert(c[REKV_TECH_KVPR].t_step <= c[REKV_TECH_KV].t_step);
    ck_assert(c[REKV_TECH_KVPR].kvpr_l > 0 && c[REKV_TECH_KVPR].kvpr_l < 2048);
    for (int t = 0; t < REKV_TECH_COUNT; t++) {
        ck_assert(c[t].t_step == fmax(c[t].t_pcie, c[t].t_compute));
        ck_assert(c[best].t_step <= c[t].t_step);
    }
    ck_assert(c[REKV_TECH_ACT].bytes_h2d * 2 ==
              c[REKV_TECH_KV].bytes_h2d); /* MHA: X is half of K+V */

    /* Hybrid at kv_fraction 1 with nothing on the GPU is plain KV; at 0 it is all ACT. */
    sh.hybrid_kv_fraction = 1;
    rekv_step_cost h;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_HYBRID, &h, NULL), 0);
    ck_assert(h.bytes_h2d == c[REKV_TECH_KV].bytes_h2d && h.t_step == c[REKV_TECH_KV].t_step);
    sh.hybrid_kv_fraction = 0;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_HYBRID, &h, NULL), 0);
    ck_assert(h.bytes_h2d == c[REKV_TECH_ACT].bytes_h2d && h.t_step == c[REKV_TECH_ACT].t_step);
    /* GPU-resident ACT costs recompute, not bytes */
    sh.act_gpu_tokens = 32 * 1024;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_HYBRID, &h, NULL), 0);
    ck_assert(h.bytes_h2d * 2 == c[REKV_TECH_ACT].bytes_h2d);
    ck_assert(h.recompute_flops == c[REKV_TECH_ACT].recompute_flops);

    rekv_err err = {0};
    sh.hybrid_kv_fraction = 2;
    ck_assert_int_eq(rekv_plan_choose(&pr, &sh, &best, NULL, &err), -EINVAL);
}
END_TEST

/* The worker's mode: resident when the cache fits the device, else the cheapest technique, with
 * hybrid priced at the KV share where its link and compute times meet. */
START_TEST(test_pick_mode)
{
    rekv_model_config opt = opt_6_7b;
    rekv_plan_model optm;
    rekv_plan_model_from_config(&opt, &optm);
    rekv_cost_profile pr = {.h2d_bw = 25e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    rekv_mode_pick m;
    /* 64 sequences of 544 tokens, fp16: 2*4096*2*64*544*32 bytes = 18.25 GB */
    double kv = 2.0 * 4096 * 2 * 64 * 544 * 32;
    ck_assert_int_eq(rekv_plan_pick_mode(&pr, &optm, 64, 544, 2, kv, 0, NULL, &m, NULL), 0);
    ck_assert(m.resident && m.kv_bytes == kv);
    ck_assert_int_eq(rekv_plan_pick_mode(&pr, &optm, 64, 544, 2, -1, 0, NULL, &m, NULL), 0);
    ck_assert(m.resident); /* unknown device memory (the cpu backend): resident */
    ck_assert_int_eq(rekv_plan_pick_mode(&pr, &optm, 64, 544, 2, kv - 1, 0, NULL, &m, NULL), 0);
    ck_assert(!m.resident);
    /* room for all but one byte: beside a step's streaming buffers, each sequence keeps most of
     * its tokens on the device (the rule the worker keeps them by) */
    double stream = rekv_cost_stream_token_bytes(4096, 4096, 2), kv_tok = 2.0 * 4096 * 2 * 32;
    ck_assert_int_eq(m.device_tokens, rekv_cost_device_tokens(kv - 1, 64, 544, kv_tok, stream));
    ck_assert_int_eq(m.device_tokens, (int64_t)((kv - 1 - 64 * 544 * stream) / (64 * kv_tok)));
    ck_assert(m.device_tokens > 272); /* past the mean context: nothing moves, KV fetching wins */
    ck_assert_int_eq(m.tech, REKV_TECH_KV);
    ck_assert(m.costs[REKV_TECH_KV].bytes_h2d == 0);
    /* a quarter of the room: 34 tokens each on the device, the rest of the mean context moves */
    ck_assert_int_eq(rekv_plan_pick_mode(&pr, &optm, 64, 544, 2, kv / 4, 0, NULL, &m, NULL), 0);
    ck_assert(!m.resident);
    ck_assert_int_eq(m.device_tokens, rekv_cost_device_tokens(kv / 4, 64, 544, kv_tok, stream));
    ck_assert(m.device_tokens > 0 && m.device_tokens < 272);
    ck_assert(m.costs[REKV_TECH_KV].bytes_h2d == 64.0 * (272 - m.device_tokens) * 2 * 4096 * 2);
    /* MHA, fast GPU, PCIe-bound: recomputation pays, so not plain KV fetching */
    ck_assert(m.tech != REKV_TECH_KV);
    ck_assert(m.hybrid_kv_fraction >= 0 && m.hybrid_kv_fraction <= 1);
    for (int t = 0; t < REKV_TECH_COUNT; t++)
        ck_assert(m.costs[m.tech].t_step <= m.costs[t].t_step);
    /* hybrid is priced at its pattern, the fastest a worker can run */
    const rekv_step_cost *h = &m.costs[REKV_TECH_HYBRID];
    int kvp, actp;
    rekv_step_shape hs;
    rekv_plan_shape(&optm, 64, 272, 2, 0, &hs);
    hs.device_tokens = m.device_tokens;
    ck_assert_int_eq(rekv_plan_hybrid_pattern(&pr, &hs, 0, &kvp, &actp, NULL, NULL), 0);
    ck_assert(m.hybrid_kv_fraction == (double)kvp / (kvp + actp));
    ck_assert(h->t_step <= m.costs[REKV_TECH_KV].t_step &&
              h->t_step <= m.costs[REKV_TECH_ACT].t_step * (1 + REKV_PLAN_MARGIN));
    /* a GPU so slow that every recomputation costs more than the link: KV fetching */
    pr.gemm_flops = 1e9;
    ck_assert_int_eq(rekv_plan_pick_mode(&pr, &optm, 64, 544, 2, 0, 0, NULL, &m, NULL), 0);
    ck_assert(!m.resident);
    ck_assert_int_eq(m.tech, REKV_TECH_KV);
    ck_assert(m.hybrid_kv_fraction == 1);
    rekv_err e = {0};
    ck_assert_int_eq(rekv_plan_pick_mode(&pr, &optm, 0, 544, 2, 0, 0, NULL, &m, &e), -EINVAL);
}
END_TEST

/* The device-resident part: every exact technique moves and recomputes only the context past it
 * (the same bytes and FLOP as a context that much shorter, the forward pass's attention still
 * over the whole context), KVPR's split counts from the context's start, infinigen ignores it,
 * and a part covering the context leaves nothing to move. */
START_TEST(test_device_part)
{
    rekv_model_config opt = opt_6_7b;
    rekv_cost_profile pr = {.h2d_bw = 25e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    rekv_step_shape whole, part, shorter;
    shape_from_config(&opt, 64, 512, 2, 0, &whole);
    whole.hybrid_kv_fraction = 0.5;
    part = whole;
    part.device_tokens = 128;
    shorter = whole;
    shorter.kv.s = 384; /* fwd_flops stays the whole context's */
    for (int t = 0; t <= REKV_TECH_INFINIGEN; t++) {
        rekv_step_cost a, b, w;
        ck_assert_int_eq(rekv_plan_step_cost(&pr, &part, (rekv_technique)t, &a, NULL), 0);
        ck_assert_int_eq(rekv_plan_step_cost(&pr, &shorter, (rekv_technique)t, &b, NULL), 0);
        ck_assert_int_eq(rekv_plan_step_cost(&pr, &whole, (rekv_technique)t, &w, NULL), 0);
        if (t == REKV_TECH_INFINIGEN) { /* selects past the part, scores the whole context */
            ck_assert(a.bytes_h2d == b.bytes_h2d && a.bytes_h2d < w.bytes_h2d);
            ck_assert(a.speculate_flops == w.speculate_flops &&
                      a.speculate_flops > b.speculate_flops);
            continue;
        }
        ck_assert_msg(a.bytes_h2d == b.bytes_h2d && a.recompute_flops == b.recompute_flops &&
                          a.t_step == b.t_step,
                      "technique %d: %g bytes with the part, %g for the shorter context", t,
                      a.bytes_h2d, b.bytes_h2d);
        ck_assert(a.bytes_h2d < w.bytes_h2d);
        if (t == REKV_TECH_KVPR)
            ck_assert_int_eq(a.kvpr_l, 128 + b.kvpr_l);
    }
    part.device_tokens = 600; /* more than the context */
    rekv_step_cost c[REKV_TECH_COUNT];
    rekv_technique best;
    ck_assert_int_eq(rekv_plan_choose(&pr, &part, &best, c, NULL), 0);
    ck_assert_int_eq(best, REKV_TECH_KV);
    for (int t = 0; t < REKV_TECH_COUNT; t++)
        ck_assert(c[t].bytes_h2d == 0 && c[t].recompute_flops == 0);
    ck_assert_int_eq(c[REKV_TECH_KVPR].kvpr_l, 512);
    part.device_tokens = -1;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &part, REKV_TECH_KV, &c[0], NULL), -EINVAL);
    /* the rule: nothing without room, the streaming buffers first, at most the capacity */
    ck_assert_int_eq(rekv_cost_device_tokens(0, 8, 100, 1000, 10), 0);
    ck_assert_int_eq(rekv_cost_device_tokens(-1, 8, 100, 1000, 10), 0);
    ck_assert_int_eq(rekv_cost_device_tokens(8 * 100 * 10, 8, 100, 1000, 10), 0);
    ck_assert_int_eq(rekv_cost_device_tokens(8 * 100 * 10 + 8 * 1000 * 42, 8, 100, 1000, 10), 42);
    ck_assert_int_eq(rekv_cost_device_tokens(1e12, 8, 100, 1000, 10), 100);
}
END_TEST

/* InfiniGen is approximate: rekv_plan_pick_mode prices it only when allowed, and picks it only
 * when it is strictly cheaper than every exact technique — on a slow link at a small fraction f,
 * never when it is not allowed, never at f = 1 (the same bytes as KV, plus the speculation), and
 * not at f = 0.9 on a step whose compute is close to its link time (the speculation tips it). */
START_TEST(test_pick_infinigen)
{
    rekv_model_config opt = opt_6_7b;
    rekv_plan_model optm;
    rekv_plan_model_from_config(&opt, &optm);
    double kv = 2.0 * 4096 * 2 * 64 * 544 * 32; /* 64 sequences of 544 tokens, fp16 */
    rekv_cost_profile slow = {.h2d_bw = 2e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    rekv_mode_pick ex, ap;
    /* room for the partial keys (fp32, 0.3 of an fp16 cache) and a step's attention buffers
     * (0.0625) but for no device-resident part (the streaming buffers of 64 x 544 tokens take
     * 0.1875 of the cache) */
    double room = 0.38 * kv;
    rekv_plan_approx prior = {0}, f1 = {1.0, 0}, f01 = {0.1, 0};

    /* slow link, prior f = 0.2: allowed, infinigen; not allowed, the same exact pick as ever */
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, room, 0, NULL, &ex, NULL), 0);
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, room, 0, &prior, &ap, NULL), 0);
    ck_assert(!ex.resident && !ap.resident && !ex.approximate && ap.approximate);
    ck_assert(ex.tech < REKV_TECH_COUNT);
    ck_assert_int_eq(ap.tech, REKV_TECH_INFINIGEN);
    ck_assert(ap.infinigen_fits && ap.infinigen_fraction == REKV_PLAN_INFINIGEN_PRIOR);
    for (int t = 0; t < REKV_TECH_COUNT; t++) /* the exact prices do not change */
        ck_assert(ex.costs[t].t_step == ap.costs[t].t_step);
    ck_assert(ex.costs[REKV_TECH_INFINIGEN].t_step == 0);
    rekv_step_cost ig = ap.costs[REKV_TECH_INFINIGEN];
    ck_assert(ig.t_step < ap.costs[ex.tech].t_step);
    /* the price: layer 0 all of KV's bytes, the other 31 layers f of them; the speculation (KV
     * priced here without a device part, as infinigen has none in this room while the exact
     * techniques keep one in what its partial keys would take) */
    ck_assert_int_eq(ap.device_tokens, 0);
    ck_assert(ex.device_tokens > 0);
    rekv_step_shape sh0;
    rekv_step_cost kvc;
    rekv_plan_shape(&optm, 64, 272, 2, 0, &sh0);
    ck_assert_int_eq(rekv_plan_step_cost(&slow, &sh0, REKV_TECH_KV, &kvc, NULL), 0);
    ck_assert(close_rel(ig.bytes_h2d, kvc.bytes_h2d * (1 + 31 * 0.2) / 32, 1e-12));
    double spec = 31.0 / 32 * 2 * (0.3 * 4096) * (64.0 * 4096 + 64.0 * 272);
    ck_assert(close_rel(ig.speculate_flops, spec, 1e-12));
    ck_assert(
        close_rel(ig.t_compute * slow.gemm_flops, kvc.t_compute * slow.gemm_flops + spec, 1e-12));
    /* a smaller measured f is cheaper still */
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, room, 0, &f01, &ap, NULL), 0);
    ck_assert_int_eq(ap.tech, REKV_TECH_INFINIGEN);
    ck_assert(ap.costs[REKV_TECH_INFINIGEN].t_step < ig.t_step);

    ck_assert_int_eq(ap.device_tokens, 0);
    /* a room past the partial keys holds a device-resident part that infinigen attends whole:
     * only the context past it is fetched (and selected among), the speculation is the same */
    rekv_mode_pick big, small;
    rekv_plan_approx f002 = {0.02, 0};
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, 0.6 * kv, 0, &f002, &big, NULL),
                     0);
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, room, 0, &f002, &small, NULL),
                     0);
    ck_assert_int_eq(big.tech, REKV_TECH_INFINIGEN);
    ck_assert(big.device_tokens > 0 && big.device_tokens < 544);
    ck_assert_int_eq(small.device_tokens, 0);
    ck_assert(close_rel(big.costs[REKV_TECH_INFINIGEN].bytes_h2d,
                        small.costs[REKV_TECH_INFINIGEN].bytes_h2d *
                            (272.0 - (double)big.device_tokens) / 272.0,
                        1e-12));
    ck_assert(big.costs[REKV_TECH_INFINIGEN].speculate_flops ==
              small.costs[REKV_TECH_INFINIGEN].speculate_flops);

    /* f = 1 moves what KV does and computes more: never strictly cheaper */
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, room, 0, &f1, &ap, NULL), 0);
    ck_assert_int_eq(ap.tech, ex.tech);
    ck_assert(close_rel(ap.costs[REKV_TECH_INFINIGEN].bytes_h2d, kvc.bytes_h2d, 1e-12));

    /* a tie is not enough: GQA with a fast GPU, where plain KV fetching is the best exact
     * technique and the speculation hides under the link time, at f = 1 */
    rekv_model_config llama = {.arch = REKV_ARCH_LLAMA,
                               .act = REKV_ACT_SILU,
                               .n_layers = 32,
                               .hidden = 4096,
                               .n_heads = 32,
                               .n_kv_heads = 8,
                               .head_dim = 128,
                               .ffn = 14336,
                               .dtype = REKV_DTYPE_BF16};
    rekv_plan_model llm;
    rekv_plan_model_from_config(&llama, &llm);
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &llm, 64, 544, 2, 1e9, 0, &f1, &ap, NULL), 0);
    ck_assert(ap.costs[REKV_TECH_INFINIGEN].t_step == ap.costs[REKV_TECH_KV].t_step);
    ck_assert_int_eq(ap.tech, REKV_TECH_KV);

    /* the partial keys (0.3 of K, all layers) and the attention buffers must fit the room */
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, 0.1 * kv, 0, &f01, &ap, NULL),
                     0);
    ck_assert(!ap.infinigen_fits && ap.tech != REKV_TECH_INFINIGEN);
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, 0.34 * kv, 0, &f01, &ap, NULL),
                     0);
    ck_assert(!ap.infinigen_fits && ap.tech != REKV_TECH_INFINIGEN);

    /* with layer 0's split (infinigen_recompute): the planner's where the room holds its
     * recomputation rows, else as many as it holds — here (0.38 - 0.3625) of the cache over 64
     * sequences' 64 KiB per token, 76 tokens */
    rekv_plan_approx rec = {0.1, 1};
    rekv_mode_pick wide, narrow;
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, 0.6 * kv, 0, &rec, &wide, NULL),
                     0);
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, room, 0, &rec, &narrow, NULL),
                     0);
    rekv_step_cost wi = wide.costs[REKV_TECH_INFINIGEN], na = narrow.costs[REKV_TECH_INFINIGEN];
    ck_assert_int_eq(narrow.device_tokens, 0);
    int64_t cap = (int64_t)((0.38 - 0.3625) * kv / (64.0 * 65536));
    ck_assert_int_eq(cap, 76);
    ck_assert_msg(wi.kvpr_l - wide.device_tokens > cap && na.kvpr_l == cap,
                  "splits %lld (device part %lld), %lld", (long long)wi.kvpr_l,
                  (long long)wide.device_tokens, (long long)na.kvpr_l);
    rekv_step_shape capped;
    rekv_plan_shape(&optm, 64, 272, 2, 0, &capped);
    capped.infinigen_fraction = 0.1;
    capped.infinigen_split = cap;
    ck_assert_int_eq(rekv_plan_step_cost(&slow, &capped, REKV_TECH_INFINIGEN, &ig, NULL), 0);
    ck_assert(ig.t_step == na.t_step && na.recompute_flops > 0);

    /* f = 0.9 where a KV step's compute is 0.99 of its link time (no device part): fewer bytes,
     * but the speculation makes compute the longer side, longer than the KV step */
    rekv_step_shape sh;
    rekv_step_cost c;
    rekv_plan_shape(&optm, 64, 272, 2, 0, &sh);
    ck_assert_int_eq(rekv_plan_step_cost(&slow, &sh, REKV_TECH_KV, &c, NULL), 0);
    rekv_cost_profile tight = slow;
    tight.gemm_flops = sh.kv.fwd_flops / (0.99 * c.t_pcie);
    ck_assert_int_eq(rekv_plan_step_cost(&tight, &sh, REKV_TECH_KV, &c, NULL), 0);
    sh.infinigen_fraction = 0.9;
    ck_assert_int_eq(rekv_plan_step_cost(&tight, &sh, REKV_TECH_INFINIGEN, &ig, NULL), 0);
    double no_spec = fmax(ig.t_pcie, sh.kv.fwd_flops / tight.gemm_flops);
    ck_assert_msg(no_spec < c.t_step, "without the speculation infinigen (%g) would win (%g)",
                  no_spec, c.t_step);
    ck_assert(ig.t_step > c.t_step);

    /* not allowed: never, whatever the link */
    for (double bw = 1e8; bw <= 1e12; bw *= 10) {
        rekv_cost_profile p = slow;
        p.h2d_bw = bw;
        ck_assert_int_eq(rekv_plan_pick_mode(&p, &optm, 64, 544, 2, room, 0, NULL, &ex, NULL), 0);
        ck_assert(ex.tech < REKV_TECH_COUNT && !ex.approximate);
    }

    /* bad infinigen shapes are refused */
    rekv_err e = {0};
    sh.infinigen_fraction = 1.5;
    ck_assert_int_eq(rekv_plan_step_cost(&slow, &sh, REKV_TECH_INFINIGEN, &c, &e), -EINVAL);
    sh.infinigen_fraction = 0.2;
    sh.n_layers = 0;
    ck_assert_int_eq(rekv_plan_step_cost(&slow, &sh, REKV_TECH_INFINIGEN, &c, &e), -EINVAL);
}
END_TEST

/* The coordinator's plan state for a worker in `mode` on an OPT-like model (8 layers, hidden 1024,
 * fp16 cache) over a 2 GB/s link at gemm_flops, its pipeline made with `split`. */
static void plan_state_8l_split(co_plan_state *ps, const char *mode, double gemm_flops,
                                uint32_t split)
{
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = 2e9;
    cp.gemm_flops = gemm_flops;
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.mode = (char *)mode;
    h.profile = &cp;
    h.hidden = h.kv_dim = h.q_dim = 1024;
    h.n_layers = 8;
    h.cache_elem_bytes = 2;
    h.layer_params = 12 * 1024 * 1024;
    h.split = split;
    co_plan_init(ps, &h);
}

static void plan_state_8l(co_plan_state *ps, const char *mode, double gemm_flops)
{
    plan_state_8l_split(ps, mode, gemm_flops, 0);
}

/* Chunked prefill's chunk: the cap until a step is predicted; then the prompt tokens whose GEMMs
 * and attention take half a predicted decode step (a multiple of 16 from 16 up, at least 1); the
 * attention priced over the longest prompt being prefilled, at the chunk rate where there is one
 * (else the decode-shape rate). */
START_TEST(test_co_plan_prefill_chunk)
{
    co_plan_state ps;
    plan_state_8l(&ps, "offload", 1e12);
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 4096), 512); /* nothing predicted yet */
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 0, 4096), 0);
    double per_token = 2.0 * 12 * 1024 * 1024 * 8 / 1e12;
    ps.pred_step_s = 200.5 * per_token;
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 4096), 96); /* no attention rate */
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 80, 4096), 80);
    /* attention at a rate where a 4096-token prompt's last token costs its GEMMs again */
    ps.prof.attn_flops_rate = 4.0 * 1024 * 4096 * 8 / per_token;
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 4096), 48);
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 0), 96);
    ps.prof.attn_chunk_flops_rate = 3 * ps.prof.attn_flops_rate; /* a third: 75 tokens */
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 4096), 64);
    ps.pred_step_s = 10 * per_token; /* a cheap decode step: 3.75 tokens a step */
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 4096), 3);
    ps.pred_step_s = 0.5 * per_token; /* less than one token's worth: still one */
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 4096), 1);
    ps.pred_step_s = 10 * per_token; /* GEMMs alone: 5 tokens, or the cap below it */
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 0), 5);
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 4, 0), 4);
    ps.pred_step_s = 1e6 * per_token;
    ck_assert_uint_eq(co_plan_prefill_chunk(&ps, 512, 64), 512);
}
END_TEST

/* An infinigen worker (Hello mode "infinigen"): the coordinator keeps the fraction its selecting
 * layers fetched (Counters.tokens_selected / tokens_considered, summed over its steps) and prices
 * the next step's prediction at it, the prior 0.2 before any measurement. */
START_TEST(test_co_plan_selected_fraction)
{
    co_plan_state ps;
    plan_state_8l(&ps, "infinigen", 300e12);
    ck_assert(ps.have_profile && ps.mode == REKV_MODE_INFINIGEN);
    ck_assert(co_plan_selected_fraction(&ps) == 0);
    uint64_t jobs[2] = {1, 2}, mb_job[2];
    uint32_t mb_index[2];
    int64_t ctx[2] = {1024, 1024};
    Rekv__Worker__StepParams sp;
    ck_assert_int_eq(co_plan_step(&ps, jobs, ctx, NULL, 2, 0, 0, &sp, mb_job, mb_index), 1);
    /* the prior: layer 0 all of the context's KV, the other 7 layers 0.2 of it */
    double kv_step = 2 * 1024.0 * 2 * 2 * 1024 * 8; /* offload's KV bytes of the step */
    double pcie_prior = ps.pred_pcie_s;
    ck_assert(close_rel(pcie_prior, kv_step * (1 + 7 * 0.2) / 8 / 2e9, 1e-9));
    Rekv__Worker__Counters c = REKV__WORKER__COUNTERS__INIT;
    c.tokens_considered = 20000; /* two steps: 5% selected, then 15% */
    c.tokens_selected = c.tokens_considered / 20;
    co_plan_observe(&ps, &c, &(co_plan_pred){0, 0});
    c.tokens_selected = c.tokens_considered * 3 / 20;
    co_plan_observe(&ps, &c, &(co_plan_pred){0, 0});
    ck_assert(close_rel(co_plan_selected_fraction(&ps), 0.1, 1e-12));
    ck_assert_int_eq(co_plan_step(&ps, jobs, ctx, NULL, 2, 0, 0, &sp, mb_job, mb_index), 1);
    ck_assert(close_rel(ps.pred_pcie_s, kv_step * (1 + 7 * 0.1) / 8 / 2e9, 1e-9));
    ck_assert_int_eq(sp.split, 0); /* made without a split: no activations to recompute from */
    Rekv__Worker__StoreRoom room = REKV__WORKER__STORE_ROOM__INIT;
    room.host_bytes = 1ull << 30;
    room.kv_block_bytes = 65536;
    room.act_block_bytes = 32768;
    co_plan_store(&ps, &room);
    ck_assert_uint_eq(co_plan_job_store_bytes(&ps, 160, 0, 0), 8ull * 10 * 65536);

    /* made with a split (Hello.split): each step gets layer 0's, the planner's, and a job's
     * activations take store bytes beside its K,V */
    co_plan_state pa;
    plan_state_8l_split(&pa, "infinigen", 300e12, 100);
    ck_assert(pa.keeps_act);
    ck_assert_int_eq(co_plan_step(&pa, jobs, ctx, NULL, 2, 0, 0, &sp, mb_job, mb_index), 1);
    rekv_step_shape sh;
    rekv_plan_model pm = {1024, 1024, 1024, 8, 12.0 * 1024 * 1024, 2};
    rekv_plan_shape(&pm, 2, 1024, 2, 0, &sh);
    sh.infinigen_split = -1;
    rekv_step_cost want;
    ck_assert_int_eq(rekv_plan_step_cost(&pa.prof, &sh, REKV_TECH_INFINIGEN, &want, NULL), 0);
    ck_assert(want.kvpr_l > 0);
    ck_assert_int_eq(sp.split, want.kvpr_l);
    ck_assert(close_rel(pa.pred_step_s, want.t_step * 8, 1e-9));
    co_plan_store(&pa, &room);
    ck_assert_uint_eq(co_plan_job_store_bytes(&pa, 160, 0, 0), 8ull * 10 * (65536 + 32768));
}
END_TEST

/* A step's measured busy times rescale the profile against that step's own prediction, not the
 * last one planned (with two Plans out that is the next step's): compute measured at twice its
 * prediction raises the compute scale though it is below the last plan's; a link with no
 * prediction leaves the link scale alone. */
START_TEST(test_co_plan_observe_own_prediction)
{
    co_plan_state ps;
    plan_state_8l(&ps, "offload", 1e12);
    ps.pred_compute_s = 1.0; /* the next step's */
    Rekv__Worker__Counters c = REKV__WORKER__COUNTERS__INIT;
    c.compute_busy_s = 0.2;
    c.h2d_busy_s = 0.5;
    co_plan_observe(&ps, &c, &(co_plan_pred){0, 0.1});
    ck_assert(close_rel(ps.scales.compute, 0.7 + 0.3 * 2, 1e-12));
    ck_assert(ps.scales.pcie == 1);
}
END_TEST

/* A worker's Hello for the planner in the loop: mode, the profile, a synthetic OPT's shape (8
 * layers, hidden 1024, fp16 cache). */
static void opt8_hello(Rekv__Worker__Hello *h, Rekv__Worker__CostProfile *cp, const char *mode)
{
    rekv__worker__hello__init(h);
    h->mode = (char *)mode;
    h->profile = cp;
    h->hidden = h->kv_dim = h->q_dim = 1024;
    h->n_layers = 8;
    h->cache_elem_bytes = 2;
    h->layer_params = 12 * 1024 * 1024;
}

/* The planner in the loop splits a batch into mini-batches that fit the worker's device room:
 * with less room, more (and smaller) mini-batches, each within the capacity unless one job alone
 * is bigger. */
START_TEST(test_co_plan_device_room)
{
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = 16e9;
    cp.gemm_flops = 50e12;
    cp.load_kv_b = 2e-6;
    cp.kv_gen_b = 1e-6;
    Rekv__Worker__Hello h;
    opt8_hello(&h, &cp, "act");
    enum { N = 16 };
    uint64_t jobs[N], mb_job[N];
    uint32_t mb_index[N];
    int64_t ctx[N];
    for (int i = 0; i < N; i++) {
        jobs[i] = (uint64_t)i + 1;
        ctx[i] = 256 + 32 * i;
    }
    int batches[3];
    uint64_t rooms[3] = {0, 64ull << 20, 24ull << 20};
    for (int r = 0; r < 3; r++) {
        h.device_buffer_bytes = rooms[r];
        co_plan_state ps;
        co_plan_init(&ps, &h);
        int64_t cap = co_plan_block_capacity(&ps);
        ck_assert(rooms[r] == 0 ? cap == 0 : cap > 0);
        Rekv__Worker__StepParams sp;
        ck_assert_int_eq(co_plan_step(&ps, jobs, ctx, NULL, N, 0, 0, &sp, mb_job, mb_index), 1);
        batches[r] = (int)sp.gpu_batches;
        if (cap > 0 && sp.gpu_batches > 1) { /* each mini-batch's ACT blocks fit the room */
            int64_t used[64] = {0};
            for (int i = 0; i < N; i++)
                used[mb_index[i]] += (ctx[i] + 15) / 16;
            for (uint32_t b = 0; b < sp.gpu_batches; b++)
                ck_assert_msg(used[b] <= cap, "mini-batch %u holds %lld blocks, room %lld", b,
                              (long long)used[b], (long long)cap);
        }
    }
    ck_assert_msg(batches[2] > batches[0], "24 MiB of room gives %d mini-batches, no limit %d",
                  batches[2], batches[0]);
    ck_assert(batches[1] >= batches[0] && batches[2] >= batches[1]);
}
END_TEST

/* The planner in the loop with a worker's device-resident part (Hello.device_tokens): KVPR's split
 * is the part plus the solver's split of the rest, and the step is priced for the rest only. */
START_TEST(test_co_plan_device_part)
{
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = 2e9;
    cp.gemm_flops = 50e12;
    Rekv__Worker__Hello h;
    opt8_hello(&h, &cp, "kvpr");
    enum { N = 4 };
    uint64_t jobs[N] = {1, 2, 3, 4}, mb_job[N];
    uint32_t mb_index[N];
    int64_t ctx[N] = {600, 600, 600, 600};
    co_plan_state none, part;
    Rekv__Worker__StepParams a, b;
    co_plan_init(&none, &h);
    ck_assert_int_eq(co_plan_step(&none, jobs, ctx, NULL, N, 0, 0, &a, mb_job, mb_index), 1);
    h.device_tokens = 200;
    co_plan_init(&part, &h);
    ck_assert_int_eq(co_plan_step(&part, jobs, ctx, NULL, N, 0, 0, &b, mb_job, mb_index), 1);
    /* the rest, 400 tokens, split as a 400-token context would be */
    int64_t c400[N] = {400, 400, 400, 400};
    co_plan_state shorter;
    Rekv__Worker__StepParams s;
    h.device_tokens = 0;
    co_plan_init(&shorter, &h);
    ck_assert_int_eq(co_plan_step(&shorter, jobs, c400, NULL, N, 0, 0, &s, mb_job, mb_index), 1);
    ck_assert_msg(a.split > 0 && s.split > 0, "recomputation pays on this link: %d, %d", a.split,
                  s.split);
    ck_assert_int_eq(b.split, 200 + s.split);
    ck_assert(part.pred_pcie_s < none.pred_pcie_s);
}
END_TEST

/* The planner in the loop for a hybrid worker: the pattern its joining jobs are charged at
 * (co_plan_job_store_bytes) and made with (the Plan's StepParams) is one choice,
 * co_plan_join_pattern's — Algorithm 1's while the store's room takes every waiting job, the
 * demand rule's when it binds, 1:1 (the worker's own) for a worker without a profile — and the
 * budget admission counts is the arena, or arena + spill within the layer window. */
START_TEST(test_co_plan_join_pattern)
{
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = 0.5e9; /* rebuilding a token's K,V costs about what moving them does */
    cp.gemm_flops = 0.5e12;
    cp.load_kv_b = 1e-6;
    cp.kv_gen_b = 1e-6;
    cp.t_load_w = 0.05;    /* each step streams the weights (HybridServe's setting): a step's */
    Rekv__Worker__Hello h; /* sequences share that cost, so admitting more pays */
    opt8_hello(&h, &cp, "hybrid");
    h.offload_weights = 1;
    co_plan_state ps;
    co_plan_init(&ps, &h);
    Rekv__Worker__StoreRoom room = REKV__WORKER__STORE_ROOM__INIT;
    room.instance = 7;
    room.host_bytes = 256ull << 20;
    room.kv_block_bytes = 2 * 1024 * 16 * 2; /* 64 KiB */
    room.act_block_bytes = 1024 * 16 * 2;
    co_plan_store(&ps, &room);
    ck_assert_uint_eq(co_plan_store_budget(&ps), 256ull << 20);

    enum { N = 48 };
    rekv_hybrid_seq wait[N];
    for (int i = 0; i < N; i++)
        wait[i] = (rekv_hybrid_seq){.tokens = 480, .full_tokens = 512};
    int kv, act, kv0, act0;
    uint64_t jobs[N], mb_job[N];
    uint32_t mb_index[N];
    int64_t ctx[N];
    for (int i = 0; i < N; i++)
        jobs[i] = (uint64_t)i + 1, ctx[i] = 480;
    Rekv__Worker__StepParams sp;
    /* ample room: Algorithm 1's pattern, the one co_plan_step picks by itself (0:0) */
    co_plan_join_pattern(&ps, NULL, 0, wait, N, 1ull << 40, &kv, &act);
    ck_assert_int_eq(ps.join_binding, 0);
    ck_assert_int_eq(co_plan_step(&ps, jobs, ctx, NULL, N, 0, 0, &sp, mb_job, mb_index), 1);
    ck_assert(sp.kv_parts == (uint32_t)kv && sp.act_parts == (uint32_t)act);
    kv0 = kv, act0 = act;
    /* the room binds: ACT-heavier, and the Plan carries what admission charged */
    uint64_t at1 = co_plan_job_store_bytes(&ps, 512, kv0, act0);
    ck_assert(at1 == (uint64_t)rekv_plan_hybrid_job_bytes(32, kv0, act0, 8, 65536, 32768));
    uint64_t left = 8 * at1 + at1 / 2; /* 8 jobs at Algorithm 1's pattern */
    co_plan_join_pattern(&ps, NULL, 0, wait, N, left, &kv, &act);
    ck_assert_int_eq(ps.join_binding, 1);
    ck_assert_msg((double)kv / (kv + act) < (double)kv0 / (kv0 + act0),
                  "binding: %d:%d, Algorithm 1 %d:%d", kv, act, kv0, act0);
    ck_assert(left / co_plan_job_store_bytes(&ps, 512, kv, act) > 8);
    double frac[N];
    for (int i = 0; i < N; i++)
        frac[i] = 0.5;
    ck_assert_int_eq(co_plan_step(&ps, jobs, ctx, frac, 8, kv, act, &sp, mb_job, mb_index), 1);
    ck_assert(sp.kv_parts == (uint32_t)kv && sp.act_parts == (uint32_t)act);
    ck_assert_uint_eq(co_plan_job_store_bytes(&ps, 512, 0, 0),
                      co_plan_job_store_bytes(&ps, 512, 1, 1));

    /* the spill tier: up to arena + spill while one layer of the batch fits a window (half the
     * arena less two big slots); infinigen pins whole steps, so its budget is the arena */
    room.spill_room_bytes = 64ull << 20;
    co_plan_store(&ps, &room);
    ck_assert_uint_eq(co_plan_store_budget(&ps), (256ull + 64) << 20);
    room.spill_room_bytes = 1ull << 40;
    co_plan_store(&ps, &room);
    uint64_t win = ((256ull << 20) - 2 * 65536) / 2;
    ck_assert_uint_eq(co_plan_store_budget(&ps), win * 8 + 7);
    co_plan_state ig;
    opt8_hello(&h, &cp, "infinigen");
    co_plan_init(&ig, &h);
    co_plan_store(&ig, &room);
    ck_assert_uint_eq(co_plan_store_budget(&ig), 256ull << 20);

    /* no profile: the worker keeps its 1:1, and so does admission */
    h.profile = NULL;
    h.mode = "hybrid";
    co_plan_init(&ps, &h);
    co_plan_store(&ps, &room);
    co_plan_join_pattern(&ps, NULL, 0, wait, N, left, &kv, &act);
    ck_assert(kv == 1 && act == 1);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("planner");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_fit_exact);
    tcase_add_test(tc, test_fwd_rates);
    tcase_add_test(tc, test_fit_noisy);
    tcase_add_test(tc, test_kvpr_brute_force);
    tcase_add_test(tc, test_kvpr_choose);
    tcase_add_test(tc, test_infinigen_split);
    tcase_add_test(tc, test_kvpr_gqa_zero);
    tcase_add_test(tc, test_kvpr_mha_closed_form);
    tcase_add_test(tc, test_kvpr_edges);
    tcase_add_test(tc, test_hybrid_hand_act_init);
    tcase_add_test(tc, test_hybrid_hand_kv_init);
    tcase_add_test(tc, test_hybrid_hand_intercepts);
    tcase_add_test(tc, test_hybrid_capacity);
    tcase_add_test(tc, test_hybrid_next_block);
    tcase_add_test(tc, test_hybrid_job_bytes);
    tcase_add_test(tc, test_hybrid_demand);
    tcase_add_test(tc, test_mb_fb);
    tcase_add_test(tc, test_mb_constructed);
    tcase_add_test(tc, test_mb_random);
    tcase_add_test(tc, test_choose);
    tcase_add_test(tc, test_step_cost_two_rates);
    tcase_add_test(tc, test_scales_correct_profile);
    tcase_add_test(tc, test_hybrid_pattern);
    tcase_add_test(tc, test_pick_mode);
    tcase_add_test(tc, test_device_part);
    tcase_add_test(tc, test_co_plan_device_part);
    tcase_add_test(tc, test_pick_infinigen);
    tcase_add_test(tc, test_co_plan_device_room);
    tcase_add_test(tc, test_co_plan_selected_fraction);
    tcase_add_test(tc, test_co_plan_observe_own_prediction);
    tcase_add_test(tc, test_co_plan_prefill_chunk);
    tcase_add_test(tc, test_co_plan_join_pattern);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
