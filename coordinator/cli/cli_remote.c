/* cli_remote.c — `rekv generate` through the coordinator (the embedded default): use the
 * coordinator at the control socket when it serves the same model, otherwise start a private
 * local trio (`rekv run` in a temporary directory), submit the job, wait for it, and stop what
 * was started. The output is the same as `rekv generate --local`: the same ids, text and top
 * logits, since the worker samples exactly as rekv_generate does. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
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
#include "coordinator/cli/cli_daemon.h"
#include "coordinator/coordinator.h"
#include "gpuworker/gpuworker.h"

#define START_TIMEOUT_MS 120000
#define CALL_TIMEOUT_MS 30000

/* The model the coordinator at ep serves ("" when it has none), or -1 when nobody answers. */
static int health(const char *ep, char *model, size_t len, int timeout_ms)
{
    rekv_ctl *c = NULL;
    int rc = -1;
    if (rekv_ctl_connect(ep, NULL, &c, NULL))
        return -1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__HealthRequest h = REKV__CONTROL__HEALTH_REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_HEALTH;
    rq.health = &h;
    Rekv__Control__Response *r = NULL;
    if (rekv_ctl_call(c, &rq, timeout_ms, &r, NULL) == 0 && r->code == REKV__CONTROL__CODE__OK &&
        r->body_case == REKV__CONTROL__RESPONSE__BODY_HEALTH && r->health->serving) {
        snprintf(model, len, "%s", r->health->model ? r->health->model : "");
        rc = 0;
    }
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    return rc;
}

static int same_file(const char *a, const char *b)
{
    char ra[PATH_MAX], rb[PATH_MAX];
    return realpath(a, ra) && realpath(b, rb) && strcmp(ra, rb) == 0;
}

/* Starts `rekv run --model PATH --dir DIR` and waits until it is ready; 0 or -errno. */
static int start_trio(const char *model_path, const char *dir, pid_t *pid, rekv_err *err)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) < 0)
        return rekv_errf(err, -errno, "pipe: %s", strerror(errno));
    pid_t parent = getpid();
    pid_t p = fork();
    if (p < 0) {
        close(pfd[0]);
        close(pfd[1]);
        return rekv_errf(err, -errno, "fork: %s", strerror(errno));
    }
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* the trio lives no longer than this command */
        if (getppid() != parent)
            _exit(1);
        char fd[16];
        snprintf(fd, sizeof(fd), "%d", pfd[1]);
        fcntl(pfd[1], F_SETFD, 0);
        setenv("REKV_LOG", "warn", 0);
        char *argv[] = {"rekv",       "run", "--model", (char *)model_path, "--dir", (char *)dir,
                        "--ready-fd", fd,    NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(pfd[1]);
    char buf[16] = {0};
    struct pollfd pf = {pfd[0], POLLIN, 0};
    int n = poll(&pf, 1, START_TIMEOUT_MS) > 0 ? (int)read(pfd[0], buf, sizeof(buf) - 1) : 0;
    close(pfd[0]);
    if (n <= 0 || strncmp(buf, "READY", 5) != 0) {
        kill(p, SIGTERM);
        waitpid(p, NULL, 0);
        return rekv_errf(err, -EIO, "the local rekv run did not start (see its messages above)");
    }
    *pid = p;
    return 0;
}

static void stop_trio(pid_t pid, const char *dir)
{
    if (pid > 0) {
        kill(pid, SIGTERM);
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
    }
    if (dir && *dir) {
        char cmd[PATH_MAX + 32];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
        if (system(cmd) != 0) { /* nothing more to do: a leftover temp dir is harmless */
        }
    }
}

