/* test_stops.c — Submit.stop (issue 36) against real daemons: a job ends at the first token whose
 * decoded text contains a stop string (across token boundaries, and inside a token of a BPE
 * vocabulary); JobStatus.text ends before the stop, generated_ids keep the token that completed it
 * and none after, the stream's texts add up to that text (so no byte of a stop, nor of a stop's
 * beginning that a later token ruled out, is ever shown before its time: events only append), and
 * all of it holds after a coordinator restart (journal). The expectation is worked out here from
 * the same job run without stops: its ids, decoded by this process's tokenizer a prefix at a time.
 */
#define _GNU_SOURCE
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "co_env.h"
#include "loader/loader.h"
#include "testutil.h"

typedef struct senv {
    char *dir;
    char ctl[4200], wrk[4200], state[4200];
    char model[4096];
} senv;

static int senv_open(senv *e, const char *rel)
{
    const char *m = tu_shared(rel);
    if (m == NULL)
        return -1;
    snprintf(e->model, sizeof(e->model), "%s", m);
    e->dir = tu_tmpdir();
    snprintf(e->ctl, sizeof(e->ctl), "ipc://%s/control", e->dir);
    snprintf(e->wrk, sizeof(e->wrk), "ipc://%s/workers", e->dir);
    snprintf(e->state, sizeof(e->state), "%s/state", e->dir);
    return 0;
}

/* What a program writes to stdout (argv[0] exec'd; it must exit 0); malloc'd. */
static char *cli_output(const char *const *argv)
{
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(pfd[0]);
        dup2(pfd[1], 1);
        execv(argv[0], (char **)argv);
        _exit(127);
    }
    close(pfd[1]);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    ssize_t r;
    while ((r = read(pfd[0], buf + n, cap - 1 - n)) > 0)
        n += (size_t)r;
    buf[n] = '\0';
    close(pfd[0]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s exited %#x", argv[0], st);
    return buf;
}

/* with_model 0: a coordinator without a tokenizer */
static pid_t start_co(senv *e, int with_model)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *args[] = {prog,   "--control",   e->ctl,   "--workers",
                          e->wrk, "--state-dir", e->state, "--worker-timeout-ms",
                          "1000", "--model",     e->model, NULL};
    if (!with_model)
        args[9] = NULL;
    return ct_spawn(args);
}

static pid_t start_wk(senv *e)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,  "--model",     e->model, "--coordinator",  e->wrk, "--backend",
                          "cpu", "--max-batch", "4",      "--heartbeat-ms", "100",  NULL};
    return ct_spawn(args);
}

typedef struct run_out {
    uint64_t job;
    int32_t ids[1024];
    size_t n_ids;
    char text[16384]; /* the stream's texts, concatenated */
    size_t n_text;
    char reason[32];
} run_out;

