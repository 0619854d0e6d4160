/* mode_stream.c — the streaming exact modes' entries in the pipeline's mode table: offload, kvpr,
 * act and hybrid are one algorithm — every context token of every layer comes whole, as K,V rows
 * fetched from the kvstore or as activation rows recomputed into K,V (pipeline_kvstore.c,
 * pl_unit_plan_whole) — with different parameters: what the store keeps (common/mode.c: KV, ACT,
 * a KV:ACT pattern, activations beside K,V) and so which rows a layer recomputes. */
#include <errno.h>

#include "gpuworker/pipeline_internal.h"

static int dev_part(const rekv_pseq *s, int ctx)
{
    return pl_dev_part(s, ctx);
}

/* act: every context token past the device part */
static size_t act_recompute_rows(const rekv_pipeline *p, const step *st, int it)
{
    (void)p;
    const rekv_pseq *s = st->items[it].seq;
    return (size_t)(s->len - dev_part(s, s->len));
}

/* kvpr: [device part, split) */
static size_t kvpr_recompute_rows(const rekv_pipeline *p, const step *st, int it)
{
    (void)p;
    const rekv_pseq *s = st->items[it].seq;
    int ctx = s->len, dev = dev_part(s, ctx);
    int l = st->split[it] < ctx ? st->split[it] : ctx;
    return l > dev ? (size_t)(l - dev) : 0;
}

/* hybrid: the tokens of [device part, ctx) in ACT blocks, as the store typed them */
static size_t hybrid_recompute_rows(const rekv_pipeline *p, const step *st, int it)
{
    (void)p;
    const rekv_pseq *s = st->items[it].seq;
    int ctx = s->len, dev = dev_part(s, ctx);
    uint64_t nk = 0, na = 0;
    size_t rows = 0;
    for (int b0 = 0; b0 < ctx; b0 += REKV_KV_BLOCK_TOKENS) {
        if (rekv_kv_next_block_type(nk, na, (uint32_t)s->kv_parts, (uint32_t)s->act_parts) ==
            REKV_KV_BLOCK_KV) {
            nk++;
            continue;
        }
        na++;
        int lo = b0 > dev ? b0 : dev,
            hi = b0 + REKV_KV_BLOCK_TOKENS < ctx ? b0 + REKV_KV_BLOCK_TOKENS : ctx;
        rows += hi > lo ? (size_t)(hi - lo) : 0;
    }
    return rows;
}

static int kvpr_check(const rekv_pipeline_config *cfg, rekv_err *err)
{
    if (cfg->split < 0)
        return rekv_errf(err, -EINVAL, "pipeline: kvpr needs a split >= 0");
    return 0;
}

static int hybrid_check(const rekv_pipeline_config *cfg, rekv_err *err)
{
    if (cfg->kv_parts < 0 || cfg->act_parts < 0 || cfg->kv_parts + cfg->act_parts == 0)
        return rekv_errf(err, -EINVAL, "pipeline: hybrid needs a kv:act pattern like 1:1");
    return 0;
}

const pl_mode_ops pl_mode_offload = {
    .mode = REKV_MODE_OFFLOAD,
    .unit_plan = pl_unit_plan_whole,
};

const pl_mode_ops pl_mode_kvpr = {
    .mode = REKV_MODE_KVPR,
    .check = kvpr_check,
    .recompute_rows = kvpr_recompute_rows,
    .unit_plan = pl_unit_plan_whole,
};

const pl_mode_ops pl_mode_act = {
    .mode = REKV_MODE_ACT,
    .recompute_rows = act_recompute_rows,
    .unit_plan = pl_unit_plan_whole,
};

const pl_mode_ops pl_mode_hybrid = {
    .mode = REKV_MODE_HYBRID,
    .check = hybrid_check,
    .recompute_rows = hybrid_recompute_rows,
    .unit_plan = pl_unit_plan_whole,
};
