/* cli_session.c — what `rekv generate` and `rekv bench decode` need to run the pipeline in this
 * process: a backend, a private kvstore (a child process) for the offloaded modes, and the
 * pipeline, with the KVPR split and the HybridServe ratio chosen from the machine's profile
 * (gpuworker/profile.h, cached per machine, model and link) when the user does not force them. */
#include "coordinator/cli/cli_session.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "coordinator/cli/cli_profile.h"
#include "coordinator/planner.h"
#include "gpuworker/heads.h"

int cli_session_choose(const rekv_model_config *c, const char *backend,
                       const rekv_link_config *link, int batch, int ctx, rekv_pipeline_config *cfg,
                       rekv_err *err)
{
    const rekv_mode_info *mi = rekv_mode_info_of(cfg->mode);
    if (mi == NULL)
        return rekv_errf(err, -EINVAL, "mode %d is not a mode", (int)cfg->mode);
    int need_split = mi->split != REKV_SPLIT_NONE && cfg->split < 0;
    int need_ratio = mi->store == REKV_STORE_PATTERN && cfg->kv_parts < 0;
    int need_np = mi->head_caches && cfg->persist_np < 0;
    if (!need_split && !need_ratio && !need_np)
        return 0;
    /* the profile of this machine, model and link: cached after its first measurement */
    rekv_profile pf;
    int rc = rekv_profile_get(c, backend, link, NULL, 0, &pf, NULL, err);
    if (rc)
        return rc;
    int dev = cfg->device_tokens < ctx ? cfg->device_tokens : ctx;
    if (need_split) {
        rekv_cost_profile prof;
        rekv_profile_to_cost(&pf, cfg->cache_dtype, &prof);
        if ((rc = cli_plan_split(&prof, c, cfg, batch, ctx, REKV_PLAN_INFINIGEN_PRIOR, &cfg->split,
                                 err)))
            return rc;
    }
    if (need_ratio && (rc = cli_plan_hybrid(&pf, c, cfg->cache_dtype, cfg->offload_weights, batch,
                                            ctx, dev, &cfg->kv_parts, &cfg->act_parts, err)))
        return rc;
    if (need_np) { /* CLO Eq. 12 from the measured link and forward rate: the planner's rule */
        rekv_cost_profile prof;
        rekv_plan_model pm;
        rekv_profile_to_cost(&pf, cfg->cache_dtype, &prof);
        rekv_plan_model_from_config(c, &pm);
        cfg->persist_np =
            rekv_plan_persist_np(&prof, &pm, c->head_dim, batch, ctx, cfg->max_fraction,
                                 rekv_kv_elem_bytes(cfg->cache_dtype, c->head_dim));
    }
    return 0;
}

