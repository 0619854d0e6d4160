/* test_forward.c — the reference forward pass against independent implementations (llama2.c's
 * run.c for stories260K, an fp32 torch forward for the HF tiny models), and its self-consistency:
 * whole-prompt prefill vs token-by-token decode, and batches vs single sequences. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/engine_internal.h"
#include "gpuworker/gpuworker.h"
#include "loader/loader.h"
#include "tests/testutil.h"

/* Runs every case of a reference file: greedy ids must match exactly; each reference top-5 entry's
 * logit must be within tol of ours for the same token id. */
static void check_reference(const char *model_rel, const char *ref_rel, double tol)
{
    const char *p = tu_shared(ref_rel);
    if (p == NULL)
        return;
    json_error_t jerr;
    json_t *ref = json_load_file(p, 0, &jerr);
    ck_assert_msg(ref != NULL, "%s: %s", p, jerr.text);
    const char *mp = tu_shared(model_rel);
    if (mp == NULL) {
        json_decref(ref);
        return;
    }
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(mp, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    json_t *cases = json_object_get(ref, "cases");
    double max_err = 0;
    size_t ci;
    json_t *cs;
    json_array_foreach(cases, ci, cs)
    {
        json_t *jp = json_object_get(cs, "prompt"), *jg = json_object_get(cs, "greedy");
        json_t *jt = json_object_get(cs, "top5");
        int np = (int)json_array_size(jp), ng = (int)json_array_size(jg);
        int32_t *prompt = malloc(sizeof(int32_t) * (size_t)np);
        for (int i = 0; i < np; i++)
            prompt[i] = (int32_t)json_integer_value(json_array_get(jp, (size_t)i));
        rekv_gen_params gp = {ng, 0, 0, 1, 0, 5, 0, 0, 0};
        rekv_gen_result r;
        ck_assert_msg(rekv_generate(e, prompt, np, &gp, &r, &err) == 0, "%s", err.msg);
        ck_assert_int_eq(r.n, ng);
        for (int i = 0; i < ng; i++) {
            int want = (int)json_integer_value(json_array_get(jg, (size_t)i));
            ck_assert_msg(r.ids[i] == want, "%s case %zu (prompt %d): step %d: got %d, want %d",
                          model_rel, ci, np, i, r.ids[i], want);
            json_t *step = json_array_get(jt, (size_t)i);
            for (size_t j = 0; j < json_array_size(step); j++) {
                json_t *pair = json_array_get(step, j);
                int id = (int)json_integer_value(json_array_get(pair, 0));
                double want_v = json_number_value(json_array_get(pair, 1));
                int found = 0;
                for (int k = 0; k < 5; k++)
                    if (r.top_ids[i * 5 + k] == id) {
                        double d = fabs(r.top_vals[i * 5 + k] - want_v);
                        if (d > max_err)
                            max_err = d;
                        ck_assert_msg(d <= tol, "%s case %zu step %d token %d: logit %f, want %f",
                                      model_rel, ci, i, id, r.top_vals[i * 5 + k], want_v);
                        found = 1;
                    }
                ck_assert_msg(found, "%s case %zu step %d: reference top-5 token %d not in ours",
                              model_rel, ci, i, id);
            }
        }
        rekv_gen_result_free(&r);
        free(prompt);
    }
    printf("   %s: %zu cases, max |logit error| %.3g (bound %.0e)\n", model_rel,
           json_array_size(cases), max_err, tol);
    rekv_engine_free(e);
    rekv_model_close(m);
    json_decref(ref);
}

/* The issue asks for 1e-4; the references' notes expect up to ~2e-4 from summation order and
 * suggest 1e-3. We meet 1e-4 (measured: 6e-5 stories260K, 7e-6 the HF models), so hold to it. */
START_TEST(reference_stories260k)
{
    check_reference("models/stories260K/stories260K.bin", "reference/stories260K.reference.json",
                    1e-4);
}
END_TEST

START_TEST(reference_opt_tiny)
{
    check_reference("models/opt-tiny-py", "reference/opt-tiny-py.reference.json", 1e-4);
}
END_TEST

START_TEST(reference_llama_tiny)
{
    check_reference("models/llama-tiny-py", "reference/llama-tiny-py.reference.json", 1e-4);
}
END_TEST

/* Largest difference, relative to the logits' scale: |a - b| / max(1, max |a|). The issue asks for
 * 1e-5; the engine does better: every GEMM is row-invariant, so a token's logits do not depend on
 * how it was batched and the tests demand equality (tolerance 0). */
static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double m = 0, scale = 1;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > m || isnan(d))
            m = isnan(d) ? INFINITY : d;
        if (fabs(a[i]) > scale)
            scale = fabs(a[i]);
    }
    return m / scale;
}

