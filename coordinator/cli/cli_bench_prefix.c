/* cli_bench_prefix.c — `rekv bench serve --workload chat|system`: issue 37's goals measured, the
 * prefix cache on against off in one run on the same workload.
 *
 * The workloads are generated here (seeded: the same tokens every run) as waves of requests; a
 * wave's requests are submitted together and all end before the next wave starts:
 *   chat    --conversations C (4) of --turns T (10): wave t holds turn t of every conversation,
 *           whose prompt is turn t-1's prompt + the answer the server gave it + --user-len U (64)
 *           new user tokens (turn 0: U tokens), so the history grows to about T x (U + G) tokens.
 *   system  --questions Q (8) waves of one request: a --system-len P (2048) token prompt shared by
 *           all, then --question-len L (100) tokens of its own.
 * Every request makes --max-new-tokens G tokens (greedy, EOS ignored).
 *
 * Runs (--runs, default off,host,disk), each on a private trio of its own (cli_bench_trio.c):
 *   off   the worker's --prefix-cache off: every prompt prefilled whole;
 *   host  the cache on, an arena that holds everything: a hit comes from host memory;
 *   disk  the cache on with --prefix-dir, and the trio stopped and started again (a kvstore
 *         restart) before each wave after the first, so each hit is read back from the spill
 *         tier (the kvstore's disk-hit counter says so).
 * Each trio first runs one short job that shares nothing with the workload (first-step costs;
 * after a restart it hits its own blocks on disk: the first read's io_uring registration) before
 * the workload's first wave or a restart's; its hits are not counted.
 *
 * The hit count is checked against the workload's shareable tokens, counted here from the token
 * lists alone: a request can take from the cache the longest run of whole 16-token blocks of its
 * prompt (at most all but its last token: its logits are computed) that a request of an earlier
 * wave wrote — that request's prompt and answer but the answer's last token, whose K,V no step
 * computes. --workload-out FILE writes every request's tokens and cached count as JSON lines for
 * an independent recount (tests/bench/prefix_shareable.py). */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "common/mode.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_bench.h"
#include "coordinator/coordinator.h"
#include "kvstore/kvstore.h"
#include "loader/loader.h"

#define BLOCK REKV_KV_BLOCK_TOKENS /* the cache's unit: a block of the kvstore (16 tokens) */

enum { RUN_OFF, RUN_HOST, RUN_DISK, N_RUNKINDS };
static const char *const run_names[N_RUNKINDS] = {"off", "host", "disk"};

typedef struct pf_opts {
    const char *model, *backend, *arena, *mode, *link_gbps, *out_file, *cache_dtype;
    int chat; /* 1: chat, 0: system */
    long convs, turns, user_len, hist_len, sys_len, q_len, questions, max_new;
    int runs[N_RUNKINDS], n_runs;
} pf_opts;

/* One request of one run. */
typedef struct preq {
    int wave, conv;
    int32_t *prompt, *out;
    uint32_t n_prompt, n_out, cached;
    uint64_t rid, job, t_submit;
    double ttft_s;
    int done, failed;
} preq;

typedef struct pf_run {
    int kind;
    preq *reqs; /* [n_reqs], in submission order */
    int n_reqs, restarts;
    double wall_s;
    double restart_ttft_s; /* the slowest warm-up job's TTFT after a restart */
    uint64_t tokens, failed;
    int64_t hit_host_blocks, hit_disk_blocks; /* the kvstore's, the warm-ups' taken out */
    char first_error[256];
} pf_run;

/* ---------------------------------------------------------------- the workload */

static int n_waves(const pf_opts *o) { return (int)(o->chat ? o->turns : o->questions); }
static int wave_size(const pf_opts *o) { return (int)(o->chat ? o->convs : 1); }

/* Request (wave w, conv c)'s prompt, from the earlier wave's request prev of its conversation
 * (chat) and the seeded new tokens; 0 or -ENOMEM. */
