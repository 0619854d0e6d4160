/* co_jobs.c — the coordinator's job table: jobs by id and by client key, the queue of waiting
 * jobs (picked by priority, then arrival), the ring of finished jobs kept for Status, a job's end
 * (a worker still holding Plans that name it is sent a Drop at once), and its re-queueing when its
 * worker dies; the stop strings (a job's text decoded a token at a time, the stop looked for in
 * it, and how much of it clients may see while a stop may still complete); and the journal that
 * makes jobs run once across restarts: a record on acceptance (synced before the Submit is
 * answered) and on end (synced before the end is reported to anyone: co_job_end only queues the
 * job for co_jobs_sync), the replay on start, the compact rewrite. */
#define _GNU_SOURCE /* memmem */
#include "coordinator/co_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"

/* ---------------------------------------------------------------- jobs */

job *co_job_find(rekv_coordinator *co, uint64_t id)
{
    for (job *j = co->hash[id % HASH_BUCKETS]; j; j = j->hnext)
        if (j->id == id)
            return j;
    return NULL;
}

/* FNV-1a */
static uint32_t key_hash(const char *k)
{
    uint32_t h = 2166136261u;
    for (; *k; k++)
        h = (h ^ (uint8_t)*k) * 16777619u;
    return h % HASH_BUCKETS;
}

job *co_job_by_key(rekv_coordinator *co, const char *key)
{
    for (job *j = co->khash[key_hash(key)]; j; j = j->knext)
        if (strcmp(j->key, key) == 0)
            return j;
    return NULL;
}

int co_job_set_key(rekv_coordinator *co, job *j, const char *key)
{
    if ((j->key = strdup(key)) == NULL)
        return -ENOMEM;
    uint32_t b = key_hash(key);
    j->knext = co->khash[b];
    co->khash[b] = j;
    return 0;
}

job *co_job_new(rekv_coordinator *co, uint64_t id)
{
    job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    j->id = id;
    j->worker = -1;
    j->queued_pos = -1;
    j->queued_s = -1;
    j->first_token_s = -1;
    j->hnext = co->hash[id % HASH_BUCKETS];
    co->hash[id % HASH_BUCKETS] = j;
    if (id >= co->next_id)
        co->next_id = id + 1;
    return j;
}

void co_job_free(rekv_coordinator *co, job *j)
{
    job **pp = &co->hash[j->id % HASH_BUCKETS];
    while (*pp && *pp != j)
        pp = &(*pp)->hnext;
    if (*pp)
        *pp = j->hnext;
    if (j->key) {
        pp = &co->khash[key_hash(j->key)];
        while (*pp && *pp != j)
            pp = &(*pp)->knext;
        if (*pp)
            *pp = j->knext;
        free(j->key);
    }
    free(j->prompt);
    free(j->gen);
    free(j->top_ids);
    free(j->top_vals);
    free(j->lp);
    free(j->tlp_ids);
    free(j->tlp_vals);
    free(j->error);
    for (uint32_t i = 0; i < j->n_stop; i++)
        free(j->stop[i]);
    free(j->stop);
    free(j->text);
    free(j);
}

int co_queue_push(rekv_coordinator *co, job *j)
{
    if (co->n_queue == co->cap_queue) {
        uint32_t cap = co->cap_queue ? co->cap_queue * 2 : 64;
        job **q = realloc(co->queue, sizeof(job *) * cap);
        if (q == NULL)
            return -ENOMEM;
        co->queue = q;
        co->cap_queue = cap;
    }
    j->state = REKV__CONTROL__JOB_STATE__QUEUED;
    j->queued_pos = (int)co->n_queue;
    j->order = co->next_order++;
    co->queue[co->n_queue++] = j;
    return 0;
}

void co_queue_remove(rekv_coordinator *co, job *j)
{
    if (j->queued_pos < 0)
        return;
    uint32_t i = (uint32_t)j->queued_pos;
    co->queue[i] = co->queue[--co->n_queue];
    co->queue[i]->queued_pos = (int)i;
    j->queued_pos = -1;
}

/* The next job to run: highest priority, then earliest; one backing off after a failed attempt
 * (retry_at_ns) waits out its time without holding up the rest. */
job *co_queue_peek(rekv_coordinator *co)
{
    job *best = NULL;
    uint64_t now = rekv_now_ns();
    for (uint32_t i = 0; i < co->n_queue; i++) {
        job *j = co->queue[i];
        if (j->retry_at_ns > now)
            continue;
        if (best == NULL || j->priority > best->priority ||
            (j->priority == best->priority && j->order < best->order))
            best = j;
    }
    return best;
}

