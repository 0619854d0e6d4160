/* co_plan.h — the coordinator's planner in the loop: before each step of a worker it prices the
 * running batch with the worker's measured profile (coordinator/planner.h) and chooses the KVPR
 * split, the hybrid KV:ACT pattern, the mini-batches (F_b bin packing) and the schedule; after the
 * step it compares the worker's measured busy times with its prediction and rescales the profile
 * (link and compute separately), so the next choice adapts. Private to the coordinator. */
#ifndef REKV_COORDINATOR_CO_PLAN_H
#define REKV_COORDINATOR_CO_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "common/mode.h"
#include "coordinator/planner.h"
#include "proto/worker.pb-c.h"

typedef struct co_plan_state {
    int have_profile;       /* the worker sent a profile: plan its steps */
    int mode;               /* rekv_mode of the worker (its storage layout; fixed) */
    rekv_cost_profile prof; /* as measured by the worker */
    uint32_t hidden, kv_dim, q_dim, n_layers;
    double elem_bytes;     /* bytes per K or V element, scales included (hello_elem_bytes) */
    uint64_t layer_params; /* weights of one layer, elements */
    int offload_weights;
    uint64_t device_buffer_bytes; /* the worker's room for a step's buffers; 0: no limit */
    int64_t device_tokens;        /* each sequence's device-resident part (Hello), tokens */
    int keeps_act; /* the store holds activations beside K,V: kvpr; infinigen made with a split
                      (Hello.split), whose steps then get one (layer 0's, rekv_plan_step_cost) */
    rekv_plan_scales scales; /* the profile's online correction (planner.h) */
    double pred_pcie_s, pred_compute_s, pred_step_s; /* of the last step planned */
    /* the last choices */
    int split, kv_parts, act_parts, gpu_batches, column;
    /* hybrid: the store's room bound the last co_plan_join_pattern (its pattern was
     * rekv_plan_hybrid_demand's, not the step-time one) */
    int join_binding;
    uint64_t steps;             /* steps planned */
    uint64_t multi_batch_steps; /* of those, split into several mini-batches */
    /* infinigen: tokens its selecting layers could have fetched, and fetched, over its steps */
    uint64_t tokens_considered, tokens_selected;
    /* the worker's kvstore (WorkerMsg.store): 0 bytes when it has none or did not say */
    uint64_t store_instance, store_host_bytes, store_kv_bytes, store_act_bytes;
    uint64_t store_spill_bytes; /* what admission counts on the store's spill tier */
    int prefix_cache; /* its sequences start from the store's prefix cache (Hello.prefix_cache) */
    uint64_t store_busy_bytes;  /* the arena in use less what the prefix cache gives back */
} co_plan_state;

/* Takes the worker's word on its kvstore (NULL: it has none now). */
void co_plan_store(co_plan_state *ps, const Rekv__Worker__StoreRoom *room);

/* The kvstore host memory a job of `tokens` tokens (prompt + max_new_tokens) takes at its full
 * length on this worker, bytes: per 16-token block of every layer, the blocks its mode stores —
 * KV (offload, infinigen), ACT (act), both (kvpr, infinigen with a split: its KV and its
 * activations), hybrid's at
 * kv_parts:act_parts, the pattern its sequence is made with (rekv_plan_hybrid_job_bytes; 0:0 is
 * 1:1, the worker's pattern before any Plan's) — at the store's per-block cost. 0 when the worker
 * keeps no cache in a store (resident) or did not say its store's sizes. */
uint64_t co_plan_job_store_bytes(const co_plan_state *ps, uint64_t tokens, int kv_parts,
                                 int act_parts);

/* The most kvstore bytes the running jobs on this worker's store may take at their full length:
 * the arena; for the exact modes with a spill tier, up to arena + spill as long as one layer of
 * them fits a layer window (half the arena less two big slots, pipeline_kvstore.c plan_windows),
 * never less than the arena. Admission's one budget (co_workers.c store_fits says which part of
 * it holds a job back). */
uint64_t co_plan_store_budget(const co_plan_state *ps);

/* The KV:ACT pattern of the hybrid sequences this worker's next step makes: admission charges the
 * joining jobs at it and the Plan's StepParams carry it, which the worker applies before the
 * joins. The step-time pattern (rekv_plan_hybrid_pattern at the batch's mean context), or, when
 * room_bytes (the store's budget less what its running jobs hold) cannot take every waiting job at
 * it, rekv_plan_hybrid_demand's. running: the batch (context, the KV share of its pattern);
 * waiting: the queue's first jobs in order, at most the batch's free places (prompt, full length).
 * 1:1 for a worker without a profile (its Plans carry no pattern); any pattern for the other modes
 * (they ignore it). */
