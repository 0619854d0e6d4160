/* http_bridge.c — the HTTP server's one thread that talks to the coordinator: one DEALER to the
 * control socket for every request, so that a streamed token costs the server a message taken off
 * a queue it already drains, not a thread woken for it.
 *
 * Data flow: libmicrohttpd's single polling thread (http.c, http_gen.c) parses a request into an
 * hgen and hands it over (http_bridge_submit: queued, the bridge woken through an eventfd, the
 * connection suspended). The bridge sends its Submits (or its Health), takes every reply and
 * StreamEvent off the DEALER, routes each by its request id (a hash table of jobs) into its
 * request's state, and after draining all that has come (a step's events for every stream
 * together) resumes the connections that have something to do: one wakeup of libmicrohttpd's
 * thread per drain, not one thread switch per token and connection. A suspended connection is
 * not watched by libmicrohttpd, so the bridge watches each running request's socket for the
 * client's going away (EPOLLRDHUP) and cancels its jobs at once. When a request ends
 * (libmicrohttpd's completion notification: http_bridge_finish) the bridge cancels what still
 * runs and frees it; only the bridge frees a request it was handed.
 *
 * What the thread-per-connection server did, it still does: a Submit or subscription without an
 * answer for a while is sent again under the same request id and client key (one job, never two;
 * a coordinator that restarted re-subscribes it from the tokens had), a Cancel until answered,
 * and a Health waits HB_HEALTH_NS at most. Everything shared with libmicrohttpd's thread is under
 * srv->mu, which the bridge holds while it works through a wakeup. */
#define _GNU_SOURCE
#include "coordinator/http_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"

#define HB_BUCKETS 4096 /* the request-id table's chains (a power of two) */
#define HB_SUBMIT_SILENCE_NS 5000000000ull /* unanswered Submits are sent again after this */
#define HB_STREAM_SILENCE_NS 10000000000ull /* a silent running request re-subscribes */
#define HB_HEALTH_NS 5000000000ull          /* a Health without answer: 503 */
#define HB_CANCEL_NS 5000000000ull          /* an unanswered Cancel is sent again */
#define HB_TICK_MS 500                      /* how often the silences are looked at */

typedef struct hcancel {
    uint64_t rq, job, sent_ns;
} hcancel;

struct hbridge {
    struct rekv_http *h;
    pthread_t thr;
    int started;
    int ep;      /* epoll: the eventfd, the DEALER's ZMQ_FD, running requests' sockets */
    int evfd;    /* written when the queue gets a request, or to quit */
    rekv_ctl *ctl;
    void *sock;  /* ctl's DEALER */
    /* under srv->mu */
    int quit;
    hgen *q_head, *q_tail; /* requests to take up (new, or ended) */
    hgen *all;             /* every request handed over and not yet freed */
    /* the bridge thread's own */
    hjob *table[HB_BUCKETS]; /* jobs by request id */
    hcancel *cancels;        /* Cancels sent and not yet answered */
    size_t n_cancels, cap_cancels;
    hgen **touched; /* requests something happened to in this round */
    size_t n_touched, cap_touched;
    Rekv__Control__Response **msgs; /* this round's messages, taken off the DEALER */
    size_t n_msgs, cap_msgs;
    struct MHD_Connection **resume; /* this round's connections to resume */
    size_t n_resume, cap_resume;
    atomic_int resuming; /* resume[] is being worked through, outside mu */
    uint64_t next_tick;
};

static const char the_dealer = 0; /* the DEALER's epoll tag (the eventfd's is the bridge) */

/* ---------------------------------------------------------------- tables */

static hjob **bucket(struct hbridge *b, uint64_t rq) { return &b->table[rq & (HB_BUCKETS - 1)]; }

static void table_add(struct hbridge *b, hjob *j)
{
    hjob **p = bucket(b, j->rq);
    j->hnext = *p;
    *p = j;
}

