/* planner.h — rekv's cost model and the optimisers built on it, as pure functions.
 *
 * Every technique rekv combines trades PCIe bytes for GPU work; this file prices both sides with
 * one hardware profile (link bandwidth and latency, GEMM throughput, HybridServe's fitted linear
 * models) and solves the papers' small optimisation problems on it:
 *
 *   - KVPR (papers/000, Sec. 3.2): the split point l of partial KV recomputation, Eq. 6–12,
 *     generalised to GQA (the activation row and the KV row have different widths);
 *   - HybridServe/CAPTURE (papers/003 and its long version 001): the host KV:ACT block allocation
 *     (Algorithm 1), the per-request block allocation rule (003 Eq. 5 / 001 Eq. 11) and the dynamic
 *     mini-batch formation by greedy bin packing on the balance metric F_b (003 Eq. 6–7); and
 *     the joining sequences' pattern under demand (rekv_plan_hybrid_demand: when the store's
 *     room binds, the pattern whose admitted batch makes the most tokens per second);
 *   - a chooser that prices one decode step under each technique as max(PCIe time, compute time)
 *     and picks the cheapest — the seed of the coordinator's planner (DESIGN.md "one cost model");
 *   - InfiniGen (approximate, opt-in): the same step with only a fraction of the context's KV
 *     fetched past layer 0, plus its speculation's FLOP (rekv_plan_step_cost, rekv_plan_pick_mode).
 *
 * No I/O, no allocation except the bin packer's scratch, no globals: the coordinator calls this
 * with the profile each worker measured and sent (common/cost.h), the CLI with its own. Functions
 * that can fail return 0 or a negative errno and fill the rekv_err; the others cannot fail on
 * valid input.
 *
 * Units everywhere: seconds, bytes, FLOP, tokens, blocks (a block is 16 tokens of one sequence in
 * one layer, DESIGN.md "Blocks"). */
#ifndef REKV_COORDINATOR_PLANNER_H
#define REKV_COORDINATOR_PLANNER_H

#include <stddef.h>
#include <stdint.h>

#include "common/cost.h"
#include "common/err.h"
#include "common/mode.h"
#include "loader/loader.h"

#define REKV_PLAN_BLOCK_TOKENS 16 /* tokens per KV/ACT block */

/* ---------------------------------------------------------------- KVPR split (000 Eq. 6-12) */

/* One layer's split problem. The paper's Eq. 6–9 assume MHA (KV row = 2h); here the activation
 * row (hidden) and the K/V row (kv_dim each) are separate, so for GQA M_X = b*l*hidden*p,
 * M_KV = 2*b*(s-l)*kv_dim*p and N = 2*b*l*hidden*(2*kv_dim) FLOP (= Eq. 9's 4*b*l*h^2 for MHA).
 * fwd_flops and weight_bytes are the layer's work that every split pays (0 when unknown). */
typedef struct rekv_kvpr_params {
    int64_t s;         /* tokens in the context of each sequence (the prefix to fetch or rebuild) */
    int64_t b;         /* sequences in the batch */
    int64_t hidden;    /* h: activation row width, elements (the layer input X) */
    int64_t kv_dim;    /* width of one K row (and of one V row), elements: n_kv_heads*head_dim */
    double elem_bytes; /* p: bytes per K/V element on the link, scales included (2 fp16, 4 fp32,
                          rekv_kv_elem_bytes int8/int4); X: rekv_cost_act_elem_bytes of it */
    double fwd_flops;  /* the layer's forward pass for the new tokens, FLOP (rekv_step_shape) */
    double attn_flops; /* of fwd_flops, the attention's (Q.K^T and P.V over the context), priced
                          at the profile's attention rate where it has one */
    double weight_bytes; /* the layer's weights that cross the link, bytes (0 if resident) */
} rekv_kvpr_params;

/* The price of one split. */
typedef struct rekv_kvpr_split {
    int64_t l;        /* tokens [0, l) come as activations and are recomputed; [l, s) come as KV */
    double t;         /* the layer's time in rekv's pipeline: max(t_link, t_compute), s */
    double t_link;    /* weights + t_x + t_kv: everything the layer moves over the link, s */
    double t_compute; /* fwd_flops / v_gpu + t_recomp, s */
    double t_x;       /* M_X / v_com (+ h2d_latency when M_X > 0), s */
    double t_kv;      /* M_KV / v_com (+ h2d_latency when M_KV > 0), s */
    double t_recomp;  /* Eq. 10: N / v_gpu, s */
    double bytes_x;   /* Eq. 6: M_X[0:l], bytes moved as activations */
    double bytes_kv;  /* Eq. 7: M_KV[l:s], bytes moved as K and V */
    double flops;     /* Eq. 9 generalised: recompute FLOP */
} rekv_kvpr_split;

