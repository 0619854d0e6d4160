#!/usr/bin/python3
"""gen_conversations.py — random conversations on the real chat templates, for
tests/test_chat_template.c (test_real_templates_on_random_conversations).

gen_conversations.py SEED COUNT TEMPLATE_DIR prints a JSON array of COUNT {"template", "vars",
"name"}: a template of TEMPLATE_DIR (*.jinja) and variables as a server passes them: messages
(system, user, assistant, tool; contents as text with quotes, newlines, Unicode, template-like
text, or None, a list of typed parts, an object; tool calls with object or string arguments),
tools, add_generation_prompt, date_string, tools_in_user_message, builtin_tools, bos/eos tokens
and rekv_now (strftime_now's time). Jinja2 (render.py --cases) and rekv must then give the same
text, or both fail, with the same message where the template's raise_exception raised. The same
SEED always gives the same cases."""
import json
import os
import random
import sys

rng = random.Random()
TEXTS = ["hi", " padded \n", "", "multi\nline\n\n", "quote ' and \" and \\\\ backslash",
         "ünïcödé ✓ 中文 😀", "<think>r</think>\n\nans", "{\"json\": [1, 2]}", "\t tab",
         "tail </think>", "a" * 50, "\u00a0nbsp\u2003", "<|im_end|>", "{{ not a tag }}", "{% raw %}"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": " The city "},
            "days": {"type": "integer", "description": "Days"},
            "either": {"type": ["string", "integer"], "description": "Either"},
            "flags": {"type": "object", "additionalProperties": {"type": "boolean"},
                      "description": "Flags"}},
            "required": ["city"]},
        "return": {"type": "number", "description": "Degrees."}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search — für alle.",
        "parameters": {"type": "object", "properties": {
            "q": {"type": "string", "description": "Query"}}}}},
]


def content():
    r = rng.random()
    if r < 0.8:
        return rng.choice(TEXTS)
    if r < 0.88:
        return None
    if r < 0.95:
        return [{"type": "text", "text": rng.choice(TEXTS)}]
    return {"content": rng.choice(TEXTS)}


def tool_call(i):
    args = rng.choice([{"city": "Paris"}, {"n": 1, "f": 1.5, "b": True, "z": None, "l": [1, "x"]},
                       "{\"q\": 1}", {}])
    return {"id": rng.choice(["call00001", "abc", "call%05d" % i]), "type": "function",
            "function": {"name": rng.choice(["get_weather", "search"]), "arguments": args}}


def message():
    role = rng.choice(["user", "user", "assistant", "assistant", "system", "tool"])
    m = {"role": role, "content": content()}
    if role == "assistant" and rng.random() < 0.3:
        m["tool_calls"] = [tool_call(i) for i in range(rng.choice([1, 1, 2]))]
        if rng.random() < 0.5:
            m["content"] = None
    if role == "tool":
        m["tool_call_id"] = rng.choice(["call00001", "short"])
    return m


def variables():
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice(TEXTS)})
    alternate = rng.random() < 0.6  # mostly well-formed turns, else anything
    for k in range(rng.randint(0, 6)):
        if alternate:
            msgs.append({"role": "user" if k % 2 == 0 else "assistant",
                         "content": rng.choice(TEXTS)})
        else:
            msgs.append(message())
    v = {"messages": msgs, "bos_token": "<s>", "eos_token": "</s>",
         "rekv_now": 1700000000 + rng.randint(0, 10**8)}
    if rng.random() < 0.5:
        v["add_generation_prompt"] = rng.random() < 0.5
    if rng.random() < 0.4:
        v["tools"] = rng.choice([TOOLS, TOOLS[:1], [], None])
    if rng.random() < 0.1:
        v["tools_in_user_message"] = False
    if rng.random() < 0.1:
        v["date_string"] = "01 Jan 2030"
    if rng.random() < 0.05:
        v["builtin_tools"] = ["code_interpreter", "brave_search"]
    return v


def main():
    rng.seed(int(sys.argv[1]))
    tdir = sys.argv[3]
    names = sorted(f for f in os.listdir(tdir) if f.endswith(".jinja"))
    sources = {}
    for n in names:
        with open(os.path.join(tdir, n), encoding="utf-8") as f:
            sources[n] = f.read()
    cases = []
    for _ in range(int(sys.argv[2])):
        name = rng.choice(names)
        cases.append({"template": sources[name], "vars": variables(), "name": name})
    json.dump(cases, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
