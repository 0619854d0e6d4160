/* fuzz_parsers.c — a deterministic mutation fuzzer for every parser of untrusted model files.
 *
 * Built with ASan and UBSan (make fuzz). Each seed input — small files generated here (synthetic
 * models, tokenizers, llama2.c checkpoints) and the models under ../shared when present, copied
 * into a private temporary directory — is mutated a few thousand times (bit flips, byte sets,
 * truncations, insertions, deletions, header-length corruption, JSON token swaps and
 * substitutions, line shuffles) and every mutant goes through the public loader API: safetensors,
 * HF model directories (config.json or model.safetensors mutated), llama2.c checkpoints, and the
 * BPE, tokenizer.json and tokenizer.bin loaders, GGUF files (a tiny llama one made here and
 * those of ../shared/gguf, their headers mutated) and chat templates (chat_template.jinja and
 * tokenizer_config.json, through rekv_chat_template_load_dir). Whatever opens is then used
 * (tensors touched, text encoded and decoded). Random byte strings go through every valid
 * tokenizer's encoder.
 *
 * A crash or sanitizer report aborts the process, naming the case; `--only SEED:ITER` replays it.
 * The same arguments always produce the same mutants.
 *
 *   fuzz_parsers [--shard I/N] [--scale F] [--only SEED[:ITER]] [--list] [--keep] */
#define _GNU_SOURCE
#include "loader/chat_template.h"
#include "loader/gguf.h"
#include "loader/loader.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define FZ_HAVE_SANITIZER 1
#endif

/* ---------------------------------------------------------------- buffers and randomness */

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void die(const char *what)
{
    fprintf(stderr, "fuzz_parsers: %s: %s\n", what, strerror(errno));
    exit(2);
}

static void buf_reserve(buf *b, size_t cap)
{
    if (cap <= b->cap)
        return;
    size_t c = b->cap ? b->cap : 256;
    while (c < cap)
        c *= 2;
    b->p = realloc(b->p, c);
    if (b->p == NULL)
        die("realloc");
    b->cap = c;
}

static void buf_set(buf *b, const void *p, size_t n)
{
    buf_reserve(b, n + 1);
    if (n)
        memcpy(b->p, p, n);
    b->n = n;
}

static void buf_add(buf *b, const void *p, size_t n)
{
    buf_reserve(b, b->n + n + 1);
    if (n)
        memcpy(b->p + b->n, p, n);
    b->n += n;
}

static void buf_adds(buf *b, const char *s)
{
    buf_add(b, s, strlen(s));
}

static void buf_printf(buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(buf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    buf_add(b, tmp, (size_t)n < sizeof(tmp) ? (size_t)n : sizeof(tmp) - 1);
}

/* Replaces b[at, at + del) with ins[0, nins). */
static void buf_splice(buf *b, size_t at, size_t del, const void *ins, size_t nins)
{
    if (at > b->n)
        at = b->n;
    if (del > b->n - at)
        del = b->n - at;
    buf_reserve(b, b->n - del + nins + 1);
    memmove(b->p + at + nins, b->p + at + del, b->n - at - del);
    if (nins)
        memcpy(b->p + at, ins, nins);
    b->n = b->n - del + nins;
}

static uint64_t g_rng;

static uint64_t rnd(void)
{
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t below(size_t n)
{
    return n ? (size_t)(rnd() % n) : 0;
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* ---------------------------------------------------------------- files */

static char g_root[PATH_MAX];

static void write_file(const char *path, const void *p, size_t n)
{
    unlink(path); /* never write through a link to a file we do not own */
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        die(path);
    const uint8_t *q = p;
    while (n > 0) {
        ssize_t w = write(fd, q, n);
        if (w <= 0)
            die(path);
        q += w;
        n -= (size_t)w;
    }
    close(fd);
}

static int read_file(const char *path, buf *b)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    b->n = 0;
    uint8_t tmp[1 << 16];
    ssize_t r;
    while ((r = read(fd, tmp, sizeof(tmp))) > 0)
        buf_add(b, tmp, (size_t)r);
    close(fd);
    return 0;
}

static const char *path_in(const char *dir, const char *name)
{
    static char p[8][PATH_MAX];
    static int k;
    char *s = p[k++ & 7];
    snprintf(s, PATH_MAX, "%s/%s", dir, name);
    return s;
}

static void make_dir(const char *p)
{
    if (mkdir(p, 0755) != 0 && errno != EEXIST)
        die(p);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

/* ---------------------------------------------------------------- seeds */

typedef enum kind {
    K_SAFETENSORS = 0, /* header length + JSON + data */
    K_JSON = 1,
    K_TEXT = 2,   /* line oriented (merges.txt) */
    K_BINARY = 3, /* llama2.c checkpoint or tokenizer.bin: int32 fields */
} kind;

typedef enum target {
    T_ST = 0,        /* rekv_safetensors_open on the file */
    T_MODEL = 1,     /* rekv_model_open on the seed's directory (config or weights mutated) */
    T_L2C = 2,       /* rekv_model_open on a llama2.c .bin */
    T_BPE_VOCAB = 3, /* rekv_tokenizer_load_bpe, vocab.json mutated */
    T_BPE_MERGES = 4,
    T_HF_JSON = 5, /* rekv_tokenizer_load_hf_json */
    T_TOKBIN = 6,  /* rekv_tokenizer_load_llama2c */
    T_GGUF = 7,    /* rekv_gguf_open, then its tensors dequantized */
    T_CHAT = 8,    /* rekv_chat_template_load_dir, then a render of a conversation with tools */
} target;

typedef struct seed {
    char name[64];
    target tgt;
    kind kind;
    char dir[PATH_MAX + 80]; /* the seed's private directory, with any companion files */
    char file[64];           /* the mutated file's name in dir */
    buf orig;                /* the whole original file */
    size_t prefix;           /* mutations touch orig[0, prefix); the rest is a constant tail */
    int iters;
} seed;

static seed *g_seeds;
static size_t g_n_seeds;

static seed *seed_add(const char *name, target t, kind k, const char *file, int iters)
{
    g_seeds = realloc(g_seeds, (g_n_seeds + 1) * sizeof(*g_seeds));
    if (g_seeds == NULL)
        die("realloc");
    seed *s = &g_seeds[g_n_seeds++];
    memset(s, 0, sizeof(*s));
    snprintf(s->name, sizeof(s->name), "%s", name);
    s->tgt = t;
    s->kind = k;
    snprintf(s->file, sizeof(s->file), "%s", file);
    snprintf(s->dir, sizeof(s->dir), "%s/%s", g_root, name);
    make_dir(s->dir);
    s->iters = iters;
    return s;
}

/* Reads the seed's file from its directory (after the caller put it there). */
static void seed_load(seed *s)
{
    if (read_file(path_in(s->dir, s->file), &s->orig) != 0)
        die(path_in(s->dir, s->file));
    s->prefix = s->orig.n;
}

/* Large safetensors files: only the header is mutated; the data stays on disk. */
static void seed_header_only(seed *s)
{
    if (s->orig.n < 8)
        return;
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--)
        h = h << 8 | s->orig.p[i];
    if (h <= s->orig.n - 8)
        s->prefix = 8 + (size_t)h;
}

/* GGUF files: the metadata and tensor infos are mutated; the tensor data stay on disk. */
static void seed_gguf_header_only(seed *s)
{
    rekv_gguf *g = NULL;
    if (rekv_gguf_open(path_in(s->dir, s->file), &g, NULL) != 0)
        die("a GGUF seed does not open");
    s->prefix = (size_t)g->data_offset;
    rekv_gguf_close(g);
}

static void copy_in(const char *src, const char *dir, const char *name)
{
    buf b = {0};
    if (read_file(src, &b) != 0)
        die(src);
    write_file(path_in(dir, name), b.p, b.n);
    free(b.p);
}

static void link_in(const char *src, const char *dir, const char *name)
{
    char abs[PATH_MAX];
    if (realpath(src, abs) == NULL)
        die(src);
    unlink(path_in(dir, name));
    if (symlink(abs, path_in(dir, name)) != 0)
        die("symlink");
}

static int exists(const char *p)
{
    return access(p, R_OK) == 0;
}

/* GPT-2's byte-to-unicode map, as UTF-8. */
static void byte_unicode(int b, char out[4])
{
    int cp;
    if ((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) {
        cp = b;
    } else {
        int n = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= '!' && x <= '~') || (x >= 0xa1 && x <= 0xac) || (x >= 0xae && x <= 0xff)))
                n++;
        cp = 256 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    }
}

