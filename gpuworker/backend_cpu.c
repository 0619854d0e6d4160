/* backend_cpu.c — the cpu backend's runtime: host memory as "device" memory, a worker thread per
 * stream, events, copies with optional link emulation, exact counters and a Chrome trace.
 *
 * The point of this backend is to let the decode pipeline be written, tested and timed without a
 * GPU. Streams and events behave as CUDA's do (in-order streams, cross-stream waits, re-recordable
 * events), and link emulation makes a host<->device copy take as long as it would over a PCIe link
 * of the configured bandwidth and latency, so overlap between copies and kernels shows up in
 * wall-clock time. Each direction of the link is shared by every stream (PCIe is full duplex but
 * one link per direction), so two streams copying host->device at once each get half of it. */
#define _GNU_SOURCE
#include "gpuworker/backend.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "common/clock.h"
#include "gpuworker/kernels.h"

/* Trace spans kept at most; later ones are counted as dropped and the JSON says so. Each span is
 * under 80 bytes, so a full trace stays under 80 MiB. */
#define CPU_TRACE_MAX_SPANS (1u << 20)
/* Event waits shorter than this are not worth a span: they did not hold the stream up. */
#define CPU_WAIT_SPAN_MIN_NS 1000u

enum { CPU_LINK_H2D = 0, CPU_LINK_D2H = 1, CPU_LINKS = 2 };

/* One direction of the emulated link. Its mutex is held for the whole of a copy, which is what
 * serialises concurrent copies of the same direction and shares the bandwidth between streams. */
typedef struct cpu_link {
    pthread_mutex_t mu; /* held while a copy occupies this direction */
} cpu_link;

/* One span of the trace: a task that ran on a stream. */
typedef struct cpu_span {
    uint64_t start_ns; /* CLOCK_MONOTONIC, ns */
    uint64_t end_ns;   /* CLOCK_MONOTONIC, ns, >= start_ns */
    uint32_t tid;      /* index of the stream in cpu_backend.stream_names, + 1 */
    char label[52];    /* kernel name or copy description, NUL-terminated, truncated */
} cpu_span;

/* What an event waits for, as of one event_record: done once the recording stream reaches it.
 * Shared (refcounted) between the event and the tasks that record or wait for it, so that
 * re-recording the event, or destroying it, never changes what an already enqueued wait waits
 * for. Fields are protected by cpu_backend.ev_mu. */
typedef struct cpu_completion {
    int refs;  /* the event (while it points here) + record and wait tasks holding it */
    bool done; /* the recorded work has finished */
} cpu_completion;

typedef struct cpu_backend {
    rekv_backend base;         /* iface and ctx (ctx points back here); first, so casts work */
    rekv_link_config link;     /* emulated link; gbps <= 0 means no throttling */
    cpu_link links[CPU_LINKS]; /* indexed by CPU_LINK_* */

    pthread_mutex_t ev_mu; /* protects every cpu_completion and rekv_event.latest */
    pthread_cond_t ev_cv;  /* broadcast whenever a completion becomes done */

    pthread_mutex_t stats_mu; /* protects stats */
    rekv_backend_stats stats; /* counters since creation or the last stats_reset */

    pthread_mutex_t trace_mu;      /* protects every field below */
    atomic_bool tracing;           /* trace_start was called: stream threads record spans */
    uint64_t trace_t0_ns;          /* CLOCK_MONOTONIC at trace_start; trace time 0 */
    cpu_span *spans;               /* [n_spans], capacity cap_spans, grown by doubling */
    size_t n_spans, cap_spans;     /* spans kept / allocated */
    uint64_t dropped_spans;        /* spans not kept because CPU_TRACE_MAX_SPANS was reached */
    char **stream_names;           /* [n_streams], every stream ever created (a trace track each) */
    size_t n_streams, cap_streams; /* names kept / allocated */
} cpu_backend;

typedef enum cpu_task_type {
    CPU_TASK_COPY = 0,   /* copy pieces, throttled by the link of its direction */
    CPU_TASK_HOST = 1,   /* a kernel: fn(arg) */
    CPU_TASK_RECORD = 2, /* mark a completion done */
    CPU_TASK_WAIT = 3,   /* block the stream until a completion is done */
} cpu_task_type;

