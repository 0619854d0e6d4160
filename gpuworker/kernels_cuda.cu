/* kernels_cuda.cu — the forward pass's kernels (kernels.h) on an NVIDIA GPU, launched on the cuda
 * backend's streams (device/backend_cuda.cu; its structures in device/cuda_internal.h): every
 * launch is on the rekv_stream's CUDA stream, timed and traced by the runtime's events, checked
 * with cudaGetLastError, and a failure is kept by the stream until its next stream_sync, as the
 * runtime's own work is.
 *
 * The kernels (fp32 activations; weight matrices in the model file's dtype, as the engine holds
 * them):
 * - linear: fp32 weights: cublasSgemm (full fp32, no TF32); f16/bf16 weights: x rounded to the
 *   weights' dtype into a per-stream scratch, then cublasGemmEx with fp32 accumulation and output
 *   (tensor cores). Then a bias kernel. Not row-invariant like cpu_gemm.c, so bits may depend on
 *   batching; results agree with the cpu reference within fp32 rounding (fp32 weights) or the
 *   16-bit rounding of x (16-bit weights). Quantized weights (GGUF Q8_0, Q4_0, Q4_K, Q6_K, kept
 *   in their blocks on the device), decoded with gguf_block.h, the decoding the cpu shares: up
 *   to 4 rows (a decode step's batch) by a fused dequantizing GEMV, a warp per weight row, each
 *   weight decoded in registers and used for every row, so the blocks are read once at their
 *   quantized size (fp32 x, exact weights: within fp32 rounding of the cpu); more rows by a kernel
 *   that decodes a chunk of the matrix's rows into a per-stream f16 scratch for the f16 GEMM
 *   (tensor cores; within the 16-bit rounding of x and of the weights), whose writing and
 *   rereading of the matrix in f16 a prefill's many rows pay for.
 * - qkv: a layer's W_Q, W_K, W_V concatenated at upload (pipeline_create.c) make one GEMM as
 *   linear's, into a per-stream scratch; one kernel then adds the bias, rotates q and k (RoPE, as
 *   rope) and writes the three parts apart: no bias kernel, no rope launches, x rounded once.
 * - norm: one block per row, two-pass LayerNorm as cpu_norm does, reductions in shared memory.
 * - rope: the engine's frequency table (rekv_rope_freqs, made once on the host) passed by value
 *   as the kernel's argument, so the angles are cpu_rope_table's bit for bit; cos/sin in double
 *   rounded to float, which matches glibc's correctly rounded cosf/sinf almost always. Dynamic
 *   NTK's positions past the original length compute their row's frequencies as
 *   rekv_rope_freqs_at does, in double.
 * - attention: one block per (head, sequence, row slice); the block's warps split the context,
 *   each keeps an online softmax, and the block merges them (flash-decoding's split, within a
 *   block). The `scores` scratch is not used. int8/int4 rows are dequantized as they are read
 *   (kv_elem), never copied out widened.
 * - kv_scatter: rows stored in the cache dtype; int8/int4 quantized by a warp per row
 *   (kvq_row_warp), the cpu's codes and scales bit for bit.
 * - sample: one block per row, rekv_sample_drawn by radix selection and prefix sums in fixed
 *   point (below), so only the chosen ids and any top logits cross back.
 * - embed: a row's lookups as they are stored; quantized tables decode only the looked-up rows.
 * - the rest: element- or row-parallel; one block per row where a row reads mapped metadata, read
 *   once per block through shared memory.
 *
 * cuBLAS lives here, not in the runtime: each stream gets its handle on its first GEMM (kstate),
 * freed by the runtime with the stream.
 *
 * This file and the runtime make librekv_cuda.so, loaded by the programs on first use of the cuda
 * backend (device/backend_cuda.h); its entry point, at the end, gives both halves. */
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/device/cuda_internal.h"

extern "C" {
#include "common/dtype.h"
#include "gpuworker/cpu_qgemm.h"
#include "gpuworker/heads.h"
#include "gpuworker/kernels.h"
#include "gpuworker/kv_pool.h"
#include "loader/gguf_block.h"
}

enum { EW_THREADS = 256, ROW_THREADS = 256, ATT_WARPS = 8, ATT_ROW_SLICES = 16 };
/* split attention: at most this many chunks of a context, each at least this many positions */
enum { ATT_MAX_SPLITS = 32, ATT_MIN_CHUNK = 64 };
/* head_dim <= 512 (kernels.h): an attention lane holds up to 16 elements of its output */
enum { ATT_MAX_PER_LANE = 16 };

static unsigned ew_blocks(size_t n)
{
    size_t b = (n + EW_THREADS - 1) / EW_THREADS;
    return (unsigned)(b > 65536 ? 65536 : b ? b : 1);
}

/* A kernel op: timed and traced, launch checked. */
#define KLAUNCH(s, name, kernel, grid, block, shmem, ...)                                          \
    do {                                                                                           \
        cuda_use_device((s)->be);                                                                  \
        long op_ = cuda_op_begin((s), CU_OP_COMPUTE, (name));                                      \
        kernel<<<(grid), (block), (shmem), (s)->cs>>>(__VA_ARGS__);                                \
        cuda_launch_check((s), (name));                                                            \
        cuda_op_end((s), op_);                                                                     \
    } while (0)

__device__ __forceinline__ static float load_as_f32(const void *p, size_t i, int dtype)
{
    if (dtype == REKV_DTYPE_F16)
        return __half2float(((const __half *)p)[i]);
    if (dtype == REKV_DTYPE_BF16)
        return __uint_as_float((uint32_t)((const uint16_t *)p)[i] << 16);
    return ((const float *)p)[i];
}

/* p[i] = f in dtype: f16 and bf16 round to nearest even (bf16 as rekv_f32_to_bf16, bit for bit) */
__device__ __forceinline__ static void store_from_f32(void *p, size_t i, float f, int dtype)
{
    if (dtype == REKV_DTYPE_F16) {
        ((__half *)p)[i] = __float2half_rn(f); /* nearest even, overflow to inf */
    } else if (dtype == REKV_DTYPE_BF16) {
        uint32_t u = __float_as_uint(f);
        uint16_t r;
        if ((u & 0x7fffffffu) > 0x7f800000u)
            r = (uint16_t)((u >> 16) | 0x40);
        else
            r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        ((uint16_t *)p)[i] = r;
    } else {
        ((float *)p)[i] = f;
    }
}

__global__ static void convert_out_kernel(void *dst, const float *src, size_t n, int dtype)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        store_from_f32(dst, i, src[i], dtype);
}

/* Sum over the block (float or double); every thread gets the result. red: blockDim.x / 32 of
 * shared. */
template <class T> __device__ static T block_sum(T v, T *red)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* red may still be read from a previous call */
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    T t = 0;
    for (int i = 0; i < nw; i++)
        t += red[i];
    return t;
}

/* y[r][c] += bias[c]: blocks over rows, threads over columns (no 64-bit modulo per element) */
__global__ static void bias_kernel(float *y, const float *bias, int m, int n)
{
    for (int r = blockIdx.x; r < m; r += gridDim.x) {
        float *yr = y + (size_t)r * (size_t)n;
        for (int c = threadIdx.x; c < n; c += blockDim.x)
            yr[c] += bias[c];
    }
}

/* A per-stream device scratch buffer (stream-ordered allocation, grown on demand). */
typedef struct cu_scratch {
    void *p;
    size_t cap; /* bytes */
} cu_scratch;

/* The kernels' state of one stream: a cuBLAS handle of its own (a handle's workspace must not be
 * shared by concurrent streams) bound to the stream, and the GEMMs' scratch. */
enum { CU_SCRATCH_RETIRED = 48 };

/* A GEMM's input in 16 bits without a conversion pass (issue 40). A linear with 16-bit weights
 * reads x rounded to their dtype from the stream's xh. The kernels whose output feeds GEMMs —
 * norm, activation, attention — write it there too, rounded as the conversion rounds it
 * (store_from_f32), and tag it: whose fp32 values xh holds (src, n elements, dtype) and the
 * stream's enqueue count then (rekv_stream.enq). A GEMM whose x is the tagged values, with nothing
 * enqueued on the stream since but GEMMs that read them, takes xh as it is: no convert kernel and
 * the same bits. Anything else in between (a kernel that may write x, a copy, a wait for another
 * stream's work) leaves the tag stale and the GEMM converts as before, tagging its own
 * conversion, so that unfused Q, K and V (or gate and up) share one. The producers write the
 * dtype of the stream's last GEMM's input, nothing when that was fp32 (fp32 weights, a quantized
 * GEMV) or there was none yet. The residual stream and the
 * GEMMs' outputs stay fp32: the rounding is the one the GEMM's input always had. */
typedef struct cu_x16 {
    const float *src; /* NULL: xh holds nothing named */
    size_t n;
    int dtype;
    uint64_t enq;
} cu_x16;

typedef struct cu_kstate {
    cublasHandle_t blas; /* bound to the stream; full fp32 products (no TF32) */
    cu_scratch xh;       /* a GEMM with 16-bit weights: x rounded to the weights' dtype */
    cu_x16 x16;          /* what xh holds */
    int x16_dtype;       /* the dtype of the stream's last GEMM's input; 0: fp32, or none yet */
    cu_scratch wh;       /* a GEMM with quantized weights: a chunk of their rows in f16 */
    cu_scratch yqkv;     /* qkv: the fused projection's output before its split */
    /* outgrown scratch, kept until the stream goes: a captured graph may still use one (growth
     * by 5/4 from a few KiB: 48 cover any size; past that the oldest is freed) */
    void *retired[CU_SCRATCH_RETIRED];
    int n_retired;
} cu_kstate;

/* Called by the runtime when the stream is destroyed, once it is idle. */
static void kstate_free(void *p)
{
    cu_kstate *k = (cu_kstate *)p;
    if (k->xh.p != NULL)
        cudaFree(k->xh.p);
    if (k->wh.p != NULL)
        cudaFree(k->wh.p);
    if (k->yqkv.p != NULL)
        cudaFree(k->yqkv.p);
    for (int i = 0; i < k->n_retired; i++)
        cudaFree(k->retired[i]);
    cublasDestroy(k->blas);
    free(k);
}

/* The stream's kernel state, created on its first GEMM; NULL with the stream failed when it cannot
 * be. */
static cu_kstate *kstate(rekv_stream *s)
{
    if (s->kstate != NULL)
        return (cu_kstate *)s->kstate;
    cu_kstate *k = (cu_kstate *)calloc(1, sizeof(*k));
    if (k == NULL) {
        cuda_stream_fail(s, -ENOMEM, "cuda stream %s: out of memory for the kernels' state",
                         s->name);
        return NULL;
    }
    cublasStatus_t bs = cublasCreate(&k->blas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        cuda_stream_fail(s, bs == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO,
                         "cuda stream %s: cannot create a cuBLAS handle: %s", s->name,
                         cublasGetStatusString(bs));
        free(k);
        return NULL;
    }
    /* full fp32 products (no TF32), as the cpu reference computes them */
    if (cublasSetStream(k->blas, s->cs) != CUBLAS_STATUS_SUCCESS ||
        cublasSetMathMode(k->blas, CUBLAS_DEFAULT_MATH) != CUBLAS_STATUS_SUCCESS) {
        cuda_stream_fail(s, -EIO, "cuda stream %s: cannot bind cuBLAS to the stream", s->name);
        cublasDestroy(k->blas);
        free(k);
        return NULL;
    }
    s->kstate = k;
    s->kstate_free = kstate_free;
    return k;
}

/* sc (one of k's scratch buffers) holds at least bytes. An outgrown buffer is kept until the
 * stream is destroyed, since a graph captured with it may launch again; growing inside a capture
 * would make the graph own the buffer, so it fails the capture instead (the step then runs
 * uncaptured, and grows). 0, or -ENOMEM / -ENOTSUP with the stream failed. */
static int stream_scratch(rekv_stream *s, cu_kstate *k, cu_scratch *sc, size_t bytes)
{
    if (bytes <= sc->cap)
        return 0;
    if (s->capturing) {
        cuda_stream_fail(s, -ENOTSUP, "cuda stream %s: a GEMM's scratch must grow inside a capture",
                         s->name);
        return -ENOTSUP;
    }
    size_t want = bytes + bytes / 4;
    void *p = NULL;
    cudaError_t e = cudaMallocAsync(&p, want, s->cs);
    if (e != cudaSuccess) {
        cudaGetLastError();
        cuda_stream_fail(s, -ENOMEM,
                         "cuda stream %s: out of device memory for %zu bytes of scratch: %s",
                         s->name, want, cudaGetErrorString(e));
        return -ENOMEM;
    }
    if (sc->p != NULL) {
        if (k->n_retired == CU_SCRATCH_RETIRED) {
            cudaFreeAsync(k->retired[0], s->cs);
            memmove(k->retired, k->retired + 1, sizeof(void *) * (CU_SCRATCH_RETIRED - 1));
            k->n_retired--;
        }
        k->retired[k->n_retired++] = sc->p;
    }
    sc->p = p;
    sc->cap = want;
    return 0;
}

/* Where a kernel about to write n fp32 values writes them in 16 bits as well (ks->xh), in dtype
 * *dt; NULL when the stream has run no 16-bit GEMM yet, or xh would have to grow inside a capture
 * (stream_scratch). Whatever xh held is no longer named. */
