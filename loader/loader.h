/* loader.h — the public interface of rekv's model loader.
 *
 * The loader reads a model from disk — a HuggingFace directory (config.json, *.safetensors,
 * tokenizer files) of the OPT or Llama families, or a llama2.c legacy checkpoint — and presents it
 * in one architecture-neutral form: a rekv_model_config and a rekv_weights table of tensors that
 * point into the memory-mapped files, in the file's dtype. Backends convert to their compute dtype.
 *
 * Every function returns 0 or a negative errno and, on failure, fills the rekv_err with one line
 * naming the file and what is wrong. Nothing here prints. */
#ifndef REKV_LOADER_H
#define REKV_LOADER_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/err.h"
#include "common/progress.h"

/* ---------------------------------------------------------------- model configuration */

typedef enum rekv_arch {
    REKV_ARCH_OPT = 0,   /* OPTForCausalLM: LayerNorm, learned positions (+2 offset), ReLU FFN */
    REKV_ARCH_LLAMA = 1, /* Llama/Mistral/Qwen2 and llama2.c: RMSNorm, RoPE, SwiGLU, GQA */
} rekv_arch;

typedef enum rekv_rope {
    REKV_ROPE_NONE = 0,     /* OPT: learned absolute positions */
    REKV_ROPE_HALF = 1,     /* HF Llama: rotate (x[j], x[j + head_dim/2]) */
    REKV_ROPE_ADJACENT = 2, /* llama2.c: rotate (x[2j], x[2j+1]) */
} rekv_rope;

/* HF config.json's rope_scaling: how the per-pair RoPE frequencies depart from theta^(-2j/d).
 * rekv computes the frequencies once (rekv_rope_freqs_init) and every backend's rope reads them. */
typedef enum rekv_rope_scaling_type {
    REKV_ROPE_SCALING_NONE = 0,    /* plain RoPE: inv_freq[j] = theta^(-2j/head_dim) */
    REKV_ROPE_SCALING_LINEAR = 1,  /* positions divided by factor (inv_freq / factor) */
    REKV_ROPE_SCALING_DYNAMIC = 2, /* NTK-aware: the base grows with the length past original_max_pos */
    REKV_ROPE_SCALING_LLAMA3 = 3,  /* Llama 3.1: low frequencies / factor, a smooth band between */
    REKV_ROPE_SCALING_YARN = 4,    /* YaRN: ramp between interpolation and extrapolation, mscale */
    REKV_ROPE_SCALING_FACTORS = 5, /* explicit per-pair divisors (GGUF's rope_freqs.weight) */
    REKV_ROPE_SCALING_LONGROPE = 6, /* Phi-3: per-pair short/long divisors, the long ones from
                                       original_max_pos on; an attention factor */
} rekv_rope_scaling_type;

#define REKV_ROPE_MAX_PAIRS 256 /* head_dim <= 512 */

typedef struct rekv_rope_scaling {
    rekv_rope_scaling_type type;
    double factor;           /* linear, dynamic, llama3, yarn: > 0 */
    int original_max_pos;   /* llama3, yarn: the pre-training context (rope_scaling's
                                original_max_position_embeddings); dynamic: the length past which
                                the base grows (HF: max_position_embeddings) */
    double low_freq_factor;  /* llama3 */
    double high_freq_factor; /* llama3; > low_freq_factor */
    double beta_fast, beta_slow;   /* yarn: ramp bounds in rotations (HF defaults 32, 1) */
    double mscale, mscale_all_dim; /* yarn (DeepSeek form): 0 when absent */
    double attention_factor;       /* yarn: cos/sin multiplier; 0 when absent (then computed) */
    int truncate;                  /* yarn: floor/ceil the ramp bounds (HF default 1) */
    /* FACTORS: inv_freq[j] = theta^(-2j/d) / freq_factors[j]; LONGROPE: HF's short_factor */
    float freq_factors[REKV_ROPE_MAX_PAIRS];
    /* LONGROPE: HF's long_factor, for positions from original_max_pos on; factor is then
     * max_pos / original_max_pos (HF's), attention_factor 0 when absent (then computed) */
    float long_factors[REKV_ROPE_MAX_PAIRS];
} rekv_rope_scaling;

