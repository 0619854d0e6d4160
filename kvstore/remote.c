/* remote.c — the kvstore's remote tier: the prefix cache's entries shared through a Redis (or
 * Valkey) that several replicas of one model point at (--remote), so that one replica's prefix
 * is read back by another instead of computed again — LMCache's Redis backend, for rekv's
 * chain keys.
 *
 * Data flow. Two threads, each with its own hiredis connection (blocking calls with
 * --remote-timeout-ms as the socket timeout), and the store's loop, which never waits for
 * either:
 *   write-through: a new entry (prefix.c publish_new) whose blocks are all in memory is queued
 *   with a hold and a reference on each block (so nothing spills, evicts or frees them), bounded
 *   (PUT_MAX_ITEMS entries, held blocks at most PUT_MAX_BYTES and an eighth of the arena; past
 *   either it is dropped and counted); the writer thread first copies each queued entry's bytes
 *   out of the arena into its value (header, CRC32C) and hands the holds back through the
 *   eventfd (the loop lets go of them), then sends the values pipelined as SET key value EX ttl.
 *   The loop copies nothing. A write Redis refuses (OOM under noeviction, ...) is counted and
 *   forgotten.
 *   read-back: a CreateSeq or Lookup whose chain stops at a key not held here (prefix.c
 *   srv_cache_fetch) queues one MGET of the keys that follow and parks; the reader thread sends
 *   it, checks each value (header, CRC32C) and hands the reply back through an eventfd the loop
 *   polls; the loop adopts the intact ones, in chain order, into free arena slots
 *   (srv_cache_adopt_host) and runs the parked requests again, which then match them like any
 *   local entry. A deadline timer lets a request whose answer is later than --remote-timeout-ms
 *   go on with what is local (a late answer is still adopted, for the next request).
 * Redis down: a failed connection backs off (100 ms doubling to 5 s); while it does, reads are
 * not asked (the request answers at once) and writes are dropped, so a dead Redis costs a job
 * nothing but the blocks it computes.
 *
 * Keys: "rekv:ROOT:{FIRST}:KEY", hex: ROOT the chain's root (the model's fingerprint, the
 * geometry and the cache dtype, prefix.c key_root) so replicas of different models never mix,
 * KEY the position's chain key, and FIRST the chain's first-block key as the Redis Cluster hash
 * tag: every key of one sequence's chain hashes to one slot, so its MGET is one node's (Cluster
 * refuses a multi-key command across slots). The cost: a popular first block (a shared system
 * prompt) puts all its continuations on one node.
 *
 * Values: a remote_hdr (magic, version, kind, layers, bytes per layer, root, key, parent, the
 * 16 token ids, CRC32C of header and payload with the crc field zeroed), then every layer's
 * block bytes, layer 0 first — the arena's layout of a block, host byte order (replicas share an
 * architecture; another's magic does not match). A read is taken only when every field is what
 * a local match would check. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include <hiredis/hiredis.h>

#include "common/clock.h"
#include "common/crc32c.h"
#include "common/log.h"
#include "kvstore/remote.h"
#include "kvstore/server_internal.h"

#define REMOTE_MAGIC 0x52564b52u /* "RKVR" */
#define REMOTE_VERSION 1
#define PUT_MAX_ITEMS 4096
#define PUT_MAX_BYTES (256ull << 20) /* and at most an eighth of the arena */
#define PUT_PIPELINE 32
#define GET_MAX_KEYS 256
#define GET_MAX_BYTES (64ull << 20)
#define BACKOFF_MIN_MS 100
#define BACKOFF_MAX_MS 5000
#define KEY_LEN 64

typedef struct remote_hdr {
    uint32_t magic;
    uint16_t version;
    uint8_t kind; /* rekv_kv_block_type */
    uint8_t pad;
    uint32_t n_layers, layer_bytes;
    uint64_t root, key, parent;
    uint32_t tokens[REKV_KV_BLOCK_TOKENS];
    uint32_t crc; /* CRC32C of this header (crc 0) and the payload */
    uint32_t pad2;
} remote_hdr;
_Static_assert(sizeof(remote_hdr) == 112, "remote_hdr is a wire format");

/* Blocks the loop holds (kv_block.holds) so that nothing spills, evicts or frees them before
 * the writer thread has copied them: handed back to the loop, which lets go. */
typedef struct put_hold {
    struct put_hold *next;
    size_t bytes; /* arena bytes held */
    uint32_t n;
    uint32_t ids[];
} put_hold;

typedef struct put_item {
    struct put_item *next;
    char key[KEY_LEN];
    remote_hdr hdr;      /* its crc is the writer's */
    const uint8_t **src; /* [hdr.n_layers] each layer's block in the arena, held */
    put_hold *hold;
    uint8_t *val; /* the value, made by the writer */
    size_t len;
} put_item;