static void *x16_claim(rekv_stream *s, size_t n, int *dt)
{
    cu_kstate *ks = (cu_kstate *)s->kstate;
    if (ks == NULL || ks->x16_dtype == 0 || n == 0)
        return NULL;
    ks->x16.src = NULL;
    if (n * 2 > ks->xh.cap && (s->capturing || stream_scratch(s, ks, &ks->xh, n * 2) != 0))
        return NULL;
    *dt = ks->x16_dtype;
    return ks->xh.p;
}

/* After the launch of the kernel that claimed xh: it holds src's n values, as of now. */
static void x16_tag(rekv_stream *s, const float *src, size_t n, int dt)
{
    cu_kstate *ks = (cu_kstate *)s->kstate;
    ks->x16 = cu_x16{src, n, dt, cuda_enq_now(s)};
}

/* Whether [a, a + an) and [b, b + bn) (bytes) overlap */
static int spans_overlap(const void *a, size_t an, const void *b, size_t bn)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + bn && y < x + an;
}

/* After an op that read the tagged x and wrote only the n_out spans outs[i] (bytes): the tag
 * still names x as of now, unless an output overlapped it. */
static void x16_keep(rekv_stream *s, const float *x, void *const *outs, const size_t *n_out,
                     int n)
{
    cu_kstate *ks = (cu_kstate *)s->kstate;
    if (ks == NULL || ks->x16.src == NULL || ks->x16.src != x)
        return;
    for (int i = 0; i < n; i++)
        if (outs[i] != NULL && spans_overlap(outs[i], n_out[i], x, ks->x16.n * sizeof(float))) {
            ks->x16.src = NULL;
            return;
        }
    ks->x16.enq = cuda_enq_now(s);
}

/* Rows of a quantized matrix dequantized into f16 (dst [rows][k]): w's rows of k weights in whole
 * blocks of type qt, row_bytes apart; each weight gguf_block.h's value (ggml's), rounded to
 * nearest even. Threads over a row's weights (x), rows over y. */
__global__ static void dequant_kernel(__half *dst, const uint8_t *w, uint32_t qt, size_t row_bytes,
                                      int rows, int k)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= k)
        return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y)
        dst[(size_t)r * k + i] = __float2half_rn(rekv_qb_at(qt, w + (size_t)r * row_bytes, i));
}

/* A quantized GEMM dequantizes at most this many weights at a time into the stream's scratch (32
 * MiB of f16): an output head of 128K rows would otherwise want a GiB of it. Up to QGEMV_MAX_M
 * rows of x go to qgemv_kernel instead. */
enum { Q_CHUNK_WEIGHTS = 1 << 24, QGEMV_MAX_M = 4, QGEMV_WARPS = 8 };

/* A decode step's quantized linear, fused: y[r][j] = x[r] · w[j] for m <= QGEMV_MAX_M rows, one
 * warp per weight row j, its lanes over the row's weights; each weight is decoded once, in
 * registers, and used for every row of x — the blocks are read once at their quantized size and
 * nothing is written but y (the dequantizing path writes and rereads the matrix in f16). x stays
 * fp32 and the weights exact, so the sums differ from the cpu's only in their order. */
__global__ static void qgemv_kernel(float *y, const float *x, const uint8_t *w, uint32_t qt,
                                    size_t row_bytes, int m, int n, int k)
{
    int lane = threadIdx.x & 31, j = blockIdx.x * QGEMV_WARPS + (threadIdx.x >> 5);
    if (j >= n) /* a whole warp leaves: the shuffles below never miss a lane */
        return;
    const uint8_t *row = w + (size_t)j * row_bytes;
    float acc[QGEMV_MAX_M] = {0};
    for (int i = lane; i < k; i += 32) {
        float v = rekv_qb_at(qt, row, i);
        for (int r = 0; r < QGEMV_MAX_M; r++)
            if (r < m)
                acc[r] += x[(size_t)r * k + i] * v;
    }
    for (int r = 0; r < QGEMV_MAX_M; r++) {
        float t = acc[r];
        for (int o = 16; o > 0; o >>= 1)
            t += __shfl_xor_sync(0xffffffffu, t, o);
        if (lane == 0 && r < m)
            y[(size_t)r * n + j] = t;
    }
}

/* y[m][n] = x[m][k] · w[n][k]^T in fp32 (no bias), enqueued on s: fp32 weights by cublasSgemm;
 * 16-bit weights with x rounded to their dtype (ks->xh), products on tensor cores, fp32 sums;
 * quantized weights (cpu_qgemm_wt): a few rows by qgemv_kernel, more as f16 weights, x rounded to
 * f16 once and the matrix dequantized a chunk of rows at a time into ks->wh, each chunk's GEMM
 * writing its columns of y. 0, or -1 with the stream failed. */
static int gemm(rekv_stream *s, cu_kstate *ks, float *y, const float *x, const void *w,
                rekv_dtype wt, int m, int n, int k)
{
    const float one = 1.0f, zero = 0.0f;
    uint32_t qt = cpu_qgemm_wt_type(wt), be = 0, bb = 0;
    if (qt && (!rekv_qb_geometry(qt, &be, &bb) || k % (int)be != 0)) {
        cuda_stream_fail(s, -EINVAL,
                         "cuda stream %s: linear over GGUF type %u with k %d (not whole blocks "
                         "of a type the kernels read)",
                         s->name, qt, k);
        return -1;
    }
    /* cuBLAS is column-major: row-major y[m][n] is y^T (n x m, ld n) = op_T(w) · x, where w's
     * rows [n][k] are a k x n matrix (ld k), transposed to n x k, and x is k x m (ld k) */
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    ks->x16_dtype = 0; /* unless x goes in 16 bits (below) */
    if (qt && m <= QGEMV_MAX_M) {
        unsigned blocks = (unsigned)((n + QGEMV_WARPS - 1) / QGEMV_WARPS);
        qgemv_kernel<<<blocks, 32 * QGEMV_WARPS, 0, s->cs>>>(y, x, (const uint8_t *)w, qt,
                                                             (size_t)k / be * bb, m, n, k);
    } else if (wt == REKV_DTYPE_F32) {
        st = cublasSgemm(ks->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, (const float *)w, k, x,
                         k, &zero, y, n);
    } else {
        rekv_dtype xt = qt ? REKV_DTYPE_F16 : wt;
        size_t xe = (size_t)m * (size_t)k;
        const cu_x16 *t = &ks->x16;
        ks->x16_dtype = (int)xt;
        if (!(t->src == x && t->n == xe && t->dtype == (int)xt && t->enq == cuda_enq_now(s))) {
            ks->x16.src = NULL;
            if (stream_scratch(s, ks, &ks->xh, xe * 2) != 0)
                return -1;
            convert_out_kernel<<<ew_blocks(xe), EW_THREADS, 0, s->cs>>>(ks->xh.p, x, xe, (int)xt);
            cuda_launch_check(s, "linear x");
            x16_tag(s, x, xe, (int)xt); /* for the next GEMM of the same x */
        }
        cudaDataType dt = xt == REKV_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
        size_t rb = (size_t)k / (be ? be : 1) * bb;
        int chunk = qt ? (int)(Q_CHUNK_WEIGHTS / k > 0 ? Q_CHUNK_WEIGHTS / k : 1) : n;
        chunk = chunk < n ? chunk : n;
        if (qt && stream_scratch(s, ks, &ks->wh, (size_t)chunk * (size_t)k * 2) != 0)
            return -1;
        for (int j = 0; j < n && st == CUBLAS_STATUS_SUCCESS; j += chunk) {
            int nc = n - j < chunk ? n - j : chunk;
            const void *wc = w;
            if (qt) {
                dim3 grid((unsigned)((k + EW_THREADS - 1) / EW_THREADS),
                          (unsigned)(nc < 65535 ? nc : 65535));
                dequant_kernel<<<grid, EW_THREADS, 0, s->cs>>>(
                    (__half *)ks->wh.p, (const uint8_t *)w + (size_t)j * rb, qt, rb, nc, k);
                cuda_launch_check(s, "linear dequant");
                wc = ks->wh.p;
            }
            st = cublasGemmEx(ks->blas, CUBLAS_OP_T, CUBLAS_OP_N, nc, m, k, &one, wc, dt, k,
                              ks->xh.p, dt, k, &zero, y + j, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT);
        }
    }
    if (st != CUBLAS_STATUS_SUCCESS) {
        cuda_stream_fail(s, -EIO, "cuda stream %s: %s GEMM (m %d, n %d, k %d): %s", s->name,
                         qt ? "quantized" : rekv_dtype_name(wt), m, n, k,
                         cublasGetStatusString(st));
        return -1;
    }
    cuda_launch_check(s, "linear");
    return 0;
}

static void k_linear(rekv_stream *s, float *y, const float *x, const void *w, rekv_dtype wt,
                     const float *bias, int m, int n, int k)
{
    if (m <= 0 || n <= 0)
        return;
    cuda_use_device(s->be);
    cu_kstate *ks = kstate(s);
    if (ks == NULL)
        return;
    long op = cuda_op_begin(s, CU_OP_COMPUTE, "linear");
    if (gemm(s, ks, y, x, w, wt, m, n, k) == 0 && bias != NULL) {
        unsigned nb = m < 65536 ? (unsigned)m : 65536u;
        bias_kernel<<<nb, EW_THREADS, 0, s->cs>>>(y, bias, m, n);
        cuda_launch_check(s, "linear bias");
    }
    cuda_op_end(s, op);
    void *out = y;
    size_t ob = sizeof(float) * (size_t)m * (size_t)n;
    x16_keep(s, x, &out, &ob, 1); /* it wrote y alone */
}

__global__ static void norm_kernel(float *out, const float *in, const float *w, const float *b,
                                   int d, float eps, void *o16, int dt16)
{
    __shared__ float red[ROW_THREADS / 32];
    const float *x = in + (size_t)blockIdx.x * d;
    float *y = out + (size_t)blockIdx.x * d;
    if (b != NULL) {
        float sum = 0;
        for (int j = threadIdx.x; j < d; j += blockDim.x)
            sum += x[j];
        float mean = block_sum(sum, red) / (float)d;
        float var = 0;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            float c = x[j] - mean;
            var += c * c;
        }
        var = block_sum(var, red) / (float)d;
        float inv = 1.0f / sqrtf(var + eps);
        /* each thread writes only what it read, after both reductions: out may equal in */
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            float v = (x[j] - mean) * inv * w[j] + b[j];
            y[j] = v;
            if (o16 != NULL) /* x16_claim: the next GEMM's input */
                store_from_f32(o16, (size_t)blockIdx.x * d + j, v, dt16);
        }
    } else {
        float ss = 0;
        for (int j = threadIdx.x; j < d; j += blockDim.x)
            ss += x[j] * x[j];
        float inv = 1.0f / sqrtf(block_sum(ss, red) / (float)d + eps);
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            float v = w[j] * (x[j] * inv);
            y[j] = v;
            if (o16 != NULL)
                store_from_f32(o16, (size_t)blockIdx.x * d + j, v, dt16);
        }
    }
}

static void k_norm(rekv_stream *s, float *out, const float *in, const float *w, const float *b,
                   int m, int d, float eps)
{
    if (m <= 0 || d <= 0)
        return;
    int dt16 = 0;
    size_t n = (size_t)m * (size_t)d;
    void *o16 = x16_claim(s, n, &dt16);
    KLAUNCH(s, "norm", norm_kernel, m, ROW_THREADS, 0, out, in, w, b, d, eps, o16, dt16);
    if (o16 != NULL)
        x16_tag(s, out, n, dt16);
}

/* A row's cos and sin of each pair at position pi into cosv, sinv ([f.half], shared), as
 * cpu_rope_table makes them: the same angle; cos/sin in double rounded to float, those of glibc's
 * correctly rounded float functions; then the attention factor (1 but for YaRN). Dynamic NTK past
 * the original length computes the row's own frequencies (rekv_rope_freqs_at) into dyn. Called by
 * every thread of the block; cosv, sinv are ready when it returns. */
__device__ static void rope_row_table(int pi, const rekv_rope_freqs &f, int head_dim, float *dyn,
                                      float *cosv, float *sinv)
{
    int half = head_dim / 2, is_dyn = pi >= f.dyn_from;
    if (is_dyn) {
        double L = (double)pi + 1, O = f.dyn_from;
        double base = f.theta * pow(f.dyn_factor * L / O - (f.dyn_factor - 1),
                                    (double)head_dim / (head_dim - 2));
        for (int j = threadIdx.x; j < half; j += blockDim.x)
            dyn[j] = (float)(1.0 / pow(base, (double)(2 * j) / (double)head_dim));
        __syncthreads();
    }
    float p = (float)pi;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        /* as cpu_rope_table: the same angle (LongRoPE's long table from long_from on); cos/sin
         * in double rounded to float; then the attention factor (1 but for YaRN, LongRoPE) */
        float a = p * (is_dyn ? dyn[j] : pi >= f.long_from ? f.long_inv_freq[j] : f.inv_freq[j]);
        cosv[j] = __fmul_rn((float)cos((double)a), f.attn_factor);
        sinv[j] = __fmul_rn((float)sin((double)a), f.attn_factor);
    }
    __syncthreads();
}

/* Pair i of a row of heads ([heads][head_dim], i over heads * half): its two elements' offsets in
 * the row, and its pair index j (adjacent: 2j, 2j+1; else j, j + half). */
__device__ __forceinline__ static int rope_pair_at(int i, int head_dim, int adjacent, int *a,
                                                   int *b)
{
    int half = head_dim / 2, h = i / half, j = i % half;
    *a = h * head_dim + (adjacent ? 2 * j : j);
    *b = h * head_dim + (adjacent ? 2 * j + 1 : j + half);
    return j;
}

