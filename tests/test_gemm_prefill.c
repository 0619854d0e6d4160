/* test_gemm_prefill.c — the cpu GEMM over tiled weights at many rows (a prefill, a large batch),
 * where each group of 4 weight rows is copied contiguous once per block of rows and every tile of
 * the block reads the copy (cpu_gemm.c, group_copy): the bits are those of the row-major GEMM,
 * and a row's bits do not depend on how many rows share the call, which rows they are, or the
 * thread count — the row-invariance the exact modes' recomputation and continuous batching stand
 * on. Shapes cross the 48-row blocks (the copy is made again for each), leave rows after the
 * last whole tile, and have k % 8 tails and a partial last block of weight rows; their groups of
 * 4 weight rows are over the 12 KiB from which they are copied, but for one shape under it. */
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "gpuworker/cpu_ops.h"
#include "tests/testutil.h"

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static float frand(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((g_rng >> 40) / 16777216.0) - 0.5f;
}

/* w [n][k] in dtype dt, x [m][k]; the tiled GEMM of all m rows against the row-major GEMM, then
 * each row against the tiled GEMM of that row alone, and the last 7 rows in a call of their own
 * (under the copy's row threshold: read in place) against the same rows in the whole call. */
static void check_rows(rekv_dtype dt, int m, int n, int k)
{
    size_t es = rekv_dtype_size(dt), nk = (size_t)n * k, bytes = nk * es, ys = sizeof(float) * n;
    float *wf = malloc(sizeof(float) * nk), *x = malloc(sizeof(float) * (size_t)m * k);
    float *b = malloc(ys), *y = malloc(ys * (size_t)m), *yt = malloc(ys * (size_t)m);
    float *y1 = malloc(ys * 8);
    void *w = malloc(bytes), *wt = malloc(bytes), *scratch = malloc(cpu_tile_scratch_bytes(dt, k));
    ck_assert(wf && x && b && y && yt && y1 && w && wt && scratch);
    for (size_t i = 0; i < nk; i++)
        wf[i] = frand();
    for (size_t i = 0; i < (size_t)m * k; i++)
        x[i] = frand();
    for (int i = 0; i < n; i++)
        b[i] = frand();
    if (dt == REKV_DTYPE_F32)
        memcpy(w, wf, bytes);
    else
        rekv_from_f32(w, wf, dt, nk);
    memcpy(wt, w, bytes);
    cpu_tile_pack(wt, dt, n, k, scratch);
    cpu_gemm_rowinv(y, x, w, dt, b, m, n, k);
    cpu_gemm_rowinv_tiled(yt, x, wt, dt, b, m, n, k);
    ck_assert_msg(memcmp(y, yt, ys * (size_t)m) == 0,
                  "%s m=%d n=%d k=%d: tiled weights give other bits than row-major",
                  rekv_dtype_name(dt), m, n, k);
    for (int i = 0; i < m; i++) {
        cpu_gemm_rowinv_tiled(y1, x + (size_t)i * k, wt, dt, b, 1, n, k);
        ck_assert_msg(memcmp(y1, yt + (size_t)i * n, ys) == 0,
                      "%s m=%d n=%d k=%d: row %d alone differs from the row among %d",
                      rekv_dtype_name(dt), m, n, k, i, m);
    }
    int few = m < 7 ? m : 7;
    cpu_gemm_rowinv_tiled(y1, x + (size_t)(m - few) * k, wt, dt, b, few, n, k);
    ck_assert_msg(memcmp(y1, yt + (size_t)(m - few) * n, ys * (size_t)few) == 0,
                  "%s m=%d n=%d k=%d: the last %d rows differ alone", rekv_dtype_name(dt), m, n, k,
                  few);
    free(wf), free(x), free(b), free(y), free(yt), free(y1), free(w), free(wt), free(scratch);
}

/* Row counts around the copy's threshold and the 48-row blocks, at one thread and two (the
 * pool's column chunks each copy into their own thread's buffer). */
START_TEST(prefill_rows_same_bits)
{
    static const rekv_dtype dts[] = {REKV_DTYPE_F16, REKV_DTYPE_BF16, REKV_DTYPE_F32};
    static const int ms[] = {8, 9, 16, 47, 48, 49, 100, 146};
    int prev = cpu_gemm_set_threads(1);
    for (int threads = 1; threads <= 2; threads++) {
        cpu_gemm_set_threads(threads);
        for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++)
            /* a partial block, a k % 8 tail; groups of 4 x 1544 x 2 and 4 x 776 x 4 bytes */
            check_rows(dts[i % 3], ms[i], 203, dts[i % 3] == REKV_DTYPE_F32 ? 781 : 1549);
        check_rows(REKV_DTYPE_F16, 130, 1024, 2053); /* the pool splits the columns */
        check_rows(REKV_DTYPE_BF16, 52, 96, 8);      /* k a single chunk, no tail: no copy */
    }
    cpu_gemm_set_threads(prev);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("gemm_prefill");
    TCase *tc = tcase_create("rows");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, prefill_rows_same_bits);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
