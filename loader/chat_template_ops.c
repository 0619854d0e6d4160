/* chat_template_ops.c — what the chat-template evaluator does to values, with Python's and
 * Jinja2's semantics: the binary operators (+ - * / // % ** ~, comparisons, in), subscripts,
 * iteration, the str and dict methods templates call (.strip(), .split(), .items(), .get(), ...)
 * and the builtins (raise_exception, strftime_now, namespace, range). A type Python would refuse
 * is an error here too, never a guess. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "loader/chat_template_internal.h"

static int is_int(const ctv *v)
{
    return v->kind == CTV_JSON && (json_is_integer(v->j) || json_is_boolean(v->j));
}
static int is_num(const ctv *v)
{
    return is_int(v) || (v->kind == CTV_JSON && json_is_real(v->j));
}
static int is_str(const ctv *v)
{
    return v->kind == CTV_JSON && json_is_string(v->j);
}
static long long int_of(const ctv *v)
{
    return json_is_integer(v->j) ? json_integer_value(v->j) : json_is_true(v->j);
}
static double num_of(const ctv *v)
{
    return is_int(v) ? (double)int_of(v) : json_real_value(v->j);
}

static int type_err(ct_state *st, const ct_node *at, const char *op, const ctv *x, const ctv *y)
{
    if (x->kind == CTV_UNDEF || (y && y->kind == CTV_UNDEF))
        return ct_render_errf(st, at, -EINVAL, "'%s' is undefined",
                              x->kind == CTV_UNDEF ? (x->p ? (const char *)x->p : "value")
                                                   : (y->p ? (const char *)y->p : "value"));
    if (y)
        return ct_render_errf(st, at, -EINVAL, "unsupported operand types for %s: '%s' and '%s'",
                              op, ct_type_name(x), ct_type_name(y));
    return ct_render_errf(st, at, -EINVAL, "bad operand type for %s: '%s'", op, ct_type_name(x));
}

static int int_result(ct_state *st, const ct_node *at, int overflow, long long r, ctv *out)
{
    if (overflow)
        return ct_render_errf(st, at, -ERANGE, "integer overflow");
    *out = ctv_json(json_integer(r));
    return 0;
}

static int arith(ct_state *st, const ct_node *at, int op, const ctv *x, const ctv *y, ctv *out)
{
    static const char *const names[] = {"+", "-", "*", "/", "//", "%", "**"};
    if (!is_num(x) || !is_num(y))
        return type_err(st, at, names[op], x, y);
    if (op == OP_DIV || op == OP_FLOORDIV || op == OP_MOD) {
        if (num_of(y) == 0)
            return ct_render_errf(st, at, -EDOM, "division by zero");
    }
    if (is_int(x) && is_int(y) && op != OP_DIV) {
        long long a = int_of(x), b = int_of(y), r = 0;
        int ov = 0;
        switch (op) {
        case OP_ADD:
            ov = __builtin_add_overflow(a, b, &r);
            break;
        case OP_SUB:
            ov = __builtin_sub_overflow(a, b, &r);
            break;
        case OP_MUL:
            ov = __builtin_mul_overflow(a, b, &r);
            break;
        case OP_FLOORDIV:
        case OP_MOD:
            if (a == (-9223372036854775807LL - 1) && b == -1)
                return int_result(st, at, 1, 0, out);
            r = a / b;
            if ((a % b != 0) && ((a < 0) != (b < 0)))
                r--; /* Python floors */
            if (op == OP_MOD)
                r = a - r * b;
            break;
        case OP_POW:
            if (b < 0)
                break;
            r = 1;
            for (long long i = 0; i < b && !ov; i++)
                ov = __builtin_mul_overflow(r, a, &r);
            return int_result(st, at, ov, r, out);
        }
        if (op != OP_POW)
            return int_result(st, at, ov, r, out);
    }
    double a = num_of(x), b = num_of(y), r = 0;
    switch (op) {
    case OP_ADD:
        r = a + b;
        break;
    case OP_SUB:
        r = a - b;
        break;
    case OP_MUL:
        r = a * b;
        break;
    case OP_DIV:
        r = a / b;
        break;
    case OP_FLOORDIV:
        r = floor(a / b);
        break;
    case OP_MOD:
        r = fmod(a, b);
        if (r != 0 && ((r < 0) != (b < 0)))
            r += b;
        break;
    case OP_POW:
        r = pow(a, b);
        break;
    }
    if (!isfinite(r))
        return ct_render_errf(st, at, -ERANGE, "float result out of range");
    *out = ctv_json(json_real(r));
    return 0;
}

