/* backend_cpu.c — the cpu backend's runtime: host memory as "device" memory, a worker thread per
 * stream, events, copies with optional link emulation, exact counters and a Chrome trace.
 *
 * The point of this backend is to let the decode pipeline be written, tested and timed without a
 * GPU. Streams and events behave as CUDA's do (in-order streams, cross-stream waits, re-recordable
 * events), and link emulation makes a host<->device copy take as long as it would over a PCIe link
 * of the configured bandwidth and latency, so overlap between copies and kernels shows up in
 * wall-clock time. Each direction of the link is shared by every stream (PCIe is full duplex but
 * one link per direction), so two streams copying host->device at once each get half of it.
 *
 * Sharing with other processes (the IPC entries) works as CUDA IPC does, on memfd: a shared
 * buffer is a memfd mapping, and an exported event keeps its state (a record counter and a
 * completion counter) in a memfd page of its own, so a record in one process and a wait in
 * another order work across them. An importer opens the exporter's memfd through
 * /proc/PID/fd/FD, so nothing is ever named in /dev/shm and nothing outlives the processes. Waits
 * on shared events and on flags sleep on a futex in the shared page (not a private one, so a wake
 * reaches other processes). */
#define _GNU_SOURCE
#include "gpuworker/device/backend.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"

/* Trace spans kept at most; later ones are counted as dropped and the JSON says so. Each span is
 * under 80 bytes, so a full trace stays under 80 MiB. */
#define CPU_TRACE_MAX_SPANS (1u << 20)
/* Event waits shorter than this are not worth a span: they did not hold the stream up. */
#define CPU_WAIT_SPAN_MIN_NS 1000u
/* A flag wait re-reads the flag at least this often, for writers that store without waking the
 * futex (a plain store, another backend). */
#define CPU_FLAG_POLL_NS 1000000l
/* The shared page of an exported event: its magic, and the bytes mapped. */
#define CPU_IPC_EVENT_MAGIC 0x56454b52u /* "RKEV" */
#define CPU_IPC_PAGE_BYTES 4096u

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

/* A device buffer in a memfd mapping instead of the heap: exported (dev_alloc_shared; the memfd
 * stays open so that importers can open it through /proc/PID/fd) or imported (fd -1). */
typedef struct cpu_shared_buf {
    struct cpu_shared_buf *next; /* list of the backend's shared buffers */
    void *p;                     /* the mapping, as handed out */
    size_t len;                  /* bytes mapped (>= 1) */
    int fd;                      /* exported: the memfd; imported: -1 */
} cpu_shared_buf;

/* The state of an exported event, in a memfd page that the exporter and every importer map.
 * event_record takes the next generation at its call; its task raises completed to it once the
 * stream reaches it. A wait taken when recorded was g lasts until completed >= g. Accessed with
 * atomics only (several processes). */
typedef struct cpu_ipc_page {
    uint32_t magic;     /* CPU_IPC_EVENT_MAGIC */
    uint32_t version;   /* 1 */
    uint64_t nonce;     /* the handle's (also in the memfd's name) */
    uint64_t recorded;  /* generations handed out by event_record, in any process */
    uint64_t completed; /* the highest generation whose work has finished; only grows */
    uint32_t seq;       /* bumped after completed grows: the futex word waiters sleep on */
    int32_t recorder;   /* the process of the latest event_record: a waiter whose generation is
                           not complete when that process has died gives up (-EPIPE) */
} cpu_ipc_page;

/* This process's mapping of a shared event's page; shared by the event and the record and wait
 * tasks that use it, so destroying the event never unmaps what an enqueued task reads. */
typedef struct cpu_ipc_map {
    atomic_int refs;        /* the event + tasks holding it */
    cpu_ipc_page *page;     /* CPU_IPC_PAGE_BYTES mapped */
    int fd;                 /* exported here: the memfd, open while mapped; imported: -1 */
    rekv_ipc_handle handle; /* what event_export gives */
} cpu_ipc_map;

/* What a cpu handle's payload holds. */
typedef struct cpu_ipc_payload {
    int32_t pid;    /* the exporting process */
    int32_t fd;     /* its memfd */
    uint64_t nonce; /* in the memfd's name: rekv-dev-<nonce> or rekv-ev-<nonce>, 16 hex digits */
} cpu_ipc_payload;

typedef struct cpu_backend {
    rekv_backend base;             /* iface and ctx (ctx points back here); first, so casts work */
    rekv_link_config link;         /* emulated link; gbps <= 0 means no throttling */
    atomic_uint_fast64_t dev_used; /* bytes of dev_alloc memory (malloc_usable_size) */
    cpu_link links[CPU_LINKS];     /* indexed by CPU_LINK_* */

    pthread_mutex_t ev_mu; /* protects every cpu_completion and rekv_event.latest */
    pthread_cond_t ev_cv;  /* broadcast whenever a completion becomes done */

    pthread_mutex_t shm_mu; /* protects shared */
    cpu_shared_buf *shared; /* exported and imported buffers */

    pthread_mutex_t stats_mu; /* protects stats */
    rekv_backend_stats stats; /* counters since creation or the last stats_reset */

    pthread_mutex_t trace_mu;      /* protects every field below */
    atomic_bool tracing;           /* trace_start was called: stream threads record spans */
    atomic_bool timing;            /* timing(on): tasks enqueued now add to the busy times */
    uint64_t trace_t0_ns;          /* CLOCK_MONOTONIC at trace_start; trace time 0 */
    cpu_span *spans;               /* [n_spans], capacity cap_spans, grown by doubling */
    size_t n_spans, cap_spans;     /* spans kept / allocated */
    uint64_t dropped_spans;        /* spans not kept because CPU_TRACE_MAX_SPANS was reached */
    char **stream_names;           /* [n_streams], every stream ever created (a trace track each) */
    size_t n_streams, cap_streams; /* names kept / allocated */
} cpu_backend;

