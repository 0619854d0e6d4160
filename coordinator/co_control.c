/* co_control.c — the control protocol (proto/control.proto): a round of requests read from the
 * control socket, Submit (checks, tokenizing, admission against the queue limit), Status, Cancel,
 * Stream and Health; replies wait until the round's accepted jobs are journaled with one sync, then
 * go out. Also the stream subscriptions: a job's new tokens (with their log-probabilities, and
 * their text, held back for stop strings), and its end, go to its subscribers.
 * Stats is answered in co_stats.c. */
#include "coordinator/co_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"

/* ---------------------------------------------------------------- sending */

static int pack_response(const Rekv__Control__Response *r, uint8_t **buf, size_t *len)
{
    *len = rekv__control__response__get_packed_size(r);
    *buf = malloc(*len ? *len : 1);
    if (*buf == NULL)
        return -ENOMEM;
    rekv__control__response__pack(r, *buf);
    return 0;
}

/* Queues a reply for the end of this round (after the journal sync). */
void co_reply_add(rekv_coordinator *co, const rid *to, Rekv__Control__Response *r, job *acc)
{
    r->version = REKV_CONTROL_PROTO_VERSION;
    reply *rp = &co->replies[co->n_replies];
    if (pack_response(r, &rp->buf, &rp->len))
        return; /* out of memory: the client times out */
    rp->to = *to;
    rp->req_id = r->id;
    rp->accepted = acc;
    rp->dup = 0;
    co->n_replies++;
}