static int concat_seq(ct_state *st, const ct_node *at, const ctv *x, const ctv *y, ctv *out)
{
    if (is_str(x)) {
        ct_buf b = {0};
        ct_buf_add(&b, json_string_value(x->j), json_string_length(x->j));
        ct_buf_add(&b, json_string_value(y->j), json_string_length(y->j));
        return ct_take_string(st, at, &b, out);
    }
    if (json_array_size(x->j) + json_array_size(y->j) > CT_MAX_STEPS)
        return ct_render_errf(st, at, -E2BIG, "list longer than %u items", CT_MAX_STEPS);
    json_t *l = json_copy(x->j);
    if (l == NULL || json_array_extend(l, y->j)) {
        json_decref(l);
        return ct_render_errf(st, at, -ENOMEM, "out of memory");
    }
    *out = ctv_json(l);
    return 0;
}

static int contains(ct_state *st, const ct_node *at, const ctv *item, const ctv *seq, int *res)
{
    if (seq->kind == CTV_UNDEF) { /* Python iterates Jinja2's Undefined: nothing is in it */
        *res = 0;
        return 0;
    }
    if (is_str(seq)) {
        if (!is_str(item))
            return ct_render_errf(st, at, -EINVAL,
                                  "'in <string>' requires string as left operand, not %s",
                                  ct_type_name(item));
        size_t n = json_string_length(seq->j), k = json_string_length(item->j);
        *res = k == 0 || memmem(json_string_value(seq->j), n, json_string_value(item->j), k);
        return 0;
    }
    if ((seq->kind == CTV_JSON || seq->kind == CTV_GEN) && json_is_array(seq->j)) {
        *res = 0;
        for (size_t i = 0; i < json_array_size(seq->j) && !*res; i++) {
            ctv e = {CTV_JSON, json_array_get(seq->j, i), NULL, 0};
            *res = ct_equal(item, &e);
        }
        return 0;
    }
    if (seq->kind == CTV_JSON && json_is_object(seq->j)) {
        *res = is_str(item) && json_object_getn(seq->j, json_string_value(item->j),
                                                json_string_length(item->j)) != NULL;
        return 0;
    }
    return type_err(st, at, "in", item, seq);
}

