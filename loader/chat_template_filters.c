/* chat_template_filters.c — the Jinja2 filters and tests of the chat-template subset, each as
 * Jinja 3.1 defines it (jinja2/filters.py, jinja2/tests.py), with HF's tojson (json.dumps with
 * ensure_ascii=False and the indent asked for). A filter or test outside these tables is refused
 * when the template is parsed. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "loader/chat_template_internal.h"

int ct_strip(const char *s, size_t n, const char *chars, size_t nchars, int left, int right,
             size_t *start, size_t *end);
int ct_str_replace(ct_state *st, const ct_node *at, const ctv *s, const ctv *old, const ctv *new,
                   long long count, ctv *out);
int ct_str_case(ct_state *st, const ct_node *at, const char *how, const char *s, size_t n,
                ctv *out);

typedef int (*filter_fn)(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out);

static int is_str(const ctv *v)
{
    return v->kind == CTV_JSON && json_is_string(v->j);
}
static int is_int(const ctv *v)
{
    return v->kind == CTV_JSON && (json_is_integer(v->j) || json_is_boolean(v->j));
}

/* The argument named kw, else the pos-th positional one, else NULL. */
static const ctv *arg(const ct_args *a, size_t pos, const char *kw)
{
    size_t k = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->kw[i] ? kw && !strcmp(a->kw[i], kw) : k++ == pos)
            return &a->v[i];
    }
    return NULL;
}

static int max_args(ct_state *st, const ct_node *at, const ct_args *a, size_t n)
{
    if (a->n > n)
        return ct_render_errf(st, at, -EINVAL, "filter '%s' takes at most %zu argument(s)",
                              at->name, n);
    return 0;
}

/* soft_str: the value as str() gives it (undefined: ""). */
static int to_str(ct_state *st, const ct_node *at, const ctv *v, ctv *out)
{
    if (is_str(v)) {
        *out = ctv_copy(v);
        return 0;
    }
    ct_buf b = {0};
    if (ct_val_str(&st->tuples, &b, v)) {
        free(b.p);
        return ct_render_errf(st, at, -EINVAL, "cannot make a str of a %s", ct_type_name(v));
    }
    return ct_take_string(st, at, &b, out);
}

static int f_trim(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    ctv s;
    int rc = max_args(st, at, a, 1);
    if (rc || (rc = to_str(st, at, v, &s)))
        return rc;
    const ctv *chars = arg(a, 0, "chars");
    if (chars && !is_str(chars) && !(chars->kind == CTV_JSON && json_is_null(chars->j))) {
        ctv_drop(&s);
        return ct_render_errf(st, at, -EINVAL, "trim chars must be a str");
    }
    chars = chars && is_str(chars) ? chars : NULL;
    size_t b, e;
    ct_strip(json_string_value(s.j), json_string_length(s.j),
             chars ? json_string_value(chars->j) : NULL, chars ? json_string_length(chars->j) : 0,
             1, 1, &b, &e);
    *out = ctv_json(json_stringn_nocheck(json_string_value(s.j) + b, e - b));
    ctv_drop(&s);
    return 0;
}

static int f_tojson(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    const ctv *ind = arg(a, 1, "indent"), *ascii = arg(a, 0, "ensure_ascii");
    const ctv *seps = arg(a, 2, "separators"), *sort = arg(a, 3, "sort_keys");
    int indent = -1;
    if ((ascii && ct_truthy(ascii)) || (sort && ct_truthy(sort)) ||
        (seps && !(seps->kind == CTV_JSON && json_is_null(seps->j))))
        return ct_render_errf(st, at, -EINVAL,
                              "tojson: only indent is supported (ensure_ascii, separators and "
                              "sort_keys keep their defaults)");
    if (ind && !(ind->kind == CTV_JSON && json_is_null(ind->j))) {
        if (!is_int(ind) || json_integer_value(ind->j) < 0 || json_integer_value(ind->j) > 64)
            return ct_render_errf(st, at, -EINVAL, "tojson: indent must be an integer 0..64");
        indent = (int)json_integer_value(ind->j);
    }
    if (v->kind != CTV_JSON)
        return ct_render_errf(st, at, -EINVAL, "Object of type %s is not JSON serializable",
                              v->kind == CTV_UNDEF ? "Undefined" : ct_type_name(v));
    ct_buf b = {0};
    if (ct_json_dumps(&b, v->j, indent, 0)) {
        free(b.p);
        return ct_render_errf(st, at, -ELOOP, "tojson: value nested too deep");
    }
    return ct_take_string(st, at, &b, out);
}

