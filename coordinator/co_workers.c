/* co_workers.c — the worker protocol (proto/worker.proto) and continuous batching: a worker's Hello
 * (the first, which asks, answered by Assign: the worker's mode, device part and N_p; the next,
 * with the pipeline built, by Welcome), one Plan per step to every worker with work, up to
 * CO_PLANS_OUT of them out at once (jobs join from the queue at step boundaries, cancels go out,
 * co_plan.c picks the step's parameters), its Progress (tokens into the jobs, finished jobs out),
 * Reset for a worker we do not know, and the timeouts that take a
 * silent worker as dead, or one whose step does not come back as hung, and re-queue its jobs.
 * Failures: a Progress's jobs marked retry are re-queued, other errors fail the job; a job of the
 * step the Progress does not name is re-queued (the worker lost it); a worker that says it is
 * unavailable gets no Plan, and its running jobs go back to the queue; a Hello under the name of
 * an active worker takes over from it once it has stayed silent, and is refused while it is alive
 * (name_claim). */
#include "coordinator/co_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/clock.h"

/* ---------------------------------------------------------------- workers */

void co_send_worker(rekv_coordinator *co, worker *w, Rekv__Worker__CoordMsg *m)
{
    m->version = REKV_WORKER_PROTO_VERSION;
    size_t n = rekv__worker__coord_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL)
        return;
    rekv__worker__coord_msg__pack(m, buf);
    int rc = co_send_to(co->wrk, &w->id, buf, n);
    if (rc)
        co_event_rl(co, CO_RL_WORKER_SEND, REKV_CO_EVENT_WARN, "send to worker %s: %s", w->name,
                    zmq_strerror(-rc));
    free(buf);
}

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
        co_job_requeue(co, w->run[i], msg, CO_RUN_COUNTS);
    if (w->n_run)
        co_event(co, REKV_CO_EVENT_WARN, "%s: %u jobs in flight re-queued", msg, w->n_run);
    else
        co_event(co, REKV_CO_EVENT_INFO, "%s", msg);
    free(w->run);
    free(w->cancel);
    memset(w, 0, sizeof(*w));
}

/* Tells a worker whose Hello we refuse to stop (it could never be served), and says why. */
static void worker_refuse(rekv_coordinator *co, const rid *id, const Rekv__Worker__Hello *h,
                          const char *why)
{
    Rekv__Worker__Shutdown sd = REKV__WORKER__SHUTDOWN__INIT;
    sd.reason = (char *)why;
    Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_SHUTDOWN;
    cm.shutdown = &sd;
    worker tmp = {0};
    tmp.id = *id;
    snprintf(tmp.name, sizeof(tmp.name), "%s", h->name ? h->name : "?");
    co_send_worker(co, &tmp, &cm);
    co_event_rl(co, CO_RL_WORKER_REFUSED, REKV_CO_EVENT_WARN, "worker %s refused: %s", tmp.name,
                why);
}

/* A worker's first Hello asks what to build its pipeline with: the mode (the one it names, or for
 * "auto" the planner's pick), the device part and CLO's N_p (co_plan_assign); the worker, once its
 * pipeline is built, says Hello again with it. */
static void worker_assign(rekv_coordinator *co, const rid *id, const Rekv__Worker__Hello *h)
{
    co_assign as;
    if (co_plan_assign(h, &as)) {
        worker_refuse(co, id, h, as.reason);
        return;
    }
    Rekv__Worker__Assign a = REKV__WORKER__ASSIGN__INIT;
    a.mode = (char *)rekv_mode_name(as.mode);
    a.split = (uint32_t)as.split;
    a.reason = as.reason;
    a.device_tokens = (uint32_t)as.device_tokens;
    a.persist_np = as.persist_np;
    Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
    cm.body_case = REKV__WORKER__COORD_MSG__BODY_ASSIGN;
    cm.assign = &a;
    worker tmp = {0};
    tmp.id = *id;
    snprintf(tmp.name, sizeof(tmp.name), "%s", h->name ? h->name : "?");
    co_send_worker(co, &tmp, &cm);
    co_event(co, REKV_CO_EVENT_INFO, "worker %s: mode %s: %s (%s)", tmp.name,
             h->mode ? h->mode : "?", a.mode, as.reason);
}

static int rid_eq(const rid *a, const rid *b)
{
    return a->n == b->n && memcmp(a->b, b->b, a->n) == 0;
}

/* A Hello from another connection under the name of active worker o: a worker restarted under its
 * name (it dropped what its predecessor left in the kvstore) takes over from a dead o, and a
 * second live worker under a taken name is refused — the two would otherwise replace each other
 * at every Hello. Which one it is only o's silence tells, so the first such Hello is not answered:
 * the newcomer's heartbeats are answered Reset, and it says Hello again four of its heartbeats
 * later. Then o, if it spoke meanwhile, is alive: the newcomer is refused (Shutdown); if it was
 * silent all along, it is dead: dropped (its jobs re-queued), and the newcomer goes on. A Hello
 * from a third one while a claim is pending waits for that claim (or o's worker timeout).
 * 1: o is dropped, go on; 0: held, no answer; -1: refused. */
