/* cli_bench_trio.c — the private trio of the serving benchmarks (`rekv bench serve`, `http`,
 * `remote`): `rekv run` (cli_run in a forked child, as cli_remote.c does) in a new temporary
 * directory, given the bench's options, ready once it says READY; the trio's daemons' CPU time,
 * read from /proc, for the benchmarks that divide it by the tokens they made; and what the
 * benchmarks share besides: percentiles, a finished job's answer, a model's configuration. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_bench.h"
#include "coordinator/cli/cli_daemon.h"

#define START_TIMEOUT_MS 120000

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

int cli_rm_tree(const char *dir)
{
    if (nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT) {
        fprintf(stderr, "rekv: could not remove %s: %s\n", dir, strerror(errno));
        return -1;
    }
    return 0;
}

void cli_trio_stop(cli_trio *t)
{
    if (t->pid > 0) {
        kill(t->pid, SIGTERM);
        while (waitpid(t->pid, NULL, 0) < 0 && errno == EINTR)
            ;
        t->pid = 0;
    }
    if (t->dir[0])
        cli_rm_tree(t->dir);
    t->dir[0] = '\0';
}

int cli_trio_start(cli_trio *t, const char *bench, const char *const *args)
{
    memset(t, 0, sizeof(*t));
    const char *tmp = getenv("TMPDIR");
    snprintf(t->dir, sizeof(t->dir), "%s/rekv-bench.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(t->dir) == NULL) {
        fprintf(stderr, "rekv bench %s: %s: %s\n", bench, t->dir, strerror(errno));
        t->dir[0] = '\0';
        return -1;
    }
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) < 0) {
        fprintf(stderr, "rekv bench %s: pipe: %s\n", bench, strerror(errno));
        cli_trio_stop(t);
        return -1;
    }
    char fd[16];
    snprintf(fd, sizeof(fd), "%d", pfd[1]);
    char *argv[64];
    int n = 0;
    argv[n++] = "rekv run";
    for (int i = 0; args[i] && n < 58; i++)
        argv[n++] = (char *)args[i];
    argv[n++] = "--dir";
    argv[n++] = t->dir;
    argv[n++] = "--ready-fd";
    argv[n++] = fd;
    argv[n] = NULL;
    fflush(NULL);
    pid_t parent = getpid(), p = fork();
    if (p < 0) {
        fprintf(stderr, "rekv bench %s: fork: %s\n", bench, strerror(errno));
        close(pfd[0]);
        close(pfd[1]);
        cli_trio_stop(t);
        return -1;
    }
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* the trio lives no longer than the bench */
        if (getppid() != parent)
            _exit(1);
        close(pfd[0]);
        setenv("REKV_LOG", "warn", 0);
        _exit(cli_run(n, argv));
    }
    close(pfd[1]);
    t->pid = p;
    char buf[16] = {0};
    struct pollfd pf = {pfd[0], POLLIN, 0};
    int r;
    do
        r = poll(&pf, 1, START_TIMEOUT_MS);
    while (r < 0 && errno == EINTR);
    ssize_t got = r > 0 ? read(pfd[0], buf, sizeof(buf) - 1) : 0;
    close(pfd[0]);
    if (got <= 0 || strncmp(buf, "READY", 5) != 0) {
        fprintf(stderr, "rekv bench %s: the trio did not start (see above)\n", bench);
        cli_trio_stop(t);
        return -1;
    }
    return 0;
}

/* utime + stime of /proc/PID/stat, in seconds; -1 when it cannot be read. The comm field is in
 * parentheses and may hold spaces, so the fields are counted from its closing one. */
static double proc_cpu_s(pid_t pid, pid_t *ppid, char *comm, size_t comm_len)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *lp = strchr(buf, '('), *rp = strrchr(buf, ')');
    if (!lp || !rp)
        return -1;
    if (comm)
        snprintf(comm, comm_len, "%.*s", (int)(rp - lp - 1), lp + 1);
    int pp = 0;
    unsigned long long ut = 0, st = 0;
    /* after ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
    if (sscanf(rp + 2, "%*c %d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &pp, &ut, &st) != 3)
        return -1;
    if (ppid)
        *ppid = pp;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

pid_t cli_trio_child(const cli_trio *t, const char *prog)
{
    DIR *d = opendir("/proc");
    struct dirent *e;
    pid_t found = 0;
    while (d && !found && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        pid_t pp = 0;
        char comm[64];
        if (*end || pid <= 0 || proc_cpu_s((pid_t)pid, &pp, comm, sizeof(comm)) < 0)
            continue;
        /* comm is the program's name cut at 15 characters: "rekv-coordinat" */
        if (pp == t->pid && strncmp(comm, prog, strlen(comm)) == 0)
            found = (pid_t)pid;
    }
    if (d)
        closedir(d);
    return found;
}

double cli_proc_cpu_s(pid_t pid)
{
    return pid > 0 ? proc_cpu_s(pid, NULL, NULL, 0) : -1;
}

int cli_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double cli_percentile(double *v, size_t n, double p)
{
    if (n == 0)
        return 0;
    qsort(v, n, sizeof(*v), cli_cmp_double);
    size_t k = (size_t)ceil(p / 100.0 * (double)n);
    return v[k ? k - 1 : 0];
}

int cli_job_answer(rekv_ctl *c, const char *bench, uint64_t job, int32_t **out, uint32_t *n_out,
                   uint32_t *cached)
{
    Rekv__Control__StatusRequest s = REKV__CONTROL__STATUS_REQUEST__INIT;
    s.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &s;
    Rekv__Control__Response *r = NULL;
    rekv_err err = {0};
    int rc = -1;
    if (rekv_ctl_call(c, &rq, 10000, &r, &err) || r->body_case != REKV__CONTROL__RESPONSE__BODY_JOB) {
        fprintf(stderr, "rekv bench %s: Status: %s\n", bench,
                r ? rekv_ctl_code_name(r->code) : err.msg);
    } else if ((*out = malloc(sizeof(int32_t) * (r->job->n_generated_ids + 1))) != NULL) {
        memcpy(*out, r->job->generated_ids, sizeof(int32_t) * r->job->n_generated_ids);
        *n_out = (uint32_t)r->job->n_generated_ids;
        *cached = r->job->cached_tokens;
        rc = 0;
    }
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    return rc;
}

int cli_bench_recv(rekv_ctl *c, const char *bench, Rekv__Control__Response **r, uint64_t *at)
{
    uint64_t since = rekv_now_ns();
    for (;;) {
        rekv_err err = {0};
        int rc = rekv_ctl_recv(c, 100, r, &err);
        *at = rekv_now_ns();
        if (rc == 0)
            return 0;
        if (rc != -ETIMEDOUT || *at - since >= (uint64_t)CLI_BENCH_SILENCE_MS * 1000000ull) {
            fprintf(stderr, "rekv bench %s: %s\n", bench,
                    rc == -ETIMEDOUT ? "nothing from the coordinator for too long" : err.msg);
            return -1;
        }
    }
}

int cli_model_config(const char *path, rekv_model_config *cfg)
{
    rekv_err err = {0};
    rekv_model *model = NULL;
    if (rekv_model_open(path, &model, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        return 1;
    }
    *cfg = model->config;
    rekv_model_close(model);
    return 0;
}

