/* cli_bench_decode.c — `rekv bench decode`: every mode asked for (--modes) on the same prompts in
 * one process: its prefill time, decode tokens/s, its ratio to offload, host->device bytes per
 * generated token, achieved host->device GB/s beside the link's peak measured in the same run,
 * the busy fractions of compute and link, the planner's prediction of its steps beside the
 * measured ones, whether its tokens equal resident's, and the peak resident memory while it ran.
 * A run that fails (a mode the device cannot hold, say) reports its error in its entry and the
 * others still run. Prints one JSON object. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/crc32c.h"
#include "common/dtype.h"
#include "common/progress.h"
#include "coordinator/cli/cli_bench.h"
#include "coordinator/cli/cli_profile.h"
#include "coordinator/cli/cli_session.h"
#include "gpuworker/gpuworker.h"
#include "kvstore/kvstore.h"
#include "loader/loader.h"

/* One mode's decode run: prefill the prompts, at most `chunk` tokens of each per step (serving's
 * chunked prefill; timed: prefill_s), then gen_len - 1
 * greedy decode steps timed alone, with counters and busy times taken over the decode steps only.
 * With link != NULL (a mode that uses the kvstore), the link's peak is measured afterwards in the
 * same session. */
typedef struct decode_result {
    double prefill_s, decode_s, compute_busy_s, h2d_busy_s, d2h_busy_s;
    uint64_t gathered;    /* h2d rows a device-side gather read (the backend's h2d_gathered) */
    uint64_t graph_steps; /* decode steps that ran as one device graph */
    uint64_t host_syncs;  /* the decode steps' calls that blocked on the device (backend stats) */
    rekv_layer_counters counters;
    double
        selected; /* infinigen's selected fraction f (rekv_pipeline_selected_fraction), 0: none */
    int32_t *tokens; /* [gen_len][batch] */
    /* each decode step's compute busy and link (h2d) busy time, s, and the split it ran at:
     * [gen_len - 1][3] */
    double *step;
    rekv_pipeline_config cfg;    /* its split: the last step's */
    int split_first;             /* the split the run started at (the planner's before any step) */
    char backend[16];            /* the backend it ran on */
    int has_store;               /* the kvstore's counters over the decode steps: */
    rekv_kv_stats ks0, ks1;      /* at their start and end */
    unsigned long long peak_rss; /* bytes: the process's peak over its steps (cli_peak_rss_bytes) */
    char error[1024];            /* why the run failed, as rekv_err says it ("": it did not) */
} decode_result;

/* A run whose split the planner chose (kvpr, infinigen keeping activations; not kvpr@L nor
 * --split) has it chosen again before each decode step (cli_plan_split) from the profile as the
 * run's steps so far corrected it: each step's compute and link busy times against that step's
 * corrected price (rekv_plan_scales_observe), as a served worker's planner corrects its profile
 * and picks each step's split (co_plan_observe, co_plan_step). So a split whose recomputation
 * measures slower than its price moves towards offload's within the run, where the profile alone
 * kept it for the whole run (issue 42 item 3). */
typedef struct online_split {
    int on;
    rekv_cost_profile prof; /* the cached profile, priced for the run's cache dtype */
    rekv_plan_scales sc;
    rekv_step_cost pred; /* the next step at its split, priced by the corrected profile */
} online_split;

static int online_split_open(online_split *os, const rekv_model_config *c,
                             const cli_pipeline_opts *po, const rekv_pipeline_config *cfg,
                             rekv_err *err)
{
    memset(os, 0, sizeof(*os));
    os->sc = (rekv_plan_scales){1, 1};
    if (po->cfg.split >= 0 || rekv_mode_info_of(cfg->mode)->split == REKV_SPLIT_NONE ||
        !rekv_pipeline_keeps_act(cfg))
        return 0;
    rekv_profile pf;
    int rc = rekv_profile_get(c, po->backend, &po->link, NULL, 0, &pf, NULL, err);
    if (rc)
        return rc;
    rekv_profile_to_cost(&pf, cfg->cache_dtype, &os->prof);
    os->on = 1;
    return 0;
}

/* Before a decode step of B sequences at context ctx: the split from the corrected profile, set
 * on the pipeline when it changes, and the step's price at it (f: infinigen's fetched fraction). */
static int online_split_step(online_split *os, rekv_pipeline *p, const rekv_model_config *c,
                             rekv_pipeline_config *cfg, int B, int ctx, double f, rekv_err *err)
{
    rekv_cost_profile now;
    rekv_plan_scaled_profile(&os->prof, &os->sc, &now);
    int split, rc;
    if ((rc = cli_plan_split(&now, c, cfg, B, ctx, f, &split, err)))
        return rc;
    if (split != cfg->split) {
        rekv_step_params sp = {split, cfg->kv_parts >= 0 ? cfg->kv_parts : 1,
                               cfg->act_parts >= 0 ? cfg->act_parts : 1, cfg->gpu_batches,
                               cfg->schedule};
        if ((rc = rekv_pipeline_set_step(p, &sp, err)))
            return rc;
        cfg->split = split;
    }
    return cli_plan_predict_step(&now, c, cfg, B, ctx, f, &os->pred, err);
}

/* One mode's run: N steps (the prefill, then N - 1 decode steps), reported to pr as done + 1 ..
 * done + N; note names the run. */
