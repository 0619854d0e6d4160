/* pipeline.h — the decode pipeline: the forward pass on a backend, with the KV cache either
 * resident on the device or kept in the kvstore's host arena and streamed in per layer, part of
 * it replaced by recomputation from activations.
 *
 * Modes (DESIGN.md, "The decode pipeline"):
 *   resident  all KV on the device — the reference;
 *   offload   every context token's K and V move host->device each step (FlexGen-style baseline);
 *   kvpr      the host keeps both K,V and the attention input X of every token; each step sends
 *             X[0:l] and recomputes K,V = X·W_K, X·W_V on the device while KV[l:s] streams (KVPR);
 *   act       every context block is stored as activations and recomputed (HybridServe's
 *             activation cache);
 *   hybrid    KV and ACT blocks per request in a kv:act ratio (HybridServe);
 *   infinigen approximate (InfiniGen): the KV lives in the store as for offload, and at layer i-1
 *             a speculation — the partial query of layer i from layer i-1's attention input,
 *             against a partial key cache kept on the device — selects per KV head the tokens
 *             whose speculated score is within alpha of the best; only their rows cross the link,
 *             while layer i-1 computes. Layer 0 and prefill steps fetch everything. With a split,
 *             the activations are kept too and part of what it fetches comes as activations to
 *             recompute from (KVPR within the selection; cfg.split).
 *   clo       approximate (CLO): per sequence, layer and KV head a top-k of its context kept on the
 *             device with the query it was chosen for; a step whose queries stay close to it
 *             (cosine >= the head's threshold, from the head profile) reuses it and moves
 *             nothing, a miss fetches a new top-k chosen by infinigen's speculation. The attention
 *             sink and the recent window stay on the device, and layer 0's whole cache
 *             (mode_clo.c).
 * Weights are resident on the device, or offloaded: each layer's weights move host->device, the
 * next layer's prefetched during the current one, W_K and W_V first (KVPR's fine-grained pipeline).
 *
 * Exactness: every mode computes the same values as resident, bit for bit, in fp32 on the cpu
 * backend. Its GEMM is row-invariant (cpu_gemm.c), so recomputed K,V equal the ones first
 * computed, and neither the split into GPU batches nor the other sequences in a batch change a
 * sequence's bits; the activation stored is the attention input (the normalised layer input), so
 * recomputation repeats exactly the original projection, bias and RoPE. */
#ifndef REKV_GPUWORKER_PIPELINE_H
#define REKV_GPUWORKER_PIPELINE_H

#include <stdint.h>

#include "common/mode.h"
#include "common/progress.h"
#include "gpuworker/device/backend.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/kernels.h"
#include "gpuworker/kv_pool.h"
#include "kvstore/kvstore.h"

typedef enum rekv_schedule {
    REKV_SCHED_ROW = 0,    /* each GPU batch through all layers (latency) */
    REKV_SCHED_COLUMN = 1, /* each layer over all GPU batches (throughput; weights loaded once) */
} rekv_schedule;

struct rekv_skew;
struct rekv_heads;

