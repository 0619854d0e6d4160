/* remote.c — the kvstore's remote tier: the prefix cache's entries shared through a Redis (or
 * Valkey) that several replicas of one model point at (--remote), so that one replica's prefix
 * is read back by another instead of computed again — LMCache's Redis backend, for rekv's
 * chain keys.
 *
 * Data flow. Two threads, each with its own hiredis connections (one per node, blocking calls
 * with --remote-timeout-ms as the socket timeout), and the store's loop, which never waits for
 * either:
 *   write-through: a new entry (prefix.c publish_new) whose blocks are all in memory is queued
 *   with a hold and a reference on each block (so nothing spills, evicts or frees them), bounded
 *   (PUT_MAX_ITEMS entries, held blocks at most PUT_MAX_BYTES and an eighth of the arena; past
 *   either it is dropped and counted); the writer thread first copies each queued entry's bytes
 *   out of the arena into its value (header, CRC32C) and hands the holds back through the
 *   eventfd (the loop lets go of them), then sends the values pipelined as SET key value EX ttl.
 *   The loop copies nothing; the writer copies each value once, into the SET command it writes
 *   to the socket itself (past hiredis's output buffer), and runs at SCHED_IDLE, so that its
 *   copies, CRC and sends take only CPU time nothing else wants — a step's above all. A write
 *   Redis refuses (OOM under noeviction, ...) is counted and forgotten.
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
 * Redis Cluster: each thread keeps a map of the 16384 slots to nodes (CRC16 of the hash tag),
 * asked with CLUSTER SLOTS when --remote's node connects (a Redis without cluster support says
 * no: every slot is that node's) and again after a MOVED answer, with a connection per node. A
 * MOVED answer moves its slot and the command goes again to the node named; an ASK answer (a
 * slot being migrated) sends it there once, after ASKING. At most MAX_REDIRECTS redirects per
 * command, and none past --remote-timeout-ms. A read's keys share one slot (checked); a write
 * batch goes to each node its items' slots name, pipelined per node.
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
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
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
#define MAX_NODES 64 /* a cluster's masters one thread talks to */
#define N_SLOTS 16384
#define MAX_REDIRECTS 5
#define SLOTS_REFRESH_MS 1000

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
    uint8_t *cmd; /* the writer's: the SET command as sent (RESP), the value inside */
    size_t len;
    int state; /* the writer's: PUT_PENDING until answered (or given up) */
    int node;  /* where it goes next (its slot's node, or a redirect's) */
    int ask;   /* the last answer was ASK: once to node, after ASKING */
    int round; /* the last round that sent it */
} put_item;

enum { PUT_PENDING, PUT_DONE };
enum { REDIR_MOVED = 1, REDIR_ASK };

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

/* One thread's connection to one node: reconnects after a backoff. */
typedef struct conn {
    redisContext *c;
    uint64_t retry_ns;
    uint32_t backoff_ms;
    int used; /* a command succeeded on c */
} conn;

/* A Redis node a thread talks to: node 0 is --remote's URL; the others a cluster's, named by
 * CLUSTER SLOTS or by a MOVED or ASK answer (TCP, database 0). */
typedef struct node {
    char host[256]; /* "" and port 0: node 0 on a unix socket */
    int port;
    conn cn;
} node;

/* One thread's nodes, and the node of each cluster slot: node 0 for every slot until a cluster
 * says otherwise (CLUSTER SLOTS when node 0 connects, a MOVED answer), so that a Redis without
 * cluster support is node 0 alone. */
typedef struct route {
    int n;
    node nodes[MAX_NODES];
    uint8_t slot[N_SLOTS]; /* slot -> index in nodes */
    uint64_t refreshed_ns; /* when CLUSTER SLOTS last answered */
} route;

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
    _Atomic uint64_t moved, asked; /* a cluster's redirects followed */
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

/* After a failed command on cn (e: errno right after it, or what our own send returned): 1 when
 * the server had closed a connection that worked before (Redis restarted, or its idle timeout),
 * which is then closed for the caller to connect again at once and retry; else 0 (a timeout, a
 * refused connection: the caller backs off). */
