/* backend.c — what every backend shares: copy checks and coalescing, copy labels, the trace file,
 * host memory. No backend is chosen here (backend_open.c does that): this file is also linked into
 * the cuda backend's shared object, which must not pull the cpu backend in. */
#include "gpuworker/device/backend.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void rekv_copy_label(char *buf, size_t cap, const char *dir, rekv_xfer_kind kind, size_t bytes)
{
    static const char *const kinds[REKV_XFER_KINDS] = {"weights", "KV", "ACT", "other"};
    char size[32];
    if (bytes < 1024)
        snprintf(size, sizeof(size), "%zu B", bytes);
    else if (bytes < (1u << 20))
        snprintf(size, sizeof(size), "%.1f KiB", (double)bytes / 1024.0);
    else if (bytes < (1u << 30))
        snprintf(size, sizeof(size), "%.1f MiB", (double)bytes / (1024.0 * 1024.0));
    else
        snprintf(size, sizeof(size), "%.2f GiB", (double)bytes / (1024.0 * 1024.0 * 1024.0));
    if (strcmp(dir, "d2d") == 0)
        snprintf(buf, cap, "d2d %s", size);
    else
        snprintf(buf, cap, "%s %s %s", dir,
                 (unsigned)kind < REKV_XFER_KINDS ? kinds[kind] : "other", size);
}

static void json_write_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"':
        case '\\':
            fprintf(f, "\\%c", *p);
            break;
        case '\n':
            fputs("\\n", f);
            break;
        case '\r':
            fputs("\\r", f);
            break;
        case '\t':
            fputs("\\t", f);
            break;
        default:
            if (*p < 0x20)
                fprintf(f, "\\u%04x", *p);
            else
                fputc(*p, f);
        }
    }
    fputc('"', f);
}

void rekv_trace_begin(FILE *f, const char *backend, const char *extra, size_t n_spans,
                      uint64_t dropped_spans, char *const *stream_names, size_t n_streams)
{
    fprintf(f, "{\"displayTimeUnit\": \"ms\",\n \"otherData\": {\"backend\": \"%s\", %s", backend,
            extra);
    fprintf(f, "\"spans\": %zu, \"dropped_spans\": %llu, \"truncated\": %s},\n", n_spans,
            (unsigned long long)dropped_spans, dropped_spans ? "true" : "false");
    fputs(" \"traceEvents\": [\n", f);
    fprintf(f,
            "  {\"ph\": \"M\", \"pid\": 1, \"tid\": 0, \"name\": \"process_name\", "
            "\"args\": {\"name\": \"rekv %s backend\"}}",
            backend);
    for (size_t i = 0; i < n_streams; i++) {
        fprintf(f,
                ",\n  {\"ph\": \"M\", \"pid\": 1, \"tid\": %zu, \"name\": \"thread_name\", "
                "\"args\": {\"name\": ",
                i + 1);
        json_write_string(f, stream_names[i]);
        fprintf(f,
                "}},\n  {\"ph\": \"M\", \"pid\": 1, \"tid\": %zu, "
                "\"name\": \"thread_sort_index\", \"args\": {\"sort_index\": %zu}}",
                i + 1, i + 1);
    }
}

void rekv_trace_span(FILE *f, uint32_t tid, double ts_us, double dur_us, const char *label)
{
    fprintf(f,
            ",\n  {\"ph\": \"X\", \"pid\": 1, \"tid\": %u, \"ts\": %.3f, \"dur\": %.3f, \"name\": ",
            tid, ts_us, dur_us);
    json_write_string(f, label);
    fputc('}', f);
}

int rekv_trace_end(FILE *f, const char *path, rekv_err *err)
{
    int rc = 0;
    fputs("\n ]}\n", f);
    if (ferror(f))
        rc = rekv_errf(err, -EIO, "%s: error writing trace", path);
    if (fclose(f) != 0 && rc == 0)
        rc = rekv_errf(err, -errno, "%s: error writing trace: %s", path, strerror(errno));
    return rc;
}

void *rekv_host_alloc(rekv_backend *be, size_t bytes)
{
    return be->iface->host_alloc ? be->iface->host_alloc(be, bytes) : malloc(bytes);
}

void rekv_host_free(rekv_backend *be, void *p)
{
    if (p == NULL)
        return;
    if (be->iface->host_free)
        be->iface->host_free(be, p);
    else
        free(p);
}

size_t rekv_copy_coalesce(const rekv_copy_piece *pieces, size_t n, rekv_copy_run *runs)
{
    size_t nr = 0;
    rekv_copy_run *r = NULL;
    for (size_t i = 0; i < n; i++) {
        const rekv_copy_piece *c = &pieces[i];
        if (c->bytes == 0)
            continue;
        if (r != NULL) {
            uintptr_t d = (uintptr_t)c->dst, s = (uintptr_t)c->src;
            uintptr_t rd = (uintptr_t)r->dst + (r->height - 1) * r->dpitch;
            uintptr_t rs = (uintptr_t)r->src + (r->height - 1) * r->spitch;
            if (r->height == 1 && d == rd + r->width && s == rs + r->width) {
                r->width += c->bytes; /* continues the row */
                r->count = i + 1 - r->first;
                continue;
            }
            if (c->bytes == r->width && d > rd && s > rs && d - rd >= r->width &&
                s - rs >= r->width && d - rd < ((uintptr_t)1 << 31) &&
                s - rs < ((uintptr_t)1 << 31) &&
                (r->height == 1 || (d - rd == r->dpitch && s - rs == r->spitch))) {
                r->dpitch = d - rd; /* the next row */
                r->spitch = s - rs;
                r->height++;
                r->count = i + 1 - r->first;
                continue;
            }
        }
        r = &runs[nr++];
        *r = (rekv_copy_run){c->dst, c->src, c->bytes, 1, c->bytes, c->bytes, i, 1};
    }
    return nr;
}

int rekv_copy_check(const char *dir, const rekv_copy_piece *pieces, size_t n, rekv_xfer_kind kind,
                    size_t *bytes, char *why, size_t why_len)
{
    size_t total = 0;
    if (n > 0 && pieces == NULL) {
        snprintf(why, why_len, "%s copy of %zu pieces with a NULL piece array", dir, n);
        return -EINVAL;
    }
    if ((unsigned)kind >= REKV_XFER_KINDS) {
        snprintf(why, why_len, "%s copy with unknown transfer kind %d", dir, (int)kind);
        return -EINVAL;
    }
    for (size_t i = 0; i < n; i++) {
        if (pieces[i].bytes > 0 && (pieces[i].dst == NULL || pieces[i].src == NULL)) {
            snprintf(why, why_len, "%s copy, piece %zu of %zu: NULL %s for %zu bytes", dir, i, n,
                     pieces[i].dst == NULL ? "dst" : "src", pieces[i].bytes);
            return -EINVAL;
        }
        if (total + pieces[i].bytes < total) {
            snprintf(why, why_len, "%s copy: total size overflows", dir);
            return -EINVAL;
        }
        total += pieces[i].bytes;
    }
    *bytes = total;
    return 0;
}

int rekv_link_emulates(const rekv_link_config *link)
{
    return link && (link->gbps > 0 || link->device_bytes > 0);
}
