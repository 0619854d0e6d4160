/* cli_client.c — `rekv submit`, `rekv status`, `rekv cancel`, `rekv stats`: one request each to the
 * coordinator's control socket (submit waits for the job by streaming its tokens: their text goes
 * to stdout as each step produces it, tokens/s to a terminal; Ctrl-C or SIGTERM while it waits
 * cancels the job), answers printed as text or JSON. */
#define _GNU_SOURCE /* pipe2 */
#include "coordinator/cli/cli_daemon.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/curve.h"
#include "coordinator/cli/cli.h"
#include "coordinator/coordinator.h"
#include "kvstore/kvstore.h"

#define CALL_TIMEOUT_MS 10000

static json_t *status_json(const Rekv__Control__JobStatus *s)
{
    json_t *o = json_object(), *ids = json_array();
    for (size_t i = 0; i < s->n_generated_ids; i++)
        json_array_append_new(ids, json_integer(s->generated_ids[i]));
    json_object_set_new(o, "job", json_integer((json_int_t)s->job));
    json_object_set_new(o, "state", json_string(rekv_ctl_state_name(s->state)));
    json_object_set_new(o, "generated_ids", ids);
    json_object_set_new(o, "finish_reason", json_string(s->finish_reason ? s->finish_reason : ""));
    if (s->error && *s->error)
        json_object_set_new(o, "error", json_string(s->error));
    if (s->text && *s->text) {
        json_t *t = json_string(s->text);
        json_object_set_new(o, "text", t ? t : json_null()); /* NULL: not valid UTF-8 */
    }
    json_object_set_new(o, "prompt_tokens", json_integer(s->prompt_tokens));
    json_object_set_new(o, "cached_tokens", json_integer(s->cached_tokens));
    json_object_set_new(o, "attempts", json_integer(s->attempts));
    json_object_set_new(o, "priority", json_integer(s->priority));
    json_object_set_new(o, "queued_s", json_real(s->queued_s));
    json_object_set_new(o, "run_s", json_real(s->run_s));
    if (s->first_token_s > 0)
        json_object_set_new(o, "first_token_s", json_real(s->first_token_s));
    if (s->waiting && *s->waiting)
        json_object_set_new(o, "waiting", json_string(s->waiting));
    if (s->n_logprobs > 0) {
        json_t *lp = json_array(), *top = json_array();
        size_t k = s->top_logprobs;
        int with_top = k > 0 && s->n_top_logprob_ids == s->n_logprobs * k &&
                       s->n_top_logprob_vals == s->n_top_logprob_ids;
        for (size_t i = 0; i < s->n_logprobs; i++) {
            json_array_append_new(lp, json_real(s->logprobs[i]));
            json_t *row = json_array();
            for (size_t q = 0; with_top && q < k; q++)
                json_array_append_new(row,
                                      json_pack("{s:i, s:f}", "id", s->top_logprob_ids[i * k + q],
                                                "logprob", (double)s->top_logprob_vals[i * k + q]));
            json_array_append_new(top, row);
        }
        json_object_set_new(o, "logprobs", lp);
        if (with_top)
            json_object_set_new(o, "top_logprobs", top);
        else
            json_decref(top);
    }
    return o;
}

static void print_json(json_t *o)
{
    char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(9));
    printf("%s\n", s);
    free(s);
    json_decref(o);
}

/* Prints a non-OK response's reason; returns 1. */
static int fail_response(const Rekv__Control__Response *r)
{
    fprintf(stderr, "rekv: %s: %s\n", rekv_ctl_code_name(r->code),
            r->error && *r->error ? r->error : "(no detail)");
    return 1;
}

