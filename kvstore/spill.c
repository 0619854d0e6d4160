/* spill.c — the NVMe spill tier: one unnamed file (O_TMPFILE, or unlinked right after open) in the
 * spill directory, written and read in fixed slots with io_uring at queue depth >= 32. Buffers are
 * the arena slots themselves registered as fixed buffers (before the first operation, not at
 * open); when registering the arena is refused (RLIMIT_MEMLOCK), a pool of registered, aligned
 * bounce buffers; when even that is refused, plain reads and writes from the arena. O_DIRECT when the filesystem takes it, buffered I/O otherwise.
 * When io_uring itself is unavailable, operations run synchronously and complete through the same
 * eventfd, so the caller's loop does not change. A test hook, REKV_TEST_SPILL_FAIL=FILE, fails
 * every write and growth of the file with EIO while FILE exists (a device failing under it). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/crc32c.h"
#include "kvstore/kv_internal.h"

#define KV_CHUNK_MAX (1ull << 30) /* io_uring caps one registered buffer at 1 GiB */

typedef struct kv_op {
    uint64_t tag;       /* caller's tag */
    uint64_t host_off;  /* the block's byte offset from the arena's first slot */
    uint32_t fslot;     /* file slot */
    uint32_t len;       /* meaningful bytes (CRC) */
    uint32_t io_len;    /* bytes moved: len rounded up to a page (O_DIRECT) */
    int is_read;        /* 1 read-back, 0 spill write */
    int bounce;         /* bounce buffer index, -1 when none */
    int retried;        /* resubmitted once after O_DIRECT was refused */
    uint64_t t0;        /* submit time, ns */
} kv_op;

struct kv_spill {
    kv_spill_config cfg;      /* copy of the configuration */
    int fd;                   /* spill file */
    int direct;               /* fd has O_DIRECT */
    int have_ring;            /* ring is set up */
    struct io_uring ring;     /* the io_uring */
    int efd;                  /* completion eventfd */
    int buffers_set;          /* spill_setup_buffers ran (before the ring's first operation) */
    int registered;           /* arena slots registered as fixed buffers */
    uint64_t slots_per_chunk; /* arena slots per registered buffer */
    uint8_t *bounce;          /* [depth][slot_bytes] bounce pool, or NULL */
    int bounce_registered;    /* pool registered as fixed buffers */
    int *bounce_free;         /* [depth] free pool indices */
    unsigned n_bounce_free;
    kv_op *ops;               /* [depth] operation records */
    unsigned *op_free;        /* [depth] free op indices */
    unsigned n_op_free;
    unsigned in_flight;       /* ops submitted or queued, not yet reaped */
    unsigned queued;          /* sqes prepared, not yet submitted */
    uint32_t *fs_free;        /* freed file slots (stack) */
    size_t n_fs_free, fs_free_cap;
    uint64_t fs_next;         /* next never-used file slot */
    uint64_t fs_max;          /* file slots allowed */
    uint32_t *fs_bad;         /* slots whose write failed: out of use until the tier works again
                               * (kv_spill_slots_revive), a fault that passes costs no room */
    size_t n_fs_bad, fs_bad_cap;
    uint64_t fs_alloc;        /* file slots backed by fallocate'd space */
    int no_falloc;            /* the filesystem has no fallocate: writes extend the file */
    kv_spill_done *sync_done; /* [depth] completions of synchronous fallback ops */
    unsigned n_sync_done;
    char *fault_file;         /* REKV_TEST_SPILL_FAIL (a test's): while this file exists, every
                               * write and growth of the spill file fails with EIO */
};

/* Whether the test hook REKV_TEST_SPILL_FAIL fails this write or growth: the device under the
 * file failing writes (as ext4 does once it aborts its journal on a failed device), for the
 * tests that run without a virtual machine (tests/test_spill_failing.c). */
static int spill_fault(const kv_spill *sp)
{
    return sp->fault_file != NULL && access(sp->fault_file, F_OK) == 0;
}

