#!/usr/bin/python3
"""gen_cases.py — random small templates for the differential test of rekv's chat-template
renderer (tests/test_chat_template.c, test_random_templates_match_jinja2).

gen_cases.py SEED COUNT prints a JSON array of COUNT {"template", "vars"}: templates built at
random from the subset's pieces (output tags, if/elif/else, for with loop variables, filters and
else, set and namespaces, break/continue, comments, whitespace control, filters, tests, methods,
operators, slices, literals) over a fixed set of variables. The test renders each with Jinja2
(render.py --cases) and with rekv: where rekv renders, its text must be Jinja2's; rekv may refuse
what Jinja2 renders (a construct outside the subset), never render what Jinja2 refuses or render
it differently. The same SEED always gives the same templates."""
import json
import random
import sys

rng = random.Random()
VARS = {"s": " Hello, World! ", "t": "a</think>b", "n": None, "i": 3, "j": -7, "f": 2.5, "z": 0,
        "b": True, "e": "", "l": [1, "x", None, 2.0], "el": [], "d": {"k": "v", "n": 1, "role": "user"},
        "ed": {}, "m": [{"role": "system", "content": "S"}, {"role": "user", "content": " hi "},
                         {"role": "assistant", "content": "yo", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}],
        "u8": "héllo wörld ✓", "tools": [{"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]}
NAMES = list(VARS) + ["u", "loop", "ns"]
STRS = ["'a'", '"b"', "''", "'x y'", "'\\n'", "'it\\'s'", '"q\\"q"', "'é'", "'<tool>'", "' '", "'role'", "'content'", "'k'"]
FILTERS = ["trim", "tojson", "tojson(indent=2)", "length", "upper", "lower", "capitalize", "title", "default('D')",
           "default('D', true)", "items", "list", "first", "last", "join", "join(', ')", "string", "int", "float",
           "reverse", "abs", "safe", "replace('l', 'L')", "selectattr('role', 'equalto', 'user')", "rejectattr('role')",
           "map(attribute='role')", "select", "reject('none')", "count", "trim('H')", "map('string')", "join(attribute='role')"]
TESTS = ["defined", "undefined", "none", "string", "number", "integer", "float", "boolean", "mapping", "iterable",
         "sequence", "equalto 1", "eq('a')", "ne(2)", "odd", "even", "divisibleby(3)", "lower", "upper", "true", "false",
         "in([1, 'x'])", "gt(1)", "sameas none"]
METHODS = ["strip()", "lstrip()", "rstrip()", "strip(' H')", "split()", "split(',')", "split('</think>')[-1]",
           "startswith('H')", "endswith(' ')", "upper()", "lower()", "replace('o', '0')", "title()", "capitalize()",
           "items()", "keys()", "values()", "get('k')", "get('zz', 5)"]
BINOPS = ["+", "-", "*", "/", "//", "%", "~", "==", "!=", "<", ">", "<=", ">=", "in", "not in", "and", "or", "**"]

def atom(depth):
    r = rng.random()
    if r < 0.35: return rng.choice(NAMES) if rng.random() < 0.2 else rng.choice(list(VARS))
    if r < 0.5: return rng.choice(STRS)
    if r < 0.6: return str(rng.choice([0, 1, 2, -1, 3, 10, 100]))
    if r < 0.65: return rng.choice(["1.5", "0.1", "2.0", "1e3", "1e20"])
    if r < 0.7: return rng.choice(["none", "true", "false", "None", "True"])
    if r < 0.8 and depth < 3: return "[" + ", ".join(expr(depth + 1) for _ in range(rng.randint(0, 3))) + "]"
    if r < 0.85 and depth < 3: return "{" + ", ".join(rng.choice(STRS) + ": " + expr(depth + 1) for _ in range(rng.randint(0, 2))) + "}"
    if depth < 3: return "(" + expr(depth + 1) + ")"
    return rng.choice(NAMES)

def postfix(e, depth):
    # Jinja2 reads "x|f[0]" as "x|(f[0])" and "1.keys" as a float: parenthesize what follows a
    # filter, a test or a number
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        if e[-1:].isdigit() or e.endswith(")") and "|" in e or " is " in e:
            e = "(" + e + ")"
        r = rng.random()
        if r < 0.25: e += "." + rng.choice(["role", "content", "k", "n", "function", "name", "x", "type", "index", "first", "last", "length", "index0", "previtem"])
        elif r < 0.45: e += "[" + rng.choice(["0", "-1", "1", "'role'", "'k'", "5", "'content'", "i"]) + "]"
        elif r < 0.55: e += "[" + rng.choice(["1:", ":-1", "::-1", "1:3", "::2", ":0", "-2:"]) + "]"
        elif r < 0.75: e += "." + rng.choice(METHODS)
        elif r < 0.9: e += "|" + rng.choice(FILTERS)
        else: e += " is " + rng.choice(["", "not "]) + rng.choice(TESTS)
    return e

def expr(depth=0):
    if depth > 3: return postfix(atom(depth), depth)
    r = rng.random()
    if r < 0.55: return postfix(atom(depth), depth)
    if r < 0.8:
        op = rng.choice(BINOPS if rng.random() < 0.4 else ["==", "!=", "and", "or", "~", "in", "not in"])
        return expr(depth + 1) + " " + op + " " + expr(depth + 1)
    if r < 0.88: return "not " + expr(depth + 1)
    if r < 0.93: return "-" + postfix(atom(depth), depth)
    # inline if-else in parentheses: an if statement's test and a for's iterable take none bare
    return "(" + expr(depth + 1) + " if " + expr(depth + 1) + (" else " + expr(depth + 1) if rng.random() < 0.7 else "") + ")"

def ws():
    return rng.choice(["", " ", "\n", "  \n", "\n  ", "\t", "x", "\n\n", " y\n  "])

def sign():
    return rng.choice(["", "", "-", "+"])

def stmt(depth, in_loop):
    r = rng.random()
    if r < 0.3: return ws() + "{{" + rng.choice(["", "-"]) + " " + expr() + " " + rng.choice(["", "-"]) + "}}" + ws()
    if r < 0.45 and depth < 3:
        s = "{%" + sign() + " if " + expr() + " " + sign() + "%}" + body(depth + 1, in_loop)
        if rng.random() < 0.3: s += "{%" + sign() + " elif " + expr() + " %}" + body(depth + 1, in_loop)
        if rng.random() < 0.4: s += "{%" + sign() + " else " + sign() + "%}" + body(depth + 1, in_loop)
        return s + ws() + "{%" + sign() + " endif " + sign() + "%}" + ws()
    if r < 0.6 and depth < 3:
        tgt = rng.choice(["x", "x", "k, v"])
        it = rng.choice(["m", "l", "d", "d.items()", "d|items", "s", "el", "range(3)", "tools", "m[1:]", "[[1, 2], [3, 4]]", expr()])
        flt = (" if " + expr()) if rng.random() < 0.2 else ""
        s = "{%" + sign() + " for " + tgt + " in " + it + flt + " " + sign() + "%}" + body(depth + 1, True)
        if rng.random() < 0.2: s += "{% else %}" + body(depth + 1, in_loop)
        return s + "{%" + sign() + " endfor " + sign() + "%}" + ws()
    if r < 0.75: return "{%" + sign() + " set " + rng.choice(["s", "x", "i", "y", "ns.a", "ns.b"]) + " = " + expr() + " " + sign() + "%}" + ws()
    if r < 0.8 and in_loop: return "{% " + rng.choice(["break", "continue"]) + " %}"
    if r < 0.85: return "{#" + sign() + " c " + sign() + "#}" + ws()
    if r < 0.9: return "{% set ns = namespace(a=1, b='x') %}"
    return ws()

def body(depth, in_loop):
    return "".join(stmt(depth, in_loop) for _ in range(rng.randint(1, 3)))



def main():
    rng.seed(int(sys.argv[1]))
    ns = "{% set ns = namespace(a=1, b='x') %}"
    cases = [{"template": ns + body(0, False), "vars": VARS} for _ in range(int(sys.argv[2]))]
    json.dump(cases, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