static int queue_order(const void *a, const void *b)
{
    const job *x = *(job *const *)a, *y = *(job *const *)b;
    if (x->priority != y->priority)
        return x->priority > y->priority ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

size_t co_queue_first(rekv_coordinator *co, job **out, size_t n)
{
    if (n == 0 || co->n_queue == 0)
        return 0;
    if (n == 1) {
        out[0] = co_queue_peek(co);
        return 1;
    }
    job **all = malloc(sizeof(job *) * co->n_queue);
    if (all == NULL) { /* the first alone, which needs no memory */
        out[0] = co_queue_peek(co);
        return 1;
    }
    memcpy(all, co->queue, sizeof(job *) * co->n_queue);
    qsort(all, co->n_queue, sizeof(job *), queue_order);
    size_t k = n < co->n_queue ? n : co->n_queue;
    memcpy(out, all, sizeof(job *) * k);
    free(all);
    return k;
}

job *co_queue_pop(rekv_coordinator *co)
{
    job *best = co_queue_peek(co);
    if (best)
        co_queue_remove(co, best);
    return best;
}

/* What a finished job's result holds in memory: its ids and top logits (capacity). */
static uint64_t result_bytes(const job *j)
{
    uint64_t stops = 0;
    for (uint32_t i = 0; i < j->n_stop; i++)
        stops += strlen(j->stop[i]) + 1 + sizeof(char *);
    uint64_t lp = j->logprobs ? 4 + (uint64_t)j->top_logprobs * 8 : 0;
    return (uint64_t)j->cap_gen * (sizeof(int32_t) + (uint64_t)j->top_logits * 8 + lp) +
           sizeof(job) + (j->error ? strlen(j->error) : 0) + (j->key ? strlen(j->key) : 0) + stops;
}

/* Remembers a finished job for Status, forgetting the oldest beyond keep_finished jobs or
 * keep_finished_bytes of results (the newest is kept whatever its size). A forgotten job's Status
 * says so (co_control.c), and its client key names no job any more. */
static void finished_push(rekv_coordinator *co, job *j)
{
    uint32_t cap = co->cfg.keep_finished;
    uint64_t add = result_bytes(j);
    while (co->n_fin > 0 &&
           (co->n_fin == cap || co->fin_bytes + add > co->cfg.keep_finished_bytes)) {
        job *old = co->finished[co->fin_head];
        co->fin_head = (co->fin_head + 1) % cap;
        co->n_fin--;
        co->fin_bytes -= result_bytes(old);
        co->evicted++;
        co_job_free(co, old);
    }
    co->finished[(co->fin_head + co->n_fin) % cap] = j;
    co->n_fin++;
    co->fin_bytes += add;
}

int co_gen_reserve(job *j, uint32_t n)
{
    if (n <= j->cap_gen)
        return 0;
    uint32_t cap = j->cap_gen ? j->cap_gen : 16;
    while (cap < n)
        cap *= 2;
    int32_t *g = realloc(j->gen, sizeof(int32_t) * cap);
    if (g == NULL)
        return -ENOMEM;
    j->gen = g;
    if (j->top_logits) {
        size_t k = j->top_logits;
        int32_t *ti = realloc(j->top_ids, sizeof(int32_t) * cap * k);
        if (ti == NULL)
            return -ENOMEM;
        j->top_ids = ti;
        float *tv = realloc(j->top_vals, sizeof(float) * cap * k);
        if (tv == NULL)
            return -ENOMEM;
        j->top_vals = tv;
    }
    if (j->logprobs) {
        size_t k = j->top_logprobs;
        float *lp = realloc(j->lp, sizeof(float) * cap);
        if (lp == NULL)
            return -ENOMEM;
        j->lp = lp;
        int32_t *ti = realloc(j->tlp_ids, sizeof(int32_t) * (cap * k > 0 ? cap * k : 1));
        if (ti == NULL)
            return -ENOMEM;
        j->tlp_ids = ti;
        float *tv = realloc(j->tlp_vals, sizeof(float) * (cap * k > 0 ? cap * k : 1));
        if (tv == NULL)
            return -ENOMEM;
        j->tlp_vals = tv;
    }
    j->cap_gen = cap;
    return 0;
}

static int ids_in(const int32_t *ids, size_t n, uint32_t vocab, int32_t *bad)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= vocab) {
            *bad = ids[i];
            return 0;
        }
    return 1;
}

int co_job_extras_valid(const job *j, const Rekv__Worker__JobProgress *jp, uint32_t vocab,
                        int32_t *bad)
{
    return (j->top_logits == 0 || ids_in(jp->top_ids, jp->n_top_ids, vocab, bad)) &&
           (!j->logprobs || ids_in(jp->top_logprob_ids, jp->n_top_logprob_ids, vocab, bad));
}

