/* pipeline_modes.c — the pipeline's mode table: each mode's functions (pl_mode_ops,
 * pipeline_internal.h), defined in the mode's file, by rekv_mode. A new mode is a value in
 * common/mode.h with its properties in common/mode.c, its file gpuworker/mode_NAME.c with its
 * pl_mode_ops, and its line here; tests/test_modes.c checks that every mode has both. */
#include "gpuworker/pipeline_internal.h"

static const pl_mode_ops *const table[REKV_MODE_COUNT] = {
    [REKV_MODE_RESIDENT] = &pl_mode_resident, [REKV_MODE_OFFLOAD] = &pl_mode_offload,
    [REKV_MODE_KVPR] = &pl_mode_kvpr,         [REKV_MODE_ACT] = &pl_mode_act,
    [REKV_MODE_HYBRID] = &pl_mode_hybrid,     [REKV_MODE_INFINIGEN] = &pl_mode_infinigen,
    [REKV_MODE_CLO] = &pl_mode_clo,
};

const pl_mode_ops *pl_mode_ops_of(rekv_mode m)
{
    return (unsigned)m < REKV_MODE_COUNT ? table[m] : NULL;
}
