/* test_remote_cluster.c — the kvstore's remote tier on a real Redis Cluster (issue 38: "works
 * with Redis Cluster's key hashing"): three Debian redis-server instances with --cluster-enabled
 * yes on loopback ports, formed into a cluster by `redis-cli --cluster create` (three masters, no
 * replicas), and two rekv-kvstore daemons (tests/kvd.h, their client writing the blocks) pointed
 * at different nodes of it.
 *
 * Store X publishes six prompts (two full blocks each); store Y, empty, reads each back from the
 * cluster byte for byte (its counters: every block a remote hit), and the keys lie on more than
 * one node. No redirect happens: each store's slot map, from CLUSTER SLOTS, sends each key to its
 * node at once — our CRC16 of the hash tag is the cluster's (a wrong one would draw MOVED
 * answers). Then one chain's slot is migrated by hand (CLUSTER SETSLOT IMPORTING / MIGRATING,
 * MIGRATE of its keys): while it moves, Y's read of the chain and X's write of a longer prompt on
 * the same first block are answered ASK and follow it; once the slot is the other node's, Y's read
 * of the new block is answered MOVED and follows it — each counted, each block intact.
 *
 * A master killed (kill -9) in a cluster of three masters with a replica each: once its replica
 * has taken over, a store whose slot map still named the dead master reads the chain from the
 * promoted replica (it asks another node for the map when one cannot be reached).
 *
 * And two complete replicas (`rekv run`, stories260K) on two nodes of the same kind of cluster:
 * six prompts replica A computed, replica B — its cache empty — serves from the cluster (each
 * job's cached_tokens: A's full blocks) with rekv_generate's tokens.
 *
 * redis-server, or a redis-cli with --cluster, missing: skipped, or failed when CI=true. */
#define _GNU_SOURCE
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "coordinator/coordinator.h"
#include "tests/co_env.h"
#include "tests/kvd.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"

#define MAX_NODES 6
#define N_CHAINS 6

typedef struct cluster {
    char *dir;
    int n;
    int port[MAX_NODES];
    pid_t pid[MAX_NODES];
    char id[MAX_NODES][48];
} cluster;

static int have_cluster_tools(void)
{
    const char *why = NULL;
    char *out = NULL;
    if (access("/usr/bin/redis-server", X_OK) != 0)
        why = "no /usr/bin/redis-server";
    else if (tu_run("redis-cli --cluster help 2>&1", &out) < 0 || out == NULL ||
             strstr(out, "create") == NULL) /* it exits 1 after the help */
        why = "no redis-cli with --cluster (Debian: redis-tools)";
    free(out);
    if (why == NULL)
        return 1;
    ck_assert_msg(!tu_ci(), "%s (CI=true): apt-get install redis-server redis-tools", why);
    fprintf(stderr, "test_remote_cluster: %s: skipped\n", why);
    return 0;
}

/* A port free on 127.0.0.1 whose cluster bus port (+10000) is free too, neither of them one of
 * the n nodes already picked (taken) nor their bus ports. */
static int cluster_port(const int *taken, int n)
{
    for (;;) {
        int p = ms_free_port(), clash = 0;
        if (p + 10000 > 65535)
            continue;
        /* nor the port or cluster bus of a node already picked (not yet listening: a random
         * pick could be one's bus port, and that node then fails to start) */
        for (int i = 0; i < n; i++)
            clash |= p == taken[i] || p == taken[i] + 10000 || p + 10000 == taken[i];
        if (clash)
            continue;
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET,
                                .sin_port = htons((uint16_t)(p + 10000)),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        int ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
        close(fd);
        if (ok)
            return p;
    }
}

static redisContext *node_conn(int port)
{
    struct timeval tv = {10, 0};
    return redisConnectWithTimeout("127.0.0.1", port, tv);
}

/* A command's reply on the node at port (the test fails on none). */
static redisReply *node_cmd(int port, const char *fmt, ...)
{
    redisContext *c = node_conn(port);
    ck_assert_msg(c && !c->err, "connect to 127.0.0.1:%d: %s", port, c ? c->errstr : "no memory");
    va_list ap;
    va_start(ap, fmt);
    redisReply *rp = redisvCommand(c, fmt, ap);
    va_end(ap);
    ck_assert_msg(rp != NULL, "127.0.0.1:%d: %s", port, c->errstr);
    redisFree(c);
    return rp;
}

