/* http_gen.c — POST /v1/completions and /v1/chat/completions: an OpenAI request read into one
 * Submit per job (n prompts x n choices), the jobs submitted over the control socket with
 * stream set, and their StreamEvents turned into the answer: one JSON object when they end, or
 * server-sent events as they come (a chunk per job with news, the usage chunk with
 * stream_options.include_usage, then "data: [DONE]").
 *
 * Data flow (libmicrohttpd's one polling thread; http_bridge.c talks to the coordinator): the
 * access handler parses the request and hands it to the bridge, which sends the Submits; the
 * connection is suspended until every Submit has its answer. Then a refusal is answered, a stream
 * is given a reader, and a non-streaming request waits (suspended) for its jobs' ends. The reader
 * formats what the bridge brought since it last looked and, with nothing to give, suspends the
 * connection until the bridge resumes it. Nothing here blocks. The request-completed
 * notification (http_gen_finish) hands the request back to the bridge, which cancels what still
 * runs; the bridge also cancels at once when it sees the client's socket close. */
#define _GNU_SOURCE
#include "coordinator/http_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <zmq.h>

#include "common/clock.h"

/* ---------------------------------------------------------------- text */

/* Bytes of s[0..n) that form whole UTF-8 characters, leaving out an incomplete one at the end
 * (the rest of it comes with the next tokens). */
static size_t utf8_whole(const unsigned char *s, size_t n)
{
    size_t i = n, back = 0;
    while (i > 0 && back < 4 && (s[i - 1] & 0xC0) == 0x80) {
        i--;
        back++;
    }
    if (i == 0)
        return n;
    unsigned char c = s[i - 1];
    size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back + 1 ? i - 1 : n;
}

/* A JSON string of any bytes: invalid UTF-8 becomes U+FFFD (a byte-level model may make it). */
static json_t *jstr(const char *s, size_t n)
{
    json_t *j = json_stringn(s, n);
    if (j)
        return j;
    hbuf b = {0};
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : c >= 0xF0 && c < 0xF8 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
        json_t *t = len && i + len <= n ? json_stringn(s + i, len) : NULL;
        if (t) {
            hbuf_put(&b, s + i, len);
            json_decref(t);
            i += len;
        } else {
            hbuf_put(&b, "\xEF\xBF\xBD", 3);
            i++;
        }
    }
    j = json_stringn(b.p ? b.p : "", b.n);
    hbuf_free(&b);
    return j;
}

/* The text of one token (for logprobs), and its bytes. */
static json_t *token_str(const struct rekv_http *h, int32_t id, json_t **bytes)
{
    char *t = NULL;
    size_t n = 0;
    if (h->tok == NULL || rekv_tokenizer_decode(h->tok, &id, 1, &t, &n, NULL)) {
        char tmp[32];
        snprintf(tmp, sizeof(tmp), "<%d>", id);
        t = strdup(tmp);
        n = t ? strlen(t) : 0;
    }
    if (bytes) {
        *bytes = json_array();
        for (size_t i = 0; i < n; i++)
            json_array_append_new(*bytes, json_integer((unsigned char)t[i]));
    }
    json_t *s = jstr(t ? t : "", n);
    free(t);
    return s;
}

static const char *finish_of(const hjob *j)
{
    if (j->state == REKV__CONTROL__JOB_STATE__CANCELLED)
        return "abort";
    if (!strcmp(j->finish, "length") || !strcmp(j->finish, "context"))
        return "length";
    return "stop"; /* eos, a stop string */
}

/* ---------------------------------------------------------------- the request */

typedef struct perr {
    unsigned status;
    const char *code;
    char msg[1100];
} perr;

