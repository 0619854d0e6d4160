/* backend_cuda_gather.cu — the cuda runtime's gathers: an h2d copy of many small rows from mapped
 * host memory as one kernel, and listed copies (copy_h2d_listed), whose pieces a kernel before them
 * wrote.
 *
 * Where an h2d call is many small rows from host memory that host_register mapped (infinigen's and
 * clo's selected tokens from the kvstore arena: thousands of rows of a few hundred bytes, each a
 * DMA of microseconds), a gather kernel reads the rows through the mapping instead of a DMA per
 * row — one launch, its row list in a per-stream ring of mapped pinned memory (issue 13's
 * zero-copy gather); a listed copy's list is where the kernel that wrote it left it (issue 44: no
 * host function between a decision and its rows). copy_enqueue (backend_cuda.cu) asks
 * cuda_gather_prepare whether a copy goes this way. */
#include "gpuworker/device/backend_cuda_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The gather: worth it from CU_GATHER_MIN_ROWS rows of at most CU_GATHER_MAX_ROW bytes on average
 * (a DMA costs microseconds whatever its size: below a few tens of KiB that, not the link, is its
 * time). Each warp takes 32 rows, its lanes read their descriptors at once and then copy the rows
 * one after another, 16 bytes a lane where the addresses allow. */
enum {
    CU_GATHER_MIN_ROWS = 32,
    CU_GATHER_MAX_ROW = 32 << 10,
    CU_GATHER_THREADS = 256,
    CU_GATHER_STACK_REGS = 64 /* registered ranges a gather copies on the stack (more: heap) */
};

/* Rows [0, n) of a gather, row i's descriptor desc(i). */
template <class D> __device__ static void gather_rows(D desc, size_t n)
{
    const unsigned full = 0xffffffffu, lane = threadIdx.x & 31u;
    size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
    for (size_t g0 = warp * 32; g0 < n; g0 += warps * 32) {
        cu_gather_desc my = {NULL, NULL, 0};
        if (g0 + lane < n)
            my = desc(g0 + lane);
        unsigned cnt = n - g0 < 32 ? (unsigned)(n - g0) : 32u;
        for (unsigned j = 0; j < cnt; j++) {
            const char *src =
                (const char *)__shfl_sync(full, (unsigned long long)(uintptr_t)my.src, (int)j);
            char *dst = (char *)__shfl_sync(full, (unsigned long long)(uintptr_t)my.dst, (int)j);
            size_t bytes = (size_t)__shfl_sync(full, (unsigned long long)my.bytes, (int)j);
            uintptr_t align = (uintptr_t)src | (uintptr_t)dst | (uintptr_t)bytes;
            if ((align & 15u) == 0)
                for (size_t i = lane; i < bytes / 16; i += 32)
                    ((int4 *)dst)[i] = ((const int4 *)src)[i];
            else if ((align & 7u) == 0)
                for (size_t i = lane; i < bytes / 8; i += 32)
                    ((unsigned long long *)dst)[i] = ((const unsigned long long *)src)[i];
            else if ((align & 3u) == 0)
                for (size_t i = lane; i < bytes / 4; i += 32)
                    ((unsigned *)dst)[i] = ((const unsigned *)src)[i];
            else
                for (size_t i = lane; i < bytes; i += 32)
                    dst[i] = src[i];
        }
    }
}

__global__ static void gather_kernel(const cu_gather_desc *d, size_t n)
{
    gather_rows([=](size_t i) { return d[i]; }, n);
}

/* copy_h2d_listed's: the list as a kernel before it left it, cut to max */
__global__ static void listed_kernel(const rekv_copy_piece *p, const size_t *n, size_t max)
{
    size_t k = *n < max ? *n : max;
    gather_rows(
        [=](size_t i) {
            rekv_copy_piece q = p[i];
            return cu_gather_desc{(const char *)q.src, (char *)q.dst, q.bytes};
        },
        k);
}

/* host_register's ranges as they are now, to match rows against without holding the lock (one
 * per offloaded layer's weights, the arena, a few flags): in stack (room for CU_GATHER_STACK_REGS)
 * or a heap copy the caller frees when the returned pointer is not stack; *n 0 when out of
 * memory. */
