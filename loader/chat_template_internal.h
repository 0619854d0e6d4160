/* chat_template_internal.h — the pieces of the chat-template renderer shared by its files: the
 * lexer's tokens (chat_template_lex.c), the syntax tree the parser builds (chat_template_parse.c),
 * the values the evaluator computes with (chat_template_value.c: JSON plus Jinja's undefined,
 * namespaces, loops, macros), the evaluator (chat_template_eval.c) and the filters, tests and
 * methods (chat_template_filters.c). Private to loader/. */
#ifndef REKV_LOADER_CHAT_TEMPLATE_INTERNAL_H
#define REKV_LOADER_CHAT_TEMPLATE_INTERNAL_H

#include <jansson.h>
#include <stddef.h>
#include <time.h>

#include "common/err.h"

/* Bounds on user input: a template is as untrusted as a request. */
#define CT_MAX_DEPTH                                                                               \
    128                           /* nesting of expressions and statements, and macro calls;       \
                                     evaluation may nest CT_MAX_DEPTH * 8 (macros in macros) */
#define CT_MAX_OUTPUT (16u << 20) /* bytes one render may produce */
#define CT_MAX_STEPS 2000000u     /* loop iterations and macro calls in one render */
/* bytes and items that operators, filters and calls take and make in one render: its time */
#define CT_MAX_WORK (1u << 30)
#define CT_ITEM_WORK 32u /* a list's or dict's item, in CT_MAX_WORK's units (bytes) */

/* ------------------------------------------------------------------------------ lexer */

typedef enum {
    TK_TEXT,
    TK_VAR_BEGIN,
    TK_VAR_END,
    TK_BLOCK_BEGIN,
    TK_BLOCK_END,
    TK_NAME,
    TK_STRING,
    TK_INT,
    TK_FLOAT,
    TK_OP,
    TK_EOF
} ct_tok_type;

typedef struct ct_tok {
    ct_tok_type type;
    int line, col;
    char *s;     /* TEXT, NAME, STRING (decoded), OP: malloc'd, NUL-terminated */
    size_t n;    /* bytes of s (a decoded string may hold NULs) */
    long long i; /* INT */
    double f;    /* FLOAT */
} ct_tok;

typedef struct ct_toks {
    ct_tok *v;
    size_t n, cap;
} ct_toks;

/* Tokenizes source as Jinja2 does with trim_blocks and lstrip_blocks (HF's environment). */
int ct_lex(const char *source, ct_toks *out, rekv_err *err);
void ct_toks_free(ct_toks *t);

/* --------------------------------------------------------------------------- syntax tree */

typedef enum {
    /* statements */
    N_BODY,
    N_TEXT,
    N_OUTPUT,
    N_IF,
    N_FOR,
    N_SET,
    N_MACRO,
    N_BREAK,
    N_CONTINUE,
    /* expressions */
    N_CONST,
    N_NAME,
    N_ATTR,
    N_ITEM,
    N_SLICE,
    N_CALL,
    N_FILTER,
    N_TEST,
    N_BIN,
    N_NOT,
    N_NEG,
    N_AND,
    N_OR,
    N_COND,
    N_LIST,
    N_DICT
} ct_node_kind;

typedef enum {
    OP_ADD,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FLOORDIV,
    OP_MOD,
    OP_POW,
    OP_CONCAT,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN
} ct_binop;

typedef struct ct_node ct_node;
struct ct_node {
    ct_node_kind kind;
    int line, col;
    int op; /* N_BIN: ct_binop; N_FILTER/N_TEST: table index; N_TEST: negated in neg */
    int neg;
    char *name;  /* N_NAME, N_ATTR, N_FILTER, N_TEST, N_SET, N_MACRO; N_FOR: first target */
    char *name2; /* N_FOR: second target; N_SET: attribute of a namespace */
    char *kw;    /* an argument passed by keyword: its name */
    json_t *cst; /* N_CONST, N_TEXT (a string) */
    ct_node *a, *b, *c, *d;
    ct_node **kids; /* N_BODY statements, N_CALL/N_FILTER/N_TEST args, N_LIST items,
                       N_DICT key,value pairs, N_MACRO parameters (N_NAME, default in a) */
    size_t nkids;
};

/* Parses tokens into a tree; *all lists every node (the tree's owner: free each, then all). */
int ct_parse_tokens(ct_toks *toks, ct_node **root, ct_node ***all, size_t *nall, rekv_err *err);
void ct_node_free(ct_node *n); /* one node's own fields, not its children */

/* ------------------------------------------------------------------------------- values */

/* CTV_GEN: what Python has as a generator (select, map, |items) or a dict view (.items(),
 * .keys(), .values()): it iterates (for, |list, |join, |first, in, the select family) but does
 * not print, compare or dump as a list would; a generator is always true, a view when not
 * empty. */
typedef enum { CTV_UNDEF, CTV_JSON, CTV_NS, CTV_LOOP, CTV_MACRO, CTV_FUNC, CTV_GEN } ctv_kind;

enum { CT_GEN_GENERATOR, CT_GEN_DICT_VIEW };

typedef struct ct_loop ct_loop;

typedef struct ctv {
    ctv_kind kind;
    json_t *j;     /* CTV_JSON (None is json null), CTV_NS (an object), CTV_GEN (an array of
                      its items): one owned ref */
    const void *p; /* CTV_LOOP: ct_loop; CTV_MACRO: its N_MACRO node; CTV_UNDEF: name */
    int id;        /* CTV_FUNC: which builtin; CTV_GEN: CT_GEN_* */
} ctv;

struct ct_loop {
    json_t *items; /* the iterated values, after the loop's filter */
    size_t index0;
};

