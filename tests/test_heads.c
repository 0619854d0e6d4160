/* test_heads.c — CLO's head profile (gpuworker/heads.h): the profile of stories260K on an eval
 * sample equals an independent float64 computation (tests/bench/stories_bounds.py --heads), the
 * equations' ends and shapes (Eq. 7–11), the JSON file's round trip and refusals, the cache, and
 * `rekv heads`. */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/planner.h"
#include "gpuworker/gpuworker.h"
#include "gpuworker/heads.h"
#include "loader/loader.h"
#include "tests/testutil.h"

#define STORIES_REL "models/stories260K/stories260K.bin"
#define SAMPLES_REL "eval/stories260K.samples.json"

typedef struct loaded {
    rekv_model *m;
    rekv_engine *e;
    char path[4096];
} loaded;

static int load(const char *rel, loaded *l)
{
    memset(l, 0, sizeof(*l));
    const char *p = tu_shared(rel);
    if (p == NULL)
        return 0;
    snprintf(l->path, sizeof(l->path), "%s", p);
    rekv_err err = {0};
    ck_assert_msg(rekv_model_open(l->path, &l->m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(l->m, &l->e, &err) == 0, "%s", err.msg);
    return 1;
}

static void unload(loaded *l)
{
    rekv_engine_free(l->e);
    rekv_model_close(l->m);
}

static int32_t *eval_ids(int *n)
{
    const char *sp = tu_shared(SAMPLES_REL);
    if (sp == NULL)
        return NULL;
    json_error_t je;
    json_t *all = json_load_file(sp, 0, &je);
    ck_assert_msg(all != NULL, "%s: %s", sp, je.text);
    json_t *ja = json_object_get(json_array_get(json_object_get(all, "samples"), 0), "ids");
    *n = (int)json_array_size(ja);
    ck_assert_int_gt(*n, 100);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)*n);
    for (int j = 0; j < *n; j++)
        ids[j] = (int32_t)json_integer_value(json_array_get(ja, (size_t)j));
    json_decref(all);
    return ids;
}

/* float64 numpy (tests/bench/stories_bounds.py --heads) on eval sample 0: per layer the mean
 * adjacent-query cosine, and layer 3's importances */
static const double want_cos[5] = {0.312040, 0.247651, 0.283811, 0.269468, 0.233825};
static const double want_imp3[8] = {0.8834, 1.0000, 0.9114, 0.9777, 0.9658, 0.7126, 0.8099, 0.7785};