static void spill_event(kv_spill *sp, rekv_kv_event lvl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void spill_event(kv_spill *sp, rekv_kv_event lvl, const char *fmt, ...)
{
    if (sp->cfg.on_event == NULL)
        return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    sp->cfg.on_event(sp->cfg.event_ctx, lvl, msg);
}

/* The named file of a spill tier kept across restarts: opened as it is (its slots' contents are
 * the caller's to adopt), its size counted as reserved space. */
static int spill_open_named(kv_spill *sp, rekv_err *err)
{
    const char *path = sp->cfg.path;
    int direct = 1;
    int fd = open(path, O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EINVAL) {
        fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        direct = 0;
    }
    if (fd < 0)
        return rekv_errf(err, -errno, "kvstore spill: cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0) {
        int e = errno;
        close(fd);
        return rekv_errf(err, -e, "kvstore spill: %s: %s", path, strerror(e));
    }
    if (!direct)
        spill_event(sp, REKV_KV_EVENT_WARN,
                    "spill: %s refuses O_DIRECT; using buffered I/O (page cache)", path);
    sp->fd = fd;
    sp->direct = direct;
    sp->fs_alloc = (uint64_t)st.st_size / sp->cfg.slot_bytes;
    return 0;
}

static int spill_open_file(kv_spill *sp, rekv_err *err)
{
    if (sp->cfg.path)
        return spill_open_named(sp, err);
    const char *dir = sp->cfg.dir;
    int fd = open(dir, O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
    int direct = 1;
    if (fd < 0 && errno == EINVAL) {
        /* either O_TMPFILE or O_DIRECT refused: try them apart */
        fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        direct = 0;
    }
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/rekv-spill.XXXXXX", dir);
        fd = mkostemp(path, O_CLOEXEC);
        if (fd >= 0) {
            unlink(path);
            direct = 0;
        }
    }
    if (fd < 0)
        return rekv_errf(err, -errno, "kvstore spill: cannot create a file in %s: %s", dir,
                         strerror(errno));
    if (!direct) {
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0 && fcntl(fd, F_SETFL, fl | O_DIRECT) == 0)
            direct = 1;
    }
    if (!direct)
        spill_event(sp, REKV_KV_EVENT_WARN,
                    "spill: %s refuses O_DIRECT; using buffered I/O (page cache)", dir);
    sp->fd = fd;
    sp->direct = direct;
    return 0;
}

/* A file that took O_DIRECT may still refuse it at I/O (or fallocate: overlayfs passes the flag
 * on to an upper file system without direct I/O, e.g. tmpfs before Linux 6.6): buffered from
 * then on. */
static void spill_drop_direct(kv_spill *sp)
{
    int fl = fcntl(sp->fd, F_GETFL);
    if (fl >= 0 && fcntl(sp->fd, F_SETFL, fl & ~O_DIRECT) == 0) {
        sp->direct = 0;
        spill_event(sp, REKV_KV_EVENT_WARN,
                    "spill: O_DIRECT I/O refused; using buffered I/O (page cache)");
    }
}

static int spill_setup_ring(kv_spill *sp)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    int rc = io_uring_queue_init_params(sp->cfg.depth, &sp->ring, &p);
    if (rc < 0) {
        spill_event(sp, REKV_KV_EVENT_WARN,
                    "spill: io_uring unavailable (%s); spill I/O runs synchronously",
                    strerror(-rc));
        return rc;
    }
    sp->have_ring = 1;
    rc = io_uring_register_eventfd(&sp->ring, sp->efd);
    if (rc < 0) {
        io_uring_queue_exit(&sp->ring);
        sp->have_ring = 0;
        spill_event(sp, REKV_KV_EVENT_WARN,
                    "spill: io_uring eventfd refused (%s); spill I/O runs synchronously",
                    strerror(-rc));
        return rc;
    }
    return 0;
}

/* The ring's buffers: the arena itself, else a bounce pool, else nothing. Done before the ring's
 * first operation, not at open: registering pins every page of the arena, which for a fresh
 * arena means faulting it all in (~0.4 s per 256 MiB on a 2-core machine, minutes for tens of
 * GiB) — at the first spill the arena is nearly full, its pages exist, and a store that never
 * spills (a private `rekv run` for one job) never pays. Nothing is in flight then. */
