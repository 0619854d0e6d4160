/* worker_proto.c — rekv-gpuworker's side of the coordinator protocol (proto/worker.proto): the
 * messages it sends (Hello with what it measured, asking for its Assign until one came;
 * heartbeats; every message says whether it can run steps and the kvstore's room) and the loop's
 * callback for the coordinator's socket, which acts on Assign, Welcome, Reset, Plan and Shutdown.
 * A Plan's step runs on the step thread (worker_plan.c); until it is over the socket is left
 * unread, so messages wait their turn — but for Drops: taking a Plan, the worker reads the
 * messages already behind it, applies the Drops (jobs the coordinator ended while the Plan
 * waited: out of the batch and of the Plan's joins) and keeps the first other message for after
 * the step (w->ahead), so that an ended job runs at most the step that was running. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/log.h"
#include "gpuworker/worker_internal.h"

void wk_warn_rl(rekv_ratelimit *rl, const char *what, const char *detail)
{
    char line[1024];
    if (rekv_ratelimit_format(rl, rekv_now_ns(), line, sizeof(line), "%s%s", what, detail))
        rekv_log(REKV_LOG_WARN, "%s", line);
}

int wk_send_msg(worker *w, Rekv__Worker__WorkerMsg *m)
{
    m->version = WORKER_PROTO_VERSION;
    m->unavailable = w->unavailable;
    m->store = w->kv && w->room.host_bytes ? &w->room : NULL;
    size_t n = rekv__worker__worker_msg__get_packed_size(m);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL)
        return -ENOMEM;
    rekv__worker__worker_msg__pack(m, buf);
    int rc = zmq_send(w->sock, buf, n, 0) < 0 ? -errno : 0;
    free(buf);
    w->last_sent_ns = rekv_now_ns();
    static rekv_ratelimit rl = REKV_RATELIMIT_INIT;
    if (rc)
        wk_warn_rl(&rl, "send to the coordinator: ", zmq_strerror(-rc));
    return rc;
}

void wk_send_hello(worker *w)
{
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.name = (char *)w->name;
    h.backend = (char *)w->be->iface->name;
    h.mode = (char *)w->mode;
    h.max_batch = (uint32_t)w->max_batch;
    h.vocab = (uint32_t)w->mc->vocab;
    h.max_pos = (uint32_t)w->mc->max_pos;
    h.eos_id = w->mc->eos_id;
    h.model = (char *)w->model;
    h.pid = (uint64_t)getpid();
    Rekv__Worker__CostProfile cp = REKV__WORKER__COST_PROFILE__INIT;
    cp.h2d_bw = w->cost.h2d_bw;
    cp.h2d_latency = w->cost.h2d_latency;
    cp.gemm_flops = w->cost.gemm_flops;
    cp.fwd_flops_rate = w->cost.fwd_flops_rate;
    cp.fwd_gemm_a = w->cost.fwd_gemm.a;
    cp.fwd_gemm_b = w->cost.fwd_gemm.b;
    cp.attn_flops_rate = w->cost.attn_flops_rate;
    cp.attn_chunk_flops_rate = w->cost.attn_chunk_flops_rate;
    cp.load_kv_a = w->cost.load_kv.a;
    cp.load_kv_b = w->cost.load_kv.b;
    cp.kv_gen_a = w->cost.kv_gen.a;
    cp.kv_gen_b = w->cost.kv_gen.b;
    cp.t_load_w = w->cost.t_load_w;
    h.profile = &cp;
    h.hidden = (uint32_t)w->mc->hidden;
    h.kv_dim = (uint32_t)rekv_config_kv_dim(w->mc);
    h.n_layers = (uint32_t)w->mc->n_layers;
    /* whole bytes per element for older coordinators (an int8/int4 cache: its activations');
     * the planner prices KV rows by cache_row_bytes */
    h.cache_elem_bytes = (uint32_t)rekv_dtype_size(rekv_act_dtype(w->pc.cache_dtype));
    h.cache_row_bytes = (uint32_t)rekv_kv_row_bytes(w->pc.cache_dtype, w->mc->head_dim);
    h.offload_weights = w->pc.offload_weights;
    h.device_buffer_bytes = w->device_buffer_bytes;
    {
        const rekv_model_config *c = w->mc;
        h.layer_params = (uint64_t)rekv_config_layer_params(c);
        h.q_dim = (uint32_t)rekv_config_q_dim(c);
        h.weight_elem_bytes = w->eng ? rekv_engine_weight_elem_bytes(w->eng)
                                     : rekv_config_weight_elem_bytes(c);
        int window;
        h.windowed_layers = (uint32_t)rekv_config_windowed_layers(c, &window);
        h.window = (uint32_t)window;
    }
    h.device_kv_room = w->device_kv_room;
    h.kvstore = w->kv != NULL;
    h.approximate = w->approximate;
    /* what the pipeline was built with (w->pc while it is not, as after a lost kvstore) */
    const rekv_pipeline_config *pc = w->pipe ? rekv_pipeline_get_config(w->pipe) : &w->pc;
    h.device_tokens = (uint32_t)pc->device_tokens;
    h.persist_np = pc->persist_np;
    h.split = pc->split > 0 ? (uint32_t)pc->split : 0;
    h.prefix_cache = w->kv != NULL && rekv_pipeline_takes_prefix(pc);
    /* before the Assign: ask for it, with what the planner decides by beyond the above */
    h.ask = !w->assigned;
    h.device_tokens_asked = w->device_tokens;
    h.head_dim = (uint32_t)w->mc->head_dim;
    h.fetch_cap = w->pc.max_fraction;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_HELLO;
    m.hello = &h;
    wk_send_msg(w, &m);
    w->awaiting_welcome = 1;
    w->hello_sent_ns = rekv_now_ns();
}