typedef struct get_job {
    struct get_job *next;  /* the reader's queue, then the done list */
    struct get_job *lnext; /* the loop's in-flight list (until the loop has applied it) */
    uint64_t id, deadline_ns, root;
    int expired; /* the loop: its requests went on without it */
    size_t n;
    kv_remote_want *want;  /* [n] */
    char (*keys)[KEY_LEN]; /* [n] */
    uint32_t n_layers;     /* the store's, and each kind's block bytes: what a value must have */
    size_t layer_bytes[2];
    redisReply *reply; /* the reader: an array of n, or NULL with err */
    int *check;        /* [n] the reader's check of each value: 0 intact, 1 none (nil), -EBADMSG
                        * (its CRC32C), -EPROTO (not this block's value) */
    int err;
} get_job;

/* One thread's connection: reconnects after a backoff. */
typedef struct conn {
    redisContext *c;
    uint64_t retry_ns;
    uint32_t backoff_ms;
    int used; /* a command succeeded on c */
} conn;

struct kv_remote {
    kv_remote_url url;
    struct timeval tv;
    uint32_t timeout_ms, ttl_s;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    put_item *put_head, *put_tail; /* to the writer */
    size_t put_n;
    get_job *get_head, *get_tail; /* to the reader */
    get_job *done_head;           /* back to the loop */
    put_hold *released;           /* copied: back to the loop */
    int stop;
    char last_err[256]; /* the threads' last failure, for the loop's log */
    pthread_t reader, writer;
    int n_threads; /* started: 0, 1 (reader) or 2 */
    int efd, efd_id, timer_id;
    _Atomic uint64_t down_until; /* ns: a connection failed, back off until then */
    get_job *inflight;           /* the loop's */
    uint64_t next_id;
    uint32_t n_waiting; /* of inflight, those not expired: the timer is set while any is */
    size_t held_bytes;  /* arena bytes of the blocks queued writes hold */
    /* the loop's counters */
    uint64_t gets, hit_blocks, miss_blocks, read_bytes, timeouts, crc_errors, get_errors;
    uint64_t logged_errors;
    /* the threads' */
    _Atomic uint64_t queued, written, dropped, put_errors, errors_seen;
};

/* ------------------------------------------------------------------ URL */

static int parse_db(const char *p, int *db)
{
    char *end;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (*p == '\0' || *end != '\0' || errno || v < 0 || v > 65535)
        return -EINVAL;
    *db = (int)v;
    return 0;
}

int kv_remote_url_parse(const char *url, kv_remote_url *out, rekv_err *err)
{
    memset(out, 0, sizeof(*out));
    if (strncmp(url, "unix://", 7) == 0) {
        const char *path = url + 7, *q = strchr(path, '?');
        size_t n = q ? (size_t)(q - path) : strlen(path);
        if (n == 0 || path[0] != '/' || n >= sizeof(out->path))
            return rekv_errf(err, -EINVAL,
                             "--remote %s: unix://PATH needs an absolute path shorter than %zu "
                             "bytes",
                             url, sizeof(out->path));
        if (q && (strncmp(q, "?db=", 4) != 0 || parse_db(q + 4, &out->db) < 0))
            return rekv_errf(err, -EINVAL, "--remote %s: after the path only ?db=N", url);
        memcpy(out->path, path, n);
        out->is_unix = 1;
        return 0;
    }
    if (strncmp(url, "redis://", 8) != 0)
        return rekv_errf(err, -EINVAL,
                         "--remote %s: expected redis://HOST:PORT[/DB] or unix:///PATH[?db=N] "
                         "(no TLS, no password)",
                         url);
    const char *h = url + 8, *he, *rest;
    if (*h == '[') { /* an IPv6 address */
        he = strchr(h, ']');
        if (he == NULL)
            return rekv_errf(err, -EINVAL, "--remote %s: no ']' after the IPv6 address", url);
        h++;
        rest = he + 1;
    } else {
        he = h + strcspn(h, ":/");
        rest = he;
    }
    size_t hn = (size_t)(he - h);
    if (hn == 0 || hn >= sizeof(out->host) || memchr(h, '@', hn))
        return rekv_errf(err, -EINVAL, "--remote %s: bad host", url);
    memcpy(out->host, h, hn);
    out->port = 6379;
    if (*rest == ':') {
        char *end;
        errno = 0;
        long port = strtol(rest + 1, &end, 10);
        if (end == rest + 1 || errno || port < 1 || port > 65535 || (*end && *end != '/'))
            return rekv_errf(err, -EINVAL, "--remote %s: bad port", url);
        out->port = (int)port;
        rest = end;
    }
    if (*rest == '/' && rest[1] && parse_db(rest + 1, &out->db) < 0)
        return rekv_errf(err, -EINVAL, "--remote %s: the database is a number", url);
    if (*rest && *rest != '/')
        return rekv_errf(err, -EINVAL, "--remote %s: unexpected '%s'", url, rest);
    return 0;
}

