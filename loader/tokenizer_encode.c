/* tokenizer_encode.c — text to token ids: the BPE merge engine shared by every tokenizer family,
 * its word cache, and the pre-tokenizers around it.
 *
 * Encoding: special/added token strings are cut out of the text first; each remaining segment is
 * normalized (tokenizer.json normalizers, both BPE kinds: tokenizer_normalize.c), split into words
 * by the pre-tokenizer (regex for byte-level, Metaspace for char BPE), turned into initial symbols,
 * and merged. Merging keeps candidate pairs in a min-heap ordered by (priority, position), so a
 * word of n symbols costs O(n log n) rather than a rescan per merge. */
#define _GNU_SOURCE
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- word cache */

#define CACHE_BUCKETS 4096
#define CACHE_MAX_ENTRIES 65536
#define CACHE_MAX_WORD 64

typedef struct cache_entry {
    struct cache_entry *next;
    uint32_t word_len, n_ids;
    int32_t *ids; /* points into the same allocation, after the word */
    char word[];
} cache_entry;

struct tok_cache {
    pthread_mutex_t lock;
    size_t n;
    cache_entry *buckets[CACHE_BUCKETS];
};

int tok_cache_create(rekv_tokenizer *tok, const char *path, rekv_err *err)
{
    tok_cache *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    pthread_mutex_init(&c->lock, NULL);
    tok->cache = c;
    return 0;
}

static void cache_clear(tok_cache *c)
{
    for (size_t i = 0; i < CACHE_BUCKETS; i++) {
        cache_entry *e = c->buckets[i];
        while (e != NULL) {
            cache_entry *nx = e->next;
            free(e);
            e = nx;
        }
        c->buckets[i] = NULL;
    }
    c->n = 0;
}

void tok_cache_free(tok_cache *c)
{
    if (c == NULL)
        return;
    cache_clear(c);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* ---------------------------------------------------------------- encode */

typedef struct id_vec {
    int32_t *v;
    size_t n, cap;
} id_vec;

static int vec_push(id_vec *v, int32_t x)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->v, cap * sizeof(*p));
        if (p == NULL)
            return -ENOMEM;
        v->v = p;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return 0;
}

typedef struct cand {
    double prio; /* lower merges first */
    int32_t left, right, lid, rid, merged;
} cand;

/* Per-call workspace, reused across the words of one encode call. */
typedef struct enc_ctx {
    const rekv_tokenizer *tok;
    rekv_err *err;
    id_vec *out;
    int32_t *sym, *prev, *next; /* symbols of the current word */
    size_t n_sym, sym_cap;
    cand *heap;
    size_t n_heap, heap_cap;
    char *buf; /* normalization buffer */
    size_t buf_cap;
    pcre2_match_data *md;
} enc_ctx;

static int sym_push(enc_ctx *c, int32_t id)
{
    if (c->n_sym == c->sym_cap) {
        size_t cap = c->sym_cap ? c->sym_cap * 2 : 64;
        int32_t *s = realloc(c->sym, cap * sizeof(*s));
        if (s == NULL)
            return -ENOMEM;
        c->sym = s;
        int32_t *p = realloc(c->prev, cap * sizeof(*p));
        if (p == NULL)
            return -ENOMEM;
        c->prev = p;
        int32_t *n = realloc(c->next, cap * sizeof(*n));
        if (n == NULL)
            return -ENOMEM;
        c->next = n;
        c->sym_cap = cap;
    }
    c->sym[c->n_sym++] = id;
    return 0;
}

static int cand_less(const cand *a, const cand *b)
{
    if (a->prio != b->prio)
        return a->prio < b->prio;
    return a->left < b->left;
}

static int heap_push(enc_ctx *c, cand x)
{
    if (c->n_heap == c->heap_cap) {
        size_t cap = c->heap_cap ? c->heap_cap * 2 : 64;
        cand *h = realloc(c->heap, cap * sizeof(*h));
        if (h == NULL)
            return -ENOMEM;
        c->heap = h;
        c->heap_cap = cap;
    }
    size_t i = c->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&x, &c->heap[p]))
            break;
        c->heap[i] = c->heap[p];
        i = p;
    }
    c->heap[i] = x;
    return 0;
}