static cu_host_reg *regs_snapshot(cuda_backend *be, cu_host_reg *stack, size_t *n)
{
    pthread_mutex_lock(&be->mu);
    size_t k = be->n_regs;
    cu_host_reg *r = k <= CU_GATHER_STACK_REGS ? stack : (cu_host_reg *)malloc(k * sizeof(*r));
    if (r != NULL)
        memcpy(r, be->regs, k * sizeof(*r));
    pthread_mutex_unlock(&be->mu);
    *n = r != NULL ? k : 0;
    return r;
}

/* The device's address of host bytes [p, p + n) where one of regs mapped them all; NULL where
 * none did. *hint: the range that matched last, tried first (a gather's rows are mostly from one
 * range, the arena). */
static const char *reg_device_addr(const cu_host_reg *regs, size_t n_regs, size_t *hint,
                                   const void *p, size_t n)
{
    const char *h = (const char *)p;
    for (size_t k = 0; k <= n_regs; k++) {
        size_t i = k == 0 ? *hint : k - 1;
        if (i >= n_regs)
            continue;
        const cu_host_reg *r = &regs[i];
        if (h >= r->host && n <= r->bytes && (size_t)(h - r->host) <= r->bytes - n) {
            *hint = i;
            return r->dev + (h - r->host);
        }
    }
    return NULL;
}

/* n gather descriptors of mapped pinned memory, the host's pointer and the device's: 0, or -1
 * (nothing allocated, CUDA's error cleared). */