void co_plan_join_pattern(co_plan_state *ps, const rekv_hybrid_seq *running, size_t n_running,
                          const rekv_hybrid_seq *waiting, size_t n_waiting, uint64_t room_bytes,
                          int *kv_parts, int *act_parts);

/* What a worker whose Hello asks builds its pipeline with (worker.proto Assign). */
typedef struct co_assign {
    rekv_mode mode;    /* the Hello's mode, or for "auto" rekv_plan_pick_mode's pick */
    int split;         /* infinigen picked by auto: layer 0's split; else 0 */
    int device_tokens; /* rekv_plan_device_tokens, or the Hello's device_tokens_asked */
    double persist_np; /* clo: rekv_plan_persist_np at its max batch and context; else INFINITY */
    char reason[640];  /* one line: why this mode, and what the device keeps */
} co_assign;

/* The Assign for a Hello that asks. The mode: the one it names, or for "auto" rekv_plan_pick_mode
 * over what it reports (its profile, the model's shape, its batch and context, its device's room
 * for the KV cache, and whether it allows an approximate mode: infinigen, at the prior f, with the
 * split the planner chooses for its layer 0); resident without a kvstore or a usable profile. The
 * device part and N_p by the planner's rules for that mode at the worker's max batch and
 * context, the device part as the operator asked where the Hello says so. 0, or -EINVAL (reason
 * says why) for a mode that is not one. */
int co_plan_assign(const Rekv__Worker__Hello *h, co_assign *out);
/* The model's shape as a Hello reports it (what the planner prices the worker's steps with). */
rekv_plan_model co_plan_hello_model(const Rekv__Worker__Hello *h);

/* Takes the worker's Hello: profile, shape, mode. */
void co_plan_init(co_plan_state *ps, const Rekv__Worker__Hello *h);

/* The prefill chunk of the worker's next step (chunked prefill), at most cap tokens (0: whole
 * prompts): the prompt tokens the profile prices at half a decode step of the running batch, so a
 * step that also prefills takes about 1.5 decode steps; each token priced with its GEMMs and its
 * attention over `prompt` tokens (the longest prompt being prefilled: its last chunk is the
 * dearest), at a prefill chunk's attention rate where the profile has one. A multiple of 16 from 16
 * up, else what fits (at least 1). cap when nothing is predicted
 * yet (no profile, resident, no step). */
uint32_t co_plan_prefill_chunk(const co_plan_state *ps, uint32_t cap, uint32_t prompt);

/* Chooses the parameters of a step over n jobs (ids jobs[], contexts ctx[] in tokens, kv_frac[]
 * the KV share of each one's blocks — hybrid, the pattern it was made with; NULL: the step's).
 * Hybrid: the step's pattern (the sequences it makes) is kv_parts:act_parts (co_plan_join_pattern),
 * or the step-time pattern when 0:0. Fills out (with mb_job/mb_index as its storage, n entries
 * each) and returns 1, or 0 when there is nothing to choose (no profile, resident mode, no jobs).
 */
int co_plan_step(co_plan_state *ps, const uint64_t *jobs, const int64_t *ctx, const double *kv_frac,
                 int n, int kv_parts, int act_parts, Rekv__Worker__StepParams *out,
                 uint64_t *mb_job, uint32_t *mb_index);

/* How many blocks (of one layer) a mini-batch's buffers may hold on the worker's device, from its
 * device_buffer_bytes; 0: no limit known. */
int64_t co_plan_block_capacity(const co_plan_state *ps);

/* What the planner predicted for one step (its pred_pcie_s and pred_compute_s when it planned
 * it; 0: nothing), kept until the step's Progress: a worker holds two Plans, so the last
 * prediction is the next step's, not the one reporting. */
typedef struct co_plan_pred {
    double pcie_s, compute_s;
} co_plan_pred;

/* Feeds back a finished step's counters: its measured kernel and link busy times against pred,
 * its prediction, and infinigen's selection. */
void co_plan_observe(co_plan_state *ps, const Rekv__Worker__Counters *c, const co_plan_pred *pred);

/* infinigen's selected fraction f measured so far (tokens_selected / tokens_considered), which
 * its step predictions are priced at; 0 before any. A worker's mode is fixed once assigned (its
 * Assign comes before its first step), so f does not re-decide the mode. */
double co_plan_selected_fraction(const co_plan_state *ps);

#endif