int cli_session_auto(rekv_engine *e, const cli_pipeline_opts *po, int batch, int ctx_max,
                     int approximate, rekv_pipeline_config *cfg, char *why, size_t why_len,
                     rekv_err *err)
{
    const rekv_model_config *c = rekv_engine_config(e);
    rekv_backend *be;
    int rc = rekv_backend_create(po->backend, &po->link, &be, NULL, 0, err);
    if (rc)
        return rc;
    double room =
        rekv_backend_kv_room(be, cfg->offload_weights ? 0 : (double)rekv_engine_weight_bytes(e));
    char name[32];
    snprintf(name, sizeof(name), "%s", be->iface->name);
    rekv_backend_destroy(be);
    rekv_profile pf;
    if ((rc = rekv_profile_get(c, name, &po->link, NULL, 0, &pf, NULL, err)))
        return rc;
    rekv_cost_profile prof;
    rekv_profile_to_cost(&pf, cfg->cache_dtype, &prof);
    if (!cfg->offload_weights)
        prof.t_load_w = 0;
    rekv_plan_model pm;
    rekv_plan_model_from_config(c, &pm);
    pm.weight_elem_bytes = rekv_engine_weight_elem_bytes(e);
    rekv_mode_pick mp;
    /* infinigen at the prior f, as a served worker's first pick, with the split it would run */
    rekv_plan_approx ap = {.infinigen_recompute = 1};
    if ((rc = rekv_plan_pick_mode(&prof, &pm, batch, ctx_max,
                                  rekv_kv_elem_bytes(cfg->cache_dtype, c->head_dim), room,
                                  cfg->offload_weights, approximate ? &ap : NULL, &mp, err)))
        return rc;
    cfg->mode = mp.resident ? REKV_MODE_RESIDENT : rekv_plan_tech_mode(mp.tech);
    if (cfg->mode == REKV_MODE_HYBRID) /* the pattern it was priced at, within the device */
        cfg->kv_parts = mp.hybrid_kv_parts, cfg->act_parts = mp.hybrid_act_parts;
    /* the device part a served worker in this mode is assigned (co_plan_assign) */
    cfg->device_tokens =
        (int)rekv_plan_device_tokens(&pm, c->head_dim, cfg->mode, batch, ctx_max,
                                     rekv_kv_elem_bytes(cfg->cache_dtype, c->head_dim), room, -1);
    if (rekv_mode_info_of(cfg->mode)->split == REKV_SPLIT_SELECTED)
        cfg->split = (int)mp.costs[REKV_TECH_INFINIGEN].kvpr_l;
    if (why) {
        int n = snprintf(why, why_len,
                         "%s with %d tokens of each sequence on the device (room %.1f MB)",
                         rekv_mode_name(cfg->mode), cfg->device_tokens, room * 1e-6);
        if (!mp.resident && n >= 0 && (size_t)n < why_len)
            n += snprintf(why + n, why_len - (size_t)n, "; step priced %.3g ms",
                          mp.costs[mp.tech].t_step * 1e3 * c->n_layers);
        if (mp.approximate && n >= 0 && (size_t)n < why_len)
            snprintf(why + n, why_len - (size_t)n, ", infinigen (approximate) %.3g ms at f %.2f%s",
                     mp.costs[REKV_TECH_INFINIGEN].t_step * 1e3 * c->n_layers,
                     mp.infinigen_fraction,
                     mp.infinigen_fits ? "" : ", its partial keys do not fit the device");
    }
    return 0;
}

/* The private store of the modes that offload: a forked child that never uses CUDA, or (push with
 * a GPU backend) the exec'd rekv-kvstore program, which opens CUDA for itself; sized for batch
 * sequences of ctx tokens, its socket and spill files in s->dir (made here). */
static int session_store_open(cli_session *s, const rekv_model_config *c,
                              const rekv_pipeline_config *cfg, const rekv_link_config *link,
                              int batch, int ctx, rekv_err *err)
{
    int rc;
    const char *tmp = getenv("TMPDIR");
    snprintf(s->dir, sizeof(s->dir), "%s/rekv-local.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(s->dir) == NULL) {
        rc = rekv_errf(err, -errno, "%s: %s", s->dir, strerror(errno));
        s->dir[0] = '\0';
        return rc;
    }
    char ep[4200];
    snprintf(ep, sizeof(ep), "ipc://%s/kv.sock", s->dir);
    rekv_kvstore_config kc;
    rekv_kvstore_config_defaults(&kc);
    kc.endpoint = ep;
    kc.spill_dir = s->dir;
    /* this process is the store's only client and holds its pins for a whole step, which can
     * take minutes for a long prefill on the cpu backend; the store dies with it */
    kc.lease_ms = 3600 * 1000;
    /* --push: the store copies the KV rows into our device buffers with a backend of the
     * kind ours is */
    kc.push_backend = cfg->push ? s->be->iface->name : NULL;
    if (cfg->push && link && link->gbps > 0) { /* over a link like ours */
        kc.push_link.gbps = link->gbps;
        kc.push_link.latency_us = link->latency_us;
    }
    if ((rc = rekv_kv_geometry_from_config(c, cfg->cache_dtype, &kc.geometry, err)))
        return rc;
    size_t kvb = rekv_kv_block_bytes(&kc.geometry), actb = rekv_kv_act_block_bytes(&kc.geometry);
    size_t slot = ((kvb > actb ? kvb : actb) + 4095) & ~(size_t)4095;
    uint64_t blocks = (uint64_t)batch * (uint64_t)((ctx + 15) / 16 + 1) * (uint64_t)c->n_layers *
                      (rekv_pipeline_keeps_act(cfg) ? 2 : 1);
    kc.host_bytes = blocks * slot + blocks * slot / 8 + (4u << 20);
    /* REKV_LOCAL_ARENA=SIZE: a smaller arena, to measure a batch that spills (the steps run
     * in layer windows); not a flag: the private store is sized to fit otherwise */
    const char *arena = getenv("REKV_LOCAL_ARENA");
    uint64_t ab;
    if (arena && *arena) {
        if (rekv_parse_size(arena, &ab) || ab == 0)
            return rekv_errf(err, -EINVAL, "REKV_LOCAL_ARENA=%s: expected bytes, e.g. 64M", arena);
        kc.host_bytes = ab;
    }
    if ((rc = rekv_kvstore_spawn(&kc, &s->store_pid, err)))
        return rc;
    return rekv_kvstore_client_connect(ep, NULL, 60000, &s->store, err);
}