int ct_bin_op(ct_state *st, const ct_node *at, int op, ctv *x, ctv *y, ctv *out)
{
    int r = 0, rc;
    switch (op) {
    case OP_ADD:
        if ((is_str(x) && is_str(y)) || (x->kind == CTV_JSON && y->kind == CTV_JSON &&
                                         json_is_array(x->j) && json_is_array(y->j)))
            return concat_seq(st, at, x, y, out);
        return arith(st, at, op, x, y, out);
    case OP_MUL:
        if ((is_str(x) && is_int(y)) || (is_int(x) && is_str(y))) {
            const ctv *s = is_str(x) ? x : y;
            long long k = int_of(is_str(x) ? y : x);
            size_t n = json_string_length(s->j);
            if (k > 0 && n > 0 && (unsigned long long)k > CT_MAX_OUTPUT / n)
                return ct_render_errf(st, at, -E2BIG, "string longer than %u bytes", CT_MAX_OUTPUT);
            ct_buf b = {0};
            for (long long i = 0; i < k; i++)
                ct_buf_add(&b, json_string_value(s->j), n);
            return ct_take_string(st, at, &b, out);
        }
        if ((x->kind == CTV_JSON && json_is_array(x->j) && is_int(y)) ||
            (is_int(x) && y->kind == CTV_JSON && json_is_array(y->j))) {
            const ctv *l = is_int(x) ? y : x;
            long long k = int_of(is_int(x) ? x : y);
            size_t n = json_array_size(l->j);
            if (k > 0 && n > 0 && (unsigned long long)k > CT_MAX_STEPS / n)
                return ct_render_errf(st, at, -E2BIG, "list longer than %u items", CT_MAX_STEPS);
            json_t *rep = json_array();
            for (long long i = 0; i < k; i++)
                json_array_extend(rep, l->j);
            *out = ctv_json(rep);
            return 0;
        }
        return arith(st, at, op, x, y, out);
    case OP_SUB:
    case OP_DIV:
    case OP_FLOORDIV:
    case OP_MOD:
    case OP_POW:
        if (op == OP_MOD && is_str(x))
            return ct_render_errf(st, at, -EINVAL, "string %% formatting is not supported");
        return arith(st, at, op, x, y, out);
    case OP_CONCAT: {
        ct_buf b = {0};
        if (ct_val_str(&st->tuples, &b, x) || ct_val_str(&st->tuples, &b, y)) {
            free(b.p);
            return type_err(st, at, "~", x, y);
        }
        return ct_take_string(st, at, &b, out);
    }
    case OP_EQ:
        r = ct_equal(x, y);
        break;
    case OP_NE:
        r = !ct_equal(x, y);
        break;
    case OP_LT:
    case OP_LE:
    case OP_GT:
    case OP_GE: {
        int c;
        if (ct_compare(x, y, &c))
            return type_err(st, at, "comparison", x, y);
        r = op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0;
        break;
    }
    case OP_IN:
    case OP_NOTIN:
        if ((rc = contains(st, at, x, y, &r)) != 0)
            return rc;
        if (op == OP_NOTIN)
            r = !r;
        break;
    default:
        return ct_render_errf(st, at, -EINVAL, "unknown operator");
    }
    *out = ctv_json(json_boolean(r));
    return 0;
}

int ct_getitem(ct_state *st, const ct_node *at, const ctv *obj, const ctv *key, ctv *out)
{
    *out = ctv_undef(NULL);
    if (obj->kind == CTV_UNDEF)
        return ct_render_errf(st, at, -EINVAL, "'%s' is undefined",
                              obj->p ? (const char *)obj->p : "value");
    if (obj->kind != CTV_JSON && !(obj->kind == CTV_NS && is_str(key))) /* ns['x'] reads ns.x */
        return 0;
    json_t *j = obj->j;
    if (json_is_object(j) && is_str(key)) {
        json_t *v = json_object_getn(j, json_string_value(key->j), json_string_length(key->j));
        if (v)
            *out = ctv_json(json_incref(v));
        return 0;
    }
    if (!is_int(key) || !(json_is_array(j) || json_is_string(j)))
        return 0;
    long long i = int_of(key);
    long long len = json_is_array(j)
                        ? (long long)json_array_size(j)
                        : (long long)ct_utf8_len(json_string_value(j), json_string_length(j));
    if (i < 0)
        i += len;
    if (i < 0 || i >= len)
        return 0;
    if (json_is_array(j)) {
        *out = ctv_json(json_incref(json_array_get(j, (size_t)i)));
        return 0;
    }
    const char *s = json_string_value(j);
    size_t n = json_string_length(j);
    size_t o = ct_utf8_offset(s, n, (size_t)i), e = ct_utf8_offset(s, n, (size_t)i + 1);
    *out = ctv_json(json_stringn_nocheck(s + o, e - o));
    return 0;
}

