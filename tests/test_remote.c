/* test_remote.c — the kvstore's remote tier (issue 38): two complete rekv replicas on loopback
 * (`rekv run`: each its own kvstore, worker and coordinator, cpu backend, stories260K; offload
 * mode, and kvpr, whose activation blocks are a second chain of another kind) and one Debian
 * redis-server the test starts on a unix socket in a temp dir. A prompt replica A computed is
 * served by replica B, whose own cache is empty, from Redis (JobStatus.cached_tokens: A's full
 * blocks) with rekv_generate's tokens, as A's are; then the faults — a bit flipped in a stored
 * value (its CRC32C refuses it: that block is computed), redis-server killed (kill -9) while B's
 * jobs read from it, restarted empty (a miss, computed; both replicas reconnect and share
 * again), `maxmemory` reached with noeviction (every write is refused with OOM; jobs go on) —
 * and every job completes with the same tokens.
 *
 * Below the replicas, the same against rekv-kvstore alone (tests/kvd.h, its client writing the
 * blocks; database 3 on the unix socket, and over TCP on loopback): the bytes a second store
 * adopts are the first one's, a Lookup reads back too, a Redis that does not answer (SIGSTOP)
 * costs a request its --remote-timeout-ms and no more (the store answers with what it holds),
 * the metrics port counts each of these, and every slot comes back once the writes are done; a
 * bad --remote is a usage error.
 *
 * redis-server missing: skipped (77), or failed when CI=true. The replicas read with
 * --remote-timeout-ms 5000: on this loaded machine a read over the default 50 ms would turn an
 * expected hit into a miss; the timeout itself is no assertion here. */
#define _GNU_SOURCE
#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "coordinator/coordinator.h"
#include "tests/co_env.h"
#include "tests/kvd.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"

/* ------------------------------------------------------------------ redis-server */

typedef struct redis {
    pid_t pid;
    char sock[4200], url[4300];
    const char *dir;
    int port; /* also on 127.0.0.1:port when not 0 */
    int db;   /* the database the test looks at */
} redis;

static int have_redis(void)
{
    if (access("/usr/bin/redis-server", X_OK) == 0)
        return 1;
    ck_assert_msg(!tu_ci(), "redis-server is missing (CI=true): apt-get install redis-server");
    fprintf(stderr, "test_remote: no /usr/bin/redis-server: skipped\n");
    return 0;
}

static redisContext *redis_conn(const redis *r)
{
    struct timeval tv = {10, 0};
    redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
    if (c && !c->err && r->db) {
        redisReply *rp = redisCommand(c, "SELECT %d", r->db);
        if (rp)
            freeReplyObject(rp);
    }
    return c;
}

/* A command's reply (the test fails on none). */
static redisReply *redis_cmd(const redis *r, const char *fmt, ...)
{
    redisContext *c = redis_conn(r);
    ck_assert_msg(c && !c->err, "connect to redis: %s", c ? c->errstr : "out of memory");
    va_list ap;
    va_start(ap, fmt);
    redisReply *rp = redisvCommand(c, fmt, ap);
    va_end(ap);
    ck_assert_msg(rp != NULL, "redis: %s", c->errstr);
    redisFree(c);
    return rp;
}

/* Starts redis-server on r->sock (no TCP port, no persistence) and waits until it answers. */
static void redis_start(redis *r)
{
    char log[4300];
    snprintf(log, sizeof(log), "%s/redis.log", r->dir);
    char port[16];
    snprintf(port, sizeof(port), "%d", r->port);
    r->pid = fork();
    ck_assert_int_ge(r->pid, 0);
    if (r->pid == 0) {
        freopen(log, "a", stdout);
        execl("/usr/bin/redis-server", "redis-server", "--port", port, "--bind", "127.0.0.1",
              "--unixsocket", r->sock, "--unixsocketperm", "700", "--save", "", "--appendonly",
              "no", "--dir", r->dir, (char *)NULL);
        _exit(127);
    }
    for (;;) { /* Check's timeout is the guard */
        redisContext *c = redis_conn(r);
        redisReply *rp = c && !c->err ? redisCommand(c, "PING") : NULL;
        int up = rp && rp->type == REDIS_REPLY_STATUS;
        if (rp)
            freeReplyObject(rp);
        if (c)
            redisFree(c);
        if (up)
            return;
        int st;
        ck_assert_msg(waitpid(r->pid, &st, WNOHANG) == 0, "redis-server exited (see %s)", log);
        usleep(10000);
    }
}

