/* test_bench_prefix.c — `rekv bench serve --workload chat|system` (issue 37's benchmark), tiny:
 * the real rekv running each workload with the prefix cache off, on (host memory) and on across
 * kvstore restarts (disk), each on its own private trio. Asserts counts only, never a time: every
 * job done, the answers the same in every run, no hit with the cache off, and with it on the
 * prompt tokens the server says it took from the cache equal the workload's shareable tokens as
 * tests/bench/prefix_shareable.py counts them from the token lists the bench wrote
 * (--workload-out) — the bench's own count agrees too —, the host run's hits from host memory,
 * the disk run's from the spill tier. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

/* A small synthetic llama (2 layers, hidden 64, context 512), made once by main. */
static char g_dir[2048], g_model[4096];

static json_int_t geti(json_t *m, const char *k)
{
    json_t *v = json_object_get(m, k);
    ck_assert_msg(json_is_integer(v), "no integer %s", k);
    return json_integer_value(v);
}

/* Runs the workload; checks the bench's report and the independent count of its token lists. */
static void check_workload(const char *workload, const char *shape, int requests)
{
    char out_file[2200], cmd[12000], *out = NULL, *count = NULL;
    snprintf(out_file, sizeof(out_file), "%s/%s.jsonl", g_dir, workload);
    snprintf(cmd, sizeof(cmd),
             "%s bench serve --workload %s --model %s %s --arena 16M --workload-out %s --json",
             tu_bin("rekv"), workload, g_model, shape, out_file);
    int rc = tu_run(cmd, &out);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(rc == 0 && o != NULL, "%s: exit %d: %s", cmd, rc, out);
    ck_assert_str_eq(json_string_value(json_object_get(o, "workload")), workload);
    ck_assert_int_eq(geti(o, "mismatches"), 0);
    json_int_t share = geti(o, "shareable_tokens");
    ck_assert_int_gt(share, 0);

    snprintf(cmd, sizeof(cmd), "/usr/bin/python3 tests/bench/prefix_shareable.py %s", out_file);
    ck_assert_int_eq(tu_run(cmd, &count), 0);
    json_t *c = json_loads(count, 0, NULL);
    ck_assert_msg(c != NULL, "prefix_shareable.py: %s", count);

    json_t *runs = json_object_get(o, "runs");
    ck_assert_int_eq(json_array_size(runs), 3);
    for (size_t i = 0; i < 3; i++) {
        json_t *r = json_array_get(runs, i);
        const char *name = json_string_value(json_object_get(r, "run"));
        json_t *ind = json_object_get(c, name);
        ck_assert_msg(ind != NULL, "run %s not in the workload file", name);
        ck_assert_int_eq(geti(r, "requests"), requests);
        ck_assert_int_eq(geti(r, "jobs_failed"), 0);
        /* the independent count of the token lists; the server's cached tokens as written */
        ck_assert_int_eq(geti(ind, "shareable_tokens"), share);
        ck_assert_int_eq(geti(ind, "cached_tokens"), geti(r, "hit_tokens"));
        ck_assert_int_eq(geti(r, "shareable_tokens"), share);
        if (strcmp(name, "off") == 0) {
            ck_assert_int_eq(geti(r, "hit_tokens"), 0);
            continue;
        }
        ck_assert_msg(geti(r, "hit_tokens") == geti(ind, "shareable_tokens"),
                      "run %s: %lld prompt tokens from the cache, %lld shareable", name,
                      (long long)geti(r, "hit_tokens"), (long long)geti(ind, "shareable_tokens"));
        int disk = strcmp(name, "disk") == 0;
        ck_assert_int_gt(geti(r, disk ? "hit_blocks_disk" : "hit_blocks_host"), 0);
        ck_assert_int_eq(geti(r, disk ? "hit_blocks_host" : "hit_blocks_disk"), 0);
    }
    json_decref(c);
    json_decref(o);
    free(out);
    free(count);
}

/* Two conversations of three turns, each opening with 40 tokens of its own history: 20 new
 * tokens a turn, 8-token answers. */
START_TEST(chat_hits_are_the_shareable_blocks)
{
    check_workload("chat",
                   "--conversations 2 --turns 3 --history-len 40 --user-len 20 --max-new-tokens 8",
                   6);
}
END_TEST

/* Three questions after a 64-token system prompt (four blocks: the last request's prompt is 74). */
START_TEST(system_prompt_hits_are_the_shareable_blocks)
{
    check_workload("system", "--questions 3 --system-len 64 --question-len 10 --max-new-tokens 4",
                   3);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("bench_prefix");
    TCase *tc = tcase_create("bench_prefix");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, chat_hits_are_the_shareable_blocks);
    tcase_add_test(tc, system_prompt_hits_are_the_shareable_blocks);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite_synth(suite,
                              "--arch llama --layers 2 --hidden 64 --heads 4 "
                              "--ffn 128 --vocab 300 --max-pos 512 --dtype f16 --seed 5",
                              g_dir, sizeof(g_dir), g_model, sizeof(g_model));
}
