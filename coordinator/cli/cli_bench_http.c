/* cli_bench_http.c — `rekv bench http`: issue 36's goal measured. One private trio (`rekv run
 * --http`, prefix cache off so that no run starts from another's KV) serves the same N jobs two
 * ways side by side: N streaming clients of the OpenAI API (POST /v1/completions, stream: true,
 * real HTTP/1.1 over TCP sockets, one connection each, written here on plain sockets and poll,
 * chunked transfer decoding and server-sent events), and the same N jobs over the control socket
 * (the protobuf client the CLI uses, one socket, every job streamed). Greedy, EOS ignored: every
 * run's jobs must match the first control run's (mismatches, exit 1 otherwise) in their generated
 * ids — an HTTP job's read back over the control socket by its id (the answer's "cmpl-JOB") — and
 * in their text as the client got it (over HTTP, the reference's bytes as the server serves them:
 * invalid UTF-8 as U+FFFD). Times are
 * taken here as the bytes arrive: TTFT from the request (the HTTP client's connect, the control
 * client's Submit) to the first event carrying text (HTTP: the first SSE chunk with text; control:
 * the first StreamEvent with text); the gaps between events with text. Each job's TTFT is also split
 * into the coordinator's own (JobStatus.first_token_s: acceptance to the first token reaching it,
 * which the scheduling of N prompts at once makes vary run to run) and what the way to and from
 * the client added to it (the rest), so that the ways compare on what differs between them.
 * CPU per token: the coordinator's and
 * the worker's CPU time (/proc/PID/stat, all threads) over each way's run divided by its tokens —
 * the HTTP server runs inside the coordinator, so over the HTTP run the coordinator's CPU is the
 * server's own. Prints one JSON object. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/daemon.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_bench.h"
#include "coordinator/coordinator.h"
#include "loader/loader.h"

#define SILENCE_MS 300000 /* nothing from any client's server this long: the run is stuck */

typedef struct http_opts {
    const char *model, *backend, *arena, *mode;
    long clients, prompt_len, max_new, rounds;
} http_opts;

/* One job's run one way. */
typedef struct hrec {
    uint64_t t_start, t_last; /* ns: request sent (connect); the last event with text */
    double ttft_s;            /* -1 until the first text */
    uint64_t tokens;          /* control: tokens streamed; HTTP: usage.completion_tokens */
    char *text;               /* the generated text, as the events brought it */
    size_t text_len;
    int32_t *ids;             /* the generated ids: control, the events'; HTTP, its job's Status */
    size_t n_ids;
    uint64_t job;             /* the coordinator's job: HTTP from the answer's id "cmpl-JOB",
                               * control from its events */
    double co_ttft_s;         /* the job's first_token_s, as the coordinator saw it (-1: none) */
    int done, failed;
} hrec;

/* One way's totals over its rounds. */
typedef struct hway {
    double *ttft, *gaps; /* samples */
    size_t n_ttft, n_gaps, cap_gaps;
    /* per job with both: the coordinator's TTFT, and what the way added to it (the client's
     * TTFT less the coordinator's: the request's way in, the first token's way out) */
    double *co_ttft, *added;
    size_t n_added;
    double wall_s, co_cpu_s, wk_cpu_s;
    uint64_t tokens, done, failed, bytes;
    char first_error[256];
    /* job runs that differ from the reference: in anything, in their ids, in their texts */
    uint64_t mismatches, id_mismatches, text_mismatches;
    char first_mismatch[512];
} hway;

static int text_append(hrec *r, const char *p, size_t n)
{
    char *t = realloc(r->text, r->text_len + n + 1);
    if (t == NULL)
        return -ENOMEM;
    memcpy(t + r->text_len, p, n);
    r->text_len += n;
    t[r->text_len] = '\0';
    r->text = t;
    return 0;
}

/* A piece of text of job r arriving at t: the TTFT at the first, a gap sample at each later. */
static void on_text(hway *w, hrec *r, const char *p, size_t n, uint64_t t)
{
    if (n == 0)
        return;
    if (r->ttft_s < 0) {
        r->ttft_s = (double)(t - r->t_start) * 1e-9;
        w->ttft[w->n_ttft++] = r->ttft_s;
    } else if (w->n_gaps < w->cap_gaps) {
        w->gaps[w->n_gaps++] = (double)(t - r->t_last) * 1e-9;
    }
    r->t_last = t;
    if (text_append(r, p, n) && !w->first_error[0])
        snprintf(w->first_error, sizeof(w->first_error), "out of memory");
}

static void set_error(hway *w, hrec *r, const char *fmt, const char *what)
{
    if (r)
        r->failed = 1;
    if (!w->first_error[0])
        snprintf(w->first_error, sizeof(w->first_error), fmt, what);
}

/* ---------------------------------------------------------------- the control socket */