typedef enum rekv_act {
    REKV_ACT_RELU = 0,
    REKV_ACT_GELU = 1, /* exact erf GELU */
    REKV_ACT_SILU = 2, /* with a gate: SwiGLU */
    REKV_ACT_GELU_TANH = 3, /* tanh-approximated GELU (PyTorch's approximate="tanh"); with a gate:
                               Gemma's GeGLU, gelu(gate) * up */
} rekv_act;

#define REKV_MAX_EOS 8 /* end-of-sequence ids a config may list */

typedef struct rekv_model_config {
    rekv_arch arch;
    rekv_rope rope;
    rekv_act act;
    int n_layers;
    int hidden;     /* model width d */
    int n_heads;    /* query heads */
    int n_kv_heads; /* key/value heads (== n_heads without GQA) */
    int head_dim;   /* per head; n_heads * head_dim need not equal hidden (explicit head_dim) */
    int ffn;        /* FFN inner width */
    int vocab;
    int max_pos;    /* context length the model supports */
    int sliding_window; /* 0: full attention; W: a position attends to itself and the W - 1 before
                           it (Mistral, Phi-3: HF's kv > q - W) */
    int embed_dim;  /* OPT word_embed_proj_dim; == hidden when there is no project_in/out */
    float norm_eps;
    float rope_theta;
    rekv_rope_scaling rope_scaling; /* type NONE: plain RoPE */
    int window_even_layers; /* 1: sliding_window applies to the even layers only, the odd ones
                               attend in full (Gemma-2); rekv_config_window says per layer */
    /* Gemma (model_type gemma, gemma2): all 0 for the other families */
    float embed_scale;   /* 0: none; else the embeddings times it (sqrt(hidden) in the model's
                            dtype, as HF's normalizer) */
    int norm_add_one;    /* RMSNorm's weights are offsets: the norm multiplies by (1 + w), in fp32;
                            the engine adds the 1 when it loads them */
    int post_norms;      /* Gemma-2: the attention's and the FFN's outputs are normalised before
                            the residual add (post_attn_norm_w, post_ffn_norm_w) */
    float attn_scale;    /* 0: 1/sqrt(head_dim); Gemma-2: query_pre_attn_scalar^-0.5 */
    float attn_softcap;  /* 0: none; c: scores = c * tanh(scores / c) before the mask */
    float final_softcap; /* 0: none; c: logits = c * tanh(logits / c) */
    int pre_norm;     /* OPT do_layer_norm_before; always 1 for Llama */
    int final_norm;   /* a norm before the head (absent in post-norm OPT such as OPT-350m) */
    int tied_head;    /* lm_head shares embed_tokens */
    int qkv_bias;     /* q/k/v projections have biases (OPT, Qwen2) */
    int o_bias;       /* output projection has a bias (OPT) */
    int ffn_bias;     /* FFN projections have biases (OPT) */
    int norm_bias;    /* norms are LayerNorm with a bias (OPT); RMSNorm without (Llama) */
    int bos_id;       /* -1 when none */
    int eos_id;       /* -1 when none; the first of eos_ids */
    int eos_ids[REKV_MAX_EOS]; /* every end-of-sequence id (Llama 3.x lists several: <|eot_id|>..) */
    int n_eos_ids;             /* 0 when none */
    int pad_id;       /* -1 when none */
    int add_bos;      /* the tokenizer prepends bos_id to every prompt */
    rekv_dtype dtype; /* dtype of the stored weights */
    /* bytes per weight of the layers' matrices as the file stores them, 0 = rekv_dtype_size(dtype);
     * a GGUF file sets it (quantized blocks: Q4_K 0.5625, a Q4_K_M mix a little more) */
    double weight_elem_bytes;
} rekv_model_config;