static int name_claim(rekv_coordinator *co, worker *o, const rid *id, const Rekv__Worker__Hello *h)
{
    char why[256];
    if (o->claim_ns && o->last_seen_ns > o->claim_ns) {
        snprintf(why, sizeof(why),
                 "another live worker (pid %llu) is serving under the name %s; give each worker "
                 "its own --name",
                 (unsigned long long)o->pid, o->name);
        o->claim_ns = 0;
        worker_refuse(co, id, h, why);
        return -1;
    }
    if (o->claim_ns && rid_eq(&o->claim_id, id)) {
        snprintf(why, sizeof(why),
                 "is replaced by a new worker of its name (pid %llu): silent since its Hello",
                 (unsigned long long)h->pid);
        worker_drop(co, o, why);
        return 1;
    }
    if (o->claim_ns == 0) {
        o->claim_id = *id;
        o->claim_ns = rekv_now_ns();
        co_event_rl(co, CO_RL_WORKER_NAME, REKV_CO_EVENT_INFO,
                    "worker %s (pid %llu) says Hello under the name of an active worker (pid "
                    "%llu): it takes over if that one stays silent until its next Hello",
                    o->name, (unsigned long long)h->pid, (unsigned long long)o->pid);
    }
    return 0;
}

static void worker_hello(rekv_coordinator *co, const rid *id, const Rekv__Worker__Hello *h,
                         const char *unavailable)
{
    worker *w = worker_find(co, id);
    if (w) /* it reset itself: whatever it ran is gone */
        worker_drop(co, w, "said Hello again");
    /* the vocabulary bounds every token id the worker returns: it must be the model's */
    char why[256];
    if (h->vocab == 0 || (co->have_model && h->vocab != (uint32_t)co->mcfg.vocab)) {
        snprintf(why, sizeof(why), "its vocabulary of %u tokens is not the model's (%d)", h->vocab,
                 co->have_model ? co->mcfg.vocab : -1);
        worker_refuse(co, id, h, why);
        return;
    }
    for (int i = 0; i < MAX_WORKERS && h->name && *h->name; i++) {
        worker *o = &co->workers[i];
        if (o->active && strcmp(o->name, h->name) == 0 && name_claim(co, o, id, h) <= 0)
            return; /* held (no answer yet) or refused */
    }
    if (h->ask || (h->mode && strcmp(h->mode, "auto") == 0)) {
        worker_assign(co, id, h);
        return;
    }
    for (int i = 0; i < MAX_WORKERS && w == NULL; i++)
        if (!co->workers[i].active)
            w = &co->workers[i];
    if (w == NULL) {
        snprintf(why, sizeof(why), "already %d workers", MAX_WORKERS);
        worker_refuse(co, id, h, why);
        return;
    }
    /* the batch is the worker's promise of room; the coordinator's tables for it are sized by it,
     * so a larger claim is capped (a worker with room for more runs fewer: always valid) */
    uint32_t mb = h->max_batch ? h->max_batch : 1;
    if (mb > REKV_WORKER_MAX_BATCH) {
        co_event_rl(co, CO_RL_WORKER_HELLO, REKV_CO_EVENT_WARN,
                    "worker %s says max_batch %u; it gets at most %u jobs at once", h->name, mb,
                    REKV_WORKER_MAX_BATCH);
        mb = REKV_WORKER_MAX_BATCH;
    }
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
    w->pid = h->pid;
    snprintf(w->unavailable, sizeof(w->unavailable), "%s", unavailable ? unavailable : "");
    co_plan_init(&w->plan, h);
    Rekv__Worker__Welcome wel = REKV__WORKER__WELCOME__INIT;
    wel.session = co->session;
    Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
    m.body_case = REKV__WORKER__COORD_MSG__BODY_WELCOME;
    m.welcome = &wel;
    co_send_worker(co, w, &m);
    co_event(co, REKV_CO_EVENT_INFO,
             "worker %s joined (pid %llu, %s backend, %s mode, batch %u, %s)", w->name,
             (unsigned long long)h->pid, w->backend, w->mode, w->max_batch,
             h->model ? h->model : "?");
}

/* Tokens a job's KV reaches on w: prompt and every new token, within the model's context. */
static uint64_t job_tokens(const worker *w, const job *j)
{
    uint64_t t = (uint64_t)j->n_prompt + j->max_new;
    return w->max_pos && t > w->max_pos ? w->max_pos : t;
}

/* Prompt tokens of job j (with the KV:ACT pattern kv:act) whose blocks running job r holds in
 * the prefix cache: the leading full blocks of j's first `limit` prompt tokens (what the worker's
 * sequence may take from the cache) equal to r's, as far as r holds them there: the prompt
 * tokens r's sequence took from the cache (the worker says so after r's first step), or its
 * whole prompt once r has made two tokens (a sequence publishes, before each step, the blocks
 * earlier steps filled; the step that made r's first token filled its prompt's). */