static int ctl_submit(rekv_ctl *c, const int32_t *ids, const http_opts *o, long i, uint64_t *rid,
                      rekv_err *err)
{
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT; /* temperature 0: greedy */
    smp.seed = (uint64_t)i;
    Rekv__Control__Submit sb = REKV__CONTROL__SUBMIT__INIT;
    sb.sampling = &smp;
    sb.prompt_ids = (int32_t *)ids;
    sb.n_prompt_ids = (size_t)o->prompt_len;
    sb.max_new_tokens = (uint32_t)o->max_new;
    sb.stop_at_eos = 0; /* as the HTTP requests' ignore_eos */
    sb.stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &sb;
    return rekv_ctl_send(c, &rq, rid, err);
}

/* One reply or stream event for the job whose Submit had request id r->id. */
static void ctl_on_reply(hway *w, hrec *recs, const uint64_t *rids, long n,
                         const Rekv__Control__Response *r, uint64_t t, long *ended)
{
    long i = 0;
    while (i < n && rids[i] != r->id)
        i++;
    if (i == n || recs[i].done)
        return;
    hrec *j = &recs[i];
    if (r->code != REKV__CONTROL__CODE__OK) {
        set_error(w, j, "control: %s", r->error ? r->error : rekv_ctl_code_name(r->code));
        j->done = 1;
        (*ended)++;
        return;
    }
    if (r->body_case != REKV__CONTROL__RESPONSE__BODY_EVENT)
        return; /* the SubmitReply */
    const Rekv__Control__StreamEvent *ev = r->event;
    j->job = ev->job;
    uint64_t end = (uint64_t)ev->offset + ev->n_tokens;
    if (end > j->tokens) {
        if (ev->has_text)
            on_text(w, j, (const char *)ev->text.data, ev->text.len, t);
        int32_t *ids = realloc(j->ids, sizeof(int32_t) * (size_t)end);
        if (ids == NULL || ev->offset > j->tokens) {
            set_error(w, j, "control: %s", ids ? "a gap in the stream" : "out of memory");
            if (ids)
                j->ids = ids;
        } else {
            j->ids = ids;
            memcpy(ids + ev->offset, ev->tokens, sizeof(int32_t) * ev->n_tokens);
            j->n_ids = (size_t)end;
        }
        j->tokens = end;
    }
    if (ev->done) {
        j->done = 1;
        (*ended)++;
        if (ev->state != REKV__CONTROL__JOB_STATE__DONE)
            set_error(w, j, "control: %s", ev->error && *ev->error ? ev->error
                                                                  : rekv_ctl_state_name(ev->state));
    }
}

/* Runs the n jobs over the control socket ep, all at once; 0, or -1 with a message printed. */
static int ctl_run(const http_opts *o, long n, const char *ep, int32_t *const *prompts, hrec *recs,
                   hway *w)
{
    rekv_err err = {0};
    rekv_ctl *c = NULL;
    uint64_t *rids = calloc((size_t)n, sizeof(*rids));
    int rc = -1;
    if (rids == NULL || rekv_ctl_connect(ep, NULL, &c, &err)) {
        fprintf(stderr, "rekv bench http: %s\n", rids ? err.msg : "out of memory");
        goto out;
    }
    uint64_t t0 = rekv_now_ns();
    for (long i = 0; i < n; i++) {
        recs[i].t_start = rekv_now_ns();
        if (ctl_submit(c, prompts[i], o, i, &rids[i], &err)) {
            fprintf(stderr, "rekv bench http: %s\n", err.msg);
            goto out;
        }
    }
    long ended = 0;
    while (ended < n) {
        Rekv__Control__Response *r = NULL;
        uint64_t t;
        if (cli_bench_recv(c, "http", &r, &t))
            goto out;
        ctl_on_reply(w, recs, rids, n, r, t, &ended);
        rekv__control__response__free_unpacked(r, NULL);
    }
    w->wall_s += (double)(rekv_now_ns() - t0) * 1e-9;
    rc = 0;
out:
    rekv_ctl_close(c);
    free(rids);
    return rc;
}

/* ---------------------------------------------------------------- the HTTP clients */

typedef struct hconn {
    int fd;
    char *req;
    size_t req_len, req_off;
    char *in;                /* bytes received and not yet decoded */
    size_t in_len, in_cap;
    char *body;              /* decoded body not yet split into events */
    size_t body_len, body_cap;
    int hdr_done, chunked, status, ended; /* ended: [DONE] (or the body's end) seen */
} hconn;

static int buf_put(char **p, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 4096;
        while (*len + n + 1 > c)
            c *= 2;
        char *q = realloc(*p, c);
        if (q == NULL)
            return -ENOMEM;
        *p = q, *cap = c;
    }
    memcpy(*p + *len, s, n);
    *len += n;
    (*p)[*len] = '\0';
    return 0;
}

static void buf_drop(char *p, size_t *len, size_t n)
{
    memmove(p, p + n, *len - n);
    *len -= n;
    p[*len] = '\0';
}