static int make_prompt(const pf_opts *o, int vocab, int w, int c, const preq *prev, preq *r)
{
    long fresh = o->chat ? o->user_len : o->q_len;
    long base = o->chat ? (prev ? prev->n_prompt + prev->n_out : o->hist_len) : o->sys_len;
    r->prompt = malloc(sizeof(int32_t) * (size_t)(base + fresh));
    if (r->prompt == NULL)
        return -ENOMEM;
    if (o->chat && prev) {
        memcpy(r->prompt, prev->prompt, sizeof(int32_t) * prev->n_prompt);
        memcpy(r->prompt + prev->n_prompt, prev->out, sizeof(int32_t) * prev->n_out);
    } else {
        uint64_t x = o->chat ? 424243ull * (uint64_t)(c + 1) /* the conversation's own history */
                             : 777;                          /* the shared system prompt */
        cli_random_tokens(&x, r->prompt, (size_t)base, vocab);
    }
    uint64_t x = 1000003ull * (uint64_t)(c + 1) + 7919ull * (uint64_t)(w + 1);
    cli_random_tokens(&x, r->prompt + base, (size_t)fresh, vocab);
    r->n_prompt = (uint32_t)(base + fresh);
    r->wave = w, r->conv = c, r->ttft_s = -1;
    return 0;
}

/* The tokens request r can take from the cache: see the file's comment. */
static uint32_t shareable(const preq *reqs, int i)
{
    const preq *r = &reqs[i];
    uint32_t best = 0, cap = (r->n_prompt - 1) / BLOCK;
    for (int j = 0; j < i; j++) {
        const preq *e = &reqs[j];
        if (e->wave >= r->wave || e->n_out == 0)
            continue;
        uint32_t written = (e->n_prompt + e->n_out - 1) / BLOCK * BLOCK, l = 0;
        while (l < written && l < r->n_prompt &&
               r->prompt[l] == (l < e->n_prompt ? e->prompt[l] : e->out[l - e->n_prompt]))
            l++;
        if (l / BLOCK > best)
            best = l / BLOCK;
    }
    return (best < cap ? best : cap) * BLOCK;
}

/* ---------------------------------------------------------------- one run */

static void pf_error(pf_run *run, preq *r, const char *what)
{
    if (r)
        r->failed = 1;
    if (!run->first_error[0])
        snprintf(run->first_error, sizeof(run->first_error), "%s", what);
}

static int pf_trio(cli_trio *t, const pf_opts *o, int kind, const char *prefix_dir)
{
    char batch[32], queue[32];
    snprintf(batch, sizeof(batch), "%d", wave_size(o) + 1);
    snprintf(queue, sizeof(queue), "%d", wave_size(o) + 2);
    const char *a[32] = {"--model", o->model, "--backend", o->backend, "--host-bytes", o->arena,
                         "--max-batch", batch, "--queue", queue, "--mode", o->mode,
                         "--prefix-cache", kind == RUN_OFF ? "off" : "on"};
    int n = 14;
    if (kind == RUN_DISK) {
        a[n++] = "--prefix-dir";
        a[n++] = prefix_dir;
    }
    if (o->link_gbps) {
        a[n++] = "--link-gbps";
        a[n++] = o->link_gbps;
    }
    if (o->cache_dtype) {
        a[n++] = "--cache-dtype";
        a[n++] = o->cache_dtype;
    }
    a[n] = NULL;
    return cli_trio_start(t, "serve", a);
}

static int pf_submit(rekv_ctl *c, const int32_t *ids, uint32_t n, long max_new, uint64_t *rid,
                     rekv_err *err)
{
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT; /* greedy */
    Rekv__Control__Submit sb = REKV__CONTROL__SUBMIT__INIT;
    sb.sampling = &smp;
    sb.prompt_ids = (int32_t *)ids;
    sb.n_prompt_ids = n;
    sb.max_new_tokens = (uint32_t)max_new;
    sb.stop_at_eos = 0;
    sb.stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    return rekv_ctl_send(c, &rq, rid, err);
}

