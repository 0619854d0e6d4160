/* rope.c — RoPE's per-pair inverse frequencies for plain RoPE and each rope_scaling type, computed
 * once per model on the host (rekv_rope_freqs_init); every backend's rope kernel reads the table.
 *
 * Plain RoPE keeps the float expression the kernels used before the table existed
 * (1 / powf(theta, 2j / d) in float), so its angles are bit for bit what they were. The scaled
 * types follow HF transformers' published formulas (modeling_rope_utils: _compute_linear_...,
 * _compute_dynamic_ntk_..., _compute_llama3_..., _compute_yarn_parameters) evaluated in double and
 * rounded once to float; tests/rope_ref.py computes the same from the formulas in numpy float64.
 *
 * Dynamic NTK is the one type whose frequencies depend on the length. HF recomputes the table for
 * each forward from the current length, so keys already cached were rotated with another base
 * than the keys computed now, and a prompt's logits depend on how it was cut into forwards. rekv
 * rotates each position p with the base for length p + 1 (the length when p is the newest token,
 * which is what HF computes for every decoded token): a key never changes once cached, and
 * results do not depend on batching, chunking or recomputation — what rekv's exact modes need.
 * Below the original length the table is plain RoPE's, as in HF.
 *
 * LongRoPE (Phi-3) switches from its short factors to its long ones past the original length; HF
 * switches the whole forward on its length, so again a cached key would be rotated one way and a
 * fresh one another. rekv switches by position, as for dynamic NTK: position p takes the long
 * factors when p + 1 > original_max_pos, which is what HF does for every decoded token. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include "loader/loader.h"

const char *rekv_rope_scaling_name(rekv_rope_scaling_type t)
{
    switch (t) {
    case REKV_ROPE_SCALING_NONE:
        return "none";
    case REKV_ROPE_SCALING_LINEAR:
        return "linear";
    case REKV_ROPE_SCALING_DYNAMIC:
        return "dynamic";
    case REKV_ROPE_SCALING_LLAMA3:
        return "llama3";
    case REKV_ROPE_SCALING_YARN:
        return "yarn";
    case REKV_ROPE_SCALING_FACTORS:
        return "factors";
    case REKV_ROPE_SCALING_LONGROPE:
        return "longrope";
    }
    return "unknown";
}

/* theta^(2j/d) in double: the wavelength's base per pair before any scaling. */
static double pair_base(double theta, int j, int d)
{
    return pow(theta, (double)(2 * j) / (double)d);
}