static hjob *table_find(struct hbridge *b, uint64_t rq)
{
    for (hjob *j = *bucket(b, rq); j; j = j->hnext)
        if (j->rq == rq)
            return j;
    return NULL;
}

static void table_del(struct hbridge *b, hjob *j)
{
    for (hjob **p = bucket(b, j->rq); *p; p = &(*p)->hnext)
        if (*p == j) {
            *p = j->hnext;
            return;
        }
}

/* Room for one more in an array of pointers; 0, or -ENOMEM. */
static int grow(void *arr, size_t n, size_t *cap)
{
    void ***a = arr;
    if (n < *cap)
        return 0;
    size_t c = *cap ? 2 * *cap : 64;
    void **t = realloc(*a, c * sizeof(void *));
    if (t == NULL)
        return -ENOMEM;
    *a = t;
    *cap = c;
    return 0;
}

static void touch(struct hbridge *b, hgen *g)
{
    if (g->touched || grow(&b->touched, b->n_touched, &b->cap_touched))
        return; /* (out of memory: its timers look at it again) */
    g->touched = 1;
    b->touched[b->n_touched++] = g;
}

static void enqueue(struct hbridge *b, hgen *g)
{
    if (g->queued)
        return;
    g->queued = 1;
    g->qnext = NULL;
    if (b->q_tail)
        b->q_tail->qnext = g;
    else
        b->q_head = g;
    b->q_tail = g;
}

static void wake(struct hbridge *b)
{
    uint64_t one = 1;
    ssize_t n = write(b->evfd, &one, sizeof(one));
    (void)n; /* a full counter is already a wakeup */
}

/* ---------------------------------------------------------------- sending */

static void send_submit(struct hbridge *b, hjob *j)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &j->sub;
    rq.id = j->rq; /* 0 the first time: a fresh id; again: the same one */
    j->sub.stream_from = j->next;
    int fresh = j->rq == 0;
    rekv_err err = {0};
    if (rekv_ctl_send(b->ctl, &rq, &j->rq, &err) == 0) {
        if (fresh)
            table_add(b, j);
        return;
    }
    if (fresh && !j->refused) { /* never sent: refused here, as the coordinator would */
        hgen *g = j->g;
        j->rq = 0;
        j->refused = 1;
        g->n_answered++;
        if (g->refuse_status == 0) {
            g->refuse_status = 500;
            snprintf(g->refuse_msg, sizeof(g->refuse_msg), "%s", err.msg);
        }
        touch(b, g);
    }
}

static void send_cancel(struct hbridge *b, uint64_t job, uint64_t rqid)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__Cancel c = REKV__CONTROL__CANCEL__INIT;
    c.job = job;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    rq.cancel = &c;
    rq.id = rqid;
    uint64_t id = 0;
    rekv_ctl_send(b->ctl, &rq, &id, NULL); /* one that did not go out is resent as if lost */
    if (rqid != 0 || id == 0)
        return; /* a resend: already in the list */
    if (b->n_cancels == b->cap_cancels) {
        size_t cap = b->cap_cancels ? 2 * b->cap_cancels : 16;
        hcancel *t = realloc(b->cancels, cap * sizeof(*t));
        if (t == NULL)
            return;
        b->cancels = t;
        b->cap_cancels = cap;
    }
    b->cancels[b->n_cancels++] = (hcancel){id, job, rekv_now_ns()};
}

/* The client went away or its request ended: the jobs accepted and still running stop now, not
 * at max_tokens (unless the server stops: its jobs are left to the coordinator). */
static void cancel_running(struct hbridge *b, hgen *g)
{
    if (atomic_load(&b->h->stopping) || g->kind != HG_GEN)
        return;
    for (int i = 0; i < g->n_jobs; i++) {
        hjob *j = &g->jobs[i];
        if (j->job && !j->done && !j->cancel_sent) {
            j->cancel_sent = 1;
            send_cancel(b, j->job, 0);
        }
    }
}

