/* tokenizer_normalize.c — tokenizer.json's normalizers (Replace, Prepend, the Unicode normal
 * forms; a Sequence is its steps in order), applied to each segment of text between specials
 * before pre-tokenization, and the string rewrite Metaspace shares with them. */
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/log.h"

/* A malloc'd copy of src (n bytes) with every `from` replaced by `to` and `pre` prepended. */
char *tok_str_rewrite(const char *pre, size_t pre_len, const char *src, size_t n, const char *from,
                      size_t from_len, const char *to, size_t to_len, size_t *out_len)
{
    size_t count = 0;
    for (size_t i = 0; from_len > 0 && i + from_len <= n;) {
        if (memcmp(src + i, from, from_len) == 0) {
            count++;
            i += from_len;
        } else {
            i++;
        }
    }
    size_t cap = pre_len + n + count * to_len + 1;
    char *out = malloc(cap);
    if (out == NULL)
        return NULL;
    size_t pos = pre_len;
    if (pre_len > 0)
        memcpy(out, pre, pre_len);
    for (size_t i = 0; i < n;) {
        if (from_len > 0 && i + from_len <= n && memcmp(src + i, from, from_len) == 0) {
            memcpy(out + pos, to, to_len);
            pos += to_len;
            i += from_len;
        } else {
            out[pos++] = src[i++];
        }
    }
    out[pos] = '\0';
    *out_len = pos;
    return out;
}

static int bytes_reserve(char **b, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    char *p = realloc(*b, c);
    if (p == NULL)
        return -ENOMEM;
    *b = p;
    *cap = c;
    return 0;
}

/* src (n bytes) in a Unicode normal form, into a malloc'd *out (NUL-terminated, *out_len bytes).
 * utf8proc normalizes each maximal run of valid UTF-8; a byte that starts no valid sequence is
 * copied unchanged and ends the run, so a character is never composed across it. HF never sees
 * such bytes (its input is a Rust String); this keeps the engine's rule that any byte string
 * encodes. Returns 0, -ENOMEM, or -EOVERFLOW (a run too long for utf8proc). */
static int str_unicode_normalize(const char *src, size_t n, tok_norm_kind kind, char **out,
                                 size_t *out_len)
{
    utf8proc_option_t opt = UTF8PROC_STABLE;
    opt |= kind == TOK_NORM_NFC || kind == TOK_NORM_NFKC ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE;
    if (kind == TOK_NORM_NFKC || kind == TOK_NORM_NFKD)
        opt |= UTF8PROC_COMPAT;
    char *b = NULL;
    size_t cap = 0, pos = 0;
    int rc = bytes_reserve(&b, &cap, n + 1);
    for (size_t i = 0; i < n && rc == 0;) {
        const unsigned char *u = (const unsigned char *)src;
        size_t j = i;
        int cl;
        while (j < n && (cl = tok_utf8_len(u + j, n - j)) > 0)
            j += (size_t)cl;
        if (j > i) {
            utf8proc_uint8_t *nf = NULL;
            utf8proc_ssize_t r = utf8proc_map(u + i, (utf8proc_ssize_t)(j - i), &nf, opt);
            if (r < 0) {
                /* the run was checked above (tok_utf8_len is as strict as utf8proc) */
                REKV_ASSERT(r != UTF8PROC_ERROR_INVALIDUTF8);
                rc = r == UTF8PROC_ERROR_NOMEM ? -ENOMEM : -EOVERFLOW;
            } else if ((rc = bytes_reserve(&b, &cap, pos + (size_t)r + 1)) == 0) {
                memcpy(b + pos, nf, (size_t)r);
                pos += (size_t)r;
            }
            free(nf);
        }
        if (rc == 0 && j < n) { /* the invalid byte, kept as it is */
            if ((rc = bytes_reserve(&b, &cap, pos + 2)) == 0)
                b[pos++] = src[j];
            j++;
        }
        i = j;
    }
    if (rc != 0) {
        free(b);
        return rc;
    }
    b[pos] = '\0';
    *out = b;
    *out_len = pos;
    return 0;
}

static int has_non_ascii(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80)
            return 1;
    return 0;
}

/* Applies the tokenizer's normalizer ops in order to a segment. *work is NULL when nothing
 * changed the text, else the malloc'd result (*wn bytes); the caller frees it. */
int tok_normalize(const rekv_tokenizer *tok, const char *s, size_t n, char **work, size_t *wn,
                  rekv_err *err)
{
    *work = NULL;
    *wn = n;
    for (size_t k = 0; k < tok->n_norm; k++) {
        const tok_norm_op *op = &tok->norm[k];
        const char *src = *work ? *work : s;
        char *next = NULL;
        switch (op->kind) {
        case TOK_NORM_PREPEND:
            if (*wn == 0)
                continue;
            next = tok_str_rewrite(op->to, op->to_len, src, *wn, NULL, 0, NULL, 0, wn);
            break;
        case TOK_NORM_REPLACE:
            next =
                tok_str_rewrite(NULL, 0, src, *wn, op->from, op->from_len, op->to, op->to_len, wn);
            break;
        case TOK_NORM_NFC:
        case TOK_NORM_NFD:
        case TOK_NORM_NFKC:
        case TOK_NORM_NFKD: {
            if (!has_non_ascii(src, *wn))
                continue;
            int rc = str_unicode_normalize(src, *wn, op->kind, &next, wn);
            if (rc == -EOVERFLOW) {
                free(*work);
                *work = NULL;
                return rekv_errf(err, rc, "tokenizer: text too long to normalize (%zu bytes)", n);
            }
            break;
        }
        }
        free(*work);
        if ((*work = next) == NULL)
            return rekv_errf(err, -ENOMEM, "tokenizer: out of memory");
    }
    return 0;
}
