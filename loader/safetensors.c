/* safetensors.c — strict reader and streaming writer of the safetensors format.
 *
 * A file is a u64 little-endian header length N, N bytes of JSON
 * ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}) and the
 * data section that the offsets index. The reader maps every file read-only and validates every
 * header before handing out a single tensor, so that nothing downstream has to distrust a shape, a
 * size or a pointer. Sharded checkpoints (model.safetensors.index.json) open as one set. */
#define _GNU_SOURCE
#include "loader/loader.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER (100u * 1024 * 1024) /* the HF reference implementation's limit */
#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

typedef struct st_file {
    char *path;
    void *map; /* NULL when the file is empty of data and was not mapped */
    size_t len;
} st_file;

struct rekv_safetensors {
    st_file *files;
    size_t n_files;
    rekv_tensor *tensors; /* sorted by name, so find() is a binary search */
    size_t n;
    size_t cap;
};

/* ---------------------------------------------------------------- helpers */

int rekv_safetensors_mapping(const rekv_safetensors *st, const void *p, size_t bytes,
                             const void **map, size_t *len)
{
    const char *c = p;
    for (size_t i = 0; st != NULL && i < st->n_files; i++) {
        const char *b = st->files[i].map;
        if (b != NULL && c >= b && bytes <= st->files[i].len && (size_t)(c - b) <= st->files[i].len - bytes) {
            *map = b;
            *len = st->files[i].len;
            return 1;
        }
    }
    return 0;
}

