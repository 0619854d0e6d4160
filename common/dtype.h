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
} rekv_dtype;

static inline size_t rekv_dtype_size(rekv_dtype t) { return t == REKV_DTYPE_F32 ? 4 : 2; }

/* "F32", "F16", "BF16" (safetensors spelling). */
const char *rekv_dtype_name(rekv_dtype t);
/* Parses the safetensors spelling; returns 0 or -EINVAL. */
int rekv_dtype_parse(const char *s, rekv_dtype *out);

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
