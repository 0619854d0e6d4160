/* soak.c — issues 16's and 41's soak: the three daemons on loopback (ipc sockets in a temporary
 * directory, stories260K, the worker in offload mode with the KV cache in the kvstore, the
 * coordinator with a journal), N submissions (default 10,000) from one client, each with a client
 * key and retried under it after a timeout or BUSY; every 10th job cancelled right after it is
 * accepted, and every 10th (another) one 40 submissions later, when it may be running or done; a
 * kill -9 and restart of the worker at N/8, of the kvstore at N/4 and of the coordinator at N/5
 * (the coordinator's journal brings its jobs back), and the kvstore stopped (SIGSTOP: a hung
 * process or disk) for 5 s at N/3 (the worker's --kvstore-timeout-ms is 2 s). The store's arena
 * (256 KiB, ~12 jobs' KV) and spill tier (--spill-bytes 1 MiB) are small, so a batch of 32 spills
 * all the time and the spill tier fills: admission has to count it. Prints a JSON summary:
 *   accepted, done, cancelled, failed: jobs by their end;
 *   lost: accepted jobs that never ended (or were forgotten before the client saw their end);
 *   run_twice: a key answered with a second job id, or a job seen ended and later not ended,
 *     or with other tokens (checked again after the coordinator's restart);
 *   wrong: DONE jobs whose tokens differ from the first DONE job of the same prompt (greedy);
 *   each daemon's RSS (kB) after warm-up (N/5 + N/4 submissions: past every restart, and past
 *     --keep-finished 1024 ends on the restarted coordinator) and at the end, once every job
 *     ended, and the change in percent.
 * A failing spill tier: REKV_SOAK_SPILL_DIR puts the spill file on another file system, and
 * REKV_SOAK_SPILL_FAIL / REKV_SOAK_SPILL_MEND are shell commands run at N/2 and 5 s later (the
 * device under it failing every I/O, then mended); tests/bench/soak-vm.sh does that in a virtual
 * machine on a device-mapper disk. The summary then also counts the store's spill write errors
 * and read-back errors (of the last store: kill -9 at N/4 zeroes them).
 * Built with `make build/tests/bench/soak`; run from the repository root:
 *   REKV_BUILD=build build/tests/bench/soak [N] > soak.json
 * Exit status 0 when nothing was lost, run twice or wrong, and no daemon's RSS grew 10% or more. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "coordinator/coordinator.h"
#include "kvstore/kvstore.h"
#include "tests/testutil.h"

#define MAX_NEW 4
#define N_PROMPTS 50

static char g_dir[4096], g_ctl[4200], g_wrk[4200], g_kv[4200], g_state[4200], g_model[4096];
static char g_spill[4096]; /* the spill tier's directory: g_dir, or REKV_SOAK_SPILL_DIR */

static void die(const char *what)
{
    fprintf(stderr, "soak: %s\n", what);
    exit(2);
}

/* A daemon with --ready-fd, its stderr to dir/name.log; its pid. */
static pid_t spawn(const char *name, const char *const *args)
{
    int pfd[2];
    if (pipe(pfd))
        die("pipe");
    const char *argv[48];
    int n = 0;
    for (; args[n]; n++)
        argv[n] = args[n];
    char fd[16], log[4400];
    snprintf(fd, sizeof(fd), "%d", pfd[1]);
    snprintf(log, sizeof(log), "%s/%s.log", g_dir, name);
    argv[n++] = "--ready-fd";
    argv[n++] = fd;
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        int lf = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (lf >= 0)
            dup2(lf, 2);
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    struct pollfd p = {pfd[0], POLLIN, 0};
    char buf[8] = {0};
    if (poll(&p, 1, 60000) != 1 || read(pfd[0], buf, 7) != 6) {
        fprintf(stderr, "soak: %s did not start (see %s)\n", name, log);
        exit(2);
    }
    close(pfd[0]);
    return pid;
}

