/* batcher.c — the job state machine of continuous batching (see batcher.h). The stop rules are
 * those of rekv_generate (generate.c), replicated here per job so that a job's tokens do not
 * depend on which other jobs shared its steps. */
#include "gpuworker/batcher.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct bjob {
    uint64_t id;     /* the caller's job id */
    rekv_pseq *seq;  /* its cache */
    int32_t *prompt; /* [n_prompt] copied at join; freed after the prefill */
    int n_prompt;
    int prefilled;    /* prompt tokens run so far (chunked prefill: over several steps) */
    int n_gen;        /* tokens sampled so far */
    int max_new;      /* max_new_tokens */
    int stop_at_eos;  /* stop after EOS */
    int top_logits;   /* report the k largest logits before each token; 0 none */
    int logprobs;     /* report each token's log-probability ... */
    int top_logprobs; /* ... and the k most likely tokens'; 0 none */
    int mini_batch;   /* the planner's GPU batch + 1; 0: none assigned */
    int32_t last;     /* the last sampled token: the next step's input */
    int32_t drawn;    /* the token the step drew (on the device) */
    rekv_sampler smp; /* per job, seeded as rekv_generate seeds it */
} bjob;

struct rekv_batcher {
    rekv_pipeline *p;           /* not owned */
    const rekv_model_config *c; /* the pipeline's model (not owned) */
    int max_batch;              /* capacity of jobs[] */
    int prefill_chunk;          /* most prompt tokens a job runs in one step; 0: all of them */
    int n;                      /* jobs running */
    bjob *jobs;                 /* [max_batch], the batch in order */
    rekv_pipe_item *items;      /* [max_batch] scratch for the step */
    rekv_batch_event *events;   /* [max_batch] the last step's outcomes */
    int32_t *ev_top_ids;        /* the events' top logits, [sum of their k] (capacity ev_top_cap) */
    float *ev_top_vals;
    float *ev_top_lp; /* their log-probabilities, when the job asked for logprobs */
    size_t ev_top_cap;
    float *ev_lp; /* [max_batch] the items' tokens' log-probabilities */
};

int rekv_batcher_create(rekv_pipeline *p, const rekv_model_config *c, int max_batch,
                        rekv_batcher **out, rekv_err *err)
{
    if (max_batch < 1)
        return rekv_errf(err, -EINVAL, "batcher: max_batch must be at least 1");
    rekv_batcher *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    b->p = p;
    b->c = c;
    b->max_batch = max_batch;
    b->jobs = calloc((size_t)max_batch, sizeof(*b->jobs));
    b->items = calloc((size_t)max_batch, sizeof(*b->items));
    b->events = calloc((size_t)max_batch, sizeof(*b->events));
    b->ev_lp = calloc((size_t)max_batch, sizeof(*b->ev_lp));
    if (!b->jobs || !b->items || !b->events || !b->ev_lp) {
        rekv_batcher_free(b);
        return rekv_errf(err, -ENOMEM, "out of memory");
    }
    *out = b;
    return 0;
}

static void job_free(bjob *j)
{
    rekv_pseq_free(j->seq);
    free(j->prompt);
    memset(j, 0, sizeof(*j));
}

void rekv_batcher_clear(rekv_batcher *b)
{
    for (int i = 0; i < b->n; i++)
        job_free(&b->jobs[i]);
    b->n = 0;
}

void rekv_batcher_free(rekv_batcher *b)
{
    if (b == NULL)
        return;
    if (b->jobs)
        rekv_batcher_clear(b);
    free(b->jobs);
    free(b->items);
    free(b->events);
    free(b->ev_top_ids);
    free(b->ev_top_vals);
    free(b->ev_top_lp);
    free(b->ev_lp);
    free(b);
}

int rekv_batcher_running(const rekv_batcher *b)
{
    return b->n;
}

void rekv_batcher_set_prefill_chunk(rekv_batcher *b, int tokens)
{
    b->prefill_chunk = tokens > 0 ? tokens : 0;
}

int rekv_batcher_job_ids(const rekv_batcher *b, uint64_t *ids, int cap)
{
    for (int i = 0; i < b->n && i < cap; i++)
        ids[i] = b->jobs[i].id;
    return b->n;
}

uint64_t rekv_batcher_store_seq(const rekv_batcher *b, uint64_t job)
{
    for (int i = 0; i < b->n; i++)
        if (b->jobs[i].id == job && b->jobs[i].seq)
            return rekv_pseq_store_seq(b->jobs[i].seq);
    return 0;
}

int rekv_batcher_cached_tokens(const rekv_batcher *b, uint64_t job)
{
    for (int i = 0; i < b->n; i++)
        if (b->jobs[i].id == job && b->jobs[i].seq)
            return rekv_pseq_cached(b->jobs[i].seq);
    return 0;
}

