/* cli_bench_serve.c — `rekv bench serve`: N jobs through a private trio per mode (`rekv run` in a
 * temporary directory: kvstore with --host-bytes from --arena, a worker in --mode M, the
 * coordinator), all at once or arriving at --rate jobs/s, each streamed on one control socket.
 * Times are taken here, on the client side, as the events arrive: TTFT from a job's Submit to its
 * first token, inter-token latency between a job's events (an event of k tokens counts k
 * intervals of 1/k of the gap). The admitted concurrency is the most jobs the coordinator's
 * Stats said RUNNING at once (the admission holds the rest QUEUED while the store is full),
 * polled; beside it the streams' own count, by order not time (a job runs from its first token
 * to its end), which also counts a job re-queued after a failed step (requeued > 0) as still
 * running, since a re-run streams only the tokens not sent yet. --long-prompt L submits one more job of an
 * L-token prompt once half the tokens are out, and compares the other jobs' ITL p99 before it
 * with theirs while it runs (prefill included). Prints one JSON object. The trio is started by
 * cli_bench_trio.c; --workload chat|system runs the prefix cache's workloads (cli_bench_prefix.c). */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "common/mode.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_bench.h"
#include "coordinator/cli/cli_daemon.h"
#include "coordinator/coordinator.h"
#include "gpuworker/device/backend.h"
#include "loader/loader.h"

#define SILENCE_MS 300000   /* no event at all this long: the run is stuck */
/* Stats.running is polled every 2 ms (one request in flight): a step takes longer, and a peak
 * of admitted jobs lasts as many steps as they decode, so the poll sees it */
#define STATS_EVERY_NS 2000000ull

enum { MAX_MODES = 8 };

typedef struct serve_opts {
    const char *model, *backend, *arena, *link_gbps, *prefill_chunk;
    const char *spill; /* the store's spill tier, bytes (0: none); NULL: the filesystem's */
    long n_jobs, prompt_len, max_new, long_prompt, max_batch;
    double rate;                  /* jobs/s; 0: all at once */
    uint64_t arena_bytes, spill_bytes;
    char modes[MAX_MODES][32];    /* a trio per mode, in this order */
    int n_modes;
} serve_opts;

typedef struct sjob {
    uint64_t req_id;          /* the Submit's request id: its reply and stream events carry it */
    uint64_t t_submit, t_last; /* ns: Submit sent; the last event with tokens */
    double ttft_s;            /* -1 until the first token */
    uint32_t n_tok;           /* tokens received */
    int done, failed, is_long;
} sjob;

typedef struct itl_sample {
    double s;  /* seconds per token */
    int phase; /* 0: before the long prompt's Submit, 1: while it runs, 2: after */
} itl_sample;

typedef struct serve_result {
    double wall_s, tokens_per_s, ttft_p50, ttft_p99, itl_p50, itl_p99;
    double itl_p99_before, itl_p99_during, long_ttft_s;
    uint64_t tokens, done, failed, streamed_concurrency, admitted;
    uint64_t held_for_room, too_large, requeued, steps;
    char first_error[256];
} serve_result;

/* ---------------------------------------------------------------- the private trio */

/* `rekv run` with the bench's options for one mode (cli_trio_start); 0 when it says READY, else
 * -1 with a message printed and whatever started stopped. */
