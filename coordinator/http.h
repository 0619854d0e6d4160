/* http.h — rekv-coordinator's OpenAI-compatible HTTP face (--http HOST:PORT): POST /v1/completions
 * and /v1/chat/completions (server-sent events with "stream": true), GET /v1/models, GET /health,
 * POST /tokenize and /detokenize, on libmicrohttpd.
 *
 * The server is a second client of the same coordinator, not a second coordinator: it speaks only
 * the control protocol, over one DEALER to the control endpoint for every request, so an HTTP job
 * is journaled, admitted, streamed and cancelled exactly as a `rekv submit` one, and the
 * coordinator's single-threaded loop is untouched. Two threads, however many connections:
 * libmicrohttpd's polling thread (epoll) for every connection, whose callbacks never block (a
 * request waiting on the coordinator has its connection suspended), and a bridge thread that owns
 * the DEALER, routes the coordinator's replies and stream events to their requests and resumes
 * their connections. Each job carries a random client key, so that a Submit the server sends
 * again (no reply in time) is one job.
 *
 * A request whose client goes away (the connection closed while its job runs, streaming or not)
 * cancels its jobs: the bridge watches each running request's socket, and libmicrohttpd's
 * request-completed notification cancels whatever is still running.
 *
 * Library code: 0 or a negative errno with a rekv_err; events go through the log callback. */
#ifndef REKV_COORDINATOR_HTTP_H
#define REKV_COORDINATOR_HTTP_H

#include <stdint.h>

#include "common/err.h"

/* Largest request body read; a larger one gets 413 (unread past this). */
#define REKV_HTTP_MAX_BODY (8u << 20)
/* Most choices per request (n) and most jobs per request (prompts x n). */
#define REKV_HTTP_MAX_N 16
#define REKV_HTTP_MAX_JOBS 64

typedef struct rekv_http_config {
    const char *listen;            /* "HOST:PORT" as common/metrics.h's rekv_listen_tcp takes */
    int allow_remote;              /* --http-public: a non-loopback address is allowed */
    const char *api_key;           /* Bearer token every request but /health must carry; NULL */
    const char *control_endpoint;  /* the coordinator's control socket, as bound */
    void *zctx;                    /* the ZeroMQ context to reach it in (the coordinator's, for
                                    * its inproc:// endpoint); NULL: a private one */
    const char *curve_server_key;  /* its Z85 public key when tcp:// with CurveZMQ, else NULL */
    const char *model_path;        /* --model: the tokenizer, the context length, the name */
    const char *served_model_name; /* NULL: --model's base name (a file's without extension) */
    uint32_t max_connections;      /* connections served at once; 0: 4096 (or fewer to fit the
                                    * open-file limit) */
    uint32_t timeout_s;            /* an idle connection is closed after this; 0: 60 */
    /* Called for notable events (start, refused connections' reasons); from any thread. */
    void (*on_log)(void *ctx, int level, const char *msg); /* level: common/log.h's */
    void *ctx;
} rekv_http_config;

typedef struct rekv_http rekv_http;

/* Loads the tokenizer, binds and starts serving. */
int rekv_http_start(const rekv_http_config *cfg, rekv_http **out, rekv_err *err);
/* The TCP port bound (for a listen address with port 0). */
int rekv_http_port(const rekv_http *h);
/* Ends every request in flight (streams end, waiting requests get 503; their jobs are left to
 * the coordinator, which journals them) and stops. NULL is fine. */
void rekv_http_stop(rekv_http *h);

#endif
