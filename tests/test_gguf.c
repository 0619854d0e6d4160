/* test_gguf.c — the GGUF parser and dequantization: every file of ../shared/gguf read and compared
 * with llama.cpp's description of it (each tensor's type, dims, offset, and the checksums of its
 * dequantized values: first 8 exact, sum within 1e-6, sum of squares within 1e-9 relative), and
 * one case per kind of bad input on small files built here, each checking the error names the
 * field at fault (and a truncation at every byte of a whole file, none of which may crash). */
#define _GNU_SOURCE
#include "loader/gguf.h"
#include "tests/gguf_edit.h"
#include "tests/testutil.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const k_files[] = {
    "llama-tiny-py-F16", "llama-tiny-py-Q8_0", "llama-tiny-py-Q4_0", "synth-llama-F16",
    "synth-llama-Q8_0",  "synth-llama-Q4_K_M", "synth-llama-Q4_0",
};
#define N_FILES (sizeof(k_files) / sizeof(k_files[0]))

/* ../shared/gguf/NAME.gguf opened, with its ref.json; 0 when absent (skipped). */
static int open_shared(const char *name, rekv_gguf **g, json_t **ref)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "gguf/%s.gguf", name);
    const char *path = tu_shared(rel);
    snprintf(rel, sizeof(rel), "gguf/%s.ref.json", name);
    const char *rpath = tu_shared(rel);
    if (path == NULL || rpath == NULL)
        return 0;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(path, g, &err) == 0, "%s", err.msg);
    json_error_t je;
    *ref = json_load_file(rpath, 0, &je);
    ck_assert_msg(*ref != NULL, "%s: %s", rpath, je.text);
    return 1;
}

/* ---------------------------------------------------------------- the shared files */

START_TEST(shared_tensor_infos)
{
    rekv_gguf *g;
    json_t *ref;
    if (!open_shared(k_files[_i], &g, &ref))
        return;
    json_t *tensors = json_object_get(ref, "tensors");
    ck_assert_uint_eq(g->n_tensors, json_object_size(tensors));
    ck_assert_uint_eq(g->version, 3);
    for (size_t i = 0; i < g->n_tensors; i++) {
        const rekv_gguf_tensor *t = &g->tensors[i];
        json_t *r = json_object_get(tensors, t->name);
        ck_assert_msg(r != NULL, "%s: tensor %s not in the reference", k_files[_i], t->name);
        ck_assert_str_eq(rekv_ggml_type_name(t->type),
                         json_string_value(json_object_get(r, "type")));
        /* llama.cpp lists ne with trailing 1s (a norm weight is [256, 1]); unused dims are 1 */
        json_t *ne = json_object_get(r, "ne");
        ck_assert_int_le(t->n_dims, (int)json_array_size(ne));
        for (size_t d = 0; d < json_array_size(ne) && d < REKV_GGUF_MAX_DIMS; d++)
            ck_assert_uint_eq(t->ne[d], (uint64_t)json_integer_value(json_array_get(ne, d)));
        ck_assert_uint_eq(t->offset, (uint64_t)json_integer_value(json_object_get(r, "offset")));
    }
    const char *arch;
    size_t n;
    ck_assert_int_eq(rekv_gguf_get_str(g, "general.architecture", &arch, &n, NULL), 0);
    ck_assert(n == 5 && memcmp(arch, "llama", 5) == 0);
    json_decref(ref);
    rekv_gguf_close(g);
}
END_TEST

/* Every tensor dequantized and its checksums compared with llama.cpp's (ggml's to_float). */
START_TEST(shared_dequant_checksums)
{
    rekv_gguf *g;
    json_t *ref;
    if (!open_shared(k_files[_i], &g, &ref))
        return;
    json_t *tensors = json_object_get(ref, "tensors");
    for (size_t i = 0; i < g->n_tensors; i++) {
        const rekv_gguf_tensor *t = &g->tensors[i];
        json_t *r = json_object_get(tensors, t->name);
        float *y = malloc(t->numel * sizeof(float));
        ck_assert_ptr_nonnull(y);
        rekv_err err = {0};
        ck_assert_msg(rekv_gguf_dequant(t, 0, t->numel, y, &err) == 0, "%s", err.msg);
        tg_check_llama_checksums(k_files[_i], t->name, t->type, r, y, t->numel);
        free(y);
    }
    json_decref(ref);
    rekv_gguf_close(g);
}
END_TEST

/* ---------------------------------------------------------------- files built here */

typedef struct gbuf {
    uint8_t *p;
    size_t n, cap;
} gbuf;

