/* tokenizer_internal.h — the private tokenizer structure shared by the loaders (tokenizer_hf.c,
 * tokenizer_llama2c.c), the tables (tokenizer.c), the encoder (tokenizer_encode.c,
 * tokenizer_normalize.c) and the decoder (tokenizer_decode.c).
 *
 * All three tokenizer families are one BPE engine over a table of pieces; they differ in how text
 * becomes initial symbols (bytes through the GPT-2 byte map, UTF-8 characters with byte fallback)
 * and in how a merge is ranked (merges.txt rank, or llama2.c's piece score). */
#ifndef REKV_LOADER_TOKENIZER_INTERNAL_H
#define REKV_LOADER_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>

#include "loader/loader.h"

#define TOK_MAX_VOCAB (1 << 24) /* ids above this are rejected: bounds the id table */
#define TOK_MAX_PIECE 4096      /* bytes in one token string */

/* The GPT-2 pre-tokenizer regex (used by vocab.json + merges.txt and by ByteLevel with use_regex).
 */
#define TOK_GPT2_PATTERN                                                                           \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

typedef enum tok_kind {
    TOK_BYTE_BPE = 0, /* GPT-2 byte-level BPE ranked by merges */
    TOK_CHAR_BPE = 1, /* SentencePiece-style BPE over characters, byte fallback, ranked by merges */
    TOK_LLAMA2C = 2,  /* llama2.c tokenizer.bin: merges chosen by the score of the merged piece */
} tok_kind;

enum {
    TOK_PIECE_NORMAL = 0,
    TOK_PIECE_SPECIAL = 1, /* matched in text, skipped by decode */
    TOK_PIECE_ADDED = 2,   /* matched in text, decoded as its literal content */
};

typedef struct tok_piece {
    char *s;      /* NUL-terminated; NULL for an unused id */
    uint32_t len; /* bytes of s */
    float score;  /* llama2.c merge score; 0 elsewhere */
    uint8_t kind; /* TOK_PIECE_* */
} tok_piece;

/* One step of a tokenizer.json normalizer; a Sequence becomes its steps in order. */
typedef enum tok_norm_kind {
    TOK_NORM_REPLACE = 0, /* replace every `from` with `to` */
    TOK_NORM_PREPEND = 1, /* prepend `to` to non-empty text */
    TOK_NORM_NFC = 2,     /* Unicode normal forms (utf8proc); from/to unused */
    TOK_NORM_NFD = 3,
    TOK_NORM_NFKC = 4,
    TOK_NORM_NFKD = 5,
} tok_norm_kind;

typedef struct tok_norm_op {
    tok_norm_kind kind;
    char *from, *to; /* NULL where the kind does not use them */
    size_t from_len, to_len;
} tok_norm_op;

typedef struct tok_cache tok_cache;

struct rekv_tokenizer {
    tok_kind kind;
    int32_t n_vocab;   /* ids are 0 .. n_vocab-1 */
    tok_piece *pieces; /* [n_vocab] */
    int32_t pieces_cap;

    /* piece string -> id: open addressing, -1 = empty; the first id of a duplicate string wins */
    int32_t *map_slots; /* [map_cap] */
    uint32_t map_cap;

    /* (left id, right id) -> (rank, merged id): open addressing, UINT64_MAX = empty */
    uint64_t *pair_keys;  /* [pair_cap] */
    int32_t *pair_rank;   /* [pair_cap] */
    int32_t *pair_merged; /* [pair_cap] */
    uint32_t pair_cap, n_pairs;

    /* ids matched literally in the input before pre-tokenization, longest string first */
    int32_t *specials;
    size_t n_specials;
    uint8_t special_first[256]; /* 1 when some special starts with this byte */

    pcre2_code *re;       /* pre-tokenizer split regex; NULL: a segment is one word */
    int re_removed;       /* Split behaviour "Removed": drop the matches, keep the gaps */
    int add_prefix_space; /* ByteLevel add_prefix_space */

    /* byte-level: id of each byte's GPT-2 unicode character; char BPE and llama2.c: id of the
     * <0xNN> byte-fallback piece; -1 when absent */
    int32_t byte_id[256];
    int16_t cp_byte[324]; /* byte-level decode: code point -> byte, -1 when not a byte char */

