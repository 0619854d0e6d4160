/* test_logprobs.c — Submit.logprobs / top_logprobs (issue 36) through real daemons (a cpu worker,
 * the coordinator), against an independent computation: the same job run by rekv_generate in
 * this process with every logit recorded (top_logits = the vocabulary), and the log-softmax of
 * those logits computed here in long double. The worker's values must be those to within fp32's
 * rounding — of the raw logits, before temperature, top-k and top-p (the sampled job shows it:
 * its temperature would move every value) — in JobStatus, in the stream's events, and after a
 * coordinator restart (journal); a job's top_logits beside its top_logprobs stay as before. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "co_env.h"
#include "testutil.h"

/* The reference: gp's job through rekv_generate with every logit, into *ref. */
static void reference(const char *model, const int32_t *prompt, int n, rekv_gen_params gp,
                      rekv_gen_result *ref, int *vocab)
{
    rekv_err err = {0};
    rekv_model *m = NULL;
    rekv_engine *e = NULL;
    ck_assert_msg(rekv_model_open(model, &m, &err) == 0, "%s", err.msg);
    ck_assert_msg(rekv_engine_create(m, &e, &err) == 0, "%s", err.msg);
    *vocab = rekv_engine_config(e)->vocab;
    gp.top_logits = *vocab;
    ck_assert_msg(rekv_generate(e, prompt, n, &gp, ref, &err) == 0, "%s", err.msg);
    rekv_engine_free(e);
    rekv_model_close(m);
}

/* got is want rounded to fp32 (an ulp of slack: the worker rounds an exact double once) */
static void expect_close(float got, long double want, const char *what, size_t t)
{
    long double tol = fabsl(want) * (long double)FLT_EPSILON + 1e-30L;
    ck_assert_msg(fabsl((long double)got - want) <= tol, "%s of token %zu: %.9g, want %.12Lg", what,
                  t, (double)got, want);
}

/* Token t's log-softmax from its full logits row: its own, and the k most likely (ids ranked by
 * logit, lower id first on ties) into ids/lps. */
static long double ref_logprob(const rekv_gen_result *ref, int V, size_t t, int k, int32_t *ids,
                               long double *lps)
{
    const int32_t *rid = ref->top_ids + t * (size_t)V;
    const float *rv = ref->top_vals + t * (size_t)V; /* every logit, largest first */
    long double sum = 0;
    for (int i = 0; i < V; i++)
        sum += expl((long double)rv[i]);
    long double lse = logl(sum), own = NAN;
    for (int i = 0; i < V; i++)
        if (rid[i] == ref->ids[t])
            own = (long double)rv[i] - lse;
    for (int q = 0; q < k; q++) {
        ids[q] = rid[q];
        lps[q] = (long double)rv[q] - lse;
    }
    return own;
}

/* The job's status (with its logprobs) against the reference. */
static void check_status(const Rekv__Control__JobStatus *st, const rekv_gen_result *ref, int V,
                         uint32_t k, uint32_t top_logits)
{
    ck_assert_int_eq(st->state, REKV__CONTROL__JOB_STATE__DONE);
    ck_assert_uint_eq(st->n_generated_ids, (size_t)ref->n);
    ck_assert_uint_eq(st->n_logprobs, (size_t)ref->n);
    ck_assert_uint_eq(st->top_logprobs, k);
    ck_assert_uint_eq(st->n_top_logprob_ids, (size_t)ref->n * k);
    ck_assert_uint_eq(st->n_top_logprob_vals, (size_t)ref->n * k);
    for (size_t t = 0; t < (size_t)ref->n; t++) {
        ck_assert_int_eq(st->generated_ids[t], ref->ids[t]);
        int32_t ids[32];
        long double lps[32];
        expect_close(st->logprobs[t], ref_logprob(ref, V, t, (int)k, ids, lps), "logprob", t);
        for (uint32_t q = 0; q < k; q++) {
            ck_assert_int_eq(st->top_logprob_ids[t * k + q], ids[q]);
            expect_close(st->top_logprob_vals[t * k + q], lps[q], "top logprob", t);
        }
        /* top_logits are the raw logits, as before */
        for (uint32_t q = 0; q < top_logits; q++) {
            ck_assert_int_eq(st->top_ids[t * top_logits + q], ref->top_ids[t * (size_t)V + q]);
            ck_assert(st->top_vals[t * top_logits + q] == ref->top_vals[t * (size_t)V + q]);
        }
    }
}

