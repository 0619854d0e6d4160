/* test_journal_fsync.c — the journal is durable before anyone hears of what it records, checked
 * without a virtual machine (test_journal's power cut is the VM one): the real rekv-coordinator
 * (and rekv-gpuworker) on real sockets, the coordinator run under build/tests/libfsync_shim.so
 * (tests/shim/fsync_shim.c, LD_PRELOAD), which logs in the process's own order each write and
 * sync of a file in its state directory and each message it sends. An accepted job's record is
 * written and fdatasync'd before the Submit reply is sent; a finished job's record is written and
 * synced before its end event reaches the streaming client and before a Status shows it ended,
 * and a cancelled one's before the Cancel reply. The checks are on that order, not on time. And a
 * disk whose sync fails (the shim's EIO) makes the Submit answered INTERNAL and forgotten: the same
 * key is a new job once syncs work again. Model: stories260K. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coordinator/coordinator.h"
#include "coordinator/journal.h"
#include "tests/co_env.h"
#include "tests/testutil.h"

/* ---------------------------------------------------------------- the coordinator under the shim
 */

typedef struct shim_env {
    env e;
    char state[PATH_MAX]; /* the state directory's real path (what /proc/self/fd shows) */
    char journal[PATH_MAX + 16];
    char log[4200], fail[4200];
} shim_env;

static int shim_env_open(shim_env *s)
{
    if (ct_env_open(&s->e))
        return -1;
    ck_assert_int_eq(mkdir(s->e.state, 0700), 0);
    ck_assert_ptr_nonnull(realpath(s->e.state, s->state));
    snprintf(s->journal, sizeof(s->journal), "%s/journal", s->state);
    snprintf(s->log, sizeof(s->log), "%s/shim.log", s->e.dir);
    snprintf(s->fail, sizeof(s->fail), "%s/sync-fails", s->e.dir);
    return 0;
}

/* rekv-coordinator with LD_PRELOAD of the shim watching its state directory. */
static pid_t start_shimmed_coordinator(shim_env *s)
{
    const char *build = getenv("REKV_BUILD");
    char rel[4200], so[PATH_MAX];
    snprintf(rel, sizeof(rel), "%s/tests/libfsync_shim.so", build && *build ? build : "build");
    ck_assert_msg(realpath(rel, so) != NULL, "%s: %s (make %s)", rel, strerror(errno), rel);
    setenv("LD_PRELOAD", so, 1);
    setenv("REKV_SHIM_DIR", s->state, 1);
    setenv("REKV_SHIM_LOG", s->log, 1);
    setenv("REKV_SHIM_FAIL", s->fail, 1);
    pid_t p = ct_start_coordinator(&s->e, "64", "30000");
    unsetenv("LD_PRELOAD");
    unsetenv("REKV_SHIM_DIR");
    unsetenv("REKV_SHIM_LOG");
    unsetenv("REKV_SHIM_FAIL");
    ck_assert_msg(p > 0, "rekv-coordinator exited at start");
    return p;
}

/* ---------------------------------------------------------------- the shim's log */

typedef enum { L_WRITE, L_SYNC, L_SEND } ltype;

typedef struct lline {
    ltype t;
    char path[PATH_MAX + 16]; /* write, sync */
    int rc;                   /* sync */
    char sock[32];            /* send: the socket (the control socket's replies are picked) */
    uint8_t *bytes;           /* write, send: decoded */
    size_t n;
} lline;

static uint8_t *unhex(const char *h, size_t *n)
{
    size_t len = strcspn(h, "\n");
    uint8_t *b = malloc(len / 2 + 1);
    ck_assert_ptr_nonnull(b);
    for (size_t i = 0; i + 1 < len; i += 2) {
        unsigned v;
        ck_assert_int_eq(sscanf(h + i, "%2x", &v), 1);
        b[i / 2] = (uint8_t)v;
    }
    *n = len / 2;
    return b;
}

