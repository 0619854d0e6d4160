/* chat_template.c — the chat-template API: parse (chat_template_lex.c, chat_template_parse.c),
 * load from a model directory, render (chat_template_eval.c) and free. The template keeps the
 * special tokens of tokenizer_config.json (bos_token, eos_token, ...) so that a render whose
 * caller sets none gets them, as HF's apply_chat_template passes them. */
#include "loader/chat_template.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "loader/chat_template_internal.h"

struct rekv_chat_template {
    ct_node *root;
    ct_node **all; /* every node of the tree (root among them) */
    size_t nall;
    json_t *special; /* object: special token name -> its text, from tokenizer_config.json */
};

int rekv_chat_template_parse(const char *source, rekv_chat_template **out, rekv_err *err)
{
    *out = NULL;
    if (source == NULL)
        return rekv_errf(err, -EINVAL, "chat template: no source");
    ct_toks toks;
    int rc = ct_lex(source, &toks, err);
    if (rc)
        return rc;
    rekv_chat_template *t = calloc(1, sizeof *t);
    if (t == NULL) {
        ct_toks_free(&toks);
        return rekv_errf(err, -ENOMEM, "chat template: out of memory");
    }
    rc = ct_parse_tokens(&toks, &t->root, &t->all, &t->nall, err);
    ct_toks_free(&toks);
    if (rc) {
        free(t);
        return rc;
    }
    t->special = json_object();
    *out = t;
    return 0;
}

void rekv_chat_template_free(rekv_chat_template *t)
{
    if (t == NULL)
        return;
    for (size_t i = 0; i < t->nall; i++)
        ct_node_free(t->all[i]);
    free(t->all);
    json_decref(t->special);
    free(t);
}

const char *rekv_chat_template_special(const rekv_chat_template *t, const char *name)
{
    return t ? json_string_value(json_object_get(t->special, name)) : NULL;
}

/* The caller's variables, with the special tokens it did not set. */
static json_t *merged_ctx(const rekv_chat_template *t, const json_t *ctx)
{
    json_t *m = json_copy((json_t *)ctx); /* shallow: values are shared, never changed */
    if (m == NULL)
        return NULL;
    const char *k;
    json_t *v;
    json_object_foreach(t->special, k, v) if (json_object_get(m, k) == NULL)
        json_object_set(m, k, v);
    return m;
}

int rekv_chat_template_render(const rekv_chat_template *t, const json_t *ctx, char **out,
                              rekv_err *err)
{
    *out = NULL;
    if (!json_is_object(ctx))
        return rekv_errf(err, -EINVAL, "chat template: render variables must be a JSON object");
    json_t *vars = merged_ctx(t, ctx);
    if (vars == NULL)
        return rekv_errf(err, -ENOMEM, "chat template: out of memory");
    ct_frame global = {0};
    ct_state st = {.ctx = vars, .global = &global, .err = err};
    json_t *now = json_object_get(vars, "rekv_now");
    if (json_is_integer(now)) {
        st.now = (time_t)json_integer_value(now);
        st.now_utc = 1;
    } else {
        st.now = time(NULL);
    }
    ct_buf b = {0};
    int rc = ct_exec(&st, &global, t->root, &b);
    if (rc == 0 && b.oom)
        rc = rekv_errf(err, -ENOMEM, "chat template: out of memory");
    if (rc == 0 && b.n > 0 && memchr(b.p, '\0', b.n) != NULL) /* the C string would end there */
        rc = rekv_errf(err, -EINVAL, "chat template: the rendered text holds a NUL character");
    ct_frame_clear(&global);
    for (size_t i = 0; i < st.tuples.n; i++)
        json_decref(st.tuples.v[i]);
    free(st.tuples.v);
    json_decref(vars);
    if (rc == 0 && b.p == NULL && (b.p = strdup("")) == NULL)
        rc = rekv_errf(err, -ENOMEM, "chat template: out of memory");
    if (rc) {
        free(b.p);
        return rc;
    }
    *out = b.p;
    return 0;
}

