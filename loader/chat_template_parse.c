/* chat_template_parse.c — the chat-template parser: tokens into a syntax tree, with Jinja2's
 * grammar and operator precedence (jinja2/parser.py) for the subset that chat templates use.
 * Anything else — a statement, filter, test, method or function outside the subset — is refused
 * here with its name and line:col, so that no template renders differently from Jinja2 because
 * a construct was half understood. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "loader/chat_template_internal.h"

typedef struct parser {
    ct_toks *t;
    size_t i;
    int depth;
    int loops;     /* enclosing for loops (break/continue), reset inside a macro */
    char **macros; /* names the template defines, for the calls' check */
    size_t nmacros;
    ct_node **calls; /* calls of plain names, checked once every macro is known */
    size_t ncalls;
    ct_node **all; /* every node made, so that a failed parse frees its partial tree */
    size_t nall, capall;
    rekv_err *err;
} parser;

static ct_tok *cur(parser *p)
{
    return &p->t->v[p->i];
}
static ct_tok *peek(parser *p, size_t k)
{
    size_t j = p->i + k < p->t->n ? p->i + k : p->t->n - 1;
    return &p->t->v[j];
}

static int perr(parser *p, const ct_tok *at, const char *fmt, const char *arg)
{
    char what[512];
    snprintf(what, sizeof what, fmt, arg ? arg : "");
    for (char *c = what; *c; c++)
        if (*c == '\n' || *c == '\r')
            *c = ' ';
    return rekv_errf(p->err, -EINVAL, "chat template %d:%d: %s", at->line, at->col, what);
}

static int is_op(const ct_tok *k, const char *op)
{
    return k->type == TK_OP && strcmp(k->s, op) == 0;
}
static int is_name(const ct_tok *k, const char *name)
{
    return k->type == TK_NAME && strcmp(k->s, name) == 0;
}

static int expect_op(parser *p, const char *op)
{
    if (!is_op(cur(p), op))
        return perr(p, cur(p), "expected '%s'", op);
    p->i++;
    return 0;
}

static int expect_end(parser *p)
{
    if (cur(p)->type != TK_BLOCK_END)
        return perr(p, cur(p), "expected end of block tag '%%}'%s", NULL);
    p->i++;
    return 0;
}

static ct_node *node_new(parser *p, ct_node_kind kind, const ct_tok *at)
{
    if (p->nall == p->capall) {
        size_t cap = p->capall ? p->capall * 2 : 64;
        ct_node **all = realloc(p->all, cap * sizeof *all);
        if (all == NULL) {
            rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
            return NULL;
        }
        p->all = all;
        p->capall = cap;
    }
    ct_node *n = calloc(1, sizeof *n);
    if (n == NULL) {
        rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
        return NULL;
    }
    p->all[p->nall++] = n;
    n->kind = kind;
    n->line = at->line;
    n->col = at->col;
    return n;
}

static int kid_add(parser *p, ct_node *n, ct_node *kid)
{
    if ((n->nkids & (n->nkids - 1)) == 0) { /* grow at powers of two */
        size_t cap = n->nkids ? n->nkids * 2 : 1;
        ct_node **k = realloc(n->kids, cap * sizeof *k);
        if (k == NULL)
            return rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
        n->kids = k;
    }
    n->kids[n->nkids++] = kid;
    return 0;
}

void ct_node_free(ct_node *n)
{
    if (n == NULL)
        return;
    free(n->name);
    free(n->name2);
    free(n->kw);
    json_decref(n->cst);
    free(n->kids); /* the children are in the template's list of nodes */
    free(n);
}

static char *take_name(parser *p)
{
    ct_tok *k = cur(p);
    char *s = strdup(k->s);
    if (s == NULL)
        rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
    p->i++;
    return s;
}

static int parse_expr(parser *p, ct_node **out);
static int parse_or(parser *p, ct_node **out);
static int parse_unary(parser *p, int with_filter, ct_node **out);
static int parse_primary(parser *p, ct_node **out);
static int parse_postfix(parser *p, ct_node **n);