static uint32_t held_common(const job *j, uint32_t limit, int kv, int act, const job *r)
{
    if (r->kv_parts != kv || r->act_parts != act || r->prompt == NULL || j->prompt == NULL)
        return 0;
    uint32_t held = r->n_gen >= 2 ? r->n_prompt : r->cached_tokens, B = REKV_PLAN_BLOCK_TOKENS;
    if (held > limit)
        held = limit;
    uint32_t n = 0;
    while (n + B <= held && memcmp(j->prompt + n, r->prompt + n, B * sizeof(int32_t)) == 0)
        n += B;
    return n;
}

/* Prompt tokens of job j whose blocks a job before it in w's batch (w->run[0, k)) holds in the
 * prefix cache, at most `took` (what j's sequence took from the cache): those blocks are charged
 * to that job, so each shared block is charged once. Only jobs of the same worker share (one
 * model, one mode: the cache's keys), and only on a worker whose sequences take cached prefixes. */
static uint32_t shared_before(const worker *w, uint32_t k, const job *j, int kv, int act,
                              uint32_t took)
{
    /* the worker leaves the prompt's last token to compute, and a mode that speculates two
     * (gpuworker/pipeline_create.c seq_create_prefix) */
    uint32_t keep = rekv_mode_info_of((rekv_mode)w->plan.mode)->speculates ? 2 : 1;
    uint32_t best = 0, limit = j->n_prompt > keep ? j->n_prompt - keep : 0;
    for (uint32_t i = 0; w->plan.prefix_cache && i < k; i++) {
        uint32_t n = held_common(j, limit, kv, act, w->run[i]);
        best = n > best ? n : best;
    }
    return best < took ? best : took;
}

/* The kvstore bytes job j takes on w at its full length (pattern kv:act) less its first `shared`
 * tokens' blocks, which another job holds (and is charged for). */
static uint64_t job_price(const worker *w, const job *j, int kv, int act, uint32_t shared)
{
    uint64_t full = co_plan_job_store_bytes(&w->plan, job_tokens(w, j), kv, act);
    uint64_t less = shared ? co_plan_job_store_bytes(&w->plan, shared, kv, act) : 0;
    return full > less ? full - less : 0;
}

/* The kvstore bytes the running jobs of every worker on w's store (the same instance) will take
 * at their full length: what admission keeps for them, each at its own pattern (hybrid: the one
 * it was charged at and made with), a prompt block shared through the prefix cache once (the
 * worker's word on what each sequence took from it, once its first step came back). */
static uint64_t store_promised(rekv_coordinator *co, const worker *w)
{
    uint64_t sum = 0;
    for (int i = 0; i < MAX_WORKERS; i++) {
        const worker *v = &co->workers[i];
        if (!v->active || v->plan.store_instance != w->plan.store_instance)
            continue;
        for (uint32_t k = 0; k < v->n_run; k++) {
            const job *j = v->run[k];
            uint32_t shared = shared_before(v, k, j, j->kv_parts, j->act_parts, j->cached_tokens);
            sum += job_price(v, j, j->kv_parts, j->act_parts, shared);
        }
    }
    return sum;
}

/* Whether a job whose KV takes `need` bytes at its full length fits w's store beside `promised`
 * (the running jobs'): 0 yes; -1 never (alone, promised 0), 1 not now; why gets the reason. The
 * budget is co_plan_store_budget's: the arena and, for the exact modes (which run a step bigger
 * than the arena in layer windows), the spill tier's room, as long as one layer of the batch fits
 * the window the worker's pipeline pins — half the arena less two slots, beside the next window
 * read ahead (pipeline_kvstore.c plan_windows). The reason names the part that binds. */
