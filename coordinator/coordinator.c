/* coordinator.c — rekv-coordinator's server: creating it (the config's defaults, the model and its
 * tokenizer, the journal's replay, the control and worker sockets), the event loop and tearing it
 * down. One thread, one event loop (common/evloop.h); each round takes a stop signal, the
 * connection counts, the worker socket (co_workers.c: up to 256 messages, then the jobs they ended
 * are synced), a round of control requests (co_control.c); then, when due, a sample of the token
 * rate each second and on_tick every 200 ms (which also bounds the sleep); then it drops silent
 * workers, sends every idle worker with work its next Plan, syncs what that ended and compacts
 * the journal (co_jobs.c) when it has grown; metrics scrapes (co_stats.c) are answered last, and
 * the loop sleeps. The job table and the journal are in co_jobs.c; the state they all share is in
 * co_internal.h. */
#define _GNU_SOURCE
#include "coordinator/coordinator.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "coordinator/co_internal.h"

#define COMPACT_RECORDS 8192        /* rewrite the journal after this many appends */
#define COMPACT_BYTES (64ull << 20) /* or these many bytes beyond twice the finished jobs' */

void co_event(rekv_coordinator *co, rekv_co_event lvl, const char *fmt, ...)
{
    if (co->cfg.on_event == NULL)
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    co->cfg.on_event(co->cfg.ctx, lvl, msg);
}

