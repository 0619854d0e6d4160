/* generate.c — one sequence from prompt to finished continuation: prefill, then decode steps. */
#include "gpuworker/gpuworker.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"

void rekv_gen_result_free(rekv_gen_result *r)
{
    free(r->ids);
    free(r->top_ids);
    free(r->top_vals);
    memset(r, 0, sizeof(*r));
}

int rekv_prompt_check(const rekv_model_config *c, const int32_t *prompt, int n, rekv_err *err)
{
    if (n <= 0)
        return rekv_errf(err, -EINVAL, "the prompt is empty");
    if (n > c->max_pos)
        return rekv_errf(err, -E2BIG,
                         "the prompt of %d tokens is longer than the model's context of %d tokens",
                         n, c->max_pos);
    for (int i = 0; i < n; i++)
        if (prompt[i] < 0 || prompt[i] >= c->vocab)
            return rekv_errf(err, -EINVAL, "prompt token id %d is outside the vocabulary (0..%d)",
                             prompt[i], c->vocab - 1);
    return 0;
}

int rekv_generate(rekv_engine *e, const int32_t *prompt, int n_prompt, const rekv_gen_params *p,
                  rekv_gen_result *out, rekv_err *err)
{
    const rekv_model_config *c = rekv_engine_config(e);
    memset(out, 0, sizeof(*out));
    int prc = rekv_prompt_check(c, prompt, n_prompt, err);
    if (prc)
        return prc;
    if (p->max_new_tokens < 0 || p->top_logits < 0)
        return rekv_errf(err, -EINVAL, "max_new_tokens and top_logits must not be negative");
    int rc = 0;
    rekv_seq *seq = NULL;
    int k = p->top_logits < c->vocab ? p->top_logits : c->vocab;
    int max_new = p->max_new_tokens;
    /* the last generated token is never fed back, so it needs no cache slot */
    int64_t want = (int64_t)n_prompt + (max_new > 0 ? max_new - 1 : 0);
    int cap = want < c->max_pos ? (int)want : c->max_pos;
    float *logits = malloc(sizeof(float) * (size_t)c->vocab);
    void *scratch = malloc(sizeof(float) * 2 * (size_t)c->vocab);
    out->ids = malloc(sizeof(int32_t) * (size_t)(max_new + 1));
    if (k > 0) {
        out->top_ids = malloc(sizeof(int32_t) * (size_t)k * (size_t)(max_new + 1));
        out->top_vals = malloc(sizeof(float) * (size_t)k * (size_t)(max_new + 1));
    }
    if (!logits || !scratch || !out->ids || (k > 0 && (!out->top_ids || !out->top_vals))) {
        rc = rekv_errf(err, -ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = rekv_seq_create(e, cap, &seq, err)))
        goto out;
    rekv_sampler s;
    rekv_sampler_init(&s, p->temperature, p->top_k, p->top_p, p->seed);
    out->finish_reason = "length";
    uint64_t t0 = rekv_now_ns();
    rekv_batch_item it = {seq, prompt, n_prompt, 0, logits};
    if (max_new > 0 && (rc = rekv_engine_forward(e, &it, 1, err)))
        goto out;
    uint64_t t1 = rekv_now_ns();
    out->prefill_s = (double)(t1 - t0) * 1e-9;
    while (out->n < max_new) {
        if (k > 0)
            rekv_top_logits(logits, c->vocab, k, out->top_ids + (size_t)out->n * k,
                            out->top_vals + (size_t)out->n * k);
        int32_t tok = rekv_sample(&s, logits, c->vocab, scratch);
        if (tok < 0) {
            rc = rekv_errf(err, -EDOM, "%s", REKV_NAN_LOGITS);
            goto out;
        }
        out->ids[out->n++] = tok;
        if (p->stop_at_eos && rekv_config_is_eos(c, tok)) {
            out->finish_reason = "eos";
            break;
        }
        if (out->n == max_new)
            break;
        if (rekv_seq_len(seq) >= c->max_pos) {
            out->finish_reason = "context";
            break;
        }
        it = (rekv_batch_item){seq, &out->ids[out->n - 1], 1, 0, logits};
        if ((rc = rekv_engine_forward(e, &it, 1, err)))
            goto out;
    }
    out->decode_s = (double)(rekv_now_ns() - t1) * 1e-9;
out:
    rekv_seq_free(seq);
    free(logits);
    free(scratch);
    if (rc)
        rekv_gen_result_free(out);
    return rc;
}
