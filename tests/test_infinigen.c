/* test_infinigen.c — the infinigen and clo modes (gpuworker/pipeline_infinigen.c,
 * mode_clo.c) with the KV cache in a real kvstore process, on the cpu backend:
 *   - the exact limit: selecting every token (REKV_SELECT_ALL, or alpha = inf with no cap) gives
 *     resident's logits bit for bit, over prefill and decode steps, batches of mixed lengths,
 *     GPU batches, both schedules, weights offloaded, pull and push — so packing the selected
 *     rows, the new row's slot and its way back to the arena are right;
 *   - the selection equals a brute-force one (sort every token) on random scores of many shapes;
 *     random selection takes as many tokens, distinct and ascending, reproducibly;
 *   - what moves: layer 0 and prefill fetch everything; other layers fetch m rows per KV head with
 *     m within the cap, the bytes exactly m rows' worth; the new rows still reach the arena;
 *   - clo: with every head missing every step and a top-k of the whole context, or persistent
 *     (some or all heads of a layer: the whole context fetched once, then grown on the device),
 *     the head caches (sink, ring, top-k region, per-head skip) give resident's logits up to
 *     summation order (the cached tokens are attended in another order); with every head hitting, a
 * sequence's layers > 0 fetch once (sink, window, top-k) and never again, layer 0 once after the
 *     prefill, and the counters say so exactly.
 * How good the speculation is belongs to `rekv eval` (README, "InfiniGen", "CLO"). */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "gpuworker/cpu_ops.h"
#include "gpuworker/heads.h"
#include "gpuworker/pipeline.h"
#include "gpuworker/skew.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

typedef tu_fixture fixture;

typedef struct run {
    float *logits;                     /* [steps + 1][B][vocab] */
    rekv_layer_counters *layers;       /* [n_layers] of the decode steps */
    rekv_layer_counters prefill;       /* the prefill step's totals */
    uint64_t host_syncs;               /* the decode steps' blocking calls (backend stats) */
    uint64_t *head_hits, *head_misses; /* clo: [n_layers][n_kv] of the decode steps, else NULL */
} run;

/* B sequences of p, each with room for its prompt and `more` tokens, prefilled in one step:
 * sequence i's logits at logits + i * vocab. */
static void prefill(rekv_pipeline *p, int vocab, int B, const int *lens, int32_t *const *prompts,
                    int more, rekv_pseq **seqs, rekv_pipe_item *items, float *logits)
{
    rekv_err err = {0};
    for (int i = 0; i < B; i++) {
        ck_assert_msg(rekv_pseq_create(p, lens[i] + more, &seqs[i], &err) == 0, "%s", err.msg);
        items[i] = (rekv_pipe_item){.seq = seqs[i],
                                    .tokens = prompts[i],
                                    .n_tokens = lens[i],
                                    .logits = logits + (size_t)i * vocab};
    }
    ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
}

/* A decode step's items: sequence i takes token next[i], its logits at logits + i * vocab. */
static void decode_items(rekv_pseq *const *seqs, const int32_t *next, int B, float *logits,
                         int vocab, rekv_pipe_item *items)
{
    for (int i = 0; i < B; i++)
        items[i] = (rekv_pipe_item){.seq = seqs[i],
                                    .tokens = &next[i],
                                    .n_tokens = 1,
                                    .logits = logits + (size_t)i * vocab};
}

static void do_run(fixture *f, const rekv_pipeline_config *cfg, int B, const int *lens,
                   int32_t *const *prompts, int steps, run *out)
{
    rekv_err err = {0};
    rekv_pipeline *p;
    int V = f->m->config.vocab, L = f->m->config.n_layers;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be,
                                       cfg->mode == REKV_MODE_RESIDENT ? NULL : f->store, cfg, &p,
                                       &err) == 0,
                  "%s", err.msg);
    rekv_pseq **seqs = calloc((size_t)B, sizeof(*seqs));
    rekv_pipe_item *items = calloc((size_t)B, sizeof(*items));
    int32_t *next = calloc((size_t)B, sizeof(int32_t));
    out->logits = malloc(sizeof(float) * (size_t)(steps + 1) * (size_t)B * (size_t)V);
    out->layers = calloc((size_t)L, sizeof(rekv_layer_counters));
    prefill(p, V, B, lens, prompts, steps, seqs, items, out->logits);
    rekv_pipeline_counters(p, &out->prefill);
    rekv_pipeline_counters_reset(p);
    rekv_backend_stats bst;
    f->be->iface->stats(f->be, &bst);
    out->host_syncs = bst.host_syncs;
    for (int s = 1; s <= steps; s++) {
        for (int i = 0; i < B; i++)
            next[i] = rekv_argmax(out->logits + ((size_t)(s - 1) * B + i) * V, V);
        decode_items(seqs, next, B, out->logits + (size_t)s * B * V, V, items);
        ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
    }
    f->be->iface->stats(f->be, &bst);
    out->host_syncs = bst.host_syncs - out->host_syncs;
    memcpy(out->layers, rekv_pipeline_counters(p, NULL), sizeof(rekv_layer_counters) * (size_t)L);
    const uint64_t *hh, *hm;
    out->head_hits = out->head_misses = NULL;
    if (rekv_pipeline_head_cache_counts(p, &hh, &hm) == 0) {
        size_t n = (size_t)L * (size_t)f->m->config.n_kv_heads * sizeof(uint64_t);
        out->head_hits = malloc(n);
        out->head_misses = malloc(n);
        memcpy(out->head_hits, hh, n);
        memcpy(out->head_misses, hm, n);
    }
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
    free(seqs);
    free(items);
    free(next);
}

static void run_free(run *r)
{
    free(r->logits);
    free(r->layers);
    free(r->head_hits);
    free(r->head_misses);
}

/* r's first n logits equal ref's bit for bit; `what` and variant i name the run that differs */
static void expect_same_logits(const run *r, const run *ref, size_t n, const char *what, size_t i)
{
    for (size_t k = 0; k < n; k++)
        if (memcmp(&r->logits[k], &ref->logits[k], sizeof(float)) != 0)
            ck_abort_msg("%s variant %zu: logit %zu is %.9g, resident's %.9g", what, i, k,
                         (double)r->logits[k], (double)ref->logits[k]);
}

static int32_t **make_prompts(const fixture *f, int B, const int *lens)
{
    int32_t **pr = calloc((size_t)B, sizeof(*pr));
    uint64_t x = 3;
    for (int b = 0; b < B; b++) {
        pr[b] = malloc(sizeof(int32_t) * (size_t)lens[b]);
        for (int i = 0; i < lens[b]; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            pr[b][i] = (int32_t)((x >> 33) % (uint64_t)f->m->config.vocab);
        }
    }
    return pr;
}