/* The request of job i: the prompt as token ids, greedy, EOS ignored, streamed with usage. */
static char *http_request(const http_opts *o, const int32_t *ids, long i, int port, size_t *len)
{
    json_t *p = json_array();
    for (long k = 0; k < o->prompt_len; k++)
        json_array_append_new(p, json_integer(ids[k]));
    json_t *b = json_pack("{s:o, s:I, s:i, s:I, s:b, s:{s:b}, s:b}", "prompt", p, "max_tokens",
                          (json_int_t)o->max_new, "temperature", 0, "seed", (json_int_t)i,
                          "stream", 1, "stream_options", "include_usage", 1, "ignore_eos", 1);
    char *body = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    char *req = NULL;
    if (body && asprintf(&req,
                         "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                         "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                         "Content-Length: %zu\r\n\r\n%s",
                         port, strlen(body), body) < 0)
        req = NULL;
    free(body);
    *len = req ? strlen(req) : 0;
    return req;
}

/* One SSE event's data of job r. */
static void http_on_data(hway *w, hconn *h, hrec *r, const char *data, uint64_t t)
{
    if (strcmp(data, "[DONE]") == 0) {
        h->ended = 1;
        return;
    }
    json_t *j = json_loads(data, 0, NULL);
    if (j == NULL) {
        set_error(w, r, "http: an event that is not JSON: %.200s", data);
        return;
    }
    const char *id = json_string_value(json_object_get(j, "id"));
    unsigned long long job;
    if (r->job == 0 && id && sscanf(id, "cmpl-%llu", &job) == 1)
        r->job = job;
    json_t *e = json_object_get(j, "error");
    if (e)
        set_error(w, r, "http: %s", json_string_value(json_object_get(e, "message")));
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *txt = json_object_get(c, "text");
    if (json_is_string(txt))
        on_text(w, r, json_string_value(txt), json_string_length(txt), t);
    json_t *u = json_object_get(json_object_get(j, "usage"), "completion_tokens");
    if (json_is_integer(u))
        r->tokens = (uint64_t)json_integer_value(u);
    json_decref(j);
}

/* Decodes what h has received: the status and headers, the chunks, the events. */
static void http_decode(hway *w, hconn *h, hrec *r, uint64_t t)
{
    if (!h->hdr_done) {
        char *e = strstr(h->in, "\r\n\r\n");
        if (e == NULL)
            return;
        *e = '\0';
        if (sscanf(h->in, "HTTP/1.%*d %d", &h->status) != 1 || h->status != 200)
            set_error(w, r, "http: the answer began %.100s", h->in);
        for (char *l = strstr(h->in, "\r\n"); l; l = strstr(l + 2, "\r\n"))
            if (strncasecmp(l + 2, "transfer-encoding:", 18) == 0 && strstr(l + 20, "chunked"))
                h->chunked = 1;
        h->hdr_done = 1;
        buf_drop(h->in, &h->in_len, (size_t)(e + 4 - h->in));
    }
    if (!h->chunked) {
        buf_put(&h->body, &h->body_len, &h->body_cap, h->in, h->in_len);
        h->in_len = 0;
    }
    while (h->chunked && h->in_len) { /* whole chunks only: size line, data, CRLF */
        char *le = strstr(h->in, "\r\n");
        if (le == NULL)
            break;
        unsigned long sz = strtoul(h->in, NULL, 16);
        size_t head = (size_t)(le + 2 - h->in);
        if (h->in_len < head + sz + 2)
            break;
        if (sz == 0) {
            h->ended = 1;
            h->in_len = 0;
            break;
        }
        buf_put(&h->body, &h->body_len, &h->body_cap, h->in + head, sz);
        buf_drop(h->in, &h->in_len, head + sz + 2);
    }
    char *ev;
    while (h->body_len && (ev = strstr(h->body, "\n\n")) != NULL) {
        *ev = '\0';
        for (char *line = h->body; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl)
                *nl = '\0';
            if (strncmp(line, "data: ", 6) == 0)
                http_on_data(w, h, r, line + 6, t);
            line = nl ? nl + 1 : NULL;
        }
        buf_drop(h->body, &h->body_len, (size_t)(ev + 2 - h->body));
    }
}

static int http_connect(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0 && errno != EINPROGRESS) {
        int e = -errno;
        close(fd);
        return e;
    }
    return fd;
}

/* One poll result of connection i: writes what is left of its request, reads what came. */
static void http_service(hway *w, hconn *h, hrec *r, short rev, uint64_t t, long *ended)
{
    if (rev & POLLOUT && h->req_off < h->req_len) {
        ssize_t k = send(h->fd, h->req + h->req_off, h->req_len - h->req_off, MSG_NOSIGNAL);
        if (k > 0)
            h->req_off += (size_t)k;
        else if (k < 0 && errno != EAGAIN && errno != EINTR)
            set_error(w, r, "http: send: %s", strerror(errno));
    }
    if (rev & (POLLIN | POLLHUP | POLLERR) && !r->failed) {
        char buf[65536];
        ssize_t k = recv(h->fd, buf, sizeof(buf), 0);
        if (k > 0) {
            w->bytes += (uint64_t)k;
            buf_put(&h->in, &h->in_len, &h->in_cap, buf, (size_t)k);
            http_decode(w, h, r, t);
        } else if (k == 0 || (errno != EAGAIN && errno != EINTR)) {
            if (!h->ended)
                set_error(w, r, "http: %s", k == 0 ? "the server closed before [DONE]"
                                                   : strerror(errno));
            h->ended = 1;
        }
    }
    if ((h->ended || r->failed) && !r->done) {
        r->done = 1;
        (*ended)++;
        close(h->fd);
        h->fd = -1;
    }
}

