/* worker_start.c — what rekv-gpuworker holds before it serves: the model and its engine, the
 * kvstore (worker_store.c), the backend, the scrape port, the cost profile it measures (cached) and
 * the device's room it reports, the coordinator's socket; and the pipeline, built when the
 * coordinator's Assign answers the first Hello (which asks with mode "auto" or --mode's, the
 * profile, the device's room and --device-tokens; worker.proto): the mode, infinigen's split,
 * each sequence's device part and CLO's N_p are the coordinator's planner's, not the worker's. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/log.h"
#include "gpuworker/profile.h"
#include "gpuworker/worker_internal.h"

int wk_start_pipeline(worker *w, rekv_err *err)
{
    /* the kvstore writes the KV rows into our buffers (it must run --push-backend) */
    w->pc.push = w->push && rekv_mode_streams(w->pc.mode);
    const rekv_mode_info *mi = rekv_mode_info_of(w->pc.mode);
    w->mode = rekv_mode_name(w->pc.mode);
    int rc;
    if (mi->speculates && w->pc.skew == NULL) {
        int cached = 0;
        if ((rc = rekv_skew_prepare(w->eng, REKV_SKEW_DEFAULT_RATIO, &w->skew, &cached, err)))
            return rc;
        rekv_log(REKV_LOG_INFO, "%s: the model's skew %s", w->mode,
                 cached ? "from the cache" : "made and cached");
        w->pc.skew = &w->skew;
    }
    if (mi->head_caches && w->pc.heads == NULL) {
        int cached = 0;
        if ((rc = rekv_heads_prepare(w->eng, &w->heads, &cached, err)))
            return rc;
        rekv_log(REKV_LOG_INFO, "clo: the model's head profile %s",
                 cached ? "from the cache" : "made and cached");
        w->pc.heads = &w->heads;
    }
    if ((rc = rekv_pipeline_create(w->eng, w->be, w->kv, &w->pc, &w->pipe, err)) ||
        (rc = rekv_batcher_create(w->pipe, w->mc, w->max_batch, &w->batch, err)))
        return rc;
    w->wm.page_locked = rekv_pipeline_page_locked(w->pipe);
    double room = rekv_backend_kv_room(w->be, 0); /* what the weights (now there) leave */
    w->device_buffer_bytes = room > 0 ? (uint64_t)room : 0;
    return 0;
}

int wk_take_assign(worker *w, const Rekv__Worker__Assign *a, rekv_err *err)
{
    rekv_mode m;
    if (a->mode == NULL || rekv_mode_parse(a->mode, &m))
        return rekv_errf(err, -EPROTO, "the coordinator assigned an unknown mode \"%s\"",
                         a->mode ? a->mode : "");
    if (!w->auto_mode && m != w->pc.mode)
        return rekv_errf(err, -EPROTO,
                         "the coordinator assigned mode %s to a worker started with --mode %s",
                         a->mode, rekv_mode_name(w->pc.mode));
    if (rekv_mode_streams(m) && w->kv_ep == NULL)
        return rekv_errf(err, -EPROTO,
                         "the coordinator assigned mode %s, which needs a kvstore, and this "
                         "worker has none",
                         a->mode);
    if (w->auto_mode && rekv_mode_approximate(m) && !w->approximate)
        return rekv_errf(err, -EPROTO,
                         "the coordinator assigned the approximate mode %s, and this worker was "
                         "not started with --approximate",
                         a->mode);
    /* exactly what the coordinator's planner decided (co_plan_assign) */
    w->pc.mode = m;
    w->pc.split = (int)a->split;
    w->pc.device_tokens = (int)a->device_tokens;
    w->pc.persist_np = a->persist_np;
    w->assigned = 1;
    rekv_log(REKV_LOG_INFO,
             "the coordinator assigned mode %s, each sequence's first %d tokens' K,V on the "
             "device, N_p %.1f (%s)",
             a->mode, w->pc.device_tokens, w->pc.persist_np,
             a->reason && *a->reason ? a->reason : "no reason given");
    int rc = 0;
    if (w->kv_lost) /* built once the store is back (wk_kv_reconnect); unavailable till then */
        w->rebuild = 1;
    else
        rc = wk_start_pipeline(w, err);
    if (rc == 0)
        wk_send_hello(w);
    return rc;
}

