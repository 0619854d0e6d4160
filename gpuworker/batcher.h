/* batcher.h — continuous batching on one pipeline: jobs join and leave a running batch at step
 * boundaries, and each job's tokens are exactly what rekv_generate would produce for it alone
 * (the same sampler per job, the same stop rules, in the same order: EOS, then max_new_tokens,
 * then the model's context).
 *
 * In a step every running job advances by one token: the jobs that joined since the last step run
 * their whole prompt (prefill), the others their last sampled token (decode), all in one
 * rekv_pipeline_step — one GEMM per projection for the whole batch. With a prefill chunk, a prompt
 * longer than it runs a chunk per step (its event has no token until the last chunk), so a long
 * prompt does not stall the running jobs' decode; the attention over the chunks is causal, so the
 * tokens are the same. The cpu backend's GEMM is
 * row-invariant, so each job's logits are bit for bit those of rekv_generate (`rekv generate
 * --local`), whoever shares the step.
 * The rekv-gpuworker daemon drives it from the coordinator's plans; tests drive it directly.
 *
 * Functions return 0 or a negative errno and fill the rekv_err; nothing here prints. */
#ifndef REKV_GPUWORKER_BATCHER_H
#define REKV_GPUWORKER_BATCHER_H

#include <stdint.h>

#include "gpuworker/pipeline.h"

typedef struct rekv_batcher rekv_batcher;

/* One job's outcome of a step. */
typedef struct rekv_batch_event {
    uint64_t job;              /* the caller's job id */
    int32_t token;             /* the token sampled this step; -1 when none (max_new_tokens 0, or
                                  a chunk of its prompt ran) */
    int finished;              /* 1: the job left the batch */
    const char *finish_reason; /* when finished: "length", "eos" or "context" (static string) */
    const int32_t *top_ids;    /* [n_top] the largest logits before the token (ids), or NULL */
    const float *top_vals;     /* [n_top] their raw values, largest first */
    int n_top;                 /* the job's top_logits k (0: none) */
    int has_logprob;           /* the job asked for logprobs (and a token came): */
    float logprob;             /* the token's log-probability (rekv_pipe_item.logprob) */
    const int32_t *top_lp_ids; /* [n_top_lp] the most likely tokens, most likely first */
    const float *top_lp_vals;  /* [n_top_lp] their log-probabilities */
    int n_top_lp;              /* the job's top_logprobs k (0: none) */
} rekv_batch_event;

/* max_batch: most jobs running at once (>= 1). p and c (the config of the pipeline's model, e.g.
 * rekv_engine_config of its engine) are not owned and must outlive the batcher. */
int rekv_batcher_create(rekv_pipeline *p, const rekv_model_config *c, int max_batch,
                        rekv_batcher **out, rekv_err *err);
/* Frees every running job's sequence, then the batcher. NULL is fine. */
void rekv_batcher_free(rekv_batcher *b);

/* Adds a job; it prefills at the next step. max_new_tokens, temperature, top_k, top_p, seed,
 * stop_at_eos, top_logits (<= vocab), logprobs and top_logprobs (<= vocab) of gp are used. The
 * prompt is copied. -EINVAL (empty prompt, token id outside the vocabulary, a job id already
 * running, bad parameters), -E2BIG (prompt longer than the context), -ENOSPC (the batch is full),
 * -ENOMEM; the message says which.
 */
int rekv_batcher_join(rekv_batcher *b, uint64_t job, const int32_t *prompt, int n_prompt,
                      const rekv_gen_params *gp, rekv_err *err);
/* Drops a running job (its sequence is freed). Returns 0, or -ENOENT when it is not running. */
int rekv_batcher_cancel(rekv_batcher *b, uint64_t job);
/* Drops every job. */
void rekv_batcher_clear(rekv_batcher *b);
/* The planner's mini-batches for the next steps: job jobs[i] runs in GPU batch index[i] (0-based).
 * A running job not named falls back, with every other job, to the pipeline's even split; n = 0
 * clears the assignment. */
void rekv_batcher_set_mini_batches(rekv_batcher *b, const uint64_t *jobs, const uint32_t *index,
                                   size_t n);
/* Most prompt tokens a job runs in one step from the next step on (chunked prefill); 0: the whole
 * prompt at once. */
void rekv_batcher_set_prefill_chunk(rekv_batcher *b, int tokens);
/* Jobs in the batch. */
int rekv_batcher_running(const rekv_batcher *b);
/* The ids of the jobs in the batch, in batch order, into ids[cap]; returns how many there are
 * (more than cap: only cap were written). */
int rekv_batcher_job_ids(const rekv_batcher *b, uint64_t *ids, int cap);
/* The running job whose cache is in kvstore sequence store_seq (rekv_pseq_uses_store_seq), into
 * *job: 0, or -ENOENT when none is. */
int rekv_batcher_job_of_store_seq(const rekv_batcher *b, uint64_t store_seq, uint64_t *job);
/* Prompt tokens running job `job` took from the kvstore's prefix cache (0: none, or not
 * running); its prefill starts past them. */
int rekv_batcher_cached_tokens(const rekv_batcher *b, uint64_t job);
/* The kvstore sequence of running job `job` (rekv_pseq_store_seq; 0 resident), or 0 when the job
 * is not running. */
uint64_t rekv_batcher_store_seq(const rekv_batcher *b, uint64_t job);

/* Runs one step. *events (owned by the batcher, valid until the next call) gets one entry per job
 * that was in the batch, in batch order; finished jobs have left it. On a failed forward step the
 * error is returned and nothing is sampled; some jobs' caches may have advanced, so the caller
 * fails them all (rekv_batcher_clear). */
int rekv_batcher_step(rekv_batcher *b, const rekv_batch_event **events, int *n_events,
                      rekv_err *err);

#endif
