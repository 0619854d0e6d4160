/* testutil.h — helpers shared by the Check suites. */
#ifndef REKV_TESTS_TESTUTIL_H
#define REKV_TESTS_TESTUTIL_H

#include <check.h>

/* Path of a file under ../shared (tests run from the repository root), or NULL when it is absent.
 * When absent and CI=true the calling test fails with a message naming the file; elsewhere it
 * prints a skip line and returns NULL, and the test should return. Returned string is static. */
const char *tu_shared(const char *rel);

/* Runs one suite and returns the process exit code (0 when every test passed). */
int tu_run_suite(Suite *s);

/* A fresh private temporary directory (mkdtemp under $TMPDIR or /tmp); removed by tu_rmrf. */
char *tu_tmpdir(void);
void tu_rmrf(const char *path);

/* Reads a whole file; NULL on error. *len may be NULL. */
char *tu_read_file(const char *path, size_t *len);

/* Path to a built program, e.g. tu_bin("rekv") -> "build/bin/rekv". Static storage. */
const char *tu_bin(const char *name);

/* Runs a shell command and captures stdout (malloc'd). Returns the exit status (or -1). */
int tu_run(const char *cmd, char **out);

#endif
