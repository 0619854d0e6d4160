/* test_run_prefix.c — the prefix cache as a user of `rekv run` meets it (issue 37): the same
 * prompt sent again starts from the KV its first run left in the kvstore (JobStatus.cached_tokens:
 * its full blocks but the last token's), with rekv_generate's tokens; with --prefix-dir the cache
 * outlives a restart of `rekv run` (the first job after it hits too); --prefix-cache off takes
 * nothing from it. Real daemons (cli_run in a child, offload mode, cpu backend), stories260K. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "coordinator/coordinator.h"
#include "tests/testutil.h"
#define MODEL_REL "models/stories260K/stories260K.bin"
#include "tests/co_env.h"

/* A 40-token prompt, greedy, 8 new tokens: two full blocks (32 tokens) to share. */
static void make_job(tjob *j, const char *model)
{
    memset(j, 0, sizeof(*j));
    j->n_prompt = 40;
    for (int i = 0; i < 40; i++)
        j->prompt[i] = 1 + (i * 37 + 5) % 500;
    j->gp = (rekv_gen_params){.max_new_tokens = 8, .top_p = 1.0f};
    ct_reference(j, 1, model);
}

START_TEST(prompt_again_and_after_restart)
{
    env e;
    if (ct_env_open(&e))
        return;
    static tjob job;
    make_job(&job, e.model);
    char pd[4300];
    snprintf(pd, sizeof(pd), "%s/prefix", e.dir);
    ck_assert_int_eq(mkdir(pd, 0700), 0);
    const char *extra[] = {"--prefix-dir", pd, NULL};
    pid_t run = ct_rekv_run_start_args(&e, "64M", "8", "offload", extra);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_uint_eq(ct_run_cached(c, &job), 0);  /* nothing cached yet */
    ck_assert_uint_eq(ct_run_cached(c, &job), 32); /* its two full blocks */
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(run), 0);

    run = ct_rekv_run_start_args(&e, "64M", "8", "offload", extra); /* the same --prefix-dir */
    c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_uint_eq(ct_run_cached(c, &job), 32); /* kept across the restart */
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(run), 0);

    const char *off[] = {"--prefix-dir", pd, "--prefix-cache", "off", NULL};
    run = ct_rekv_run_start_args(&e, "64M", "8", "offload", off);
    c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    ck_assert_uint_eq(ct_run_cached(c, &job), 0);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(run), 0);
    ct_free_jobs(&job, 1);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("run_prefix");
    TCase *tc = tcase_create("run");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, prompt_again_and_after_restart);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