static int run_decode(rekv_engine *eng, const cli_pipeline_opts *po, rekv_mode mode, int B, int S,
                      int N, int chunk, int32_t *const *prompts, decode_result *out,
                      link_peak *link, device_peak *dev, rekv_progress *pr, uint64_t done,
                      const char *note, rekv_err *err)
{
    const rekv_model_config *c = rekv_engine_config(eng);
    int rc;
    out->cfg = po->cfg;
    out->cfg.mode = mode;
    online_split os;
    if ((rc = cli_session_choose(c, po->backend, &po->link, B, S, &out->cfg, err)) ||
        (rc = online_split_open(&os, c, po, &out->cfg, err)))
        return rc;
    out->split_first = out->cfg.split;
    cli_session ses;
    if ((rc = cli_session_open(&ses, eng, po, &out->cfg, B, S + N, err)))
        return rc;
    snprintf(out->backend, sizeof(out->backend), "%s", ses.be->iface->name);
    rekv_pseq **seqs = calloc((size_t)B, sizeof(*seqs));
    rekv_pipe_item *items = calloc((size_t)B, sizeof(*items));
    out->tokens = malloc(sizeof(int32_t) * (size_t)B * (size_t)N);
    out->step = calloc((size_t)(N - 1) * 3, sizeof(double));
    if (!seqs || !items || !out->tokens || !out->step) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto out;
    }
    for (int b = 0; b < B && rc == 0; b++)
        rc = rekv_pseq_create(ses.p, S + N, &seqs[b], err);
    /* greedy, drawn on the device as a served worker draws: only the ids cross back */
    rekv_sampler greedy;
    rekv_sampler_init(&greedy, 0, 0, 1, 0);
    uint64_t t_pre = rekv_now_ns();
    for (int t0 = 0; t0 < S && rc == 0; t0 += chunk) {
        for (int b = 0; b < B; b++)
            items[b] = (rekv_pipe_item){.seq = seqs[b],
                                        .tokens = prompts[b] + t0,
                                        .n_tokens = S - t0 < chunk ? S - t0 : chunk,
                                        .smp = &greedy,
                                        .token = &out->tokens[b]};
        rc = rekv_pipeline_step(ses.p, items, B, err);
    }
    if (rc)
        goto out;
    out->prefill_s = (double)(rekv_now_ns() - t_pre) * 1e-9;
    rekv_progress_update(pr, done + 1, note);
    rekv_pipeline_counters_reset(ses.p);
    ses.be->iface->stats_reset(ses.be);
    ses.be->iface->timing(ses.be, true); /* the decode steps' busy times: every op timed */
    if (po->trace)
        ses.be->iface->trace_start(ses.be);
    out->has_store = ses.store && rekv_kvstore_stats(ses.store, &out->ks0, NULL) == 0;
    uint64_t t0 = rekv_now_ns();
    for (int step = 0; step + 1 < N; step++) {
        for (int b = 0; b < B; b++)
            items[b] = (rekv_pipe_item){.seq = seqs[b],
                                        .tokens = &out->tokens[(size_t)step * B + b],
                                        .n_tokens = 1,
                                        .smp = &greedy,
                                        .token = &out->tokens[(size_t)(step + 1) * B + b]};
        double f = rekv_pipeline_selected_fraction(rekv_pipeline_counters(ses.p, NULL), c->n_layers,
                                                   NULL, NULL);
        if (os.on && (rc = online_split_step(&os, ses.p, c, &out->cfg, B, S + step,
                                             f > 0 ? f : REKV_PLAN_INFINIGEN_PRIOR, err)))
            goto out;
        rekv_backend_stats b0, b1;
        ses.be->iface->stats(ses.be, &b0);
        if ((rc = rekv_pipeline_step(ses.p, items, B, err)))
            goto out;
        ses.be->iface->stats(ses.be, &b1);
        double *st = out->step + (size_t)step * 3;
        st[0] = b1.compute_busy_s - b0.compute_busy_s;
        st[1] = b1.h2d_busy_s - b0.h2d_busy_s;
        st[2] = out->cfg.split;
        if (os.on)
            rekv_plan_scales_observe(&os.sc, st[1], os.pred.t_pcie, st[0], os.pred.t_compute);
        out->host_syncs += b1.host_syncs - b0.host_syncs;
        rekv_progress_update(pr, done + (uint64_t)step + 2, note);
    }
    out->decode_s = (double)(rekv_now_ns() - t0) * 1e-9;
    /* the run's peak, before the yardsticks below allocate theirs (on the cpu backend the
     * device's copy buffers are host memory: 512 MiB) */
    out->peak_rss = cli_peak_rss_bytes();
    out->graph_steps = rekv_pipeline_graph_steps(ses.p, NULL); /* the prefill never is one */
    if (out->has_store)
        out->has_store = rekv_kvstore_stats(ses.store, &out->ks1, NULL) == 0;
    out->selected = rekv_pipeline_selected_fraction(rekv_pipeline_counters(ses.p, &out->counters),
                                                    rekv_engine_config(eng)->n_layers, NULL, NULL);
    rekv_backend_stats bst;
    ses.be->iface->stats(ses.be, &bst);
    out->compute_busy_s = bst.compute_busy_s;
    out->h2d_busy_s = bst.h2d_busy_s;
    out->d2h_busy_s = bst.d2h_busy_s;
    out->gathered = bst.h2d_gathered;
    if (po->trace) /* this run's own file (decode_run_all names it) */
        rc = ses.be->iface->trace_write(ses.be, po->trace, err);
    if (rc == 0 && link && ses.store) { /* yardsticks: one that cannot be measured is lost, not
                                            the run */
        rekv_err lerr = {0};
        link->error[0] = '\0';
        if (cli_bench_measure_link(ses.be, ses.store, link, &lerr))
            snprintf(link->error, sizeof(link->error), "%s", lerr.msg);
    }
    if (rc == 0 && dev) {
        rekv_err derr = {0};
        if (cli_bench_measure_device(ses.be, eng, B * chunk, dev, &derr))
            snprintf(dev->error, sizeof(dev->error), "%s", derr.msg);
    }