static int trio_start(cli_trio *t, const serve_opts *o, const char *mode)
{
    char batch[32], queue[32];
    snprintf(batch, sizeof(batch), "%ld", o->max_batch);
    snprintf(queue, sizeof(queue), "%ld", o->n_jobs + 1);
    const char *argv[32];
    int n = 0;
#define ARG(s) (argv[n++] = (s))
    ARG("--model"); ARG(o->model);
    ARG("--mode"); ARG(mode); ARG("--backend"); ARG(o->backend);
    ARG("--host-bytes"); ARG(o->arena); ARG("--max-batch"); ARG(batch);
    if (o->spill) {
        ARG("--spill-bytes"); ARG(o->spill);
    }
    ARG("--queue"); ARG(queue);
    if (o->link_gbps) {
        ARG("--link-gbps"); ARG(o->link_gbps);
    }
    if (o->prefill_chunk) {
        ARG("--prefill-chunk"); ARG(o->prefill_chunk);
    }
    argv[n] = NULL;
#undef ARG
    if (cli_trio_start(t, "serve", argv)) {
        fprintf(stderr, "rekv bench serve: (mode %s)\n", mode);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- one mode's run */

static double itl_p99(const itl_sample *s, size_t n, int phase, double *tmp)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (phase < 0 || s[i].phase == phase)
            tmp[m++] = s[i].s;
    return cli_percentile(tmp, m, 99);
}

static int send_submit(rekv_ctl *c, sjob *j, const int32_t *ids, int n_ids, long max_new,
                       rekv_err *err)
{
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT; /* greedy */
    Rekv__Control__Submit sb = REKV__CONTROL__SUBMIT__INIT;
    sb.sampling = &smp;
    sb.prompt_ids = (int32_t *)ids;
    sb.n_prompt_ids = (size_t)n_ids;
    sb.max_new_tokens = (uint32_t)max_new;
    sb.stop_at_eos = 0; /* every job makes max_new tokens: the counts are known */
    sb.stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    j->t_submit = rekv_now_ns();
    return rekv_ctl_send(c, &rq, &j->req_id, err);
}

static int send_stats(rekv_ctl *c, uint64_t *id, rekv_err *err)
{
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    rq.id = 0;
    return rekv_ctl_send(c, &rq, id, err);
}

/* One mode's run as it goes: the jobs, the inter-token samples, and where the arrivals are. */
typedef struct serve_state {
    sjob *jobs;          /* [n_all]: the n_jobs, then the long prompt's */
    itl_sample *samples; /* [cap_s] */
    double *tmp;         /* [max(cap_s, n_all)]: percentiles' scratch */
    size_t n_samples, cap_s;
    int n_all, submitted, ended, running, phase, long_sent;
    uint64_t stats_id, last_stats, got_tokens, t0, last_event, half;
} serve_state;

/* Sends what is due at now: the arrivals, the long prompt once half the tokens are out, a Stats
 * poll; returns how long to wait for a reply (ms), or -1 with a message printed. */
static int serve_send_due(const serve_opts *o, rekv_ctl *c, serve_state *st,
                          int32_t *const *prompts, const int32_t *long_ids, uint64_t now)
{
    rekv_err err = {0};
    while (st->submitted < (int)o->n_jobs &&
           (o->rate <= 0 || now >= st->t0 + (uint64_t)((double)st->submitted / o->rate * 1e9))) {
        if (send_submit(c, &st->jobs[st->submitted], prompts[st->submitted], (int)o->prompt_len,
                        o->max_new, &err))
            goto fail;
        st->submitted++;
    }
    if (!st->long_sent && st->got_tokens >= st->half) {
        if (send_submit(c, &st->jobs[o->n_jobs], long_ids, (int)o->long_prompt, o->max_new, &err))
            goto fail;
        st->long_sent = 1;
        st->phase = 1;
    }
    if (st->stats_id == 0 && now - st->last_stats >= STATS_EVERY_NS) {
        if (send_stats(c, &st->stats_id, &err))
            goto fail;
        st->last_stats = now;
    }
    int wait_ms = 20;
    if (st->submitted < (int)o->n_jobs && o->rate > 0) {
        uint64_t due = st->t0 + (uint64_t)((double)st->submitted / o->rate * 1e9);
        wait_ms = due > now ? (int)((due - now) / 1000000ull) : 0;
        wait_ms = wait_ms > 20 ? 20 : wait_ms;
    }
    return wait_ms;
fail:
    fprintf(stderr, "rekv bench serve: %s\n", err.msg);
    return -1;
}

/* A stream event of job j at time t: its first token (TTFT), the inter-token samples, its end. */
static void serve_on_event(serve_state *st, sjob *j, const Rekv__Control__StreamEvent *ev,
                           uint64_t t, serve_result *res)
{
    uint64_t end = (uint64_t)ev->offset + ev->n_tokens;
    uint32_t k = end > j->n_tok ? (uint32_t)(end - j->n_tok) : 0;
    if (k > 0) {
        if (j->n_tok == 0) {
            j->ttft_s = (double)(t - j->t_submit) * 1e-9;
            if (!j->is_long && ++st->running > (int)res->streamed_concurrency)
                res->streamed_concurrency = (uint64_t)st->running;
        } else if (!j->is_long) {
            for (uint32_t q = 0; q < k && st->n_samples < st->cap_s; q++)
                st->samples[st->n_samples++] =
                    (itl_sample){(double)(t - j->t_last) * 1e-9 / k, st->phase};
        }
        j->n_tok = (uint32_t)end;
        j->t_last = t;
        st->got_tokens += k;
        res->tokens += k;
    }
    if (ev->done) {
        j->done = 1;
        st->ended++;
        if (!j->is_long && j->n_tok > 0)
            st->running--;
        if (ev->state != REKV__CONTROL__JOB_STATE__DONE) {
            j->failed = 1;
            if (!res->first_error[0])
                snprintf(res->first_error, sizeof(res->first_error), "%s: %s",
                         rekv_ctl_state_name(ev->state), ev->error ? ev->error : "");
        }
        if (j->is_long)
            st->phase = 2;
    }
}

/* One reply at time t: a Stats poll's (the admitted concurrency), or a job's. */
static void serve_on_reply(serve_state *st, const Rekv__Control__Response *r, uint64_t t,
                           serve_result *res)
{
    if (r->id == st->stats_id) {
        if (r->body_case == REKV__CONTROL__RESPONSE__BODY_STATS && r->stats->running > res->admitted)
            res->admitted = r->stats->running;
        st->stats_id = 0;
        return;
    }
    sjob *j = NULL;
    for (int i = 0; i < st->n_all && !j; i++)
        if (st->jobs[i].req_id == r->id && st->jobs[i].t_submit)
            j = &st->jobs[i];
    if (j == NULL || j->done)
        return;
    if (r->code != REKV__CONTROL__CODE__OK) { /* BUSY, BAD_REQUEST...: the job never ran */
        snprintf(res->first_error, sizeof(res->first_error), "%s: %s",
                 rekv_ctl_code_name(r->code), r->error ? r->error : "");
        j->done = j->failed = 1;
        st->ended++;
    } else if (r->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT) {
        serve_on_event(st, j, r->event, t, res);
    }
}

/* The run's figures from what the jobs saw: throughput, TTFT and ITL percentiles, failures. */
static void serve_summarise(const serve_opts *o, serve_state *st, serve_result *res)
{
    res->wall_s = (double)(rekv_now_ns() - st->t0) * 1e-9;
    res->tokens_per_s = res->wall_s > 0 ? (double)res->tokens / res->wall_s : 0;
    size_t m = 0;
    for (int i = 0; i < (int)o->n_jobs; i++) {
        res->done += !st->jobs[i].failed;
        res->failed += st->jobs[i].failed;
        if (st->jobs[i].ttft_s >= 0)
            st->tmp[m++] = st->jobs[i].ttft_s;
    }
    res->ttft_p50 = cli_percentile(st->tmp, m, 50);
    res->ttft_p99 = cli_percentile(st->tmp, m, 99);
    for (size_t i = 0; i < st->n_samples; i++)
        st->tmp[i] = st->samples[i].s;
    res->itl_p50 = cli_percentile(st->tmp, st->n_samples, 50);
    res->itl_p99 = itl_p99(st->samples, st->n_samples, -1, st->tmp);
    if (o->long_prompt > 0) {
        sjob *lj = &st->jobs[o->n_jobs];
        res->failed += lj->failed;
        res->long_ttft_s = lj->ttft_s;
        res->itl_p99_before = itl_p99(st->samples, st->n_samples, 0, st->tmp);
        res->itl_p99_during = itl_p99(st->samples, st->n_samples, 1, st->tmp);
    }
}

/* The coordinator's counters once every job is over; 0, or -1 with a message printed. */
static int serve_final_stats(rekv_ctl *c, serve_result *res)
{
    rekv_err err = {0};
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    Rekv__Control__Response *r = NULL;
    int rc = -1;
    if (rekv_ctl_call(c, &rq, 10000, &r, &err) || r->body_case != REKV__CONTROL__RESPONSE__BODY_STATS) {
        fprintf(stderr, "rekv bench serve: Stats: %s\n", r ? rekv_ctl_code_name(r->code) : err.msg);
    } else {
        res->held_for_room = r->stats->jobs_held_for_room;
        res->too_large = r->stats->jobs_too_large;
        res->requeued = r->stats->requeued;
        res->steps = r->stats->steps;
        rc = 0;
    }
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    return rc;
}

/* Runs the jobs against the coordinator at ep; 0, or -1 with a message printed. */
static int serve_run(const serve_opts *o, const char *ep, int32_t *const *prompts,
                     const int32_t *long_ids, serve_result *res)
{
    rekv_err err = {0};
    rekv_ctl *c = NULL;
    serve_state st = {.n_all = (int)o->n_jobs + (o->long_prompt > 0),
                      .long_sent = o->long_prompt <= 0,
                      .half = (uint64_t)o->n_jobs * (uint64_t)o->max_new / 2};
    int rc = -1;
    st.cap_s = (size_t)st.n_all * (size_t)o->max_new + 16;
    st.jobs = calloc((size_t)st.n_all, sizeof(*st.jobs));
    st.samples = malloc(sizeof(*st.samples) * st.cap_s);
    st.tmp = malloc(sizeof(double) * (st.cap_s > (size_t)st.n_all ? st.cap_s : (size_t)st.n_all));
    memset(res, 0, sizeof(*res));
    if (!st.jobs || !st.samples || !st.tmp) {
        fprintf(stderr, "rekv bench serve: out of memory\n");
        goto out;
    }
    if (rekv_ctl_connect(ep, NULL, &c, &err)) {
        fprintf(stderr, "rekv bench serve: %s\n", err.msg);
        goto out;
    }
    for (int i = 0; i < st.n_all; i++)
        st.jobs[i].ttft_s = -1, st.jobs[i].is_long = i == (int)o->n_jobs;
    st.t0 = st.last_event = rekv_now_ns();
    while (st.ended < st.n_all) {
        int wait_ms = serve_send_due(o, c, &st, prompts, long_ids, rekv_now_ns());
        if (wait_ms < 0)
            goto out;
        Rekv__Control__Response *r = NULL;
        int rr = rekv_ctl_recv(c, wait_ms, &r, &err);
        if (rr == -ETIMEDOUT) {
            if (rekv_now_ns() - st.last_event > (uint64_t)SILENCE_MS * 1000000ull) {
                fprintf(stderr, "rekv bench serve: nothing from the coordinator in %d s\n",
                        SILENCE_MS / 1000);
                goto out;
            }
            continue;
        }
        if (rr) {
            fprintf(stderr, "rekv bench serve: %s\n", err.msg);
            goto out;
        }
        st.last_event = rekv_now_ns();
        serve_on_reply(&st, r, st.last_event, res);
        rekv__control__response__free_unpacked(r, NULL);
    }
    serve_summarise(o, &st, res);
    rc = serve_final_stats(c, res);
out:
    rekv_ctl_close(c);
    free(st.jobs);
    free(st.samples);
    free(st.tmp);
    return rc;
}

/* ---------------------------------------------------------------- the command */

static void serve_usage(FILE *f)
{
    fprintf(f,
            "usage: rekv bench serve --model PATH [--modes offload,hybrid] [--arena SIZE]\n"
            "                        [--spill-bytes SIZE] [--jobs N] [--prompt-len S]\n"
            "                        [--max-new-tokens G] [--rate R] [--long-prompt L]\n"
            "                        [--max-batch B] [--backend cpu|cuda|auto] [--link-gbps G]\n"
            "                        [--prefill-chunk N] [--json]\n"
            "For each mode, starts a private kvstore (--host-bytes SIZE, default 64M), worker\n"
            "(--mode MODE, --backend, default cpu) and coordinator, submits N jobs (default 16)\n"
            "of S random prompt tokens (default 64) and G new tokens each (default 32, EOS\n"
            "ignored), all at once or R per second, streams them, and prints one JSON object:\n"
            "per mode tokens/s, TTFT and inter-token latency p50/p99 (taken here, as the\n"
            "tokens arrive), the most jobs running at once (admitted concurrency), the\n"
            "coordinator's jobs held for kvstore room and failed jobs. --long-prompt L: one\n"
            "more job of an L-token prompt, submitted once half the tokens are out; the other\n"
            "jobs' ITL p99 before it and while it runs. --max-batch: the worker's (default\n"
            "N + 1, so that the arena is what limits). --prefill-chunk: the coordinator's cap\n"
            "(rekv run --prefill-chunk; 0: whole prompts). --spill-bytes: the store's spill tier\n"
            "(rekv run --spill-bytes; 0: none, so that the arena alone is the room admission\n"
            "counts; default: the filesystem's). Exit 1 when a job failed.\n"
            "--workload chat|system: the prefix cache's workloads instead, cache on against off\n"
            "(`rekv bench serve --workload chat --help`).\n");
}

/* --modes: a trio per mode; 0, or -1 with the one it cannot run named. */
static int serve_parse_modes(const char *modes, serve_opts *o)
{
    char *mdup = strdup(modes), *save = NULL;
    for (char *t = mdup ? strtok_r(mdup, ",", &save) : NULL; t; t = strtok_r(NULL, ",", &save)) {
        rekv_mode mv;
        if (o->n_modes == MAX_MODES || rekv_mode_parse(t, &mv) || strlen(t) >= sizeof(o->modes[0])) {
            fprintf(stderr, "rekv bench serve: --modes: unknown or too many modes (\"%s\", at "
                            "most %d)\n", t, MAX_MODES);
            free(mdup);
            return -1;
        }
        snprintf(o->modes[o->n_modes++], sizeof(o->modes[0]), "%s", t);
    }
    free(mdup);
    return 0;
}

static int serve_parse(int argc, char **argv, serve_opts *o)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"modes", required_argument, 0, 'M'},
                                         {"arena", required_argument, 0, 'a'},
                                         {"spill-bytes", required_argument, 0, 's'},
                                         {"jobs", required_argument, 0, 'n'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"max-new-tokens", required_argument, 0, 'g'},
                                         {"rate", required_argument, 0, 'r'},
                                         {"long-prompt", required_argument, 0, 'L'},
                                         {"max-batch", required_argument, 0, 'B'},
                                         {"backend", required_argument, 0, 'b'},
                                         {"link-gbps", required_argument, 0, 'l'},
                                         {"prefill-chunk", required_argument, 0, 'c'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    *o = (serve_opts){.backend = "cpu", .arena = "64M", .n_jobs = 16, .prompt_len = 64,
                      .max_new = 32};
    const char *modes = "offload,hybrid";
    rekv_link_config link_check = REKV_LINK_NONE; /* the value goes to the worker as given */
    long v;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'M': modes = optarg; break;
        case 'a': o->arena = optarg; break;
        case 's': o->spill = optarg; break;
        case 'n': if (cli_parse_int("jobs", optarg, 1, 4000, &o->n_jobs)) return 2; break;
        case 'p': if (cli_parse_int("prompt-len", optarg, 1, 1 << 20, &o->prompt_len)) return 2; break;
        case 'g': if (cli_parse_int("max-new-tokens", optarg, 1, 1 << 20, &o->max_new)) return 2; break;
        case 'r': if (cli_parse_float("rate", optarg, 0, 1e6, &o->rate)) return 2; break;
        case 'L': if (cli_parse_int("long-prompt", optarg, 0, 1 << 20, &o->long_prompt)) return 2; break;
        case 'B': if (cli_parse_int("max-batch", optarg, 1, 4096, &o->max_batch)) return 2; break;
        case 'b': o->backend = optarg; break;
        case 'l': if (cli_parse_link(&link_check, "link-gbps", optarg)) return 2; o->link_gbps = optarg; break;
        case 'c': if (cli_parse_int("prefill-chunk", optarg, 0, INT32_MAX, &v)) return 2; o->prefill_chunk = optarg; break;
        case 'j': break; /* JSON is the only output */
        case 'h': serve_usage(stdout); return 0;
        default: serve_usage(stderr); return 2;
        }
    }
    if (cli_no_operands(argc, argv) || o->model == NULL) {
        serve_usage(stderr);
        return 2;
    }
    if (rekv_parse_size(o->arena, &o->arena_bytes) || o->arena_bytes == 0) {
        fprintf(stderr, "rekv bench serve: --arena %s: expected bytes, e.g. 1G\n", o->arena);
        return 2;
    }
    if (o->spill && rekv_parse_size(o->spill, &o->spill_bytes)) {
        fprintf(stderr, "rekv bench serve: --spill-bytes %s: expected bytes, e.g. 1G, or 0\n",
                o->spill);
        return 2;
    }
    if (o->max_batch == 0)
        o->max_batch = o->n_jobs + 1 > 4096 ? 4096 : o->n_jobs + 1;
    if (serve_parse_modes(modes, o))
        return 2;
    if (o->n_modes == 0) {
        serve_usage(stderr);
        return 2;
    }
    return CLI_PARSED;
}

