/* tokenizer_hf.c — loads HuggingFace BPE tokenizers: vocab.json + merges.txt (GPT-2/OPT byte-level
 * BPE, with the special tokens named in special_tokens_map.json / tokenizer_config.json beside
 * them), and tokenizer.json with model.type "BPE" in its byte-level form (ByteLevel pre-tokenizer,
 * optionally after a Split regex) or its SentencePiece form (▁ for spaces, byte fallback).
 *
 * Normalizers: Replace (String pattern), Prepend, NFC, NFD, NFKC, NFKD, and Sequences of them,
 * applied in the declared order to the text between added tokens, before the pre-tokenizer, in
 * both forms (tokenizer.c). The Unicode forms come from utf8proc; they act on each run of valid
 * UTF-8 and leave any other byte as it is (HF never sees such bytes: its input is a Rust String).
 *
 * Not supported (refused with -ENOTSUP naming the component): other model types, other
 * normalizers (Lowercase, Strip, StripAccents, Precompiled, BertNormalizer, ...), pre-tokenizers
 * other than ByteLevel/Split/Metaspace, continuing_subword_prefix and end_of_word_suffix. Added
 * tokens are all matched in the text before normalization (as HF does for "normalized": false);
 * their normalized/lstrip/rstrip/single_word flags are ignored. */
#define _GNU_SOURCE
#include "loader/tokenizer_internal.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- shared pieces */

static int load_json(const char *path, json_t **out, rekv_err *err)
{
    json_error_t je;
    *out = json_load_file(path, 0, &je);
    if (*out == NULL) {
        FILE *f = fopen(path, "rb");
        if (f == NULL)
            return rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
        fclose(f);
        return rekv_errf(err, -EINVAL, "%s: invalid JSON at line %d column %d: %s", path, je.line,
                         je.column, je.text);
    }
    return 0;
}

/* vocab: an object of piece -> id. */
static int load_vocab(rekv_tokenizer *tok, json_t *vocab, const char *path, rekv_err *err)
{
    if (!json_is_object(vocab))
        return rekv_errf(err, -EINVAL, "%s: the vocabulary is not a JSON object", path);
    if (json_object_size(vocab) == 0)
        return rekv_errf(err, -EINVAL, "%s: the vocabulary is empty", path);
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val)
    {
        if (!json_is_integer(val))
            return rekv_errf(err, -EINVAL, "%s: the id of token \"%.64s\" is not an integer", path,
                             key);
        json_int_t id = json_integer_value(val);
        if (id >= 0 && id < tok->n_vocab && tok->pieces[id].s != NULL)
            return rekv_errf(err, -EINVAL,
                             "%s: id %lld is given to two tokens (\"%.64s\", "
                             "\"%.64s\")",
                             path, (long long)id, tok->pieces[id].s, key);
        int rc = tok_set_piece(tok, id, key, strlen(key), 0.0f, TOK_PIECE_NORMAL, path, err);
        if (rc != 0)
            return rc;
    }
    return tok_index_build(tok, path, err);
}

/* One merge (a, b) of the given rank; both and their concatenation must be pieces. */
static int add_merge(rekv_tokenizer *tok, const char *a, size_t la, const char *b, size_t lb,
                     int32_t rank, const char *path, long line, rekv_err *err)
{
    int32_t ia = tok_lookup(tok, a, la), ib = tok_lookup(tok, b, lb);
    const char *bad = ia < 0 ? a : ib < 0 ? b : NULL;
    int bad_len = (int)(ia < 0 ? la : lb);
    if (bad != NULL)
        return rekv_errf(err, -EINVAL,
                         "%s: merge %ld (\"%.*s\" \"%.*s\") uses \"%.*s\", which is "
                         "not in the vocabulary",
                         path, line, (int)la, a, (int)lb, b, bad_len, bad);
    if (la + lb > TOK_MAX_PIECE)
        return rekv_errf(err, -EINVAL, "%s: merge %ld is too long", path, line);
    char cat[TOK_MAX_PIECE];
    memcpy(cat, a, la);
    memcpy(cat + la, b, lb);
    int32_t im = tok_lookup(tok, cat, la + lb);
    if (im < 0)
        return rekv_errf(err, -EINVAL,
                         "%s: merge %ld (\"%.*s\" \"%.*s\") makes \"%.*s\", which is "
                         "not in the vocabulary",
                         path, line, (int)la, a, (int)lb, b, (int)(la + lb), cat);
    return tok_pair_add(tok, ia, ib, rank, im, path, err);
}