out:
    if (seqs)
        for (int b = 0; b < B; b++)
            rekv_pseq_free(seqs[b]);
    free(seqs);
    free(items);
    cli_session_close(&ses);
    return rc;
}

/* The planner's prediction of run r's decode steps (step k at context S + k) beside what they
 * measured (their mean: measured, > 0), into o: "predicted_step_s" with the cached profile as it
 * is, "online_predicted_step_s" with it corrected by the run's steps before (rekv_plan_scales from
 * 1, updated by each step's busy times, as a served worker's planner corrects it), each a mean over
 * the steps, with its relative error against the measured mean, and the scales the run ended with.
 * infinigen and clo are priced at the fraction the run's selecting layers fetched. */
static void predict_run(const rekv_profile *pf, const rekv_model_config *c, const decode_result *r,
                        int B, int S, int N, double measured, json_t *o)
{
    rekv_plan_scales sc = {1, 1};
    rekv_cost_profile prof, now;
    rekv_profile_to_cost(pf, r->cfg.cache_dtype, &prof);
    double f = r->selected > 0 ? r->selected : REKV_PLAN_INFINIGEN_PRIOR;
    double plain = 0, online = 0;
    rekv_pipeline_config at = r->cfg;
    for (int k = 0; k < N - 1; k++) {
        const double *st = r->step + (size_t)k * 3; /* compute, link busy, split */
        rekv_step_cost p0, p1;
        rekv_plan_scaled_profile(&prof, &sc, &now);
        at.split = (int)st[2];
        if (cli_plan_predict_step(&prof, c, &at, B, S + k, f > 1 ? 1 : f, &p0, NULL) ||
            cli_plan_predict_step(&now, c, &at, B, S + k, f > 1 ? 1 : f, &p1, NULL))
            return;
        plain += p0.t_step;
        online += p1.t_step;
        rekv_plan_scales_observe(&sc, st[1], p1.t_pcie, st[0], p1.t_compute);
    }
    plain /= N - 1, online /= N - 1;
    json_object_set_new(o, "predicted_step_s", json_real(plain));
    json_object_set_new(o, "prediction_error", json_real(plain / measured - 1));
    json_object_set_new(o, "online_predicted_step_s", json_real(online));
    json_object_set_new(o, "online_prediction_error", json_real(online / measured - 1));
    json_object_set_new(o, "scales",
                        json_pack("{s:f, s:f}", "pcie", sc.pcie, "compute", sc.compute));
}

enum { MAX_RUNS = 16 };

/* One run of --modes, as given: "kvpr", "kvpr@300", "offload+push", "auto", "offload:int4". */
typedef struct decode_spec {
    rekv_mode mode; /* "auto": the planner's pick, once made */
    int has_dtype;  /* "RUN:DTYPE": this run's cache dtype (else --cache-dtype's) */
    rekv_dtype dtype;
    int push;       /* "MODE+push": this run pushes (--push: every streaming run does) */
    int split;      /* "kvpr@L": this run's split; -1: --split's, or the planner's */
    int is_auto;    /* "auto": the planner picks the mode and the device part */
    char name[112]; /* the run as given ("kvpr@300"), "-2"... added when repeated */
    char why[256];  /* "auto": the planner's line on its pick */
} decode_spec;

typedef struct decode_opts {
    const char *model_path;
    long B, S, N, PB; /* batch, prompt length, gen length, prefill chunk */
    int json, approximate;
    cli_pipeline_opts po;
    decode_spec runs[MAX_RUNS];
    int n_runs;
} decode_opts;

