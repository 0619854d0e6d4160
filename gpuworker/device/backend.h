/* backend.h — the device runtime: what the engine (gpuworker/) and the kvstore's push path run on.
 *
 * The device room (gpuworker/device/) uses nothing above common/. A backend is a table of function
 * pointers (rekv_backend_iface) and its context, as in ggml-backend: device buffers, streams,
 * events, asynchronous copies in each direction and their coalescing, link and memory emulation,
 * buffers and events shared with other processes, and stream waits on flags. Work enqueued on one
 * stream runs in order; streams run concurrently; events order work across streams. Nothing
 * enqueued blocks the caller, except the *_sync calls. The compute side — GEMM and the forward
 * pass's kernels — is the engine's (gpuworker/kernels.h), launched on these streams.
 *
 * Two backends implement it:
 * - cpu (backend_cpu.c): "device" memory is host memory; every stream is a worker thread with a
 *   FIFO of tasks (launch_host runs a function on it: the cpu kernels are such tasks). Optional
 *   link emulation throttles host<->device copies to a bandwidth and latency so that the
 *   pipeline's overlap shows in wall-clock time without a GPU.
 * - cuda (built when nvcc is present): cudaMalloc, CUDA streams and events, CUDA IPC.
 *
 * Every copy is tagged with what it moves (weights, KV, activations), and the backend counts bytes
 * per kind and direction exactly, and, while timing is on, the time each stream was busy. A trace
 * of every task (a span per task, a track per stream) can be written as Chrome trace JSON for
 * Perfetto.
 *
 * Errors: functions that can fail return 0 or a negative errno and fill a rekv_err. Asynchronous
 * work cannot report at enqueue time; a failure inside a task is kept by its stream and returned by
 * the next rekv_stream_sync.
 *
 * Device lost: -ENODEV from stream_sync means the device is unusable for the rest of the process —
 * on cuda a sticky error (an illegal address, a launch failure, ...: CUDA documents that the
 * context is corrupt, every later call fails the same way, and only a new process gets a working
 * device); the message names the CUDA error. Every later stream_sync fails so too. A program that
 * sees it ends with a non-zero exit (the worker does, and its supervisor starts it again) instead
 * of failing every later job on the broken context. The cpu backend loses its device only when a
 * test asks (REKV_TEST_DEVICE_LOST, rekv_backend_cpu_create), so the programs' handling of the
 * loss is tested without a GPU. */
#ifndef REKV_GPUWORKER_DEVICE_BACKEND_H
#define REKV_GPUWORKER_DEVICE_BACKEND_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>

#include "common/err.h"

typedef struct rekv_backend rekv_backend;
typedef struct rekv_stream rekv_stream;
typedef struct rekv_event rekv_event;
typedef struct rekv_graph rekv_graph;

/* What a copy moves; counters are kept per kind. */
typedef enum rekv_xfer_kind {
    REKV_XFER_WEIGHTS = 0,
    REKV_XFER_KV = 1,
    REKV_XFER_ACT = 2,
    REKV_XFER_OTHER = 3, /* tokens, logits, small control data */
    REKV_XFER_KINDS = 4,
} rekv_xfer_kind;

/* GPU emulation (cpu backend). Link: each direction is a link of its own, as PCIe is full duplex;
 * a copy of n bytes occupies its direction's link for latency_us + n / (gbps * 1e9 / 8 bits)
 * seconds; gbps <= 0: no throttling. Memory: dev_alloc fails beyond device_bytes in use, and
 * mem_info reports them, as a GPU of that size would; 0: no limit (mem_info says -ENOTSUP). */
typedef struct rekv_link_config {
    double gbps;           /* gigabits per second, each direction */
    double latency_us;     /* per copy operation (a gather of pieces counts once) */
    uint64_t device_bytes; /* emulated device memory; 0: unlimited */
} rekv_link_config;

/* One piece of a gathered or scattered copy. */
typedef struct rekv_copy_piece {
    void *dst;
    const void *src;
    size_t bytes;
} rekv_copy_piece;