static void spill_setup_buffers(kv_spill *sp)
{
    int rc;
    sp->buffers_set = 1;
    uint64_t total = sp->cfg.n_slots * sp->cfg.slot_bytes;
    if (sp->cfg.register_arena) {
        sp->slots_per_chunk = KV_CHUNK_MAX / sp->cfg.slot_bytes;
        if (sp->slots_per_chunk == 0)
            sp->slots_per_chunk = 1;
        uint64_t chunk = sp->slots_per_chunk * sp->cfg.slot_bytes;
        unsigned n = (unsigned)((total + chunk - 1) / chunk);
        struct iovec *iov = calloc(n, sizeof(*iov));
        if (iov != NULL) {
            for (unsigned i = 0; i < n; i++) {
                iov[i].iov_base = sp->cfg.slots + (uint64_t)i * chunk;
                iov[i].iov_len = (i + 1 == n) ? total - (uint64_t)i * chunk : chunk;
            }
            rc = io_uring_register_buffers(&sp->ring, iov, n);
            free(iov);
            if (rc == 0)
                sp->registered = 1;
            else
                spill_event(sp, REKV_KV_EVENT_INFO,
                            "spill: registering the %llu-byte arena with io_uring failed (%s); "
                            "using registered bounce buffers",
                            (unsigned long long)total, strerror(-rc));
        }
    }
    if (!sp->registered) {
        size_t pool = (size_t)sp->cfg.depth * sp->cfg.slot_bytes;
        void *b = mmap(NULL, pool, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        sp->bounce_free = calloc(sp->cfg.depth, sizeof(int));
        if (b != MAP_FAILED && sp->bounce_free != NULL) {
            sp->bounce = b;
            for (unsigned i = 0; i < sp->cfg.depth; i++)
                sp->bounce_free[sp->n_bounce_free++] = (int)(sp->cfg.depth - 1 - i);
            struct iovec *iov = calloc(sp->cfg.depth, sizeof(*iov));
            if (iov != NULL) {
                for (unsigned i = 0; i < sp->cfg.depth; i++) {
                    iov[i].iov_base = sp->bounce + (size_t)i * sp->cfg.slot_bytes;
                    iov[i].iov_len = sp->cfg.slot_bytes;
                }
                rc = io_uring_register_buffers(&sp->ring, iov, sp->cfg.depth);
                free(iov);
                sp->bounce_registered = rc == 0;
            }
            if (!sp->bounce_registered) {
                /* unregistered bounce buffers buy nothing over the arena itself */
                munmap(sp->bounce, pool);
                sp->bounce = NULL;
                spill_event(sp, REKV_KV_EVENT_WARN,
                            "spill: io_uring refused registered buffers; using plain reads and "
                            "writes");
            }
        } else if (b != MAP_FAILED) {
            munmap(b, pool);
        }
    }
}

int kv_spill_open(const kv_spill_config *cfg, kv_spill **out, rekv_err *err)
{
    int rc = 0;
    *out = NULL;
    if (cfg->slot_bytes == 0 || cfg->slot_bytes % 4096 != 0 || cfg->depth < 1)
        return rekv_errf(err, -EINVAL, "kvstore spill: bad slot size or depth");
    kv_spill *sp = calloc(1, sizeof(*sp));
    if (sp == NULL)
        return rekv_errf(err, -ENOMEM, "kvstore spill: out of memory");
    sp->cfg = *cfg;
    sp->fd = -1;
    sp->efd = -1;
    sp->fs_max = cfg->max_bytes ? cfg->max_bytes / cfg->slot_bytes : UINT32_MAX - 1;
    if (sp->fs_max > UINT32_MAX - 1)
        sp->fs_max = UINT32_MAX - 1;
    sp->ops = calloc(cfg->depth, sizeof(*sp->ops));
    sp->op_free = calloc(cfg->depth, sizeof(*sp->op_free));
    sp->sync_done = calloc(cfg->depth, sizeof(*sp->sync_done));
    if (sp->ops == NULL || sp->op_free == NULL || sp->sync_done == NULL) {
        rc = rekv_errf(err, -ENOMEM, "kvstore spill: out of memory");
        goto fail;
    }
    for (unsigned i = 0; i < cfg->depth; i++)
        sp->op_free[sp->n_op_free++] = cfg->depth - 1 - i;
    sp->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (sp->efd < 0) {
        rc = rekv_errf(err, -errno, "kvstore spill: eventfd: %s", strerror(errno));
        goto fail;
    }
    rc = spill_open_file(sp, err);
    if (rc < 0)
        goto fail;
    (void)spill_setup_ring(sp);
    const char *fault = getenv("REKV_TEST_SPILL_FAIL");
    if (fault && *fault) {
        sp->fault_file = strdup(fault);
        spill_event(sp, REKV_KV_EVENT_WARN,
                    "spill: test hook REKV_TEST_SPILL_FAIL=%s: writes fail while that file exists",
                    fault);
    }
    *out = sp;
    return 0;
fail:
    kv_spill_close(sp);
    return rc;
}

void kv_spill_close(kv_spill *sp)
{
    if (sp == NULL)
        return;
    kv_spill_done d[16];
    while (sp->in_flight > 0 && kv_spill_reap(sp, d, 16, 1) >= 0)
        ;
    if (sp->have_ring)
        io_uring_queue_exit(&sp->ring);
    if (sp->bounce)
        munmap(sp->bounce, (size_t)sp->cfg.depth * sp->cfg.slot_bytes);
    if (sp->fd >= 0)
        close(sp->fd);
    if (sp->efd >= 0)
        close(sp->efd);
    free(sp->bounce_free);
    free(sp->ops);
    free(sp->op_free);
    free(sp->sync_done);
    free(sp->fs_free);
    free(sp->fs_bad);
    free(sp->fault_file);
    free(sp);
}

int kv_spill_event_fd(const kv_spill *sp) { return sp->efd; }
int kv_spill_direct(const kv_spill *sp) { return sp->direct; }
int kv_spill_registered(const kv_spill *sp) { return sp->registered; }
unsigned kv_spill_in_flight(const kv_spill *sp) { return sp->in_flight; }
unsigned kv_spill_depth(const kv_spill *sp) { return sp->cfg.depth; }

int kv_spill_adopt(kv_spill *sp, const uint32_t *used, size_t n)
{
    uint64_t top = 0;
    for (size_t i = 0; i < n; i++)
        if ((uint64_t)used[i] + 1 > top)
            top = (uint64_t)used[i] + 1;
    if (top > sp->fs_max)
        return -ENOSPC; /* a smaller --spill-bytes than the file was made with */
    uint8_t *in = calloc(top ? top : 1, 1);
    if (in == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        in[used[i]] = 1;
    sp->fs_next = top;
    for (uint64_t f = top; f-- > 0;) /* the lowest slots handed out first */
        if (!in[f])
            kv_spill_slot_free(sp, (uint32_t)f);
    free(in);
    return 0;
}

int kv_spill_slot_alloc(kv_spill *sp, uint32_t *fslot)
{
    if (sp->n_fs_free > 0) {
        *fslot = sp->fs_free[--sp->n_fs_free];
        return 0;
    }
    if (sp->fs_next >= sp->fs_max)
        return -ENOSPC;
    /* Space is reserved ahead in chunks: O_DIRECT writes inside i_size are truly asynchronous
     * (extending ones are not on ext4), and a full disk or RLIMIT_FSIZE shows up here, before any
     * block leaves memory. */
    if (!sp->no_falloc && sp->fs_next >= sp->fs_alloc) {
        uint64_t want = sp->fs_alloc < 16 ? 16 : sp->fs_alloc; /* double, from 16 slots */
        if (want > (256ull << 20) / sp->cfg.slot_bytes)
            want = (256ull << 20) / sp->cfg.slot_bytes;
        if (want == 0)
            want = 1;
        if (sp->fs_alloc + want > sp->fs_max)
            want = sp->fs_max - sp->fs_alloc;
        int rc = 0;
        for (;;) {
            off_t off = (off_t)(sp->fs_alloc * sp->cfg.slot_bytes);
            if (spill_fault(sp)) {
                rc = -EIO;
            } else if (fallocate(sp->fd, 0, off, (off_t)(want * sp->cfg.slot_bytes)) == 0) {
                sp->fs_alloc += want;
                break;
            } else {
                rc = -errno;
            }
            if (rc == -EINVAL && sp->direct) {
                spill_drop_direct(sp);
                if (!sp->direct)
                    continue;
            }
            if (rc == -EOPNOTSUPP || rc == -ENOSYS) {
                sp->no_falloc = 1;
                break;
            }
            if (want == 1)
                return rc; /* -ENOSPC, -EFBIG, -EIO: not even one more slot */
            want = 1;
        }
    }
    *fslot = (uint32_t)sp->fs_next++;
    return 0;
}

/* Appends fslot to a growing list of file slots (first: its first capacity). */
static void slot_list_push(uint32_t **list, size_t *n, size_t *cap, size_t first, uint32_t fslot)
{
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : first;
        uint32_t *l = realloc(*list, ncap * sizeof(*l));
        if (l == NULL)
            return; /* the slot is lost to reuse, nothing else */
        *list = l;
        *cap = ncap;
    }
    (*list)[(*n)++] = fslot;
}

void kv_spill_slot_free(kv_spill *sp, uint32_t fslot)
{
    slot_list_push(&sp->fs_free, &sp->n_fs_free, &sp->fs_free_cap, 256, fslot);
}

void kv_spill_slot_bad(kv_spill *sp, uint32_t fslot)
{
    slot_list_push(&sp->fs_bad, &sp->n_fs_bad, &sp->fs_bad_cap, 64, fslot);
}

size_t kv_spill_slots_revive(kv_spill *sp)
{
    size_t n = sp->n_fs_bad;
    while (sp->n_fs_bad > 0)
        kv_spill_slot_free(sp, sp->fs_bad[--sp->n_fs_bad]);
    return n;
}

int kv_spill_slot_probe(kv_spill *sp, uint32_t *fslot)
{
    if (sp->n_fs_bad > 0) {
        *fslot = sp->fs_bad[--sp->n_fs_bad];
        return 0;
    }
    return kv_spill_slot_alloc(sp, fslot);
}

uint64_t kv_spill_slots_used(const kv_spill *sp)
{
    return sp->fs_next - sp->n_fs_free - sp->n_fs_bad;
}

int kv_spill_at_limit(const kv_spill *sp)
{
    return sp->n_fs_free == 0 && sp->fs_next >= sp->fs_max;
}

uint64_t kv_spill_room(const kv_spill *sp)
{
    uint64_t slot = sp->cfg.slot_bytes;
    /* the limit less the slots in use and those out of use since their write failed (not room
     * while the tier fails: counted as room, admission priced jobs on slots nothing can use) */
    uint64_t used = kv_spill_slots_used(sp) + sp->n_fs_bad;
    uint64_t by_limit = sp->fs_max > used ? (sp->fs_max - used) * slot : 0;
    /* the disk: its free space now (another file may have taken it) plus what the file already
     * holds and does not use (reserved ahead by fallocate, or freed slots) */
    uint64_t held = sp->n_fs_free + (sp->fs_alloc > sp->fs_next ? sp->fs_alloc - sp->fs_next : 0);
    struct statvfs v;
    uint64_t disk = held * slot;
    if (fstatvfs(sp->fd, &v) == 0)
        disk += (uint64_t)v.f_bavail * (uint64_t)v.f_frsize;
    return by_limit < disk ? by_limit : disk;
}

static uint8_t *slot_addr(const kv_spill *sp, uint64_t host_off)
{
    return sp->cfg.slots + host_off;
}

/* Runs one operation with pread/pwrite (no ring) and records its completion. */
static void spill_sync(kv_spill *sp, kv_op *op, unsigned idx)
{
    uint8_t *buf = slot_addr(sp, op->host_off);
    off_t off = (off_t)op->fslot * (off_t)sp->cfg.slot_bytes;
    ssize_t n = op->is_read ? pread(sp->fd, buf, op->io_len, off)
                            : pwrite(sp->fd, buf, op->io_len, off);
    if (n < 0 && errno == EINVAL && sp->direct) {
        spill_drop_direct(sp);
        n = op->is_read ? pread(sp->fd, buf, op->io_len, off)
                        : pwrite(sp->fd, buf, op->io_len, off);
    }
    kv_spill_done *d = &sp->sync_done[sp->n_sync_done++];
    d->tag = op->tag;
    d->is_read = op->is_read;
    d->res = n < 0 ? -errno : (size_t)n == op->io_len ? 0 : -EIO;
    d->crc = (op->is_read && d->res == 0) ? rekv_crc32c(0, buf, op->len) : 0;
    d->ns = rekv_now_ns() - op->t0;
    sp->op_free[sp->n_op_free++] = idx;
    uint64_t one = 1;
    ssize_t w = write(sp->efd, &one, sizeof(one));
    (void)w;
}

static void spill_prep(kv_spill *sp, kv_op *op, unsigned idx)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&sp->ring);
    /* in_flight <= depth == SQ entries, and we submit before reaping, so an sqe exists */
    off_t off = (off_t)op->fslot * (off_t)sp->cfg.slot_bytes;
    unsigned len = op->io_len;
    if (sp->registered) {
        uint8_t *buf = slot_addr(sp, op->host_off);
        /* a block lies inside one big slot, and a chunk is whole big slots */
        int bi = (int)(op->host_off / (sp->slots_per_chunk * sp->cfg.slot_bytes));
        if (op->is_read)
            io_uring_prep_read_fixed(sqe, sp->fd, buf, len, (uint64_t)off, bi);
        else
            io_uring_prep_write_fixed(sqe, sp->fd, buf, len, (uint64_t)off, bi);
    } else if (op->bounce >= 0) {
        uint8_t *buf = sp->bounce + (size_t)op->bounce * sp->cfg.slot_bytes;
        if (op->is_read)
            io_uring_prep_read_fixed(sqe, sp->fd, buf, len, (uint64_t)off, op->bounce);
        else
            io_uring_prep_write_fixed(sqe, sp->fd, buf, len, (uint64_t)off, op->bounce);
    } else {
        uint8_t *buf = slot_addr(sp, op->host_off);
        if (op->is_read)
            io_uring_prep_read(sqe, sp->fd, buf, len, (uint64_t)off);
        else
            io_uring_prep_write(sqe, sp->fd, buf, len, (uint64_t)off);
    }
    io_uring_sqe_set_data64(sqe, idx);
    sp->queued++;
}

