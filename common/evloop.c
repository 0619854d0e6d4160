/* evloop.c — the daemons' event loop (see evloop.h): an array of entries (a socket or an fd, the
 * events wanted, a callback) rebuilt into a zmq_pollitem_t array each round, after a wake eventfd
 * of its own (rekv_evloop_stop) and before the metrics server's fds; a small array of timers
 * scanned for the earliest; ids instead of pointers, so that a callback may add or remove entries
 * (the arrays grow, removed slots are compacted after the round) without the round losing its
 * place. Daemons hold a handful of entries and timers: linear scans are the simple way. */
#define _GNU_SOURCE
#include "common/evloop.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"

typedef struct ev_entry {
    int id; /* 0: removed (compacted after the round) */
    void *sock;
    int fd;
    short events;
    rekv_evloop_io_fn fn;         /* NULL for a signal fd */
    rekv_evloop_signal_fn sig_fn; /* a signal fd's (NULL: stop) */
    int is_signal;
    void *ctx;
} ev_entry;

typedef struct ev_timer {
    int id;                 /* 0: ended (compacted after the round) */
    uint64_t when;          /* due at this rekv_now_ns() */
    unsigned long long ran; /* the round it last ran in (or was added in): once a round at most */
    rekv_evloop_timer_fn fn;
    void *ctx;
} ev_timer;

struct rekv_evloop {
    ev_entry *e; /* [n_e] in the order added */
    int n_e, cap_e;
    ev_timer *t; /* [n_t] */
    int n_t, cap_t;
    int next_id;
    zmq_pollitem_t *items; /* [cap_items]: the wake fd, the polled entries, the metrics fds */
    int *item_id;          /* [cap_ids] the entry id of each item (0: not an entry's) */
    int cap_items, cap_ids;
    int wake_fd; /* eventfd written by rekv_evloop_stop */
    int stop;    /* set by rekv_evloop_stop (atomic: any thread, signal handlers) */
    unsigned long long rounds;
    rekv_evloop_hook_fn hook;
    void *hook_ctx;
    rekv_metrics_server *metrics;
    rekv_metrics_render_fn render;
    void *render_ctx;
    int m_fds[REKV_METRICS_MAX_FDS], m_n; /* the metrics fds of the last poll, and their */
    short m_ev[REKV_METRICS_MAX_FDS], m_rev[REKV_METRICS_MAX_FDS]; /* events, results */
};

static int stopped(const rekv_evloop *loop)
{
    return __atomic_load_n(&loop->stop, __ATOMIC_SEQ_CST);
}

int rekv_evloop_create(rekv_evloop **out, rekv_err *err)
{
    *out = NULL;
    rekv_evloop *loop = calloc(1, sizeof(*loop));
    if (loop == NULL)
        return rekv_errf(err, -ENOMEM, "evloop: out of memory");
    loop->next_id = 1;
    loop->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (loop->wake_fd < 0) {
        int e = errno;
        free(loop);
        return rekv_errf(err, -e, "evloop: eventfd: %s", strerror(e));
    }
    *out = loop;
    return 0;
}

void rekv_evloop_free(rekv_evloop *loop)
{
    if (loop == NULL)
        return;
    close(loop->wake_fd);
    free(loop->e);
    free(loop->t);
    free(loop->items);
    free(loop->item_id);
    free(loop);
}

static int grow(void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap)
        return 0;
    int n = *cap ? *cap * 2 : 8;
    while (n < need)
        n *= 2;
    void *q = realloc(*p, (size_t)n * elem);
    if (q == NULL)
        return -ENOMEM;
    *p = q;
    *cap = n;
    return 0;
}

static int add_entry(rekv_evloop *loop, const ev_entry *proto, rekv_err *err)
{
    if (grow((void **)&loop->e, &loop->cap_e, loop->n_e + 1, sizeof(ev_entry)))
        return rekv_errf(err, -ENOMEM, "evloop: out of memory");
    ev_entry *e = &loop->e[loop->n_e++];
    *e = *proto;
    e->id = loop->next_id++;
    return e->id;
}

int rekv_evloop_add_socket(rekv_evloop *loop, void *sock, short events, rekv_evloop_io_fn fn,
                           void *ctx, rekv_err *err)
{
    if (sock == NULL || fn == NULL)
        return rekv_errf(err, -EINVAL, "evloop: no socket or no callback");
    ev_entry e = {.sock = sock, .fd = -1, .events = events, .fn = fn, .ctx = ctx};
    return add_entry(loop, &e, err);
}

int rekv_evloop_add_fd(rekv_evloop *loop, int fd, short events, rekv_evloop_io_fn fn, void *ctx,
                       rekv_err *err)
{
    if (fd < 0 || fn == NULL)
        return rekv_errf(err, -EINVAL, "evloop: fd %d or no callback", fd);
    ev_entry e = {.fd = fd, .events = events, .fn = fn, .ctx = ctx};
    return add_entry(loop, &e, err);
}

