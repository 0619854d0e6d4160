/* heads.h — CLO's head profile (§3.2–3.3 of the CLO paper, ../shared/papers/002_*), the offline
 * half of `--mode clo` (its run time is not built yet: issue 13).
 *
 * Per layer and query head, from one calibration forward pass:
 *   - adjacent_cos: the mean cosine between the post-RoPE queries of adjacent decode positions
 *     (CLO's Figure 5: how often a cached top-k can be reused), pairs (p-1, p) with p-1 >=
 *     REKV_HEADS_FROM;
 *   - importance in [0, 1]: how much the head needs the middle of its context. CLO takes
 *     DuoAttention's trained gates; rekv measures the same property without training: the relative
 *     squared error of the head's attention output when it sees only REKV_HEADS_SINK first and
 *     REKV_HEADS_RECENT last tokens (a streaming head loses nothing), summed over the positions
 *     whose context is longer than that, divided by the largest over the model's heads (so the
 *     most sensitive head is 1; all 0 when no position is long enough).
 * The reuse thresholds come from them at run time (rekv_heads_tau: Eq. 7–9 with eta and p), so
 * they can be tuned without profiling again; a GQA group's similarity is aggregated by Eq. 10
 * (rekv_heads_aggregate) and its reuse difficulty is Eq. 11 (rekv_heads_difficulty).
 *
 * The file is JSON (small, readable: `rekv heads --json` prints the same), cached as
 * $XDG_CACHE_HOME/rekv/heads-<fingerprint>-<build tag>.json beside the skew, keyed by the
 * model's fingerprint and the build (rekv_engine_fingerprint, rekv_cache_build_tag: the queries are
 * what is measured, on a sample the model and the sampler make). */
#ifndef REKV_GPUWORKER_HEADS_H
#define REKV_GPUWORKER_HEADS_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "gpuworker/gpuworker.h"

#define REKV_HEADS_FROM 32      /* positions before this are a prompt, not decode steps */
#define REKV_HEADS_SINK 4       /* CLO's attention sink ... */
#define REKV_HEADS_RECENT 64    /* ... and recent window, always attended */
#define REKV_HEADS_ETA 0.95     /* Eq. 7's upper bound on the threshold (the most important head) */
#define REKV_HEADS_POWER 2.0    /* Eq. 8's p: lambda = importance^p (the paper: 2 or 3) */
#define REKV_HEADS_EPSILON 0.05 /* Eq. 11's error margin */

typedef struct rekv_heads {
    int n_layers, n_heads, n_kv_heads;
    uint64_t fingerprint; /* rekv_engine_fingerprint of the model profiled */
    int sample_tokens;    /* the calibration sample's length */
    double *importance;   /* [n_layers][n_heads] */
    double *adjacent_cos; /* [n_layers][n_heads] */
} rekv_heads;

/* One forward pass over ids (n >= 2; -E2BIG past the context). Fills *out (rekv_heads_free). */
int rekv_heads_profile(rekv_engine *e, const int32_t *ids, int n, rekv_heads *out, rekv_err *err);
void rekv_heads_free(rekv_heads *h);

/* Eq. 7–9: theta* = acos(eta), theta = lambda theta* + (1 - lambda) pi with lambda =
 * importance^p, tau = cos(theta): eta for importance 1, -1 (always reuse) for importance 0. */
double rekv_heads_tau(double importance, double eta, double p);
/* Eq. 10 over m query heads: sum(s) / sum(s / sim), the harmonic mean of the similarities
 * weighted by importance (the least similar, most important head dominates). Importances of 0
 * weigh nothing; all 0: the plain harmonic mean. A similarity <= 0 gives -1 (a miss whatever tau
 * is, as the formula's sign would be meaningless). */
double rekv_heads_aggregate(const double *importance, const double *sim, int m);
/* Eq. 11 for KV head g of layer l: D = tau - (s_hat - epsilon), tau from the group's largest
 * importance, s_hat the group's adjacent_cos aggregated by Eq. 10. D > 0: hard to reuse. */
double rekv_heads_difficulty(const rekv_heads *h, int layer, int g, double eta, double p,
                             double epsilon);

/* Eq. 12-13 for layer l (>= 1): of the KV heads whose difficulty D (eta, p, epsilon) is > 0,
 * the max(N_d - n_p, 0) hardest are marked persist[g] = 1 (the others 0): n_p, Eq. 12's N_p, is
 * how many heads' misses a layer's compute hides behind the link. Returns how many it marked. */
int rekv_heads_persistent(const rekv_heads *h, int layer, double eta, double p, double epsilon,
                          double n_p, uint8_t *persist);

/* Eq. 12 (N_p, the count Eq. 13 takes) is the coordinator's planner's: rekv_plan_persist_np
 * (coordinator/planner.h), from the worker's measured profile; the worker builds with what the
 * coordinator assigns. */

/* The JSON file. Load checks the shape and that it was made for e's model (fingerprint). Save
 * writes a temporary file beside path and renames it into place (making the directory). */
int rekv_heads_save(const rekv_heads *h, const char *path, rekv_err *err);
int rekv_heads_load(const char *path, const rekv_engine *e, rekv_heads *out, rekv_err *err);
int rekv_heads_cache_path(const rekv_engine *e, char *path, size_t cap, rekv_err *err);
/* e's profile from the cache, else profiled on the sample rekv_skew_sample generates (never the
 * evaluated text) and cached (a cache that cannot be written is no error). */
int rekv_heads_prepare(rekv_engine *e, rekv_heads *out, int *from_cache, rekv_err *err);

#endif
