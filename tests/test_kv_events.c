/* test_kv_events.c — the kvstore's KV events for routers (rekv-kvstore --kv-events,
 * kvstore/events.c) against a real rekv-kvstore and a real ZeroMQ SUB socket: every message
 * decoded by an independent decoder (tests/kv_events_decode.py, python3-msgpack, which also
 * checks vLLM's wire format field by field), its sequence numbers consecutive, and the events
 * replayed as a router replays them (BlockStored adds, BlockRemoved takes away, AllBlocksCleared
 * empties) give exactly what the store holds: as many positions as its Stats says, each one's
 * chain of parents and token ids a prefix its Lookup finds whole, and every published prompt's
 * cached run found in the replay. Publishes, evictions in a small arena, ClearCache, a late
 * subscriber and a restart over a kept prefix cache (--prefix-dir), over ipc:// (the store
 * binds) and tcp:// (the store connects to a router's bound SUB, llm-d's centralized mode).
 *
 * And the gauges the Gateway API Inference Extension's endpoint picker scrapes (vLLM's names, on
 * the coordinator's --metrics): `rekv run --kv-events --metrics` with a real worker, the
 * requests waiting and running with the worker stopped (SIGSTOP: none ends) adding up to the
 * jobs the test submitted, as the coordinator's Stats counts them, and the KV cache usage fraction
 * equal to the store's own Stats: blocks only the prefix cache holds count as free (vLLM's
 * kv_cache_usage_perc), a sequence's blocks as used. */
#define _GNU_SOURCE
#include <check.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "coordinator/coordinator.h"
#include "kvstore/kvstore.h"
#include "tests/kvd.h"
#include "tests/metrics_scrape.h"
#include "tests/testutil.h"
#define MODEL_REL "models/stories260K/stories260K.bin"
#include "tests/co_env.h"

#define FP 0x1234abcdull
#define BT 16

/* ------------------------------------------------------------------ the subscriber */

typedef struct sub {
    void *ctx, *sock;
    char *raw; /* every message received: per frame, a 4-byte little-endian length, the bytes */
    size_t n_raw, cap_raw;
    size_t n_msgs;
    int cleared; /* a message held "AllBlocksCleared" (the picture told on joining) */
} sub;

static void raw_add(sub *s, const void *p, size_t n)
{
    if (s->n_raw + n + 4 > s->cap_raw) {
        s->cap_raw = (s->n_raw + n + 4) * 2;
        s->raw = realloc(s->raw, s->cap_raw);
        ck_assert_ptr_nonnull(s->raw);
    }
    uint32_t le = (uint32_t)n;
    for (int i = 0; i < 4; i++)
        s->raw[s->n_raw++] = (char)(le >> (8 * i));
    memcpy(s->raw + s->n_raw, p, n);
    s->n_raw += n;
}

/* A SUB socket subscribed to every topic: connected to endpoint, or bound when bind (its
 * tcp:// endpoint then in bound_ep). */
static void sub_open(sub *s, const char *endpoint, int bind, char *bound_ep, size_t len)
{
    memset(s, 0, sizeof(*s));
    s->ctx = zmq_ctx_new();
    s->sock = zmq_socket(s->ctx, ZMQ_SUB);
    ck_assert_ptr_nonnull(s->sock);
    int zero = 0;
    zmq_setsockopt(s->sock, ZMQ_LINGER, &zero, sizeof(zero));
    ck_assert_int_eq(zmq_setsockopt(s->sock, ZMQ_SUBSCRIBE, "", 0), 0);
    if (bind) {
        ck_assert_int_eq(zmq_bind(s->sock, endpoint), 0);
        ck_assert_int_eq(zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, bound_ep, &len), 0);
    } else {
        ck_assert_int_eq(zmq_connect(s->sock, endpoint), 0);
    }
}

static void sub_close(sub *s)
{
    zmq_close(s->sock);
    zmq_ctx_term(s->ctx);
    free(s->raw);
}

/* Receives one message (waiting for it: Check's timeout is the guard); 1 when its payload holds
 * token tok as msgpack writes a uint32 (0xce, big-endian) and an AllBlocksCleared came before or
 * with it — how the test knows a barrier block's BlockStored came after the picture the
 * subscriber is told on joining (a batch may reach it just before that picture). */