/* The shim's log as lines (its "start" line checked: the shim was loaded), *n their count. */
static lline *read_log(const shim_env *s, size_t *n)
{
    char *text = tu_read_file(s->log, NULL);
    ck_assert_msg(text != NULL && strncmp(text, "start ", 6) == 0,
                  "%s: the shim was not loaded into rekv-coordinator", s->log);
    size_t cap = 64, k = 0;
    lline *v = calloc(cap, sizeof(*v));
    ck_assert_ptr_nonnull(v);
    for (char *p = strchr(text, '\n'); p && p[1]; p = strchr(p + 1, '\n')) {
        char *l = p + 1;
        if (k == cap) {
            v = realloc(v, (cap *= 2) * sizeof(*v));
            ck_assert_ptr_nonnull(v);
        }
        lline *x = memset(&v[k], 0, sizeof(*v));
        char fn[32];
        if (strncmp(l, "write ", 6) == 0) {
            x->t = L_WRITE;
            ck_assert_int_eq(sscanf(l + 6, "%4200s", x->path), 1);
            x->bytes = unhex(l + 6 + strlen(x->path) + 1, &x->n);
        } else if (strncmp(l, "sync ", 5) == 0) {
            x->t = L_SYNC;
            ck_assert_int_eq(sscanf(l + 5, "%31s %4200s %d", fn, x->path, &x->rc), 3);
        } else {
            ck_assert_msg(strncmp(l, "send ", 5) == 0, "shim log: %.60s", l);
            x->t = L_SEND;
            ck_assert_int_eq(sscanf(l + 5, "%31s", x->sock), 1);
            x->bytes = unhex(l + 5 + strlen(x->sock) + 1, &x->n);
        }
        k++;
    }
    free(text);
    *n = k;
    return v;
}

static void free_log(lline *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(v[i].bytes);
    free(v);
}

/* The first line that writes job's record of the given body (a whole frame), or -1. */
static long find_record(const shim_env *s, const lline *v, size_t n, uint64_t job,
                        Rekv__Control__JournalRecord__BodyCase body)
{
    for (size_t i = 0; i < n; i++) {
        if (v[i].t != L_WRITE || strcmp(v[i].path, s->journal) != 0 || v[i].n < 12)
            continue;
        uint32_t hdr[3];
        memcpy(hdr, v[i].bytes, 12);
        if (hdr[0] != REKV_JOURNAL_MAGIC || hdr[1] != v[i].n - 12)
            continue;
        Rekv__Control__JournalRecord *r =
            rekv__control__journal_record__unpack(NULL, hdr[1], v[i].bytes + 12);
        int hit = r && r->job == job && r->body_case == body;
        if (r)
            rekv__control__journal_record__free_unpacked(r, NULL);
        if (hit)
            return (long)i;
    }
    return -1;
}

/* The first sync of the journal after line `after` (any rc when rc_any, else rc 0), or -1. */
static long find_sync(const shim_env *s, const lline *v, size_t n, long after, int rc_any)
{
    for (size_t i = (size_t)(after + 1); i < n; i++)
        if (v[i].t == L_SYNC && strcmp(v[i].path, s->journal) == 0 && (rc_any || v[i].rc == 0))
            return (long)i;
    return -1;
}

/* What a sent message says: 1 for the one pick wants. */
typedef int (*pick_fn)(const Rekv__Control__Response *r, uint64_t a);

static int pick_reply(const Rekv__Control__Response *r, uint64_t req_id)
{
    return req_id != 0 && r->id == req_id;
}
static int pick_end_event(const Rekv__Control__Response *r, uint64_t job)
{
    return r->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT && r->event->job == job &&
           r->event->done;
}
static int pick_ended_status(const Rekv__Control__Response *r, uint64_t job)
{
    return r->body_case == REKV__CONTROL__RESPONSE__BODY_JOB && r->job->job == job &&
           r->job->state != REKV__CONTROL__JOB_STATE__QUEUED &&
           r->job->state != REKV__CONTROL__JOB_STATE__RUNNING;
}

/* The first message sent on sock (NULL: any socket) that pick(r, a) wants, or -1. A worker's
 * message may parse as a Response too: pick_reply (a request id, which they lack) finds the
 * control socket, the other picks look only there. */
static long find_send(const lline *v, size_t n, const char *sock, pick_fn pick, uint64_t a)
{
    for (size_t i = 0; i < n; i++) {
        if (v[i].t != L_SEND || (sock && strcmp(v[i].sock, sock) != 0))
            continue;
        Rekv__Control__Response *r = rekv__control__response__unpack(NULL, v[i].n, v[i].bytes);
        int hit = r && pick(r, a);
        if (r)
            rekv__control__response__free_unpacked(r, NULL);
        if (hit)
            return (long)i;
    }
    return -1;
}

/* ---------------------------------------------------------------- requests */

static Rekv__Control__Response *submit(rekv_ctl *c, const char *key, uint32_t max_new)
{
    static int32_t prompt[] = {1, 2, 3};
    Rekv__Control__Submit sb = REKV__CONTROL__SUBMIT__INIT;
    sb.n_prompt_ids = 3;
    sb.prompt_ids = prompt;
    sb.max_new_tokens = max_new;
    sb.client_key = (char *)key;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    return tu_ctl_call(c, &rq);
}