void co_job_put_extras(job *j, const Rekv__Worker__JobProgress *jp, size_t t)
{
    size_t n = j->n_gen, tk = j->top_logits;
    if (tk) {
        int with = jp->n_top_ids == jp->n_tokens * tk && jp->n_top_vals == jp->n_top_ids;
        for (size_t q = 0; q < tk; q++) {
            j->top_ids[n * tk + q] = with ? jp->top_ids[t * tk + q] : 0;
            j->top_vals[n * tk + q] = with ? jp->top_vals[t * tk + q] : 0;
        }
    }
    if (j->logprobs) {
        size_t lk = j->top_logprobs;
        int with = jp->n_logprobs == jp->n_tokens;
        int with_top = jp->n_top_logprob_ids == jp->n_tokens * lk &&
                       jp->n_top_logprob_vals == jp->n_top_logprob_ids;
        j->lp[n] = with ? jp->logprobs[t] : 0;
        for (size_t q = 0; q < lk; q++) {
            j->tlp_ids[n * lk + q] = with_top ? jp->top_logprob_ids[t * lk + q] : 0;
            j->tlp_vals[n * lk + q] = with_top ? jp->top_logprob_vals[t * lk + q] : 0;
        }
    }
}

/* ---------------------------------------------------------------- stop strings */

/* Tokens of context before `from` that co_text_added decodes with the new ones. */
#define TEXT_CONTEXT 4

/* The tokenizer decodes piece by piece except that the whole text loses up to a few leading
 * spaces (and a piece after BOS its space), so what [from, to) adds is decode(ids[a, to)) less
 * decode(ids[a, from)): the same as decoding every id each time, without the cost growing with
 * the text. When the context decodes to nothing, the strip could reach the new pieces, so it
 * decodes from the start instead. */
int co_text_added(const rekv_tokenizer *tok, const int32_t *ids, uint32_t from, uint32_t to,
                  char **out, size_t *n)
{
    if (to < from)
        return -EINVAL;
    uint32_t a = from > TEXT_CONTEXT ? from - TEXT_CONTEXT : 0;
    char *pre = NULL, *all = NULL;
    size_t n_pre = 0, n_all = 0;
    int rc;
    for (;;) {
        if (a < from && (rc = rekv_tokenizer_decode(tok, ids + a, from - a, &pre, &n_pre, NULL)))
            return rc;
        free(pre);
        pre = NULL;
        if (a == 0 || n_pre > 0)
            break;
        a = 0;
    }
    if ((rc = rekv_tokenizer_decode(tok, ids + a, to - a, &all, &n_all, NULL)))
        return rc;
    REKV_ASSERT(n_pre <= n_all); /* the context's text is a prefix of the whole */
    memmove(all, all + n_pre, n_all - n_pre);
    *out = all;
    *n = n_all - n_pre;
    return 0;
}

int co_job_set_stops(job *j, char *const *stop, size_t n)
{
    if (n == 0)
        return 0;
    if ((j->stop = calloc(n, sizeof(char *))) == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        if ((j->stop[i] = strdup(stop[i] ? stop[i] : "")) == NULL)
            return -ENOMEM; /* co_job_free frees the ones made (n_stop counts them) */
        j->n_stop = (uint32_t)i + 1;
    }
    return 0;
}

int co_job_stop_text(const job *j)
{
    return j->n_stop > 0 || strcmp(j->finish_reason, "stop") == 0;
}

/* The longest end of t[0, n) that is a proper prefix of one of j's stops: the bytes a client
 * must not see yet, since the next tokens may complete the stop. */