/* A tiny byte-level BPE: 4 specials, 256 bytes, a few merges. */
static const char *const k_merges[][2] = {
    {"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"i", "n"},   {"Ġ", "a"}, {"e", "r"}, {"o", "n"},
    {"Ġ", "s"}, {"r", "e"}, {"Ġ", "Ġ"},   {"ĠĠ", "ĠĠ"}, {"d", "e"}, {"Ġ", "("}, {"s", "elf"},
};

static void gen_bpe(buf *vocab, buf *merges, buf *tokjson)
{
    const char *specials[4] = {"<s>", "<pad>", "</s>", "<unk>"};
    buf v = {0};
    int id = 0;
    buf_adds(&v, "{");
    for (int i = 0; i < 4; i++)
        buf_printf(&v, "%s\"%s\": %d", i ? ", " : "", specials[i], id++);
    for (int b = 0; b < 256; b++) {
        char u[4];
        byte_unicode(b, u);
        if (u[0] == '"' || u[0] == '\\')
            buf_printf(&v, ", \"\\%s\": %d", u, id++);
        else
            buf_printf(&v, ", \"%s\": %d", u, id++);
    }
    /* "elf" must exist before "self" can be merged: add it as a plain merge result */
    buf m = {0};
    buf_adds(&m, "#version: 0.2\n");
    const char *extra[][2] = {{"e", "l"}, {"el", "f"}};
    for (int i = 0; i < 2; i++) {
        buf_printf(&m, "%s %s\n", extra[i][0], extra[i][1]);
        buf_printf(&v, ", \"%s%s\": %d", extra[i][0], extra[i][1], id++);
    }
    for (size_t i = 0; i < sizeof(k_merges) / sizeof(k_merges[0]); i++) {
        const char *a = k_merges[i][0], *b = k_merges[i][1];
        buf_printf(&m, "%s %s\n", a, b);
        buf_printf(&v, ", \"%s%s\": %d", a, b, id++);
    }
    buf_adds(&v, "}");
    buf_set(vocab, v.p, v.n);
    buf_set(merges, m.p, m.n);

    /* the same model as a tokenizer.json */
    buf t = {0};
    buf_adds(&t,
             "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \"added_tokens\": [");
    for (int i = 0; i < 4; i++)
        buf_printf(&t,
                   "%s{\"id\": %d, \"content\": \"%s\", \"single_word\": false, \"lstrip\": "
                   "false, \"rstrip\": false, \"normalized\": false, \"special\": true}",
                   i ? ", " : "", i, specials[i]);
    buf_adds(&t, "], \"normalizer\": null, \"pre_tokenizer\": {\"type\": \"ByteLevel\", "
                 "\"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": true}, "
                 "\"post_processor\": null, \"decoder\": {\"type\": \"ByteLevel\", "
                 "\"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true}, "
                 "\"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
                 "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, "
                 "\"fuse_unk\": false, \"byte_fallback\": false, \"vocab\": ");
    buf_add(&t, v.p, v.n);
    buf_adds(&t, ", \"merges\": [");
    int first = 1;
    for (size_t i = 0; i < m.n;) {
        size_t e = i;
        while (e < m.n && m.p[e] != '\n')
            e++;
        if (m.p[i] != '#') {
            buf_adds(&t, first ? "\"" : ", \"");
            buf_add(&t, m.p + i, e - i);
            buf_adds(&t, "\"");
            first = 0;
        }
        i = e + 1;
    }
    buf_adds(&t, "]}}");
    buf_set(tokjson, t.p, t.n);
    free(v.p);
    free(m.p);
    free(t.p);
}

/* A tiny llama2.c tokenizer.bin: <unk>, <s>, </s>, 256 byte pieces, some words. */
static void gen_tokbin(buf *b)
{
    static const char *const words[] = {" ",  "e",  "t", "a",    "o",  " t",   "he",   " the",
                                        "in", " a", "▁", "▁the", "\n", "Once", " upon"};
    b->n = 0;
    int32_t maxlen = 16;
    buf_add(b, &maxlen, 4);
    char piece[16];
    for (int i = 0; i < 3 + 256 + (int)(sizeof(words) / sizeof(words[0])); i++) {
        const char *s;
        if (i < 3) {
            s = i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>";
        } else if (i < 259) {
            snprintf(piece, sizeof(piece), "<0x%02X>", i - 3);
            s = piece;
        } else {
            s = words[i - 259];
        }
        float score = i < 259 ? 0.0f : -(float)(i - 259);
        int32_t len = (int32_t)strlen(s);
        buf_add(b, &score, 4);
        buf_add(b, &len, 4);
        buf_add(b, s, (size_t)len);
    }
}

/* A tiny llama2.c checkpoint; vocab < 0 means a separate classifier. */
static void gen_l2c(buf *b, int32_t vocab)
{
    int32_t h[7] = {16, 32, 2, 4, 2, vocab, 8};
    int64_t dim = h[0], hid = h[1], L = h[2], V = vocab < 0 ? -vocab : vocab, seq = h[6];
    int64_t kv = dim * h[4] / h[3], hs = dim / h[3];
    int64_t n = V * dim + L * dim * 2 + L * dim * dim * 2 + L * kv * dim * 2 + L * hid * dim * 3 +
                dim + seq * hs + (vocab < 0 ? V * dim : 0);
    b->n = 0;
    buf_add(b, h, sizeof(h));
    for (int64_t i = 0; i < n; i++) {
        float f = (float)((int)(i * 2654435761u % 2001) - 1000) * 1e-3f;
        buf_add(b, &f, 4);
    }
}

/* A tiny llama GGUF (version 3): the llama.* keys, a byte-level BPE tokenizer (4 specials, 256
 * bytes, one merge), and f32 tensors for one layer of width 32 (2 heads of 16, 1 KV head). */
static void gg_str(buf *b, const char *s)
{
    uint64_t n = strlen(s);
    buf_add(b, &n, 8);
    buf_add(b, s, n);
}
static void gg_kv_u32(buf *b, const char *k, uint32_t v)
{
    uint32_t t = 4;
    gg_str(b, k);
    buf_add(b, &t, 4);
    buf_add(b, &v, 4);
}
static void gg_kv_f32(buf *b, const char *k, float v)
{
    uint32_t t = 6;
    gg_str(b, k);
    buf_add(b, &t, 4);
    buf_add(b, &v, 4);
}
static void gg_kv_str(buf *b, const char *k, const char *v)
{
    uint32_t t = 8;
    gg_str(b, k);
    buf_add(b, &t, 4);
    gg_str(b, v);
}
static void gg_arr(buf *b, const char *k, uint32_t et, uint64_t n)
{
    uint32_t t = 9;
    gg_str(b, k);
    buf_add(b, &t, 4);
    buf_add(b, &et, 4);
    buf_add(b, &n, 8);
}