/* A reply for one of the wave's requests rs[0..n) at time t. */
static void pf_on_reply(pf_run *run, preq *rs, int n, const Rekv__Control__Response *r,
                        uint64_t t, int *ended)
{
    int i = 0;
    while (i < n && rs[i].rid != r->id)
        i++;
    if (i == n)
        return;
    preq *q = &rs[i];
    if (r->code == REKV__CONTROL__CODE__OK && r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
        q->job = r->submitted->job; /* the job whose answer is read */
        return;
    }
    if (q->done)
        return;
    if (r->code != REKV__CONTROL__CODE__OK) {
        pf_error(run, q, r->error ? r->error : rekv_ctl_code_name(r->code));
        q->done = 1, (*ended)++;
        return;
    }
    if (r->body_case != REKV__CONTROL__RESPONSE__BODY_EVENT)
        return;
    if (r->event->n_tokens > 0 && q->ttft_s < 0)
        q->ttft_s = (double)(t - q->t_submit) * 1e-9;
    if (r->event->done) {
        q->done = 1, (*ended)++;
        if (r->event->state != REKV__CONTROL__JOB_STATE__DONE)
            pf_error(run, q, r->event->error && *r->event->error
                                 ? r->event->error
                                 : rekv_ctl_state_name(r->event->state));
    }
}

/* Submits rs[0..n) at once, streams them to their ends, then reads their answers; 0 or -1. */
static int pf_wave(rekv_ctl *c, const pf_opts *o, pf_run *run, preq *rs, int n, long max_new)
{
    rekv_err err = {0};
    uint64_t t0 = rekv_now_ns();
    for (int i = 0; i < n; i++) {
        rs[i].t_submit = rekv_now_ns();
        if (pf_submit(c, rs[i].prompt, rs[i].n_prompt, max_new, &rs[i].rid, &err)) {
            fprintf(stderr, "rekv bench serve: %s\n", err.msg);
            return -1;
        }
    }
    int ended = 0;
    while (ended < n) {
        Rekv__Control__Response *r = NULL;
        uint64_t t;
        if (cli_bench_recv(c, "serve", &r, &t))
            return -1;
        pf_on_reply(run, rs, n, r, t, &ended);
        rekv__control__response__free_unpacked(r, NULL);
    }
    if (o) /* the workload's waves count in the run's time and tokens; a warm-up's do not */
        run->wall_s += (double)(rekv_now_ns() - t0) * 1e-9;
    for (int i = 0; i < n; i++) {
        if (!rs[i].failed && cli_job_answer(c, "serve", rs[i].job, &rs[i].out, &rs[i].n_out, &rs[i].cached))
            return -1;
        if (o)
            run->tokens += rs[i].n_out, run->failed += rs[i].failed;
    }
    return 0;
}

/* One short job that shares nothing with the workload: 40 tokens, two whole blocks, the same in
 * every warm-up of the run, so that after a restart it takes them from the spill tier and pays the
 * first read's costs (the arena's io_uring registration) before the wave. Its TTFT after a
 * restart is kept apart (restart_ttft). */
static int pf_warm(rekv_ctl *c, pf_run *run, int vocab)
{
    int32_t ids[40];
    uint64_t x = 99;
    cli_random_tokens(&x, ids, 40, vocab);
    preq w = {.prompt = ids, .n_prompt = 40, .ttft_s = -1};
    int rc = pf_wave(c, NULL, run, &w, 1, 1);
    free(w.out);
    if (rc == 0 && w.failed) {
        fprintf(stderr, "rekv bench serve: the warm-up job failed: %s\n", run->first_error);
        return -1;
    }
    if (rc == 0 && run->restarts > 0 && run->restart_ttft_s < w.ttft_s)
        run->restart_ttft_s = w.ttft_s;
    return rc;
}

/* Adds (sign 1) or takes out (-1) the trio's kvstore's prefix hits by tier to the run's; 0 or -1
 * with a message printed. */
static int pf_kv_hits(const cli_trio *t, pf_run *run, int sign)
{
    char ep[4200];
    snprintf(ep, sizeof(ep), "ipc://%s/kvstore", t->dir);
    rekv_kvstore_client *k = NULL;
    rekv_kv_stats st;
    rekv_err err = {0};
    if (rekv_kvstore_client_connect(ep, NULL, 10000, &k, &err) || rekv_kvstore_stats(k, &st, &err)) {
        fprintf(stderr, "rekv bench serve: the kvstore's stats: %s\n", err.msg);
        rekv_kvstore_client_close(k);
        return -1;
    }
    run->hit_host_blocks += sign * (int64_t)st.prefix_hit_host_blocks;
    run->hit_disk_blocks += sign * (int64_t)st.prefix_hit_disk_blocks;
    rekv_kvstore_client_close(k);
    return 0;
}

