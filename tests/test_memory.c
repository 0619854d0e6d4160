/* test_memory.c — host memory holds weights and KV, so the weights must live in the process once:
 * `rekv generate --local` on a synthetic fp32 model may peak at most at the model file + its KV
 * cache + 10% (+64 MB) above the same command on a tiny model (the program itself, its libraries).
 * Before the engine released the file's pages after packing and the cpu backend adopted the
 * engine's copies instead of copying them to its "device", the weights were there three times.
 * Peak RSS is read from the child's rusage (ru_maxrss): a count, not a time. */
#define _GNU_SOURCE
#include "loader/loader.h"
#include "tests/testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* Peak RSS in bytes of `rekv generate --local` with extra options on model dir; the tokens it
 * printed into out (malloc'd). */
static long long generate_peak(const char *dir, const char *extra, char **out)
{
    char outp[8192];
    snprintf(outp, sizeof(outp), "%s.out", dir);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        if (freopen(outp, "w", stdout) == NULL)
            _exit(126);
        char *argv[16];
        int n = 0;
        argv[n++] = (char *)tu_bin("rekv");
        argv[n++] = "generate";
        argv[n++] = "--model";
        argv[n++] = (char *)dir;
        argv[n++] = "--prompt-ids";
        argv[n++] = "1,2,3,4,5,6,7,8";
        argv[n++] = "--max-new-tokens";
        argv[n++] = "4";
        argv[n++] = "--local";
        if (extra != NULL)
            argv[n++] = (char *)extra;
        argv[n] = NULL;
        execv(argv[0], argv);
        _exit(127);
    }
    int status = 0;
    struct rusage ru;
    ck_assert_int_eq(wait4(pid, &status, 0, &ru), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rekv generate on %s: status %d",
                  dir, status);
    *out = tu_read_file(outp, NULL);
    ck_assert_ptr_nonnull(*out);
    unlink(outp);
    return (long long)ru.ru_maxrss * 1024;
}

static void synth(const rekv_synth_spec *s, const char *dir)
{
    rekv_err err = {0};
    ck_assert_msg(rekv_synth_write(s, dir, &err) == 0, "synth: %s", err.msg);
}

static long long file_size(const char *dir, const char *name)
{
    char p[8192];
    struct stat st;
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    ck_assert_int_eq(stat(p, &st), 0);
    return (long long)st.st_size;
}

START_TEST(weights_live_once)
{
    char *tmp = tu_tmpdir();
    char tiny[4096], big[4096];
    snprintf(tiny, sizeof(tiny), "%s/tiny", tmp);
    snprintf(big, sizeof(big), "%s/big", tmp);
    /* ~150 MB of fp32 weights, a short context so that the KV cache is small beside them */
    rekv_synth_spec b = {.arch = REKV_ARCH_LLAMA, .n_layers = 6, .hidden = 768, .n_heads = 12,
                         .n_kv_heads = 4, .ffn = 2048, .vocab = 8192, .max_pos = 256,
                         .dtype = REKV_DTYPE_F32, .seed = 5};
    rekv_synth_spec t = b;
    t.n_layers = 1, t.hidden = 64, t.n_heads = 4, t.n_kv_heads = 2, t.ffn = 128, t.vocab = 256;
    synth(&b, big);
    synth(&t, tiny);
    char *o_tiny = NULL, *o_big = NULL, *o_off = NULL;
    long long base = generate_peak(tiny, NULL, &o_tiny);
    long long peak = generate_peak(big, NULL, &o_big);
    long long file = file_size(big, "model.safetensors");
    long long kv = 2LL * b.n_layers * b.max_pos * (b.hidden / b.n_heads * b.n_kv_heads) * 4;
    long long budget = file + kv + file / 10 + (64LL << 20);
    ck_assert_msg(peak - base <= budget,
                  "peak RSS %lld MB above the tiny model's %lld MB; the budget (file %lld MB + KV "
                  "%lld MB + 10%% + 64 MB) is %lld MB",
                  (peak - base) >> 20, base >> 20, file >> 20, kv >> 20, budget >> 20);
    /* offloaded weights stream from the engine's blocks: the same single copy (plus two layers) */
    peak = generate_peak(big, "--offload-weights", &o_off);
    ck_assert_msg(peak - base <= budget, "--offload-weights: peak RSS %lld MB above base, budget %lld MB",
                  (peak - base) >> 20, budget >> 20);
    ck_assert_str_eq(o_off, o_big); /* and the tokens do not change */
    free(o_tiny), free(o_big), free(o_off);
    tu_rmrf(tmp);
    free(tmp);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("memory");
    TCase *tc = tcase_create("rss");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, weights_live_once);
    suite_add_tcase(s, tc);
    return tu_run_suite(s);
}