/* every way of selecting all tokens, on every pipeline shape, equals resident bit for bit */
static void check_exact_limit(const char *model, rekv_dtype cache, const int *lens, int B,
                              int steps)
{
    fixture f;
    tu_fixture_open(&f, model, cache, "cpu");
    rekv_skew sk;
    tu_skew_calibrate(&f, &sk);
    int32_t **prompts = make_prompts(&f, B, lens);
    size_t V = (size_t)f.m->config.vocab, n = (size_t)(steps + 1) * (size_t)B * V;
    rekv_pipeline_config ref_cfg;
    rekv_pipeline_config_defaults(&ref_cfg);
    ref_cfg.cache_dtype = cache;
    run ref;
    do_run(&f, &ref_cfg, B, lens, prompts, steps, &ref);
    struct {
        rekv_select sel;
        float alpha, cap;
        int offload_w, gpu_batches, push;
        rekv_schedule sched;
        int lookahead, device_tokens;
    } v[] = {
        {REKV_SELECT_ALL, 4, 0.2f, 0, 1, 0, REKV_SCHED_ROW, 1, 0},
        {REKV_SELECT_SPECULATE, INFINITY, 1, 0, 2, 0, REKV_SCHED_COLUMN, 1, 0},
        {REKV_SELECT_ALL, 4, 0.2f, 1, 2, 0, REKV_SCHED_ROW, 0, 0},
        {REKV_SELECT_ALL, 4, 0.2f, 1, 3, 1, REKV_SCHED_COLUMN, 1, 0},
        {REKV_SELECT_SPECULATE, INFINITY, 1, 0, 1, 1, REKV_SCHED_ROW, 0, 0},
        /* a device-resident part: its slots, then the selected ones past it */
        {REKV_SELECT_ALL, 4, 0.2f, 0, 2, 0, REKV_SCHED_ROW, 1, 20},
        {REKV_SELECT_SPECULATE, INFINITY, 1, 1, 1, 1, REKV_SCHED_COLUMN, 0, 20},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        rekv_pipeline_config cfg;
        rekv_pipeline_config_defaults(&cfg);
        cfg.mode = REKV_MODE_INFINIGEN;
        cfg.cache_dtype = cache;
        cfg.skew = &sk;
        cfg.select = v[i].sel;
        cfg.alpha = v[i].alpha;
        cfg.max_fraction = v[i].cap;
        cfg.offload_weights = v[i].offload_w;
        cfg.gpu_batches = v[i].gpu_batches;
        cfg.schedule = v[i].sched;
        cfg.push = v[i].push;
        cfg.lookahead = v[i].lookahead;
        cfg.device_tokens = v[i].device_tokens;
        run r;
        do_run(&f, &cfg, B, lens, prompts, steps, &r);
        expect_same_logits(&r, &ref, n, model, i);
        /* everything past the device part crossed the link, every layer */
        for (int l = 0; l < f.m->config.n_layers; l++) {
            ck_assert_uint_eq(r.layers[l].tokens_fetched, r.layers[l].tokens_considered);
            ck_assert_uint_gt(r.layers[l].tokens_fetched, 0);
            ck_assert(v[i].device_tokens == 0 || r.layers[l].tokens_device > 0);
        }
        run_free(&r);
    }
    run_free(&ref);
    for (int b = 0; b < B; b++)
        free(prompts[b]);
    free(prompts);
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
}

START_TEST(exact_limit_stories260k)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    int lens[] = {17, 1, 40};
    check_exact_limit(path, REKV_DTYPE_F32, lens, 3, 4);
}
END_TEST

