/* test_tokenizer.c — the tokenizers against reference encodings (llama2.c tokenizer.bin, the tiny
 * byte-level BPE models), tokenizer.json in both its byte-level and SentencePiece forms, and
 * malformed files. */
#define _GNU_SOURCE
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loader/loader.h"
#include "tests/testutil.h"

static char *xstrdup(const char *s)
{
    char *d = strdup(s);
    ck_assert_ptr_nonnull(d);
    return d;
}

static void write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    ck_assert_uint_eq(fwrite(data, 1, len, f), len);
    fclose(f);
}

static char *join(const char *dir, const char *name)
{
    char *p;
    ck_assert_int_ge(asprintf(&p, "%s/%s", dir, name), 0);
    return p;
}

/* Encodes text and checks the ids equal want (a JSON array), then that decode gives text back. */
static void check_case(const rekv_tokenizer *tok, const char *text, size_t len, int bos,
                       json_t *want, int roundtrip)
{
    rekv_err err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = rekv_tokenizer_encode(tok, text, len, bos, &ids, &n, &err);
    ck_assert_msg(rc == 0, "encode failed: %s", err.msg);
    if (want != NULL) {
        ck_assert_msg(n == json_array_size(want), "text \"%.60s\": %zu ids, want %zu", text, n,
                      json_array_size(want));
        for (size_t i = 0; i < n; i++)
            ck_assert_msg(ids[i] == json_integer_value(json_array_get(want, i)),
                          "text \"%.60s\": id %zu is %d, want %lld", text, i, ids[i],
                          (long long)json_integer_value(json_array_get(want, i)));
    }
    if (roundtrip) {
        char *back = NULL;
        size_t blen = 0;
        rc = rekv_tokenizer_decode(tok, ids, n, &back, &blen, &err);
        ck_assert_msg(rc == 0, "decode failed: %s", err.msg);
        ck_assert_msg(blen == len && memcmp(back, text, len) == 0,
                      "round trip of \"%.60s\" gave \"%.60s\"", text, back);
        ck_assert_int_eq(back[blen], '\0');
        free(back);
    }
    free(ids);
}

static int32_t *encode(const rekv_tokenizer *tok, const char *text, int bos, size_t *n)
{
    rekv_err err = {0};
    int32_t *ids = NULL;
    int rc = rekv_tokenizer_encode(tok, text, strlen(text), bos, &ids, n, &err);
    ck_assert_msg(rc == 0, "encode of \"%s\" failed: %s", text, err.msg);
    return ids;
}

static void check_ids(const rekv_tokenizer *tok, const char *text, int bos, const int32_t *want,
                      size_t n_want)
{
    size_t n;
    int32_t *ids = encode(tok, text, bos, &n);
    ck_assert_msg(n == n_want, "\"%s\": %zu ids, want %zu", text, n, n_want);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(ids[i] == want[i], "\"%s\": id %zu is %d, want %d", text, i, ids[i], want[i]);
    free(ids);
}

static char *decode(const rekv_tokenizer *tok, const int32_t *ids, size_t n)
{
    rekv_err err = {0};
    char *text = NULL;
    size_t len;
    int rc = rekv_tokenizer_decode(tok, ids, n, &text, &len, &err);
    ck_assert_msg(rc == 0, "decode failed: %s", err.msg);
    ck_assert_uint_eq(len, strlen(text));
    return text;
}

/* ---------------------------------------------------------------- llama2.c */

START_TEST(test_llama2c_expected)
{
    const char *p = tu_shared("tokenizers/llama2/tokenizer.bin");
    if (p == NULL)
        return;
    char *bin = xstrdup(p);
    p = tu_shared("tokenizers/llama2/expected.json");
    if (p == NULL) {
        free(bin);
        return;
    }
    json_error_t je;
    json_t *exp = json_load_file(p, 0, &je);
    ck_assert_msg(exp != NULL, "%s: %s", p, je.text);
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_llama2c(bin, &tok, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_tokenizer_vocab_size(tok), 32000);
    ck_assert_int_eq(rekv_tokenizer_token_id(tok, "<s>"), 1);
    ck_assert_int_eq(rekv_tokenizer_token_id(tok, "</s>"), 2);
    json_t *cases = json_object_get(exp, "cases");
    ck_assert_int_gt(json_array_size(cases), 0);
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c)
    {
        json_t *t = json_object_get(c, "text");
        check_case(tok, json_string_value(t), json_string_length(t), 1, json_object_get(c, "ids"),
                   1);
    }
    /* bytes outside the vocabulary (and invalid UTF-8) go through <0xNN> and come back */
    const char odd[] = "x\xff\xfe y \xe2\x82 \xf0\x9f\x98\x80!";
    check_case(tok, odd, sizeof(odd) - 1, 1, NULL, 1);
    /* the leading space is dropped only after BOS */
    int32_t ids[] = {1, 306, 4658};
    char *s = decode(tok, ids, 3);
    ck_assert_str_eq(s, "I believe");
    free(s);
    s = decode(tok, ids + 1, 2);
    ck_assert_str_eq(s, " I believe");
    free(s);
    rekv_tokenizer_free(tok);
    json_decref(exp);
    free(bin);
}
END_TEST

