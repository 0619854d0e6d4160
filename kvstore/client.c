/* client.c — the kvstore client library (used by the gpuworker, the bench and the tests): receives
 * the arena memfd over the fd socket, maps it, and makes synchronous protobuf requests over a
 * ZeroMQ DEALER socket. One mutex serialises the requests, so that a worker's loop can renew the
 * lease (rekv_kvstore_renew_nowait) while its step thread uses the same connection: one lease,
 * one set of pins, one socket.
 *
 * A lost store: a ZeroMQ socket monitor (a PAIR on inproc) reports the connection's end; the
 * first DISCONNECTED marks the client lost for good (the arena it maps is the dead store's, and
 * ZeroMQ's silent reconnect would carry our requests to a new store that knows nothing of our
 * sequences), and every request then fails at once with -EPIPE. A request that gets no reply
 * within the timeout marks it lost too (-ETIMEDOUT): a store that hangs (SIGSTOP, a stuck disk)
 * costs one timeout in all, not one per later request (a worker dropping each of its sequences
 * after a failed step), and its lease expiry or the owner's next DropOwner frees what the
 * connection held. A request waiting for its reply polls the monitor, an abort eventfd and the
 * caller's stop fd (rekv_kvstore_client_set_stop_fd) beside the socket, so it ends as soon as
 * the store dies, another thread calls rekv_kvstore_client_abort or the process is told to
 * stop. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "kvstore/kvstore.h"
#include "proto/kvstore.pb-c.h"

struct rekv_kvstore_client {
    void *zctx, *zsock;        /* ZeroMQ context and DEALER socket */
    int timeout_ms;            /* per request */
    uint64_t next_id;          /* request ids */
    int memfd;                 /* the arena */
    void *arena;               /* its mapping */
    size_t bytes;              /* mapping length */
    rekv_kv_arena_header *hdr; /* == arena */
    uint8_t *buf;              /* packing buffer */
    size_t cap;
    char owner[REKV_KV_OWNER_MAX + 1]; /* sent with every request ("" for none); see kvstore.h */
    pthread_mutex_t lock;      /* one request at a time: guards the socket, buf, next_id, owner,
                                * the monitor */
    void *zmon;                /* PAIR receiving the DEALER's monitor events (DISCONNECTED) */
    int abort_fd;              /* eventfd: rekv_kvstore_client_abort */
    atomic_int stop_fd;        /* polled, never read (a daemon's stop eventfd); -1: none */
    atomic_int lost;           /* 0, or the negative errno every request now fails with */
    uint64_t lost_seq;         /* the last sequence a failed reply said is lost (0: none since
                                * rekv_kvstore_client_take_lost_seq); under lock */
    char endpoint[256];        /* for messages */
};

static int recv_memfd(const char *path, int timeout_ms, int *out, rekv_err *err)
{
    int rc = 0;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return rekv_errf(err, -errno, "kvstore client: socket: %s", strerror(errno));
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        rc = rekv_errf(err, -ENAMETOOLONG, "kvstore client: %s is too long", path);
        goto out;
    }
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    /* a stopped store's full backlog makes connect wait: bound that too */
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        rc = rekv_errf(err, -errno, "kvstore client: connect %s: %s", path, strerror(errno));
        goto out;
    }
    char byte;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                        .msg_controllen = sizeof(u.buf)};
    ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
    if (n <= 0) {
        rc = rekv_errf(err, n < 0 ? -errno : -EPROTO, "kvstore client: no arena from %s: %s", path,
                       n < 0 ? strerror(errno) : "connection closed");
        goto out;
    }
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    if (cm == NULL || cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS ||
        cm->cmsg_len != CMSG_LEN(sizeof(int))) {
        rc = rekv_errf(err, -EPROTO, "kvstore client: %s sent no file descriptor", path);
        goto out;
    }
    memcpy(out, CMSG_DATA(cm), sizeof(int));
out:
    close(s);
    return rc;
}

