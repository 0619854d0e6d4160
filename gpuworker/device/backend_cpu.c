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
 * Sharing with other processes (shared buffers, shared events, flag waits) is in
 * backend_cpu_ipc.c; the types both files use are in backend_cpu_internal.h. */
#define _GNU_SOURCE
#include "gpuworker/device/backend_cpu_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "common/clock.h"

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
void cpu_stream_fail(rekv_stream *s, int code, const char *fmt, ...)
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
void cpu_trace_span(cpu_backend *be, uint32_t tid, const char *label, uint64_t start_ns,
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

bool cpu_tracing(const cpu_backend *be)
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
            cpu_stream_fail(s, -EINVAL, "stream %s: a listed copy of %zu pieces (room for %zu)",
                            s->name, t->u.copy.n, t->u.copy.later_max);
            return;
        }
        if (rekv_copy_check("h2d", pieces, t->u.copy.n, t->u.copy.kind, &t->u.copy.bytes, why,
                            sizeof(why)) < 0) {
            cpu_stream_fail(s, -EINVAL, "stream %s: %s", s->name, why);
            return;
        }
    }
    bool throttled = dir != CPU_COPY_D2D && be->link.gbps > 0;

    if (dir != CPU_COPY_D2D)
        pthread_mutex_lock(&be->links[dir].mu);
    uint64_t start = rekv_now_ns();
    if (throttled) { /* the link's own time (cpu_link): when it and the stream were ready */
        uint64_t ready = s->vt > t->enq_ns ? s->vt : t->enq_ns;
        start = ready > be->links[dir].free_ns ? ready : be->links[dir].free_ns;
    }
    for (size_t i = 0; i < t->u.copy.n; i++)
        if (pieces[i].bytes > 0)
            memmove(pieces[i].dst, pieces[i].src, pieces[i].bytes);
    uint64_t end = rekv_now_ns();
    if (throttled) {
        double dur_ns = be->link.latency_us * 1e3 + (double)t->u.copy.bytes * 8.0 / be->link.gbps;
        uint64_t due = start + (uint64_t)(dur_ns > 0 ? dur_ns : 0);
        if (end < due)
            sleep_until_ns(due);
        end = due;
        be->links[dir].free_ns = due;
    }
    s->vt = end;
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
    if (cpu_tracing(be)) {
        static const char *const dir_names[] = {"h2d", "d2h", "d2d"};
        char label[64];
        rekv_copy_label(label, sizeof(label), dir_names[dir], t->u.copy.kind, t->u.copy.bytes);
        cpu_trace_span(be, s->tid, label, start, end);
    }
}

static void run_host(rekv_stream *s, cpu_task *t)
{
    cpu_backend *be = s->be;
    uint64_t start = rekv_now_ns();
    t->u.host.fn(t->u.host.arg);
    uint64_t end = rekv_now_ns();
    s->vt = end;
    if (t->timed) {
        pthread_mutex_lock(&be->stats_mu);
        be->stats.compute_busy_s += (double)(end - start) * 1e-9;
        pthread_mutex_unlock(&be->stats_mu);
    }
    cpu_trace_span(be, s->tid, t->u.host.name, start, end);
}

