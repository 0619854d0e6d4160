/* arena.c — the shared host arena: a sealed-size memfd, mapped shared, with a header at offset 0
 * and slots after it (two classes, kvstore/slots.c). A memfd has no name in any filesystem, so no exit path (crash
 * included) can leave it behind; clients get it over SCM_RIGHTS. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/memfd.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvstore/kv_internal.h"

#define KV_PAGE 4096ull
#define KV_HUGE (2ull << 20)

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

int rekv_kv_arena_header_check(const rekv_kv_arena_header *h, size_t map_bytes, rekv_err *err)
{
    if (map_bytes < sizeof(*h))
        return rekv_errf(err, -EPROTO, "kvstore arena: %zu bytes is too small", map_bytes);
    if (h->magic != REKV_KV_ARENA_MAGIC)
        return rekv_errf(err, -EPROTO, "kvstore arena: bad magic 0x%08x", h->magic);
    if (h->version != REKV_KV_ARENA_VERSION)
        return rekv_errf(err, -EPROTO, "kvstore arena: version %u, this build speaks %u",
                         h->version, REKV_KV_ARENA_VERSION);
    if (h->arena_bytes != map_bytes || h->slot_bytes == 0 || h->slot_bytes % KV_PAGE != 0 ||
        h->data_offset % KV_PAGE != 0 || h->data_offset > map_bytes ||
        h->n_slots > (map_bytes - h->data_offset) / h->slot_bytes ||
        h->kv_block_bytes > h->slot_bytes || h->act_block_bytes > h->slot_bytes ||
        h->small_slot_bytes == 0 || h->small_slot_bytes > h->slot_bytes ||
        h->small_slot_bytes % KV_PAGE != 0 ||
        h->block_tokens != REKV_KV_BLOCK_TOKENS)
        return rekv_errf(err, -EPROTO, "kvstore arena: inconsistent header");
    return 0;
}

int kv_arena_create(kv_arena *a, uint64_t host_bytes, const rekv_kv_geometry *g, int huge,
                    uint32_t lease_ms, char *notice, size_t notice_len, rekv_err *err)
{
    int rc = 0;
    memset(a, 0, sizeof(*a));
    a->fd = -1;
    a->base = MAP_FAILED;
    if (notice && notice_len)
        notice[0] = '\0';
    uint64_t kvb = rekv_kv_block_bytes(g), actb = rekv_kv_act_block_bytes(g);
    uint64_t slot, small;
    uint32_t per_big;
    kv_slots_sizes(kvb, actb, &slot, &small, &per_big);
    uint64_t bytes = host_bytes;
    int fd = -1;
    if (huge) {
        bytes = round_up(host_bytes, KV_HUGE);
        fd = memfd_create("rekv-kvstore-arena", MFD_CLOEXEC | MFD_HUGETLB);
        if (fd >= 0 && ftruncate(fd, (off_t)bytes) < 0) {
            close(fd);
            fd = -1;
        }
        if (fd >= 0) {
            a->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
            if (a->base == MAP_FAILED) {
                close(fd);
                fd = -1;
            } else {
                a->huge = 1;
            }
        }
        if (fd < 0 && notice)
            snprintf(notice, notice_len,
                     "huge pages unavailable for %llu bytes (reserve them in "
                     "/proc/sys/vm/nr_hugepages); using normal pages",
                     (unsigned long long)bytes);
    }
    if (fd < 0) {
        bytes = round_up(host_bytes, KV_PAGE);
        fd = memfd_create("rekv-kvstore-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0) {
            rc = rekv_errf(err, -errno, "kvstore arena: memfd_create: %s", strerror(errno));
            goto fail;
        }
        if (ftruncate(fd, (off_t)bytes) < 0) {
            rc = rekv_errf(err, -errno, "kvstore arena: ftruncate %llu bytes: %s",
                           (unsigned long long)bytes, strerror(errno));
            goto fail;
        }
        /* clients must not be able to shrink it under us (SIGBUS in the daemon) */
        (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
        a->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (a->base == MAP_FAILED) {
            rc = rekv_errf(err, -errno, "kvstore arena: mmap %llu bytes: %s",
                           (unsigned long long)bytes, strerror(errno));
            goto fail;
        }
        (void)madvise(a->base, bytes, MADV_HUGEPAGE);
    }
    a->fd = fd;
    a->bytes = bytes;
    uint64_t data_off = KV_PAGE;
    if (bytes < data_off + slot) {
        rc = rekv_errf(err, -EINVAL,
                       "kvstore arena: host bytes %llu hold no block of %llu bytes",
                       (unsigned long long)host_bytes, (unsigned long long)slot);
        goto fail;
    }
    a->hdr = a->base;
    a->slots = (uint8_t *)a->base + data_off;
    a->slot_bytes = slot;
    a->n_slots = (bytes - data_off) / slot;
    if (a->n_slots * per_big > UINT32_MAX - 1) /* slot numbers are 32-bit */
        a->n_slots = (UINT32_MAX - 1) / per_big;
    rekv_kv_arena_header *h = a->hdr;
    memset(h, 0, sizeof(*h));
    h->magic = REKV_KV_ARENA_MAGIC;
    h->version = REKV_KV_ARENA_VERSION;
    h->arena_bytes = bytes;
    h->data_offset = data_off;
    h->slot_bytes = slot;
    h->small_slot_bytes = small;
    h->n_slots = a->n_slots;
    h->kv_block_bytes = kvb;
    h->act_block_bytes = actb;
    h->n_layers = g->n_layers;
    h->n_kv_heads = g->n_kv_heads;
    h->head_dim = g->head_dim;
    h->hidden = g->hidden;
    h->dtype = (uint32_t)g->dtype;
    h->block_tokens = g->block_tokens;
    h->lease_ms = lease_ms;
    h->huge_pages = (uint32_t)a->huge;
    return 0;
fail:
    if (a->base != MAP_FAILED)
        munmap(a->base, bytes);
    if (fd >= 0)
        close(fd);
    a->base = MAP_FAILED;
    a->fd = -1;
    return rc;
}

void kv_arena_destroy(kv_arena *a)
{
    if (a->base != NULL && a->base != MAP_FAILED)
        munmap(a->base, a->bytes);
    if (a->fd >= 0)
        close(a->fd);
    a->base = MAP_FAILED;
    a->fd = -1;
}
