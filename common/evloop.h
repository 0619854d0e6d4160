/* evloop.h — the one event loop every rekv daemon runs (as Redis's ae): ZeroMQ sockets and plain
 * fds with a callback each, timers on the monotonic clock, the stop signals, a before-sleep hook,
 * and the metrics server's changing set of fds — on zmq_poll, in one thread, never blocking but in
 * the poll.
 *
 * A round: the before-sleep hook; the metrics server answers what the last poll allows (last of
 * the round, so a scrape sees its state); zmq_poll, until the next timer is due (at most a second
 * while a metrics server is attached, for its timeouts; forever with neither); the callbacks of the
 * sockets and fds that are ready, in the order they were added; the timers that are due, earliest
 * first (equal times in the order they were added). Seen from the poll, each round is: callbacks,
 * timers, hook, scrapes — a daemon's own order of work within a round follows from where it puts
 * each piece.
 *
 * Stopping: rekv_evloop_stop, from a callback, another thread or a signal handler. Once it is
 * called no other callback of the round runs and run returns 0. The stop signals (SIGTERM, SIGINT)
 * come through a signal fd (rekv_evloop_add_signal_fd): the daemons' rekv_daemon_stop_fd (a
 * handler writing an eventfd, common/daemon.h), or a signalfd in a single-threaded child
 * (kvstore/spawn.c); by default they stop the loop, a daemon that must finish something first (the
 * worker, its step) passes a callback that decides. SIGHUP is nobody's: no daemon handles it, so
 * its default action ends the process at once (systemd units send none: there is no reload).
 *
 * Poll events are ZeroMQ's bits (ZMQ_POLLIN, ZMQ_POLLOUT, ZMQ_POLLERR), also for plain fds.
 * Adding, changing and removing are for the loop's thread (callbacks included); a callback may
 * remove any entry or timer, itself too, and a removed one is not called again, even later in the
 * same round; one added in a callback is polled from the next round. Functions return 0 (or an id)
 * or a negative errno and fill the rekv_err where they take one; nothing prints, nothing exits. */
#ifndef REKV_COMMON_EVLOOP_H
#define REKV_COMMON_EVLOOP_H

#include "common/err.h"
#include "common/metrics.h"

typedef struct rekv_evloop rekv_evloop;

/* A socket or fd is ready: revents as zmq_poll reported them (ZMQ_POLLIN, ...). */
typedef void (*rekv_evloop_io_fn)(rekv_evloop *loop, void *ctx, short revents);
/* A timer is due: returns the milliseconds until it is due again (0: next round), or
 * REKV_EVLOOP_TIMER_END to end it. A periodic timer returns its period, a one-shot one END. */
typedef long (*rekv_evloop_timer_fn)(rekv_evloop *loop, void *ctx);
#define REKV_EVLOOP_TIMER_END (-1L)
/* The before-sleep hook: called once per round, before the poll. */
typedef void (*rekv_evloop_hook_fn)(rekv_evloop *loop, void *ctx);
/* A stop signal came: signo is its number from a signalfd, 0 from an eventfd (which carries none).
 * The callback decides: rekv_evloop_stop stops the loop. */
typedef void (*rekv_evloop_signal_fn)(rekv_evloop *loop, void *ctx, int signo);

int rekv_evloop_create(rekv_evloop **out, rekv_err *err);
/* Frees the loop; closes nothing it was given. NULL is fine. */
void rekv_evloop_free(rekv_evloop *loop);

/* Polls the ZeroMQ socket sock, or the fd, for events (0: not polled until set); returns the
 * entry's id (> 0). */
int rekv_evloop_add_socket(rekv_evloop *loop, void *sock, short events, rekv_evloop_io_fn fn,
                           void *ctx, rekv_err *err);
int rekv_evloop_add_fd(rekv_evloop *loop, int fd, short events, rekv_evloop_io_fn fn, void *ctx,
                       rekv_err *err);
/* Changes what entry id is polled for (0: nothing, e.g. a socket left unread for a while);
 * -ENOENT for an unknown id. */
int rekv_evloop_set_events(rekv_evloop *loop, int id, short events);
/* Removes entry id; -ENOENT for an unknown one. */
int rekv_evloop_del(rekv_evloop *loop, int id);

/* fd (a signalfd or an eventfd) becomes readable on a stop signal: the loop reads it and calls
 * fn, or stops when fn is NULL. Returns the entry's id. */
int rekv_evloop_add_signal_fd(rekv_evloop *loop, int fd, rekv_evloop_signal_fn fn, void *ctx,
                              rekv_err *err);

/* A timer first due delay_ms from now (0: the next round); returns its id (> 0). */
int rekv_evloop_timer_add(rekv_evloop *loop, long delay_ms, rekv_evloop_timer_fn fn, void *ctx,
                          rekv_err *err);
/* Makes timer id due delay_ms from now instead (inside its own callback the callback's return
 * decides); -ENOENT for an unknown (or ended) one. */
int rekv_evloop_timer_set(rekv_evloop *loop, int id, long delay_ms);
/* Ends timer id; -ENOENT for an unknown (or ended) one. */
int rekv_evloop_timer_del(rekv_evloop *loop, int id);

/* The hook called before each poll (NULL: none); one per loop, a second call replaces it. */
void rekv_evloop_before_sleep(rekv_evloop *loop, rekv_evloop_hook_fn fn, void *ctx);

/* Polls srv's fds each round and lets it answer scrapes with render(ctx) (common/metrics.h);
 * NULL srv: none. One per loop. */
void rekv_evloop_serve_metrics(rekv_evloop *loop, rekv_metrics_server *srv,
                               rekv_metrics_render_fn render, void *ctx);

/* Runs rounds until rekv_evloop_stop: 0, or the negative errno of a failed poll. A stop that came
 * before run returns at once. After a return the loop may run again. */
int rekv_evloop_run(rekv_evloop *loop, rekv_err *err);
/* Makes run return: no further callback of the round runs. Async-signal-safe and for any thread
 * (an atomic flag and an eventfd write). */
void rekv_evloop_stop(rekv_evloop *loop);
/* Rounds run so far (each poll is one), for tests and stats. */
unsigned long long rekv_evloop_rounds(const rekv_evloop *loop);

#endif
