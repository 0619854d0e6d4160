/* cli_eval.c — `rekv eval`: the fidelity of a mode, measured the way the papers measure it:
 * teacher-forced negative log-likelihood of a text under the model running in that mode, with the
 * bytes the mode moved and, with --compare resident, how often its greedy choice agrees with the
 * all-resident pipeline's and by how much its logits differ.
 *
 * Decode-style, so that the mode's fetch path is the one measured: a window's first --prefill
 * tokens go in as one prefill step, then every further token is a decode step of its own, and the
 * logits of a decode step at position p score token p + 1 (../shared/eval/README.md: mean over
 * p = prefill .. n-2 of -log softmax(logits_p)[ids[p+1]]). A text longer than the window (the
 * model's context, or --window) is scored in windows: the next window starts --prefill + 1 tokens
 * before the previous one ended, so its prefill is context already scored and its first decode
 * step scores the first token the previous window could not; every token after the first
 * prefill + 1 is scored exactly once. Each window is a fresh sequence.
 *
 * kv_bytes_offload and tokens_considered are what `offload` moves for the same decode steps: every
 * context token's K and V, every layer. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/progress.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_session.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/premises.h"
#include "loader/loader.h"

static void usage(FILE *f)
{
    fprintf(
        f, "usage: rekv eval --model PATH (--text FILE | --ids FILE) [--prefill N] [--window N]\n"
           "                 [--compare resident] [--json] [pipeline options]\n"
           "Teacher-forced NLL of the text under the model in the given mode: the first --prefill\n"
           "tokens (default 32) of each window are a prefill step, every later token a decode\n"
           "step whose logits score the next token. --ids FILE: a JSON array of token ids (for\n"
           "models without a tokenizer). --window N: windows of N tokens (default: the model's\n"
           "context). --compare resident: also run the all-resident pipeline in step and report\n"
           "the agreement of the greedy choices and the largest logit difference. --bounds\n"
           "(infinigen): also run, in step, its selection at random and by exact scores, each\n"
           "at the same budget, and report their NLL and the share of the gap between them\n"
           "that the speculation closes.\n"
           "Pipeline options:\n" CLI_PIPELINE_USAGE);
}

/* -log softmax(logits)[target], in double. */
static double nll_of(const float *logits, int vocab, int target)
{
    double mx = logits[0];
    for (int i = 1; i < vocab; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    double s = 0;
    for (int i = 0; i < vocab; i++)
        s += exp((double)logits[i] - mx);
    return mx + log(s) - (double)logits[target];
}

/* One pipeline evaluated in step: its sequence and the logits of its last step. */
/* The runs eval keeps in step, by role: the mode, and what it is compared with. */
enum { RUN_MODE, RUN_RESIDENT, RUN_RANDOM, RUN_EXACT, N_RUNS };

typedef struct eval_run {
    int on;
    cli_session ses;
    rekv_pseq *seq;
    float *logits; /* [vocab] */
} eval_run;

static int run_step(eval_run *r, const int32_t *tokens, int n, rekv_err *err)
{
    rekv_pipe_item it = {.seq = r->seq, .tokens = tokens, .n_tokens = n, .logits = r->logits};
    return rekv_pipeline_step(r->ses.p, &it, 1, err);
}

typedef struct eval_opts {
    cli_pipeline_opts po;
    const char *model_path, *text_path, *ids_path;
    long prefill, window; /* window 0: the model's context */
    int json, compare;    /* compare: --compare resident */
    int bounds;           /* --bounds: infinigen's random and exact selections in step */
} eval_opts;

static int eval_parse(int argc, char **argv, eval_opts *o)
{
    enum { O_MODEL = 1, O_TEXT, O_IDS, O_PREFILL, O_WINDOW, O_COMPARE, O_BOUNDS, O_JSON, O_HELP };
    static const struct option opts[] = {{"model", required_argument, 0, O_MODEL},
                                         {"text", required_argument, 0, O_TEXT},
                                         {"ids", required_argument, 0, O_IDS},
                                         {"prefill", required_argument, 0, O_PREFILL},
                                         {"window", required_argument, 0, O_WINDOW},
                                         {"compare", required_argument, 0, O_COMPARE},
                                         {"bounds", no_argument, 0, O_BOUNDS},
                                         {"json", no_argument, 0, O_JSON},
                                         {"help", no_argument, 0, O_HELP},
                                         CLI_PIPELINE_OPTIONS,
                                         {0, 0, 0, 0}};
    memset(o, 0, sizeof(*o));
    cli_pipeline_opts_defaults(&o->po);
    o->prefill = 32;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int pr = cli_parse_pipeline_opt(c, optarg, &o->po);
        if (pr < 0)
            return 2;
        if (pr > 0)
            continue;
        switch (c) {
        case O_MODEL:
            o->model_path = optarg;
            break;
        case O_TEXT:
            o->text_path = optarg;
            break;
        case O_IDS:
            o->ids_path = optarg;
            break;
        case O_PREFILL:
            if (cli_parse_int("prefill", optarg, 1, 1 << 20, &o->prefill))
                return 2;
            break;
        case O_WINDOW:
            if (cli_parse_int("window", optarg, 3, 1 << 24, &o->window))
                return 2;
            break;
        case O_COMPARE:
            if (strcmp(optarg, "resident") != 0) {
                fprintf(stderr, "rekv eval: --compare %s: only resident can be compared with\n",
                        optarg);
                return 2;
            }
            o->compare = 1;
            break;
        case O_BOUNDS:
            o->bounds = 1;
            break;
        case O_JSON:
            o->json = 1;
            break;
        case O_HELP:
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (cli_no_operands(argc, argv) || o->model_path == NULL ||
        (o->text_path == NULL) == (o->ids_path == NULL)) {
        usage(stderr);
        return 2;
    }
    if (o->bounds && o->po.cfg.mode != REKV_MODE_INFINIGEN) {
        fprintf(stderr, "rekv eval: --bounds needs --mode infinigen (it runs infinigen's random "
                        "and exact selections beside it)\n");
        return 2;
    }
    return CLI_PARSED;
}

/* The text's token ids (--ids, or --text through the model's tokenizer), each in the vocabulary;
 * *ids malloc'd. */
static int eval_read_ids(const eval_opts *o, const rekv_model_config *cfg, int32_t **ids, size_t *n,
                         rekv_err *err)
{
    int rc;
    if (o->ids_path) {
        if ((rc = cli_read_ids(o->ids_path, ids, n, err)))
            return rc;
    } else {
        rekv_tokenizer *tok = NULL;
        char *text = NULL;
        size_t len = 0;
        rc = rekv_tokenizer_load_for_model(o->model_path, &tok, err);
        if (rc == -ENOENT) {
            rekv_err_clear(err); /* the loader's line names the file it looked for */
            return rekv_errf(err, rc, "%s has no tokenizer; give the text as --ids", o->model_path);
        }
        if (rc == 0 && (rc = cli_read_text(o->text_path, &text, &len, err)) == 0)
            rc =
                rekv_tokenizer_encode(tok, text, len, cfg->add_bos ? cfg->bos_id : -1, ids, n, err);
        free(text);
        rekv_tokenizer_free(tok);
        if (rc)
            return rc;
    }
    for (size_t i = 0; i < *n; i++)
        if ((*ids)[i] >= cfg->vocab)
            return rekv_errf(err, -EINVAL, "token id %d (at %zu) is outside the vocabulary (0..%d)",
                             (*ids)[i], i, cfg->vocab - 1);
    return 0;
}

/* What the windows scored. */
typedef struct eval_tally {
    double nll_sum, max_err, secs;
    double nll_run[N_RUNS]; /* each run's, summed */
    uint64_t scored, agree, windows;
    uint64_t kv_offload, considered; /* what offload would move and consider */
} eval_tally;

/* Scores ids[0..n) in windows of w tokens through the runs that are on, in step, as the file's
 * opening says. */
static int eval_windows(eval_run *runs, const int32_t *ids, size_t n, long prefill,
                        long w, const rekv_model_config *cfg, rekv_progress *prog, eval_tally *t,
                        rekv_err *err)
{
    const rekv_pipeline_config *pc = rekv_pipeline_get_config(runs[0].ses.p);
    uint64_t kv_row =
        2ull * (uint64_t)cfg->n_kv_heads * rekv_kv_row_bytes(pc->cache_dtype, cfg->head_dim);
    int rc;
    for (size_t s = 0;;) {
        t->windows++;
        size_t e = s + (size_t)w < n ? s + (size_t)w : n; /* this window: ids[s .. e) */
        for (int r = 0; r < N_RUNS; r++)
            if (runs[r].on &&
                (rc = rekv_pseq_create(runs[r].ses.p, (int)(e - s), &runs[r].seq, err)))
                return rc;
        for (int r = 0; r < N_RUNS; r++)
            if (runs[r].on && (rc = run_step(&runs[r], ids + s, (int)prefill, err)))
                return rc;
        for (size_t p = s + (size_t)prefill; p + 1 < e; p++) {
            for (int r = 0; r < N_RUNS; r++)
                if (runs[r].on && (rc = run_step(&runs[r], ids + p, 1, err)))
                    return rc;
            for (int r = 0; r < N_RUNS; r++)
                if (runs[r].on)
                    t->nll_run[r] += nll_of(runs[r].logits, cfg->vocab, ids[p + 1]);
            t->nll_sum = t->nll_run[RUN_MODE];
            t->scored++;
            uint64_t ctx = p - s; /* context tokens before this step's */
            t->kv_offload += ctx * kv_row * (uint64_t)cfg->n_layers;
            t->considered += ctx * (uint64_t)cfg->n_layers;
            if (runs[RUN_RESIDENT].on) {
                t->agree += rekv_argmax(runs[0].logits, cfg->vocab) ==
                            rekv_argmax(runs[RUN_RESIDENT].logits, cfg->vocab);
                for (int i = 0; i < cfg->vocab; i++) {
                    double d = fabs((double)runs[0].logits[i] -
                                    (double)runs[RUN_RESIDENT].logits[i]);
                    t->max_err = d > t->max_err ? d : t->max_err;
                }
            }
            char note[48];
            snprintf(note, sizeof(note), "nll %.4f", t->nll_sum / (double)t->scored);
            rekv_progress_update(prog, t->scored, note);
        }
        for (int r = 0; r < N_RUNS; r++) {
            rekv_pseq_free(runs[r].seq);
            runs[r].seq = NULL;
        }
        if (e >= n)
            return 0;
        s = e - (size_t)prefill - 1;
    }
}

/* infinigen's and clo's knobs and what they fetched, per layer. */
static void eval_json_selection(json_t *o, const rekv_pipeline *p, const rekv_model_config *cfg)
{
    const rekv_pipeline_config *pc = rekv_pipeline_get_config(p);
    static const char *const sel[] = {"speculate", "random", "all"};
    json_t *fr = json_array();
    const rekv_layer_counters *lc = rekv_pipeline_counters(p, NULL);
    for (int l = 0; fr && l < cfg->n_layers; l++)
        json_array_append_new(
            fr, json_real(lc[l].tokens_considered
                              ? (double)lc[l].tokens_fetched / (double)lc[l].tokens_considered
                              : 0.0));
    json_object_set_new(o, "alpha", isinf(pc->alpha) ? json_null() : json_real(pc->alpha));
    json_object_set_new(o, "fetch_cap", json_real(pc->max_fraction));
    json_object_set_new(o, "select", json_string(sel[pc->select]));
    json_object_set_new(o, "lookahead", json_integer(pc->lookahead));
    json_object_set_new(o, "partial_columns",
                        json_pack("[i, i]", pc->skew->rk, pc->skew->head_dim));
    json_object_set_new(o, "layer_fetched_fraction", fr);
    if (pc->kv_pool_bytes > 0) { /* InfiniGen's pool limit, and whose entries it evicts */
        json_object_set_new(o, "kv_pool_bytes", json_integer((json_int_t)pc->kv_pool_bytes));
        json_object_set_new(
            o, "kv_pool_policy",
            json_string(pc->kv_pool_policy == REKV_KV_POOL_FIFO ? "fifo" : "counter"));
    }
}

/* clo's knobs and its head cache: hits and misses, and per layer and KV head the hit ratio. */
static void eval_json_clo(json_t *o, const rekv_pipeline *p, const rekv_model_config *cfg,
                          const rekv_layer_counters *tot)
{
    const rekv_pipeline_config *pc = rekv_pipeline_get_config(p);
    uint64_t hm = tot->head_hits + tot->head_misses;
    json_object_set_new(o, "eta", json_real(pc->eta));
    json_object_set_new(o, "power", json_real(pc->power));
    json_object_set_new(o, "persist_np",
                        isinf(pc->persist_np) ? json_null() : json_real(pc->persist_np));
    json_object_set_new(o, "head_hits", json_integer((json_int_t)tot->head_hits));
    json_object_set_new(o, "head_misses", json_integer((json_int_t)tot->head_misses));
    json_object_set_new(o, "hit_ratio", json_real(hm ? (double)tot->head_hits / hm : 0.0));
    /* per layer and KV head; null where nothing was decided (layer 0, persistent) */
    const uint64_t *hh, *hmiss;
    json_t *hr = json_array();
    if (hr && rekv_pipeline_head_cache_counts(p, &hh, &hmiss) == 0)
        for (int l = 0; l < cfg->n_layers; l++) {
            json_t *row = json_array();
            for (int g = 0; row && g < cfg->n_kv_heads; g++) {
                size_t at = (size_t)l * (size_t)cfg->n_kv_heads + (size_t)g;
                uint64_t dec = hh[at] + hmiss[at];
                json_array_append_new(row,
                                      dec ? json_real((double)hh[at] / (double)dec) : json_null());
            }
            json_array_append_new(hr, row);
        }
    json_object_set_new(o, "head_hit_ratio", hr);
}

/* [n] as a JSON array, NaN as null. */
static json_t *json_doubles(const double *v, int n)
{
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++)
        json_array_append_new(a, isnan(v[i]) ? json_null() : json_real(v[i]));
    return a;
}

/* The mean of a premise's per-layer figure over the layers that have one. */
static double layer_mean(const double *v, int n)
{
    double s = 0;
    int k = 0;
    for (int l = 0; l < n; l++)
        if (!isnan(v[l]))
            s += v[l], k++;
    return k ? s / k : NAN;
}

/* The premises' figures per layer (premises.h), and their means over the layers that have one. */
static json_t *eval_json_premises(const rekv_premises *pm)
{
    json_t *o = json_object();
    int L = pm->n_layers;
    const struct {
        const char *name;
        const double *v;
    } f[] = {{"layer_input_cosine", pm->input_cos},
             {"speculated_query_cosine", pm->spec_q_cos},
             {"adjacent_query_cosine", pm->adj_q_cos},
             {"recall", pm->recall}};
    json_object_set_new(o, "steps", json_integer((json_int_t)pm->steps));
    for (size_t i = 0; o && i < sizeof(f) / sizeof(f[0]); i++) {
        char mean[64];
        snprintf(mean, sizeof(mean), "%s_mean", f[i].name);
        double m = layer_mean(f[i].v, L);
        json_object_set_new(o, f[i].name, json_doubles(f[i].v, L));
        json_object_set_new(o, mean, isnan(m) ? json_null() : json_real(m));
    }
    return o;
}

static int eval_print_json(const eval_opts *o, const eval_run *run, const rekv_model_config *cfg,
                           long w, const eval_tally *t, const rekv_premises *pm, rekv_err *err)
{
    const rekv_pipeline_config *pc = rekv_pipeline_get_config(run->ses.p);
    rekv_layer_counters tot;
    rekv_pipeline_counters(run->ses.p, &tot);
    double nll = t->nll_sum / (double)t->scored;
    json_t *j = json_pack(
        "{s:s, s:s, s:s, s:I, s:f, s:f, s:i, s:i, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f}", "model",
        o->model_path, "mode", rekv_mode_name(pc->mode), "backend", run->ses.be->iface->name,
        "tokens", (json_int_t)t->scored, "nll", nll, "ppl", exp(nll), "prefill", (int)o->prefill,
        "window", (int)w, "windows", (json_int_t)t->windows, "h2d_kv_bytes",
        (json_int_t)tot.h2d_bytes[REKV_XFER_KV], "h2d_act_bytes",
        (json_int_t)tot.h2d_bytes[REKV_XFER_ACT], "kv_bytes_offload", (json_int_t)t->kv_offload,
        "tokens_fetched", (json_int_t)tot.tokens_fetched, "tokens_considered",
        (json_int_t)t->considered, "tokens_recomputed", (json_int_t)tot.tokens_recomputed,
        "seconds", t->secs);
    if (j == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    if (rekv_pipeline_keeps_act(pc))
        json_object_set_new(j, "split", json_integer(pc->split));
    const rekv_mode_info *mi = rekv_mode_info_of(pc->mode);
    if (mi->store == REKV_STORE_PATTERN)
        json_object_set_new(j, "ratio", json_pack("[i, i]", pc->kv_parts, pc->act_parts));
    if (mi->speculates)
        eval_json_selection(j, run->ses.p, cfg);
    if (mi->head_caches)
        eval_json_clo(j, run->ses.p, cfg, &tot);
    if (pm->input_cos)
        json_object_set_new(j, "premises", eval_json_premises(pm));
    if (o->bounds) {
        double nr = t->nll_run[RUN_RANDOM] / (double)t->scored;
        double nx = t->nll_run[RUN_EXACT] / (double)t->scored;
        json_object_set_new(j, "nll_random", json_real(nr));
        json_object_set_new(j, "nll_exact", json_real(nx));
        json_object_set_new(j, "gap_closed", nr != nx ? json_real((nr - nll) / (nr - nx))
                                                      : json_null());
    }
    if (o->compare) {
        json_object_set_new(j, "agreement", json_real((double)t->agree / (double)t->scored));
        json_object_set_new(j, "max_logit_error", json_real(t->max_err));
    }
    char *s = json_dumps(j, JSON_REAL_PRECISION(17));
    json_decref(j);
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    printf("%s\n", s);
    free(s);
    return 0;
}

static void eval_print_text(const eval_opts *o, const eval_run *run, const eval_tally *t,
                            const rekv_premises *pm)
{
    const rekv_pipeline_config *pc = rekv_pipeline_get_config(run->ses.p);
    rekv_layer_counters tot;
    rekv_pipeline_counters(run->ses.p, &tot);
    double nll = t->nll_sum / (double)t->scored;
    printf("%s: %llu tokens scored in %llu windows, nll %.6f nats/token, ppl %.4f (%s mode, "
           "%.1f s)\n",
           o->model_path, (unsigned long long)t->scored, (unsigned long long)t->windows, nll,
           exp(nll), rekv_mode_name(pc->mode), t->secs);
    printf("KV host->device %llu bytes (offload would move %llu), ACT %llu bytes; tokens "
           "fetched %llu of %llu considered, %llu recomputed\n",
           (unsigned long long)tot.h2d_bytes[REKV_XFER_KV], (unsigned long long)t->kv_offload,
           (unsigned long long)tot.h2d_bytes[REKV_XFER_ACT], (unsigned long long)tot.tokens_fetched,
           (unsigned long long)t->considered, (unsigned long long)tot.tokens_recomputed);
    if (o->compare)
        printf("against resident: greedy agreement %.4f, largest logit difference %.3g\n",
               (double)t->agree / (double)t->scored, t->max_err);
    if (o->bounds) {
        double nr = t->nll_run[RUN_RANDOM] / (double)t->scored;
        double nx = t->nll_run[RUN_EXACT] / (double)t->scored;
        printf("bounds at the same budget: random selection nll %.6f, exact %.6f; the "
               "speculation closes %.3f of the gap\n",
               nr, nx, nr != nx ? (nr - nll) / (nr - nx) : NAN);
    }
    if (pm->input_cos)
        printf("premises (first window, means over the layers): block input cosine with the layer "
               "before %.3f, query from the layer before's input vs its own %.3f, adjacent "
               "queries %.3f; the selection's recall of the exact top-m %.3f\n",
               layer_mean(pm->input_cos, pm->n_layers), layer_mean(pm->spec_q_cos, pm->n_layers),
               layer_mean(pm->adj_q_cos, pm->n_layers), layer_mean(pm->recall, pm->n_layers));
}

/* Opens the runs o asks for, each sized for one sequence of w tokens: the mode; with --compare,
 * the all-resident reference (same cache dtype and backend); with --bounds, infinigen's random
 * selection (same skew and count) and its exact one (every column of the skew, lookahead 0, the
 * count the fetch cap: alpha infinite). */
static int eval_open_runs(const eval_opts *o, rekv_engine *eng, const rekv_model_config *cfg,
                          long w, eval_run *runs, rekv_err *err)
{
    runs[RUN_MODE].on = 1;
    runs[RUN_RESIDENT].on = o->compare;
    runs[RUN_RANDOM].on = runs[RUN_EXACT].on = o->bounds;
    for (int r = 0; r < N_RUNS; r++) {
        if (!runs[r].on)
            continue;
        rekv_pipeline_config pc = o->po.cfg;
        cli_pipeline_opts po = o->po;
        if (r == RUN_RESIDENT) {
            rekv_pipeline_config_defaults(&pc);
            pc.cache_dtype = o->po.cfg.cache_dtype;
        } else if (r == RUN_RANDOM) {
            pc.select = REKV_SELECT_RANDOM;
        } else if (r == RUN_EXACT) {
            pc.skew = NULL, po.skew = NULL, po.partial_ratio = 1;
            pc.lookahead = 0, pc.alpha = INFINITY;
        }
        runs[r].logits = malloc((size_t)cfg->vocab * sizeof(float));
        if (runs[r].logits == NULL)
            return rekv_errf(err, -ENOMEM, "out of memory");
        int rc = cli_session_open(&runs[r].ses, eng, &po, &pc, 1, (int)w, err);
        if (rc)
            return rc;
    }
    return 0;
}

int cli_eval(int argc, char **argv)
{
    rekv_progress prog = {.style = REKV_PROGRESS_QUIET}; /* begun before the windows */
    eval_opts o;
    int rc = eval_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    eval_run runs[N_RUNS];
    memset(runs, 0, sizeof(runs));
    rekv_premises pm = {0};
    if (rekv_model_open(o.model_path, &model, &err))
        goto fail;
    const rekv_model_config *cfg = &model->config;
    if (eval_read_ids(&o, cfg, &ids, &n, &err))
        goto fail;
    long w = o.window > 0 && o.window < cfg->max_pos ? o.window : cfg->max_pos;
    if (w < o.prefill + 2) {
        rekv_errf(&err, -EINVAL,
                  "a window of %ld tokens leaves nothing to score after a prefill of %ld (give "
                  "--window >= prefill + 2)",
                  w, o.prefill);
        goto fail;
    }
    if (n < (size_t)o.prefill + 2) {
        rekv_errf(&err, -EINVAL, "%zu tokens leave nothing to score after a prefill of %ld", n,
                  o.prefill);
        goto fail;
    }
    if (rekv_engine_create(model, &eng, &err))
        goto fail;
    if (cli_session_choose(cfg, o.po.backend, &o.po.link, 1, (int)w, &o.po.cfg, &err))
        goto fail;
    if (eval_open_runs(&o, eng, cfg, w, runs, &err))
        goto fail;
    eval_tally t = {0};
    uint64_t t0 = rekv_now_ns();
    rekv_progress_begin(&prog, stderr, rekv_progress_style_for(stderr, o.json), "rekv eval",
                        "tokens", n - (size_t)o.prefill - 1);
    if (eval_windows(runs, ids, n, o.prefill, w, cfg, &prog, &t, &err))
        goto fail;
    rekv_progress_end(&prog);
    t.secs = (double)(rekv_now_ns() - t0) * 1e-9;
    const rekv_pipeline_config *pc0 = rekv_pipeline_get_config(runs[0].ses.p);
    if (rekv_mode_info_of(pc0->mode)->speculates && /* the premises, on the first window */
        rekv_premises_measure(eng, pc0->skew, ids, (int)((size_t)w < n ? (size_t)w : n),
                              (int)o.prefill, pc0->alpha, pc0->max_fraction, pc0->lookahead, &pm,
                              &err))
        goto fail;
    if (o.json) {
        if (eval_print_json(&o, &runs[0], cfg, w, &t, &pm, &err))
            goto fail;
    } else {
        eval_print_text(&o, &runs[0], &t, &pm);
    }
    rc = 0;
    goto out;
fail:
    rekv_progress_end(&prog); /* a bar's line ends before the message */
    fprintf(stderr, "rekv eval: %s\n", err.msg);
out:
    for (int r = 0; r < N_RUNS; r++) {
        rekv_pseq_free(runs[r].seq);
        cli_session_close(&runs[r].ses);
        free(runs[r].logits);
    }
    rekv_premises_free(&pm);
    rekv_engine_free(eng);
    free(ids);
    rekv_model_close(model);
    return rc;
}
