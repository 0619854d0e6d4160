/* daemon.h — what every rekv daemon's main does the same way: stop on SIGTERM/SIGINT through an
 * fd its event loop polls, tell whoever started it that it is ready (a ready pipe, systemd's
 * sd_notify), pet systemd's watchdog, and parse its numeric options. For daemon mains only. */
#ifndef REKV_COMMON_DAEMON_H
#define REKV_COMMON_DAEMON_H

#include <stdint.h>

/* An eventfd that becomes readable on SIGTERM or SIGINT, through a handler rather than a blocked
 * mask plus signalfd: libraries such as OpenBLAS start threads before main with the signals
 * unblocked, and a process signal delivered to one of them would kill the daemon outright. The
 * daemon's event loop takes it with rekv_evloop_add_signal_fd (common/evloop.h). SIGHUP is left
 * alone: its default action ends the process. Also
 * ignores SIGPIPE (a dead peer is an error return, not death) and raises the open-file soft limit
 * to the hard one (connections are descriptors). Returns the fd or -errno. */
int rekv_daemon_stop_fd(void);

/* Reports readiness: "READY\n" on ready_fd (then closed) when >= 0, and READY=1 to systemd when
 * started under it (NOTIFY_SOCKET), which also arms rekv_daemon_watchdog. */
void rekv_daemon_ready(int ready_fd);

/* Pets systemd's watchdog when a third of its interval has passed; cheap, call from every loop
 * iteration. Does nothing outside systemd or without WatchdogSec=. */
void rekv_daemon_watchdog(void);

/* Tells systemd the daemon is stopping. */
void rekv_daemon_stopping(void);

/* Strict decimal uint32 parsing; 0 or -1. */
int rekv_parse_u32(const char *s, uint32_t *out);
/* A byte count: decimal digits with an optional K, M or G (binary multiples); 0 or -1. */
int rekv_parse_size(const char *s, uint64_t *out);

#endif
