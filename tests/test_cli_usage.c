/* test_cli_usage.c — a usage error names what it rejects: every `rekv` subcommand given a stray
 * argument (a doc's literal "[--prefill-chunk 0]") or an unknown option says which one, under the
 * command's own name, and exits 2 before doing any work. Runs the real binary; the paths it names
 * do not exist, so a check that is missing shows as another exit code or message, never as work. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

/* Runs `rekv ARGS`; returns the exit code, stdout in *out and stderr's first line in *line
 * (both malloc'd). */
static int rekv_first_line(const char *args, char **out, char **line)
{
    char errpath[] = "/tmp/rekv-usage-err.XXXXXX", cmd[4096];
    int fd = mkstemp(errpath);
    ck_assert_int_ge(fd, 0);
    close(fd);
    snprintf(cmd, sizeof(cmd), "%s %s 2>%s", tu_bin("rekv"), args, errpath);
    int rc = tu_run(cmd, out);
    char *err = tu_read_file(errpath, NULL);
    unlink(errpath);
    ck_assert_ptr_nonnull(err);
    err[strcspn(err, "\n")] = '\0';
    *line = err;
    return rc;
}

/* `rekv ARGS` exits 2, prints nothing on stdout, and stderr's first line is want. */
static void expect_usage_error(const char *args, const char *want)
{
    char *out, *line;
    int rc = rekv_first_line(args, &out, &line);
    ck_assert_msg(rc == 2, "rekv %s: exit %d, want 2 (stderr: %s)", args, rc, line);
    ck_assert_msg(strcmp(line, want) == 0, "rekv %s: stderr starts \"%s\", want \"%s\"", args, line,
                  want);
    ck_assert_msg(out[0] == '\0', "rekv %s: stdout not empty: %s", args, out);
    free(out);
    free(line);
}

#define NOPE "/nonexistent/rekv-model"
#define STRAY "[--prefill-chunk 0]" /* two words to the shell: the first is the one named */

/* Each subcommand with what it needs besides the stray words, and its name. */
static const struct {
    const char *name, *args;
} commands[] = {
    {"rekv generate", "generate --model " NOPE " --prompt-ids 1"},
    {"rekv generate", "generate --model " NOPE " --prompt-ids 1 --local --mode offload"},
    {"rekv run", "run --model " NOPE},
    {"rekv submit", "submit --prompt-ids 1 --socket ipc:///nonexistent/control"},
    {"rekv status", "status --socket ipc:///nonexistent/control 7"}, /* JOB 7 */
    {"rekv status", "status --kvstore ipc:///nonexistent/kvstore"},
    {"rekv stats", "stats --socket ipc:///nonexistent/control"},
    {"rekv profile", "profile --model " NOPE},
    {"rekv eval", "eval --model " NOPE " --ids " NOPE},
    {"rekv skew", "skew --model " NOPE},
    {"rekv heads", "heads --model " NOPE},
    {"rekv bench forward", "bench forward --model " NOPE},
    {"rekv bench decode", "bench decode --model " NOPE " --modes offload"},
    {"rekv bench serve", "bench serve --model " NOPE},
    {"rekv bench kvstore", "bench kvstore --spill-dir /nonexistent"},
};

START_TEST(stray_argument_named)
{
    char args[1024], want[256];
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
        snprintf(args, sizeof(args), "%s %s", commands[i].args, STRAY);
        snprintf(want, sizeof(want), "%s: unexpected argument '[--prefill-chunk'",
                 commands[i].name);
        expect_usage_error(args, want);
    }
    /* the operands a command takes are not stray; one more is */
    expect_usage_error("status --socket ipc:///nonexistent/control 7 8",
                       "rekv status: unexpected argument '8'");
    expect_usage_error("cancel --socket ipc:///nonexistent/control 7 8",
                       "rekv cancel: unexpected argument '8'");
    expect_usage_error("bench " STRAY, "rekv bench: unknown benchmark '[--prefill-chunk'");
}
END_TEST

START_TEST(unknown_option_named)
{
    char args[1024], want[256];
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
        snprintf(args, sizeof(args), "%s --no-such-option", commands[i].args);
        snprintf(want, sizeof(want), "%s: unrecognized option '--no-such-option'",
                 commands[i].name);
        expect_usage_error(args, want);
    }
    /* status's options are not cancel's */
    expect_usage_error("cancel --min-workers 1 7",
                       "rekv cancel: unrecognized option '--min-workers'");
    expect_usage_error("cancel --kvstore ipc:///nonexistent/kvstore 7",
                       "rekv cancel: unrecognized option '--kvstore'");
    expect_usage_error("frob", "rekv: unknown command \"frob\"");
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cli_usage");
    TCase *tc = tcase_create("usage");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, stray_argument_named);
    tcase_add_test(tc, unknown_option_named);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    return tu_run_suite(suite());
}