static int sub_recv(sub *s, uint32_t tok)
{
    int found = 0;
    for (int f = 0; f < 3; f++) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        ck_assert_int_ge(zmq_msg_recv(&m, s->sock, 0), 0);
        ck_assert_int_eq(zmq_msg_more(&m), f < 2); /* three frames */
        raw_add(s, zmq_msg_data(&m), zmq_msg_size(&m));
        if (f == 2 && tok) {
            uint8_t pat[5] = {0xce, tok >> 24, tok >> 16, tok >> 8, tok};
            const uint8_t *d = zmq_msg_data(&m);
            for (size_t i = 0; i + 5 <= zmq_msg_size(&m) && !found; i++)
                found = memcmp(d + i, pat, 5) == 0;
            s->cleared |= memmem(d, zmq_msg_size(&m), "AllBlocksCleared", 16) != NULL;
        }
        zmq_msg_close(&m);
    }
    s->n_msgs++;
    return found && s->cleared;
}

/* vLLM's replay (--kv-events-replay): a DEALER asks for every batch from the first one s
 * received; the store's answer, up to its end marker, is byte for byte what s received. */
static void replay_check(sub *s, const char *endpoint)
{
    ck_assert_uint_ge(s->n_raw, 16);
    uint32_t tl = (uint8_t)s->raw[0] | (uint8_t)s->raw[1] << 8; /* the first topic's length */
    const char *first_seq = s->raw + 4 + tl + 4;                /* its sequence number */
    void *d = zmq_socket(s->ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof(zero));
    ck_assert_int_eq(zmq_connect(d, endpoint), 0);
    ck_assert_int_eq(zmq_send(d, "", 0, ZMQ_SNDMORE), 0);
    ck_assert_int_eq(zmq_send(d, first_seq, 8, 0), 8);
    sub r = {0};
    for (int end = 0; !end;) {
        zmq_msg_t m[5];
        int n = 0;
        for (int more = 1; more; n++) {
            ck_assert_int_lt(n, 5);
            zmq_msg_init(&m[n]);
            ck_assert_int_ge(zmq_msg_recv(&m[n], d, 0), 0);
            more = zmq_msg_more(&m[n]);
        }
        ck_assert_int_eq(n, 4); /* "", topic, seq, payload; the end: "", "", -1, "" */
        ck_assert_int_eq(zmq_msg_size(&m[0]), 0);
        ck_assert_int_eq(zmq_msg_size(&m[2]), 8);
        end = memcmp(zmq_msg_data(&m[2]), "\xff\xff\xff\xff\xff\xff\xff\xff", 8) == 0;
        for (int f = 1; f < 4 && !end; f++)
            raw_add(&r, zmq_msg_data(&m[f]), zmq_msg_size(&m[f]));
        for (int f = 0; f < n; f++)
            zmq_msg_close(&m[f]);
    }
    zmq_close(d);
    ck_assert_uint_eq(r.n_raw, s->n_raw);
    ck_assert_int_eq(memcmp(r.raw, s->raw, s->n_raw), 0);
    free(r.raw);
}

/* ------------------------------------------------------------------ the store's side */

static int32_t T[512], U[512];

static rekv_kv_prefix px(const int32_t *t, size_t n)
{
    return (rekv_kv_prefix){t, n, FP, 0, 0};
}

static rekv_kv_stats stats(rekv_kvstore_client *c)
{
    rekv_kv_stats st;
    rekv_err err = {0};
    ck_assert_msg(rekv_kvstore_stats(c, &st, &err) == 0, "stats: %s", err.msg);
    return st;
}

/* seq with the first n tokens of t written and published (its full blocks). */
static void publish(rekv_kvstore_client *c, uint64_t seq, const int32_t *t, size_t n)
{
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, seq, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, seq, n, 0, 0, NULL, &err) == 0, "append: %s", err.msg);
    kvd_write_blocks(c, seq, 0, n / BT, 1);
    rekv_kv_prefix p = px(t, n);
    rekv_kv_prefix_hit h;
    ck_assert_msg(rekv_kvstore_publish(c, seq, &p, &h, &err) == 0, "publish: %s", err.msg);
}

/* A barrier: a one-block prompt of its own published; returns once its BlockStored came, so
 * that every event the store told before it came too (one connection keeps the order). */
