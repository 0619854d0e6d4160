/* test_chat_template.c — the chat-template renderer (loader/chat_template*.c) against Jinja2 as
 * HF transformers sets it up (tests/chat_template/render.py with Debian's python3-jinja2): every
 * real template of ../shared/chat-templates on every conversation of
 * tests/chat_template/conversations renders byte-equal, or fails where Jinja2 fails (with the
 * same message where the template's raise_exception raised); the subset's pieces (whitespace
 * control, loops, filters, tests, methods, macros, scoping) on small templates, and random
 * templates of those pieces, again compared with Jinja2; what the subset refuses at parse time,
 * named with line:col; malformed templates; the bounds on depth, steps and output; and loading a
 * model directory's template. */
#define _GNU_SOURCE
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "loader/chat_template.h"
#include "tests/testutil.h"

#define ORACLE "/usr/bin/python3 tests/chat_template/render.py"
#define CONV_DIR "tests/chat_template/conversations"

/* Where C and Jinja2 differ: the first differing byte and a little context of both. */
static void report_diff(const char *what, const char *want, const char *got)
{
    size_t i = 0;
    while (want[i] && want[i] == got[i])
        i++;
    size_t from = i > 40 ? i - 40 : 0;
    fprintf(stderr, "%s: differs at byte %zu\n  jinja2: %.100s\n  rekv:   %.100s\n", what, i,
            want + from, got + from);
}

/* 1 when the oracle can run: Debian's python3 with python3-jinja2 (deploy/debian-packages.txt).
 * Missing, it fails the test in CI (CI=true) and skips it elsewhere, as tu_shared does. */
static int have_oracle(void)
{
    char *out = NULL;
    int rc = tu_run("/usr/bin/python3 -c 'import jinja2' 2>&1", &out);
    free(out);
    if (rc == 0)
        return 1;
    if (tu_ci())
        ck_abort_msg("/usr/bin/python3 with python3-jinja2 is required (CI=true): the oracle");
    fprintf(stderr, "   skip: /usr/bin/python3 with python3-jinja2 not found\n");
    return 0;
}

/* One render compared with Jinja2's result r ({"output"} or {"error", "raised"}); 1 when equal. */
static int check_one(const char *what, const rekv_chat_template *t, json_t *vars, json_t *r)
{
    char *out = NULL;
    rekv_err err = {0};
    int rc = rekv_chat_template_render(t, vars, &out, &err);
    json_t *want = json_object_get(r, "output");
    int ok;
    if (want) {
        ok = rc == 0 && strcmp(out, json_string_value(want)) == 0;
        if (rc)
            fprintf(stderr, "%s: jinja2 renders, rekv fails: %s\n", what, err.msg);
        else if (!ok)
            report_diff(what, json_string_value(want), out);
    } else {
        const char *msg = json_string_value(json_object_get(r, "error"));
        char raised[1100];
        snprintf(raised, sizeof raised, "raise_exception: %s", msg);
        ok = rc < 0 && (!json_is_true(json_object_get(r, "raised")) || strstr(err.msg, raised));
        if (!ok)
            fprintf(stderr, "%s: jinja2 fails with \"%s\", rekv %s%s\n", what, msg,
                    rc ? "fails with: " : "renders", rc ? err.msg : "");
    }
    free(out);
    return ok;
}

START_TEST(test_real_templates_match_jinja2)
{
    const char *dir = tu_shared("chat-templates");
    if (dir == NULL || !have_oracle())
        return;
    char cmd[512], *js = NULL;
    snprintf(cmd, sizeof cmd, ORACLE " %s " CONV_DIR, dir);
    ck_assert_msg(tu_run(cmd, &js) == 0, "the oracle failed: %s", cmd);
    json_error_t je;
    json_t *results = json_loads(js, 0, &je);
    ck_assert_msg(json_is_array(results), "oracle output: %s", je.text);
    ck_assert_uint_ge(json_array_size(results), 8 * 14);
    size_t i, bad = 0, errors = 0;
    json_t *r;
    json_array_foreach(results, i, r)
    {
        const char *tn = json_string_value(json_object_get(r, "template"));
        const char *cn = json_string_value(json_object_get(r, "conversation"));
        char path[1024], what[512];
        snprintf(path, sizeof path, "%s/%s", dir, tn);
        char *src = tu_read_file(path, NULL);
        ck_assert_ptr_nonnull(src);
        rekv_chat_template *t;
        rekv_err err = {0};
        ck_assert_msg(rekv_chat_template_parse(src, &t, &err) == 0, "%s: %s", tn, err.msg);
        snprintf(path, sizeof path, CONV_DIR "/%s", cn);
        json_t *conv = json_load_file(path, 0, &je);
        ck_assert_msg(conv != NULL, "%s: %s", path, je.text);
        snprintf(what, sizeof what, "%s on %s", tn, cn);
        bad += !check_one(what, t, json_object_get(conv, "vars"), r);
        errors += json_object_get(r, "error") != NULL;
        json_decref(conv);
        rekv_chat_template_free(t);
        free(src);
    }
    ck_assert_msg(bad == 0, "%zu of %zu renders differ from Jinja2's (above)", bad,
                  json_array_size(results));
    ck_assert_msg(errors > 0 && errors < json_array_size(results) / 2,
                  "the conversations should make some templates fail and most render");
    json_decref(results);
    free(js);
}
END_TEST