/* Runs the n jobs as n concurrent streaming HTTP clients of 127.0.0.1:port; 0, or -1 with a
 * message printed. */
static int http_run(const http_opts *o, long n, int port, int32_t *const *prompts, hrec *recs,
                    hway *w)
{
    hconn *cs = calloc((size_t)n, sizeof(*cs));
    struct pollfd *pf = calloc((size_t)n, sizeof(*pf));
    int rc = -1;
    long ended = 0;
    if (!cs || !pf)
        goto oom;
    for (long i = 0; i < n; i++) {
        cs[i].fd = -1;
        if ((cs[i].req = http_request(o, prompts[i], i, port, &cs[i].req_len)) == NULL)
            goto oom;
    }
    uint64_t t0 = rekv_now_ns(), last = t0;
    for (long i = 0; i < n; i++) {
        recs[i].t_start = rekv_now_ns();
        if ((cs[i].fd = http_connect(port)) < 0) {
            fprintf(stderr, "rekv bench http: connect 127.0.0.1:%d: %s\n", port,
                    strerror(-cs[i].fd));
            goto out;
        }
    }
    while (ended < n) {
        for (long i = 0; i < n; i++)
            pf[i] = (struct pollfd){cs[i].fd,
                                    (short)(POLLIN | (cs[i].req_off < cs[i].req_len ? POLLOUT : 0)),
                                    0};
        int k = poll(pf, (nfds_t)n, 100);
        uint64_t t = rekv_now_ns();
        if (k < 0 && errno != EINTR) {
            fprintf(stderr, "rekv bench http: poll: %s\n", strerror(errno));
            goto out;
        }
        if (k <= 0) {
            if (t - last > (uint64_t)SILENCE_MS * 1000000ull) {
                fprintf(stderr, "rekv bench http: nothing from the server in %d s\n",
                        SILENCE_MS / 1000);
                goto out;
            }
            continue;
        }
        last = t;
        for (long i = 0; i < n; i++)
            if (pf[i].revents)
                http_service(w, &cs[i], &recs[i], pf[i].revents, t, &ended);
    }
    w->wall_s += (double)(rekv_now_ns() - t0) * 1e-9;
    rc = 0;
    goto out;
oom:
    fprintf(stderr, "rekv bench http: out of memory\n");
out:
    for (long i = 0; cs && i < n; i++) {
        if (cs[i].fd >= 0)
            close(cs[i].fd);
        free(cs[i].req), free(cs[i].in), free(cs[i].body);
    }
    free(cs);
    free(pf);
    return rc;
}

/* ---------------------------------------------------------------- the report */

static json_t *way_json(hway *w)
{
    double tok = w->tokens ? (double)w->tokens : 1;
    json_t *o = json_pack(
        "{s:I, s:I, s:I, s:f, s:f, s:{s:f, s:f, s:f}, s:{s:f, s:f, s:f}, s:f, s:f, s:f, s:f}",
        "jobs_done", (json_int_t)(w->done - w->failed), "jobs_failed", (json_int_t)w->failed,
        "tokens", (json_int_t)w->tokens, "wall_s", w->wall_s, "tokens_per_s",
        w->wall_s > 0 ? (double)w->tokens / w->wall_s : 0.0, "ttft_s", "p50",
        cli_percentile(w->ttft, w->n_ttft, 50), "p90", cli_percentile(w->ttft, w->n_ttft, 90), "p99",
        cli_percentile(w->ttft, w->n_ttft, 99), "itl_s", "p50", cli_percentile(w->gaps, w->n_gaps, 50), "p90",
        cli_percentile(w->gaps, w->n_gaps, 90), "p99", cli_percentile(w->gaps, w->n_gaps, 99), "coordinator_cpu_s",
        w->co_cpu_s, "worker_cpu_s", w->wk_cpu_s, "coordinator_cpu_per_token_s",
        w->co_cpu_s / tok, "worker_cpu_per_token_s", w->wk_cpu_s / tok);
    if (w->n_added)
        json_object_set_new(
            o, "ttft_split_s",
            json_pack("{s:I, s:{s:f, s:f}, s:{s:f, s:f}}", "jobs", (json_int_t)w->n_added,
                      "coordinator", "p50", cli_percentile(w->co_ttft, w->n_added, 50), "p90",
                      cli_percentile(w->co_ttft, w->n_added, 90), "added", "p50",
                      cli_percentile(w->added, w->n_added, 50), "p90",
                      cli_percentile(w->added, w->n_added, 90)));
    if (w->bytes)
        json_object_set_new(o, "bytes", json_integer((json_int_t)w->bytes));
    if (w->first_error[0])
        json_object_set_new(o, "first_error", json_string(w->first_error));
    json_object_set_new(o, "mismatches",
                        json_pack("{s:I, s:I, s:I}", "jobs", (json_int_t)w->mismatches, "ids",
                                  (json_int_t)w->id_mismatches, "texts",
                                  (json_int_t)w->text_mismatches));
    if (w->first_mismatch[0])
        json_object_set_new(o, "first_mismatch", json_string(w->first_mismatch));
    return o;
}

