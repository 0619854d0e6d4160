/* tokenizer_decode.c — token ids back to text: byte-level pieces through the GPT-2 byte map,
 * char BPE's replacements and byte-fallback pieces, llama2.c's leading-space rule; special tokens
 * are skipped, added ones written as they are. */
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- decode */

typedef struct str_buf {
    char *s;
    size_t n, cap;
} str_buf;

static int sb_put(str_buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->s, cap);
        if (p == NULL)
            return -ENOMEM;
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
    return 0;
}

/* The byte of a "<0xNN>" piece, or -1. */
static int byte_piece(const tok_piece *p)
{
    if (p->len != 6 || memcmp(p->s, "<0x", 3) != 0 || p->s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char ch = p->s[i];
        int d = ch >= '0' && ch <= '9'   ? ch - '0'
                : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10
                : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                                         : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Byte-level piece: each character back through the inverse byte map; others copied. */
static int decode_byte_piece(const rekv_tokenizer *tok, const tok_piece *p, str_buf *b)
{
    const unsigned char *s = (const unsigned char *)p->s;
    for (size_t i = 0; i < p->len;) {
        int cl = tok_utf8_len(s + i, p->len - i);
        uint32_t cp = 0;
        if (cl == 1)
            cp = s[i];
        else if (cl == 2)
            cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
        else
            cp = UINT32_MAX;
        if (cl == 0)
            cl = 1;
        if (cp < sizeof(tok->cp_byte) / sizeof(tok->cp_byte[0]) && tok->cp_byte[cp] >= 0) {
            char ch = (char)tok->cp_byte[cp];
            if (sb_put(b, &ch, 1) != 0)
                return -ENOMEM;
        } else if (sb_put(b, (const char *)s + i, (size_t)cl) != 0) {
            return -ENOMEM;
        }
        i += (size_t)cl;
    }
    return 0;
}

int rekv_tokenizer_decode(const rekv_tokenizer *tok, const int32_t *ids, size_t n_ids, char **text,
                          size_t *len, rekv_err *err)
{
    if (tok == NULL || text == NULL || (ids == NULL && n_ids > 0))
        return rekv_errf(err, -EINVAL, "tokenizer: decode called with a NULL argument");
    *text = NULL;
    if (len != NULL)
        *len = 0;
    str_buf b = {0};
    int rc = sb_put(&b, "", 0);
    int32_t prev = -1;
    for (size_t k = 0; k < n_ids && rc == 0; k++) {
        int32_t id = ids[k];
        if (id < 0 || id >= tok->n_vocab || tok->pieces[id].s == NULL) {
            free(b.s);
            return rekv_errf(err, -EINVAL,
                             "tokenizer: id %d at position %zu is not in the "
                             "vocabulary of %d",
                             (int)id, k, (int)tok->n_vocab);
        }
        const tok_piece *p = &tok->pieces[id];
        int after_bos = prev >= 0 && prev == tok->bos_id;
        prev = id;
        if (p->kind == TOK_PIECE_SPECIAL)
            continue;
        if (p->kind == TOK_PIECE_ADDED) {
            rc = sb_put(&b, p->s, p->len);
            continue;
        }
        if (tok->kind == TOK_BYTE_BPE) {
            rc = decode_byte_piece(tok, p, &b);
            continue;
        }
        int byte = (tok->dec_bytes || tok->kind == TOK_LLAMA2C) ? byte_piece(p) : -1;
        if (byte >= 0) {
            char ch = (char)byte;
            rc = sb_put(&b, &ch, 1);
        } else if (tok->kind == TOK_LLAMA2C) {
            size_t skip = after_bos && p->s[0] == ' ' ? 1 : 0;
            rc = sb_put(&b, p->s + skip, p->len - skip);
        } else if (tok->dec_from_len > 0) {
            for (size_t i = 0; i < p->len && rc == 0;) {
                if (i + tok->dec_from_len <= p->len &&
                    memcmp(p->s + i, tok->dec_from, tok->dec_from_len) == 0) {
                    rc = sb_put(&b, tok->dec_to, tok->dec_to_len);
                    i += tok->dec_from_len;
                } else {
                    rc = sb_put(&b, p->s + i, 1);
                    i++;
                }
            }
        } else {
            rc = sb_put(&b, p->s, p->len);
        }
    }
    if (rc != 0) {
        free(b.s);
        return rekv_errf(err, -ENOMEM, "tokenizer: out of memory while decoding");
    }
    size_t skip = 0;
    while ((int)skip < tok->dec_strip && skip < b.n && b.s[skip] == ' ')
        skip++;
    if (skip > 0) {
        memmove(b.s, b.s + skip, b.n - skip + 1);
        b.n -= skip;
    }
    *text = b.s;
    if (len != NULL)
        *len = b.n;
    return 0;
}