/* Small templates on the subset's pieces: {template, vars}, each compared with Jinja2's. */
static const char *const unit_cases[][2] = {
    /* whitespace control, trim_blocks, lstrip_blocks, comments, "+" */
    {"a\n  {% if true %}\n  b\n  {% endif %}\nc\n", "{}"},
    {"a  {{- x -}}  b {#- c -#} d\n{# e #}\nf {%+ if true %} g {% endif +%}\nh", "{\"x\": 1}"},
    {"  {{ x }}  \n\t{% for i in [1,2] %}  {{ i }}\n{% endfor %}\n\n", "{\"x\": \"v\"}"},
    {"{% if true -%}\n\n  x  \n{%- endif %}\r\ny\r\n", "{}"},
    {"{# only a comment #}\n  {#- c2 #}  z", "{}"},
    /* loops: loop vars, dict items, filter, else, break/continue, scoping */
    {"{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
     "{{ loop.length }}{{ loop.revindex }}{{ loop.previtem }}|{{ loop.nextitem }};{% endfor %}",
     "{\"xs\": [\"a\", \"b\", \"c\"]}"},
    {"{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}{% for k, v in d|items %}{{ k }}{% "
     "endfor %}{% for k in d %}{{ k }}{% endfor %}",
     "{\"d\": {\"z\": 1, \"a\": [1, 2], \"m\": null}}"},
    {"{% for x in xs if x > 1 %}{{ x }}{{ loop.last }}{% else %}none{% endfor %}"
     "{% for x in [] %}{% else %}empty{% endfor %}",
     "{\"xs\": [3, 1, 2]}"},
    {"{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break "
     "%}{% endif %}{{ x }}{% endfor %}",
     "{}"},
    {"{% for x in [1, 2] %}{% continue %}{% else %}E{% endfor %}|{% for x in [1, 2] %}{{ x }}"
     "{% break %}{% else %}E{% endfor %}|{% for x in [1, 2] %}{% if x == 2 %}{% break %}{% endif "
     "%}{% else %}E{% endfor %}",
     "{}"},
    {"{% set y = 5 %}{% for i in [1, 2] %}{{ y }}{% set y = i %}{{ y }}{% endfor %}{{ y }}"
     "{% if true %}{% set z = 3 %}{% endif %}{{ z }}",
     "{}"},
    {"{% set ns = namespace(n=0, s='') %}{% for c in 'héllo' %}{% set ns.n = ns.n + 1 %}"
     "{% set ns.s = c ~ ns.s %}{% endfor %}{{ ns.n }} {{ ns.s }}",
     "{}"},
    /* filters */
    {"{{ s|trim }}|{{ s|length }}|{{ s|upper }}|{{ s|lower }}|{{ s|capitalize }}|{{ s|title }}|"
     "{{ s|replace('l', 'L') }}|{{ s|replace('', '-') }}|{{ u|default('dflt') }}|"
     "{{ e|default('x', true) }}|{{ xs|join(', ') }}|{{ xs|first }}{{ xs|last }}|{{ xs|length }}",
     "{\"s\": \"  hello world \\n\", \"e\": \"\", \"xs\": [1, \"b\", 2.5]}"},
    {"{{ ms|selectattr('role', 'equalto', 'user')|list|length }}"
     "{{ ms|rejectattr('role', 'equalto', 'user')|map(attribute='c')|join }}"
     "{{ ms|map(attribute='role')|list }}{{ xs|reject('equalto', 2)|list }}"
     "{{ xs|select('odd')|list }}{{ ms|selectattr('c')|list|length }}",
     "{\"ms\": [{\"role\": \"user\", \"c\": \"x\"}, {\"role\": \"bot\", \"c\": \"y\"}, {\"role\": "
     "\"user\", \"c\": \"\"}], \"xs\": [1, 2, 3]}"},
    {"{{ v|tojson }}\n{{ v|tojson(indent=2) }}\n{{ v|tojson(indent=0) }}\n{{ 'x\\u00e9\"\\n\\t'"
     "|tojson }}{{ [[], {}]|tojson(indent=4) }}",
     "{\"v\": {\"a\": [1, 2.0, 1e-07, 1e+22, 0.1, -0.0, true, null], \"b\": {\"c\": "
     "\"é\\u0001<>&'\"}}}"},
    {"{{ '42'|int + 1 }} {{ 'x'|int }} {{ 3.9|int }} {{ '2.5'|float }} {{ 7|string + 'a' }} "
     "{{ [3, 1]|reverse|list }} {{ 'abc'|reverse }} {{ -3|abs }} {{ x|string }}",
     "{\"x\": [1, \"a\", {\"k\": null, \"q\": \"it's\"}, true, 1.5]}"},
    /* tests */
    {"{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ n is none }}{{ s is string }}"
     "{{ d is mapping }}{{ s is iterable }}{{ 1 is number }}{{ d is iterable }}{{ 3 is odd }}"
     "{{ 4 is even }}{{ 6 is divisibleby 3 }}{{ s is sequence }}{{ x is not none }}"
     "{{ y is iterable }}{{ n is sameas none }}{{ 1.5 is float }}{{ true is boolean }}",
     "{\"x\": 1, \"n\": null, \"s\": \"str\", \"d\": {}}"},
    /* expressions, methods, slices */
    {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 "
     "}} {{ 'a' ~ 1 ~ none }} {{ 'a' * 3 }} {{ [1] + [2] }} {{ 1 == 1.0 }} {{ 'b' > 'a' }} "
     "{{ 'x' in 'xyz' }} {{ 2 not in [1] }} {{ 'k' in d }} {{ 0 or 'z' }} {{ 1 and 2 }} "
     "{{ not 0 }} {{ 'y' if x else 'n' }} {{ 'y' if not x }} {{ (1, 2) }} {{ (1,) }} {{ -x }} "
     "{{ d|items|list }} {{ d.items()|list }} {{ [(1, 'a')]|tojson }}",
     "{\"x\": 3, \"d\": {\"k\": 1}}"},
    {"{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.strip(' a') }}|{{ s.split() }}|"
     "{{ s.split('a') }}|{{ s.split(' ', 1) }}|{{ s.startswith(' a') }}{{ s.endswith('c ') }}|"
     "{{ s.upper() }}|{{ s.replace('b', 'B') }}|{{ d.get('k') }}{{ d.get('z') }}"
     "{{ d.get('z', 5) }}|{{ d.keys()|list }}{{ d.values()|list }}|{{ s[1:4] }}|{{ s[::-1] }}|"
     "{{ xs[1:] }}{{ xs[:-1] }}{{ xs[-1] }}{{ xs[::2] }}{{ xs[5] }}|{{ 'añb'[1] }}{{ d['k'] }}"
     "{{ xs.0 }}",
     "{\"s\": \" a b  c \", \"d\": {\"k\": 1}, \"xs\": [1, 2, 3, 4]}"},
    {"{{ c.split('</think>')[-1] }}|{{ '\\xe9\\u00e9\\n' }}|{{ \"a\" 'b' }}|{{ m == ms[-1] }}",
     "{\"c\": \"<think>x</think>\\n\\nanswer\", \"m\": {\"a\": [1]}, \"ms\": [{\"a\": [1.0]}]}"},
    /* macros */
    {"{% macro f(a, b='B', c=none) %}[{{ a }}{{ b }}{{ c }}{{ g }}]{% endmacro %}{% set g = 'G' "
     "%}{{ f(1) }}{{ f(1, 2) }}{{ f(1, c=3) }}{{ f('x') + '!' }}",
     "{}"},
    {"{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% "
     "endmacro %}{{ fact(10) }}",
     "{}"},
    /* printing Python values */
    {"{{ none }} {{ true }} {{ 1.0 }} {{ 1e20 }} {{ 1/3 }} {{ [1, 'a', none, {'k': \"it's\"}] "
     "}} {{ 100000000000000000.0 }} {{ 0.0001 }} {{ 0.00001 }} {{ u }}|{{ s }}",
     "{\"s\": \"quote\\\"s 'and' \\u0007\"}"},
    /* errors: raise_exception, undefined use, type errors */
    {"{{ raise_exception('bad ' ~ x) }}", "{\"x\": 1}"},
    {"{{ 'a' + 1 }}", "{}"},
    {"{{ u.v }}", "{}"},
    {"{{ 1 / 0 }}", "{}"},
    {"{{ strftime_now('%Y-%m-%d %b %a') }}", "{\"rekv_now\": 1700000000}"},
    /* undefined and none as Jinja2's Undefined and Python's None behave */
    {"{{ n.v is defined }}|{{ n.v }}|{{ n['v'] }}|{{ 5.v }}|{{ 'ab'.v }}|{{ u|trim }}|"
     "{{ u|length }}|{{ u|list }}|{{ u|join }}|{{ u|first }}|{{ u|default(3) }}|{{ u is none }}|"
     "{{ u|string }}|{{ x ~ u ~ 'a' }}|{{ u == u }}|{{ u != 1 }}|{{ not u }}|{{ u or 'd' }}|"
     "{{ 'a' in u }}|{% for x in u %}a{% else %}b{% endfor %}",
     "{\"n\": null, \"x\": 1}"},
    {"{{ u.v is defined }}", "{}"},
    {"{{ 1 < x < 3 }}{{ 1 < x > 5 }}{{ 0 == 0 != 1 in [1] }}"
     "{{ 5 is lower }}{{ [['a']] is lower }}{{ u is upper }}"
     "{% set ns = namespace(a=1) %}{% set ns.a = u %}{{ ns.a is defined }}",
     "{\"x\": 2, \"n\": null}"},
    /* generators and iterators: true even when empty, iterable, not printable */
    {"{{ x|title }}|{{ 'ab-cd (ef) g_h x1y'|title }}|{{ 'ab-cd x1y'.title() }}|"
     "{{ not ([]|reverse) }}{{ not ([]|select) }}{{ not (u|items) }}{{ not {}.items() }}|"
     "{{ [1, 2]|reverse|list }}{{ ([1, 2]|select)|reverse }}{{ 1 in [1]|select }}"
     "{{ {'a': 1}.keys()|length }}{{ [3]|map('string')|first }}",
     "{\"x\": [{\"type\": \"function\"}]}"},
    {"{{ u|int }}", "{}"},
    {"{{ 'ab'.index|length }}", "{}"},
    {"{{ ([1]|select)|last }}", "{}"},
    {"{{ 'abc'.startswith(('x', 'a')) }}{{ 'abc'.endswith(('x',)) }}{{ x|join(d='-') }}"
     "{{ u|default(default_value=3) }}{{ x|map(attribute='k', default='?')|list }}",
     "{\"x\": [1, 2]}"},
    {"{{ [s] }}{{ {s: 1} }}{{ s|tojson }}",
     "{\"s\": \"a\\u2003b\\u200bc\\u3000d\\ue000e\\u061cf\\u00a0g\\u00adh\\u2066i\\ufeffj"
     "\\ud83d\\ude00k\\u4e2dl\\u0301m\\u202fn\\u2029\\u0085\\u007f\\\\'\\\"\"}"},
    {"{{ '0x1A'|int }} {{ ' 42 '|int }} {{ '4.5'|int }} {{ '-.5e1'|float }} {{ '1e'|int }} "
     "{{ 'abc'|float }} {{ '5.'|float }} {{ '+3'|int }} {{ ''|int }} {{ true|float }}",
     "{}"},
    {"{{ 'a\\101\\0b\\q\\7\\x41\\U0001F600'|tojson }}", "{}"},
    {"{{ u|tojson }}", "{}"},
    {"{{ none|length }}", "{}"},
    {"{{ u + 1 }}", "{}"},
    {"{% for x in none %}{% endfor %}", "{}"},
    {"{{ [1, 2, 3]|select('gt', 1)|list }}{{ ['a', 'B']|map('upper')|list }}"
     "{{ [1, none]|reject('none')|list }}{{ {'b': 1, 'a': 2} }}{{ {'b': 1, 'a': 2}|tojson }}"
     "{{ d|tojson }}{{ 3 * 'ab' }}{{ [1] * 2 }}{{ 0 * [1] }}",
     "{\"d\": {\"z\": 1, \"a\": {\"y\": [], \"b\": {}}}}"},
    {"{{ 10 / 4 }} {{ 10 / 5 }} {{ 2 ** -1 }} {{ 2.5 // 1 }} {{ -2.5 % 2 }} {{ 1e300 * 10 }} "
     "{{ 'abc'|replace('b', 'X', 0) }}{{ 'a-b-c'.split('-', 1) }}",
     "{}"},
    {"{% if true %}\n  {{ 'x' }}\n{% endif %}\n  {%- if true %} y {% endif -%}\n z"
     "{%- set x -%}\n  block {{ 1 }}\n{%- endset %}[{{ x }}]",
     "{}"},
};

