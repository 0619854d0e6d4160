/* test_qdecode.c — the GGUF block decoders that host and device share (loader/gguf_block.h; the
 * cuda kernels dequantize the GEMM's weights and the embedding's rows with them, issue 43), on the
 * cpu, where no GPU is needed:
 * - every quantized tensor of ../shared/gguf decoded a weight at a time (rekv_qb_at, what each
 *   device thread computes) gives the bits of the cpu GEMM's own tile decoding
 *   (cpu_qgemm_dequant_rows: AVX2) and of the reference (rekv_gguf_dequant, block at a time), and
 *   llama.cpp's checksums (first 8 values exact, sum and sum of squares: ggml's to_float);
 * - blocks built here from chosen scales, mins and codes — the extremes of each field (f16 scales
 *   at ±65504, subnormal, ±0, Q4_K's 6-bit scales and mins at 0 and 63 in both halves of their
 *   packing, Q6_K's int8 scales at -128 and 127, codes at both ends) and random ones — decode to
 *   the values ggml's formulas give on those fields (packed by this file's own encoder, written
 *   from ggml's block layouts), by all three decoders;
 * - blocks of random bytes decode alike by all three; the f16 widening is rekv_f16_to_f32's for
 *   every one of the 65536 values. */
#define _GNU_SOURCE
#include "common/dtype.h"
#include "gpuworker/cpu_qgemm.h"
#include "loader/gguf.h"
#include "loader/gguf_block.h"
#include "tests/gguf_edit.h"
#include "tests/testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const k_files[] = {"llama-tiny-py-Q8_0", "llama-tiny-py-Q4_0",
                                      "synth-llama-Q8_0", "synth-llama-Q4_K_M", "synth-llama-Q4_0"};
#define N_FILES (sizeof(k_files) / sizeof(k_files[0]))
static const uint32_t k_types[] = {REKV_GGML_Q8_0, REKV_GGML_Q4_0, REKV_GGML_Q4_K, REKV_GGML_Q6_K};
#define N_TYPES (sizeof(k_types) / sizeof(k_types[0]))

static uint32_t g_rng = 12345u;
static uint32_t rnd(void)
{
    g_rng = g_rng * 1664525u + 1013904223u;
    return g_rng >> 8;
}

/* n weights of type at w ([rows][k], whole blocks) decoded by each decoder and compared bit for
 * bit; out (may be NULL) gets rekv_qb_at's values. */
static void check_decoders(uint32_t type, const uint8_t *w, int rows, int k, float *out,
                           const char *what)
{
    size_t rb = cpu_qgemm_row_bytes(type, k), n = (size_t)rows * (size_t)k;
    float *at = malloc(n * sizeof(float)), *tile = malloc(n * sizeof(float));
    float *ref = malloc(n * sizeof(float));
    ck_assert(at && tile && ref);
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < k; i++)
            at[(size_t)r * k + i] = rekv_qb_at(type, w + r * rb, i);
        if (rekv_ggml_dequant_row(type, w + r * rb, (uint64_t)k, ref + (size_t)r * k) != 0)
            ck_abort_msg("%s (%s): row %d not decoded", what, rekv_ggml_type_name(type), r);
    }
    cpu_qgemm_dequant_rows(type, w, rb, rows, k, tile);
    /* plain ifs: a Check assertion per weight costs a system call */
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&at[i], &ref[i], 4) != 0)
            ck_abort_msg("%s (%s) [%zu]: weight at a time %.9g, by blocks %.9g", what,
                         rekv_ggml_type_name(type), i, at[i], ref[i]);
        if (memcmp(&at[i], &tile[i], 4) != 0)
            ck_abort_msg("%s (%s) [%zu]: weight at a time %.9g, the cpu GEMM's tile %.9g", what,
                         rekv_ggml_type_name(type), i, at[i], tile[i]);
    }
    if (out)
        memcpy(out, at, n * sizeof(float));
    free(at), free(tile), free(ref);
}

/* ---------------------------------------------------------------- the shared files */

