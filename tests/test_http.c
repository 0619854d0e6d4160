/* test_http.c — rekv-coordinator --http against real daemons (a coordinator and a cpu worker on
 * docs8L), spoken to in raw HTTP over a socket: completions non-streaming and streamed (tokens
 * identical to the same greedy job submitted over the control socket, as `rekv submit` does),
 * n choices with seeds, echo, stop strings, logprobs (the control socket's values), /v1/models,
 * /health, /tokenize and /detokenize, every refusal with its status and OpenAI error object, curl,
 * a full queue's 429, Bearer authentication, `rekv run --http`, chat (the prompt Jinja2 renders
 * from the same messages; a template the renderer refuses), and a client that goes away
 * cancelling its job (streaming, not, queued, and the rest of a request refused in part). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tests/co_env.h"
#include "tests/http_env.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"

static hx_env X;
static int have_env;

static void setup(void) { have_env = hx_start(&X, NULL, 1) == 0; }
static void teardown(void)
{
    if (have_env)
        hx_stop(&X);
}

#define NEED_ENV()                                                                               \
    do {                                                                                         \
        if (!have_env)                                                                           \
            return;                                                                              \
    } while (0)

/* Waits until job ends; its Status (freed by the caller). */
static Rekv__Control__Response *wait_end(rekv_ctl *c, uint64_t job)
{
    for (;;) {
        Rekv__Control__Response *r = tu_ctl_status(c, job);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        Rekv__Control__JobState s = r->job->state;
        if (s != REKV__CONTROL__JOB_STATE__QUEUED && s != REKV__CONTROL__JOB_STATE__RUNNING)
            return r;
        rekv__control__response__free_unpacked(r, NULL);
        usleep(10000);
    }
}

/* The job id of an answer's "id" ("cmpl-N" / "chatcmpl-N"). */
static uint64_t job_of(json_t *j)
{
    const char *id = json_string_value(json_object_get(j, "id"));
    ck_assert_ptr_nonnull(id);
    const char *dash = strrchr(id, '-');
    ck_assert_ptr_nonnull(dash);
    return strtoull(dash + 1, NULL, 10);
}

/* The same job over the control socket: its generated ids (n in *n; malloc'd). */
static int32_t *control_job(rekv_ctl *c, const char *prompt, uint32_t max_new, size_t *n)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    s.prompt_text = (char *)prompt;
    s.sampling = &smp;
    s.max_new_tokens = max_new;
    s.stop_at_eos = 1;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    uint64_t job = r->submitted->job;
    rekv__control__response__free_unpacked(r, NULL);
    r = wait_end(c, job);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
    *n = r->job->n_generated_ids;
    int32_t *ids = malloc(sizeof(int32_t) * (*n ? *n : 1));
    memcpy(ids, r->job->generated_ids, sizeof(int32_t) * *n);
    rekv__control__response__free_unpacked(r, NULL);
    return ids;
}

/* The ids and text an HTTP job generated, from the control socket's Status. */
static void job_result(rekv_ctl *c, uint64_t job, int32_t **ids, size_t *n, char **text)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__StatusRequest st = REKV__CONTROL__STATUS_REQUEST__INIT;
    st.job = job;
    st.with_text = 1;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &st;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
    *n = r->job->n_generated_ids;
    *ids = malloc(sizeof(int32_t) * (*n ? *n : 1));
    memcpy(*ids, r->job->generated_ids, sizeof(int32_t) * *n);
    *text = strdup(r->job->text ? r->job->text : "");
    rekv__control__response__free_unpacked(r, NULL);
}

/* The data: events of an SSE body, each parsed (the last one "[DONE]" checked and left out). */
static json_t *sse_events(const char *body)
{
    json_t *all = json_array();
    const char *p = body;
    int done = 0;
    while ((p = strstr(p, "data: ")) != NULL) {
        p += 6;
        const char *end = strstr(p, "\n\n");
        ck_assert_msg(end != NULL, "an event without its blank line: %.200s", p);
        ck_assert_msg(!done, "events after [DONE]");
        if (strncmp(p, "[DONE]", 6) == 0) {
            done = 1;
        } else {
            json_error_t je;
            json_t *j = json_loadb(p, (size_t)(end - p), 0, &je);
            ck_assert_msg(j != NULL, "event is not JSON: %.200s", p);
            json_array_append_new(all, j);
        }
        p = end + 2;
    }
    ck_assert_msg(done, "the stream does not end with data: [DONE]: %.300s", body);
    return all;
}