START_TEST(test_subset_matches_jinja2)
{
    if (!have_oracle())
        return;
    size_t n = sizeof unit_cases / sizeof unit_cases[0];
    json_t *cases = json_array();
    for (size_t i = 0; i < n; i++) {
        json_error_t je;
        json_t *vars = json_loads(unit_cases[i][1], 0, &je);
        ck_assert_msg(vars != NULL, "case %zu vars: %s", i, je.text);
        json_array_append_new(cases,
                              json_pack("{s:s,s:o}", "template", unit_cases[i][0], "vars", vars));
    }
    char *dir = tu_tmpdir(), path[1024], cmd[1200], *js = NULL;
    snprintf(path, sizeof path, "%s/cases.json", dir);
    ck_assert_int_eq(json_dump_file(cases, path, 0), 0);
    snprintf(cmd, sizeof cmd, ORACLE " --cases %s", path);
    ck_assert_msg(tu_run(cmd, &js) == 0, "the oracle failed: %s", cmd);
    json_error_t je;
    json_t *results = json_loads(js, 0, &je);
    ck_assert_msg(json_array_size(results) == n, "oracle output: %s", je.text);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        rekv_chat_template *t;
        rekv_err err = {0};
        char what[64];
        snprintf(what, sizeof what, "unit case %zu", i);
        if (rekv_chat_template_parse(unit_cases[i][0], &t, &err) != 0) {
            fprintf(stderr, "%s: refused: %s\n", what, err.msg);
            bad++;
            continue;
        }
        json_t *c = json_array_get(cases, i);
        bad += !check_one(what, t, json_object_get(c, "vars"), json_array_get(results, i));
        rekv_chat_template_free(t);
    }
    ck_assert_msg(bad == 0, "%zu of %zu unit cases differ from Jinja2 (above)", bad, n);
    json_decref(results);
    json_decref(cases);
    free(js);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