/* ------------------------------------------------------------------ connections (threads) */

static void note_error(kv_remote *r, const char *what, const char *msg)
{
    pthread_mutex_lock(&r->mu);
    snprintf(r->last_err, sizeof(r->last_err), "%s: %s", what, msg);
    pthread_mutex_unlock(&r->mu);
    atomic_fetch_add(&r->errors_seen, 1);
}

static void conn_drop(kv_remote *r, conn *cn)
{
    if (cn->c)
        redisFree(cn->c);
    cn->c = NULL;
    cn->backoff_ms = cn->backoff_ms ? cn->backoff_ms * 2 : BACKOFF_MIN_MS;
    if (cn->backoff_ms > BACKOFF_MAX_MS)
        cn->backoff_ms = BACKOFF_MAX_MS;
    cn->retry_ns = rekv_now_ns() + (uint64_t)cn->backoff_ms * 1000000ull;
    atomic_store(&r->down_until, cn->retry_ns);
}

/* After a failed command on cn (e: errno right after it): 1 when the server had closed a
 * connection that worked before (Redis restarted, or its idle timeout), which is then closed for
 * the caller to connect again at once and retry; else 0 (a timeout, a refused connection: the
 * caller backs off). */
static int conn_reopen(conn *cn, int e)
{
    int closed = cn->c->err == REDIS_ERR_EOF ||
                 (cn->c->err == REDIS_ERR_IO && (e == EPIPE || e == ECONNRESET));
    if (!cn->used || !closed)
        return 0;
    redisFree(cn->c);
    cn->c = NULL;
    cn->used = 0;
    return 1;
}

/* 0 with a connection, else -ECONNREFUSED (backing off). */
static int conn_ensure(kv_remote *r, conn *cn)
{
    if (cn->c)
        return 0;
    if (rekv_now_ns() < cn->retry_ns)
        return -ECONNREFUSED;
    cn->c = r->url.is_unix ? redisConnectUnixWithTimeout(r->url.path, r->tv)
                           : redisConnectWithTimeout(r->url.host, r->url.port, r->tv);
    if (cn->c == NULL || cn->c->err || redisSetTimeout(cn->c, r->tv) != REDIS_OK) {
        note_error(r, "connect", cn->c ? cn->c->errstr : "out of memory");
        conn_drop(r, cn);
        return -ECONNREFUSED;
    }
    if (r->url.db) {
        redisReply *rp = redisCommand(cn->c, "SELECT %d", r->url.db);
        int ok = rp && rp->type == REDIS_REPLY_STATUS;
        if (!ok)
            note_error(r, "SELECT", rp ? rp->str : cn->c->errstr);
        if (rp)
            freeReplyObject(rp);
        if (!ok) {
            conn_drop(r, cn);
            return -ECONNREFUSED;
        }
    }
    cn->backoff_ms = 0;
    atomic_store(&r->down_until, 0);
    return 0;
}

/* ------------------------------------------------------------------ the threads */

static uint32_t value_crc(remote_hdr h, const uint8_t *payload, size_t n);

/* Makes the values of items[0..n) from the arena and hands their holds back to the loop; an
 * item whose value cannot be allocated is dropped (NULL in items). */
static void copy_puts(kv_remote *r, put_item **items, int n)
{
    put_hold *back = NULL;
    for (int i = 0; i < n; i++) {
        put_item *it = items[i];
        const remote_hdr *h = &it->hdr;
        size_t lb = h->layer_bytes;
        it->len = sizeof(*h) + (size_t)h->n_layers * lb;
        if ((it->val = malloc(it->len)) != NULL) {
            uint8_t *payload = it->val + sizeof(*h);
            for (uint32_t l = 0; l < h->n_layers; l++)
                memcpy(payload + (size_t)l * lb, it->src[l], lb);
            it->hdr.crc = value_crc(*h, payload, (size_t)h->n_layers * lb);
            memcpy(it->val, &it->hdr, sizeof(*h));
        }
        it->hold->next = back;
        back = it->hold;
        it->hold = NULL;
    }
    pthread_mutex_lock(&r->mu);
    while (back) {
        put_hold *h = back;
        back = h->next;
        h->next = r->released;
        r->released = h;
    }
    uint64_t one = 1;
    ssize_t wr = write(r->efd, &one, sizeof(one));
    (void)wr;
    pthread_mutex_unlock(&r->mu);
}

