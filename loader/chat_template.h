/* chat_template.h — a model's chat template (the Jinja2 source in its tokenizer_config.json
 * "chat_template", or chat_template.jinja beside it) rendered by a subset of Jinja written here:
 * what the real templates of today's instruct models use (../shared/chat-templates), each
 * rendering byte-equal to Jinja2's. A template using a construct outside the subset is refused at
 * parse time with the construct named. Implemented in chat_template.c. */
#ifndef REKV_LOADER_CHAT_TEMPLATE_H
#define REKV_LOADER_CHAT_TEMPLATE_H

#include <jansson.h>

#include "common/err.h"

typedef struct rekv_chat_template rekv_chat_template;

/* Parses a template's source. */
int rekv_chat_template_parse(const char *source, rekv_chat_template **out, rekv_err *err);

/* The model directory's template: chat_template.jinja, else tokenizer_config.json's
 * "chat_template" (a string, or the list form's entry named "default"). 0 with *out NULL when the
 * model has none. */
int rekv_chat_template_load_dir(const char *dir, rekv_chat_template **out, rekv_err *err);

/* Renders with the variables of ctx, a JSON object (messages, tools, add_generation_prompt,
 * bos_token, eos_token, and whatever else the caller sets), into a malloc'd NUL-terminated
 * string. Errors (raise_exception, a type error) are one line in err. */
int rekv_chat_template_render(const rekv_chat_template *t, const json_t *ctx, char **out,
                              rekv_err *err);

void rekv_chat_template_free(rekv_chat_template *t);

#endif
