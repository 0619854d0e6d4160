/* metrics.c — the Prometheus text-format builder and the scrape server described in metrics.h.
 * The server is libmicrohttpd with its own polling thread: HTTP itself (parsing, bounds,
 * timeouts, oversized or slow requests, closing without resetting an answer) is the library's,
 * and never waits on the daemon. The exposition is the daemon's state, which only its loop's
 * thread may read: a scrape asks for it through an eventfd the loop polls (the one fd
 * rekv_metrics_server_fds gives), the loop renders in rekv_metrics_server_handle and wakes the
 * waiting scrapes, and a scrape the loop does not answer within the server's timeout gets 503.
 * (libmicrohttpd's external-polling mode, driven from the loop, answered an oversized request
 * only at its connection's timeout, and its select mode cannot take fds past FD_SETSIZE.) */
#define _GNU_SOURCE
#include "common/metrics.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <time.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <microhttpd.h>
#include <zmq.h>

#include "common/clock.h"

/* ---------------------------------------------------------------- exposition text */

void rekv_metrics_buf_init(rekv_metrics_buf *b)
{
    memset(b, 0, sizeof(*b));
}

void rekv_metrics_buf_free(rekv_metrics_buf *b)
{
    if (b == NULL)
        return;
    for (size_t i = 0; i < b->n_families; i++)
        free(b->families[i]);
    free(b->families);
    free(b->data);
    rekv_metrics_buf_init(b);
}

static int buf_fail(rekv_metrics_buf *b, int code)
{
    if (b->err == 0)
        b->err = code;
    return b->err;
}

static int buf_reserve(rekv_metrics_buf *b, size_t more)
{
    if (b->len + more + 1 <= b->cap)
        return 0;
    if (b->len + more + 1 > REKV_METRICS_MAX_BODY)
        return buf_fail(b, -E2BIG);
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more + 1)
        cap *= 2;
    if (cap > REKV_METRICS_MAX_BODY)
        cap = REKV_METRICS_MAX_BODY;
    char *d = realloc(b->data, cap);
    if (d == NULL)
        return buf_fail(b, -ENOMEM);
    b->data = d;
    b->cap = cap;
    return 0;
}