static int path_join(char **out, const char *dir, const char *name)
{
    size_t dl = strlen(dir);
    int slash = dl > 0 && dir[dl - 1] == '/';
    if (asprintf(out, "%s%s%s", dir, slash ? "" : "/", name) < 0) {
        *out = NULL;
        return -ENOMEM;
    }
    return 0;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static int tensor_name_cmp(const void *a, const void *b)
{
    return strcmp(((const rekv_tensor *)a)->name, ((const rekv_tensor *)b)->name);
}

static int push_tensor(rekv_safetensors *st, const rekv_tensor *t)
{
    if (st->n == st->cap) {
        size_t cap = st->cap ? st->cap * 2 : 64;
        rekv_tensor *nt = realloc(st->tensors, cap * sizeof(*nt));
        if (nt == NULL)
            return -ENOMEM;
        st->tensors = nt;
        st->cap = cap;
    }
    st->tensors[st->n++] = *t;
    return 0;
}

/* A JSON integer that fits in [0, max]; -1 otherwise. */
static int64_t json_nonneg(const json_t *v, int64_t max)
{
    if (!json_is_integer(v))
        return -1;
    json_int_t x = json_integer_value(v);
    if (x < 0 || x > max)
        return -1;
    return (int64_t)x;
}

/* ---------------------------------------------------------------- one file */

typedef struct span {
    uint64_t begin, end;
    const char *name;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Validates one tensor entry of file f and appends it to st. */
static int parse_entry(rekv_safetensors *st, const st_file *f, const char *name, json_t *v,
                       const uint8_t *data, uint64_t data_len, span *sp, rekv_err *err)
{
    const char *path = f->path;
    if (!json_is_object(v))
        return rekv_errf(err, -EINVAL, "%s: tensor %s: entry is not a JSON object", path, name);
    json_t *jd = json_object_get(v, "dtype");
    json_t *js = json_object_get(v, "shape");
    json_t *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd))
        return rekv_errf(err, -EINVAL, "%s: tensor %s: missing or non-string \"dtype\"", path,
                         name);
    rekv_tensor t;
    memset(&t, 0, sizeof(t));
    if (rekv_dtype_parse(json_string_value(jd), &t.dtype) != 0)
        return rekv_errf(err, -EINVAL,
                         "unknown dtype %.32s for tensor %s in %s (supported: F32, F16, BF16)",
                         json_string_value(jd), name, path);
    if (!json_is_array(js))
        return rekv_errf(err, -EINVAL, "%s: tensor %s: missing or non-array \"shape\"", path, name);
    size_t nd = json_array_size(js);
    if (nd > REKV_MAX_DIMS)
        return rekv_errf(err, -EINVAL, "%s: tensor %s has %zu dimensions (at most %d supported)",
                         path, name, nd, REKV_MAX_DIMS);
    t.ndim = (int)nd;
    uint64_t numel = 1;
    int zero = 0;
    for (size_t i = 0; i < nd; i++) {
        int64_t d = json_nonneg(json_array_get(js, i), INT64_MAX);
        if (d < 0)
            return rekv_errf(err, -EINVAL,
                             "%s: tensor %s: shape[%zu] is not a non-negative integer", path, name,
                             i);
        t.shape[i] = d;
        if (d == 0)
            zero = 1;
        else if (!zero && __builtin_mul_overflow(numel, (uint64_t)d, &numel))
            return rekv_errf(err, -EOVERFLOW, "%s: tensor %s: shape overflows 64 bits", path, name);
    }
    if (zero)
        numel = 0;
    uint64_t want;
    if (__builtin_mul_overflow(numel, (uint64_t)rekv_dtype_size(t.dtype), &want) ||
        want > (uint64_t)INT64_MAX)
        return rekv_errf(err, -EOVERFLOW, "%s: tensor %s: byte size overflows 64 bits", path, name);
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return rekv_errf(err, -EINVAL, "%s: tensor %s: \"data_offsets\" is not [begin, end]", path,
                         name);
    int64_t b = json_nonneg(json_array_get(jo, 0), INT64_MAX);
    int64_t e = json_nonneg(json_array_get(jo, 1), INT64_MAX);
    if (b < 0 || e < 0)
        return rekv_errf(err, -EINVAL, "%s: tensor %s: data_offsets are not non-negative integers",
                         path, name);
    if (b > e)
        return rekv_errf(err, -EINVAL, "%s: tensor %s: data_offsets [%lld, %lld] begin after end",
                         path, name, (long long)b, (long long)e);
    if ((uint64_t)e > data_len)
        return rekv_errf(err, -EINVAL,
                         "%s: tensor %s: data_offsets [%lld, %lld] out of range (data section "
                         "is %llu bytes)",
                         path, name, (long long)b, (long long)e, (unsigned long long)data_len);
    if ((uint64_t)(e - b) != want)
        return rekv_errf(err, -EINVAL,
                         "%s: tensor %s: byte length %lld does not match shape and dtype %s "
                         "(%llu bytes)",
                         path, name, (long long)(e - b), rekv_dtype_name(t.dtype),
                         (unsigned long long)want);
    t.data = data + b;
    t.nbytes = (size_t)want;
    if (want > 0 && ((uintptr_t)t.data % rekv_dtype_size(t.dtype)) != 0)
        return rekv_errf(err, -EINVAL,
                         "%s: tensor %s: data at offset %lld is not aligned to its %zu-byte "
                         "elements",
                         path, name, (long long)b, rekv_dtype_size(t.dtype));
    t.name = strdup(name);
    if (t.name == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    int rc = push_tensor(st, &t);
    if (rc < 0) {
        free((char *)t.name);
        return rekv_errf(err, rc, "%s: out of memory", path);
    }
    sp->begin = (uint64_t)b;
    sp->end = (uint64_t)e;
    sp->name = t.name;
    return 0;
}

/* Maps one .safetensors file and appends its tensors to st. */
static int open_file(rekv_safetensors *st, const char *path, rekv_err *err)
{
    int rc = 0;
    json_t *root = NULL;
    span *spans = NULL;
    st_file *nf = realloc(st->files, (st->n_files + 1) * sizeof(*nf));
    if (nf == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    st->files = nf;
    st_file *f = &st->files[st->n_files];
    memset(f, 0, sizeof(*f));
    f->path = strdup(path);
    if (f->path == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    st->n_files++; /* from here the file is released by rekv_safetensors_close */

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return rekv_errf(err, -errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        rc = rekv_errf(err, -errno, "%s: cannot stat: %s", path, strerror(errno));
        goto out_close;
    }
    if (!S_ISREG(sb.st_mode)) {
        rc = rekv_errf(err, -EINVAL, "%s: not a regular file", path);
        goto out_close;
    }
    if (sb.st_size < 8) {
        rc = rekv_errf(err, -EINVAL,
                       "%s: truncated: %lld bytes is too short for a safetensors header", path,
                       (long long)sb.st_size);
        goto out_close;
    }
    f->len = (size_t)sb.st_size;
    void *map = mmap(NULL, f->len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        rc = rekv_errf(err, -errno, "%s: cannot mmap: %s", path, strerror(errno));
        goto out_close;
    }
    f->map = map;
    const uint8_t *base = map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | base[i];
    if (hlen > ST_MAX_HEADER) {
        rc = rekv_errf(err, -EINVAL, "%s: header length %llu is implausible (limit %u bytes)", path,
                       (unsigned long long)hlen, ST_MAX_HEADER);
        goto out_close;
    }
    if (hlen > f->len - 8) {
        rc = rekv_errf(err, -EINVAL,
                       "%s: truncated: header length %llu runs past the end of the %zu-byte file",
                       path, (unsigned long long)hlen, f->len);
        goto out_close;
    }
    if (hlen < 2) {
        rc = rekv_errf(err, -EINVAL, "%s: header length %llu is too short for a JSON object", path,
                       (unsigned long long)hlen);
        goto out_close;
    }
    const uint8_t *data = base + 8 + hlen;
    uint64_t data_len = f->len - 8 - hlen;

    json_error_t je;
    root = json_loadb((const char *)base + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (root == NULL) {
        if (strstr(je.text, "duplicate") != NULL)
            rc = rekv_errf(err, -EINVAL, "%s: duplicate tensor name in header: %s", path, je.text);
        else
            rc = rekv_errf(err, -EINVAL, "%s: header is not valid JSON: %s (byte %d)", path,
                           je.text, je.position);
        goto out_close;
    }
    if (!json_is_object(root)) {
        rc = rekv_errf(err, -EINVAL, "%s: header is not a JSON object", path);
        goto out_close;
    }
    size_t n_entries = json_object_size(root);
    spans = calloc(n_entries ? n_entries : 1, sizeof(*spans));
    if (spans == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto out_close;
    }
    size_t n_spans = 0;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        if (strcmp(key, "__metadata__") == 0) {
            if (!json_is_object(v)) {
                rc = rekv_errf(err, -EINVAL, "%s: __metadata__ is not a JSON object", path);
                goto out_close;
            }
            const char *mk;
            json_t *mv;
            json_object_foreach(v, mk, mv)
            {
                if (!json_is_string(mv)) {
                    rc = rekv_errf(err, -EINVAL, "%s: __metadata__ value of %s is not a string",
                                   path, mk);
                    goto out_close;
                }
            }
            continue;
        }
        if (key[0] == '\0') {
            rc = rekv_errf(err, -EINVAL, "%s: a tensor has an empty name", path);
            goto out_close;
        }
        rc = parse_entry(st, f, key, v, data, data_len, &spans[n_spans], err);
        if (rc < 0)
            goto out_close;
        n_spans++;
    }
    /* Sorted by offset, each tensor must end before the next one begins; empty tensors take no
     * room and cannot overlap anything. */
    qsort(spans, n_spans, sizeof(*spans), span_cmp);
    const span *prev = NULL;
    for (size_t i = 0; i < n_spans; i++) {
        if (spans[i].begin == spans[i].end)
            continue;
        if (prev != NULL && spans[i].begin < prev->end) {
            rc = rekv_errf(err, -EINVAL, "%s: tensors %s [%llu, %llu] and %s [%llu, %llu] overlap",
                           path, prev->name, (unsigned long long)prev->begin,
                           (unsigned long long)prev->end, spans[i].name,
                           (unsigned long long)spans[i].begin, (unsigned long long)spans[i].end);
            goto out_close;
        }
        prev = &spans[i];
    }
out_close:
    free(spans);
    json_decref(root);
    close(fd);
    return rc;
}

/* ---------------------------------------------------------------- sharded index */

static int shard_name_ok(const char *s)
{
    return s[0] != '\0' && strchr(s, '/') == NULL && strchr(s, '\\') == NULL &&
           strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static int open_index(rekv_safetensors *st, const char *index_path, rekv_err *err)
{
    int rc = 0;
    char *dir = NULL, *shard_path = NULL;
    json_t *where = NULL;
    json_error_t je;
    json_t *root = json_load_file(index_path, JSON_REJECT_DUPLICATES, &je);
    if (root == NULL) {
        if (access(index_path, R_OK) != 0)
            return rekv_errf(err, -errno, "%s: cannot open: %s", index_path, strerror(errno));
        return rekv_errf(err, -EINVAL, "%s: not valid JSON: %s (line %d)", index_path, je.text,
                         je.line);
    }
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(root) || !json_is_object(wm)) {
        rc = rekv_errf(err, -EINVAL, "%s: no \"weight_map\" object", index_path);
        goto out;
    }
    if (json_object_size(wm) == 0) {
        rc = rekv_errf(err, -EINVAL, "%s: \"weight_map\" is empty", index_path);
        goto out;
    }
    const char *slash = strrchr(index_path, '/');
    dir = slash ? strndup(index_path, (size_t)(slash - index_path + 1)) : strdup("./");
    if (dir == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", index_path);
        goto out;
    }
    /* Open each distinct shard once, in the order the map first names it. */
    json_t *opened = json_object();
    where = json_object(); /* tensor name -> the shard that holds it */
    if (opened == NULL || where == NULL) {
        json_decref(opened);
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", index_path);
        goto out;
    }
    const char *name;
    json_t *v;
    json_object_foreach(wm, name, v)
    {
        if (!json_is_string(v)) {
            rc = rekv_errf(err, -EINVAL, "%s: weight_map entry %s is not a file name", index_path,
                           name);
            break;
        }
        const char *shard = json_string_value(v);
        if (!shard_name_ok(shard)) {
            rc = rekv_errf(err, -EINVAL,
                           "%s: shard file name \"%s\" for tensor %s escapes the model directory",
                           index_path, shard, name);
            break;
        }
        if (json_object_get(opened, shard) != NULL)
            continue;
        rc = path_join(&shard_path, dir, shard);
        if (rc < 0) {
            rekv_errf(err, rc, "%s: out of memory", index_path);
            break;
        }
        json_object_set_new(opened, shard, json_true());
        size_t first = st->n;
        rc = open_file(st, shard_path, err);
        free(shard_path);
        shard_path = NULL;
        if (rc < 0)
            break;
        for (size_t i = first; i < st->n && rc == 0; i++) {
            const char *tn = st->tensors[i].name;
            json_t *prev = json_object_get(where, tn);
            if (prev != NULL)
                rc = rekv_errf(err, -EINVAL,
                               "%s: tensor %s appears in more than one shard (%s "
                               "and %s)",
                               index_path, tn, json_string_value(prev), shard);
            else
                json_object_set_new(where, tn, json_string(shard));
        }
        if (rc < 0)
            break;
    }
    json_decref(opened);
    if (rc < 0)
        goto out;
    /* Every mapped tensor must live in the shard the map names. */
    json_object_foreach(wm, name, v)
    {
        json_t *w = json_object_get(where, name);
        if (w == NULL || strcmp(json_string_value(w), json_string_value(v)) != 0) {
            rc = rekv_errf(err, -EINVAL, "%s: tensor %s is mapped to shard %s but not found there",
                           index_path, name, json_string_value(v));
            goto out;
        }
    }
out:
    free(dir);
    json_decref(where);
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------- public reader */

int rekv_safetensors_open(const char *path, rekv_safetensors **out, rekv_err *err)
{
    *out = NULL;
    int rc;
    char *resolved = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return rekv_errf(err, -errno, "%s: cannot open: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode)) {
        char *idx = NULL;
        if (path_join(&idx, path, ST_INDEX_NAME) < 0)
            return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        if (access(idx, F_OK) == 0) {
            resolved = idx;
        } else {
            free(idx);
            if (path_join(&resolved, path, ST_SINGLE_NAME) < 0)
                return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
            if (access(resolved, F_OK) != 0) {
                free(resolved);
                return rekv_errf(err, -ENOENT, "%s: directory holds neither %s nor %s", path,
                                 ST_SINGLE_NAME, ST_INDEX_NAME);
            }
        }
    } else {
        resolved = strdup(path);
        if (resolved == NULL)
            return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    }

    rekv_safetensors *st = calloc(1, sizeof(*st));
    if (st == NULL) {
        free(resolved);
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    }
    if (ends_with(resolved, ".json"))
        rc = open_index(st, resolved, err);
    else
        rc = open_file(st, resolved, err);
    if (rc < 0)
        goto fail;

    if (st->n > 1) /* a file of no tensors has no list (qsort takes none, even of 0) */
        qsort(st->tensors, st->n, sizeof(*st->tensors), tensor_name_cmp);
    for (size_t i = 1; i < st->n; i++) {
        if (strcmp(st->tensors[i - 1].name, st->tensors[i].name) == 0) {
            rc = rekv_errf(err, -EINVAL, "%s: tensor %s appears in more than one shard", resolved,
                           st->tensors[i].name);
            goto fail;
        }
    }
    free(resolved);
    *out = st;
    return 0;
fail:
    free(resolved);
    rekv_safetensors_close(st);
    return rc;
}

void rekv_safetensors_close(rekv_safetensors *st)
{
    if (st == NULL)
        return;
    for (size_t i = 0; i < st->n; i++)
        free((char *)st->tensors[i].name);
    free(st->tensors);
    for (size_t i = 0; i < st->n_files; i++) {
        if (st->files[i].map != NULL)
            munmap(st->files[i].map, st->files[i].len);
        free(st->files[i].path);
    }
    free(st->files);
    free(st);
}

size_t rekv_safetensors_count(const rekv_safetensors *st)
{
    return st ? st->n : 0;
}

const rekv_tensor *rekv_safetensors_at(const rekv_safetensors *st, size_t i)
{
    return st != NULL && i < st->n ? &st->tensors[i] : NULL;
}

const rekv_tensor *rekv_safetensors_find(const rekv_safetensors *st, const char *name)
{
    if (st == NULL || name == NULL || st->n == 0)
        return NULL;
    rekv_tensor key = {.name = name};
    return bsearch(&key, st->tensors, st->n, sizeof(*st->tensors), tensor_name_cmp);
}

/* ---------------------------------------------------------------- writer */

struct rekv_st_writer {
    char *path;
    char *tmp_path;
    FILE *f;
    json_t *header;   /* insertion-ordered: tensors appear in declaration order */
    uint64_t total;   /* bytes declared */
    uint64_t written; /* data bytes written so far */
    int header_done;
    int failed; /* a write failed: close discards the file */
};

int rekv_st_writer_open(const char *path, rekv_st_writer **out, rekv_err *err)
{
    *out = NULL;
    rekv_st_writer *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    int rc;
    w->path = strdup(path);
    w->header = json_object();
    if (w->path == NULL || w->header == NULL || asprintf(&w->tmp_path, "%s.tmp.XXXXXX", path) < 0) {
        w->tmp_path = NULL;
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    int fd = mkostemp(w->tmp_path, O_CLOEXEC);
    if (fd < 0) {
        rc = rekv_errf(err, -errno, "%s: cannot create: %s", w->tmp_path, strerror(errno));
        free(w->tmp_path);
        w->tmp_path = NULL;
        goto fail;
    }
    if (fchmod(fd, 0644) != 0) {
        /* not fatal: the file stays private to its owner */
    }
    w->f = fdopen(fd, "wb");
    if (w->f == NULL) {
        rc = rekv_errf(err, -errno, "%s: fdopen: %s", w->tmp_path, strerror(errno));
        close(fd);
        goto fail;
    }
    json_t *meta = json_pack("{s:s}", "format", "pt");
    if (meta == NULL || json_object_set_new(w->header, "__metadata__", meta) != 0) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    *out = w;
    return 0;
fail:
    if (w->f != NULL)
        fclose(w->f);
    if (w->tmp_path != NULL)
        unlink(w->tmp_path);
    free(w->tmp_path);
    free(w->path);
    json_decref(w->header);
    free(w);
    return rc;
}

int rekv_st_writer_declare(rekv_st_writer *w, const char *name, rekv_dtype dtype, int ndim,
                           const int64_t *shape, rekv_err *err)
{
    if (w->header_done)
        return rekv_errf(err, -EINVAL, "%s: tensor %s declared after data was written", w->path,
                         name);
    if (name == NULL || name[0] == '\0' || strcmp(name, "__metadata__") == 0)
        return rekv_errf(err, -EINVAL, "%s: invalid tensor name \"%s\"", w->path,
                         name ? name : "(null)");
    if (dtype != REKV_DTYPE_F32 && dtype != REKV_DTYPE_F16 && dtype != REKV_DTYPE_BF16)
        return rekv_errf(err, -EINVAL, "%s: tensor %s: unknown dtype %d", w->path, name,
                         (int)dtype);
    if (ndim < 0 || ndim > REKV_MAX_DIMS)
        return rekv_errf(err, -EINVAL, "%s: tensor %s: %d dimensions (0..%d supported)", w->path,
                         name, ndim, REKV_MAX_DIMS);
    if (json_object_get(w->header, name) != NULL)
        return rekv_errf(err, -EEXIST, "%s: tensor %s declared twice", w->path, name);
    uint64_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return rekv_errf(err, -EINVAL, "%s: tensor %s: negative dimension %lld", w->path, name,
                             (long long)shape[i]);
        if (__builtin_mul_overflow(numel, (uint64_t)shape[i], &numel))
            return rekv_errf(err, -EOVERFLOW, "%s: tensor %s: shape overflows", w->path, name);
    }
    size_t esize = rekv_dtype_size(dtype);
    uint64_t nbytes, end;
    if (__builtin_mul_overflow(numel, (uint64_t)esize, &nbytes) ||
        __builtin_add_overflow(w->total, nbytes, &end) || end > (uint64_t)INT64_MAX)
        return rekv_errf(err, -EOVERFLOW, "%s: tensor %s: size overflows", w->path, name);
    /* The reader requires every tensor aligned to its element size (the header is padded to 8),
     * as HF's writer ensures by ordering wider dtypes first. */
    if (nbytes > 0 && w->total % esize != 0)
        return rekv_errf(err, -EINVAL,
                         "%s: tensor %s would start at data offset %llu, not a multiple of its "
                         "%zu-byte elements; declare wider dtypes first",
                         w->path, name, (unsigned long long)w->total, esize);
    json_t *jshape = json_array();
    json_t *entry = json_object();
    int bad = jshape == NULL || entry == NULL;
    for (int i = 0; i < ndim && !bad; i++)
        bad = json_array_append_new(jshape, json_integer((json_int_t)shape[i])) != 0;
    if (!bad)
        bad = json_object_set_new(entry, "dtype", json_string(rekv_dtype_name(dtype))) != 0 ||
              json_object_set(entry, "shape", jshape) != 0 ||
              json_object_set_new(entry, "data_offsets",
                                  json_pack("[I,I]", (json_int_t)w->total, (json_int_t)end)) != 0;
    json_decref(jshape);
    if (bad) {
        json_decref(entry);
        return rekv_errf(err, -ENOMEM, "%s: out of memory", w->path);
    }
    if (json_object_set_new(w->header, name, entry) != 0) /* jansson refuses invalid UTF-8 */
        return rekv_errf(err, -EINVAL, "%s: tensor name \"%s\" is not valid UTF-8", w->path,
                         name);
    w->total = end;
    return 0;
}

static int write_header(rekv_st_writer *w, rekv_err *err)
{
    char *js = json_dumps(w->header, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (js == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", w->path);
    size_t n = strlen(js);
    size_t padded = (n + 7) & ~(size_t)7;
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    int ok = fwrite(len8, 1, 8, w->f) == 8 && fwrite(js, 1, n, w->f) == n;
    for (size_t i = n; ok && i < padded; i++)
        ok = fputc(' ', w->f) != EOF;
    free(js);
    w->header_done = 1;
    if (!ok) {
        w->failed = 1;
        return rekv_errf(err, -EIO, "%s: write failed: %s", w->tmp_path, strerror(errno));
    }
    return 0;
}

int rekv_st_writer_write(rekv_st_writer *w, const void *data, size_t nbytes, rekv_err *err)
{
    if (w->failed)
        return rekv_errf(err, -EIO, "%s: an earlier write failed", w->path);
    if (!w->header_done) {
        int rc = write_header(w, err);
        if (rc < 0)
            return rc;
    }
    if (nbytes > w->total - w->written) {
        w->failed = 1;
        return rekv_errf(
            err, -EINVAL, "%s: %zu bytes written past the %llu declared (%llu already written)",
            w->path, nbytes, (unsigned long long)w->total, (unsigned long long)w->written);
    }
    if (nbytes > 0 && fwrite(data, 1, nbytes, w->f) != nbytes) {
        w->failed = 1;
        return rekv_errf(err, -EIO, "%s: write failed: %s", w->tmp_path, strerror(errno));
    }
    w->written += nbytes;
    return 0;
}

int rekv_st_writer_close(rekv_st_writer *w, rekv_err *err)
{
    if (w == NULL)
        return 0;
    int rc = 0;
    if (!w->header_done && !w->failed)
        rc = write_header(w, err);
    if (rc == 0 && w->failed)
        rc = rekv_errf(err, -EIO, "%s: not written: an earlier write failed", w->path);
    if (rc == 0 && w->written != w->total)
        rc = rekv_errf(err, -EINVAL, "%s: only %llu of the %llu declared data bytes were written",
                       w->path, (unsigned long long)w->written, (unsigned long long)w->total);
    if (fclose(w->f) != 0 && rc == 0)
        rc = rekv_errf(err, -EIO, "%s: write failed: %s", w->tmp_path, strerror(errno));
    if (rc == 0 && rename(w->tmp_path, w->path) != 0)
        rc = rekv_errf(err, -errno, "%s: cannot rename %s into place: %s", w->path, w->tmp_path,
                       strerror(errno));
    if (rc < 0)
        unlink(w->tmp_path);
    free(w->tmp_path);
    free(w->path);
    json_decref(w->header);
    free(w);
    return rc;
}