static int f_length(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int rc = max_args(st, at, a, 0);
    if (rc)
        return rc;
    long long n;
    if (v->kind == CTV_UNDEF)
        n = 0;
    else if (is_str(v))
        n = (long long)ct_utf8_len(json_string_value(v->j), json_string_length(v->j));
    else if (v->kind == CTV_JSON && json_is_array(v->j))
        n = (long long)json_array_size(v->j);
    else if (v->kind == CTV_JSON && json_is_object(v->j))
        n = (long long)json_object_size(v->j);
    else if (v->kind == CTV_GEN && v->id == CT_GEN_DICT_VIEW)
        n = (long long)json_array_size(v->j);
    else
        return ct_render_errf(st, at, -EINVAL, "object of type '%s' has no len()", ct_type_name(v));
    *out = ctv_json(json_integer(n));
    return 0;
}

static int f_case(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    ctv s;
    int rc = max_args(st, at, a, 0);
    if (rc || (rc = to_str(st, at, v, &s)))
        return rc;
    const char *how = strcmp(at->name, "title") == 0 ? "jtitle" : at->name;
    rc = ct_str_case(st, at, how, json_string_value(s.j), json_string_length(s.j), out);
    ctv_drop(&s);
    return rc;
}

static int f_default(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int rc = max_args(st, at, a, 2);
    if (rc)
        return rc;
    const ctv *d = arg(a, 0, "default_value"), *boolean = arg(a, 1, "boolean");
    int use = v->kind == CTV_UNDEF || (boolean && ct_truthy(boolean) && !ct_truthy(v));
    if (!use)
        *out = ctv_copy(v);
    else
        *out = d ? ctv_copy(d) : ctv_json(json_string(""));
    return 0;
}

static int f_items(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int rc = max_args(st, at, a, 0);
    if (rc)
        return rc;
    if (v->kind == CTV_UNDEF) {
        *out = (ctv){CTV_GEN, json_array(), NULL, CT_GEN_GENERATOR};
        return 0;
    }
    if (v->kind != CTV_JSON || !json_is_object(v->j))
        return ct_render_errf(st, at, -EINVAL, "can only get item pairs from a mapping");
    json_t *l = json_array();
    const char *k;
    json_t *x;
    json_object_foreach(v->j, k, x)
    {
        json_t *pair = json_pack("[sO]", k, x);
        if (pair == NULL || json_array_append_new(l, pair) || ct_mark_tuple(st, pair)) {
            json_decref(l);
            return ct_render_errf(st, at, -ENOMEM, "out of memory");
        }
    }
    *out = (ctv){CTV_GEN, l, NULL, CT_GEN_GENERATOR};
    return 0;
}

/* Jinja2's attribute lookup for filters: "a.b" walks getitem, so a dict's key or a list's index. */
static int attr_of(ct_state *st, const ct_node *at, const ctv *item, const ctv *attr, ctv *out)
{
    if (!is_str(attr))
        return ct_getitem(st, at, item, attr, out);
    const char *s = json_string_value(attr->j);
    ctv cur = ctv_copy(item);
    for (;;) {
        const char *dot = strchr(s, '.');
        size_t n = dot ? (size_t)(dot - s) : strlen(s);
        ctv key = ctv_json(json_stringn_nocheck(s, n)), next;
        int all_digits = n > 0;
        for (size_t i = 0; i < n; i++)
            all_digits = all_digits && s[i] >= '0' && s[i] <= '9';
        if (all_digits) {
            ctv_drop(&key);
            key = ctv_json(json_integer(strtoll(s, NULL, 10)));
        }
        int rc = cur.kind == CTV_UNDEF ? (next = ctv_undef(NULL), 0)
                                       : ct_getitem(st, at, &cur, &key, &next);
        ctv_drop(&key);
        ctv_drop(&cur);
        if (rc)
            return rc;
        cur = next;
        if (dot == NULL)
            break;
        s = dot + 1;
    }
    *out = cur;
    return 0;
}