static size_t stop_holdback(const job *j, const char *t, size_t n)
{
    size_t best = 0;
    for (uint32_t i = 0; i < j->n_stop; i++) {
        size_t sl = strlen(j->stop[i]);
        if (sl == 0) /* none is accepted; a replayed record could hold one */
            continue;
        for (size_t k = sl - 1 < n ? sl - 1 : n; k > best; k--)
            if (memcmp(t + n - k, j->stop[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

/* The first occurrence of any of j's stops in t[0, n) ending past byte `old` (an earlier one
 * would have been found when its token came): its start, or -1. The earliest start wins, so
 * that the text kept contains no stop at all. */
static long stop_find(const job *j, const char *t, size_t n, size_t old)
{
    long first = -1;
    for (uint32_t i = 0; i < j->n_stop; i++) {
        size_t sl = strlen(j->stop[i]);
        size_t at = old + 1 > sl ? old + 1 - sl : 0;
        if (sl == 0 || n < at + sl)
            continue;
        const char *m = memmem(t + at, n - at, j->stop[i], sl);
        if (m && (first < 0 || m - t < first))
            first = m - t;
    }
    return first;
}

int co_job_stop_check(rekv_coordinator *co, job *j)
{
    if (j->n_stop == 0 || co->tok == NULL)
        return 0;
    if (j->text_tokens > j->n_gen) { /* a re-run started over */
        j->text_tokens = 0;
        j->text_len = 0;
    }
    while (j->text_tokens < j->n_gen) {
        char *add;
        size_t n_add;
        int rc = co_text_added(co->tok, j->gen, j->text_tokens, j->text_tokens + 1, &add, &n_add);
        if (rc)
            return rc;
        if (j->text_len + n_add + 1 > j->text_cap) {
            size_t cap = j->text_cap ? j->text_cap : 256;
            while (cap < j->text_len + n_add + 1)
                cap *= 2;
            char *t = realloc(j->text, cap);
            if (t == NULL) {
                free(add);
                return -ENOMEM;
            }
            j->text = t;
            j->text_cap = cap;
        }
        size_t old = j->text_len;
        memcpy(j->text + old, add, n_add);
        free(add);
        j->text_len += n_add;
        j->text_tokens++;
        long at = stop_find(j, j->text, j->text_len, old);
        if (at >= 0) {
            j->text_end = (uint32_t)at;
            j->n_gen = j->text_tokens; /* the ids after the stop's are not the job's */
            return 1;
        }
    }
    return 0;
}

int co_job_text_shown(rekv_coordinator *co, const job *j, uint32_t upto, char **text, size_t *len,
                      size_t *shown)
{
    if (co->tok == NULL)
        return -ENOENT;
    if (j->text && upto == j->text_tokens) { /* running: the text the stops were looked for in */
        if ((*text = malloc(j->text_len + 1)) == NULL)
            return -ENOMEM;
        memcpy(*text, j->text, j->text_len);
        (*text)[j->text_len] = '\0';
        *len = j->text_len;
    } else {
        int rc = rekv_tokenizer_decode(co->tok, j->gen, upto, text, len, NULL);
        if (rc)
            return rc;
    }
    int over = j->state != REKV__CONTROL__JOB_STATE__QUEUED &&
               j->state != REKV__CONTROL__JOB_STATE__RUNNING;
    if (upto >= j->n_gen && strcmp(j->finish_reason, "stop") == 0)
        *shown = j->text_end < *len ? j->text_end : *len;
    else if (upto >= j->n_gen && over)
        *shown = *len;
    else
        *shown = *len - stop_holdback(j, *text, *len);
    return 0;
}

/* ---------------------------------------------------------------- job life */

static void journal_finished(rekv_coordinator *co, job *j);

/* Ends a job (DONE, CANCELLED or FAILED): its finished record is appended now; subscribers and
 * the finished ring learn of it in co_jobs_sync, once the record is durable. */
void co_job_end(rekv_coordinator *co, job *j, Rekv__Control__JobState st, const char *reason,
                const char *error)
{
    if (j->state == REKV__CONTROL__JOB_STATE__RUNNING)
        co->n_running--;
    co_queue_remove(co, j);
    j->state = st;
    j->worker = -1;
    j->end_ns = rekv_now_ns();
    snprintf(j->finish_reason, sizeof(j->finish_reason), "%s", reason ? reason : "");
    if (error) {
        free(j->error);
        j->error = strdup(error);
    }
    if (st == REKV__CONTROL__JOB_STATE__DONE)
        co->n_done++;
    else if (st == REKV__CONTROL__JOB_STATE__CANCELLED)
        co->n_cancelled++;
    else
        co->n_failed++;
    journal_finished(co, j);
    /* the prompt is no longer needed; only the result is kept */
    free(j->prompt);
    j->prompt = NULL;
    free(j->text);
    j->text = NULL;
    j->text_len = j->text_cap = 0;
    j->text_tokens = 0;
    if (!j->end_pending) {
        j->end_pending = 1;
        j->pnext = NULL;
        if (co->pend_head == NULL)
            co->pend_tail = &co->pend_head;
        *co->pend_tail = j;
        co->pend_tail = &j->pnext;
    }
}

void co_jobs_report_ended(rekv_coordinator *co)
{
    job *j = co->pend_head;
    co->pend_head = NULL;
    co->pend_tail = &co->pend_head;
    while (j) {
        job *next = j->pnext;
        j->end_pending = 0;
        j->pnext = NULL;
        co_stream_flush(co, j);
        finished_push(co, j);
        j = next;
    }
}

int co_jobs_sync(rekv_coordinator *co, rekv_err *err)
{
    int rc = 0;
    if (co->pend_head && co->journal)
        rc = rekv_journal_sync(co->journal, err);
    co_jobs_report_ended(co);
    return rc;
}

void co_worker_drop(rekv_coordinator *co, worker *w, uint64_t id)
{
    if (w->out == 0) /* no Plan out can name it: the next one's cancel is enough */
        return;
    Rekv__Worker__Drop d = REKV__WORKER__DROP__INIT;
    d.n_jobs = 1;
    d.jobs = &id;
    Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
    m.body_case = REKV__WORKER__COORD_MSG__BODY_DROP;
    m.drop = &d;
    co_send_worker(co, w, &m);
}

static void journal_attempts(rekv_coordinator *co, const job *j);

/* Puts a running job back in the queue after its worker died, or fails it after max_attempts.
 * A run that ended on the worker's kvstore loss does not count (the store comes back; the job
 * waits for an available worker) — up to max_attempts of them (co_run_end); nor one that ended
 * on the store's room (CO_RUN_ROOM: other jobs free it, a failing spill tier makes admission
 * price the arena alone) — up to CO_ROOM_WAITS_MAX of them. The attempts used are journaled, so
 * a restart keeps them. A counted failure, and a room one, backs off before the next run —
 * CO_RETRY_BASE_MS, doubling with each attempt used (room wait), at most 64 times it — so that a
 * cause that passes (room another job frees, a disk an operator clears) is seen before the
 * attempts are spent: a step failing on room used to spend all three within milliseconds, and
 * with the spill tier failing 100 of them within minutes. Its status says so meanwhile. */
void co_job_requeue(rekv_coordinator *co, job *j, const char *why, co_run_end how)
{
    int counts = how == CO_RUN_COUNTS;
    if (how == CO_RUN_STORE_LOST && ++j->store_losses > co->cfg.max_attempts) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s; the kvstore was lost under it %u times: given up", why,
                 j->store_losses);
        co_job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", msg);
        return;
    }
    if (how == CO_RUN_ROOM && ++j->room_waits > CO_ROOM_WAITS_MAX) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s; the kvstore had no room for it %u times: given up", why,
                 j->room_waits);
        co_job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", msg);
        return;
    }
    if (!counts && j->attempts > 0)
        j->attempts--;
    else if (j->attempts >= co->cfg.max_attempts) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s; gave up after %u attempts", why, j->attempts);
        co_job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", msg);
        return;
    }
    j->retry_at_ns = 0;
    uint32_t waits = counts ? j->attempts : how == CO_RUN_ROOM ? j->room_waits : 0;
    if (waits > 0) {
        uint32_t shift = waits - 1 < 6 ? waits - 1 : 6;
        uint64_t ms = (uint64_t)CO_RETRY_BASE_MS << shift;
        j->retry_at_ns = rekv_now_ns() + ms * 1000000ull;
        if (counts)
            snprintf(j->waiting, sizeof(j->waiting),
                     "attempt %u of %u failed; retrying in %llu ms: %.*s", j->attempts,
                     co->cfg.max_attempts, (unsigned long long)ms,
                     (int)(sizeof(j->waiting) - 64), why);
        else
            snprintf(j->waiting, sizeof(j->waiting),
                     "waiting for kvstore room (%u of %u); retrying in %llu ms: %.*s",
                     j->room_waits, CO_ROOM_WAITS_MAX, (unsigned long long)ms,
                     (int)(sizeof(j->waiting) - 64), why);
    }
    co->n_running--;
    j->worker = -1;
    /* sampling is seeded, so the re-run produces the same tokens; subscribers got the first
     * `streamed` of them already and will only see the rest */
    j->n_gen = 0;
    j->text_len = 0; /* the re-run decodes the same text again, and stops at the same token */
    j->text_tokens = 0;
    co->requeued++;
    journal_attempts(co, j);
    if (co_queue_push(co, j)) {
        j->state = REKV__CONTROL__JOB_STATE__FAILED; /* not running any more: counted as failed */
        co_job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "",
                   "out of memory re-queueing the job");
    }
}

