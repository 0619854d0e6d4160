/* coordinator.c — rekv-coordinator's server: the control socket, the bounded job queue, continuous
 * batching over the workers (one Plan per step per worker, jobs joining and leaving at step
 * boundaries), worker liveness, the journal, and the stream subscriptions. One thread, one
 * zmq_poll loop. */
#define _GNU_SOURCE
#include "coordinator/coordinator.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "coordinator/co_plan.h"
#include "coordinator/journal.h"
#include "coordinator/metrics.h"
#include "loader/loader.h"
#include "proto/worker.pb-c.h"

#define MAX_WORKERS 16
#define MAX_SUBS 4          /* stream subscribers per job */
#define MAX_RID 256         /* ZeroMQ routing ids are at most 255 bytes */
#define READ_BATCH 512      /* control requests read (and journaled with one sync) per round */
#define HASH_BUCKETS 4096
#define RATE_SLOTS 8        /* one-second samples of the token counter for tokens/s */
#define COMPACT_RECORDS 8192 /* rewrite the journal after this many appends */

typedef struct rid {
    uint8_t b[MAX_RID]; /* routing id bytes */
    size_t n;           /* length */
} rid;

typedef struct sub {
    rid to;      /* the client's routing id */
    uint64_t id; /* the request id its events carry */
} sub;

typedef struct job {
    uint64_t id;
    Rekv__Control__JobState state;
    int32_t *prompt;        /* [n_prompt] token ids; NULL for jobs replayed finished */
    uint32_t n_prompt;
    float temperature;      /* sampling, as submitted */
    uint32_t top_k;
    float top_p;
    uint64_t seed;
    uint32_t max_new;       /* max_new_tokens */
    int stop_at_eos;
    int32_t priority;       /* higher first */
    uint64_t order;         /* arrival order among equal priorities */
    int32_t *gen;           /* [n_gen] generated ids (capacity cap_gen) */
    uint32_t n_gen, cap_gen;
    uint32_t top_logits;    /* k: the k largest logits before each generated token; 0 none */
    int32_t *top_ids;       /* [n_gen][top_logits] (capacity cap_gen) */
    float *top_vals;        /* [n_gen][top_logits] */
    uint32_t streamed;      /* tokens already sent to subscribers: a re-run resends none of them */
    char finish_reason[16]; /* "length", "eos", "context", "cancelled" */
    char *error;            /* FAILED: one line (malloc'd) */
    uint32_t attempts;      /* starts on a worker */
    int worker;             /* index in workers[] while RUNNING, else -1 */
    double accepted_at;     /* CLOCK_REALTIME s */
    uint64_t start_ns;      /* last start (monotonic) */
    uint64_t end_ns;        /* end (monotonic); 0 while unfinished */
    double queued_s;        /* acceptance to first start; < 0 until started */
    sub subs[MAX_SUBS];
    int n_subs;
    int queued_pos;         /* index in the queue while QUEUED, else -1 */
    struct job *hnext;      /* hash chain */
} job;

typedef struct worker {
    int active;           /* slot in use */
    rid id;               /* routing id on the worker socket */
    char name[64], backend[16], mode[16];
    uint32_t max_batch, vocab, max_pos;
    int32_t eos_id;
    uint64_t last_seen_ns; /* last message of any kind */
    int busy;             /* a Plan is out, its Progress not yet back */
    uint64_t step;        /* number of the Plan out (or the last one) */
    uint64_t plan_sent_ns;
    job **run;            /* [max_batch] jobs in its batch */
    uint32_t n_run;
    uint64_t *cancel;     /* [max_batch] jobs to drop at its next Plan */
    uint32_t n_cancel;
    uint64_t steps, tokens;
    co_plan_state plan;   /* the planner's state for this worker (co_plan.h) */
} worker;

typedef struct reply {
    rid to;          /* routing id */
    uint8_t *buf;    /* packed Response */
    size_t len;
    uint64_t req_id; /* the request's id */
    job *accepted;   /* a Submit waiting for the journal sync, else NULL */
} reply;

struct rekv_coordinator {
    rekv_coordinator_config cfg;
    char control_ep[4200], worker_ep[4200];
    char control_path[4200], worker_path[4200]; /* ipc socket files, "" otherwise */
    void *zctx, *ctl, *wrk;
    int stop_fd;             /* eventfd: rekv_coordinator_stop */
    rekv_journal *journal;   /* NULL without a state_dir */
    rekv_tokenizer *tok;     /* text prompts, with_text; NULL without one */
    rekv_model_config mcfg;  /* valid when have_model */
    int have_model;
    char model_name[256];

    job *hash[HASH_BUCKETS];
    job **queue;             /* QUEUED jobs, unordered (picked by priority, then order) */
    uint32_t n_queue, cap_queue;
    job **finished;          /* ring of finished jobs kept for Status, oldest first */
    uint32_t fin_head, n_fin;
    uint64_t next_id, next_order;
    worker workers[MAX_WORKERS];
    uint64_t session;

    reply *replies;          /* this round's replies [READ_BATCH] */
    size_t n_replies;

    /* counters */
    uint64_t n_running, n_done, n_cancelled, n_failed, accepted, rejected_busy, bad_requests,
        requeued, tokens, steps;
    double rtt_sum, wstep_sum;
    uint64_t counters[6];    /* h2d weights, kv, act, d2h, recomputed, fetched */
    uint64_t rate_tokens[RATE_SLOTS];
    uint64_t rate_ns[RATE_SLOTS];
    uint32_t rate_i;
    uint64_t start_ns;
    rekv_metrics_server *metrics; /* the scrape port; NULL when not configured */
};

static void event(rekv_coordinator *co, rekv_co_event lvl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void event(rekv_coordinator *co, rekv_co_event lvl, const char *fmt, ...)
{
    if (co->cfg.on_event == NULL)
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    co->cfg.on_event(co->cfg.ctx, lvl, msg);
}

void rekv_coordinator_config_defaults(rekv_coordinator_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->queue_limit = 256;
    cfg->keep_finished = 1024;
    cfg->worker_timeout_ms = 30000;
    cfg->max_attempts = 3;
    cfg->max_new_limit = 1u << 20;
    cfg->signal_fd = -1;
}

static double realtime_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- jobs */

static job *job_find(rekv_coordinator *co, uint64_t id)
{
    for (job *j = co->hash[id % HASH_BUCKETS]; j; j = j->hnext)
        if (j->id == id)
            return j;
    return NULL;
}

static job *job_new(rekv_coordinator *co, uint64_t id)
{
    job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    j->id = id;
    j->worker = -1;
    j->queued_pos = -1;
    j->queued_s = -1;
    j->hnext = co->hash[id % HASH_BUCKETS];
    co->hash[id % HASH_BUCKETS] = j;
    if (id >= co->next_id)
        co->next_id = id + 1;
    return j;
}

static void job_free(rekv_coordinator *co, job *j)
{
    job **pp = &co->hash[j->id % HASH_BUCKETS];
    while (*pp && *pp != j)
        pp = &(*pp)->hnext;
    if (*pp)
        *pp = j->hnext;
    free(j->prompt);
    free(j->gen);
    free(j->top_ids);
    free(j->top_vals);
    free(j->error);
    free(j);
}

static int queue_push(rekv_coordinator *co, job *j)
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

static void queue_remove(rekv_coordinator *co, job *j)
{
    if (j->queued_pos < 0)
        return;
    uint32_t i = (uint32_t)j->queued_pos;
    co->queue[i] = co->queue[--co->n_queue];
    co->queue[i]->queued_pos = (int)i;
    j->queued_pos = -1;
}

/* The next job to run: highest priority, then earliest. */
static job *queue_pop(rekv_coordinator *co)
{
    job *best = NULL;
    for (uint32_t i = 0; i < co->n_queue; i++) {
        job *j = co->queue[i];
        if (best == NULL || j->priority > best->priority ||
            (j->priority == best->priority && j->order < best->order))
            best = j;
    }
    if (best)
        queue_remove(co, best);
    return best;
}

/* Remembers a finished job for Status, forgetting the oldest beyond keep_finished. */
static void finished_push(rekv_coordinator *co, job *j)
{
    uint32_t cap = co->cfg.keep_finished;
    if (co->n_fin == cap) {
        job *old = co->finished[co->fin_head];
        co->fin_head = (co->fin_head + 1) % cap;
        co->n_fin--;
        job_free(co, old);
    }
    co->finished[(co->fin_head + co->n_fin) % cap] = j;
    co->n_fin++;
}

static int gen_reserve(job *j, uint32_t n)
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
    j->cap_gen = cap;
    return 0;
}