void co_event_rl(rekv_coordinator *co, co_rl_site site, rekv_co_event lvl, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int go = rekv_ratelimit_vformat(&co->rl[site], rekv_now_ns(), msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (go)
        co_event(co, lvl, "%s", msg);
}

void rekv_coordinator_config_defaults(rekv_coordinator_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->queue_limit = 256;
    cfg->keep_finished = 1024;
    cfg->keep_finished_bytes = 64ull << 20;
    cfg->worker_timeout_ms = 30000;
    cfg->step_timeout_ms = 300000;
    cfg->max_attempts = 3;
    cfg->prefill_chunk = 512;
    cfg->max_new_limit = 1u << 20;
    cfg->signal_fd = -1;
}

double co_realtime_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- sending */

int co_send_to(void *sock, const rid *to, const void *buf, size_t len)
{
    /* ROUTER_MANDATORY: a vanished peer is EHOSTUNREACH instead of a silent drop; DONTWAIT: a
     * peer that does not read is dropped rather than blocking the loop */
    if (zmq_send(sock, to->b, to->n, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return -errno;
    if (zmq_send(sock, buf, len, ZMQ_DONTWAIT) < 0)
        return -errno;
    return 0;
}

/* ---------------------------------------------------------------- loop */

static void sync_ended(rekv_coordinator *co)
{
    rekv_err e = {0};
    if (co_jobs_sync(co, &e))
        co_event(co, REKV_CO_EVENT_ERROR,
                 "%s (finished jobs reported anyway; a restart may run "
                 "them again)",
                 e.msg);
}

static void on_signal(rekv_evloop *loop, void *ctx, int signo)
{
    rekv_coordinator *co = ctx;
    if (signo)
        co_event(co, REKV_CO_EVENT_INFO, "signal %d: stopping", signo);
    else
        co_event(co, REKV_CO_EVENT_INFO, "signal: stopping");
    rekv_evloop_stop(loop);
}

/* connection counts first: a request is judged against every connection before it */
static void on_conncap(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_conncap_drain(ctx);
}

/* up to 256 worker messages a round, then the jobs they ended are synced (and reported) */
static void on_workers(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_coordinator *co = ctx;
    for (int k = 0; k < 256; k++) {
        int ev = 0;
        size_t sz = sizeof(ev);
        co_handle_worker_msg(co);
        if (zmq_getsockopt(co->wrk, ZMQ_EVENTS, &ev, &sz) || !(ev & ZMQ_POLLIN))
            break;
    }
    sync_ended(co);
}

static void on_control(rekv_evloop *loop, void *ctx, short revents)
{
    co_handle_control(ctx);
}

/* a sample of the token counter a second, for tokens/s */
static long on_rate(rekv_evloop *loop, void *ctx)
{
    rekv_coordinator *co = ctx;
    co->rate_i = (co->rate_i + 1) % RATE_SLOTS;
    co->rate_tokens[co->rate_i] = co->tokens;
    co->rate_ns[co->rate_i] = rekv_now_ns();
    return 1000;
}

/* a round at least every 200 ms: silent and hung workers are found, on_tick runs */
static long on_tick(rekv_evloop *loop, void *ctx)
{
    rekv_coordinator *co = ctx;
    if (co->cfg.on_tick)
        co->cfg.on_tick(co->cfg.ctx);
    return 200;
}

/* The end of every round: drop silent workers, send every idle worker with work its next Plan,
 * report what that ended, and compact the journal when it has grown. */
static void before_sleep(rekv_evloop *loop, void *ctx)
{
    rekv_coordinator *co = ctx;
    co_check_workers(co);
    co_schedule(co);
    sync_ended(co);
    /* by records, and by bytes: finished records carry results, and the journal holds no
     * more than the remembered ones after a rewrite */
    if (co->journal &&
        (rekv_journal_records(co->journal) > COMPACT_RECORDS ||
         rekv_journal_bytes(co->journal) > COMPACT_BYTES + 2 * co->cfg.keep_finished_bytes)) {
        rekv_err e2 = {0};
        if (co_journal_compact(co, &e2))
            co_event(co, REKV_CO_EVENT_ERROR, "%s", e2.msg);
    }
}

/* The loop's entries, in the order a round takes them (see the top of the file). */
static int loop_setup(rekv_coordinator *co, rekv_err *err)
{
    rekv_evloop *l = co->loop;
    int rc;
    if (co->cfg.signal_fd >= 0 &&
        (rc = rekv_evloop_add_signal_fd(l, co->cfg.signal_fd, on_signal, co, err)) < 0)
        return rc;
    if ((rc = rekv_evloop_add_socket(l, rekv_conncap_socket(co->ctl_cap), ZMQ_POLLIN, on_conncap,
                                     co->ctl_cap, err)) < 0 ||
        (rc = rekv_evloop_add_socket(l, rekv_conncap_socket(co->wrk_cap), ZMQ_POLLIN, on_conncap,
                                     co->wrk_cap, err)) < 0 ||
        (rc = rekv_evloop_add_socket(l, co->wrk, ZMQ_POLLIN, on_workers, co, err)) < 0 ||
        (rc = rekv_evloop_add_socket(l, co->ctl, ZMQ_POLLIN, on_control, co, err)) < 0 ||
        (rc = rekv_evloop_timer_add(l, 0, on_rate, co, err)) < 0 ||
        (rc = rekv_evloop_timer_add(l, 200, on_tick, co, err)) < 0)
        return rc;
    rekv_evloop_before_sleep(l, before_sleep, co);
    rekv_evloop_serve_metrics(l, co->metrics, co_metrics_render, co);
    return 0;
}

int rekv_coordinator_run(rekv_coordinator *co, rekv_err *err)
{
    return rekv_evloop_run(co->loop, err);
}

void rekv_coordinator_stop(rekv_coordinator *co)
{
    rekv_evloop_stop(co->loop);
}

/* ---------------------------------------------------------------- setup */

/* For ipc:// endpoints: the socket file path, its directory created (0700) when missing, a stale
 * socket file removed. Returns 0 or -errno. Other transports: path = "". */
static int ipc_prepare(const char *ep, char *path, size_t len, rekv_err *err)
{
    path[0] = '\0';
    if (strncmp(ep, "ipc://", 6) != 0)
        return 0;
    snprintf(path, len, "%s", ep + 6);
    char dir[4200];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        if (mkdir(dir, 0700) < 0 && errno != EEXIST)
            return rekv_errf(err, -errno, "%s: mkdir: %s", dir, strerror(errno));
    }
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode))
        unlink(path);
    return 0;
}

/* Takes an exclusive flock on path (created mode 0600, never removed: removing a lock file races
 * with its next taker) and writes our pid into it; -EBUSY naming the holder when another process
 * has it. */
static int lock_take(const char *path, const char *what, int *fd_out, rekv_err *err)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return rekv_errf(err, -errno, "%s: open: %s", path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
        int e = errno;
        char pid[32] = {0};
        ssize_t n = pread(fd, pid, sizeof(pid) - 1, 0);
        close(fd);
        if (n > 0 && pid[n - 1] == '\n')
            pid[n - 1] = '\0';
        if (e == EWOULDBLOCK)
            return rekv_errf(err, -EBUSY,
                             "another rekv-coordinator (pid %s) is using %s: %s is locked",
                             n > 0 ? pid : "?", what, path);
        return rekv_errf(err, -e, "%s: flock: %s", path, strerror(e));
    }
    char pid[32];
    int len = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
    if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
        /* the lock holds without the pid; only the second one's message is poorer */
    }
    *fd_out = fd;
    return 0;
}