/* infinigen and clo: the skew (po->skew's file, or the model's, made once and cached), and clo's
 * head profile, each where pc brings none; said on stderr when made now. */
static int session_prepare_sparse(cli_session *s, rekv_engine *e, const cli_pipeline_opts *po,
                                  rekv_pipeline_config *pc, rekv_err *err)
{
    int rc = 0;
    const rekv_mode_info *mi = rekv_mode_info_of(pc->mode);
    if (mi->speculates && pc->skew == NULL) {
        if (po->skew) {
            rc = rekv_skew_load(po->skew, e, &s->skew, err);
        } else {
            int cached = 0;
            uint64_t t0 = rekv_now_ns();
            rc = rekv_skew_prepare(e, po->partial_ratio, &s->skew, &cached, err);
            if (rc == 0 && !cached)
                fprintf(stderr,
                        "rekv: %s: skewed the model on a sample it generated "
                        "(%.1f s; cached for next time)\n",
                        rekv_mode_name(pc->mode), (double)(rekv_now_ns() - t0) * 1e-9);
        }
        if (rc)
            return rc;
        pc->skew = &s->skew;
    }
    if (mi->head_caches && pc->heads == NULL) {
        int cached = 0;
        uint64_t t0 = rekv_now_ns();
        if ((rc = rekv_heads_prepare(e, &s->heads, &cached, err)))
            return rc;
        if (!cached)
            fprintf(stderr,
                    "rekv: clo: profiled the model's heads on a sample it generated "
                    "(%.1f s; cached for next time)\n",
                    (double)(rekv_now_ns() - t0) * 1e-9);
        pc->heads = &s->heads;
    }
    return 0;
}

int cli_session_open(cli_session *s, rekv_engine *e, const cli_pipeline_opts *po,
                     const rekv_pipeline_config *cfg, int batch, int ctx, rekv_err *err)
{
    memset(s, 0, sizeof(*s));
    char note[1200];
    int rc = 0;
    if ((rc = rekv_backend_create(po->backend, &po->link, &s->be, note, sizeof(note), err)))
        goto fail;
    static int said; /* once per process (bench opens a session per mode) */
    if (!said && strncmp(note, "no usable GPU", 13) == 0) {
        fprintf(stderr, "rekv: %s\n", note); /* a GPU build without a GPU says so */
        said = 1;
    }
    if (rekv_mode_streams(cfg->mode) &&
        (rc = session_store_open(s, rekv_engine_config(e), cfg, &po->link, batch, ctx, err)))
        goto fail;
    rekv_pipeline_config pc = *cfg;
    pc.push = cfg->push && rekv_mode_streams(cfg->mode); /* --push: the modes that stream KV */
    if ((rc = session_prepare_sparse(s, e, po, &pc, err)) ||
        (rc = rekv_pipeline_create(e, s->be, s->store, &pc, &s->p, err)))
        goto fail;
    return 0;
fail:
    cli_session_close(s);
    return rc;
}

