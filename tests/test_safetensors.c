/* test_safetensors.c — the safetensors reader and writer: round trips, shards, and one test per
 * validation rule, each checking that the error names the file. */
#define _GNU_SOURCE
#include "loader/loader.h"
#include "tests/testutil.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char *g_dir;

static void setup(void)
{
    g_dir = tu_tmpdir();
}
static void teardown(void)
{
    tu_rmrf(g_dir);
    free(g_dir);
    g_dir = NULL;
}

static const char *tmp_path(const char *name)
{
    static char buf[4][4096];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 4096, "%s/%s", g_dir, name);
    return p;
}

/* Writes a raw safetensors file: u64 header length, the header (padded with spaces to 8 unless
 * hlen_override >= 0, which is written as the length field instead), then ndata bytes of data. */
static const char *write_raw(const char *name, const char *header, size_t ndata,
                             long long hlen_override)
{
    const char *path = tmp_path(name);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    size_t n = strlen(header), padded = (n + 7) & ~(size_t)7;
    uint64_t len = hlen_override >= 0 ? (uint64_t)hlen_override : padded;
    uint8_t l8[8];
    for (int i = 0; i < 8; i++)
        l8[i] = (uint8_t)(len >> (8 * i));
    fwrite(l8, 1, 8, f);
    fwrite(header, 1, n, f);
    for (size_t i = n; i < padded; i++)
        fputc(' ', f);
    for (size_t i = 0; i < ndata; i++)
        fputc((int)(i * 7 & 0xff), f);
    fclose(f);
    return path;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* Opening must fail with a message that names the file and contains want. */
static void expect_fail(const char *path, const char *want)
{
    rekv_err err = {0};
    rekv_safetensors *st = (rekv_safetensors *)1;
    int rc = rekv_safetensors_open(path, &st, &err);
    ck_assert_msg(rc < 0, "%s opened, expected an error containing \"%s\"", path, want);
    ck_assert_ptr_null(st);
    ck_assert_int_eq(err.code, rc);
    /* the file at fault: path itself, or for an index, the directory's shard */
    const char *slash = strrchr(path, '/');
    int dir_len = slash ? (int)(slash - path) : (int)strlen(path);
    ck_assert_msg(strstr(err.msg, path) != NULL || strncmp(err.msg, path, (size_t)dir_len) == 0,
                  "message does not name %s: %s", path, err.msg);
    ck_assert_msg(strstr(err.msg, want) != NULL, "message lacks \"%s\": %s", want, err.msg);
    ck_assert_msg(strchr(err.msg, '\n') == NULL, "message is not one line: %s", err.msg);
}

static rekv_safetensors *open_ok(const char *path)
{
    rekv_err err = {0};
    rekv_safetensors *st = NULL;
    int rc = rekv_safetensors_open(path, &st, &err);
    ck_assert_msg(rc == 0, "open %s: %s", path, err.msg);
    ck_assert_ptr_nonnull(st);
    return st;
}

/* ---------------------------------------------------------------- round trips */

typedef struct spec_t {
    const char *name;
    rekv_dtype dt;
    int ndim;
    int64_t shape[REKV_MAX_DIMS];
} spec_t;

static const spec_t k_specs[] = {
    {"f32.matrix", REKV_DTYPE_F32, 2, {3, 5}},
    {"f32.scalar", REKV_DTYPE_F32, 0, {0}},
    {"f32.empty", REKV_DTYPE_F32, 1, {0}},
    {"f32.empty3", REKV_DTYPE_F32, 3, {4, 0, 2}},
    {"f32.odd", REKV_DTYPE_F32, 1, {7}},
    {"a.f16", REKV_DTYPE_F16, 1, {9}},
    {"b.bf16", REKV_DTYPE_BF16, 3, {2, 3, 4}},
    {"c.f16.8d", REKV_DTYPE_F16, 8, {1, 2, 1, 2, 1, 2, 1, 3}},
    {"d.bf16.empty", REKV_DTYPE_BF16, 2, {0, 5}},
};
#define N_SPECS (sizeof(k_specs) / sizeof(k_specs[0]))

static size_t spec_bytes(const spec_t *s)
{
    size_t n = rekv_dtype_size(s->dt);
    for (int i = 0; i < s->ndim; i++)
        n *= (size_t)s->shape[i];
    return n;
}

static uint8_t pattern(size_t ti, size_t i)
{
    return (uint8_t)(ti * 31 + i * 13 + 1);
}

START_TEST(test_roundtrip)
{
    const char *path = tmp_path("rt.safetensors");
    rekv_err err = {0};
    rekv_st_writer *w;
    ck_assert_int_eq(rekv_st_writer_open(path, &w, &err), 0);
    for (size_t t = 0; t < N_SPECS; t++)
        ck_assert_msg(rekv_st_writer_declare(w, k_specs[t].name, k_specs[t].dt, k_specs[t].ndim,
                                             k_specs[t].shape, &err) == 0,
                      "%s", err.msg);
    /* the whole data stream, written in pieces of odd sizes that cross tensor boundaries */
    size_t total = 0;
    for (size_t t = 0; t < N_SPECS; t++)
        total += spec_bytes(&k_specs[t]);
    uint8_t *all = malloc(total + 1);
    size_t off = 0;
    for (size_t t = 0; t < N_SPECS; t++)
        for (size_t i = 0; i < spec_bytes(&k_specs[t]); i++)
            all[off++] = pattern(t, i);
    for (size_t o = 0, step = 1; o < total; o += step, step = step * 2 + 1) {
        size_t n = total - o < step ? total - o : step;
        ck_assert_msg(rekv_st_writer_write(w, all + o, n, &err) == 0, "%s", err.msg);
    }
    ck_assert_msg(rekv_st_writer_close(w, &err) == 0, "%s", err.msg);

    /* the header is padded with spaces to a multiple of 8 */
    size_t flen;
    char *raw = tu_read_file(path, &flen);
    ck_assert_ptr_nonnull(raw);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | (uint8_t)raw[i];
    ck_assert_int_eq(hlen % 8, 0);
    ck_assert_uint_eq(flen, 8 + hlen + total);
    ck_assert_int_eq(raw[8], '{');
    ck_assert_ptr_nonnull(strstr(raw + 8, "\"__metadata__\":{\"format\":\"pt\"}"));
    free(raw);
    /* no temporary file is left behind */
    char cmd[4300];
    snprintf(cmd, sizeof(cmd), "ls '%s' | grep -c tmp", g_dir);
    char *out;
    tu_run(cmd, &out);
    ck_assert_str_eq(out, "0\n");
    free(out);

    rekv_safetensors *st = open_ok(path);
    ck_assert_uint_eq(rekv_safetensors_count(st), N_SPECS);
    for (size_t t = 0; t < N_SPECS; t++) {
        const spec_t *s = &k_specs[t];
        const rekv_tensor *x = rekv_safetensors_find(st, s->name);
        ck_assert_msg(x != NULL, "%s missing", s->name);
        ck_assert_str_eq(x->name, s->name);
        ck_assert_int_eq(x->dtype, s->dt);
        ck_assert_int_eq(x->ndim, s->ndim);
        for (int d = 0; d < s->ndim; d++)
            ck_assert_int_eq(x->shape[d], s->shape[d]);
        ck_assert_uint_eq(x->nbytes, spec_bytes(s));
        ck_assert_int_eq(rekv_tensor_numel(x) * (int64_t)rekv_dtype_size(x->dtype),
                         (int64_t)x->nbytes);
        const uint8_t *p = x->data;
        for (size_t i = 0; i < x->nbytes; i++)
            ck_assert_uint_eq(p[i], pattern(t, i));
        if (x->nbytes > 0)
            ck_assert_uint_eq((uintptr_t)x->data % rekv_dtype_size(x->dtype), 0);
    }
    /* at() enumerates every tensor once, in name order */
    for (size_t i = 1; i < rekv_safetensors_count(st); i++)
        ck_assert_int_lt(
            strcmp(rekv_safetensors_at(st, i - 1)->name, rekv_safetensors_at(st, i)->name), 0);
    ck_assert_ptr_null(rekv_safetensors_at(st, N_SPECS));
    ck_assert_ptr_null(rekv_safetensors_find(st, "nope"));
    ck_assert_ptr_null(rekv_safetensors_find(st, ""));
    rekv_safetensors_close(st);
    free(all);

    /* a real value round trip through the conversions */
    float vals[4] = {1.5f, -2.25f, 0.0f, 65504.0f};
    int64_t four = 4;
    for (int dt = 0; dt < 3; dt++) {
        const char *p2 = tmp_path("vals.safetensors");
        uint8_t buf[16];
        rekv_from_f32(buf, vals, (rekv_dtype)dt, 4);
        ck_assert_int_eq(rekv_st_writer_open(p2, &w, &err), 0);
        ck_assert_int_eq(rekv_st_writer_declare(w, "v", (rekv_dtype)dt, 1, &four, &err), 0);
        ck_assert_int_eq(rekv_st_writer_write(w, buf, 4 * rekv_dtype_size(dt), &err), 0);
        ck_assert_int_eq(rekv_st_writer_close(w, &err), 0);
        st = open_ok(p2);
        float back[4];
        rekv_to_f32(back, rekv_safetensors_find(st, "v")->data, (rekv_dtype)dt, 4);
        ck_assert_float_eq(back[0], 1.5f);
        ck_assert_float_eq(back[1], -2.25f);
        ck_assert_float_eq(back[2], 0.0f);
        rekv_safetensors_close(st);
    }
}
END_TEST

START_TEST(test_empty_file_roundtrip)
{
    const char *path = tmp_path("empty.safetensors");
    rekv_err err = {0};
    rekv_st_writer *w;
    ck_assert_int_eq(rekv_st_writer_open(path, &w, &err), 0);
    ck_assert_int_eq(rekv_st_writer_close(w, &err), 0);
    rekv_safetensors *st = open_ok(path);
    ck_assert_uint_eq(rekv_safetensors_count(st), 0);
    ck_assert_ptr_null(rekv_safetensors_find(st, "x"));
    rekv_safetensors_close(st);
}
END_TEST

START_TEST(test_writer_errors)
{
    const char *path = tmp_path("w.safetensors");
    rekv_err err = {0};
    rekv_st_writer *w;
    int64_t sh[2] = {2, 3};
    uint8_t buf[64] = {0};

    /* too few bytes: close fails and leaves nothing behind */
    ck_assert_int_eq(rekv_st_writer_open(path, &w, &err), 0);
    ck_assert_int_eq(rekv_st_writer_declare(w, "a", REKV_DTYPE_F32, 2, sh, &err), 0);
    ck_assert_int_eq(rekv_st_writer_write(w, buf, 10, &err), 0);
    ck_assert_int_lt(rekv_st_writer_close(w, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "only 10 of the 24"));
    ck_assert_int_ne(access(path, F_OK), 0);

    /* too many bytes */
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_st_writer_open(path, &w, &err), 0);
    ck_assert_int_eq(rekv_st_writer_declare(w, "a", REKV_DTYPE_F32, 2, sh, &err), 0);
    ck_assert_int_lt(rekv_st_writer_write(w, buf, 25, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, path));
    ck_assert_int_lt(rekv_st_writer_close(w, NULL), 0);
    ck_assert_int_ne(access(path, F_OK), 0);

    /* duplicate name, declare after data, bad dims, misalignment */
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_st_writer_open(path, &w, &err), 0);
    ck_assert_int_eq(rekv_st_writer_declare(w, "a", REKV_DTYPE_F16, 1, sh, &err), 0);
    ck_assert_int_lt(rekv_st_writer_declare(w, "a", REKV_DTYPE_F16, 1, sh, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "declared twice"));
    rekv_err_clear(&err);
    int64_t neg = -1;
    ck_assert_int_lt(rekv_st_writer_declare(w, "n", REKV_DTYPE_F16, 1, &neg, &err), 0);
    rekv_err_clear(&err);
    ck_assert_int_lt(rekv_st_writer_declare(w, "m", REKV_DTYPE_F16, REKV_MAX_DIMS + 1, sh, &err),
                     0);
    int64_t three = 3;
    ck_assert_int_eq(rekv_st_writer_declare(w, "b", REKV_DTYPE_F16, 1, &three, &err), 0);
    rekv_err_clear(&err);
    /* b ends at byte 10: a 4-byte tensor would be misaligned */
    ck_assert_int_lt(rekv_st_writer_declare(w, "c", REKV_DTYPE_F32, 1, &three, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "declare wider dtypes first"));
    ck_assert_int_eq(rekv_st_writer_write(w, buf, 4, &err), 0);
    rekv_err_clear(&err);
    ck_assert_int_lt(rekv_st_writer_declare(w, "d", REKV_DTYPE_F16, 1, &three, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "after data"));
    ck_assert_int_eq(rekv_st_writer_write(w, buf, 6, &err), 0);
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_st_writer_close(w, &err), 0);
    rekv_safetensors *st = open_ok(path);
    ck_assert_uint_eq(rekv_safetensors_count(st), 2);
    rekv_safetensors_close(st);

    /* a directory that does not exist */
    rekv_err_clear(&err);
    ck_assert_int_lt(rekv_st_writer_open("/nonexistent-dir/x.safetensors", &w, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "/nonexistent-dir/x.safetensors"));
}
END_TEST

