/* cli_util.c — argument parsing shared by the rekv subcommands. */
#include "coordinator/cli/cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int cli_parse_ids(const char *s, int32_t **ids, int *n)
{
    size_t cap = 16, len = 0;
    int32_t *v = malloc(cap * sizeof(int32_t));
    if (v == NULL)
        return -ENOMEM;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX || (*end != ',' && *end != '\0')) {
            free(v);
            return -EINVAL;
        }
        if (len == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, cap * sizeof(int32_t));
            if (nv == NULL) {
                free(v);
                return -ENOMEM;
            }
            v = nv;
        }
        v[len++] = (int32_t)x;
        p = *end == ',' ? end + 1 : end;
        if (*end == ',' && *p == '\0') {
            free(v);
            return -EINVAL;
        }
    }
    if (len == 0) {
        free(v);
        return -EINVAL;
    }
    *ids = v;
    *n = (int)len;
    return 0;
}

int cli_parse_int(const char *name, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (end == s || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "rekv: --%s: expected an integer in [%ld, %ld], got \"%s\"\n", name, lo, hi,
                s);
        return -1;
    }
    *out = x;
    return 0;
}

int cli_parse_float(const char *name, const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "rekv: --%s: expected a number in [%g, %g], got \"%s\"\n", name, lo, hi, s);
        return -1;
    }
    *out = x;
    return 0;
}
