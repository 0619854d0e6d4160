/* cli_remote.c — `rekv generate` through the coordinator (the embedded default): use the
 * coordinator at the control socket when it serves the same model, otherwise start a private
 * local trio (`rekv run` in a temporary directory), submit the job, wait for it, and stop what
 * was started. The output is the same as `rekv generate --local`: the same ids, text and top
 * logits, since the worker samples exactly as rekv_generate does.
 *
 * SIGINT and SIGTERM, from when the temporary directory is made until cli_remote_end, go to a
 * handler that writes the signal to a pipe every wait here polls beside its socket or pipe: the
 * call gives up (-EINTR) and cli_remote_end stops the trio and removes the directory (nftw), so an
 * interrupted generate leaves nothing behind; on a serving coordinator its job is cancelled. A
 * handler rather than a blocked mask: a signal sent to the process may be delivered to any thread
 * that does not block it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

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

/* ---------------------------------------------------------------- interruption */

static volatile sig_atomic_t g_signal; /* the first SIGINT/SIGTERM since cli_remote_begin */
static int g_signal_fd = -1;           /* the write end of the active cli_remote's pipe */

static void on_signal(int sig)
{
    int saved = errno;
    if (g_signal == 0)
        g_signal = sig;
    unsigned char b = (unsigned char)sig;
    if (g_signal_fd >= 0 && write(g_signal_fd, &b, 1) < 0) { /* full: one byte is enough */
    }
    errno = saved;
}

static const int caught[2] = {SIGINT, SIGTERM};

static int remote_begin(cli_remote *rm, rekv_err *err)
{
    memset(rm, 0, sizeof(*rm));
    rm->sig_fd[0] = rm->sig_fd[1] = -1;
    if (pipe2(rm->sig_fd, O_CLOEXEC | O_NONBLOCK) < 0)
        return rekv_errf(err, -errno, "pipe: %s", strerror(errno));
    g_signal = 0;
    g_signal_fd = rm->sig_fd[1];
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 2; i++)
        sigaction(caught[i], &sa, &rm->old_action[i]);
    rm->installed = 1;
    return 0;
}

/* A pollfd that becomes readable when the call is interrupted. */
static struct pollfd sig_pollfd(const cli_remote *rm)
{
    return (struct pollfd){rm->sig_fd[0], POLLIN, 0};
}