/* Whether tok ends a sequence: one of the config's EOS ids (eos_id alone when the list is empty,
 * as a config built by code may leave it). */
static inline int rekv_config_is_eos(const rekv_model_config *c, int tok)
{
    if (c->n_eos_ids == 0)
        return tok == c->eos_id && tok >= 0;
    for (int i = 0; i < c->n_eos_ids; i++)
        if (tok == c->eos_ids[i])
            return 1;
    return 0;
}

/* The sliding window of layer l (0: full attention there). */
static inline int rekv_config_window(const rekv_model_config *c, int l)
{
    return c->window_even_layers && l % 2 != 0 ? 0 : c->sliding_window;
}

/* How many layers have a window (0: none), and into *window its size (one size for all). */
static inline int rekv_config_windowed_layers(const rekv_model_config *c, int *window)
{
    int n = 0;
    *window = 0;
    for (int l = 0; l < c->n_layers; l++)
        if (rekv_config_window(c, l) > 0)
            *window = rekv_config_window(c, l), n++;
    return n;
}

/* Whether the FFN is gated (a third matrix, up_proj: SwiGLU, GeGLU). */
static inline int rekv_config_gated(const rekv_model_config *c)
{
    return c->act == REKV_ACT_SILU || c->act == REKV_ACT_GELU_TANH;
}

/* kv_dim = n_kv_heads * head_dim; q_dim = n_heads * head_dim. */
static inline int rekv_config_kv_dim(const rekv_model_config *c) { return c->n_kv_heads * c->head_dim; }
static inline int rekv_config_q_dim(const rekv_model_config *c) { return c->n_heads * c->head_dim; }
/* Weights in one decoder layer's matrices: Q and O (hidden x q_dim), K and V (hidden x kv_dim),
 * and the FFN's two (three with SwiGLU's gate) of hidden x ffn. Biases and norms not counted. */
static inline double rekv_config_layer_params(const rekv_model_config *c)
{
    double H = c->hidden, F = c->ffn;
    return 2 * H * rekv_config_q_dim(c) + 2 * H * rekv_config_kv_dim(c) +
           (rekv_config_gated(c) ? 3 : 2) * H * F;
}

/* Bytes per weight of the layers' matrices as held: what the planner prices an offloaded layer's
 * weights by (rekv_config_layer_params of them). */
static inline double rekv_config_weight_elem_bytes(const rekv_model_config *c)
{
    return c->weight_elem_bytes > 0 ? c->weight_elem_bytes : (double)rekv_dtype_size(c->dtype);
}

/* RoPE's per-pair frequencies, computed on the host once per model (rekv_rope_freqs_init) and read
 * by every backend's rope: the angle of pair j at position p is p * inv_freq[j], and cos and sin
 * are multiplied by attn_factor (HF's attention_scaling; 1 but for YaRN). Dynamic NTK alone
 * depends on the length: position p >= dyn_from uses the base grown for length p + 1 (rekv_rope_
 * freqs_at), so a cached key never changes and results never depend on how a sequence is cut. */
typedef struct rekv_rope_freqs {
    int half;                           /* head_dim / 2 */
    float inv_freq[REKV_ROPE_MAX_PAIRS]; /* [half]: radians per position step */
    float attn_factor;
    int dyn_from;      /* dynamic: original_max_pos; INT_MAX otherwise */
    int long_from;     /* longrope: original_max_pos (positions from it use long_inv_freq);
                          INT_MAX otherwise */
    float long_inv_freq[REKV_ROPE_MAX_PAIRS]; /* longrope: [half] */
    double dyn_factor; /* dynamic: rope_scaling.factor */
    double theta;      /* dynamic: rope_theta */
} rekv_rope_freqs;

