/* http.c — the HTTP server of rekv-coordinator (http.h): libmicrohttpd's daemon, routing, Bearer
 * authentication, the request body (bounded: 413 past REKV_HTTP_MAX_BODY, refused from its
 * Content-Length before it is read), OpenAI's error objects, and the small endpoints
 * (/v1/models, /health, /tokenize, /detokenize). Completions and chat are http_gen.c; the thread
 * that talks to the coordinator is http_bridge.c.
 *
 * Threads: two, however many connections. libmicrohttpd's one polling thread (epoll) accepts (at
 * most max_connections at once; more are closed at accept), reads and writes every connection
 * and runs every callback here, none of which blocks: a request that waits on the coordinator
 * (completions, chat, /health) is handed to the bridge thread and its connection suspended until
 * the bridge resumes it. An idle or slow client costs a socket in the epoll set, not a thread.
 * Shared between the two: srv->mu (the requests the bridge works for), the read-only tokenizer and
 * model config. */
#define _GNU_SOURCE
#include "coordinator/http_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/metrics.h"

/* ---------------------------------------------------------------- buffers, replies */

int hbuf_put(hbuf *b, const void *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL)
            return -ENOMEM;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

int hbuf_printf(hbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    if (n < 0)
        return -EINVAL;
    if ((size_t)n < sizeof(tmp))
        return hbuf_put(b, tmp, (size_t)n);
    char *big = malloc((size_t)n + 1);
    if (big == NULL)
        return -ENOMEM;
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int rc = hbuf_put(b, big, (size_t)n);
    free(big);
    return rc;
}

void hbuf_free(hbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}

enum MHD_Result http_json(struct MHD_Connection *c, unsigned status, json_t *j)
{
    return http_json_hdr(c, status, j, NULL, NULL);
}