/* Submits s with a stream and follows it to the end: the events' tokens and texts, in order. */
static void run_stream(rekv_ctl *c, Rekv__Control__Submit *s, run_out *o)
{
    memset(o, 0, sizeof(*o));
    s->stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = s;
    uint64_t id;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_send(c, &rq, &id, &err) == 0, "%s", err.msg);
    for (int done = 0; !done;) {
        Rekv__Control__Response *r = NULL;
        ck_assert_msg(rekv_ctl_recv(c, 60000, &r, &err) == 0, "%s", err.msg);
        ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
        ck_assert_uint_eq(r->id, id);
        if (r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
            o->job = r->submitted->job;
        } else {
            ck_assert_int_eq(r->body_case, REKV__CONTROL__RESPONSE__BODY_EVENT);
            const Rekv__Control__StreamEvent *ev = r->event;
            ck_assert_uint_eq(ev->offset, o->n_ids); /* nothing twice, nothing skipped */
            ck_assert(o->n_ids + ev->n_tokens <= 1024);
            memcpy(o->ids + o->n_ids, ev->tokens, sizeof(int32_t) * ev->n_tokens);
            o->n_ids += ev->n_tokens;
            ck_assert(ev->has_text);
            ck_assert(o->n_text + ev->text.len < sizeof(o->text));
            memcpy(o->text + o->n_text, ev->text.data, ev->text.len);
            o->n_text += ev->text.len;
            if (ev->done) {
                snprintf(o->reason, sizeof(o->reason), "%s", ev->finish_reason);
                done = 1;
            }
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
}

static Rekv__Control__Response *status_text(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__StatusRequest st = REKV__CONTROL__STATUS_REQUEST__INIT;
    st.job = job;
    st.with_text = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &st;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
    return r;
}

/* What a job stopping at `stop` must give, from the ids it makes without stops: the fewest ids
 * whose text holds the stop (*k), the text before the stop's first place (*text_end). */
static void expect_stop(const rekv_tokenizer *tok, const int32_t *ids, size_t n, const char *stop,
                        size_t *k, size_t *text_end)
{
    for (*k = 1; *k <= n; (*k)++) {
        char *t;
        size_t len;
        ck_assert_int_eq(rekv_tokenizer_decode(tok, ids, *k, &t, &len, NULL), 0);
        char *m = memmem(t, len, stop, strlen(stop));
        if (m) {
            *text_end = (size_t)(m - t);
            free(t);
            return;
        }
        free(t);
    }
    ck_abort_msg("the stop never appears");
}

/* The job with `stops` against `ref` (the same job without them): stream, Status and, after a
 * restart of the coordinator (co: its pid, replaced), Status and a new stream. */
static void check_stopped(senv *e, pid_t *co, rekv_ctl **c, Rekv__Control__Submit *s,
                          const run_out *ref, const rekv_tokenizer *tok, const char *stop)
{
    size_t k, end;
    expect_stop(tok, ref->ids, ref->n_ids, stop, &k, &end);
    ck_assert_msg(k < ref->n_ids, "the stop must end the job before its length");
    run_out o;
    run_stream(*c, s, &o);
    ck_assert_str_eq(o.reason, "stop");
    ck_assert_uint_eq(o.n_ids, k);
    ck_assert_int_eq(memcmp(o.ids, ref->ids, sizeof(int32_t) * k), 0);
    ck_assert_uint_eq(o.n_text, end);
    ck_assert_int_eq(memcmp(o.text, ref->text, end), 0);
    for (int pass = 0; pass < 2; pass++) {
        Rekv__Control__Response *r = status_text(*c, o.job);
        const Rekv__Control__JobStatus *st = r->job;
        ck_assert_int_eq(st->state, REKV__CONTROL__JOB_STATE__DONE);
        ck_assert_str_eq(st->finish_reason, "stop");
        ck_assert_uint_eq(st->n_generated_ids, k);
        ck_assert_int_eq(memcmp(st->generated_ids, ref->ids, sizeof(int32_t) * k), 0);
        ck_assert_uint_eq(strlen(st->text), end);
        ck_assert_int_eq(memcmp(st->text, ref->text, end), 0);
        rekv__control__response__free_unpacked(r, NULL);
        if (pass == 1)
            break;
        /* the journal keeps where the text ends */
        rekv_ctl_close(*c);
        ck_assert_int_eq(ct_stop(*co), 0);
        *co = start_co(e, 1);
        *c = ct_ctl_open(e->ctl);
    }
    /* a stream after the restart: the whole text at once, cut as before */
    Rekv__Control__StreamRequest sr = REKV__CONTROL__STREAM_REQUEST__INIT;
    sr.job = o.job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STREAM;
    rq.stream = &sr;
    Rekv__Control__Response *r = tu_ctl_call(*c, &rq);
    ck_assert_int_eq(r->body_case, REKV__CONTROL__RESPONSE__BODY_EVENT);
    ck_assert(r->event->done);
    ck_assert_uint_eq(r->event->n_tokens, k);
    ck_assert_uint_eq(r->event->text.len, end);
    ck_assert_int_eq(memcmp(r->event->text.data, ref->text, end), 0);
    rekv__control__response__free_unpacked(r, NULL);
}

/* A byte-level vocabulary (docs8L): a stop of three tokens; a second stop whose first two bytes
 * come earlier in the text (held back there, then shown when the next byte rules it out) but which
 * never completes. */
START_TEST(stop_across_tokens)
{
    senv e;
    if (senv_open(&e, "models/docs8L/docs8L.bin"))
        return;
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_for_model(e.model, &tok, &err) == 0, "%s", err.msg);
    pid_t co = start_co(&e, 1), wk = start_wk(&e);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.prompt_text = "The package provides";
    s.max_new_tokens = 120;
    run_out ref;
    run_stream(c, &s, &ref);
    ck_assert_str_eq(ref.reason, "length");
    ck_assert_uint_eq(ref.n_ids, 120);
    /* a stop: three bytes first seen at 40 or later; a decoy: two bytes seen earlier and a third
     * that never follows them (\x01: never in docs8L's text) */
    ck_assert_uint_ge(ref.n_text, 100);
    char stop[4] = {0}, decoy[4] = {0};
    size_t p = 40;
    for (; p + 3 < ref.n_text; p++) {
        memcpy(stop, ref.text + p, 3);
        if (memmem(ref.text, p + 2, stop, 3) == NULL)
            break;
    }
    ck_assert_uint_lt(p + 3, ref.n_text);
    memcpy(decoy, ref.text + 10, 2);
    decoy[2] = '\x01';
    char *stops[] = {decoy, stop};
    s.n_stop = 2;
    s.stop = stops;
    check_stopped(&e, &co, &c, &s, &ref, tok, stop);
    /* a stop whose beginning ends the text: held back to the last step, then shown whole with
     * the job's end ("length") */
    char tail[4] = {ref.text[ref.n_text - 2], ref.text[ref.n_text - 1], '\x01', 0};
    char *tails[] = {tail};
    s.n_stop = 1;
    s.stop = tails;
    run_out o;
    run_stream(c, &s, &o);
    ck_assert_str_eq(o.reason, "length");
    ck_assert_uint_eq(o.n_text, ref.n_text);
    ck_assert_int_eq(memcmp(o.text, ref.text, ref.n_text), 0);
    /* `rekv submit --stop`: the prompt, the text up to the stop, a newline */
    size_t k, end;
    expect_stop(tok, ref.ids, ref.n_ids, stop, &k, &end);
    const char *argv[] = {tu_bin("rekv"),
                          "submit",
                          "--socket",
                          e.ctl,
                          "--prompt",
                          s.prompt_text,
                          "--max-new-tokens",
                          "120",
                          "--stop",
                          decoy,
                          "--stop",
                          stop,
                          NULL};
    char *out = cli_output(argv);
    size_t np = strlen(s.prompt_text);
    ck_assert_uint_eq(strlen(out), np + end + 1);
    ck_assert_int_eq(memcmp(out, s.prompt_text, np), 0);
    ck_assert_int_eq(memcmp(out + np, ref.text, end), 0);
    free(out);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    rekv_tokenizer_free(tok);
    tu_rmrf(e.dir);
    free(e.dir);
}
END_TEST