START_TEST(test_many_tensors_find)
{
    const char *path = tmp_path("many.safetensors");
    rekv_err err = {0};
    rekv_st_writer *w;
    enum { N = 5000 };
    ck_assert_int_eq(rekv_st_writer_open(path, &w, &err), 0);
    int64_t one = 1;
    char name[64];
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof(name), "model.layers.%d.w", (i * 7919) % N);
        ck_assert_int_eq(rekv_st_writer_declare(w, name, REKV_DTYPE_F32, 1, &one, &err), 0);
    }
    for (int i = 0; i < N; i++) {
        float v = (float)((i * 7919) % N);
        ck_assert_int_eq(rekv_st_writer_write(w, &v, 4, &err), 0);
    }
    ck_assert_int_eq(rekv_st_writer_close(w, &err), 0);
    rekv_safetensors *st = open_ok(path);
    ck_assert_uint_eq(rekv_safetensors_count(st), N);
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof(name), "model.layers.%d.w", i);
        const rekv_tensor *t = rekv_safetensors_find(st, name);
        ck_assert_ptr_nonnull(t);
        ck_assert_float_eq(*(const float *)t->data, (float)i);
    }
    rekv_safetensors_close(st);
}
END_TEST

/* ---------------------------------------------------------------- shards */

static void write_shard(const char *name, const char *const *tensors, int n, float base)
{
    rekv_err err = {0};
    rekv_st_writer *w;
    int64_t sh[2] = {2, 2};
    ck_assert_int_eq(rekv_st_writer_open(tmp_path(name), &w, &err), 0);
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(rekv_st_writer_declare(w, tensors[i], REKV_DTYPE_F32, 2, sh, &err), 0);
    for (int i = 0; i < n; i++) {
        float v[4] = {base + (float)i, 0, 0, 0};
        ck_assert_int_eq(rekv_st_writer_write(w, v, sizeof(v), &err), 0);
    }
    ck_assert_int_eq(rekv_st_writer_close(w, &err), 0);
}