static int conn_reopen(conn *cn, int e)
{
    int closed = cn->c->err == REDIS_ERR_EOF || ((cn->c->err == REDIS_ERR_IO || cn->c->err == 0) &&
                                                 (e == EPIPE || e == ECONNRESET));
    if (!cn->used || !closed)
        return 0;
    redisFree(cn->c);
    cn->c = NULL;
    cn->used = 0;
    return 1;
}

/* Redis Cluster's slot of a key: CRC16 (XMODEM, as Redis's crc16.c) of its hash tag — what lies
 * between its first '{' and the next '}' when that is not empty — else of the whole key, mod
 * 16384. Every key of one chain has the chain's first block as its tag: one slot. */
static uint16_t key_slot(const char *key)
{
    const char *o = strchr(key, '{'), *c = o ? strchr(o + 1, '}') : NULL;
    const char *p = c && c > o + 1 ? o + 1 : key;
    size_t n = c && c > o + 1 ? (size_t)(c - p) : strlen(key);
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)((uint8_t)p[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = crc & 0x8000 ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc & (N_SLOTS - 1);
}

/* The index of node host (hn bytes):port in rt, added when new; -1 when the table is full. Node
 * 0, --remote's own, matches when it is that TCP address. */
static int node_of(route *rt, const char *host, size_t hn, int port)
{
    for (int k = 0; k < rt->n; k++)
        if (rt->nodes[k].port == port && strlen(rt->nodes[k].host) == hn &&
            memcmp(rt->nodes[k].host, host, hn) == 0)
            return k;
    if (rt->n == MAX_NODES || hn == 0 || hn >= sizeof(rt->nodes[0].host))
        return -1;
    node *nd = &rt->nodes[rt->n];
    memset(nd, 0, sizeof(*nd));
    memcpy(nd->host, host, hn);
    nd->port = port;
    return rt->n++;
}

/* Fills rt's slot map from CLUSTER SLOTS on node k's connection. A Redis without cluster support
 * answers an error: every slot stays node 0's. A failed call leaves the map as it was (the
 * connection's next command finds out). */
static void slots_refresh(route *rt, int k)
{
    redisReply *rp = redisCommand(rt->nodes[k].cn.c, "CLUSTER SLOTS");
    if (rp && rp->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i < rp->elements; i++) {
            const redisReply *e = rp->element[i], *m;
            if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
                e->element[0]->type != REDIS_REPLY_INTEGER ||
                e->element[1]->type != REDIS_REPLY_INTEGER ||
                (m = e->element[2])->type != REDIS_REPLY_ARRAY || m->elements < 2 ||
                m->element[0]->type != REDIS_REPLY_STRING ||
                m->element[1]->type != REDIS_REPLY_INTEGER)
                continue;
            long long lo = e->element[0]->integer, hi = e->element[1]->integer;
            const char *host = m->element[0]->str; /* "": the node asked */
            size_t hn = m->element[0]->len;
            if (hn == 0)
                host = rt->nodes[k].host, hn = strlen(host);
            int to = node_of(rt, host, hn, (int)m->element[1]->integer);
            for (long long s = lo < 0 ? 0 : lo; to >= 0 && s <= hi && s < N_SLOTS; s++)
                rt->slot[s] = (uint8_t)to;
        }
        rt->refreshed_ns = rekv_now_ns();
    }
    if (rp)
        freeReplyObject(rp);
}

/* 0 with a connection to node k, else -ECONNREFUSED (backing off). Node 0 is --remote's URL (a
 * unix socket possibly, its database SELECTed); after it connects, the slot map is asked for. */
