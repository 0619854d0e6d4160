/* bench.c — `rekv bench kvstore`: measures, in one run and as ratios against a baseline measured
 * in the same run, (a) gathering N random blocks out of the arena against one memcpy of the same
 * bytes, (b) the spill engine's write and read-back throughput at queue depth 32, one KV block per
 * request, against fio (io_uring, O_DIRECT, same directory, block size and depth), and (c) the
 * round-trip latency of plan requests for 1, 64 and 4096 blocks against a private rekv-kvstore
 * server (a forked child running the server library). Prints one JSON object on stdout. */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "kvstore/kv_internal.h"
#include "kvstore/kvstore.h"

typedef struct bench_opts {
    int json;               /* --json (the output is JSON either way) */
    uint32_t gather_blocks; /* --blocks */
    uint32_t spill_blocks;  /* --spill-blocks */
    uint64_t host_mib;      /* --host-mib */
    const char *dir;        /* --spill-dir */
    int no_fio;             /* --no-fio */
    uint32_t plan_iters;    /* --plan-iters (for 1 block; fewer for bigger plans) */
    rekv_kv_geometry g;     /* OPT-6.7B-like: 32 kv heads x 128, hidden 4096, fp16 */
} bench_opts;

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* ------------------------------------------------------------------ (b) spill engine vs fio */

static int bench_spill(const bench_opts *o, json_t *out, rekv_err *err)
{
    int rc = 0;
    kv_arena a;
    kv_spill *sp = NULL;
    size_t kvb = rekv_kv_block_bytes(&o->g);
    uint64_t host = 4096 + (uint64_t)o->spill_blocks * ((kvb + 4095) / 4096 * 4096);
    rc = kv_arena_create(&a, host, &o->g, 0, 1000, NULL, 0, err);
    if (rc < 0)
        return rc;
    uint64_t n = a.n_slots < o->spill_blocks ? a.n_slots : o->spill_blocks;
    uint64_t seed = 88172645463325252ull;
    for (uint64_t i = 0; i < n * a.slot_bytes / 8; i++)
        ((uint64_t *)a.slots)[i] = xorshift(&seed);
    kv_spill_config sc = {.dir = o->dir, .slots = a.slots, .n_slots = a.n_slots,
                          .slot_bytes = a.slot_bytes, .depth = 32, .register_arena = 1};
    if ((rc = kv_spill_open(&sc, &sp, err)) < 0)
        goto out;
    uint32_t *crc = calloc(n, sizeof(uint32_t));
    if (crc == NULL) {
        rc = rekv_errf(err, -ENOMEM, "bench: out of memory");
        goto out;
    }
    double secs[2];
    uint64_t bad = 0;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t next = 0, done = 0, t0 = rekv_now_ns();
        kv_spill_done d[32];
        while (done < n) {
            while (next < n && kv_spill_in_flight(sp) < 32) {
                uint64_t off = next * a.slot_bytes;
                int q = pass == 0 ? kv_spill_write(sp, off, (uint32_t)next, kvb, next, &crc[next])
                                  : kv_spill_read(sp, off, (uint32_t)next, kvb, next);
                if (q < 0)
                    break;
                next++;
            }
            if ((rc = kv_spill_submit(sp)) < 0) {
                rekv_errf(err, rc, "bench: io_uring submit: %s", strerror(-rc));
                goto out_crc;
            }
            int got = kv_spill_reap(sp, d, 32, 1);
            for (int i = 0; i < got; i++) {
                if (d[i].res < 0) {
                    rc = rekv_errf(err, d[i].res, "bench: spill %s failed: %s",
                                   pass ? "read" : "write", strerror(-d[i].res));
                    goto out_crc;
                }
                if (pass == 1 && d[i].crc != crc[d[i].tag])
                    bad++;
            }
            done += (uint64_t)(got > 0 ? got : 0);
        }
        secs[pass] = (double)(rekv_now_ns() - t0) * 1e-9;
    }
    double bytes = (double)n * (double)a.slot_bytes;
    json_t *j = json_object();
    json_object_set_new(j, "blocks", json_integer((json_int_t)n));
    json_object_set_new(j, "block_bytes", json_integer((json_int_t)a.slot_bytes));
    json_object_set_new(j, "queue_depth", json_integer(32));
    json_object_set_new(j, "direct_io", json_boolean(kv_spill_direct(sp)));
    json_object_set_new(j, "registered_arena", json_boolean(kv_spill_registered(sp)));
    json_object_set_new(j, "write_gbps", json_real(bytes / secs[0] * 1e-9));
    json_object_set_new(j, "read_gbps", json_real(bytes / secs[1] * 1e-9));
    json_object_set_new(j, "crc_mismatches", json_integer((json_int_t)bad));
    /* fio on a file in the same directory, same block size, depth and byte count */
    int have_fio = !o->no_fio && system("command -v fio >/dev/null 2>&1") == 0;
    if (have_fio) {
        char path[4200], cmd[8600];
        snprintf(path, sizeof(path), "%s/rekv-bench-fio.%d", o->dir, (int)getpid());
        double fio_gbps[2] = {0, 0};
        for (int pass = 0; pass < 2 && have_fio; pass++) {
            snprintf(cmd, sizeof(cmd),
                     "fio --name=rekv --filename='%s' --ioengine=io_uring --direct=1 --bs=%llu "
                     "--iodepth=32 --rw=%s --size=%llu --output-format=json 2>/dev/null",
                     path, (unsigned long long)a.slot_bytes, pass ? "read" : "write",
                     (unsigned long long)bytes);
            FILE *p = popen(cmd, "r");
            json_t *fj = p ? json_loadf(p, JSON_DISABLE_EOF_CHECK, NULL) : NULL;
            if (p)
                pclose(p);
            json_t *job = fj ? json_array_get(json_object_get(fj, "jobs"), 0) : NULL;
            json_t *bw = job ? json_object_get(json_object_get(job, pass ? "read" : "write"),
                                               "bw_bytes")
                             : NULL;
            if (bw && json_is_number(bw))
                fio_gbps[pass] = json_number_value(bw) * 1e-9;
            else
                have_fio = 0;
            json_decref(fj);
        }
        unlink(path);
        if (have_fio) {
            json_object_set_new(j, "fio_write_gbps", json_real(fio_gbps[0]));
            json_object_set_new(j, "fio_read_gbps", json_real(fio_gbps[1]));
            json_object_set_new(j, "write_ratio", json_real(bytes / secs[0] * 1e-9 / fio_gbps[0]));
            json_object_set_new(j, "read_ratio", json_real(bytes / secs[1] * 1e-9 / fio_gbps[1]));
        }
    }
    if (!have_fio)
        json_object_set_new(j, "fio", json_string("not run (not installed, --no-fio, or failed)"));
    json_object_set_new(out, "spill", j);