void cli_session_close(cli_session *s)
{
    rekv_pipeline_free(s->p);
    rekv_skew_free(&s->skew);
    rekv_heads_free(&s->heads);
    rekv_kvstore_client_close(s->store);
    if (s->store_pid > 0)
        rekv_kvstore_reap(s->store_pid);
    rekv_backend_destroy(s->be);
    if (s->dir[0])
        rmdir(s->dir); /* the store removed its socket and spill files */
    memset(s, 0, sizeof(*s));
}

/* The options that take a word: 1 consumed, 0 not one of them, -1 bad value (printed). */
static int parse_pipeline_word(int c, const char *arg, cli_pipeline_opts *o)
{
    switch (c) {
    case CLI_OPT_MODE:
        if (rekv_mode_parse(arg, &o->cfg.mode)) {
            fprintf(stderr,
                    "rekv: --mode: expected resident, offload, kvpr, act, hybrid, infinigen or "
                    "clo\n");
            return -1;
        }
        return 1;
    case CLI_OPT_SCHEDULE:
        if (strcmp(arg, "row") == 0)
            o->cfg.schedule = REKV_SCHED_ROW;
        else if (strcmp(arg, "column") == 0)
            o->cfg.schedule = REKV_SCHED_COLUMN;
        else {
            fprintf(stderr, "rekv: --schedule: expected row or column\n");
            return -1;
        }
        return 1;
    case CLI_OPT_RATIO: {
        unsigned kv, act;
        char tail;
        if (sscanf(arg, "%u:%u%c", &kv, &act, &tail) != 2 || kv + act == 0 || kv > 1024 ||
            act > 1024) {
            fprintf(stderr, "rekv: --ratio: expected KV:ACT block counts like 2:1\n");
            return -1;
        }
        o->cfg.kv_parts = (int)kv;
        o->cfg.act_parts = (int)act;
        return 1;
    }
    case CLI_OPT_CACHE_DTYPE:
        if (rekv_cache_dtype_parse(arg, &o->cfg.cache_dtype) != 0) {
            fprintf(stderr, "rekv: --cache-dtype %s: expected f16, f32, int8 or int4\n", arg);
            return -1;
        }
        return 1;
    case CLI_OPT_BACKEND:
        if (strcmp(arg, "auto") && strcmp(arg, "cpu") && strcmp(arg, "cuda")) {
            fprintf(stderr, "rekv: --backend: expected auto, cpu or cuda\n");
            return -1;
        }
        o->backend = arg;
        return 1;
    case CLI_OPT_KV_POOL_POLICY:
        if (strcmp(arg, "counter") == 0 || strcmp(arg, "fifo") == 0)
            o->cfg.kv_pool_policy = arg[0] == 'c' ? REKV_KV_POOL_COUNTER : REKV_KV_POOL_FIFO;
        else {
            fprintf(stderr, "rekv: --kv-pool-policy: expected counter or fifo\n");
            return -1;
        }
        return 1;
    case CLI_OPT_SELECT:
        if (strcmp(arg, "speculate") == 0)
            o->cfg.select = REKV_SELECT_SPECULATE;
        else if (strcmp(arg, "random") == 0)
            o->cfg.select = REKV_SELECT_RANDOM;
        else if (strcmp(arg, "all") == 0)
            o->cfg.select = REKV_SELECT_ALL;
        else {
            fprintf(stderr, "rekv: --select: expected speculate, random or all\n");
            return -1;
        }
        return 1;
    }
    return 0;
}