/* The jobs' prompts (n_jobs of prompt_len tokens) and the long prompt's, the same run after run. */
static int serve_prompts(const serve_opts *o, int vocab, int32_t **prompts, int32_t *long_ids)
{
    uint64_t x = 4242;
    for (long i = 0; i < o->n_jobs; i++) {
        if ((prompts[i] = malloc(sizeof(int32_t) * (size_t)o->prompt_len)) == NULL)
            return -1;
        cli_random_tokens(&x, prompts[i], (size_t)o->prompt_len, vocab);
    }
    cli_random_tokens(&x, long_ids, (size_t)o->long_prompt, vocab);
    return 0;
}

/* One mode's entry of "modes". */
static json_t *serve_mode_json(const serve_opts *o, const char *mode, const serve_result *res)
{
    json_t *m = json_pack(
        "{s:s, s:I, s:I, s:I, s:f, s:f, s:{s:f, s:f}, s:{s:f, s:f}, s:I, s:I, s:I, s:I, s:I, "
        "s:I}",
        "mode", mode, "jobs_done", (json_int_t)res->done, "jobs_failed", (json_int_t)res->failed,
        "tokens", (json_int_t)res->tokens, "wall_s", res->wall_s, "tokens_per_s",
        res->tokens_per_s, "ttft_s", "p50", res->ttft_p50, "p99", res->ttft_p99, "itl_s", "p50",
        res->itl_p50, "p99", res->itl_p99, "admitted_concurrency", (json_int_t)res->admitted,
        "streaming_concurrency", (json_int_t)res->streamed_concurrency, "jobs_held_for_room",
        (json_int_t)res->held_for_room, "jobs_too_large", (json_int_t)res->too_large, "requeued",
        (json_int_t)res->requeued, "steps", (json_int_t)res->steps);
    if (o->long_prompt > 0)
        json_object_set_new(
            m, "long_prompt",
            json_pack("{s:f, s:f, s:f, s:f}", "ttft_s", res->long_ttft_s, "itl_p99_before_s",
                      res->itl_p99_before, "itl_p99_during_s", res->itl_p99_during,
                      "itl_p99_ratio",
                      res->itl_p99_before > 0 ? res->itl_p99_during / res->itl_p99_before : 0.0));
    if (res->first_error[0])
        json_object_set_new(m, "first_error", json_string(res->first_error));
    return m;
}

