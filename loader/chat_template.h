/* chat_template.h — a model's chat template (the Jinja2 source in its tokenizer_config.json
 * "chat_template", or chat_template.jinja beside it) rendered by a subset of Jinja written here:
 * what the real templates of today's instruct models use (../shared/chat-templates), each
 * rendering byte-equal to Jinja2's in HF's environment (ImmutableSandboxedEnvironment with
 * trim_blocks, lstrip_blocks and loop controls; HF's tojson; raise_exception and strftime_now).
 * A template using a construct outside the subset is refused at parse time with the construct
 * named and its line:col. Implemented in chat_template*.c (lexer, parser, evaluator, values,
 * operators, filters).
 *
 * The subset: {{ }}, {% %}, {# #} with "-"/"+" whitespace control; if/elif/else, for (one or two
 * targets, an "if" filter, else, loop.index/index0/revindex/revindex0/first/last/length/previtem/
 * nextitem), break/continue, set (also ns.attr and block set), macro (positional, keyword and
 * default arguments, recursion); literals, attribute and subscript access, slices, calls, + - * /
 * // % ** ~, comparisons (chained as in Python), in / not in, and/or/not, inline if-else; tuple
 * literals; filters trim tojson length
 * count upper lower capitalize title default d items selectattr rejectattr select reject map
 * first last join replace string int float list reverse abs safe; tests defined undefined none
 * string number integer float boolean true false mapping iterable sequence equalto eq ne in odd
 * even divisibleby lower upper gt lt ge le sameas; str methods strip lstrip rstrip split
 * startswith endswith upper lower replace title capitalize; dict methods items keys values get;
 * builtins raise_exception(msg), strftime_now(fmt), namespace(k=v, ...), range(...).
 * Values follow Python's: str() and repr() as Python prints them, a generator (select, map,
 * |items, reverse) or dict view (.items()) that iterates but does not print; where Python
 * would print what only Python can (a generator's address, a non-ASCII upper()), the render
 * fails instead. Besides the real templates, tests/chat_template/gen_cases.py's random
 * templates check that rekv never renders what Jinja2 refuses nor renders differently.
 *
 * Bounds (a template is user input): nesting 128 deep, 16 MiB of output (and of any one string),
 * 2,000,000 loop iterations and macro calls, and 2^30 units of work (bytes, and list or dict items
 * at 32 each, that operators, filters and calls take and make) per render. */
#ifndef REKV_LOADER_CHAT_TEMPLATE_H
#define REKV_LOADER_CHAT_TEMPLATE_H

#include <jansson.h>

#include "common/err.h"

typedef struct rekv_chat_template rekv_chat_template;

/* Parses a template's source. -EINVAL with "chat template L:C: ..." for a malformed template or
 * one outside the subset (e.g. "statement '{% include %}' is not supported"). */
int rekv_chat_template_parse(const char *source, rekv_chat_template **out, rekv_err *err);

/* The model directory's template: chat_template.jinja, else tokenizer_config.json's
 * "chat_template" (a string, or the list form's entry named "default"). 0 with *out NULL when the
 * model has none. The special tokens of tokenizer_config.json (bos_token, eos_token, unk_token,
 * sep_token, pad_token, cls_token, mask_token: strings, or objects whose "content" is the string;
 * additional_special_tokens, a list of them) are kept with the template. */
int rekv_chat_template_load_dir(const char *dir, rekv_chat_template **out, rekv_err *err);

/* A special token's text from tokenizer_config.json ("bos_token", "eos_token", "unk_token",
 * "sep_token", "pad_token", "cls_token", "mask_token"), or NULL when the model does not say (or
 * the template was parsed from a string). Owned by the template. */
const char *rekv_chat_template_special(const rekv_chat_template *t, const char *name);

/* Renders with the variables of ctx, a JSON object (messages, tools, add_generation_prompt,
 * bos_token, eos_token, and whatever else the caller sets), into a malloc'd NUL-terminated
 * string. The special tokens the caller does not set come from rekv_chat_template_special.
 * strftime_now(fmt) formats the local time now, as HF's does; a ctx integer "rekv_now" (Unix
 * seconds) pins it, formatted in UTC, for reproducible renders. Llama 3.x templates take
 * "date_string" from ctx before calling strftime_now. Errors (raise_exception's message follows
 * "raise_exception: ", a type error, an undefined value used, a bound passed, a NUL character
 * in the text) are one line in err. A parsed template is not changed by rendering: several
 * threads may render it at once.
 *
 * HF's apply_chat_template always passes tools and documents (None when the request has none)
 * and add_generation_prompt (False by default); a caller after its exact behaviour sets them
 * (null, false) — a template may tell an undefined variable from a null one. */
int rekv_chat_template_render(const rekv_chat_template *t, const json_t *ctx, char **out,
                              rekv_err *err);

void rekv_chat_template_free(rekv_chat_template *t);

#endif
