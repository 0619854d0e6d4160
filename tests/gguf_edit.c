/* gguf_edit.c — rewriting a GGUF with edited metadata and converted tensors, for tests (see
 * gguf_edit.h). The writer is this file's own, from the format (loader/gguf.c's opening comment):
 * the reader under test only supplies the parsed values it copies. */
#define _GNU_SOURCE
#include "tests/gguf_edit.h"

#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "loader/gguf.h"

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
    if (n)
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
static void put_bytes_str(gbuf *b, const char *s, size_t n)
{
    put_u64(b, n);
    put(b, s, n);
}

static void put_value(gbuf *b, const tg_edit *e)
{
    put_u32(b, (uint32_t)e->type);
    if (e->type == REKV_GGUF_U32)
        put_u32(b, e->u);
    else if (e->type == REKV_GGUF_F32)
        put(b, &e->f, 4);
    else
        put_bytes_str(b, e->s, strlen(e->s));
}

static void put_kv(gbuf *b, const rekv_gguf_kv *kv)
{
    put_bytes_str(b, kv->key, strlen(kv->key));
    put_u32(b, kv->type);
    if (kv->type == REKV_GGUF_ARRAY) {
        put_u32(b, kv->elem_type);
        put_u64(b, kv->n);
    }
    if (kv->elem_type == REKV_GGUF_STRING) {
        for (uint64_t i = 0; i < kv->n; i++) {
            const char *s;
            size_t n;
            ck_assert_int_eq(rekv_gguf_kv_str(kv, i, &s, &n), 0);
            put_bytes_str(b, s, n);
        }
        return;
    }
    static const uint8_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    ck_assert(kv->elem_type < sizeof(sizes) && sizes[kv->elem_type]); /* no nested arrays here */
    put(b, kv->value, (size_t)kv->n * sizes[kv->elem_type]);
}

/* 1 when convert changes t: the F16 matrices, or with TG_DEQUANT_F32 every non-F32 matrix. */
static int converts(const rekv_gguf_tensor *t, int convert)
{
    if (t->n_dims < 2 || convert == TG_KEEP)
        return 0;
    if (convert == TG_DEQUANT_F32)
        return t->type != REKV_GGML_F32;
    return t->type == REKV_GGML_F16;
}

/* The bytes tensor t takes after conversion, and its data converted into dst when dst != NULL. */
static size_t convert_tensor(const rekv_gguf_tensor *t, int convert, uint8_t *dst)
{
    if (!converts(t, convert)) {
        if (dst)
            memcpy(dst, t->data, t->nbytes);
        return t->nbytes;
    }
    if (convert == TG_DEQUANT_F32) {
        rekv_err err = {0};
        if (dst)
            ck_assert_msg(rekv_gguf_dequant(t, 0, t->numel, (float *)dst, &err) == 0, "%s",
                          err.msg);
        return (size_t)t->numel * 4;
    }
    size_t size = convert == TG_TO_BF16 ? 2 : 4;
    for (uint64_t i = 0; dst && i < t->numel; i++) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)t->data + 2 * i, 2);
        float x = rekv_f16_to_f32(h);
        if (convert != TG_TO_F32)
            x = rekv_bf16_to_f32(rekv_f32_to_bf16(x));
        uint16_t bf = rekv_f32_to_bf16(x);
        memcpy(dst + size * i, convert == TG_TO_BF16 ? (const void *)&bf : (const void *)&x, size);
    }
    return (size_t)t->numel * size;
}

