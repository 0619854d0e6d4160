/* persist.c — the prefix cache across restarts (--prefix-dir DIR; crash included): the spill
 * tier's file is DIR/spill.rekv, named and kept, and DIR/index.rekv says which of its slots hold
 * which cached block.
 *
 * The index is a header (the format's version, the geometry, cache dtype and slot size: what a
 * block's bytes mean) and then an append-only log of fixed 128-byte records, each with its own
 * CRC32C: "slot F holds layer L of the cached position (key, parent, kind, tokens), its bytes'
 * CRC32C is C", written once that block's spill write has completed (or when a block already on
 * disk is published), and "slot F no longer holds it", written before the slot can be reused (a
 * read-back, a free). At start the log is replayed up to its first bad record (a torn tail), each
 * position whose every layer is there has its blocks read and checked against their CRC32C (a
 * torn or corrupted block drops its position, one log line), and what survives becomes cached
 * blocks on disk, their slots adopted by the spill tier; the index is then rewritten with just
 * them (to a temporary file, renamed over). A record whose slot was reused after a crash that
 * lost its "no longer" record fails the CRC check: the store never serves a wrong block. An index
 * made for another geometry, dtype or format is ignored with the reason, and both files start
 * empty. An flock on the directory keeps a second store off it. A clean stop writes the cache's
 * blocks in memory to disk first (blocks.c srv_cache_flush); a crash keeps what was on disk. The
 * model's fingerprint is in every key, so another model's blocks are never hits (and go first
 * when room is needed, being unused). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "kvstore/server_internal.h"

#define IDX_VERSION 1u
#define REC_MAGIC 0x31434552u /* "REC1" */
enum { REC_BLOCK = 1, REC_FREED = 2 };

typedef struct idx_header {
    char magic[8]; /* "RKVPIDX\0" */
    uint32_t version;
    uint32_t n_layers, n_kv_heads, head_dim, hidden, dtype, block_tokens;
    uint32_t pad;
    uint64_t slot_bytes, kv_block_bytes, act_block_bytes;
    uint32_t crc; /* CRC32C of the header with this field 0 */
    uint32_t pad2;
} idx_header;
_Static_assert(sizeof(idx_header) == 72, "index header is 72 bytes");

typedef struct idx_rec {
    uint32_t magic, type; /* REC_MAGIC, REC_* */
    uint64_t key, parent; /* the position's chain keys (prefix.c) */
    uint32_t kind, layer, fslot, data_crc;
    uint32_t tokens[REKV_KV_BLOCK_TOKENS];
    uint32_t pad[5];
    uint32_t crc; /* CRC32C of the record with this field 0 */
} idx_rec;
_Static_assert(sizeof(idx_rec) == 128, "index record is 128 bytes");

static uint32_t rec_crc(const idx_rec *r)
{
    idx_rec c = *r;
    c.crc = 0;
    return rekv_crc32c(0, &c, sizeof(c));
}

static void header_fill(const rekv_kvstore_server *s, idx_header *h)
{
    const rekv_kv_geometry *g = &s->cfg.geometry;
    memset(h, 0, sizeof(*h));
    memcpy(h->magic, "RKVPIDX", 8);
    h->version = IDX_VERSION;
    h->n_layers = g->n_layers;
    h->n_kv_heads = g->n_kv_heads;
    h->head_dim = g->head_dim;
    h->hidden = g->hidden;
    h->dtype = (uint32_t)g->dtype;
    h->block_tokens = g->block_tokens;
    h->slot_bytes = s->hs.big_bytes;
    h->kv_block_bytes = s->arena.hdr->kv_block_bytes;
    h->act_block_bytes = s->arena.hdr->act_block_bytes;
    h->crc = rekv_crc32c(0, h, sizeof(*h));
}

/* ------------------------------------------------------------------ the log */

static void rec_append(rekv_kvstore_server *s, idx_rec *r)
{
    r->magic = REC_MAGIC;
    r->crc = rec_crc(r);
    ssize_t n = write(s->idx_fd, r, sizeof(*r));
    if (n != (ssize_t)sizeof(*r)) /* a torn record ends the log at the next start: the rest is
                                     lost to the cache, never wrong */
        srv_event_rl(s, SRV_RL_SPILL_WRITE, REKV_KV_EVENT_ERROR,
                     "prefix cache index %s: write failed: %s", s->idx_path,
                     n < 0 ? strerror(errno) : "short write");
}