/* ---------------------------------------------------------------- tests */

/* Submit (no worker: the job stays queued): the accepted record's write, then an fdatasync of the
 * journal that succeeded, then the reply, in that order. */
START_TEST(accepted_synced_before_reply)
{
    shim_env s;
    if (shim_env_open(&s))
        return;
    pid_t co = start_shimmed_coordinator(&s);
    rekv_ctl *c = ct_ctl_open(s.e.ctl);
    Rekv__Control__Response *r = submit(c, "fsync-accept", 4);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "submit: %s", r->error);
    uint64_t job = r->submitted->job, req = r->id;
    rekv__control__response__free_unpacked(r, NULL);

    size_t n;
    lline *v = read_log(&s, &n);
    long w = find_record(&s, v, n, job, REKV__CONTROL__JOURNAL_RECORD__BODY_ACCEPTED);
    long y = find_sync(&s, v, n, w, 0);
    long z = find_send(v, n, NULL, pick_reply, req);
    ck_assert_msg(w >= 0, "no accepted record of job %llu written to %s", (unsigned long long)job,
                  s.journal);
    ck_assert_msg(z >= 0, "the Submit reply was not among the messages sent");
    ck_assert_msg(y >= 0 && y < z,
                  "the Submit reply (log line %ld) was sent before the accepted record (line %ld) "
                  "was synced (sync at line %ld, -1: none yet)",
                  z, w, y);
    printf("accepted: record written at log line %ld, synced at %ld, reply sent at %ld\n", w, y, z);
    free_log(v, n);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&s.e);
}
END_TEST

/* A streamed job runs on a worker to its end: its finished record's write, then a sync of the
 * journal, then the end event to the streaming client and the first Status that shows it ended. */
START_TEST(finished_synced_before_end_heard)
{
    shim_env s;
    if (shim_env_open(&s))
        return;
    pid_t co = start_shimmed_coordinator(&s);
    pid_t wk = ct_start_worker(&s.e, "4");
    ck_assert_msg(wk > 0, "rekv-gpuworker exited at start");
    rekv_ctl *c = ct_ctl_open(s.e.ctl);
    ct_wait_workers(c, 1);

    static int32_t prompt[] = {1, 2, 3};
    Rekv__Control__Submit sb = REKV__CONTROL__SUBMIT__INIT;
    sb.n_prompt_ids = 3;
    sb.prompt_ids = prompt;
    sb.max_new_tokens = 8;
    sb.stream = 1;
    sb.client_key = "fsync-end";
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    rekv_err err = {0};
    uint64_t req = 0, job = 0;
    ck_assert_msg(rekv_ctl_send(c, &rq, &req, &err) == 0, "%s", err.msg);
    for (int over = 0; !over;) { /* the reply, events, the last one done (Check's timeout guards) */
        Rekv__Control__Response *r = NULL;
        ck_assert_msg(rekv_ctl_recv(c, -1, &r, &err) == 0, "%s", err.msg);
        ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "stream: %s", r->error);
        if (r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED)
            job = r->submitted->job;
        else if (r->body_case == REKV__CONTROL__RESPONSE__BODY_EVENT && r->event->done) {
            ck_assert_int_eq(r->event->state, REKV__CONTROL__JOB_STATE__DONE);
            over = 1;
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
    ck_assert_uint_ne(job, 0);
    Rekv__Control__Response *st = tu_ctl_status(c, job);
    ck_assert_int_eq(st->job->state, REKV__CONTROL__JOB_STATE__DONE);
    rekv__control__response__free_unpacked(st, NULL);

    size_t n;
    lline *v = read_log(&s, &n);
    long w = find_record(&s, v, n, job, REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED);
    long y = find_sync(&s, v, n, w, 0);
    long z = find_send(v, n, NULL, pick_reply, req);
    ck_assert_msg(z >= 0, "the Submit reply was not among the messages sent");
    long ev = find_send(v, n, v[z].sock, pick_end_event, job);
    long sv = find_send(v, n, v[z].sock, pick_ended_status, job);
    ck_assert_msg(w >= 0, "no finished record of job %llu written to %s", (unsigned long long)job,
                  s.journal);
    ck_assert_msg(ev >= 0 && sv >= 0, "the end event (%ld) or the ended Status (%ld) not sent", ev,
                  sv);
    ck_assert_msg(y >= 0 && y < ev,
                  "the end event (log line %ld) was sent before the finished record (line %ld) "
                  "was synced (sync at line %ld, -1: none yet)",
                  ev, w, y);
    ck_assert_msg(y < sv,
                  "a Status showing the job ended (log line %ld) was sent before the finished "
                  "record (line %ld) was synced (%ld)",
                  sv, w, y);
    printf("finished: record written at log line %ld, synced at %ld, end event sent at %ld, "
           "Status at %ld\n",
           w, y, ev, sv);
    free_log(v, n);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&s.e);
}
END_TEST

