/* chat_template_value.c — the renderer's values: JSON (jansson) standing for Python's str, int,
 * float, bool, None, list and dict, plus Jinja's undefined, namespaces, loops and macros. Here
 * they print as Python prints them (str(), repr() of containers, a float's shortest repr), dump
 * as HF's tojson filter does (json.dumps with ensure_ascii=False), compare and test truth as
 * Python does. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/chat_template_internal.h"

void ctv_drop(ctv *v)
{
    json_decref(v->j);
    v->j = NULL;
    v->kind = CTV_UNDEF;
    v->p = NULL;
}

ctv ctv_copy(const ctv *v)
{
    ctv c = *v;
    json_incref(c.j);
    return c;
}

int ct_buf_add(ct_buf *b, const void *p, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *q = realloc(b->p, cap);
        if (q == NULL) {
            b->oom = 1;
            return -ENOMEM;
        }
        b->p = q;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

int ct_buf_adds(ct_buf *b, const char *s)
{
    return ct_buf_add(b, s, strlen(s));
}

size_t ct_utf8_len(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xc0) != 0x80;
    return k;
}

size_t ct_utf8_offset(const char *s, size_t n, size_t i)
{
    size_t k = 0, b = 0;
    for (; b < n; b++) {
        if (((unsigned char)s[b] & 0xc0) == 0x80)
            continue;
        if (k++ == i)
            return b;
    }
    return n;
}

/* repr(float): the shortest digits that read back to d, in fixed notation for exponents from
 * -4 to 15 and as d.ddde+XX otherwise. */
void ct_py_float(ct_buf *b, double d)
{
    char tmp[64];
    if (isnan(d)) {
        ct_buf_adds(b, "nan");
        return;
    }
    if (isinf(d)) {
        ct_buf_adds(b, d < 0 ? "-inf" : "inf");
        return;
    }
    int prec;
    for (prec = 1; prec < 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
        if (strtod(tmp, NULL) == d)
            break;
    }
    snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
    char digits[32];
    size_t nd = 0;
    const char *q = tmp;
    int neg = *q == '-';
    if (neg)
        q++;
    for (; *q && *q != 'e'; q++)
        if (*q != '.')
            digits[nd++] = *q;
    int exp = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = '\0';
    char out[80];
    size_t k = 0;
    if (neg)
        out[k++] = '-';
    if (exp >= -4 && exp < 16) {
        if (exp < 0) {
            out[k++] = '0';
            out[k++] = '.';
            for (int z = 0; z < -exp - 1; z++)
                out[k++] = '0';
            memcpy(out + k, digits, nd);
            k += nd;
        } else {
            for (int j = 0; j <= exp; j++)
                out[k++] = (size_t)j < nd ? digits[j] : '0';
            out[k++] = '.';
            if ((size_t)exp + 1 < nd) {
                memcpy(out + k, digits + exp + 1, nd - (size_t)exp - 1);
                k += nd - (size_t)exp - 1;
            } else {
                out[k++] = '0';
            }
        }
        out[k] = '\0';
    } else {
        out[k++] = digits[0];
        if (nd > 1) {
            out[k++] = '.';
            memcpy(out + k, digits + 1, nd - 1);
            k += nd - 1;
        }
        snprintf(out + k, sizeof out - k, "e%c%02d", exp < 0 ? '-' : '+', abs(exp));
    }
    ct_buf_adds(b, out);
}

/* The code point at s (valid UTF-8 from jansson; a stray byte stands for itself). */
static unsigned long utf8_cp(const unsigned char *s, size_t n, size_t *len)
{
    if (s[0] < 0x80 || n < 2) {
        *len = 1;
        return s[0];
    }
    if ((s[0] & 0xe0) == 0xc0) {
        *len = 2;
        return ((s[0] & 0x1fUL) << 6) | (s[1] & 0x3f);
    }
    if ((s[0] & 0xf0) == 0xe0 && n >= 3) {
        *len = 3;
        return ((s[0] & 0x0fUL) << 12) | ((s[1] & 0x3fUL) << 6) | (s[2] & 0x3f);
    }
    if (n >= 4) {
        *len = 4;
        return ((s[0] & 0x07UL) << 18) | ((s[1] & 0x3fUL) << 12) | ((s[2] & 0x3fUL) << 6) |
               (s[3] & 0x3f);
    }
    *len = 1;
    return s[0];
}

/* Code points above 0xff that Python's repr escapes: separators and spaces (Zl, Zp, Zs),
 * format characters (Cf), private use (Co) and noncharacters. Unassigned code points, which
 * Python escapes too, would need Unicode's tables; text with them is rare in a chat. */
