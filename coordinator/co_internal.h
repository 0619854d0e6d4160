/* co_internal.h — the coordinator server's state, shared by its pieces: the rekv_coordinator
 * struct with its jobs, workers and pending replies, and the functions one piece calls in another.
 * coordinator.c creates it and runs the loop; co_jobs.c holds the job table and the journal,
 * co_workers.c the worker protocol, co_control.c the control protocol, co_stats.c Stats and the
 * metrics. Private to the coordinator (the public API is coordinator.h). */
#ifndef REKV_COORDINATOR_CO_INTERNAL_H
#define REKV_COORDINATOR_CO_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/conncap.h"
#include "common/evloop.h"
#include "common/ratelimit.h"
#include "coordinator/co_plan.h"
#include "coordinator/coordinator.h"
#include "coordinator/journal.h"
#include "common/metrics.h"
#include "loader/loader.h"
#include "proto/worker.pb-c.h"

#define MAX_WORKERS 16
/* Plans a worker holds at once: the one it runs and the next, which it finds waiting when its
 * step ends, so the coordinator's round trip (Progress in, Plan out) is off the step's path. The
 * next is made before the running step's Progress is in: it cannot give a slot that step frees to
 * a new job (that waits one step) and it may still name a job the step finishes (the worker has
 * dropped it: no output); the tokens are the same. */
#define CO_PLANS_OUT 2
#define CO_RETRY_BASE_MS 100 /* a failed attempt's first backoff (co_job_requeue) */
#define CO_ROOM_WAITS_MAX 64 /* runs a job may lose to the kvstore's room (CO_RUN_ROOM): backing
                              * off up to 64 times the base, minutes of waiting */
#define MAX_SUBS 4  /* stream subscribers per job */
#define MAX_RID 256 /* ZeroMQ routing ids are at most 255 bytes */
#define READ_BATCH                                                                                 \
    512 /* control requests read (and journaled with one sync) per round; each                     \
         * gets at most two replies (a repeated streaming Submit) */
#define HASH_BUCKETS 4096
#define CO_STOP_MAX 16          /* Submit.stop: at most this many strings ... */
#define CO_STOP_MAX_BYTES 256   /* ... of 1 to this many bytes each */
#define CO_TOP_LOGPROBS_MAX 20u /* Submit.top_logprobs: at most (OpenAI's limit) */
#define RATE_SLOTS 8 /* one-second samples of the token counter for tokens/s */

/* Log lines a peer can cause once per message: each call site logs at most once a second
 * (co_event_rl), saying how many it held back. */
typedef enum co_rl_site {
    CO_RL_WORKER_MALFORMED, /* a message on the worker socket we cannot read */
    CO_RL_CONN_CAP,         /* a request on a connection over --max-clients */
    CO_RL_WORKER_SEND,      /* a send to a worker failed */
    CO_RL_WORKER_REFUSED,   /* a Hello refused */
    CO_RL_WORKER_HELLO,     /* a Hello's max_batch capped */
    CO_RL_WORKER_REPLY,     /* a Progress with tokens outside the vocabulary */
    CO_RL_HYBRID_PATTERN,   /* a hybrid worker's joining sequences get another KV:ACT pattern */
    CO_RL_WORKER_NAME,      /* a Hello under an active worker's name, held till decided */
    CO_RL_COUNT
} co_rl_site;

typedef struct rid {
    uint8_t b[MAX_RID]; /* routing id bytes */
    size_t n;           /* length */
} rid;

typedef struct sub {
    rid to;        /* the client's routing id */
    uint64_t id;   /* the request id its events carry */
    uint32_t from; /* the first token it still needs (Submit.stream_from) */
} sub;