int rekv_kvstore_client_connect(const char *endpoint, const char *fd_socket, int timeout_ms,
                                rekv_kvstore_client **out, rekv_err *err)
{
    int rc = 0;
    char path[4096];
    *out = NULL;
    if (timeout_ms <= 0)
        timeout_ms = 30000;
    if (fd_socket == NULL) {
        if (strncmp(endpoint, "ipc://", 6) != 0)
            return rekv_errf(err, -EINVAL, "kvstore client: %s is not ipc://; give the fd socket",
                             endpoint);
        snprintf(path, sizeof(path), "%s.fd", endpoint + 6);
        fd_socket = path;
    }
    rekv_kvstore_client *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
    c->memfd = -1;
    c->abort_fd = -1;
    atomic_init(&c->stop_fd, -1);
    c->arena = MAP_FAILED;
    c->timeout_ms = timeout_ms;
    snprintf(c->endpoint, sizeof(c->endpoint), "%s", endpoint);
    pthread_mutex_init(&c->lock, NULL);
    c->abort_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c->abort_fd < 0) {
        rc = rekv_errf(err, -errno, "kvstore client: eventfd: %s", strerror(errno));
        goto fail;
    }
    if ((rc = recv_memfd(fd_socket, timeout_ms, &c->memfd, err)) < 0)
        goto fail;
    struct stat st;
    if (fstat(c->memfd, &st) < 0) {
        rc = rekv_errf(err, -errno, "kvstore client: fstat arena: %s", strerror(errno));
        goto fail;
    }
    c->bytes = (size_t)st.st_size;
    c->arena = mmap(NULL, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->memfd, 0);
    if (c->arena == MAP_FAILED) {
        rc = rekv_errf(err, -errno, "kvstore client: mmap arena: %s", strerror(errno));
        goto fail;
    }
    c->hdr = c->arena;
    if ((rc = rekv_kv_arena_header_check(c->hdr, c->bytes, err)) < 0)
        goto fail;
    c->zctx = zmq_ctx_new();
    c->zsock = c->zctx ? zmq_socket(c->zctx, ZMQ_DEALER) : NULL;
    if (c->zsock == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore client: zmq socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int zero = 0;
    zmq_setsockopt(c->zsock, ZMQ_LINGER, &zero, sizeof(zero));
    /* the monitor first, so that no end of the connection goes unseen */
    char mon[64];
    snprintf(mon, sizeof(mon), "inproc://rekv-kvstore-monitor-%p", (void *)c);
    if (zmq_socket_monitor(c->zsock, mon, ZMQ_EVENT_DISCONNECTED) < 0 ||
        (c->zmon = zmq_socket(c->zctx, ZMQ_PAIR)) == NULL || zmq_connect(c->zmon, mon) < 0) {
        rc = rekv_errf(err, -zmq_errno(), "kvstore client: socket monitor: %s",
                       zmq_strerror(zmq_errno()));
        goto fail;
    }
    zmq_setsockopt(c->zmon, ZMQ_LINGER, &zero, sizeof(zero));
    if (zmq_connect(c->zsock, endpoint) < 0) {
        rc = rekv_errf(err, -zmq_errno(), "kvstore client: connect %s: %s", endpoint,
                       zmq_strerror(zmq_errno()));
        goto fail;
    }
    c->next_id = ((uint64_t)getpid() << 32);
    *out = c;
    return 0;
fail:
    rekv_kvstore_client_close(c);
    return rc;
}

