/* mode.c — see mode.h. */
#include "common/mode.h"

#include <errno.h>
#include <string.h>

static const char *const mode_names[] = {"resident", "offload",   "kvpr", "act",
                                         "hybrid",   "infinigen", "clo"};
enum { N_MODES = sizeof(mode_names) / sizeof(mode_names[0]) };

const char *rekv_mode_name(rekv_mode m)
{
    return (unsigned)m < N_MODES ? mode_names[m] : "?";
}

int rekv_mode_parse(const char *s, rekv_mode *out)
{
    for (int i = 0; s && i < N_MODES; i++)
        if (strcmp(s, mode_names[i]) == 0) {
            *out = (rekv_mode)i;
            return 0;
        }
    return -EINVAL;
}

int rekv_mode_approximate(rekv_mode m)
{
    return m == REKV_MODE_INFINIGEN || m == REKV_MODE_CLO;
}
