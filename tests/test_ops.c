/* test_ops.c — the programs as an operator meets them (issue 17): `rekv submit` prints a job's
 * text as the coordinator streams it, not when the job ends (a real coordinator, with the test as
 * its worker speaking worker.proto so that the job provably has not ended when the first text
 * arrives); the client fails at once, naming the endpoint, where no coordinator can be;
 * `rekv generate`, interrupted while its private daemons start or serve, exits by the signal and
 * leaves no temporary directory; `--trace F` over several runs writes a trace per run; every
 * program prints one version, takes --opt=VALUE, and exits 2 on a usage error; the daemons speak
 * systemd's notify protocol (READY, WATCHDOG, STOPPING). Runs the real programs from the build. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/version.h"
#include "coordinator/coordinator.h"
#include "loader/loader.h"
#include "proto/worker.pb-c.h"
#include "tests/testutil.h"

#define OPT_REL "models/opt-tiny-py"

/* ---------------------------------------------------------------- helpers */

/* Starts argv (NULL-terminated) with stdout on a pipe (*out_fd) and stderr on the file errpath;
 * with ready, appends --ready-fd and waits (60 s at most) until the program says READY. */
static pid_t start(const char *const *args, int *out_fd, const char *errpath, int ready)
{
    int pfd[2] = {-1, -1}, ofd[2] = {-1, -1};
    if (ready)
        ck_assert_int_eq(pipe(pfd), 0);
    if (out_fd)
        ck_assert_int_eq(pipe(ofd), 0);
    const char *argv[64];
    int n = 0;
    for (; args[n]; n++)
        argv[n] = args[n];
    char fd[16];
    if (ready) {
        snprintf(fd, sizeof(fd), "%d", pfd[1]);
        argv[n++] = "--ready-fd";
        argv[n++] = fd;
    }
    argv[n] = NULL;
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (out_fd) {
            dup2(ofd[1], 1);
            close(ofd[0]);
            close(ofd[1]);
        }
        if (errpath) {
            int e = open(errpath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
            if (e >= 0)
                dup2(e, 2);
        }
        if (ready)
            close(pfd[0]);
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    if (out_fd) {
        close(ofd[1]);
        *out_fd = ofd[0];
    }
    if (ready) {
        close(pfd[1]);
        struct pollfd p = {pfd[0], POLLIN, 0};
        ck_assert_msg(poll(&p, 1, 60000) == 1, "%s did not become ready", argv[0]);
        char buf[8] = {0};
        ck_assert_msg(read(pfd[0], buf, 7) == 6, "%s exited before it was ready", argv[0]);
        close(pfd[0]);
    }
    return pid;
}

static int stop(pid_t pid)
{
    kill(pid, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    return st;
}

/* Reads from fd into buf (of *n bytes so far, cap bytes) until it holds `want` bytes or the fd is
 * closed (a hang: Check's timeout is the guard). */
static void read_until(int fd, char *buf, size_t *n, size_t cap, size_t want)
{
    while (*n < want) {
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, 1000);
        if (r <= 0)
            continue;
        ssize_t got = read(fd, buf + *n, cap - *n - 1);
        ck_assert_msg(got >= 0, "read: %s", strerror(errno));
        if (got == 0)
            break;
        *n += (size_t)got;
    }
    buf[*n] = '\0';
}

/* One message to or from the test's worker socket. */
static void worker_send(void *sock, Rekv__Worker__WorkerMsg *m)
{
    m->version = REKV_WORKER_PROTO_VERSION;
    uint8_t buf[4096];
    size_t n = rekv__worker__worker_msg__get_packed_size(m);
    ck_assert(n <= sizeof(buf));
    rekv__worker__worker_msg__pack(m, buf);
    ck_assert_int_eq(zmq_send(sock, buf, n, 0), (int)n);
}

static Rekv__Worker__CoordMsg *worker_recv(void *sock)
{
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    while (zmq_poll(&it, 1, 1000) != 1) /* until it sends (Check's timeout is the guard) */
        ;
    uint8_t buf[65536];
    int got = zmq_recv(sock, buf, sizeof(buf), 0);
    ck_assert(got > 0 && (size_t)got <= sizeof(buf));
    Rekv__Worker__CoordMsg *m = rekv__worker__coord_msg__unpack(NULL, (size_t)got, buf);
    ck_assert_ptr_nonnull(m);
    return m;
}

/* Answers step `step` of the plan with one token of job `job`. */
static void worker_progress(void *sock, uint64_t step, uint64_t job, int32_t tok, int finished)
{
    Rekv__Worker__JobProgress jp = REKV__WORKER__JOB_PROGRESS__INIT;
    jp.job = job;
    jp.n_tokens = 1;
    jp.tokens = &tok;
    jp.finished = finished;
    jp.finish_reason = finished ? "length" : "";
    Rekv__Worker__JobProgress *jps[1] = {&jp};
    Rekv__Worker__Progress p = REKV__WORKER__PROGRESS__INIT;
    p.step = step;
    p.n_jobs = 1;
    p.jobs = jps;
    p.running = finished ? 0 : 1;
    Rekv__Worker__WorkerMsg m = REKV__WORKER__WORKER_MSG__INIT;
    m.body_case = REKV__WORKER__WORKER_MSG__BODY_PROGRESS;
    m.progress = &p;
    worker_send(sock, &m);
}

/* ---------------------------------------------------------------- submit streams */

/* `rekv submit` against a coordinator (with --model: a tokenizer, text; without: token ids) whose
 * worker is this test: the worker answers the first step with one token and holds the second, and
 * the text of that token must reach submit's stdout while the job is still running (the worker has
 * not finished it, so this is order, not timing); then the second step ends the job and submit
 * exits 0 having printed the rest. */
static void submit_streams(const char *model, int with_tokenizer)
{
    char *dir = tu_tmpdir(), ctl[4200], wrk[4200], errpath[4200];
    snprintf(ctl, sizeof(ctl), "ipc://%s/control", dir);
    snprintf(wrk, sizeof(wrk), "ipc://%s/workers", dir);
    snprintf(errpath, sizeof(errpath), "%s/submit.err", dir);
    char co_prog[4096], cli_prog[4096];
    snprintf(co_prog, sizeof(co_prog), "%s", tu_bin("rekv-coordinator"));
    snprintf(cli_prog, sizeof(cli_prog), "%s", tu_bin("rekv"));
    const char *co_args[] = {co_prog,  "--control", ctl,   "--workers", wrk, "--worker-timeout-ms",
                             "600000", "--model",   model, NULL};
    if (!with_tokenizer)
        co_args[7] = NULL;
    pid_t co = start(co_args, NULL, NULL, 1);

    /* the test is the worker */
    void *zctx = zmq_ctx_new(), *sock = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    ck_assert_int_eq(zmq_connect(sock, wrk), 0);
    Rekv__Worker__Hello h = REKV__WORKER__HELLO__INIT;
    h.name = "test";
    h.backend = "cpu";
    h.mode = "resident";
    h.max_batch = 4;
    h.vocab = 4096;
    h.max_pos = 1024;
    h.eos_id = 2;
    Rekv__Worker__WorkerMsg hm = REKV__WORKER__WORKER_MSG__INIT;
    hm.body_case = REKV__WORKER__WORKER_MSG__BODY_HELLO;
    hm.hello = &h;
    worker_send(sock, &hm);
    Rekv__Worker__CoordMsg *m = worker_recv(sock);
    ck_assert_int_eq(m->body_case, REKV__WORKER__COORD_MSG__BODY_WELCOME);
    rekv__worker__coord_msg__free_unpacked(m, NULL);

    /* the health probes of deploy/docker-compose.yml: one worker, not two */
    if (with_tokenizer) {
        char probe[8400];
        snprintf(probe, sizeof(probe), "%s status --socket=%s --min-workers=1 >/dev/null 2>&1",
                 cli_prog, ctl);
        ck_assert_msg(tu_run(probe, NULL) == 0, "%s", probe);
        snprintf(probe, sizeof(probe), "%s status --socket=%s --min-workers=2 >/dev/null 2>&1",
                 cli_prog, ctl);
        ck_assert_msg(tu_run(probe, NULL) == 1, "%s", probe);
    }

    /* the texts the two tokens make: the first alone, then both */
    const int32_t toks[2] = {268, 314};
    char *first = NULL, *all = NULL;
    size_t n_first = 0, n_all = 0;
    if (with_tokenizer) {
        rekv_tokenizer *tok = NULL;
        rekv_err err = {0};
        ck_assert_msg(rekv_tokenizer_load_for_model(model, &tok, &err) == 0, "%s", err.msg);
        ck_assert(rekv_tokenizer_decode(tok, toks, 1, &first, &n_first, &err) == 0);
        ck_assert(rekv_tokenizer_decode(tok, toks, 2, &all, &n_all, &err) == 0);
        rekv_tokenizer_free(tok);
        ck_assert_msg(n_first > 0 && n_all > n_first, "pick tokens with text");
    } else {
        first = strdup("268");
        all = strdup("268,314");
        n_first = 3;
        n_all = 7;
    }

    const char *sub_args[] = {cli_prog,    "submit",           "--socket=", "--prompt-ids",
                              "2,100,200", "--max-new-tokens", "2",         NULL};
    char sock_opt[4300];
    snprintf(sock_opt, sizeof(sock_opt), "--socket=%s", ctl);
    sub_args[2] = sock_opt;
    int out_fd;
    pid_t sub = start(sub_args, &out_fd, errpath, 0);

    m = worker_recv(sock);
    ck_assert_int_eq(m->body_case, REKV__WORKER__COORD_MSG__BODY_PLAN);
    ck_assert_int_eq(m->plan->n_join, 1);
    uint64_t job = m->plan->join[0]->job, step = m->plan->step;
    rekv__worker__coord_msg__free_unpacked(m, NULL);
    worker_progress(sock, step, job, toks[0], 0);

    char out[4096];
    size_t n = 0;
    read_until(out_fd, out, &n, sizeof(out), n_first);
    ck_assert_msg(n == n_first && memcmp(out, first, n_first) == 0,
                  "submit printed \"%s\" after the first step, not \"%s\"", out, first);
    ck_assert_msg(waitpid(sub, NULL, WNOHANG) == 0, "submit exited before the job ended");

    m = worker_recv(sock); /* the next step's plan */
    ck_assert_int_eq(m->body_case, REKV__WORKER__COORD_MSG__BODY_PLAN);
    step = m->plan->step;
    rekv__worker__coord_msg__free_unpacked(m, NULL);
    worker_progress(sock, step, job, toks[1], 1);
    read_until(out_fd, out, &n, sizeof(out), sizeof(out) - 1); /* to EOF */
    int st;
    ck_assert_int_eq(waitpid(sub, &st, 0), sub);
    char *errtxt = tu_read_file(errpath, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "submit failed: %s", errtxt);
    ck_assert_msg(n == n_all + 1 && memcmp(out, all, n_all) == 0 && out[n_all] == '\n',
                  "submit printed \"%s\", not \"%s\\n\"", out, all);
    free(errtxt);
    close(out_fd);
    free(first);
    free(all);
    zmq_close(sock);
    zmq_ctx_term(zctx);
    ck_assert_int_eq(stop(co), 0);
    tu_rmrf(dir);
    free(dir);
}

START_TEST(submit_streams_text)
{
    const char *m = tu_shared(OPT_REL);
    if (m == NULL)
        return;
    char model[4096];
    snprintf(model, sizeof(model), "%s", m);
    submit_streams(model, 1);
    submit_streams(model, 0);
}
END_TEST

/* ---------------------------------------------------------------- fast failure */

/* Runs `rekv ARGS` with XDG_RUNTIME_DIR=xdg; its exit code, stderr in *err. */
static int rekv_env(const char *xdg, const char *args, char **err)
{
    char *d = tu_tmpdir(), cmd[16384], errpath[4200];
    snprintf(errpath, sizeof(errpath), "%s/err", d);
    snprintf(cmd, sizeof(cmd), "XDG_RUNTIME_DIR='%s' %s %s >/dev/null 2>'%s'", xdg, tu_bin("rekv"),
             args, errpath);
    int rc = tu_run(cmd, NULL);
    *err = tu_read_file(errpath, NULL);
    tu_rmrf(d);
    free(d);
    return rc;
}

/* No socket file, or a socket nobody listens on: every client command says so at once (the
 * message, not a timeout, is what shows it did not wait for a reply), exit 1. */
START_TEST(client_fails_fast_without_coordinator)
{
    char *xdg = tu_tmpdir(), stale[4200], args[8192], *err;
    const char *cmds[] = {"submit --prompt-ids 1,2", "status", "status 3", "cancel 3", "stats"};
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        int rc = rekv_env(xdg, cmds[i], &err);
        ck_assert_msg(rc == 1, "rekv %s: exit %d: %s", cmds[i], rc, err);
        ck_assert_msg(strstr(err, "does not exist") && strstr(err, xdg),
                      "rekv %s does not say the default socket is missing: %s", cmds[i], err);
        free(err);
    }
    /* generate through a coordinator at a socket that is not there: no probe, the same message */
    const char *m = tu_shared(OPT_REL);
    if (m) {
        snprintf(args, sizeof(args), "generate --model %s --prompt-ids 2 --socket ipc://%s/none", m,
                 xdg);
        int rc = rekv_env(xdg, args, &err);
        ck_assert_msg(rc == 1 && strstr(err, "does not exist"), "exit %d: %s", rc, err);
        free(err);
    }
    /* a socket left behind by a coordinator that died */
    snprintf(stale, sizeof(stale), "%s/stale", xdg);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    ck_assert(strlen(stale) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, stale, strlen(stale) + 1);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(fd);
    snprintf(args, sizeof(args), "submit --socket ipc://%s --prompt-ids 1", stale);
    int rc = rekv_env(xdg, args, &err);
    ck_assert_msg(rc == 1 && strstr(err, "nothing listens") && strstr(err, stale), "exit %d: %s",
                  rc, err);
    free(err);
    tu_rmrf(xdg);
    free(xdg);
}
END_TEST

