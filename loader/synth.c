/* synth.c — synthetic HuggingFace-format models of any size, for tests and benchmarks.
 *
 * Weights are a pure function of (seed, tensor index, element index) through splitmix64, so any
 * element can be recomputed on its own and a model of any size streams out in fixed-size chunks
 * without ever being held in memory. Scales keep activations in range through many layers:
 * linear weights are uniform in ±gain/sqrt(fan_in), norm weights are near 1 (Gemma's, offsets from
 * 1, near 0), biases are small, and embeddings (and an untied lm_head) are roughly normal with std
 * 2/sqrt(hidden) clamped to [0.02, 1], which puts the logits at a std of about 2 after the final
 * norm. */
#define _GNU_SOURCE
#include "loader/loader.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define SYNTH_CHUNK_ELEMS (256u * 1024) /* 1 MiB of fp32 per chunk */
#define SYNTH_GAIN 1.0f

typedef enum synth_init {
    SYNTH_LINEAR = 0,   /* uniform ±gain/sqrt(fan_in) */
    SYNTH_NORM_W = 1,   /* 1 + uniform ±0.1 */
    SYNTH_BIAS = 2,     /* uniform ±0.02 */
    SYNTH_EMBED = 3,    /* approximately normal, std from the hidden size */
    SYNTH_NORM_OFF = 4, /* uniform ±0.1: Gemma's norm weights, offsets from 1 */
} synth_init;

typedef struct synth_tensor {
    char name[128];
    int ndim;
    int64_t shape[2];
    synth_init init;
    /* the tensor's rows are the rows of nparts generated tensors in order, part i being tensor
     * index ti[i] (its place in the plain Llama's list) of rows[i] rows: 1 part but for Phi-3's
     * fused ones, so a fused tensor holds exactly the plain Llama's Q, K, V or gate, up */
    int nparts;
    uint64_t ti[3];
    int64_t rows[3];
} synth_tensor;

typedef struct synth_list {
    synth_tensor *t;
    size_t n, cap;
} synth_list;

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The key of tensor ti: element i's bits are splitmix64(key + i * golden), i.e. the i-th output of
 * a splitmix64 stream seeded with key. */
static uint64_t synth_tensor_key(uint64_t seed, uint64_t ti)
{
    return splitmix64(seed ^ splitmix64(ti * 0xd1b54a32d192ed03ull + 1));
}

static int list_add(synth_list *l, synth_init init, int ndim, int64_t d0, int64_t d1,
                    const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static int list_add(synth_list *l, synth_init init, int ndim, int64_t d0, int64_t d1,
                    const char *fmt, ...)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        synth_tensor *nt = realloc(l->t, cap * sizeof(*nt));
        if (nt == NULL)
            return -ENOMEM;
        l->t = nt;
        l->cap = cap;
    }
    synth_tensor *t = &l->t[l->n++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof(t->name), fmt, ap);
    va_end(ap);
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->init = init;
    t->nparts = 1;
    t->ti[0] = l->n - 1;
    t->rows[0] = d0;
    return 0;
}

/* Phi-3's layout of a plain Llama list: each layer's q, k, v weights become one qkv_proj and its
 * gate, up one gate_up_proj (HF's Phi3 names and order), every other tensor kept. */
static void fuse_phi3(synth_list *l)
{
    size_t o = 0;
    for (size_t i = 0; i < l->n; i++) {
        synth_tensor t = l->t[i];
        const char *q = strstr(t.name, "self_attn.q_proj.weight");
        const char *g = strstr(t.name, "mlp.gate_proj.weight");
        int n = q ? 3 : g ? 2 : 1;
        if (n > 1) {
            for (int k = 1; k < n; k++) {
                t.ti[k] = l->t[i + (size_t)k].ti[0];
                t.rows[k] = l->t[i + (size_t)k].shape[0];
                t.shape[0] += t.rows[k];
            }
            t.nparts = n;
            strcpy(q ? strstr(t.name, "q_proj") : strstr(t.name, "gate_proj"),
                   q ? "qkv_proj.weight" : "gate_up_proj.weight");
            i += (size_t)n - 1;
        }
        l->t[o++] = t;
    }
    l->n = o;
}