typedef struct job {
    uint64_t id;
    Rekv__Control__JobState state;
    int32_t *prompt; /* [n_prompt] token ids; NULL for jobs replayed finished */
    uint32_t n_prompt;
    uint32_t cached_tokens; /* prompt tokens the last start took from the prefix cache */
    float temperature; /* sampling, as submitted */
    uint32_t top_k;
    float top_p;
    uint64_t seed;
    uint32_t max_new; /* max_new_tokens */
    int stop_at_eos;
    int32_t priority; /* higher first */
    uint64_t order;   /* arrival order among equal priorities */
    int32_t *gen;     /* [n_gen] generated ids (capacity cap_gen) */
    uint32_t n_gen, cap_gen;
    uint32_t top_logits;     /* k: the k largest logits before each generated token; 0 none */
    int32_t *top_ids;        /* [n_gen][top_logits] (capacity cap_gen) */
    float *top_vals;         /* [n_gen][top_logits] */
    int logprobs;            /* Submit.logprobs: each generated token's log-probability ... */
    uint32_t top_logprobs;   /* ... and the k most likely tokens' (0: none) */
    float *lp;               /* [n_gen] (capacity cap_gen) when logprobs */
    int32_t *tlp_ids;        /* [n_gen][top_logprobs] most likely first */
    float *tlp_vals;         /* [n_gen][top_logprobs] their log-probabilities */
    uint32_t streamed;       /* tokens already sent to subscribers: a re-run resends none of them */
    char **stop;             /* [n_stop] Submit.stop (each malloc'd, NUL-terminated); kept for
                              * the job's life, so that a late subscriber's text is held back
                              * as the first one's was */
    uint32_t n_stop;
    char *text; /* RUNNING with stops: decoded text of gen[0, text_tokens) (malloc'd,
                 * capacity text_cap), where stops are looked for */
    size_t text_len, text_cap;
    uint32_t text_tokens;
    uint32_t text_end;       /* finish_reason "stop": JobStatus.text is the first text_end bytes of
                              * the decoded ids (journaled: JournalRecord.text_end) */
    size_t stream_bytes;     /* with stops: bytes of the text sent to subscribers with the first
                              * `streamed` tokens */
    char finish_reason[16];  /* "length", "eos", "context", "cancelled" */
    char *error;             /* FAILED: one line (malloc'd) */
    uint32_t attempts;       /* starts on a worker */
    uint32_t store_losses;   /* runs that ended on the worker's kvstore loss (CO_RUN_STORE_LOST).
                              * Not journaled: a coordinator restart forgets them */
    uint32_t room_waits;     /* runs that ended on the kvstore's room (CO_RUN_ROOM); the same */
    int worker;              /* index in workers[] while RUNNING, else -1 */
    int kv_parts, act_parts; /* RUNNING on a hybrid worker: the KV:ACT pattern its sequence was
                              * made with, the one admission charges it at */
    double accepted_at;      /* CLOCK_REALTIME s */
    uint64_t start_ns;       /* last start (monotonic) */
    uint64_t end_ns;         /* end (monotonic); 0 while unfinished */
    double queued_s;         /* acceptance to first start; < 0 until started */
    double first_token_s;    /* acceptance to the first generated token; < 0 until it came */
    uint32_t timed;          /* tokens whose latency went into the TTFT/inter-token histograms:
                              * a re-run's tokens below it were seen before and are not timed */
    uint64_t last_token_ns;  /* when the last timed token came (monotonic); 0: none yet */
    sub subs[MAX_SUBS];
    int n_subs;
    int queued_pos;     /* index in the queue while QUEUED, else -1 */
    char waiting[200];  /* QUEUED: why admission holds it back (JobStatus.waiting); "" otherwise */
    uint64_t retry_at_ns; /* QUEUED after a failed attempt: not run again before (co_job_requeue) */
    struct job *hnext;  /* hash chain */
    char *key;          /* Submit.client_key (malloc'd), NULL when none */
    struct job *knext;  /* key hash chain */
    int unsynced;       /* accepted this round, its record not yet synced */
    int end_pending;    /* ended, its finished record not yet synced: not reported yet */
    uint64_t mark;      /* the Progress that last named it (co->progress_mark) */
    uint64_t join_step; /* RUNNING: the step of its worker it joined in */
    struct job *pnext;  /* list of jobs with end_pending, in the order they ended */
} job;

