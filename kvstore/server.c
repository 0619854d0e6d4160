/* server.c — the kvstore daemon: create and destroy, and its event loop (common/evloop.h: the
 * ROUTER socket, the io_uring eventfd, the fd-passing socket and an optional signal fd; no
 * threads, no busy waiting), with the fd socket that hands out the arena's memfd.
 *
 * A round of the loop takes, in order: a stop signal, the spill tier's completions (blocks.c,
 * which runs the parked requests again), fd-socket connections, the connection count, up to 256
 * requests from the ROUTER socket (handlers.c); then, when due, the lease check every quarter
 * lease (leases.c) and the on_tick callback every second; then read-ahead and background spilling
 * above the high watermark (blocks.c), and the spill I/O queued since the last round goes to the
 * kernel; metrics scrapes are answered last, and the loop sleeps. The state they share is in
 * server_internal.h; push.c holds the push path. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "kvstore/remote.h"
#include "kvstore/server_internal.h"

const char *const srv_hist_names[H_COUNT] = {"plan",  "pin",         "append",
                                             "other", "spill_write", "spill_read"};

/* ------------------------------------------------------------------ small helpers */

void srv_event(rekv_kvstore_server *s, rekv_kv_event lvl, const char *fmt, ...)
{
    if (s->cfg.on_event == NULL)
        return;
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    s->cfg.on_event(s->cfg.event_ctx, lvl, msg);
}

void srv_event_rl(rekv_kvstore_server *s, srv_rl_site site, rekv_kv_event lvl, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    int go = rekv_ratelimit_vformat(&s->rl[site], rekv_now_ns(), msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (go)
        srv_event(s, lvl, "%s", msg);
}

void srv_hist_add(rekv_kv_hist *h, uint64_t ns)
{
    int b = 0;
    while (b + 1 < REKV_KV_HIST_BUCKETS && (ns >> (b + 1)) != 0)
        b++;
    h->buckets[b]++;
    h->count++;
    h->sum_ns += ns;
}

int srv_grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *q = realloc(*p, n * elem);
    if (q == NULL)
        return -ENOMEM;
    *p = q;
    *cap = n;
    return 0;
}

/* ------------------------------------------------------------------ sockets */

static void serve_fd_socket(rekv_kvstore_server *s)
{
    for (;;) {
        int c = accept4(s->fd_listen, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0)
            return;
        char byte = 'A';
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } u;
        memset(&u, 0, sizeof(u));
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = u.buf,
                            .msg_controllen = sizeof(u.buf)};
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &s->arena.fd, sizeof(int));
        (void)sendmsg(c, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        close(c);
    }
}

static char *ipc_path_of(const char *endpoint)
{
    if (strncmp(endpoint, "ipc://", 6) != 0)
        return NULL;
    return strdup(endpoint + 6);
}

/* Removes a stale socket file a crash left; -EADDRINUSE when a live server answers on it. */
static int unlink_stale_socket(const char *path, rekv_err *err)
{
    struct stat st;
    if (lstat(path, &st) < 0)
        return 0;
    if (!S_ISSOCK(st.st_mode))
        return rekv_errf(err, -EEXIST, "kvstore: %s exists and is not a socket", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        int live = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        close(fd);
        if (live)
            return rekv_errf(err, -EADDRINUSE, "kvstore: another server is serving on %s", path);
    }
    unlink(path);
    return 0;
}

/* ------------------------------------------------------------------ the loop's callbacks */

static void on_signal(rekv_evloop *loop, void *ctx, int signo)
{
    rekv_kvstore_server *s = ctx;
    if (signo)
        srv_event(s, REKV_KV_EVENT_INFO, "signal %d: shutting down", signo);
    else
        srv_event(s, REKV_KV_EVENT_INFO, "stop requested: shutting down");
    rekv_evloop_stop(loop);
}

static void on_spill_io(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_kvstore_server *s = ctx;
    s->now = rekv_now_ns();
    srv_on_completions(s);
}

static void on_fd_socket(rekv_evloop *loop, void *ctx, short revents)
{
    serve_fd_socket(ctx);
}