static long long redis_int(const redis *r, const char *cmd)
{
    redisReply *rp = redis_cmd(r, cmd);
    ck_assert_int_eq(rp->type, REDIS_REPLY_INTEGER);
    long long v = rp->integer;
    freeReplyObject(rp);
    return v;
}

/* Waits until Redis holds at least n keys (the writer thread's SETs landed). */
static void redis_wait_keys(const redis *r, long long n)
{
    while (redis_int(r, "DBSIZE") < n)
        usleep(10000);
}

/* ------------------------------------------------------------------ replicas */

typedef struct replica {
    env e;
    pid_t run;
    rekv_ctl *c;
} replica;

static int replica_start(replica *p, const redis *r, const char *mode)
{
    if (ct_env_open(&p->e))
        return -1;
    const char *extra[] = {"--remote", r->url, "--remote-timeout-ms", "5000", NULL};
    p->run = ct_rekv_run_start_args(&p->e, "64M", "8", mode, extra);
    p->c = ct_ctl_open(p->e.ctl);
    ct_wait_workers(p->c, 1);
    return 0;
}

static void replica_stop(replica *p)
{
    rekv_ctl_close(p->c);
    ck_assert_int_eq(ct_stop(p->run), 0);
    ct_env_close(&p->e);
}

/* Two replicas and a redis in A's directory; 0, or -1 when the test is skipped. */
static int setup(replica *a, replica *b, redis *r, const char *mode)
{
    if (!have_redis())
        return -1;
    memset(r, 0, sizeof(*r));
    r->dir = tu_tmpdir();
    snprintf(r->sock, sizeof(r->sock), "%s/redis.sock", r->dir);
    snprintf(r->url, sizeof(r->url), "unix://%s", r->sock);
    redis_start(r);
    if (replica_start(a, r, mode) < 0)
        return -1;
    if (replica_start(b, r, mode) < 0)
        return -1;
    return 0;
}

static void teardown(replica *a, replica *b, redis *r)
{
    replica_stop(a);
    replica_stop(b);
    if (r->pid > 0)
        tu_kill9(r->pid);
    tu_rmrf(r->dir);
    free((char *)r->dir);
}

/* The key of the second block of a chain Redis holds: "rekv:ROOT:{FIRST}:KEY" with KEY !=
 * FIRST (the first block's KEY is its own tag). */
static char *second_block_key(const redis *r)
{
    redisReply *rp = redis_cmd(r, "KEYS rekv:*");
    ck_assert_int_eq(rp->type, REDIS_REPLY_ARRAY);
    char *out = NULL;
    for (size_t i = 0; i < rp->elements && out == NULL; i++) {
        const char *k = rp->element[i]->str, *tag = strchr(k, '{'), *end = strrchr(k, ':');
        ck_assert(tag && end && end > tag);
        if (strncmp(tag + 1, end + 1, 16) != 0)
            out = strdup(k);
    }
    freeReplyObject(rp);
    ck_assert_ptr_nonnull(out);
    return out;
}

/* ------------------------------------------------------------------ tests */

/* offload keeps KV blocks; kvpr KV and activation (ACT) blocks, two chains of two kinds */
static const char *const modes[] = {"offload", "kvpr"};