/* Prices split l (0 <= l <= s) as rekv's pipeline runs it: t = max(t_link, t_compute). The paper's
 * Eq. 11, t = t_x + max(t_recomp, t_kv), models one layer alone — X must arrive before its GEMM,
 * so X's transfer is not overlapped. rekv runs layers (units) on separate copy and compute streams
 * with double buffers: X of the next unit streams while this one recomputes, so in steady state a
 * layer costs the larger of its link time and its compute time (DESIGN.md: "minimises max(PCIe
 * time, compute time)"; HybridServe's Eq. 2–4 model it so too). Measured: on an H100 (OPT-6.7B
 * shape, batch 64, ~527 tokens) Eq. 11's l = 342 ran at 199 tok/s, l = 460 at 212 and all-recompute
 * at 235; the cpu emulation showed the same order. Each copy that moves bytes pays
 * prof->h2d_latency (weights, X, the KV suffix). */
void rekv_plan_kvpr_eval(const rekv_cost_profile *prof, const rekv_kvpr_params *p, int64_t l,
                         rekv_kvpr_split *out);

/* Eq. 12 with that time: the integer l in [0, s] minimising t(l), in O(1); ties (to a relative
 * 1e-12, so that rounding cannot pick an arbitrary point of a flat stretch) go to the smallest l.
 * In (0, s) t is the maximum of two linear functions of l — the link time falls by b*(2*kv_dim -
 * hidden)*p/v_com per token moved to X, the compute time rises by its recompute — so the minimum
 * over the integers lies at floor(l*), ceil(l*) of their crossing l*, or an end of the interior
 * (1, s-1); the endpoints 0 and s are separate candidates because the copy latencies jump there.
 * When an activation row is not smaller than a K+V row (GQA with hidden >= 2*kv_dim), sending X
 * never pays and the result is l = 0.
 *
 * Any token is a valid split for the engine: KV blocks are [kv_head][token][head_dim], so the
 * suffix [l, s) is a strided gather, and the X prefix comes from ACT blocks or a token-granular
 * activation store. Returns -EINVAL on a negative size, non-positive speeds or elem_bytes. */
int rekv_plan_kvpr_solve(const rekv_cost_profile *prof, const rekv_kvpr_params *p,
                         rekv_kvpr_split *out, rekv_err *err);

/* How much slower than the model's best a choice with less recomputation may be priced and still
 * be taken: the model's compute side is optimistic (the profile times each kernel alone, best of
 * five rounds; a step's kernels share the device with the link's and the store's work), and where
 * link and compute nearly balance the pipeline overlaps them less than max() assumes; a choice
 * that recomputes less is the robust one within that error (on this machine's cpu backend, a
 * split priced 0.7% faster than offload's l = 0 ran 6% slower). The noise the goals allow. */
#define REKV_PLAN_MARGIN 0.03

/* The split a step runs: rekv_plan_kvpr_solve's optimum l*, pulled to the smallest l whose t is
 * within REKV_PLAN_MARGIN of t(l*) (0 when l = 0 is). Returns as the solver does. */
int rekv_plan_kvpr_choose(const rekv_cost_profile *prof, const rekv_kvpr_params *p,
                          rekv_kvpr_split *out, rekv_err *err);

/* ---------------------------------------------------------------- HybridServe host allocation */

/* Inputs of Algorithm 1 (003/001 "Hybrid Cache Allocation Policy"). The time models and T_load_w
 * come from the rekv_cost_profile. Counts are per layer, as the time models are (one layer's
 * pipeline is what Eq. 2–4 balance); host memory holds n_layers copies of each per-layer block. */
typedef struct rekv_hybrid_params {
    double host_bytes;      /* M_Host: host memory for weights plus cache, bytes */
    double weight_bytes;    /* S_weight: all layers' weights in host memory, bytes (0 if none) */
    int n_layers;           /* decoder layers; a block in every layer costs n_layers * S bytes */
    double kv_block_bytes;  /* S_KV: one KV block of one layer (K and V of 16 tokens), bytes */
    double act_block_bytes; /* S_ACT: one ACT block of one layer (X of 16 tokens), bytes */
    int64_t act_gpu_blocks; /* #ACT_GPU: ACT blocks of one layer held in the GPU ACT buffer */
    int block_tokens;       /* tokens per block, to evaluate the per-token time models (16) */
    int max_parts;          /* largest part of the pattern kv_parts:act_parts (0 means 8) */
} rekv_hybrid_params;

