/* gguf.h — reading GGUF files (llama.cpp's model format, versions 2 and 3): the parsed file, its
 * metadata, its tensors, their dequantization (gguf_quant.c), and the mapping of a llama-family
 * GGUF onto rekv's model config, weights (gguf_model.c) and tokenizer (tokenizer_gguf.c).
 *
 * The file is mmap'd read-only; keys, values and tensor data point into the mapping, so a parsed
 * file lives as long as its rekv_gguf. Opening checks every count, length, offset and size against
 * the file, so that nothing read later can run past it. Every function returns 0 or a negative
 * errno and fills the rekv_err with one line naming the file and the field at fault. */
#ifndef REKV_LOADER_GGUF_H
#define REKV_LOADER_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "loader/loader.h"

/* ---------------------------------------------------------------- tensor types */

/* ggml's tensor type numbers, as stored in a GGUF tensor info. */
typedef enum rekv_ggml_type {
    REKV_GGML_F32 = 0,
    REKV_GGML_F16 = 1,
    REKV_GGML_Q4_0 = 2,
    REKV_GGML_Q4_1 = 3,
    REKV_GGML_Q5_0 = 6,
    REKV_GGML_Q5_1 = 7,
    REKV_GGML_Q8_0 = 8,
    REKV_GGML_Q8_1 = 9,
    REKV_GGML_Q2_K = 10,
    REKV_GGML_Q3_K = 11,
    REKV_GGML_Q4_K = 12,
    REKV_GGML_Q5_K = 13,
    REKV_GGML_Q6_K = 14,
    REKV_GGML_Q8_K = 15,
    REKV_GGML_IQ4_NL = 20,
    REKV_GGML_IQ4_XS = 23,
    REKV_GGML_I8 = 24,
    REKV_GGML_I16 = 25,
    REKV_GGML_I32 = 26,
    REKV_GGML_I64 = 27,
    REKV_GGML_F64 = 28,
    REKV_GGML_BF16 = 30,
} rekv_ggml_type;

/* ggml's name of a type ("f16", "q4_K"), or NULL for a type rekv does not know. */
const char *rekv_ggml_type_name(uint32_t type);
/* Elements per block and bytes per block; 0 and 0 for an unknown type. */
void rekv_ggml_type_block(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes);
/* 1 when rekv_gguf_dequant can turn the type into float32. */
int rekv_ggml_type_dequantizable(uint32_t type);
/* 1 for the block types a model's matrices may keep (Q8_0, Q4_0, Q4_K, Q6_K): the engine
 * multiplies with them as they are stored (rekv_tensor.qtype). */
static inline int rekv_gguf_matrix_type(uint32_t type)
{
    return type == REKV_GGML_Q8_0 || type == REKV_GGML_Q4_0 || type == REKV_GGML_Q4_K ||
           type == REKV_GGML_Q6_K;
}

/* ---------------------------------------------------------------- metadata */

typedef enum rekv_gguf_vtype {
    REKV_GGUF_U8 = 0,
    REKV_GGUF_I8 = 1,
    REKV_GGUF_U16 = 2,
    REKV_GGUF_I16 = 3,
    REKV_GGUF_U32 = 4,
    REKV_GGUF_I32 = 5,
    REKV_GGUF_F32 = 6,
    REKV_GGUF_BOOL = 7,
    REKV_GGUF_STRING = 8,
    REKV_GGUF_ARRAY = 9,
    REKV_GGUF_U64 = 10,
    REKV_GGUF_I64 = 11,
    REKV_GGUF_F64 = 12,
} rekv_gguf_vtype;

/* "uint32", "string", "array", ... ; "?" for an invalid number. */
const char *rekv_gguf_vtype_name(uint32_t vtype);

typedef struct rekv_gguf_kv {
    char *key;          /* NUL-terminated copy */
    uint32_t type;      /* rekv_gguf_vtype */
    uint32_t elem_type; /* arrays: the elements' type; else == type */
    uint64_t n;         /* arrays: element count; else 1 */
    const uint8_t
        *value; /* into the mapping: the scalar, the string's length, or the first element */
    const uint8_t *
        *elems; /* arrays of strings or arrays: [n] pointers to each element; else NULL */
} rekv_gguf_kv;

/* ---------------------------------------------------------------- tensors */

#define REKV_GGUF_MAX_DIMS 4