/* One block per row; threads over (head, pair). f comes by value (about 1 KiB of the 4 KiB a
 * launch's arguments may take): no device copy of the table to keep or free. The row's cos and
 * sin of each pair are computed once, into shared memory, for all its heads: the double-precision
 * cos/sin that match the cpu's cost half per row, not n_heads * half. */
__global__ static void rope_kernel(float *x, const int32_t *pos, int n_heads, int head_dim,
                                   const rekv_rope_freqs f, int adjacent)
{
    __shared__ int pi;
    __shared__ float dyn[REKV_ROPE_MAX_PAIRS], cosv[REKV_ROPE_MAX_PAIRS], sinv[REKV_ROPE_MAX_PAIRS];
    if (threadIdx.x == 0)
        pi = pos[blockIdx.x]; /* mapped host memory: read once per block */
    __syncthreads();
    rope_row_table(pi, f, head_dim, dyn, cosv, sinv);
    float *row = x + (size_t)blockIdx.x * (size_t)n_heads * (size_t)head_dim;
    for (int i = threadIdx.x; i < n_heads * (head_dim / 2); i += blockDim.x) {
        int ia, ib, j = rope_pair_at(i, head_dim, adjacent, &ia, &ib);
        float c = cosv[j], sn = sinv[j], x0 = row[ia], x1 = row[ib];
        row[ia] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
        row[ib] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
    }
}

static void k_rope(rekv_stream *s, float *x, const int32_t *pos, int m, int n_heads, int head_dim,
                   const rekv_rope_freqs *f, rekv_rope style)
{
    if (m <= 0 || n_heads <= 0 || head_dim < 2 || style == REKV_ROPE_NONE)
        return;
    if (head_dim > 512 || f->half * 2 != head_dim) {
        cuda_stream_fail(s, -EINVAL,
                         "cuda stream %s: rope with head_dim %d (> 512, or not the "
                         "table's %d)",
                         s->name, head_dim, 2 * f->half);
        return;
    }
    KLAUNCH(s, "rope", rope_kernel, m, ROW_THREADS, 0, x, pos, n_heads, head_dim, *f,
            style == REKV_ROPE_ADJACENT);
}

/* qkv's split: one block per row of the fused projection's output y ([m][nq + 2 nkv] fp32): the
 * bias added as bias_kernel adds it, q's and k's heads rotated as rope_kernel rotates them (the
 * same table, the same arithmetic), and the three parts written where three linears and two ropes
 * put them — the bias and RoPE passes of the unfused path, and their launches, folded into the
 * one pass that must copy the parts apart anyway. */
__global__ static void qkv_split_kernel(float *q, float *k, float *v, const float *y,
                                        const float *bias, const int32_t *pos, int n_heads,
                                        int n_kv, int head_dim, const rekv_rope_freqs f, int style)
{
    __shared__ int pi;
    __shared__ float dyn[REKV_ROPE_MAX_PAIRS], cosv[REKV_ROPE_MAX_PAIRS], sinv[REKV_ROPE_MAX_PAIRS];
    size_t r = blockIdx.x;
    int nq = n_heads * head_dim, nkv = n_kv * head_dim, w = nq + 2 * nkv;
    const float *yr = y + r * (size_t)w;
    float *qr = q + r * (size_t)nq, *kr = k + r * (size_t)nkv, *vr = v + r * (size_t)nkv;
    for (int j = threadIdx.x; j < nkv; j += blockDim.x) /* v: never rotated */
        vr[j] = bias ? yr[nq + nkv + j] + bias[nq + nkv + j] : yr[nq + nkv + j];
    if (style == REKV_ROPE_NONE) {
        for (int j = threadIdx.x; j < nq + nkv; j += blockDim.x) {
            float t = bias ? yr[j] + bias[j] : yr[j];
            if (j < nq)
                qr[j] = t;
            else
                kr[j - nq] = t;
        }
        return;
    }
    if (threadIdx.x == 0)
        pi = pos[blockIdx.x]; /* mapped host memory: read once per block */
    __syncthreads();
    rope_row_table(pi, f, head_dim, dyn, cosv, sinv);
    int half = head_dim / 2, adjacent = style == REKV_ROPE_ADJACENT;
    for (int i = threadIdx.x; i < (n_heads + n_kv) * half; i += blockDim.x) {
        int is_k = i >= n_heads * half, ia, ib;
        int j = rope_pair_at(is_k ? i - n_heads * half : i, head_dim, adjacent, &ia, &ib);
        int at = is_k ? nq : 0; /* the part's first column in y and bias */
        float *out = is_k ? kr : qr;
        float x0 = yr[at + ia], x1 = yr[at + ib];
        if (bias) {
            x0 += bias[at + ia];
            x1 += bias[at + ib];
        }
        float c = cosv[j], sn = sinv[j];
        out[ia] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn));
        out[ib] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, c));
    }
}

/* kernels.h's qkv: one GEMM over the concatenated matrices into the stream's scratch, then the
 * split (bias, RoPE, the three parts) — a convert (16-bit weights), a GEMM and one kernel where
 * the unfused path runs three of each, three bias kernels and two ropes. */
static void k_qkv(rekv_stream *s, float *q, float *k, float *v, const float *x, const void *w,
                  rekv_dtype wt, const float *bias, int m, int kdim, int n_heads, int n_kv,
                  int head_dim, const int32_t *pos, const rekv_rope_freqs *f, rekv_rope style)
{
    if (m <= 0 || n_heads <= 0 || n_kv <= 0 || head_dim <= 0)
        return;
    if (style != REKV_ROPE_NONE && (head_dim > 512 || f->half * 2 != head_dim)) {
        cuda_stream_fail(s, -EINVAL,
                         "cuda stream %s: qkv's rope with head_dim %d (> 512, or not the table's "
                         "%d)",
                         s->name, head_dim, 2 * f->half);
        return;
    }
    cuda_use_device(s->be);
    cu_kstate *ks = kstate(s);
    if (ks == NULL)
        return;
    int n = (n_heads + 2 * n_kv) * head_dim;
    if (stream_scratch(s, ks, &ks->yqkv, sizeof(float) * (size_t)m * (size_t)n) != 0)
        return;
    float *y = (float *)ks->yqkv.p;
    long op = cuda_op_begin(s, CU_OP_COMPUTE, "qkv");
    if (gemm(s, ks, y, x, w, wt, m, n, kdim) == 0) {
        rekv_rope_freqs none{}; /* without RoPE f may be NULL; the kernel reads no table */
        qkv_split_kernel<<<m, ROW_THREADS, 0, s->cs>>>(
            q, k, v, y, bias, pos, n_heads, n_kv, head_dim, style == REKV_ROPE_NONE ? none : *f,
            (int)style);
        cuda_launch_check(s, "qkv split");
    }
    cuda_op_end(s, op);
    size_t qb = sizeof(float) * (size_t)m * (size_t)head_dim, ys = qb / head_dim * n;
    void *outs[4] = {q, k, v, y};
    size_t ob[4] = {qb * n_heads, qb * n_kv, qb * n_kv, ys};
    x16_keep(s, x, outs, ob, 4); /* it wrote q, k, v and its scratch alone */
}

/* act (rekv_act) of v, the gated ones' (SiLU, tanh GELU) gate g (NULL: none) */
__device__ __forceinline__ static float act_of(float v, const float *g, size_t i, int act)
{
    if (act == REKV_ACT_RELU)
        return v > 0 ? v : 0;
    if (act == REKV_ACT_GELU)
        return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    if (act == REKV_ACT_GELU_TANH) { /* PyTorch's approximate="tanh", as cpu_activation */
        float inner = 0.7978845608028654f * (v + 0.044715f * (v * v * v));
        float gv = 0.5f * v * (1.0f + tanhf(inner));
        return g ? gv * g[i] : gv;
    }
    float sv = v / (1.0f + expf(-v));
    return g ? sv * g[i] : sv;
}

__global__ static void act_kernel(float *a, const float *b, size_t n, int act, void *o16,
                                  int dt16)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = act_of(a[i], b, i, act);
        a[i] = v;
        if (o16 != NULL) /* x16_claim: the down projection's input */
            store_from_f32(o16, i, v, dt16);
    }
}

static void k_activation(rekv_stream *s, float *x, const float *b, size_t n, rekv_act act)
{
    if (n == 0)
        return;
    int dt16 = 0;
    void *o16 = x16_claim(s, n, &dt16);
    KLAUNCH(s, "activation", act_kernel, ew_blocks(n), EW_THREADS, 0, x, b, n, (int)act, o16,
            dt16);
    if (o16 != NULL)
        x16_tag(s, x, n, dt16);
}

__global__ static void add_kernel(float *x, const float *y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static void k_add(rekv_stream *s, float *x, const float *y, size_t n)
{
    if (n == 0)
        return;
    KLAUNCH(s, "add", add_kernel, ew_blocks(n), EW_THREADS, 0, x, y, n);
}

/* Gemma's element-wise ops (kernels.h scale, softcap): x *= a; x = cap * tanh(x / cap) */
__global__ static void scale_kernel(float *x, size_t n, float a, int softcap)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = softcap ? tanhf(x[i] / a) * a : x[i] * a;
}

static void k_scale(rekv_stream *s, float *x, size_t n, float a)
{
    if (n == 0)
        return;
    KLAUNCH(s, "scale", scale_kernel, ew_blocks(n), EW_THREADS, 0, x, n, a, 0);
}

static void k_softcap(rekv_stream *s, float *x, size_t n, float cap)
{
    if (n == 0)
        return;
    KLAUNCH(s, "softcap", scale_kernel, ew_blocks(n), EW_THREADS, 0, x, n, cap, 1);
}

/* The bias of the linear before them folded into the activation and the residual add (kernels.h
 * bias_activation, bias_add): blocks over rows, threads over columns, as bias_kernel, whose pass
 * they replace; the same sums in the same order as the bias kernel then the plain kernel. */
__global__ static void bias_act_kernel(float *a, const float *bias, const float *b, int m, int n,
                                       int act, void *o16, int dt16)
{
    for (int r = blockIdx.x; r < m; r += gridDim.x) {
        size_t at = (size_t)r * (size_t)n;
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            float v = act_of(a[at + c] + bias[c], b, at + c, act);
            a[at + c] = v;
            if (o16 != NULL)
                store_from_f32(o16, at + c, v, dt16);
        }
    }
}

__global__ static void bias_add_kernel(float *x, const float *y, const float *bias, int m, int n)
{
    for (int r = blockIdx.x; r < m; r += gridDim.x) {
        size_t at = (size_t)r * (size_t)n;
        for (int c = threadIdx.x; c < n; c += blockDim.x)
            x[at + c] += y[at + c] + bias[c];
    }
}

static void k_bias_activation(rekv_stream *s, float *a, const float *bias, const float *b, int m,
                              int n, rekv_act act)
{
    if (m <= 0 || n <= 0)
        return;
    unsigned nb = m < 65536 ? (unsigned)m : 65536u;
    int dt16 = 0;
    size_t ne = (size_t)m * (size_t)n;
    void *o16 = x16_claim(s, ne, &dt16);
    KLAUNCH(s, "activation", bias_act_kernel, nb, EW_THREADS, 0, a, bias, b, m, n, (int)act, o16,
            dt16);
    if (o16 != NULL)
        x16_tag(s, a, ne, dt16);
}

static void k_bias_add(rekv_stream *s, float *x, const float *y, const float *bias, int m, int n)
{
    if (m <= 0 || n <= 0)
        return;
    unsigned nb = m < 65536 ? (unsigned)m : 65536u;
    KLAUNCH(s, "add", bias_add_kernel, nb, EW_THREADS, 0, x, y, bias, m, n);
}

/* One block per row; a quantized table (qt: its GGUF type, rb: a row's bytes) has only the
 * looked-up rows decoded (gguf_block.h: ggml's values, as the cpu's lookup gives them). */
__global__ static void embed_kernel(float *x, const void *table, int tdtype, uint32_t qt, size_t rb,
                                    const int32_t *tokens, const float *pos_table,
                                    const int32_t *pos, int pos_offset, int e)
{
    __shared__ int tok, ps;
    if (threadIdx.x == 0) {
        tok = table ? tokens[blockIdx.x] : 0;
        ps = pos_table ? pos[blockIdx.x] + pos_offset : 0;
    }
    __syncthreads();
    float *row = x + (size_t)blockIdx.x * e;
    const float *pr = pos_table ? pos_table + (size_t)ps * e : NULL;
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        float v = !table ? row[j]
                  : qt   ? rekv_qb_at(qt, (const uint8_t *)table + (size_t)tok * rb, j)
                         : load_as_f32(table, (size_t)tok * e + j, tdtype);
        if (pr)
            v += pr[j];
        row[j] = v;
    }
}

static void k_embed(rekv_stream *s, float *x, const void *table, rekv_dtype tt,
                    const int32_t *tokens, const float *pos_table, const int32_t *pos,
                    int pos_offset, int m, int e)
{
    if (m <= 0 || e <= 0 || (table == NULL && pos_table == NULL))
        return;
    uint32_t qt = cpu_qgemm_wt_type(tt), be = 0, bb = 0;
    if (qt && (!rekv_qb_geometry(qt, &be, &bb) || e % (int)be != 0)) {
        cuda_stream_fail(s, -EINVAL,
                         "cuda stream %s: embed over GGUF type %u with width %d (not whole "
                         "blocks of a type the kernels read)",
                         s->name, qt, e);
        return;
    }
    size_t rb = qt ? (size_t)e / be * bb : 0;
    KLAUNCH(s, "embed", embed_kernel, m, ROW_THREADS, 0, x, table, (int)tt, qt, rb, tokens,
            pos_table, pos, pos_offset, e);
}