/* Connects, failing at once (not after the call's timeout) where no coordinator can be. */
static int connect_or_say(const char *ep, rekv_ctl **c)
{
    rekv_err err = {0};
    const char *key = NULL;
    if (cli_ctl_reachable(ep, &err) || rekv_curve_server_key(ep, &key, &err) ||
        rekv_ctl_connect(ep, key, c, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        return 1;
    }
    return 0;
}

static int call_or_say(rekv_ctl *c, Rekv__Control__Request *rq, Rekv__Control__Response **r)
{
    rekv_err err = {0};
    if (rekv_ctl_call(c, rq, CALL_TIMEOUT_MS, r, &err)) {
        fprintf(stderr, "rekv: %s (is a coordinator running? start one with `rekv run`)\n",
                err.msg);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- submit */

#define SUBMIT_TRIES 4            /* one Submit and up to three retries with its key */
#define STREAM_SILENCE_MS 30000   /* no event this long: ask again (same key) */

/* def, or $REKV_TIMEOUT_MS when set (tests make a restart's silence short) */
static int timeout_ms(int def)
{
    const char *env = getenv("REKV_TIMEOUT_MS");
    long t;
    if (env && *env && cli_parse_int("REKV_TIMEOUT_MS", env, 1, 3600000, &t) == 0)
        return (int)t;
    return def;
}

int cli_submit_call(rekv_ctl *c, Rekv__Control__Request *rq, char *key, int call_ms, int tries,
                    Rekv__Control__Response **r, rekv_err *err)
{
    call_ms = timeout_ms(call_ms);
    if (rq->submit->client_key == NULL || *rq->submit->client_key == '\0') {
        uint8_t rnd[16];
        if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
            return rekv_errf(err, -EIO, "getrandom: %s", strerror(errno));
        for (int i = 0; i < 16; i++)
            snprintf(key + 2 * i, 3, "%02x", rnd[i]);
        rq->submit->client_key = key;
    }
    int rc = 0;
    for (int i = 0; i < tries; i++) {
        if (i)
            fprintf(stderr, "rekv: %s; sending the job again (key %s: it runs once)\n", err->msg,
                    rq->submit->client_key);
        rq->id = 0; /* a late reply to an earlier attempt is dropped; the retry's names the job */
        rekv_err_clear(err);
        rc = rekv_ctl_call(c, rq, call_ms, r, err);
        if (rc != -ETIMEDOUT)
            break;
    }
    return rc;
}

static void submit_usage(FILE *f)
{
    fprintf(f,
            "usage: rekv submit (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]\n"
            "                   [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
            "                   [--priority P] [--ignore-eos] [--stop STR]...\n"
            "                   [--logprobs] [--top-logprobs K] [--no-wait] [--json]\n"
            "                   [--socket ENDPOINT]\n"
            "Sampling as `rekv generate`. Waits for the job, printing its text as the tokens\n"
            "come (token ids when the coordinator has no tokenizer), unless --no-wait (then\n"
            "prints its id); --json prints one object when the job is over. --stop ends the\n"
            "job where its text first holds STR (up to 16; the text ends before it; needs the\n"
            "coordinator's tokenizer). --logprobs records each token's log-probability,\n"
            "--top-logprobs K (0-20) also the K most likely tokens': in --json's object, else\n"
            "a line per token after the text. Ctrl-C (or SIGTERM) while waiting cancels the\n"
            "job and exits 130 (143).\n");
}

#define SUBMIT_MAX_STOPS 16 /* the coordinator's limit (control.proto Submit.stop) */

typedef struct submit_opts {
    const char *prompt, *prompt_ids, *ep;
    long max_new, top_k, seed, prio, top_logprobs;
    double temperature, top_p;
    int json, ignore_eos, no_wait, logprobs;
    char *stop[SUBMIT_MAX_STOPS]; /* --stop, in order (argv's strings) */
    int n_stop;
} submit_opts;

static int submit_parse(int argc, char **argv, submit_opts *o)
{
    static const struct option opts[] = {
        {"prompt", required_argument, 0, 'p'},      {"prompt-ids", required_argument, 0, 'i'},
        {"max-new-tokens", required_argument, 0, 'n'}, {"temperature", required_argument, 0, 't'},
        {"top-k", required_argument, 0, 'k'},       {"top-p", required_argument, 0, 'P'},
        {"seed", required_argument, 0, 's'},        {"priority", required_argument, 0, 'r'},
        {"ignore-eos", no_argument, 0, 'E'},        {"no-wait", no_argument, 0, 'W'},
        {"json", no_argument, 0, 'j'},              {"socket", required_argument, 0, 'S'},
        {"stop", required_argument, 0, 'x'},        {"logprobs", no_argument, 0, 'L'},
        {"top-logprobs", required_argument, 0, 'T'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    *o = (submit_opts){.max_new = 64, .top_p = 1};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'p': o->prompt = optarg; break;
        case 'i': o->prompt_ids = optarg; break;
        case 'n': if (cli_parse_int("max-new-tokens", optarg, 0, 1 << 24, &o->max_new)) return 2; break;
        case 't': if (cli_parse_float("temperature", optarg, 0, 100, &o->temperature)) return 2; break;
        case 'k': if (cli_parse_int("top-k", optarg, 0, 1 << 30, &o->top_k)) return 2; break;
        case 'P': if (cli_parse_float("top-p", optarg, 0, 1, &o->top_p)) return 2; break;
        case 's': if (cli_parse_int("seed", optarg, 0, INT64_MAX, &o->seed)) return 2; break;
        case 'r': if (cli_parse_int("priority", optarg, -1000000, 1000000, &o->prio)) return 2; break;
        case 'E': o->ignore_eos = 1; break;
        case 'W': o->no_wait = 1; break;
        case 'j': o->json = 1; break;
        case 'S': o->ep = optarg; break;
        case 'x':
            if (o->n_stop == SUBMIT_MAX_STOPS) {
                fprintf(stderr, "%s: at most %d --stop strings\n", argv[0], SUBMIT_MAX_STOPS);
                return 2;
            }
            o->stop[o->n_stop++] = optarg;
            break;
        case 'L': o->logprobs = 1; break;
        case 'T': if (cli_parse_int("top-logprobs", optarg, 0, 20, &o->top_logprobs)) return 2; o->logprobs = 1; break;
        case 'h': submit_usage(stdout); return 0;
        default: submit_usage(stderr); return 2;
        }
    }
    if (cli_no_operands(argc, argv) || (o->prompt == NULL) == (o->prompt_ids == NULL)) {
        submit_usage(stderr);
        return 2;
    }
    return CLI_PARSED;
}

/* While a job is waited for, SIGINT and SIGTERM go to a handler that writes the signal to a pipe
 * the wait polls beside the socket (from before the Submit, so that one during it is seen once the
 * job has its id). A handler rather than a blocked mask and a signalfd: a signal sent to the
 * process may be delivered to any thread that does not block it (as cli_remote.c). */
static int g_sig_pipe = -1; /* the write end */

static void on_submit_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    if (write(g_sig_pipe, &b, 1) < 0) { /* full: a byte is there already */
    }
    errno = saved;
}

/* The signal the pipe holds (read end sfd), or 0. */
static int take_signal(int sfd)
{
    unsigned char b;
    return sfd >= 0 && read(sfd, &b, 1) == 1 ? b : 0;
}

/* rekv_ctl_recv that also ends, -EINTR with the signal in *signo, when SIGINT or SIGTERM came
 * (sfd: the read end of their pipe, -1 none). */
static int follow_recv(rekv_ctl *c, int sfd, int timeout_ms, Rekv__Control__Response **r,
                       int *signo, rekv_err *err)
{
    zmq_pollitem_t it[2] = {{rekv_ctl_socket(c), 0, ZMQ_POLLIN, 0}, {NULL, sfd, ZMQ_POLLIN, 0}};
    int n;
    do
        n = zmq_poll(it, sfd >= 0 ? 2 : 1, timeout_ms);
    while (n < 0 && errno == EINTR);
    if (n < 0)
        return rekv_errf(err, -errno, "control poll: %s", zmq_strerror(errno));
    if ((it[1].revents & ZMQ_POLLIN) && (*signo = take_signal(sfd)) != 0)
        return rekv_errf(err, -EINTR, "interrupted by signal %d", *signo);
    if (n == 0 || !(it[0].revents & ZMQ_POLLIN))
        return rekv_errf(err, -ETIMEDOUT, "no reply from the coordinator within %d ms",
                         timeout_ms);
    return rekv_ctl_recv(c, 0, r, err);
}

/* Follows job's stream (rq: its Submit, sent again under the same key after a silence; req_id: the
 * request id its events carry) until the job is over, *r then holding the last event: without
 * --json its text (or, from a coordinator without a tokenizer, its ids) goes to stdout as it
 * comes; tokens/s on a terminal that is not also showing the text. 0, 1 with a message, or 2
 * when SIGINT or SIGTERM came first (sfd: their pipe's read end; *signo which). */
static int submit_follow(rekv_ctl *c, Rekv__Control__Request *rq, char *key, uint64_t job,
                         uint64_t req_id, const submit_opts *o, int sfd, int *signo,
                         Rekv__Control__Response **r)
{
    rekv_err err = {0};
    int tty = isatty(2) && (o->json || !isatty(1)), started = 0;
    uint64_t t0 = rekv_now_ns(), n_tok = 0;
    if (!o->json && o->prompt) {
        fputs(o->prompt, stdout);
        fflush(stdout);
    }
    for (;;) {
        rekv__control__response__free_unpacked(*r, NULL);
        *r = NULL;
        int rc = follow_recv(c, sfd, timeout_ms(STREAM_SILENCE_MS), r, signo, &err);
        if (rc == -EINTR)
            return 2;
        if (rc == -ETIMEDOUT) {
            /* silence: the coordinator may have restarted and lost the subscription; the same
             * key subscribes again to the same job, from the first token not shown yet */
            rq->submit->stream_from = (uint32_t)n_tok;
            rc = cli_submit_call(c, rq, key, CALL_TIMEOUT_MS, SUBMIT_TRIES, r, &err);
            if (rc == 0 && (*r)->code != REKV__CONTROL__CODE__OK)
                return fail_response(*r);
            if (rc == 0) {
                if ((*r)->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED)
                    req_id = (*r)->id;
                continue;
            }
        }
        if (rc) {
            fprintf(stderr, "rekv: %s\n", err.msg);
            return 1;
        }
        if ((*r)->id != req_id || (*r)->body_case != REKV__CONTROL__RESPONSE__BODY_EVENT)
            continue;
        const Rekv__Control__StreamEvent *ev = (*r)->event;
        uint64_t end = (uint64_t)ev->offset + ev->n_tokens;
        if (end <= n_tok && !ev->done)
            continue; /* shown already */
        if (!o->json && end > n_tok) {
            /* the coordinator sends from the first token not shown (stream_from); text that
             * starts before it could not be cut, and is not expected */
            if (ev->has_text && ev->offset >= n_tok)
                fwrite(ev->text.data, 1, ev->text.len, stdout);
            else if (!ev->has_text)
                for (uint64_t i = ev->offset > n_tok ? ev->offset : n_tok; i < end; i++, started = 1)
                    printf("%s%d", started ? "," : "", ev->tokens[i - ev->offset]);
            fflush(stdout);
        }
        n_tok = end > n_tok ? end : n_tok;
        if (tty) {
            double dt = (double)(rekv_now_ns() - t0) * 1e-9;
            fprintf(stderr, "\rjob %llu: %llu tokens, %.1f tokens/s ", (unsigned long long)job,
                    (unsigned long long)n_tok, dt > 0 ? (double)n_tok / dt : 0.0);
        }
        if (ev->done) {
            if (tty)
                fprintf(stderr, "\n");
            return 0;
        }
    }
}

/* --json: the finished job's status as one object; the exit code. */
static int submit_print_json(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__StatusRequest sr = REKV__CONTROL__STATUS_REQUEST__INIT;
    sr.job = job;
    sr.with_text = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &sr;
    Rekv__Control__Response *r = NULL;
    int rc = 1;
    if (call_or_say(c, &rq, &r))
        goto out;
    if (r->code != REKV__CONTROL__CODE__OK || r->body_case != REKV__CONTROL__RESPONSE__BODY_JOB) {
        rc = fail_response(r);
        goto out;
    }
    const Rekv__Control__JobStatus *st = r->job;
    print_json(status_json(st));
    if (st->state == REKV__CONTROL__JOB_STATE__FAILED)
        fprintf(stderr, "rekv: job %llu failed: %s\n", (unsigned long long)job, st->error);
    rc = st->state == REKV__CONTROL__JOB_STATE__DONE ? 0 : 1;
out:
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    return rc;
}

/* Ctrl-C or SIGTERM while the job is waited for: it is cancelled (the coordinator ends it at
 * once; its worker drops it), and with --json its status is printed. The exit code: 128 + signo. */
static int submit_cancel(rekv_ctl *c, uint64_t job, int signo, int json)
{
    Rekv__Control__Cancel cn = REKV__CONTROL__CANCEL__INIT;
    cn.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
    rq.cancel = &cn;
    Rekv__Control__Response *r = NULL;
    fflush(stdout);
    if (call_or_say(c, &rq, &r) == 0) {
        if (r->code != REKV__CONTROL__CODE__OK || r->body_case != REKV__CONTROL__RESPONSE__BODY_JOB)
            fail_response(r);
        else if (json)
            print_json(status_json(r->job));
        else
            fprintf(stderr, "\nrekv: job %llu %s (%s)\n", (unsigned long long)job,
                    rekv_ctl_state_name(r->job->state), strsignal(signo));
    }
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    return 128 + signo;
}

/* --logprobs without --json: after the text, a line per generated token: its id, its
 * log-probability and the most likely tokens' (id:logprob). */
static int submit_print_logprobs(rekv_ctl *c, uint64_t job)
{
    Rekv__Control__StatusRequest sr = REKV__CONTROL__STATUS_REQUEST__INIT;
    sr.job = job;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &sr;
    Rekv__Control__Response *r = NULL;
    if (call_or_say(c, &rq, &r))
        return 1;
    if (r->code != REKV__CONTROL__CODE__OK || r->body_case != REKV__CONTROL__RESPONSE__BODY_JOB) {
        fail_response(r);
        rekv__control__response__free_unpacked(r, NULL);
        return 1;
    }
    const Rekv__Control__JobStatus *s = r->job;
    size_t k = s->top_logprobs;
    int with_top =
        s->n_top_logprob_ids == s->n_logprobs * k && s->n_top_logprob_vals == s->n_top_logprob_ids;
    for (size_t i = 0; i < s->n_logprobs && i < s->n_generated_ids; i++) {
        printf("%d\t%.6f", s->generated_ids[i], (double)s->logprobs[i]);
        for (size_t q = 0; with_top && q < k; q++)
            printf("%s%d:%.6f", q ? " " : "\t", s->top_logprob_ids[i * k + q],
                   (double)s->top_logprob_vals[i * k + q]);
        printf("\n");
    }
    rekv__control__response__free_unpacked(r, NULL);
    return 0;
}

/* --no-wait: the job's id (and with --json the queue's depth). */
static void submit_print_id(const Rekv__Control__Response *r, int json)
{
    if (json) {
        json_t *oj = json_object();
        json_object_set_new(oj, "job", json_integer((json_int_t)r->submitted->job));
        json_object_set_new(oj, "queue_depth", json_integer(r->submitted->queue_depth));
        print_json(oj);
    } else {
        printf("%llu\n", (unsigned long long)r->submitted->job);
    }
}

int cli_submit(int argc, char **argv)
{
    submit_opts o;
    int rc = submit_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    int32_t *ids = NULL;
    int n_ids = 0;
    if (o.prompt_ids && cli_parse_ids(o.prompt_ids, &ids, &n_ids)) {
        fprintf(stderr, "rekv: --prompt-ids: expected comma-separated token ids, got \"%s\"\n",
                o.prompt_ids);
        return 2;
    }
    rekv_ctl *c = NULL;
    rc = 1;
    Rekv__Control__Response *r = NULL;
    int sp[2] = {-1, -1}, sfd = -1, signo = 0;
    struct sigaction old_int, old_term;
    /* waiting: Ctrl-C and SIGTERM cancel the job instead of leaving it to run */
    if (!o.no_wait) {
        if (pipe2(sp, O_CLOEXEC | O_NONBLOCK) < 0) {
            fprintf(stderr, "rekv: pipe: %s\n", strerror(errno));
            goto out;
        }
        sfd = sp[0];
        g_sig_pipe = sp[1];
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_submit_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, &old_int);
        sigaction(SIGTERM, &sa, &old_term);
    }
    if (connect_or_say(o.ep, &c))
        goto out;
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    smp.temperature = (float)o.temperature;
    smp.top_k = (uint32_t)o.top_k;
    smp.top_p = (float)o.top_p;
    smp.seed = (uint64_t)o.seed;
    Rekv__Control__Submit sub = REKV__CONTROL__SUBMIT__INIT;
    sub.prompt_text = (char *)(o.prompt ? o.prompt : "");
    sub.n_prompt_ids = (size_t)n_ids;
    sub.prompt_ids = ids;
    sub.sampling = &smp;
    sub.max_new_tokens = (uint32_t)o.max_new;
    sub.priority = (int32_t)o.prio;
    sub.stop_at_eos = !o.ignore_eos;
    sub.stream = !o.no_wait;
    sub.n_stop = (size_t)o.n_stop;
    sub.stop = o.stop;
    sub.logprobs = o.logprobs;
    sub.top_logprobs = (uint32_t)o.top_logprobs;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sub;
    char key[REKV_CLIENT_KEY_MAX + 1];
    rekv_err err = {0};
    if (cli_submit_call(c, &rq, key, CALL_TIMEOUT_MS, SUBMIT_TRIES, &r, &err)) {
        fprintf(stderr, "rekv: %s (is a coordinator running? start one with `rekv run`)\n",
                err.msg);
        goto out;
    }
    if (r->code != REKV__CONTROL__CODE__OK || r->body_case != REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
        rc = fail_response(r);
        goto out;
    }
    uint64_t job = r->submitted->job;
    if (o.no_wait) {
        submit_print_id(r, o.json);
        rc = 0;
        goto out;
    }
    int fr = submit_follow(c, &rq, key, job, r->id, &o, sfd, &signo, &r);
    if (fr == 2) {
        rc = submit_cancel(c, job, signo, o.json);
        goto out;
    }
    if (fr)
        goto out;
    if (o.json) {
        rc = submit_print_json(c, job);
        goto out;
    }
    const Rekv__Control__StreamEvent *ev = r->event;
    printf("\n");
    if (ev->state == REKV__CONTROL__JOB_STATE__FAILED)
        fprintf(stderr, "rekv: job %llu failed: %s\n", (unsigned long long)job, ev->error);
    else if (ev->state != REKV__CONTROL__JOB_STATE__DONE)
        fprintf(stderr, "rekv: job %llu %s\n", (unsigned long long)job,
                rekv_ctl_state_name(ev->state));
    rc = ev->state == REKV__CONTROL__JOB_STATE__DONE ? 0 : 1;
    if (o.logprobs && submit_print_logprobs(c, job))
        rc = 1;
out:
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    free(ids);
    if (sfd >= 0) {
        sigaction(SIGINT, &old_int, NULL);
        sigaction(SIGTERM, &old_term, NULL);
        g_sig_pipe = -1;
        if ((signo = take_signal(sfd)) != 0 && rc == 1)
            rc = 128 + signo; /* interrupted before the job had an id (the Submit failed) */
        close(sp[0]);
        close(sp[1]);
    }
    return rc;
}

/* ---------------------------------------------------------------- status, cancel */

/* `rekv status --kvstore ENDPOINT`: the store answers a Stats request (a health probe). */
static int kvstore_status(const char *ep, int json)
{
    rekv_err err = {0};
    rekv_kvstore_client *kc = NULL;
    rekv_kv_stats st;
    if (rekv_kvstore_client_connect(ep, NULL, CALL_TIMEOUT_MS, &kc, &err) ||
        rekv_kvstore_stats(kc, &st, &err)) {
        fprintf(stderr, "rekv: kvstore at %s: %s\n", ep, err.msg);
        rekv_kvstore_client_close(kc);
        return 1;
    }
    rekv_kvstore_client_close(kc);
    if (json) {
        json_t *oj = json_pack("{s:s, s:I, s:I, s:I, s:I, s:I, s:I}", "kvstore", ep, "clients",
                               (json_int_t)st.clients, "sequences", (json_int_t)st.sequences,
                               "free_slots", (json_int_t)st.free_slots, "total_slots",
                               (json_int_t)st.total_slots, "host_bytes",
                               (json_int_t)st.host_bytes, "host_free_bytes",
                               (json_int_t)st.host_free_bytes);
        print_json(oj);
    } else {
        printf("kvstore serving, %llu clients, %llu sequences, %llu of %llu slots free, "
               "%llu of %llu bytes free\n",
               (unsigned long long)st.clients, (unsigned long long)st.sequences,
               (unsigned long long)st.free_slots, (unsigned long long)st.total_slots,
               (unsigned long long)st.host_free_bytes, (unsigned long long)st.host_bytes);
    }
    return 0;
}

typedef struct job_opts {
    const char *ep, *kv_ep; /* --socket, --kvstore */
    long job;               /* -1: none (status: the coordinator's health) */
    long min_workers;
    int json;
} job_opts;

/* `rekv status [JOB]` and `rekv cancel JOB` (cancel without status's --min-workers and
 * --kvstore). */
static int job_parse(int argc, char **argv, int cancel, job_opts *o)
{
    static const struct option status_opts[] = {{"socket", required_argument, 0, 'S'},
                                                {"json", no_argument, 0, 'j'},
                                                {"min-workers", required_argument, 0, 'w'},
                                                {"kvstore", required_argument, 0, 'K'},
                                                {"help", no_argument, 0, 'h'},
                                                {0, 0, 0, 0}};
    static const struct option cancel_opts[] = {{"socket", required_argument, 0, 'S'},
                                                {"json", no_argument, 0, 'j'},
                                                {"help", no_argument, 0, 'h'},
                                                {0, 0, 0, 0}};
    const char *use =
        cancel ? "usage: rekv cancel [--socket ENDPOINT] [--json] JOB\n"
               : "usage: rekv status [--socket ENDPOINT] [--json] [--min-workers N] [JOB]\n"
                 "       rekv status --kvstore ENDPOINT [--json]\n"
                 "Without JOB: the coordinator's health; exit 1 when it does not answer, or\n"
                 "serves fewer than --min-workers workers. --kvstore: whether the kvstore at\n"
                 "ENDPOINT answers. Both serve as health probes (deploy/docker-compose.yml).\n";
    *o = (job_opts){.job = -1};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", cancel ? cancel_opts : status_opts, NULL)) != -1) {
        switch (c) {
        case 'S': o->ep = optarg; break;
        case 'j': o->json = 1; break;
        case 'w': if (cli_parse_int("min-workers", optarg, 0, 1 << 20, &o->min_workers)) return 2; break;
        case 'K': o->kv_ep = optarg; break;
        case 'h': fputs(use, stdout); return 0;
        default: fputs(use, stderr); return 2;
        }
    }
    const char *job = !o->kv_ep && optind < argc ? argv[optind++] : NULL;
    if (cli_no_operands(argc, argv) || (cancel && job == NULL) ||
        (o->kv_ep && (o->ep || o->min_workers))) {
        fputs(use, stderr);
        return 2;
    }
    if (job && cli_parse_int("job", job, 1, INT64_MAX, &o->job))
        return 2;
    return CLI_PARSED;
}