START_TEST(models_health_tokenize)
{
    NEED_ENV();
    hx_resp r;
    hx_request(X.port, "GET", "/v1/models", NULL, NULL, &r);
    ck_assert_int_eq(r.status, 200);
    json_t *j = hx_json(&r);
    ck_assert_str_eq(json_string_value(json_object_get(j, "object")), "list");
    json_t *m = json_array_get(json_object_get(j, "data"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(m, "id")), "docs8L");
    ck_assert_int_eq(json_integer_value(json_object_get(m, "max_model_len")), 512);
    json_decref(j);
    hx_resp_free(&r);

    hx_request(X.port, "GET", "/health", NULL, NULL, &r);
    ck_assert_int_eq(r.status, 200);
    hx_resp_free(&r);

    int st;
    j = hx_post(X.port, "/tokenize", "{\"prompt\": \"apt-get install\"}", &st);
    ck_assert_int_eq(st, 200);
    json_t *toks = json_object_get(j, "tokens");
    ck_assert_int_eq(json_integer_value(json_object_get(j, "count")), json_array_size(toks));
    ck_assert_int_ge(json_array_size(toks), strlen("apt-get install"));
    ck_assert_int_eq(json_integer_value(json_object_get(j, "max_model_len")), 512);
    char *ids = json_dumps(toks, JSON_COMPACT);
    char body[4096];
    snprintf(body, sizeof(body), "{\"tokens\": %s}", ids);
    free(ids);
    json_decref(j);
    j = hx_post(X.port, "/detokenize", body, &st);
    ck_assert_int_eq(st, 200);
    ck_assert_str_eq(json_string_value(json_object_get(j, "prompt")), "apt-get install");
    json_decref(j);
}
END_TEST

/* Greedy completions over HTTP, streamed and not, are the control socket's tokens. */
START_TEST(completion_matches_control)
{
    NEED_ENV();
    const char *prompt = "The package provides";
    rekv_ctl *c = hx_ctl(&X);
    size_t n_ref;
    int32_t *ref = control_job(c, prompt, 24, &n_ref);
    ck_assert_int_eq(n_ref, 24);

    int st;
    json_t *j = hx_post(X.port, "/v1/completions",
                        "{\"model\": \"docs8L\", \"prompt\": \"The package provides\", "
                        "\"max_tokens\": 24, \"temperature\": 0}",
                        &st);
    ck_assert_int_eq(st, 200);
    ck_assert_str_eq(json_string_value(json_object_get(j, "object")), "text_completion");
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "length");
    json_t *u = json_object_get(j, "usage");
    ck_assert_int_eq(json_integer_value(json_object_get(u, "completion_tokens")), 24);
    ck_assert_int_eq(json_integer_value(json_object_get(u, "total_tokens")),
                     24 + json_integer_value(json_object_get(u, "prompt_tokens")));
    int32_t *ids;
    size_t n;
    char *text;
    job_result(c, job_of(j), &ids, &n, &text);
    ck_assert_int_eq(n, n_ref);
    ck_assert_mem_eq(ids, ref, n * sizeof(int32_t));
    ck_assert_str_eq(json_string_value(json_object_get(ch, "text")), text);
    free(ids);
    json_decref(j);

    /* streamed: the chunks' texts put together, the same job's tokens, usage last */
    hx_resp r;
    hx_request(X.port, "POST", "/v1/completions", NULL,
               "{\"prompt\": \"The package provides\", \"max_tokens\": 24, \"temperature\": 0, "
               "\"stream\": true, \"stream_options\": {\"include_usage\": true}}",
               &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strcasestr(r.head, "content-type: text/event-stream"));
    json_t *ev = sse_events(r.body);
    ck_assert_int_ge(json_array_size(ev), 3);
    char all[4096] = "";
    size_t i;
    json_t *e;
    const char *finish = NULL;
    json_array_foreach(ev, i, e)
    {
        json_t *chs = json_object_get(e, "choices");
        if (i + 1 == json_array_size(ev)) {
            ck_assert_int_eq(json_array_size(chs), 0);
            ck_assert_int_eq(
                json_integer_value(json_object_get(json_object_get(e, "usage"),
                                                   "completion_tokens")),
                24);
            continue;
        }
        ck_assert_ptr_null(json_object_get(e, "usage"));
        json_t *c0 = json_array_get(chs, 0);
        strcat(all, json_string_value(json_object_get(c0, "text")));
        if (json_is_string(json_object_get(c0, "finish_reason")))
            finish = json_string_value(json_object_get(c0, "finish_reason"));
    }
    ck_assert_str_eq(finish, "length");
    ck_assert_str_eq(all, text);
    job_result(c, job_of(json_array_get(ev, 0)), &ids, &n, &text);
    ck_assert_int_eq(n, n_ref);
    ck_assert_mem_eq(ids, ref, n * sizeof(int32_t));
    free(ids);
    free(text);
    free(ref);
    json_decref(ev);
    hx_resp_free(&r);
    rekv_ctl_close(c);
}
END_TEST

/* n choices with a seed are the jobs with seeds seed..seed+n-1; token-id prompts and lists of
 * prompts are jobs of their own; echo puts the prompt first. */
