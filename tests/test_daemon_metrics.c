/* test_daemon_metrics.c — each daemon's --metrics port, scraped over real HTTP from the real
 * programs: a kvstore, a coordinator and a cpu gpuworker (offload mode, so KV moves through the
 * store) on a small synthetic model, N jobs run one after another, and then every family the
 * docs/metrics.md names is there with the counts N jobs of T tokens make (counts, never times): jobs and
 * tokens, one TTFT and one queue wait per job, T-1 inter-token gaps per job, one step histogram
 * observation per step on both sides of the worker socket, the bytes the worker moved equal to
 * what the coordinator summed from its reports. Each output also passes `promtool check metrics`
 * when promtool is installed (in CI it must be). The kvstore's spill and CRC counters are checked
 * in test_kvstore_spill, where spilling and a corrupt read-back are forced. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/metrics_scrape.h"
#include "tests/testutil.h"

#define N_JOBS 3
#define N_TOKENS 4

/* Starts argv (NULL-terminated) with --ready-fd appended, stderr to errpath, and waits (60 s at
 * most) until it says READY. */
static pid_t start_ready(const char *const *args, const char *errpath)
{
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    const char *argv[64];
    int n = 0;
    for (; args[n]; n++)
        argv[n] = args[n];
    char fd[16];
    snprintf(fd, sizeof(fd), "%d", pfd[1]);
    argv[n++] = "--ready-fd";
    argv[n++] = fd;
    argv[n] = NULL;
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int e = open(errpath, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (e >= 0)
            dup2(e, 2);
        close(pfd[0]);
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    struct pollfd p = {pfd[0], POLLIN, 0};
    ck_assert_msg(poll(&p, 1, 60000) == 1, "%s did not become ready", argv[0]);
    char buf[8] = {0};
    ck_assert_msg(read(pfd[0], buf, 7) == 6, "%s exited before it was ready (see %s)", argv[0],
                  errpath);
    close(pfd[0]);
    return pid;
}

static void stop(pid_t pid)
{
    kill(pid, SIGTERM);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
}

/* The value of series in body; fails the test when there is none. */
static double val(const char *body, const char *series)
{
    double v = ms_value(body, series);
    ck_assert_msg(!isnan(v), "no sample %s in:\n%s", series, body);
    return v;
}

typedef struct rig {
    char *dir;
    char model[4200], kv[4200], control[4200], workers[4200], log[4200];
    char co_bin[4200], kv_bin[4200], w_bin[4200];
    char p_kv[16], p_co[16], p_w[16];
    int port_kv, port_co, port_w;
    pid_t kv_pid, co_pid, w_pid;
} rig;

static void rig_start(rig *r)
{
    memset(r, 0, sizeof(*r));
    r->dir = tu_tmpdir();
    snprintf(r->model, sizeof(r->model), "%s/m", r->dir);
    snprintf(r->kv, sizeof(r->kv), "ipc://%s/kv", r->dir);
    snprintf(r->control, sizeof(r->control), "ipc://%s/control", r->dir);
    snprintf(r->workers, sizeof(r->workers), "ipc://%s/workers", r->dir);
    snprintf(r->log, sizeof(r->log), "%s/log", r->dir);
    snprintf(r->co_bin, sizeof(r->co_bin), "%s", tu_bin("rekv-coordinator"));
    snprintf(r->kv_bin, sizeof(r->kv_bin), "%s", tu_bin("rekv-kvstore"));
    snprintf(r->w_bin, sizeof(r->w_bin), "%s", tu_bin("rekv-gpuworker"));
    char cmd[8600];
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 "
             "--vocab 256 --max-pos 128 --dtype f32 %s >/dev/null",
             tu_bin("rekv-loader"), r->model);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
    r->port_kv = ms_free_port();
    snprintf(r->p_kv, sizeof(r->p_kv), "127.0.0.1:%d", r->port_kv);
    char spill[4200];
    snprintf(spill, sizeof(spill), "%s/spill", r->dir);
    ck_assert_int_eq(mkdir(spill, 0700), 0);
    const char *kv_args[] = {r->kv_bin, "--endpoint",  r->kv,      "--model", r->model,
                             "--host-bytes", "16M", "--spill-dir", spill, "--cache-dtype",
                             "f32",     "--metrics",   r->p_kv,    NULL};
    r->kv_pid = start_ready(kv_args, r->log);
    r->port_co = ms_free_port();
    snprintf(r->p_co, sizeof(r->p_co), "127.0.0.1:%d", r->port_co);
    const char *co_args[] = {r->co_bin, "--control", r->control, "--workers", r->workers,
                             "--metrics", r->p_co,   NULL};
    r->co_pid = start_ready(co_args, r->log);
    r->port_w = ms_free_port();
    snprintf(r->p_w, sizeof(r->p_w), "127.0.0.1:%d", r->port_w);
    const char *w_args[] = {r->w_bin,      "--model",   r->model, "--coordinator",
                            r->workers,    "--kvstore", r->kv,    "--backend",
                            "cpu",         "--mode",    "offload", "--max-batch",
                            "4",           "--device-memory", "64M", "--name",
                            "w0",          "--metrics", r->p_w,   "--device-tokens",
                            "2",           NULL}; /* the rest of each context streams */
    r->w_pid = start_ready(w_args, r->log);
}

