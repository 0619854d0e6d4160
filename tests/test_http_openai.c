/* test_http_openai.c — the HTTP server checked by a client that is not ours: the official `openai`
 * npm package (tests/openai/check.mjs, run by /usr/bin/node) against real coordinators and cpu
 * workers: models, completions streamed and not, n and seed, stop strings, logprobs, the error
 * classes it maps our status codes to, a Bearer key, chat's refusal without a template, chat with
 * one (a second server: llama-tiny-py with Qwen2.5's template; streamed, logprobs, text parts),
 * and a stream it aborts. Its summary is then compared with the control socket's own record: the
 * greedy completion's and the chat's texts are their jobs', the aborted stream's job ends
 * CANCELLED. Skipped (a failure under CI=true) without node or without tests/openai/node_modules
 * (`npm ci` in tests/openai; .ci/run does it). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/http_env.h"
#include "tests/testutil.h"

#define NODE "/usr/bin/node"

static int have_client(void)
{
    const char *why = access(NODE, X_OK) != 0 ? NODE " is not installed"
                      : access("tests/openai/node_modules/openai/package.json", R_OK) != 0
                          ? "the openai package is not installed (cd tests/openai && npm ci)"
                          : NULL;
    if (why == NULL)
        return 1;
    ck_assert_msg(!tu_ci(), "%s (CI=true)", why);
    fprintf(stderr, "   skip: %s\n", why);
    return 0;
}

START_TEST(openai_client)
{
    if (!have_client())
        return;
    char *dir = tu_tmpdir();
    char key[4200];
    snprintf(key, sizeof(key), "%s/key", dir);
    FILE *f = fopen(key, "w");
    ck_assert_ptr_nonnull(f);
    fputs("sk-rekv-test\n", f);
    fclose(f);
    const char *extra[] = {"--api-key-file", key, NULL};
    hx_env x, y;
    const char *chat_model = hx_chat_model(dir, "Qwen-Qwen2.5-7B-Instruct");
    if (chat_model == NULL || hx_start(&x, extra, 1)) {
        tu_rmrf(dir);
        free(dir);
        return;
    }
    if (hx_start_model(&y, chat_model, NULL, 1)) {
        hx_stop(&x);
        tu_rmrf(dir);
        free(dir);
        return;
    }
    char cmd[8800], log[4300];
    snprintf(log, sizeof(log), "%s/node.log", dir);
    snprintf(cmd, sizeof(cmd),
             "REKV_BASE_URL=http://127.0.0.1:%d/v1 REKV_MODEL=docs8L REKV_API_KEY=sk-rekv-test "
             "REKV_CHAT_BASE_URL=http://127.0.0.1:%d/v1 REKV_CHAT_MODEL=Qwen-Qwen2.5-7B-Instruct "
             NODE " tests/openai/check.mjs 2>%s",
             x.port, y.port, log);
    char *out = NULL;
    int rc = tu_run(cmd, &out);
    char *err = tu_read_file(log, NULL);
    ck_assert_msg(rc == 0, "check.mjs failed (%d):\n%s\n%s", rc, out ? out : "",
                  err ? tu_log_end(log) : "");
    free(err);
    const char *last = strrchr(out, '{');
    ck_assert_ptr_nonnull(last);
    json_error_t je;
    json_t *sum = json_loads(last, 0, &je);
    ck_assert_msg(sum != NULL, "summary: %s", je.text);

    rekv_ctl *c = hx_ctl(&x);
    uint64_t job = strtoull(strrchr(json_string_value(json_object_get(sum, "completion_id")), '-') + 1,
                            NULL, 10);
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    Rekv__Control__StatusRequest st = REKV__CONTROL__STATUS_REQUEST__INIT;
    st.job = job;
    st.with_text = 1;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_STATUS;
    rq.status = &st;
    Rekv__Control__Response *r = tu_ctl_call(c, &rq);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    ck_assert_str_eq(r->job->text, json_string_value(json_object_get(sum, "completion_text")));
    rekv__control__response__free_unpacked(r, NULL);

    job = strtoull(strrchr(json_string_value(json_object_get(sum, "aborted_id")), '-') + 1, NULL,
                   10);
    for (;;) {
        r = tu_ctl_status(c, job);
        ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
        Rekv__Control__JobState s = r->job->state;
        size_t n = r->job->n_generated_ids;
        rekv__control__response__free_unpacked(r, NULL);
        if (s == REKV__CONTROL__JOB_STATE__QUEUED || s == REKV__CONTROL__JOB_STATE__RUNNING) {
            usleep(10000);
            continue;
        }
        ck_assert_msg(s == REKV__CONTROL__JOB_STATE__CANCELLED, "the aborted stream's job: %s",
                      rekv_ctl_state_name(s));
        ck_assert_msg(n < 200, "the aborted stream's job ran %zu of 400 tokens", n);
        break;
    }
    rekv_ctl_close(c);

    /* the chat answer is its job's text */
    c = hx_ctl(&y);
    job = strtoull(strrchr(json_string_value(json_object_get(sum, "chat_id")), '-') + 1, NULL, 10);
    st.job = job;
    r = tu_ctl_call(c, &rq);
    ck_assert_int_eq(r->code, REKV__CONTROL__CODE__OK);
    ck_assert_str_eq(r->job->text, json_string_value(json_object_get(sum, "chat_text")));
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    json_decref(sum);
    free(out);
    hx_stop(&y);
    hx_stop(&x);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("http_openai");
    TCase *tc = tcase_create("openai");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, openai_client);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