/* ---------------------------------------------------------------- journal */

void co_status_fill(const job *j, Rekv__Control__JobStatus *s)
{
    rekv__control__job_status__init(s);
    s->job = j->id;
    s->state = j->state;
    s->n_generated_ids = j->n_gen;
    s->generated_ids = j->gen;
    s->top_logits = j->top_logits;
    if (j->top_logits) {
        s->n_top_ids = s->n_top_vals = (size_t)j->n_gen * j->top_logits;
        s->top_ids = j->top_ids;
        s->top_vals = j->top_vals;
    }
    if (j->logprobs) {
        s->n_logprobs = j->n_gen;
        s->logprobs = j->lp;
        s->top_logprobs = j->top_logprobs;
        s->n_top_logprob_ids = s->n_top_logprob_vals = (size_t)j->n_gen * j->top_logprobs;
        s->top_logprob_ids = j->tlp_ids;
        s->top_logprob_vals = j->tlp_vals;
    }
    s->finish_reason = (char *)j->finish_reason;
    s->error = j->error ? j->error : "";
    s->prompt_tokens = j->n_prompt;
    s->cached_tokens = j->cached_tokens;
    s->attempts = j->attempts;
    s->priority = j->priority;
    s->waiting = j->state == REKV__CONTROL__JOB_STATE__QUEUED ? (char *)j->waiting : "";
    uint64_t now = rekv_now_ns();
    s->queued_s = j->queued_s >= 0 ? j->queued_s : 0;
    s->first_token_s = j->first_token_s >= 0 ? j->first_token_s : 0;
    if (j->start_ns)
        s->run_s = (double)((j->end_ns ? j->end_ns : now) - j->start_ns) * 1e-9;
}