/* B serves A's prefix from Redis with A's tokens; a flipped bit in a value is refused. */
START_TEST(replica_reads_what_another_wrote)
{
    replica a, b;
    redis r;
    if (setup(&a, &b, &r, modes[_i]) < 0)
        return;
    tjob j1, j2;
    ct_make_salted_job(&j1, a.e.model, 1);
    ct_make_salted_job(&j2, a.e.model, 2);
    ck_assert_uint_eq(ct_run_cached(a.c, &j1), 0);  /* nothing anywhere yet */
    redis_wait_keys(&r, 2);                         /* its two full blocks, written through */
    ck_assert_uint_eq(ct_run_cached(b.c, &j1), 32); /* B's cache was empty: both from Redis */

    /* one bit of the second block's value flipped (past the header: the KV bytes) */
    redisReply *rp = redis_cmd(&r, "FLUSHALL");
    freeReplyObject(rp);
    ck_assert_uint_eq(ct_run_cached(a.c, &j2), 0);
    redis_wait_keys(&r, 2);
    char *key = second_block_key(&r);
    rp = redis_cmd(&r, "GETRANGE %s 200 200", key);
    ck_assert_int_eq(rp->type, REDIS_REPLY_STRING);
    ck_assert_int_eq((int)rp->len, 1);
    char flipped = (char)(rp->str[0] ^ 0x10);
    freeReplyObject(rp);
    rp = redis_cmd(&r, "SETRANGE %s 200 %b", key, &flipped, (size_t)1);
    freeReplyObject(rp);
    free(key);
    /* the first block is taken, the damaged second one computed: the same tokens */
    ck_assert_uint_eq(ct_run_cached(b.c, &j2), 16);
    teardown(&a, &b, &r);
    ct_free_jobs(&j1, 1);
    ct_free_jobs(&j2, 1);
}
END_TEST

/* kill -9 of replica A — its `rekv run` and each of its daemons — once A's prefix is in Redis:
 * B, whose cache is empty, still serves that prefix from Redis with A's tokens. */
START_TEST(replica_killed_its_prefix_stays)
{
    replica a, b;
    redis r;
    if (setup(&a, &b, &r, "offload") < 0)
        return;
    tjob j;
    ct_make_salted_job(&j, a.e.model, 3);
    ck_assert_uint_eq(ct_run_cached(a.c, &j), 0);
    redis_wait_keys(&r, 2);
    char path[64], line[512];
    snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)a.run, (int)a.run);
    FILE *f = fopen(path, "r"); /* A's daemons: SIGKILL, not the SIGTERM rekv run's death sends */
    ck_assert_ptr_nonnull(f);
    int killed = 0;
    if (fgets(line, sizeof(line), f))
        for (char *t = strtok(line, " \n"); t; t = strtok(NULL, " \n"))
            killed += kill((pid_t)atoi(t), SIGKILL) == 0;
    fclose(f);
    ck_assert_int_eq(killed, 3);
    tu_kill9(a.run);
    rekv_ctl_close(a.c);
    ck_assert_uint_eq(ct_run_cached(b.c, &j), 32); /* from Redis, with rekv_generate's tokens */
    replica_stop(&b);
    tu_kill9(r.pid);
    tu_rmrf(r.dir);
    free((char *)r.dir);
    ct_env_close(&a.e);
    ct_free_jobs(&j, 1);
}
END_TEST

/* Runs prompts of salt from, from + 1, ... on A then on B until B takes one whole from Redis:
 * both have reconnected (their backoff passed). Returns the next salt. */
static int until_shared(replica *a, replica *b, const redis *r, int from)
{
    for (int salt = from;; salt++) { /* Check's timeout is the guard */
        tjob j;
        ct_make_salted_job(&j, a->e.model, salt);
        long long keys = redis_int(r, "DBSIZE");
        ck_assert_uint_eq(ct_run_cached(a->c, &j), 0);
        /* A's writes land, or were dropped while it backed off: then the next prompt */
        for (int k = 0; k < 100 && redis_int(r, "DBSIZE") < keys + 2; k++)
            usleep(10000);
        uint32_t got = redis_int(r, "DBSIZE") >= keys + 2 ? ct_run_cached(b->c, &j) : 0;
        ct_free_jobs(&j, 1);
        if (got == 32)
            return salt + 1;
    }
}

/* redis-server killed while B's jobs read from it, restarted empty, and full: every job ends
 * with rekv_generate's tokens. */
