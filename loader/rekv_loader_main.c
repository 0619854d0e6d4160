/* rekv_loader_main.c — the rekv-loader CLI: writes synthetic models and inspects model files.
 *
 *   rekv-loader synth --arch opt|llama --layers N --hidden H --heads A [--kv-heads K] --ffn F
 *                     --vocab V [--max-pos P] [--dtype f16|bf16|f32] [--seed S] [--tied|--untied]
 *                     [--rope-theta T] [--rope-scaling TYPE[:KEY=VALUE,...]] [--qwen2|--phi3]
 *                     [--sliding-window W] OUTDIR
 *   rekv-loader inspect PATH   (a HF directory, a .safetensors file or index, a llama2.c .bin,
 *                               a .gguf file)
 *
 * Options are getopt_long's (--opt VALUE or --opt=VALUE). Errors are one line on stderr: exit 2 for
 * a usage error (unknown option, missing or bad value), 1 when the work itself fails. */
#define _GNU_SOURCE
#include "loader/gguf.h"
#include "loader/loader.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/progress.h"
#include "common/version.h"

static const char usage[] =
    "usage: rekv-loader COMMAND ...\n"
    "\n"
    "commands:\n"
    "  synth --arch opt|llama --layers N --hidden H --heads A [--kv-heads K] --ffn F --vocab V\n"
    "        [--max-pos P] [--dtype f16|bf16|f32] [--seed S] [--tied|--untied]\n"
    "        [--rope-theta T] [--rope-scaling TYPE[:KEY=VALUE,...]]\n"
    "        [--qwen2|--phi3|--gemma|--gemma2] [--head-dim D] [--sliding-window W] OUTDIR\n"
    "      Writes a synthetic HuggingFace model (config.json + model.safetensors) with\n"
    "      deterministic weights. Defaults: --kv-heads A, --max-pos 2048, --dtype f16, --seed 0,\n"
    "      OPT tied and Llama untied output head. Llama only: --rope-theta (10000),\n"
    "      --rope-scaling linear|dynamic|llama3|yarn with config.json's rope_scaling fields\n"
    "      (e.g. llama3:factor=8,low_freq_factor=1,high_freq_factor=4,\n"
    "      original_max_position_embeddings=8192; longrope:original_max_position_embeddings=N\n"
    "      writes generated short/long factors, Phi-3 only), --qwen2 (model_type qwen2: q/k/v\n"
    "      biases), --phi3 (model_type phi3: fused qkv_proj and gate_up_proj holding the plain\n"
    "      Llama's weights of the same seed), --sliding-window W (config.json's sliding_window;\n"
    "      a plain Llama becomes model_type mistral, as HF's Llama has no window), --gemma\n"
    "      (model_type gemma: GeGLU, (1 + w) norms, scaled embeddings, tied head), --gemma2\n"
    "      (model_type gemma2: also the four norms of a layer, soft-capping, the window on the\n"
    "      even layers; query_pre_attn_scalar hidden/heads), --head-dim D (hidden/heads).\n"
    "  inspect PATH\n"
    "      Prints the configuration and every tensor of a HuggingFace directory, a .safetensors\n"
    "      file or index, a llama2.c .bin checkpoint, or a GGUF file (its metadata too), with\n"
    "      total bytes and parameter count.\n"
    "  --help\n"
    "      This text.\n"
    "  --version\n"
    "      The version.\n";

/* A runtime failure: one line, exit 1. */
static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "rekv-loader: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

/* A usage error (a missing or bad option): one line, exit 2. */
static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "rekv-loader: ");
    vfprintf(stderr, fmt, ap);
    fputs(" (see rekv-loader --help)\n", stderr);
    va_end(ap);
    return 2;
}

static int parse_ll(const char *opt, const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (s[0] == '\0' || *end != '\0' || errno != 0 || v < lo || v > hi) {
        fprintf(stderr, "rekv-loader: --%s: \"%s\" is not an integer in [%lld, %lld]\n", opt, s, lo,
                hi);
        return -1;
    }
    *out = v;
    return 0;
}

/* ---------------------------------------------------------------- synth */

/* --rope-scaling TYPE[:KEY=VALUE,...]: TYPE is linear, dynamic, llama3 or yarn; the keys are
 * config.json's rope_scaling fields (truncate takes 0 or 1). */
