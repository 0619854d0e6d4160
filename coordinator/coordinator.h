/* coordinator.h — rekv's coordinator: the control socket clients submit jobs to, the job queue,
 * continuous batching over the gpuworkers, and the journal that makes accepted jobs survive a
 * restart; and the client side of the control protocol (proto/control.proto).
 *
 * Sockets (ZeroMQ, one frame per message, protobuf-c):
 *   control  ROUTER; clients (DEALER) send Request, get Response with the same id. ipc:// by
 *            default, in $XDG_RUNTIME_DIR/rekv or /run/rekv, socket file mode 0660 (its directory
 *            decides who reaches it). tcp:// only
 * when configured; a non-loopback tcp address needs a CurveZMQ secret key. workers  ROUTER; each
 * gpuworker (DEALER) says Hello, then gets one Plan per step and answers Progress
 * (proto/worker.proto). A worker silent for worker_timeout_ms is dead, and one whose step is not
 * answered within step_timeout_ms is hung: its jobs are re-queued (or failed after max_attempts
 * starts) and the coordinator carries on. A Hello naming an active worker (another connection)
 * replaces it at once: its jobs are re-queued. A step the worker reports failed re-queues the jobs
 * it marks retry and fails the others; a job a Progress leaves out is re-queued (never left
 * RUNNING); a worker that says it is unavailable gets no Plan until it says otherwise.
 *
 * Journal: <state_dir>/journal, append-only records [magic u32][len u32][crc32c u32][payload],
 * payload a JournalRecord. An accepted job's record is fdatasync'd before the Submit is answered
 * (one sync per batch of requests read together); a finished job's record is fdatasync'd before
 * the end is reported to anyone (Status, streams, Cancel's reply: one sync per loop round), so a
 * job reported finished is never run again. On start the journal is replayed — unfinished jobs
 * queue again, finished ones are remembered with their tokens, a torn or corrupt tail (the first
 * record whose frame or CRC32C is wrong, and all after it) is cut off — and rewritten compactly,
 * beginning with the next job id so that ids are never handed out twice.
 *
 * Exactly once: a Submit may carry a client key; a key the coordinator knows (its job queued,
 * running or among the remembered finished jobs; journaled with it) is answered with that job
 * instead of a new one, so a client that retries after a lost reply or a restart gets one job.
 *
 * One coordinator per path: <control socket>.lock, <worker socket>.lock (ipc://) and
 * <state_dir>/lock are flock'd before the journal is read or a stale socket file removed; a
 * second coordinator fails with -EBUSY naming the first one's pid. The lock files stay.
 *
 * Library code: functions return 0 or a negative errno and fill the rekv_err; the server reports
 * notable events through a callback so that only the daemon's main logs. */
#ifndef REKV_COORDINATOR_COORDINATOR_H
#define REKV_COORDINATOR_COORDINATOR_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "proto/control.pb-c.h"

#define REKV_CONTROL_PROTO_VERSION 1u
#define REKV_WORKER_PROTO_VERSION 1u
/* Most jobs the coordinator runs on one worker at once; a Hello saying more is capped to it. */
#define REKV_WORKER_MAX_BATCH 4096u
/* Largest Submit.top_logits, and largest top_logits x max_new_tokens (a job's top logits, which
 * the coordinator keeps in memory and journals): larger Submits get BAD_REQUEST. */
#define REKV_TOP_LOGITS_MAX 64u
#define REKV_TOP_LOGITS_MAX_ENTRIES (1u << 20)
/* Longest Submit.client_key. */
#define REKV_CLIENT_KEY_MAX 128
/* Largest request the control socket answers normally; larger ones get BAD_REQUEST. */
#define REKV_CONTROL_MAX_REQUEST (1u << 20)

/* The directory of the default sockets: $XDG_RUNTIME_DIR/rekv when set, else /run/rekv. */
int rekv_runtime_dir(char *buf, size_t len, rekv_err *err);
/* The system service's runtime directory (the systemd units' RuntimeDirectory). */
#define REKV_SYSTEM_RUNTIME_DIR "/run/rekv"
/* "ipc://<runtime dir>/control": where rekv-coordinator (and `rekv run`) listens by default. */
int rekv_default_control_endpoint(char *buf, size_t len, rekv_err *err);
/* Where a client looks by default: the user's own coordinator (rekv_default_control_endpoint)
 * when one listens there, else the system service's (/run/rekv/control) when one listens there,
 * else the user's (so that the error names the socket `rekv run` would make). */
int rekv_client_control_endpoint(char *buf, size_t len, rekv_err *err);

/* ---------------------------------------------------------------- server */

typedef enum rekv_co_event {
    REKV_CO_EVENT_INFO = 0,
    REKV_CO_EVENT_WARN = 1,
    REKV_CO_EVENT_ERROR = 2,
} rekv_co_event;