/* Fills f from the config's rope_theta, head_dim and rope_scaling; -EINVAL names a bad field. */
int rekv_rope_freqs_init(rekv_rope_freqs *f, const rekv_model_config *c, rekv_err *err);
/* The frequencies of position pos: f->inv_freq, dynamic NTK's for length pos + 1, or longrope's
 * long table from its original length on. */
void rekv_rope_freqs_at(const rekv_rope_freqs *f, int pos, float *inv_freq);
/* The name of a scaling type as HF's rope_type spells it ("none" for NONE). */
const char *rekv_rope_scaling_name(rekv_rope_scaling_type t);

/* Parses a HuggingFace config.json (OPT, Llama, Mistral, Qwen2, Phi-3, Gemma, Gemma-2), validating
 * every field; generation_config.json beside it adds its eos_token_id. */
int rekv_config_load_hf(const char *config_json_path, rekv_model_config *out, rekv_err *err);

/* ---------------------------------------------------------------- safetensors */

#define REKV_MAX_DIMS 8

typedef struct rekv_tensor {
    const char *name;             /* owned by the file it came from */
    rekv_dtype dtype;
    int ndim;
    int64_t shape[REKV_MAX_DIMS]; /* row-major; shape[ndim-1] varies fastest */
    const void *data;             /* points into a read-only mmap */
    size_t nbytes;
    /* 0, or the GGUF block type (loader/gguf.h's rekv_ggml_type: Q8_0, Q4_0, Q4_K, Q6_K) of a
     * matrix whose data are quantized blocks, each row shape[ndim-1] elements in whole blocks;
     * dtype is then F32, meaning only "dequantizes to fp32" */
    uint32_t qtype;
} rekv_tensor;