static void rig_stop(rig *r)
{
    stop(r->w_pid);
    stop(r->co_pid);
    stop(r->kv_pid);
    tu_rmrf(r->dir);
    free(r->dir);
}

/* One job after another, each waited for: N_TOKENS tokens (eos ignored) from a 5-token prompt. */
static void run_jobs(rig *r)
{
    char cmd[8600];
    snprintf(cmd, sizeof(cmd),
             "%s submit --socket %s --prompt-ids 1,2,3,4,5 --max-new-tokens %d --ignore-eos "
             "--json >/dev/null 2>>%s",
             tu_bin("rekv"), r->control, N_TOKENS, r->log);
    for (int i = 0; i < N_JOBS; i++)
        ck_assert_msg(tu_run(cmd, NULL) == 0, "job %d failed (see %s)", i, r->log);
}

/* The coordinator's families after N_JOBS jobs of N_TOKENS tokens. */
static void check_coordinator(const char *m)
{
    /* now: nothing queued or running; cumulative: N submitted, N finished */
    ck_assert_double_eq(val(m, "rekv_jobs{state=\"queued\"}"), 0);
    ck_assert_double_eq(val(m, "rekv_jobs{state=\"running\"}"), 0);
    ck_assert_double_eq(val(m, "rekv_jobs_submitted_total"), N_JOBS);
    ck_assert_double_eq(val(m, "rekv_jobs_finished_total"), N_JOBS);
    ck_assert_double_eq(val(m, "rekv_jobs_failed_total"), 0);
    ck_assert_double_eq(val(m, "rekv_jobs_cancelled_total"), 0);
    ck_assert_double_eq(val(m, "rekv_tokens_generated_total"), N_JOBS * N_TOKENS);
    /* no server-side rates: rate() of the counters */
    ck_assert_ptr_null(strstr(m, "per_second"));
    ck_assert_ptr_null(strstr(m, "rekv_jobs{state=\"done\"}"));
    /* one first token and one queue wait per job, a gap between each job's consecutive tokens */
    ck_assert_double_eq(val(m, "rekv_time_to_first_token_seconds_count"), N_JOBS);
    ck_assert_double_eq(val(m, "rekv_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), N_JOBS);
    ck_assert_double_eq(val(m, "rekv_queue_wait_seconds_count"), N_JOBS);
    ck_assert_double_eq(val(m, "rekv_inter_token_latency_seconds_count"),
                        N_JOBS * (N_TOKENS - 1));
    /* one job at a time, one token per step: a step per token, each timed on both sides */
    double steps = val(m, "rekv_steps_total");
    ck_assert_double_eq(steps, N_JOBS * N_TOKENS);
    ck_assert_double_eq(val(m, "rekv_step_seconds_count"), steps);
    ck_assert_double_eq(val(m, "rekv_step_round_trip_seconds_count"), steps);
    ck_assert_double_ge(val(m, "rekv_step_seconds_sum"), 0);
    ck_assert_double_eq(val(m, "rekv_queue_limit"), 256);
}

/* The kvstore's, after the same jobs: the worker connected, its requests timed, its pins hit. */
static void check_kvstore(const char *m)
{
    ck_assert_double_eq(val(m, "rekv_kvstore_clients"), 1);
    ck_assert_double_gt(val(m, "rekv_kvstore_arena_size_bytes"), 0);
    ck_assert_double_le(val(m, "rekv_kvstore_arena_used_bytes"),
                        val(m, "rekv_kvstore_arena_size_bytes"));
    ck_assert_double_gt(val(m, "rekv_kvstore_request_seconds_count{kind=\"pin\"}"), 0);
    ck_assert_double_gt(val(m, "rekv_kvstore_request_seconds_count{kind=\"append\"}"), 0);
    ck_assert_double_gt(val(m, "rekv_kvstore_pins_total{result=\"hit\"}"), 0);
    /* 16 MiB hold these jobs: nothing spilled, nothing lost */
    ck_assert_double_eq(val(m, "rekv_kvstore_spill_writes_total"), 0);
    ck_assert_double_eq(val(m, "rekv_kvstore_crc_errors_total"), 0);
    ck_assert_double_eq(val(m, "rekv_kvstore_read_errors_total"), 0);
}

/* The gpuworker's, against the coordinator's: the same steps (each timed once), the tokens, the
 * bytes its reports carried, and the emulated device's memory (--device-memory 64M). */
static void check_worker(const char *w, const char *co)
{
    ck_assert_ptr_nonnull(
        strstr(w, "rekv_gpuworker_info{worker=\"w0\",backend=\"cpu\",mode=\"offload\"} 1\n"));
    double steps = val(co, "rekv_steps_total");
    ck_assert_double_eq(val(w, "rekv_gpuworker_steps_total"), steps);
    ck_assert_double_eq(val(w, "rekv_gpuworker_step_seconds_count"), steps);
    ck_assert_double_eq(val(w, "rekv_gpuworker_step_seconds_bucket{le=\"+Inf\"}"), steps);
    ck_assert_double_eq(val(w, "rekv_gpuworker_steps_failed_total"), 0);
    ck_assert_double_eq(val(w, "rekv_gpuworker_tokens_generated_total"), N_JOBS * N_TOKENS);
    ck_assert_double_eq(val(w, "rekv_gpuworker_running_jobs"), 0);
    ck_assert_double_eq(val(w, "rekv_gpuworker_graph_steps_total"), 0); /* offload: never */
    /* offload: the KV cache comes from the store, every byte also reported to the coordinator */
    double kv = val(w, "rekv_gpuworker_transfer_bytes_total{dir=\"h2d\",kind=\"kv\"}");
    ck_assert_double_gt(kv, 0);
    ck_assert_double_eq(kv, val(co, "rekv_bytes_total{dir=\"h2d\",kind=\"kv\"}"));
    ck_assert_double_eq(val(w, "rekv_gpuworker_transfer_bytes_total{dir=\"h2d\",kind=\"act\"}"),
                        val(co, "rekv_bytes_total{dir=\"h2d\",kind=\"act\"}"));
    ck_assert_double_eq(
        val(w, "rekv_gpuworker_transfer_bytes_total{dir=\"h2d\",kind=\"weights\"}"),
        val(co, "rekv_bytes_total{dir=\"h2d\",kind=\"weights\"}"));
    double d2h = 0;
    static const char *const kinds[] = {"weights", "kv", "act", "other"};
    for (int k = 0; k < 4; k++) {
        char series[128];
        snprintf(series, sizeof(series),
                 "rekv_gpuworker_transfer_bytes_total{dir=\"d2h\",kind=\"%s\"}", kinds[k]);
        d2h += val(w, series);
    }
    ck_assert_double_gt(d2h, 0);
    ck_assert_double_eq(d2h, val(co, "rekv_bytes_total{dir=\"d2h\",kind=\"all\"}"));
    ck_assert_double_eq(val(w, "rekv_gpuworker_device_memory_size_bytes"), 64 << 20);
    double used = val(w, "rekv_gpuworker_device_memory_used_bytes");
    ck_assert_double_gt(used, 0);
    ck_assert_double_le(used, 64 << 20);
}

/* Every family in a daemon's output is named in docs/metrics.md's tables (as `name`). */
static void check_docs_list(const char *m)
{
    char *readme = tu_read_file("docs/metrics.md", NULL);
    ck_assert_ptr_nonnull(readme);
    for (const char *p = strstr(m, "# TYPE "); p; p = strstr(p + 1, "# TYPE ")) {
        char name[128], quoted[140];
        ck_assert_int_eq(sscanf(p + 7, "%127s", name), 1);
        snprintf(quoted, sizeof(quoted), "`%s`", name);
        char *q = strstr(readme, quoted);
        if (q == NULL) { /* or with its labels: `name{...}` */
            snprintf(quoted, sizeof(quoted), "`%s{", name);
            q = strstr(readme, quoted);
        }
        ck_assert_msg(q != NULL, "docs/metrics.md does not list the family %s", name);
    }
    free(readme);
}

START_TEST(test_daemons_metrics)
{
    rig r;
    rig_start(&r);
    char *m0 = ms_scrape(r.port_co), *w0 = ms_scrape(r.port_w);
    ck_assert_double_eq(val(m0, "rekv_jobs_submitted_total"), 0);
    ck_assert_double_eq(val(m0, "rekv_time_to_first_token_seconds_count"), 0);
    ck_assert_double_eq(val(w0, "rekv_gpuworker_steps_total"), 0);
    ck_assert_double_eq(val(w0, "rekv_gpuworker_step_seconds_count"), 0);
    run_jobs(&r);
    char *m = ms_scrape(r.port_co);
    check_coordinator(m);
    ms_promtool(m);
    char *k = ms_scrape(r.port_kv);
    check_kvstore(k);
    ms_promtool(k);
    char *w = ms_scrape(r.port_w);
    check_worker(w, m);
    ms_promtool(w);
    check_docs_list(m);
    check_docs_list(k);
    check_docs_list(w);
    free(m0);
    free(w0);
    free(m);
    free(k);
    free(w);
    rig_stop(&r);
}
END_TEST

/* A daemon asked for metrics off loopback without --metrics-public refuses to start, naming the
 * flag; with it, it serves. */
START_TEST(test_metrics_public_flag)
{
    char *dir = tu_tmpdir(), cmd[8600];
    int port = ms_free_port();
    snprintf(cmd, sizeof(cmd),
             "timeout 30 %s --control ipc://%s/c --workers ipc://%s/w --metrics 0.0.0.0:%d 2>&1",
             tu_bin("rekv-coordinator"), dir, dir, port);
    char *out = NULL;
    ck_assert_int_eq(tu_run(cmd, &out), 1);
    ck_assert_msg(strstr(out, "--metrics-public") != NULL, "%s", out);
    free(out);
    char co[4200], c[4200], w[4200], addr[64], log[4200];
    snprintf(co, sizeof(co), "%s", tu_bin("rekv-coordinator"));
    snprintf(c, sizeof(c), "ipc://%s/c", dir);
    snprintf(w, sizeof(w), "ipc://%s/w", dir);
    snprintf(addr, sizeof(addr), ":%d", port);
    snprintf(log, sizeof(log), "%s/log", dir);
    const char *args[] = {co,         "--control", c, "--workers", w, "--metrics", addr,
                          "--metrics-public", NULL};
    pid_t pid = start_ready(args, log);
    char *m = ms_scrape(port);
    ck_assert_double_eq(val(m, "rekv_jobs{state=\"queued\"}"), 0);
    free(m);
    stop(pid);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* `rekv run --metrics :PORT` starts its coordinator with --metrics-public when given it (and
 * fails naming it when not); the port serves. */
START_TEST(test_rekv_run_metrics_public)
{
    char *dir = tu_tmpdir(), cmd[16800], model[4200], rekv[4200], d[4200], addr[64], log[4200];
    snprintf(model, sizeof(model), "%s/m", dir);
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 1 --hidden 32 --heads 2 --ffn 64 --vocab 64 "
             "--max-pos 64 --dtype f32 %s >/dev/null",
             tu_bin("rekv-loader"), model);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
    snprintf(rekv, sizeof(rekv), "%s", tu_bin("rekv"));
    snprintf(d, sizeof(d), "%s/run", dir);
    snprintf(log, sizeof(log), "%s/log", dir);
    int port = ms_free_port();
    snprintf(addr, sizeof(addr), ":%d", port);
    snprintf(cmd, sizeof(cmd),
             "timeout 60 %s run --model %s --backend cpu --dir %s --metrics %s >/dev/null 2>&1",
             rekv, model, d, addr);
    ck_assert_int_ne(tu_run(cmd, NULL), 0); /* refused: not loopback, not asked for */
    const char *args[] = {rekv, "run",       "--model", model,   "--backend",       "cpu",
                          "--dir", d,        "--metrics", addr,  "--metrics-public", NULL};
    pid_t pid = start_ready(args, log);
    char *m = ms_scrape(port);
    ck_assert_double_eq(val(m, "rekv_jobs{state=\"running\"}"), 0);
    free(m);
    stop(pid);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *daemon_metrics_suite(void)
{
    Suite *s = suite_create("daemon_metrics");
    TCase *tc = tcase_create("daemons");
    tcase_set_timeout(tc, 240);
    tcase_add_test(tc, test_daemons_metrics);
    tcase_add_test(tc, test_metrics_public_flag);
    tcase_add_test(tc, test_rekv_run_metrics_public);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(daemon_metrics_suite());
}