static int interrupted(rekv_err *err)
{
    return rekv_errf(err, -EINTR, "interrupted by SIG%s",
                     sigabbrev_np(g_signal ? g_signal : SIGINT));
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

int cli_remote_end(cli_remote *rm)
{
    if (rm->pid > 0) {
        kill(rm->pid, SIGTERM);
        while (waitpid(rm->pid, NULL, 0) < 0 && errno == EINTR)
            ;
        rm->pid = 0;
    }
    /* the trio has stopped: nothing writes in the directory any more */
    if (rm->dir[0] && nftw(rm->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
        fprintf(stderr, "rekv: could not remove %s: %s\n", rm->dir, strerror(errno));
    rm->dir[0] = '\0';
    int sig = 0;
    if (rm->installed) {
        for (int i = 0; i < 2; i++)
            sigaction(caught[i], &rm->old_action[i], NULL);
        sig = g_signal;
        g_signal_fd = -1;
        rm->installed = 0;
    }
    for (int i = 0; i < 2; i++)
        if (rm->sig_fd[i] >= 0) {
            close(rm->sig_fd[i]);
            rm->sig_fd[i] = -1;
        }
    return sig;
}

/* Starts `rekv run --model PATH --dir DIR` (cli_run in a child) and waits until it is ready; 0 or
 * -errno (-EINTR when interrupted; rm->pid is then set for cli_remote_end to stop). */
static int start_trio(cli_remote *rm, const char *model_path, rekv_err *err)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) < 0)
        return rekv_errf(err, -errno, "pipe: %s", strerror(errno));
    pid_t parent = getpid();
    /* the child must not run our handler: SIGINT/SIGTERM stay blocked (pending) across the fork,
     * for `rekv run`'s signalfd */
    sigset_t stop, old;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    sigprocmask(SIG_BLOCK, &stop, &old);
    pid_t p = fork();
    if (p < 0) {
        rekv_errf(err, -errno, "fork: %s", strerror(errno));
        sigprocmask(SIG_SETMASK, &old, NULL);
        close(pfd[0]);
        close(pfd[1]);
        return err ? err->code : -EAGAIN;
    }
    if (p == 0) {
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* the trio lives no longer than this command */
        if (getppid() != parent)
            _exit(1);
        char fd[16];
        snprintf(fd, sizeof(fd), "%d", pfd[1]);
        close(pfd[0]);
        close(rm->sig_fd[0]);
        close(rm->sig_fd[1]);
        setenv("REKV_LOG", "warn", 0);
        /* one job: a batch of one (the worker sizes its device buffers for its batch) */
        char *argv[] = {"rekv run",    "--model", (char *)model_path, "--dir", rm->dir,
                        "--max-batch", "1",       "--ready-fd",       fd,      NULL};
        /* `rekv run` in this forked child rather than exec'd: this binary's libraries (CUDA's
         * among them) are loaded already, which saves the second of loading them again */
        _exit(cli_run(9, argv));
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    close(pfd[1]);
    rm->pid = p;
    char buf[16] = {0};
    struct pollfd pf[2] = {{pfd[0], POLLIN, 0}, sig_pollfd(rm)};
    int r;
    do
        r = poll(pf, 2, START_TIMEOUT_MS);
    while (r < 0 && errno == EINTR && !g_signal);
    int n = r > 0 && (pf[0].revents & (POLLIN | POLLHUP)) && !g_signal
                ? (int)read(pfd[0], buf, sizeof(buf) - 1)
                : 0;
    close(pfd[0]);
    if (g_signal)
        return interrupted(err);
    if (n <= 0 || strncmp(buf, "READY", 5) != 0)
        return rekv_errf(err, -EIO, "the local rekv run did not start (see its messages above)");
    return 0;
}

/* Waits up to timeout_ms for the response to request id (other ids are dropped); gives up when
 * the call is interrupted. */
static int wait_reply(const cli_remote *rm, rekv_ctl *c, uint64_t id, int timeout_ms,
                      Rekv__Control__Response **r, rekv_err *err)
{
    uint64_t deadline = rekv_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        struct pollfd sp = sig_pollfd(rm);
        zmq_pollitem_t it[2] = {{rekv_ctl_socket(c), 0, ZMQ_POLLIN, 0},
                                {NULL, sp.fd, ZMQ_POLLIN, 0}};
        uint64_t now = rekv_now_ns();
        if (now >= deadline)
            return rekv_errf(err, -ETIMEDOUT, "no reply from the coordinator within %d ms",
                             timeout_ms);
        int n = zmq_poll(it, 2, (long)((deadline - now) / 1000000ull) + 1);
        if (g_signal)
            return interrupted(err);
        if (n < 0 && errno != EINTR)
            return rekv_errf(err, -errno, "control poll: %s", zmq_strerror(errno));
        if (n <= 0 || !(it[0].revents & ZMQ_POLLIN))
            continue;
        int rc = rekv_ctl_recv(c, 0, r, err);
        if (rc)
            return rc;
        if ((*r)->id == id)
            return 0;
        rekv__control__response__free_unpacked(*r, NULL);
        *r = NULL;
    }
}

/* rekv_ctl_call that gives up when the call is interrupted. */
static int call(const cli_remote *rm, rekv_ctl *c, Rekv__Control__Request *rq,
                Rekv__Control__Response **r, rekv_err *err)
{
    uint64_t id;
    int rc = rekv_ctl_send(c, rq, &id, err);
    return rc ? rc : wait_reply(rm, c, id, CALL_TIMEOUT_MS, r, err);
}

/* Sleeps ms, or less when the call is interrupted; 0 or -EINTR. */
static int nap(const cli_remote *rm, int ms, rekv_err *err)
{
    struct pollfd sp = sig_pollfd(rm);
    if (poll(&sp, 1, ms) != 0 || g_signal)
        return g_signal || (sp.revents & POLLIN) ? interrupted(err) : 0;
    return 0;
}

/* The coordinator for model_path, its endpoint into ep: the one at socket (which must serve it),
 * else the default control socket's when it serves it, else a private trio started in rm->dir. */