START_TEST(test_llama2c_for_model)
{
    const char *p = tu_shared("tokenizers/llama2/tokenizer.bin");
    if (p == NULL)
        return;
    size_t len;
    char *data = tu_read_file(p, &len);
    ck_assert_ptr_nonnull(data);
    char *dir = tu_tmpdir();
    char *tb = join(dir, "tokenizer.bin"), *model = join(dir, "model.bin");
    write_file(model, "x", 1);
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    /* no tokenizer.bin yet */
    ck_assert_int_eq(rekv_tokenizer_load_for_model(model, &tok, &err), -ENOENT);
    ck_assert_ptr_nonnull(strstr(err.msg, model));
    write_file(tb, data, len);
    rekv_err_clear(&err);
    ck_assert_msg(rekv_tokenizer_load_for_model(model, &tok, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_tokenizer_vocab_size(tok), 32000);
    rekv_tokenizer_free(tok);
    /* an empty directory has no tokenizer */
    rekv_err_clear(&err);
    char *empty = join(dir, "empty");
    ck_assert_int_eq(mkdir(empty, 0700), 0);
    ck_assert_int_eq(rekv_tokenizer_load_for_model(empty, &tok, &err), -ENOENT);
    ck_assert_ptr_nonnull(strstr(err.msg, empty));
    rekv_err_clear(&err);
    ck_assert_int_lt(rekv_tokenizer_load_for_model("/nonexistent/model", &tok, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "/nonexistent/model"));
    tu_rmrf(dir);
    free(empty);
    free(tb);
    free(model);
    free(dir);
    free(data);
}
END_TEST

/* ---------------------------------------------------------------- vocab.json + merges.txt */

/* Checks every reference encoding of model name with tok. */
static void check_reference(const rekv_tokenizer *tok, const char *name)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "reference/%s.reference.json", name);
    const char *p = tu_shared(rel);
    if (p == NULL)
        return;
    json_error_t je;
    json_t *ref = json_load_file(p, 0, &je);
    ck_assert_msg(ref != NULL, "%s: %s", p, je.text);
    json_t *encs = json_object_get(ref, "encodings");
    ck_assert_int_gt(json_array_size(encs), 0);
    size_t i;
    json_t *e;
    json_array_foreach(encs, i, e)
    {
        json_t *t = json_object_get(e, "text");
        check_case(tok, json_string_value(t), json_string_length(t), -1, json_object_get(e, "ids"),
                   1);
    }
    json_decref(ref);
}

static void check_bpe_model(const char *name)
{
    char rel[256];
    snprintf(rel, sizeof(rel), "models/%s/vocab.json", name);
    if (tu_shared(rel) == NULL)
        return;
    snprintf(rel, sizeof(rel), "../shared/models/%s", name);
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_for_model(rel, &tok, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_tokenizer_vocab_size(tok), 4096);
    ck_assert_int_eq(rekv_tokenizer_token_id(tok, "</s>"), 2);
    ck_assert_int_eq(rekv_tokenizer_token_id(tok, "no such piece"), -1);
    check_reference(tok, name);

    /* specials are matched in the text and skipped by decode */
    size_t n;
    int32_t *ids = encode(tok, "</s>def f():<pad>", 2, &n);
    ck_assert_int_ge(n, 4);
    ck_assert_int_eq(ids[0], 2);
    ck_assert_int_eq(ids[1], 2);
    ck_assert_int_eq(ids[n - 1], 1);
    char *s = decode(tok, ids, n);
    ck_assert_str_eq(s, "def f():");
    free(s);
    free(ids);
    /* empty text, and any bytes (invalid UTF-8 included) survive the round trip */
    ids = encode(tok, "", -1, &n);
    ck_assert_uint_eq(n, 0);
    free(ids);
    const char odd[] = "a\xff\xc3(b \xe2\x82\xac\xed\xa0\x80 \t\n  x\x00y";
    check_case(tok, odd, sizeof(odd) - 1, -1, NULL, 1);
    /* a long word: merging must stay fast and correct */
    size_t big = 200000;
    char *longw = malloc(big + 1);
    for (size_t i = 0; i < big; i++)
        longw[i] = "abcdefgh"[i % 7];
    longw[big] = '\0';
    check_case(tok, longw, big, -1, NULL, 1);
    free(longw);
    /* out-of-range ids are an error, not a crash */
    int32_t bad[] = {5, 99999};
    char *t = NULL;
    rekv_err_clear(&err);
    ck_assert_int_lt(rekv_tokenizer_decode(tok, bad, 2, &t, NULL, &err), 0);
    ck_assert_ptr_null(t);
    rekv_tokenizer_free(tok);
}

START_TEST(test_bpe_opt)
{
    check_bpe_model("opt-tiny-py");
}
END_TEST

START_TEST(test_bpe_llama)
{
    check_bpe_model("llama-tiny-py");
}
END_TEST

/* ---------------------------------------------------------------- tokenizer.json */