static int py_unprintable(unsigned long c)
{
    static const unsigned long ranges[][2] = {
        {0x061c, 0x061c},   {0x0600, 0x0605},   {0x06dd, 0x06dd},   {0x070f, 0x070f},
        {0x08e2, 0x08e2},   {0x1680, 0x1680},   {0x180e, 0x180e},   {0x2000, 0x200f},
        {0x2028, 0x202f},   {0x205f, 0x2064},   {0x2066, 0x206f},   {0x3000, 0x3000},
        {0xd800, 0xf8ff},   {0xfdd0, 0xfdef},   {0xfeff, 0xfeff},   {0xfff9, 0xfffb},
        {0xfffe, 0xffff},   {0x110bd, 0x110bd}, {0x110cd, 0x110cd}, {0x1bca0, 0x1bca3},
        {0x1d173, 0x1d17a}, {0xe0001, 0xe0001}, {0xe0020, 0xe007f}, {0xf0000, 0x10ffff},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
        if (c >= ranges[i][0] && c <= ranges[i][1])
            return 1;
    return (c & 0xfffe) == 0xfffe; /* the noncharacters at the end of every plane */
}

/* repr(str): single quotes unless the text has ' and no ", escapes as Python writes them.
 * Python also escapes the non-printable code points above 0x7f; the C1 controls and the
 * separators below are those a chat message may hold. */
void ct_py_repr_str(ct_buf *b, const char *s, size_t n)
{
    int sq = memchr(s, '\'', n) != NULL, dq = memchr(s, '"', n) != NULL;
    char q = sq && !dq ? '"' : '\'';
    ct_buf_add(b, &q, 1);
    for (size_t i = 0; i < n;) {
        size_t len;
        unsigned long c = utf8_cp((const unsigned char *)s + i, n - i, &len);
        char esc[16];
        if (c == (unsigned char)q || c == '\\')
            snprintf(esc, sizeof esc, "\\%c", (char)c);
        else if (c == '\n')
            strcpy(esc, "\\n");
        else if (c == '\r')
            strcpy(esc, "\\r");
        else if (c == '\t')
            strcpy(esc, "\\t");
        else if (c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad)
            snprintf(esc, sizeof esc, "\\x%02lx", c);
        else if (py_unprintable(c))
            snprintf(esc, sizeof esc, c < 0x10000 ? "\\u%04lx" : "\\U%08lx", c);
        else {
            ct_buf_add(b, s + i, len);
            i += len;
            continue;
        }
        ct_buf_adds(b, esc);
        i += len;
    }
    ct_buf_add(b, &q, 1);
}

static int is_tuple(const ct_tuples *t, const json_t *v)
{
    for (size_t i = 0; t && i < t->n; i++)
        if (t->v[i] == v)
            return 1;
    return 0;
}

int ct_is_tuple(const ct_tuples *tuples, const json_t *v)
{
    return is_tuple(tuples, v);
}

static int py_repr(const ct_tuples *t, ct_buf *b, const json_t *v, int depth)
{
    if (depth > CT_MAX_DEPTH)
        return -ELOOP;
    switch (json_typeof(v)) {
    case JSON_STRING:
        ct_py_repr_str(b, json_string_value(v), json_string_length(v));
        return 0;
    case JSON_INTEGER: {
        char tmp[32];
        snprintf(tmp, sizeof tmp, "%lld", (long long)json_integer_value(v));
        return ct_buf_adds(b, tmp);
    }
    case JSON_REAL:
        ct_py_float(b, json_real_value(v));
        return 0;
    case JSON_TRUE:
        return ct_buf_adds(b, "True");
    case JSON_FALSE:
        return ct_buf_adds(b, "False");
    case JSON_NULL:
        return ct_buf_adds(b, "None");
    case JSON_ARRAY: {
        int tuple = is_tuple(t, v);
        ct_buf_adds(b, tuple ? "(" : "[");
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i)
                ct_buf_adds(b, ", ");
            int rc = py_repr(t, b, json_array_get(v, i), depth + 1);
            if (rc)
                return rc;
        }
        if (tuple && json_array_size(v) == 1)
            ct_buf_adds(b, ",");
        return ct_buf_adds(b, tuple ? ")" : "]");
    }
    case JSON_OBJECT: {
        const char *k;
        json_t *x;
        int first = 1;
        ct_buf_adds(b, "{");
        json_object_foreach((json_t *)v, k, x)
        {
            if (!first)
                ct_buf_adds(b, ", ");
            first = 0;
            ct_py_repr_str(b, k, strlen(k));
            ct_buf_adds(b, ": ");
            int rc = py_repr(t, b, x, depth + 1);
            if (rc)
                return rc;
        }
        return ct_buf_adds(b, "}");
    }
    }
    return -EINVAL;
}

