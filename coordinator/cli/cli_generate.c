/* cli_generate.c — `rekv generate`: run a prompt through a model and print the continuation, as
 * text or as one JSON object. By default the job goes through the coordinator (the local trio is
 * started for the call when none serves the model); --local, or any pipeline option, runs the
 * pipeline in this process. Both print the same ids, text and top logits. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/progress.h"
#include "coordinator/cli/cli_session.h"
#include "gpuworker/gpuworker.h"
#include "loader/loader.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: rekv generate --model PATH (--prompt TEXT | --prompt-ids 1,2,3)\n"
            "                     [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]\n"
            "                     [--seed S] [--top-logits K] [--ignore-eos] [--json]\n"
            "                     [--socket ENDPOINT | --local [pipeline options]]\n"
            "PATH is a HuggingFace model directory or a llama2.c .bin checkpoint.\n"
            "--temperature 0 (the default) is greedy. Generation stops at the model's EOS unless\n"
            "--ignore-eos is given. The job goes to the coordinator at --socket (default: the\n"
            "local control socket, or a private `rekv run` started for this call); --local runs\n"
            "it in this process, as any of these pipeline options does:\n" CLI_PIPELINE_USAGE);
}

/* The "stats" of an in-process run: what ran, how fast, and the exact counters per layer. */
static json_t *local_stats(cli_session *ses, const cli_pipeline_opts *po,
                           const rekv_model_config *cfg, const rekv_gen_result *res, int n_ids)
{
    rekv_layer_counters tot;
    const rekv_layer_counters *lc = rekv_pipeline_counters(ses->p, &tot);
    rekv_backend_stats bst;
    ses->be->iface->stats(ses->be, &bst);
    json_t *layers = json_array();
    for (int l = 0; l < cfg->n_layers; l++)
        json_array_append_new(layers,
                              json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "h2d_weights",
                                        (json_int_t)lc[l].h2d_bytes[REKV_XFER_WEIGHTS], "h2d_kv",
                                        (json_int_t)lc[l].h2d_bytes[REKV_XFER_KV], "h2d_act",
                                        (json_int_t)lc[l].h2d_bytes[REKV_XFER_ACT], "d2h_kv",
                                        (json_int_t)lc[l].d2h_bytes[REKV_XFER_KV], "d2h_act",
                                        (json_int_t)lc[l].d2h_bytes[REKV_XFER_ACT],
                                        "tokens_recomputed", (json_int_t)lc[l].tokens_recomputed,
                                        "tokens_fetched", (json_int_t)lc[l].tokens_fetched));
    json_t *st = json_pack(
        "{s:s, s:s, s:s, s:b, s:s, s:i, s:s, s:i, s:i, s:f, s:f, s:f, s:f}", "backend",
        ses->be->iface->name, "via", "local", "mode", rekv_mode_name(po->cfg.mode),
        "offload_weights", po->cfg.offload_weights, "schedule",
        po->cfg.schedule == REKV_SCHED_ROW ? "row" : "column", "gpu_batches", po->cfg.gpu_batches,
        "finish_reason", res->finish_reason, "prompt_tokens", n_ids, "generated_tokens", res->n,
        "prefill_s", res->prefill_s, "decode_s", res->decode_s, "prefill_tokens_per_s",
        res->prefill_s > 0 ? (double)n_ids / res->prefill_s : 0.0, "decode_tokens_per_s",
        res->decode_s > 0 && res->n > 1 ? (double)(res->n - 1) / res->decode_s : 0.0);
    if (rekv_pipeline_keeps_act(&po->cfg))
        json_object_set_new(st, "split", json_integer(po->cfg.split));
    if (rekv_mode_info_of(po->cfg.mode)->store == REKV_STORE_PATTERN)
        json_object_set_new(st, "ratio", json_pack("[i, i]", po->cfg.kv_parts, po->cfg.act_parts));
    size_t n_steps;
    const rekv_layer_counters *sc = rekv_pipeline_step_counters(ses->p, &n_steps);
    json_t *steps = json_array();
    for (size_t i = 0; i < n_steps; i++)
        json_array_append_new(steps,
                              json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "h2d_weights",
                                        (json_int_t)sc[i].h2d_bytes[REKV_XFER_WEIGHTS], "h2d_kv",
                                        (json_int_t)sc[i].h2d_bytes[REKV_XFER_KV], "h2d_act",
                                        (json_int_t)sc[i].h2d_bytes[REKV_XFER_ACT], "d2h_kv",
                                        (json_int_t)sc[i].d2h_bytes[REKV_XFER_KV], "d2h_act",
                                        (json_int_t)sc[i].d2h_bytes[REKV_XFER_ACT],
                                        "tokens_recomputed", (json_int_t)sc[i].tokens_recomputed,
                                        "tokens_fetched", (json_int_t)sc[i].tokens_fetched));
    json_object_set_new(st, "counters",
                        json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o}", "h2d_weights",
                                  (json_int_t)tot.h2d_bytes[REKV_XFER_WEIGHTS], "h2d_kv",
                                  (json_int_t)tot.h2d_bytes[REKV_XFER_KV], "h2d_act",
                                  (json_int_t)tot.h2d_bytes[REKV_XFER_ACT], "d2h_kv",
                                  (json_int_t)tot.d2h_bytes[REKV_XFER_KV], "d2h_act",
                                  (json_int_t)tot.d2h_bytes[REKV_XFER_ACT], "d2h_logits",
                                  (json_int_t)bst.d2h_bytes[REKV_XFER_OTHER], "tokens_recomputed",
                                  (json_int_t)tot.tokens_recomputed, "tokens_fetched",
                                  (json_int_t)tot.tokens_fetched, "per_layer", layers));
    /* step 0 is the prefill, then one entry per decode step */
    json_object_set_new(json_object_get(st, "counters"), "per_step", steps);
    return st;
}