static int bad(perr *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(perr *e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    e->status = 400;
    return -1;
}

/* An optional number field: 0 absent (or null), 1 present in *v, -1 after bad(). */
static int opt_num(json_t *o, const char *k, double *v, int integer, perr *e)
{
    json_t *j = json_object_get(o, k);
    if (j == NULL || json_is_null(j))
        return 0;
    if (integer ? !json_is_integer(j) : !json_is_number(j))
        return bad(e, "'%s' must be %s", k, integer ? "an integer" : "a number");
    *v = json_number_value(j);
    return 1;
}

static int opt_bool(json_t *o, const char *k, int *v, perr *e)
{
    json_t *j = json_object_get(o, k);
    if (j == NULL || json_is_null(j))
        return 0;
    if (!json_is_boolean(j))
        return bad(e, "'%s' must be a boolean", k);
    *v = json_is_true(j);
    return 1;
}

/* prompt: a string, token ids, a list of strings or a list of id lists. Fills g's prompts (the
 * texts point into the JSON). */
static int read_prompts(hgen *g, json_t *p, const char ***texts, perr *e)
{
    if (p == NULL || json_is_null(p))
        return bad(e, "'prompt' is required");
    int vocab = g->srv->have_model ? g->srv->mcfg.vocab : INT32_MAX;
    size_t n = 1;
    json_t *one;
    int list = json_is_array(p) && json_array_size(p) > 0 &&
               (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0)));
    if (json_is_array(p) && json_array_size(p) == 0)
        return bad(e, "'prompt' is empty");
    if (list)
        n = json_array_size(p);
    if (n > REKV_HTTP_MAX_JOBS)
        return bad(e, "'prompt' holds %zu prompts; at most %d", n, REKV_HTTP_MAX_JOBS);
    *texts = calloc(n, sizeof(char *));
    g->prompt_ids = calloc(n, sizeof(int32_t *));
    g->prompt_n = calloc(n, sizeof(size_t));
    if (*texts == NULL || g->prompt_ids == NULL || g->prompt_n == NULL)
        return bad(e, "out of memory");
    g->n_prompts = (int)n;
    for (size_t i = 0; i < n; i++) {
        one = list ? json_array_get(p, i) : p;
        if (json_is_string(one)) {
            if (json_string_length(one) == 0)
                return bad(e, "'prompt' %zu is empty", i);
            (*texts)[i] = json_string_value(one);
            continue;
        }
        if (!json_is_array(one) || json_array_size(one) == 0)
            return bad(e, "'prompt' must be a string, an array of token ids, or an array of "
                          "either (non-empty)");
        size_t m = json_array_size(one);
        int32_t *ids = malloc(sizeof(int32_t) * m);
        if (ids == NULL)
            return bad(e, "out of memory");
        g->prompt_ids[i] = ids;
        g->prompt_n[i] = m;
        for (size_t k = 0; k < m; k++) {
            json_t *v = json_array_get(one, k);
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab)
                return bad(e, "'prompt' token %zu is not a token id of the vocabulary", k);
            ids[k] = (int32_t)json_integer_value(v);
        }
    }
    return 0;
}

/* A message as the template takes it: content parts joined into one text (each part's "text",
 * one "\n" between parts, as vLLM does for templates that take a string), tool calls' JSON
 * "arguments" given as objects (what the templates iterate over). NULL after bad(). */
static json_t *template_message(json_t *msg, size_t i, perr *e)
{
    json_t *role = json_object_get(msg, "role"), *c = json_object_get(msg, "content");
    if (!json_is_object(msg) || !json_is_string(role))
        return bad(e, "'messages'[%zu] must be an object with a string 'role'", i), NULL;
    if (c && !json_is_string(c) && !json_is_array(c) && !json_is_null(c))
        return bad(e, "'messages'[%zu].content must be a string or an array of parts", i), NULL;
    json_t *m = json_deep_copy(msg);
    if (json_is_array(c)) {
        hbuf text = {0};
        size_t k;
        json_t *part;
        json_array_foreach(c, k, part)
        {
            json_t *t = json_object_get(part, "text");
            if (!json_is_string(t) || !json_is_string(json_object_get(part, "type")) ||
                strcmp(json_string_value(json_object_get(part, "type")), "text") != 0) {
                hbuf_free(&text);
                json_decref(m);
                return bad(e, "'messages'[%zu].content[%zu]: only text parts are supported", i, k),
                       NULL;
            }
            if (k)
                hbuf_put(&text, "\n", 1);
            hbuf_put(&text, json_string_value(t), json_string_length(t));
        }
        json_object_set_new(m, "content", json_stringn(text.p ? text.p : "", text.n));
        hbuf_free(&text);
    }
    size_t k;
    json_t *call;
    json_array_foreach(json_object_get(m, "tool_calls"), k, call)
    {
        json_t *fn = json_object_get(call, "function");
        json_t *args = json_object_get(fn, "arguments");
        json_t *obj = json_is_string(args) ? json_loads(json_string_value(args), 0, NULL) : NULL;
        if (json_is_object(obj))
            json_object_set_new(fn, "arguments", obj);
        else
            json_decref(obj);
    }
    return m;
}

/* messages: a non-empty array rendered with the model's chat template and tokenized here, without
 * a BOS of the tokenizer's (the template writes its own, as HF's apply_chat_template does), into
 * prompt 0's ids. */
