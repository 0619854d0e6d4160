/* journal.h — the coordinator's append-only job journal (format in coordinator.h). Private to the
 * coordinator module. Functions return 0 or a negative errno and fill the rekv_err. */
#ifndef REKV_COORDINATOR_JOURNAL_H
#define REKV_COORDINATOR_JOURNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "proto/control.pb-c.h"

#define REKV_JOURNAL_MAGIC 0x314a5652u /* "RVJ1" little-endian */

typedef struct rekv_journal rekv_journal;

/* Called once per intact record, in order. Returning non-zero stops the replay with that code. */
typedef int (*rekv_journal_fn)(void *ctx, const Rekv__Control__JournalRecord *rec);

/* Opens (creating, mode 0600) <dir>/journal, replays every intact record through fn, cuts off a
 * torn or corrupt tail (reported in *dropped_bytes), and leaves the file open for appending. */
int rekv_journal_open(const char *dir, rekv_journal_fn fn, void *ctx, rekv_journal **out,
                      uint64_t *dropped_bytes, rekv_err *err);
void rekv_journal_close(rekv_journal *j);
/* Appends one record (buffered in the kernel; call sync to make it durable). */
int rekv_journal_append(rekv_journal *j, const Rekv__Control__JournalRecord *rec, rekv_err *err);
/* fdatasync. */
int rekv_journal_sync(rekv_journal *j, rekv_err *err);
/* Replaces the journal with recs[n] atomically (temp file, fsync, rename, fsync of the directory)
 * and appends to the new file from then on. */
int rekv_journal_rewrite(rekv_journal *j, const Rekv__Control__JournalRecord *const *recs, size_t n,
                         rekv_err *err);
/* Records appended since open or the last rewrite, and their bytes. */
uint64_t rekv_journal_records(const rekv_journal *j);
uint64_t rekv_journal_bytes(const rekv_journal *j);

#endif