void rekv_kvstore_client_close(rekv_kvstore_client *c)
{
    if (c == NULL)
        return;
    if (c->zsock) {
        zmq_socket_monitor(c->zsock, NULL, 0);
        zmq_close(c->zsock);
    }
    if (c->zmon)
        zmq_close(c->zmon);
    if (c->zctx)
        zmq_ctx_term(c->zctx);
    if (c->arena != MAP_FAILED)
        munmap(c->arena, c->bytes);
    if (c->memfd >= 0)
        close(c->memfd);
    if (c->abort_fd >= 0)
        close(c->abort_fd);
    free(c->buf);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

void *rekv_kvstore_client_arena(const rekv_kvstore_client *c, size_t *bytes)
{
    if (bytes)
        *bytes = c->bytes;
    return c->arena;
}

const rekv_kv_arena_header *rekv_kvstore_client_header(const rekv_kvstore_client *c)
{
    return c->hdr;
}

void rekv_kvstore_client_geometry(const rekv_kvstore_client *c, rekv_kv_geometry *g)
{
    g->n_layers = c->hdr->n_layers;
    g->n_kv_heads = c->hdr->n_kv_heads;
    g->head_dim = c->hdr->head_dim;
    g->hidden = c->hdr->hidden;
    g->dtype = (rekv_dtype)c->hdr->dtype;
    g->block_tokens = c->hdr->block_tokens;
}

/* Marks the client lost with code unless it already is (the first cause stays). */
static void mark_lost(rekv_kvstore_client *c, int code)
{
    int zero = 0;
    atomic_compare_exchange_strong(&c->lost, &zero, code);
}

/* Reads the monitor's pending events; a DISCONNECTED marks the client lost. With c->lock held. */
static void monitor_drain(rekv_kvstore_client *c)
{
    for (;;) {
        zmq_msg_t ev, addr;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, c->zmon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        uint16_t id = 0;
        if (zmq_msg_size(&ev) >= 2)
            memcpy(&id, zmq_msg_data(&ev), 2);
        int more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        if (more) { /* the endpoint's frame */
            zmq_msg_init(&addr);
            zmq_msg_recv(&addr, c->zmon, 0);
            zmq_msg_close(&addr);
        }
        if (id == ZMQ_EVENT_DISCONNECTED)
            mark_lost(c, -EPIPE);
    }
}

/* The error of a lost or aborted client, or 0. */
static int lost_err(rekv_kvstore_client *c, rekv_err *err)
{
    int lost = atomic_load(&c->lost);
    if (lost == -ECANCELED)
        return rekv_errf(err, lost, "kvstore client: aborted");
    if (lost == -ETIMEDOUT)
        return rekv_errf(err, lost,
                         "kvstore client: the kvstore at %s left a request unanswered for %d ms; "
                         "the connection is given up: reconnect",
                         c->endpoint, c->timeout_ms);
    if (lost)
        return rekv_errf(err, lost,
                         "kvstore client: the connection to the kvstore at %s ended (the store "
                         "stopped or restarted): reconnect",
                         c->endpoint);
    return 0;
}

/* Whether the caller's stop fd is readable (then the client is aborted, for good). */
static int stop_seen(rekv_kvstore_client *c)
{
    struct pollfd p = {atomic_load(&c->stop_fd), POLLIN, 0};
    if (p.fd < 0 || poll(&p, 1, 0) <= 0 || !(p.revents & POLLIN))
        return 0;
    mark_lost(c, -ECANCELED);
    return 1;
}

/* Sends len bytes and waits for the reply frame whose Response id is `id` (id 0 accepts any);
 * -EPIPE as soon as the store's connection ends, -ECANCELED when aborted or stopped, -ETIMEDOUT
 * (and lost from then on) when no reply comes in time. With c->lock held. */
static int call_raw(rekv_kvstore_client *c, const void *buf, size_t len, uint64_t id,
                    Rekv__Kvstore__Response **resp, rekv_err *err)
{
    *resp = NULL;
    int rc;
    monitor_drain(c);
    stop_seen(c);
    if ((rc = lost_err(c, err)))
        return rc;
    if (zmq_send(c->zsock, buf, len, 0) < 0)
        return rekv_errf(err, -zmq_errno(), "kvstore client: send: %s", zmq_strerror(zmq_errno()));
    uint64_t deadline = rekv_now_ns() + (uint64_t)c->timeout_ms * 1000000ull;
    for (;;) {
        uint64_t now = rekv_now_ns();
        if (now >= deadline) {
            /* the store hangs: later requests would each wait as long */
            mark_lost(c, -ETIMEDOUT);
            return rekv_errf(err, -ETIMEDOUT, "kvstore client: no reply from %s in %d ms",
                             c->endpoint, c->timeout_ms);
        }
        int sfd = atomic_load(&c->stop_fd);
        zmq_pollitem_t it[4] = {{.socket = c->zsock, .events = ZMQ_POLLIN},
                                {.socket = c->zmon, .events = ZMQ_POLLIN},
                                {.socket = NULL, .fd = c->abort_fd, .events = ZMQ_POLLIN},
                                {.socket = NULL, .fd = sfd, .events = ZMQ_POLLIN}};
        int pr = zmq_poll(it, sfd >= 0 ? 4 : 3, (long)((deadline - now) / 1000000ull) + 1);
        if (pr < 0 && zmq_errno() != EINTR)
            return rekv_errf(err, -zmq_errno(), "kvstore client: poll: %s",
                             zmq_strerror(zmq_errno()));
        if (pr <= 0)
            continue;
        if (it[1].revents & ZMQ_POLLIN)
            monitor_drain(c);
        if (sfd >= 0 && (it[3].revents & ZMQ_POLLIN))
            mark_lost(c, -ECANCELED);
        if ((rc = lost_err(c, err)))
            return rc;
        if (!(it[0].revents & ZMQ_POLLIN))
            continue;
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->zsock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            continue;
        }
        Rekv__Kvstore__Response *r =
            rekv__kvstore__response__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
        zmq_msg_close(&m);
        if (r == NULL)
            return rekv_errf(err, -EPROTO, "kvstore client: malformed reply");
        if (id != 0 && r->id != id && r->id != 0) {
            rekv__kvstore__response__free_unpacked(r, NULL); /* a late reply to a timed-out call */
            continue;
        }
        *resp = r;
        return 0;
    }
}

uint64_t rekv_kvstore_client_take_lost_seq(rekv_kvstore_client *c)
{
    pthread_mutex_lock(&c->lock);
    uint64_t seq = c->lost_seq;
    c->lost_seq = 0;
    pthread_mutex_unlock(&c->lock);
    return seq;
}

int rekv_kvstore_client_lost(rekv_kvstore_client *c)
{
    if (atomic_load(&c->lost) == 0 && pthread_mutex_trylock(&c->lock) == 0) {
        monitor_drain(c);
        pthread_mutex_unlock(&c->lock);
    }
    return atomic_load(&c->lost);
}

void rekv_kvstore_client_abort(rekv_kvstore_client *c)
{
    mark_lost(c, -ECANCELED);
    uint64_t one = 1;
    ssize_t w = write(c->abort_fd, &one, sizeof(one));
    (void)w;
}

void rekv_kvstore_client_set_stop_fd(rekv_kvstore_client *c, int fd)
{
    atomic_store(&c->stop_fd, fd);
}

void rekv_kvstore_client_set_timeout(rekv_kvstore_client *c, int timeout_ms)
{
    pthread_mutex_lock(&c->lock);
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : 30000;
    pthread_mutex_unlock(&c->lock);
}

/* Stamps req with the version, a fresh id and the owner, sends it and waits for its reply; with
 * c->lock held. */
