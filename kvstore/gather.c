/* gather.c — copying scattered arena blocks into one contiguous buffer (the worker's staging
 * buffer). Large gathers use non-temporal stores, as glibc's memcpy does for large copies, so that
 * the destination does not pass through the cache on its way to DMA; small ones use memcpy. */
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "kvstore/kvstore.h"

#define NT_MIN_TOTAL (4u << 20) /* below this the destination stays cache-resident: memcpy */

void rekv_kv_gather(void *dst, const void *arena, const uint64_t *offsets, size_t n, size_t bytes)
{
    uint8_t *d = dst;
    const uint8_t *a = arena;
#if defined(__x86_64__)
    if (n * bytes >= NT_MIN_TOTAL && bytes % 64 == 0 && ((uintptr_t)d & 15) == 0) {
        for (size_t i = 0; i < n; i++) {
            const uint8_t *s = a + offsets[i];
            if (((uintptr_t)s & 15) != 0) {
                memcpy(d + i * bytes, s, bytes);
                continue;
            }
            __m128i *o = (__m128i *)(d + i * bytes);
            const __m128i *p = (const __m128i *)s;
            for (size_t k = 0; k < bytes / 16; k += 4) {
                __m128i x0 = _mm_load_si128(p + k), x1 = _mm_load_si128(p + k + 1);
                __m128i x2 = _mm_load_si128(p + k + 2), x3 = _mm_load_si128(p + k + 3);
                _mm_stream_si128(o + k, x0);
                _mm_stream_si128(o + k + 1, x1);
                _mm_stream_si128(o + k + 2, x2);
                _mm_stream_si128(o + k + 3, x3);
            }
        }
        _mm_sfence();
        return;
    }
#endif
    for (size_t i = 0; i < n; i++)
        memcpy(d + i * bytes, a + offsets[i], bytes);
}