static void health_ask(struct hbridge *b, hgen *g)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__HealthRequest hr = REKV__CONTROL__HEALTH_REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_HEALTH;
    rq.health = &hr;
    rekv_err err = {0};
    g->asked_ns = rekv_now_ns();
    if (rekv_ctl_send(b->ctl, &rq, &g->jobs[0].rq, &err) == 0) {
        table_add(b, &g->jobs[0]);
        return;
    }
    g->jobs[0].rq = 0;
    g->health_done = 1;
    snprintf(g->health_err, sizeof(g->health_err), "%.180s", err.msg);
    touch(b, g);
}

/* ---------------------------------------------------------------- taking up requests */

static void watch(struct hbridge *b, hgen *g)
{
    struct epoll_event ev = {.events = EPOLLRDHUP, .data.ptr = g};
    if (g->fd >= 0 && epoll_ctl(b->ep, EPOLL_CTL_ADD, g->fd, &ev) == 0)
        g->watched = 1;
}

static void unwatch(struct hbridge *b, hgen *g)
{
    if (g->watched)
        epoll_ctl(b->ep, EPOLL_CTL_DEL, g->fd, NULL);
    g->watched = 0;
}

/* The queue: new requests' Submits go out (and their sockets are watched: under mu, so before an
 * end that would close them), ended ones are looked at in this round's end. */
static void take_queue(struct hbridge *b)
{
    while (b->q_head) {
        hgen *g = b->q_head;
        b->q_head = g->qnext;
        if (b->q_head == NULL)
            b->q_tail = NULL;
        g->queued = 0;
        if (g->want_new && !g->want_finish) {
            g->heard_ns = rekv_now_ns();
            if (g->kind == HG_HEALTH) {
                health_ask(b, g);
            } else {
                watch(b, g);
                for (int i = 0; i < g->n_jobs; i++)
                    send_submit(b, &g->jobs[i]);
            }
        }
        g->want_new = 0;
        touch(b, g);
    }
}

/* ---------------------------------------------------------------- receiving */

static void take_health(hgen *g, const Rekv__Control__Response *resp)
{
    if (g->health_done)
        return;
    g->health_done = 1;
    g->health_replied = 1;
    if (resp->body_case == REKV__CONTROL__RESPONSE__BODY_HEALTH) {
        g->health_serving = resp->health->serving;
        g->health_workers = resp->health->workers;
    }
}

/* One message from the coordinator into its request's state. */
static void route(struct hbridge *b, const Rekv__Control__Response *resp, uint64_t now)
{
    hjob *j = table_find(b, resp->id);
    if (j == NULL) { /* a Cancel's answer, or a message for a request already freed */
        for (size_t i = 0; i < b->n_cancels; i++)
            if (b->cancels[i].rq == resp->id) {
                b->cancels[i] = b->cancels[--b->n_cancels];
                break;
            }
        return;
    }
    hgen *g = j->g;
    g->heard_ns = now;
    touch(b, g);
    if (g->kind == HG_HEALTH) {
        take_health(g, resp);
        return;
    }
    if (resp->code != REKV__CONTROL__CODE__OK) {
        if (j->job == 0 && !j->refused) {
            j->refused = 1;
            g->n_answered++;
            if (g->refuse_status == 0) {
                g->refuse_status = http_status_of_code(resp->code);
                snprintf(g->refuse_msg, sizeof(g->refuse_msg), "%s",
                         resp->error ? resp->error : "refused");
            }
        }
    } else if (resp->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
        if (j->job == 0 && !j->refused) {
            j->job = resp->submitted->job;
            j->prompt_tokens = resp->submitted->prompt_tokens;
            g->n_answered++;
        }
    } else if (resp->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT) {
        http_gen_take_event(g, j, resp->event);
        j->dirty = 1;
    }
}

