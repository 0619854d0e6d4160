/* test_deploy_names.c — deploy/ gives every worker on a box a --name of its own (the coordinator
 * refuses a second live worker under a taken name): the plain unit's worker is gpuworker, each
 * instance of the template rekv-gpuworker@.service is gpuworker-N with its own metrics address and
 * GPU; `systemd-analyze verify` accepts an instance beside the other units, the exposure score of
 * the instance is at most 4 as theirs, `make install` installs the template with ExecStart in
 * PREFIX/bin, and compose's worker takes its name from REKV_WORKER_NAME. (tests/test_deploy.c
 * covers the three plain units.) */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "tests/testutil.h"

#define TEMPLATE "deploy/systemd/rekv-gpuworker@.service"

/* src copied to dst with /usr/bin/ made bindir. */
static void copy_unit(const char *src, const char *dst, const char *bindir)
{
    char *text = tu_read_file(src, NULL);
    ck_assert_msg(text != NULL, "%s is missing", src);
    FILE *f = fopen(dst, "w");
    ck_assert_ptr_nonnull(f);
    for (char *p = text; *p;) {
        char *hit = strstr(p, "/usr/bin/");
        if (hit == NULL) {
            fputs(p, f);
            break;
        }
        fwrite(p, 1, (size_t)(hit - p), f);
        fputs(bindir, f);
        p = hit + strlen("/usr/bin/");
    }
    fclose(f);
    free(text);
}

/* The template names each instance's worker after it, and gives it its own metrics address and
 * GPU; the plain unit's worker is gpuworker. Both keep the plain unit's settings. */
START_TEST(template_names_each_worker)
{
    char *t = tu_read_file(TEMPLATE, NULL),
         *p = tu_read_file("deploy/systemd/rekv-gpuworker.service", NULL);
    ck_assert_msg(t != NULL, "%s is missing", TEMPLATE);
    ck_assert_ptr_nonnull(p);
    ck_assert_msg(strstr(t, "ExecStart=/usr/bin/rekv-gpuworker --name gpuworker-%i "),
                  "%s: the worker is not named after the instance", TEMPLATE);
    ck_assert_msg(strstr(t, "--metrics ${REKV_INSTANCE_METRICS}") &&
                      strstr(t, "Environment=REKV_INSTANCE_METRICS=127.0.0.1:947%i") &&
                      strstr(t, "Environment=CUDA_VISIBLE_DEVICES=%i") &&
                      strstr(t, "EnvironmentFile=-/etc/rekv/gpuworker-%i.env"),
                  "%s: an instance does not get its own metrics address, GPU and settings",
                  TEMPLATE);
    ck_assert_msg(strstr(p, "ExecStart=/usr/bin/rekv-gpuworker --name gpuworker "),
                  "the plain unit's worker is not gpuworker");
    static const char *const same[] = {"Type=notify",
                                       "Restart=on-failure",
                                       "User=rekv",
                                       "EnvironmentFile=-/etc/rekv/rekv.env",
                                       "BindsTo=rekv-kvstore.service",
                                       "DevicePolicy=closed",
                                       "SystemCallFilter=@system-service",
                                       "WatchdogSec="};
    for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++)
        ck_assert_msg(strstr(t, same[i]) && strstr(p, same[i]), "%s or the plain unit lacks %s",
                      TEMPLATE, same[i]);
    free(t);
    free(p);
}
END_TEST

