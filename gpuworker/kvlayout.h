/* kvlayout.h — how K and V rows lie in every KV buffer of rekv: the kvstore's KV blocks, the
 * device's attention buffers and resident caches, and the reference engine's cache. A buffer is a
 * run of blocks of REKV_KV_ROWS_PER_BLOCK positions; each block holds K then V, each laid out
 * [n_kv][REKV_KV_ROWS_PER_BLOCK][head_dim]. One layout everywhere means a fetched block is one
 * contiguous copy from the store's arena into the device (and adjacent blocks merge into one),
 * instead of a copy per head. */
#ifndef REKV_GPUWORKER_KVLAYOUT_H
#define REKV_GPUWORKER_KVLAYOUT_H

#include <stddef.h>

#define REKV_KV_ROWS_PER_BLOCK 16

#ifdef __CUDACC__
#define REKV_KVL_FN __host__ __device__ static inline
#else
#define REKV_KVL_FN static inline
#endif

/* Element index of the K row of kv head g at position t; its V row is n_kv * 16 * head_dim
 * further on (rekv_kv_v_shift). */
REKV_KVL_FN size_t rekv_kv_row(int n_kv, int head_dim, int g, int t)
{
    return (((size_t)(t / REKV_KV_ROWS_PER_BLOCK) * 2 * (size_t)n_kv + (size_t)g) *
                REKV_KV_ROWS_PER_BLOCK +
            (size_t)(t % REKV_KV_ROWS_PER_BLOCK)) *
           (size_t)head_dim;
}

REKV_KVL_FN size_t rekv_kv_v_shift(int n_kv, int head_dim)
{
    return (size_t)n_kv * REKV_KV_ROWS_PER_BLOCK * (size_t)head_dim;
}

/* Elements of a buffer holding positions 0..tokens-1 (whole blocks). */
REKV_KVL_FN size_t rekv_kv_buffer_elems(int n_kv, int head_dim, int tokens)
{
    size_t blocks = ((size_t)tokens + REKV_KV_ROWS_PER_BLOCK - 1) / REKV_KV_ROWS_PER_BLOCK;
    return blocks * 2 * rekv_kv_v_shift(n_kv, head_dim);
}

/* Byte offset of the row at element index i (a multiple of head_dim, as rekv_kv_row gives) in a
 * buffer whose rows take row_bytes (rekv_kv_row_bytes: a quantized row holds its codes and scales,
 * so byte offsets go by rows, never by elements). */
REKV_KVL_FN size_t rekv_kv_off(size_t i, int head_dim, size_t row_bytes)
{
    return i / (size_t)head_dim * row_bytes;
}

/* Bytes of a buffer holding positions 0..tokens-1 (whole blocks) of rows of row_bytes. */
REKV_KVL_FN size_t rekv_kv_buffer_bytes(int n_kv, int head_dim, int tokens, size_t row_bytes)
{
    return rekv_kv_off(rekv_kv_buffer_elems(n_kv, head_dim, tokens), head_dim, row_bytes);
}

#endif