typedef struct gen_opts {
    cli_pipeline_opts po;
    const char *model_path, *prompt, *prompt_ids, *socket;
    long max_new, top_k, top_logits, seed;
    double temperature, top_p;
    int json, ignore_eos;
    int local; /* --local, or a pipeline option: run the pipeline in this process */
} gen_opts;

static int gen_parse(int argc, char **argv, gen_opts *o)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"prompt", required_argument, 0, 'p'},
                                         {"prompt-ids", required_argument, 0, 'i'},
                                         {"max-new-tokens", required_argument, 0, 'n'},
                                         {"temperature", required_argument, 0, 't'},
                                         {"top-k", required_argument, 0, 'k'},
                                         {"top-p", required_argument, 0, 'P'},
                                         {"seed", required_argument, 0, 's'},
                                         {"top-logits", required_argument, 0, 'L'},
                                         {"json", no_argument, 0, 'j'},
                                         {"ignore-eos", no_argument, 0, 'E'},
                                         {"help", no_argument, 0, 'h'},
                                         {"local", no_argument, 0, 'l'},
                                         {"socket", required_argument, 0, 'S'},
                                         CLI_PIPELINE_OPTIONS,
                                         {0, 0, 0, 0}};
    memset(o, 0, sizeof(*o));
    cli_pipeline_opts_defaults(&o->po);
    o->max_new = 64, o->top_p = 1;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int pr = cli_parse_pipeline_opt(c, optarg, &o->po);
        if (pr < 0)
            return 2;
        if (pr > 0) {
            o->local = 1; /* pipeline options describe this process's pipeline */
            continue;
        }
        switch (c) {
        case 'm':
            o->model_path = optarg;
            break;
        case 'p':
            o->prompt = optarg;
            break;
        case 'i':
            o->prompt_ids = optarg;
            break;
        case 'n':
            if (cli_parse_int("max-new-tokens", optarg, 0, 1 << 24, &o->max_new))
                return 2;
            break;
        case 't':
            if (cli_parse_float("temperature", optarg, 0, 100, &o->temperature))
                return 2;
            break;
        case 'k':
            if (cli_parse_int("top-k", optarg, 0, 1 << 30, &o->top_k))
                return 2;
            break;
        case 'P':
            if (cli_parse_float("top-p", optarg, 0, 1, &o->top_p))
                return 2;
            break;
        case 's':
            if (cli_parse_int("seed", optarg, 0, INT64_MAX, &o->seed))
                return 2;
            break;
        case 'L':
            if (cli_parse_int("top-logits", optarg, 0, 1 << 20, &o->top_logits))
                return 2;
            break;
        case 'j':
            o->json = 1;
            break;
        case 'E':
            o->ignore_eos = 1;
            break;
        case 'l':
            o->local = 1;
            break;
        case 'S':
            o->socket = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (cli_no_operands(argc, argv) || o->model_path == NULL ||
        (o->prompt == NULL) == (o->prompt_ids == NULL) || (o->local && o->socket)) {
        usage(stderr);
        return 2;
    }
    return CLI_PARSED;
}