static void reply_error(rekv_coordinator *co, const rid *to, uint64_t id, Rekv__Control__Code code,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void reply_error(rekv_coordinator *co, const rid *to, uint64_t id, Rekv__Control__Code code,
                        const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = id;
    r.code = code;
    r.error = msg;
    if (code == REKV__CONTROL__CODE__BAD_REQUEST)
        co->bad_requests++;
    co_reply_add(co, to, &r, NULL);
}

/* The bytes that tokens [from, to) of j add to the decoded text of its generated ids, for a
 * StreamEvent: malloc'd in ev->text (has_text set), or nothing without a tokenizer or when the ids
 * do not decode (co_text_added). */
static void stream_text(const rekv_coordinator *co, const job *j, uint32_t from, uint32_t to,
                        Rekv__Control__StreamEvent *ev)
{
    char *t;
    size_t n;
    if (co->tok == NULL || co_text_added(co->tok, j->gen, from, to, &t, &n))
        return;
    ev->text.data = (uint8_t *)t;
    ev->text.len = n;
    ev->has_text = 1;
}

/* A job with stops: the text between what a client was shown with tokens [0, from) (*bytes; when
 * bytes is NULL or *bytes SIZE_MAX, what co_job_text_shown says it was) and what it may be shown
 * now (held back where a stop may begin; *bytes advanced): the events' texts add up to
 * JobStatus.text and never hold a byte of a stop. */
static void stop_text(rekv_coordinator *co, const job *j, uint32_t from, size_t *bytes,
                      Rekv__Control__StreamEvent *ev)
{
    char *t, *pre;
    size_t len, shown, n_pre, seen;
    if (co_job_text_shown(co, j, j->n_gen, &t, &len, &shown))
        return;
    if (bytes && *bytes != SIZE_MAX) {
        seen = *bytes;
    } else if (co_job_text_shown(co, j, from < j->n_gen ? from : j->n_gen, &pre, &n_pre, &seen)) {
        free(t);
        return;
    } else {
        free(pre);
    }
    if (seen > shown) /* a re-run that has not caught up: nothing new */
        seen = shown;
    memmove(t, t + seen, shown - seen);
    ev->text.data = (uint8_t *)t;
    ev->text.len = shown - seen;
    ev->has_text = 1;
    if (bytes)
        *bytes = shown;
}

/* The event of tokens [from, n_gen) of j (and its end, when over); ev->text malloc'd. bytes: a job
 * with stops, the text the receiver was shown so far (stop_text), NULL: work it out. */
static void stream_event(rekv_coordinator *co, const job *j, uint32_t from, int over,
                         Rekv__Control__StreamEvent *ev, size_t *bytes)
{
    rekv__control__stream_event__init(ev);
    ev->job = j->id;
    ev->offset = from;
    ev->n_tokens = j->n_gen > from ? j->n_gen - from : 0;
    ev->tokens = j->gen + from;
    ev->done = over;
    ev->state = j->state;
    ev->finish_reason = (char *)j->finish_reason;
    ev->error = j->error ? j->error : "";
    if (j->logprobs && ev->n_tokens > 0) {
        ev->n_logprobs = ev->n_tokens;
        ev->logprobs = j->lp + from;
        ev->n_top_logprob_ids = ev->n_top_logprob_vals = ev->n_tokens * j->top_logprobs;
        ev->top_logprob_ids = j->tlp_ids + (size_t)from * j->top_logprobs;
        ev->top_logprob_vals = j->tlp_vals + (size_t)from * j->top_logprobs;
    }
    if (co_job_stop_text(j))
        stop_text(co, j, from, bytes, ev);
    else
        stream_text(co, j, from, j->n_gen > from ? j->n_gen : from, ev);
}

/* Streams tokens [streamed, n_gen) (and the end, when the job is over) to its subscribers; one
 * that has shown more (sub.from: it subscribed again after a restart) gets only what is new to
 * it. */
void co_stream_flush(rekv_coordinator *co, job *j)
{
    if (j->n_subs == 0) {
        if (j->n_gen > j->streamed) {
            j->streamed = j->n_gen;
            j->stream_bytes = SIZE_MAX; /* worked out when a subscriber comes */
        }
        return;
    }
    int over = j->state != REKV__CONTROL__JOB_STATE__QUEUED &&
               j->state != REKV__CONTROL__JOB_STATE__RUNNING;
    if (j->n_gen <= j->streamed && !over)
        return;
    Rekv__Control__StreamEvent ev, own;
    size_t bytes = j->stream_bytes;
    stream_event(co, j, j->streamed, over, &ev, &bytes);
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.version = REKV_CONTROL_PROTO_VERSION;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_EVENT;
    for (int i = 0; i < j->n_subs;) {
        sub *sb = &j->subs[i];
        r.event = &ev;
        own.text.data = NULL;
        if (sb->from > j->streamed) { /* it has some of these already */
            if (sb->from >= j->n_gen && !over) {
                i++;
                continue;
            }
            stream_event(co, j, sb->from < j->n_gen ? sb->from : j->n_gen, over, &own, NULL);
            r.event = &own;
        }
        r.id = sb->id;
        uint8_t *buf;
        size_t len;
        int rc = pack_response(&r, &buf, &len);
        free(own.text.data);
        if (rc == 0) {
            rc = co_send_to(co->ctl, &sb->to, buf, len);
            free(buf);
        }
        if (rc) { /* gone or not reading: drop the subscription */
            j->subs[i] = j->subs[--j->n_subs];
            continue;
        }
        i++;
    }
    free(ev.text.data);
    if (j->n_gen >= j->streamed)
        j->stream_bytes = bytes;
    j->streamed = j->n_gen > j->streamed ? j->n_gen : j->streamed;
    if (over)
        j->n_subs = 0;
}

/* ---------------------------------------------------------------- control requests */

static void do_stream(rekv_coordinator *co, const rid *from, uint64_t rq, uint64_t id,
                      uint32_t from_tok);

/* A client key: 1..REKV_CLIENT_KEY_MAX printable ASCII characters without spaces. */
static int key_valid(const char *k)
{
    size_t n = 0;
    for (; k[n]; n++)
        if (n >= REKV_CLIENT_KEY_MAX || (uint8_t)k[n] <= 0x20 || (uint8_t)k[n] >= 0x7f)
            return 0;
    return n > 0;
}

/* A Submit whose key names a job we remember: the reply names that job, and a streaming client
 * is subscribed to it (an event with every token so far, then the rest). */
static void submit_duplicate(rekv_coordinator *co, const rid *from, uint64_t rq,
                             const Rekv__Control__Submit *s, job *j)
{
    Rekv__Control__SubmitReply sr = REKV__CONTROL__SUBMIT_REPLY__INIT;
    sr.job = j->id;
    sr.prompt_tokens = j->n_prompt;
    sr.queue_depth = co->n_queue;
    sr.duplicate = 1;
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_SUBMITTED;
    r.submitted = &sr;
    /* a job accepted this round is not accepted until its record is synced: this reply waits
     * for the same sync and fails with it */
    size_t at = co->n_replies;
    co_reply_add(co, from, &r, j->unsynced ? j : NULL);
    if (co->n_replies > at)
        co->replies[at].dup = 1;
    if (s->stream)
        do_stream(co, from, rq, j->id, s->stream_from);
}

/* Submit.stop: at most CO_STOP_MAX strings of 1 to CO_STOP_MAX_BYTES bytes, and a tokenizer to
 * decode the ids they are looked for in. 0, or -1 after a BAD_REQUEST reply. */
static int submit_check_stops(rekv_coordinator *co, const rid *from, uint64_t rq,
                              const Rekv__Control__Submit *s)
{
    if (s->n_stop == 0)
        return 0;
    if (co->tok == NULL) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "stop strings need the coordinator's tokenizer to decode the generated ids "
                    "(start it with --model)");
        return -1;
    }
    if (s->n_stop > CO_STOP_MAX) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "%zu stop strings: at most %d are taken", s->n_stop, CO_STOP_MAX);
        return -1;
    }
    for (size_t i = 0; i < s->n_stop; i++) {
        size_t n = s->stop[i] ? strlen(s->stop[i]) : 0;
        if (n == 0 || n > CO_STOP_MAX_BYTES) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                        "stop string %zu is %zu bytes long: each must be 1 to %d bytes", i + 1, n,
                        CO_STOP_MAX_BYTES);
            return -1;
        }
    }
    return 0;
}

