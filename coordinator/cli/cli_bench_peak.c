/* cli_bench_peak.c — the yardsticks `rekv bench decode` measures in the same run as its modes: the
 * link's host->device peak from the kvstore's arena, pinned and pageable memory, and the device's
 * copy and GEMM rates. Each is the best of a few synchronised passes after a warm-up. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/dtype.h"
#include "coordinator/cli/cli_bench.h"
#include "gpuworker/kernels.h"
#include "loader/loader.h"

/* Best of `reps` timed passes of pass(arg) on s (one warm-up first), seconds. */
static int best_pass(rekv_backend *be, rekv_stream *s, int reps, void (*pass)(void *), void *arg,
                     double *best, rekv_err *err)
{
    *best = 0;
    for (int i = 0; i <= reps; i++) {
        uint64_t t0 = rekv_now_ns();
        pass(arg);
        int rc = be->iface->stream_sync(s, err);
        if (rc)
            return rc;
        double t = (double)(rekv_now_ns() - t0) * 1e-9;
        if (i > 0 && (*best == 0 || t < *best))
            *best = t;
    }
    return 0;
}

/* one copy: host to device (h2d), else device to device */
typedef struct copy_pass {
    rekv_backend *be;
    rekv_stream *s;
    rekv_copy_piece pc;
    int h2d;
} copy_pass;

static void run_copy_pass(void *arg)
{
    copy_pass *a = arg;
    if (a->h2d)
        a->be->iface->copy_h2d(a->s, &a->pc, 1, REKV_XFER_OTHER);
    else
        a->be->iface->copy_d2d(a->s, &a->pc, 1);
}

/* Host->device bandwidth of plain copies of `bytes` from src into device memory, GB/s: one
 * warm-up copy, then the best of 5 (each synchronised). */
static int measure_h2d(rekv_backend *be, const void *src, size_t bytes, double *gbps, rekv_err *err)
{
    const rekv_backend_iface *bi = be->iface;
    rekv_stream *s = NULL;
    void *d = bi->dev_alloc(be, bytes);
    int rc = d ? bi->stream_create(be, "bandwidth", &s, err)
               : rekv_errf(err, -ENOMEM, "bench: out of device memory for %zu bytes", bytes);
    double t = 0;
    copy_pass cp = {be, s, {d, src, bytes}, 1};
    if (rc == 0)
        rc = best_pass(be, s, 5, run_copy_pass, &cp, &t, err);
    if (s)
        bi->stream_destroy(s);
    if (d)
        bi->dev_free(be, d);
    *gbps = rc == 0 ? (double)bytes / t * 1e-9 : 0;
    return rc;
}

int cli_bench_measure_link(rekv_backend *be, rekv_kvstore_client *store, link_peak *out,
                           rekv_err *err)
{
    size_t ab = 0;
    char *arena = rekv_kvstore_client_arena(store, &ab);
    size_t max = ab > (2u << 20) ? ab - 4096 : 0;
    if (max > (256u << 20))
        max = 256u << 20;
    size_t fr = 0, tot = 0; /* a device of little memory (--device-memory): what the run left */
    rekv_err me = {0};
    if (be->iface->mem_info && be->iface->mem_info(be, &fr, &tot, &me) == 0 && fr / 2 < max)
        max = fr / 2 & ~(size_t)4095;
    if (max == 0)
        return rekv_errf(err, -EINVAL, "bench: the kvstore's arena is too small to measure");
    void *pinned = rekv_host_alloc(be, max);
    char *pageable = malloc(max);
    int rc = pinned && pageable ? 0 : rekv_errf(err, -ENOMEM, "bench: out of host memory");
    if (rc == 0) {
        memset(pinned, 1, max);
        memset(pageable, 1, max);
        /* copies of ~0.1 s at the probed rate (a slow emulated link needs small ones) */
        double probe = 0;
        size_t least = max < (1u << 20) ? max : 1u << 20;
        rc = measure_h2d(be, pinned, least, &probe, err);
        double want = probe * 1e9 * 0.1;
        out->bytes = want >= (double)max ? max : want < (double)least ? least : (size_t)want;
        out->bytes &= ~(size_t)4095;
    }
    if (rc == 0)
        rc = measure_h2d(be, arena + 4096, out->bytes, &out->arena_gbps, err);
    if (rc == 0)
        rc = measure_h2d(be, pinned, out->bytes, &out->pinned_gbps, err);
    if (rc == 0)
        rc = measure_h2d(be, pageable, out->bytes, &out->pageable_gbps, err);
    rekv_host_free(be, pinned);
    free(pageable);
    return rc;
}

typedef struct gemm_pass {
    const rekv_kernel_iface *k;
    rekv_stream *s;
    float *x, *y;
    void *w;
    rekv_dtype wt;
    int rows, n_shapes, shape[7][2]; /* (n, k) */
} gemm_pass;