static int store_fits(const worker *w, uint64_t tokens, uint64_t need, uint64_t promised, char *why,
                      size_t n)
{
    const co_plan_state *ps = &w->plan;
    uint64_t host = ps->store_host_bytes, all = promised + need;
    uint64_t spill =
        rekv_mode_info_of((rekv_mode)ps->mode)->layer_windows ? ps->store_spill_bytes : 0;
    uint64_t big =
        ps->store_kv_bytes > ps->store_act_bytes ? ps->store_kv_bytes : ps->store_act_bytes;
    uint64_t win = host > 2 * big ? (host - 2 * big) / 2 : 0;
    uint64_t L = ps->n_layers > 0 ? (uint64_t)ps->n_layers : 1;
    int ret = promised ? 1 : -1;
    const double M = 1048576.0;
    if (all <= co_plan_store_budget(ps))
        return 0;
    if (spill == 0) {
        if (promised)
            snprintf(why, n, "needs %.2f MiB, running jobs hold %.2f of %.2f MiB", need / M,
                     promised / M, host / M);
        else
            snprintf(why, n,
                     "its KV cache of %llu tokens takes %.2f MiB of kvstore host memory; the "
                     "store has %.2f MiB in all",
                     (unsigned long long)tokens, need / M, host / M);
    } else if (all > host + spill) {
        if (promised)
            snprintf(why, n,
                     "needs %.2f MiB, running jobs hold %.2f of %.2f MiB (arena %.2f, spill %.2f)",
                     need / M, promised / M, (host + spill) / M, host / M, spill / M);
        else
            snprintf(why, n,
                     "its KV cache of %llu tokens takes %.2f MiB of kvstore host memory and "
                     "spill; the store has %.2f MiB of arena and %.2f MiB of spill",
                     (unsigned long long)tokens, need / M, host / M, spill / M);
    } else if (promised) {
        snprintf(why, n,
                 "one layer of the batch would take %.2f MiB, more than a layer window of "
                 "the %.2f MiB arena (%.2f MiB)",
                 all / L / M, host / M, win / M);
    } else {
        snprintf(why, n,
                 "one layer of its KV cache takes %.2f MiB of kvstore host memory, more "
                 "than a layer window of the %.2f MiB arena (%.2f MiB: half of it less two "
                 "blocks, beside the next window read ahead)",
                 need / L / M, host / M, win / M);
    }
    return ret;
}

/* The KV:ACT pattern of the hybrid sequences w's next step makes (co_plan_join_pattern), from its
 * batch, the queue's first jobs that could join it and the store's room left; 1:1 when it cannot
 * say (out of memory), which the Plan then carries like any other. */
static void join_pattern(rekv_coordinator *co, worker *w, uint32_t room, uint64_t promised,
                         int *kv_parts, int *act_parts)
{
    *kv_parts = *act_parts = 1;
    if (rekv_mode_info_of((rekv_mode)w->plan.mode)->store != REKV_STORE_PATTERN)
        return;
    rekv_hybrid_seq *run = calloc(w->n_run + 1, sizeof(*run));
    rekv_hybrid_seq *wait = calloc(room + 1, sizeof(*wait));
    job **first = calloc(room + 1, sizeof(*first));
    if (run && wait && first) {
        for (uint32_t k = 0; k < w->n_run; k++) {
            const job *j = w->run[k];
            int t = j->kv_parts + j->act_parts;
            run[k].tokens = (int64_t)j->n_prompt + j->n_gen;
            run[k].kv_fraction = t > 0 ? (double)j->kv_parts / t : 0.5;
        }
        size_t n_wait = co_queue_first(co, first, room);
        for (size_t k = 0; k < n_wait; k++) {
            wait[k].tokens = first[k]->n_prompt;
            wait[k].full_tokens = (int64_t)job_tokens(w, first[k]);
        }
        uint64_t budget = co_plan_store_budget(&w->plan);
        co_plan_join_pattern(&w->plan, run, w->n_run, wait, n_wait,
                             budget > promised ? budget - promised : 0, kv_parts, act_parts);
    }
    free(run);
    free(wait);
    free(first);
}

/* Admission of job j, the queue's first, into w's batch (pattern kv:act): its KV at its full
 * length must fit the store beside what the running jobs will grow into (*promised, which an
 * admitted job adds to); else it waits (first in line: nothing passes it). Its prompt blocks a
 * running job holds in the prefix cache are that job's charge: the job's sequence takes them by
 * reference, so it is priced at the rest (optimistic: the worker's word on what it took reprices
 * it after its first step, and a store out of room fails the step, whose jobs run again —
 * worker_store.c wk_step_error_retry). A job larger than the whole store alone fails at its full
 * price: it must fit once the job it shares with has gone. 0 admitted, 1 it waits, -1 it failed. */
static int admit(rekv_coordinator *co, worker *w, job *j, int kv, int act, uint64_t *promised)
{
    uint64_t full = job_price(w, j, kv, act, 0);
    uint32_t shared = shared_before(w, w->n_run, j, kv, act, UINT32_MAX);
    uint64_t need = job_price(w, j, kv, act, shared);
    char why[256];
    int fit = store_fits(w, job_tokens(w, j), full, 0, why, sizeof(why));
    if (fit < 0) {
        co->too_large++;
        co_job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", why);
        return -1;
    }
    if (need > 0 &&
        (fit = store_fits(w, job_tokens(w, j), need, *promised, why, sizeof(why))) != 0) {
        if (strncmp(j->waiting, "waiting for kvstore room", 24) != 0) /* first held */
            co->held_for_room++;
        snprintf(j->waiting, sizeof(j->waiting), "waiting for kvstore room: %.*s",
                 (int)(sizeof(j->waiting) - 32), why);
        return 1;
    }
    if (shared)
        co->prefix_priced++;
    j->cached_tokens = 0; /* this start's, when the worker says */
    *promised += need;
    return 0;
}

