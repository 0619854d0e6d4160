/* ratelimit.h — at most one log line per interval per call site, counting the lines held back so
 * that the next line let through can say how many there were. The caller keeps one
 * rekv_ratelimit per call site and passes the clock in (tests give their own); not thread-safe:
 * one per thread that logs there. */
#ifndef REKV_COMMON_RATELIMIT_H
#define REKV_COMMON_RATELIMIT_H

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

#endif
