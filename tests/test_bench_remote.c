/* test_bench_remote.c — `rekv bench remote` (issue 38's benchmark), tiny: two real replicas
 * (`rekv run`, a small synthetic llama) and Debian's redis-server, started by the bench, through
 * its four runs — local (nothing shared), remote (both replicas --remote on one Redis), kill
 * (redis-server killed with SIGKILL under one of B's jobs), steps (three trios given the same
 * prompts: no Redis, a Redis, a Redis at SCHED_IDLE). Asserts counts only, never a time:
 * every job done in every run with the local run's tokens (the bench's mismatch count, and its exit
 * code), replica B taking prompt tokens from its cache only where a Redis shares A's blocks
 * (none in the local run, where each of B's system prompts is new to it; some in the remote
 * run, with Redis's own keyspace_hits beside), and the kill run completing; and a missing
 * redis-server is a clear error. redis-server absent: skipped, or failed when CI=true. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

#define REDIS "/usr/bin/redis-server"

/* A small synthetic llama (2 layers, hidden 64, context 512), made once by main. */
static char g_dir[2048], g_model[4096];

static int have_redis(void)
{
    if (access(REDIS, X_OK) == 0)
        return 1;
    ck_assert_msg(!tu_ci(), "redis-server is missing (CI=true): apt-get install redis-server");
    fprintf(stderr, "test_bench_remote: no %s: skipped\n", REDIS);
    return 0;
}

static json_int_t geti(json_t *m, const char *k)
{
    json_t *v = json_object_get(m, k);
    ck_assert_msg(json_is_integer(v), "no integer %s", k);
    return json_integer_value(v);
}

static json_t *run_named(json_t *o, const char *name)
{
    json_t *runs = json_object_get(o, "runs");
    for (size_t i = 0; i < json_array_size(runs); i++) {
        json_t *r = json_array_get(runs, i);
        if (strcmp(json_string_value(json_object_get(r, "run")), name) == 0)
            return r;
    }
    ck_abort_msg("no run %s", name);
    return NULL;
}

/* Two pairs of a 64-token system prompt (four blocks) + 10 tokens, 4-token answers. The replicas
 * read with --remote-timeout-ms 5000: on this loaded machine a read over a short timeout would
 * turn an expected hit into a miss; the timeout is no assertion here. */
START_TEST(shared_prefixes_and_a_killed_redis_keep_the_tokens)
{
    if (!have_redis())
        return;
    char cmd[12000], *out = NULL;
    snprintf(cmd, sizeof(cmd),
             "%s bench remote --model %s --pairs 2 --system-len 64 --question-len 10 "
             "--max-new-tokens 4 --arena 16M --remote-timeout-ms 5000 --redis-server %s --json",
             tu_bin("rekv"), g_model, REDIS);
    int rc = tu_run(cmd, &out);
    json_t *o = json_loads(out, 0, NULL);
    ck_assert_msg(rc == 0 && o != NULL, "%s: exit %d: %s", cmd, rc, out);
    ck_assert_int_eq(geti(o, "mismatches"), 0);
    ck_assert_int_eq(json_array_size(json_object_get(o, "runs")), 4);
    const char *names[] = {"local", "remote", "kill"};
    for (int i = 0; i < 3; i++) {
        json_t *r = run_named(o, names[i]);
        ck_assert_int_eq(geti(r, "requests"), 4);
        ck_assert_int_eq(geti(r, "jobs_failed"), 0);
        ck_assert_int_eq(geti(r, "mismatches"), 0);
        ck_assert_int_eq(geti(r, "tokens"), 16);
        ck_assert_int_eq(geti(r, "a_cached_tokens"), 0); /* A's prefixes are new everywhere */
    }
    /* nothing shared: each of B's system prompts is new to it */
    ck_assert_int_eq(geti(run_named(o, "local"), "b_cached_tokens"), 0);
    json_t *remote = run_named(o, "remote");
    ck_assert_int_gt(geti(remote, "b_cached_tokens"), 0);
    ck_assert_int_gt(geti(json_object_get(remote, "redis"), "keyspace_hits"), 0);
    /* killed under B's request of pair 1 (request 3); every job still done, above */
    ck_assert_int_eq(geti(run_named(o, "kill"), "redis_killed_at_request"), 3);
    /* steps: A's two prompts on each of three trios (no Redis; Redis; Redis at SCHED_IDLE), every
     * answer the local run's */
    json_t *st = run_named(o, "steps");
    ck_assert_int_eq(geti(st, "requests"), 6);
    ck_assert_int_eq(geti(st, "jobs_failed"), 0);
    ck_assert_int_eq(geti(st, "mismatches"), 0);
    ck_assert_int_eq(geti(st, "tokens"), 24);
    json_decref(o);
    free(out);
}
END_TEST

START_TEST(a_missing_redis_server_is_a_clear_error)
{
    char cmd[12000], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s bench remote --model %s --redis-server %s/no-redis 2>&1",
             tu_bin("rekv"), g_model, g_dir);
    ck_assert_int_eq(tu_run(cmd, &out), 1);
    ck_assert_msg(strstr(out, "--redis-server") && strstr(out, "no-redis"), "%s", out);
    free(out);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("bench_remote");
    TCase *tc = tcase_create("bench_remote");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, shared_prefixes_and_a_killed_redis_keep_the_tokens);
    tcase_add_test(tc, a_missing_redis_server_is_a_clear_error);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite_synth(suite,
                              "--arch llama --layers 2 --hidden 64 --heads 4 --ffn 128 --vocab 300 "
                              "--max-pos 512 --dtype f16 --seed 5",
                              g_dir, sizeof(g_dir), g_model, sizeof(g_model));
}
