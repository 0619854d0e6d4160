/* test_modes.c — the modes' two tables are complete and agree: every rekv_mode has its properties
 * (common/mode.c, rekv_mode_info_of) and its entry in the pipeline's mode table
 * (gpuworker/mode_*.c, pl_mode_ops_of), its name round-trips, the functions an entry has are the
 * ones its properties call for (a mode that streams plans its units, one that speculates says which
 * items are sparse, one with a split or ACT blocks says which rows it recomputes, ...), the planner
 * prices every mode, and anything that is not a mode has neither and is refused. A new mode that
 * misses a row fails here before any step runs. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/mode.h"
#include "coordinator/planner.h"
#include "gpuworker/pipeline_internal.h"
#include "tests/fixture.h"
#include "tests/testutil.h"

START_TEST(every_mode_has_both_entries)
{
    for (int m = 0; m < REKV_MODE_COUNT; m++) {
        const rekv_mode_info *mi = rekv_mode_info_of((rekv_mode)m);
        ck_assert_msg(mi != NULL, "mode %d has no properties (common/mode.c)", m);
        ck_assert_msg(mi->name && mi->name[0] && strcmp(mi->name, "?") != 0, "mode %d: no name", m);
        rekv_mode back = (rekv_mode)-1;
        ck_assert_msg(rekv_mode_parse(mi->name, &back) == 0 && back == (rekv_mode)m,
                      "mode %d (%s) does not parse back to itself", m, mi->name);
        ck_assert_str_eq(rekv_mode_name((rekv_mode)m), mi->name);
        const pl_mode_ops *ops = pl_mode_ops_of((rekv_mode)m);
        ck_assert_msg(ops != NULL, "mode %s has no entry in the pipeline's mode table", mi->name);
        ck_assert_msg(ops->mode == (rekv_mode)m, "mode %s's table entry is mode %d's", mi->name,
                      (int)ops->mode);
    }
}
END_TEST

START_TEST(entries_match_properties)
{
    for (int m = 0; m < REKV_MODE_COUNT; m++) {
        const rekv_mode_info *mi = rekv_mode_info_of((rekv_mode)m);
        const pl_mode_ops *o = pl_mode_ops_of((rekv_mode)m);
        ck_assert_msg(mi && o, "mode %d: an entry is missing (every_mode_has_both_entries)", m);
        const char *n = mi->name;
        int streams = mi->store != REKV_STORE_NONE;
        ck_assert_msg(rekv_mode_streams((rekv_mode)m) == streams, "%s: streams", n);
        ck_assert_msg(rekv_mode_approximate((rekv_mode)m) == mi->approximate, "%s: approximate", n);
        /* the step plans the units of a mode that streams, and only those */
        ck_assert_msg((o->unit_plan != NULL) == streams, "%s: a unit plan iff it streams", n);
        /* a mode whose cache stays on the device allocates it */
        ck_assert_msg(streams || o->seq_alloc != NULL, "%s: keeps its cache nowhere", n);
        /* the speculation: its step memory, its state, and which items fetch sparsely */
        ck_assert_msg((o->sparse != NULL) == mi->speculates, "%s: sparse iff it speculates", n);
        ck_assert_msg(!mi->speculates || (o->step_prepare && o->create && o->seq_alloc),
                      "%s: speculates without its memory", n);
        /* rows rebuilt from activations: a split, ACT blocks or a KV:ACT pattern */
        int recomputes = mi->split != REKV_SPLIT_NONE || mi->store == REKV_STORE_ACT ||
                         mi->store == REKV_STORE_PATTERN;
        ck_assert_msg((o->recompute_rows != NULL) == recomputes,
                      "%s: says which rows it recomputes iff it recomputes", n);
        /* what is made is freed */
        ck_assert_msg((o->create != NULL) == (o->free != NULL), "%s: create/free", n);
        ck_assert_msg((o->seq_alloc != NULL) == (o->seq_free != NULL), "%s: seq_alloc/free", n);
        /* properties that only a streaming, exact mode can have */
        ck_assert_msg(!mi->act_gpu || (streams && !mi->approximate && recomputes), "%s: ACT_GPU",
                      n);
        ck_assert_msg(!mi->device_part || streams, "%s: a device part beside nothing", n);
        ck_assert_msg(!mi->layer_windows || (streams && !mi->approximate), "%s: windows", n);
        /* head caches are chosen by the speculation, with its step memory */
        ck_assert_msg(!mi->head_caches || (mi->speculates && o->step_done),
                      "%s: head caches without the speculation", n);
        /* activations beside K,V: always with a prefix split, with a selection's only when > 0 */
        ck_assert_msg(rekv_mode_keeps_act((rekv_mode)m, 0) == (mi->split == REKV_SPLIT_PREFIX),
                      "%s: keeps_act at split 0", n);
        ck_assert_msg(rekv_mode_keeps_act((rekv_mode)m, 8) == (mi->split != REKV_SPLIT_NONE),
                      "%s: keeps_act at split 8", n);
    }
}
END_TEST