/* The options that take a number: 1 consumed, 0 not one of them, -1 bad value (printed). */
static int parse_pipeline_number(int c, const char *arg, cli_pipeline_opts *o)
{
    long v;
    double d;
    switch (c) {
    case CLI_OPT_GPU_BATCHES:
        if (cli_parse_int("gpu-batches", arg, 1, 64, &v))
            return -1;
        o->cfg.gpu_batches = (int)v;
        return 1;
    case CLI_OPT_SPLIT:
        if (cli_parse_int("split", arg, 0, 1 << 30, &v))
            return -1;
        o->cfg.split = (int)v;
        return 1;
    case CLI_OPT_ACT_GPU:
        if (cli_parse_int("act-gpu-blocks", arg, 0, 1 << 20, &v))
            return -1;
        o->cfg.act_gpu_blocks = (int)v;
        return 1;
    case CLI_OPT_DEVICE_TOKENS:
        if (cli_parse_int("device-tokens", arg, 0, 1 << 24, &v))
            return -1;
        o->cfg.device_tokens = (int)v;
        return 1;
    case CLI_OPT_LOOKAHEAD:
        if (cli_parse_int("lookahead", arg, 0, 1, &v))
            return -1;
        o->cfg.lookahead = (int)v;
        return 1;
    case CLI_OPT_ALPHA:
        if (strcmp(arg, "inf") == 0) {
            o->cfg.alpha = INFINITY;
            return 1;
        }
        if (cli_parse_float("alpha", arg, 1e-6, 1e6, &d))
            return -1;
        o->cfg.alpha = (float)d;
        return 1;
    case CLI_OPT_FETCH_CAP:
        if (cli_parse_float("fetch-cap", arg, 1e-6, 1, &d))
            return -1;
        o->cfg.max_fraction = (float)d;
        return 1;
    case CLI_OPT_PARTIAL_RATIO:
        if (cli_parse_float("partial-ratio", arg, 1e-6, 1, &d))
            return -1;
        o->partial_ratio = d;
        return 1;
    case CLI_OPT_ETA:
        if (cli_parse_float("eta", arg, -0.999999, 1, &d))
            return -1;
        o->cfg.eta = (float)d;
        return 1;
    case CLI_OPT_POWER:
        if (cli_parse_float("power", arg, 1e-6, 1e3, &d))
            return -1;
        o->cfg.power = (float)d;
        return 1;
    case CLI_OPT_PERSIST_NP:
        if (strcmp(arg, "auto") == 0)
            o->cfg.persist_np = -1;
        else if (cli_parse_float("persist-np", arg, 0, 1e9, &d))
            return -1;
        else
            o->cfg.persist_np = d;
        return 1;
    }
    return 0;
}

int cli_parse_pipeline_opt(int c, const char *arg, cli_pipeline_opts *o)
{
    switch (c) {
    case CLI_OPT_OFFLOAD_WEIGHTS:
        o->cfg.offload_weights = 1;
        return 1;
    case CLI_OPT_PUSH:
        o->cfg.push = 1;
        return 1;
    case CLI_OPT_TRACE:
        o->trace = arg;
        return 1;
    case CLI_OPT_SKEW:
        o->skew = arg;
        return 1;
    case CLI_OPT_LINK_GBPS:
        return cli_parse_link(&o->link, "link-gbps", arg) ? -1 : 1;
    case CLI_OPT_LINK_LATENCY:
        return cli_parse_link(&o->link, "link-latency-us", arg) ? -1 : 1;
    case CLI_OPT_DEVICE_MEMORY:
        return cli_parse_link(&o->link, "device-memory", arg) ? -1 : 1;
    case CLI_OPT_KV_POOL_BYTES: {
        uint64_t v;
        if (rekv_parse_size(arg, &v) || v == 0 || v > SIZE_MAX) {
            fprintf(stderr, "rekv: --kv-pool-bytes: expected a byte count > 0 (K, M, G)\n");
            return -1;
        }
        o->cfg.kv_pool_bytes = (size_t)v;
        return 1;
    }
    }
    int r = parse_pipeline_word(c, arg, o);
    return r ? r : parse_pipeline_number(c, arg, o);
}

void cli_pipeline_opts_defaults(cli_pipeline_opts *o)
{
    memset(o, 0, sizeof(*o));
    rekv_pipeline_config_defaults(&o->cfg);
    o->cfg.split = -1;    /* from the cost model */
    o->cfg.kv_parts = -1; /* from the cost model */
    o->cfg.act_parts = -1;
    o->cfg.persist_np = -1; /* clo: Eq. 12 from the cost model */
    o->link = REKV_LINK_NONE;
    o->backend = "auto";
    o->partial_ratio = REKV_SKEW_DEFAULT_RATIO;
}
