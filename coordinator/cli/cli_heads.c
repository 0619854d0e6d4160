/* cli_heads.c — `rekv heads`: CLO's head profile of a model (gpuworker/heads.h), made or read
 * from the cache, and the thresholds and reuse difficulty it gives: per layer and query head the
 * importance, the adjacent decode queries' cosine and tau (Eq. 7–9); per KV head D (Eq. 11).
 *
 * Without --text/--ids it does what `--mode clo` will do on its own (rekv_heads_prepare: the
 * cache, else a sample the model generates itself) and so pre-warms the cache; with them it
 * profiles that text instead and writes --out (default: the cache file). */
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

#include "coordinator/cli/cli.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/heads.h"
#include "gpuworker/skew.h"
#include "loader/loader.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: rekv heads --model PATH [--text FILE | --ids FILE] [--eta E] [--power P]\n"
            "                  [--out FILE] [--json]\n"
            "CLO's head profile: per layer and query head the importance (the attention\n"
            "output's loss when the head sees only %d sink and %d recent tokens, relative to the\n"
            "model's largest) and the mean cosine of adjacent decode queries; from them the reuse\n"
            "threshold tau (CLO Eq. 7-9: --eta E, default %.2f, --power P, default %.0f) and each\n"
            "KV head's reuse difficulty D (Eq. 11; D > 0: hard to reuse).\n"
            "Without --text/--ids: the profile --mode clo uses, from the cache ($XDG_CACHE_HOME/\n"
            "rekv or ~/.cache/rekv) or made on %d tokens the model generates itself and saved\n"
            "there. --text FILE / --ids FILE (a JSON array of token ids): profile that text.\n"
            "--out FILE: where to write it (default: the cache file). --json: one JSON object.\n",
            REKV_HEADS_SINK, REKV_HEADS_RECENT, REKV_HEADS_ETA, REKV_HEADS_POWER,
            REKV_SKEW_SAMPLE_TOKENS);
}

static json_t *head_rows(const rekv_heads *h, int l, double eta, double p)
{
    json_t *a = json_array();
    for (int j = 0; j < h->n_heads; j++) {
        size_t i = (size_t)l * h->n_heads + j;
        json_array_append_new(a, json_pack("{s:f, s:f, s:f}", "importance", h->importance[i],
                                           "adjacent_cos", h->adjacent_cos[i], "tau",
                                           rekv_heads_tau(h->importance[i], eta, p)));
    }
    return a;
}

static int print_json(const char *model_path, const char *path, const rekv_heads *h, int from_cache,
                      double eta, double p)
{
    json_t *layers = json_array();
    for (int l = 0; l < h->n_layers; l++) {
        json_t *d = json_array();
        for (int g = 0; g < h->n_kv_heads; g++)
            json_array_append_new(
                d, json_real(rekv_heads_difficulty(h, l, g, eta, p, REKV_HEADS_EPSILON)));
        json_array_append_new(layers, json_pack("{s:i, s:o, s:o}", "layer", l, "heads",
                                                head_rows(h, l, eta, p), "kv_difficulty", d));
    }
    json_t *o = json_pack("{s:s, s:s, s:b, s:i, s:f, s:f, s:f, s:o}", "model", model_path, "path",
                          path, "from_cache", from_cache, "tokens", h->sample_tokens, "eta", eta,
                          "power", p, "epsilon", REKV_HEADS_EPSILON, "layers", layers);
    char *text = o ? json_dumps(o, JSON_REAL_PRECISION(9)) : NULL;
    json_decref(o);
    if (text == NULL)
        return -1;
    printf("%s\n", text);
    free(text);
    return 0;
}