static void gen_gguf(buf *b)
{
    enum { H = 32, F = 64, V = 261 };
    static const struct {
        const char *name;
        uint64_t ne0, ne1;
    } ts[] = {{"token_embd.weight", H, V},     {"output_norm.weight", H, 1},
              {"output.weight", H, V},         {"blk.0.attn_norm.weight", H, 1},
              {"blk.0.attn_q.weight", H, H},   {"blk.0.attn_k.weight", H, 16},
              {"blk.0.attn_v.weight", H, 16},  {"blk.0.attn_output.weight", H, H},
              {"blk.0.ffn_norm.weight", H, 1}, {"blk.0.ffn_gate.weight", H, F},
              {"blk.0.ffn_up.weight", H, F},   {"blk.0.ffn_down.weight", F, H}};
    const size_t nt = sizeof(ts) / sizeof(ts[0]);
    uint32_t u;
    uint64_t q;
    b->n = 0;
    buf_add(b, "GGUF", 4);
    u = 3, buf_add(b, &u, 4);
    q = nt, buf_add(b, &q, 8);
    q = 19, buf_add(b, &q, 8);
    gg_kv_str(b, "general.architecture", "llama");
    gg_kv_u32(b, "llama.context_length", 64);
    gg_kv_u32(b, "llama.embedding_length", H);
    gg_kv_u32(b, "llama.block_count", 1);
    gg_kv_u32(b, "llama.feed_forward_length", F);
    gg_kv_u32(b, "llama.attention.head_count", 2);
    gg_kv_u32(b, "llama.attention.head_count_kv", 1);
    gg_kv_u32(b, "llama.rope.dimension_count", 16);
    gg_kv_f32(b, "llama.rope.freq_base", 10000.0f);
    gg_kv_f32(b, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    gg_kv_u32(b, "llama.vocab_size", V);
    gg_kv_str(b, "tokenizer.ggml.model", "gpt2");
    gg_kv_str(b, "tokenizer.ggml.pre", "gpt-2");
    gg_arr(b, "tokenizer.ggml.tokens", 8, V);
    const char *specials[4] = {"<unk>", "<s>", "</s>", "<pad>"};
    for (int i = 0; i < 4; i++)
        gg_str(b, specials[i]);
    for (int i = 0; i < 256; i++) {
        char c[4];
        byte_unicode(i, c);
        gg_str(b, c);
    }
    gg_str(b, "he");
    gg_arr(b, "tokenizer.ggml.token_type", 5, V);
    for (int i = 0; i < V; i++) {
        int32_t t = i < 4 ? 3 : 1; /* CONTROL, NORMAL */
        buf_add(b, &t, 4);
    }
    gg_arr(b, "tokenizer.ggml.merges", 8, 1);
    gg_str(b, "h e");
    gg_kv_u32(b, "tokenizer.ggml.bos_token_id", 1);
    gg_kv_u32(b, "tokenizer.ggml.eos_token_id", 2);
    uint32_t bt = 7;
    gg_str(b, "tokenizer.ggml.add_bos_token");
    buf_add(b, &bt, 4);
    buf_add(b, "\1", 1);
    uint64_t off = 0;
    for (size_t i = 0; i < nt; i++) {
        gg_str(b, ts[i].name);
        u = ts[i].ne1 == 1 ? 1 : 2, buf_add(b, &u, 4);
        buf_add(b, &ts[i].ne0, 8);
        if (ts[i].ne1 != 1)
            buf_add(b, &ts[i].ne1, 8);
        u = 0, buf_add(b, &u, 4);
        buf_add(b, &off, 8);
        off += (ts[i].ne0 * ts[i].ne1 * 4 + 31) / 32 * 32;
    }
    while (b->n % 32)
        buf_add(b, "", 1);
    for (size_t i = 0; i < nt; i++) {
        for (uint64_t k = 0; k < ts[i].ne0 * ts[i].ne1; k++) {
            float x = ts[i].ne1 == 1 ? 1.0f : (float)((int)(k * 2654435761u % 2001) - 1000) * 1e-4f;
            buf_add(b, &x, 4);
        }
        while (b->n % 32)
            buf_add(b, "", 1);
    }
}

static void synth_into(const char *dir, rekv_arch arch, rekv_dtype dt, int tied, uint64_t seed_v)
{
    rekv_synth_spec s = {.arch = arch,
                         .n_layers = 2,
                         .hidden = 16,
                         .n_heads = 4,
                         .n_kv_heads = arch == REKV_ARCH_LLAMA ? 2 : 4,
                         .ffn = 24,
                         .vocab = 40,
                         .max_pos = 12,
                         .dtype = dt,
                         .seed = seed_v,
                         .tied_head = tied};
    rekv_err err = {0};
    if (rekv_synth_write(&s, dir, &err) != 0) {
        fprintf(stderr, "fuzz_parsers: synth: %s\n", err.msg);
        exit(2);
    }
}

/* The same Llama with rope_scaling (llama3: every field a type reads) and Qwen2's biases. */
static void synth_rope_into(const char *dir, uint64_t seed_v)
{
    rekv_synth_spec s = {.arch = REKV_ARCH_LLAMA,
                         .n_layers = 1,
                         .hidden = 16,
                         .n_heads = 2,
                         .n_kv_heads = 1,
                         .ffn = 24,
                         .vocab = 40,
                         .max_pos = 12,
                         .dtype = REKV_DTYPE_F32,
                         .seed = seed_v};
    rekv_synth_llama lv = {.rope_theta = 500000.0f, .qwen2 = 1};
    lv.rope_scaling = (rekv_rope_scaling){.type = REKV_ROPE_SCALING_LLAMA3,
                                          .factor = 8,
                                          .original_max_pos = 4,
                                          .low_freq_factor = 1,
                                          .high_freq_factor = 4};
    rekv_err err = {0};
    if (rekv_synth_write_llama(&s, &lv, dir, NULL, NULL, &err) != 0) {
        fprintf(stderr, "fuzz_parsers: synth: %s\n", err.msg);
        exit(2);
    }
}

/* A small safetensors file with every dtype and odd shapes, written with the project's writer. */
static void gen_mixed_st(const char *path)
{
    rekv_err err = {0};
    rekv_st_writer *w;
    static const struct {
        const char *name;
        rekv_dtype dt;
        int nd;
        int64_t sh[3];
    } t[] = {{"w.f32", REKV_DTYPE_F32, 2, {3, 2}},
             {"s.f32", REKV_DTYPE_F32, 0, {0}},
             {"e.f32", REKV_DTYPE_F32, 1, {0}},
             {"h.f16", REKV_DTYPE_F16, 3, {1, 2, 3}},
             {"b.bf16", REKV_DTYPE_BF16, 1, {5}}};
    if (rekv_st_writer_open(path, &w, &err) != 0)
        goto fail;
    size_t total = 0;
    for (size_t i = 0; i < 5; i++) {
        if (rekv_st_writer_declare(w, t[i].name, t[i].dt, t[i].nd, t[i].sh, &err) != 0)
            goto fail;
        size_t n = rekv_dtype_size(t[i].dt);
        for (int d = 0; d < t[i].nd; d++)
            n *= (size_t)t[i].sh[d];
        total += n;
    }
    uint8_t data[256];
    for (size_t i = 0; i < sizeof(data); i++)
        data[i] = (uint8_t)(i * 37);
    if (rekv_st_writer_write(w, data, total, &err) != 0 || rekv_st_writer_close(w, &err) != 0)
        goto fail;
    return;
fail:
    fprintf(stderr, "fuzz_parsers: writing %s: %s\n", path, err.msg);
    exit(2);
}

/* The chat-template seeds: a tokenizer_config.json of the subset's constructs, and the real
 * templates of ../shared/chat-templates as chat_template.jinja. */
static void chat_seeds(int mid, int big)
{
    seed *s = seed_add("chat-config", T_CHAT, K_JSON, "tokenizer_config.json", mid);
    static const char chat_cfg[] =
        "{\"bos_token\": {\"content\": \"<s>\"}, \"eos_token\": \"</s>\", \"chat_template\": "
        "\"{%- macro m(x, y=2) %}{{ x ~ y }}{% endmacro %}{% set ns = namespace(n=0) %}"
        "{{ bos_token }}{% for msg in messages if msg.role != 'x' %}{% set ns.n = ns.n + 1 %}"
        "{{ loop.index }}{{ msg['content']|trim|upper }}{{ m(msg.role[1:]) }}{% if loop.last %}"
        "{{ tools|tojson(indent=2) }}{{ (tools|map(attribute='type')|list)[::-1] }}{% endif %}"
        "{%- endfor %}{{ ns.n ~ eos_token }}{{ 'a b'.split()|join(',') }}\"}";
    write_file(path_in(s->dir, "tokenizer_config.json"), chat_cfg, strlen(chat_cfg));
    seed_load(s);
    struct dirent **names = NULL;
    int n_names = scandir("../shared/chat-templates", &names, NULL, alphasort); /* a fixed order */
    for (int k = 0; k < n_names; k++) {
        const struct dirent *de = names[k];
        size_t len = strlen(de->d_name);
        if (len < 7 || strcmp(de->d_name + len - 6, ".jinja") != 0)
            continue;
        char name[64], p[PATH_MAX];
        snprintf(name, sizeof(name), "chat-%.50s", de->d_name);
        snprintf(p, sizeof(p), "../shared/chat-templates/%s", de->d_name);
        s = seed_add(name, T_CHAT, K_TEXT, "chat_template.jinja", big);
        copy_in(p, s->dir, "chat_template.jinja");
        seed_load(s);
    }
    for (int k = 0; k < n_names; k++)
        free(names[k]);
    free(names);
}

/* Seeds of three of ../shared/gguf's files (copied), their headers mutated. */
static void shared_gguf_seeds(int mid)
{
    static const char *const ggufs[] = {"llama-tiny-py-F16", "synth-llama-Q4_K_M",
                                        "llama-tiny-py-Q4_0"};
    for (size_t i = 0; i < sizeof(ggufs) / sizeof(ggufs[0]); i++) {
        char name[64], p[PATH_MAX];
        snprintf(p, sizeof(p), "../shared/gguf/%s.gguf", ggufs[i]);
        if (!exists(p))
            continue;
        snprintf(name, sizeof(name), "shared-gguf-%d", (int)i);
        seed *s = seed_add(name, T_GGUF, K_BINARY, "model.gguf", mid);
        copy_in(p, s->dir, "model.gguf");
        seed_load(s);
        seed_gguf_header_only(s);
    }
}

static void build_seeds(double scale)
{
    int small = (int)(5000 * scale), mid = (int)(1500 * scale), big = (int)(400 * scale);
    if (small < 1)
        small = 1;
    if (mid < 1)
        mid = 1;
    if (big < 1)
        big = 1;
    seed *s;
    const char *sh_opt = "../shared/models/opt-tiny-py";
    const char *sh_llama = "../shared/models/llama-tiny-py";
    const char *sh_260k = "../shared/models/stories260K/stories260K.bin";
    const char *sh_tokbin = "../shared/tokenizers/llama2/tokenizer.bin";

    /* safetensors on their own */
    s = seed_add("st-opt", T_ST, K_SAFETENSORS, "model.safetensors", small);
    synth_into(s->dir, REKV_ARCH_OPT, REKV_DTYPE_F16, 1, 1);
    seed_load(s);
    s = seed_add("st-llama", T_ST, K_SAFETENSORS, "model.safetensors", small);
    synth_into(s->dir, REKV_ARCH_LLAMA, REKV_DTYPE_BF16, 0, 2);
    seed_load(s);
    s = seed_add("st-mixed", T_ST, K_SAFETENSORS, "mixed.safetensors", small);
    gen_mixed_st(path_in(s->dir, "mixed.safetensors"));
    seed_load(s);
    /* metadata and no tensor at all: valid, and empty (its tensor list was sorted from NULL) */
    s = seed_add("st-empty", T_ST, K_SAFETENSORS, "empty.safetensors", mid);
    {
        static const char hdr[] = "{\"__metadata__\": {\"format\": \"pt\"}}";
        uint8_t b[8 + sizeof(hdr) - 1];
        for (int i = 0; i < 8; i++)
            b[i] = (uint8_t)((uint64_t)(sizeof(hdr) - 1) >> (8 * i));
        memcpy(b + 8, hdr, sizeof(hdr) - 1);
        write_file(path_in(s->dir, "empty.safetensors"), b, sizeof(b));
    }
    seed_load(s);

    /* HF directories: config.json or model.safetensors mutated, the other one valid */
    s = seed_add("hf-opt-config", T_MODEL, K_JSON, "config.json", small);
    synth_into(s->dir, REKV_ARCH_OPT, REKV_DTYPE_F16, 1, 3);
    seed_load(s);
    s = seed_add("hf-llama-config", T_MODEL, K_JSON, "config.json", small);
    synth_into(s->dir, REKV_ARCH_LLAMA, REKV_DTYPE_F32, 1, 4);
    seed_load(s);
    s = seed_add("hf-llama-rope-config", T_MODEL, K_JSON, "config.json", small);
    synth_rope_into(s->dir, 7);
    seed_load(s);
    s = seed_add("hf-opt-weights", T_MODEL, K_SAFETENSORS, "model.safetensors", small);
    synth_into(s->dir, REKV_ARCH_OPT, REKV_DTYPE_F32, 0, 5);
    seed_load(s);
    s = seed_add("hf-llama-weights", T_MODEL, K_SAFETENSORS, "model.safetensors", small);
    synth_into(s->dir, REKV_ARCH_LLAMA, REKV_DTYPE_F16, 0, 6);
    seed_load(s);

    /* llama2.c checkpoints */
    buf b = {0};
    s = seed_add("l2c-shared-head", T_L2C, K_BINARY, "model.bin", small);
    gen_l2c(&b, 64);
    write_file(path_in(s->dir, "model.bin"), b.p, b.n);
    seed_load(s);
    s = seed_add("l2c-own-head", T_L2C, K_BINARY, "model.bin", small);
    gen_l2c(&b, -64);
    write_file(path_in(s->dir, "model.bin"), b.p, b.n);
    seed_load(s);

    /* tokenizers */
    buf vocab = {0}, merges = {0}, tj = {0};
    gen_bpe(&vocab, &merges, &tj);
    s = seed_add("bpe-vocab", T_BPE_VOCAB, K_JSON, "vocab.json", small);
    write_file(path_in(s->dir, "vocab.json"), vocab.p, vocab.n);
    write_file(path_in(s->dir, "merges.txt"), merges.p, merges.n);
    seed_load(s);
    s = seed_add("bpe-merges", T_BPE_MERGES, K_TEXT, "merges.txt", small);
    write_file(path_in(s->dir, "vocab.json"), vocab.p, vocab.n);
    write_file(path_in(s->dir, "merges.txt"), merges.p, merges.n);
    seed_load(s);
    s = seed_add("hf-tokenizer-json", T_HF_JSON, K_JSON, "tokenizer.json", small);
    write_file(path_in(s->dir, "tokenizer.json"), tj.p, tj.n);
    seed_load(s);
    /* the same with Unicode normalizers (identity on the encoder's round-trip texts) */
    static const char null_norm[] = "\"normalizer\": null",
                      nfc_norm[] = "\"normalizer\": {\"type\": \"Sequence\", \"normalizers\": "
                                   "[{\"type\": \"NFKD\"}, {\"type\": \"NFC\"}]}";
    const uint8_t *at = memmem(tj.p, tj.n, null_norm, strlen(null_norm));
    if (at == NULL)
        die("gen_bpe: no null normalizer");
    buf_splice(&tj, (size_t)(at - tj.p), strlen(null_norm), nfc_norm, strlen(nfc_norm));
    s = seed_add("hf-tokenizer-json-nfc", T_HF_JSON, K_JSON, "tokenizer.json", small);
    write_file(path_in(s->dir, "tokenizer.json"), tj.p, tj.n);
    seed_load(s);
    s = seed_add("tokbin", T_TOKBIN, K_BINARY, "tokenizer.bin", small);
    gen_tokbin(&b);
    write_file(path_in(s->dir, "tokenizer.bin"), b.p, b.n);
    seed_load(s);
    s = seed_add("gguf-tiny", T_GGUF, K_BINARY, "tiny.gguf", small);
    gen_gguf(&b);
    write_file(path_in(s->dir, "tiny.gguf"), b.p, b.n);
    seed_load(s);
    seed_gguf_header_only(s);
    free(vocab.p);
    free(merges.p);
    free(tj.p);
    free(b.p);

    chat_seeds(mid, big);

    /* the shared models, copied (never modified in place) */
    const char *dirs[2] = {sh_opt, sh_llama};
    const char *tags[2] = {"opt", "llama"};
    for (int i = 0; i < 2; i++) {
        char name[64], p[PATH_MAX];
        snprintf(p, sizeof(p), "%s/model.safetensors", dirs[i]);
        if (!exists(p))
            continue;
        snprintf(name, sizeof(name), "shared-%s-weights", tags[i]);
        s = seed_add(name, T_MODEL, K_SAFETENSORS, "model.safetensors", big);
        copy_in(p, s->dir, "model.safetensors");
        copy_in(path_in(dirs[i], "config.json"), s->dir, "config.json");
        seed_load(s);
        seed_header_only(s);
        snprintf(name, sizeof(name), "shared-%s-config", tags[i]);
        s = seed_add(name, T_MODEL, K_JSON, "config.json", mid);
        link_in(p, s->dir, "model.safetensors");
        copy_in(path_in(dirs[i], "config.json"), s->dir, "config.json");
        seed_load(s);
        if (exists(path_in(dirs[i], "vocab.json")) && exists(path_in(dirs[i], "merges.txt"))) {
            snprintf(name, sizeof(name), "shared-%s-vocab", tags[i]);
            s = seed_add(name, T_BPE_VOCAB, K_JSON, "vocab.json", big);
            copy_in(path_in(dirs[i], "vocab.json"), s->dir, "vocab.json");
            link_in(path_in(dirs[i], "merges.txt"), s->dir, "merges.txt");
            seed_load(s);
            snprintf(name, sizeof(name), "shared-%s-merges", tags[i]);
            s = seed_add(name, T_BPE_MERGES, K_TEXT, "merges.txt", big);
            link_in(path_in(dirs[i], "vocab.json"), s->dir, "vocab.json");
            copy_in(path_in(dirs[i], "merges.txt"), s->dir, "merges.txt");
            seed_load(s);
        }
    }
    if (exists(sh_260k)) {
        s = seed_add("shared-stories260K", T_L2C, K_BINARY, "stories260K.bin", mid);
        copy_in(sh_260k, s->dir, "stories260K.bin");
        seed_load(s);
        s->prefix = 4096; /* the header and the start of the embeddings */
    }
    shared_gguf_seeds(mid);
    if (exists(sh_tokbin)) {
        s = seed_add("shared-tokbin", T_TOKBIN, K_BINARY, "tokenizer.bin", big);
        copy_in(sh_tokbin, s->dir, "tokenizer.bin");
        seed_load(s);
    }
}

/* ---------------------------------------------------------------- mutations */

typedef struct jtok {
    size_t at, n;
    char type; /* s string, n number, l literal, p punctuation */
} jtok;

static size_t json_tokens(const uint8_t *p, size_t n, jtok *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n && k < cap;) {
        uint8_t c = p[i];
        size_t s = i;
        char type;
        if (c == '"') {
            i++;
            while (i < n && p[i] != '"')
                i += p[i] == '\\' ? 2 : 1;
            i = i < n ? i + 1 : n;
            type = 's';
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            while (i < n && strchr("-+.eE0123456789", p[i]) && p[i] != 0)
                i++;
            type = 'n';
        } else if (c >= 'a' && c <= 'z') {
            while (i < n && p[i] >= 'a' && p[i] <= 'z')
                i++;
            type = 'l';
        } else if (strchr("{}[]:,", c) && c != 0) {
            i++;
            type = 'p';
        } else {
            i++;
            continue;
        }
        out[k].at = s;
        out[k].n = i - s;
        out[k].type = type;
        k++;
    }
    return k;
}