out_crc:
    free(crc);
out:
    kv_spill_close(sp);
    kv_arena_destroy(&a);
    return rc;
}

/* ------------------------------------------------------------------ private server */

static pid_t start_server(const bench_opts *o, const char *endpoint, rekv_err *err)
{
    rekv_kvstore_config cfg;
    rekv_kvstore_config_defaults(&cfg);
    cfg.endpoint = endpoint;
    cfg.host_bytes = o->host_mib << 20;
    cfg.spill_dir = o->dir;
    cfg.geometry = o->g;
    /* one client that holds its pins while it fills and gathers without renewing them: on a
     * loaded machine that outlasts the default 5 s lease, and lost pins are not what it measures */
    cfg.lease_ms = 600000;
    pid_t pid;
    int rc = rekv_kvstore_spawn(&cfg, &pid, err);
    return rc < 0 ? rc : pid;
}

/* ------------------------------------------------------------------ (a) gather, (c) plan */

static int bench_server(const bench_opts *o, json_t *out, rekv_err *err)
{
    int rc = 0;
    char dir[4200], endpoint[4300];
    snprintf(dir, sizeof(dir), "%s/rekv-bench.XXXXXX", o->dir);
    if (mkdtemp(dir) == NULL)
        return rekv_errf(err, -errno, "bench: mkdtemp in %s: %s", o->dir, strerror(errno));
    snprintf(endpoint, sizeof(endpoint), "ipc://%s/kv.sock", dir);
    rekv_kvstore_client *c = NULL;
    rekv_kv_plan_block *pb = NULL;
    uint8_t *buf = NULL;
    uint64_t *lat = NULL;
    size_t n = 0, cap = 0;
    pid_t pid = start_server(o, endpoint, err);
    if (pid < 0) {
        rc = pid;
        goto out_dir;
    }
    if ((rc = rekv_kvstore_client_connect(endpoint, NULL, 60000, &c, err)) < 0)
        goto out;
    size_t kvb = rekv_kvstore_client_header(c)->kv_block_bytes;
    uint64_t per_layer = 2048; /* 2 layers x 2048 = 4096 blocks: the largest plan */
    if ((rc = rekv_kvstore_seq_create(c, 1, err)) < 0 ||
        (rc = rekv_kvstore_append(c, 1, per_layer * REKV_KV_BLOCK_TOKENS, 0, 0, NULL, err)) < 0)
        goto out;
    rekv_kv_range all[2] = {{1, 0, 0, per_layer * REKV_KV_BLOCK_TOKENS},
                            {1, 1, 0, per_layer * REKV_KV_BLOCK_TOKENS}};
    if ((rc = rekv_kvstore_plan(c, all, 2, 1, &pb, &n, &cap, err)) < 0)
        goto out;
    uint8_t *arena = rekv_kvstore_client_arena(c, NULL);
    uint64_t seed = 0x2545F4914F6CDD1Dull;
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < kvb / 8; k++)
            ((uint64_t *)(arena + pb[i].offset))[k] = xorshift(&seed);
    /* (a) gather N random blocks vs one memcpy of N blocks' bytes */
    uint32_t N = o->gather_blocks < n ? o->gather_blocks : (uint32_t)n;
    size_t total = (size_t)N * kvb;
    /* page-aligned, as the attention buffers a gather fills are: glibc's memcpy into a large
     * malloc'd buffer (an mmap at page + 16) is ~2.8x slower, which would flatter the gather */
    void *bufp = NULL;
    buf = posix_memalign(&bufp, 4096, total ? total : 1) == 0 ? bufp : NULL;
    uint32_t *idx = malloc(N * sizeof(uint32_t));
    if (buf == NULL || idx == NULL) {
        free(idx);
        rc = rekv_errf(err, -ENOMEM, "bench: out of memory");
        goto out;
    }
    memset(buf, 1, total);
    uint64_t *offs = malloc(N * sizeof(uint64_t));
    if (offs == NULL) {
        free(idx);
        rc = rekv_errf(err, -ENOMEM, "bench: out of memory");
        goto out;
    }
    for (uint32_t i = 0; i < N; i++) {
        idx[i] = (uint32_t)(xorshift(&seed) % n);
        offs[i] = pb[idx[i]].offset;
    }
    /* the memcpy baseline reads N contiguous blocks of the same arena */
    uint64_t lowest = pb[0].offset;
    for (size_t i = 0; i < n; i++)
        lowest = pb[i].offset < lowest ? pb[i].offset : lowest;
    uint64_t best_g = UINT64_MAX, best_m = UINT64_MAX;
    for (int rep = 0; rep < 5; rep++) {
        uint64_t t0 = rekv_now_ns();
        rekv_kv_gather(buf, arena, offs, N, kvb);
        uint64_t t1 = rekv_now_ns();
        memcpy(buf, arena + lowest, total);
        uint64_t t2 = rekv_now_ns();
        best_g = t1 - t0 < best_g ? t1 - t0 : best_g;
        best_m = t2 - t1 < best_m ? t2 - t1 : best_m;
    }
    /* the gathered bytes are the blocks asked for */
    rekv_kv_gather(buf, arena, offs, N, kvb);
    for (uint32_t i = 0; i < N && rc == 0; i++)
        if (memcmp(buf + (size_t)i * kvb, arena + offs[i], kvb) != 0)
            rc = rekv_errf(err, -EIO, "bench: gather copied wrong bytes");
    free(idx);
    free(offs);
    if (rc < 0)
        goto out;
    json_t *g = json_object();
    json_object_set_new(g, "blocks", json_integer(N));
    json_object_set_new(g, "block_bytes", json_integer((json_int_t)kvb));
    json_object_set_new(g, "gather_gbps", json_real((double)total / (double)best_g));
    json_object_set_new(g, "memcpy_gbps", json_real((double)total / (double)best_m));
    json_object_set_new(g, "ratio", json_real((double)best_m / (double)best_g));
    json_object_set_new(out, "gather", g);
    if ((rc = rekv_kvstore_unpin(c, all, 2, err)) < 0)
        goto out;
    /* (c) plan round trips: 1 block, 64 blocks (32 per layer), 4096 blocks (all) */
    json_t *pl = json_array();
    json_object_set_new(out, "plan", pl);
    static const uint64_t sizes[3] = {1, 64, 4096};
    lat = malloc(o->plan_iters * sizeof(uint64_t));
    if (lat == NULL) {
        rc = rekv_errf(err, -ENOMEM, "bench: out of memory");
        goto out;
    }
    for (int si = 0; si < 3; si++) {
        uint64_t per = sizes[si] == 1 ? 1 : sizes[si] / 2;
        rekv_kv_range r[2] = {{1, 0, 0, per * REKV_KV_BLOCK_TOKENS},
                              {1, 1, 0, per * REKV_KV_BLOCK_TOKENS}};
        size_t nr = sizes[si] == 1 ? 1 : 2;
        uint32_t iters = o->plan_iters / (si == 2 ? 10 : 1);
        if (iters < 20)
            iters = 20;
        if (iters > o->plan_iters)
            iters = o->plan_iters;
        for (uint32_t it = 0; it < iters + 10; it++) {
            uint64_t t0 = rekv_now_ns();
            if ((rc = rekv_kvstore_plan(c, r, nr, 0, &pb, &n, &cap, err)) < 0)
                goto out;
            if (it >= 10)
                lat[it - 10] = rekv_now_ns() - t0;
        }
        if (n != sizes[si]) {
            rc = rekv_errf(err, -EPROTO, "bench: plan returned %zu blocks, wanted %llu", n,
                           (unsigned long long)sizes[si]);
            goto out;
        }
        qsort(lat, iters, sizeof(uint64_t), cmp_u64);
        json_t *e = json_object();
        json_object_set_new(e, "blocks", json_integer((json_int_t)sizes[si]));
        json_object_set_new(e, "iterations", json_integer(iters));
        json_object_set_new(e, "p50_us", json_real((double)lat[iters / 2] * 1e-3));
        json_object_set_new(e, "p99_us", json_real((double)lat[(size_t)(iters * 0.99)] * 1e-3));
        json_array_append_new(pl, e);
    }
