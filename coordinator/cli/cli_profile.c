/* cli_profile.c — `rekv profile`: measures (or loads from the cache) the hardware profile of a
 * model on the cpu backend, prints it with its fitted models, and shows what the planner would
 * choose with it for a decode batch of 8 at a few context lengths; and the planner decisions the
 * rest of the CLI takes from a profile (cli_profile.h). */
#include "coordinator/cli/cli_profile.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/progress.h"
#include "coordinator/cli/cli.h"
#include "gpuworker/device/backend.h"
#include "loader/loader.h"

/* One layer of a decode step of `batch` sequences of `ctx` tokens of model c with a cache of
 * cache_dtype (rekv_plan_shape), and the profile it is priced with: `in` as given, the weights'
 * load time only when they are offloaded. */
static void step_setup(const rekv_cost_profile *in, const rekv_model_config *c,
                       rekv_dtype cache_dtype, int offload_weights, int batch, int ctx,
                       rekv_cost_profile *prof, rekv_step_shape *sh)
{
    *prof = *in;
    if (!offload_weights)
        prof->t_load_w = 0;
    rekv_plan_model pm;
    rekv_plan_model_from_config(c, &pm);
    rekv_plan_shape(&pm, batch, ctx, rekv_kv_elem_bytes(cache_dtype, c->head_dim), offload_weights,
                    sh);
}

/* cli_plan_kvpr with the profile given as the planner prices it (corrected or not). */
static int plan_kvpr(const rekv_cost_profile *measured, const rekv_model_config *c,
                     rekv_dtype cache_dtype, int offload_weights, int batch, int ctx,
                     rekv_kvpr_split *out, rekv_err *err)
{
    rekv_cost_profile prof;
    rekv_step_shape sh;
    step_setup(measured, c, cache_dtype, offload_weights, batch, ctx, &prof, &sh);
    return rekv_plan_kvpr_choose(&prof, &sh.kv, out, err);
}

int cli_plan_kvpr(const rekv_profile *pf, const rekv_model_config *c, rekv_dtype cache_dtype,
                  int offload_weights, int batch, int ctx, rekv_kvpr_split *out, rekv_err *err)
{
    rekv_cost_profile measured;
    rekv_profile_to_cost(pf, cache_dtype, &measured);
    return plan_kvpr(&measured, c, cache_dtype, offload_weights, batch, ctx, out, err);
}

int cli_plan_split(const rekv_cost_profile *prof, const rekv_model_config *c,
                   const rekv_pipeline_config *cfg, int batch, int ctx, double f, int *split,
                   rekv_err *err)
{
    const rekv_mode_info *mi = rekv_mode_info_of(cfg->mode);
    if (mi == NULL)
        return rekv_errf(err, -EINVAL, "mode %d is not a mode", (int)cfg->mode);
    int rc;
    if (mi->split == REKV_SPLIT_SELECTED) { /* layer 0's, as the planner prices it */
        rekv_pipeline_config at = *cfg;
        rekv_step_cost sc;
        at.split = -1;
        if ((rc = cli_plan_predict_step(prof, c, &at, batch, ctx, f, &sc, err)))
            return rc;
        *split = (int)sc.kvpr_l;
        return 0;
    }
    if (mi->split == REKV_SPLIT_NONE)
        return rekv_errf(err, -EINVAL, "%s has no split", rekv_mode_name(cfg->mode));
    /* what moves: the context past the device-resident part */
    int dev = cfg->device_tokens < ctx ? cfg->device_tokens : ctx;
    rekv_kvpr_split sp;
    if ((rc = plan_kvpr(prof, c, cfg->cache_dtype, cfg->offload_weights, batch, ctx - dev, &sp,
                        err)))
        return rc;
    *split = dev + (int)sp.l;
    return 0;
}