/* select / reject / selectattr / rejectattr: keep the items the test (or truth) picks. */
static int f_select(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int by_attr = strstr(at->name, "attr") != NULL, reject = at->name[0] == 'r';
    size_t first = by_attr ? 1 : 0;
    if (by_attr && (a->n < 1 || a->kw[0]))
        return ct_render_errf(st, at, -EINVAL, "%s needs an attribute name", at->name);
    for (size_t i = 0; i < a->n; i++)
        if (a->kw[i])
            return ct_render_errf(st, at, -EINVAL, "%s takes no keyword arguments", at->name);
    int test = -1;
    if (a->n > first) {
        if (!is_str(&a->v[first]) || (test = ct_test_index(json_string_value(a->v[first].j))) < 0)
            return ct_render_errf(st, at, -EINVAL, "%s: test '%s' is not supported", at->name,
                                  is_str(&a->v[first]) ? json_string_value(a->v[first].j) : "?");
    }
    json_t *items;
    int rc = ct_iter_list(st, at, v, &items);
    if (rc)
        return rc;
    json_t *kept = json_array();
    ct_args rest = {a->v + first + 1, a->kw + first + 1, a->n > first + 1 ? a->n - first - 1 : 0};
    for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
        ctv item = ctv_json(json_incref(json_array_get(items, i))), x;
        rc = by_attr ? attr_of(st, at, &item, &a->v[0], &x) : (x = ctv_copy(&item), 0);
        int res = 0;
        if (rc == 0 && test >= 0)
            rc = ct_apply_test(st, at, test, &x, &rest, &res);
        else if (rc == 0)
            res = ct_truthy(&x);
        if (rc == 0 && res != reject)
            json_array_append(kept, item.j);
        ctv_drop(&item);
        ctv_drop(&x);
    }
    json_decref(items);
    if (rc) {
        json_decref(kept);
        return rc;
    }
    *out = (ctv){CTV_GEN, kept, NULL, CT_GEN_GENERATOR};
    return 0;
}

static int f_map(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    const ctv *attr = arg(a, 99, "attribute"), *dflt = arg(a, 99, "default");
    int filter = -1;
    if (attr == NULL) {
        if (a->n < 1 || a->kw[0] || !is_str(&a->v[0]) ||
            (filter = ct_filter_index(json_string_value(a->v[0].j))) < 0)
            return ct_render_errf(st, at, -EINVAL, "map needs attribute= or a known filter name");
    }
    json_t *items;
    int rc = ct_iter_list(st, at, v, &items);
    if (rc)
        return rc;
    json_t *res = json_array();
    ct_args rest = {a->n ? a->v + 1 : NULL, a->n ? a->kw + 1 : NULL, a->n ? a->n - 1 : 0};
    ct_node sub = *at;
    if (filter >= 0)
        sub.name = (char *)json_string_value(a->v[0].j);
    for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
        ctv item = ctv_json(json_incref(json_array_get(items, i))), x = {0};
        if (attr) {
            rc = attr_of(st, at, &item, attr, &x);
            if (rc == 0 && x.kind == CTV_UNDEF && dflt)
                x = ctv_copy(dflt);
        } else {
            rc = ct_apply_filter(st, &sub, filter, &item, &rest, &x);
        }
        if (rc == 0 && x.kind != CTV_JSON)
            rc = ct_render_errf(st, at, -EINVAL, "map: an item maps to %s", ct_type_name(&x));
        if (rc == 0)
            json_array_append(res, x.j);
        ctv_drop(&item);
        ctv_drop(&x);
    }
    json_decref(items);
    if (rc) {
        json_decref(res);
        return rc;
    }
    *out = (ctv){CTV_GEN, res, NULL, CT_GEN_GENERATOR};
    return 0;
}

static int f_first_last(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    json_t *items;
    int rc = max_args(st, at, a, 0);
    if (rc == 0 && at->name[0] == 'l' && v->kind == CTV_GEN && v->id == CT_GEN_GENERATOR)
        return ct_render_errf(st, at, -EINVAL, "'generator' object is not reversible");
    if (rc || (rc = ct_iter_list(st, at, v, &items)))
        return rc;
    size_t n = json_array_size(items);
    json_t *x = n ? json_array_get(items, at->name[0] == 'f' ? 0 : n - 1) : NULL;
    *out = x ? ctv_json(json_incref(x)) : ctv_undef(NULL);
    json_decref(items);
    return 0;
}