typedef struct rekv_pipeline_config {
    rekv_mode mode;
    int offload_weights; /* weights stream host->device per layer */
    rekv_schedule schedule;
    int gpu_batches;         /* a step's batch is split into this many GPU batches (>= 1) */
    int split;               /* kvpr: context tokens per sequence recomputed from activations, l
                                (clamped to the context); the caller picks it
                                (rekv_plan_kvpr_choose). infinigen created with split > 0
                                keeps activations too (rekv_pipeline_keeps_act) and recomputes
                                what it fetches: [device part, split) of a layer it fetches
                                whole (layer 0, prefill), and of a selecting layer's selection
                                up to split tokens whose activation row is fewer bytes than the
                                K,V rows its KV heads selected (the tokens most heads chose) —
                                the same values, fewer bytes; created with 0 it keeps none and
                                recomputes nothing, whatever a step's split */
    int kv_parts, act_parts; /* hybrid: block pattern kv:act, e.g. 1:1 (the caller picks it) */
    rekv_dtype cache_dtype;  /* host cache dtype: F32 (exact), F16, INT8 or INT4 */
    int act_gpu_blocks;      /* ACT_GPU (HybridServe): each sequence's first N ACT blocks per
                                layer are also kept on the device, so their activations never
                                cross the link again (act, hybrid, kvpr); 0: none */
    int device_tokens;       /* the device-resident part of each sequence's context: its first N
                                tokens' K,V of every layer are also kept on the device (copied
                                there as they are made; the store stays complete), so a step
                                takes them from there and moves only the rest — as KV, or as
                                activations to recompute (kvpr's split counts from 0, so it
                                recomputes tokens [N, split)) — offload, kvpr, act, hybrid;
                                infinigen attends the part whole and selects among the rest
                                (resident keeps everything there anyway; clo refuses it);
                                0: none */
    int push;                /* the kvstore writes the KV rows into the device's attention buffers
                                (CUDA IPC / memfd) instead of the worker copying them from the
                                arena (pull); needs a store with a push backend of this backend's
                                kind, and a mode other than resident. 0: pull */
    /* infinigen */
    const struct rekv_skew *skew; /* the model's skew (gpuworker/skew.h; not owned, kept for the
                                     pipeline's life); required by infinigen and clo */
    float alpha;                  /* speculated-score margin (default 4: the paper's for OPT) */
    float max_fraction;           /* most tokens fetched per (sequence, layer), as a fraction of
                                     its context (default 0.2, the paper's); clo: the top-k
                                     fetched on a miss, besides sink and recent window */
    rekv_select select;
    uint64_t select_seed; /* REKV_SELECT_RANDOM's */
    int lookahead;        /* 1 (InfiniGen): layer i's speculation runs at layer i-1 from
                             its input, so layer i's fetch overlaps layer i-1's compute
                             (but layer 1's from its own input: pl_ig_lookahead);
                             0: from layer i's own input — a better guess on models whose
                             layers change the residual stream much (stories260K), the
                             fetch then overlapping only other GPU batches' compute;
                             -1 (default): the mode's — infinigen 1, clo 0 (CLO tests a
                             head's own query, as its paper does) */
    size_t kv_pool_bytes; /* InfiniGen §4.4's pool limit: the most bytes of one sequence's K,V
                             kept per selecting layer (> 0) together, at the cache dtype's row
                             size — limit / ((n_layers - 1) * 2 * n_kv * row) entries per
                             (layer, KV head), at least one block (16). Past it each new entry
                             evicts one (kv_pool_policy), never selected or attended again; the
                             evicted rows stay in the store (masked, not reclaimed). Layer 0,
                             fetched whole, is not pooled. infinigen only, no device part; a
                             step of several tokens must fit the pool. 0 (default): no limit */
    rekv_kv_pool_policy kv_pool_policy; /* the victim: REKV_KV_POOL_COUNTER (default) or _FIFO */
    /* clo */
    const struct rekv_heads *heads; /* the model's head profile (gpuworker/heads.h; not owned,
                                       kept for the pipeline's life); required by clo */
    float eta, power;  /* the reuse thresholds' Eq. 7 bound and Eq. 8 exponent (REKV_HEADS_ETA,
                          REKV_HEADS_POWER) */
    double persist_np; /* Eq. 12's N_p: per layer, the heads whose misses the link can serve;
                          the hardest heads beyond them (difficulty D > 0, Eq. 11-13) keep
                          their whole KV on the device. INFINITY (default): none */
    /* the kvstore's prefix cache (kvstore.proto Prefix): a sequence made with
       rekv_pseq_create_prefix starts from the longest cached run of its prompt's full blocks and
       prefills only the rest; every sequence publishes its full blocks as they fill and when
       freed. Every mode (rekv_pipeline_takes_prefix): what lives on the device comes from the
       cached blocks — resident's cache, the device part, ACT_GPU's copy, the partial keys —
       or, for act's and hybrid's device part, from the sequence's next step; resident, whose
       cache is not in the store, publishes nothing. Needs a store. 0 (default): off */
    int prefix_cache;
    uint64_t fingerprint; /* the model's (rekv_engine_fingerprint) for the cache's keys; 0: the
                             pipeline computes it at creation when prefix_cache is on */
} rekv_pipeline_config;