static int read_messages(hgen *g, json_t *req, perr *e)
{
    struct rekv_http *h = g->srv;
    json_t *m = json_object_get(req, "messages");
    if (!json_is_array(m))
        return bad(e, "'messages' must be an array of messages");
    if (json_array_size(m) == 0)
        return bad(e, "'messages' is empty");
    json_t *msgs = json_array();
    size_t i;
    json_t *msg;
    json_array_foreach(m, i, msg)
    {
        json_t *t = template_message(msg, i, e);
        if (t == NULL) {
            json_decref(msgs);
            return -1;
        }
        json_array_append_new(msgs, t);
    }
    if (h->chat == NULL || h->tok == NULL) {
        json_decref(msgs);
        return bad(e, "%s", h->chat ? "the server has no tokenizer for chat" : h->chat_why);
    }
    json_t *tools = json_object_get(req, "tools");
    if (tools && !json_is_null(tools) && !json_is_array(tools)) {
        json_decref(msgs);
        return bad(e, "'tools' must be an array");
    }
    int agp = 1;
    if (opt_bool(req, "add_generation_prompt", &agp, e) < 0) {
        json_decref(msgs);
        return -1;
    }
    json_t *ctx = json_pack("{s:o, s:O, s:n, s:b}", "messages", msgs, "tools",
                            tools ? tools : json_null(), "documents", "add_generation_prompt", agp);
    json_t *kw = json_object_get(req, "chat_template_kwargs");
    if (json_is_object(kw))
        json_object_update(ctx, kw);
    char *text = NULL;
    rekv_err err = {0};
    int rc = rekv_chat_template_render(h->chat, ctx, &text, &err);
    json_decref(ctx);
    if (rc)
        return bad(e, "the chat template cannot render these messages: %s", err.msg);
    int32_t *ids = NULL;
    size_t n = 0;
    g->prompt_ids = calloc(1, sizeof(int32_t *));
    g->prompt_n = calloc(1, sizeof(size_t));
    g->n_prompts = 1;
    rc = g->prompt_ids && g->prompt_n
             ? rekv_tokenizer_encode(h->tok, text, strlen(text), -1, &ids, &n, &err)
             : -ENOMEM;
    free(text);
    if (rc)
        return bad(e, "the rendered conversation does not tokenize: %s", err.msg);
    g->prompt_ids[0] = ids;
    g->prompt_n[0] = n;
    return 0;
}

/* Sampling, limits, stops, logprobs: the fields every job of the request shares. */
static int read_common(hgen *g, json_t *req, Rekv__Control__Submit *s, uint32_t *n, int *seeded,
                       uint64_t *seed, perr *e)
{
    struct rekv_http *h = g->srv;
    json_t *model = json_object_get(req, "model");
    if (model && !json_is_null(model)) {
        if (!json_is_string(model))
            return bad(e, "'model' must be a string");
        if (strcmp(json_string_value(model), h->model_name) != 0) {
            e->status = 404;
            e->code = "model_not_found";
            snprintf(e->msg, sizeof(e->msg), "The model `%s` does not exist.",
                     json_string_value(model));
            return -1;
        }
    }
    double v = 0;
    int rc, b = 0;
    s->max_new_tokens = g->chat ? (h->have_model ? (uint32_t)h->mcfg.max_pos : 256) : 16;
    const char *mk = json_object_get(req, "max_completion_tokens") ? "max_completion_tokens"
                                                                    : "max_tokens";
    if ((rc = opt_num(req, mk, &v, 1, e)) < 0)
        return -1;
    if (rc && (v < 1 || v > 1e9))
        return bad(e, "'%s' must be at least 1 (got %.0f)", mk, v);
    if (rc)
        s->max_new_tokens = (uint32_t)v;
    s->sampling->temperature = 1.0f;
    if ((rc = opt_num(req, "temperature", &v, 0, e)) < 0)
        return -1;
    if (rc && (v < 0 || v > 100))
        return bad(e, "'temperature' must be 0 or more");
    if (rc)
        s->sampling->temperature = (float)v;
    if ((rc = opt_num(req, "top_p", &v, 0, e)) < 0)
        return -1;
    if (rc && (v <= 0 || v > 1))
        return bad(e, "'top_p' must be in (0, 1]");
    if (rc)
        s->sampling->top_p = v >= 1 ? 0.0f : (float)v;
    if ((rc = opt_num(req, "top_k", &v, 1, e)) < 0)
        return -1;
    if (rc && (v < -1 || v > 1e9))
        return bad(e, "'top_k' must be -1 (off), 0 (off) or more");
    if (rc && v > 0)
        s->sampling->top_k = (uint32_t)v;
    if ((rc = opt_num(req, "seed", &v, 1, e)) < 0)
        return -1;
    *seeded = rc;
    *seed = rc ? (uint64_t)json_integer_value(json_object_get(req, "seed")) : 0;
    *n = 1;
    if ((rc = opt_num(req, "n", &v, 1, e)) < 0)
        return -1;
    if (rc && (v < 1 || v > REKV_HTTP_MAX_N))
        return bad(e, "'n' must be 1..%d", REKV_HTTP_MAX_N);
    if (rc)
        *n = (uint32_t)v;
    if ((rc = opt_num(req, "priority", &v, 1, e)) < 0)
        return -1;
    if (rc && (v < INT32_MIN || v > INT32_MAX))
        return bad(e, "'priority' is out of range");
    if (rc)
        s->priority = (int32_t)v;
    int ignore_eos = 0; /* vLLM's extension: run to max_tokens past the model's EOS */
    if (opt_bool(req, "ignore_eos", &ignore_eos, e) < 0)
        return -1;
    s->stop_at_eos = !ignore_eos;
    if (opt_bool(req, "stream", &g->stream, e) < 0)
        return -1;
    json_t *so = json_object_get(req, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so) || opt_bool(so, "include_usage", &b, e) < 0)
            return bad(e, "'stream_options' must be an object {\"include_usage\": boolean}");
        if (!g->stream)
            return bad(e, "'stream_options' is only allowed with 'stream': true");
        g->include_usage = b;
    }
    json_t *st = json_object_get(req, "stop");
    if (st && !json_is_null(st)) {
        size_t k = json_is_string(st) ? 1 : json_is_array(st) ? json_array_size(st) : 0;
        if (!json_is_string(st) && !json_is_array(st))
            return bad(e, "'stop' must be a string or an array of strings");
        g->stops = calloc(k ? k : 1, sizeof(char *));
        for (size_t i = 0; g->stops && i < k; i++) {
            json_t *x = json_is_string(st) ? st : json_array_get(st, i);
            if (!json_is_string(x) || json_string_length(x) == 0)
                return bad(e, "'stop' must hold non-empty strings");
            g->stops[g->n_stops++] = (char *)json_string_value(x);
        }
        s->n_stop = g->n_stops;
        s->stop = g->stops;
    }
    return 0;
}