static int conn_ensure(kv_remote *r, route *rt, int k)
{
    conn *cn = &rt->nodes[k].cn;
    if (cn->c)
        return 0;
    if (rekv_now_ns() < cn->retry_ns)
        return -ECONNREFUSED;
    if (k == 0)
        cn->c = r->url.is_unix ? redisConnectUnixWithTimeout(r->url.path, r->tv)
                               : redisConnectWithTimeout(r->url.host, r->url.port, r->tv);
    else
        cn->c = redisConnectWithTimeout(rt->nodes[k].host, rt->nodes[k].port, r->tv);
    if (cn->c == NULL || cn->c->err || redisSetTimeout(cn->c, r->tv) != REDIS_OK) {
        note_error(r, "connect", cn->c ? cn->c->errstr : "out of memory");
        conn_drop(r, cn);
        /* a cluster's master gone (failed over, or removed): another node knows who has its
         * slots now */
        for (int j = 0; j < rt->n; j++)
            if (j != k && rt->nodes[j].cn.c &&
                rekv_now_ns() - rt->refreshed_ns > (uint64_t)SLOTS_REFRESH_MS * 1000000ull) {
                slots_refresh(rt, j);
                break;
            }
        return -ECONNREFUSED;
    }
    if (k == 0 && r->url.db) {
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
    if (k == 0)
        slots_refresh(rt, 0);
    return 0;
}

/* A thread's route: node 0 is --remote's URL, every slot its. */
static route *route_new(const kv_remote *r)
{
    route *rt = calloc(1, sizeof(*rt));
    if (rt == NULL)
        return NULL;
    rt->n = 1;
    if (!r->url.is_unix) {
        snprintf(rt->nodes[0].host, sizeof(rt->nodes[0].host), "%s", r->url.host);
        rt->nodes[0].port = r->url.port;
    }
    return rt;
}

static void route_free(route *rt)
{
    for (int k = 0; rt && k < rt->n; k++)
        if (rt->nodes[k].cn.c)
            redisFree(rt->nodes[k].cn.c);
    free(rt);
}

/* Whether rp is a cluster's redirect ("MOVED 3999 127.0.0.1:6381", "ASK ..."): REDIR_MOVED or
 * REDIR_ASK with the slot and the node it names (added to rt; an empty host is from's, the node
 * that answered), else 0 (also for a node the table has no room for). */
static int redirect_of(route *rt, const redisReply *rp, int from, int *slot, int *to)
{
    if (rp->type != REDIS_REPLY_ERROR)
        return 0;
    int kind = strncmp(rp->str, "MOVED ", 6) == 0 ? REDIR_MOVED
               : strncmp(rp->str, "ASK ", 4) == 0 ? REDIR_ASK
                                                  : 0;
    if (kind == 0)
        return 0;
    const char *p = rp->str + (kind == REDIR_MOVED ? 6 : 4), *colon;
    char *end;
    long s = strtol(p, &end, 10);
    if (end == p || *end != ' ' || s < 0 || s >= N_SLOTS || (colon = strrchr(end, ':')) == NULL)
        return 0;
    const char *host = end + 1;
    long port = strtol(colon + 1, &end, 10);
    if (port < 1 || port > 65535 || *end)
        return 0;
    size_t hn = (size_t)(colon - host);
    if (hn == 0)
        host = rt->nodes[from].host, hn = strlen(host);
    if ((*to = node_of(rt, host, hn, (int)port)) < 0)
        return 0;
    *slot = (int)s;
    return kind;
}

/* A MOVED: slot lives on node to from now on. */
static void on_moved(kv_remote *r, route *rt, int slot, int to)
{
    rt->slot[slot] = (uint8_t)to;
    atomic_fetch_add(&r->moved, 1);
}

/* After a MOVED from node to: the rest of the map is asked for again (at most every
 * SLOTS_REFRESH_MS: a resharding moves many slots, and one answer tells all). */
static void refresh_after_moved(kv_remote *r, route *rt, int to)
{
    if (rekv_now_ns() - rt->refreshed_ns > (uint64_t)SLOTS_REFRESH_MS * 1000000ull &&
        conn_ensure(r, rt, to) == 0)
        slots_refresh(rt, to);
}

/* argv on node k (after ASKING when asking), the connection opened again once when the server
 * had closed it: the reply, or NULL with *err -ECONNREFUSED (no connection: backing off),
 * -ETIMEDOUT or -EIO (the connection dropped). */
static redisReply *node_command(kv_remote *r, route *rt, int k, int asking, int argc,
                                const char **argv, const size_t *lens, const char *what, int *err)
{
    conn *cn = &rt->nodes[k].cn;
    for (int tries = 0;; tries++) {
        if ((*err = conn_ensure(r, rt, k)) < 0)
            return NULL;
        void *rp = NULL, *ok = NULL;
        if (asking) {
            redisAppendCommand(cn->c, "ASKING");
            redisAppendCommandArgv(cn->c, argc, argv, lens);
            if (redisGetReply(cn->c, &ok) == REDIS_OK && redisGetReply(cn->c, &rp) != REDIS_OK)
                rp = NULL;
            if (ok)
                freeReplyObject(ok);
        } else {
            rp = redisCommandArgv(cn->c, argc, argv, lens);
        }
        if (rp) {
            cn->used = 1;
            return rp;
        }
        if (tries > 0 || !conn_reopen(cn, errno))
            break;
    }
    *err =
        cn->c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK) ? -ETIMEDOUT : -EIO;
    note_error(r, what, cn->c->errstr);
    conn_drop(r, cn);
    return NULL;
}