static void decode_usage(FILE *f)
{
    fprintf(f, "usage: rekv bench decode --model PATH [--batch B] [--prompt-len S]\n"
               "                         [--gen-len N] [--modes "
               "resident,offload,kvpr+push,kvpr@300,auto,...]\n"
               "                         [--prefill-chunk T] [--approximate] [pipeline "
               "options] [--json]\n"
               "Prints JSON; progress goes to stderr (none with --json).\n"
               "Runs every mode on the same prompts in one process and prints its prefill\n"
               "time, decode tokens/s, its ratio to offload, host->device bytes per\n"
               "generated token, achieved host->device GB/s next to the link's peak\n"
               "measured in the same run (from pinned, kvstore-arena and pageable memory)\n"
               "and the busy fractions of compute and link. kvpr@L runs kvpr with split L\n"
               "(e.g. --modes kvpr,kvpr@300,kvpr@450 against the planner's), infinigen@L\n"
               "infinigen recomputing up to L of what it fetches. The planner's split is\n"
               "chosen again before each decode step from the profile as the run's steps\n"
               "corrected it, as a served worker's planner does (split_first: the one it\n"
               "started at, split: the last step's); RUN:DTYPE runs with\n"
               "that cache dtype (offload,offload:int4 side by side). auto runs what\n"
               "a served worker with --mode auto would: the mode the planner prices\n"
               "cheapest, with each sequence's first tokens kept on the device where the\n"
               "device has room for them but not for the whole cache (--device-memory on\n"
               "the cpu backend); with --approximate it may pick infinigen, as a worker\n"
               "started with --approximate may. --prefill-chunk T prefills at most T\n"
               "tokens of each prompt per step, as serving does (default: whole prompts in\n"
               "one step; a chunk needs less device memory for the prefill's rows, same\n"
               "tokens). A run that fails (a mode the device cannot hold) reports its\n"
               "error in its entry and the others still run; the exit status is 1 only\n"
               "when every run failed. Each run reports its peak resident memory.\n"
               "Pipeline options:\n" CLI_PIPELINE_USAGE
               "(--mode is ignored. --trace F with several runs writes one trace per run,\n"
               "F with the run's name before its extension: --trace t.json --modes\n"
               "offload,kvpr@300 writes t.offload.json and t.kvpr@300.json)\n");
}

/* --modes: the runs, each MODE, kvpr@SPLIT, infinigen@SPLIT or auto, optionally +push, then
 * optionally :DTYPE (its cache dtype); 0, or -1 with the one it cannot run named. */
static int decode_parse_runs(const char *modes, decode_opts *o)
{
    char *mdup = strdup(modes), *save = NULL;
    o->n_runs = 0;
    for (char *t = strtok_r(mdup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        decode_spec *sp = &o->runs[o->n_runs < MAX_RUNS ? o->n_runs : MAX_RUNS - 1];
        char run_name[96];
        snprintf(run_name, sizeof(run_name), "%s", t);
        char *colon = strchr(t, ':');
        int bad = 0;
        sp->has_dtype = colon != NULL;
        if (colon) {
            *colon = '\0';
            bad |= rekv_cache_dtype_parse(colon + 1, &sp->dtype) != 0;
        }
        char *plus = strchr(t, '+'), *at = strchr(t, '@'), *end = NULL;
        int push = plus != NULL && strcmp(plus, "+push") == 0;
        bad |= plus && !push;
        if (plus)
            *plus = '\0';
        long split = -1;
        if (at) {
            *at = '\0';
            split = strtol(at + 1, &end, 10);
            bad |= end == at + 1 || *end || split < 0 || split > INT32_MAX;
        }
        sp->is_auto = strcmp(t, "auto") == 0 && !at;
        if (sp->is_auto)
            sp->mode = REKV_MODE_OFFLOAD; /* until the planner picks */
        if (o->n_runs == MAX_RUNS || bad || (!sp->is_auto && rekv_mode_parse(t, &sp->mode)) ||
            (push && !rekv_mode_streams(sp->mode)) ||
            (at && rekv_mode_info_of(sp->mode)->split == REKV_SPLIT_NONE)) {
            fprintf(stderr,
                    "rekv bench decode: --modes: unknown or too many runs (\"%s\"; MODE, "
                    "kvpr@SPLIT, infinigen@SPLIT or auto, each optionally +push and :f32, :f16, "
                    ":int8 or :int4, at most %d; resident never pushes)\n",
                    run_name, MAX_RUNS);
            free(mdup);
            return -1;
        }
        sp->push = push || (o->po.cfg.push && rekv_mode_streams(sp->mode));
        sp->split = (int)split;
        int seen = 1;
        for (int k = 0; k < o->n_runs; k++)
            seen += strncmp(o->runs[k].name, run_name, strlen(run_name)) == 0 &&
                    (o->runs[k].name[strlen(run_name)] == '\0' ||
                     o->runs[k].name[strlen(run_name)] == '-');
        if (seen > 1)
            snprintf(sp->name, sizeof(sp->name), "%s-%d", run_name, seen);
        else
            snprintf(sp->name, sizeof(sp->name), "%s", run_name);
        o->n_runs++;
    }
    free(mdup);
    return 0;
}

static int decode_parse(int argc, char **argv, decode_opts *o)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"batch", required_argument, 0, 'b'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"gen-len", required_argument, 0, 'g'},
                                         {"modes", required_argument, 0, 'M'},
                                         {"prefill-chunk", required_argument, 0, 'P'},
                                         {"json", no_argument, 0, 'j'},
                                         {"approximate", no_argument, 0, 'A'},
                                         {"help", no_argument, 0, 'h'},
                                         CLI_PIPELINE_OPTIONS,
                                         {0, 0, 0, 0}};
    const char *modes = "resident,offload,kvpr,act,hybrid";
    memset(o, 0, sizeof(*o));
    o->B = 8, o->S = 128, o->N = 8, o->PB = 0;
    cli_pipeline_opts_defaults(&o->po);
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int pr = cli_parse_pipeline_opt(c, optarg, &o->po);
        if (pr < 0)
            return 2;
        if (pr > 0)
            continue;
        switch (c) {
        case 'm':
            o->model_path = optarg;
            break;
        case 'b':
            if (cli_parse_int("batch", optarg, 1, 4096, &o->B))
                return 2;
            break;
        case 'p':
            if (cli_parse_int("prompt-len", optarg, 1, 1 << 20, &o->S))
                return 2;
            break;
        case 'g':
            if (cli_parse_int("gen-len", optarg, 2, 1 << 20, &o->N))
                return 2;
            break;
        case 'M':
            modes = optarg;
            break;
        case 'P':
            if (cli_parse_int("prefill-chunk", optarg, 1, 1 << 20, &o->PB))
                return 2;
            break;
        case 'j':
            o->json = 1; /* JSON is the only output; --json also keeps stderr quiet */
            break;
        case 'A':
            o->approximate = 1;
            break;
        case 'h':
            decode_usage(stdout);
            return 0;
        default:
            decode_usage(stderr);
            return 2;
        }
    }
    if (cli_no_operands(argc, argv)) {
        decode_usage(stderr);
        return 2;
    }
    if (o->model_path == NULL) {
        fprintf(stderr, "rekv bench decode: --model is required\n");
        return 2;
    }
    if (o->PB == 0 || o->PB > o->S) /* whole prompts in one prefill step */
        o->PB = o->S;
    return decode_parse_runs(modes, o) ? 2 : CLI_PARSED;
}

