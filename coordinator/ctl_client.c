/* ctl_client.c — the client side of the control protocol: a DEALER socket, requests out, responses
 * in, one frame each. Used by the rekv CLI and the tests. */
#include "coordinator/coordinator.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/curve.h"

struct rekv_ctl {
    void *zctx;       /* ZeroMQ context: private, or the caller's (rekv_ctl_connect_in) */
    int own_ctx;      /* 1: zctx is private, terminated by rekv_ctl_close */
    void *sock;       /* DEALER connected to the control socket */
    uint64_t next_id; /* request ids this client hands out */
};

int rekv_runtime_dir(char *buf, size_t len, rekv_err *err)
{
    const char *x = getenv("XDG_RUNTIME_DIR");
    int n = x && *x ? snprintf(buf, len, "%s/rekv", x)
                    : snprintf(buf, len, "%s", REKV_SYSTEM_RUNTIME_DIR);
    if (n < 0 || (size_t)n >= len)
        return rekv_errf(err, -ENAMETOOLONG, "runtime directory path too long");
    return 0;
}

int rekv_default_control_endpoint(char *buf, size_t len, rekv_err *err)
{
    char dir[4000];
    int rc = rekv_runtime_dir(dir, sizeof(dir), err);
    if (rc)
        return rc;
    int n = snprintf(buf, len, "ipc://%s/control", dir);
    if (n < 0 || (size_t)n >= len)
        return rekv_errf(err, -ENAMETOOLONG, "control endpoint path too long");
    return 0;
}

/* 1 when a process listens on the unix socket at path (a connect succeeds), else 0. */
static int unix_socket_listening(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path))
        return 0;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    int ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    return ok;
}

int rekv_client_control_endpoint(char *buf, size_t len, rekv_err *err)
{
    int rc = rekv_default_control_endpoint(buf, len, err);
    if (rc || strcmp(buf, "ipc://" REKV_SYSTEM_RUNTIME_DIR "/control") == 0)
        return rc;
    if (unix_socket_listening(buf + strlen("ipc://")) ||
        !unix_socket_listening(REKV_SYSTEM_RUNTIME_DIR "/control"))
        return 0;
    int n = snprintf(buf, len, "ipc://%s/control", REKV_SYSTEM_RUNTIME_DIR);
    if (n < 0 || (size_t)n >= len)
        return rekv_errf(err, -ENAMETOOLONG, "control endpoint path too long");
    return 0;
}

int rekv_ctl_connect(const char *endpoint, const char *curve_server_key, rekv_ctl **out,
                     rekv_err *err)
{
    return rekv_ctl_connect_in(NULL, endpoint, curve_server_key, out, err);
}

int rekv_ctl_connect_in(void *zctx, const char *endpoint, const char *curve_server_key,
                        rekv_ctl **out, rekv_err *err)
{
    char def[4100];
    int rc;
    if (endpoint == NULL) {
        if ((rc = rekv_client_control_endpoint(def, sizeof(def), err)))
            return rc;
        endpoint = def;
    }
    rekv_ctl *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    /* ids start from the clock so that two clients' ids are unlikely to collide in logs */
    c->next_id = rekv_now_ns() & 0xffffffffffull;
    c->own_ctx = zctx == NULL;
    c->zctx = zctx ? zctx : zmq_ctx_new();
    c->sock = c->zctx ? zmq_socket(c->zctx, ZMQ_DEALER) : NULL;
    if (c->sock == NULL) {
        rc = rekv_errf(err, -errno, "zmq socket: %s", zmq_strerror(errno));
        goto fail;
    }
    int linger = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof(linger));
    if (curve_server_key && (rc = rekv_curve_client(c->sock, curve_server_key, err)))
        goto fail;
    if (zmq_connect(c->sock, endpoint) != 0) {
        rc = rekv_errf(err, -errno, "%s: connect: %s", endpoint, zmq_strerror(errno));
        goto fail;
    }
    *out = c;
    return 0;
fail:
    rekv_ctl_close(c);
    return rc;
}

void rekv_ctl_close(rekv_ctl *c)
{
    if (c == NULL)
        return;
    if (c->sock)
        zmq_close(c->sock);
    if (c->zctx && c->own_ctx)
        zmq_ctx_term(c->zctx);
    free(c);
}