/* Exact, machine-independent counters, plus busy time per stream role. */
typedef struct rekv_backend_stats {
    uint64_t h2d_bytes[REKV_XFER_KINDS]; /* host -> device, by kind */
    uint64_t d2h_bytes[REKV_XFER_KINDS]; /* device -> host, by kind */
    uint64_t h2d_copies, d2h_copies;     /* copy operations (a gather counts once) */
    uint64_t h2d_gathered;               /* h2d rows a device-side gather read (cuda) */
    uint64_t host_syncs;   /* calls that blocked their caller until device work finished:
                              stream_sync, event_sync, and the backend's own waits (cuda) */
    double compute_busy_s; /* time streams spent running kernels */
    double h2d_busy_s;     /* time the host->device link was occupied */
    double d2h_busy_s;     /* time the device->host link was occupied */
} rekv_backend_stats;

/* A handle naming a device buffer or an event of one process, for another process on the same
 * machine to import (CUDA IPC on cuda, memfd on cpu): 128 bytes of plain data, so it can travel in
 * any message. The header is common to every backend; the payload is the exporting backend's
 * own, and importers check the header before reading it, so a garbage, truncated or wrong-kind
 * handle is refused with a message, never used. Layout (host byte order, same machine only):
 *   cuda: payload = cudaIpcMemHandle_t or cudaIpcEventHandle_t (64 bytes each); an event's extra
 *         = {int32 pid, int32 fd, uint64 nonce} of a memfd page beside the event (ipc_memfd.h)
 *         where each record writes its process, so that a waiter can tell a dead recorder;
 *   cpu:  payload = {int32 pid, int32 fd, uint64 nonce}: the exporter's memfd, opened through
 *         /proc/PID/fd/FD, whose name carries the nonce, so a handle whose process has exited or
 *         whose buffer was freed (the fd number reused) is refused, not mapped. */
#define REKV_IPC_MAGIC 0x50494b52u /* "RKIP" as little-endian bytes */
#define REKV_IPC_VERSION 1
typedef enum rekv_ipc_kind {
    REKV_IPC_MEM = 1,   /* a device buffer from dev_alloc_shared */
    REKV_IPC_EVENT = 2, /* an event from event_create_shared */
} rekv_ipc_kind;
typedef struct rekv_ipc_handle {
    uint32_t magic;       /* REKV_IPC_MAGIC */
    uint16_t version;     /* REKV_IPC_VERSION */
    uint16_t kind;        /* rekv_ipc_kind */
    char backend[8];      /* the exporting backend's name, NUL-padded: "cpu", "cuda" */
    uint64_t bytes;       /* REKV_IPC_MEM: the buffer's size; 0 for an event */
    uint8_t extra[16];    /* the exporting backend's, beside the payload (above); else zero */
    uint8_t reserved[24]; /* zero */
    uint8_t payload[64];  /* the exporting backend's (above) */
} rekv_ipc_handle;
#ifdef __cplusplus
static_assert(sizeof(rekv_ipc_handle) == 128, "an IPC handle is 128 bytes");
#else
_Static_assert(sizeof(rekv_ipc_handle) == 128, "an IPC handle is 128 bytes");
#endif

/* For backends: a handle with its header filled and a zero payload. */
static inline void rekv_ipc_handle_init(rekv_ipc_handle *h, rekv_ipc_kind kind, const char *backend,
                                        uint64_t bytes)
{
    memset(h, 0, sizeof(*h));
    h->magic = REKV_IPC_MAGIC;
    h->version = REKV_IPC_VERSION;
    h->kind = (uint16_t)kind;
    for (size_t i = 0; i + 1 < sizeof(h->backend) && backend[i]; i++)
        h->backend[i] = backend[i];
    h->bytes = bytes;
}

/* For backends, before reading a payload: 0, or -EINVAL with err saying what is wrong — not a
 * handle (garbage), another version, another backend's, or the other kind. what names the call
 * for the message, e.g. "cuda backend: dev_import". */
static inline int rekv_ipc_handle_check(const rekv_ipc_handle *h, rekv_ipc_kind kind,
                                        const char *backend, const char *what, rekv_err *err)
{
    static const char *const kinds[] = {"of unknown kind", "a buffer's", "an event's"};
    char name[sizeof(h->backend) + 1] = {0};
    if (h == NULL)
        return rekv_errf(err, -EINVAL, "%s: NULL handle", what);
    if (h->magic != REKV_IPC_MAGIC)
        return rekv_errf(err, -EINVAL, "%s: not a rekv IPC handle (magic 0x%08x)", what,
                         (unsigned)h->magic);
    if (h->version != REKV_IPC_VERSION)
        return rekv_errf(err, -EINVAL, "%s: IPC handle version %u (this build reads %d)", what,
                         (unsigned)h->version, REKV_IPC_VERSION);
    memcpy(name, h->backend, sizeof(h->backend));
    if (strcmp(name, backend) != 0)
        return rekv_errf(err, -EINVAL, "%s: the handle is the %s backend's", what, name);
    if (h->kind != kind)
        return rekv_errf(err, -EINVAL, "%s: the handle is %s, not %s", what,
                         kinds[h->kind == REKV_IPC_MEM || h->kind == REKV_IPC_EVENT ? h->kind : 0],
                         kinds[kind]);
    return 0;
}

