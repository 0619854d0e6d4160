/* http_env.h — the HTTP server's tests (test_http*.c): a real coordinator with --http and a cpu
 * gpuworker on docs8L (a byte-level model with a tokenizer, so text prompts work), and a raw
 * HTTP/1.1 client over a TCP socket (no HTTP library of ours or theirs between the test and the
 * server's bytes). */
#ifndef REKV_TESTS_HTTP_ENV_H
#define REKV_TESTS_HTTP_ENV_H

#include <jansson.h>
#include <stddef.h>
#include <sys/types.h>

#include "coordinator/coordinator.h"

#define HX_MODEL_REL "models/docs8L/docs8L.bin"

typedef struct hx_env {
    char *dir;         /* private directory: sockets, logs, state */
    char ctl[4200];    /* the control endpoint */
    char wrk[4200];
    char model[4096];
    char log[4200];    /* the daemons' stderr */
    int port;          /* the HTTP port */
    pid_t co, worker;  /* 0: not running */
} hx_env;

/* Starts the coordinator (--model docs8L, --http 127.0.0.1:PORT, extra: more of its arguments,
 * NULL-terminated, may be NULL) and, when with_worker, a cpu worker, waiting until it serves.
 * Returns -1 when the model is missing (skipped, as tu_shared says). */
int hx_start(hx_env *x, const char *const *extra, int with_worker);
/* The same on another model (a path). */
int hx_start_model(hx_env *x, const char *model, const char *const *extra, int with_worker);
/* A model directory in dir: llama-tiny-py's files (linked) with the chat template of
 * ../shared/chat-templates/<name>.jinja as chat_template.jinja; its path (static storage), or
 * NULL when the files are missing (skipped, as tu_shared says). */
const char *hx_chat_model(const char *dir, const char *name);
void hx_start_worker(hx_env *x);
void hx_stop(hx_env *x);

typedef struct hx_resp {
    int status;  /* 0: no answer (connection closed first) */
    char *head;  /* status line and headers (malloc'd) */
    char *body;  /* the body, de-chunked, NUL-terminated (malloc'd) */
    size_t n;    /* its bytes */
} hx_resp;

/* A TCP connection to 127.0.0.1:port (fails the test when it cannot connect). */
int hx_connect(int port);
/* Sends a request (HTTP/1.1, Connection: close; headers: extra header lines each ending in
 * "\r\n", or NULL; body NULL: none) on a new connection and reads the whole answer. */
void hx_request(int port, const char *method, const char *path, const char *headers,
                const char *body, hx_resp *r);
/* Reads an answer from fd until EOF into r. */
void hx_read_answer(int fd, hx_resp *r);
void hx_resp_free(hx_resp *r);
/* The body as JSON (fails the test when it is not). */
json_t *hx_json(const hx_resp *r);
/* POST path with a JSON body; the answer's JSON (status in *status). */
json_t *hx_post(int port, const char *path, const char *body, int *status);
/* Checks that r is an OpenAI error object with status and (when type != NULL) that type. */
void hx_expect_error(const hx_resp *r, int status, const char *type);

/* The control socket of x (tu_ctl_open). */
rekv_ctl *hx_ctl(hx_env *x);

#endif