/* (Re)starts the run's trio and connects to it, then warms it up; 0 or -1. */
static int pf_start(const pf_opts *o, int vocab, pf_run *run, cli_trio *t, const char *pdir,
                    rekv_ctl **c)
{
    char ep[4200];
    rekv_err err = {0};
    if (pf_trio(t, o, run->kind, pdir))
        return -1;
    snprintf(ep, sizeof(ep), "ipc://%s/control", t->dir);
    if (rekv_ctl_connect(ep, NULL, c, &err)) {
        fprintf(stderr, "rekv bench serve: %s\n", err.msg);
        return -1;
    }
    return pf_warm(*c, run, vocab) ? -1 : pf_kv_hits(t, run, -1);
}

/* One run of the whole workload; 0, or -1 with a message printed. */
static int pf_one_run(const pf_opts *o, int vocab, pf_run *run)
{
    int W = n_waves(o), S = wave_size(o), rc = -1;
    run->n_reqs = W * S;
    run->reqs = calloc((size_t)run->n_reqs, sizeof(*run->reqs));
    char pdir[4096] = "";
    cli_trio t = {0};
    rekv_ctl *c = NULL;
    if (run->reqs == NULL) {
        fprintf(stderr, "rekv bench serve: out of memory\n");
        return -1;
    }
    if (run->kind == RUN_DISK) {
        const char *tmp = getenv("TMPDIR");
        snprintf(pdir, sizeof(pdir), "%s/rekv-prefix.XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (mkdtemp(pdir) == NULL) {
            fprintf(stderr, "rekv bench serve: %s: %s\n", pdir, strerror(errno));
            return -1;
        }
    }
    for (int w = 0; w < W; w++) {
        if (w > 0 && run->kind == RUN_DISK) { /* a clean stop writes the cache to disk */
            int k = pf_kv_hits(&t, run, 1);
            rekv_ctl_close(c);
            c = NULL;
            cli_trio_stop(&t);
            run->restarts++;
            if (k)
                goto out;
        }
        if ((w == 0 || run->kind == RUN_DISK) && pf_start(o, vocab, run, &t, pdir, &c))
            goto out;
        preq *rs = run->reqs + (size_t)w * (size_t)S;
        for (int i = 0; i < S; i++)
            if (make_prompt(o, vocab, w, i, w ? &rs[i - S] : NULL, &rs[i])) {
                fprintf(stderr, "rekv bench serve: out of memory\n");
                goto out;
            }
        if (pf_wave(c, o, run, rs, S, o->max_new))
            goto out;
    }
    rc = pf_kv_hits(&t, run, 1);
out:
    rekv_ctl_close(c);
    cli_trio_stop(&t);
    if (pdir[0])
        cli_rm_tree(pdir);
    return rc;
}

/* ---------------------------------------------------------------- the report */

/* Nearest-rank percentile p of the TTFTs of the run's requests in waves [w0, w1). */
static double ttft_pct(const pf_run *run, int w0, int w1, double p)
{
    double *v = malloc(sizeof(double) * (size_t)(run->n_reqs + 1));
    size_t n = 0;
    for (int i = 0; v && i < run->n_reqs; i++)
        if (run->reqs[i].wave >= w0 && run->reqs[i].wave < w1 && run->reqs[i].ttft_s >= 0)
            v[n++] = run->reqs[i].ttft_s;
    double r = v ? cli_percentile(v, n, p) : 0;
    free(v);
    return r;
}

typedef struct pf_sums {
    uint64_t prompt, hit, share;
} pf_sums;