START_TEST(exact_limit_synthetic)
{
    static const rekv_synth_spec specs[] = {
        {REKV_ARCH_OPT, 2, 64, 4, 4, 128, 300, 1100, REKV_DTYPE_F16, 11, 1},
        {REKV_ARCH_LLAMA, 3, 64, 8, 2, 160, 300, 1100, REKV_DTYPE_BF16, 12, 0},
    };
    char *dir = tu_tmpdir();
    for (size_t i = 0; i < 2; i++) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/m%zu", dir, i);
        rekv_err err = {0};
        ck_assert_msg(rekv_synth_write(&specs[i], path, &err) == 0, "%s", err.msg);
        int lens[] = {5, 33, 70};
        check_exact_limit(path, REKV_DTYPE_F16, lens, 3, 3);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* Recomputation within the selection (cfg.split with infinigen): the same values, fewer bytes.
 * On an MHA model (4 heads: a token's activation row is worth it when 3 or 4 heads selected it)
 * selecting everything with a split recomputes every token (resident's bits, every pipeline
 * shape); the speculated selection with a split gives that selection's bits (the split changes
 * how rows arrive, never which) with fewer bytes over the link — each recomputed token's
 * activation row fewer than the K,V rows it replaced — and at most split tokens a (sequence,
 * layer). On stories260K (GQA: an activation row is as wide as all of a token's K,V) a selecting
 * layer recomputes nothing, layer 0 (fetched whole) [0, split) as kvpr. */
static void ig_totals(const fixture *f, const run *r, int from, rekv_layer_counters *t)
{
    memset(t, 0, sizeof(*t));
    for (int l = from; l < f->m->config.n_layers; l++) {
        t->h2d_bytes[REKV_XFER_KV] += r->layers[l].h2d_bytes[REKV_XFER_KV];
        t->h2d_bytes[REKV_XFER_ACT] += r->layers[l].h2d_bytes[REKV_XFER_ACT];
        t->d2h_bytes[REKV_XFER_ACT] += r->layers[l].d2h_bytes[REKV_XFER_ACT];
        t->tokens_fetched += r->layers[l].tokens_fetched;
        t->tokens_recomputed += r->layers[l].tokens_recomputed;
        t->tokens_considered += r->layers[l].tokens_considered;
    }
}

START_TEST(recompute_within_selection)
{
    static const rekv_synth_spec spec = {REKV_ARCH_OPT,  3,  64, 4, 4, 128, 300, 1100,
                                         REKV_DTYPE_F16, 13, 1};
    char *dir = tu_tmpdir(), path[4200];
    snprintf(path, sizeof(path), "%s/m", dir);
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(&spec, path, &err) == 0, "%s", err.msg);
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, "cpu");
    const rekv_model_config *c = &f.m->config;
    rekv_skew sk;
    tu_skew_calibrate(&f, &sk);
    int B = 3, lens[] = {5, 40, 90}, steps = 4, H = c->hidden;
    int32_t **prompts = make_prompts(&f, B, lens);
    size_t n = (size_t)(steps + 1) * (size_t)B * (size_t)c->vocab;
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    run ref;
    do_run(&f, &cfg, B, lens, prompts, steps, &ref);
    cfg.mode = REKV_MODE_INFINIGEN;
    cfg.skew = &sk;
    cfg.split = 1 << 20;
    /* everything selected, everything recomputed: resident's bits */
    struct {
        int gpu_batches, push, offload_w, device_tokens;
        rekv_schedule sched;
    } v[] = {{1, 0, 0, 0, REKV_SCHED_ROW},
             {2, 1, 1, 0, REKV_SCHED_COLUMN},
             {2, 0, 0, 20, REKV_SCHED_ROW}};
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        rekv_pipeline_config a = cfg;
        a.select = REKV_SELECT_ALL;
        a.gpu_batches = v[i].gpu_batches;
        a.push = v[i].push;
        a.offload_weights = v[i].offload_w;
        a.device_tokens = v[i].device_tokens;
        a.schedule = v[i].sched;
        run r;
        do_run(&f, &a, B, lens, prompts, steps, &r);
        expect_same_logits(&r, &ref, n, "recompute", i);
        for (int l = 0; l < c->n_layers; l++) {
            ck_assert_uint_gt(r.layers[l].tokens_recomputed, 0);
            ck_assert_uint_eq(r.layers[l].tokens_recomputed, r.layers[l].tokens_considered);
            ck_assert_uint_eq(r.layers[l].h2d_bytes[REKV_XFER_KV], 0);
            ck_assert_uint_eq(r.layers[l].h2d_bytes[REKV_XFER_ACT],
                              r.layers[l].tokens_recomputed * (uint64_t)H * sizeof(float));
            /* the new rows' activations reach the arena beside their K,V */
            ck_assert_uint_eq(r.layers[l].d2h_bytes[REKV_XFER_ACT],
                              (uint64_t)(B * steps * H) * sizeof(float));
        }
        run_free(&r);
    }
    /* a device without room for every token's recomputation (about 80 of the first decode
     * step's 135 rows, 1600 bytes each with the buffers' slack): the split lowered to what fits,
     * the rest as K,V, the same bits */
    rekv_pipeline_config tight = cfg;
    tight.select = REKV_SELECT_ALL;
    tight.split = 1;
    rekv_link_config link = {.device_bytes =
                                 tu_device_use(&f, &tight, B, lens, prompts) + 80 * 1600};
    tight.split = 1 << 20;
    rekv_backend *roomy = f.be;
    ck_assert_msg(rekv_backend_cpu_create(&link, &f.be, &err) == 0, "%s", err.msg);
    run low;
    do_run(&f, &tight, B, lens, prompts, steps, &low);
    rekv_backend_destroy(f.be);
    f.be = roomy;
    expect_same_logits(&low, &ref, n, "lowered split", 0);
    for (int l = 0; l < c->n_layers; l++) {
        ck_assert_uint_gt(low.layers[l].tokens_recomputed, 0);
        ck_assert_uint_lt(low.layers[l].tokens_recomputed, low.layers[l].tokens_considered);
        ck_assert_uint_gt(low.layers[l].h2d_bytes[REKV_XFER_KV], 0);
    }
    run_free(&low);
    /* the speculated selection: its own bits, fewer bytes */
    cfg.max_fraction = 0.6f;
    rekv_pipeline_config plain = cfg;
    plain.split = 0;
    run sp, rc, r2;
    do_run(&f, &plain, B, lens, prompts, steps, &sp);
    do_run(&f, &cfg, B, lens, prompts, steps, &rc);
    ck_assert_msg(memcmp(sp.logits, rc.logits, n * sizeof(float)) == 0,
                  "recomputing within the selection changed the logits");
    ck_assert(memcmp(sp.logits, ref.logits, n * sizeof(float)) != 0); /* it was sparse */
    rekv_layer_counters a, b;
    ig_totals(&f, &sp, 1, &a);
    ig_totals(&f, &rc, 1, &b);
    ck_assert_uint_eq(a.tokens_fetched, b.tokens_fetched);
    ck_assert_uint_eq(a.tokens_recomputed, 0);
    ck_assert_uint_gt(b.tokens_recomputed, 0);
    ck_assert_uint_eq(b.h2d_bytes[REKV_XFER_ACT],
                      b.tokens_recomputed * (uint64_t)H * sizeof(float));
    ck_assert_uint_lt(b.h2d_bytes[REKV_XFER_KV] + b.h2d_bytes[REKV_XFER_ACT],
                      a.h2d_bytes[REKV_XFER_KV]);
    /* a small split: at most that many a (sequence, layer), the same bits */
    rekv_pipeline_config small = cfg;
    small.split = 2;
    do_run(&f, &small, B, lens, prompts, steps, &r2);
    ck_assert(memcmp(sp.logits, r2.logits, n * sizeof(float)) == 0);
    ig_totals(&f, &r2, 1, &b);
    ck_assert_uint_gt(b.tokens_recomputed, 0);
    ck_assert_uint_le(b.tokens_recomputed, (uint64_t)(2 * B * steps * (c->n_layers - 1)));
    run_free(&sp), run_free(&rc), run_free(&r2), run_free(&ref);
    for (int i = 0; i < B; i++)
        free(prompts[i]);
    free(prompts);
    rekv_skew_free(&sk);
    tu_fixture_close(&f);

    /* GQA: a selecting layer never recomputes; layer 0 recomputes [0, split) */
    const char *sp260 = tu_shared("models/stories260K/stories260K.bin");
    if (sp260 != NULL) {
        tu_fixture_open(&f, sp260, REKV_DTYPE_F32, "cpu");
        tu_skew_calibrate(&f, &sk);
        int l2[] = {60, 30};
        prompts = make_prompts(&f, 2, l2);
        rekv_pipeline_config g;
        rekv_pipeline_config_defaults(&g);
        g.mode = REKV_MODE_INFINIGEN;
        g.skew = &sk;
        g.select = REKV_SELECT_ALL;
        g.split = 10;
        run r;
        do_run(&f, &g, 2, l2, prompts, 3, &r);
        ig_totals(&f, &r, 1, &b);
        ck_assert_uint_eq(b.tokens_recomputed, 0);
        ck_assert_uint_eq(b.tokens_fetched, b.tokens_considered);
        ck_assert_uint_eq(r.layers[0].tokens_recomputed, 2 * 3 * 10);
        run_free(&r);
        free(prompts[0]), free(prompts[1]), free(prompts);
        rekv_skew_free(&sk);
        tu_fixture_close(&f);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ------------------------------------------------------------------ selection */

typedef struct scored {
    float v;
    int t;
} scored;

static int by_score(const void *a, const void *b)
{
    const scored *x = a, *y = b;
    if (x->v != y->v)
        return x->v < y->v ? 1 : -1;
    return x->t - y->t;
}

static int by_pos(const void *a, const void *b)
{
    return *(const int32_t *)a - *(const int32_t *)b;
}

/* The selection rule, the slow way: per KV head each token's score is the group's summed softmax
 * of the speculated scores (summed per head in token order, as the rule does, so the floats agree);
 * the count is the per-query-head count within alpha of its best, averaged over query heads, then
 * capped; sort every token, take the first m */
static int brute_select(const float *s, int nh, int nkv, int len, float alpha, float cap,
                        int32_t *sel)
{
    int group = nh / nkv;
    scored *all = malloc(sizeof(scored) * (size_t)nkv * (size_t)len);
    double counted = 0;
    for (int g = 0; g < nkv; g++)
        for (int t = 0; t < len; t++)
            all[(size_t)g * len + t] = (scored){0, t};
    for (int h = 0; h < nh; h++) {
        const float *sh = s + (size_t)h * len;
        float best = -INFINITY;
        for (int t = 0; t < len; t++)
            best = fmaxf(best, sh[t]);
        float lane[8] = {0}, sum = 0; /* the softmax's sum as cpu_softmax_exp makes it */
        int c = 0;
        for (int t = 0; t < len; t++) {
            lane[t % 8] += cpu_expf(sh[t] - best);
            c += sh[t] > best - alpha;
        }
        for (int l = 0; l < 8; l++)
            sum += lane[l];
        counted += c;
        for (int t = 0; t < len; t++)
            all[(size_t)(h / group) * len + t].v += cpu_expf(sh[t] - best) * (1.0f / sum);
    }
    int m = (int)lround(counted / nh), mx = (int)((double)cap * len);
    m = m > mx ? mx : m;
    m = m < 1 ? 1 : m;
    for (int g = 0; g < nkv; g++) {
        qsort(all + (size_t)g * len, (size_t)len, sizeof(scored), by_score);
        for (int j = 0; j < m; j++)
            sel[(size_t)g * len + j] = all[(size_t)g * len + j].t;
        qsort(sel + (size_t)g * len, (size_t)m, sizeof(int32_t), by_pos);
    }
    free(all);
    return m;
}

START_TEST(selection_matches_brute_force)
{
    uint64_t x = 11;
    for (int trial = 0; trial < 400; trial++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int nkv = 1 + (int)((x >> 40) % 4), group = 1 + (int)((x >> 50) % 3);
        int nh = nkv * group, len = 1 + (int)((x >> 20) % (trial % 10 ? 300 : 4000));
        float alpha = 0.5f + (float)((x >> 10) % 60) / 10.0f;
        float cap = trial % 3 == 0 ? 1.0f : 0.05f + (float)((x >> 30) % 50) / 100.0f;
        float *s = malloc(sizeof(float) * (size_t)nh * (size_t)len);
        for (int i = 0; i < nh * len; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            /* coarse values, so that ties happen */
            s[i] = (float)((int)((x >> 33) % 64) - 32) / 4.0f;
        }
        int32_t *a = malloc(sizeof(int32_t) * (size_t)nkv * (size_t)len);
        int32_t *b = malloc(sizeof(int32_t) * (size_t)nkv * (size_t)len);
        float *scratch = malloc(sizeof(float) * (size_t)(nkv + 1) * (size_t)len);
        int ma = rekv_ig_select(s, nh, nkv, len, alpha, cap, REKV_SELECT_SPECULATE, 0, a, scratch);
        int mb = brute_select(s, nh, nkv, len, alpha, cap, b);
        ck_assert_msg(ma == mb, "trial %d: m %d, brute force %d", trial, ma, mb);
        for (int g = 0; g < nkv; g++)
            for (int j = 0; j < ma; j++)
                ck_assert_msg(a[(size_t)g * len + j] == b[(size_t)g * len + j],
                              "trial %d head %d slot %d: token %d, brute force %d", trial, g, j,
                              a[(size_t)g * len + j], b[(size_t)g * len + j]);
        /* random: as many, distinct, ascending, reproducible, and not the speculation's */
        int32_t *r1 = malloc(sizeof(int32_t) * (size_t)nkv * (size_t)len);
        int32_t *r2 = malloc(sizeof(int32_t) * (size_t)nkv * (size_t)len);
        int m1 = rekv_ig_select(s, nh, nkv, len, alpha, cap, REKV_SELECT_RANDOM, 99, r1, scratch);
        int m2 = rekv_ig_select(s, nh, nkv, len, alpha, cap, REKV_SELECT_RANDOM, 99, r2, scratch);
        ck_assert_int_eq(m1, ma);
        ck_assert_int_eq(m2, ma);
        for (int g = 0; g < nkv; g++)
            for (int j = 0; j < m1; j++) {
                ck_assert_int_eq(r1[(size_t)g * len + j], r2[(size_t)g * len + j]);
                ck_assert(r1[(size_t)g * len + j] >= 0 && r1[(size_t)g * len + j] < len);
                if (j > 0)
                    ck_assert(r1[(size_t)g * len + j] > r1[(size_t)g * len + j - 1]);
            }
        free(r1), free(r2), free(a), free(b), free(s), free(scratch);
    }
}
END_TEST

/* clo's decision the slow way: the cosines in double; Eq. 10 as the paper prints it, sum(s_j) /
 * sum(s_j / sim_j) over the query heads with weight s_j = their importance (every head 1 when
 * none has any; a weighted head whose similarity is not positive makes the aggregate -1, the
 * least a cosine can be); a hit when it is at least tau. A miss: k = round(frac * len) clipped to
 * [1, min(kmax, middle)], the middle's tokens sorted by the group's summed softmax (summed as
 * brute_select sums it), the first k, as offsets past the sink, ascending. */
static int brute_clo(const float *q, const float *label, const double *imp, double tau, int group,
                     int hd, const float *s, int len, float frac, int kmax, int32_t *out)
{
    if (label) {
        double wsum = 0, num = 0, den = 0;
        int nonpos = 0;
        for (int h = 0; h < group; h++)
            wsum += imp[h];
        for (int h = 0; h < group; h++) {
            double w = wsum > 0 ? imp[h] : 1, ab = 0, aa = 0, bb = 0;
            for (int i = 0; i < hd; i++) {
                double a = q[h * hd + i], b = label[h * hd + i];
                ab += a * b, aa += a * a, bb += b * b;
            }
            double sim = aa > 0 && bb > 0 ? ab / sqrt(aa * bb) : 0;
            if (w == 0)
                continue;
            if (sim <= 0)
                nonpos = 1;
            num += w, den += w / sim;
        }
        double agg = nonpos || den <= 0 ? -1 : num / den;
        if (agg >= tau)
            return 0;
    }
    int middle = len - REKV_HEADS_SINK - REKV_HEADS_RECENT;
    int k = (int)lround((double)frac * len);
    k = k > kmax ? kmax : k;
    k = k > middle ? middle : k;
    k = k < 1 ? 1 : k;
    scored *all = calloc((size_t)len, sizeof(scored));
    for (int t = 0; t < len; t++)
        all[t].t = t;
    for (int h = 0; h < group; h++) {
        const float *sh = s + (size_t)h * len;
        float best = -INFINITY, lane[8] = {0}, sum = 0;
        for (int t = 0; t < len; t++)
            best = fmaxf(best, sh[t]);
        for (int t = 0; t < len; t++)
            lane[t % 8] += cpu_expf(sh[t] - best);
        for (int l = 0; l < 8; l++)
            sum += lane[l];
        for (int t = 0; t < len; t++)
            all[t].v += cpu_expf(sh[t] - best) * (1.0f / sum);
    }
    qsort(all + REKV_HEADS_SINK, (size_t)middle, sizeof(scored), by_score);
    for (int j = 0; j < k; j++)
        out[j] = all[REKV_HEADS_SINK + j].t - REKV_HEADS_SINK;
    qsort(out, (size_t)k, sizeof(int32_t), by_pos);
    free(all);
    return k;
}

/* rekv_clo_decide, which the pipeline's decisions are, against brute_clo on random queries,
 * labels (from equal to opposite), importances (zeros among them) and thresholds (the bounds
 * among them), with coarse scores so that ties happen: the same hit or k, and the same tokens. */
START_TEST(clo_decisions_match_brute_force)
{
    uint64_t x = 17;
    int hits = 0, misses = 0, fresh = 0;
    for (int trial = 0; trial < 600; trial++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int group = 1 + (int)((x >> 40) % 4), hd = 2 + (int)((x >> 50) % 63);
        int len = REKV_HEADS_SINK + REKV_HEADS_RECENT + 1 + (int)((x >> 20) % 500);
        float frac = trial % 5 == 0 ? 1.0f : 0.02f + (float)((x >> 30) % 40) / 100.0f;
        int kmax = trial % 7 == 0 ? 1 + (int)((x >> 12) % 20) : len;
        double tau = trial % 11 == 0   ? 1.0
                     : trial % 13 == 0 ? -1.0
                                       : (double)((x >> 8) % 2001) / 1000 - 1;
        float mix = (float)((x >> 44) % 101) / 50.0f - 1.0f; /* label = mix * q + noise */
        size_t n = (size_t)group * (size_t)hd;
        float *q = malloc(sizeof(float) * n), *lab = malloc(sizeof(float) * n);
        float *s = malloc(sizeof(float) * (size_t)group * (size_t)len);
        float *scratch = malloc(sizeof(float) * 2 * (size_t)len);
        int32_t *a = malloc(sizeof(int32_t) * (size_t)len),
                *b = malloc(sizeof(int32_t) * (size_t)len);
        double imp[4];
        for (int h = 0; h < group; h++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            imp[h] = trial % 17 == 0 ? 0 : (x >> 61) == 0 ? 0 : (double)((x >> 33) % 1000) / 999;
        }
        for (size_t i = 0; i < n; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            q[i] = (float)((int)((x >> 33) % 2001) - 1000) / 500.0f;
            lab[i] = trial % 19 == 0
                         ? q[i]
                         : mix * q[i] + (float)((int)((x >> 45) % 2001) - 1000) / 2500.0f;
        }
        for (int i = 0; i < group * len; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            s[i] = (float)((int)((x >> 33) % 64) - 32) / 4.0f;
        }
        const float *label = trial % 23 == 0 ? NULL : lab;
        int ka = rekv_clo_decide(q, label, imp, tau, group, hd, s, len, frac, kmax, scratch, a);
        int kb = brute_clo(q, label, imp, tau, group, hd, s, len, frac, kmax, b);
        ck_assert_msg(ka == kb, "trial %d: k %d, brute force %d", trial, ka, kb);
        qsort(a, (size_t)ka, sizeof(int32_t), by_pos);
        for (int j = 0; j < ka; j++)
            ck_assert_msg(a[j] == b[j], "trial %d slot %d: token %d, brute force %d", trial, j,
                          a[j], b[j]);
        hits += ka == 0, misses += ka > 0, fresh += label == NULL;
        free(q), free(lab), free(s), free(scratch), free(a), free(b);
    }
    ck_assert_msg(hits > 100 && misses > 100 && fresh > 10, "hits %d, misses %d, fresh %d", hits,
                  misses, fresh);
}
END_TEST

/* ------------------------------------------------------------------ what moves */

START_TEST(speculation_moves_less)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, "cpu");
    const rekv_model_config *c = &f.m->config;
    rekv_skew sk;
    tu_skew_calibrate(&f, &sk);
    int lens[] = {150, 90};
    int32_t **prompts = make_prompts(&f, 2, lens);
    int steps = 6;
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    run ref, r;
    do_run(&f, &cfg, 2, lens, prompts, steps, &ref);
    cfg.mode = REKV_MODE_INFINIGEN;
    cfg.skew = &sk;
    cfg.max_fraction = 0.25f;
    for (int la = 0; la < 2; la++) {
        cfg.lookahead = la;
        do_run(&f, &cfg, 2, lens, prompts, steps, &r);
        size_t row = (size_t)c->head_dim * sizeof(float) * 2 * (size_t)c->n_kv_heads;
        /* prefill: nothing to fetch, partial keys made for every row */
        ck_assert_uint_eq(r.prefill.tokens_fetched, 0);
        /* decode: the context is lens + steps before; layer 0 fetches everything */
        uint64_t ctx = 0;
        for (int s = 0; s < steps; s++)
            ctx += (uint64_t)(lens[0] + s) + (uint64_t)(lens[1] + s);
        ck_assert_uint_eq(r.layers[0].tokens_considered, ctx);
        ck_assert_uint_eq(r.layers[0].tokens_fetched, ctx);
        uint64_t fetched = 0;
        for (int l = 1; l < c->n_layers; l++) {
            ck_assert_uint_eq(r.layers[l].tokens_considered, ctx);
            ck_assert_uint_ge(r.layers[l].tokens_fetched, (uint64_t)(2 * steps));
            /* each step at most a quarter of each sequence's context */
            uint64_t cap = 0;
            for (int s = 0; s < steps; s++)
                cap += (uint64_t)((lens[0] + s) / 4) + (uint64_t)((lens[1] + s) / 4);
            ck_assert_uint_le(r.layers[l].tokens_fetched, cap);
            ck_assert_uint_eq(r.layers[l].h2d_bytes[REKV_XFER_KV],
                              r.layers[l].tokens_fetched * row);
            /* the new rows still reach the arena: one row per sequence and step */
            ck_assert_uint_eq(r.layers[l].d2h_bytes[REKV_XFER_KV], (uint64_t)(2 * steps) * row);
            fetched += r.layers[l].tokens_fetched;
        }
        ck_assert_uint_lt(fetched, ctx * (uint64_t)(c->n_layers - 1));
        /* the planner's f: the selecting layers' share, layer 0 (fetched whole) left out */
        uint64_t considered, selected;
        double fr = rekv_pipeline_selected_fraction(r.layers, c->n_layers, &considered, &selected);
        ck_assert_uint_eq(selected, fetched);
        ck_assert_uint_eq(considered, ctx * (uint64_t)(c->n_layers - 1));
        ck_assert(fr == (double)fetched / (double)considered);
        /* a sparse step's results do not depend on how the step runs: pull or push, GPU
         * batches, schedule, weights offloaded — the same bits */
        rekv_pipeline_config v = cfg;
        v.push = 1;
        v.gpu_batches = 2;
        v.schedule = REKV_SCHED_COLUMN;
        v.offload_weights = 1;
        run r2;
        do_run(&f, &v, 2, lens, prompts, steps, &r2);
        size_t n = (size_t)(steps + 1) * 2 * (size_t)c->vocab;
        ck_assert_msg(memcmp(r.logits, r2.logits, n * sizeof(float)) == 0,
                      "lookahead %d: the same selection gave other logits when run otherwise", la);
        ck_assert(memcmp(r.logits, ref.logits, n * sizeof(float)) != 0); /* it was sparse */
        /* nor on the threads that select (a unit's sequences on the pool, each its own scratch) */
        run r1;
        cpu_gemm_set_threads(1);
        do_run(&f, &cfg, 2, lens, prompts, steps, &r1);
        cpu_gemm_set_threads(0);
        ck_assert_msg(memcmp(r.logits, r1.logits, n * sizeof(float)) == 0,
                      "lookahead %d: one thread selected otherwise", la);
        run_free(&r1);
        run_free(&r2);
        run_free(&r);
    }
    run_free(&ref);
    free(prompts[0]), free(prompts[1]), free(prompts);
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
}
END_TEST