static int32_t *random_ids(int n, int vocab, uint64_t seed)
{
    int32_t *t = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = (int32_t)((seed >> 33) % (uint64_t)vocab);
    }
    return t;
}

/* Whole-prompt prefill (all logits) vs feeding the same tokens one at a time: identical bits. */
static void check_prefill_vs_decode(const char *path, int len, double tol)
{
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    int V = m->config.vocab;
    if (len > m->config.max_pos)
        len = m->config.max_pos;
    int32_t *t = random_ids(len, V, (uint64_t)len);
    float *all = malloc(sizeof(float) * (size_t)len * V), *one = malloc(sizeof(float) * V);
    rekv_seq *a, *b;
    ck_assert_int_eq(rekv_seq_create(e, len, &a, &err), 0);
    ck_assert_int_eq(rekv_seq_create(e, len, &b, &err), 0);
    rekv_batch_item it = {a, t, len, 1, all};
    ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
    double worst = 0;
    for (int i = 0; i < len; i++) {
        it = (rekv_batch_item){b, t + i, 1, 0, one};
        ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
        double d = max_abs_diff(all + (size_t)i * V, one, (size_t)V);
        worst = d > worst ? d : worst;
    }
    ck_assert_msg(worst <= tol, "%s: prefill vs decode differ by %g over %d tokens", path, worst,
                  len);
    rekv_seq_free(a);
    rekv_seq_free(b);
    free(all);
    free(one);
    free(t);
    rekv_engine_free(e);
    rekv_model_close(m);
}

/* A batch of sequences of different lengths, prefilled together and then decoded together, gives
 * each sequence's logits as when it runs alone. */
static void check_batch_vs_single(const char *path, int n_seq, double tol)
{
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    int V = m->config.vocab, steps = 3;
    rekv_seq **bs = calloc((size_t)n_seq, sizeof(*bs));
    rekv_batch_item *items = calloc((size_t)n_seq, sizeof(*items));
    int32_t **toks = calloc((size_t)n_seq, sizeof(*toks));
    int *lens = calloc((size_t)n_seq, sizeof(int));
    float *lb = malloc(sizeof(float) * (size_t)n_seq * V), *ls = malloc(sizeof(float) * V);
    for (int s = 0; s < n_seq; s++) {
        lens[s] = 1 + (s * 37 + 5) % 61;
        if (lens[s] + steps > m->config.max_pos)
            lens[s] = m->config.max_pos - steps;
        toks[s] = random_ids(lens[s] + steps, V, 99 + (uint64_t)s);
        ck_assert_int_eq(rekv_seq_create(e, lens[s] + steps, &bs[s], &err), 0);
    }
    for (int step = 0; step <= steps; step++) {
        for (int s = 0; s < n_seq; s++)
            items[s] = step == 0 ? (rekv_batch_item){bs[s], toks[s], lens[s], 0, lb + (size_t)s * V}
                                 : (rekv_batch_item){bs[s], toks[s] + lens[s] + step - 1, 1, 0,
                                                     lb + (size_t)s * V};
        ck_assert_msg(rekv_engine_forward(e, items, n_seq, &err) == 0, "%s", err.msg);
        for (int s = 0; s < n_seq; s++) {
            /* the same sequence alone, from scratch, to the same point */
            rekv_seq *one;
            ck_assert_int_eq(rekv_seq_create(e, lens[s] + steps, &one, &err), 0);
            rekv_batch_item it = {one, toks[s], lens[s] + step, 0, ls};
            ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
            double d = max_abs_diff(lb + (size_t)s * V, ls, (size_t)V);
            ck_assert_msg(d <= tol, "%s: seq %d (len %d) step %d: batch vs alone differ by %g",
                          path, s, lens[s], step, d);
            rekv_seq_free(one);
        }
    }
    for (int s = 0; s < n_seq; s++) {
        rekv_seq_free(bs[s]);
        free(toks[s]);
    }
    free(bs), free(items), free(toks), free(lens), free(lb), free(ls);
    rekv_engine_free(e);
    rekv_model_close(m);
}