/* ---------------------------------------------------------------- generate interrupted */

/* The name of the first rekv-run.* entry in dir (static), or NULL. */
static const char *run_dir_in(const char *dir)
{
    static char name[4096];
    DIR *d = opendir(dir);
    ck_assert_ptr_nonnull(d);
    struct dirent *e;
    const char *found = NULL;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, "rekv-run.", 9) == 0) {
            snprintf(name, sizeof(name), "%s", e->d_name);
            found = name;
        }
    closedir(d);
    return found;
}

/* `rekv generate` (its default path: a private `rekv run` in a rekv-run.* directory under $TMPDIR)
 * interrupted by sig once `stage` exists — the directory (0: as early as it can be seen) or the
 * trio's control socket in it (1: serving, the job submitted or about to be) — exits by that
 * signal's status and leaves nothing in $TMPDIR. */
static void generate_interrupted(const char *model, int sig, int stage)
{
    char *tmp = tu_tmpdir(), *xdg = tu_tmpdir(), errpath[4200];
    snprintf(errpath, sizeof(errpath), "%s/generate.err", xdg);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        setenv("TMPDIR", tmp, 1);
        setenv("XDG_RUNTIME_DIR", xdg, 1); /* no coordinator serves there */
        int e = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0600),
            nul = open("/dev/null", O_WRONLY);
        dup2(e, 2);
        dup2(nul, 1);
        execl(tu_bin("rekv"), "rekv", "generate", "--model", model, "--prompt", "def main(",
              "--max-new-tokens", "1000", "--ignore-eos", (char *)NULL);
        _exit(127);
    }
    for (;;) {
        const char *run = run_dir_in(tmp);
        char sock[8400];
        if (run)
            snprintf(sock, sizeof(sock), "%s/%s/control", tmp, run);
        if (run && (stage == 0 || access(sock, F_OK) == 0))
            break;
        ck_assert_msg(waitpid(pid, NULL, WNOHANG) == 0, "rekv generate ended before stage %d",
                      stage);
        usleep(2000);
    }
    kill(pid, sig);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    char *err = tu_read_file(errpath, NULL);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 128 + sig,
                  "%s at stage %d: status 0x%x (want exit %d): %s", sigabbrev_np(sig), stage, st,
                  128 + sig, err);
    const char *left = run_dir_in(tmp);
    ck_assert_msg(left == NULL, "%s at stage %d left %s/%s behind", sigabbrev_np(sig), stage, tmp,
                  left);
    free(err);
    tu_rmrf(tmp);
    tu_rmrf(xdg);
    free(tmp);
    free(xdg);
}