static const char *const k_numbers[] = {"0",
                                        "-1",
                                        "1",
                                        "2",
                                        "3",
                                        "7",
                                        "8",
                                        "255",
                                        "256",
                                        "65535",
                                        "65536",
                                        "2147483647",
                                        "2147483648",
                                        "-2147483648",
                                        "4294967295",
                                        "4294967296",
                                        "9223372036854775807",
                                        "9223372036854775808",
                                        "18446744073709551615",
                                        "-9223372036854775808",
                                        "1e308",
                                        "1e309",
                                        "-0",
                                        "0.5",
                                        "1.5",
                                        "1e-5",
                                        "-1e-5",
                                        "3.4e38",
                                        "1e-45",
                                        "NaN",
                                        "Infinity",
                                        "[]",
                                        "{}",
                                        "null",
                                        "true",
                                        "\"7\""};

static const char *const k_strings[] = {
    "\"\"",
    "\"F32\"",
    "\"F16\"",
    "\"BF16\"",
    "\"I64\"",
    "\"F64\"",
    "\"U8\"",
    "\"__metadata__\"",
    "\"opt\"",
    "\"llama\"",
    "\"mistral\"",
    "\"qwen2\"",
    "\"gelu\"",
    "\"silu\"",
    "\"relu\"",
    "\"../model.safetensors\"",
    "\"/etc/passwd\"",
    "\"model.safetensors\"",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\"<s>\"",
    "\"</s>\"",
    "\"\\u00ff\\u0100\"",
    "\"BPE\"",
    "\"ByteLevel\"",
    "\"Metaspace\"",
    "\"Sequence\"",
    "\"Split\"",
    "\"(?:\"",
    "\"[\"",
    "\"\\\\\"",
    "0",
    "null",
    "\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\""};