static int build_opt(const rekv_synth_spec *s, synth_list *l)
{
    int64_t H = s->hidden, F = s->ffn, V = s->vocab, P = s->max_pos;
    int rc = 0;
    rc |= list_add(l, SYNTH_EMBED, 2, V, H, "model.decoder.embed_tokens.weight");
    rc |= list_add(l, SYNTH_EMBED, 2, P + 2, H, "model.decoder.embed_positions.weight");
    for (int i = 0; i < s->n_layers && rc == 0; i++) {
        const char *p = "model.decoder.layers";
        static const char *const proj[4] = {"q_proj", "k_proj", "v_proj", "out_proj"};
        for (int j = 0; j < 4; j++) {
            rc |= list_add(l, SYNTH_LINEAR, 2, H, H, "%s.%d.self_attn.%s.weight", p, i, proj[j]);
            rc |= list_add(l, SYNTH_BIAS, 1, H, 0, "%s.%d.self_attn.%s.bias", p, i, proj[j]);
        }
        rc |= list_add(l, SYNTH_NORM_W, 1, H, 0, "%s.%d.self_attn_layer_norm.weight", p, i);
        rc |= list_add(l, SYNTH_BIAS, 1, H, 0, "%s.%d.self_attn_layer_norm.bias", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, F, H, "%s.%d.fc1.weight", p, i);
        rc |= list_add(l, SYNTH_BIAS, 1, F, 0, "%s.%d.fc1.bias", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, H, F, "%s.%d.fc2.weight", p, i);
        rc |= list_add(l, SYNTH_BIAS, 1, H, 0, "%s.%d.fc2.bias", p, i);
        rc |= list_add(l, SYNTH_NORM_W, 1, H, 0, "%s.%d.final_layer_norm.weight", p, i);
        rc |= list_add(l, SYNTH_BIAS, 1, H, 0, "%s.%d.final_layer_norm.bias", p, i);
    }
    rc |= list_add(l, SYNTH_NORM_W, 1, H, 0, "model.decoder.final_layer_norm.weight");
    rc |= list_add(l, SYNTH_BIAS, 1, H, 0, "model.decoder.final_layer_norm.bias");
    if (!s->tied_head)
        rc |= list_add(l, SYNTH_EMBED, 2, V, H, "lm_head.weight");
    return rc ? -ENOMEM : 0;
}

