/* gpuworker.h — the public interface of rekv's engine: a model loaded for compute, sequences with
 * their KV caches, batched forward passes, and sampling.
 *
 * The engine computes in fp32 on the cpu backend (the reference): weights are converted from the
 * file's dtype once, at engine creation. A forward call takes a batch of sequences, each with any
 * number of new tokens (a whole prompt for prefill, one token for decode), runs every projection
 * of the whole batch as one GEMM, appends each sequence's keys and values to its cache, and returns
 * logits. Functions return 0 or a negative errno and fill the rekv_err. */
#ifndef REKV_GPUWORKER_H
#define REKV_GPUWORKER_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "loader/loader.h"

typedef struct rekv_engine rekv_engine;
typedef struct rekv_seq rekv_seq;

/* Loads the model's weights for compute. Weight matrices stay in the file's dtype (f32, f16 or
 * bf16; fp32 when the file mixes them), vectors become fp32; every product widens the weights
 * exactly, so the results are those of the fp32 widening whichever dtype is kept. The model may
 * be closed afterwards. */
int rekv_engine_create(const rekv_model *model, rekv_engine **out, rekv_err *err);
void rekv_engine_free(rekv_engine *e);
/* The engine holds the matrices only a GEMM reads in the cpu GEMM's tile layout (cpu_gemm.c):
 * untile makes them row-major again, for a backend that reads them so (a pipeline on cuda calls
 * it) or to measure what the layout gives (`rekv bench forward --row-major`). The cpu backend
 * computes the same bits either way. 0 or -ENOMEM (e unchanged); not while a step on e runs. */
int rekv_engine_untile(rekv_engine *e, rekv_err *err);
const rekv_model_config *rekv_engine_config(const rekv_engine *e);
/* The dtype the engine holds its weight matrices in (and moves them to a device in). */
rekv_dtype rekv_engine_weight_dtype(const rekv_engine *e);
/* Bytes of all its weights as held (what a device holds when they are resident). */
size_t rekv_engine_weight_bytes(const rekv_engine *e);
/* Bytes per weight of the layers' matrices as the engine holds them: the weight dtype's size, or
 * with quantized matrices the file's (rekv_config_weight_elem_bytes) — what the planner prices an
 * offloaded layer by. */
double rekv_engine_weight_elem_bytes(const rekv_engine *e);
/* Bytes of the weights one decode step reads whole: every layer, the lm_head and the output
 * projection (not the embedding tables, of which it reads only its tokens' rows). */
size_t rekv_engine_step_weight_bytes(const rekv_engine *e);

/* A sequence whose cache holds up to `capacity` tokens (at most the model's context length). */
int rekv_seq_create(rekv_engine *e, int capacity, rekv_seq **out, rekv_err *err);
void rekv_seq_free(rekv_seq *s);
/* Tokens already in the cache (the position of the next token). */
int rekv_seq_len(const rekv_seq *s);
/* Forgets the last n tokens (n <= len), e.g. to rerun a suffix. */
void rekv_seq_truncate(rekv_seq *s, int len);

typedef struct rekv_batch_item {
    rekv_seq *seq;
    const int32_t *tokens; /* [n_tokens] new tokens, appended at positions len.. */
    int n_tokens;          /* >= 1 */
    int all_logits;        /* 1: logits for every new token; 0: only for the last one */
    float *logits;         /* out: [n_tokens][vocab] or [vocab], fp32 */
} rekv_batch_item;

/* Runs one forward step over a batch of sequences (each sequence at most once per batch); a batch
 * of more than 512 new tokens runs as passes of at most 512 (the same bits, a pass's scratch).
 * Fails without touching any cache when a token id is out of range or a sequence would exceed its
 * capacity (-E2BIG, "... longer than the context ..."). */
int rekv_engine_forward(rekv_engine *e, rekv_batch_item *items, int n_items, rekv_err *err);

/* A fingerprint of the engine's model (fingerprint.c), the key of every cache of what it computes:
 * the skew and head-profile files and the kvstore's prefix cache (a cached block's K,V). Over the
 * shape (n_layers, hidden, n_heads, n_kv_heads, head_dim, rope kind, weight dtype, ffn, vocab,
 * embed_dim, context, architecture), the rope theta, a scaled rope's frequency table, and each
 * tensor as the engine holds it (matrices in its weight dtype, norms and biases fp32; a presence
 * byte and the size first, so a missing bias differs from a zero one; a tensor past 1 MiB by its
 * first MiB and 4 KiB of every 256 KiB after it: a 7B model's every byte would cost seconds at
 * each start). The high 32 bits are CRC32C, the low 32 bits a multiplicative hash of the same
 * bytes (a second CRC with another seed would differ from the first by a constant). */
uint64_t rekv_engine_fingerprint(const rekv_engine *e);