START_TEST(redis_faults_never_fail_a_job)
{
    replica a, b;
    redis r;
    if (setup(&a, &b, &r, "offload") < 0)
        return;
    enum { N = 12 };
    static tjob jobs[N];
    for (int i = 0; i < N; i++)
        ct_make_salted_job(&jobs[i], a.e.model, 10 + i);
    tjob old;
    ct_make_salted_job(&old, a.e.model, 99);
    /* A computes them all (their blocks written through), then B runs them while Redis dies */
    ck_assert_int_eq(ct_submit_all(a.c, jobs, N), N);
    ct_wait_and_check(a.c, jobs, N);
    ck_assert_uint_eq(ct_run_cached(a.c, &old), 0);
    redis_wait_keys(&r, 2 * N + 2);
    ck_assert_int_eq(ct_submit_all(b.c, jobs, N), N);
    tu_kill9(r.pid);
    r.pid = 0;
    ct_wait_and_check(b.c, jobs, N);

    /* restarted empty: the prompt A computed before is not there any more; B computes it */
    redis_start(&r);
    ck_assert_uint_eq(ct_run_cached(b.c, &old), 0);
    int salt = until_shared(&a, &b, &r, 100); /* and both share again once reconnected */

    /* full: every SET refused with OOM; jobs go on and B computes what A could not store */
    redisReply *rp = redis_cmd(&r, "FLUSHALL");
    freeReplyObject(rp);
    rp = redis_cmd(&r, "CONFIG SET maxmemory-policy noeviction");
    freeReplyObject(rp);
    rp = redis_cmd(&r, "CONFIG SET maxmemory 1");
    freeReplyObject(rp);
    tjob full;
    ct_make_salted_job(&full, a.e.model, salt);
    ck_assert_uint_eq(ct_run_cached(a.c, &full), 0);
    for (;;) { /* A's two SETs were answered OOM (Redis counts them) */
        rp = redis_cmd(&r, "INFO errorstats");
        const char *oom = strstr(rp->str, "errorstat_OOM:count=");
        int n = oom ? atoi(oom + strlen("errorstat_OOM:count=")) : 0;
        freeReplyObject(rp);
        if (n >= 2)
            break;
        usleep(10000);
    }
    ck_assert_int_eq(redis_int(&r, "DBSIZE"), 0);
    ck_assert_uint_eq(ct_run_cached(b.c, &full), 0);
    teardown(&a, &b, &r);
    ct_free_jobs(jobs, N);
    ct_free_jobs(&old, 1);
    ct_free_jobs(&full, 1);
}
END_TEST

/* ------------------------------------------------------------------ rekv-kvstore alone */

static int32_t T[64], U[64]; /* two prompts */

static rekv_kv_prefix kpx(const int32_t *t, size_t n)
{
    return (rekv_kv_prefix){t, n, 0x5eedull, 0, 0};
}

static double metric(int port, const char *series)
{
    char *body = ms_scrape(port);
    ck_assert_int_gt(ms_check_exposition(body, strlen(body)), 0);
    double v = ms_value(body, series);
    free(body);
    ck_assert_msg(v == v, "no sample %s", series);
    return v;
}

/* Blocks [0, n) of seq (both layers) hold what kvd_write_blocks wrote for sequence src, gen. */
static void verify_as(rekv_kvstore_client *c, uint64_t seq, uint64_t n, uint64_t src, uint32_t gen)
{
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    rekv_kv_plan_block *pb = NULL;
    size_t nb, cap = 0;
    rekv_err err = {0};
    for (uint32_t l = 0; l < 2; l++) {
        rekv_kv_range rg = {seq, l, 0, n * 16};
        ck_assert_msg(rekv_kvstore_plan(c, &rg, 1, 1, &pb, &nb, &cap, &err) == 0, "pin: %s",
                      err.msg);
        ck_assert_int_eq(nb, n);
        for (size_t i = 0; i < nb; i++)
            ck_assert_msg(kvd_check(arena + pb[i].offset, kvd_type_bytes(c, pb[i].type), src, l,
                                    pb[i].block, gen),
                          "layer %u block %llu is not the other store's", l,
                          (unsigned long long)pb[i].block);
        ck_assert_int_eq(rekv_kvstore_unpin(c, &rg, 1, NULL), 0);
    }
    free(pb);
}

/* Every sequence dropped and the cache cleared: once the writer has let go of what it copied,
 * every slot of c's arena is free (Check's timeout is the guard). */
static void assert_all_back(rekv_kvstore_client *c)
{
    for (;;) {
        ck_assert_int_eq(rekv_kvstore_cache_clear(c, NULL), 0);
        rekv_kv_stats st;
        rekv_err err = {0};
        ck_assert_msg(rekv_kvstore_stats(c, &st, &err) == 0, "stats: %s", err.msg);
        ck_assert_int_eq(st.sequences, 0);
        ck_assert_int_eq(st.pinned_blocks, 0);
        if (st.host_kv + st.host_act + st.disk_kv + st.disk_act == 0 &&
            st.free_slots == st.total_slots && st.prefix_entries == 0)
            return;
        usleep(10000);
    }
}