typedef struct rekv_hybrid_alloc {
    int64_t act_init;   /* ACT_init: host ACT blocks per layer that fill T_load_w with recompute */
    int64_t kv_init;    /* KV_init: host KV blocks per layer that fill the recompute with loads */
    int64_t act_remain; /* ACT_remain: ACT blocks per layer in the memory left after init */
    int64_t kv_remain;  /* KV_remain: KV blocks per layer in the memory left after init */
    int64_t act_host;   /* #ACT_Host = ACT_init + ACT_remain, blocks per layer */
    int64_t kv_host;    /* #KV_Host = KV_init + KV_remain, blocks per layer */
    double kv_fraction; /* #KV_Host / (#KV_Host + #ACT_Host), dimensionless (0 when both 0) */
    int kv_parts;       /* per-request pattern kv_parts:act_parts, small integers closest to the */
    int act_parts;      /*   host ratio (each <= max_parts, smallest sum on ties) */
    double bytes_used;  /* S_weight + n_layers*(S_ACT*#ACT + S_KV*#KV), bytes; <= M_Host */
    double t_pcie;      /* Eq. 2: T_load_w + T_load_kv(#KV_Host), s */
    double t_compute;   /* Eq. 3: T_kv_gen(#ACT_Host + #ACT_GPU), s */
} rekv_hybrid_alloc;

/* Algorithm 1, step by step:
 *   init (lines 11–18): T_budget = T_load_w - T_kv_gen(#ACT_GPU); if >= 0, ACT_init is the count
 *     whose T_kv_gen equals T_budget, else KV_init is the count whose T_load_kv equals -T_budget.
 *   remain (lines 20–26): M_remaining = M_Host - S_weight - M_occupied is filled with #ACT, #KV
 *     such that S_ACT*#ACT + S_KV*#KV = M_remaining and T_kv_gen(#ACT) = T_load_kv(#KV).
 * Where the paper is vague, rekv chooses:
 *   - "find # s.t. T = x" is solved on the continuous affine model, then the integer count is the
 *     one of {0, floor, ceil} with the smallest |T(count) - x| (Eq. 4's objective), ties to the
 *     smaller count.
 *   - line 26 is taken literally, with the models' intercepts (it balances the additional blocks
 *     against each other, not the totals); the continuous solution is clamped to the memory
 *     budget, #KV is rounded to floor or ceil, #ACT takes whatever whole blocks the memory left
 *     over holds (floor), and of the two the pair with the smaller |T_kv_gen - T_load_kv| wins,
 *     ties to fewer KV blocks. Memory is therefore never exceeded.
 *   - if the init blocks alone do not fit (M_remaining < 0) they are cut to what fits and nothing
 *     remains; if the weights alone do not fit it is an error (-ENOSPC).
 *   - S_ACT need not be S_KV/2 (GQA: it can be larger); the linear system is solved in general.
 * Returns 0, -EINVAL on bad parameters or -ENOSPC. */
int rekv_plan_hybrid_alloc(const rekv_cost_profile *prof, const rekv_hybrid_params *p,
                           rekv_hybrid_alloc *out, rekv_err *err);

/* Algorithm 1's inputs for a batch whose context is `blocks` blocks (per layer) and whose host
 * memory is what that context takes as all-KV, plus the weights when layer_weight_bytes > 0
 * (offloaded): the case both the CLI and the coordinator plan for. */
void rekv_plan_hybrid_params_for_batch(rekv_hybrid_params *hp, int64_t hidden, int64_t kv_dim,
                                       int n_layers, double elem_bytes, double layer_weight_bytes,
                                       double blocks);

/* The request block allocation rule (003 Eq. 5, 001 Eq. 11) lives with the store that applies it:
 * rekv_kv_next_block_type() in kvstore/kvstore.h. */

/* ---------------------------------------------------------------- dynamic mini-batch formation */

/* One request's blocks in the current step (per layer). */
typedef struct rekv_mb_request {
    int64_t n_kv;  /* KV blocks it loads from the host, blocks */
    int64_t n_act; /* ACT blocks it regenerates KV from, blocks */
} rekv_mb_request;

/* Eq. 6–7 (001 Eq. 12–13): balance = T_kv_gen(#ACT_mb) / T_load_kv(#KV_mb) with the counts in
 * blocks of block_tokens tokens, F_b = max(balance, 1/balance) >= 1. An empty mini-batch has
 * F_b = 1; a mini-batch with work on only one side has F_b = +inf (the other pipeline idles). */
double rekv_plan_mb_fb(const rekv_cost_profile *prof, int block_tokens, int64_t n_act,
                       int64_t n_kv);

typedef enum rekv_mb_policy {
    /* Paper's greedy, as rekv reads it: each request, in arrival order, joins the open mini-batch
     * where it fits whose F_b drops the most (F_b after - F_b before smallest; "whether adding the
     * request reduces the imbalance compared to the current mini-batch state", 003 Sec. IV-C3);
     * a new mini-batch opens only when it fits nowhere. Ties to the lowest index. */
    REKV_MB_GREEDY_DELTA = 0,
    /* The variant that joins the mini-batch with the lowest F_b after adding. On random request
     * sets it is no better than first fit (it keeps perfecting one batch and strands the others),
     * which is why it is not the default; kept for comparison. */
    REKV_MB_GREEDY_MIN_AFTER = 1,
    /* First fit in arrival order: the baseline the greedy is compared against. */
    REKV_MB_FIRST_FIT = 2,
} rekv_mb_policy;