/* Writes opt-tiny-py's vocab + merges as a HF tokenizer.json. split: GPT-2 regex as a Split
 * pre-tokenizer in a Sequence, and merges as [a, b] pairs, rather than ByteLevel alone.
 * normalizer: the "normalizer" value (stolen), NULL for null. */
static char *write_hf_json(const char *dir, const char *vocab_path, const char *merges_path,
                           int split, json_t *normalizer)
{
    json_error_t je;
    json_t *vocab = json_load_file(vocab_path, 0, &je);
    ck_assert_ptr_nonnull(vocab);
    json_t *merges = json_array();
    FILE *f = fopen(merges_path, "r");
    ck_assert_ptr_nonnull(f);
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) > 0) {
        if (line[n - 1] == '\n')
            line[--n] = '\0';
        if (n == 0 || strncmp(line, "#version", 8) == 0)
            continue;
        if (split) {
            char *sp = strchr(line, ' ');
            *sp = '\0';
            json_array_append_new(merges, json_pack("[ss]", line, sp + 1));
        } else {
            json_array_append_new(merges, json_string(line));
        }
    }
    free(line);
    fclose(f);
    json_t *added = json_array();
    const char *names[] = {"<s>", "<pad>", "</s>", "<unk>"};
    for (int i = 0; i < 4; i++)
        json_array_append_new(added, json_pack("{s:i,s:s,s:b,s:b,s:b,s:b,s:b}", "id", i, "content",
                                               names[i], "single_word", 0, "lstrip", 0, "rstrip", 0,
                                               "normalized", 1, "special", 1));
    json_t *bl = json_pack("{s:s,s:b,s:b,s:b}", "type", "ByteLevel", "add_prefix_space", 0,
                           "trim_offsets", 1, "use_regex", !split);
    json_t *pre = bl;
    if (split) {
        json_t *sp = json_pack("{s:s,s:{s:s},s:s,s:b}", "type", "Split", "pattern", "Regex",
                               "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|"
                               "\\s+(?!\\S)|\\s+",
                               "behavior", "Isolated", "invert", 0);
        pre = json_pack("{s:s,s:[oo]}", "type", "Sequence", "pretokenizers", sp, bl);
    }
    json_t *root = json_pack(
        "{s:s,s:n,s:n,s:o,s:o,s:o,s:n,s:{s:s,s:b,s:b,s:b},s:{s:s,s:n,s:n,s:s,s:s,s:b,s:b,s:o,s:o}}",
        "version", "1.0", "truncation", "padding", "added_tokens", added, "normalizer",
        normalizer ? normalizer : json_null(), "pre_tokenizer", pre, "post_processor", "decoder",
        "type", "ByteLevel", "add_prefix_space", 1, "trim_offsets", 1, "use_regex", 1, "model",
        "type", "BPE", "dropout", "unk_token", "continuing_subword_prefix", "",
        "end_of_word_suffix", "", "fuse_unk", 0, "byte_fallback", 0, "vocab", vocab, "merges",
        merges);
    ck_assert_ptr_nonnull(root);
    char *path = join(dir, "tokenizer.json");
    ck_assert_int_eq(json_dump_file(root, path, JSON_INDENT(1)), 0);
    json_decref(root);
    return path;
}

START_TEST(test_hf_json_byte_level)
{
    const char *p = tu_shared("models/opt-tiny-py/vocab.json");
    if (p == NULL)
        return;
    char *vocab = xstrdup(p);
    p = tu_shared("models/opt-tiny-py/merges.txt");
    if (p == NULL) {
        free(vocab);
        return;
    }
    char *merges = xstrdup(p);
    for (int split = 0; split < 2; split++) {
        char *dir = tu_tmpdir();
        char *path = write_hf_json(dir, vocab, merges, split, NULL);
        rekv_tokenizer *tok = NULL;
        rekv_err err = {0};
        /* the directory route must pick tokenizer.json */
        ck_assert_msg(rekv_tokenizer_load_for_model(dir, &tok, &err) == 0, "%s", err.msg);
        ck_assert_int_eq(rekv_tokenizer_vocab_size(tok), 4096);
        check_reference(tok, "opt-tiny-py");
        size_t n;
        int32_t *ids = encode(tok, "</s>x<unk>", -1, &n);
        ck_assert_uint_eq(n, 3);
        ck_assert_int_eq(ids[0], 2);
        ck_assert_int_eq(ids[2], 3);
        free(ids);
        rekv_tokenizer_free(tok);
        tu_rmrf(dir);
        free(path);
        free(dir);
    }
    free(vocab);
    free(merges);
}
END_TEST

#define U "\xe2\x96\x81" /* ▁ */

/* A SentencePiece-style BPE: <unk> <s> </s>, 256 byte pieces (ids 3..258), then characters and
 * merges; normalizer Prepend(▁) + Replace(" " -> ▁), decoder Replace + ByteFallback + Strip. */