static void run_gemm_pass(void *arg)
{
    gemm_pass *a = arg;
    for (int i = 0; i < a->n_shapes; i++)
        a->k->linear(a->s, a->y, a->x, a->w, a->wt, NULL, a->rows, a->shape[i][0], a->shape[i][1]);
}

int cli_bench_measure_device(rekv_backend *be, const rekv_engine *eng, int rows, device_peak *out,
                             rekv_err *err)
{
    const rekv_backend_iface *bi = be->iface;
    const rekv_model_config *c = rekv_engine_config(eng);
    rekv_dtype wt = rekv_engine_weight_dtype(eng);
    int H = c->hidden, Q = rekv_config_q_dim(c), KV = rekv_config_kv_dim(c), F = c->ffn;
    gemm_pass g = {.k = rekv_kernels_of(be),
                   .wt = wt,
                   .rows = rows < DEVICE_GEMM_ROWS ? rows : DEVICE_GEMM_ROWS};
    int shapes[7][2] = {{Q, H}, {KV, H}, {KV, H}, {H, Q}, {F, H}, {H, F}, {F, H}};
    g.n_shapes = rekv_config_gated(c) ? 7 : 6;
    memcpy(g.shape, shapes, sizeof(shapes));
    size_t big = (size_t)(F > Q ? F : Q), wide = big > (size_t)H ? big : (size_t)H;
    size_t ws = rekv_dtype_size(wt), w_elems = (size_t)H * big; /* the largest of the shapes */
    size_t xy = sizeof(float) * (size_t)g.rows * wide, wb = ws * w_elems;
    size_t fr = 0, tot = 0, cb = 256u << 20;
    rekv_err me = {0};
    if (bi->mem_info && bi->mem_info(be, &fr, &tot, &me) == 0 && fr / 4 < cb)
        cb = fr / 4 & ~(size_t)4095;
    float *hx = malloc(xy), pat[1024];
    char *hw = malloc(wb), tab[1024 * 4];
    void *d1 = bi->dev_alloc(be, cb), *d2 = bi->dev_alloc(be, cb);
    g.x = bi->dev_alloc(be, xy), g.y = bi->dev_alloc(be, xy), g.w = bi->dev_alloc(be, wb);
    rekv_stream *s = NULL;
    int rc = hx && hw && d1 && d2 && g.x && g.y && g.w
                 ? bi->stream_create(be, "device peak", &s, err)
                 : rekv_errf(err, -ENOMEM, "bench: out of memory measuring the device");
    if (rc == 0) { /* small, varied values: a GEMM of zeros runs faster than one of data */
        for (int i = 0; i < 1024; i++)
            pat[i] = (float)((i * 2654435761u) % 2001) * 1e-3f - 1.0f;
        rekv_from_f32(tab, pat, wt, 1024);
        for (size_t i = 0; i < xy / sizeof(float); i++)
            hx[i] = pat[i % 1021];
        for (size_t i = 0; i < w_elems; i++)
            memcpy(hw + i * ws, tab + (i % 1019) * ws, ws);
        rekv_copy_piece pc[3] = {{g.x, hx, xy}, {g.y, hx, xy}, {g.w, hw, wb}};
        bi->copy_h2d(s, pc, 3, REKV_XFER_OTHER);
        /* the copy's source holds data too (untouched host pages would read as the zero page) */
        for (size_t at = 0; at < cb; at += xy) {
            rekv_copy_piece fill = {(char *)d1 + at, g.x, cb - at < xy ? cb - at : xy};
            bi->copy_d2d(s, &fill, 1);
        }
        rc = bi->stream_sync(s, err);
    }
    g.s = s;
    copy_pass cp = {be, s, {d2, d1, cb}, 0};
    double t = 0;
    if (rc == 0 && (rc = best_pass(be, s, 5, run_copy_pass, &cp, &t, err)) == 0) {
        out->copy_bytes = cb;
        out->copy_gbps = 2.0 * (double)cb / t * 1e-9;
    }
    if (rc == 0 && (rc = best_pass(be, s, 3, run_gemm_pass, &g, &t, err)) == 0) {
        double flops = 0;
        for (int i = 0; i < g.n_shapes; i++)
            flops += 2.0 * g.rows * (double)g.shape[i][0] * (double)g.shape[i][1];
        out->gemm_rows = g.rows;
        out->gemm_flops = flops / t;
    }
    if (s)
        bi->stream_destroy(s);
    void *bufs[] = {d1, d2, g.x, g.y, g.w};
    for (int i = 0; i < 5; i++)
        if (bufs[i])
            bi->dev_free(be, bufs[i]);
    free(hx);
    free(hw);
    return rc;
}