/* Packs n requests into mini-batches of at most kv_max KV blocks and act_max ACT blocks.
 * assign[i] receives the mini-batch index of request i (0-based, dense); *n_batches the count.
 * Returns -EINVAL when a request alone exceeds a capacity or an argument is bad, -ENOMEM. */
int rekv_plan_mb_pack(const rekv_cost_profile *prof, int block_tokens, rekv_mb_policy policy,
                      const rekv_mb_request *reqs, size_t n, int64_t kv_max, int64_t act_max,
                      int *assign, size_t *n_batches, rekv_err *err);

/* Mean F_b over the mini-batches of an assignment (unweighted; +inf if any is one-sided). */
double rekv_plan_mb_mean_fb(const rekv_cost_profile *prof, int block_tokens,
                            const rekv_mb_request *reqs, size_t n, const int *assign,
                            size_t n_batches);

/* ---------------------------------------------------------------- chooser */

typedef enum rekv_technique {
    REKV_TECH_KV = 0,     /* fetch every KV row of the context (offloading baseline) */
    REKV_TECH_KVPR = 1,   /* KVPR at the split a step runs (rekv_plan_kvpr_choose) */
    REKV_TECH_ACT = 2,    /* fetch activations of the whole context, recompute all K,V */
    REKV_TECH_HYBRID = 3, /* a fixed KV:ACT mix (HybridServe's host ratio) + GPU-held ACT */
    REKV_TECH_COUNT = 4,  /* the exact techniques above: the ones rekv_plan_choose compares */
    /* approximate (tokens may differ from resident's, common/mode.h): priced by
     * rekv_plan_step_cost, chosen only by rekv_plan_pick_mode and only when the user allows it */
    REKV_TECH_INFINIGEN = REKV_TECH_COUNT, /* layer 0's KV and a fraction f of every other
                                            * layer's, selected by a speculation (InfiniGen) */
} rekv_technique;

/* InfiniGen's partial width: rk = 0.3 * head_dim columns of each head's query and key take part in
 * the speculation (its §5; gpuworker/skew.h REKV_SKEW_DEFAULT_RATIO). */
#define REKV_PLAN_INFINIGEN_PARTIAL 0.3
/* f before any measurement: the pipeline's cap on the selected fraction (cfg.max_fraction's
 * default), i.e. the worst case; the fraction selected is typically lower. */
#define REKV_PLAN_INFINIGEN_PRIOR 0.2

/* One layer of one decode step, the shape the chooser prices. */
typedef struct rekv_step_shape {
    rekv_kvpr_params kv;       /* the cached context (b, s, hidden, kv_dim, elem_bytes) and what
                                * every technique pays: kv.weight_bytes over the link (0 if
                                * resident), kv.fwd_flops for the new tokens' forward pass
                                * (projections, FFN, attention over the context) */
    double hybrid_kv_fraction; /* host-held context tokens kept as KV, 0..1 (REKV_TECH_HYBRID) */
    int64_t act_gpu_tokens;    /* context tokens of the batch whose ACT is already in GPU memory
                                * (REKV_TECH_HYBRID; recomputed, never transferred) */
    int64_t device_tokens;     /* per sequence, context tokens whose K,V the device keeps (the
                                * device-resident part): every technique moves, recomputes or
                                * selects among only the other kv.s - device_tokens */
    /* REKV_TECH_INFINIGEN (rekv_plan_shape fills them; the exact techniques ignore them) */
    double infinigen_fraction; /* f: context tokens a selecting layer fetches, 0..1 */
    int64_t infinigen_split;   /* layer 0's split as the pipeline takes it (tokens from the
                                * context's start; [device_tokens, split) recomputed; 0: none,
                                * rekv_plan_shape's), < 0: the planner's choice */
    int n_layers;              /* layers of the step (>= 1): layer 0 fetches the whole context */
    int64_t q_dim;             /* query row width, elements (the partial query's width) */
    /* act, hybrid: the share of the moved context (kv.s - device_tokens, and ACT_GPU's) whose
     * recomputation the device's buffers hold beside the step's attention buffers
     * (rekv_plan_act_room_fraction). Their recomputed tokens are not lowered as kvpr's split is
     * (the store keeps no K,V of them): one that recomputes more cannot run, and is priced
     * t_step = INFINITY. 0: no limit */
    double act_room_fraction;
} rekv_step_shape;

