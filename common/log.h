/* log.h — the one logging function of the daemons and the CLI (never called from library code),
 * and REKV_ASSERT (which library code may use). */
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

/* Broken invariant: logs "FILE:LINE: assertion failed: COND" at ERROR (rekv_log's format, so a
 * daemon's log says which program) and aborts. The one part of this header library code may use:
 * an assert is a check for a programming error — a state the code's own logic rules out (where a
 * comment would say "cannot fail" or "cannot happen") — and going on past one would corrupt
 * memory or a protocol, which is worse than the abort; it is no way out of library code for bad
 * input, a full disk or a dead peer, which return -errno as always. Never compiled out (NDEBUG
 * does not touch it); still, keep COND free of side effects: call the function first and assert
 * on its result, so that the call reads as part of the code. */
#define REKV_ASSERT(cond)                                                                          \
    do {                                                                                           \
        if (!(cond))                                                                               \
            rekv_assert_fail(#cond, __FILE__, __LINE__);                                           \
    } while (0)
_Noreturn void rekv_assert_fail(const char *expr, const char *file, int line);

#endif