int cli_plan_hybrid(const rekv_profile *pf, const rekv_model_config *c, rekv_dtype cache_dtype,
                    int offload_weights, int batch, int ctx, int device_tokens, int *kv_parts,
                    int *act_parts, rekv_err *err)
{
    rekv_cost_profile measured, prof;
    rekv_profile_to_cost(pf, cache_dtype, &measured);
    rekv_step_shape sh;
    step_setup(&measured, c, cache_dtype, offload_weights, batch, ctx, &prof, &sh);
    sh.device_tokens = device_tokens;
    return rekv_plan_hybrid_pattern(&prof, &sh, 0, kv_parts, act_parts, NULL, err);
}

int cli_plan_alg1(const rekv_profile *pf, const rekv_model_config *c, rekv_dtype cache_dtype,
                  int offload_weights, int batch, int ctx, rekv_hybrid_alloc *out, rekv_err *err)
{
    rekv_cost_profile prof;
    rekv_profile_to_cost(pf, cache_dtype, &prof);
    if (!offload_weights)
        prof.t_load_w = 0;
    double dsz = rekv_kv_elem_bytes(cache_dtype, c->head_dim);
    double layer_w = offload_weights ? pf->layer_weight_bytes : 0;
    double blocks = (double)batch * ((ctx + REKV_PLAN_BLOCK_TOKENS - 1) / REKV_PLAN_BLOCK_TOKENS);
    rekv_hybrid_params hp;
    rekv_plan_hybrid_params_for_batch(&hp, c->hidden, rekv_config_kv_dim(c), c->n_layers, dsz,
                                      layer_w, blocks);
    return rekv_plan_hybrid_alloc(&prof, &hp, out, err);
}

int cli_plan_predict_step(const rekv_cost_profile *profile, const rekv_model_config *c,
                          const rekv_pipeline_config *cfg, int batch, int ctx, double f,
                          rekv_step_cost *out, rekv_err *err)
{
    rekv_cost_profile prof;
    rekv_step_shape sh;
    step_setup(profile, c, cfg->cache_dtype, cfg->offload_weights, batch, ctx, &prof, &sh);
    const rekv_mode_info *mi = rekv_mode_info_of(cfg->mode);
    if (mi == NULL)
        return rekv_errf(err, -EINVAL, "mode %d is not a mode", (int)cfg->mode);
    /* resident: the whole context on the device, so that only the weights cross the link, and
     * only when offloaded (it was priced as if nothing crossed: 0.6 ms for 18–53 ms steps) */
    sh.device_tokens = rekv_mode_streams(cfg->mode) ? cfg->device_tokens : ctx;
    rekv_technique tech = rekv_plan_mode_tech(cfg->mode);
    if (tech == REKV_TECH_HYBRID)
        sh.hybrid_kv_fraction = cfg->kv_parts + cfg->act_parts > 0
                                    ? (double)cfg->kv_parts / (cfg->kv_parts + cfg->act_parts)
                                    : 1;
    if (tech == REKV_TECH_INFINIGEN) {
        sh.infinigen_fraction = f;
        /* at the run's split (< 0: the planner's); none without activations */
        sh.infinigen_split = cfg->split < 0 && mi->split == REKV_SPLIT_SELECTED ? -1
                             : rekv_pipeline_keeps_act(cfg)                      ? cfg->split
                                                                                 : 0;
    }
    memset(out, 0, sizeof(*out));
    double L = c->n_layers;
    if (tech == REKV_TECH_KVPR) { /* at the run's split, not the solver's, past the device part */
        int dev = cfg->device_tokens < ctx ? cfg->device_tokens : ctx;
        int l = (cfg->split < ctx ? cfg->split : ctx) - dev;
        rekv_kvpr_split ev;
        sh.kv.s = ctx - dev;
        rekv_plan_kvpr_eval(&prof, &sh.kv, l > 0 ? l : 0, &ev);
        *out = (rekv_step_cost){.t_pcie = ev.t_link * L,
                                .t_compute = ev.t_compute * L,
                                .t_step = ev.t * L,
                                .kvpr_l = cfg->split};
        return 0;
    }
    int rc = rekv_plan_step_cost(&prof, &sh, tech, out, err);
    if (rc)
        return rc;
    out->t_pcie *= L;
    out->t_compute *= L;
    out->t_step *= L;
    return 0;
}