static pid_t start_kvstore(void)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-kvstore"));
    const char *a[] = {prog,          "--endpoint",  g_kv,  "--model",       g_model,
                       "--host-bytes",  "256K",        "--cache-dtype", "f32",
                       "--spill-dir",   g_spill,       "--spill-bytes", "1M",   NULL};
    return spawn("kvstore", a);
}

static pid_t start_coordinator(void)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *a[] = {prog,    "--control", g_ctl, "--workers",      g_wrk, "--state-dir",
                       g_state, "--queue",   "256", "--max-attempts", "100", NULL};
    return spawn("coordinator", a);
}

static pid_t start_worker(void)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *a[] = {
        prog,     "--model",   g_model,   "--coordinator", g_wrk, "--name",
        "w0",     "--backend", "cpu",     "--max-batch",   "32",  "--heartbeat-ms",
        "100",    "--mode",    "offload", "--kvstore",     g_kv,  "--kvstore-timeout-ms",
        "2000",   NULL};
    return spawn("worker", a);
}

static void kill9(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

static void stop(pid_t pid)
{
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

typedef struct sjob {
    uint64_t id;
    int ended;  /* 0, or the final JobState + 1 */
    int cancel; /* 1: cancel it once accepted; 2: 40 submissions later */
    int32_t got[MAX_NEW];
    uint32_t n_got;
} sjob;

static rekv_ctl *g_c;
static pid_t g_kv_pid;            /* the kvstore, for the SIGSTOP */
static uint64_t g_kv_resume_ns;   /* when the stopped store gets SIGCONT (0: not stopped) */
static uint64_t g_spill_mend_ns;  /* when REKV_SOAK_SPILL_MEND runs (0: not failing) */
static int g_spill_faults;        /* REKV_SOAK_SPILL_FAIL runs */

/* Runs a fault command (REKV_SOAK_SPILL_FAIL / _MEND); dies when it fails. */
static void fault_cmd(const char *var)
{
    const char *cmd = getenv(var);
    if (cmd && *cmd && system(cmd) != 0)
        die(var);
}

/* The faults that run on a clock: a stopped kvstore continued once its time is up. Called from
 * every wait, so that a wait for jobs the stopped store holds up does not wait forever. */
static void tick_faults(void)
{
    if (g_kv_resume_ns && rekv_now_ns() >= g_kv_resume_ns) {
        kill(g_kv_pid, SIGCONT);
        g_kv_resume_ns = 0;
    }
    if (g_spill_mend_ns && rekv_now_ns() >= g_spill_mend_ns) {
        fault_cmd("REKV_SOAK_SPILL_MEND");
        g_spill_mend_ns = 0;
    }
}
static int32_t g_ref[N_PROMPTS][MAX_NEW];
static uint32_t g_ref_n[N_PROMPTS];
static int g_ref_have[N_PROMPTS];
static long n_twice, n_wrong;

static void reconnect(void)
{
    rekv_ctl_close(g_c);
    rekv_err err = {0};
    if (rekv_ctl_connect(g_ctl, NULL, &g_c, &err))
        die(err.msg);
}

/* One call; NULL after a timeout (reconnected: a retry goes out on a fresh socket). */
static Rekv__Control__Response *call(Rekv__Control__Request *r)
{
    Rekv__Control__Response *resp = NULL;
    rekv_err err = {0};
    r->id = 0;
    tick_faults();
    if (rekv_ctl_call(g_c, r, 5000, &resp, &err) == 0)
        return resp;
    reconnect();
    return NULL;
}

/* Submits job i under its key until accepted; 0, or -1 when the coordinator keeps refusing. */
static int submit(sjob *jobs, long i)
{
    int32_t prompt[3] = {1, (int32_t)(2 + i % N_PROMPTS), (int32_t)(3 + (i % N_PROMPTS) * 3 % 97)};
    char key[32];
    snprintf(key, sizeof(key), "soak-%ld", i);
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.n_prompt_ids = 3;
    s.prompt_ids = prompt;
    s.sampling = &smp;
    s.max_new_tokens = MAX_NEW;
    s.client_key = key;
    Rekv__Control__Request r = REKV__CONTROL__REQUEST__INIT;
    r.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    r.submit = &s;
    for (int tries = 0; tries < 20000; tries++) {
        Rekv__Control__Response *resp = call(&r);
        if (resp == NULL)
            continue;
        int code = resp->code;
        if (code == REKV__CONTROL__CODE__OK && resp->submitted) {
            uint64_t id = resp->submitted->job;
            if (jobs[i].id && jobs[i].id != id)
                n_twice++;
            jobs[i].id = id;
        }
        rekv__control__response__free_unpacked(resp, NULL);
        if (code == REKV__CONTROL__CODE__OK)
            return 0;
        usleep(code == REKV__CONTROL__CODE__BUSY ? 20000 : 100000);
    }
    return -1;
}

static void cancel(uint64_t id)
{
    Rekv__Control__Cancel cn = REKV__CONTROL__CANCEL__INIT;
    cn.job = id;
    Rekv__Control__Request r = REKV__CONTROL__REQUEST__INIT;
    r.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    r.cancel = &cn;
    Rekv__Control__Response *resp = call(&r);
    if (resp)
        rekv__control__response__free_unpacked(resp, NULL);
}

/* Status of job i: 1 when it has ended (recorded), 0 when not yet, -1 when not found. */
static int check(sjob *jobs, long i)
{
    Rekv__Control__StatusRequest st = REKV__CONTROL__STATUS_REQUEST__INIT;
    st.job = jobs[i].id;
    Rekv__Control__Request r = REKV__CONTROL__REQUEST__INIT;
    r.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    r.status = &st;
    Rekv__Control__Response *resp = call(&r);
    if (resp == NULL)
        return 0;
    int out = 0;
    if (resp->code == REKV__CONTROL__CODE__NOT_FOUND) {
        out = -1;
    } else if (resp->code == REKV__CONTROL__CODE__OK && resp->job) {
        Rekv__Control__JobStatus *j = resp->job;
        int ended = j->state == REKV__CONTROL__JOB_STATE__DONE ||
                    j->state == REKV__CONTROL__JOB_STATE__CANCELLED ||
                    j->state == REKV__CONTROL__JOB_STATE__FAILED;
        uint32_t n = j->n_generated_ids < MAX_NEW ? (uint32_t)j->n_generated_ids : MAX_NEW;
        if (jobs[i].ended) { /* seen ended before: the same end, the same tokens */
            if (!ended || jobs[i].ended != (int)j->state + 1 || n != jobs[i].n_got ||
                memcmp(jobs[i].got, j->generated_ids, n * sizeof(int32_t)))
                n_twice++;
            out = 1;
        } else if (ended) {
            jobs[i].ended = (int)j->state + 1;
            jobs[i].n_got = n;
            memcpy(jobs[i].got, j->generated_ids, n * sizeof(int32_t));
            if (j->state == REKV__CONTROL__JOB_STATE__DONE) {
                int p = (int)(i % N_PROMPTS);
                if (!g_ref_have[p]) {
                    g_ref_have[p] = 1;
                    g_ref_n[p] = n;
                    memcpy(g_ref[p], j->generated_ids, n * sizeof(int32_t));
                } else if (n != g_ref_n[p] || memcmp(g_ref[p], j->generated_ids, n * 4)) {
                    n_wrong++;
                }
            }
            out = 1;
        }
    }
    rekv__control__response__free_unpacked(resp, NULL);
    return out;
}

/* What the run gives, as one JSON object on stdout (see the top of the file); returns the largest
 * RSS change of the three daemons, in percent. */
static double print_summary(const sjob *jobs, long n, long accepted, long lost, int kills,
                            int stops, const long rss_warm[3], const long rss_end[3], uint64_t t0)
{
    long done = 0, cancelled = 0, failed = 0;
    for (long k = 0; k < n; k++) {
        done += jobs[k].ended == REKV__CONTROL__JOB_STATE__DONE + 1;
        cancelled += jobs[k].ended == REKV__CONTROL__JOB_STATE__CANCELLED + 1;
        failed += jobs[k].ended == REKV__CONTROL__JOB_STATE__FAILED + 1;
    }
    /* what the faults did: steps that failed and jobs re-queued (coordinator), bytes the last
     * kvstore spilled and read back */
    uint64_t steps_failed = 0, requeued = 0;
    rekv_kv_stats kst = {0};
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    Rekv__Control__Response *sresp = call(&rq);
    if (sresp && sresp->stats)
        steps_failed = sresp->stats->steps_failed, requeued = sresp->stats->requeued;
    if (sresp)
        rekv__control__response__free_unpacked(sresp, NULL);
    rekv_kvstore_client *kc = NULL;
    rekv_err kerr = {0};
    if (rekv_kvstore_client_connect(g_kv, NULL, 5000, &kc, &kerr) == 0) {
        (void)rekv_kvstore_stats(kc, &kst, &kerr);
        rekv_kvstore_client_close(kc);
    }
    static const char *const daemon[3] = {"coordinator", "worker", "kvstore"};
    double pct[3], worst = 0;
    printf("{\"submissions\":%ld,\"accepted\":%ld,\"done\":%ld,\"cancelled\":%ld,\"failed\":%ld,"
           "\"lost\":%ld,\"run_twice\":%ld,\"wrong\":%ld,\"kills\":%d,\"stops\":%d,"
           "\"steps_failed\":%llu,\"requeued\":%llu,\"kvstore_bytes_spilled\":%llu,"
           "\"kvstore_bytes_read_back\":%llu,\"kvstore_spill_errors\":%llu,"
           "\"kvstore_read_errors\":%llu,\"kvstore_crc_errors\":%llu,\"spill_faults\":%d,",
           n, accepted, done, cancelled, failed, lost, n_twice, n_wrong, kills, stops,
           (unsigned long long)steps_failed, (unsigned long long)requeued,
           (unsigned long long)kst.bytes_spilled, (unsigned long long)kst.bytes_read_back,
           (unsigned long long)kst.spill_errors, (unsigned long long)kst.read_errors,
           (unsigned long long)kst.crc_errors, g_spill_faults);
    for (int d = 0; d < 3; d++) {
        pct[d] = rss_warm[d] > 0 ? 100.0 * (double)(rss_end[d] - rss_warm[d]) / (double)rss_warm[d]
                                 : 0;
        worst = pct[d] > worst ? pct[d] : worst;
        printf("\"%s_rss_kb_warm\":%ld,\"%s_rss_kb_end\":%ld,\"%s_rss_change_pct\":%.2f,",
               daemon[d], rss_warm[d], daemon[d], rss_end[d], daemon[d], pct[d]);
    }
    printf("\"wall_s\":%.1f}\n", (double)(rekv_now_ns() - t0) / 1e9);
    return worst;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10000;
    if (n < 100)
        die("at least 100 submissions");
    snprintf(g_model, sizeof(g_model), "../shared/models/stories260K/stories260K.bin");
    if (access(g_model, R_OK)) {
        fprintf(stderr, "soak: %s is missing\n", g_model);
        return 77;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof(g_dir), "%s/rekv-soak.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (mkdtemp(g_dir) == NULL)
        die("mkdtemp");
    snprintf(g_ctl, sizeof(g_ctl), "ipc://%s/control", g_dir);
    snprintf(g_wrk, sizeof(g_wrk), "ipc://%s/workers", g_dir);
    snprintf(g_kv, sizeof(g_kv), "ipc://%s/kv", g_dir);
    snprintf(g_state, sizeof(g_state), "%s/state", g_dir);
    const char *spill = getenv("REKV_SOAK_SPILL_DIR");
    snprintf(g_spill, sizeof(g_spill), "%s", spill && *spill ? spill : g_dir);
    uint64_t t0 = rekv_now_ns();
    pid_t kv = start_kvstore(), co = start_coordinator(), wk = start_worker();
    g_kv_pid = kv;
    reconnect();
    sjob *jobs = calloc((size_t)n, sizeof(sjob));
    long accepted = 0, lost = 0, oldest = 0, warm_at = n / 5 + n / 4;
    long rss_warm[3] = {-1, -1, -1}, rss_end[3] = {-1, -1, -1}; /* coordinator, worker, kvstore */
    int kills = 0, stops = 0;
    for (long i = 0; i < n; i++) {
        jobs[i].cancel = i % 10 == 9 ? 1 : i % 10 == 4 ? 2 : 0;
        if (submit(jobs, i))
            die("the coordinator refused a job 20,000 times");
        accepted++;
        if (jobs[i].cancel == 1)
            cancel(jobs[i].id);
        if (i >= 40 && jobs[i - 40].cancel == 2)
            cancel(jobs[i - 40].id);
        if (i == n / 8) {
            kill9(wk);
            wk = start_worker();
            kills++;
        }
        if (i == n / 4) {
            kill9(kv);
            kv = g_kv_pid = start_kvstore();
            kills++;
        }
        if (i == n / 3) { /* hung: the worker's requests time out; continued in 5 s */
            kill(kv, SIGSTOP);
            g_kv_resume_ns = rekv_now_ns() + 5000000000ull;
            stops++;
        }
        if (i == n / 2 && getenv("REKV_SOAK_SPILL_FAIL")) { /* every spill I/O fails for 5 s */
            fault_cmd("REKV_SOAK_SPILL_FAIL");
            g_spill_mend_ns = rekv_now_ns() + 5000000000ull;
            g_spill_faults++;
        }
        if (i == n / 5) {
            kill9(co);
            co = start_coordinator();
            reconnect();
            kills++;
            /* what ended before the kill is still ended, with the same tokens */
            for (long k = oldest > 1000 ? oldest - 1000 : 0; k < oldest; k++)
                if (jobs[k].ended > 0)
                    (void)check(jobs, k); /* NOT_FOUND: forgotten, nothing to compare */
        }
        if (i == warm_at) {
            rss_warm[0] = tu_proc_status_kb(co, "VmRSS");
            rss_warm[1] = tu_proc_status_kb(wk, "VmRSS");
            rss_warm[2] = tu_proc_status_kb(kv, "VmRSS");
        }
        /* follow the oldest unended jobs, so that none is forgotten before it is seen */
        while (oldest <= i && i - oldest > 200) {
            int r = check(jobs, oldest);
            if (r < 0) {
                lost++;
                oldest++;
            } else if (r > 0) {
                oldest++;
            } else {
                tick_faults();
                usleep(5000);
            }
        }
        while (oldest <= i && jobs[oldest].ended)
            oldest++;
        if (i % 16 == 0)
            for (long k = oldest; k <= i && k < oldest + 32; k++)
                if (!jobs[k].ended && check(jobs, k) < 0) {
                    jobs[k].ended = -1;
                    lost++;
                }
    }
    /* the rest, 300 s at most */
    uint64_t until = rekv_now_ns() + 300ull * 1000000000ull;
    for (; oldest < n && rekv_now_ns() < until;) {
        if (jobs[oldest].ended) {
            oldest++;
            continue;
        }
        int r = check(jobs, oldest);
        if (r < 0) {
            jobs[oldest].ended = -1;
            lost++;
        }
        if (r == 0)
            usleep(10000);
        tick_faults();
    }
    for (long k = oldest; k < n; k++)
        lost += !jobs[k].ended;
    rss_end[0] = tu_proc_status_kb(co, "VmRSS");
    rss_end[1] = tu_proc_status_kb(wk, "VmRSS");
    rss_end[2] = tu_proc_status_kb(kv, "VmRSS");
    double worst = print_summary(jobs, n, accepted, lost, kills, stops, rss_warm, rss_end, t0);
    rekv_ctl_close(g_c);
    stop(wk);
    stop(co);
    stop(kv);
    int bad = lost || n_twice || n_wrong || worst >= 10.0;
    if (bad) /* the daemons' logs are what explains it: kept */
        fprintf(stderr, "soak: the daemons' logs are kept in %s\n", g_dir);
    else
        tu_rmrf(g_dir);
    free(jobs);
    return bad ? 1 : 0;
}
