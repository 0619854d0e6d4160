/* tokenizer.c — the tokenizer core: piece and merge tables, the BPE merge engine shared by every
 * tokenizer family, encode/decode, and picking a model's tokenizer files.
 *
 * Encoding: special/added token strings are cut out of the text first; each remaining segment is
 * normalized (tokenizer.json normalizers, both BPE kinds), split into words by the pre-tokenizer
 * (regex for byte-level, Metaspace for char BPE), turned into initial symbols, and merged. Merging
 * keeps candidate pairs in a min-heap ordered by (priority, position), so a word of n symbols costs
 * O(n log n) rather than a rescan per merge. */
#define _GNU_SOURCE
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <utf8proc.h>

/* ---------------------------------------------------------------- hashing */

static uint32_t hash_bytes(const char *s, size_t len)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 16777619u;
    }
    return h;
}

static uint32_t hash_pair(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return (uint32_t)k;
}

/* ---------------------------------------------------------------- construction */

rekv_tokenizer *tok_new(tok_kind kind)
{
    rekv_tokenizer *tok = calloc(1, sizeof(*tok));
    if (tok == NULL)
        return NULL;
    tok->kind = kind;
    tok->unk_id = -1;
    tok->bos_id = -1;
    for (int i = 0; i < 256; i++)
        tok->byte_id[i] = -1;
    for (size_t i = 0; i < sizeof(tok->cp_byte) / sizeof(tok->cp_byte[0]); i++)
        tok->cp_byte[i] = -1;
    return tok;
}