START_TEST(profile_matches_float64)
{
    loaded L;
    int n = 0;
    int32_t *ids = eval_ids(&n);
    if (ids == NULL || !load(STORIES_REL, &L)) {
        free(ids);
        return;
    }
    rekv_heads h;
    rekv_err err = {0};
    ck_assert_msg(rekv_heads_profile(L.e, ids, n, &h, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(h.n_layers, 5);
    ck_assert_int_eq(h.n_heads, 8);
    ck_assert_int_eq(h.sample_tokens, n);
    double mx = 0;
    for (int l = 0; l < 5; l++) {
        double m = 0;
        for (int j = 0; j < 8; j++) {
            double imp = h.importance[l * 8 + j];
            ck_assert(imp >= 0 && imp <= 1);
            mx = imp > mx ? imp : mx;
            m += h.adjacent_cos[l * 8 + j] / 8;
        }
        ck_assert_msg(fabs(m - want_cos[l]) < 1e-4, "layer %d: adjacent cos %.6f, float64 %.6f", l,
                      m, want_cos[l]);
    }
    ck_assert(mx == 1.0); /* the most sensitive head is the unit */
    for (int j = 0; j < 8; j++)
        ck_assert_msg(fabs(h.importance[3 * 8 + j] - want_imp3[j]) < 1e-3,
                      "layer 3 head %d: importance %.4f, float64 %.4f", j, h.importance[24 + j],
                      want_imp3[j]);
    /* a sample no longer than sink + recent loses nothing by streaming: importance all 0 */
    rekv_heads s;
    ck_assert_msg(rekv_heads_profile(L.e, ids, REKV_HEADS_SINK + REKV_HEADS_RECENT, &s, &err) == 0,
                  "%s", err.msg);
    for (int i = 0; i < 40; i++)
        ck_assert(s.importance[i] == 0);
    rekv_heads_free(&s);
    ck_assert_int_eq(rekv_heads_profile(L.e, ids, 1, &s, &err), -EINVAL);
    int32_t bad[3] = {1, 100000, 2};
    rekv_err_clear(&err);
    ck_assert_int_eq(rekv_heads_profile(L.e, bad, 3, &s, &err), -EINVAL);
    ck_assert_msg(strstr(err.msg, "vocabulary") != NULL, "%s", err.msg);
    rekv_heads_free(&h);
    free(ids);
    unload(&L);
}
END_TEST

START_TEST(equations)
{
    /* Eq. 7-9: eta for the most important head, -1 (always reuse) for the least, monotone */
    ck_assert(fabs(rekv_heads_tau(1, 0.9, 2) - 0.9) < 1e-12);
    ck_assert(fabs(rekv_heads_tau(0, 0.9, 2) + 1) < 1e-12);
    double prev = -2;
    for (int i = 0; i <= 20; i++) {
        double t = rekv_heads_tau(i / 20.0, 0.95, 3);
        ck_assert(t > prev);
        prev = t;
    }
    /* a higher p lowers the threshold of a middling head (more reuse) */
    ck_assert(rekv_heads_tau(0.5, 0.9, 3) < rekv_heads_tau(0.5, 0.9, 2));
    /* Eq. 10: equal similarities stay; the least similar, most important head dominates */
    double imp[3] = {0.2, 0.9, 0.5}, eq[3] = {0.7, 0.7, 0.7}, sim[3] = {0.9, 0.3, 0.9};
    ck_assert(fabs(rekv_heads_aggregate(imp, eq, 3) - 0.7) < 1e-12);
    double s = rekv_heads_aggregate(imp, sim, 3);
    ck_assert(fabs(s - 1.6 / (0.2 / 0.9 + 0.9 / 0.3 + 0.5 / 0.9)) < 1e-12);
    double imp_low[3] = {0.9, 0.2, 0.5}; /* the dissimilar head made unimportant: higher */
    ck_assert(rekv_heads_aggregate(imp_low, sim, 3) > s);
    double zero[3] = {0, 0, 0}, neg[3] = {0.9, -0.1, 0.9};
    ck_assert(fabs(rekv_heads_aggregate(zero, sim, 3) - 3 / (1 / 0.9 + 1 / 0.3 + 1 / 0.9)) < 1e-12);
    ck_assert(rekv_heads_aggregate(imp, neg, 3) == -1);
    /* Eq. 11 on a hand-made profile: 1 layer, 4 heads in 2 groups */
    double pi[4] = {1.0, 0.5, 0.0, 0.0}, pc[4] = {0.6, 0.8, 0.2, 0.2};
    rekv_heads h = {1, 4, 2, 0, 0, pi, pc};
    double d0 = rekv_heads_difficulty(&h, 0, 0, 0.9, 2, 0.05);
    double agg = 1.5 / (1.0 / 0.6 + 0.5 / 0.8);
    ck_assert(fabs(d0 - (0.9 - (agg - 0.05))) < 1e-12);
    /* a group of unimportant heads always reuses: tau -1, never hard */
    ck_assert(rekv_heads_difficulty(&h, 0, 1, 0.9, 2, 0.05) < 0);
    /* Eq. 12-13: of 4 KV heads with D = 0.3, -0.5, 0.6, 0.1 (N_d 3), N_p 1.5 persists
     * ceil(3 - 1.5) = 2, the hardest (2, then 0); N_p >= N_d none; N_p 0 the three */
    double qi[4] = {1, 0, 1, 1},
           qc[4] = {0.9 - 0.3 + 0.05, 0.5, 0.9 - 0.6 + 0.05, 0.9 - 0.1 + 0.05};
    rekv_heads h4 = {1, 4, 4, 0, 0, qi, qc};
    uint8_t per[4];
    ck_assert_int_eq(rekv_heads_persistent(&h4, 0, 0.9, 2, 0.05, 1.5, per), 2);
    ck_assert(per[0] == 1 && per[1] == 0 && per[2] == 1 && per[3] == 0);
    ck_assert_int_eq(rekv_heads_persistent(&h4, 0, 0.9, 2, 0.05, 3, per), 0);
    ck_assert(per[0] + per[1] + per[2] + per[3] == 0);
    ck_assert_int_eq(rekv_heads_persistent(&h4, 0, 0.9, 2, 0.05, 0, per), 3);
    ck_assert(per[0] == 1 && per[1] == 0 && per[2] == 1 && per[3] == 1);
}
END_TEST

/* Eq. 12 (the planner's rekv_plan_persist_np) by hand: an OPT-like layer (hidden 64, 4 heads of
 * 16, ffn 256, relu) at batch 2 and 100 tokens: FLOPs 2·2·(2·64·64 + 2·64·64 + 2·64·256) +
 * 4·2·100·64 = 247,808; at 1 GFLOP/s that is 247.808 us, in which a 1 GB/s link moves 247,808
 * bytes; a head's top-k (fetch cap 0.2: 20 tokens, K and V of 16 fp16 values, two sequences) is
 * 2,560 bytes: N_p = 96.8. A slower link or a faster forward pass leaves fewer heads to the link;
 * no link measured: no limit. */
START_TEST(np_from_the_link)
{
    rekv_model_config c = {0};
    c.act = REKV_ACT_RELU;
    c.hidden = 64;
    c.n_heads = c.n_kv_heads = 4;
    c.head_dim = 16;
    c.ffn = 256;
    rekv_cost_profile prof = {0};
    prof.h2d_bw = 1e9;
    prof.fwd_flops_rate = 1e9;
    rekv_plan_model m;
    rekv_plan_model_from_config(&c, &m);
    double np = rekv_plan_persist_np(&prof, &m, c.head_dim, 2, 100, 0.2, 2);
    ck_assert_msg(fabs(np - 247808.0 / 2560.0) < 1e-9, "N_p %g", np);
    prof.h2d_bw = 1e8;
    ck_assert(fabs(rekv_plan_persist_np(&prof, &m, c.head_dim, 2, 100, 0.2, 2) - np / 10) < 1e-9);
    prof.h2d_bw = 1e9;
    prof.fwd_flops_rate = 0;
    prof.gemm_flops = 2e9; /* unmeasured forward rate: the GEMM rate */
    ck_assert(fabs(rekv_plan_persist_np(&prof, &m, c.head_dim, 2, 100, 0.2, 2) - np / 2) < 1e-9);
    prof.h2d_bw = 0;
    ck_assert(isinf(rekv_plan_persist_np(&prof, &m, c.head_dim, 2, 100, 0.2, 2)));
}
END_TEST

START_TEST(file_round_trip_and_refusals)
{
    loaded L;
    if (!load(STORIES_REL, &L))
        return;
    char *dir = tu_tmpdir(), path[4300], bad[4300];
    snprintf(path, sizeof(path), "%s/sub/heads.json", dir);
    snprintf(bad, sizeof(bad), "%s/bad.json", dir);
    rekv_err err = {0};
    int32_t ids[120];
    for (int i = 0; i < 120; i++)
        ids[i] = (int32_t)(1 + (i * 37) % 500);
    rekv_heads h, r;
    ck_assert_msg(rekv_heads_profile(L.e, ids, 120, &h, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_heads_save(&h, path, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_heads_load(path, L.e, &r, &err) == 0, "%s", err.msg);
    ck_assert(r.fingerprint == h.fingerprint);
    ck_assert_int_eq(r.sample_tokens, 120);
    for (int i = 0; i < 40; i++) {
        ck_assert(fabs(r.importance[i] - h.importance[i]) < 1e-8);
        ck_assert(fabs(r.adjacent_cos[i] - h.adjacent_cos[i]) < 1e-8);
    }
    rekv_heads_free(&r);
    /* another model's profile (the fingerprint), a wrong shape, a value out of range, not JSON */
    char *text = tu_read_file(path, NULL);
    ck_assert_ptr_nonnull(text);
    const char *cases[][2] = {{"\"fingerprint\": \"", "another model"},
                              {"\"layers\": 5", "layers"},
                              {NULL, "range"},
                              {"{", "not a head profile"}};
    for (int c = 0; c < 4; c++) {
        char *t = strdup(text);
        if (c == 0) {
            char *p = strstr(t, cases[0][0]) + strlen(cases[0][0]);
            *p = *p == '0' ? '1' : '0';
        } else if (c == 1) {
            char *p = strstr(t, "\"layers\": 5");
            ck_assert_ptr_nonnull(p);
            p[10] = '4';
        } else if (c == 2) {
            char *p = strstr(t, "\"importance\"");
            p = strpbrk(strchr(strchr(p, '[') + 1, '['), "0123456789"); /* the first value */
            *p = '7';
        } else {
            t[strlen(t) / 2] = '\0';
        }
        FILE *f = fopen(bad, "w");
        fputs(t, f);
        fclose(f);
        rekv_err_clear(&err);
        ck_assert_int_eq(rekv_heads_load(bad, L.e, &r, &err), -EINVAL);
        ck_assert_msg(strstr(err.msg, cases[c][1]) != NULL, "case %d: %s", c, err.msg);
        free(t);
    }
    free(text);
    rekv_heads_free(&h);
    tu_rmrf(dir);
    free(dir);
    unload(&L);
}
END_TEST

START_TEST(prepare_caches_and_cli)
{
    loaded L;
    if (!load(STORIES_REL, &L))
        return;
    char *dir = tu_tmpdir(), cmd[8192];
    setenv("XDG_CACHE_HOME", dir, 1);
    rekv_err err = {0};
    rekv_heads a, b;
    int cached = -1;
    ck_assert_msg(rekv_heads_prepare(L.e, &a, &cached, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(cached, 0);
    ck_assert_msg(rekv_heads_prepare(L.e, &b, &cached, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(cached, 1);
    for (int i = 0; i < 40; i++)
        ck_assert(fabs(a.importance[i] - b.importance[i]) < 1e-8);
    /* the CLI reads the same cache */
    char *out = NULL;
    snprintf(cmd, sizeof(cmd), "XDG_CACHE_HOME='%s' %s heads --model '%s' --json", dir,
             tu_bin("rekv"), L.path);
    ck_assert_int_eq(tu_run(cmd, &out), 0);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    ck_assert_msg(o != NULL, "%s: %s", je.text, out);
    ck_assert(json_is_true(json_object_get(o, "from_cache")));
    json_t *l3 = json_array_get(json_object_get(o, "layers"), 3);
    ck_assert_int_eq(json_array_size(json_object_get(l3, "kv_difficulty")), 4);
    double imp = json_real_value(
        json_object_get(json_array_get(json_object_get(l3, "heads"), 1), "importance"));
    ck_assert(fabs(imp - a.importance[3 * 8 + 1]) < 1e-6);
    json_decref(o);
    free(out);
    snprintf(cmd, sizeof(cmd), "%s heads --model '%s' --eta 2 2>/dev/null", tu_bin("rekv"), L.path);
    ck_assert_int_eq(tu_run(cmd, &out), 2); /* eta outside [-1, 1] */
    free(out);
    rekv_heads_free(&a);
    rekv_heads_free(&b);
    unsetenv("XDG_CACHE_HOME");
    tu_rmrf(dir);
    free(dir);
    unload(&L);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("heads");
    TCase *tc = tcase_create("heads");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, profile_matches_float64);
    tcase_add_test(tc, equations);
    tcase_add_test(tc, np_from_the_link);
    tcase_add_test(tc, file_round_trip_and_refusals);
    tcase_add_test(tc, prepare_caches_and_cli);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
