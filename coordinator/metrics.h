/* metrics.h — Prometheus metrics for rekv's daemons: a builder for the text exposition format
 * (version 0.0.4) and a tiny HTTP/1.1 server that answers scrapes from inside a single-threaded
 * zmq_poll loop.
 *
 * The server never blocks and never owns a thread: the loop asks it for the file descriptors to
 * poll (rekv_metrics_server_fds), adds them to its zmq_pollitem_t array as raw fds, and hands the
 * results back (rekv_metrics_server_handle), which accepts, reads and answers. Every response ends
 * the connection (Connection: close). Requests are bounded (REKV_METRICS_MAX_REQUEST bytes, else
 * 431), connections are bounded (extra ones are answered 503 at once, best effort, and closed),
 * and a connection that does not finish its request within the timeout is closed (408 when it sent
 * part of one). Answers: GET or HEAD /metrics -> 200 with the body render() builds; another path
 * -> 404; another method on /metrics -> 405; a malformed request -> 400; render failing -> 500.
 *
 * Poll events here are ZeroMQ's bits (ZMQ_POLLIN, ZMQ_POLLOUT, ZMQ_POLLERR), as zmq_pollitem_t
 * carries them — not poll(2)'s, whose values differ.
 *
 * Library code: functions return 0 or a negative errno and fill the rekv_err; nothing prints. */
#ifndef REKV_COORDINATOR_METRICS_H
#define REKV_COORDINATOR_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

/* ---------------------------------------------------------------- exposition text */

/* Largest body a buffer grows to; beyond it every call fails with -E2BIG. */
#define REKV_METRICS_MAX_BODY (64u << 20)

/* A growing exposition text. Zero-initialised (or rekv_metrics_buf_init) is empty and valid.
 * Errors are sticky: after the first failure every call returns it and appends nothing, so a
 * render function may ignore return values and check err once (the server answers 500). */
typedef struct rekv_metrics_buf {
    char *data;          /* the text, NUL-terminated (malloc'd; NULL while nothing was written) */
    size_t len;          /* bytes of text in data, without the NUL */
    size_t cap;          /* bytes allocated at data */
    int err;             /* the first failure (negative errno), 0 while none */
    char **families;     /* [n_families] names of the families declared, in order (malloc'd) */
    size_t n_families;   /* families declared; the last one is the current family */
    size_t cap_families; /* slots allocated at families */
} rekv_metrics_buf;

void rekv_metrics_buf_init(rekv_metrics_buf *b);
/* Frees the text and the family list and leaves b empty (as after init). NULL is fine. */
void rekv_metrics_buf_free(rekv_metrics_buf *b);

/* Starts the family `name` (matching [a-zA-Z_:][a-zA-Z0-9_:]*): writes its "# HELP" (help escaped:
 * backslash, newline) and "# TYPE" lines and makes it the current family. type: "counter", "gauge"
 * or "untyped". Declaring the current family again writes nothing and returns 0; declaring an
 * earlier family again is -EINVAL (the format wants each family's lines together). */
int rekv_metrics_family(rekv_metrics_buf *b, const char *name, const char *type, const char *help);

/* Appends one sample of the current family: `name{labels} value`. name must be the current
 * family's (-EINVAL otherwise, also when no family was declared). labels: NULL or "" for none, else
 * a label set as it appears between the braces, e.g. "state=\"queued\",kind=\"kv\"": it is checked
 * (label names [a-zA-Z_][a-zA-Z0-9_]* not starting with "__", values quoted, escapes only \\ \" \n)
 * and copied; -EINVAL when malformed. Use rekv_metrics_sample_kv for values not known to be safe.
 * value: printed as the shortest decimal that reads back the same; NaN, +Inf, -Inf as such. */
int rekv_metrics_sample(rekv_metrics_buf *b, const char *name, const char *labels, double value);

/* Like rekv_metrics_sample with labels given as (name, value) string pairs ending with a NULL
 * name; the values are escaped here (backslash, double quote, newline), so any string will do. */
int rekv_metrics_sample_kv(rekv_metrics_buf *b, const char *name, double value, ...)
    __attribute__((sentinel));

/* 1 when s is a valid metric name, else 0. */
int rekv_metrics_name_valid(const char *s);

/* ---------------------------------------------------------------- HTTP server */

/* Largest request (request line and headers) accepted; larger ones get 431 and are closed. */
#define REKV_METRICS_MAX_REQUEST 8192
/* Most open connections; more are closed as soon as they are accepted. */
#define REKV_METRICS_MAX_CONNS 32
/* Size for the fds/events arrays: the listening socket and every connection. */
#define REKV_METRICS_MAX_FDS (1 + REKV_METRICS_MAX_CONNS)

/* Builds the body of a 200 answer. Returning a negative errno, or leaving buf->err set, answers
 * 500 instead. Called from rekv_metrics_server_handle, once per GET or HEAD /metrics. */
typedef int (*rekv_metrics_render_fn)(void *ctx, rekv_metrics_buf *buf);

typedef struct rekv_metrics_server_opts {
    int max_conns;  /* open connections at most, 1..REKV_METRICS_MAX_CONNS; 0: the maximum */
    int timeout_ms; /* time a connection has to send its request, and then to take the answer;
                     * 0: 5000 */
} rekv_metrics_server_opts;

typedef struct rekv_metrics_server rekv_metrics_server;

/* Listens on `listen`: "HOST:PORT" with a numeric IPv4 address or a host name, "[IPV6]:PORT", or
 * ":PORT" for every interface (IPv6 and IPv4 when the host has IPv6, else IPv4); a host name binds
 * the first of its addresses that will. PORT 0 picks a free port (see rekv_metrics_server_port).
 * -EINVAL for a malformed address or an unknown host, else bind's errno. */
int rekv_metrics_server_create(const char *listen, rekv_metrics_server **out, rekv_err *err);
/* The same with limits; opts may be NULL (the defaults). */
int rekv_metrics_server_create_opts(const char *listen, const rekv_metrics_server_opts *opts,
                                    rekv_metrics_server **out, rekv_err *err);
/* Closes the listening socket and every connection. NULL is fine. */
void rekv_metrics_server_free(rekv_metrics_server *s);
/* The port actually bound (useful after asking for port 0). */
int rekv_metrics_server_port(const rekv_metrics_server *s);
/* Connections open now (the listening socket not counted). */
int rekv_metrics_server_conns(const rekv_metrics_server *s);

/* Fills fds[i] and events[i] (ZMQ_POLLIN / ZMQ_POLLOUT) for the loop to poll — the listening
 * socket and each open connection — and returns how many it filled, at most max. With max below
 * REKV_METRICS_MAX_FDS some connections may be left out (they still time out). The set changes
 * with every handle call: ask again before each poll. */
int rekv_metrics_server_fds(const rekv_metrics_server *s, int *fds, short *events, int max);

/* Does the work the poll results allow: fds[n] and revents[n] as the loop got them back (entries
 * for fds that are not the server's are ignored; n == 0 is fine). Accepts, reads, answers (calling
 * render for /metrics) and writes without blocking, then closes connections past their timeout.
 * Call it after every poll, and at least every second or so, for the timeouts. */
void rekv_metrics_server_handle(rekv_metrics_server *s, const int *fds, const short *revents, int n,
                                rekv_metrics_render_fn render, void *ctx);

#endif