enum MHD_Result http_json_hdr(struct MHD_Connection *c, unsigned status, json_t *j,
                              const char *hname, const char *hval)
{
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (s == NULL)
        return MHD_NO;
    size_t n = strlen(s);
    /* a newline, as curl users expect the prompt back on its own line */
    char *t = realloc(s, n + 2);
    if (t == NULL) {
        free(s);
        return MHD_NO;
    }
    t[n] = '\n';
    t[n + 1] = '\0';
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(n + 1, t, MHD_RESPMEM_MUST_FREE);
    if (resp == NULL) {
        free(t);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (hname)
        MHD_add_response_header(resp, hname, hval);
    enum MHD_Result rc = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return rc;
}

static json_t *error_obj_v(unsigned status, const char *type, const char *code, const char *fmt,
                           va_list ap)
{
    char msg[1200];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    if (type == NULL)
        type = status == 401   ? "authentication_error"
               : status == 404 ? "not_found_error"
               : status == 429 ? "rate_limit_error"
               : status >= 500 ? "server_error"
                               : "invalid_request_error";
    return json_pack("{s:{s:s, s:s, s:n, s:o}}", "error", "message", msg, "type", type, "param",
                     "code", code ? json_string(code) : json_null());
}

json_t *http_error_obj(unsigned status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    json_t *e = error_obj_v(status, NULL, NULL, fmt, ap);
    va_end(ap);
    return e;
}

enum MHD_Result http_error(struct MHD_Connection *c, unsigned status, const char *type,
                           const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    json_t *e = error_obj_v(status, type, code, fmt, ap);
    va_end(ap);
    return http_json(c, status, e);
}

unsigned http_status_of_code(Rekv__Control__Code code)
{
    switch (code) {
    case REKV__CONTROL__CODE__OK: return 200;
    case REKV__CONTROL__CODE__BAD_REQUEST: return 400;
    case REKV__CONTROL__CODE__BUSY: return 429;
    case REKV__CONTROL__CODE__NOT_FOUND: return 404;
    case REKV__CONTROL__CODE__SHUTTING_DOWN: return 503;
    default: return 500;
    }
}

/* ---------------------------------------------------------------- small endpoints */

static enum MHD_Result answer_models(hreq *r)
{
    struct rekv_http *h = r->srv;
    json_t *m = json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", h->model_name, "object", "model",
                          "created", (json_int_t)h->created, "owned_by", "rekv", "root",
                          h->model_name);
    if (m && h->have_model)
        json_object_set_new(m, "max_model_len", json_integer(h->mcfg.max_pos));
    return http_json(r->conn, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
}

/* /health asks the coordinator through the bridge: the connection waits suspended (5 s at most:
 * a health check that waits is itself the answer). */
static enum MHD_Result answer_health(hreq *r)
{
    hgen *g = calloc(1, sizeof(*g));
    hjob *j = calloc(1, sizeof(*j));
    if (g == NULL || j == NULL) {
        free(g);
        free(j);
        return MHD_NO;
    }
    g->srv = r->srv;
    g->conn = r->conn;
    g->kind = HG_HEALTH;
    g->fd = -1;
    g->jobs = j;
    g->n_jobs = 1;
    j->g = g;
    r->gen = g;
    if (http_bridge_submit(g))
        return http_error(r->conn, 503, NULL, NULL, "the server is shutting down");
    r->pending = 1;
    return MHD_YES;
}

static enum MHD_Result health_continue(hreq *r)
{
    hgen *g = r->gen;
    struct rekv_http *h = r->srv;
    unsigned status = 503;
    json_t *j = NULL;
    /* the answer is made under mu and queued after (http_internal.h: hanswer) */
    pthread_mutex_lock(&h->mu);
    if (atomic_load(&h->stopping))
        j = http_error_obj(503, "the server is shutting down");
    else if (http_gen_wait(g))
        j = NULL;
    else if (!g->health_replied)
        j = http_error_obj(503, "the coordinator does not answer: %s", g->health_err);
    else if (!g->health_serving || g->health_workers == 0)
        j = http_error_obj(503, "no worker is serving (%u connected)", g->health_workers);
    else {
        status = 200;
        j = json_pack("{s:s, s:i}", "status", "ok", "workers", (int)g->health_workers);
    }
    int waiting = g->suspended;
    pthread_mutex_unlock(&h->mu);
    if (waiting)
        return MHD_YES;
    r->pending = 0;
    return http_json(r->conn, status, j);
}

/* The request body as a JSON object, or NULL after queueing the 400. */
static json_t *body_object(hreq *r, enum MHD_Result *ret)
{
    json_error_t je;
    json_t *j = json_loadb(r->body.p ? r->body.p : "", r->body.n, JSON_REJECT_DUPLICATES, &je);
    if (j == NULL) {
        *ret = http_error(r->conn, 400, NULL, NULL, "the body is not valid JSON: %s (line %d)",
                          je.text, je.line);
        return NULL;
    }
    if (!json_is_object(j)) {
        json_decref(j);
        *ret = http_error(r->conn, 400, NULL, NULL, "the body must be a JSON object");
        return NULL;
    }
    return j;
}

static enum MHD_Result answer_tokenize(hreq *r)
{
    struct rekv_http *h = r->srv;
    enum MHD_Result ret;
    if (h->tok == NULL)
        return http_error(r->conn, 400, NULL, NULL,
                          "the server has no tokenizer (start it with --model of a model that "
                          "has one)");
    json_t *j = body_object(r, &ret);
    if (j == NULL)
        return ret;
    json_t *p = json_object_get(j, "prompt"), *sp = json_object_get(j, "add_special_tokens");
    if (!json_is_string(p)) {
        json_decref(j);
        return http_error(r->conn, 400, NULL, NULL, "'prompt' must be a string");
    }
    if (sp && !json_is_boolean(sp)) {
        json_decref(j);
        return http_error(r->conn, 400, NULL, NULL, "'add_special_tokens' must be a boolean");
    }
    /* the BOS rule the coordinator's Submit.prompt_text follows, so the count is the job's */
    int bos = h->have_model && h->mcfg.add_bos && (sp == NULL || json_is_true(sp))
                  ? h->mcfg.bos_id
                  : -1;
    int32_t *ids = NULL;
    size_t n = 0;
    rekv_err err = {0};
    if (rekv_tokenizer_encode(h->tok, json_string_value(p), json_string_length(p), bos, &ids, &n,
                              &err)) {
        json_decref(j);
        return http_error(r->conn, 400, NULL, NULL, "%s", err.msg);
    }
    json_decref(j);
    json_t *toks = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(toks, json_integer(ids[i]));
    free(ids);
    return http_json(r->conn, 200,
                     json_pack("{s:o, s:I, s:i}", "tokens", toks, "count", (json_int_t)n,
                               "max_model_len", h->have_model ? h->mcfg.max_pos : 0));
}

static enum MHD_Result answer_detokenize(hreq *r)
{
    struct rekv_http *h = r->srv;
    enum MHD_Result ret;
    if (h->tok == NULL)
        return http_error(r->conn, 400, NULL, NULL,
                          "the server has no tokenizer (start it with --model of a model that "
                          "has one)");
    json_t *j = body_object(r, &ret);
    if (j == NULL)
        return ret;
    json_t *t = json_object_get(j, "tokens");
    if (!json_is_array(t)) {
        json_decref(j);
        return http_error(r->conn, 400, NULL, NULL, "'tokens' must be an array of token ids");
    }
    size_t n = json_array_size(t);
    int32_t *ids = malloc(sizeof(int32_t) * (n ? n : 1));
    int vocab = rekv_tokenizer_vocab_size(h->tok);
    for (size_t i = 0; ids && i < n; i++) {
        json_t *v = json_array_get(t, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab) {
            free(ids);
            json_decref(j);
            return http_error(r->conn, 400, NULL, NULL,
                              "'tokens'[%zu] is not a token id of the vocabulary (0..%d)", i,
                              vocab - 1);
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    json_decref(j);
    char *text = NULL;
    size_t tl = 0;
    rekv_err err = {0};
    if (ids == NULL || rekv_tokenizer_decode(h->tok, ids, n, &text, &tl, &err)) {
        free(ids);
        return http_error(r->conn, 500, NULL, NULL, "%s", ids ? err.msg : "out of memory");
    }
    free(ids);
    /* a byte-level vocabulary decodes to any bytes: JSON carries only valid UTF-8 */
    json_t *s = json_stringn(text, tl);
    free(text);
    if (s == NULL)
        return http_error(r->conn, 400, NULL, NULL,
                          "these tokens do not decode to valid UTF-8 text");
    return http_json(r->conn, 200, json_pack("{s:o}", "prompt", s));
}

/* ---------------------------------------------------------------- routing */

static int route_of(const char *url, const char **allow)
{
    static const struct {
        const char *path;
        int route;
        const char *method;
    } routes[] = {
        {"/v1/completions", HR_COMPLETIONS, "POST"},
        {"/v1/chat/completions", HR_CHAT, "POST"},
        {"/v1/models", HR_MODELS, "GET"},
        {"/health", HR_HEALTH, "GET"},
        {"/tokenize", HR_TOKENIZE, "POST"},
        {"/detokenize", HR_DETOKENIZE, "POST"},
    };
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
        if (strcmp(url, routes[i].path) == 0) {
            *allow = routes[i].method;
            return routes[i].route;
        }
    return HR_NONE;
}

/* Constant-time: the time depends on the lengths only, never on where the bytes differ. */
static int key_matches(const struct rekv_http *h, const char *got)
{
    size_t n = strlen(got);
    unsigned char d = n != h->api_key_len;
    for (size_t i = 0; i < n; i++)
        d |= (unsigned char)got[i] ^ (unsigned char)h->api_key[i % h->api_key_len];
    return d == 0;
}

static enum MHD_Result authorized(hreq *r, int *ok)
{
    struct rekv_http *h = r->srv;
    *ok = 1;
    if (h->api_key == NULL || r->route == HR_HEALTH)
        return MHD_YES;
    const char *a = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND,
                                                MHD_HTTP_HEADER_AUTHORIZATION);
    if (a && strncasecmp(a, "Bearer ", 7) == 0 && key_matches(h, a + 7))
        return MHD_YES;
    *ok = 0;
    return http_error(r->conn, 401, "invalid_request_error", "invalid_api_key",
                      a ? "Incorrect API key provided" : "Missing API key (Authorization: Bearer "
                                                         "KEY)");
}

static enum MHD_Result answer(hreq *r)
{
    switch (r->route) {
    case HR_COMPLETIONS:
    case HR_CHAT: return http_gen_answer(r);
    case HR_MODELS: return answer_models(r);
    case HR_HEALTH: return answer_health(r);
    case HR_TOKENIZE: return answer_tokenize(r);
    case HR_DETOKENIZE: return answer_detokenize(r);
    default: return MHD_NO;
    }
}

/* The first call of a request: route, method, authentication, Content-Length. Returns MHD_YES
 * with r->refused set when an answer was queued. */
static enum MHD_Result request_begin(hreq *r, const char *url, const char *method)
{
    const char *allow = NULL;
    r->route = route_of(url, &allow);
    if (r->route == HR_NONE) {
        r->refused = 1;
        return http_error(r->conn, 404, "invalid_request_error", "unknown_url",
                          "Unknown request URL: %s %s", method, url);
    }
    if (strcmp(method, allow) != 0) {
        r->refused = 1;
        return http_json_hdr(r->conn, 405,
                             json_pack("{s:{s:s, s:s, s:n, s:n}}", "error", "message",
                                       "Method not allowed", "type", "invalid_request_error",
                                       "param", "code"),
                             MHD_HTTP_HEADER_ALLOW, allow);
    }
    int ok;
    enum MHD_Result rc = authorized(r, &ok);
    if (!ok) {
        r->refused = 1;
        return rc;
    }
    const char *cl = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND,
                                                 MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl && strtoull(cl, NULL, 10) > REKV_HTTP_MAX_BODY) {
        r->refused = 1;
        return http_error(r->conn, 413, NULL, NULL,
                          "the request body of %s bytes is larger than the limit of %u bytes", cl,
                          REKV_HTTP_MAX_BODY);
    }
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
    (void)version;
    struct rekv_http *h = cls;
    hreq *r = *con_cls;
    if (r == NULL) {
        if ((r = calloc(1, sizeof(*r))) == NULL)
            return MHD_NO;
        r->srv = h;
        r->conn = conn;
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        r->fd = ci ? ci->connect_fd : -1;
        *con_cls = r;
        return request_begin(r, url, method);
    }
    if (r->pending) /* resumed by the bridge */
        return r->route == HR_HEALTH ? health_continue(r) : http_gen_continue(r);
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (r->route == HR_NONE || (r->refused && !r->too_large))
            return MHD_YES; /* answered at the start: libmicrohttpd drops the rest */
        r->seen += n;
        if (r->seen > REKV_HTTP_MAX_BODY) {
            /* a body without a Content-Length (chunked) that grows past the limit: libmicrohttpd
             * takes no answer while the body comes, so the rest is read and dropped (never
             * kept) for the 413 at its end; one that goes on and on is cut off */
            r->too_large = 1;
            r->refused = 1;
            hbuf_free(&r->body);
            return r->seen > 4ull * REKV_HTTP_MAX_BODY ? MHD_NO : MHD_YES;
        }
        return hbuf_put(&r->body, upload, n) ? MHD_NO : MHD_YES;
    }
    if (r->too_large) {
        r->too_large = 0;
        return http_error(conn, 413, NULL, NULL,
                          "the request body is larger than the limit of %u bytes",
                          REKV_HTTP_MAX_BODY);
    }
    if (r->refused)
        return MHD_YES;
    r->refused = 1; /* answered from here on */
    return answer(r);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)conn;
    (void)toe; /* however it ended, jobs that have not are cancelled */
    hreq *r = *con_cls;
    if (r == NULL)
        return;
    *con_cls = NULL;
    if (r->gen)
        http_gen_finish(r);
    hbuf_free(&r->body);
    free(r);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    struct rekv_http *h = cls;
    char msg[512];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n && msg[n - 1] == '\n')
        msg[--n] = '\0';
    /* a stream ended because its client went away (or the server stops) is ours, not news */
    int level = strstr(msg, "application error generating response") ? REKV_LOG_DEBUG
                                                                      : REKV_LOG_WARN;
    if (h->on_log)
        h->on_log(h->log_ctx, level, msg);
}

