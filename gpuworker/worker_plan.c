/* worker_plan.c — running the coordinator's Plans: a Plan drops the cancelled jobs, adds the
 * joining ones, sets the planner's step parameters, and starts one batcher step on the step
 * thread; the loop's thread meanwhile heartbeats, keeps the kvstore lease and answers scrapes, and
 * when the thread's done fd says the step is over it reports every job in one Progress (a token,
 * a finish, or an error with whether the job runs again) with the step's counters and busy
 * times.
 *
 * Failures: a step that fails as a whole reports every job that was in it, each to be run again
 * (retry: the kvstore went away or had no room, the worker is stopping) or failed with the reason
 * (anything else); when the store names the sequence whose block failed to read back (a CRC
 * mismatch, an I/O error), that sequence's job runs again using an attempt, the others using
 * none. A step that lost the device (-ENODEV: a sticky CUDA error, which leaves the context
 * corrupt) reports its jobs to run again and stops the loop: the worker exits 1 with the error
 * logged, its supervisor (systemd, `rekv run`) starts it again, and the new process has a working
 * device. SIGTERM during a step aborts the step's kvstore requests (worker_main.c), so the worker
 * stops within a step's compute time whatever the store does. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"
#include "gpuworker/worker_internal.h"

/* Steps run on a thread of their own, so that the loop's thread keeps the coordinator informed
 * (a long prefill on the cpu backend can outlast the coordinator's worker timeout). One thread for
 * the worker's life: with a thread started per step, the worker's own step on opt-tiny-py took
 * 1.13 and 1.74 ms where it takes 0.92 and 1.28 ms now (two A/B rounds, 2-core machine). */

static void *step_thread(void *arg)
{
    wk_stepper *st = arg;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->pending && !st->quit)
            pthread_cond_wait(&st->go, &st->mu);
        if (st->quit)
            break;
        pthread_mutex_unlock(&st->mu);
        /* each step's own reason: rekv_errf keeps the first failure, so an error never cleared
         * would give every later failed step the first one's text */
        rekv_err_clear(&st->err);
        st->rc = rekv_batcher_step(st->batch, &st->ev, &st->n_ev, &st->err);
        pthread_mutex_lock(&st->mu);
        st->pending = 0;
        uint64_t one = 1;
        ssize_t wr = write(st->done_fd, &one, sizeof(one));
        (void)wr;
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

int wk_stepper_start(wk_stepper *st)
{
    memset(st, 0, sizeof(*st));
    st->done_fd = eventfd(0, EFD_CLOEXEC);
    if (st->done_fd < 0)
        return -errno;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->go, NULL);
    int rc = pthread_create(&st->t, NULL, step_thread, st);
    if (rc) {
        close(st->done_fd);
        st->done_fd = -1;
        return -rc;
    }
    st->started = 1;
    return 0;
}

void wk_stepper_stop(wk_stepper *st)
{
    if (!st->started)
        return;
    pthread_mutex_lock(&st->mu);
    st->quit = 1;
    pthread_cond_signal(&st->go);
    pthread_mutex_unlock(&st->mu);
    pthread_join(st->t, NULL);
    close(st->done_fd);
    st->started = 0;
}

/* The Plan crossed our word that we are unavailable; there are no running jobs (they were
 * reported with the failed step). */
void wk_refuse_plan(worker *w, const Rekv__Worker__Plan *plan)
{
    size_t nj = plan->n_join;
    Rekv__Worker__JobProgress *jp = calloc(nj ? nj : 1, sizeof(*jp));
    Rekv__Worker__JobProgress **pp = calloc(nj ? nj : 1, sizeof(*pp));
    if (jp == NULL || pp == NULL) {
        rekv_log(REKV_LOG_ERROR, "out of memory refusing a plan");
        goto out;
    }
    for (size_t i = 0; i < nj; i++) {
        rekv__worker__job_progress__init(&jp[i]);
        jp[i].job = plan->join[i]->job;
        jp[i].error = -EAGAIN;
        jp[i].error_msg = w->unavailable;
        jp[i].retry = 1;
        pp[i] = &jp[i];
    }
    Rekv__Worker__Progress pr = REKV__WORKER__PROGRESS__INIT;
    pr.step = plan->step;
    pr.n_jobs = nj;
    pr.jobs = pp;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &pr;
    wk_send_msg(w, &m);
out:
    free(jp);
    free(pp);
}