static void barrier(rekv_kvstore_client *c, sub *s)
{
    static uint32_t k;
    int32_t b[BT];
    uint32_t tok = 0x7b000000u + (++k) * BT;
    for (int i = 0; i < BT; i++)
        b[i] = (int32_t)(tok + (uint32_t)i);
    publish(c, 90000 + k, b, BT);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 90000 + k, NULL), 0);
    while (!sub_recv(s, tok))
        ;
}

/* ------------------------------------------------------------------ the router's view */

typedef struct pos {
    uint64_t hash, parent;
    int has_parent, live;
    uint32_t tokens[BT];
} pos;

typedef struct view {
    pos *p;
    size_t n, cap;
    size_t stored, removed, cleared; /* events replayed (blocks for the first two) */
    size_t chains_whole;             /* view_check: held positions with every ancestor held */
} view;

static pos *view_find(view *v, uint64_t h)
{
    for (size_t i = 0; i < v->n; i++)
        if (v->p[i].live && v->p[i].hash == h)
            return &v->p[i];
    return NULL;
}

static uint64_t hash_of(json_t *j)
{
    ck_assert_msg(json_is_string(j), "a hash is a decimal string");
    return strtoull(json_string_value(j), NULL, 10);
}

static void view_apply(view *v, json_t *ev)
{
    const char *type = json_string_value(json_object_get(ev, "type"));
    json_t *hashes = json_object_get(ev, "block_hashes"), *h;
    size_t i;
    if (strcmp(type, "AllBlocksCleared") == 0) {
        v->n = 0;
        v->cleared++;
    } else if (strcmp(type, "BlockRemoved") == 0) {
        json_array_foreach(hashes, i, h)
        {
            pos *p = view_find(v, hash_of(h));
            ck_assert_msg(p != NULL, "BlockRemoved of a block never stored");
            p->live = 0;
            v->removed++;
        }
    } else {
        json_t *par = json_object_get(ev, "parent_block_hash"), *toks;
        toks = json_object_get(ev, "token_ids");
        json_array_foreach(hashes, i, h)
        {
            ck_assert_msg(view_find(v, hash_of(h)) == NULL, "a block stored twice");
            if (v->n == v->cap) {
                v->cap = v->cap ? v->cap * 2 : 64;
                v->p = realloc(v->p, v->cap * sizeof(pos));
            }
            pos *p = &v->p[v->n++];
            p->hash = hash_of(h);
            p->live = 1;
            /* the first block's parent is the event's; each next block's, the block before */
            p->has_parent = i > 0 || !json_is_null(par);
            p->parent = i > 0 ? v->p[v->n - 2].hash : p->has_parent ? hash_of(par) : 0;
            for (int t = 0; t < BT; t++)
                p->tokens[t] = (uint32_t)json_integer_value(json_array_get(toks, i * BT + t));
            v->stored++;
        }
    }
}

/* Decodes every message so far with the independent decoder and replays them from the first
 * AllBlocksCleared (the whole picture each subscriber is told as it joins). */
static void view_build(sub *s, view *v, const char *dir, int array, const char *topic)
{
    char path[4300], cmd[4500], *out = NULL;
    snprintf(path, sizeof(path), "%s/messages.bin", dir);
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fwrite(s->raw, 1, s->n_raw, f), s->n_raw);
    fclose(f);
    snprintf(cmd, sizeof(cmd), "/usr/bin/python3 tests/kv_events_decode.py %s%s 2>&1", path,
             array ? " --array" : "");
    int rc = tu_run(cmd, &out);
    ck_assert_msg(rc == 0, "decoder: %s", out);
    memset(v, 0, sizeof(*v));
    size_t n_msgs = 0;
    long long last_seq = -1;
    int started = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        json_error_t je;
        json_t *m = json_loads(line, 0, &je);
        ck_assert_msg(m != NULL, "decoder's JSON: %s", je.text);
        long long seq = json_integer_value(json_object_get(m, "seq"));
        ck_assert_str_eq(json_string_value(json_object_get(m, "topic")), topic);
        ck_assert_msg(last_seq < 0 || seq == last_seq + 1,
                      "sequence %lld after %lld: consecutive, none dropped", seq, last_seq);
        last_seq = seq;
        json_t *evs = json_object_get(m, "events"), *ev;
        size_t i;
        json_array_foreach(evs, i, ev)
        {
            started |=
                strcmp(json_string_value(json_object_get(ev, "type")), "AllBlocksCleared") == 0;
            if (started)
                view_apply(v, ev);
        }
        json_decref(m);
        n_msgs++;
    }
    ck_assert_int_eq(n_msgs, s->n_msgs);
    ck_assert_msg(started, "no AllBlocksCleared: a subscriber is told one as it joins");
    free(out);
}