/* "(" args ")": positional, then name=value; the subset has no *args / **kwargs. */
static int parse_args(parser *p, ct_node *n)
{
    int rc = expect_op(p, "(");
    int kw_seen = 0;
    while (rc == 0 && !is_op(cur(p), ")")) {
        if (n->nkids > 0 && (rc = expect_op(p, ",")) != 0)
            break;
        if (is_op(cur(p), ")"))
            break;
        if (is_op(cur(p), "*") || is_op(cur(p), "**"))
            return perr(p, cur(p), "'*args' / '**kwargs' in a call are not supported%s", NULL);
        char *kw = NULL;
        if (cur(p)->type == TK_NAME && is_op(peek(p, 1), "=")) {
            if ((kw = take_name(p)) == NULL)
                return -ENOMEM;
            p->i++;
            kw_seen = 1;
        } else if (kw_seen) {
            return perr(p, cur(p), "positional argument after a keyword argument%s", NULL);
        }
        ct_node *arg;
        if ((rc = parse_expr(p, &arg)) != 0) {
            free(kw);
            break;
        }
        arg->kw = kw;
        rc = kid_add(p, n, arg);
    }
    return rc ? rc : expect_op(p, ")");
}

static int parse_subscript(parser *p, ct_node **n)
{
    ct_tok *at = cur(p);
    p->i++;
    ct_node *parts[3] = {NULL, NULL, NULL};
    int nparts = 0, rc = 0, colons = 0;
    while (rc == 0 && !is_op(cur(p), "]")) {
        if (is_op(cur(p), ":")) {
            if (++colons > 2)
                rc = perr(p, cur(p), "too many ':' in a slice%s", NULL);
            p->i++;
            nparts = colons;
            continue;
        }
        if (is_op(cur(p), ","))
            rc = perr(p, cur(p), "tuple subscripts are not supported%s", NULL);
        else if (parts[nparts] != NULL)
            rc = perr(p, cur(p), "expected ']'%s", NULL);
        else
            rc = parse_expr(p, &parts[nparts]);
    }
    ct_node *s = rc ? NULL : node_new(p, colons ? N_SLICE : N_ITEM, at);
    if (rc == 0 && parts[0] == NULL && colons == 0)
        rc = perr(p, at, "empty subscript%s", NULL);
    if (s == NULL || rc)
        return rc ? rc : -ENOMEM;
    p->i++;
    s->a = *n;
    s->b = parts[0];
    s->c = parts[1];
    s->d = parts[2];
    *n = s;
    return 0;
}

static int check_call(parser *p, ct_node *call, const ct_tok *at)
{
    ct_node *f = call->a;
    if (f->kind == N_ATTR) {
        if (!ct_is_method_name(f->name))
            return perr(p, at, "method '.%s()' is not supported", f->name);
        return 0;
    }
    if (f->kind != N_NAME)
        return perr(p, at, "calling the result of an expression is not supported%s", NULL);
    if (ct_builtin_index(f->name) >= 0)
        return 0;
    ct_node **c = realloc(p->calls, (p->ncalls + 1) * sizeof *c);
    if (c == NULL)
        return rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
    p->calls = c;
    p->calls[p->ncalls++] = call;
    return 0;
}

static int parse_postfix(parser *p, ct_node **n)
{
    for (;;) {
        ct_tok *at = cur(p);
        int rc = 0;
        if (is_op(at, ".")) {
            ct_tok *k = peek(p, 1);
            if (k->type != TK_NAME && k->type != TK_INT)
                return perr(p, k, "expected an attribute name after '.'%s", NULL);
            ct_node *a = node_new(p, k->type == TK_NAME ? N_ATTR : N_ITEM, at);
            if (a == NULL)
                return -ENOMEM;
            a->a = *n;
            *n = a;
            p->i++;
            if (k->type == TK_NAME) {
                if ((a->name = take_name(p)) == NULL)
                    return -ENOMEM;
            } else {
                if ((a->b = node_new(p, N_CONST, k)) == NULL)
                    return -ENOMEM;
                a->b->cst = json_integer(k->i);
                p->i++;
            }
        } else if (is_op(at, "[")) {
            rc = parse_subscript(p, n);
        } else if (is_op(at, "(")) {
            ct_node *c = node_new(p, N_CALL, at);
            if (c == NULL)
                return -ENOMEM;
            c->a = *n;
            *n = c;
            if ((rc = parse_args(p, c)) == 0)
                rc = check_call(p, c, at);
        } else {
            return 0;
        }
        if (rc)
            return rc;
    }
}