START_TEST(test_sharded)
{
    static const char *const a[] = {"embed", "layer.0"};
    static const char *const b[] = {"layer.1", "head"};
    write_shard("model-00001-of-00002.safetensors", a, 2, 10);
    write_shard("model-00002-of-00002.safetensors", b, 2, 20);
    const char *index = tmp_path("model.safetensors.index.json");
    write_text(index, "{\"metadata\": {\"total_size\": 64}, \"weight_map\": {"
                      "\"embed\": \"model-00001-of-00002.safetensors\","
                      "\"layer.0\": \"model-00001-of-00002.safetensors\","
                      "\"layer.1\": \"model-00002-of-00002.safetensors\","
                      "\"head\": \"model-00002-of-00002.safetensors\"}}");
    /* by index path and by directory */
    for (int k = 0; k < 2; k++) {
        rekv_safetensors *st = open_ok(k == 0 ? index : g_dir);
        ck_assert_uint_eq(rekv_safetensors_count(st), 4);
        ck_assert_float_eq(*(const float *)rekv_safetensors_find(st, "embed")->data, 10);
        ck_assert_float_eq(*(const float *)rekv_safetensors_find(st, "layer.0")->data, 11);
        ck_assert_float_eq(*(const float *)rekv_safetensors_find(st, "layer.1")->data, 20);
        ck_assert_float_eq(*(const float *)rekv_safetensors_find(st, "head")->data, 21);
        rekv_safetensors_close(st);
    }

    /* a tensor mapped to the wrong shard */
    write_text(index, "{\"weight_map\": {"
                      "\"embed\": \"model-00002-of-00002.safetensors\","
                      "\"head\": \"model-00002-of-00002.safetensors\"}}");
    expect_fail(index, "tensor embed is mapped to shard model-00002-of-00002.safetensors but not "
                       "found there");
    /* a shard that does not exist */
    write_text(index, "{\"weight_map\": {\"embed\": \"missing.safetensors\"}}");
    expect_fail(index, "missing.safetensors: cannot open"); /* the message names the shard */
    /* a tensor in two shards */
    write_shard("dup.safetensors", a, 1, 30);
    write_text(index, "{\"weight_map\": {"
                      "\"embed\": \"model-00001-of-00002.safetensors\","
                      "\"layer.1\": \"dup.safetensors\"}}");
    expect_fail(index, "tensor embed appears in more than one shard");
    /* no weight_map, bad JSON */
    write_text(index, "{\"metadata\": {}}");
    expect_fail(index, "no \"weight_map\"");
    write_text(index, "{\"weight_map\": {\"embed\": ");
    expect_fail(index, "not valid JSON");
}
END_TEST