/* --prompt through the tokenizer (tok, NULL: the model has none) into *ids (malloc'd), or the
 * --prompt-ids already there; either checked against the vocabulary and the context. */
static int gen_prompt(const gen_opts *o, const rekv_model_config *cfg, rekv_tokenizer *tok,
                      int32_t **ids, size_t *n_ids, rekv_err *err)
{
    int rc;
    if (o->prompt) {
        if (tok == NULL)
            return rekv_errf(err, -ENOENT, "%s has no tokenizer; give the prompt as --prompt-ids",
                             o->model_path);
        if ((rc = rekv_tokenizer_encode(tok, o->prompt, strlen(o->prompt),
                                        cfg->add_bos ? cfg->bos_id : -1, ids, n_ids, err)))
            return rc;
    }
    for (size_t i = 0; i < *n_ids; i++)
        if ((*ids)[i] >= cfg->vocab)
            return rekv_errf(err, -EINVAL,
                             "prompt token id %d is outside the vocabulary of %s (0..%d)",
                             (*ids)[i], o->model_path, cfg->vocab - 1);
    if (*n_ids > (size_t)cfg->max_pos)
        return rekv_errf(err, -EINVAL,
                         "the prompt of %zu tokens is longer than the context of %s (%d tokens)",
                         *n_ids, o->model_path, cfg->max_pos);
    return 0;
}

/* The pipeline in this process (ses, on the engine *eng made here): the generation into res and
 * its "stats" into *st. */
static int gen_run_local(gen_opts *o, rekv_model *model, const int32_t *ids, size_t n_ids,
                         const rekv_gen_params *gp, rekv_engine **eng, cli_session *ses,
                         rekv_gen_result *res, json_t **st, rekv_err *err)
{
    const rekv_model_config *cfg = &model->config;
    int rc;
    if ((rc = rekv_engine_create(model, eng, err)))
        return rc;
    int64_t want = (int64_t)n_ids + (o->max_new > 0 ? o->max_new - 1 : 0);
    int ctx = want < cfg->max_pos ? (int)want : cfg->max_pos;
    if ((rc =
             cli_session_choose(cfg, o->po.backend, &o->po.link, 1, (int)n_ids, &o->po.cfg, err)) ||
        (rc = cli_session_open(ses, *eng, &o->po, &o->po.cfg, 1, ctx, err)))
        return rc;
    if (o->po.trace)
        ses->be->iface->trace_start(ses->be);
    const int32_t *pp = ids;
    int np = (int)n_ids;
    rekv_progress pr;
    rekv_progress_begin(&pr, stderr, rekv_progress_style_for(stderr, o->json), "rekv generate",
                        "tokens", 0);
    rc = rekv_pipeline_generate_progress(ses->p, &pp, &np, 1, gp, res, rekv_progress_cb, &pr, err);
    rekv_progress_end(&pr);
    if (rc)
        return rc;
    if (o->po.trace && (rc = ses->be->iface->trace_write(ses->be, o->po.trace, err)))
        return rc;
    *st = local_stats(ses, &o->po, cfg, res, (int)n_ids);
    return 0;
}

/* The result as one JSON object; takes st (the "stats"). */
static void gen_print_json(const gen_opts *o, const int32_t *ids, size_t n_ids,
                           const rekv_gen_result *res, const rekv_tokenizer *tok, const char *text,
                           size_t text_len, json_t *st)
{
    json_t *j = json_object(), *pi = json_array(), *gi = json_array(), *tl = json_array();
    for (size_t i = 0; i < n_ids; i++)
        json_array_append_new(pi, json_integer(ids[i]));
    for (int i = 0; i < res->n; i++) {
        json_array_append_new(gi, json_integer(res->ids[i]));
        json_t *step = json_array();
        for (long k = 0; k < o->top_logits && res->top_ids; k++) {
            size_t at = (size_t)i * (size_t)o->top_logits + (size_t)k;
            json_array_append_new(
                step, json_pack("[I f]", (json_int_t)res->top_ids[at], (double)res->top_vals[at]));
        }
        json_array_append_new(tl, step);
    }
    json_object_set_new(j, "prompt_ids", pi);
    json_object_set_new(j, "generated_ids", gi);
    json_object_set_new(j, "text", text ? json_stringn(text, text_len) : json_null());
    if (text && !json_is_string(json_object_get(j, "text")))
        json_object_set_new(j, "text", json_null()); /* not valid UTF-8 */
    if (tok == NULL)
        json_object_set_new(j, "text_unavailable", json_string("the model has no tokenizer"));
    json_object_set_new(j, "top_logits", tl);
    json_object_set_new(j, "stats", st);
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(9));
    printf("%s\n", s);
    free(s);
    json_decref(j);
}