enum { CT_FN_RAISE, CT_FN_STRFTIME, CT_FN_NAMESPACE, CT_FN_RANGE };

static inline ctv ctv_undef(const char *name)
{
    return (ctv){CTV_UNDEF, NULL, name, 0};
}
static inline ctv ctv_json(json_t *j)
{
    return (ctv){CTV_JSON, j, NULL, 0};
} /* steals j */
static inline ctv ctv_none(void)
{
    return ctv_json(json_null());
}
void ctv_drop(ctv *v);
ctv ctv_copy(const ctv *v);

/* A growing output string; its bytes stay NUL-terminated. */
typedef struct ct_buf {
    char *p;
    size_t n, cap;
    int oom; /* an append failed: the text is incomplete */
} ct_buf;
int ct_buf_add(ct_buf *b, const void *p, size_t n);
int ct_buf_adds(ct_buf *b, const char *s);

/* The arrays that stand for Python tuples (tuple literals, the pairs of items()), by identity:
 * they print as (a, b). Each entry holds a reference. */
typedef struct ct_tuples {
    json_t **v;
    size_t n, cap;
} ct_tuples;

/* Python's str() of a value into b: strings as they are, True/False/None, repr of lists, tuples
 * and dicts, a float's shortest repr; undefined prints nothing. -EINVAL when not printable. */
int ct_val_str(const ct_tuples *tuples, ct_buf *b, const ctv *v);
int ct_is_tuple(const ct_tuples *tuples, const json_t *v);
/* json.dumps(v, ensure_ascii=False, indent=indent (< 0: None)). */
int ct_json_dumps(ct_buf *b, const json_t *v, int indent, int level);
void ct_py_repr_str(ct_buf *b, const char *s, size_t n);
void ct_py_float(ct_buf *b, double d);

int ct_truthy(const ctv *v);
int ct_equal(const ctv *x, const ctv *y);
int ct_json_equal(const json_t *x, const json_t *y);
/* -1, 0, 1; -EINVAL when the two do not compare (Python's TypeError). */
int ct_compare(const ctv *x, const ctv *y, int *cmp);
const char *ct_type_name(const ctv *v);

/* UTF-8: the number of code points, and the byte offset of code point i (i <= count). */
size_t ct_utf8_len(const char *s, size_t n);
size_t ct_utf8_offset(const char *s, size_t n, size_t i);

/* ------------------------------------------------------------------------------ evaluator */

typedef struct ct_var {
    const char *name;
    ctv v;
} ct_var;

typedef struct ct_frame {
    struct ct_frame *parent;
    ct_var *vars;
    size_t n, cap;
} ct_frame;

typedef struct ct_state {
    const json_t *ctx; /* the caller's variables */
    ct_frame *global;  /* the template's top-level frame: macros see it */
    size_t steps;
    int depth;        /* evaluation nesting */
    int calls;        /* macro calls nested */
    int flow;         /* 1 after {% break %}, 2 after {% continue %} */
    time_t now;       /* strftime_now's clock */
    int now_utc;      /* ctx gave rekv_now: format in UTC, for reproducible tests */
    size_t out_total; /* bytes produced so far, all buffers together */
    size_t work;      /* bytes and items operated on so far (CT_MAX_WORK) */
    ct_tuples tuples;
    rekv_err *err;
} ct_state;

int ct_bin_op(ct_state *st, const ct_node *at, int op, ctv *x, ctv *y, ctv *out);
int ct_eval(ct_state *st, ct_frame *f, const ct_node *n, ctv *out);
int ct_exec(ct_state *st, ct_frame *f, const ct_node *n, ct_buf *out);
int ct_frame_set(ct_frame *f, const char *name, ctv v); /* steals v */
void ct_frame_clear(ct_frame *f);
int ct_render_errf(ct_state *st, const ct_node *at, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int ct_out(ct_state *st, ct_buf *out, const void *p, size_t n);
/* Adds units to the render's work (CT_MAX_WORK); -E2BIG past it. */
int ct_charge(ct_state *st, const ct_node *at, size_t units);
/* Marks arr (a new array) as a tuple, for printing and startswith; -ENOMEM. */
int ct_mark_tuple(ct_state *st, json_t *arr);
/* A new string value from b's bytes, refused past CT_MAX_OUTPUT or after a failed append; frees
 * b's memory either way. */
int ct_take_string(ct_state *st, const ct_node *at, ct_buf *b, ctv *out);

/* ---------------------------------------------------------------- filters, tests, methods */

/* Positional args evaluated, and keyword args by name (NULL where positional). */
typedef struct ct_args {
    ctv *v;
    const char **kw;
    size_t n;
} ct_args;

int ct_filter_index(const char *name); /* -1 when not in the subset */
int ct_test_index(const char *name);
int ct_is_method_name(const char *name);
int ct_builtin_index(const char *name); /* CT_FN_*, or -1 */
int ct_apply_filter(ct_state *st, const ct_node *at, int idx, ctv *subject, ct_args *a, ctv *out);
int ct_apply_test(ct_state *st, const ct_node *at, int idx, ctv *subject, ct_args *a, int *res);
int ct_call_method(ct_state *st, const ct_node *at, ctv *self, const char *name, ct_args *a,
                   ctv *out);
int ct_call_builtin(ct_state *st, const ct_node *at, int id, ct_args *a, ctv *out);
/* Iteration as Python's for: a list's items, a dict's keys, a string's characters; undefined is
 * empty. Returns a new array. */
int ct_iter_list(ct_state *st, const ct_node *at, const ctv *v, json_t **out);
/* Getattr/getitem as Jinja2's sandbox does them, for values that are not methods. */
int ct_getitem(ct_state *st, const ct_node *at, const ctv *obj, const ctv *key, ctv *out);

#endif