static int desc_alloc(size_t n, cu_gather_desc **host, const cu_gather_desc **dev)
{
    void *h = NULL, *d = NULL;
    if (cudaHostAlloc(&h, n * sizeof(cu_gather_desc),
                      cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess ||
        cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
        cudaGetLastError();
        if (h != NULL)
            cudaFreeHost(h);
        return -1;
    }
    *host = (cu_gather_desc *)h;
    *dev = (const cu_gather_desc *)d;
    return 0;
}

/* Makes s's ring hold cap descriptors: waits for the kernels reading the old one (it grows a few
 * times in a process's life, to 4x its largest gather) and replaces it. 0, or -1 with the stream
 * failed. */
static int gather_ring_grow(rekv_stream *s, size_t cap)
{
    cu_gather_ring *g = &s->gather;
    for (int i = 0; i < g->n_busy; i++) {
        cuda_count_host_sync(s->be);
        if (cuda_stream_check(s, cudaEventSynchronize(g->busy[i].ev), "gather ring"))
            return -1;
    }
    g->n_busy = 0;
    if (g->host == NULL) /* the stream's first gather */
        for (int i = 0; i < CU_GATHER_INFLIGHT; i++)
            if (cudaEventCreateWithFlags(&g->busy[i].ev, cudaEventDisableTiming) != cudaSuccess) {
                cudaGetLastError();
                while (i-- > 0)
                    cudaEventDestroy(g->busy[i].ev);
                cuda_stream_fail(s, -ENOMEM, "stream %s: no events for a gather", s->name);
                return -1;
            }
    if (g->host != NULL)
        cudaFreeHost(g->host);
    g->host = NULL;
    if (desc_alloc(cap, &g->host, &g->dev)) {
        for (int i = 0; i < CU_GATHER_INFLIGHT; i++)
            cudaEventDestroy(g->busy[i].ev);
        cuda_stream_fail(s, -ENOMEM, "stream %s: no pinned memory for a gather's %zu rows", s->name,
                         cap);
        return -1;
    }
    g->cap = cap;
    g->head = 0;
    return 0;
}

/* Room for n descriptors in s's ring, after the kernels that read any of it finished (rarely
 * waited for: a gather takes at most a quarter of the ring, and those that finished are let go
 * first, without waiting): their first index, or -1 with the stream failed. */
static long gather_slice(rekv_stream *s, size_t n)
{
    cu_gather_ring *g = &s->gather;
    int done = 0; /* they finish in stream order: the oldest first */
    cudaError_t q = cudaSuccess;
    while (done < g->n_busy && (q = cudaEventQuery(g->busy[done].ev)) == cudaSuccess)
        done++;
    if (q == cudaErrorNotReady && cudaPeekAtLastError() == cudaErrorNotReady)
        cudaGetLastError(); /* "not yet" is no failure for a later launch check to find */
    else if (q != cudaSuccess && cuda_stream_check(s, q, "gather ring"))
        return -1;
    if (done > 0) { /* their events go to the free end, after the busy ones */
        cudaEvent_t freed[CU_GATHER_INFLIGHT];
        for (int i = 0; i < done; i++)
            freed[i] = g->busy[i].ev;
        memmove(&g->busy[0], &g->busy[done], (size_t)(g->n_busy - done) * sizeof(g->busy[0]));
        g->n_busy -= done;
        for (int i = 0; i < done; i++)
            g->busy[g->n_busy + i].ev = freed[i];
    }
    if (g->host == NULL || n > g->cap / 4) {
        size_t cap = CU_GATHER_RING;
        while (cap < 4 * n)
            cap *= 2;
        if (gather_ring_grow(s, cap))
            return -1;
    }
    size_t lo = g->head + n <= g->cap ? g->head : 0;
    /* the slices it overlaps, or the oldest when every slot is taken; busy[] stays oldest first */
    for (int i = 0; i < g->n_busy;) {
        if (g->n_busy < CU_GATHER_INFLIGHT && (g->busy[i].hi <= lo || g->busy[i].lo >= lo + n)) {
            i++;
            continue;
        }
        cuda_count_host_sync(s->be);
        if (cuda_stream_check(s, cudaEventSynchronize(g->busy[i].ev), "gather ring"))
            return -1;
        cudaEvent_t ev = g->busy[i].ev;
        memmove(&g->busy[i], &g->busy[i + 1], (size_t)(g->n_busy - i - 1) * sizeof(g->busy[0]));
        g->busy[--g->n_busy].ev = ev;
    }
    return (long)lo;
}

/* The blocks a gather of at most rows rows takes: a warp per 32 rows, two blocks per SM at most */
static unsigned gather_blocks(const rekv_stream *s, size_t rows)
{
    size_t groups = (rows + 31) / 32, per_block = CU_GATHER_THREADS / 32;
    size_t grid = (groups + per_block - 1) / per_block, grid_max = (size_t)s->be->sms * 2;
    unsigned blocks = (unsigned)(grid < grid_max ? grid : grid_max);
    return blocks ? blocks : 1;
}

/* The launch and the ring's bookkeeping of a gather of n rows whose descriptors are at slice lo.
 * Returns 1 (done, or the stream failed). */
int cuda_gather_launch(rekv_stream *s, long lo, size_t n)
{
    gather_kernel<<<gather_blocks(s, n), CU_GATHER_THREADS, 0, s->cs>>>(s->gather.dev + lo, n);
    cuda_launch_check(s, "gather");
    cu_gather_ring *g = &s->gather;
    if (cuda_stream_check(s, cudaEventRecord(g->busy[g->n_busy].ev, s->cs), "gather ring"))
        return 1;
    g->busy[g->n_busy].lo = (size_t)lo;
    g->busy[g->n_busy].hi = (size_t)lo + n;
    g->n_busy++;
    g->head = (size_t)lo + n;
    return 1;
}

/* The h2d runs as a gather when they are many small rows all in host_register's mapped ranges:
 * returns 1 with their descriptors in the ring at *lo_out (*rows_out of them; *lo_out < 0: the
 * stream failed), or 0 to leave them to DMA. */
int cuda_gather_prepare(rekv_stream *s, const rekv_copy_run *runs, size_t nr, size_t bytes,
                        long *lo_out, size_t *rows_out)
{
    cuda_backend *be = s->be;
    size_t rows = 0;
    for (size_t i = 0; i < nr; i++)
        rows += runs[i].height;
    if (rows < CU_GATHER_MIN_ROWS || bytes / rows > CU_GATHER_MAX_ROW)
        return 0;
    cu_host_reg stack[CU_GATHER_STACK_REGS];
    size_t n_regs, hint = 0;
    cu_host_reg *regs = regs_snapshot(be, stack, &n_regs);
    int mapped = n_regs > 0;
    for (size_t i = 0; mapped && i < nr; i++) {
        const rekv_copy_run *r = &runs[i];
        mapped = reg_device_addr(regs, n_regs, &hint, r->src,
                                 (r->height - 1) * r->spitch + r->width) != NULL;
    }
    long lo = mapped ? gather_slice(s, rows) : -1;
    if (lo >= 0) {
        cu_gather_desc *d = s->gather.host + lo;
        size_t k = 0;
        for (size_t i = 0; i < nr; i++) {
            const rekv_copy_run *r = &runs[i];
            for (size_t row = 0; row < r->height; row++, k++) {
                d[k].src = reg_device_addr(regs, n_regs, &hint,
                                           (const char *)r->src + row * r->spitch, r->width);
                d[k].dst = (char *)r->dst + row * r->dpitch;
                d[k].bytes = r->width;
            }
        }
        pthread_mutex_lock(&be->mu);
        be->stats.h2d_gathered += rows;
        pthread_mutex_unlock(&be->mu);
    }
    if (regs != stack)
        free(regs);
    *lo_out = lo;
    *rows_out = rows;
    return mapped;
}

/* ------------------------------------------------------------------ listed gathers */

void cuda_copy_h2d_listed(rekv_stream *s, const rekv_copy_piece *pieces, const size_t *n,
                          size_t max, rekv_xfer_kind kind)
{
    if (cuda_refused_in_capture(s, "a listed copy"))
        return;
    if (pieces == NULL || n == NULL || (unsigned)kind >= REKV_XFER_KINDS) {
        cuda_stream_fail(s, -EINVAL,
                         "stream %s: a listed copy needs its pieces, their count and a kind",
                         s->name);
        return;
    }
    if (s->n_listed == s->cap_listed) {
        size_t cap = s->cap_listed ? 2 * s->cap_listed : 16;
        cu_listed *l = (cu_listed *)realloc(s->listed, cap * sizeof(*l));
        if (l == NULL) {
            cuda_stream_fail(s, -ENOMEM, "stream %s: out of memory for a listed copy", s->name);
            return;
        }
        s->listed = l;
        s->cap_listed = cap;
    }
    cuda_use_device(s->be);
    long op = cuda_op_begin(s, CU_OP_H2D, "h2d listed gather");
    listed_kernel<<<gather_blocks(s, max), CU_GATHER_THREADS, 0, s->cs>>>(pieces, n, max);
    cuda_launch_check(s, "listed gather");
    s->listed[s->n_listed++] = (cu_listed){pieces, n, max, kind};
    cuda_op_end(s, op);
}

void cuda_listed_resolve(rekv_stream *s, int ran)
{
    cuda_backend *be = s->be;
    for (size_t i = 0; ran && i < s->n_listed; i++) {
        const cu_listed *l = &s->listed[i];
        size_t k = *l->n < l->max ? *l->n : l->max, bytes = 0, rows = 0;
        for (size_t j = 0; j < k; j++) {
            bytes += l->pieces[j].bytes;
            rows += l->pieces[j].bytes > 0;
        }
        pthread_mutex_lock(&be->mu);
        be->stats.h2d_bytes[l->kind] += bytes;
        be->stats.h2d_copies++;
        be->stats.h2d_gathered += rows;
        pthread_mutex_unlock(&be->mu);
    }
    s->n_listed = 0;
}

const void *cuda_host_mapped(rekv_backend *base, const void *p)
{
    cuda_backend *be = cuda_backend_of(base);
    cu_host_reg stack[CU_GATHER_STACK_REGS];
    size_t n_regs, hint = 0;
    cu_host_reg *regs = regs_snapshot(be, stack, &n_regs);
    const void *d = reg_device_addr(regs, n_regs, &hint, p, 1);
    if (regs != stack)
        free(regs);
    return d;
}