typedef struct rekv_step_cost {
    double t_pcie;    /* weights + X + KV over the link, with one latency per non-empty copy, s */
    double t_compute; /* (fwd_flops + recompute + speculation FLOP) / gemm_flops, s */
    double t_step;    /* max(t_pcie, t_compute), s: full overlap assumed, as 003 Eq. 2–4 do
                       * (and as the KVPR split is chosen, see rekv_plan_kvpr_eval);
                       * REKV_TECH_INFINIGEN, whose layers differ: the mean of each layer's */
    double bytes_h2d; /* bytes over the link */
    double recompute_flops; /* FLOP spent rebuilding K,V */
    double speculate_flops; /* FLOP of InfiniGen's speculation (REKV_TECH_INFINIGEN), else 0 */
    int64_t kvpr_l;         /* the split used (REKV_TECH_KVPR; REKV_TECH_INFINIGEN: layer 0's, 0 for
                               none), tokens from the context's start as the pipeline takes it (tokens
                               [device_tokens, kvpr_l) are recomputed); -1 otherwise */
} rekv_step_cost;

/* Prices one technique. Returns -EINVAL on bad parameters.
 *
 * REKV_TECH_INFINIGEN is priced as the mean layer of a decode step, so that it compares with the
 * others' one layer: of the step's n_layers layers, layer 0 fetches the context past the device
 * part whole (as REKV_TECH_KV does) and each of the other n_layers - 1 fetches the fraction f of
 * it, so the KV bytes are KV's times (1 + (n_layers - 1) f) / n_layers. Those layers also pay the
 * speculation, priced like the rest of the forward pass at gemm_flops: the partial query, a GEMV
 * of the attention input onto rk = 0.3 head_dim columns of every query head (2 b hidden 0.3 q_dim
 * FLOP), and its scores against the partial keys of the whole context (2 b s 0.3 q_dim FLOP). Left
 * out, as small or unknown: the partial key of the new token, the selection over the scores, and
 * that the selected rows are many small copies (one link latency per layer is charged, as for the
 * others; the coordinator's measured link scale corrects the step predictions, not the mode
 * choice). The layers run one after another, so t_step is the mean of each layer's own
 * max(link, compute) (not the max of the means, t_pcie and t_compute: layer 0 does not share its
 * load with the lighter selecting layers). Layer 0, which fetches whole, recomputes its first l
 * moved tokens from activations as KVPR does (the pipeline's split with infinigen), l KVPR's
 * choice for that layer alone (rekv_plan_kvpr_choose) unless shape->infinigen_split gives it,
 * returned in kvpr_l. The selecting layers' recomputation of the tokens most KV heads chose
 * (pipeline.h) is left out: how many heads agree is the model's, and on GQA never pays. */
int rekv_plan_step_cost(const rekv_cost_profile *prof, const rekv_step_shape *shape,
                        rekv_technique tech, rekv_step_cost *out, rekv_err *err);

/* Prices every exact technique (costs[REKV_TECH_COUNT], may be NULL) and stores the fastest in
 * *best (ties to fewer moving parts: KV, ACT, KVPR, hybrid). Returns -EINVAL on bad parameters. */
int rekv_plan_choose(const rekv_cost_profile *prof, const rekv_step_shape *shape,
                     rekv_technique *best, rekv_step_cost *costs, rekv_err *err);

/* Hybrid's KV:ACT pattern for a step of `shape` (its hybrid_kv_fraction ignored): of the patterns
 * kv_parts:act_parts in lowest terms with both parts <= max_parts (0 means 8) — 1:0 is all KV
 * (offload's bytes), 0:1 all ACT — the one rekv_plan_step_cost prices fastest (ties to the larger
 * KV share: less to recompute; so are patterns priced within REKV_PLAN_MARGIN of the fastest:
 * the largest KV share among them is taken), its cost in *cost (may be NULL). This is HybridServe's
 * Algorithm 1 balance (T_kv_gen(#ACT) = T_load_kv(#KV), rekv_plan_hybrid_alloc) priced by the one
 * step model: the compute side also runs the layer's forward pass and the link side also carries
 * the ACT rows, which Algorithm 1 leaves out — on a device whose forward pass is a large part of a
 * step (the cpu backend: 8:1 was Algorithm 1's pattern at 8 Gbit/s and ran at 0.58x offload) the
 * balance it strikes leaves the compute side the longer one. Picking among the patterns the worker
 * can run, rather than rounding a continuous share, also keeps the choice from ever pricing above
 * 1:0, i.e. offload. Returns -EINVAL on bad parameters. */
int rekv_plan_hybrid_pattern(const rekv_cost_profile *prof, const rekv_step_shape *shape,
                             int max_parts, int *kv_parts, int *act_parts, rekv_step_cost *cost,
                             rekv_err *err);

/* ---------------------------------------------------------------- online correction */

/* A profile corrected by the steps it priced (issue 14 item 5): a step's measured busy times
 * against its prediction rescale the link terms and the compute terms separately, smoothed over
 * steps (the newest weighs REKV_PLAN_SMOOTH). The coordinator keeps one per worker and plans each
 * step with the corrected profile; `rekv bench decode` keeps one across its runs and prints the
 * corrected prediction beside the measured step. */