static void submit_fill(const job *j, Rekv__Control__Submit *s, Rekv__Control__Sampling *smp)
{
    rekv__control__submit__init(s);
    rekv__control__sampling__init(smp);
    smp->temperature = j->temperature;
    smp->top_k = j->top_k;
    smp->top_p = j->top_p;
    smp->seed = j->seed;
    s->sampling = smp;
    s->n_prompt_ids = j->n_prompt;
    s->prompt_ids = j->prompt;
    s->max_new_tokens = j->max_new;
    s->priority = j->priority;
    s->stop_at_eos = j->stop_at_eos;
    s->top_logits = j->top_logits;
    s->logprobs = j->logprobs;
    s->top_logprobs = j->top_logprobs;
    s->n_stop = j->n_stop;
    s->stop = j->stop;
}

int co_journal_accepted(rekv_coordinator *co, job *j, rekv_err *err)
{
    if (co->journal == NULL)
        return 0;
    Rekv__Control__Submit s;
    Rekv__Control__Sampling smp;
    submit_fill(j, &s, &smp);
    Rekv__Control__JournalRecord rec = REKV__CONTROL__JOURNAL_RECORD__INIT;
    rec.job = j->id;
    rec.body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_ACCEPTED;
    rec.accepted = &s;
    rec.accepted_at = j->accepted_at;
    rec.client_key = j->key ? j->key : "";
    return rekv_journal_append(co->journal, &rec, err);
}

static void journal_finished(rekv_coordinator *co, job *j)
{
    if (co->journal == NULL)
        return;
    Rekv__Control__JobStatus s;
    co_status_fill(j, &s);
    Rekv__Control__JournalRecord rec = REKV__CONTROL__JOURNAL_RECORD__INIT;
    rec.job = j->id;
    rec.body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED;
    rec.finished = &s;
    rec.accepted_at = j->accepted_at;
    rec.client_key = j->key ? j->key : "";
    rec.text_end = j->text_end;
    rec.n_stop = j->n_stop;
    rec.stop = j->stop;
    rekv_err err = {0};
    if (rekv_journal_append(co->journal, &rec, &err))
        co_event(co, REKV_CO_EVENT_ERROR, "%s", err.msg);
}

/* A job back in the queue: the attempts it used (never fsync'd on its own: the next Submit's
 * sync or the kernel carries it; a power cut can lose it, a kill -9 cannot). */
static void journal_attempts(rekv_coordinator *co, const job *j)
{
    if (co->journal == NULL)
        return;
    Rekv__Control__JournalRecord rec = REKV__CONTROL__JOURNAL_RECORD__INIT;
    rec.job = j->id;
    rec.body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_ATTEMPTS;
    rec.attempts = j->attempts;
    rec.accepted_at = j->accepted_at;
    rec.client_key = j->key ? j->key : "";
    rekv_err err = {0};
    if (rekv_journal_append(co->journal, &rec, &err))
        co_event(co, REKV_CO_EVENT_ERROR, "%s", err.msg);
}

/* A replayed job's attempts: at most max_attempts - 1, so that it gets one more (said, never
 * silent) when a restart lowered --max-attempts below what it used. */