static int parse_rope_scaling(const char *spec, rekv_rope_scaling *r)
{
    static const struct {
        const char *key;
        size_t off;
    } keys[] = {{"factor", offsetof(rekv_rope_scaling, factor)},
                {"low_freq_factor", offsetof(rekv_rope_scaling, low_freq_factor)},
                {"high_freq_factor", offsetof(rekv_rope_scaling, high_freq_factor)},
                {"beta_fast", offsetof(rekv_rope_scaling, beta_fast)},
                {"beta_slow", offsetof(rekv_rope_scaling, beta_slow)},
                {"mscale", offsetof(rekv_rope_scaling, mscale)},
                {"mscale_all_dim", offsetof(rekv_rope_scaling, mscale_all_dim)},
                {"attention_factor", offsetof(rekv_rope_scaling, attention_factor)}};
    char buf[512];
    if (snprintf(buf, sizeof(buf), "%s", spec) >= (int)sizeof(buf))
        return bad_usage("synth: --rope-scaling: too long");
    memset(r, 0, sizeof(*r));
    r->beta_fast = 32, r->beta_slow = 1, r->truncate = 1; /* HF's defaults */
    char *kv = strchr(buf, ':');
    if (kv)
        *kv++ = '\0';
    rekv_rope_scaling_type t;
    for (t = REKV_ROPE_SCALING_LINEAR; t <= REKV_ROPE_SCALING_LONGROPE; t++)
        if (t != REKV_ROPE_SCALING_FACTORS && strcmp(buf, rekv_rope_scaling_name(t)) == 0)
            break;
    if (t > REKV_ROPE_SCALING_LONGROPE)
        return bad_usage(
            "synth: --rope-scaling: type \"%s\" is not linear, dynamic, llama3, yarn or longrope",
            buf);
    r->type = t;
    for (char *save = NULL, *item = kv ? strtok_r(kv, ",", &save) : NULL; item;
         item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '='), *end;
        if (eq == NULL)
            return bad_usage("synth: --rope-scaling: \"%s\" is not KEY=VALUE", item);
        *eq = '\0';
        double x = strtod(eq + 1, &end);
        if (eq[1] == '\0' || *end != '\0' || !isfinite(x) || x < 0)
            return bad_usage("synth: --rope-scaling: %s=\"%s\" is not a non-negative number", item,
                             eq + 1);
        size_t i;
        for (i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
            if (strcmp(item, keys[i].key) == 0)
                break;
        if (i < sizeof(keys) / sizeof(keys[0]))
            *(double *)((char *)r + keys[i].off) = x;
        else if (strcmp(item, "original_max_position_embeddings") == 0 && x == floor(x) && x >= 1 &&
                 x <= 1 << 30)
            r->original_max_pos = (int)x;
        else if (strcmp(item, "truncate") == 0 && (x == 0 || x == 1))
            r->truncate = (int)x;
        else
            return bad_usage("synth: --rope-scaling: unknown key or bad value %s=%s", item, eq + 1);
    }
    return 0;
}

/* synth's --rope-theta: a positive number; 0, or 2 with the usage error printed. */
static int parse_theta(const char *v, float *out)
{
    char *end;
    double t = strtod(v, &end);
    if (v[0] == '\0' || *end != '\0' || !(t > 0) || t > 1e12)
        return bad_usage("synth: --rope-theta: \"%s\" is not a positive number", v);
    *out = (float)t;
    return 0;
}

/* synth's --arch, --dtype and --seed (name says which) into s; 0, or 2 with the usage error. */
static int parse_spec_word(const char *name, const char *v, rekv_synth_spec *s)
{
    if (strcmp(name, "arch") == 0) {
        if (strcmp(v, "opt") == 0)
            s->arch = REKV_ARCH_OPT;
        else if (strcmp(v, "llama") == 0)
            s->arch = REKV_ARCH_LLAMA;
        else
            return bad_usage("synth: --arch must be opt or llama, not \"%s\"", v);
    } else if (strcmp(name, "dtype") == 0) {
        if (strcmp(v, "f16") == 0)
            s->dtype = REKV_DTYPE_F16;
        else if (strcmp(v, "bf16") == 0)
            s->dtype = REKV_DTYPE_BF16;
        else if (strcmp(v, "f32") == 0)
            s->dtype = REKV_DTYPE_F32;
        else
            return bad_usage("synth: --dtype must be f16, bf16 or f32, not \"%s\"", v);
    } else {
        char *end;
        errno = 0;
        unsigned long long seed = strtoull(v, &end, 0);
        if (v[0] == '\0' || v[0] == '-' || *end != '\0' || errno != 0)
            return bad_usage("synth: --seed: \"%s\" is not an unsigned integer", v);
        s->seed = seed;
    }
    return 0;
}

