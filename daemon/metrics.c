/* GET /metrics: Prometheus text exposition (format 0.0.4). See metrics.h. */

#include "metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alert.h"
#include "detect.h"
#include "spool.h"

/* A label value, escaped: run names are at most 128 bytes and monitor
 * names 48, so twice that plus slack always fits. */
#define METRICS_LABEL_MAX 1024u
#define METRICS_BUF_INITIAL 16384u

/* --- buffer ------------------------------------------------------------------------- */

void metrics_printf(struct metrics_buf *b, const char *fmt, ...)
{
    if (b->err)
        return;
    for (;;) {
        size_t room = b->cap - b->len;
        int n = 0;
        if (b->p) {
            va_list ap;
            va_start(ap, fmt);
            n = vsnprintf(b->p + b->len, room, fmt, ap);
            va_end(ap);
            if (n < 0) {
                b->err = -EINVAL;
                return;
            }
            if ((size_t)n < room) {
                b->len += (size_t)n;
                return;
            }
        }
        size_t need = b->len + (size_t)n + 1;
        if (need > METRICS_MAX_BYTES) {
            b->err = -E2BIG;
            return;
        }
        size_t cap = b->cap ? b->cap : METRICS_BUF_INITIAL;
        while (cap < need)
            cap *= 2;
        if (cap > METRICS_MAX_BYTES)
            cap = METRICS_MAX_BYTES;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->err = -ENOMEM;
            return;
        }
        if (!b->p)
            p[0] = '\0';
        b->p = p;
        b->cap = cap;
    }
}

void metrics_buf_free(struct metrics_buf *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}

int metrics_escape_label(const char *in, char *out, size_t outlen)
{
    size_t o = 0;
    for (const char *p = in; *p != '\0'; p++) {
        const char *rep = NULL;
        char one[2] = {*p, '\0'};
        switch (*p) {
        case '\\':
            rep = "\\\\";
            break;
        case '"':
            rep = "\\\"";
            break;
        case '\n':
            rep = "\\n";
            break;
        default:
            rep = one;
            break;
        }
        size_t n = strlen(rep);
        if (o + n + 1 > outlen)
            return -ENOSPC;
        memcpy(out + o, rep, n);
        o += n;
    }
    if (o + 1 > outlen)
        return -ENOSPC;
    out[o] = '\0';
    return 0;
}

/* --- families ------------------------------------------------------------------------ */

