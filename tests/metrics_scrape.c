/* metrics_scrape.c — see metrics_scrape.h. */
#define _GNU_SOURCE
#include "tests/metrics_scrape.h"

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/metrics.h"
#include "tests/testutil.h"

int ms_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    socklen_t l = sizeof(a);
    ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &l), 0);
    close(fd);
    return ntohs(a.sin_port);
}

char *ms_scrape(int port)
{
    int fd = -1;
    while (fd < 0) { /* until it listens (Check's timeout is the guard) */
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(fd, 0);
        struct timeval tv = {30, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
            close(fd);
            fd = -1;
            usleep(50000);
        }
    }
    static const char req[] = "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n";
    ck_assert_int_eq(send(fd, req, sizeof(req) - 1, MSG_NOSIGNAL), (ssize_t)sizeof(req) - 1);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    ck_assert_ptr_nonnull(buf);
    for (;;) {
        if (n + 4096 + 1 > cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            ck_assert_ptr_nonnull(buf);
        }
        ssize_t r = recv(fd, buf + n, cap - n - 1, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    ck_assert_msg(strncmp(buf, "HTTP/1.1 200 ", 13) == 0, "scrape of port %d: %.200s", port, buf);
    char *body = strstr(buf, "\r\n\r\n");
    ck_assert_ptr_nonnull(body);
    body += 4;
    size_t nb = n - (size_t)(body - buf);
    char *out = malloc(nb + 1);
    ck_assert_ptr_nonnull(out);
    memcpy(out, body, nb + 1);
    free(buf);
    ck_assert_int_gt(ms_check_exposition(out, nb), 0);
    return out;
}

#define MAX_FAM 256

typedef struct fam {
    char name[128];
    int help, type; /* lines seen */
    int histogram;
    int done; /* its samples are over (another family's came) */
} fam;

static fam *fam_find(fam *f, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (strcmp(f[i].name, name) == 0)
            return &f[i];
    return NULL;
}

int ms_check_exposition(const char *body, size_t n)
{
    static fam f[MAX_FAM];
    int n_fam = 0, samples = 0;
    fam *cur = NULL;
    double last_cum = -1; /* a histogram's previous bucket count in this label set */
    ck_assert_msg(n == 0 || body[n - 1] == '\n', "exposition does not end with a newline");
    const char *p = body, *end = body + n;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        ck_assert_ptr_nonnull(nl);
        char line[4096];
        ck_assert_int_lt(nl - p, (long)sizeof(line));
        memcpy(line, p, (size_t)(nl - p));
        line[nl - p] = '\0';
        p = nl + 1;
        char name[128];
        if (strncmp(line, "# HELP ", 7) == 0 || strncmp(line, "# TYPE ", 7) == 0) {
            ck_assert_int_eq(sscanf(line + 7, "%127s", name), 1);
            ck_assert_msg(rekv_metrics_name_valid(name), "bad name in %s", line);
            fam *x = fam_find(f, n_fam, name);
            if (x == NULL) {
                ck_assert_int_lt(n_fam, MAX_FAM);
                x = &f[n_fam++];
                memset(x, 0, sizeof(*x));
                snprintf(x->name, sizeof(x->name), "%s", name);
            }
            ck_assert_msg(!x->done && x != NULL, "%s lines after %s's samples", line, name);
            int is_help = line[2] == 'H';
            ck_assert_msg(!(is_help ? x->help : x->type), "second %s line for %s",
                          is_help ? "HELP" : "TYPE", name);
            *(is_help ? &x->help : &x->type) = 1;
            if (!is_help) {
                const char *t = line + 7 + strlen(name) + 1;
                ck_assert_msg(!strcmp(t, "counter") || !strcmp(t, "gauge") ||
                                  !strcmp(t, "untyped") || !strcmp(t, "histogram"),
                              "type %s", t);
                x->histogram = !strcmp(t, "histogram");
            }
            continue;
        }
        ck_assert_msg(line[0] != '#' && line[0] != '\0', "unexpected line '%s'", line);
        size_t nn = strcspn(line, "{ ");
        ck_assert_int_lt(nn, sizeof(name));
        memcpy(name, line, nn);
        name[nn] = '\0';
        ck_assert_msg(rekv_metrics_name_valid(name), "bad sample name in '%s'", line);
        /* the family: the name itself, or a histogram's name_bucket/_sum/_count */
        fam *x = fam_find(f, n_fam, name);
        const char *suffix = "";
        if (x == NULL || x->histogram) {
            static const char *const sfx[] = {"_bucket", "_sum", "_count"};
            x = NULL;
            for (int k = 0; k < 3 && x == NULL; k++) {
                size_t ls = strlen(sfx[k]);
                if (nn > ls && strcmp(name + nn - ls, sfx[k]) == 0) {
                    char base[128];
                    snprintf(base, sizeof(base), "%.*s", (int)(nn - ls), name);
                    x = fam_find(f, n_fam, base);
                    suffix = sfx[k];
                    if (x && !x->histogram)
                        x = NULL;
                }
            }
        }
        ck_assert_msg(x != NULL && x->help && x->type, "sample '%s' before its HELP/TYPE", line);
        int has_le = 0;
        char le[64] = "";
        const char *q = line + nn;
        if (*q == '{') {
            q++;
            while (*q != '}') { /* name="value", */
                size_t ln = strcspn(q, "=");
                ck_assert_msg(ln > 0 && q[ln] == '=' && q[ln + 1] == '"', "labels in '%s'", line);
                int is_le = ln == 2 && strncmp(q, "le", 2) == 0;
                q += ln + 2;
                const char *v0 = q;
                while (*q != '"') {
                    ck_assert_msg(*q != '\0', "unterminated label value in '%s'", line);
                    if (*q == '\\') {
                        ck_assert_msg(q[1] == '\\' || q[1] == '"' || q[1] == 'n',
                                      "bad escape in '%s'", line);
                        q++;
                    }
                    q++;
                }
                if (is_le) {
                    has_le = 1;
                    snprintf(le, sizeof(le), "%.*s", (int)(q - v0), v0);
                }
                q++;
                if (*q == ',')
                    q++;
            }
            q++;
        }
        ck_assert_msg(*q == ' ', "no value in '%s'", line);
        q++;
        char *e;
        double v = strtod(q, &e);
        ck_assert_msg(e != q && *e == '\0', "value '%s' in '%s'", q, line);
        if (x->histogram) {
            ck_assert_msg(has_le == (strcmp(suffix, "_bucket") == 0), "le in '%s'", line);
            if (has_le) {
                ck_assert_msg(v >= last_cum || last_cum < 0, "buckets not cumulative at '%s'",
                              line);
                last_cum = strcmp(le, "+Inf") == 0 ? -1 : v;
            }
        }
        if (cur != x) {
            ck_assert_msg(!x->done, "samples of %s not together", x->name);
            if (cur)
                cur->done = 1;
            cur = x;
        }
        samples++;
    }
    return samples;
}

int ms_promtool(const char *body)
{
    int have = tu_run("command -v promtool >/dev/null 2>&1", NULL) == 0;
    if (!have) {
        ck_assert_msg(!tu_ci(),
                      "promtool is not installed, and CI=true needs it (Debian's prometheus "
                      "package, in deploy/debian-packages.txt)");
        printf("promtool not installed (Debian: apt-get install prometheus): "
               "skipping `promtool check metrics`\n");
        return 77;
    }
    char *dir = tu_tmpdir();
    char path[4200], cmd[8600];
    snprintf(path, sizeof(path), "%s/metrics.txt", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fputs(body, f) >= 0, 1);
    ck_assert_int_eq(fclose(f), 0);
    snprintf(cmd, sizeof(cmd), "promtool check metrics < '%s' 2>&1", path);
    char *out = NULL;
    int rc = tu_run(cmd, &out);
    /* exit 3 is lint alone; its colon rule (colons are for recording rules) is no fault in the
     * vllm:* gauges the Gateway API Inference Extension reads by vLLM's names */
    int colons_only = rc == 3 && out != NULL;
    for (char *l = out ? strtok(out, "\n") : NULL; l; l = strtok(NULL, "\n"))
        colons_only &= strncmp(l, "vllm:", 5) == 0 && strstr(l, "should not contain ':'") != NULL;
    ck_assert_msg(rc == 0 || colons_only, "promtool check metrics: exit %d: %s", rc,
                  out ? out : "");
    free(out);
    tu_rmrf(dir);
    free(dir);
    return 0;
}

double ms_value(const char *body, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, series, n) == 0 && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    }
    return NAN;
}
