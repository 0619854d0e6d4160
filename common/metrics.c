/* metrics.c — the Prometheus text-format builder and the non-blocking HTTP/1.1 scrape server
 * described in metrics.h. The server keeps a fixed table of connections, each a small state
 * machine: READ (collect the request, validated line by line as it arrives so garbage is answered
 * at once), WRITE (send the status line, headers and body), DRAIN (after the answer, shut down our
 * side and read what the client still sends until it closes, so that closing does not reset the
 * connection under an answer the client has not read yet — a "lingering close"). */
#define _GNU_SOURCE
#include "common/metrics.h"

#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
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

#define ACCEPTS_PER_CALL 64       /* bounds the work of one handle call */
#define DRAIN_MS 1000             /* lingering close: how long we read after answering */
#define DRAIN_MAX (64u << 10)     /* and how much */
#define EMFILE_PAUSE_NS 100000000 /* out of fds: stop polling the listener this long */
#define HEAD_MAX 512              /* status line and headers (and the short error bodies) */

typedef enum conn_state {
    CONN_FREE = 0, /* slot unused */
    CONN_READ,     /* collecting the request */
    CONN_WRITE,    /* sending the answer */
    CONN_DRAIN,    /* answered, our side shut down: reading until the client closes */
} conn_state;

typedef struct conn {
    conn_state state;
    int fd;                             /* the connection; -1 while free */
    size_t n_req;                       /* bytes in req */
    size_t line;                        /* offset in req of the first line not yet parsed */
    int have_request_line;              /* the request line was parsed */
    int is_head;                        /* method HEAD: answer without the body */
    int status;                         /* the answer decided while reading (405/404), 0: none */
    char head[HEAD_MAX];                /* status line, headers, and for errors the body */
    size_t n_head;                      /* bytes in head */
    char *body;                         /* the 200 answer's body (malloc'd), else NULL */
    size_t n_body;                      /* bytes of body to send */
    size_t sent;                        /* bytes of head then body sent so far */
    size_t drained;                     /* bytes read and dropped in DRAIN */
    uint64_t deadline_ns;               /* monotonic: past it the connection is closed */
    size_t content_length;              /* the 200 answer's Content-Length (HEAD sends no body) */
    char req[REKV_METRICS_MAX_REQUEST]; /* the request bytes read so far (last: not cleared) */
} conn;

struct rekv_metrics_server {
    int listen_fd;         /* the listening socket, non-blocking */
    int port;              /* the port bound */
    int max_conns;         /* connections at most (<= REKV_METRICS_MAX_CONNS) */
    uint64_t timeout_ns;   /* request timeout, and answer timeout */
    uint64_t accept_pause; /* monotonic ns until which the listener is not polled (EMFILE) */
    int n_conns;           /* slots in use */
    conn conns[REKV_METRICS_MAX_CONNS]; /* the table; state CONN_FREE marks a free slot */
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

int rekv_metrics_server_create(const char *listen, rekv_metrics_server **out, rekv_err *err)
{
    return rekv_metrics_server_create_opts(listen, NULL, out, err);
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

int rekv_metrics_server_create_opts(const char *listen, const rekv_metrics_server_opts *opts,
                                    rekv_metrics_server **out, rekv_err *err)
{
    *out = NULL;
    if (opts &&
        (opts->max_conns < 0 || opts->max_conns > REKV_METRICS_MAX_CONNS || opts->timeout_ms < 0))
        return rekv_errf(err, -EINVAL, "metrics: max_conns must be 0..%d and timeout_ms >= 0",
                         REKV_METRICS_MAX_CONNS);
    int fd = -1, bound_port = 0;
    int rc = rekv_listen_tcp(listen, opts && opts->allow_remote, "metrics",
                             "--metrics-public; scrapes are not authenticated", &fd, &bound_port,
                             err);
    if (rc)
        return rc;
    rekv_metrics_server *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        close(fd);
        return rekv_errf(err, -ENOMEM, "metrics: out of memory");
    }
    s->listen_fd = fd;
    s->port = bound_port;
    s->max_conns = opts && opts->max_conns ? opts->max_conns : REKV_METRICS_MAX_CONNS;
    s->timeout_ns = (uint64_t)(opts && opts->timeout_ms ? opts->timeout_ms : 5000) * 1000000ull;
    for (int i = 0; i < REKV_METRICS_MAX_CONNS; i++)
        s->conns[i].fd = -1;
    *out = s;
    return 0;
}

static void conn_close(rekv_metrics_server *s, conn *c)
{
    close(c->fd);
    free(c->body);
    c->body = NULL;
    c->fd = -1;
    c->state = CONN_FREE;
    s->n_conns--;
}

void rekv_metrics_server_free(rekv_metrics_server *s)
{
    if (s == NULL)
        return;
    for (int i = 0; i < REKV_METRICS_MAX_CONNS; i++)
        if (s->conns[i].state != CONN_FREE)
            conn_close(s, &s->conns[i]);
    close(s->listen_fd);
    free(s);
}

int rekv_metrics_server_port(const rekv_metrics_server *s)
{
    return s->port;
}

int rekv_metrics_server_conns(const rekv_metrics_server *s)
{
    return s->n_conns;
}

int rekv_metrics_server_fds(const rekv_metrics_server *s, int *fds, short *events, int max)
{
    int n = 0;
    if (n < max && rekv_now_ns() >= s->accept_pause) {
        fds[n] = s->listen_fd;
        events[n++] = ZMQ_POLLIN;
    }
    for (int i = 0; i < REKV_METRICS_MAX_CONNS && n < max; i++) {
        const conn *c = &s->conns[i];
        if (c->state == CONN_FREE)
            continue;
        fds[n] = c->fd;
        events[n++] = c->state == CONN_WRITE ? ZMQ_POLLOUT : ZMQ_POLLIN;
    }
    return n;
}

static const char *reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 431:
        return "Request Header Fields Too Large";
    case 503:
        return "Service Unavailable";
    default:
        return "Internal Server Error";
    }
}

