#ifndef FORESHOCK_REMOTE_WRITE_H
#define FORESHOCK_REMOTE_WRITE_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "fs_err.h"
#include "stats.h"

/* Prometheus remote write: the daemon's stored series, sent to a remote
 * time-series store (Prometheus with its receiver, Thanos Receive, Cortex,
 * Mimir, VictoriaMetrics) as snappy-compressed protobuf over HTTP.
 *
 * The queue is the database itself: a cursor per run (the last step sent)
 * and one over alert_events (the last event id sent), in the table
 * remote_write_cursor (schema/011_remote_write.sql), per target. The sender thread reads
 * the points after its cursor on its own read-only connection, sends them,
 * and only after a 2xx asks the writer (STORE_ITEM_RW_CURSOR: one thread
 * owns the database) to advance the cursor. So nothing is copied, a restart
 * or an outage of any length resumes at the cursor, and a slow or absent
 * receiver never holds ingest: it only lets the cursor lag
 * (foreshock_remote_write_pending).
 *
 * What is sent: every series of the run without a head label, which holds
 * the scalars (loss, grad_norm, ... per rank), the per-layer head
 * aggregates the monitor stage stores (NAME.min, .mean, .max, .argmin per
 * layer and window), router and per-layer series; with per_head the
 * heads' own series too; and every alert transition as the gauge
 * foreshock_alert{alertname, severity, family, run, attempt, scope} (1:
 * firing, 0: not). Series are named foreshock_NAME (rw_metric_name) and
 * labelled run, attempt (the run's attempt running at the point's time),
 * layer, window, head or rank where they apply, and the job labels.
 * Sample timestamps are the points' own times, in milliseconds, but rising
 * within a series: a step whose time falls in the millisecond of the step
 * before it (ranks catching up after an outage) is moved 1 ms later
 * (rw_batch_add). The move is remembered in memory only: a batch resent
 * after a restart may put such a sample 1 ms away from where it was first
 * sent, which a receiver stores as a second sample.
 *
 * Guarantee: every point at or below its run's settled step (below) is sent
 * until a receiver answers 2xx, at least once. A crash between the 2xx and
 * the cursor's commit resends that batch: the same series, timestamps and
 * values, which Prometheus and VictoriaMetrics (with deduplication on)
 * store once. A 4xx other than 429 is not retried: the batch is counted in
 * foreshock_remote_write_samples_failed_total, logged, and passed.
 *
 * A step is settled when no live stream of the run (one heard within
 * RW_LIVE_S, or RW_LIVE_INTERVALS of its mean report interval if longer) is
 * still before it and the monitor stage has no spooled frame
 * at or before it: its points are then all written. A step re-done after a
 * rewind that was sent already is not sent again. */

#define RW_MAX_TARGETS 4u /* [remote_write "NAME"] sections; = STATS_MAX_RW_TARGETS */
#define RW_NAME_MAX 32u   /* target name bytes with NUL; = sizeof fs_rw_stats.name */
#define RW_URL_MAX 1024u
#define RW_PATH_MAX 1024u
#define RW_AUTH_MAX 256u
#define RW_LABELS_MAX 1024u     /* the `labels` setting, bytes with NUL */
#define RW_JOB_LABELS_MAX 16u   /* job labels */
#define RW_LABEL_NAME_MAX 64u   /* bytes with NUL */
#define RW_LABEL_VALUE_MAX 256u /* bytes with NUL */
#define RW_TOKEN_MAX 4096u      /* bearer token file bytes */
#define RW_LIVE_S 30.0          /* a stream heard within this long may still send earlier steps */
#define RW_LIVE_INTERVALS 3.0   /* ... or within this many of its mean report intervals */
#define RW_IDLE_POLL_MS 1000u   /* sleep between passes that found nothing to send */
#define RW_BACKOFF_MIN_MS 500u  /* first retry delay; doubles per failure */
#define RW_BACKOFF_MAX_MS 30000u
#define RW_MAX_STEP_SPAN 4096u    /* steps of one run in one batch, at most */
#define RW_LAST_TS_MAX (1u << 20) /* series whose last timestamp is kept (then all forgotten) */

struct rw_label {
    char name[RW_LABEL_NAME_MAX];
    char value[RW_LABEL_VALUE_MAX];
};