static void plan_free(wk_plan *p)
{
    if (p->msg)
        rekv__worker__coord_msg__free_unpacked(p->msg, NULL);
    free(p->jp);
    free(p->pp);
    free(p->toks);
    free(p->errs);
    free(p->cached);
    memset(p, 0, sizeof(*p));
}

/* The joining jobs; a join that fails is reported at once (a join makes the job's kvstore
 * sequence: the store's loss shows here too). */
static void plan_joins(worker *w, wk_plan *p)
{
    const Rekv__Worker__Plan *plan = p->plan;
    for (size_t i = 0; i < plan->n_join; i++) {
        const Rekv__Worker__JobSpec *s = plan->join[i];
        rekv_gen_params gp = {(int)s->max_new_tokens,
                              s->temperature,
                              (int)s->top_k,
                              s->top_p > 0 ? s->top_p : 1.0f,
                              s->seed,
                              (int)s->top_logits,
                              s->stop_at_eos,
                              s->logprobs,
                              (int)s->top_logprobs};
        rekv_log(REKV_LOG_DEBUG,
                 "step %llu: job %llu joins: %zu prompt tokens, temperature %g, "
                 "top-k %u, top-p %g, seed %llu, max %u, eos %d",
                 (unsigned long long)plan->step, (unsigned long long)s->job, s->n_prompt,
                 (double)s->temperature, s->top_k, (double)s->top_p, (unsigned long long)s->seed,
                 s->max_new_tokens, s->stop_at_eos);
        size_t n = p->n;
        int rc = rekv_batcher_join(w->batch, s->job, s->prompt, (int)s->n_prompt, &gp, &p->errs[n]);
        if (rc) {
            int join_lost = 0;
            rekv__worker__job_progress__init(&p->jp[n]);
            p->jp[n].job = s->job;
            p->jp[n].error = rc;
            p->jp[n].error_msg = p->errs[n].msg;
            p->jp[n].retry = wk_step_error_retry(w, rc, &join_lost);
            p->lost |= join_lost;
            p->pp[n] = &p->jp[n];
            p->n++;
        } else if (w->kv) {
            p->cached[i] = (uint32_t)rekv_batcher_cached_tokens(w->batch, s->job);
            rekv_log(REKV_LOG_DEBUG,
                     "step %llu: job %llu's cache is kvstore sequence %llu, %u prompt tokens "
                     "from the prefix cache",
                     (unsigned long long)plan->step, (unsigned long long)s->job,
                     (unsigned long long)rekv_batcher_store_seq(w->batch, s->job), p->cached[i]);
        }
    }
}

/* Drops the cancelled, sets the step's parameters, adds the joining and sets the mini-batches;
 * -ENOMEM when the reports have no room. */
static int plan_prepare(worker *w, wk_plan *p)
{
    const Rekv__Worker__Plan *plan = p->plan;
    for (size_t i = 0; i < plan->n_cancel; i++)
        rekv_batcher_cancel(w->batch, plan->cancel[i]);
    rekv_batcher_set_prefill_chunk(w->batch, (int)plan->prefill_chunk);
    size_t cap = plan->n_join + (size_t)rekv_batcher_running(w->batch);
    p->cap = cap;
    p->jp = calloc(cap ? cap : 1, sizeof(*p->jp));
    p->pp = calloc(cap ? cap : 1, sizeof(*p->pp));
    p->toks = calloc(cap ? cap : 1, sizeof(int32_t));
    p->errs = calloc(cap ? cap : 1, sizeof(rekv_err));
    p->cached = calloc(plan->n_join ? plan->n_join : 1, sizeof(uint32_t));
    if (!p->jp || !p->pp || !p->toks || !p->errs || !p->cached)
        return -ENOMEM;
    /* the planner's choices for this step (any of them gives the same tokens), before the joins:
     * their sequences are made with its KV:ACT pattern, the one the coordinator admitted them at
     * (and a sequence keeps it) */
    if (plan->params) {
        const Rekv__Worker__StepParams *sp = plan->params;
        rekv_step_params st = {sp->split, (int)sp->kv_parts, (int)sp->act_parts,
                               sp->gpu_batches ? (int)sp->gpu_batches : 1,
                               sp->column ? REKV_SCHED_COLUMN : REKV_SCHED_ROW};
        rekv_err perr = {0};
        static rekv_ratelimit rl = REKV_RATELIMIT_INIT;
        if (rekv_pipeline_set_step(w->pipe, &st, &perr))
            wk_warn_rl(&rl, "a Plan's step parameters refused: ", perr.msg);
    }
    plan_joins(w, p);
    /* the planner's mini-batches, once the joining jobs are in the batch */
    if (plan->params) {
        size_t nm = plan->params->n_mb_job < plan->params->n_mb_index ? plan->params->n_mb_job
                                                                      : plan->params->n_mb_index;
        rekv_batcher_set_mini_batches(w->batch, plan->params->mb_job, plan->params->mb_index, nm);
    }
    return 0;
}

