/* config.c — HuggingFace config.json → rekv_model_config, for the OPT and Llama families (Llama,
 * Mistral, Qwen2, Phi-3: Phi-3's fused qkv_proj and gate_up_proj are split by model.c; Gemma and
 * Gemma-2), and generation_config.json's end ids.
 *
 * Every field the forward pass depends on is read and checked; a missing required field, a wrong
 * type or an unsupported feature (an unknown rope_scaling type or activation) is an error naming
 * the file and the field, never a silent default. */
#include "loader/loader.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

/* Reads an integer field; missing → def (or an error when def < 0 means required). */
static int get_int(json_t *root, const char *path, const char *key, long long def, long long lo,
                   long long hi, int *out, rekv_err *err)
{
    json_t *v = json_object_get(root, key);
    long long x;
    if (v == NULL || json_is_null(v)) {
        if (def == LLONG_MIN)
            return rekv_errf(err, -EINVAL, "%s: required field \"%s\" is missing", path, key);
        x = def;
    } else if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_array(v) && json_array_size(v) > 0 &&
               json_is_integer(json_array_get(v, 0))) {
        x = json_integer_value(json_array_get(v, 0)); /* eos_token_id may be a list */
    } else {
        return rekv_errf(err, -EINVAL, "%s: field \"%s\" must be an integer", path, key);
    }
    if (x < lo || x > hi)
        return rekv_errf(err, -EINVAL, "%s: field \"%s\" = %lld is out of range [%lld, %lld]", path,
                         key, x, lo, hi);
    *out = (int)x;
    return 0;
}

static int get_float(json_t *root, const char *path, const char *key, double def, float *out,
                     rekv_err *err)
{
    json_t *v = json_object_get(root, key);
    double x;
    if (v == NULL || json_is_null(v))
        x = def;
    else if (json_is_number(v))
        x = json_number_value(v);
    else
        return rekv_errf(err, -EINVAL, "%s: field \"%s\" must be a number", path, key);
    if (!isfinite(x) || x <= 0)
        return rekv_errf(err, -EINVAL, "%s: field \"%s\" = %g must be positive", path, key, x);
    *out = (float)x;
    return 0;
}

static int get_bool(json_t *root, const char *path, const char *key, int def, int *out,
                    rekv_err *err)
{
    json_t *v = json_object_get(root, key);
    if (v == NULL || json_is_null(v))
        *out = def;
    else if (json_is_boolean(v))
        *out = json_is_true(v);
    else
        return rekv_errf(err, -EINVAL, "%s: field \"%s\" must be true or false", path, key);
    return 0;
}

