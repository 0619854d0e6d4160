/* geometry.c — block sizes and in-block offsets of the KV and ACT blocks (DESIGN.md, Blocks). A KV
 * block's bytes are its rows' real size (rekv_kv_row_bytes: an int8/int4 row holds its codes and
 * scales); ACT blocks are in rekv_act_dtype (16-bit beside a quantized cache). */
#include <errno.h>

#include "kvstore/kvstore.h"

int rekv_kv_geometry_init(rekv_kv_geometry *g, uint32_t n_layers, uint32_t n_kv_heads,
                          uint32_t head_dim, uint32_t hidden, rekv_dtype cache_dtype,
                          rekv_err *err)
{
    if (n_layers == 0 || n_kv_heads == 0 || head_dim == 0 || hidden == 0)
        return rekv_errf(err, -EINVAL,
                         "kvstore geometry: layers %u, kv heads %u, head dim %u, hidden %u must "
                         "all be positive",
                         n_layers, n_kv_heads, head_dim, hidden);
    if (n_layers > 4096 || n_kv_heads > 4096 || head_dim > 4096 || hidden > 1u << 20)
        return rekv_errf(err, -EINVAL, "kvstore geometry: sizes out of range");
    if (cache_dtype != REKV_DTYPE_F16 && cache_dtype != REKV_DTYPE_F32 &&
        !rekv_dtype_quantized(cache_dtype))
        return rekv_errf(err, -EINVAL,
                         "kvstore geometry: cache dtype must be f16, f32, int8 or int4");
    if (cache_dtype == REKV_DTYPE_I4 && head_dim % 2 != 0)
        return rekv_errf(err, -EINVAL,
                         "kvstore geometry: an int4 cache needs an even head dim, "
                         "not %u",
                         head_dim);
    g->n_layers = n_layers;
    g->n_kv_heads = n_kv_heads;
    g->head_dim = head_dim;
    g->hidden = hidden;
    g->dtype = cache_dtype;
    g->block_tokens = REKV_KV_BLOCK_TOKENS;
    return 0;
}

int rekv_kv_geometry_from_config(const rekv_model_config *cfg, rekv_dtype cache_dtype,
                                 rekv_kv_geometry *g, rekv_err *err)
{
    if (cfg->n_layers <= 0 || cfg->n_kv_heads <= 0 || cfg->head_dim <= 0 || cfg->hidden <= 0)
        return rekv_errf(err, -EINVAL, "kvstore geometry: model config has non-positive sizes");
    return rekv_kv_geometry_init(g, (uint32_t)cfg->n_layers, (uint32_t)cfg->n_kv_heads,
                                 (uint32_t)cfg->head_dim, (uint32_t)cfg->hidden, cache_dtype, err);
}

size_t rekv_kv_block_bytes(const rekv_kv_geometry *g)
{
    return 2 * (size_t)g->n_kv_heads * g->block_tokens *
           rekv_kv_row_bytes(g->dtype, (int)g->head_dim);
}

size_t rekv_kv_act_block_bytes(const rekv_kv_geometry *g)
{
    return (size_t)g->block_tokens * g->hidden * rekv_dtype_size(rekv_act_dtype(g->dtype));
}

size_t rekv_kv_k_offset(const rekv_kv_geometry *g, uint32_t kv_head, uint32_t token)
{
    return ((size_t)kv_head * g->block_tokens + token) *
           rekv_kv_row_bytes(g->dtype, (int)g->head_dim);
}

size_t rekv_kv_v_offset(const rekv_kv_geometry *g, uint32_t kv_head, uint32_t token)
{
    return rekv_kv_block_bytes(g) / 2 + rekv_kv_k_offset(g, kv_head, token);
}

size_t rekv_kv_act_offset(const rekv_kv_geometry *g, uint32_t token)
{
    return (size_t)token * g->hidden * rekv_dtype_size(rekv_act_dtype(g->dtype));
}

rekv_kv_block_type rekv_kv_next_block_type(uint64_t n_kv, uint64_t n_act, uint32_t kv_parts,
                                           uint32_t act_parts)
{
    __int128 T = (__int128)kv_parts + act_parts;
    if (T == 0)
        return REKV_KV_BLOCK_KV;
    /* KV iff kv_parts*(n+1)/T - n_kv > 1/2: the KV count after this block is then closer to its
     * target if the block is KV */
    __int128 n1 = (__int128)n_kv + n_act + 1;
    __int128 lhs = 2 * ((__int128)kv_parts * n1 - (__int128)n_kv * T);
    return lhs > T ? REKV_KV_BLOCK_KV : REKV_KV_BLOCK_ACT;
}