void rekv_pipeline_config_defaults(rekv_pipeline_config *cfg);

/* 1 when a pipeline of cfg has the store keep every token's attention input beside its K,V (the
 * activations in kvstore sequence id + 1): kvpr, and infinigen created with a split > 0. */
int rekv_pipeline_keeps_act(const rekv_pipeline_config *cfg);
/* 1 when a pipeline made with cfg starts its sequences from the kvstore's prefix cache
 * (cfg->prefix_cache, in a mode and configuration that allow it: rekv_pseq_create_prefix), else
 * 0. The worker tells the coordinator (Hello.prefix_cache), whose admission counts on it. */
int rekv_pipeline_takes_prefix(const rekv_pipeline_config *cfg);

/* Per-layer counters of one step (or accumulated), exact. */
typedef struct rekv_layer_counters {
    uint64_t h2d_bytes[REKV_XFER_KINDS];
    uint64_t d2h_bytes[REKV_XFER_KINDS];
    uint64_t tokens_recomputed; /* context tokens whose K,V were recomputed from activations */
    uint64_t tokens_fetched;    /* context tokens whose K,V moved host->device (infinigen: slots
                                   per KV head, i.e. fetched rows / n_kv_heads) */
    uint64_t tokens_device;     /* context tokens whose K,V a streaming mode took from the
                                   device-resident part (cfg.device_tokens) */
    uint64_t tokens_considered; /* context tokens a step could have fetched (infinigen, clo: of
                                   the layers and steps that select; other modes: 0) */
    uint64_t head_hits;         /* clo: (sequence, KV head) steps that reused their top-k */
    uint64_t head_misses;       /* ... and that fetched a new one */
} rekv_layer_counters;

typedef struct rekv_pipeline rekv_pipeline;
typedef struct rekv_pseq rekv_pseq;

/* store: a connected kvstore client (not owned), required by every mode but resident. The
 * engine provides the weights (not owned). */
int rekv_pipeline_create(rekv_engine *engine, rekv_backend *be, rekv_kvstore_client *store,
                         const rekv_pipeline_config *cfg, rekv_pipeline **out, rekv_err *err);
void rekv_pipeline_free(rekv_pipeline *p);
const rekv_pipeline_config *rekv_pipeline_get_config(const rekv_pipeline *p);
/* Whether the host memory the pipeline copies from (the kvstore arena, offloaded weights) is
 * page-locked: 1 all of it, 0 the backend refused some (a warning was logged: those copies run
 * from pageable memory, far below the link's speed), -1 nothing to lock or a backend that does
 * not lock (cpu). */
int rekv_pipeline_page_locked(const rekv_pipeline *p);
/* How many layers project Q, K, V as one GEMM over matrices concatenated at upload (the cuda
 * kernels' qkv, resident weights): 0 on the cpu backend and with weights offloaded. */
int rekv_pipeline_fused_layers(const rekv_pipeline *p);

/* A sequence of up to `capacity` tokens; its cache lives where the mode says. */
int rekv_pseq_create(rekv_pipeline *p, int capacity, rekv_pseq **out, rekv_err *err);
/* The same, for a sequence whose prompt is prompt[n_prompt]: with cfg.prefix_cache (in a mode
 * that allows it) it starts from the kvstore's longest cached run of the prompt's full blocks,
 * all but its last token at most (that one's logits are computed), so rekv_pseq_len says where
 * its prefill starts; else as rekv_pseq_create. */
int rekv_pseq_create_prefix(rekv_pipeline *p, int capacity, const int32_t *prompt, int n_prompt,
                            rekv_pseq **out, rekv_err *err);