static void put(gbuf *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        ck_assert_ptr_nonnull(b->p);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
static void put_u32(gbuf *b, uint32_t v)
{
    put(b, &v, 4);
}
static void put_u64(gbuf *b, uint64_t v)
{
    put(b, &v, 8);
}
static void put_str(gbuf *b, const char *s)
{
    put_u64(b, strlen(s));
    put(b, s, strlen(s));
}

/* What the small file holds; the cases change one thing. */
typedef struct spec {
    uint32_t version;
    int64_t n_tensors_field; /* -1: the real count */
    int64_t n_kv_field;      /* -1: the real count */
    int64_t alignment;       /* -1: no general.alignment key */
    uint32_t type;           /* the second tensor's type */
    uint64_t ne1;            /* the second tensor's ne[1] */
    uint64_t offset_delta;   /* added to the second tensor's offset */
    uint64_t array_n_field;  /* 0: the real count of the string array */
} spec;

static spec spec_ok(void)
{
    spec s = {3, -1, -1, -1, REKV_GGML_F16, 4, 0, 0};
    return s;
}

/* A GGUF with six key/values (one of each kind, an array of strings and an array of arrays among
 * them) and two tensors: "a" f32 [8] and "b" [32, ne1] of the spec's type. */
static size_t build(const spec *s, gbuf *b)
{
    b->n = 0;
    uint32_t al = s->alignment > 0 ? (uint32_t)s->alignment : 32;
    put(b, "GGUF", 4);
    put_u32(b, s->version);
    put_u64(b, s->n_tensors_field >= 0 ? (uint64_t)s->n_tensors_field : 2);
    put_u64(b, s->n_kv_field >= 0 ? (uint64_t)s->n_kv_field : (s->alignment >= 0 ? 6 : 5));
    put_str(b, "general.architecture");
    put_u32(b, REKV_GGUF_STRING);
    put_str(b, "llama");
    put_str(b, "test.u32");
    put_u32(b, REKV_GGUF_U32);
    put_u32(b, 7);
    put_str(b, "test.f64");
    put_u32(b, REKV_GGUF_F64);
    double d = 0.5;
    put(b, &d, 8);
    put_str(b, "test.strings");
    put_u32(b, REKV_GGUF_ARRAY);
    put_u32(b, REKV_GGUF_STRING);
    put_u64(b, s->array_n_field ? s->array_n_field : 3);
    put_str(b, "x");
    put_str(b, "yy");
    put_str(b, "");
    put_str(b, "test.nested");
    put_u32(b, REKV_GGUF_ARRAY);
    put_u32(b, REKV_GGUF_ARRAY);
    put_u64(b, 1);
    put_u32(b, REKV_GGUF_I16);
    put_u64(b, 2);
    int16_t two[2] = {-1, 3};
    put(b, two, 4);
    if (s->alignment >= 0) {
        put_str(b, "general.alignment");
        put_u32(b, REKV_GGUF_U32);
        put_u32(b, (uint32_t)s->alignment);
    }
    uint32_t be, bb;
    rekv_ggml_type_block(s->type, &be, &bb);
    if (be == 0)
        be = 1, bb = 1;
    size_t b_bytes = (size_t)(32 / be * bb) * (size_t)(s->ne1 < 64 ? s->ne1 : 4);
    put_str(b, "a");
    put_u32(b, 1);
    put_u64(b, 8);
    put_u32(b, REKV_GGML_F32);
    put_u64(b, 0);
    put_str(b, "b");
    put_u32(b, 2);
    put_u64(b, 32);
    put_u64(b, s->ne1);
    put_u32(b, s->type);
    put_u64(b, (32 + al - 1) / al * al + s->offset_delta);
    while (b->n % al)
        put(b, "", 1);
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    put(b, a, sizeof(a));
    while (b->n % al)
        put(b, "", 1);
    for (size_t i = 0; i < b_bytes; i++)
        put(b, "\x3c", 1);
    return b->n;
}

static char *g_dir;
static void setup(void)
{
    g_dir = tu_tmpdir();
}
static void teardown(void)
{
    tu_rmrf(g_dir);
    free(g_dir);
}

/* Writes n bytes of b and opens them: the return code, the message in err. */
static int try_open(const gbuf *b, size_t n, rekv_gguf **g, rekv_err *err)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/t.gguf", g_dir);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(b->p, 1, n, f), n);
    fclose(f);
    rekv_err_clear(err);
    *g = NULL;
    return rekv_gguf_open(path, g, err);
}

/* The spec's file must be refused with -code and a one-line message holding `needle`. */
static void expect_refused(const spec *s, int code, const char *needle)
{
    gbuf b = {0};
    build(s, &b);
    rekv_gguf *g;
    rekv_err err;
    int rc = try_open(&b, b.n, &g, &err);
    ck_assert_msg(rc == -code, "want -%d (%s), got %d: %s", code, needle, rc, err.msg);
    ck_assert_msg(strstr(err.msg, needle) != NULL && strstr(err.msg, "t.gguf") != NULL,
                  "the message \"%s\" should name \"%s\" and the file", err.msg, needle);
    ck_assert_ptr_null(strchr(err.msg, '\n'));
    free(b.p);
}