static pf_sums pf_count(const pf_run *run)
{
    pf_sums s = {0};
    for (int i = 0; i < run->n_reqs; i++) {
        s.prompt += run->reqs[i].n_prompt;
        s.hit += run->reqs[i].cached;
        s.share += shareable(run->reqs, i);
    }
    return s;
}

/* The answers of run that differ from ref's (the same request's). */
static long pf_mismatches(const pf_run *ref, const pf_run *run)
{
    long m = 0;
    for (int i = 0; i < run->n_reqs && i < ref->n_reqs; i++) {
        const preq *a = &ref->reqs[i], *b = &run->reqs[i];
        m += a->n_out != b->n_out || (a->n_out && memcmp(a->out, b->out, sizeof(int32_t) * a->n_out));
    }
    return m;
}

static json_t *pf_run_json(const pf_opts *o, const pf_run *run)
{
    pf_sums s = pf_count(run);
    int W = n_waves(o);
    json_t *j = json_pack(
        "{s:s, s:I, s:I, s:f, s:f, s:f, s:{s:f}, s:{s:f, s:f}, s:I, s:I, s:f, s:I, s:I, s:I, "
        "s:i}",
        "run", run_names[run->kind], "requests", (json_int_t)run->n_reqs, "tokens",
        (json_int_t)run->tokens, "wall_s", run->wall_s, "tokens_per_s",
        run->wall_s > 0 ? (double)run->tokens / run->wall_s : 0.0, "requests_per_s",
        run->wall_s > 0 ? (double)run->n_reqs / run->wall_s : 0.0, "ttft_first_wave_s", "p50",
        ttft_pct(run, 0, 1, 50), "ttft_later_waves_s", "p50", ttft_pct(run, 1, W, 50), "p90",
        ttft_pct(run, 1, W, 90), "prompt_tokens", (json_int_t)s.prompt, "hit_tokens",
        (json_int_t)s.hit, "hit_rate", s.prompt ? (double)s.hit / (double)s.prompt : 0.0,
        "shareable_tokens", (json_int_t)s.share, "hit_blocks_host",
        (json_int_t)run->hit_host_blocks, "hit_blocks_disk", (json_int_t)run->hit_disk_blocks,
        "restarts", run->restarts);
    json_object_set_new(j, "jobs_failed", json_integer((json_int_t)run->failed));
    if (run->restarts)
        json_object_set_new(j, "warmup_ttft_after_restart_s", json_real(run->restart_ttft_s));
    if (run->first_error[0])
        json_object_set_new(j, "first_error", json_string(run->first_error));
    return j;
}