static void family(struct metrics_buf *b, const char *name, const char *type, const char *help)
{
    metrics_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static uint64_t ld(const atomic_uint_fast64_t *a)
{
    return (uint64_t)atomic_load_explicit((atomic_uint_fast64_t *)a, memory_order_relaxed);
}

/* A float sample value: Prometheus spells the specials NaN, +Inf, -Inf. */
static void value(struct metrics_buf *b, double v)
{
    if (isnan(v))
        metrics_printf(b, "NaN\n");
    else if (isinf(v))
        metrics_printf(b, "%sInf\n", v > 0 ? "+" : "-");
    else
        metrics_printf(b, "%.17g\n", v);
}

struct counter_def {
    const char *name;
    const char *type; /* "counter" | "gauge" */
    size_t offset;    /* of an atomic_uint_fast64_t in struct fs_stats */
    const char *help;
};

#define STAT(f) offsetof(struct fs_stats, f)

static const struct counter_def counters[] = {
    {"foreshock_connections", "gauge", STAT(connections_current), "Open ingest connections."},
    {"foreshock_connections_total", "counter", STAT(connections_total),
     "Ingest connections accepted."},
    {"foreshock_connections_rejected_total", "counter", STAT(connections_rejected),
     "Ingest connections refused when accepted, any admission limit "
     "(by limit: foreshock_ingest_refused_total)."},
    {"foreshock_ingest_unauthenticated", "gauge", STAT(unauthenticated),
     "Ingest connections in TLS handshake or before an accepted Hello."},
    {"foreshock_ingest_evicted_total", "counter", STAT(evicted),
     "Unauthenticated ingest connections closed to admit one from a less busy address."},
    {"foreshock_frames_received_total", "counter", STAT(frames_in), "Frames received."},
    {"foreshock_received_bytes_total", "counter", STAT(bytes_in), "Ingest bytes received."},
    {"foreshock_decode_errors_total", "counter", STAT(decode_errors),
     "Frames that did not decode."},
    {"foreshock_protocol_errors_total", "counter", STAT(protocol_errors),
     "Error frames sent to clients, any code."},
    {"foreshock_tls_failures_total", "counter", STAT(tls_failures),
     "Ingest connections whose TLS handshake failed (no or an untrusted certificate)."},
    {"foreshock_reports_received_total", "counter", STAT(reports_in), "Reports received."},
    {"foreshock_reports_committed_total", "counter", STAT(reports_committed),
     "Reports committed to the database (resends not counted)."},
    {"foreshock_reports_duplicate_total", "counter", STAT(reports_duplicate),
     "Resent reports that were already committed."},
    {"foreshock_points_committed_total", "counter", STAT(points_committed),
     "Series points committed."},
    {"foreshock_acks_sent_total", "counter", STAT(acks_out), "Ack frames sent."},
    {"foreshock_advice_sent_total", "counter", STAT(advice_out),
     "Advice frames sent to trainers (resends after a reconnect included)."},
    {"foreshock_advice_acked_total", "counter", STAT(advice_acked),
     "Advices trainers acknowledged (once per stream and advice)."},
    {"foreshock_backpressure_pauses_total", "counter", STAT(backpressure_pauses),
     "Times ingest stopped reading because the writer queue was full."},
    {"foreshock_frame_buffer_bytes", "gauge", STAT(frame_buffer_bytes),
     "Bytes of frames above 64 KiB being read into their own buffers (frame_buffer_max_bytes)."},
    {"foreshock_frame_buffer_waits_total", "counter", STAT(frame_buffer_waits),
     "Times a connection stopped reading until frame_buffer_max_bytes had room."},
    {"foreshock_commits_total", "counter", STAT(commits), "Write transactions committed."},
    {"foreshock_commit_errors_total", "counter", STAT(commit_errors),
     "Write transactions that failed (rolled back and retried or refused)."},
    {"foreshock_writer_queue_items", "gauge", STAT(writer_queue_items),
     "Items queued for the writer or in its open transaction."},
    {"foreshock_writer_queue_bytes", "gauge", STAT(writer_queue_bytes),
     "Bytes queued for the writer or in its open transaction."},
    {"foreshock_spool_bytes", "gauge", STAT(spool_bytes),
     "Bytes in the sketch spool log (DB.spool/): report frames kept until their steps are "
     "evaluated."},
    {"foreshock_spool_damaged_records_total", "counter", STAT(spool_damaged_records),
     "Spool records the start's replay found damaged: stretches that are not a record (passed "
     "over to the next one) and bodies failing their CRC."},
    {"foreshock_spool_skipped_bytes_total", "counter", STAT(spool_skipped_bytes),
     "Spool bytes the start's replay passed over looking for the next record."},
    {"foreshock_monitor_buckets_total", "counter", STAT(buckets_evaluated),
     "(run, step) buckets whose monitors ran."},
    {"foreshock_monitor_heads_total", "counter", STAT(heads_computed),
     "Attention heads through the QK monitor math."},
    {"foreshock_incomplete_steps_total", "counter", STAT(incomplete_total),
     "Reductions recorded as incomplete (a shard or rank never arrived)."},
    {"foreshock_sketches_late_total", "counter", STAT(sketches_late),
     "Sketches for a step already evaluated."},
    {"foreshock_sketches_duplicate_total", "counter", STAT(sketches_duplicate),
     "Sketches for a shard index or rank already summed into their step (ignored)."},
    {"foreshock_reports_superseded_total", "counter", STAT(reports_superseded),
     "Reports of an attempt a rewind abandoned, for steps it re-does (ignored)."},
    {"foreshock_rewinds_total", "counter", STAT(rewinds),
     "Rewinds (a trainer restarted from a checkpoint) whose detection state was rebuilt."},
    {"foreshock_reduce_bytes", "gauge", STAT(reduce_bytes),
     "Memory held by partial shard/rank reductions."},
    {"foreshock_reduce_pauses_total", "counter", STAT(reduce_pauses),
     "Times ingest read only the ranks that complete the oldest step (reduce_max_bytes or "
     "spool_max_bytes reached)."},
    {"foreshock_alerts_fired_total", "counter", STAT(alerts_fired), "Alert transitions to firing."},
    {"foreshock_outbox_pending", "gauge", STAT(outbox_pending), "Page deliveries not yet done."},
    {"foreshock_http_requests_total", "counter", STAT(http_requests), "HTTP responses sent."},
    {"foreshock_http_errors_total", "counter", STAT(http_errors),
     "HTTP responses with a status of 400 or more."},
};

static void target_family(struct metrics_buf *b, const struct fs_stats *st, const char *name,
                          const char *help, size_t offset)
{
    family(b, name, "counter", help);
    unsigned n = st->ntargets < STATS_MAX_TARGETS ? st->ntargets : STATS_MAX_TARGETS;
    for (unsigned i = 0; i < n; i++) {
        const struct fs_target_stats *t = &st->targets[i];
        char tn[STATS_TARGET_NAME_MAX], kn[sizeof t->kind];
        snprintf(tn, sizeof tn, "%s", t->name); /* NUL-terminated even if the writer was not */
        snprintf(kn, sizeof kn, "%s", t->kind);
        if (tn[0] == '\0')
            continue;
        char te[2 * STATS_TARGET_NAME_MAX + 1], ke[2 * sizeof t->kind + 1];
        if (metrics_escape_label(tn, te, sizeof te) != 0 ||
            metrics_escape_label(kn, ke, sizeof ke) != 0)
            continue;
        const atomic_uint_fast64_t *c = (const atomic_uint_fast64_t *)((const char *)t + offset);
        metrics_printf(b, "%s{target=\"%s\",kind=\"%s\"} %" PRIu64 "\n", name, te, ke, ld(c));
    }
}

/* A family per [remote_write "NAME"] target, label target. */
static void rw_family(struct metrics_buf *b, const struct fs_stats *st, const char *name,
                      const char *type, const char *help, size_t offset)
{
    family(b, name, type, help);
    unsigned n = st->n_rw < STATS_MAX_RW_TARGETS ? st->n_rw : STATS_MAX_RW_TARGETS;
    for (unsigned i = 0; i < n; i++) {
        const struct fs_rw_stats *t = &st->rw[i];
        char tn[sizeof t->name], te[2 * sizeof t->name + 1];
        snprintf(tn, sizeof tn, "%s", t->name);
        if (tn[0] == '\0' || metrics_escape_label(tn, te, sizeof te) != 0)
            continue;
        const atomic_uint_fast64_t *c = (const atomic_uint_fast64_t *)((const char *)t + offset);
        metrics_printf(b, "%s{target=\"%s\"} %" PRIu64 "\n", name, te, ld(c));
    }
}

int metrics_write_stats(struct metrics_buf *b, const struct fs_stats *st, const char *version)
{
    char ve[256];
    if (metrics_escape_label(version, ve, sizeof ve) != 0)
        snprintf(ve, sizeof ve, "unknown");
    family(b, "foreshock_build_info", "gauge", "Build information; the value is always 1.");
    metrics_printf(b, "foreshock_build_info{version=\"%s\"} 1\n", ve);
    family(b, "foreshock_ready", "gauge",
           "1 when storage is open and committing and both listeners are bound.");
    metrics_printf(b, "foreshock_ready %d\n",
                   atomic_load_explicit((atomic_int *)&st->ready, memory_order_relaxed) == 1);
    family(b, "foreshock_storage_failing", "gauge", "1 while commits fail (disk full, I/O).");
    metrics_printf(b, "foreshock_storage_failing %d\n",
                   atomic_load_explicit((atomic_int *)&st->storage_failing, memory_order_relaxed) !=
                       0);

    family(b, "foreshock_spool_lost_frames_total", "counter",
           "Acknowledged frames of steps not yet evaluated that the start's replay did not find "
           "in the spool log: missing (segment or directory gone, file cut short) or damaged.");
    metrics_printf(b, "foreshock_spool_lost_frames_total{why=\"missing\"} %" PRIu64 "\n",
                   ld(&st->spool_lost_missing));
    metrics_printf(b, "foreshock_spool_lost_frames_total{why=\"damaged\"} %" PRIu64 "\n",
                   ld(&st->spool_lost_damaged));
    family(b, "foreshock_spool_fault", "gauge",
           "1 for the reason commits stopped: the spool log was deleted or replaced under the "
           "running daemon (until a restart).");
    int fault = atomic_load_explicit((atomic_int *)&st->spool_fault, memory_order_relaxed);
    for (int f = SPOOL_FAULT_NONE + 1; f < SPOOL_FAULT_COUNT; f++)
        metrics_printf(b, "foreshock_spool_fault{reason=\"%s\"} %d\n", spool_fault_name(f),
                       fault == f);

    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
        const struct counter_def *d = &counters[i];
        family(b, d->name, d->type, d->help);
        const atomic_uint_fast64_t *a =
            (const atomic_uint_fast64_t *)((const char *)st + d->offset);
        metrics_printf(b, "%s %" PRIu64 "\n", d->name, ld(a));
    }

    family(b, "foreshock_ingest_refused_total", "counter",
           "Ingest connections refused when accepted, by the limit that refused them.");
    metrics_printf(b, "foreshock_ingest_refused_total{reason=\"max_connections\"} %" PRIu64 "\n",
                   ld(&st->refused_full));
    metrics_printf(b, "foreshock_ingest_refused_total{reason=\"per_address\"} %" PRIu64 "\n",
                   ld(&st->refused_address));
    metrics_printf(b, "foreshock_ingest_refused_total{reason=\"unauthenticated\"} %" PRIu64 "\n",
                   ld(&st->refused_unauth));

    family(b, "foreshock_monitor_seconds_total", "counter",
           "CPU time the worker threads spent in the monitor math (thread CPU clock), seconds.");
    metrics_printf(b, "foreshock_monitor_seconds_total ");
    value(b, (double)ld(&st->monitor_seconds_sum_us) / 1e6);

    /* The buckets are cumulative already (store.c). Read +Inf first so
     * that no finite bucket is read larger than the count. */
    const char *h = "foreshock_commit_duration_seconds";
    family(b, h, "histogram", "Write transaction duration, seconds.");
    uint64_t count = ld(&st->commit_seconds_bucket[STATS_COMMIT_BUCKETS]);
    uint64_t sum_us = ld(&st->commit_seconds_sum_us);
    for (int i = 0; i < STATS_COMMIT_BUCKETS; i++) {
        uint64_t v = ld(&st->commit_seconds_bucket[i]);
        metrics_printf(b, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", h, stats_commit_bucket_le[i],
                       v < count ? v : count);
    }
    metrics_printf(b, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", h, count);
    metrics_printf(b, "%s_sum ", h);
    value(b, (double)sum_us / 1e6);
    metrics_printf(b, "%s_count %" PRIu64 "\n", h, count);

    /* One owner per counter: the HTTP handlers (silenced_by) and the
     * pager thread each keep their own compiled set (silence_set.h). */
    family(b, "foreshock_silence_compiles_total", "counter",
           "Silences parsed and their regular expressions compiled for matching; an unchanged "
           "silence is reused, not compiled again.");
    metrics_printf(b, "foreshock_silence_compiles_total{by=\"http\"} %" PRIu64 "\n",
                   ld(&st->silence_compiles_http));
    metrics_printf(b, "foreshock_silence_compiles_total{by=\"pager\"} %" PRIu64 "\n",
                   ld(&st->silence_compiles_pager));

    target_family(b, st, "foreshock_pages_sent_total", "Page deliveries a target accepted.",
                  offsetof(struct fs_target_stats, sent));
    target_family(b, st, "foreshock_pages_failed_total",
                  "Page delivery attempts that failed and will be retried.",
                  offsetof(struct fs_target_stats, failed));
    target_family(b, st, "foreshock_pages_dropped_total",
                  "Page deliveries given up (permanent error).",
                  offsetof(struct fs_target_stats, dropped));
    target_family(b, st, "foreshock_pages_silenced_total",
                  "Page deliveries not made because a silence matched.",
                  offsetof(struct fs_target_stats, silenced));
    rw_family(b, st, "foreshock_remote_write_samples_sent_total", "counter",
              "Remote write: samples a receiver acknowledged (a batch resent after a crash counts "
              "again).",
              offsetof(struct fs_rw_stats, samples_sent));
    rw_family(b, st, "foreshock_remote_write_samples_failed_total", "counter",
              "Remote write: samples a receiver refused with a 4xx other than 429 (not retried).",
              offsetof(struct fs_rw_stats, samples_failed));
    rw_family(b, st, "foreshock_remote_write_retries_total", "counter",
              "Remote write: requests retried after a network error, a timeout, a 5xx or a 429.",
              offsetof(struct fs_rw_stats, retries));
    rw_family(b, st, "foreshock_remote_write_pending", "gauge",
              "Remote write: steps of all runs and alert events stored but not yet acknowledged.",
              offsetof(struct fs_rw_stats, pending));
    rw_family(b, st, "foreshock_remote_write_last_success_timestamp", "gauge",
              "Remote write: unix time of the last acknowledged request (0: none yet).",
              offsetof(struct fs_rw_stats, last_success));
    return b->err;
}

/* --- from the database ------------------------------------------------------------------ */

static int prep(sqlite3 *db, const char *sql, sqlite3_stmt **st, struct fs_err *err)
{
    int rc = sqlite3_prepare_v2(db, sql, -1, st, NULL);
    if (rc != SQLITE_OK)
        fs_err_set(err, rc, "metrics: prepare: %s", sqlite3_errmsg(db));
    return rc;
}

static int fail_step(sqlite3 *db, int rc, const char *what, struct fs_err *err)
{
    return fs_err_set(err, rc, "metrics: %s: %s", what, sqlite3_errmsg(db));
}

static int alerts_family(struct metrics_buf *b, sqlite3 *db, struct fs_err *err)
{
    /* state numbers pinned in alert.h: 1 pending, 2 firing */
    _Static_assert(ALERT_PENDING == 1 && ALERT_FIRING == 2, "the open states are 1 and 2");
    uint64_t n[2][2] = {{0}};
    sqlite3_stmt *st = NULL;
    int rc = prep(db, metrics_query_sql(METRICS_Q_ALERTS), &st, err);
    if (rc != SQLITE_OK)
        return rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        int s = sqlite3_column_int(st, 0) - 1;
        const char *v = (const char *)sqlite3_column_text(st, 1);
        enum detect_severity k;
        if (v && s >= 0 && s < 2 &&
            detect_severity_parse(v, (size_t)sqlite3_column_bytes(st, 1), &k) == 0)
            n[s][k] = (uint64_t)sqlite3_column_int64(st, 2);
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        return fail_step(db, rc, "alerts", err);
    family(b, "foreshock_alerts", "gauge", "Open alerts by state and severity.");
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 2; k++)
            metrics_printf(b, "foreshock_alerts{state=\"%s\",severity=\"%s\"} %" PRIu64 "\n",
                           alert_state_name((enum alert_state_id)(ALERT_PENDING + s)),
                           detect_severity_name((enum detect_severity)k), n[s][k]);
    return SQLITE_OK;
}

