/* cli_profile.h — `rekv profile`, and the planner decisions that the CLI derives from a profile
 * (shared by `rekv profile`'s report and cli_session_choose, so both say the same). */
#ifndef REKV_COORDINATOR_CLI_PROFILE_H
#define REKV_COORDINATOR_CLI_PROFILE_H

#include "coordinator/planner.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/profile.h"

/* rekv profile --model PATH [--link-gbps G] [--link-latency-us U] [--reprofile] [--json] */
int cli_profile(int argc, char **argv);

/* KVPR's split (rekv_plan_kvpr_choose) for a decode step of `batch` sequences of `ctx` tokens with
 * a host cache of cache_dtype, the layer's weights offloaded or not. */
int cli_plan_kvpr(const rekv_profile *pf, const rekv_model_config *c, rekv_dtype cache_dtype,
                  int offload_weights, int batch, int ctx, rekv_kvpr_split *out, rekv_err *err);

/* The split the planner gives cfg's mode for a decode step of `batch` sequences of `ctx` tokens,
 * with prof (rekv_profile_to_cost of the profile, corrected or not): kvpr's device part plus
 * rekv_plan_kvpr_choose's l over the rest; infinigen's layer 0 split at the fetched fraction f.
 * cli_session_choose takes it from the profile as measured; `rekv bench decode` again before
 * each decode step from the profile as the run's steps corrected it, as a served worker's
 * planner does. -EINVAL for a mode without a split. */
int cli_plan_split(const rekv_cost_profile *prof, const rekv_model_config *c,
                   const rekv_pipeline_config *cfg, int batch, int ctx, double f, int *split,
                   rekv_err *err);

/* Hybrid's pattern for a decode step of `batch` sequences of `ctx` tokens, the first
 * device_tokens of each kept on the device: rekv_plan_hybrid_pattern, the fastest pattern by the
 * step model. */
int cli_plan_hybrid(const rekv_profile *pf, const rekv_model_config *c, rekv_dtype cache_dtype,
                    int offload_weights, int batch, int ctx, int device_tokens, int *kv_parts,
                    int *act_parts, rekv_err *err);

/* HybridServe's Algorithm 1 as published, over the host memory that the batch's context takes as
 * all-KV (plus the weights when they are offloaded, which also sets T_load_w): `rekv profile`
 * prints its pattern beside the planner's. */
int cli_plan_alg1(const rekv_profile *pf, const rekv_model_config *c, rekv_dtype cache_dtype,
                  int offload_weights, int batch, int ctx, rekv_hybrid_alloc *out, rekv_err *err);

/* What the planner predicts a decode step of cfg's pipeline takes, for `batch` sequences of `ctx`
 * tokens, with prof (the profile for cfg's cache dtype, rekv_profile_to_cost, corrected or not):
 * rekv_plan_step_cost of cfg's technique at its split / ratio (and, for infinigen and clo, at the
 * fetched fraction f), times the layers, in out's t_pcie, t_compute and t_step; resident is the
 * compute alone. `rekv bench decode` prints it beside the measured step. */
int cli_plan_predict_step(const rekv_cost_profile *prof, const rekv_model_config *c,
                          const rekv_pipeline_config *cfg, int batch, int ctx, double f,
                          rekv_step_cost *out, rekv_err *err);

#endif
