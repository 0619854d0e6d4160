/* cli_skew.c — `rekv skew`: InfiniGen's skewing matrices for a model (gpuworker/skew.h), made or
 * read from the cache, and what they buy: per layer, the share of the query's squared norm that
 * the rk selected columns of the skewed query Q·A hold, beside the share the same rule's rk columns
 * hold without skewing (A = identity).
 *
 * Without --text/--ids it does what `--mode infinigen` does on its own (rekv_skew_prepare: the
 * cache, else a sample the model generates itself) and so pre-warms the cache; with them it
 * calibrates on that text instead. The file goes to --out, by default the cache path
 * rekv_skew_prepare reads. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/cli/cli.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/skew.h"
#include "loader/loader.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: rekv skew --model PATH [--text FILE | --ids FILE] [--ratio R] [--out FILE]\n"
            "                 [--json]\n"
            "Makes InfiniGen's skewing matrices for the model (one orthogonal A per layer and KV\n"
            "head, from the SVD of the calibration queries, and the rk = ceil(R * head_dim)\n"
            "columns the speculation uses) and prints, per layer, the share of the query's\n"
            "squared norm those columns hold, skewed and without skewing.\n"
            "Without --text/--ids: the skew --mode infinigen uses, from the cache\n"
            "($XDG_CACHE_HOME/rekv or ~/.cache/rekv) or calibrated on %d tokens the model\n"
            "generates itself and saved there. --text FILE / --ids FILE (a JSON array of token\n"
            "ids): calibrate on that text (its first context-length tokens) instead.\n"
            "--ratio R: the partial ratio, in (0, 1] (default %.1f). --out FILE: where to write\n"
            "the skew (default: the cache file --mode infinigen reads). --json: one JSON object.\n",
            REKV_SKEW_SAMPLE_TOKENS, REKV_SKEW_DEFAULT_RATIO);
}

/* --ratio: a number in (0, 1]. */
static int parse_ratio(const char *s, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(s, &end);
    if (end == s || *end || errno || !(x > 0 && x <= 1)) {
        fprintf(stderr, "rekv skew: --ratio: expected a number in (0, 1], got \"%s\"\n", s);
        return -1;
    }
    *out = x;
    return 0;
}

static int print_json(const char *model_path, const char *path, double ratio, const rekv_skew *s,
                      int from_cache, int n_ids, const double *skewed, const double *plain)
{
    char fp[17];
    snprintf(fp, sizeof(fp), "%016llx", (unsigned long long)s->fingerprint);
    json_t *layers = json_array();
    double ms = 0, mp = 0;
    for (int l = 0; l < s->n_layers && layers; l++) {
        json_array_append_new(layers, json_pack("{s:i, s:f, s:f}", "layer", l, "concentration",
                                                skewed[l], "concentration_unskewed", plain[l]));
        ms += skewed[l] / s->n_layers;
        mp += plain[l] / s->n_layers;
    }
    json_t *o = json_pack(
        "{s:s, s:s, s:f, s:i, s:i, s:i, s:i, s:s, s:b, s:i, s:f, s:f, s:o}", "model", model_path,
        "path", path, "ratio", ratio, "rk", s->rk, "head_dim", s->head_dim, "n_layers", s->n_layers,
        "n_kv_heads", s->n_kv_heads, "fingerprint", fp, "from_cache", from_cache, "tokens", n_ids,
        "concentration", ms, "concentration_unskewed", mp, "layers", layers);
    char *text = o ? json_dumps(o, JSON_REAL_PRECISION(17)) : NULL;
    json_decref(o);
    if (text == NULL)
        return -ENOMEM;
    printf("%s\n", text);
    free(text);
    return 0;
}