static int build_llama(const rekv_synth_spec *s, const rekv_synth_llama *x, synth_list *l)
{
    int64_t H = s->hidden, F = s->ffn, V = s->vocab;
    int64_t hd = x->head_dim > 0 ? x->head_dim : s->hidden / s->n_heads;
    int64_t qd = s->n_heads * hd, kvd = s->n_kv_heads * hd;
    synth_init nw = x->gemma ? SYNTH_NORM_OFF : SYNTH_NORM_W;
    int rc = 0;
    rc |= list_add(l, SYNTH_EMBED, 2, V, H, "model.embed_tokens.weight");
    for (int i = 0; i < s->n_layers && rc == 0; i++) {
        const char *p = "model.layers";
        rc |= list_add(l, nw, 1, H, 0, "%s.%d.input_layernorm.weight", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, qd, H, "%s.%d.self_attn.q_proj.weight", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, kvd, H, "%s.%d.self_attn.k_proj.weight", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, kvd, H, "%s.%d.self_attn.v_proj.weight", p, i);
        if (x->qwen2) { /* after the weights: a plain Llama's tensors keep their indices */
            rc |= list_add(l, SYNTH_BIAS, 1, qd, 0, "%s.%d.self_attn.q_proj.bias", p, i);
            rc |= list_add(l, SYNTH_BIAS, 1, kvd, 0, "%s.%d.self_attn.k_proj.bias", p, i);
            rc |= list_add(l, SYNTH_BIAS, 1, kvd, 0, "%s.%d.self_attn.v_proj.bias", p, i);
        }
        rc |= list_add(l, SYNTH_LINEAR, 2, H, qd, "%s.%d.self_attn.o_proj.weight", p, i);
        rc |= list_add(l, nw, 1, H, 0, "%s.%d.post_attention_layernorm.weight", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, F, H, "%s.%d.mlp.gate_proj.weight", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, F, H, "%s.%d.mlp.up_proj.weight", p, i);
        rc |= list_add(l, SYNTH_LINEAR, 2, H, F, "%s.%d.mlp.down_proj.weight", p, i);
        if (x->gemma == 2) { /* Gemma-2's other two: its post_attention_layernorm is the
                                attention's output norm, pre_feedforward the FFN's input norm */
            rc |= list_add(l, nw, 1, H, 0, "%s.%d.pre_feedforward_layernorm.weight", p, i);
            rc |= list_add(l, nw, 1, H, 0, "%s.%d.post_feedforward_layernorm.weight", p, i);
        }
    }
    rc |= list_add(l, nw, 1, H, 0, "model.norm.weight");
    if (!s->tied_head)
        rc |= list_add(l, SYNTH_EMBED, 2, V, H, "lm_head.weight");
    return rc ? -ENOMEM : 0;
}

/* Fills out[0..n) with elements [first, first + n) of generated tensor index ti, of t's init and
 * width. */
static void synth_fill_one(const rekv_synth_spec *s, const synth_tensor *t, uint64_t ti,
                           uint64_t first, float *out, size_t n)
{
    uint64_t key = synth_tensor_key(s->seed, ti);
    float amp;
    switch (t->init) {
    case SYNTH_LINEAR:
        amp = SYNTH_GAIN / sqrtf((float)t->shape[1]);
        break;
    case SYNTH_NORM_W:
    case SYNTH_NORM_OFF:
        amp = 0.1f;
        break;
    case SYNTH_BIAS:
        amp = 0.02f;
        break;
    case SYNTH_EMBED:
    default: {
        float std = 2.0f / sqrtf((float)s->hidden);
        amp = std < 0.02f ? 0.02f : std > 1.0f ? 1.0f : std;
        break;
    }
    }
    const float u16 = 1.0f / 32768.0f;
    for (size_t i = 0; i < n; i++) {
        uint64_t h = splitmix64(key + (first + i) * 0x9e3779b97f4a7c15ull);
        float v;
        if (t->init == SYNTH_EMBED) {
            /* the sum of four uniforms in [-1, 1) has std 2/sqrt(3): close enough to normal */
            float sum = 0;
            for (int k = 0; k < 4; k++)
                sum += (float)((int32_t)((h >> (16 * k)) & 0xffffu) - 32768) * u16;
            v = sum * 0.8660254f * amp;
        } else {
            float u = (float)((int64_t)(h >> 40) - (1 << 23)) * (1.0f / (float)(1 << 23));
            v = u * amp;
            if (t->init == SYNTH_NORM_W)
                v += 1.0f;
        }
        out[i] = v;
    }
}

/* Fills out[0..n) with elements [first, first + n) of t, part by part. */
static void synth_fill(const rekv_synth_spec *s, const synth_tensor *t, uint64_t first, float *out,
                       size_t n)
{
    uint64_t cols = (uint64_t)(t->ndim == 2 ? t->shape[1] : 1), off = 0;
    for (int p = 0; p < t->nparts && n > 0; p++) {
        uint64_t len = (uint64_t)t->rows[p] * cols;
        if (first < off + len) {
            size_t k = first + n <= off + len ? n : (size_t)(off + len - first);
            synth_fill_one(s, t, t->ti[p], first - off, out, k);
            out += k, first += k, n -= k;
        }
        off += len;
    }
}

