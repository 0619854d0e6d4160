/* chat_template_eval.c — the chat-template evaluator: walks the syntax tree with Jinja2's
 * semantics. Scopes are frames: the template's top level, one fresh frame per loop iteration
 * (what a loop body sets is gone at the next iteration and after the loop, as in Jinja2), one per
 * macro call (whose parent is the top level); an if has no scope of its own. Names not found in
 * the frames come from the caller's variables (ctx), then from the builtins (raise_exception,
 * strftime_now, namespace, range). Every render is bounded in output, steps and depth. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/chat_template_internal.h"

int ct_render_errf(ct_state *st, const ct_node *at, int code, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap); /* rekv_errf makes it one line, whatever raise_exception's message holds */
    if (at)
        return rekv_errf(st->err, code, "chat template %d:%d: %s", at->line, at->col, msg);
    return rekv_errf(st->err, code, "chat template: %s", msg);
}

int ct_out(ct_state *st, ct_buf *out, const void *p, size_t n)
{
    if (st->out_total + n > CT_MAX_OUTPUT)
        return ct_render_errf(st, NULL, -E2BIG, "output longer than %u bytes", CT_MAX_OUTPUT);
    st->out_total += n;
    if (ct_buf_add(out, p, n))
        return ct_render_errf(st, NULL, -ENOMEM, "out of memory");
    return 0;
}

int ct_mark_tuple(ct_state *st, json_t *arr)
{
    ct_tuples *t = &st->tuples;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        json_t **v = realloc(t->v, cap * sizeof *v);
        if (v == NULL)
            return ct_render_errf(st, NULL, -ENOMEM, "out of memory");
        t->v = v;
        t->cap = cap;
    }
    t->v[t->n++] = json_incref(arr);
    return 0;
}

int ct_take_string(ct_state *st, const ct_node *at, ct_buf *b, ctv *out)
{
    int rc = 0;
    if (b->oom)
        rc = ct_render_errf(st, at, -ENOMEM, "out of memory");
    else if (b->n > CT_MAX_OUTPUT)
        rc = ct_render_errf(st, at, -E2BIG, "string longer than %u bytes", CT_MAX_OUTPUT);
    json_t *j = rc ? NULL : json_stringn_nocheck(b->p ? b->p : "", b->n);
    free(b->p);
    memset(b, 0, sizeof *b);
    if (rc)
        return rc;
    if (j == NULL)
        return ct_render_errf(st, at, -ENOMEM, "out of memory");
    *out = ctv_json(j);
    return 0;
}

int ct_frame_set(ct_frame *f, const char *name, ctv v)
{
    for (size_t i = 0; i < f->n; i++)
        if (strcmp(f->vars[i].name, name) == 0) {
            ctv_drop(&f->vars[i].v);
            f->vars[i].v = v;
            return 0;
        }
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 8;
        ct_var *vars = realloc(f->vars, cap * sizeof *vars);
        if (vars == NULL) {
            ctv_drop(&v);
            return -ENOMEM;
        }
        f->vars = vars;
        f->cap = cap;
    }
    f->vars[f->n++] = (ct_var){name, v};
    return 0;
}

void ct_frame_clear(ct_frame *f)
{
    for (size_t i = 0; i < f->n; i++)
        ctv_drop(&f->vars[i].v);
    free(f->vars);
    f->vars = NULL;
    f->n = f->cap = 0;
}

static const ctv *frame_find(const ct_frame *f, const char *name)
{
    for (; f; f = f->parent)
        for (size_t i = f->n; i-- > 0;)
            if (strcmp(f->vars[i].name, name) == 0)
                return &f->vars[i].v;
    return NULL;
}