/* ---------------------------------------------------------------- the command */

static void http_usage(FILE *f)
{
    fprintf(f,
            "usage: rekv bench http --model PATH [--clients N] [--prompt-len S]\n"
            "                       [--max-new-tokens G] [--rounds R] [--mode MODE]\n"
            "                       [--arena SIZE] [--backend cpu|cuda|auto] [--json]\n"
            "Starts one private kvstore (--host-bytes SIZE, default 64M), worker and\n"
            "coordinator with --http on a free loopback port (`rekv run`, prefix cache off;\n"
            "--mode: the worker's, default rekv run's auto; the report names the one it ran),\n"
            "and runs the same N jobs (default 64) of S random prompt tokens (default 64) and\n"
            "G new tokens (default 32; greedy, EOS ignored) two ways: N concurrent streaming\n"
            "clients of POST /v1/completions, and all N over the control socket. R rounds\n"
            "(default 1), the ways alternating first. Prints one JSON object: each way's\n"
            "tokens/s, TTFT and inter-event latency p50/p90/p99 (taken here), the\n"
            "coordinator's and the worker's CPU time per token (/proc), the jobs whose ids or\n"
            "texts differ from the first control run's (mismatches), the TTFT ratios and the\n"
            "HTTP run's coordinator CPU over the worker's. The model needs a tokenizer. Exit 1\n"
            "on a mismatch or a failed job.\n");
}

static int http_parse(int argc, char **argv, http_opts *o)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"clients", required_argument, 0, 'n'},
                                         {"prompt-len", required_argument, 0, 'p'},
                                         {"max-new-tokens", required_argument, 0, 'g'},
                                         {"rounds", required_argument, 0, 'r'},
                                         {"mode", required_argument, 0, 'M'},
                                         {"arena", required_argument, 0, 'a'},
                                         {"backend", required_argument, 0, 'b'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    *o = (http_opts){.backend = "cpu", .arena = "64M", .clients = 64, .prompt_len = 64,
                     .max_new = 32, .rounds = 1};
    uint64_t bytes;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o->model = optarg; break;
        case 'n': if (cli_parse_int("clients", optarg, 1, 1000, &o->clients)) return 2; break;
        case 'p': if (cli_parse_int("prompt-len", optarg, 1, 1 << 20, &o->prompt_len)) return 2; break;
        case 'g': if (cli_parse_int("max-new-tokens", optarg, 1, 1 << 20, &o->max_new)) return 2; break;
        case 'r': if (cli_parse_int("rounds", optarg, 1, 100, &o->rounds)) return 2; break;
        case 'M': o->mode = optarg; break;
        case 'a': o->arena = optarg; break;
        case 'b': o->backend = optarg; break;
        case 'j': break; /* JSON is the only output */
        case 'h': http_usage(stdout); return 0;
        default: http_usage(stderr); return 2;
        }
    }
    if (cli_no_operands(argc, argv) || o->model == NULL) {
        http_usage(stderr);
        return 2;
    }
    if (rekv_parse_size(o->arena, &bytes) || bytes == 0) {
        fprintf(stderr, "rekv bench http: --arena %s: expected bytes, e.g. 1G\n", o->arena);
        return 2;
    }
    return CLI_PARSED;
}

/* A loopback port nobody listens on now (bound and released: the trio binds it next). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof(a);
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &l) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static int http_trio(cli_trio *t, const http_opts *o, int port)
{
    char listen[32], batch[32], queue[32];
    snprintf(listen, sizeof(listen), "127.0.0.1:%d", port);
    snprintf(batch, sizeof(batch), "%ld", o->clients + 1);
    snprintf(queue, sizeof(queue), "%ld", 2 * o->clients + 1);
    const char *args[24] = {"--model", o->model, "--backend", o->backend, "--host-bytes",
                            o->arena, "--max-batch", batch, "--queue", queue, "--http", listen,
                            "--prefix-cache", "off"};
    int n = 14;
    if (o->mode) {
        args[n++] = "--mode";
        args[n++] = o->mode;
    }
    args[n] = NULL;
    return cli_trio_start(t, "http", args);
}

static void recs_reset(hrec *recs, long n)
{
    for (long i = 0; i < n; i++) {
        free(recs[i].text);
        free(recs[i].ids);
        recs[i] = (hrec){.ttft_s = -1, .co_ttft_s = -1};
    }
}

/* Each job's Status over the control socket: its first_token_s, and an HTTP job's generated ids
 * (http: 1); 0 or -1. */