static int spec_check(const rekv_synth_spec *s, const rekv_synth_llama *x, rekv_synth_spec *norm,
                      const char *outdir, rekv_err *err)
{
    *norm = *s;
    if (s->arch != REKV_ARCH_OPT && s->arch != REKV_ARCH_LLAMA)
        return rekv_errf(err, -EINVAL, "%s: synth: unknown architecture %d", outdir, (int)s->arch);
    if (s->n_layers < 1 || s->hidden < 1 || s->n_heads < 1 || s->ffn < 1 || s->max_pos < 1)
        return rekv_errf(err, -EINVAL,
                         "%s: synth: layers, hidden, heads, ffn and max_pos must all be positive",
                         outdir);
    if (s->vocab < 3)
        return rekv_errf(err, -EINVAL, "%s: synth: vocab %d is below 3 (the special tokens)",
                         outdir, s->vocab);
    if (s->hidden % s->n_heads != 0)
        return rekv_errf(err, -EINVAL, "%s: synth: hidden %d is not a multiple of heads %d", outdir,
                         s->hidden, s->n_heads);
    if (s->n_kv_heads == 0)
        norm->n_kv_heads = s->n_heads;
    if (norm->n_kv_heads < 1 || s->n_heads % norm->n_kv_heads != 0)
        return rekv_errf(err, -EINVAL, "%s: synth: heads %d is not a multiple of kv-heads %d",
                         outdir, s->n_heads, norm->n_kv_heads);
    if (s->arch == REKV_ARCH_OPT && norm->n_kv_heads != s->n_heads)
        return rekv_errf(err, -EINVAL,
                         "%s: synth: OPT has no grouped-query attention (kv-heads "
                         "must equal heads)",
                         outdir);
    if (x->phi3 + x->qwen2 + (x->gemma > 0) > 1)
        return rekv_errf(err, -EINVAL, "%s: synth: --phi3, --qwen2 and --gemma are three families",
                         outdir);
    if (x->gemma == 1 && x->sliding_window != 0)
        return rekv_errf(err, -EINVAL, "%s: synth: Gemma has no window (Gemma-2 has)", outdir);
    if (x->head_dim != 0 && (x->head_dim < 2 || x->head_dim % 2 != 0 || x->head_dim > 512))
        return rekv_errf(err, -EINVAL, "%s: synth: head_dim %d must be even, from 2 to 512", outdir,
                         x->head_dim);
    if (x->rope_scaling.type == REKV_ROPE_SCALING_LONGROPE && !x->phi3)
        return rekv_errf(err, -EINVAL, "%s: synth: longrope is written for --phi3 models", outdir);
    if (s->arch == REKV_ARCH_OPT &&
        (x->rope_scaling.type != REKV_ROPE_SCALING_NONE || x->qwen2 || x->phi3 || x->gemma ||
         x->head_dim || x->rope_theta != 0 || x->sliding_window != 0))
        return rekv_errf(err, -EINVAL,
                         "%s: synth: OPT has no RoPE (rope, family and window options are Llama's)",
                         outdir);
    if (s->arch == REKV_ARCH_LLAMA) { /* the checks the loader will make, made before writing */
        rekv_model_config c = {.head_dim = x->head_dim > 0 ? x->head_dim : s->hidden / s->n_heads,
                               .rope_theta = x->rope_theta > 0 ? x->rope_theta : 10000.0f,
                               .rope_scaling = x->rope_scaling};
        /* HF's dynamic reads max_position_embeddings; yarn defaults to it */
        if (x->rope_scaling.type == REKV_ROPE_SCALING_DYNAMIC ||
            (x->rope_scaling.type == REKV_ROPE_SCALING_YARN &&
             x->rope_scaling.original_max_pos == 0))
            c.rope_scaling.original_max_pos = s->max_pos;
        rekv_rope_freqs f;
        rekv_err e2 = {0};
        int rc = rekv_rope_freqs_init(&f, &c, &e2);
        if (rc)
            return rekv_errf(err, rc, "%s: synth: %s", outdir, e2.msg);
        if (x->rope_scaling.type == REKV_ROPE_SCALING_FACTORS)
            return rekv_errf(err, -EINVAL, "%s: synth: config.json has no per-pair rope factors",
                             outdir);
    }
    if (s->dtype != REKV_DTYPE_F32 && s->dtype != REKV_DTYPE_F16 && s->dtype != REKV_DTYPE_BF16)
        return rekv_errf(err, -EINVAL, "%s: synth: unknown dtype %d", outdir, (int)s->dtype);
    /* tensor dims are products of ints: keep every one within int range */
    int64_t m = (int64_t)s->hidden * s->ffn;
    if ((int64_t)s->vocab * s->hidden > m)
        m = (int64_t)s->vocab * s->hidden;
    if ((int64_t)(s->max_pos + 2LL) * s->hidden > m)
        m = (int64_t)(s->max_pos + 2LL) * s->hidden;
    if (m > ((int64_t)1 << 40) || s->max_pos > INT32_MAX - 2)
        return rekv_errf(err, -EINVAL, "%s: synth: tensor sizes are implausibly large", outdir);
    return 0;
}