typedef struct worker {
    int active; /* slot in use */
    rid id;     /* routing id on the worker socket */
    char name[64], backend[16], mode[16];
    uint32_t max_batch, vocab, max_pos;
    int32_t eos_id;
    uint64_t last_seen_ns; /* last message of any kind */
    uint64_t pid;          /* its Hello's */
    rid claim_id;          /* another worker that said Hello under this one's name (co_workers.c) */
    uint64_t claim_ns;     /* when; 0: none pending */
    uint32_t out;          /* Plans sent whose Progress is not back: at most CO_PLANS_OUT */
    uint64_t step;         /* number of the last Plan sent; the oldest out is step - out + 1 */
    uint64_t store_lost_upto; /* the last Plan out when the worker said its kvstore was lost: it
                               * dropped its batch with the store, so a Progress up to that step
                               * missing a job lost it with the store — even one that comes once
                               * the store is back (0: none) */
    uint64_t plan_sent_ns[CO_PLANS_OUT]; /* when Plan s went out, at s % CO_PLANS_OUT */
    uint64_t progress_ns;                /* when its last Progress came */
    co_plan_pred pred[CO_PLANS_OUT]; /* the planner's prediction for Plan s, at s % CO_PLANS_OUT */
    job **run;                       /* [max_batch] jobs in its batch */
    uint32_t n_run;
    uint64_t *cancel; /* [max_batch] jobs to drop at its next Plan */
    uint32_t n_cancel;
    char unavailable[256]; /* non-empty: it cannot run steps now, and why (WorkerMsg); no Plans */
    uint64_t steps, tokens;
    co_plan_state plan;                /* the planner's state for this worker (co_plan.h) */
    int made_kv_parts, made_act_parts; /* hybrid: the pattern of the last jobs it was sent (for
                                        * the log line when it changes) */
    /* its kvstore's prefix cache counters as it last said (StoreRoom prefix_*: lookups, hit
     * tokens, hit blocks on host and on disk, evictions, bytes read back), for Stats */
    uint64_t store_prefix[6];
} worker;

typedef struct reply {
    rid to;       /* routing id */
    uint8_t *buf; /* packed Response */
    size_t len;
    uint64_t req_id; /* the request's id */
    job *accepted;   /* a Submit waiting for the journal sync, else NULL */
    int dup;         /* accepted is another request's job (a repeated client key) */
} reply;

struct rekv_coordinator {
    rekv_coordinator_config cfg;
    char control_ep[4200], worker_ep[4200];
    char inproc_ep[64]; /* the control ROUTER's in-process endpoint (the HTTP server's) */
    char control_path[4200], worker_path[4200]; /* ipc socket files, "" otherwise */
    void *zctx, *ctl, *wrk;
    rekv_conncap *ctl_cap, *wrk_cap; /* connection counts of ctl and wrk (common/conncap.h) */
    rekv_evloop *loop;               /* the event loop (coordinator.c) */
    rekv_journal *journal;           /* NULL without a state_dir */
    rekv_tokenizer *tok;             /* text prompts, with_text; NULL without one */
    rekv_model_config mcfg;          /* valid when have_model */
    int have_model;
    char model_name[4096]; /* the model's absolute path (Health.model), when --model */

    job *hash[HASH_BUCKETS];
    job *khash[HASH_BUCKETS]; /* jobs with a client key, by the key's hash */
    job *pend_head;           /* ended jobs waiting for the journal sync (job.pnext) */
    job **pend_tail;
    job **queue; /* QUEUED jobs, unordered (picked by priority, then order) */
    uint32_t n_queue, cap_queue;
    job **finished; /* ring of finished jobs kept for Status, oldest first */
    uint32_t fin_head, n_fin;
    uint64_t
        fin_bytes; /* their results' bytes (co_job_result_bytes), at most keep_finished_bytes */
    uint64_t next_id, next_order;
    worker workers[MAX_WORKERS];
    uint64_t session;

    reply *replies; /* this round's replies [READ_BATCH] */
    size_t n_replies;