static void llama3_table(rekv_rope_freqs *f, const rekv_rope_scaling *s, double theta, int d)
{
    double old = s->original_max_pos;
    double low_wl = old / s->low_freq_factor, high_wl = old / s->high_freq_factor;
    for (int j = 0; j < f->half; j++) {
        double inv = 1.0 / pair_base(theta, j, d), wl = 2 * M_PI / inv, v;
        if (wl < high_wl) /* high frequencies: unchanged */
            v = inv;
        else if (wl > low_wl) /* low frequencies: interpolated by factor */
            v = inv / s->factor;
        else { /* between: a smooth blend of the two */
            double sm =
                (old / wl - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
            v = (1 - sm) * inv / s->factor + sm * inv;
        }
        f->inv_freq[j] = (float)v;
    }
}

static double yarn_mscale(double scale, double m)
{
    return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

/* The pair index where a wavelength makes `rotations` turns over the original length. */
static double yarn_correction_dim(double rotations, int d, double theta, double orig)
{
    return (d * log(orig / (rotations * 2 * M_PI))) / (2 * log(theta));
}

static void yarn_table(rekv_rope_freqs *f, const rekv_rope_scaling *s, double theta, int d)
{
    double lo = yarn_correction_dim(s->beta_fast, d, theta, s->original_max_pos);
    double hi = yarn_correction_dim(s->beta_slow, d, theta, s->original_max_pos);
    if (s->truncate)
        lo = floor(lo), hi = ceil(hi);
    lo = lo < 0 ? 0 : lo;
    hi = hi > d - 1 ? d - 1 : hi;
    if (lo == hi)
        hi += 0.001; /* as HF: no division by zero */
    for (int j = 0; j < f->half; j++) {
        double base = pair_base(theta, j, d);
        double ramp = (j - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double extra = 1 - ramp; /* weight of extrapolation (the unscaled frequency) */
        f->inv_freq[j] = (float)((1.0 / (s->factor * base)) * (1 - extra) + (1.0 / base) * extra);
    }
    double a = s->attention_factor;
    if (a <= 0)
        a = s->mscale != 0 && s->mscale_all_dim != 0
                ? yarn_mscale(s->factor, s->mscale) / yarn_mscale(s->factor, s->mscale_all_dim)
                : yarn_mscale(s->factor, 1);
    f->attn_factor = (float)a;
}

/* LongRoPE (Phi-3; HF's _compute_longrope_parameters): inv_freq[j] = 1 / (ext[j] theta^(2j/d)),
 * ext the short factors below the original length and the long ones from it on; cos and sin times
 * attention_factor, by default sqrt(1 + ln(s) / ln(original)) for s = factor > 1 (HF: max_pos /
 * original), whichever table is in use. */
static void longrope_table(rekv_rope_freqs *f, const rekv_rope_scaling *s, double theta, int d)
{
    for (int j = 0; j < f->half; j++) {
        double base = pair_base(theta, j, d);
        f->inv_freq[j] = (float)(1.0 / ((double)s->freq_factors[j] * base));
        f->long_inv_freq[j] = (float)(1.0 / ((double)s->long_factors[j] * base));
    }
    double a = s->attention_factor;
    if (a <= 0)
        a = s->factor > 1 ? sqrt(1 + log(s->factor) / log((double)s->original_max_pos)) : 1.0;
    f->attn_factor = (float)a;
    f->long_from = s->original_max_pos;
}

/* The fields a type reads, checked here too so that a config built by code (GGUF, synth) gets the
 * same one-line errors as config.json does. */
static int check(const rekv_rope_scaling *s, const rekv_model_config *c, rekv_err *err)
{
    const char *n = rekv_rope_scaling_name(s->type);
    if (s->type == REKV_ROPE_SCALING_NONE || s->type == REKV_ROPE_SCALING_FACTORS) {
        if (s->type == REKV_ROPE_SCALING_FACTORS)
            for (int j = 0; j < c->head_dim / 2; j++)
                if (!(s->freq_factors[j] > 0) || !isfinite(s->freq_factors[j]))
                    return rekv_errf(err, -EINVAL,
                                     "rope_scaling.freq_factors[%d] = %g must be positive", j,
                                     (double)s->freq_factors[j]);
        return 0;
    }
    if (!(s->factor > 0) || !isfinite(s->factor))
        return rekv_errf(err, -EINVAL, "rope_scaling (%s): factor = %g must be positive", n,
                         s->factor);
    if (s->type == REKV_ROPE_SCALING_LINEAR)
        return 0;
    if (s->type == REKV_ROPE_SCALING_LONGROPE)
        for (int j = 0; j < c->head_dim / 2; j++)
            if (!(s->freq_factors[j] > 0) || !isfinite(s->freq_factors[j]) ||
                !(s->long_factors[j] > 0) || !isfinite(s->long_factors[j]))
                return rekv_errf(err, -EINVAL,
                                 "rope_scaling (longrope): short_factor[%d] = %g and "
                                 "long_factor[%d] = %g must be positive",
                                 j, (double)s->freq_factors[j], j, (double)s->long_factors[j]);
    if (s->original_max_pos <= 0)
        return rekv_errf(
            err, -EINVAL,
            "rope_scaling (%s): original_max_position_embeddings = %d must be positive", n,
            s->original_max_pos);
    if (s->type == REKV_ROPE_SCALING_DYNAMIC && c->head_dim <= 2)
        return rekv_errf(err, -EINVAL, "rope_scaling (dynamic): head_dim %d must be above 2",
                         c->head_dim);
    if (s->type == REKV_ROPE_SCALING_LLAMA3 &&
        (!(s->low_freq_factor > 0) || !(s->high_freq_factor > s->low_freq_factor)))
        return rekv_errf(
            err, -EINVAL,
            "rope_scaling (llama3): low_freq_factor = %g and high_freq_factor = %g must "
            "satisfy 0 < low_freq_factor < high_freq_factor",
            s->low_freq_factor, s->high_freq_factor);
    if (s->type == REKV_ROPE_SCALING_YARN) {
        if (!(s->beta_fast > 0) || !(s->beta_slow > 0))
            return rekv_errf(
                err, -EINVAL,
                "rope_scaling (yarn): beta_fast = %g and beta_slow = %g must be positive",
                s->beta_fast, s->beta_slow);
        if (!(c->rope_theta > 1))
            return rekv_errf(err, -EINVAL, "rope_scaling (yarn): rope_theta = %g must be above 1",
                             (double)c->rope_theta);
        if (s->attention_factor < 0 || s->mscale < 0 || s->mscale_all_dim < 0)
            return rekv_errf(
                err, -EINVAL,
                "rope_scaling (yarn): attention_factor, mscale and mscale_all_dim must "
                "not be negative");
    }
    return 0;
}

int rekv_rope_freqs_init(rekv_rope_freqs *f, const rekv_model_config *c, rekv_err *err)
{
    const rekv_rope_scaling *s = &c->rope_scaling;
    int d = c->head_dim, rc;
    memset(f, 0, sizeof(*f));
    if (d < 2 || d % 2 != 0 || d / 2 > REKV_ROPE_MAX_PAIRS)
        return rekv_errf(err, -EINVAL, "rope: head_dim %d must be even and in [2, %d]", d,
                         2 * REKV_ROPE_MAX_PAIRS);
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta))
        return rekv_errf(err, -EINVAL, "rope: rope_theta = %g must be positive",
                         (double)c->rope_theta);
    if ((rc = check(s, c, err)))
        return rc;
    f->half = d / 2;
    f->attn_factor = 1.0f;
    f->dyn_from = INT_MAX;
    f->long_from = INT_MAX;
    f->theta = c->rope_theta;
    double theta = c->rope_theta;
    switch (s->type) {
    case REKV_ROPE_SCALING_NONE:
    case REKV_ROPE_SCALING_DYNAMIC:
    case REKV_ROPE_SCALING_FACTORS:
        /* the kernels' expression before the table: plain RoPE keeps its bits */
        for (int j = 0; j < f->half; j++)
            f->inv_freq[j] = 1.0f / powf(c->rope_theta, (float)(2 * j) / (float)d);
        if (s->type == REKV_ROPE_SCALING_FACTORS)
            for (int j = 0; j < f->half; j++)
                f->inv_freq[j] /= s->freq_factors[j];
        if (s->type == REKV_ROPE_SCALING_DYNAMIC) {
            f->dyn_from = s->original_max_pos;
            f->dyn_factor = s->factor;
        }
        break;
    case REKV_ROPE_SCALING_LINEAR:
        for (int j = 0; j < f->half; j++)
            f->inv_freq[j] = (float)(1.0 / (pair_base(theta, j, d) * s->factor));
        break;
    case REKV_ROPE_SCALING_LLAMA3:
        llama3_table(f, s, theta, d);
        break;
    case REKV_ROPE_SCALING_YARN:
        yarn_table(f, s, theta, d);
        break;
    case REKV_ROPE_SCALING_LONGROPE:
        longrope_table(f, s, theta, d);
        break;
    default:
        return rekv_errf(err, -EINVAL, "rope_scaling: unknown type %d", (int)s->type);
    }
    return 0;
}

void rekv_rope_freqs_at(const rekv_rope_freqs *f, int pos, float *inv_freq)
{
    if (pos >= f->long_from) {
        memcpy(inv_freq, f->long_inv_freq, sizeof(float) * (size_t)f->half);
        return;
    }
    if (pos < f->dyn_from) {
        memcpy(inv_freq, f->inv_freq, sizeof(float) * (size_t)f->half);
        return;
    }
    /* HF's dynamic NTK for sequence length L = pos + 1 past the original length O:
     * base' = theta * (factor * L / O - (factor - 1))^(d / (d - 2)) */
    int d = 2 * f->half;
    double L = (double)pos + 1, O = f->dyn_from;
    double base = f->theta * pow(f->dyn_factor * L / O - (f->dyn_factor - 1), (double)d / (d - 2));
    for (int j = 0; j < f->half; j++)
        inv_freq[j] = (float)(1.0 / pow(base, (double)(2 * j) / (double)d));
}