/* The step failed as a whole: every job in it is reported, to run again or failed. */
static void report_failed_step(worker *w, wk_plan *p, const rekv_err *serr)
{
    int retry = wk_step_error_retry(w, serr->code, &p->lost);
    /* a block lost on read-back (CRC mismatch, I/O error) is one sequence's: its job runs again
     * from its prompt on a new sequence, using an attempt (it fails once they are spent: a disk
     * that keeps failing); the others' caches are intact and they run again using none */
    uint64_t lost_seq = w->kv ? rekv_kvstore_client_take_lost_seq(w->kv) : 0, owner = 0;
    int scoped =
        !retry && lost_seq != 0 && rekv_batcher_job_of_store_seq(w->batch, lost_seq, &owner) == 0;
    unsigned long long step = (unsigned long long)p->plan->step;
    if (scoped) {
        snprintf(p->other_msg, sizeof(p->other_msg),
                 "step %llu failed on job %llu's lost kvstore blocks; this job runs again", step,
                 (unsigned long long)owner);
        rekv_log(REKV_LOG_ERROR,
                 "step %llu failed (job %llu runs again from its prompt, using an attempt; the "
                 "others run again): %s",
                 step, (unsigned long long)owner, serr->msg);
    } else {
        rekv_log(retry ? REKV_LOG_WARN : REKV_LOG_ERROR, "step %llu failed (%s): %s", step,
                 retry ? "its jobs run again" : "its jobs fail", serr->msg);
    }
    int running = p->running;
    uint64_t *ids = calloc((size_t)running, sizeof(uint64_t));
    int n_ids = ids ? rekv_batcher_job_ids(w->batch, ids, running) : 0;
    for (int i = 0; i < n_ids && i < running && p->n < p->cap; i++) {
        int other = scoped && ids[i] != owner;
        Rekv__Worker__JobProgress *j = &p->jp[p->n];
        rekv__worker__job_progress__init(j);
        j->job = ids[i];
        j->error = other ? -EAGAIN : serr->code;
        j->error_msg = other ? p->other_msg : (char *)serr->msg;
        j->retry = scoped ? 1 : retry;
        j->uncounted = other;
        p->pp[p->n++] = j;
    }
    free(ids);
    rekv_batcher_clear(w->batch);
    /* no room in the store: what admission priced the jobs on changed (a spill tier that started
     * failing has none); this Progress carries the room as it is now, not up to a second old */
    if (w->kv && (serr->code == -ENOMEM || serr->code == -ENOSPC)) {
        w->room_ns = 0;
        wk_kv_room_due(w);
    }
}

