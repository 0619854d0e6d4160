/* tokenizer_gguf.c — a GGUF file's own tokenizer (tokenizer.ggml.*) as a rekv tokenizer, built
 * from the same tables as the other loaders (tokenizer.c) and run by the same engine:
 *
 * - "gpt2" (byte-level BPE): tokens in id order, merges ranked by their order ("a b" per entry),
 *   the GPT-2 byte map, and the pre-tokenizer regex tokenizer.ggml.pre names; only "gpt-2" (the
 *   GPT-2 regex) is known here — others are refused naming the key rather than split wrongly.
 * - "llama" (SentencePiece BPE): tokens with their scores, merged by the score of the merged piece
 *   as llama.cpp's SPM tokenizer and llama2.c's run.c both do, so this is the llama2.c engine
 *   (TOK_LLAMA2C) with "▁" read as a space, a dummy-prefix space (tokenizer.ggml.add_space_prefix,
 *   default on) and <0xNN> byte fallback.
 *
 * token_type marks CONTROL tokens (special: matched in text, skipped by decode), USER_DEFINED
 * (added: matched, decoded as written) and UNKNOWN (the unk id). */
#define _GNU_SOURCE
#include "loader/gguf.h"
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { GGUF_TOK_NORMAL = 1, GGUF_TOK_UNKNOWN = 2, GGUF_TOK_CONTROL = 3, GGUF_TOK_USER = 4 };

static const char k_space_mark[] = "\xe2\x96\x81"; /* U+2581, SentencePiece's space */

/* An array key of n elements (n == 0: any length), or -EINVAL naming it. optional: absent is 0. */
static int get_array(const rekv_gguf *g, const char *key, uint64_t n, int optional,
                     const rekv_gguf_kv **out, rekv_err *err)
{
    *out = rekv_gguf_kv_find(g, key);
    if (*out == NULL)
        return optional ? 0
                        : rekv_errf(err, -EINVAL, "%s: metadata \"%s\" is missing", g->path, key);
    if ((*out)->type != REKV_GGUF_ARRAY)
        return rekv_errf(err, -EINVAL, "%s: metadata \"%s\" is a %s, not an array", g->path, key,
                         rekv_gguf_vtype_name((*out)->type));
    if (n && (*out)->n != n)
        return rekv_errf(err, -EINVAL,
                         "%s: metadata \"%s\" has %llu entries, but tokenizer.ggml.tokens has %llu",
                         g->path, key, (unsigned long long)(*out)->n, (unsigned long long)n);
    return 0;
}

