/* metrics.h — Prometheus metrics for rekv's daemons (coordinator, kvstore, gpuworker): a builder
 * for the text exposition format (version 0.0.4) with counters, gauges and fixed-bucket
 * histograms, and the scrape server (libmicrohttpd) for a daemon whose state its single-threaded
 * zmq_poll loop alone reads.
 *
 * Conventions every daemon follows: cumulative numbers are counters (_total) and rates are left to
 * PromQL's rate(); what is true now is a gauge; latencies are histograms in seconds over
 * rekv_metrics_latency_bounds. The server listens on loopback only unless its opts allow another
 * address (the daemons' --metrics-public), since it has no authentication.
 *
 * libmicrohttpd runs on its own thread (HTTP never waits on the daemon); the loop asks for the
 * file descriptor to poll (rekv_metrics_server_fds: one eventfd, readable when a scrape waits for
 * the exposition), adds it to its zmq_pollitem_t array as a raw fd, and calls
 * rekv_metrics_server_handle, which renders (in the loop's thread, so render may read the loop's
 * state without locks) and hands the text to every scrape waiting; a scrape the loop does not
 * answer within the timeout gets 503. Every response ends
 * the connection (Connection: close). Requests are bounded (431 past about twice
 * REKV_METRICS_MAX_REQUEST bytes, 414 for a request line), connections are bounded (past
 * max_conns, new ones wait unaccepted until one closes), and a connection idle for the timeout
 * (rounded up to whole seconds) is closed. Answers: GET or HEAD /metrics (also in the absolute
 * form http://HOST/metrics) -> 200 with the body render() builds; another path -> 404; another
 * method on /metrics -> 405; a malformed request -> 400 (what libmicrohttpd reads leniently is
 * answered as it reads it); another HTTP version -> 505; render failing -> 500; the loop not
 * rendering within the timeout -> 503.
 *
 * Poll events here are ZeroMQ's bits (ZMQ_POLLIN, ZMQ_POLLOUT, ZMQ_POLLERR), as zmq_pollitem_t
 * carries them — not poll(2)'s, whose values differ.
 *
 * Library code: functions return 0 or a negative errno and fill the rekv_err; nothing prints. */
#ifndef REKV_COMMON_METRICS_H
#define REKV_COMMON_METRICS_H

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
    int cur_histogram;   /* the current family is a histogram */
    size_t n_families;   /* families declared; the last one is the current family */
    size_t cap_families; /* slots allocated at families */
} rekv_metrics_buf;

void rekv_metrics_buf_init(rekv_metrics_buf *b);
/* Frees the text and the family list and leaves b empty (as after init). NULL is fine. */
void rekv_metrics_buf_free(rekv_metrics_buf *b);

/* Starts the family `name` (matching [a-zA-Z_:][a-zA-Z0-9_:]*): writes its "# HELP" (help escaped:
 * backslash, newline) and "# TYPE" lines and makes it the current family. type: "counter", "gauge",
 * "histogram" or "untyped". Declaring the current family again writes nothing and returns 0;
 * declaring an earlier family again is -EINVAL (the format wants each family's lines together).
 * A histogram family's samples are written by rekv_metrics_histogram only. */
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

/* ---------------------------------------------------------------- histograms */

/* Most finite bucket bounds a histogram has (the +Inf bucket comes on top). */
#define REKV_METRICS_MAX_BOUNDS 24

/* Latency bounds in seconds shared by every rekv histogram: 0.5 ms .. 100 s in 1-2.5-5 steps. */
extern const double rekv_metrics_latency_bounds[];
extern const uint32_t rekv_metrics_latency_n_bounds;

/* Observations in fixed buckets, kept by the daemon that observes and rendered on a scrape. Not
 * thread-safe: one thread observes and renders (each daemon's loop). */