/* A command that must answer +OK (or another status). */
static void node_ok(int port, const char *fmt, ...)
{
    redisContext *c = node_conn(port);
    ck_assert_msg(c && !c->err, "connect to 127.0.0.1:%d", port);
    va_list ap;
    va_start(ap, fmt);
    redisReply *rp = redisvCommand(c, fmt, ap);
    va_end(ap);
    ck_assert_msg(rp && rp->type == REDIS_REPLY_STATUS, "127.0.0.1:%d %s: %s", port, fmt,
                  rp ? rp->str : c->errstr);
    freeReplyObject(rp);
    redisFree(c);
}

static long long node_int(int port, const char *cmd)
{
    redisReply *rp = node_cmd(port, cmd);
    ck_assert_msg(rp->type == REDIS_REPLY_INTEGER, "%s: %s", cmd,
                  rp->type == REDIS_REPLY_ERROR ? rp->str : "not an integer");
    long long v = rp->integer;
    freeReplyObject(rp);
    return v;
}

/* Keys on all nodes together. */
static long long cluster_keys(const cluster *cl)
{
    long long n = 0;
    for (int i = 0; i < cl->n; i++)
        n += node_int(cl->port[i], "DBSIZE");
    return n;
}

static void cluster_wait_keys(const cluster *cl, long long n)
{
    while (cluster_keys(cl) < n) /* Check's timeout is the guard */
        usleep(10000);
}

/* Starts n cluster-enabled redis-servers (a node is taken as failed after 1 s unseen), forms
 * them into one cluster of n / (replicas + 1) masters with redis-cli and waits until every node
 * says cluster_state:ok and knows every slot's owner. */
static void cluster_start(cluster *cl, int n, int replicas)
{
    memset(cl, 0, sizeof(*cl));
    cl->dir = tu_tmpdir();
    cl->n = n;
    for (int i = 0; i < cl->n; i++) {
        cl->port[i] = cluster_port(cl->port, i);
        char port[16], dir[4200], conf[4300], log[4300];
        snprintf(port, sizeof(port), "%d", cl->port[i]);
        snprintf(dir, sizeof(dir), "%s/%d", cl->dir, cl->port[i]);
        ck_assert_int_eq(mkdir(dir, 0700), 0);
        snprintf(conf, sizeof(conf), "%s/nodes.conf", dir);
        snprintf(log, sizeof(log), "%s/redis.log", dir);
        cl->pid[i] = fork();
        ck_assert_int_ge(cl->pid[i], 0);
        if (cl->pid[i] == 0) {
            freopen(log, "a", stdout);
            execl("/usr/bin/redis-server", "redis-server", "--port", port, "--bind", "127.0.0.1",
                  "--cluster-enabled", "yes", "--cluster-config-file", conf,
                  "--cluster-node-timeout", "1000", "--save", "", "--appendonly", "no", "--dir",
                  dir, (char *)NULL);
            _exit(127);
        }
    }
    for (int i = 0; i < cl->n; i++)
        for (;;) { /* each answers PING (Check's timeout is the guard) */
            redisContext *c = node_conn(cl->port[i]);
            redisReply *rp = c && !c->err ? redisCommand(c, "PING") : NULL;
            int up = rp && rp->type == REDIS_REPLY_STATUS;
            if (rp)
                freeReplyObject(rp);
            if (c)
                redisFree(c);
            if (up)
                break;
            int st;
            ck_assert_msg(waitpid(cl->pid[i], &st, WNOHANG) == 0, "redis-server exited (see %s)",
                          cl->dir);
            usleep(10000);
        }
    char cmd[1024], *out = NULL;
    int len = snprintf(cmd, sizeof(cmd), "redis-cli --cluster create");
    for (int i = 0; i < n; i++)
        len += snprintf(cmd + len, sizeof(cmd) - (size_t)len, " 127.0.0.1:%d", cl->port[i]);
    snprintf(cmd + len, sizeof(cmd) - (size_t)len, " --cluster-replicas %d --cluster-yes 2>&1",
             replicas);
    int st = tu_run(cmd, &out);
    ck_assert_msg(st == 0, "%s: status %d: %s", cmd, st, out);
    free(out);
    for (int i = 0; i < cl->n; i++) {
        for (;;) {
            redisReply *rp = node_cmd(cl->port[i], "CLUSTER INFO");
            int ok = rp->type == REDIS_REPLY_STRING && strstr(rp->str, "cluster_state:ok");
            freeReplyObject(rp);
            if (ok)
                break;
            usleep(20000);
        }
        redisReply *rp = node_cmd(cl->port[i], "CLUSTER MYID");
        ck_assert_int_eq(rp->type, REDIS_REPLY_STRING);
        snprintf(cl->id[i], sizeof(cl->id[i]), "%s", rp->str);
        freeReplyObject(rp);
    }
    /* and every node knows every slot's owner */
    for (int i = 0; i < cl->n; i++)
        for (;;) {
            redisReply *rp = node_cmd(cl->port[i], "CLUSTER INFO");
            char known[64];
            snprintf(known, sizeof(known), "cluster_known_nodes:%d\r", n);
            int ok = strstr(rp->str, "cluster_slots_ok:16384") && strstr(rp->str, known);
            freeReplyObject(rp);
            if (ok)
                break;
            usleep(20000);
        }
}