START_TEST(test_shard_path_escape)
{
    const char *index = tmp_path("model.safetensors.index.json");
    static const char *const bad[] = {"../model.safetensors", "/etc/passwd", "sub/x.safetensors",
                                      "..", "."};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char text[256];
        snprintf(text, sizeof(text), "{\"weight_map\": {\"embed\": \"%s\"}}", bad[i]);
        write_text(index, text);
        expect_fail(index, "escapes the model directory");
    }
}
END_TEST

START_TEST(test_directory_without_model)
{
    expect_fail(g_dir, "neither");
    /* a directory with model.safetensors */
    static const char *const a[] = {"x"};
    write_shard("model.safetensors", a, 1, 5);
    rekv_safetensors *st = open_ok(g_dir);
    ck_assert_uint_eq(rekv_safetensors_count(st), 1);
    rekv_safetensors_close(st);
}
END_TEST

/* ---------------------------------------------------------------- validation rules */

#define T2(a, b) "{\"a\":" a ",\"b\":" b "}"
#define ENT(dt, shape, b, e)                                                                       \
    "{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

START_TEST(test_overlap)
{
    expect_fail(
        write_raw("o.safetensors", T2(ENT("F32", "[2]", 0, 8), ENT("F32", "[2]", 4, 12)), 16, -1),
        "overlap");
    /* identical ranges overlap too */
    expect_fail(
        write_raw("o2.safetensors", T2(ENT("F32", "[2]", 0, 8), ENT("F32", "[2]", 0, 8)), 8, -1),
        "overlap");
    /* adjacent, empty and reversed-order tensors are fine */
    rekv_safetensors *st =
        open_ok(write_raw("ok.safetensors",
                          "{\"b\":" ENT("F32", "[2]", 8, 16) ",\"a\":" ENT(
                              "F32", "[2]", 0, 8) ",\"e\":" ENT("F32", "[0]", 8, 8) "}",
                          16, -1));
    ck_assert_uint_eq(rekv_safetensors_count(st), 3);
    rekv_safetensors_close(st);
}
END_TEST