START_TEST(choices_prompts_echo)
{
    NEED_ENV();
    int st;
    json_t *j = hx_post(X.port, "/v1/completions",
                        "{\"prompt\": \"Debian\", \"max_tokens\": 8, \"temperature\": 1.0, "
                        "\"seed\": 7, \"n\": 3}",
                        &st);
    ck_assert_int_eq(st, 200);
    json_t *chs = json_object_get(j, "choices");
    ck_assert_int_eq(json_array_size(chs), 3);
    for (int i = 0; i < 3; i++) {
        char body[256];
        snprintf(body, sizeof(body),
                 "{\"prompt\": \"Debian\", \"max_tokens\": 8, \"temperature\": 1.0, \"seed\": %d}",
                 7 + i);
        json_t *one = hx_post(X.port, "/v1/completions", body, &st);
        ck_assert_int_eq(st, 200);
        json_t *c = json_array_get(chs, (size_t)i);
        ck_assert_int_eq(json_integer_value(json_object_get(c, "index")), i);
        ck_assert_str_eq(json_string_value(json_object_get(c, "text")),
                         json_string_value(json_object_get(
                             json_array_get(json_object_get(one, "choices"), 0), "text")));
        json_decref(one);
    }
    json_decref(j);

    /* two prompts, one as token ids (the tokenizer's ids of the text: the same job) */
    j = hx_post(X.port, "/tokenize", "{\"prompt\": \"Debian\"}", &st);
    char *ids = json_dumps(json_object_get(j, "tokens"), JSON_COMPACT);
    json_decref(j);
    char body[1024];
    snprintf(body, sizeof(body),
             "{\"prompt\": [%s, %s], \"max_tokens\": 6, \"temperature\": 0, \"echo\": true}",
             "[68, 101]", ids);
    free(ids);
    /* [68, 101] has no BOS: a different job; only its echo is checked */
    j = hx_post(X.port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 200);
    chs = json_object_get(j, "choices");
    ck_assert_int_eq(json_array_size(chs), 2);
    const char *t0 = json_string_value(json_object_get(json_array_get(chs, 0), "text"));
    const char *t1 = json_string_value(json_object_get(json_array_get(chs, 1), "text"));
    ck_assert_msg(strncmp(t0, "De", 2) == 0, "echo of [68, 101]: '%s'", t0);
    ck_assert_msg(strncmp(t1, "Debian", 6) == 0, "echo of Debian's ids: '%s'", t1);
    json_t *one = hx_post(X.port, "/v1/completions",
                          "{\"prompt\": \"Debian\", \"max_tokens\": 6, \"temperature\": 0}", &st);
    char want[256];
    snprintf(want, sizeof(want), "Debian%s",
             json_string_value(
                 json_object_get(json_array_get(json_object_get(one, "choices"), 0), "text")));
    ck_assert_str_eq(t1, want);
    json_decref(one);
    json_decref(j);
}
END_TEST







/* The text of choice 0 of a completions answer (malloc'd), and its finish_reason in fin. */
static char *choice_text(json_t *j, char *fin, size_t nfin)
{
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *t = json_object_get(c, "text");
    if (t == NULL)
        t = json_object_get(json_object_get(c, "message"), "content");
    ck_assert_msg(json_is_string(t), "no text in the choice");
    snprintf(fin, nfin, "%s", json_string_value(json_object_get(c, "finish_reason")));
    return strdup(json_string_value(t));
}

/* The texts of a stream's chunks put together (completions' text or chat's delta content), and
 * the last finish_reason. */
static char *stream_text(const char *body, char *fin, size_t nfin)
{
    json_t *ev = sse_events(body);
    size_t cap = 65536, n = 0;
    char *all = calloc(1, cap);
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
    {
        json_t *c = json_array_get(json_object_get(e, "choices"), 0);
        if (c == NULL)
            continue;
        json_t *t = json_object_get(c, "text");
        if (t == NULL)
            t = json_object_get(json_object_get(c, "delta"), "content");
        if (json_is_string(t)) {
            ck_assert_uint_lt(n + json_string_length(t), cap);
            memcpy(all + n, json_string_value(t), json_string_length(t));
            n += json_string_length(t);
        }
        if (json_is_string(json_object_get(c, "finish_reason")))
            snprintf(fin, nfin, "%s", json_string_value(json_object_get(c, "finish_reason")));
    }
    json_decref(ev);
    return all;
}

/* Stop strings: the text ends before the first stop (which the text of the same job without it
 * places), streamed and not, finish_reason "stop". */
START_TEST(stop_strings)
{
    NEED_ENV();
    int st;
    char fin[32], body[1024];
    json_t *j = hx_post(X.port, "/v1/completions",
                        "{\"prompt\": \"The package\", \"max_tokens\": 40, \"temperature\": 0}", &st);
    ck_assert_int_eq(st, 200);
    char *full = choice_text(j, fin, sizeof(fin));
    json_decref(j);
    ck_assert_uint_ge(strlen(full), 20);
    char stop[8];
    snprintf(stop, sizeof(stop), "%.3s", full + 12);
    size_t at = (size_t)(strstr(full, stop) - full);
    snprintf(body, sizeof(body),
             "{\"prompt\": \"The package\", \"max_tokens\": 40, \"temperature\": 0, "
             "\"stop\": [\"zzzz\", \"%s\"]}",
             stop);
    j = hx_post(X.port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 200);
    char *t = choice_text(j, fin, sizeof(fin));
    json_decref(j);
    ck_assert_str_eq(fin, "stop");
    ck_assert_uint_eq(strlen(t), at);
    ck_assert_int_eq(strncmp(t, full, at), 0);
    free(t);
    snprintf(body, sizeof(body),
             "{\"prompt\": \"The package\", \"max_tokens\": 40, \"temperature\": 0, "
             "\"stop\": \"%s\", \"stream\": true}",
             stop);
    hx_resp r;
    hx_request(X.port, "POST", "/v1/completions", NULL, body, &r);
    ck_assert_int_eq(r.status, 200);
    t = stream_text(r.body, fin, sizeof(fin));
    ck_assert_str_eq(fin, "stop");
    ck_assert_uint_eq(strlen(t), at);
    ck_assert_int_eq(strncmp(t, full, at), 0);
    free(t);
    hx_resp_free(&r);
    free(full);
}
END_TEST