int rekv_batcher_job_of_store_seq(const rekv_batcher *b, uint64_t store_seq, uint64_t *job)
{
    for (int i = 0; i < b->n; i++)
        if (b->jobs[i].seq && rekv_pseq_uses_store_seq(b->jobs[i].seq, store_seq)) {
            *job = b->jobs[i].id;
            return 0;
        }
    return -ENOENT;
}

void rekv_batcher_set_mini_batches(rekv_batcher *b, const uint64_t *jobs, const uint32_t *index,
                                   size_t n)
{
    for (int i = 0; i < b->n; i++) {
        b->jobs[i].mini_batch = 0;
        for (size_t k = 0; k < n; k++)
            if (jobs[k] == b->jobs[i].id)
                b->jobs[i].mini_batch = (int)index[k] + 1;
    }
}

int rekv_batcher_join(rekv_batcher *b, uint64_t job, const int32_t *prompt, int n_prompt,
                      const rekv_gen_params *gp, rekv_err *err)
{
    int rc;
    const rekv_model_config *c = b->c;
    if (b->n >= b->max_batch)
        return rekv_errf(err, -ENOSPC, "the batch is full (%d jobs)", b->max_batch);
    for (int i = 0; i < b->n; i++)
        if (b->jobs[i].id == job)
            return rekv_errf(err, -EINVAL, "job %llu is already running", (unsigned long long)job);
    int prc = rekv_prompt_check(c, prompt, n_prompt, err);
    if (prc)
        return prc;
    if (gp->max_new_tokens < 0 || gp->temperature < 0 || gp->top_k < 0 || gp->top_p < 0 ||
        gp->top_p > 1)
        return rekv_errf(err, -EINVAL, "bad sampling parameters");
    if (gp->top_logits < 0 || gp->top_logits > c->vocab)
        return rekv_errf(err, -EINVAL, "top_logits %d is outside 0..%d (the vocabulary)",
                         gp->top_logits, c->vocab);
    if (gp->top_logprobs < 0 || gp->top_logprobs > c->vocab)
        return rekv_errf(err, -EINVAL, "top_logprobs %d is outside 0..%d (the vocabulary)",
                         gp->top_logprobs, c->vocab);
    bjob *j = &b->jobs[b->n];
    memset(j, 0, sizeof(*j));
    j->id = job;
    j->n_prompt = n_prompt;
    j->max_new = gp->max_new_tokens;
    j->stop_at_eos = gp->stop_at_eos;
    j->top_logits = gp->top_logits;
    j->logprobs = gp->logprobs != 0;
    j->top_logprobs = j->logprobs ? gp->top_logprobs : 0;
    j->last = -1;
    rekv_sampler_init(&j->smp, gp->temperature, gp->top_k, gp->top_p, gp->seed);
    j->prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    if (j->prompt == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    memcpy(j->prompt, prompt, sizeof(int32_t) * (size_t)n_prompt);
    /* as rekv_generate: the last generated token is never fed back, so it needs no cache slot */
    int64_t want = (int64_t)n_prompt + (j->max_new > 0 ? j->max_new - 1 : 0);
    int cap = want < c->max_pos ? (int)want : c->max_pos;
    if (j->max_new > 0 &&
        (rc = rekv_pseq_create_prefix(b->p, cap, prompt, n_prompt, &j->seq, err))) {
        free(j->prompt);
        memset(j, 0, sizeof(*j));
        return rc;
    }
    j->prefilled = j->seq ? rekv_pseq_len(j->seq) : 0; /* the prefix cache's tokens */
    b->n++;
    return 0;
}

int rekv_batcher_cancel(rekv_batcher *b, uint64_t job)
{
    for (int i = 0; i < b->n; i++) {
        if (b->jobs[i].id != job)
            continue;
        job_free(&b->jobs[i]);
        memmove(&b->jobs[i], &b->jobs[i + 1], sizeof(bjob) * (size_t)(b->n - i - 1));
        b->n--;
        return 0;
    }
    return -ENOENT;
}

/* The largest logits a job's draws report: its top_logits and its top_logprobs share one list
 * (the first k of the k' largest are the k largest). */
static int job_n_top(const bjob *j)
{
    return j->top_logits > j->top_logprobs ? j->top_logits : j->top_logprobs;
}

int rekv_batcher_step(rekv_batcher *b, const rekv_batch_event **events, int *n_events,
                      rekv_err *err)
{
    *events = b->events;
    *n_events = 0;
    if (b->n == 0)
        return 0;
    const rekv_model_config *c = b->c;
    int n_items = 0;
    /* room for every job's top logits of this step; the events point into it */
    size_t need = 0, top_at = 0;
    for (int i = 0; i < b->n; i++)
        need += (size_t)job_n_top(&b->jobs[i]);
    if (need > b->ev_top_cap) {
        int32_t *ti = realloc(b->ev_top_ids, sizeof(int32_t) * need);
        if (ti)
            b->ev_top_ids = ti;
        float *tv = ti ? realloc(b->ev_top_vals, sizeof(float) * need) : NULL;
        if (tv)
            b->ev_top_vals = tv;
        float *tl = tv ? realloc(b->ev_top_lp, sizeof(float) * need) : NULL;
        if (tl)
            b->ev_top_lp = tl;
        if (ti == NULL || tv == NULL || tl == NULL)
            return rekv_errf(err, -ENOMEM, "out of memory");
        b->ev_top_cap = need;
    }
    /* the items, in job order; jobs with max_new 0 never run (as rekv_generate). A step that
     * reaches a job's last prompt token draws its next token on the device: only the token and
     * the top logits it reports cross back */
    for (int i = 0; i < b->n; i++) {
        bjob *j = &b->jobs[i];
        if (j->max_new == 0)
            continue;
        int left = j->n_prompt - j->prefilled;
        if (left > 0 && b->prefill_chunk > 0 && left > b->prefill_chunk)
            left = b->prefill_chunk;
        rekv_pipe_item *it = &b->items[n_items++];
        *it = j->prefilled == j->n_prompt
                  ? (rekv_pipe_item){.seq = j->seq, .tokens = &j->last, .n_tokens = 1}
                  : (rekv_pipe_item){
                        .seq = j->seq, .tokens = j->prompt + j->prefilled, .n_tokens = left};
        if (j->prefilled + left == j->n_prompt || j->prefilled == j->n_prompt) {
            it->smp = &j->smp;
            it->token = &j->drawn;
            it->n_top = job_n_top(j);
            it->top_ids = b->ev_top_ids + top_at;
            it->top_vals = b->ev_top_vals + top_at;
            it->logprob = j->logprobs ? &b->ev_lp[i] : NULL;
            it->top_lp = b->ev_top_lp + top_at;
            top_at += (size_t)it->n_top;
        }
    }
    /* the planner's mini-batches apply only when every job in the step has one */
    int all = n_items > 0;
    for (int i = 0, a = 0; i < b->n; i++)
        if (b->jobs[i].max_new != 0) {
            all &= b->jobs[i].mini_batch > 0;
            b->items[a++].gpu_batch = b->jobs[i].mini_batch;
        }
    for (int a = 0; a < n_items && !all; a++)
        b->items[a].gpu_batch = 0;
    int rc;
    if (n_items > 0 && (rc = rekv_pipeline_step(b->p, b->items, n_items, err)))
        return rc;
    int kept = 0, ne = 0;
    top_at = 0;
    for (int i = 0; i < b->n; i++) {
        bjob *j = &b->jobs[i];
        rekv_batch_event *ev = &b->events[ne++];
        *ev = (rekv_batch_event){.job = j->id, .token = -1};
        if (j->max_new == 0) {
            ev->finished = 1;
            ev->finish_reason = "length";
        } else if (j->prefilled < j->n_prompt &&
                   (j->prefilled = rekv_pseq_len(j->seq)) < j->n_prompt) {
            /* a chunk of the prompt: nothing to sample yet */
        } else {
            if (j->prompt) {
                free(j->prompt);
                j->prompt = NULL;
            }
            if (j->top_logits) { /* before sampling, as rekv_generate records them */
                ev->top_ids = b->ev_top_ids + top_at;
                ev->top_vals = b->ev_top_vals + top_at;
                ev->n_top = j->top_logits;
            }
            if (j->logprobs) {
                ev->has_logprob = 1;
                ev->logprob = b->ev_lp[i];
                ev->top_lp_ids = b->ev_top_ids + top_at;
                ev->top_lp_vals = b->ev_top_lp + top_at;
                ev->n_top_lp = j->top_logprobs;
            }
            top_at += (size_t)job_n_top(j);
            int32_t tok = j->drawn;
            ev->token = tok;
            j->last = tok;
            j->n_gen++;
            if (j->stop_at_eos && rekv_config_is_eos(c, tok))
                ev->finish_reason = "eos";
            else if (j->n_gen == j->max_new)
                ev->finish_reason = "length";
            else if (rekv_pseq_len(j->seq) >= c->max_pos)
                ev->finish_reason = "context";
            ev->finished = ev->finish_reason != NULL;
        }
        if (ev->finished) {
            job_free(j);
        } else {
            if (kept != i)
                b->jobs[kept] = *j;
            kept++;
        }
    }
    b->n = kept;
    *n_events = ne;
    return 0;
}