/* Whether v (len bytes) is the value job j asked for at position i, intact: 0, or -EBADMSG (its
 * CRC32C) or -EPROTO (another block's header, or not one). */
static int value_check(const get_job *j, size_t i, const uint8_t *v, size_t len)
{
    const kv_remote_want *w = &j->want[i];
    remote_hdr h;
    uint32_t L = j->n_layers;
    size_t lb = j->layer_bytes[w->kind == REKV_KV_BLOCK_KV ? 0 : 1];
    if (len != sizeof(h) + (size_t)L * lb)
        return -EPROTO;
    memcpy(&h, v, sizeof(h));
    if (h.magic != REMOTE_MAGIC || h.version != REMOTE_VERSION || h.kind != w->kind ||
        h.n_layers != L || h.layer_bytes != lb || h.root != j->root || h.key != w->key ||
        h.parent != w->parent || memcmp(h.tokens, w->tokens, sizeof(h.tokens)) != 0)
        return -EPROTO;
    if (value_crc(h, v + sizeof(h), (size_t)L * lb) != h.crc)
        return -EBADMSG;
    return 0;
}

static void run_get(kv_remote *r, conn *cn, get_job *j)
{
    if (rekv_now_ns() > j->deadline_ns) { /* its requests went on long ago: skip it */
        j->err = -ETIMEDOUT;
        return;
    }
    const char **argv = malloc(sizeof(char *) * (j->n + 1));
    size_t *lens = malloc(sizeof(size_t) * (j->n + 1));
    if (argv == NULL || lens == NULL) {
        free(argv);
        free(lens);
        j->err = -ENOMEM;
        return;
    }
    argv[0] = "MGET";
    lens[0] = 4;
    for (size_t i = 0; i < j->n; i++) {
        argv[i + 1] = j->keys[i];
        lens[i + 1] = strlen(j->keys[i]);
    }
    redisReply *rp = NULL;
    for (int tries = 0;; tries++) {
        if ((j->err = conn_ensure(r, cn)) < 0)
            break;
        rp = redisCommandArgv(cn->c, (int)j->n + 1, argv, lens);
        if (rp || tries > 0 || !conn_reopen(cn, errno))
            break;
    }
    free(argv);
    free(lens);
    if (j->err < 0)
        return;
    if (rp == NULL) { /* I/O error or the timeout: the connection is unusable */
        j->err = cn->c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK)
                     ? -ETIMEDOUT
                     : -EIO;
        note_error(r, "MGET", cn->c->errstr);
        conn_drop(r, cn);
        return;
    }
    if (rp->type != REDIS_REPLY_ARRAY || rp->elements != j->n) {
        note_error(r, "MGET", rp->type == REDIS_REPLY_ERROR ? rp->str : "not an array of values");
        freeReplyObject(rp);
        j->err = -EIO;
        return;
    }
    cn->used = 1;
    j->reply = rp;
    for (size_t i = 0; i < j->n; i++) { /* checked here: the loop only copies what is intact */
        const redisReply *v = rp->element[i];
        j->check[i] = v->type == REDIS_REPLY_NIL ? 1
                      : v->type == REDIS_REPLY_STRING
                          ? value_check(j, i, (const uint8_t *)v->str, v->len)
                          : -EPROTO;
    }
}

static void *reader_main(void *arg)
{
    kv_remote *r = arg;
    conn cn = {0};
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        get_job *j = r->get_head;
        if (j == NULL) {
            pthread_cond_wait(&r->cv, &r->mu);
            continue;
        }
        r->get_head = j->next;
        if (r->get_head == NULL)
            r->get_tail = NULL;
        pthread_mutex_unlock(&r->mu);
        run_get(r, &cn, j);
        pthread_mutex_lock(&r->mu);
        j->next = r->done_head; /* the loop applies them in any order: each stands alone */
        r->done_head = j;
        uint64_t one = 1;
        ssize_t wr = write(r->efd, &one, sizeof(one));
        (void)wr; /* a full counter is still readable */
    }
    pthread_mutex_unlock(&r->mu);
    if (cn.c)
        redisFree(cn.c);
    return NULL;
}

/* Sends items[0..n) pipelined; counts each as written or failed. */
/* Sends the values of items[0..n) pipelined (a connection the server had closed is opened again
 * once); counts each as written, failed or dropped. */