static void print_text(const char *path, const rekv_skew *s, int from_cache, int n_ids,
                       const double *skewed, const double *plain)
{
    printf("%s: rk %d of %d columns, fingerprint %016llx, %s\n", path, s->rk, s->head_dim,
           (unsigned long long)s->fingerprint, from_cache ? "from the cache" : "calibrated now");
    printf("share of the query's squared norm in the rk selected columns (over %d tokens):\n",
           n_ids);
    printf("  layer  skewed  unskewed\n");
    for (int l = 0; l < s->n_layers; l++)
        printf("  %5d  %6.4f  %8.4f\n", l, skewed[l], plain[l]);
}

typedef struct skew_opts {
    const char *model_path, *text_path, *ids_path, *out_path;
    double ratio;
    int json;
} skew_opts;

static int skew_parse(int argc, char **argv, skew_opts *o)
{
    enum { O_MODEL = 1, O_TEXT, O_IDS, O_RATIO, O_OUT, O_JSON, O_HELP };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"text", required_argument, 0, O_TEXT},
        {"ids", required_argument, 0, O_IDS},     {"ratio", required_argument, 0, O_RATIO},
        {"out", required_argument, 0, O_OUT},     {"json", no_argument, 0, O_JSON},
        {"help", no_argument, 0, O_HELP},         {0, 0, 0, 0}};
    *o = (skew_opts){.ratio = REKV_SKEW_DEFAULT_RATIO};
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
        case O_RATIO:
            if (parse_ratio(optarg, &o->ratio))
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

int cli_skew(int argc, char **argv)
{
    skew_opts o;
    int prc = skew_parse(argc, argv, &o);
    if (prc != CLI_PARSED)
        return prc;
    int rc = 1, from_cache = 0, n_ids = 0;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_engine *eng = NULL;
    rekv_skew skew = {0};
    int32_t *ids = NULL;
    char cache_path[4300];
    double *skewed = NULL, *plain = NULL;
    if (rekv_model_open(o.model_path, &model, &err) || rekv_engine_create(model, &eng, &err))
        goto fail;
    const rekv_model_config *cfg = &model->config;
    if (o.ids_path || o.text_path) {
        if (cli_calibration_ids(o.model_path, cfg, o.text_path, o.ids_path, o.json, &ids, &n_ids,
                                &err))
            goto fail;
        if (rekv_skew_calibrate(eng, ids, n_ids, o.ratio, &skew, &err))
            goto fail;
    } else {
        if (rekv_skew_prepare(eng, o.ratio, &skew, &from_cache, &err) ||
            rekv_skew_sample(eng, &ids, &n_ids, &err))
            goto fail;
    }
    int to_cache = o.out_path == NULL;
    if (to_cache) {
        if (rekv_skew_cache_path(eng, o.ratio, cache_path, sizeof(cache_path), &err))
            goto fail;
        o.out_path = cache_path;
    }
    /* written again even when prepare has just saved it: prepare does not count a cache it could
     * not write as a failure, and pre-warming the cache is what this command was asked for */
    if (!(to_cache && from_cache) && rekv_skew_save(&skew, o.out_path, &err))
        goto fail;
    skewed = calloc((size_t)skew.n_layers, sizeof(double));
    plain = calloc((size_t)skew.n_layers, sizeof(double));
    if (skewed == NULL || plain == NULL) {
        rekv_errf(&err, -ENOMEM, "out of memory");
        goto fail;
    }
    if (rekv_skew_concentration(eng, &skew, ids, n_ids, skewed, plain, &err))
        goto fail;
    if (o.json) {
        if (print_json(o.model_path, o.out_path, o.ratio, &skew, from_cache, n_ids, skewed,
                       plain)) {
            rekv_errf(&err, -ENOMEM, "out of memory");
            goto fail;
        }
    } else {
        print_text(o.out_path, &skew, from_cache, n_ids, skewed, plain);
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "rekv skew: %s\n", err.msg);
out:
    free(skewed);
    free(plain);
    rekv_skew_free(&skew);
    free(ids);
    rekv_engine_free(eng);
    rekv_model_close(model);
    return rc;
}