/* logprobs and echo, whose shapes differ between the two endpoints. */
static int read_logprobs(hgen *g, json_t *req, perr *e)
{
    double v = 0;
    int rc;
    if (g->chat) {
        if (opt_bool(req, "logprobs", &g->want_lp, e) < 0)
            return -1;
        if ((rc = opt_num(req, "top_logprobs", &v, 1, e)) < 0)
            return -1;
        if (rc && (v < 0 || v > 20))
            return bad(e, "'top_logprobs' must be 0..20");
        if (rc && v > 0 && !g->want_lp)
            return bad(e, "'top_logprobs' needs 'logprobs': true");
        g->top_lp = rc ? (uint32_t)v : 0;
        return 0;
    }
    if ((rc = opt_num(req, "logprobs", &v, 1, e)) < 0)
        return -1;
    if (rc && (v < 0 || v > 20))
        return bad(e, "'logprobs' must be 0..20");
    g->want_lp = rc;
    g->top_lp = rc ? (uint32_t)v : 0;
    if (opt_bool(req, "echo", &g->echo, e) < 0)
        return -1;
    if (g->echo && g->want_lp)
        return bad(e, "'echo' with 'logprobs' is not supported: rekv does not compute the "
                      "prompt's log-probabilities");
    return 0;
}

static void random_hex(char *out, size_t bytes)
{
    unsigned char r[16];
    if (bytes > sizeof(r))
        bytes = sizeof(r);
    if (getrandom(r, bytes, 0) != (ssize_t)bytes) {
        uint64_t t = rekv_now_ns() ^ (uint64_t)(uintptr_t)out;
        memcpy(r, &t, bytes < 8 ? bytes : 8);
    }
    for (size_t i = 0; i < bytes; i++)
        sprintf(out + 2 * i, "%02x", r[i]);
}

/* One job per prompt and choice, sharing s's fields. */
static int build_jobs(hgen *g, const char **texts, const Rekv__Control__Submit *s,
                      uint32_t n, int seeded, uint64_t seed, perr *e)
{
    g->n_jobs = g->n_prompts * (int)n;
    if (g->n_jobs > REKV_HTTP_MAX_JOBS)
        return bad(e, "%d prompts x n=%u is %d jobs; at most %d", g->n_prompts, n, g->n_jobs,
                   REKV_HTTP_MAX_JOBS);
    g->jobs = calloc((size_t)g->n_jobs, sizeof(hjob));
    Rekv__Control__Sampling *smp = calloc((size_t)g->n_jobs, sizeof(*smp));
    if (g->jobs == NULL || smp == NULL) {
        free(smp);
        return bad(e, "out of memory");
    }
    char base[40];
    random_hex(base, 12);
    for (int p = 0; p < g->n_prompts; p++)
        for (uint32_t i = 0; i < n; i++) {
            hjob *j = &g->jobs[p * (int)n + (int)i];
            j->sub = *s;
            smp[p * n + i] = *s->sampling;
            j->sub.sampling = &smp[p * n + i];
            if (seeded)
                j->sub.sampling->seed = seed + i;
            else
                getrandom(&j->sub.sampling->seed, sizeof(uint64_t), 0);
            j->g = g;
            j->prompt = p;
            j->index = p * (int)n + (int)i;
            snprintf(j->key, sizeof(j->key), "http-%s-%d", base, j->index);
            j->sub.client_key = j->key;
            if (texts[p]) {
                j->sub.prompt_text = (char *)texts[p];
            } else {
                j->sub.prompt_ids = g->prompt_ids[p];
                j->sub.n_prompt_ids = g->prompt_n[p];
            }
        }
    return 0;
}

/* The echoed prompt of each prompt (completions' echo). */
static int echo_texts(hgen *g, const char **texts, perr *e)
{
    g->echo_text = calloc((size_t)g->n_prompts, sizeof(char *));
    if (g->echo_text == NULL)
        return bad(e, "out of memory");
    for (int p = 0; p < g->n_prompts; p++) {
        if (texts[p]) {
            g->echo_text[p] = strdup(texts[p]);
            continue;
        }
        const hjob *j = &g->jobs[p * (g->n_jobs / g->n_prompts)];
        size_t tl = 0;
        if (g->srv->tok == NULL || rekv_tokenizer_decode(g->srv->tok, j->sub.prompt_ids,
                                                         j->sub.n_prompt_ids, &g->echo_text[p],
                                                         &tl, NULL))
            return bad(e, "'echo' of a token-id prompt needs the server's tokenizer");
    }
    return 0;
}