/* Run i failed: its error kept for its entry of the report, the other runs go on. */
static void decode_failed(const decode_opts *o, int i, decode_result *r, const char *why)
{
    snprintf(r->error, sizeof(r->error), "%s", why[0] ? why : "failed");
    if (!o->json)
        fprintf(stderr, "rekv bench decode: %s: %s (the other runs go on)\n", o->runs[i].name,
                r->error);
}

/* Every run of o in turn, into res[]: the link's peak measured after the first that uses the
 * kvstore (*have_lp), the device's after the first that runs. A run that fails keeps its error in
 * res[i].error and the next one runs. Returns the runs that succeeded, or -1 with a message
 * printed (a --trace path too long). */
static int decode_run_all(rekv_engine *eng, decode_opts *o, int32_t *const *prompts,
                          decode_result *res, link_peak *lp, int *have_lp, device_peak *dp)
{
    rekv_progress pr;
    int ok = 0, have_dp = 0;
    rekv_progress_begin(&pr, stderr, rekv_progress_style_for(stderr, o->json), "rekv bench decode",
                        "steps", (uint64_t)o->n_runs * (uint64_t)o->N);
    for (int i = 0; i < o->n_runs; i++) {
        rekv_err err = {0};
        decode_spec *sp = &o->runs[i];
        cli_pipeline_opts run = o->po;
        char trace[4400];
        if (o->po.trace && o->n_runs > 1) {
            if (cli_trace_path(o->po.trace, sp->name, trace, sizeof(trace))) {
                rekv_progress_end(&pr);
                fprintf(stderr, "rekv bench decode: --trace %s: path too long\n", o->po.trace);
                return -1;
            }
            run.trace = trace;
        }
        cli_peak_rss_reset(); /* the run's own peak where the kernel allows */
        if (sp->has_dtype)
            run.cfg.cache_dtype = sp->dtype;
        if (sp->is_auto) { /* what a served worker with --mode auto would run as */
            if (cli_session_auto(eng, &run, (int)o->B, (int)(o->S + o->N), o->approximate, &run.cfg,
                                 sp->why, sizeof(sp->why), &err)) {
                decode_failed(o, i, &res[i], err.msg);
                continue;
            }
            sp->mode = run.cfg.mode;
            sp->push = sp->push && rekv_mode_streams(sp->mode);
            if (!o->json)
                fprintf(stderr, "rekv bench decode: auto: %s\n", sp->why);
        }
        int measure = !*have_lp && rekv_mode_streams(sp->mode);
        run.cfg.push = sp->push;
        if (sp->split >= 0)
            run.cfg.split = sp->split;
        if (run_decode(eng, &run, sp->mode, (int)o->B, (int)o->S, (int)o->N, (int)o->PB, prompts,
                       &res[i], measure ? lp : NULL, have_dp ? NULL : dp, &pr,
                       (uint64_t)i * (uint64_t)o->N, sp->name, &err)) {
            decode_failed(o, i, &res[i], err.msg);
            continue;
        }
        *have_lp |= measure && !lp->error[0]; /* else a later run tries again */
        have_dp = 1;
        ok++;
    }
    rekv_progress_end(&pr);
    return ok;
}

/* What every run's report is measured against: the runs' shared yardsticks. */
typedef struct decode_refs {
    double offload_tps;     /* offload's decode tokens/s (pull's when both ran), 0: none ran */
    int resident;           /* the resident run, -1: none */
    const rekv_profile *pf; /* this machine's profile, NULL: none */
    const link_peak *lp;    /* NULL: not measured */
    const char *lp_error;   /* why not, where a run tried ("": none did) */
    const device_peak *dp;
} decode_refs;

/* Run r's yardsticks (issue 15's): the prefill's FLOP/s against the engine's GEMM on its shapes,
 * resident decode against the memory roofline (the weights and the KV each step reads, at the
 * device copy's rate), host->device GB/s over the decode (all kinds) and while the link was busy
 * (not for push: the store's copies of KV rows do not show in the worker's link busy time). */