/* A special-token value: "<s>" or {"content": "<s>", ...}. NULL when neither. */
static const char *special_content(json_t *v)
{
    if (json_is_string(v))
        return json_string_value(v);
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return json_string_value(json_object_get(v, "content"));
    return NULL;
}

static int mark_special_named(rekv_tokenizer *tok, const char *name, const char *path,
                              rekv_err *err)
{
    if (name == NULL)
        return 0;
    int32_t id = tok_lookup(tok, name, strlen(name));
    return id < 0 ? 0 : tok_special_add(tok, id, TOK_PIECE_SPECIAL, path, err);
}

/* special_tokens_map.json / tokenizer_config.json: *_token keys, additional_special_tokens and
 * added_tokens_decoder. Tokens that are not in the vocabulary and have no id are ignored. */
static int load_special_file(rekv_tokenizer *tok, const char *path, rekv_err *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return 0; /* optional */
    fclose(f);
    json_t *root;
    int rc = load_json(path, &root, err);
    if (rc != 0)
        return rc;
    if (!json_is_object(root)) {
        json_decref(root);
        return rekv_errf(err, -EINVAL, "%s: not a JSON object", path);
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        size_t kl = strlen(key);
        if (kl > 6 && strcmp(key + kl - 6, "_token") == 0) {
            if ((rc = mark_special_named(tok, special_content(val), path, err)) != 0)
                goto out;
        } else if (strcmp(key, "additional_special_tokens") == 0 && json_is_array(val)) {
            size_t i;
            json_t *v;
            json_array_foreach(val, i, v)
            {
                if ((rc = mark_special_named(tok, special_content(v), path, err)) != 0)
                    goto out;
            }
        } else if (strcmp(key, "added_tokens_decoder") == 0 && json_is_object(val)) {
            const char *idk;
            json_t *v;
            json_object_foreach(val, idk, v)
            {
                const char *content = special_content(v);
                char *end;
                long long id = strtoll(idk, &end, 10);
                if (content == NULL || *end != '\0' || end == idk)
                    continue;
                int special = !json_is_false(json_object_get(v, "special"));
                int32_t have = tok_lookup(tok, content, strlen(content));
                if (have < 0) {
                    if (id < tok->n_vocab && id >= 0 && tok->pieces[id].s != NULL)
                        continue; /* the id belongs to another piece: trust vocab.json */
                    rc = tok_set_piece(tok, id, content, strlen(content), 0.0f, TOK_PIECE_NORMAL,
                                       path, err);
                    if (rc == 0)
                        rc = tok_index_build(tok, path, err);
                    if (rc != 0)
                        goto out;
                    have = (int32_t)id;
                }
                rc = tok_special_add(tok, have, special ? TOK_PIECE_SPECIAL : TOK_PIECE_ADDED, path,
                                     err);
                if (rc != 0)
                    goto out;
            }
        }
    }
out:
    json_decref(root);
    return rc;
}

/* ---------------------------------------------------------------- vocab.json + merges.txt */

static int load_merges_txt(rekv_tokenizer *tok, const char *path, rekv_err *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    long lineno = 0;
    int32_t rank = 0;
    int rc = 0;
    while ((n = getline(&line, &cap, f)) >= 0) {
        lineno++;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = '\0';
        if (n == 0 || (lineno == 1 && strncmp(line, "#version", 8) == 0))
            continue;
        if (memchr(line, '\0', (size_t)n) != NULL) {
            rc = rekv_errf(err, -EINVAL, "%s:%ld: NUL byte in a merge", path, lineno);
            break;
        }
        char *sp = strchr(line, ' ');
        if (sp == NULL || sp == line || sp[1] == '\0' || strchr(sp + 1, ' ') != NULL) {
            rc = rekv_errf(err, -EINVAL,
                           "%s:%ld: a merge must be two tokens separated by one "
                           "space",
                           path, lineno);
            break;
        }
        rc = add_merge(tok, line, (size_t)(sp - line), sp + 1, (size_t)(n - (sp + 1 - line)),
                       rank++, path, lineno, err);
        if (rc != 0)
            break;
    }
    if (rc == 0 && ferror(f))
        rc = rekv_errf(err, -EIO, "%s: read error", path);
    free(line);
    fclose(f);
    return rc;
}