/* One block per row r: its K and V heads go to seqs[row_seq[r]] at position row_pos[r], stored in
 * the cache dtype. */
__global__ static void scatter_kernel(const float *k, const float *v, const int32_t *row_seq,
                                      const int32_t *row_pos, const int32_t *head_pos,
                                      const rekv_attn_seq *seqs, int n_kv, int hd, int dtype)
{
    __shared__ void *kv;
    __shared__ int p;
    if (threadIdx.x == 0) {
        kv = seqs[row_seq[blockIdx.x]].kv;
        p = head_pos ? -1 : row_pos[blockIdx.x]; /* head_pos: row_pos may be NULL */
    }
    __syncthreads();
    size_t src0 = (size_t)blockIdx.x * (size_t)n_kv * (size_t)hd, vs = rekv_kv_v_shift(n_kv, hd);
    for (int i = threadIdx.x; i < n_kv * hd; i += blockDim.x) {
        int g = i / hd, j = i % hd;
        int slot = head_pos ? head_pos[(size_t)blockIdx.x * (size_t)n_kv + (size_t)g] : p;
        if (slot < 0)
            continue;
        size_t dst = rekv_kv_row(n_kv, hd, g, slot) + (size_t)j;
        store_from_f32(kv, dst, k[src0 + i], dtype);
        store_from_f32(kv, dst + vs, v[src0 + i], dtype);
    }
}

/* Elements per quantization group of a row of hd (rekv_kvq_group's rule, for the device). */
__host__ __device__ __forceinline__ static int kvq_group(int hd)
{
    return hd % REKV_KVQ_GROUP == 0 ? REKV_KVQ_GROUP : hd;
}

/* Quantizes one row of hd fp32 elements x into dst (int8/int4, common/dtype.h's row format), the
 * warp together: codes and scales bit for bit rekv_kv_row_from_f32's. Per group, amax is a max
 * (order-free; NaN ignored as the cpu's `a > amax` does), s = f16(amax / qmax) saturated at 65504
 * (__float2half_rn rounds to nearest even, as rekv_f32_to_f16), a code rint(x / s) clamped, half
 * to even (rintf); each quotient is one IEEE division (__fdiv_rn, whatever the flags). */
__device__ static void kvq_row_warp(uint8_t *dst, const float *x, int hd, int q4)
{
    int lane = threadIdx.x & 31, gs = kvq_group(hd);
    float qmax = q4 ? 7.0f : 127.0f;
    uint8_t *scales = dst + (q4 ? hd / 2 : hd);
    for (int g = 0; g < hd / gs; g++) {
        const float *xg = x + (size_t)g * gs;
        float amax = 0.0f;
        for (int i = lane; i < gs; i += 32) {
            float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
        }
        for (int o = 16; o > 0; o >>= 1) {
            float b = __shfl_xor_sync(0xffffffffu, amax, o);
            amax = b > amax ? b : amax;
        }
        float sq = __fdiv_rn(amax, qmax);
        unsigned short sh =
            sq >= 65504.0f ? (unsigned short)0x7bffu : __half_as_ushort(__float2half_rn(sq));
        float s = __half2float(__ushort_as_half(sh));
        if (lane == 0) { /* byte stores: a row's scales need not be 2-aligned */
            scales[2 * g] = (uint8_t)(sh & 0xffu);
            scales[2 * g + 1] = (uint8_t)(sh >> 8);
        }
        /* lane i makes element i (int8) or the byte of elements 2i, 2i + 1 (int4) */
        for (int i = lane; i < (q4 ? gs / 2 : gs); i += 32) {
            int n = q4 ? 2 : 1, c[2] = {0, 0};
            for (int u = 0; u < n && s != 0.0f; u++) {
                float q = rintf(__fdiv_rn(xg[n * i + u], s));
                c[u] = q > qmax ? (int)qmax : q < -qmax ? -(int)qmax : (int)q;
            }
            if (q4)
                dst[((size_t)g * gs) / 2 + i] = (uint8_t)((c[0] + 8) | ((c[1] + 8) << 4));
            else
                dst[(size_t)g * gs + i] = (uint8_t)(int8_t)c[0];
        }
    }
}

/* The quantized scatter: one block per row r, a warp per (kv head, K or V) row, written to the
 * slot's row at row index times rb bytes (rows, never elements: kvlayout.h's rekv_kv_off). */
__global__ static void scatter_q_kernel(const float *k, const float *v, const int32_t *row_seq,
                                        const int32_t *row_pos, const int32_t *head_pos,
                                        const rekv_attn_seq *seqs, int n_kv, int hd, int q4,
                                        size_t rb)
{
    __shared__ uint8_t *kv;
    __shared__ int p;
    if (threadIdx.x == 0) {
        kv = (uint8_t *)seqs[row_seq[blockIdx.x]].kv;
        p = head_pos ? -1 : row_pos[blockIdx.x];
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    size_t src0 = (size_t)blockIdx.x * (size_t)n_kv * (size_t)hd;
    for (int w = warp; w < 2 * n_kv; w += warps) {
        int g = w >> 1, is_v = w & 1;
        int slot = head_pos ? head_pos[(size_t)blockIdx.x * (size_t)n_kv + (size_t)g] : p;
        if (slot < 0)
            continue;
        /* rekv_kv_row with head_dim 1 is the row's index */
        size_t row = rekv_kv_row(n_kv, 1, g, slot) + (is_v ? rekv_kv_v_shift(n_kv, 1) : 0);
        kvq_row_warp(kv + row * rb, (is_v ? v : k) + src0 + (size_t)g * hd, hd, q4);
    }
}

static void k_kv_scatter(rekv_stream *s, const float *k, const float *v, int rows,
                         const int32_t *row_seq, const int32_t *row_pos, const int32_t *head_pos,
                         const rekv_attn_seq *seqs, int n_kv, int head_dim, rekv_dtype dt)
{
    if (rows <= 0 || n_kv <= 0 || head_dim <= 0)
        return;
    if (rekv_dtype_quantized(dt)) {
        int q4 = dt == REKV_DTYPE_I4;
        if (q4 && head_dim % 2 != 0) { /* two codes a byte: a row is whole bytes */
            cuda_stream_fail(s, -EINVAL,
                             "cuda stream %s: kv_scatter: an INT4 row of odd head_dim %d", s->name,
                             head_dim);
            return;
        }
        KLAUNCH(s, "kv_scatter", scatter_q_kernel, rows, ROW_THREADS, 0, k, v, row_seq, row_pos,
                head_pos, seqs, n_kv, head_dim, q4, rekv_kv_row_bytes(dt, head_dim));
        return;
    }
    KLAUNCH(s, "kv_scatter", scatter_kernel, rows, ROW_THREADS, 0, k, v, row_seq, row_pos, head_pos,
            seqs, n_kv, head_dim, (int)dt);
}

/* Attention is a block per (head h, sequence y, z). Per query row, warp w takes context
 * positions w, w + ATT_WARPS, ... of the block's range; a position's score is a warp dot product;
 * each warp keeps a running max, sum and output (lane-strided over head_dim), and the block then
 * merges its warps' partial softmaxes (attn_merge). Plain (attention_kernel): z is a slice of the
 * rows — rows z, z + ATT_ROW_SLICES, ... — each over its whole context; one slice when every
 * sequence has one row. Split, flash-decoding
 * style (attention_split_kernel, for decode batches too small to fill the device): every sequence
 * has one row and z is a chunk of its context; each block writes its unnormalised partial
 * (max, sum, output) and attention_combine_kernel merges the chunks. Shared: q [hd],
 * acc [ATT_WARPS][hd], m and l [ATT_WARPS] each. */

/* Element j of a cache row at row (its first byte) of head dim hd, widened to fp32 exactly:
 * int8/int4 dequantized in place, the group's f16 scale times the code in one fp32 multiply as
 * rekv_kv_row_to_f32 does (__fmul_rn: never contracted into the caller's sums), so the values
 * are the cpu attention's bit for bit; no dequantized copy of the context is made. */
template <int DT> __device__ __forceinline__ static float kv_elem(const uint8_t *row, int j, int hd)
{
    if (DT == REKV_DTYPE_I8 || DT == REKV_DTYPE_I4) {
        int q4 = DT == REKV_DTYPE_I4;
        const uint8_t *sc = row + (q4 ? hd / 2 : hd) + 2 * (j / kvq_group(hd));
        float s = __half2float(__ushort_as_half((unsigned short)(sc[0] | (sc[1] << 8))));
        int c = q4 ? (int)((row[j >> 1] >> (4 * (j & 1))) & 0xfu) - 8 : (int)(int8_t)row[j];
        return __fmul_rn((float)c, s);
    }
    return load_as_f32(row, j, DT);
}

/* kv_gather: one block per row r, its threads over the row's n_kv * hd K elements, widened by
 * kv_elem as attention reads them. */
template <int DT>
__global__ static void gather_k_kernel(float *k, const int32_t *row_seq, const int32_t *row_pos,
                                       const rekv_attn_seq *seqs, int n_kv, int hd, size_t rb)
{
    const uint8_t *kv = (const uint8_t *)seqs[row_seq ? row_seq[blockIdx.x] : 0].kv;
    int slot = row_pos ? row_pos[blockIdx.x] : (int)blockIdx.x;
    float *out = k + (size_t)blockIdx.x * (size_t)n_kv * (size_t)hd;
    for (int i = threadIdx.x; i < n_kv * hd; i += blockDim.x) /* rekv_kv_row with head_dim 1: */
        out[i] = kv_elem<DT>(kv + rekv_kv_row(n_kv, 1, i / hd, slot) * rb, i % hd, hd); /* a row */
}

/* The warp's pass over positions t0 + warp, t0 + warp + ATT_WARPS, ... < t1 of kv head kvh; rows
 * of rb bytes (rekv_kv_row_bytes). */
template <int DT>
__device__ static void attn_warp_pass(const float *qs, const void *kv, int n_kv, int hd, size_t rb,
                                      int kvh, int t0, int t1, float scale, float cap, float &m,
                                      float &l, float *acc)
{
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    size_t vs = rekv_kv_v_shift(n_kv, 1) * rb; /* bytes from a K row to its V row */
    m = -INFINITY;
    l = 0;
#pragma unroll
    for (int c = 0; c < ATT_MAX_PER_LANE; c++)
        acc[c] = 0;
    for (int t = t0 + warp; t < t1; t += ATT_WARPS) {
        /* rekv_kv_row with head_dim 1 is the row's index */
        const uint8_t *row = (const uint8_t *)kv + rekv_kv_row(n_kv, 1, kvh, t) * rb;
        float d = 0;
        for (int j = lane; j < hd; j += 32)
            d += qs[j] * kv_elem<DT>(row, j, hd);
        for (int o = 16; o > 0; o >>= 1)
            d += __shfl_xor_sync(0xffffffffu, d, o);
        d *= scale;
        if (cap > 0) /* Gemma-2's soft-capped scores, as cpu_attention */
            d = tanhf(d / cap) * cap;
        float m_new = fmaxf(m, d);
        float corr = expf(m - m_new), p = expf(d - m_new);
        l = l * corr + p;
#pragma unroll
        for (int c = 0; c < ATT_MAX_PER_LANE; c++) {
            int j = c * 32 + lane;
            if (j < hd)
                acc[c] = acc[c] * corr + p * kv_elem<DT>(row + vs, j, hd);
        }
        m = m_new;
    }
}

/* Merges the block's warps (warp 0 saw position t0, so the max is finite; a warp that saw nothing
 * has m = -inf and weighs exp(-inf) = 0): o[j] = the merged output, divided by the merged sum
 * when normalise, else left with *mx and *sum for a later merge. */
__device__ static void attn_merge(float *accs, float *ms, float *ls, int hd, float m, float l,
                                  const float *acc, float *o, int normalise, float *mx_out,
                                  float *sum_out, void *o16, size_t i16, int dt16)
{
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < ATT_MAX_PER_LANE; c++) {
        int j = c * 32 + lane;
        if (j < hd)
            accs[warp * hd + j] = acc[c];
    }
    if (lane == 0) {
        ms[warp] = m;
        ls[warp] = l;
    }
    __syncthreads();
    float mx = ms[0];
    for (int w = 1; w < ATT_WARPS; w++)
        mx = fmaxf(mx, ms[w]);
    float sum = 0, wt[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; w++) { /* a warp that attended nothing weighs nothing */
        wt[w] = ms[w] == -INFINITY ? 0.0f : expf(ms[w] - mx);
        sum += ls[w] * wt[w];
    }
    /* nothing attended at all (an empty range): zeros, as on cpu, not NaN */
    float inv = !(sum > 0) ? 0.0f : normalise ? 1.0f / sum : 1.0f;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        float v = 0;
        for (int w = 0; w < ATT_WARPS; w++)
            v += accs[w * hd + j] * wt[w];
        o[j] = v * inv;
        if (o16 != NULL) /* x16_claim: the output projection's input, element i16 + j */
            store_from_f32(o16, i16 + j, v * inv, dt16);
    }
    *mx_out = mx;
    *sum_out = sum;
}

/* The first slot the query at position pos attends: after clo's skip, within the window. */
__device__ __forceinline__ static int attn_first(const rekv_attn_seq &sq, int kvh, int pos)
{
    int first = sq.skip ? sq.skip[kvh] : 0;
    return sq.window > 0 && pos + 1 - sq.window > first ? pos + 1 - sq.window : first;
}