#define REKV_PLAN_SMOOTH 0.3
typedef struct rekv_plan_scales {
    double pcie;    /* measured / predicted link busy time, smoothed; 1 to start */
    double compute; /* measured / predicted compute busy time, smoothed; 1 to start */
} rekv_plan_scales;

/* The profile as the scales say the steps ran: link rates over pcie (bandwidth divided, latency
 * and load times multiplied), compute rates over compute, so that every time the planner prices
 * scales by its side's factor. */
void rekv_plan_scaled_profile(const rekv_cost_profile *p, const rekv_plan_scales *s,
                              rekv_cost_profile *out);

/* Takes one step: its measured link and compute busy times, and the times the scaled profile
 * predicted for it. A side with no prediction (or nothing measured) keeps its scale; one step moves
 * a scale at most to 0.01..100 of the unscaled prediction. */
void rekv_plan_scales_observe(rekv_plan_scales *s, double pcie_busy_s, double pcie_pred_s,
                              double compute_busy_s, double compute_pred_s);

/* What a worker runs as (its mode is fixed for its life: it decides what the kvstore holds). */
typedef struct rekv_mode_pick {
    int resident;              /* the whole KV cache fits in device memory: nothing moves */
    rekv_technique tech;       /* otherwise the technique priced cheapest */
    double hybrid_kv_fraction; /* hybrid's KV share, of its pattern (rekv_plan_hybrid_pattern) */
    int hybrid_kv_parts;       /* that pattern's k of k:a (within the device's room) */
    int hybrid_act_parts;      /* and its a */
    double kv_bytes;           /* the KV cache of b sequences of s_max tokens, all layers */
    /* one layer of a decode step at s_max / 2 tokens: the exact techniques, then
     * [REKV_TECH_INFINIGEN] when approximate modes were allowed (else zero) */
    rekv_step_cost costs[REKV_TECH_INFINIGEN + 1];
    int approximate;           /* approximate modes were allowed, and infinigen priced */
    double infinigen_fraction; /* the f it was priced at */
    int infinigen_fits;        /* its partial key cache and a step's attention buffers fit the
                                * device (else never chosen) */
    /* each sequence's device-resident part, tokens (rekv_cost_device_tokens of device_kv_bytes,
     * for infinigen of what its partial keys leave of it), which the costs were priced with */
    int64_t device_tokens;
} rekv_mode_pick;

/* The pipeline mode that runs a technique (common/mode.h): offload, kvpr, act, hybrid, infinigen.
 */
rekv_mode rekv_plan_tech_mode(rekv_technique tech);
/* The technique a mode's steps are priced as: resident and offload as REKV_TECH_KV (resident's
 * steps are not priced: no Plan carries knobs for it), clo as infinigen with the fraction its
 * misses fetched (hits fetch none). */
rekv_technique rekv_plan_mode_tech(rekv_mode m);

/* What the user allows beyond the exact techniques (`--approximate`). */
typedef struct rekv_plan_approx {
    double infinigen_fraction; /* f measured on this worker's decode steps (tokens the selecting
                                * layers fetched / their context); <= 0 or NaN: none yet, the
                                * prior REKV_PLAN_INFINIGEN_PRIOR. Clamped to 1. */
    int infinigen_recompute;   /* the worker would run infinigen with the split the planner
                                * chooses (costs[REKV_TECH_INFINIGEN].kvpr_l; its pipeline then
                                * keeps activations); 0: without one */
} rekv_plan_approx;

/* A model as the cost model sees it: one decoder layer's widths and weights, and the depth — what a
 * worker's Hello reports, or rekv_plan_model_from_config computes from a config. */
typedef struct rekv_plan_model {
    int64_t hidden, q_dim, kv_dim; /* elements: activation row, query row, one K (or V) row */
    int n_layers;
    double layer_params;      /* weight elements of one decoder layer (biases and norms left out) */
    double weight_elem_bytes; /* bytes per weight element as the worker holds them */
    int64_t window;           /* sliding window W of the windowed layers (0: none); a streaming
                                 mode fetches at most W + 15 tokens of theirs (whole blocks) */
    int windowed_layers;      /* how many of the n_layers have it */
} rekv_plan_model;

void rekv_plan_model_from_config(const rekv_model_config *cfg, rekv_plan_model *out);

/* rekv_step_shape.act_room_fraction of b sequences of up to s_max tokens, device_tokens of each
 * on the device, cache elements of elem bytes, on a device with room bytes for its KV cache and a
 * step's buffers (rekv_backend_kv_room; <= 0: no limit): the recomputation rows left once the
 * attention buffers (both parities, the whole context) and the device part are placed, over the
 * moved context; 0 where the device holds the recomputation of all of it, else an eighth less, as
 * the pipeline keeps an eighth back where it lowers a split (pipeline_buffers.c). */