/* A report per event of the step: its token (with the top logits it asked for), its finish. */
static void report_events(wk_plan *p, const rekv_batch_event *ev, int n_ev)
{
    for (int i = 0; i < n_ev && p->n < p->cap; i++) {
        Rekv__Worker__JobProgress *j = &p->jp[p->n];
        rekv__worker__job_progress__init(j);
        j->job = ev[i].job;
        for (size_t k = 0; k < p->plan->n_join; k++) /* a job that joined this step */
            if (p->plan->join[k]->job == ev[i].job)
                j->cached_tokens = p->cached[k];
        if (ev[i].token >= 0) {
            rekv_log(REKV_LOG_DEBUG, "step %llu: job %llu token %d%s%s",
                     (unsigned long long)p->plan->step, (unsigned long long)ev[i].job, ev[i].token,
                     ev[i].finished ? ", finished: " : "",
                     ev[i].finished ? ev[i].finish_reason : "");
            p->toks[p->n] = ev[i].token;
            j->n_tokens = 1;
            j->tokens = &p->toks[p->n];
            if (ev[i].n_top > 0) { /* valid until the next batcher step, after the send */
                j->n_top_ids = j->n_top_vals = (size_t)ev[i].n_top;
                j->top_ids = (int32_t *)ev[i].top_ids;
                j->top_vals = (float *)ev[i].top_vals;
            }
            if (ev[i].has_logprob) { /* the same: the batcher's, valid past the send */
                j->n_logprobs = 1;
                j->logprobs = (float *)&ev[i].logprob;
                j->n_top_logprob_ids = j->n_top_logprob_vals = (size_t)ev[i].n_top_lp;
                j->top_logprob_ids = (int32_t *)ev[i].top_lp_ids;
                j->top_logprob_vals = (float *)ev[i].top_lp_vals;
            }
        }
        j->finished = ev[i].finished;
        j->finish_reason = ev[i].finished ? (char *)ev[i].finish_reason : "";
        p->pp[p->n++] = j;
    }
}

/* The step's Progress: the reports, the jobs still running, its time, counters and busy times;
 * and the scrape port's step metrics. */
static void send_progress(worker *w, wk_plan *p, const rekv_batch_event *ev, int n_ev,
                          double step_s, int failed)
{
    rekv_layer_counters tot;
    const rekv_layer_counters *per = rekv_pipeline_counters(w->pipe, &tot);
    if (p->running > 0) {
        uint64_t n_tok = 0;
        for (int i = 0; i < n_ev; i++)
            n_tok += ev[i].token >= 0;
        rekv_worker_metrics_step(&w->wm, step_s, &tot, n_tok, failed,
                                 rekv_batcher_running(w->batch));
        w->wm.graph_steps = rekv_pipeline_graph_steps(w->pipe, NULL);
    }
    Rekv__Worker__Counters c = REKV__WORKER__COUNTERS__INIT;
    c.h2d_weights = tot.h2d_bytes[REKV_XFER_WEIGHTS];
    c.h2d_kv = tot.h2d_bytes[REKV_XFER_KV];
    c.h2d_act = tot.h2d_bytes[REKV_XFER_ACT];
    for (int k = 0; k < REKV_XFER_KINDS; k++)
        c.d2h += tot.d2h_bytes[k];
    c.tokens_recomputed = tot.tokens_recomputed;
    c.tokens_fetched = tot.tokens_fetched;
    /* infinigen's selected fraction: what the selecting layers selected of what they could have
     * fetched (layer 0 fetches whole: left out) */
    if (per)
        rekv_pipeline_selected_fraction(per, w->mc->n_layers, &c.tokens_considered,
                                        &c.tokens_selected);
    rekv_backend_stats bs1;
    w->be->iface->stats(w->be, &bs1);
    w->be->iface->timing(w->be, false);
    if (p->timed) {
        c.compute_busy_s = bs1.compute_busy_s - p->bs0.compute_busy_s;
        c.h2d_busy_s = bs1.h2d_busy_s - p->bs0.h2d_busy_s;
    }
    Rekv__Worker__Progress pr = REKV__WORKER__PROGRESS__INIT;
    pr.step = p->plan->step;
    pr.n_jobs = p->n;
    pr.jobs = p->pp;
    pr.running = (uint32_t)rekv_batcher_running(w->batch);
    pr.step_s = step_s;
    pr.counters = &c;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &pr;
    wk_send_msg(w, &m);
}