static int parse_filter(parser *p, ct_node **n)
{
    ct_tok *at = cur(p);
    p->i++;
    if (cur(p)->type != TK_NAME)
        return perr(p, cur(p), "expected a filter name after '|'%s", NULL);
    if (is_op(peek(p, 1), "."))
        return perr(p, cur(p), "dotted filter names are not supported%s", NULL);
    int idx = ct_filter_index(cur(p)->s);
    if (idx < 0)
        return perr(p, cur(p), "filter '%s' is not supported", cur(p)->s);
    ct_node *f = node_new(p, N_FILTER, at);
    if (f == NULL)
        return -ENOMEM;
    f->a = *n;
    *n = f;
    f->op = idx;
    if ((f->name = take_name(p)) == NULL)
        return -ENOMEM;
    return is_op(cur(p), "(") ? parse_args(p, f) : 0;
}

static int parse_test(parser *p, ct_node **n)
{
    ct_tok *at = cur(p);
    p->i++;
    int neg = 0;
    if (is_name(cur(p), "not")) {
        neg = 1;
        p->i++;
    }
    if (cur(p)->type != TK_NAME)
        return perr(p, cur(p), "expected a test name after 'is'%s", NULL);
    int idx = ct_test_index(cur(p)->s);
    if (idx < 0)
        return perr(p, cur(p), "test '%s' is not supported", cur(p)->s);
    ct_node *t = node_new(p, N_TEST, at);
    if (t == NULL)
        return -ENOMEM;
    t->a = *n;
    *n = t;
    t->op = idx;
    t->neg = neg;
    if ((t->name = take_name(p)) == NULL)
        return -ENOMEM;
    ct_tok *k = cur(p);
    if (is_op(k, "("))
        return parse_args(p, t);
    int starts = k->type == TK_NAME || k->type == TK_STRING || k->type == TK_INT ||
                 k->type == TK_FLOAT || is_op(k, "[") || is_op(k, "{");
    if (!starts || is_name(k, "else") || is_name(k, "or") || is_name(k, "and"))
        return 0;
    if (is_name(k, "is"))
        return perr(p, k, "chained tests are not supported%s", NULL);
    ct_node *arg;
    int rc = parse_primary(p, &arg);
    if (rc == 0)
        rc = parse_postfix(p, &arg);
    return rc ? rc : kid_add(p, t, arg);
}

static int parse_unary(parser *p, int with_filter, ct_node **out)
{
    ct_tok *at = cur(p);
    int rc;
    if (++p->depth > CT_MAX_DEPTH)
        return perr(p, at, "expression nested too deep%s", NULL);
    if (is_op(at, "-") || is_op(at, "+")) {
        p->i++;
        ct_node *n = node_new(p, N_NEG, at);
        if (n == NULL)
            return -ENOMEM;
        n->op = is_op(at, "+");
        *out = n;
        rc = parse_unary(p, 0, &n->a);
    } else {
        rc = parse_primary(p, out);
    }
    if (rc == 0)
        rc = parse_postfix(p, out);
    while (rc == 0 && with_filter) {
        if (is_op(cur(p), "|"))
            rc = parse_filter(p, out);
        else if (is_name(cur(p), "is"))
            rc = parse_test(p, out);
        else if (is_op(cur(p), "("))
            rc = perr(p, cur(p), "calling the result of a filter or test is not supported%s", NULL);
        else
            break;
    }
    p->depth--;
    return rc;
}

static int parse_binary_level(parser *p, int level, ct_node **out);

/* Jinja2's levels, loosest first: or, and, not, compare, + -, ~, * / // %, **. */
static const struct {
    const char *ops[5];
    ct_binop codes[5];
} levels[] = {
    {{"+", "-"}, {OP_ADD, OP_SUB}},
    {{"~"}, {OP_CONCAT}},
    {{"*", "/", "//", "%"}, {OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD}},
    {{"**"}, {OP_POW}},
};

static int parse_binary_level(parser *p, int level, ct_node **out)
{
    if (level == (int)(sizeof levels / sizeof levels[0]))
        return parse_unary(p, 1, out);
    int rc = parse_binary_level(p, level + 1, out);
    for (;;) {
        if (rc)
            return rc;
        int which = -1;
        for (int k = 0; k < 5 && levels[level].ops[k]; k++)
            if (is_op(cur(p), levels[level].ops[k]))
                which = k;
        if (which < 0)
            return 0;
        ct_node *n = node_new(p, N_BIN, cur(p));
        if (n == NULL)
            return -ENOMEM;
        p->i++;
        n->op = levels[level].codes[which];
        n->a = *out;
        *out = n;
        rc = parse_binary_level(p, level + 1, &n->b);
    }
}