/* A Submit's limits, before its prompt is read: 0, or -1 after a BAD_REQUEST or BUSY reply. */
static int submit_check(rekv_coordinator *co, const rid *from, uint64_t rq,
                        const Rekv__Control__Submit *s, float temp, float top_p)
{
    int has_text = s->prompt_text && *s->prompt_text;
    if (has_text == (s->n_prompt_ids > 0)) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "give the prompt as text or as token ids, exactly one of the two");
        return -1;
    }
    /* every sampling field here, by name: a value the worker would refuse (or misread) later
     * must not be accepted (NaN fails each comparison, so it is refused too) */
    if (!(temp >= 0 && temp <= 100)) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "temperature %g is outside [0, 100] (0: greedy)", (double)temp);
        return -1;
    }
    if (top_p != 0 && !(top_p > 0 && top_p <= 1)) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_p %g is outside (0, 1] (0 or unset: 1, off)", (double)top_p);
        return -1;
    }
    uint32_t top_k = s->sampling ? s->sampling->top_k : 0;
    if (top_k > INT32_MAX) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_k %u is above the limit of %d (0: off)", top_k, INT32_MAX);
        return -1;
    }
    /* a job's top logits live in memory until it is forgotten and in its journal record */
    if (s->top_logits > REKV_TOP_LOGITS_MAX) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_logits %u is above the limit of %u", s->top_logits, REKV_TOP_LOGITS_MAX);
        return -1;
    }
    if (co->have_model && s->top_logits > (uint32_t)co->mcfg.vocab) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_logits %u is above the model's vocabulary of %d", s->top_logits,
                    co->mcfg.vocab);
        return -1;
    }
    if ((uint64_t)s->top_logits * s->max_new_tokens > REKV_TOP_LOGITS_MAX_ENTRIES) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_logits x max_new_tokens = %llu is above the limit of %u (ask for fewer "
                    "top logits or fewer tokens)",
                    (unsigned long long)s->top_logits * s->max_new_tokens,
                    REKV_TOP_LOGITS_MAX_ENTRIES);
        return -1;
    }
    if ((uint64_t)s->top_logprobs * s->max_new_tokens > REKV_TOP_LOGITS_MAX_ENTRIES) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_logprobs x max_new_tokens = %llu is above the limit of %u (ask for "
                    "fewer top logprobs or fewer tokens)",
                    (unsigned long long)s->top_logprobs * s->max_new_tokens,
                    REKV_TOP_LOGITS_MAX_ENTRIES);
        return -1;
    }
    if (s->max_new_tokens > co->cfg.max_new_limit) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "max_new_tokens %u is above the limit of %u", s->max_new_tokens,
                    co->cfg.max_new_limit);
        return -1;
    }
    if (submit_check_stops(co, from, rq, s))
        return -1;
    if (s->top_logprobs > 0 && !s->logprobs) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_logprobs %u needs logprobs", s->top_logprobs);
        return -1;
    }
    if (s->top_logprobs > CO_TOP_LOGPROBS_MAX ||
        (co->have_model && s->top_logprobs > (uint32_t)co->mcfg.vocab)) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_logprobs %u is outside 0..%u%s", s->top_logprobs, CO_TOP_LOGPROBS_MAX,
                    co->have_model && (uint32_t)co->mcfg.vocab < CO_TOP_LOGPROBS_MAX
                        ? " and the model's vocabulary"
                        : "");
        return -1;
    }
    if (co->n_queue >= co->cfg.queue_limit) {
        co->rejected_busy++;
        reply_error(co, from, rq, REKV__CONTROL__CODE__BUSY,
                    "busy: %u jobs are waiting (the limit); nothing was accepted, retry later",
                    co->n_queue);
        return -1;
    }
    return 0;
}