int rekv_tokenizer_load_bpe(const char *vocab_json, const char *merges_txt, rekv_tokenizer **out,
                            rekv_err *err)
{
    if (vocab_json == NULL || merges_txt == NULL || out == NULL)
        return rekv_errf(err, -EINVAL, "tokenizer: load_bpe called with a NULL argument");
    *out = NULL;
    json_t *vocab = NULL;
    char *dir = NULL;
    int rc;
    rekv_tokenizer *tok = tok_new(TOK_BYTE_BPE);
    if (tok == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", vocab_json);
    if ((rc = load_json(vocab_json, &vocab, err)) != 0)
        goto out;
    if ((rc = load_vocab(tok, vocab, vocab_json, err)) != 0)
        goto out;
    if ((rc = load_merges_txt(tok, merges_txt, err)) != 0)
        goto out;
    tok_byte_level_init(tok);
    /* the usual special names, then whatever the files beside vocab.json declare */
    static const char *const known[] = {"<s>", "</s>", "<pad>", "<unk>", "<mask>", "<|endoftext|>"};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if ((rc = mark_special_named(tok, known[i], vocab_json, err)) != 0)
            goto out;
    const char *slash = strrchr(vocab_json, '/');
    size_t dl = slash ? (size_t)(slash - vocab_json) : 1;
    dir = malloc(dl + 64);
    if (dir == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", vocab_json);
        goto out;
    }
    static const char *const extra[] = {"special_tokens_map.json", "tokenizer_config.json"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(dir, dl + 64, "%.*s/%s", (int)dl, slash ? vocab_json : ".", extra[i]);
        if ((rc = load_special_file(tok, dir, err)) != 0)
            goto out;
    }
    tok_specials_finish(tok);
    int32_t unk = tok_lookup(tok, "<unk>", 5);
    tok->unk_id = unk;
    if ((rc = tok_regex_set(tok, TOK_GPT2_PATTERN, PCRE2_ZERO_TERMINATED, 0, vocab_json, err)) != 0)
        goto out;
    rc = tok_cache_create(tok, vocab_json, err);
out:
    json_decref(vocab);
    free(dir);
    if (rc != 0) {
        rekv_tokenizer_free(tok);
        return rc;
    }
    *out = tok;
    return 0;
}

/* ---------------------------------------------------------------- tokenizer.json */

static const char *type_of(json_t *o)
{
    json_t *t = json_object_get(o, "type");
    return json_is_string(t) ? json_string_value(t) : "";
}

/* A "String" pattern's text, or NULL. */
static const char *pattern_string(json_t *pat)
{
    return json_string_value(json_object_get(pat, "String"));
}

static int set_str(char **dst, size_t *dst_len, const char *s)
{
    free(*dst);
    *dst = strdup(s);
    if (*dst == NULL)
        return -ENOMEM;
    if (dst_len != NULL)
        *dst_len = strlen(s);
    return 0;
}

/* Appends a normalizer op; from and to may be NULL (Prepend has no from, Unicode forms neither). */
static int add_norm(rekv_tokenizer *tok, tok_norm_kind kind, const char *from, const char *to)
{
    tok_norm_op *n = realloc(tok->norm, (tok->n_norm + 1) * sizeof(*n));
    if (n == NULL)
        return -ENOMEM;
    tok->norm = n;
    tok_norm_op *op = &n[tok->n_norm];
    memset(op, 0, sizeof(*op));
    op->kind = kind;
    tok->n_norm++;
    if ((from != NULL && (op->from = strdup(from)) == NULL) ||
        (to != NULL && (op->to = strdup(to)) == NULL))
        return -ENOMEM;
    op->from_len = from ? strlen(from) : 0;
    op->to_len = to ? strlen(to) : 0;
    return 0;
}

static int parse_normalizer(rekv_tokenizer *tok, json_t *n, const char *path, rekv_err *err)
{
    if (n == NULL || json_is_null(n))
        return 0;
    const char *t = type_of(n);
    if (strcmp(t, "Sequence") == 0) {
        json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list))
            return rekv_errf(err, -EINVAL, "%s: Sequence normalizer without a normalizers array",
                             path);
        size_t i;
        json_t *v;
        json_array_foreach(list, i, v)
        {
            int rc = parse_normalizer(tok, v, path, err);
            if (rc != 0)
                return rc;
        }
        return 0;
    }
    static const struct {
        const char *name;
        tok_norm_kind kind;
    } forms[] = {{"NFC", TOK_NORM_NFC},
                 {"NFD", TOK_NORM_NFD},
                 {"NFKC", TOK_NORM_NFKC},
                 {"NFKD", TOK_NORM_NFKD}};
    for (size_t i = 0; i < sizeof(forms) / sizeof(forms[0]); i++)
        if (strcmp(t, forms[i].name) == 0)
            return add_norm(tok, forms[i].kind, NULL, NULL)
                       ? rekv_errf(err, -ENOMEM, "%s: out of memory", path)
                       : 0;
    if (strcmp(t, "Prepend") == 0) {
        const char *p = json_string_value(json_object_get(n, "prepend"));
        if (p == NULL)
            return rekv_errf(err, -EINVAL, "%s: Prepend normalizer without a string", path);
        return add_norm(tok, TOK_NORM_PREPEND, NULL, p)
                   ? rekv_errf(err, -ENOMEM, "%s: out of memory", path)
                   : 0;
    }
    if (strcmp(t, "Replace") == 0) {
        const char *from = pattern_string(json_object_get(n, "pattern"));
        const char *to = json_string_value(json_object_get(n, "content"));
        if (from == NULL || to == NULL || from[0] == '\0')
            return rekv_errf(err, -ENOTSUP,
                             "%s: only Replace normalizers with a non-empty String "
                             "pattern are supported",
                             path);
        return add_norm(tok, TOK_NORM_REPLACE, from, to)
                   ? rekv_errf(err, -ENOMEM, "%s: out of memory", path)
                   : 0;
    }
    return rekv_errf(err, -ENOTSUP, "%s: normalizer \"%s\" is not supported", path, t);
}

