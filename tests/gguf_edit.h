/* gguf_edit.h — test helpers for GGUF files: one rewritten with its metadata edited and,
 * optionally, its F16 tensors converted to another dtype (tests/test_gguf_model.c,
 * tests/test_gguf_forward.c); a tensor's dequantized values against llama.cpp's checksums
 * (tests/test_gguf.c, tests/test_qdecode.c). */
#ifndef REKV_TESTS_GGUF_EDIT_H
#define REKV_TESTS_GGUF_EDIT_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* One change to the metadata: key set to a scalar (u32, f32 or string) or dropped (type -1); a
 * key that is not there is added. rename_tensor/new_name renames a tensor instead; add_tensor
 * adds a one-dimensional F32 tensor of add_n values add_f32 after the others. */
typedef struct tg_edit {
    const char *key;
    int type; /* REKV_GGUF_U32, _F32, _STRING; -1 drops the key */
    uint32_t u;
    float f;
    const char *s;
    const char *rename_tensor, *new_name;
    const char *add_tensor;
    const float *add_f32;
    uint64_t add_n;
} tg_edit;

/* How tg_rewrite converts matrices: F16 ones, or with TG_DEQUANT_F32 every one (vectors stay as
 * they are). */
enum {
    TG_KEEP = -1,
    TG_TO_F32 = 0,          /* widened exactly */
    TG_TO_BF16 = 1,         /* rounded to nearest even */
    TG_TO_F32_VIA_BF16 = 2, /* F32 holding exactly TG_TO_BF16's values */
    TG_DEQUANT_F32 = 3,     /* every matrix, quantized ones too, as F32 (loader's dequantization) */
};

/* Writes src with the edits applied and F16 tensors converted (TG_*) to dir/edited.gguf and
 * returns that path (static storage). Fails the calling test on any error. */
const char *tg_rewrite(const char *src, const tg_edit *edits, size_t n_edits, int convert,
                       const char *dir);

/* y, the numel values of tensor `name` of `file` dequantized (ggml type `type`), against r, its
 * entry in ../shared/gguf's ref.json (llama.cpp's first8 exactly, sum within 1e-6, sumsq within
 * 1e-9 relative). Fails the calling test naming the file, tensor and type. */
void tg_check_llama_checksums(const char *file, const char *name, uint32_t type,
                              const json_t *r, const float *y, uint64_t numel);

#endif