double rekv_plan_act_room_fraction(const rekv_plan_model *m, int64_t b, int64_t s_max,
                                   int64_t device_tokens, double elem, double room);

/* Picks the mode for a worker serving up to b sequences of up to s_max tokens: resident when their
 * whole KV cache (cache_elem_bytes per element, K and V, every layer) fits in device_kv_bytes (the
 * device memory left for it; < 0: unknown, taken as enough), else the cheapest of KV fetching,
 * KVPR, ACT and hybrid by rekv_plan_step_cost, priced at the mean context s_max / 2 (a sequence's
 * context grows from its prompt to s_max), with hybrid at the KV share where its link and compute
 * times meet. Ties go to the lower technique (fewer moving parts). The device room the whole cache
 * does not fit still holds each sequence's first tokens (out->device_tokens, by
 * rekv_plan_device_tokens, the part the coordinator assigns): the exact techniques are priced
 * for the rest of the context only — the device-resident part combined with any of them.
 *
 * approx NULL: exact techniques only. Otherwise infinigen is priced too (at approx's f) and
 * chosen only when it is strictly cheaper than every exact technique and its partial key cache
 * (0.3 of every layer's K row, fp32, for b sequences of s_max tokens) and a step's attention
 * buffers (K and V of the whole context in both parities: layer 0 fetches it whole) fit
 * device_kv_bytes; the room the keys leave holds its device-resident part
 * (rekv_cost_device_tokens; the part assigned, rekv_plan_device_tokens, takes the keys' whole
 * columns), which it attends whole and selects past, and with which it is priced. With approx->infinigen_recompute, layer 0's split is the planner's,
 * capped at the tokens whose recomputation rows (rekv_cost_stream_token_bytes less the attention
 * buffers' share) the room left past the keys and buffers holds. */
int rekv_plan_pick_mode(const rekv_cost_profile *prof, const rekv_plan_model *m, int64_t b,
                        int64_t s_max, double cache_elem_bytes, double device_kv_bytes,
                        int weights_offloaded, const rekv_plan_approx *approx, rekv_mode_pick *out,
                        rekv_err *err);

/* ---------------------------------------------------------------- what a worker is built with */

/* What a worker is built with needs one head's width beside m (head_dim: CLO's top-k is per head,
 * infinigen's partial key columns are per KV head; 0 takes the K row as one head).
 *
 * The device memory infinigen's partial keys take for one sequence of `tokens` tokens, bytes:
 * fp32, ceil(REKV_PLAN_INFINIGEN_PARTIAL * head_dim) columns of each KV head's K row (the skew's
 * rk, rekv_cost_partial_cols), every layer — what the worker's pipeline allocates
 * (gpuworker/pipeline.h rekv_ig_partial_key_bytes). (rekv_plan_pick_mode's price takes 0.3 of the
 * K row, a little less where 0.3 head_dim is not whole.) */
double rekv_plan_ig_partial_key_bytes(const rekv_plan_model *m, int64_t head_dim, int64_t tokens);

/* The device-resident part (gpuworker/pipeline.h cfg.device_tokens) a worker in `mode` keeps for
 * each of its b sequences of up to s_max tokens: `asked` when >= 0 (the operator's
 * --device-tokens), else from its device's room for the KV cache (device_kv_bytes,
 * Hello.device_kv_room; <= 0: none) rekv_cost_device_tokens_of of the room, for infinigen of what
 * b sequences' partial keys (rekv_plan_ig_partial_key_bytes) leave of it; 0 for the modes that
 * keep none (resident holds everything there anyway, clo its head caches). The coordinator
 * assigns it (Assign.device_tokens) and prices the worker's steps with it; rekv_plan_pick_mode
 * prices the exact techniques with the room's. */
int64_t rekv_plan_device_tokens(const rekv_plan_model *m, int64_t head_dim, rekv_mode mode,
                                int64_t b, int64_t s_max, double cache_elem_bytes,
                                double device_kv_bytes, int64_t asked);

/* CLO's Eq. 12 for a decode step of `batch` sequences of up to `ctx` tokens: N_p, how many KV
 * heads of a layer can miss and have their top-k (fetch_cap of the context, K and V of head_dim
 * elements of cache_elem_bytes, for every sequence) cross the link while the layer computes —
 * T_comp * B_link / mem_head, with the link's bandwidth from prof and T_comp the layer's
 * decode-shape forward pass (projections and FFN at prof's forward rate for `batch` rows,
 * attention over ctx at its attention rate). (The paper prints T_comp / (B * mem_head); only
 * T_comp * B / mem_head is a count of heads.) INFINITY when nothing limits it (no link measured).
 * The coordinator assigns it to a clo worker at its max batch and context (Assign.persist_np);
 * `rekv eval/bench --mode clo` at the run's. */