/* LongRoPE's factors for a synthetic Phi-3 unless given (factor == 0 means not): short ones a
 * little above 1, long ones rising to factor = max_pos / original on the low frequencies, the
 * shape of Phi-3's published lists; factor set as HF computes it. */
static void longrope_factors(rekv_rope_scaling *r, int half, int max_pos)
{
    if (r->original_max_pos > 0)
        r->factor = (double)max_pos / r->original_max_pos;
    if (r->freq_factors[0] > 0)
        return;
    double top = r->factor > 1 ? r->factor : 1;
    for (int j = 0; j < half; j++) {
        double x = half > 1 ? (double)j / (half - 1) : 0;
        r->freq_factors[j] = (float)(1.0 + 0.05 * x);
        r->long_factors[j] = (float)(1.0 + (top - 1.0) * x * x);
    }
}

static const char *torch_dtype_name(rekv_dtype d)
{
    return d == REKV_DTYPE_F32 ? "float32" : d == REKV_DTYPE_F16 ? "float16" : "bfloat16";
}

/* Gemma's and Gemma-2's fields (HF's GemmaConfig, Gemma2Config); the head_dim is the Llama's. */
static int gemma_extras(const rekv_synth_llama *x, json_t *c)
{
    int two = x->gemma == 2, rc = 0;
    json_int_t hidden = json_integer_value(json_object_get(c, "hidden_size"));
    json_int_t heads = json_integer_value(json_object_get(c, "num_attention_heads"));
    rc |= json_object_set_new(c, "model_type", json_string(two ? "gemma2" : "gemma"));
    rc |= json_object_set_new(c, "architectures",
                              json_pack("[s]", two ? "Gemma2ForCausalLM" : "GemmaForCausalLM"));
    rc |= json_object_set_new(c, "hidden_act", json_string("gelu_pytorch_tanh"));
    rc |= json_object_set_new(c, "hidden_activation", json_string("gelu_pytorch_tanh"));
    rc |= json_object_del(c, "mlp_bias"); /* GemmaConfig has none */
    if (!two)
        return rc;
    rc |= json_object_set_new(c, "query_pre_attn_scalar", json_integer(hidden / heads));
    rc |= json_object_set_new(c, "attn_logit_softcapping", json_real(50.0));
    rc |= json_object_set_new(c, "final_logit_softcapping", json_real(30.0));
    rc |= json_object_set_new(c, "sliding_window",
                              json_integer(x->sliding_window > 0 ? x->sliding_window : 4096));
    rc |= json_object_set_new(c, "cache_implementation", json_string("hybrid"));
    return rc;
}