int ct_iter_list(ct_state *st, const ct_node *at, const ctv *v, json_t **out)
{
    if (v->kind == CTV_UNDEF) {
        *out = json_array();
        return 0;
    }
    if (v->kind == CTV_GEN) {
        *out = json_incref(v->j);
        return 0;
    }
    if (v->kind != CTV_JSON ||
        !(json_is_array(v->j) || json_is_object(v->j) || json_is_string(v->j)))
        return ct_render_errf(st, at, -EINVAL, "'%s' object is not iterable", ct_type_name(v));
    if (json_is_array(v->j)) {
        *out = json_incref(v->j);
        return 0;
    }
    json_t *l = json_array();
    if (json_is_object(v->j)) {
        const char *k;
        json_t *x;
        json_object_foreach(v->j, k, x) json_array_append_new(l, json_string_nocheck(k));
    } else {
        const char *s = json_string_value(v->j);
        size_t n = json_string_length(v->j);
        for (size_t i = 0; i < n;) {
            size_t e = i + 1;
            while (e < n && ((unsigned char)s[e] & 0xc0) == 0x80)
                e++;
            json_array_append_new(l, json_stringn_nocheck(s + i, e - i));
            i = e;
        }
    }
    *out = l;
    return 0;
}

/* ------------------------------------------------------------------------------- methods */

static const char *const str_methods[] = {"strip",      "lstrip",   "rstrip",     "split",
                                          "startswith", "endswith", "upper",      "lower",
                                          "replace",    "title",    "capitalize", NULL};
static const char *const dict_methods[] = {"items", "keys", "values", "get", NULL};

static int in_list(const char *const *l, const char *name)
{
    for (; *l; l++)
        if (strcmp(*l, name) == 0)
            return 1;
    return 0;
}

int ct_is_method_name(const char *name)
{
    return in_list(str_methods, name) || in_list(dict_methods, name);
}

/* Python's str.isspace() for the code point at s: its length in bytes, 0 when not a space. */
static size_t space_at(const char *s, size_t n)
{
    unsigned char c = (unsigned char)s[0];
    if (c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f))
        return 1;
    if (n >= 2 && c == 0xc2 && ((unsigned char)s[1] == 0x85 || (unsigned char)s[1] == 0xa0))
        return 2;
    if (n >= 3 && c == 0xe1 && (unsigned char)s[1] == 0x9a && (unsigned char)s[2] == 0x80)
        return 3;
    if (n >= 3 && c == 0xe2 && (unsigned char)s[1] == 0x80) {
        unsigned char d = (unsigned char)s[2];
        if (d <= 0x8a || d == 0xa8 || d == 0xa9 || d == 0xaf)
            return 3;
    }
    if (n >= 3 && c == 0xe2 && (unsigned char)s[1] == 0x81 && (unsigned char)s[2] == 0x9f)
        return 3;
    if (n >= 3 && c == 0xe3 && (unsigned char)s[1] == 0x80 && (unsigned char)s[2] == 0x80)
        return 3;
    return 0;
}

static size_t space_before(const char *s, size_t end)
{
    for (size_t k = 1; k <= 3 && k <= end; k++)
        if (((unsigned char)s[end - k] & 0xc0) != 0x80)
            return space_at(s + end - k, k) == k ? k : 0;
    return 0;
}

static int char_in(const char *set, size_t setn, const char *s, size_t len)
{
    for (size_t i = 0; i + len <= setn;) {
        size_t e = i + 1;
        while (e < setn && ((unsigned char)set[e] & 0xc0) == 0x80)
            e++;
        if (e - i == len && memcmp(set + i, s, len) == 0)
            return 1;
        i = e;
    }
    return 0;
}

/* str.strip / lstrip / rstrip, of whitespace or of the characters in chars. */
int ct_strip(const char *s, size_t n, const char *chars, size_t nchars, int left, int right,
             size_t *start, size_t *end);