/* ------------------------------------------------------------------ the threads */

static uint32_t value_crc(remote_hdr h, const uint8_t *payload, size_t n);

/* Makes the SET commands of items[0..n) from the arena — the RESP bytes as sent, the value
 * (header, CRC32C, every layer's block) copied once, into its place in the command — and hands
 * their holds back to the loop; an item whose command cannot be allocated is dropped (cmd
 * NULL). */
static void copy_puts(kv_remote *r, put_item **items, int n)
{
    put_hold *back = NULL;
    char ttl[16];
    int tn = snprintf(ttl, sizeof(ttl), "%u", r->ttl_s);
    for (int i = 0; i < n; i++) {
        put_item *it = items[i];
        const remote_hdr *h = &it->hdr;
        size_t lb = h->layer_bytes, vlen = sizeof(*h) + (size_t)h->n_layers * lb;
        char pre[160], post[48];
        int pn = snprintf(pre, sizeof(pre), "*5\r\n$3\r\nSET\r\n$%zu\r\n%s\r\n$%zu\r\n",
                          strlen(it->key), it->key, vlen);
        int qn = snprintf(post, sizeof(post), "\r\n$2\r\nEX\r\n$%d\r\n%s\r\n", tn, ttl);
        it->len = (size_t)pn + vlen + (size_t)qn;
        if ((it->cmd = malloc(it->len)) != NULL) {
            uint8_t *val = it->cmd + pn, *payload = val + sizeof(*h);
            for (uint32_t l = 0; l < h->n_layers; l++)
                memcpy(payload + (size_t)l * lb, it->src[l], lb);
            it->hdr.crc = value_crc(*h, payload, (size_t)h->n_layers * lb);
            memcpy(it->cmd, pre, (size_t)pn);
            memcpy(val, &it->hdr, sizeof(*h));
            memcpy(val + vlen, post, (size_t)qn);
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

/* j's MGET on the node of its keys' slot (one: they share the chain's hash tag), following a
 * cluster's MOVED and ASK answers while within j's deadline. */
static void run_get(kv_remote *r, route *rt, get_job *j)
{
    if (rekv_now_ns() > j->deadline_ns) { /* its requests went on long ago: skip it */
        j->err = -ETIMEDOUT;
        return;
    }
    int slot = key_slot(j->keys[0]);
    for (size_t i = 1; i < j->n; i++)
        if (key_slot(j->keys[i]) != slot) { /* a cluster would refuse it: CROSSSLOT */
            note_error(r, "MGET", "keys of more than one hash slot");
            j->err = -EINVAL;
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
    if (rt->refreshed_ns == 0) /* a first connection asks for the slot map, before routing */
        conn_ensure(r, rt, 0);
    int k = rt->slot[slot], asking = 0, s, to, kind;
    for (int hops = 0;; hops++) {
        rp = node_command(r, rt, k, asking, (int)j->n + 1, argv, lens, "MGET", &j->err);
        if (rp == NULL || (kind = redirect_of(rt, rp, k, &s, &to)) == 0 || hops == MAX_REDIRECTS ||
            rekv_now_ns() > j->deadline_ns)
            break;
        freeReplyObject(rp);
        rp = NULL;
        if (kind == REDIR_MOVED) {
            on_moved(r, rt, s, to);
            refresh_after_moved(r, rt, to);
        } else {
            atomic_fetch_add(&r->asked, 1);
        }
        asking = kind == REDIR_ASK;
        k = to;
    }
    free(argv);
    free(lens);
    if (rp == NULL)
        return;
    if (rp->type != REDIS_REPLY_ARRAY || rp->elements != j->n) {
        note_error(r, "MGET", rp->type == REDIS_REPLY_ERROR ? rp->str : "not an array of values");
        freeReplyObject(rp);
        j->err = -EIO;
        return;
    }
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
    route *rt = route_new(r);
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
        if (rt)
            run_get(r, rt, j);
        else
            j->err = -ENOMEM;
        pthread_mutex_lock(&r->mu);
        j->next = r->done_head; /* the loop applies them in any order: each stands alone */
        r->done_head = j;
        uint64_t one = 1;
        ssize_t wr = write(r->efd, &one, sizeof(one));
        (void)wr; /* a full counter is still readable */
    }
    pthread_mutex_unlock(&r->mu);
    route_free(rt);
    return NULL;
}

/* Writes all of p[0..n) to fd: 0, or a negative errno (-EAGAIN: the send timeout). */
static int send_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? -errno : -EIO;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* One round's writes to node k: the items pending for it (each after ASKING when the last answer
 * was ASK), pipelined, then their answers — OK is written, MOVED or ASK sends it on to the next
 * round (within the deadline), another error (OOM under noeviction, ...) is failed. The commands
 * go straight to the socket: hiredis would copy each value twice more (formatting, then its output
 * buffer) — two copies of the batch where the arena's is the one needed, megabytes per entry at a
 * real model's geometry — and move what is left of its buffer after a partial write. A connection
 * the server had closed is opened again once; one failing otherwise fails what is left. */
static void puts_to_node(kv_remote *r, route *rt, int k, put_item **items, int n, int round,
                         uint64_t deadline_ns)
{
    static const char asking[] = "*1\r\n$6\r\nASKING\r\n";
    conn *cn = &rt->nodes[k].cn;
    int moved_to = -1, answered = 0, e = 0;
    for (int tries = 0;; tries++) {
        if (conn_ensure(r, rt, k) < 0) {
            for (int i = 0; i < n; i++)
                if (items[i]->state == PUT_PENDING && items[i]->node == k) {
                    items[i]->state = PUT_DONE;
                    atomic_fetch_add(&r->dropped, 1);
                }
            return;
        }
        for (int i = 0; i < n && e == 0; i++) {
            const put_item *it = items[i];
            if (it->state != PUT_PENDING || it->node != k || it->round >= round)
                continue;
            if (it->ask)
                e = send_all(cn->c->fd, (const uint8_t *)asking, sizeof(asking) - 1);
            if (e == 0)
                e = send_all(cn->c->fd, it->cmd, it->len);
        }
        for (int i = 0; i < n && e == 0; i++) {
            put_item *it = items[i];
            if (it->state != PUT_PENDING || it->node != k || it->round >= round)
                continue;
            void *v = NULL, *ok = NULL;
            if (it->ask && redisGetReply(cn->c, &ok) != REDIS_OK)
                e = errno ? -errno : -EIO;
            if (ok)
                freeReplyObject(ok);
            if (e == 0 && redisGetReply(cn->c, &v) != REDIS_OK)
                e = errno ? -errno : -EIO;
            if (e)
                break;
            cn->used = 1;
            answered = 1;
            it->round = round;
            redisReply *rp = v;
            int s, to, kind = redirect_of(rt, rp, k, &s, &to);
            if (kind && round < MAX_REDIRECTS && rekv_now_ns() < deadline_ns) {
                it->node = to;
                it->ask = kind == REDIR_ASK;
                if (kind == REDIR_MOVED) {
                    on_moved(r, rt, s, to);
                    moved_to = to;
                } else {
                    atomic_fetch_add(&r->asked, 1);
                }
            } else if (rp->type == REDIS_REPLY_ERROR) {
                note_error(r, "SET", rp->str);
                atomic_fetch_add(&r->put_errors, 1);
                it->state = PUT_DONE;
            } else {
                atomic_fetch_add(&r->written, 1);
                it->state = PUT_DONE;
            }
            freeReplyObject(rp);
        }
        if (e == 0)
            break;
        if (!answered && tries == 0 && conn_reopen(cn, -e)) {
            e = 0; /* nothing of the batch went through: all of it again */
            continue;
        }
        note_error(r, "SET", cn->c->err ? cn->c->errstr : strerror(-e));
        for (int i = 0; i < n; i++)
            if (items[i]->state == PUT_PENDING && items[i]->node == k && items[i]->round < round) {
                items[i]->state = PUT_DONE;
                atomic_fetch_add(&r->put_errors, 1);
            }
        conn_drop(r, cn);
        break;
    }
    if (moved_to >= 0)
        refresh_after_moved(r, rt, moved_to);
}

/* Sends the commands of items[0..n) to the nodes of their keys' slots, in rounds: a round sends
 * each node its items pipelined; a cluster's MOVED or ASK answer sends an item again in the next
 * round, up to MAX_REDIRECTS times and within --remote-timeout-ms. Counts each as written, failed
 * or dropped. */
static void run_puts(kv_remote *r, route *rt, put_item **items, int n)
{
    uint64_t deadline_ns = rekv_now_ns() + (uint64_t)r->timeout_ms * 1000000ull;
    if (rt->refreshed_ns == 0) /* a first connection asks for the slot map, before routing */
        conn_ensure(r, rt, 0);
    for (int i = 0; i < n; i++) {
        put_item *it = items[i];
        it->state = it->cmd ? PUT_PENDING : PUT_DONE;
        if (it->cmd == NULL) /* no memory for its command */
            atomic_fetch_add(&r->dropped, 1);
        it->node = rt->slot[key_slot(it->key)];
        it->ask = 0;
        it->round = -1;
    }
    for (int round = 0; round <= MAX_REDIRECTS; round++)
        for (int i = 0; i < n; i++)
            if (items[i]->state == PUT_PENDING && items[i]->round < round)
                puts_to_node(r, rt, items[i]->node, items, n, round, deadline_ns);
    for (int i = 0; i < n; i++)
        if (items[i]->state == PUT_PENDING) {
            note_error(r, "SET", "redirected too often");
            atomic_fetch_add(&r->put_errors, 1);
        }
}

static void *writer_main(void *arg)
{
    kv_remote *r = arg;
    route *rt = route_new(r);
    put_item *batch[PUT_PIPELINE];
    /* Background work: the copies, CRC32C and sends yield the CPU to anything else (a step
     * above all). Lowering one's own policy needs no privilege; where it fails, nice is all. */
    struct sched_param sp = {0};
    if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) != 0 &&
        setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19) != 0)
        note_error(r, "writer", "could not lower its priority");
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
        if (rt)
            run_puts(r, rt, batch, n);
        else
            atomic_fetch_add(&r->dropped, (uint64_t)n);
        for (int i = 0; i < n; i++) {
            free(batch[i]->cmd);
            free(batch[i]->src);
            free(batch[i]);
        }
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    route_free(rt);
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
    pthread_setname_np(r->reader, "rekv-kv-rread"); /* in top -H and perf: a name is all */
    pthread_setname_np(r->writer, "rekv-kv-rwrite");
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
        {"rekv_kvstore_remote_redirects_total", "kind=\"moved\"",
         "Redis Cluster redirects followed: MOVED (the slot's node learnt) and ASK (a slot "
         "being migrated).",
         (double)atomic_load(&r->moved)},
        {"rekv_kvstore_remote_redirects_total", "kind=\"ask\"", NULL,
         (double)atomic_load(&r->asked)},
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
