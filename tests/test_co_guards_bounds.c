/* test_co_guards_bounds.c — what the coordinator bounds (tests/co_guard.h starts it):
 * top_logits above 64, or top_logits x max_new_tokens above 2^20, is a bad request; finished jobs
 * are forgotten oldest first beyond --keep-finished jobs or --keep-finished-bytes of results, and
 * Status says so; a daemon raises its open-file limit. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>
#include "common/clock.h"
#include "common/ratelimit.h"
#include "coordinator/coordinator.h"
#include "proto/worker.pb-c.h"
#include "tests/testutil.h"
#include "tests/co_guard.h"

/* ---------------------------------------------------------------- caps */

START_TEST(top_logits_capped)
{
    env e;
    cg_env_start(&e, NULL);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    Rekv__Control__Response *r = cg_submit(c, 8, REKV_TOP_LOGITS_MAX + 1);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    ck_assert_msg(strstr(r->error, "top_logits 65 is above the limit of 64"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    uint32_t most = REKV_TOP_LOGITS_MAX_ENTRIES / REKV_TOP_LOGITS_MAX;
    r = cg_submit(c, most + 1, REKV_TOP_LOGITS_MAX);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    ck_assert_msg(strstr(r->error, "top_logits x max_new_tokens"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    cg_submit_ok(c, most, REKV_TOP_LOGITS_MAX);
    cg_submit_ok(c, 8, REKV_TOP_LOGITS_MAX);
    rekv_ctl_close(c);
    cg_env_stop(&e);
}
END_TEST

/* Beyond --keep-finished jobs the oldest finished job is forgotten: its Status says so, the
 * others answer. */
START_TEST(finished_jobs_capped_by_count)
{
    env e;
    const char *extra[] = {"--keep-finished", "2", NULL};
    cg_env_start(&e, extra);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    uint64_t id[3];
    for (int i = 0; i < 3; i++) {
        id[i] = cg_submit_ok(c, 4, 0);
        Rekv__Control__Cancel cn = REKV__CONTROL__CANCEL__INIT;
        cn.job = id[i];
        Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
        rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
        rq.cancel = &cn;
        Rekv__Control__Response *r = tu_ctl_call(c, &rq);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        rekv__control__response__free_unpacked(r, NULL);
    }
    Rekv__Control__Response *r = tu_ctl_status(c, id[0]);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    ck_assert_msg(strstr(r->error, "no longer remembered") && strstr(r->error, "last 2 finished"),
                  "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    for (int i = 1; i < 3; i++) {
        r = tu_ctl_status(c, id[i]);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
        rekv__control__response__free_unpacked(r, NULL);
    }
    r = tu_ctl_status(c, id[2] + 1000);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    ck_assert_msg(strstr(r->error, "no job"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    r = cg_stats(c);
    ck_assert_uint_eq(r->stats->finished_forgotten, 1);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    cg_env_stop(&e);
}
END_TEST

/* Results with 64 top logits per token (16 tokens: ~8 KiB each in memory) under a 24 KiB cap:
 * two are remembered, the third finished job makes the coordinator forget the first. */
START_TEST(finished_jobs_capped_by_bytes)
{
    env e;
    const char *extra[] = {"--keep-finished-bytes", "24576", NULL};
    cg_env_start(&e, extra);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    fake f;
    cg_fake_welcomed(&f, e.wrk, 1, 512);
    int32_t toks[16];
    for (int i = 0; i < 16; i++)
        toks[i] = 100 + i;
    uint64_t id[3];
    for (int i = 0; i < 3; i++) {
        id[i] = cg_submit_ok(c, 16, 64);
        Rekv__Worker__CoordMsg *cm = cg_fake_plan(&f);
        ck_assert_ptr_nonnull(cm);
        ck_assert_uint_eq(cm->plan->join[0]->top_logits, 64);
        cg_fake_progress(&f, cm->plan->step, id[i], toks, 16, 1, 64);
        rekv__worker__coord_msg__free_unpacked(cm, NULL);
        cg_fake_empty(&f); /* the Plan made before the job had finished */
        Rekv__Control__Response *r = cg_wait_end(c, id[i]);
        ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__DONE);
        ck_assert_uint_eq(r->job->n_top_ids, 16 * 64);
        rekv__control__response__free_unpacked(r, NULL);
    }
    Rekv__Control__Response *r = tu_ctl_status(c, id[0]);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__NOT_FOUND);
    ck_assert_msg(strstr(r->error, "no longer remembered"), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    for (int i = 1; i < 3; i++) {
        r = tu_ctl_status(c, id[i]);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        ck_assert_uint_eq(r->job->n_generated_ids, 16);
        ck_assert_uint_eq(r->job->n_top_ids, 16 * 64);
        rekv__control__response__free_unpacked(r, NULL);
    }
    r = cg_stats(c);
    ck_assert_uint_eq(r->stats->finished_forgotten, 1);
    rekv__control__response__free_unpacked(r, NULL);
    cg_fake_close(&f);
    rekv_ctl_close(c);
    cg_env_stop(&e);
}
END_TEST

/* ---------------------------------------------------------------- log flood */

/* A daemon lifts its open-file soft limit to the hard one (every connection is a descriptor):
 * started with a soft limit of 256, the coordinator runs with the hard limit. */
START_TEST(daemon_raises_nofile)
{
    struct rlimit old, low;
    ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
    if (old.rlim_max <= 256) {
        fprintf(stderr, "   skip: the hard open-file limit is %llu, nothing to raise to\n",
                (unsigned long long)old.rlim_max);
        return;
    }
    low = old;
    low.rlim_cur = 256;
    ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
    char *dir = tu_tmpdir(), ctl[4200], wrk[4200], path[64], line[256];
    snprintf(ctl, sizeof(ctl), "ipc://%s/control", dir);
    snprintf(wrk, sizeof(wrk), "ipc://%s/workers", dir);
    const char *args[] = {tu_bin("rekv-coordinator"), "--control", ctl, "--workers", wrk, NULL};
    pid_t co = tu_spawn(args, NULL, NULL);
    ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
    ck_assert_int_gt(co, 0);
    snprintf(path, sizeof(path), "/proc/%d/limits", (int)co);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    unsigned long long soft = 0, hard = 0;
    int found = 0;
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, "Max open files", 14) == 0)
            found = sscanf(line + 14, "%llu %llu", &soft, &hard) == 2;
    fclose(f);
    ck_assert_msg(found, "no open-file limit in %s", path);
    ck_assert_msg(soft == hard && soft > 256, "the coordinator runs with %llu of %llu", soft, hard);
    ck_assert_int_eq(tu_stop(co), 0);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("co_guards_bounds");
    TCase *tc;
    tc = tcase_create("co_guards");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, top_logits_capped);
    tcase_add_test(tc, finished_jobs_capped_by_count);
    tcase_add_test(tc, finished_jobs_capped_by_bytes);
    tcase_add_test(tc, daemon_raises_nofile);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