static int read_request(hgen *g, json_t *req, perr *e)
{
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    s.sampling = &smp;
    s.stop_at_eos = 1;
    s.stream = 1;
    uint32_t n = 1;
    int seeded = 0;
    uint64_t seed = 0;
    const char **texts = NULL;
    json_t *prompt = json_object_get(req, "prompt");
    int rc;
    if ((rc = read_common(g, req, &s, &n, &seeded, &seed, e)) || (rc = read_logprobs(g, req, e)))
        goto out;
    if (g->chat) {
        texts = calloc(1, sizeof(char *));
        if (texts == NULL || (rc = read_messages(g, req, e)))
            goto out;
    } else if ((rc = read_prompts(g, prompt, &texts, e))) {
        goto out;
    }
    s.logprobs = g->want_lp;
    s.top_logprobs = g->top_lp;
    if ((rc = build_jobs(g, texts, &s, n, seeded, seed, e)))
        goto out;
    if (g->echo && (rc = echo_texts(g, texts, e)))
        goto out;
out:
    free(texts);
    return rc;
}

/* ---------------------------------------------------------------- what the bridge brings */

void http_gen_take_event(hgen *g, hjob *j, const Rekv__Control__StreamEvent *ev)
{
    size_t n = ev->n_tokens;
    if (ev->offset == j->next && n) {
        hbuf_put(&j->ids, ev->tokens, n * sizeof(int32_t));
        if (ev->has_text)
            hbuf_put(&j->text, ev->text.data, ev->text.len);
        if (g->want_lp) {
            /* tokens without their logprobs (a coordinator that does not record them) get 0 */
            for (size_t i = 0; i < n; i++) {
                float lp = i < ev->n_logprobs ? ev->logprobs[i] : 0.0f;
                hbuf_put(&j->lp, &lp, sizeof(lp));
            }
            for (size_t i = 0; i < n * g->top_lp; i++) {
                int32_t id = i < ev->n_top_logprob_ids ? ev->top_logprob_ids[i] : -1;
                float v = i < ev->n_top_logprob_vals ? ev->top_logprob_vals[i] : 0.0f;
                hbuf_put(&j->top_ids, &id, sizeof(id));
                hbuf_put(&j->top_vals, &v, sizeof(v));
            }
        }
        j->next += (uint32_t)n;
    }
    if (ev->done && !j->done) {
        j->done = 1;
        g->n_done++;
        j->state = ev->state;
        snprintf(j->finish, sizeof(j->finish), "%s", ev->finish_reason ? ev->finish_reason : "");
        if (ev->error && *ev->error)
            j->error = strdup(ev->error);
    }
}

/* ---------------------------------------------------------------- answers */

static json_t *usage_json(const hgen *g)
{
    json_int_t prompt = 0, gen = 0;
    int per = g->n_jobs / g->n_prompts;
    for (int i = 0; i < g->n_jobs; i++) {
        gen += g->jobs[i].next;
        if (i % per == 0)
            prompt += g->jobs[i].prompt_tokens;
    }
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", prompt, "completion_tokens", gen,
                     "total_tokens", prompt + gen);
}

/* Logprobs of tokens [from, to) of j in the endpoint's shape. text_at: the text offset of the
 * first (completions' text_offset). */
static json_t *logprobs_json(const hgen *g, const hjob *j, size_t from, size_t to, size_t text_at)
{
    const int32_t *ids = (const int32_t *)j->ids.p;
    const float *lp = (const float *)j->lp.p;
    const int32_t *tid = (const int32_t *)j->top_ids.p;
    const float *tv = (const float *)j->top_vals.p;
    json_t *content = json_array(), *toks = json_array(), *tlp = json_array(),
           *tops = json_array(), *offs = json_array();
    for (size_t t = from; t < to && lp; t++) {
        json_t *bytes = NULL, *s = token_str(g->srv, ids[t], g->chat ? &bytes : NULL);
        json_t *top = g->chat ? json_array() : json_object();
        for (uint32_t k = 0; k < g->top_lp; k++) {
            int32_t id = tid[t * g->top_lp + k];
            if (id < 0)
                continue;
            json_t *tb = NULL, *ts = token_str(g->srv, id, g->chat ? &tb : NULL);
            if (g->chat)
                json_array_append_new(top, json_pack("{s:o, s:f, s:o}", "token", ts, "logprob",
                                                     (double)tv[t * g->top_lp + k], "bytes", tb));
            else {
                json_object_set_new(top, json_string_value(ts),
                                    json_real(tv[t * g->top_lp + k]));
                json_decref(ts);
            }
        }
        if (g->chat) {
            json_array_append_new(content, json_pack("{s:o, s:f, s:o, s:o}", "token", s,
                                                     "logprob", (double)lp[t], "bytes", bytes,
                                                     "top_logprobs", top));
        } else {
            json_array_append_new(offs, json_integer((json_int_t)text_at));
            text_at += json_string_length(s);
            json_array_append_new(toks, s);
            json_array_append_new(tlp, json_real(lp[t]));
            json_array_append_new(tops, top);
        }
    }
    if (g->chat) {
        json_decref(toks), json_decref(tlp), json_decref(tops), json_decref(offs);
        return json_pack("{s:o}", "content", content);
    }
    json_decref(content);
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", tlp,
                     "top_logprobs", tops, "text_offset", offs);
}

