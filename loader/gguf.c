/* gguf.c — the GGUF parser: header (versions 2 and 3), metadata key/values of every type (nested
 * arrays included), tensor infos, alignment and the data section, over a read-only mmap of the
 * file.
 *
 * Layout (little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count; the
 * key/values (string key, u32 value type, value; a string is u64 length + bytes; an array is u32
 * element type, u64 count, elements); the tensor infos (string name, u32 n_dims, u64 ne[n_dims],
 * u32 ggml type, u64 offset relative to the data section); padding to general.alignment (default
 * 32); the data section. Every read goes through a cursor that refuses to pass the file's end, and
 * every count is checked against the bytes left before anything is allocated for it, so a corrupt
 * file gets one error naming the field and never a crash or a huge allocation. */
#define _GNU_SOURCE
#include "loader/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_NAME 256      /* tensor names and keys (ggml's own limit is 64 for names) */
#define GGUF_MAX_ARRAY_DEPTH 4 /* arrays of arrays of ... */

/* ---------------------------------------------------------------- types */

typedef struct type_info {
    const char *name;
    uint32_t block, bytes;
    int dequant;
} type_info;

static const type_info k_types[] = {
    [REKV_GGML_F32] = {"f32", 1, 4, 1},         [REKV_GGML_F16] = {"f16", 1, 2, 1},
    [REKV_GGML_Q4_0] = {"q4_0", 32, 18, 1},     [REKV_GGML_Q4_1] = {"q4_1", 32, 20, 0},
    [REKV_GGML_Q5_0] = {"q5_0", 32, 22, 0},     [REKV_GGML_Q5_1] = {"q5_1", 32, 24, 0},
    [REKV_GGML_Q8_0] = {"q8_0", 32, 34, 1},     [REKV_GGML_Q8_1] = {"q8_1", 32, 36, 0},
    [REKV_GGML_Q2_K] = {"q2_K", 256, 84, 0},    [REKV_GGML_Q3_K] = {"q3_K", 256, 110, 0},
    [REKV_GGML_Q4_K] = {"q4_K", 256, 144, 1},   [REKV_GGML_Q5_K] = {"q5_K", 256, 176, 0},
    [REKV_GGML_Q6_K] = {"q6_K", 256, 210, 1},   [REKV_GGML_Q8_K] = {"q8_K", 256, 292, 0},
    [REKV_GGML_IQ4_NL] = {"iq4_nl", 32, 18, 0}, [REKV_GGML_IQ4_XS] = {"iq4_xs", 256, 136, 0},
    [REKV_GGML_I8] = {"i8", 1, 1, 0},           [REKV_GGML_I16] = {"i16", 1, 2, 0},
    [REKV_GGML_I32] = {"i32", 1, 4, 0},         [REKV_GGML_I64] = {"i64", 1, 8, 0},
    [REKV_GGML_F64] = {"f64", 1, 8, 0},         [REKV_GGML_BF16] = {"bf16", 1, 2, 1},
};

static const type_info *type_of(uint32_t t)
{
    if (t >= sizeof(k_types) / sizeof(k_types[0]) || k_types[t].name == NULL)
        return NULL;
    return &k_types[t];
}

const char *rekv_ggml_type_name(uint32_t type)
{
    const type_info *ti = type_of(type);
    return ti ? ti->name : NULL;
}

void rekv_ggml_type_block(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes)
{
    const type_info *ti = type_of(type);
    *block_elems = ti ? ti->block : 0;
    *block_bytes = ti ? ti->bytes : 0;
}

int rekv_ggml_type_dequantizable(uint32_t type)
{
    const type_info *ti = type_of(type);
    return ti != NULL && ti->dequant;
}

const char *rekv_gguf_vtype_name(uint32_t vtype)
{
    static const char *const names[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                        "int32",  "float32", "bool",   "string", "array",
                                        "uint64", "int64",   "float64"};
    return vtype < sizeof(names) / sizeof(names[0]) ? names[vtype] : "?";
}