/* The pieces (llama: "▁" as a space) with their scores and kinds. */
static int load_pieces(rekv_tokenizer *tok, const rekv_gguf *g, int spm, rekv_err *err)
{
    const rekv_gguf_kv *tokens, *scores, *types;
    int rc = get_array(g, "tokenizer.ggml.tokens", 0, 0, &tokens, err);
    if (rc)
        return rc;
    if (tokens->elem_type != REKV_GGUF_STRING || tokens->n == 0 || tokens->n > TOK_MAX_VOCAB)
        return rekv_errf(err, -EINVAL,
                         "%s: metadata \"tokenizer.ggml.tokens\" must be 1 to %d strings", g->path,
                         TOK_MAX_VOCAB);
    if ((rc = get_array(g, "tokenizer.ggml.scores", tokens->n, 1, &scores, err)) ||
        (rc = get_array(g, "tokenizer.ggml.token_type", tokens->n, 1, &types, err)))
        return rc;
    for (uint64_t i = 0; i < tokens->n; i++) {
        const char *s;
        size_t len;
        rekv_gguf_kv_str(tokens, i, &s, &len);
        double score = 0;
        int64_t type = GGUF_TOK_NORMAL;
        if (scores && (rekv_gguf_kv_float(scores, i, &score) != 0 || !isfinite(score)))
            return rekv_errf(err, -EINVAL,
                             "%s: metadata \"tokenizer.ggml.scores\" entry %llu is not a finite "
                             "float",
                             g->path, (unsigned long long)i);
        if (types && rekv_gguf_kv_int(types, i, &type) != 0)
            return rekv_errf(err, -EINVAL,
                             "%s: metadata \"tokenizer.ggml.token_type\" entry %llu is not an "
                             "integer",
                             g->path, (unsigned long long)i);
        char *conv = NULL;
        if (spm && type != GGUF_TOK_CONTROL && type != GGUF_TOK_USER &&
            memmem(s, len, k_space_mark, 3) != NULL) {
            conv = tok_str_rewrite(NULL, 0, s, len, k_space_mark, 3, " ", 1, &len);
            if (conv == NULL)
                return rekv_errf(err, -ENOMEM, "%s: out of memory", g->path);
            s = conv;
        }
        /* the kind is set by tok_special_add below, which registers the piece for matching */
        rc = tok_set_piece(tok, (int64_t)i, s, len, (float)score, TOK_PIECE_NORMAL, g->path, err);
        free(conv);
        if (rc)
            return rc;
        if (type == GGUF_TOK_UNKNOWN && tok->unk_id < 0)
            tok->unk_id = (int)i;
    }
    if ((rc = tok_index_build(tok, g->path, err)))
        return rc;
    for (int32_t i = 0; types != NULL && i < tok->n_vocab; i++) {
        int64_t type = GGUF_TOK_NORMAL;
        rekv_gguf_kv_int(types, (uint64_t)i, &type);
        int kind = type == GGUF_TOK_CONTROL ? TOK_PIECE_SPECIAL
                   : type == GGUF_TOK_USER  ? TOK_PIECE_ADDED
                                            : TOK_PIECE_NORMAL;
        if (kind != TOK_PIECE_NORMAL && (rc = tok_special_add(tok, i, kind, g->path, err)))
            return rc;
    }
    tok_specials_finish(tok);
    return 0;
}

/* BPE merges: "left right", ranked by position. */
static int load_merges(rekv_tokenizer *tok, const rekv_gguf *g, rekv_err *err)
{
    const rekv_gguf_kv *merges;
    int rc = get_array(g, "tokenizer.ggml.merges", 0, 0, &merges, err);
    if (rc)
        return rc;
    if (merges->elem_type != REKV_GGUF_STRING || merges->n > INT32_MAX)
        return rekv_errf(err, -EINVAL, "%s: metadata \"tokenizer.ggml.merges\" is not strings",
                         g->path);
    for (uint64_t i = 0; i < merges->n; i++) {
        const char *s, *sp;
        size_t n;
        rekv_gguf_kv_str(merges, i, &s, &n);
        /* the split is at the first space after the first byte, as llama.cpp splits */
        sp = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;
        int32_t a = sp ? tok_lookup(tok, s, (size_t)(sp - s)) : -1;
        int32_t b = sp ? tok_lookup(tok, sp + 1, n - (size_t)(sp + 1 - s)) : -1;
        int32_t m = -1;
        if (a >= 0 && b >= 0 && n - 1 <= TOK_MAX_PIECE) {
            char cat[TOK_MAX_PIECE];
            size_t la = (size_t)(sp - s), lb = n - la - 1;
            memcpy(cat, s, la);
            memcpy(cat + la, sp + 1, lb);
            m = tok_lookup(tok, cat, la + lb);
        }
        if (m < 0)
            return rekv_errf(err, -EINVAL,
                             "%s: metadata \"tokenizer.ggml.merges\" entry %llu (\"%.*s\") is not "
                             "two tokens whose join is a token",
                             g->path, (unsigned long long)i, (int)(n < 64 ? n : 64), s);
        if ((rc = tok_pair_add(tok, a, b, (int32_t)i, m, g->path, err)))
            return rc;
    }
    return 0;
}

