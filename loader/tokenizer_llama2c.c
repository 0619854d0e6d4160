/* tokenizer_llama2c.c — loads llama2.c's tokenizer.bin.
 *
 * Format (little-endian): int32 max_token_length, then for every token: float32 score, int32 len,
 * len bytes. The vocabulary size is not stored; the file is read to its end. Ids 0, 1, 2 are
 * <unk>, <s>, </s> (SentencePiece's convention, which llama2.c's run.c relies on) and 3..258 the
 * <0xNN> byte-fallback pieces. */
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FILE_BYTES (1L << 30)

static int read_le32(const unsigned char *p) /* the file's byte order, not the host's */
{
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    int32_t s;
    memcpy(&s, &v, sizeof(s));
    return s;
}

int rekv_tokenizer_load_llama2c(const char *path, rekv_tokenizer **out, rekv_err *err)
{
    if (path == NULL || out == NULL)
        return rekv_errf(err, -EINVAL, "tokenizer: load_llama2c called with a NULL argument");
    *out = NULL;
    unsigned char *data = NULL;
    rekv_tokenizer *tok = NULL;
    int rc = 0;
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0)
        size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        rc = rekv_errf(err, -EIO, "%s: cannot determine the file size", path);
        goto out;
    }
    if (size > MAX_FILE_BYTES) {
        rc = rekv_errf(err, -EFBIG, "%s: %ld bytes is too large for a tokenizer", path, size);
        goto out;
    }
    data = malloc(size > 0 ? (size_t)size : 1);
    if (data == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    if (fread(data, 1, (size_t)size, f) != (size_t)size) {
        rc = rekv_errf(err, -EIO, "%s: read failed", path);
        goto out;
    }
    if (size < 4) {
        rc = rekv_errf(err, -EINVAL, "%s: truncated: no max_token_length header", path);
        goto out;
    }
    int max_len = read_le32(data);
    if (max_len <= 0 || max_len > TOK_MAX_PIECE) {
        rc = rekv_errf(err, -EINVAL, "%s: max_token_length %d is out of range [1, %d]", path,
                       max_len, TOK_MAX_PIECE);
        goto out;
    }
    tok = tok_new(TOK_LLAMA2C);
    if (tok == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    size_t off = 4;
    int64_t id = 0;
    while (off < (size_t)size) {
        if ((size_t)size - off < 8) {
            rc = rekv_errf(err, -EINVAL, "%s: truncated in the header of token %lld", path,
                           (long long)id);
            goto out;
        }
        float score;
        uint32_t bits = (uint32_t)read_le32(data + off);
        memcpy(&score, &bits, sizeof(score));
        int len = read_le32(data + off + 4);
        off += 8;
        if (!isfinite(score)) {
            rc = rekv_errf(err, -EINVAL, "%s: token %lld has a non-finite score", path,
                           (long long)id);
            goto out;
        }
        if (len < 0 || len > max_len) {
            rc = rekv_errf(err, -EINVAL, "%s: token %lld has length %d, outside [0, %d]", path,
                           (long long)id, len, max_len);
            goto out;
        }
        if ((size_t)size - off < (size_t)len) {
            rc = rekv_errf(err, -EINVAL, "%s: truncated in the bytes of token %lld", path,
                           (long long)id);
            goto out;
        }
        rc = tok_set_piece(tok, id, (const char *)data + off, (size_t)len, score, TOK_PIECE_NORMAL,
                           path, err);
        if (rc != 0)
            goto out;
        off += (size_t)len;
        id++;
    }
    if (id < 3) {
        rc = rekv_errf(err, -EINVAL, "%s: only %lld tokens; <unk>, <s>, </s> are required", path,
                       (long long)id);
        goto out;
    }
    if ((rc = tok_index_build(tok, path, err)) != 0)
        goto out;
    for (int32_t i = 0; i < 3; i++)
        tok->pieces[i].kind = TOK_PIECE_SPECIAL; /* skipped by decode; not matched in text */
    tok->unk_id = 0;
    tok->bos_id = 1;
    tok->dummy_prefix = 1;
    tok->byte_fallback = 1;
    tok->dec_bytes = 1;
    /* run.c falls back to id 3 + byte; use it only when those really are the byte pieces */
    tok_byte_fallback_init(tok);
    for (int b = 0; b < 256; b++)
        if (tok->byte_id[b] != 3 + b)
            tok->byte_id[b] = -1;
out:
    if (f != NULL)
        fclose(f);
    free(data);
    if (rc != 0) {
        rekv_tokenizer_free(tok);
        return rc;
    }
    *out = tok;
    return 0;
}
