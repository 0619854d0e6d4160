/* test_planner_hybrid.c — HybridServe's Algorithm 1 (papers/003) against hand-worked examples
 * and brute force: the act/KV initialisation, capacity and next block, a job's bytes, the demand
 * model, the request block allocation rule and mini-batch packing, step costs and the pattern. */
#include "coordinator/co_plan.h"
#include "coordinator/planner.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "tests/planner_fixture.h"

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
    ck_assert(tp_close_rel(a.kv_fraction, 240.0 / 770.0, 1e-15));
    ck_assert(a.bytes_used == 1110000);
    /* Eq. 2–3: T_PCIe = 1.6e-3 + 240*32e-6 = 9.28e-3 = T_comp = (530+50)*16e-6: balanced. */
    ck_assert(tp_close_rel(a.t_pcie, 9.28e-3, 1e-12));
    ck_assert(tp_close_rel(a.t_compute, 9.28e-3, 1e-12));
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
    tp_g_rng = 21;
    for (int c = 0; c < 5000; c++) {
        rekv_cost_profile pr = {.h2d_bw = 16e9, .gemm_flops = 1e14};
        pr.t_load_w = (tp_rnd() & 7) ? tp_logrand(1e-5, 0.1) : 0.0;
        pr.kv_gen =
            (rekv_linear){(tp_rnd() & 1) ? tp_logrand(1e-7, 1e-4) : 0.0, tp_logrand(1e-9, 1e-5)};
        pr.load_kv =
            (rekv_linear){(tp_rnd() & 1) ? tp_logrand(1e-7, 1e-4) : 0.0, tp_logrand(1e-9, 1e-5)};
        rekv_hybrid_params p = {.n_layers = (int)tp_irand(1, 80),
                                .kv_block_bytes = (double)tp_irand(1, 1 << 20),
                                .block_tokens = 16,
                                .act_gpu_blocks = tp_irand(0, 5000),
                                .max_parts = (int)tp_irand(0, 12)};
        p.act_block_bytes = (tp_rnd() & 1) ? p.kv_block_bytes / 2 : (double)tp_irand(1, 1 << 20);
        p.weight_bytes = (tp_rnd() & 1) ? 0.0 : tp_logrand(1e3, 1e11);
        p.host_bytes = p.weight_bytes + ((tp_rnd() & 7) ? tp_logrand(1e3, 1e12) : 0.0);
        rekv_hybrid_alloc a;
        ck_assert_int_eq(rekv_plan_hybrid_alloc(&pr, &p, &a, NULL), 0);
        ck_assert(a.act_init >= 0 && a.kv_init >= 0 && a.act_remain >= 0 && a.kv_remain >= 0);
        ck_assert(a.act_init == 0 || a.kv_init == 0);
        ck_assert_int_eq(a.act_host, a.act_init + a.act_remain);
        ck_assert_int_eq(a.kv_host, a.kv_init + a.kv_remain);
        double used = p.weight_bytes + p.n_layers * (p.act_block_bytes * (double)a.act_host +
                                                     p.kv_block_bytes * (double)a.kv_host);
        ck_assert_msg(used <= p.host_bytes, "case %d: %.0f > %.0f", c, used, p.host_bytes);
        ck_assert(tp_close_rel(a.bytes_used, used, 1e-12) || used == 0);
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
    tp_g_rng = 31;
    for (int c = 0; c < 300; c++) {
        int64_t kr = tp_irand(0, 1000), ar = tp_irand(0, 1000);
        if (kr + ar == 0)
            ar = 1;
        if (c < 20) { /* large host counts too (the store takes 32-bit parts) */
            kr = tp_irand(0, UINT32_MAX);
            ar = tp_irand(1, UINT32_MAX);
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
    ck_assert(tp_close_rel(c->throughput, demand_throughput(pr, d, c->n_join, fc), 1e-9));
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
    rekv_plan_model_from_config(&tp_opt_6_7b, &m);
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
    ck_assert(tp_close_rel(rekv_plan_mb_fb(&mb_prof, 16, 4, 2), 67.0 / 66.0, 1e-14));
    ck_assert(
        tp_close_rel(rekv_plan_mb_fb(&mb_prof, 16, 2, 4), (3.0 + 128.0) / (2.0 + 32.0), 1e-14));
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
    ck_assert_msg(tp_close_rel(mff, 3.75, 1e-14), "first fit %.17g", mff);
    ck_assert_msg(tp_close_rel(mgd, 1.2, 1e-14), "greedy %.17g", mgd);
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
    tp_g_rng = 41;
    enum { SETS = 400, MAXN = 80 };
    rekv_mb_request r[MAXN];
    int assign[MAXN];
    for (int mix = 0; mix < 3; mix++) {
        double sum_ff = 0, sum_gd = 0;
        int better = 0, worse = 0;
        for (int s = 0; s < SETS; s++) {
            size_t n = (size_t)tp_irand(5, MAXN);
            for (size_t i = 0; i < n; i++) {
                if (mix == 0)
                    r[i] = (rekv_mb_request){tp_irand(1, 20), tp_irand(1, 20)};
                else if (mix == 1)
                    r[i] = (tp_rnd() & 1) ? (rekv_mb_request){tp_irand(1, 30), tp_irand(1, 10)}
                                          : (rekv_mb_request){tp_irand(1, 10), tp_irand(1, 30)};
                else
                    r[i] = (rekv_mb_request){tp_irand(1, 8), tp_irand(1, 40)};
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
    const rekv_model_config opt = tp_opt8_config;
    rekv_step_shape sh;
    tp_shape_from_config(&opt, 8, 512, 2, 0, &sh);
    sh.hybrid_kv_fraction = 0.5;
    rekv_cost_profile pr = {.h2d_bw = 1e9, .gemm_flops = 1e12, .fwd_flops_rate = 1e11};
    rekv_step_cost c;
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_KV, &c, NULL), 0);
    ck_assert(tp_close_rel(c.t_compute, sh.kv.fwd_flops / 1e11, 1e-12));
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_ACT, &c, NULL), 0);
    ck_assert(c.recompute_flops > 0);
    ck_assert(tp_close_rel(c.t_compute, sh.kv.fwd_flops / 1e11 + c.recompute_flops / 1e12, 1e-12));
    pr.fwd_flops_rate = 0; /* unmeasured: the GEMM rate */
    ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, REKV_TECH_KV, &c, NULL), 0);
    ck_assert(tp_close_rel(c.t_compute, sh.kv.fwd_flops / 1e12, 1e-12));
}
END_TEST