static int buf_put(rekv_metrics_buf *b, const char *s, size_t n)
{
    if (buf_reserve(b, n))
        return b->err;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

static int buf_puts(rekv_metrics_buf *b, const char *s)
{
    return buf_put(b, s, strlen(s));
}

/* Appends s with backslash and newline escaped, and double quotes too when quotes is set. */
static int buf_escaped(rekv_metrics_buf *b, const char *s, int quotes)
{
    for (const char *p = s; *p; p++) {
        const char *r = NULL;
        if (*p == '\\')
            r = "\\\\";
        else if (*p == '\n')
            r = "\\n";
        else if (*p == '"' && quotes)
            r = "\\\"";
        if (r ? buf_puts(b, r) : buf_put(b, p, 1))
            return b->err;
    }
    return 0;
}

int rekv_metrics_name_valid(const char *s)
{
    if (s == NULL || *s == '\0')
        return 0;
    for (const char *p = s; *p; p++) {
        char c = *p;
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                 (p != s && c >= '0' && c <= '9');
        if (!ok)
            return 0;
    }
    return 1;
}

/* A label name: [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__" (reserved), n bytes at s. */
static int label_name_valid(const char *s, size_t n)
{
    if (n == 0 || (n >= 2 && s[0] == '_' && s[1] == '_'))
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                 (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return 0;
    }
    return 1;
}

/* A label set as written between braces: name="value"(,name="value")*. */
static int labels_valid(const char *s)
{
    const char *p = s;
    for (;;) {
        const char *eq = strchr(p, '=');
        if (eq == NULL || !label_name_valid(p, (size_t)(eq - p)) || eq[1] != '"')
            return 0;
        p = eq + 2;
        while (*p != '"') {
            if (*p == '\0' || *p == '\n')
                return 0;
            if (*p == '\\') {
                if (p[1] != '\\' && p[1] != '"' && p[1] != 'n')
                    return 0;
                p++;
            }
            p++;
        }
        p++;
        if (*p == '\0')
            return 1;
        if (*p != ',')
            return 0;
        p++;
    }
}

int rekv_metrics_family(rekv_metrics_buf *b, const char *name, const char *type, const char *help)
{
    if (b->err)
        return b->err;
    if (!rekv_metrics_name_valid(name) || type == NULL ||
        (strcmp(type, "counter") && strcmp(type, "gauge") && strcmp(type, "histogram") &&
         strcmp(type, "untyped")))
        return buf_fail(b, -EINVAL);
    int histogram = strcmp(type, "histogram") == 0;
    for (size_t i = 0; i < b->n_families; i++)
        if (strcmp(b->families[i], name) == 0)
            return i + 1 == b->n_families && histogram == b->cur_histogram ? 0
                                                                            : buf_fail(b, -EINVAL);
    if (b->n_families == b->cap_families) {
        size_t cap = b->cap_families ? b->cap_families * 2 : 32;
        char **f = realloc(b->families, cap * sizeof(*f));
        if (f == NULL)
            return buf_fail(b, -ENOMEM);
        b->families = f;
        b->cap_families = cap;
    }
    char *copy = strdup(name);
    if (copy == NULL)
        return buf_fail(b, -ENOMEM);
    b->families[b->n_families++] = copy;
    b->cur_histogram = histogram;
    buf_puts(b, "# HELP ");
    buf_puts(b, name);
    buf_puts(b, " ");
    buf_escaped(b, help ? help : "", 0);
    buf_puts(b, "\n# TYPE ");
    buf_puts(b, name);
    buf_puts(b, " ");
    buf_puts(b, type);
    return buf_puts(b, "\n");
}

/* The shortest of %.15g..%.17g that reads back as v; NaN and the infinities as the format spells
 * them. */
static void format_value(char *out, size_t n, double v)
{
    if (isnan(v)) {
        snprintf(out, n, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(out, n, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(out, n, "%.*g", prec, v);
        if (strtod(out, NULL) == v)
            return;
    }
}

/* Checks that name is the current family's. */
static int sample_begin(rekv_metrics_buf *b, const char *name)
{
    if (b->err)
        return b->err;
    if (b->n_families == 0 || name == NULL || b->cur_histogram ||
        strcmp(b->families[b->n_families - 1], name) != 0)
        return buf_fail(b, -EINVAL);
    return 0;
}

static int sample_end(rekv_metrics_buf *b, double value)
{
    char v[64];
    format_value(v, sizeof(v), value);
    buf_puts(b, " ");
    buf_puts(b, v);
    return buf_puts(b, "\n");
}

int rekv_metrics_sample(rekv_metrics_buf *b, const char *name, const char *labels, double value)
{
    if (sample_begin(b, name))
        return b->err;
    if (labels && *labels && !labels_valid(labels))
        return buf_fail(b, -EINVAL);
    buf_puts(b, name);
    if (labels && *labels) {
        buf_puts(b, "{");
        buf_puts(b, labels);
        buf_puts(b, "}");
    }
    return sample_end(b, value);
}

int rekv_metrics_sample_kv(rekv_metrics_buf *b, const char *name, double value, ...)
{
    if (sample_begin(b, name))
        return b->err;
    va_list ap;
    /* check every label name before writing anything, so a failure leaves no half line */
    va_start(ap, value);
    for (const char *k; (k = va_arg(ap, const char *)) != NULL;) {
        const char *v = va_arg(ap, const char *);
        if (!label_name_valid(k, strlen(k)) || v == NULL) {
            va_end(ap);
            return buf_fail(b, -EINVAL);
        }
    }
    va_end(ap);
    buf_puts(b, name);
    va_start(ap, value);
    int first = 1;
    for (const char *k; (k = va_arg(ap, const char *)) != NULL; first = 0) {
        const char *v = va_arg(ap, const char *);
        buf_puts(b, first ? "{" : ",");
        buf_puts(b, k);
        buf_puts(b, "=\"");
        buf_escaped(b, v, 1);
        buf_puts(b, "\"");
    }
    va_end(ap);
    if (!first)
        buf_puts(b, "}");
    return sample_end(b, value);
}

/* ---------------------------------------------------------------- histograms */

const double rekv_metrics_latency_bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                              0.05,   0.1,   0.25,   0.5,   1,    2.5,
                                              5,      10,    25,     50,    100};
const uint32_t rekv_metrics_latency_n_bounds =
    sizeof(rekv_metrics_latency_bounds) / sizeof(rekv_metrics_latency_bounds[0]);

int rekv_metrics_hist_init(rekv_metrics_hist *h, const double *bounds, uint32_t n_bounds)
{
    memset(h, 0, sizeof(*h));
    if (bounds == NULL || n_bounds == 0 || n_bounds > REKV_METRICS_MAX_BOUNDS)
        return -EINVAL;
    for (uint32_t i = 0; i < n_bounds; i++)
        if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
            return -EINVAL;
    h->bounds = bounds;
    h->n_bounds = n_bounds;
    return 0;
}

void rekv_metrics_hist_observe(rekv_metrics_hist *h, double v)
{
    if (isnan(v) || h->n_bounds == 0)
        return;
    uint32_t i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->count++;
    h->sum += v;
}

/* One line "name suffix{labels,le="le"} value", labels already checked. */
static void hist_line(rekv_metrics_buf *b, const char *name, const char *suffix, const char *labels,
                      const char *le, double value)
{
    buf_puts(b, name);
    buf_puts(b, suffix);
    int any = labels && *labels;
    if (any || le) {
        buf_puts(b, "{");
        if (any)
            buf_puts(b, labels);
        if (le) {
            buf_puts(b, any ? ",le=\"" : "le=\"");
            buf_puts(b, le);
            buf_puts(b, "\"");
        }
        buf_puts(b, "}");
    }
    sample_end(b, value);
}

int rekv_metrics_histogram(rekv_metrics_buf *b, const char *name, const char *labels,
                           const rekv_metrics_hist *h)
{
    if (b->err)
        return b->err;
    if (b->n_families == 0 || name == NULL || !b->cur_histogram ||
        strcmp(b->families[b->n_families - 1], name) != 0 || h->n_bounds == 0)
        return buf_fail(b, -EINVAL);
    if (labels && *labels) {
        /* "le" is the bucket's label: a set naming it too would be two le labels */
        if (!labels_valid(labels) || strncmp(labels, "le=", 3) == 0 || strstr(labels, ",le=\""))
            return buf_fail(b, -EINVAL);
    }
    uint64_t cum = 0;
    char le[64];
    for (uint32_t i = 0; i < h->n_bounds; i++) {
        cum += h->counts[i];
        format_value(le, sizeof(le), h->bounds[i]);
        hist_line(b, name, "_bucket", labels, le, (double)cum);
    }
    cum += h->counts[h->n_bounds];
    hist_line(b, name, "_bucket", labels, "+Inf", (double)cum);
    hist_line(b, name, "_sum", labels, NULL, h->sum);
    hist_line(b, name, "_count", labels, NULL, (double)h->count);
    return b->err;
}

/* ---------------------------------------------------------------- HTTP server */

struct rekv_metrics_server {
    struct MHD_Daemon *mhd; /* libmicrohttpd, on its own polling thread */
    int port;               /* the port bound */
    int wake_fd;            /* eventfd: a scrape asks the loop to render (the one fd it polls) */
    int timeout_ms;         /* how long a scrape waits for the loop */
    pthread_mutex_t mu;     /* guards what follows */
    pthread_cond_t cv;
    uint64_t asked, done;   /* renders asked for and made (a scrape waits until done >= its ask) */
    char *text;             /* the last render (NULL: it failed) */
    size_t len;
};

/* Splits "HOST:PORT", "[HOST]:PORT" or ":PORT" into host (empty for ":PORT") and port. */
static int parse_listen(const char *listen, char *host, size_t hn, char *port, size_t pn)
{
    const char *colon;
    if (listen == NULL || *listen == '\0')
        return -EINVAL;
    if (listen[0] == '[') {
        const char *end = strchr(listen, ']');
        if (end == NULL || end[1] != ':' || end == listen + 1)
            return -EINVAL;
        if ((size_t)(end - listen - 1) >= hn)
            return -EINVAL;
        memcpy(host, listen + 1, (size_t)(end - listen - 1));
        host[end - listen - 1] = '\0';
        colon = end + 1;
    } else {
        colon = strrchr(listen, ':');
        /* an IPv6 address needs its brackets */
        if (colon == NULL || (size_t)(colon - listen) >= hn ||
            memchr(listen, ':', (size_t)(colon - listen)))
            return -EINVAL;
        memcpy(host, listen, (size_t)(colon - listen));
        host[colon - listen] = '\0';
    }
    const char *p = colon + 1;
    size_t n = strlen(p);
    if (n == 0 || n > 5 || n >= pn || strspn(p, "0123456789") != n || atoi(p) > 65535)
        return -EINVAL;
    memcpy(port, p, n + 1);
    return 0;
}

/* A listening socket on ai, non-blocking; -errno. */
static int listen_on(const struct addrinfo *ai, int dual)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0)
        return -errno;
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6)
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, dual ? &zero : &one, sizeof(int));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0) {
        int e = -errno;
        close(fd);
        return e;
    }
    return fd;
}