/* A device-resident part (cfg.device_tokens) is attended whole, from the device, whatever the
 * selection; the selection is among the tokens past it, and only those cross the link. */
START_TEST(device_part_attended_whole)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, "cpu");
    const rekv_model_config *c = &f.m->config;
    rekv_skew sk;
    tu_skew_calibrate(&f, &sk);
    int lens[] = {150, 90}, steps = 5;
    int32_t **prompts = make_prompts(&f, 2, lens);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    run ref, all, part, none;
    do_run(&f, &cfg, 2, lens, prompts, steps, &ref);
    cfg.mode = REKV_MODE_INFINIGEN;
    cfg.skew = &sk;
    cfg.max_fraction = 0.25f;
    do_run(&f, &cfg, 2, lens, prompts, steps, &none);
    cfg.device_tokens = 4096; /* the whole context: nothing to select, resident's bits */
    do_run(&f, &cfg, 2, lens, prompts, steps, &all);
    cfg.device_tokens = 64;
    do_run(&f, &cfg, 2, lens, prompts, steps, &part);
    size_t n = (size_t)(steps + 1) * 2 * (size_t)c->vocab;
    ck_assert_msg(memcmp(all.logits, ref.logits, n * sizeof(float)) == 0,
                  "a device part holding the whole context did not give resident's logits");
    uint64_t ctx = 0, dev = 0;
    for (int s = 0; s < steps; s++)
        for (int b = 0; b < 2; b++) {
            ctx += (uint64_t)(lens[b] + s);
            dev += (uint64_t)(lens[b] + s < 64 ? lens[b] + s : 64);
        }
    size_t row = (size_t)c->head_dim * sizeof(float) * 2 * (size_t)c->n_kv_heads;
    for (int l = 0; l < c->n_layers; l++) {
        ck_assert_uint_eq(all.layers[l].tokens_fetched, 0);
        ck_assert_uint_eq(all.layers[l].h2d_bytes[REKV_XFER_KV], 0);
        ck_assert_uint_eq(all.layers[l].tokens_device, ctx);
        ck_assert_uint_eq(part.layers[l].tokens_device, dev);
        /* layer 0 fetches the rest whole; the others select among it, a quarter at most */
        ck_assert_uint_eq(part.layers[l].tokens_considered, ctx - dev);
        if (l == 0)
            ck_assert_uint_eq(part.layers[l].tokens_fetched, ctx - dev);
        else
            ck_assert_uint_le(part.layers[l].tokens_fetched, (ctx - dev) / 4);
        ck_assert_uint_eq(part.layers[l].h2d_bytes[REKV_XFER_KV],
                          part.layers[l].tokens_fetched * row);
        ck_assert_uint_lt(part.layers[l].tokens_fetched, none.layers[l].tokens_fetched);
        /* the new rows still reach the arena */
        ck_assert_uint_eq(part.layers[l].d2h_bytes[REKV_XFER_KV], (uint64_t)(2 * steps) * row);
    }
    ck_assert(memcmp(part.logits, ref.logits, n * sizeof(float)) != 0); /* it was sparse */
    run_free(&ref), run_free(&all), run_free(&part), run_free(&none);
    free(prompts[0]), free(prompts[1]), free(prompts);
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
}
END_TEST