    /* normalizer ops, in order, applied to each segment between specials (both BPE kinds) */
    tok_norm_op *norm;
    size_t n_norm;

    /* char BPE text processing */
    char *ms_repl; /* Metaspace pre-tokenizer replacement ("▁"), NULL when none */
    size_t ms_repl_len;
    int ms_prepend;    /* 0 never, 1 always, 2 first segment only */
    int ms_split;      /* split words before each replacement char */
    int byte_fallback; /* unknown characters become <0xNN> pieces */
    int unk_id;        /* -1 when none */
    int fuse_unk;
    int ignore_merges; /* a word that is itself a piece is emitted whole */

    /* char BPE decoding */
    char *dec_from, *dec_to; /* replace dec_from by dec_to in every piece (▁ -> space) */
    size_t dec_from_len, dec_to_len;
    int dec_strip; /* strip up to this many leading spaces of the output */
    int dec_bytes; /* <0xNN> pieces decode to raw bytes */

    /* llama2.c */
    int bos_id;       /* the leading space of the piece after this id is dropped on decode */
    int dummy_prefix; /* prepend a space to non-empty text */

    tok_cache *cache; /* word -> ids; NULL for llama2.c */
};

/* ---- construction helpers (tokenizer.c) */
rekv_tokenizer *tok_new(tok_kind kind);
/* Sets id's piece (copying s); grows the table. path names the file for errors. */
int tok_set_piece(rekv_tokenizer *tok, int64_t id, const char *s, size_t len, float score, int kind,
                  const char *path, rekv_err *err);
/* (Re)builds the piece -> id index; call after the pieces change. */
int tok_index_build(rekv_tokenizer *tok, const char *path, rekv_err *err);
int32_t tok_lookup(const rekv_tokenizer *tok, const char *s, size_t len);
/* Adds a merge; a pair seen before keeps its first (lowest) rank. */
int tok_pair_add(rekv_tokenizer *tok, int32_t a, int32_t b, int32_t rank, int32_t merged,
                 const char *path, rekv_err *err);
/* Marks id as special/added (kind) and registers it for matching in text. */
int tok_special_add(rekv_tokenizer *tok, int32_t id, int kind, const char *path, rekv_err *err);
/* Sorts the specials longest first; call once after the last tok_special_add. */
void tok_specials_finish(rekv_tokenizer *tok);
/* Compiles a pre-tokenizer regex (UTF + Unicode properties). literal: match the text as is. */
int tok_regex_set(rekv_tokenizer *tok, const char *pattern, size_t len, int literal,
                  const char *path, rekv_err *err);
/* Fills byte_id/cp_byte from the GPT-2 byte-to-unicode map. */
void tok_byte_level_init(rekv_tokenizer *tok);
/* Fills byte_id from <0xNN> pieces. */
void tok_byte_fallback_init(rekv_tokenizer *tok);

/* Length (1-4) of the valid UTF-8 sequence at p (n bytes available), 0 when invalid. */
int tok_utf8_len(const unsigned char *p, size_t n);
/* FNV-1a of len bytes of s. */
uint32_t tok_hash_bytes(const char *s, size_t len);
/* The merge of (a, b): 1 with its rank and merged id, 0 when there is none. */
int tok_pair_find(const rekv_tokenizer *tok, int32_t a, int32_t b, int32_t *rank, int32_t *merged);

/* ---- the word cache (tokenizer_encode.c) */
int tok_cache_create(rekv_tokenizer *tok, const char *path, rekv_err *err);
void tok_cache_free(tok_cache *c);

/* ---- normalizers (tokenizer_normalize.c) */
/* Applies the tokenizer's normalizer ops in order to a segment. *work is NULL when nothing
 * changed the text, else the malloc'd result (*wn bytes); the caller frees it. */
int tok_normalize(const rekv_tokenizer *tok, const char *s, size_t n, char **work, size_t *wn,
                  rekv_err *err);
/* A malloc'd copy of src (n bytes) with every `from` replaced by `to` and `pre` prepended (*out_len
 * bytes, NUL-terminated); NULL when out of memory. */
char *tok_str_rewrite(const char *pre, size_t pre_len, const char *src, size_t n, const char *from,
                      size_t from_len, const char *to, size_t to_len, size_t *out_len);

#endif
