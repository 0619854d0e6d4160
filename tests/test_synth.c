/* test_synth.c — synthetic models: names, shapes, config.json, determinism, value ranges, bounded
 * memory while streaming, and the rekv-loader synth/inspect commands. */
#define _GNU_SOURCE
#include "loader/loader.h"
#include "tests/testutil.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

static char *g_dir;

static void setup(void)
{
    g_dir = tu_tmpdir();
}
static void teardown(void)
{
    tu_rmrf(g_dir);
    free(g_dir);
    g_dir = NULL;
}

static const char *sub(const char *name)
{
    static char buf[4][4096];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 4096, "%s/%s", g_dir, name);
    return p;
}

static void synth_ok(const rekv_synth_spec *s, const char *dir)
{
    rekv_err err = {0};
    int rc = rekv_synth_write(s, dir, &err);
    ck_assert_msg(rc == 0, "synth %s: %s", dir, err.msg);
}

static rekv_synth_spec opt_spec(void)
{
    rekv_synth_spec s = {.arch = REKV_ARCH_OPT,
                         .n_layers = 3,
                         .hidden = 64,
                         .n_heads = 4,
                         .n_kv_heads = 4,
                         .ffn = 256,
                         .vocab = 300,
                         .max_pos = 128,
                         .dtype = REKV_DTYPE_F16,
                         .seed = 42,
                         .tied_head = 1};
    return s;
}

static rekv_synth_spec llama_spec(void)
{
    rekv_synth_spec s = {.arch = REKV_ARCH_LLAMA,
                         .n_layers = 3,
                         .hidden = 64,
                         .n_heads = 8,
                         .n_kv_heads = 2,
                         .ffn = 176,
                         .vocab = 300,
                         .max_pos = 128,
                         .dtype = REKV_DTYPE_BF16,
                         .seed = 7,
                         .tied_head = 0};
    return s;
}

/* ---------------------------------------------------------------- expected tensors */

typedef struct want_t {
    char name[128];
    int64_t d0, d1; /* d1 == 0: 1-d */
} want_t;

static int add(want_t *w, int n, int64_t d0, int64_t d1, const char *name)
{
    snprintf(w[n].name, sizeof(w[n].name), "%s", name);
    w[n].d0 = d0;
    w[n].d1 = d1;
    return n + 1;
}

/* The HF tensor list of a spec, built independently of synth.c. */
static int expected(const rekv_synth_spec *s, want_t *w)
{
    int n = 0;
    char nm[128];
    int64_t H = s->hidden, F = s->ffn, V = s->vocab;
    if (s->arch == REKV_ARCH_OPT) {
        n = add(w, n, V, H, "model.decoder.embed_tokens.weight");
        n = add(w, n, s->max_pos + 2, H, "model.decoder.embed_positions.weight");
        n = add(w, n, H, 0, "model.decoder.final_layer_norm.weight");
        n = add(w, n, H, 0, "model.decoder.final_layer_norm.bias");
        for (int i = 0; i < s->n_layers; i++) {
            const char *proj[] = {"q_proj", "k_proj", "v_proj", "out_proj"};
            for (int j = 0; j < 4; j++) {
                snprintf(nm, sizeof(nm), "model.decoder.layers.%d.self_attn.%s.weight", i, proj[j]);
                n = add(w, n, H, H, nm);
                snprintf(nm, sizeof(nm), "model.decoder.layers.%d.self_attn.%s.bias", i, proj[j]);
                n = add(w, n, H, 0, nm);
            }
            const char *norms[] = {"self_attn_layer_norm", "final_layer_norm"};
            for (int j = 0; j < 2; j++) {
                snprintf(nm, sizeof(nm), "model.decoder.layers.%d.%s.weight", i, norms[j]);
                n = add(w, n, H, 0, nm);
                snprintf(nm, sizeof(nm), "model.decoder.layers.%d.%s.bias", i, norms[j]);
                n = add(w, n, H, 0, nm);
            }
            snprintf(nm, sizeof(nm), "model.decoder.layers.%d.fc1.weight", i);
            n = add(w, n, F, H, nm);
            snprintf(nm, sizeof(nm), "model.decoder.layers.%d.fc1.bias", i);
            n = add(w, n, F, 0, nm);
            snprintf(nm, sizeof(nm), "model.decoder.layers.%d.fc2.weight", i);
            n = add(w, n, H, F, nm);
            snprintf(nm, sizeof(nm), "model.decoder.layers.%d.fc2.bias", i);
            n = add(w, n, H, 0, nm);
        }
    } else {
        int64_t hd = H / s->n_heads, q = s->n_heads * hd, kv = s->n_kv_heads * hd;
        n = add(w, n, V, H, "model.embed_tokens.weight");
        n = add(w, n, H, 0, "model.norm.weight");
        for (int i = 0; i < s->n_layers; i++) {
#define L(suffix, a, b)                                                                            \
    do {                                                                                           \
        snprintf(nm, sizeof(nm), "model.layers.%d." suffix, i);                                    \
        n = add(w, n, a, b, nm);                                                                   \
    } while (0)
            L("input_layernorm.weight", H, 0);
            L("post_attention_layernorm.weight", H, 0);
            L("self_attn.q_proj.weight", q, H);
            L("self_attn.k_proj.weight", kv, H);
            L("self_attn.v_proj.weight", kv, H);
            L("self_attn.o_proj.weight", H, q);
            L("mlp.gate_proj.weight", F, H);
            L("mlp.up_proj.weight", F, H);
            L("mlp.down_proj.weight", H, F);
#undef L
        }
    }
    if (!s->tied_head)
        n = add(w, n, V, H, "lm_head.weight");
    return n;
}

