/* cli_daemon.h — the rekv subcommands that work with the daemons: `rekv run` starts the local trio
 * (kvstore, gpuworker, coordinator) and supervises it; submit, status, cancel and stats talk to a
 * coordinator's control socket. Each is an argc/argv main returning a process exit code
 * (0 ok, 1 failure, 2 usage). */
#ifndef REKV_COORDINATOR_CLI_DAEMON_H
#define REKV_COORDINATOR_CLI_DAEMON_H

int cli_run(int argc, char **argv);
int cli_submit(int argc, char **argv);
int cli_status(int argc, char **argv);
int cli_cancel(int argc, char **argv);
int cli_stats(int argc, char **argv);

#endif