/* Prompt tokens it took from the prefix cache when made (0: none). */
int rekv_pseq_cached(const rekv_pseq *s);
void rekv_pseq_free(rekv_pseq *s);
int rekv_pseq_len(const rekv_pseq *s);
/* infinigen with cfg.kv_pool_bytes: s's KV pool (which entries remain, their counters; pool
 * layer * n_kv + head), for reading; NULL without one. */
const rekv_kv_pool *rekv_pseq_kv_pool(const rekv_pseq *s);
/* 1 when the kvstore sequence store_seq holds this sequence's cache (kvpr: its K,V or its
 * activations), else 0 (resident: never). Maps a store's rekv_kvstore_client_take_lost_seq to
 * the sequence that lost blocks. */
int rekv_pseq_uses_store_seq(const rekv_pseq *s, uint64_t store_seq);
/* The kvstore sequence holding its K,V (kvpr: the activations are in the next one); 0 resident. */
uint64_t rekv_pseq_store_seq(const rekv_pseq *s);

/* What crosses back from the device per item is what it asks for: the whole logits row, or only
 * the token a sampler draws on the device (and the top logits it reports), or nothing (a prompt
 * chunk). */
typedef struct rekv_pipe_item {
    rekv_pseq *seq;
    const int32_t *tokens; /* [n_tokens] new tokens */
    int n_tokens;
    float *logits;     /* out: [vocab], for the last new token; NULL: not copied back */
    int gpu_batch;     /* 0: the step splits the batch into cfg.gpu_batches evenly; k >= 1 on
                          every item: items with equal k form one GPU batch (a mini-batch of
                          the planner's bin packing), in increasing k */
    rekv_sampler *smp; /* not NULL: the device draws the next token from the last new token's
                          logits, as rekv_sample(smp, ...) does (the state advances only when the
                          step succeeds) ... */
    int32_t *token;    /* ... into *token */
    int n_top;         /* ... with the n_top largest logits before it (rekv_top_logits) */
    int32_t *top_ids;  /* [n_top] */
    float *top_vals;   /* [n_top] */
    float *logprob;    /* ... and, not NULL: the drawn token's log-probability (its logit less
                          rekv_logsumexp of the raw logits, in double, rounded once) ... */
    float *top_lp;     /* ... and the n_top largest's, [n_top] (may be NULL when n_top is 0) */
} rekv_pipe_item;

/* What the planner may change between steps; the mode, weight placement and cache dtype are fixed
 * for a pipeline's life (they decide what the store holds). Any value gives the same tokens. */
typedef struct rekv_step_params {
    int split;               /* kvpr, infinigen keeping activations: as the config's */
    int kv_parts, act_parts; /* hybrid: pattern of the sequences made from now on (a sequence's
                                blocks keep the pattern it was made with) */
    int gpu_batches;         /* even split when items carry no gpu_batch */
    rekv_schedule schedule;
} rekv_step_params;

int rekv_pipeline_set_step(rekv_pipeline *p, const rekv_step_params *sp, rekv_err *err);

/* One forward step over a batch (prefill: many tokens per sequence; decode: one). */
int rekv_pipeline_step(rekv_pipeline *p, rekv_pipe_item *items, int n_items, rekv_err *err);

/* Resident decode steps that ran as one device graph (pipeline_graph.c), and how many graphs were
 * captured (*captures, may be NULL), since creation. */
uint64_t rekv_pipeline_graph_steps(const rekv_pipeline *p, uint64_t *captures);

/* Counters accumulated since creation or the last reset: per layer ([n_layers]) and in total. */
const rekv_layer_counters *rekv_pipeline_counters(const rekv_pipeline *p,
                                                  rekv_layer_counters *total);
void rekv_pipeline_counters_reset(rekv_pipeline *p);
/* clo, since creation or the last reset: per layer and KV head ([n_layers][n_kv] each), the
 * (sequence, decode step)s that reused the head's cached top-k (*hits) or fetched a new one
 * (*misses); layer 0 and persistent heads count in neither. -EINVAL (and NULLs) outside clo. */