template <int DT>
__global__ static void __launch_bounds__(ATT_WARPS * 32)
    attention_kernel(float *out, const float *q, const rekv_attn_seq *seqs, int n_heads, int n_kv,
                     int hd, size_t rb, float scale, void *o16, int dt16)
{
    extern __shared__ float sh[];
    float *qs = sh, *accs = sh + hd, *ms = accs + ATT_WARPS * hd, *ls = ms + ATT_WARPS;
    __shared__ rekv_attn_seq sq;
    if (threadIdx.x == 0)
        sq = seqs[blockIdx.y]; /* mapped host memory: read once per block */
    __syncthreads();
    int h = blockIdx.x, kvh = h / (n_heads / n_kv);
    size_t qd = (size_t)n_heads * (size_t)hd;
    for (int i = blockIdx.z; i < sq.n; i += gridDim.z) {
        size_t r = (size_t)sq.row0 + (size_t)i;
        const float *qh = q + r * qd + (size_t)h * hd;
        __syncthreads(); /* the previous row's merge has read the shared arrays */
        for (int j = threadIdx.x; j < hd; j += blockDim.x)
            qs[j] = qh[j];
        __syncthreads();
        float m, l, acc[ATT_MAX_PER_LANE], mx, sum;
        attn_warp_pass<DT>(qs, sq.kv, n_kv, hd, rb, kvh, attn_first(sq, kvh, sq.start + i),
                           sq.start + i + 1, sq.scale > 0 ? sq.scale : scale, sq.softcap, m, l,
                           acc);
        attn_merge(accs, ms, ls, hd, m, l, acc, out + r * qd + (size_t)h * hd, 1, &mx, &sum, o16,
                   r * qd + (size_t)h * hd, dt16);
    }
}

/* A partial of (row r, head h, chunk z): max, sum, then hd outputs. */
__device__ __forceinline__ static float *attn_partial(float *part, size_t r, int h, int z,
                                                      int n_heads, int splits, int hd)
{
    return part + ((r * (size_t)n_heads + (size_t)h) * (size_t)splits + (size_t)z) * (hd + 2);
}

template <int DT>
__global__ static void __launch_bounds__(ATT_WARPS * 32)
    attention_split_kernel(float *part, const float *q, const rekv_attn_seq *seqs, int n_heads,
                           int n_kv, int hd, size_t rb, float scale)
{
    extern __shared__ float sh[];
    float *qs = sh, *accs = sh + hd, *ms = accs + ATT_WARPS * hd, *ls = ms + ATT_WARPS;
    __shared__ rekv_attn_seq sq;
    if (threadIdx.x == 0)
        sq = seqs[blockIdx.y];
    __syncthreads();
    int h = blockIdx.x, kvh = h / (n_heads / n_kv), z = blockIdx.z, splits = gridDim.z;
    int base = attn_first(sq, kvh, sq.start);
    int n_ctx = sq.start + 1; /* the sequence's one row; slots base..start attended */
    int chunk = (n_ctx - base + splits - 1) / splits;
    if (chunk < ATT_MIN_CHUNK)
        chunk = ATT_MIN_CHUNK;
    int t0 = base + z * chunk, t1 = min(n_ctx, t0 + chunk);
    size_t r = (size_t)sq.row0;
    float *pp = attn_partial(part, r, h, z, n_heads, splits, hd);
    if (t0 >= t1) { /* past the context: an empty partial */
        for (int j = threadIdx.x; j < hd; j += blockDim.x)
            pp[2 + j] = 0;
        if (threadIdx.x == 0) {
            pp[0] = -INFINITY;
            pp[1] = 0;
        }
        return;
    }
    const float *qh = q + r * (size_t)n_heads * hd + (size_t)h * hd;
    for (int j = threadIdx.x; j < hd; j += blockDim.x)
        qs[j] = qh[j];
    __syncthreads();
    float m, l, acc[ATT_MAX_PER_LANE], mx, sum;
    attn_warp_pass<DT>(qs, sq.kv, n_kv, hd, rb, kvh, t0, t1, sq.scale > 0 ? sq.scale : scale,
                       sq.softcap, m, l, acc);
    attn_merge(accs, ms, ls, hd, m, l, acc, pp + 2, 0, &mx, &sum, NULL, 0, 0);
    if (threadIdx.x == 0) {
        pp[0] = mx;
        pp[1] = sum;
    }
}

/* Block (row r, head h): merges the chunks' partials (chunk 0 is never empty: a finite max). */
__global__ static void attention_combine_kernel(float *out, const float *part, int n_heads,
                                                int splits, int hd, void *o16, int dt16)
{
    size_t r = blockIdx.x;
    int h = blockIdx.y;
    const float *p0 = attn_partial((float *)part, r, h, 0, n_heads, splits, hd);
    size_t stride = (size_t)hd + 2;
    float mx = p0[0];
    for (int z = 1; z < splits; z++)
        mx = fmaxf(mx, p0[z * stride]);
    float sum = 0;
    for (int z = 0; z < splits; z++) /* an empty chunk weighs nothing */
        if (p0[z * stride] != -INFINITY)
            sum += p0[z * stride + 1] * expf(p0[z * stride] - mx);
    float inv = sum > 0 ? 1.0f / sum : 0.0f; /* nothing attended: zeros, as on cpu */
    size_t o0 = (r * (size_t)n_heads + (size_t)h) * hd;
    float *o = out + o0;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        float v = 0;
        for (int z = 0; z < splits; z++)
            if (p0[z * stride] != -INFINITY)
                v += p0[z * stride + 2 + j] * expf(p0[z * stride] - mx);
        o[j] = v * inv;
        if (o16 != NULL)
            store_from_f32(o16, o0 + j, v * inv, dt16);
    }
}

/* kernel<DT> for cache dtype dt, launched as KLAUNCH does */
#define DT_LAUNCH(s, name, dt, kernel, grid, threads, shmem, ...)                                  \
    do {                                                                                           \
        if ((dt) == REKV_DTYPE_F16)                                                                \
            KLAUNCH(s, name, kernel<REKV_DTYPE_F16>, grid, threads, shmem, __VA_ARGS__);          \
        else if ((dt) == REKV_DTYPE_BF16)                                                          \
            KLAUNCH(s, name, kernel<REKV_DTYPE_BF16>, grid, threads, shmem, __VA_ARGS__);         \
        else if ((dt) == REKV_DTYPE_I8)                                                            \
            KLAUNCH(s, name, kernel<REKV_DTYPE_I8>, grid, threads, shmem, __VA_ARGS__);           \
        else if ((dt) == REKV_DTYPE_I4)                                                            \
            KLAUNCH(s, name, kernel<REKV_DTYPE_I4>, grid, threads, shmem, __VA_ARGS__);           \
        else                                                                                       \
            KLAUNCH(s, name, kernel<REKV_DTYPE_F32>, grid, threads, shmem, __VA_ARGS__);          \
    } while (0)

#define ATT_LAUNCH(s, dt, kernel, grid, shmem, ...)                                                \
    DT_LAUNCH(s, "attention", dt, kernel, grid, ATT_WARPS * 32, shmem, __VA_ARGS__)

static void k_kv_gather(rekv_stream *s, float *k, int rows, const int32_t *row_seq,
                        const int32_t *row_pos, const rekv_attn_seq *seqs, int n_kv, int head_dim,
                        rekv_dtype dt)
{
    if (rows <= 0 || n_kv <= 0 || head_dim <= 0)
        return;
    DT_LAUNCH(s, "kv_gather", dt, gather_k_kernel, rows, ROW_THREADS, 0, k, row_seq, row_pos, seqs,
              n_kv, head_dim, rekv_kv_row_bytes(dt, head_dim));
}

static void k_attention(rekv_stream *s, float *out, const float *q, const rekv_attn_seq *seqs,
                        int n_seqs, int rows, int n_heads, int n_kv, int head_dim, float *scores,
                        rekv_dtype dt)
{
    (void)scores;
    if (n_seqs <= 0 || n_heads <= 0)
        return;
    if (head_dim <= 0 || head_dim > 32 * ATT_MAX_PER_LANE || n_kv <= 0 || n_heads % n_kv != 0) {
        cuda_stream_fail(s, -EINVAL,
                         "cuda stream %s: attention with head_dim %d (1..%d), %d heads, "
                         "%d kv heads",
                         s->name, head_dim, 32 * ATT_MAX_PER_LANE, n_heads, n_kv);
        return;
    }
    if (n_seqs > 65535) {
        cuda_stream_fail(s, -EINVAL, "cuda stream %s: attention over %d sequences (at most 65535)",
                         s->name, n_seqs);
        return;
    }
    if (dt == REKV_DTYPE_I4 && head_dim % 2 != 0) {
        cuda_stream_fail(s, -EINVAL, "cuda stream %s: attention over INT4 rows of odd head_dim %d",
                         s->name, head_dim);
        return;
    }
    size_t rb = rekv_kv_row_bytes(dt, head_dim);
    size_t shmem = sizeof(float) * ((size_t)head_dim * (1 + ATT_WARPS) + 2 * ATT_WARPS);
    float scale = 1.0f / sqrtf((float)head_dim); /* unless a descriptor has its own */
    /* a decode batch (one row per sequence) of fewer blocks than fill the device twice: split
     * each context into chunks (at least ATT_MIN_CHUNK positions each, decided per sequence) */
    int blocks = n_heads * n_seqs, fill = 2 * s->be->sms;
    /* rows == n_seqs is one row each only when no sequence has none: the pipeline's items always
     * have new tokens (kernels.h: every sequence contributes its n rows) */
    if (rows == n_seqs && blocks < fill) {
        int splits = (fill + blocks - 1) / blocks;
        if (splits > ATT_MAX_SPLITS)
            splits = ATT_MAX_SPLITS;
        size_t bytes = sizeof(float) * (size_t)rows * (size_t)n_heads * (size_t)splits *
                       ((size_t)head_dim + 2);
        float *part = NULL;
        cuda_use_device(s->be);
        if (cuda_stream_check(s, cudaMallocAsync((void **)&part, bytes, s->cs),
                              "attention scratch"))
            return;
        dim3 grid((unsigned)n_heads, (unsigned)n_seqs, (unsigned)splits);
        ATT_LAUNCH(s, dt, attention_split_kernel, grid, shmem, part, q, seqs, n_heads, n_kv,
                   head_dim, rb, scale);
        int dt16 = 0;
        size_t no = (size_t)rows * (size_t)n_heads * (size_t)head_dim;
        void *o16 = x16_claim(s, no, &dt16);
        KLAUNCH(s, "attention", attention_combine_kernel, dim3((unsigned)rows, (unsigned)n_heads),
                128, 0, out, part, n_heads, splits, head_dim, o16, dt16);
        if (o16 != NULL)
            x16_tag(s, out, no, dt16);
        cuda_stream_check(s, cudaFreeAsync(part, s->cs), "attention scratch");
        x16_keep(s, out, NULL, NULL, 0); /* the free wrote nothing */
        return;
    }
    /* one row per sequence (decode): one block per (head, sequence) — slices would only find
     * no row of theirs and exit */
    dim3 grid((unsigned)n_heads, (unsigned)n_seqs, rows == n_seqs ? 1u : (unsigned)ATT_ROW_SLICES);
    int dt16 = 0;
    size_t no = (size_t)rows * (size_t)n_heads * (size_t)head_dim;
    void *o16 = x16_claim(s, no, &dt16);
    ATT_LAUNCH(s, dt, attention_kernel, grid, shmem, out, q, seqs, n_heads, n_kv, head_dim, rb,
               scale, o16, dt16);
    if (o16 != NULL)
        x16_tag(s, out, no, dt16);
}

/* One block per piece (the piece read once, through shared memory), threads over its elements. */
__global__ static void convert_kernel(const rekv_convert_piece *pieces, int dtype)
{
    __shared__ rekv_convert_piece pc;
    if (threadIdx.x == 0)
        pc = pieces[blockIdx.x];
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < pc.n; i += blockDim.x)
        pc.dst[i] = load_as_f32(pc.src, i, dtype);
}

/* convert and convert_out take whole elements: a quantized row is read and written by rows only
 * (kv_scatter, attention), as on cpu (rekv_to_f32 / rekv_from_f32 refuse them) */
static int convert_refuses(rekv_stream *s, const char *what, rekv_dtype dtype)
{
    if (!rekv_dtype_quantized(dtype))
        return 0;
    cuda_stream_fail(s, -EINVAL, "cuda stream %s: %s of %s elements (quantized rows: by rows only)",
                     s->name, what, rekv_dtype_name(dtype));
    return 1;
}

static void k_convert(rekv_stream *s, const rekv_convert_piece *pieces, size_t n, rekv_dtype dtype)
{
    if (n == 0 || convert_refuses(s, "convert", dtype))
        return;
    /* grid.x may be up to 2^31 - 1; launch in chunks anyway so that the index stays an int */
    for (size_t off = 0; off < n; off += 1u << 30) {
        size_t c = n - off < (1u << 30) ? n - off : (1u << 30);
        KLAUNCH(s, "merge", convert_kernel, (unsigned)c, ROW_THREADS, 0, pieces + off, (int)dtype);
    }
}

static void k_convert_out(rekv_stream *s, void *dst, const float *src, size_t n, rekv_dtype dtype)
{
    if (n == 0 || convert_refuses(s, "convert_out", dtype))
        return;
    KLAUNCH(s, "convert_out", convert_out_kernel, ew_blocks(n), EW_THREADS, 0, dst, src, n,
            (int)dtype);
}