int cli_generate_remote(const char *model_path, const char *socket, const int32_t *ids, int n_ids,
                        const rekv_gen_params *gp, rekv_gen_result *res, double *queued_s,
                        double *run_s, rekv_err *err)
{
    static char reason[32];
    char ep[PATH_MAX + 16], dir[PATH_MAX] = "", model[PATH_MAX];
    pid_t pid = 0;
    rekv_ctl *c = NULL;
    Rekv__Control__Response *r = NULL;
    int rc = 0;
    memset(res, 0, sizeof(*res));
    if (socket)
        snprintf(ep, sizeof(ep), "%s", socket);
    else if ((rc = rekv_default_control_endpoint(ep, sizeof(ep), err)))
        return rc;
    int up = health(ep, model, sizeof(model), 1000) == 0;
    if (up && !same_file(model, model_path)) {
        if (socket)
            return rekv_errf(err, -EINVAL,
                             "the coordinator at %s serves %s, not %s (use --local to run here)",
                             ep, *model ? model : "no model", model_path);
        up = 0; /* the default socket serves another model: run a private trio instead */
    }
    if (!up) {
        if (socket)
            return rekv_errf(err, -ECONNREFUSED, "no coordinator answers at %s", socket);
        const char *tmp = getenv("TMPDIR");
        snprintf(dir, sizeof(dir), "%s/rekv-run.XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (mkdtemp(dir) == NULL)
            return rekv_errf(err, -errno, "%s: %s", dir, strerror(errno));
        if ((rc = start_trio(model_path, dir, &pid, err)))
            goto out;
        snprintf(ep, sizeof(ep), "ipc://%s/control", dir);
    }
    if ((rc = rekv_ctl_connect(ep, NULL, &c, err)))
        goto out;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__Submit sb = REKV__CONTROL__SUBMIT__INIT;
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    smp.temperature = gp->temperature;
    smp.top_k = (uint32_t)gp->top_k;
    smp.top_p = gp->top_p;
    smp.seed = gp->seed;
    sb.sampling = &smp;
    sb.prompt_ids = (int32_t *)ids;
    sb.n_prompt_ids = (size_t)n_ids;
    sb.max_new_tokens = (uint32_t)gp->max_new_tokens;
    sb.stop_at_eos = gp->stop_at_eos;
    sb.top_logits = (uint32_t)gp->top_logits;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    /* a busy queue is a reason to wait, not to fail; a lost reply is sent again under the same
     * key (a BUSY answer accepted nothing, so the key stays free for the next try) */
    char key[REKV_CLIENT_KEY_MAX + 1];
    for (;;) {
        if ((rc = cli_submit_call(c, &rq, key, CALL_TIMEOUT_MS, 4, &r, err)))
            goto out;
        if (r->code != REKV__CONTROL__CODE__BUSY)
            break;
        rekv__control__response__free_unpacked(r, NULL);
        r = NULL;
        usleep(100000);
    }
    if (r->code != REKV__CONTROL__CODE__OK) {
        rc = rekv_errf(err, -EINVAL, "the coordinator refused the job: %s", r->error);
        goto out;
    }
    uint64_t job = r->submitted->job;
    rekv__control__response__free_unpacked(r, NULL);
    r = NULL;
    Rekv__Control__StatusRequest st = REKV__CONTROL__STATUS_REQUEST__INIT;
    st.job = job;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &st;
    rq.id = 0;
    /* a long run shows its progress on a terminal (stderr: stdout stays the result) */
    int tty = isatty(STDERR_FILENO), shown = 0;
    uint64_t t_start = rekv_now_ns(), t_shown = t_start;
    for (int wait_ms = 1;; wait_ms = wait_ms < 50 ? wait_ms * 2 : 50) {
        if ((rc = rekv_ctl_call(c, &rq, CALL_TIMEOUT_MS, &r, err)))
            goto out;
        if (r->code != REKV__CONTROL__CODE__OK ||
            r->body_case != REKV__CONTROL__RESPONSE__BODY_JOB) {
            rc = rekv_errf(err, -EIO, "job %llu: %s", (unsigned long long)job, r->error);
            goto out;
        }
        Rekv__Control__JobState s = r->job->state;
        uint64_t now = rekv_now_ns();
        if (tty && now - t_shown > 500000000ull && s != REKV__CONTROL__JOB_STATE__DONE) {
            double el = (double)(now - t_start) * 1e-9;
            fprintf(stderr, "\r  %s: %zu tokens, %.1f tokens/s   ", rekv_ctl_state_name(s),
                    r->job->n_generated_ids, el > 0 ? (double)r->job->n_generated_ids / el : 0.0);
            t_shown = now;
            shown = 1;
        }
        if (s == REKV__CONTROL__JOB_STATE__DONE)
            break;
        if (s == REKV__CONTROL__JOB_STATE__FAILED || s == REKV__CONTROL__JOB_STATE__CANCELLED) {
            rc = rekv_errf(err, -EIO, "job %llu %s: %s", (unsigned long long)job,
                           rekv_ctl_state_name(s), *r->job->error ? r->job->error : "no reason");
            goto out;
        }
        rekv__control__response__free_unpacked(r, NULL);
        r = NULL;
        usleep((useconds_t)wait_ms * 1000);
        rq.id = 0;
    }
    if (shown)
        fprintf(stderr, "\n");
    Rekv__Control__JobStatus *js = r->job;
    size_t n = js->n_generated_ids, k = (size_t)gp->top_logits;
    res->n = (int)n;
    res->ids = malloc(sizeof(int32_t) * (n ? n : 1));
    if (k) {
        res->top_ids = malloc(sizeof(int32_t) * (n ? n * k : 1));
        res->top_vals = malloc(sizeof(float) * (n ? n * k : 1));
    }
    if (!res->ids || (k && (!res->top_ids || !res->top_vals))) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto out;
    }
    memcpy(res->ids, js->generated_ids, sizeof(int32_t) * n);
    if (k) {
        if (js->top_logits != k || js->n_top_ids != n * k || js->n_top_vals != n * k) {
            rc = rekv_errf(err, -EPROTO, "the coordinator returned no top logits for job %llu",
                           (unsigned long long)job);
            goto out;
        }
        memcpy(res->top_ids, js->top_ids, sizeof(int32_t) * n * k);
        memcpy(res->top_vals, js->top_vals, sizeof(float) * n * k);
    }
    snprintf(reason, sizeof(reason), "%s", js->finish_reason);
    res->finish_reason = reason;
    *queued_s = js->queued_s;
    *run_s = js->run_s;
out:
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    stop_trio(pid, dir);
    if (rc)
        rekv_gen_result_free(res);
    return rc;
}