/* Everything the DEALER holds now, unpacked into b->msgs (without mu: libmicrohttpd's thread
 * goes on meanwhile). */
static void drain(struct hbridge *b)
{
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, b->sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            if (errno == EINTR)
                continue;
            return;
        }
        int more = zmq_msg_more(&m);
        Rekv__Control__Response *resp =
            rekv__control__response__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
        zmq_msg_close(&m);
        while (more) { /* a well-behaved coordinator sends one frame */
            zmq_msg_init(&m);
            zmq_msg_recv(&m, b->sock, 0);
            more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (resp == NULL)
            continue;
        if (grow(&b->msgs, b->n_msgs, &b->cap_msgs)) {
            rekv__control__response__free_unpacked(resp, NULL); /* as if lost: resent */
            continue;
        }
        b->msgs[b->n_msgs++] = resp;
    }
}

/* ---------------------------------------------------------------- timers, ends */

static void free_request(struct hbridge *b, hgen *g)
{
    unwatch(b, g);
    for (int i = 0; i < g->n_jobs; i++)
        if (g->jobs[i].rq)
            table_del(b, &g->jobs[i]);
    if (g->prev)
        g->prev->next = g->next;
    else
        b->all = g->next;
    if (g->next)
        g->next->prev = g->prev;
    http_gen_free(g);
}

/* Submits sent and not answered: an ended request waits for them, to cancel their jobs. */
static int awaiting(const hgen *g)
{
    int n = 0;
    for (int i = 0; g->kind == HG_GEN && i < g->n_jobs; i++)
        n += g->jobs[i].rq && !g->jobs[i].job && !g->jobs[i].refused;
    return n;
}

static void resend_quiet(struct hbridge *b, hgen *g, uint64_t now)
{
    if (g->kind == HG_HEALTH) {
        if (!g->health_done && now - g->asked_ns >= HB_HEALTH_NS) {
            g->health_done = 1;
            snprintf(g->health_err, sizeof(g->health_err),
                     "no reply from the coordinator within %llu ms",
                     (unsigned long long)(HB_HEALTH_NS / 1000000));
            touch(b, g);
        }
        return;
    }
    int answering = awaiting(g) > 0;
    if (now - g->heard_ns < (answering ? HB_SUBMIT_SILENCE_NS : HB_STREAM_SILENCE_NS))
        return;
    if (!answering && (g->n_done == g->n_jobs || g->gone || g->want_finish))
        return;
    g->heard_ns = now;
    for (int i = 0; i < g->n_jobs; i++) {
        hjob *j = &g->jobs[i];
        if (j->rq && !j->refused && !j->done && (answering ? j->job == 0 : 1))
            send_submit(b, j);
    }
}

static void tick(struct hbridge *b, uint64_t now)
{
    if (atomic_load(&b->h->stopping))
        return; /* waits end now; nothing is asked again */
    for (hgen *g = b->all; g; g = g->next)
        if (!g->want_new)
            resend_quiet(b, g, now);
    for (size_t i = 0; i < b->n_cancels; i++)
        if (now - b->cancels[i].sent_ns >= HB_CANCEL_NS) {
            b->cancels[i].sent_ns = now;
            send_cancel(b, b->cancels[i].job, b->cancels[i].rq);
        }
}

/* The round's end: what happened to each request, acted on. */
static void settle(struct hbridge *b)
{
    for (size_t i = 0; i < b->n_touched; i++) {
        hgen *g = b->touched[i];
        g->touched = 0;
        if (g->gone || g->want_finish)
            cancel_running(b, g);
        if (g->want_finish) {
            if (awaiting(g) == 0 || atomic_load(&b->h->stopping))
                free_request(b, g);
            continue;
        }
        if (g->suspended && http_gen_ready(g) &&
            grow(&b->resume, b->n_resume, &b->cap_resume) == 0) {
            g->suspended = 0; /* resumed after mu is let go (only the bridge frees g) */
            b->resume[b->n_resume++] = g->conn;
        }
    }
    b->n_touched = 0;
}

