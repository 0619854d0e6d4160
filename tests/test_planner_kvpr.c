/* test_planner_kvpr.c — the planner's cost model against brute force, hand-worked examples
 * and invariants: the least-squares fit, forward rates, and KVPR's split (papers/000 Eq. 6–12),
 * InfiniGen's split among them. The other planner suites: test_planner_hybrid,
 * test_planner_modes; shared parts in tests/planner_fixture.h. */
#include "coordinator/co_plan.h"
#include "coordinator/planner.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "tests/planner_fixture.h"

/* ---------------------------------------------------------------- fit_linear */

START_TEST(test_fit_exact)
{
    double xs[50], ys[50], a, b;
    for (int i = 0; i < 50; i++) {
        xs[i] = 16.0 * (i + 1) + (i % 3); /* token counts, not evenly spaced */
        ys[i] = 3.7e-5 + 2.1e-7 * xs[i];
    }
    ck_assert_int_eq(rekv_linear_fit(xs, ys, 50, &a, &b, NULL), 0);
    ck_assert_msg(tp_close_rel(a, 3.7e-5, 1e-9), "a = %.17g", a);
    ck_assert_msg(tp_close_rel(b, 2.1e-7, 1e-9), "b = %.17g", b);

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
    tp_g_rng = 7;
    enum { N = 400 };
    double xs[N], ys[N], a, b;
    const double a0 = 5e-5, b0 = 3e-7; /* T(n) for n up to 8192 tokens: 5e-5 .. 2.5e-3 s */
    for (int i = 0; i < N; i++) {
        xs[i] = (double)tp_irand(16, 8192);
        ys[i] =
            (a0 + b0 * xs[i]) * (1.0 + 0.02 * (tp_urand() - 0.5)); /* +-1% multiplicative noise */
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
    pr->h2d_bw = tp_logrand(1e9, 64e9);
    pr->gemm_flops = tp_logrand(1e11, 1e15);
    pr->h2d_latency = (tp_rnd() & 1) ? 0.0 : tp_logrand(1e-7, 1e-3);
    /* a decode step's forward pass often runs far below the GEMM rate of recomputation */
    pr->fwd_flops_rate = (tp_rnd() & 1) ? 0.0 : pr->gemm_flops * tp_logrand(0.01, 1.0);
    p->s = tp_irand(0, 2500);
    p->b = tp_irand(1, 64);
    p->hidden = hs[tp_irand(0, 7)];
    int64_t div =
        gqa_only ? (int64_t)2 << tp_irand(0, 3) : (int64_t)1 << tp_irand(0, 3); /* MHA or GQA 2..8 */
    p->kv_dim = p->hidden / div;
    p->elem_bytes = (tp_rnd() & 1) ? 2.0 : 4.0;
    /* the layer's own work: none, or a forward pass of a few hidden^2 per sequence (and weights
     * on the link) */
    p->fwd_flops =
        (tp_rnd() & 1) ? 0.0 : tp_logrand(1.0, 30.0) * 2.0 * p->b * p->hidden * p->hidden;
    p->weight_bytes = (tp_rnd() & 3) ? 0.0 : 12.0 * p->hidden * p->hidden * 2.0;
    /* a rate that falls with fewer rows, and attention at its own (lower) rate, or neither */
    if (tp_rnd() & 1)
        pr->fwd_gemm = (rekv_linear){tp_logrand(1e-13, 1e-10), tp_logrand(1e-15, 1e-12)};
    if (tp_rnd() & 1) {
        pr->attn_flops_rate = pr->gemm_flops * tp_logrand(0.001, 0.5);
        p->attn_flops = p->fwd_flops * tp_logrand(0.01, 1.0);
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
    tp_g_rng = 11;
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
        ck_assert_msg(tp_close_rel(sp.t, t_split(&pr, &p, sp.l), 1e-12), "t %.17g vs %.17g", sp.t,
                      t_split(&pr, &p, sp.l));
        ck_assert_msg(sp.t <= bt * (1 + 1e-12), "case %d: l=%lld t=%.17g, brute l=%lld t=%.17g", c,
                      (long long)sp.l, sp.t, (long long)bl, bt);
        exact += sp.l == bl;
        interior += sp.l > 0 && sp.l < p.s;
        /* the byte and FLOP counts are Eq. 6, 7, 9 */
        ck_assert(tp_close_rel(sp.bytes_x, (double)p.b * sp.l * p.hidden * p.elem_bytes, 1e-15) ||
                  sp.bytes_x == 0);
        ck_assert(
            tp_close_rel(sp.bytes_kv, 2.0 * p.b * (p.s - sp.l) * p.kv_dim * p.elem_bytes, 1e-15) ||
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
    tp_g_rng = 14;
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
        ck_assert(tp_close_rel(ch.t, t_split(&pr, &p, ch.l), 1e-12) || ch.t == 0);
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
    tp_g_rng = 21;
    int used = 0;
    for (int c = 0; c < 600; c++) {
        rekv_cost_profile pr;
        rekv_step_shape sh = {0};
        int gqa = c % 3 == 0;
        random_kvpr(&pr, &sh.kv, gqa);
        if (sh.kv.s > 1200)
            sh.kv.s = 1200;
        sh.infinigen_fraction = tp_logrand(0.02, 1.0);
        sh.n_layers = (int)tp_irand(1, 40);
        sh.q_dim = sh.kv.hidden;
        sh.device_tokens = (tp_rnd() & 1) ? 0 : tp_irand(0, sh.kv.s);
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
    const rekv_model_config opt = tp_opt8_config;
    rekv_plan_model pm;
    rekv_plan_model_from_config(&opt, &pm);
    pm.weight_elem_bytes = 2;
    rekv_step_shape sh;
    rekv_plan_shape(&pm, 8, 512, 2, 0, &sh);
    ck_assert_int_eq(sh.infinigen_split, 0);
    rekv_step_cost kv, none, chosen;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_KV, &kv, NULL), 0);
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_INFINIGEN, &none, NULL), 0);
    ck_assert(tp_close_rel(none.bytes_h2d, kv.bytes_h2d * (1 + 7 * 0.2) / 8, 1e-12));
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
    tp_g_rng = 12;
    for (int c = 0; c < 2000; c++) {
        rekv_cost_profile pr;
        rekv_kvpr_params p;
        random_kvpr(&pr, &p, 1);
        pr.gemm_flops = tp_logrand(1e12, 1e18); /* even an absurdly fast GPU */
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
    ck_assert_msg(tp_close_rel(sp.t, 2.732032e-3, 1e-12), "t = %.17g", sp.t);
    ck_assert(tp_close_rel(sp.t_link, sp.t_x + sp.t_kv, 1e-15) && sp.t_compute == sp.t_recomp);
    rekv_plan_kvpr_eval(&pr, &p, 500, &sp);
    ck_assert_msg(tp_close_rel(sp.t, 3.072e-3, 1e-12), "t(500) = %.17g", sp.t);

    /* Random MHA profiles without latency, forward pass or weights: l is floor or ceil of the
     * crossing l* = s * (2p/v_com) / (4h/v_gpu + p/v_com), or s when that lies beyond it. */
    tp_g_rng = 13;
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

static Suite *suite(void)
{
    Suite *s = suite_create("planner_kvpr");
    TCase *tc;
    tc = tcase_create("core");
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
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
