/* http_env.c — see http_env.h. */
#define _GNU_SOURCE
#include "tests/http_env.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/metrics_scrape.h"
#include "tests/testutil.h"

int hx_start(hx_env *x, const char *const *extra, int with_worker)
{
    const char *m = tu_shared(HX_MODEL_REL);
    if (m == NULL)
        return -1;
    return hx_start_model(x, m, extra, with_worker);
}

const char *hx_chat_model(const char *dir, const char *name)
{
    static char path[4200];
    char rel[512], src[4200], dst[8500];
    snprintf(rel, sizeof(rel), "chat-templates/%s.jinja", name);
    const char *tmpl = tu_shared(rel), *m = tu_shared("models/llama-tiny-py/config.json");
    if (tmpl == NULL || m == NULL)
        return NULL;
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    ck_assert_int_eq(mkdir(path, 0700), 0);
    static const char *files[] = {"config.json", "merges.txt", "model.safetensors",
                                  "special_tokens_map.json", "tokenizer_config.json", "vocab.json"};
    char *abs = realpath("../shared/models/llama-tiny-py", NULL);
    ck_assert_ptr_nonnull(abs);
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        snprintf(src, sizeof(src), "%s/%s", abs, files[i]);
        snprintf(dst, sizeof(dst), "%s/%s", path, files[i]);
        ck_assert_int_eq(symlink(src, dst), 0);
    }
    free(abs);
    char cmd[13000];
    snprintf(cmd, sizeof(cmd), "cp '%s' '%s/chat_template.jinja'", tmpl, path);
    tu_run_ok(cmd);
    return path;
}

int hx_start_model(hx_env *x, const char *m, const char *const *extra, int with_worker)
{
    memset(x, 0, sizeof(*x));
    snprintf(x->model, sizeof(x->model), "%s", m);
    x->dir = tu_tmpdir();
    snprintf(x->ctl, sizeof(x->ctl), "ipc://%s/control", x->dir);
    snprintf(x->wrk, sizeof(x->wrk), "ipc://%s/workers", x->dir);
    snprintf(x->log, sizeof(x->log), "%s/daemons.log", x->dir);
    x->port = ms_free_port();
    char listen[64], state[4200], prog[4096];
    snprintf(listen, sizeof(listen), "127.0.0.1:%d", x->port);
    snprintf(state, sizeof(state), "%s/state", x->dir);
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-coordinator"));
    const char *args[48] = {prog,    "--control", x->ctl,  "--workers", x->wrk,   "--state-dir",
                            state,   "--model",   x->model, "--http",   listen};
    int n = 11;
    for (int i = 0; extra && extra[i] && n < 46; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    int st = 0;
    x->co = tu_spawn(args, x->log, &st);
    ck_assert_msg(x->co > 0, "rekv-coordinator did not start: %s", tu_log_end(x->log));
    if (with_worker)
        hx_start_worker(x);
    return 0;
}

void hx_start_worker(hx_env *x)
{
    char prog[4096];
    snprintf(prog, sizeof(prog), "%s", tu_bin("rekv-gpuworker"));
    const char *args[] = {prog,  "--model",     x->model, "--coordinator",  x->wrk, "--backend",
                          "cpu", "--max-batch", "16",     "--heartbeat-ms", "100",  NULL};
    x->worker = tu_spawn(args, x->log, NULL);
    ck_assert_msg(x->worker > 0, "rekv-gpuworker did not start: %s", tu_log_end(x->log));
    /* serving: /health says so once the coordinator counts the worker */
    for (;;) {
        hx_resp r;
        hx_request(x->port, "GET", "/health", NULL, NULL, &r);
        int ok = r.status == 200;
        hx_resp_free(&r);
        if (ok)
            break;
        usleep(20000);
    }
}

void hx_stop(hx_env *x)
{
    if (x->worker > 0)
        tu_stop(x->worker);
    if (x->co > 0)
        tu_stop(x->co);
    x->worker = x->co = 0;
    if (x->dir) {
        tu_rmrf(x->dir);
        free(x->dir);
        x->dir = NULL;
    }
}

int hx_connect(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_msg(connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0, "connect :%d: %s", port,
                  strerror(errno));
    return fd;
}

static void send_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return; /* the server may close early (413): the answer says why */
        p += w;
        n -= (size_t)w;
    }
}

