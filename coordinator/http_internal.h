/* http_internal.h — what the HTTP server's files share (http.c: the daemon, routing, errors, the
 * small endpoints; http_gen.c: completions and chat completions; http_bridge.c: the one thread
 * that talks to the coordinator for every request). Not a public interface. */
#ifndef REKV_COORDINATOR_HTTP_INTERNAL_H
#define REKV_COORDINATOR_HTTP_INTERNAL_H

#include <jansson.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator/coordinator.h"
#include "coordinator/http.h"
#include "loader/chat_template.h"
#include "loader/loader.h"

struct hbridge;

struct rekv_http {
    struct MHD_Daemon *mhd;
    int port;
    atomic_int stopping;       /* set by rekv_http_stop (under mu): waits end, streams close */
    pthread_mutex_t mu;        /* every hgen's shared state (below), and the bridge's queue */
    int have_mu;
    struct hbridge *bridge;    /* the thread that talks to the coordinator (http_bridge.c) */
    void *zctx;                /* the ZeroMQ context of the bridge's DEALER */
    int own_zctx;              /* zctx is ours to end (not the coordinator's) */
    char *control_endpoint;    /* strdup'd */
    char *curve_server_key;    /* strdup'd, or NULL */
    char *api_key;             /* strdup'd, or NULL */
    size_t api_key_len;
    char model_name[256];      /* GET /v1/models' id; a request's "model" must be it */
    char model_json[600];      /* model_name as a JSON string (quoted, escaped) */
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
    int pending;          /* waits on the bridge: later calls continue it (gen or health) */
    int route;            /* HR_* */
    hbuf body;            /* the request body read so far */
    int refused;          /* answered (or to be refused): the rest of the body is dropped */
    int too_large;        /* the body passed REKV_HTTP_MAX_BODY as it came: 413 at its end */
    uint64_t seen;        /* body bytes received */
    struct hgen *gen;     /* completions, chat, health: what waits on the bridge, else NULL */
} hreq;

/* One job of a request (a Submit: one prompt, one choice). The bridge writes what comes from the
 * coordinator, the connection's callbacks read it; both under srv->mu. */
typedef struct hjob {
    struct hgen *g;            /* its request */
    struct hjob *hnext;        /* the bridge's table of request ids: its chain */
    Rekv__Control__Submit sub; /* as sent (prompt fields point into the request's JSON) */
    char key[64];              /* its client key */
    uint64_t rq;               /* the Submit's request id: its reply and events carry it; 0 unsent */
    uint64_t job;              /* the coordinator's id once accepted, else 0 */
    uint32_t prompt_tokens;
    int prompt;                /* index of its prompt */
    int index;                 /* its choice index */
    uint32_t next;             /* generated tokens had (the next event's expected offset) */
    int done;
    int dirty;                 /* events since the stream last looked */
    int cancel_sent;           /* the bridge sent its Cancel */
    Rekv__Control__JobState state;
    char finish[32];  /* the coordinator's finish_reason */
    char *error;      /* FAILED: why (malloc'd) */
    hbuf text;        /* the generated text's bytes */
    size_t text_sent; /* bytes of text already streamed */
    hbuf lp;          /* [next] float: each token's log-probability (with logprobs) */
    hbuf top_ids;     /* [next][top_logprobs] int32 */
    hbuf top_vals;    /* [next][top_logprobs] float */
    hbuf ids;         /* [next] int32: the generated ids */
    size_t lp_sent;   /* tokens whose logprobs were streamed */
    int refused;      /* the coordinator refused its Submit */
    int echo_sent;    /* stream: the echoed prompt went out */
    int role_sent;    /* chat stream: the first delta (role) went out */
    int end_sent;     /* stream: its finish_reason went out */
} hjob;

/* What a request waits on the bridge for. */
enum { HG_GEN = 0, HG_HEALTH };
/* Where a completion is: its Submits' answers, its jobs' ends (non-streaming), the stream. */
enum { PH_SUBMIT = 0, PH_WAIT, PH_STREAM };

/* A request the bridge works for: completions and chat (its jobs), or /health (one Health
 * request, in jobs[0]). Made by the connection's callback, handed to the bridge
 * (http_bridge_submit), from then on freed by the bridge only (after http_bridge_finish). */