static void print_text(const char *path, const rekv_heads *h, int from_cache, double eta, double p)
{
    printf("%s: %s, %d tokens; eta %.2f, power %.1f\n", path,
           from_cache ? "from the cache" : "profiled now", h->sample_tokens, eta, p);
    printf("  layer  head  importance  adjacent_cos     tau\n");
    for (int l = 0; l < h->n_layers; l++)
        for (int j = 0; j < h->n_heads; j++) {
            size_t i = (size_t)l * h->n_heads + j;
            printf("  %5d  %4d  %10.4f  %12.4f  %6.3f\n", l, j, h->importance[i],
                   h->adjacent_cos[i], rekv_heads_tau(h->importance[i], eta, p));
        }
    printf("  layer  reuse difficulty D per KV head (> 0: hard to reuse)\n");
    for (int l = 0; l < h->n_layers; l++) {
        printf("  %5d ", l);
        for (int g = 0; g < h->n_kv_heads; g++)
            printf(" %7.3f", rekv_heads_difficulty(h, l, g, eta, p, REKV_HEADS_EPSILON));
        printf("\n");
    }
}

typedef struct heads_opts {
    const char *model_path, *text_path, *ids_path, *out_path;
    double eta, power;
    int json;
} heads_opts;

static int heads_parse(int argc, char **argv, heads_opts *o)
{
    enum { O_MODEL = 1, O_TEXT, O_IDS, O_ETA, O_POWER, O_OUT, O_JSON, O_HELP };
    static const struct option opts[] = {{"model", required_argument, 0, O_MODEL},
                                         {"text", required_argument, 0, O_TEXT},
                                         {"ids", required_argument, 0, O_IDS},
                                         {"eta", required_argument, 0, O_ETA},
                                         {"power", required_argument, 0, O_POWER},
                                         {"out", required_argument, 0, O_OUT},
                                         {"json", no_argument, 0, O_JSON},
                                         {"help", no_argument, 0, O_HELP},
                                         {0, 0, 0, 0}};
    *o = (heads_opts){.eta = REKV_HEADS_ETA, .power = REKV_HEADS_POWER};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
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
        case O_ETA:
            if (cli_parse_float("eta", optarg, -1, 1, &o->eta))
                return 2;
            break;
        case O_POWER:
            if (cli_parse_float("power", optarg, 0, 16, &o->power))
                return 2;
            break;
        case O_OUT:
            o->out_path = optarg;
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
    if (cli_no_operands(argc, argv) || o->model_path == NULL || (o->text_path && o->ids_path)) {
        usage(stderr);
        return 2;
    }
    return CLI_PARSED;
}

int cli_heads(int argc, char **argv)
{
    heads_opts o;
    int prc = heads_parse(argc, argv, &o);
    if (prc != CLI_PARSED)
        return prc;
    int rc = 1, from_cache = 0, n = 0;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    rekv_heads h = {0};
    int32_t *ids = NULL;
    char cache_path[4300];
    if (rekv_model_open(o.model_path, &model, &err) || rekv_engine_create(model, &eng, &err))
        goto fail;
    if (o.ids_path || o.text_path) {
        if (cli_calibration_ids(o.model_path, &model->config, o.text_path, o.ids_path, o.json, &ids,
                                &n, &err) ||
            rekv_heads_profile(eng, ids, n, &h, &err))
            goto fail;
    } else if (rekv_heads_prepare(eng, &h, &from_cache, &err)) {
        goto fail;
    }
    int to_cache = o.out_path == NULL;
    if (to_cache) {
        if (rekv_heads_cache_path(eng, cache_path, sizeof(cache_path), &err))
            goto fail;
        o.out_path = cache_path;
    }
    if (!(to_cache && from_cache) && rekv_heads_save(&h, o.out_path, &err))
        goto fail;
    if (o.json ? print_json(o.model_path, o.out_path, &h, from_cache, o.eta, o.power) : 0) {
        rekv_errf(&err, -1, "out of memory");
        goto fail;
    }
    if (!o.json)
        print_text(o.out_path, &h, from_cache, o.eta, o.power);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "rekv heads: %s\n", err.msg);
out:
    rekv_heads_free(&h);
    free(ids);
    rekv_engine_free(eng);
    rekv_model_close(model);
    return rc;
}
