/* push.c — the kvstore server's push path (cfg.push_backend): the store copies KV rows from its
 * arena straight into a worker's device buffers, instead of the worker fetching them.
 *
 * The server holds a backend (its arena registered with it where the backend can) and a stream
 * per connection, made at its first push. A Push imports the client's buffers and events once
 * (kept per connection, keyed by the handle's bytes), checks every piece (it must lie inside one
 * block this connection pins, and inside the buffer), and enqueues on the connection's stream a
 * wait on the client's wait event ("buffer free"), the copies from the arena into the buffers,
 * and a record of its done event ("pushed"); the reply leaves once they are enqueued. Imports are
 * dropped, after the stream has drained, on Release, when the connection's lease expires (ZeroMQ
 * does not report a disconnect; a silent connection is a gone one), and on destroy. A stream per
 * connection, because a worker that dies with a "buffer free" record pending leaves the stream's
 * wait blocked for good on cuda (backend.h): the drain then says so (-EPIPE) and the stream is
 * dropped, and no other worker's pushes were queued behind it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuworker/device/backend.h"
#include "kvstore/server_internal.h"

#define MAX_IMPORTS 64 /* per connection; beyond it the connection's imports are dropped */
#define MAX_PUSH_BUFFERS 16

/* ------------------------------------------------------------------ imports */

/* Drops c's imports whose handle is one of handles[n] (handles NULL: all of them), once the push
 * stream has finished the work that uses them. */
void srv_client_drop_imports(rekv_kvstore_server *s, kv_client *c, ProtobufCBinaryData *handles,
                             size_t n)
{
    if (c->imports == NULL)
        return;
    rekv_err e = {0};
    if (c->pstream && s->pbe->iface->stream_sync(c->pstream, &e) == -EPIPE) {
        /* its worker died with a record pending: the stream cannot run again */
        srv_event(s, REKV_KV_EVENT_WARN, "push: %s; the connection gets a new stream", e.msg);
        s->pbe->iface->stream_destroy(c->pstream);
        c->pstream = NULL;
    }
    kv_import **pp = &c->imports;
    while (*pp) {
        kv_import *im = *pp;
        int drop = handles == NULL;
        for (size_t i = 0; i < n && !drop; i++)
            drop = handles[i].len == sizeof(im->handle) &&
                   memcmp(handles[i].data, im->handle, sizeof(im->handle)) == 0;
        if (!drop) {
            pp = &im->next;
            continue;
        }
        *pp = im->next;
        if (im->ev)
            s->pbe->iface->event_destroy(im->ev);
        else
            s->pbe->iface->dev_unimport(s->pbe, im->dev);
        free(im);
        c->n_imports--;
    }
}

/* c's import of handle h (a buffer, or an event when is_event), importing it on first use. */
static int import_get(rekv_kvstore_server *s, kv_client *c, const ProtobufCBinaryData *h,
                      int is_event, kv_import **out, kv_reply *r, const char *what)
{
    if (h->len != REKV_KV_IPC_HANDLE_BYTES)
        return srv_fail(r, -EINVAL, "push: %s handle of %zu bytes, not %d", what, h->len,
                        REKV_KV_IPC_HANDLE_BYTES);
    for (kv_import *im = c->imports; im; im = im->next)
        if (memcmp(im->handle, h->data, sizeof(im->handle)) == 0 && (im->ev != NULL) == is_event) {
            *out = im;
            return 0;
        }
    kv_import *im = calloc(1, sizeof(*im));
    if (im == NULL)
        return srv_fail(r, -ENOMEM, "push: out of memory");
    rekv_ipc_handle hd;
    memcpy(&hd, h->data, sizeof(hd));
    memcpy(im->handle, h->data, sizeof(im->handle));
    rekv_err e = {0};
    const rekv_backend_iface *bi = s->pbe->iface;
    int rc = is_event ? bi->event_import(s->pbe, &hd, &im->ev, &e)
                      : bi->dev_import(s->pbe, &hd, &im->dev, &im->bytes, &e);
    if (rc < 0) {
        free(im);
        return srv_fail(r, rc, "push: %s: %s", what, e.msg[0] ? e.msg : "import failed");
    }
    im->next = c->imports;
    c->imports = im;
    c->n_imports++;
    *out = im;
    return 0;
}