/* bad configurations are refused with a clear error */
/* infinigen pins a whole step (only the exact modes run in layer windows): a step whose blocks do
 * not fit the arena fails at once, saying so, and leaves nothing pinned. */
START_TEST(whole_step_past_the_arena_fails)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    /* 28 slots of 4 KiB; four prompts of 20 tokens take 2 blocks a layer each, 40 in all */
    tu_fixture_open_host(&f, path, REKV_DTYPE_F32, NULL, 4096 + 28 * 4096);
    rekv_skew sk;
    tu_skew_calibrate(&f, &sk);
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_INFINIGEN;
    cfg.skew = &sk;
    rekv_pipeline *p = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err) == 0, "%s", err.msg);
    enum { B = 4, S = 20 };
    rekv_pseq *seqs[B];
    rekv_pipe_item items[B];
    int32_t prompt[S];
    float *logits = malloc(sizeof(float) * B * (size_t)f.m->config.vocab);
    for (int t = 0; t < S; t++)
        prompt[t] = t + 1;
    for (int i = 0; i < B; i++) {
        ck_assert_msg(rekv_pseq_create(p, 64, &seqs[i], &err) == 0, "%s", err.msg);
        items[i] = (rekv_pipe_item){.seq = seqs[i],
                                    .tokens = prompt,
                                    .n_tokens = S,
                                    .logits = logits + (size_t)i * f.m->config.vocab};
    }
    ck_assert_int_eq(rekv_pipeline_step(p, items, B, &err), -ENOMEM);
    ck_assert_msg(strstr(err.msg, "pins a whole step") != NULL, "%s", err.msg);
    rekv_kv_stats st;
    ck_assert_int_eq(rekv_kvstore_stats(f.store, &st, NULL), 0);
    ck_assert_uint_eq(st.pinned_blocks, 0);
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
    free(logits);
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
}
END_TEST