void *rekv_ctl_socket(rekv_ctl *c) { return c->sock; }

int rekv_ctl_send(rekv_ctl *c, Rekv__Control__Request *req, uint64_t *id, rekv_err *err)
{
    req->version = REKV_CONTROL_PROTO_VERSION;
    if (req->id == 0)
        req->id = ++c->next_id;
    if (id)
        *id = req->id;
    size_t n = rekv__control__request__get_packed_size(req);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    rekv__control__request__pack(req, buf);
    int rc = zmq_send(c->sock, buf, n, 0);
    free(buf);
    if (rc < 0)
        return rekv_errf(err, -errno, "control send: %s", zmq_strerror(errno));
    return 0;
}

int rekv_ctl_send_raw(rekv_ctl *c, const void *const *frames, const size_t *lens, size_t n,
                      rekv_err *err)
{
    for (size_t i = 0; i < n; i++)
        if (zmq_send(c->sock, frames[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0) < 0)
            return rekv_errf(err, -errno, "control send: %s", zmq_strerror(errno));
    return 0;
}

int rekv_ctl_recv(rekv_ctl *c, int timeout_ms, Rekv__Control__Response **resp, rekv_err *err)
{
    zmq_pollitem_t it = {c->sock, 0, ZMQ_POLLIN, 0};
    int r;
    do
        r = zmq_poll(&it, 1, timeout_ms);
    while (r < 0 && errno == EINTR);
    if (r < 0)
        return rekv_errf(err, -errno, "control poll: %s", zmq_strerror(errno));
    if (r == 0)
        return rekv_errf(err, -ETIMEDOUT, "no reply from the coordinator within %d ms",
                         timeout_ms);
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, c->sock, 0) < 0) {
        zmq_msg_close(&m);
        return rekv_errf(err, -errno, "control recv: %s", zmq_strerror(errno));
    }
    /* a well-behaved coordinator sends one frame; drain any others */
    int more = zmq_msg_more(&m);
    *resp = rekv__control__response__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
    zmq_msg_close(&m);
    while (more) {
        zmq_msg_init(&m);
        zmq_msg_recv(&m, c->sock, 0);
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    if (*resp == NULL)
        return rekv_errf(err, -EPROTO, "the coordinator's reply is not a Response message");
    return 0;
}

int rekv_ctl_call(rekv_ctl *c, Rekv__Control__Request *req, int timeout_ms,
                  Rekv__Control__Response **resp, rekv_err *err)
{
    uint64_t id;
    int rc = rekv_ctl_send(c, req, &id, err);
    if (rc)
        return rc;
    uint64_t deadline = rekv_now_ns() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000ull;
    for (;;) {
        int left = -1;
        if (timeout_ms >= 0) {
            uint64_t now = rekv_now_ns();
            left = now >= deadline ? 0 : (int)((deadline - now) / 1000000ull);
        }
        if ((rc = rekv_ctl_recv(c, left, resp, err)))
            return rc;
        if ((*resp)->id == id)
            return 0;
        rekv__control__response__free_unpacked(*resp, NULL);
        *resp = NULL;
    }
}

const char *rekv_ctl_state_name(Rekv__Control__JobState s)
{
    switch (s) {
    case REKV__CONTROL__JOB_STATE__QUEUED: return "queued";
    case REKV__CONTROL__JOB_STATE__RUNNING: return "running";
    case REKV__CONTROL__JOB_STATE__DONE: return "done";
    case REKV__CONTROL__JOB_STATE__CANCELLED: return "cancelled";
    case REKV__CONTROL__JOB_STATE__FAILED: return "failed";
    default: return "unknown";
    }
}

const char *rekv_ctl_code_name(Rekv__Control__Code c)
{
    switch (c) {
    case REKV__CONTROL__CODE__OK: return "ok";
    case REKV__CONTROL__CODE__BAD_REQUEST: return "bad request";
    case REKV__CONTROL__CODE__BUSY: return "busy";
    case REKV__CONTROL__CODE__NOT_FOUND: return "not found";
    case REKV__CONTROL__CODE__INTERNAL: return "internal error";
    case REKV__CONTROL__CODE__SHUTTING_DOWN: return "shutting down";
    default: return "unknown";
    }
}
