/* cli_bench_remote.c — `rekv bench remote`: issue 38's goals measured, two replicas that share
 * their prefix caches through one Redis against the same two with nothing shared, in one run.
 *
 * Two private trios (cli_bench_trio.c: `rekv run`, offload, the prefix cache on), replica A and
 * replica B, and one redis-server this bench starts (Debian's, on a unix socket in a temporary
 * directory, `--save '' --appendonly no`, no TCP port). The workload is the shared-system-prompt
 * one of `rekv bench serve --workload system` (cli_bench_prefix.c) spread round-robin over the two
 * replicas, one request at a time, with the system prompt changing every two requests: pair p is
 * a --system-len P token prompt of its own (seeded) asked first on A, then on B, each with its own
 * --question-len L tokens. So every request of B has a prefix A computed and B never held — the
 * case the remote tier exists for — and every request of A a prefix held nowhere: each of A's
 * lookups misses, locally and in Redis. Every request makes --max-new-tokens G tokens (greedy,
 * EOS ignored).
 *
 * Runs, each on fresh trios (and a fresh Redis):
 *   local   no --remote: nothing is shared; B computes each system prompt again. The reference.
 *   remote  both with --remote unix://...: B reads A's blocks from Redis (JobStatus.cached_tokens;
 *           Redis's own keyspace_hits beside). Before each of B's requests the bench waits until
 *           Redis holds every block written so far (DBSIZE against the distinct whole blocks of
 *           the prompts and answers, counted from the token lists: A's write-through is
 *           asynchronous, and "a prefix computed by A" means one A has finished writing).
 *   kill    as remote, and redis-server is killed (SIGKILL) right after B's request of pair
 *           P/2 is submitted: that job and every later one go on without Redis.
 *   steps   three trios side by side (rm_steps_run): no --remote, --remote on a Redis at normal
 *           priority, --remote on a Redis at SCHED_IDLE (as an operator sharing a replica's cores
 *           with Redis should run it), the same prompts (A's) in turn, every lookup missing. The
 *           step-time goal is measured here rather than between the runs above: those run minutes
 *           apart on a machine whose load changes, and B's work differs between them.
 * Reported: B's TTFT p50 remote / local (goal <= 0.30); jobs failed in every run (goal 0); for
 * each remote trio of the steps run, the median over pairs of its mean step time over the local
 * trio's for the same prompt (the coordinator's worker_step_avg_s around each request): the steps
 * of a replica whose every lookup misses while its blocks are written through (goal <= 1.05,
 * with Redis at either priority; each trio's mean over the whole run beside it). Every answer must equal the local run's: mismatches are counted, and the exit code is 1
 * on any, or on a failed job. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_bench.h"
#include "coordinator/coordinator.h"
#include "kvstore/kvstore.h"
#include "loader/loader.h"

#define BLOCK REKV_KV_BLOCK_TOKENS
#define REDIS_START_MS 10000
#define KEYS_WAIT_MS 60000 /* a dropped write (a full queue) would hold the wait: give up then */
#define WARM_LEN 40        /* the warm-up job's prompt: two whole blocks, written by both */
#define WARM_BLOCKS ((WARM_LEN + 1 - 1) / BLOCK)

enum { RUN_LOCAL, RUN_REMOTE, RUN_KILL, RUN_STEPS, N_RUNS };
static const char *const run_names[N_RUNS] = {"local", "remote", "kill", "steps"};
enum { REP_A, REP_B };
/* the steps run's trios: no --remote; --remote on a Redis at normal priority; at SCHED_IDLE */
enum { S_LOCAL, S_REMOTE, S_IDLE, N_S };

typedef struct rm_opts {
    const char *model, *backend, *arena, *redis_bin, *timeout_ms;
    long pairs, sys_len, q_len, max_new;
} rm_opts;

typedef struct rreq {
    int32_t *prompt, *out;
    uint32_t n_prompt, n_out, cached;
    double ttft_s;
    double step_avg_s; /* the steps run: its worker's mean step over this request alone */
    int failed;
} rreq;

typedef struct rm_run {
    int kind, n, killed_before; /* killed_before: the request redis-server was killed under */
    rreq *reqs;                 /* [n]: request i on replica i % 2 */
    double wall_s, step_avg_s[N_S]; /* [REP_A, REP_B], or the steps run's [N_S] */
    uint64_t tokens, failed, steps[N_S], waits_timed_out;
    long long redis_hits, redis_misses, redis_keys; /* -1: not asked (local) or Redis gone */
    char first_error[256];
} rm_run;

typedef struct redis_srv {
    pid_t pid;
    char dir[4096], sock[4200], url[4300];
} redis_srv;

/* ---------------------------------------------------------------- redis-server */