/* --workload-out: every request of every run as one JSON line. */
static int pf_write(const char *path, const pf_run *runs, int n_runs)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "rekv bench serve: --workload-out %s: %s\n", path, strerror(errno));
        return -1;
    }
    for (int k = 0; k < n_runs; k++)
        for (int i = 0; i < runs[k].n_reqs; i++) {
            const preq *q = &runs[k].reqs[i];
            json_t *p = json_array(), *a = json_array();
            for (uint32_t t = 0; t < q->n_prompt; t++)
                json_array_append_new(p, json_integer(q->prompt[t]));
            for (uint32_t t = 0; t < q->n_out; t++)
                json_array_append_new(a, json_integer(q->out[t]));
            json_t *l = json_pack("{s:s, s:i, s:i, s:o, s:o, s:I}", "run", run_names[runs[k].kind],
                                  "wave", q->wave, "conv", q->conv, "prompt", p, "output", a,
                                  "cached_tokens", (json_int_t)q->cached);
            json_dumpf(l, f, JSON_COMPACT);
            fputc('\n', f);
            json_decref(l);
        }
    if (fclose(f) != 0) {
        fprintf(stderr, "rekv bench serve: --workload-out %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the command */

static void pf_usage(FILE *f)
{
    fprintf(f,
            "usage: rekv bench serve --workload chat|system --model PATH [--runs off,host,disk]\n"
            "                        [--mode MODE] [--arena SIZE] [--backend B] [--link-gbps G]\n"
            "                        [--max-new-tokens G] [--cache-dtype f32|f16|int8|int4]\n"
            "                        [--workload-out FILE] [--json]\n"
            "  chat:   [--conversations C] [--turns T] [--user-len U] [--history-len H]\n"
            "  system: [--questions Q] [--system-len P] [--question-len L]\n"
            "The prefix cache off against on, each run on a private trio (`rekv run --mode MODE`,\n"
            "default offload; --host-bytes SIZE, default 256M). chat: C conversations (default\n"
            "4) of T turns (10), each turn's prompt the previous prompt + its answer + U new\n"
            "tokens (64), the first turn's an H-token history of its own (1024) + U, turns in\n"
            "waves; system: Q questions (8), one at a time, each a P-token\n"
            "prompt shared by all (2048) + L tokens of its own (100). G new tokens a request\n"
            "(chat 32, system 16; greedy, EOS ignored). Runs: off (--prefix-cache off), host\n"
            "(on; hits from host memory), disk (on, --prefix-dir, the trio restarted before each\n"
            "wave after the first: hits read back from the spill tier). Prints one JSON object:\n"
            "per run tokens/s, TTFT of the first wave and of the later ones (p50/p90), the\n"
            "prompt tokens taken from the cache, the kvstore's hit blocks by tier; the\n"
            "workload's shareable tokens (whole 16-token blocks an earlier wave wrote, counted\n"
            "from the token lists), the ratios to off. Exit 1 when a job failed, an answer\n"
            "differs from the off run's, or a cache-on run's hits differ from the shareable\n"
            "count. --workload-out: every request's tokens and cached count, JSON lines.\n"
            "--cache-dtype: the trio's (`rekv run --cache-dtype`; default the backend's).\n");
}

static int pf_parse_runs(const char *s, pf_opts *o)
{
    char *d = strdup(s), *save = NULL;
    o->n_runs = 0;
    for (char *t = d ? strtok_r(d, ",", &save) : NULL; t; t = strtok_r(NULL, ",", &save)) {
        int k = 0;
        while (k < N_RUNKINDS && strcmp(t, run_names[k]) != 0)
            k++;
        if (k == N_RUNKINDS || o->n_runs == N_RUNKINDS) {
            fprintf(stderr, "rekv bench serve: --runs: '%s' is not off, host or disk\n", t);
            free(d);
            return -1;
        }
        o->runs[o->n_runs++] = k;
    }
    free(d);
    return o->n_runs ? 0 : -1;
}

static int pf_parse(int argc, char **argv, pf_opts *o)
{
    static const struct option opts[] = {
        {"workload", required_argument, 0, 'w'},   {"model", required_argument, 0, 'm'},
        {"runs", required_argument, 0, 'R'},       {"mode", required_argument, 0, 'M'},
        {"arena", required_argument, 0, 'a'},      {"backend", required_argument, 0, 'b'},
        {"link-gbps", required_argument, 0, 'l'},  {"max-new-tokens", required_argument, 0, 'g'},
        {"conversations", required_argument, 0, 'C'}, {"turns", required_argument, 0, 'T'},
        {"user-len", required_argument, 0, 'U'},   {"history-len", required_argument, 0, 'H'},
        {"questions", required_argument, 0, 'Q'},
        {"system-len", required_argument, 0, 'P'}, {"question-len", required_argument, 0, 'L'},
        {"workload-out", required_argument, 0, 'o'}, {"json", no_argument, 0, 'j'},
        {"cache-dtype", required_argument, 0, 'D'},
        {"help", no_argument, 0, 'h'},             {0, 0, 0, 0}};
    *o = (pf_opts){.backend = "cpu", .arena = "256M", .mode = "offload", .convs = 4, .turns = 10,
                   .user_len = 64, .hist_len = 1024, .sys_len = 2048, .q_len = 100, .questions = 8,
                   .max_new = -1};
    const char *workload = NULL, *runs = "off,host,disk";
    rekv_link_config link_check = REKV_LINK_NONE;
    rekv_mode mv;
    uint64_t bytes;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'w': workload = optarg; break;
        case 'm': o->model = optarg; break;
        case 'R': runs = optarg; break;
        case 'M': o->mode = optarg; break;
        case 'a': o->arena = optarg; break;
        case 'b': o->backend = optarg; break;
        case 'l': if (cli_parse_link(&link_check, "link-gbps", optarg)) return 2; o->link_gbps = optarg; break;
        case 'g': if (cli_parse_int("max-new-tokens", optarg, 1, 1 << 20, &o->max_new)) return 2; break;
        case 'C': if (cli_parse_int("conversations", optarg, 1, 1000, &o->convs)) return 2; break;
        case 'T': if (cli_parse_int("turns", optarg, 1, 1000, &o->turns)) return 2; break;
        case 'U': if (cli_parse_int("user-len", optarg, 1, 1 << 20, &o->user_len)) return 2; break;
        case 'H': if (cli_parse_int("history-len", optarg, 0, 1 << 20, &o->hist_len)) return 2; break;
        case 'Q': if (cli_parse_int("questions", optarg, 1, 1000, &o->questions)) return 2; break;
        case 'P': if (cli_parse_int("system-len", optarg, 0, 1 << 20, &o->sys_len)) return 2; break;
        case 'L': if (cli_parse_int("question-len", optarg, 1, 1 << 20, &o->q_len)) return 2; break;
        case 'o': o->out_file = optarg; break;
        case 'D': o->cache_dtype = optarg; break;
        case 'j': break; /* JSON is the only output */
        case 'h': pf_usage(stdout); return 0;
        default: pf_usage(stderr); return 2;
        }
    }
    if (cli_no_operands(argc, argv) || o->model == NULL || workload == NULL ||
        (strcmp(workload, "chat") != 0 && strcmp(workload, "system") != 0)) {
        if (workload && strcmp(workload, "chat") != 0 && strcmp(workload, "system") != 0)
            fprintf(stderr, "rekv bench serve: --workload %s: chat or system\n", workload);
        pf_usage(stderr);
        return 2;
    }
    o->chat = strcmp(workload, "chat") == 0;
    if (o->max_new < 0)
        o->max_new = o->chat ? 32 : 16;
    if (rekv_parse_size(o->arena, &bytes) || bytes == 0) {
        fprintf(stderr, "rekv bench serve: --arena %s: expected bytes, e.g. 1G\n", o->arena);
        return 2;
    }
    if (rekv_mode_parse(o->mode, &mv)) {
        fprintf(stderr, "rekv bench serve: --mode %s: not a mode\n", o->mode);
        return 2;
    }
    return pf_parse_runs(runs, o) ? 2 : CLI_PARSED;
}

