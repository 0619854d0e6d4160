/* mode.c — see mode.h: the modes' property table. */
#include "common/mode.h"

#include <errno.h>
#include <string.h>

static const rekv_mode_info modes[REKV_MODE_COUNT] = {
    [REKV_MODE_RESIDENT] = {.name = "resident", .store = REKV_STORE_NONE},
    [REKV_MODE_OFFLOAD] = {.name = "offload",
                           .store = REKV_STORE_KV,
                           .device_part = 1,
                           .layer_windows = 1},
    [REKV_MODE_KVPR] = {.name = "kvpr",
                        .store = REKV_STORE_KV,
                        .split = REKV_SPLIT_PREFIX,
                        .act_gpu = 1,
                        .device_part = 1,
                        .layer_windows = 1},
    [REKV_MODE_ACT] = {.name = "act",
                       .store = REKV_STORE_ACT,
                       .act_gpu = 1,
                       .device_part = 1,
                       .layer_windows = 1},
    [REKV_MODE_HYBRID] = {.name = "hybrid",
                          .store = REKV_STORE_PATTERN,
                          .act_gpu = 1,
                          .device_part = 1,
                          .layer_windows = 1},
    [REKV_MODE_INFINIGEN] = {.name = "infinigen",
                             .approximate = 1,
                             .store = REKV_STORE_KV,
                             .split = REKV_SPLIT_SELECTED,
                             .device_part = 1,
                             .speculates = 1,
                             .selects = 1},
    [REKV_MODE_CLO] = {.name = "clo",
                       .approximate = 1,
                       .store = REKV_STORE_KV,
                       .speculates = 1,
                       .head_caches = 1,
                       .selects = 1},
};

const rekv_mode_info *rekv_mode_info_of(rekv_mode m)
{
    return (unsigned)m < REKV_MODE_COUNT && modes[m].name ? &modes[m] : NULL; /* a row left out */
}

const char *rekv_mode_name(rekv_mode m)
{
    const rekv_mode_info *i = rekv_mode_info_of(m);
    return i ? i->name : "?";
}

int rekv_mode_parse(const char *s, rekv_mode *out)
{
    for (int i = 0; s && i < REKV_MODE_COUNT; i++)
        if (modes[i].name && strcmp(s, modes[i].name) == 0) {
            *out = (rekv_mode)i;
            return 0;
        }
    return -EINVAL;
}

int rekv_mode_approximate(rekv_mode m)
{
    const rekv_mode_info *i = rekv_mode_info_of(m);
    return i && i->approximate;
}

int rekv_mode_streams(rekv_mode m)
{
    const rekv_mode_info *i = rekv_mode_info_of(m);
    return i && i->store != REKV_STORE_NONE;
}

int rekv_mode_keeps_act(rekv_mode m, int split)
{
    const rekv_mode_info *i = rekv_mode_info_of(m);
    return i && (i->split == REKV_SPLIT_PREFIX || (i->split == REKV_SPLIT_SELECTED && split > 0));
}