/* Bytes of one scalar value of type t; 0 for strings, arrays and invalid types. */
static size_t scalar_size(uint32_t t)
{
    static const uint8_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < sizeof(sizes) ? sizes[t] : 0;
}

/* ---------------------------------------------------------------- the cursor */

typedef struct cursor {
    const uint8_t *p;
    size_t len, at;
    const char *path;
    rekv_err *err;
} cursor;

static size_t left(const cursor *c)
{
    return c->len - c->at;
}

/* The next n bytes, or NULL with an error naming what was being read. */
static const uint8_t *take(cursor *c, size_t n, const char *what)
{
    if (n > left(c)) {
        rekv_errf(c->err, -EINVAL, "%s: truncated: %s needs %zu bytes at offset %zu, %zu left",
                  c->path, what, n, c->at, left(c));
        return NULL;
    }
    const uint8_t *p = c->p + c->at;
    c->at += n;
    return p;
}

static int take_u32(cursor *c, uint32_t *v, const char *what)
{
    const uint8_t *p = take(c, 4, what);
    if (p == NULL)
        return -EINVAL;
    memcpy(v, p, 4); /* the format and every host rekv runs on are little-endian */
    return 0;
}

static int take_u64(cursor *c, uint64_t *v, const char *what)
{
    const uint8_t *p = take(c, 8, what);
    if (p == NULL)
        return -EINVAL;
    memcpy(v, p, 8);
    return 0;
}

/* A GGUF string: u64 length + bytes. */
static int take_str(cursor *c, const uint8_t **s, uint64_t *n, const char *what)
{
    int rc;
    if ((rc = take_u64(c, n, what)))
        return rc;
    if (*n > left(c))
        return rekv_errf(c->err, -EINVAL,
                         "%s: truncated or corrupt: %s has length %llu at offset %zu, past the "
                         "end of the file",
                         c->path, what, (unsigned long long)*n, c->at - 8);
    *s = take(c, (size_t)*n, what);
    return 0;
}

/* A NUL-terminated copy of a key or tensor name; refuses NUL bytes and overlong names. */
static int take_name(cursor *c, char **out, const char *what)
{
    const uint8_t *s;
    uint64_t n;
    int rc = take_str(c, &s, &n, what);
    if (rc)
        return rc;
    if (n == 0 || n > GGUF_MAX_NAME)
        return rekv_errf(c->err, -EINVAL, "%s: %s at offset %zu has length %llu, outside [1, %d]",
                         c->path, what, c->at - (size_t)n - 8, (unsigned long long)n,
                         GGUF_MAX_NAME);
    if (memchr(s, '\0', (size_t)n) != NULL)
        return rekv_errf(c->err, -EINVAL, "%s: %s \"%.*s\" contains a NUL byte", c->path, what,
                         (int)n, (const char *)s);
    *out = strndup((const char *)s, (size_t)n);
    if (*out == NULL)
        return rekv_errf(c->err, -ENOMEM, "%s: out of memory", c->path);
    return 0;
}

/* ---------------------------------------------------------------- metadata values */

/* Skips one value of type t (checking it), recording element pointers of arrays of strings and
 * arrays in kv when kv is not NULL (the top level). */