#define MAX_TOKS 200000
static jtok *g_toks;

/* One JSON-aware mutation of b[lo, hi); returns 0 when there was nothing to do. */
static int mutate_json(buf *b, size_t lo, size_t hi)
{
    size_t k = json_tokens(b->p + lo, hi - lo, g_toks, MAX_TOKS);
    if (k == 0)
        return 0;
    jtok *t = &g_toks[below(k)];
    size_t at = lo + t->at;
    switch (below(8)) {
    case 7: { /* an array grown: ", 1" (or ", 0") repeated after a number, e.g. extra dims */
        for (int tries = 0; tries < 8 && t->type != 'n'; tries++)
            t = &g_toks[below(k)];
        at = lo + t->at + t->n;
        const char *one = below(4) ? ",1" : ",0";
        size_t reps = 1 + below(12);
        for (size_t r = 0; r < reps; r++)
            buf_splice(b, at, 0, one, 2);
        return 1;
    }
    case 0: { /* a number or any token replaced by an interesting number */
        if (t->type != 'n')
            for (int tries = 0; tries < 8 && t->type != 'n'; tries++)
                t = &g_toks[below(k)];
        at = lo + t->at;
        const char *s = k_numbers[below(sizeof(k_numbers) / sizeof(k_numbers[0]))];
        buf_splice(b, at, t->n, s, strlen(s));
        return 1;
    }
    case 1: { /* a string replaced by an interesting string */
        for (int tries = 0; tries < 8 && t->type != 's'; tries++)
            t = &g_toks[below(k)];
        at = lo + t->at;
        const char *s = k_strings[below(sizeof(k_strings) / sizeof(k_strings[0]))];
        buf_splice(b, at, t->n, s, strlen(s));
        return 1;
    }
    case 2: { /* two tokens swapped */
        jtok *u = &g_toks[below(k)];
        if (u == t)
            return 1;
        jtok *a = t->at < u->at ? t : u, *c = t->at < u->at ? u : t;
        if (a->at + a->n > c->at)
            return 1;
        buf tmp = {0};
        buf_add(&tmp, b->p + lo + c->at, c->n);
        buf_add(&tmp, b->p + lo + a->at + a->n, c->at - a->at - a->n);
        buf_add(&tmp, b->p + lo + a->at, a->n);
        memcpy(b->p + lo + a->at, tmp.p, tmp.n);
        free(tmp.p);
        return 1;
    }
    case 3: /* a token deleted */
        buf_splice(b, at, t->n, NULL, 0);
        return 1;
    case 4: { /* a token duplicated */
        buf tmp = {0};
        buf_add(&tmp, b->p + at, t->n);
        buf_splice(b, at, 0, tmp.p, tmp.n);
        free(tmp.p);
        return 1;
    }
    case 5: { /* a token replaced by another token of the file */
        jtok *u = &g_toks[below(k)];
        buf tmp = {0};
        buf_add(&tmp, b->p + lo + u->at, u->n);
        buf_splice(b, at, t->n, tmp.p, tmp.n);
        free(tmp.p);
        return 1;
    }
    default: { /* punctuation inserted */
        static const char *const punct[] = {"{", "}", "[", "]", ",", ":", "\"", "{\"a\":[]}", "[["};
        const char *s = punct[below(sizeof(punct) / sizeof(punct[0]))];
        buf_splice(b, at, 0, s, strlen(s));
        return 1;
    }
    }
}

static void mutate_lines(buf *b)
{
    size_t starts[4096];
    size_t k = 0;
    for (size_t i = 0; i < b->n && k < 4096; i++)
        if (i == 0 || b->p[i - 1] == '\n')
            starts[k++] = i;
    if (k < 2)
        return;
    size_t i = below(k), j = below(k);
    size_t ie = i + 1 < k ? starts[i + 1] : b->n;
    buf line = {0};
    buf_add(&line, b->p + starts[i], ie - starts[i]);
    switch (below(3)) {
    case 0: /* delete line i */
        buf_splice(b, starts[i], ie - starts[i], NULL, 0);
        break;
    case 1: /* duplicate line i before line j */
        buf_splice(b, starts[j], 0, line.p, line.n);
        break;
    default: /* a line's separator space removed, doubled, or the line cut in half */
        for (size_t x = starts[i]; x < ie; x++)
            if (b->p[x] == ' ') {
                if (below(2))
                    buf_splice(b, x, 1, NULL, 0);
                else
                    buf_splice(b, x, 0, "  ", 2);
                break;
            }
        if (below(2) && ie > starts[i] + 1)
            buf_splice(b, starts[i] + (ie - starts[i]) / 2, 0, "\n", 1);
        break;
    }
    free(line.p);
}

static void put_le(buf *b, size_t at, uint64_t v, int n)
{
    for (int i = 0; i < n && at + (size_t)i < b->n; i++)
        b->p[at + (size_t)i] = (uint8_t)(v >> (8 * i));
}