START_TEST(shared_tensors)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "gguf/%s.gguf", k_files[_i]);
    const char *path = tu_shared(rel);
    snprintf(rel, sizeof(rel), "gguf/%s.ref.json", k_files[_i]);
    const char *rpath = tu_shared(rel);
    if (path == NULL || rpath == NULL)
        return;
    rekv_gguf *g;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(path, &g, &err) == 0, "%s", err.msg);
    json_error_t je;
    json_t *ref = json_load_file(rpath, 0, &je);
    ck_assert_msg(ref != NULL, "%s: %s", rpath, je.text);
    json_t *tensors = json_object_get(ref, "tensors");
    int types_seen = 0;
    for (size_t ti = 0; ti < g->n_tensors; ti++) {
        const rekv_gguf_tensor *t = &g->tensors[ti];
        uint32_t be, bb;
        if (!rekv_qb_geometry(t->type, &be, &bb))
            continue;
        types_seen |= 1 << t->type % 16;
        int k = (int)t->ne[0], rows = (int)(t->numel / t->ne[0]);
        float *y = malloc(t->numel * sizeof(float));
        ck_assert_ptr_nonnull(y);
        check_decoders(t->type, t->data, rows, k, y, t->name);
        json_t *r = json_object_get(tensors, t->name);
        tg_check_llama_checksums(k_files[_i], t->name, t->type, r, y, t->numel);
        free(y);
    }
    ck_assert_msg(types_seen != 0, "%s: no quantized tensor", k_files[_i]);
    json_decref(ref);
    rekv_gguf_close(g);
}
END_TEST

/* ---------------------------------------------------------------- blocks built here */

/* One block's fields, as ggml's formulas take them; the encoders below pack them. */
typedef struct qfields {
    uint16_t d, dmin;  /* f16 */
    int sc[16], mn[8]; /* Q4_K: 8 six-bit scales and mins; Q6_K: 16 int8 scales */
    int q[256];        /* codes: Q8_0 int8, Q4_0 0..15, Q4_K 0..15, Q6_K 0..63 */
} qfields;

static void put16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, 2);
}

/* ggml's block layouts (block_q8_0, block_q4_0, block_q4_K, block_q6_K), written from the format,
 * not from the decoders. */
static void encode(uint32_t type, const qfields *f, uint8_t *b)
{
    switch (type) {
    case REKV_GGML_Q8_0:
        put16(b, f->d);
        for (int i = 0; i < 32; i++)
            b[2 + i] = (uint8_t)(int8_t)f->q[i];
        break;
    case REKV_GGML_Q4_0:
        put16(b, f->d);
        for (int i = 0; i < 16; i++)
            b[2 + i] = (uint8_t)(f->q[i] | f->q[i + 16] << 4);
        break;
    case REKV_GGML_Q4_K:
        put16(b, f->d);
        put16(b + 2, f->dmin);
        for (int j = 0; j < 4; j++) { /* ggml's quantize_row_q4_K packing */
            b[4 + j] = (uint8_t)((f->sc[j] & 63) | (f->sc[j + 4] >> 4) << 6);
            b[4 + j + 4] = (uint8_t)((f->mn[j] & 63) | (f->mn[j + 4] >> 4) << 6);
            b[4 + j + 8] = (uint8_t)((f->sc[j + 4] & 15) | (f->mn[j + 4] & 15) << 4);
        }
        for (int c = 0; c < 4; c++) /* 32 bytes: sub-block 2c low nibbles, 2c + 1 high */
            for (int l = 0; l < 32; l++)
                b[16 + 32 * c + l] = (uint8_t)(f->q[64 * c + l] | f->q[64 * c + 32 + l] << 4);
        break;
    case REKV_GGML_Q6_K:
        memset(b, 0, 210);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const int *q = f->q + 128 * h;
                uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                ql[l] = (uint8_t)((q[l] & 15) | (q[l + 64] & 15) << 4);
                ql[l + 32] = (uint8_t)((q[l + 32] & 15) | (q[l + 96] & 15) << 4);
                qh[l] = (uint8_t)((q[l] >> 4) | (q[l + 32] >> 4) << 2 | (q[l + 64] >> 4) << 4 |
                                  (q[l + 96] >> 4) << 6);
            }
        for (int s = 0; s < 16; s++)
            b[192 + s] = (uint8_t)(int8_t)f->sc[s];
        put16(b + 208, f->d);
        break;
    }
}

/* Weight i of the block f describes, by ggml's formulas in float (each product rounded). */
static float expect(uint32_t type, const qfields *f, int i)
{
    float d = rekv_f16_to_f32(f->d), dmin = rekv_f16_to_f32(f->dmin);
    switch (type) {
    case REKV_GGML_Q8_0:
        return (float)f->q[i] * d;
    case REKV_GGML_Q4_0:
        return (float)(f->q[i] - 8) * d;
    case REKV_GGML_Q4_K: {
        float d1 = d * (float)f->sc[i / 32], m1 = dmin * (float)f->mn[i / 32];
        float p = d1 * (float)f->q[i];
        return p - m1;
    }
    default: {
        float ds = d * (float)f->sc[i / 16];
        return ds * (float)(f->q[i] - 32);
    }
    }
}