static int parse_compare(parser *p, ct_node **out)
{
    int rc = parse_binary_level(p, 0, out);
    static const char *const cmp[] = {"==", "!=", "<", "<=", ">", ">="};
    static const ct_binop codes[] = {OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE};
    ct_node *last = NULL; /* the right operand of the comparison before: a chain's next left */
    while (rc == 0) {
        ct_tok *at = cur(p);
        int op = -1;
        for (int k = 0; k < 6; k++)
            if (is_op(at, cmp[k]))
                op = codes[k];
        if (is_name(at, "in"))
            op = OP_IN;
        else if (is_name(at, "not") && is_name(peek(p, 1), "in"))
            op = OP_NOTIN;
        if (op < 0)
            return 0;
        p->i += op == OP_NOTIN ? 2 : 1;
        ct_node *n = node_new(p, N_BIN, at);
        if (n == NULL)
            return -ENOMEM;
        n->op = op;
        if (last == NULL) {
            n->a = *out;
            *out = n;
        } else { /* "a < b < c" is "a < b and b < c", as in Python (b, without effects, twice) */
            ct_node *and = node_new(p, N_AND, at);
            if (and == NULL)
                return -ENOMEM;
            n->a = last;
            and->a = *out;
            and->b = n;
            *out = and;
        }
        rc = parse_binary_level(p, 0, &n->b);
        last = n->b;
    }
    return rc;
}

static int parse_not(parser *p, ct_node **out)
{
    if (!is_name(cur(p), "not"))
        return parse_compare(p, out);
    if (++p->depth > CT_MAX_DEPTH)
        return perr(p, cur(p), "expression nested too deep%s", NULL);
    ct_node *n = node_new(p, N_NOT, cur(p));
    if (n == NULL)
        return -ENOMEM;
    p->i++;
    *out = n;
    int rc = parse_not(p, &n->a);
    p->depth--;
    return rc;
}

static int parse_andor(parser *p, int is_or, ct_node **out)
{
    int rc = is_or ? parse_andor(p, 0, out) : parse_not(p, out);
    while (rc == 0 && is_name(cur(p), is_or ? "or" : "and")) {
        ct_node *n = node_new(p, is_or ? N_OR : N_AND, cur(p));
        if (n == NULL)
            return -ENOMEM;
        p->i++;
        n->a = *out;
        *out = n;
        rc = is_or ? parse_andor(p, 0, &n->b) : parse_not(p, &n->b);
    }
    return rc;
}

static int parse_or(parser *p, ct_node **out)
{
    return parse_andor(p, 1, out);
}

static int parse_expr(parser *p, ct_node **out)
{
    *out = NULL;
    int rc = parse_or(p, out);
    while (rc == 0 && is_name(cur(p), "if")) {
        ct_node *n = node_new(p, N_COND, cur(p));
        if (n == NULL)
            return -ENOMEM;
        p->i++;
        n->b = *out;
        *out = n;
        if ((rc = parse_or(p, &n->a)) == 0 && is_name(cur(p), "else")) {
            p->i++;
            rc = parse_expr(p, &n->c);
        }
    }
    return rc;
}

/* "[a, b]", "{k: v}" and "(a, b)" (a tuple: a list here). */
static int parse_display(parser *p, ct_node **out)
{
    ct_tok *at = cur(p);
    int dict = is_op(at, "{"), paren = is_op(at, "(");
    const char *close = dict ? "}" : paren ? ")" : "]";
    p->i++;
    ct_node *n = node_new(p, dict ? N_DICT : N_LIST, at);
    if (n == NULL)
        return -ENOMEM;
    *out = n;
    int rc = 0, commas = 0;
    while (rc == 0 && !is_op(cur(p), close)) {
        if (n->nkids > 0) {
            if ((rc = expect_op(p, ",")) != 0)
                break;
            commas++;
            if (is_op(cur(p), close))
                break;
        }
        ct_node *k;
        if ((rc = parse_expr(p, &k)) != 0 || (rc = kid_add(p, n, k)) != 0)
            break;
        if (dict && (rc = expect_op(p, ":")) == 0 && (rc = parse_expr(p, &k)) == 0)
            rc = kid_add(p, n, k);
    }
    if (rc)
        return rc;
    p->i++;
    n->neg = paren;                              /* a tuple */
    if (paren && n->nkids == 1 && commas == 0) { /* "(x)" is x, not a tuple */
        *out = n->kids[0];
    }
    return 0;
}