static int call_locked(rekv_kvstore_client *c, Rekv__Kvstore__Request *req,
                       Rekv__Kvstore__Response **resp, rekv_err *err)
{
    req->version = REKV_KVSTORE_PROTO_VERSION;
    req->id = ++c->next_id;
    req->owner = c->owner;
    size_t len = rekv__kvstore__request__get_packed_size(req);
    if (len > c->cap) {
        uint8_t *nb = realloc(c->buf, len);
        if (nb == NULL)
            return rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
        c->buf = nb;
        c->cap = len;
    }
    rekv__kvstore__request__pack(req, c->buf);
    return call_raw(c, c->buf, len, req->id, resp, err);
}

/* Sends req and returns the reply (caller frees) or -errno with the server's message. nowait:
 * -EBUSY at once when another thread's request is in flight. */
static int call_ex(rekv_kvstore_client *c, Rekv__Kvstore__Request *req,
                   Rekv__Kvstore__Response **resp, int nowait, rekv_err *err)
{
    *resp = NULL;
    if (nowait) {
        if (pthread_mutex_trylock(&c->lock) != 0)
            return -EBUSY;
    } else {
        pthread_mutex_lock(&c->lock);
    }
    int rc = call_locked(c, req, resp, err);
    if (rc == 0 && (*resp)->status != 0 && (*resp)->lost_seq != 0)
        c->lost_seq = (*resp)->lost_seq;
    pthread_mutex_unlock(&c->lock);
    if (rc < 0)
        return rc;
    if ((*resp)->status != 0) {
        rc = (*resp)->status < 0 ? (*resp)->status : -EPROTO;
        rekv_errf(err, rc, "kvstore: %s", (*resp)->error ? (*resp)->error : "error");
        rekv__kvstore__response__free_unpacked(*resp, NULL);
        *resp = NULL;
    }
    return rc;
}

static int call(rekv_kvstore_client *c, Rekv__Kvstore__Request *req,
                Rekv__Kvstore__Response **resp, rekv_err *err)
{
    return call_ex(c, req, resp, 0, err);
}

static int call_simple(rekv_kvstore_client *c, Rekv__Kvstore__Request *req, rekv_err *err)
{
    Rekv__Kvstore__Response *resp;
    int rc = call(c, req, &resp, err);
    if (rc == 0)
        rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}

int rekv_kvstore_client_raw(rekv_kvstore_client *c, const void *req, size_t len, int32_t *status,
                            char *err_msg, size_t err_len, rekv_err *err)
{
    Rekv__Kvstore__Response *resp;
    pthread_mutex_lock(&c->lock);
    int rc = call_raw(c, req, len, 0, &resp, err);
    pthread_mutex_unlock(&c->lock);
    if (rc < 0)
        return rc;
    *status = resp->status;
    if (err_msg && err_len)
        snprintf(err_msg, err_len, "%s", resp->error ? resp->error : "");
    rekv__kvstore__response__free_unpacked(resp, NULL);
    return 0;
}

int rekv_kvstore_seq_create(rekv_kvstore_client *c, uint64_t seq, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__CreateSeq m = REKV__KVSTORE__CREATE_SEQ__INIT;
    m.seq = seq;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_CREATE_SEQ;
    req.create_seq = &m;
    return call_simple(c, &req, err);
}