static inline int64_t rekv_tensor_numel(const rekv_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

/* A set of safetensors files: one model.safetensors or the shards named by
 * model.safetensors.index.json. Opening validates every header strictly. */
typedef struct rekv_safetensors rekv_safetensors;

/* The mapping of the set's files that holds [p, p + bytes): its start and length; 0 when none. */
int rekv_safetensors_mapping(const rekv_safetensors *st, const void *p, size_t bytes,
                             const void **map, size_t *len);

/* path: a .safetensors file, a model.safetensors.index.json, or a directory holding either. */
int rekv_safetensors_open(const char *path, rekv_safetensors **out, rekv_err *err);
void rekv_safetensors_close(rekv_safetensors *st);
size_t rekv_safetensors_count(const rekv_safetensors *st);
const rekv_tensor *rekv_safetensors_at(const rekv_safetensors *st, size_t i);
/* NULL when there is no tensor of that name. */
const rekv_tensor *rekv_safetensors_find(const rekv_safetensors *st, const char *name);

/* Streaming writer: the caller declares every tensor first (the header is written then), and then
 * writes each tensor's bytes in declaration order, in as many pieces as it likes, so that models
 * larger than memory can be written. */
typedef struct rekv_st_writer rekv_st_writer;
int rekv_st_writer_open(const char *path, rekv_st_writer **out, rekv_err *err);
int rekv_st_writer_declare(rekv_st_writer *w, const char *name, rekv_dtype dtype, int ndim,
                           const int64_t *shape, rekv_err *err);
int rekv_st_writer_write(rekv_st_writer *w, const void *data, size_t nbytes, rekv_err *err);
/* Checks every declared byte was written, flushes, closes; frees w in all cases. */
int rekv_st_writer_close(rekv_st_writer *w, rekv_err *err);

/* ---------------------------------------------------------------- weights */

/* The weights of one decoder layer; a NULL entry means the architecture has no such tensor.
 * Shapes are as HuggingFace stores them: a linear layer's weight is [out][in]. */
typedef struct rekv_layer_weights {
    const rekv_tensor *attn_norm_w, *attn_norm_b; /* [hidden] */
    const rekv_tensor *wq, *bq;                   /* [q_dim][hidden], [q_dim] */
    const rekv_tensor *wk, *bk;                   /* [kv_dim][hidden], [kv_dim] */
    const rekv_tensor *wv, *bv;                   /* [kv_dim][hidden], [kv_dim] */
    const rekv_tensor *wo, *bo;                   /* [hidden][q_dim], [hidden] */
    const rekv_tensor *ffn_norm_w, *ffn_norm_b;   /* [hidden] */
    const rekv_tensor *w1, *b1; /* OPT fc1 / Llama gate_proj: [ffn][hidden], [ffn] */
    const rekv_tensor *w2, *b2; /* OPT fc2 / Llama down_proj: [hidden][ffn], [hidden] */
    const rekv_tensor *w3;      /* Llama up_proj: [ffn][hidden]; NULL for OPT */
    /* Gemma-2: post_attention_layernorm, post_feedforward_layernorm ([hidden]); NULL otherwise
     * (Gemma-2's pre_feedforward_layernorm is ffn_norm_w) */
    const rekv_tensor *post_attn_norm_w, *post_ffn_norm_w;
} rekv_layer_weights;

typedef struct rekv_weights {
    const rekv_tensor *embed_tokens;    /* [vocab][embed_dim] */
    const rekv_tensor *embed_positions; /* OPT: [max_pos + 2][hidden]; NULL otherwise */
    const rekv_tensor *project_in;      /* OPT: [hidden][embed_dim] when embed_dim != hidden */
    const rekv_tensor *project_out;     /* OPT: [embed_dim][hidden] when embed_dim != hidden */
    const rekv_tensor *final_norm_w, *final_norm_b; /* [hidden] */
    const rekv_tensor *lm_head;         /* [vocab][embed_dim]; == embed_tokens when tied */
    rekv_layer_weights *layers;         /* [n_layers] */
} rekv_weights;

/* ---------------------------------------------------------------- tokenizer */

typedef struct rekv_tokenizer rekv_tokenizer;

/* Loads the tokenizer that belongs to a model: for a HF directory, tokenizer.json when present,
 * else vocab.json + merges.txt (byte-level BPE); for a llama2.c .bin, a tokenizer.bin beside it.
 * Returns -ENOENT (with a message) when the model has no tokenizer. */
int rekv_tokenizer_load_for_model(const char *model_path, rekv_tokenizer **out, rekv_err *err);
/* Loads one tokenizer file set explicitly. */
int rekv_tokenizer_load_bpe(const char *vocab_json, const char *merges_txt, rekv_tokenizer **out,
                            rekv_err *err);
int rekv_tokenizer_load_hf_json(const char *tokenizer_json, rekv_tokenizer **out, rekv_err *err);
int rekv_tokenizer_load_llama2c(const char *tokenizer_bin, rekv_tokenizer **out, rekv_err *err);
void rekv_tokenizer_free(rekv_tokenizer *tok);

/* Encodes UTF-8 text (len bytes; need not be NUL-terminated) into ids; bos_id >= 0 prepends it.
 * *ids is malloc'd; the caller frees it. Special-token strings in the text are matched as specials. */
int rekv_tokenizer_encode(const rekv_tokenizer *tok, const char *text, size_t len, int bos_id,
                          int32_t **ids, size_t *n_ids, rekv_err *err);
/* Decodes ids into UTF-8 (malloc'd, NUL-terminated; *len excludes the NUL). Special tokens such
 * as BOS/EOS are skipped. Bytes that are not valid UTF-8 are kept as they are. */
int rekv_tokenizer_decode(const rekv_tokenizer *tok, const int32_t *ids, size_t n_ids, char **text,
                          size_t *len, rekv_err *err);
int rekv_tokenizer_vocab_size(const rekv_tokenizer *tok);
/* The id of a token string (e.g. "</s>"), or -1. */
int rekv_tokenizer_token_id(const rekv_tokenizer *tok, const char *piece);

/* ---------------------------------------------------------------- a whole model */

typedef struct rekv_model {
    rekv_model_config config;
    rekv_weights weights;
    char *path;
    /* private: what backs the tensors */
    rekv_safetensors *st;      /* HF models */
    void *map;                 /* llama2.c: the mmap'd checkpoint */
    size_t map_len;
    rekv_tensor *owned;        /* llama2.c: the tensor descriptors */
    size_t n_owned;
} rekv_model;

/* path: a HF directory or a llama2.c .bin. Validates the config and every tensor's presence, dtype
 * and shape. The tokenizer is separate (rekv_tokenizer_load_for_model): the engine runs on ids. */
int rekv_model_open(const char *path, rekv_model **out, rekv_err *err);
void rekv_model_close(rekv_model *m);

/* The caller has what it needs of t (a copy, converted or packed): t's pages of the model's
 * read-only file mapping leave this process's memory (madvise MADV_DONTNEED; whole pages, so
 * a neighbour's edge too). Nothing is lost: a later read of any tensor faults its pages back in
 * from the file. A tensor outside the model's mappings is left alone. */
void rekv_model_release(const rekv_model *m, const rekv_tensor *t);

/* Opens a llama2.c legacy checkpoint (see shared/models/stories260K/FORMAT.md). */
int rekv_model_open_llama2c(const char *bin_path, rekv_model **out, rekv_err *err);
/* Opens a HF directory. */
int rekv_model_open_hf(const char *dir, rekv_model **out, rekv_err *err);

/* ---------------------------------------------------------------- synthetic models */

typedef struct rekv_synth_spec {
    rekv_arch arch;
    int n_layers, hidden, n_heads, n_kv_heads, ffn, vocab, max_pos;
    rekv_dtype dtype;
    uint64_t seed;
    int tied_head; /* default: OPT tied, Llama untied */
} rekv_synth_spec;

/* A Llama's variants beyond rekv_synth_spec (kept apart so that the spec's positional
 * initializers stay complete); all zero: a plain Llama. */
typedef struct rekv_synth_llama {
    float rope_theta;               /* 0: 10000 */
    rekv_rope_scaling rope_scaling; /* written as config.json's rope_scaling unless type NONE */
    int qwen2; /* model_type qwen2: q/k/v projections with biases (Qwen2.5's attention) */
    int phi3;  /* model_type phi3: qkv_proj and gate_up_proj fused as HF's Phi3 stores them, each
                  the concatenation of the plain Llama's tensors of the same seed */
    int sliding_window; /* written as config.json's sliding_window when > 0 */
    int gemma;    /* 1: model_type gemma (GeGLU, (1 + w) norms stored as offsets near 0, scaled
                     embeddings); 2: gemma2 (also the post-norms, soft-capping at HF's defaults 50
                     and 30, query_pre_attn_scalar hidden / heads, the window on even layers) */
    int head_dim; /* 0: hidden / heads; else config.json's head_dim */
} rekv_synth_llama;

/* Writes a HF-format directory (config.json + model.safetensors) with deterministic weights scaled
 * so activations stay in range, streaming tensors so that any size can be written. */
int rekv_synth_write(const rekv_synth_spec *spec, const char *outdir, rekv_err *err);
/* The same, calling progress(arg, bytes written, bytes in all) after each chunk of tensor data
 * (progress may be NULL). */
int rekv_synth_write_progress(const rekv_synth_spec *spec, const char *outdir,
                              rekv_progress_fn progress, void *arg, rekv_err *err);
/* The same with a Llama's variants (llama may be NULL: none; a non-zero one for OPT is an error). */
int rekv_synth_write_llama(const rekv_synth_spec *spec, const rekv_synth_llama *llama,
                           const char *outdir, rekv_progress_fn progress, void *arg, rekv_err *err);

#endif