static int parse_primary(parser *p, ct_node **out)
{
    ct_tok *k = cur(p);
    *out = NULL;
    if (k->type == TK_NAME) {
        static const char *const refused[] = {"caller", "varargs", "kwargs", "self",
                                              "super",  "cycler",  "joiner", "lipsum"};
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
            if (strcmp(k->s, refused[i]) == 0)
                return perr(p, k, "'%s' is not supported", k->s);
        ct_node *n = node_new(p, N_CONST, k);
        if (n == NULL)
            return -ENOMEM;
        *out = n;
        if (!strcmp(k->s, "true") || !strcmp(k->s, "True"))
            n->cst = json_true();
        else if (!strcmp(k->s, "false") || !strcmp(k->s, "False"))
            n->cst = json_false();
        else if (!strcmp(k->s, "none") || !strcmp(k->s, "None"))
            n->cst = json_null();
        else {
            n->kind = N_NAME;
            return (n->name = take_name(p)) ? 0 : -ENOMEM;
        }
        p->i++;
        return 0;
    }
    if (k->type == TK_STRING || k->type == TK_INT || k->type == TK_FLOAT) {
        ct_node *n = node_new(p, N_CONST, k);
        if (n == NULL)
            return -ENOMEM;
        *out = n;
        if (k->type == TK_INT)
            n->cst = json_integer(k->i);
        else if (k->type == TK_FLOAT)
            n->cst = json_real(k->f);
        else { /* adjacent string literals are one string, as in Python */
            size_t len = 0, j;
            for (j = p->i; p->t->v[j].type == TK_STRING; j++)
                len += p->t->v[j].n;
            char *s = malloc(len + 1);
            if (s == NULL)
                return rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
            len = 0;
            for (; p->i < j; p->i++) {
                memcpy(s + len, cur(p)->s, cur(p)->n);
                len += cur(p)->n;
            }
            n->cst = json_stringn_nocheck(s, len);
            free(s);
            return n->cst ? 0 : rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
        }
        p->i++;
        return n->cst ? 0 : rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
    }
    if (is_op(k, "(") || is_op(k, "[") || is_op(k, "{"))
        return parse_display(p, out);
    if (k->type == TK_VAR_END || k->type == TK_BLOCK_END)
        return perr(p, k, "expected an expression%s", NULL);
    return perr(p, k, "unexpected '%s'", k->s ? k->s : "end of template");
}

/* ---------------------------------------------------------------------------- statements */

static int parse_body(parser *p, const char *const *stops, int *which, ct_node **out);

static int parse_if(parser *p, ct_node *n)
{
    static const char *const stops[] = {"elif", "else", "endif", NULL};
    int which, rc;
    /* Jinja2 reads an if's test without "x if y else z" (parse_tuple(with_condexpr=False)) */
    if ((rc = parse_or(p, &n->a)) || (rc = expect_end(p)) ||
        (rc = parse_body(p, stops, &which, &n->b)))
        return rc;
    if (which == 0) { /* elif: an if in the else branch */
        if ((n->c = node_new(p, N_IF, cur(p))) == NULL)
            return -ENOMEM;
        return parse_if(p, n->c);
    }
    if (which == 1) {
        static const char *const endif[] = {"endif", NULL};
        if ((rc = expect_end(p)) || (rc = parse_body(p, endif, &which, &n->c)))
            return rc;
    }
    return expect_end(p);
}

