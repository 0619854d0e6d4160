/* mode_resident.c — resident's entry in the pipeline's mode table: each sequence's KV cache of
 * every layer on the device (kvlayout.h, cap positions), which the attention reads and kv_scatter
 * writes in place; nothing streams (common/mode.c: store NONE), so the step plans no unit and a
 * decode step may run as one device graph (pipeline_graph.c). */
#include <errno.h>

#include "gpuworker/pipeline_internal.h"

static int resident_seq_alloc(rekv_pipeline *p, rekv_pseq *s, rekv_err *err)
{
    const rekv_model_config *c = p->c;
    size_t n = (size_t)c->n_layers * rekv_kv_buffer_elems(c->n_kv_heads, c->head_dim, s->cap);
    s->kv = p->bi->dev_alloc(p->be, rekv_kv_off(n, c->head_dim, p->kv_rowb));
    if (s->kv == NULL)
        return rekv_errf(err, -ENOMEM, "out of device memory for a KV cache of %d tokens", s->cap);
    return 0;
}

static void resident_seq_free(rekv_pipeline *p, rekv_pseq *s)
{
    if (s->kv)
        p->bi->dev_free(p->be, s->kv);
    s->kv = NULL;
}

const pl_mode_ops pl_mode_resident = {
    .mode = REKV_MODE_RESIDENT,
    .seq_alloc = resident_seq_alloc,
    .seq_free = resident_seq_free,
};