START_TEST(generate_interrupted_leaves_nothing)
{
    const char *m = tu_shared(OPT_REL);
    if (m == NULL)
        return;
    char model[4096];
    snprintf(model, sizeof(model), "%s", m);
    generate_interrupted(model, SIGTERM, 0);
    generate_interrupted(model, SIGINT, 0);
    generate_interrupted(model, SIGINT, 1);
    generate_interrupted(model, SIGTERM, 1);
}
END_TEST

/* ---------------------------------------------------------------- traces */

/* `rekv bench decode --trace F` with several runs writes one Chrome trace per run, F with the
 * run's name before its extension (a repeated run numbered), and with one run F itself. */
START_TEST(bench_trace_per_run)
{
    char *d = tu_tmpdir(), cmd[16384], path[4200], loader[4096], rekv[4096];
    snprintf(loader, sizeof(loader), "%s", tu_bin("rekv-loader")); /* tu_bin's is static */
    snprintf(rekv, sizeof(rekv), "%s", tu_bin("rekv"));
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch opt --layers 2 --hidden 64 --heads 4 --ffn 128 --vocab 256 "
             "--max-pos 128 --dtype f32 %s/m >/dev/null && "
             "%s bench decode --model %s/m --backend cpu --batch 1 --prompt-len 16 --gen-len 2 "
             "--modes resident,offload,kvpr@2,offload --trace %s/t.json >/dev/null 2>&1 && "
             "%s bench decode --model %s/m --backend cpu --batch 1 --prompt-len 16 --gen-len 2 "
             "--modes kvpr --trace=%s/one >/dev/null 2>&1",
             loader, d, rekv, d, d, rekv, d, d);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
    const char *want[] = {"t.resident.json", "t.offload.json", "t.kvpr@2.json", "t.offload-2.json",
                          "one"};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", d, want[i]);
        char *text = tu_read_file(path, NULL);
        ck_assert_msg(text != NULL, "no trace %s", path);
        ck_assert_msg(strstr(text, "\"traceEvents\"") != NULL, "%s is not a Chrome trace", path);
        free(text);
    }
    snprintf(path, sizeof(path), "%s/t.json", d);
    ck_assert_msg(access(path, F_OK) != 0, "several runs wrote %s too", path);
    tu_rmrf(d);
    free(d);
}
END_TEST

