/* test_progress.c — progress of long work (issue 17 item 6), by counts and bytes, never by time:
 * common/progress on a file writes a line per tenth of the work (exactly 10 for a run that
 * reports every unit, one for a jump to the end), nothing when quiet; on a terminal (a real
 * pseudo-terminal) one line redrawn with \r and ended once; the style follows the stream;
 * $REKV_PROGRESS=0 silences it. The programs run with $REKV_PROGRESS=1 (no wait of 2 s before
 * progress shows, so the counts do not depend on the machine's speed):
 * `rekv-loader synth` with stderr on a pipe writes its lines ending at 100%,
 * `rekv eval` and `rekv profile` write their lines, and with --json nothing to stderr; `rekv
 * bench decode --json` and `rekv generate --local --json` write nothing to stderr either. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <unistd.h>

#include "common/progress.h"
#include "tests/testutil.h"

/* What f holds (rewound), malloc'd. */
static char *contents(FILE *f)
{
    fflush(f);
    long n = ftell(f);
    char *buf = calloc(1, (size_t)n + 1);
    rewind(f);
    ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    return buf;
}

static int count_char(const char *s, char c)
{
    int n = 0;
    for (; *s; s++)
        n += *s == c;
    return n;
}

static int count_str(const char *s, const char *needle)
{
    int n = 0;
    for (const char *at = s; (at = strstr(at, needle)) != NULL; at += strlen(needle))
        n++;
    return n;
}

START_TEST(lines_every_tenth)
{
    FILE *f = tmpfile();
    ck_assert_int_eq(rekv_progress_style_for(f, 0), REKV_PROGRESS_LINES);
    rekv_progress p;
    rekv_progress_begin(&p, f, REKV_PROGRESS_LINES, "t", "tokens", 37);
    p.delay_ns = 0;
    for (uint64_t i = 1; i <= 37; i++)
        rekv_progress_update(&p, i, i == 30 ? "nll 1.50" : NULL);
    rekv_progress_end(&p);
    rekv_progress_update(&p, 40, NULL); /* after the end: nothing */
    char *out = contents(f);
    ck_assert_int_eq(count_char(out, '\n'), 10);
    ck_assert_int_eq(count_char(out, '\r'), 0);
    ck_assert_msg(strncmp(out, "t: 4/37 tokens (10%)\n", 21) == 0, "%s", out);
    ck_assert_msg(strstr(out, "t: 30/37 tokens (81%), nll 1.50\n") != NULL, "%s", out);
    const char *last = "t: 37/37 tokens (100%), nll 1.50\n";
    ck_assert_msg(strlen(out) >= strlen(last) &&
                      strcmp(out + strlen(out) - strlen(last), last) == 0,
                  "%s", out);
    free(out);
    fclose(f);

    /* a jump to the end is one line; bytes are shown in MiB; a callback's total counts */
    f = tmpfile();
    rekv_progress_begin(&p, f, REKV_PROGRESS_LINES, "synth", "bytes", 0);
    p.delay_ns = 0;
    rekv_progress_cb(&p, 3u << 20, 3u << 20);
    rekv_progress_end(&p);
    out = contents(f);
    ck_assert_str_eq(out, "synth: 3.0/3.0 MiB (100%)\n");
    free(out);
    fclose(f);
}
END_TEST

START_TEST(quiet_writes_nothing)
{
    FILE *f = tmpfile();
    ck_assert_int_eq(rekv_progress_style_for(f, 1), REKV_PROGRESS_QUIET);
    rekv_progress p;
    rekv_progress_begin(&p, f, rekv_progress_style_for(f, 1), "t", "steps", 5);
    p.delay_ns = 0;
    for (uint64_t i = 1; i <= 5; i++)
        rekv_progress_update(&p, i, "x");
    rekv_progress_end(&p);
    /* $REKV_PROGRESS=0: never, whatever the stream */
    setenv("REKV_PROGRESS", "0", 1);
    rekv_progress_begin(&p, f, REKV_PROGRESS_LINES, "t", "steps", 5);
    p.delay_ns = 0;
    for (uint64_t i = 1; i <= 5; i++)
        rekv_progress_update(&p, i, "x");
    rekv_progress_end(&p);
    unsetenv("REKV_PROGRESS");
    fflush(f);
    ck_assert_int_eq(ftell(f), 0);
    fclose(f);
}
END_TEST