/* logprobs: one per token, the greedy token's the largest of its top list, and the same values
 * the control socket records for the job. */
START_TEST(completion_logprobs)
{
    NEED_ENV();
    int st;
    json_t *j = hx_post(X.port, "/v1/completions",
                        "{\"prompt\": \"The package\", \"max_tokens\": 8, \"temperature\": 0, "
                        "\"logprobs\": 3}",
                        &st);
    ck_assert_int_eq(st, 200);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *lp = json_object_get(c, "logprobs");
    json_t *toks = json_object_get(lp, "tokens"), *tlp = json_object_get(lp, "token_logprobs"),
           *top = json_object_get(lp, "top_logprobs"), *off = json_object_get(lp, "text_offset");
    ck_assert_int_eq(json_array_size(toks), 8);
    ck_assert_int_eq(json_array_size(tlp), 8);
    ck_assert_int_eq(json_array_size(top), 8);
    ck_assert_int_eq(json_array_size(off), 8);
    char joined[512] = "";
    rekv_ctl *ctl = hx_ctl(&X);
    Rekv__Control__Response *r = tu_ctl_status(ctl, job_of(j));
    ck_assert_int_eq(r->job->n_logprobs, 8);
    for (size_t i = 0; i < 8; i++) {
        double v = json_real_value(json_array_get(tlp, i));
        ck_assert(v <= 0);
        ck_assert_msg((float)v == r->job->logprobs[i], "token %zu: %g, the job's %g", i, v,
                      (double)r->job->logprobs[i]);
        json_t *ti = json_array_get(top, i);
        ck_assert_uint_ge(json_object_size(ti), 1);
        const char *k;
        json_t *val;
        double best = -1e30;
        json_object_foreach(ti, k, val)
        {
            if (json_real_value(val) > best)
                best = json_real_value(val);
        }
        ck_assert_msg(best == v, "token %zu: greedy %g, its top %g", i, v, best);
        ck_assert_int_eq(json_integer_value(json_array_get(off, i)), strlen(joined));
        strcat(joined, json_string_value(json_array_get(toks, i)));
    }
    ck_assert_str_eq(joined, json_string_value(json_object_get(c, "text")));
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(ctl);
    json_decref(j);
}
END_TEST

/* Chat on a model directory with Qwen2.5's template: the prompt is what Jinja2 renders from the
 * same messages (tokenized without a BOS), so the chat answer is the completion of those ids;
 * streamed, the deltas put together are the same text; logprobs come in chat's shape. */