START_TEST(bad_config_refused)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, "cpu");
    rekv_pipeline_config cfg;
    rekv_pipeline_config_defaults(&cfg);
    cfg.mode = REKV_MODE_INFINIGEN;
    rekv_pipeline *p = NULL;
    rekv_err err = {0};
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "skew") != NULL, "%s", err.msg);
    rekv_skew sk;
    tu_skew_calibrate(&f, &sk);
    cfg.skew = &sk;
    cfg.max_fraction = 0;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "cap") != NULL, "%s", err.msg);
    cfg.max_fraction = 0.2f;
    sk.head_dim++;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "not this model's") != NULL, "%s", err.msg);
    sk.head_dim--;
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
}
END_TEST

/* ------------------------------------------------------------------ clo */

/* What every clo test opens: stories260K with its store, a skew, and a head profile of one
 * importance for every head (adjacent-query cosine 0.5). 0: the model is missing (skipped). */
typedef struct clo_fixture {
    fixture f;
    rekv_skew sk;
    rekv_heads hp;
} clo_fixture;

static int clo_open(clo_fixture *x, double importance)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return 0;
    tu_fixture_open(&x->f, path, REKV_DTYPE_F32, NULL);
    tu_skew_calibrate(&x->f, &x->sk);
    tu_heads_uniform(&x->f, importance, &x->hp);
    return 1;
}

static void clo_close(clo_fixture *x, int32_t **prompts, int B)
{
    for (int b = 0; prompts && b < B; b++)
        free(prompts[b]);
    free(prompts);
    rekv_heads_free(&x->hp);
    rekv_skew_free(&x->sk);
    tu_fixture_close(&x->f);
}

/* A clo configuration on x's skew and profile. */
static void clo_config(clo_fixture *x, rekv_pipeline_config *cfg)
{
    rekv_pipeline_config_defaults(cfg);
    cfg->mode = REKV_MODE_CLO;
    cfg->skew = &x->sk;
    cfg->heads = &x->hp;
}

/* every head misses every step and its top-k is the whole middle of the context: the same
 * attention as resident's over the same rows, in another order */
START_TEST(clo_full_cache_matches_resident)
{
    clo_fixture x;
    if (!clo_open(&x, 1.0))
        return;
    fixture f = x.f;
    int lens[] = {90, 40, 75}, B = 3, steps = 8; /* 40: dense until past sink + window */
    int32_t **prompts = make_prompts(&f, B, lens);
    size_t V = (size_t)f.m->config.vocab, n = (size_t)(steps + 1) * (size_t)B * V;
    rekv_pipeline_config ref_cfg;
    rekv_pipeline_config_defaults(&ref_cfg);
    run ref;
    do_run(&f, &ref_cfg, B, lens, prompts, steps, &ref);
    /* persist_np: every head's difficulty is 1 - (0.5 - 0.05) > 0, so N_p 2 makes the two lower
     * KV heads of each layer persistent (whole context on the device), 0 all of them */
    struct {
        int offload_w, gpu_batches, lookahead;
        rekv_schedule sched;
        double persist_np;
    } v[] = {{0, 1, 1, REKV_SCHED_ROW, INFINITY},
             {1, 2, 0, REKV_SCHED_COLUMN, INFINITY},
             {0, 3, 1, REKV_SCHED_ROW, INFINITY},
             {0, 2, 1, REKV_SCHED_ROW, 2},
             {1, 1, 0, REKV_SCHED_COLUMN, 0}};
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        rekv_pipeline_config cfg;
        clo_config(&x, &cfg);
        cfg.eta = 1;
        cfg.max_fraction = 1;
        cfg.offload_weights = v[i].offload_w;
        cfg.gpu_batches = v[i].gpu_batches;
        cfg.lookahead = v[i].lookahead;
        cfg.schedule = v[i].sched;
        cfg.persist_np = v[i].persist_np;
        run r;
        do_run(&f, &cfg, B, lens, prompts, steps, &r);
        double worst = 0;
        for (size_t k = 0; k < n; k++) {
            double d = fabs((double)r.logits[k] - (double)ref.logits[k]) /
                       (1.0 + fabs((double)ref.logits[k]));
            worst = d > worst ? d : worst;
        }
        ck_assert_msg(worst < 1e-5, "variant %zu: logits differ from resident's by %g", i, worst);
        uint64_t hits = 0, misses = 0;
        for (int l = 0; l < f.m->config.n_layers; l++) {
            hits += r.layers[l].head_hits;
            misses += r.layers[l].head_misses;
        }
        /* sequences 0 and 2 are sparse every decode step; 1 is never (40 + 8 <= 68); persistent
         * heads neither hit nor miss */
        uint64_t kvh = (uint64_t)f.m->config.n_kv_heads;
        uint64_t lossy = isinf(v[i].persist_np) ? kvh : (uint64_t)v[i].persist_np;
        ck_assert_uint_eq(hits, 0);
        ck_assert_uint_eq(misses,
                          2ull * (uint64_t)steps * (uint64_t)(f.m->config.n_layers - 1) * lossy);
        /* per KV head: the persistent ones (the lower ones, Eq. 13) decide nothing */
        for (int l = 0; l < f.m->config.n_layers; l++)
            for (uint64_t g = 0; g < kvh; g++) {
                size_t at = (size_t)l * (size_t)kvh + (size_t)g;
                ck_assert_uint_eq(r.head_hits[at], 0);
                ck_assert_uint_eq(r.head_misses[at],
                                  l > 0 && g >= kvh - lossy ? 2ull * (uint64_t)steps : 0);
            }
        /* every head persistent: each layer's context crossed once (sequence 1, dense, all of
         * it every step) */
        uint64_t once = (uint64_t)(lens[0] + lens[2]) + (uint64_t)(steps * lens[1]) +
                        (uint64_t)(steps * (steps - 1) / 2);
        if (v[i].persist_np == 0)
            for (int l = 1; l < f.m->config.n_layers; l++)
                ck_assert_uint_eq(r.layers[l].h2d_bytes[REKV_XFER_KV],
                                  once * kvh * 2 * (uint64_t)f.m->config.head_dim * sizeof(float));
        run_free(&r);
    }
    run_free(&ref);
    clo_close(&x, prompts, B);
}
END_TEST

/* every head hits once its cache is built: after the first decode step nothing is fetched */
START_TEST(clo_hits_move_nothing)
{
    clo_fixture x;
    if (!clo_open(&x, 0.0))
        return;
    fixture f = x.f;
    const rekv_model_config *c = &f.m->config;
    int lens[] = {100, 150}, B = 2, steps = 6;
    int32_t **prompts = make_prompts(&f, B, lens);
    rekv_pipeline_config cfg;
    clo_config(&x, &cfg);
    cfg.max_fraction = 0.1f;
    run r;
    do_run(&f, &cfg, B, lens, prompts, steps, &r);
    uint64_t row = (uint64_t)c->head_dim * sizeof(float), kvh = (uint64_t)c->n_kv_heads;
    uint64_t l0 = 0, rest = 0;
    for (int b = 0; b < B; b++) {
        l0 += (uint64_t)lens[b] * kvh * 2 * row; /* layer 0: the context once */
        int cap = lens[b] + steps, k = (int)lround(0.1 * lens[b]), kmax = (int)ceil(0.1 * cap);
        k = k > kmax ? kmax : k;
        /* per layer > 0: the sink, the window and the top-k of each KV head, once */
        rest += (uint64_t)(REKV_HEADS_SINK + REKV_HEADS_RECENT + k) * kvh * 2 * row;
    }
    ck_assert_uint_eq(r.layers[0].h2d_bytes[REKV_XFER_KV], l0);
    for (int l = 1; l < c->n_layers; l++) {
        ck_assert_uint_eq(r.layers[l].h2d_bytes[REKV_XFER_KV], rest);
        ck_assert_uint_eq(r.layers[l].head_misses, (uint64_t)B * kvh);
        ck_assert_uint_eq(r.layers[l].head_hits, (uint64_t)B * kvh * (uint64_t)(steps - 1));
        for (uint64_t g = 0; g < kvh; g++) { /* and each KV head alike */
            ck_assert_uint_eq(r.head_misses[(size_t)l * kvh + g], (uint64_t)B);
            ck_assert_uint_eq(r.head_hits[(size_t)l * kvh + g], (uint64_t)B * (steps - 1));
        }
        /* every new row still reaches the arena */
        ck_assert_uint_eq(r.layers[l].d2h_bytes[REKV_XFER_KV],
                          (uint64_t)B * (uint64_t)steps * kvh * 2 * row);
    }
    run_free(&r);
    clo_close(&x, prompts, B);
}
END_TEST