static ev_entry *entry_of(rekv_evloop *loop, int id)
{
    for (int i = 0; i < loop->n_e; i++)
        if (id > 0 && loop->e[i].id == id)
            return &loop->e[i];
    return NULL;
}

int rekv_evloop_set_events(rekv_evloop *loop, int id, short events)
{
    ev_entry *e = entry_of(loop, id);
    if (e == NULL)
        return -ENOENT;
    e->events = events;
    return 0;
}

int rekv_evloop_del(rekv_evloop *loop, int id)
{
    ev_entry *e = entry_of(loop, id);
    if (e == NULL)
        return -ENOENT;
    e->id = 0;
    return 0;
}

/* A signal fd is readable: a signalfd gives a struct with the number, an eventfd a count. */
static void signal_ready(rekv_evloop *loop, const ev_entry *e)
{
    struct signalfd_siginfo si;
    ssize_t r = read(e->fd, &si, sizeof(si));
    if (r <= 0)
        return; /* already read: nothing came */
    int signo = r == (ssize_t)sizeof(si) ? (int)si.ssi_signo : 0;
    if (e->sig_fn)
        e->sig_fn(loop, e->ctx, signo);
    else
        rekv_evloop_stop(loop);
}

int rekv_evloop_add_signal_fd(rekv_evloop *loop, int fd, rekv_evloop_signal_fn fn, void *ctx,
                              rekv_err *err)
{
    if (fd < 0)
        return rekv_errf(err, -EINVAL, "evloop: signal fd %d", fd);
    ev_entry e = {.fd = fd, .events = ZMQ_POLLIN, .sig_fn = fn, .is_signal = 1, .ctx = ctx};
    return add_entry(loop, &e, err);
}

int rekv_evloop_timer_add(rekv_evloop *loop, long delay_ms, rekv_evloop_timer_fn fn, void *ctx,
                          rekv_err *err)
{
    if (fn == NULL || delay_ms < 0)
        return rekv_errf(err, -EINVAL, "evloop: timer without a callback or with delay %ld",
                         delay_ms);
    if (grow((void **)&loop->t, &loop->cap_t, loop->n_t + 1, sizeof(ev_timer)))
        return rekv_errf(err, -ENOMEM, "evloop: out of memory");
    ev_timer *t = &loop->t[loop->n_t++];
    *t = (ev_timer){.id = loop->next_id++,
                    .when = rekv_now_ns() + (uint64_t)delay_ms * 1000000ull,
                    .ran = loop->rounds, /* not in the round it is added in */
                    .fn = fn,
                    .ctx = ctx};
    return t->id;
}

static ev_timer *timer_of(rekv_evloop *loop, int id)
{
    for (int i = 0; i < loop->n_t; i++)
        if (id > 0 && loop->t[i].id == id)
            return &loop->t[i];
    return NULL;
}

int rekv_evloop_timer_set(rekv_evloop *loop, int id, long delay_ms)
{
    ev_timer *t = timer_of(loop, id);
    if (t == NULL || delay_ms < 0)
        return t ? -EINVAL : -ENOENT;
    t->when = rekv_now_ns() + (uint64_t)delay_ms * 1000000ull;
    return 0;
}

int rekv_evloop_timer_del(rekv_evloop *loop, int id)
{
    ev_timer *t = timer_of(loop, id);
    if (t == NULL)
        return -ENOENT;
    t->id = 0;
    return 0;
}

void rekv_evloop_before_sleep(rekv_evloop *loop, rekv_evloop_hook_fn fn, void *ctx)
{
    loop->hook = fn;
    loop->hook_ctx = ctx;
}

void rekv_evloop_serve_metrics(rekv_evloop *loop, rekv_metrics_server *srv,
                               rekv_metrics_render_fn render, void *ctx)
{
    loop->metrics = srv;
    loop->render = render;
    loop->render_ctx = ctx;
    loop->m_n = 0;
}

void rekv_evloop_stop(rekv_evloop *loop)
{
    __atomic_store_n(&loop->stop, 1, __ATOMIC_SEQ_CST);
    uint64_t one = 1;
    ssize_t w = write(loop->wake_fd, &one, sizeof(one));
    (void)w;
}

unsigned long long rekv_evloop_rounds(const rekv_evloop *loop)
{
    return loop->rounds;
}

/* Fills the poll items: the wake fd, every entry with events, the metrics server's fds; returns
 * how many, or -ENOMEM. */