/* Fills c->head with an error answer (a one-line text body) and switches to WRITE. */
static void conn_answer_error(rekv_metrics_server *s, conn *c, int status)
{
    char body[64];
    int nb = snprintf(body, sizeof(body), "%d %s\n", status, reason(status));
    int n = snprintf(c->head, sizeof(c->head),
                     "HTTP/1.1 %d %s\r\n"
                     "Content-Type: text/plain; charset=utf-8\r\n"
                     "Content-Length: %d\r\n"
                     "%s"
                     "Connection: close\r\n\r\n%s",
                     status, reason(status), c->is_head ? 0 : nb,
                     status == 405 ? "Allow: GET, HEAD\r\n" : "", c->is_head ? "" : body);
    c->n_head = (size_t)n < sizeof(c->head) ? (size_t)n : sizeof(c->head) - 1;
    c->n_body = 0;
    c->sent = 0;
    c->state = CONN_WRITE;
    c->deadline_ns = rekv_now_ns() + s->timeout_ns;
}

static void conn_answer_metrics(rekv_metrics_server *s, conn *c, rekv_metrics_render_fn render,
                                void *ctx)
{
    rekv_metrics_buf b;
    rekv_metrics_buf_init(&b);
    if (render) {
        int rc = render(ctx, &b);
        if (rc < 0 || b.err) {
            rekv_metrics_buf_free(&b);
            conn_answer_error(s, c, 500);
            return;
        }
    }
    c->body = b.data; /* the text is ours now */
    c->content_length = b.len;
    c->n_body = c->is_head ? 0 : b.len;
    b.data = NULL;
    rekv_metrics_buf_free(&b);
    c->n_head = (size_t)snprintf(c->head, sizeof(c->head),
                                 "HTTP/1.1 200 OK\r\n"
                                 "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                                 "Content-Length: %zu\r\n"
                                 "Cache-Control: no-store\r\n"
                                 "Connection: close\r\n\r\n",
                                 c->content_length);
    c->sent = 0;
    c->state = CONN_WRITE;
    c->deadline_ns = rekv_now_ns() + s->timeout_ns;
}

/* RFC 9110 tchar. */
static int is_tchar(unsigned char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           (ch && strchr("!#$%&'*+-.^_`|~", ch) != NULL);
}

/* Bytes a request line or header may carry (besides the line end): visible ASCII, space, tab,
 * and in header values obs-text. */
static int line_bytes_ok(const char *p, size_t n, int request_line)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '\t' && !request_line)
            continue;
        if (ch < 0x20 || ch == 0x7f || (ch >= 0x80 && request_line))
            return 0;
    }
    return 1;
}

/* Parses "METHOD SP TARGET SP HTTP/1.x"; sets c->is_head and c->status (404/405 decided now,
 * answered when the headers end). Returns 0, or 400 when malformed. */