/* synth's options (file scope: cmd_synth's switch is long enough) */
enum {
    O_ARCH = 1000,
    O_DTYPE,
    O_SEED,
    O_LAYERS,
    O_HIDDEN,
    O_HEADS,
    O_KV_HEADS,
    O_FFN,
    O_VOCAB,
    O_MAX_POS,
    O_TIED,
    O_UNTIED,
    O_ROPE_THETA,
    O_ROPE_SCALING,
    O_QWEN2,
    O_PHI3,
    O_WINDOW,
    O_GEMMA,
    O_GEMMA2,
    O_HEAD_DIM,
    O_HELP
};
static const struct option synth_opts[] = {{"arch", required_argument, 0, O_ARCH},
                                           {"dtype", required_argument, 0, O_DTYPE},
                                           {"seed", required_argument, 0, O_SEED},
                                           {"layers", required_argument, 0, O_LAYERS},
                                           {"hidden", required_argument, 0, O_HIDDEN},
                                           {"heads", required_argument, 0, O_HEADS},
                                           {"kv-heads", required_argument, 0, O_KV_HEADS},
                                           {"ffn", required_argument, 0, O_FFN},
                                           {"vocab", required_argument, 0, O_VOCAB},
                                           {"max-pos", required_argument, 0, O_MAX_POS},
                                           {"tied", no_argument, 0, O_TIED},
                                           {"untied", no_argument, 0, O_UNTIED},
                                           {"rope-theta", required_argument, 0, O_ROPE_THETA},
                                           {"rope-scaling", required_argument, 0, O_ROPE_SCALING},
                                           {"qwen2", no_argument, 0, O_QWEN2},
                                           {"phi3", no_argument, 0, O_PHI3},
                                           {"sliding-window", required_argument, 0, O_WINDOW},
                                           {"gemma", no_argument, 0, O_GEMMA},
                                           {"gemma2", no_argument, 0, O_GEMMA2},
                                           {"head-dim", required_argument, 0, O_HEAD_DIM},
                                           {"help", no_argument, 0, O_HELP},
                                           {0, 0, 0, 0}};

/* The int field of s or lv that option o sets, or NULL. */
static int *synth_int_field(int o, rekv_synth_spec *s, rekv_synth_llama *lv)
{
    switch (o) {
    case O_LAYERS: return &s->n_layers;
    case O_HIDDEN: return &s->hidden;
    case O_HEADS: return &s->n_heads;
    case O_KV_HEADS: return &s->n_kv_heads;
    case O_FFN: return &s->ffn;
    case O_VOCAB: return &s->vocab;
    case O_MAX_POS: return &s->max_pos;
    case O_WINDOW: return &lv->sliding_window;
    case O_HEAD_DIM: return &lv->head_dim;
    default: return NULL;
    }
}