static int skip_value(cursor *c, uint32_t t, int depth, rekv_gguf_kv *kv, const char *key)
{
    size_t sz = scalar_size(t);
    if (sz) {
        const uint8_t *p = take(c, sz, key);
        if (p == NULL)
            return -EINVAL;
        if (t == REKV_GGUF_BOOL && *p > 1)
            return rekv_errf(c->err, -EINVAL, "%s: metadata \"%s\": bool value %u is not 0 or 1",
                             c->path, key, *p);
        return 0;
    }
    if (t == REKV_GGUF_STRING) {
        const uint8_t *s;
        uint64_t n;
        return take_str(c, &s, &n, key);
    }
    if (t != REKV_GGUF_ARRAY)
        return rekv_errf(c->err, -EINVAL, "%s: metadata \"%s\": value type %u is not a GGUF type",
                         c->path, key, t);
    if (depth >= GGUF_MAX_ARRAY_DEPTH)
        return rekv_errf(c->err, -EINVAL, "%s: metadata \"%s\": arrays nested deeper than %d",
                         c->path, key, GGUF_MAX_ARRAY_DEPTH);
    uint32_t et;
    uint64_t n;
    int rc;
    if ((rc = take_u32(c, &et, key)) || (rc = take_u64(c, &n, key)))
        return rc;
    size_t esz = scalar_size(et);
    if (esz == 0 && et != REKV_GGUF_STRING && et != REKV_GGUF_ARRAY)
        return rekv_errf(c->err, -EINVAL,
                         "%s: metadata \"%s\": array element type %u is not a GGUF type", c->path,
                         key, et);
    /* every element takes at least one byte (a string or array at least 8): a count the rest of
     * the file cannot hold is refused before anything is sized by it */
    size_t min = esz ? esz : 8;
    if (n > left(c) / min)
        return rekv_errf(c->err, -EINVAL,
                         "%s: metadata \"%s\": array of %llu %s elements does not fit in the %zu "
                         "bytes left (truncated or corrupt)",
                         c->path, key, (unsigned long long)n, rekv_gguf_vtype_name(et), left(c));
    if (kv != NULL) {
        kv->elem_type = et;
        kv->n = n;
        kv->value = c->p + c->at;
    }
    if (esz) {
        c->at += (size_t)n * esz;
        if (et == REKV_GGUF_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (c->p[c->at - (size_t)n + i] > 1)
                    return rekv_errf(c->err, -EINVAL,
                                     "%s: metadata \"%s\": bool element %llu is not 0 or 1",
                                     c->path, key, (unsigned long long)i);
        return 0;
    }
    if (kv != NULL && n > 0) {
        kv->elems = malloc((size_t)n * sizeof(*kv->elems));
        if (kv->elems == NULL)
            return rekv_errf(c->err, -ENOMEM, "%s: out of memory for metadata \"%s\"", c->path,
                             key);
    }
    for (uint64_t i = 0; i < n; i++) {
        if (kv != NULL)
            kv->elems[i] = c->p + c->at;
        if ((rc = skip_value(c, et, depth + 1, NULL, key)))
            return rc;
    }
    return 0;
}

static int read_kvs(rekv_gguf *g, cursor *c, uint64_t n_kv)
{
    /* a key/value takes at least 8 (key length) + 1 + 4 (type) + 1 bytes */
    if (n_kv > left(c) / 14)
        return rekv_errf(c->err, -EINVAL,
                         "%s: header: metadata_kv_count %llu does not fit in the file (%zu bytes; "
                         "truncated or corrupt)",
                         g->path, (unsigned long long)n_kv, g->len);
    g->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof(*g->kvs));
    if (g->kvs == NULL)
        return rekv_errf(c->err, -ENOMEM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < n_kv; i++) {
        rekv_gguf_kv *kv = &g->kvs[i];
        char what[64];
        snprintf(what, sizeof(what), "metadata key %llu", (unsigned long long)i);
        int rc;
        if ((rc = take_name(c, &kv->key, what)))
            return rc;
        g->n_kvs = (size_t)i + 1; /* so close frees the key */
        if ((rc = take_u32(c, &kv->type, kv->key)))
            return rc;
        kv->elem_type = kv->type;
        kv->n = 1;
        kv->value = c->p + c->at;
        if ((rc = skip_value(c, kv->type, 0, kv, kv->key)))
            return rc;
    }
    return 0;
}

/* ---------------------------------------------------------------- tensor infos */