/* 127.0.0.0/8, ::1, or ::ffff:127.0.0.0/104. */
static int addr_loopback(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)ss)->sin_addr.s_addr) >> 24) == 127;
    if (ss->ss_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)ss)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
    }
    return 0;
}

int rekv_listen_tcp(const char *listen, int allow_remote, const char *what, const char *remote_hint,
                    int *fd_out, int *port_out, rekv_err *err)
{
    char host[256], port[8];
    if (parse_listen(listen, host, sizeof(host), port, sizeof(port)))
        return rekv_errf(err, -EINVAL,
                         "%s: listen address '%s' is not HOST:PORT, [IPV6]:PORT or :PORT", what,
                         listen ? listen : "(null)");
    int fd = -1;
    if (host[0] == '\0') {
        /* every interface: IPv6 accepting IPv4 too, or IPv4 alone on hosts without IPv6 */
        struct addrinfo h6 = {.ai_family = AF_INET6,
                              .ai_socktype = SOCK_STREAM,
                              .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
        struct addrinfo h4 = h6, *ai = NULL;
        h4.ai_family = AF_INET;
        int e = -EADDRNOTAVAIL;
        if (getaddrinfo(NULL, port, &h6, &ai) == 0) {
            if ((fd = listen_on(ai, 1)) < 0)
                e = fd;
            freeaddrinfo(ai);
        }
        /* no IPv6 here (a port in use or a forbidden one is the same answer on IPv4) */
        if (fd < 0 && e != -EADDRINUSE && e != -EACCES && getaddrinfo(NULL, port, &h4, &ai) == 0) {
            if ((fd = listen_on(ai, 0)) < 0)
                e = fd;
            freeaddrinfo(ai);
        }
        if (fd < 0)
            return rekv_errf(err, e, "%s: listen on %s: %s", what, listen, strerror(-e));
    } else {
        struct addrinfo hints = {.ai_family = AF_UNSPEC,
                                 .ai_socktype = SOCK_STREAM,
                                 .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                        *ai = NULL;
        int g = getaddrinfo(host, port, &hints, &ai);
        if (g != 0)
            return rekv_errf(err, -EINVAL, "%s: listen address '%s': %s", what, listen,
                             gai_strerror(g));
        int e = -EADDRNOTAVAIL;
        for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next)
            if ((fd = listen_on(a, 0)) < 0)
                e = fd;
        freeaddrinfo(ai);
        if (fd < 0)
            return rekv_errf(err, e, "%s: listen on %s: %s", what, listen, strerror(-e));
    }

    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) < 0) {
        int e = -errno;
        close(fd);
        return rekv_errf(err, e, "%s: getsockname: %s", what, strerror(-e));
    }
    if (!allow_remote && !addr_loopback(&ss)) {
        close(fd);
        return rekv_errf(err, -EPERM,
                         "%s: %s is not a loopback address, and serving %s off this host must be "
                         "asked for (%s)",
                         what, host[0] ? host : listen, what, remote_hint);
    }
    *fd_out = fd;
    *port_out = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
    return 0;
}