/* A kernel run on the cpu backend as a task: fn(arg) runs on the stream's thread. */
typedef void (*rekv_host_fn)(void *arg);

/* The table every backend fills. Entries marked optional may be NULL; the wrappers below fall
 * back (e.g. a gather becomes one copy per piece). */
typedef struct rekv_backend_iface {
    const char *name; /* "cpu", "cuda" */
    void (*destroy)(rekv_backend *be);

    /* device memory; alloc returns NULL when out of memory */
    void *(*dev_alloc)(rekv_backend *be, size_t bytes);
    void (*dev_free)(rekv_backend *be, void *p);
    /* optional: host memory kernels can read directly (per-step metadata: positions, descriptors,
     * convert lists) — pinned and mapped on cuda. NULL: malloc/free (the cpu backend). */
    void *(*host_alloc)(rekv_backend *be, size_t bytes);
    void (*host_free)(rekv_backend *be, void *p);

    /* streams run their work in order; name labels the stream's trace track */
    int (*stream_create)(rekv_backend *be, const char *name, rekv_stream **out, rekv_err *err);
    void (*stream_destroy)(rekv_stream *s); /* waits for its work first */
    int (*stream_sync)(rekv_stream *s, rekv_err *err);

    int (*event_create)(rekv_backend *be, rekv_event **out, rekv_err *err);
    void (*event_destroy)(rekv_event *ev);
    /* ev completes when all work enqueued on s before this call has finished; re-recording an
     * event replaces what it waits for, as cudaEventRecord does */
    void (*event_record)(rekv_event *ev, rekv_stream *s);
    /* work enqueued on s after this call starts only after ev (as last recorded) completes */
    void (*stream_wait_event)(rekv_stream *s, rekv_event *ev);
    void (*event_sync)(rekv_event *ev);

    /* asynchronous copies; the pieces array is copied at enqueue, the memory it points to must
     * stay valid until the work completes */
    void (*copy_h2d)(rekv_stream *s, const rekv_copy_piece *pieces, size_t n, rekv_xfer_kind kind);
    void (*copy_d2h)(rekv_stream *s, const rekv_copy_piece *pieces, size_t n, rekv_xfer_kind kind);
    void (*copy_d2d)(rekv_stream *s, const rekv_copy_piece *pieces, size_t n);
    /* optional: a host->device gather whose list a kernel earlier on s wrote (infinigen's
     * selection and clo's decisions on the device, kernels.h): when the stream reaches it, *n
     * pieces (at most max; more fail the stream on cpu, are cut to max on cuda) from pieces[0];
     * pieces of 0 bytes move nothing. pieces and n are host_alloc memory (the device writes and
     * reads them through the mapping; the caller keeps them until the stream's next stream_sync)
     * and each source is where the device reads host_register'd memory (host_mapped), so that on
     * cuda the gather kernel runs with no host function before it. Counted as one copy, its bytes
     * when the stream has reached it (cpu) or at its stream's next stream_sync (cuda). NULL: not
     * supported. */
    void (*copy_h2d_listed)(rekv_stream *s, const rekv_copy_piece *pieces, const size_t *n,
                            size_t max, rekv_xfer_kind kind);

    /* cpu backend: runs fn(copy of arg) on the stream; name labels the trace span. The cuda
     * backend runs host functions with cudaLaunchHostFunc. */
    void (*launch_host)(rekv_stream *s, const char *name, rekv_host_fn fn, const void *arg,
                        size_t arg_bytes);

    void (*stats)(rekv_backend *be, rekv_backend_stats *out);
    void (*stats_reset)(rekv_backend *be);
    /* busy times (stats) are measured only for work enqueued while timing is on or a trace
     * records (trace_start): timing is off at creation, since on cuda every timed copy and kernel
     * costs two events. Byte and copy counters are exact either way. */
    void (*timing)(rekv_backend *be, bool on);
    /* trace: record spans from now on (clearing earlier ones) / write them as Chrome trace JSON */
    void (*trace_start)(rekv_backend *be);
    int (*trace_write)(rekv_backend *be, const char *path, rekv_err *err);

    /* optional: page-locks host memory the device copies from and to (the kvstore arena), so
     * copies are DMA and overlap (cudaHostRegister). NULL: nothing to do (the cpu backend). */
    int (*host_register)(rekv_backend *be, void *p, size_t bytes, rekv_err *err);
    void (*host_unregister)(rekv_backend *be, void *p);

    /* ---- optional: sharing with other processes (the push path: a transfer engine in another
     * process writes into device receive buffers this process exports, and signals through an
     * event this process's streams wait on). NULL: the backend cannot share. Handles are only
     * meaningful on the same machine, to a backend of the same kind. ---- */

    /* device memory another process can import; *out names it. Freed with dev_free as usual,
     * which must come after every importer's dev_unimport (on cuda, freeing memory another
     * process still maps is undefined). NULL on failure, with err filled. */
    void *(*dev_alloc_shared)(rekv_backend *be, size_t bytes, rekv_ipc_handle *out, rekv_err *err);
    /* maps a buffer another process exported: *dev is usable as device memory on this backend's
     * streams, *bytes (may be NULL) is its size. Released with dev_unimport, never dev_free. On
     * cuda the exporter must be another process (a CUDA restriction). */
    int (*dev_import)(rekv_backend *be, const rekv_ipc_handle *h, void **dev, size_t *bytes,
                      rekv_err *err);
    /* once the work that uses it has finished, as dev_free */
    void (*dev_unimport)(rekv_backend *be, void *dev);
    /* an event that can be exported: as event_create otherwise (CUDA needs to know at creation,
     * cudaEventInterprocess). Its completion state is shared, so a record in one process and a
     * wait in another order work across them; the wait orders against the last record *as of the
     * wait's call*, in any process, so the producer records and then tells the consumer. When
     * records of one event are in flight on several streams at once, a wait may be released by a
     * later record's completion (cpu: a completion counter) — export events one producer stream
     * records at a time. A wait on a record whose process dies before completing it does not
     * wait for ever: the waiting stream's next stream_sync fails -EPIPE, saying so (cpu: the
     * stream's wait gives up, and the stream goes on; cuda: the sync polls while the recorder
     * lives, and the device-side wait stays blocked, so that stream fails every later sync too —
     * make a new one). */
    int (*event_create_shared)(rekv_backend *be, rekv_event **out, rekv_err *err);
    /* names an event from event_create_shared (or one imported: the same handle back); -EINVAL
     * for an event from event_create */
    int (*event_export)(rekv_event *ev, rekv_ipc_handle *out, rekv_err *err);
    /* opens an exported event: used with event_record, stream_wait_event, event_sync and
     * event_destroy like any other */
    int (*event_import)(rekv_backend *be, const rekv_ipc_handle *h, rekv_event **out,
                        rekv_err *err);

    /* ---- optional: GPU-side synchronisation on a flag in host memory the device can read
     * (host_alloc memory, or memory registered with host_register, e.g. the kvstore arena, a
     * memfd shared between processes). flag is 4-byte aligned. NULL: not supported. ---- */

    /* work enqueued on s after this starts only once *flag >= value, compared as CUDA does,
     * (int32_t)(*flag - value) >= 0, so a counter may wrap; never blocks the caller. The flag is
     * re-read until it holds: any writer works (stream_write_flag, a CPU store, another process);
     * on cpu a plain store without stream_write_flag is seen within a millisecond. */
    void (*stream_wait_flag)(rekv_stream *s, const uint32_t *flag, uint32_t value);
    /* once the work enqueued on s before this has finished, stores value to *flag (a release:
     * what that work wrote is visible to whoever sees the value, in any process) */
    void (*stream_write_flag)(rekv_stream *s, uint32_t *flag, uint32_t value);

    /* optional: the device's free and total memory in bytes (cudaMemGetInfo). NULL: the device's
     * memory is the host's (the cpu backend), with no separate limit. */
    int (*mem_info)(rekv_backend *be, size_t *free_bytes, size_t *total_bytes, rekv_err *err);

    /* optional, for a device whose memory is the host's (the cpu backend): host memory p of
     * bytes, which the caller keeps and does not write while it is adopted, made usable as
     * device memory without a copy; counted against the device's memory as dev_alloc's is (NULL
     * when that is full). Given back with dev_unadopt (bytes as adopted), never dev_free. NULL
     * on a device with its own memory (cuda): copy into dev_alloc'd memory instead. */
    void *(*dev_adopt)(rekv_backend *be, const void *p, size_t bytes);
    void (*dev_unadopt)(rekv_backend *be, void *dev, size_t bytes);

    /* ---- optional: graphs (CUDA graphs; on cpu, the tasks kept to be queued again). Between
     * graph_begin(s) and graph_end(s), the kernels and copies enqueued on s are captured instead
     * of run, with their arguments as given (the memory those point to is read when the graph
     * runs); graph_end makes them a graph, or fails (-ENOTSUP, -EIO, a message) when something
     * else was enqueued on s meanwhile (events, waits, flags, host functions: on cpu those still
     * run, on cuda not) or the device refused, and then nothing captured ever runs. graph_launch
     * enqueues a graph's work on a stream as one operation (its copies counted again each time), as
     * often as wanted; graph_destroy frees it once no launch is pending. */
    int (*graph_begin)(rekv_stream *s, rekv_err *err);
    int (*graph_end)(rekv_stream *s, rekv_graph **out, rekv_err *err);
    void (*graph_launch)(rekv_stream *s, rekv_graph *g);
    void (*graph_destroy)(rekv_graph *g);

    /* optional: where the device reads host memory host_register registered (p inside a
     * registered range; cuda: the mapping's device address), or NULL when p is in none. NULL:
     * the device reads host memory at its own address (cpu). */
    const void *(*host_mapped)(rekv_backend *be, const void *p);
    /* stream_sync of s[0..n) as one blocking call (one host sync): waits until the work of each
     * has finished and returns the first failure in that order (with its message; each stream's
     * failures are cleared, as stream_sync clears them). */
    int (*streams_sync)(rekv_stream *const *s, int n, rekv_err *err);
} rekv_backend_iface;