static int read_text(const char *path, char **out, rekv_err *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return errno == ENOENT ? 1 : rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || sb.st_size > (off_t)CT_MAX_OUTPUT) {
        fclose(f);
        return rekv_errf(err, -EFBIG, "%s: not a chat template of at most %u bytes", path,
                         CT_MAX_OUTPUT);
    }
    char *s = malloc((size_t)sb.st_size + 1);
    size_t n = s ? fread(s, 1, (size_t)sb.st_size, f) : 0;
    int bad = ferror(f);
    fclose(f);
    if (s == NULL || bad) {
        free(s);
        return rekv_errf(err, s ? -EIO : -ENOMEM, "%s: cannot read", path);
    }
    s[n] = '\0';
    if (strlen(s) != n) {
        free(s);
        return rekv_errf(err, -EINVAL, "%s: holds a NUL byte", path);
    }
    *out = s;
    return 0;
}

/* tokenizer_config.json's "chat_template": a string, or [{name, template}] whose "default". */
static int config_template(const char *path, json_t *cfg, const char **src, rekv_err *err)
{
    json_t *ct = json_object_get(cfg, "chat_template");
    *src = NULL;
    if (ct == NULL || json_is_null(ct))
        return 0;
    if (json_is_string(ct)) {
        *src = json_string_value(ct);
        return 0;
    }
    if (json_is_array(ct)) {
        size_t i;
        json_t *e;
        json_array_foreach(ct, i, e)
        {
            if (json_is_string(json_object_get(e, "template")) &&
                json_is_string(json_object_get(e, "name")) &&
                strcmp(json_string_value(json_object_get(e, "name")), "default") == 0) {
                *src = json_string_value(json_object_get(e, "template"));
                return 0;
            }
        }
        return rekv_errf(err, -EINVAL, "%s: chat_template list has no entry named \"default\"",
                         path);
    }
    return rekv_errf(err, -EINVAL, "%s: chat_template is neither a string nor a list", path);
}

/* A special token's text: a string, or an object whose "content" is it (AddedToken). */
static json_t *token_text(json_t *v)
{
    if (json_is_object(v))
        v = json_object_get(v, "content");
    return json_is_string(v) ? v : NULL;
}

/* The special tokens, as HF's special_tokens_map passes them to the template. */
static void config_special(json_t *cfg, json_t *special)
{
    static const char *const names[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                        "pad_token", "cls_token", "mask_token"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        json_t *v = token_text(json_object_get(cfg, names[i]));
        if (v)
            json_object_set(special, names[i], v);
    }
    json_t *extra = json_object_get(cfg, "additional_special_tokens"), *list = json_array(), *e;
    size_t i;
    json_array_foreach(extra, i, e) if (token_text(e)) json_array_append(list, token_text(e));
    if (json_is_array(extra) && list)
        json_object_set(special, "additional_special_tokens", list);
    json_decref(list);
}

int rekv_chat_template_load_dir(const char *dir, rekv_chat_template **out, rekv_err *err)
{
    *out = NULL;
    char path[4096], cfg_path[4096];
    if (snprintf(path, sizeof path, "%s/chat_template.jinja", dir) >= (int)sizeof path ||
        snprintf(cfg_path, sizeof cfg_path, "%s/tokenizer_config.json", dir) >=
            (int)sizeof cfg_path)
        return rekv_errf(err, -ENAMETOOLONG, "%s: path too long", dir);
    json_t *cfg = NULL;
    struct stat sb;
    if (stat(cfg_path, &sb) == 0) {
        json_error_t je;
        cfg = json_load_file(cfg_path, 0, &je);
        if (cfg == NULL || !json_is_object(cfg)) {
            json_decref(cfg);
            return rekv_errf(err, -EINVAL, "%s:%d: %s", cfg_path, je.line,
                             cfg ? "not a JSON object" : je.text);
        }
    }
    char *text = NULL;
    const char *src = NULL;
    int rc = read_text(path, &text, err);
    if (rc < 0)
        goto out;
    if (rc == 1) {
        rc = cfg ? config_template(cfg_path, cfg, &src, err) : 0;
        if (rc || src == NULL)
            goto out;
    } else {
        src = text;
    }
    rc = rekv_chat_template_parse(src, out, err);
    if (rc == 0 && cfg)
        config_special(cfg, (*out)->special);
out:
    free(text);
    json_decref(cfg);
    return rc < 0 ? rc : 0;
}
