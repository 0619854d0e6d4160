/* test_kvstore_bench.c — runs `rekv bench kvstore` (rekv_kvstore_bench_main) at a small size and
 * checks that it prints one JSON object with every measurement. With REKV_BENCH_FULL=1 it runs at
 * the default size and copies the JSON to stderr (how the numbers in the notes were taken). */
#define _GNU_SOURCE
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvstore/kvstore.h"
#include "tests/testutil.h"

START_TEST(test_bench_json)
{
    char *dir = tu_tmpdir();
    char out[4200];
    snprintf(out, sizeof(out), "%s/bench.json", dir);
    int full = getenv("REKV_BENCH_FULL") && strcmp(getenv("REKV_BENCH_FULL"), "1") == 0;
    char *argv_small[] = {"kvstore", "--json", "--blocks", "256", "--spill-blocks", "128",
                          "--plan-iters", "100", "--spill-dir", dir, NULL};
    char *argv_full[] = {"kvstore", "--json", "--spill-dir", dir, NULL};
    char **argv = full ? argv_full : argv_small;
    int argc = 0;
    while (argv[argc])
        argc++;
    fflush(stdout);
    int saved = dup(1);
    FILE *f = fopen(out, "w");
    ck_assert_ptr_nonnull(f);
    dup2(fileno(f), 1);
    int rc = rekv_kvstore_bench_main(argc, argv);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    fclose(f);
    ck_assert_int_eq(rc, 0);
    json_error_t je;
    json_t *j = json_load_file(out, 0, &je);
    ck_assert_msg(j != NULL, "bench output is not JSON: %s", je.text);
    if (full) {
        char *s = json_dumps(j, JSON_INDENT(2));
        fprintf(stderr, "%s\n", s);
        free(s);
    }
    json_t *g = json_object_get(j, "gather");
    ck_assert_ptr_nonnull(g);
    ck_assert(json_number_value(json_object_get(g, "ratio")) > 0);
    json_t *sp = json_object_get(j, "spill");
    ck_assert_ptr_nonnull(sp);
    ck_assert(json_number_value(json_object_get(sp, "write_gbps")) > 0);
    ck_assert(json_number_value(json_object_get(sp, "read_gbps")) > 0);
    ck_assert_int_eq(json_integer_value(json_object_get(sp, "crc_mismatches")), 0);
    ck_assert_int_eq(json_integer_value(json_object_get(sp, "queue_depth")), 32);
    json_t *pl = json_object_get(j, "plan");
    ck_assert_int_eq(json_array_size(pl), 3);
    ck_assert_int_eq(json_integer_value(json_object_get(json_array_get(pl, 2), "blocks")), 4096);
    ck_assert(json_number_value(json_object_get(json_array_get(pl, 0), "p99_us")) > 0);
    json_decref(j);
    /* the bench leaves nothing in its directory but our output */
    char cmd[4300], *ls = NULL;
    snprintf(cmd, sizeof(cmd), "ls -A '%s'", dir);
    tu_run(cmd, &ls);
    ck_assert_str_eq(ls, "bench.json\n");
    free(ls);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kvstore_bench");
    TCase *tc = tcase_create("bench");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_bench_json);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
