/* sample.c — token selection: greedy, temperature, top-k and top-p (nucleus), with a seeded RNG so
 * that the same seed gives the same tokens on every run and every backend. */
#include "gpuworker/gpuworker.h"

#include <math.h>
#include <stdlib.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* uniform in [0, 1) with 24 bits */
static float rng_f32(uint64_t *state)
{
    return (float)(splitmix64(state) >> 40) / 16777216.0f;
}

void rekv_sampler_init(rekv_sampler *s, float temperature, int top_k, float top_p, uint64_t seed)
{
    s->temperature = temperature;
    s->top_k = top_k;
    s->top_p = top_p;
    s->state = seed;
}

int rekv_argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

typedef struct cand {
    float p;
    int32_t id;
} cand;

/* a ranks before b: the larger logit, the lower id on ties */
static int cand_before(const cand *a, const cand *b)
{
    return a->p > b->p || (a->p == b->p && a->id < b->id);
}

/* Moves the first k of c[0..n-1] in rank order into c[0..k-1], in no particular order
 * (quickselect: a top-k needs no sort of the whole vocabulary). */
static void cand_select(cand *c, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        cand pv = c[lo + (hi - lo) / 2], t;
        int i = lo, j = hi;
        while (i <= j) {
            while (cand_before(&c[i], &pv))
                i++;
            while (cand_before(&pv, &c[j]))
                j--;
            if (i <= j) {
                t = c[i], c[i] = c[j], c[j] = t;
                i++, j--;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            return;
    }
}

static int cand_id(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    return x->id < y->id ? -1 : (x->id > y->id);
}

float rekv_sampler_draw(rekv_sampler *s)
{
    return s->temperature > 0.0f ? rng_f32(&s->state) : 0.0f;
}

int32_t rekv_sample(rekv_sampler *s, const float *logits, int vocab, void *scratch)
{
    float u = rekv_sampler_draw(s);
    return rekv_sample_drawn(s, u, logits, vocab, scratch);
}

/* a max-heap of c[0..n) in rank order (cand_before): sifts c[i] down */
static void cand_sift(cand *c, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, top = i;
        if (l < n && cand_before(&c[l], &c[top]))
            top = l;
        if (r < n && cand_before(&c[r], &c[top]))
            top = r;
        if (top == i)
            return;
        cand t = c[i];
        c[i] = c[top], c[top] = t;
        i = top;
    }
}

/* a token's weight: its logit against the largest, at temperature t (one expression for every
 * use, so the nucleus and the draw weigh alike) */
static float weight(float logit, float mx, float t)
{
    return expf((logit - mx) / t);
}

/* 1 when x[0..n) holds a NaN: a broken model's logits, which no choice may hide (argmax would
 * pick token 0) */
static int has_nan(const float *x, int n)
{
    for (int i = 0; i < n; i++)
        if (isnan(x[i]))
            return 1;
    return 0;
}

int32_t rekv_sample_drawn(const rekv_sampler *s, float u, const float *logits, int vocab,
                          void *scratch)
{
    if (has_nan(logits, vocab))
        return -1;
    if (s->temperature <= 0.0f)
        return rekv_argmax(logits, vocab);
    cand *c = scratch;
    float mx = logits[rekv_argmax(logits, vocab)], t = s->temperature;
    for (int i = 0; i < vocab; i++) {
        c[i].id = i;
        c[i].p = logits[i];
    }
    /* the first top_k by rank (selected, not sorted), in id order */
    int n = vocab;
    if (s->top_k > 0 && s->top_k < n) {
        n = s->top_k;
        cand_select(c, vocab, n);
        qsort(c, (size_t)n, sizeof(cand), cand_id);
    }
    /* top-p: the shortest prefix by rank whose weight reaches top_p of the total (the total
     * summed in id order, the prefix in rank order): taken off a heap, so only the nucleus is
     * ordered */
    int first = 0;
    if (s->top_p > 0.0f && s->top_p < 1.0f) {
        double total = 0, cum = 0;
        for (int i = 0; i < n; i++)
            total += weight(c[i].p, mx, t);
        for (int i = n / 2 - 1; i >= 0; i--)
            cand_sift(c, n, i);
        for (int left = n; left > 0 && cum < (double)s->top_p * total;) {
            cum += weight(c[0].p, mx, t);
            cand x = c[0];
            c[0] = c[--left];
            c[left] = x;
            cand_sift(c, left, 0);
            first = left;
        }
        qsort(c + first, (size_t)(n - first), sizeof(cand), cand_id);
    }
    /* the draw walks the kept tokens in id order: the same distribution as any order, and one a
     * device reaches with a prefix sum instead of a sort (the cuda kernel) */
    double sum = 0, acc = 0;
    for (int i = first; i < n; i++)
        sum += (c[i].p = weight(c[i].p, mx, t));
    double r = (double)u * sum;
    for (int i = first; i < n; i++) {
        acc += c[i].p;
        if (r < acc)
            return c[i].id;
    }
    return c[n - 1].id;
}

void rekv_top_logits(const float *logits, int vocab, int k, int32_t *ids, float *vals)
{
    if (k > vocab)
        k = vocab;
    if (k <= 0)
        return;
    int n = 0; /* insertion into a small sorted list: k is small */
    for (int i = 0; i < vocab; i++) {
        float v = logits[i];
        if (n == k && !(v > vals[k - 1]))
            continue;
        int j = n < k ? n++ : k - 1;
        while (j > 0 && v > vals[j - 1]) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        vals[j] = v;
        ids[j] = i;
    }
}

double rekv_logsumexp(const float *logits, int vocab)
{
    if (vocab <= 0)
        return -INFINITY;
    double mx = logits[0];
    for (int i = 1; i < vocab; i++)
        if (logits[i] > mx || isnan(logits[i]))
            mx = logits[i];
    if (isnan(mx) || isinf(mx))
        return mx; /* NaN stays NaN; +inf: the token at +inf takes it all */
    double sum = 0;
    for (int i = 0; i < vocab; i++)
        sum += exp((double)logits[i] - mx);
    return mx + log(sum);
}