int ct_strip(const char *s, size_t n, const char *chars, size_t nchars, int left, int right,
             size_t *start, size_t *end)
{
    size_t a = 0, b = n;
    while (left && a < b) {
        size_t len = 1;
        while (a + len < b && ((unsigned char)s[a + len] & 0xc0) == 0x80)
            len++;
        if (chars ? !char_in(chars, nchars, s + a, len) : space_at(s + a, b - a) != len)
            break;
        a += len;
    }
    while (right && b > a) {
        size_t len = 1;
        while (len < b - a && ((unsigned char)s[b - len] & 0xc0) == 0x80)
            len++;
        if (chars ? !char_in(chars, nchars, s + b - len, len) : space_before(s, b) != len)
            break;
        b -= len;
    }
    *start = a;
    *end = b;
    return 0;
}

static int str_split(ct_state *st, const ct_node *at, const char *s, size_t n, const ctv *sep,
                     long long maxsplit, ctv *out)
{
    json_t *l = json_array();
    if (sep == NULL || (sep->kind == CTV_JSON && json_is_null(sep->j))) {
        size_t i = 0;
        for (;;) {
            size_t w;
            while (i < n && (w = space_at(s + i, n - i)) > 0)
                i += w;
            if (i >= n)
                break;
            size_t e = i;
            if (maxsplit >= 0 && (long long)json_array_size(l) >= maxsplit) {
                size_t a, b;
                ct_strip(s + i, n - i, NULL, 0, 0, 1, &a, &b);
                e = i + b;
                json_array_append_new(l, json_stringn_nocheck(s + i, e - i));
                break;
            }
            while (e < n && space_at(s + e, n - e) == 0)
                e++;
            json_array_append_new(l, json_stringn_nocheck(s + i, e - i));
            i = e;
        }
    } else {
        if (!is_str(sep) || json_string_length(sep->j) == 0) {
            json_decref(l);
            return ct_render_errf(st, at, -EINVAL, "split() separator must be a non-empty str");
        }
        const char *p = json_string_value(sep->j);
        size_t k = json_string_length(sep->j), i = 0;
        for (;;) {
            const char *hit = maxsplit >= 0 && (long long)json_array_size(l) >= maxsplit
                                  ? NULL
                                  : memmem(s + i, n - i, p, k);
            size_t e = hit ? (size_t)(hit - s) : n;
            json_array_append_new(l, json_stringn_nocheck(s + i, e - i));
            if (hit == NULL)
                break;
            i = e + k;
        }
    }
    *out = ctv_json(l);
    return 0;
}

/* s.replace(old, new, count): shared with the replace filter. */
int ct_str_replace(ct_state *st, const ct_node *at, const ctv *s, const ctv *old, const ctv *new,
                   long long count, ctv *out);
int ct_str_replace(ct_state *st, const ct_node *at, const ctv *s, const ctv *old, const ctv *new,
                   long long count, ctv *out)
{
    if (!is_str(s) || !is_str(old) || !is_str(new))
        return ct_render_errf(st, at, -EINVAL, "replace() takes strings");
    const char *p = json_string_value(s->j), *o = json_string_value(old->j);
    size_t n = json_string_length(s->j), k = json_string_length(old->j);
    ct_buf b = {0};
    size_t i = 0;
    long long done = 0;
    if (k == 0) { /* Python inserts new between every character, and at both ends */
        for (size_t c = 0; c <= n; done++) {
            if (count < 0 || done < count)
                ct_buf_add(&b, json_string_value(new->j), json_string_length(new->j));
            if (c == n || b.n > CT_MAX_OUTPUT)
                break;
            size_t e = c + 1;
            while (e < n && ((unsigned char)p[e] & 0xc0) == 0x80)
                e++;
            ct_buf_add(&b, p + c, e - c);
            c = e;
        }
        return ct_take_string(st, at, &b, out);
    }
    while (i < n && b.n <= CT_MAX_OUTPUT) {
        const char *hit = count >= 0 && done >= count ? NULL : memmem(p + i, n - i, o, k);
        if (hit == NULL)
            break;
        ct_buf_add(&b, p + i, (size_t)(hit - p) - i);
        ct_buf_add(&b, json_string_value(new->j), json_string_length(new->j));
        i = (size_t)(hit - p) + k;
        done++;
    }
    ct_buf_add(&b, p + i, n - i);
    return ct_take_string(st, at, &b, out);
}