void wk_send_heartbeat(worker *w)
{
    Rekv__Worker__Heartbeat hb = REKV__WORKER__HEARTBEAT__INIT;
    hb.steps = w->steps;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_HEARTBEAT;
    m.heartbeat = &hb;
    wk_send_msg(w, &m);
}

/* Drops the jobs of d (worker.proto Drop) from the batch and from plan's joins (plan: one read but
 * not run yet, or NULL). */
static void apply_drop(worker *w, const Rekv__Worker__Drop *d, Rekv__Worker__Plan *plan)
{
    for (size_t i = 0; i < d->n_jobs; i++) {
        if (w->batch)
            rekv_batcher_cancel(w->batch, d->jobs[i]);
        for (size_t k = 0; plan && k < plan->n_join; k++) {
            if (plan->join[k]->job != d->jobs[i])
                continue;
            rekv__worker__job_spec__free_unpacked(plan->join[k], NULL);
            memmove(&plan->join[k], &plan->join[k + 1],
                    sizeof(*plan->join) * (plan->n_join - k - 1));
            plan->n_join--;
            break;
        }
    }
}

/* Acts on one message; 1 when reading stops (a step started, or the loop stops). */
static int on_message(worker *w, Rekv__Worker__CoordMsg *m)
{
    rekv_err err = {0};
    int stop = 0;
    switch (m->body_case) {
    case REKV__WORKER__COORD_MSG__BODY_ASSIGN:
        if (w->assigned || !w->awaiting_welcome)
            break; /* an answer to an earlier Hello: our pipeline is set */
        w->awaiting_welcome = 0;
        if (wk_take_assign(w, m->assign, &err)) {
            rekv_log(REKV_LOG_ERROR, "%s", err.msg);
            w->exit_code = 1;
            rekv_evloop_stop(w->loop);
            stop = 1;
        }
        break;
    case REKV__WORKER__COORD_MSG__BODY_WELCOME:
        w->awaiting_welcome = 0;
        rekv_log(REKV_LOG_INFO, "the coordinator accepted us (session %llu)",
                 (unsigned long long)m->welcome->session);
        wk_kv_drop_leftovers(w); /* before any Plan of ours creates a sequence */
        break;
    case REKV__WORKER__COORD_MSG__BODY_RESET:
        /* our Hello is on its way already: one answer per Hello — unless it went out four
         * heartbeats ago, when the coordinator that got it died before answering and the
         * one answering now never will (a live one answers within a loop round) */
        if (w->awaiting_welcome && rekv_now_ns() - w->hello_sent_ns < 4ull * w->hb_ms * 1000000ull)
            break;
        if (w->batch) {
            if (rekv_batcher_running(w->batch))
                rekv_log(REKV_LOG_WARN, "the coordinator reset us: dropping %d jobs",
                         rekv_batcher_running(w->batch));
            rekv_batcher_clear(w->batch);
        }
        wk_send_hello(w);
        break;
    case REKV__WORKER__COORD_MSG__BODY_PLAN:
        /* not a Plan for the session our Hello ended, nor one before we have a mode */
        if (!w->awaiting_welcome && w->pipe != NULL)
            return wk_plan_start(w, m); /* takes m */
        if (!w->awaiting_welcome && w->kv_lost)
            wk_refuse_plan(w, m->plan);
        break;
    case REKV__WORKER__COORD_MSG__BODY_DROP:
        apply_drop(w, m->drop, NULL);
        break;
    case REKV__WORKER__COORD_MSG__BODY_SHUTDOWN:
        if (m->shutdown->reason && *m->shutdown->reason)
            rekv_log(REKV_LOG_ERROR, "the coordinator refused this worker: %s",
                     m->shutdown->reason);
        else
            rekv_log(REKV_LOG_INFO, "the coordinator asked us to stop");
        rekv_evloop_stop(w->loop);
        stop = 1;
        break;
    default:
        break;
    }
    rekv__worker__coord_msg__free_unpacked(m, NULL);
    return stop;
}