/* A Submit's prompt as token ids (its text encoded, or its ids copied), each in the vocabulary
 * and all within the model's context: the malloc'd ids (*n of them), or NULL after a reply. */
static int32_t *submit_prompt(rekv_coordinator *co, const rid *from, uint64_t rq,
                              const Rekv__Control__Submit *s, size_t *n_out)
{
    int32_t *ids = NULL;
    size_t n = 0;
    if (s->prompt_text && *s->prompt_text) {
        if (co->tok == NULL) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                        "the coordinator has no tokenizer (start it with --model); give token "
                        "ids");
            return NULL;
        }
        rekv_err err = {0};
        int bos = co->have_model && co->mcfg.add_bos ? co->mcfg.bos_id : -1;
        if (rekv_tokenizer_encode(co->tok, s->prompt_text, strlen(s->prompt_text), bos, &ids, &n,
                                  &err)) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST, "%s", err.msg);
            return NULL;
        }
    } else {
        n = s->n_prompt_ids;
        ids = malloc(sizeof(int32_t) * n);
        if (ids == NULL) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__INTERNAL, "out of memory");
            return NULL;
        }
        memcpy(ids, s->prompt_ids, sizeof(int32_t) * n);
    }
    if (n == 0) {
        free(ids);
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST, "the prompt is empty");
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (co->have_model && ids[i] >= co->mcfg.vocab)) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                        "prompt token id %d is outside the vocabulary%s", ids[i],
                        co->have_model ? "" : " (negative)");
            free(ids);
            return NULL;
        }
    }
    if (co->have_model && n > (size_t)co->mcfg.max_pos) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "the prompt of %zu tokens is longer than the model's context of %d tokens", n,
                    co->mcfg.max_pos);
        free(ids);
        return NULL;
    }
    *n_out = n;
    return ids;
}

