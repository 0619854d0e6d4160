/* test_params.c — a parameter is checked where it is accepted, and the refusal names it (issue
 * 41): a Submit's sampling fields (top_k 2^32-1, top_p NaN or out of (0, 1], temperature NaN or
 * negative, top_logits above the model's vocabulary) are bad requests naming the field, never a
 * job that fails later; rekv-kvstore's --lease-ms 0, --high-pct 150, --low-pct above --high-pct
 * and --host-bytes above the machine's memory, rekv-coordinator's --worker-timeout-ms 0 and
 * --max-attempts 0, rekv-gpuworker's --name '' exit 2 naming the option; a daemon whose
 * open-file limit caps --max-clients says so at start, with the limit; a model whose logits are
 * NaN fails generation with that error (locally and served), not token 0 with exit 0; and
 * `rekv-loader inspect` fails on a missing or transposed tensor. Runs the real programs. */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/coordinator.h"
#include "tests/co_guard.h"
#include "tests/testutil.h"

/* A synthetic llama of vocabulary 32 in dir/model (f32: every weight a float of 4 bytes). */
static void synth(const char *dir, char *model, size_t cap)
{
    char cmd[8192];
    snprintf(model, cap, "%s/model", dir);
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --ffn 128 --vocab 32 "
             "--dtype f32 %s >/dev/null",
             tu_bin("rekv-loader"), model);
    tu_run_ok(cmd);
}

/* model/model.safetensors with the header's `from` replaced by `to` (the same length) once, or,
 * when from is NULL, every data byte set to 0xff (a NaN in f32, f16 and bf16 alike). */
static void patch(const char *model, const char *from, const char *to)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/model.safetensors", model);
    size_t n = 0;
    char *b = tu_read_file(path, &n);
    ck_assert_ptr_nonnull(b);
    uint64_t hlen;
    memcpy(&hlen, b, 8);
    ck_assert_uint_le(8 + hlen, n);
    if (from) {
        ck_assert_uint_eq(strlen(from), strlen(to));
        char *at = memmem(b + 8, hlen, from, strlen(from));
        ck_assert_msg(at, "%s is not in the header", from);
        memcpy(at, to, strlen(to));
    } else {
        memset(b + 8 + hlen, 0xff, n - 8 - hlen);
    }
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(b, 1, n, f), n);
    ck_assert_int_eq(fclose(f), 0);
    free(b);
}

/* Runs cmd (its stderr into its stdout): the exit code, and want must be in what it printed. */
static void expect(const char *cmd, int want_rc, const char *want)
{
    char full[8192], *out = NULL;
    snprintf(full, sizeof(full), "%s 2>&1", cmd);
    int rc = tu_run(full, &out);
    ck_assert_msg(rc == want_rc, "%s: exit %d, want %d: %s", cmd, rc, want_rc, out);
    ck_assert_msg(strstr(out, want), "%s: no \"%s\" in: %s", cmd, want, out);
    free(out);
}

/* ---------------------------------------------------------------- Submit */

static Rekv__Control__Response *submit(rekv_ctl *c, float temp, uint32_t top_k, float top_p,
                                       uint32_t top_logits)
{
    static int32_t prompt[] = {1, 2, 3};
    Rekv__Control__Sampling smp = REKV__CONTROL__SAMPLING__INIT;
    smp.temperature = temp;
    smp.top_k = top_k;
    smp.top_p = top_p;
    Rekv__Control__Submit s = REKV__CONTROL__SUBMIT__INIT;
    s.n_prompt_ids = 3;
    s.prompt_ids = prompt;
    s.max_new_tokens = 2;
    s.top_logits = top_logits;
    s.sampling = &smp;
    Rekv__Control__Request rq = REKV__CONTROL__REQUEST__INIT;
    rq.body_case = REKV__CONTROL__REQUEST__BODY_SUBMIT;
    rq.submit = &s;
    return tu_ctl_call(c, &rq);
}

static void submit_refused(rekv_ctl *c, float temp, uint32_t top_k, float top_p,
                           uint32_t top_logits, const char *want)
{
    Rekv__Control__Response *r = submit(c, temp, top_k, top_p, top_logits);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__BAD_REQUEST, "want \"%s\", got code %d (%s)",
                  want, r->code, r->error);
    ck_assert_msg(strstr(r->error, want), "no \"%s\" in: %s", want, r->error);
    rekv__control__response__free_unpacked(r, NULL);
}

static void submit_accepted(rekv_ctl *c, float temp, uint32_t top_k, float top_p)
{
    Rekv__Control__Response *r = submit(c, temp, top_k, top_p, 0);
    ck_assert_msg(r->code == REKV__CONTROL__CODE__OK, "refused: %s", r->error);
    rekv__control__response__free_unpacked(r, NULL);
}