static enum MHD_Result on_scrape(void *cls, struct MHD_Connection *c, const char *url,
                                 const char *method, const char *version, const char *upload,
                                 size_t *upload_size, void **con_cls);

int rekv_metrics_server_create(const char *listen, rekv_metrics_server **out, rekv_err *err)
{
    return rekv_metrics_server_create_opts(listen, NULL, out, err);
}

/* libmicrohttpd's messages: library code never prints. */
static void mhd_quiet(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    (void)fmt;
    (void)ap;
}

int rekv_metrics_server_create_opts(const char *listen, const rekv_metrics_server_opts *opts,
                                    rekv_metrics_server **out, rekv_err *err)
{
    *out = NULL;
    if (opts &&
        (opts->max_conns < 0 || opts->max_conns > REKV_METRICS_MAX_CONNS || opts->timeout_ms < 0))
        return rekv_errf(err, -EINVAL, "metrics: max_conns must be 0..%d and timeout_ms >= 0",
                         REKV_METRICS_MAX_CONNS);
    rekv_metrics_server *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return rekv_errf(err, -ENOMEM, "metrics: out of memory");
    int fd = -1;
    int rc = rekv_listen_tcp(listen, opts && opts->allow_remote, "metrics",
                             "--metrics-public; scrapes are not authenticated", &fd, &s->port,
                             err);
    if (rc) {
        free(s);
        return rc;
    }
    int ms = opts && opts->timeout_ms ? opts->timeout_ms : 5000;
    unsigned max_conns = (unsigned)(opts && opts->max_conns ? opts->max_conns
                                                            : REKV_METRICS_MAX_CONNS);
    s->timeout_ms = ms;
    s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    /* its own polling thread (poll: any fd number, and level-triggered — with epoll a request
     * cut short by a half-close waited for the timeout); the connections bounded and timed out */
    s->mhd = s->wake_fd < 0 ? NULL
                            : MHD_start_daemon(
                                  MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                                      MHD_USE_ERROR_LOG,
                                  0, NULL, NULL, on_scrape, s, MHD_OPTION_EXTERNAL_LOGGER,
                                  mhd_quiet, NULL, MHD_OPTION_LISTEN_SOCKET, fd,
                                  MHD_OPTION_CONNECTION_LIMIT, max_conns,
                                  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)((ms + 999) / 1000),
                                  MHD_OPTION_CONNECTION_MEMORY_LIMIT,
                                  (size_t)(2 * REKV_METRICS_MAX_REQUEST), MHD_OPTION_END);
    if (s->mhd == NULL) {
        close(fd);
        if (s->wake_fd >= 0)
            close(s->wake_fd);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return rekv_errf(err, -EIO, "metrics: libmicrohttpd did not start on %s", listen);
    }
    *out = s;
    return 0;
}