static int job_status(int http, const char *ep, hrec *recs, long n, hway *w)
{
    rekv_err err = {0};
    rekv_ctl *c = NULL;
    if (rekv_ctl_connect(ep, NULL, &c, &err)) {
        fprintf(stderr, "rekv bench http: %s\n", err.msg);
        return -1;
    }
    for (long i = 0; i < n; i++) {
        Rekv__Control__StatusRequest sr = REKV__CONTROL__STATUS_REQUEST__INIT;
        sr.job = recs[i].job;
        Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
        rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
        rq.status = &sr;
        Rekv__Control__Response *r = NULL;
        if (recs[i].job == 0 || rekv_ctl_call(c, &rq, 10000, &r, &err) ||
            r->body_case != REKV__CONTROL__RESPONSE__BODY_JOB) {
            set_error(w, &recs[i], "%s: no status for its job",
                      http ? "http" : "control");
        } else {
            if (r->job->first_token_s > 0)
                recs[i].co_ttft_s = r->job->first_token_s;
            if (http && (recs[i].ids = malloc(sizeof(int32_t) * (r->job->n_generated_ids + 1)))) {
                memcpy(recs[i].ids, r->job->generated_ids,
                       sizeof(int32_t) * r->job->n_generated_ids);
                recs[i].n_ids = r->job->n_generated_ids;
            }
        }
        if (r)
            rekv__control__response__free_unpacked(r, NULL);
    }
    rekv_ctl_close(c);
    return 0;
}

/* The text an HTTP client of the server gets for these bytes: each byte that does not start a
 * valid UTF-8 character becomes U+FFFD (coordinator/http_gen.c, jstr: a byte-level model may make
 * any bytes). *out: malloc'd. */
static int utf8_as_served(const char *s, size_t n, char **out, size_t *out_len)
{
    char *b = malloc(3 * n + 1);
    size_t m = 0;
    if (b == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : c >= 0xF0 && c < 0xF8 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
        json_t *t = len && i + len <= n ? json_stringn(s + i, len) : NULL;
        if (t) {
            memcpy(b + m, s + i, len);
            m += len, i += len;
            json_decref(t);
        } else {
            memcpy(b + m, "\xEF\xBF\xBD", 3);
            m += 3, i++;
        }
    }
    *out = b, *out_len = m;
    return 0;
}

/* Job i of this run (q) against the reference (r, the first control run's): the same ids, and the
 * same text as its client gets it (http: the reference's text as served). Notes the first
 * difference. */
static void compare(hway *w, int http, long i, const hrec *r, const hrec *q)
{
    char *rt = r->text;
    size_t rn = r->text_len, at = 0;
    if (http && utf8_as_served(r->text ? r->text : "", r->text_len, &rt, &rn)) {
        set_error(w, NULL, "%s", "out of memory");
        return;
    }
    int ids = r->n_ids != q->n_ids || (r->n_ids && memcmp(r->ids, q->ids, sizeof(int32_t) * r->n_ids));
    while (at < rn && at < q->text_len && rt[at] == q->text[at])
        at++;
    int text = r->tokens != q->tokens || rn != q->text_len || at != rn;
    w->mismatches += ids || text;
    w->id_mismatches += ids;
    w->text_mismatches += text;
    if ((ids || text) && !w->first_mismatch[0]) {
        char a[40] = "", b[40] = ""; /* the differing bytes, in hex: they may not be UTF-8 */
        for (size_t k = at; k < at + 8 && k < rn; k++)
            snprintf(a + 2 * (k - at), 3, "%02x", (unsigned char)rt[k]);
        for (size_t k = at; k < at + 8 && k < q->text_len; k++)
            snprintf(b + 2 * (k - at), 3, "%02x", (unsigned char)q->text[k]);
        snprintf(w->first_mismatch, sizeof(w->first_mismatch),
                 "job %ld: ids %s; the reference %llu tokens, %zu bytes, this run %llu tokens, %zu "
                 "bytes; from byte %zu the reference has %s, this run %s",
                 i, ids ? "differ" : "equal", (unsigned long long)r->tokens, rn,
                 (unsigned long long)q->tokens, q->text_len, at, a, b);
    }
    if (http)
        free(rt);
}

/* One way's run of the jobs (http: 1) with the daemons' CPU time around it, then each job against
 * ref (the first control run's; NULL: none). 0, or -1 when it could not run. */