static void cluster_stop(cluster *cl)
{
    for (int i = 0; i < cl->n; i++)
        if (cl->pid[i] > 0)
            tu_kill9(cl->pid[i]);
    tu_rmrf(cl->dir);
    free(cl->dir);
}

/* The keys of the one chain whose hash tag is not in before[0..nb) (the chain just written):
 * its slot (CLUSTER KEYSLOT, the cluster's own) and the node holding it. */
static void new_chain(const cluster *cl, char **before, size_t nb, int *slot, int *node)
{
    *slot = -1;
    for (int i = 0; i < cl->n; i++) {
        redisReply *rp = node_cmd(cl->port[i], "KEYS rekv:*");
        ck_assert_int_eq(rp->type, REDIS_REPLY_ARRAY);
        for (size_t k = 0; k < rp->elements; k++) {
            const char *key = rp->element[k]->str;
            int seen = 0;
            for (size_t b = 0; b < nb; b++)
                seen |= strcmp(before[b], key) == 0;
            if (seen)
                continue;
            redisReply *s = node_cmd(cl->port[i], "CLUSTER KEYSLOT %s", key);
            ck_assert_msg(*slot < 0 || *slot == s->integer, "a new chain in two slots");
            *slot = (int)s->integer;
            *node = i;
            freeReplyObject(s);
        }
        freeReplyObject(rp);
    }
    ck_assert_int_ge(*slot, 0);
}

/* Every key of the cluster (malloc'd strings), for new_chain. */
static char **all_keys(const cluster *cl, size_t *n)
{
    char **v = NULL;
    *n = 0;
    for (int i = 0; i < cl->n; i++) {
        redisReply *rp = node_cmd(cl->port[i], "KEYS rekv:*");
        v = realloc(v, sizeof(char *) * (*n + rp->elements + 1));
        for (size_t k = 0; k < rp->elements; k++)
            v[(*n)++] = strdup(rp->element[k]->str);
        freeReplyObject(rp);
    }
    return v;
}

/* ------------------------------------------------------------------ the stores */

static double metric(int port, const char *series)
{
    char *body = ms_scrape(port);
    double v = ms_value(body, series);
    free(body);
    ck_assert_msg(v == v, "no sample %s", series);
    return v;
}

#define HITS "rekv_kvstore_remote_blocks_total{result=\"hit\"}"
#define MOVED "rekv_kvstore_remote_redirects_total{kind=\"moved\"}"
#define ASKED "rekv_kvstore_remote_redirects_total{kind=\"ask\"}"
#define WRITTEN "rekv_kvstore_remote_writes_total{result=\"written\"}"

static int32_t P[N_CHAINS + 2][40]; /* the prompts; the last two share their first block */

static rekv_kv_prefix kpx(const int32_t *t, size_t n)
{
    return (rekv_kv_prefix){t, n, 0x5eedull, 0, 0};
}

/* Blocks [b0, b1) of seq (both layers) hold what kvd_write_blocks wrote for sequence src, gen. */
static void verify_as(rekv_kvstore_client *c, uint64_t seq, uint64_t b0, uint64_t b1, uint64_t src,
                      uint32_t gen)
{
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    rekv_kv_plan_block *pb = NULL;
    size_t nb, cap = 0;
    rekv_err err = {0};
    for (uint32_t l = 0; l < 2; l++) {
        rekv_kv_range rg = {seq, l, b0 * 16, b1 * 16};
        ck_assert_msg(rekv_kvstore_plan(c, &rg, 1, 1, &pb, &nb, &cap, &err) == 0, "pin: %s",
                      err.msg);
        ck_assert_int_eq(nb, b1 - b0);
        for (size_t i = 0; i < nb; i++)
            ck_assert_msg(kvd_check(arena + pb[i].offset, kvd_type_bytes(c, pb[i].type), src, l,
                                    pb[i].block, gen),
                          "layer %u block %llu is not the other store's", l,
                          (unsigned long long)pb[i].block);
        ck_assert_int_eq(rekv_kvstore_unpin(c, &rg, 1, NULL), 0);
    }
    free(pb);
}