/* clo's decisions (similarity, a miss's top-k) of a unit's sequences run on the pool: one thread
 * or two, the same hits, misses and bits, over steps that both hit and miss. */
START_TEST(clo_any_threads)
{
    clo_fixture x;
    if (!clo_open(&x, 0.5))
        return;
    fixture f = x.f;
    const rekv_model_config *c = &f.m->config;
    int lens[] = {150, 90, 120}, B = 3, steps = 6;
    int32_t **prompts = make_prompts(&f, B, lens);
    rekv_pipeline_config cfg;
    clo_config(&x, &cfg);
    run r, r1;
    do_run(&f, &cfg, B, lens, prompts, steps, &r);
    cpu_gemm_set_threads(1);
    do_run(&f, &cfg, B, lens, prompts, steps, &r1);
    cpu_gemm_set_threads(0);
    uint64_t hits = 0, misses = 0;
    for (int l = 1; l < c->n_layers; l++) {
        ck_assert_uint_eq(r.layers[l].head_hits, r1.layers[l].head_hits);
        ck_assert_uint_eq(r.layers[l].head_misses, r1.layers[l].head_misses);
        ck_assert_uint_eq(r.layers[l].h2d_bytes[REKV_XFER_KV],
                          r1.layers[l].h2d_bytes[REKV_XFER_KV]);
        hits += r.layers[l].head_hits;
        misses += r.layers[l].head_misses;
    }
    ck_assert_msg(hits > 0 && misses > 0, "hits %llu, misses %llu: not both",
                  (unsigned long long)hits, (unsigned long long)misses);
    size_t n = (size_t)(steps + 1) * (size_t)B * (size_t)c->vocab;
    ck_assert_msg(memcmp(r.logits, r1.logits, n * sizeof(float)) == 0,
                  "one thread decided otherwise");
    run_free(&r);
    run_free(&r1);
    clo_close(&x, prompts, B);
}
END_TEST

/* CLO §4.4: the step thread never waits for the device within a clo step — the decisions run on
 * the h2d stream once the speculation reaches the host, and the copies of the rows they name
 * follow there — so a clo decode step blocks its caller exactly as often as an offload step (the
 * drain at its end), on every pipeline shape; infinigen's selection runs there the same way. */
START_TEST(clo_step_thread_never_waits)
{
    clo_fixture x;
    if (!clo_open(&x, 0.5))
        return;
    fixture f = x.f;
    const rekv_model_config *c = &f.m->config;
    int lens[] = {150, 90, 120}, B = 3, steps = 4;
    int32_t **prompts = make_prompts(&f, B, lens);
    struct {
        int gpu_batches, lookahead;
        rekv_schedule sched;
    } v[] = {{1, 1, REKV_SCHED_ROW}, {2, 0, REKV_SCHED_COLUMN}, {3, 1, REKV_SCHED_ROW}};
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        rekv_pipeline_config cfg;
        run off, ig, clo;
        clo_config(&x, &cfg);
        cfg.gpu_batches = v[i].gpu_batches;
        cfg.lookahead = v[i].lookahead;
        cfg.schedule = v[i].sched;
        do_run(&f, &cfg, B, lens, prompts, steps, &clo);
        cfg.mode = REKV_MODE_INFINIGEN;
        do_run(&f, &cfg, B, lens, prompts, steps, &ig);
        cfg.mode = REKV_MODE_OFFLOAD;
        do_run(&f, &cfg, B, lens, prompts, steps, &off);
        uint64_t hits = 0, misses = 0;
        for (int l = 1; l < c->n_layers; l++)
            hits += clo.layers[l].head_hits, misses += clo.layers[l].head_misses;
        ck_assert_msg(hits > 0 && misses > 0, "variant %zu: hits %llu, misses %llu", i,
                      (unsigned long long)hits, (unsigned long long)misses);
        ck_assert_msg(clo.host_syncs == off.host_syncs,
                      "variant %zu: a clo step blocked %llu times, offload's %llu", i,
                      (unsigned long long)clo.host_syncs, (unsigned long long)off.host_syncs);
        ck_assert_uint_eq(ig.host_syncs, off.host_syncs);
        run_free(&off);
        run_free(&ig);
        run_free(&clo);
    }
    clo_close(&x, prompts, B);
}
END_TEST

/* The step thread enqueues a whole clo or infinigen step before the device has run its loads (as
 * test_ipc shows for push): a backend whose streams each wait on a gate from their first
 * operation of the step, which only the step thread's first blocking call opens. That call is the
 * drain at the step's end, by when every selecting unit's decisions (clo_decide, ig_select) and
 * the listed copy of the rows they name are enqueued. (The cpu kernels reach the streams through
 * the cpu table itself, so a stream may run kernels before its first operation through this one:
 * the embedding, a speculation — never a unit's loads, which come through it, and its decisions
 * come after a wait for the speculation, which does too.) */
static struct {
    const rekv_backend_iface *real;
    int armed, gated, opened, decisions, at_open;
    rekv_stream *seen[8];
    int n_seen;
    const char *first_block; /* "stream_sync" or "event_sync" */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} g_gate = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void gate_wait(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_gate.mu);
    while (!g_gate.opened)
        pthread_cond_wait(&g_gate.cv, &g_gate.mu);
    pthread_mutex_unlock(&g_gate.mu);
}

static void gate_open_by(const char *call)
{
    pthread_mutex_lock(&g_gate.mu);
    if (g_gate.gated && !g_gate.opened) {
        g_gate.first_block = call;
        g_gate.at_open = g_gate.decisions;
        g_gate.opened = 1;
        pthread_cond_broadcast(&g_gate.cv);
    }
    pthread_mutex_unlock(&g_gate.mu);
}

/* s's first operation of the armed step: the gate first */
static void gate_stream(rekv_stream *s)
{
    if (!g_gate.armed || g_gate.opened)
        return;
    for (int i = 0; i < g_gate.n_seen; i++)
        if (g_gate.seen[i] == s)
            return;
    ck_assert_int_lt(g_gate.n_seen, 8);
    g_gate.seen[g_gate.n_seen++] = s;
    g_gate.gated = 1;
    g_gate.real->launch_host(s, "gate", gate_wait, NULL, 0);
}

static void gated_launch_host(rekv_stream *s, const char *name, rekv_host_fn fn, const void *arg,
                              size_t arg_bytes)
{
    gate_stream(s);
    g_gate.real->launch_host(s, name, fn, arg, arg_bytes);
}

static void gated_h2d(rekv_stream *s, const rekv_copy_piece *pc, size_t n, rekv_xfer_kind kind)
{
    gate_stream(s);
    g_gate.real->copy_h2d(s, pc, n, kind);
}

static void gated_d2h(rekv_stream *s, const rekv_copy_piece *pc, size_t n, rekv_xfer_kind kind)
{
    gate_stream(s);
    g_gate.real->copy_d2h(s, pc, n, kind);
}

static void gated_d2d(rekv_stream *s, const rekv_copy_piece *pc, size_t n)
{
    gate_stream(s);
    g_gate.real->copy_d2d(s, pc, n);
}

static void gated_listed(rekv_stream *s, const rekv_copy_piece *pc, const size_t *n, size_t max,
                         rekv_xfer_kind kind)
{
    gate_stream(s);
    if (g_gate.armed) /* a selecting unit's rows, after its decisions */
        g_gate.decisions++;
    g_gate.real->copy_h2d_listed(s, pc, n, max, kind);
}

static void gated_record(rekv_event *ev, rekv_stream *s)
{
    gate_stream(s);
    g_gate.real->event_record(ev, s);
}

static void gated_wait_event(rekv_stream *s, rekv_event *ev)
{
    gate_stream(s);
    g_gate.real->stream_wait_event(s, ev);
}

static int gated_stream_sync(rekv_stream *s, rekv_err *err)
{
    gate_open_by("stream_sync");
    return g_gate.real->stream_sync(s, err);
}