/* The online correction: steps that measure their compute at 1.5x and their link at 0.8x of the
 * prediction move the scales there (smoothed: 1 - 0.7^k of the way after k steps), and the
 * corrected profile then prices every technique's compute and link times by exactly those factors
 * (weights offloaded: the load time too) — what the coordinator plans with and `rekv bench decode`
 * prints as its online prediction. A side with nothing predicted keeps its scale. */
START_TEST(test_scales_correct_profile)
{
    const rekv_model_config opt = tp_opt8_config;
    rekv_step_shape sh;
    tp_shape_from_config(&opt, 8, 512, 2, 1, &sh);
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
            ck_assert(tp_close_rel(sc.compute, 1 + 0.5 * w, 1e-12));
            ck_assert(tp_close_rel(sc.pcie, 1 - 0.2 * w, 1e-12));
        }
    }
    ck_assert(tp_close_rel(sc.compute, 1.5, 1e-6) && tp_close_rel(sc.pcie, 0.8, 1e-6));
    rekv_plan_scaled_profile(&pr, &sc, &now);
    for (int t = 0; t <= REKV_TECH_INFINIGEN; t++) {
        rekv_step_cost c0, c1;
        ck_assert_int_eq(rekv_plan_step_cost(&pr, &sh, (rekv_technique)t, &c0, NULL), 0);
        ck_assert_int_eq(rekv_plan_step_cost(&now, &sh, (rekv_technique)t, &c1, NULL), 0);
        if (t == REKV_TECH_KVPR) /* the split moves with the rates: compare at the same split */
            continue;
        ck_assert_msg(tp_close_rel(c1.t_compute, sc.compute * c0.t_compute, 1e-12), "tech %d", t);
        ck_assert_msg(tp_close_rel(c1.t_pcie, sc.pcie * c0.t_pcie, 1e-12), "tech %d", t);
    }
    rekv_kvpr_split a, b;
    rekv_plan_kvpr_eval(&pr, &sh.kv, 200, &a);
    rekv_plan_kvpr_eval(&now, &sh.kv, 200, &b);
    ck_assert(tp_close_rel(b.t_compute, sc.compute * a.t_compute, 1e-12));
    ck_assert(tp_close_rel(b.t_link, sc.pcie * a.t_link, 1e-12));
    /* HybridServe's fitted models and the weights' load time scale with their side */
    ck_assert(tp_close_rel(rekv_linear_eval(&now.kv_gen, 64),
                           sc.compute * rekv_linear_eval(&pr.kv_gen, 64), 1e-12));
    ck_assert(tp_close_rel(rekv_linear_eval(&now.load_kv, 64),
                           sc.pcie * rekv_linear_eval(&pr.load_kv, 64), 1e-12));
    ck_assert(tp_close_rel(now.t_load_w, sc.pcie * pr.t_load_w, 1e-12));
    /* nothing predicted on a side (resident's link): its scale stays */
    rekv_plan_scales r = {1, 1};
    rekv_plan_scales_observe(&r, 0.3, 0, 0.2, 0.1);
    ck_assert(r.pcie == 1 && tp_close_rel(r.compute, 0.7 + 0.3 * 2, 1e-12));
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
    const rekv_model_config opt = tp_opt8_config;
    rekv_step_shape sh;
    tp_shape_from_config(&opt, 1, 1536, 2, 0, &sh);
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

static Suite *suite(void)
{
    Suite *s = suite_create("planner_hybrid");
    TCase *tc;
    tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
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
    tcase_add_test(tc, test_step_cost_two_rates);
    tcase_add_test(tc, test_scales_correct_profile);
    tcase_add_test(tc, test_hybrid_pattern);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