/* Checks a copy before a backend enqueues it (dir: "h2d", "d2h" or "d2d"): 0 with *bytes the
 * total, or -EINVAL with why (one line, to follow "stream NAME: ") for a NULL piece array, an
 * unknown kind, a NULL address of a non-empty piece, or a total that overflows. */
int rekv_copy_check(const char *dir, const rekv_copy_piece *pieces, size_t n, rekv_xfer_kind kind,
                    size_t *bytes, char *why, size_t why_len);

/* A strided copy: height rows of width bytes, row i from src + i * spitch to dst + i * dpitch;
 * it does what pieces[first .. first + count) do. */
typedef struct rekv_copy_run {
    void *dst;
    const void *src;
    size_t width, height, dpitch, spitch;
    size_t first, count;
} rekv_copy_run;

/* Coalesces pieces, in order, into as few runs as a DMA engine needs: a piece that continues the
 * run's single row on both sides extends it, and equal-size pieces at one constant stride on each
 * side (each stride >= the size, < 2^31) stack as rows of one run (cudaMemcpy2DAsync). Empty
 * pieces are skipped. runs holds n entries; returns how many were written. Addresses alone decide:
 * pieces in two allocations that happen to touch merge too, so a backend whose copies must stay
 * inside one allocation falls back to a run's pieces when the merged copy is refused. */