/* Cancel of a queued job (no worker) ends it in the control round: its finished record is written
 * and synced before the Cancel reply that says CANCELLED is sent. */
START_TEST(cancelled_synced_before_reply)
{
    shim_env s;
    if (shim_env_open(&s))
        return;
    pid_t co = start_shimmed_coordinator(&s);
    rekv_ctl *c = ct_ctl_open(s.e.ctl);
    Rekv__Control__Response *r = submit(c, "fsync-cancel", 4);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "submit: %s", r->error);
    uint64_t job = r->submitted->job;
    rekv__control__response__free_unpacked(r, NULL);
    Rekv__Control__Cancel cn = REKV__CONTROL__CANCEL__INIT;
    cn.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    rq.cancel = &cn;
    r = tu_ctl_call(c, &rq);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "cancel: %s", r->error);
    ck_assert_int_eq(r->job->state, REKV__CONTROL__JOB_STATE__CANCELLED);
    uint64_t req = r->id;
    rekv__control__response__free_unpacked(r, NULL);

    size_t n;
    lline *v = read_log(&s, &n);
    long w = find_record(&s, v, n, job, REKV__CONTROL__JOURNAL_RECORD__BODY_FINISHED);
    long y = find_sync(&s, v, n, w, 0);
    long z = find_send(v, n, NULL, pick_reply, req);
    ck_assert_msg(w >= 0, "no finished record of job %llu written to %s", (unsigned long long)job,
                  s.journal);
    ck_assert_msg(z >= 0, "the Cancel reply was not among the messages sent");
    ck_assert_msg(y >= 0 && y < z,
                  "the Cancel reply (log line %ld) was sent before the finished record (line %ld) "
                  "was synced (sync at line %ld, -1: none yet)",
                  z, w, y);
    free_log(v, n);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&s.e);
}
END_TEST

/* A failing disk: while the journal's sync fails (EIO from the shim), a Submit is answered
 * INTERNAL naming the failure, after that sync, and the job is not kept; once syncs work again the
 * same key makes a new job, accepted and synced. */
START_TEST(failed_sync_refuses_submit)
{
    shim_env s;
    if (shim_env_open(&s))
        return;
    pid_t co = start_shimmed_coordinator(&s);
    rekv_ctl *c = ct_ctl_open(s.e.ctl);
    int fd = open(s.fail, O_WRONLY | O_CREAT | O_EXCL, 0600);
    ck_assert_int_ge(fd, 0);
    close(fd);
    Rekv__Control__Response *r = submit(c, "fsync-fail", 4);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__INTERNAL,
                  "a Submit whose record could not be synced was answered %s (%s)",
                  rekv_ctl_code_name(r->code), r->error);
    ck_assert_msg(strstr(r->error, "fdatasync") != NULL, "error: %s", r->error);
    uint64_t req = r->id;
    rekv__control__response__free_unpacked(r, NULL);
    size_t n;
    lline *v = read_log(&s, &n);
    long y = find_sync(&s, v, n, -1, 1), z = find_send(v, n, NULL, pick_reply, req);
    ck_assert_msg(y >= 0 && v[y].rc == -EIO, "no failed sync of %s in the log", s.journal);
    ck_assert_msg(z > y, "the reply (log line %ld) was sent before the failed sync (%ld)", z, y);
    free_log(v, n);

    ck_assert_int_eq(unlink(s.fail), 0);
    r = submit(c, "fsync-fail", 4);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "submit after the disk recovered: %s",
                  r->error);
    ck_assert_msg(!r->submitted->duplicate, "the refused Submit's job was kept");
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&s.e);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("journal_fsync");
    TCase *tc = tcase_create("order");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, accepted_synced_before_reply);
    tcase_add_test(tc, finished_synced_before_end_heard);
    tcase_add_test(tc, cancelled_synced_before_reply);
    tcase_add_test(tc, failed_sync_refuses_submit);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