static int read_tensor_info(rekv_gguf *g, cursor *c, rekv_gguf_tensor *t, uint64_t i)
{
    char what[64];
    snprintf(what, sizeof(what), "tensor %llu's name", (unsigned long long)i);
    int rc;
    if ((rc = take_name(c, &t->name, what)))
        return rc;
    uint32_t nd;
    if ((rc = take_u32(c, &nd, t->name)))
        return rc;
    if (nd < 1 || nd > REKV_GGUF_MAX_DIMS)
        return rekv_errf(c->err, -EINVAL, "%s: tensor \"%s\": n_dims %u is outside [1, %d]",
                         g->path, t->name, nd, REKV_GGUF_MAX_DIMS);
    t->n_dims = (int)nd;
    t->numel = 1;
    for (int d = 0; d < REKV_GGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    for (uint32_t d = 0; d < nd; d++) {
        if ((rc = take_u64(c, &t->ne[d], t->name)))
            return rc;
        /* ggml keeps dims as int64 and needs their product to fit too */
        if (t->ne[d] > (uint64_t)INT64_MAX ||
            (t->ne[d] != 0 && t->numel > (uint64_t)INT64_MAX / t->ne[d]))
            return rekv_errf(c->err, -EINVAL,
                             "%s: tensor \"%s\": ne[%u] = %llu overflows the element count",
                             g->path, t->name, d, (unsigned long long)t->ne[d]);
        t->numel *= t->ne[d];
    }
    if ((rc = take_u32(c, &t->type, t->name)))
        return rc;
    const type_info *ti = type_of(t->type);
    if (ti == NULL)
        return rekv_errf(c->err, -EINVAL,
                         "%s: tensor \"%s\": type %u is not a ggml type rekv knows", g->path,
                         t->name, t->type);
    if (t->ne[0] % ti->block != 0)
        return rekv_errf(c->err, -EINVAL,
                         "%s: tensor \"%s\": ne[0] = %llu is not a multiple of %s's block of %u",
                         g->path, t->name, (unsigned long long)t->ne[0], ti->name, ti->block);
    uint64_t blocks = t->numel / ti->block;
    if (blocks > SIZE_MAX / ti->bytes || blocks * ti->bytes > g->len)
        return rekv_errf(c->err, -EINVAL, "%s: tensor \"%s\": %llu elements of %s exceed the file",
                         g->path, t->name, (unsigned long long)t->numel, ti->name);
    t->nbytes = (size_t)(blocks * ti->bytes);
    return take_u64(c, &t->offset, t->name); /* relative for now; made absolute in place_tensors */
}

static int cmp_by_offset(const void *a, const void *b)
{
    const rekv_gguf_tensor *x = *(const rekv_gguf_tensor *const *)a,
                           *y = *(const rekv_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Checks each tensor's offset (aligned, inside the file, no two overlapping) and points it into
 * the mapping. */
static int place_tensors(rekv_gguf *g, rekv_err *err)
{
    uint64_t data_len = g->len - g->data_offset;
    for (size_t i = 0; i < g->n_tensors; i++) {
        rekv_gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment != 0)
            return rekv_errf(err, -EINVAL,
                             "%s: tensor \"%s\": offset %llu is not a multiple of "
                             "general.alignment (%u)",
                             g->path, t->name, (unsigned long long)t->offset, g->alignment);
        if (t->offset > data_len || t->nbytes > data_len - t->offset)
            return rekv_errf(err, -EINVAL,
                             "%s: tensor \"%s\": data [%llu, +%zu) runs past the end of the file "
                             "(truncated? the data section has %llu bytes)",
                             g->path, t->name, (unsigned long long)t->offset, t->nbytes,
                             (unsigned long long)data_len);
        t->offset += g->data_offset;
        t->data = g->map + t->offset;
    }
    const rekv_gguf_tensor **order = malloc((g->n_tensors ? g->n_tensors : 1) * sizeof(*order));
    if (order == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", g->path);
    for (size_t i = 0; i < g->n_tensors; i++)
        order[i] = &g->tensors[i];
    qsort(order, g->n_tensors, sizeof(*order), cmp_by_offset);
    int rc = 0;
    for (size_t i = 1; i < g->n_tensors && rc == 0; i++)
        if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset)
            rc = rekv_errf(err, -EINVAL, "%s: tensors \"%s\" and \"%s\" overlap in the file",
                           g->path, order[i - 1]->name, order[i]->name);
    free(order);
    return rc;
}

static int read_tensors(rekv_gguf *g, cursor *c, uint64_t n_t)
{
    /* a tensor info takes at least 8 + 1 (name) + 4 + 8 (one dim) + 4 + 8 bytes */
    if (n_t > left(c) / 33)
        return rekv_errf(c->err, -EINVAL,
                         "%s: header: tensor_count %llu does not fit in the file (%zu bytes; "
                         "truncated or corrupt)",
                         g->path, (unsigned long long)n_t, g->len);
    g->tensors = calloc(n_t ? (size_t)n_t : 1, sizeof(*g->tensors));
    if (g->tensors == NULL)
        return rekv_errf(c->err, -ENOMEM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < n_t; i++) {
        int rc = read_tensor_info(g, c, &g->tensors[i], i);
        g->n_tensors = (size_t)i + 1;
        if (rc)
            return rc;
    }
    return 0;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Refuses a name given twice (what: "metadata key", "tensor"); sorting keeps a crafted file with
 * many entries from costing quadratic time. */
static int check_unique(const rekv_gguf *g, const char **names, size_t n, const char *what,
                        rekv_err *err)
{
    qsort(names, n, sizeof(*names), cmp_str);
    for (size_t i = 1; i < n; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            return rekv_errf(err, -EINVAL, "%s: %s \"%s\" appears twice", g->path, what, names[i]);
    return 0;
}

static int check_names(const rekv_gguf *g, rekv_err *err)
{
    size_t n = g->n_kvs > g->n_tensors ? g->n_kvs : g->n_tensors;
    const char **names = malloc((n ? n : 1) * sizeof(*names));
    if (names == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", g->path);
    for (size_t i = 0; i < g->n_kvs; i++)
        names[i] = g->kvs[i].key;
    int rc = check_unique(g, names, g->n_kvs, "metadata key", err);
    for (size_t i = 0; i < g->n_tensors && rc == 0; i++)
        names[i] = g->tensors[i].name;
    if (rc == 0)
        rc = check_unique(g, names, g->n_tensors, "tensor", err);
    free(names);
    return rc;
}

/* general.alignment: a uint32 power of two when present. */
static int read_alignment(rekv_gguf *g, rekv_err *err)
{
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const rekv_gguf_kv *kv = rekv_gguf_kv_find(g, "general.alignment");
    if (kv == NULL)
        return 0;
    if (kv->type != REKV_GGUF_U32)
        return rekv_errf(err, -EINVAL, "%s: general.alignment is a %s, not a uint32", g->path,
                         rekv_gguf_vtype_name(kv->type));
    uint32_t a;
    memcpy(&a, kv->value, 4);
    if (a == 0 || (a & (a - 1)) != 0)
        return rekv_errf(err, -EINVAL, "%s: general.alignment %u is not a power of two", g->path,
                         a);
    g->alignment = a;
    return 0;
}

/* ---------------------------------------------------------------- open, close, find */

static int parse(rekv_gguf *g, rekv_err *err)
{
    cursor c = {g->map, g->len, 0, g->path, err};
    const uint8_t *magic = take(&c, 4, "the magic");
    if (magic == NULL)
        return -EINVAL;
    if (memcmp(magic, GGUF_MAGIC, 4) != 0)
        return rekv_errf(err, -EINVAL, "%s: not a GGUF file (magic %02x %02x %02x %02x)", g->path,
                         magic[0], magic[1], magic[2], magic[3]);
    uint64_t n_t, n_kv;
    int rc;
    if ((rc = take_u32(&c, &g->version, "the version")))
        return rc;
    if (g->version != 2 && g->version != 3)
        return rekv_errf(err, -ENOTSUP, "%s: GGUF version %u is not supported (2 and 3 are)",
                         g->path, g->version);
    if ((rc = take_u64(&c, &n_t, "tensor_count")) ||
        (rc = take_u64(&c, &n_kv, "metadata_kv_count")))
        return rc;
    if ((rc = read_kvs(g, &c, n_kv)) || (rc = read_alignment(g, err)) ||
        (rc = read_tensors(g, &c, n_t)) || (rc = check_names(g, err)))
        return rc;
    uint64_t end = c.at, pad = (g->alignment - end % g->alignment) % g->alignment;
    if (pad > g->len - end)
        return rekv_errf(err, -EINVAL,
                         "%s: truncated: the file ends in the padding before the data", g->path);
    g->data_offset = end + pad;
    return place_tensors(g, err);
}

int rekv_gguf_is_gguf(const char *path)
{
    char m[4];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, m, 4);
    close(fd);
    return n == 4 && memcmp(m, GGUF_MAGIC, 4) == 0;
}

int rekv_gguf_open(const char *path, rekv_gguf **out, rekv_err *err)
{
    *out = NULL;
    rekv_gguf *g = calloc(1, sizeof(*g));
    if (g == NULL || (g->path = strdup(path)) == NULL) {
        free(g);
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    }
    int rc = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        rc = rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode) || st.st_size < 24) {
        rc = rekv_errf(err, -EINVAL, "%s: %s", path,
                       S_ISREG(st.st_mode) ? "truncated: shorter than a GGUF header (24 bytes)"
                                           : "not a regular file");
        goto out;
    }
    g->len = (size_t)st.st_size;
    void *map = mmap(NULL, g->len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        rc = rekv_errf(err, -errno, "%s: mmap: %s", path, strerror(errno));
        g->len = 0;
        goto out;
    }
    g->map = map;
    rc = parse(g, err);
out:
    if (fd >= 0)
        close(fd);
    if (rc) {
        rekv_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

void rekv_gguf_close(rekv_gguf *g)
{
    if (g == NULL)
        return;
    for (size_t i = 0; i < g->n_kvs; i++) {
        free(g->kvs[i].key);
        free(g->kvs[i].elems);
    }
    free(g->kvs);
    for (size_t i = 0; i < g->n_tensors; i++)
        free(g->tensors[i].name);
    free(g->tensors);
    if (g->map)
        munmap((void *)g->map, g->len);
    free(g->path);
    free(g);
}

const rekv_gguf_kv *rekv_gguf_kv_find(const rekv_gguf *g, const char *key)
{
    for (size_t i = 0; i < g->n_kvs; i++)
        if (g->kvs[i].key && strcmp(g->kvs[i].key, key) == 0)
            return &g->kvs[i];
    return NULL;
}

const rekv_gguf_tensor *rekv_gguf_tensor_find(const rekv_gguf *g, const char *name)
{
    for (size_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].name && strcmp(g->tensors[i].name, name) == 0)
            return &g->tensors[i];
    return NULL;
}

/* ---------------------------------------------------------------- typed reads */

/* The element at i of kv (or kv's scalar), for fixed-size element types. */
static const uint8_t *elem_at(const rekv_gguf_kv *kv, uint64_t i)
{
    size_t sz = scalar_size(kv->elem_type);
    if (sz == 0 || i >= kv->n)
        return NULL;
    return kv->value + (size_t)i * sz;
}

int rekv_gguf_kv_int(const rekv_gguf_kv *kv, uint64_t i, int64_t *out)
{
    const uint8_t *p = elem_at(kv, i);
    if (p == NULL)
        return -EINVAL;
    switch (kv->elem_type) {
    case REKV_GGUF_U8:
        *out = *p;
        return 0;
    case REKV_GGUF_I8:
        *out = (int8_t)*p;
        return 0;
    case REKV_GGUF_BOOL:
        *out = *p;
        return 0;
    case REKV_GGUF_U16: {
        uint16_t v;
        memcpy(&v, p, 2);
        *out = v;
        return 0;
    }
    case REKV_GGUF_I16: {
        int16_t v;
        memcpy(&v, p, 2);
        *out = v;
        return 0;
    }
    case REKV_GGUF_U32: {
        uint32_t v;
        memcpy(&v, p, 4);
        *out = v;
        return 0;
    }
    case REKV_GGUF_I32: {
        int32_t v;
        memcpy(&v, p, 4);
        *out = v;
        return 0;
    }
    case REKV_GGUF_I64: {
        int64_t v;
        memcpy(&v, p, 8);
        *out = v;
        return 0;
    }
    case REKV_GGUF_U64: {
        uint64_t v;
        memcpy(&v, p, 8);
        if (v > (uint64_t)INT64_MAX)
            return -ERANGE;
        *out = (int64_t)v;
        return 0;
    }
    default:
        return -EINVAL;
    }
}

int rekv_gguf_kv_float(const rekv_gguf_kv *kv, uint64_t i, double *out)
{
    const uint8_t *p = elem_at(kv, i);
    if (p == NULL)
        return -EINVAL;
    if (kv->elem_type == REKV_GGUF_F32) {
        float v;
        memcpy(&v, p, 4);
        *out = v;
        return 0;
    }
    if (kv->elem_type == REKV_GGUF_F64) {
        memcpy(out, p, 8);
        return 0;
    }
    return -EINVAL;
}

int rekv_gguf_kv_str(const rekv_gguf_kv *kv, uint64_t i, const char **s, size_t *len)
{
    if (kv->elem_type != REKV_GGUF_STRING || i >= kv->n)
        return -EINVAL;
    const uint8_t *p = kv->type == REKV_GGUF_ARRAY ? kv->elems[i] : kv->value;
    uint64_t n;
    memcpy(&n, p, 8); /* checked against the file when it was parsed */
    *s = (const char *)p + 8;
    *len = (size_t)n;
    return 0;
}

/* The key's kv, or -ENOENT; scalar: it must not be an array. */
static int kv_get(const rekv_gguf *g, const char *key, const rekv_gguf_kv **kv, rekv_err *err)
{
    *kv = rekv_gguf_kv_find(g, key);
    if (*kv == NULL)
        return rekv_errf(err, -ENOENT, "%s: metadata \"%s\" is missing", g->path, key);
    if ((*kv)->type == REKV_GGUF_ARRAY)
        return rekv_errf(err, -EINVAL, "%s: metadata \"%s\" is an array, not a single value",
                         g->path, key);
    return 0;
}

int rekv_gguf_get_i64(const rekv_gguf *g, const char *key, int64_t *out, rekv_err *err)
{
    const rekv_gguf_kv *kv;
    int rc = kv_get(g, key, &kv, err);
    if (rc)
        return rc;
    if (kv->type == REKV_GGUF_BOOL || rekv_gguf_kv_int(kv, 0, out) != 0)
        return rekv_errf(err, -EINVAL, "%s: metadata \"%s\" is a %s, not an integer%s", g->path,
                         key, rekv_gguf_vtype_name(kv->type),
                         kv->type == REKV_GGUF_U64 ? " that fits in int64" : "");
    return 0;
}

int rekv_gguf_get_f64(const rekv_gguf *g, const char *key, double *out, rekv_err *err)
{
    const rekv_gguf_kv *kv;
    int rc = kv_get(g, key, &kv, err);
    if (rc)
        return rc;
    if (rekv_gguf_kv_float(kv, 0, out) != 0)
        return rekv_errf(err, -EINVAL, "%s: metadata \"%s\" is a %s, not a float", g->path, key,
                         rekv_gguf_vtype_name(kv->type));
    return 0;
}

int rekv_gguf_get_bool(const rekv_gguf *g, const char *key, int *out, rekv_err *err)
{
    const rekv_gguf_kv *kv;
    int rc = kv_get(g, key, &kv, err);
    if (rc)
        return rc;
    if (kv->type != REKV_GGUF_BOOL)
        return rekv_errf(err, -EINVAL, "%s: metadata \"%s\" is a %s, not a bool", g->path, key,
                         rekv_gguf_vtype_name(kv->type));
    *out = kv->value[0];
    return 0;
}

int rekv_gguf_get_str(const rekv_gguf *g, const char *key, const char **s, size_t *len,
                      rekv_err *err)
{
    const rekv_gguf_kv *kv;
    int rc = kv_get(g, key, &kv, err);
    if (rc)
        return rc;
    if (rekv_gguf_kv_str(kv, 0, s, len) != 0)
        return rekv_errf(err, -EINVAL, "%s: metadata \"%s\" is a %s, not a string", g->path, key,
                         rekv_gguf_vtype_name(kv->type));
    return 0;
}