static char *write_sp_json(const char *dir)
{
    json_t *vocab = json_object();
    json_object_set_new(vocab, "<unk>", json_integer(0));
    json_object_set_new(vocab, "<s>", json_integer(1));
    json_object_set_new(vocab, "</s>", json_integer(2));
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        json_object_set_new(vocab, name, json_integer(3 + b));
    }
    const char *pieces[] = {U,     "h",  "e",    "l",      "o",       "w",   "r", "d",
                            U "h", "ll", U "he", U "hell", U "hello", U "w", "or"};
    for (int i = 0; i < 15; i++)
        json_object_set_new(vocab, pieces[i], json_integer(259 + i));
    json_t *merges =
        json_pack("[sssssss]", U " h", "l l", U "h e", U "he ll", U "hell o", U " w", "o r");
    json_t *added = json_array();
    const char *names[] = {"<unk>", "<s>", "</s>"};
    for (int i = 0; i < 3; i++)
        json_array_append_new(added, json_pack("{s:i,s:s,s:b,s:b,s:b,s:b,s:b}", "id", i, "content",
                                               names[i], "single_word", 0, "lstrip", 0, "rstrip", 0,
                                               "normalized", 0, "special", 1));
    json_t *root = json_pack(
        "{s:o,s:{s:s,s:[{s:s,s:s},{s:s,s:{s:s},s:s}]},s:n,"
        "s:{s:s,s:[{s:s,s:{s:s},s:s},{s:s},{s:s},{s:s,s:s,s:i,s:i}]},"
        "s:{s:s,s:n,s:s,s:b,s:b,s:b,s:o,s:o}}",
        "added_tokens", added, "normalizer", "type", "Sequence", "normalizers", "type", "Prepend",
        "prepend", U, "type", "Replace", "pattern", "String", " ", "content", U, "pre_tokenizer",
        "decoder", "type", "Sequence", "decoders", "type", "Replace", "pattern", "String", U,
        "content", " ", "type", "ByteFallback", "type", "Fuse", "type", "Strip", "content", " ",
        "start", 1, "stop", 0, "model", "type", "BPE", "dropout", "unk_token", "<unk>", "fuse_unk",
        1, "byte_fallback", 1, "ignore_merges", 0, "vocab", vocab, "merges", merges);
    ck_assert_ptr_nonnull(root);
    char *path = join(dir, "tokenizer.json");
    ck_assert_int_eq(json_dump_file(root, path, 0), 0);
    json_decref(root);
    return path;
}

