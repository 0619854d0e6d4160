/* planner_fixture.c — see planner_fixture.h. */
#include "coordinator/co_plan.h"
#include "coordinator/planner.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "tests/planner_fixture.h"

uint64_t tp_g_rng;

uint64_t tp_rnd(void)
{
    uint64_t z = (tp_g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double tp_urand(void)
{
    return (double)(tp_rnd() >> 11) / 9007199254740992.0;
}
int64_t tp_irand(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(tp_rnd() % (uint64_t)(hi - lo + 1));
}

double tp_logrand(double lo, double hi)
{
    return lo * pow(hi / lo, tp_urand());
}

int tp_close_rel(double x, double y, double rel)
{
    return fabs(x - y) <= rel * fmax(fabs(x), fabs(y));
}

const rekv_model_config tp_opt_6_7b = {.arch = REKV_ARCH_OPT,
                                       .act = REKV_ACT_RELU,
                                       .n_layers = 32,
                                       .hidden = 4096,
                                       .n_heads = 32,
                                       .n_kv_heads = 32,
                                       .head_dim = 128,
                                       .ffn = 16384,
                                       .dtype = REKV_DTYPE_F16};

const rekv_model_config tp_opt8_config = {.arch = REKV_ARCH_OPT,
                                          .act = REKV_ACT_RELU,
                                          .n_layers = 8,
                                          .hidden = 1024,
                                          .n_heads = 16,
                                          .n_kv_heads = 16,
                                          .head_dim = 64,
                                          .ffn = 4096,
                                          .dtype = REKV_DTYPE_F16};

void tp_shape_from_config(const rekv_model_config *cfg, int64_t b, int64_t s, double elem,
                          int weights_offloaded, rekv_step_shape *out)
{
    rekv_plan_model m;
    rekv_plan_model_from_config(cfg, &m);
    rekv_plan_shape(&m, b, s, elem, weights_offloaded, out);
}