typedef struct cmp_counts {
    size_t n, same, both_fail, refused, bad;
} cmp_counts;

/* Runs gen (a command printing [{template, vars}] cases) and the oracle on its cases, and
 * renders each with rekv. strict: rekv renders exactly what Jinja2 renders and fails where it
 * fails (check_one); else rekv may also refuse what Jinja2 renders. Differences go to stderr. */
static cmp_counts compare_generated(const char *gen, int strict)
{
    cmp_counts k = {0};
    char *dir = tu_tmpdir(), cmd[4200], *js = NULL;
    snprintf(cmd, sizeof cmd, "%s > %s/cases.json && " ORACLE " --cases %s/cases.json 2>/dev/null",
             gen, dir, dir);
    ck_assert_msg(tu_run(cmd, &js) == 0, "the oracle failed: %s", cmd);
    json_error_t je;
    json_t *results = json_loads(js, 0, &je);
    snprintf(cmd, sizeof cmd, "%s/cases.json", dir);
    json_t *cases = json_load_file(cmd, 0, &je);
    k.n = json_array_size(cases);
    ck_assert_msg(k.n > 0 && json_array_size(results) == k.n, "%s", je.text);
    for (size_t i = 0; i < k.n; i++) {
        json_t *c = json_array_get(cases, i), *r = json_array_get(results, i);
        const char *src = json_string_value(json_object_get(c, "template"));
        json_t *want = json_object_get(r, "output");
        char what[128];
        snprintf(what, sizeof what, "generated case %zu (%s)", i,
                 json_is_string(json_object_get(c, "name"))
                     ? json_string_value(json_object_get(c, "name"))
                     : "random template");
        rekv_chat_template *t;
        rekv_err err = {0};
        if (rekv_chat_template_parse(src, &t, &err) != 0) {
            if (strict && want)
                fprintf(stderr, "%s: jinja2 renders, rekv refuses: %s\n", what, err.msg);
            k.refused += want != NULL;
            k.both_fail += want == NULL;
            k.bad += strict && want;
            continue;
        }
        char *out = NULL;
        int rc = rekv_chat_template_render(t, json_object_get(c, "vars"), &out, &err);
        if (rc == 0 && want && strcmp(out, json_string_value(want)) == 0)
            k.same++;
        else if (strict || rc == 0) { /* the strict rule, or rekv rendered: it must be Jinja2's */
            int ok = check_one(what, t, json_object_get(c, "vars"), r);
            k.bad += !ok;
            k.both_fail += ok;
            if (!ok && !strict)
                fprintf(stderr, "  template: %s\n", src);
        } else {
            k.refused += want != NULL;
            k.both_fail += want == NULL;
        }
        free(out);
        rekv_chat_template_free(t);
    }
    fprintf(stderr, "   %zu generated cases: %zu equal, %zu failing in both, %zu refused by rekv\n",
            k.n, k.same, k.both_fail, k.refused);
    json_decref(results);
    json_decref(cases);
    free(js);
    tu_rmrf(dir);
    free(dir);
    return k;
}