/* systemd-analyze verify accepts instance 1 beside the other units; its exposure is at most 4. */
START_TEST(template_instance_verifies)
{
    if (tu_run("command -v systemd-analyze >/dev/null 2>&1", NULL) != 0) {
        fprintf(stderr, "   skip: systemd-analyze is not installed\n");
        return;
    }
    char *dir = tu_tmpdir(), cwd[2048], bindir[4096], src[256], dst[4400], cmd[16384];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof(cwd)));
    snprintf(bindir, sizeof(bindir), "%s/%s", cwd, tu_bin(""));
    const char *units[] = {"rekv-kvstore", "rekv-coordinator", "rekv-gpuworker"};
    size_t off = (size_t)snprintf(cmd, sizeof(cmd), "cd '%s' && systemd-analyze verify", dir);
    for (size_t i = 0; i < 3; i++) {
        snprintf(src, sizeof(src), "deploy/systemd/%s.service", units[i]);
        snprintf(dst, sizeof(dst), "%s/%s.service", dir, units[i]);
        copy_unit(src, dst, bindir);
        off += (size_t)snprintf(cmd + off, sizeof(cmd) - off, " ./%s.service", units[i]);
    }
    snprintf(dst, sizeof(dst), "%s/rekv-gpuworker@.service", dir);
    copy_unit(TEMPLATE, dst, bindir);
    snprintf(dst, sizeof(dst), "%s/rekv-gpuworker@1.service", dir);
    copy_unit(TEMPLATE, dst, bindir);
    snprintf(cmd + off, sizeof(cmd) - off, " ./rekv-gpuworker@1.service 2>&1");
    char *out = NULL;
    int rc = tu_run(cmd, &out);
    if (rc != 0 && strstr(out, "Failed to") && strstr(out, "bus")) {
        fprintf(stderr, "   skip: systemd-analyze cannot run here: %s\n", out);
    } else {
        ck_assert_msg(rc == 0, "systemd-analyze verify failed:\n%s", out);
        ck_assert_msg(strstr(out, "rekv") == NULL, "systemd-analyze verify complains:\n%s", out);
    }
    free(out);
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && systemd-analyze security --offline=yes ./rekv-gpuworker@1.service 2>&1",
             dir);
    rc = tu_run(cmd, &out);
    const char *at = strstr(out, "Overall exposure level for rekv-gpuworker@1.service: ");
    if (at == NULL && strstr(out, "offline")) {
        fprintf(stderr, "   skip: this systemd-analyze cannot score a unit file offline\n");
    } else {
        ck_assert_msg(at != NULL, "systemd-analyze security (exit %d) gave no score:\n%s", rc, out);
        double score = atof(at + strlen("Overall exposure level for rekv-gpuworker@1.service: "));
        ck_assert_msg(score <= 4.0, "rekv-gpuworker@1.service: exposure %.1f > 4:\n%s", score, out);
        fprintf(stderr, "   rekv-gpuworker@1.service: exposure %.1f\n", score);
    }
    free(out);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* `make install` installs the template, its ExecStart in PREFIX/bin. */
START_TEST(make_install_installs_template)
{
    if (tu_run("command -v make >/dev/null 2>&1", NULL) != 0) {
        fprintf(stderr, "   skip: make is not installed\n");
        return;
    }
    char *d = tu_tmpdir(), cmd[8192], path[4600], *out = NULL;
    const char *build = getenv("REKV_BUILD");
    snprintf(cmd, sizeof(cmd),
             "env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make -s install BUILD='%s' DESTDIR='%s' "
             "PREFIX=/opt/rekv SYSCONFDIR=/etc 2>&1",
             build && *build ? build : "build", d);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "make install failed:\n%s", out);
    free(out);
    snprintf(path, sizeof(path), "%s/opt/rekv/lib/systemd/system/rekv-gpuworker@.service", d);
    char *text = tu_read_file(path, NULL);
    ck_assert_msg(text != NULL, "make install did not install %s", path);
    ck_assert_msg(strstr(text, "ExecStart=/opt/rekv/bin/rekv-gpuworker --name gpuworker-%i ") &&
                      !strstr(text, "/usr/bin/"),
                  "%s: ExecStart does not point at PREFIX/bin", path);
    free(text);
    tu_rmrf(d);
    free(d);
}
END_TEST

/* Compose's worker takes its --name from REKV_WORKER_NAME (set in its environment), so that a
 * copy of the service can have its own. */
START_TEST(compose_worker_name_from_env)
{
    char *text = tu_read_file("deploy/docker-compose.yml", NULL);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(strstr(text, "--name \"$${REKV_WORKER_NAME:-gpuworker}\"") &&
                      strstr(text, "REKV_WORKER_NAME: gpuworker"),
                  "compose's gpuworker does not take its --name from REKV_WORKER_NAME");
    ck_assert_msg(strstr(text, "--name gpuworker ") == NULL, "compose hard-codes --name gpuworker");
    free(text);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("deploy_names");
    TCase *tc = tcase_create("deploy_names");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, template_names_each_worker);
    tcase_add_test(tc, template_instance_verifies);
    tcase_add_test(tc, make_install_installs_template);
    tcase_add_test(tc, compose_worker_name_from_env);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
