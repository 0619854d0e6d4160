/* tokenizer.c — the tokenizer core: the piece and merge tables the loaders fill (tokenizer_hf.c,
 * tokenizer_llama2c.c), queries, free, and picking a model's tokenizer files.
 *
 * The rest of the tokenizer is a file per stage: tokenizer_encode.c (specials, pre-tokenizers and
 * the BPE merge engine), tokenizer_normalize.c (tokenizer.json's normalizers) and
 * tokenizer_decode.c. */
#define _GNU_SOURCE
#include "loader/gguf.h"
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---------------------------------------------------------------- hashing */

uint32_t tok_hash_bytes(const char *s, size_t len)
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
        uint32_t h = tok_hash_bytes(p->s, p->len) & (cap - 1);
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
    uint32_t h = tok_hash_bytes(s, len) & mask;
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

int tok_pair_find(const rekv_tokenizer *tok, int32_t a, int32_t b, int32_t *rank, int32_t *merged)
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
    tok_cache_free(tok->cache);
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
    if (rekv_gguf_is_gguf(model_path)) /* a GGUF carries its own (tokenizer_gguf.c) */
        return rekv_tokenizer_load_gguf_file(model_path, out, err);
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
