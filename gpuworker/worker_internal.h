/* worker_internal.h — the state of rekv-gpuworker, shared by its files and by nothing else:
 * worker_main.c (the command line, the event loop, teardown), worker_start.c (loading, the
 * backend, the pipeline in its mode), worker_proto.c (the coordinator protocol), worker_plan.c
 * (running a Plan's step on the step thread and reporting it) and worker_store.c (the kvstore
 * connection: lease, loss, reconnection). One thread runs the event loop (common/evloop.h); a
 * step runs on the step thread meanwhile, and the loop leaves the coordinator's socket unread
 * until the step is over. */
#ifndef REKV_GPUWORKER_WORKER_INTERNAL_H
#define REKV_GPUWORKER_WORKER_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "common/cost.h"
#include "common/evloop.h"
#include "common/metrics.h"
#include "common/ratelimit.h"
#include "gpuworker/batcher.h"
#include "gpuworker/heads.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "gpuworker/worker_metrics.h"
#include "kvstore/kvstore.h"
#include "proto/worker.pb-c.h"

#define WORKER_PROTO_VERSION 1u /* REKV_WORKER_PROTO_VERSION in coordinator.h */
#define KV_WAIT_MS 30000ull     /* how long a worker started beside its kvstore waits for it */
#define KV_SAY_WAIT_MS 2000ull  /* and after how long it says so */
#define WORKER_TIMED_EVERY 8    /* one step in this many is timed (busy times for the planner) */

/* The step thread (worker_plan.c). */
typedef struct wk_stepper {
    pthread_t t;
    pthread_mutex_t mu;
    pthread_cond_t go;
    int started, pending, quit; /* pending: a step to run (set here, cleared by the thread) */
    rekv_batcher *batch;
    const rekv_batch_event *ev;
    int n_ev;
    rekv_err err;
    int rc;
    int done_fd; /* eventfd the thread writes when a step is over */
} wk_stepper;

/* The Plan being run: what its step's report needs, from its start to its end. */
typedef struct wk_plan {
    Rekv__Worker__CoordMsg *msg;    /* the Plan's message (owned), NULL when none runs */
    const Rekv__Worker__Plan *plan; /* msg->plan */
    Rekv__Worker__JobProgress *jp;  /* [cap] the jobs' reports */
    Rekv__Worker__JobProgress **pp; /* [cap] pointers to them */
    int32_t *toks;                  /* [cap] a token per report */
    rekv_err *errs;                 /* [cap] the joins' errors */
    uint32_t *cached;               /* [n_join] prompt tokens each join took from the prefix cache */
    size_t n, cap;                  /* reports filled, room */
    int lost;                       /* the kvstore is gone (a join or the step said so) */
    int timed;                      /* this step's busy times are measured */
    int running;                    /* jobs in the step */
    rekv_backend_stats bs0;         /* the backend's stats before the step */
    uint64_t t0;                    /* when the step started */
    char other_msg[160];            /* the others' error when one job's blocks were lost */
} wk_plan;

typedef struct worker {
    void *sock;          /* DEALER to the coordinator */
    rekv_pipeline *pipe; /* NULL until the mode is known (--mode auto: the coordinator's Assign) */
    rekv_batcher *batch;
    rekv_engine *eng;
    rekv_pipeline_config pc; /* the pipeline to build (pc.mode once known) */
    rekv_skew skew;          /* infinigen, clo: the model's (rekv_skew_prepare; cached) */
    rekv_heads heads;        /* clo: the model's head profile (rekv_heads_prepare; cached) */
    int push;                /* --push */
    int approximate;         /* --approximate: the coordinator may assign an approximate mode */
    int auto_mode;           /* --mode auto: the coordinator chooses the mode */
    int assigned;            /* the coordinator's Assign came: pc holds its mode, split, device
                                part and N_p (until then every Hello asks for it) */
    const rekv_model_config *mc;
    const char *name, *mode, *model; /* mode: "auto" until the pipeline is built */
    int max_batch;
    uint64_t steps;
    uint64_t last_sent_ns;        /* for heartbeats */
    uint64_t hello_sent_ns;       /* when the Hello awaiting its Welcome went out */
    int awaiting_welcome;         /* a Hello is out: Resets and Plans before the Welcome are stale
                                   * (messages that crossed it) and are ignored */
    uint64_t room_ns;             /* when the store's room (room) was last read */
    int leftovers_dropped;        /* what a dead worker of our name left in the kvstore is gone
                                   * (dropped at our first Welcome, wk_kv_drop_leftovers) */
    rekv_backend *be;             /* for the busy times each Progress reports */
    rekv_cost_profile cost;       /* measured at start (cached per machine/model), sent in Hello */
    double device_kv_room;        /* for the mode choice (Hello); < 0: no device limit */
    int device_tokens;            /* --device-tokens: each sequence's device-resident part, sent
                                     in Hello for the Assign; -1: the coordinator's planner
                                     decides (rekv_plan_device_tokens) */
    uint64_t device_buffer_bytes; /* for the planner's mini-batches (Hello); 0: no limit */
    uint32_t hb_ms;               /* heartbeat period, also while a step runs */
    rekv_kvstore_client *kv;      /* NULL in resident mode without --kvstore, and while lost */
    uint64_t renew_ns;            /* kvstore lease renewal period: a quarter of its lease */
    uint64_t last_renew_ns;
    const char *kv_ep; /* --kvstore */
    int kv_timeout_ms; /* --kvstore-timeout-ms: the bound on one store request */
    int kv_lost;       /* the store went away: no client, no pipeline, reconnecting */
    int rebuild;       /* a pipeline was built before the loss: build it again */
    uint64_t next_reconnect_ns;
    int reconnect_tries;          /* since the loss (the first failure is logged, not each) */
    char unavailable[256];        /* sent with every message while non-empty (worker.proto) */
    Rekv__Worker__StoreRoom room; /* the kvstore's room (its Stats at connect), sent with every
                                   * message while w->kv is set; host_bytes 0: not known */
    int stop_fd;                  /* SIGTERM/SIGINT (common/daemon.h) */
    int stopping;                 /* a stop arrived during a step: its kvstore requests aborted */
    int exit_code;                /* the program's, once the loop stops */
    int device_lost;              /* a step failed -ENODEV (backend.h): the loop stops, exit 1 */
    rekv_metrics_server *metrics; /* the scrape port; NULL without --metrics */
    rekv_worker_metrics wm;       /* what it serves */
    wk_stepper stepper;           /* the step thread */
    wk_plan cur;                  /* the Plan whose step runs */
    Rekv__Worker__CoordMsg *ahead; /* a message read past a Plan while looking for Drops
                                    * (worker_proto.c), handled before the socket's next */
    rekv_evloop *loop;            /* the event loop */
    int sock_id;                  /* the coordinator socket's entry in it */
    int wake_timer;               /* bounds its sleep by the next heartbeat, renewal, reconnect */
} worker;