    /* counters */
    uint64_t n_running, n_done, n_cancelled, n_failed, accepted, rejected_busy, bad_requests,
        requeued, tokens, steps;
    uint64_t evicted;          /* finished jobs forgotten (keep_finished, keep_finished_bytes) */
    uint64_t worker_malformed; /* worker-socket messages we could not read */
    uint64_t worker_rejected;  /* job results refused (tokens outside the vocabulary) */
    uint64_t progress_mark;    /* numbers the Progress messages (job.mark) */
    uint64_t steps_failed;     /* steps a worker reported failed as a whole, or never finished */
    uint64_t held_for_room;    /* jobs admission held back for kvstore room (once each) */
    uint64_t prefix_priced;    /* starts priced less the prompt blocks a running job holds */
    uint64_t too_large;        /* jobs failed: their KV is larger than the whole store */
    rekv_ratelimit rl[CO_RL_COUNT];
    double rtt_sum, wstep_sum;
    /* the metrics port's histograms, in seconds (rekv_metrics_latency_bounds) */
    rekv_metrics_hist h_ttft;     /* acceptance to the job's first token */
    rekv_metrics_hist h_itl;      /* between a job's consecutive tokens */
    rekv_metrics_hist h_queue;    /* acceptance to the job's first start on a worker */
    rekv_metrics_hist h_step;     /* a step as the worker timed it (Progress.step_s) */
    rekv_metrics_hist h_step_rtt; /* a step's Progress, from when the worker could start it */
    uint64_t counters[8];         /* h2d weights, kv, act, d2h, recomputed, fetched; infinigen's
                                   * considered and selected (Counters) */
    uint64_t rate_tokens[RATE_SLOTS];
    uint64_t rate_ns[RATE_SLOTS];
    uint32_t rate_i;
    uint64_t start_ns;
    rekv_metrics_server *metrics; /* the scrape port; NULL when not configured */
    int lock_fd[3]; /* flock'd: <control socket>.lock, <worker socket>.lock, <state_dir>/lock */
};

/* ---------------------------------------------------------------- coordinator.c */