static void do_submit(rekv_coordinator *co, const rid *from, uint64_t rq,
                      const Rekv__Control__Submit *s)
{
    const char *key = s->client_key && *s->client_key ? s->client_key : NULL;
    if (key && !key_valid(key)) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "client_key must be 1 to %d printable ASCII characters without spaces",
                    REKV_CLIENT_KEY_MAX);
        return;
    }
    if (key) {
        /* before every other check: a retry of an accepted job is answered even when the queue
         * is full now */
        job *dup = co_job_by_key(co, key);
        if (dup) {
            submit_duplicate(co, from, rq, s, dup);
            return;
        }
    }
    float temp = s->sampling ? s->sampling->temperature : 0;
    float top_p = s->sampling ? s->sampling->top_p : 0;
    if (submit_check(co, from, rq, s, temp, top_p))
        return;
    if (top_p == 0) /* proto3: unset */
        top_p = 1;
    size_t n = 0;
    int32_t *ids = submit_prompt(co, from, rq, s, &n);
    if (ids == NULL)
        return;
    job *j = co_job_new(co, co->next_id);
    if (j == NULL || co_queue_push(co, j)) {
        if (j)
            co_job_free(co, j);
        free(ids);
        reply_error(co, from, rq, REKV__CONTROL__CODE__INTERNAL, "out of memory");
        return;
    }
    j->prompt = ids;
    j->n_prompt = (uint32_t)n;
    j->temperature = temp;
    j->top_k = s->sampling ? s->sampling->top_k : 0;
    j->top_p = top_p;
    j->seed = s->sampling ? s->sampling->seed : 0;
    j->max_new = s->max_new_tokens;
    j->stop_at_eos = s->stop_at_eos;
    j->top_logits = s->top_logits;
    j->logprobs = s->logprobs;
    j->top_logprobs = s->logprobs ? s->top_logprobs : 0;
    j->priority = s->priority;
    j->accepted_at = co_realtime_s();
    if (co_job_set_stops(j, s->stop, s->n_stop)) {
        co_queue_remove(co, j);
        co_job_free(co, j);
        reply_error(co, from, rq, REKV__CONTROL__CODE__INTERNAL, "out of memory");
        return;
    }
    if (s->stream) {
        j->subs[0] = (sub){*from, rq, 0};
        j->n_subs = 1;
    }
    rekv_err err = {0};
    if (key && co_job_set_key(co, j, key)) {
        co_queue_remove(co, j);
        co_job_free(co, j);
        reply_error(co, from, rq, REKV__CONTROL__CODE__INTERNAL, "out of memory");
        return;
    }
    if (co_journal_accepted(co, j, &err)) {
        co_event(co, REKV_CO_EVENT_ERROR, "%s", err.msg);
        co_queue_remove(co, j);
        co_job_free(co, j);
        reply_error(co, from, rq, REKV__CONTROL__CODE__INTERNAL, "journal: %s", err.msg);
        return;
    }
    co->accepted++;
    j->unsynced = 1;
    Rekv__Control__SubmitReply sr = REKV__CONTROL__SUBMIT_REPLY__INIT;
    sr.job = j->id;
    sr.prompt_tokens = (uint32_t)n;
    sr.queue_depth = co->n_queue;
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_SUBMITTED;
    r.submitted = &sr;
    co_reply_add(co, from, &r, j);
}

/* NOT_FOUND for a job we do not have: ids below the next one were handed out and the job has
 * ended and been forgotten (only the last --keep-finished jobs, --keep-finished-bytes of results,
 * are kept), or (rarely) its Submit failed after the id was taken. */
static void not_found(rekv_coordinator *co, const rid *from, uint64_t rq, uint64_t id)
{
    if (id >= 1 && id < co->next_id)
        reply_error(co, from, rq, REKV__CONTROL__CODE__NOT_FOUND,
                    "job %llu is no longer remembered: it ended and was forgotten (the "
                    "coordinator keeps the last %u finished jobs and at most %llu bytes of their "
                    "results: --keep-finished, --keep-finished-bytes)",
                    (unsigned long long)id, co->cfg.keep_finished,
                    (unsigned long long)co->cfg.keep_finished_bytes);
    else
        reply_error(co, from, rq, REKV__CONTROL__CODE__NOT_FOUND, "no job %llu",
                    (unsigned long long)id);
}

static void do_status(rekv_coordinator *co, const rid *from, uint64_t rq,
                      const Rekv__Control__StatusRequest *s)
{
    job *j = co_job_find(co, s->job);
    if (j == NULL) {
        not_found(co, from, rq, s->job);
        return;
    }
    Rekv__Control__JobStatus st;
    co_status_fill(j, &st);
    char *text = NULL;
    size_t tl, shown;
    if (s->with_text && co->tok && j->n_gen && co_job_stop_text(j)) {
        /* the text a stream shows by now: held back where a stop may begin, cut at the stop */
        if (co_job_text_shown(co, j, j->n_gen, &text, &tl, &shown) == 0) {
            text[shown] = '\0';
            st.text = text;
        }
    } else if (s->with_text && co->tok && j->n_gen &&
               rekv_tokenizer_decode(co->tok, j->gen, j->n_gen, &text, &tl, NULL) == 0) {
        st.text = text;
    }
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_JOB;
    r.job = &st;
    co_reply_add(co, from, &r, NULL);
    free(text);
}