/* Random templates of the subset's pieces (tests/chat_template/gen_cases.py, a fixed seed), each
 * rendered by Jinja2 and by rekv: rekv may refuse what Jinja2 renders, never render what Jinja2
 * refuses nor render it differently. Enough must render for the comparison to mean something. */
START_TEST(test_random_templates_match_jinja2)
{
    if (!have_oracle())
        return;
    cmp_counts k = compare_generated("/usr/bin/python3 tests/chat_template/gen_cases.py 1 600", 0);
    ck_assert_msg(k.bad == 0, "%zu of %zu random templates render differently (above)", k.bad, k.n);
    ck_assert_msg(k.same >= k.n / 10 && k.refused <= k.n / 20,
                  "%zu equal and %zu refused: the cases should mostly render or fail in both",
                  k.same, k.refused);
}
END_TEST

/* The real templates on random conversations (tests/chat_template/gen_conversations.py, a fixed
 * seed): rekv renders every one as Jinja2 does, or fails where Jinja2 fails. */
START_TEST(test_real_templates_on_random_conversations)
{
    const char *dir = tu_shared("chat-templates");
    if (dir == NULL || !have_oracle())
        return;
    char gen[1100];
    snprintf(gen, sizeof gen, "/usr/bin/python3 tests/chat_template/gen_conversations.py 1 400 %s",
             dir);
    cmp_counts k = compare_generated(gen, 1);
    ck_assert_msg(k.bad == 0, "%zu of %zu renders differ from Jinja2's (above)", k.bad, k.n);
    ck_assert_msg(k.same >= k.n / 2, "only %zu of %zu render: the conversations should mostly fit",
                  k.same, k.n);
}
END_TEST