/* The coordinator's health; exit 1 when it serves fewer than min_workers. */
static int print_health(const Rekv__Control__Health *h, const job_opts *o)
{
    if (o->json) {
        json_t *oj = json_object();
        json_object_set_new(oj, "serving", json_boolean(h->serving));
        json_object_set_new(oj, "workers", json_integer(h->workers));
        json_object_set_new(oj, "protocol_version", json_integer(h->protocol_version));
        json_object_set_new(oj, "uptime_s", json_real(h->uptime_s));
        json_object_set_new(oj, "model", json_string(h->model ? h->model : ""));
        print_json(oj);
    } else {
        printf("serving, %u worker%s, up %.0f s, model %s\n", h->workers,
               h->workers == 1 ? "" : "s", h->uptime_s, h->model && *h->model ? h->model : "?");
    }
    if (h->workers < (uint32_t)o->min_workers) {
        fprintf(stderr, "rekv: %u worker%s, fewer than %ld\n", h->workers,
                h->workers == 1 ? "" : "s", o->min_workers);
        return 1;
    }
    return 0;
}

static void print_job(const Rekv__Control__JobStatus *s, int json)
{
    if (json) {
        print_json(status_json(s));
        return;
    }
    printf("job %llu: %s%s%s%s, %zu tokens, %u attempt%s%s%s\n", (unsigned long long)s->job,
           rekv_ctl_state_name(s->state), *s->finish_reason ? " (" : "", s->finish_reason,
           *s->finish_reason ? ")" : "", s->n_generated_ids, s->attempts,
           s->attempts == 1 ? "" : "s", *s->error ? ": " : "", s->error);
    if (s->waiting && *s->waiting)
        printf("%s\n", s->waiting);
    if (s->text && *s->text)
        printf("%s\n", s->text);
}

