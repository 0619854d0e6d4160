/* co_guard.h — the co_guards suites' shared parts (test_co_guards_*.c): the real
 * rekv-coordinator started in a private directory (its log kept), its control socket's calls, and
 * a fake worker speaking worker.proto on a DEALER. */
#ifndef REKV_TESTS_CO_GUARD_H
#define REKV_TESTS_CO_GUARD_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include "coordinator/coordinator.h"
#include "proto/worker.pb-c.h"

typedef struct env {
    char *dir;
    char ctl[4200], wrk[4200], state[4200], log[4200];
    pid_t co;
} env;

/* Starts rekv-coordinator in a fresh directory with extra arguments (NULL-terminated). */
void cg_env_start(env *e, const char *const *extra);

void cg_env_stop(env *e);

rekv_ctl *cg_ctl_open(const char *ep);

Rekv__Control__Response *cg_submit(rekv_ctl *c, uint32_t max_new, uint32_t top_logits);

uint64_t cg_submit_ok(rekv_ctl *c, uint32_t max_new, uint32_t top_logits);

Rekv__Control__Response *cg_stats(rekv_ctl *c);

/* Waits until job has ended (Check's timeout is the guard); returns its status. */
Rekv__Control__Response *cg_wait_end(rekv_ctl *c, uint64_t job);

typedef struct fake {
    void *zctx, *sock;
} fake;

void cg_fake_open(fake *f, const char *ep);

void cg_fake_close(fake *f);

void cg_fake_send(fake *f, Rekv__Worker__WorkerMsg *m);

/* The coordinator's next message (NULL after 20 s). */
Rekv__Worker__CoordMsg *cg_fake_recv(fake *f);

Rekv__Worker__CoordMsg *cg_fake_hello(fake *f, uint32_t max_batch, uint32_t vocab);

/* Connects a worker to ep and says Hello, which must be answered Welcome. */
void cg_fake_welcomed(fake *f, const char *ep, uint32_t max_batch, uint32_t vocab);

/* The next Plan (NULL when none comes). */
Rekv__Worker__CoordMsg *cg_fake_plan(fake *f);

/* Answers step with one job's tokens (and k top logits per token, ids 0..k-1, when k > 0). */
void cg_fake_progress(fake *f, uint64_t step, uint64_t job, const int32_t *tokens, size_t n,
                      int finished, uint32_t k);

/* Answers step with a Progress naming no job; unavailable (WorkerMsg.unavailable): NULL, or what
 * a worker whose kvstore is gone says. */
void cg_fake_no_job(fake *f, uint64_t step, const char *unavailable);

/* Reads the next Plan, which must join nothing, and answers it with a Progress naming no job
 * (what a worker says of a step whose jobs the coordinator no longer runs there). */
void cg_fake_empty(fake *f);
/* The next Plan that joins a job, the ones before it (a re-queued job backs off before it runs
 * again) answered as cg_fake_empty does; *cancelled counts the Plans that cancelled job. */
Rekv__Worker__CoordMsg *cg_fake_plan_join(fake *f, uint64_t job, int *cancelled);

/* Reads one worker message from a ROUTER (its routing id into id, idn bytes); NULL after 20 s. */
Rekv__Worker__WorkerMsg *cg_router_recv(void *sock, char *id, int *idn);

/* The test as a worker's coordinator: a ROUTER on a fresh ipc endpoint and rekv-gpuworker
 * (stories260K, cpu, resident, heartbeats every 100 ms) connected to it, its Hello read (the
 * worker's routing id in id/idn). */
typedef struct fake_co {
    char *dir;
    char ep[4200], log[4200], id[256];
    int idn;
    void *ctx, *sock;
    pid_t pid;
} fake_co;

void *cg_fake_co_bind(fake_co *f);

/* 0, or -1 when the model is missing (the test skips, tu_shared said why) */
int cg_fake_co_start(fake_co *f);

/* sends one message (body, n bytes) to the worker */
void cg_fake_co_send(fake_co *f, const void *body, size_t n);

void cg_fake_co_stop(fake_co *f);

#endif