static int silences_family(struct metrics_buf *b, sqlite3 *db, double now, struct fs_err *err)
{
    sqlite3_stmt *st = NULL;
    int rc = prep(db, metrics_query_sql(METRICS_Q_SILENCES), &st, err);
    if (rc != SQLITE_OK)
        return rc;
    sqlite3_bind_double(st, 1, now);
    rc = sqlite3_step(st);
    int64_t n = rc == SQLITE_ROW ? sqlite3_column_int64(st, 0) : 0;
    sqlite3_finalize(st);
    if (rc != SQLITE_ROW)
        return fail_step(db, rc, "silences", err);
    family(b, "foreshock_silences_active", "gauge", "Silences in effect now.");
    metrics_printf(b, "foreshock_silences_active %" PRId64 "\n", n);
    return SQLITE_OK;
}

struct run_row {
    int64_t id;
    char label[2 * 128 + 8]; /* escaped name (run names are <= 128 bytes) */
    int has_step;
    int64_t last_step;
};

int metrics_write_db(struct metrics_buf *b, sqlite3 *db, const struct metrics_opts *o, double now,
                     struct fs_err *err)
{
    struct run_row runs[METRICS_MAX_RUNS];
    size_t nruns = 0;
    sqlite3_stmt *st = NULL;
    int rc;
    if ((rc = alerts_family(b, db, err)) != SQLITE_OK ||
        (rc = silences_family(b, db, now, err)) != SQLITE_OK)
        return rc;