/* The coordinator's next message from the socket, or NULL when none waits (malformed ones are
 * skipped, said once in a while). */
static Rekv__Worker__CoordMsg *recv_one(worker *w)
{
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, w->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            return NULL;
        }
        Rekv__Worker__CoordMsg *m =
            rekv__worker__coord_msg__unpack(NULL, zmq_msg_size(&msg), zmq_msg_data(&msg));
        zmq_msg_close(&msg);
        if (m && m->version == WORKER_PROTO_VERSION)
            return m;
        static rekv_ratelimit rl = REKV_RATELIMIT_INIT;
        wk_warn_rl(&rl, "a malformed message from the coordinator; ignored", "");
        if (m)
            rekv__worker__coord_msg__free_unpacked(m, NULL);
    }
}

/* Before plan's step: the Drops already behind it, applied; the first other message is kept. */
static void read_ahead(worker *w, Rekv__Worker__Plan *plan)
{
    while (w->ahead == NULL) {
        Rekv__Worker__CoordMsg *m = recv_one(w);
        if (m == NULL)
            return;
        if (m->body_case == REKV__WORKER__COORD_MSG__BODY_DROP) {
            apply_drop(w, m->drop, plan);
            rekv__worker__coord_msg__free_unpacked(m, NULL);
        } else {
            w->ahead = m;
        }
    }
}

void wk_on_coordinator(rekv_evloop *loop, void *ctx, short revents)
{
    worker *w = ctx;
    for (;;) {
        Rekv__Worker__CoordMsg *m = w->ahead;
        w->ahead = NULL;
        if (m == NULL && (m = recv_one(w)) == NULL)
            return;
        if (m->body_case == REKV__WORKER__COORD_MSG__BODY_PLAN && !w->awaiting_welcome &&
            w->pipe != NULL)
            read_ahead(w, m->plan);
        if (on_message(w, m))
            return; /* a step runs (the rest waits in the socket), or the loop stops */
    }
}