static int cmd_synth(int argc, char **argv)
{
    rekv_synth_spec s;
    rekv_synth_llama lv;
    memset(&s, 0, sizeof(s));
    memset(&lv, 0, sizeof(lv));
    s.arch = -1;
    s.dtype = REKV_DTYPE_F16;
    s.max_pos = 2048;
    int tied = -1;
    int o;
    optind = 1;
    opterr = 0; /* our own one-line message */
    while ((o = getopt_long(argc, argv, ":h", synth_opts, NULL)) != -1) {
        const char *v = optarg;
        int *field = synth_int_field(o, &s, &lv);
        long long x;
        switch (o) {
        case O_TIED:
            tied = 1;
            break;
        case O_UNTIED:
            tied = 0;
            break;
        case O_QWEN2:
            lv.qwen2 = 1;
            break;
        case O_PHI3:
            lv.phi3 = 1;
            break;
        case O_GEMMA:
        case O_GEMMA2:
            if (lv.gemma)
                return bad_usage("synth: --gemma and --gemma2 are two families");
            lv.gemma = o == O_GEMMA ? 1 : 2;
            break;
        case O_ROPE_THETA:
            if (parse_theta(v, &lv.rope_theta))
                return 2;
            break;
        case O_ROPE_SCALING:
            if (parse_rope_scaling(v, &lv.rope_scaling) != 0)
                return 2;
            break;
        case 'h':
        case O_HELP:
            fputs(usage, stdout);
            return 0;
        case O_ARCH:
        case O_DTYPE:
        case O_SEED:
            if (parse_spec_word(o == O_ARCH ? "arch" : o == O_DTYPE ? "dtype" : "seed", v, &s))
                return 2;
            break;
        case ':':
            return bad_usage("synth: option %s needs a value", argv[optind - 1]);
        default:
            if (field == NULL)
                return bad_usage("synth: unknown option %s", argv[optind - 1]);
        }
        if (field != NULL) {
            const char *name = "";
            for (const struct option *q = synth_opts; q->name; q++)
                if (q->val == o)
                    name = q->name;
            if (parse_ll(name, v, 1, 1 << 30, &x) < 0)
                return 2;
            *field = (int)x;
        }
    }
    if (optind + 1 < argc)
        return bad_usage("synth: more than one output directory (%s and %s)", argv[optind],
                         argv[optind + 1]);
    const char *outdir = optind < argc ? argv[optind] : NULL;
    if ((int)s.arch < 0)
        return bad_usage("synth: --arch is required");
    if (s.n_layers == 0 || s.hidden == 0 || s.n_heads == 0 || s.ffn == 0 || s.vocab == 0)
        return bad_usage("synth: --layers, --hidden, --heads, --ffn and --vocab are required");
    if (outdir == NULL)
        return bad_usage("synth: no output directory given");
    s.tied_head = tied >= 0 ? tied : s.arch == REKV_ARCH_OPT || lv.gemma; /* HF's defaults */
    rekv_err err = {0};
    rekv_progress pr;
    rekv_progress_begin(&pr, stderr, rekv_progress_style_for(stderr, 0), "rekv-loader synth",
                        "bytes", 0);
    int rc = rekv_synth_write_llama(&s, &lv, outdir, rekv_progress_cb, &pr, &err);
    rekv_progress_end(&pr);
    if (rc < 0)
        return fail("%s", err.msg);
    printf("wrote %s/config.json and %s/model.safetensors\n", outdir, outdir);
    return 0;
}

/* ---------------------------------------------------------------- inspect */

static void print_shape(const rekv_tensor *t, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < t->ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%" PRId64, d ? ", " : "", t->shape[d]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
}

static void print_config(const rekv_model_config *c)
{
    static const char *const arch[] = {"opt", "llama"};
    static const char *const rope[] = {"none", "half", "adjacent"};
    static const char *const act[] = {"relu", "gelu", "silu", "gelu_tanh"};
    printf("config:\n");
    printf("  arch            %s\n", (unsigned)c->arch < 2 ? arch[c->arch] : "?");
    printf("  layers          %d\n", c->n_layers);
    printf("  hidden          %d\n", c->hidden);
    printf("  heads           %d\n", c->n_heads);
    printf("  kv_heads        %d\n", c->n_kv_heads);
    printf("  head_dim        %d\n", c->head_dim);
    printf("  ffn             %d\n", c->ffn);
    printf("  vocab           %d\n", c->vocab);
    printf("  max_pos         %d\n", c->max_pos);
    if (c->sliding_window > 0)
        printf("  sliding_window  %d\n", c->sliding_window);
    printf("  embed_dim       %d\n", c->embed_dim);
    printf("  norm_eps        %g\n", (double)c->norm_eps);
    printf("  rope            %s (theta %g)\n", (unsigned)c->rope < 3 ? rope[c->rope] : "?",
           (double)c->rope_theta);
    const rekv_rope_scaling *rs = &c->rope_scaling;
    if (rs->type != REKV_ROPE_SCALING_NONE)
        printf("  rope_scaling    %s (factor %g, original_max_pos %d, low/high_freq_factor %g/%g, "
               "beta_fast/slow %g/%g, attention_factor %g)\n",
               rekv_rope_scaling_name(rs->type), rs->factor, rs->original_max_pos,
               rs->low_freq_factor, rs->high_freq_factor, rs->beta_fast, rs->beta_slow,
               rs->attention_factor);
    printf("  activation      %s%s\n", (unsigned)c->act < 4 ? act[c->act] : "?",
           rekv_config_gated(c) ? " (gated)" : "");
    if (c->window_even_layers)
        printf("  window_layers   even\n");
    if (c->norm_add_one)
        printf("  gemma           embed_scale %g, norms (1 + w), post_norms %d, attn_scale %g, "
               "attn_softcap %g, final_softcap %g\n",
               (double)c->embed_scale, c->post_norms, (double)c->attn_scale,
               (double)c->attn_softcap, (double)c->final_softcap);
    printf("  pre_norm        %d\n", c->pre_norm);
    printf("  final_norm      %d\n", c->final_norm);
    printf("  tied_head       %d\n", c->tied_head);
    printf("  biases          qkv %d, o %d, ffn %d, norm %d\n", c->qkv_bias, c->o_bias, c->ffn_bias,
           c->norm_bias);
    printf("  bos/eos/pad     %d/%d/%d (add_bos %d)\n", c->bos_id, c->eos_id, c->pad_id,
           c->add_bos);
    if (c->n_eos_ids > 1) {
        printf("  eos_ids        ");
        for (int i = 0; i < c->n_eos_ids; i++)
            printf(" %d", c->eos_ids[i]);
        printf("\n");
    }
    printf("  dtype           %s\n", rekv_dtype_name(c->dtype));
}