void srv_persist_block(rekv_kvstore_server *s, uint32_t id)
{
    kv_block *b = &s->blocks[id];
    if (s->idx_fd < 0 || b->centry == NIL || b->state != BS_DISK || b->persisted || b->load_err)
        return;
    const kv_centry *e = &s->centries[b->centry];
    idx_rec r;
    memset(&r, 0, sizeof(r));
    r.type = REC_BLOCK;
    r.key = e->key;
    r.parent = e->parent;
    r.kind = e->kind;
    r.layer = b->layer;
    r.fslot = b->fslot;
    r.data_crc = b->crc;
    memcpy(r.tokens, e->tokens, sizeof(r.tokens));
    rec_append(s, &r);
    b->persisted = 1;
}

void srv_persist_drop(rekv_kvstore_server *s, kv_block *b)
{
    if (s->idx_fd < 0 || !b->persisted)
        return;
    idx_rec r;
    memset(&r, 0, sizeof(r));
    r.type = REC_FREED;
    r.fslot = b->fslot;
    rec_append(s, &r);
    b->persisted = 0;
}

/* ------------------------------------------------------------------ loading */

/* The log's records, the last word on each slot kept: recs (malloc'd) of *n. */
static int replay(rekv_kvstore_server *s, int fd, idx_rec **out, size_t *n_out, int *torn)
{
    kv_map at; /* fslot -> index in recs */
    kv_map_init(&at);
    idx_rec *recs = NULL, r;
    size_t n = 0, cap = 0;
    ssize_t got;
    *torn = 0;
    while ((got = read(fd, &r, sizeof(r))) == (ssize_t)sizeof(r)) {
        if (r.magic != REC_MAGIC || r.crc != rec_crc(&r) ||
            (r.type != REC_BLOCK && r.type != REC_FREED)) {
            *torn = 1;
            break;
        }
        uint64_t *v = kv_map_get(&at, r.fslot);
        if (r.type == REC_FREED) {
            if (v)
                recs[*v].type = REC_FREED;
            continue;
        }
        if (v) {
            recs[*v] = r;
            continue;
        }
        if (srv_grow((void **)&recs, &cap, n + 1, sizeof(r)) < 0 || kv_map_put(&at, r.fslot, n) < 0)
            goto oom;
        recs[n++] = r;
    }
    *torn |= got > 0;
    kv_map_free(&at);
    *out = recs;
    *n_out = n;
    return 0;
oom:
    kv_map_free(&at);
    free(recs);
    return -ENOMEM;
}

/* 1 when block record r's bytes in the spill file match its CRC32C. */
static int block_intact(const rekv_kvstore_server *s, int fd, const idx_rec *r, uint8_t *buf)
{
    size_t len = r->kind == REKV_KV_BLOCK_KV ? s->arena.hdr->kv_block_bytes
                                             : s->arena.hdr->act_block_bytes;
    ssize_t got = pread(fd, buf, len, (off_t)r->fslot * (off_t)s->hs.big_bytes);
    return got == (ssize_t)len && rekv_crc32c(0, buf, len) == r->data_crc;
}

/* Positions (all layers, the same key, parent, kind and tokens) out of recs, each checked
 * against the spill file; *kept gets the survivors' records, layer by layer ([n_kept][L]). */