START_TEST(consistency_shared_models)
{
    const char *models[] = {"models/stories260K/stories260K.bin", "models/opt-tiny-py",
                            "models/llama-tiny-py"};
    for (int i = 0; i < 3; i++) {
        const char *path = tu_shared(models[i]);
        if (path == NULL)
            continue;
        check_prefill_vs_decode(path, 100, 0);
        check_batch_vs_single(path, 5, 0);
    }
}
END_TEST

/* Synthetic OPT and Llama models of several shapes: GQA and not, tied and untied heads, fp16,
 * bf16 and fp32 storage, head_dim 8 to 64. */
START_TEST(consistency_synthetic_models)
{
    static const rekv_synth_spec specs[] = {
        /* arch, layers, hidden, heads, kv_heads, ffn, vocab, max_pos, dtype, seed, tied */
        {REKV_ARCH_OPT, 2, 64, 4, 4, 256, 300, 256, REKV_DTYPE_F16, 1, 1},
        {REKV_ARCH_OPT, 3, 96, 12, 12, 200, 517, 128, REKV_DTYPE_F32, 2, 0},
        {REKV_ARCH_OPT, 1, 256, 4, 4, 512, 1000, 200, REKV_DTYPE_BF16, 3, 1},
        {REKV_ARCH_LLAMA, 2, 64, 8, 2, 160, 300, 256, REKV_DTYPE_BF16, 4, 0},
        {REKV_ARCH_LLAMA, 3, 128, 4, 4, 344, 777, 128, REKV_DTYPE_F16, 5, 1},
        {REKV_ARCH_LLAMA, 2, 192, 6, 1, 512, 640, 160, REKV_DTYPE_F32, 6, 0},
    };
    char *dir = tu_tmpdir();
    for (size_t i = 0; i < sizeof(specs) / sizeof(specs[0]); i++) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/m%zu", dir, i);
        rekv_err err = {0};
        ck_assert_msg(rekv_synth_write(&specs[i], path, &err) == 0, "%s", err.msg);
        check_prefill_vs_decode(path, 100, 0);
        check_batch_vs_single(path, 6, 0);
    }
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* A batch longer than a pass holds (forward.c's FWD_ROWS, 512 rows) runs as passes that cut
 * through its prompts: the scratch stays at one pass's rows, and every item's logits are those of
 * the same prompt run alone in one pass, bit for bit (an all_logits item's every row too). */
START_TEST(long_batches_run_in_passes)
{
    static const rekv_synth_spec spec = {REKV_ARCH_LLAMA, 2, 64, 4, 2, 160, 300, 1024,
                                         REKV_DTYPE_F16, 7, 0};
    char *dir = tu_tmpdir(), path[4200];
    snprintf(path, sizeof(path), "%s/m", dir);
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_synth_write(&spec, path, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_model_open(path, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    int V = m->config.vocab, lens[] = {300, 450, 500, 7}, all[] = {0, 1, 0, 0}, n = 4;
    rekv_seq *seqs[4];
    rekv_batch_item items[4];
    int32_t *toks[4];
    float *lg[4];
    for (int s = 0; s < n; s++) {
        toks[s] = random_ids(lens[s], V, 40 + (uint64_t)s);
        lg[s] = malloc(sizeof(float) * (size_t)(all[s] ? lens[s] : 1) * (size_t)V);
        ck_assert_int_eq(rekv_seq_create(e, lens[s], &seqs[s], &err), 0);
        items[s] = (rekv_batch_item){seqs[s], toks[s], lens[s], all[s], lg[s]};
    }
    ck_assert_msg(rekv_engine_forward(e, items, n, &err) == 0, "%s", err.msg);
    ck_assert_msg(e->cap_rows <= 512, "the scratch holds %zu rows for a batch of 1257", e->cap_rows);
    for (int s = 0; s < n; s++) {
        ck_assert_int_eq(rekv_seq_len(seqs[s]), lens[s]);
        size_t nl = (size_t)(all[s] ? lens[s] : 1) * (size_t)V;
        float *one = malloc(sizeof(float) * nl);
        rekv_seq *alone;
        ck_assert_int_eq(rekv_seq_create(e, lens[s], &alone, &err), 0);
        rekv_batch_item it = {alone, toks[s], lens[s], all[s], one};
        ck_assert_msg(rekv_engine_forward(e, &it, 1, &err) == 0, "%s", err.msg);
        ck_assert_msg(memcmp(one, lg[s], sizeof(float) * nl) == 0,
                      "item %d (%d tokens): batched in passes vs alone differ", s, lens[s]);
        rekv_seq_free(alone);
        free(one);
        rekv_seq_free(seqs[s]);
        free(toks[s]);
        free(lg[s]);
    }
    rekv_engine_free(e);
    rekv_model_close(m);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* Bad input: out-of-range ids and contexts are refused without touching the cache. */
START_TEST(forward_rejects_bad_batches)
{
    const char *p = tu_shared("models/stories260K/stories260K.bin");
    if (p == NULL)
        return;
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_int_eq(rekv_model_open(p, &m, &err), 0);
    ck_assert_int_eq(rekv_engine_create(m, &e, &err), 0);
    rekv_seq *s;
    float *lg = malloc(sizeof(float) * (size_t)m->config.vocab);
    ck_assert_int_eq(rekv_seq_create(e, 4, &s, &err), 0);
    int32_t bad[] = {1, 5000};
    rekv_batch_item it = {s, bad, 2, 0, lg};
    ck_assert_int_lt(rekv_engine_forward(e, &it, 1, &err), 0);
    ck_assert_ptr_nonnull(strstr(err.msg, "vocabulary"));
    ck_assert_int_eq(rekv_seq_len(s), 0);
    int32_t five[] = {1, 2, 3, 4, 5};
    rekv_err_clear(&err);
    it = (rekv_batch_item){s, five, 5, 0, lg};
    ck_assert_int_eq(rekv_engine_forward(e, &it, 1, &err), -E2BIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "longer than the context"));
    rekv_err_clear(&err);
    int32_t *longp = random_ids(600, 512, 1);
    rekv_gen_params gp = {4, 0, 0, 1, 0, 0, 0, 0, 0};
    rekv_gen_result r;
    ck_assert_int_eq(rekv_generate(e, longp, 600, &gp, &r, &err), -E2BIG);
    ck_assert_ptr_nonnull(strstr(err.msg, "longer than the model's context"));
    free(longp);
    free(lg);
    rekv_seq_free(s);
    rekv_engine_free(e);
    rekv_model_close(m);
}
END_TEST

/* Sampling: greedy is argmax; a seed reproduces; top-k 1 is greedy; top-p keeps the nucleus. */
START_TEST(sampling)
{
    float logits[6] = {0.1f, 2.0f, 1.9f, -1.0f, 2.0f, 0.0f};
    char scratch[6 * 8];
    rekv_sampler s;
    rekv_sampler_init(&s, 0, 0, 1, 1);
    ck_assert_int_eq(rekv_sample(&s, logits, 6, scratch), 1); /* lowest id among ties */
    rekv_sampler_init(&s, 1.0f, 1, 1, 7);
    for (int i = 0; i < 50; i++)
        ck_assert_int_eq(rekv_sample(&s, logits, 6, scratch), 1);
    int counts[6] = {0};
    rekv_sampler_init(&s, 1.0f, 0, 0.5f, 3); /* nucleus: {1, 4} hold 0.5+ of the mass */
    for (int i = 0; i < 2000; i++)
        counts[rekv_sample(&s, logits, 6, scratch)]++;
    ck_assert_int_eq(counts[0] + counts[2] + counts[3] + counts[5], 0);
    ck_assert_int_gt(counts[1], 800);
    ck_assert_int_gt(counts[4], 800);
    rekv_sampler a, b;
    rekv_sampler_init(&a, 0.8f, 0, 1, 42);
    rekv_sampler_init(&b, 0.8f, 0, 1, 42);
    for (int i = 0; i < 100; i++)
        ck_assert_int_eq(rekv_sample(&a, logits, 6, scratch), rekv_sample(&b, logits, 6, scratch));
    int32_t ids[3];
    float vals[3];
    rekv_top_logits(logits, 6, 3, ids, vals);
    ck_assert_int_eq(ids[0], 1);
    ck_assert_int_eq(ids[1], 4);
    ck_assert_int_eq(ids[2], 2);
}
END_TEST

/* rekv_sample_drawn against its definition written plainly (gpuworker.h): ranked by logit, lower
 * id first; the first top_k; the shortest prefix holding top_p of their weight (the prefix summed
 * in rank order, the total in id order); the kept tokens walked in id order to u times their sum.
 * Logits with many ties, every top-k from 0 to past the vocabulary. */
static const float *g_rank_lg;
static int by_rank(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    if (g_rank_lg[x] != g_rank_lg[y])
        return g_rank_lg[x] > g_rank_lg[y] ? -1 : 1;
    return (x > y) - (x < y);
}

static int by_id(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static int32_t plain_draw(float t, int k, float p, float u, const float *lg, int V)
{
    int *order = malloc(sizeof(int) * V);
    double *w = malloc(sizeof(double) * V);
    for (int i = 0; i < V; i++)
        order[i] = i;
    g_rank_lg = lg;
    qsort(order, (size_t)V, sizeof(int), by_rank);
    if (t <= 0) {
        int32_t best = order[0];
        free(order), free(w);
        return best;
    }
    int n = k > 0 && k < V ? k : V;
    double sum = 0;
    for (int i = 0; i < n; i++)
        w[order[i]] = expf((lg[order[i]] - lg[order[0]]) / t);
    for (int i = 0; i < V; i++) /* the total in id order */
        for (int j = 0; j < n; j++)
            if (order[j] == i)
                sum += w[i];
    if (p > 0 && p < 1) {
        double cum = 0;
        for (int i = 0; i < n; i++)
            if ((cum += w[order[i]]) >= (double)p * sum) {
                n = i + 1;
                break;
            }
    }
    qsort(order, (size_t)n, sizeof(int), by_id);
    sum = 0;
    for (int i = 0; i < n; i++)
        sum += w[order[i]];
    double acc = 0, r = (double)u * sum;
    int32_t pick = order[n - 1];
    for (int i = 0; i < n; i++)
        if (r < (acc += w[order[i]])) {
            pick = order[i];
            break;
        }
    free(order), free(w);
    return pick;
}

START_TEST(sampling_follows_definition)
{
    const int vocabs[] = {1, 2, 7, 300, 5000};
    const float temps[] = {0, 0.7f, 1.3f}, tops_p[] = {1, 0.5f, 0.9f, 0.99f};
    const float us[] = {0, 0.3f, 0.999999f};
    uint64_t x = 99;
    int checked = 0;
    for (int vi = 0; vi < 5; vi++) {
        int V = vocabs[vi];
        float *lg = malloc(sizeof(float) * V);
        void *scratch = malloc(8 * (size_t)V);
        for (int i = 0; i < V; i++) { /* quantized: many ties */
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            lg[i] = (float)((int)((x >> 33) % 64) - 32) * 0.25f;
        }
        const int ks[] = {0, 1, 3, 40, V - 1, V, V + 3};
        for (int ki = 0; ki < 7; ki++)
            for (int ti = 0; ti < 3; ti++)
                for (int pi = 0; pi < 4; pi++)
                    for (int ui = 0; ui < 3; ui++) {
                        rekv_sampler s = {temps[ti], ks[ki], tops_p[pi], 0};
                        int32_t got = rekv_sample_drawn(&s, us[ui], lg, V, scratch);
                        int32_t want = plain_draw(temps[ti], ks[ki], tops_p[pi], us[ui], lg, V);
                        ck_assert_msg(got == want, "V %d T %g k %d p %g u %g: %d, not %d", V,
                                      (double)temps[ti], ks[ki], (double)tops_p[pi], (double)us[ui],
                                      got, want);
                        checked++;
                    }
        free(lg);
        free(scratch);
    }
    ck_assert_int_eq(checked, 5 * 7 * 3 * 4 * 3);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("forward");
    TCase *tc = tcase_create("forward");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, reference_stories260k);
    tcase_add_test(tc, reference_opt_tiny);
    tcase_add_test(tc, reference_llama_tiny);
    tcase_add_test(tc, consistency_shared_models);
    tcase_add_test(tc, consistency_synthetic_models);
    tcase_add_test(tc, forward_rejects_bad_batches);
    tcase_add_test(tc, long_batches_run_in_passes);
    tcase_add_test(tc, sampling);
    tcase_add_test(tc, sampling_follows_definition);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