/* Prints the report: the shape, the options, and the modes' entries. */
static void serve_print(const serve_opts *o, const rekv_model_config *cfg, json_t *modes)
{
    json_t *out = json_pack(
        "{s:s, s:s, s:{s:i, s:i, s:i, s:i, s:i, s:i}, s:s, s:I, s:i, s:i, s:i, s:f, s:i, s:i, "
        "s:O}",
        "bench", "serve", "backend", o->backend, "model", "layers", cfg->n_layers, "hidden",
        cfg->hidden, "heads", cfg->n_heads, "kv_heads", cfg->n_kv_heads, "vocab", cfg->vocab,
        "max_pos", cfg->max_pos, "arena", o->arena, "arena_bytes", (json_int_t)o->arena_bytes,
        "jobs", (int)o->n_jobs, "prompt_len", (int)o->prompt_len, "max_new_tokens",
        (int)o->max_new, "rate", o->rate, "long_prompt", (int)o->long_prompt, "max_batch",
        (int)o->max_batch, "modes", modes);
    if (o->link_gbps)
        json_object_set_new(out, "link_gbps", json_real(atof(o->link_gbps)));
    if (o->spill) /* the store's spill tier (0: none); absent: the filesystem's */
        json_object_set_new(out, "spill_bytes", json_integer((json_int_t)o->spill_bytes));
    /* the coordinator's cap (rekv-coordinator's default when not given) */
    json_object_set_new(out, "prefill_chunk",
                        json_integer(o->prefill_chunk ? atol(o->prefill_chunk) : 512));
    char *s = json_dumps(out, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", s);
    free(s);
    json_decref(out);
}

int cli_bench_serve(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) /* the prefix cache's workloads: cli_bench_prefix.c */
        if (strncmp(argv[i], "--workload", 10) == 0)
            return cli_bench_serve_workload(argc, argv);
    serve_opts o;
    int rc = serve_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    rekv_err err = {0};
    rekv_model *model = NULL;
    if (rekv_model_open(o.model, &model, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        return 1;
    }
    rekv_model_config cfg = model->config;
    rekv_model_close(model);
    long longest = o.prompt_len > o.long_prompt ? o.prompt_len : o.long_prompt;
    if (longest + o.max_new > cfg.max_pos) {
        fprintf(stderr, "rekv bench serve: prompt + max-new-tokens exceeds the context (%d)\n",
                cfg.max_pos);
        return 2;
    }
    rc = 1;
    int32_t **prompts = calloc((size_t)o.n_jobs, sizeof(*prompts));
    int32_t *long_ids = malloc(sizeof(int32_t) * (size_t)(o.long_prompt + 1));
    json_t *arr = json_array();
    if (!prompts || !long_ids || serve_prompts(&o, cfg.vocab, prompts, long_ids))
        goto out;
    uint64_t failed = 0;
    for (int mi = 0; mi < o.n_modes; mi++) {
        cli_trio t;
        serve_result res;
        char ep[4200];
        if (trio_start(&t, &o, o.modes[mi]))
            goto out;
        snprintf(ep, sizeof(ep), "ipc://%s/control", t.dir);
        int r = serve_run(&o, ep, prompts, long_ids, &res);
        cli_trio_stop(&t);
        if (r)
            goto out;
        failed += res.failed;
        json_array_append_new(arr, serve_mode_json(&o, o.modes[mi], &res));
    }
    serve_print(&o, &cfg, arr);
    if (failed)
        fprintf(stderr, "rekv bench serve: %llu job%s failed\n", (unsigned long long)failed,
                failed == 1 ? "" : "s");
    rc = failed ? 1 : 0;
out:
    json_decref(arr);
    if (prompts)
        for (long i = 0; i < o.n_jobs; i++)
            free(prompts[i]);
    free(prompts);
    free(long_ids);
    return rc;
}