/* Prints the report; returns the failures' count (jobs failed, answers differing from the first
 * run's, cache-on runs whose hits are not the shareable count, cache-off runs with hits). */
static long pf_print(const pf_opts *o, const rekv_model_config *cfg, const pf_run *runs)
{
    json_t *arr = json_array();
    long bad = 0, mism = 0;
    const pf_run *by[N_RUNKINDS] = {0};
    pf_sums first = pf_count(&runs[0]);
    for (int k = 0; k < o->n_runs; k++) {
        const pf_run *r = &runs[k];
        pf_sums s = pf_count(r);
        by[r->kind] = r;
        json_array_append_new(arr, pf_run_json(o, r));
        mism += pf_mismatches(&runs[0], r);
        bad += (long)r->failed;
        if (r->kind == RUN_OFF ? s.hit != 0 : s.hit != s.share) {
            fprintf(stderr, "rekv bench serve: run %s took %llu prompt tokens from the cache; the "
                            "workload's shareable tokens are %llu\n",
                    run_names[r->kind], (unsigned long long)s.hit,
                    r->kind == RUN_OFF ? 0ull : (unsigned long long)s.share);
            bad++;
        }
    }
    int W = n_waves(o);
    json_t *out = json_pack(
        "{s:s, s:s, s:s, s:s, s:{s:i, s:i, s:i, s:i, s:i, s:i}, s:s, s:s, s:I, s:I, s:I, s:f, "
        "s:o, s:I}",
        "bench", "serve", "workload", o->chat ? "chat" : "system", "backend", o->backend, "mode",
        o->mode, "model", "layers", cfg->n_layers, "hidden", cfg->hidden, "heads", cfg->n_heads,
        "kv_heads", cfg->n_kv_heads, "vocab", cfg->vocab, "max_pos", cfg->max_pos, "arena",
        o->arena, "cache_dtype", o->cache_dtype ? o->cache_dtype : "default", "max_new_tokens",
        (json_int_t)o->max_new, "prompt_tokens", (json_int_t)first.prompt, "shareable_tokens", (json_int_t)first.share,
        "shareable_fraction", first.prompt ? (double)first.share / (double)first.prompt : 0.0,
        "runs", arr, "mismatches", (json_int_t)mism);
    if (o->chat)
        json_object_set_new(out, "workload_shape",
                            json_pack("{s:I, s:I, s:I, s:I}", "conversations", (json_int_t)o->convs,
                                      "turns", (json_int_t)o->turns, "user_len",
                                      (json_int_t)o->user_len, "history_len",
                                      (json_int_t)o->hist_len));
    else
        json_object_set_new(out, "workload_shape",
                            json_pack("{s:I, s:I, s:I}", "questions", (json_int_t)o->questions,
                                      "system_len", (json_int_t)o->sys_len, "question_len",
                                      (json_int_t)o->q_len));
    if (o->link_gbps)
        json_object_set_new(out, "link_gbps", json_real(atof(o->link_gbps)));
    /* against off: the later waves' TTFT p50 (the requests with a prefix to take) and tokens/s */
    double off_ttft = by[RUN_OFF] ? ttft_pct(by[RUN_OFF], 1, W, 50) : 0;
    for (int k = RUN_HOST; k < N_RUNKINDS && by[RUN_OFF]; k++) {
        if (!by[k])
            continue;
        char key[64];
        snprintf(key, sizeof(key), "ttft_p50_ratio_%s", run_names[k]);
        double t = ttft_pct(by[k], 1, W, 50);
        json_object_set_new(out, key, json_real(off_ttft > 0 ? t / off_ttft : 0.0));
        snprintf(key, sizeof(key), "tokens_per_s_ratio_%s", run_names[k]);
        double a = by[k]->wall_s > 0 ? (double)by[k]->tokens / by[k]->wall_s : 0;
        double b = by[RUN_OFF]->wall_s > 0 ? (double)by[RUN_OFF]->tokens / by[RUN_OFF]->wall_s : 0;
        json_object_set_new(out, key, json_real(b > 0 ? a / b : 0.0));
    }
    char *str = json_dumps(out, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", str);
    free(str);
    json_decref(out);
    if (mism)
        fprintf(stderr, "rekv bench serve: %ld answer%s differ from the first run's\n", mism,
                mism == 1 ? "" : "s");
    return bad + mism;
}

int cli_bench_serve_workload(int argc, char **argv)
{
    pf_opts o;
    int rc = pf_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    rekv_model_config cfg;
    if (cli_model_config(o.model, &cfg))
        return 1;
    long longest = o.chat ? o.turns * o.user_len + (o.turns - 1) * o.max_new + o.max_new
                          : o.sys_len + o.q_len + o.max_new;
    if (longest > cfg.max_pos) {
        fprintf(stderr, "rekv bench serve: the workload's longest request (%ld tokens with its "
                        "answer) exceeds the context (%d)\n", longest, cfg.max_pos);
        return 2;
    }
    pf_run runs[N_RUNKINDS];
    memset(runs, 0, sizeof(runs));
    rc = 1;
    int done = 0;
    for (; done < o.n_runs; done++) {
        runs[done].kind = o.runs[done];
        if (pf_one_run(&o, cfg.vocab, &runs[done])) {
            done++;
            goto out;
        }
    }
    long bad = pf_print(&o, &cfg, runs);
    if (o.out_file && pf_write(o.out_file, runs, o.n_runs))
        goto out;
    rc = bad ? 1 : 0;
out:
    for (int k = 0; k < done; k++) {
        for (int i = 0; i < runs[k].n_reqs && runs[k].reqs; i++)
            free(runs[k].reqs[i].prompt), free(runs[k].reqs[i].out);
        free(runs[k].reqs);
    }
    return rc;
}