static int f_join(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    const ctv *sep = arg(a, 0, "d"), *attr = arg(a, 1, "attribute");
    int rc = max_args(st, at, a, 2);
    json_t *items;
    if (rc || (rc = ct_iter_list(st, at, v, &items)))
        return rc;
    ct_buf b = {0};
    for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
        ctv item = ctv_json(json_incref(json_array_get(items, i))), x = {0};
        if (i && sep && ct_val_str(&st->tuples, &b, sep))
            rc = ct_render_errf(st, at, -EINVAL, "join separator is a %s", ct_type_name(sep));
        if (rc == 0)
            rc = attr ? attr_of(st, at, &item, attr, &x) : (x = ctv_copy(&item), 0);
        if (rc == 0 && ct_val_str(&st->tuples, &b, &x))
            rc = ct_render_errf(st, at, -EINVAL, "cannot join a %s", ct_type_name(&x));
        if (rc == 0 && b.n > CT_MAX_OUTPUT)
            rc = ct_render_errf(st, at, -E2BIG, "string longer than %u bytes", CT_MAX_OUTPUT);
        ctv_drop(&item);
        ctv_drop(&x);
    }
    json_decref(items);
    if (rc) {
        free(b.p);
        return rc;
    }
    return ct_take_string(st, at, &b, out);
}

static int f_replace(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    const ctv *old = arg(a, 0, "old"), *new = arg(a, 1, "new"), *count = arg(a, 2, "count");
    ctv s;
    int rc = max_args(st, at, a, 3);
    if (rc)
        return rc;
    if (old == NULL || new == NULL || (count && !is_int(count) && !json_is_null(count->j)))
        return ct_render_errf(st, at, -EINVAL, "replace takes old, new[, count]");
    if ((rc = to_str(st, at, v, &s)))
        return rc;
    long long n = count && is_int(count) ? json_integer_value(count->j) : -1;
    rc = ct_str_replace(st, at, &s, old, new, n, out);
    ctv_drop(&s);
    return rc;
}

static int f_string(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int rc = max_args(st, at, a, 0);
    return rc ? rc : to_str(st, at, v, out);
}

/* Whether t (stripped) is a number as Python's int()/float() read it: 1 a plain decimal one, 0
 * one they refuse too, -1 one only Python reads (underscores, non-ASCII digits, inf, nan). */
static int number_syntax(const char *t)
{
    const char *p = t + (*t == '+' || *t == '-');
    if (strcasecmp(p, "inf") == 0 || strcasecmp(p, "infinity") == 0 || strcasecmp(p, "nan") == 0)
        return -1;
    for (const char *c = t; *c; c++)
        if (*c == '_' || (unsigned char)*c >= 0x80)
            return -1;
    size_t digits = 0;
    while (*p >= '0' && *p <= '9')
        p++, digits++;
    if (*p == '.')
        for (p++; *p >= '0' && *p <= '9'; p++)
            digits++;
    if (digits == 0)
        return 0;
    if (*p == 'e' || *p == 'E') {
        p += 1 + (p[1] == '+' || p[1] == '-');
        if (!(*p >= '0' && *p <= '9'))
            return 0;
        while (*p >= '0' && *p <= '9')
            p++;
    }
    return *p == '\0';
}