static const uint64_t k_ints[] = {0,
                                  1,
                                  2,
                                  3,
                                  4,
                                  7,
                                  8,
                                  16,
                                  255,
                                  256,
                                  0x7fff,
                                  0x8000,
                                  0xffff,
                                  0x10000,
                                  0x7fffffff,
                                  0x80000000u,
                                  0xffffffffu,
                                  0x100000000ull,
                                  0x7fffffffffffffffull,
                                  0x8000000000000000ull,
                                  ~0ull,
                                  (uint64_t)-2,
                                  100000000,
                                  100000001};

/* One raw mutation of b[0, hi); may also shrink or grow b. */
static void mutate_raw(buf *b, size_t hi, int allow_resize)
{
    if (hi == 0) {
        buf_add(b, "\0", 1);
        return;
    }
    size_t at = below(hi);
    int op = (int)below(allow_resize ? 9 : 5);
    switch (op) {
    case 0: { /* bit flips */
        int n = 1 + (int)below(4);
        for (int i = 0; i < n; i++)
            b->p[below(hi)] ^= (uint8_t)(1u << below(8));
        break;
    }
    case 1: { /* bytes set to 0, 0xff or random */
        int n = 1 + (int)below(8);
        for (int i = 0; i < n; i++) {
            int v = (int)below(3);
            b->p[below(hi)] = v == 0 ? 0 : v == 1 ? 0xff : (uint8_t)rnd();
        }
        break;
    }
    case 2: /* an interesting 4- or 8-byte integer */
        put_le(b, at, k_ints[below(sizeof(k_ints) / sizeof(k_ints[0]))], below(2) ? 4 : 8);
        break;
    case 3: { /* a run copied from elsewhere */
        size_t from = below(hi), n = 1 + below(16);
        if (from + n > hi)
            n = hi - from;
        if (at + n > hi)
            n = hi - at;
        memmove(b->p + at, b->p + from, n);
        break;
    }
    case 4: /* one byte, small delta */
        b->p[at] = (uint8_t)(b->p[at] + (below(2) ? 1 : -1));
        break;
    case 5: { /* truncation: anywhere, or within the first 64 bytes */
        size_t len = below(2) ? below(hi) : below(hi < 64 ? hi : 64);
        buf_splice(b, len, b->n - len, NULL, 0);
        break;
    }
    case 6: { /* random bytes inserted */
        uint8_t ins[16];
        size_t n = 1 + below(16);
        for (size_t i = 0; i < n; i++)
            ins[i] = (uint8_t)rnd();
        buf_splice(b, at, 0, ins, n);
        break;
    }
    case 7: { /* a range deleted */
        size_t n = 1 + below(32);
        buf_splice(b, at, n, NULL, 0);
        break;
    }
    default: { /* a chunk repeated */
        size_t n = 1 + below(64);
        if (at + n > b->n)
            n = b->n - at;
        buf tmp = {0};
        buf_add(&tmp, b->p + at, n);
        buf_splice(b, at, 0, tmp.p, tmp.n);
        free(tmp.p);
        break;
    }
    }
}

/* Builds mutant m from the seed's prefix. Sets *tail_len: how much of the constant tail follows. */
static void mutate(const seed *s, buf *m, size_t *tail_len)
{
    size_t tail = s->orig.n - s->prefix;
    buf_set(m, s->orig.p, s->prefix);
    *tail_len = tail;
    int big = tail > 0; /* keep the prefix length so the file is patched in place */
    int rounds = 1 + (below(4) == 0 ? (int)below(4) : 0);
    for (int r = 0; r < rounds; r++) {
        if (s->kind == K_SAFETENSORS && m->n >= 8 && below(10) < 7) {
            uint64_t h = 0;
            for (int i = 7; i >= 0; i--)
                h = h << 8 | m->p[i];
            if (h > m->n - 8) {
                mutate_raw(m, m->n, !big);
                continue;
            }
            size_t old_h = (size_t)h;
            int op = (int)below(10);
            if (op == 0) { /* header length field corrupted */
                static const int64_t deltas[] = {-9, -8, -7, -1, 1, 7, 8, 9};
                uint64_t v = below(2) ? h + (uint64_t)deltas[below(8)]
                                      : k_ints[below(sizeof(k_ints) / sizeof(k_ints[0]))];
                if (below(4) == 0)
                    v = s->orig.n + below(3) - 9;
                put_le(m, 0, v, 8);
                continue;
            }
            /* JSON or raw mutation inside the header, then the length fixed up */
            buf j = {0};
            buf_add(&j, m->p + 8, old_h);
            if (op >= 8 || !mutate_json(&j, 0, j.n))
                mutate_raw(&j, j.n, 1);
            if (big && j.n <= old_h) { /* pad to keep the data where it is */
                while (j.n < old_h)
                    buf_add(&j, " ", 1);
            } else if (big) {
                free(j.p);
                continue; /* would move the data: skip (rewriting the file is slow) */
            } else if (below(2)) {
                while (j.n % 8)
                    buf_add(&j, " ", 1);
            }
            buf_splice(m, 8, old_h, j.p, j.n);
            put_le(m, 0, j.n, 8);
            free(j.p);
        } else if (s->kind == K_JSON && below(10) < 7) {
            if (!mutate_json(m, 0, m->n))
                mutate_raw(m, m->n, 1);
        } else if (s->kind == K_TEXT && below(2)) {
            mutate_lines(m);
        } else if (s->kind == K_BINARY && below(3) == 0 && m->n >= 28) {
            /* a header field (int32) set to an interesting value */
            static const int32_t v[] = {0,         -1,      1,       2,       3,
                                        -64,       64,      65,      7,       INT32_MAX,
                                        INT32_MIN, 1 << 16, 1 << 24, 1 << 30, -(1 << 30)};
            size_t field = below(7);
            put_le(m, field * 4, (uint32_t)v[below(sizeof(v) / sizeof(v[0]))], 4);
        } else {
            mutate_raw(m, m->n, !big);
        }
    }
    if (big && m->n != s->prefix) { /* resized despite everything: drop the tail */
        *tail_len = 0;
    }
    if (big && below(50) == 0) { /* now and then: the real file truncated in its data */
        buf_set(m, s->orig.p, s->prefix);
        *tail_len = below(tail);
    }
}

/* ---------------------------------------------------------------- targets */

static volatile uint8_t g_sink;

static void touch(const rekv_tensor *t)
{
    if (t == NULL)
        return;
    if (t->nbytes > 0) {
        const volatile uint8_t *p = t->data;
        g_sink ^= p[0];
        g_sink ^= p[t->nbytes - 1];
    }
    if (t->ndim < 0 || t->ndim > REKV_MAX_DIMS) {
        fprintf(stderr, "fuzz_parsers: tensor %s has ndim %d\n", t->name, t->ndim);
        abort();
    }
}

static void exercise_model(rekv_model *m)
{
    const rekv_weights *w = &m->weights;
    touch(w->embed_tokens);
    touch(w->embed_positions);
    touch(w->project_in);
    touch(w->project_out);
    touch(w->final_norm_w);
    touch(w->final_norm_b);
    touch(w->lm_head);
    for (int i = 0; i < m->config.n_layers && w->layers != NULL; i++) {
        const rekv_layer_weights *l = &w->layers[i];
        const rekv_tensor *ts[] = {
            l->attn_norm_w, l->attn_norm_b, l->wq,         l->bq, l->wk, l->bk, l->wv, l->bv, l->wo,
            l->bo,          l->ffn_norm_w,  l->ffn_norm_b, l->w1, l->b1, l->w2, l->b2, l->w3};
        for (size_t k = 0; k < sizeof(ts) / sizeof(ts[0]); k++)
            touch(ts[k]);
    }
}

static const char *const k_texts[] = {
    "",
    "Hello world",
    "def main():\n    return self.x  # comment\n",
    "<s>the</s> <unk><pad>in",
    "Once upon a time, there was a little girl.",
    "\xff\xfe\x80 invalid \xc3( utf8 \xe2\x82",
    "日本語のテキスト 🙂 emoji",
    "    \t\t\n\n\r\n   ",
};

static void exercise_tokenizer(rekv_tokenizer *tok, int check_roundtrip);

static int g_accepted;

/* The tokenizer that belongs to a model, when there is one. */
static void model_tokenizer(const char *model_path)
{
    rekv_tokenizer *tok = NULL;
    if (rekv_tokenizer_load_for_model(model_path, &tok, NULL) == 0) {
        exercise_tokenizer(tok, 0);
        rekv_tokenizer_free(tok);
    }
}