static int gated_streams_sync(rekv_stream *const *s, int n, rekv_err *err)
{
    gate_open_by("stream_sync");
    return g_gate.real->streams_sync(s, n, err);
}

static void gated_event_sync(rekv_event *ev)
{
    gate_open_by("event_sync");
    g_gate.real->event_sync(ev);
}

START_TEST(clo_step_enqueued_before_the_device_runs)
{
    clo_fixture x;
    if (!clo_open(&x, 0.5))
        return;
    fixture f = x.f;
    const rekv_model_config *c = &f.m->config;
    rekv_backend_iface bi = *f.be->iface;
    g_gate.real = f.be->iface;
    bi.launch_host = gated_launch_host;
    bi.copy_h2d = gated_h2d;
    bi.copy_d2h = gated_d2h;
    bi.copy_d2d = gated_d2d;
    bi.copy_h2d_listed = gated_listed;
    bi.event_record = gated_record;
    bi.stream_wait_event = gated_wait_event;
    bi.stream_sync = gated_stream_sync;
    bi.streams_sync = gated_streams_sync;
    bi.event_sync = gated_event_sync;
    f.be->iface = &bi;
    enum { B = 2, G = 2 };
    int lens[B] = {100, 150};
    int32_t **prompts = make_prompts(&f, B, lens);
    float *logits = malloc(sizeof(float) * B * (size_t)c->vocab);
    for (int mode = 0; mode < 2; mode++) {
        rekv_pipeline_config cfg;
        clo_config(&x, &cfg);
        cfg.mode = mode ? REKV_MODE_INFINIGEN : REKV_MODE_CLO;
        cfg.gpu_batches = G;
        rekv_pipeline *p = NULL;
        rekv_err err = {0};
        ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err) == 0, "%s", err.msg);
        rekv_pseq *seqs[B];
        rekv_pipe_item items[B];
        int32_t next[B] = {1, 2};
        prefill(p, c->vocab, B, lens, prompts, 4, seqs, items, logits);
        for (int s = 0; s < 2; s++) {
            decode_items(seqs, next, B, logits, c->vocab, items);
            g_gate.armed = s == 1, g_gate.gated = g_gate.opened = g_gate.decisions = 0;
            g_gate.n_seen = 0;
            g_gate.first_block = NULL;
            ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s", err.msg);
            g_gate.armed = 0;
        }
        ck_assert(g_gate.gated && g_gate.opened);
        ck_assert_str_eq(g_gate.first_block, "stream_sync");
        ck_assert_int_eq(g_gate.at_open, (c->n_layers - 1) * G);
        ck_assert_int_eq(g_gate.decisions, (c->n_layers - 1) * G);
        for (int i = 0; i < B; i++)
            rekv_pseq_free(seqs[i]);
        rekv_pipeline_free(p);
    }
    f.be->iface = g_gate.real;
    free(logits);
    clo_close(&x, prompts, B);
}
END_TEST

/* A killed kvstore does not hang a clo step's device-side waits (issue 13): a backend whose
 * listed copy (the rows the decisions name) first runs, on the same stream, a kill of the store
 * — so the rows' copies, the attention and later units' decisions run after the store is gone. They
 * need nothing from it (the arena stays mapped), so the step's device work completes — every head
 * decided, as in the step before — and the step then fails on the store's lost connection, with
 * a message; freeing the sequences and the pipeline returns. A hang fails the test by its
 * timeout. */
static pid_t g_kill_pid;
static const rekv_backend_iface *g_real_bi;

static void kill_store(void *arg)
{
    (void)arg;
    if (g_kill_pid > 0) {
        kill(g_kill_pid, SIGKILL);
        waitpid(g_kill_pid, NULL, 0);
        g_kill_pid = 0;
    }
}

static void listed_after_kill(rekv_stream *s, const rekv_copy_piece *pieces, const size_t *n,
                              size_t max, rekv_xfer_kind kind)
{
    if (g_kill_pid > 0)
        g_real_bi->launch_host(s, "kill the kvstore", kill_store, NULL, 0);
    g_real_bi->copy_h2d_listed(s, pieces, n, max, kind);
}

START_TEST(clo_store_killed_mid_step)
{
    clo_fixture x;
    if (!clo_open(&x, 0.5))
        return;
    fixture f = x.f;
    const rekv_model_config *c = &f.m->config;
    rekv_backend_iface bi = *f.be->iface;
    g_real_bi = f.be->iface;
    bi.copy_h2d_listed = listed_after_kill;
    f.be->iface = &bi;
    rekv_pipeline_config cfg;
    clo_config(&x, &cfg);
    rekv_pipeline *p = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err) == 0, "%s", err.msg);
    enum { B = 2 };
    int lens[B] = {100, 150};
    int32_t **prompts = make_prompts(&f, B, lens);
    rekv_pseq *seqs[B];
    rekv_pipe_item items[B];
    int32_t next[B] = {1, 2};
    float *logits = malloc(sizeof(float) * B * (size_t)c->vocab);
    prefill(p, c->vocab, B, lens, prompts, 8, seqs, items, logits);
    uint64_t decided[3] = {0, 0, 0};
    for (int s = 0; s < 3; s++) {
        decode_items(seqs, next, B, logits, c->vocab, items);
        rekv_pipeline_counters_reset(p);
        if (s == 2)
            g_kill_pid = f.store_pid;
        rekv_err_clear(&err);
        int rc = rekv_pipeline_step(p, items, B, &err);
        if (s < 2) {
            ck_assert_msg(rc == 0, "%s", err.msg);
        } else {
            ck_assert_msg(rc != 0 && strstr(err.msg, "kvstore") != NULL,
                          "the step after the store died: %d %s", rc, err.msg);
            ck_assert_int_eq(g_kill_pid, 0); /* the kill ran, inside the step */
        }
        rekv_layer_counters t;
        rekv_pipeline_counters(p, &t);
        decided[s] = t.head_hits + t.head_misses;
    }
    ck_assert_msg(decided[1] > 0 && decided[2] == decided[1],
                  "heads decided: %llu in a step, %llu with the store killed",
                  (unsigned long long)decided[1], (unsigned long long)decided[2]);
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
    f.be->iface = g_real_bi;
    free(logits);
    x.f.store_pid = 0; /* reaped by the kill: nothing to stop */
    clo_close(&x, prompts, B);
}
END_TEST

/* clo without a head profile, with one of another model, or with push: clear errors */
START_TEST(clo_bad_config_refused)
{
    clo_fixture x;
    if (!clo_open(&x, 0.5))
        return;
    fixture f = x.f;
    rekv_heads hp = x.hp;
    rekv_pipeline_config cfg;
    clo_config(&x, &cfg);
    cfg.heads = NULL;
    rekv_pipeline *p = NULL;
    rekv_err err = {0};
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "head profile") != NULL, "%s", err.msg);
    cfg.heads = &hp;
    hp.n_kv_heads++;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "not this model's") != NULL, "%s", err.msg);
    hp.n_kv_heads--;
    cfg.push = 1;
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_pipeline_create(f.e, f.be, f.store, &cfg, &p, &err), -ENOTSUP);
    clo_close(&x, NULL, 0);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("infinigen");
    TCase *tc = tcase_create("infinigen");
    tcase_set_timeout(tc, 900);
    tcase_add_test(tc, selection_matches_brute_force);
    tcase_add_test(tc, clo_decisions_match_brute_force);
    tcase_add_test(tc, bad_config_refused);
    tcase_add_test(tc, whole_step_past_the_arena_fails);
    tcase_add_test(tc, speculation_moves_less);
    tcase_add_test(tc, device_part_attended_whole);
    tcase_add_test(tc, recompute_within_selection);
    tcase_add_test(tc, exact_limit_stories260k);
    tcase_add_test(tc, exact_limit_synthetic);
    tcase_add_test(tc, clo_full_cache_matches_resident);
    tcase_add_test(tc, clo_hits_move_nothing);
    tcase_add_test(tc, clo_any_threads);
    tcase_add_test(tc, clo_step_thread_never_waits);
    tcase_add_test(tc, clo_step_enqueued_before_the_device_runs);
    tcase_add_test(tc, clo_store_killed_mid_step);
    tcase_add_test(tc, clo_bad_config_refused);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