/* Sends worker wi its next Plan when it has work: joins from the queue, cancels. 1 when sent. */
static int schedule_worker(rekv_coordinator *co, int wi)
{
    worker *w = &co->workers[wi];
    uint32_t room = w->max_batch - w->n_run;
    if (w->n_run == 0 && w->n_cancel == 0 && (co->n_queue == 0 || room == 0))
        return 0;
    Rekv__Worker__JobSpec *specs = calloc(room ? room : 1, sizeof(*specs));
    Rekv__Worker__JobSpec **sp = calloc(room ? room : 1, sizeof(*sp));
    if (!specs || !sp) {
        free(specs);
        free(sp);
        return 0;
    }
    uint32_t n_join = 0;
    uint64_t promised = store_promised(co, w);
    /* hybrid: the pattern this step's joining sequences are made with, and charged at */
    int kv_parts, act_parts;
    join_pattern(co, w, room, promised, &kv_parts, &act_parts);
    while (n_join < room) {
        job *j = co_queue_peek(co);
        if (j == NULL)
            break;
        /* a prompt the worker's model cannot take fails here, with the reason */
        if (w->max_pos && j->n_prompt > w->max_pos) {
            char msg[256];
            snprintf(msg, sizeof(msg),
                     "the prompt of %u tokens is longer than the model's context of %u tokens",
                     j->n_prompt, w->max_pos);
            co_job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", msg);
            continue;
        }
        int adm = admit(co, w, j, kv_parts, act_parts, &promised);
        if (adm < 0)
            continue;
        if (adm > 0)
            break;
        j->kv_parts = kv_parts;
        j->act_parts = act_parts;
        co_queue_remove(co, j);
        j->waiting[0] = '\0';
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
        s->logprobs = j->logprobs;
        s->top_logprobs = j->top_logprobs;
        sp[n_join++] = s;
        j->state = REKV__CONTROL__JOB_STATE__RUNNING;
        j->worker = wi;
        j->attempts++;
        j->n_gen = 0;
        j->start_ns = rekv_now_ns();
        j->join_step = w->step + 1;
        if (j->queued_s < 0) {
            j->queued_s = co_realtime_s() - j->accepted_at;
            rekv_metrics_hist_observe(&co->h_queue, j->queued_s > 0 ? j->queued_s : 0);
        }
        co->n_running++;
        w->run[w->n_run++] = j;
    }
    if (n_join > 0 && rekv_mode_info_of((rekv_mode)w->plan.mode)->store == REKV_STORE_PATTERN &&
        (kv_parts != w->made_kv_parts || act_parts != w->made_act_parts)) {
        co_event_rl(co, CO_RL_HYBRID_PATTERN, REKV_CO_EVENT_INFO,
                    "worker %s: %u joining jobs' sequences are made at KV:ACT %d:%d (%s)", w->name,
                    n_join, kv_parts, act_parts,
                    w->plan.join_binding ? "the store's room binds: the pattern whose batch "
                                           "is predicted the most tokens per second"
                                         : "the step model's fastest");
        w->made_kv_parts = kv_parts;
        w->made_act_parts = act_parts;
    }
    if (w->n_run == 0 && w->n_cancel == 0) {
        free(specs);
        free(sp);
        return 0;
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
    double *frac = calloc(w->max_batch, sizeof(double));
    if (ids && mbj && ctx && mbi && frac) {
        for (uint32_t k = 0; k < w->n_run; k++) {
            const job *r = w->run[k];
            int t = r->kv_parts + r->act_parts;
            ids[k] = r->id;
            ctx[k] = (int64_t)r->n_prompt + r->n_gen;
            frac[k] = t > 0 ? (double)r->kv_parts / t : 0.5;
        }
        if (co_plan_step(&w->plan, ids, ctx, frac, (int)w->n_run, kv_parts, act_parts, &params, mbj,
                         mbi))
            plan.params = &params;
    }
    w->pred[plan.step % CO_PLANS_OUT] =
        plan.params ? (co_plan_pred){w->plan.pred_pcie_s, w->plan.pred_compute_s}
                    : (co_plan_pred){0, 0};
    /* chunks keep decoding jobs streaming: none decoding, the cap; else priced at the longest
     * prompt in prefill (no token yet) */
    uint32_t prompt = 0, decoding = 0;
    for (uint32_t k = 0; k < w->n_run; k++) {
        decoding += w->run[k]->n_gen > 0;
        if (w->run[k]->n_gen == 0 && w->run[k]->n_prompt > prompt)
            prompt = w->run[k]->n_prompt;
    }
    plan.prefill_chunk = decoding ? co_plan_prefill_chunk(&w->plan, co->cfg.prefill_chunk, prompt)
                                  : co->cfg.prefill_chunk;
    Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
    m.body_case = REKV__WORKER__COORD_MSG__BODY_PLAN;
    m.plan = &plan;
    co_send_worker(co, w, &m);
    w->n_cancel = 0;
    w->out++;
    w->plan_sent_ns[w->step % CO_PLANS_OUT] = rekv_now_ns();
    free(ids);
    free(mbj);
    free(ctx);
    free(mbi);
    free(frac);
    free(specs);
    free(sp);
    return 1;
}

/* Sends every available worker Plans until it holds CO_PLANS_OUT or has no more work. */
void co_schedule(rekv_coordinator *co)
{
    for (int wi = 0; wi < MAX_WORKERS; wi++) {
        worker *w = &co->workers[wi];
        while (w->active && w->out < CO_PLANS_OUT && !w->unavailable[0] && schedule_worker(co, wi))
            ;
    }
}

/* 1 when every id is in [0, vocab); else 0 with the first one outside in *bad. */
static int ids_valid(const int32_t *ids, size_t n, uint32_t vocab, int32_t *bad)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= vocab) {
            *bad = ids[i];
            return 0;
        }
    return 1;
}

