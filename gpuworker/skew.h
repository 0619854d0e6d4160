/* skew.h — InfiniGen's skewing (OSDI'24 §4.2–4.3), the offline half of `--mode infinigen`.
 *
 * For every layer and KV head g, an orthogonal hd x hd matrix A (the right singular vectors of the
 * group's query matrix: the post-RoPE, post-bias query rows of the q heads that share g, stacked,
 * from a calibration forward pass) and the rk columns of A along which the skewed query and key
 * are largest (column sums of |Q·A| + |K·A|, top rk). Since A is orthogonal, (Q·A)(K·A)^T = Q·K^T;
 * the speculation uses only the selected columns: q·A[:, cols] · (k·A[:, cols])^T approximates
 * q·k^T.
 *
 * rekv does not rewrite the model's weights: A is applied at run time after RoPE (Llama family),
 * and for models without RoPE (OPT) it is folded into a partial query weight W_Q·A[:, cols] at
 * pipeline creation — so the model on disk, its resident run and the exact modes are untouched,
 * and the skew is a small file beside the model in the cache (DEVELOPERS.md, "InfiniGen").
 *
 * The file: "REKVSKEW" magic, version, the shape, the model fingerprint it was made for, A, the
 * columns, and a CRC32C over all of it; a file for another model, or a damaged one, is refused. */
#ifndef REKV_GPUWORKER_SKEW_H
#define REKV_GPUWORKER_SKEW_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "gpuworker/gpuworker.h"

typedef struct rekv_skew {
    int n_layers, n_kv_heads, head_dim;
    int rk;               /* partial columns per KV head (ceil(ratio * head_dim), >= 1) */
    uint64_t fingerprint; /* of the model (rekv_engine_fingerprint) */
    float *a;             /* [n_layers][n_kv_heads][head_dim][head_dim]: A, row-major (A[d][c]) */
    int32_t *cols;        /* [n_layers][n_kv_heads][rk]: the selected columns of A, largest first */
} rekv_skew;

/* The partial ratio InfiniGen uses (§5: 0.3). */
#define REKV_SKEW_DEFAULT_RATIO 0.3


/* Calibrates on the given token ids (one forward pass over them; n >= 2): fills *out (free with
 * rekv_skew_free). ratio in (0, 1]. rk = ceil(ratio * head_dim), computed with 1e-9 of slack so
 * that 0.3 * 10 is 3. -EINVAL for a ratio outside (0, 1] or n < 2, -E2BIG for n past the context,
 * -EDOM when an SVD does not converge (non-finite activations). */
int rekv_skew_calibrate(rekv_engine *e, const int32_t *ids, int n, double ratio, rekv_skew *out,
                        rekv_err *err);

/* Writes / reads the file. Load checks the magic, version, CRC, and that the skew fits e's model
 * (shape and fingerprint); every mismatch is a clear error. Save writes a temporary file beside
 * path, fsyncs it and renames it into place, creating path's directory when missing. */
int rekv_skew_save(const rekv_skew *s, const char *path, rekv_err *err);
int rekv_skew_load(const char *path, const rekv_engine *e, rekv_skew *out, rekv_err *err);
void rekv_skew_free(rekv_skew *s);

/* The skew of e's model at this ratio: from the cache ($XDG_CACHE_HOME/rekv, else
 * $HOME/.cache/rekv; file named by fingerprint and ratio) when there, else calibrated on a sample
 * the model generates itself (REKV_SKEW_SAMPLE_TOKENS tokens from BOS at temperature 1 with a
 * fixed seed — never the text being evaluated) and saved there (a cache that cannot be written
 * is not an error). *from_cache says which.
 * The file is skew-<fingerprint, 16 hex digits>-r<round(ratio * 1000)>-<build tag>.bin: the
 * fingerprint names the weights, the build tag the code that sampled and calibrated (another
 * build's file is left alone and made again, since a change to the sampler or the calibration
 * changes the result). One that does not load (damaged, another model) or holds another rk is
 * calibrated again and overwritten. The sample
 * starts from the model's bos_id, or token 1 (llama2.c's BOS) when it names none; top_k 0, top_p 1,
 * seed 0x5eed, at most context - 1 new tokens, EOS not a stop. */
#define REKV_SKEW_SAMPLE_TOKENS 256
/* The directory of rekv's caches: $XDG_CACHE_HOME/rekv (an absolute XDG_CACHE_HOME), else
 * $HOME/.cache/rekv; -ENOENT when neither is set. */
int rekv_cache_dir(char *dir, size_t cap, rekv_err *err);
/* The build's part of a cache file's name: CRC32C of rekv_version() ("0.1.0 (git HASH)"), so a
 * result computed by other code is never read back as this build's. */
uint32_t rekv_cache_build_tag(void);
/* Writes size bytes of buf to path whole or not at all: a temporary file beside it, fsynced and
 * renamed into place (the directory made when missing, then synced). */
int rekv_cache_write(const char *path, const void *buf, size_t size, rekv_err *err);
int rekv_skew_prepare(rekv_engine *e, double ratio, rekv_skew *out, int *from_cache, rekv_err *err);

/* A[:, cols] of (layer, g): [head_dim][rk], into dst. */
void rekv_skew_partial(const rekv_skew *s, int layer, int g, float *dst);

/* Additions for `rekv skew` (the CLI cannot reach the engine's calibration tap):
 *
 * rekv_skew_cache_path: the file rekv_skew_prepare reads and writes for e's model at this ratio.
 * rekv_skew_sample: the sample rekv_skew_prepare calibrates on (BOS, then the generated tokens;
 * ids malloc'd, n of them).
 * rekv_skew_concentration: one forward pass over ids; per layer ([n_layers] each), the fraction of
 * the query's squared norm that the rk selected columns of Q·A capture (skewed), and the same for
 * the rk columns the same rule picks on these rows with A = identity (plain), each averaged over
 * the layer's KV heads — what skewing buys the speculation. */
int rekv_skew_cache_path(const rekv_engine *e, double ratio, char *path, size_t cap, rekv_err *err);
int rekv_skew_sample(rekv_engine *e, int32_t **ids, int *n, rekv_err *err);
int rekv_skew_concentration(rekv_engine *e, const rekv_skew *s, const int32_t *ids, int n,
                            double *skewed, double *plain, rekv_err *err);

#endif