START_TEST(bar_on_a_terminal)
{
    int m = posix_openpt(O_RDWR | O_NOCTTY);
    ck_assert_int_ge(m, 0);
    ck_assert_int_eq(grantpt(m), 0);
    ck_assert_int_eq(unlockpt(m), 0);
    int s = open(ptsname(m), O_RDWR | O_NOCTTY);
    ck_assert_int_ge(s, 0);
    struct termios t;
    ck_assert_int_eq(tcgetattr(s, &t), 0);
    cfmakeraw(&t); /* what we write is what the master reads: no \n -> \r\n */
    ck_assert_int_eq(tcsetattr(s, TCSANOW, &t), 0);
    FILE *f = fdopen(s, "w");
    ck_assert_int_eq(rekv_progress_style_for(f, 0), REKV_PROGRESS_BAR);
    ck_assert_int_eq(rekv_progress_style_for(f, 1), REKV_PROGRESS_QUIET);
    rekv_progress p;
    rekv_progress_begin(&p, f, rekv_progress_style_for(f, 0), "bench", "steps", 50);
    p.delay_ns = 0;
    for (uint64_t i = 1; i <= 50; i++)
        rekv_progress_update(&p, i, NULL);
    rekv_progress_end(&p);
    fclose(f);
    char buf[65536];
    size_t n = 0;
    ssize_t r;
    while (n < sizeof(buf) - 1 && (r = read(m, buf + n, sizeof(buf) - 1 - n)) > 0)
        n += (size_t)r; /* EIO once the slave is closed and drained */
    buf[n] = '\0';
    close(m);
    /* drawn at the first update, at the last, and once more by end; one line, ended once */
    ck_assert_msg(count_char(buf, '\r') >= 3, "%s", buf);
    ck_assert_int_eq(count_char(buf, '\n'), 1);
    ck_assert_msg(n > 0 && buf[n - 1] == '\n', "%s", buf);
    ck_assert_msg(strncmp(buf, "\rbench [", 8) == 0, "%s", buf);
    ck_assert_msg(count_str(buf, "] 100% 50/50 steps") >= 2, "%s", buf);
}
END_TEST

/* ---------------------------------------------------------------- the programs */

static char *g_dir;
static char g_model[4200];

static void model_setup(void)
{
    g_dir = tu_tmpdir();
    snprintf(g_model, sizeof(g_model), "%s/m", g_dir);
}

static void model_teardown(void)
{
    tu_rmrf(g_dir);
    free(g_dir);
}

/* Runs cmd with progress from the start ($REKV_PROGRESS=1: no wait for long work), its stderr (a
 * pipe) captured into *err_out and stdout dropped; the exit status. */
static int run_stderr(const char *cmd, char **err_out)
{
    char full[9000];
    snprintf(full, sizeof(full), "REKV_PROGRESS=1 %s 2>&1 >/dev/null", cmd);
    return tu_run(full, err_out);
}

START_TEST(synth_lines_on_a_pipe)
{
    char cmd[8600], *err = NULL;
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 "
             "--vocab 256 --max-pos 128 --dtype f32 %s",
             tu_bin("rekv-loader"), g_model);
    ck_assert_int_eq(run_stderr(cmd, &err), 0);
    /* a line per tenth of the bytes that a tensor's chunk reaches (a large tensor may cross
     * several at once): rising percentages, the last 100%, no \r */
    int lines = count_str(err, "rekv-loader synth: "), last = 0;
    ck_assert_msg(lines >= 3 && lines <= 10 && lines == count_char(err, '\n'), "%s", err);
    for (const char *at = err; (at = strstr(at, "MiB (")) != NULL; at++) {
        int pct = atoi(at + 5);
        ck_assert_msg(pct > last, "%s", err);
        last = pct;
    }
    ck_assert_int_eq(last, 100);
    ck_assert_int_eq(count_char(err, '\r'), 0);
    free(err);
}
END_TEST