/* Random fields of type; ext: push each field to one of its ends instead. */
static void fields(uint32_t type, qfields *f, int ext)
{
    static const uint16_t f16s[] = {0x7bff, 0xfbff, 0x0001, 0x8001, 0x0000, 0x8000, 0x3c00, 0x0400};
    f->d = ext ? f16s[rnd() % 8] : (uint16_t)(0x2000 + rnd() % 0x1800 + (rnd() & 1) * 0x8000);
    f->dmin = ext ? f16s[rnd() % 8] : (uint16_t)(0x2000 + rnd() % 0x1800 + (rnd() & 1) * 0x8000);
    int lo = 0, hi = 0;
    switch (type) {
    case REKV_GGML_Q8_0:
        lo = -128, hi = 127;
        break;
    case REKV_GGML_Q4_0:
    case REKV_GGML_Q4_K:
        lo = 0, hi = 15;
        break;
    default:
        lo = 0, hi = 63;
        break;
    }
    for (int i = 0; i < 256; i++)
        f->q[i] = ext ? (rnd() & 1 ? hi : lo) : lo + (int)(rnd() % (uint32_t)(hi - lo + 1));
    for (int j = 0; j < 16; j++) {
        if (type == REKV_GGML_Q6_K)
            f->sc[j] = ext ? (rnd() & 1 ? 127 : -128) : (int)(rnd() % 256) - 128;
        else
            f->sc[j] = ext ? (rnd() & 1 ? 63 : 0) : (int)(rnd() % 64);
    }
    for (int j = 0; j < 8; j++)
        f->mn[j] = ext ? (rnd() & 1 ? 63 : 0) : (int)(rnd() % 64);
}

enum { N_BLOCKS = 64 };

START_TEST(built_blocks)
{
    uint32_t type = k_types[_i], be, bb;
    ck_assert(rekv_qb_geometry(type, &be, &bb));
    uint8_t *w = malloc((size_t)N_BLOCKS * bb);
    qfields *f = malloc(sizeof(qfields) * N_BLOCKS);
    float *y = malloc(sizeof(float) * N_BLOCKS * be);
    ck_assert(w && f && y);
    for (int rep = 0; rep < 2; rep++) { /* random fields, then their extremes */
        for (int b = 0; b < N_BLOCKS; b++) {
            fields(type, &f[b], rep);
            encode(type, &f[b], w + (size_t)b * bb);
        }
        /* rows of 4 blocks: the row decoders step across block boundaries */
        check_decoders(type, w, N_BLOCKS / 4, 4 * (int)be, y, rep ? "extremes" : "random fields");
        for (int b = 0; b < N_BLOCKS; b++)
            for (uint32_t i = 0; i < be; i++) {
                float want = expect(type, &f[b], (int)i), got = y[(size_t)b * be + i];
                if (memcmp(&got, &want, 4) != 0)
                    ck_abort_msg("%s, %s block %d weight %u: decoded %.9g, ggml's formula %.9g",
                                 rep ? "extremes" : "random fields", rekv_ggml_type_name(type), b,
                                 i, got, want);
            }
    }
    /* blocks of random bytes (finite f16 scales: an inf or NaN scale makes NaN weights whose
     * payload the decoders need not agree on) */
    for (size_t i = 0; i < (size_t)N_BLOCKS * bb; i++)
        w[i] = (uint8_t)rnd();
    for (int b = 0; b < N_BLOCKS; b++) {
        uint8_t *p = w + (size_t)b * bb;
        uint8_t *d_hi = type == REKV_GGML_Q6_K ? p + 209 : p + 1;
        *d_hi &= 0xbb; /* exponent < 31 */
        if (type == REKV_GGML_Q4_K)
            p[3] &= 0xbb;
    }
    check_decoders(type, w, N_BLOCKS / 4, 4 * (int)be, NULL, "random bytes");
    free(w), free(f), free(y);
}
END_TEST

START_TEST(f16_widening)
{
    for (uint32_t h = 0; h < 65536; h++) {
        uint8_t p[2];
        put16(p, (uint16_t)h);
        float a = rekv_qb_f16(p), b = rekv_f16_to_f32((uint16_t)h);
        if (memcmp(&a, &b, 4) != 0)
            ck_abort_msg("f16 0x%04x: %.9g, rekv_f16_to_f32 %.9g", h, a, b);
    }
}
END_TEST

static Suite *qdecode_suite(void)
{
    Suite *s = suite_create("qdecode");
    TCase *tc = tcase_create("shared");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, shared_tensors, 0, N_FILES);
    suite_add_tcase(s, tc);
    tc = tcase_create("built");
    tcase_add_loop_test(tc, built_blocks, 0, N_TYPES);
    tcase_add_test(tc, f16_widening);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(qdecode_suite());
}