int tok_set_piece(rekv_tokenizer *tok, int64_t id, const char *s, size_t len, float score, int kind,
                  const char *path, rekv_err *err)
{
    if (id < 0 || id >= TOK_MAX_VOCAB)
        return rekv_errf(err, -EINVAL, "%s: token id %lld out of range [0, %d)", path,
                         (long long)id, TOK_MAX_VOCAB);
    if (len > TOK_MAX_PIECE)
        return rekv_errf(err, -EINVAL, "%s: token %lld is %zu bytes long (limit %d)", path,
                         (long long)id, len, TOK_MAX_PIECE);
    if (id >= tok->pieces_cap) {
        int64_t cap = tok->pieces_cap ? tok->pieces_cap : 256;
        while (cap <= id)
            cap *= 2;
        tok_piece *p = realloc(tok->pieces, (size_t)cap * sizeof(*p));
        if (p == NULL)
            return rekv_errf(err, -ENOMEM, "%s: out of memory for %lld tokens", path,
                             (long long)id + 1);
        memset(p + tok->pieces_cap, 0, (size_t)(cap - tok->pieces_cap) * sizeof(*p));
        tok->pieces = p;
        tok->pieces_cap = (int32_t)cap;
    }
    if (id >= tok->n_vocab)
        tok->n_vocab = (int32_t)(id + 1);
    char *copy = malloc(len + 1);
    if (copy == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    memcpy(copy, s, len);
    copy[len] = '\0';
    tok_piece *pc = &tok->pieces[id];
    free(pc->s);
    pc->s = copy;
    pc->len = (uint32_t)len;
    pc->score = score;
    pc->kind = (uint8_t)kind;
    return 0;
}

int tok_index_build(rekv_tokenizer *tok, const char *path, rekv_err *err)
{
    uint32_t cap = 16;
    while (cap < (uint32_t)tok->n_vocab * 2u)
        cap *= 2;
    int32_t *slots = malloc(cap * sizeof(*slots));
    if (slots == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory for the vocabulary index", path);
    for (uint32_t i = 0; i < cap; i++)
        slots[i] = -1;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        const tok_piece *p = &tok->pieces[id];
        if (p->s == NULL)
            continue;
        uint32_t h = hash_bytes(p->s, p->len) & (cap - 1);
        int dup = 0;
        while (slots[h] >= 0) {
            const tok_piece *q = &tok->pieces[slots[h]];
            if (q->len == p->len && memcmp(q->s, p->s, p->len) == 0) {
                dup = 1;
                break;
            }
            h = (h + 1) & (cap - 1);
        }
        if (!dup)
            slots[h] = id;
    }
    free(tok->map_slots);
    tok->map_slots = slots;
    tok->map_cap = cap;
    return 0;
}

int32_t tok_lookup(const rekv_tokenizer *tok, const char *s, size_t len)
{
    if (tok->map_slots == NULL)
        return -1;
    uint32_t mask = tok->map_cap - 1;
    uint32_t h = hash_bytes(s, len) & mask;
    while (tok->map_slots[h] >= 0) {
        const tok_piece *q = &tok->pieces[tok->map_slots[h]];
        if (q->len == len && memcmp(q->s, s, len) == 0)
            return tok->map_slots[h];
        h = (h + 1) & mask;
    }
    return -1;
}

static int pair_grow(rekv_tokenizer *tok)
{
    uint32_t cap = tok->pair_cap ? tok->pair_cap * 2 : 1024;
    uint64_t *keys = malloc(cap * sizeof(*keys));
    int32_t *rank = malloc(cap * sizeof(*rank));
    int32_t *merged = malloc(cap * sizeof(*merged));
    if (keys == NULL || rank == NULL || merged == NULL) {
        free(keys);
        free(rank);
        free(merged);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < cap; i++)
        keys[i] = UINT64_MAX;
    for (uint32_t i = 0; i < tok->pair_cap; i++) {
        if (tok->pair_keys[i] == UINT64_MAX)
            continue;
        uint32_t h = hash_pair(tok->pair_keys[i]) & (cap - 1);
        while (keys[h] != UINT64_MAX)
            h = (h + 1) & (cap - 1);
        keys[h] = tok->pair_keys[i];
        rank[h] = tok->pair_rank[i];
        merged[h] = tok->pair_merged[i];
    }
    free(tok->pair_keys);
    free(tok->pair_rank);
    free(tok->pair_merged);
    tok->pair_keys = keys;
    tok->pair_rank = rank;
    tok->pair_merged = merged;
    tok->pair_cap = cap;
    return 0;
}

int tok_pair_add(rekv_tokenizer *tok, int32_t a, int32_t b, int32_t rank, int32_t merged,
                 const char *path, rekv_err *err)
{
    if ((tok->n_pairs + 1) * 2 > tok->pair_cap && pair_grow(tok) != 0)
        return rekv_errf(err, -ENOMEM, "%s: out of memory for merges", path);
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = tok->pair_cap - 1;
    uint32_t h = hash_pair(key) & mask;
    while (tok->pair_keys[h] != UINT64_MAX) {
        if (tok->pair_keys[h] == key)
            return 0; /* first (lowest) rank wins */
        h = (h + 1) & mask;
    }
    tok->pair_keys[h] = key;
    tok->pair_rank[h] = rank;
    tok->pair_merged[h] = merged;
    tok->n_pairs++;
    return 0;
}

static int pair_find(const rekv_tokenizer *tok, int32_t a, int32_t b, int32_t *rank,
                     int32_t *merged)
{
    if (tok->pair_cap == 0)
        return 0;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = tok->pair_cap - 1;
    uint32_t h = hash_pair(key) & mask;
    while (tok->pair_keys[h] != UINT64_MAX) {
        if (tok->pair_keys[h] == key) {
            *rank = tok->pair_rank[h];
            *merged = tok->pair_merged[h];
            return 1;
        }
        h = (h + 1) & mask;
    }
    return 0;
}

int tok_special_add(rekv_tokenizer *tok, int32_t id, int kind, const char *path, rekv_err *err)
{
    if (id < 0 || id >= tok->n_vocab || tok->pieces[id].s == NULL)
        return rekv_errf(err, -EINVAL, "%s: special token id %d is not in the vocabulary", path,
                         (int)id);
    tok_piece *p = &tok->pieces[id];
    int already = p->kind != TOK_PIECE_NORMAL;
    if (kind == TOK_PIECE_SPECIAL || p->kind == TOK_PIECE_NORMAL)
        p->kind = (uint8_t)kind;
    if (already || p->len == 0)
        return 0;
    int32_t *s = realloc(tok->specials, (tok->n_specials + 1) * sizeof(*s));
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    tok->specials = s;
    tok->specials[tok->n_specials++] = id;
    tok->special_first[(unsigned char)p->s[0]] = 1;
    return 0;
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const rekv_tokenizer *tok = ctx;
    const tok_piece *pa = &tok->pieces[*(const int32_t *)a];
    const tok_piece *pb = &tok->pieces[*(const int32_t *)b];
    if (pa->len != pb->len)
        return pa->len > pb->len ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

void tok_specials_finish(rekv_tokenizer *tok)
{
    if (tok->n_specials > 1)
        qsort_r(tok->specials, tok->n_specials, sizeof(*tok->specials), cmp_special, tok);
}

int tok_regex_set(rekv_tokenizer *tok, const char *pattern, size_t len, int literal,
                  const char *path, rekv_err *err)
{
    int code;
    PCRE2_SIZE off;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &code, &off, NULL);
    if (re == NULL) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof(msg));
        return rekv_errf(err, -EINVAL, "%s: pre-tokenizer regex does not compile at offset %zu: %s",
                         path, (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional: the interpreter is the fallback */
    pcre2_code_free(tok->re);
    tok->re = re;
    return 0;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to 256 + n. */
static int byte_to_cp(int b)
{
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
        return b;
    int n = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF)))
            n++;
    return 256 + n;
}

