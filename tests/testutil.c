/* testutil.c — see testutil.h. */
#define _GNU_SOURCE
#include "tests/testutil.h"

#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"

const char *tu_shared(const char *rel)
{
    static char *known[64]; /* each file's path, kept: callers hold them */
    static size_t n_known;
    char path[4096];
    snprintf(path, sizeof(path), "../shared/%s", rel);
    if (access(path, R_OK) != 0) {
        if (tu_ci())
            ck_abort_msg("required test file %s is missing (CI=true): ../shared must sit beside "
                         "the repository",
                         path);
        fprintf(stderr, "   skip: %s not found\n", path);
        return NULL;
    }
    for (size_t i = 0; i < n_known; i++)
        if (strcmp(known[i], path) == 0)
            return known[i];
    char *kept = strdup(path);
    ck_assert_msg(kept != NULL, "out of memory");
    if (n_known < sizeof(known) / sizeof(known[0]))
        known[n_known++] = kept;
    return kept;
}

int tu_ci(void)
{
    const char *ci = getenv("CI");
    return ci != NULL && strcmp(ci, "true") == 0;
}

int tu_run_suite(Suite *s)
{
    /* lines as they come, also into a pipe or a log (make test | tee): with CK_LOG_FILE_NAME=-
     * (tests/run_tests.sh sets it) Check prints each case's result to stdout as the case ends */
    setvbuf(stdout, NULL, _IOLBF, 0);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? 0 : 1;
}