START_TEST(test_hf_json_sentencepiece)
{
    char *dir = tu_tmpdir();
    char *path = write_sp_json(dir);
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_hf_json(path, &tok, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(rekv_tokenizer_vocab_size(tok), 274);
    /* ▁ h e l l o ▁ w o r l d -> ▁hello ▁w or l d */
    const int32_t hw[] = {1, 271, 272, 273, 262, 266};
    check_ids(tok, "hello world", 1, hw, 6);
    /* é is not a piece: its two UTF-8 bytes C3 A9 fall back to <0xC3> <0xA9> */
    const int32_t he[] = {267, 3 + 0xC3, 3 + 0xA9};
    check_ids(tok, "h\xc3\xa9", -1, he, 3);
    /* x is not a piece either */
    const int32_t x[] = {259, 3 + 'x'};
    check_ids(tok, "x", -1, x, 2);
    /* a special in the text; the segment after it gets its own ▁ */
    const int32_t sp[] = {271, 2, 271};
    check_ids(tok, "hello</s>hello", -1, sp, 3);
    const int32_t none[] = {0};
    check_ids(tok, "", -1, none, 0);
    /* decode: ▁ -> space, bytes fused, specials skipped, the leading space stripped */
    const int32_t ids[] = {1, 271, 272, 273, 262, 266, 267, 3 + 0xC3, 3 + 0xA9, 2};
    char *s = decode(tok, ids, 10);
    ck_assert_str_eq(s, "hello world h\xc3\xa9");
    free(s);
    check_case(tok, "hello wor\xc3\xa9ld  x", strlen("hello wor\xc3\xa9ld  x"), -1, NULL, 1);
    rekv_tokenizer_free(tok);
    tu_rmrf(dir);
    free(path);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- Unicode normalizers */

#define E_ACUTE "\xc3\xa9" /* U+00E9, é precomposed */
#define ACUTE "\xcc\x81"   /* U+0301, combining acute accent */
#define FI "\xef\xac\x81"  /* U+FB01, the fi ligature: compatibility-decomposes to "fi" */

/* A char BPE tokenizer.json with no merges and no pre-tokenizer, so each character that is a piece
 * encodes as itself: <unk> <s> </s>, 256 byte pieces (ids 3..258), then these. */
static const char *const k_norm_pieces[] = {"e", E_ACUTE, ACUTE, "x", "f", "i", "'"};
enum { P_E = 259, P_EACUTE, P_ACUTE, P_X, P_F, P_I, P_APOS };
#define B(b) (3 + (b)) /* the byte-fallback piece of byte b */

/* Loads that tokenizer with the given normalizer (stolen; NULL: none). */
static rekv_tokenizer *load_norm_tok(json_t *normalizer)
{
    json_t *vocab = json_object();
    const char *names[] = {"<unk>", "<s>", "</s>"};
    json_t *added = json_array();
    for (int i = 0; i < 3; i++) {
        json_object_set_new(vocab, names[i], json_integer(i));
        json_array_append_new(added, json_pack("{s:i,s:s,s:b,s:b}", "id", i, "content", names[i],
                                               "normalized", 0, "special", 1));
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        json_object_set_new(vocab, name, json_integer(B(b)));
    }
    for (int i = 0; i < (int)(sizeof(k_norm_pieces) / sizeof(k_norm_pieces[0])); i++)
        json_object_set_new(vocab, k_norm_pieces[i], json_integer(P_E + i));
    json_t *root = json_pack(
        "{s:o,s:o,s:n,s:{s:s,s:[{s:s},{s:s}]},s:{s:s,s:s,s:b,s:o,s:[]}}", "added_tokens", added,
        "normalizer", normalizer ? normalizer : json_null(), "pre_tokenizer", "decoder", "type",
        "Sequence", "decoders", "type", "ByteFallback", "type", "Fuse", "model", "type", "BPE",
        "unk_token", "<unk>", "byte_fallback", 1, "vocab", vocab, "merges");
    ck_assert_ptr_nonnull(root);
    char *dir = tu_tmpdir();
    char *path = join(dir, "tokenizer.json");
    ck_assert_int_eq(json_dump_file(root, path, 0), 0);
    json_decref(root);
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_hf_json(path, &tok, &err) == 0, "%s", err.msg);
    tu_rmrf(dir);
    free(path);
    free(dir);
    return tok;
}

static json_t *norm_form(const char *type)
{
    return json_pack("{s:s}", "type", type);
}

static json_t *norm_replace(const char *from, const char *to)
{
    return json_pack("{s:s,s:{s:s},s:s}", "type", "Replace", "pattern", "String", from, "content",
                     to);
}

static json_t *norm_seq2(json_t *a, json_t *b)
{
    return json_pack("{s:s,s:[oo]}", "type", "Sequence", "normalizers", a, b);
}

/* check_ids for text that may hold NUL bytes. */
static void check_ids_len(const rekv_tokenizer *tok, const char *text, size_t len,
                          const int32_t *want, size_t n_want)
{
    rekv_err err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    ck_assert_msg(rekv_tokenizer_encode(tok, text, len, -1, &ids, &n, &err) == 0, "%s", err.msg);
    ck_assert_msg(n == n_want, "%zu-byte text: %zu ids, want %zu", len, n, n_want);
    for (size_t i = 0; i < n; i++)
        ck_assert_msg(ids[i] == want[i], "%zu-byte text: id %zu is %d, want %d", len, i, ids[i],
                      want[i]);
    free(ids);
}

START_TEST(test_hf_json_unicode_forms)
{
    const int32_t composed[] = {P_EACUTE}, decomposed[] = {P_E, P_ACUTE};
    const int32_t fi[] = {P_F, P_I}, lig[] = {B(0xEF), B(0xAC), B(0x81)};
    const int32_t fi_e_acute[] = {P_F, P_I, P_E, P_ACUTE};

    /* no normalizer: the two spellings of é are different tokens */
    rekv_tokenizer *tok = load_norm_tok(NULL);
    check_ids(tok, "e" ACUTE, -1, decomposed, 2);
    check_ids(tok, E_ACUTE, -1, composed, 1);
    check_ids(tok, FI, -1, lig, 3);
    rekv_tokenizer_free(tok);

    /* NFC: both become the precomposed piece; decode gives the normalized text */
    tok = load_norm_tok(norm_form("NFC"));
    check_ids(tok, "e" ACUTE, -1, composed, 1);
    check_ids(tok, E_ACUTE, -1, composed, 1);
    check_ids(tok, FI, -1, lig, 3); /* a compatibility character: NFC keeps it */
    const int32_t two[] = {P_EACUTE, P_X, P_EACUTE};
    check_ids(tok, "e" ACUTE "x" E_ACUTE, -1, two, 3);
    check_case(tok, E_ACUTE "x" FI, strlen(E_ACUTE "x" FI), -1, NULL, 1);
    int32_t ids[] = {P_E, P_ACUTE};
    char *s = decode(tok, ids, 2); /* decode does not normalize */
    ck_assert_str_eq(s, "e" ACUTE);
    free(s);
    /* each segment between specials is normalized on its own, like HF's split on added tokens */
    const int32_t sp[] = {P_EACUTE, 2, P_EACUTE};
    check_ids(tok, "e" ACUTE "</s>e" ACUTE, -1, sp, 3);
    const int32_t apart[] = {P_E, 2, P_ACUTE};
    check_ids(tok, "e</s>" ACUTE, -1, apart, 3);
    rekv_tokenizer_free(tok);

    /* NFD: both become e + U+0301 */
    tok = load_norm_tok(norm_form("NFD"));
    check_ids(tok, "e" ACUTE, -1, decomposed, 2);
    check_ids(tok, E_ACUTE, -1, decomposed, 2);
    check_ids(tok, FI, -1, lig, 3);
    rekv_tokenizer_free(tok);

    /* NFKC: the ligature becomes "fi", é composes */
    tok = load_norm_tok(norm_form("NFKC"));
    check_ids(tok, FI, -1, fi, 2);
    check_ids(tok, "e" ACUTE, -1, composed, 1);
    rekv_tokenizer_free(tok);

    /* NFKD: the ligature becomes "fi", é decomposes */
    tok = load_norm_tok(norm_form("NFKD"));
    check_ids(tok, FI E_ACUTE, -1, fi_e_acute, 4);
    rekv_tokenizer_free(tok);
}
END_TEST

START_TEST(test_hf_json_unicode_sequence)
{
    const int32_t composed[] = {P_EACUTE}, decomposed[] = {P_E, P_ACUTE}, x[] = {P_X};
    const int32_t apos[] = {P_E, P_APOS};

    /* Replace(' -> U+0301) then NFC: the accent the Replace makes is composed */
    rekv_tokenizer *tok = load_norm_tok(norm_seq2(norm_replace("'", ACUTE), norm_form("NFC")));
    check_ids(tok, "e'", -1, composed, 1);
    rekv_tokenizer_free(tok);
    /* NFC then Replace(' -> U+0301): it comes too late to be composed */
    tok = load_norm_tok(norm_seq2(norm_form("NFC"), norm_replace("'", ACUTE)));
    check_ids(tok, "e'", -1, decomposed, 2);
    rekv_tokenizer_free(tok);

    /* NFC then Replace(é -> x): the Replace sees the composed é */
    tok = load_norm_tok(norm_seq2(norm_form("NFC"), norm_replace(E_ACUTE, "x")));
    check_ids(tok, "e" ACUTE, -1, x, 1);
    check_ids(tok, E_ACUTE, -1, x, 1);
    rekv_tokenizer_free(tok);
    /* Replace(é -> x) then NFC: the decomposed spelling slips past the Replace */
    tok = load_norm_tok(norm_seq2(norm_replace(E_ACUTE, "x"), norm_form("NFC")));
    check_ids(tok, "e" ACUTE, -1, composed, 1);
    check_ids(tok, E_ACUTE, -1, x, 1);
    rekv_tokenizer_free(tok);

    /* NFD then Replace(U+0301 -> '): accents stripped to apostrophes, whatever the spelling */
    tok = load_norm_tok(norm_seq2(norm_form("NFD"), norm_replace(ACUTE, "'")));
    check_ids(tok, E_ACUTE, -1, apos, 2);
    check_ids(tok, "e" ACUTE, -1, apos, 2);
    rekv_tokenizer_free(tok);

    /* nested Sequences flatten in order: [[NFD, Replace(U+0301 -> ')], NFC] */
    tok = load_norm_tok(
        norm_seq2(norm_seq2(norm_form("NFD"), norm_replace(ACUTE, "'")), norm_form("NFC")));
    check_ids(tok, E_ACUTE, -1, apos, 2);
    rekv_tokenizer_free(tok);
}
END_TEST

/* Text that is not valid UTF-8: each valid run is normalized on its own and every other byte is
 * kept as it is (so it reaches byte fallback); a character is never composed across such a byte. */
START_TEST(test_hf_json_unicode_invalid_utf8)
{
    const char *const forms[] = {"NFC", "NFD", "NFKC", "NFKD"};
    for (int f = 0; f < 4; f++) {
        rekv_tokenizer *tok = load_norm_tok(norm_form(forms[f]));
        int nfc = f == 0 || f == 2;
        /* e, a stray 0xFF, then a combining accent that has nothing to compose with */
        const int32_t ff[] = {P_E, B(0xFF), P_ACUTE};
        check_ids(tok, "e\xff" ACUTE, -1, ff, 3);
        /* both spellings of é, x, then a truncated 3-byte sequence */
        const char trunc[] = "e" ACUTE E_ACUTE "x\xe2\x82";
        if (nfc) {
            const int32_t want[] = {P_EACUTE, P_EACUTE, P_X, B(0xE2), B(0x82)};
            check_ids(tok, trunc, -1, want, 5);
        } else {
            const int32_t want[] = {P_E, P_ACUTE, P_E, P_ACUTE, P_X, B(0xE2), B(0x82)};
            check_ids(tok, trunc, -1, want, 7);
        }
        /* a surrogate encoded in UTF-8 (invalid) between e and the accent */
        const int32_t sur[] = {P_E, B(0xED), B(0xA0), B(0x80), P_ACUTE};
        check_ids(tok, "e\xed\xa0\x80" ACUTE, -1, sur, 5);
        /* NUL is a valid character (a starter): the accent after it stays separate */
        const char nul[] = "e\0" ACUTE;
        const int32_t nul_ids[] = {P_E, B(0), P_ACUTE};
        check_ids_len(tok, nul, sizeof(nul) - 1, nul_ids, 3);
        rekv_tokenizer_free(tok);
    }
}
END_TEST

/* The byte-level form: HF applies the normalizer before the ByteLevel pre-tokenizer. */
START_TEST(test_hf_json_byte_level_nfc)
{
    const char *p = tu_shared("models/opt-tiny-py/vocab.json");
    if (p == NULL)
        return;
    char *vocab = xstrdup(p);
    p = tu_shared("models/opt-tiny-py/merges.txt");
    if (p == NULL) {
        free(vocab);
        return;
    }
    char *merges = xstrdup(p);
    /* naïve café!, with ï and é decomposed and precomposed */
    const char *dec = "nai\xcc\x88ve cafe" ACUTE "!", *pre = "na\xc3\xafve caf" E_ACUTE "!";
    for (int nfc = 0; nfc < 2; nfc++) {
        char *dir = tu_tmpdir();
        char *path = write_hf_json(dir, vocab, merges, 1, nfc ? norm_form("NFC") : NULL);
        rekv_tokenizer *tok = NULL;
        rekv_err err = {0};
        ck_assert_msg(rekv_tokenizer_load_hf_json(path, &tok, &err) == 0, "%s", err.msg);
        check_reference(tok, "opt-tiny-py"); /* its texts are NFC already */
        size_t nd, np;
        int32_t *id_d = encode(tok, dec, -1, &nd), *id_p = encode(tok, pre, -1, &np);
        int same = nd == np && memcmp(id_d, id_p, nd * sizeof(*id_d)) == 0;
        char *back = decode(tok, id_d, nd);
        if (nfc) {
            ck_assert_msg(same, "NFC: the decomposed text encodes differently");
            ck_assert_str_eq(back, pre);
        } else {
            ck_assert_msg(!same, "no normalizer: the two spellings encode the same");
            ck_assert_str_eq(back, dec);
        }
        free(back);
        free(id_d);
        free(id_p);
        /* every byte still encodes */
        const char odd[] = "a\xff\xc3(b " ACUTE "\xe2\x82\xac\xed\xa0\x80 \t\n  x\x00y";
        check_case(tok, odd, sizeof(odd) - 1, -1, NULL, 1);
        rekv_tokenizer_free(tok);
        tu_rmrf(dir);
        free(path);
        free(dir);
    }
    free(vocab);
    free(merges);
}
END_TEST

/* ---------------------------------------------------------------- malformed files */

static void expect_fail_bin(const char *path, const void *data, size_t len)
{
    write_file(path, data, len);
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    int rc = rekv_tokenizer_load_llama2c(path, &tok, &err);
    ck_assert_msg(rc < 0, "%zu-byte tokenizer.bin loaded", len);
    ck_assert_ptr_null(tok);
    ck_assert_msg(strstr(err.msg, path) != NULL, "message \"%s\" lacks the path", err.msg);
}

START_TEST(test_malformed_llama2c)
{
    char *dir = tu_tmpdir();
    char *path = join(dir, "tokenizer.bin");
    const char *p = tu_shared("tokenizers/llama2/tokenizer.bin");
    if (p != NULL) {
        size_t len;
        char *data = tu_read_file(p, &len);
        ck_assert_ptr_nonnull(data);
        size_t cuts[] = {0, 2, 4, 7, 12, 1000, len / 2, len - 1};
        for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++)
            expect_fail_bin(path, data, cuts[i]);
        free(data);
    }
    /* negative and huge lengths, a bad header, a NaN score */
    int32_t neg[] = {16, 0, -5};
    expect_fail_bin(path, neg, sizeof(neg));
    int32_t huge[] = {16, 0, 0x7fffffff, 0};
    expect_fail_bin(path, huge, sizeof(huge));
    int32_t badmax[] = {-1, 0, 1, 0x41};
    expect_fail_bin(path, badmax, sizeof(badmax));
    uint32_t nan[] = {16, 0x7fc00000u, 1, 0x41};
    expect_fail_bin(path, nan, sizeof(nan));
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_tokenizer_load_llama2c("/nonexistent/tokenizer.bin", &tok, &err),
                     -ENOENT);
    ck_assert_ptr_nonnull(strstr(err.msg, "/nonexistent/tokenizer.bin"));
    tu_rmrf(dir);
    free(path);
    free(dir);
}
END_TEST