/* Byte-level pre-tokenizers: ByteLevel, Split, or a Sequence of them. */
static int parse_byte_pretok(rekv_tokenizer *tok, json_t *p, const char *path, rekv_err *err)
{
    const char *t = type_of(p);
    int rc;
    if (strcmp(t, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(p, "pretokenizers"), i, v)
        {
            if ((rc = parse_byte_pretok(tok, v, path, err)) != 0)
                return rc;
        }
        return 0;
    }
    if (strcmp(t, "ByteLevel") == 0) {
        tok->add_prefix_space = json_is_true(json_object_get(p, "add_prefix_space"));
        json_t *ur = json_object_get(p, "use_regex");
        if (ur == NULL || json_is_true(ur)) {
            if (tok->re != NULL)
                return rekv_errf(err, -ENOTSUP, "%s: more than one splitting pre-tokenizer", path);
            return tok_regex_set(tok, TOK_GPT2_PATTERN, PCRE2_ZERO_TERMINATED, 0, path, err);
        }
        return 0;
    }
    if (strcmp(t, "Split") == 0) {
        json_t *pat = json_object_get(p, "pattern");
        const char *re = json_string_value(json_object_get(pat, "Regex"));
        const char *lit = pattern_string(pat);
        const char *beh = json_string_value(json_object_get(p, "behavior"));
        if (re == NULL && lit == NULL)
            return rekv_errf(err, -EINVAL, "%s: Split pre-tokenizer without a pattern", path);
        if (json_is_true(json_object_get(p, "invert")))
            return rekv_errf(err, -ENOTSUP, "%s: inverted Split is not supported", path);
        if (beh != NULL && strcmp(beh, "Isolated") != 0 && strcmp(beh, "Removed") != 0)
            return rekv_errf(err, -ENOTSUP, "%s: Split behavior \"%s\" is not supported", path,
                             beh);
        if (tok->re != NULL)
            return rekv_errf(err, -ENOTSUP, "%s: more than one splitting pre-tokenizer", path);
        tok->re_removed = beh != NULL && strcmp(beh, "Removed") == 0;
        return tok_regex_set(tok, re ? re : lit, PCRE2_ZERO_TERMINATED, re == NULL, path, err);
    }
    return rekv_errf(err, -ENOTSUP, "%s: pre-tokenizer \"%s\" is not supported", path, t);
}

static int parse_metaspace(rekv_tokenizer *tok, json_t *p, const char *path, rekv_err *err)
{
    const char *repl = json_string_value(json_object_get(p, "replacement"));
    if (repl == NULL || repl[0] == '\0')
        repl = "\xe2\x96\x81";
    if (set_str(&tok->ms_repl, &tok->ms_repl_len, repl) != 0)
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    const char *scheme = json_string_value(json_object_get(p, "prepend_scheme"));
    if (scheme != NULL)
        tok->ms_prepend = strcmp(scheme, "always") == 0 ? 1 : strcmp(scheme, "first") == 0 ? 2 : 0;
    else
        tok->ms_prepend = json_is_false(json_object_get(p, "add_prefix_space")) ? 0 : 1;
    json_t *split = json_object_get(p, "split");
    tok->ms_split = split == NULL || json_is_true(split);
    return 0;
}