/* A BPE vocabulary (llama-tiny-py, sampled for varied tokens): a stop that begins in one token and
 * ends one byte into the next, so the text ends before a token that the ids keep. */
START_TEST(stop_inside_token)
{
    senv e;
    if (senv_open(&e, "models/llama-tiny-py"))
        return;
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_for_model(e.model, &tok, &err) == 0, "%s", err.msg);
    pid_t co = start_co(&e, 1), wk = start_wk(&e);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    smp.temperature = 1.0f;
    smp.seed = 11;
    s.sampling = &smp;
    s.prompt_text = "def main(argv):\n    ";
    s.max_new_tokens = 60;
    run_out ref;
    run_stream(c, &s, &ref);
    ck_assert_uint_eq(ref.n_ids, 60);
    /* token t (t >= 5) of two bytes or more whose text starts at L0 >= 2: the stop is the two
     * bytes before it and its first byte, first seen there */
    char stop[4] = {0};
    size_t t, l0 = 0;
    int found = 0;
    for (t = 5; t + 1 < ref.n_ids && !found; t++) {
        char *a, *b;
        size_t la, lb;
        ck_assert_int_eq(rekv_tokenizer_decode(tok, ref.ids, t, &a, &la, NULL), 0);
        ck_assert_int_eq(rekv_tokenizer_decode(tok, ref.ids, t + 1, &b, &lb, NULL), 0);
        if (lb >= la + 2 && la >= 2) {
            memcpy(stop, b + la - 2, 3);
            l0 = la;
            found = memmem(b, la + 1, stop, 3) == b + la - 2 && strlen(stop) == 3;
        }
        free(a);
        free(b);
    }
    ck_assert_msg(found, "no token to stop inside");
    char *stops[] = {stop};
    s.n_stop = 1;
    s.stop = stops;
    size_t k, end;
    expect_stop(tok, ref.ids, ref.n_ids, stop, &k, &end);
    ck_assert_uint_eq(end, l0 - 2); /* the text ends in the token before the one kept last */
    check_stopped(&e, &co, &c, &s, &ref, tok, stop);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    rekv_tokenizer_free(tok);
    tu_rmrf(e.dir);
    free(e.dir);
}
END_TEST

/* The worker dies (kill -9) while a job with a stop streams; the job runs again on a new worker
 * from its prompt: the stream goes on where it was (no token, no byte twice, none held back
 * shown), and ends at the stop as the first run would have. The worker is stopped before the kill,
 * so the job cannot reach its stop in the first run. */