/* ---------------------------------------------------------------- sending */

static int send_to(void *sock, const rid *to, const void *buf, size_t len)
{
    /* ROUTER_MANDATORY: a vanished peer is EHOSTUNREACH instead of a silent drop; DONTWAIT: a
     * peer that does not read is dropped rather than blocking the loop */
    if (zmq_send(sock, to->b, to->n, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return -errno;
    if (zmq_send(sock, buf, len, ZMQ_DONTWAIT) < 0)
        return -errno;
    return 0;
}

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
static void reply_add(rekv_coordinator *co, const rid *to, Rekv__Control__Response *r, job *acc)
{
    r->version = REKV_CONTROL_PROTO_VERSION;
    reply *rp = &co->replies[co->n_replies];
    if (pack_response(r, &rp->buf, &rp->len))
        return; /* out of memory: the client times out */
    rp->to = *to;
    rp->req_id = r->id;
    rp->accepted = acc;
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
    reply_add(co, to, &r, NULL);
}

static void send_worker(rekv_coordinator *co, worker *w, Rekv__Worker__CoordMsg *m)
{
    m->version = REKV_WORKER_PROTO_VERSION;
    size_t n = rekv__worker__coord_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL)
        return;
    rekv__worker__coord_msg__pack(m, buf);
    int rc = send_to(co->wrk, &w->id, buf, n);
    if (rc)
        event(co, REKV_CO_EVENT_WARN, "send to worker %s: %s", w->name, zmq_strerror(-rc));
    free(buf);
}

/* Streams tokens [streamed, n_gen) (and the end, when the job is over) to its subscribers. */
static void stream_flush(rekv_coordinator *co, job *j)
{
    if (j->n_subs == 0) {
        if (j->n_gen > j->streamed)
            j->streamed = j->n_gen;
        return;
    }
    int over = j->state != REKV__CONTROL__JOB_STATE__QUEUED &&
               j->state != REKV__CONTROL__JOB_STATE__RUNNING;
    if (j->n_gen <= j->streamed && !over)
        return;
    Rekv__Control__StreamEvent ev = REKV__CONTROL__STREAM_EVENT__INIT;
    ev.job = j->id;
    ev.offset = j->streamed;
    ev.n_tokens = j->n_gen > j->streamed ? j->n_gen - j->streamed : 0;
    ev.tokens = j->gen + j->streamed;
    ev.done = over;
    ev.state = j->state;
    ev.finish_reason = j->finish_reason;
    ev.error = j->error ? j->error : "";
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.version = REKV_CONTROL_PROTO_VERSION;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_EVENT;
    r.event = &ev;
    for (int i = 0; i < j->n_subs;) {
        r.id = j->subs[i].id;
        uint8_t *buf;
        size_t len;
        int rc = pack_response(&r, &buf, &len);
        if (rc == 0) {
            rc = send_to(co->ctl, &j->subs[i].to, buf, len);
            free(buf);
        }
        if (rc) { /* gone or not reading: drop the subscription */
            j->subs[i] = j->subs[--j->n_subs];
            continue;
        }
        i++;
    }
    j->streamed = j->n_gen > j->streamed ? j->n_gen : j->streamed;
    if (over)
        j->n_subs = 0;
}

/* ---------------------------------------------------------------- job life */

static void journal_finished(rekv_coordinator *co, job *j);

/* Ends a job (DONE, CANCELLED or FAILED): journal, subscribers, the finished ring. */
static void job_end(rekv_coordinator *co, job *j, Rekv__Control__JobState st, const char *reason,
                    const char *error)
{
    if (j->state == REKV__CONTROL__JOB_STATE__RUNNING)
        co->n_running--;
    queue_remove(co, j);
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
    stream_flush(co, j);
    /* the prompt is no longer needed; only the result is kept */
    free(j->prompt);
    j->prompt = NULL;
    finished_push(co, j);
}

/* Puts a running job back in the queue after its worker died, or fails it after max_attempts. */
static void job_requeue(rekv_coordinator *co, job *j, const char *why)
{
    if (j->attempts >= co->cfg.max_attempts) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s; gave up after %u attempts", why, j->attempts);
        job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", msg);
        return;
    }
    co->n_running--;
    j->worker = -1;
    /* sampling is seeded, so the re-run produces the same tokens; subscribers got the first
     * `streamed` of them already and will only see the rest */
    j->n_gen = 0;
    co->requeued++;
    if (queue_push(co, j)) {
        j->state = REKV__CONTROL__JOB_STATE__FAILED; /* not running any more: counted as failed */
        job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", "out of memory re-queueing the job");
    }
}

/* ---------------------------------------------------------------- journal */

static void status_fill(const job *j, Rekv__Control__JobStatus *s)
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
    s->finish_reason = (char *)j->finish_reason;
    s->error = j->error ? j->error : "";
    s->prompt_tokens = j->n_prompt;
    s->attempts = j->attempts;
    s->priority = j->priority;
    uint64_t now = rekv_now_ns();
    s->queued_s = j->queued_s >= 0 ? j->queued_s : 0;
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
}

static int journal_accepted(rekv_coordinator *co, job *j, rekv_err *err)
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
    return rekv_journal_append(co->journal, &rec, err);
}

static void journal_finished(rekv_coordinator *co, job *j)
{
    if (co->journal == NULL)
        return;
    Rekv__Control__JobStatus s;
    status_fill(j, &s);
    Rekv__Control__JournalRecord rec = REKV__CONTROL__JOURNAL_RECORD__INIT;
    rec.job = j->id;
    rec.body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED;
    rec.finished = &s;
    rec.accepted_at = j->accepted_at;
    rekv_err err = {0};
    if (rekv_journal_append(co->journal, &rec, &err))
        event(co, REKV_CO_EVENT_ERROR, "%s", err.msg);
}