size_t rekv_copy_coalesce(const rekv_copy_piece *pieces, size_t n, rekv_copy_run *runs);

/* A Chrome trace (JSON, for Perfetto) as the backends write it: rekv_trace_begin writes the
 * header — otherData with the backend's name, `extra` members (e.g. "\"device\": 0, ", or ""),
 * the span counts — and a track per stream (tid i + 1 for stream_names[i]); then one
 * rekv_trace_span per span (microseconds); rekv_trace_end closes the file and reports any write
 * error. */
void rekv_trace_begin(FILE *f, const char *backend, const char *extra, size_t n_spans,
                      uint64_t dropped_spans, char *const *stream_names, size_t n_streams);
void rekv_trace_span(FILE *f, uint32_t tid, double ts_us, double dur_us, const char *label);
int rekv_trace_end(FILE *f, const char *path, rekv_err *err);

/* The trace label of a copy, e.g. "h2d KV 1.0 MiB" or "d2d 64 B" (dir: "h2d", "d2h" or "d2d";
 * the kind is left out for d2d). Shared by the backends so their traces read alike. */
void rekv_copy_label(char *buf, size_t cap, const char *dir, rekv_xfer_kind kind, size_t bytes);

/* Host memory through the backend's host_alloc where it has one (pinned and mapped on cuda), else
 * malloc; freed with rekv_host_free (NULL is a no-op). */