static int inspect_safetensors(const char *path)
{
    rekv_err err = {0};
    rekv_safetensors *st;
    if (rekv_safetensors_open(path, &st, &err) < 0)
        return fail("%s", err.msg);
    size_t n = rekv_safetensors_count(st);
    uint64_t bytes = 0, params = 0;
    printf("tensors: %zu\n", n);
    for (size_t i = 0; i < n; i++) {
        const rekv_tensor *t = rekv_safetensors_at(st, i);
        char shape[256];
        print_shape(t, shape, sizeof(shape));
        printf("  %-60s %-4s %-20s %zu\n", t->name, rekv_dtype_name(t->dtype), shape, t->nbytes);
        bytes += t->nbytes;
        params += (uint64_t)rekv_tensor_numel(t);
    }
    printf("total bytes: %" PRIu64 "\n", bytes);
    printf("parameters: %" PRIu64 " (%.2fM)\n", params, (double)params / 1e6);
    rekv_safetensors_close(st);
    return 0;
}

static int inspect_hf_dir(const char *dir)
{
    char cfg[4096];
    snprintf(cfg, sizeof(cfg), "%s/config.json", dir);
    printf("model: %s (HuggingFace directory)\n", dir);
    if (access(cfg, F_OK) == 0) {
        rekv_model_config c;
        rekv_err err = {0};
        if (rekv_config_load_hf(cfg, &c, &err) < 0)
            return fail("%s", err.msg);
        print_config(&c);
    } else {
        printf("config: none (no config.json)\n");
        return inspect_safetensors(dir);
    }
    int rc = inspect_safetensors(dir);
    if (rc)
        return rc;
    /* what loading checks: every tensor the config needs, present, with its shape (a listing
     * alone would pass a missing or transposed one) */
    rekv_model *m = NULL;
    rekv_err err = {0};
    if (rekv_model_open_hf(dir, &m, &err) < 0)
        return fail("%s", err.msg);
    rekv_model_close(m);
    printf("weights: every tensor the config needs is present with its shape\n");
    return 0;
}

