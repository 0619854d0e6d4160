/* cost.h — the vocabulary of rekv's cost model that the worker and the coordinator share: what the
 * hardware costs (rekv_cost_profile) and HybridServe's fitted linear time models. The worker's
 * profiler measures and fits these (gpuworker/profile.c) and sends them in its Hello; the
 * coordinator's planner (coordinator/planner.h) prices and decides with them. Pure data and math:
 * nothing here decides anything.
 *
 * Units: seconds, bytes, FLOP, tokens. */
#ifndef REKV_COMMON_COST_H
#define REKV_COMMON_COST_H

#include <math.h>
#include <stddef.h>

#include "common/err.h"

/* y = a + b*x. HybridServe fits T_load_kv and T_kv_gen this way from samples (001 Sec. 4.3,
 * "Sampling-based linear regression"; R^2 = 0.99 on their RTX 4090). */
typedef struct rekv_linear {
    double a; /* intercept, s (a fixed cost per call: launch, DMA setup) */
    double b; /* slope, s per token */
} rekv_linear;

/* Evaluates a fitted time model at n tokens. n <= 0 gives 0, not the intercept: no work means no
 * launch and no copy, so an empty side of the pipeline costs nothing (this is what makes F_b of a
 * mini-batch with no ACT blocks infinite rather than finite and misleading). */
double rekv_linear_eval(const rekv_linear *m, double n);

/* Least-squares fit of ys = a + b*xs over n >= 2 samples (centred sums, so large xs such as token
 * counts do not cancel). Returns -EINVAL when n < 2, a pointer is NULL, or all xs are equal. */
int rekv_linear_fit(const double *xs, const double *ys, size_t n, double *a, double *b,
                    rekv_err *err);

/* What the hardware costs. Filled by the worker's profiler from its own measurements. */
typedef struct rekv_cost_profile {
    double h2d_bw;         /* host->device link bandwidth, bytes/s (KVPR's v_com) */
    double h2d_latency;    /* fixed cost of one host->device copy, s (0 gives the papers' models) */
    double gemm_flops;     /* sustained GEMM throughput over many rows, FLOP/s (KVPR's v_gpu):
                              what recomputation runs at */
    double fwd_flops_rate; /* a decode step's forward pass (GEMMs over a batch's few rows),
                              FLOP/s, far below gemm_flops on a GPU and on the cpu; 0: taken as
                              gemm_flops (rekv_cost_fwd_rate) */
    rekv_linear load_kv;   /* T_load_kv(n tokens): time to load n tokens' KV of one layer, s */
    rekv_linear kv_gen;    /* T_kv_gen(n tokens): time to regenerate n tokens' KV from ACT, s */
    double t_load_w; /* T_load_w: time to load one decoder layer's weights, s (0 if resident) */
    /* A decode-shape GEMM's time against its rows, per FLOP of one row: T(rows) = (a + b*rows) *
     * row_flops — at few rows the weights stream for little work (memory-bound), at many the
     * FLOPs dominate. a = b = 0: not measured (fwd_flops_rate stands for every row count). */
    rekv_linear fwd_gemm;
    double attn_flops_rate;       /* the attention kernel at a decode step's shape (one query per
                                     sequence over its context), FLOP/s; 0: priced as the GEMMs */
    double attn_chunk_flops_rate; /* at a prefill chunk's (many rows of one sequence over its
                                     context: each key read once for them all), FLOP/s; 0: not
                                     measured (attn_flops_rate) */
} rekv_cost_profile;

/* The rate a decode step's forward pass runs at: fwd_flops_rate, or gemm_flops when unmeasured. */
static inline double rekv_cost_fwd_rate(const rekv_cost_profile *p)
{
    return p->fwd_flops_rate > 0 ? p->fwd_flops_rate : p->gemm_flops;
}

/* The forward pass's rate for a step of `rows` new rows (a decode step: its batch), from
 * fwd_gemm where it was measured: rows / (a + b*rows); else rekv_cost_fwd_rate. */
static inline double rekv_cost_fwd_rate_at(const rekv_cost_profile *p, double rows)
{
    double t = p->fwd_gemm.a + p->fwd_gemm.b * rows;
    return rows > 0 && p->fwd_gemm.b > 0 && t > 0 ? rows / t : rekv_cost_fwd_rate(p);
}

/* Bytes per activation element beside a KV cache of kv_elem bytes per K or V element, scales
 * included (common/dtype.h: rekv_kv_elem_bytes, rekv_act_dtype): the cache's own for f32 and f16,
 * fp32 beside an int8 or int4 cache — whose elements take under 2 bytes (1 + 2/group, 0.5 +
 * 2/group), which is how a price tells them. */
static inline double rekv_cost_act_elem_bytes(double kv_elem)
{
    return kv_elem < 2.0 ? 4.0 : kv_elem;
}

/* Device bytes a streaming step's buffers take per context token of a GPU batch
 * (gpuworker/pipeline.c): K and V in the cache dtype (elem bytes) and the activation row
 * (rekv_cost_act_elem_bytes) in both parities' buffers, plus the fp32 recomputation input and
 * K,V. */
static inline double rekv_cost_stream_token_bytes(double hidden, double kv_dim, double elem)
{
    return 2.0 * (2.0 * kv_dim * elem + hidden * rekv_cost_act_elem_bytes(elem)) + 4.0 * hidden +
           8.0 * kv_dim;
}

/* The device-resident part (gpuworker/pipeline.h cfg.device_tokens) a worker keeps for each of
 * its b sequences of up to cap tokens, from the device memory its KV cache could take once the
 * weights are placed (room, bytes, rekv_backend_kv_room: less the tenth of the device kept for
 * the backend's workspace and a prefill's rows; <= 0: none): the streaming buffers of a step
 * over b sequences of cap tokens (stream_token_bytes each) come first, and what is left holds
 * whole tokens of kv_token_bytes (K and V of every layer). The coordinator's planner assigns it
 * to the worker (rekv_plan_device_tokens) and prices its steps with it: one rule. */
static inline int rekv_cost_device_tokens(double room, double b, int cap, double kv_token_bytes,
                                          double stream_token_bytes)
{
    if (!(room > 0) || !(b > 0) || !(kv_token_bytes > 0) || cap <= 0)
        return 0;
    double n = (room - b * cap * stream_token_bytes) / (b * kv_token_bytes);
    return n >= cap ? cap : n > 0 ? (int)n : 0;
}

/* rekv_cost_device_tokens for a model's shape (activation row hidden, one K row kv_dim, n_layers
 * layers) and cache elements of elem bytes. */
static inline int rekv_cost_device_tokens_of(double room, double b, int cap, double hidden,
                                             double kv_dim, double n_layers, double elem)
{
    return rekv_cost_device_tokens(room, b, cap, 2.0 * kv_dim * elem * n_layers,
                                   rekv_cost_stream_token_bytes(hidden, kv_dim, elem));
}

/* InfiniGen's partial columns per KV head: ceil(ratio * head_dim) in [1, head_dim], with 1e-9 of
 * slack so that 0.3 * 10 is 3 — the skew's rk (gpuworker/skew.h), whose partial keys the worker
 * keeps on the device and the planner sizes its device part by. */
static inline int rekv_cost_partial_cols(double ratio, int head_dim)
{
    double x = ceil(ratio * head_dim - 1e-9);
    return x < 1 ? 1 : x > head_dim ? head_dim : (int)x;
}

#endif