static int64_t expected_params(const rekv_synth_spec *s)
{
    want_t *w = calloc(4096, sizeof(*w));
    int n = expected(s, w);
    int64_t p = 0;
    for (int i = 0; i < n; i++)
        p += w[i].d0 * (w[i].d1 ? w[i].d1 : 1);
    free(w);
    return p;
}

static void check_model(const rekv_synth_spec *s, const char *dir)
{
    rekv_err err = {0};
    rekv_safetensors *st;
    ck_assert_msg(rekv_safetensors_open(dir, &st, &err) == 0, "%s", err.msg);
    want_t *w = calloc(4096, sizeof(*w));
    int n = expected(s, w);
    ck_assert_uint_eq(rekv_safetensors_count(st), (size_t)n);
    for (int i = 0; i < n; i++) {
        const rekv_tensor *t = rekv_safetensors_find(st, w[i].name);
        ck_assert_msg(t != NULL, "%s: %s missing", dir, w[i].name);
        ck_assert_int_eq(t->dtype, s->dtype);
        ck_assert_int_eq(t->ndim, w[i].d1 ? 2 : 1);
        ck_assert_msg(t->shape[0] == w[i].d0 && (!w[i].d1 || t->shape[1] == w[i].d1),
                      "%s has the wrong shape", w[i].name);
    }
    free(w);

    /* value ranges: norms near 1, small biases, bounded linear weights, finite embeddings */
    for (size_t i = 0; i < rekv_safetensors_count(st); i++) {
        const rekv_tensor *t = rekv_safetensors_at(st, i);
        size_t ne = (size_t)rekv_tensor_numel(t);
        float *v = malloc(ne * sizeof(float));
        rekv_to_f32(v, t->data, t->dtype, ne);
        double sum = 0, sq = 0, mx = 0;
        for (size_t j = 0; j < ne; j++) {
            ck_assert_msg(isfinite(v[j]), "%s[%zu] is not finite", t->name, j);
            sum += v[j];
            sq += (double)v[j] * v[j];
            if (fabs(v[j]) > mx)
                mx = fabs(v[j]);
        }
        double mean = sum / (double)ne, sd = sqrt(sq / (double)ne - mean * mean);
        const char *nm = t->name;
        int is_norm_w = strstr(nm, "norm") && strstr(nm, ".weight");
        if (is_norm_w) {
            ck_assert_msg(fabs(mean - 1) < 0.05 && mx < 1.15, "%s: mean %g max %g", nm, mean, mx);
        } else if (strstr(nm, ".bias")) {
            ck_assert_msg(mx <= 0.021, "%s: max %g", nm, mx);
        } else if (strstr(nm, "embed") || strstr(nm, "lm_head")) {
            ck_assert_msg(sd > 0.01 && sd < 1.1 && fabs(mean) < 0.05, "%s: mean %g sd %g", nm, mean,
                          sd);
        } else {
            double fan_in = (double)t->shape[1];
            ck_assert_msg(mx <= 1.01 / sqrt(fan_in) && sd > 0.3 / sqrt(fan_in), "%s: max %g sd %g",
                          nm, mx, sd);
        }
        free(v);
    }
    rekv_safetensors_close(st);
}

