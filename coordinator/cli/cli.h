/* cli.h — the rekv CLI's subcommands (each an argc/argv main of its own) and their helpers. */
#ifndef REKV_COORDINATOR_CLI_H
#define REKV_COORDINATOR_CLI_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

int cli_generate(int argc, char **argv);
int cli_bench(int argc, char **argv);
/* `rekv eval`: teacher-forced NLL of a text in a mode (cli_eval.c) */
int cli_eval(int argc, char **argv);
/* `rekv skew`: calibrate (or show the cached) InfiniGen skewing matrices (cli_skew.c) */
int cli_skew(int argc, char **argv);
/* `rekv heads`: profile (or show the cached) CLO head profile (cli_heads.c) */
int cli_heads(int argc, char **argv);

struct rekv_gen_params;
struct rekv_gen_result;
struct rekv_err;
/* What `rekv generate` through a coordinator set up for the call: the private `rekv run` started
 * when none serves the model, its temporary directory, and SIGINT/SIGTERM handling that makes an
 * interrupted call give up and clean up. */
typedef struct cli_remote {
    pid_t pid;                      /* the private `rekv run`, 0 when none */
    char dir[4096];                 /* its temporary directory, "" when none */
    int sig_fd[2];                  /* pipe the signal handler writes to */
    int installed;                  /* the handlers are ours: old_action to restore */
    struct sigaction old_action[2]; /* SIGINT's and SIGTERM's before */
} cli_remote;
/* `rekv generate` through the coordinator at socket (NULL: the default control socket, or a
 * private `rekv run` started for the call when none serves model_path there). Fills res as
 * rekv_generate does; queued_s / run_s from the job's status. -EINTR when SIGINT or SIGTERM came.
 * Whatever it returns, call cli_remote_end(rm) afterwards (after printing the result: the private
 * trio's teardown need not delay it). */
int cli_generate_remote(cli_remote *rm, const char *model_path, const char *socket,
                        const int32_t *ids, int n_ids, const struct rekv_gen_params *gp,
                        struct rekv_gen_result *res, double *queued_s, double *run_s,
                        struct rekv_err *err);
/* Stops the private trio, removes its directory and restores the signal handling; returns the
 * signal that interrupted the call (0: none). */
int cli_remote_end(cli_remote *rm);

/* Whether a coordinator can answer at control endpoint ep (NULL: the default one) without
 * waiting for a reply: for an ipc:// path, that the socket exists and something listens on it.
 * 0 (also for other transports, where ZeroMQ finds out), or a negative errno with one line in err
 * naming the endpoint (-ENOENT: no socket, -ECONNREFUSED: a socket nobody listens on). */
int cli_ctl_reachable(const char *ep, struct rekv_err *err);

/* The trace file of one of several runs given --trace F: F with ".RUN" inserted before the
 * extension of its file name, or appended when it has none (t.json -> t.kvpr.json, t -> t.kvpr);
 * 0 or -ENAMETOOLONG. */
int cli_trace_path(const char *trace, const char *run, char *out, size_t len);

/* What a subcommand's option parser returns: CLI_PARSED to go on, else the command's exit code
 * (0 after --help, 2 after a usage error it has printed). */
enum { CLI_PARSED = -1 };

/* Usage errors name what they reject. A subcommand's argv[0] is its name as the user typed it
 * ("rekv generate", "rekv bench decode": rekv_main.c and cli_bench set it with cli_name_command),
 * so getopt_long's own messages about an unknown option or a missing value name the command too.
 * cli_name_command writes "PREFIX argv[0]" into name[len] (the caller's, living as long as argv)
 * and points argv[0] at it. */
void cli_name_command(char **argv, const char *prefix, char *name, size_t len);
/* What getopt_long left in argv[optind..argc): 0 when nothing, else -1 after printing
 * "ARGV0: unexpected argument 'ARG'" for the first; the caller prints its usage and exits 2. */
int cli_no_operands(int argc, char **argv);
/* A pseudo-random prompt of n token ids below vocab, drawn from *state (an LCG; each bench seeds
 * its own, so its prompts are the same run after run). */
void cli_random_tokens(uint64_t *state, int32_t *ids, size_t n, int vocab);

/* Parses "1,2,3" into a malloc'd array; -EINVAL on anything else. */
int cli_parse_ids(const char *s, int32_t **ids, int *n);
/* Strict numeric option parsing; print "rekv: --name: ..." and return -1 on error. */
int cli_parse_int(const char *name, const char *s, long lo, long hi, long *out);
int cli_parse_float(const char *name, const char *s, double lo, double hi, double *out);
/* One link emulation option, --link-gbps, --link-latency-us or --device-memory, into *link
 * (rekv_link_parse: the same rule in every program); prints "rekv: --name: ..." and returns -1 on
 * error. link may be a scratch config where the caller only checks the value. */
struct rekv_link_config;
int cli_parse_link(struct rekv_link_config *link, const char *name, const char *arg);
/* Reads a JSON array of token ids (--ids FILE) into a malloc'd array. */
int cli_read_ids(const char *path, int32_t **ids, size_t *n, struct rekv_err *err);
/* Reads a whole file (--text FILE) into *text (malloc'd, not NUL-terminated), its size in *len;
 * a read error (a directory, an I/O failure) is an error, not a short text. */
int cli_read_text(const char *path, char **text, size_t *len, struct rekv_err *err);
/* A calibration text for model_path: --ids FILE, or --text FILE through the model's tokenizer
 * (-ENOENT with "give the text as --ids" when it has none), cut to the context (a note on stderr
 * unless quiet). *ids malloc'd. */
struct rekv_model_config;
int cli_calibration_ids(const char *model_path, const struct rekv_model_config *cfg,
                        const char *text_path, const char *ids_path, int quiet, int32_t **ids,
                        int *n, struct rekv_err *err);

#endif