/* One round: the queue, the silences, the messages, under mu; then the resumes without it, all
 * together (libmicrohttpd's thread wakes once for them, and never waits on mu for them). */
static int round_once(struct hbridge *b, struct epoll_event *evs, int n)
{
    struct rekv_http *h = b->h;
    drain(b);
    pthread_mutex_lock(&h->mu);
    if (b->quit) {
        pthread_mutex_unlock(&h->mu);
        return 1;
    }
    for (int i = 0; i < n; i++) {
        if (evs[i].data.ptr == b || evs[i].data.ptr == &the_dealer)
            continue;
        hgen *g = evs[i].data.ptr; /* its client closed (or reset) the connection */
        g->gone = 1;
        unwatch(b, g);
        touch(b, g);
    }
    take_queue(b);
    uint64_t now = rekv_now_ns();
    if (now >= b->next_tick) {
        tick(b, now);
        b->next_tick = now + HB_TICK_MS * 1000000ull;
    }
    for (size_t i = 0; i < b->n_msgs; i++)
        route(b, b->msgs[i], now);
    settle(b);
    if (b->n_resume)
        atomic_store(&b->resuming, 1);
    pthread_mutex_unlock(&h->mu);
    for (size_t i = 0; i < b->n_resume; i++)
        MHD_resume_connection(b->resume[i]);
    if (b->n_resume)
        atomic_store(&b->resuming, 0);
    b->n_resume = 0;
    for (size_t i = 0; i < b->n_msgs; i++)
        rekv__control__response__free_unpacked(b->msgs[i], NULL);
    b->n_msgs = 0;
    return 0;
}

static void *bridge_main(void *arg)
{
    struct hbridge *b = arg;
    struct epoll_event evs[64];
    for (;;) {
        /* ZMQ_FD signals only what comes after the socket was last found empty: a send (or
         * anything) since may have taken the signal of a message now waiting */
        int zev = 0;
        size_t zl = sizeof(zev);
        zmq_getsockopt(b->sock, ZMQ_EVENTS, &zev, &zl);
        int n = epoll_wait(b->ep, evs, 64, (zev & ZMQ_POLLIN) ? 0 : HB_TICK_MS);
        for (int i = 0; i < n; i++)
            if (evs[i].data.ptr == b) {
                uint64_t v;
                ssize_t r = read(b->evfd, &v, sizeof(v));
                (void)r;
            }
        if (round_once(b, evs, n < 0 ? 0 : n))
            break;
    }
    return NULL;
}

/* ---------------------------------------------------------------- the API */

int http_bridge_start(struct rekv_http *h, rekv_err *err)
{
    struct hbridge *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return rekv_errf(err, -ENOMEM, "http: out of memory");
    b->h = h;
    b->ep = epoll_create1(EPOLL_CLOEXEC);
    b->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    h->bridge = b;
    if (b->ep < 0 || b->evfd < 0)
        return rekv_errf(err, -errno, "http: epoll/eventfd: %s", strerror(errno));
    int rc = rekv_ctl_connect_in(h->zctx, h->control_endpoint, h->curve_server_key, &b->ctl, err);
    if (rc)
        return rc;
    b->sock = rekv_ctl_socket(b->ctl);
    int zfd = -1;
    size_t zl = sizeof(zfd);
    if (zmq_getsockopt(b->sock, ZMQ_FD, &zfd, &zl) != 0)
        return rekv_errf(err, -errno, "http: ZMQ_FD: %s", zmq_strerror(errno));
    struct epoll_event e1 = {.events = EPOLLIN, .data.ptr = b};
    struct epoll_event e2 = {.events = EPOLLIN, .data.ptr = (void *)&the_dealer};
    if (epoll_ctl(b->ep, EPOLL_CTL_ADD, b->evfd, &e1) || epoll_ctl(b->ep, EPOLL_CTL_ADD, zfd, &e2))
        return rekv_errf(err, -errno, "http: epoll_ctl: %s", strerror(errno));
    if ((rc = pthread_create(&b->thr, NULL, bridge_main, b)) != 0)
        return rekv_errf(err, -rc, "http: thread: %s", strerror(rc));
    pthread_setname_np(b->thr, "rekv-http"); /* in top and perf, beside libmicrohttpd's */
    b->started = 1;
    return 0;
}