/* ---------------------------------------------------------------- version */

/* Every program prints the same version, common/version.c's, for --version, and exits 0. */
START_TEST(version_everywhere)
{
    const char *progs[] = {"rekv", "rekv-kvstore", "rekv-gpuworker", "rekv-coordinator",
                           "rekv-loader"};
    for (size_t i = 0; i < sizeof(progs) / sizeof(progs[0]); i++) {
        char cmd[8192], want[512], *out = NULL;
        snprintf(cmd, sizeof(cmd), "%s --version 2>&1", tu_bin(progs[i]));
        int rc = tu_run(cmd, &out);
        snprintf(want, sizeof(want), "%s %s\n", progs[i], rekv_version());
        ck_assert_msg(rc == 0 && strcmp(out, want) == 0,
                      "%s --version: exit %d, \"%s\" (want \"%s\")", progs[i], rc, out, want);
        free(out);
    }
    ck_assert_msg(strncmp(rekv_version(), REKV_VERSION, strlen(REKV_VERSION)) == 0, "%s",
                  rekv_version());
}
END_TEST

/* ---------------------------------------------------------------- command lines */

/* Every program and subcommand parses with getopt_long: --opt=VALUE works like --opt VALUE, a
 * usage error (unknown option or command, a missing or bad value) exits 2 with a message on
 * stderr, and --help exits 0 with the usage on stdout. */