/* Python's upper/lower/title/capitalize, for ASCII text only: a non-ASCII letter would need
 * Unicode's case tables, so such text is an error rather than a wrong result. */
int ct_str_case(ct_state *st, const ct_node *at, const char *how, const char *s, size_t n,
                ctv *out);
int ct_str_case(ct_state *st, const ct_node *at, const char *how, const char *s, size_t n, ctv *out)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80)
            return ct_render_errf(st, at, -EINVAL, "%s() of non-ASCII text is not supported", how);
    char *d = malloc(n + 1);
    if (d == NULL)
        return ct_render_errf(st, at, -ENOMEM, "out of memory");
    /* "title": str.title(), a word starts after any non-letter; "jtitle": Jinja2's title
       filter, a word starts after "-", whitespace, "(", "{", "[" or "<" */
    int word_start = 1, jinja = how[0] == 'j';
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
        int sep = strchr("-({[< \t\n\r\v\f\x1c\x1d\x1e\x1f", c) != NULL && c != '\0';
        int up =
            how[0] == 'u' || ((how[0] == 't' || jinja) && word_start) || (how[0] == 'c' && i == 0);
        if (up && c >= 'a' && c <= 'z')
            c = (char)(c - 32);
        else if (!up && c >= 'A' && c <= 'Z')
            c = (char)(c + 32);
        d[i] = c;
        word_start = jinja ? sep : !alpha;
    }
    *out = ctv_json(json_stringn_nocheck(d, n));
    free(d);
    return 0;
}

static int opt_int(const ct_args *a, size_t i, long long dflt, long long *v)
{
    if (i >= a->n || (a->v[i].kind == CTV_JSON && json_is_null(a->v[i].j))) {
        *v = dflt;
        return 0;
    }
    if (!is_int(&a->v[i]))
        return -EINVAL;
    *v = int_of(&a->v[i]);
    return 0;
}

static int str_method(ct_state *st, const ct_node *at, const ctv *self, const char *name,
                      ct_args *a, ctv *out)
{
    const char *s = json_string_value(self->j);
    size_t n = json_string_length(self->j);
    if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
        const ctv *chars = a->n > 0 && !json_is_null(a->v[0].j) ? &a->v[0] : NULL;
        if (chars && !is_str(chars))
            return ct_render_errf(st, at, -EINVAL, "%s() argument must be str or None", name);
        size_t b, e;
        ct_strip(s, n, chars ? json_string_value(chars->j) : NULL,
                 chars ? json_string_length(chars->j) : 0, name[0] != 'r', name[0] != 'l', &b, &e);
        *out = ctv_json(json_stringn_nocheck(s + b, e - b));
        return 0;
    }
    if (!strcmp(name, "split")) {
        long long maxsplit;
        if (opt_int(a, 1, -1, &maxsplit))
            return ct_render_errf(st, at, -EINVAL, "split() maxsplit must be an integer");
        return str_split(st, at, s, n, a->n > 0 ? &a->v[0] : NULL, maxsplit, out);
    }
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        if (a->n != 1)
            return ct_render_errf(st, at, -EINVAL, "%s() takes one argument here", name);
        json_t *cands = is_str(&a->v[0]) ? NULL : a->v[0].j;
        if (cands == NULL || !json_is_array(cands) || !ct_is_tuple(&st->tuples, cands))
            cands = NULL; /* Python takes a str or a tuple of them, not a list */
        if (!is_str(&a->v[0]) && cands == NULL)
            return ct_render_errf(st, at, -EINVAL, "%s() takes a str or a tuple of str", name);
        int r = 0;
        for (size_t i = 0; i < (cands ? json_array_size(cands) : 1) && !r; i++) {
            json_t *p = cands ? json_array_get(cands, i) : a->v[0].j;
            if (!json_is_string(p))
                return ct_render_errf(st, at, -EINVAL, "%s() takes a str or a tuple of str", name);
            size_t k = json_string_length(p);
            r = k <= n && memcmp(name[0] == 's' ? s : s + n - k, json_string_value(p), k) == 0;
        }
        *out = ctv_json(json_boolean(r));
        return 0;
    }
    if (!strcmp(name, "replace")) {
        long long count;
        if (a->n < 2 || opt_int(a, 2, -1, &count))
            return ct_render_errf(st, at, -EINVAL, "replace() takes old, new[, count]");
        return ct_str_replace(st, at, self, &a->v[0], &a->v[1], count, out);
    }
    if (a->n != 0)
        return ct_render_errf(st, at, -EINVAL, "%s() takes no arguments", name);
    return ct_str_case(st, at, name, s, n, out);
}

