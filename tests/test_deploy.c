/* test_deploy.c — the deploy/ files are accepted by their tools: `systemd-analyze verify` on the
 * three units (ExecStart pointed at the freshly built binaries, since verify checks that they
 * exist), and `docker compose config` on the compose file. Each part is skipped, with a message,
 * where its tool is missing or cannot run here. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

static const char *const units[] = {"rekv-kvstore", "rekv-gpuworker", "rekv-coordinator"};

START_TEST(systemd_units_verify)
{
    if (tu_run("command -v systemd-analyze >/dev/null 2>&1", NULL) != 0) {
        fprintf(stderr, "   skip: systemd-analyze is not installed\n");
        return;
    }
    char *dir = tu_tmpdir();
    char cwd[2048];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof(cwd)));
    char bindir[4096];
    snprintf(bindir, sizeof(bindir), "%s/%s", cwd, tu_bin(""));
    char cmd[16384];
    size_t off = (size_t)snprintf(cmd, sizeof(cmd), "systemd-analyze verify");
    for (size_t i = 0; i < 3; i++) {
        char src[256], dst[4200];
        snprintf(src, sizeof(src), "deploy/systemd/%s.service", units[i]);
        snprintf(dst, sizeof(dst), "%s/%s.service", dir, units[i]);
        char *text = tu_read_file(src, NULL);
        ck_assert_msg(text != NULL, "%s is missing", src);
        ck_assert_msg(strstr(text, "Type=notify") && strstr(text, "Restart=on-failure") &&
                          strstr(text, "EnvironmentFile=-/etc/rekv/rekv.env") &&
                          strstr(text, "RuntimeDirectory=rekv"),
                      "%s lacks a required setting", src);
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
        off += (size_t)snprintf(cmd + off, sizeof(cmd) - off, " '%s'", dst);
    }
    snprintf(cmd + off, sizeof(cmd) - off, " 2>&1");
    char *out = NULL;
    int rc = tu_run(cmd, &out);
    if (rc != 0 && strstr(out, "Failed to") && strstr(out, "bus")) {
        fprintf(stderr, "   skip: systemd-analyze cannot run here: %s\n", out);
    } else {
        ck_assert_msg(rc == 0, "systemd-analyze verify failed:\n%s", out);
        ck_assert_msg(strstr(out, "rekv") == NULL, "systemd-analyze verify complains:\n%s", out);
    }
    free(out);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

START_TEST(compose_config)
{
    const char *tool = NULL;
    if (tu_run("docker compose version >/dev/null 2>&1", NULL) == 0)
        tool = "docker compose";
    else if (tu_run("docker-compose version >/dev/null 2>&1", NULL) == 0)
        tool = "docker-compose";
    if (tool == NULL) {
        fprintf(stderr, "   skip: neither `docker compose` nor docker-compose can run here\n");
        return;
    }
    char cmd[512], *out = NULL;
    snprintf(cmd, sizeof(cmd), "%s -f deploy/docker-compose.yml config -q 2>&1", tool);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "%s config rejects deploy/docker-compose.yml:\n%s", tool, out);
    free(out);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("deploy");
    TCase *tc = tcase_create("deploy");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, systemd_units_verify);
    tcase_add_test(tc, compose_config);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return tu_run_suite(suite()); }
