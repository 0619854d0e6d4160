/* cli_util.c — argument parsing and input files shared by the rekv subcommands. */
#include "coordinator/cli/cli.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/coordinator.h"
#include "gpuworker/device/backend.h"
#include "loader/loader.h"

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

void cli_name_command(char **argv, const char *prefix, char *name, size_t len)
{
    snprintf(name, len, "%s %s", prefix, argv[0]);
    argv[0] = name;
}

int cli_no_operands(int argc, char **argv)
{
    if (optind >= argc)
        return 0;
    fprintf(stderr, "%s: unexpected argument '%s'\n", argv[0], argv[optind]);
    return -1;
}

void cli_random_tokens(uint64_t *state, int32_t *ids, size_t n, int vocab)
{
    for (size_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((*state >> 33) % (uint64_t)vocab);
    }
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

int cli_parse_link(rekv_link_config *link, const char *name, const char *arg)
{
    rekv_err err = {0};
    if (rekv_link_parse(link, name, arg, &err)) {
        fprintf(stderr, "rekv: %s\n", err.msg);
        return -1;
    }
    return 0;
}

int cli_read_ids(const char *path, int32_t **ids, size_t *n, rekv_err *err)
{
    json_error_t je;
    json_t *a = json_load_file(path, 0, &je);
    if (a == NULL)
        return rekv_errf(err, -EINVAL, "%s: %s (line %d)", path, je.text, je.line);
    int rc = 0;
    if (!json_is_array(a)) {
        rc = rekv_errf(err, -EINVAL, "%s: expected a JSON array of token ids", path);
        goto out;
    }
    *n = json_array_size(a);
    *ids = malloc((*n ? *n : 1) * sizeof(int32_t));
    if (*ids == NULL) {
        rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (size_t i = 0; i < *n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            rc = rekv_errf(err, -EINVAL, "%s: element %zu is not a token id", path, i);
            free(*ids);
            *ids = NULL;
            goto out;
        }
        (*ids)[i] = (int32_t)json_integer_value(v);
    }
out:
    json_decref(a);
    return rc;
}

int cli_read_text(const char *path, char **text, size_t *len, rekv_err *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return rekv_errf(err, -errno, "%s: %s", path, strerror(errno));
    int rc = 0;
    char *b = NULL;
    size_t n = 0, cap = 0, got;
    do {
        if (n == cap) {
            char *nb = realloc(b, cap = cap ? 2 * cap : 1 << 16);
            if (nb == NULL) {
                rc = rekv_errf(err, -ENOMEM, "%s: out of memory", path);
                break;
            }
            b = nb;
        }
        n += got = fread(b + n, 1, cap - n, f);
    } while (got > 0);
    if (rc == 0 && ferror(f))
        rc = rekv_errf(err, -EIO, "%s: read error", path);
    fclose(f);
    if (rc) {
        free(b);
        return rc;
    }
    *text = b;
    *len = n;
    return 0;
}

int cli_ctl_reachable(const char *ep, rekv_err *err)
{
    char def[4200];
    int rc;
    if (ep == NULL) {
        if ((rc = rekv_client_control_endpoint(def, sizeof(def), err)))
            return rc;
        ep = def;
    }
    if (strncmp(ep, "ipc://", 6) != 0 || ep[6] == '@') /* abstract or not ipc: ZeroMQ tells */
        return 0;
    const char *path = ep + 6;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return rekv_errf(err, -errno,
                         "no coordinator at %s: %s (start one with `rekv run`, or "
                         "give --socket)",
                         ep, errno == ENOENT ? "the socket does not exist" : strerror(errno));
    if (!S_ISSOCK(sb.st_mode))
        return rekv_errf(err, -ENOTSOCK, "%s: %s is not a socket", ep, path);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path))
        return 0; /* ZeroMQ would refuse it with its own message */
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 ? 0 : -errno;
    close(fd);
    if (rc == -ECONNREFUSED)
        return rekv_errf(err, rc,
                         "no coordinator at %s: nothing listens on the socket (left "
                         "behind by one that stopped?)",
                         ep);
    return 0; /* listening, or busy (EAGAIN: its backlog is full): ZeroMQ will get through */
}

int cli_trace_path(const char *trace, const char *run, char *out, size_t len)
{
    const char *slash = strrchr(trace, '/'), *base = slash ? slash + 1 : trace;
    const char *dot = strrchr(base, '.');
    if (dot == NULL || dot == base) /* no extension (a leading dot names a hidden file) */
        dot = base + strlen(base);
    int n = snprintf(out, len, "%.*s.%s%s", (int)(dot - trace), trace, run, dot);
    return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

int cli_calibration_ids(const char *model_path, const rekv_model_config *cfg,
                        const char *text_path, const char *ids_path, int quiet, int32_t **ids,
                        int *n, rekv_err *err)
{
    size_t len = 0, m = 0;
    int rc;
    *ids = NULL;
    if (ids_path) {
        if ((rc = cli_read_ids(ids_path, ids, &m, err)))
            return rc;
    } else {
        rekv_tokenizer *tok = NULL;
        char *text = NULL;
        rc = rekv_tokenizer_load_for_model(model_path, &tok, err);
        if (rc == -ENOENT) {
            rekv_err_clear(err); /* the loader's line names the file it looked for */
            return rekv_errf(err, rc, "%s has no tokenizer; give the text as --ids", model_path);
        }
        if (rc == 0 && (rc = cli_read_text(text_path, &text, &len, err)) == 0)
            rc = rekv_tokenizer_encode(tok, text, len, cfg->add_bos ? cfg->bos_id : -1, ids, &m,
                                       err);
        free(text);
        rekv_tokenizer_free(tok);
        if (rc)
            return rc;
    }
    if (m > (size_t)cfg->max_pos) {
        if (!quiet)
            fprintf(stderr, "rekv: calibrating on the first %d of %zu tokens (the context)\n",
                    cfg->max_pos, m);
        m = (size_t)cfg->max_pos;
    }
    *n = (int)m;
    return 0;
}