/* ---------------------------------------------------------------- rekv profile */

static const char *const tech_names[REKV_TECH_COUNT] = {"kv", "kvpr", "act", "hybrid"};
static const int plan_ctx[] = {128, 512, 2048};
#define PLAN_BATCH 8

/* What the planner picks for one context length (fp32 cache, resident weights). */
typedef struct plan_row {
    int ctx;
    rekv_technique best;
    rekv_step_cost costs[REKV_TECH_COUNT];
    rekv_kvpr_split split;
    int kv_parts, act_parts; /* hybrid's pattern (the planner's) */
    rekv_hybrid_alloc alg1;  /* Algorithm 1's, as published */
} plan_row;

static int plan_for(const rekv_profile *pf, const rekv_model_config *c, int ctx, plan_row *r,
                    rekv_err *err)
{
    int rc;
    memset(r, 0, sizeof(*r));
    r->ctx = ctx;
    if ((rc = cli_plan_kvpr(pf, c, REKV_DTYPE_F32, 0, PLAN_BATCH, ctx, &r->split, err)) ||
        (rc = cli_plan_hybrid(pf, c, REKV_DTYPE_F32, 0, PLAN_BATCH, ctx, 0, &r->kv_parts,
                              &r->act_parts, err)) ||
        (rc = cli_plan_alg1(pf, c, REKV_DTYPE_F32, 0, PLAN_BATCH, ctx, &r->alg1, err)))
        return rc;
    rekv_cost_profile prof;
    rekv_profile_to_cost(pf, REKV_DTYPE_F32, &prof);
    prof.t_load_w = 0;
    rekv_plan_model pm;
    rekv_plan_model_from_config(c, &pm);
    rekv_step_shape shape;
    rekv_plan_shape(&pm, PLAN_BATCH, ctx, 4.0, 0, &shape);
    shape.hybrid_kv_fraction = (double)r->kv_parts / (r->kv_parts + r->act_parts);
    return rekv_plan_choose(&prof, &shape, &r->best, r->costs, err);
}

static void print_linear(const char *name, const rekv_profile *p, const rekv_linear *m)
{
    printf("  %-10s %s  %9.1f us + %8.4f us/token   (n=%d: %.3f ms)\n", name,
           m == &p->load_kv[REKV_PROFILE_F16] || m == &p->kv_gen[REKV_PROFILE_F16] ? "f16" : "f32",
           m->a * 1e6, m->b * 1e6, p->fit_tokens_max, rekv_linear_eval(m, p->fit_tokens_max) * 1e3);
}