typedef struct rekv_metrics_hist {
    const double *bounds; /* [n_bounds] finite upper bounds (le), strictly increasing; not owned */
    uint32_t n_bounds;    /* 1..REKV_METRICS_MAX_BOUNDS */
    uint64_t counts[REKV_METRICS_MAX_BOUNDS + 1]; /* [n_bounds + 1] observations per bucket, not
                                                   * cumulative; the last is above every bound */
    uint64_t count;                               /* observations */
    double sum;                                   /* their sum */
} rekv_metrics_hist;

/* Empties h and gives it the bounds (kept by pointer: static storage). -EINVAL when n_bounds is 0
 * or above REKV_METRICS_MAX_BOUNDS, or the bounds do not increase strictly. */
int rekv_metrics_hist_init(rekv_metrics_hist *h, const double *bounds, uint32_t n_bounds);
/* Counts v in the first bucket whose bound is >= v (Prometheus' le); NaN is ignored. */
void rekv_metrics_hist_observe(rekv_metrics_hist *h, double v);

/* Writes h as samples of the current family, which must be a histogram named `name` (-EINVAL
 * otherwise): name_bucket{labels,le="B"} with cumulative counts for each bound and "+Inf", then
 * name_sum and name_count. labels as for rekv_metrics_sample (NULL or "" for none; "le" is taken). */
int rekv_metrics_histogram(rekv_metrics_buf *b, const char *name, const char *labels,
                           const rekv_metrics_hist *h);

/* 1 when s is a valid metric name, else 0. */
int rekv_metrics_name_valid(const char *s);

/* ---------------------------------------------------------------- HTTP server */

/* A listening TCP socket (non-blocking, close-on-exec) on `listen`, as for
 * rekv_metrics_server_create below: its fd and the port bound. what names the server in messages
 * ("metrics", "http"); remote_hint says how to allow a non-loopback address (the flag and why it
 * is asked for), named in the -EPERM message when allow_remote is 0. */
int rekv_listen_tcp(const char *listen, int allow_remote, const char *what, const char *remote_hint,
                    int *fd_out, int *port_out, rekv_err *err);

/* A request (request line and headers) of this size is always served; libmicrohttpd's buffer is
 * twice it, and a request that does not fit gets 431 (414: the request line) and is closed. */
#define REKV_METRICS_MAX_REQUEST 8192
/* Most open connections; more wait, unaccepted, until one closes. */
#define REKV_METRICS_MAX_CONNS 32
/* Size for the fds/events arrays (rekv_metrics_server_fds fills one: kept for the callers). */
#define REKV_METRICS_MAX_FDS (1 + REKV_METRICS_MAX_CONNS)

/* Builds the body of a 200 answer. Returning a negative errno, or leaving buf->err set, answers
 * 500 instead. Called from rekv_metrics_server_handle, once per GET or HEAD /metrics. */
typedef int (*rekv_metrics_render_fn)(void *ctx, rekv_metrics_buf *buf);

typedef struct rekv_metrics_server_opts {
    int max_conns;    /* open connections at most, 1..REKV_METRICS_MAX_CONNS; 0: the maximum */
    int timeout_ms;   /* a connection idle this long (rounded up to whole seconds) is closed;
                       * 0: 5000 */
    int allow_remote; /* 1: any address; 0: only a loopback one (127.0.0.0/8, ::1), since anyone
                       * who reaches the port reads the metrics */
} rekv_metrics_server_opts;

typedef struct rekv_metrics_server rekv_metrics_server;

/* Listens on `listen`: "HOST:PORT" with a numeric IPv4 address or a host name, "[IPV6]:PORT", or
 * ":PORT" for every interface (IPv6 and IPv4 when the host has IPv6, else IPv4); a host name binds
 * the first of its addresses that will. PORT 0 picks a free port (see rekv_metrics_server_port).
 * -EINVAL for a malformed address or an unknown host; -EPERM when the address bound is not a
 * loopback one and opts do not allow_remote (":PORT" is every interface, so never loopback);
 * else bind's errno. */
int rekv_metrics_server_create(const char *listen, rekv_metrics_server **out, rekv_err *err);
/* The same with limits; opts may be NULL (the defaults: loopback only). */
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