/* ---------------------------------------------------------------- start, stop */

/* The served name: --model's last path component, a checkpoint file's without its extension
 * (docs8L/docs8L.bin -> docs8L; a directory keeps its dots: Qwen2.5-7B). */
static void model_name_of(const char *path, char *out, size_t n)
{
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s", path);
    size_t l = strlen(tmp);
    while (l > 1 && tmp[l - 1] == '/')
        tmp[--l] = '\0';
    const char *base = strrchr(tmp, '/') ? strrchr(tmp, '/') + 1 : tmp;
    snprintf(out, n, "%s", base);
    struct stat st;
    char *dot = strrchr(out, '.');
    if (dot && dot != out && stat(path, &st) == 0 && S_ISREG(st.st_mode))
        *dot = '\0';
}

/* Connections at most: wanted (0: 4096) within what the open-file limit leaves (each connection
 * is a socket; half the room, so that the coordinator's own files and workers always fit). */
static unsigned conn_limit(uint32_t wanted)
{
    unsigned n = wanted ? wanted : 4096;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        unsigned room = rl.rlim_cur > 256 ? (unsigned)((rl.rlim_cur - 128) / 2) : 64;
        if (n > room)
            n = room;
    }
    return n;
}

/* The model directory's chat template. One that cannot be used does not stop the server: chat
 * requests are answered 400 with the reason, completions are served. */