static void do_cancel(rekv_coordinator *co, const rid *from, uint64_t rq, uint64_t id)
{
    job *j = co_job_find(co, id);
    if (j == NULL) {
        not_found(co, from, rq, id);
        return;
    }
    if (j->state == REKV__CONTROL__JOB_STATE__RUNNING && j->worker >= 0) {
        worker *w = &co->workers[j->worker];
        for (uint32_t k = 0; k < w->n_run; k++)
            if (w->run[k] == j) {
                w->run[k] = w->run[--w->n_run];
                break;
            }
        w->cancel[w->n_cancel++] = j->id; /* n_cancel + n_run <= max_batch */
        co_worker_drop(co, w, j->id);
    }
    if (j->state == REKV__CONTROL__JOB_STATE__QUEUED ||
        j->state == REKV__CONTROL__JOB_STATE__RUNNING)
        co_job_end(co, j, REKV__CONTROL__JOB_STATE__CANCELLED, "cancelled", NULL);
    Rekv__Control__JobStatus st;
    co_status_fill(j, &st);
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_JOB;
    r.job = &st;
    co_reply_add(co, from, &r, NULL);
}

/* Subscribes a client to job id: a first event with the tokens it needs so far (from from_tok
 * on), sent at once, then the rest as they come. */
static void do_stream(rekv_coordinator *co, const rid *from, uint64_t rq, uint64_t id,
                      uint32_t from_tok)
{
    job *j = co_job_find(co, id);
    if (j == NULL) {
        not_found(co, from, rq, id);
        return;
    }
    int over = j->state != REKV__CONTROL__JOB_STATE__QUEUED &&
               j->state != REKV__CONTROL__JOB_STATE__RUNNING;
    Rekv__Control__StreamEvent ev;
    stream_event(co, j, from_tok < j->n_gen ? from_tok : j->n_gen, over, &ev, NULL);
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_EVENT;
    r.event = &ev;
    co_reply_add(co, from, &r, NULL);
    free(ev.text.data);
    if (!over) {
        if (j->n_subs == MAX_SUBS)
            j->subs[0] = j->subs[--j->n_subs]; /* bounded: the oldest subscriber loses out */
        /* later events start where the job is now; a re-run after a worker death resends
         * nothing the subscriber has */
        if (j->streamed < j->n_gen) {
            j->streamed = j->n_gen;
            j->stream_bytes = SIZE_MAX;
        }
        j->subs[j->n_subs] = (sub){*from, rq, from_tok};
        j->n_subs++;
    }
}

static void do_health(rekv_coordinator *co, const rid *from, uint64_t rq)
{
    Rekv__Control__Health h = REKV__CONTROL__HEALTH__INIT;
    h.serving = 1;
    for (int i = 0; i < MAX_WORKERS; i++)
        h.workers += co->workers[i].active ? 1u : 0u;
    h.protocol_version = REKV_CONTROL_PROTO_VERSION;
    h.uptime_s = (double)(rekv_now_ns() - co->start_ns) * 1e-9;
    h.model = co->model_name;
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_HEALTH;
    r.health = &h;
    co_reply_add(co, from, &r, NULL);
}