typedef struct rekv_coordinator_config {
    const char *control_endpoint; /* NULL: rekv_default_control_endpoint() */
    const char *worker_endpoint;  /* NULL: "ipc://<dir of the control socket>/workers" */
    const char *state_dir;        /* journal directory; NULL: no journal (jobs die with us) */
    const char *model_path;       /* for the tokenizer (text prompts) and early checks; NULL */
    const char *curve_secret;     /* Z85 CurveZMQ secret key for tcp://; NULL: none */
    const char *metrics_listen;   /* Prometheus scrape address ("127.0.0.1:9464", "[::1]:9464",
                                   * ":9464"); NULL: no metrics port (common/metrics.h) */
    int metrics_public;           /* 1: metrics_listen may be a non-loopback address (refused
                                   * with -EPERM otherwise: scrapes have no authentication) */
    uint32_t queue_limit;         /* most jobs waiting to run; beyond: BUSY. 0: 256 */
    uint32_t keep_finished;       /* finished jobs remembered for Status; 0: 1024 */
    uint64_t keep_finished_bytes; /* at most this many bytes of their results (ids, top logits);
                                   * the oldest are forgotten first. 0: 64 MiB */
    uint32_t worker_timeout_ms;   /* a worker silent this long is dead; 0: 30000 */
    uint32_t step_timeout_ms;     /* a step not answered this long after its Plan is hung: the
                                   * worker is dropped as if dead (its jobs re-queued) and must
                                   * say Hello again; 0: 300000 */
    uint32_t max_attempts;        /* starts per job before it fails; 0: 3 */
    uint32_t prefill_chunk;       /* most prompt tokens a job runs per step (chunked prefill), so
                                   * a long prompt does not stall the running jobs' decode; the
                                   * planner may choose fewer (co_plan_prefill_chunk). 0: whole
                                   * prompts. Default 512 */
    uint32_t max_new_limit;       /* largest max_new_tokens accepted; 0: 1 << 20 */
    uint32_t max_clients;         /* connections per socket (control, workers) served; more are
                                   * answered BUSY, past twice as many dropped at accept
                                   * (common/conncap.h). 0: 1024; lowered to fit RLIMIT_NOFILE */
    int signal_fd;                /* a signalfd (or eventfd) the loop polls; readable stops it; -1 */
    /* Called from the loop for notable events (workers joining and leaving, replays, errors). */
    void (*on_event)(void *ctx, rekv_co_event level, const char *msg);
    /* Called from the loop at least every 200 ms (e.g. sd_notify WATCHDOG=1). */
    void (*on_tick)(void *ctx);
    void *ctx; /* passed to on_event and on_tick */
} rekv_coordinator_config;

void rekv_coordinator_config_defaults(rekv_coordinator_config *cfg);

typedef struct rekv_coordinator rekv_coordinator;

/* Replays the journal, binds both sockets (removing stale ipc socket files, creating the socket
 * directory mode 0700 when missing; the control socket's file mode 0660, the workers' 0600). */
int rekv_coordinator_create(const rekv_coordinator_config *cfg, rekv_coordinator **out,
                            rekv_err *err);
/* Runs the event loop until rekv_coordinator_stop() or a signal on cfg->signal_fd. */
int rekv_coordinator_run(rekv_coordinator *co, rekv_err *err);
/* Makes run() return soon; async-signal-safe. */
void rekv_coordinator_stop(rekv_coordinator *co);
/* Tells connected workers to drop their jobs, closes the sockets, removes the ipc socket files.
 * Unfinished jobs stay in the journal. NULL is fine. */
void rekv_coordinator_destroy(rekv_coordinator *co);
/* The endpoints actually bound (with the defaults filled in). */
const char *rekv_coordinator_control_endpoint(const rekv_coordinator *co);
const char *rekv_coordinator_worker_endpoint(const rekv_coordinator *co);
/* The control socket's in-process endpoint and the ZeroMQ context it lives in: a client in the
 * coordinator's own process (the HTTP server) reaches it there without a socket or I/O-thread hop
 * per message. Clients of it must close before rekv_coordinator_destroy. */
const char *rekv_coordinator_inproc_endpoint(const rekv_coordinator *co);
void *rekv_coordinator_zctx(const rekv_coordinator *co);

/* ---------------------------------------------------------------- client */

typedef struct rekv_ctl rekv_ctl;

/* Connects a DEALER to the control socket. NULL endpoint: the default. curve_server_key: the
 * server's Z85 public key for a CurveZMQ tcp endpoint, else NULL. */
int rekv_ctl_connect(const char *endpoint, const char *curve_server_key, rekv_ctl **out,
                     rekv_err *err);
/* The same in the caller's ZeroMQ context (zctx NULL: a private one): the HTTP server's bridge
 * reaches the coordinator's inproc:// endpoint in the coordinator's own context this way.
 * rekv_ctl_close leaves a caller's context alone. */
int rekv_ctl_connect_in(void *zctx, const char *endpoint, const char *curve_server_key,
                        rekv_ctl **out, rekv_err *err);
void rekv_ctl_close(rekv_ctl *c);
/* The ZeroMQ socket, for zmq_poll by callers that wait on several things. */
void *rekv_ctl_socket(rekv_ctl *c);

/* Sends a request; fills in version and, when 0, a fresh id (returned in *id when id != NULL). */
int rekv_ctl_send(rekv_ctl *c, Rekv__Control__Request *req, uint64_t *id, rekv_err *err);
/* Sends raw frames (tests send malformed ones): n frames of the given lengths. */
int rekv_ctl_send_raw(rekv_ctl *c, const void *const *frames, const size_t *lens, size_t n,
                      rekv_err *err);
/* Receives one response; -ETIMEDOUT after timeout_ms (< 0: wait forever). Free it with
 * rekv__control__response__free_unpacked(resp, NULL). */
int rekv_ctl_recv(rekv_ctl *c, int timeout_ms, Rekv__Control__Response **resp, rekv_err *err);
/* Sends and waits for the response with the same id (others arriving meanwhile are dropped). */
int rekv_ctl_call(rekv_ctl *c, Rekv__Control__Request *req, int timeout_ms,
                  Rekv__Control__Response **resp, rekv_err *err);

/* Names for the enums, for the CLI and logs. */
const char *rekv_ctl_state_name(Rekv__Control__JobState s);
const char *rekv_ctl_code_name(Rekv__Control__Code c);

#endif