int ct_val_str(const ct_tuples *tuples, ct_buf *b, const ctv *v)
{
    switch (v->kind) {
    case CTV_UNDEF:
        return 0;
    case CTV_JSON:
        if (json_is_string(v->j))
            return ct_buf_add(b, json_string_value(v->j), json_string_length(v->j));
        return py_repr(tuples, b, v->j, 0);
    default:
        return -EINVAL;
    }
}

static void json_str(ct_buf *b, const char *s, size_t n)
{
    ct_buf_adds(b, "\"");
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char tmp[8];
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c == '\b')
            esc = "\\b";
        else if (c == '\f')
            esc = "\\f";
        else if (c < 0x20) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            esc = tmp;
        }
        if (esc == NULL)
            continue;
        ct_buf_add(b, s + run, i - run);
        ct_buf_adds(b, esc);
        run = i + 1;
    }
    ct_buf_add(b, s + run, n - run);
    ct_buf_adds(b, "\"");
}

static void newline_indent(ct_buf *b, int indent, int level)
{
    ct_buf_adds(b, "\n");
    for (int i = 0; i < indent * level; i++)
        ct_buf_adds(b, " ");
}

int ct_json_dumps(ct_buf *b, const json_t *v, int indent, int level)
{
    if (level > CT_MAX_DEPTH)
        return -ELOOP;
    const char *sep = indent >= 0 ? "," : ", ";
    switch (json_typeof(v)) {
    case JSON_STRING:
        json_str(b, json_string_value(v), json_string_length(v));
        return 0;
    case JSON_TRUE:
        return ct_buf_adds(b, "true");
    case JSON_FALSE:
        return ct_buf_adds(b, "false");
    case JSON_NULL:
        return ct_buf_adds(b, "null");
    case JSON_INTEGER:
    case JSON_REAL:
        return py_repr(NULL, b, v, 0);
    case JSON_ARRAY:
        if (json_array_size(v) == 0)
            return ct_buf_adds(b, "[]");
        ct_buf_adds(b, "[");
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i)
                ct_buf_adds(b, sep);
            if (indent >= 0)
                newline_indent(b, indent, level + 1);
            int rc = ct_json_dumps(b, json_array_get(v, i), indent, level + 1);
            if (rc)
                return rc;
        }
        if (indent >= 0)
            newline_indent(b, indent, level);
        return ct_buf_adds(b, "]");
    case JSON_OBJECT: {
        if (json_object_size(v) == 0)
            return ct_buf_adds(b, "{}");
        const char *k;
        json_t *x;
        int first = 1;
        ct_buf_adds(b, "{");
        json_object_foreach((json_t *)v, k, x)
        {
            if (!first)
                ct_buf_adds(b, sep);
            first = 0;
            if (indent >= 0)
                newline_indent(b, indent, level + 1);
            json_str(b, k, strlen(k));
            ct_buf_adds(b, ": ");
            int rc = ct_json_dumps(b, x, indent, level + 1);
            if (rc)
                return rc;
        }
        if (indent >= 0)
            newline_indent(b, indent, level);
        return ct_buf_adds(b, "}");
    }
    }
    return -EINVAL;
}

int ct_truthy(const ctv *v)
{
    if (v->kind == CTV_UNDEF)
        return 0;
    if (v->kind == CTV_GEN) /* a generator is an object, true even when it will yield nothing */
        return v->id == CT_GEN_GENERATOR || json_array_size(v->j) > 0;
    if (v->kind != CTV_JSON)
        return 1;
    switch (json_typeof(v->j)) {
    case JSON_STRING:
        return json_string_length(v->j) > 0;
    case JSON_INTEGER:
        return json_integer_value(v->j) != 0;
    case JSON_REAL:
        return json_real_value(v->j) != 0;
    case JSON_TRUE:
        return 1;
    case JSON_FALSE:
    case JSON_NULL:
        return 0;
    case JSON_ARRAY:
        return json_array_size(v->j) > 0;
    case JSON_OBJECT:
        return json_object_size(v->j) > 0;
    }
    return 0;
}