/* Parses src, which must be refused with every one of the words in want (NULL-terminated). */
static void check_refused(const char *src, const char *want1, const char *want2)
{
    rekv_chat_template *t = NULL;
    rekv_err err = {0};
    int rc = rekv_chat_template_parse(src, &t, &err);
    ck_assert_msg(rc == -EINVAL, "\"%s\" was not refused", src);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(err.msg, want1) && (want2 == NULL || strstr(err.msg, want2)),
                  "\"%s\": error \"%s\" lacks \"%s\" / \"%s\"", src, err.msg, want1,
                  want2 ? want2 : "");
    ck_assert_msg(strchr(err.msg, '\n') == NULL, "one line: %s", err.msg);
}

START_TEST(test_unsupported_refused_with_name)
{
    check_refused("{% include 'other.jinja' %}", "statement '{% include %}'", "1:4");
    check_refused("a\n  {% raw %}{{ x }}{% endraw %}", "'{% raw %}'", "2:6");
    check_refused("{% generation %}x{% endgeneration %}", "'{% generation %}'", NULL);
    check_refused("{% extends 'base' %}", "extends", NULL);
    check_refused("{% with a = 1 %}{% endwith %}", "'{% with %}'", NULL);
    check_refused("{{ x|wordcount }}", "filter 'wordcount'", "1:6");
    check_refused("{{ x is callable }}", "test 'callable'", NULL);
    check_refused("{{ lipsum() }}", "'lipsum'", NULL);
    check_refused("\n\n{{ helper(1) }}", "function 'helper'", "3:");
    check_refused("{{ '{}'.format(1) }}", "method '.format()'", NULL);
    check_refused("{{ xs.append(1) }}", "method '.append()'", NULL);
    check_refused("{% for x in xs recursive %}{% endfor %}", "'recursive'", NULL);
    check_refused("{% macro m() %}{{ caller() }}{% endmacro %}", "'caller'", NULL);
    check_refused("{% set a, b = 1, 2 %}", "several targets", NULL);
    check_refused("{{ f(*xs) }}", "*args", NULL);
    check_refused("{% if a if b else c %}{% endif %}", "expected end of block tag", NULL);
    check_refused("{% break %}", "outside a loop", NULL);
    check_refused("{{ loop.cycle('a', 'b') }}", "method '.cycle()'", NULL);
}
END_TEST

