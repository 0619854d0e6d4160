/* kv_internal.h — private pieces of the kvstore module shared by its .c files: the u64 hash map,
 * the arena (memfd) and the io_uring spill engine. Not part of the public interface. */
#ifndef REKV_KVSTORE_INTERNAL_H
#define REKV_KVSTORE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "kvstore/kvstore.h"

/* ---------------------------------------------------------------- u64 -> u64 hash map */

/* Open addressing, linear probing, backward-shift deletion. Key UINT64_MAX is reserved. */
typedef struct kv_map {
    uint64_t *keys; /* [cap]; UINT64_MAX marks an empty cell */
    uint64_t *vals; /* [cap] */
    size_t cap;     /* power of two, or 0 before the first insert */
    size_t len;     /* live entries */
} kv_map;

void kv_map_init(kv_map *m);
void kv_map_free(kv_map *m);
/* Pointer to the value of key, or NULL. Valid until the next insert or delete. */
uint64_t *kv_map_get(const kv_map *m, uint64_t key);
/* Inserts or overwrites; returns 0 or -ENOMEM. */
int kv_map_put(kv_map *m, uint64_t key, uint64_t val);
/* Removes key; returns 1 when it was there, else 0. */
int kv_map_del(kv_map *m, uint64_t key);
/* Iteration: for (size_t i = 0; i < m->cap; i++) if (m->keys[i] != KV_MAP_EMPTY) ... */
#define KV_MAP_EMPTY UINT64_MAX

/* ---------------------------------------------------------------- arena */

typedef struct kv_arena {
    int fd;                      /* the memfd */
    void *base;                  /* mapping of the whole arena */
    size_t bytes;                /* mapping length */
    rekv_kv_arena_header *hdr;   /* == base */
    uint8_t *slots;              /* base + hdr->data_offset */
    uint64_t n_slots, slot_bytes; /* big slots (kv_slots): their number and bytes */
    int huge;                    /* backed by hugetlb pages */
} kv_arena;

/* Creates and maps a memfd arena of host_bytes and writes its header. huge: try MFD_HUGETLB first;
 * *notice (may be NULL) gets a line when huge pages were asked for but not available. */
int kv_arena_create(kv_arena *a, uint64_t host_bytes, const rekv_kv_geometry *g, int huge,
                    uint32_t lease_ms, char *notice, size_t notice_len, rekv_err *err);
void kv_arena_destroy(kv_arena *a);

/* ---------------------------------------------------------------- host slots (slots.c) */

/* The arena's blocks in two classes from one budget: big slots of the larger block type's bytes,
 * each holding one such block or split into per_big small slots of the smaller type's bytes (both
 * rounded up to a page). A slot number is big * per_big + j. */
typedef struct kv_slots {
    uint64_t big_bytes, small_bytes; /* class sizes; equal when per_big == 1 */
    uint32_t per_big;                /* small slots per big slot (1..64) */
    int small_type;                  /* rekv_kv_block_type of the small class (per_big > 1) */
    uint32_t n_big;                  /* big slots in the arena */
    uint32_t *free_big;              /* [n_big] stack of whole free big slots */
    uint32_t n_free_big;
    uint64_t *used;                  /* [n_big] split slots: bit j set while small slot j is taken */
    uint8_t *split;                  /* [n_big] 1 while split into small slots */
    uint32_t *partial;               /* [n_big] split slots with a free small slot */
    uint32_t *partial_pos;           /* [n_big] index in partial, UINT32_MAX when not there */
    uint32_t n_partial;
    uint64_t free_small;             /* free small slots in split slots */
    uint64_t used_bytes;             /* bytes of the slots handed out */
} kv_slots;

/* Carves data_bytes into slots for blocks of kv_bytes and act_bytes; 0 or -ENOMEM. */
int kv_slots_init(kv_slots *sl, uint64_t data_bytes, uint64_t kv_bytes, uint64_t act_bytes);
/* The slot classes of blocks of kv_bytes and act_bytes: big slots of *big bytes, each one block of
 * the larger type or *per_big small slots of *small bytes (kv_slots_init's and the arena's). */
void kv_slots_sizes(uint64_t kv_bytes, uint64_t act_bytes, uint64_t *big, uint64_t *small,
                    uint32_t *per_big);
void kv_slots_destroy(kv_slots *sl);
/* 1 when blocks of type take small slots. */
int kv_slots_is_small(const kv_slots *sl, int type);
/* What a block of type costs in the arena, bytes. */
uint64_t kv_slots_class_bytes(const kv_slots *sl, int type);
/* Byte offset of a slot from the arena's first slot. */
uint64_t kv_slots_offset(const kv_slots *sl, uint32_t slot);
/* Bytes in free slots (whole big ones and small ones in split slots). */
uint64_t kv_slots_free_bytes(const kv_slots *sl);
/* A slot for a block of type: 0, or -ENOSPC when none is free. */
int kv_slots_alloc(kv_slots *sl, int type, uint32_t *slot);
void kv_slots_put(kv_slots *sl, int type, uint32_t slot);
/* 1 when need[type] blocks (KV, ACT) could be allocated now, with gain[type] more slots of each
 * type's class freed first (NULL: none); else 0. */