static size_t view_live(const view *v)
{
    size_t n = 0;
    for (size_t i = 0; i < v->n; i++)
        n += v->p[i].live;
    return n;
}

/* The position of hash h the view knows, held or removed (the held one first). */
static pos *view_find_any(view *v, uint64_t h)
{
    pos *p = view_find(v, h);
    for (size_t i = v->n; p == NULL && i-- > 0;)
        if (v->p[i].hash == h)
            p = &v->p[i];
    return p;
}

/* The view is what the store holds: its count is the store's; each held position's chain
 * (parents up to one with none, each a block the events told) spells a prompt the store's Lookup
 * finds up to the first block of it the events removed — the whole chain when none was. (The
 * store evicts by its blocks' LRU, so a chain may lose a block before its children.) */
static void view_check(view *v, rekv_kvstore_client *c)
{
    ck_assert_int_eq(view_live(v), stats(c).prefix_entries);
    int32_t toks[64 * BT];
    for (size_t i = 0; i < v->n; i++) {
        if (!v->p[i].live)
            continue;
        pos *chain[64];
        size_t depth = 0, held = 0;
        for (pos *p = &v->p[i];; p = view_find_any(v, p->parent)) {
            ck_assert_msg(p != NULL, "a block's parent was never told");
            ck_assert_uint_lt(depth, 64);
            chain[depth++] = p;
            if (!p->has_parent)
                break;
        }
        while (held < depth && chain[depth - 1 - held]->live)
            held++;
        for (size_t d = 0; d < depth; d++)
            for (int t = 0; t < BT; t++)
                toks[d * BT + t] = (int32_t)chain[depth - 1 - d]->tokens[t];
        rekv_kv_prefix p = px(toks, depth * BT);
        rekv_kv_prefix_hit h;
        ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
        ck_assert_msg(h.blocks == held,
                      "the events' chain of %zu blocks, %zu held from its root: the store finds "
                      "%llu",
                      depth, held, (unsigned long long)h.blocks);
        v->chains_whole += held == depth;
    }
}

/* The run of prompt t (n tokens) the view holds, root first: what a router would score. */
static uint64_t view_match(view *v, const int32_t *t, size_t n)
{
    uint64_t k = 0;
    pos *prev = NULL;
    for (; k < n / BT; k++) {
        pos *next = NULL;
        for (size_t i = 0; i < v->n && next == NULL; i++) {
            pos *p = &v->p[i];
            if (p->live && (prev ? p->has_parent && p->parent == prev->hash : !p->has_parent) &&
                memcmp(p->tokens, t + k * BT, sizeof(p->tokens)) == 0)
                next = p;
        }
        if (next == NULL)
            break;
        prev = next;
    }
    return k;
}

static void check_prompt(view *v, rekv_kvstore_client *c, const int32_t *t, size_t n)
{
    rekv_kv_prefix p = px(t, n);
    rekv_kv_prefix_hit h;
    ck_assert_int_eq(rekv_kvstore_lookup(c, &p, &h, NULL), 0);
    ck_assert_int_eq(view_match(v, t, n), h.blocks);
}

static void view_free(view *v)
{
    free(v->p);
}

static void tokens_init(void)
{
    for (int i = 0; i < 512; i++) {
        T[i] = 1000 + i * 7;
        U[i] = i < 32 ? T[i] : 500000 + i; /* shares T's first two blocks */
    }
}

/* ------------------------------------------------------------------ the cases */

/* ipc:// (the store binds). 24 slots, no spill tier: 12 positions of 2 layers. Published
 * prompts, a shared prefix told once, evictions for a running sequence, ClearCache. */