START_TEST(command_lines)
{
    static const char *const usage_errors[] = {
        "rekv --bogus",
        "rekv frob",
        "rekv generate --bogus",
        "rekv generate --model=/nonexistent --prompt-ids=a,b",
        "rekv run --bogus",
        "rekv run --model=/nonexistent --mode=bogus",
        "rekv run --model=/nonexistent --host-bytes=12Q",
        "rekv run --model=/nonexistent --link-gbps=fast",
        "rekv submit --bogus",
        "rekv submit --prompt-ids=1 --max-new-tokens=-1",
        "rekv status abc",
        "rekv cancel",
        "rekv stats extra",
        "rekv profile --bogus",
        "rekv bench",
        "rekv bench decode --bogus",
        "rekv bench forward --bogus",
        "rekv bench kvstore --blocks=0",
        "rekv eval --bogus",
        "rekv skew --bogus",
        "rekv-kvstore --bogus",
        "rekv-kvstore --endpoint=ipc:///nonexistent/kv --host-bytes=12Q",
        "rekv-gpuworker --model=/nonexistent --max-batch=0",
        "rekv-coordinator --queue=abc",
        "rekv-loader",
        "rekv-loader frob",
        "rekv-loader synth --bogus",
        "rekv-loader synth --arch",
        "rekv-loader synth --arch=opt --layers=x",
        "rekv-loader synth --arch=gpt",
        "rekv-loader synth --arch=opt --layers=1 --hidden=8 --heads=2 --ffn=8 --vocab=16",
        "rekv-loader inspect",
        "rekv-loader inspect --bogus x",
    };
    static const char *const helps[] = {
        "rekv --help",
        "rekv generate --help",
        "rekv run --help",
        "rekv submit --help",
        "rekv status --help",
        "rekv cancel --help",
        "rekv stats --help",
        "rekv profile --help",
        "rekv bench --help",
        "rekv bench decode --help",
        "rekv bench forward --help",
        "rekv bench kvstore --help",
        "rekv eval --help",
        "rekv skew --help",
        "rekv-kvstore --help",
        "rekv-gpuworker --help",
        "rekv-coordinator --help",
        "rekv-loader --help",
        "rekv-loader synth --help",
        "rekv-loader inspect --help",
    };
    char *d = tu_tmpdir(), cmd[16384], prog[4096], *out;
    for (int pass = 0; pass < 2; pass++) {
        const char *const *list = pass ? helps : usage_errors;
        size_t n = pass ? sizeof(helps) / sizeof(helps[0])
                        : sizeof(usage_errors) / sizeof(usage_errors[0]);
        for (size_t i = 0; i < n; i++) {
            const char *sp = strchr(list[i], ' ');
            if (sp == NULL)
                sp = list[i] + strlen(list[i]);
            snprintf(prog, sizeof(prog), "%.*s", (int)(sp - list[i]), list[i]);
            snprintf(cmd, sizeof(cmd), "XDG_RUNTIME_DIR='%s' %s%s 2>'%s/err'", d, tu_bin(prog), sp,
                     d);
            int rc = tu_run(cmd, &out);
            snprintf(cmd, sizeof(cmd), "%s/err", d);
            char *err = tu_read_file(cmd, NULL);
            if (pass == 0)
                ck_assert_msg(rc == 2 && err && *err && !*out,
                              "`%s`: exit %d (want 2), stderr \"%s\", stdout \"%s\"", list[i], rc,
                              err, out);
            else
                ck_assert_msg(rc == 0 && strstr(out, "usage") && err && !*err,
                              "`%s`: exit %d (want 0), stdout \"%s\", stderr \"%s\"", list[i], rc,
                              out, err);
            free(err);
            free(out);
        }
    }
    /* --opt=VALUE, and an option after the operand (getopt_long permutes) */
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch=opt --layers=1 --hidden=8 --heads=2 %s/m --ffn=8 --vocab=16 "
             "--max-pos=16 --dtype=f32 --seed=3 >/dev/null",
             tu_bin("rekv-loader"), d);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
    snprintf(cmd, sizeof(cmd), "%s/m/config.json", d);
    ck_assert_msg(access(cmd, F_OK) == 0, "synth with --opt=VALUE wrote no %s", cmd);
    tu_rmrf(d);
    free(d);
}
END_TEST

