/* conncap.c — see conncap.h. */
#define _GNU_SOURCE
#include "common/conncap.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include "common/metrics.h"

enum { FD_NONE = 0, FD_ADMITTED = 1, FD_OVER = 2 };

struct rekv_conncap {
    void *router;
    void *mon;      /* PAIR connected to the router's monitor */
    uint8_t *state; /* (n_state) FD_* by connection fd */
    size_t n_state;
    rekv_conncap_stats st;
};

uint32_t rekv_conncap_max_for(uint32_t wanted)
{
    if (wanted == 0)
        wanted = REKV_CONNCAP_DEFAULT;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        uint64_t keep = REKV_CONNCAP_RESERVE + REKV_CONNCAP_QUEUE;
        uint64_t room = rl.rlim_cur > keep ? (rl.rlim_cur - keep) / 2 : 0;
        if (room < 1)
            room = 1;
        if (wanted > room)
            wanted = (uint32_t)room;
    }
    return wanted;
}

int rekv_conncap_lowered(uint32_t wanted, char *why, size_t n)
{
    if (wanted == 0)
        wanted = REKV_CONNCAP_DEFAULT;
    uint32_t cap = rekv_conncap_max_for(wanted);
    struct rlimit rl;
    if (cap >= wanted || getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return 0;
    uint64_t need = 2ull * wanted + REKV_CONNCAP_RESERVE + REKV_CONNCAP_QUEUE;
    char hard[32];
    if (rl.rlim_max == RLIM_INFINITY)
        snprintf(hard, sizeof(hard), "unlimited");
    else
        snprintf(hard, sizeof(hard), "%llu", (unsigned long long)rl.rlim_max);
    snprintf(why, n,
             "--max-clients %u lowered to %u per socket: the open-file limit (RLIMIT_NOFILE) is "
             "%llu (soft), %s (hard), and %u clients need %llu (raise the hard limit: "
             "LimitNOFILE=, ulimit -Hn)",
             wanted, cap, (unsigned long long)rl.rlim_cur, hard, wanted, (unsigned long long)need);
    return 1;
}

int rekv_conncap_create(void *zctx, void *router, uint32_t max, rekv_conncap **out, rekv_err *err)
{
    rekv_conncap *cc = calloc(1, sizeof(*cc));
    if (cc == NULL)
        return rekv_errf(err, -ENOMEM, "conncap: out of memory");
    cc->router = router;
    cc->st.max = max ? max : 1;
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://rekv-conncap-%p", (void *)cc);
    int zero = 0, one = 1;
    if (zmq_socket_monitor(router, ep, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) < 0 ||
        (cc->mon = zmq_socket(zctx, ZMQ_PAIR)) == NULL ||
        /* the gate: a full pipe blocks the monitor's send, and with it libzmq's I/O thread
         * before its next accept (no event is ever dropped either) */
        zmq_setsockopt(cc->mon, ZMQ_RCVHWM, &one, sizeof(one)) < 0 ||
        zmq_setsockopt(cc->mon, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
        zmq_connect(cc->mon, ep) < 0) {
        int e = zmq_errno();
        rekv_conncap_free(cc);
        return rekv_errf(err, -e, "conncap: socket monitor: %s", zmq_strerror(e));
    }
    *out = cc;
    return 0;
}

void rekv_conncap_free(rekv_conncap *cc)
{
    if (cc == NULL)
        return;
    /* not zmq_socket_monitor(router, NULL): it waits for the monitor's lock, which an I/O
     * thread blocked on the full pipe holds; the context's end unblocks that send (ETERM) */
    if (cc->mon)
        zmq_close(cc->mon);
    free(cc->state);
    free(cc);
}

void *rekv_conncap_socket(const rekv_conncap *cc)
{
    return cc->mon;
}

static uint8_t *state_at(rekv_conncap *cc, int fd)
{
    if (fd < 0)
        return NULL;
    if ((size_t)fd >= cc->n_state) {
        size_t n = cc->n_state ? cc->n_state : 1024;
        while (n <= (size_t)fd)
            n *= 2;
        uint8_t *s = realloc(cc->state, n);
        if (s == NULL)
            return NULL;
        memset(s + cc->n_state, 0, n - cc->n_state);
        cc->state = s;
        cc->n_state = n;
    }
    return &cc->state[fd];
}

static void on_event(rekv_conncap *cc, uint16_t ev, int fd)
{
    uint8_t *s = state_at(cc, fd);
    if (s == NULL)
        return;
    if (ev == ZMQ_EVENT_DISCONNECTED) {
        if (*s == FD_ADMITTED)
            cc->st.admitted--;
        if (*s != FD_NONE)
            cc->st.live--;
        *s = FD_NONE;
        return;
    }
    /* ACCEPTED; an fd already counted lost its DISCONNECTED somehow: count it once */
    if (*s == FD_ADMITTED)
        cc->st.admitted--;
    if (*s != FD_NONE)
        cc->st.live--;
    cc->st.accepted++;
    cc->st.live++;
    if (cc->st.admitted < cc->st.max) {
        *s = FD_ADMITTED;
        cc->st.admitted++;
        return;
    }
    *s = FD_OVER;
    if (cc->st.live > 2ull * cc->st.max) {
        /* the fd stays libzmq's: it reads the end of the stream and closes it (DISCONNECTED) */
        (void)shutdown(fd, SHUT_RDWR);
        cc->st.shed++;
    }
}

void rekv_conncap_drain(rekv_conncap *cc)
{
    for (;;) {
        zmq_msg_t ev, addr;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, cc->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            return;
        }
        /* frame 1: uint16 event, uint32 value (the fd); frame 2: the endpoint */
        if (zmq_msg_more(&ev)) {
            zmq_msg_init(&addr);
            zmq_msg_recv(&addr, cc->mon, 0);
            zmq_msg_close(&addr);
        }
        if (zmq_msg_size(&ev) == 6) {
            uint16_t e;
            uint32_t v;
            memcpy(&e, zmq_msg_data(&ev), 2);
            memcpy(&v, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
            on_event(cc, e, (int)v);
        }
        zmq_msg_close(&ev);
    }
}

int rekv_conncap_over(rekv_conncap *cc, zmq_msg_t *msg)
{
    rekv_conncap_drain(cc);
    int fd = zmq_msg_get(msg, ZMQ_SRCFD);
    if (fd < 0 || (size_t)fd >= cc->n_state || cc->state[fd] != FD_OVER)
        return 0;
    cc->st.busy++;
    return 1;
}

void rekv_conncap_get_stats(const rekv_conncap *cc, rekv_conncap_stats *st)
{
    *st = cc->st;
}

void rekv_conncap_metrics(struct rekv_metrics_buf *b, const char *prefix,
                          const rekv_conncap *const *caps, const char *const *names, int n)
{
    char open_name[96], refused[96];
    snprintf(open_name, sizeof(open_name), "%s_connections", prefix);
    snprintf(refused, sizeof(refused), "%s_connections_refused_total", prefix);
    rekv_conncap_stats st[n > 0 ? n : 1];
    for (int i = 0; i < n; i++)
        rekv_conncap_get_stats(caps[i], &st[i]);
    rekv_metrics_family(b, open_name, "gauge",
                        "Connections open now on the socket (admitted and over --max-clients).");
    for (int i = 0; i < n; i++)
        rekv_metrics_sample_kv(b, open_name, (double)st[i].live, "socket", names[i], NULL);
    rekv_metrics_family(b, refused, "counter",
                        "Past --max-clients: requests answered busy, connections shed at accept.");
    for (int i = 0; i < n; i++) {
        rekv_metrics_sample_kv(b, refused, (double)st[i].busy, "socket", names[i], "how", "busy",
                               NULL);
        rekv_metrics_sample_kv(b, refused, (double)st[i].shed, "socket", names[i], "how", "shed",
                               NULL);
    }
}
