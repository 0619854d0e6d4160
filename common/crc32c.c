/* crc32c.c — CRC32C (Castagnoli, reflected polynomial 0x82F63B78) for spilled blocks and journal
 * records: the SSE4.2 crc32 instruction when the CPU has it, a slicing-by-8 table otherwise. */
#include <stdint.h>
#include <string.h>

#include "common/crc32c.h"

static uint32_t g_table[8][256];
static int g_mode; /* 0: not initialised, 1: table, 2: sse4.2 */

static void crc32c_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        g_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            g_table[t][i] = (g_table[t - 1][i] >> 8) ^ g_table[0][g_table[t - 1][i] & 0xff];
#if defined(__x86_64__)
    __builtin_cpu_init();
    g_mode = __builtin_cpu_supports("sse4.2") ? 2 : 1;
#else
    g_mode = 1;
#endif
}

static uint32_t crc32c_table(uint32_t c, const uint8_t *p, size_t n)
{
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = g_table[7][w & 0xff] ^ g_table[6][(w >> 8) & 0xff] ^ g_table[5][(w >> 16) & 0xff] ^
            g_table[4][(w >> 24) & 0xff] ^ g_table[3][(w >> 32) & 0xff] ^
            g_table[2][(w >> 40) & 0xff] ^ g_table[1][(w >> 48) & 0xff] ^ g_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ g_table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__)
/* One stream of 8-byte steps: several GB/s, well above what the spill tier moves. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t c, const uint8_t *p,
                                                               size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = __builtin_ia32_crc32di(c64, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

uint32_t rekv_crc32c(uint32_t crc, const void *buf, size_t n)
{
    if (g_mode == 0)
        crc32c_init();
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (g_mode == 2)
        return ~crc32c_sse42(c, buf, n);
#endif
    return ~crc32c_table(c, buf, n);
}

/* Exposed for the test of the table path on SSE4.2 machines. */
uint32_t rekv_crc32c_sw(uint32_t crc, const void *buf, size_t n);
uint32_t rekv_crc32c_sw(uint32_t crc, const void *buf, size_t n)
{
    if (g_mode == 0)
        crc32c_init();
    return ~crc32c_table(~crc, buf, n);
}
