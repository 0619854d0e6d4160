/* clock.h — monotonic time for stats and benchmarks. */
#ifndef REKV_COMMON_CLOCK_H
#define REKV_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t rekv_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline double rekv_now_s(void) { return (double)rekv_now_ns() * 1e-9; }

#endif