static void run_puts(kv_remote *r, conn *cn, put_item **items, int n)
{
    char ttl[16];
    snprintf(ttl, sizeof(ttl), "%u", r->ttl_s);
    int sent = 0;
    for (int i = 0; i < n; i++)
        sent += items[i]->val != NULL;
    atomic_fetch_add(&r->dropped, (uint64_t)(n - sent)); /* no memory for their values */
    for (int tries = 0;; tries++) {
        if (conn_ensure(r, cn) < 0) {
            atomic_fetch_add(&r->dropped, (uint64_t)sent);
            return;
        }
        for (int i = 0; i < n; i++) {
            if (items[i]->val == NULL)
                continue;
            const char *argv[5] = {"SET", items[i]->key, (const char *)items[i]->val, "EX", ttl};
            size_t lens[5] = {3, strlen(items[i]->key), items[i]->len, 2, strlen(ttl)};
            redisAppendCommandArgv(cn->c, 5, argv, lens);
        }
        int again = 0;
        for (int k = 0; k < sent && !again; k++) {
            void *v = NULL;
            if (redisGetReply(cn->c, &v) != REDIS_OK) {
                if (k == 0 && tries == 0 && conn_reopen(cn, errno)) {
                    again = 1; /* nothing of the batch went through: all of it again */
                    break;
                }
                note_error(r, "SET", cn->c->errstr);
                atomic_fetch_add(&r->put_errors, (uint64_t)(sent - k));
                conn_drop(r, cn);
                return;
            }
            cn->used = 1;
            redisReply *rp = v;
            if (rp->type == REDIS_REPLY_ERROR) { /* OOM under noeviction, READONLY, ... */
                note_error(r, "SET", rp->str);
                atomic_fetch_add(&r->put_errors, 1);
            } else {
                atomic_fetch_add(&r->written, 1);
            }
            freeReplyObject(rp);
        }
        if (!again)
            return;
    }
}

static void *writer_main(void *arg)
{
    kv_remote *r = arg;
    conn cn = {0};
    put_item *batch[PUT_PIPELINE];
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        if (r->put_head == NULL) {
            pthread_cond_wait(&r->cv, &r->mu);
            continue;
        }
        int n = 0;
        while (n < PUT_PIPELINE && r->put_head) {
            put_item *it = r->put_head;
            r->put_head = it->next;
            r->put_n--;
            batch[n++] = it;
        }
        if (r->put_head == NULL)
            r->put_tail = NULL;
        pthread_mutex_unlock(&r->mu);
        copy_puts(r, batch, n); /* first: the loop gets its blocks back before any network wait */
        run_puts(r, &cn, batch, n);
        for (int i = 0; i < n; i++) {
            free(batch[i]->val);
            free(batch[i]->src);
            free(batch[i]);
        }
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    if (cn.c)
        redisFree(cn.c);
    return NULL;
}

/* ------------------------------------------------------------------ the loop's side */

static void key_of(char *out, uint64_t root, uint64_t first, uint64_t key)
{
    snprintf(out, KEY_LEN, "rekv:%016" PRIx64 ":{%016" PRIx64 "}:%016" PRIx64, root, first, key);
}

static size_t layer_bytes_of(const rekv_kvstore_server *s, int kind)
{
    return kind == REKV_KV_BLOCK_KV ? s->arena.hdr->kv_block_bytes : s->arena.hdr->act_block_bytes;
}

static uint32_t value_crc(remote_hdr h, const uint8_t *payload, size_t n)
{
    h.crc = 0;
    return rekv_crc32c(rekv_crc32c(0, &h, sizeof(h)), payload, n);
}

static int remote_down(const kv_remote *r)
{
    uint64_t until = atomic_load(&r->down_until);
    return until && rekv_now_ns() < until;
}