typedef enum cpu_copy_dir {
    CPU_COPY_H2D = CPU_LINK_H2D,
    CPU_COPY_D2H = CPU_LINK_D2H,
    CPU_COPY_D2D = 2,
} cpu_copy_dir;

/* One unit of work in a stream's FIFO; allocated with its payload (pieces or argument bytes). */
typedef struct cpu_task {
    struct cpu_task *next; /* FIFO link */
    cpu_task_type type;    /* which member of u is valid */
    union {
        struct {
            cpu_copy_dir dir;    /* also the index of the link it occupies, unless d2d */
            rekv_xfer_kind kind; /* counted per kind for h2d and d2h */
            size_t n;            /* pieces in payload, as rekv_copy_piece[n] */
            size_t bytes;        /* sum of the pieces' bytes */
        } copy;
        struct {
            rekv_host_fn fn; /* the kernel */
            void *arg;       /* payload (a copy of the caller's bytes), or the caller's pointer
                                when arg_bytes was 0 */
            char name[52];   /* span label, truncated */
        } host;
        cpu_completion *comp; /* RECORD and WAIT: one reference owned by the task */
    } u;
    max_align_t payload[]; /* rekv_copy_piece[] or the host function's argument bytes */
} cpu_task;

struct rekv_stream {
    cpu_backend *be;        /* owner: links, stats, trace, completions */
    uint32_t tid;           /* trace track: index in be->stream_names + 1 */
    const char *name;       /* be->stream_names[tid - 1]; lives as long as the backend */
    pthread_t thread;       /* runs the tasks, in order */
    pthread_mutex_t mu;     /* protects every field below */
    pthread_cond_t work_cv; /* signalled when a task is queued or stop is set */
    pthread_cond_t idle_cv; /* broadcast when the queue drains */
    cpu_task *head, *tail;  /* FIFO of pending tasks */
    bool busy;              /* the thread is running a task taken off the queue */
    bool stop;              /* stream_destroy: exit once the queue is empty */
    int err_code;           /* first failure since the last stream_sync, 0 when none */
    char err_msg[512];      /* its message, one line */
};

struct rekv_event {
    cpu_backend *be;        /* owner: its ev_mu protects latest */
    cpu_completion *latest; /* what the last event_record waits for; NULL if never recorded */
};

/* ---- helpers ---- */

static void completion_unref_locked(cpu_completion *c)
{
    if (c != NULL && --c->refs == 0)
        free(c);
}