/* The llama2.c legacy checkpoint: 7 int32 of header, then fp32 arrays (FORMAT.md). */
static int inspect_llama2c(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fail("%s: cannot open: %s", path, strerror(errno));
    int32_t h[7];
    struct stat sb;
    if (fstat(fd, &sb) != 0 || read(fd, h, sizeof(h)) != (ssize_t)sizeof(h)) {
        close(fd);
        return fail("%s: %s", path, "too short for a llama2.c header (28 bytes)");
    }
    close(fd);
    int64_t dim = h[0], hid = h[1], L = h[2], nh = h[3], nkv = h[4], vocab = h[5], seq = h[6];
    int shared = vocab > 0;
    if (vocab < 0)
        vocab = -vocab;
    if (dim <= 0 || hid <= 0 || L <= 0 || nh <= 0 || nkv <= 0 || vocab <= 0 || seq <= 0 ||
        dim % nh != 0 || nh % nkv != 0 || (dim / nh) % 2 != 0)
        return fail("%s: %s", path, "implausible llama2.c header");
    int64_t hs = dim / nh, kv = dim * nkv / nh;
    struct {
        const char *name;
        int64_t n;
    } arr[] = {
        {"token_embedding", vocab * dim},
        {"rms_att_weight", L * dim},
        {"wq", L * dim * dim},
        {"wk", L * kv * dim},
        {"wv", L * kv * dim},
        {"wo", L * dim * dim},
        {"rms_ffn_weight", L * dim},
        {"w1", L * hid * dim},
        {"w2", L * dim * hid},
        {"w3", L * hid * dim},
        {"rms_final_weight", dim},
        {"freq_cis_real", seq * hs / 2},
        {"freq_cis_imag", seq * hs / 2},
        {"classifier", shared ? 0 : vocab * dim},
    };
    printf("model: %s (llama2.c checkpoint)\n", path);
    printf("header:\n  dim %" PRId64 "\n  hidden_dim %" PRId64 "\n  n_layers %" PRId64
           "\n  n_heads %" PRId64 "\n  n_kv_heads %" PRId64 "\n  vocab_size %d (%s classifier)\n"
           "  seq_len %" PRId64 "\n",
           dim, hid, L, nh, nkv, h[5], shared ? "shared" : "separate", seq);
    int64_t floats = 0, params = 0;
    printf("arrays (fp32):\n");
    for (size_t i = 0; i < sizeof(arr) / sizeof(arr[0]); i++) {
        if (arr[i].n == 0)
            continue;
        printf("  %-18s %12" PRId64 " floats %14" PRId64 " bytes\n", arr[i].name, arr[i].n,
               arr[i].n * 4);
        floats += arr[i].n;
        if (strncmp(arr[i].name, "freq_cis", 8) != 0)
            params += arr[i].n;
    }
    int64_t want = 28 + floats * 4;
    printf("total bytes: %" PRId64 " (file %lld)\n", want, (long long)sb.st_size);
    printf("parameters: %" PRId64 " (%.2fM)\n", params, (double)params / 1e6);
    if (want != (int64_t)sb.st_size) {
        char msg[128];
        snprintf(msg, sizeof(msg), "file is %lld bytes, the header implies %lld",
                 (long long)sb.st_size, (long long)want);
        return fail("%s: %s", path, msg);
    }
    return 0;
}

/* One metadata value (element i of an array) as text: strings quoted, cut at 60 bytes. */
static void print_gguf_value(const rekv_gguf_kv *kv, uint64_t i)
{
    const char *str;
    size_t n;
    int64_t iv;
    double fv;
    if (rekv_gguf_kv_str(kv, i, &str, &n) == 0) {
        putchar('"');
        for (size_t k = 0; k < n && k < 60; k++) {
            unsigned char c = (unsigned char)str[k];
            if (c == '"' || c == '\\')
                printf("\\%c", c);
            else if (c < 0x20 || c == 0x7f)
                printf("\\x%02x", c);
            else
                putchar(c);
        }
        printf(n > 60 ? "\"..." : "\"");
    } else if (rekv_gguf_kv_float(kv, i, &fv) == 0) {
        printf("%.9g", fv);
    } else if (kv->elem_type == REKV_GGUF_BOOL) {
        printf("%s", kv->value[i] ? "true" : "false");
    } else if (rekv_gguf_kv_int(kv, i, &iv) == 0) {
        printf("%" PRId64, iv);
    } else if (kv->elem_type == REKV_GGUF_U64) {
        uint64_t u;
        memcpy(&u, kv->value + i * 8, 8);
        printf("%" PRIu64, u);
    } else {
        printf("[...]"); /* an array inside an array */
    }
}

/* A GGUF file: header, metadata, tensors; then, for a llama GGUF, the config and whether rekv
 * can load its weights. */