double rekv_plan_persist_np(const rekv_cost_profile *prof, const rekv_plan_model *m,
                            int64_t head_dim, int64_t batch, int64_t ctx, double fetch_cap,
                            double cache_elem_bytes);

/* Fills a step shape for one layer of m: batch b, context s tokens (the mean layer's: a windowed
 * layer's min(s, window + 15), the whole blocks a streaming mode fetches), cache elements of
 * cache_elem_bytes, one new token per sequence; kv.weight_bytes is the layer's weights when
 * weights_offloaded, else 0. The hybrid fields are left 0 for the caller; infinigen's are m's
 * depth and query width, and f = REKV_PLAN_INFINIGEN_PRIOR. */
void rekv_plan_shape(const rekv_plan_model *m, int64_t b, int64_t s, double cache_elem_bytes,
                     int weights_offloaded, rekv_step_shape *out);

/* ---------------------------------------------------------------- hybrid pattern under demand */

/* The host bytes a sequence of `blocks` blocks per layer takes at pattern kv_parts:act_parts
 * (0:0 all KV), every layer: what admission reserves for it. The store's rule keeps the KV count
 * the nearest integer to blocks * kv/(kv + act), so it is the floor or the ceiling of that; the
 * reservation is the dearer of the two, never less than the sequence will take. */
double rekv_plan_hybrid_job_bytes(int64_t blocks, int kv_parts, int act_parts, int n_layers,
                                  double kv_block_bytes, double act_block_bytes);

/* The demand-aware pattern of joining sequences (HybridServe's point: host memory is what the
 * ACT cache buys). Algorithm 1 balances one step's link and compute times; but when the store's
 * room binds and sequences are waiting, a more ACT-heavy pattern admits more of them at once, and
 * a step over more sequences makes more tokens per second even when each step is slower. */
typedef struct rekv_hybrid_seq {
    int64_t tokens;      /* the context the next decode step prices: running, its tokens now;
                          * waiting, its prompt */
    int64_t full_tokens; /* waiting: prompt + max new tokens (within the context), the KV that
                          * admission reserves; running: unused */
    double kv_fraction;  /* running: the KV share of its blocks (the pattern it was made with),
                          * 0..1; waiting: unused */
} rekv_hybrid_seq;

typedef struct rekv_hybrid_demand {
    rekv_plan_model model;     /* widths, depth and one layer's weights (rekv_plan_shape) */
    double cache_elem_bytes;   /* bytes per cached element */
    double layer_weight_bytes; /* one layer's weights over the link per step, bytes (0: resident) */
    int64_t device_tokens;     /* each sequence's device-resident part, tokens */
    double kv_block_bytes;     /* the store's cost of one KV block of one layer, bytes */
    double act_block_bytes;    /* the store's cost of one ACT block of one layer, bytes */
    double room_bytes;         /* what admission may still promise joining sequences, bytes */
    const rekv_hybrid_seq *running; /* [n_running] the batch */
    size_t n_running;
    const rekv_hybrid_seq *waiting; /* [n_waiting] in queue order, at most the batch's free
                                     * places; admission takes a prefix of them */
    size_t n_waiting;
    int kv_parts, act_parts; /* the step-time choice (Algorithm 1's), > 0 in all */
    int max_parts;           /* largest part of a candidate pattern (0 means 8) */
} rekv_hybrid_demand;

typedef struct rekv_hybrid_choice {
    int kv_parts, act_parts; /* the pattern the joining sequences are made with */
    size_t n_join;           /* the first n_join waiting sequences fit the room at it */
    int binding;             /* the room held back waiting sequences at the step-time choice */
    double t_step;           /* one layer of a decode step of the batch with them, s (0: empty) */
    double throughput;       /* (n_running + n_join) / (n_layers * t_step): tokens/s */
} rekv_hybrid_choice;

/* The rule: at the step-time pattern, admission takes the longest prefix of the waiting
 * sequences whose reservations (rekv_plan_hybrid_job_bytes) fit room_bytes. When that is all of
 * them the room does not bind and the step-time pattern stands. Otherwise every pattern k:a in
 * lowest terms (k, a <= max_parts) with a smaller KV share is a candidate too, and the one whose
 * batch (the running sequences and the prefix admitted at it) has the highest predicted
 * throughput wins — batch size over the step time that rekv_plan_step_cost (REKV_TECH_HYBRID)
 * predicts for it, at the mean context and the batch's token-weighted KV share; ties (to a
 * relative 1e-9) go to the larger KV share (fewer recomputations), the step-time pattern first.
 * Only ACT-heavier patterns are candidates: a KV-heavier one admits no more, and its step time
 * is Algorithm 1's to judge. Returns -EINVAL on bad parameters. */
int rekv_plan_hybrid_demand(const rekv_cost_profile *prof, const rekv_hybrid_demand *d,
                            rekv_hybrid_choice *out, rekv_err *err);

#endif
