#ifndef FORESHOCK_LOG_H
#define FORESHOCK_LOG_H

#include <stdint.h>

/* One line per event on stderr:
 *   2026-12-02T12:00:00.123Z info ingest: message
 * UTC, millisecond precision, level, module. Each line goes out in a single
 * write(2), so lines from different threads do not interleave. */

enum log_level { LOG_LEVEL_DEBUG = 0, LOG_LEVEL_INFO = 1, LOG_LEVEL_WARN = 2, LOG_LEVEL_ERROR = 3 };

/* Sets the lowest level that is printed (default LOG_LEVEL_INFO). Any thread. */
void log_set_level(enum log_level level);
enum log_level log_get_level(void);

/* "debug", "info", "warn", "error" <-> enum; log_level_parse returns 0 or
 * -EINVAL. log_level_names is the one table of them, by value and
 * NULL-terminated (a CONFIG_ENUM choice list). Pure; any thread. */
extern const char *const log_level_names[];
int log_level_parse(const char *name, enum log_level *out);
const char *log_level_name(enum log_level level);

/* Prints one line if level is enabled. module is a short static name
 * ("ingest", "store"). Any thread. */
void log_msg(enum log_level level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define log_debug(mod, ...) log_msg(LOG_LEVEL_DEBUG, mod, __VA_ARGS__)
#define log_info(mod, ...) log_msg(LOG_LEVEL_INFO, mod, __VA_ARGS__)
#define log_warn(mod, ...) log_msg(LOG_LEVEL_WARN, mod, __VA_ARGS__)
#define log_error(mod, ...) log_msg(LOG_LEVEL_ERROR, mod, __VA_ARGS__)

/* Rate limiter for one kind of repeated complaint: at most one line per
 * interval; the next line printed says how many were suppressed. Not
 * thread-safe: each instance belongs to the thread that owns the state it
 * complains about (zero-initialise it; interval 0 means the default
 * FS_LOG_RATE_INTERVAL_MS). */
struct log_ratelimit {
    uint64_t interval_ms;
    uint64_t last_ms; /* monotonic time of the last printed line */
    uint64_t suppressed;
    int printed; /* 0 until the first line */
};

/* Like log_msg, through the limiter rl. Returns 1 if printed, 0 if
 * suppressed. Owner thread of rl only. */
int log_limited(struct log_ratelimit *rl, enum log_level level, const char *module, const char *fmt,
                ...) __attribute__((format(printf, 4, 5)));

/* Monotonic milliseconds (CLOCK_MONOTONIC). Any thread. */
uint64_t log_now_ms(void);

#endif