START_TEST(chat_is_the_templates_prompt)
{
    char *dir = tu_tmpdir();
    const char *model = hx_chat_model(dir, "Qwen-Qwen2.5-7B-Instruct");
    hx_env y;
    if (model == NULL || hx_start_model(&y, model, NULL, 1)) {
        tu_rmrf(dir);
        free(dir);
        return;
    }
    const char *msgs = "[{\"role\": \"system\", \"content\": \"You are terse.\"}, "
                       "{\"role\": \"user\", \"content\": \"Name a colour.\"}]";
    char path[8600], cmd[20000], *rendered = NULL;
    snprintf(path, sizeof(path), "%s/msgs.json", dir);
    FILE *f = fopen(path, "w");
    fputs(msgs, f);
    fclose(f);
    snprintf(cmd, sizeof(cmd),
             "/usr/bin/python3 -c 'import json, sys\n"
             "from jinja2.sandbox import ImmutableSandboxedEnvironment as E\n"
             "t = E(trim_blocks=True, lstrip_blocks=True).from_string(open(sys.argv[1]).read())\n"
             "sys.stdout.write(json.dumps(t.render(messages=json.load(open(sys.argv[2])), "
             "add_generation_prompt=True, tools=None, bos_token=\"</s>\", eos_token=\"</s>\")))' "
             "%s/chat_template.jinja %s",
             model, path);
    ck_assert_int_eq(tu_run(cmd, &rendered), 0);
    char body[8192];
    snprintf(body, sizeof(body), "{\"prompt\": %s, \"add_special_tokens\": false}", rendered);
    free(rendered);
    int st;
    json_t *tk = hx_post(y.port, "/tokenize", body, &st);
    ck_assert_int_eq(st, 200);
    char *ids = json_dumps(json_object_get(tk, "tokens"), JSON_COMPACT);
    json_decref(tk);
    snprintf(body, sizeof(body), "{\"prompt\": %s, \"max_tokens\": 12, \"temperature\": 0}", ids);
    free(ids);
    char fin_a[32], fin_b[32], fin_c[32];
    json_t *a = hx_post(y.port, "/v1/completions", body, &st);
    ck_assert_int_eq(st, 200);
    char *ta = choice_text(a, fin_a, sizeof(fin_a));

    snprintf(body, sizeof(body),
             "{\"model\": \"Qwen-Qwen2.5-7B-Instruct\", \"messages\": %s, \"max_tokens\": 12, "
             "\"temperature\": 0, \"logprobs\": true, \"top_logprobs\": 2}",
             msgs);
    json_t *b = hx_post(y.port, "/v1/chat/completions", body, &st);
    ck_assert_msg(st == 200, "chat: %d", st);
    ck_assert_str_eq(json_string_value(json_object_get(b, "object")), "chat.completion");
    char *tb = choice_text(b, fin_b, sizeof(fin_b));
    ck_assert_str_eq(tb, ta);
    ck_assert_str_eq(fin_b, fin_a);
    json_t *ua = json_object_get(a, "usage"), *ub = json_object_get(b, "usage");
    ck_assert_int_eq(json_integer_value(json_object_get(ua, "prompt_tokens")),
                     json_integer_value(json_object_get(ub, "prompt_tokens")));
    json_t *cb = json_array_get(json_object_get(b, "choices"), 0);
    ck_assert_str_eq(
        json_string_value(json_object_get(json_object_get(cb, "message"), "role")), "assistant");
    json_t *content = json_object_get(json_object_get(cb, "logprobs"), "content");
    ck_assert_int_eq(json_array_size(content),
                     json_integer_value(json_object_get(ub, "completion_tokens")));
    json_t *first = json_array_get(content, 0);
    ck_assert(json_is_string(json_object_get(first, "token")));
    ck_assert(json_is_array(json_object_get(first, "bytes")));
    ck_assert_int_eq(json_array_size(json_object_get(first, "top_logprobs")), 2);

    /* streamed */
    snprintf(body, sizeof(body),
             "{\"messages\": %s, \"max_tokens\": 12, \"temperature\": 0, \"stream\": true}",
             msgs);
    hx_resp r;
    hx_request(y.port, "POST", "/v1/chat/completions", NULL, body, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"role\":\"assistant\""));
    ck_assert_ptr_nonnull(strstr(r.body, "\"object\":\"chat.completion.chunk\""));
    char *tc = stream_text(r.body, fin_c, sizeof(fin_c));
    ck_assert_str_eq(tc, ta);
    ck_assert_str_eq(fin_c, fin_a);
    hx_resp_free(&r);
    free(ta), free(tb), free(tc);
    json_decref(a), json_decref(b);
    hx_stop(&y);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* A template the renderer refuses (a construct outside its subset) does not stop the server: chat
 * is answered 400 naming the construct. */