static int f_number(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int want_int = at->name[0] == 'i';
    const ctv *dflt = arg(a, 0, "default");
    int rc = max_args(st, at, a, 1);
    if (rc)
        return rc;
    if (v->kind == CTV_UNDEF) /* int(Undefined) raises in Jinja2, past the filter's default */
        return ct_render_errf(st, at, -EINVAL, "'%s' is undefined",
                              v->p ? (const char *)v->p : "value");
    double d = 0;
    int ok = 0;
    if (v->kind == CTV_JSON && (json_is_number(v->j) || json_is_boolean(v->j))) {
        d = json_is_boolean(v->j) ? json_is_true(v->j) : json_number_value(v->j);
        ok = 1;
        if (want_int && json_is_integer(v->j)) {
            *out = ctv_copy(v);
            return 0;
        }
    } else if (is_str(v)) {
        const char *s = json_string_value(v->j);
        char *end;
        size_t b, e;
        ct_strip(s, json_string_length(v->j), NULL, 0, 1, 1, &b, &e);
        char *t = strndup(s + b, e - b);
        if (t == NULL)
            return ct_render_errf(st, at, -ENOMEM, "out of memory");
        int syntax = number_syntax(t);
        if (syntax < 0) {
            free(t);
            return ct_render_errf(st, at, -EINVAL, "%s of this text is not supported", at->name);
        }
        if (syntax == 0)
            t[0] = '\0'; /* Python refuses it: the default */
        if (want_int) {
            errno = 0;
            long long x = strtoll(t, &end, 10);
            ok = *t && *end == '\0' && errno == 0;
            if (ok) {
                free(t);
                *out = ctv_json(json_integer(x));
                return 0;
            }
        }
        d = strtod(t, &end);
        ok = *t && *end == '\0' && isfinite(d);
        free(t);
    }
    if (!ok) {
        *out = dflt       ? ctv_copy(dflt)
               : want_int ? ctv_json(json_integer(0))
                          : ctv_json(json_real(0));
        return 0;
    }
    if (want_int && (d >= 9.2e18 || d <= -9.2e18))
        return ct_render_errf(st, at, -ERANGE, "int out of range");
    *out = want_int ? ctv_json(json_integer((long long)d)) : ctv_json(json_real(d));
    return 0;
}

static int f_list(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    json_t *items;
    int rc = max_args(st, at, a, 0);
    if (rc || (rc = ct_iter_list(st, at, v, &items)))
        return rc;
    *out = ctv_json(json_copy(items));
    json_decref(items);
    return 0;
}

static int f_reverse(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    json_t *items;
    int rc = max_args(st, at, a, 0);
    if (rc || (rc = ct_iter_list(st, at, v, &items)))
        return rc;
    json_t *r = json_array();
    for (size_t i = json_array_size(items); i-- > 0;)
        json_array_append(r, json_array_get(items, i));
    json_decref(items);
    if (!is_str(v)) { /* reversed(): an iterator; a generator, which reversed() refuses: a list */
        *out = v->kind == CTV_GEN && v->id == CT_GEN_GENERATOR
                   ? ctv_json(r)
                   : (ctv){CTV_GEN, r, NULL, CT_GEN_GENERATOR};
        return 0;
    }
    ct_buf b = {0};
    for (size_t i = 0; i < json_array_size(r); i++)
        ct_buf_add(&b, json_string_value(json_array_get(r, i)),
                   json_string_length(json_array_get(r, i)));
    json_decref(r);
    return ct_take_string(st, at, &b, out);
}

static int f_abs(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int rc = max_args(st, at, a, 0);
    if (rc)
        return rc;
    if (is_int(v)) {
        long long x = json_is_integer(v->j) ? json_integer_value(v->j) : json_is_true(v->j);
        if (x == (-9223372036854775807LL - 1))
            return ct_render_errf(st, at, -ERANGE, "integer overflow");
        *out = ctv_json(json_integer(x < 0 ? -x : x));
    } else if (v->kind == CTV_JSON && json_is_real(v->j)) {
        *out = ctv_json(json_real(fabs(json_real_value(v->j))));
    } else {
        return ct_render_errf(st, at, -EINVAL, "bad operand type for abs(): '%s'", ct_type_name(v));
    }
    return 0;
}

static int f_safe(ct_state *st, const ct_node *at, ctv *v, ct_args *a, ctv *out)
{
    int rc = max_args(st, at, a, 0);
    if (rc == 0)
        *out = ctv_copy(v); /* no autoescape here, so safe changes nothing */
    return rc;
}

/* Each filter with the keyword arguments it takes (Jinja's names, space-separated). */
static const struct {
    const char *name;
    filter_fn fn;
    const char *kws;
} filters[] = {
    {"trim", f_trim, "chars"},
    {"tojson", f_tojson, "ensure_ascii indent separators sort_keys"},
    {"length", f_length, ""},
    {"count", f_length, ""},
    {"upper", f_case, ""},
    {"lower", f_case, ""},
    {"capitalize", f_case, ""},
    {"title", f_case, ""},
    {"default", f_default, "default_value boolean"},
    {"d", f_default, "default_value boolean"},
    {"items", f_items, ""},
    {"selectattr", f_select, ""},
    {"rejectattr", f_select, ""},
    {"select", f_select, ""},
    {"reject", f_select, ""},
    {"map", f_map, "attribute default"},
    {"first", f_first_last, ""},
    {"last", f_first_last, ""},
    {"join", f_join, "d attribute"},
    {"replace", f_replace, "old new count"},
    {"string", f_string, ""},
    {"int", f_number, "default"},
    {"float", f_number, "default"},
    {"list", f_list, ""},
    {"reverse", f_reverse, ""},
    {"abs", f_abs, ""},
    {"safe", f_safe, ""},
};