static json_t *answer_json(hgen *g)
{
    json_t *choices = json_array();
    for (int i = 0; i < g->n_jobs; i++) {
        hjob *j = &g->jobs[i];
        hbuf text = {0};
        if (g->echo)
            hbuf_printf(&text, "%s", g->echo_text[j->prompt]);
        hbuf_put(&text, j->text.p ? j->text.p : "", j->text.n);
        json_t *lp = g->want_lp ? logprobs_json(g, j, 0, j->next, 0) : json_null();
        json_t *c;
        if (g->chat)
            c = json_pack("{s:i, s:{s:s, s:o}, s:o, s:s}", "index", j->index, "message", "role",
                          "assistant", "content", jstr(text.p ? text.p : "", text.n), "logprobs",
                          lp, "finish_reason", finish_of(j));
        else
            c = json_pack("{s:i, s:o, s:o, s:s}", "index", j->index, "text",
                          jstr(text.p ? text.p : "", text.n), "logprobs", lp, "finish_reason",
                          finish_of(j));
        hbuf_free(&text);
        json_array_append_new(choices, c);
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", g->id, "object",
                     g->chat ? "chat.completion" : "text_completion", "created",
                     (json_int_t)g->created, "model", g->srv->model_name, "choices", choices,
                     "usage", usage_json(g));
}

/* One SSE event. */
static void sse(hgen *g, json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (s) {
        hbuf_printf(&g->out, "data: %s\n\n", s);
        free(s);
    }
}

static json_t *chunk(hgen *g, json_t *choices)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:o}", "id", g->id, "object",
                     g->chat ? "chat.completion.chunk" : "text_completion", "created",
                     (json_int_t)g->created, "model", g->srv->model_name, "choices", choices);
}

/* s[0..n) as a JSON string, quoted, onto b: what jstr and json_dumps would write (invalid UTF-8
 * as U+FFFD), without building a json_t per token. */
static void json_quote(hbuf *b, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    hbuf_put(b, "\"", 1);
    size_t run = 0; /* bytes copied as they are, from s + i - run */
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : c >= 0xC2 && c < 0xE0 ? 2 : c >= 0xE0 && c < 0xF0 ? 3
                                                          : c >= 0xF0 && c < 0xF5 ? 4 : 0;
        int ok = len && i + len <= n;
        for (size_t k = 1; ok && k < len; k++)
            ok = ((unsigned char)s[i + k] & 0xC0) == 0x80;
        if (ok && len == 3) { /* no overlong forms, no surrogates */
            unsigned v = (c & 0x0Fu) << 12 | ((unsigned char)s[i + 1] & 0x3Fu) << 6;
            ok = v >= 0x800 && (v < 0xD800 || v > 0xDFFF);
        } else if (ok && len == 4) {
            unsigned v = (c & 0x07u) << 18 | ((unsigned char)s[i + 1] & 0x3Fu) << 12;
            ok = v >= 0x10000 && v <= 0x10FFFF;
        }
        const char *esc = NULL;
        char u[7];
        if (!ok)
            esc = "\xEF\xBF\xBD";
        else if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c < 0x20) {
            esc = c == '\n' ? "\\n" : c == '\t' ? "\\t" : c == '\r' ? "\\r" : c == '\b' ? "\\b"
                  : c == '\f' ? "\\f" : u;
            memcpy(u, "\\u00", 4);
            u[4] = hex[c >> 4], u[5] = hex[c & 15], u[6] = '\0';
        }
        if (esc == NULL) {
            run += len;
            i += len;
            continue;
        }
        hbuf_put(b, s + i - run, run);
        run = 0;
        hbuf_put(b, esc, strlen(esc));
        i += ok ? len : 1;
    }
    hbuf_put(b, s + n - run, run);
    hbuf_put(b, "\"", 1);
}

/* The chunk for what j got since its last one (whole UTF-8 characters only until it ends),
 * written by hand (its shape is fixed; only logprobs go through jansson). */