/* Decodes a chunked body in place; returns its length. */
static size_t dechunk(char *b, size_t n)
{
    size_t in = 0, out = 0;
    while (in < n) {
        char *end;
        unsigned long len = strtoul(b + in, &end, 16);
        char *crlf = strstr(b + in, "\r\n");
        if (crlf == NULL || end == b + in)
            break;
        in = (size_t)(crlf - b) + 2;
        if (len == 0 || in + len > n)
            break;
        memmove(b + out, b + in, len);
        out += len;
        in += len + 2;
    }
    b[out] = '\0';
    return out;
}

void hx_read_answer(int fd, hx_resp *r)
{
    memset(r, 0, sizeof(*r));
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    ck_assert_ptr_nonnull(buf);
    for (;;) {
        if (n + 4096 > cap)
            ck_assert_ptr_nonnull(buf = realloc(buf, cap *= 2));
        ssize_t got = recv(fd, buf + n, cap - n - 1, 0);
        if (got <= 0)
            break;
        n += (size_t)got;
    }
    buf[n] = '\0';
    char *sep = strstr(buf, "\r\n\r\n");
    if (n < 12 || sep == NULL) {
        r->head = buf;
        r->body = strdup("");
        return;
    }
    r->status = atoi(buf + 9);
    *sep = '\0';
    r->head = strdup(buf);
    r->n = n - (size_t)(sep + 4 - buf);
    r->body = malloc(r->n + 1);
    memcpy(r->body, sep + 4, r->n);
    r->body[r->n] = '\0';
    if (strcasestr(r->head, "transfer-encoding: chunked"))
        r->n = dechunk(r->body, r->n);
    free(buf);
}

void hx_request(int port, const char *method, const char *path, const char *headers,
                const char *body, hx_resp *r)
{
    int fd = hx_connect(port);
    char head[8192];
    int hn = snprintf(head, sizeof(head),
                      "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s", method, path,
                      headers ? headers : "");
    if (body)
        hn += snprintf(head + hn, sizeof(head) - (size_t)hn,
                       "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                       strlen(body));
    hn += snprintf(head + hn, sizeof(head) - (size_t)hn, "\r\n");
    send_all(fd, head, (size_t)hn);
    if (body)
        send_all(fd, body, strlen(body));
    hx_read_answer(fd, r);
    close(fd);
}

void hx_resp_free(hx_resp *r)
{
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof(*r));
}

json_t *hx_json(const hx_resp *r)
{
    json_error_t je;
    json_t *j = json_loadb(r->body, r->n, 0, &je);
    ck_assert_msg(j != NULL, "answer %d is not JSON (%s): %.300s", r->status, je.text, r->body);
    return j;
}

json_t *hx_post(int port, const char *path, const char *body, int *status)
{
    hx_resp r;
    hx_request(port, "POST", path, NULL, body, &r);
    json_t *j = hx_json(&r);
    *status = r.status;
    hx_resp_free(&r);
    return j;
}

void hx_expect_error(const hx_resp *r, int status, const char *type)
{
    ck_assert_msg(r->status == status, "want %d, got %d: %.300s", status, r->status, r->body);
    json_t *j = hx_json(r);
    json_t *e = json_object_get(j, "error");
    ck_assert_msg(json_is_object(e), "no error object: %.300s", r->body);
    ck_assert_msg(json_is_string(json_object_get(e, "message")) &&
                      json_string_length(json_object_get(e, "message")) > 0,
                  "error without a message: %.300s", r->body);
    ck_assert_msg(json_is_string(json_object_get(e, "type")), "error without a type");
    ck_assert_msg(json_object_get(e, "param") && json_object_get(e, "code"),
                  "error without param/code: %.300s", r->body);
    if (type)
        ck_assert_str_eq(json_string_value(json_object_get(e, "type")), type);
    json_decref(j);
}

rekv_ctl *hx_ctl(hx_env *x) { return tu_ctl_open(x->ctl); }
