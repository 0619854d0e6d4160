/* conncap.h — a cap on the connections a daemon's ROUTER socket accepts, so that a flood of
 * clients never runs the process out of file descriptors: libzmq 4.3's ipc listener asserts
 * (aborts) when accept() fails with EMFILE, and ZeroMQ offers no way to refuse one connection.
 *
 * A socket monitor (ZMQ_EVENT_ACCEPTED / ZMQ_EVENT_DISCONNECTED, whose value is the connection's
 * fd) counts the live connections by fd. The first `max` are admitted; one accepted while `max`
 * are admitted is "over": the daemon answers each of its requests with a busy error instead of
 * serving it (rekv_conncap_over, by the request's ZMQ_SRCFD), and a well-behaved client then
 * closes it. One accepted while 2 x max connections are live is shed at once: shutdown(2) of its
 * fd, which libzmq sees as the peer going away and closes itself (close(2) would pull the fd from
 * under libzmq; shutdown leaves the descriptor to its owner).
 *
 * The count is behind libzmq's I/O thread, which accepts on its own; what bounds the lag is the
 * monitor's pipe: libzmq sends monitor events blocking, and with a receive high-water mark of 1
 * the pipe holds the monitor socket's default 1000 (+1) events, after which the I/O thread waits
 * in the ACCEPTED send, before its next accept(), until the daemon's loop reads. So at most
 * 2 x max + REKV_CONNCAP_QUEUE connections are ever open, and rekv_conncap_max_for keeps that
 * plus REKV_CONNCAP_RESERVE within RLIMIT_NOFILE. (While the loop lags, the gate stalls the
 * socket's other I/O too: a flood is slowed, not served.) Not thread-safe: the daemon's loop
 * owns it. Functions return 0 or a negative errno and fill err. */
#ifndef REKV_COMMON_CONNCAP_H
#define REKV_COMMON_CONNCAP_H

#include <stdint.h>
#include <zmq.h>

#include "common/err.h"

#define REKV_CONNCAP_DEFAULT 1024u /* --max-clients when not given */
#define REKV_CONNCAP_RESERVE 128u  /* fds kept for everything that is not a connection */
#define REKV_CONNCAP_QUEUE 1024u   /* connections accepted ahead of the count, at most (above) */

typedef struct rekv_conncap rekv_conncap;

/* The cap to use for a wanted one (0: REKV_CONNCAP_DEFAULT) under the process's RLIMIT_NOFILE
 * (soft): at most (limit - REKV_CONNCAP_RESERVE - REKV_CONNCAP_QUEUE) / 2, at least 1. Below
 * ~1,150 fds the bound cannot hold; the units raise the limit to 65536. */
uint32_t rekv_conncap_max_for(uint32_t wanted);
/* 1 when rekv_conncap_max_for lowers wanted, with why (n bytes) saying so: the cap, the soft and
 * hard limits, and the limit the wanted cap needs; else 0. For a daemon's start, after it raised
 * its soft limit (rekv_daemon_stop_fd), so that a cap an operator did not ask for is logged. */
int rekv_conncap_lowered(uint32_t wanted, char *why, size_t n);

/* Watches router (a ROUTER of zctx; call before its zmq_bind, so that no connection goes
 * uncounted) with at most max admitted connections. */
int rekv_conncap_create(void *zctx, void *router, uint32_t max, rekv_conncap **out, rekv_err *err);
void rekv_conncap_free(rekv_conncap *cc);

/* The socket to poll for ZMQ_POLLIN; then rekv_conncap_drain. */
void *rekv_conncap_socket(const rekv_conncap *cc);
/* Reads every event queued so far: counts, marks over-cap connections, sheds past 2 x max. */
void rekv_conncap_drain(rekv_conncap *cc);
/* 1 when msg (a frame read from the router) came on a connection accepted over the cap.
 * Drains first, so that a connection's ACCEPTED is read before its first request. */
int rekv_conncap_over(rekv_conncap *cc, zmq_msg_t *msg);

typedef struct rekv_conncap_stats {
    uint32_t max;      /* admitted connections at most */
    uint32_t live;     /* connections open now (admitted + over) */
    uint32_t admitted; /* of which admitted */
    uint64_t accepted; /* connections accepted since the start */
    uint64_t busy;     /* requests answered busy (rekv_conncap_over said 1) */
    uint64_t shed;     /* connections shut down at accept, past 2 x max */
} rekv_conncap_stats;
void rekv_conncap_get_stats(const rekv_conncap *cc, rekv_conncap_stats *st);

struct rekv_metrics_buf;
/* Two Prometheus families for n sockets, labelled socket=names[i]: PREFIX_connections (gauge:
 * open now) and PREFIX_connections_refused_total (counter; how="busy": requests answered busy,
 * how="shed": connections shut down at accept). */
void rekv_conncap_metrics(struct rekv_metrics_buf *b, const char *prefix,
                          const rekv_conncap *const *caps, const char *const *names, int n);

#endif