static const char *get_str(json_t *root, const char *key)
{
    json_t *v = json_object_get(root, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

#define BIG (1 << 30)

static int parse_opt(json_t *root, const char *path, rekv_model_config *c, rekv_err *err)
{
    int rc;
    c->arch = REKV_ARCH_OPT;
    c->rope = REKV_ROPE_NONE;
    if ((rc = get_int(root, path, "hidden_size", LLONG_MIN, 1, BIG, &c->hidden, err)) ||
        (rc = get_int(root, path, "num_hidden_layers", LLONG_MIN, 1, 100000, &c->n_layers, err)) ||
        (rc = get_int(root, path, "ffn_dim", LLONG_MIN, 1, BIG, &c->ffn, err)) ||
        (rc = get_int(root, path, "num_attention_heads", LLONG_MIN, 1, 100000, &c->n_heads, err)) ||
        (rc = get_int(root, path, "vocab_size", LLONG_MIN, 1, BIG, &c->vocab, err)) ||
        (rc =
             get_int(root, path, "max_position_embeddings", LLONG_MIN, 1, BIG, &c->max_pos, err)) ||
        (rc = get_int(root, path, "word_embed_proj_dim", c->hidden, 1, BIG, &c->embed_dim, err)) ||
        (rc = get_bool(root, path, "do_layer_norm_before", 1, &c->pre_norm, err)) ||
        (rc = get_bool(root, path, "enable_bias", 1, &c->qkv_bias, err)) ||
        (rc = get_bool(root, path, "tie_word_embeddings", 1, &c->tied_head, err)))
        return rc;
    int affine, remove_final;
    if ((rc = get_bool(root, path, "layer_norm_elementwise_affine", 1, &affine, err)) ||
        (rc = get_bool(root, path, "_remove_final_layer_norm", 0, &remove_final, err)))
        return rc;
    if (!affine)
        return rekv_errf(err, -ENOTSUP, "%s: layer_norm_elementwise_affine=false is not supported",
                         path);
    if (c->hidden % c->n_heads != 0)
        return rekv_errf(err, -EINVAL,
                         "%s: hidden_size %d is not a multiple of num_attention_heads %d", path,
                         c->hidden, c->n_heads);
    /* HF builds the final LayerNorm only for pre-norm models (OPT-350m has none). */
    c->final_norm = c->pre_norm && !remove_final;
    c->n_kv_heads = c->n_heads;
    c->head_dim = c->hidden / c->n_heads;
    if (c->head_dim > 512)
        return rekv_errf(err, -ENOTSUP, "%s: head dimension %d is above the supported 512", path,
                         c->head_dim);
    c->o_bias = c->ffn_bias = c->qkv_bias;
    c->norm_bias = 1;
    c->norm_eps = 1e-5f;
    c->rope_theta = 0;
    const char *act = get_str(root, "activation_function");
    if (act == NULL || strcmp(act, "relu") == 0)
        c->act = REKV_ACT_RELU;
    else if (strcmp(act, "gelu") == 0)
        c->act = REKV_ACT_GELU;
    else
        return rekv_errf(err, -ENOTSUP,
                         "%s: activation_function \"%s\" is not supported (relu, gelu)", path, act);
    return 0;
}

/* A number of rope_scaling; absent or null → def (NAN: the field is required). */
static int rope_num(json_t *rs, const char *path, const char *key, double def, double *out,
                    rekv_err *err)
{
    json_t *v = json_object_get(rs, key);
    if (v == NULL || json_is_null(v)) {
        if (isnan(def))
            return rekv_errf(err, -EINVAL, "%s: required field \"rope_scaling.%s\" is missing",
                             path, key);
        *out = def;
        return 0;
    }
    if (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < 0)
        return rekv_errf(err, -EINVAL,
                         "%s: field \"rope_scaling.%s\" must be a non-negative number", path, key);
    *out = json_number_value(v);
    return 0;
}

/* rope_scaling's short_factor or long_factor: one positive number per pair of head_dim. */
static int rope_factors(json_t *rs, const char *path, const char *key, int half, float *out,
                        rekv_err *err)
{
    json_t *v = json_object_get(rs, key);
    if (v == NULL || json_is_null(v))
        return rekv_errf(err, -EINVAL, "%s: required field \"rope_scaling.%s\" is missing", path,
                         key);
    if (!json_is_array(v) || json_array_size(v) != (size_t)half)
        return rekv_errf(
            err, -EINVAL,
            "%s: field \"rope_scaling.%s\" must be a list of %d numbers (head_dim / 2)", path, key,
            half);
    for (int j = 0; j < half; j++) {
        json_t *x = json_array_get(v, (size_t)j);
        if (!json_is_number(x) || !(json_number_value(x) > 0) || !isfinite(json_number_value(x)))
            return rekv_errf(err, -EINVAL,
                             "%s: field \"rope_scaling.%s\"[%d] must be a positive number", path,
                             key, j);
        out[j] = (float)json_number_value(x);
    }
    return 0;
}

/* LongRoPE (Phi-3, as HF's _compute_longrope_parameters reads it): the original length from the
 * config's top level (Phi-3 keeps it there; Phi3Config's default 4096), else rope_scaling's, else
 * max_position_embeddings; with a top-level original the factor is max_pos / original, as HF. */
static int parse_longrope(json_t *root, json_t *rs, const char *path, rekv_model_config *c,
                          rekv_err *err)
{
    rekv_rope_scaling *s = &c->rope_scaling;
    int rc, half = c->head_dim / 2, phi3 = strcmp(get_str(root, "model_type"), "phi3") == 0;
    int top = json_object_get(root, "original_max_position_embeddings") != NULL;
    double orig = c->max_pos;
    s->type = REKV_ROPE_SCALING_LONGROPE;
    if ((rc = rope_factors(rs, path, "short_factor", half, s->freq_factors, err)) ||
        (rc = rope_factors(rs, path, "long_factor", half, s->long_factors, err)) ||
        (rc = rope_num(rs, path, "attention_factor", 0, &s->attention_factor, err)) ||
        (rc = rope_num(rs, path, "original_max_position_embeddings", phi3 ? 4096 : c->max_pos,
                       &orig, err)))
        return rc;
    if (top) {
        int o;
        if ((rc = get_int(root, path, "original_max_position_embeddings", LLONG_MIN, 1, BIG, &o,
                          err)))
            return rc;
        orig = o;
    }
    if (orig < 1 || orig > BIG || orig != floor(orig))
        return rekv_errf(err, -EINVAL,
                         "%s: field \"original_max_position_embeddings\" = %g must be a positive "
                         "integer",
                         path, orig);
    s->original_max_pos = (int)orig;
    if ((rc = rope_num(rs, path, "factor", 1, &s->factor, err)))
        return rc;
    if (top || phi3)
        s->factor = (double)c->max_pos / orig;
    if (s->factor <= 0)
        return rekv_errf(err, -EINVAL, "%s: field \"rope_scaling.factor\" = %g must be positive",
                         path, s->factor);
    rekv_rope_freqs f;
    rekv_err e2 = {0};
    if ((rc = rekv_rope_freqs_init(&f, c, &e2)))
        return rekv_errf(err, rc, "%s: %s", path, e2.msg);
    return 0;
}

/* rope_scaling (or transformers 5's rope_parameters) → c->rope_scaling, checked by
 * rekv_rope_freqs_init as every config is; extends max_pos where the scaling's point is a longer
 * context than max_position_embeddings states (dynamic: factor x it; yarn: factor x the original).
 */
static int parse_rope_scaling(json_t *root, const char *path, rekv_model_config *c, rekv_err *err)
{
    rekv_rope_scaling *s = &c->rope_scaling;
    memset(s, 0, sizeof(*s));
    json_t *rs = json_object_get(root, "rope_scaling");
    if (rs == NULL || json_is_null(rs))
        rs = json_object_get(root, "rope_parameters");
    if (rs == NULL || json_is_null(rs))
        return 0;
    if (!json_is_object(rs))
        return rekv_errf(err, -EINVAL, "%s: field \"rope_scaling\" must be an object or null",
                         path);
    int rc;
    double theta = c->rope_theta, orig = 0;
    if ((rc = rope_num(rs, path, "rope_theta", theta, &theta, err))) /* rope_parameters holds it */
        return rc;
    if (!(theta > 0))
        return rekv_errf(err, -EINVAL, "%s: field \"rope_theta\" must be positive", path);
    c->rope_theta = (float)theta;
    const char *type = get_str(rs, "rope_type");
    if (type == NULL)
        type = get_str(rs, "type"); /* the older spelling */
    if (type == NULL)
        return rekv_errf(err, -EINVAL, "%s: required field \"rope_scaling.rope_type\" is missing",
                         path);
    json_t *tr = json_object_get(rs, "truncate");
    if (tr != NULL && !json_is_null(tr) && !json_is_boolean(tr))
        return rekv_errf(err, -EINVAL, "%s: field \"rope_scaling.truncate\" must be true or false",
                         path);
    s->truncate = tr == NULL || json_is_null(tr) || json_is_true(tr);
    if (strcmp(type, "default") == 0)
        return 0;
    if (strcmp(type, "longrope") == 0 || strcmp(type, "su") == 0) /* "su": Phi-3's first name */
        return parse_longrope(root, rs, path, c, err);
    if (strcmp(type, "linear") == 0)
        s->type = REKV_ROPE_SCALING_LINEAR;
    else if (strcmp(type, "dynamic") == 0)
        s->type = REKV_ROPE_SCALING_DYNAMIC;
    else if (strcmp(type, "llama3") == 0)
        s->type = REKV_ROPE_SCALING_LLAMA3;
    else if (strcmp(type, "yarn") == 0)
        s->type = REKV_ROPE_SCALING_YARN;
    else
        return rekv_errf(err, -ENOTSUP,
                         "%s: rope_scaling.rope_type \"%s\" is not supported (default, linear, "
                         "dynamic, llama3, yarn, longrope)",
                         path, type);
    int llama3 = s->type == REKV_ROPE_SCALING_LLAMA3, yarn = s->type == REKV_ROPE_SCALING_YARN;
    if ((rc = rope_num(rs, path, "factor", NAN, &s->factor, err)) ||
        (llama3 && (rc = rope_num(rs, path, "low_freq_factor", NAN, &s->low_freq_factor, err))) ||
        (llama3 && (rc = rope_num(rs, path, "high_freq_factor", NAN, &s->high_freq_factor, err))) ||
        (llama3 &&
         (rc = rope_num(rs, path, "original_max_position_embeddings", NAN, &orig, err))) ||
        (yarn &&
         (rc = rope_num(rs, path, "original_max_position_embeddings", c->max_pos, &orig, err))) ||
        /* HF reads beta_* with `or`: 0 or null takes the default */
        (yarn && (rc = rope_num(rs, path, "beta_fast", 32, &s->beta_fast, err))) ||
        (yarn && (rc = rope_num(rs, path, "beta_slow", 1, &s->beta_slow, err))) ||
        (yarn && (rc = rope_num(rs, path, "mscale", 0, &s->mscale, err))) ||
        (yarn && (rc = rope_num(rs, path, "mscale_all_dim", 0, &s->mscale_all_dim, err))) ||
        (yarn && (rc = rope_num(rs, path, "attention_factor", 0, &s->attention_factor, err))))
        return rc;
    if (s->factor <= 0)
        return rekv_errf(err, -EINVAL, "%s: field \"rope_scaling.factor\" = %g must be positive",
                         path, s->factor);
    if (yarn && s->beta_fast == 0)
        s->beta_fast = 32;
    if (yarn && s->beta_slow == 0)
        s->beta_slow = 1;
    if ((llama3 || yarn) && (orig < 1 || orig > BIG || orig != floor(orig)))
        return rekv_errf(
            err, -EINVAL,
            "%s: field \"rope_scaling.original_max_position_embeddings\" = %g must be a "
            "positive integer",
            path, orig);
    if (llama3 && !(s->high_freq_factor > s->low_freq_factor && s->low_freq_factor > 0))
        return rekv_errf(
            err, -EINVAL,
            "%s: fields \"rope_scaling.low_freq_factor\" = %g and \"high_freq_factor\" = "
            "%g must satisfy 0 < low < high",
            path, s->low_freq_factor, s->high_freq_factor);
    /* HF's dynamic NTK grows the base past max_position_embeddings (it reads no original field) */
    s->original_max_pos = s->type == REKV_ROPE_SCALING_DYNAMIC ? c->max_pos : (int)orig;
    double reach = s->type == REKV_ROPE_SCALING_DYNAMIC ? c->max_pos * s->factor
                   : yarn                               ? orig * s->factor
                                                        : 0;
    if (reach > c->max_pos)
        c->max_pos = reach > BIG ? BIG : (int)reach;
    rekv_rope_freqs f;
    rekv_err e2 = {0};
    if ((rc = rekv_rope_freqs_init(&f, c, &e2))) /* the checks every config gets */
        return rekv_errf(err, rc, "%s: %s", path, e2.msg);
    return 0;
}

/* The window of Mistral, Qwen2 and Phi-3 (every layer, or none). */
static int parse_window(json_t *root, const char *path, const char *type, rekv_model_config *c,
                        rekv_err *err)
{
    int rc, qwen2 = strcmp(type, "qwen2") == 0;
    /* Mistral and Phi-3 always window when sliding_window is set; HF's Llama never does (it has
     * no such field); Qwen2 only with use_sliding_window, and only the layers from
     * max_window_layers on: a mix of windowed and full layers is refused. A window at least as long
     * as the context never masks anything: kept as none, so that the modes that cannot honour a
     * window (infinigen, clo) stay open to such models. */
    int window = 0, full_layers = 0;
    int use_window = strcmp(type, "mistral") == 0 || strcmp(type, "phi3") == 0;
    if ((rc = get_int(root, path, "sliding_window", 0, 0, BIG, &window, err)) ||
        (qwen2 && (rc = get_bool(root, path, "use_sliding_window", 0, &use_window, err))) ||
        (qwen2 && (rc = get_int(root, path, "max_window_layers", 28, 0, BIG, &full_layers, err))))
        return rc;
    /* transformers' explicit per-layer list, where a config has one, decides which layers */
    json_t *lt = json_object_get(root, "layer_types");
    if (lt != NULL && !json_is_null(lt)) {
        size_t i, sliding = 0;
        json_t *x;
        if (!json_is_array(lt) || json_array_size(lt) != (size_t)c->n_layers)
            return rekv_errf(err, -EINVAL,
                             "%s: field \"layer_types\" must be a list of %d layer types", path,
                             c->n_layers);
        json_array_foreach(lt, i, x)
        {
            if (json_is_string(x) && strcmp(json_string_value(x), "sliding_attention") == 0)
                sliding++;
        }
        use_window = use_window && sliding > 0;
        full_layers = sliding == (size_t)c->n_layers ? 0 : c->n_layers - (int)sliding;
    } else if (use_window && full_layers >= c->n_layers) {
        use_window = 0;
    }
    c->sliding_window = use_window && window > 0 && window < c->max_pos ? window : 0;
    if (c->sliding_window && full_layers > 0)
        return rekv_errf(err, -ENOTSUP,
                         "%s: a sliding window on some layers only (%d of %d layers full, by "
                         "max_window_layers or layer_types) is not supported",
                         path, full_layers, c->n_layers);
    return 0;
}

/* The fields every Llama-like family shares (Llama, Mistral, Qwen2, Phi-3, Gemma). */
static int parse_llama(json_t *root, const char *path, const char *type, rekv_model_config *c,
                       rekv_err *err)
{
    int rc;
    int qwen2 = strcmp(type, "qwen2") == 0, gemma = strncmp(type, "gemma", 5) == 0;
    c->arch = REKV_ARCH_LLAMA;
    c->rope = REKV_ROPE_HALF;
    c->act = REKV_ACT_SILU;
    c->pre_norm = 1;
    c->final_norm = 1;
    c->norm_bias = 0;
    if ((rc = get_int(root, path, "hidden_size", LLONG_MIN, 1, BIG, &c->hidden, err)) ||
        (rc = get_int(root, path, "num_hidden_layers", LLONG_MIN, 1, 100000, &c->n_layers, err)) ||
        (rc = get_int(root, path, "intermediate_size", LLONG_MIN, 1, BIG, &c->ffn, err)) ||
        (rc = get_int(root, path, "num_attention_heads", LLONG_MIN, 1, 100000, &c->n_heads, err)) ||
        (rc = get_int(root, path, "num_key_value_heads", c->n_heads, 1, 100000, &c->n_kv_heads,
                      err)) ||
        (rc = get_int(root, path, "vocab_size", LLONG_MIN, 1, BIG, &c->vocab, err)) ||
        (rc =
             get_int(root, path, "max_position_embeddings", LLONG_MIN, 1, BIG, &c->max_pos, err)) ||
        (rc = get_float(root, path, "rms_norm_eps", 1e-6, &c->norm_eps, err)) ||
        (rc = get_float(root, path, "rope_theta", 10000.0, &c->rope_theta, err)) ||
        /* HF's GemmaConfig and Gemma2Config tie by default */
        (rc = get_bool(root, path, "tie_word_embeddings", gemma, &c->tied_head, err)) ||
        (rc = get_bool(root, path, "attention_bias", qwen2, &c->qkv_bias, err)) ||
        (rc = get_bool(root, path, "mlp_bias", 0, &c->ffn_bias, err)))
        return rc;
    if (!gemma && c->hidden % c->n_heads != 0 && json_object_get(root, "head_dim") == NULL)
        return rekv_errf(err, -EINVAL,
                         "%s: hidden_size %d is not a multiple of num_attention_heads %d", path,
                         c->hidden, c->n_heads);
    /* Gemma's config classes default head_dim to 256 whatever the width */
    if ((rc = get_int(root, path, "head_dim", gemma ? 256 : c->hidden / c->n_heads, 2, 512,
                      &c->head_dim, err)))
        return rc;
    if (c->head_dim % 2 != 0)
        return rekv_errf(err, -EINVAL, "%s: head_dim %d must be even for RoPE", path, c->head_dim);
    if (c->n_heads % c->n_kv_heads != 0)
        return rekv_errf(err, -EINVAL,
                         "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                         path, c->n_heads, c->n_kv_heads);
    /* Qwen2 has q/k/v biases but none on o_proj; Llama's attention_bias covers o_proj too. */
    c->o_bias = qwen2 ? 0 : c->qkv_bias;
    c->embed_dim = c->hidden;
    /* RoPE over part of each head (Phi, GPT-NeoX style) would need the kernels' rotation split */
    json_t *prf = json_object_get(root, "partial_rotary_factor");
    if (prf != NULL && !json_is_null(prf) && (!json_is_number(prf) || json_number_value(prf) != 1))
        return rekv_errf(err, -ENOTSUP,
                         "%s: field \"partial_rotary_factor\" other than 1 is not "
                         "supported",
                         path);
    if ((rc = parse_rope_scaling(root, path, c, err)))
        return rc;
    if (gemma) /* its activation and window are parse_gemma's */
        return 0;
    const char *act = get_str(root, "hidden_act");
    if (act != NULL && strcmp(act, "silu") != 0)
        return rekv_errf(err, -ENOTSUP, "%s: hidden_act \"%s\" is not supported (silu)", path, act);
    return parse_window(root, path, type, c, err);
}

/* A soft-capping field of Gemma-2: absent → def (HF's default), null → none (0). */
static int get_softcap(json_t *root, const char *path, const char *key, double def, float *out,
                       rekv_err *err)
{
    json_t *v = json_object_get(root, key);
    if (v != NULL && json_is_null(v)) {
        *out = 0;
        return 0;
    }
    return get_float(root, path, key, def, out, err);
}

/* Gemma and Gemma-2 (HF's GemmaConfig, Gemma2Config) past the Llama fields: GeGLU with the
 * tanh GELU (hidden_activation; absent: HF's gelu_pytorch_tanh — hidden_act is ignored, as HF
 * does), (1 + w) norms, embeddings times sqrt(hidden_size) in the model's dtype; Gemma-2 also the
 * four norms of a layer, the attention scale query_pre_attn_scalar^-0.5, soft-capped attention
 * scores and logits, and a window on the even layers (HF: is_sliding = not layer_idx % 2). */
static int parse_gemma(json_t *root, const char *path, int gemma2, rekv_model_config *c,
                       rekv_err *err)
{
    int rc;
    json_t *ha = json_object_get(root, "hidden_activation");
    const char *act = json_is_string(ha) ? json_string_value(ha) : NULL;
    if (ha != NULL && !json_is_null(ha) && act == NULL)
        return rekv_errf(err, -EINVAL, "%s: field \"hidden_activation\" must be a string", path);
    if (act != NULL && strcmp(act, "gelu_pytorch_tanh") != 0 && strcmp(act, "gelu_new") != 0)
        return rekv_errf(err, -ENOTSUP,
                         "%s: hidden_activation \"%s\" is not supported (gelu_pytorch_tanh)", path,
                         act);
    c->act = REKV_ACT_GELU_TANH;
    c->norm_add_one = 1;
    c->embed_scale = (float)sqrt((double)c->hidden);
    if (!gemma2)
        return 0;
    c->post_norms = 1;
    float qs;
    int window;
    if ((rc = get_float(root, path, "query_pre_attn_scalar", 256, &qs, err)) ||
        (rc = get_softcap(root, path, "attn_logit_softcapping", 50.0, &c->attn_softcap, err)) ||
        (rc = get_softcap(root, path, "final_logit_softcapping", 30.0, &c->final_softcap, err)) ||
        (rc = get_int(root, path, "sliding_window", 4096, 1, BIG, &window, err)))
        return rc;
    c->attn_scale = (float)(1.0 / sqrt((double)qs));
    json_t *lt = json_object_get(root, "layer_types"); /* transformers 4.5x writes it */
    if (lt != NULL && !json_is_null(lt)) {
        if (!json_is_array(lt) || json_array_size(lt) != (size_t)c->n_layers)
            return rekv_errf(err, -EINVAL,
                             "%s: field \"layer_types\" must be a list of %d layer types", path,
                             c->n_layers);
        for (int l = 0; l < c->n_layers; l++) {
            const char *t = json_string_value(json_array_get(lt, (size_t)l));
            const char *want = l % 2 == 0 ? "sliding_attention" : "full_attention";
            if (t == NULL || strcmp(t, want) != 0)
                return rekv_errf(err, -ENOTSUP,
                                 "%s: field \"layer_types\"[%d] is not \"%s\": only Gemma-2's "
                                 "alternation (sliding on the even layers) is supported",
                                 path, l, want);
        }
    }
    /* null: HF's None, no window; as for the other families, one no shorter than the context is
     * none */
    json_t *sw = json_object_get(root, "sliding_window");
    c->sliding_window = (sw != NULL && json_is_null(sw)) || window >= c->max_pos ? 0 : window;
    c->window_even_layers = c->sliding_window > 0;
    return 0;
}

/* HF's normalizer: sqrt(hidden_size) as a tensor of the model's dtype (bf16: sqrt(3072) = 55.43
 * becomes 55.5), by which rekv's fp32 embeddings are then multiplied. */
static void round_embed_scale(rekv_model_config *c)
{
    if (c->embed_scale == 0 || c->dtype == REKV_DTYPE_F32)
        return;
    uint16_t h;
    rekv_from_f32(&h, &c->embed_scale, c->dtype, 1);
    rekv_to_f32(&c->embed_scale, &h, c->dtype, 1);
}

/* Every id of eos_token_id (an integer or a list: Llama 3.x Instruct ends turns with <|eot_id|>,
 * not its first id <|end_of_text|>); c->eos_id, its first, is read already. */
static int parse_eos_ids(json_t *root, const char *path, rekv_model_config *c, rekv_err *err)
{
    json_t *v = json_object_get(root, "eos_token_id");
    c->n_eos_ids = 0;
    if (!json_is_array(v)) {
        if (c->eos_id >= 0)
            c->eos_ids[c->n_eos_ids++] = c->eos_id;
        return 0;
    }
    if (json_array_size(v) > REKV_MAX_EOS)
        return rekv_errf(err, -EINVAL, "%s: field \"eos_token_id\" lists %zu ids, more than %d",
                         path, json_array_size(v), REKV_MAX_EOS);
    size_t i;
    json_t *x;
    json_array_foreach(v, i, x)
    {
        json_int_t id = json_is_integer(x) ? json_integer_value(x) : -1;
        if (id < 0 || id >= c->vocab)
            return rekv_errf(err, -EINVAL,
                             "%s: field \"eos_token_id\"[%zu] must be an id below vocab_size %d",
                             path, i, c->vocab);
        c->eos_ids[c->n_eos_ids++] = (int)id;
    }
    return 0;
}

/* Adds id to c's EOS list unless there already; the first id becomes eos_id when there was none. */
static int add_eos_id(rekv_model_config *c, int id, const char *path, rekv_err *err)
{
    for (int i = 0; i < c->n_eos_ids; i++)
        if (c->eos_ids[i] == id)
            return 0;
    if (c->n_eos_ids == REKV_MAX_EOS)
        return rekv_errf(err, -EINVAL, "%s: field \"eos_token_id\": more than %d end ids in all",
                         path, REKV_MAX_EOS);
    c->eos_ids[c->n_eos_ids++] = id;
    if (c->eos_id < 0)
        c->eos_id = id;
    return 0;
}

/* generation_config.json beside config.json: its eos_token_id (an integer or a list) joins the
 * config's, as vLLM and HF's generate take the union — the chat models end turns there (Gemma-2-it:
 * config 1, generation_config [1, 107] with 107 <end_of_turn>; Qwen2.5-Instruct adds 151643). No
 * file, or no field, adds nothing; a bad one is an error naming it. */
static int merge_generation_config(const char *config_path, rekv_model_config *c, rekv_err *err)
{
    char gpath[4096];
    const char *slash = strrchr(config_path, '/');
    int dirlen = slash ? (int)(slash - config_path) : 1;
    snprintf(gpath, sizeof(gpath), "%.*s/generation_config.json", dirlen,
             slash ? config_path : ".");
    json_error_t jerr;
    json_t *root = json_load_file(gpath, 0, &jerr);
    if (root == NULL) {
        if (access(gpath, F_OK) != 0)
            return 0;
        return rekv_errf(err, -EINVAL, "%s: %s (line %d)", gpath, jerr.text, jerr.line);
    }
    int rc = 0;
    json_t *v = json_is_object(root) ? json_object_get(root, "eos_token_id") : NULL;
    if (!json_is_object(root)) {
        rc = rekv_errf(err, -EINVAL, "%s: not a JSON object", gpath);
    } else if (v == NULL || json_is_null(v)) {
        rc = 0;
    } else if (json_is_integer(v) || json_is_array(v)) {
        size_t n = json_is_array(v) ? json_array_size(v) : 1;
        for (size_t i = 0; i < n && rc == 0; i++) {
            json_t *x = json_is_array(v) ? json_array_get(v, i) : v;
            json_int_t id = json_is_integer(x) ? json_integer_value(x) : -1;
            if (id < 0 || id >= c->vocab)
                rc = rekv_errf(err, -EINVAL,
                               "%s: field \"eos_token_id\" must be ids below vocab_size %d",
                               gpath, c->vocab);
            else
                rc = add_eos_id(c, (int)id, gpath, err);
        }
    } else {
        rc = rekv_errf(err, -EINVAL, "%s: field \"eos_token_id\" must be an integer or a list",
                       gpath);
    }
    json_decref(root);
    return rc;
}

int rekv_config_load_hf(const char *path, rekv_model_config *c, rekv_err *err)
{
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return rekv_errf(err, errno == ENOENT ? -ENOENT : -EINVAL, "%s: %s (line %d)", path,
                         jerr.text, jerr.line);
    int rc;
    memset(c, 0, sizeof(*c));
    if (!json_is_object(root)) {
        rc = rekv_errf(err, -EINVAL, "%s: not a JSON object", path);
        goto out;
    }
    const char *type = get_str(root, "model_type");
    if (type == NULL) {
        rc = rekv_errf(err, -EINVAL, "%s: required field \"model_type\" is missing", path);
        goto out;
    }
    if (strcmp(type, "opt") == 0)
        rc = parse_opt(root, path, c, err);
    else if (strcmp(type, "llama") == 0 || strcmp(type, "mistral") == 0 ||
             strcmp(type, "qwen2") == 0 || strcmp(type, "phi3") == 0)
        rc = parse_llama(root, path, type, c, err);
    else if (strcmp(type, "gemma") == 0 || strcmp(type, "gemma2") == 0) {
        rc = parse_llama(root, path, type, c, err);
        if (rc == 0)
            rc = parse_gemma(root, path, strcmp(type, "gemma2") == 0, c, err);
    } else
        rc = rekv_errf(err, -ENOTSUP,
                       "%s: model_type \"%s\" is not supported (opt, llama, mistral, qwen2, phi3, "
                       "gemma, gemma2)",
                       path, type);
    if (rc)
        goto out;
    if ((rc = get_int(root, path, "bos_token_id", -1, -1, c->vocab - 1, &c->bos_id, err)) ||
        (rc = get_int(root, path, "eos_token_id", -1, -1, c->vocab - 1, &c->eos_id, err)) ||
        (rc = get_int(root, path, "pad_token_id", -1, -1, c->vocab - 1, &c->pad_id, err)) ||
        (rc = parse_eos_ids(root, path, c, err)) ||
        (rc = merge_generation_config(path, c, err)))
        goto out;
    /* Qwen2's tokenizer adds no BOS; OPT's and Llama's do (tokenizer_config.json may override). */
    c->add_bos = strcmp(type, "qwen2") != 0 && c->bos_id >= 0;
    c->dtype = REKV_DTYPE_F32;
    const char *td = get_str(root, "torch_dtype");
    if (td && strcmp(td, "float16") == 0)
        c->dtype = REKV_DTYPE_F16;
    else if (td && strcmp(td, "bfloat16") == 0)
        c->dtype = REKV_DTYPE_BF16;
    round_embed_scale(c);
out:
    json_decref(root);
    return rc;
}