START_TEST(built_file_reads_back)
{
    gbuf b = {0};
    spec s = spec_ok();
    s.alignment = 64;
    build(&s, &b);
    rekv_gguf *g;
    rekv_err err;
    ck_assert_msg(try_open(&b, b.n, &g, &err) == 0, "%s", err.msg);
    ck_assert_uint_eq(g->alignment, 64);
    ck_assert_uint_eq(g->data_offset % 64, 0);
    ck_assert_uint_eq(g->n_kvs, 6);
    int64_t v;
    ck_assert_int_eq(rekv_gguf_get_i64(g, "test.u32", &v, NULL), 0);
    ck_assert_int_eq(v, 7);
    double d;
    ck_assert_int_eq(rekv_gguf_get_f64(g, "test.f64", &d, NULL), 0);
    ck_assert(d == 0.5);
    const rekv_gguf_kv *kv = rekv_gguf_kv_find(g, "test.strings");
    ck_assert_uint_eq(kv->n, 3);
    const char *str;
    size_t n;
    ck_assert_int_eq(rekv_gguf_kv_str(kv, 1, &str, &n), 0);
    ck_assert(n == 2 && memcmp(str, "yy", 2) == 0);
    ck_assert_int_eq(rekv_gguf_kv_str(kv, 2, &str, &n), 0);
    ck_assert_uint_eq(n, 0);
    kv = rekv_gguf_kv_find(g, "test.nested");
    ck_assert(kv->elem_type == REKV_GGUF_ARRAY && kv->n == 1);
    const rekv_gguf_tensor *t = rekv_gguf_tensor_find(g, "a");
    ck_assert(((const float *)t->data)[7] == 8.0f);
    /* a missing key and a key of the wrong type name the key */
    ck_assert_int_eq(rekv_gguf_get_i64(g, "test.none", &v, &err), -ENOENT);
    ck_assert_ptr_nonnull(strstr(err.msg, "test.none"));
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_gguf_get_i64(g, "test.f64", &v, &err), -EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "\"test.f64\" is a float64"));
    rekv_gguf_close(g);
    free(b.p);
}
END_TEST

/* Cut at every byte: each prefix is refused with a message (the sanitizer build would catch a
 * read past the end), and the whole file opens. */
START_TEST(truncated_everywhere)
{
    gbuf b = {0};
    spec s = spec_ok();
    build(&s, &b);
    for (size_t n = 0; n < b.n; n++) {
        rekv_gguf *g;
        rekv_err err;
        int rc = try_open(&b, n, &g, &err);
        ck_assert_msg(rc == -EINVAL && strstr(err.msg, "truncated") != NULL,
                      "cut at %zu of %zu: rc %d, \"%s\"", n, b.n, rc, err.msg);
    }
    free(b.p);
}
END_TEST

START_TEST(bad_fields_named)
{
    spec s = spec_ok();
    s.type = 99;
    expect_refused(&s, EINVAL, "tensor \"b\": type 99 is not a ggml type");
    s = spec_ok();
    s.alignment = 48;
    expect_refused(&s, EINVAL, "general.alignment 48 is not a power of two");
    s = spec_ok();
    s.offset_delta = 8;
    expect_refused(&s, EINVAL, "tensor \"b\": offset 40 is not a multiple of general.alignment");
    s = spec_ok();
    s.offset_delta = 32;
    expect_refused(&s, EINVAL, "tensor \"b\": data [64, +256) runs past the end");
    s = spec_ok();
    s.offset_delta = (uint64_t)-32; /* b at a's offset */
    expect_refused(&s, EINVAL, "overlap");
    s = spec_ok();
    s.version = 1;
    expect_refused(&s, ENOTSUP, "GGUF version 1 is not supported");
    s = spec_ok();
    s.n_tensors_field = INT64_MAX;
    expect_refused(&s, EINVAL, "tensor_count");
    s = spec_ok();
    s.n_kv_field = 1LL << 40;
    expect_refused(&s, EINVAL, "metadata_kv_count");
    s = spec_ok();
    s.ne1 = 1ULL << 62;
    expect_refused(&s, EINVAL, "tensor \"b\": ne[1] = 4611686018427387904 overflows");
    s = spec_ok();
    s.ne1 = 1ULL << 40;
    expect_refused(&s, EINVAL, "exceed the file");
    s = spec_ok();
    s.array_n_field = 1ULL << 60;
    expect_refused(&s, EINVAL, "metadata \"test.strings\": array of 1152921504606846976 string");
    s = spec_ok();
    s.type = REKV_GGML_Q4_K; /* a row of 32 is not a whole Q4_K block of 256 */
    expect_refused(&s, EINVAL, "ne[0] = 32 is not a multiple of q4_K's block of 256");
    s = spec_ok();
    s.n_kv_field = 4; /* the fifth key/value is then read as the first tensor info */
    expect_refused(&s, EINVAL, "tensor \"test.nested\": n_dims 9 is outside [1, 4]");
}
END_TEST

Suite *gguf_suite(void);
Suite *gguf_suite(void)
{
    Suite *s = suite_create("gguf");
    TCase *tc = tcase_create("shared");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, shared_tensor_infos, 0, N_FILES);
    tcase_add_loop_test(tc, shared_dequant_checksums, 0, N_FILES);
    suite_add_tcase(s, tc);
    tc = tcase_create("bad_input");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, built_file_reads_back);
    tcase_add_test(tc, truncated_everywhere);
    tcase_add_test(tc, bad_fields_named);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(gguf_suite());
}