int http_bridge_submit(hgen *g)
{
    struct rekv_http *h = g->srv;
    struct hbridge *b = h->bridge;
    pthread_mutex_lock(&h->mu);
    if (atomic_load(&h->stopping)) {
        pthread_mutex_unlock(&h->mu);
        return -ESHUTDOWN;
    }
    g->registered = 1;
    g->want_new = 1;
    g->prev = NULL;
    g->next = b->all;
    if (b->all)
        b->all->prev = g;
    b->all = g;
    enqueue(b, g);
    g->suspended = 1;
    MHD_suspend_connection(g->conn);
    pthread_mutex_unlock(&h->mu);
    wake(b);
    return 0;
}

void http_bridge_finish(hgen *g)
{
    struct rekv_http *h = g->srv;
    pthread_mutex_lock(&h->mu);
    /* its socket leaves the epoll set now, before libmicrohttpd closes it (and the number is
     * reused for another connection) */
    unwatch(h->bridge, g);
    g->want_finish = 1;
    enqueue(h->bridge, g);
    pthread_mutex_unlock(&h->mu);
    wake(h->bridge);
}

void http_bridge_drain(struct rekv_http *h)
{
    struct hbridge *b = h->bridge;
    if (b == NULL)
        return;
    /* the waiting connections' resumes are made after mu is let go, as the bridge's are */
    struct MHD_Connection **resume = NULL;
    size_t n = 0, cap = 0;
    pthread_mutex_lock(&h->mu);
    atomic_store(&h->stopping, 1);
    for (hgen *g = b->all; g; g = g->next)
        if (g->suspended) {
            g->suspended = 0;
            if (grow(&resume, n, &cap) == 0)
                resume[n++] = g->conn;
            else
                MHD_resume_connection(g->conn); /* out of memory: now, under mu */
        }
    pthread_mutex_unlock(&h->mu);
    for (size_t i = 0; i < n; i++)
        MHD_resume_connection(resume[i]);
    free(resume);
    if (!b->started)
        return;
    while (atomic_load(&b->resuming)) /* a round's resumes, begun before stopping */
        usleep(1000);
    /* a moment for their 503s and streams' ends to go out (libmicrohttpd's thread runs them)
     * before the daemon closes every connection */
    for (int i = 0; i < 200; i++) {
        int busy = 0;
        pthread_mutex_lock(&h->mu);
        for (hgen *g = b->all; g && !busy; g = g->next)
            busy = !g->want_finish;
        pthread_mutex_unlock(&h->mu);
        if (!busy)
            break;
        usleep(5000);
    }
}

void http_bridge_stop(struct rekv_http *h)
{
    struct hbridge *b = h->bridge;
    if (b == NULL)
        return;
    if (b->started) {
        pthread_mutex_lock(&h->mu);
        b->quit = 1;
        pthread_mutex_unlock(&h->mu);
        wake(b);
        pthread_join(b->thr, NULL);
    }
    while (b->all) {
        hgen *g = b->all;
        b->all = g->next;
        http_gen_free(g);
    }
    rekv_ctl_close(b->ctl);
    if (b->ep >= 0)
        close(b->ep);
    if (b->evfd >= 0)
        close(b->evfd);
    free(b->cancels);
    free(b->touched);
    free(b->msgs);
    free(b->resume);
    free(b);
    h->bridge = NULL;
}