static int parse_request_line(conn *c, const char *p, size_t n)
{
    const char *sp1 = memchr(p, ' ', n);
    if (sp1 == NULL || sp1 == p || sp1 - p > 32)
        return 400;
    size_t nm = (size_t)(sp1 - p);
    for (size_t i = 0; i < nm; i++)
        if (!is_tchar((unsigned char)p[i]))
            return 400;
    const char *t = sp1 + 1, *end = p + n;
    const char *sp2 = memchr(t, ' ', (size_t)(end - t));
    if (sp2 == NULL || sp2 == t)
        return 400;
    size_t nv = (size_t)(end - sp2 - 1);
    if (nv != 8 || (memcmp(sp2 + 1, "HTTP/1.1", 8) && memcmp(sp2 + 1, "HTTP/1.0", 8)))
        return 400;
    /* absolute-form (http://host/path): skip to the path */
    size_t nt = (size_t)(sp2 - t);
    static const char *const schemes[] = {"http://", "https://"};
    for (int k = 0; k < 2; k++) {
        size_t ns = strlen(schemes[k]);
        if (nt >= ns && strncasecmp(t, schemes[k], ns) == 0) {
            const char *slash = memchr(t + ns, '/', nt - ns);
            if (slash == NULL)
                return 400;
            nt -= (size_t)(slash - t);
            t = slash;
            break;
        }
    }
    if (t[0] != '/')
        return 400;
    for (size_t i = 0; i < nt; i++)
        if (t[i] == '?' || t[i] == '#') {
            nt = i;
            break;
        }
    int get = nm == 3 && memcmp(p, "GET", 3) == 0;
    c->is_head = nm == 4 && memcmp(p, "HEAD", 4) == 0;
    int metrics = nt == 8 && memcmp(t, "/metrics", 8) == 0;
    c->status = !metrics ? 404 : (get || c->is_head) ? 200 : 405;
    return 0;
}

/* A header line "name: value". */
static int header_ok(const char *p, size_t n)
{
    const char *colon = memchr(p, ':', n);
    if (colon == NULL || colon == p)
        return 0;
    for (const char *q = p; q < colon; q++)
        if (!is_tchar((unsigned char)*q))
            return 0;
    return 1;
}

/* Parses the complete lines received since last time. Returns the status to answer with once the
 * request is complete or known bad, 0 while more is needed. */
static int conn_parse(conn *c)
{
    for (;;) {
        const char *start = c->req + c->line;
        size_t avail = c->n_req - c->line;
        const char *nl = memchr(start, '\n', avail);
        if (nl == NULL) {
            /* a partial line: reject garbage now rather than at the size limit */
            size_t n = avail && start[avail - 1] == '\r' ? avail - 1 : avail;
            if (!line_bytes_ok(start, n, !c->have_request_line))
                return 400;
            return c->n_req == sizeof(c->req) ? 431 : 0;
        }
        size_t n = (size_t)(nl - start);
        if (n && start[n - 1] == '\r')
            n--;
        c->line += (size_t)(nl - start) + 1;
        if (!line_bytes_ok(start, n, !c->have_request_line))
            return 400;
        if (!c->have_request_line) {
            if (n == 0) {
                if (c->line > 4) /* a few empty lines before the request are tolerated */
                    return 400;
                continue;
            }
            int bad = parse_request_line(c, start, n);
            if (bad)
                return bad;
            c->have_request_line = 1;
            continue;
        }
        if (n == 0)
            return c->status;
        if (start[0] == ' ' || start[0] == '\t' || !header_ok(start, n))
            return 400; /* obsolete line folding, or not a header */
    }
}

/* Sends what the socket takes; switches to DRAIN (or closes) when all is sent. */
static void conn_write(rekv_metrics_server *s, conn *c)
{
    while (c->state == CONN_WRITE) {
        size_t total = c->n_head + c->n_body;
        if (c->sent >= total) {
            shutdown(c->fd, SHUT_WR);
            c->state = CONN_DRAIN;
            c->drained = 0;
            uint64_t drain = (uint64_t)DRAIN_MS * 1000000ull;
            c->deadline_ns = rekv_now_ns() + (drain < s->timeout_ns ? drain : s->timeout_ns);
            return;
        }
        struct iovec iov[2];
        int niov = 0;
        if (c->sent < c->n_head)
            iov[niov++] = (struct iovec){c->head + c->sent, c->n_head - c->sent};
        size_t boff = c->sent > c->n_head ? c->sent - c->n_head : 0;
        if (c->n_body > boff)
            iov[niov++] = (struct iovec){c->body + boff, c->n_body - boff};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
        ssize_t w = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                conn_close(s, c);
            return;
        }
        c->sent += (size_t)w;
    }
}

