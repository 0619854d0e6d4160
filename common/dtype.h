/* dtype.h — element types of tensors, caches and files, and conversion to and from fp32. */
#ifndef REKV_COMMON_DTYPE_H
#define REKV_COMMON_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum rekv_dtype {
    REKV_DTYPE_F32 = 0,
    REKV_DTYPE_F16 = 1,
    REKV_DTYPE_BF16 = 2,
    /* KV cache only (--cache-dtype int8|int4): rows quantized group-wise, see rekv_kv_row_bytes */
    REKV_DTYPE_I8 = 3,
    REKV_DTYPE_I4 = 4,
} rekv_dtype;

/* Bytes of one element; 0 for the quantized cache dtypes, which have no whole bytes per element
 * (their sizes are rekv_kv_row_bytes'). */
static inline size_t rekv_dtype_size(rekv_dtype t)
{
    return t == REKV_DTYPE_F32 ? 4 : t == REKV_DTYPE_F16 || t == REKV_DTYPE_BF16 ? 2 : 0;
}

static inline int rekv_dtype_quantized(rekv_dtype t)
{
    return t == REKV_DTYPE_I8 || t == REKV_DTYPE_I4;
}

/* "F32", "F16", "BF16" (safetensors spelling), "INT8", "INT4". */
const char *rekv_dtype_name(rekv_dtype t);
/* Parses the safetensors spelling; returns 0 or -EINVAL. */
int rekv_dtype_parse(const char *s, rekv_dtype *out);
/* Parses a --cache-dtype value: f32, f16, int8 or int4 (either case); returns 0 or -EINVAL. */
int rekv_cache_dtype_parse(const char *s, rekv_dtype *out);

/* The KV cache's rows. A row is the hd elements of one K or V head at one position; rows are the
 * unit every KV buffer is cut in (gpuworker/kvlayout.h), so a buffer's byte offsets are row index
 * times rekv_kv_row_bytes. f32/f16: the elements. int8/int4 (quantized when a row is made):
 * group-wise over the row, REKV_KVQ_GROUP elements a group (the whole row when hd is not a
 * multiple), each group's codes and then its f16 scales, all inside the row:
 *   int8: codes c = clamp(rint(x / s), -127, 127) as int8, s = f16(max|x| / 127), x' = c * s
 *   int4: codes c = clamp(rint(x / s), -7, 7) + 8 as nibbles (element 2i low, 2i+1 high),
 *         s = f16(max|x| / 7), x' = (c - 8) * s
 * rint rounds half to even; f16() rounds to nearest even and saturates at 65504 (so |x| past
 * 127 * 65504 for int8, 7 * 65504 for int4, clips); a group of zeros has s = 0 and codes 0; every
 * product and quotient is one fp32 operation (tests/kv_quant_ref.py is the same in numpy).
 * Groups of 32 with symmetric codes, by `rekv eval` on docs8L (head dim 32; the three samples'
 * mean NLL against the f32 cache): int4 +1.4% at 32 (18 bytes a row, 0.28x f16's), +0.55% at 16
 * and +0.36% at 8 (0.31x, 0.38x), +1.1% with a zero point at 32 (0.31x); int8 +0.02%. 32 is the
 * finest group that keeps int4 within 0.3x f16's bytes. Per-channel K (KIVI) groups across
 * positions: a row could neither be quantized when it is made nor stand alone in the layout. */
#define REKV_KVQ_GROUP 32
/* Elements per quantization group of a row of hd elements: 32, or hd where 32 does not divide it.
 */
static inline int rekv_kvq_group(int hd)
{
    return hd % REKV_KVQ_GROUP == 0 ? REKV_KVQ_GROUP : hd;
}
/* Bytes of one row of hd elements in cache dtype t (hd even for int4). */
static inline size_t rekv_kv_row_bytes(rekv_dtype t, int hd)
{
    size_t n = (size_t)hd, groups = n / (size_t)rekv_kvq_group(hd);
    return t == REKV_DTYPE_I8   ? n + 2 * groups
           : t == REKV_DTYPE_I4 ? n / 2 + 2 * groups
                                : n * rekv_dtype_size(t);
}
/* Bytes of n elements of a KV buffer of rows of hd elements (n a multiple of hd). */
static inline size_t rekv_kv_bytes(rekv_dtype t, int hd, size_t n)
{
    return n / (size_t)hd * rekv_kv_row_bytes(t, hd);
}
/* Bytes per K or V element in cache dtype t with rows of hd, scales included (what the link and the
 * arena carry per element: the planner's price; 4, 2, 1.0625 int8 and 0.5625 int4 at hd 32). */
static inline double rekv_kv_elem_bytes(rekv_dtype t, int hd)
{
    return (double)rekv_kv_row_bytes(t, hd) / (double)hd;
}
/* The dtype activation (ACT) blocks are kept in beside a cache of dtype t: t, or f32 for the
 * quantized caches. Activations feed GEMMs, so they are never quantized; and kept in fp32, the
 * K,V that kvpr, act and hybrid recompute from them are resident's bit for bit, so their codes
 * are too (16-bit activations would move a few codes by one, as an f16 cache moves logits). */
static inline rekv_dtype rekv_act_dtype(rekv_dtype t)
{
    return rekv_dtype_quantized(t) ? REKV_DTYPE_F32 : t;
}
/* One row of hd fp32 elements into cache dtype t at dst (rekv_kv_row_bytes bytes), and back. */
void rekv_kv_row_from_f32(void *dst, const float *src, rekv_dtype t, int hd);
void rekv_kv_row_to_f32(float *dst, const void *src, rekv_dtype t, int hd);

static inline float rekv_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t rekv_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float rekv_f16_to_f32(uint16_t h);
uint16_t rekv_f32_to_f16(float f); /* round to nearest even, overflow to inf */

/* Converts n elements of type t at src into fp32 at dst. */
void rekv_to_f32(float *dst, const void *src, rekv_dtype t, size_t n);
/* Converts n fp32 elements into type t at dst. */
void rekv_from_f32(void *dst, const float *src, rekv_dtype t, size_t n);

#endif