/* Replay: an accepted job queues again; a finished record ends it. */
static int replay_fn(void *ctx, const Rekv__Control__JournalRecord *rec)
{
    rekv_coordinator *co = ctx;
    job *j = job_find(co, rec->job);
    if (rec->body_case == REKV__CONTROL__JOURNAL_RECORD__BODY_ACCEPTED && rec->accepted) {
        if (j)
            return 0; /* duplicate record (a rewrite raced a crash): the first one wins */
        const Rekv__Control__Submit *s = rec->accepted;
        if ((j = job_new(co, rec->job)) == NULL)
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
        j->priority = s->priority;
        j->accepted_at = rec->accepted_at;
        co->accepted++;
        return queue_push(co, j);
    }
    if (rec->body_case == REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED && rec->finished) {
        const Rekv__Control__JobStatus *s = rec->finished;
        if (j && j->end_ns)
            return 0; /* already finished: a duplicate record */
        if (j == NULL && (j = job_new(co, rec->job)) == NULL)
            return -ENOMEM;
        queue_remove(co, j);
        j->top_logits = s->top_logits;
        if (s->n_top_ids != s->n_generated_ids * s->top_logits ||
            s->n_top_vals != s->n_top_ids)
            j->top_logits = 0; /* inconsistent record: keep the ids, drop the logits */
        if (gen_reserve(j, (uint32_t)s->n_generated_ids))
            return -ENOMEM;
        memcpy(j->gen, s->generated_ids, sizeof(int32_t) * s->n_generated_ids);
        if (j->top_logits) {
            memcpy(j->top_ids, s->top_ids, sizeof(int32_t) * s->n_top_ids);
            memcpy(j->top_vals, s->top_vals, sizeof(float) * s->n_top_vals);
        }
        j->n_gen = j->streamed = (uint32_t)s->n_generated_ids;
        j->n_prompt = s->prompt_tokens;
        j->attempts = s->attempts;
        j->priority = s->priority;
        j->queued_s = s->queued_s;
        j->accepted_at = rec->accepted_at;
        j->state = s->state;
        snprintf(j->finish_reason, sizeof(j->finish_reason), "%s",
                 s->finish_reason ? s->finish_reason : "");
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

/* Rewrites the journal with what a replay needs: unfinished jobs, then the remembered finished. */
static int journal_compact(rekv_coordinator *co, rekv_err *err)
{
    size_t n = co->n_queue + co->n_running + co->n_fin, k = 0;
    Rekv__Control__JournalRecord *recs = calloc(n ? n : 1, sizeof(*recs));
    Rekv__Control__JournalRecord **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
    Rekv__Control__Submit *subs = calloc(n ? n : 1, sizeof(*subs));
    Rekv__Control__Sampling *smps = calloc(n ? n : 1, sizeof(*smps));
    Rekv__Control__JobStatus *sts = calloc(n ? n : 1, sizeof(*sts));
    int rc = 0;
    if (!recs || !ptrs || !subs || !smps || !sts) {
        rc = rekv_errf(err, -ENOMEM, "out of memory compacting the journal");
        goto out;
    }
    /* unfinished jobs in id order would be nicer; hash order is fine: replay keys on ids */
    for (size_t b = 0; b < HASH_BUCKETS; b++)
        for (job *j = co->hash[b]; j; j = j->hnext) {
            if (k == n)
                break;
            rekv__control__journal_record__init(&recs[k]);
            recs[k].job = j->id;
            recs[k].accepted_at = j->accepted_at;
            if (j->state == REKV__CONTROL__JOB_STATE__QUEUED ||
                j->state == REKV__CONTROL__JOB_STATE__RUNNING) {
                submit_fill(j, &subs[k], &smps[k]);
                recs[k].body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_ACCEPTED;
                recs[k].accepted = &subs[k];
            } else {
                status_fill(j, &sts[k]);
                recs[k].body_case = REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED;
                recs[k].finished = &sts[k];
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

/* ---------------------------------------------------------------- workers */

static worker *worker_find(rekv_coordinator *co, const rid *id)
{
    for (int i = 0; i < MAX_WORKERS; i++) {
        worker *w = &co->workers[i];
        if (w->active && w->id.n == id->n && memcmp(w->id.b, id->b, id->n) == 0)
            return w;
    }
    return NULL;
}

static void worker_drop(rekv_coordinator *co, worker *w, const char *why)
{
    char msg[256];
    snprintf(msg, sizeof(msg), "worker %s %s", w->name, why);
    for (uint32_t i = 0; i < w->n_run; i++)
        job_requeue(co, w->run[i], msg);
    if (w->n_run)
        event(co, REKV_CO_EVENT_WARN, "%s: %u jobs in flight re-queued", msg, w->n_run);
    else
        event(co, REKV_CO_EVENT_INFO, "%s", msg);
    free(w->run);
    free(w->cancel);
    memset(w, 0, sizeof(*w));
}

/* A worker started with --mode auto asks for its mode: the planner decides (co_plan_assign) and
 * the worker, once its pipeline is built, says Hello again with it. */
static void worker_assign(rekv_coordinator *co, const rid *id, const Rekv__Worker__Hello *h)
{
    char why[512];
    rekv_mode m = co_plan_assign(h, why, sizeof(why));
    Rekv__Worker__Assign a = REKV__WORKER__ASSIGN__INIT;
    a.mode = (char *)rekv_mode_name(m);
    a.reason = why;
    Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_ASSIGN;
    cm.assign = &a;
    worker tmp = {0};
    tmp.id = *id;
    snprintf(tmp.name, sizeof(tmp.name), "%s", h->name ? h->name : "?");
    send_worker(co, &tmp, &cm);
    event(co, REKV_CO_EVENT_INFO, "worker %s: mode auto: %s", tmp.name, why);
}

static void worker_hello(rekv_coordinator *co, const rid *id, const Rekv__Worker__Hello *h)
{
    worker *w = worker_find(co, id);
    if (w) /* it reset itself: whatever it ran is gone */
        worker_drop(co, w, "said Hello again");
    if (h->mode && strcmp(h->mode, "auto") == 0) {
        worker_assign(co, id, h);
        return;
    }
    for (int i = 0; i < MAX_WORKERS && w == NULL; i++)
        if (!co->workers[i].active)
            w = &co->workers[i];
    if (w == NULL) {
        event(co, REKV_CO_EVENT_WARN, "worker %s refused: already %d workers", h->name,
              MAX_WORKERS);
        return;
    }
    uint32_t mb = h->max_batch ? h->max_batch : 1;
    w->run = calloc(mb, sizeof(job *));
    w->cancel = calloc(mb, sizeof(uint64_t));
    if (!w->run || !w->cancel) {
        free(w->run);
        free(w->cancel);
        memset(w, 0, sizeof(*w));
        return;
    }
    w->active = 1;
    w->id = *id;
    snprintf(w->name, sizeof(w->name), "%s", h->name ? h->name : "?");
    snprintf(w->backend, sizeof(w->backend), "%s", h->backend ? h->backend : "?");
    snprintf(w->mode, sizeof(w->mode), "%s", h->mode ? h->mode : "?");
    w->max_batch = mb;
    w->vocab = h->vocab;
    w->max_pos = h->max_pos;
    w->eos_id = h->eos_id;
    w->last_seen_ns = rekv_now_ns();
    co_plan_init(&w->plan, h);
    Rekv__Worker__Welcome wel = REKV__WORKER__WELCOME__INIT;
    wel.session = co->session;
    Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
    m.body_case = REKV__WORKER__COORD_MSG__BODY_WELCOME;
    m.welcome = &wel;
    send_worker(co, w, &m);
    event(co, REKV_CO_EVENT_INFO, "worker %s joined (pid %llu, %s backend, %s mode, batch %u, %s)",
          w->name, (unsigned long long)h->pid, w->backend, w->mode, w->max_batch,
          h->model ? h->model : "?");
}

/* Sends the next Plan to every idle worker that has work: joins from the queue, cancels. */
static void schedule(rekv_coordinator *co)
{
    for (int wi = 0; wi < MAX_WORKERS; wi++) {
        worker *w = &co->workers[wi];
        if (!w->active || w->busy)
            continue;
        uint32_t room = w->max_batch - w->n_run;
        if (w->n_run == 0 && w->n_cancel == 0 && (co->n_queue == 0 || room == 0))
            continue;
        Rekv__Worker__JobSpec *specs = calloc(room ? room : 1, sizeof(*specs));
        Rekv__Worker__JobSpec **sp = calloc(room ? room : 1, sizeof(*sp));
        if (!specs || !sp) {
            free(specs);
            free(sp);
            return;
        }
        uint32_t n_join = 0;
        while (n_join < room) {
            job *j = queue_pop(co);
            if (j == NULL)
                break;
            /* a prompt the worker's model cannot take fails here, with the reason */
            if (w->max_pos && j->n_prompt > w->max_pos) {
                char msg[256];
                snprintf(msg, sizeof(msg),
                         "the prompt of %u tokens is longer than the model's context of %u tokens",
                         j->n_prompt, w->max_pos);
                job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", msg);
                continue;
            }
            Rekv__Worker__JobSpec *s = &specs[n_join];
            rekv__worker__job_spec__init(s);
            s->job = j->id;
            s->n_prompt = j->n_prompt;
            s->prompt = j->prompt;
            s->temperature = j->temperature;
            s->top_k = j->top_k;
            s->top_p = j->top_p;
            s->seed = j->seed;
            s->max_new_tokens = j->max_new;
            s->stop_at_eos = j->stop_at_eos;
            s->top_logits = j->top_logits;
            sp[n_join++] = s;
            j->state = REKV__CONTROL__JOB_STATE__RUNNING;
            j->worker = wi;
            j->attempts++;
            j->n_gen = 0;
            j->start_ns = rekv_now_ns();
            if (j->queued_s < 0)
                j->queued_s = realtime_s() - j->accepted_at;
            co->n_running++;
            w->run[w->n_run++] = j;
        }
        if (w->n_run == 0 && w->n_cancel == 0) {
            free(specs);
            free(sp);
            continue;
        }
        Rekv__Worker__Plan plan = REKV__WORKER__PLAN__INIT;
        plan.step = ++w->step;
        plan.n_join = n_join;
        plan.join = sp;
        plan.n_cancel = w->n_cancel;
        plan.cancel = w->cancel;
        /* the planner prices the batch this step will run (jobs that just joined included) */
        Rekv__Worker__StepParams params;
        uint64_t *ids = calloc(w->max_batch, sizeof(uint64_t)), *mbj = calloc(w->max_batch, 8);
        int64_t *ctx = calloc(w->max_batch, sizeof(int64_t));
        uint32_t *mbi = calloc(w->max_batch, sizeof(uint32_t));
        if (ids && mbj && ctx && mbi) {
            for (uint32_t k = 0; k < w->n_run; k++) {
                ids[k] = w->run[k]->id;
                ctx[k] = (int64_t)w->run[k]->n_prompt + w->run[k]->n_gen;
            }
            if (co_plan_step(&w->plan, ids, ctx, (int)w->n_run, &params, mbj, mbi))
                plan.params = &params;
        }
        Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
        m.body_case = REKV__WORKER__COORD_MSG__BODY_PLAN;
        m.plan = &plan;
        send_worker(co, w, &m);
        w->n_cancel = 0;
        w->busy = 1;
        w->plan_sent_ns = rekv_now_ns();
        free(ids);
        free(mbj);
        free(ctx);
        free(mbi);
        free(specs);
        free(sp);
    }
}

static void worker_progress(rekv_coordinator *co, worker *w, const Rekv__Worker__Progress *p)
{
    if (!w->busy || p->step != w->step)
        return; /* stale: from before a reset */
    w->busy = 0;
    w->steps++;
    co->steps++;
    co->rtt_sum += (double)(rekv_now_ns() - w->plan_sent_ns) * 1e-9;
    co->wstep_sum += p->step_s;
    if (p->counters) {
        co->counters[0] += p->counters->h2d_weights;
        co->counters[1] += p->counters->h2d_kv;
        co->counters[2] += p->counters->h2d_act;
        co->counters[3] += p->counters->d2h;
        co->counters[4] += p->counters->tokens_recomputed;
        co->counters[5] += p->counters->tokens_fetched;
        co_plan_observe(&w->plan, p->counters->compute_busy_s, p->counters->h2d_busy_s);
    }
    for (size_t i = 0; i < p->n_jobs; i++) {
        const Rekv__Worker__JobProgress *jp = p->jobs[i];
        uint32_t k;
        for (k = 0; k < w->n_run && w->run[k]->id != jp->job; k++)
            ;
        if (k == w->n_run)
            continue; /* cancelled meanwhile */
        job *j = w->run[k];
        size_t tk = j->top_logits;
        int with_top = tk && jp->n_top_ids == jp->n_tokens * tk && jp->n_top_vals == jp->n_top_ids;
        for (size_t t = 0; t < jp->n_tokens && j->n_gen < j->max_new; t++) {
            if (gen_reserve(j, j->n_gen + 1))
                break;
            if (tk) { /* a worker that sent none leaves zeros rather than garbage */
                for (size_t q = 0; q < tk; q++) {
                    j->top_ids[(size_t)j->n_gen * tk + q] = with_top ? jp->top_ids[t * tk + q] : 0;
                    j->top_vals[(size_t)j->n_gen * tk + q] = with_top ? jp->top_vals[t * tk + q] : 0;
                }
            }
            j->gen[j->n_gen++] = jp->tokens[t];
            w->tokens++;
            co->tokens++;
        }
        int end = jp->finished || jp->error;
        if (end) {
            w->run[k] = w->run[--w->n_run];
            if (jp->error)
                job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "",
                        jp->error_msg && *jp->error_msg ? jp->error_msg : "the worker failed");
            else
                job_end(co, j, REKV__CONTROL__JOB_STATE__DONE, jp->finish_reason, NULL);
        } else {
            stream_flush(co, j);
        }
    }
}

static void handle_worker_msg(rekv_coordinator *co)
{
    zmq_msg_t f[3];
    int nf = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, co->wrk, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (nf < 3)
            f[nf++] = m;
        else
            zmq_msg_close(&m);
    }
    if (nf != 2 || zmq_msg_size(&f[0]) > MAX_RID)
        goto out;
    rid id;
    id.n = zmq_msg_size(&f[0]);
    memcpy(id.b, zmq_msg_data(&f[0]), id.n);
    Rekv__Worker__WorkerMsg *m =
        rekv__worker__worker_msg__unpack(NULL, zmq_msg_size(&f[1]), zmq_msg_data(&f[1]));
    if (m == NULL || m->version != REKV_WORKER_PROTO_VERSION) {
        event(co, REKV_CO_EVENT_WARN, "worker socket: a malformed message or another protocol "
                                      "version; ignored");
        if (m)
            rekv__worker__worker_msg__free_unpacked(m, NULL);
        goto out;
    }
    worker *w = worker_find(co, &id);
    if (w)
        w->last_seen_ns = rekv_now_ns();
    if (m->body_case == REKV__WORKER__WORKER_MSG__BODY_HELLO && m->hello) {
        worker_hello(co, &id, m->hello);
    } else if (w == NULL) {
        /* we restarted (or dropped it as dead): it must start over */
        Rekv__Worker__Reset rs = REKV__WORKER__RESET__INIT;
        Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
        cm.body_case = REKV__WORKER__COORD_MSG__BODY_RESET;
        cm.reset = &rs;
        worker tmp = {0};
        tmp.id = id;
        snprintf(tmp.name, sizeof(tmp.name), "(unknown)");
        send_worker(co, &tmp, &cm);
    } else if (m->body_case == REKV__WORKER__WORKER_MSG__BODY_PROGRESS && m->progress) {
        worker_progress(co, w, m->progress);
    }
    rekv__worker__worker_msg__free_unpacked(m, NULL);
out:
    for (int i = 0; i < nf; i++)
        zmq_msg_close(&f[i]);
}

/* ---------------------------------------------------------------- control requests */

static void do_submit(rekv_coordinator *co, const rid *from, uint64_t rq,
                      const Rekv__Control__Submit *s)
{
    int has_text = s->prompt_text && *s->prompt_text;
    if (has_text == (s->n_prompt_ids > 0)) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "give the prompt as text or as token ids, exactly one of the two");
        return;
    }
    float temp = s->sampling ? s->sampling->temperature : 0;
    float top_p = s->sampling && s->sampling->top_p > 0 ? s->sampling->top_p : 1;
    if (!(temp >= 0 && temp <= 100) || !(top_p > 0 && top_p <= 1)) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "temperature must be in [0, 100] and top_p in (0, 1]");
        return;
    }
    if (s->top_logits > 1024) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "top_logits must be at most 1024");
        return;
    }
    if (s->max_new_tokens > co->cfg.max_new_limit) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "max_new_tokens %u is above the limit of %u", s->max_new_tokens,
                    co->cfg.max_new_limit);
        return;
    }
    if (co->n_queue >= co->cfg.queue_limit) {
        co->rejected_busy++;
        reply_error(co, from, rq, REKV__CONTROL__CODE__BUSY,
                    "busy: %u jobs are waiting (the limit); nothing was accepted, retry later",
                    co->n_queue);
        return;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (has_text) {
        if (co->tok == NULL) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                        "the coordinator has no tokenizer (start it with --model); give token "
                        "ids");
            return;
        }
        rekv_err err = {0};
        int bos = co->have_model && co->mcfg.add_bos ? co->mcfg.bos_id : -1;
        if (rekv_tokenizer_encode(co->tok, s->prompt_text, strlen(s->prompt_text), bos, &ids, &n,
                                  &err)) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST, "%s", err.msg);
            return;
        }
    } else {
        n = s->n_prompt_ids;
        ids = malloc(sizeof(int32_t) * n);
        if (ids == NULL) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__INTERNAL, "out of memory");
            return;
        }
        memcpy(ids, s->prompt_ids, sizeof(int32_t) * n);
    }
    if (n == 0) {
        free(ids);
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST, "the prompt is empty");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (co->have_model && ids[i] >= co->mcfg.vocab)) {
            reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                        "prompt token id %d is outside the vocabulary%s", ids[i],
                        co->have_model ? "" : " (negative)");
            free(ids);
            return;
        }
    }
    if (co->have_model && n > (size_t)co->mcfg.max_pos) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__BAD_REQUEST,
                    "the prompt of %zu tokens is longer than the model's context of %d tokens", n,
                    co->mcfg.max_pos);
        free(ids);
        return;
    }
    job *j = job_new(co, co->next_id);
    if (j == NULL || queue_push(co, j)) {
        if (j)
            job_free(co, j);
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
    j->priority = s->priority;
    j->accepted_at = realtime_s();
    if (s->stream) {
        j->subs[0].to = *from;
        j->subs[0].id = rq;
        j->n_subs = 1;
    }
    rekv_err err = {0};
    if (journal_accepted(co, j, &err)) {
        event(co, REKV_CO_EVENT_ERROR, "%s", err.msg);
        queue_remove(co, j);
        job_free(co, j);
        reply_error(co, from, rq, REKV__CONTROL__CODE__INTERNAL, "journal: %s", err.msg);
        return;
    }
    co->accepted++;
    Rekv__Control__SubmitReply sr = REKV__CONTROL__SUBMIT_REPLY__INIT;
    sr.job = j->id;
    sr.prompt_tokens = (uint32_t)n;
    sr.queue_depth = co->n_queue;
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_SUBMITTED;
    r.submitted = &sr;
    reply_add(co, from, &r, j);
}