static int parse_for(parser *p, ct_node *n)
{
    int rc, which;
    if (cur(p)->type != TK_NAME)
        return perr(p, cur(p), "expected a loop variable%s", NULL);
    if ((n->name = take_name(p)) == NULL)
        return -ENOMEM;
    if (is_op(cur(p), ",")) {
        p->i++;
        if (cur(p)->type != TK_NAME)
            return perr(p, cur(p), "expected a second loop variable%s", NULL);
        if ((n->name2 = take_name(p)) == NULL)
            return -ENOMEM;
        if (is_op(cur(p), ","))
            return perr(p, cur(p), "more than two loop variables are not supported%s", NULL);
    }
    if (!is_name(cur(p), "in"))
        return perr(p, cur(p), "expected 'in'%s", NULL);
    p->i++;
    if ((rc = parse_or(p, &n->a)))
        return rc;
    if (is_name(cur(p), "if")) {
        p->i++;
        if ((rc = parse_expr(p, &n->b)))
            return rc;
    }
    if (is_name(cur(p), "recursive"))
        return perr(p, cur(p), "'recursive' loops are not supported%s", NULL);
    static const char *const stops[] = {"else", "endfor", NULL};
    p->loops++;
    rc = expect_end(p);
    if (rc == 0)
        rc = parse_body(p, stops, &which, &n->c);
    p->loops--;
    if (rc == 0 && which == 0) {
        static const char *const endfor[] = {"endfor", NULL};
        if ((rc = expect_end(p)) == 0)
            rc = parse_body(p, endfor, &which, &n->d);
    }
    return rc ? rc : expect_end(p);
}

static int parse_set(parser *p, ct_node *n)
{
    int rc, which;
    if (cur(p)->type != TK_NAME)
        return perr(p, cur(p), "expected a variable name after 'set'%s", NULL);
    if ((n->name = take_name(p)) == NULL)
        return -ENOMEM;
    if (is_op(cur(p), ".")) {
        p->i++;
        if (cur(p)->type != TK_NAME)
            return perr(p, cur(p), "expected an attribute name%s", NULL);
        if ((n->name2 = take_name(p)) == NULL)
            return -ENOMEM;
    }
    if (is_op(cur(p), ","))
        return perr(p, cur(p), "'set' with several targets is not supported%s", NULL);
    if (is_op(cur(p), "=")) {
        p->i++;
        if ((rc = parse_expr(p, &n->a)))
            return rc;
        return expect_end(p);
    }
    if (is_op(cur(p), "|"))
        return perr(p, cur(p), "filtered block 'set' is not supported%s", NULL);
    if (n->name2)
        return perr(p, cur(p), "block 'set' of an attribute is not supported%s", NULL);
    static const char *const stops[] = {"endset", NULL};
    if ((rc = expect_end(p)) || (rc = parse_body(p, stops, &which, &n->c)))
        return rc;
    return expect_end(p);
}

static int parse_macro(parser *p, ct_node *n)
{
    int rc, which;
    if (cur(p)->type != TK_NAME)
        return perr(p, cur(p), "expected a macro name%s", NULL);
    if ((n->name = take_name(p)) == NULL)
        return -ENOMEM;
    char **m = realloc(p->macros, (p->nmacros + 1) * sizeof *m);
    if (m == NULL)
        return rekv_errf(p->err, -ENOMEM, "chat template: out of memory");
    p->macros = m;
    p->macros[p->nmacros++] = n->name;
    if ((rc = expect_op(p, "(")))
        return rc;
    while (!is_op(cur(p), ")")) {
        if (n->nkids > 0 && (rc = expect_op(p, ",")))
            return rc;
        if (cur(p)->type != TK_NAME)
            return perr(p, cur(p), "expected a parameter name%s", NULL);
        ct_node *param = node_new(p, N_NAME, cur(p));
        if (param == NULL || (param->name = take_name(p)) == NULL)
            return -ENOMEM;
        if ((rc = kid_add(p, n, param)))
            return rc;
        if (is_op(cur(p), "=")) {
            p->i++;
            if ((rc = parse_expr(p, &param->a)))
                return rc;
        }
    }
    p->i++;
    static const char *const stops[] = {"endmacro", NULL};
    int loops = p->loops;
    p->loops = 0;
    if ((rc = expect_end(p)) == 0)
        rc = parse_body(p, stops, &which, &n->b);
    p->loops = loops;
    return rc ? rc : expect_end(p);
}