static int gather_positions(rekv_kvstore_server *s, idx_rec *recs, size_t n, idx_rec **kept,
                            size_t *n_kept, uint64_t *bad)
{
    uint32_t L = s->cfg.geometry.n_layers;
    kv_map pos; /* key -> position index */
    kv_map_init(&pos);
    idx_rec *p = NULL; /* [n_pos][L] */
    uint8_t *have = NULL;
    size_t n_pos = 0, cap = 0, cap_h = 0;
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        idx_rec *r = &recs[i];
        if (r->type != REC_BLOCK || r->layer >= L)
            continue;
        uint64_t *v = kv_map_get(&pos, r->key);
        size_t k = v ? (size_t)*v : n_pos;
        if (v == NULL) {
            if (srv_grow((void **)&p, &cap, (n_pos + 1) * L, sizeof(idx_rec)) < 0 ||
                srv_grow((void **)&have, &cap_h, (n_pos + 1) * L, 1) < 0 ||
                kv_map_put(&pos, r->key, n_pos) < 0) {
                rc = -ENOMEM;
                goto out;
            }
            memset(have + n_pos * L, 0, L);
            n_pos++;
        }
        p[k * L + r->layer] = *r;
        have[k * L + r->layer] = 1;
    }
    int fd = open(s->spill_path, O_RDONLY | O_CLOEXEC);
    uint8_t *buf = malloc(s->hs.big_bytes);
    size_t w = 0;
    for (size_t k = 0; k < n_pos && fd >= 0 && buf; k++) {
        int ok = 1;
        for (uint32_t l = 0; l < L && ok; l++) {
            const idx_rec *a = &p[k * L + l], *b0 = &p[k * L];
            ok = have[k * L + l] && a->parent == b0->parent && a->kind == b0->kind &&
                 memcmp(a->tokens, b0->tokens, sizeof(a->tokens)) == 0;
        }
        for (uint32_t l = 0; l < L && ok; l++)
            if (!block_intact(s, fd, &p[k * L + l], buf)) {
                ok = 0;
                (*bad)++;
                srv_event(s, REKV_KV_EVENT_WARN,
                          "prefix cache: a cached block on disk (slot %u, layer %u) fails its "
                          "CRC32C check: its position is dropped",
                          p[k * L + l].fslot, l);
            }
        if (ok) {
            memmove(&p[w * L], &p[k * L], sizeof(idx_rec) * L);
            w++;
        }
    }
    if (fd >= 0)
        close(fd);
    free(buf);
    *kept = p;
    *n_kept = w;
    p = NULL;
out:
    free(p);
    free(have);
    kv_map_free(&pos);
    return rc;
}

/* The index rewritten with just the kept blocks (a temporary file renamed over the old one). */
static int index_rewrite(rekv_kvstore_server *s, const idx_rec *kept, size_t n, rekv_err *err)
{
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp", s->idx_path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return rekv_errf(err, -errno, "kvstore: %s: %s", tmp, strerror(errno));
    idx_header h;
    header_fill(s, &h);
    int ok = write(fd, &h, sizeof(h)) == (ssize_t)sizeof(h);
    for (size_t i = 0; i < n && ok; i++) {
        idx_rec r = kept[i];
        r.crc = rec_crc(&r);
        ok = write(fd, &r, sizeof(r)) == (ssize_t)sizeof(r);
    }
    ok = ok && fdatasync(fd) == 0;
    int e = errno;
    close(fd);
    if (!ok || rename(tmp, s->idx_path) < 0) {
        e = ok ? errno : e;
        unlink(tmp);
        return rekv_errf(err, -e, "kvstore: cannot write %s: %s", s->idx_path, strerror(e));
    }
    return 0;
}

/* The reason an index's header does not fit this store, or NULL. */
static const char *header_mismatch(const rekv_kvstore_server *s, const idx_header *h)
{
    idx_header want, c = *h;
    header_fill(s, &want);
    c.crc = 0;
    if (memcmp(h->magic, "RKVPIDX", 8) != 0 || h->crc != rekv_crc32c(0, &c, sizeof(c)))
        return "not a rekv prefix cache index, or a damaged one";
    if (h->version != IDX_VERSION)
        return "another version of the index format";
    if (h->n_layers != want.n_layers || h->n_kv_heads != want.n_kv_heads ||
        h->head_dim != want.head_dim || h->hidden != want.hidden)
        return "another model's geometry";
    if (h->dtype != want.dtype)
        return "another cache dtype";
    if (h->slot_bytes != want.slot_bytes || h->kv_block_bytes != want.kv_block_bytes ||
        h->act_block_bytes != want.act_block_bytes)
        return "another block layout (build)";
    return NULL;
}

/* Reads the index and the spill file's blocks it names into *kept; an index that does not fit
 * leaves *kept empty, with the reason logged. */