static void do_status(rekv_coordinator *co, const rid *from, uint64_t rq,
                      const Rekv__Control__StatusRequest *s)
{
    job *j = job_find(co, s->job);
    if (j == NULL) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__NOT_FOUND, "no job %llu",
                    (unsigned long long)s->job);
        return;
    }
    Rekv__Control__JobStatus st;
    status_fill(j, &st);
    char *text = NULL;
    size_t tl;
    if (s->with_text && co->tok && j->n_gen &&
        rekv_tokenizer_decode(co->tok, j->gen, j->n_gen, &text, &tl, NULL) == 0)
        st.text = text;
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_JOB;
    r.job = &st;
    reply_add(co, from, &r, NULL);
    free(text);
}

static void do_cancel(rekv_coordinator *co, const rid *from, uint64_t rq, uint64_t id)
{
    job *j = job_find(co, id);
    if (j == NULL) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__NOT_FOUND, "no job %llu",
                    (unsigned long long)id);
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
    }
    if (j->state == REKV__CONTROL__JOB_STATE__QUEUED || j->state == REKV__CONTROL__JOB_STATE__RUNNING)
        job_end(co, j, REKV__CONTROL__JOB_STATE__CANCELLED, "cancelled", NULL);
    Rekv__Control__JobStatus st;
    status_fill(j, &st);
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_JOB;
    r.job = &st;
    reply_add(co, from, &r, NULL);
}