/* The redis-server to run: --redis-server PATH, else the first in PATH; 0, or -1 with a message. */
static int redis_find(const char *given, char *out, size_t len)
{
    if (given) {
        snprintf(out, len, "%s", given);
        if (access(out, X_OK) == 0)
            return 0;
        fprintf(stderr, "rekv bench remote: --redis-server %s: %s\n", given, strerror(errno));
        return -1;
    }
    const char *path = getenv("PATH");
    char *d = strdup(path && *path ? path : "/usr/bin:/bin"), *save = NULL;
    for (char *p = d ? strtok_r(d, ":", &save) : NULL; p; p = strtok_r(NULL, ":", &save)) {
        snprintf(out, len, "%s/redis-server", p);
        if (access(out, X_OK) == 0) {
            free(d);
            return 0;
        }
    }
    free(d);
    fprintf(stderr, "rekv bench remote: no redis-server in PATH (Debian: apt-get install "
                    "redis-server; or --redis-server PATH)\n");
    return -1;
}

static redisContext *redis_conn(const redis_srv *r)
{
    struct timeval tv = {5, 0};
    redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
    if (c && c->err) {
        redisFree(c);
        c = NULL;
    }
    return c;
}

/* One integer reply of cmd, or -1. */
static long long redis_int(redisContext *c, const char *cmd)
{
    redisReply *rp = redisCommand(c, cmd);
    long long v = rp && rp->type == REDIS_REPLY_INTEGER ? rp->integer : -1;
    if (rp)
        freeReplyObject(rp);
    return v;
}

/* A field of INFO stats ("keyspace_hits"), or -1. */
static long long redis_info(redisContext *c, const char *field)
{
    redisReply *rp = redisCommand(c, "INFO stats");
    long long v = -1;
    const char *at = rp && rp->type == REDIS_REPLY_STRING ? strstr(rp->str, field) : NULL;
    if (at && at[strlen(field)] == ':')
        v = atoll(at + strlen(field) + 1);
    if (rp)
        freeReplyObject(rp);
    return v;
}

static void redis_stop(redis_srv *r)
{
    if (r->pid > 0) {
        kill(r->pid, SIGKILL);
        while (waitpid(r->pid, NULL, 0) < 0 && errno == EINTR)
            ;
        r->pid = 0;
    }
    if (r->dir[0])
        cli_rm_tree(r->dir);
    r->dir[0] = '\0';
}

/* Starts redis-server in a new temporary directory, on a unix socket there (at SCHED_IDLE when
 * idle: CPU time only when nothing else wants it), and waits until it answers PING; 0, or -1 with a message printed (its log named) and nothing left running. */
static int redis_start(redis_srv *r, const char *bin, int idle)
{
    memset(r, 0, sizeof(*r));
    const char *tmp = getenv("TMPDIR");
    snprintf(r->dir, sizeof(r->dir), "%s/rekv-redis.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(r->dir) == NULL) {
        fprintf(stderr, "rekv bench remote: %s: %s\n", r->dir, strerror(errno));
        r->dir[0] = '\0';
        return -1;
    }
    snprintf(r->sock, sizeof(r->sock), "%s/redis.sock", r->dir);
    snprintf(r->url, sizeof(r->url), "unix://%s", r->sock);
    char log[4300];
    snprintf(log, sizeof(log), "%s/redis.log", r->dir);
    fflush(NULL);
    pid_t parent = getpid();
    if ((r->pid = fork()) < 0) {
        fprintf(stderr, "rekv bench remote: fork: %s\n", strerror(errno));
        r->pid = 0;
        redis_stop(r);
        return -1;
    }
    if (r->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* Redis lives no longer than the bench */
        if (getppid() != parent)
            _exit(1);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (fd >= 0)
            dup2(fd, 1), dup2(fd, 2);
        struct sched_param sp = {0};
        if (idle && sched_setscheduler(0, SCHED_IDLE, &sp) != 0)
            _exit(126);
        execl(bin, "redis-server", "--port", "0", "--unixsocket", r->sock, "--unixsocketperm",
              "700", "--save", "", "--appendonly", "no", "--dir", r->dir, (char *)NULL);
        _exit(127);
    }
    for (uint64_t t0 = rekv_now_ns();
         rekv_now_ns() - t0 < (uint64_t)REDIS_START_MS * 1000000ull; usleep(10000)) {
        redisContext *c = redis_conn(r);
        redisReply *rp = c ? redisCommand(c, "PING") : NULL;
        int up = rp && rp->type == REDIS_REPLY_STATUS;
        if (rp)
            freeReplyObject(rp);
        if (c)
            redisFree(c);
        if (up)
            return 0;
        if (waitpid(r->pid, NULL, WNOHANG) == r->pid) {
            r->pid = 0;
            break;
        }
    }
    char msg[8192] = "";
    FILE *f = fopen(log, "r");
    size_t n = f ? fread(msg, 1, sizeof(msg) - 1, f) : 0;
    msg[n] = '\0';
    if (f)
        fclose(f);
    fprintf(stderr, "rekv bench remote: %s did not start on %s:\n%s\n", bin, r->sock, msg);
    redis_stop(r);
    return -1;
}