static size_t cp_to_utf8(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    out[0] = (char)(0xE0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
}

void tok_byte_level_init(rekv_tokenizer *tok)
{
    for (int b = 0; b < 256; b++) {
        int cp = byte_to_cp(b);
        char u[4];
        size_t n = cp_to_utf8((uint32_t)cp, u);
        tok->byte_id[b] = tok_lookup(tok, u, n);
        tok->cp_byte[cp] = (int16_t)b;
    }
}

void tok_byte_fallback_init(rekv_tokenizer *tok)
{
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        tok->byte_id[b] = tok_lookup(tok, name, 6);
    }
}

int tok_utf8_len(const unsigned char *p, size_t n)
{
    unsigned c = p[0];
    if (c < 0x80)
        return 1;
    int len;
    unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else
        return 0;
    if ((size_t)len > n || p[1] < lo || p[1] > hi)
        return 0;
    for (int i = 2; i < len; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    return len;
}

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

static void cache_free(tok_cache *c)
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
        if (!pair_find(tok, a, b, &rank, &x.merged))
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
    uint32_t h = hash_bytes(w, len) % CACHE_BUCKETS;
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
    uint32_t h = hash_bytes(w, len) % CACHE_BUCKETS;
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

/* A malloc'd copy of src (n bytes) with every `from` replaced by `to` and `pre` prepended. */
static char *str_rewrite(const char *pre, size_t pre_len, const char *src, size_t n,
                         const char *from, size_t from_len, const char *to, size_t to_len,
                         size_t *out_len)
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
            if (r < 0) /* INVALIDUTF8 cannot happen: the run was checked above */
                rc = r == UTF8PROC_ERROR_NOMEM ? -ENOMEM : -EOVERFLOW;
            else if ((rc = bytes_reserve(&b, &cap, pos + (size_t)r + 1)) == 0) {
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
static int normalize_segment(enc_ctx *c, const char *s, size_t n, char **work, size_t *wn)
{
    const rekv_tokenizer *tok = c->tok;
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
            next = str_rewrite(op->to, op->to_len, src, *wn, NULL, 0, NULL, 0, wn);
            break;
        case TOK_NORM_REPLACE:
            next = str_rewrite(NULL, 0, src, *wn, op->from, op->from_len, op->to, op->to_len, wn);
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
                return rekv_errf(c->err, rc, "tokenizer: text too long to normalize (%zu bytes)",
                                 n);
            }
            break;
        }
        }
        free(*work);
        if ((*work = next) == NULL)
            return rekv_errf(c->err, -ENOMEM, "tokenizer: out of memory");
    }
    return 0;
}