static int dict_method(ct_state *st, const ct_node *at, const ctv *self, const char *name,
                       ct_args *a, ctv *out)
{
    if (!strcmp(name, "get")) {
        if (a->n < 1 || a->n > 2)
            return ct_render_errf(st, at, -EINVAL, "get() takes a key and an optional default");
        json_t *v = is_str(&a->v[0]) ? json_object_getn(self->j, json_string_value(a->v[0].j),
                                                        json_string_length(a->v[0].j))
                                     : NULL;
        if (v)
            *out = ctv_json(json_incref(v));
        else
            *out = a->n == 2 ? ctv_copy(&a->v[1]) : ctv_none();
        return 0;
    }
    if (a->n != 0)
        return ct_render_errf(st, at, -EINVAL, "%s() takes no arguments", name);
    json_t *l = json_array();
    const char *k;
    json_t *v;
    json_object_foreach(self->j, k, v)
    {
        if (name[0] == 'k')
            json_array_append_new(l, json_string_nocheck(k));
        else if (name[0] == 'v')
            json_array_append(l, v);
        else {
            json_t *pair = json_pack("[sO]", k, v);
            if (pair == NULL || json_array_append_new(l, pair) || ct_mark_tuple(st, pair)) {
                json_decref(l);
                return ct_render_errf(st, at, -ENOMEM, "out of memory");
            }
        }
    }
    *out = (ctv){CTV_GEN, l, NULL, CT_GEN_DICT_VIEW};
    return 0;
}

int ct_call_method(ct_state *st, const ct_node *at, ctv *self, const char *name, ct_args *a,
                   ctv *out)
{
    for (size_t i = 0; i < a->n; i++)
        if (a->kw[i] != NULL)
            return ct_render_errf(st, at, -EINVAL, ".%s() takes no keyword arguments here", name);
    for (size_t i = 0; i < a->n; i++)
        if (a->v[i].kind != CTV_JSON)
            return ct_render_errf(st, at, -EINVAL, ".%s() argument is %s", name,
                                  ct_type_name(&a->v[i]));
    if (is_str(self) && in_list(str_methods, name))
        return str_method(st, at, self, name, a, out);
    if (self->kind == CTV_JSON && json_is_object(self->j) && in_list(dict_methods, name))
        return dict_method(st, at, self, name, a, out);
    if (self->kind == CTV_UNDEF)
        return type_err(st, at, name, self, NULL);
    return ct_render_errf(st, at, -EINVAL, "'%s' object has no method '%s'", ct_type_name(self),
                          name);
}

/* ------------------------------------------------------------------------------ builtins */

int ct_builtin_index(const char *name)
{
    static const char *const names[] = {"raise_exception", "strftime_now", "namespace", "range"};
    for (int i = 0; i < 4; i++)
        if (strcmp(name, names[i]) == 0)
            return i;
    return -1;
}