/* Takes job k off w's batch (the worker is told to drop it at the next Plan) and re-queues it
 * (how: as co_job_requeue). */
static void worker_requeue_at(rekv_coordinator *co, worker *w, uint32_t k, const char *why,
                              co_run_end counts)
{
    job *j = w->run[k];
    w->run[k] = w->run[--w->n_run];
    w->cancel[w->n_cancel++] = j->id; /* n_cancel + n_run <= max_batch */
    co_job_requeue(co, j, why, counts);
}

/* When w could start its step s: its Plan out and the step before it reported. */
static uint64_t step_could_start(const worker *w, uint64_t s)
{
    uint64_t sent = w->plan_sent_ns[s % CO_PLANS_OUT];
    return sent > w->progress_ns ? sent : w->progress_ns;
}

/* unavailable: the message's WorkerMsg.unavailable — set, the worker's kvstore is lost, and the
 * jobs its failed step hands back (retry) have not used an attempt */
static void worker_progress(rekv_coordinator *co, worker *w, const Rekv__Worker__Progress *p,
                            const char *unavailable)
{
    int store_lost = (unavailable && *unavailable) || p->step <= w->store_lost_upto;
    if (w->out == 0 || p->step != w->step - w->out + 1)
        return; /* stale: from before a reset */
    uint64_t mark = ++co->progress_mark;
    int failed_step = 0;
    w->out--;
    uint64_t now = rekv_now_ns();
    double rtt = (double)(now - step_could_start(w, p->step)) * 1e-9;
    w->progress_ns = now;
    if (p->n_jobs > 0) { /* a step that ran (one planned before its jobs ended may run none) */
        w->steps++;
        co->steps++;
        co->rtt_sum += rtt;
        co->wstep_sum += p->step_s;
        rekv_metrics_hist_observe(&co->h_step_rtt, rtt);
        rekv_metrics_hist_observe(&co->h_step, p->step_s);
    }
    if (p->counters) {
        co->counters[0] += p->counters->h2d_weights;
        co->counters[1] += p->counters->h2d_kv;
        co->counters[2] += p->counters->h2d_act;
        co->counters[3] += p->counters->d2h;
        co->counters[4] += p->counters->tokens_recomputed;
        co->counters[5] += p->counters->tokens_fetched;
        co->counters[6] += p->counters->tokens_considered;
        co->counters[7] += p->counters->tokens_selected;
        co_plan_observe(&w->plan, p->counters, &w->pred[p->step % CO_PLANS_OUT]);
    }
    for (size_t i = 0; i < p->n_jobs; i++) {
        const Rekv__Worker__JobProgress *jp = p->jobs[i];
        uint32_t k;
        for (k = 0; k < w->n_run && w->run[k]->id != jp->job; k++)
            ;
        if (k == w->n_run)
            continue; /* cancelled meanwhile */
        job *j = w->run[k];
        j->mark = mark;
        if (jp->cached_tokens) /* the step it joined: its prompt from the prefix cache */
            j->cached_tokens = jp->cached_tokens;
        if (jp->error && jp->retry) {
            /* its step failed for a reason that passes: the worker dropped it; run it again */
            char why[320];
            snprintf(why, sizeof(why), "worker %s: %s", w->name,
                     jp->error_msg && *jp->error_msg ? jp->error_msg : "the step failed");
            w->run[k] = w->run[--w->n_run];
            /* no room in the store (-ENOMEM, -ENOSPC: worker_store.c's retried codes) is not
             * the job's doing: admission let it run, and other jobs or a failing spill tier
             * hold the room for now */
            int room = jp->error == -ENOMEM || jp->error == -ENOSPC;
            co_job_requeue(co, j, why,
                           store_lost      ? CO_RUN_STORE_LOST
                           : jp->uncounted ? CO_RUN_FREE
                           : room          ? CO_RUN_ROOM
                                           : CO_RUN_COUNTS);
            failed_step = 1;
            continue;
        }
        /* every id must be in the vocabulary, or none of the step's output is taken: the job is
         * dropped on that worker and re-queued (failed after max_attempts), never given garbage */
        int32_t bad;
        if (!ids_valid(jp->tokens, jp->n_tokens, w->vocab, &bad) ||
            !co_job_extras_valid(j, jp, w->vocab, &bad)) {
            char why[256];
            snprintf(why, sizeof(why),
                     "worker %s returned token id %d, outside the vocabulary "
                     "of %u",
                     w->name, bad, w->vocab);
            co_event_rl(co, CO_RL_WORKER_REPLY, REKV_CO_EVENT_WARN, "job %llu: %s",
                        (unsigned long long)j->id, why);
            co->worker_rejected++;
            worker_requeue_at(co, w, k, why, CO_RUN_COUNTS);
            continue;
        }
        for (size_t t = 0; t < jp->n_tokens && j->n_gen < j->max_new; t++) {
            if (co_gen_reserve(j, j->n_gen + 1))
                break;
            co_job_put_extras(j, jp, t);
            if (j->n_gen >= j->timed) { /* a token clients have not had before: time it */
                if (j->timed == 0) {
                    double ttft = co_realtime_s() - j->accepted_at;
                    rekv_metrics_hist_observe(&co->h_ttft, ttft > 0 ? ttft : 0);
                    if (j->first_token_s < 0)
                        j->first_token_s = ttft > 0 ? ttft : 0;
                } else {
                    /* the first of a Progress's tokens takes the whole gap, the others 0 */
                    rekv_metrics_hist_observe(&co->h_itl, (double)(now - j->last_token_ns) * 1e-9);
                }
                j->timed = j->n_gen + 1;
                j->last_token_ns = now;
            }
            j->gen[j->n_gen++] = jp->tokens[t];
            w->tokens++;
            co->tokens++;
        }
        /* a stop string ends the job at the token that completed it; the worker drops it */
        int stopped = !jp->error && co_job_stop_check(co, j) == 1;
        int end = jp->finished || jp->error || stopped;
        if (end) {
            w->run[k] = w->run[--w->n_run];
            if (stopped && !jp->finished) {
                w->cancel[w->n_cancel++] = j->id; /* n_cancel + n_run <= max_batch */
                co_worker_drop(co, w, j->id);
            }
            char msg[256]; /* a worker's reason, bounded: it is kept and journaled */
            snprintf(msg, sizeof(msg), "%s",
                     jp->error_msg && *jp->error_msg ? jp->error_msg : "the worker failed");
            if (jp->error) {
                co_job_end(co, j, REKV__CONTROL__JOB_STATE__FAILED, "", msg);
                failed_step = 1;
            } else
                co_job_end(co, j, REKV__CONTROL__JOB_STATE__DONE,
                           stopped ? "stop" : jp->finish_reason, NULL);
        } else {
            co_stream_flush(co, j);
        }
    }
    /* every job of the step gets a word in its Progress (worker.proto); one without is lost on
     * the worker (a step that failed and did not say so): it runs again, never stays RUNNING.
     * Jobs joining in a later Plan are not of this step. A worker that lost its kvstore between
     * steps dropped its batch with the store and refuses the Plan that crossed its word
     * (wk_refuse_plan: it names only the Plan's joins) or, its store back by then, runs it
     * without them (store_lost_upto): that loss, like one under a step, uses no attempt. */
    for (uint32_t k = 0; k < w->n_run;) {
        if (w->run[k]->mark == mark || w->run[k]->join_step > p->step) {
            k++;
            continue;
        }
        char why[200];
        snprintf(why, sizeof(why), "worker %s did not report it in step %llu", w->name,
                 (unsigned long long)p->step);
        co_event_rl(co, CO_RL_WORKER_REPLY, REKV_CO_EVENT_WARN, "job %llu: %s",
                    (unsigned long long)w->run[k]->id, why);
        worker_requeue_at(co, w, k, why, store_lost ? CO_RUN_STORE_LOST : CO_RUN_COUNTS);
        failed_step = 1;
    }
    if (failed_step)
        co->steps_failed++;
}