/* Byte-level segment: normalizer ops, then the pre-tokenizer and words. */
static int encode_byte_segment(enc_ctx *c, const char *s, size_t n)
{
    char *work;
    size_t wn;
    int rc = normalize_segment(c, s, n, &work, &wn);
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
    int rc = normalize_segment(c, s, n, &work, &wn);
    if (rc != 0)
        return rc;
    if (tok->ms_repl != NULL) {
        const char *src = work ? work : s;
        int prepend = tok->ms_prepend == 1 || (tok->ms_prepend == 2 && first);
        if (wn >= tok->ms_repl_len && memcmp(src, tok->ms_repl, tok->ms_repl_len) == 0)
            prepend = 0;
        if (wn == 0)
            prepend = 0;
        char *next = str_rewrite(tok->ms_repl, prepend ? tok->ms_repl_len : 0, src, wn, " ", 1,
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

/* ---------------------------------------------------------------- queries, free */

int rekv_tokenizer_vocab_size(const rekv_tokenizer *tok)
{
    return tok ? tok->n_vocab : 0;
}

int rekv_tokenizer_token_id(const rekv_tokenizer *tok, const char *piece)
{
    if (tok == NULL || piece == NULL)
        return -1;
    int32_t id = tok_lookup(tok, piece, strlen(piece));
    if (id >= 0 || tok->kind != TOK_LLAMA2C)
        return id;
    /* llama2.c stores the specials as "\n<s>\n" etc.; answer their usual names too */
    static const char *const names[] = {"<unk>", "<s>", "</s>"};
    for (int i = 0; i < 3 && i < tok->n_vocab; i++)
        if (strcmp(piece, names[i]) == 0)
            return i;
    return -1;
}

void rekv_tokenizer_free(rekv_tokenizer *tok)
{
    if (tok == NULL)
        return;
    for (int32_t i = 0; i < tok->n_vocab; i++)
        free(tok->pieces[i].s);
    free(tok->pieces);
    free(tok->map_slots);
    free(tok->pair_keys);
    free(tok->pair_rank);
    free(tok->pair_merged);
    free(tok->specials);
    pcre2_code_free(tok->re);
    for (size_t i = 0; i < tok->n_norm; i++) {
        free(tok->norm[i].from);
        free(tok->norm[i].to);
    }
    free(tok->norm);
    free(tok->ms_repl);
    free(tok->dec_from);
    free(tok->dec_to);
    cache_free(tok->cache);
    free(tok);
}

/* ---------------------------------------------------------------- picking a model's tokenizer */

static int file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* malloc'd "<dir_len bytes of dir>/name", NULL when out of memory. */
static char *path_join(const char *dir, size_t dir_len, const char *name)
{
    size_t n = dir_len + 1 + strlen(name) + 1;
    char *p = malloc(n);
    if (p != NULL)
        snprintf(p, n, "%.*s/%s", (int)dir_len, dir, name);
    return p;
}

int rekv_tokenizer_load_for_model(const char *model_path, rekv_tokenizer **out, rekv_err *err)
{
    if (model_path == NULL || out == NULL)
        return rekv_errf(err, -EINVAL, "tokenizer: load_for_model called with a NULL argument");
    *out = NULL;
    struct stat st;
    if (stat(model_path, &st) != 0)
        return rekv_errf(err, -errno, "%s: %s", model_path, strerror(errno));
    char *a = NULL, *b = NULL;
    int rc;
    if (S_ISDIR(st.st_mode)) {
        size_t dl = strlen(model_path);
        if ((a = path_join(model_path, dl, "tokenizer.json")) == NULL)
            goto oom;
        if (file_exists(a)) {
            rc = rekv_tokenizer_load_hf_json(a, out, err);
            goto done;
        }
        free(a);
        b = path_join(model_path, dl, "merges.txt");
        if ((a = path_join(model_path, dl, "vocab.json")) == NULL || b == NULL)
            goto oom;
        if (file_exists(a) && file_exists(b)) {
            rc = rekv_tokenizer_load_bpe(a, b, out, err);
            goto done;
        }
        rc = rekv_errf(err, -ENOENT,
                       "%s: no tokenizer (neither tokenizer.json nor vocab.json + merges.txt)",
                       model_path);
        goto done;
    }
    /* a llama2.c checkpoint: tokenizer.bin in the same directory */
    const char *slash = strrchr(model_path, '/');
    a = slash ? path_join(model_path, (size_t)(slash - model_path), "tokenizer.bin")
              : path_join(".", 1, "tokenizer.bin");
    if (a == NULL)
        goto oom;
    if (file_exists(a))
        rc = rekv_tokenizer_load_llama2c(a, out, err);
    else
        rc = rekv_errf(err, -ENOENT, "%s: no tokenizer (%s not found)", model_path, a);
    goto done;
oom:
    rc = rekv_errf(err, -ENOMEM, "%s: out of memory", model_path);
done:
    free(a);
    free(b);
    return rc;
}