static void kvd_remote(kvd *d, const redis *r, const char *timeout_ms, int port)
{
    char extra[4600];
    snprintf(extra, sizeof(extra), "--remote %s --remote-timeout-ms %s --metrics 127.0.0.1:%d",
             r->url, timeout_ms, port);
    kvd_start(d, 64, extra, 0);
}

START_TEST(store_reads_back_bit_for_bit)
{
    if (!have_redis())
        return;
    /* database 3, X and Y on the unix socket, Z over TCP */
    redis r = {.port = ms_free_port(), .db = 3};
    r.dir = tu_tmpdir();
    snprintf(r.sock, sizeof(r.sock), "%s/redis.sock", r.dir);
    snprintf(r.url, sizeof(r.url), "unix://%s?db=3", r.sock);
    redis_start(&r);
    for (int i = 0; i < 64; i++) {
        T[i] = 1000 + i * 7;
        U[i] = 3000 + i * 11;
    }
    int px_port = ms_free_port(), py_port = ms_free_port();
    kvd x, y;
    kvd_remote(&x, &r, "5000", px_port);
    rekv_kvstore_client *cx = kvd_client(&x);
    rekv_err err = {0};
    /* X: 40 tokens of T written and published: two full blocks (2 layers each) */
    ck_assert_int_eq(rekv_kvstore_seq_create(cx, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(cx, 1, 40, 0, 0, NULL, NULL), 0);
    kvd_write_blocks(cx, 1, 0, 2, 7);
    rekv_kv_prefix p = kpx(T, 40);
    ck_assert_msg(rekv_kvstore_publish(cx, 1, &p, NULL, &err) == 0, "publish: %s", err.msg);
    redis_wait_keys(&r, 2);
    /* Redis has them; the writer counts each as it reads its answer */
    while (metric(px_port, "rekv_kvstore_remote_writes_total{result=\"written\"}") < 2)
        usleep(10000);
    ck_assert_int_eq(metric(px_port, "rekv_kvstore_remote_writes_total{result=\"queued\"}"), 2);

    /* Y, empty: a sequence made from T's prefix gets X's blocks, byte for byte */
    kvd_remote(&y, &r, "5000", py_port);
    rekv_kvstore_client *cy = kvd_client(&y);
    rekv_kv_prefix_hit h;
    p = kpx(T, 39);
    ck_assert_msg(rekv_kvstore_seq_create_prefix(cy, 2, &p, &h, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(h.tokens, 32);
    ck_assert_int_eq(h.host_blocks, 4);
    verify_as(cy, 2, 2, 1, 7); /* what X's client wrote into X's sequence 1 */
    ck_assert_int_eq(metric(py_port, "rekv_kvstore_remote_blocks_total{result=\"hit\"}"), 4);
    ck_assert_int_eq(metric(py_port, "rekv_kvstore_remote_crc_errors_total"), 0);
    char *body = ms_scrape(py_port); /* the remote tier's families, as Prometheus reads them */
    ms_promtool(body);
    free(body);
    ck_assert_int_eq(metric(py_port, "rekv_kvstore_remote_writes_total{result=\"queued\"}"), 0);
    /* the same tokens under another model's fingerprint: other keys, nothing to read */
    p = (rekv_kv_prefix){T, 39, 0x5eedull + 1, 0, 0};
    ck_assert_msg(rekv_kvstore_seq_create_prefix(cy, 5, &p, &h, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(h.tokens, 0);
    ck_assert_int_eq(metric(py_port, "rekv_kvstore_remote_blocks_total{result=\"miss\"}"), 4);
    ck_assert_int_eq(rekv_kvstore_seq_drop(cy, 5, NULL), 0);

    /* U published on X; Redis stopped: Y's Lookup of U answers after its timeout with nothing */
    ck_assert_int_eq(rekv_kvstore_seq_create(cx, 3, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(cx, 3, 40, 0, 0, NULL, NULL), 0);
    kvd_write_blocks(cx, 3, 0, 2, 9);
    p = kpx(U, 40);
    ck_assert_int_eq(rekv_kvstore_publish(cx, 3, &p, NULL, NULL), 0);
    redis_wait_keys(&r, 4);
    kvd z;
    int pz_port = ms_free_port();
    redis tcp = r;
    snprintf(tcp.url, sizeof(tcp.url), "redis://127.0.0.1:%d/3", r.port);
    kvd_remote(&z, &tcp, "100", pz_port);
    rekv_kvstore_client *cz = kvd_client(&z);
    ck_assert_int_eq(kill(r.pid, SIGSTOP), 0);
    p = kpx(U, 39);
    ck_assert_int_eq(rekv_kvstore_lookup(cz, &p, &h, NULL), 0);
    ck_assert_int_eq(h.tokens, 0);
    ck_assert_int_ge(metric(pz_port, "rekv_kvstore_remote_timeouts_total") +
                         metric(pz_port, "rekv_kvstore_remote_read_errors_total"),
                     1);
    ck_assert_int_eq(kill(r.pid, SIGCONT), 0);
    /* answering again: a Lookup reads back too (its sequence then needs no read) */
    for (;;) { /* Z's reconnection backoff passes (Check's timeout is the guard) */
        ck_assert_int_eq(rekv_kvstore_lookup(cz, &p, &h, NULL), 0);
        if (h.tokens == 32)
            break;
        usleep(20000);
    }
    ck_assert_msg(rekv_kvstore_seq_create_prefix(cz, 4, &p, &h, &err) == 0, "%s", err.msg);
    ck_assert_int_eq(h.tokens, 32);
    ck_assert_int_eq(rekv_kvstore_seq_drop(cx, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(cx, 3, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(cy, 2, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(cz, 4, NULL), 0);
    assert_all_back(cx);
    assert_all_back(cy);
    assert_all_back(cz);
    rekv_kvstore_client_close(cx);
    rekv_kvstore_client_close(cy);
    rekv_kvstore_client_close(cz);
    kvd_stop(&x);
    kvd_stop(&y);
    kvd_stop(&z);
    tu_kill9(r.pid);
    tu_rmrf(r.dir);
    free((char *)r.dir);
}
END_TEST

START_TEST(bad_remote_is_a_usage_error)
{
    const char *bad[] = {"redis:/x",        "rediss://h:1",   "redis://h:0",    "redis://h:1/x",
                         "unix://rel/path", "unix:///p?db=x", "redis://u:p@h:1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char cmd[512];
        snprintf(cmd, sizeof(cmd),
                 "%s --endpoint ipc:///nonexistent/kv --host-bytes 1M --layers 2 --kv-heads 2 "
                 "--head-dim 32 --hidden 64 --remote '%s' 2>&1",
                 tu_bin("rekv-kvstore"), bad[i]);
        char *out = NULL;
        int st = tu_run(cmd, &out);
        ck_assert_msg(st == 2 && strstr(out, "--remote"), "%s: status %d: %s", bad[i], st, out);
        free(out);
    }
    const char *bad_ms[] = {"0", "10001", "x"}; /* a parked request waits at most 10 s */
    for (size_t i = 0; i < sizeof(bad_ms) / sizeof(bad_ms[0]); i++) {
        char cmd[512];
        snprintf(cmd, sizeof(cmd),
                 "%s --endpoint ipc:///nonexistent/kv --host-bytes 1M --layers 2 --kv-heads 2 "
                 "--head-dim 32 --hidden 64 --remote redis://h:1 --remote-timeout-ms %s 2>&1",
                 tu_bin("rekv-kvstore"), bad_ms[i]);
        char *out = NULL;
        int st = tu_run(cmd, &out);
        ck_assert_msg(st == 2 && strstr(out, "--remote-timeout-ms"), "%s: status %d: %s",
                      bad_ms[i], st, out);
        free(out);
    }
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("remote");
    TCase *tc = tcase_create("redis");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, replica_killed_its_prefix_stays);
    tcase_add_loop_test(tc, replica_reads_what_another_wrote, 0, 2);
    tcase_add_test(tc, redis_faults_never_fail_a_job);
    suite_add_tcase(s, tc);
    TCase *ts = tcase_create("store");
    tcase_set_timeout(ts, 60);
    tcase_add_test(ts, store_reads_back_bit_for_bit);
    tcase_add_test(ts, bad_remote_is_a_usage_error);
    suite_add_tcase(s, ts);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