static void decode_yardsticks(const rekv_engine *eng, const decode_opts *o, const decode_spec *sp,
                              const decode_result *r, const decode_refs *ref, uint64_t h2d,
                              double measured, json_t *m)
{
    const rekv_model_config *cfg = rekv_engine_config(eng);
    long B = o->B, S = o->S, N = o->N, PB = o->PB;
    double pre_flops = rekv_engine_flops(eng, (double)B * S, (double)B * S * (S + 1) / 2,
                                         (double)B * (double)((S + PB - 1) / PB));
    json_object_set_new(m, "prefill_flops_per_s", json_real(pre_flops / r->prefill_s));
    if (ref->dp->gemm_flops > 0)
        json_object_set_new(m, "prefill_vs_gemm",
                            json_real(pre_flops / r->prefill_s / ref->dp->gemm_flops));
    if (!rekv_mode_streams(sp->mode) && !r->cfg.offload_weights && ref->dp->copy_gbps > 0 &&
        measured > 0) {
        double kv_row = 2.0 * cfg->n_layers * rekv_config_kv_dim(cfg) *
                        rekv_kv_elem_bytes(r->cfg.cache_dtype, cfg->head_dim),
               bytes = 0;
        for (long k = 0; k + 1 < N; k++)
            bytes += (double)rekv_engine_step_weight_bytes(eng) + (double)B * (S + k + 1) * kv_row;
        double roof = bytes / (N - 1) / (ref->dp->copy_gbps * 1e9);
        json_object_set_new(m, "roofline_step_s", json_real(roof));
        json_object_set_new(m, "roofline_frac", json_real(roof / measured));
    }
    json_object_set_new(m, "h2d_gbps", json_real((double)h2d / r->decode_s * 1e-9));
    /* rows the cuda backend's gather kernel read from the registered arena (prefill too) */
    json_object_set_new(m, "h2d_gathered_rows", json_integer((json_int_t)r->gathered));
    json_object_set_new(m, "graph_steps", json_integer((json_int_t)r->graph_steps));
    /* how often a step's caller blocked on the device (the drain at its end, and any wait
     * within: infinigen's per unit; clo's none, CLO §4.4) */
    json_object_set_new(m, "host_syncs_per_step",
                        json_real(N > 1 ? (double)r->host_syncs / (N - 1) : 0));
    if (r->h2d_busy_s > 0 && !sp->push)
        json_object_set_new(m, "h2d_gbps_while_busy",
                            json_real((double)h2d / r->h2d_busy_s * 1e-9));
    if (ref->lp && ref->lp->pinned_gbps > 0)
        json_object_set_new(m, "h2d_vs_pinned_peak",
                            json_real((double)h2d / r->decode_s * 1e-9 / ref->lp->pinned_gbps));
}

/* The decode steps' spill reads: a pin waited for them (critical) or not (ahead). */
static json_t *decode_spill_json(const decode_result *r)
{
    const rekv_kv_stats *a = &r->ks0, *z = &r->ks1;
    return json_pack("{s:I, s:I, s:I, s:I, s:I, s:I}", "arena_bytes", (json_int_t)z->host_bytes,
                     "read_back_bytes", (json_int_t)(z->bytes_read_back - a->bytes_read_back),
                     "spilled_bytes", (json_int_t)(z->bytes_spilled - a->bytes_spilled),
                     "critical_blocks", (json_int_t)(z->pin_wait_blocks - a->pin_wait_blocks),
                     "ahead_blocks", (json_int_t)(z->read_ahead_blocks - a->read_ahead_blocks),
                     "critical_bytes", (json_int_t)(z->pin_wait_bytes - a->pin_wait_bytes));
}