/* Submits with a stream; the events' logprobs, concatenated, are the status's. Returns the job. */
static uint64_t run_streamed(rekv_ctl *c, Rekv__Control__Submit *s, const rekv_gen_result *ref,
                             int V)
{
    s->stream = 1;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = s;
    uint64_t id, job = 0;
    rekv_err err = {0};
    ck_assert_msg(rekv_ctl_send(c, &rq, &id, &err) == 0, "%s", err.msg);
    Rekv__Control__JobStatus acc = REKV__CONTROL__JOB_STATUS__INIT;
    int32_t gen[256], tids[256 * 20];
    float lps[256], tvals[256 * 20];
    acc.generated_ids = gen, acc.logprobs = lps, acc.top_logprob_ids = tids;
    acc.top_logprob_vals = tvals;
    acc.top_logprobs = s->top_logprobs;
    uint32_t k = s->top_logprobs;
    for (int done = 0; !done;) {
        Rekv__Control__Response *r = NULL;
        ck_assert_msg(rekv_ctl_recv(c, 60000, &r, &err) == 0, "%s", err.msg);
        ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
        if (r->body_case == REKV__CONTROL__RESPONSE__BODY_SUBMITTED) {
            job = r->submitted->job;
        } else {
            const Rekv__Control__StreamEvent *ev = r->event;
            ck_assert_uint_eq(ev->offset, acc.n_generated_ids);
            ck_assert_uint_eq(ev->n_logprobs, ev->n_tokens);
            ck_assert_uint_eq(ev->n_top_logprob_ids, ev->n_tokens * k);
            ck_assert(acc.n_generated_ids + ev->n_tokens <= 256);
            memcpy(gen + acc.n_generated_ids, ev->tokens, 4 * ev->n_tokens);
            memcpy(lps + acc.n_generated_ids, ev->logprobs, 4 * ev->n_tokens);
            memcpy(tids + acc.n_generated_ids * k, ev->top_logprob_ids, 4 * ev->n_tokens * k);
            memcpy(tvals + acc.n_generated_ids * k, ev->top_logprob_vals, 4 * ev->n_tokens * k);
            acc.n_generated_ids += ev->n_tokens;
            acc.state = ev->state;
            done = ev->done;
        }
        rekv__control__response__free_unpacked(r, NULL);
    }
    acc.n_logprobs = acc.n_generated_ids;
    acc.n_top_logprob_ids = acc.n_top_logprob_vals = acc.n_generated_ids * k;
    check_status(&acc, ref, V, k, 0);
    return job;
}

START_TEST(logprobs_exact)
{
    env e;
    if (ct_env_open(&e))
        return;
    pid_t co = ct_start_coordinator(&e, "64", "5000"), wk = ct_start_worker(&e, "4");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    ct_wait_workers(c, 1);
    int32_t prompt[] = {1, 403, 407, 261, 378, 288, 262};
    int n = (int)(sizeof(prompt) / sizeof(prompt[0]));
    /* greedy, then sampled: temperature 0.8 with top-k and top-p, whose values must not move */
    rekv_gen_params gps[2] = {
        {.max_new_tokens = 40, .temperature = 0, .top_p = 1},
        {.max_new_tokens = 40, .temperature = 0.8f, .top_k = 40, .top_p = 0.9f, .seed = 7}};
    uint64_t jobs[2];
    rekv_gen_result refs[2];
    int V = 0;
    for (int i = 0; i < 2; i++) {
        reference(e.model, prompt, n, gps[i], &refs[i], &V);
        ck_assert_int_eq(refs[i].n, 40);
        Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
        smp.temperature = gps[i].temperature;
        smp.top_k = (uint32_t)gps[i].top_k;
        smp.top_p = gps[i].top_p;
        smp.seed = gps[i].seed;
        Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
        s.prompt_ids = prompt;
        s.n_prompt_ids = (size_t)n;
        s.sampling = &smp;
        s.max_new_tokens = 40;
        s.logprobs = 1;
        s.top_logprobs = i == 0 ? 5 : 20;
        s.top_logits = 3; /* beside them, still the raw logits */
        jobs[i] = run_streamed(c, &s, &refs[i], V);
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < 2; i++) {
            Rekv__Control__Response *r = tu_ctl_status(c, jobs[i]);
            ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "%s", r->error);
            check_status(r->job, &refs[i], V, i == 0 ? 5 : 20, 3);
            rekv__control__response__free_unpacked(r, NULL);
        }
        if (pass == 1)
            break;
        /* journaled: the same after a restart */
        rekv_ctl_close(c);
        ck_assert_int_eq(ct_stop(co), 0);
        co = ct_start_coordinator(&e, "64", "5000");
        c = ct_ctl_open(e.ctl);
    }
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(wk), 0);
    ck_assert_int_eq(ct_stop(co), 0);
    for (int i = 0; i < 2; i++)
        rekv_gen_result_free(&refs[i]);
    ct_env_close(&e);
}
END_TEST

static void expect_bad(rekv_ctl *c, Rekv__Control__Submit *s, const char *what)
{
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = s;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__BAD_REQUEST);
    ck_assert_msg(strstr(r->error, what), "%s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
}

START_TEST(logprobs_refused)
{
    env e;
    if (ct_env_open(&e))
        return;
    pid_t co = ct_start_coordinator(&e, "64", "5000");
    rekv_ctl *c = ct_ctl_open(e.ctl);
    int32_t prompt[] = {1, 2};
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.prompt_ids = prompt;
    s.n_prompt_ids = 2;
    s.max_new_tokens = 4;
    s.top_logprobs = 2;
    expect_bad(c, &s, "top_logprobs 2 needs logprobs");
    s.logprobs = 1;
    s.top_logprobs = 21;
    expect_bad(c, &s, "top_logprobs 21 is outside 0..20");
    rekv_ctl_close(c);
    ck_assert_int_eq(ct_stop(co), 0);
    ct_env_close(&e);
}
END_TEST

static Suite *logprobs_suite(void)
{
    Suite *s = suite_create("logprobs");
    TCase *tc = tcase_create("logprobs");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, logprobs_exact);
    tcase_add_test(tc, logprobs_refused);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(logprobs_suite());
}