/* Python's numbers: bool is an int, and ints equal floats of the same value. */
static int as_number(const json_t *j, double *d, long long *i, int *is_int)
{
    switch (json_typeof(j)) {
    case JSON_INTEGER:
        *i = json_integer_value(j);
        *d = (double)*i;
        *is_int = 1;
        return 1;
    case JSON_TRUE:
        *i = 1;
        *d = 1;
        *is_int = 1;
        return 1;
    case JSON_FALSE:
        *i = 0;
        *d = 0;
        *is_int = 1;
        return 1;
    case JSON_REAL:
        *d = json_real_value(j);
        *i = 0;
        *is_int = 0;
        return 1;
    default:
        return 0;
    }
}

int ct_json_equal(const json_t *x, const json_t *y)
{
    double dx, dy;
    long long ix, iy;
    int nx, ny;
    if (as_number(x, &dx, &ix, &nx) && as_number(y, &dy, &iy, &ny))
        return nx && ny ? ix == iy : dx == dy;
    if (json_typeof(x) != json_typeof(y))
        return 0;
    switch (json_typeof(x)) {
    case JSON_STRING:
        return json_string_length(x) == json_string_length(y) &&
               memcmp(json_string_value(x), json_string_value(y), json_string_length(x)) == 0;
    case JSON_NULL:
        return 1;
    case JSON_ARRAY:
        if (json_array_size(x) != json_array_size(y))
            return 0;
        for (size_t i = 0; i < json_array_size(x); i++)
            if (!ct_json_equal(json_array_get(x, i), json_array_get(y, i)))
                return 0;
        return 1;
    case JSON_OBJECT: {
        if (json_object_size(x) != json_object_size(y))
            return 0;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)x, k, v)
        {
            json_t *w = json_object_get(y, k);
            if (w == NULL || !ct_json_equal(v, w))
                return 0;
        }
        return 1;
    }
    default:
        return 0;
    }
}

int ct_equal(const ctv *x, const ctv *y)
{
    if (x->kind == CTV_JSON && y->kind == CTV_JSON)
        return ct_json_equal(x->j, y->j);
    if (x->kind != y->kind)
        return 0;
    if (x->kind == CTV_UNDEF)
        return 1; /* Jinja2's Undefined equals any Undefined */
    return x->j == y->j && x->p == y->p && x->id == y->id;
}

static int json_compare(const json_t *x, const json_t *y, int *cmp, int depth)
{
    double dx, dy;
    long long ix, iy;
    int nx, ny;
    if (depth > CT_MAX_DEPTH)
        return -ELOOP;
    if (as_number(x, &dx, &ix, &nx) && as_number(y, &dy, &iy, &ny)) {
        if (nx && ny)
            *cmp = ix < iy ? -1 : ix > iy;
        else
            *cmp = dx < dy ? -1 : dx > dy;
        return 0;
    }
    if (json_is_string(x) && json_is_string(y)) {
        size_t lx = json_string_length(x), ly = json_string_length(y);
        int c = memcmp(json_string_value(x), json_string_value(y), lx < ly ? lx : ly);
        *cmp = c ? (c < 0 ? -1 : 1) : (lx < ly ? -1 : lx > ly);
        return 0;
    }
    if (json_is_array(x) && json_is_array(y)) {
        size_t n =
            json_array_size(x) < json_array_size(y) ? json_array_size(x) : json_array_size(y);
        for (size_t i = 0; i < n; i++) {
            if (ct_json_equal(json_array_get(x, i), json_array_get(y, i)))
                continue;
            return json_compare(json_array_get(x, i), json_array_get(y, i), cmp, depth + 1);
        }
        *cmp =
            json_array_size(x) < json_array_size(y) ? -1 : json_array_size(x) > json_array_size(y);
        return 0;
    }
    return -EINVAL;
}

int ct_compare(const ctv *x, const ctv *y, int *cmp)
{
    if (x->kind != CTV_JSON || y->kind != CTV_JSON)
        return -EINVAL;
    return json_compare(x->j, y->j, cmp, 0);
}

const char *ct_type_name(const ctv *v)
{
    switch (v->kind) {
    case CTV_UNDEF:
        return "undefined";
    case CTV_NS:
        return "namespace";
    case CTV_LOOP:
        return "loop";
    case CTV_MACRO:
        return "macro";
    case CTV_GEN:
        return v->id == CT_GEN_GENERATOR ? "generator" : "dict view";
    case CTV_FUNC:
        return "function";
    case CTV_JSON:
        break;
    }
    switch (json_typeof(v->j)) {
    case JSON_STRING:
        return "str";
    case JSON_INTEGER:
        return "int";
    case JSON_REAL:
        return "float";
    case JSON_TRUE:
    case JSON_FALSE:
        return "bool";
    case JSON_NULL:
        return "NoneType";
    case JSON_ARRAY:
        return "list";
    case JSON_OBJECT:
        return "dict";
    }
    return "?";
}