static int lookup(ct_state *st, const ct_frame *f, const char *name, ctv *out)
{
    const ctv *v = frame_find(f, name);
    if (v) {
        *out = ctv_copy(v);
        return 0;
    }
    json_t *j = json_object_get(st->ctx, name);
    if (j) {
        *out = ctv_json(json_incref(j));
        return 0;
    }
    int fn = ct_builtin_index(name);
    if (fn >= 0) {
        *out = (ctv){CTV_FUNC, NULL, NULL, fn};
        return 0;
    }
    *out = ctv_undef(name);
    return 0;
}

static void args_free(ct_args *a)
{
    for (size_t i = 0; i < a->n; i++)
        ctv_drop(&a->v[i]);
    free(a->v);
    free(a->kw);
    memset(a, 0, sizeof *a);
}

static int args_eval(ct_state *st, ct_frame *f, const ct_node *n, ct_args *a)
{
    memset(a, 0, sizeof *a);
    if (n->nkids == 0)
        return 0;
    a->v = calloc(n->nkids, sizeof *a->v);
    a->kw = calloc(n->nkids, sizeof *a->kw);
    if (a->v == NULL || a->kw == NULL) {
        args_free(a);
        return ct_render_errf(st, n, -ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n->nkids; i++) {
        int rc = ct_eval(st, f, n->kids[i], &a->v[i]);
        a->kw[i] = n->kids[i]->kw;
        a->n = i + 1;
        if (rc) {
            args_free(a);
            return rc;
        }
    }
    return 0;
}

static int loop_attr(ct_state *st, const ct_node *at, const ct_loop *l, const char *name, ctv *out)
{
    size_t len = json_array_size(l->items), i = l->index0;
    long long v;
    if (!strcmp(name, "index"))
        v = (long long)i + 1;
    else if (!strcmp(name, "index0"))
        v = (long long)i;
    else if (!strcmp(name, "revindex"))
        v = (long long)(len - i);
    else if (!strcmp(name, "revindex0"))
        v = (long long)(len - i - 1);
    else if (!strcmp(name, "length"))
        v = (long long)len;
    else if (!strcmp(name, "depth"))
        v = 1;
    else if (!strcmp(name, "depth0"))
        v = 0;
    else if (!strcmp(name, "first") || !strcmp(name, "last")) {
        int b = name[0] == 'f' ? i == 0 : i + 1 == len;
        *out = ctv_json(json_boolean(b));
        return 0;
    } else if (!strcmp(name, "previtem") || !strcmp(name, "nextitem")) {
        size_t k = name[0] == 'p' ? i - 1 : i + 1; /* i - 1 wraps past len at i == 0 */
        json_t *j = json_array_get(l->items, k);
        *out = j ? ctv_json(json_incref(j)) : ctv_undef(name);
        return 0;
    } else {
        return ct_render_errf(st, at, -EINVAL, "loop.%s is not supported", name);
    }
    *out = ctv_json(json_integer(v));
    return 0;
}

/* Whether Python's str, list, dict, int or float (as j's type) has the attribute name: a
 * template reading one (not calling it) would get a bound method or a number's part. */
static int py_attribute(const json_t *j, const char *name)
{
    static const char *const str_attrs =
        " capitalize casefold center count encode endswith expandtabs find format format_map "
        "index isalnum isalpha isascii isdecimal isdigit isidentifier islower isnumeric "
        "isprintable isspace istitle isupper join ljust lower lstrip maketrans partition "
        "removeprefix removesuffix replace rfind rindex rjust rpartition rsplit rstrip split "
        "splitlines startswith strip swapcase title translate upper zfill ";
    static const char *const list_attrs =
        " append clear copy count extend index insert pop remove reverse sort ";
    static const char *const dict_attrs =
        " clear copy fromkeys get items keys pop popitem setdefault update values ";
    static const char *const int_attrs = " as_integer_ratio bit_count bit_length conjugate "
                                         "denominator from_bytes imag is_integer numerator real "
                                         "to_bytes ";
    static const char *const float_attrs =
        " as_integer_ratio conjugate fromhex hex imag is_integer real ";
    const char *list = json_is_string(j)                          ? str_attrs
                       : json_is_array(j)                         ? list_attrs
                       : json_is_object(j)                        ? dict_attrs
                       : json_is_integer(j) || json_is_boolean(j) ? int_attrs
                       : json_is_real(j)                          ? float_attrs
                                                                  : NULL;
    size_t n = strlen(name);
    for (const char *p = list ? strstr(list, name) : NULL; p; p = strstr(p + 1, name))
        if (p[-1] == ' ' && p[n] == ' ')
            return 1;
    return 0;
}

static int getattr(ct_state *st, const ct_node *at, const ctv *obj, const char *name, ctv *out)
{
    switch (obj->kind) {
    case CTV_UNDEF:
        return ct_render_errf(st, at, -EINVAL, "'%s' is undefined",
                              obj->p ? (const char *)obj->p : "value");
    case CTV_LOOP:
        return loop_attr(st, at, obj->p, name, out);
    case CTV_NS: {
        json_t *j = json_object_get(obj->j, name);
        *out = j ? ctv_json(json_incref(j)) : ctv_undef(name);
        return 0;
    }
    case CTV_JSON:
        if (py_attribute(obj->j, name)) /* Jinja2 finds Python's attribute before a key */
            return ct_render_errf(st, at, -EINVAL,
                                  "'.%s' of a %s is a Python attribute: not supported here", name,
                                  ct_type_name(obj));
        if (json_is_object(obj->j)) {
            json_t *j = json_object_get(obj->j, name);
            *out = j ? ctv_json(json_incref(j)) : ctv_undef(name);
            return 0;
        }
        *out = ctv_undef(name);
        return 0;
    default:
        *out = ctv_undef(name);
        return 0;
    }
}

/* Python's slice indices for a sequence of len items. */
static int slice_bound(const ctv *v, long long len, long long step, int is_start, long long *out)
{
    if (v == NULL || (v->kind == CTV_JSON && json_is_null(v->j))) {
        *out = step > 0 ? (is_start ? 0 : len) : (is_start ? len - 1 : -1);
        return 0;
    }
    if (v->kind != CTV_JSON || !json_is_integer(v->j))
        return -EINVAL;
    long long x = json_integer_value(v->j);
    if (x < 0)
        x += len;
    if (x < 0)
        x = step > 0 ? 0 : -1;
    if (x >= len)
        x = step > 0 ? len : len - 1;
    *out = x;
    return 0;
}

static int eval_slice(ct_state *st, ct_frame *f, const ct_node *n, ctv *obj, ctv *out)
{
    ctv parts[3] = {{0}};
    const ct_node *nodes[3] = {n->b, n->c, n->d};
    int rc = 0;
    for (int i = 0; i < 3 && rc == 0; i++)
        if (nodes[i])
            rc = ct_eval(st, f, nodes[i], &parts[i]);
    long long step = 1, start = 0, stop = 0;
    int is_str = obj->kind == CTV_JSON && json_is_string(obj->j);
    int is_list = obj->kind == CTV_JSON && json_is_array(obj->j);
    if (rc == 0 && !is_str && !is_list) /* Jinja2 slices with Python's [a:b], which raises */
        rc = ct_render_errf(st, n, -EINVAL, "cannot slice a %s", ct_type_name(obj));
    const char *s = is_str ? json_string_value(obj->j) : NULL;
    size_t sn = is_str ? json_string_length(obj->j) : 0;
    long long len = is_str    ? (long long)ct_utf8_len(s, sn)
                    : is_list ? (long long)json_array_size(obj->j)
                              : 0;
    if (rc == 0 && nodes[2]) {
        if (parts[2].kind != CTV_JSON || !json_is_integer(parts[2].j))
            rc = ct_render_errf(st, n, -EINVAL, "slice step must be an integer");
        else if ((step = json_integer_value(parts[2].j)) == 0)
            rc = ct_render_errf(st, n, -EINVAL, "slice step cannot be zero");
    }
    if (rc == 0 && (slice_bound(nodes[0] ? &parts[0] : NULL, len, step, 1, &start) ||
                    slice_bound(nodes[1] ? &parts[1] : NULL, len, step, 0, &stop)))
        rc = ct_render_errf(st, n, -EINVAL, "slice indices must be integers or none");
    ct_buf b = {0};
    json_t *list = is_list && rc == 0 ? json_array() : NULL;
    for (long long i = start; rc == 0 && (step > 0 ? i < stop : i > stop); i += step) {
        if (is_list) {
            json_array_append(list, json_array_get(obj->j, (size_t)i));
        } else {
            size_t o = ct_utf8_offset(s, sn, (size_t)i), e = ct_utf8_offset(s, sn, (size_t)i + 1);
            ct_buf_add(&b, s + o, e - o);
        }
    }
    for (int i = 0; i < 3; i++)
        ctv_drop(&parts[i]);
    if (rc) {
        free(b.p);
        json_decref(list);
        return rc;
    }
    if (is_list) {
        *out = ctv_json(list);
        return 0;
    }
    return ct_take_string(st, n, &b, out);
}

/* A value's size for the work bound: a string's bytes; a list's or dict's items, each weighed
 * as CT_ITEM_WORK bytes (what making one costs, next to copying a byte); else 1. */
static size_t val_size(const ctv *v)
{
    if (v->kind != CTV_JSON && v->kind != CTV_NS)
        return 1;
    if (json_is_string(v->j))
        return json_string_length(v->j) + 1;
    if (json_is_array(v->j))
        return (json_array_size(v->j) + 1) * CT_ITEM_WORK;
    if (json_is_object(v->j))
        return (json_object_size(v->j) + 1) * CT_ITEM_WORK;
    return 1;
}

int ct_charge(ct_state *st, const ct_node *at, size_t units)
{
    st->work += units;
    if (st->work > CT_MAX_WORK)
        return ct_render_errf(st, at, -E2BIG,
                              "more than %u units of work (bytes and items operated on)",
                              CT_MAX_WORK);
    return 0;
}

/* Charges the work of an operation on (or making) v: a render of a big string in a long loop
 * ends here, where the output and step bounds alone would let it run for hours. */
static int charge(ct_state *st, const ct_node *at, const ctv *v)
{
    return ct_charge(st, at, val_size(v));
}

static int charge_args(ct_state *st, const ct_node *at, const ctv *self, const ct_args *a)
{
    int rc = self ? charge(st, at, self) : 0;
    for (size_t i = 0; i < a->n && rc == 0; i++)
        rc = charge(st, at, &a->v[i]);
    return rc;
}

static int call_macro(ct_state *st, const ct_node *at, const ct_node *m, ct_args *a, ctv *out)
{
    if (++st->steps > CT_MAX_STEPS)
        return ct_render_errf(st, at, -E2BIG, "more than %u loop iterations and calls",
                              CT_MAX_STEPS);
    if (st->calls + 1 > CT_MAX_DEPTH)
        return ct_render_errf(st, at, -ELOOP, "macro calls nested deeper than %d", CT_MAX_DEPTH);
    ct_frame fr = {.parent = st->global};
    int rc = 0;
    size_t npos = 0;
    for (size_t i = 0; i < a->n; i++)
        npos += a->kw[i] == NULL;
    if (npos > m->nkids)
        rc = ct_render_errf(st, at, -EINVAL, "macro '%s' takes not more than %zu argument(s)",
                            m->name, m->nkids);
    for (size_t i = 0; i < a->n && rc == 0; i++) {
        if (a->kw[i] == NULL)
            continue;
        int found = 0;
        for (size_t j = 0; j < m->nkids; j++)
            if (!strcmp(m->kids[j]->name, a->kw[i]))
                found = j < npos ? -1 : 1; /* -1: a positional argument gave it already */
        if (found < 0)
            rc = ct_render_errf(st, at, -EINVAL, "macro '%s' got multiple values for '%s'", m->name,
                                a->kw[i]);
        else if (!found)
            rc = ct_render_errf(st, at, -EINVAL, "macro '%s' has no parameter '%s'", m->name,
                                a->kw[i]);
    }
    st->calls++;
    for (size_t j = 0; j < m->nkids && rc == 0; j++) {
        const ct_node *param = m->kids[j];
        ctv v = ctv_undef(param->name);
        int given = 0;
        for (size_t i = 0, pos = 0; i < a->n && !given; i++) {
            if (a->kw[i] ? !strcmp(a->kw[i], param->name) : pos++ == j) {
                v = ctv_copy(&a->v[i]);
                given = 1;
            }
        }
        if (!given && param->a)
            rc = ct_eval(st, &fr, param->a, &v);
        if (rc == 0)
            rc = ct_frame_set(&fr, param->name, v);
    }
    ct_buf b = {0};
    int flow = st->flow;
    if (rc == 0)
        rc = ct_exec(st, &fr, m->b, &b);
    st->flow = flow;
    st->calls--;
    ct_frame_clear(&fr);
    if (rc) {
        free(b.p);
        return rc;
    }
    return ct_take_string(st, at, &b, out);
}

static int eval_call(ct_state *st, ct_frame *f, const ct_node *n, ctv *out)
{
    const ct_node *callee = n->a;
    ctv self = {0}, fn = {0};
    ct_args a;
    int rc;
    if (callee->kind == N_ATTR)
        rc = ct_eval(st, f, callee->a, &self);
    else
        rc = lookup(st, f, callee->name, &fn);
    if (rc)
        return rc;
    if ((rc = args_eval(st, f, n, &a)) != 0)
        goto out;
    rc = charge_args(st, n, callee->kind == N_ATTR ? &self : NULL, &a);
    if (rc == 0 && callee->kind == N_ATTR)
        rc = ct_call_method(st, n, &self, callee->name, &a, out);
    else if (rc == 0 && fn.kind == CTV_MACRO)
        rc = call_macro(st, n, fn.p, &a, out);
    else if (rc == 0 && fn.kind == CTV_FUNC)
        rc = ct_call_builtin(st, n, fn.id, &a, out);
    else if (rc == 0)
        rc = ct_render_errf(st, n, -EINVAL, "'%s' is %s, not a function", callee->name,
                            fn.kind == CTV_UNDEF ? "undefined" : ct_type_name(&fn));
    args_free(&a);
out:
    ctv_drop(&self);
    ctv_drop(&fn);
    return rc;
}

static int eval_list(ct_state *st, ct_frame *f, const ct_node *n, ctv *out)
{
    json_t *c = n->kind == N_LIST ? json_array() : json_object();
    if (c == NULL)
        return ct_render_errf(st, n, -ENOMEM, "out of memory");
    int rc = 0;
    for (size_t i = 0; i < n->nkids && rc == 0; i += n->kind == N_LIST ? 1 : 2) {
        ctv k = {0}, v = {0};
        rc = ct_eval(st, f, n->kids[i], &k);
        if (rc == 0 && n->kind == N_DICT)
            rc = ct_eval(st, f, n->kids[i + 1], &v);
        if (rc == 0 && (k.kind != CTV_JSON || (n->kind == N_DICT && v.kind != CTV_JSON)))
            rc = ct_render_errf(st, n->kids[i], -EINVAL, "a %s cannot go in a list or dict",
                                ct_type_name(k.kind != CTV_JSON ? &k : &v));
        else if (rc == 0 && n->kind == N_DICT && !json_is_string(k.j))
            rc = ct_render_errf(st, n->kids[i], -EINVAL, "dict keys must be strings here");
        else if (rc == 0 && n->kind == N_LIST)
            json_array_append(c, k.j);
        else if (rc == 0)
            json_object_setn(c, json_string_value(k.j), json_string_length(k.j), v.j);
        ctv_drop(&k);
        ctv_drop(&v);
    }
    if (rc == 0 && n->neg)
        rc = ct_mark_tuple(st, c);
    if (rc) {
        json_decref(c);
        return rc;
    }
    *out = ctv_json(c);
    return 0;
}

static int eval_bin(ct_state *st, ct_frame *f, const ct_node *n, ctv *out)
{
    ctv x = {0}, y = {0};
    int rc = ct_eval(st, f, n->a, &x);
    if (rc == 0)
        rc = ct_eval(st, f, n->b, &y);
    if (rc == 0 && (rc = charge(st, n, &x)) == 0)
        rc = charge(st, n, &y);
    if (rc == 0)
        rc = ct_bin_op(st, n, n->op, &x, &y, out);
    ctv_drop(&x);
    ctv_drop(&y);
    return rc;
}

static int eval_filter_test(ct_state *st, ct_frame *f, const ct_node *n, ctv *out)
{
    ctv subject = {0};
    ct_args a;
    int rc = ct_eval(st, f, n->a, &subject);
    if (rc)
        return rc;
    if ((rc = args_eval(st, f, n, &a)) == 0) {
        rc = charge_args(st, n, &subject, &a);
        if (rc == 0 && n->kind == N_FILTER) {
            rc = ct_apply_filter(st, n, n->op, &subject, &a, out);
        } else if (rc == 0) {
            int res = 0;
            rc = ct_apply_test(st, n, n->op, &subject, &a, &res);
            if (rc == 0)
                *out = ctv_json(json_boolean(n->neg ? !res : res));
        }
        args_free(&a);
    }
    ctv_drop(&subject);
    return rc;
}

static int eval_inner(ct_state *st, ct_frame *f, const ct_node *n, ctv *out)
{
    ctv x = {0}, y = {0};
    int rc = 0;
    switch (n->kind) {
    case N_CONST:
        *out = ctv_json(json_incref(n->cst));
        return 0;
    case N_NAME:
        return lookup(st, f, n->name, out);
    case N_ATTR:
        if ((rc = ct_eval(st, f, n->a, &x)) == 0)
            rc = getattr(st, n, &x, n->name, out);
        break;
    case N_ITEM:
        if ((rc = ct_eval(st, f, n->a, &x)) == 0 && (rc = ct_eval(st, f, n->b, &y)) == 0)
            rc = ct_getitem(st, n, &x, &y, out);
        break;
    case N_SLICE:
        if ((rc = ct_eval(st, f, n->a, &x)) == 0)
            rc = eval_slice(st, f, n, &x, out);
        break;
    case N_CALL:
        return eval_call(st, f, n, out);
    case N_FILTER:
    case N_TEST:
        return eval_filter_test(st, f, n, out);
    case N_BIN:
        return eval_bin(st, f, n, out);
    case N_NOT:
        if ((rc = ct_eval(st, f, n->a, &x)) == 0)
            *out = ctv_json(json_boolean(!ct_truthy(&x)));
        break;
    case N_NEG:
        if ((rc = ct_eval(st, f, n->a, &x)) == 0) {
            ctv zero = ctv_json(json_integer(0));
            rc = ct_bin_op(st, n, n->op ? OP_ADD : OP_SUB, &zero, &x, out);
            ctv_drop(&zero);
        }
        break;
    case N_AND:
    case N_OR: /* Python's: the deciding operand itself */
        if ((rc = ct_eval(st, f, n->a, &x)) != 0)
            break;
        if (ct_truthy(&x) == (n->kind == N_OR)) {
            *out = x;
            return 0;
        }
        rc = ct_eval(st, f, n->b, out);
        break;
    case N_COND:
        if ((rc = ct_eval(st, f, n->a, &x)) != 0)
            break;
        if (ct_truthy(&x))
            rc = ct_eval(st, f, n->b, out);
        else if (n->c)
            rc = ct_eval(st, f, n->c, out);
        else
            *out = ctv_undef(NULL);
        break;
    case N_LIST:
    case N_DICT:
        return eval_list(st, f, n, out);
    default:
        return ct_render_errf(st, n, -EINVAL, "not an expression");
    }
    ctv_drop(&x);
    ctv_drop(&y);
    return rc;
}

int ct_eval(ct_state *st, ct_frame *f, const ct_node *n, ctv *out)
{
    *out = ctv_undef(NULL);
    if (st->depth + 1 > CT_MAX_DEPTH * 8)
        return ct_render_errf(st, n, -ELOOP, "expression nested too deep");
    st->depth++;
    int rc = eval_inner(st, f, n, out);
    st->depth--;
    if (rc == 0 && (n->kind == N_BIN || n->kind == N_FILTER || n->kind == N_CALL ||
                    n->kind == N_SLICE || n->kind == N_LIST || n->kind == N_DICT))
        rc = charge(st, n, out); /* what it made */
    if (rc)
        ctv_drop(out);
    return rc;
}

/* ---------------------------------------------------------------------------- statements */

static int bind_targets(ct_state *st, const ct_node *n, ct_frame *fr, json_t *item)
{
    if (n->name2 == NULL)
        return ct_frame_set(fr, n->name, ctv_json(json_incref(item)));
    if (!json_is_array(item) || json_array_size(item) != 2)
        return ct_render_errf(st, n, -EINVAL, "cannot unpack a %s into two loop variables",
                              json_is_array(item) ? "list not of two" : "non-pair");
    int rc = ct_frame_set(fr, n->name, ctv_json(json_incref(json_array_get(item, 0))));
    return rc ? rc : ct_frame_set(fr, n->name2, ctv_json(json_incref(json_array_get(item, 1))));
}

/* The loop's items, after its "if" filter (which loop.length and loop.last count). */
static int for_items(ct_state *st, ct_frame *f, const ct_node *n, json_t **items)
{
    ctv it = {0};
    int rc = ct_eval(st, f, n->a, &it);
    if (rc == 0)
        rc = ct_iter_list(st, n, &it, items);
    if (rc == 0 && (rc = charge(st, n, &(ctv){CTV_JSON, *items, NULL, 0})) != 0)
        json_decref(*items);
    ctv_drop(&it);
    if (rc || n->b == NULL)
        return rc;
    json_t *kept = json_array();
    for (size_t i = 0; i < json_array_size(*items) && rc == 0; i++) {
        ct_frame fr = {.parent = f};
        ctv c = {0};
        json_t *item = json_array_get(*items, i);
        if ((rc = bind_targets(st, n, &fr, item)) == 0 && (rc = ct_eval(st, &fr, n->b, &c)) == 0)
            if (ct_truthy(&c))
                json_array_append(kept, item);
        ctv_drop(&c);
        ct_frame_clear(&fr);
    }
    json_decref(*items);
    *items = kept;
    if (rc)
        json_decref(kept);
    return rc;
}

static int exec_for(ct_state *st, ct_frame *f, const ct_node *n, ct_buf *out)
{
    json_t *items = NULL;
    int rc = for_items(st, f, n, &items);
    if (rc)
        return rc;
    ct_loop loop = {.items = items};
    size_t len = json_array_size(items);
    /* Jinja2 runs the else block unless some iteration reached the end of the body: one that
       broke or continued does not count (its generated code clears the flag there) */
    int body_ended = 0;
    for (size_t i = 0; i < len && rc == 0; i++) {
        if (++st->steps > CT_MAX_STEPS) {
            rc = ct_render_errf(st, n, -E2BIG, "more than %u loop iterations and calls",
                                CT_MAX_STEPS);
            break;
        }
        ct_frame fr = {.parent = f};
        loop.index0 = i;
        rc = ct_frame_set(&fr, "loop", (ctv){CTV_LOOP, NULL, &loop, 0});
        if (rc == 0)
            rc = bind_targets(st, n, &fr, json_array_get(items, i));
        if (rc == 0)
            rc = ct_exec(st, &fr, n->c, out);
        ct_frame_clear(&fr);
        int flow = st->flow;
        st->flow = 0;
        body_ended = body_ended || flow == 0;
        if (flow == 1)
            break;
    }
    if (rc == 0 && !body_ended && n->d) {
        ct_frame fr = {.parent = f};
        rc = ct_exec(st, &fr, n->d, out);
        ct_frame_clear(&fr);
    }
    json_decref(items);
    return rc;
}

static int exec_set(ct_state *st, ct_frame *f, const ct_node *n, ct_buf *out)
{
    (void)out;
    ctv v = {0};
    int rc;
    if (n->a) {
        rc = ct_eval(st, f, n->a, &v);
    } else {
        ct_buf b = {0};
        rc = ct_exec(st, f, n->c, &b);
        if (rc == 0)
            rc = ct_take_string(st, n, &b, &v);
        else
            free(b.p);
    }
    if (rc)
        return rc;
    if (n->name2 == NULL)
        return ct_frame_set(f, n->name, v);
    const ctv *ns = frame_find(f, n->name);
    if (ns == NULL || ns->kind != CTV_NS)
        rc = ct_render_errf(st, n, -EINVAL, "cannot assign attribute on non-namespace '%s'",
                            n->name);
    else if (v.kind == CTV_UNDEF) /* reads back as undefined, as Jinja2's stored Undefined */
        json_object_del(ns->j, n->name2);
    else if (v.kind != CTV_JSON)
        rc = ct_render_errf(st, n, -EINVAL, "a %s cannot be stored in a namespace",
                            ct_type_name(&v));
    else
        rc = json_object_set(ns->j, n->name2, v.j) ? ct_render_errf(st, n, -ENOMEM, "out of memory")
                                                   : 0;
    ctv_drop(&v);
    return rc;
}

int ct_exec(ct_state *st, ct_frame *f, const ct_node *n, ct_buf *out)
{
    ctv v = {0};
    int rc = 0;
    switch (n->kind) {
    case N_BODY:
        for (size_t i = 0; i < n->nkids && rc == 0 && st->flow == 0; i++)
            rc = ct_exec(st, f, n->kids[i], out);
        return rc;
    case N_TEXT:
        return ct_out(st, out, json_string_value(n->cst), json_string_length(n->cst));
    case N_OUTPUT: {
        if ((rc = ct_eval(st, f, n->a, &v)) != 0)
            return rc;
        ct_buf b = {0};
        if (ct_val_str(&st->tuples, &b, &v) != 0)
            rc = ct_render_errf(st, n, -EINVAL, "cannot print a %s", ct_type_name(&v));
        else if (b.oom)
            rc = ct_render_errf(st, n, -ENOMEM, "out of memory");
        else
            rc = ct_out(st, out, b.p, b.n);
        free(b.p);
        ctv_drop(&v);
        return rc;
    }
    case N_IF:
        if ((rc = ct_eval(st, f, n->a, &v)) != 0)
            return rc;
        rc = ct_truthy(&v) ? ct_exec(st, f, n->b, out) : n->c ? ct_exec(st, f, n->c, out) : 0;
        ctv_drop(&v);
        return rc;
    case N_FOR:
        return exec_for(st, f, n, out);
    case N_SET:
        return exec_set(st, f, n, out);
    case N_MACRO:
        return ct_frame_set(f, n->name, (ctv){CTV_MACRO, NULL, n, 0});
    case N_BREAK:
        st->flow = 1;
        return 0;
    case N_CONTINUE:
        st->flow = 2;
        return 0;
    default:
        return ct_render_errf(st, n, -EINVAL, "not a statement");
    }
}
