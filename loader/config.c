/* config.c — HuggingFace config.json → rekv_model_config, for the OPT and Llama families.
 *
 * Every field the forward pass depends on is read and checked; a missing required field, a wrong
 * type or an unsupported feature (rope scaling, an unknown activation) is an error naming the file
 * and the field, never a silent default. */
#include "loader/loader.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <string.h>

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
    } else if (json_is_array(v) && json_array_size(v) > 0 && json_is_integer(json_array_get(v, 0))) {
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
        (rc = get_int(root, path, "max_position_embeddings", LLONG_MIN, 1, BIG, &c->max_pos, err)) ||
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
        return rekv_errf(err, -EINVAL, "%s: hidden_size %d is not a multiple of num_attention_heads %d",
                         path, c->hidden, c->n_heads);
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
        return rekv_errf(err, -ENOTSUP, "%s: activation_function \"%s\" is not supported (relu, gelu)",
                         path, act);
    return 0;
}

static int parse_llama(json_t *root, const char *path, const char *type, rekv_model_config *c,
                       rekv_err *err)
{
    int rc;
    int qwen2 = strcmp(type, "qwen2") == 0;
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
        (rc = get_int(root, path, "max_position_embeddings", LLONG_MIN, 1, BIG, &c->max_pos, err)) ||
        (rc = get_float(root, path, "rms_norm_eps", 1e-6, &c->norm_eps, err)) ||
        (rc = get_float(root, path, "rope_theta", 10000.0, &c->rope_theta, err)) ||
        (rc = get_bool(root, path, "tie_word_embeddings", 0, &c->tied_head, err)) ||
        (rc = get_bool(root, path, "attention_bias", qwen2, &c->qkv_bias, err)) ||
        (rc = get_bool(root, path, "mlp_bias", 0, &c->ffn_bias, err)))
        return rc;
    if (c->hidden % c->n_heads != 0 && json_object_get(root, "head_dim") == NULL)
        return rekv_errf(err, -EINVAL, "%s: hidden_size %d is not a multiple of num_attention_heads %d",
                         path, c->hidden, c->n_heads);
    if ((rc = get_int(root, path, "head_dim", c->hidden / c->n_heads, 2, 512, &c->head_dim, err)))
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
    json_t *scaling = json_object_get(root, "rope_scaling");
    if (scaling != NULL && !json_is_null(scaling))
        return rekv_errf(err, -ENOTSUP, "%s: rope_scaling is not supported yet", path);
    const char *act = get_str(root, "hidden_act");
    if (act != NULL && strcmp(act, "silu") != 0)
        return rekv_errf(err, -ENOTSUP, "%s: hidden_act \"%s\" is not supported (silu)", path, act);
    /* Attention here is full; a sliding window only matters beyond its length, so the usable
     * context is capped at the window rather than silently computing something else. */
    int window = 0, use_window = !qwen2;
    if ((rc = get_int(root, path, "sliding_window", 0, 0, BIG, &window, err)) ||
        (qwen2 && (rc = get_bool(root, path, "use_sliding_window", 0, &use_window, err))))
        return rc;
    if (use_window && window > 0 && window < c->max_pos)
        c->max_pos = window;
    return 0;
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
             strcmp(type, "qwen2") == 0)
        rc = parse_llama(root, path, type, c, err);
    else
        rc = rekv_errf(err, -ENOTSUP,
                       "%s: model_type \"%s\" is not supported (opt, llama, mistral, qwen2)", path,
                       type);
    if (rc)
        goto out;
    if ((rc = get_int(root, path, "bos_token_id", -1, -1, c->vocab - 1, &c->bos_id, err)) ||
        (rc = get_int(root, path, "eos_token_id", -1, -1, c->vocab - 1, &c->eos_id, err)) ||
        (rc = get_int(root, path, "pad_token_id", -1, -1, c->vocab - 1, &c->pad_id, err)))
        goto out;
    /* Qwen2's tokenizer adds no BOS; OPT's and Llama's do (tokenizer_config.json may override). */
    c->add_bos = strcmp(type, "qwen2") != 0 && c->bos_id >= 0;
    c->dtype = REKV_DTYPE_F32;
    const char *td = get_str(root, "torch_dtype");
    if (td && strcmp(td, "float16") == 0)
        c->dtype = REKV_DTYPE_F16;
    else if (td && strcmp(td, "bfloat16") == 0)
        c->dtype = REKV_DTYPE_BF16;
out:
    json_decref(root);
    return rc;
}