/* before the requests: each is judged by every connection (rekv_conncap_over drains too) */
static void on_conncap(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_kvstore_server *s = ctx;
    rekv_conncap_drain(s->cap);
}

/* up to 256 requests a round, so that the rest of the round is never starved */
static void on_requests(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_kvstore_server *s = ctx;
    s->now = rekv_now_ns();
    for (int k = 0; k < 256; k++) {
        int ev = 0;
        size_t el = sizeof(ev);
        if (zmq_getsockopt(s->zsock, ZMQ_EVENTS, &ev, &el) < 0 || !(ev & ZMQ_POLLIN))
            break;
        srv_handle_message(s);
        s->now = rekv_now_ns();
    }
}

/* every quarter lease (at least every millisecond) */
static long on_lease_check(rekv_evloop *loop, void *ctx)
{
    rekv_kvstore_server *s = ctx;
    s->now = rekv_now_ns();
    srv_leases_check(s);
    if (s->pending)
        srv_run_pending(s); /* a paused spill tier may have resumed */
    uint64_t lease_ms = s->cfg.lease_ms / 4;
    return lease_ms ? (long)lease_ms : 1;
}

static long on_tick(rekv_evloop *loop, void *ctx)
{
    rekv_kvstore_server *s = ctx;
    s->cfg.on_tick(s->cfg.event_ctx);
    return 1000;
}

/* the rest of every round: read-ahead and background spilling, then the spill I/O they and the
 * round's requests queued goes to the kernel before the loop sleeps */
static void before_sleep(rekv_evloop *loop, void *ctx)
{
    rekv_kvstore_server *s = ctx;
    s->now = rekv_now_ns();
    srv_ahead_pump(s);
    srv_spill_watermark(s);
    srv_spill_probe(s);
    if (s->spill)
        (void)kv_spill_submit(s->spill);
    srv_events_flush(s); /* the round's KV events, one batch */
}

/* The loop's entries, in the order a round takes them (see the top of the file). */
static int loop_setup(rekv_kvstore_server *s, rekv_err *err)
{
    rekv_evloop *l = s->loop;
    int rc;
    if (s->cfg.signal_fd >= 0 &&
        (rc = rekv_evloop_add_signal_fd(l, s->cfg.signal_fd, on_signal, s, err)) < 0)
        return rc;
    if (s->spill && (rc = rekv_evloop_add_fd(l, kv_spill_event_fd(s->spill), ZMQ_POLLIN,
                                             on_spill_io, s, err)) < 0)
        return rc;
    if ((rc = rekv_evloop_add_fd(l, s->fd_listen, ZMQ_POLLIN, on_fd_socket, s, err)) < 0 ||
        (rc = rekv_evloop_add_socket(l, rekv_conncap_socket(s->cap), ZMQ_POLLIN, on_conncap, s,
                                     err)) < 0 ||
        (rc = rekv_evloop_add_socket(l, s->zsock, ZMQ_POLLIN, on_requests, s, err)) < 0)
        return rc;
    long lease_ms = (long)(s->cfg.lease_ms / 4);
    if ((rc = rekv_evloop_timer_add(l, lease_ms ? lease_ms : 1, on_lease_check, s, err)) < 0)
        return rc;
    if (s->cfg.on_tick && (rc = rekv_evloop_timer_add(l, 0, on_tick, s, err)) < 0)
        return rc;
    rekv_evloop_before_sleep(l, before_sleep, s);
    rekv_evloop_serve_metrics(l, s->metrics, srv_metrics_render, s);
    return 0;
}

int rekv_kvstore_server_run(rekv_kvstore_server *s, rekv_err *err)
{
    s->now = rekv_now_ns();
    int rc = rekv_evloop_run(s->loop, err);
    if (s->idx_fd >= 0) /* kept across the restart: the cache in memory goes to disk first */
        srv_cache_flush(s);
    return rc;
}

void rekv_kvstore_server_stop(rekv_kvstore_server *s)
{
    rekv_evloop_stop(s->loop);
}

/* The ROUTER socket on the endpoint (a stale socket file removed; mode 0600), its connection
 * count watching from before the bind. */