/* dst and src must not overlap (the cpu backend's memmove allows it; nothing relies on it). */
__global__ static void gather_kernel(float *dst, const float *src, const int32_t *idx, int w)
{
    __shared__ int r;
    if (threadIdx.x == 0)
        r = idx[blockIdx.x];
    __syncthreads();
    const float *sr = src + (size_t)r * w;
    float *dr = dst + (size_t)blockIdx.x * w;
    for (int j = threadIdx.x; j < w; j += blockDim.x)
        dr[j] = sr[j];
}

static void k_gather_rows(rekv_stream *s, float *dst, const float *src, const int32_t *idx, int n,
                          int w)
{
    if (n <= 0 || w <= 0)
        return;
    KLAUNCH(s, "gather_rows", gather_kernel, n, ROW_THREADS, 0, dst, src, idx, w);
}

/* ------------------------------------------------------------------ infinigen */

/* one block per (row, head), a thread per column */
__global__ static void head_proj_kernel(float *out, float *const *out_rows, const float *in,
                                        const float *a, int n_heads, int group, int hd, int rk)
{
    int r = blockIdx.x / n_heads, h = blockIdx.x % n_heads;
    float *o = out_rows ? out_rows[r] : out + (size_t)r * n_heads * rk;
    const float *x = in + ((size_t)r * n_heads + h) * hd;
    const float *ah = a + (size_t)(h / group) * hd * rk;
    for (int c = threadIdx.x; c < rk; c += blockDim.x) {
        float acc = 0;
        for (int d = 0; d < hd; d++)
            acc += x[d] * ah[(size_t)d * rk + c];
        o[(size_t)h * rk + c] = acc;
    }
}

static void k_head_proj(rekv_stream *s, float *out, float *const *out_rows, const float *in,
                        const float *a, int rows, int n_heads, int group, int hd, int rk)
{
    if (rows <= 0)
        return;
    int threads = rk < 32 ? 32 : rk > 256 ? 256 : rk;
    KLAUNCH(s, "head_proj", head_proj_kernel, rows * n_heads, threads, 0, out, out_rows, in, a,
            n_heads, group, hd, rk);
}

/* one block per (sequence, head); the partial query in shared memory, a thread per token. The
 * descriptor is in mapped host memory: read once per block, not on every iteration (the stores to
 * out may alias it, so the compiler would re-read it over PCIe) */
__global__ static void spec_kernel(float *out, const float *q, const rekv_spec_seq *seqs,
                                   int n_heads, int group, int rk, float scale)
{
    extern __shared__ float qs[];
    __shared__ rekv_spec_seq sd;
    if (threadIdx.x == 0)
        sd = seqs[blockIdx.x / n_heads];
    __syncthreads();
    const rekv_spec_seq *sq = &sd;
    int h = blockIdx.x % n_heads, n_kv = n_heads / group;
    for (int c = threadIdx.x; c < rk; c += blockDim.x)
        qs[c] = q[((size_t)sq->row * n_heads + h) * rk + c];
    __syncthreads();
    float *o = out + sq->out + (size_t)h * sq->len;
    for (int t = threadIdx.x; t < sq->len; t += blockDim.x) {
        const float *k = sq->pk + ((size_t)t * n_kv + h / group) * rk;
        float acc = 0;
        for (int c = 0; c < rk; c++)
            acc += qs[c] * k[c];
        o[t] = scale * acc;
    }
}

static void k_spec_scores(rekv_stream *s, float *out, const float *q, const rekv_spec_seq *seqs,
                          int n, int n_heads, int group, int rk, float scale)
{
    if (n <= 0)
        return;
    KLAUNCH(s, "spec_scores", spec_kernel, n * n_heads, ROW_THREADS, sizeof(float) * rk, out, q,
            seqs, n_heads, group, rk, scale);
}

/* ------------------------------------------------------------------ sampling */

/* One block per row follows rekv_sample_drawn (gpuworker/sample.c) without a sort: each thread
 * takes a contiguous run of ids, so a block-wide prefix sum over the threads' runs walks the
 * vocabulary in id order. A set of tokens "the first n by rank" (logit descending, lower id first)
 * is a threshold key and a count of the tokens at the threshold to take, lowest ids first; the
 * threshold is found by radix selection (four passes of 8 bits, histograms in shared memory).
 * Weights are exp((logit - max) / temperature) in fixed point (SAMPLE_FIX bits below the point):
 * integer sums, so a draw does not depend on the order of atomic adds. */
enum { SAMPLE_THREADS = 1024 };
#define SAMPLE_FIX 0x1p40f

/* a logit's rank as an unsigned key: larger logit, larger key; -0 is +0 */
__device__ __forceinline__ static uint32_t logit_key(float f)
{
    uint32_t u = __float_as_uint(f);
    if (u == 0x80000000u)
        u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ static float key_logit(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* The tokens with key > thr, and the first n_tie (by id) of those with key == thr; base: the
 * ties before this thread's run. */
typedef struct sample_set {
    uint32_t thr;
    unsigned long long n_tie, base;
} sample_set;

/* calls f(i, key) for the members of s in this thread's run [lo, hi), in id order */
template <class F>
__device__ static void set_walk(const float *lg, int lo, int hi, const sample_set &s, F f)
{
    unsigned long long rank = s.base;
    for (int i = lo; i < hi; i++) {
        uint32_t k = logit_key(lg[i]);
        if (k > s.thr || (k == s.thr && rank++ < s.n_tie))
            f(i, k);
    }
}

/* Exclusive prefix sum of v over the block's threads, in thread order; *total: the sum. sh: 33
 * words of shared memory. */
__device__ static unsigned long long block_scan(unsigned long long v, unsigned long long *total,
                                                unsigned long long *sh)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    unsigned long long x = v;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    __syncthreads(); /* sh may still be read from a previous call */
    if (lane == 31)
        sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned long long t = lane < nw ? sh[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            unsigned long long y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o)
                t += y;
        }
        if (lane < nw)
            sh[lane] = t;
    }
    __syncthreads();
    *total = sh[nw - 1];
    return (warp ? sh[warp - 1] : 0) + x - v;
}

/* s.base for s.thr: the ties (key == thr) in the runs of the threads before this one */
__device__ static void set_base(const float *lg, int lo, int hi, sample_set *s,
                                unsigned long long *sh)
{
    unsigned long long c = 0, total;
    for (int i = lo; i < hi; i++)
        c += logit_key(lg[i]) == s->thr;
    s->base = block_scan(c, &total, sh);
}

/* The first members of dom by rank whose weights w(key) reach want (want <= their total). */
template <class W>
__device__ static sample_set set_select(const float *lg, int lo, int hi, const sample_set &dom,
                                        unsigned long long want, W w, unsigned long long *hist,
                                        unsigned long long *sh)
{
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        for (int b = threadIdx.x; b < 256; b += blockDim.x)
            hist[b] = 0;
        __syncthreads();
        set_walk(lg, lo, hi, dom, [&](int, uint32_t k) {
            if ((k & mask) == prefix)
                atomicAdd(&hist[(k >> shift) & 255u], w(k));
        });
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long acc = 0;
            int b = 255;
            for (; b > 0 && acc + hist[b] < want; b--)
                acc += hist[b];
            sh[0] = (unsigned long long)b;
            sh[1] = want - acc;
        }
        __syncthreads();
        prefix |= (uint32_t)sh[0] << shift;
        mask |= 255u << shift;
        want = sh[1];
    }
    unsigned long long wt = w(prefix); /* every tie weighs the same */
    sample_set s = {prefix, wt ? (want + wt - 1) / wt : 0, 0};
    set_base(lg, lo, hi, &s, sh);
    return s;
}

__global__ static void __launch_bounds__(SAMPLE_THREADS)
    sample_kernel(int32_t *ids, int32_t *top_ids, float *top_vals, rekv_sample_lp *lp,
                  const float *logits, const rekv_sample_row *rows, int V)
{
    __shared__ unsigned long long hist[256], sh[34];
    __shared__ double red_d[32];
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    __shared__ rekv_sample_row w; /* mapped host memory: read once per block */
    if (threadIdx.x == 0)
        w = rows[blockIdx.x];
    __syncthreads();
    const float *lg = logits + (size_t)blockIdx.x * V;
    int chunk = (V + (int)blockDim.x - 1) / (int)blockDim.x;
    int lo = min(V, (int)threadIdx.x * chunk), hi = min(V, lo + chunk);

    /* a NaN logit (a broken model) draws -1, as rekv_sample_drawn: no choice may hide it (the
     * pipeline fails the step) */
    int nan_here = 0;
    for (int i = lo; i < hi; i++)
        nan_here |= isnan(lg[i]);
    if (__syncthreads_or(nan_here)) {
        if (threadIdx.x == 0)
            ids[blockIdx.x] = -1;
        return;
    }

    /* the greedy choice: the largest logit, the lowest id on ties */
    float bv = -INFINITY;
    int bi = V;
    for (int i = lo; i < hi; i++)
        if (bi == V || lg[i] > bv)
            bv = lg[i], bi = i;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi < V && (bi == V || ov > bv || (ov == bv && oi < bi)))
            bv = ov, bi = oi;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    if (lane == 0)
        red_v[warp] = bv, red_i[warp] = bi;
    __syncthreads();
    bv = red_v[0], bi = red_i[0];
    for (int j = 1; j < nw; j++)
        if (red_i[j] < V && (bi == V || red_v[j] > bv || (red_v[j] == bv && red_i[j] < bi)))
            bv = red_v[j], bi = red_i[j];
    if (w.logprob) { /* rekv_logsumexp: the sum of exp(logit - max) in double */
        double sum = 0;
        for (int i = lo; i < hi; i++)
            sum += exp((double)lg[i] - (double)bv);
        for (int o = 16; o > 0; o >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0)
            red_d[warp] = sum;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int j = 1; j < nw; j++)
                sum += red_d[j];
            lp[blockIdx.x].lse = isfinite(bv) ? (double)bv + log(sum) : (double)bv;
        }
    }

    const sample_set all = {0, ~0ull, 0};
    auto one = [](uint32_t) -> unsigned long long { return 1; };
    if (w.n_top > 0) { /* the n_top largest, written in id order */
        sample_set t =
            set_select(lg, lo, hi, all, (unsigned long long)min(w.n_top, V), one, hist, sh);
        unsigned long long mine = 0, total;
        set_walk(lg, lo, hi, t, [&](int, uint32_t) { mine++; });
        unsigned long long at = (unsigned long long)w.top_at + block_scan(mine, &total, sh);
        set_walk(lg, lo, hi, t, [&](int i, uint32_t) {
            top_ids[at] = i;
            top_vals[at] = lg[i];
            at++;
        });
    }
    if (!(w.temperature > 0.0f)) {
        if (threadIdx.x == 0) {
            ids[blockIdx.x] = bi;
            if (w.logprob)
                lp[blockIdx.x].logit = bv;
        }
        return;
    }
    float mx = bv, temp = w.temperature;
    auto weight = [=](uint32_t k) -> unsigned long long {
        return (unsigned long long)(expf((key_logit(k) - mx) / temp) * SAMPLE_FIX);
    };
    sample_set dom = all;
    if (w.top_k > 0 && w.top_k < V)
        dom = set_select(lg, lo, hi, all, (unsigned long long)w.top_k, one, hist, sh);
    unsigned long long mine = 0, total;
    if (w.top_p > 0.0f && w.top_p < 1.0f) {
        set_walk(lg, lo, hi, dom, [&](int, uint32_t k) { mine += weight(k); });
        block_scan(mine, &total, sh);
        unsigned long long want = (unsigned long long)ceil((double)w.top_p * (double)total);
        dom = set_select(lg, lo, hi, dom, want ? want : 1, weight, hist, sh);
        mine = 0;
    }
    /* the draw: the first kept token, in id order, whose running weight exceeds u * the sum */
    set_walk(lg, lo, hi, dom, [&](int, uint32_t k) { mine += weight(k); });
    unsigned long long acc = block_scan(mine, &total, sh);
    if (total == 0) { /* no weight at all (an inf or NaN logit): the greedy pick, never nothing */
        if (threadIdx.x == 0) {
            ids[blockIdx.x] = bi;
            if (w.logprob)
                lp[blockIdx.x].logit = bv;
        }
        return;
    }
    unsigned long long target = (unsigned long long)((double)w.u * (double)total);
    if (acc <= target && target < acc + mine) {
        int pick = -1;
        set_walk(lg, lo, hi, dom, [&](int i, uint32_t k) {
            acc += weight(k);
            if (pick < 0 && acc > target)
                pick = i;
        });
        ids[blockIdx.x] = pick;
        if (w.logprob)
            lp[blockIdx.x].logit = lg[pick];
    }
}

static void k_sample(rekv_stream *s, int32_t *ids, int32_t *top_ids, float *top_vals,
                     rekv_sample_lp *lp, const float *logits, const rekv_sample_row *rows, int n,
                     int vocab, void *scratch)
{
    (void)scratch;
    if (n <= 0 || vocab <= 0)
        return;
    KLAUNCH(s, "sample", sample_kernel, n, SAMPLE_THREADS, 0, ids, top_ids, top_vals, lp, logits,
            rows, vocab);
}

/* ------------------------------------------------------------------ infinigen's selection */