static cand heap_pop(enc_ctx *c)
{
    cand top = c->heap[0];
    cand last = c->heap[--c->n_heap];
    size_t i = 0, n = c->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const cand *best = &last;
        if (l < n && cand_less(&c->heap[l], best)) {
            m = l;
            best = &c->heap[l];
        }
        if (r < n && cand_less(&c->heap[r], best))
            m = r;
        if (m == i)
            break;
        c->heap[i] = c->heap[m];
        i = m;
    }
    if (n > 0)
        c->heap[i] = last;
    return top;
}

/* Offers the pair of symbols (l, r) as a merge candidate when the tokenizer knows it. */
static int offer_pair(enc_ctx *c, int32_t l, int32_t r)
{
    const rekv_tokenizer *tok = c->tok;
    int32_t a = c->sym[l], b = c->sym[r];
    cand x = {.left = l, .right = r, .lid = a, .rid = b};
    if (tok->kind == TOK_LLAMA2C) {
        const tok_piece *pa = &tok->pieces[a], *pb = &tok->pieces[b];
        char cat[TOK_MAX_PIECE];
        if ((size_t)pa->len + pb->len > sizeof(cat))
            return 0;
        memcpy(cat, pa->s, pa->len);
        memcpy(cat + pa->len, pb->s, pb->len);
        int32_t id = tok_lookup(tok, cat, (size_t)pa->len + pb->len);
        if (id < 0)
            return 0;
        x.prio = -(double)tok->pieces[id].score;
        x.merged = id;
    } else {
        int32_t rank;
        if (!tok_pair_find(tok, a, b, &rank, &x.merged))
            return 0;
        x.prio = rank;
    }
    return heap_push(c, x);
}

/* Merges the symbols in c->sym[0..n_sym) and appends the result to c->out. */
static int merge_and_emit(enc_ctx *c)
{
    size_t n = c->n_sym;
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++) {
        c->prev[i] = (int32_t)i - 1;
        c->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    c->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++)
        if (offer_pair(c, (int32_t)i, (int32_t)i + 1) != 0)
            return -ENOMEM;
    while (c->n_heap > 0) {
        cand x = heap_pop(c);
        /* stale when either side has merged since the candidate was offered */
        if (c->sym[x.left] != x.lid || c->next[x.left] != x.right || c->sym[x.right] != x.rid)
            continue;
        c->sym[x.left] = x.merged;
        int32_t nx = c->next[x.right];
        c->next[x.left] = nx;
        if (nx >= 0)
            c->prev[nx] = x.left;
        c->sym[x.right] = -1;
        c->next[x.right] = -1;
        if (c->prev[x.left] >= 0 && offer_pair(c, c->prev[x.left], x.left) != 0)
            return -ENOMEM;
        if (nx >= 0 && offer_pair(c, x.left, nx) != 0)
            return -ENOMEM;
    }
    for (int32_t i = 0; i >= 0; i = c->next[i])
        if (vec_push(c->out, c->sym[i]) != 0)
            return -ENOMEM;
    return 0;
}

static int cache_get(enc_ctx *c, const char *w, size_t len)
{
    tok_cache *cache = c->tok->cache;
    if (cache == NULL || len > CACHE_MAX_WORD)
        return 0;
    uint32_t h = tok_hash_bytes(w, len) % CACHE_BUCKETS;
    int found = 0, rc = 0;
    pthread_mutex_lock(&cache->lock);
    for (cache_entry *e = cache->buckets[h]; e != NULL; e = e->next) {
        if (e->word_len == len && memcmp(e->word, w, len) == 0) {
            found = 1;
            for (uint32_t i = 0; i < e->n_ids && rc == 0; i++)
                rc = vec_push(c->out, e->ids[i]);
            break;
        }
    }
    pthread_mutex_unlock(&cache->lock);
    return rc != 0 ? rc : found;
}