void rekv_metrics_server_free(rekv_metrics_server *s)
{
    if (s == NULL)
        return;
    MHD_stop_daemon(s->mhd); /* joins its thread; closes the connections and the listener */
    close(s->wake_fd);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s->text);
    free(s);
}

int rekv_metrics_server_port(const rekv_metrics_server *s)
{
    return s->port;
}

int rekv_metrics_server_conns(const rekv_metrics_server *s)
{
    const union MHD_DaemonInfo *di =
        MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
    return di ? (int)di->num_connections : 0;
}

int rekv_metrics_server_fds(const rekv_metrics_server *s, int *fds, short *events, int max)
{
    if (max < 1)
        return 0;
    fds[0] = s->wake_fd;
    events[0] = ZMQ_POLLIN;
    return 1;
}

/* A short answer (errors) or the exposition; every answer closes the connection. */
static enum MHD_Result queue(struct MHD_Connection *c, unsigned status, char *body, size_t n,
                             int must_free, const char *ctype)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(
        n, body, must_free ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (r == NULL) {
        if (must_free)
            free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result rc = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result error_answer(struct MHD_Connection *c, unsigned status)
{
    static char not_found[] = "not found: the metrics are at /metrics\n";
    static char not_allowed[] = "method not allowed: GET or HEAD /metrics\n";
    static char failed[] = "the metrics could not be rendered\n";
    static char busy[] = "the daemon did not render its metrics in time\n";
    static char malformed[] = "bad request\n";
    char *b = status == 404   ? not_found
              : status == 405 ? not_allowed
              : status == 400 ? malformed
              : status == 503 ? busy
                              : failed;
    return queue(c, status, b, strlen(b), 0, "text/plain; charset=utf-8");
}

static enum MHD_Result on_scrape(void *cls, struct MHD_Connection *c, const char *url,
                                 const char *method, const char *version, const char *upload,
                                 size_t *upload_size, void **con_cls)
{
    (void)version;
    (void)upload;
    rekv_metrics_server *s = cls;
    if (*con_cls == NULL) {
        /* answered on the first call, before any body is read */
        *con_cls = s;
        /* the absolute form (a proxy's "GET http://host:9464/metrics") names the same path */
        if (strncasecmp(url, "http://", 7) == 0) {
            url = strchr(url + 7, '/');
            if (url == NULL)
                return error_answer(c, 400);
        }
        if (strcmp(url, "/metrics") != 0)
            return error_answer(c, 404);
        if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
            return error_answer(c, 405);
        return MHD_YES;
    }
    if (*upload_size) {
        *upload_size = 0; /* a GET's body: ignored */
        return MHD_YES;
    }
    /* ask the loop for a render and wait for it (libmicrohttpd's thread: the daemon's state is
     * the loop's alone) */
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += s->timeout_ms / 1000;
    until.tv_nsec += (long)(s->timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&s->mu);
    uint64_t mine = ++s->asked, one = 1;
    ssize_t w = write(s->wake_fd, &one, sizeof(one));
    (void)w; /* a full counter is still readable: the loop wakes */
    int rc = 0;
    while (s->done < mine && rc == 0)
        rc = pthread_cond_timedwait(&s->cv, &s->mu, &until);
    int answered = s->done >= mine, ok = answered && s->text != NULL;
    char *text = ok ? malloc(s->len + 1) : NULL;
    size_t n = ok ? s->len : 0;
    if (text)
        memcpy(text, s->text, n);
    pthread_mutex_unlock(&s->mu);
    if (!answered)
        return error_answer(c, 503); /* the loop did not answer in time */
    if (text == NULL)
        return error_answer(c, 500);
    return queue(c, 200, text, n, 1, "text/plain; version=0.0.4; charset=utf-8");
}

void rekv_metrics_server_handle(rekv_metrics_server *s, const int *fds, const short *revents, int n,
                                rekv_metrics_render_fn render, void *ctx)
{
    int asked = 0;
    for (int i = 0; i < n; i++)
        asked |= fds[i] == s->wake_fd && (revents[i] & ZMQ_POLLIN);
    uint64_t count;
    if (!asked || read(s->wake_fd, &count, sizeof(count)) != (ssize_t)sizeof(count))
        return;
    /* one render answers every scrape waiting now (in the loop's thread: it reads its state) */
    rekv_metrics_buf b;
    rekv_metrics_buf_init(&b);
    int rc = render ? render(ctx, &b) : -EIO;
    char *text = NULL;
    size_t len = 0;
    if (rc >= 0 && !b.err) {
        text = b.data ? b.data : strdup("");
        len = b.data ? b.len : 0;
        b.data = NULL;
    }
    rekv_metrics_buf_free(&b);
    pthread_mutex_lock(&s->mu);
    free(s->text);
    s->text = text;
    s->len = len;
    s->done = s->asked;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}