/* ---------------------------------------------------------------- the workload */

/* Request i: pair i/2's system prompt, then the question of its side (A even, B odd). */
static int make_prompt(const rm_opts *o, int vocab, int i, rreq *r)
{
    long n = o->sys_len + o->q_len;
    if ((r->prompt = malloc(sizeof(int32_t) * (size_t)n)) == NULL)
        return -ENOMEM;
    uint64_t x = 777 + 1000003ull * (uint64_t)(i / 2);
    cli_random_tokens(&x, r->prompt, (size_t)o->sys_len, vocab);
    x = 7919ull * (uint64_t)(i + 1) + 13;
    cli_random_tokens(&x, r->prompt + o->sys_len, (size_t)o->q_len, vocab);
    r->n_prompt = (uint32_t)n;
    r->ttft_s = -1;
    return 0;
}

/* Token t of what request r wrote to its cache: its prompt, then its answer. */
static int32_t written_tok(const rreq *r, uint32_t t)
{
    return t < r->n_prompt ? r->prompt[t] : r->out[t - r->n_prompt];
}

/* The whole blocks request r wrote: its prompt and answer but the answer's last token, whose K,V
 * no step computes. */
static uint32_t written_blocks(const rreq *r)
{
    return r->n_out ? (r->n_prompt + r->n_out - 1) / BLOCK : 0;
}

/* The distinct blocks (chain keys) requests [0, upto] wrote, the warm-up's beside: each
 * request's blocks but those its longest whole-block prefix shared with an earlier one holds. */
static long long keys_written(const rm_run *run, int upto)
{
    long long keys = WARM_BLOCKS;
    for (int i = 0; i <= upto; i++) {
        const rreq *r = &run->reqs[i];
        uint32_t k = written_blocks(r), best = 0;
        for (int j = 0; j < i; j++) {
            const rreq *e = &run->reqs[j];
            uint32_t m = written_blocks(e) < k ? written_blocks(e) : k, t = 0;
            while (t < m * BLOCK && written_tok(r, t) == written_tok(e, t))
                t++;
            best = t / BLOCK > best ? t / BLOCK : best;
        }
        keys += k - best;
    }
    return keys;
}

/* Waits until Redis holds want keys (at most KEYS_WAIT_MS; counted when it gives up). */
static void wait_dbsize(const redis_srv *r, rm_run *run, long long want)
{
    long long have = -1;
    redisContext *c = redis_conn(r);
    uint64_t t0 = rekv_now_ns();
    while (c && (have = redis_int(c, "DBSIZE")) >= 0 && have < want &&
           rekv_now_ns() - t0 < (uint64_t)KEYS_WAIT_MS * 1000000ull)
        usleep(5000);
    if (have < want)
        run->waits_timed_out++;
    if (c)
        redisFree(c);
}

/* Waits until Redis holds what requests [0, upto] wrote. */
static void wait_keys(const redis_srv *r, rm_run *run, int upto)
{
    wait_dbsize(r, run, keys_written(run, upto));
}

/* ---------------------------------------------------------------- one request */

static void rm_error(rm_run *run, rreq *q, const char *what)
{
    if (q)
        q->failed = 1;
    if (!run->first_error[0])
        snprintf(run->first_error, sizeof(run->first_error), "%s", what);
}

static int rm_submit(rekv_ctl *c, const rreq *q, long max_new, uint64_t *rid, rekv_err *err)
{
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT; /* greedy */
    Rekv__Control__Submit sb = REKV__CONTROL__SUBMIT__INIT;
    sb.sampling = &smp;
    sb.prompt_ids = q->prompt;
    sb.n_prompt_ids = q->n_prompt;
    sb.max_new_tokens = (uint32_t)max_new;
    sb.stop_at_eos = 0;
    sb.stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    return rekv_ctl_send(c, &rq, rid, err);
}

/* Runs q to its end on c (killing kill, when given, right after the Submit): its TTFT, answer and
 * cached tokens; a job that fails is marked, not an error. 0, or -1 with a message printed. */
