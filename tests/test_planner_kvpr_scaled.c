/* test_planner_kvpr_scaled.c — KVPR's split under the online correction (issue 42 item 3): the
 * planner never keeps pricing a split whose recomputation the measured steps say loses. A device
 * whose compute runs 4x slower than its profile says: the profile alone picks a split l > 0; as
 * the steps run at the split chosen from the corrected profile (rekv_plan_scaled_profile) and
 * report their busy times (rekv_plan_scales_observe), as a served worker's planner does
 * (co_plan.c), the split falls to 0 — offload's — and stays there. No timing: the "measured"
 * busy times are the profile's own prices times the device's true factors. */
#include "coordinator/planner.h"
#include "tests/testutil.h"

/* One layer of a 512-wide model, batch 8 over 256 tokens, an fp32 cache over an 8 Gbit/s link:
 * by the profile the link (8.4 ms at l = 0) outweighs the compute (3.6 ms), and each token moved
 * to recomputation saves 16 us of link for 84 us of compute, so l* is about 48. */
static const rekv_cost_profile g_prof = {.h2d_bw = 1e9,
                                         .h2d_latency = 1e-5,
                                         .gemm_flops = 1e11,
                                         .fwd_flops_rate = 2e10,
                                         .attn_flops_rate = 4e9};

static rekv_kvpr_params params(void)
{
    double attn = 4.0 * 8 * 256 * 512;
    return (rekv_kvpr_params){.s = 256,
                              .b = 8,
                              .hidden = 512,
                              .kv_dim = 512,
                              .elem_bytes = 4,
                              .fwd_flops = 2.0 * 8 * (4.0 * 512 * 512 + 3.0 * 512 * 1408) + attn,
                              .attn_flops = attn};
}

/* Runs `steps` steps on a device whose link and compute take pcie_f and compute_f times the
 * profile's prices, each at the split chosen from the corrected profile; the last split in *l. */
static void run_steps(rekv_plan_scales *sc, double pcie_f, double compute_f, int steps, int64_t *l)
{
    rekv_kvpr_params p = params();
    for (int i = 0; i < steps; i++) {
        rekv_cost_profile now;
        rekv_kvpr_split ch, truth;
        rekv_plan_scaled_profile(&g_prof, sc, &now);
        ck_assert_int_eq(rekv_plan_kvpr_choose(&now, &p, &ch, NULL), 0);
        rekv_plan_kvpr_eval(&g_prof, &p, ch.l, &truth); /* what the step costs, unscaled */
        rekv_plan_scales_observe(sc, truth.t_link * pcie_f, ch.t_link, truth.t_compute * compute_f,
                                 ch.t_compute);
        *l = ch.l;
    }
}

START_TEST(test_slow_compute_split_zero)
{
    rekv_kvpr_params p = params();
    rekv_kvpr_split first, zero;
    ck_assert_int_eq(rekv_plan_kvpr_choose(&g_prof, &p, &first, NULL), 0);
    rekv_plan_kvpr_eval(&g_prof, &p, 0, &zero);
    ck_assert_msg(first.l > 10 && first.t * (1 + REKV_PLAN_MARGIN) < zero.t,
                  "the profile alone should recompute: l %lld at %g s, l = 0 at %g s",
                  (long long)first.l, first.t, zero.t);
    rekv_plan_scales sc = {1, 1};
    int64_t l = -1;
    run_steps(&sc, 1.0, 4.0, 30, &l);
    ck_assert_msg(l == 0, "after 30 steps of 4x slower compute: split %lld (compute scale %g)",
                  (long long)l, sc.compute);
    ck_assert_msg(sc.compute > 3.5, "compute scale %g", sc.compute);
    /* at l = 0 the steps still measure the compute slow: the split stays at offload's */
    run_steps(&sc, 1.0, 4.0, 30, &l);
    ck_assert_int_eq(l, 0);
}
END_TEST

/* The other way: a device as fast as its profile keeps the profile's split. */
START_TEST(test_true_profile_keeps_split)
{
    rekv_kvpr_params p = params();
    rekv_kvpr_split first;
    ck_assert_int_eq(rekv_plan_kvpr_choose(&g_prof, &p, &first, NULL), 0);
    rekv_plan_scales sc = {1, 1};
    int64_t l = -1;
    run_steps(&sc, 1.0, 1.0, 30, &l);
    ck_assert_int_eq(l, first.l);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("planner_kvpr_scaled");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_slow_compute_split_zero);
    tcase_add_test(tc, test_true_profile_keeps_split);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