static int builtin_range(ct_state *st, const ct_node *at, ct_args *a, ctv *out)
{
    long long r[3] = {0, 0, 1};
    if (a->n < 1 || a->n > 3)
        return ct_render_errf(st, at, -EINVAL, "range() takes 1 to 3 integers");
    for (size_t i = 0; i < a->n; i++) {
        if (!is_int(&a->v[i]) || a->kw[i])
            return ct_render_errf(st, at, -EINVAL, "range() takes 1 to 3 integers");
        r[a->n == 1 ? 1 : i] = int_of(&a->v[i]);
    }
    if (r[2] == 0)
        return ct_render_errf(st, at, -EINVAL, "range() step must not be zero");
    double count = ((double)r[1] - (double)r[0]) / (double)r[2]; /* charged before it is made */
    if (count > CT_MAX_STEPS)
        return ct_render_errf(st, at, -E2BIG, "range() longer than %u", CT_MAX_STEPS);
    int rc = ct_charge(st, at, count > 0 ? (size_t)count * CT_ITEM_WORK : 0);
    if (rc)
        return rc;
    json_t *l = json_array();
    for (long long x = r[0]; r[2] > 0 ? x < r[1] : x > r[1]; x += r[2]) {
        if (json_array_size(l) >= CT_MAX_STEPS) {
            json_decref(l);
            return ct_render_errf(st, at, -E2BIG, "range() longer than %u", CT_MAX_STEPS);
        }
        json_array_append_new(l, json_integer(x));
        if ((r[2] > 0 && x > r[1] - r[2]) || (r[2] < 0 && x < r[1] - r[2]))
            break; /* the next step would pass the end (or overflow) */
    }
    *out = ctv_json(l);
    return 0;
}

int ct_call_builtin(ct_state *st, const ct_node *at, int id, ct_args *a, ctv *out)
{
    if (id == CT_FN_RANGE)
        return builtin_range(st, at, a, out);
    if (id == CT_FN_NAMESPACE) {
        json_t *o = json_object();
        for (size_t i = 0; i < a->n; i++) {
            if (a->kw[i] == NULL || a->v[i].kind != CTV_JSON) {
                json_decref(o);
                return ct_render_errf(st, at, -EINVAL, "namespace() takes name=value arguments");
            }
            json_object_set(o, a->kw[i], a->v[i].j);
        }
        *out = (ctv){CTV_NS, o, NULL, 0};
        return 0;
    }
    if (a->n != 1 || a->kw[0] != NULL)
        return ct_render_errf(st, at, -EINVAL, "%s() takes one argument",
                              id == CT_FN_RAISE ? "raise_exception" : "strftime_now");
    ct_buf b = {0};
    if (ct_val_str(&st->tuples, &b, &a->v[0])) {
        free(b.p);
        return ct_render_errf(st, at, -EINVAL, "cannot print a %s", ct_type_name(&a->v[0]));
    }
    if (id == CT_FN_RAISE) {
        int rc = ct_render_errf(st, at, -EINVAL, "raise_exception: %s", b.p ? b.p : "");
        free(b.p);
        return rc;
    }
    struct tm tm;
    if (st->now_utc ? gmtime_r(&st->now, &tm) == NULL : localtime_r(&st->now, &tm) == NULL) {
        free(b.p);
        return ct_render_errf(st, at, -EINVAL, "strftime_now: time out of range");
    }
    char tmp[512];
    size_t n = b.p && b.n < 256 ? strftime(tmp, sizeof tmp, b.p, &tm) : 0;
    int bad = b.p != NULL && b.n > 0 && n == 0;
    free(b.p);
    if (bad)
        return ct_render_errf(st, at, -EINVAL, "strftime_now: format too long or empty result");
    *out = ctv_json(json_stringn_nocheck(tmp, n));
    return 0;
}
