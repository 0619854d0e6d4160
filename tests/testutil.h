/* testutil.h — helpers shared by the Check suites. */
#ifndef REKV_TESTS_TESTUTIL_H
#define REKV_TESTS_TESTUTIL_H

#include <check.h>

/* Path of a file under ../shared (tests run from the repository root), or NULL when it is absent.
 * When absent and CI=true the calling test fails with a message naming the file; elsewhere it
 * prints a skip line and returns NULL, and the test should return. The string stays valid for the
 * process's life (one per file), so a test may hold several. */
const char *tu_shared(const char *rel);

/* Runs one suite and returns the process exit code (0 when every test passed). Check's
 * environment picks the output (CK_VERBOSITY; CK_LOG_FILE_NAME=- adds a line as each case ends);
 * stdout is line-buffered. */
int tu_run_suite(Suite *s);
/* main() of a test program whose cases share one synthetic model: makes a fresh temporary
 * directory into dir (dir_n bytes; mkdtemp, as no ck_ call may run outside a test), writes
 * `rekv-loader synth SYNTH_ARGS` into dir/m (its path into model), runs suite() and removes the
 * directory; returns the exit code (1 when the model could not be made). */
int tu_run_suite_synth(Suite *(*suite)(void), const char *synth_args, char *dir, size_t dir_n,
                       char *model, size_t model_n);

/* A fresh private temporary directory (mkdtemp under $TMPDIR or /tmp); removed by tu_rmrf. */
char *tu_tmpdir(void);
void tu_rmrf(const char *path);

/* Reads a whole file; NULL on error. *len may be NULL. */
char *tu_read_file(const char *path, size_t *len);

/* Path to a built program, e.g. tu_bin("rekv") -> "build/bin/rekv". Static storage. */
const char *tu_bin(const char *name);

/* Runs a shell command and captures stdout (malloc'd). Returns the exit status (or -1). */
int tu_run(const char *cmd, char **out);
/* Runs a shell command that must succeed (exit 0); fails the test with its output otherwise. */
void tu_run_ok(const char *cmd);

/* 1 when CI=true: a part that cannot run is then a failure, never a skip. */
int tu_ci(void);

/* ---- a virtual machine (tests/vm.sh): a real systemd, a disk of the test's own ---- */

/* Runs this very test program (its suite and case by CK_RUN_SUITE/CK_RUN_CASE) as root in a
 * virtual machine with a 64 MiB disk (/dev/vda, WORKDIR/disk.img: kept for the next boot), its
 * environment plus `env` ("NAME=value ..."), which tells the test it is the guest. Returns 1 when
 * the machine ran and ended (WORKDIR/out holds what it wrote: tu_vm_out), 0 when no machine can
 * run here (printed as a skip with the reason; a failure under CI=true); any other failure of
 * vm.sh fails the test. */
int tu_vm_self(const char *workdir, const char *env, const char *suite, const char *tcase);
/* WORKDIR/out/NAME as the guest wrote it (malloc'd), "" when it wrote none. */
char *tu_vm_out(const char *workdir, const char *name);
/* The last 2,000 bytes of a log, for a message Check can carry (its messages are short). */
const char *tu_log_end(const char *log);

/* ---- daemons: the real processes, started as their users start them ---- */

#include <sys/types.h>

/* Starts a program (args NULL-terminated, at most 40) with --ready-fd, its stderr appended to
 * errlog (NULL: inherited), and waits up to 60 s for READY; returns its pid, or -1 when it exited
 * first (its wait status in *status when status != NULL). */
pid_t tu_spawn(const char *const *args, const char *errlog, int *status);
/* SIGTERM and wait; returns the wait status. */
int tu_stop(pid_t pid);
/* SIGKILL and reap. */
void tu_kill9(pid_t pid);
/* The unnamed spill file (O_TMPFILE) a rekv-kvstore of pid keeps in spill_dir, found through
 * /proc/PID/fd: its descriptor number in that process (-1 when it has none there), and the file
 * opened read-write here (-1 likewise). */
int tu_spill_fd_number(pid_t pid, const char *spill_dir);
int tu_spill_fd(pid_t pid, const char *spill_dir);
/* 1 when the file holds needle. */
int tu_file_has(const char *path, const char *needle);
/* A "Name: N kB" line of /proc/PID/status (field "VmRSS", "VmHWM", "RssShmem", ...): N, or -1
 * when the process or the line is not there. A count, not a time. */
long tu_proc_status_kb(pid_t pid, const char *field);

/* ---- the coordinator's control socket ---- */

#include "coordinator/coordinator.h"

rekv_ctl *tu_ctl_open(const char *endpoint);
/* A request (a fresh id) and its response, within 20 s; the caller frees the response. */
Rekv__Control__Response *tu_ctl_call(rekv_ctl *c, Rekv__Control__Request *rq);
Rekv__Control__Response *tu_ctl_status(rekv_ctl *c, uint64_t job);
Rekv__Control__Response *tu_ctl_stats(rekv_ctl *c);
/* Waits (up to 30 s) until Health says n workers. */
void tu_ctl_wait_workers(rekv_ctl *c, uint32_t n);

/* ---- a backend's trace ---- */

#include "gpuworker/device/backend.h"

/* One span of a backend's Chrome trace: its stream's name, its label, start and end (us). */
typedef struct tu_span {
    char stream[64], label[96];
    double start, end;
} tu_span;
/* The spans be traced since its trace_start ("X" events, in the file's order), read back from
 * what trace_write writes; *n their count. The caller frees the array. */
tu_span *tu_trace_spans(rekv_backend *be, size_t *n);

#endif