START_TEST(stop_rerun_after_worker_death)
{
    senv e;
    if (senv_open(&e, "models/docs8L/docs8L.bin"))
        return;
    rekv_tokenizer *tok = NULL;
    rekv_err err = {0};
    ck_assert_msg(rekv_tokenizer_load_for_model(e.model, &tok, &err) == 0, "%s", err.msg);
    pid_t co = start_co(&e, 1), wk = start_wk(&e);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.prompt_text = "The package provides";
    s.max_new_tokens = 120;
    run_out ref;
    run_stream(c, &s, &ref);
    char stop[4] = {0};
    size_t p = 60;
    for (; p + 3 < ref.n_text; p++) {
        memcpy(stop, ref.text + p, 3);
        if (memmem(ref.text, p + 2, stop, 3) == NULL)
            break;
    }
    ck_assert_uint_lt(p + 3, ref.n_text);
    size_t k, end;
    expect_stop(tok, ref.ids, ref.n_ids, stop, &k, &end);
    char *stops[] = {stop};
    s.n_stop = 1;
    s.stop = stops;
    s.stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    uint64_t id, job = 0;
    ck_assert_msg(rekv_ctl_send(c, &rq, &id, &err) == 0, "%s", err.msg);
    run_out o;
    memset(&o, 0, sizeof(o));
    int killed = 0;
    for (int done = 0; !done;) {
        Rekv__Control__Response *r = NULL;
        ck_assert_msg(rekv_ctl_recv(c, 60000, &r, &err) == 0, "%s", err.msg);
        ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
        if (r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
            job = r->submitted->job;
        } else {
            const Rekv__Control__StreamEvent *ev = r->event;
            ck_assert_uint_eq(ev->offset, o.n_ids);
            memcpy(o.ids + o.n_ids, ev->tokens, sizeof(int32_t) * ev->n_tokens);
            o.n_ids += ev->n_tokens;
            memcpy(o.text + o.n_text, ev->text.data, ev->text.len);
            o.n_text += ev->text.len;
            done = ev->done;
            if (done)
                snprintf(o.reason, sizeof(o.reason), "%s", ev->finish_reason);
            if (!killed && o.n_ids >= 10) {
                ck_assert_uint_lt(o.n_ids, k);
                ck_assert_int_eq(kill(wk, SIGSTOP), 0);
                tu_kill9(wk);
                wk = start_wk(&e);
                killed = 1;
            }
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
    ck_assert(killed);
    ck_assert_str_eq(o.reason, "stop");
    ck_assert_uint_eq(o.n_ids, k);
    ck_assert_int_eq(memcmp(o.ids, ref.ids, sizeof(int32_t) * k), 0);
    ck_assert_uint_eq(o.n_text, end);
    ck_assert_int_eq(memcmp(o.text, ref.text, end), 0);
    Rekv__Control__Response *r = status_text(c, job);
    ck_assert_uint_eq(r->job->attempts, 2);
    ck_assert_uint_eq(strlen(r->job->text), end);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    rekv_tokenizer_free(tok);
    tu_rmrf(e.dir);
    free(e.dir);
}
END_TEST

static void expect_bad(rekv_ctl *c, Rekv__Control__Submit *s, const char *what)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = s;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    ck_assert_msg(strstr(r->error, what), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
}

/* The limits: 16 strings of 1..256 bytes, and a tokenizer. */
START_TEST(stop_refused)
{
    senv e;
    if (senv_open(&e, "models/docs8L/docs8L.bin"))
        return;
    pid_t co = start_co(&e, 1);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.prompt_text = "x";
    s.max_new_tokens = 4;
    char *many[17];
    for (int i = 0; i < 17; i++)
        many[i] = "ab";
    s.stop = many;
    s.n_stop = 17;
    expect_bad(c, &s, "at most 16");
    s.n_stop = 16;
    many[3] = "";
    expect_bad(c, &s, "stop string 4 is 0 bytes");
    char big[258];
    memset(big, 'a', 257);
    big[257] = '\0';
    many[3] = big;
    expect_bad(c, &s, "stop string 4 is 257 bytes");
    big[256] = '\0';
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq); /* 16 of 256 bytes: taken */
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    /* no tokenizer: ids only, and no stops */
    tu_rmrf(e.state);
    co = start_co(&e, 0);
    c = ct_ctl_open(e.ctl);
    int32_t ids[] = {65, 66};
    s.prompt_text = NULL;
    s.prompt_ids = ids;
    s.n_prompt_ids = 2;
    s.n_stop = 1;
    expect_bad(c, &s, "stop strings need the coordinator's tokenizer");
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    tu_rmrf(e.dir);
    free(e.dir);
}
END_TEST

static Suite *stops_suite(void)
{
    Suite *s = suite_create("stops");
    TCase *tc = tcase_create("stops");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, stop_across_tokens);
    tcase_add_test(tc, stop_inside_token);
    tcase_add_test(tc, stop_rerun_after_worker_death);
    tcase_add_test(tc, stop_refused);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(stops_suite());
}
