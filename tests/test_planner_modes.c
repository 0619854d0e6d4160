/* test_planner_modes.c — the technique chooser and the coordinator's plan (co_plan): the mode
 * picked for a shape and a machine, the device part, InfiniGen where it wins, prefill chunks, the
 * selected fraction, predictions observed, the device's room and the join pattern. */
#include "coordinator/co_plan.h"
#include "coordinator/planner.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "tests/planner_fixture.h"

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
    tp_shape_from_config(&llama, 8, 1024, 2, 1, &sh);
    ck_assert(sh.kv.weight_bytes == 2.0 * 218103808.0);
    ck_assert(sh.kv.fwd_flops == 2.0 * 8 * 218103808.0 + 4.0 * 8 * 1024 * 4096);
    ck_assert(sh.kv.kv_dim == 1024 && sh.kv.hidden == 4096);

    /* GQA, weights resident, fast GPU: activations are bigger than KV, so plain KV wins. */
    rekv_cost_profile pr = {.h2d_bw = 25e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    tp_shape_from_config(&llama, 8, 1024, 2, 0, &sh);
    ck_assert_int_eq(rekv_plan_choose(&pr, &sh, &best, c, NULL), 0);
    ck_assert_int_eq(best, REKV_TECH_KV);
    ck_assert_int_eq(c[REKV_TECH_KVPR].kvpr_l, 0);

    /* OPT-13B-like MHA, big batch and context, weights resident, slow link: recompute pays, and
     * KVPR (a mix) is at least as good as either pure technique on PCIe-bound steps. */
    pr = (rekv_cost_profile){.h2d_bw = 16e9, .gemm_flops = 150e12};
    tp_shape_from_config(&opt, 32, 2048, 2, 0, &sh);
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
    rekv_model_config opt = tp_opt_6_7b;
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

/* act's and hybrid's recomputed tokens cannot be lowered as kvpr's split is (the store keeps no
 * K,V of them): on a device whose room holds the attention buffers and the recomputation of only
 * half the context, act is never picked (priced INFINITY) and hybrid's pattern recomputes at most
 * that share (less an eighth); with room for all of it, nothing changes. A slow link, so that
 * recomputation pays (was: a hybrid of 2:3 on such a device failed its steps where offload ran). */
START_TEST(test_pick_mode_act_room)
{
    rekv_model_config opt = tp_opt_6_7b;
    rekv_plan_model m;
    rekv_plan_model_from_config(&opt, &m);
    rekv_cost_profile pr = {.h2d_bw = 2e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    double att = 64.0 * 544 * 4 * 4096 * 2, stream = rekv_cost_stream_token_bytes(4096, 4096, 2);
    double rec_all = 64.0 * 544 * stream - att;
    rekv_mode_pick full, half;
    /* room for every buffer, no device part: the recomputation of the whole context fits */
    ck_assert(rekv_plan_act_room_fraction(&m, 64, 544, 0, 2, att + rec_all) == 0);
    ck_assert_int_eq(rekv_plan_pick_mode(&pr, &m, 64, 544, 2, att + rec_all, 0, NULL, &full, NULL),
                     0);
    ck_assert(!full.resident && full.device_tokens == 0);
    ck_assert_msg(full.hybrid_kv_fraction < 0.5 || full.tech == REKV_TECH_ACT,
                  "recomputation does not pay here: the test shows nothing");
    double share = rekv_plan_act_room_fraction(&m, 64, 544, 0, 2, att + rec_all / 2);
    ck_assert(fabs(share - 0.5 * 7 / 8) < 1e-9);
    ck_assert_int_eq(
        rekv_plan_pick_mode(&pr, &m, 64, 544, 2, att + rec_all / 2, 0, NULL, &half, NULL), 0);
    ck_assert(half.tech != REKV_TECH_ACT && isinf(half.costs[REKV_TECH_ACT].t_step));
    ck_assert_msg(1 - half.hybrid_kv_fraction <= share + 1e-9,
                  "hybrid %d:%d recomputes %.3f > %.3f", half.hybrid_kv_parts,
                  half.hybrid_act_parts, 1 - half.hybrid_kv_fraction, share);
    ck_assert(half.hybrid_kv_fraction ==
              (double)half.hybrid_kv_parts / (half.hybrid_kv_parts + half.hybrid_act_parts));
    ck_assert(isfinite(half.costs[half.tech].t_step));
}
END_TEST

/* The device-resident part: every exact technique moves and recomputes only the context past it
 * (the same bytes and FLOP as a context that much shorter, the forward pass's attention still
 * over the whole context), KVPR's split counts from the context's start, infinigen ignores it,
 * and a part covering the context leaves nothing to move. */
START_TEST(test_device_part)
{
    rekv_model_config opt = tp_opt_6_7b;
    rekv_cost_profile pr = {.h2d_bw = 25e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    rekv_step_shape whole, part, shorter;
    tp_shape_from_config(&opt, 64, 512, 2, 0, &whole);
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

/* A model with a sliding window (which infinigen refuses at pipeline creation) gets an exact pick
 * where the same model without one gets infinigen (test_pick_infinigen's first case). */
START_TEST(test_pick_windowed_exact)
{
    rekv_model_config opt = tp_opt_6_7b;
    rekv_plan_model optm, win;
    rekv_plan_model_from_config(&opt, &optm);
    double kv = 2.0 * 4096 * 2 * 64 * 544 * 32;
    rekv_cost_profile slow = {.h2d_bw = 2e9, .gemm_flops = 300e12, .h2d_latency = 5e-6};
    rekv_plan_approx prior = {0};
    rekv_mode_pick ap, wp;
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, 0.38 * kv, 0, &prior, &ap, NULL),
                     0);
    ck_assert_int_eq(ap.tech, REKV_TECH_INFINIGEN);
    win = optm;
    win.window = 256, win.windowed_layers = win.n_layers;
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &win, 64, 544, 2, 0.38 * kv, 0, &prior, &wp, NULL),
                     0);
    ck_assert(!wp.approximate && wp.tech < REKV_TECH_COUNT);
}
END_TEST