static int spill_queue(kv_spill *sp, int is_read, uint64_t host_off, uint32_t fslot, size_t len,
                       uint64_t tag, uint32_t *crc)
{
    if (sp->n_op_free == 0)
        return -EAGAIN;
    uint64_t io_len = (len + 4095) / 4096 * 4096;
    if (len == 0 || io_len > sp->cfg.slot_bytes || host_off % 4096 != 0 ||
        host_off + io_len > sp->cfg.n_slots * sp->cfg.slot_bytes ||
        host_off / sp->cfg.slot_bytes != (host_off + io_len - 1) / sp->cfg.slot_bytes)
        return -EINVAL;
    unsigned idx = sp->op_free[--sp->n_op_free];
    kv_op *op = &sp->ops[idx];
    op->tag = tag;
    op->host_off = host_off;
    op->fslot = fslot;
    op->len = (uint32_t)len;
    op->io_len = (uint32_t)io_len;
    op->is_read = is_read;
    op->bounce = -1;
    op->retried = 0;
    op->t0 = rekv_now_ns();
    sp->in_flight++;
    uint8_t *src = slot_addr(sp, host_off);
    if (!is_read && crc)
        *crc = rekv_crc32c(0, src, len);
    if (!is_read && spill_fault(sp)) { /* completes at once, failed, like a synchronous op */
        kv_spill_done *d = &sp->sync_done[sp->n_sync_done++];
        *d = (kv_spill_done){.tag = tag, .res = -EIO, .is_read = 0};
        sp->op_free[sp->n_op_free++] = idx;
        uint64_t one = 1;
        ssize_t w = write(sp->efd, &one, sizeof(one));
        (void)w;
        return 0;
    }
    if (!sp->have_ring) {
        spill_sync(sp, op, idx);
        return 0;
    }
    if (!sp->buffers_set)
        spill_setup_buffers(sp);
    if (!sp->registered && sp->bounce != NULL) {
        op->bounce = sp->bounce_free[--sp->n_bounce_free];
        if (!is_read)
            memcpy(sp->bounce + (size_t)op->bounce * sp->cfg.slot_bytes, src, op->io_len);
    }
    spill_prep(sp, op, idx);
    return 0;
}