/* Reports a notable event through cfg.on_event (a no-op without one). */
void co_event(rekv_coordinator *co, rekv_co_event lvl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* co_event at most once a second for this call site, with "(N similar messages suppressed)"
 * when lines were held back since the last one. */
void co_event_rl(rekv_coordinator *co, co_rl_site site, rekv_co_event lvl, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* CLOCK_REALTIME in seconds (when a job was accepted). */
double co_realtime_s(void);
/* Sends one message to a peer of a ROUTER socket without blocking; 0 or -errno. */
int co_send_to(void *sock, const rid *to, const void *buf, size_t len);

/* ---------------------------------------------------------------- co_jobs.c */

job *co_job_find(rekv_coordinator *co, uint64_t id);
job *co_job_new(rekv_coordinator *co, uint64_t id);
/* The job remembered under a client key, or NULL. */
job *co_job_by_key(rekv_coordinator *co, const char *key);
/* Gives j the key (copied) and files it under it; 0 or -ENOMEM. */
int co_job_set_key(rekv_coordinator *co, job *j, const char *key);
void co_job_free(rekv_coordinator *co, job *j);
/* Queues a job (QUEUED); 0 or -ENOMEM. */
int co_queue_push(rekv_coordinator *co, job *j);
void co_queue_remove(rekv_coordinator *co, job *j);
job *co_queue_pop(rekv_coordinator *co);
/* The job co_queue_pop would return, left in the queue; NULL when it is empty. */
job *co_queue_peek(rekv_coordinator *co);
/* The next (at most) n jobs co_queue_pop would return, in that order, left in the queue, into
 * out[n]; returns how many. */
size_t co_queue_first(rekv_coordinator *co, job **out, size_t n);
/* Room for n generated tokens (and their top logits, log-probabilities); 0 or -ENOMEM. */
int co_gen_reserve(job *j, uint32_t n);
/* Takes token t of a worker's report into j at n_gen (room reserved, n_gen not advanced): its top
 * logits and log-probabilities, zeros where the worker sent none (never garbage). */
void co_job_put_extras(job *j, const Rekv__Worker__JobProgress *jp, size_t t);
/* 1 when every id of the report's top logits and top log-probabilities is in [0, vocab); else 0
 * with the first one outside in *bad. */
int co_job_extras_valid(const job *j, const Rekv__Worker__JobProgress *jp, uint32_t vocab,
                        int32_t *bad);
/* Ends a job: its finished record is appended, and it is reported (subscribers, the finished
 * ring) only by the next co_jobs_sync, after the record is durable. */
void co_job_end(rekv_coordinator *co, job *j, Rekv__Control__JobState st, const char *reason,
                const char *error);
/* Makes the records appended so far durable (one fdatasync) and then reports the jobs that
 * ended since the last call. Returns 0, or the sync's negative errno (the jobs are reported
 * anyway: the error is logged, and a restart may run them again). */
int co_jobs_sync(rekv_coordinator *co, rekv_err *err);
/* Reports the ended jobs (streams, finished ring) without a sync: the caller synced. */
void co_jobs_report_ended(rekv_coordinator *co);
/* A running job of w ended by the coordinator (Cancel, a stop): w is told to drop it now, ahead of
 * the Plans it holds that name it (worker.proto Drop); the caller also puts it in w->cancel. */
void co_worker_drop(rekv_coordinator *co, worker *w, uint64_t id);
/* How a run that is re-queued ended, which decides whether it used an attempt. */
typedef enum co_run_end {
    CO_RUN_FREE = 0,       /* an innocent bystander of a step another job's lost blocks failed */
    CO_RUN_COUNTS = 1,     /* it counts toward max_attempts (its worker died, the step failed) */
    CO_RUN_STORE_LOST = 2, /* the worker's kvstore was lost: the job's fault no more than the
                            * worker's, so no attempt — but a store that dies under the same job
                            * more than max_attempts times may be dying of it: the job fails */
    CO_RUN_ROOM = 3,       /* the kvstore had no room (-ENOMEM, -ENOSPC) for a job admission let
                            * run: other jobs or a failing spill tier hold it, which passes; no
                            * attempt, but it backs off, and fails after CO_ROOM_WAITS_MAX */
} co_run_end;
void co_job_requeue(rekv_coordinator *co, job *j, const char *why, co_run_end how);
/* The bytes tokens [from, to) of ids add to the decoded text of ids[0, to) (malloc'd into *out,
 * *n bytes): decode(ids[a, to)) less decode(ids[a, from)) for a few tokens of context a..from,
 * which the tokenizer makes equal to decoding all of them (co_jobs.c). 0 or -errno. */
int co_text_added(const rekv_tokenizer *tok, const int32_t *ids, uint32_t from, uint32_t to,
                  char **out, size_t *n);
/* Takes Submit.stop into j (copied); 0 or -ENOMEM. */
int co_job_set_stops(job *j, char *const *stop, size_t n);
/* With stops: the generated ids past j->text_tokens into its text, a token at a time; when a
 * token completes a stop, n_gen ends at it, text_end is set and 1 is returned (the caller ends
 * the job, "stop"). 0: no stop; -errno: the text could not be decoded (no stop is looked for). */
int co_job_stop_check(rekv_coordinator *co, job *j);
/* 1 when j's text is held back for stops (it has stops, or ended on one after a replay). */
int co_job_stop_text(const job *j);
/* With co_job_stop_text: the decoded text of gen[0, upto) in *text (malloc'd; *len bytes) and
 * how many of its bytes clients may see: all but the end that could still begin a stop, for a
 * running job; up to the stop, for one that ended on it; all, for one that ended otherwise at
 * upto == n_gen. -errno when the ids do not decode. */
int co_job_text_shown(rekv_coordinator *co, const job *j, uint32_t upto, char **text, size_t *len,
                      size_t *shown);
/* A job's JobStatus, pointing into the job (valid while it lives). */
void co_status_fill(const job *j, Rekv__Control__JobStatus *s);
/* Appends an accepted job's record (not synced); 0 without a journal. */
int co_journal_accepted(rekv_coordinator *co, job *j, rekv_err *err);
/* The rekv_journal_fn of the replay on start (ctx: the coordinator). */
int co_replay_fn(void *ctx, const Rekv__Control__JournalRecord *rec);
int co_journal_compact(rekv_coordinator *co, rekv_err *err);

/* ---------------------------------------------------------------- co_workers.c */

void co_send_worker(rekv_coordinator *co, worker *w, Rekv__Worker__CoordMsg *m);
/* Reads one message from the worker socket and acts on it. */
void co_handle_worker_msg(rekv_coordinator *co);
void co_schedule(rekv_coordinator *co);
/* Drops the workers silent for worker_timeout_ms, re-queueing their jobs. */
void co_check_workers(rekv_coordinator *co);

/* ---------------------------------------------------------------- co_control.c */

void co_reply_add(rekv_coordinator *co, const rid *to, Rekv__Control__Response *r, job *acc);
void co_stream_flush(rekv_coordinator *co, job *j);
void co_handle_control(rekv_coordinator *co);

/* ---------------------------------------------------------------- co_stats.c */

/* Answers a Stats request. */
void co_do_stats(rekv_coordinator *co, const rid *from, uint64_t rq);
/* The rekv_metrics_render_fn of the metrics port (ctx: the coordinator). */
int co_metrics_render(void *ctx, rekv_metrics_buf *b);

#endif