typedef struct hgen {
    struct rekv_http *srv;
    struct MHD_Connection *conn;
    int kind;                /* HG_* */
    int fd;                  /* the client's socket, watched while it runs; -1: not watched */
    int chat;
    int stream, include_usage;
    int echo;
    int want_lp;             /* logprobs asked for */
    uint32_t top_lp;         /* top logprobs per token */
    json_t *req;             /* the request's JSON (the Submits point into it) */
    char **stops;            /* [n_stops] into req */
    size_t n_stops;
    char **echo_text;        /* [n_prompts] echo: each prompt's text (malloc'd) */
    int32_t **prompt_ids;    /* [n_prompts] id prompts (malloc'd), else NULL */
    size_t *prompt_n;        /* [n_prompts] their lengths */
    int n_prompts;
    hjob *jobs;
    int n_jobs, n_done;
    char id[48];
    int64_t created;
    hbuf out;       /* stream: SSE bytes not yet given to libmicrohttpd */
    hbuf chunk_head; /* stream: each chunk's opening, up to its choice's index */
    size_t out_off; /* of out, bytes given */
    int ended;      /* stream: [DONE] written */
    /* shared with the bridge, under srv->mu */
    int phase;               /* PH_* */
    int suspended;           /* its connection is suspended until the bridge resumes it */
    int n_answered;          /* Submits answered (accepted or refused) */
    unsigned refuse_status;  /* the first refusal's HTTP status, 0: none */
    char refuse_msg[1100];
    int gone;                /* the bridge saw the client's socket close */
    int health_done;         /* HG_HEALTH: answered (or timed out: health_err) */
    int health_replied;      /* the coordinator answered (else health_err says why not) */
    int health_serving;      /* its answer: serving, with workers connected */
    uint32_t health_workers;
    char health_err[200];
    /* the bridge's own */
    int registered;          /* handed to the bridge (its callbacks no longer free it) */
    int want_new, want_finish; /* what its queue entry asks */
    int queued, touched, watched;            /* in the queue, in this round's touched list,
                                              * its fd in the bridge's epoll set */
    struct hgen *qnext;      /* the bridge's queue of requests to take up */
    struct hgen *prev, *next; /* every request handed over (rekv_http_stop walks them) */
    uint64_t heard_ns;       /* last message for it (its resends wait for silence) */
    uint64_t asked_ns;       /* health: when asked */
} hgen;

enum { HR_NONE = 0, HR_COMPLETIONS, HR_CHAT, HR_MODELS, HR_HEALTH, HR_TOKENIZE, HR_DETOKENIZE };

/* Queues an OpenAI error object {"error":{"message","type","param","code"}} with status. type
 * NULL: chosen from the status; code may be NULL (null in the JSON). */
enum MHD_Result http_error(struct MHD_Connection *c, unsigned status, const char *type,
                           const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* The same error object, not queued (an answer made under srv->mu, queued after: libmicrohttpd
 * calls the content reader, which takes mu, holding a response's mutex, so no call that takes a
 * response's mutex is made under mu). */
json_t *http_error_obj(unsigned status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Queues j (stolen) as JSON with status. */
enum MHD_Result http_json(struct MHD_Connection *c, unsigned status, json_t *j);
/* The same with one more header (hname NULL: none). */
enum MHD_Result http_json_hdr(struct MHD_Connection *c, unsigned status, json_t *j,
                              const char *hname, const char *hval);
/* The HTTP status for a coordinator's refusal. */
unsigned http_status_of_code(Rekv__Control__Code code);

/* Completions and chat completions (http_gen.c): called once the body is complete; then, while
 * r->pending, at each call of the access handler (the bridge resumed the connection). */
enum MHD_Result http_gen_answer(hreq *r);
enum MHD_Result http_gen_continue(hreq *r);
/* The request ended (libmicrohttpd's request-completed notification, however it ended): hands it
 * back to the bridge, which cancels its jobs that have not ended (unless the server stops) and
 * frees it. */
void http_gen_finish(hreq *r);
/* Frees g (its callbacks, before it was handed over; the bridge, after). */
void http_gen_free(hgen *g);
/* A StreamEvent for j (under mu). */
void http_gen_take_event(hgen *g, hjob *j, const Rekv__Control__StreamEvent *ev);
/* 1 when g's connection has something to do (under mu): a response to queue, bytes to stream, or
 * an end (the client gone, the server stopping); else its connection may wait suspended. */
int http_gen_ready(const hgen *g);
/* Under mu: suspends g's connection (from its access handler or content reader) unless
 * http_gen_ready; 1 when suspended. */
int http_gen_wait(hgen *g);

/* The bridge (http_bridge.c): one thread, one DEALER to the coordinator for every request. */
int http_bridge_start(struct rekv_http *h, rekv_err *err);
/* Hands g over (its Submits, or its Health, go out) and suspends its connection; -ESHUTDOWN when
 * the server stops (g stays the caller's). */
int http_bridge_submit(hgen *g);
/* g's request ended (from libmicrohttpd's completion notification). */
void http_bridge_finish(hgen *g);
/* rekv_http_stop's first half: every waiting connection is resumed (to its 503 or its stream's
 * end) and given a moment to go out; nothing is suspended after it. */
void http_bridge_drain(struct rekv_http *h);
/* The second half, after libmicrohttpd stopped: the thread ends, every request is freed. */
void http_bridge_stop(struct rekv_http *h);

#endif
