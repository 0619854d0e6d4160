/* err.h — error reporting for rekv library code.
 *
 * Library functions never print. They return 0 on success or a negative errno, and, when the
 * caller passes a rekv_err, fill it with one human-readable line that names the file or object
 * involved and what is wrong. Only the daemons' main loops and the CLI decide what to log. */
#ifndef REKV_COMMON_ERR_H
#define REKV_COMMON_ERR_H

#include <stddef.h>

typedef struct rekv_err {
    int code;       /* negative errno of the first failure, 0 when none */
    char msg[1024]; /* one line, no trailing newline */
} rekv_err;

/* Records the failure (only the first one is kept, so the innermost cause wins) and returns code,
 * so that `return rekv_errf(err, -EINVAL, "%s: bad header", path);` reads naturally: one line,
 * whatever the formatted text quotes (a line break or tab made a space, any other control byte '?').
 * err may be NULL. code must be negative. */
int rekv_errf(rekv_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Clears err so it can be reused. */
void rekv_err_clear(rekv_err *err);

#endif