/* X: prompt i as sequence seq, its blocks [b0, 2) written (gen) and published. */
static void publish(rekv_kvstore_client *c, uint64_t seq, int i, uint64_t b0, uint32_t gen)
{
    rekv_err err = {0};
    rekv_kv_prefix p = kpx(P[i], 39);
    rekv_kv_prefix_hit h;
    ck_assert_msg(rekv_kvstore_seq_create_prefix(c, seq, &p, &h, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(h.tokens, b0 * 16);
    ck_assert_int_eq(rekv_kvstore_append(c, seq, 40 - b0 * 16, 0, 0, NULL, NULL), 0);
    kvd_write_blocks(c, seq, b0, 2, gen);
    p = kpx(P[i], 40);
    ck_assert_msg(rekv_kvstore_publish(c, seq, &p, NULL, &err) == 0, "publish: %s", err.msg);
}

/* Y: a sequence made from prompt i's prefix; the tokens it got. */
static uint64_t read_back(rekv_kvstore_client *c, uint64_t seq, int i)
{
    rekv_err err = {0};
    rekv_kv_prefix p = kpx(P[i], 39);
    rekv_kv_prefix_hit h;
    ck_assert_msg(rekv_kvstore_seq_create_prefix(c, seq, &p, &h, &err) == 0, "%s", err.msg);
    return h.tokens;
}

static void kvd_cluster(kvd *d, int node_port, int metrics_port)
{
    char extra[512];
    snprintf(extra, sizeof(extra),
             "--remote redis://127.0.0.1:%d --remote-timeout-ms 5000 --metrics 127.0.0.1:%d",
             node_port, metrics_port);
    kvd_start(d, 64, extra, 0);
}

START_TEST(two_stores_share_through_a_cluster)
{
    if (!have_cluster_tools())
        return;
    cluster cl;
    cluster_start(&cl, 3, 0);
    for (int i = 0; i < N_CHAINS + 2; i++)
        for (int t = 0; t < 40; t++)
            P[i][t] = 100 + 37 * i + 3 * t;
    for (int t = 0; t < 16; t++) /* the last prompt: the one before's first block, then its own */
        P[N_CHAINS + 1][t] = P[N_CHAINS][t];
    int px = ms_free_port(), py = ms_free_port();
    kvd x, y;
    kvd_cluster(&x, cl.port[0], px); /* each store knows one node, another's */
    kvd_cluster(&y, cl.port[1], py);
    rekv_kvstore_client *cx = kvd_client(&x), *cy = kvd_client(&y);

    /* six chains written through X, read back by Y byte for byte, each key straight to its node */
    for (int i = 0; i < N_CHAINS; i++) { /* one at a time: queued writes hold a few slots */
        publish(cx, 1 + (uint64_t)i, i, 0, 7);
        cluster_wait_keys(&cl, 2 * (i + 1));
    }
    for (int i = 0; i < N_CHAINS; i++) {
        ck_assert_uint_eq(read_back(cy, 101 + (uint64_t)i, i), 32);
        verify_as(cy, 101 + (uint64_t)i, 0, 2, 1 + (uint64_t)i, 7);
    }
    ck_assert_int_eq(metric(py, HITS), 2 * 2 * N_CHAINS); /* blocks x layers */
    int holding = 0;
    for (int i = 0; i < cl.n; i++)
        holding += node_int(cl.port[i], "DBSIZE") > 0;
    ck_assert_int_ge(holding, 2);
    ck_assert_int_eq(metric(px, MOVED), 0);
    ck_assert_int_eq(metric(py, MOVED), 0);
    ck_assert_int_eq(metric(px, ASKED), 0);

    /* a seventh chain; then its slot migrates from node s to node d, keys first */
    size_t nb;
    char **before = all_keys(&cl, &nb);
    publish(cx, 50, N_CHAINS, 0, 9);
    cluster_wait_keys(&cl, 2 * N_CHAINS + 2);
    int slot = -1, s = 0;
    new_chain(&cl, before, nb, &slot, &s);
    int d = (s + 1) % cl.n;
    node_ok(cl.port[d], "CLUSTER SETSLOT %d IMPORTING %s", slot, cl.id[s]);
    node_ok(cl.port[s], "CLUSTER SETSLOT %d MIGRATING %s", slot, cl.id[d]);
    redisReply *rp = node_cmd(cl.port[s], "CLUSTER GETKEYSINSLOT %d 100", slot);
    ck_assert_int_eq(rp->type, REDIS_REPLY_ARRAY);
    ck_assert_int_eq(rp->elements, 2);
    for (size_t k = 0; k < rp->elements; k++)
        node_ok(cl.port[s], "MIGRATE 127.0.0.1 %d %s 0 10000", cl.port[d], rp->element[k]->str);
    freeReplyObject(rp);

    /* mid-migration: Y's read of it and X's write of the eighth (its first block the seventh's,
     * so the same slot) are answered ASK by s and follow it to d */
    ck_assert_uint_eq(read_back(cy, 150, N_CHAINS), 32);
    verify_as(cy, 150, 0, 2, 50, 9);
    ck_assert_int_ge(metric(py, ASKED), 1);
    publish(cx, 51, N_CHAINS + 1, 1, 11);
    while (metric(px, WRITTEN) < 2 * N_CHAINS + 3)
        usleep(10000);
    ck_assert_int_ge(metric(px, ASKED), 1);
    rp = node_cmd(cl.port[d], "CLUSTER COUNTKEYSINSLOT %d", slot);
    ck_assert_int_eq(rp->integer, 3); /* the seventh's two and the eighth's one, all on d */
    freeReplyObject(rp);

    /* the slot is d's: Y's map still says s, whose MOVED sends its read of the eighth's second
     * block to d (the first is Y's own since the seventh) */
    for (int i = 0; i < cl.n; i++)
        node_ok(cl.port[i], "CLUSTER SETSLOT %d NODE %s", slot, cl.id[d]);
    double moved0 = metric(py, MOVED);
    ck_assert_uint_eq(read_back(cy, 151, N_CHAINS + 1), 32);
    verify_as(cy, 151, 0, 1, 50, 9);
    verify_as(cy, 151, 1, 2, 51, 11);
    ck_assert_int_ge(metric(py, MOVED), moved0 + 1);
    ck_assert_int_eq(metric(py, HITS), 2 * 2 * N_CHAINS + 4 + 2);

    for (size_t k = 0; k < nb; k++)
        free(before[k]);
    free(before);
    rekv_kvstore_client_close(cx);
    rekv_kvstore_client_close(cy);
    kvd_stop(&x);
    kvd_stop(&y);
    cluster_stop(&cl);
}
END_TEST

/* The master that holds a key (after one chain was written: its slot's). */
static int master_holding(const cluster *cl)
{
    for (int i = 0; i < cl->n; i++) {
        redisReply *rp = node_cmd(cl->port[i], "ROLE");
        int master = rp->type == REDIS_REPLY_ARRAY && rp->elements > 0 &&
                     strcmp(rp->element[0]->str, "master") == 0;
        freeReplyObject(rp);
        if (master && node_int(cl->port[i], "DBSIZE") > 0)
            return i;
    }
    ck_abort_msg("no master holds a key");
    return -1;
}

/* A master killed (kill -9) and failed over to its replica: Y, whose slot map named the dead
 * master, asks another node for the map when it cannot reach it, and reads the chain from the
 * promoted replica. */
START_TEST(a_failed_over_master_is_found_again)
{
    if (!have_cluster_tools())
        return;
    cluster cl;
    cluster_start(&cl, 6, 1); /* three masters, a replica each */
    for (int t = 0; t < 40; t++)
        P[0][t] = 100 + 3 * t, P[1][t] = 900 + 5 * t;
    int px = ms_free_port(), py = ms_free_port();
    kvd x, y;
    kvd_cluster(&x, cl.port[0], px);
    kvd_cluster(&y, cl.port[1], py);
    rekv_kvstore_client *cx = kvd_client(&x), *cy = kvd_client(&y);
    publish(cx, 1, 0, 0, 7);
    while (metric(px, WRITTEN) < 2)
        usleep(10000);
    int m = master_holding(&cl);
    publish(cx, 2, 1, 0, 8);
    while (metric(px, WRITTEN) < 4)
        usleep(10000);
    ck_assert_uint_eq(read_back(cy, 102, 1), 32); /* Y has its map now */

    /* the master of chain 0's slot dies; its replica (holding the two keys) takes over */
    int rep_i = -1;
    for (int i = 0; i < cl.n && rep_i < 0; i++) {
        redisReply *rp = node_cmd(cl.port[i], "ROLE");
        if (strcmp(rp->element[0]->str, "slave") == 0 && rp->element[2]->integer == cl.port[m])
            rep_i = i;
        freeReplyObject(rp);
    }
    ck_assert_int_ge(rep_i, 0);
    while (node_int(cl.port[rep_i], "DBSIZE") < 2) /* replicated */
        usleep(10000);
    tu_kill9(cl.pid[m]);
    cl.pid[m] = 0;
    for (;;) { /* Check's timeout is the guard: failover after the 1 s node timeout */
        redisReply *rp = node_cmd(cl.port[rep_i], "ROLE");
        int master = strcmp(rp->element[0]->str, "master") == 0;
        freeReplyObject(rp);
        if (master)
            break;
        usleep(20000);
    }
    for (int i = 0; i < cl.n; i++)
        while (i != m) {
            redisReply *rp = node_cmd(cl.port[i], "CLUSTER INFO");
            int ok = strstr(rp->str, "cluster_state:ok") != NULL;
            freeReplyObject(rp);
            if (ok)
                break;
            usleep(20000);
        }
    /* Y's first tries go to the dead master (refused: the store answers what it holds, and backs
     * off); then the promoted replica answers */
    uint64_t seq = 200;
    for (;; seq++) {
        uint64_t got = read_back(cy, seq, 0);
        if (got == 32)
            break;
        ck_assert_uint_eq(got, 0);
        ck_assert_int_eq(rekv_kvstore_seq_drop(cy, seq, NULL), 0);
        usleep(50000);
    }
    verify_as(cy, seq, 0, 2, 1, 7);
    rekv_kvstore_client_close(cx);
    rekv_kvstore_client_close(cy);
    kvd_stop(&x);
    kvd_stop(&y);
    cluster_stop(&cl);
}
END_TEST

/* ------------------------------------------------------------------ replicas */

typedef struct replica {
    env e;
    pid_t run;
    rekv_ctl *c;
} replica;

static void replica_start(replica *p, int node_port)
{
    ck_assert_int_eq(ct_env_open(&p->e), 0);
    char url[64];
    snprintf(url, sizeof(url), "redis://127.0.0.1:%d", node_port);
    const char *extra[] = {"--remote", url, "--remote-timeout-ms", "5000", NULL};
    p->run = ct_rekv_run_start_args(&p->e, "64M", "8", "offload", extra);
    p->c = ct_ctl_open(p->e.ctl);
    ct_wait_workers(p->c, 1);
}

static void replica_stop(replica *p)
{
    rekv_ctl_close(p->c);
    ck_assert_int_eq(ct_stop(p->run), 0);
    ct_env_close(&p->e);
}

/* Two complete replicas (`rekv run`, stories260K) on two nodes of the cluster: each prompt A
 * computed, B — its own cache empty — serves from the cluster (its two full blocks cached) with
 * rekv_generate's tokens, as A's are; the chains lie on more than one node. */
START_TEST(two_replicas_share_prefixes_through_a_cluster)
{
    if (!have_cluster_tools())
        return;
    cluster cl;
    cluster_start(&cl, 3, 0);
    replica a, b;
    replica_start(&a, cl.port[0]);
    replica_start(&b, cl.port[2]);
    enum { N = 6 };
    static tjob jobs[N];
    for (int i = 0; i < N; i++) {
        ct_make_salted_job(&jobs[i], a.e.model, 20 + i);
        ck_assert_uint_eq(ct_run_cached(a.c, &jobs[i]), 0);
        cluster_wait_keys(&cl, 2 * (i + 1)); /* its two full blocks, written through */
    }
    for (int i = 0; i < N; i++)
        ck_assert_uint_eq(ct_run_cached(b.c, &jobs[i]), 32);
    int holding = 0;
    for (int i = 0; i < cl.n; i++)
        holding += node_int(cl.port[i], "DBSIZE") > 0;
    ck_assert_int_ge(holding, 2);
    replica_stop(&a);
    replica_stop(&b);
    cluster_stop(&cl);
    ct_free_jobs(jobs, N);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("remote_cluster");
    TCase *tc = tcase_create("cluster");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, two_stores_share_through_a_cluster);
    tcase_add_test(tc, two_replicas_share_prefixes_through_a_cluster);
    tcase_add_test(tc, a_failed_over_master_is_found_again);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