/* Run i's entry of "modes". */
static json_t *decode_run_json(const rekv_engine *eng, const decode_opts *o, int i,
                               const decode_result *res, const decode_refs *ref)
{
    const rekv_model_config *cfg = rekv_engine_config(eng);
    const decode_spec *sp = &o->runs[i];
    const decode_result *r = &res[i];
    long B = o->B, S = o->S, N = o->N;
    if (r->error[0]) /* what it was asked to be, and why it did not run */
        return json_pack("{s:s, s:s, s:b, s:s}", "mode",
                         sp->is_auto ? "auto" : rekv_mode_name(sp->mode), "run", sp->name, "push",
                         sp->push, "error", r->error);
    double toks = (double)B * (N - 1), tps = toks / r->decode_s; /* tokens of decode steps */
    uint64_t h2d = 0;
    for (int k = 0; k < REKV_XFER_KINDS; k++)
        h2d += r->counters.h2d_bytes[k];
    json_t *m =
        json_pack("{s:s, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:I, s:I}", "mode",
                  rekv_mode_name(sp->mode), "decode_s", r->decode_s, "decode_tokens_per_s", tps,
                  "h2d_bytes_per_token", (double)h2d / toks, "h2d_kv_bytes_per_token",
                  (double)r->counters.h2d_bytes[REKV_XFER_KV] / toks, "h2d_act_bytes_per_token",
                  (double)r->counters.h2d_bytes[REKV_XFER_ACT] / toks, "h2d_weight_bytes_per_token",
                  (double)r->counters.h2d_bytes[REKV_XFER_WEIGHTS] / toks, "compute_busy_frac",
                  r->compute_busy_s / r->decode_s, "link_busy_frac", r->h2d_busy_s / r->decode_s,
                  "tokens_recomputed", (json_int_t)r->counters.tokens_recomputed, "tokens_fetched",
                  (json_int_t)r->counters.tokens_fetched);
    json_object_set_new(m, "push", json_boolean(sp->push));
    json_object_set_new(m, "run", json_string(sp->name));
    json_object_set_new(m, "cache_dtype", json_string(rekv_dtype_name(r->cfg.cache_dtype)));
    json_object_set_new(m, "peak_rss_bytes", json_integer((json_int_t)r->peak_rss));
    if (sp->is_auto)
        json_object_set_new(m, "auto", json_string(sp->why));
    json_object_set_new(m, "device_tokens", json_integer(r->cfg.device_tokens));
    json_object_set_new(m, "tokens_device", json_integer((json_int_t)r->counters.tokens_device));
    /* the generated ids' CRC32C: runs compare across invocations too */
    json_object_set_new(
        m, "tokens_crc32c",
        json_integer(rekv_crc32c(0, r->tokens, sizeof(int32_t) * (size_t)B * (size_t)N)));
    double measured = N > 1 ? r->decode_s / (N - 1) : 0;
    json_object_set_new(m, "measured_step_s", json_real(measured));
    if (ref->pf && measured > 0)
        predict_run(ref->pf, cfg, r, (int)B, (int)S, (int)N, measured, m);
    json_object_set_new(m, "prefill_s", json_real(r->prefill_s));
    if (r->has_store && r->ks1.bytes_read_back > r->ks0.bytes_read_back)
        json_object_set_new(m, "spill", decode_spill_json(r));
    json_object_set_new(m, "prefill_tokens_per_s", json_real((double)B * S / r->prefill_s));
    decode_yardsticks(eng, o, sp, r, ref, h2d, measured, m);
    if (ref->offload_tps > 0)
        json_object_set_new(m, "ratio_vs_offload", json_real(tps / ref->offload_tps));
    if (rekv_pipeline_keeps_act(&r->cfg)) {
        json_object_set_new(m, "split", json_integer(r->cfg.split));
        json_object_set_new(m, "split_first", json_integer(r->split_first));
    }
    if (rekv_mode_info_of(sp->mode)->store == REKV_STORE_PATTERN)
        json_object_set_new(m, "ratio", json_pack("[i, i]", r->cfg.kv_parts, r->cfg.act_parts));
    if (rekv_mode_info_of(sp->mode)->head_caches) {
        uint64_t hits = r->counters.head_hits, hm = hits + r->counters.head_misses;
        json_object_set_new(m, "head_hits", json_integer((json_int_t)hits));
        json_object_set_new(m, "head_misses", json_integer((json_int_t)(hm - hits)));
        json_object_set_new(m, "hit_ratio", json_real(hm ? (double)hits / (double)hm : 0.0));
    }
    if (ref->resident >= 0 && r->cfg.cache_dtype == res[ref->resident].cfg.cache_dtype)
        json_object_set_new(m, "tokens_match_resident",
                            json_boolean(memcmp(r->tokens, res[ref->resident].tokens,
                                                sizeof(int32_t) * (size_t)B * N) == 0));
    return m;
}

/* The whole report: the shape, the runs, the prompts' checksum and the peaks measured. */
static json_t *decode_report(const rekv_engine *eng, const decode_opts *o, json_t *runs,
                             int32_t *const *prompts, const decode_result *res,
                             const decode_refs *ref)
{
    const rekv_model_config *cfg = rekv_engine_config(eng);
    const cli_pipeline_opts *po = &o->po;
    const char *backend = po->backend; /* the first run's that ran, else the one asked for */
    unsigned long long rss = 0;
    for (int i = o->n_runs - 1; i >= 0; i--) {
        if (res[i].backend[0])
            backend = res[i].backend;
        rss = res[i].peak_rss > rss ? res[i].peak_rss : rss;
    }
    json_t *out = json_pack(
        "{s:s, s:s, s:{s:i, s:i, s:i, s:i, s:i, s:i}, s:i, s:i, s:i, s:f, s:f, s:b, s:s, "
        "s:i, s:s, s:o}",
        "bench", "decode", "backend", backend, "model", "layers", cfg->n_layers, "hidden",
        cfg->hidden, "heads", cfg->n_heads, "kv_heads", cfg->n_kv_heads, "ffn", cfg->ffn, "vocab",
        cfg->vocab, "batch", (int)o->B, "prompt_len", (int)o->S, "gen_len", (int)o->N, "link_gbps",
        po->link.gbps, "link_latency_us", po->link.latency_us, "offload_weights",
        po->cfg.offload_weights, "schedule", po->cfg.schedule == REKV_SCHED_ROW ? "row" : "column",
        "gpu_batches", po->cfg.gpu_batches, "cache_dtype", rekv_dtype_name(po->cfg.cache_dtype),
        "modes", runs);
    json_object_set_new(out, "push", json_boolean(po->cfg.push));
    /* the largest of the runs' peaks: the weights, the KV and the scratch of the biggest */
    json_object_set_new(out, "peak_rss_bytes", json_integer((json_int_t)rss));
    /* the prompts' CRC32C (int32 ids, prompt after prompt): deploy/hf_bench.py prints its own */
    uint32_t pcrc = 0;
    for (long b = 0; b < o->B; b++)
        pcrc = rekv_crc32c(pcrc, prompts[b], sizeof(int32_t) * (size_t)o->S);
    json_object_set_new(out, "prompts_crc32c", json_integer(pcrc));
    json_object_set_new(out, "weight_dtype",
                        json_string(rekv_dtype_name(rekv_engine_weight_dtype(eng))));
    const device_peak *dp = ref->dp;
    if (dp->error[0])
        json_object_set_new(out, "device_peak", json_pack("{s:s}", "error", dp->error));
    else if (dp->copy_gbps > 0)
        json_object_set_new(out, "device_peak",
                            json_pack("{s:I, s:f, s:i, s:f}", "copy_bytes",
                                      (json_int_t)dp->copy_bytes, "copy_gbps", dp->copy_gbps,
                                      "gemm_rows", dp->gemm_rows, "gemm_flops_per_s",
                                      dp->gemm_flops));
    if (!ref->lp && ref->lp_error[0])
        json_object_set_new(out, "link_peak", json_pack("{s:s}", "error", ref->lp_error));
    else if (ref->lp)
        json_object_set_new(out, "link_peak",
                            json_pack("{s:I, s:f, s:f, s:f}", "copy_bytes",
                                      (json_int_t)ref->lp->bytes, "h2d_gbps_pinned",
                                      ref->lp->pinned_gbps, "h2d_gbps_arena", ref->lp->arena_gbps,
                                      "h2d_gbps_pageable", ref->lp->pageable_gbps));
    return out;
}