static int run_way(int http, const http_opts *o, const char *ep, int port, pid_t co, pid_t wk,
                   int32_t *const *prompts, hrec *recs, const hrec *ref, hway *w)
{
    long n = o->clients;
    recs_reset(recs, n);
    double c0 = cli_proc_cpu_s(co), k0 = cli_proc_cpu_s(wk);
    int rc = http ? http_run(o, n, port, prompts, recs, w) : ctl_run(o, n, ep, prompts, recs, w);
    w->co_cpu_s += cli_proc_cpu_s(co) - c0;
    w->wk_cpu_s += cli_proc_cpu_s(wk) - k0;
    if (rc || job_status(http, ep, recs, n, w))
        return -1;
    for (long i = 0; i < n; i++) {
        if (recs[i].ttft_s >= 0 && recs[i].co_ttft_s >= 0 && w->co_ttft) {
            w->co_ttft[w->n_added] = recs[i].co_ttft_s;
            w->added[w->n_added++] = recs[i].ttft_s - recs[i].co_ttft_s;
        }
        w->done++;
        w->failed += recs[i].failed;
        w->tokens += recs[i].tokens;
        if (ref)
            compare(w, http, i, &ref[i], &recs[i]);
    }
    return 0;
}

static int way_alloc(hway *w, size_t n_ttft, size_t n_gaps)
{
    memset(w, 0, sizeof(*w));
    w->ttft = malloc(sizeof(double) * (n_ttft + 1));
    w->gaps = malloc(sizeof(double) * (n_gaps + 1));
    w->co_ttft = malloc(sizeof(double) * (n_ttft + 1));
    w->added = malloc(sizeof(double) * (n_ttft + 1));
    w->cap_gaps = n_gaps;
    return w->ttft && w->gaps && w->co_ttft && w->added ? 0 : -ENOMEM;
}

static void way_free(hway *w)
{
    free(w->ttft), free(w->gaps), free(w->co_ttft), free(w->added);
}

/* Waits until the HTTP port takes connections (the coordinator binds it as it starts). */
static int wait_port(int port)
{
    for (int k = 0; k < 1000; k++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
        if (fd >= 0)
            close(fd);
        if (ok)
            return 0;
        usleep(10000);
    }
    fprintf(stderr, "rekv bench http: nothing listens on 127.0.0.1:%d\n", port);
    return -1;
}

/* The mode the trio's worker runs in, from the coordinator's Stats ("" when it cannot tell). */
static void worker_mode(const char *ep, char *mode, size_t len)
{
    rekv_err err = {0};
    rekv_ctl *c = NULL;
    Rekv__Control__StatsRequest sr = REKV__CONTROL__STATS_REQUEST__INIT;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATS;
    rq.stats = &sr;
    Rekv__Control__Response *r = NULL;
    mode[0] = '\0';
    if (rekv_ctl_connect(ep, NULL, &c, &err) == 0 && rekv_ctl_call(c, &rq, 10000, &r, &err) == 0 &&
        r->body_case == REKV__CONTROL__RESPONSE__BODY_STATS && r->stats->n_workers > 0)
        snprintf(mode, len, "%s", r->stats->workers[0]->mode);
    if (r)
        rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
}

/* Runs every round against the started trio; fills the two ways and the mismatches; 0 or -1. */
static int http_rounds(const http_opts *o, const cli_trio *t, int port, int32_t *const *prompts,
                       hway *ctl, hway *web, char *mode, size_t mode_len)
{
    char ep[4200];
    snprintf(ep, sizeof(ep), "ipc://%s/control", t->dir);
    pid_t co = cli_trio_child(t, "rekv-coordinator"), wk = cli_trio_child(t, "rekv-gpuworker");
    if (co <= 0 || wk <= 0) {
        fprintf(stderr, "rekv bench http: the trio's coordinator or worker is not running\n");
        return -1;
    }
    long n = o->clients;
    hrec *ref = calloc((size_t)n, sizeof(*ref)), *recs = calloc((size_t)n, sizeof(*recs));
    hway warm;
    int rc = -1;
    if (!ref || !recs || way_alloc(&warm, 1, (size_t)o->max_new)) {
        fprintf(stderr, "rekv bench http: out of memory\n");
        goto out;
    }
    http_opts one = *o;
    one.clients = 1; /* a warm-up job: the weights paged in, the worker's first step done */
    if (wait_port(port) || run_way(0, &one, ep, port, co, wk, prompts, recs, NULL, &warm) < 0 ||
        run_way(0, o, ep, port, co, wk, prompts, ref, NULL, ctl) < 0)
        goto out;
    size_t text = 0;
    for (long i = 0; i < n; i++)
        text += ref[i].text_len;
    if (text == 0) {
        fprintf(stderr, "rekv bench http: the control socket's streams carry no text: the "
                        "model needs a tokenizer to compare the ways\n");
        goto out;
    }
    for (long r = 0; r < o->rounds; r++) {
        /* round 0: control (the reference, above), then HTTP; then each way first in turn */
        int order[2] = {r % 2 ? 1 : 0, r % 2 ? 0 : 1};
        for (int k = 0; k < 2; k++) {
            if (r == 0 && order[k] == 0)
                continue;
            if (run_way(order[k], o, ep, port, co, wk, prompts, recs, ref, order[k] ? web : ctl))
                goto out;
        }
    }
    worker_mode(ep, mode, mode_len);
    rc = 0;
out:
    if (ref)
        recs_reset(ref, n);
    if (recs)
        recs_reset(recs, n);
    free(ref);
    free(recs);
    way_free(&warm);
    return rc;
}