/* The rope and Qwen2 fields of a Llama's config.json, as HF writes them (rope_scaling's fields
 * by type: those HF's _compute_*_parameters read). */
static int llama_extras(const rekv_synth_llama *x, int half, json_t *c)
{
    const rekv_rope_scaling *r = &x->rope_scaling;
    int rc = 0;
    if (x->rope_theta > 0)
        rc |= json_object_set_new(c, "rope_theta", json_real(x->rope_theta));
    if (x->gemma) {
        rc |= gemma_extras(x, c);
    } else if (x->qwen2) {
        rc |= json_object_set_new(c, "model_type", json_string("qwen2"));
        rc |= json_object_set_new(c, "architectures", json_pack("[s]", "Qwen2ForCausalLM"));
        rc |= json_object_del(c, "attention_bias"); /* Qwen2's biases come with the type */
        if (x->sliding_window > 0) {                /* every layer windowed */
            rc |= json_object_set_new(c, "use_sliding_window", json_true());
            rc |= json_object_set_new(c, "max_window_layers", json_integer(0));
        }
    } else if (x->phi3) {
        rc |= json_object_set_new(c, "model_type", json_string("phi3"));
        rc |= json_object_set_new(c, "architectures", json_pack("[s]", "Phi3ForCausalLM"));
        rc |= json_object_del(c, "attention_bias"); /* Phi3Config has neither */
        rc |= json_object_del(c, "mlp_bias");
    } else if (x->sliding_window > 0) { /* HF's Llama has no window; Mistral's is always on */
        rc |= json_object_set_new(c, "model_type", json_string("mistral"));
        rc |= json_object_set_new(c, "architectures", json_pack("[s]", "MistralForCausalLM"));
    }
    if (x->sliding_window > 0 && !x->gemma)
        rc |= json_object_set_new(c, "sliding_window", json_integer(x->sliding_window));
    if (r->type == REKV_ROPE_SCALING_LONGROPE) { /* as Phi-3's config.json */
        json_t *sf = json_array(), *lf = json_array();
        for (int j = 0; j < half; j++) {
            rc |= json_array_append_new(sf, json_real(r->freq_factors[j]));
            rc |= json_array_append_new(lf, json_real(r->long_factors[j]));
        }
        rc |= json_object_set_new(c, "original_max_position_embeddings",
                                  json_integer(r->original_max_pos));
        rc |= json_object_set_new(
            c, "rope_scaling",
            json_pack("{s:s,s:o,s:o}", "type", "longrope", "short_factor", sf, "long_factor", lf));
        return rc;
    }
    if (r->type == REKV_ROPE_SCALING_NONE)
        return rc;
    json_t *o =
        json_pack("{s:s,s:f}", "rope_type", rekv_rope_scaling_name(r->type), "factor", r->factor);
    if (o == NULL)
        return -1;
    if (r->type == REKV_ROPE_SCALING_LLAMA3) {
        rc |= json_object_set_new(o, "low_freq_factor", json_real(r->low_freq_factor));
        rc |= json_object_set_new(o, "high_freq_factor", json_real(r->high_freq_factor));
    }
    if ((r->type == REKV_ROPE_SCALING_LLAMA3 || r->type == REKV_ROPE_SCALING_YARN) &&
        r->original_max_pos > 0)
        rc |= json_object_set_new(o, "original_max_position_embeddings",
                                  json_integer(r->original_max_pos));
    if (r->type == REKV_ROPE_SCALING_YARN) {
        rc |= json_object_set_new(o, "beta_fast", json_real(r->beta_fast));
        rc |= json_object_set_new(o, "beta_slow", json_real(r->beta_slow));
        rc |= json_object_set_new(o, "truncate", json_boolean(r->truncate));
        if (r->attention_factor > 0)
            rc |= json_object_set_new(o, "attention_factor", json_real(r->attention_factor));
        if (r->mscale > 0)
            rc |= json_object_set_new(o, "mscale", json_real(r->mscale));
        if (r->mscale_all_dim > 0)
            rc |= json_object_set_new(o, "mscale_all_dim", json_real(r->mscale_all_dim));
    }
    rc |= json_object_set_new(c, "rope_scaling", o);
    return rc;
}