static void do_stream(rekv_coordinator *co, const rid *from, uint64_t rq, uint64_t id)
{
    job *j = job_find(co, id);
    if (j == NULL) {
        reply_error(co, from, rq, REKV__CONTROL__CODE__NOT_FOUND, "no job %llu",
                    (unsigned long long)id);
        return;
    }
    /* the first event carries every token so far, sent at once; later ones come per step */
    Rekv__Control__StreamEvent ev = REKV__CONTROL__STREAM_EVENT__INIT;
    ev.job = j->id;
    ev.n_tokens = j->n_gen;
    ev.tokens = j->gen;
    ev.state = j->state;
    ev.done = j->state != REKV__CONTROL__JOB_STATE__QUEUED &&
              j->state != REKV__CONTROL__JOB_STATE__RUNNING;
    ev.finish_reason = j->finish_reason;
    ev.error = j->error ? j->error : "";
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_EVENT;
    r.event = &ev;
    reply_add(co, from, &r, NULL);
    if (!ev.done) {
        if (j->n_subs == MAX_SUBS)
            j->subs[0] = j->subs[--j->n_subs]; /* bounded: the oldest subscriber loses out */
        /* later events start where the job is now; a re-run after a worker death resends
         * nothing the subscriber has */
        if (j->streamed < j->n_gen)
            j->streamed = j->n_gen;
        j->subs[j->n_subs].to = *from;
        j->subs[j->n_subs].id = rq;
        j->n_subs++;
    }
}

static double tokens_per_s(rekv_coordinator *co)
{
    uint32_t oldest = (co->rate_i + 1) % RATE_SLOTS, newest = co->rate_i;
    if (co->rate_ns[oldest] == 0 || co->rate_ns[newest] <= co->rate_ns[oldest])
        return 0;
    return (double)(co->rate_tokens[newest] - co->rate_tokens[oldest]) /
           ((double)(co->rate_ns[newest] - co->rate_ns[oldest]) * 1e-9);
}

static void do_stats(rekv_coordinator *co, const rid *from, uint64_t rq)
{
    Rekv__Control__Stats s = REKV__CONTROL__STATS__INIT;
    s.queued = co->n_queue;
    s.running = co->n_running;
    s.done = co->n_done;
    s.cancelled = co->n_cancelled;
    s.failed = co->n_failed;
    s.accepted = co->accepted;
    s.rejected_busy = co->rejected_busy;
    s.bad_requests = co->bad_requests;
    s.requeued = co->requeued;
    s.tokens = co->tokens;
    s.tokens_per_s = tokens_per_s(co);
    s.steps = co->steps;
    s.step_rtt_avg_s = co->steps ? co->rtt_sum / (double)co->steps : 0;
    s.worker_step_avg_s = co->steps ? co->wstep_sum / (double)co->steps : 0;
    s.queue_limit = co->cfg.queue_limit;
    s.uptime_s = (double)(rekv_now_ns() - co->start_ns) * 1e-9;
    s.h2d_bytes_weights = co->counters[0];
    s.h2d_bytes_kv = co->counters[1];
    s.h2d_bytes_act = co->counters[2];
    s.d2h_bytes = co->counters[3];
    s.tokens_recomputed = co->counters[4];
    s.tokens_fetched = co->counters[5];
    Rekv__Control__WorkerInfo wi[MAX_WORKERS], *wp[MAX_WORKERS];
    size_t nw = 0;
    uint64_t now = rekv_now_ns();
    for (int i = 0; i < MAX_WORKERS; i++) {
        worker *w = &co->workers[i];
        if (!w->active)
            continue;
        rekv__control__worker_info__init(&wi[nw]);
        wi[nw].name = w->name;
        wi[nw].backend = w->backend;
        wi[nw].mode = w->mode;
        wi[nw].running = w->n_run;
        wi[nw].max_batch = w->max_batch;
        wi[nw].steps = w->steps;
        wi[nw].tokens = w->tokens;
        wi[nw].idle_s = (double)(now - w->last_seen_ns) * 1e-9;
        wi[nw].plan_split = w->plan.split;
        wi[nw].plan_kv_parts = (uint32_t)w->plan.kv_parts;
        wi[nw].plan_act_parts = (uint32_t)w->plan.act_parts;
        wi[nw].plan_gpu_batches = (uint32_t)w->plan.gpu_batches;
        wi[nw].plan_column = w->plan.column;
        wi[nw].plan_predicted_step_s = w->plan.pred_step_s;
        wi[nw].plan_pcie_scale = w->plan.pcie_scale;
        wi[nw].plan_compute_scale = w->plan.compute_scale;
        wi[nw].plan_steps = w->plan.steps;
        wi[nw].plan_multi_batch_steps = w->plan.multi_batch_steps;
        wp[nw] = &wi[nw];
        nw++;
    }
    s.n_workers = nw;
    s.workers = wp;
    Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
    r.id = rq;
    r.body_case = REKV__CONTROL__RESPONSE__BODY_STATS;
    r.stats = &s;
    reply_add(co, from, &r, NULL);
}