void srv_remote_put(rekv_kvstore_server *s, uint32_t i, uint64_t root, uint64_t first)
{
    kv_remote *r = s->remote;
    const kv_centry *e = &s->centries[i];
    uint32_t L = s->cfg.geometry.n_layers;
    size_t lb = layer_bytes_of(s, e->kind), held = (size_t)L * lb;
    size_t arena = (size_t)s->hs.n_big * s->hs.big_bytes;
    int resident = 1;
    for (uint32_t l = 0; l < L; l++)
        resident &= s->blocks[e->ids[l]].state == BS_HOST;
    pthread_mutex_lock(&r->mu);
    int room = r->put_n < PUT_MAX_ITEMS;
    pthread_mutex_unlock(&r->mu);
    /* what queued writes hold stays a small part of the arena: a slow Redis never takes the
     * room running sequences need */
    room &= r->held_bytes + held <= PUT_MAX_BYTES && r->held_bytes + held <= arena / 8;
    put_item *it = NULL;
    if (!resident || !room || remote_down(r) || (it = calloc(1, sizeof(*it))) == NULL ||
        (it->src = malloc(sizeof(*it->src) * L)) == NULL ||
        (it->hold = malloc(sizeof(put_hold) + sizeof(uint32_t) * L)) == NULL) {
        if (it)
            free(it->src);
        free(it);
        atomic_fetch_add(&r->dropped, 1);
        return;
    }
    it->hdr = (remote_hdr){.magic = REMOTE_MAGIC,
                           .version = REMOTE_VERSION,
                           .kind = e->kind,
                           .n_layers = L,
                           .layer_bytes = (uint32_t)lb,
                           .root = root,
                           .key = e->key,
                           .parent = e->parent};
    memcpy(it->hdr.tokens, e->tokens, sizeof(it->hdr.tokens));
    it->hold->n = L;
    it->hold->bytes = held;
    for (uint32_t l = 0; l < L; l++) {
        uint32_t id = e->ids[l];
        it->src[l] = s->arena.slots + kv_slots_offset(&s->hs, s->blocks[id].slot);
        it->hold->ids[l] = id;
        /* a hold: not spilled until the writer has copied it; and a reference: not freed, even
         * when the cache lets go of it and its sequence is dropped (which a hold alone would
         * refuse) */
        s->blocks[id].holds++;
        s->blocks[id].refs++;
        srv_lru_update(s, id, 0);
    }
    r->held_bytes += held;
    key_of(it->key, root, first, e->key);
    pthread_mutex_lock(&r->mu);
    if (r->put_tail)
        r->put_tail->next = it;
    else
        r->put_head = it;
    r->put_tail = it;
    r->put_n++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    atomic_fetch_add(&r->queued, 1);
}

static void job_free(get_job *j)
{
    if (j->reply)
        freeReplyObject(j->reply);
    free(j->want);
    free(j->keys);
    free(j->check);
    free(j);
}

int srv_remote_get(rekv_kvstore_server *s, kv_pending *p, uint64_t root, uint64_t first,
                   const kv_remote_want *want, size_t n)
{
    kv_remote *r = s->remote;
    if (remote_down(r))
        return 0;
    size_t entry =
        sizeof(remote_hdr) + (size_t)s->cfg.geometry.n_layers *
                                 (s->arena.hdr->kv_block_bytes > s->arena.hdr->act_block_bytes
                                      ? s->arena.hdr->kv_block_bytes
                                      : s->arena.hdr->act_block_bytes);
    size_t cap = GET_MAX_BYTES / entry ? GET_MAX_BYTES / entry : 1;
    if (cap > GET_MAX_KEYS)
        cap = GET_MAX_KEYS;
    if (n > cap)
        n = cap;
    get_job *j = calloc(1, sizeof(*j));
    if (j == NULL || (j->want = malloc(sizeof(*want) * n)) == NULL ||
        (j->keys = malloc(KEY_LEN * n)) == NULL || (j->check = calloc(n, sizeof(int))) == NULL) {
        if (j)
            job_free(j);
        return 0;
    }
    memcpy(j->want, want, sizeof(*want) * n);
    for (size_t i = 0; i < n; i++)
        key_of(j->keys[i], root, first, want[i].key);
    j->n = n;
    j->root = root;
    j->n_layers = s->cfg.geometry.n_layers;
    j->layer_bytes[0] = layer_bytes_of(s, REKV_KV_BLOCK_KV);
    j->layer_bytes[1] = layer_bytes_of(s, REKV_KV_BLOCK_ACT);
    j->id = ++r->next_id;
    j->deadline_ns = rekv_now_ns() + (uint64_t)r->timeout_ms * 1000000ull;
    if (r->n_waiting++ == 0) /* else an earlier deadline has the timer */
        rekv_evloop_timer_set(s->loop, r->timer_id, (long)r->timeout_ms);
    j->lnext = r->inflight;
    r->inflight = j;
    pthread_mutex_lock(&r->mu);
    if (r->get_tail)
        r->get_tail->next = j;
    else
        r->get_head = j;
    r->get_tail = j;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    r->gets++;
    p->remote_job = j->id;
    return 1;
}

int srv_remote_waiting(const rekv_kvstore_server *s, const kv_pending *p)
{
    for (const get_job *j = s->remote->inflight; j; j = j->lnext)
        if (j->id == p->remote_job)
            return !j->expired;
    return 0; /* answered */
}

/* Adopts what job j brought, in chain order, up to the first position missing, damaged or with
 * no room. */