START_TEST(submit_names_the_field)
{
    char *dir = tu_tmpdir(), model[4200];
    synth(dir, model, sizeof(model));
    env e;
    const char *extra[] = {"--model", model, NULL};
    cg_env_start(&e, extra);
    rekv_ctl *c = cg_ctl_open(e.ctl);
    submit_refused(c, 0, UINT32_MAX, 0, 0, "top_k 4294967295 is above the limit");
    submit_refused(c, 0, 0, NAN, 0, "top_p nan is outside (0, 1]");
    submit_refused(c, 0, 0, -0.5f, 0, "top_p -0.5 is outside (0, 1]");
    submit_refused(c, 0, 0, 1.5f, 0, "top_p 1.5 is outside (0, 1]");
    submit_refused(c, NAN, 0, 0, 0, "temperature nan is outside [0, 100]");
    submit_refused(c, -1, 0, 0, 0, "temperature -1 is outside [0, 100]");
    submit_refused(c, INFINITY, 0, 0, 0, "temperature inf is outside [0, 100]");
    submit_refused(c, 0, 0, 0, 33, "top_logits 33 is above the model's vocabulary of 32");
    /* the edges are accepted (unset top_p is off), nothing else was */
    submit_accepted(c, 0, INT32_MAX, 0);
    submit_accepted(c, 1, 0, 1);
    submit_accepted(c, 0.5f, 5, 0.25f);
    Rekv__Control__Response *r = cg_stats(c);
    ck_assert_uint_eq(r->stats->queued, 3);
    rekv__control__response__free_unpacked(r, NULL);
    rekv_ctl_close(c);
    cg_env_stop(&e);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- daemon options */

START_TEST(daemon_options_named)
{
    char cmd[4096];
    const char *kv = tu_bin("rekv-kvstore");
#define KV "%s --endpoint ipc:///nonexistent/kv --layers 1 --kv-heads 1 --head-dim 8 --hidden 8 "
    snprintf(cmd, sizeof(cmd), KV "--host-bytes 1M --lease-ms 0", kv);
    expect(cmd, 2, "--lease-ms: bad value '0'");
    snprintf(cmd, sizeof(cmd), KV "--host-bytes 1M --high-pct 150", kv);
    expect(cmd, 2, "--high-pct: bad value '150'");
    snprintf(cmd, sizeof(cmd), KV "--host-bytes 1M --low-pct 0", kv);
    expect(cmd, 2, "--low-pct: bad value '0'");
    snprintf(cmd, sizeof(cmd), KV "--host-bytes 1M --high-pct 50 --low-pct 60", kv);
    expect(cmd, 2, "--low-pct 60 is above --high-pct 50");
    snprintf(cmd, sizeof(cmd), KV "--host-bytes 1M --low-pct 95", kv);
    expect(cmd, 2, "--low-pct 95 is above --high-pct 90 (the default)");
    /* twice the machine's memory */
    unsigned long long mem =
        (unsigned long long)sysconf(_SC_PHYS_PAGES) * (unsigned long long)sysconf(_SC_PAGESIZE);
    snprintf(cmd, sizeof(cmd), KV "--host-bytes %llu", kv, 2 * mem);
    char want[160];
    snprintf(want, sizeof(want), "--host-bytes %llu is more than this machine's memory (%llu",
             2 * mem, mem);
    expect(cmd, 2, want);
#undef KV
    const char *co = tu_bin("rekv-coordinator");
    snprintf(cmd, sizeof(cmd), "%s --control ipc:///nonexistent/c --worker-timeout-ms 0", co);
    expect(cmd, 2, "--worker-timeout-ms: bad value '0'");
    snprintf(cmd, sizeof(cmd), "%s --control ipc:///nonexistent/c --max-attempts 0", co);
    expect(cmd, 2, "--max-attempts: bad value '0'");
    snprintf(cmd, sizeof(cmd), "%s --model /nonexistent --name ''", tu_bin("rekv-gpuworker"));
    expect(cmd, 2, "--name: bad value ''");
}
END_TEST

/* ---------------------------------------------------------------- the fd cap */

/* Under a hard open-file limit of 1024 (prlimit: it cannot be raised) --max-clients 1024 is
 * lowered, and the coordinator says so at start with the limit that did it. */
/* cmd (args, under prlimit) starts and, stopped, has logged want. */
static void logs_at_start(const char *dir, const char *const *args, const char *want)
{
    char log[4200];
    snprintf(log, sizeof(log), "%s/log", dir);
    pid_t pid = tu_spawn(args, log, NULL);
    char *text = tu_read_file(log, NULL);
    ck_assert_msg(pid > 0, "%s did not start: %s", args[3], tu_log_end(text ? text : ""));
    free(text);
    ck_assert_int_eq(tu_stop(pid), 0);
    text = tu_read_file(log, NULL);
    ck_assert_ptr_nonnull(text);
    ck_assert_msg(strstr(text, want), "%s: no \"%s\" in: %s", args[3], want, tu_log_end(text));
    free(text);
    unlink(log);
}

START_TEST(fd_cap_logged)
{
    if (access("/usr/bin/prlimit", X_OK) != 0) {
        fprintf(stderr, "   skip: no /usr/bin/prlimit\n");
        return;
    }
    char *dir = tu_tmpdir(), ctl[4200], wrk[4200], kv[4200];
    snprintf(ctl, sizeof(ctl), "ipc://%s/control", dir);
    snprintf(wrk, sizeof(wrk), "ipc://%s/workers", dir);
    snprintf(kv, sizeof(kv), "ipc://%s/kv", dir);
    const char *want = "WARN --max-clients 1024 lowered to 1 per socket: the open-file limit "
                       "(RLIMIT_NOFILE) is 1024 (soft), 1024 (hard)";
    const char *co[] = {"/usr/bin/prlimit",
                        "--nofile=1024:1024",
                        "--",
                        tu_bin("rekv-coordinator"),
                        "--control",
                        ctl,
                        "--workers",
                        wrk,
                        NULL};
    logs_at_start(dir, co, want);
    const char *kvs[] = {"/usr/bin/prlimit",
                         "--nofile=1024:1024",
                         "--",
                         tu_bin("rekv-kvstore"),
                         "--endpoint",
                         kv,
                         "--host-bytes",
                         "1M",
                         "--no-spill",
                         "--layers",
                         "1",
                         "--kv-heads",
                         "1",
                         "--head-dim",
                         "8",
                         "--hidden",
                         "8",
                         NULL};
    logs_at_start(dir, kvs, want);
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- NaN logits */

/* All-NaN weights: generation fails with the NaN error, greedy (which would say token 0) and
 * sampling, in this process and through the daemons (the worker's step fails the job). */
START_TEST(nan_model_refused)
{
    char *dir = tu_tmpdir(), model[4200], cmd[8192];
    synth(dir, model, sizeof(model));
    patch(model, NULL, NULL);
    const char *rekv = tu_bin("rekv");
    snprintf(cmd, sizeof(cmd), "%s generate --model %s --prompt-ids 1,2 --max-new-tokens 2 --local",
             rekv, model);
    expect(cmd, 1, "the model's logits are NaN");
    snprintf(cmd, sizeof(cmd),
             "%s generate --model %s --prompt-ids 1,2 --max-new-tokens 2 --local --temperature 0.7",
             rekv, model);
    expect(cmd, 1, "the model's logits are NaN");
    snprintf(cmd, sizeof(cmd),
             "XDG_RUNTIME_DIR=%s %s generate --model %s --prompt-ids 1,2 --max-new-tokens 2", dir,
             rekv, model);
    expect(cmd, 1, "failed: the model's logits are NaN");
    tu_rmrf(dir);
    free(dir);
}
END_TEST

/* ---------------------------------------------------------------- inspect */

START_TEST(inspect_checks_tensors)
{
    char *dir = tu_tmpdir(), model[4200], cmd[8192];
    synth(dir, model, sizeof(model));
    snprintf(cmd, sizeof(cmd), "%s inspect %s", tu_bin("rekv-loader"), model);
    expect(cmd, 0, "every tensor the config needs is present with its shape");
    /* transposed: [vocab, hidden] read as [hidden, vocab], the same bytes */
    patch(model, "\"model.embed_tokens.weight\":{\"dtype\":\"F32\",\"shape\":[32,64]",
          "\"model.embed_tokens.weight\":{\"dtype\":\"F32\",\"shape\":[64,32]");
    expect(cmd, 1, "tensor \"model.embed_tokens.weight\" has shape [64, 32], expected [32, 64]");
    patch(model, "[64,32]", "[32,64]");
    expect(cmd, 0, "every tensor the config needs");
    /* missing: under another name */
    patch(model, "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proX.weight");
    expect(cmd, 1, "tensor \"model.layers.1.mlp.up_proj.weight\" is missing");
    tu_rmrf(dir);
    free(dir);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("params");
    TCase *tc = tcase_create("params");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, submit_names_the_field);
    tcase_add_test(tc, daemon_options_named);
    tcase_add_test(tc, fd_cap_logged);
    tcase_add_test(tc, nan_model_refused);
    tcase_add_test(tc, inspect_checks_tensors);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