/* The Prometheus exposition of what Stats reports (a rekv_metrics_render_fn). Families are
 * named rekv_*; counters since the coordinator started end in _total. */
static int metrics_render(void *ctx, rekv_metrics_buf *b)
{
    rekv_coordinator *co = ctx;
    uint64_t now = rekv_now_ns();
    static const char *const states[] = {"queued", "running", "done", "cancelled", "failed"};
    const uint64_t by_state[] = {co->n_queue, co->n_running, co->n_done, co->n_cancelled,
                                 co->n_failed};
    rekv_metrics_family(b, "rekv_jobs", "gauge",
                        "Jobs by state (done, cancelled, failed: since start).");
    for (int i = 0; i < 5; i++)
        rekv_metrics_sample_kv(b, "rekv_jobs", (double)by_state[i], "state", states[i], NULL);

    /* one sample each, no labels */
    const struct {
        const char *name, *type, *help;
        double v;
    } one[] = {
        {"rekv_queue_depth", "gauge", "Jobs waiting to run.", (double)co->n_queue},
        {"rekv_queue_limit", "gauge", "Most jobs waiting; beyond it Submit gets BUSY.",
         (double)co->cfg.queue_limit},
        {"rekv_jobs_accepted_total", "counter", "Jobs accepted (replayed ones included).",
         (double)co->accepted},
        {"rekv_jobs_rejected_busy_total", "counter", "Submits answered BUSY.",
         (double)co->rejected_busy},
        {"rekv_bad_requests_total", "counter", "Requests answered BAD_REQUEST.",
         (double)co->bad_requests},
        {"rekv_jobs_requeued_total", "counter", "Jobs put back after their worker died.",
         (double)co->requeued},
        {"rekv_tokens_generated_total", "counter", "Generated tokens, all workers.",
         (double)co->tokens},
        {"rekv_tokens_per_second", "gauge", "Generated tokens per second over the last ~5 s.",
         tokens_per_s(co)},
        {"rekv_steps_total", "counter", "Plans executed, all workers.", (double)co->steps},
        {"rekv_step_rtt_seconds_total", "counter", "Plan sent to Progress received, summed.",
         co->rtt_sum},
        {"rekv_worker_step_seconds_total", "counter", "The workers' own time per step, summed.",
         co->wstep_sum},
        {"rekv_uptime_seconds", "gauge", "Seconds since the coordinator started.",
         (double)(now - co->start_ns) * 1e-9},
    };
    for (size_t i = 0; i < sizeof(one) / sizeof(*one); i++) {
        rekv_metrics_family(b, one[i].name, one[i].type, one[i].help);
        rekv_metrics_sample(b, one[i].name, NULL, one[i].v);
    }

    rekv_metrics_family(b, "rekv_bytes_total", "counter",
                        "Bytes the workers moved, by direction and kind.");
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"h2d\",kind=\"weights\"",
                        (double)co->counters[0]);
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"h2d\",kind=\"kv\"", (double)co->counters[1]);
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"h2d\",kind=\"act\"",
                        (double)co->counters[2]);
    rekv_metrics_sample(b, "rekv_bytes_total", "dir=\"d2h\",kind=\"all\"",
                        (double)co->counters[3]);
    rekv_metrics_family(b, "rekv_kv_tokens_total", "counter",
                        "Cached tokens whose K,V were recomputed or fetched.");
    rekv_metrics_sample(b, "rekv_kv_tokens_total", "how=\"recomputed\"", (double)co->counters[4]);
    rekv_metrics_sample(b, "rekv_kv_tokens_total", "how=\"fetched\"", (double)co->counters[5]);

    /* per worker; rekv_worker_info's mode label is the mode the worker runs (the planner's) */
    static const struct {
        const char *name, *type, *help;
    } wf[] = {
        {"rekv_worker_info", "gauge", "A connected worker (always 1), its backend and mode."},
        {"rekv_worker_running", "gauge", "Jobs in the worker's batch."},
        {"rekv_worker_max_batch", "gauge", "Largest batch the worker takes."},
        {"rekv_worker_steps_total", "counter", "Steps the worker ran."},
        {"rekv_worker_tokens_total", "counter", "Tokens the worker generated."},
        {"rekv_worker_idle_seconds", "gauge", "Seconds since the worker's last message."},
        {"rekv_worker_plan_split", "gauge", "The planner's KVPR split (tokens) for the last step."},
        {"rekv_worker_plan_gpu_batches", "gauge", "Mini-batches (GPU batches) of the last step."},
        {"rekv_worker_plan_kv_parts", "gauge", "KV part of the hybrid block pattern."},
        {"rekv_worker_plan_act_parts", "gauge", "ACT part of the hybrid block pattern."},
        {"rekv_worker_plan_predicted_step_seconds", "gauge", "Predicted time of the last step."},
        {"rekv_worker_plan_pcie_scale", "gauge", "Measured / predicted link time, smoothed."},
        {"rekv_worker_plan_compute_scale", "gauge", "Measured / predicted compute time, smoothed."},
    };
    for (size_t f = 0; f < sizeof(wf) / sizeof(*wf); f++) {
        rekv_metrics_family(b, wf[f].name, wf[f].type, wf[f].help);
        for (int i = 0; i < MAX_WORKERS; i++) {
            const worker *w = &co->workers[i];
            if (!w->active)
                continue;
            const double v[] = {1,
                                w->n_run,
                                w->max_batch,
                                (double)w->steps,
                                (double)w->tokens,
                                (double)(now - w->last_seen_ns) * 1e-9,
                                w->plan.split,
                                w->plan.gpu_batches,
                                w->plan.kv_parts,
                                w->plan.act_parts,
                                w->plan.pred_step_s,
                                w->plan.pcie_scale,
                                w->plan.compute_scale};
            if (f == 0)
                rekv_metrics_sample_kv(b, wf[f].name, v[f], "worker", w->name, "backend",
                                       w->backend, "mode", w->mode, NULL);
            else
                rekv_metrics_sample_kv(b, wf[f].name, v[f], "worker", w->name, NULL);
        }
    }
    return b->err;
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
    reply_add(co, from, &r, NULL);
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
    switch (req->body_case) {
    case REKV__CONTROL__REQUEST__BODY_SUBMIT: do_submit(co, &from, req->id, req->submit); break;
    case REKV__CONTROL__REQUEST__BODY_STATUS: do_status(co, &from, req->id, req->status); break;
    case REKV__CONTROL__REQUEST__BODY_CANCEL: do_cancel(co, &from, req->id, req->cancel->job); break;
    case REKV__CONTROL__REQUEST__BODY_STREAM: do_stream(co, &from, req->id, req->stream->job); break;
    case REKV__CONTROL__REQUEST__BODY_STATS: do_stats(co, &from, req->id); break;
    case REKV__CONTROL__REQUEST__BODY_HEALTH: do_health(co, &from, req->id); break;
    default:
        reply_error(co, &from, req->id, REKV__CONTROL__CODE__BAD_REQUEST, "the request is empty");
    }