/* worker_start.c */

/* Builds the pipeline and the batcher with w->pc as assigned (the weights go onto the device
 * here), and measures the room they leave for a step's buffers. */
int wk_start_pipeline(worker *w, rekv_err *err);
/* The coordinator answered our first Hello (which asked, with mode "auto" or --mode's): build
 * the pipeline in the mode, with the split, device part and N_p it assigned, and say Hello again
 * with them. 0, or a negative errno with err filled when the worker cannot run so. */
int wk_take_assign(worker *w, const Rekv__Worker__Assign *a, rekv_err *err);
/* What a worker holds once started: the model and engine, the kvstore (waiting for its socket up
 * to KV_WAIT_MS; 1 when a stop came meanwhile), the backend, the scrape port, the measured
 * profile, the coordinator's socket connected (zctx). The pipeline waits for the Assign. */
typedef struct wk_start_args {
    const char *model_path, *coord, *backend, *metrics_listen;
    rekv_link_config link;
    int metrics_public, auto_mode;
} wk_start_args;
int wk_start(worker *w, const wk_start_args *a, rekv_model **model, void **zctx, rekv_err *err);

/* worker_proto.c */

/* A WARN a peer can cause once per message: at most one a second per call site (rl), the next
 * one saying how many were held back. */
void wk_warn_rl(rekv_ratelimit *rl, const char *what, const char *detail);
/* Sends m to the coordinator with our availability and the store's room; 0 or -errno (logged). */
int wk_send_msg(worker *w, Rekv__Worker__WorkerMsg *m);
void wk_send_hello(worker *w);
void wk_send_heartbeat(worker *w);
/* The loop's callback for the coordinator's socket: reads and acts on its messages until none
 * is left or a step starts (the socket is then left unread until the step is over). */
void wk_on_coordinator(rekv_evloop *loop, void *ctx, short revents);

/* worker_plan.c */

/* Starts the step thread; -errno when it cannot (steps then run on the loop's thread). */
int wk_stepper_start(wk_stepper *st);
void wk_stepper_stop(wk_stepper *st);
/* Runs a Plan (taking msg): drops the cancelled, adds the joining, starts the step on the step
 * thread (1: it runs; wk_on_step_done reports it) or runs and reports it here (0; 1 when the
 * step lost the device and the loop stops). */
int wk_plan_start(worker *w, Rekv__Worker__CoordMsg *msg);
/* The loop's callback for the step thread's done fd: reports the step. */
void wk_on_step_done(rekv_evloop *loop, void *ctx, short revents);
/* A Plan while we cannot run steps: every joining job runs again. */
void wk_refuse_plan(worker *w, const Rekv__Worker__Plan *plan);

/* worker_store.c */

/* Connects to --kvstore at start, waiting for its socket up to KV_WAIT_MS: 0, 1 when a stop
 * came first, or -errno; names the connection's owner (our --name). */
int wk_kv_connect(worker *w, rekv_err *err);
/* Reads the store's room again when a second has passed since the last read (for the loop, when
 * no step runs): another file filling the spill disk shrinks what admission counts on. */
void wk_kv_room_due(worker *w);
/* Drops what a dead worker of our name left in the kvstore, once, at the coordinator's first
 * Welcome: a second live worker under a taken name is refused before it could drop the first
 * one's sequences. A failure is logged (the store's lease expiry frees them instead). */
void wk_kv_drop_leftovers(worker *w);
/* Renews the kvstore lease when due (never waits for the step thread's requests). */
void wk_kv_renew_due(worker *w);
/* Whether a failed step's (or join's) jobs run again; *lost: the kvstore is gone. */
int wk_step_error_retry(worker *w, int code, int *lost);
/* The kvstore is gone: the pipeline goes with its client; reconnecting from here on. */
void wk_kv_lose(worker *w);
/* Connects again when due (every half second while lost), and rebuilds the pipeline. */
void wk_kv_reconnect(worker *w);

#endif
