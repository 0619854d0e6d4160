/* backend_cpu_ipc.c — the cpu backend's sharing with other processes: shared buffers, shared
 * events and flag waits (the stream tasks that run them are here too).
 *
 * It works as CUDA IPC does, on memfd: a shared buffer is a memfd mapping, and an exported event
 * keeps its state (a record counter and a completion counter) in a memfd page of its own, so a
 * record in one process and a wait in another order work across them. An importer opens the
 * exporter's memfd through /proc/PID/fd/FD, so nothing is ever named in /dev/shm and nothing
 * outlives the processes. Waits on shared events and on flags sleep on a futex in the shared page
 * (not a private one, so a wake reaches other processes). */
#define _GNU_SOURCE
#include "gpuworker/device/backend_cpu_internal.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "gpuworker/device/ipc_memfd.h"

/* A flag wait re-reads the flag at least this often, for writers that store without waking the
 * futex (a plain store, another backend). */
#define CPU_FLAG_POLL_NS 1000000l

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

void cpu_ipc_map_unref(cpu_ipc_map *m)
{
    if (m == NULL || atomic_fetch_sub(&m->refs, 1) != 1)
        return;
    munmap(m->page, CPU_IPC_PAGE_BYTES);
    if (m->fd >= 0)
        close(m->fd);
    free(m);
}

void cpu_run_ipc_record(rekv_stream *s, cpu_task *t)
{
    ipc_page_complete(t->u.ipc.map->page, t->u.ipc.gen);
    cpu_ipc_map_unref(t->u.ipc.map);
}

void cpu_run_ipc_wait(rekv_stream *s, cpu_task *t)
{
    uint64_t start = rekv_now_ns();
    int32_t rec = __atomic_load_n(&t->u.ipc.map->page->recorder, __ATOMIC_ACQUIRE);
    if (ipc_page_wait(t->u.ipc.map->page, t->u.ipc.gen) != 0)
        cpu_stream_fail(
            s, -EPIPE,
            "cpu stream %s: a shared event's recording process (pid %d) died before the "
            "recorded work finished",
            s->name, (int)rec);
    cpu_ipc_map_unref(t->u.ipc.map);
    uint64_t end = rekv_now_ns();
    if (end - start > CPU_WAIT_SPAN_MIN_NS)
        cpu_trace_span(s->be, s->tid, "wait ipc event", start, end);
}

/* A wait, not compute: traced, but not in compute_busy_s. */
void cpu_run_flag_wait(rekv_stream *s, cpu_task *t)
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
    if (end - start > CPU_WAIT_SPAN_MIN_NS && cpu_tracing(s->be)) {
        char label[48];
        snprintf(label, sizeof(label), "wait flag >= %u", (unsigned)value);
        cpu_trace_span(s->be, s->tid, label, start, end);
    }
}

void cpu_run_flag_write(rekv_stream *s, cpu_task *t)
{
    /* the stream's earlier tasks ran on this thread: the release publishes what they wrote */
    __atomic_store_n(t->u.flag.addr, t->u.flag.value, __ATOMIC_RELEASE);
    futex_wake_word(t->u.flag.addr);
}

/* Takes p's entry off the list of shared buffers (only if imported, when imported_only); NULL
 * when p is no such buffer. */
cpu_shared_buf *cpu_shared_take(cpu_backend *be, const void *p, bool imported_only)
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

void cpu_shared_free(cpu_shared_buf *sb)
{
    munmap(sb->p, sb->len);
    if (sb->fd >= 0)
        close(sb->fd);
    free(sb);
}

/* A shared event: the generation is taken now, so a wait enqueued after this call, in any process,
 * waits for this record. */
void cpu_ipc_event_record(rekv_event *ev, rekv_stream *s)
{
    cpu_task *t = cpu_task_new(s, CPU_TASK_IPC_RECORD, 0);
    if (t == NULL)
        return;
    atomic_fetch_add(&ev->ipc->refs, 1);
    t->u.ipc.map = ev->ipc;
    __atomic_store_n(&ev->ipc->page->recorder, (int32_t)getpid(), __ATOMIC_RELEASE);
    t->u.ipc.gen = __atomic_add_fetch(&ev->ipc->page->recorded, 1, __ATOMIC_SEQ_CST);
    cpu_task_push(s, t);
}

void cpu_ipc_event_wait(rekv_stream *s, rekv_event *ev)
{
    cpu_ipc_page *pg = ev->ipc->page;
    uint64_t gen = __atomic_load_n(&pg->recorded, __ATOMIC_SEQ_CST);
    if (gen == 0 || __atomic_load_n(&pg->completed, __ATOMIC_ACQUIRE) >= gen)
        return; /* never recorded, or already complete */
    cpu_task *t = cpu_task_new(s, CPU_TASK_IPC_WAIT, 0);
    if (t == NULL)
        return;
    atomic_fetch_add(&ev->ipc->refs, 1);
    t->u.ipc.map = ev->ipc;
    t->u.ipc.gen = gen;
    cpu_task_push(s, t);
}

