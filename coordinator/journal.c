/* journal.c — the coordinator's append-only job journal: CRC-framed protobuf records, replayed on
 * start with a torn tail cut off, rewritten compactly by rename. */
#define _GNU_SOURCE
#include "coordinator/journal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/crc32c.h"

/* A record larger than this is corruption, not a job (prompts are bounded far below it). */
#define MAX_RECORD (64u << 20)

struct rekv_journal {
    int fd;           /* the journal, O_APPEND */
    int dir_fd;       /* its directory, for fsync after a rename */
    char path[4096];  /* <dir>/journal */
    uint64_t records; /* appended since open or the last rewrite */
    uint64_t bytes;   /* their bytes */
};

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Frames one record into a malloc'd buffer. */
static int frame(const Rekv__Control__JournalRecord *rec, uint8_t **out, size_t *len)
{
    size_t n = rekv__control__journal_record__get_packed_size(rec);
    uint8_t *buf = malloc(12 + n);
    if (buf == NULL)
        return -ENOMEM;
    rekv__control__journal_record__pack(rec, buf + 12);
    uint32_t hdr[3] = {REKV_JOURNAL_MAGIC, (uint32_t)n, rekv_crc32c(0, buf + 12, n)};
    memcpy(buf, hdr, 12);
    *out = buf;
    *len = 12 + n;
    return 0;
}

static int replay(rekv_journal *j, rekv_journal_fn fn, void *ctx, uint64_t *dropped, rekv_err *err)
{
    struct stat st;
    if (fstat(j->fd, &st) < 0)
        return rekv_errf(err, -errno, "%s: %s", j->path, strerror(errno));
    size_t size = (size_t)st.st_size, off = 0;
    uint8_t *buf = size ? malloc(size) : NULL;
    if (size && buf == NULL)
        return rekv_errf(err, -ENOMEM, "%s: out of memory reading %zu bytes", j->path, size);
    size_t got = 0;
    while (got < size) {
        ssize_t r = pread(j->fd, buf + got, size - got, (off_t)got);
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            free(buf);
            return rekv_errf(err, -e, "%s: read: %s", j->path, strerror(e));
        }
        got += (size_t)r;
    }
    int rc = 0;
    while (off + 12 <= size) {
        uint32_t hdr[3];
        memcpy(hdr, buf + off, 12);
        if (hdr[0] != REKV_JOURNAL_MAGIC || hdr[1] > MAX_RECORD || off + 12 + hdr[1] > size ||
            rekv_crc32c(0, buf + off + 12, hdr[1]) != hdr[2])
            break;
        Rekv__Control__JournalRecord *rec =
            rekv__control__journal_record__unpack(NULL, hdr[1], buf + off + 12);
        if (rec == NULL)
            break;
        rc = fn ? fn(ctx, rec) : 0;
        rekv__control__journal_record__free_unpacked(rec, NULL);
        if (rc) {
            free(buf);
            return rekv_errf(err, rc, "%s: replay failed at byte %zu", j->path, off);
        }
        off += 12 + hdr[1];
    }
    free(buf);
    *dropped = size - off;
    if (off < size && ftruncate(j->fd, (off_t)off) < 0)
        return rekv_errf(err, -errno, "%s: cutting off the torn tail: %s", j->path,
                         strerror(errno));
    return 0;
}

int rekv_journal_open(const char *dir, rekv_journal_fn fn, void *ctx, rekv_journal **out,
                      uint64_t *dropped_bytes, rekv_err *err)
{
    rekv_journal *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return rekv_errf(err, -ENOMEM, "out of memory");
    j->fd = j->dir_fd = -1;
    int rc;
    if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
        rc = rekv_errf(err, -errno, "%s: mkdir: %s", dir, strerror(errno));
        goto fail;
    }
    if ((size_t)snprintf(j->path, sizeof(j->path), "%s/journal", dir) >= sizeof(j->path)) {
        rc = rekv_errf(err, -ENAMETOOLONG, "%s: path too long", dir);
        goto fail;
    }
    j->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    j->fd = open(j->path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (j->dir_fd < 0 || j->fd < 0) {
        rc = rekv_errf(err, -errno, "%s: open: %s", j->path, strerror(errno));
        goto fail;
    }
    uint64_t dropped = 0;
    if ((rc = replay(j, fn, ctx, &dropped, err)))
        goto fail;
    if (dropped_bytes)
        *dropped_bytes = dropped;
    *out = j;
    return 0;
fail:
    rekv_journal_close(j);
    return rc;
}

void rekv_journal_close(rekv_journal *j)
{
    if (j == NULL)
        return;
    if (j->fd >= 0)
        close(j->fd);
    if (j->dir_fd >= 0)
        close(j->dir_fd);
    free(j);
}

int rekv_journal_append(rekv_journal *j, const Rekv__Control__JournalRecord *rec, rekv_err *err)
{
    uint8_t *buf;
    size_t len;
    int rc = frame(rec, &buf, &len);
    if (rc)
        return rekv_errf(err, rc, "%s: out of memory", j->path);
    /* one write per record: O_APPEND keeps records whole unless the disk fills mid-write, and a
     * torn tail is cut off at the next replay */
    rc = write_all(j->fd, buf, len);
    free(buf);
    if (rc)
        return rekv_errf(err, rc, "%s: write: %s", j->path, strerror(-rc));
    j->records++;
    j->bytes += len;
    return 0;
}

int rekv_journal_sync(rekv_journal *j, rekv_err *err)
{
    if (fdatasync(j->fd) < 0)
        return rekv_errf(err, -errno, "%s: fdatasync: %s", j->path, strerror(errno));
    return 0;
}

int rekv_journal_rewrite(rekv_journal *j, const Rekv__Control__JournalRecord *const *recs, size_t n,
                         rekv_err *err)
{
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.new", j->path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0)
        return rekv_errf(err, -errno, "%s: open: %s", tmp, strerror(errno));
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        uint8_t *buf;
        size_t len;
        if ((rc = frame(recs[i], &buf, &len)) == 0) {
            rc = write_all(fd, buf, len);
            free(buf);
        }
    }
    if (rc == 0 && fsync(fd) < 0)
        rc = -errno;
    if (rc == 0 && rename(tmp, j->path) < 0)
        rc = -errno;
    if (rc == 0 && fsync(j->dir_fd) < 0)
        rc = -errno;
    if (rc) {
        close(fd);
        unlink(tmp);
        return rekv_errf(err, rc, "%s: rewrite: %s", j->path, strerror(-rc));
    }
    close(j->fd);
    j->fd = fd;
    j->records = 0;
    j->bytes = 0;
    return 0;
}

uint64_t rekv_journal_records(const rekv_journal *j) { return j->records; }
uint64_t rekv_journal_bytes(const rekv_journal *j) { return j->bytes; }