/* ---------------------------------------------------------------- kvstore probe */

/* `rekv status --kvstore ENDPOINT` (the compose healthcheck of the store): 0 when a store answers
 * there, 1 with a message naming the endpoint when none does. */
START_TEST(status_kvstore_probe)
{
    char *d = tu_tmpdir(), ep[4200], prog[4096], cmd[8800], *out = NULL;
    snprintf(ep, sizeof(ep), "ipc://%s/kv", d);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *args[] = {prog, "--endpoint", ep,  "--host-bytes", "16M", "--layers",
                          "1",  "--kv-heads", "1", "--head-dim",   "16",  "--hidden",
                          "16", "--no-spill", NULL};
    pid_t kv = start(args, NULL, NULL, 1);
    snprintf(cmd, sizeof(cmd), "%s status --kvstore=%s 2>&1", tu_bin("rekv"), ep);
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0 && strstr(out, "kvstore serving"), "exit %d: %s", rc, out);
    free(out);
    ck_assert_int_eq(stop(kv), 0);
    rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 1 && strstr(out, ep), "a stopped store: exit %d: %s", rc, out);
    free(out);
    tu_rmrf(d);
    free(d);
}
END_TEST

/* The systemd notify protocol (Type=notify units, WatchdogSec=): each daemon started with
 * NOTIFY_SOCKET (a datagram socket this test binds) and WATCHDOG_USEC says READY=1 once it serves,
 * then WATCHDOG=1 while it runs, and STOPPING=1 on SIGTERM, in that order. */