int cli_generate(int argc, char **argv)
{
    gen_opts o;
    int rc = gen_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    rc = 1;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_tokenizer *tok = NULL;
    rekv_engine *eng = NULL;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    char *text = NULL;
    rekv_gen_result res = {0};
    cli_session ses = {0};
    cli_remote remote;
    int remote_used = 0; /* remote is set up: cli_remote_end it */
    json_t *st = NULL;   /* the "stats" of the JSON output */
    if (o.prompt_ids) {  /* a usage error before any work */
        int n;
        if (cli_parse_ids(o.prompt_ids, &ids, &n)) {
            fprintf(stderr, "rekv: --prompt-ids: expected comma-separated token ids, got \"%s\"\n",
                    o.prompt_ids);
            return 2;
        }
        n_ids = (size_t)n;
    }
    if (rekv_model_open(o.model_path, &model, &err))
        goto fail;
    const rekv_model_config *cfg = &model->config;
    int trc = rekv_tokenizer_load_for_model(o.model_path, &tok, &err);
    if (trc && trc != -ENOENT)
        goto fail;
    rekv_err_clear(&err);
    if (gen_prompt(&o, cfg, tok, &ids, &n_ids, &err))
        goto fail;
    if (o.top_logits > cfg->vocab)
        o.top_logits = cfg->vocab;
    rekv_gen_params gp = {(int)o.max_new,   (float)o.temperature, (int)o.top_k, (float)o.top_p,
                          (uint64_t)o.seed, (int)o.top_logits,    !o.ignore_eos, 0, 0};
    if (!o.local) {
        double queued_s = 0, run_s = 0;
        remote_used = 1;
        if (cli_generate_remote(&remote, o.model_path, o.socket, ids, (int)n_ids, &gp, &res,
                                &queued_s, &run_s, &err))
            goto fail;
        st = json_pack("{s:s, s:s, s:i, s:i, s:f, s:f}", "via", "coordinator", "finish_reason",
                       res.finish_reason, "prompt_tokens", (int)n_ids, "generated_tokens", res.n,
                       "queued_s", queued_s, "run_s", run_s);
    } else if (gen_run_local(&o, model, ids, n_ids, &gp, &eng, &ses, &res, &st, &err)) {
        goto fail;
    }
    size_t text_len = 0;
    if (tok && rekv_tokenizer_decode(tok, res.ids, (size_t)res.n, &text, &text_len, &err))
        goto fail;
    if (o.json) {
        gen_print_json(&o, ids, n_ids, &res, tok, text, text_len, st);
        st = NULL;
    } else if (text) {
        printf("%s%s\n", o.prompt ? o.prompt : "", text);
    } else {
        fprintf(stderr, "rekv: %s has no tokenizer; printing token ids\n", o.model_path);
        for (int i = 0; i < res.n; i++)
            printf("%s%d", i ? "," : "", res.ids[i]);
        printf("\n");
    }
    fflush(stdout);
    rc = 0;
    goto out;
fail:
    if (err.code != -EINTR) /* interrupted: said below */
        fprintf(stderr, "rekv: %s\n", err.msg);
out:
    if (remote_used) { /* the private trio stops after the result is out */
        int sig = cli_remote_end(&remote);
        if (sig) {
            fprintf(stderr, "rekv: interrupted by SIG%s; stopped what this call started\n",
                    sigabbrev_np(sig));
            rc = 128 + sig;
        }
    }
    rekv_gen_result_free(&res);
    json_decref(st);
    cli_session_close(&ses);
    free(text);
    free(ids);
    rekv_engine_free(eng);
    rekv_tokenizer_free(tok);
    rekv_model_close(model);
    return rc;
}