static int rm_request(rekv_ctl *c, rreq *q, long max_new, redis_srv *kill, rm_run *run)
{
    rekv_err err = {0};
    uint64_t rid = 0, job = 0, t0 = rekv_now_ns();
    if (rm_submit(c, q, max_new, &rid, &err)) {
        fprintf(stderr, "rekv bench remote: %s\n", err.msg);
        return -1;
    }
    if (kill)
        redis_stop(kill);
    for (int done = 0; !done;) {
        Rekv__Control__Response *r = NULL;
        uint64_t t;
        if (cli_bench_recv(c, "remote", &r, &t))
            return -1;
        if (r->id != rid) { /* not this job's (nothing else is asked on c meanwhile) */
            rekv__control__response__free_unpacked(r, NULL);
            continue;
        }
        if (r->code != REKV__CONTROL__CODE__OK) {
            rm_error(run, q, r->error ? r->error : rekv_ctl_code_name(r->code));
            done = 1;
        } else if (r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
            job = r->submitted->job;
        } else if (r->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT) {
            if (r->event->n_tokens > 0 && q->ttft_s < 0)
                q->ttft_s = (double)(t - t0) * 1e-9;
            if ((done = r->event->done) && r->event->state != REKV__CONTROL__JOB_STATE__DONE)
                rm_error(run, q, r->event->error && *r->event->error
                                     ? r->event->error
                                     : rekv_ctl_state_name(r->event->state));
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
    return q->failed ? 0 : cli_job_answer(c, "remote", job, &q->out, &q->n_out, &q->cached);
}

/* The coordinator's steps and mean worker step time so far; 0 or -1 with a message printed. */
static int rm_steps(rekv_ctl *c, uint64_t *steps, double *avg_s)
{
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    Rekv__Control__Response *r = NULL;
    rekv_err err = {0};
    int rc = -1;
    if (rekv_ctl_call(c, &rq, 10000, &r, &err) || r->body_case != REKV__CONTROL__RESPONSE__BODY_STATS) {
        fprintf(stderr, "rekv bench remote: Stats: %s\n", r ? rekv_ctl_code_name(r->code) : err.msg);
    } else {
        *steps = r->stats->steps;
        *avg_s = r->stats->worker_step_avg_s;
        rc = 0;
    }
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    return rc;
}

/* ---------------------------------------------------------------- one run */

/* Starts replica k's trio (with --remote url when url) and connects; then one short warm-up job
 * that shares nothing with the workload (first-step costs). 0 or -1 with a message printed. */
static int rm_replica(const rm_opts *o, int vocab, const char *url, cli_trio *t, rekv_ctl **c,
                      rm_run *run)
{
    const char *a[32] = {"--model", o->model, "--backend", o->backend, "--host-bytes", o->arena,
                         "--max-batch", "2", "--queue", "4", "--mode", "offload",
                         "--prefix-cache", "on"};
    int n = 14;
    if (url) {
        a[n++] = "--remote", a[n++] = url;
        a[n++] = "--remote-timeout-ms", a[n++] = o->timeout_ms;
    }
    a[n] = NULL;
    char ep[4200];
    rekv_err err = {0};
    if (cli_trio_start(t, "remote", a))
        return -1;
    snprintf(ep, sizeof(ep), "ipc://%s/control", t->dir);
    if (rekv_ctl_connect(ep, NULL, c, &err)) {
        fprintf(stderr, "rekv bench remote: %s\n", err.msg);
        return -1;
    }
    int32_t ids[WARM_LEN];
    uint64_t x = 99;
    cli_random_tokens(&x, ids, WARM_LEN, vocab);
    rreq w = {.prompt = ids, .n_prompt = WARM_LEN, .ttft_s = -1};
    int rc = rm_request(*c, &w, 1, NULL, run);
    free(w.out);
    if (rc == 0 && w.failed) {
        fprintf(stderr, "rekv bench remote: the warm-up job failed: %s\n", run->first_error);
        return -1;
    }
    return rc;
}

/* The workload on started replicas; 0 or -1 with a message printed. */
static int rm_workload(const rm_opts *o, rm_run *run, rekv_ctl *const *c, redis_srv *rs)
{
    uint64_t steps0[2];
    double avg0[2];
    for (int k = 0; k < 2; k++)
        if (rm_steps(c[k], &steps0[k], &avg0[k]))
            return -1;
    int kill_at = run->kind == RUN_KILL ? (int)(o->pairs / 2) * 2 + REP_B : -1;
    uint64_t t0 = rekv_now_ns();
    for (int i = 0; i < run->n; i++) {
        int rep = i % 2;
        if (rep == REP_B && rs->pid > 0)
            wait_keys(rs, run, i - 1);
        if (rm_request(c[rep], &run->reqs[i], o->max_new, i == kill_at ? rs : NULL, run))
            return -1;
        run->killed_before = i == kill_at ? i : run->killed_before;
        run->tokens += run->reqs[i].n_out;
        run->failed += (uint64_t)run->reqs[i].failed;
    }
    run->wall_s = (double)(rekv_now_ns() - t0) * 1e-9;
    for (int k = 0; k < 2; k++) { /* the workload's steps alone: the warm-up's taken out */
        uint64_t s;
        double a;
        if (rm_steps(c[k], &s, &a))
            return -1;
        run->steps[k] = s - steps0[k];
        run->step_avg_s[k] = run->steps[k] ? (a * (double)s - avg0[k] * (double)steps0[k]) /
                                                 (double)run->steps[k]
                                           : 0;
    }
    return 0;
}

/* One run on fresh replicas (and a fresh Redis but for local); 0, or -1 with a message printed. */
static int rm_one_run(const rm_opts *o, int vocab, const char *redis_bin, rm_run *run)
{
    cli_trio t[2] = {{0}, {0}};
    rekv_ctl *c[2] = {NULL, NULL};
    redis_srv rs = {0};
    int rc = -1;
    run->n = (int)o->pairs * 2;
    run->killed_before = -1;
    run->redis_hits = run->redis_misses = run->redis_keys = -1;
    if ((run->reqs = calloc((size_t)run->n, sizeof(*run->reqs))) == NULL)
        goto oom;
    for (int i = 0; i < run->n; i++)
        if (make_prompt(o, vocab, i, &run->reqs[i]))
            goto oom;
    if (run->kind != RUN_LOCAL && redis_start(&rs, redis_bin, 0))
        goto out;
    for (int k = 0; k < 2; k++)
        if (rm_replica(o, vocab, run->kind != RUN_LOCAL ? rs.url : NULL, &t[k], &c[k], run))
            goto out;
    if (rm_workload(o, run, c, &rs))
        goto out;
    redisContext *rc_ = rs.pid > 0 ? redis_conn(&rs) : NULL;
    if (rc_) { /* Redis's own count of the keys it found and did not */
        run->redis_hits = redis_info(rc_, "keyspace_hits");
        run->redis_misses = redis_info(rc_, "keyspace_misses");
        run->redis_keys = redis_int(rc_, "DBSIZE");
        redisFree(rc_);
    }
    rc = 0;
    goto out;
oom:
    fprintf(stderr, "rekv bench remote: out of memory\n");
out:
    for (int k = 0; k < 2; k++) {
        rekv_ctl_close(c[k]);
        cli_trio_stop(&t[k]);
    }
    redis_stop(&rs);
    return rc;
}

/* The steps run: three trios at once — S_LOCAL without --remote, S_REMOTE and S_IDLE each with a
 * Redis of its own, at normal priority and at SCHED_IDLE — given the same prompts (A's of the
 * workload, each system prompt new: every lookup misses, in the cache and in Redis), one request
 * at a time in turn, the order going through the six permutations pair by pair. Each does the same work in the same minutes,
 * so a change of the machine's load falls on the three alike. After each request of a remote trio
 * the bench waits until its Redis holds what it wrote: write-through work that outlasts the
 * request is charged to no other trio's steps. 0, or -1 with a message printed. */
static int rm_steps_run(const rm_opts *o, int vocab, const char *redis_bin, rm_run *run)
{
    cli_trio t[N_S] = {{0}, {0}, {0}};
    rekv_ctl *c[N_S] = {NULL, NULL, NULL};
    redis_srv rs[2] = {{0}, {0}}; /* S_REMOTE's, S_IDLE's */
    uint64_t steps0[N_S], s1;
    double avg0[N_S], a1;
    long long want[2] = {WARM_BLOCKS, WARM_BLOCKS};
    int rc = -1;
    run->n = (int)o->pairs * N_S; /* request p * N_S + k: pair p's A prompt on trio k */
    run->killed_before = -1;
    run->redis_hits = run->redis_misses = run->redis_keys = -1;
    if ((run->reqs = calloc((size_t)run->n, sizeof(*run->reqs))) == NULL)
        goto oom;
    for (int i = 0; i < run->n; i++)
        if (make_prompt(o, vocab, i / N_S * 2 + REP_A, &run->reqs[i]))
            goto oom;
    if (redis_start(&rs[0], redis_bin, 0) || redis_start(&rs[1], redis_bin, 1))
        goto out;
    for (int k = 0; k < N_S; k++)
        if (rm_replica(o, vocab, k == S_LOCAL ? NULL : rs[k - 1].url, &t[k], &c[k], run) ||
            rm_steps(c[k], &steps0[k], &avg0[k]))
            goto out;
    /* the six orders in turn: over six pairs each trio goes first, second and last twice and
     * follows each other trio three times (what one leaves behind falls on each alike) */
    static const int order[6][N_S] = {{0, 1, 2}, {1, 2, 0}, {2, 0, 1},
                                      {0, 2, 1}, {2, 1, 0}, {1, 0, 2}};
    uint64_t t0 = rekv_now_ns();
    for (int p = 0; p < o->pairs; p++)
        for (int j = 0; j < N_S; j++) {
            int k = order[p % 6][j];
            rreq *q = &run->reqs[p * N_S + k];
            if (rm_steps(c[k], &s1, &a1) || rm_request(c[k], q, o->max_new, NULL, run))
                goto out;
            uint64_t s2;
            double a2;
            if (rm_steps(c[k], &s2, &a2))
                goto out;
            q->step_avg_s = s2 > s1 ? (a2 * (double)s2 - a1 * (double)s1) / (double)(s2 - s1) : 0;
            run->tokens += q->n_out;
            run->failed += (uint64_t)q->failed;
            if (k != S_LOCAL) {
                want[k - 1] += written_blocks(q);
                wait_dbsize(&rs[k - 1], run, want[k - 1]);
            }
        }
    run->wall_s = (double)(rekv_now_ns() - t0) * 1e-9;
    for (int k = 0; k < N_S; k++) {
        uint64_t s;
        double a;
        if (rm_steps(c[k], &s, &a))
            goto out;
        run->steps[k] = s - steps0[k];
        run->step_avg_s[k] = run->steps[k] ? (a * (double)s - avg0[k] * (double)steps0[k]) /
                                                 (double)run->steps[k]
                                           : 0;
    }
    rc = 0;
    goto out;
oom:
    fprintf(stderr, "rekv bench remote: out of memory\n");
out:
    for (int k = 0; k < N_S; k++) {
        rekv_ctl_close(c[k]);
        cli_trio_stop(&t[k]);
    }
    redis_stop(&rs[0]);
    redis_stop(&rs[1]);
    return rc;
}

/* ---------------------------------------------------------------- the report */

/* Nearest-rank percentile p of the TTFTs of replica rep's requests. */
static double ttft_pct(const rm_run *run, int rep, double p)
{
    double *v = malloc(sizeof(double) * (size_t)(run->n + 1));
    size_t n = 0;
    for (int i = rep; v && i < run->n; i += 2)
        if (run->reqs[i].ttft_s >= 0)
            v[n++] = run->reqs[i].ttft_s;
    double r = v ? cli_percentile(v, n, p) : 0;
    free(v);
    return r;
}

static uint64_t cached_sum(const rm_run *run, int rep)
{
    uint64_t s = 0;
    for (int i = rep; i < run->n; i += 2)
        s += run->reqs[i].cached;
    return s;
}

/* The answers of run that differ from ref's (the same request's; for the steps run, A's of the
 * pair). */
static long mismatches(const rm_run *ref, const rm_run *run)
{
    long m = 0;
    for (int i = 0; i < run->n; i++) {
        int r = run->kind == RUN_STEPS ? i / N_S * 2 + REP_A : i;
        if (r >= ref->n)
            break;
        const rreq *a = &ref->reqs[r], *b = &run->reqs[i];
        m += a->n_out != b->n_out || (a->n_out && memcmp(a->out, b->out, sizeof(int32_t) * a->n_out));
    }
    return m;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The steps run: the median over pairs of trio k's mean step over the local trio's, each pair's
 * two requests (the same prompt) minutes apart at most — a burst of the machine's other load
 * that falls on one request moves one ratio, not the median. */
static double paired_ratio(const rm_run *run, int k)
{
    int np = run->n / N_S, n = 0;
    double *v = malloc(sizeof(double) * (size_t)(np + 1));
    for (int p = 0; v && p < np; p++) {
        const rreq *l = &run->reqs[p * N_S + S_LOCAL], *r = &run->reqs[p * N_S + k];
        if (l->step_avg_s > 0 && r->step_avg_s > 0)
            v[n++] = r->step_avg_s / l->step_avg_s;
    }
    double m = 0;
    if (v && n) {
        qsort(v, (size_t)n, sizeof(double), cmp_double);
        m = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    }
    free(v);
    return m;
}

static json_t *steps_json(const rm_run *run, long mism)
{
    return json_pack("{s:s, s:i, s:I, s:I, s:I, s:f, s:{s:f, s:f, s:f}, s:{s:I, s:I, s:I}, "
                     "s:{s:f, s:f}}",
                     "run",
                     run_names[run->kind], "requests", run->n, "tokens", (json_int_t)run->tokens,
                     "jobs_failed", (json_int_t)run->failed, "mismatches", (json_int_t)mism,
                     "wall_s", run->wall_s, "step_avg_s", "local", run->step_avg_s[S_LOCAL],
                     "remote", run->step_avg_s[S_REMOTE], "remote_idle",
                     run->step_avg_s[S_IDLE], "steps", "local", (json_int_t)run->steps[S_LOCAL],
                     "remote", (json_int_t)run->steps[S_REMOTE], "remote_idle",
                     (json_int_t)run->steps[S_IDLE], "median_pair_ratio", "remote",
                     paired_ratio(run, S_REMOTE), "remote_idle", paired_ratio(run, S_IDLE));
}

static json_t *run_json(const rm_run *run, long mism)
{
    if (run->kind == RUN_STEPS)
        return steps_json(run, mism);
    json_t *j = json_pack(
        "{s:s, s:i, s:I, s:I, s:I, s:f, s:{s:f, s:f}, s:{s:f, s:f}, s:I, s:I, s:{s:f, s:f}, "
        "s:{s:I, s:I}}",
        "run", run_names[run->kind], "requests", run->n, "tokens", (json_int_t)run->tokens,
        "jobs_failed", (json_int_t)run->failed, "mismatches", (json_int_t)mism, "wall_s",
        run->wall_s, "ttft_a_s", "p50", ttft_pct(run, REP_A, 50), "p90", ttft_pct(run, REP_A, 90),
        "ttft_b_s", "p50", ttft_pct(run, REP_B, 50), "p90", ttft_pct(run, REP_B, 90),
        "a_cached_tokens", (json_int_t)cached_sum(run, REP_A), "b_cached_tokens",
        (json_int_t)cached_sum(run, REP_B), "step_avg_s", "a", run->step_avg_s[REP_A], "b",
        run->step_avg_s[REP_B], "steps", "a", (json_int_t)run->steps[REP_A], "b",
        (json_int_t)run->steps[REP_B]);
    if (run->kind != RUN_LOCAL)
        json_object_set_new(j, "key_waits_timed_out", json_integer((json_int_t)run->waits_timed_out));
    if (run->redis_hits >= 0)
        json_object_set_new(j, "redis", json_pack("{s:I, s:I, s:I}", "keyspace_hits",
                                                  (json_int_t)run->redis_hits, "keyspace_misses",
                                                  (json_int_t)run->redis_misses, "keys",
                                                  (json_int_t)run->redis_keys));
    if (run->killed_before >= 0)
        json_object_set_new(j, "redis_killed_at_request", json_integer(run->killed_before));
    if (run->first_error[0])
        json_object_set_new(j, "first_error", json_string(run->first_error));
    return j;
}

static json_t *goal(double value, double limit)
{
    return json_pack("{s:f, s:f, s:b}", "value", value, "goal", limit, "met", value <= limit);
}

/* Prints the report; returns the failures' count (jobs failed, answers differing from local's). */
static long rm_print(const rm_opts *o, const rekv_model_config *cfg, const rm_run *runs)
{
    json_t *arr = json_array();
    long bad = 0, mism_all = 0;
    for (int k = 0; k < N_RUNS; k++) {
        long m = mismatches(&runs[RUN_LOCAL], &runs[k]);
        mism_all += m;
        bad += (long)runs[k].failed;
        json_array_append_new(arr, run_json(&runs[k], m));
    }
    double tl = ttft_pct(&runs[RUN_LOCAL], REP_B, 50), tr = ttft_pct(&runs[RUN_REMOTE], REP_B, 50);
    double mr = paired_ratio(&runs[RUN_STEPS], S_REMOTE), mi = paired_ratio(&runs[RUN_STEPS], S_IDLE);
    json_t *out = json_pack(
        "{s:s, s:s, s:s, s:{s:i, s:i, s:i, s:i, s:i, s:i}, s:s, s:I, s:I, s:{s:I, s:I, s:I}, "
        "s:o, s:I, s:{s:o, s:o, s:o, s:o, s:o}}",
        "bench", "remote", "backend", o->backend, "mode", "offload", "model", "layers",
        cfg->n_layers, "hidden", cfg->hidden, "heads", cfg->n_heads, "kv_heads", cfg->n_kv_heads,
        "vocab", cfg->vocab, "max_pos", cfg->max_pos, "arena", o->arena, "remote_timeout_ms",
        (json_int_t)atol(o->timeout_ms), "max_new_tokens", (json_int_t)o->max_new, "workload_shape", "pairs",
        (json_int_t)o->pairs, "system_len", (json_int_t)o->sys_len, "question_len",
        (json_int_t)o->q_len, "runs", arr, "mismatches", (json_int_t)mism_all, "goals",
        "ttft_b_p50_remote_over_local", goal(tl > 0 ? tr / tl : 0, 0.30),
        "step_remote_over_local", goal(mr, 1.05), "step_remote_idle_over_local", goal(mi, 1.05),
        "jobs_failed_kill",
        goal((double)runs[RUN_KILL].failed, 0), "mismatches", goal((double)mism_all, 0));
    char *s = json_dumps(out, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", s);
    free(s);
    json_decref(out);
    if (mism_all)
        fprintf(stderr, "rekv bench remote: %ld answer%s differ from the local run's\n", mism_all,
                mism_all == 1 ? "" : "s");
    if (bad)
        fprintf(stderr, "rekv bench remote: %ld job%s failed\n", bad, bad == 1 ? "" : "s");
    return bad + mism_all;
}

/* ---------------------------------------------------------------- the command */

static void rm_usage(FILE *f)
{
    fprintf(f,
            "usage: rekv bench remote --model PATH [--pairs N] [--system-len P] [--question-len L]\n"
            "                         [--max-new-tokens G] [--arena SIZE] [--backend B]\n"
            "                         [--remote-timeout-ms MS] [--redis-server PATH] [--json]\n"
            "Two replicas (private trios: `rekv run --mode offload`, the prefix cache on,\n"
            "--host-bytes SIZE, default 256M) and one redis-server started here (a unix socket\n"
            "in a temporary directory, no persistence; PATH's, or --redis-server). N pairs\n"
            "(default 8), one request at a time: a P-token system prompt of the pair's own\n"
            "(2048) + L tokens (100) asked on replica A, then the same system prompt + other L\n"
            "tokens on replica B; G new tokens each (16; greedy, EOS ignored). Four runs on\n"
            "fresh replicas: local (no --remote: nothing shared), remote (both --remote\n"
            "unix://SOCKET --remote-timeout-ms MS, default 1000: B reads A's blocks from Redis),\n"
            "kill (as remote, redis-server killed with SIGKILL right after B's request of pair\n"
            "N/2 is submitted), steps (three trios given A's prompts in turn: no --remote,\n"
            "--remote on a redis-server at normal priority, --remote on one at SCHED_IDLE;\n"
            "after each request the bench waits for its writes to land). Prints one JSON\n"
            "object: per run the TTFT on A and B, the prompt tokens each took from its cache,\n"
            "each worker's mean step time over the workload, Redis's keyspace hits and misses;\n"
            "the goals: B's TTFT p50 remote / local <= 0.30, the steps run's step time remote /\n"
            "local (the median over pairs of the two requests' mean steps) <= 1.05 at either\n"
            "Redis priority (every lookup misses), no job failed in the kill run, no answer\n"
            "differing from the local run's. Exit 1 when a job failed or an answer differs.\n");
}

static int rm_parse(int argc, char **argv, rm_opts *o)
{
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},          {"pairs", required_argument, 0, 'N'},
        {"system-len", required_argument, 0, 'P'},     {"question-len", required_argument, 0, 'L'},
        {"max-new-tokens", required_argument, 0, 'g'}, {"arena", required_argument, 0, 'a'},
        {"backend", required_argument, 0, 'b'},        {"remote-timeout-ms", required_argument, 0, 't'},
        {"redis-server", required_argument, 0, 'r'},   {"json", no_argument, 0, 'j'},
        {"help", no_argument, 0, 'h'},                 {0, 0, 0, 0}};
    *o = (rm_opts){.backend = "cpu", .arena = "256M", .timeout_ms = "1000", .pairs = 8,
                   .sys_len = 2048, .q_len = 100, .max_new = 16};
    uint64_t bytes;
    long v;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'N': if (cli_parse_int("pairs", optarg, 1, 1000, &o->pairs)) return 2; break;
        case 'P': if (cli_parse_int("system-len", optarg, BLOCK, 1 << 20, &o->sys_len)) return 2; break;
        case 'L': if (cli_parse_int("question-len", optarg, 1, 1 << 20, &o->q_len)) return 2; break;
        case 'g': if (cli_parse_int("max-new-tokens", optarg, 1, 1 << 20, &o->max_new)) return 2; break;
        case 'a': o->arena = optarg; break;
        case 'b': o->backend = optarg; break;
        case 't': if (cli_parse_int("remote-timeout-ms", optarg, 1, 10000, &v)) return 2; o->timeout_ms = optarg; break;
        case 'r': o->redis_bin = optarg; break;
        case 'j': break; /* JSON is the only output */
        case 'h': rm_usage(stdout); return 0;
        default: rm_usage(stderr); return 2;
        }
    }
    if (cli_no_operands(argc, argv) || o->model == NULL) {
        rm_usage(stderr);
        return 2;
    }
    if (rekv_parse_size(o->arena, &bytes) || bytes == 0) {
        fprintf(stderr, "rekv bench remote: --arena %s: expected bytes, e.g. 1G\n", o->arena);
        return 2;
    }
    return CLI_PARSED;
}