START_TEST(chat_template_refused)
{
    char *dir = tu_tmpdir();
    const char *model = hx_chat_model(dir, "Qwen-Qwen2.5-7B-Instruct");
    hx_env y;
    if (model == NULL) {
        tu_rmrf(dir);
        free(dir);
        return;
    }
    char path[8600];
    snprintf(path, sizeof(path), "%s/chat_template.jinja", model);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{% include 'other.jinja' %}", f);
    fclose(f);
    if (hx_start_model(&y, model, NULL, 0)) {
        tu_rmrf(dir);
        free(dir);
        return;
    }
    hx_resp r;
    hx_request(y.port, "POST", "/v1/chat/completions", NULL,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", &r);
    hx_expect_error(&r, 400, "invalid_request_error");
    ck_assert_msg(strstr(r.body, "include"), "%s", r.body);
    hx_resp_free(&r);
    hx_stop(&y);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static void expect(const char *method, const char *path, const char *headers, const char *body,
                   int status, const char *type)
{
    hx_resp r;
    hx_request(X.port, method, path, headers, body, &r);
    hx_expect_error(&r, status, type);
    hx_resp_free(&r);
}

/* Every refusal: its status and an OpenAI error object; the server serves on. */
START_TEST(refusals)
{
    NEED_ENV();
    const char *C = "/v1/completions";
    const char *E = "invalid_request_error";
    expect("POST", C, NULL, "{\"prompt\": \"x\"", 400, E);
    expect("POST", C, NULL, "[1, 2]", 400, E);
    expect("POST", C, NULL, "{\"prompt\": 5}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": []}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"\"}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"max_tokens\": \"9\"}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"max_tokens\": 0}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"max_tokens\": -3}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"temperature\": \"hot\"}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"n\": 100000}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"stream\": 1}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"stop\": 3}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": [1, 99999]}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"echo\": true, \"logprobs\": 2}", 400, E);
    expect("POST", C, NULL, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}",
           400, E);
    /* longer than the context (512): the coordinator's refusal, as a 400 */
    char big[2048] = "{\"prompt\": \"";
    memset(big + strlen(big), 'a', 700);
    strcat(big, "\"}");
    expect("POST", C, NULL, big, 400, E);
    hx_resp r;
    hx_request(X.port, "POST", C, NULL, "{\"model\": \"gpt-4\", \"prompt\": \"x\"}", &r);
    hx_expect_error(&r, 404, NULL);
    json_t *j = hx_json(&r);
    ck_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "code")),
                     "model_not_found");
    json_decref(j);
    hx_resp_free(&r);
    /* chat: empty or malformed messages; without a template in the model, a clear 400 */
    const char *CH = "/v1/chat/completions";
    expect("POST", CH, NULL, "{\"messages\": []}", 400, E);
    expect("POST", CH, NULL, "{\"messages\": \"hi\"}", 400, E);
    expect("POST", CH, NULL, "{\"messages\": [{\"content\": \"hi\"}]}", 400, E);
    hx_request(X.port, "POST", CH, NULL, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
               &r);
    hx_expect_error(&r, 400, E);
    ck_assert_ptr_nonnull(strstr(r.body, "chat template"));
    hx_resp_free(&r);
    /* paths and methods */
    expect("GET", "/v1/nothing", NULL, NULL, 404, NULL);
    expect("GET", C, NULL, NULL, 405, NULL);
    expect("POST", "/v1/models", NULL, "{}", 405, NULL);
    expect("POST", "/tokenize", NULL, "{\"prompt\": 1}", 400, E);
    expect("POST", "/detokenize", NULL, "{\"tokens\": [-1]}", 400, E);
    /* a 100 MB body, announced: refused from its Content-Length, never read */
    int fd = hx_connect(X.port);
    const char *h = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 100000000\r\n\r\n{\"prompt\": \"";
    ck_assert_int_eq(send(fd, h, strlen(h), MSG_NOSIGNAL), (ssize_t)strlen(h));
    hx_read_answer(fd, &r);
    close(fd);
    hx_expect_error(&r, 413, NULL);
    hx_resp_free(&r);
    /* ... and one sent chunked, with no length: cut off at the limit */
    fd = hx_connect(X.port);
    const char *hc = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n";
    send(fd, hc, strlen(hc), MSG_NOSIGNAL);
    static char chunk[1 << 20];
    memset(chunk, ' ', sizeof(chunk));
    char line[32];
    for (int i = 0; i < 16; i++) {
        snprintf(line, sizeof(line), "%x\r\n", (unsigned)sizeof(chunk));
        if (send(fd, line, strlen(line), MSG_NOSIGNAL) < 0 ||
            send(fd, chunk, sizeof(chunk), MSG_NOSIGNAL) < 0 || send(fd, "\r\n", 2, MSG_NOSIGNAL) < 0)
            break;
    }
    send(fd, "0\r\n\r\n", 5, MSG_NOSIGNAL);
    hx_read_answer(fd, &r);
    close(fd);
    hx_expect_error(&r, 413, NULL);
    hx_resp_free(&r);
    /* still serving */
    int st;
    j = hx_post(X.port, C, "{\"prompt\": \"x\", \"max_tokens\": 2}", &st);
    ck_assert_int_eq(st, 200);
    json_decref(j);
}
END_TEST

static Rekv__Control__Stats *stats(rekv_ctl *c, Rekv__Control__Response **keep)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    *keep = tu_ctl_call(c, &rq);
    ck_assert_int_eq((*keep)->code, REKV__CONTROL__CODE__OK);
    return (*keep)->stats;
}

/* A request the coordinator refuses in part (one prompt of two too long) is refused whole: the job
 * accepted beside the refused one is cancelled, not left to run for nobody. */
START_TEST(refused_request_cancels_the_rest)
{
    NEED_ENV();
    rekv_ctl *c = hx_ctl(&X);
    Rekv__Control__Response *keep;
    Rekv__Control__Stats *s0 = stats(c, &keep);
    uint64_t accepted0 = s0->accepted, cancelled0 = s0->cancelled;
    rekv__control__response__free_unpacked(keep, NULL);
    char big[2048] = "{\"max_tokens\": 500, \"prompt\": [\"The\", \"";
    memset(big + strlen(big), 'a', 700);
    strcat(big, "\"]}");
    expect("POST", "/v1/completions", NULL, big, 400, "invalid_request_error");
    for (;;) {
        Rekv__Control__Stats *s1 = stats(c, &keep);
        int done = s1->cancelled == cancelled0 + 1;
        ck_assert_int_eq(s1->accepted, accepted0 + 1);
        rekv__control__response__free_unpacked(keep, NULL);
        if (done)
            break;
        usleep(10000);
    }
    rekv_ctl_close(c);
}
END_TEST

/* Reads from fd until the first data: event has come; its JSON. */
static json_t *first_event(int fd)
{
    static char buf[65536];
    size_t n = 0;
    for (;;) {
        ssize_t got = recv(fd, buf + n, sizeof(buf) - n - 1, 0);
        ck_assert_msg(got > 0, "the stream ended before its first event");
        n += (size_t)got;
        buf[n] = '\0';
        char *d = strstr(buf, "data: ");
        char *end = d ? strstr(d, "\n") : NULL;
        if (end) {
            json_error_t je;
            json_t *j = json_loadb(d + 6, (size_t)(end - d - 6), 0, &je);
            ck_assert_msg(j != NULL, "first event: %s", je.text);
            return j;
        }
    }
}