/* One coordinator per control socket, worker socket and journal: the socket files' locks sit
 * beside them (<socket>.lock), the journal's in its directory (<state_dir>/lock). Taken before
 * the journal is replayed and before a stale socket file is removed, so a second coordinator
 * touches neither. */
static int lock_paths(rekv_coordinator *co, rekv_err *err)
{
    const char *eps[2] = {co->control_ep, co->worker_ep};
    char path[4300];
    int rc;
    for (int i = 0; i < 2; i++) {
        if (strncmp(eps[i], "ipc://", 6) != 0 || (i == 1 && strcmp(eps[0], eps[1]) == 0))
            continue;
        snprintf(path, sizeof(path), "%s", eps[i] + 6);
        char *slash = strrchr(path, '/');
        if (slash && slash != path) {
            *slash = '\0';
            if (mkdir(path, 0700) < 0 && errno != EEXIST)
                return rekv_errf(err, -errno, "%s: mkdir: %s", path, strerror(errno));
        }
        snprintf(path, sizeof(path), "%s.lock", eps[i] + 6);
        if ((rc = lock_take(path, eps[i], &co->lock_fd[i], err)))
            return rc;
    }
    if (co->cfg.state_dir) {
        if (mkdir(co->cfg.state_dir, 0700) < 0 && errno != EEXIST)
            return rekv_errf(err, -errno, "%s: mkdir: %s", co->cfg.state_dir, strerror(errno));
        snprintf(path, sizeof(path), "%s/lock", co->cfg.state_dir);
        if ((rc = lock_take(path, "the journal", &co->lock_fd[2], err)))
            return rc;
    }
    return 0;
}

/* tcp:// is allowed on loopback, or anywhere with a CurveZMQ key. */
static int tcp_check(const char *ep, const char *curve, rekv_err *err)
{
    if (strncmp(ep, "tcp://", 6) != 0)
        return 0;
    const char *h = ep + 6;
    int loop = strncmp(h, "127.", 4) == 0 || strncmp(h, "localhost:", 10) == 0 ||
               strncmp(h, "[::1]:", 6) == 0;
    if (!loop && curve == NULL)
        return rekv_errf(err, -EPERM, "%s: a non-loopback tcp endpoint needs a CurveZMQ secret key",
                         ep);
    return 0;
}

/* A ROUTER bound to ep; CurveZMQ on tcp:// endpoints when a secret key is given (an ipc socket
 * is a file its permissions guard, and local peers hold no keys: never CURVE'd). An ipc socket's
 * file gets mode (from the first instant: a umask around the bind). */