/* A GGUF opened, every key/value read through the accessors, the first and last block of every
 * tensor dequantized; then the same file as a model and as a tokenizer. */
static int fuzz_gguf(const char *path, rekv_err *err)
{
    rekv_gguf *g = NULL;
    int rc = rekv_gguf_open(path, &g, err);
    if (rc != 0)
        return rc;
    g_accepted++;
    for (size_t i = 0; i < g->n_kvs; i++) {
        const rekv_gguf_kv *kv = &g->kvs[i];
        for (uint64_t k = 0; k < kv->n && k < 64; k++) {
            int64_t iv;
            double fv;
            const char *sv;
            size_t n;
            if (rekv_gguf_kv_str(kv, k, &sv, &n) == 0 && n > 0)
                g_sink ^= (uint8_t)sv[n - 1];
            rekv_gguf_kv_int(kv, k, &iv);
            rekv_gguf_kv_float(kv, k, &fv);
        }
    }
    float y[256];
    for (size_t i = 0; i < g->n_tensors; i++) {
        const rekv_gguf_tensor *t = &g->tensors[i];
        uint32_t be, bb;
        rekv_ggml_type_block(t->type, &be, &bb);
        if (t->numel < be || !rekv_ggml_type_dequantizable(t->type))
            continue;
        rekv_err e2 = {0};
        if (rekv_gguf_dequant(t, 0, be, y, &e2) != 0 ||
            rekv_gguf_dequant(t, t->numel - be, be, y, &e2) != 0) {
            fprintf(stderr, "fuzz_parsers: dequantizing %s failed: %s\n", t->name, e2.msg);
            abort();
        }
    }
    rekv_gguf_close(g);
    /* run_case checks the model's error report too (quantized files load, their blocks kept) */
    rekv_model *m = NULL;
    if ((rc = rekv_model_open(path, &m, err)) == 0) {
        exercise_model(m);
        rekv_model_close(m);
    }
    model_tokenizer(path);
    return rc;
}

static void run_case(const seed *s)
{
    rekv_err err = {0};
    int rc = 0;
    const char *path = path_in(s->dir, s->file);
    switch (s->tgt) {
    case T_ST: {
        rekv_safetensors *st = NULL;
        if ((rc = rekv_safetensors_open(path, &st, &err)) == 0) {
            g_accepted++;
            for (size_t i = 0; i < rekv_safetensors_count(st); i++) {
                const rekv_tensor *t = rekv_safetensors_at(st, i);
                touch(t);
                if (rekv_safetensors_find(st, t->name) != t) {
                    fprintf(stderr, "fuzz_parsers: find(%s) does not return it\n", t->name);
                    abort();
                }
            }
            rekv_safetensors_close(st);
        }
        break;
    }
    case T_MODEL: {
        rekv_model *m = NULL;
        rekv_model_config c;
        rekv_config_load_hf(path_in(s->dir, "config.json"), &c, NULL);
        if ((rc = rekv_model_open(s->dir, &m, &err)) == 0) {
            g_accepted++;
            exercise_model(m);
            rekv_model_close(m);
        }
        model_tokenizer(s->dir);
        break;
    }
    case T_L2C: {
        rekv_model *m = NULL;
        if ((rc = rekv_model_open(path, &m, &err)) == 0) {
            g_accepted++;
            exercise_model(m);
            rekv_model_close(m);
        }
        model_tokenizer(path);
        break;
    }
    case T_GGUF:
        rc = fuzz_gguf(path, &err);
        break;
    case T_CHAT: {
        rekv_chat_template *t = NULL;
        if ((rc = rekv_chat_template_load_dir(s->dir, &t, &err)) == 0 && t != NULL) {
            g_accepted++;
            static const char conv[] =
                "{\"add_generation_prompt\": true, \"messages\": [{\"role\": \"system\", "
                "\"content\": \"S\"}, {\"role\": \"user\", \"content\": \" hi \"}, {\"role\": "
                "\"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"abcdefghi\", "
                "\"type\": "
                "\"function\", \"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}]}, "
                "{\"role\": \"tool\", \"tool_call_id\": \"abcdefghi\", \"content\": \"r\"}], "
                "\"tools\": "
                "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\", "
                "\"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": "
                "[\"string\", \"integer\"], \"description\": \"x\"}}}}}]}";
            json_t *ctx = json_loads(conv, 0, NULL);
            char *out = NULL;
            if (ctx != NULL) /* NULL only when allocation failed */
                rc = rekv_chat_template_render(t, ctx, &out, &err);
            free(out);
            json_decref(ctx);
            rekv_chat_template_free(t);
        }
        break;
    }
    case T_BPE_VOCAB:
    case T_BPE_MERGES:
    case T_HF_JSON:
    case T_TOKBIN: {
        rekv_tokenizer *tok = NULL;
        if (s->tgt == T_HF_JSON)
            rc = rekv_tokenizer_load_hf_json(path, &tok, &err);
        else if (s->tgt == T_TOKBIN)
            rc = rekv_tokenizer_load_llama2c(path, &tok, &err);
        else
            rc = rekv_tokenizer_load_bpe(path_in(s->dir, "vocab.json"),
                                         path_in(s->dir, "merges.txt"), &tok, &err);
        if (rc == 0) {
            g_accepted++;
            exercise_tokenizer(tok, 0);
            rekv_tokenizer_free(tok);
        }
        break;
    }
    }
    /* the error convention: a negative errno, and one line of message when it fails */
    if (rc > 0 || (rc < 0 && (err.code >= 0 || err.msg[0] == '\0' || strchr(err.msg, '\n')))) {
        fprintf(stderr, "fuzz_parsers: bad error report (rc %d, code %d): \"%s\"\n", rc, err.code,
                err.msg);
        abort();
    }
}

/* Encodes texts and decodes the ids; with check_roundtrip, decode(encode(x)) must give x back
 * (byte-level BPE, texts without special-token strings). */
static void encode_decode(rekv_tokenizer *tok, const char *text, size_t len, int check_roundtrip)
{
    rekv_err err = {0};
    int32_t *ids = NULL;
    size_t n = 0;
    int vs = rekv_tokenizer_vocab_size(tok);
    if (rekv_tokenizer_encode(tok, text, len, below(2) ? -1 : 1, &ids, &n, &err) != 0)
        return;
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vs) {
            fprintf(stderr, "fuzz_parsers: encode produced id %d outside [0, %d)\n", ids[i], vs);
            abort();
        }
    char *out = NULL;
    size_t olen = 0;
    if (rekv_tokenizer_decode(tok, ids, n, &out, &olen, &err) == 0) {
        if (out[olen] != '\0') {
            fprintf(stderr, "fuzz_parsers: decode result is not NUL-terminated\n");
            abort();
        }
        if (check_roundtrip && (olen != len || memcmp(out, text, len) != 0)) {
            fprintf(stderr,
                    "fuzz_parsers: decode(encode(x)) != x for a %zu-byte text "
                    "(got %zu bytes)\n",
                    len, olen);
            abort();
        }
        free(out);
    }
    free(ids);
}

static void exercise_tokenizer(rekv_tokenizer *tok, int check_roundtrip)
{
    for (size_t i = 0; i < sizeof(k_texts) / sizeof(k_texts[0]); i++)
        encode_decode(tok, k_texts[i], strlen(k_texts[i]), 0);
    (void)check_roundtrip;
    int vs = rekv_tokenizer_vocab_size(tok);
    /* decode of arbitrary ids, in range and out of it */
    int32_t ids[16];
    for (int i = 0; i < 16; i++)
        ids[i] = below(8) == 0 ? (int32_t)rnd() : (int32_t)below(vs > 0 ? (size_t)vs : 1);
    char *out = NULL;
    size_t olen;
    rekv_err err = {0};
    if (rekv_tokenizer_decode(tok, ids, 16, &out, &olen, &err) == 0)
        free(out);
    rekv_tokenizer_token_id(tok, "</s>");
    rekv_tokenizer_token_id(tok, "");
}

