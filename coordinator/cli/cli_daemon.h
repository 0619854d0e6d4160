/* cli_daemon.h — the rekv subcommands that work with the daemons: `rekv run` starts the local trio
 * (kvstore, gpuworker, coordinator) and supervises it; submit, status, cancel and stats talk to a
 * coordinator's control socket. Each is an argc/argv main returning a process exit code
 * (0 ok, 1 failure, 2 usage). */
#ifndef REKV_COORDINATOR_CLI_DAEMON_H
#define REKV_COORDINATOR_CLI_DAEMON_H

#include "coordinator/coordinator.h"

int cli_run(int argc, char **argv);
int cli_submit(int argc, char **argv);
int cli_status(int argc, char **argv);
int cli_cancel(int argc, char **argv);
int cli_stats(int argc, char **argv);
/* `rekv bench serve`: N jobs through a private trio per mode (cli_bench_serve.c). */
int cli_bench_serve(int argc, char **argv);

/* Sends a Submit and waits for its reply. An empty rq->submit->client_key gets a random one
 * first (kept in key[REKV_CLIENT_KEY_MAX + 1], which must outlive the call's retries); when no
 * reply comes within timeout_ms (a coordinator restarting, a lost connection), the same Submit
 * is sent again under a new request id, at most `tries` times in all: the coordinator answers a
 * repeated key with the job it accepted, so a retry never makes a second job. $REKV_TIMEOUT_MS
 * overrides timeout_ms. 0 or the last attempt's negative errno. */
int cli_submit_call(rekv_ctl *c, Rekv__Control__Request *rq, char *key, int timeout_ms,
                    int tries, Rekv__Control__Response **r, rekv_err *err);

#endif