    /* The most recently active runs, at most max_runs. */
    unsigned max = o->max_runs < METRICS_MAX_RUNS ? o->max_runs : METRICS_MAX_RUNS;
    if ((rc = prep(db, metrics_query_sql(METRICS_Q_RUNS), &st, err)) != SQLITE_OK)
        return rc;
    sqlite3_bind_double(st, 1, now - o->run_max_age);
    sqlite3_bind_int(st, 2, (int)max);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW && nruns < max) {
        struct run_row *r = &runs[nruns];
        const char *name = (const char *)sqlite3_column_text(st, 1);
        if (!name || metrics_escape_label(name, r->label, sizeof r->label) != 0)
            continue;
        r->id = sqlite3_column_int64(st, 0);
        r->has_step = sqlite3_column_type(st, 2) != SQLITE_NULL;
        r->last_step = sqlite3_column_int64(st, 2);
        nruns++;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE && rc != SQLITE_ROW)
        return fail_step(db, rc, "runs", err);

    family(b, "foreshock_run_last_step", "gauge",
           "Highest step committed for a recently active run.");
    for (size_t i = 0; i < nruns; i++)
        if (runs[i].has_step)
            metrics_printf(b, "foreshock_run_last_step{run=\"%s\"} %" PRId64 "\n", runs[i].label,
                           runs[i].last_step);

    /* Latest loss: the lowest rank's loss series, its last point. */
    family(b, "foreshock_run_loss", "gauge", "Latest loss of a recently active run (lowest rank).");
    if ((rc = prep(db, metrics_query_sql(METRICS_Q_LOSS), &st, err)) != SQLITE_OK)
        return rc;
    for (size_t i = 0; i < nruns; i++) {
        sqlite3_bind_int64(st, 1, runs[i].id);
        rc = sqlite3_step(st);
        if (rc == SQLITE_ROW) {
            metrics_printf(b, "foreshock_run_loss{run=\"%s\"} ", runs[i].label);
            value(b,
                  sqlite3_column_type(st, 0) == SQLITE_NULL ? NAN : sqlite3_column_double(st, 0));
        } else if (rc != SQLITE_DONE) {
            sqlite3_finalize(st);
            return fail_step(db, rc, "loss", err);
        }
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);

    /* Per-layer aggregates (the query says which series). */
    family(b, "foreshock_monitor_value", "gauge",
           "Latest value of each per-layer monitor series of a recently active run.");
    if ((rc = prep(db, metrics_query_sql(METRICS_Q_MONITOR_VALUES), &st, err)) != SQLITE_OK)
        return rc;
    for (size_t i = 0; i < nruns; i++) {
        sqlite3_bind_int64(st, 1, runs[i].id);
        sqlite3_bind_int(st, 2, METRICS_MAX_SERIES_SCAN);
        sqlite3_bind_int(st, 3, METRICS_MAX_MONITOR_VALUES);
        while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
            const char *name = (const char *)sqlite3_column_text(st, 0);
            char ne[METRICS_LABEL_MAX];
            if (!name || metrics_escape_label(name, ne, sizeof ne) != 0)
                continue;
            int64_t window = sqlite3_column_int64(st, 2);
            /* QK aggregates exist per attention window: it is a label
             * where it applies, so that samples stay distinct. */
            char wl[40] = "";
            if (window > 0)
                snprintf(wl, sizeof wl, ",window=\"%" PRId64 "\"", window);
            metrics_printf(
                b, "foreshock_monitor_value{run=\"%s\",layer=\"%" PRId64 "\",monitor=\"%s\"%s} ",
                runs[i].label, (int64_t)sqlite3_column_int64(st, 1), ne, wl);
            value(b,
                  sqlite3_column_type(st, 3) == SQLITE_NULL ? NAN : sqlite3_column_double(st, 3));
        }
        if (rc != SQLITE_DONE) {
            sqlite3_finalize(st);
            return fail_step(db, rc, "monitor values", err);
        }
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
    return b->err;
}