/* The backend, the scrape port, and the profile the planner prices this worker's steps with
 * (measured here, cached on disk); the device's room for the coordinator's mode choice. */
static int start_backend(worker *w, const wk_start_args *a, rekv_err *err)
{
    char note[1200];
    int rc;
    if ((rc = rekv_backend_create(a->backend, &a->link, &w->be, note, sizeof(note), err)))
        return rc;
    if (note[0])
        rekv_log(REKV_LOG_INFO, "%s", note);
    rekv_worker_metrics_init(&w->wm, w->be, w->name, &w->mode);
    if (a->metrics_listen) {
        rekv_metrics_server_opts mo = {.allow_remote = a->metrics_public};
        if ((rc = rekv_metrics_server_create_opts(a->metrics_listen, &mo, &w->metrics, err)))
            return rc;
        rekv_log(REKV_LOG_INFO, "metrics on %s (GET /metrics)", a->metrics_listen);
    }
    rekv_profile prof;
    rekv_profile_origin origin;
    if ((rc = rekv_profile_get(w->mc, w->be->iface->name, &a->link, NULL, 0, &prof, &origin, err)))
        return rc;
    rekv_profile_to_cost(&prof, w->pc.cache_dtype, &w->cost);
    if (!w->pc.offload_weights)
        w->cost.t_load_w = 0;
    /* the device's room for the KV cache: what is free less the weights when they will live on
     * the device (they are not there yet) */
    w->device_kv_room = rekv_backend_kv_room(
        w->be, w->pc.offload_weights ? 0 : (double)rekv_engine_weight_bytes(w->eng));
    return 0;
}

/* The DEALER to the coordinator (CurveZMQ on a tcp:// endpoint with a server key). */
static int connect_coordinator(worker *w, const char *coord, void **zctx, rekv_err *err)
{
    *zctx = zmq_ctx_new();
    w->sock = *zctx ? zmq_socket(*zctx, ZMQ_DEALER) : NULL;
    int linger = 0, ivl = 100, rc;
    if (w->sock == NULL)
        return rekv_errf(err, -ENOMEM, "zmq socket: %s", zmq_strerror(errno));
    zmq_setsockopt(w->sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(w->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof(ivl));
    const char *ckey = NULL;
    rekv_err cerr = {0};
    if ((rc = rekv_curve_server_key(coord, &ckey, &cerr)) ||
        (ckey && (rc = rekv_curve_client(w->sock, ckey, &cerr))))
        return rekv_errf(err, rc, "%s: %s", coord, cerr.msg);
    if (zmq_connect(w->sock, coord) != 0)
        return rekv_errf(err, -errno, "%s: connect: %s", coord, zmq_strerror(errno));
    return 0;
}

int wk_start(worker *w, const wk_start_args *a, rekv_model **model, void **zctx, rekv_err *err)
{
    int rc;
    if ((rc = rekv_model_open(a->model_path, model, err)) ||
        (rc = rekv_engine_create(*model, &w->eng, err)))
        return rc;
    w->mc = rekv_engine_config(w->eng);
    if (w->kv_ep && w->pc.prefix_cache) { /* once: every pipeline of this model keys with it */
        w->pc.fingerprint = rekv_engine_fingerprint(w->eng);
        rekv_log(REKV_LOG_INFO, "prefix cache on: the model's fingerprint is %016llx",
                 (unsigned long long)w->pc.fingerprint);
    }
    if (w->kv_ep) {
        if ((rc = wk_kv_connect(w, err)))
            return rc; /* 1: asked to stop */
    } else if (!a->auto_mode && rekv_mode_streams(w->pc.mode)) {
        return rekv_errf(err, -EINVAL,
                         "--mode %s keeps the KV cache in the kvstore: give --kvstore",
                         rekv_mode_name(w->pc.mode));
    }
    if ((rc = start_backend(w, a, err)))
        return rc;
    /* the first Hello asks with this mode (or "auto"); the pipeline waits for the Assign */
    w->auto_mode = a->auto_mode;
    w->mode = a->auto_mode ? "auto" : rekv_mode_name(w->pc.mode);
    return connect_coordinator(w, a->coord, zctx, err);
}