START_TEST(quiet_with_json)
{
    char cmd[8600], *err = NULL;
    snprintf(cmd, sizeof(cmd),
             "%s synth --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --ffn 128 "
             "--vocab 256 --max-pos 128 --dtype f32 %s >/dev/null 2>&1",
             tu_bin("rekv-loader"), g_model);
    ck_assert_int_eq(tu_run(cmd, NULL), 0);
    char ids[4300];
    snprintf(ids, sizeof(ids), "%s/ids.json", g_dir);
    FILE *f = fopen(ids, "w");
    ck_assert_ptr_nonnull(f);
    for (int i = 0; i < 60; i++)
        fprintf(f, "%s%d", i ? "," : "[", 1 + i * 3);
    fputs("]\n", f);
    fclose(f);
    /* eval: lines without --json, nothing with it */
    snprintf(cmd, sizeof(cmd), "%s eval --model %s --ids %s --prefill 4 --backend cpu",
             tu_bin("rekv"), g_model, ids);
    ck_assert_int_eq(run_stderr(cmd, &err), 0);
    ck_assert_msg(count_str(err, "rekv eval: ") == 10, "%s", err);
    ck_assert_msg(strstr(err, "tokens (100%)") != NULL, "%s", err);
    free(err);
    /* profile: one unit per measurement, 20 of them, so exactly a line per tenth */
    snprintf(cmd, sizeof(cmd), "XDG_CACHE_HOME=%s/cache %s profile --model %s --reprofile", g_dir,
             tu_bin("rekv"), g_model);
    ck_assert_int_eq(run_stderr(cmd, &err), 0);
    ck_assert_msg(count_str(err, "rekv profile: ") == 10 && count_char(err, '\n') == 10, "%s", err);
    ck_assert_msg(strstr(err, "rekv profile: 20/20 measurements (100%)\n") != NULL, "%s", err);
    free(err);
    strncat(cmd, " --json", sizeof(cmd) - strlen(cmd) - 1);
    int rc = run_stderr(cmd, &err);
    ck_assert_msg(rc == 0 && err[0] == '\0', "%s: exit %d, stderr:\n%s", cmd, rc, err);
    free(err);
    const char *quiet[] = {
        "%s eval --model %s --ids %s --prefill 4 --backend cpu --json",
        "%s bench decode --model %s --backend cpu --batch 2 --prompt-len 8 --gen-len 4 "
        "--modes resident,offload --json",
        "%s generate --local --backend cpu --model %s --prompt-ids 1,2,3 --max-new-tokens 20 "
        "--ignore-eos --json",
    };
    for (size_t i = 0; i < sizeof(quiet) / sizeof(quiet[0]); i++) {
        snprintf(cmd, sizeof(cmd), quiet[i], tu_bin("rekv"), g_model, ids);
        rc = run_stderr(cmd, &err);
        ck_assert_msg(rc == 0 && err[0] == '\0', "%s: exit %d, stderr:\n%s", cmd, rc, err);
        free(err);
    }
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("progress");
    TCase *tc = tcase_create("progress");
    tcase_add_test(tc, lines_every_tenth);
    tcase_add_test(tc, quiet_writes_nothing);
    tcase_add_test(tc, bar_on_a_terminal);
    suite_add_tcase(s, tc);
    TCase *tp = tcase_create("programs");
    tcase_set_timeout(tp, 120);
    tcase_add_checked_fixture(tp, model_setup, model_teardown);
    tcase_add_test(tp, synth_lines_on_a_pipe);
    tcase_add_test(tp, quiet_with_json);
    suite_add_tcase(s, tp);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