START_TEST(test_malformed_refused)
{
    check_refused("{% if x %}never closed", "missing '{% endif %}'", NULL);
    check_refused("{% for x in y %}", "missing '{% endfor %}'", NULL);
    check_refused("{{ x ", "missing end of variable tag", "1:");
    check_refused("{{ 'abc }}", "unterminated string", "1:4");
    check_refused("ok\n{% endfor %}", "unexpected '{% endfor %}'", "2:4");
    check_refused("{{ (1 }}", "unbalanced bracket", NULL);
    check_refused("{{ }}", "expected an expression", NULL);
    check_refused("{# never closed", "missing end of comment", NULL);
    check_refused("{% if %}{% endif %}", "expected an expression", NULL);
    check_refused("{{ x $ y }}", "unexpected character '$'", NULL);
    check_refused("{% for in xs %}{% endfor %}", "expected 'in'", NULL);
    check_refused("{{ x | }}", "expected a filter name", NULL);
    check_refused("{{ '\\u12' }}", "escape", NULL);
    check_refused("{{ '\\N{EM DASH}' }}", "\\N{...}", NULL);
}
END_TEST

/* Renders src (which parses) and expects the render to fail with want in the message. */
static void check_render_fails(const char *src, const char *want)
{
    rekv_chat_template *t;
    rekv_err err = {0};
    ck_assert_msg(rekv_chat_template_parse(src, &t, &err) == 0, "%s: %s", src, err.msg);
    json_t *vars = json_object();
    char *out = NULL;
    int rc = rekv_chat_template_render(t, vars, &out, &err);
    ck_assert_msg(rc < 0, "\"%.60s\" rendered", src);
    ck_assert_ptr_null(out);
    ck_assert_msg(strstr(err.msg, want), "\"%.60s\": error \"%s\" lacks \"%s\"", src, err.msg,
                  want);
    json_decref(vars);
    rekv_chat_template_free(t);
}

