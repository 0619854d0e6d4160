/* mode_infinigen.c — infinigen's entry in the pipeline's mode table: the speculation one layer
 * ahead and the selection are pipeline_infinigen.c's (its opening comment is the data flow, and
 * clo shares the speculation); here is how a unit of infinigen plans — at layers > 0 a decode row
 * fetches the rows its KV heads selected, packed into slots, and recomputes the most-chosen of them
 * within the split; layer 0 and prefill fetch whole, recomputing [device part, split) when
 * activations are kept (kvpr's path). The selection itself is a kernel on the h2d stream (the
 * device's own, ig_select), so neither the step thread nor the device waits for the host
 * (unit_fetch, step_done: pipeline_infinigen.c), except where the plan needs it (push, a split
 * on an MHA model: st->ig_wait). */
#include <errno.h>

#include "gpuworker/pipeline_internal.h"

static int ig_create(rekv_pipeline *p, rekv_err *err)
{
    return pl_ig_create(p, 0, err); /* no whole queries: the partial query weight may fold */
}

/* [device part, split) of a layer fetched whole, or up to split selected tokens */
static size_t ig_recompute_rows(const rekv_pipeline *p, const step *st, int it)
{
    const rekv_pseq *s = st->items[it].seq;
    int ctx = s->len, dev = pl_dev_part(s, ctx);
    return p->keep_act && st->split[it] > 0
               ? (size_t)(st->split[it] < ctx - dev ? st->split[it] : ctx - dev)
               : 0;
}

static int ig_unit_plan(rekv_pipeline *p, step *st, int g, int layer, int b, rekv_attn_seq *d,
                        unit_io *io)
{
    int rc = pl_ig_unit_begin(p, st, g, layer, io), L = p->c->n_layers;
    if (rc || (layer > 0 && (rc = pl_ig_unit_prepare(p, st, g, layer, d, io))))
        return rc;
    /* selected rows recomputed within the split go to each head's own slot */
    if ((rc = pl_unit_act_alloc(p, st, g, p->keep_act, io)))
        return rc;
    for (int j = 0; j < st->g_begin[g + 1] - st->g_begin[g]; j++) {
        int item = st->g_begin[g] + j;
        if (layer > 0 && pl_ig_sparse(p, st, item))
            rc = pl_ig_item_plan(p, st, item, j, layer, &st->kv_ref[item * L + layer],
                                 p->keep_act ? &st->act_ref[item * L + layer] : NULL, b, &d[j], io);
        else
            rc = pl_item_plan_whole(p, st, item, j, layer, b, d, 1, io);
        if (rc)
            return rc;
    }
    return 0;
}

static void ig_free(rekv_pipeline *p)
{
    pl_ig_free(p);
}

const pl_mode_ops pl_mode_infinigen = {
    .mode = REKV_MODE_INFINIGEN,
    .create = ig_create,
    .free = ig_free,
    .seq_alloc = pl_ig_seq_alloc,
    .seq_free = pl_ig_seq_free,
    .prefix_fill = pl_ig_prefix_fill,
    .step_prepare = pl_ig_prepare,
    .sparse = pl_ig_sparse,
    .recompute_rows = ig_recompute_rows,
    .unit_plan = ig_unit_plan,
    .unit_fetch = pl_ig_unit_fetch,
    .step_done = pl_ig_step_done,
};