static int inspect_gguf(const char *path)
{
    rekv_err err = {0};
    rekv_gguf *g;
    if (rekv_gguf_open(path, &g, &err) < 0)
        return fail("%s", err.msg);
    printf("model: %s (GGUF version %u, alignment %u, data at %" PRIu64 ")\n", path, g->version,
           g->alignment, g->data_offset);
    printf("metadata: %zu\n", g->n_kvs);
    for (size_t i = 0; i < g->n_kvs; i++) {
        const rekv_gguf_kv *kv = &g->kvs[i];
        printf("  %-44s ", kv->key);
        if (kv->type != REKV_GGUF_ARRAY) {
            printf("%-8s ", rekv_gguf_vtype_name(kv->type));
            print_gguf_value(kv, 0);
        } else {
            printf("%s[%" PRIu64 "] [", rekv_gguf_vtype_name(kv->elem_type), kv->n);
            for (uint64_t k = 0; k < kv->n && k < 4; k++) {
                printf(k ? ", " : "");
                print_gguf_value(kv, k);
            }
            printf(kv->n > 4 ? ", ...]" : "]");
        }
        putchar('\n');
    }
    uint64_t bytes = 0, params = 0;
    printf("tensors: %zu\n", g->n_tensors);
    for (size_t i = 0; i < g->n_tensors; i++) {
        const rekv_gguf_tensor *t = &g->tensors[i];
        char shape[160];
        size_t n = (size_t)snprintf(shape, sizeof(shape), "[");
        for (int d = 0; d < t->n_dims && n < sizeof(shape); d++)
            n += (size_t)snprintf(shape + n, sizeof(shape) - n, "%s%" PRIu64, d ? ", " : "",
                                  t->ne[d]);
        if (n < sizeof(shape))
            snprintf(shape + n, sizeof(shape) - n, "]");
        printf("  %-40s %-6s %-16s %12zu bytes at %" PRIu64 "\n", t->name,
               rekv_ggml_type_name(t->type), shape, t->nbytes, t->offset);
        bytes += t->nbytes;
        params += t->numel;
    }
    printf("total bytes: %" PRIu64 "\n", bytes);
    printf("parameters: %" PRIu64 " (%.2fM)\n", params, (double)params / 1e6);
    printf("(GGUF dims: ne[0], the row length, first)\n");
    /* a file rekv cannot run (another architecture, quantized weights for now) is still a valid
     * one to list: say why, and succeed */
    rekv_model_config c;
    int rc = rekv_gguf_config(g, &c, &err);
    rekv_gguf_close(g);
    if (rc == -ENOTSUP) {
        printf("config: not supported: %s\n", err.msg);
        return 0;
    }
    if (rc < 0)
        return fail("%s", err.msg);
    print_config(&c);
    rekv_model *m = NULL;
    rc = rekv_model_open_gguf(path, &m, &err);
    if (rc == -ENOTSUP) {
        printf("weights: not loadable yet: %s\n", err.msg);
        return 0;
    }
    if (rc < 0)
        return fail("%s", err.msg);
    rekv_model_close(m);
    printf("weights: every tensor the config needs is present with its shape\n");
    return 0;
}

static int cmd_inspect(int argc, char **argv)
{
    static const struct option opts[] = {{"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int o;
    optind = 1;
    opterr = 0;
    while ((o = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        if (o == 'h') {
            fputs(usage, stdout);
            return 0;
        }
        return bad_usage("inspect: unknown option %s", argv[optind - 1]);
    }
    if (argc - optind != 1)
        return bad_usage("inspect: expected exactly one PATH");
    const char *path = argv[optind];
    struct stat sb;
    if (stat(path, &sb) != 0)
        return fail("%s: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode))
        return inspect_hf_dir(path);
    if (rekv_gguf_is_gguf(path))
        return inspect_gguf(path);
    size_t n = strlen(path);
    if ((n >= 12 && strcmp(path + n - 12, ".safetensors") == 0) ||
        (n >= 5 && strcmp(path + n - 5, ".json") == 0)) {
        printf("model: %s\n", path);
        return inspect_safetensors(path);
    }
    return inspect_llama2c(path);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fputs(usage, stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        fputs(usage, stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("rekv-loader %s\n", rekv_version());
        return 0;
    }
    if (strcmp(cmd, "synth") == 0)
        return cmd_synth(argc - 1, argv + 1);
    if (strcmp(cmd, "inspect") == 0)
        return cmd_inspect(argc - 1, argv + 1);
    return bad_usage("unknown command \"%s\"", cmd);
}