static int build_gpt2(rekv_tokenizer *tok, const rekv_gguf *g, rekv_err *err)
{
    const char *pre = "gpt-2";
    size_t n = 5;
    int rc;
    if (rekv_gguf_kv_find(g, "tokenizer.ggml.pre") &&
        (rc = rekv_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &n, err)))
        return rc;
    if (!(n == 5 && memcmp(pre, "gpt-2", 5) == 0))
        return rekv_errf(
            err, -ENOTSUP,
            "%s: metadata \"tokenizer.ggml.pre\" = \"%.*s\": that pre-tokenizer is not "
            "supported (gpt-2 is)",
            g->path, (int)(n < 64 ? n : 64), pre);
    if ((rc = load_pieces(tok, g, 0, err)) || (rc = load_merges(tok, g, err)))
        return rc;
    tok_byte_level_init(tok);
    for (int b = 0; b < 256; b++)
        if (tok->byte_id[b] < 0)
            return rekv_errf(err, -EINVAL,
                             "%s: metadata \"tokenizer.ggml.tokens\" lacks the byte-level token "
                             "of byte %d",
                             g->path, b);
    if ((rc = tok_regex_set(tok, TOK_GPT2_PATTERN, PCRE2_ZERO_TERMINATED, 0, g->path, err)))
        return rc;
    return tok_cache_create(tok, g->path, err);
}

static int build_spm(rekv_tokenizer *tok, const rekv_gguf *g, rekv_err *err)
{
    int rc = load_pieces(tok, g, 1, err);
    if (rc)
        return rc;
    int prefix = 1;
    if (rekv_gguf_kv_find(g, "tokenizer.ggml.add_space_prefix") &&
        (rc = rekv_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &prefix, err)))
        return rc;
    tok->dummy_prefix = prefix;
    tok->byte_fallback = 1;
    tok->dec_bytes = 1;
    tok_byte_fallback_init(tok);
    int64_t bos = -1;
    if (rekv_gguf_kv_find(g, "tokenizer.ggml.bos_token_id") &&
        rekv_gguf_get_i64(g, "tokenizer.ggml.bos_token_id", &bos, NULL) == 0 && bos >= 0 &&
        bos < tok->n_vocab)
        tok->bos_id = (int)bos; /* decode drops the dummy prefix's space after it */
    return 0;
}

int rekv_tokenizer_load_gguf(const rekv_gguf *g, rekv_tokenizer **out, rekv_err *err)
{
    *out = NULL;
    const char *model;
    size_t n;
    int rc = rekv_gguf_get_str(g, "tokenizer.ggml.model", &model, &n, err);
    if (rc)
        return rc;
    int gpt2 = n == 4 && memcmp(model, "gpt2", 4) == 0;
    int spm = n == 5 && memcmp(model, "llama", 5) == 0;
    if (!gpt2 && !spm)
        return rekv_errf(err, -ENOTSUP,
                         "%s: metadata \"tokenizer.ggml.model\" = \"%.*s\" is not supported (gpt2 "
                         "and llama are)",
                         g->path, (int)(n < 64 ? n : 64), model);
    rekv_tokenizer *tok = tok_new(gpt2 ? TOK_BYTE_BPE : TOK_LLAMA2C);
    if (tok == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", g->path);
    rc = gpt2 ? build_gpt2(tok, g, err) : build_spm(tok, g, err);
    if (rc) {
        rekv_tokenizer_free(tok);
        return rc;
    }
    *out = tok;
    return 0;
}

int rekv_tokenizer_load_gguf_file(const char *path, rekv_tokenizer **out, rekv_err *err)
{
    rekv_gguf *g;
    int rc = rekv_gguf_open(path, &g, err);
    if (rc)
        return rc;
    rc = rekv_tokenizer_load_gguf(g, out, err);
    rekv_gguf_close(g);
    return rc;
}
