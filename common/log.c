/* log.c — see log.h. */
#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern const char *program_invocation_short_name;

static rekv_log_level g_level = REKV_LOG_INFO;

void rekv_log_set_level(rekv_log_level level) { g_level = level; }

void rekv_log_init_from_env(void)
{
    const char *s = getenv("REKV_LOG");
    if (s == NULL)
        return;
    if (strcmp(s, "debug") == 0)
        g_level = REKV_LOG_DEBUG;
    else if (strcmp(s, "info") == 0)
        g_level = REKV_LOG_INFO;
    else if (strcmp(s, "warn") == 0)
        g_level = REKV_LOG_WARN;
    else if (strcmp(s, "error") == 0)
        g_level = REKV_LOG_ERROR;
}

void rekv_log(rekv_log_level level, const char *fmt, ...)
{
    static const char *names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    if (level < g_level)
        return;
    char line[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof(line), "%02d:%02d:%02d.%03ld %s %s ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, program_invocation_short_name, names[level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof(line))
        vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}

void rekv_assert_fail(const char *expr, const char *file, int line)
{
    rekv_log(REKV_LOG_ERROR, "%s:%d: assertion failed: %s", file, line, expr);
    abort();
}