static void http_print(const http_opts *o, const rekv_model_config *cfg, hway *ctl, hway *web,
                       uint64_t mism, const char *mode)
{
    double c50 = cli_percentile(ctl->ttft, ctl->n_ttft, 50), c90 = cli_percentile(ctl->ttft, ctl->n_ttft, 90);
    double h50 = cli_percentile(web->ttft, web->n_ttft, 50), h90 = cli_percentile(web->ttft, web->n_ttft, 90);
    double wk = web->tokens ? web->wk_cpu_s / (double)web->tokens : 0;
    double co = web->tokens ? web->co_cpu_s / (double)web->tokens : 0;
    json_t *out = json_pack(
        "{s:s, s:s, s:s, s:{s:i, s:i, s:i, s:i}, s:s, s:I, s:I, s:I, s:I, s:o, s:o, s:I, s:f, "
        "s:f, s:f, s:f}",
        "bench", "http", "backend", o->backend, "mode", mode,
        "model", "layers", cfg->n_layers, "hidden", cfg->hidden, "vocab", cfg->vocab, "max_pos",
        cfg->max_pos, "arena", o->arena, "clients", (json_int_t)o->clients, "prompt_len",
        (json_int_t)o->prompt_len, "max_new_tokens", (json_int_t)o->max_new, "rounds",
        (json_int_t)o->rounds, "control", way_json(ctl), "http", way_json(web),
        "mismatches", (json_int_t)mism, "ttft_p50_ratio", c50 > 0 ? h50 / c50 : 0.0,
        "ttft_p90_ratio", c90 > 0 ? h90 / c90 : 0.0, "tokens_per_s_ratio",
        ctl->wall_s > 0 && web->wall_s > 0
            ? ((double)web->tokens / web->wall_s) / ((double)ctl->tokens / ctl->wall_s)
            : 0.0,
        "server_cpu_over_worker_cpu", wk > 0 ? co / wk : 0.0);
    /* the TTFT HTTP adds beyond what the control socket adds, both over the coordinator's own
     * (which the scheduling of 64 prompts at once makes vary run to run), as a share of the
     * control socket's TTFT */
    if (ctl->n_added && web->n_added && c50 > 0)
        json_object_set_new(out, "ttft_http_extra_share",
                            json_real((cli_percentile(web->added, web->n_added, 50) -
                                       cli_percentile(ctl->added, ctl->n_added, 50)) /
                                      c50));
    char *s = json_dumps(out, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    printf("%s\n", s);
    free(s);
    json_decref(out);
}

int cli_bench_http(int argc, char **argv)
{
    http_opts o;
    int rc = http_parse(argc, argv, &o);
    if (rc != CLI_PARSED)
        return rc;
    rekv_model_config cfg;
    if (cli_model_config(o.model, &cfg))
        return 1;
    if (o.prompt_len + o.max_new > cfg.max_pos) {
        fprintf(stderr, "rekv bench http: prompt + max-new-tokens exceeds the context (%d)\n",
                cfg.max_pos);
        return 2;
    }
    rc = 1;
    int32_t **prompts = calloc((size_t)o.clients, sizeof(*prompts));
    hway ctl = {0}, web = {0};
    size_t nt = (size_t)(o.clients * o.rounds), ng = nt * (size_t)o.max_new;
    uint64_t x = 4242; /* the same prompts run after run */
    int oom = !prompts || way_alloc(&ctl, nt, ng) || way_alloc(&web, nt, ng);
    for (long i = 0; !oom && i < o.clients; i++) {
        if ((prompts[i] = malloc(sizeof(int32_t) * (size_t)o.prompt_len)) == NULL)
            oom = 1;
        else
            cli_random_tokens(&x, prompts[i], (size_t)o.prompt_len, cfg.vocab);
    }
    if (oom) {
        fprintf(stderr, "rekv bench http: out of memory\n");
        goto out;
    }
    int port = free_port();
    char mode[64] = "";
    cli_trio t;
    if (port <= 0) {
        fprintf(stderr, "rekv bench http: no free loopback port\n");
        goto out;
    }
    int r = http_trio(&t, &o, port) ? -1 : http_rounds(&o, &t, port, prompts, &ctl, &web, mode, sizeof(mode));
    cli_trio_stop(&t);
    if (r)
        goto out;
    uint64_t mism = ctl.mismatches + web.mismatches;
    http_print(&o, &cfg, &ctl, &web, mism, mode);
    if (mism || ctl.failed || web.failed)
        fprintf(stderr, "rekv bench http: %llu job%s differ from the first control run, %llu "
                "failed\n", (unsigned long long)mism, mism == 1 ? "" : "s",
                (unsigned long long)(ctl.failed + web.failed));
    rc = mism || ctl.failed || web.failed ? 1 : 0;
out:
    if (prompts)
        for (long i = 0; i < o.clients; i++)
            free(prompts[i]);
    free(prompts);
    way_free(&ctl);
    way_free(&web);
    return rc;
}