int ct_filter_index(const char *name)
{
    for (size_t i = 0; i < sizeof filters / sizeof filters[0]; i++)
        if (strcmp(name, filters[i].name) == 0)
            return (int)i;
    return -1;
}

int ct_apply_filter(ct_state *st, const ct_node *at, int idx, ctv *subject, ct_args *a, ctv *out)
{
    ct_node named = *at;
    named.name = (char *)filters[idx].name; /* "count" is "length", "d" is "default" */
    if (!strcmp(named.name, "d"))
        named.name = (char *)"default";
    for (size_t i = 0; i < a->n; i++) {
        if (a->v[i].kind != CTV_JSON && a->v[i].kind != CTV_UNDEF)
            return ct_render_errf(st, at, -EINVAL, "filter '%s' got a %s argument", named.name,
                                  ct_type_name(&a->v[i]));
        if (a->kw[i] == NULL)
            continue;
        const char *k = filters[idx].kws, *hit = NULL;
        size_t n = strlen(a->kw[i]);
        while ((k = strstr(k, a->kw[i])) != NULL && hit == NULL) {
            if ((k == filters[idx].kws || k[-1] == ' ') && (k[n] == ' ' || k[n] == '\0'))
                hit = k;
            k += n;
        }
        if (hit == NULL)
            return ct_render_errf(st, at, -EINVAL, "filter '%s' takes no keyword argument '%s'",
                                  named.name, a->kw[i]);
    }
    return filters[idx].fn(st, &named, subject, a, out);
}

/* --------------------------------------------------------------------------------- tests */

static const char *const tests[] = {
    "defined", "undefined", "none",  "string",  "number",   "integer",     "float",
    "boolean", "true",      "false", "mapping", "iterable", "sequence",    "equalto",
    "eq",      "ne",        "in",    "odd",     "even",     "divisibleby", "lower",
    "upper",   "gt",        "lt",    "ge",      "le",       "sameas",      NULL};

int ct_test_index(const char *name)
{
    for (int i = 0; tests[i]; i++)
        if (strcmp(name, tests[i]) == 0)
            return i;
    return -1;
}

static int test_compare(ct_state *st, const ct_node *at, const char *name, ctv *v, ct_args *a,
                        int *res)
{
    static const struct {
        const char *name;
        int op;
    } ops[] = {{"equalto", OP_EQ}, {"eq", OP_EQ}, {"ne", OP_NE}, {"in", OP_IN},
               {"gt", OP_GT},      {"lt", OP_LT}, {"ge", OP_GE}, {"le", OP_LE}};
    if (a->n != 1)
        return ct_render_errf(st, at, -EINVAL, "test '%s' takes one argument", name);
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        if (strcmp(name, ops[i].name) != 0)
            continue;
        ctv r;
        int rc = ct_bin_op(st, at, ops[i].op, v, &a->v[0], &r);
        if (rc)
            return rc;
        *res = ct_truthy(&r);
        ctv_drop(&r);
        return 0;
    }
    return ct_render_errf(st, at, -EINVAL, "test '%s' is not supported", name);
}

static int test_number(ct_state *st, const ct_node *at, const char *name, ctv *v, ct_args *a,
                       int *res)
{
    if (!strcmp(name, "divisibleby") ? a->n != 1 : a->n != 0)
        return ct_render_errf(st, at, -EINVAL, "wrong arguments for test '%s'", name);
    if (!is_int(v) || (a->n && !is_int(&a->v[0])))
        return ct_render_errf(st, at, -EINVAL, "test '%s' needs integers", name);
    long long x = json_is_integer(v->j) ? json_integer_value(v->j) : json_is_true(v->j);
    if (name[0] == 'd') {
        long long y =
            json_is_integer(a->v[0].j) ? json_integer_value(a->v[0].j) : json_is_true(a->v[0].j);
        if (y == 0)
            return ct_render_errf(st, at, -EDOM, "division by zero");
        *res = y == -1 || x % y == 0;
    } else {
        *res = (x % 2 != 0) == (name[0] == 'o');
    }
    return 0;
}