/* ---------------------------------------------------------------- config.json */

static json_t *load_config(const char *dir)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/config.json", dir);
    json_error_t je;
    json_t *c = json_load_file(p, 0, &je);
    ck_assert_msg(c != NULL, "%s: %s", p, je.text);
    return c;
}

static long long geti(json_t *c, const char *k)
{
    json_t *v = json_object_get(c, k);
    ck_assert_msg(json_is_integer(v), "config field %s is missing or not an integer", k);
    return json_integer_value(v);
}

static const char *gets_(json_t *c, const char *k)
{
    json_t *v = json_object_get(c, k);
    ck_assert_msg(json_is_string(v), "config field %s is missing or not a string", k);
    return json_string_value(v);
}

START_TEST(test_opt_tied)
{
    rekv_synth_spec s = opt_spec();
    const char *d = sub("opt");
    synth_ok(&s, d);
    check_model(&s, d);
    json_t *c = load_config(d);
    ck_assert_str_eq(gets_(c, "model_type"), "opt");
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(c, "architectures"), 0)),
                     "OPTForCausalLM");
    ck_assert_int_eq(geti(c, "hidden_size"), 64);
    ck_assert_int_eq(geti(c, "num_hidden_layers"), 3);
    ck_assert_int_eq(geti(c, "ffn_dim"), 256);
    ck_assert_int_eq(geti(c, "num_attention_heads"), 4);
    ck_assert_int_eq(geti(c, "max_position_embeddings"), 128);
    ck_assert_int_eq(geti(c, "word_embed_proj_dim"), 64);
    ck_assert_int_eq(geti(c, "vocab_size"), 300);
    ck_assert_int_eq(geti(c, "bos_token_id"), 2);
    ck_assert_int_eq(geti(c, "eos_token_id"), 2);
    ck_assert_int_eq(geti(c, "pad_token_id"), 1);
    ck_assert(json_is_true(json_object_get(c, "do_layer_norm_before")));
    ck_assert(json_is_true(json_object_get(c, "enable_bias")));
    ck_assert(json_is_true(json_object_get(c, "tie_word_embeddings")));
    ck_assert_str_eq(gets_(c, "activation_function"), "relu");
    ck_assert_str_eq(gets_(c, "torch_dtype"), "float16");
    json_decref(c);

    /* the project's own config parser accepts it */
    rekv_model_config mc;
    rekv_err err = {0};
    ck_assert_msg(rekv_config_load_hf(sub("opt/config.json"), &mc, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(mc.arch, REKV_ARCH_OPT);
    ck_assert_int_eq(mc.hidden, 64);
    ck_assert_int_eq(mc.tied_head, 1);
}
END_TEST

START_TEST(test_opt_untied_f32)
{
    rekv_synth_spec s = opt_spec();
    s.tied_head = 0;
    s.dtype = REKV_DTYPE_F32;
    s.n_layers = 1;
    const char *d = sub("opt32");
    synth_ok(&s, d);
    check_model(&s, d);
    json_t *c = load_config(d);
    ck_assert(json_is_false(json_object_get(c, "tie_word_embeddings")));
    ck_assert_str_eq(gets_(c, "torch_dtype"), "float32");
    json_decref(c);
}
END_TEST

START_TEST(test_llama_gqa)
{
    rekv_synth_spec s = llama_spec();
    const char *d = sub("llama");
    synth_ok(&s, d);
    check_model(&s, d);
    json_t *c = load_config(d);
    ck_assert_str_eq(gets_(c, "model_type"), "llama");
    ck_assert_str_eq(json_string_value(json_array_get(json_object_get(c, "architectures"), 0)),
                     "LlamaForCausalLM");
    ck_assert_int_eq(geti(c, "hidden_size"), 64);
    ck_assert_int_eq(geti(c, "intermediate_size"), 176);
    ck_assert_int_eq(geti(c, "num_hidden_layers"), 3);
    ck_assert_int_eq(geti(c, "num_attention_heads"), 8);
    ck_assert_int_eq(geti(c, "num_key_value_heads"), 2);
    ck_assert_int_eq(geti(c, "head_dim"), 8);
    ck_assert_int_eq(geti(c, "max_position_embeddings"), 128);
    ck_assert_int_eq(geti(c, "vocab_size"), 300);
    ck_assert_int_eq(geti(c, "bos_token_id"), 1);
    ck_assert_int_eq(geti(c, "eos_token_id"), 2);
    ck_assert_double_eq_tol(json_number_value(json_object_get(c, "rms_norm_eps")), 1e-5, 1e-12);
    ck_assert_double_eq_tol(json_number_value(json_object_get(c, "rope_theta")), 10000, 1e-9);
    ck_assert_str_eq(gets_(c, "hidden_act"), "silu");
    ck_assert(json_is_false(json_object_get(c, "tie_word_embeddings")));
    ck_assert_str_eq(gets_(c, "torch_dtype"), "bfloat16");
    json_decref(c);

    rekv_model_config mc;
    rekv_err err = {0};
    ck_assert_msg(rekv_config_load_hf(sub("llama/config.json"), &mc, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(mc.arch, REKV_ARCH_LLAMA);
    ck_assert_int_eq(mc.n_kv_heads, 2);
    ck_assert_int_eq(mc.head_dim, 8);
}
END_TEST

START_TEST(test_llama_tied)
{
    rekv_synth_spec s = llama_spec();
    s.tied_head = 1;
    s.n_kv_heads = 8;
    s.dtype = REKV_DTYPE_F16;
    const char *d = sub("llama-tied");
    synth_ok(&s, d);
    check_model(&s, d);
    json_t *c = load_config(d);
    ck_assert(json_is_true(json_object_get(c, "tie_word_embeddings")));
    json_decref(c);
}
END_TEST

START_TEST(test_bad_spec)
{
    rekv_err err = {0};
    rekv_synth_spec s = llama_spec();
    s.n_kv_heads = 3; /* 8 % 3 != 0 */
    ck_assert_int_lt(rekv_synth_write(&s, sub("bad"), &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "kv-heads"));
    ck_assert_ptr_nonnull(strstr(err.msg, sub("bad")));
    rekv_err_clear(&err);
    s = opt_spec();
    s.hidden = 65;
    ck_assert_int_lt(rekv_synth_write(&s, sub("bad"), &err), 0);
    rekv_err_clear(&err);
    s = opt_spec();
    s.n_kv_heads = 2;
    ck_assert_int_lt(rekv_synth_write(&s, sub("bad"), &err), 0);
    rekv_err_clear(&err);
    s = opt_spec();
    s.n_layers = 0;
    ck_assert_int_lt(rekv_synth_write(&s, sub("bad"), &err), 0);
    rekv_err_clear(&err);
    s = opt_spec();
    ck_assert_int_lt(rekv_synth_write(&s, "/nonexistent-dir/sub", &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "/nonexistent-dir/sub"));
}
END_TEST

/* ---------------------------------------------------------------- determinism */

static int same_file(const char *a, const char *b)
{
    size_t la, lb;
    char *x = tu_read_file(a, &la), *y = tu_read_file(b, &lb);
    ck_assert_ptr_nonnull(x);
    ck_assert_ptr_nonnull(y);
    int same = la == lb && memcmp(x, y, la) == 0;
    free(x);
    free(y);
    return same;
}

START_TEST(test_deterministic)
{
    rekv_synth_spec s = llama_spec();
    synth_ok(&s, sub("a"));
    synth_ok(&s, sub("b"));
    s.seed++;
    synth_ok(&s, sub("c"));
    ck_assert(same_file(sub("a/model.safetensors"), sub("b/model.safetensors")));
    ck_assert(same_file(sub("a/config.json"), sub("b/config.json")));
    ck_assert(!same_file(sub("a/model.safetensors"), sub("c/model.safetensors")));
    ck_assert(same_file(sub("a/config.json"), sub("c/config.json")));

    /* different tensors of one model are not copies of each other */
    rekv_err err = {0};
    rekv_safetensors *st;
    ck_assert_int_eq(rekv_safetensors_open(sub("a"), &st, &err), 0);
    const rekv_tensor *q = rekv_safetensors_find(st, "model.layers.0.self_attn.k_proj.weight");
    const rekv_tensor *k = rekv_safetensors_find(st, "model.layers.0.self_attn.v_proj.weight");
    ck_assert_int_ne(memcmp(q->data, k->data, q->nbytes), 0);
    rekv_safetensors_close(st);
}
END_TEST

/* ---------------------------------------------------------------- activations stay in range */

static float *tensor_f32(const rekv_safetensors *st, const char *fmt, int layer)
{
    char name[160];
    snprintf(name, sizeof(name), fmt, layer);
    const rekv_tensor *t = rekv_safetensors_find(st, name);
    ck_assert_msg(t != NULL, "%s missing", name);
    size_t n = (size_t)rekv_tensor_numel(t);
    float *v = malloc(n * sizeof(float));
    rekv_to_f32(v, t->data, t->dtype, n);
    return v;
}

static void matvec(float *y, const float *w, const float *x, int rows, int cols)
{
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++)
            s += (double)w[(size_t)r * cols + c] * x[c];
        y[r] = (float)s;
    }
}

static void norm(float *y, const float *x, int n, const float *w, const float *b)
{
    double mean = 0, sq = 0;
    for (int i = 0; i < n; i++)
        mean += x[i];
    mean = b ? mean / n : 0; /* LayerNorm centres, RMSNorm does not */
    for (int i = 0; i < n; i++)
        sq += (x[i] - mean) * (x[i] - mean);
    double inv = 1.0 / sqrt(sq / n + 1e-5);
    for (int i = 0; i < n; i++)
        y[i] = (float)((x[i] - mean) * inv * w[i] + (b ? b[i] : 0));
}

static void free_all(float **p, int n)
{
    for (int i = 0; i < n; i++)
        free(p[i]);
}

/* A one-token forward pass (attention over one position is just the value path) through a deep
 * model: the residual stream must stay well inside fp16 range and the logits finite and spread. */
static void check_forward(const rekv_synth_spec *s, const char *dir)
{
    rekv_err err = {0};
    rekv_safetensors *st;
    ck_assert_int_eq(rekv_safetensors_open(dir, &st, &err), 0);
    int H = s->hidden, F = s->ffn, hd = H / s->n_heads, kvd = s->n_kv_heads * hd;
    float *x = calloc((size_t)H, 4), *n = calloc((size_t)H, 4), *a = calloc((size_t)F, 4),
          *b = calloc((size_t)F, 4), *v = calloc((size_t)H, 4), *o = calloc((size_t)H, 4);
    int opt = s->arch == REKV_ARCH_OPT;
    int tok = 17;
    float *emb =
        tensor_f32(st, opt ? "model.decoder.embed_tokens.weight" : "model.embed_tokens.weight", 0);
    for (int i = 0; i < H; i++)
        x[i] = emb[(size_t)tok * H + i];
    if (opt) {
        float *pos = tensor_f32(st, "model.decoder.embed_positions.weight", 0);
        for (int i = 0; i < H; i++)
            x[i] += pos[2 * H + i];
        free(pos);
    }
    double maxabs = 0;
    for (int l = 0; l < s->n_layers; l++) {
        if (opt) {
            float *w[12] = {
                tensor_f32(st, "model.decoder.layers.%d.self_attn_layer_norm.weight", l),
                tensor_f32(st, "model.decoder.layers.%d.self_attn_layer_norm.bias", l),
                tensor_f32(st, "model.decoder.layers.%d.self_attn.v_proj.weight", l),
                tensor_f32(st, "model.decoder.layers.%d.self_attn.v_proj.bias", l),
                tensor_f32(st, "model.decoder.layers.%d.self_attn.out_proj.weight", l),
                tensor_f32(st, "model.decoder.layers.%d.self_attn.out_proj.bias", l),
                tensor_f32(st, "model.decoder.layers.%d.final_layer_norm.weight", l),
                tensor_f32(st, "model.decoder.layers.%d.final_layer_norm.bias", l),
                tensor_f32(st, "model.decoder.layers.%d.fc1.weight", l),
                tensor_f32(st, "model.decoder.layers.%d.fc1.bias", l),
                tensor_f32(st, "model.decoder.layers.%d.fc2.weight", l),
                tensor_f32(st, "model.decoder.layers.%d.fc2.bias", l)};
            norm(n, x, H, w[0], w[1]);
            matvec(v, w[2], n, H, H);
            for (int i = 0; i < H; i++)
                v[i] += w[3][i];
            matvec(o, w[4], v, H, H);
            for (int i = 0; i < H; i++)
                x[i] += o[i] + w[5][i];
            norm(n, x, H, w[6], w[7]);
            matvec(a, w[8], n, F, H);
            for (int i = 0; i < F; i++)
                a[i] = fmaxf(a[i] + w[9][i], 0);
            matvec(o, w[10], a, H, F);
            for (int i = 0; i < H; i++)
                x[i] += o[i] + w[11][i];
            free_all(w, 12);
        } else {
            float *w[7] = {tensor_f32(st, "model.layers.%d.input_layernorm.weight", l),
                           tensor_f32(st, "model.layers.%d.self_attn.v_proj.weight", l),
                           tensor_f32(st, "model.layers.%d.self_attn.o_proj.weight", l),
                           tensor_f32(st, "model.layers.%d.post_attention_layernorm.weight", l),
                           tensor_f32(st, "model.layers.%d.mlp.gate_proj.weight", l),
                           tensor_f32(st, "model.layers.%d.mlp.up_proj.weight", l),
                           tensor_f32(st, "model.layers.%d.mlp.down_proj.weight", l)};
            norm(n, x, H, w[0], NULL);
            float *kv = calloc((size_t)kvd, 4);
            matvec(kv, w[1], n, kvd, H);
            int group = s->n_heads / s->n_kv_heads;
            for (int h = 0; h < s->n_heads; h++) /* GQA: query head h reads kv head h / group */
                memcpy(v + h * hd, kv + (h / group) * hd, (size_t)hd * 4);
            free(kv);
            matvec(o, w[2], v, H, H);
            for (int i = 0; i < H; i++)
                x[i] += o[i];
            norm(n, x, H, w[3], NULL);
            matvec(a, w[4], n, F, H);
            matvec(b, w[5], n, F, H);
            for (int i = 0; i < F; i++)
                a[i] = a[i] / (1 + expf(-a[i])) * b[i];
            matvec(o, w[6], a, H, F);
            for (int i = 0; i < H; i++)
                x[i] += o[i];
            free_all(w, 7);
        }
        for (int i = 0; i < H; i++)
            if (fabs(x[i]) > maxabs)
                maxabs = fabs(x[i]);
    }
    ck_assert_msg(maxabs < 1000, "residual stream reached %g", maxabs);
    float *fw =
        tensor_f32(st, opt ? "model.decoder.final_layer_norm.weight" : "model.norm.weight", 0);
    float *fb = opt ? tensor_f32(st, "model.decoder.final_layer_norm.bias", 0) : NULL;
    norm(n, x, H, fw, fb);
    float *head = s->tied_head ? emb : tensor_f32(st, "lm_head.weight", 0);
    float *logits = malloc((size_t)s->vocab * 4);
    matvec(logits, head, n, s->vocab, H);
    double sum = 0, sq = 0;
    for (int i = 0; i < s->vocab; i++) {
        ck_assert(isfinite(logits[i]));
        ck_assert(fabsf(logits[i]) < 1000);
        sum += logits[i];
        sq += (double)logits[i] * logits[i];
    }
    double mean = sum / s->vocab, sd = sqrt(sq / s->vocab - mean * mean);
    ck_assert_msg(sd > 0.3 && sd < 20, "logit std %g", sd);
    if (head != emb)
        free(head);
    free(logits);
    free(fw);
    free(fb);
    free(emb);
    free(x);
    free(n);
    free(a);
    free(b);
    free(v);
    free(o);
    rekv_safetensors_close(st);
}

START_TEST(test_activations_in_range)
{
    rekv_synth_spec s = opt_spec();
    s.n_layers = 48;
    s.hidden = 128;
    s.ffn = 512;
    synth_ok(&s, sub("deep-opt"));
    check_forward(&s, sub("deep-opt"));
    s = llama_spec();
    s.n_layers = 48;
    s.hidden = 128;
    s.ffn = 344;
    synth_ok(&s, sub("deep-llama"));
    check_forward(&s, sub("deep-llama"));
}
END_TEST

/* ---------------------------------------------------------------- streaming memory */

START_TEST(test_streaming_memory)
{
    /* about 100 MiB of weights; the writer must stream rather than build it in memory */
    rekv_synth_spec s = {.arch = REKV_ARCH_LLAMA,
                         .n_layers = 6,
                         .hidden = 768,
                         .n_heads = 12,
                         .n_kv_heads = 4,
                         .ffn = 2048,
                         .vocab = 8000,
                         .max_pos = 2048,
                         .dtype = REKV_DTYPE_F16,
                         .seed = 1,
                         .tied_head = 0};
    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    synth_ok(&s, sub("mid"));
    getrusage(RUSAGE_SELF, &ru1);
    struct stat sb;
    ck_assert_int_eq(stat(sub("mid/model.safetensors"), &sb), 0);
    ck_assert_int_eq((long long)sb.st_size - expected_params(&s) * 2 > 0, 1);
    long grew_kb = ru1.ru_maxrss - ru0.ru_maxrss;
    ck_assert_msg(sb.st_size > 90ll << 20, "file is only %lld bytes", (long long)sb.st_size);
    ck_assert_msg(ru1.ru_maxrss < 48 * 1024 && grew_kb < 32 * 1024,
                  "max RSS %ld KiB (grew %ld KiB) while writing a %lld-byte model", ru1.ru_maxrss,
                  grew_kb, (long long)sb.st_size);
}
END_TEST

/* ---------------------------------------------------------------- the CLI */

START_TEST(test_cli)
{
    const char *bin = tu_bin("rekv-loader");
    char cmd[8192];
    char *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s --help", bin);
    ck_assert_msg(tu_run(cmd, &out) == 0, "%s failed (run make first)", cmd);
    ck_assert_ptr_nonnull(strstr(out, "synth"));
    ck_assert_ptr_nonnull(strstr(out, "inspect"));
    free(out);

    const char *d = sub("cli-llama");
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 2 --hidden 64 --heads 8 --kv-heads 2 --ffn 176 "
             "--vocab 300 --max-pos 128 --dtype bf16 --seed 7 --untied %s",
             bin, d);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
    rekv_synth_spec s = llama_spec();
    s.n_layers = 2;
    check_model(&s, d);
    /* the CLI and the library write the same bytes */
    synth_ok(&s, sub("lib-llama"));
    ck_assert(same_file(sub("cli-llama/model.safetensors"), sub("lib-llama/model.safetensors")));

    snprintf(cmd, sizeof(cmd), "%s inspect %s", bin, d);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    char want[128];
    snprintf(want, sizeof(want), "parameters: %lld", (long long)expected_params(&s));
    ck_assert_msg(strstr(out, want) != NULL, "inspect output lacks \"%s\":\n%s", want, out);
    ck_assert_ptr_nonnull(strstr(out, "model.layers.1.self_attn.k_proj.weight"));
    ck_assert_ptr_nonnull(strstr(out, "[16, 64]"));
    free(out);

    /* OPT with the CLI's default (tied) head */
    d = sub("cli-opt");
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch opt --layers 2 --hidden 32 --heads 4 --ffn 64 --vocab 100 "
             "--max-pos 16 --dtype f32 --seed 3 %s",
             bin, d);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
    rekv_synth_spec so = {.arch = REKV_ARCH_OPT,
                          .n_layers = 2,
                          .hidden = 32,
                          .n_heads = 4,
                          .n_kv_heads = 4,
                          .ffn = 64,
                          .vocab = 100,
                          .max_pos = 16,
                          .dtype = REKV_DTYPE_F32,
                          .seed = 3,
                          .tied_head = 1};
    check_model(&so, d);
    snprintf(cmd, sizeof(cmd), "%s inspect %s/model.safetensors", bin, d);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    snprintf(want, sizeof(want), "parameters: %lld", (long long)expected_params(&so));
    ck_assert_msg(strstr(out, want) != NULL, "inspect output lacks \"%s\":\n%s", want, out);
    free(out);

    /* errors: non-zero exit and one line on stderr */
    snprintf(cmd, sizeof(cmd), "%s synth --arch gpt --layers 1 %s 2>&1", bin, sub("x"));
    ck_assert_int_ne(tu_run(cmd, &out), 0);
    ck_assert_ptr_nonnull(strstr(out, "--arch must be opt or llama"));
    free(out);
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch opt --layers 1 --hidden 30 --heads 4 --ffn 8 "
             "--vocab 10 %s 2>&1",
             bin, sub("x"));
    ck_assert_int_ne(tu_run(cmd, &out), 0);
    ck_assert_ptr_nonnull(strstr(out, "not a multiple"));
    free(out);
    snprintf(cmd, sizeof(cmd), "%s inspect %s/nope 2>&1", bin, g_dir);
    ck_assert_int_ne(tu_run(cmd, &out), 0);
    ck_assert_ptr_nonnull(strstr(out, "nope"));
    free(out);
    snprintf(cmd, sizeof(cmd), "%s frobnicate 2>&1", bin);
    ck_assert_int_ne(tu_run(cmd, &out), 0);
    free(out);
}
END_TEST