out:
    if (req)
        rekv__control__request__free_unpacked(req, NULL);
    zmq_msg_close(&body);
    return 1;
}

/* Reads a round of requests, makes the accepted ones durable with one sync, then answers. */
static void handle_control(rekv_coordinator *co)
{
    co->n_replies = 0;
    size_t n = 0;
    while (n < READ_BATCH && read_control(co))
        n++;
    int synced_ok = 1;
    rekv_err err = {0};
    for (size_t i = 0; i < co->n_replies; i++)
        if (co->replies[i].accepted) {
            if (co->journal && rekv_journal_sync(co->journal, &err)) {
                event(co, REKV_CO_EVENT_ERROR, "%s", err.msg);
                synced_ok = 0;
            }
            break;
        }
    for (size_t i = 0; i < co->n_replies; i++) {
        reply *rp = &co->replies[i];
        if (rp->accepted && !synced_ok) {
            /* not durable, so not accepted: take it back and say so */
            job *j = rp->accepted;
            queue_remove(co, j);
            job_free(co, j);
            co->accepted--;
            free(rp->buf);
            Rekv__Control__Response r = REKV__CONTROL__RESPONSE__INIT;
            r.id = rp->req_id;
            r.version = REKV_CONTROL_PROTO_VERSION;
            r.code = REKV__CONTROL__CODE__INTERNAL;
            r.error = err.msg;
            if (pack_response(&r, &rp->buf, &rp->len))
                continue;
        }
        send_to(co->ctl, &rp->to, rp->buf, rp->len);
        free(rp->buf);
    }
    co->n_replies = 0;
}

/* ---------------------------------------------------------------- loop */

static void check_workers(rekv_coordinator *co)
{
    uint64_t now = rekv_now_ns(), limit = (uint64_t)co->cfg.worker_timeout_ms * 1000000ull;
    for (int i = 0; i < MAX_WORKERS; i++) {
        worker *w = &co->workers[i];
        if (w->active && now - w->last_seen_ns > limit) {
            char why[128];
            snprintf(why, sizeof(why), "is silent for %u ms: taken as dead",
                     co->cfg.worker_timeout_ms);
            worker_drop(co, w, why);
        }
    }
}

int rekv_coordinator_run(rekv_coordinator *co, rekv_err *err)
{
    uint64_t last_rate = 0;
    for (;;) {
        zmq_pollitem_t it[4 + REKV_METRICS_MAX_FDS] = {
            {co->ctl, 0, ZMQ_POLLIN, 0},
            {co->wrk, 0, ZMQ_POLLIN, 0},
            {NULL, co->stop_fd, ZMQ_POLLIN, 0},
            {NULL, co->cfg.signal_fd, ZMQ_POLLIN, 0},
        };
        int n_it = co->cfg.signal_fd >= 0 ? 4 : 3;
        /* the metrics server's fds go after the fixed items, which keep their indices */
        int m_fds[REKV_METRICS_MAX_FDS], m_n = 0, m_at = n_it;
        short m_ev[REKV_METRICS_MAX_FDS], m_rev[REKV_METRICS_MAX_FDS];
        if (co->metrics)
            m_n = rekv_metrics_server_fds(co->metrics, m_fds, m_ev, REKV_METRICS_MAX_FDS);
        for (int k = 0; k < m_n; k++)
            it[n_it++] = (zmq_pollitem_t){NULL, m_fds[k], m_ev[k], 0};
        int r = zmq_poll(it, n_it, 200);
        if (r < 0 && errno != EINTR)
            return rekv_errf(err, -errno, "zmq_poll: %s", zmq_strerror(errno));
        if (r > 0 && (it[2].revents & ZMQ_POLLIN))
            return 0;
        if (r > 0 && co->cfg.signal_fd >= 0 && (it[3].revents & ZMQ_POLLIN)) {
            /* a signalfd or an eventfd written by a signal handler */
            struct signalfd_siginfo si;
            if (read(co->cfg.signal_fd, &si, sizeof(si)) == (ssize_t)sizeof(si))
                event(co, REKV_CO_EVENT_INFO, "signal %u: stopping", si.ssi_signo);
            else
                event(co, REKV_CO_EVENT_INFO, "signal: stopping");
            return 0;
        }
        if (r > 0 && (it[1].revents & ZMQ_POLLIN))
            for (int k = 0; k < 256; k++) {
                int ev = 0;
                size_t sz = sizeof(ev);
                handle_worker_msg(co);
                if (zmq_getsockopt(co->wrk, ZMQ_EVENTS, &ev, &sz) || !(ev & ZMQ_POLLIN))
                    break;
            }
        if (r > 0 && (it[0].revents & ZMQ_POLLIN))
            handle_control(co);
        check_workers(co);
        schedule(co);
        if (co->metrics) { /* after schedule: a scrape sees this round's state */
            for (int k = 0; k < m_n; k++)
                m_rev[k] = r > 0 ? it[m_at + k].revents : 0;
            rekv_metrics_server_handle(co->metrics, m_fds, m_rev, m_n, metrics_render, co);
        }
        uint64_t now = rekv_now_ns();
        if (now - last_rate >= 1000000000ull) {
            last_rate = now;
            co->rate_i = (co->rate_i + 1) % RATE_SLOTS;
            co->rate_tokens[co->rate_i] = co->tokens;
            co->rate_ns[co->rate_i] = now;
        }
        if (co->journal && rekv_journal_records(co->journal) > COMPACT_RECORDS) {
            rekv_err e2 = {0};
            if (journal_compact(co, &e2))
                event(co, REKV_CO_EVENT_ERROR, "%s", e2.msg);
        }
        if (co->cfg.on_tick)
            co->cfg.on_tick(co->cfg.ctx);
    }
}

void rekv_coordinator_stop(rekv_coordinator *co)
{
    uint64_t one = 1;
    ssize_t w = write(co->stop_fd, &one, sizeof(one));
    (void)w;
}

/* ---------------------------------------------------------------- setup */

/* For ipc:// endpoints: the socket file path, its directory created (0700) when missing, a stale
 * socket file removed. Returns 0 or -errno. Other transports: path = "". */
static int ipc_prepare(const char *ep, char *path, size_t len, rekv_err *err)
{
    path[0] = '\0';
    if (strncmp(ep, "ipc://", 6) != 0)
        return 0;
    snprintf(path, len, "%s", ep + 6);
    char dir[4200];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if (mkdir(dir, 0700) < 0 && errno != EEXIST)
            return rekv_errf(err, -errno, "%s: mkdir: %s", dir, strerror(errno));
    }
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
        unlink(path);
    return 0;
}

/* tcp:// is allowed on loopback, or anywhere with a CurveZMQ key. */
static int tcp_check(const char *ep, const char *curve, rekv_err *err)
{
    if (strncmp(ep, "tcp://", 6) != 0)
        return 0;
    const char *h = ep + 6;
    int loop = strncmp(h, "127.", 4) == 0 || strncmp(h, "localhost:", 10) == 0 ||
               strncmp(h, "[::1]:", 6) == 0;
    if (!loop && curve == NULL)
        return rekv_errf(err, -EPERM,
                         "%s: a non-loopback tcp endpoint needs a CurveZMQ secret key", ep);
    return 0;
}