/* Random byte strings through a valid tokenizer. */
static void fuzz_encoder(rekv_tokenizer *tok, int iters, int byte_level)
{
    static const char *const pieces[] = {
        "<s>",  "</s>", "<unk>", "<pad>", " ",   "  ", "\n",  "the", "▁", "Ġ", "\xf0\x9f\x99\x82",
        "\xc3", "\xff", "'s",    "'",     "123", "\t", "\r\n"};
    char text[512];
    for (int it = 0; it < iters; it++) {
        size_t len = below(sizeof(text));
        int style = (int)below(4);
        size_t i = 0;
        while (i < len) {
            if (style == 0) {
                text[i++] = (char)rnd();
            } else if (style == 1) {
                text[i++] = (char)(32 + below(95));
            } else {
                const char *p = pieces[below(sizeof(pieces) / sizeof(pieces[0]))];
                size_t n = strlen(p);
                if (style == 3 && p[0] == '<')
                    continue; /* no special tokens in the round-trip style */
                if (i + n > len)
                    break;
                memcpy(text + i, p, n);
                i += n;
            }
        }
        len = i;
        int rt = byte_level && (style == 1 || style == 3) && memchr(text, '<', len) == NULL;
        encode_decode(tok, text, len, rt);
    }
}

/* ---------------------------------------------------------------- the driver */

static const char *g_case_seed = "";
static int g_case_iter = -1;
static char g_case_path[PATH_MAX];

static void report_case(void)
{
    if (g_case_iter >= 0)
        fprintf(stderr,
                "fuzz_parsers: FAILED on seed %s mutant %d (input kept at %s); replay with "
                "--only %s:%d\n",
                g_case_seed, g_case_iter, g_case_path, g_case_seed, g_case_iter);
    else if (g_case_seed[0])
        fprintf(stderr, "fuzz_parsers: FAILED in %s\n", g_case_seed);
}

/* A case's time limit, in CPU seconds of this process (ITIMER_PROF, user + system): a hang spins,
 * while time other processes take on a busy machine does not count. 0 disarms it. */
static void case_limit(unsigned cpu_s)
{
    struct itimerval it = {.it_interval = {0, 0}, .it_value = {(time_t)cpu_s, 0}};
    setitimer(ITIMER_PROF, &it, NULL);
}

static void on_signal(int sig)
{
    if (sig == SIGPROF)
        fprintf(stderr, "fuzz_parsers: a case ran longer than its time limit (hang?)\n");
    report_case();
    signal(SIGABRT, SIG_DFL);
    abort();
}

static int write_mutant(const seed *s, const buf *m, size_t tail_len, int *intact)
{
    const char *path = path_in(s->dir, s->file);
    size_t tail = s->orig.n - s->prefix;
    if (*intact && m->n == s->prefix && tail_len == tail && tail > 0) {
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || pwrite(fd, m->p, m->n, 0) != (ssize_t)m->n)
            die(path);
        close(fd);
        return 0;
    }
    buf full = {0};
    buf_add(&full, m->p, m->n);
    buf_add(&full, s->orig.p + s->prefix, tail_len);
    write_file(path, full.p, full.n);
    free(full.p);
    *intact = m->n == s->prefix && tail_len == tail;
    return 0;
}

static void fuzz_seed(seed *s, int only_iter)
{
    buf m = {0};
    int intact = 1;
    int lo = only_iter >= 0 ? only_iter : 0, hi = only_iter >= 0 ? only_iter + 1 : s->iters;
    g_accepted = 0;
    g_case_seed = s->name;
    snprintf(g_case_path, sizeof(g_case_path), "%s", path_in(s->dir, s->file));
    /* the unmutated seed must go through cleanly first */
    g_case_iter = -1;
    case_limit(20);
    run_case(s);
    int seed_ok = g_accepted;
    for (int it = lo; it < hi; it++) {
        g_rng = hash_str(s->name) * 0x9e3779b97f4a7c15ull + (uint64_t)it;
        size_t tail_len;
        mutate(s, &m, &tail_len);
        write_mutant(s, &m, tail_len, &intact);
        g_case_iter = it;
        case_limit(10);
        run_case(s);
    }
    case_limit(0);
    g_case_iter = -1;
    /* leave the original in place for the next seed's companions */
    buf_set(&m, s->orig.p, s->prefix);
    write_mutant(s, &m, s->orig.n - s->prefix, &intact);
    printf("  %-26s %5d mutants, %5d accepted%s\n", s->name, hi - lo, g_accepted - seed_ok,
           seed_ok ? "" : "  (the unmutated seed is rejected!)");
    fflush(stdout);
    free(m.p);
}

static void fuzz_encoders(double scale)
{
    int n = (int)(3000 * scale);
    if (n < 1)
        n = 1;
    g_case_iter = -1;
    rekv_err err = {0};
    for (size_t i = 0; i < g_n_seeds; i++) {
        seed *s = &g_seeds[i];
        if (s->tgt != T_BPE_VOCAB && s->tgt != T_HF_JSON && s->tgt != T_TOKBIN)
            continue;
        rekv_tokenizer *tok = NULL;
        const char *path = path_in(s->dir, s->file);
        int rc = s->tgt == T_HF_JSON ? rekv_tokenizer_load_hf_json(path, &tok, &err)
                 : s->tgt == T_TOKBIN
                     ? rekv_tokenizer_load_llama2c(path, &tok, &err)
                     : rekv_tokenizer_load_bpe(path_in(s->dir, "vocab.json"),
                                               path_in(s->dir, "merges.txt"), &tok, &err);
        if (rc != 0) {
            printf("  encode:%-19s skipped (%s)\n", s->name, err.msg);
            rekv_err_clear(&err);
            continue;
        }
        char label[96];
        snprintf(label, sizeof(label), "encode:%s", s->name);
        g_case_seed = label;
        g_rng = hash_str(label);
        case_limit(60);
        fuzz_encoder(tok, n, s->tgt != T_TOKBIN);
        case_limit(0);
        rekv_tokenizer_free(tok);
        printf("  %-26s %5d random texts\n", label, n);
        fflush(stdout);
    }
}

int main(int argc, char **argv)
{
    int shard = 0, n_shards = 1, list = 0, keep = 0, only_iter = -1;
    double scale = 1.0;
    const char *only = NULL;
    char only_name[64] = "";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--shard") == 0 && i + 1 < argc) {
            if (sscanf(argv[++i], "%d/%d", &shard, &n_shards) != 2 || n_shards < 1 || shard < 0 ||
                shard >= n_shards) {
                fprintf(stderr, "fuzz_parsers: --shard wants I/N\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--scale") == 0 && i + 1 < argc) {
            scale = atof(argv[++i]);
        } else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
            only = argv[++i];
            snprintf(only_name, sizeof(only_name), "%s", only);
            char *colon = strchr(only_name, ':');
            if (colon) {
                *colon = '\0';
                only_iter = atoi(colon + 1);
            }
        } else if (strcmp(argv[i], "--list") == 0) {
            list = 1;
        } else if (strcmp(argv[i], "--keep") == 0) {
            keep = 1;
        } else {
            fprintf(stderr, "usage: fuzz_parsers [--shard I/N] [--scale F] [--only SEED[:ITER]] "
                            "[--list] [--keep]\n");
            return 2;
        }
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(g_root, sizeof(g_root), "%s/rekv-fuzz.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(g_root) == NULL)
        die("mkdtemp");
    g_toks = malloc(MAX_TOKS * sizeof(*g_toks));
    if (g_toks == NULL)
        die("malloc");
    /* SIGSEGV stays with the sanitizer, which reports better; sanitizer reports end in abort()
     * (abort_on_error=1, set by run_fuzz.sh), which names the case here */
    signal(SIGPROF, on_signal);
    signal(SIGABRT, on_signal);
#ifdef FZ_HAVE_SANITIZER
    __sanitizer_set_death_callback(report_case);
#endif
    build_seeds(scale);
    time_t t0 = time(NULL);
    size_t ran = 0;
    for (size_t i = 0; i < g_n_seeds; i++) {
        seed *s = &g_seeds[i];
        if (list) {
            printf("%s (%d mutants)\n", s->name, s->iters);
            continue;
        }
        if (only != NULL ? strcmp(s->name, only_name) != 0 : (int)(i % (size_t)n_shards) != shard)
            continue;
        fuzz_seed(s, only_iter);
        ran++;
    }
    if (!list && (only == NULL || strncmp(only, "encode", 6) == 0) && shard == n_shards - 1)
        fuzz_encoders(scale);
    if (!list)
        printf("fuzz_parsers: shard %d/%d: %zu seeds in %lds, no crash\n", shard, n_shards, ran,
               (long)(time(NULL) - t0));
    if (!keep)
        nftw(g_root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    for (size_t i = 0; i < g_n_seeds; i++)
        free(g_seeds[i].orig.p);
    free(g_seeds);
    free(g_toks);
    return 0;
}