static void job_apply(rekv_kvstore_server *s, get_job *j)
{
    kv_remote *r = s->remote;
    uint32_t L = s->cfg.geometry.n_layers;
    if (j->err) {
        if (j->err == -ETIMEDOUT && !j->expired)
            r->timeouts++;
        else if (j->err != -ETIMEDOUT)
            r->get_errors++;
        return;
    }
    for (size_t i = 0; i < j->n; i++) {
        const redisReply *v = j->reply->element[i];
        int rc = j->check[i];
        if (rc == 1) { /* never written, expired or evicted */
            r->miss_blocks += (uint64_t)(j->n - i) * L;
            return;
        }
        if (rc < 0) {
            r->crc_errors++;
            srv_event_rl(s, SRV_RL_REMOTE, REKV_KV_EVENT_WARN, "remote: %s: %s; computed instead",
                         j->keys[i], rc == -EBADMSG ? "CRC32C mismatch" : "not this block's value");
            return;
        }
        rc = srv_cache_adopt_host(s, &j->want[i], (const uint8_t *)v->str + sizeof(remote_hdr),
                                  layer_bytes_of(s, j->want[i].kind));
        if (rc == -EEXIST)
            continue; /* made here meanwhile */
        if (rc < 0)
            return; /* no free room in the arena: the rest is computed */
        r->hit_blocks += L;
        r->read_bytes += v->len;
    }
}

/* Logs the threads' last failure when there were new ones (once a second at most). */
static void log_errors(rekv_kvstore_server *s)
{
    kv_remote *r = s->remote;
    uint64_t seen = atomic_load(&r->errors_seen);
    if (seen == r->logged_errors)
        return;
    char msg[256];
    pthread_mutex_lock(&r->mu);
    snprintf(msg, sizeof(msg), "%s", r->last_err);
    pthread_mutex_unlock(&r->mu);
    srv_event_rl(s, SRV_RL_REMOTE, REKV_KV_EVENT_WARN,
                 "remote: %s (jobs go on; the blocks are computed)", msg);
    r->logged_errors = seen;
}

static void on_done(rekv_evloop *loop, void *ctx, short revents)
{
    rekv_kvstore_server *s = ctx;
    kv_remote *r = s->remote;
    uint64_t cnt;
    ssize_t rd = read(r->efd, &cnt, sizeof(cnt));
    (void)rd;
    s->now = rekv_now_ns();
    pthread_mutex_lock(&r->mu);
    get_job *done = r->done_head;
    put_hold *rel = r->released;
    r->done_head = NULL;
    r->released = NULL;
    pthread_mutex_unlock(&r->mu);
    int any = done != NULL || rel != NULL;
    while (rel) { /* the writer has copied them */
        put_hold *h = rel;
        rel = h->next;
        for (uint32_t l = 0; l < h->n; l++) {
            REKV_ASSERT(s->blocks[h->ids[l]].holds > 0);
            s->blocks[h->ids[l]].holds--;
            srv_block_unref(s, h->ids[l]); /* the last reference frees it */
        }
        r->held_bytes -= h->bytes;
        free(h);
    }
    while (done) {
        get_job *j = done;
        done = j->next;
        job_apply(s, j);
        if (!j->expired)
            r->n_waiting--;
        for (get_job **pp = &r->inflight; *pp; pp = &(*pp)->lnext)
            if (*pp == j) {
                *pp = j->lnext;
                break;
            }
        job_free(j);
    }
    log_errors(s);
    if (any)
        srv_run_pending(s);
}

/* The reads past their deadline let their requests go on; logs the threads' failures (once a
 * second at most). Due again at the next deadline. */
static long on_timer(rekv_evloop *loop, void *ctx)
{
    rekv_kvstore_server *s = ctx;
    kv_remote *r = s->remote;
    uint64_t now = rekv_now_ns(), next = 0;
    int any = 0;
    s->now = now;
    for (get_job *j = r->inflight; j; j = j->lnext)
        if (!j->expired && j->deadline_ns <= now) {
            j->expired = 1;
            r->n_waiting--;
            r->timeouts++;
            any = 1;
        }
    log_errors(s);
    if (any)
        srv_run_pending(s); /* which may ask again: the deadlines below include those */
    for (get_job *j = r->inflight; j; j = j->lnext)
        if (!j->expired && (next == 0 || j->deadline_ns < next))
            next = j->deadline_ns;
    long ms = next ? (long)((next > now ? next - now : 0) / 1000000ull) + 1 : 1000;
    return ms < 1000 ? ms : 1000; /* at least once a second: the writer's failures are logged */
}