static int bind_router(rekv_coordinator *co, void **sock, const char *ep, const char *path,
                       int curve, rekv_err *err)
{
    *sock = zmq_socket(co->zctx, ZMQ_ROUTER);
    if (*sock == NULL)
        return rekv_errf(err, -errno, "zmq socket: %s", zmq_strerror(errno));
    int one = 1, linger = 0, hwm = 100000;
    /* bound memory per peer: 16 MiB frames at most (larger ones cut the connection) */
    int64_t maxmsg = 16ll << 20;
    zmq_setsockopt(*sock, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(*sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(*sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(*sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    if (curve && co->cfg.curve_secret) {
        if (zmq_setsockopt(*sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) ||
            zmq_setsockopt(*sock, ZMQ_CURVE_SECRETKEY, co->cfg.curve_secret, 40))
            return rekv_errf(err, -EINVAL, "CurveZMQ secret key rejected: %s",
                             zmq_strerror(errno));
    }
    /* the socket file is created by bind; a umask keeps it 0600 from the first instant */
    mode_t old = umask(0077);
    int rc = zmq_bind(*sock, ep);
    int e = errno;
    umask(old);
    if (rc != 0)
        return rekv_errf(err, -e, "%s: bind: %s", ep, zmq_strerror(e));
    if (*path && chmod(path, 0600) < 0)
        return rekv_errf(err, -errno, "%s: chmod: %s", path, strerror(errno));
    return 0;
}

int rekv_coordinator_create(const rekv_coordinator_config *cfg, rekv_coordinator **out,
                            rekv_err *err)
{
    rekv_coordinator *co = calloc(1, sizeof(*co));
    if (co == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    co->cfg = *cfg;
    if (co->cfg.queue_limit == 0)
        co->cfg.queue_limit = 256;
    if (co->cfg.keep_finished == 0)
        co->cfg.keep_finished = 1024;
    if (co->cfg.worker_timeout_ms == 0)
        co->cfg.worker_timeout_ms = 30000;
    if (co->cfg.max_attempts == 0)
        co->cfg.max_attempts = 3;
    if (co->cfg.max_new_limit == 0)
        co->cfg.max_new_limit = 1u << 20;
    co->stop_fd = -1;
    co->start_ns = rekv_now_ns();
    co->session = co->start_ns;
    co->next_id = 1;
    int rc;
    co->finished = calloc(co->cfg.keep_finished, sizeof(job *));
    co->replies = calloc(READ_BATCH + 1, sizeof(reply));
    co->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!co->finished || !co->replies || co->stop_fd < 0) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto fail;
    }
    if (cfg->control_endpoint)
        snprintf(co->control_ep, sizeof(co->control_ep), "%s", cfg->control_endpoint);
    else if ((rc = rekv_default_control_endpoint(co->control_ep, sizeof(co->control_ep), err)))
        goto fail;
    if (cfg->worker_endpoint) {
        snprintf(co->worker_ep, sizeof(co->worker_ep), "%s", cfg->worker_endpoint);
    } else if (strncmp(co->control_ep, "ipc://", 6) == 0) {
        snprintf(co->worker_ep, sizeof(co->worker_ep), "%s", co->control_ep);
        char *slash = strrchr(co->worker_ep, '/');
        snprintf(slash + 1, sizeof(co->worker_ep) - (size_t)(slash + 1 - co->worker_ep),
                 "workers");
    } else {
        rc = rekv_errf(err, -EINVAL, "give a worker endpoint with a non-ipc control endpoint");
        goto fail;
    }
    if ((rc = tcp_check(co->control_ep, cfg->curve_secret, err)) ||
        (rc = tcp_check(co->worker_ep, cfg->curve_secret, err)))
        goto fail;
    if (cfg->model_path) {
        rekv_model *m = NULL;
        if ((rc = rekv_model_open(cfg->model_path, &m, err)))
            goto fail;
        co->mcfg = m->config;
        co->have_model = 1;
        rekv_model_close(m);
        rc = rekv_tokenizer_load_for_model(cfg->model_path, &co->tok, err);
        if (rc && rc != -ENOENT)
            goto fail;
        if (rc == -ENOENT) {
            rekv_err_clear(err);
            event(co, REKV_CO_EVENT_INFO, "%s has no tokenizer: prompts must be token ids",
                  cfg->model_path);
        }
        const char *base = strrchr(cfg->model_path, '/');
        snprintf(co->model_name, sizeof(co->model_name), "%s",
                 base && base[1] ? base + 1 : cfg->model_path);
    }
    if (cfg->state_dir) {
        uint64_t dropped = 0;
        if ((rc = rekv_journal_open(cfg->state_dir, replay_fn, co, &co->journal, &dropped, err)))
            goto fail;
        if (dropped)
            event(co, REKV_CO_EVENT_WARN, "journal: cut off a torn tail of %llu bytes",
                  (unsigned long long)dropped);
        if (co->n_queue || co->n_fin)
            event(co, REKV_CO_EVENT_INFO,
                  "journal: %u unfinished jobs queued again, %u finished jobs remembered",
                  co->n_queue, co->n_fin);
        if ((rc = journal_compact(co, err)))
            goto fail;
    }
    co->zctx = zmq_ctx_new();
    if (co->zctx == NULL) {
        rc = rekv_errf(err, -errno, "zmq context: %s", zmq_strerror(errno));
        goto fail;
    }
    if ((rc = ipc_prepare(co->control_ep, co->control_path, sizeof(co->control_path), err)) ||
        (rc = ipc_prepare(co->worker_ep, co->worker_path, sizeof(co->worker_path), err)) ||
        (rc = bind_router(co, &co->ctl, co->control_ep, co->control_path, 1, err)) ||
        (rc = bind_router(co, &co->wrk, co->worker_ep, co->worker_path, 1, err)))
        goto fail;
    if (cfg->metrics_listen &&
        (rc = rekv_metrics_server_create(cfg->metrics_listen, &co->metrics, err)))
        goto fail;
    *out = co;
    return 0;
fail:
    rekv_coordinator_destroy(co);
    return rc;
}

const char *rekv_coordinator_control_endpoint(const rekv_coordinator *co) { return co->control_ep; }
const char *rekv_coordinator_worker_endpoint(const rekv_coordinator *co) { return co->worker_ep; }

void rekv_coordinator_destroy(rekv_coordinator *co)
{
    if (co == NULL)
        return;
    if (co->wrk) {
        /* workers drop their batches rather than finish jobs nobody will collect */
        for (int i = 0; i < MAX_WORKERS; i++) {
            worker *w = &co->workers[i];
            if (!w->active)
                continue;
            Rekv__Worker__Reset rs = REKV__WORKER__RESET__INIT;
            Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
            m.body_case = REKV__WORKER__COORD_MSG__BODY_RESET;
            m.reset = &rs;
            send_worker(co, w, &m);
        }
    }
    if (co->ctl)
        zmq_close(co->ctl);
    if (co->wrk)
        zmq_close(co->wrk);
    if (co->zctx)
        zmq_ctx_term(co->zctx);
    if (co->control_path[0] && co->ctl)
        unlink(co->control_path);
    if (co->worker_path[0] && co->wrk)
        unlink(co->worker_path);
    for (int i = 0; i < MAX_WORKERS; i++) {
        free(co->workers[i].run);
        free(co->workers[i].cancel);
    }
    for (size_t b = 0; b < HASH_BUCKETS; b++)
        while (co->hash[b])
            job_free(co, co->hash[b]);
    rekv_metrics_server_free(co->metrics);
    rekv_journal_close(co->journal);
    rekv_tokenizer_free(co->tok);
    if (co->stop_fd >= 0)
        close(co->stop_fd);
    free(co->queue);
    free(co->finished);
    free(co->replies);
    free(co);
}