static void load_chat_template(struct rekv_http *h, const char *path)
{
    struct stat st;
    snprintf(h->chat_why, sizeof(h->chat_why),
             "this model has no chat template (tokenizer_config.json 'chat_template' or "
             "chat_template.jinja in its directory): use /v1/completions");
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return;
    rekv_err err = {0};
    if (rekv_chat_template_load_dir(path, &h->chat, &err) == 0)
        return;
    h->chat = NULL;
    snprintf(h->chat_why, sizeof(h->chat_why), "the model's chat template cannot be used: %.600s",
             err.msg);
    if (h->on_log)
        h->on_log(h->log_ctx, REKV_LOG_WARN, h->chat_why);
}

static int load_model(struct rekv_http *h, const rekv_http_config *cfg, rekv_err *err)
{
    if (cfg->model_path == NULL) {
        snprintf(h->model_name, sizeof(h->model_name), "%s",
                 cfg->served_model_name ? cfg->served_model_name : "rekv");
        return 0;
    }
    rekv_model *m = NULL;
    int rc = rekv_model_open(cfg->model_path, &m, err);
    if (rc)
        return rc;
    h->mcfg = m->config;
    h->have_model = 1;
    rekv_model_close(m);
    rc = rekv_tokenizer_load_for_model(cfg->model_path, &h->tok, err);
    if (rc == -ENOENT) {
        rekv_err_clear(err);
        rc = 0;
    }
    if (cfg->served_model_name)
        snprintf(h->model_name, sizeof(h->model_name), "%s", cfg->served_model_name);
    else
        model_name_of(cfg->model_path, h->model_name, sizeof(h->model_name));
    if (rc == 0)
        load_chat_template(h, cfg->model_path);
    return rc;
}

