#ifndef FORESHOCK_METRICS_H
#define FORESHOCK_METRICS_H

/* GET /metrics: the Prometheus text exposition format 0.0.4.
 *
 * metrics_write_stats() renders the process counters (pure: reads atomics
 * only); metrics_write_db() adds what comes from the database (alert and
 * silence counts, per-run gauges for a bounded set of recent runs) through
 * a read connection the caller holds, inside the caller's read
 * transaction. The caller owns the buffer. Any thread, on its own buffer
 * and connection. */

#include <sqlite3.h>
#include <stddef.h>
#include <stdint.h>

#include "fs_err.h"
#include "fs_limits.h"
#include "stats.h"

#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define METRICS_MAX_RUNS FS_CAP_METRICS_MAX_RUNS /* metrics_max_runs at most */
#define METRICS_MAX_SERIES_SCAN 65536   /* series rows of one run looked at for monitor values */
#define METRICS_MAX_MONITOR_VALUES 4096 /* foreshock_monitor_value samples per run */
#define METRICS_MAX_BYTES (16u << 20)   /* the whole exposition; past it: -E2BIG */

struct metrics_buf {
    char *p; /* NUL-terminated text, malloc'd */
    size_t len, cap;
    int err; /* first failure (-ENOMEM, -E2BIG); later writes are no-ops */
};

struct metrics_opts {
    unsigned max_runs;  /* per-run gauges for at most this many runs (<= METRICS_MAX_RUNS) */
    double run_max_age; /* ... whose last report is at most this many seconds old */
};

/* Appends printf-style text. Sets b->err on failure. */
void metrics_printf(struct metrics_buf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Frees b->p and zeroes b. */
void metrics_buf_free(struct metrics_buf *b);

/* Escapes a label value for the exposition format (backslash, double
 * quote and newline become \\, \" and \n) into out (NUL-terminated).
 * Returns 0, or -ENOSPC when outlen is too small. */
int metrics_escape_label(const char *in, char *out, size_t outlen);

/* Appends every counter and gauge of st, HELP and TYPE for each family.
 * version: the build_info label. Returns b->err. */
int metrics_write_stats(struct metrics_buf *b, const struct fs_stats *st, const char *version);

/* Appends the database families (foreshock_alerts, foreshock_silences_active,
 * foreshock_run_last_step, foreshock_run_loss, foreshock_monitor_value).
 * now: UNIX seconds. Returns 0, a negative errno code from the buffer, or
 * a positive SQLite error code (err says what failed). */
int metrics_write_db(struct metrics_buf *b, sqlite3 *db, const struct metrics_opts *o, double now,
                     struct fs_err *err);

/* metrics_write_db's queries, prepared per scrape on the scraping HTTP
 * read connection. Their SQL is kept with the other read connections' SQL
 * in http_sql.c. */
enum metrics_query {
    METRICS_Q_ALERTS,         /* state, severity, count of open alerts */
    METRICS_Q_SILENCES,       /* ?1 now: count of silences in effect */
    METRICS_Q_RUNS,           /* ?1 oldest last_seen_at, ?2 limit: id, name, last_step */
    METRICS_Q_LOSS,           /* ?1 run id: the latest loss value */
    METRICS_Q_MONITOR_VALUES, /* ?1 run id, ?2 series scanned, ?3 rows: name, layer, window, value
                               */
    METRICS_Q__COUNT
};

/* The SQL of query q, a static string. Any thread. */
const char *metrics_query_sql(enum metrics_query q);

#endif
