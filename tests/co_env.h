/* co_env.h — the coordinator suites' shared parts (test_coordinator_*.c): a test
 * mix of jobs with rekv_generate's output for each, the daemons (rekv-kvstore, rekv-gpuworker,
 * rekv-coordinator, `rekv run`) started in a private directory, and the control socket's calls. */
#ifndef REKV_TESTS_CO_ENV_H
#define REKV_TESTS_CO_ENV_H

#include <stdint.h>
#include <sys/types.h>
#include "coordinator/coordinator.h"
#include "common/mode.h"
#include "gpuworker/gpuworker.h"
#include "kvstore/kvstore.h"

/* One job of the test mix and its expected output. */
typedef struct tjob {
    int32_t prompt[64];
    int n_prompt;
    rekv_gen_params gp;
    rekv_gen_result ref; /* rekv_generate in this process */
    uint64_t id;         /* the coordinator's job id */
} tjob;

/* A deterministic mix: prompt lengths 1..40, greedy and sampled, top-k, top-p, EOS on and off. */
void ct_make_jobs(tjob *jobs, int n, int max_new_base, int vocab, uint64_t salt);

void ct_reference(tjob *jobs, int n, const char *model);

void ct_free_jobs(tjob *jobs, int n);

/* Submits without waiting for the reply (so that all jobs are in flight together). */
uint64_t ct_submit_async(rekv_ctl *c, const tjob *j);

/* Submits all jobs at once, then collects the replies; returns how many were accepted (BUSY ones
 * get id 0). */
int ct_submit_all(rekv_ctl *c, tjob *jobs, int n);

/* Waits until every accepted job has ended, then checks each one's tokens against the reference.
 * No deadline of its own (Check's timeout is the guard): load makes it slower, never red. */
void ct_wait_and_check(rekv_ctl *c, tjob *jobs, int n);

/* Job j: a 40-token prompt of its own per salt (two full cache blocks), greedy, 8 new tokens, its
 * reference from model. */
void ct_make_salted_job(tjob *j, const char *model, int salt);
/* Runs a copy of job proto to its end (its tokens checked against the reference) and returns its
 * cached_tokens: the prompt tokens it took from the prefix cache. */
uint32_t ct_run_cached(rekv_ctl *c, const tjob *proto);

/* Starts a program with --ready-fd and waits for READY. */
pid_t ct_spawn(const char *const *args);

int ct_stop(pid_t pid);

typedef struct env {
    char *dir;
    char ctl[4200], wrk[4200], state[4200], kv[4200];
    char model[4096];
} env;

int ct_env_open(env *e);

void ct_env_close(env *e);

pid_t ct_start_coordinator(env *e, const char *queue, const char *timeout_ms);

/* Workers run the cpu backend: jobs are checked against rekv_generate bit for bit, and on a GPU
 * machine "auto" would be cuda. */
pid_t ct_start_worker(env *e, const char *max_batch);

/* A worker keeping its KV cache in e's kvstore (offload mode); name NULL: its default; gbps
 * non-NULL: behind an emulated link of that many Gbit/s, so every step's copies take at least
 * their bytes over it. */
pid_t ct_kv_worker(env *e, const char *max_batch, const char *name, const char *gbps);

pid_t ct_start_kv_worker(env *e, const char *max_batch, const char *name);

rekv_kvstore_client *ct_kv_open(env *e);

void ct_kv_stats(rekv_kvstore_client *k, rekv_kv_stats *st);

rekv_ctl *ct_ctl_open(const char *ep);

Rekv__Control__Response *ct_health(rekv_ctl *c);

/* Waits until the coordinator sees n workers (Check's timeout is the guard). */
void ct_wait_workers(rekv_ctl *c, uint32_t n);

/* `rekv run` (cli_run in a child) on e's private sockets; returns once it is ready. mode NULL:
 * the default. */
pid_t ct_rekv_run_start(env *e, const char *host_bytes, const char *max_batch, const char *mode);

/* rekv run with more arguments (extra: NULL-terminated, may be NULL), on the cpu backend (see
 * start_worker). */
pid_t ct_rekv_run_start_args(env *e, const char *host_bytes, const char *max_batch,
                             const char *mode, const char *const *extra);

/* Ctrl-C: everything stops cleanly. */
void ct_rekv_run_stop(pid_t pid);

/* The coordinator's Stats (free with rekv__control__response__free_unpacked). */
Rekv__Control__Response *ct_stats(rekv_ctl *c);
/* The spill room the coordinator's admission counts on its one worker's kvstore (rekv stats). */
uint64_t ct_worker_spill_room(rekv_ctl *c);

#endif
