/* log.h — the one logging function of the daemons and the CLI (never called from library code). */
#ifndef REKV_COMMON_LOG_H
#define REKV_COMMON_LOG_H

typedef enum rekv_log_level {
    REKV_LOG_DEBUG = 0,
    REKV_LOG_INFO = 1,
    REKV_LOG_WARN = 2,
    REKV_LOG_ERROR = 3,
} rekv_log_level;

/* Messages below this level are dropped. Default INFO; REKV_LOG=debug|info|warn|error overrides. */
void rekv_log_set_level(rekv_log_level level);
void rekv_log_init_from_env(void);

/* Writes "<time> <program> <LEVEL> message" to stderr, one line, atomically. */
void rekv_log(rekv_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Broken invariant: prints file and line and aborts. For bugs, never for bad input. */
#define REKV_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond))                                                                               \
            rekv_assert_fail(#cond, __FILE__, __LINE__);                                           \
    } while (0)
_Noreturn void rekv_assert_fail(const char *expr, const char *file, int line);

#endif