typedef struct rekv_gguf_tensor {
    char *name;    /* NUL-terminated copy */
    uint32_t type; /* rekv_ggml_type */
    int n_dims;
    uint64_t ne[REKV_GGUF_MAX_DIMS]; /* ne[0] = row length (fastest); unused dims 1 */
    uint64_t numel;
    uint64_t offset; /* absolute byte offset of the data in the file */
    size_t nbytes;
    const void *data; /* into the mapping */
} rekv_gguf_tensor;

typedef struct rekv_gguf {
    char *path;
    const uint8_t *map; /* the whole file, read-only */
    size_t len;
    uint32_t version;
    uint32_t alignment;   /* general.alignment, 32 when absent */
    uint64_t data_offset; /* where tensor data begins (a multiple of alignment) */
    rekv_gguf_kv *kvs;
    size_t n_kvs;
    rekv_gguf_tensor *tensors;
    size_t n_tensors;
} rekv_gguf;

/* 1 when the file at path begins with the GGUF magic. */
int rekv_gguf_is_gguf(const char *path);
int rekv_gguf_open(const char *path, rekv_gguf **out, rekv_err *err);
void rekv_gguf_close(rekv_gguf *g);

/* NULL when absent. */
const rekv_gguf_kv *rekv_gguf_kv_find(const rekv_gguf *g, const char *key);
const rekv_gguf_tensor *rekv_gguf_tensor_find(const rekv_gguf *g, const char *name);

/* Typed reads of a key. Integers of any integer type are accepted when the value fits; floats
 * accept F32/F64. -ENOENT (with a message) when the key is absent, -EINVAL when its type or value
 * does not fit. */
int rekv_gguf_get_i64(const rekv_gguf *g, const char *key, int64_t *out, rekv_err *err);
int rekv_gguf_get_f64(const rekv_gguf *g, const char *key, double *out, rekv_err *err);
int rekv_gguf_get_bool(const rekv_gguf *g, const char *key, int *out, rekv_err *err);
/* The string's bytes (not NUL-terminated) and length. */
int rekv_gguf_get_str(const rekv_gguf *g, const char *key, const char **s, size_t *len,
                      rekv_err *err);
/* Scalar element i of an array (or the scalar itself with i == 0) as int64 / double. */
int rekv_gguf_kv_int(const rekv_gguf_kv *kv, uint64_t i, int64_t *out);
int rekv_gguf_kv_float(const rekv_gguf_kv *kv, uint64_t i, double *out);
/* String element i of an array of strings (or the string itself with i == 0). */
int rekv_gguf_kv_str(const rekv_gguf_kv *kv, uint64_t i, const char **s, size_t *len);

/* ---------------------------------------------------------------- dequantization (gguf_quant.c) */

/* Dequantizes n elements of type `type` (whole blocks) at src into dst: 0, -ENOTSUP for a type it
 * cannot read, -EINVAL when n is not whole blocks (rekv_gguf_dequant is this on a tensor). */
int rekv_ggml_dequant_row(uint32_t type, const void *src, uint64_t n, float *dst);
/* Dequantizes elements [first, first + n) of t into dst as float32, exactly as ggml's to_float.
 * first and n must be multiples of the type's block size. */
int rekv_gguf_dequant(const rekv_gguf_tensor *t, uint64_t first, uint64_t n, float *dst,
                      rekv_err *err);

/* ---------------------------------------------------------------- a llama GGUF as a rekv model */

/* The model config a llama-architecture GGUF describes (gguf_model.c); every key it needs is
 * checked, and the tensors' shapes against it. */
int rekv_gguf_config(const rekv_gguf *g, rekv_model_config *out, rekv_err *err);
/* Opens path as a rekv_model (called by rekv_model_open for GGUF files). */
int rekv_model_open_gguf(const char *path, rekv_model **out, rekv_err *err);
/* The GGUF's own tokenizer (tokenizer.ggml.*) as a rekv tokenizer (tokenizer_gguf.c). */
int rekv_tokenizer_load_gguf(const rekv_gguf *g, rekv_tokenizer **out, rekv_err *err);
/* The same from a path (rekv_tokenizer_load_for_model's choice for a GGUF file). */
int rekv_tokenizer_load_gguf_file(const char *path, rekv_tokenizer **out, rekv_err *err);

#endif