START_TEST(test_out_of_range)
{
    expect_fail(write_raw("r.safetensors", "{\"a\":" ENT("F32", "[4]", 0, 16) "}", 8, -1),
                "out of range");
    expect_fail(write_raw("r2.safetensors", "{\"a\":" ENT("F32", "[1]", 8, 4) "}", 8, -1),
                "begin after end");
    expect_fail(write_raw("r3.safetensors",
                          "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
                          "\"data_offsets\":[0,-4]}}",
                          8, -1),
                "not non-negative");
    expect_fail(write_raw("r4.safetensors",
                          "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
                          "\"data_offsets\":[0]}}",
                          8, -1),
                "data_offsets");
}
END_TEST

START_TEST(test_wrong_byte_length)
{
    expect_fail(write_raw("l.safetensors", "{\"a\":" ENT("F32", "[3]", 0, 8) "}", 16, -1),
                "byte length 8 does not match");
    expect_fail(write_raw("l2.safetensors", "{\"a\":" ENT("F16", "[2,2]", 0, 16) "}", 16, -1),
                "does not match");
    /* huge shapes overflow instead of wrapping */
    expect_fail(write_raw("l3.safetensors",
                          "{\"a\":" ENT("F32", "[4294967296,4294967296,16]", 0, 8) "}", 16, -1),
                "overflow");
    expect_fail(write_raw("l4.safetensors", "{\"a\":" ENT("F32", "[-1]", 0, 8) "}", 16, -1),
                "shape[0] is not a non-negative integer");
    expect_fail(
        write_raw("l5.safetensors", "{\"a\":" ENT("F32", "[1,1,1,1,1,1,1,1,1]", 0, 4) "}", 16, -1),
        "9 dimensions");
    expect_fail(write_raw("l6.safetensors", "{\"a\":" ENT("F32", "[1.5]", 0, 4) "}", 16, -1),
                "shape[0]");
}
END_TEST

