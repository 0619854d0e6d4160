/* backend_cpu_internal.h — the cpu backend's own types, shared by its two files: backend_cpu.c
 * (streams, tasks, events, copies, stats and trace) and backend_cpu_ipc.c (shared buffers, shared
 * events and flag waits across processes). Nothing outside gpuworker/device/backend_cpu*.c
 * includes it. */
#ifndef REKV_DEVICE_BACKEND_CPU_INTERNAL_H
#define REKV_DEVICE_BACKEND_CPU_INTERNAL_H

#include "gpuworker/device/backend.h"
#include "gpuworker/device/ipc_memfd.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Trace spans kept at most; later ones are counted as dropped and the JSON says so. Each span is
 * under 80 bytes, so a full trace stays under 80 MiB. */
#define CPU_TRACE_MAX_SPANS (1u << 20)
/* Event waits shorter than this are not worth a span: they did not hold the stream up. */
#define CPU_WAIT_SPAN_MIN_NS 1000u
/* The shared page of an exported event: its magic, and the bytes mapped. */
#define CPU_IPC_EVENT_MAGIC 0x56454b52u /* "RKEV" */
#define CPU_IPC_PAGE_BYTES 4096u

enum { CPU_LINK_H2D = 0, CPU_LINK_D2H = 1, CPU_LINKS = 2 };

/* One direction of the emulated link. Its mutex is held for the whole of a copy, which is what
 * serialises concurrent copies of the same direction and shares the bandwidth between streams.
 *
 * The link is a DMA engine, not a CPU: an emulated copy starts when the link is free and its
 * stream has reached it (the stream's virtual time, rekv_stream.vt: its previous copy's end, the
 * completion of what it waited for, the enqueue), not when the stream's thread next gets a CPU.
 * On a machine whose cores the compute holds (the GEMM pool), the thread would otherwise wait for
 * the layer's compute to end before starting the next layer's copy, and the link would sit idle
 * that long every layer: weights offloaded at batch 1 showed the link 83% busy where the copies
 * queued back to back. A copy the thread starts late ends at its due time if that is still to
 * come (it sleeps), else at once; the bytes are always moved before the copy's completion. */
typedef struct cpu_link {
    pthread_mutex_t mu; /* held while a copy occupies this direction */
    uint64_t free_ns;   /* under mu: when the last emulated copy's transfer ends */
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
    int refs;         /* the event (while it points here) + record and wait tasks holding it */
    bool done;        /* the recorded work has finished */
    uint64_t done_ns; /* the recording stream's virtual time then (cpu_link) */
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

/* What a cpu handle's payload holds: where its memfd is (ipc_memfd.h), named rekv-dev-<nonce>
 * (a buffer) or rekv-ev-<nonce> (an event's page). */
typedef rekv_ipc_memfd_ref cpu_ipc_payload;

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

    long lost_after;           /* REKV_TEST_DEVICE_LOST: the "compute" sync that loses the
                                  device; 0: never */
    atomic_long compute_syncs; /* stream_syncs of "compute" streams so far */
    atomic_bool lost;          /* the device is lost: every stream_sync fails (-ENODEV) */
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
    uint64_t enq_ns;       /* when it was queued (cpu_task_push) */
    size_t payload_bytes;  /* of payload[] (a graph's copy of the task copies them too) */
    union {
        struct {
            cpu_copy_dir dir;    /* also the index of the link it occupies, unless d2d */
            rekv_xfer_kind kind; /* counted per kind for h2d and d2h */
            size_t n;            /* pieces in payload, as rekv_copy_piece[n] */
            size_t bytes;        /* sum of the pieces' bytes */
            /* listed (copy_h2d_listed): the pieces are *later_n at later, read when the
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
    uint64_t vt;            /* the thread's own: when its last task ended, in the emulated
                               link's time (cpu_link) */
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

/* ---- backend_cpu.c, for backend_cpu_ipc.c ---- */

/* Keeps the first failure of a stream, for the next stream_sync. */
void cpu_stream_fail(rekv_stream *s, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Records a span if tracing; spans that began before trace_start are clipped to it. */
void cpu_trace_span(cpu_backend *be, uint32_t tid, const char *label, uint64_t start_ns,
                    uint64_t end_ns);
bool cpu_tracing(const cpu_backend *be);
/* A task of type with payload_bytes of payload, or NULL (the stream then holds -ENOMEM). */
cpu_task *cpu_task_new(rekv_stream *s, cpu_task_type type, size_t payload_bytes);
/* Queues t on s (or into the graph s is capturing); s owns it from here on. */
void cpu_task_push(rekv_stream *s, cpu_task *t);

/* ---- backend_cpu_ipc.c, for backend_cpu.c ---- */

/* Tasks, run on the stream's thread (stream_main). */
void cpu_run_ipc_record(rekv_stream *s, cpu_task *t);
void cpu_run_ipc_wait(rekv_stream *s, cpu_task *t);
void cpu_run_flag_wait(rekv_stream *s, cpu_task *t);
void cpu_run_flag_write(rekv_stream *s, cpu_task *t);

/* A shared event's record, wait and sync (ev->ipc != NULL). */
void cpu_ipc_event_record(rekv_event *ev, rekv_stream *s);
void cpu_ipc_event_wait(rekv_stream *s, rekv_event *ev);
void cpu_ipc_event_sync(rekv_event *ev);
void cpu_ipc_map_unref(cpu_ipc_map *m);

/* Takes p's entry off the list of shared buffers (only if imported, when imported_only); NULL
 * when p is no such buffer. */
cpu_shared_buf *cpu_shared_take(cpu_backend *be, const void *p, bool imported_only);
void cpu_shared_free(cpu_shared_buf *sb);

/* The interface's entries for sharing (rekv_cpu_backend_iface). */
void *cpu_dev_alloc_shared(rekv_backend *base, size_t bytes, rekv_ipc_handle *out, rekv_err *err);
int cpu_dev_import(rekv_backend *base, const rekv_ipc_handle *h, void **dev, size_t *bytes,
                   rekv_err *err);
void cpu_dev_unimport(rekv_backend *base, void *dev);
int cpu_event_create_shared(rekv_backend *base, rekv_event **out, rekv_err *err);
int cpu_event_export(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err);
int cpu_event_import(rekv_backend *base, const rekv_ipc_handle *h, rekv_event **out, rekv_err *err);
void cpu_stream_wait_flag(rekv_stream *s, const uint32_t *flag, uint32_t value);
void cpu_stream_write_flag(rekv_stream *s, uint32_t *flag, uint32_t value);

#endif