/* The selection on the device (kernels.h ig_select) follows rekv_ig_select_seq
 * (pipeline_infinigen.c) in kernels, with nothing between them on the host:
 *   - ig_live_kernel, a block per (sequence, KV head), for a sequence with a KV pool: the head's
 *     live positions in order (a prefix sum over the threads' runs) and its query group's scores
 *     gathered there — what the others select among;
 *   - ig_stats_kernel, a block per (sequence, query head): the head's largest score, the sum of
 *     its exponentials, its tokens above the largest minus alpha;
 *   - ig_pick_kernel, a block per (sequence, KV head): the count m (the heads' counts averaged,
 *     capped, as every block of the sequence computes it alike), the group's summed softmax, its
 *     top m by sample's radix selection (set_select: lowest position first on ties), written in
 *     position order by a prefix sum over the threads' runs; or m at random (rekv_ig_select's
 *     Floyd sample and splitmix draws, the cpu's positions exactly), or all;
 *   - ig_pool_kernel, a block per (sequence, KV head) with a pool: the selected entries' counters
 *     up (at most one saturates, the first in order: the halving lands between the increments
 *     before it and after it, as rekv_kv_pool_touch's), then the new token admitted, each victim
 *     the least counted (or the oldest) of the older half of the live entries (rekv_kv_pool_admit);
 *   - ig_rows_kernel, a block per sequence: its rows' copies after the earlier sequences' (their
 *     m read back in stream order), in ig_select's order, for the listed gather after it.
 * Scratch per sequence (rekv_ig_scratch_floats): the group sums [n_kv][len] from 0, the gathered
 * scores [n_heads][len] from (n_kv + 1) len, the live positions [n_kv][len] from (n_kv + 1 +
 * n_heads) len, the heads' statistics (largest, 1 / sum, count) from (2 n_kv + 1 + n_heads) len.
 * The exponentials are expf's, not the cpu's polynomial, and the sums are in another order, so a
 * sum within an ulp or so of the m-th may rank otherwise than on cpu. */
enum { IG_THREADS = 1024 };

__device__ static float block_max(float v, float *red)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads(); /* red may still be read from a previous call */
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    float t = red[0];
    for (int i = 1; i < nw; i++)
        t = fmaxf(t, red[i]);
    return t;
}

/* A sequence of the selection as a block sees it: its descriptor and what it selects among. */
typedef struct ig_view {
    rekv_ig_seq q;
    int span; /* the tokens selected among: len - dev, or a pool's live ones */
} ig_view;

/* Thread 0 reads sequence j's descriptor (mapped host memory: once per block); every thread
 * returns with it. */
__device__ static void ig_view_load(ig_view *v, const rekv_ig_seq *seqs, int j)
{
    if (threadIdx.x == 0) {
        v->q = seqs[j];
        v->span = v->q.count ? v->q.len - v->q.n_gone[0] : v->q.len - v->q.dev;
    }
    __syncthreads();
}

__device__ static float *ig_sub(const ig_view &v, int n_kv)
{
    return v.q.scratch + (size_t)(n_kv + 1) * (size_t)v.q.len;
}

__device__ static int32_t *ig_live(const ig_view &v, int n_heads, int n_kv, int g)
{
    return (int32_t *)(v.q.scratch + (size_t)(n_kv + 1 + n_heads) * (size_t)v.q.len) +
           (size_t)g * (size_t)v.q.len;
}

__device__ static float *ig_stats_at(const ig_view &v, int n_heads, int n_kv, int h)
{
    return v.q.scratch + (size_t)(2 * n_kv + 1 + n_heads) * (size_t)v.q.len + 3 * (size_t)h;
}

/* Head h's scores selected among (span of them): past the device part, or gathered */
__device__ static const float *ig_row(const float *scores, const ig_view &v, int n_kv, int h)
{
    if (v.q.count)
        return ig_sub(v, n_kv) + (size_t)h * (size_t)v.span;
    return scores + v.q.scores + (size_t)h * (size_t)v.q.len + v.q.dev;
}

__global__ static void __launch_bounds__(IG_THREADS)
    ig_live_kernel(const float *scores, const rekv_ig_seq *seqs, int n_heads, int n_kv)
{
    __shared__ ig_view v;
    __shared__ unsigned long long sh[34];
    int g = blockIdx.x % n_kv, group = n_heads / n_kv;
    ig_view_load(&v, seqs, blockIdx.x / n_kv);
    if (v.q.count == NULL)
        return;
    int len = v.q.len, chunk = (len + (int)blockDim.x - 1) / (int)blockDim.x;
    int lo = min(len, (int)threadIdx.x * chunk), hi = min(len, lo + chunk);
    const uint8_t *gone = v.q.gone + (size_t)g * (size_t)v.q.cap;
    int32_t *live = ig_live(v, n_heads, n_kv, g);
    unsigned long long mine = 0, total;
    for (int t = lo; t < hi; t++)
        mine += !gone[t];
    unsigned long long at = block_scan(mine, &total, sh);
    for (int t = lo; t < hi; t++)
        if (!gone[t])
            live[at++] = t;
    __syncthreads();
    for (int j = 0; j < group; j++) {
        int h = g * group + j;
        const float *s = scores + v.q.scores + (size_t)h * (size_t)len;
        float *sub = ig_sub(v, n_kv) + (size_t)h * (size_t)v.span;
        for (int i = threadIdx.x; i < v.span; i += blockDim.x)
            sub[i] = s[live[i]];
    }
}

__global__ static void __launch_bounds__(IG_THREADS)
    ig_stats_kernel(const float *scores, const rekv_ig_seq *seqs, int n_heads, int n_kv,
                    float alpha)
{
    __shared__ ig_view v;
    __shared__ float red[32];
    int h = blockIdx.x % n_heads;
    ig_view_load(&v, seqs, blockIdx.x / n_heads);
    int rest = v.span;
    if (rest <= 0)
        return;
    const float *sh = ig_row(scores, v, n_kv, h);
    float mx = -INFINITY, sum = 0, cnt = 0;
    for (int t = threadIdx.x; t < rest; t += blockDim.x)
        mx = fmaxf(mx, sh[t]);
    mx = block_max(mx, red);
    for (int t = threadIdx.x; t < rest; t += blockDim.x) {
        sum += expf(sh[t] - mx);
        cnt += sh[t] > mx - alpha;
    }
    sum = block_sum(sum, red);
    cnt = block_sum(cnt, red); /* exact: a count below 2^24 */
    if (threadIdx.x == 0) {
        float *st = ig_stats_at(v, n_heads, n_kv, h);
        st[0] = mx;
        st[1] = 1.0f / sum;
        st[2] = cnt;
    }
}

__device__ static uint64_t ig_splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__global__ static void __launch_bounds__(IG_THREADS)
    ig_pick_kernel(const float *scores, const rekv_ig_seq *seqs, rekv_ig_shape shape)
{
    __shared__ ig_view v;
    __shared__ unsigned long long hist[256], sh[34];
    __shared__ int m_sh;
    int nkv = shape.n_kv, nh = shape.n_heads, group = nh / nkv, g = blockIdx.x % nkv;
    ig_view_load(&v, seqs, blockIdx.x / nkv);
    int rest = v.span;
    if (threadIdx.x == 0) {
        int m = rest > 0 ? rest : 0;
        if (rest > 0 && shape.how != REKV_SELECT_ALL) {
            double counted = 0;
            for (int h = 0; h < nh; h++) {
                float c = ig_stats_at(v, nh, nkv, h)[2];
                counted += c > 0 ? c : 1;
            }
            m = (int)llround(counted / nh);
            int cap = (int)((double)shape.max_fraction * rest);
            m = m > cap ? cap : m;
            m = m < 1 ? 1 : m > rest ? rest : m;
        }
        m_sh = m;
        if (g == 0) {
            *v.q.m = m;
            *v.q.start = v.q.dev + m;
            *v.q.slot = v.q.dev + m;
        }
    }
    __syncthreads();
    int m = m_sh;
    if (rest <= 0)
        return;
    /* token i of the span is position live[i] with a pool, else offset i past dev */
    int32_t *sel = v.q.sel + (size_t)g * (size_t)(v.q.len - v.q.dev);
    const int32_t *live = v.q.count ? ig_live(v, nh, nkv, g) : NULL;
    float *comb = v.q.scratch + (size_t)g * (size_t)rest;
    int chunk = (rest + (int)blockDim.x - 1) / (int)blockDim.x;
    int lo = min(rest, (int)threadIdx.x * chunk), hi = min(rest, lo + chunk);
    unsigned long long mine = 0, total;
    if (shape.how == REKV_SELECT_ALL) {
        for (int t = threadIdx.x; t < rest; t += blockDim.x)
            sel[t] = live ? live[t] : t;
        return;
    }
    if (shape.how == REKV_SELECT_RANDOM) { /* Floyd's sample, marked in comb, read in order */
        for (int t = threadIdx.x; t < rest; t += blockDim.x)
            comb[t] = 0;
        __syncthreads();
        if (threadIdx.x == 0) {
            uint64_t x = v.q.key ^ ((uint64_t)g * 0x2545f4914f6cdd1dull);
            for (int j = rest - m; j < rest; j++) {
                int t = (int)(ig_splitmix(&x) % (uint64_t)(j + 1));
                comb[comb[t] != 0 ? j : t] = 1;
            }
        }
        __syncthreads();
        for (int i = lo; i < hi; i++)
            mine += comb[i] != 0;
        unsigned long long at = block_scan(mine, &total, sh);
        for (int i = lo; i < hi; i++)
            if (comb[i] != 0)
                sel[at++] = live ? live[i] : i;
        return;
    }
    for (int t = threadIdx.x; t < rest; t += blockDim.x) { /* the group's summed softmax */
        float acc = 0;
        for (int j = 0; j < group; j++) {
            int h = g * group + j;
            const float *st = ig_stats_at(v, nh, nkv, h);
            float e = expf(ig_row(scores, v, nkv, h)[t] - st[0]) * st[1];
            acc = j == 0 ? e : acc + e;
        }
        comb[t] = acc;
    }
    __syncthreads();
    const sample_set all = {0, ~0ull, 0};
    auto one = [](uint32_t) -> unsigned long long { return 1; };
    sample_set top = set_select(comb, lo, hi, all, (unsigned long long)m, one, hist, sh);
    set_walk(comb, lo, hi, top, [&](int, uint32_t) { mine++; });
    unsigned long long at = block_scan(mine, &total, sh);
    set_walk(comb, lo, hi, top, [&](int i, uint32_t) { sel[at++] = live ? live[i] : i; });
}