static void expect_fail_bpe(const char *vocab, const char *merges, const char *blame)
{
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    int rc = rekv_tokenizer_load_bpe(vocab, merges, &tok, &err);
    ck_assert_msg(rc < 0, "loaded %s + %s", vocab, merges);
    ck_assert_ptr_null(tok);
    ck_assert_msg(strstr(err.msg, blame) != NULL, "message \"%s\" lacks %s", err.msg, blame);
}

START_TEST(test_malformed_bpe)
{
    char *dir = tu_tmpdir();
    char *vocab = join(dir, "vocab.json"), *merges = join(dir, "merges.txt");
    char *tj = join(dir, "tokenizer.json");
    const char good_vocab[] = "{\"a\": 0, \"b\": 1, \"ab\": 2, \"<s>\": 3}";
    write_file(vocab, good_vocab, strlen(good_vocab));
    write_file(merges, "#version: 0.2\na b\n", 18);
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_bpe(vocab, merges, &tok, &err) == 0, "%s", err.msg);
    const int32_t ab[] = {2, 3, 0};
    check_ids(tok, "ab<s>a", -1, ab, 3);
    /* a byte with no token and no <unk>: an error, not a crash */
    size_t n;
    int32_t *ids = NULL;
    rekv_err_clear(&err);
    ck_assert_int_lt(rekv_tokenizer_encode(tok, "abc", 3, -1, &ids, &n, &err), 0);
    ck_assert_ptr_null(ids);
    rekv_tokenizer_free(tok);

    /* merges with unknown tokens, or making an unknown token, or malformed lines */
    const char *bad_merges[] = {"a zz\n", "b a\n", "a\n", "a b c\n", " a\n"};
    for (size_t i = 0; i < sizeof(bad_merges) / sizeof(bad_merges[0]); i++) {
        write_file(merges, bad_merges[i], strlen(bad_merges[i]));
        expect_fail_bpe(vocab, merges, merges);
    }
    write_file(merges, "a b\n", 4);
    /* garbage and wrong-typed vocab.json */
    const char *bad_vocab[] = {"\x01garbage{",
                               "",
                               "[1, 2]",
                               "{\"a\": \"x\"}",
                               "{\"a\": -1}",
                               "{\"a\": 99999999999}",
                               "{\"a\": 0, \"b\": 0}",
                               "{}",
                               "{\"a\": 0, \"b\": 1, \"ab\": 2"};
    for (size_t i = 0; i < sizeof(bad_vocab) / sizeof(bad_vocab[0]); i++) {
        write_file(vocab, bad_vocab[i], strlen(bad_vocab[i]));
        expect_fail_bpe(vocab, merges, vocab);
    }
    /* missing files */
    write_file(vocab, good_vocab, strlen(good_vocab));
    expect_fail_bpe(vocab, "/nonexistent/merges.txt", "/nonexistent/merges.txt");
    expect_fail_bpe("/nonexistent/vocab.json", merges, "/nonexistent/vocab.json");
    /* a broken special_tokens_map.json beside vocab.json is reported */
    char *stm = join(dir, "special_tokens_map.json");
    write_file(stm, "{", 1);
    expect_fail_bpe(vocab, merges, stm);
    unlink(stm);

    /* tokenizer.json: invalid JSON, unsupported model, unknown merge tokens, bad added tokens */
    const char *bad_tj[] = {
        "not json",
        "{}",
        "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a q\"]}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [[\"a\"]]}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": 5}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"added_tokens\": [{\"id\": "
        "-4, \"content\": \"x\"}]}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": "
        "\"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\"}, \"decoder\": "
        "{\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"normalizer\": {\"type\": "
        "\"Lowercase\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"normalizer\": {\"type\": "
        "\"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}, {\"type\": \"NFKC_CF\"}]}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}}, \"normalizer\": {\"type\": "
        "\"Sequence\", \"normalizers\": {\"type\": \"NFC\"}}}",
        /* a bad escape before a line break and a control byte: the parser's message quotes them
         * (found by fuzz_parsers); an error is still one line */
        "{\"model\": \"\\\n\x01\"}",
    };
    for (size_t i = 0; i < sizeof(bad_tj) / sizeof(bad_tj[0]); i++) {
        write_file(tj, bad_tj[i], strlen(bad_tj[i]));
        tok = NULL;
        rekv_err_clear(&err);
        ck_assert_msg(rekv_tokenizer_load_hf_json(tj, &tok, &err) < 0, "loaded %s", bad_tj[i]);
        ck_assert_ptr_null(tok);
        ck_assert_msg(strstr(err.msg, tj) != NULL, "message \"%s\" lacks the path", err.msg);
        for (const char *c = err.msg; *c; c++)
            ck_assert_msg((unsigned char)*c >= 0x20 && *c != 0x7f,
                          "message of %s holds control byte %#x", bad_tj[i], (unsigned char)*c);
    }
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_tokenizer_load_hf_json("/nonexistent/tokenizer.json", &tok, &err),
                     -ENOENT);
    ck_assert_ptr_nonnull(strstr(err.msg, "/nonexistent/tokenizer.json"));
    tu_rmrf(dir);
    free(stm);
    free(vocab);
    free(merges);
    free(tj);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("tokenizer");
    TCase *tc = tcase_create("tokenizer");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_llama2c_expected);
    tcase_add_test(tc, test_llama2c_for_model);
    tcase_add_test(tc, test_bpe_opt);
    tcase_add_test(tc, test_bpe_llama);
    tcase_add_test(tc, test_hf_json_byte_level);
    tcase_add_test(tc, test_hf_json_sentencepiece);
    tcase_add_test(tc, test_hf_json_unicode_forms);
    tcase_add_test(tc, test_hf_json_unicode_sequence);
    tcase_add_test(tc, test_hf_json_unicode_invalid_utf8);
    tcase_add_test(tc, test_hf_json_byte_level_nfc);
    tcase_add_test(tc, test_malformed_llama2c);
    tcase_add_test(tc, test_malformed_bpe);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