/* ------------------------------------------------------------------ requests */

int srv_h_push(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Push *m, kv_reply *r)
{
    if (s->pbe == NULL)
        return srv_fail(r, -ENOTSUP,
                        "this kvstore has no push backend (start it with --push-backend)");
    size_t n = m->n_src;
    if (m->n_dst != n || m->n_bytes != n || m->n_buffer != n)
        return srv_fail(r, -EINVAL, "push: piece arrays of different lengths (%zu, %zu, %zu, %zu)",
                        m->n_src, m->n_buffer, m->n_dst, m->n_bytes);
    if (m->n_buffers > MAX_PUSH_BUFFERS)
        return srv_fail(r, -EINVAL, "push: %zu buffers, at most %d", m->n_buffers,
                        MAX_PUSH_BUFFERS);
    r->push.backend = (char *)s->pbe->iface->name;
    r->resp.body_case = REKV__KVSTORE__RESPONSE__BODY_PUSH;
    r->resp.push = &r->push;
    if (n == 0 && m->n_buffers == 0 && m->wait_event.len == 0 && m->done_event.len == 0)
        return 0; /* a probe */
    if (c->n_imports + m->n_buffers + 2 > MAX_IMPORTS)
        srv_client_drop_imports(s, c, NULL, 0);
    kv_import *bufs[MAX_PUSH_BUFFERS], *wait = NULL, *done = NULL;
    for (size_t i = 0; i < m->n_buffers; i++) {
        bufs[i] = NULL;
        if (import_get(s, c, &m->buffers[i], 0, &bufs[i], r, "buffer") || bufs[i] == NULL)
            return 0;
    }
    if (m->wait_event.len && (import_get(s, c, &m->wait_event, 1, &wait, r, "wait event") || !wait))
        return 0;
    if (m->done_event.len && (import_get(s, c, &m->done_event, 1, &done, r, "done event") || !done))
        return 0;
    if (c->pstream == NULL) {
        rekv_err e = {0};
        int rc = s->pbe->iface->stream_create(s->pbe, "push", &c->pstream, &e);
        if (rc < 0)
            return srv_fail(r, rc, "push: %s", e.msg);
    }
    rekv_copy_piece *pc = srv_reply_alloc(r, n, sizeof(*pc));
    if (pc == NULL)
        return srv_fail(r, -ENOMEM, "push: out of memory for %zu pieces", n);
    uint64_t lo = s->arena.hdr->data_offset, hi = s->arena.bytes;
    for (size_t i = 0; i < n; i++) {
        uint64_t src = m->src[i], dst = m->dst[i], bytes = m->bytes[i];
        if (m->buffer[i] >= m->n_buffers)
            return srv_fail(r, -EINVAL, "push: piece %zu names buffer %u of %zu", i, m->buffer[i],
                            m->n_buffers);
        if (src < lo || src > hi || bytes > hi - src)
            return srv_fail(
                r, -EINVAL,
                "push: piece %zu reads [%llu, +%llu) outside the arena's blocks [%llu, %llu)", i,
                (unsigned long long)src, (unsigned long long)bytes, (unsigned long long)lo,
                (unsigned long long)hi);
        kv_import *b = bufs[m->buffer[i]];
        if (dst > b->bytes || bytes > b->bytes - dst)
            return srv_fail(
                r, -EINVAL, "push: piece %zu writes [%llu, +%llu) outside buffer %u of %zu bytes",
                i, (unsigned long long)dst, (unsigned long long)bytes, m->buffer[i], b->bytes);
        /* within one block this connection pins: anything else may be spilled and its slot
         * given to another sequence while the copy runs (a pinned block whose spill was in
         * flight when it was pinned keeps its host copy: SPILLING is resident) */
        uint32_t slot = 0, id = NIL;
        uint64_t start = 0;
        if (kv_slots_find(&s->hs, src - lo, &slot, &start) == 0)
            id = s->slot_block[slot];
        if (bytes > 0 && (id >= s->n_block_ids ||
                          (s->blocks[id].state != BS_HOST && s->blocks[id].state != BS_SPILLING) ||
                          s->blocks[id].slot != slot ||
                          src - lo - start + bytes > srv_blk_bytes(s, &s->blocks[id]) ||
                          kv_map_get(&c->pins, id) == NULL))
            return srv_fail(
                r, -EPERM,
                "push: piece %zu reads [%llu, +%llu), not inside one block this connection "
                "has pinned",
                i, (unsigned long long)src, (unsigned long long)bytes);
        pc[i] = (rekv_copy_piece){(uint8_t *)b->dev + dst, (uint8_t *)s->arena.base + src,
                                  (size_t)bytes};
    }
    const rekv_backend_iface *bi = s->pbe->iface;
    if (wait)
        bi->stream_wait_event(c->pstream, wait->ev);
    if (n)
        bi->copy_h2d(c->pstream, pc, n, REKV_XFER_KV);
    if (done)
        bi->event_record(done->ev, c->pstream);
    return 0;
}

