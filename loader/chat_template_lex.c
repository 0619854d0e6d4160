/* chat_template_lex.c — the chat-template lexer: a template's source into tokens, as Jinja2's
 * lexer does it in HF's environment (trim_blocks=True, lstrip_blocks=True, keep_trailing_newline
 * False): newlines normalized to \n and one final newline dropped; "{%-"/"{{-"/"{#-" strip the
 * whitespace before them, "-%}"/"-}}"/"-#}" the whitespace after; lstrip_blocks removes the spaces
 * and tabs between a line's start and a block or comment tag (not a "{{"), trim_blocks the one
 * newline after a block or comment tag; "+" after the opening or before the closing turns either
 * off. Text between tags becomes TK_TEXT; a tag's inside becomes expression tokens. */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "loader/chat_template_internal.h"

typedef struct lexer {
    const char *s; /* the normalized source */
    size_t n;
    size_t pos;
    ct_toks *out;
    rekv_err *err;
    size_t lc_pos, lc_start; /* line_col's cache: positions only grow while lexing */
    int lc_line;
} lexer;

/* Python's str.isspace() over ASCII: what \s and rstrip() take here. */
static int is_ws(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

static void line_col(lexer *lx, size_t pos, int *line, int *col)
{
    if (pos < lx->lc_pos || lx->lc_line == 0) {
        lx->lc_pos = lx->lc_start = 0;
        lx->lc_line = 1;
    }
    for (size_t i = lx->lc_pos; i < pos && i < lx->n; i++)
        if (lx->s[i] == '\n') {
            lx->lc_line++;
            lx->lc_start = i + 1;
        }
    lx->lc_pos = pos;
    *line = lx->lc_line;
    *col = (int)(pos - lx->lc_start) + 1;
}

static int lex_errf(lexer *lx, size_t pos, const char *what)
{
    int line, col;
    line_col(lx, pos, &line, &col);
    return rekv_errf(lx->err, -EINVAL, "chat template %d:%d: %s", line, col, what);
}

static int emit(lexer *lx, ct_tok_type type, size_t pos, const char *s, size_t n, ct_tok **tok)
{
    ct_toks *t = lx->out;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 256;
        ct_tok *v = realloc(t->v, cap * sizeof *v);
        if (v == NULL)
            return rekv_errf(lx->err, -ENOMEM, "chat template: out of memory");
        t->v = v;
        t->cap = cap;
    }
    ct_tok *k = &t->v[t->n];
    memset(k, 0, sizeof *k);
    k->type = type;
    line_col(lx, pos, &k->line, &k->col);
    if (s != NULL) {
        k->s = malloc(n + 1);
        if (k->s == NULL)
            return rekv_errf(lx->err, -ENOMEM, "chat template: out of memory");
        memcpy(k->s, s, n);
        k->s[n] = '\0';
        k->n = n;
    }
    t->n++;
    if (tok)
        *tok = k;
    return 0;
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    c = tolower(c);
    return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static size_t put_utf8(char *d, unsigned long cp)
{
    if (cp < 0x80) {
        d[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        d[0] = (char)(0xc0 | (cp >> 6));
        d[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        d[0] = (char)(0xe0 | (cp >> 12));
        d[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        d[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    d[0] = (char)(0xf0 | (cp >> 18));
    d[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    d[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    d[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* A string literal's body with Python's unicode-escape decoding, as Jinja2 decodes it. */
static int lex_string(lexer *lx, size_t start, size_t *end)
{
    char q = lx->s[start];
    size_t i = start + 1;
    char *d = malloc(lx->n - start + 1);
    if (d == NULL)
        return rekv_errf(lx->err, -ENOMEM, "chat template: out of memory");
    size_t k = 0;
    for (;;) {
        if (i >= lx->n) {
            free(d);
            return lex_errf(lx, start, "unterminated string");
        }
        char c = lx->s[i];
        if (c == q)
            break;
        if (c != '\\' || i + 1 >= lx->n) {
            d[k++] = c;
            i++;
            continue;
        }
        char e = lx->s[i + 1];
        const char *simple = strchr("\\'\"abfnrtv\n", e);
        if (simple != NULL && e != '\0') {
            static const char map[] = "\\'\"\a\b\f\n\r\t\v";
            if (e != '\n')
                d[k++] = map[simple - "\\'\"abfnrtv\n"];
            i += 2;
            continue;
        }
        if (e >= '0' && e <= '7') { /* octal: up to three digits */
            unsigned long cp = 0;
            size_t j = i + 1;
            for (; j < i + 4 && j < lx->n && lx->s[j] >= '0' && lx->s[j] <= '7'; j++)
                cp = cp * 8 + (unsigned long)(lx->s[j] - '0');
            k += put_utf8(d + k, cp);
            i = j;
            continue;
        }
        if (e == 'N') {
            free(d);
            return lex_errf(lx, i, "\\N{...} escapes are not supported");
        }
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits == 0) { /* not an escape: Python keeps the backslash */
            d[k++] = c;
            i++;
            continue;
        }
        unsigned long cp = 0;
        for (int j = 0; j < digits; j++) {
            int h = i + 2 + j < lx->n ? hexval((unsigned char)lx->s[i + 2 + j]) : -1;
            if (h < 0) {
                free(d);
                return lex_errf(lx, i, "bad \\x, \\u or \\U escape in a string");
            }
            cp = cp * 16 + (unsigned long)h;
        }
        if (cp > 0x10ffff || (cp >= 0xd800 && cp < 0xe000)) {
            free(d);
            return lex_errf(lx, i, "escape outside Unicode in a string");
        }
        k += put_utf8(d + k, cp);
        i += 2 + (size_t)digits;
    }
    ct_tok *t;
    int rc = emit(lx, TK_STRING, start, d, k, &t);
    free(d);
    *end = i + 1;
    return rc;
}

static const char *const ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                  "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                  ".",  ",",  ":",  "|",  "=",  "<",  ">", ";"};

/* One token inside a tag at lx->pos (whitespace already skipped). */
static int lex_expr_token(lexer *lx, char *stack, int *depth)
{
    const char *s = lx->s;
    size_t p = lx->pos, n = lx->n;
    unsigned char c = (unsigned char)s[p];
    if (isdigit(c)) {
        size_t e = p;
        while (e < n && isdigit((unsigned char)s[e]))
            e++;
        int is_float = 0;
        if (e + 1 < n && s[e] == '.' && isdigit((unsigned char)s[e + 1])) {
            is_float = 1;
            for (e++; e < n && isdigit((unsigned char)s[e]); e++)
                ;
        }
        if (e < n && (s[e] == 'e' || s[e] == 'E')) {
            size_t x = e + 1;
            if (x < n && (s[x] == '+' || s[x] == '-'))
                x++;
            if (x < n && isdigit((unsigned char)s[x])) {
                is_float = 1;
                for (e = x; e < n && isdigit((unsigned char)s[e]); e++)
                    ;
            }
        }
        ct_tok *t;
        int rc = emit(lx, is_float ? TK_FLOAT : TK_INT, p, s + p, e - p, &t);
        if (rc)
            return rc;
        errno = 0;
        if (is_float)
            t->f = strtod(t->s, NULL);
        else
            t->i = strtoll(t->s, NULL, 10);
        if (errno)
            return lex_errf(lx, p, "number out of range");
        lx->pos = e;
        return 0;
    }
    if (isalpha(c) || c == '_') {
        size_t e = p;
        while (e < n && (isalnum((unsigned char)s[e]) || s[e] == '_'))
            e++;
        lx->pos = e;
        return emit(lx, TK_NAME, p, s + p, e - p, NULL);
    }
    if (c == '\'' || c == '"')
        return lex_string(lx, p, &lx->pos);
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        size_t l = strlen(ops[i]);
        if (p + l > n || memcmp(s + p, ops[i], l) != 0)
            continue;
        if (l == 1 && strchr("([{", c)) {
            if (*depth >= CT_MAX_DEPTH)
                return lex_errf(lx, p, "brackets nested too deep");
            stack[(*depth)++] = c == '(' ? ')' : c == '[' ? ']' : '}';
        } else if (l == 1 && strchr(")]}", c)) {
            if (*depth == 0 || stack[*depth - 1] != (char)c)
                return lex_errf(lx, p, "unbalanced bracket");
            (*depth)--;
        }
        lx->pos = p + l;
        return emit(lx, TK_OP, p, ops[i], l, NULL);
    }
    char what[64];
    snprintf(what, sizeof what, "unexpected character '%c'", isprint(c) ? c : '?');
    return lex_errf(lx, p, what);
}

/* The inside of a "{{" or "{%" tag, up to and including its end. */
static int lex_tag(lexer *lx, int block)
{
    char stack[CT_MAX_DEPTH];
    int depth = 0;
    const char *s = lx->s;
    const char *close = block ? "%}" : "}}";
    for (;;) {
        size_t p = lx->pos;
        if (depth == 0) {
            int sign = (s[p] == '-' || (block && s[p] == '+')) ? s[p] : 0;
            size_t q = p + (sign ? 1 : 0);
            if (q + 1 < lx->n + 1 && strncmp(s + q, close, 2) == 0) {
                int rc = emit(lx, block ? TK_BLOCK_END : TK_VAR_END, p, NULL, 0, NULL);
                if (rc)
                    return rc;
                q += 2;
                if (sign == '-')
                    while (q < lx->n && is_ws((unsigned char)s[q]))
                        q++;
                else if (sign == 0 && block && q < lx->n && s[q] == '\n')
                    q++;
                lx->pos = q;
                return 0;
            }
        }
        while (lx->pos < lx->n && is_ws((unsigned char)s[lx->pos]))
            lx->pos++;
        if (lx->pos >= lx->n)
            return lex_errf(lx, p,
                            block ? "missing end of block tag '%}'"
                                  : "missing end of variable tag '}}'");
        if (lx->pos > p)
            continue;
        int rc = lex_expr_token(lx, stack, &depth);
        if (rc)
            return rc;
    }
}

/* The text before a tag at tp, with the whitespace control the tag asks for. */
static int lex_text(lexer *lx, size_t tp, int kind, int sign)
{
    const char *s = lx->s;
    size_t pos = lx->pos, len = tp - pos;
    if (sign == '-') {
        while (len > 0 && is_ws((unsigned char)s[pos + len - 1]))
            len--;
    } else if (sign != '+' && kind != '{') {
        size_t l = len;
        while (l > 0 && s[pos + l - 1] != '\n')
            l--;
        int line_start = l > 0 || pos == 0 || s[pos - 1] == '\n';
        int blank = l < len;
        for (size_t i = l; i < len; i++)
            blank = blank && is_ws((unsigned char)s[pos + i]);
        if (line_start && blank)
            len = l;
    }
    return len ? emit(lx, TK_TEXT, pos, s + pos, len, NULL) : 0;
}

static int lex_comment(lexer *lx, size_t tp, size_t body)
{
    const char *end = strstr(lx->s + body, "#}");
    if (end == NULL)
        return lex_errf(lx, tp, "missing end of comment tag");
    size_t k = (size_t)(end - lx->s), q = k + 2;
    char sign = k > body ? lx->s[k - 1] : 0;
    if (sign == '-')
        while (q < lx->n && is_ws((unsigned char)lx->s[q]))
            q++;
    else if (sign != '+' && q < lx->n && lx->s[q] == '\n')
        q++;
    lx->pos = q;
    return 0;
}

static char *normalize(const char *src, size_t *n)
{
    size_t len = strlen(src);
    char *s = malloc(len + 1);
    if (s == NULL)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[k++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            s[k++] = src[i];
        }
    }
    if (k > 0 && s[k - 1] == '\n')
        k--;
    s[k] = '\0';
    *n = k;
    return s;
}

static int lex_all(lexer *lx)
{
    const char *s = lx->s;
    while (lx->pos < lx->n) {
        size_t tp = lx->pos;
        while (tp + 1 < lx->n && !(s[tp] == '{' && strchr("{%#", s[tp + 1]) && s[tp + 1]))
            tp++;
        if (tp + 1 >= lx->n) {
            int rc = emit(lx, TK_TEXT, lx->pos, s + lx->pos, lx->n - lx->pos, NULL);
            lx->pos = lx->n;
            return rc;
        }
        int kind = s[tp + 1];
        int sign = (s[tp + 2] == '-' || s[tp + 2] == '+') ? s[tp + 2] : 0;
        int rc = lex_text(lx, tp, kind, sign);
        if (rc)
            return rc;
        size_t body = tp + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            rc = lex_comment(lx, tp, body);
        } else {
            rc = emit(lx, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, tp, NULL, 0, NULL);
            lx->pos = body;
            if (rc == 0)
                rc = lex_tag(lx, kind == '%');
        }
        if (rc)
            return rc;
    }
    return 0;
}

int ct_lex(const char *source, ct_toks *out, rekv_err *err)
{
    memset(out, 0, sizeof *out);
    lexer lx = {.out = out, .err = err};
    char *s = normalize(source, &lx.n);
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "chat template: out of memory");
    lx.s = s;
    int rc = lex_all(&lx);
    if (rc == 0)
        rc = emit(&lx, TK_EOF, lx.n, NULL, 0, NULL);
    free(s);
    if (rc)
        ct_toks_free(out);
    return rc;
}

void ct_toks_free(ct_toks *t)
{
    for (size_t i = 0; i < t->n; i++)
        free(t->v[i].s);
    free(t->v);
    memset(t, 0, sizeof *t);
}