static void sleep_until_ns(uint64_t t_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ull),
                          .tv_nsec = (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* Keeps the first failure of a stream, for the next stream_sync. */
static void stream_fail(rekv_stream *s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void stream_fail(rekv_stream *s, int code, const char *fmt, ...)
{
    pthread_mutex_lock(&s->mu);
    if (s->err_code == 0) {
        s->err_code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->err_msg, sizeof(s->err_msg), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&s->mu);
}

/* Records a span if tracing; spans that began before trace_start are clipped to it. */
static void trace_span(cpu_backend *be, uint32_t tid, const char *label, uint64_t start_ns,
                       uint64_t end_ns)
{
    if (!atomic_load_explicit(&be->tracing, memory_order_relaxed))
        return;
    pthread_mutex_lock(&be->trace_mu);
    if (!atomic_load_explicit(&be->tracing, memory_order_relaxed))
        goto out_unlock;
    if (be->n_spans == CPU_TRACE_MAX_SPANS) {
        be->dropped_spans++;
        goto out_unlock;
    }
    if (be->n_spans == be->cap_spans) {
        size_t cap = be->cap_spans ? be->cap_spans * 2 : 4096;
        cpu_span *ns = realloc(be->spans, cap * sizeof(*ns));
        if (ns == NULL) {
            be->dropped_spans++;
            goto out_unlock;
        }
        be->spans = ns;
        be->cap_spans = cap;
    }
    cpu_span *sp = &be->spans[be->n_spans++];
    sp->start_ns = start_ns < be->trace_t0_ns ? be->trace_t0_ns : start_ns;
    sp->end_ns = end_ns < sp->start_ns ? sp->start_ns : end_ns;
    sp->tid = tid;
    snprintf(sp->label, sizeof(sp->label), "%s", label);
out_unlock:
    pthread_mutex_unlock(&be->trace_mu);
}

static bool tracing(const cpu_backend *be)
{
    return atomic_load_explicit(&be->tracing, memory_order_relaxed);
}

/* ---- running tasks (on the stream's thread) ---- */

static void run_copy(rekv_stream *s, cpu_task *t)
{
    cpu_backend *be = s->be;
    const rekv_copy_piece *pieces = (const rekv_copy_piece *)t->payload;
    cpu_copy_dir dir = t->u.copy.dir;
    bool throttled = dir != CPU_COPY_D2D && be->link.gbps > 0;

    if (dir != CPU_COPY_D2D)
        pthread_mutex_lock(&be->links[dir].mu);
    uint64_t start = rekv_now_ns();
    for (size_t i = 0; i < t->u.copy.n; i++)
        if (pieces[i].bytes > 0)
            memmove(pieces[i].dst, pieces[i].src, pieces[i].bytes);
    uint64_t end = rekv_now_ns();
    if (throttled) {
        double dur_ns = be->link.latency_us * 1e3 + (double)t->u.copy.bytes * 8.0 / be->link.gbps;
        uint64_t due = start + (uint64_t)(dur_ns > 0 ? dur_ns : 0);
        if (end < due) {
            sleep_until_ns(due);
            end = due;
        }
    }
    if (dir != CPU_COPY_D2D)
        pthread_mutex_unlock(&be->links[dir].mu);

    if (dir != CPU_COPY_D2D) {
        double busy = (double)(end - start) * 1e-9;
        pthread_mutex_lock(&be->stats_mu);
        if (dir == CPU_COPY_H2D) {
            be->stats.h2d_bytes[t->u.copy.kind] += t->u.copy.bytes;
            be->stats.h2d_copies++;
            be->stats.h2d_busy_s += busy;
        } else {
            be->stats.d2h_bytes[t->u.copy.kind] += t->u.copy.bytes;
            be->stats.d2h_copies++;
            be->stats.d2h_busy_s += busy;
        }
        pthread_mutex_unlock(&be->stats_mu);
    }
    if (tracing(be)) {
        static const char *const dir_names[] = {"h2d", "d2h", "d2d"};
        char label[64];
        rekv_copy_label(label, sizeof(label), dir_names[dir], t->u.copy.kind, t->u.copy.bytes);
        trace_span(be, s->tid, label, start, end);
    }
}

static void run_host(rekv_stream *s, cpu_task *t)
{
    cpu_backend *be = s->be;
    uint64_t start = rekv_now_ns();
    t->u.host.fn(t->u.host.arg);
    uint64_t end = rekv_now_ns();
    pthread_mutex_lock(&be->stats_mu);
    be->stats.compute_busy_s += (double)(end - start) * 1e-9;
    pthread_mutex_unlock(&be->stats_mu);
    trace_span(be, s->tid, t->u.host.name, start, end);
}

static void run_record(rekv_stream *s, cpu_task *t)
{
    cpu_backend *be = s->be;
    pthread_mutex_lock(&be->ev_mu);
    t->u.comp->done = true;
    completion_unref_locked(t->u.comp);
    pthread_cond_broadcast(&be->ev_cv);
    pthread_mutex_unlock(&be->ev_mu);
}

static void run_wait(rekv_stream *s, cpu_task *t)
{
    cpu_backend *be = s->be;
    uint64_t start = rekv_now_ns();
    pthread_mutex_lock(&be->ev_mu);
    while (!t->u.comp->done)
        pthread_cond_wait(&be->ev_cv, &be->ev_mu);
    completion_unref_locked(t->u.comp);
    pthread_mutex_unlock(&be->ev_mu);
    uint64_t end = rekv_now_ns();
    if (end - start > CPU_WAIT_SPAN_MIN_NS)
        trace_span(be, s->tid, "wait", start, end);
}

static void *stream_main(void *arg)
{
    rekv_stream *s = arg;
    /* The kernel's default timer slack (50 us) would make every emulated copy overshoot its due
     * time by that much: an emulated 10 us link latency would behave as 60 us. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == NULL && !s->stop)
            pthread_cond_wait(&s->work_cv, &s->mu);
        if (s->head == NULL)
            break; /* stop, and nothing left to do */
        cpu_task *t = s->head;
        s->head = t->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->busy = true;
        pthread_mutex_unlock(&s->mu);

        switch (t->type) {
        case CPU_TASK_COPY:
            run_copy(s, t);
            break;
        case CPU_TASK_HOST:
            run_host(s, t);
            break;
        case CPU_TASK_RECORD:
            run_record(s, t);
            break;
        case CPU_TASK_WAIT:
            run_wait(s, t);
            break;
        }
        free(t);

        pthread_mutex_lock(&s->mu);
        s->busy = false;
        if (s->head == NULL)
            pthread_cond_broadcast(&s->idle_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- enqueueing (caller's thread) ---- */

static cpu_task *task_new(rekv_stream *s, cpu_task_type type, size_t payload_bytes)
{
    cpu_task *t = calloc(1, sizeof(*t) + payload_bytes);
    if (t == NULL) {
        stream_fail(s, -ENOMEM, "stream %s: out of memory queueing a task", s->name);
        return NULL;
    }
    t->type = type;
    return t;
}

static void task_push(rekv_stream *s, cpu_task *t)
{
    pthread_mutex_lock(&s->mu);
    if (s->tail)
        s->tail->next = t;
    else
        s->head = t;
    s->tail = t;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
}

static void copy_enqueue(rekv_stream *s, cpu_copy_dir dir, const rekv_copy_piece *pieces, size_t n,
                         rekv_xfer_kind kind)
{
    static const char *const dir_names[] = {"h2d", "d2h", "d2d"};
    size_t bytes = 0;
    cpu_task *t = NULL;

    if (n > 0 && pieces == NULL) {
        stream_fail(s, -EINVAL, "stream %s: %s copy of %zu pieces with a NULL piece array", s->name,
                    dir_names[dir], n);
        return;
    }
    if ((unsigned)kind >= REKV_XFER_KINDS) {
        stream_fail(s, -EINVAL, "stream %s: %s copy with unknown transfer kind %d", s->name,
                    dir_names[dir], (int)kind);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (pieces[i].bytes > 0 && (pieces[i].dst == NULL || pieces[i].src == NULL)) {
            stream_fail(s, -EINVAL, "stream %s: %s copy, piece %zu of %zu: NULL %s for %zu bytes",
                        s->name, dir_names[dir], i, n, pieces[i].dst == NULL ? "dst" : "src",
                        pieces[i].bytes);
            return;
        }
        if (bytes + pieces[i].bytes < bytes) {
            stream_fail(s, -EINVAL, "stream %s: %s copy: total size overflows", s->name,
                        dir_names[dir]);
            return;
        }
        bytes += pieces[i].bytes;
    }
    t = task_new(s, CPU_TASK_COPY, n * sizeof(rekv_copy_piece));
    if (t == NULL)
        return;
    t->u.copy.dir = dir;
    t->u.copy.kind = kind;
    t->u.copy.n = n;
    t->u.copy.bytes = bytes;
    if (n > 0)
        memcpy(t->payload, pieces, n * sizeof(rekv_copy_piece));
    task_push(s, t);
}

/* ---- the interface ---- */

static void cpu_copy_h2d(rekv_stream *s, const rekv_copy_piece *pieces, size_t n,
                         rekv_xfer_kind kind)
{
    copy_enqueue(s, CPU_COPY_H2D, pieces, n, kind);
}

static void cpu_copy_d2h(rekv_stream *s, const rekv_copy_piece *pieces, size_t n,
                         rekv_xfer_kind kind)
{
    copy_enqueue(s, CPU_COPY_D2H, pieces, n, kind);
}

static void cpu_copy_d2d(rekv_stream *s, const rekv_copy_piece *pieces, size_t n)
{
    copy_enqueue(s, CPU_COPY_D2D, pieces, n, REKV_XFER_OTHER);
}

/* arg_bytes == 0 passes arg itself through (nothing to copy), so a kernel may take a pointer to
 * state the caller keeps alive until the stream has run it. */
static void cpu_launch_host(rekv_stream *s, const char *name, rekv_host_fn fn, const void *arg,
                            size_t arg_bytes)
{
    if (fn == NULL) {
        stream_fail(s, -EINVAL, "stream %s: launch of kernel %s with a NULL function", s->name,
                    name ? name : "(unnamed)");
        return;
    }
    if (arg_bytes > 0 && arg == NULL) {
        stream_fail(s, -EINVAL, "stream %s: kernel %s: NULL argument of %zu bytes", s->name,
                    name ? name : "(unnamed)", arg_bytes);
        return;
    }
    cpu_task *t = task_new(s, CPU_TASK_HOST, arg_bytes);
    if (t == NULL)
        return;
    t->u.host.fn = fn;
    if (arg_bytes > 0) {
        memcpy(t->payload, arg, arg_bytes);
        t->u.host.arg = t->payload;
    } else {
        t->u.host.arg = (void *)arg;
    }
    snprintf(t->u.host.name, sizeof(t->u.host.name), "%s", name ? name : "kernel");
    task_push(s, t);
}

static void *cpu_dev_alloc(rekv_backend *be, size_t bytes)
{
    void *p = NULL;
    /* a zero-byte request still gets a unique pointer, as cudaMalloc's callers expect non-NULL */
    if (posix_memalign(&p, 64, bytes ? bytes : 1) != 0)
        return NULL;
    return p;
}

static void cpu_dev_free(rekv_backend *be, void *p)
{
    free(p);
}

static int cpu_stream_create(rekv_backend *base, const char *name, rekv_stream **out, rekv_err *err)
{
    cpu_backend *be = base->ctx;
    rekv_stream *s = NULL;
    char *nm = NULL;
    int rc = 0;

    *out = NULL;
    s = calloc(1, sizeof(*s));
    nm = strdup(name ? name : "stream");
    if (s == NULL || nm == NULL) {
        rc = rekv_errf(err, -ENOMEM, "cpu backend: out of memory creating stream %s",
                       name ? name : "stream");
        goto out_free;
    }
    s->be = be;
    s->name = nm;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->idle_cv, NULL);

    /* register the name first: the backend owns it from here on (trace tracks outlive streams) */
    pthread_mutex_lock(&be->trace_mu);
    if (be->n_streams == be->cap_streams) {
        size_t cap = be->cap_streams ? be->cap_streams * 2 : 16;
        char **nn = realloc(be->stream_names, cap * sizeof(*nn));
        if (nn == NULL) {
            pthread_mutex_unlock(&be->trace_mu);
            rc = rekv_errf(err, -ENOMEM, "cpu backend: out of memory creating stream %s", nm);
            goto out_destroy_locks;
        }
        be->stream_names = nn;
        be->cap_streams = cap;
    }
    be->stream_names[be->n_streams++] = nm;
    s->tid = (uint32_t)be->n_streams;
    nm = NULL;
    pthread_mutex_unlock(&be->trace_mu);

    rc = -pthread_create(&s->thread, NULL, stream_main, s);
    if (rc != 0) {
        rc = rekv_errf(err, rc, "cpu backend: cannot start the thread of stream %s: %s", s->name,
                       strerror(-rc));
        goto out_destroy_locks;
    }
    {
        /* thread names are 15 bytes at most; the prefix makes them findable in top and gdb */
        char tname[16];
        snprintf(tname, sizeof(tname), "rekv-%s", s->name);
        pthread_setname_np(s->thread, tname);
    }
    *out = s;
    return 0;

out_destroy_locks:
    pthread_cond_destroy(&s->idle_cv);
    pthread_cond_destroy(&s->work_cv);
    pthread_mutex_destroy(&s->mu);
out_free:
    free(nm);
    free(s);
    return rc;
}

static int cpu_stream_sync(rekv_stream *s, rekv_err *err)
{
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    while (s->head != NULL || s->busy)
        pthread_cond_wait(&s->idle_cv, &s->mu);
    if (s->err_code != 0) {
        rc = rekv_errf(err, s->err_code, "%s", s->err_msg);
        s->err_code = 0;
        s->err_msg[0] = '\0';
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static void cpu_stream_destroy(rekv_stream *s)
{
    if (s == NULL)
        return;
    cpu_stream_sync(s, NULL);
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->idle_cv);
    pthread_cond_destroy(&s->work_cv);
    pthread_mutex_destroy(&s->mu);
    free(s); /* the name belongs to the backend */
}

static int cpu_event_create(rekv_backend *base, rekv_event **out, rekv_err *err)
{
    rekv_event *ev = calloc(1, sizeof(*ev));
    *out = NULL;
    if (ev == NULL)
        return rekv_errf(err, -ENOMEM, "cpu backend: out of memory creating an event");
    ev->be = base->ctx;
    *out = ev;
    return 0;
}

static void cpu_event_destroy(rekv_event *ev)
{
    if (ev == NULL)
        return;
    /* enqueued records and waits hold their own references and still run */
    pthread_mutex_lock(&ev->be->ev_mu);
    completion_unref_locked(ev->latest);
    pthread_mutex_unlock(&ev->be->ev_mu);
    free(ev);
}

static void cpu_event_record(rekv_event *ev, rekv_stream *s)
{
    cpu_backend *be = ev->be;
    cpu_completion *c = calloc(1, sizeof(*c));
    cpu_task *t = task_new(s, CPU_TASK_RECORD, 0);
    if (c == NULL || t == NULL) {
        stream_fail(s, -ENOMEM, "stream %s: out of memory recording an event", s->name);
        free(c);
        free(t);
        return;
    }
    c->refs = 2; /* the event and the record task */
    t->u.comp = c;
    pthread_mutex_lock(&be->ev_mu);
    completion_unref_locked(ev->latest);
    ev->latest = c;
    pthread_mutex_unlock(&be->ev_mu);
    task_push(s, t);
}

static void cpu_stream_wait_event(rekv_stream *s, rekv_event *ev)
{
    cpu_backend *be = ev->be;
    cpu_completion *c;

    pthread_mutex_lock(&be->ev_mu);
    c = ev->latest;
    if (c == NULL || c->done) {
        /* never recorded, or already complete: nothing to wait for */
        pthread_mutex_unlock(&be->ev_mu);
        return;
    }
    c->refs++;
    pthread_mutex_unlock(&be->ev_mu);

    cpu_task *t = task_new(s, CPU_TASK_WAIT, 0);
    if (t == NULL) {
        pthread_mutex_lock(&be->ev_mu);
        completion_unref_locked(c);
        pthread_mutex_unlock(&be->ev_mu);
        return;
    }
    t->u.comp = c;
    task_push(s, t);
}

static void cpu_event_sync(rekv_event *ev)
{
    cpu_backend *be = ev->be;
    pthread_mutex_lock(&be->ev_mu);
    cpu_completion *c = ev->latest;
    if (c != NULL) {
        c->refs++; /* the event may be re-recorded while we wait */
        while (!c->done)
            pthread_cond_wait(&be->ev_cv, &be->ev_mu);
        completion_unref_locked(c);
    }
    pthread_mutex_unlock(&be->ev_mu);
}

static void cpu_stats(rekv_backend *base, rekv_backend_stats *out)
{
    cpu_backend *be = base->ctx;
    pthread_mutex_lock(&be->stats_mu);
    *out = be->stats;
    pthread_mutex_unlock(&be->stats_mu);
}

static void cpu_stats_reset(rekv_backend *base)
{
    cpu_backend *be = base->ctx;
    pthread_mutex_lock(&be->stats_mu);
    memset(&be->stats, 0, sizeof(be->stats));
    pthread_mutex_unlock(&be->stats_mu);
}

static void cpu_trace_start(rekv_backend *base)
{
    cpu_backend *be = base->ctx;
    pthread_mutex_lock(&be->trace_mu);
    be->n_spans = 0;
    be->dropped_spans = 0;
    be->trace_t0_ns = rekv_now_ns();
    atomic_store(&be->tracing, true);
    pthread_mutex_unlock(&be->trace_mu);
}

/* Writes s as a JSON string, quotes included. */
static void json_write_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"':
            fputs("\\\"", f);
            break;
        case '\\':
            fputs("\\\\", f);
            break;
        case '\n':
            fputs("\\n", f);
            break;
        case '\r':
            fputs("\\r", f);
            break;
        case '\t':
            fputs("\\t", f);
            break;
        default:
            if (*p < 0x20)
                fprintf(f, "\\u%04x", *p);
            else
                fputc(*p, f);
        }
    }
    fputc('"', f);
}

/* Holds the trace lock while writing: stream threads that finish a task meanwhile wait for it,
 * which only matters if one writes a trace in the middle of a measured run. */
static int cpu_trace_write(rekv_backend *base, const char *path, rekv_err *err)
{
    cpu_backend *be = base->ctx;
    int rc = 0;
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return rekv_errf(err, -errno, "%s: cannot create trace file: %s", path, strerror(errno));

    pthread_mutex_lock(&be->trace_mu);
    fputs("{\"displayTimeUnit\": \"ms\",\n \"otherData\": {\"backend\": \"cpu\", ", f);
    fprintf(f, "\"spans\": %zu, \"dropped_spans\": %llu, \"truncated\": %s},\n", be->n_spans,
            (unsigned long long)be->dropped_spans, be->dropped_spans ? "true" : "false");
    fputs(" \"traceEvents\": [\n", f);
    fputs("  {\"ph\": \"M\", \"pid\": 1, \"tid\": 0, \"name\": \"process_name\", "
          "\"args\": {\"name\": \"rekv cpu backend\"}}",
          f);
    for (size_t i = 0; i < be->n_streams; i++) {
        fprintf(f,
                ",\n  {\"ph\": \"M\", \"pid\": 1, \"tid\": %zu, \"name\": \"thread_name\", "
                "\"args\": {\"name\": ",
                i + 1);
        json_write_string(f, be->stream_names[i]);
        fprintf(f,
                "}},\n  {\"ph\": \"M\", \"pid\": 1, \"tid\": %zu, "
                "\"name\": \"thread_sort_index\", \"args\": {\"sort_index\": %zu}}",
                i + 1, i + 1);
    }
    for (size_t i = 0; i < be->n_spans; i++) {
        const cpu_span *sp = &be->spans[i];
        fprintf(f,
                ",\n  {\"ph\": \"X\", \"pid\": 1, \"tid\": %u, \"ts\": %.3f, \"dur\": %.3f, "
                "\"name\": ",
                sp->tid, (double)(sp->start_ns - be->trace_t0_ns) * 1e-3,
                (double)(sp->end_ns - sp->start_ns) * 1e-3);
        json_write_string(f, sp->label);
        fputc('}', f);
    }
    fputs("\n ]}\n", f);
    pthread_mutex_unlock(&be->trace_mu);

    if (ferror(f))
        rc = rekv_errf(err, -EIO, "%s: error writing trace", path);
    if (fclose(f) != 0 && rc == 0)
        rc = rekv_errf(err, -errno, "%s: error writing trace: %s", path, strerror(errno));
    return rc;
}

static void cpu_destroy(rekv_backend *base)
{
    cpu_backend *be = base->ctx;
    for (size_t i = 0; i < be->n_streams; i++)
        free(be->stream_names[i]);
    free(be->stream_names);
    free(be->spans);
    pthread_mutex_destroy(&be->trace_mu);
    pthread_mutex_destroy(&be->stats_mu);
    pthread_cond_destroy(&be->ev_cv);
    pthread_mutex_destroy(&be->ev_mu);
    for (int i = 0; i < CPU_LINKS; i++)
        pthread_mutex_destroy(&be->links[i].mu);
    free(be);
}

/* Not static: backend_cpu_kernels.c launches its kernels through it (every cpu stream shares this
 * table, so a kernel needs only the stream). */
const rekv_backend_iface rekv_cpu_backend_iface;
const rekv_backend_iface rekv_cpu_backend_iface = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .dev_alloc = cpu_dev_alloc,
    .dev_free = cpu_dev_free,
    .stream_create = cpu_stream_create,
    .stream_destroy = cpu_stream_destroy,
    .stream_sync = cpu_stream_sync,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .stream_wait_event = cpu_stream_wait_event,
    .event_sync = cpu_event_sync,
    .copy_h2d = cpu_copy_h2d,
    .copy_d2h = cpu_copy_d2h,
    .copy_d2d = cpu_copy_d2d,
    .launch_host = cpu_launch_host,
    .stats = cpu_stats,
    .stats_reset = cpu_stats_reset,
    .trace_start = cpu_trace_start,
    .trace_write = cpu_trace_write,
};

int rekv_backend_cpu_create(const rekv_link_config *link, rekv_backend **out, rekv_err *err)
{
    *out = NULL;
    cpu_backend *be = calloc(1, sizeof(*be));
    if (be == NULL)
        return rekv_errf(err, -ENOMEM, "cpu backend: out of memory");
    be->base.iface = &rekv_cpu_backend_iface;
    be->base.kernels = &rekv_cpu_kernels;
    be->base.ctx = be;
    if (link)
        be->link = *link;
    for (int i = 0; i < CPU_LINKS; i++)
        pthread_mutex_init(&be->links[i].mu, NULL);
    pthread_mutex_init(&be->ev_mu, NULL);
    pthread_cond_init(&be->ev_cv, NULL);
    pthread_mutex_init(&be->stats_mu, NULL);
    pthread_mutex_init(&be->trace_mu, NULL);
    atomic_init(&be->tracing, false);
    *out = &be->base;
    return 0;
}