/* Remembers that word w encoded to out[from..]. Failure to cache is not an error. */
static void cache_put(enc_ctx *c, const char *w, size_t len, size_t from)
{
    tok_cache *cache = c->tok->cache;
    if (cache == NULL || len > CACHE_MAX_WORD)
        return;
    size_t n_ids = c->out->n - from;
    size_t off = (sizeof(cache_entry) + len + 7) & ~(size_t)7;
    cache_entry *e = malloc(off + n_ids * sizeof(int32_t));
    if (e == NULL)
        return;
    memcpy(e->word, w, len);
    e->word_len = (uint32_t)len;
    e->n_ids = (uint32_t)n_ids;
    e->ids = (int32_t *)((char *)e + off);
    memcpy(e->ids, c->out->v + from, n_ids * sizeof(int32_t));
    uint32_t h = tok_hash_bytes(w, len) % CACHE_BUCKETS;
    pthread_mutex_lock(&cache->lock);
    if (cache->n >= CACHE_MAX_ENTRIES)
        cache_clear(cache); /* bounded memory: start over rather than track recency */
    e->next = cache->buckets[h];
    cache->buckets[h] = e;
    cache->n++;
    pthread_mutex_unlock(&cache->lock);
}

/* Byte-level: one pre-tokenized word (any bytes) -> ids. */
static int encode_byte_word(enc_ctx *c, const char *w, size_t len)
{
    const rekv_tokenizer *tok = c->tok;
    int rc = cache_get(c, w, len);
    if (rc != 0)
        return rc < 0 ? rc : 0;
    size_t from = c->out->n;
    c->n_sym = 0;
    for (size_t i = 0; i < len; i++) {
        int32_t id = tok->byte_id[(unsigned char)w[i]];
        if (id < 0)
            id = tok->unk_id;
        if (id < 0)
            return rekv_errf(c->err, -EINVAL,
                             "tokenizer: byte 0x%02X has no token and there is no unk token",
                             (unsigned char)w[i]);
        if (sym_push(c, id) != 0)
            return -ENOMEM;
    }
    rc = merge_and_emit(c);
    if (rc == 0)
        cache_put(c, w, len, from);
    return rc;
}

/* Char BPE: one word (UTF-8 characters, invalid bytes taken one at a time) -> ids. */
static int encode_char_word(enc_ctx *c, const char *w, size_t len)
{
    const rekv_tokenizer *tok = c->tok;
    if (tok->ignore_merges && tok->kind != TOK_LLAMA2C) {
        int32_t id = tok_lookup(tok, w, len);
        if (id >= 0)
            return vec_push(c->out, id);
    }
    int rc = cache_get(c, w, len);
    if (rc != 0)
        return rc < 0 ? rc : 0;
    size_t from = c->out->n;
    c->n_sym = 0;
    int last_unk = 0;
    for (size_t i = 0; i < len;) {
        int cl = tok_utf8_len((const unsigned char *)w + i, len - i);
        if (cl == 0)
            cl = 1;
        int32_t id = tok_lookup(tok, w + i, (size_t)cl);
        if (id >= 0) {
            rc = sym_push(c, id);
            last_unk = 0;
        } else {
            int all_bytes = tok->byte_fallback || tok->kind == TOK_LLAMA2C;
            for (int k = 0; k < cl && all_bytes; k++)
                all_bytes = tok->byte_id[(unsigned char)w[i + k]] >= 0;
            if (all_bytes) {
                rc = 0;
                for (int k = 0; k < cl && rc == 0; k++)
                    rc = sym_push(c, tok->byte_id[(unsigned char)w[i + k]]);
                last_unk = 0;
            } else if (tok->unk_id >= 0) {
                rc = (tok->fuse_unk && last_unk) ? 0 : sym_push(c, tok->unk_id);
                last_unk = 1;
            } else {
                return rekv_errf(c->err, -EINVAL,
                                 "tokenizer: a character of the text is not in the vocabulary, "
                                 "and there is no byte fallback or unk token");
            }
        }
        if (rc != 0)
            return -ENOMEM;
        i += (size_t)cl;
    }
    rc = merge_and_emit(c);
    if (rc == 0 && tok->kind != TOK_LLAMA2C)
        cache_put(c, w, len, from);
    return rc;
}

static int buf_reserve(enc_ctx *c, size_t n)
{
    if (n <= c->buf_cap)
        return 0;
    size_t cap = c->buf_cap ? c->buf_cap : 256;
    while (cap < n)
        cap *= 2;
    char *b = realloc(c->buf, cap);
    if (b == NULL)
        return -ENOMEM;
    c->buf = b;
    c->buf_cap = cap;
    return 0;
}