const char *tg_rewrite(const char *src, const tg_edit *edits, size_t n_edits, int convert,
                       const char *dir)
{
    static char out[4096];
    rekv_gguf *g;
    rekv_err err = {0};
    ck_assert_msg(rekv_gguf_open(src, &g, &err) == 0, "%s", err.msg);
    gbuf b = {0};
    gbuf kvs = {0};
    uint64_t n_kv = 0;
    for (size_t i = 0; i < g->n_kvs; i++) {
        const tg_edit *e = NULL;
        for (size_t k = 0; k < n_edits; k++)
            if (edits[k].key && strcmp(edits[k].key, g->kvs[i].key) == 0)
                e = &edits[k];
        if (e == NULL) {
            put_kv(&kvs, &g->kvs[i]);
            n_kv++;
        } else if (e->type >= 0) {
            put_bytes_str(&kvs, e->key, strlen(e->key));
            put_value(&kvs, e);
            n_kv++;
        }
    }
    for (size_t k = 0; k < n_edits; k++)
        if (edits[k].key && edits[k].type >= 0 && rekv_gguf_kv_find(g, edits[k].key) == NULL) {
            put_bytes_str(&kvs, edits[k].key, strlen(edits[k].key));
            put_value(&kvs, &edits[k]);
            n_kv++;
        }
    uint64_t n_added = 0;
    for (size_t k = 0; k < n_edits; k++)
        n_added += edits[k].add_tensor != NULL;
    put(&b, "GGUF", 4);
    put_u32(&b, 3);
    put_u64(&b, g->n_tensors + n_added);
    put_u64(&b, n_kv);
    put(&b, kvs.p, kvs.n);
    /* tensors in the file's order, each at the next aligned offset */
    uint64_t off = 0;
    for (size_t i = 0; i < g->n_tensors; i++) {
        const rekv_gguf_tensor *t = &g->tensors[i];
        const char *name = t->name;
        for (size_t k = 0; k < n_edits; k++)
            if (edits[k].rename_tensor && strcmp(edits[k].rename_tensor, name) == 0)
                name = edits[k].new_name;
        put_bytes_str(&b, name, strlen(name));
        put_u32(&b, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++)
            put_u64(&b, t->ne[d]);
        int converted = converts(t, convert);
        put_u32(&b, !converted              ? t->type
                    : convert == TG_TO_BF16 ? (uint32_t)REKV_GGML_BF16
                                            : (uint32_t)REKV_GGML_F32);
        put_u64(&b, off);
        off += (convert_tensor(t, convert, NULL) + g->alignment - 1) / g->alignment * g->alignment;
    }
    for (size_t k = 0; k < n_edits; k++) {
        if (edits[k].add_tensor == NULL)
            continue;
        put_bytes_str(&b, edits[k].add_tensor, strlen(edits[k].add_tensor));
        put_u32(&b, 1);
        put_u64(&b, edits[k].add_n);
        put_u32(&b, (uint32_t)REKV_GGML_F32);
        put_u64(&b, off);
        off += (edits[k].add_n * 4 + g->alignment - 1) / g->alignment * g->alignment;
    }
    for (size_t i = 0; i < g->n_tensors; i++) {
        while (b.n % g->alignment)
            put(&b, "", 1);
        size_t n = convert_tensor(&g->tensors[i], convert, NULL);
        uint8_t *data = malloc(n + 1);
        ck_assert_ptr_nonnull(data);
        convert_tensor(&g->tensors[i], convert, data);
        put(&b, data, n);
        free(data);
    }
    for (size_t k = 0; k < n_edits; k++) {
        if (edits[k].add_tensor == NULL)
            continue;
        while (b.n % g->alignment)
            put(&b, "", 1);
        put(&b, edits[k].add_f32, edits[k].add_n * 4);
    }
    snprintf(out, sizeof(out), "%s/edited.gguf", dir);
    FILE *f = fopen(out, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(b.p, 1, b.n, f), b.n);
    fclose(f);
    free(b.p);
    free(kvs.p);
    rekv_gguf_close(g);
    return out;
}

void tg_check_llama_checksums(const char *file, const char *name, uint32_t type,
                              const json_t *r, const float *y, uint64_t numel)
{
    const char *tn = rekv_ggml_type_name(type);
    json_t *first8 = json_object_get(r, "first8");
    ck_assert_msg(first8 != NULL, "%s %s: no checksums in the reference", file, name);
    for (size_t k = 0; k < 8 && k < numel; k++) {
        float want = (float)json_number_value(json_array_get(first8, k));
        ck_assert_msg(y[k] == want, "%s %s (%s): first8[%zu] = %.9g, llama.cpp %.9g", file, name,
                      tn, k, y[k], want);
    }
    double sum = 0, sumsq = 0;
    for (uint64_t k = 0; k < numel; k++) {
        sum += y[k];
        sumsq += (double)y[k] * y[k];
    }
    double want_sum = json_number_value(json_object_get(r, "sum"));
    double want_sq = json_number_value(json_object_get(r, "sumsq"));
    ck_assert_msg(fabs(sum - want_sum) <= 1e-6, "%s %s (%s): sum %.12g, llama.cpp %.12g", file,
                  name, tn, sum, want_sum);
    ck_assert_msg(fabs(sumsq - want_sq) <= 1e-9 * fabs(want_sq),
                  "%s %s (%s): sumsq %.15g, llama.cpp %.15g", file, name, tn, sumsq, want_sq);
}