static void stream_job(hgen *g, hjob *j)
{
    if (j->end_sent)
        return;
    if (j->state == REKV__CONTROL__JOB_STATE__FAILED && j->done) {
        sse(g, json_pack("{s:{s:s, s:s, s:n, s:n}}", "error", "message",
                         j->error ? j->error : "the job failed", "type", "server_error", "param",
                         "code"));
        j->end_sent = 1;
        return;
    }
    size_t upto = j->done ? j->text.n
                          : j->text_sent + utf8_whole((const unsigned char *)j->text.p +
                                                          j->text_sent,
                                                      j->text.n - j->text_sent);
    const char *echo = g->echo && !j->echo_sent ? g->echo_text[j->prompt] : "";
    j->echo_sent = 1;
    size_t text_at = j->text_sent, n_text = upto - j->text_sent;
    size_t lp_to = j->next;
    int first_chat = g->chat && !j->role_sent;
    if (n_text == 0 && !*echo && !j->done && !first_chat && lp_to == j->lp_sent)
        return;
    char *lp = NULL;
    if (g->want_lp && lp_to > j->lp_sent) {
        json_t *l = logprobs_json(g, j, j->lp_sent, lp_to, text_at);
        lp = l ? json_dumps(l, JSON_COMPACT) : NULL;
        json_decref(l);
    }
    j->lp_sent = lp_to;
    hbuf *o = &g->out;
    if (g->chunk_head.n == 0) /* what every chunk of the request opens with, made once */
        hbuf_printf(&g->chunk_head,
                    "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":%s,"
                    "\"choices\":[{\"index\":",
                    g->id, g->chat ? "chat.completion.chunk" : "text_completion",
                    (long long)g->created, g->srv->model_json);
    hbuf_put(o, g->chunk_head.p, g->chunk_head.n);
    char idx[16];
    int il = snprintf(idx, sizeof(idx), "%d,", j->index);
    hbuf_put(o, idx, (size_t)il);
    const char *field = g->chat ? "\"delta\":{\"content\":" : "\"text\":";
    hbuf_put(o, field, strlen(field));
    if (*echo) { /* the echo and the text as one string */
        hbuf t = {0};
        hbuf_put(&t, echo, strlen(echo));
        hbuf_put(&t, j->text.p ? j->text.p + text_at : "", n_text);
        json_quote(o, t.p, t.n);
        hbuf_free(&t);
    } else {
        json_quote(o, j->text.p ? j->text.p + text_at : "", n_text);
    }
    j->text_sent = upto;
    if (g->chat && first_chat)
        hbuf_put(o, ",\"role\":\"assistant\"}", 20);
    else if (g->chat)
        hbuf_put(o, "}", 1);
    j->role_sent = 1;
    hbuf_put(o, ",\"logprobs\":", 12);
    if (lp)
        hbuf_put(o, lp, strlen(lp));
    else
        hbuf_put(o, "null", 4);
    hbuf_put(o, ",\"finish_reason\":", 17);
    free(lp);
    if (j->done)
        hbuf_printf(o, "\"%s\"}]}\n\n", finish_of(j));
    else
        hbuf_put(o, "null}]}\n\n", 9);
    j->end_sent = j->done;
}

static void stream_end(hgen *g)
{
    if (g->include_usage) {
        json_t *c = chunk(g, json_array());
        json_object_set_new(c, "usage", usage_json(g));
        sse(g, c);
    }
    hbuf_printf(&g->out, "data: [DONE]\n\n");
    g->ended = 1;
}

/* libmicrohttpd asks for bytes: what the bridge brought, formatted; nothing yet suspends the
 * connection (the bridge resumes it when its jobs have more). */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    hgen *g = cls;
    pthread_mutex_lock(&g->srv->mu);
    ssize_t ret;
    for (;;) {
        if (g->out_off < g->out.n) {
            size_t n = g->out.n - g->out_off;
            if (n > max)
                n = max;
            memcpy(buf, g->out.p + g->out_off, n);
            g->out_off += n;
            ret = (ssize_t)n;
            break;
        }
        g->out.n = g->out_off = 0;
        if (g->ended) {
            ret = MHD_CONTENT_READER_END_OF_STREAM;
            break;
        }
        if (atomic_load(&g->srv->stopping) || g->gone) {
            ret = MHD_CONTENT_READER_END_WITH_ERROR; /* http_gen_finish: the bridge cancels */
            break;
        }
        for (int i = 0; i < g->n_jobs; i++)
            if (g->jobs[i].dirty) {
                g->jobs[i].dirty = 0;
                stream_job(g, &g->jobs[i]);
            }
        if (g->out.n)
            continue;
        if (g->n_done == g->n_jobs) {
            stream_end(g);
            continue;
        }
        if (http_gen_wait(g)) {
            ret = 0;
            break;
        }
    }
    pthread_mutex_unlock(&g->srv->mu);
    return ret;
}

/* ---------------------------------------------------------------- entry points */

int http_gen_ready(const hgen *g)
{
    if (atomic_load(&g->srv->stopping) || g->gone)
        return 1;
    if (g->kind == HG_HEALTH)
        return g->health_done;
    switch (g->phase) {
    case PH_SUBMIT: return g->n_answered == g->n_jobs;
    case PH_WAIT: return g->n_done == g->n_jobs;
    default:
        if (g->out_off < g->out.n || g->n_done == g->n_jobs)
            return 1;
        for (int i = 0; i < g->n_jobs; i++)
            if (g->jobs[i].dirty)
                return 1;
        return 0;
    }
}

int http_gen_wait(hgen *g)
{
    if (http_gen_ready(g))
        return 0;
    g->suspended = 1;
    MHD_suspend_connection(g->conn);
    return 1;
}