/* InfiniGen is approximate: rekv_plan_pick_mode prices it only when allowed, and picks it only
 * when it is strictly cheaper than every exact technique — on a slow link at a small fraction f,
 * never when it is not allowed, never at f = 1 (the same bytes as KV, plus the speculation), and
 * not at f = 0.9 on a step whose compute is close to its link time (the speculation tips it). */
START_TEST(test_pick_infinigen)
{
    rekv_model_config opt = tp_opt_6_7b;
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
    ck_assert(tp_close_rel(ig.bytes_h2d, kvc.bytes_h2d * (1 + 31 * 0.2) / 32, 1e-12));
    double spec = 31.0 / 32 * 2 * (0.3 * 4096) * (64.0 * 4096 + 64.0 * 272);
    ck_assert(tp_close_rel(ig.speculate_flops, spec, 1e-12));
    ck_assert(tp_close_rel(ig.t_compute * slow.gemm_flops, kvc.t_compute * slow.gemm_flops + spec,
                           1e-12));
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
    ck_assert(tp_close_rel(big.costs[REKV_TECH_INFINIGEN].bytes_h2d,
                           small.costs[REKV_TECH_INFINIGEN].bytes_h2d *
                               (272.0 - (double)big.device_tokens) / 272.0,
                           1e-12));
    ck_assert(big.costs[REKV_TECH_INFINIGEN].speculate_flops ==
              small.costs[REKV_TECH_INFINIGEN].speculate_flops);

    /* f = 1 moves what KV does and computes more: never strictly cheaper */
    ck_assert_int_eq(rekv_plan_pick_mode(&slow, &optm, 64, 544, 2, room, 0, &f1, &ap, NULL), 0);
    ck_assert_int_eq(ap.tech, ex.tech);
    ck_assert(tp_close_rel(ap.costs[REKV_TECH_INFINIGEN].bytes_h2d, kvc.bytes_h2d, 1e-12));

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
    ck_assert(tp_close_rel(pcie_prior, kv_step * (1 + 7 * 0.2) / 8 / 2e9, 1e-9));
    Rekv__Worker__Counters c = REKV__WORKER__COUNTERS__INIT;
    c.tokens_considered = 20000; /* two steps: 5% selected, then 15% */
    c.tokens_selected = c.tokens_considered / 20;
    co_plan_observe(&ps, &c, &(co_plan_pred){0, 0});
    c.tokens_selected = c.tokens_considered * 3 / 20;
    co_plan_observe(&ps, &c, &(co_plan_pred){0, 0});
    ck_assert(tp_close_rel(co_plan_selected_fraction(&ps), 0.1, 1e-12));
    ck_assert_int_eq(co_plan_step(&ps, jobs, ctx, NULL, 2, 0, 0, &sp, mb_job, mb_index), 1);
    ck_assert(tp_close_rel(ps.pred_pcie_s, kv_step * (1 + 7 * 0.1) / 8 / 2e9, 1e-9));
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
    rekv_plan_model pm = {1024, 1024, 1024, 8, 12.0 * 1024 * 1024, 2, 0, 0};
    rekv_plan_shape(&pm, 2, 1024, 2, 0, &sh);
    sh.infinigen_split = -1;
    rekv_step_cost want;
    ck_assert_int_eq(rekv_plan_step_cost(&pa.prof, &sh, REKV_TECH_INFINIGEN, &want, NULL), 0);
    ck_assert(want.kvpr_l > 0);
    ck_assert_int_eq(sp.split, want.kvpr_l);
    ck_assert(tp_close_rel(pa.pred_step_s, want.t_step * 8, 1e-9));
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
    ck_assert(tp_close_rel(ps.scales.compute, 0.7 + 0.3 * 2, 1e-12));
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

static Suite *suite(void)
{
    Suite *s = suite_create("planner_modes");
    TCase *tc;
    tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_choose);
    tcase_add_test(tc, test_pick_mode);
    tcase_add_test(tc, test_pick_mode_act_room);
    tcase_add_test(tc, test_device_part);
    tcase_add_test(tc, test_co_plan_device_part);
    tcase_add_test(tc, test_pick_infinigen);
    tcase_add_test(tc, test_pick_windowed_exact);
    tcase_add_test(tc, test_co_plan_device_room);
    tcase_add_test(tc, test_co_plan_selected_fraction);
    tcase_add_test(tc, test_co_plan_observe_own_prediction);
    tcase_add_test(tc, test_co_plan_prefill_chunk);
    tcase_add_test(tc, test_co_plan_join_pattern);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