static int remote_endpoint(cli_remote *rm, const char *model_path, const char *socket, char *ep,
                           size_t len, rekv_err *err)
{
    char model[PATH_MAX];
    int rc;
    if (socket)
        snprintf(ep, len, "%s", socket);
    else if ((rc = rekv_client_control_endpoint(ep, len, err)))
        return rc;
    /* a socket that does not exist, or that nobody listens on, is no coordinator: no probe */
    rekv_err probe = {0};
    int reachable = cli_ctl_reachable(ep, &probe) == 0;
    if (!reachable && socket)
        return rekv_errf(err, probe.code, "%s", probe.msg);
    int up = reachable && health(ep, model, sizeof(model), 1000) == 0;
    if (up && !same_file(model, model_path)) {
        if (socket)
            return rekv_errf(err, -EINVAL,
                             "the coordinator at %s serves %s, not %s (use --local to run here)",
                             ep, *model ? model : "no model", model_path);
        up = 0; /* the default socket serves another model: run a private trio instead */
    }
    if (up)
        return 0;
    if (socket)
        return rekv_errf(err, -ECONNREFUSED, "no coordinator answers at %s", socket);
    const char *tmp = getenv("TMPDIR");
    snprintf(rm->dir, sizeof(rm->dir), "%s/rekv-run.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(rm->dir) == NULL) {
        rc = rekv_errf(err, -errno, "%s: %s", rm->dir, strerror(errno));
        rm->dir[0] = '\0';
        return rc;
    }
    if ((rc = start_trio(rm, model_path, err)))
        return rc;
    snprintf(ep, len, "ipc://%s/control", rm->dir);
    return 0;
}

/* Submits the job on *c (connected to ep; a new connection after BUSY), waiting while the queue is
 * busy; *r holds the accepting reply, *req_id the request id the job's events carry. */
static int remote_submit(const cli_remote *rm, rekv_ctl **c, const char *ep, const int32_t *ids,
                         int n_ids, const rekv_gen_params *gp, Rekv__Control__Response **r,
                         uint64_t *req_id, rekv_err *err)
{
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
    sb.stream = 1; /* its events tell when the job is over */
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    /* a busy queue is a reason to wait, not to fail; a lost reply is sent again under the same
     * key (a BUSY answer accepted nothing, so the key stays free for the next try) */
    char key[REKV_CLIENT_KEY_MAX + 1];
    int rc;
    for (;;) {
        if ((rc = cli_submit_call(*c, &rq, key, CALL_TIMEOUT_MS, 4, r, err)))
            return rc;
        if ((*r)->code != REKV__CONTROL__CODE__BUSY)
            break;
        rekv__control__response__free_unpacked(*r, NULL);
        *r = NULL;
        if ((rc = nap(rm, 100, err)))
            return rc;
        rq.id = 0;
        /* a new connection: BUSY may mean this one is over the coordinator's --max-clients,
         * and it would stay so */
        rekv_ctl_close(*c);
        *c = NULL;
        if ((rc = rekv_ctl_connect(ep, NULL, c, err)))
            return rc;
    }
    if ((*r)->code != REKV__CONTROL__CODE__OK)
        return rekv_errf(err, -EINVAL, "the coordinator refused the job: %s", (*r)->error);
    *req_id = rq.id;
    return 0;
}

/* The job's status into *r (freed first), interrupted as the call is. */
static int remote_status(const cli_remote *rm, rekv_ctl *c, uint64_t job,
                         Rekv__Control__Response **r, rekv_err *err)
{
    Rekv__Control__StatusRequest st = REKV__CONTROL__STATUS_REQUEST__INIT;
    st.job = job;
    Rekv__Control__Request srq = REKV__CONTROL__REQUEST__INIT;
    srq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    srq.status = &st;
    rekv__control__response__free_unpacked(*r, NULL);
    *r = NULL;
    int rc = call(rm, c, &srq, r, err);
    if (rc == 0 && ((*r)->code != REKV__CONTROL__CODE__OK ||
                    (*r)->body_case != REKV__CONTROL__RESPONSE__BODY_JOB))
        rc = rekv_errf(err, -EIO, "job %llu: %s", (unsigned long long)job, (*r)->error);
    return rc;
}

/* Waits until the job is over: its events say so the moment it is (sub_id: the request id they
 * carry); after a silence its status. A long run shows its progress on a terminal (stderr: stdout
 * stays the result); *shown when it did. */
static int remote_wait(const cli_remote *rm, rekv_ctl *c, uint64_t job, uint64_t sub_id,
                       Rekv__Control__Response **r, int *shown, rekv_err *err)
{
    int tty = isatty(STDERR_FILENO), rc;
    uint64_t t_start = rekv_now_ns(), t_shown = t_start;
    for (;;) {
        rekv__control__response__free_unpacked(*r, NULL);
        *r = NULL;
        rc = wait_reply(rm, c, sub_id, CALL_TIMEOUT_MS, r, err);
        if (rc == -ETIMEDOUT) { /* a long step, or a coordinator gone: ask */
            rekv_err_clear(err);
            if ((rc = remote_status(rm, c, job, r, err)))
                return rc;
            if ((*r)->job->state == REKV__CONTROL__JOB_STATE__QUEUED ||
                (*r)->job->state == REKV__CONTROL__JOB_STATE__RUNNING)
                continue;
            return 0;
        }
        if (rc)
            return rc;
        if ((*r)->body_case != REKV__CONTROL__RESPONSE__BODY_EVENT)
            continue;
        const Rekv__Control__StreamEvent *ev = (*r)->event;
        uint64_t now = rekv_now_ns(), n_tok = ev->offset + ev->n_tokens;
        if (tty && now - t_shown > 500000000ull && !ev->done) {
            double el = (double)(now - t_start) * 1e-9;
            fprintf(stderr, "\r  %s: %llu tokens, %.1f tokens/s   ", rekv_ctl_state_name(ev->state),
                    (unsigned long long)n_tok, el > 0 ? (double)n_tok / el : 0.0);
            t_shown = now;
            *shown = 1;
        }
        if (ev->done)
            return 0;
    }
}

