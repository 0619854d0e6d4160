/* testutil.c — see testutil.h. */
#define _GNU_SOURCE
#include "tests/testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

const char *tu_shared(const char *rel)
{
    static char path[4096];
    snprintf(path, sizeof(path), "../shared/%s", rel);
    if (access(path, R_OK) == 0)
        return path;
    const char *ci = getenv("CI");
    if (ci != NULL && strcmp(ci, "true") == 0)
        ck_abort_msg("required test file %s is missing (CI=true): ../shared must sit beside the "
                     "repository",
                     path);
    fprintf(stderr, "   skip: %s not found\n", path);
    return NULL;
}

int tu_run_suite(Suite *s)
{
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? 0 : 1;
}

char *tu_tmpdir(void)
{
    const char *base = getenv("TMPDIR");
    char tmpl[4096];
    snprintf(tmpl, sizeof(tmpl), "%s/rekv-test.XXXXXX", base ? base : "/tmp");
    char *d = mkdtemp(tmpl);
    ck_assert_msg(d != NULL, "mkdtemp failed");
    return strdup(d);
}

void tu_rmrf(const char *path)
{
    if (path == NULL || strncmp(path, "/tmp", 4) != 0)
        return;
    char cmd[4200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", path);
    if (system(cmd) != 0)
        fprintf(stderr, "   warning: could not remove %s\n", path);
}

char *tu_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t r;
    while (buf && (r = fread(buf + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) {
            cap *= 2;
            char *nb = realloc(buf, cap + 1);
            if (nb == NULL) {
                free(buf);
                buf = NULL;
            }
            buf = nb;
        }
    }
    fclose(f);
    if (buf == NULL)
        return NULL;
    buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}

const char *tu_bin(const char *name)
{
    static char path[4096];
    const char *build = getenv("REKV_BUILD");
    snprintf(path, sizeof(path), "%s/bin/%s", build && *build ? build : "build", name);
    return path;
}

int tu_run(const char *cmd, char **out)
{
    FILE *p = popen(cmd, "r");
    if (p == NULL)
        return -1;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n, p)) > 0) {
        n += r;
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
    }
    buf[n] = '\0';
    int st = pclose(p);
    if (out)
        *out = buf;
    else
        free(buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