/* Reads one control message; returns 0 when there was none. */
static int read_control(rekv_coordinator *co)
{
    zmq_msg_t id, body;
    zmq_msg_init(&id);
    if (zmq_msg_recv(&id, co->ctl, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&id);
        return 0;
    }
    rid from;
    from.n = zmq_msg_size(&id) <= MAX_RID ? zmq_msg_size(&id) : MAX_RID;
    memcpy(from.b, zmq_msg_data(&id), from.n);
    int more = zmq_msg_more(&id);
    zmq_msg_close(&id);
    size_t frames = 0, size = 0;
    zmq_msg_init(&body);
    Rekv__Control__Request *req = NULL;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, co->ctl, 0) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        frames++;
        size = zmq_msg_size(&m);
        if (frames == 1) {
            zmq_msg_close(&body);
            body = m;
        } else {
            zmq_msg_close(&m);
        }
    }
    if (frames != 1) {
        reply_error(co, &from, 0, REKV__CONTROL__CODE__BAD_REQUEST,
                    "a request is exactly one frame (got %zu)", frames);
        goto out;
    }
    if (size > REKV_CONTROL_MAX_REQUEST) {
        reply_error(co, &from, 0, REKV__CONTROL__CODE__BAD_REQUEST,
                    "the request of %zu bytes is larger than the limit of %u bytes", size,
                    REKV_CONTROL_MAX_REQUEST);
        goto out;
    }
    req = rekv__control__request__unpack(NULL, size, zmq_msg_data(&body));
    if (req == NULL) {
        reply_error(co, &from, 0, REKV__CONTROL__CODE__BAD_REQUEST,
                    "the request is not a rekv.control.Request message");
        goto out;
    }
    if (req->version != REKV_CONTROL_PROTO_VERSION) {
        reply_error(co, &from, req->id, REKV__CONTROL__CODE__BAD_REQUEST,
                    "protocol version %u is not supported (this coordinator speaks %u)",
                    req->version, REKV_CONTROL_PROTO_VERSION);
        goto out;
    }
    if (rekv_conncap_over(co->ctl_cap, &body)) {
        /* never served, whatever it asks: the client closes and tries again later */
        rekv_conncap_stats cs;
        rekv_conncap_get_stats(co->ctl_cap, &cs);
        co_event_rl(co, CO_RL_CONN_CAP, REKV_CO_EVENT_WARN,
                    "control socket: %u connections open, more than --max-clients %u: busy",
                    cs.live, cs.max);
        reply_error(co, &from, req->id, REKV__CONTROL__CODE__BUSY,
                    "busy: the coordinator serves at most %u client connections (--max-clients) "
                    "and %u are open; retry later",
                    cs.max, cs.live);
        goto out;
    }
    switch (req->body_case) {
    case REKV__CONTROL__REQUEST__BODY_SUBMIT:
        do_submit(co, &from, req->id, req->submit);
        break;
    case REKV__CONTROL__REQUEST__BODY_STATUS:
        do_status(co, &from, req->id, req->status);
        break;
    case REKV__CONTROL__REQUEST__BODY_CANCEL:
        do_cancel(co, &from, req->id, req->cancel->job);
        break;
    case REKV__CONTROL__REQUEST__BODY_STREAM:
        do_stream(co, &from, req->id, req->stream->job, 0);
        break;
    case REKV__CONTROL__REQUEST__BODY_STATS:
        co_do_stats(co, &from, req->id);
        break;
    case REKV__CONTROL__REQUEST__BODY_HEALTH:
        do_health(co, &from, req->id);
        break;
    default:
        reply_error(co, &from, req->id, REKV__CONTROL__CODE__BAD_REQUEST, "the request is empty");
    }
out:
    if (req)
        rekv__control__request__free_unpacked(req, NULL);
    zmq_msg_close(&body);
    return 1;
}

/* Reads a round of requests, makes the accepted jobs (and every job ended so far) durable with
 * one sync, answers, then reports the ended jobs to their subscribers. */
void co_handle_control(rekv_coordinator *co)
{
    co->n_replies = 0;
    size_t n = 0;
    while (n < READ_BATCH && read_control(co))
        n++;
    int synced_ok = 1, need = co->pend_head != NULL;
    rekv_err err = {0};
    for (size_t i = 0; i < co->n_replies && !need; i++)
        need = co->replies[i].accepted != NULL;
    if (need && co->journal && rekv_journal_sync(co->journal, &err)) {
        co_event(co, REKV_CO_EVENT_ERROR, "%s", err.msg);
        synced_ok = 0;
    }
    for (size_t i = 0; i < co->n_replies; i++) {
        reply *rp = &co->replies[i];
        if (rp->accepted && !synced_ok) {
            /* not durable, so not accepted: take it back (below) and say so */
            co->accepted -= rp->dup ? 0 : 1;
            free(rp->buf);
            Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
            r.id = rp->req_id;
            r.version = REKV_CONTROL_PROTO_VERSION;
            r.code = REKV__CONTROL__CODE__INTERNAL;
            r.error = err.msg;
            if (pack_response(&r, &rp->buf, &rp->len))
                continue;
        }
        co_send_to(co->ctl, &rp->to, rp->buf, rp->len);
        free(rp->buf);
    }
    for (size_t i = 0; i < co->n_replies; i++) {
        job *j = co->replies[i].accepted;
        if (j == NULL || co->replies[i].dup)
            continue;
        j->unsynced = 0;
        /* a job cancelled in the round it came in has ended and is reported as such */
        if (!synced_ok && !j->end_pending) {
            co_queue_remove(co, j);
            co_job_free(co, j);
        }
    }
    co->n_replies = 0;
    co_jobs_report_ended(co);
}
