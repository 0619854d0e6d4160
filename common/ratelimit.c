/* ratelimit.c — the per-call-site log limit of ratelimit.h. */
#include "common/ratelimit.h"

#include <stdio.h>
#include <string.h>

int rekv_ratelimit_allow(rekv_ratelimit *rl, uint64_t now_ns, uint64_t interval_ns,
                         uint64_t *suppressed)
{
    if (rl->used && now_ns - rl->last_ns < interval_ns) {
        rl->suppressed++;
        return 0;
    }
    if (suppressed)
        *suppressed = rl->suppressed;
    rl->suppressed = 0;
    rl->last_ns = now_ns;
    rl->used = 1;
    return 1;
}

int rekv_ratelimit_vformat(rekv_ratelimit *rl, uint64_t now_ns, char *buf, size_t cap,
                           const char *fmt, va_list ap)
{
    uint64_t held = 0;
    if (!rekv_ratelimit_allow(rl, now_ns, REKV_RATELIMIT_INTERVAL_NS, &held))
        return 0;
    char tail[64] = "";
    if (held)
        snprintf(tail, sizeof(tail), " (%llu similar messages suppressed)",
                 (unsigned long long)held);
    size_t t = strlen(tail), room = cap > t ? cap - t : 1;
    int n = vsnprintf(buf, room, fmt, ap);
    size_t len = n < 0 ? 0 : (size_t)n < room ? (size_t)n : room - 1;
    snprintf(buf + len, cap - len, "%s", tail);
    return 1;
}

int rekv_ratelimit_format(rekv_ratelimit *rl, uint64_t now_ns, char *buf, size_t cap,
                          const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int go = rekv_ratelimit_vformat(rl, now_ns, buf, cap, fmt, ap);
    va_end(ap);
    return go;
}