static int test_type(const char *name, const ctv *v, int *res)
{
    int j = v->kind == CTV_JSON;
    json_type t = j ? json_typeof(v->j) : JSON_NULL;
    if (!strcmp(name, "defined"))
        *res = v->kind != CTV_UNDEF;
    else if (!strcmp(name, "undefined"))
        *res = v->kind == CTV_UNDEF;
    else if (!strcmp(name, "none"))
        *res = j && t == JSON_NULL;
    else if (!strcmp(name, "string"))
        *res = j && t == JSON_STRING;
    else if (!strcmp(name, "number")) /* Python's bool is a Number */
        *res = j && (t == JSON_INTEGER || t == JSON_REAL || t == JSON_TRUE || t == JSON_FALSE);
    else if (!strcmp(name, "integer"))
        *res = j && t == JSON_INTEGER;
    else if (!strcmp(name, "float"))
        *res = j && t == JSON_REAL;
    else if (!strcmp(name, "boolean"))
        *res = j && (t == JSON_TRUE || t == JSON_FALSE);
    else if (!strcmp(name, "true"))
        *res = j && t == JSON_TRUE;
    else if (!strcmp(name, "false"))
        *res = j && t == JSON_FALSE;
    else if (!strcmp(name, "mapping"))
        *res = j && t == JSON_OBJECT;
    else if (!strcmp(name, "iterable") || !strcmp(name, "sequence")) /* Undefined is both */
        *res = v->kind == CTV_UNDEF || v->kind == CTV_LOOP ||
               (name[0] == 'i' && v->kind == CTV_GEN) ||
               (j && (t == JSON_STRING || t == JSON_ARRAY || t == JSON_OBJECT));
    else
        return -ENOENT;
    return 0;
}

int ct_apply_test(ct_state *st, const ct_node *at, int idx, ctv *subject, ct_args *a, int *res)
{
    const char *name = tests[idx];
    for (size_t i = 0; i < a->n; i++)
        if (a->kw[i])
            return ct_render_errf(st, at, -EINVAL, "test '%s' takes no keyword arguments", name);
    if (test_type(name, subject, res) == 0) {
        if (a->n)
            return ct_render_errf(st, at, -EINVAL, "test '%s' takes no arguments", name);
        return 0;
    }
    if (!strcmp(name, "odd") || !strcmp(name, "even") || !strcmp(name, "divisibleby"))
        return test_number(st, at, name, subject, a, res);
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) { /* str(value).islower() */
        ctv sv;
        int rc = a->n ? ct_render_errf(st, at, -EINVAL, "test '%s' takes no arguments", name)
                      : to_str(st, at, subject, &sv);
        if (rc)
            return rc;
        const char *s = json_string_value(sv.j);
        int cased = 0, ok = 1;
        for (size_t i = 0; i < json_string_length(sv.j) && rc == 0; i++) {
            unsigned char c = (unsigned char)s[i];
            if (c >= 0x80)
                rc = ct_render_errf(st, at, -EINVAL, "test '%s' of non-ASCII text", name);
            int lo = c >= 'a' && c <= 'z', up = c >= 'A' && c <= 'Z';
            cased = cased || lo || up;
            ok = ok && !(name[0] == 'l' ? up : lo);
        }
        ctv_drop(&sv);
        *res = cased && ok;
        return rc;
    }
    if (!strcmp(name, "sameas")) {
        if (a->n != 1)
            return ct_render_errf(st, at, -EINVAL, "test 'sameas' takes one argument");
        /* "is": only the singletons None, True and False are safe to answer */
        const ctv *o = &a->v[0];
        if (!(o->kind == CTV_JSON && (json_is_null(o->j) || json_is_boolean(o->j))))
            return ct_render_errf(st, at, -EINVAL, "'sameas' only with none, true or false");
        *res = subject->kind == CTV_JSON && json_typeof(subject->j) == json_typeof(o->j);
        return 0;
    }
    return test_compare(st, at, name, subject, a, res);
}