int kv_spill_write(kv_spill *sp, uint64_t host_off, uint32_t fslot, size_t len, uint64_t tag,
                   uint32_t *crc)
{
    return spill_queue(sp, 0, host_off, fslot, len, tag, crc);
}

int kv_spill_read(kv_spill *sp, uint64_t host_off, uint32_t fslot, size_t len, uint64_t tag)
{
    return spill_queue(sp, 1, host_off, fslot, len, tag, NULL);
}

int kv_spill_submit(kv_spill *sp)
{
    if (!sp->have_ring || sp->queued == 0)
        return 0;
    int rc = io_uring_submit(&sp->ring);
    if (rc < 0)
        return rc;
    sp->queued -= (unsigned)rc < sp->queued ? (unsigned)rc : sp->queued;
    return 0;
}

int kv_spill_reap(kv_spill *sp, kv_spill_done *out, int max, int wait)
{
    uint64_t cnt;
    ssize_t r = read(sp->efd, &cnt, sizeof(cnt)); /* drain first: no wakeup is lost */
    (void)r;
    int n = 0;
    while (n < max && sp->n_sync_done > 0) {
        out[n++] = sp->sync_done[0];
        memmove(sp->sync_done, sp->sync_done + 1, --sp->n_sync_done * sizeof(*sp->sync_done));
        sp->in_flight--;
    }
    if (!sp->have_ring)
        return n;
    if (sp->queued)
        (void)kv_spill_submit(sp);
    while (n < max) {
        struct io_uring_cqe *cqe = NULL;
        int rc = io_uring_peek_cqe(&sp->ring, &cqe);
        if (rc == -EAGAIN && wait && n == 0 && sp->in_flight > 0)
            rc = io_uring_wait_cqe(&sp->ring, &cqe);
        if (rc < 0 || cqe == NULL)
            break;
        unsigned idx = (unsigned)io_uring_cqe_get_data64(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&sp->ring, cqe);
        kv_op *op = &sp->ops[idx];
        if (res == -EINVAL && sp->direct && !op->retried) {
            spill_drop_direct(sp);
            op->retried = 1;
            spill_prep(sp, op, idx);
            (void)kv_spill_submit(sp);
            continue;
        }
        kv_spill_done *d = &out[n++];
        d->tag = op->tag;
        d->is_read = op->is_read;
        d->res = res < 0 ? res : (uint64_t)res == op->io_len ? 0 : -EIO;
        d->crc = 0;
        d->ns = rekv_now_ns() - op->t0;
        if (op->is_read && d->res == 0) {
            uint8_t *dst = slot_addr(sp, op->host_off);
            if (op->bounce >= 0)
                memcpy(dst, sp->bounce + (size_t)op->bounce * sp->cfg.slot_bytes, op->io_len);
            d->crc = rekv_crc32c(0, dst, op->len);
        }
        if (op->bounce >= 0)
            sp->bounce_free[sp->n_bounce_free++] = op->bounce;
        sp->op_free[sp->n_op_free++] = idx;
        sp->in_flight--;
    }
    return n;
}