static int build_items(rekv_evloop *loop)
{
    int m = 0;
    if (loop->metrics)
        m = rekv_metrics_server_fds(loop->metrics, loop->m_fds, loop->m_ev, REKV_METRICS_MAX_FDS);
    int need = 1 + loop->n_e + m;
    if (grow((void **)&loop->items, &loop->cap_items, need, sizeof(zmq_pollitem_t)) ||
        grow((void **)&loop->item_id, &loop->cap_ids, need, sizeof(int)))
        return -ENOMEM;
    int n = 0;
    loop->items[n] = (zmq_pollitem_t){NULL, loop->wake_fd, ZMQ_POLLIN, 0};
    loop->item_id[n++] = 0;
    for (int i = 0; i < loop->n_e; i++) {
        const ev_entry *e = &loop->e[i];
        if (e->id == 0 || e->events == 0)
            continue;
        loop->items[n] = (zmq_pollitem_t){e->sock, e->sock ? 0 : e->fd, e->events, 0};
        loop->item_id[n++] = e->id;
    }
    for (int k = 0; k < m; k++) {
        loop->items[n] = (zmq_pollitem_t){NULL, loop->m_fds[k], loop->m_ev[k], 0};
        loop->item_id[n++] = 0;
    }
    loop->m_n = m;
    return n;
}

/* Until the earliest timer is due (rounded up), at most a second with a metrics server; -1:
 * none. */
static long poll_timeout(const rekv_evloop *loop)
{
    long timeout = -1;
    uint64_t now = rekv_now_ns();
    for (int i = 0; i < loop->n_t; i++) {
        const ev_timer *t = &loop->t[i];
        if (t->id == 0)
            continue;
        long d = t->when > now ? (long)((t->when - now + 999999) / 1000000) : 0;
        if (timeout < 0 || d < timeout)
            timeout = d;
    }
    if (loop->metrics && (timeout < 0 || timeout > 1000))
        timeout = 1000;
    return timeout;
}

/* Calls the ready entries' callbacks in the order they were added (the items' order). */
static void dispatch(rekv_evloop *loop, int n_items)
{
    for (int k = 1; k < n_items && !stopped(loop); k++) {
        short rev = loop->items[k].revents;
        int id = loop->item_id[k];
        if (id == 0 || rev == 0)
            continue;
        ev_entry *e = entry_of(loop, id); /* NULL when a callback removed it */
        if (e == NULL)
            continue;
        ev_entry copy = *e; /* a callback may grow (move) the array */
        if (copy.is_signal)
            signal_ready(loop, &copy);
        else
            copy.fn(loop, copy.ctx, rev);
    }
}

/* Runs the due timers, earliest first, each at most once a round. */
static void run_timers(rekv_evloop *loop)
{
    uint64_t now = rekv_now_ns();
    while (!stopped(loop)) {
        ev_timer *best = NULL;
        for (int i = 0; i < loop->n_t; i++) {
            ev_timer *t = &loop->t[i];
            if (t->id == 0 || t->when > now || t->ran == loop->rounds)
                continue;
            if (best == NULL || t->when < best->when || (t->when == best->when && t->id < best->id))
                best = t;
        }
        if (best == NULL)
            return;
        best->ran = loop->rounds;
        int id = best->id;
        long next = best->fn(loop, best->ctx);
        ev_timer *t = timer_of(loop, id); /* NULL when it removed itself */
        if (t == NULL)
            continue;
        if (next < 0)
            t->id = 0;
        else
            t->when = rekv_now_ns() + (uint64_t)next * 1000000ull;
    }
}

/* Drops removed entries and ended timers, keeping the order. */
static void compact(rekv_evloop *loop)
{
    int j = 0;
    for (int i = 0; i < loop->n_e; i++)
        if (loop->e[i].id != 0)
            loop->e[j++] = loop->e[i];
    loop->n_e = j;
    j = 0;
    for (int i = 0; i < loop->n_t; i++)
        if (loop->t[i].id != 0)
            loop->t[j++] = loop->t[i];
    loop->n_t = j;
}

int rekv_evloop_run(rekv_evloop *loop, rekv_err *err)
{
    int rc = 0, m_ready = 0; /* m_ready: the metrics results of the last poll, to answer */
    while (!stopped(loop)) {
        if (loop->hook)
            loop->hook(loop, loop->hook_ctx);
        if (stopped(loop))
            break;
        if (loop->metrics) /* last of the round: a scrape sees what the round did */
            rekv_metrics_server_handle(loop->metrics, loop->m_fds, loop->m_rev, m_ready,
                                       loop->render, loop->render_ctx);
        int n = build_items(loop);
        if (n < 0) {
            rc = rekv_errf(err, n, "evloop: out of memory");
            break;
        }
        int r = zmq_poll(loop->items, n, poll_timeout(loop));
        loop->rounds++;
        m_ready = 0;
        if (r < 0) {
            int e = zmq_errno();
            if (e == EINTR)
                continue;
            rc = rekv_errf(err, -e, "zmq_poll: %s", zmq_strerror(e));
            break;
        }
        for (int k = 0; k < loop->m_n; k++)
            loop->m_rev[k] = loop->items[n - loop->m_n + k].revents;
        m_ready = loop->m_n;
        dispatch(loop, n - loop->m_n);
        run_timers(loop);
        compact(loop);
    }
    /* the stop is spent: the loop may run again */
    uint64_t v;
    ssize_t rd = read(loop->wake_fd, &v, sizeof(v));
    (void)rd;
    __atomic_store_n(&loop->stop, 0, __ATOMIC_SEQ_CST);
    compact(loop);
    return rc;
}