static int index_read(rekv_kvstore_server *s, idx_rec **kept, size_t *n_kept)
{
    *kept = NULL;
    *n_kept = 0;
    int fd = open(s->idx_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -errno;
    idx_header h;
    ssize_t got = read(fd, &h, sizeof(h));
    const char *why = got == 0                     ? NULL
                      : got != (ssize_t)sizeof(h) ? "a torn header"
                                                   : header_mismatch(s, &h);
    if (got == 0 || why) {
        if (why)
            srv_event(s, REKV_KV_EVENT_WARN,
                      "prefix cache index %s ignored (%s): the cache starts empty", s->idx_path,
                      why);
        close(fd);
        return 0;
    }
    idx_rec *recs;
    size_t n;
    int torn, rc = replay(s, fd, &recs, &n, &torn);
    close(fd);
    if (rc)
        return rc;
    if (torn)
        srv_event(s, REKV_KV_EVENT_WARN,
                  "prefix cache index %s: a torn record ends it (a crash while writing it)",
                  s->idx_path);
    uint64_t bad = 0;
    rc = gather_positions(s, recs, n, kept, n_kept, &bad);
    free(recs);
    return rc;
}

int srv_persist_open(rekv_kvstore_server *s, const char *dir, rekv_err *err)
{
    uint32_t L = s->cfg.geometry.n_layers;
    int lock = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* the index is renamed over */
    if (lock < 0)
        return rekv_errf(err, -errno, "kvstore: --prefix-dir %s: %s", dir, strerror(errno));
    if (flock(lock, LOCK_EX | LOCK_NB) < 0) {
        int e = errno;
        close(lock);
        return rekv_errf(err, e == EWOULDBLOCK ? -EBUSY : -e,
                         "kvstore: --prefix-dir %s is in use by another kvstore", dir);
    }
    s->idx_lock = lock;
    idx_rec *kept;
    size_t n;
    int rc = index_read(s, &kept, &n);
    if (rc)
        return rekv_errf(err, rc, "kvstore: reading %s: %s", s->idx_path, strerror(-rc));
    uint32_t *fslots = malloc(sizeof(uint32_t) * (n > 0 ? n * L : 1));
    if (fslots == NULL) {
        free(kept);
        return rekv_errf(err, -ENOMEM, "kvstore: out of memory");
    }
    for (size_t i = 0; i < n * L; i++)
        fslots[i] = kept[i].fslot;
    if (kv_spill_adopt(s->spill, fslots, n * L) < 0) {
        srv_event(s, REKV_KV_EVENT_WARN,
                  "prefix cache %s holds more than --spill-bytes: the cache starts empty",
                  s->spill_path);
        n = 0;
        kv_spill_adopt(s->spill, NULL, 0);
    }
    free(fslots);
    size_t adopted = 0;
    uint32_t *fs = malloc(sizeof(uint32_t) * L), *crc = malloc(sizeof(uint32_t) * L);
    for (size_t k = 0; k < n && fs && crc; k++) {
        const idx_rec *r = &kept[k * L];
        for (uint32_t l = 0; l < L; l++)
            fs[l] = r[l].fslot, crc[l] = r[l].data_crc;
        if (srv_cache_adopt(s, r->key, r->parent, (int)r->kind, r->tokens, fs, crc) == 0)
            adopted++;
        else /* lost to the cache: their slots are free again */
            for (uint32_t l = 0; l < L; l++)
                kv_spill_slot_free(s->spill, fs[l]);
    }
    free(fs);
    free(crc);
    if (adopted)
        srv_event(s, REKV_KV_EVENT_INFO,
                  "prefix cache: %zu cached positions (%zu blocks) kept on disk from before",
                  adopted, adopted * L);
    /* the log from now on: just what is kept */
    idx_rec *live = calloc(adopted * L + 1, sizeof(idx_rec));
    size_t m = 0;
    for (uint32_t i = 0; live && i < s->n_block_ids; i++)
        if (s->blocks[i].state == BS_DISK && s->blocks[i].persisted) {
            const kv_block *b = &s->blocks[i];
            const kv_centry *e = &s->centries[b->centry];
            idx_rec r = {0};
            r.magic = REC_MAGIC, r.type = REC_BLOCK, r.key = e->key, r.parent = e->parent;
            r.kind = e->kind, r.layer = b->layer, r.fslot = b->fslot, r.data_crc = b->crc;
            memcpy(r.tokens, e->tokens, sizeof(r.tokens));
            live[m++] = r;
        }
    free(kept);
    rc = live ? index_rewrite(s, live, m, err) : rekv_errf(err, -ENOMEM, "out of memory");
    free(live);
    if (rc)
        return rc;
    s->idx_fd = open(s->idx_path, O_WRONLY | O_APPEND | O_CLOEXEC);
    if (s->idx_fd < 0)
        return rekv_errf(err, -errno, "kvstore: %s: %s", s->idx_path, strerror(errno));
    return 0;
}

void srv_persist_close(rekv_kvstore_server *s)
{
    if (s->idx_fd >= 0)
        close(s->idx_fd);
    if (s->idx_lock >= 0)
        close(s->idx_lock);
    s->idx_fd = s->idx_lock = -1;
}