START_TEST(test_bounds)
{
    /* nesting: parse-time for expressions and statements, render-time for macro recursion */
    char *deep = malloc(4000);
    ck_assert_ptr_nonnull(deep);
    strcpy(deep, "{{ ");
    for (int i = 0; i < 1000; i++)
        strcat(deep, "(");
    check_refused(deep, "nested too deep", NULL);
    deep[0] = '\0';
    for (int i = 0; i < 300; i++)
        strcat(deep, "{% if x %}");
    check_refused(deep, "nested too deep", NULL);
    free(deep);
    check_render_fails("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                       "macro calls nested deeper");
    /* steps: a loop that prints nothing still ends */
    check_render_fails("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                       "{% endfor %}",
                       "loop iterations");
    /* output, and strings that double */
    check_render_fails("{% for i in range(1000000) %}{{ 'x' * 100 }}{% endfor %}",
                       "output longer than");
    check_render_fails("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                       "string longer than");
    check_render_fails("{{ 'x' * 100000000 }}", "string longer than");
    /* work: big values in long loops, each step and the output small */
    check_render_fails("{% set s = 'x' * 10000000 %}{% for i in range(1000000) %}"
                       "{% set t = s.strip() %}{% endfor %}",
                       "units of work");
    check_render_fails("{% for i in range(2000000) %}{% set x = range(2000000) %}{% endfor %}",
                       "units of work");
    check_render_fails("{% set ns = namespace(l=[]) %}{% for i in range(1000000) %}"
                       "{% set ns.l = ns.l + [i] %}{% endfor %}",
                       "units of work");
    /* what Python refuses, refused here too */
    check_render_fails("{{ 'abc'.startswith(['a']) }}", "tuple of str");
    check_render_fails("{% macro m(a, b) %}{% endmacro %}{{ m(1, a=2) }}", "multiple values");
    check_render_fails("{{ [1]|tojson(foo=2) }}", "no keyword argument 'foo'");
    check_render_fails("a{{ '\\0' }}b", "NUL character"); /* a C string would end at it */
    check_render_fails("{{ range(100000000)|length }}", "range() longer");
    /* Python prints these as dict_items([...]) and <generator ...>: not printed here */
    check_render_fails("{{ {'a': 1}.items() }}", "cannot print");
    check_render_fails("{{ {'a': 1}|items }}", "cannot print");
    check_render_fails("{{ [1]|reverse }}", "cannot print"); /* "<list_reverseiterator ...>" */
}
END_TEST

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

static char *render_dir(const char *dir)
{
    rekv_chat_template *t = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_chat_template_load_dir(dir, &t, &err) == 0, "%s", err.msg);
    if (t == NULL)
        return NULL;
    json_t *vars = json_pack("{s:[{s:s,s:s}]}", "messages", "role", "user", "content", "hi");
    char *out = NULL;
    ck_assert_msg(rekv_chat_template_render(t, vars, &out, &err) == 0, "%s", err.msg);
    json_decref(vars);
    rekv_chat_template_free(t);
    return out;
}

START_TEST(test_load_dir)
{
    char *dir = tu_tmpdir();
    ck_assert_ptr_null(render_dir(dir)); /* no template at all: none, and no error */
    write_file(dir, "tokenizer_config.json",
               "{\"bos_token\": {\"content\": \"<s>\", \"lstrip\": false}, \"eos_token\": "
               "\"</s>\", \"additional_special_tokens\": [\"<a>\", {\"content\": \"<b>\"}], "
               "\"chat_template\": \"{{ bos_token }}{% for m in messages %}"
               "{{ m.content }}{% endfor %}{{ eos_token }}{{ additional_special_tokens|join }}\"}");
    char *out = render_dir(dir);
    ck_assert_str_eq(out, "<s>hi</s><a><b>");
    free(out);

    rekv_chat_template *t;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_chat_template_load_dir(dir, &t, &err), 0);
    ck_assert_str_eq(rekv_chat_template_special(t, "bos_token"), "<s>");
    ck_assert_str_eq(rekv_chat_template_special(t, "eos_token"), "</s>");
    ck_assert_ptr_null(rekv_chat_template_special(t, "pad_token"));
    json_t *vars = json_pack("{s:[],s:s}", "messages", "bos_token", "[B]");
    ck_assert_int_eq(rekv_chat_template_render(t, vars, &out, &err), 0);
    ck_assert_str_eq(out, "[B]</s><a><b>"); /* the caller's own value wins */
    free(out);
    json_decref(vars);
    rekv_chat_template_free(t);

    write_file(dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}, "
               "{\"name\": \"default\", \"template\": \"D{{ messages|length }}\"}]}");
    out = render_dir(dir);
    ck_assert_str_eq(out, "D1");
    free(out);

    write_file(dir, "chat_template.jinja", "J{{ messages[0].content }}\n");
    out = render_dir(dir);
    ck_assert_str_eq(out, "Jhi"); /* chat_template.jinja first; its final newline dropped */
    free(out);

    write_file(dir, "chat_template.jinja", "{% include 'x' %}");
    ck_assert_int_eq(rekv_chat_template_load_dir(dir, &t, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "include"), "%s", err.msg);
    char path[1024];
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    unlink(path);

    write_file(dir, "tokenizer_config.json", "{\"chat_template\": [{\"name\": \"x\"}]}");
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_chat_template_load_dir(dir, &t, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "default"), "%s", err.msg);
    write_file(dir, "tokenizer_config.json", "{\"chat_template\": ");
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_chat_template_load_dir(dir, &t, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "tokenizer_config.json"), "%s", err.msg);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("chat_template");
    TCase *tc = tcase_create("chat_template");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_real_templates_match_jinja2);
    tcase_add_test(tc, test_subset_matches_jinja2);
    tcase_add_test(tc, test_random_templates_match_jinja2);
    tcase_add_test(tc, test_real_templates_on_random_conversations);
    tcase_add_test(tc, test_unsupported_refused_with_name);
    tcase_add_test(tc, test_malformed_refused);
    tcase_add_test(tc, test_bounds);
    tcase_add_test(tc, test_load_dir);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