void srv_client_push_end(rekv_kvstore_server *s, kv_client *c)
{
    srv_client_drop_imports(s, c, NULL, 0);
    if (c->pstream) {
        s->pbe->iface->stream_destroy(c->pstream);
        c->pstream = NULL;
    }
}

int srv_h_release(rekv_kvstore_server *s, kv_client *c, Rekv__Kvstore__Release *m, kv_reply *r)
{
    if (s->pbe == NULL)
        return srv_fail(r, -ENOTSUP,
                        "this kvstore has no push backend (start it with --push-backend)");
    srv_client_drop_imports(s, c, m->n_handles ? m->handles : NULL, m->n_handles);
    return 0;
}

/* ------------------------------------------------------------------ setup and teardown */

/* Sets up the push backend cfg->push_backend names, if any: the backend, the arena registered
 * with it where it can be. Called by create once the arena exists; on failure
 * destroy undoes what was done. */
int srv_push_open(rekv_kvstore_server *s, const rekv_kvstore_config *cfg, rekv_err *err)
{
    int rc;
    if (cfg->push_backend && cfg->push_backend[0]) {
        char note[256] = "";
        rekv_link_config link = {cfg->push_link.gbps, cfg->push_link.latency_us, 0};
        if ((rc = rekv_backend_create(cfg->push_backend, link.gbps > 0 ? &link : NULL, &s->pbe,
                                      note, sizeof(note), err)))
            return rc;
        if (!rekv_backend_has_ipc(s->pbe)) {
            return rekv_errf(err, -ENOTSUP,
                             "kvstore: the %s backend cannot import buffers to push to",
                             s->pbe->iface->name);
        }
        if (s->pbe->iface->host_register && s->pbe->iface->host_unregister) {
            rekv_err e = {0};
            if (s->pbe->iface->host_register(s->pbe, s->arena.base, s->arena.bytes, &e) == 0)
                s->push_registered = 1;
            else
                srv_event(s, REKV_KV_EVENT_WARN, "push: arena not page-locked: %s", e.msg);
        }
        char over[96] = "";
        if (link.gbps > 0)
            snprintf(over, sizeof(over), " over an emulated link of %g Gbit/s, %g us per copy",
                     link.gbps, link.latency_us);
        srv_event(s, REKV_KV_EVENT_INFO, "push backend: %s%s%s%s", s->pbe->iface->name, over,
                  note[0] ? " — " : "", note);
    }
    return 0;
}

/* Imports unmapped and streams destroyed, then the backend; destroy calls it before the arena
 * goes. */
void srv_push_close(rekv_kvstore_server *s)
{
    for (kv_client *c = s->clients; c; c = c->next)
        srv_client_push_end(s, c);
    if (s->push_registered)
        s->pbe->iface->host_unregister(s->pbe, s->arena.base);
    rekv_backend_destroy(s->pbe);
}