static void run_record(rekv_stream *s, cpu_task *t)
{
    cpu_backend *be = s->be;
    pthread_mutex_lock(&be->ev_mu);
    t->u.comp->done = true;
    t->u.comp->done_ns = s->vt;
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
    if (t->u.comp->done_ns > s->vt)
        s->vt = t->u.comp->done_ns;
    completion_unref_locked(t->u.comp);
    pthread_mutex_unlock(&be->ev_mu);
    uint64_t end = rekv_now_ns();
    if (end - start > CPU_WAIT_SPAN_MIN_NS)
        cpu_trace_span(be, s->tid, "wait", start, end);
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
            cpu_run_ipc_record(s, t);
            break;
        case CPU_TASK_IPC_WAIT: /* another process's time: when the wait returned */
            cpu_run_ipc_wait(s, t);
            s->vt = rekv_now_ns();
            break;
        case CPU_TASK_FLAG_WAIT:
            cpu_run_flag_wait(s, t);
            s->vt = rekv_now_ns();
            break;
        case CPU_TASK_FLAG_WRITE:
            cpu_run_flag_write(s, t);
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

cpu_task *cpu_task_new(rekv_stream *s, cpu_task_type type, size_t payload_bytes)
{
    cpu_task *t = calloc(1, sizeof(*t) + payload_bytes);
    if (t == NULL) {
        cpu_stream_fail(s, -ENOMEM, "stream %s: out of memory queueing a task", s->name);
        return NULL;
    }
    t->type = type;
    t->timed = atomic_load_explicit(&s->be->timing, memory_order_relaxed) || cpu_tracing(s->be);
    t->payload_bytes = payload_bytes;
    return t;
}

void cpu_task_push(rekv_stream *s, cpu_task *t)
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
    t->enq_ns = rekv_now_ns();
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
        cpu_stream_fail(s, -EINVAL, "stream %s: %s", s->name, why);
        return;
    }
    t = cpu_task_new(s, CPU_TASK_COPY, n * sizeof(rekv_copy_piece));
    if (t == NULL)
        return;
    t->u.copy.dir = dir;
    t->u.copy.kind = kind;
    t->u.copy.n = n;
    t->u.copy.bytes = bytes;
    if (n > 0)
        memcpy(t->payload, pieces, n * sizeof(rekv_copy_piece));
    cpu_task_push(s, t);
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

static void cpu_copy_h2d_listed(rekv_stream *s, const rekv_copy_piece *pieces, const size_t *n,
                                size_t max, rekv_xfer_kind kind)
{
    if (pieces == NULL || n == NULL || (unsigned)kind >= REKV_XFER_KINDS) {
        cpu_stream_fail(s, -EINVAL,
                        "stream %s: a listed copy needs its pieces, their count and a kind",
                        s->name);
        return;
    }
    cpu_task *t = cpu_task_new(s, CPU_TASK_COPY, 0);
    if (t == NULL)
        return;
    t->u.copy.dir = CPU_COPY_H2D;
    t->u.copy.kind = kind;
    t->u.copy.later = pieces;
    t->u.copy.later_n = n;
    t->u.copy.later_max = max;
    cpu_task_push(s, t);
}

/* arg_bytes == 0 passes arg itself through (nothing to copy), so a kernel may take a pointer to
 * state the caller keeps alive until the stream has run it. */