static void print_table(const char *model_path, const rekv_model_config *c, const rekv_profile *p,
                        const rekv_profile_origin *o, const plan_row *rows, int n_rows)
{
    printf("profile of %s on the %s backend, link ", model_path, p->backend);
    if (p->link.gbps > 0)
        printf("emulated at %g Gbit/s and %g us per copy\n", p->link.gbps, p->link.latency_us);
    else
        printf("not emulated\n");
    if (o->loaded)
        printf("  loaded from %s\n", o->path);
    else
        printf("  measured in %.2f s (%s); %s %s\n", p->measure_s, o->reason,
               o->saved ? "saved to" : "cache", o->saved ? o->path : "not written");
    printf("link\n");
    printf("  host->device %10.3f GB/s, latency %8.1f us\n", p->h2d_bw * 1e-9,
           p->h2d_latency * 1e6);
    printf("  device->host %10.3f GB/s, latency %8.1f us\n", p->d2h_bw * 1e-9,
           p->d2h_latency * 1e6);
    printf("compute\n");
    printf("  linear K/V  [%d x %d] x [%d x %d]^T  %8.2f GFLOP/s\n", p->gemm_rows, c->hidden,
           rekv_config_kv_dim(c), c->hidden, p->gemm_kv_flops * 1e-9);
    printf("  linear FFN  [%d x %d] x [%d x %d]^T  %8.2f GFLOP/s\n", p->gemm_rows, c->hidden,
           c->ffn, c->hidden, p->gemm_ffn_flops * 1e-9);
    printf("  attention   %d sequences x %d tokens      %8.2f GFLOP/s\n", p->attn_batch,
           p->attn_ctx, p->attn_flops * 1e-9);
    printf("  attention   a 64-row chunk at %d tokens   %8.2f GFLOP/s\n", p->attn_ctx,
           p->attn_chunk_flops * 1e-9);
    printf("  recompute   f32 / f16 cache             %8.2f / %.2f GFLOP/s\n",
           p->recomp_flops[REKV_PROFILE_F32] * 1e-9, p->recomp_flops[REKV_PROFILE_F16] * 1e-9);
    printf("one layer's weights: %.2f MiB, T_load_w %.3f ms\n",
           p->layer_weight_bytes / (1024.0 * 1024.0), p->t_load_w * 1e3);
    printf("fitted per-layer models (a + b*n)\n");
    for (int d = 0; d < REKV_PROFILE_DTYPES; d++)
        print_linear("T_load_kv", p, &p->load_kv[d]);
    for (int d = 0; d < REKV_PROFILE_DTYPES; d++)
        print_linear("T_kv_gen", p, &p->kv_gen[d]);
    printf("planner, batch %d, fp32 cache, weights resident (per-layer step time, ms)\n",
           PLAN_BATCH);
    printf("  %6s %-7s %8s %8s %8s %8s %8s %7s %7s\n", "ctx", "best", "kv", "kvpr", "act", "hybrid",
           "split", "kv:act", "alg1");
    for (int i = 0; i < n_rows; i++) {
        const plan_row *r = &rows[i];
        printf("  %6d %-7s %8.3f %8.3f %8.3f %8.3f %8lld %4d:%-2d %4d:%d\n", r->ctx,
               tech_names[r->best], r->costs[0].t_step * 1e3, r->costs[1].t_step * 1e3,
               r->costs[2].t_step * 1e3, r->costs[3].t_step * 1e3, (long long)r->split.l,
               r->kv_parts, r->act_parts, r->alg1.kv_parts, r->alg1.act_parts);
    }
}

static json_t *json_report(const char *model_path, const rekv_profile *p,
                           const rekv_profile_origin *o, const plan_row *rows, int n_rows)
{
    json_t *plans = json_array();
    for (int i = 0; i < n_rows; i++) {
        const plan_row *r = &rows[i];
        json_t *t = json_object();
        for (int k = 0; k < REKV_TECH_COUNT; k++)
            json_object_set_new(t, tech_names[k], json_real(r->costs[k].t_step));
        json_array_append_new(plans,
                              json_pack("{s:i,s:i,s:s,s:o,s:I,s:f,s:i,s:i,s:f,s:[i,i]}", "batch",
                                        PLAN_BATCH, "ctx", r->ctx, "best", tech_names[r->best],
                                        "t_step_s", t, "kvpr_split", (json_int_t)r->split.l,
                                        "kvpr_t_s", r->split.t, "hybrid_kv_parts", r->kv_parts,
                                        "hybrid_act_parts", r->act_parts, "hybrid_kv_fraction",
                                        (double)r->kv_parts / (r->kv_parts + r->act_parts),
                                        "alg1_pattern", r->alg1.kv_parts, r->alg1.act_parts));
    }
    return json_pack("{s:s,s:{s:s,s:b,s:b,s:s},s:o,s:o}", "model", model_path, "cache", "path",
                     o->path, "loaded", o->loaded, "saved", o->saved, "reason", o->reason,
                     "profile", rekv_profile_json(p), "planner", plans);
}

typedef struct profile_opts {
    const char *model_path, *backend;
    rekv_link_config link; /* the emulated link (--link-gbps, --link-latency-us) */
    int force, json;       /* force: --reprofile */
} profile_opts;