void http_gen_free(hgen *g)
{
    if (g == NULL)
        return;
    for (int i = 0; g->jobs && i < g->n_jobs; i++) {
        hjob *j = &g->jobs[i];
        free(j->error);
        hbuf_free(&j->text), hbuf_free(&j->lp), hbuf_free(&j->top_ids);
        hbuf_free(&j->top_vals), hbuf_free(&j->ids);
    }
    if (g->jobs)
        free(g->jobs[0].sub.sampling); /* the array of every job's Sampling */
    free(g->jobs);
    for (int p = 0; p < g->n_prompts; p++) {
        if (g->echo_text)
            free(g->echo_text[p]);
        if (g->prompt_ids)
            free(g->prompt_ids[p]);
    }
    free(g->echo_text);
    free(g->prompt_ids);
    free(g->prompt_n);
    free(g->stops);
    hbuf_free(&g->out);
    hbuf_free(&g->chunk_head);
    json_decref(g->req);
    free(g);
}

enum MHD_Result http_gen_answer(hreq *r)
{
    struct rekv_http *h = r->srv;
    hgen *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return MHD_NO;
    r->gen = g;
    g->srv = h;
    g->conn = r->conn;
    g->kind = HG_GEN;
    g->fd = r->fd;
    g->chat = r->route == HR_CHAT;
    g->created = (int64_t)time(NULL);
    json_error_t je;
    g->req = json_loadb(r->body.p ? r->body.p : "", r->body.n, JSON_REJECT_DUPLICATES, &je);
    if (g->req == NULL)
        return http_error(r->conn, 400, NULL, NULL, "the body is not valid JSON: %s (line %d)",
                          je.text, je.line);
    if (!json_is_object(g->req))
        return http_error(r->conn, 400, NULL, NULL, "the body must be a JSON object");
    perr e = {0};
    if (read_request(g, g->req, &e))
        return http_error(r->conn, e.status, NULL, e.code, "%s", e.msg);
    g->phase = PH_SUBMIT;
    if (http_bridge_submit(g))
        return http_error(r->conn, 503, NULL, NULL, "the server is shutting down");
    r->pending = 1; /* suspended: the bridge resumes it when every Submit has its answer */
    return MHD_YES;
}

/* What a resumed request does next, decided under mu and done after it (http_error_obj). */
enum { GN_WAIT = 0, GN_CLOSE, GN_JSON, GN_STREAM };

/* A waiting request's connection was resumed: its answer (*j, *status), its stream, or it waits
 * again. Under mu. */
static int gen_continue(hreq *r, hgen *g, unsigned *status, json_t **j)
{
    *status = 503;
    if (atomic_load(&r->srv->stopping))
        return *j = http_error_obj(503, "the server is shutting down"), GN_JSON;
    if (g->gone)
        return GN_CLOSE; /* http_gen_finish: the bridge has cancelled what was accepted */
    if (http_gen_wait(g))
        return GN_WAIT;
    if (g->phase == PH_SUBMIT) {
        if (g->refuse_status) {
            *status = g->refuse_status;
            return *j = http_error_obj(g->refuse_status, "%s", g->refuse_msg), GN_JSON;
        }
        snprintf(g->id, sizeof(g->id), "%s%llu", g->chat ? "chatcmpl-" : "cmpl-",
                 (unsigned long long)g->jobs[0].job);
        if (g->stream) {
            g->phase = PH_STREAM;
            return GN_STREAM;
        }
        g->phase = PH_WAIT;
        if (http_gen_wait(g))
            return GN_WAIT;
    }
    *status = 500;
    for (int i = 0; i < g->n_jobs; i++)
        if (g->jobs[i].state == REKV__CONTROL__JOB_STATE__FAILED)
            return *j = http_error_obj(500, "job %llu failed: %s",
                                       (unsigned long long)g->jobs[i].job,
                                       g->jobs[i].error ? g->jobs[i].error : "(no reason given)"),
                   GN_JSON;
    *status = 200;
    *j = answer_json(g);
    return GN_JSON;
}

enum MHD_Result http_gen_continue(hreq *r)
{
    hgen *g = r->gen;
    unsigned status;
    json_t *j = NULL;
    pthread_mutex_lock(&r->srv->mu);
    int next = gen_continue(r, g, &status, &j);
    pthread_mutex_unlock(&r->srv->mu);
    if (next == GN_WAIT)
        return MHD_YES;
    r->pending = 0; /* answered (or closing): later calls have nothing to do */
    if (next == GN_CLOSE)
        return MHD_NO;
    if (next == GN_JSON)
        return http_json(r->conn, status, j);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, g, NULL);
    if (resp == NULL)
        return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = MHD_queue_response(r->conn, 200, resp);
    MHD_destroy_response(resp);
    return ret;
}

void http_gen_finish(hreq *r)
{
    hgen *g = r->gen;
    r->gen = NULL;
    if (g->registered)
        http_bridge_finish(g); /* the bridge cancels what runs, and frees it */
    else
        http_gen_free(g);
}