/* Reads and drops what the client still sends after the answer; closes at its EOF. */
static void conn_drain(rekv_metrics_server *s, conn *c)
{
    char scratch[4096];
    for (;;) {
        ssize_t r = recv(c->fd, scratch, sizeof(scratch), MSG_DONTWAIT);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r <= 0 || (c->drained += (size_t)r) > DRAIN_MAX) {
            conn_close(s, c);
            return;
        }
    }
}

static void conn_read(rekv_metrics_server *s, conn *c, rekv_metrics_render_fn render, void *ctx)
{
    while (c->state == CONN_READ) {
        ssize_t r = recv(c->fd, c->req + c->n_req, sizeof(c->req) - c->n_req, MSG_DONTWAIT);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (r <= 0) { /* the client went away before finishing its request */
            conn_close(s, c);
            return;
        }
        c->n_req += (size_t)r;
        int status = conn_parse(c);
        if (status == 200)
            conn_answer_metrics(s, c, render, ctx);
        else if (status)
            conn_answer_error(s, c, status);
    }
    conn_write(s, c);
    if (c->state == CONN_DRAIN)
        conn_drain(s, c);
}

static void conn_io(rekv_metrics_server *s, conn *c, rekv_metrics_render_fn render, void *ctx)
{
    switch (c->state) {
    case CONN_READ:
        conn_read(s, c, render, ctx);
        break;
    case CONN_WRITE:
        conn_write(s, c);
        if (c->state == CONN_DRAIN)
            conn_drain(s, c);
        break;
    case CONN_DRAIN:
        conn_drain(s, c);
        break;
    case CONN_FREE:
        break;
    }
}

static void accept_some(rekv_metrics_server *s, rekv_metrics_render_fn render, void *ctx)
{
    static const char busy[] = "HTTP/1.1 503 Service Unavailable\r\n"
                               "Content-Type: text/plain; charset=utf-8\r\n"
                               "Content-Length: 24\r\n"
                               "Connection: close\r\n\r\n"
                               "503 Service Unavailable\n";
    for (int k = 0; k < ACCEPTS_PER_CALL; k++) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                s->accept_pause = rekv_now_ns() + EMFILE_PAUSE_NS;
            return; /* EAGAIN, or nothing better to do */
        }
        if (s->n_conns >= s->max_conns) {
            ssize_t w = send(fd, busy, sizeof(busy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)w; /* best effort */
            close(fd);
            continue;
        }
        conn *c = NULL;
        for (int i = 0; i < REKV_METRICS_MAX_CONNS && c == NULL; i++)
            if (s->conns[i].state == CONN_FREE)
                c = &s->conns[i];
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        memset(c, 0, offsetof(conn, req)); /* the request buffer needs no clearing */
        c->fd = fd;
        c->state = CONN_READ;
        c->deadline_ns = rekv_now_ns() + s->timeout_ns;
        s->n_conns++;
        conn_read(s, c, render, ctx); /* the request is often there already */
    }
}

void rekv_metrics_server_handle(rekv_metrics_server *s, const int *fds, const short *revents, int n,
                                rekv_metrics_render_fn render, void *ctx)
{
    int listener_ready = 0;
    /* connections first: slots closed here are reused only by the accepts below, so an fd number
     * in fds[] never reaches a connection it was not polled for */
    for (int i = 0; i < n; i++) {
        if (revents[i] == 0)
            continue;
        if (fds[i] == s->listen_fd) {
            listener_ready = 1;
            continue;
        }
        for (int k = 0; k < REKV_METRICS_MAX_CONNS; k++)
            if (s->conns[k].state != CONN_FREE && s->conns[k].fd == fds[i]) {
                conn_io(s, &s->conns[k], render, ctx);
                break;
            }
    }
    if (listener_ready)
        accept_some(s, render, ctx);
    uint64_t now = rekv_now_ns();
    for (int k = 0; k < REKV_METRICS_MAX_CONNS; k++) {
        conn *c = &s->conns[k];
        if (c->state == CONN_FREE || now < c->deadline_ns)
            continue;
        if (c->state == CONN_READ && c->n_req > 0) {
            conn_answer_error(s, c, 408); /* best effort; closed if it does not go out now */
            conn_write(s, c);
            if (c->state == CONN_WRITE)
                conn_close(s, c);
        } else {
            conn_close(s, c);
        }
    }
}
