/* planner_fixture.h — the planner suites' shared parts (test_planner_*.c): a deterministic
 * random stream (splitmix64, so a failing case can be replayed), a relative comparison, and the
 * model shapes (OPT-6.7B, an 8-layer OPT) the cases plan for. */
#ifndef REKV_TESTS_PLANNER_FIXTURE_H
#define REKV_TESTS_PLANNER_FIXTURE_H

#include <stdint.h>
#include "coordinator/co_plan.h"
#include "coordinator/planner.h"

/* splitmix64: deterministic across platforms, so a failing case can be replayed. */
extern uint64_t tp_g_rng;

uint64_t tp_rnd(void);

/* [0, 1) */
double tp_urand(void);

/* [lo, hi] */
int64_t tp_irand(int64_t lo, int64_t hi);

double tp_logrand(double lo, double hi);

int tp_close_rel(double x, double y, double rel);

/* OPT-6.7B's shape, the papers' model */
extern const rekv_model_config tp_opt_6_7b;

/* The synthetic OPT the benches run (8 layers, hidden 1024, fp16). */
extern const rekv_model_config tp_opt8_config;

/* A step shape for one layer of a config (rekv_plan_model_from_config, rekv_plan_shape). */
void tp_shape_from_config(const rekv_model_config *cfg, int64_t b, int64_t s, double elem,
                          int weights_offloaded, rekv_step_shape *out);

#endif