START_TEST(test_unknown_dtype)
{
    const char *p = write_raw("d.safetensors", "{\"weird\":" ENT("I64", "[1]", 0, 8) "}", 8, -1);
    char want[4200];
    snprintf(want, sizeof(want), "unknown dtype I64 for tensor weird in %s", p);
    expect_fail(p, want);
    expect_fail(write_raw("d2.safetensors",
                          "{\"a\":{\"dtype\":5,\"shape\":[1],"
                          "\"data_offsets\":[0,4]}}",
                          8, -1),
                "dtype");
}
END_TEST

START_TEST(test_bad_json)
{
    expect_fail(write_raw("j.safetensors", "{\"a\": {\"dtype\": ", 8, -1), "not valid JSON");
    expect_fail(write_raw("j2.safetensors", "[1, 2, 3]", 8, -1), "not a JSON object");
    expect_fail(write_raw("j3.safetensors", "{\"a\": 3}", 8, -1), "not a JSON object");
    expect_fail(write_raw("j4.safetensors", "{\"__metadata__\": {\"x\": 1}}", 8, -1),
                "__metadata__ value of x is not a string");
    expect_fail(write_raw("j5.safetensors", "{\"__metadata__\": [1]}", 8, -1),
                "__metadata__ is not a JSON object");
    expect_fail(write_raw("j6.safetensors", "{} trailing", 8, -1), "not valid JSON");
    /* metadata alone is a valid, empty file */
    rekv_safetensors *st =
        open_ok(write_raw("j7.safetensors", "{\"__metadata__\": {\"format\": \"pt\"}}", 0, -1));
    ck_assert_uint_eq(rekv_safetensors_count(st), 0);
    rekv_safetensors_close(st);
}
END_TEST

START_TEST(test_header_length)
{
    expect_fail(write_raw("h.safetensors", "{}", 8, 1000), "runs past the end");
    expect_fail(write_raw("h2.safetensors", "{}", 8, 1ll << 40), "implausible");
    expect_fail(write_raw("h3.safetensors", "{}", 8, (long long)((~0ull) >> 1)), "implausible");
    expect_fail(write_raw("h4.safetensors", "{}", 8, 0), "too short");
}
END_TEST

START_TEST(test_truncated)
{
    const char *p = tmp_path("t.safetensors");
    write_text(p, "");
    expect_fail(p, "truncated");
    write_text(p, "\x10\x00\x00");
    expect_fail(p, "truncated");
    /* a complete file cut inside its data */
    const char *full = write_raw("t2.safetensors", "{\"a\":" ENT("F32", "[4]", 0, 16) "}", 16, -1);
    size_t len;
    char *raw = tu_read_file(full, &len);
    FILE *f = fopen(full, "wb");
    fwrite(raw, 1, len - 3, f);
    fclose(f);
    free(raw);
    expect_fail(full, "out of range");
    expect_fail(tmp_path("nonexistent.safetensors"), "cannot open");
}
END_TEST

START_TEST(test_duplicate_names)
{
    expect_fail(write_raw("dup.safetensors",
                          "{\"a\":" ENT("F32", "[1]", 0, 4) ",\"a\":" ENT("F32", "[1]", 4, 8) "}",
                          8, -1),
                "duplicate");
}
END_TEST

