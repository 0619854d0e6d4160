/* premises.h — what InfiniGen and CLO rest on, measured on a model and a text (premises.c), so a
 * reader of `rekv eval` sees when a model is outside the papers' regime:
 *  - consecutive layers' block inputs are alike (InfiniGen §3.3: cosine 0.89–0.97 on OPT),
 *  - so a layer's query made from the layer before's attention input is close to its true one,
 *  - a head's queries at adjacent decode steps are alike (CLO's head-wise reuse),
 *  - and the speculated selection finds the tokens exact attention would rank highest: the
 *    recall of the exact top m by infinigen's selection at its own budget m.
 * Measured teacher-forced on the cpu engine (the reference; a tap on its attention), over the
 * decode steps of one window: the first `prefill` tokens go in as one step, each later one alone,
 * as `rekv eval` runs. */
#ifndef REKV_GPUWORKER_PREMISES_H
#define REKV_GPUWORKER_PREMISES_H

#include <stdint.h>

#include "common/err.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/skew.h"

typedef struct rekv_premises {
    int n_layers;
    uint64_t steps; /* decode steps measured */
    /* [n_layers] means over the decode steps (and query heads where a figure is per head); NaN
     * where undefined: layer 0 of the first three, the first step of adjacent_query_cosine */
    double *input_cos;  /* cosine of layer l's block input (the residual stream) with l-1's */
    double *spec_q_cos; /* cosine of layer l's query made from layer l-1's attention input with
                           its true query */
    double *adj_q_cos;  /* cosine of a head's query with its query at the step before */
    double *recall;     /* of the exact top m (the group's summed softmax of the true scores) by
                           infinigen's selection (rekv_ig_select on the skew's partial scores, from
                           the input `lookahead` sets: pl_ig_lookahead's rule), m its own count */
} rekv_premises;

/* Measures them over ids[0..n) (n within the model's context, n >= prefill + 2), with the skew
 * and infinigen's alpha, fetch cap and lookahead (0 or 1; layer 1 always from its own input).
 * The engine's tap is set for the run and cleared after. Free with rekv_premises_free. */
int rekv_premises_measure(rekv_engine *e, const rekv_skew *sk, const int32_t *ids, int n,
                          int prefill, float alpha, float max_fraction, int lookahead,
                          rekv_premises *out, rekv_err *err);
void rekv_premises_free(rekv_premises *p);

#endif