START_TEST(test_cli_inspect_llama2c)
{
    const char *p = tu_shared("models/stories260K/stories260K.bin");
    if (p == NULL)
        return;
    char cmd[4200];
    char *out;
    snprintf(cmd, sizeof(cmd), "%s inspect %s", tu_bin("rekv-loader"), p);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    ck_assert_ptr_nonnull(strstr(out, "dim 64"));
    ck_assert_ptr_nonnull(strstr(out, "n_kv_heads 4"));
    /* 264,128 floats minus the two 512x4 RoPE tables */
    ck_assert_ptr_nonnull(strstr(out, "parameters: 260032"));
    free(out);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("synth");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_opt_tied);
    tcase_add_test(tc, test_opt_untied_f32);
    tcase_add_test(tc, test_llama_gqa);
    tcase_add_test(tc, test_llama_tied);
    tcase_add_test(tc, test_bad_spec);
    tcase_add_test(tc, test_deterministic);
    tcase_add_test(tc, test_activations_in_range);
    tcase_add_test(tc, test_streaming_memory);
    tcase_add_test(tc, test_cli);
    tcase_add_test(tc, test_cli_inspect_llama2c);
    suite_add_tcase(s, tc);
    return s;
}

int main(int argc, char **argv)
{
    /* run directly (not from make), find rekv-loader in the build tree this test was built in */
    const char *slash = argc > 0 ? strstr(argv[0], "/tests/") : NULL;
    if (getenv("REKV_BUILD") == NULL && slash != NULL) {
        char build[4096];
        snprintf(build, sizeof(build), "%.*s", (int)(slash - argv[0]), argv[0]);
        setenv("REKV_BUILD", build, 1);
    }
    return tu_run_suite(suite());
}
