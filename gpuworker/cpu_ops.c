/* cpu_ops.c — see cpu_ops.h. Plain loops the compiler vectorises (the GEMM is cpu_gemm.c's). */
#include "gpuworker/cpu_ops.h"

#include <math.h>
#include <string.h>

void cpu_norm(float *out, const float *in, const float *w, const float *b, int m, int d, float eps)
{
    for (int i = 0; i < m; i++) {
        const float *x = in + (size_t)i * d;
        float *y = out + (size_t)i * d;
        if (b) {
            float mean = 0;
            for (int j = 0; j < d; j++)
                mean += x[j];
            mean /= (float)d;
            float var = 0;
            for (int j = 0; j < d; j++)
                var += (x[j] - mean) * (x[j] - mean);
            var /= (float)d;
            float inv = 1.0f / sqrtf(var + eps);
            for (int j = 0; j < d; j++)
                y[j] = (x[j] - mean) * inv * w[j] + b[j];
        } else {
            float ss = 0;
            for (int j = 0; j < d; j++)
                ss += x[j] * x[j];
            float inv = 1.0f / sqrtf(ss / (float)d + eps);
            for (int j = 0; j < d; j++)
                y[j] = w[j] * (x[j] * inv);
        }
    }
}

void cpu_layernorm(float *x, const float *w, const float *b, int m, int d, float eps)
{
    cpu_norm(x, x, w, b, m, d, eps);
}

void cpu_rmsnorm(float *x, const float *w, int m, int d, float eps)
{
    cpu_norm(x, x, w, NULL, m, d, eps);
}

void cpu_rope_table(float *cos_t, float *sin_t, const int *pos, int m, int head_dim, float theta)
{
    int half = head_dim / 2;
    for (int j = 0; j < half; j++) {
        float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)head_dim);
        for (int i = 0; i < m; i++) {
            float a = (float)pos[i] * inv_freq;
            cos_t[(size_t)i * half + j] = cosf(a);
            sin_t[(size_t)i * half + j] = sinf(a);
        }
    }
}

void cpu_rope(float *x, const float *cos_t, const float *sin_t, int m, int n_heads, int head_dim,
              rekv_rope style)
{
    int half = head_dim / 2;
    for (int i = 0; i < m; i++) {
        const float *c = cos_t + (size_t)i * half, *s = sin_t + (size_t)i * half;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)i * n_heads + h) * head_dim;
            for (int j = 0; j < half; j++) {
                /* adjacent pairs (x[2j], x[2j+1]) or halves (x[j], x[j+half]) */
                float *a = style == REKV_ROPE_ADJACENT ? &v[2 * j] : &v[j];
                float *b = style == REKV_ROPE_ADJACENT ? &v[2 * j + 1] : &v[j + half];
                float x0 = *a, x1 = *b;
                *a = x0 * c[j] - x1 * s[j];
                *b = x0 * s[j] + x1 * c[j];
            }
        }
    }
}

void cpu_activation(float *a, const float *b, size_t n, rekv_act act)
{
    switch (act) {
    case REKV_ACT_RELU:
        for (size_t i = 0; i < n; i++)
            a[i] = a[i] > 0 ? a[i] : 0;
        break;
    case REKV_ACT_GELU:
        for (size_t i = 0; i < n; i++)
            a[i] = 0.5f * a[i] * (1.0f + erff(a[i] * 0.70710678118654752f));
        break;
    case REKV_ACT_SILU:
        for (size_t i = 0; i < n; i++) {
            float s = a[i] / (1.0f + expf(-a[i]));
            a[i] = b ? s * b[i] : s;
        }
        break;
    }
}

/* The row at element index i of a cache in dtype dt as fp32: the row itself, or widened into buf.
 */
static inline const float *cache_row(const void *kv, size_t i, int hd, rekv_dtype dt, float *buf)
{
    const void *r = (const char *)kv + i * rekv_dtype_size(dt);
    if (dt == REKV_DTYPE_F32)
        return r;
    rekv_to_f32(buf, r, dt, (size_t)hd);
    return buf;
}

void cpu_attention(float *out, const float *q, const void *kv, rekv_dtype dt, int m, int start,
                   int n_heads, int n_kv, int hd, const int32_t *skip, float *scores)
{
    float scale = 1.0f / sqrtf((float)hd);
    int group = n_heads / n_kv;
    size_t vs = rekv_kv_v_shift(n_kv, hd);
    float buf[hd > 0 ? hd : 1]; /* a widened row */
    for (int i = 0; i < m; i++) {
        int n_ctx = start + i + 1; /* causal: positions 0..start+i */
        for (int h = 0; h < n_heads; h++) {
            const float *qh = q + ((size_t)i * n_heads + h) * hd;
            int t0 = skip ? skip[h / group] : 0;
            float mx = -INFINITY;
            for (int t = t0; t < n_ctx; t++) {
                const float *kt = cache_row(kv, rekv_kv_row(n_kv, hd, h / group, t), hd, dt, buf);
                float d = 0;
                for (int j = 0; j < hd; j++)
                    d += qh[j] * kt[j];
                scores[t] = d * scale;
                if (scores[t] > mx)
                    mx = scores[t];
            }
            float sum = 0;
            for (int t = t0; t < n_ctx; t++) {
                scores[t] = expf(scores[t] - mx);
                sum += scores[t];
            }
            float inv = 1.0f / sum;
            float *oh = out + ((size_t)i * n_heads + h) * hd;
            memset(oh, 0, sizeof(float) * (size_t)hd);
            for (int t = t0; t < n_ctx; t++) {
                const float *vt =
                    cache_row(kv, rekv_kv_row(n_kv, hd, h / group, t) + vs, hd, dt, buf);
                float p = scores[t] * inv;
                for (int j = 0; j < hd; j++)
                    oh[j] += p * vt[j];
            }
        }
    }
}

void cpu_head_proj(float *out, float *const *out_rows, const float *in, const float *a, int rows,
                   int n_heads, int group, int hd, int rk)
{
    for (int r = 0; r < rows; r++) {
        float *o = out_rows ? out_rows[r] : out + (size_t)r * (size_t)n_heads * (size_t)rk;
        for (int h = 0; h < n_heads; h++) {
            const float *x = in + ((size_t)r * (size_t)n_heads + (size_t)h) * (size_t)hd;
            const float *ah = a + (size_t)(h / group) * (size_t)hd * (size_t)rk;
            for (int c = 0; c < rk; c++) {
                float acc = 0;
                for (int d = 0; d < hd; d++)
                    acc += x[d] * ah[(size_t)d * (size_t)rk + (size_t)c];
                o[(size_t)h * (size_t)rk + (size_t)c] = acc;
            }
        }
    }
}

void cpu_spec_scores(float *out, const float *q, const rekv_spec_seq *seqs, int n, int n_heads,
                     int group, int rk, float scale)
{
    int n_kv = n_heads / group;
    for (int j = 0; j < n; j++) {
        const rekv_spec_seq *sq = &seqs[j];
        for (int h = 0; h < n_heads; h++) {
            const float *qh = q + ((size_t)sq->row * (size_t)n_heads + (size_t)h) * (size_t)rk;
            float *o = out + sq->out + (size_t)h * (size_t)sq->len;
            for (int t = 0; t < sq->len; t++) {
                const float *k =
                    sq->pk + ((size_t)t * (size_t)n_kv + (size_t)(h / group)) * (size_t)rk;
                float acc = 0;
                for (int c = 0; c < rk; c++)
                    acc += qh[c] * k[c];
                o[t] = scale * acc;
            }
        }
    }
}