static int write_config(const rekv_synth_spec *s, const rekv_synth_llama *x, const char *path,
                        rekv_err *err)
{
    json_t *c;
    int hd = x->head_dim > 0 ? x->head_dim : s->hidden / s->n_heads;
    if (s->arch == REKV_ARCH_OPT) {
        c = json_pack(
            "{s:[s],s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:b,s:i,s:s,s:b,s:b,s:i,s:i,s:i,"
            "s:f,s:f,s:f,s:f,s:f,s:b,s:b,s:s}",
            "architectures", "OPTForCausalLM", "model_type", "opt", "vocab_size", s->vocab,
            "hidden_size", s->hidden, "num_hidden_layers", s->n_layers, "ffn_dim", s->ffn,
            "num_attention_heads", s->n_heads, "max_position_embeddings", s->max_pos,
            "do_layer_norm_before", 1, "word_embed_proj_dim", s->hidden, "activation_function",
            "relu", "enable_bias", 1, "layer_norm_elementwise_affine", 1, "bos_token_id", 2,
            "eos_token_id", 2, "pad_token_id", 1, "dropout", 0.0, "attention_dropout", 0.0,
            "activation_dropout", 0.0, "layerdrop", 0.0, "init_std", 0.02, "tie_word_embeddings",
            s->tied_head ? 1 : 0, "use_cache", 1, "torch_dtype", torch_dtype_name(s->dtype));
    } else {
        c = json_pack("{s:[s],s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:f,s:f,s:s,s:b,s:b,s:b,s:i,"
                      "s:i,s:b,s:s}",
                      "architectures", "LlamaForCausalLM", "model_type", "llama", "vocab_size",
                      s->vocab, "hidden_size", s->hidden, "intermediate_size", s->ffn,
                      "num_hidden_layers", s->n_layers, "num_attention_heads", s->n_heads,
                      "num_key_value_heads", s->n_kv_heads, "head_dim", hd,
                      "max_position_embeddings", s->max_pos, "rms_norm_eps", 1e-5, "rope_theta",
                      10000.0, "hidden_act", "silu", "tie_word_embeddings", s->tied_head ? 1 : 0,
                      "attention_bias", 0, "mlp_bias", 0, "bos_token_id", 1, "eos_token_id", 2,
                      "use_cache", 1, "torch_dtype", torch_dtype_name(s->dtype));
    }
    if (c == NULL || (s->arch == REKV_ARCH_LLAMA && llama_extras(x, hd / 2, c) != 0)) {
        json_decref(c);
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    }
    char *tmp = NULL;
    int rc = 0;
    if (asprintf(&tmp, "%s.tmp", path) < 0) {
        json_decref(c);
        return rekv_errf(err, -ENOMEM, "%s: out of memory", path);
    }
    if (json_dump_file(c, tmp, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(15)) != 0)
        rc = rekv_errf(err, -EIO, "%s: cannot write", tmp);
    else if (rename(tmp, path) != 0)
        rc = rekv_errf(err, -errno, "%s: cannot rename into place: %s", path, strerror(errno));
    if (rc < 0)
        remove(tmp);
    free(tmp);
    json_decref(c);
    return rc;
}

int rekv_synth_write(const rekv_synth_spec *spec, const char *outdir, rekv_err *err)
{
    return rekv_synth_write_progress(spec, outdir, NULL, NULL, err);
}

int rekv_synth_write_progress(const rekv_synth_spec *spec, const char *outdir,
                              rekv_progress_fn progress, void *arg, rekv_err *err)
{
    return rekv_synth_write_llama(spec, NULL, outdir, progress, arg, err);
}