static void replay_attempts(rekv_coordinator *co, job *j, uint32_t used)
{
    uint32_t max = co->cfg.max_attempts;
    if (used >= max) {
        co_event(co, REKV_CO_EVENT_WARN,
                 "job %llu used %u attempts, --max-attempts is %u: it gets one more",
                 (unsigned long long)j->id, used, max);
        used = max - 1;
    }
    j->attempts = used;
}

/* Replay: an accepted job queues again (with the attempts a later record says it used; the
 * attempt a coordinator restart cut short does not count); a finished record ends it. */
int co_replay_fn(void *ctx, const Rekv__Control__JournalRecord *rec)
{
    rekv_coordinator *co = ctx;
    if (rec->next_id > co->next_id)
        co->next_id = rec->next_id;
    if (rec->body_case == REKV__CONTROL__JOURNAL_RECORD__BODY__NOT_SET)
        return 0;
    job *j = co_job_find(co, rec->job);
    if (rec->body_case == REKV__CONTROL__JOURNAL_RECORD__BODY_ACCEPTED && rec->accepted) {
        if (j)
            return 0; /* duplicate record (a rewrite raced a crash): the first one wins */
        const Rekv__Control__Submit *s = rec->accepted;
        if ((j = co_job_new(co, rec->job)) == NULL)
            return -ENOMEM;
        j->n_prompt = (uint32_t)s->n_prompt_ids;
        j->prompt = malloc(sizeof(int32_t) * (s->n_prompt_ids ? s->n_prompt_ids : 1));
        if (j->prompt == NULL)
            return -ENOMEM;
        memcpy(j->prompt, s->prompt_ids, sizeof(int32_t) * s->n_prompt_ids);
        if (s->sampling) {
            j->temperature = s->sampling->temperature;
            j->top_k = s->sampling->top_k;
            j->top_p = s->sampling->top_p;
            j->seed = s->sampling->seed;
        }
        j->max_new = s->max_new_tokens;
        j->stop_at_eos = s->stop_at_eos;
        j->top_logits = s->top_logits;
        j->logprobs = s->logprobs;
        j->top_logprobs =
            s->logprobs && s->top_logprobs <= CO_TOP_LOGPROBS_MAX ? s->top_logprobs : 0;
        j->priority = s->priority;
        j->accepted_at = rec->accepted_at;
        if (co_job_set_stops(j, s->stop, s->n_stop))
            return -ENOMEM;
        co->accepted++;
        if (rec->client_key && *rec->client_key && co_job_by_key(co, rec->client_key) == NULL &&
            co_job_set_key(co, j, rec->client_key))
            return -ENOMEM;
        return co_queue_push(co, j);
    }
    if (rec->body_case == REKV__CONTROL__JOURNAL_RECORD__BODY_ATTEMPTS) {
        if (j && !j->end_ns)
            replay_attempts(co, j, rec->attempts);
        return 0;
    }
    if (rec->body_case == REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED && rec->finished) {
        const Rekv__Control__JobStatus *s = rec->finished;
        if (j && j->end_ns)
            return 0; /* already finished: a duplicate record */
        if (j == NULL && (j = co_job_new(co, rec->job)) == NULL)
            return -ENOMEM;
        if (j->key == NULL && rec->client_key && *rec->client_key &&
            co_job_by_key(co, rec->client_key) == NULL && co_job_set_key(co, j, rec->client_key))
            return -ENOMEM;
        co_queue_remove(co, j);
        j->top_logits = s->top_logits;
        if (s->n_top_ids != s->n_generated_ids * s->top_logits || s->n_top_vals != s->n_top_ids)
            j->top_logits = 0; /* inconsistent record: keep the ids, drop the logits */
        /* log-probabilities when the record has them all (an older or inconsistent one: none) */
        j->logprobs = s->n_logprobs > 0 && s->n_logprobs == s->n_generated_ids &&
                      s->n_top_logprob_ids == s->n_generated_ids * s->top_logprobs &&
                      s->n_top_logprob_vals == s->n_top_logprob_ids;
        j->top_logprobs = j->logprobs ? s->top_logprobs : 0;
        if (co_gen_reserve(j, (uint32_t)s->n_generated_ids))
            return -ENOMEM;
        memcpy(j->gen, s->generated_ids, sizeof(int32_t) * s->n_generated_ids);
        if (j->top_logits) {
            memcpy(j->top_ids, s->top_ids, sizeof(int32_t) * s->n_top_ids);
            memcpy(j->top_vals, s->top_vals, sizeof(float) * s->n_top_vals);
        }
        if (j->logprobs) {
            memcpy(j->lp, s->logprobs, sizeof(float) * s->n_logprobs);
            memcpy(j->tlp_ids, s->top_logprob_ids, sizeof(int32_t) * s->n_top_logprob_ids);
            memcpy(j->tlp_vals, s->top_logprob_vals, sizeof(float) * s->n_top_logprob_vals);
        }
        j->n_gen = j->streamed = (uint32_t)s->n_generated_ids;
        j->stream_bytes = SIZE_MAX;
        j->n_prompt = s->prompt_tokens;
        j->cached_tokens = s->cached_tokens;
        j->attempts = s->attempts;
        j->priority = s->priority;
        j->queued_s = s->queued_s;
        j->first_token_s = s->first_token_s > 0 ? s->first_token_s : -1;
        j->accepted_at = rec->accepted_at;
        j->state = s->state;
        snprintf(j->finish_reason, sizeof(j->finish_reason), "%s",
                 s->finish_reason ? s->finish_reason : "");
        j->text_end = rec->text_end;
        if (j->n_stop == 0 && co_job_set_stops(j, rec->stop, rec->n_stop))
            return -ENOMEM;
        if (s->error && *s->error)
            j->error = strdup(s->error);
        free(j->prompt);
        j->prompt = NULL;
        j->end_ns = rekv_now_ns();
        if (j->state == REKV__CONTROL__JOB_STATE__DONE)
            co->n_done++;
        else if (j->state == REKV__CONTROL__JOB_STATE__CANCELLED)
            co->n_cancelled++;
        else
            co->n_failed++;
        finished_push(co, j);
    }
    return 0;
}