/* A streaming client that closes mid-way cancels its job: CANCELLED, far short of max_tokens. */
START_TEST(disconnect_cancels_stream)
{
    NEED_ENV();
    rekv_ctl *c = hx_ctl(&X);
    int fd = hx_connect(X.port);
    const char *body = "{\"prompt\": \"The\", \"max_tokens\": 500, \"temperature\": 0, "
                       "\"ignore_eos\": true, "
                       "\"stream\": true}";
    char req[1024];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    ck_assert_int_eq(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    json_t *ev = first_event(fd);
    uint64_t job = job_of(ev);
    json_decref(ev);
    close(fd);
    Rekv__Control__Response *r = wait_end(c, job);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
    ck_assert_msg(r->job->n_generated_ids < 250, "ran %zu of 500 tokens after the client left",
                  r->job->n_generated_ids);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
}
END_TEST

/* A non-streaming request whose client closes while its job runs cancels the job. */
START_TEST(disconnect_cancels_request)
{
    NEED_ENV();
    rekv_ctl *c = hx_ctl(&X);
    /* the next job id: one past this job's */
    int st;
    json_t *j = hx_post(X.port, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 1}", &st);
    uint64_t job = job_of(j) + 1;
    json_decref(j);
    int fd = hx_connect(X.port);
    /* ignore_eos: it runs to its 500 tokens unless cancelled, however loaded the machine */
    const char *body = "{\"prompt\": \"The\", \"max_tokens\": 500, \"temperature\": 0, "
                       "\"ignore_eos\": true}";
    char req[1024];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    ck_assert_int_eq(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    /* running (it has tokens), then the client goes */
    for (;;) {
        Rekv__Control__Response *r = tu_ctl_status(c, job);
        int running = r->code == REKV__CONTROL__CODE__OK && r->job->n_generated_ids > 0;
        rekv__control__response__free_unpacked(r, NULL);
        if (running)
            break;
        usleep(2000);
    }
    close(fd);
    Rekv__Control__Response *r = wait_end(c, job);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
    ck_assert_msg(r->job->n_generated_ids < 250, "ran %zu of 500 tokens after the client left",
                  r->job->n_generated_ids);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
}
END_TEST

/* --api-key-file: Bearer KEY or 401 (OpenAI's object); /health needs none; without a worker
 * /health is 503. */
START_TEST(api_key_and_health)
{
    char *dir = tu_tmpdir();
    char key[4200];
    snprintf(key, sizeof(key), "%s/key", dir);
    FILE *f = fopen(key, "w");
    ck_assert_ptr_nonnull(f);
    fputs("sk-test-123\n", f);
    fclose(f);
    const char *extra[] = {"--api-key-file", key, "--served-model-name", "tiny", NULL};
    hx_env y;
    if (hx_start(&y, extra, 0)) {
        tu_rmrf(dir);
        free(dir);
        return;
    }
    hx_resp r;
    hx_request(y.port, "GET", "/health", NULL, NULL, &r);
    hx_expect_error(&r, 503, NULL);
    hx_resp_free(&r);
    hx_request(y.port, "GET", "/v1/models", NULL, NULL, &r);
    hx_expect_error(&r, 401, NULL);
    ck_assert_ptr_nonnull(strstr(r.body, "invalid_api_key"));
    hx_resp_free(&r);
    hx_request(y.port, "GET", "/v1/models", "Authorization: Bearer sk-test-124\r\n", NULL, &r);
    hx_expect_error(&r, 401, NULL);
    hx_resp_free(&r);
    hx_request(y.port, "GET", "/v1/models", "Authorization: Bearer sk-test-1234\r\n", NULL, &r);
    hx_expect_error(&r, 401, NULL);
    hx_resp_free(&r);
    hx_request(y.port, "POST", "/v1/completions", NULL, "{\"prompt\": \"x\"}", &r);
    hx_expect_error(&r, 401, NULL);
    hx_resp_free(&r);
    hx_request(y.port, "GET", "/v1/models", "Authorization: Bearer sk-test-123\r\n", NULL, &r);
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"id\":\"tiny\""));
    hx_resp_free(&r);
    hx_start_worker(&y);
    hx_request(y.port, "POST", "/v1/completions", "Authorization: Bearer sk-test-123\r\n",
               "{\"model\": \"tiny\", \"prompt\": \"x\", \"max_tokens\": 2}", &r);
    ck_assert_int_eq(r.status, 200);
    hx_resp_free(&r);
    hx_stop(&y);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* curl, a client that is not ours: a stream (chunked, as HTTP/1.1 carries it) and a non-streaming
 * answer agree, and an error's status is what curl reports. */
START_TEST(curl_client)
{
    NEED_ENV();
    if (system("command -v curl >/dev/null 2>&1") != 0) {
        ck_assert_msg(!tu_ci(), "curl is not installed (CI=true)");
        fprintf(stderr, "   skip: curl is not installed\n");
        return;
    }
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof(cmd),
             "curl -sS -N http://127.0.0.1:%d/v1/completions -H 'Content-Type: application/json' "
             "-d '{\"prompt\": \"Debian\", \"max_tokens\": 12, \"temperature\": 0, "
             "\"stream\": true}'",
             X.port);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    json_t *ev = sse_events(out);
    char all[1024] = "";
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e)
        strcat(all, json_string_value(json_object_get(
                        json_array_get(json_object_get(e, "choices"), 0), "text")));
    json_decref(ev);
    free(out);
    snprintf(cmd, sizeof(cmd),
             "curl -sS http://127.0.0.1:%d/v1/completions -H 'Content-Type: application/json' "
             "-d '{\"prompt\": \"Debian\", \"max_tokens\": 12, \"temperature\": 0}'",
             X.port);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_ptr_nonnull(j);
    ck_assert_str_eq(all, json_string_value(json_object_get(
                              json_array_get(json_object_get(j, "choices"), 0), "text")));
    json_decref(j);
    free(out);
    snprintf(cmd, sizeof(cmd),
             "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/v1/completions "
             "-d '{\"prompt\": \"x\", \"max_tokens\": 0}'",
             X.port);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    ck_assert_str_eq(out, "400");
    free(out);
}
END_TEST