static int job_command(int argc, char **argv, int cancel)
{
    job_opts o;
    int rc = job_parse(argc, argv, cancel, &o);
    if (rc != CLI_PARSED)
        return rc;
    if (o.kv_ep)
        return kvstore_status(o.kv_ep, o.json);
    rekv_ctl *c = NULL;
    Rekv__Control__Response *r = NULL;
    rc = 1;
    if (connect_or_say(o.ep, &c))
        return 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__StatusRequest sr = REKV__CONTROL__STATUS_REQUEST__INIT;
    Rekv__Control__Cancel cr = REKV__CONTROL__CANCEL__INIT;
    Rekv__Control__HealthRequest hr = REKV__CONTROL__HEALTH_REQUEST__INIT;
    if (o.job < 0) {
        rq.body_case = REKV__CONTROL__REQUEST__BODY_HEALTH;
        rq.health = &hr;
    } else if (cancel) {
        cr.job = (uint64_t)o.job;
        rq.body_case = REKV__CONTROL__REQUEST__BODY_CANCEL;
        rq.cancel = &cr;
    } else {
        sr.job = (uint64_t)o.job;
        sr.with_text = 1;
        rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
        rq.status = &sr;
    }
    if (call_or_say(c, &rq, &r))
        goto out;
    if (r->code != REKV__CONTROL__CODE__OK) {
        rc = fail_response(r);
        goto out;
    }
    rc = 0;
    if (r->body_case == REKV__CONTROL__RESPONSE__BODY_HEALTH)
        rc = print_health(r->health, &o);
    else if (r->body_case == REKV__CONTROL__RESPONSE__BODY_JOB)
        print_job(r->job, o.json);
out:
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    return rc;
}