out:
    free(lat);
    free(buf);
    free(pb);
    rekv_kvstore_client_close(c);
    if (pid > 0) {
        rekv_kvstore_reap(pid);
    }
out_dir:
    rmdir(dir);
    return rc;
}

static int parse_u(const char *s, uint64_t *v)
{
    char *e;
    errno = 0;
    *v = strtoull(s, &e, 10);
    return errno || e == s || *e ? -1 : 0;
}

int rekv_kvstore_bench_main(int argc, char **argv)
{
    bench_opts o = {.gather_blocks = 1024, .spill_blocks = 1024, .host_mib = 1280,
                    .plan_iters = 2000};
    const char *tmp = getenv("TMPDIR");
    o.dir = tmp && *tmp ? tmp : "/var/tmp";
    rekv_kv_geometry_init(&o.g, 2, 32, 128, 4096, REKV_DTYPE_F16, NULL);
    static const struct option opts[] = {
        {"json", no_argument, 0, 'j'},         {"blocks", required_argument, 0, 'b'},
        {"spill-blocks", required_argument, 0, 's'}, {"host-mib", required_argument, 0, 'm'},
        {"spill-dir", required_argument, 0, 'd'},    {"no-fio", no_argument, 0, 'F'},
        {"plan-iters", required_argument, 0, 'p'},   {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    int help = 0;
    int c;
    uint64_t v;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'j': o.json = 1; break;
        case 'F': o.no_fio = 1; break;
        case 'd': o.dir = optarg; break;
        case 'b': if (parse_u(optarg, &v) < 0 || v == 0) goto usage; o.gather_blocks = (uint32_t)v; break;
        case 's': if (parse_u(optarg, &v) < 0 || v == 0) goto usage; o.spill_blocks = (uint32_t)v; break;
        case 'm': if (parse_u(optarg, &v) < 0 || v < 64) goto usage; o.host_mib = v; break;
        case 'p': if (parse_u(optarg, &v) < 0 || v < 20) goto usage; o.plan_iters = (uint32_t)v; break;
        case 'h': help = 1; goto usage;
        default: goto usage;
        }
    }
    if (optind != argc) { /* argv[0]: "rekv bench kvstore" (the CLI names it) */
        fprintf(stderr, "%s: unexpected argument '%s'\n", argv[0], argv[optind]);
        goto usage;
    }
    /* the 4096-block plan needs 4096 KV blocks resident below the spill watermark */
    uint64_t need_mib = (4096ull * rekv_kv_block_bytes(&o.g) * 100 / 85 >> 20) + 2;
    if (o.host_mib < need_mib)
        o.host_mib = need_mib;
    json_t *out = json_object();
    json_object_set_new(out, "bench", json_string("kvstore"));
    json_t *geo = json_object();
    json_object_set_new(geo, "layers", json_integer(o.g.n_layers));
    json_object_set_new(geo, "kv_heads", json_integer(o.g.n_kv_heads));
    json_object_set_new(geo, "head_dim", json_integer(o.g.head_dim));
    json_object_set_new(geo, "hidden", json_integer(o.g.hidden));
    json_object_set_new(geo, "dtype", json_string(rekv_dtype_name(o.g.dtype)));
    json_object_set_new(out, "geometry", geo);
    json_object_set_new(out, "spill_dir", json_string(o.dir));
    rekv_err err = {0};
    int rc = bench_server(&o, out, &err);
    if (rc == 0)
        rc = bench_spill(&o, out, &err);
    if (rc < 0) {
        fprintf(stderr, "rekv bench kvstore: %s\n", err.msg);
        json_decref(out);
        return 1;
    }
    json_dumpf(out, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(4));
    fputc('\n', stdout);
    fflush(stdout);
    json_decref(out);
    return 0;
usage:
    fprintf(help ? stdout : stderr,
            "usage: rekv bench kvstore [--json] [--blocks N] [--spill-blocks N] "
            "[--host-mib N] [--spill-dir DIR] [--no-fio] [--plan-iters N]\n");
    return help ? 0 : 2;
}