int rekv_pipeline_head_cache_counts(const rekv_pipeline *p, const uint64_t **hits,
                                    const uint64_t **misses);
/* infinigen's selected fraction f (the planner's rekv_step_shape.infinigen_fraction) from per-layer
 * counters ([n_layers]): of the tokens its selecting layers (> 0) could have fetched, the share
 * they selected (fetched or recomputed); layer 0 fetches whole, so it is left out. *considered and
 * *selected (may be NULL): the sums. 0 when nothing was considered. */
double rekv_pipeline_selected_fraction(const rekv_layer_counters *per, int n_layers,
                                       uint64_t *considered, uint64_t *selected);
/* Each step's totals since the last reset, in order ([*n_steps], owned by the pipeline). */
const rekv_layer_counters *rekv_pipeline_step_counters(const rekv_pipeline *p, size_t *n_steps);

/* The device bytes of one sequence's partial keys (infinigen, clo) for cap tokens: fp32
 * [n_layers][cap][n_kv][rk]. The worker sets its device room aside for them. */
size_t rekv_ig_partial_key_bytes(const rekv_model_config *c, int rk, int cap);

/* infinigen's selection for one (sequence, layer) from its speculated scores [n_heads][len]
 * (pipeline_infinigen.c): fills sel[g * len + j], j < m, with KV head g's tokens (positions
 * ascending) and returns m, the same for every KV head. key seeds REKV_SELECT_RANDOM. scratch:
 * (n_kv + 1) * len floats. */
int rekv_ig_select(const float *scores, int n_heads, int n_kv, int len, float alpha,
                   float max_fraction, rekv_select how, uint64_t key, int32_t *sel, float *scratch);
/* One sequence's whole selection as the ig_select kernel makes it (kernels.h rekv_ig_seq): among
 * [dev, len) of its scores (scores + q->scores), or with a KV pool among each KV head's live
 * positions, the pools then touched and the new token admitted; sel and *q->m set (also
 * returned). q->scratch: rekv_ig_scratch_floats(len, ...) floats. The cpu kernel's and the step
 * thread's selection, so the two are the same bits. */
int rekv_ig_select_seq(const float *scores, const rekv_ig_seq *q, const rekv_ig_shape *sh);
/* clo's decision for one (sequence, layer, KV head) at a decode step (mode_clo.c), a pure
 * function. q, label: [group][head_dim] the group's queries now and when the head's top-k was
 * chosen (label NULL: nothing cached yet, a miss); imp: [group] the query heads' importances
 * (Eq. 10's weights); tau: the head's threshold (Eq. 7-9). A hit — Eq. 10's importance-weighted
 * harmonic mean of the query/label cosines (double) at least tau — returns 0. A miss returns k =
 * round(frac * len) within [1, min(kmax, middle)] and fills out[0..k) with the offsets, past the
 * 4 sink tokens, of the k tokens of the middle [sink, len - recent) with the largest sum over the
 * group of each head's softmax of scores ([group][len], the speculated scores); ties: the lower
 * position. scratch: 2 len floats. */
int rekv_clo_decide(const float *q, const float *label, const double *imp, double tau, int group,
                    int head_dim, const float *scores, int len, float frac, int kmax,
                    float *scratch, int32_t *out);

/* Generates for a batch of prompts together (prefill as one step, then decode steps over the
 * sequences still running), with the same sampling as rekv_generate. results[n] are filled. */
int rekv_pipeline_generate(rekv_pipeline *p, const int32_t *const *prompts, const int *n_prompts,
                           int n, const rekv_gen_params *params, rekv_gen_result *results,
                           rekv_err *err);
/* The same, calling progress(arg, tokens generated so far, n * max_new_tokens) after every step
 * (progress may be NULL). */
int rekv_pipeline_generate_progress(rekv_pipeline *p, const int32_t *const *prompts,
                                    const int *n_prompts, int n, const rekv_gen_params *params,
                                    rekv_gen_result *results, rekv_progress_fn progress, void *arg,
                                    rekv_err *err);

#endif