int kv_slots_fit(const kv_slots *sl, const uint64_t need[2], const uint64_t gain[2]);
/* The slot whose area holds byte rel (from the first slot) as the slots are split now, and where
 * that slot starts; -ERANGE when rel is in no slot. */
int kv_slots_find(const kv_slots *sl, uint64_t rel, uint32_t *slot, uint64_t *start);

/* ---------------------------------------------------------------- spill engine */

typedef struct kv_spill kv_spill;

typedef struct kv_spill_config {
    const char *dir;       /* where the (unnamed) spill file lives */
    const char *path;      /* instead: this named file, kept across restarts (the prefix cache's
                              --prefix-dir); opened as it is, its slots free until adopted */
    uint64_t max_bytes;    /* file capacity; 0: unlimited */
    uint8_t *slots;        /* the arena's first slot */
    uint64_t n_slots;      /* big host slots (kv_slots) */
    uint64_t slot_bytes;   /* a big slot's bytes, multiple of 4096; also the file slot size */
    unsigned depth;        /* queue depth (in-flight operations), >= 32 */
    int register_arena;    /* try registering the slots as io_uring fixed buffers */
    void (*on_event)(void *ctx, rekv_kv_event level, const char *msg);
    void *event_ctx;
} kv_spill_config;

/* One finished operation. */
typedef struct kv_spill_done {
    uint64_t tag;   /* as submitted */
    int32_t res;    /* 0 or -errno (a short transfer is -EIO) */
    int is_read;    /* 1 for a read-back */
    uint32_t crc;   /* reads: CRC32C of the bytes now in the host slot */
    uint64_t ns;    /* submit-to-completion time */
} kv_spill_done;

int kv_spill_open(const kv_spill_config *cfg, kv_spill **out, rekv_err *err);
/* Waits for everything in flight, then closes the file and the ring. NULL is fine. */
void kv_spill_close(kv_spill *sp);
/* eventfd that becomes readable when completions are waiting. */
int kv_spill_event_fd(const kv_spill *sp);
int kv_spill_direct(const kv_spill *sp);
int kv_spill_registered(const kv_spill *sp);
unsigned kv_spill_in_flight(const kv_spill *sp);
unsigned kv_spill_depth(const kv_spill *sp);

/* File slots: alloc returns -ENOSPC when max_bytes is used up. A slot whose write failed is marked
 * bad: not handed out (nor counted as room) until kv_spill_slots_revive, which the caller runs
 * once a write succeeds again (a device mended: a slot that is truly bad fails again and is
 * marked again); it returns how many came back. */
int kv_spill_slot_alloc(kv_spill *sp, uint32_t *fslot);
void kv_spill_slot_free(kv_spill *sp, uint32_t fslot);
void kv_spill_slot_bad(kv_spill *sp, uint32_t fslot);
size_t kv_spill_slots_revive(kv_spill *sp);
/* A file slot to try the tier with: one whose write failed (back to bad or free after the
 * try), else a new one (kv_spill_slot_alloc). */
int kv_spill_slot_probe(kv_spill *sp, uint32_t *fslot);
uint64_t kv_spill_slots_used(const kv_spill *sp);
/* Takes the file slots used[0..n) as in use (a named file's slots that hold blocks kept from
 * before a restart); every other slot below the highest is free. Once, before any alloc. */
int kv_spill_adopt(kv_spill *sp, const uint32_t *used, size_t n);
/* Bytes the tier can still take now: what max_bytes leaves, and never more than the filesystem's
 * free space (statvfs f_bavail) plus what the file holds but does not use, so another file filling
 * the disk shrinks it. */
uint64_t kv_spill_room(const kv_spill *sp);
/* 1 when kv_spill_slot_alloc's -ENOSPC is the max_bytes limit's (every slot handed out), 0 when
 * it would be the filesystem's. */
int kv_spill_at_limit(const kv_spill *sp);

/* Queues a write of the len bytes at host_off (from the first slot; a block, which never crosses a
 * big slot) to file slot (len rounded up to a page is written); *crc gets the CRC32C of the len
 * bytes. -EAGAIN when depth operations are in flight. */
int kv_spill_write(kv_spill *sp, uint64_t host_off, uint32_t fslot, size_t len, uint64_t tag,
                   uint32_t *crc);
/* Queues a read of file slot into host_off (len rounded up to a page); the completion carries the
 * CRC32C of len bytes. */
int kv_spill_read(kv_spill *sp, uint64_t host_off, uint32_t fslot, size_t len, uint64_t tag);
/* Submits what was queued. */
int kv_spill_submit(kv_spill *sp);
/* Collects up to max completions; wait = 1 blocks for at least one when any is in flight. */
int kv_spill_reap(kv_spill *sp, kv_spill_done *out, int max, int wait);

#endif