static void cpu_launch_host(rekv_stream *s, const char *name, rekv_host_fn fn, const void *arg,
                            size_t arg_bytes)
{
    if (fn == NULL) {
        cpu_stream_fail(s, -EINVAL, "stream %s: launch of kernel %s with a NULL function", s->name,
                        name ? name : "(unnamed)");
        return;
    }
    if (arg_bytes > 0 && arg == NULL) {
        cpu_stream_fail(s, -EINVAL, "stream %s: kernel %s: NULL argument of %zu bytes", s->name,
                        name ? name : "(unnamed)", arg_bytes);
        return;
    }
    cpu_task *t = cpu_task_new(s, CPU_TASK_HOST, arg_bytes);
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
    cpu_task_push(s, t);
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

static void cpu_dev_free(rekv_backend *base, void *p)
{
    cpu_backend *be = base->ctx;
    cpu_shared_buf *sb = p != NULL ? cpu_shared_take(be, p, false) : NULL;
    if (sb != NULL) {
        cpu_shared_free(sb);
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

/* REKV_TEST_DEVICE_LOST (rekv_backend_cpu_create): whether this sync finds the device lost. */
static bool device_lost_at_sync(cpu_backend *be, const rekv_stream *s)
{
    if (be->lost_after > 0 && strcmp(s->name, "compute") == 0 &&
        atomic_fetch_add(&be->compute_syncs, 1) + 1 >= be->lost_after)
        atomic_store(&be->lost, true);
    return atomic_load(&be->lost);
}

/* stream_sync's wait and report, not counted */
static int stream_drain(rekv_stream *s, rekv_err *err)
{
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    while (s->head != NULL || s->busy)
        pthread_cond_wait(&s->idle_cv, &s->mu);
    if (device_lost_at_sync(s->be, s)) {
        /* as a sticky CUDA error: this failure replaces any other the stream kept */
        rc = rekv_errf(err, -ENODEV,
                       "cpu backend: stream %s: device lost (REKV_TEST_DEVICE_LOST=%ld, a test's "
                       "stand-in for a sticky CUDA error)",
                       s->name, s->be->lost_after);
        s->err_code = 0;
        s->err_msg[0] = '\0';
    } else if (s->err_code != 0) {
        rc = rekv_errf(err, s->err_code, "%s", s->err_msg);
        s->err_code = 0;
        s->err_msg[0] = '\0';
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int cpu_stream_sync(rekv_stream *s, rekv_err *err)
{
    count_host_sync(s->be);
    return stream_drain(s, err);
}

static int cpu_streams_sync(rekv_stream *const *s, int n, rekv_err *err)
{
    int rc = 0;
    if (n > 0)
        count_host_sync(s[0]->be);
    for (int i = 0; i < n; i++) {
        int r = stream_drain(s[i], rc ? NULL : err);
        rc = rc ? rc : r;
    }
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
    bool timed = atomic_load_explicit(&s->be->timing, memory_order_relaxed) || cpu_tracing(s->be);
    for (size_t i = 0; i < g->n; i++) {
        const cpu_task *src = g->tasks[i];
        cpu_task *t = malloc(sizeof(*t) + src->payload_bytes);
        if (t == NULL) {
            cpu_stream_fail(s, -ENOMEM, "stream %s: out of memory launching a graph", s->name);
            return;
        }
        memcpy(t, src, sizeof(*t) + src->payload_bytes);
        if (t->type == CPU_TASK_HOST && src->u.host.arg == (const void *)src->payload)
            t->u.host.arg = t->payload;
        t->next = NULL;
        t->timed = timed;
        cpu_task_push(s, t);
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
        cpu_ipc_map_unref(ev->ipc);
        free(ev);
        return;
    }
    /* enqueued records and waits hold their own references and still run */
    pthread_mutex_lock(&ev->be->ev_mu);
    completion_unref_locked(ev->latest);
    pthread_mutex_unlock(&ev->be->ev_mu);
    free(ev);
}

static void cpu_event_record(rekv_event *ev, rekv_stream *s)
{
    cpu_backend *be = ev->be;
    if (ev->ipc != NULL) {
        cpu_ipc_event_record(ev, s);
        return;
    }
    cpu_completion *c = calloc(1, sizeof(*c));
    cpu_task *t = cpu_task_new(s, CPU_TASK_RECORD, 0);
    if (c == NULL || t == NULL) {
        cpu_stream_fail(s, -ENOMEM, "stream %s: out of memory recording an event", s->name);
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
    cpu_task_push(s, t);
}

static void cpu_stream_wait_event(rekv_stream *s, rekv_event *ev)
{
    cpu_backend *be = ev->be;
    cpu_completion *c;

    if (ev->ipc != NULL) {
        cpu_ipc_event_wait(s, ev);
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

    cpu_task *t = cpu_task_new(s, CPU_TASK_WAIT, 0);
    if (t == NULL) {
        pthread_mutex_lock(&be->ev_mu);
        completion_unref_locked(c);
        pthread_mutex_unlock(&be->ev_mu);
        return;
    }
    t->u.comp = c;
    cpu_task_push(s, t);
}

static void cpu_event_sync(rekv_event *ev)
{
    cpu_backend *be = ev->be;
    count_host_sync(be);
    if (ev->ipc != NULL) {
        cpu_ipc_event_sync(ev);
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
        cpu_shared_free(sb);
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
    .copy_h2d_listed = cpu_copy_h2d_listed,
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
    .streams_sync = cpu_streams_sync,
};

int rekv_backend_cpu_create(const rekv_link_config *link, rekv_backend **out, rekv_err *err)
{
    *out = NULL;
    long lost_after = 0;
    const char *lost = getenv("REKV_TEST_DEVICE_LOST");
    if (lost != NULL && *lost != '\0') {
        char *end = NULL;
        errno = 0;
        lost_after = strtol(lost, &end, 10);
        if (errno != 0 || *end != '\0' || lost_after < 1)
            return rekv_errf(err, -EINVAL,
                             "cpu backend: REKV_TEST_DEVICE_LOST=%s: expected the count of "
                             "compute-stream syncs after which the device is lost (1 or more)",
                             lost);
    }
    cpu_backend *be = calloc(1, sizeof(*be));
    if (be == NULL)
        return rekv_errf(err, -ENOMEM, "cpu backend: out of memory");
    be->lost_after = lost_after;
    atomic_init(&be->compute_syncs, 0);
    atomic_init(&be->lost, false);
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