static int parse_char_decoder(rekv_tokenizer *tok, json_t *d, const char *path, rekv_err *err)
{
    if (d == NULL || json_is_null(d))
        return 0;
    const char *t = type_of(d);
    if (strcmp(t, "Sequence") == 0) {
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(d, "decoders"), i, v)
        {
            int rc = parse_char_decoder(tok, v, path, err);
            if (rc != 0)
                return rc;
        }
        return 0;
    }
    if (strcmp(t, "Replace") == 0) {
        const char *from = pattern_string(json_object_get(d, "pattern"));
        const char *to = json_string_value(json_object_get(d, "content"));
        if (from == NULL || to == NULL || from[0] == '\0')
            return rekv_errf(err, -ENOTSUP,
                             "%s: only Replace decoders with a String pattern are "
                             "supported",
                             path);
        if (set_str(&tok->dec_from, &tok->dec_from_len, from) != 0 ||
            set_str(&tok->dec_to, &tok->dec_to_len, to) != 0)
            return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        return 0;
    }
    if (strcmp(t, "ByteFallback") == 0) {
        tok->dec_bytes = 1;
        return 0;
    }
    if (strcmp(t, "Fuse") == 0)
        return 0;
    if (strcmp(t, "Strip") == 0) {
        const char *content = json_string_value(json_object_get(d, "content"));
        json_t *start = json_object_get(d, "start");
        if (content != NULL && strcmp(content, " ") == 0 && json_is_integer(start))
            tok->dec_strip = (int)json_integer_value(start);
        return 0;
    }
    if (strcmp(t, "Metaspace") == 0) {
        const char *repl = json_string_value(json_object_get(d, "replacement"));
        if (set_str(&tok->dec_from, &tok->dec_from_len, repl ? repl : "\xe2\x96\x81") != 0 ||
            set_str(&tok->dec_to, &tok->dec_to_len, " ") != 0)
            return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        const char *scheme = json_string_value(json_object_get(d, "prepend_scheme"));
        int prepend = scheme ? strcmp(scheme, "never") != 0
                             : !json_is_false(json_object_get(d, "add_prefix_space"));
        tok->dec_strip = prepend ? 1 : 0;
        return 0;
    }
    return rekv_errf(err, -ENOTSUP, "%s: decoder \"%s\" is not supported", path, t);
}

static int has_type(json_t *o, const char *list_key, const char *type)
{
    if (o == NULL || json_is_null(o))
        return 0;
    if (strcmp(type_of(o), type) == 0)
        return 1;
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(o, list_key), i, v)
    {
        if (has_type(v, list_key, type))
            return 1;
    }
    return 0;
}

static int load_json_merges(rekv_tokenizer *tok, json_t *merges, const char *path, rekv_err *err)
{
    if (merges == NULL || json_is_null(merges))
        return 0;
    if (!json_is_array(merges))
        return rekv_errf(err, -EINVAL, "%s: model.merges is not an array", path);
    size_t i;
    json_t *m;
    json_array_foreach(merges, i, m)
    {
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            const char *sp = strchr(s, ' ');
            if (sp == NULL || strchr(sp + 1, ' ') != NULL)
                return rekv_errf(err, -EINVAL,
                                 "%s: merge %zu (\"%.64s\") is not two tokens "
                                 "separated by one space",
                                 path, i, s);
            a = s;
            la = (size_t)(sp - s);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            la = json_string_length(json_array_get(m, 0));
            lb = json_string_length(json_array_get(m, 1));
        } else {
            return rekv_errf(err, -EINVAL, "%s: merge %zu is neither \"a b\" nor [a, b]", path, i);
        }
        if (la == 0 || lb == 0)
            return rekv_errf(err, -EINVAL, "%s: merge %zu has an empty token", path, i);
        int rc = add_merge(tok, a, la, b, lb, (int32_t)i, path, (long)i, err);
        if (rc != 0)
            return rc;
    }
    return 0;
}

