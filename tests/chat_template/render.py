#!/usr/bin/python3
"""render.py — the independent oracle for rekv's chat-template renderer (loader/chat_template*.c).

Renders every template of TEMPLATE_DIR (*.jinja) on every conversation of CONV_DIR (*.json, each
{"description": ..., "vars": {...}}) with Jinja2 set up exactly as HF transformers'
apply_chat_template sets it up: ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True, extensions=[loopcontrols]), HF's own tojson filter (json.dumps with
ensure_ascii=False and the indent asked for, where Jinja2's would escape HTML), and the globals
raise_exception (a TemplateError with the message) and strftime_now (the time now; here the
conversation's "rekv_now" in UTC when it gives one, as rekv's renderer does).

Prints one JSON array: per template and conversation {"template", "conversation", and "output"
or "error" with "raised": true when the template's raise_exception raised it}.

render.py --cases FILE renders instead each {"template": SOURCE, "vars": {...}} of the JSON array
in FILE (the unit cases of tests/test_chat_template.c) and prints their results in order.
Run with Debian's /usr/bin/python3 (python3-jinja2)."""
import datetime
import json
import os
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def make_env(variables):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        if "rekv_now" in variables:
            t = datetime.datetime.fromtimestamp(variables["rekv_now"], datetime.timezone.utc)
            return t.strftime(fmt)
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(source, variables):
    try:
        out = make_env(variables).from_string(source).render(**variables)
        return {"output": out}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e), "raised": type(e) is jinja2.exceptions.TemplateError}
    except Exception as e:  # a Python TypeError and the like: the template failed
        return {"error": "%s: %s" % (type(e).__name__, e), "raised": False}


def main():
    if sys.argv[1] == "--cases":
        with open(sys.argv[2], encoding="utf-8") as f:
            cases = json.load(f)
        json.dump([render(c["template"], c["vars"]) for c in cases], sys.stdout,
                  ensure_ascii=False)
        return
    tdir, cdir = sys.argv[1], sys.argv[2]
    results = []
    for t in sorted(f for f in os.listdir(tdir) if f.endswith(".jinja")):
        with open(os.path.join(tdir, t), encoding="utf-8") as f:
            source = f.read()
        for c in sorted(f for f in os.listdir(cdir) if f.endswith(".json")):
            with open(os.path.join(cdir, c), encoding="utf-8") as f:
                variables = json.load(f)["vars"]
            r = render(source, variables)
            r.update(template=t, conversation=c)
            results.append(r)
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