/* Fills m from px; *tok (caller frees) holds the ids. */
static int prefix_build(const rekv_kv_prefix *px, Rekv__Kvstore__Prefix *m, uint32_t **tok,
                        rekv_err *err)
{
    *tok = malloc(sizeof(uint32_t) * (px->n_tokens ? px->n_tokens : 1));
    if (*tok == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
    for (size_t i = 0; i < px->n_tokens; i++) {
        if (px->tokens[i] < 0) {
            free(*tok);
            *tok = NULL;
            return rekv_errf(err, -EINVAL, "kvstore client: prefix token %zu is negative (%d)", i,
                             (int)px->tokens[i]);
        }
        (*tok)[i] = (uint32_t)px->tokens[i];
    }
    m->tokens = *tok;
    m->n_tokens = px->n_tokens;
    m->fingerprint = px->fingerprint;
    m->kv_parts = px->kv_parts;
    m->act_parts = px->act_parts;
    return 0;
}

/* Sends a request with a prefix and takes its PrefixReply into *hit (may be NULL). */
static int prefix_call(rekv_kvstore_client *c, Rekv__Kvstore__Request *req,
                       rekv_kv_prefix_hit *hit, rekv_err *err)
{
    Rekv__Kvstore__Response *resp;
    int rc = call(c, req, &resp, err);
    if (rc < 0)
        return rc;
    if (resp->body_case != REKV__KVSTORE__RESPONSE__BODY_PREFIX)
        rc = rekv_errf(err, -EPROTO, "kvstore client: prefix reply without body");
    else if (hit)
        *hit = (rekv_kv_prefix_hit){resp->prefix->blocks, resp->prefix->tokens,
                                    resp->prefix->host_blocks, resp->prefix->disk_blocks,
                                    resp->prefix->published};
    rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}

int rekv_kvstore_seq_create_prefix(rekv_kvstore_client *c, uint64_t seq, const rekv_kv_prefix *px,
                                   rekv_kv_prefix_hit *hit, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__CreateSeq m = REKV__KVSTORE__CREATE_SEQ__INIT;
    Rekv__Kvstore__Prefix pm = REKV__KVSTORE__PREFIX__INIT;
    uint32_t *tok;
    int rc = prefix_build(px, &pm, &tok, err);
    if (rc)
        return rc;
    m.seq = seq;
    m.prefix = &pm;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_CREATE_SEQ;
    req.create_seq = &m;
    rc = prefix_call(c, &req, hit, err);
    free(tok);
    return rc;
}

int rekv_kvstore_lookup(rekv_kvstore_client *c, const rekv_kv_prefix *px, rekv_kv_prefix_hit *hit,
                        rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Lookup m = REKV__KVSTORE__LOOKUP__INIT;
    Rekv__Kvstore__Prefix pm = REKV__KVSTORE__PREFIX__INIT;
    uint32_t *tok;
    int rc = prefix_build(px, &pm, &tok, err);
    if (rc)
        return rc;
    m.prefix = &pm;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_LOOKUP;
    req.lookup = &m;
    rc = prefix_call(c, &req, hit, err);
    free(tok);
    return rc;
}

int rekv_kvstore_publish(rekv_kvstore_client *c, uint64_t seq, const rekv_kv_prefix *px,
                         rekv_kv_prefix_hit *hit, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Publish m = REKV__KVSTORE__PUBLISH__INIT;
    Rekv__Kvstore__Prefix pm = REKV__KVSTORE__PREFIX__INIT;
    uint32_t *tok;
    int rc = prefix_build(px, &pm, &tok, err);
    if (rc)
        return rc;
    m.seq = seq;
    m.prefix = &pm;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_PUBLISH;
    req.publish = &m;
    rc = prefix_call(c, &req, hit, err);
    free(tok);
    return rc;
}

int rekv_kvstore_cache_clear(rekv_kvstore_client *c, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__ClearCache m = REKV__KVSTORE__CLEAR_CACHE__INIT;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_CLEAR_CACHE;
    req.clear_cache = &m;
    return call_simple(c, &req, err);
}

int rekv_kvstore_seq_drop(rekv_kvstore_client *c, uint64_t seq, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__DropSeq m = REKV__KVSTORE__DROP_SEQ__INIT;
    m.seq = seq;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_DROP_SEQ;
    req.drop_seq = &m;
    return call_simple(c, &req, err);
}

int rekv_kvstore_append(rekv_kvstore_client *c, uint64_t seq, uint64_t n_tokens,
                        uint32_t kv_parts, uint32_t act_parts, uint64_t *n_tokens_after,
                        rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Append m = REKV__KVSTORE__APPEND__INIT;
    m.seq = seq;
    m.n_tokens = n_tokens;
    m.kv_parts = kv_parts;
    m.act_parts = act_parts;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_APPEND;
    req.append = &m;
    Rekv__Kvstore__Response *resp;
    int rc = call(c, &req, &resp, err);
    if (rc < 0)
        return rc;
    if (resp->body_case != REKV__KVSTORE__RESPONSE__BODY_APPEND)
        rc = rekv_errf(err, -EPROTO, "kvstore client: append reply without body");
    else if (n_tokens_after)
        *n_tokens_after = resp->append->n_tokens;
    rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}

int rekv_kvstore_table(rekv_kvstore_client *c, uint64_t seq, uint32_t layer,
                       rekv_kv_table_entry **entries, size_t *n_blocks, uint64_t *n_tokens,
                       rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__GetTable m = REKV__KVSTORE__GET_TABLE__INIT;
    m.seq = seq;
    m.layer = layer;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_GET_TABLE;
    req.get_table = &m;
    *entries = NULL;
    *n_blocks = 0;
    Rekv__Kvstore__Response *resp;
    int rc = call(c, &req, &resp, err);
    if (rc < 0)
        return rc;
    Rekv__Kvstore__TableReply *t = resp->table;
    if (resp->body_case != REKV__KVSTORE__RESPONSE__BODY_TABLE || t->n_type != t->n_tier ||
        t->n_type != t->n_phys) {
        rc = rekv_errf(err, -EPROTO, "kvstore client: bad table reply");
        goto out;
    }
    rekv_kv_table_entry *e = calloc(t->n_type ? t->n_type : 1, sizeof(*e));
    if (e == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
        goto out;
    }
    for (size_t i = 0; i < t->n_type; i++) {
        e[i].type = t->type[i];
        e[i].tier = t->tier[i];
        e[i].phys = t->phys[i];
    }
    *entries = e;
    *n_blocks = t->n_type;
    if (n_tokens)
        *n_tokens = t->n_tokens;
out:
    rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}

static int ranges_build(const rekv_kv_range *ranges, size_t n, Rekv__Kvstore__Range **arr,
                        Rekv__Kvstore__Range ***ptrs)
{
    *arr = calloc(n ? n : 1, sizeof(**arr));
    *ptrs = calloc(n ? n : 1, sizeof(**ptrs));
    if (*arr == NULL || *ptrs == NULL) {
        free(*arr);
        free(*ptrs);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        Rekv__Kvstore__Range init = REKV__KVSTORE__RANGE__INIT;
        (*arr)[i] = init;
        (*arr)[i].seq = ranges[i].seq;
        (*arr)[i].layer = ranges[i].layer;
        (*arr)[i].token_begin = ranges[i].token_begin;
        (*arr)[i].token_end = ranges[i].token_end;
        (*ptrs)[i] = &(*arr)[i];
    }
    return 0;
}

static int plan_call(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges, int pin,
                     const rekv_kv_range *ahead, size_t n_ahead, rekv_kv_plan_block **blocks,
                     size_t *n_blocks, size_t *cap, rekv_err *err)
{
    Rekv__Kvstore__Range *arr, **ptrs, *arr_a = NULL, **ptrs_a = NULL;
    *n_blocks = 0;
    if (ranges_build(ranges, n_ranges, &arr, &ptrs) < 0)
        return rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
    if (n_ahead && ranges_build(ahead, n_ahead, &arr_a, &ptrs_a) < 0) {
        free(arr);
        free(ptrs);
        return rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
    }
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Plan m = REKV__KVSTORE__PLAN__INIT;
    m.n_ranges = n_ranges;
    m.ranges = ptrs;
    m.pin = pin != 0;
    m.n_ahead = n_ahead;
    m.ahead = ptrs_a;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_PLAN;
    req.plan = &m;
    Rekv__Kvstore__Response *resp;
    int rc = call(c, &req, &resp, err);
    free(arr);
    free(ptrs);
    free(arr_a);
    free(ptrs_a);
    if (rc < 0)
        return rc;
    Rekv__Kvstore__PlanReply *p = resp->plan;
    size_t n = resp->body_case == REKV__KVSTORE__RESPONSE__BODY_PLAN ? p->n_block : 0;
    if (resp->body_case != REKV__KVSTORE__RESPONSE__BODY_PLAN || p->n_type != n ||
        p->n_offset != n || p->n_first != n || p->n_count != n || p->n_range_count != n_ranges) {
        rc = rekv_errf(err, -EPROTO, "kvstore client: bad plan reply");
        goto out;
    }
    if (n > *cap || *blocks == NULL) {
        rekv_kv_plan_block *nb = realloc(*blocks, (n ? n : 1) * sizeof(*nb));
        if (nb == NULL) {
            rc = rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
            goto out;
        }
        *blocks = nb;
        *cap = n ? n : 1;
    }
    size_t k = 0;
    for (size_t r = 0; r < n_ranges; r++)
        for (uint32_t j = 0; j < p->range_count[r] && k < n; j++, k++) {
            rekv_kv_plan_block *b = &(*blocks)[k];
            b->block = p->block[k];
            b->offset = p->offset[k];
            b->type = p->type[k];
            b->range = (uint32_t)r;
            b->first = p->first[k];
            b->count = p->count[k];
            uint64_t bb = b->type == REKV_KV_BLOCK_KV ? c->hdr->kv_block_bytes
                                                      : c->hdr->act_block_bytes;
            if (b->offset < c->hdr->data_offset || b->offset + bb > c->bytes) {
                rc = rekv_errf(err, -EPROTO, "kvstore client: plan offset outside the arena");
                goto out;
            }
        }
    if (k != n) {
        rc = rekv_errf(err, -EPROTO, "kvstore client: plan range counts do not add up");
        goto out;
    }
    *n_blocks = n;
out:
    rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}

int rekv_kvstore_plan(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges, int pin,
                      rekv_kv_plan_block **blocks, size_t *n_blocks, size_t *cap, rekv_err *err)
{
    return plan_call(c, ranges, n_ranges, pin, NULL, 0, blocks, n_blocks, cap, err);
}

int rekv_kvstore_pin_ahead(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                           const rekv_kv_range *ahead, size_t n_ahead, rekv_kv_plan_block **blocks,
                           size_t *n_blocks, size_t *cap, rekv_err *err)
{
    return plan_call(c, ranges, n_ranges, 1, ahead, n_ahead, blocks, n_blocks, cap, err);
}

static int unpin_call(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                      int done, rekv_err *err)
{
    Rekv__Kvstore__Range *arr, **ptrs;
    if (ranges_build(ranges, n_ranges, &arr, &ptrs) < 0)
        return rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Unpin m = REKV__KVSTORE__UNPIN__INIT;
    m.n_ranges = n_ranges;
    m.ranges = ptrs;
    m.done = done != 0;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_UNPIN;
    req.unpin = &m;
    int rc = call_simple(c, &req, err);
    free(arr);
    free(ptrs);
    return rc;
}

int rekv_kvstore_unpin(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                       rekv_err *err)
{
    return unpin_call(c, ranges, n_ranges, 0, err);
}

int rekv_kvstore_unpin_done(rekv_kvstore_client *c, const rekv_kv_range *ranges, size_t n_ranges,
                            rekv_err *err)
{
    return unpin_call(c, ranges, n_ranges, 1, err);
}

int rekv_kvstore_free(rekv_kvstore_client *c, uint64_t seq, uint32_t layer_begin,
                      uint32_t layer_end, uint64_t block_begin, uint64_t block_end, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Free m = REKV__KVSTORE__FREE__INIT;
    m.seq = seq;
    m.layer_begin = layer_begin;
    m.layer_end = layer_end;
    m.block_begin = block_begin;
    m.block_end = block_end;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_FREE;
    req.free = &m;
    return call_simple(c, &req, err);
}

static int renew(rekv_kvstore_client *c, int nowait, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Renew m = REKV__KVSTORE__RENEW__INIT;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_RENEW;
    req.renew = &m;
    Rekv__Kvstore__Response *resp;
    int rc = call_ex(c, &req, &resp, nowait, err);
    if (rc == 0)
        rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}

int rekv_kvstore_renew(rekv_kvstore_client *c, rekv_err *err) { return renew(c, 0, err); }

int rekv_kvstore_renew_nowait(rekv_kvstore_client *c, rekv_err *err)
{
    int rc = renew(c, 1, err);
    return rc == -EBUSY ? 0 : rc; /* the request in flight renews the lease itself */
}

int rekv_kvstore_client_set_owner(rekv_kvstore_client *c, const char *owner, rekv_err *err)
{
    if (owner == NULL)
        owner = "";
    if (strlen(owner) >= sizeof(c->owner))
        return rekv_errf(err, -EINVAL,
                         "kvstore client: owner name '%.40s...' is longer than %zu bytes", owner,
                         sizeof(c->owner) - 1);
    pthread_mutex_lock(&c->lock);
    snprintf(c->owner, sizeof(c->owner), "%s", owner);
    pthread_mutex_unlock(&c->lock);
    return 0;
}

int rekv_kvstore_drop_owner(rekv_kvstore_client *c, const char *owner, uint64_t *n_seqs,
                            uint64_t *n_blocks, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__DropOwner m = REKV__KVSTORE__DROP_OWNER__INIT;
    m.owner = (char *)owner;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_DROP_OWNER;
    req.drop_owner = &m;
    Rekv__Kvstore__Response *resp;
    int rc = call(c, &req, &resp, err);
    if (rc < 0)
        return rc;
    if (resp->body_case != REKV__KVSTORE__RESPONSE__BODY_DROP_OWNER) {
        rc = rekv_errf(err, -EPROTO, "kvstore client: drop-owner reply without body");
    } else {
        if (n_seqs)
            *n_seqs = resp->drop_owner->sequences;
        if (n_blocks)
            *n_blocks = resp->drop_owner->blocks;
    }
    rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}

static ProtobufCBinaryData handle_bytes(const void *h)
{
    return (ProtobufCBinaryData){h ? REKV_KV_IPC_HANDLE_BYTES : 0, (uint8_t *)h};
}

int rekv_kvstore_push(rekv_kvstore_client *c, const void *const *buffers, size_t n_buffers,
                      const void *wait_event, const void *done_event,
                      const rekv_kv_push_piece *pieces, size_t n_pieces, char *backend, size_t cap,
                      rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Push m = REKV__KVSTORE__PUSH__INIT;
    ProtobufCBinaryData *bufs = calloc(n_buffers ? n_buffers : 1, sizeof(*bufs));
    uint64_t *src = malloc(sizeof(uint64_t) * (n_pieces ? n_pieces : 1));
    uint64_t *dst = malloc(sizeof(uint64_t) * (n_pieces ? n_pieces : 1));
    uint64_t *bytes = malloc(sizeof(uint64_t) * (n_pieces ? n_pieces : 1));
    uint32_t *which = malloc(sizeof(uint32_t) * (n_pieces ? n_pieces : 1));
    int rc = 0;
    if (bufs == NULL || src == NULL || dst == NULL || bytes == NULL || which == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_buffers; i++)
        bufs[i] = handle_bytes(buffers[i]);
    for (size_t i = 0; i < n_pieces; i++) {
        src[i] = pieces[i].src;
        dst[i] = pieces[i].dst;
        bytes[i] = pieces[i].bytes;
        which[i] = pieces[i].buffer;
    }
    m.n_buffers = n_buffers;
    m.buffers = bufs;
    m.wait_event = handle_bytes(wait_event);
    m.done_event = handle_bytes(done_event);
    m.n_src = m.n_dst = m.n_bytes = m.n_buffer = n_pieces;
    m.src = src;
    m.dst = dst;
    m.bytes = bytes;
    m.buffer = which;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_PUSH;
    req.push = &m;
    Rekv__Kvstore__Response *resp;
    if ((rc = call(c, &req, &resp, err)) < 0)
        goto out;
    if (backend && cap) {
        const char *name =
            resp->body_case == REKV__KVSTORE__RESPONSE__BODY_PUSH && resp->push->backend
                ? resp->push->backend
                : "";
        snprintf(backend, cap, "%s", name);
    }
    rekv__kvstore__response__free_unpacked(resp, NULL);
out:
    free(bufs);
    free(src);
    free(dst);
    free(bytes);
    free(which);
    return rc;
}

int rekv_kvstore_release(rekv_kvstore_client *c, const void *const *handles, size_t n,
                         rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__Release m = REKV__KVSTORE__RELEASE__INIT;
    ProtobufCBinaryData *hs = calloc(n ? n : 1, sizeof(*hs));
    if (hs == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore client: out of memory");
    for (size_t i = 0; i < n; i++)
        hs[i] = handle_bytes(handles[i]);
    m.n_handles = n;
    m.handles = hs;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_RELEASE;
    req.release = &m;
    int rc = call_simple(c, &req, err);
    free(hs);
    return rc;
}

int rekv_kvstore_stats(rekv_kvstore_client *c, rekv_kv_stats *out, rekv_err *err)
{
    Rekv__Kvstore__Request req = REKV__KVSTORE__REQUEST__INIT;
    Rekv__Kvstore__StatsRequest m = REKV__KVSTORE__STATS_REQUEST__INIT;
    req.body_case = REKV__KVSTORE__REQUEST__BODY_STATS;
    req.stats = &m;
    Rekv__Kvstore__Response *resp;
    int rc = call(c, &req, &resp, err);
    if (rc < 0)
        return rc;
    if (resp->body_case != REKV__KVSTORE__RESPONSE__BODY_STATS) {
        rc = rekv_errf(err, -EPROTO, "kvstore client: stats reply without body");
        goto out;
    }
    Rekv__Kvstore__StatsReply *s = resp->stats;
    memset(out, 0, sizeof(*out));
    out->host_kv = s->host_kv;
    out->host_act = s->host_act;
    out->disk_kv = s->disk_kv;
    out->disk_act = s->disk_act;
    out->free_slots = s->free_slots;
    out->total_slots = s->total_slots;
    out->pinned_blocks = s->pinned_blocks;
    out->bytes_spilled = s->bytes_spilled;
    out->bytes_read_back = s->bytes_read_back;
    out->pin_hits = s->pin_hits;
    out->pin_misses = s->pin_misses;
    out->spill_errors = s->spill_errors;
    out->crc_errors = s->crc_errors;
    out->read_errors = s->read_errors;
    out->sequences = s->sequences;
    out->clients = s->clients;
    out->leases_expired = s->leases_expired;
    out->spills_in_flight = s->spills_in_flight;
    out->reads_in_flight = s->reads_in_flight;
    out->sequences_reclaimed = s->sequences_reclaimed;
    out->host_bytes = s->host_bytes;
    out->host_free_bytes = s->host_free_bytes;
    out->host_used_bytes = s->host_used_bytes;
    out->kv_slot_bytes = s->kv_slot_bytes;
    out->act_slot_bytes = s->act_slot_bytes;
    out->spill_bytes = s->spill_bytes;
    out->spill_used_bytes = s->spill_used_bytes;
    out->instance = s->instance;
    out->pin_wait_blocks = s->pin_wait_blocks;
    out->pin_wait_bytes = s->pin_wait_bytes;
    out->read_ahead_blocks = s->read_ahead_blocks;
    out->read_ahead_bytes = s->read_ahead_bytes;
    out->spill_room_bytes = s->spill_room_bytes;
    out->prefix_lookups = s->prefix_lookups;
    out->prefix_hit_tokens = s->prefix_hit_tokens;
    out->prefix_hit_host_blocks = s->prefix_hit_host_blocks;
    out->prefix_hit_disk_blocks = s->prefix_hit_disk_blocks;
    out->prefix_evictions = s->prefix_evictions;
    out->prefix_hit_read_bytes = s->prefix_hit_read_bytes;
    out->prefix_published_blocks = s->prefix_published_blocks;
    out->prefix_cached_blocks = s->prefix_cached_blocks;
    out->prefix_entries = s->prefix_entries;
    out->prefix_host_bytes = s->prefix_host_bytes;
    out->direct_io = s->direct_io;
    out->registered_arena = s->registered_arena;
    for (size_t i = 0; i < s->n_histograms && out->n_hists < 8; i++) {
        rekv_kv_hist *h = &out->hists[out->n_hists++];
        snprintf(h->name, sizeof(h->name), "%s", s->histograms[i]->name);
        for (size_t b = 0; b < s->histograms[i]->n_buckets && b < REKV_KV_HIST_BUCKETS; b++)
            h->buckets[b] = s->histograms[i]->buckets[b];
        h->count = s->histograms[i]->count;
        h->sum_ns = s->histograms[i]->sum_ns;
    }
out:
    rekv__kvstore__response__free_unpacked(resp, NULL);
    return rc;
}
