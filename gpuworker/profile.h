/* profile.h — the profiler: measures what the planner's cost model needs (common/cost.h,
 * DESIGN.md "Planner: one cost model") on a backend, and caches the result on disk.
 *
 * Everything is measured through the backend's own streams, copies and kernels, so the cpu
 * backend with link emulation reports the emulated link, and a device backend its real one:
 *   - host->device and device->host: copies of several sizes, fitted as t = latency + bytes/bw;
 *   - GEMM throughput of the `linear` kernel at the model's shapes (the K/V projection over many
 *     rows, the FFN's first projection);
 *   - attention throughput of the `attention` kernel (a decode batch over a context);
 *   - HybridServe's linear models (papers/001 Sec. 4.3): T_load_kv(n), the time to load n tokens'
 *     K and V rows of one layer host->device, and T_kv_gen(n), the time to load n activation rows
 *     and regenerate their K and V (copy, convert when the cache is fp16, two linears, RoPE),
 *     each sampled at several n and fitted by least squares, for an fp32 and an fp16 host cache.
 * Shapes come from the model's config only: the weights the kernels run on are deterministic
 * filler of the model's shapes (timings do not depend on values), so no engine is needed.
 *
 * The cache: one JSON file per (rekv build, machine, model shape, backend, link settings) in
 * $XDG_CACHE_HOME/rekv/profiles/ or ~/.cache/rekv/profiles/, named by a hash of a key string that
 * the file also holds. A file is trusted only when its version, key and every field check out;
 * otherwise the profile is measured again and the file replaced (temporary file + rename). The
 * build (rekv_version: release and git describe) is part of the key: what was measured is this
 * code's speed, so a profile taken before the kernels changed (a faster GEMM) would misprice.
 *
 * Functions return 0 or a negative errno and fill the rekv_err; nothing prints. */
#ifndef REKV_GPUWORKER_PROFILE_H
#define REKV_GPUWORKER_PROFILE_H

#include <jansson.h>
#include <stddef.h>

#include "common/err.h"
#include "common/cost.h"
#include "common/progress.h"
#include "gpuworker/device/backend.h"
#include "loader/loader.h"

/* Bumped whenever the fields or the way they are measured change: older files are re-measured. */
#define REKV_PROFILE_VERSION 5

/* Index of the per-cache-dtype models. */
enum { REKV_PROFILE_F32 = 0, REKV_PROFILE_F16 = 1, REKV_PROFILE_DTYPES = 2 };

typedef struct rekv_profile {
    int version;           /* REKV_PROFILE_VERSION */
    char backend[16];      /* the backend's iface name: "cpu", "cuda" */
    rekv_link_config link; /* link emulation the backend ran with (gbps 0: none), for the key */

    double h2d_bw;      /* host->device bandwidth, bytes/s (fitted slope's inverse) */
    double h2d_latency; /* fixed cost of one host->device copy, s (fitted intercept, >= 0) */
    double d2h_bw;      /* device->host bandwidth, bytes/s */
    double d2h_latency; /* fixed cost of one device->host copy, s (>= 0) */

    int gemm_rows;           /* rows (tokens) of the measured FFN linear */
    int gemm_kv_rows;        /* rows of the measured K/V linear: grown until it takes ~1 ms */
    double gemm_kv_flops;    /* `linear` [gemm_kv_rows][hidden] x [kv_dim][hidden]^T, FLOP/s */
    double gemm_ffn_flops;   /* `linear` [gemm_rows][hidden] x [ffn][hidden]^T, FLOP/s */
    double gemm_ffn_1_flops; /* the same at one row (a batch-1 decode step: the weights streamed
                                for one row's work), FLOP/s */
    int attn_batch;          /* sequences of the measured attention, one query each */
    int attn_ctx;            /* context tokens each of them attends to */
    double attn_flops;       /* `attention` throughput, FLOP/s (4*head_dim*ctx per query head) */
    double attn_chunk_flops; /* the same for a prefill chunk: 64 rows of one sequence at the end
                                of attn_ctx positions, causal */

    double layer_weight_bytes; /* one decoder layer's fp32 weights (matrices, biases, norms), B */
    double t_load_w;           /* h2d_latency + layer_weight_bytes/h2d_bw: one layer's weights
                                  over the link as one gathered copy, s */
    /* [REKV_PROFILE_F32 / _F16]: host cache dtype. a in s, b in s per token; per layer. */
    rekv_linear load_kv[REKV_PROFILE_DTYPES]; /* T_load_kv(n): n tokens' K,V rows h2d (+convert) */
    rekv_linear kv_gen[REKV_PROFILE_DTYPES];  /* T_kv_gen(n): n activation rows h2d (+convert),
                                                 K and V linears, RoPE of K, K and V into an
                                                 attention buffer (kv_scatter) */
    int fit_tokens_max;                       /* largest n sampled for the two models, tokens */
    /* recomputation alone (T_kv_gen's largest sample without the copy: conversion from the cache
     * dtype, K and V linears, RoPE, the scatter), FLOP/s of its two linears: what the planner
     * prices it at */
    double recomp_flops[REKV_PROFILE_DTYPES];
    double measure_s; /* wall time the measurement took, s */
} rekv_profile;

