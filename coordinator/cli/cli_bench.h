/* cli_bench.h — `rekv bench`'s benchmarks (each an argc/argv main, dispatched by cli_bench.c) and
 * the yardsticks they measure in the same run: the link's and the device's peaks. */
#ifndef REKV_COORDINATOR_CLI_BENCH_H
#define REKV_COORDINATOR_CLI_BENCH_H

#include <stddef.h>
#include <sys/types.h>

#include "common/err.h"
#include "coordinator/coordinator.h"
#include "gpuworker/device/backend.h"
#include "gpuworker/gpuworker.h"
#include "kvstore/kvstore.h"

/* `rekv bench forward`: the engine's forward pass beside OpenBLAS (cli_bench_forward.c) */
int cli_bench_forward(int argc, char **argv);
/* `rekv bench decode`: every mode's decode on the same prompts (cli_bench_decode.c) */
int cli_bench_decode(int argc, char **argv);

/* `rekv bench http`: the same jobs over the HTTP API and the control socket (cli_bench_http.c) */
int cli_bench_http(int argc, char **argv);

/* `rekv bench serve --workload chat|system`: the prefix cache on against off (cli_bench_prefix.c) */
int cli_bench_serve_workload(int argc, char **argv);

/* `rekv bench remote`: two replicas sharing through a Redis against sharing nothing
 * (cli_bench_remote.c) */
int cli_bench_remote(int argc, char **argv);

/* The serving benchmarks' private trio (cli_bench_trio.c): `rekv run ARGS --dir D --ready-fd F`
 * in a forked child, D a new temporary directory (removed by cli_trio_stop). */
typedef struct cli_trio {
    pid_t pid; /* the `rekv run` child; 0: none */
    char dir[4096];
} cli_trio;

/* 0 once the trio says READY; else -1 with a message naming "rekv bench BENCH" printed and
 * whatever started stopped. args: NULL-terminated, without "rekv run", --dir and --ready-fd. */
int cli_trio_start(cli_trio *t, const char *bench, const char *const *args);
void cli_trio_stop(cli_trio *t);
/* The pid of the trio's daemon PROG ("rekv-coordinator", "rekv-gpuworker", "rekv-kvstore");
 * 0 when none runs. */
pid_t cli_trio_child(const cli_trio *t, const char *prog);
/* A process's CPU time so far (user + system, all its threads) in seconds; -1 where /proc cannot
 * tell. */
double cli_proc_cpu_s(pid_t pid);
/* Removes a directory tree; 0, or -1 with a message printed. */
int cli_rm_tree(const char *dir);
/* qsort's comparison of doubles, ascending. */
int cli_cmp_double(const void *a, const void *b);
/* The nearest-rank percentile p (0..100) of v[0..n), sorting v; 0 when n is 0. */
double cli_percentile(double *v, size_t n, double p);
/* A finished job's generated ids (malloc'd into *out, *n_out of them) and its prompt tokens from
 * the prefix cache, from its Status on c; 0, or -1 with "rekv bench BENCH: Status: ..." printed. */
int cli_job_answer(rekv_ctl *c, const char *bench, uint64_t job, int32_t **out,
                   uint32_t *n_out, uint32_t *cached);
/* The next reply on c (*r, to free with rekv__control__response__free_unpacked; *at, when it came:
 * monotonic ns), waiting as long as the coordinator is not silent for CLI_BENCH_SILENCE_MS (then
 * the run is stuck); 0, or -1 with "rekv bench BENCH: ..." printed. */
#define CLI_BENCH_SILENCE_MS 300000
int cli_bench_recv(rekv_ctl *c, const char *bench, Rekv__Control__Response **r, uint64_t *at);
/* The configuration of the model at path (any model rekv loads); 0, or 1 with the error printed. */
int cli_model_config(const char *path, rekv_model_config *cfg);

/* The process's peak resident memory (VmHWM) in bytes, 0 where /proc cannot tell; reset makes
 * the next peak count from now (writing 5 to /proc/self/clear_refs: 0, or -errno where the kernel
 * refuses, and the peak stays the process's). */
unsigned long long cli_peak_rss_bytes(void);
int cli_peak_rss_reset(void);

/* The link's peak in this run, three ways: from the kvstore's arena as the pipeline copies from it
 * (page-locked by the backend where it can: cudaHostRegister), from the backend's own pinned host
 * memory (cudaHostAlloc), and from ordinary pageable memory. */
typedef struct link_peak {
    double arena_gbps, pinned_gbps, pageable_gbps;
    size_t bytes;
    char error[1024]; /* why it could not be measured ("" when it was): the yardstick is lost, not
                        the run (a device the run filled has no room left for its copies) */
} link_peak;

int cli_bench_measure_link(rekv_backend *be, rekv_kvstore_client *store, link_peak *out,
                           rekv_err *err);

/* The device's own rates in this run, the yardsticks of issue 15's goals: a device-to-device copy
 * (GB/s counting the bytes read and the bytes written: the memory's rate a decode step's reads
 * share) and the engine's GEMM (the kernel table's linear, as the pipeline calls it) over one
 * layer's projections at the rows of a prefill step (at most DEVICE_GEMM_ROWS), FLOP/s. */
enum { DEVICE_GEMM_ROWS = 2048 };
typedef struct device_peak {
    double copy_gbps, gemm_flops;
    size_t copy_bytes;
    int gemm_rows;
    char error[1024]; /* bench decode: why it could not be measured ("": it was, or not tried) */
} device_peak;

int cli_bench_measure_device(rekv_backend *be, const rekv_engine *eng, int rows, device_peak *out,
                             rekv_err *err);

#endif