/* The ipc half of cpu_event_sync: waits for the latest record, in any process. */
void cpu_ipc_event_sync(rekv_event *ev)
{
    cpu_ipc_page *pg = ev->ipc->page;
    (void)ipc_page_wait(pg, __atomic_load_n(&pg->recorded, __ATOMIC_SEQ_CST));
}

/* ---- sharing with other processes ---- */

static void ipc_handle_fill(rekv_ipc_handle *h, rekv_ipc_kind kind, uint64_t bytes, int fd,
                            uint64_t nonce)
{
    cpu_ipc_payload pl = {(int32_t)getpid(), fd, nonce};
    rekv_ipc_handle_init(h, kind, "cpu", bytes);
    memcpy(h->payload, &pl, sizeof(pl));
}

/* Opens the memfd a cpu handle names (ipc_memfd.h): the new fd or a negative errno. */
static int ipc_open(const rekv_ipc_handle *h, const char *prefix, size_t len, const char *what,
                    rekv_err *err)
{
    cpu_ipc_payload pl;
    memcpy(&pl, h->payload, sizeof(pl));
    return rekv_ipc_memfd_open("cpu", &pl, prefix, len, what, err);
}

static void shared_add(cpu_backend *be, cpu_shared_buf *sb)
{
    pthread_mutex_lock(&be->shm_mu);
    sb->next = be->shared;
    be->shared = sb;
    pthread_mutex_unlock(&be->shm_mu);
}

void *cpu_dev_alloc_shared(rekv_backend *base, size_t bytes, rekv_ipc_handle *out, rekv_err *err)
{
    cpu_backend *be = base->ctx;
    uint64_t nonce = rekv_ipc_nonce();
    cpu_shared_buf *sb = calloc(1, sizeof(*sb));
    if (sb == NULL) {
        rekv_errf(err, -ENOMEM, "cpu backend: out of memory");
        return NULL;
    }
    sb->len = bytes ? bytes : 1; /* a unique pointer for zero bytes too, as dev_alloc */
    sb->fd = rekv_ipc_memfd_create("cpu", "rekv-dev-", nonce, sb->len, &sb->p, err);
    if (sb->fd < 0) {
        free(sb);
        return NULL;
    }
    shared_add(be, sb);
    ipc_handle_fill(out, REKV_IPC_MEM, bytes, sb->fd, nonce);
    return sb->p;
}

int cpu_dev_import(rekv_backend *base, const rekv_ipc_handle *h, void **dev, size_t *bytes,
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

void cpu_dev_unimport(rekv_backend *base, void *dev)
{
    cpu_backend *be = base->ctx;
    cpu_shared_buf *sb = dev != NULL ? cpu_shared_take(be, dev, true) : NULL;
    if (sb != NULL)
        cpu_shared_free(sb);
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

int cpu_event_create_shared(rekv_backend *base, rekv_event **out, rekv_err *err)
{
    uint64_t nonce = rekv_ipc_nonce();
    void *map = NULL;
    rekv_ipc_handle h;

    *out = NULL;
    int fd = rekv_ipc_memfd_create("cpu", "rekv-ev-", nonce, CPU_IPC_PAGE_BYTES, &map, err);
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

int cpu_event_export(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err)
{
    if (ev->ipc == NULL)
        return rekv_errf(err, -EINVAL,
                         "cpu backend: event_export: the event was made by "
                         "event_create; only event_create_shared's can be exported");
    *out = ev->ipc->handle;
    return 0;
}

int cpu_event_import(rekv_backend *base, const rekv_ipc_handle *h, rekv_event **out, rekv_err *err)
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
        cpu_stream_fail(s, -EINVAL, "stream %s: %s: flag %p is %s", s->name, what,
                        (const void *)flag, flag == NULL ? "NULL" : "not 4-byte aligned");
        return false;
    }
    return true;
}

void cpu_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value)
{
    if (!flag_ok(s, flag, "wait for flag"))
        return;
    cpu_task *t = cpu_task_new(s, CPU_TASK_FLAG_WAIT, 0);
    if (t == NULL)
        return;
    t->u.flag.addr = (uint32_t *)flag; /* only read */
    t->u.flag.value = value;
    cpu_task_push(s, t);
}

void cpu_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value)
{
    if (!flag_ok(s, flag, "write flag"))
        return;
    cpu_task *t = cpu_task_new(s, CPU_TASK_FLAG_WRITE, 0);
    if (t == NULL)
        return;
    t->u.flag.addr = flag;
    t->u.flag.value = value;
    cpu_task_push(s, t);
}