/* A full queue (the coordinator's BUSY) is 429 with OpenAI's rate-limit error; the waiting
 * request's client leaving cancels its queued job. */
START_TEST(busy_is_429)
{
    const char *extra[] = {"--queue", "1", NULL};
    hx_env y;
    if (hx_start(&y, extra, 0))
        return;
    int fd = hx_connect(y.port);
    const char *body = "{\"prompt\": \"The\", \"max_tokens\": 5}";
    char req[512];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    ck_assert_int_eq(send(fd, req, (size_t)n, MSG_NOSIGNAL), n);
    rekv_ctl *c = hx_ctl(&y);
    Rekv__Control__Response *keep;
    for (;;) { /* queued: no worker runs it */
        int queued = stats(c, &keep)->queued == 1;
        rekv__control__response__free_unpacked(keep, NULL);
        if (queued)
            break;
        usleep(10000);
    }
    hx_resp r;
    hx_request(y.port, "POST", "/v1/completions", NULL, body, &r);
    hx_expect_error(&r, 429, "rate_limit_error");
    hx_resp_free(&r);
    close(fd);
    for (;;) {
        Rekv__Control__Stats *st = stats(c, &keep);
        int gone = st->queued == 0 && st->cancelled == 1;
        rekv__control__response__free_unpacked(keep, NULL);
        if (gone)
            break;
        usleep(10000);
    }
    rekv_ctl_close(c);
    hx_stop(&y);
}
END_TEST

/* `rekv run --http` serves the API (its coordinator got the flags). */
START_TEST(rekv_run_http)
{
    env e;
    if (ct_env_open(&e))
        return;
    int port = ms_free_port();
    char listen[64];
    snprintf(listen, sizeof(listen), "127.0.0.1:%d", port);
    const char *extra[] = {"--http", listen, "--served-model-name", "story", NULL};
    pid_t pid = ct_rekv_run_start_args(&e, "64M", "4", NULL, extra);
    hx_resp r;
    for (;;) { /* ready: the coordinator listens; serving once its worker joined */
        hx_request(port, "GET", "/health", NULL, NULL, &r);
        int ok = r.status == 200;
        hx_resp_free(&r);
        if (ok)
            break;
        usleep(20000);
    }
    hx_request(port, "POST", "/v1/completions", NULL,
               "{\"model\": \"story\", \"prompt\": [1, 5, 9], \"max_tokens\": 3}", &r);
    ck_assert_msg(r.status == 200, "%d: %s", r.status, r.body);
    hx_resp_free(&r);
    ct_rekv_run_stop(pid);
    ct_env_close(&e);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("http");
    TCase *tc = tcase_create("api");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, models_health_tokenize);
    tcase_add_test(tc, completion_matches_control);
    tcase_add_test(tc, choices_prompts_echo);
    tcase_add_test(tc, refusals);
    tcase_add_test(tc, curl_client);
    tcase_add_test(tc, refused_request_cancels_the_rest);
    tcase_add_test(tc, stop_strings);
    tcase_add_test(tc, completion_logprobs);
    tcase_add_test(tc, disconnect_cancels_stream);
    tcase_add_test(tc, disconnect_cancels_request);
    suite_add_tcase(s, tc);
    TCase *ta = tcase_create("auth");
    tcase_set_timeout(ta, 60);
    tcase_add_test(ta, api_key_and_health);
    TCase *tch = tcase_create("chat");
    tcase_set_timeout(tch, 60);
    tcase_add_test(tch, chat_is_the_templates_prompt);
    tcase_add_test(tch, chat_template_refused);
    suite_add_tcase(s, tch);
    tcase_add_test(ta, rekv_run_http);
    tcase_add_test(ta, busy_is_429);
    suite_add_tcase(s, ta);
    return tu_run_suite(s);
}