void *rekv_host_alloc(rekv_backend *be, size_t bytes);
void rekv_host_free(rekv_backend *be, void *p);

/* No emulation (a real device, or the cpu backend at memory speed), and the latency a copy costs
 * once --link-gbps turns emulation on: every program starts from this one default. */
#define REKV_LINK_NONE ((rekv_link_config){.gbps = 0, .latency_us = 10, .device_bytes = 0})

/* Parses one link emulation option, the same in every program: name is the long option without
 * its dashes, "link-gbps" or "link-latency-us" (each 0 to 1e6) or "device-memory" (a size with a
 * K, M or G suffix); the kvstore's --push-link-* options pass the name without "push-". 0; -EINVAL
 * with "--NAME: expected ..." in err for a bad value; -ENOENT for any other name. */
int rekv_link_parse(rekv_link_config *link, const char *name, const char *arg, rekv_err *err);

/* Whether link asks for any emulation (a link speed or a device memory limit): that is the cpu
 * backend's job, and "auto" then means cpu. */
int rekv_link_emulates(const rekv_link_config *link);

/* The backend a program asked for: "cpu", "cuda", or "auto" (cuda when built with it and a device
 * exists, else cpu; cpu whenever link or memory emulation is asked for). Emulation is the cpu
 * backend's only: "cuda" with it is -EINVAL. *note (may be NULL)
 * receives one line saying what was chosen and why, for the program to print. */
int rekv_backend_create(const char *which, const rekv_link_config *link, rekv_backend **out,
                        char *note, size_t note_len, rekv_err *err);

/* The device memory a KV cache could take, bytes: what mem_info says is free, less a tenth of the
 * device (the backend's own workspace) and less place_bytes (what is still to be placed there:
 * the weights, when they will live on the device); < 0 where the device's memory is the host's
 * (no limit known: mem_info unsupported). */
double rekv_backend_kv_room(rekv_backend *be, double place_bytes);

/* Every backend object starts with this. */
struct rekv_backend {
    const rekv_backend_iface *iface;
    void *ctx;
};

/* Creates the cpu backend. link may be NULL (no throttling). For tests of what a program does when
 * its device is lost: with REKV_TEST_DEVICE_LOST=N in the environment, the Nth stream_sync of a
 * stream named "compute" (the pipeline's, synchronised at the end of every step) and every later
 * stream_sync of any stream fail with -ENODEV, as a sticky CUDA error does; the work itself still
 * runs. A value that is not a count from 1 fails the creation (-EINVAL). */
int rekv_backend_cpu_create(const rekv_link_config *link, rekv_backend **out, rekv_err *err);
/* The cpu backend's table: every cpu stream shares it, so the cpu kernels launch their tasks
 * through its launch_host with only the stream in hand. */
extern const rekv_backend_iface rekv_cpu_backend_iface;

static inline void rekv_backend_destroy(rekv_backend *be)
{
    if (be)
        be->iface->destroy(be);
}

/* Whether the backend can share buffers and events with other processes / wait on flags. */
static inline int rekv_backend_has_ipc(const rekv_backend *be)
{
    const rekv_backend_iface *bi = be->iface;
    return bi->dev_alloc_shared && bi->dev_import && bi->dev_unimport && bi->event_create_shared &&
           bi->event_export && bi->event_import;
}

static inline int rekv_backend_has_flags(const rekv_backend *be)
{
    return be->iface->stream_wait_flag && be->iface->stream_write_flag;
}

/* Where be's device reads host memory p (registered with host_register where the backend has
 * it): the backend's host_mapped, or p itself; NULL where p is not registered. */
static inline const void *rekv_host_mapped(rekv_backend *be, const void *p)
{
    return be->iface->host_mapped ? be->iface->host_mapped(be, p) : p;
}

#endif