START_TEST(publish_evict_clear)
{
    tokens_init();
    char *dir = tu_tmpdir(), ep[4200], extra[4400];
    snprintf(ep, sizeof(ep), "ipc://%s/events.sock", dir);
    int port = ms_free_port();
    snprintf(extra, sizeof(extra), "--no-spill --kv-events %s --metrics 127.0.0.1:%d", ep, port);
    kvd d;
    kvd_start(&d, 24, extra, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    sub s;
    sub_open(&s, ep, 0, NULL, 0);
    view v;

    publish(c, 1, T, 72); /* 4 full blocks and a partial one: 4 positions */
    publish(c, 2, U, 64); /* T's first two blocks already cached: 2 new ones */
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    barrier(c, &s);
    view_build(&s, &v, dir, 0, "");
    ck_assert_int_eq(view_live(&v), 7); /* T's 4, U's 2, the barrier's 1 */
    view_check(&v, c);
    check_prompt(&v, c, T, 72);
    check_prompt(&v, c, U, 64);
    view_free(&v);

    /* a running sequence of 9 positions: 18 slots, the 24 less what stays cached */
    rekv_err err = {0};
    ck_assert_int_eq(rekv_kvstore_seq_create(c, 3, NULL), 0);
    ck_assert_msg(rekv_kvstore_append(c, 3, 9 * BT, 0, 0, NULL, &err) == 0, "%s", err.msg);
    ck_assert_uint_gt(stats(c).prefix_evictions, 0);
    barrier(c, &s);
    view_build(&s, &v, dir, 0, "");
    ck_assert_uint_gt(v.removed, 0);
    view_check(&v, c);
    ck_assert_uint_gt(v.chains_whole, 0);
    check_prompt(&v, c, T, 72);
    check_prompt(&v, c, U, 64);
    view_free(&v);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 3, NULL), 0);

    /* ClearCache: one AllBlocksCleared, then the barrier alone */
    ck_assert_int_eq(rekv_kvstore_cache_clear(c, NULL), 0);
    barrier(c, &s);
    view_build(&s, &v, dir, 0, "");
    ck_assert_uint_ge(v.cleared, 2); /* the one on joining, ClearCache's */
    ck_assert_int_eq(view_live(&v), 1);
    view_check(&v, c);
    check_prompt(&v, c, T, 72);
    /* the store's own counts: blocks told, batches sent, none dropped */
    char *m = ms_scrape(port);
    ms_check_exposition(m, strlen(m));
    ck_assert_double_ge(ms_value(m, "rekv_kvstore_kv_events_total{type=\"stored\"}"), v.stored);
    ck_assert_double_ge(ms_value(m, "rekv_kvstore_kv_events_total{type=\"cleared\"}"), 2);
    ck_assert_double_ge(ms_value(m, "rekv_kvstore_kv_event_batches_total{outcome=\"sent\"}"),
                        s.n_msgs);
    ck_assert_double_eq(ms_value(m, "rekv_kvstore_kv_event_batches_total{outcome=\"dropped\"}"), 0);
    free(m);
    view_free(&v);

    sub_close(&s);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* A subscriber that joins late is told the whole picture, parents first; vLLM's replay socket
 * sends it all again. */
START_TEST(late_subscriber_told_everything)
{
    tokens_init();
    char *dir = tu_tmpdir(), ep[1024], rep[1024], extra[2200];
    snprintf(ep, sizeof(ep), "ipc://%s/events.sock", dir);
    snprintf(rep, sizeof(rep), "ipc://%s/replay.sock", dir);
    snprintf(extra, sizeof(extra), "--kv-events %s --kv-events-format array --kv-events-replay %s",
             ep, rep);
    kvd d;
    kvd_start(&d, 64, extra, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    publish(c, 1, U, 64);
    publish(c, 2, T, 128); /* T's blocks 2.. are children of blocks U published */
    sub s;
    sub_open(&s, ep, 0, NULL, 0);
    barrier(c, &s);
    view v;
    view_build(&s, &v, dir, 1, "");
    ck_assert_int_eq(view_live(&v), 11);
    view_check(&v, c);
    check_prompt(&v, c, T, 128);
    check_prompt(&v, c, U, 64);
    view_free(&v);
    replay_check(&s, rep);
    sub_close(&s);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 2, NULL), 0);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* tcp://: the router binds, the store connects (llm-d's centralized mode); a restart over a kept
 * prefix cache tells AllBlocksCleared and the blocks it kept, parents first. */
