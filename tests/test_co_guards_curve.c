/* test_co_guards_curve.c — --curve-secret-file: CURVE guards tcp:// endpoints (a worker and
 * the CLI with the key are served, a malformed key is a clear error) and leaves ipc:// sockets
 * alone. */
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

/* ---------------------------------------------------------------- log flood */

/* --curve-secret-file guards tcp:// endpoints only: on ipc:// sockets (a file, mode 0600) a local
 * client and a local worker, which hold no keys, are served as without it. */
START_TEST(curve_leaves_ipc_alone)
{
    char pub[41], sec[41];
    if (zmq_curve_keypair(pub, sec) != 0) {
        fprintf(stderr, "   skip: this libzmq has no CURVE (%s)\n", zmq_strerror(errno));
        return;
    }
    const char *model = tu_shared("models/stories260K/stories260K.bin");
    if (model == NULL)
        return;
    char *dir = tu_tmpdir(), key[4200], ctl[4200], wrk[4200], log[4200];
    snprintf(key, sizeof(key), "%s/secret", dir);
    snprintf(ctl, sizeof(ctl), "ipc://%s/control", dir);
    snprintf(wrk, sizeof(wrk), "ipc://%s/workers", dir);
    snprintf(log, sizeof(log), "%s/log", dir);
    FILE *f = fopen(key, "w");
    ck_assert_ptr_nonnull(f);
    fputs(sec, f);
    fclose(f);
    const char *co_args[] = {tu_bin("rekv-coordinator"), "--control", ctl, "--workers", wrk,
                             "--curve-secret-file",      key,         NULL};
    pid_t co = tu_spawn(co_args, log, NULL);
    ck_assert_int_gt(co, 0);
    const char *wk_args[] = {tu_bin("rekv-gpuworker"),
                             "--model",
                             model,
                             "--coordinator",
                             wrk,
                             "--backend",
                             "cpu",
                             "--name",
                             "w0",
                             NULL};
    pid_t wk = tu_spawn(wk_args, log, NULL);
    ck_assert_int_gt(wk, 0);
    rekv_ctl *c = tu_ctl_open(ctl);
    tu_ctl_wait_workers(c, 1); /* the worker joined over ipc, and a plain client asks */
    Rekv__Control__Response *r = tu_ctl_stats(c);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* On a tcp:// endpoint with --curve-secret-file, the worker and the CLI given the coordinator's
 * public key ($REKV_CURVE_SERVER_KEY) are served; a client without it gets no answer. */
START_TEST(curve_on_tcp)
{
    char pub[41], sec[41];
    if (zmq_curve_keypair(pub, sec) != 0) {
        fprintf(stderr, "   skip: this libzmq has no CURVE (%s)\n", zmq_strerror(errno));
        return;
    }
    const char *model = tu_shared("models/stories260K/stories260K.bin");
    if (model == NULL)
        return;
    char *dir = tu_tmpdir(), key[4200], ctl[64], wrk[64], log[4200], cmd[8192];
    int port = 20000 + (int)(getpid() % 20000);
    snprintf(key, sizeof(key), "%s/secret", dir);
    snprintf(ctl, sizeof(ctl), "tcp://127.0.0.1:%d", port);
    snprintf(wrk, sizeof(wrk), "tcp://127.0.0.1:%d", port + 1);
    snprintf(log, sizeof(log), "%s/log", dir);
    FILE *f = fopen(key, "w");
    ck_assert_ptr_nonnull(f);
    fputs(sec, f);
    fclose(f);
    const char *co_args[] = {tu_bin("rekv-coordinator"), "--control", ctl, "--workers", wrk,
                             "--curve-secret-file",      key,         NULL};
    pid_t co = tu_spawn(co_args, log, NULL);
    ck_assert_int_gt(co, 0);
    char want[128];
    snprintf(want, sizeof(want), "REKV_CURVE_SERVER_KEY=%s", pub); /* the key it logs is ours */
    ck_assert(tu_file_has(log, want));
    setenv("REKV_CURVE_SERVER_KEY", pub, 1);
    const char *wk_args[] = {tu_bin("rekv-gpuworker"),
                             "--model",
                             model,
                             "--coordinator",
                             wrk,
                             "--backend",
                             "cpu",
                             "--name",
                             "w0",
                             NULL};
    pid_t wk = tu_spawn(wk_args, log, NULL);
    ck_assert_int_gt(wk, 0);
    /* the CLI with the key: the worker has joined */
    char *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s stats --socket %s", tu_bin("rekv"), ctl);
    int joined = 0;
    while (!joined) { /* Check's timeout is the guard */
        ck_assert_int_eq(tu_run(cmd, &out), 0);
        joined = strstr(out, "\"w0\"") != NULL;
        free(out);
        if (!joined)
            usleep(100000);
    }
    /* a malformed key is a clear error */
    setenv("REKV_CURVE_SERVER_KEY", "short", 1);
    snprintf(cmd, sizeof(cmd), "%s stats --socket %s 2>&1", tu_bin("rekv"), ctl);
    ck_assert_int_ne(tu_run(cmd, &out), 0);
    ck_assert_msg(strstr(out, "40 Z85") != NULL, "%s", out);
    free(out);
    unsetenv("REKV_CURVE_SERVER_KEY");
    /* without the key: no answer */
    rekv_ctl *c = NULL;
    rekv_err err = {0};
    ck_assert_int_eq(rekv_ctl_connect(ctl, NULL, &c, &err), 0);
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    Rekv__Control__Response *r = NULL;
    ck_assert_int_eq(rekv_ctl_call(c, &rq, 1000, &r, &err), -ETIMEDOUT);
    rekv_ctl_close(c);
    ck_assert_int_eq(tu_stop(wk), 0);
    ck_assert_int_eq(tu_stop(co), 0);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("co_guards_curve");
    TCase *tc;
    tc = tcase_create("co_guards");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, curve_leaves_ipc_alone);
    tcase_add_test(tc, curve_on_tcp);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