static int bind_router(rekv_coordinator *co, void **sock, rekv_conncap **cap, const char *ep,
                       const char *path, mode_t mode, rekv_err *err)
{
    *sock = zmq_socket(co->zctx, ZMQ_ROUTER);
    if (*sock == NULL)
        return rekv_errf(err, -errno, "zmq socket: %s", zmq_strerror(errno));
    int one = 1, linger = 0, hwm = 100000;
    /* bound memory per peer: 16 MiB frames at most (larger ones cut the connection) */
    int64_t maxmsg = 16ll << 20;
    zmq_setsockopt(*sock, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(*sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(*sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(*sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    if (co->cfg.curve_secret && strncmp(ep, "tcp://", 6) == 0) {
        if (zmq_setsockopt(*sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) ||
            zmq_setsockopt(*sock, ZMQ_CURVE_SECRETKEY, co->cfg.curve_secret, 40))
            return rekv_errf(err, -EINVAL, "CurveZMQ secret key rejected: %s", zmq_strerror(errno));
    }
    /* counted from the first connection, so before the bind */
    int rc = rekv_conncap_create(co->zctx, *sock, co->cfg.max_clients, cap, err);
    if (rc)
        return rc;
    /* the socket file is created by bind; a umask gives it no more than mode from the start */
    mode_t old = umask(~mode & 0777);
    rc = zmq_bind(*sock, ep);
    int e = errno;
    umask(old);
    if (rc != 0)
        return rekv_errf(err, -e, "%s: bind: %s", ep, zmq_strerror(e));
    if (*path && chmod(path, mode) < 0)
        return rekv_errf(err, -errno, "%s: chmod: %s", path, strerror(errno));
    return 0;
}

int rekv_coordinator_create(const rekv_coordinator_config *cfg, rekv_coordinator **out,
                            rekv_err *err)
{
    rekv_coordinator *co = calloc(1, sizeof(*co));
    if (co == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    co->cfg = *cfg;
    if (co->cfg.queue_limit == 0)
        co->cfg.queue_limit = 256;
    if (co->cfg.keep_finished == 0)
        co->cfg.keep_finished = 1024;
    if (co->cfg.keep_finished_bytes == 0)
        co->cfg.keep_finished_bytes = 64ull << 20;
    if (co->cfg.worker_timeout_ms == 0)
        co->cfg.worker_timeout_ms = 30000;
    if (co->cfg.step_timeout_ms == 0)
        co->cfg.step_timeout_ms = 300000;
    if (co->cfg.max_attempts == 0)
        co->cfg.max_attempts = 3;
    if (co->cfg.max_new_limit == 0)
        co->cfg.max_new_limit = 1u << 20;
    co->cfg.max_clients = rekv_conncap_max_for(co->cfg.max_clients);
    co->lock_fd[0] = co->lock_fd[1] = co->lock_fd[2] = -1;
    co->pend_tail = &co->pend_head;
    co->start_ns = rekv_now_ns();
    co->session = co->start_ns;
    co->next_id = 1;
    int rc;
    co->finished = calloc(co->cfg.keep_finished, sizeof(job *));
    co->replies = calloc(2 * READ_BATCH + 1, sizeof(reply));
    if (!co->finished || !co->replies) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto fail;
    }
    if ((rc = rekv_evloop_create(&co->loop, err)))
        goto fail;
    if (cfg->control_endpoint)
        snprintf(co->control_ep, sizeof(co->control_ep), "%s", cfg->control_endpoint);
    else if ((rc = rekv_default_control_endpoint(co->control_ep, sizeof(co->control_ep), err)))
        goto fail;
    if (cfg->worker_endpoint) {
        snprintf(co->worker_ep, sizeof(co->worker_ep), "%s", cfg->worker_endpoint);
    } else if (strncmp(co->control_ep, "ipc://", 6) == 0) {
        snprintf(co->worker_ep, sizeof(co->worker_ep), "%s", co->control_ep);
        char *slash = strrchr(co->worker_ep, '/');
        snprintf(slash + 1, sizeof(co->worker_ep) - (size_t)(slash + 1 - co->worker_ep), "workers");
    } else {
        rc = rekv_errf(err, -EINVAL, "give a worker endpoint with a non-ipc control endpoint");
        goto fail;
    }
    if ((rc = tcp_check(co->control_ep, cfg->curve_secret, err)) ||
        (rc = tcp_check(co->worker_ep, cfg->curve_secret, err)) || (rc = lock_paths(co, err)))
        goto fail;
    if (cfg->model_path) {
        rekv_model *m = NULL;
        if ((rc = rekv_model_open(cfg->model_path, &m, err)))
            goto fail;
        co->mcfg = m->config;
        co->have_model = 1;
        rekv_model_close(m);
        rc = rekv_tokenizer_load_for_model(cfg->model_path, &co->tok, err);
        if (rc && rc != -ENOENT)
            goto fail;
        if (rc == -ENOENT) {
            rekv_err_clear(err);
            co_event(co, REKV_CO_EVENT_INFO, "%s has no tokenizer: prompts must be token ids",
                     cfg->model_path);
        }
        /* absolute, so a client can tell whether this is the model it means (was: the base
         * name, which no client in another directory could match) */
        char *abs = realpath(cfg->model_path, NULL);
        snprintf(co->model_name, sizeof(co->model_name), "%s", abs ? abs : cfg->model_path);
        free(abs);
    }
    if (cfg->state_dir) {
        uint64_t dropped = 0;
        if ((rc = rekv_journal_open(cfg->state_dir, co_replay_fn, co, &co->journal, &dropped, err)))
            goto fail;
        if (dropped)
            co_event(co, REKV_CO_EVENT_WARN, "journal: cut off a torn tail of %llu bytes",
                     (unsigned long long)dropped);
        if (co->n_queue || co->n_fin)
            co_event(co, REKV_CO_EVENT_INFO,
                     "journal: %u unfinished jobs queued again, %u finished jobs remembered",
                     co->n_queue, co->n_fin);
        if ((rc = co_journal_compact(co, err)))
            goto fail;
    }
    co->zctx = zmq_ctx_new();
    if (co->zctx == NULL) {
        rc = rekv_errf(err, -errno, "zmq context: %s", zmq_strerror(errno));
        goto fail;
    }
    if ((rc = ipc_prepare(co->control_ep, co->control_path, sizeof(co->control_path), err)) ||
        (rc = ipc_prepare(co->worker_ep, co->worker_path, sizeof(co->worker_path), err)) ||
        /* the control socket is the group's (its directory decides who reaches it: a user's
         * $XDG_RUNTIME_DIR is 0700, the service's /run/rekv 0750 with group rekv); the workers'
         * socket is the coordinator's user's alone */
        (rc = bind_router(co, &co->ctl, &co->ctl_cap, co->control_ep, co->control_path, 0660,
                          err)) ||
        (rc = bind_router(co, &co->wrk, &co->wrk_cap, co->worker_ep, co->worker_path, 0600, err)))
        goto fail;
    /* in-process clients: no CurveZMQ (inproc runs no handshake) and no connection cap (the
     * HTTP server caps its own connections) */
    snprintf(co->inproc_ep, sizeof(co->inproc_ep), "inproc://rekv-control-%p", (void *)co);
    if (zmq_bind(co->ctl, co->inproc_ep) != 0) {
        rc = rekv_errf(err, -errno, "%s: bind: %s", co->inproc_ep, zmq_strerror(errno));
        goto fail;
    }
    rekv_metrics_hist *hists[] = {&co->h_ttft, &co->h_itl, &co->h_queue, &co->h_step,
                                  &co->h_step_rtt};
    for (size_t i = 0; i < sizeof(hists) / sizeof(*hists); i++)
        rekv_metrics_hist_init(hists[i], rekv_metrics_latency_bounds,
                               rekv_metrics_latency_n_bounds);
    rekv_metrics_server_opts mo = {.allow_remote = cfg->metrics_public};
    if (cfg->metrics_listen &&
        (rc = rekv_metrics_server_create_opts(cfg->metrics_listen, &mo, &co->metrics, err)))
        goto fail;
    if ((rc = loop_setup(co, err)))
        goto fail;
    *out = co;
    return 0;
fail:
    rekv_coordinator_destroy(co);
    return rc;
}

const char *rekv_coordinator_control_endpoint(const rekv_coordinator *co)
{
    return co->control_ep;
}
const char *rekv_coordinator_inproc_endpoint(const rekv_coordinator *co)
{
    return co->inproc_ep;
}
void *rekv_coordinator_zctx(const rekv_coordinator *co) { return co->zctx; }
const char *rekv_coordinator_worker_endpoint(const rekv_coordinator *co)
{
    return co->worker_ep;
}

void rekv_coordinator_destroy(rekv_coordinator *co)
{
    if (co == NULL)
        return;
    /* a clean stop makes the last ends durable too (their reports go nowhere now) */
    rekv_err e = {0};
    if (co->journal && co_jobs_sync(co, &e))
        co_event(co, REKV_CO_EVENT_ERROR, "%s", e.msg);
    if (co->wrk) {
        /* workers drop their batches rather than finish jobs nobody will collect */
        for (int i = 0; i < MAX_WORKERS; i++) {
            worker *w = &co->workers[i];
            if (!w->active)
                continue;
            Rekv__Worker__Reset rs = REKV__WORKER__RESET__INIT;
            Rekv__Worker__CoordMsg m = REKV__WORKER__COORD_MSG__INIT;
            m.body_case = REKV__WORKER__COORD_MSG__BODY_RESET;
            m.reset = &rs;
            co_send_worker(co, w, &m);
        }
    }
    rekv_conncap_free(co->ctl_cap); /* before its socket: it stops the socket's monitor */
    rekv_conncap_free(co->wrk_cap);
    if (co->ctl)
        zmq_close(co->ctl);
    if (co->wrk)
        zmq_close(co->wrk);
    if (co->zctx)
        zmq_ctx_term(co->zctx);
    if (co->control_path[0] && co->ctl)
        unlink(co->control_path);
    if (co->worker_path[0] && co->wrk)
        unlink(co->worker_path);
    for (int i = 0; i < MAX_WORKERS; i++) {
        free(co->workers[i].run);
        free(co->workers[i].cancel);
    }
    for (size_t b = 0; b < HASH_BUCKETS; b++)
        while (co->hash[b])
            co_job_free(co, co->hash[b]);
    rekv_metrics_server_free(co->metrics);
    rekv_journal_close(co->journal);
    rekv_tokenizer_free(co->tok);
    rekv_evloop_free(co->loop);
    free(co->queue);
    free(co->finished);
    free(co->replies);
    for (int i = 0; i < 3; i++)
        if (co->lock_fd[i] >= 0)
            close(co->lock_fd[i]);
    free(co);
}