/* Measures c's shapes on be (its streams must be free for the duration). link: the link
 * emulation be was created with (NULL or gbps <= 0: none) — only recorded. Takes about 1 s on a
 * small model; larger models take longer in the kernels. */
int rekv_profile_measure(const rekv_model_config *c, rekv_backend *be, const rekv_link_config *link,
                         rekv_profile *out, rekv_err *err);

/* The planner's view of a profile for a host cache of cache_dtype (F32, or F16/BF16 which move 2
 * bytes per element): bandwidth, latency, the K/V GEMM throughput, the fitted models and
 * T_load_w. Set out->t_load_w to 0 when the weights stay resident. */
void rekv_profile_to_cost(const rekv_profile *p, rekv_dtype cache_dtype, rekv_cost_profile *out);

/* The profile as a JSON object (the cache file's fields, without its key); NULL when out of
 * memory. The caller owns the reference. */
json_t *rekv_profile_json(const rekv_profile *p);

/* The cache key (machine, model shape, backend, link) as a string, and the file it names:
 * dir/<16 hex digits of its 64-bit FNV-1a hash>.json. dir NULL: the default directory
 * ($XDG_CACHE_HOME/rekv/profiles, else $HOME/.cache/rekv/profiles). -ENAMETOOLONG, -ENOENT when
 * there is no default directory. */
int rekv_profile_key(const rekv_model_config *c, const char *backend, const rekv_link_config *link,
                     char *key, size_t key_cap, rekv_err *err);
int rekv_profile_path(const rekv_model_config *c, const char *backend, const rekv_link_config *link,
                      const char *dir, char *path, size_t path_cap, rekv_err *err);

/* Writes p as JSON under key, atomically (path.tmp.PID, fsync, rename), creating directories. */
int rekv_profile_save(const char *path, const char *key, const rekv_profile *p, rekv_err *err);
/* Reads a file written by rekv_profile_save; -EINVAL (with the reason) when the version is not
 * REKV_PROFILE_VERSION, the key differs from `key` (when not NULL), or any field is missing, of
 * the wrong type, not finite or out of range. -ENOENT when absent. */
int rekv_profile_load(const char *path, const char *key, rekv_profile *out, rekv_err *err);

/* What rekv_profile_load_or_measure did. */
typedef struct rekv_profile_origin {
    int loaded;        /* 1: read from the cache; 0: measured */
    int saved;         /* measured and written to the cache */
    char path[4096];   /* the cache file */
    char reason[1100]; /* why it was measured (absent, invalid: ..., forced), or why saving
                          failed; empty when loaded */
} rekv_profile_origin;

/* Loads the cached profile of (c, be, link) from dir (NULL: default) when present and valid and
 * force is 0; otherwise measures it and writes the cache. Failing to write the cache is not an
 * error (origin->saved = 0 and the reason say so): a read-only home still gets a profile. */
int rekv_profile_load_or_measure(const rekv_model_config *c, rekv_backend *be,
                                 const rekv_link_config *link, const char *dir, int force,
                                 rekv_profile *out, rekv_profile_origin *origin, rekv_err *err);

/* The same on a backend of its own, of the kind rekv_backend_create(backend, link) gives ("auto",
 * "cpu", "cuda"; link may be NULL), made without link's memory limit: the measurement's buffers
 * need not fit an emulated device. */
int rekv_profile_get(const rekv_model_config *c, const char *backend, const rekv_link_config *link,
                     const char *dir, int force, rekv_profile *out, rekv_profile_origin *origin,
                     rekv_err *err);
/* The same, calling progress(arg, measurements done, measurements in all) as it measures
 * (never when the profile is loaded); progress may be NULL. */
int rekv_profile_get_progress(const rekv_model_config *c, const char *backend,
                              const rekv_link_config *link, const char *dir, int force,
                              rekv_profile *out, rekv_profile_origin *origin,
                              rekv_progress_fn progress, void *arg, rekv_err *err);

#endif
