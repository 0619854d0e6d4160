/* ratelimit.c — the per-call-site log limit of ratelimit.h. */
#include "common/ratelimit.h"

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
