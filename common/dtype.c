/* dtype.c — see dtype.h. */
#include "common/dtype.h"
#include "common/log.h"

#include <errno.h>
#include <math.h>
#include <strings.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

const char *rekv_dtype_name(rekv_dtype t)
{
    switch (t) {
    case REKV_DTYPE_F32:
        return "F32";
    case REKV_DTYPE_F16:
        return "F16";
    case REKV_DTYPE_BF16:
        return "BF16";
    case REKV_DTYPE_I8:
        return "INT8";
    case REKV_DTYPE_I4:
        return "INT4";
    }
    return "?";
}

int rekv_cache_dtype_parse(const char *s, rekv_dtype *out)
{
    static const struct {
        const char *name;
        rekv_dtype t;
    } names[] = {{"f32", REKV_DTYPE_F32},
                 {"f16", REKV_DTYPE_F16},
                 {"int8", REKV_DTYPE_I8},
                 {"int4", REKV_DTYPE_I4}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcasecmp(s, names[i].name) == 0) {
            *out = names[i].t;
            return 0;
        }
    return -EINVAL;
}

int rekv_dtype_parse(const char *s, rekv_dtype *out)
{
    if (strcmp(s, "F32") == 0)
        *out = REKV_DTYPE_F32;
    else if (strcmp(s, "F16") == 0)
        *out = REKV_DTYPE_F16;
    else if (strcmp(s, "BF16") == 0)
        *out = REKV_DTYPE_BF16;
    else
        return -EINVAL;
    return 0;
}

float rekv_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while ((man & 0x400u) == 0);
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t rekv_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return sign | 0x7e00u; /* NaN */
    if (a >= 0x477ff000u)      /* rounds to >= 65520: inf */
        return sign | 0x7c00u;
    if (a < 0x38800000u) { /* below the smallest normal: subnormal or zero */
        float af;
        memcpy(&af, &a, 4);
        /* 2^-24 is the subnormal step; nearbyint rounds half to even in the default mode */
        return sign | (uint16_t)nearbyintf(af * 16777216.0f);
    }
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xfffu + mant_odd;
    return sign | (uint16_t)(((a >> 13) - ((uint32_t)(127 - 15) << 10)) & 0x7fffu);
}

#if defined(__x86_64__)
/* f16 -> f32 eight at a time with F16C, exact like rekv_f16_to_f32; a group holding an infinity
 * or NaN goes the scalar way, so NaN payloads come out bit for bit the same too. Returns how many
 * elements it converted (a multiple of 8). */
__attribute__((target("avx2,f16c"))) static size_t f16_to_f32_avx2(float *dst, const uint16_t *s,
                                                                   size_t n)
{
    const __m128i expmask = _mm_set1_epi16(0x7c00);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, expmask), expmask)) != 0) {
            for (size_t j = i; j < i + 8; j++)
                dst[j] = rekv_f16_to_f32(s[j]);
            continue;
        }
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    return i;
}
#endif

void rekv_to_f32(float *dst, const void *src, rekv_dtype t, size_t n)
{
    switch (t) {
    case REKV_DTYPE_F32:
        memcpy(dst, src, n * 4);
        break;
    case REKV_DTYPE_F16: {
        const uint16_t *s = src;
        size_t i = 0;
#if defined(__x86_64__)
        if (n >= 8 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
            i = f16_to_f32_avx2(dst, s, n);
#endif
        for (; i < n; i++)
            dst[i] = rekv_f16_to_f32(s[i]);
        break;
    }
    case REKV_DTYPE_BF16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = rekv_bf16_to_f32(s[i]);
        break;
    }
    case REKV_DTYPE_I8:
    case REKV_DTYPE_I4: /* by rows only: rekv_kv_row_to_f32 */
        REKV_ASSERT(!"rekv_to_f32 of a quantized dtype");
    }
}

void rekv_from_f32(void *dst, const float *src, rekv_dtype t, size_t n)
{
    switch (t) {
    case REKV_DTYPE_F32:
        memcpy(dst, src, n * 4);
        break;
    case REKV_DTYPE_F16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = rekv_f32_to_f16(src[i]);
        break;
    }
    case REKV_DTYPE_BF16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = rekv_f32_to_bf16(src[i]);
        break;
    }
    case REKV_DTYPE_I8:
    case REKV_DTYPE_I4: /* by rows only: rekv_kv_row_from_f32 */
        REKV_ASSERT(!"rekv_from_f32 of a quantized dtype");
    }
}

/* ------------------------------------------------------------ quantized KV rows (dtype.h) */

/* A group's scale: f16(amax / qmax), saturated at f16's largest finite value. */
static uint16_t kvq_scale(const float *x, int n, float qmax)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float s = amax / qmax;
    return s >= 65504.0f ? (uint16_t)0x7bffu : rekv_f32_to_f16(s);
}

/* x's code at scale s in [-qmax, qmax]: rint (half to even, the default rounding mode) */
static inline int kvq_code(float x, float s, float qmax)
{
    if (s == 0.0f)
        return 0;
    float q = rintf(x / s);
    return q > qmax ? (int)qmax : q < -qmax ? -(int)qmax : (int)q;
}

void rekv_kv_row_from_f32(void *dst, const float *src, rekv_dtype t, int hd)
{
    if (!rekv_dtype_quantized(t)) {
        rekv_from_f32(dst, src, t, (size_t)hd);
        return;
    }
    int gs = rekv_kvq_group(hd), q4 = t == REKV_DTYPE_I4;
    float qmax = q4 ? 7.0f : 127.0f;
    uint8_t *codes = dst, *scales = codes + (q4 ? hd / 2 : hd);
    for (int g = 0; g < hd / gs; g++) {
        const float *x = src + (size_t)g * (size_t)gs;
        uint16_t sh = kvq_scale(x, gs, qmax);
        float s = rekv_f16_to_f32(sh);
        memcpy(scales + 2 * g, &sh, 2);
        for (int i = 0; i < gs; i++) {
            int c = kvq_code(x[i], s, qmax), e = g * gs + i;
            if (!q4)
                codes[e] = (uint8_t)(int8_t)c;
            else if (e % 2 == 0)
                codes[e / 2] = (uint8_t)(c + 8);
            else
                codes[e / 2] |= (uint8_t)((c + 8) << 4);
        }
    }
}

void rekv_kv_row_to_f32(float *dst, const void *src, rekv_dtype t, int hd)
{
    if (!rekv_dtype_quantized(t)) {
        rekv_to_f32(dst, src, t, (size_t)hd);
        return;
    }
    int gs = rekv_kvq_group(hd), q4 = t == REKV_DTYPE_I4;
    const uint8_t *codes = src, *scales = codes + (q4 ? hd / 2 : hd);
    for (int g = 0; g < hd / gs; g++) {
        uint16_t sh;
        memcpy(&sh, scales + 2 * g, 2);
        float s = rekv_f16_to_f32(sh);
        float *d = dst + (size_t)g * (size_t)gs;
        if (q4) { /* gs is even: a group's codes are whole bytes */
            const uint8_t *c = codes + (size_t)g * (size_t)gs / 2;
            for (int i = 0; i < gs / 2; i++) {
                d[2 * i] = (float)((int)(c[i] & 0xfu) - 8) * s;
                d[2 * i + 1] = (float)((int)(c[i] >> 4) - 8) * s;
            }
        } else {
            const int8_t *c = (const int8_t *)codes + (size_t)g * (size_t)gs;
            for (int i = 0; i < gs; i++)
                d[i] = (float)c[i] * s;
        }
    }
}