typedef enum cpu_task_type {
    CPU_TASK_COPY = 0,       /* copy pieces, throttled by the link of its direction */
    CPU_TASK_HOST = 1,       /* a kernel: fn(arg) */
    CPU_TASK_RECORD = 2,     /* mark a completion done */
    CPU_TASK_WAIT = 3,       /* block the stream until a completion is done */
    CPU_TASK_IPC_RECORD = 4, /* raise a shared event's completed to a generation */
    CPU_TASK_IPC_WAIT = 5,   /* block the stream until a shared event's completed reaches one */
    CPU_TASK_FLAG_WAIT = 6,  /* block the stream until a flag holds a value */
    CPU_TASK_FLAG_WRITE = 7, /* store a value to a flag */
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
    bool timed;            /* enqueued while timing or tracing: adds to the busy times */
    size_t payload_bytes;  /* of payload[] (a graph's copy of the task copies them too) */
    union {
        struct {
            cpu_copy_dir dir;    /* also the index of the link it occupies, unless d2d */
            rekv_xfer_kind kind; /* counted per kind for h2d and d2h */
            size_t n;            /* pieces in payload, as rekv_copy_piece[n] */
            size_t bytes;        /* sum of the pieces' bytes */
            /* deferred (copy_h2d_deferred): the pieces are *later_n at later, read when the
             * task runs (n and bytes are then set from them); NULL otherwise */
            const rekv_copy_piece *later;
            const size_t *later_n;
            size_t later_max;
        } copy;
        struct {
            rekv_host_fn fn; /* the kernel */
            void *arg;       /* payload (a copy of the caller's bytes), or the caller's pointer
                                when arg_bytes was 0 */
            char name[52];   /* span label, truncated */
        } host;
        cpu_completion *comp; /* RECORD and WAIT: one reference owned by the task */
        struct {
            cpu_ipc_map *map; /* one reference owned by the task */
            uint64_t gen;     /* the generation recorded, or waited for */
        } ipc;                /* IPC_RECORD and IPC_WAIT */
        struct {
            uint32_t *addr; /* 4-byte aligned */
            uint32_t value;
        } flag; /* FLAG_WAIT and FLAG_WRITE */
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
    rekv_graph *capture;    /* graph_begin: tasks go here instead of the FIFO; NULL when not */
};

/* A graph: the kernels and copies a capture kept, queued again (copies) by each launch. */
struct rekv_graph {
    cpu_task **tasks;
    size_t n, cap;
    bool refused; /* something else was enqueued during the capture */
};

struct rekv_event {
    cpu_backend *be;        /* owner: its ev_mu protects latest */
    cpu_completion *latest; /* what the last event_record waits for; NULL if never recorded */
    cpu_ipc_map *ipc;       /* shared events: the state is there instead (latest unused);
                               NULL for events from event_create */
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

/* futex(2) on a word that may be shared between processes, hence not FUTEX_PRIVATE_FLAG. A wait
 * returns at once when *addr != expect, on a wake, a signal or the timeout (rel may be NULL). */
static void futex_wait_word(const uint32_t *addr, uint32_t expect, const struct timespec *rel)
{
    syscall(SYS_futex, addr, FUTEX_WAIT, expect, rel, NULL, 0);
}

static void futex_wake_word(uint32_t *addr)
{
    syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* *flag >= value as cuStreamWaitValue32's GEQ compares: cyclic, so a counter may wrap. */
static bool flag_holds(uint32_t v, uint32_t value)
{
    return (int32_t)(v - value) >= 0;
}

/* Blocks until a shared event's completed reaches gen: 0, or -EPIPE when the process that
 * recorded it died first (its work will never finish; checked every 20 ms). */
static int ipc_page_wait(cpu_ipc_page *pg, uint64_t gen)
{
    const struct timespec tick = {0, 20 * 1000 * 1000};
    for (;;) {
        /* seq before completed: a completion after these loads changes seq, so the futex wait
         * returns at once instead of missing the wake */
        uint32_t seq = __atomic_load_n(&pg->seq, __ATOMIC_ACQUIRE);
        if (__atomic_load_n(&pg->completed, __ATOMIC_ACQUIRE) >= gen)
            return 0;
        futex_wait_word(&pg->seq, seq, &tick);
        pid_t rec = __atomic_load_n(&pg->recorder, __ATOMIC_ACQUIRE);
        if (rec > 0 && rec != getpid() && kill(rec, 0) < 0 && errno == ESRCH &&
            __atomic_load_n(&pg->completed, __ATOMIC_ACQUIRE) < gen)
            return -EPIPE;
    }
}

static void ipc_page_complete(cpu_ipc_page *pg, uint64_t gen)
{
    uint64_t c = __atomic_load_n(&pg->completed, __ATOMIC_RELAXED);
    while (c < gen && !__atomic_compare_exchange_n(&pg->completed, &c, gen, false, __ATOMIC_SEQ_CST,
                                                   __ATOMIC_RELAXED))
        ;
    __atomic_add_fetch(&pg->seq, 1, __ATOMIC_SEQ_CST);
    futex_wake_word(&pg->seq);
}

static void ipc_map_unref(cpu_ipc_map *m)
{
    if (m == NULL || atomic_fetch_sub(&m->refs, 1) != 1)
        return;
    munmap(m->page, CPU_IPC_PAGE_BYTES);
    if (m->fd >= 0)
        close(m->fd);
    free(m);
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
    if (t->u.copy.later != NULL) { /* the list as the stream's earlier work left it */
        char why[160];
        pieces = t->u.copy.later;
        t->u.copy.n = *t->u.copy.later_n;
        if (t->u.copy.n > t->u.copy.later_max) {
            stream_fail(s, -EINVAL, "stream %s: a deferred copy of %zu pieces (room for %zu)",
                        s->name, t->u.copy.n, t->u.copy.later_max);
            return;
        }
        if (rekv_copy_check("h2d", pieces, t->u.copy.n, t->u.copy.kind, &t->u.copy.bytes, why,
                            sizeof(why)) < 0) {
            stream_fail(s, -EINVAL, "stream %s: %s", s->name, why);
            return;
        }
    }
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
            be->stats.h2d_busy_s += t->timed ? busy : 0;
        } else {
            be->stats.d2h_bytes[t->u.copy.kind] += t->u.copy.bytes;
            be->stats.d2h_copies++;
            be->stats.d2h_busy_s += t->timed ? busy : 0;
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
    if (t->timed) {
        pthread_mutex_lock(&be->stats_mu);
        be->stats.compute_busy_s += (double)(end - start) * 1e-9;
        pthread_mutex_unlock(&be->stats_mu);
    }
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

static void run_ipc_record(rekv_stream *s, cpu_task *t)
{
    ipc_page_complete(t->u.ipc.map->page, t->u.ipc.gen);
    ipc_map_unref(t->u.ipc.map);
}

static void run_ipc_wait(rekv_stream *s, cpu_task *t)
{
    uint64_t start = rekv_now_ns();
    int32_t rec = __atomic_load_n(&t->u.ipc.map->page->recorder, __ATOMIC_ACQUIRE);
    if (ipc_page_wait(t->u.ipc.map->page, t->u.ipc.gen) != 0)
        stream_fail(s, -EPIPE,
                    "cpu stream %s: a shared event's recording process (pid %d) died before the "
                    "recorded work finished",
                    s->name, (int)rec);
    ipc_map_unref(t->u.ipc.map);
    uint64_t end = rekv_now_ns();
    if (end - start > CPU_WAIT_SPAN_MIN_NS)
        trace_span(s->be, s->tid, "wait ipc event", start, end);
}

/* A wait, not compute: traced, but not in compute_busy_s. */
static void run_flag_wait(rekv_stream *s, cpu_task *t)
{
    uint32_t *addr = t->u.flag.addr, value = t->u.flag.value;
    uint64_t start = rekv_now_ns();
    for (;;) {
        uint32_t v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
        if (flag_holds(v, value))
            break;
        struct timespec poll = {0, CPU_FLAG_POLL_NS};
        futex_wait_word(addr, v, &poll);
    }
    uint64_t end = rekv_now_ns();
    if (end - start > CPU_WAIT_SPAN_MIN_NS && tracing(s->be)) {
        char label[48];
        snprintf(label, sizeof(label), "wait flag >= %u", (unsigned)value);
        trace_span(s->be, s->tid, label, start, end);
    }
}

static void run_flag_write(rekv_stream *s, cpu_task *t)
{
    /* the stream's earlier tasks ran on this thread: the release publishes what they wrote */
    __atomic_store_n(t->u.flag.addr, t->u.flag.value, __ATOMIC_RELEASE);
    futex_wake_word(t->u.flag.addr);
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
        case CPU_TASK_IPC_RECORD:
            run_ipc_record(s, t);
            break;
        case CPU_TASK_IPC_WAIT:
            run_ipc_wait(s, t);
            break;
        case CPU_TASK_FLAG_WAIT:
            run_flag_wait(s, t);
            break;
        case CPU_TASK_FLAG_WRITE:
            run_flag_write(s, t);
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
    t->timed = atomic_load_explicit(&s->be->timing, memory_order_relaxed) || tracing(s->be);
    t->payload_bytes = payload_bytes;
    return t;
}

static void task_push(rekv_stream *s, cpu_task *t)
{
    pthread_mutex_lock(&s->mu);
    rekv_graph *g = s->capture;
    if (g != NULL && (t->type == CPU_TASK_COPY || t->type == CPU_TASK_HOST)) {
        cpu_task **nt =
            g->n == g->cap ? realloc(g->tasks, (g->cap ? 2 * g->cap : 64) * sizeof(*nt)) : g->tasks;
        if (nt != NULL) {
            g->tasks = nt;
            g->cap = g->n == g->cap ? (g->cap ? 2 * g->cap : 64) : g->cap;
            g->tasks[g->n++] = t;
        } else {
            g->refused = true;
            free(t);
        }
        pthread_mutex_unlock(&s->mu);
        return;
    }
    if (g != NULL) /* it runs (an event must complete), but the capture is void */
        g->refused = true;
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
    char why[160];
    if (rekv_copy_check(dir_names[dir], pieces, n, kind, &bytes, why, sizeof(why)) < 0) {
        stream_fail(s, -EINVAL, "stream %s: %s", s->name, why);
        return;
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

static void cpu_copy_h2d_deferred(rekv_stream *s, const rekv_copy_piece *pieces, const size_t *n,
                                  size_t max, rekv_xfer_kind kind)
{
    if (pieces == NULL || n == NULL || (unsigned)kind >= REKV_XFER_KINDS) {
        stream_fail(s, -EINVAL,
                    "stream %s: a deferred copy needs its pieces, their count and a kind", s->name);
        return;
    }
    cpu_task *t = task_new(s, CPU_TASK_COPY, 0);
    if (t == NULL)
        return;
    t->u.copy.dir = CPU_COPY_H2D;
    t->u.copy.kind = kind;
    t->u.copy.later = pieces;
    t->u.copy.later_n = n;
    t->u.copy.later_max = max;
    task_push(s, t);
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

static void *cpu_dev_alloc(rekv_backend *base, size_t bytes)
{
    cpu_backend *be = base->ctx;
    void *p = NULL;
    /* a zero-byte request still gets a unique pointer, as cudaMalloc's callers expect non-NULL */
    if (posix_memalign(&p, 64, bytes ? bytes : 1) != 0)
        return NULL;
    uint64_t n = malloc_usable_size(p);
    uint64_t used = atomic_fetch_add(&be->dev_used, n) + n;
    if (be->link.device_bytes > 0 && used > be->link.device_bytes) { /* the emulated device */
        atomic_fetch_sub(&be->dev_used, n);
        free(p);
        return NULL;
    }
    return p;
}

static void *cpu_dev_adopt(rekv_backend *base, const void *p, size_t bytes)
{
    cpu_backend *be = base->ctx;
    uint64_t used = atomic_fetch_add(&be->dev_used, bytes) + bytes;
    if (p == NULL || (be->link.device_bytes > 0 && used > be->link.device_bytes)) {
        atomic_fetch_sub(&be->dev_used, bytes);
        return NULL;
    }
    return (void *)p;
}

static void cpu_dev_unadopt(rekv_backend *base, void *dev, size_t bytes)
{
    cpu_backend *be = base->ctx;
    if (dev != NULL)
        atomic_fetch_sub(&be->dev_used, bytes);
}

static int cpu_mem_info(rekv_backend *base, size_t *free_bytes, size_t *total_bytes, rekv_err *err)
{
    cpu_backend *be = base->ctx;
    uint64_t cap = be->link.device_bytes, used = atomic_load(&be->dev_used);
    if (cap == 0)
        return rekv_errf(err, -ENOTSUP, "cpu backend: device memory is the host's (no limit set)");
    *free_bytes = used < cap ? (size_t)(cap - used) : 0;
    *total_bytes = (size_t)cap;
    return 0;
}

/* Takes p's entry off the list of shared buffers (only if imported, when imported_only); NULL
 * when p is no such buffer. */
static cpu_shared_buf *shared_take(cpu_backend *be, const void *p, bool imported_only)
{
    cpu_shared_buf *sb = NULL;
    pthread_mutex_lock(&be->shm_mu);
    for (cpu_shared_buf **pp = &be->shared; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->p == p && (!imported_only || (*pp)->fd < 0)) {
            sb = *pp;
            *pp = sb->next;
            break;
        }
    }
    pthread_mutex_unlock(&be->shm_mu);
    return sb;
}

static void shared_free(cpu_shared_buf *sb)
{
    munmap(sb->p, sb->len);
    if (sb->fd >= 0)
        close(sb->fd);
    free(sb);
}

static void cpu_dev_free(rekv_backend *base, void *p)
{
    cpu_backend *be = base->ctx;
    cpu_shared_buf *sb = p != NULL ? shared_take(be, p, false) : NULL;
    if (sb != NULL) {
        shared_free(sb);
    } else if (p != NULL) {
        atomic_fetch_sub(&be->dev_used, (uint64_t)malloc_usable_size(p));
        free(p);
    }
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

static void count_host_sync(cpu_backend *be)
{
    pthread_mutex_lock(&be->stats_mu);
    be->stats.host_syncs++;
    pthread_mutex_unlock(&be->stats_mu);
}

static int cpu_stream_sync(rekv_stream *s, rekv_err *err)
{
    int rc = 0;
    count_host_sync(s->be);
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

static void cpu_graph_destroy(rekv_graph *g)
{
    if (g == NULL)
        return;
    for (size_t i = 0; i < g->n; i++)
        free(g->tasks[i]);
    free(g->tasks);
    free(g);
}

static int cpu_graph_begin(rekv_stream *s, rekv_err *err)
{
    rekv_graph *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return rekv_errf(err, -ENOMEM, "stream %s: out of memory for a graph", s->name);
    pthread_mutex_lock(&s->mu);
    rekv_graph *was = s->capture;
    if (was == NULL)
        s->capture = g;
    pthread_mutex_unlock(&s->mu);
    if (was != NULL) {
        free(g);
        return rekv_errf(err, -EBUSY, "stream %s: already capturing a graph", s->name);
    }
    return 0;
}

static int cpu_graph_end(rekv_stream *s, rekv_graph **out, rekv_err *err)
{
    pthread_mutex_lock(&s->mu);
    rekv_graph *g = s->capture;
    s->capture = NULL;
    pthread_mutex_unlock(&s->mu);
    *out = NULL;
    if (g == NULL)
        return rekv_errf(err, -EINVAL, "stream %s: graph_end without graph_begin", s->name);
    if (g->refused) {
        cpu_graph_destroy(g);
        return rekv_errf(err, -ENOTSUP,
                         "stream %s: a capture saw work other than kernels and copies", s->name);
    }
    *out = g;
    return 0;
}

/* Queues a copy of every task the graph kept, timed as work enqueued now is. */
static void cpu_graph_launch(rekv_stream *s, rekv_graph *g)
{
    bool timed = atomic_load_explicit(&s->be->timing, memory_order_relaxed) || tracing(s->be);
    for (size_t i = 0; i < g->n; i++) {
        const cpu_task *src = g->tasks[i];
        cpu_task *t = malloc(sizeof(*t) + src->payload_bytes);
        if (t == NULL) {
            stream_fail(s, -ENOMEM, "stream %s: out of memory launching a graph", s->name);
            return;
        }
        memcpy(t, src, sizeof(*t) + src->payload_bytes);
        if (t->type == CPU_TASK_HOST && src->u.host.arg == (const void *)src->payload)
            t->u.host.arg = t->payload;
        t->next = NULL;
        t->timed = timed;
        task_push(s, t);
    }
}

static void cpu_stream_destroy(rekv_stream *s)
{
    if (s == NULL)
        return;
    cpu_graph_destroy(s->capture);
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
    if (ev->ipc != NULL) { /* enqueued tasks hold their own references to the mapping */
        ipc_map_unref(ev->ipc);
        free(ev);
        return;
    }
    /* enqueued records and waits hold their own references and still run */
    pthread_mutex_lock(&ev->be->ev_mu);
    completion_unref_locked(ev->latest);
    pthread_mutex_unlock(&ev->be->ev_mu);
    free(ev);
}

/* A shared event: the generation is taken now, so a wait enqueued after this call, in any process,
 * waits for this record. */
static void ipc_event_record(rekv_event *ev, rekv_stream *s)
{
    cpu_task *t = task_new(s, CPU_TASK_IPC_RECORD, 0);
    if (t == NULL)
        return;
    atomic_fetch_add(&ev->ipc->refs, 1);
    t->u.ipc.map = ev->ipc;
    __atomic_store_n(&ev->ipc->page->recorder, (int32_t)getpid(), __ATOMIC_RELEASE);
    t->u.ipc.gen = __atomic_add_fetch(&ev->ipc->page->recorded, 1, __ATOMIC_SEQ_CST);
    task_push(s, t);
}

static void ipc_event_wait(rekv_stream *s, rekv_event *ev)
{
    cpu_ipc_page *pg = ev->ipc->page;
    uint64_t gen = __atomic_load_n(&pg->recorded, __ATOMIC_SEQ_CST);
    if (gen == 0 || __atomic_load_n(&pg->completed, __ATOMIC_ACQUIRE) >= gen)
        return; /* never recorded, or already complete */
    cpu_task *t = task_new(s, CPU_TASK_IPC_WAIT, 0);
    if (t == NULL)
        return;
    atomic_fetch_add(&ev->ipc->refs, 1);
    t->u.ipc.map = ev->ipc;
    t->u.ipc.gen = gen;
    task_push(s, t);
}

static void cpu_event_record(rekv_event *ev, rekv_stream *s)
{
    cpu_backend *be = ev->be;
    if (ev->ipc != NULL) {
        ipc_event_record(ev, s);
        return;
    }
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

    if (ev->ipc != NULL) {
        ipc_event_wait(s, ev);
        return;
    }
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
    count_host_sync(be);
    if (ev->ipc != NULL) {
        cpu_ipc_page *pg = ev->ipc->page;
        (void)ipc_page_wait(pg, __atomic_load_n(&pg->recorded, __ATOMIC_SEQ_CST));
        return;
    }
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

/* ---- sharing with other processes ---- */

/* A random number naming one export, so that a handle whose fd number has since been reused for
 * something else is told apart. */
static uint64_t ipc_nonce(void)
{
    static atomic_uint_fast64_t counter;
    uint64_t n = 0;
    if (getrandom(&n, sizeof(n), GRND_NONBLOCK) != (ssize_t)sizeof(n))
        n = rekv_now_ns() ^ ((uint64_t)getpid() << 32);
    return n ^ atomic_fetch_add(&counter, 0x9e3779b97f4a7c15ull);
}

static void ipc_handle_fill(rekv_ipc_handle *h, rekv_ipc_kind kind, uint64_t bytes, int fd,
                            uint64_t nonce)
{
    cpu_ipc_payload pl = {(int32_t)getpid(), fd, nonce};
    rekv_ipc_handle_init(h, kind, "cpu", bytes);
    memcpy(h->payload, &pl, sizeof(pl));
}

/* Opens the memfd a handle names, through /proc/PID/fd/FD, and checks that it is the one that
 * was exported (its name carries the nonce) and has the expected size. Returns the new fd or a
 * negative errno. */
static int ipc_open(const rekv_ipc_handle *h, const char *prefix, size_t len, const char *what,
                    rekv_err *err)
{
    cpu_ipc_payload pl;
    char path[64], want[64], link[256];
    struct stat st;
    int fd, rc;

    memcpy(&pl, h->payload, sizeof(pl));
    if (pl.pid <= 0 || pl.fd < 0)
        return rekv_errf(err, -EINVAL,
                         "cpu backend: %s: the handle names no process (pid %d, fd %d)", what,
                         (int)pl.pid, (int)pl.fd);
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pl.pid, (int)pl.fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (kill(pl.pid, 0) != 0 && errno == ESRCH)
            return rekv_errf(err, -ESRCH, "cpu backend: %s: the exporting process %d has exited",
                             what, (int)pl.pid);
        if (e == ENOENT)
            return rekv_errf(err, -ENOENT,
                             "cpu backend: %s: process %d no longer exports it (freed, or the "
                             "process is exiting)",
                             what, (int)pl.pid);
        return rekv_errf(err, -e, "cpu backend: %s: cannot open %s (the exporter's memory): %s%s",
                         what, path, strerror(e),
                         e == EACCES ? " (another user's process, or one made undumpable)" : "");
    }
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    link[n > 0 ? n : 0] = '\0';
    int wn = snprintf(want, sizeof(want), "/memfd:%s%016llx", prefix, (unsigned long long)pl.nonce);
    if (strncmp(link, want, (size_t)wn) != 0 || (link[wn] != '\0' && link[wn] != ' ')) {
        rc = rekv_errf(err, -ESTALE,
                       "cpu backend: %s: stale handle: fd %d of process %d is no longer what was "
                       "exported (it is %s)",
                       what, (int)pl.fd, (int)pl.pid, link[0] ? link : "unreadable");
        goto out_close;
    }
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != (uint64_t)len) {
        rc = rekv_errf(err, -ESTALE,
                       "cpu backend: %s: the exported memory has %lld bytes, the handle says %zu",
                       what, (long long)st.st_size, len);
        goto out_close;
    }
    return fd;

out_close:
    close(fd);
    return rc;
}

/* A new memfd of len bytes named prefix + nonce, mapped shared. Returns the fd, or -errno. */
static int ipc_create(const char *prefix, uint64_t nonce, size_t len, void **map, rekv_err *err)
{
    char name[64];
    int fd, rc;
    snprintf(name, sizeof(name), "%s%016llx", prefix, (unsigned long long)nonce);
    fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0)
        return rekv_errf(err, -errno, "cpu backend: memfd_create: %s", strerror(errno));
    if (ftruncate(fd, (off_t)len) != 0) {
        rc = rekv_errf(err, -errno, "cpu backend: cannot size shared memory to %zu bytes: %s", len,
                       strerror(errno));
        goto out_close;
    }
    *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (*map == MAP_FAILED) {
        rc = rekv_errf(err, -errno, "cpu backend: cannot map %zu bytes of shared memory: %s", len,
                       strerror(errno));
        goto out_close;
    }
    return fd;

out_close:
    close(fd);
    return rc;
}

static void shared_add(cpu_backend *be, cpu_shared_buf *sb)
{
    pthread_mutex_lock(&be->shm_mu);
    sb->next = be->shared;
    be->shared = sb;
    pthread_mutex_unlock(&be->shm_mu);
}

static void *cpu_dev_alloc_shared(rekv_backend *base, size_t bytes, rekv_ipc_handle *out,
                                  rekv_err *err)
{
    cpu_backend *be = base->ctx;
    uint64_t nonce = ipc_nonce();
    cpu_shared_buf *sb = calloc(1, sizeof(*sb));
    if (sb == NULL) {
        rekv_errf(err, -ENOMEM, "cpu backend: out of memory");
        return NULL;
    }
    sb->len = bytes ? bytes : 1; /* a unique pointer for zero bytes too, as dev_alloc */
    sb->fd = ipc_create("rekv-dev-", nonce, sb->len, &sb->p, err);
    if (sb->fd < 0) {
        free(sb);
        return NULL;
    }
    shared_add(be, sb);
    ipc_handle_fill(out, REKV_IPC_MEM, bytes, sb->fd, nonce);
    return sb->p;
}

static int cpu_dev_import(rekv_backend *base, const rekv_ipc_handle *h, void **dev, size_t *bytes,
                          rekv_err *err)
{
    cpu_backend *be = base->ctx;
    cpu_shared_buf *sb = NULL;
    int rc, fd;

    *dev = NULL;
    rc = rekv_ipc_handle_check(h, REKV_IPC_MEM, "cpu", "cpu backend: dev_import", err);
    if (rc < 0)
        return rc;
    if (h->bytes > SIZE_MAX / 2)
        return rekv_errf(err, -EINVAL, "cpu backend: dev_import: the handle says %llu bytes",
                         (unsigned long long)h->bytes);
    sb = calloc(1, sizeof(*sb));
    if (sb == NULL)
        return rekv_errf(err, -ENOMEM, "cpu backend: out of memory");
    sb->len = h->bytes ? (size_t)h->bytes : 1;
    sb->fd = -1;
    if ((fd = ipc_open(h, "rekv-dev-", sb->len, "dev_import", err)) < 0) {
        rc = fd;
        goto out_free;
    }
    sb->p = mmap(NULL, sb->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (sb->p == MAP_FAILED) {
        rc = rekv_errf(err, -errno, "cpu backend: dev_import: cannot map %zu bytes: %s", sb->len,
                       strerror(errno));
        close(fd);
        goto out_free;
    }
    close(fd); /* the mapping keeps the memory */
    shared_add(be, sb);
    *dev = sb->p;
    if (bytes)
        *bytes = (size_t)h->bytes;
    return 0;

out_free:
    free(sb);
    return rc;
}

static void cpu_dev_unimport(rekv_backend *base, void *dev)
{
    cpu_backend *be = base->ctx;
    cpu_shared_buf *sb = dev != NULL ? shared_take(be, dev, true) : NULL;
    if (sb != NULL)
        shared_free(sb);
}

static rekv_event *ipc_event_new(cpu_backend *be, cpu_ipc_page *page, int fd,
                                 const rekv_ipc_handle *h)
{
    rekv_event *ev = calloc(1, sizeof(*ev));
    cpu_ipc_map *m = calloc(1, sizeof(*m));
    if (ev == NULL || m == NULL) {
        free(ev);
        free(m);
        return NULL;
    }
    atomic_init(&m->refs, 1);
    m->page = page;
    m->fd = fd;
    m->handle = *h;
    ev->be = be;
    ev->ipc = m;
    return ev;
}

static int cpu_event_create_shared(rekv_backend *base, rekv_event **out, rekv_err *err)
{
    uint64_t nonce = ipc_nonce();
    void *map = NULL;
    rekv_ipc_handle h;

    *out = NULL;
    int fd = ipc_create("rekv-ev-", nonce, CPU_IPC_PAGE_BYTES, &map, err);
    if (fd < 0)
        return fd;
    cpu_ipc_page *pg = map; /* zero-filled: nothing recorded, nothing completed */
    pg->version = 1;
    pg->nonce = nonce;
    pg->magic = CPU_IPC_EVENT_MAGIC;
    ipc_handle_fill(&h, REKV_IPC_EVENT, 0, fd, nonce);
    *out = ipc_event_new(base->ctx, pg, fd, &h);
    if (*out == NULL) {
        munmap(map, CPU_IPC_PAGE_BYTES);
        close(fd);
        return rekv_errf(err, -ENOMEM, "cpu backend: out of memory creating an event");
    }
    return 0;
}

static int cpu_event_export(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err)
{
    if (ev->ipc == NULL)
        return rekv_errf(err, -EINVAL,
                         "cpu backend: event_export: the event was made by "
                         "event_create; only event_create_shared's can be exported");
    *out = ev->ipc->handle;
    return 0;
}

static int cpu_event_import(rekv_backend *base, const rekv_ipc_handle *h, rekv_event **out,
                            rekv_err *err)
{
    cpu_ipc_payload pl;
    int rc, fd;

    *out = NULL;
    rc = rekv_ipc_handle_check(h, REKV_IPC_EVENT, "cpu", "cpu backend: event_import", err);
    if (rc < 0)
        return rc;
    if ((fd = ipc_open(h, "rekv-ev-", CPU_IPC_PAGE_BYTES, "event_import", err)) < 0)
        return fd;
    cpu_ipc_page *pg = mmap(NULL, CPU_IPC_PAGE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    rc = pg == MAP_FAILED ? -errno : 0;
    close(fd);
    if (rc < 0)
        return rekv_errf(err, rc, "cpu backend: event_import: cannot map the event: %s",
                         strerror(-rc));
    memcpy(&pl, h->payload, sizeof(pl));
    if (pg->magic != CPU_IPC_EVENT_MAGIC || pg->nonce != pl.nonce) {
        munmap(pg, CPU_IPC_PAGE_BYTES);
        return rekv_errf(err, -ESTALE,
                         "cpu backend: event_import: stale handle: process %d's memory is not "
                         "the exported event",
                         (int)pl.pid);
    }
    *out = ipc_event_new(base->ctx, pg, -1, h);
    if (*out == NULL) {
        munmap(pg, CPU_IPC_PAGE_BYTES);
        return rekv_errf(err, -ENOMEM, "cpu backend: out of memory importing an event");
    }
    return 0;
}

static bool flag_ok(rekv_stream *s, const uint32_t *flag, const char *what)
{
    if (flag == NULL || ((uintptr_t)flag & 3u) != 0) {
        stream_fail(s, -EINVAL, "stream %s: %s: flag %p is %s", s->name, what, (const void *)flag,
                    flag == NULL ? "NULL" : "not 4-byte aligned");
        return false;
    }
    return true;
}

static void cpu_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value)
{
    if (!flag_ok(s, flag, "wait for flag"))
        return;
    cpu_task *t = task_new(s, CPU_TASK_FLAG_WAIT, 0);
    if (t == NULL)
        return;
    t->u.flag.addr = (uint32_t *)flag; /* only read */
    t->u.flag.value = value;
    task_push(s, t);
}

static void cpu_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value)
{
    if (!flag_ok(s, flag, "write flag"))
        return;
    cpu_task *t = task_new(s, CPU_TASK_FLAG_WRITE, 0);
    if (t == NULL)
        return;
    t->u.flag.addr = flag;
    t->u.flag.value = value;
    task_push(s, t);
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

static void cpu_timing(rekv_backend *base, bool on)
{
    cpu_backend *be = base->ctx;
    atomic_store(&be->timing, on);
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
/* Holds the trace lock while writing: stream threads that finish a task meanwhile wait for it,
 * which only matters if one writes a trace in the middle of a measured run. */
static int cpu_trace_write(rekv_backend *base, const char *path, rekv_err *err)
{
    cpu_backend *be = base->ctx;
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return rekv_errf(err, -errno, "%s: cannot create trace file: %s", path, strerror(errno));
    pthread_mutex_lock(&be->trace_mu);
    rekv_trace_begin(f, "cpu", "", be->n_spans, be->dropped_spans, be->stream_names, be->n_streams);
    for (size_t i = 0; i < be->n_spans; i++) {
        const cpu_span *sp = &be->spans[i];
        rekv_trace_span(f, sp->tid, (double)(sp->start_ns - be->trace_t0_ns) * 1e-3,
                        (double)(sp->end_ns - sp->start_ns) * 1e-3, sp->label);
    }
    pthread_mutex_unlock(&be->trace_mu);
    return rekv_trace_end(f, path, err);
}

static void cpu_destroy(rekv_backend *base)
{
    cpu_backend *be = base->ctx;
    for (size_t i = 0; i < be->n_streams; i++)
        free(be->stream_names[i]);
    free(be->stream_names);
    free(be->spans);
    while (be->shared != NULL) { /* buffers never freed or unimported */
        cpu_shared_buf *sb = be->shared;
        be->shared = sb->next;
        shared_free(sb);
    }
    pthread_mutex_destroy(&be->trace_mu);
    pthread_mutex_destroy(&be->stats_mu);
    pthread_mutex_destroy(&be->shm_mu);
    pthread_cond_destroy(&be->ev_cv);
    pthread_mutex_destroy(&be->ev_mu);
    for (int i = 0; i < CPU_LINKS; i++)
        pthread_mutex_destroy(&be->links[i].mu);
    free(be);
}

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
    .copy_h2d_deferred = cpu_copy_h2d_deferred,
    .launch_host = cpu_launch_host,
    .stats = cpu_stats,
    .stats_reset = cpu_stats_reset,
    .timing = cpu_timing,
    .graph_begin = cpu_graph_begin,
    .graph_end = cpu_graph_end,
    .graph_launch = cpu_graph_launch,
    .graph_destroy = cpu_graph_destroy,
    .trace_start = cpu_trace_start,
    .trace_write = cpu_trace_write,
    .dev_alloc_shared = cpu_dev_alloc_shared,
    .dev_import = cpu_dev_import,
    .dev_unimport = cpu_dev_unimport,
    .event_create_shared = cpu_event_create_shared,
    .event_export = cpu_event_export,
    .event_import = cpu_event_import,
    .stream_wait_flag = cpu_stream_wait_flag,
    .stream_write_flag = cpu_stream_write_flag,
    .mem_info = cpu_mem_info,
    .dev_adopt = cpu_dev_adopt,
    .dev_unadopt = cpu_dev_unadopt,
};

int rekv_backend_cpu_create(const rekv_link_config *link, rekv_backend **out, rekv_err *err)
{
    *out = NULL;
    cpu_backend *be = calloc(1, sizeof(*be));
    if (be == NULL)
        return rekv_errf(err, -ENOMEM, "cpu backend: out of memory");
    be->base.iface = &rekv_cpu_backend_iface;
    be->base.ctx = be;
    if (link)
        be->link = *link;
    for (int i = 0; i < CPU_LINKS; i++)
        pthread_mutex_init(&be->links[i].mu, NULL);
    pthread_mutex_init(&be->ev_mu, NULL);
    pthread_cond_init(&be->ev_cv, NULL);
    pthread_mutex_init(&be->shm_mu, NULL);
    pthread_mutex_init(&be->stats_mu, NULL);
    pthread_mutex_init(&be->trace_mu, NULL);
    atomic_init(&be->tracing, false);
    atomic_init(&be->timing, false);
    atomic_init(&be->dev_used, 0);
    *out = &be->base;
    return 0;
}