static int bind_router(rekv_kvstore_server *s, rekv_err *err)
{
    int rc;
    if (s->ipc_path && (rc = unlink_stale_socket(s->ipc_path, err)) < 0)
        return rc;
    s->zctx = zmq_ctx_new();
    s->zsock = s->zctx ? zmq_socket(s->zctx, ZMQ_ROUTER) : NULL;
    if (s->zsock == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore: zmq socket: %s", zmq_strerror(zmq_errno()));
    int zero = 0, hwm = 100000;
    int64_t maxmsg = 64ll << 20;
    zmq_setsockopt(s->zsock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s->zsock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s->zsock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s->zsock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    /* counted from the first connection, so before the bind */
    if ((rc = rekv_conncap_create(s->zctx, s->zsock, rekv_conncap_max_for(s->cfg.max_clients),
                                  &s->cap, err)) < 0)
        return rc;
    mode_t old = umask(077);
    int brc = zmq_bind(s->zsock, s->endpoint);
    umask(old);
    if (brc < 0)
        return rekv_errf(err, -zmq_errno(), "kvstore: bind %s: %s", s->endpoint,
                         zmq_strerror(zmq_errno()));
    if (s->ipc_path)
        chmod(s->ipc_path, 0600);
    return 0;
}

/* ------------------------------------------------------------------ lifecycle */

void rekv_kvstore_config_defaults(rekv_kvstore_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->lease_ms = 5000;
    cfg->high_pct = 90;
    cfg->low_pct = 80;
    cfg->signal_fd = -1;
    cfg->push_link = REKV_LINK_NONE;
}

static void spill_event_cb(void *ctx, rekv_kv_event lvl, const char *msg)
{
    rekv_kvstore_server *s = ctx;
    srv_event(s, lvl, "%s", msg);
}

/* The fd-passing socket (the arena's memfd to each client), owner-only; 0 or -errno. */
static int listen_fd_socket(rekv_kvstore_server *s, rekv_err *err)
{
    int rc;
    if ((rc = unlink_stale_socket(s->fd_path, err)) < 0)
        return rc;
    s->fd_listen = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->fd_listen < 0)
        return rekv_errf(err, -errno, "kvstore: socket: %s", strerror(errno));
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s->fd_path);
    mode_t old = umask(077);
    int brc = bind(s->fd_listen, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (brc < 0 || listen(s->fd_listen, 64) < 0) {
        rc = rekv_errf(err, -errno, "kvstore: bind %s: %s", s->fd_path, strerror(errno));
        close(s->fd_listen);
        s->fd_listen = -1;
        return rc;
    }
    return 0;
}

/* KV events (--kv-events): each subscriber, as it joins, is told AllBlocksCleared and what the
 * store holds (a restarted store's router drops what it believed of the old one); the replay
 * socket when asked for. 0 or -errno. */
static int events_setup(rekv_kvstore_server *s, const rekv_kvstore_config *cfg, rekv_err *err)
{
    int rc;
    if ((rc = kv_events_create(s->zctx, cfg->kv_events, cfg->kv_events_topic,
                               cfg->kv_events_array ? KV_EVENTS_ARRAY : KV_EVENTS_MAP, &s->events,
                               err)) < 0 ||
        (rc = rekv_evloop_add_socket(s->loop, kv_events_socket(s->events), ZMQ_POLLIN,
                                     srv_events_on_subscribe, s, err)) < 0)
        return rc;
    if (cfg->kv_events_replay &&
        ((rc = kv_events_replay_open(s->events, s->zctx, cfg->kv_events_replay, err)) < 0 ||
         (rc = rekv_evloop_add_socket(s->loop, kv_events_replay_socket(s->events), ZMQ_POLLIN,
                                      srv_events_on_replay, s, err)) < 0))
        return rc;
    return 0;
}

int rekv_kvstore_server_create(const rekv_kvstore_config *cfg, rekv_kvstore_server **out,
                               rekv_err *err)
{
    int rc = 0;
    *out = NULL;
    rekv_kvstore_server *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore: out of memory");
    s->cfg = *cfg;
    s->fd_listen = -1;
    s->arena.fd = -1;
    s->arena.base = NULL;
    s->lru_head = s->lru_tail = NIL;
    s->idx_fd = s->idx_lock = -1;
    kv_map_init(&s->seqs);
    srv_cache_init(s);
    for (int i = 0; i < H_COUNT; i++)
        snprintf(s->hist[i].name, sizeof(s->hist[i].name), "%s", srv_hist_names[i]);
    if (s->cfg.lease_ms == 0)
        s->cfg.lease_ms = 5000;
    if (s->cfg.high_pct == 0 || s->cfg.high_pct > 100)
        s->cfg.high_pct = 90;
    if (s->cfg.low_pct == 0 || s->cfg.low_pct > s->cfg.high_pct)
        s->cfg.low_pct = s->cfg.high_pct > 10 ? s->cfg.high_pct - 10 : s->cfg.high_pct;
    if (cfg->endpoint == NULL) {
        rc = rekv_errf(err, -EINVAL, "kvstore: no endpoint");
        goto fail;
    }
    rekv_kv_geometry g = cfg->geometry;
    if ((rc = rekv_kv_geometry_init(&s->cfg.geometry, g.n_layers, g.n_kv_heads, g.head_dim,
                                    g.hidden, g.dtype, err)) < 0)
        goto fail;
    s->endpoint = strdup(cfg->endpoint);
    s->ipc_path = ipc_path_of(cfg->endpoint);
    if (cfg->fd_socket) {
        s->fd_path = strdup(cfg->fd_socket);
    } else if (s->ipc_path) {
        if (asprintf(&s->fd_path, "%s.fd", s->ipc_path) < 0)
            s->fd_path = NULL;
    } else {
        rc = rekv_errf(err, -EINVAL, "kvstore: endpoint %s is not ipc://; give an fd socket path",
                       cfg->endpoint);
        goto fail;
    }
    const char *dir = cfg->spill_dir ? cfg->spill_dir : getenv("TMPDIR");
    s->spill_dir = strdup(dir && *dir ? dir : "/var/tmp");
    if (s->endpoint == NULL || s->fd_path == NULL || s->spill_dir == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore: out of memory");
        goto fail;
    }
    if (strlen(s->fd_path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        rc = rekv_errf(err, -ENAMETOOLONG, "kvstore: socket path %s is too long", s->fd_path);
        goto fail;
    }
    /* arena */
    char notice[256];
    rc = kv_arena_create(&s->arena, cfg->host_bytes, &s->cfg.geometry, cfg->huge_pages,
                         s->cfg.lease_ms, notice, sizeof(notice), err);
    if (rc < 0)
        goto fail;
    if (notice[0])
        srv_event(s, REKV_KV_EVENT_WARN, "%s", notice);
    /* push backend */
    if ((rc = srv_push_open(s, cfg, err)))
        goto fail;
    if (kv_slots_init(&s->hs, s->arena.n_slots * s->arena.slot_bytes,
                      s->arena.hdr->kv_block_bytes, s->arena.hdr->act_block_bytes) < 0 ||
        (s->slot_block = calloc((size_t)s->hs.n_big * s->hs.per_big + 1, sizeof(uint32_t))) ==
            NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore: out of memory for the slot list");
        goto fail;
    }
    if (getrandom(&s->instance, sizeof(s->instance), 0) != sizeof(s->instance))
        s->instance = rekv_now_ns() ^ ((uint64_t)getpid() << 32);
    /* spill tier */
    if (cfg->prefix_dir && cfg->no_spill) {
        rc = rekv_errf(err, -EINVAL, "kvstore: --prefix-dir keeps the spill tier's cached blocks: "
                                     "it needs the spill tier (not --no-spill)");
        goto fail;
    }
    if (cfg->prefix_dir && (asprintf(&s->spill_path, "%s/spill.rekv", cfg->prefix_dir) < 0 ||
                            asprintf(&s->idx_path, "%s/index.rekv", cfg->prefix_dir) < 0)) {
        s->spill_path = s->idx_path = NULL;
        rc = rekv_errf(err, -ENOMEM, "kvstore: out of memory");
        goto fail;
    }
    if (!cfg->no_spill) {
        kv_spill_config sc = {
            .dir = s->spill_dir,
            .path = s->spill_path,
            .max_bytes = cfg->spill_bytes,
            .slots = s->arena.slots,
            .n_slots = s->arena.n_slots,
            .slot_bytes = s->arena.slot_bytes,
            .depth = 64,
            .register_arena = !cfg->no_register_arena,
            .on_event = spill_event_cb,
            .event_ctx = s,
        };
        rc = kv_spill_open(&sc, &s->spill, err);
        if (rc < 0)
            goto fail;
    }
    if (cfg->prefix_dir && (rc = srv_persist_open(s, cfg->prefix_dir, err)) < 0)
        goto fail;
    if ((rc = rekv_evloop_create(&s->loop, err)) < 0)
        goto fail;
    if ((rc = listen_fd_socket(s, err)) < 0 || (rc = bind_router(s, err)) < 0)
        goto fail;
    if (cfg->metrics_listen) {
        rekv_metrics_server_opts mo = {.allow_remote = cfg->metrics_public};
        if ((rc = rekv_metrics_server_create_opts(cfg->metrics_listen, &mo, &s->metrics, err)))
            goto fail;
    }
    if ((rc = loop_setup(s, err)) < 0)
        goto fail;
    if (cfg->remote && (rc = srv_remote_open(s, err)) < 0) /* the remote tier's threads */
        goto fail;
    if (cfg->kv_events && (rc = events_setup(s, cfg, err)) < 0)
        goto fail;
    *out = s;
    return 0;
fail:
    rekv_kvstore_server_destroy(s);
    return rc;
}

void rekv_kvstore_server_destroy(rekv_kvstore_server *s)
{
    if (s == NULL)
        return;
    /* parked requests get an answer rather than a timeout */
    while (s->pending) {
        kv_pending *p = s->pending;
        s->pending = p->next;
        kv_reply r;
        srv_reply_init(&r, p->req->id);
        srv_fail(&r, -ESHUTDOWN, "kvstore is shutting down");
        srv_send_reply(s, p->ident, p->ident_len, p->delim, &r.resp);
        srv_pending_free(p);
    }
    srv_remote_close(s); /* its threads stop before what they were given goes */
    rekv_metrics_server_free(s->metrics);
    kv_spill_close(s->spill); /* waits for in-flight I/O before the arena goes */
    rekv_conncap_free(s->cap); /* before its socket: it stops the socket's monitor */
    kv_events_free(s->events); /* before the context's term */
    if (s->zsock)
        zmq_close(s->zsock);
    if (s->zctx)
        zmq_ctx_term(s->zctx);
    if (s->fd_listen >= 0) {
        close(s->fd_listen);
        unlink(s->fd_path);
    }
    if (s->ipc_path && s->zsock)
        unlink(s->ipc_path);
    rekv_evloop_free(s->loop);
    if (s->pbe) /* imports unmapped, then the stream and the backend, before the arena goes */
        srv_push_close(s);
    if (s->arena.base != NULL)
        kv_arena_destroy(&s->arena);
    for (size_t i = 0; i < s->seqs.cap; i++)
        if (s->seqs.keys[i] != KV_MAP_EMPTY)
            srv_seq_free_mem(s, (kv_seq *)(uintptr_t)s->seqs.vals[i]);
    kv_map_free(&s->seqs);
    srv_cache_free(s);
    while (s->clients) {
        kv_client *c = s->clients;
        s->clients = c->next;
        kv_map_free(&c->pins);
        free(c);
    }
    free(s->blocks);
    free(s->free_ids);
    kv_slots_destroy(&s->hs);
    free(s->slot_block);
    free(s->scratch);
    free(s->ahead_q);
    free(s->endpoint);
    free(s->ipc_path);
    free(s->fd_path);
    free(s->spill_dir);
    srv_persist_close(s);
    free(s->spill_path);
    free(s->idx_path);
    free(s);
}