/* An interrupted wait: the job is cancelled, so that it does not run on without anyone waiting
 * (a private trio stops anyway). Not interruptible itself: the signal is already in the pipe. */
static void remote_cancel(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__Cancel cn = REKV__CONTROL__CANCEL__INIT;
    cn.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    rq.cancel = &cn;
    Rekv__Control__Response *r = NULL;
    if (rekv_ctl_call(c, &rq, 2000, &r, NULL) == 0)
        rekv__control__response__free_unpacked(r, NULL);
}

/* The finished job (js) as rekv_generate's result: ids, top logits, finish reason, times. */
static int remote_result(const Rekv__Control__JobStatus *js, const rekv_gen_params *gp,
                         rekv_gen_result *res, double *queued_s, double *run_s, rekv_err *err)
{
    static char reason[32];
    size_t n = js->n_generated_ids, k = (size_t)gp->top_logits;
    res->n = (int)n;
    res->ids = malloc(sizeof(int32_t) * (n ? n : 1));
    if (k) {
        res->top_ids = malloc(sizeof(int32_t) * (n ? n * k : 1));
        res->top_vals = malloc(sizeof(float) * (n ? n * k : 1));
    }
    if (!res->ids || (k && (!res->top_ids || !res->top_vals)))
        return rekv_errf(err, -ENOMEM, "out of memory");
    memcpy(res->ids, js->generated_ids, sizeof(int32_t) * n);
    if (k) {
        if (js->top_logits != k || js->n_top_ids != n * k || js->n_top_vals != n * k)
            return rekv_errf(err, -EPROTO, "the coordinator returned no top logits for job %llu",
                             (unsigned long long)js->job);
        memcpy(res->top_ids, js->top_ids, sizeof(int32_t) * n * k);
        memcpy(res->top_vals, js->top_vals, sizeof(float) * n * k);
    }
    snprintf(reason, sizeof(reason), "%s", js->finish_reason);
    res->finish_reason = reason;
    *queued_s = js->queued_s;
    *run_s = js->run_s;
    return 0;
}

int cli_generate_remote(cli_remote *rm, const char *model_path, const char *socket,
                        const int32_t *ids, int n_ids, const rekv_gen_params *gp,
                        rekv_gen_result *res, double *queued_s, double *run_s, rekv_err *err)
{
    char ep[PATH_MAX + 16];
    rekv_ctl *c = NULL;
    Rekv__Control__Response *r = NULL;
    memset(res, 0, sizeof(*res));
    int rc = remote_begin(rm, err);
    if (rc)
        return rc;
    if ((rc = remote_endpoint(rm, model_path, socket, ep, sizeof(ep), err)) ||
        (rc = rekv_ctl_connect(ep, NULL, &c, err)))
        goto out;
    uint64_t sub_id = 0;
    if ((rc = remote_submit(rm, &c, ep, ids, n_ids, gp, &r, &sub_id, err)))
        goto out;
    uint64_t job = r->submitted->job;
    int shown = 0;
    if ((rc = remote_wait(rm, c, job, sub_id, &r, &shown, err))) {
        if (rc == -EINTR)
            remote_cancel(c, job);
        goto out;
    }
    /* everything about the finished job (ids, top logits, times) */
    if ((rc = remote_status(rm, c, job, &r, err)))
        goto out;
    Rekv__Control__JobState js_state = r->job->state;
    if (js_state != REKV__CONTROL__JOB_STATE__DONE) {
        rc = rekv_errf(err, -EIO, "job %llu %s: %s", (unsigned long long)job,
                       rekv_ctl_state_name(js_state), *r->job->error ? r->job->error : "no reason");
        goto out;
    }
    if (shown)
        fprintf(stderr, "\n");
    rc = remote_result(r->job, gp, res, queued_s, run_s, err);
out:
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    if (rc)
        rekv_gen_result_free(res);
    return rc;
}