/* Floating-point operations of one forward over `n_tokens` new tokens whose attention spans
 * `ctx_sum` cached positions in total (sum over tokens of positions attended), logits for
 * `n_logits` rows. Counts multiply-adds as 2 FLOPs; for benchmarks. */
double rekv_engine_flops(const rekv_engine *e, double n_tokens, double ctx_sum, double n_logits);

/* ---------------------------------------------------------------- sampling */

typedef struct rekv_sampler {
    float temperature; /* 0: greedy (argmax, lowest id on ties) */
    int top_k;         /* 0: off */
    float top_p;       /* 1: off */
    uint64_t state;    /* RNG state; set by rekv_sampler_init */
} rekv_sampler;

void rekv_sampler_init(rekv_sampler *s, float temperature, int top_k, float top_p, uint64_t seed);
/* The greedy choice: the index of the largest of x[0..n-1], the lowest on ties. */
int rekv_argmax(const float *x, int n);
/* Picks the next token from logits[vocab]: rekv_sample_drawn with rekv_sampler_draw's number.
 * scratch holds 2*vocab floats' worth of memory. -1 when a logit is NaN (REKV_NAN_LOGITS). */
int32_t rekv_sample(rekv_sampler *s, const float *logits, int vocab, void *scratch);
/* The uniform number in [0, 1) the next sample uses, advancing the state; greedy draws nothing
 * (0, the state unchanged). */
float rekv_sampler_draw(rekv_sampler *s);
/* The token s's parameters choose with the number u drawn: greedy is rekv_argmax; otherwise the
 * tokens ranked by logit (lower id first on ties), the first top_k of them, then the shortest
 * prefix of those holding top_p of their weight exp((logit - max) / temperature) (the prefix's
 * weight summed in rank order, their total in id order, in double); of these kept tokens, walked
 * in id order, the first whose running weight exceeds u times their sum (in id order). Only the
 * orders differ from the usual definition, not the distribution; they let a device draw with
 * prefix sums instead of a sort (the kernels' sample: cpu calls this, cuda follows it). */
int32_t rekv_sample_drawn(const rekv_sampler *s, float u, const float *logits, int vocab,
                          void *scratch);
/* What a caller fails with when a draw gave -1: a logit was NaN, which every choice would hide
 * (greedy would emit token 0); a broken model (NaN weights), not a job's fault. The cuda sample
 * kernel does not check (its ids are never -1). */
#define REKV_NAN_LOGITS "the model's logits are NaN (broken or corrupt weights?): no token drawn"
/* The k largest logits as (id, logit) pairs, largest first, lower id first on ties. */
void rekv_top_logits(const float *logits, int vocab, int k, int32_t *ids, float *vals);
/* log(sum_i exp(logits[i])) over the whole row, in double (the largest logit taken out first): a
 * token's log-probability is its logit less this, exact to fp32's rounding. NaN when a logit is. */
double rekv_logsumexp(const float *logits, int vocab);

/* ---------------------------------------------------------------- generation */

typedef struct rekv_gen_params {
    int max_new_tokens;
    float temperature; /* 0: greedy */
    int top_k;         /* 0: off */
    float top_p;       /* 1: off */
    uint64_t seed;
    int top_logits;  /* record the k largest logits before each generated token (0: none) */
    int stop_at_eos; /* stop after generating the model's EOS (it is included in the output) */
    /* the batcher (the worker's jobs): each generated token's log-probability, the log-softmax of
     * the raw logits it was drawn from (before temperature, top-k, top-p); with top_logprobs k
     * (0..vocab) also the k most likely tokens' */
    int logprobs;
    int top_logprobs;
} rekv_gen_params;

typedef struct rekv_gen_result {
    int32_t *ids; /* [n] generated ids (malloc'd) */
    int n;
    int32_t *top_ids;          /* [n][top_logits] (malloc'd) or NULL */
    float *top_vals;           /* [n][top_logits] raw logits, or NULL */
    double prefill_s;          /* wall time of the prompt's forward pass */
    double decode_s;           /* wall time of the decode steps */
    const char *finish_reason; /* "length", "eos" or "context" (the model's context is full) */
} rekv_gen_result;

/* Checks a prompt against the model: not empty, within its context, every id in its vocabulary.
 * 0, or -EINVAL / -E2BIG with the reason. */
int rekv_prompt_check(const rekv_model_config *c, const int32_t *prompt, int n, rekv_err *err);

/* Runs a prompt through the engine and generates up to max_new_tokens. A prompt longer than the
 * context is -E2BIG with a message saying so. Frees nothing of the caller's; free the result with
 * rekv_gen_result_free. */
int rekv_generate(rekv_engine *e, const int32_t *prompt, int n_prompt, const rekv_gen_params *p,
                  rekv_gen_result *out, rekv_err *err);
void rekv_gen_result_free(rekv_gen_result *r);

#endif