/* One [remote_write "NAME"] section (plain [remote_write]: "default"). */
struct rw_target {
    char name[RW_NAME_MAX];
    char url[RW_URL_MAX];
    char bearer_token_file[RW_PATH_MAX];
    char basic_user[RW_AUTH_MAX];
    char tenant[RW_AUTH_MAX]; /* X-Scope-OrgID (Mimir, Cortex), "": none */
    char basic_password_file[RW_PATH_MAX];
    char tls_ca[RW_PATH_MAX];
    char tls_cert[RW_PATH_MAX];
    char tls_key[RW_PATH_MAX];
    uint64_t batch_samples; /* samples per request (whole steps: may be exceeded) */
    double timeout_s;
    char labels[RW_LABELS_MAX]; /* "cluster=a,team=b" */
    int per_head;               /* also send every head's own series */
    /* parsed by rw_config_check */
    size_t n_job_labels;
    struct rw_label job_labels[RW_JOB_LABELS_MAX];
};

/* Every target; each has its own sender thread and its own cursors. */
struct rw_config {
    size_t n;
    struct rw_target t[RW_MAX_TARGETS];
    char origin[FS_CONFIG_MAX_PATH];
};

/* Empties rc and fills *out with the section to register with the config
 * parser: [remote_write] or [remote_write "NAME"], up to RW_MAX_TARGETS,
 * names [A-Za-z0-9_.-]. Main thread. */
void rw_config_section(struct rw_config *rc, struct config_section *out);
/* Checks every target's settings (url required, auth pairs, TLS key and
 * cert together, label syntax) and parses `labels`. 0 or -EINVAL with
 * err. Main thread. */
int rw_config_check(struct rw_config *rc, struct fs_err *err);

/* Parses "name=value,name=value" into out (at most max). Label names are
 * [a-zA-Z_][a-zA-Z0-9_]*, not reserved by us (run, attempt, layer, head,
 * window, rank, alertname, severity, family) nor starting "__". Returns
 * the count, or -EINVAL with err. Pure. */
int rw_parse_labels(const char *text, struct rw_label *out, size_t max, struct fs_err *err);

/* The metric name of a stored series name: "foreshock_" + name with every
 * byte not in [a-zA-Z0-9_] as '_' ("qk.d2.erank": foreshock_qk_d2_erank),
 * then suffix. Returns 0, or -ENOSPC when it does not fit. Pure. */
int rw_metric_name(const char *series, const char *suffix, char *out, size_t len);

/* What becomes of a request by its HTTP status (0: no response). */
enum rw_outcome { RW_SENT, RW_RETRY, RW_REJECTED };
enum rw_outcome rw_classify(long http_status);

/* Encoding: a batch of series with their samples, built in memory. */
struct rw_batch;
struct rw_batch *rw_batch_new(void);
void rw_batch_free(struct rw_batch *b);
void rw_batch_clear(struct rw_batch *b);
/* Appends a sample to the series of these labels (name/value pairs, n of
 * them, "__name__" among them; any order), creating it. A series'
 * timestamps must rise (a receiver refuses two values at one millisecond):
 * a sample at or before the last one this batch object took for the series,
 * in this or an earlier batch, is moved to 1 ms after it. So add a series'
 * samples oldest first. 0 or -ENOMEM. */
int rw_batch_add(struct rw_batch *b, const struct rw_label *labels, size_t n, int64_t ts_ms,
                 double value);
size_t rw_batch_samples(const struct rw_batch *b);
size_t rw_batch_series(const struct rw_batch *b);
/* The request body: the WriteRequest, labels sorted by name, snappy
 * compressed. *out is malloc'd (caller frees). 0 or -ENOMEM. */
int rw_batch_encode(const struct rw_batch *b, uint8_t **out, size_t *len);

struct store;
struct remote_write;

/* Starts a sender thread per target over the database at db_path (each its
 * own read-only connection); *out NULL when there is no target. The cursor goes
 * through store (STORE_ITEM_RW_CURSOR). 0 or a negative errno with err.
 * Main thread. */
int remote_write_start(const struct rw_config *rc, const char *db_path, struct store *store,
                       struct fs_stats *stats, struct remote_write **out, struct fs_err *err);
/* Stops and joins the sender (an in-flight request is abandoned; its batch
 * is resent after the next start). NULL is a no-op. Call before
 * store_close. Main thread. */
void remote_write_stop(struct remote_write *rw);

#endif