int cli_bench_remote(int argc, char **argv)
{
    rm_opts o;
    int rc = rm_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    char redis_bin[4096];
    if (redis_find(o.redis_bin, redis_bin, sizeof(redis_bin)))
        return 1;
    rekv_model_config cfg;
    if (cli_model_config(o.model, &cfg))
        return 1;
    if (o.sys_len + o.q_len + o.max_new > cfg.max_pos) {
        fprintf(stderr, "rekv bench remote: a request (%ld tokens with its answer) exceeds the "
                        "context (%d)\n", o.sys_len + o.q_len + o.max_new, cfg.max_pos);
        return 2;
    }
    rm_run runs[N_RUNS];
    memset(runs, 0, sizeof(runs));
    rc = 1;
    int done = 0;
    for (; done < N_RUNS; done++) {
        runs[done].kind = done;
        if ((done == RUN_STEPS ? rm_steps_run : rm_one_run)(&o, cfg.vocab, redis_bin,
                                                           &runs[done])) {
            done++;
            goto out;
        }
    }
    rc = rm_print(&o, &cfg, runs) ? 1 : 0;
out:
    for (int k = 0; k < done; k++) {
        for (int i = 0; i < runs[k].n && runs[k].reqs; i++)
            free(runs[k].reqs[i].prompt), free(runs[k].reqs[i].out);
        free(runs[k].reqs);
    }
    return rc;
}