/* Rewrites the journal with what a replay needs: the next job id, then every job the
 * coordinator remembers (unfinished ones as accepted records, the others as finished ones). */
int co_journal_compact(rekv_coordinator *co, rekv_err *err)
{
    size_t n = 1, k = 0;
    for (size_t b = 0; b < HASH_BUCKETS; b++)
        for (job *j = co->hash[b]; j; j = j->hnext)
            n += 2; /* an unfinished one may need its attempts too */
    Rekv__Control__JournalRecord *recs = calloc(n, sizeof(*recs));
    Rekv__Control__JournalRecord **ptrs = calloc(n, sizeof(*ptrs));
    Rekv__Control__Submit *subs = calloc(n, sizeof(*subs));
    Rekv__Control__Sampling *smps = calloc(n, sizeof(*smps));
    Rekv__Control__JobStatus *sts = calloc(n, sizeof(*sts));
    int rc = 0;
    if (!recs || !ptrs || !subs || !smps || !sts) {
        rc = rekv_errf(err, -ENOMEM, "out of memory compacting the journal");
        goto out;
    }
    /* ids of forgotten jobs (evicted from the finished ring) are never handed out again */
    rekv__control__journal_record__init(&recs[0]);
    recs[0].next_id = co->next_id;
    ptrs[k++] = &recs[0];
    /* unfinished jobs in id order would be nicer; hash order is fine: replay keys on ids */
    for (size_t b = 0; b < HASH_BUCKETS; b++)
        for (job *j = co->hash[b]; j && k < n; j = j->hnext) {
            rekv__control__journal_record__init(&recs[k]);
            recs[k].job = j->id;
            recs[k].accepted_at = j->accepted_at;
            recs[k].client_key = j->key ? j->key : "";
            if (j->state == REKV__CONTROL__JOB_STATE__QUEUED ||
                j->state == REKV__CONTROL__JOB_STATE__RUNNING) {
                submit_fill(j, &subs[k], &smps[k]);
                recs[k].body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_ACCEPTED;
                recs[k].accepted = &subs[k];
                /* the attempts it used; a running one's own has not ended yet */
                uint32_t used = j->attempts -
                                (j->state == REKV__CONTROL__JOB_STATE__RUNNING && j->attempts > 0);
                if (used > 0 && k + 1 < n) {
                    ptrs[k] = &recs[k];
                    k++;
                    rekv__control__journal_record__init(&recs[k]);
                    recs[k].job = j->id;
                    recs[k].accepted_at = j->accepted_at;
                    recs[k].client_key = j->key ? j->key : "";
                    recs[k].body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_ATTEMPTS;
                    recs[k].attempts = used;
                }
            } else {
                co_status_fill(j, &sts[k]);
                recs[k].body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED;
                recs[k].finished = &sts[k];
                recs[k].text_end = j->text_end;
                recs[k].n_stop = j->n_stop;
                recs[k].stop = j->stop;
            }
            ptrs[k] = &recs[k];
            k++;
        }
    rc = rekv_journal_rewrite(co->journal, (const Rekv__Control__JournalRecord *const *)ptrs, k,
                              err);
out:
    free(recs);
    free(ptrs);
    free(subs);
    free(smps);
    free(sts);
    return rc;
}