/* The step is over (serr->code: it failed as a whole): reports it and ends the Plan. */
static void plan_finish(worker *w, const rekv_batch_event *ev, int n_ev, const rekv_err *serr)
{
    wk_plan *p = &w->cur;
    if (serr->code) {
        report_failed_step(w, p, serr);
        n_ev = 0;
    }
    double step_s = (double)(rekv_now_ns() - p->t0) * 1e-9;
    if (p->lost && !w->stopping) /* said in this Progress: no Plan comes until we are back */
        snprintf(w->unavailable, sizeof(w->unavailable), "its kvstore at %s is gone; reconnecting",
                 w->kv_ep);
    report_events(p, ev, n_ev);
    send_progress(w, p, ev, n_ev, step_s, serr->code != 0);
    w->steps++;
    int lost = p->lost;
    plan_free(p);
    if (serr->code == -ENODEV && !w->device_lost) {
        /* every later step would fail the same way: only a new process gets the device back */
        rekv_log(REKV_LOG_ERROR, "device lost, exiting so that the worker is restarted: %s",
                 serr->msg);
        w->device_lost = 1;
        w->exit_code = 1;
        rekv_evloop_stop(w->loop);
        return;
    }
    if (lost && !w->stopping)
        wk_kv_lose(w);
}

int wk_plan_start(worker *w, Rekv__Worker__CoordMsg *msg)
{
    wk_plan *p = &w->cur;
    memset(p, 0, sizeof(*p));
    p->msg = msg;
    p->plan = msg->plan;
    if (plan_prepare(w, p)) {
        rekv_log(REKV_LOG_ERROR, "out of memory running a plan");
        plan_free(p);
        return 0;
    }
    rekv_pipeline_counters_reset(w->pipe);
    /* the planner corrects its prices by measured busy times; timing costs two events per op on
     * cuda, so one step in WORKER_TIMED_EVERY is timed and only its busy times are reported */
    p->timed = w->steps % WORKER_TIMED_EVERY == 0;
    w->be->iface->timing(w->be, p->timed);
    w->be->iface->stats(w->be, &p->bs0);
    p->t0 = rekv_now_ns();
    p->running = rekv_batcher_running(w->batch);
    if (w->kv)
        rekv_kvstore_client_take_lost_seq(w->kv); /* only this step's */
    wk_stepper *st = &w->stepper;
    rekv_err serr = {0};
    if (p->running == 0 || !st->started) { /* nothing to run, or no step thread: here */
        const rekv_batch_event *ev = NULL;
        int n_ev = 0;
        if (p->running > 0)
            rekv_batcher_step(w->batch, &ev, &n_ev, &serr);
        plan_finish(w, ev, n_ev, &serr);
        return w->device_lost;
    }
    pthread_mutex_lock(&st->mu);
    st->batch = w->batch;
    st->pending = 1;
    pthread_cond_signal(&st->go);
    pthread_mutex_unlock(&st->mu);
    rekv_evloop_set_events(w->loop, w->sock_id, 0); /* the coordinator's messages wait */
    return 1;
}

void wk_on_step_done(rekv_evloop *loop, void *ctx, short revents)
{
    worker *w = ctx;
    wk_stepper *st = &w->stepper;
    uint64_t one;
    ssize_t rd = read(st->done_fd, &one, sizeof(one));
    (void)rd;
    if (w->cur.msg == NULL)
        return;
    pthread_mutex_lock(&st->mu); /* the thread's writes before its signal are ours */
    const rekv_batch_event *ev = st->ev;
    int n_ev = st->n_ev, rc = st->rc;
    pthread_mutex_unlock(&st->mu);
    rekv_err serr = {0};
    if (rc)
        rekv_errf(&serr, rc, "%s", st->err.msg);
    plan_finish(w, ev, n_ev, &serr);
    if (w->device_lost)
        return; /* the loop stops: nothing more is read */
    rekv_evloop_set_events(loop, w->sock_id, ZMQ_POLLIN);
    if (w->ahead && !w->stopping) /* read past the last Plan: the socket may hold nothing */
        wk_on_coordinator(loop, w, ZMQ_POLLIN);
    if (w->stopping) {
        rekv_log(REKV_LOG_INFO, "signal: stopping");
        rekv_evloop_stop(loop);
    }
}