int cli_status(int argc, char **argv) { return job_command(argc, argv, 0); }
int cli_cancel(int argc, char **argv) { return job_command(argc, argv, 1); }

/* ---------------------------------------------------------------- stats */

/* The coordinator's counters, connections and workers as `rekv stats` prints them. */
static json_t *stats_json(const Rekv__Control__Stats *s)
{
    json_t *oj = json_pack(
        "{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:I, s:f, s:f, s:i, s:f}",
        "queued", (json_int_t)s->queued, "running", (json_int_t)s->running, "done",
        (json_int_t)s->done, "cancelled", (json_int_t)s->cancelled, "failed",
        (json_int_t)s->failed, "accepted", (json_int_t)s->accepted, "rejected_busy",
        (json_int_t)s->rejected_busy, "bad_requests", (json_int_t)s->bad_requests, "requeued",
        (json_int_t)s->requeued, "tokens", (json_int_t)s->tokens, "tokens_per_s", s->tokens_per_s,
        "steps", (json_int_t)s->steps, "step_rtt_avg_s", s->step_rtt_avg_s, "worker_step_avg_s",
        s->worker_step_avg_s, "queue_limit", (int)s->queue_limit, "uptime_s", s->uptime_s);
    json_object_set_new(oj, "bytes",
                        json_pack("{s:I, s:I, s:I, s:I}", "h2d_weights",
                                  (json_int_t)s->h2d_bytes_weights, "h2d_kv",
                                  (json_int_t)s->h2d_bytes_kv, "h2d_act",
                                  (json_int_t)s->h2d_bytes_act, "d2h", (json_int_t)s->d2h_bytes));
    json_object_set_new(oj, "tokens_recomputed", json_integer((json_int_t)s->tokens_recomputed));
    json_object_set_new(oj, "tokens_fetched", json_integer((json_int_t)s->tokens_fetched));
    json_object_set_new(oj, "tokens_considered", json_integer((json_int_t)s->tokens_considered));
    json_object_set_new(oj, "tokens_selected", json_integer((json_int_t)s->tokens_selected));
    json_object_set_new(oj, "steps_failed", json_integer((json_int_t)s->steps_failed));
    json_object_set_new(oj, "finished_forgotten", json_integer((json_int_t)s->finished_forgotten));
    json_object_set_new(oj, "worker_messages_malformed",
                        json_integer((json_int_t)s->worker_messages_malformed));
    json_object_set_new(oj, "worker_results_rejected",
                        json_integer((json_int_t)s->worker_results_rejected));
    json_object_set_new(oj, "jobs_held_for_room", json_integer((json_int_t)s->jobs_held_for_room));
    json_object_set_new(oj, "jobs_too_large", json_integer((json_int_t)s->jobs_too_large));
    json_object_set_new(oj, "jobs_prefix_priced", json_integer((json_int_t)s->jobs_prefix_priced));
    json_t *conns = json_object();
    const Rekv__Control__ConnStats *cs[2] = {s->control_connections, s->worker_connections};
    for (int i = 0; i < 2; i++)
        if (cs[i])
            json_object_set_new(conns, i ? "workers" : "control",
                                json_pack("{s:i, s:i, s:I, s:I, s:I}", "open", (int)cs[i]->open,
                                          "max", (int)cs[i]->max, "accepted",
                                          (json_int_t)cs[i]->accepted, "busy",
                                          (json_int_t)cs[i]->busy, "shed",
                                          (json_int_t)cs[i]->shed));
    json_object_set_new(oj, "connections", conns);
    const Rekv__Control__PrefixCacheStats *pc = s->prefix_cache;
    if (pc) /* the kvstores' prefix caches (each store once) */
        json_object_set_new(
            oj, "prefix_cache",
            json_pack("{s:i, s:I, s:I, s:{s:I, s:I}, s:I, s:I}", "stores", (int)pc->stores,
                      "lookups", (json_int_t)pc->lookups, "hit_tokens", (json_int_t)pc->hit_tokens,
                      "hit_blocks", "host", (json_int_t)pc->hit_host_blocks, "disk",
                      (json_int_t)pc->hit_disk_blocks, "evictions", (json_int_t)pc->evictions,
                      "hit_read_bytes", (json_int_t)pc->hit_read_bytes));
    json_t *ws = json_array();
    for (size_t i = 0; i < s->n_workers; i++) {
        const Rekv__Control__WorkerInfo *w = s->workers[i];
        json_t *wj = json_pack("{s:s, s:s, s:s, s:i, s:i, s:I, s:I, s:f}", "name", w->name,
                               "backend", w->backend, "mode", w->mode, "running", (int)w->running,
                               "max_batch", (int)w->max_batch, "steps", (json_int_t)w->steps,
                               "tokens", (json_int_t)w->tokens, "idle_s", w->idle_s);
        json_object_set_new(
            wj, "plan",
            json_pack("{s:i, s:[i, i], s:i, s:s, s:f, s:f, s:f, s:f}", "split", (int)w->plan_split,
                      "kv_act", (int)w->plan_kv_parts, (int)w->plan_act_parts, "gpu_batches",
                      (int)w->plan_gpu_batches, "schedule", w->plan_column ? "column" : "row",
                      "predicted_step_s", w->plan_predicted_step_s, "pcie_scale",
                      w->plan_pcie_scale, "compute_scale", w->plan_compute_scale,
                      "selected_fraction", w->plan_selected_fraction));
        json_object_set_new(wj, "device_tokens", json_integer((json_int_t)w->device_tokens));
        json_object_set_new(wj, "store_spill_room_bytes",
                            json_integer((json_int_t)w->store_spill_room_bytes));
        if (w->unavailable && *w->unavailable) /* why it takes no steps now */
            json_object_set_new(wj, "unavailable", json_string(w->unavailable));
        json_array_append_new(ws, wj);
    }
    json_object_set_new(oj, "workers", ws);
    return oj;
}

int cli_stats(int argc, char **argv)
{
    static const struct option opts[] = {{"socket", required_argument, 0, 'S'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *ep = NULL;
    int o;
    optind = 1;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'S': ep = optarg; break;
        case 'h': printf("usage: rekv stats [--socket ENDPOINT]   (prints one JSON object)\n"); return 0;
        default: fprintf(stderr, "usage: rekv stats [--socket ENDPOINT]\n"); return 2;
        }
    }
    if (cli_no_operands(argc, argv)) {
        fprintf(stderr, "usage: rekv stats [--socket ENDPOINT]\n");
        return 2;
    }
    rekv_ctl *c = NULL;
    Rekv__Control__Response *r = NULL;
    int rc = 1;
    if (connect_or_say(ep, &c))
        return 1;
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    if (call_or_say(c, &rq, &r))
        goto out;
    if (r->code != REKV__CONTROL__CODE__OK || r->body_case != REKV__CONTROL__RESPONSE__BODY_STATS) {
        rc = fail_response(r);
        goto out;
    }
    print_json(stats_json(r->stats));
    rc = 0;
out:
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    return rc;
}