static void profile_usage(FILE *f)
{
    fprintf(f,
            "usage: rekv profile --model PATH [--backend auto|cpu|cuda] [--link-gbps G]\n"
            "                    [--link-latency-us U] [--reprofile] [--json]\n"
            "Measures the link each way, GEMM and attention throughput at the model's\n"
            "shapes and the fitted T_load_kv(n) and T_kv_gen(n) on the backend (the GPU\n"
            "when there is one; on cpu with an emulated link of G Gbit/s and U us per\n"
            "copy when --link-gbps is given),\n"
            "caches the profile in $XDG_CACHE_HOME/rekv/profiles (or ~/.cache/...), and\n"
            "shows the planner's choices for a batch of %d at contexts 128, 512, 2048.\n"
            "  --reprofile   measure even when a valid cached profile exists\n"
            "  --json        print one JSON object\n",
            PLAN_BATCH);
}

static int profile_parse(int argc, char **argv, profile_opts *o)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"link-gbps", required_argument, 0, 'g'},
                                         {"link-latency-us", required_argument, 0, 'l'},
                                         {"reprofile", no_argument, 0, 'r'},
                                         {"backend", required_argument, 0, 'b'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    *o = (profile_opts){.backend = "auto", .link = REKV_LINK_NONE};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm':
            o->model_path = optarg;
            break;
        case 'g':
            if (cli_parse_link(&o->link, "link-gbps", optarg))
                return 2;
            break;
        case 'l':
            if (cli_parse_link(&o->link, "link-latency-us", optarg))
                return 2;
            break;
        case 'r':
            o->force = 1;
            break;
        case 'b':
            if (strcmp(optarg, "auto") && strcmp(optarg, "cpu") && strcmp(optarg, "cuda")) {
                fprintf(stderr, "rekv profile: --backend: expected auto, cpu or cuda\n");
                return 2;
            }
            o->backend = optarg;
            break;
        case 'j':
            o->json = 1;
            break;
        case 'h':
            profile_usage(stdout);
            return 0;
        default:
            profile_usage(stderr);
            return 2;
        }
    }
    if (cli_no_operands(argc, argv))
        return 2;
    if (o->model_path == NULL) {
        fprintf(stderr, "rekv profile: --model is required\n");
        return 2;
    }
    return CLI_PARSED;
}

int cli_profile(int argc, char **argv)
{
    profile_opts po;
    int prc = profile_parse(argc, argv, &po);
    if (prc != CLI_PARSED)
        return prc;
    rekv_err err = {0};
    rekv_model *model = NULL;
    rekv_profile p;
    rekv_profile_origin o;
    plan_row rows[sizeof(plan_ctx) / sizeof(plan_ctx[0])];
    int n_rows = (int)(sizeof(plan_ctx) / sizeof(plan_ctx[0])), ret = 1;
    if (rekv_model_open(po.model_path, &model, &err))
        goto fail;
    rekv_progress pr;
    rekv_progress_begin(&pr, stderr, rekv_progress_style_for(stderr, po.json), "rekv profile",
                        "measurements", 0);
    int grc = rekv_profile_get_progress(&model->config, po.backend, &po.link, NULL, po.force, &p,
                                        &o, rekv_progress_cb, &pr, &err);
    rekv_progress_end(&pr);
    if (grc)
        goto fail;
    for (int i = 0; i < n_rows; i++)
        if (plan_for(&p, &model->config, plan_ctx[i], &rows[i], &err))
            goto fail;
    if (po.json) {
        json_t *j = json_report(po.model_path, &p, &o, rows, n_rows);
        char *s = j ? json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(17)) : NULL;
        json_decref(j);
        if (!s) {
            fprintf(stderr, "rekv profile: out of memory\n");
            goto out;
        }
        printf("%s\n", s);
        free(s);
    } else {
        print_table(po.model_path, &model->config, &p, &o, rows, n_rows);
    }
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "rekv profile: %s\n", err.msg);
out:
    rekv_model_close(model);
    return ret;
}