static void notify_sequence(const char *const *args, const char *sock_path)
{
    int sfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(sfd, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock_path);
    unlink(sock_path);
    ck_assert_int_eq(bind(sfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    setenv("NOTIFY_SOCKET", sock_path, 1);
    setenv("WATCHDOG_USEC", "150000", 1);
    pid_t pid = tu_spawn(args, NULL, NULL);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    ck_assert_msg(pid > 0, "%s exited at start", args[0]);
    int ready = 0, watchdogs = 0, stopping = 0, sent_term = 0;
    while (!stopping) {
        if (watchdogs >= 2 && !sent_term) {
            kill(pid, SIGTERM);
            sent_term = 1;
        }
        struct pollfd p = {sfd, POLLIN, 0};
        if (poll(&p, 1, 1000) <= 0)
            continue;
        char msg[256];
        ssize_t n = recv(sfd, msg, sizeof(msg) - 1, 0);
        ck_assert_int_gt(n, 0);
        msg[n] = '\0';
        if (strstr(msg, "READY=1")) {
            ck_assert_msg(!ready && watchdogs == 0, "%s: READY=1 again or after a ping", args[0]);
            ready = 1;
        }
        if (strstr(msg, "WATCHDOG=1")) {
            ck_assert_msg(ready, "%s: a watchdog ping before READY=1", args[0]);
            watchdogs++;
        }
        if (strstr(msg, "STOPPING=1")) {
            ck_assert_msg(sent_term, "%s: STOPPING=1 before SIGTERM", args[0]);
            stopping = 1;
        }
    }
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: exit status %d", args[0], st);
    close(sfd);
    unlink(sock_path);
}

START_TEST(sd_notify_protocol)
{
    char *dir = tu_tmpdir(), ctl[4200], wrk[4200], kv[4200], spill[4200], sock[4200];
    char co_prog[4096], kv_prog[4096];
    snprintf(co_prog, sizeof(co_prog), "%s", tu_bin("rekv-coordinator"));
    snprintf(kv_prog, sizeof(kv_prog), "%s", tu_bin("rekv-kvstore"));
    snprintf(ctl, sizeof(ctl), "ipc://%s/control", dir);
    snprintf(wrk, sizeof(wrk), "ipc://%s/workers", dir);
    snprintf(kv, sizeof(kv), "ipc://%s/kv.sock", dir);
    snprintf(spill, sizeof(spill), "%s/spill", dir);
    snprintf(sock, sizeof(sock), "%s/notify", dir);
    ck_assert_int_eq(mkdir(spill, 0700), 0);
    const char *co[] = {co_prog, "--control", ctl, "--workers", wrk, NULL};
    notify_sequence(co, sock);
    const char *store[] = {
        kv_prog, "--endpoint", kv,  "--host-bytes", "4M", "--spill-dir", spill, "--layers",
        "2",     "--kv-heads", "2", "--head-dim",   "32", "--hidden",    "64",  NULL};
    notify_sequence(store, sock);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("ops");
    TCase *tc = tcase_create("ops");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, submit_streams_text);
    tcase_add_test(tc, client_fails_fast_without_coordinator);
    tcase_add_test(tc, generate_interrupted_leaves_nothing);
    tcase_add_test(tc, bench_trace_per_run);
    tcase_add_test(tc, version_everywhere);
    tcase_add_test(tc, command_lines);
    tcase_add_test(tc, status_kvstore_probe);
    tcase_add_test(tc, sd_notify_protocol);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