int srv_remote_open(rekv_kvstore_server *s, rekv_err *err)
{
    kv_remote *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore: out of memory");
    r->efd = -1;
    s->remote = r;
    int rc = kv_remote_url_parse(s->cfg.remote, &r->url, err);
    if (rc < 0)
        return rc;
    r->timeout_ms = s->cfg.remote_timeout_ms ? s->cfg.remote_timeout_ms : 50;
    r->ttl_s = s->cfg.remote_ttl_s ? s->cfg.remote_ttl_s : 3600;
    r->tv.tv_sec = r->timeout_ms / 1000;
    r->tv.tv_usec = (r->timeout_ms % 1000) * 1000;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if ((r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
        return rekv_errf(err, -errno, "kvstore: eventfd: %s", strerror(errno));
    if ((rc = rekv_evloop_add_fd(s->loop, r->efd, ZMQ_POLLIN, on_done, s, err)) < 0)
        return rc;
    r->efd_id = rc;
    if ((rc = rekv_evloop_timer_add(s->loop, 1000, on_timer, s, err)) < 0)
        return rc;
    r->timer_id = rc;
    if ((rc = pthread_create(&r->reader, NULL, reader_main, r)) != 0)
        return rekv_errf(err, -rc, "kvstore: remote reader thread: %s", strerror(rc));
    r->n_threads = 1;
    if ((rc = pthread_create(&r->writer, NULL, writer_main, r)) != 0)
        return rekv_errf(err, -rc, "kvstore: remote writer thread: %s", strerror(rc));
    r->n_threads = 2;
    return 0;
}

void srv_remote_close(rekv_kvstore_server *s)
{
    kv_remote *r = s->remote;
    if (r == NULL)
        return;
    if (r->n_threads) {
        pthread_mutex_lock(&r->mu);
        r->stop = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->reader, NULL);
        if (r->n_threads > 1)
            pthread_join(r->writer, NULL);
    }
    while (r->inflight) { /* every job, queued or done, is on this list */
        get_job *j = r->inflight;
        r->inflight = j->lnext;
        job_free(j);
    }
    while (r->put_head) { /* their holds go with the store */
        put_item *it = r->put_head;
        r->put_head = it->next;
        free(it->hold);
        free(it->src);
        free(it);
    }
    while (r->released) {
        put_hold *h = r->released;
        r->released = h->next;
        free(h);
    }
    if (r->efd >= 0) {
        if (r->efd_id > 0)
            rekv_evloop_del(s->loop, r->efd_id);
        if (r->timer_id > 0)
            rekv_evloop_timer_del(s->loop, r->timer_id);
        close(r->efd);
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv);
    }
    free(r);
    s->remote = NULL;
}

void srv_remote_metrics(const rekv_kvstore_server *s, rekv_metrics_buf *b)
{
    kv_remote *r = s->remote;
    if (r == NULL)
        return;
    const struct {
        const char *name, *labels, *help;
        double v;
    } c[] = {
        {"rekv_kvstore_remote_gets_total", NULL,
         "Reads (one MGET of a chain's keys) sent to the remote tier.", (double)r->gets},
        {"rekv_kvstore_remote_blocks_total", "result=\"hit\"",
         "Blocks (all layers) read back from the remote tier intact (hit), or asked for and not "
         "there (miss).",
         (double)r->hit_blocks},
        {"rekv_kvstore_remote_blocks_total", "result=\"miss\"", NULL, (double)r->miss_blocks},
        {"rekv_kvstore_remote_read_bytes_total", NULL,
         "Bytes of the values adopted from the remote tier.", (double)r->read_bytes},
        {"rekv_kvstore_remote_writes_total", "result=\"queued\"",
         "Entries written through: queued, written (Redis said OK), dropped (the queue full, Redis "
         "down, or a block not in memory), failed (an error answer such as OOM, or a lost "
         "connection).",
         (double)atomic_load(&r->queued)},
        {"rekv_kvstore_remote_writes_total", "result=\"written\"", NULL,
         (double)atomic_load(&r->written)},
        {"rekv_kvstore_remote_writes_total", "result=\"dropped\"", NULL,
         (double)atomic_load(&r->dropped)},
        {"rekv_kvstore_remote_writes_total", "result=\"failed\"", NULL,
         (double)atomic_load(&r->put_errors)},
        {"rekv_kvstore_remote_read_errors_total", NULL,
         "Reads that failed (no connection, an error answer, a lost connection).",
         (double)r->get_errors},
        {"rekv_kvstore_remote_timeouts_total", NULL,
         "Reads not answered within --remote-timeout-ms (their requests went on without them).",
         (double)r->timeouts},
        {"rekv_kvstore_remote_crc_errors_total", NULL,
         "Values read back and refused: a CRC32C mismatch, or a header not the block's.",
         (double)r->crc_errors},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++) {
        if (c[i].help)
            rekv_metrics_family(b, c[i].name, "counter", c[i].help);
        rekv_metrics_sample(b, c[i].name, c[i].labels, c[i].v);
    }
    rekv_metrics_family(b, "rekv_kvstore_remote_up", "gauge",
                        "1 unless the last connection to the remote tier failed (backing off).");
    rekv_metrics_sample(b, "rekv_kvstore_remote_up", NULL, remote_down(r) ? 0 : 1);
}
