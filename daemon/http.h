#ifndef FORESHOCK_HTTP_H
#define FORESHOCK_HTTP_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#include "fs_err.h"
#include "fs_limits.h"
#include "stats.h"

/* The HTTP API: JSON under /api/v1/, /healthz, /readyz, /metrics.
 *
 * Threads: libmicrohttpd runs its own pool of `threads` threads. Each request
 * reads SQLite through one of `threads` read-only connections (WAL lets them
 * run beside the writer); writes (silences) are store items that the writer
 * thread commits while the request, its connection suspended, waits for the
 * outcome on a thread of its own (no pool thread is held meanwhile).
 * http_start() and http_stop() are called from the main thread only;
 * http_stop() must come before store_close() (it waits for the writes in
 * flight, each up to 10 s, as the writer may still settle them). */

#define HTTP_MAX_THREADS FS_CAP_HTTP_THREADS
#define HTTP_MAX_CONNECTIONS 1024
/* Connections one client address may hold: far below HTTP_MAX_CONNECTIONS,
 * so silent connections from one address cannot take every slot from the
 * dashboards, scrapers and health probes elsewhere (1,100 silent
 * connections delayed /healthz by 29 s). */
#define HTTP_MAX_CONNECTIONS_PER_IP 64
#define HTTP_DEFAULT_LIMIT 1000      /* points/series/runs per page when ?limit= is absent */
#define HTTP_MAX_LIMIT 10000         /* largest ?limit= accepted; above it: 400 */
#define HTTP_MAX_POINTS_BUCKETS 5000 /* largest ?max_points= (downsampling) */
#define HTTP_DEFAULT_METRICS_MAX_RUNS FS_DEF_METRICS_MAX_RUNS /* metrics_max_runs */
#define HTTP_DEFAULT_METRICS_RUN_MAX_AGE 3600.0               /* metrics_run_max_age, seconds */

struct store;

struct http_opts {
    const char *host;           /* bind address, e.g. "127.0.0.1" */
    uint16_t port;              /* 0: pick an ephemeral port */
    const char *db_path;        /* the daemon's database, opened read-only */
    unsigned threads;           /* 1..HTTP_MAX_THREADS */
    struct fs_stats *stats;     /* shared counters; http reads `ready` for /readyz */
    struct store *store;        /* the writer, for silences; NULL: writes answer 503 */
    const char *read_token;     /* NULL or "": reads need no token (copied) */
    const char *write_token;    /* NULL or "": write endpoints answer 403 (copied) */
    unsigned metrics_max_runs;  /* per-run gauges of /metrics for this many runs (0: none) */
    double metrics_run_max_age; /* ... active in the last this many seconds (0: default) */
    bool read_only;             /* foreshockd --read-only: an archive, no writer; write
                                   routes answer 403 read_only whatever the token */
    const char *tls_cert_file;  /* HTTPS (PEM; both or neither); NULL or "": plain HTTP */
    const char *tls_key_file;
};

struct http;

/* Binds and starts serving. On success returns 0 and *out; on failure
 * returns a negative errno-style code, writes a message into err and
 * starts nothing. The database must exist with its schema
 * applied (the writer opens it first). */
int http_start(const struct http_opts *opts, struct http **out, struct fs_err *err);

/* The port actually bound (useful when opts.port was 0). */
uint16_t http_port(const struct http *h);

/* Stops accepting, finishes in-flight requests, closes the read-only
 * connections and frees h. NULL is a no-op. */
void http_stop(struct http *h);

#endif