int rekv_http_start(const rekv_http_config *cfg, rekv_http **out, rekv_err *err)
{
    *out = NULL;
    struct rekv_http *h = calloc(1, sizeof(*h));
    if (h == NULL)
        return rekv_errf(err, -ENOMEM, "http: out of memory");
    int rc, fd = -1;
    h->on_log = cfg->on_log;
    h->log_ctx = cfg->ctx;
    pthread_mutex_init(&h->mu, NULL);
    h->have_mu = 1;
    h->created = (int64_t)time(NULL);
    h->control_endpoint = strdup(cfg->control_endpoint);
    h->curve_server_key = cfg->curve_server_key ? strdup(cfg->curve_server_key) : NULL;
    if (cfg->api_key) {
        h->api_key = strdup(cfg->api_key);
        h->api_key_len = strlen(cfg->api_key);
        if (h->api_key_len == 0) {
            rc = rekv_errf(err, -EINVAL, "http: the API key is empty");
            goto fail;
        }
    }
    if ((rc = load_model(h, cfg, err)))
        goto fail;
    json_t *mj = json_string(h->model_name);
    char *mjs = mj ? json_dumps(mj, JSON_ENCODE_ANY) : NULL;
    json_decref(mj);
    if (mjs == NULL || strlen(mjs) >= sizeof(h->model_json)) {
        free(mjs);
        rc = rekv_errf(err, -EINVAL, "http: the served model name is not valid UTF-8 text");
        goto fail;
    }
    snprintf(h->model_json, sizeof(h->model_json), "%s", mjs);
    free(mjs);
    h->own_zctx = cfg->zctx == NULL;
    if ((h->zctx = cfg->zctx ? cfg->zctx : zmq_ctx_new()) == NULL) {
        rc = rekv_errf(err, -errno, "http: zmq context: %s", zmq_strerror(errno));
        goto fail;
    }
    if ((rc = http_bridge_start(h, err)))
        goto fail;
    if ((rc = rekv_listen_tcp(cfg->listen, cfg->allow_remote, "http",
                              "--http-public; put an --api-key-file on it", &fd, &h->port, err)))
        goto fail;
    unsigned limit = conn_limit(cfg->max_connections);
    h->mhd = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ITC |
            MHD_USE_ERROR_LOG,
        0, NULL, NULL, on_request, h, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
        MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_LIMIT, limit,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)(cfg->timeout_s ? cfg->timeout_s : 60),
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64u << 10), MHD_OPTION_END);
    if (h->mhd == NULL) {
        close(fd);
        rc = rekv_errf(err, -EIO, "http: libmicrohttpd did not start on %s", cfg->listen);
        goto fail;
    }
    *out = h;
    return 0;
fail:
    rekv_http_stop(h);
    return rc;
}

int rekv_http_port(const rekv_http *h) { return h->port; }

void rekv_http_stop(rekv_http *h)
{
    if (h == NULL)
        return;
    /* every suspended connection resumed first (libmicrohttpd must have none when it stops) */
    if (h->have_mu)
        http_bridge_drain(h);
    atomic_store(&h->stopping, 1);
    if (h->mhd) {
        /* the listening socket is ours: MHD_stop_daemon closes it */
        MHD_stop_daemon(h->mhd);
    }
    http_bridge_stop(h); /* its DEALER closes before the context ends */
    if (h->have_mu)
        pthread_mutex_destroy(&h->mu);
    if (h->zctx && h->own_zctx)
        zmq_ctx_term(h->zctx);
    rekv_tokenizer_free(h->tok);
    rekv_chat_template_free(h->chat);
    free(h->control_endpoint);
    free(h->curve_server_key);
    free(h->api_key);
    free(h);
}
