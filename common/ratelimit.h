/* ratelimit.h — at most one log line per interval per call site, counting the lines held back so
 * that the next line let through can say how many there were. The caller keeps one
 * rekv_ratelimit per call site and passes the clock in (tests give their own); not thread-safe:
 * one per thread that logs there. */
#ifndef REKV_COMMON_RATELIMIT_H
#define REKV_COMMON_RATELIMIT_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#define REKV_RATELIMIT_INTERVAL_NS 1000000000ull /* one line per second */

typedef struct rekv_ratelimit {
    uint64_t last_ns;    /* when the last line was let through */
    uint64_t suppressed; /* lines held back since then */
    int used;            /* a line was let through once */
} rekv_ratelimit;

#define REKV_RATELIMIT_INIT {0, 0, 0}

/* 1 when a line may go out at now_ns (the first ever, or interval_ns after the last one let
 * through); then *suppressed gets the number held back since that one and the count starts
 * again. 0 when it is held back (and counted). */
int rekv_ratelimit_allow(rekv_ratelimit *rl, uint64_t now_ns, uint64_t interval_ns,
                         uint64_t *suppressed);

/* The line of a call site, one a second (REKV_RATELIMIT_INTERVAL_NS) through rl: 1 with fmt's text
 * in buf (cap bytes), followed by " (N similar messages suppressed)" when lines were held back
 * since the last one (the count always fits: the text is cut short first); 0 when this one is held
 * back. What every daemon's rate-limited log calls. */
int rekv_ratelimit_vformat(rekv_ratelimit *rl, uint64_t now_ns, char *buf, size_t cap,
                           const char *fmt, va_list ap);
int rekv_ratelimit_format(rekv_ratelimit *rl, uint64_t now_ns, char *buf, size_t cap,
                          const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#endif
