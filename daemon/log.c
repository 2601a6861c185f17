/* Line logger on stderr with per-kind rate limiting. */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fs_limits.h"

static atomic_int min_level = LOG_LEVEL_INFO;

const char *const log_level_names[] = {
    [LOG_LEVEL_DEBUG] = "debug",
    [LOG_LEVEL_INFO] = "info",
    [LOG_LEVEL_WARN] = "warn",
    [LOG_LEVEL_ERROR] = "error",
    NULL,
};

void log_set_level(enum log_level level)
{
    atomic_store_explicit(&min_level, (int)level, memory_order_relaxed);
}

enum log_level log_get_level(void)
{
    return (enum log_level)atomic_load_explicit(&min_level, memory_order_relaxed);
}

int log_level_parse(const char *name, enum log_level *out)
{
    for (int i = LOG_LEVEL_DEBUG; i <= LOG_LEVEL_ERROR; i++) {
        if (strcmp(name, log_level_names[i]) == 0) {
            *out = (enum log_level)i;
            return 0;
        }
    }
    return -EINVAL;
}

const char *log_level_name(enum log_level level)
{
    if ((int)level < LOG_LEVEL_DEBUG || level > LOG_LEVEL_ERROR)
        return "?";
    return log_level_names[level];
}

uint64_t log_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Formats the whole line into one buffer and writes it with one write(2):
 * stderr may be a pipe shared by several threads. */
static void emit(enum log_level level, const char *module, const char *suffix, const char *fmt,
                 va_list ap)
{
    char line[FS_LOG_LINE_MAX];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(line, sizeof(line), "%Y-%m-%dT%H:%M:%S", &tm);
    int k = snprintf(line + n, sizeof(line) - n, ".%03ldZ %s %s: ", ts.tv_nsec / 1000000L,
                     log_level_name(level), module);
    if (k > 0)
        n += (size_t)k;
    if (n < sizeof(line)) {
        k = vsnprintf(line + n, sizeof(line) - n, fmt, ap);
        if (k > 0)
            n = n + (size_t)k < sizeof(line) ? n + (size_t)k : sizeof(line) - 1;
    }
    if (suffix && n < sizeof(line)) {
        k = snprintf(line + n, sizeof(line) - n, "%s", suffix);
        if (k > 0)
            n = n + (size_t)k < sizeof(line) ? n + (size_t)k : sizeof(line) - 1;
    }
    /* Keep one line per event: newlines inside a message would break
     * parsers that read the log line by line. */
    for (size_t i = 0; i < n; i++)
        if (line[i] == '\n' || line[i] == '\r')
            line[i] = ' ';
    if (n >= sizeof(line) - 1)
        n = sizeof(line) - 2;
    line[n++] = '\n';
    ssize_t off = 0;
    while ((size_t)off < n) {
        ssize_t w = write(STDERR_FILENO, line + off, n - (size_t)off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += w;
    }
}

void log_msg(enum log_level level, const char *module, const char *fmt, ...)
{
    if ((int)level < atomic_load_explicit(&min_level, memory_order_relaxed))
        return;
    va_list ap;
    va_start(ap, fmt);
    emit(level, module, NULL, fmt, ap);
    va_end(ap);
}

int log_limited(struct log_ratelimit *rl, enum log_level level, const char *module, const char *fmt,
                ...)
{
    if ((int)level < atomic_load_explicit(&min_level, memory_order_relaxed))
        return 0;
    uint64_t now = log_now_ms();
    uint64_t interval = rl->interval_ms ? rl->interval_ms : FS_LOG_RATE_INTERVAL_MS;
    if (rl->printed && now - rl->last_ms < interval) {
        rl->suppressed++;
        return 0;
    }
    char suffix[48] = "";
    if (rl->suppressed)
        snprintf(suffix, sizeof(suffix), " (%llu suppressed)", (unsigned long long)rl->suppressed);
    rl->printed = 1;
    rl->last_ms = now;
    rl->suppressed = 0;
    va_list ap;
    va_start(ap, fmt);
    emit(level, module, suffix[0] ? suffix : NULL, fmt, ap);
    va_end(ap);
    return 1;
}