static int parse_statement(parser *p, ct_node **out)
{
    ct_tok *at = cur(p);
    if (at->type != TK_NAME)
        return perr(p, at, "expected a statement name%s", NULL);
    static const struct {
        const char *name;
        ct_node_kind kind;
    } stmts[] = {{"if", N_IF},       {"for", N_FOR},     {"set", N_SET},
                 {"macro", N_MACRO}, {"break", N_BREAK}, {"continue", N_CONTINUE}};
    int k = -1;
    for (int i = 0; i < 6; i++)
        if (strcmp(at->s, stmts[i].name) == 0)
            k = i;
    if (k < 0) {
        if (strncmp(at->s, "end", 3) == 0 || !strcmp(at->s, "else") || !strcmp(at->s, "elif"))
            return perr(p, at, "unexpected '{%% %s %%}'", at->s);
        return perr(p, at, "statement '{%% %s %%}' is not supported", at->s);
    }
    ct_node *n = node_new(p, stmts[k].kind, at);
    if (n == NULL)
        return -ENOMEM;
    *out = n;
    p->i++;
    switch (stmts[k].kind) {
    case N_IF:
        return parse_if(p, n);
    case N_FOR:
        return parse_for(p, n);
    case N_SET:
        return parse_set(p, n);
    case N_MACRO:
        return parse_macro(p, n);
    default:
        if (p->loops == 0)
            return perr(p, at, "'%s' outside a loop", at->s);
        return expect_end(p);
    }
}

/* Statements until one of stops (NULL-terminated; NULL stops: the end of the template). On a
 * stop, *which is its index and the parser stands after its name. */
static int parse_body(parser *p, const char *const *stops, int *which, ct_node **out)
{
    ct_tok *start = cur(p);
    ct_node *body = node_new(p, N_BODY, start);
    if (body == NULL)
        return -ENOMEM;
    *out = body;
    if (++p->depth > CT_MAX_DEPTH)
        return perr(p, start, "statements nested too deep%s", NULL);
    int rc = 0;
    for (;;) {
        ct_tok *k = cur(p);
        ct_node *n = NULL;
        if (k->type == TK_EOF) {
            const char *end = NULL;
            for (int i = 0; stops && stops[i]; i++)
                if (strncmp(stops[i], "end", 3) == 0)
                    end = stops[i];
            if (stops != NULL)
                rc = perr(p, k, "missing '{%% %s %%}' at the end of the template", end);
            break;
        }
        if (k->type == TK_TEXT) {
            if ((n = node_new(p, N_TEXT, k)) == NULL)
                return -ENOMEM;
            n->cst = json_stringn_nocheck(k->s, k->n);
            p->i++;
        } else if (k->type == TK_VAR_BEGIN) {
            p->i++;
            if ((n = node_new(p, N_OUTPUT, k)) == NULL)
                return -ENOMEM;
            if ((rc = parse_expr(p, &n->a)) == 0 && cur(p)->type != TK_VAR_END)
                rc = perr(p, cur(p), "expected end of variable tag '}}'%s", NULL);
            p->i++;
        } else if (k->type == TK_BLOCK_BEGIN) {
            ct_tok *name = peek(p, 1);
            for (int i = 0; stops && stops[i] && name->type == TK_NAME; i++)
                if (strcmp(name->s, stops[i]) == 0) {
                    *which = i;
                    p->i += 2;
                    p->depth--;
                    return 0;
                }
            p->i++;
            rc = parse_statement(p, &n);
        } else {
            rc = perr(p, k, "unexpected token%s", NULL);
        }
        if (n != NULL) {
            int rc2 = kid_add(p, body, n);
            rc = rc ? rc : rc2;
        }
        if (rc)
            break;
    }
    p->depth--;
    return rc;
}

int ct_parse_tokens(ct_toks *toks, ct_node **out, ct_node ***all, size_t *nall, rekv_err *err)
{
    parser p = {.t = toks, .err = err};
    int which;
    ct_node *root = NULL;
    int rc = parse_body(&p, NULL, &which, &root);
    for (size_t i = 0; rc == 0 && i < p.ncalls; i++) {
        const char *name = p.calls[i]->a->name;
        int known = 0;
        for (size_t j = 0; j < p.nmacros; j++)
            known = known || strcmp(p.macros[j], name) == 0;
        if (!known)
            rc = rekv_errf(err, -EINVAL, "chat template %d:%d: function '%s' is not supported",
                           p.calls[i]->line, p.calls[i]->col, name);
    }
    free(p.calls);
    free(p.macros);
    if (rc) {
        for (size_t i = 0; i < p.nall; i++)
            ct_node_free(p.all[i]);
        free(p.all);
        return rc;
    }
    *out = root;
    *all = p.all;
    *nall = p.nall;
    return 0;
}