/* Prints the report of the runs in res. */
static void decode_print(const rekv_engine *eng, const decode_opts *o, int32_t *const *prompts,
                         const decode_result *res, const link_peak *lp, int have_lp,
                         const device_peak *dp)
{
    decode_refs ref = {.resident = -1, .lp = have_lp ? lp : NULL, .lp_error = lp->error, .dp = dp};
    for (int i = 0; i < o->n_runs; i++) {
        /* the yardsticks, by name: offload is the baseline (README's ratios), resident the
         * reference of every exact mode's tokens; a run that failed is neither */
        if (res[i].error[0])
            continue;
        /* the yardsticks run at --cache-dtype: a RUN:DTYPE run is measured against them */
        if (o->runs[i].has_dtype && o->runs[i].dtype != o->po.cfg.cache_dtype)
            continue;
        if (o->runs[i].mode == REKV_MODE_OFFLOAD && (ref.offload_tps == 0 || !o->runs[i].push))
            ref.offload_tps = (double)o->B * (o->N - 1) / res[i].decode_s; /* pull's when both */
        if (o->runs[i].mode == REKV_MODE_RESIDENT)
            ref.resident = i;
    }
    /* the planner's prediction of each run's decode steps, beside the measured ones (the profile is
     * this machine's, cached; measured once when missing): the profile's own, and the profile
     * corrected online by the run's steps before each one, as a served worker's planner corrects
     * it (a worker's mode is fixed for its life: each run starts from the profile) */
    rekv_profile pf;
    rekv_err perr = {0};
    if (rekv_profile_get(rekv_engine_config(eng), o->po.backend, &o->po.link, NULL, 0, &pf, NULL,
                         &perr) == 0)
        ref.pf = &pf;
    json_t *arr = json_array();
    for (int i = 0; i < o->n_runs; i++)
        json_array_append_new(arr, decode_run_json(eng, o, i, res, &ref));
    json_t *out = decode_report(eng, o, arr, prompts, res, &ref);
    char *str = json_dumps(out, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", str);
    free(str);
    json_decref(out);
}

int cli_bench_decode(int argc, char **argv)
{
    decode_opts *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        fprintf(stderr, "rekv bench decode: out of memory\n");
        return 1;
    }
    int rc = decode_parse(argc, argv, o);
    if (rc != CLI_PARSED) {
        free(o);
        return rc;
    }
    rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    int32_t **prompts = NULL;
    decode_result res[MAX_RUNS];
    memset(res, 0, sizeof(res));
    if (rekv_model_open(o->model_path, &model, &err) || rekv_engine_create(model, &eng, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        goto out;
    }
    const rekv_model_config *cfg = &model->config;
    if (o->S + o->N > cfg->max_pos) {
        fprintf(stderr, "rekv bench decode: prompt-len + gen-len exceeds the context (%d)\n",
                cfg->max_pos);
        goto out;
    }
    prompts = calloc((size_t)o->B, sizeof(*prompts));
    uint64_t x = 777;
    for (long b = 0; prompts && b < o->B; b++) {
        if ((prompts[b] = malloc(sizeof(int32_t) * (size_t)o->S)) == NULL)
            break;
        cli_random_tokens(&x, prompts[b], (size_t)o->S, cfg->vocab);
    }
    if (prompts == NULL || prompts[o->B - 1] == NULL) {
        fprintf(stderr, "rekv bench decode: out of memory\n");
        goto out;
    }
    link_peak lp = {0};
    device_peak dp = {0};
    int have_lp = 0;
    int ok = decode_run_all(eng, o, prompts, res, &lp, &have_lp, &dp);
    if (ok < 0)
        goto out;
    decode_print(eng, o, prompts, res, &lp, have_lp, &dp);
    rc = ok > 0 ? 0 : 1; /* every run failed: nothing measured */
out:
    for (int i = 0; i < o->n_runs; i++)
        free(res[i].tokens), free(res[i].step);
    if (prompts)
        for (long b = 0; b < o->B; b++)
            free(prompts[b]);
    free(prompts);
    rekv_engine_free(eng);
    rekv_model_close(model);
    free(o);
    return rc;
}