START_TEST(test_misaligned)
{
    expect_fail(
        write_raw("al.safetensors", T2(ENT("F16", "[1]", 0, 2), ENT("F32", "[1]", 2, 6)), 8, -1),
        "not aligned");
}
END_TEST

/* ---------------------------------------------------------------- the shared models */

static void check_shape(const rekv_safetensors *st, const char *name, rekv_dtype dt, int64_t d0,
                        int64_t d1)
{
    const rekv_tensor *t = rekv_safetensors_find(st, name);
    ck_assert_msg(t != NULL, "%s missing", name);
    ck_assert_int_eq(t->dtype, dt);
    ck_assert_int_eq(t->ndim, d1 ? 2 : 1);
    ck_assert_int_eq(t->shape[0], d0);
    if (d1)
        ck_assert_int_eq(t->shape[1], d1);
}

START_TEST(test_shared_opt)
{
    const char *p = tu_shared("models/opt-tiny-py/model.safetensors");
    if (p == NULL)
        return;
    rekv_safetensors *st = open_ok(p);
    ck_assert_uint_eq(rekv_safetensors_count(st), 4 + 6 * 16);
    check_shape(st, "model.decoder.embed_tokens.weight", REKV_DTYPE_F16, 4096, 256);
    check_shape(st, "model.decoder.embed_positions.weight", REKV_DTYPE_F16, 1026, 256);
    check_shape(st, "model.decoder.layers.5.fc1.weight", REKV_DTYPE_F16, 1024, 256);
    check_shape(st, "model.decoder.layers.0.fc2.weight", REKV_DTYPE_F16, 256, 1024);
    check_shape(st, "model.decoder.layers.3.self_attn.k_proj.bias", REKV_DTYPE_F16, 256, 0);
    ck_assert_ptr_null(rekv_safetensors_find(st, "lm_head.weight"));
    rekv_safetensors_close(st);
}
END_TEST

START_TEST(test_shared_llama)
{
    const char *p = tu_shared("models/llama-tiny-py");
    if (p == NULL)
        return;
    rekv_safetensors *st = open_ok(p); /* the directory form */
    ck_assert_uint_eq(rekv_safetensors_count(st), 3 + 6 * 9);
    check_shape(st, "model.embed_tokens.weight", REKV_DTYPE_BF16, 4096, 256);
    check_shape(st, "lm_head.weight", REKV_DTYPE_BF16, 4096, 256);
    check_shape(st, "model.layers.0.self_attn.k_proj.weight", REKV_DTYPE_BF16, 64, 256);
    check_shape(st, "model.layers.0.self_attn.q_proj.weight", REKV_DTYPE_BF16, 256, 256);
    check_shape(st, "model.layers.5.mlp.down_proj.weight", REKV_DTYPE_BF16, 256, 704);
    check_shape(st, "model.norm.weight", REKV_DTYPE_BF16, 256, 0);
    /* the RMSNorm weights of a trained model are near 1, not garbage */
    const rekv_tensor *t = rekv_safetensors_find(st, "model.norm.weight");
    float v = rekv_bf16_to_f32(((const uint16_t *)t->data)[0]);
    ck_assert(v > 0.0f && v < 10.0f);
    rekv_safetensors_close(st);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("safetensors");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_roundtrip);
    tcase_add_test(tc, test_empty_file_roundtrip);
    tcase_add_test(tc, test_writer_errors);
    tcase_add_test(tc, test_many_tensors_find);
    tcase_add_test(tc, test_sharded);
    tcase_add_test(tc, test_shard_path_escape);
    tcase_add_test(tc, test_directory_without_model);
    tcase_add_test(tc, test_overlap);
    tcase_add_test(tc, test_out_of_range);
    tcase_add_test(tc, test_wrong_byte_length);
    tcase_add_test(tc, test_unknown_dtype);
    tcase_add_test(tc, test_bad_json);
    tcase_add_test(tc, test_header_length);
    tcase_add_test(tc, test_truncated);
    tcase_add_test(tc, test_duplicate_names);
    tcase_add_test(tc, test_misaligned);
    tcase_add_test(tc, test_shared_opt);
    tcase_add_test(tc, test_shared_llama);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