int rekv_synth_write_llama(const rekv_synth_spec *spec, const rekv_synth_llama *llama,
                           const char *outdir, rekv_progress_fn progress, void *arg, rekv_err *err)
{
    static const rekv_synth_llama plain;
    rekv_synth_llama xl = llama ? *llama : plain;
    const rekv_synth_llama *x = &xl;
    if (xl.rope_scaling.type == REKV_ROPE_SCALING_LONGROPE && spec->n_heads > 0)
        longrope_factors(&xl.rope_scaling,
                         (xl.head_dim > 0 ? xl.head_dim : spec->hidden / spec->n_heads) / 2,
                         spec->max_pos);
    rekv_synth_spec s;
    int rc = spec_check(spec, x, &s, outdir, err);
    if (rc < 0)
        return rc;
    if (mkdir(outdir, 0755) != 0 && errno != EEXIST)
        return rekv_errf(err, -errno, "%s: cannot create directory: %s", outdir, strerror(errno));

    synth_list l = {0};
    char *cfg_path = NULL, *st_path = NULL;
    float *f32 = NULL;
    void *conv = NULL;
    rekv_st_writer *w = NULL;
    if (asprintf(&cfg_path, "%s/config.json", outdir) < 0) {
        cfg_path = NULL;
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", outdir);
        goto out;
    }
    if (asprintf(&st_path, "%s/model.safetensors", outdir) < 0) {
        st_path = NULL;
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", outdir);
        goto out;
    }
    rc = s.arch == REKV_ARCH_OPT ? build_opt(&s, &l) : build_llama(&s, x, &l);
    if (rc == 0 && x->phi3)
        fuse_phi3(&l);
    f32 = malloc(SYNTH_CHUNK_ELEMS * sizeof(float));
    conv = malloc(SYNTH_CHUNK_ELEMS * rekv_dtype_size(s.dtype));
    if (rc < 0 || f32 == NULL || conv == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", outdir);
        goto out;
    }
    rc = rekv_st_writer_open(st_path, &w, err);
    if (rc < 0)
        goto out;
    for (size_t i = 0; i < l.n; i++) {
        rc = rekv_st_writer_declare(w, l.t[i].name, s.dtype, l.t[i].ndim, l.t[i].shape, err);
        if (rc < 0)
            goto out;
    }
    uint64_t total = 0, written = 0;
    for (size_t i = 0; i < l.n; i++)
        total += (uint64_t)l.t[i].shape[0] * (uint64_t)(l.t[i].ndim == 2 ? l.t[i].shape[1] : 1) *
                 rekv_dtype_size(s.dtype);
    for (size_t i = 0; i < l.n; i++) {
        const synth_tensor *t = &l.t[i];
        uint64_t numel = (uint64_t)t->shape[0] * (uint64_t)(t->ndim == 2 ? t->shape[1] : 1);
        for (uint64_t e = 0; e < numel; e += SYNTH_CHUNK_ELEMS) {
            size_t n = numel - e < SYNTH_CHUNK_ELEMS ? (size_t)(numel - e) : SYNTH_CHUNK_ELEMS;
            synth_fill(&s, t, e, f32, n);
            rekv_from_f32(conv, f32, s.dtype, n);
            rc = rekv_st_writer_write(w, conv, n * rekv_dtype_size(s.dtype), err);
            if (rc < 0)
                goto out;
            written += n * rekv_dtype_size(s.dtype);
            if (progress)
                progress(arg, written, total);
        }
    }
    rc = rekv_st_writer_close(w, err);
    w = NULL;
    if (rc < 0)
        goto out;
    /* config.json last: a directory with a config is a complete model */
    rc = write_config(&s, x, cfg_path, err);
out:
    if (w != NULL)
        rekv_st_writer_close(w, NULL); /* discards the partial file */
    free(conv);
    free(f32);
    free(l.t);
    free(st_path);
    free(cfg_path);
    return rc;
}