START_TEST(restart_kept_cache_over_tcp)
{
    tokens_init();
    char *dir = tu_tmpdir(), ep[256], extra[4600];
    sub s;
    sub_open(&s, "tcp://127.0.0.1:*", 1, ep, sizeof(ep));
    snprintf(extra, sizeof(extra), "--prefix-dir %s --kv-events %s --kv-events-topic kv@a@m", dir,
             ep);
    kvd d;
    kvd_start(&d, 64, extra, 0);
    rekv_kvstore_client *c = kvd_client(&d);
    publish(c, 1, T, 80);
    ck_assert_int_eq(rekv_kvstore_seq_drop(c, 1, NULL), 0);
    barrier(c, &s);
    view v;
    view_build(&s, &v, dir, 0, "kv@a@m");
    ck_assert_int_eq(view_live(&v), 6);
    view_check(&v, c);
    view_free(&v);
    rekv_kvstore_client_close(c);
    kvd_stop(&d); /* a clean stop writes the cache to disk */

    free(s.raw); /* the restarted store's messages alone */
    s.raw = NULL;
    s.n_raw = s.cap_raw = s.n_msgs = 0;
    s.cleared = 0;
    kvd_start(&d, 64, extra, 0);
    c = kvd_client(&d);
    barrier(c, &s);
    view_build(&s, &v, dir, 0, "kv@a@m");
    ck_assert_int_eq(view_live(&v), 7); /* the 6 kept, the barrier */
    view_check(&v, c);
    check_prompt(&v, c, T, 80);
    view_free(&v);
    rekv_kvstore_client_close(c);
    kvd_stop(&d);
    sub_close(&s);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ------------------------------------------------------------------ the gauges */

/* The gpuworker `rekv run` (pid run) started: its child of that name. */
static pid_t run_worker_pid(pid_t run)
{
    char path[64], comm[64], *kids;
    snprintf(path, sizeof(path), "/proc/%d/task/%d/children", run, run);
    kids = tu_read_file(path, NULL);
    ck_assert_ptr_nonnull(kids);
    pid_t found = 0;
    for (char *t = strtok(kids, " \n"); t && !found; t = strtok(NULL, " \n")) {
        snprintf(path, sizeof(path), "/proc/%s/comm", t);
        char *c = tu_read_file(path, NULL);
        if (c && sscanf(c, "%63s", comm) == 1 && strcmp(comm, "rekv-gpuworker") == 0)
            found = (pid_t)atoi(t);
        free(c);
    }
    free(kids);
    ck_assert_int_gt(found, 0);
    return found;
}

/* A scrape of the coordinator's port: well-formed, and each of the protocol's gauges typed so. */
static char *scrape(int port)
{
    char *m = ms_scrape(port);
    ms_check_exposition(m, strlen(m));
    static const char *const g[] = {"vllm:num_requests_waiting", "vllm:num_requests_running",
                                    "vllm:kv_cache_usage_perc"};
    for (int i = 0; i < 3; i++) {
        char line[128];
        snprintf(line, sizeof(line), "# TYPE %s gauge\n", g[i]);
        ck_assert_msg(strstr(m, line) != NULL, "no %s", line);
    }
    return m;
}

/* Scrapes until the usage gauge reads want (the worker tells the coordinator the store's room
 * with its messages, refreshed every second: no deadline of our own). */
static void wait_usage(int port, double want)
{
    for (;;) {
        char *m = scrape(port);
        double v = ms_value(m, "vllm:kv_cache_usage_perc");
        free(m);
        if (v == want)
            return;
        usleep(50000);
    }
}

/* The store's KV usage as vLLM counts it, from its Stats: in use less the cache's own. */
static double store_usage(rekv_kvstore_client *k)
{
    rekv_kv_stats st;
    ct_kv_stats(k, &st);
    return (double)(st.host_used_bytes - st.prefix_host_bytes) / (double)st.host_bytes;
}

START_TEST(router_gauges_and_run_events)
{
    env e;
    if (ct_env_open(&e))
        return;
    int port = ms_free_port();
    char ports[32], ep[4300];
    snprintf(ports, sizeof(ports), "127.0.0.1:%d", port);
    snprintf(ep, sizeof(ep), "ipc://%s/events.sock", e.dir);
    const char *extra[] = {"--metrics",           ports,     "--kv-events", ep,
                           "--worker-timeout-ms", "3600000", NULL};
    pid_t run = ct_rekv_run_start_args(&e, "8M", "2", "offload", extra);
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    rekv_kvstore_client *k = ct_kv_open(&e);
    sub s;
    sub_open(&s, ep, 0, NULL, 0);

    /* a job's prompt published by the worker: two full blocks a router sees, root first */
    static tjob a;
    memset(&a, 0, sizeof(a));
    a.n_prompt = 40;
    for (int i = 0; i < 40; i++)
        a.prompt[i] = 1 + (i * 37 + 5) % 500;
    a.gp = (rekv_gen_params){.max_new_tokens = 8, .top_p = 1.0f};
    ct_reference(&a, 1, e.model);
    ck_assert_int_eq(ct_submit_all(c, &a, 1), 1);
    ct_wait_and_check(c, &a, 1);
    barrier(k, &s);
    view v;
    view_build(&s, &v, e.dir, 0, "");
    rekv_kv_stats st;
    ct_kv_stats(k, &st);
    ck_assert_int_eq(view_live(&v), st.prefix_entries);
    ck_assert_int_eq(view_match(&v, a.prompt, 32), 2);
    view_free(&v);

    /* the cache's blocks fill the arena but count as free; a sequence's count as used */
    ck_assert_uint_gt(st.host_used_bytes, 0);
    wait_usage(port, 0);
    ck_assert_int_eq(rekv_kvstore_seq_create(k, 77, NULL), 0);
    ck_assert_int_eq(rekv_kvstore_append(k, 77, 4 * BT, 0, 0, NULL, NULL), 0);
    ct_kv_stats(k, &st);
    rekv_kv_geometry g;
    rekv_kvstore_client_geometry(k, &g);
    double want = store_usage(k); /* 4 blocks in every layer */
    ck_assert_double_eq(want, (double)(4 * g.n_layers * st.kv_slot_bytes) / (double)st.host_bytes);
    wait_usage(port, want);
    ck_assert_int_eq(rekv_kvstore_seq_drop(k, 77, NULL), 0);
    wait_usage(port, 0);

    /* the worker stopped: the coordinator gives it what its Plans can carry (one or two jobs,
     * as the submissions meet its rounds), the rest wait; nothing ends while it is stopped */
    pid_t wpid = run_worker_pid(run);
    ck_assert_int_eq(kill(wpid, SIGSTOP), 0);
    static tjob jobs[5];
    ct_make_jobs(jobs, 5, 40, 512, 3);
    ct_reference(jobs, 5, e.model);
    ck_assert_int_eq(ct_submit_all(c, jobs, 5), 5);
    for (;;) { /* a scrape between two equal Stats (admission only goes one way while stopped) */
        Rekv__Control__Response *r0 = ct_stats(c);
        char *m = scrape(port);
        Rekv__Control__Response *r1 = ct_stats(c);
        uint32_t run_n = r1->stats->running, queued = r1->stats->queued;
        int same = r0->stats->running == run_n && r0->stats->queued == queued && run_n > 0;
        rekv__control__response__free_unpacked(r0, NULL);
        rekv__control__response__free_unpacked(r1, NULL);
        if (same) {
            ck_assert_uint_eq(run_n + queued, 5);
            ck_assert_double_eq(ms_value(m, "vllm:num_requests_waiting"), queued);
            ck_assert_double_eq(ms_value(m, "vllm:num_requests_running"), run_n);
            ck_assert_double_eq(ms_value(m, "rekv_jobs{state=\"queued\"}"), queued);
            ck_assert_double_eq(ms_value(m, "rekv_jobs{state=\"running\"}"), run_n);
            ck_assert_int_ne(ms_promtool(m), 1);
        }
        free(m);
        if (same)
            break;
    }
    ck_assert_int_eq(kill(wpid, SIGCONT), 0);
    ct_wait_and_check(c, jobs, 5);
    char *m = scrape(port);
    ck_assert_double_eq(ms_value(m, "vllm:num_requests_waiting"), 0);
    ck_assert_double_eq(ms_value(m, "vllm:num_requests_running"), 0);
    free(m);

    ct_free_jobs(jobs, 5);
    ct_free_jobs(&a, 1);
    sub_close(&s);
    rekv_kvstore_client_close(k);
    rekv_ctl_close(c);
    ct_rekv_run_stop(run);
    ct_env_close(&e);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("kv_events");
    TCase *tc = tcase_create("events");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, publish_evict_clear);
    tcase_add_test(tc, late_subscriber_told_everything);
    tcase_add_test(tc, restart_kept_cache_over_tcp);
    suite_add_tcase(s, tc);
    tc = tcase_create("gauges");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, router_gauges_and_run_events);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