/* What a known worker's message says of its availability (WorkerMsg.unavailable). One that
 * cannot run steps gets no Plan; the jobs in its batch go back to the queue unless a Plan is out
 * (its Progress reports them). */
static void worker_availability(rekv_coordinator *co, worker *w, const char *unavailable)
{
    const char *u = unavailable ? unavailable : "";
    if (strcmp(u, w->unavailable) == 0)
        return;
    if (*u)
        co_event(co, REKV_CO_EVENT_WARN, "worker %s is unavailable: %s", w->name, u);
    else
        co_event(co, REKV_CO_EVENT_INFO, "worker %s is available again", w->name);
    snprintf(w->unavailable, sizeof(w->unavailable), "%s", u);
    if (*u && w->out > 0) /* the Plans out will report the batch it dropped with its store */
        w->store_lost_upto = w->step;
    if (*u && w->out == 0) {
        char why[320];
        snprintf(why, sizeof(why), "worker %s is unavailable: %s", w->name, u);
        while (w->n_run > 0)
            worker_requeue_at(co, w, 0, why, CO_RUN_STORE_LOST);
    }
}

void co_handle_worker_msg(rekv_coordinator *co)
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
    if (nf == 0)
        return; /* nothing to read */
    if (rekv_conncap_over(co->wrk_cap, &f[nf - 1])) {
        /* no busy word in worker.proto: unanswered, the worker says Hello again later */
        co_event_rl(co, CO_RL_CONN_CAP, REKV_CO_EVENT_WARN,
                    "worker socket: a message on a connection over --max-clients; ignored");
        goto out;
    }
    if (nf != 2 || zmq_msg_size(&f[0]) > MAX_RID) {
        co->worker_malformed++;
        co_event_rl(co, CO_RL_WORKER_MALFORMED, REKV_CO_EVENT_WARN,
                    "worker socket: a malformed message or another protocol version; ignored");
        goto out;
    }
    rid id;
    id.n = zmq_msg_size(&f[0]);
    memcpy(id.b, zmq_msg_data(&f[0]), id.n);
    Rekv__Worker__WorkerMsg *m =
        rekv__worker__worker_msg__unpack(NULL, zmq_msg_size(&f[1]), zmq_msg_data(&f[1]));
    if (m == NULL || m->version != REKV_WORKER_PROTO_VERSION) {
        co->worker_malformed++;
        co_event_rl(co, CO_RL_WORKER_MALFORMED, REKV_CO_EVENT_WARN,
                    "worker socket: a malformed message or another protocol version; ignored");
        if (m)
            rekv__worker__worker_msg__free_unpacked(m, NULL);
        goto out;
    }
    worker *w = worker_find(co, &id);
    if (w)
        w->last_seen_ns = rekv_now_ns();
    if (m->body_case == REKV__WORKER__WORKER_MSG__BODY_HELLO && m->hello) {
        worker_hello(co, &id, m->hello, m->unavailable);
    } else if (w == NULL) {
        /* we restarted (or dropped it as dead): it must start over */
        Rekv__Worker__Reset rs = REKV__WORKER__RESET__INIT;
        Rekv__Worker__CoordMsg cm = REKV__WORKER__COORD_MSG__INIT;
        cm.body_case = REKV__WORKER__COORD_MSG__BODY_RESET;
        cm.reset = &rs;
        worker tmp = {0};
        tmp.id = id;
        snprintf(tmp.name, sizeof(tmp.name), "(unknown)");
        co_send_worker(co, &tmp, &cm);
    } else {
        if (m->body_case == REKV__WORKER__WORKER_MSG__BODY_PROGRESS && m->progress)
            worker_progress(co, w, m->progress, m->unavailable);
        worker_availability(co, w, m->unavailable);
    }
    if ((w = worker_find(co, &id)) != NULL) { /* its kvstore's room, for admission */
        co_plan_store(&w->plan, m->store);
        const Rekv__Worker__StoreRoom *r = m->store;
        uint64_t px[6] = {0};
        if (r) {
            px[0] = r->prefix_lookups, px[1] = r->prefix_hit_tokens;
            px[2] = r->prefix_hit_host_blocks, px[3] = r->prefix_hit_disk_blocks;
            px[4] = r->prefix_evictions, px[5] = r->prefix_hit_read_bytes;
        }
        memcpy(w->store_prefix, px, sizeof(px));
    }
    rekv__worker__worker_msg__free_unpacked(m, NULL);
out:
    for (int i = 0; i < nf; i++)
        zmq_msg_close(&f[i]);
}

void co_check_workers(rekv_coordinator *co)
{
    uint64_t now = rekv_now_ns(), limit = (uint64_t)co->cfg.worker_timeout_ms * 1000000ull;
    uint64_t step_limit = (uint64_t)co->cfg.step_timeout_ms * 1000000ull;
    for (int i = 0; i < MAX_WORKERS; i++) {
        worker *w = &co->workers[i];
        char why[128];
        if (w->active && now - w->last_seen_ns > limit) {
            snprintf(why, sizeof(why), "is silent for %u ms: taken as dead",
                     co->cfg.worker_timeout_ms);
            worker_drop(co, w, why);
        } else if (w->active && w->out > 0 &&
                   now - step_could_start(w, w->step - w->out + 1) > step_limit) {
            /* heartbeats or not, a step this late is hung: its jobs run again elsewhere (or
             * here, once the worker is back: its next message is answered Reset) */
            snprintf(why, sizeof(why), "has not finished step %llu in %u ms: taken as hung",
                     (unsigned long long)(w->step - w->out + 1), co->cfg.step_timeout_ms);
            co->steps_failed++;
            worker_drop(co, w, why);
        }
    }
}