/* Splits a valid UTF-8 run with the pre-tokenizer regex; matches and the gaps between them are
 * words (Split behaviour Isolated), or only the gaps (Removed). */
static int split_regex(enc_ctx *c, const char *s, size_t n)
{
    const rekv_tokenizer *tok = c->tok;
    size_t off = 0, gap = 0;
    int rc;
    while (off < n) {
        int m = pcre2_match(tok->re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, c->md, NULL);
        if (m == PCRE2_ERROR_NOMATCH)
            break;
        if (m < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(m, msg, sizeof(msg));
            return rekv_errf(c->err, -EINVAL, "tokenizer: pre-tokenizer regex failed: %s",
                             (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms) { /* empty match: step over one character, it stays in the gap */
            int cl = tok_utf8_len((const unsigned char *)s + ms, n - ms);
            off = ms + (size_t)(cl > 0 ? cl : 1);
            continue;
        }
        if (ms > gap && (rc = encode_byte_word(c, s + gap, ms - gap)) != 0)
            return rc;
        if (!tok->re_removed && (rc = encode_byte_word(c, s + ms, me - ms)) != 0)
            return rc;
        off = gap = me;
    }
    if (gap < n && (rc = encode_byte_word(c, s + gap, n - gap)) != 0)
        return rc;
    return 0;
}

/* Byte-level text after normalization: valid UTF-8 runs go through the regex; each invalid byte
 * is its own word, so any byte string encodes (and decodes back unchanged, less normalization). */
static int encode_byte_text(enc_ctx *c, const char *s, size_t n)
{
    const rekv_tokenizer *tok = c->tok;
    int rc;
    if (tok->add_prefix_space && n > 0 && s[0] != ' ') {
        if (buf_reserve(c, n + 1) != 0)
            return -ENOMEM;
        c->buf[0] = ' ';
        memcpy(c->buf + 1, s, n);
        s = c->buf;
        n++;
    }
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        int cl;
        while (j < n && (cl = tok_utf8_len((const unsigned char *)s + j, n - j)) > 0)
            j += (size_t)cl;
        if (j > i) {
            rc = tok->re ? split_regex(c, s + i, j - i) : encode_byte_word(c, s + i, j - i);
            if (rc != 0)
                return rc;
        }
        if (j < n && (rc = encode_byte_word(c, s + j, 1)) != 0)
            return rc;
        i = j + (j < n);
    }
    return 0;
}

/* Byte-level segment: normalizer ops, then the pre-tokenizer and words. */
static int encode_byte_segment(enc_ctx *c, const char *s, size_t n)
{
    char *work;
    size_t wn;
    int rc = tok_normalize(c->tok, s, n, &work, &wn, c->err);
    if (rc != 0)
        return rc;
    rc = encode_byte_text(c, work ? work : s, wn);
    free(work);
    return rc;
}

/* Char BPE segment: normalizer ops, Metaspace, then words. first: no special precedes it. */
static int encode_char_segment(enc_ctx *c, const char *s, size_t n, int first)
{
    const rekv_tokenizer *tok = c->tok;
    char *work; /* the current text once it has been rewritten, else NULL */
    size_t wn;
    int rc = tok_normalize(c->tok, s, n, &work, &wn, c->err);
    if (rc != 0)
        return rc;
    if (tok->ms_repl != NULL) {
        const char *src = work ? work : s;
        int prepend = tok->ms_prepend == 1 || (tok->ms_prepend == 2 && first);
        if (wn >= tok->ms_repl_len && memcmp(src, tok->ms_repl, tok->ms_repl_len) == 0)
            prepend = 0;
        if (wn == 0)
            prepend = 0;
        char *next = tok_str_rewrite(tok->ms_repl, prepend ? tok->ms_repl_len : 0, src, wn, " ", 1,
                                     tok->ms_repl, tok->ms_repl_len, &wn);
        free(work);
        if ((work = next) == NULL)
            return rekv_errf(c->err, -ENOMEM, "tokenizer: out of memory");
    }
    const char *t = work ? work : s;
    if (tok->ms_repl != NULL && tok->ms_split) {
        size_t start = 0;
        for (size_t i = 1; i + tok->ms_repl_len <= wn && rc == 0; i++) {
            if (memcmp(t + i, tok->ms_repl, tok->ms_repl_len) == 0) {
                rc = encode_char_word(c, t + start, i - start);
                start = i;
            }
        }
        if (rc == 0 && wn > start)
            rc = encode_char_word(c, t + start, wn - start);
    } else if (wn > 0) {
        rc = encode_char_word(c, t, wn);
    }
    free(work);
    return rc;
}

/* llama2.c (run.c): a dummy-prefix space for non-empty text, then one word for all of it. */
static int encode_llama2c(enc_ctx *c, const char *s, size_t n)
{
    if (n == 0)
        return 0;
    if (buf_reserve(c, n + 1) != 0)
        return rekv_errf(c->err, -ENOMEM, "tokenizer: out of memory");
    size_t pos = 0;
    if (c->tok->dummy_prefix)
        c->buf[pos++] = ' ';
    memcpy(c->buf + pos, s, n);
    return encode_char_word(c, c->buf, pos + n);
}

/* The special token starting at s (n bytes left), or -1. */
static int32_t match_special(const rekv_tokenizer *tok, const char *s, size_t n)
{
    if (!tok->special_first[(unsigned char)s[0]])
        return -1;
    for (size_t k = 0; k < tok->n_specials; k++) {
        const tok_piece *p = &tok->pieces[tok->specials[k]];
        if (p->len <= n && memcmp(p->s, s, p->len) == 0)
            return tok->specials[k];
    }
    return -1;
}

int rekv_tokenizer_encode(const rekv_tokenizer *tok, const char *text, size_t len, int bos_id,
                          int32_t **ids, size_t *n_ids, rekv_err *err)
{
    if (tok == NULL || ids == NULL || n_ids == NULL || (text == NULL && len > 0))
        return rekv_errf(err, -EINVAL, "tokenizer: encode called with a NULL argument");
    *ids = NULL;
    *n_ids = 0;
    if (bos_id >= tok->n_vocab)
        return rekv_errf(err, -EINVAL, "tokenizer: bos id %d is outside the vocabulary of %d",
                         bos_id, (int)tok->n_vocab);
    id_vec out = {0};
    enc_ctx c = {.tok = tok, .err = err, .out = &out};
    int rc = 0;
    if (tok->re != NULL) {
        c.md = pcre2_match_data_create_from_pattern(tok->re, NULL);
        if (c.md == NULL) {
            rc = -ENOMEM;
            goto out;
        }
    }
    if (bos_id >= 0 && (rc = vec_push(&out, bos_id)) != 0)
        goto out;
    if (tok->kind == TOK_LLAMA2C) {
        rc = encode_llama2c(&c, text, len);
        goto out;
    }
    size_t seg = 0;
    int first = 1;
    for (size_t i = 0; i <= len;) {
        int32_t sp = i < len ? match_special(tok, text + i, len - i) : -1;
        if (sp < 0 && i < len) {
            i++;
            continue;
        }
        if (i > seg) {
            rc = tok->kind == TOK_BYTE_BPE ? encode_byte_segment(&c, text + seg, i - seg)
                                           : encode_char_segment(&c, text + seg, i - seg, first);
            if (rc != 0)
                goto out;
        }
        if (sp < 0)
            break;
        if ((rc = vec_push(&out, sp)) != 0)
            goto out;
        first = 0;
        i += tok->pieces[sp].len;
        seg = i;
    }
out:
    pcre2_match_data_free(c.md);
    free(c.sym);
    free(c.prev);
    free(c.next);
    free(c.heap);
    free(c.buf);
    if (rc != 0) {
        free(out.v);
        return rc == -ENOMEM ? rekv_errf(err, rc, "tokenizer: out of memory while encoding") : rc;
    }
    if (out.v == NULL && (out.v = malloc(sizeof(int32_t))) == NULL)
        return rekv_errf(err, -ENOMEM, "tokenizer: out of memory while encoding");
    *ids = out.v;
    *n_ids = out.n;
    return 0;
}