START_TEST(planner_prices_every_mode)
{
    for (int m = 0; m < REKV_MODE_COUNT; m++) {
        const rekv_mode_info *mi = rekv_mode_info_of((rekv_mode)m);
        ck_assert_msg(mi != NULL, "mode %d has no properties", m);
        rekv_technique t = rekv_plan_mode_tech((rekv_mode)m);
        ck_assert_msg(t >= 0 && t <= REKV_TECH_INFINIGEN, "%s: priced as %d", mi->name, (int)t);
        /* approximate modes are priced by the fraction they fetch (infinigen's pricing) */
        ck_assert_msg(mi->store == REKV_STORE_NONE || (t == REKV_TECH_INFINIGEN) == mi->approximate,
                      "%s: priced as %d", mi->name, (int)t);
    }
    /* each technique the planner picks runs as a mode priced as that technique */
    for (int t = 0; t <= REKV_TECH_INFINIGEN; t++)
        ck_assert_int_eq(rekv_plan_mode_tech(rekv_plan_tech_mode((rekv_technique)t)), t);
}
END_TEST

START_TEST(not_a_mode)
{
    rekv_mode bad[] = {REKV_MODE_COUNT, (rekv_mode)-1, (rekv_mode)99};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ck_assert_ptr_null(rekv_mode_info_of(bad[i]));
        ck_assert_ptr_null(pl_mode_ops_of(bad[i]));
        ck_assert_str_eq(rekv_mode_name(bad[i]), "?");
        ck_assert_int_eq(rekv_mode_approximate(bad[i]), 0);
        ck_assert_int_eq(rekv_mode_streams(bad[i]), 0);
        ck_assert_int_eq(rekv_mode_keeps_act(bad[i], 8), 0);
        /* the pipeline refuses it before it looks at anything else */
        rekv_pipeline_config cfg;
        rekv_pipeline_config_defaults(&cfg);
        cfg.mode = bad[i];
        rekv_pipeline *p = NULL;
        rekv_err err = {0};
        ck_assert_int_eq(rekv_pipeline_create(NULL, NULL, NULL, &cfg, &p, &err), -EINVAL);
        ck_assert_ptr_null(p);
        ck_assert_msg(strstr(err.msg, "is not a mode") != NULL, "%s", err.msg);
    }
    rekv_mode out = REKV_MODE_KVPR;
    ck_assert_int_eq(rekv_mode_parse("?", &out), -EINVAL);
    ck_assert_int_eq(rekv_mode_parse(NULL, &out), -EINVAL);
    ck_assert_int_eq(rekv_mode_parse("Resident", &out), -EINVAL);
    ck_assert_int_eq(out, REKV_MODE_KVPR);
}
END_TEST

/* Mode m at its exact limit, from its properties: part of the context recomputed (a split), a
 * KV:ACT pattern, the first tokens on the device, every token selected, every head cache missing
 * with a top-k of the whole middle of the context. */
static void limit_config(rekv_mode m, int device_tokens, const rekv_skew *sk, const rekv_heads *hp,
                         rekv_pipeline_config *cfg)
{
    const rekv_mode_info *mi = rekv_mode_info_of(m);
    rekv_pipeline_config_defaults(cfg);
    cfg->mode = m;
    cfg->split = mi->split != REKV_SPLIT_NONE ? 7 : 0;
    cfg->kv_parts = 2, cfg->act_parts = 1;
    cfg->device_tokens = mi->device_part ? device_tokens : 0;
    cfg->act_gpu_blocks = mi->act_gpu && device_tokens ? 1 : 0;
    if (mi->speculates) {
        cfg->skew = sk;
        cfg->max_fraction = 1;
        cfg->select = mi->head_caches ? REKV_SELECT_SPECULATE : REKV_SELECT_ALL;
    }
    if (mi->head_caches) {
        cfg->heads = hp;
        cfg->eta = 1; /* with every importance 1: tau 1, every head misses */
    }
}

/* A prefill of prompts, then `steps` greedy decode steps: every step's logits, [steps + 1][B][V];
 * *moved: the context tokens that came from the store or the device part, recomputed or not. */
