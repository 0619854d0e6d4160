/* test_modes.c — the modes' two tables are complete and agree: every rekv_mode has its properties
 * (common/mode.c, rekv_mode_info_of) and its entry in the pipeline's mode table
 * (gpuworker/mode_*.c, pl_mode_ops_of), its name round-trips, the functions an entry has are the
 * ones its properties call for (a mode that streams plans its units, one that speculates says which
 * items are sparse, one with a split or ACT blocks says which rows it recomputes, ...), the planner
 * prices every mode, and anything that is not a mode has neither and is refused. A new mode that
 * misses a row fails here before any step runs. */
#include <errno.h>
#include <string.h>

#include "common/mode.h"
#include "coordinator/planner.h"
#include "gpuworker/pipeline_internal.h"
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

int main(void)
{
    Suite *s = suite_create("modes");
    TCase *tc = tcase_create("modes");
    tcase_add_test(tc, every_mode_has_both_entries);
    tcase_add_test(tc, entries_match_properties);
    tcase_add_test(tc, planner_prices_every_mode);
    tcase_add_test(tc, not_a_mode);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