int tu_run_suite_synth(Suite *(*suite)(void), const char *synth_args, char *dir, size_t dir_n,
                       char *model, size_t model_n)
{
    const char *base = getenv("TMPDIR");
    snprintf(dir, dir_n, "%s/rekv-test.XXXXXX", base && *base ? base : "/tmp");
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(model, model_n, "%s/m", dir);
    char cmd[8192];
    snprintf(cmd, sizeof(cmd), "%s synth %s %s >/dev/null", tu_bin("rekv-loader"), synth_args,
             model);
    int rc = 1;
    if (system(cmd) != 0)
        fprintf(stderr, "%s failed\n", cmd);
    else
        rc = tu_run_suite(suite());
    tu_rmrf(dir);
    return rc;
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

pid_t tu_spawn(const char *const *args, const char *errlog, int *status)
{
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    const char *argv[48];
    int n = 0;
    for (; args[n] && n < 40; n++)
        argv[n] = args[n];
    char fd[16];
    snprintf(fd, sizeof(fd), "%d", pfd[1]);
    argv[n++] = "--ready-fd";
    argv[n++] = fd;
    argv[n] = NULL;
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        if (errlog) {
            int lf = open(errlog, O_WRONLY | O_CREAT | O_APPEND, 0600);
            if (lf >= 0)
                dup2(lf, 2);
        }
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    struct pollfd p = {pfd[0], POLLIN, 0};
    ck_assert_msg(poll(&p, 1, 60000) == 1, "%s did not become ready", argv[0]);
    char buf[8] = {0};
    ssize_t got = read(pfd[0], buf, 7);
    close(pfd[0]);
    if (got != 6) {
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        if (status)
            *status = st;
        return -1;
    }
    return pid;
}

int tu_stop(pid_t pid)
{
    kill(pid, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return st;
}

void tu_kill9(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

int tu_file_has(const char *path, const char *needle)
{
    char *t = tu_read_file(path, NULL);
    int has = t && strstr(t, needle) != NULL;
    free(t);
    return has;
}

rekv_ctl *tu_ctl_open(const char *endpoint)
{
    rekv_ctl *c = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_connect(endpoint, NULL, &c, &err) == 0, "%s", err.msg);
    return c;
}

Rekv__Control__Response *tu_ctl_call(rekv_ctl *c, Rekv__Control__Request *rq)
{
    Rekv__Control__Response *r = NULL;
    rekv_err err = {0};
    rq->id = 0;
    ck_assert_msg(rekv_ctl_call(c, rq, 20000, &r, &err) == 0, "%s", err.msg);
    return r;
}

Rekv__Control__Response *tu_ctl_status(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__StatusRequest s = REKV__CONTROL__STATUS_REQUEST__INIT;
    s.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &s;
    return tu_ctl_call(c, &rq);
}

Rekv__Control__Response *tu_ctl_stats(rekv_ctl *c)
{
    Rekv__Control__StatsRequest s = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &s;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_int_eq(r->body_case, REKV__CONTROL__RESPONSE__BODY_STATS);
    return r;
}

void tu_ctl_wait_workers(rekv_ctl *c, uint32_t n)
{
    for (;;) {
        Rekv__Control__HealthRequest h = REKV__CONTROL__HEALTH_REQUEST__INIT;
        Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
        rq.body_case = REKV__CONTROL__REQUEST__BODY_HEALTH;
        rq.health = &h;
        Rekv__Control__Response *r = tu_ctl_call(c, &rq);
        uint32_t w = r->health ? r->health->workers : 0;
        rekv__control__response__free_unpacked(r, NULL);
        if (w == n)
            return;
        usleep(20000);
    }
}

long tu_proc_status_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    size_t n = strlen(field);
    long kb = -1;
    while (f && fgets(line, sizeof(line), f))
        if (strncmp(line, field, n) == 0 && line[n] == ':' && sscanf(line + n + 1, "%ld", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb;
}

int tu_spill_fd_number(pid_t pid, const char *spill_dir)
{
    char dir[64], link[4300], want[4300];
    snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
    snprintf(want, sizeof(want), "%s/", spill_dir);
    DIR *dd = opendir(dir);
    if (dd == NULL)
        return -1;
    struct dirent *e;
    int fd = -1;
    while (fd < 0 && (e = readdir(dd)) != NULL) {
        char path[400];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        ssize_t n = readlink(path, link, sizeof(link) - 1);
        if (n <= 0)
            continue;
        link[n] = '\0';
        if (strncmp(link, want, strlen(want)) == 0)
            fd = atoi(e->d_name);
    }
    closedir(dd);
    return fd;
}

int tu_spill_fd(pid_t pid, const char *spill_dir)
{
    int n = tu_spill_fd_number(pid, spill_dir);
    if (n < 0)
        return -1;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pid, n);
    return open(path, O_RDWR);
}

tu_span *tu_trace_spans(rekv_backend *be, size_t *n)
{
    char *dir = tu_tmpdir(), path[4200];
    snprintf(path, sizeof(path), "%s/trace.json", dir);
    rekv_err err = {0};
    ck_assert_msg(be->iface->trace_write(be, path, &err) == 0, "%s", err.msg);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr), *e;
    ck_assert_msg(root != NULL, "trace: %s", jerr.text);
    tu_rmrf(dir);
    free(dir);
    json_t *evs = json_object_get(root, "traceEvents");
    tu_span *out = calloc(json_array_size(evs) + 1, sizeof(*out));
    ck_assert(out != NULL);
    size_t i, k = 0;
    json_array_foreach(evs, i, e)
    {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        if (ph == NULL || strcmp(ph, "X") != 0)
            continue;
        json_int_t tid = json_integer_value(json_object_get(e, "tid"));
        size_t j;
        json_t *m;
        json_array_foreach(evs, j, m) /* the stream: its thread_name metadata event */
        {
            const char *mn = json_string_value(json_object_get(m, "name"));
            if (mn && strcmp(mn, "thread_name") == 0 &&
                json_integer_value(json_object_get(m, "tid")) == tid)
                snprintf(out[k].stream, sizeof(out[k].stream), "%s",
                         json_string_value(json_object_get(json_object_get(m, "args"), "name")));
        }
        const char *label = json_string_value(json_object_get(e, "name"));
        snprintf(out[k].label, sizeof(out[k].label), "%s", label ? label : "");
        out[k].start = json_number_value(json_object_get(e, "ts"));
        out[k].end = out[k].start + json_number_value(json_object_get(e, "dur"));
        k++;
    }
    json_decref(root);
    *n = k;
    return out;
}

void tu_run_ok(const char *cmd)
{
    char *out = NULL;
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "%s (exit %d): %s", cmd, rc, out ? out : "");
    free(out);
}

int tu_vm_self(const char *workdir, const char *env, const char *suite, const char *tcase)
{
    char cmd[8192], exe[4096], *out = NULL;
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    ck_assert_int_gt(n, 0);
    exe[n] = '\0';
    const char *build = getenv("REKV_BUILD");
    snprintf(cmd, sizeof(cmd),
             "tests/vm.sh '%s' --disk 64 -- env %s REKV_BUILD='%s' CK_RUN_SUITE=%s CK_RUN_CASE=%s "
             "'%s' 2>&1",
             workdir, env, build && *build ? build : "build", suite, tcase, exe);
    int rc = tu_run(cmd, &out);
    if (rc == 77) {
        ck_assert_msg(!tu_ci(), "no virtual machine can run (CI=true): %s", out);
        fprintf(stderr, "   %s", out);
        free(out);
        return 0;
    }
    ck_assert_msg(rc == 0, "tests/vm.sh failed (exit %d):\n%s", rc, out);
    free(out);
    return 1;
}

char *tu_vm_out(const char *workdir, const char *name)
{
    char path[4400];
    snprintf(path, sizeof(path), "%s/out/%s", workdir, name);
    char *text = tu_read_file(path, NULL);
    return text ? text : strdup("");
}

const char *tu_log_end(const char *log)
{
    size_t n = strlen(log);
    return log + (n > 2000 ? n - 2000 : 0);
}