static float *run_mode(tu_fixture *f, const rekv_pipeline_config *cfg, int B, const int *lens,
                       int32_t *const *prompts, int steps, uint64_t *moved)
{
    rekv_err err = {0};
    rekv_pipeline *p = NULL;
    int V = f->m->config.vocab;
    ck_assert_msg(rekv_pipeline_create(f->e, f->be, rekv_mode_streams(cfg->mode) ? f->store : NULL,
                                       cfg, &p, &err) == 0,
                  "%s: %s", rekv_mode_name(cfg->mode), err.msg);
    float *logits = malloc(sizeof(float) * (size_t)(steps + 1) * (size_t)B * (size_t)V);
    rekv_pseq *seqs[4];
    rekv_pipe_item items[4];
    int32_t next[4];
    ck_assert(B <= 4 && logits != NULL);
    for (int s = 0; s <= steps; s++) {
        float *out = logits + (size_t)s * (size_t)B * (size_t)V;
        for (int i = 0; i < B; i++) {
            if (s == 0)
                ck_assert_msg(rekv_pseq_create(p, lens[i] + steps, &seqs[i], &err) == 0, "%s",
                              err.msg);
            else
                next[i] = rekv_argmax(out - (size_t)B * V + (size_t)i * V, V);
            items[i] = (rekv_pipe_item){.seq = seqs[i],
                                        .tokens = s == 0 ? prompts[i] : &next[i],
                                        .n_tokens = s == 0 ? lens[i] : 1,
                                        .logits = out + (size_t)i * V};
        }
        ck_assert_msg(rekv_pipeline_step(p, items, B, &err) == 0, "%s step %d: %s",
                      rekv_mode_name(cfg->mode), s, err.msg);
    }
    rekv_layer_counters t;
    rekv_pipeline_counters(p, &t);
    *moved = t.tokens_fetched + t.tokens_recomputed + t.tokens_device;
    for (int i = 0; i < B; i++)
        rekv_pseq_free(seqs[i]);
    rekv_pipeline_free(p);
    return logits;
}

START_TEST(every_mode_matches_resident)
{
    const char *path = tu_shared("models/stories260K/stories260K.bin");
    if (path == NULL)
        return;
    tu_fixture f;
    tu_fixture_open(&f, path, REKV_DTYPE_F32, NULL);
    rekv_skew sk;
    rekv_heads hp;
    tu_skew_calibrate(&f, &sk);
    tu_heads_uniform(&f, 1.0, &hp);
    /* 90 and 75: past clo's sink and window (68), so its head caches are used; 40 is not */
    enum { B = 3, STEPS = 4 };
    int lens[B] = {90, 40, 75};
    int32_t *prompts[B];
    uint64_t x = 3;
    for (int b = 0; b < B; b++) {
        prompts[b] = malloc(sizeof(int32_t) * (size_t)lens[b]);
        for (int i = 0; i < lens[b]; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            prompts[b][i] = (int32_t)((x >> 33) % (uint64_t)f.m->config.vocab);
        }
    }
    size_t n = (size_t)(STEPS + 1) * B * (size_t)f.m->config.vocab;
    rekv_pipeline_config cfg;
    uint64_t moved;
    limit_config(REKV_MODE_RESIDENT, 0, &sk, &hp, &cfg);
    float *ref = run_mode(&f, &cfg, B, lens, prompts, STEPS, &moved);
    for (int m = 0; m < REKV_MODE_COUNT; m++)
        for (int dev = 0; dev <= 20; dev += 20) {
            const rekv_mode_info *mi = rekv_mode_info_of((rekv_mode)m);
            if (dev && !mi->device_part && !mi->act_gpu)
                continue;
            limit_config((rekv_mode)m, dev, &sk, &hp, &cfg);
            float *got = run_mode(&f, &cfg, B, lens, prompts, STEPS, &moved);
            double worst = 0;
            for (size_t k = 0; k < n; k++) {
                if (mi->head_caches) /* the same rows in another order */
                    worst = fmax(worst, fabs((double)got[k] - ref[k]) / (1 + fabs((double)ref[k])));
                else if (memcmp(&got[k], &ref[k], sizeof(float)) != 0)
                    ck_abort_msg("%s (device part %d): logit %zu is %.9g, resident's %.9g",
                                 mi->name, dev, k, (double)got[k], (double)ref[k]);
            }
            ck_assert_msg(worst < 1e-5, "%s: logits differ from resident's by %g", mi->name, worst);
            /* a mode that streams moved its context (by link, recomputation or device part) */
            ck_assert_msg(mi->store == REKV_STORE_NONE || moved > 0, "%s moved nothing", mi->name);
            free(got);
        }
    free(ref);
    for (int b = 0; b < B; b++)
        free(prompts[b]);
    rekv_heads_free(&hp);
    rekv_skew_free(&sk);
    tu_fixture_close(&f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("modes");
    TCase *tc = tcase_create("modes");
    tcase_add_test(tc, every_mode_has_both_entries);
    tcase_add_test(tc, entries_match_properties);
    tcase_add_test(tc, planner_prices_every_mode);
    tcase_add_test(tc, not_a_mode);
    suite_add_tcase(s, tc);
    TCase *run = tcase_create("run");
    tcase_set_timeout(run, 120);
    tcase_add_test(run, every_mode_matches_resident);
    suite_add_tcase(s, run);
    return tu_run_suite(s);
}
