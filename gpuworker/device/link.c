/* link.c — the link emulation options every program takes (--link-gbps, --link-latency-us,
 * --device-memory), parsed in one place. A file of its own so that the cuda backend's shared
 * object, which links backend.c, does not pull the size parser and its daemon helpers in. */
#include "gpuworker/device/backend.h"

#include "common/daemon.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int link_number(const char *name, const char *arg, double *out, rekv_err *err)
{
    char *end;
    errno = 0;
    double x = strtod(arg, &end);
    if (end == arg || *end || errno || !(x >= 0 && x <= 1e6))
        return rekv_errf(err, -EINVAL, "--%s: expected a number from 0 to 1e6, got '%s'", name, arg);
    *out = x;
    return 0;
}

int rekv_link_parse(rekv_link_config *link, const char *name, const char *arg, rekv_err *err)
{
    if (strcmp(name, "link-gbps") == 0)
        return link_number(name, arg, &link->gbps, err);
    if (strcmp(name, "link-latency-us") == 0)
        return link_number(name, arg, &link->latency_us, err);
    if (strcmp(name, "device-memory") == 0) {
        if (rekv_parse_size(arg, &link->device_bytes))
            return rekv_errf(err, -EINVAL, "--%s: expected a size such as 512M, got '%s'", name, arg);
        return 0;
    }
    return rekv_errf(err, -ENOENT, "--%s: not a link emulation option", name);
}