static int load_added_tokens(rekv_tokenizer *tok, json_t *added, const char *path, rekv_err *err)
{
    if (added == NULL || json_is_null(added))
        return 0;
    if (!json_is_array(added))
        return rekv_errf(err, -EINVAL, "%s: added_tokens is not an array", path);
    size_t i;
    json_t *a;
    int rc;
    /* set every piece first, then index once, then register (tok_special_add needs ids) */
    json_array_foreach(added, i, a)
    {
        json_t *id = json_object_get(a, "id");
        const char *content = json_string_value(json_object_get(a, "content"));
        if (!json_is_integer(id) || content == NULL)
            return rekv_errf(err, -EINVAL,
                             "%s: added_tokens[%zu] needs an integer id and a "
                             "string content",
                             path, i);
        json_int_t v = json_integer_value(id);
        if (v >= 0 && v < tok->n_vocab && tok->pieces[v].s != NULL &&
            strcmp(tok->pieces[v].s, content) == 0)
            continue;
        rc = tok_set_piece(tok, v, content, strlen(content), 0.0f, TOK_PIECE_NORMAL, path, err);
        if (rc != 0)
            return rc;
    }
    if ((rc = tok_index_build(tok, path, err)) != 0)
        return rc;
    json_array_foreach(added, i, a)
    {
        int special = json_is_true(json_object_get(a, "special"));
        rc = tok_special_add(tok, (int32_t)json_integer_value(json_object_get(a, "id")),
                             special ? TOK_PIECE_SPECIAL : TOK_PIECE_ADDED, path, err);
        if (rc != 0)
            return rc;
    }
    tok_specials_finish(tok);
    return 0;
}

int rekv_tokenizer_load_hf_json(const char *path, rekv_tokenizer **out, rekv_err *err)
{
    if (path == NULL || out == NULL)
        return rekv_errf(err, -EINVAL, "tokenizer: load_hf_json called with a NULL argument");
    *out = NULL;
    json_t *root = NULL;
    rekv_tokenizer *tok = NULL;
    int rc = load_json(path, &root, err);
    if (rc != 0)
        return rc;
    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) {
        rc = rekv_errf(err, -EINVAL, "%s: no \"model\" object", path);
        goto out;
    }
    const char *mt = type_of(model);
    if (mt[0] != '\0' && strcmp(mt, "BPE") != 0) {
        rc =
            rekv_errf(err, -ENOTSUP, "%s: model type \"%s\" is not supported (only BPE)", path, mt);
        goto out;
    }
    static const char *const unsupported[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const char *v = json_string_value(json_object_get(model, unsupported[i]));
        if (v != NULL && v[0] != '\0') {
            rc = rekv_errf(err, -ENOTSUP, "%s: model.%s is not supported", path, unsupported[i]);
            goto out;
        }
    }
    json_t *pre = json_object_get(root, "pre_tokenizer");
    json_t *dec = json_object_get(root, "decoder");
    json_t *norm = json_object_get(root, "normalizer");
    int byte_level =
        has_type(pre, "pretokenizers", "ByteLevel") || has_type(dec, "decoders", "ByteLevel");
    tok = tok_new(byte_level ? TOK_BYTE_BPE : TOK_CHAR_BPE);
    if (tok == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    if ((rc = load_vocab(tok, json_object_get(model, "vocab"), path, err)) != 0)
        goto out;
    if ((rc = load_json_merges(tok, json_object_get(model, "merges"), path, err)) != 0)
        goto out;
    if ((rc = load_added_tokens(tok, json_object_get(root, "added_tokens"), path, err)) != 0)
        goto out;
    if ((rc = parse_normalizer(tok, norm, path, err)) != 0)
        goto out;
    const char *unk = json_string_value(json_object_get(model, "unk_token"));
    tok->unk_id = unk ? tok_lookup(tok, unk, strlen(unk)) : -1;
    tok->byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    tok->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));
    tok->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    if (byte_level) {
        if (pre != NULL && !json_is_null(pre) && (rc = parse_byte_pretok(tok, pre, path, err)) != 0)
            goto out;
        tok_byte_level_init(tok);
    } else {
        if (pre != NULL && !json_is_null(pre)) {
            if (strcmp(type_of(pre), "Metaspace") != 0) {
                rc = rekv_errf(err, -ENOTSUP,
                               "%s: pre-tokenizer \"%s\" is not supported without "
                               "ByteLevel",
                               path, type_of(pre));
                goto out;
            }
            if ((rc = parse_metaspace(tok, pre, path, err)) != 0)
                goto out;
        }
        if ((rc = parse_char_decoder(tok, dec, path, err)) != 0)
            goto out;
        if (tok->byte_fallback)
            tok->dec_bytes = 1;
        tok_byte_fallback_init(tok);
    }
    rc = tok_cache_create(tok, path, err);
out:
    json_decref(root);
    if (rc != 0) {
        rekv_tokenizer_free(tok);
        return rc;
    }
    *out = tok;
    return 0;
}