__global__ static void __launch_bounds__(IG_THREADS)
    ig_pool_kernel(const rekv_ig_seq *seqs, int n_kv)
{
    __shared__ ig_view v;
    __shared__ unsigned long long sh[34], best;
    __shared__ int first, m, n_gone;
    int g = blockIdx.x % n_kv;
    ig_view_load(&v, seqs, blockIdx.x / n_kv);
    if (v.q.count == NULL)
        return;
    int len = v.q.len, cap = v.q.cap;
    uint8_t *cnt = v.q.count + (size_t)g * (size_t)cap, *gone = v.q.gone + (size_t)g * (size_t)cap;
    const int32_t *sel = v.q.sel + (size_t)g * (size_t)len;
    if (threadIdx.x == 0) {
        m = *v.q.m;
        first = m;
        n_gone = v.q.n_gone[g];
    }
    __syncthreads();
    /* touch: the first entry in order to reach the maximum halves every counter; none after it
     * can reach it again (127 + 1) */
    for (int j = threadIdx.x; j < m; j += blockDim.x)
        if (cnt[sel[j]] == REKV_KV_POOL_COUNT_MAX - 1)
            atomicMin(&first, j);
    __syncthreads();
    for (int j = threadIdx.x; j < m && j <= first; j += blockDim.x)
        cnt[sel[j]]++;
    __syncthreads();
    if (first < m) {
        for (int t = threadIdx.x; t < cap; t += blockDim.x)
            cnt[t] >>= 1;
        __syncthreads();
        for (int j = first + 1 + (int)threadIdx.x; j < m; j += blockDim.x)
            cnt[sel[j]]++;
        __syncthreads();
    }
    /* admit: evict until the live entries and the new one fit; each victim the least counted of
     * the older half of the live ones, the first on ties (fifo: the first) */
    int chunk = (len + (int)blockDim.x - 1) / (int)blockDim.x;
    int lo = min(len, (int)threadIdx.x * chunk), hi = min(len, lo + chunk);
    while (len - n_gone + 1 > v.q.limit) {
        unsigned long long mine = 0, total, key = ~0ull;
        int half = (len - n_gone + 1) / 2;
        for (int t = lo; t < hi; t++)
            mine += !gone[t];
        unsigned long long rank = block_scan(mine, &total, sh);
        for (int t = lo; t < hi && rank < (unsigned long long)half; t++)
            if (!gone[t]) {
                unsigned long long k =
                    ((v.q.policy == REKV_KV_POOL_COUNTER ? (unsigned long long)cnt[t] : 0) << 32) |
                    (unsigned)t;
                key = k < key ? k : key;
                rank++;
            }
        if (threadIdx.x == 0)
            best = ~0ull;
        __syncthreads();
        atomicMin(&best, key);
        __syncthreads();
        if (best == ~0ull) /* no live entry: limit < 1, refused at init */
            break;
        if (threadIdx.x == 0) {
            gone[(int)(best & 0xffffffffu)] = 1;
            n_gone++;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        v.q.n_gone[g] = n_gone;
        if (len < cap)
            cnt[len] = 0, gone[len] = 0;
    }
}

__global__ static void ig_rows_kernel(const rekv_ig_seq *seqs, int n, rekv_ig_shape shape,
                                      const uint8_t *arena, rekv_copy_piece *pieces,
                                      size_t *n_pieces)
{
    __shared__ rekv_ig_seq q;
    __shared__ size_t off;
    __shared__ int m;
    int j = blockIdx.x, nkv = shape.n_kv, hd = shape.head_dim;
    if (threadIdx.x == 0) {
        q = seqs[j];
        size_t o = 0;
        for (int i = 0; i < j; i++)
            o += 2 * (size_t)nkv * (size_t)*seqs[i].m;
        off = o;
        m = *q.m;
        if (j == n - 1)
            *n_pieces = o + 2 * (size_t)nkv * (size_t)m;
    }
    __syncthreads();
    int rest = q.len - q.dev;
    size_t row = shape.row_bytes, vs = rekv_kv_off(rekv_kv_v_shift(nkv, hd), hd, row);
    size_t per = (size_t)nkv * (size_t)m;
    for (size_t k = threadIdx.x; k < 2 * per; k += blockDim.x) {
        size_t half = k >= per ? vs : 0, r = k % per;
        int g = (int)(r / (size_t)m), i = (int)(r % (size_t)m);
        int t = q.dev + q.sel[(size_t)g * rest + i];
        size_t so = rekv_kv_off(rekv_kv_row(nkv, hd, g, t % REKV_KV_ROWS_PER_BLOCK), hd, row);
        size_t dof = rekv_kv_off(rekv_kv_row(nkv, hd, g, q.dev + i), hd, row);
        pieces[off + k] =
            rekv_copy_piece{(uint8_t *)q.kv + dof + half,
                            arena + q.blocks[t / REKV_KV_ROWS_PER_BLOCK] + so + half, row};
    }
}

static void k_ig_select(rekv_stream *s, const float *scores, const rekv_ig_seq *seqs, int n,
                        const rekv_ig_shape *shape, const uint8_t *arena, rekv_copy_piece *pieces,
                        size_t *n_pieces)
{
    if (n <= 0)
        return;
    int pooled = 0; /* the descriptors are host memory, read here as the device will */
    for (int j = 0; j < n; j++)
        pooled |= seqs[j].count != NULL;
    int nh = shape->n_heads, nkv = shape->n_kv;
    if (pooled)
        KLAUNCH(s, "ig_live", ig_live_kernel, n * nkv, IG_THREADS, 0, scores, seqs, nh, nkv);
    KLAUNCH(s, "ig_stats", ig_stats_kernel, n * nh, IG_THREADS, 0, scores, seqs, nh, nkv,
            shape->alpha);
    KLAUNCH(s, "ig_pick", ig_pick_kernel, n * nkv, IG_THREADS, 0, scores, seqs, *shape);
    if (pooled)
        KLAUNCH(s, "ig_pool", ig_pool_kernel, n * nkv, IG_THREADS, 0, seqs, nkv);
    KLAUNCH(s, "ig_rows", ig_rows_kernel, n, ROW_THREADS, 0, seqs, n, *shape, arena, pieces,
            n_pieces);
}

/* ------------------------------------------------------------------ clo's decisions */

/* clo's decisions on the device (kernels.h clo_decide) follow rekv_clo_decide (mode_clo.c) in two
 * kernels, with nothing between them on the host:
 *   - clo_decide_kernel, a block per (sequence, KV head): a persistent head is left to the plan;
 *     else, with a label, the group's query/label cosines in double and Eq. 10's aggregate against
 *     tau (a hit: nothing moves); a miss: each head's softmax over the context, the group's sum
 *     over the middle [sink, len - recent) into scratch (g * len on), its top k by the sampler's
 *     radix selection (lowest position first on ties) in position order, the queries as labels;
 *   - clo_rows_kernel, a block per sequence: the misses' rows after the earlier sequences' (their
 *     head_k read back in stream order), each token's K row then its V row.
 * The exponentials are expf's and the sums in another order than the cpu's, so a token within
 * rounding of the k-th may rank otherwise; the cosines and the aggregate are the host's doubles
 * (a sum in another order: a similarity within an ulp of tau may decide otherwise). */
enum { CLO_THREADS = 1024, CLO_MAX_GROUP = 64, CLO_MAX_KV = 256 };

__global__ static void __launch_bounds__(CLO_THREADS)
    clo_decide_kernel(const float *scores, const rekv_clo_seq *seqs, rekv_clo_shape shape)
{
    __shared__ rekv_clo_seq q; /* mapped host memory: read once per block */
    __shared__ double redd[32], sim[CLO_MAX_GROUP];
    __shared__ float red[32], st_max[CLO_MAX_GROUP], st_inv[CLO_MAX_GROUP];
    __shared__ unsigned long long hist[256], sh[34];
    __shared__ int klen, hit, persist;
    int nkv = shape.n_kv, nh = shape.n_heads, group = nh / nkv, hd = shape.head_dim;
    int g = blockIdx.x % nkv;
    if (threadIdx.x == 0) {
        q = seqs[blockIdx.x / nkv];
        persist = shape.persist[g];
        klen = q.klen[g];
    }
    __syncthreads();
    if (persist) {
        if (threadIdx.x == 0)
            q.head_k[g] = -1;
        return;
    }
    int len = q.len, K = q.K;
    size_t h0 = (size_t)g * (size_t)group;
    if (klen >= 0) { /* Eq. 10 over the group's cosines, as rekv_heads_aggregate */
        for (int j = 0; j < group; j++) {
            const float *a = q.q + (h0 + j) * hd, *b = q.label + (h0 + j) * hd;
            double ab = 0, aa = 0, bb = 0;
            for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                ab += (double)a[i] * b[i];
                aa += (double)a[i] * a[i];
                bb += (double)b[i] * b[i];
            }
            ab = block_sum(ab, redd);
            aa = block_sum(aa, redd);
            bb = block_sum(bb, redd);
            if (threadIdx.x == 0)
                sim[j] = aa > 0 && bb > 0 ? ab / sqrt(aa * bb) : 0;
        }
        if (threadIdx.x == 0) {
            const double *imp = shape.imp + h0;
            double num = 0, den = 0, w_all = 0, agg;
            int bad = 0;
            for (int j = 0; j < group; j++)
                w_all += imp[j];
            for (int j = 0; j < group && !bad; j++) {
                double w = w_all > 0 ? imp[j] : 1;
                if (w == 0)
                    continue;
                if (!(sim[j] > 0))
                    bad = 1;
                num += w;
                den += w / sim[j];
            }
            agg = bad ? -1 : den > 0 ? num / den : -1;
            hit = agg >= shape.tau[g];
        }
    } else if (threadIdx.x == 0) {
        hit = 0;
    }
    __syncthreads();
    if (hit) {
        if (threadIdx.x == 0) {
            q.head_k[g] = 0;
            q.skip[g] = K - klen;
        }
        return;
    }
    int middle = len - REKV_HEADS_SINK - REKV_HEADS_RECENT;
    int k = (int)llround((double)shape.frac * len);
    k = k > K ? K : k;
    k = k > middle ? middle : k;
    k = k < 1 ? 1 : k;
    const float *s0 = scores + q.scores + h0 * (size_t)len;
    for (int j = 0; j < group; j++) { /* each head's softmax over the whole context */
        const float *sj = s0 + (size_t)j * len;
        float mx = -INFINITY, sum = 0;
        for (int t = threadIdx.x; t < len; t += blockDim.x)
            mx = fmaxf(mx, sj[t]);
        mx = block_max(mx, red);
        for (int t = threadIdx.x; t < len; t += blockDim.x)
            sum += expf(sj[t] - mx);
        sum = block_sum(sum, red);
        if (threadIdx.x == 0)
            st_max[j] = mx, st_inv[j] = 1.0f / sum;
    }
    __syncthreads();
    float *comb = q.scratch + (size_t)g * (size_t)len; /* the middle's group sums */
    for (int t = threadIdx.x; t < middle; t += blockDim.x) {
        float acc = 0;
        for (int j = 0; j < group; j++) {
            float e = expf(s0[(size_t)j * len + REKV_HEADS_SINK + t] - st_max[j]) * st_inv[j];
            acc = j == 0 ? e : acc + e;
        }
        comb[t] = acc;
    }
    __syncthreads();
    int chunk = (middle + (int)blockDim.x - 1) / (int)blockDim.x;
    int lo = min(middle, (int)threadIdx.x * chunk), hi = min(middle, lo + chunk);
    const sample_set all = {0, ~0ull, 0};
    auto one = [](uint32_t) -> unsigned long long { return 1; };
    sample_set top = set_select(comb, lo, hi, all, (unsigned long long)k, one, hist, sh);
    unsigned long long mine = 0, total;
    set_walk(comb, lo, hi, top, [&](int, uint32_t) { mine++; });
    unsigned long long at = block_scan(mine, &total, sh);
    int32_t *sel = q.sel + (size_t)g * K;
    set_walk(comb, lo, hi, top, [&](int i, uint32_t) { sel[at++] = i; });
    float *label = q.label + h0 * hd; /* read above: every thread is past the cosines */
    for (int i = threadIdx.x; i < group * hd; i += blockDim.x)
        label[i] = q.q[h0 * hd + i];
    if (threadIdx.x == 0) {
        q.head_k[g] = k;
        q.klen[g] = k;
        q.skip[g] = K - k;
    }
}

__global__ static void clo_rows_kernel(const rekv_clo_seq *seqs, int n, rekv_clo_shape shape,
                                       const uint8_t *arena, rekv_copy_piece *pieces,
                                       size_t *n_pieces)
{
    __shared__ rekv_clo_seq q;
    __shared__ size_t base[CLO_MAX_KV];
    __shared__ int32_t ks[CLO_MAX_KV];
    int j = blockIdx.x, nkv = shape.n_kv, hd = shape.head_dim;
    if (threadIdx.x == 0) {
        q = seqs[j];
        size_t o = 0;
        for (int i = 0; i < j; i++)
            for (int g = 0; g < nkv; g++)
                o += seqs[i].head_k[g] > 0 ? 2 * (size_t)seqs[i].head_k[g] : 0;
        for (int g = 0; g < nkv; g++) {
            ks[g] = q.head_k[g] > 0 ? q.head_k[g] : 0;
            base[g] = o;
            o += 2 * (size_t)ks[g];
        }
        if (j == n - 1)
            *n_pieces = o;
    }
    __syncthreads();
    size_t row = shape.row_bytes, vs = rekv_kv_off(rekv_kv_v_shift(nkv, hd), hd, row);
    for (int g = 0; g < nkv; g++)
        for (int i = threadIdx.x; i < ks[g]; i += blockDim.x) {
            int t = REKV_HEADS_SINK + q.sel[(size_t)g * q.K + i];
            const uint8_t *src =
                arena + q.blocks[t / REKV_KV_ROWS_PER_BLOCK] +
                rekv_kv_off(rekv_kv_row(nkv, hd, g, t % REKV_KV_ROWS_PER_BLOCK), hd, row);
            uint8_t *dst =
                (uint8_t *)q.kv + rekv_kv_off(rekv_kv_row(nkv, hd, g, q.K - ks[g] + i), hd, row);
            pieces[base[g] + 2 * (size_t)i] = rekv_copy_piece{dst, src, row};
            pieces[base[g] + 2 * (size_t)i + 1] = rekv_copy_piece{dst + vs, src + vs, row};
        }
}

static void k_clo_decide(rekv_stream *s, const float *scores, const rekv_clo_seq *seqs, int n,
                         const rekv_clo_shape *shape, const uint8_t *arena, rekv_copy_piece *pieces,
                         size_t *n_pieces)
{
    if (n <= 0)
        return;
    int group = shape->n_heads / shape->n_kv;
    if (group > CLO_MAX_GROUP || shape->n_kv > CLO_MAX_KV) {
        cuda_stream_fail(s, -ENOTSUP,
                         "clo_decide: %d query heads a KV head, %d KV heads (at most "
                         "%d and %d)",
                         group, shape->n_kv, CLO_MAX_GROUP, CLO_MAX_KV);
        return;
    }
    KLAUNCH(s, "clo_decide", clo_decide_kernel, n * shape->n_kv, CLO_THREADS, 0, scores, seqs,
            *shape);
    KLAUNCH(s, "clo_rows", clo_rows_kernel, n, ROW_THREADS, 0, seqs, n, *shape, arena, pieces,
            n_pieces);
}

/* ------------------------------------------------------------------ the table */

static const rekv_kernel_iface cuda_kernels = {
    k_linear,          /* linear */
    k_norm,            /* norm */
    k_rope,            /* rope */
    k_activation,      /* activation */
    k_add,             /* add */
    k_embed,           /* embed */
    k_kv_scatter,      /* kv_scatter */
    k_kv_gather,       /* kv_gather */
    k_attention,       /* attention */
    k_convert,         /* convert */
    k_convert_out,     /* convert_out */
    k_gather_rows,     /* gather_rows */
    k_head_proj,       /* head_proj */
    k_spec_scores,     /* spec_scores */
    k_sample,          /* sample */
    NULL,              /* linear_tiled: cuBLAS reads row-major weights */
    k_qkv,             /* qkv */
    k_bias_activation, /* bias_activation */
    k_bias_add,        /* bias_add */
    k_scale,           /* scale */
    k_softcap,         /* softcap */
    k_ig_select,       /* ig_select */
    k_clo_decide,      /* clo_decide */
};

/* ------------------------------------------------------------------ the object's entry point */

static const rekv_cuda_module cuda_module = {
    REKV_CUDA_MODULE_ABI,       /* abi */
    sizeof(rekv_backend_iface), /* backend_iface_size */
    sizeof(rekv_kernel_iface),  /* kernel_iface_size */
    0,                          /* reserved */
    cuda_backend_create,        /* backend_create */
    &cuda_kernels,              /* kernels */
};

/* The one symbol librekv_cuda.so exports (the Makefile's version script hides the rest). */
extern "C" const rekv_cuda_module *rekv_cuda_module_get(void)
{
    return &cuda_module;
}
