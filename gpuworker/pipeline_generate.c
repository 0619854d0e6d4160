/* pipeline_generate.c — generation over the pipeline (rekv_pipeline_generate): a batch of prompts
 * prefilled in one step, then decode steps over the sequences still running, sampled as
 * rekv_generate samples (generate.c), on the device: only the tokens (and any top logits)
 * cross back. */
#include "gpuworker/pipeline_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"

/* it draws r's next token (and its k top logits) with smp */
static void draw_into(rekv_pipe_item *it, rekv_sampler *smp, rekv_gen_result *r, int k)
{
    it->smp = smp;
    it->token = &r->ids[r->n];
    it->n_top = k;
    if (k > 0) {
        it->top_ids = r->top_ids + (size_t)r->n * k;
        it->top_vals = r->top_vals + (size_t)r->n * k;
    }
}

int rekv_pipeline_generate(rekv_pipeline *p, const int32_t *const *prompts, const int *n_prompts,
                           int n, const rekv_gen_params *gp, rekv_gen_result *res, rekv_err *err)
{
    return rekv_pipeline_generate_progress(p, prompts, n_prompts, n, gp, res, NULL, NULL, err);
}

int rekv_pipeline_generate_progress(rekv_pipeline *p, const int32_t *const *prompts,
                                    const int *n_prompts, int n, const rekv_gen_params *gp,
                                    rekv_gen_result *res, rekv_progress_fn progress, void *arg,
                                    rekv_err *err)
{
    const rekv_model_config *c = p->c;
    int rc = 0, k = gp->top_logits < c->vocab ? gp->top_logits : c->vocab;
    int max_new = gp->max_new_tokens;
    memset(res, 0, sizeof(*res) * (size_t)n);
    if (max_new < 0 || gp->top_logits < 0)
        return rekv_errf(err, -EINVAL, "max_new_tokens and top_logits must not be negative");
    for (int i = 0; i < n; i++)
        if ((rc = rekv_prompt_check(c, prompts[i], n_prompts[i], err)))
            return rc;
    rekv_pseq **seqs = calloc((size_t)n, sizeof(*seqs));
    rekv_sampler *smp = calloc((size_t)n, sizeof(*smp));
    rekv_pipe_item *items = calloc((size_t)n, sizeof(*items));
    int *idx = calloc((size_t)n, sizeof(int));
    if (!seqs || !smp || !items || !idx) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < n && rc == 0; i++) {
        int64_t want = (int64_t)n_prompts[i] + (max_new > 0 ? max_new - 1 : 0);
        int cap = want < c->max_pos ? (int)want : c->max_pos;
        res[i].ids = malloc(sizeof(int32_t) * (size_t)(max_new + 1));
        if (k > 0) {
            res[i].top_ids = malloc(sizeof(int32_t) * (size_t)k * (size_t)(max_new + 1));
            res[i].top_vals = malloc(sizeof(float) * (size_t)k * (size_t)(max_new + 1));
        }
        if (!res[i].ids || (k > 0 && (!res[i].top_ids || !res[i].top_vals)))
            rc = rekv_errf(err, -ENOMEM, "out of memory");
        else
            rc = rekv_pseq_create(p, cap, &seqs[i], err);
        rekv_sampler_init(&smp[i], gp->temperature, gp->top_k, gp->top_p, gp->seed + (uint64_t)i);
        res[i].finish_reason = "length";
        items[i] = (rekv_pipe_item){.seq = seqs[i], .tokens = prompts[i], .n_tokens = n_prompts[i]};
        idx[i] = i;
    }
    if (rc || max_new == 0)
        goto out;
    /* every step draws each running sequence's next token on the device, into its result */
    for (int i = 0; i < n; i++)
        draw_into(&items[i], &smp[i], &res[i], k);
    uint64_t t0 = rekv_now_ns();
    if ((rc = rekv_pipeline_step(p, items, n, err)))
        goto out;
    uint64_t t1 = rekv_now_ns();
    for (int i = 0; i < n; i++)
        res[i].prefill_s = (double)(t1 - t0) * 1e-9;
    int running = n;
    uint64_t generated = 0, total = (uint64_t)n * (uint64_t)max_new;
    while (running > 0) {
        int m = 0;
        for (int a = 0; a < running; a++) {
            int i = idx[a];
            rekv_gen_result *r = &res[i];
            int32_t tok = r->ids[r->n++];
            generated++;
            if (gp->stop_at_eos && rekv_config_is_eos(c, tok))
                r->finish_reason = "eos";
            else if (r->n < max_new && rekv_pseq_len(seqs[i]) >= c->max_pos)
                r->finish_reason = "context";
            else if (r->n < max_new)
                idx[m++] = i; /* still running */
        }
        if (progress)
            progress(arg, generated, total);
        /* the sequences still running, in order */
        running = m;
        for (int a = 0; a < running; a++) {
            int i = idx[a];
            items[a] = (rekv_pipe_item){
                .seq = seqs[i], .tokens = &res[i].ids[res[i].n - 1], .n_tokens = 1};
            draw_into(&items[a], &smp[i], &res[i], k);
        }
        if (running > 0 && (rc = rekv_pipeline_step(p, items, running, err)))
            goto out;
    }
    double dec = (double)(rekv_now_ns() - t1) * 1e-9;
    for (int i = 0; i < n; i++)
        res[i].decode_s = dec;
out:
    if (seqs)
        for (int i = 0; i < n; i++)
            rekv_pseq_free(seqs[i]);
    if (rc)
        for (int i = 0; i < n; i++)
            rekv_gen_result_free(&res[i]);
    free(seqs);
    free(smp);
    free(items);
    free(idx);
    return rc;
}
