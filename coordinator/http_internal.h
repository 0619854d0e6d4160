/* http_internal.h — what the HTTP server's files share (http.c: the daemon, routing, errors, the
 * small endpoints; http_gen.c: completions and chat completions). Not a public interface. */
#ifndef REKV_COORDINATOR_HTTP_INTERNAL_H
#define REKV_COORDINATOR_HTTP_INTERNAL_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator/coordinator.h"
#include "coordinator/http.h"
#include "loader/chat_template.h"
#include "loader/loader.h"

struct rekv_http {
    struct MHD_Daemon *mhd;
    int port;
    atomic_int stopping;       /* set by rekv_http_stop: waits end, streams close */
    void *zctx;                /* one ZeroMQ context for every request's DEALER */
    int own_zctx;              /* zctx is ours to end (not the coordinator's) */
    char *control_endpoint;    /* strdup'd */
    char *curve_server_key;    /* strdup'd, or NULL */
    char *api_key;             /* strdup'd, or NULL */
    size_t api_key_len;
    char model_name[256];      /* GET /v1/models' id; a request's "model" must be it */
    rekv_tokenizer *tok;       /* /tokenize, /detokenize, logprobs' token strings; NULL: none */
    int have_model;            /* mcfg is valid */
    rekv_model_config mcfg;    /* the context length (max_pos), bos/eos, vocab */
    rekv_chat_template *chat;  /* the model's chat template; NULL: chat answers chat_why */
    char chat_why[700];        /* why there is none (one line) */
    int64_t created;           /* start time (unix seconds), for /v1/models */
    void (*on_log)(void *ctx, int level, const char *msg);
    void *log_ctx;
};

/* A growing byte buffer. */
typedef struct hbuf {
    char *p;
    size_t n, cap;
} hbuf;

int hbuf_put(hbuf *b, const void *s, size_t n);
int hbuf_printf(hbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void hbuf_free(hbuf *b);

/* One HTTP request: its body as it arrives, then what answering it needs. */
typedef struct hreq {
    struct rekv_http *srv;
    struct MHD_Connection *conn;
    int fd;               /* the client's socket (watched for the client going away) */
    int route;            /* HR_* */
    hbuf body;            /* the request body read so far */
    int refused;          /* answered (or to be refused): the rest of the body is dropped */
    int too_large;        /* the body passed REKV_HTTP_MAX_BODY as it came: 413 at its end */
    uint64_t seen;        /* body bytes received */
    struct hgen *gen;     /* completions and chat: the jobs (http_gen.c), else NULL */
} hreq;

enum { HR_NONE = 0, HR_COMPLETIONS, HR_CHAT, HR_MODELS, HR_HEALTH, HR_TOKENIZE, HR_DETOKENIZE };

/* Queues an OpenAI error object {"error":{"message","type","param","code"}} with status. type
 * NULL: chosen from the status; code may be NULL (null in the JSON). */
enum MHD_Result http_error(struct MHD_Connection *c, unsigned status, const char *type,
                           const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Queues j (stolen) as JSON with status. */
enum MHD_Result http_json(struct MHD_Connection *c, unsigned status, json_t *j);
/* The same with one more header (hname NULL: none). */
enum MHD_Result http_json_hdr(struct MHD_Connection *c, unsigned status, json_t *j,
                              const char *hname, const char *hval);
/* The HTTP status for a coordinator's refusal. */
unsigned http_status_of_code(Rekv__Control__Code code);

/* A DEALER to the coordinator for one request; NULL after logging why. */
rekv_ctl *http_ctl_open(struct rekv_http *h, rekv_err *err);
/* One call with the server's retry rule: a request without a reply in time is sent again (with
 * the same id; a Submit's client key makes it one job) until the server stops. */
int http_ctl_call(struct rekv_http *h, rekv_ctl *c, Rekv__Control__Request *rq,
                  Rekv__Control__Response **resp, rekv_err *err);
/* 1 when the client's connection is closed (EOF or an error pending on fd), else 0. */
int http_client_gone(int fd);

/* Completions and chat completions (http_gen.c): called once the body is complete. */
enum MHD_Result http_gen_answer(hreq *r);
/* The request ended (toe: libmicrohttpd's reason): cancels its unfinished jobs unless they ended,
 * frees its state. */
void http_gen_finish(hreq *r, int completed_ok);

#endif
