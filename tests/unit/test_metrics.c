/* /metrics rendering: label escaping as a table, the counters' text from
 * a known fs_stats, and the database families from a temp database. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sqlite3.h>

#include "fstest.h"
#include "metrics.h"

Test(metrics, escape_label_table)
{
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"plain", "plain"},
        {"", ""},
        {"a\"b", "a\\\"b"},
        {"back\\slash", "back\\\\slash"},
        {"two\nlines", "two\\nlines"},
        {"\\\"\n", "\\\\\\\"\\n"},
        {"tab\tstays", "tab\tstays"},
        {"utf8 \xc3\xa9", "utf8 \xc3\xa9"},
    };
    for (size_t i = 0; i < N(cases); i++) {
        char buf[64];
        cr_assert_eq(metrics_escape_label(cases[i].in, buf, sizeof buf), 0);
        cr_expect_str_eq(buf, cases[i].out, "'%s'", cases[i].in);
    }
    char small[4];
    cr_expect_eq(metrics_escape_label("abcd", small, sizeof small), -ENOSPC);
    cr_expect_eq(metrics_escape_label("a\"", small, sizeof small), 0);
    cr_expect_eq(metrics_escape_label("ab\"", small, sizeof small), -ENOSPC);
}

static bool has_line(const char *text, const char *line)
{
    size_t n = strlen(line);
    for (const char *p = text; (p = strstr(p, line)); p++)
        if ((p == text || p[-1] == '\n') && p[n] == '\n')
            return true;
    return false;
}

Test(metrics, stats_text)
{
    static struct fs_stats st; /* zeroed; static: it is large */
    atomic_store(&st.ready, 1);
    atomic_store(&st.reports_committed, 42);
    atomic_store(&st.connections_current, 3);
    atomic_store(&st.monitor_seconds_sum_us, 1500000);
    /* two commits: 0.0007 s and 0.02 s (cumulative buckets, as store.c keeps them) */
    for (int i = 0; i < STATS_COMMIT_BUCKETS; i++)
        atomic_store(&st.commit_seconds_bucket[i],
                     (stats_commit_bucket_le[i] >= 0.02) + (stats_commit_bucket_le[i] >= 0.0007));
    atomic_store(&st.commit_seconds_bucket[STATS_COMMIT_BUCKETS], 2);
    atomic_store(&st.commit_seconds_sum_us, 20700);
    st.ntargets = 2;
    snprintf(st.targets[0].name, sizeof st.targets[0].name, "am\"main");
    snprintf(st.targets[0].kind, sizeof st.targets[0].kind, "alertmanager");
    atomic_store(&st.targets[0].sent, 5);
    snprintf(st.targets[1].name, sizeof st.targets[1].name, "pd");
    snprintf(st.targets[1].kind, sizeof st.targets[1].kind, "pagerduty");

    struct metrics_buf b = {0};
    cr_assert_eq(metrics_write_stats(&b, &st, "1.2\"3"), 0);
    const char *t = b.p;
    static const char *const lines[] = {
        "foreshock_build_info{version=\"1.2\\\"3\"} 1",
        "foreshock_ready 1",
        "foreshock_storage_failing 0",
        "foreshock_reports_committed_total 42",
        "# TYPE foreshock_reports_committed_total counter",
        "foreshock_connections 3",
        "# TYPE foreshock_connections gauge",
        "foreshock_monitor_seconds_total 1.5",
        "# TYPE foreshock_commit_duration_seconds histogram",
        "foreshock_commit_duration_seconds_bucket{le=\"0.0005\"} 0",
        "foreshock_commit_duration_seconds_bucket{le=\"0.001\"} 1",
        "foreshock_commit_duration_seconds_bucket{le=\"0.025\"} 2",
        "foreshock_commit_duration_seconds_bucket{le=\"+Inf\"} 2",
        "foreshock_commit_duration_seconds_sum 0.0207",
        "foreshock_commit_duration_seconds_count 2",
        "foreshock_pages_sent_total{target=\"am\\\"main\",kind=\"alertmanager\"} 5",
        "foreshock_pages_failed_total{target=\"pd\",kind=\"pagerduty\"} 0",
        "# TYPE foreshock_pages_silenced_total counter",
        "# TYPE foreshock_outbox_pending gauge",
        "foreshock_http_errors_total 0",
    };
    for (size_t i = 0; i < N(lines); i++)
        cr_expect(has_line(t, lines[i]), "missing line: %s", lines[i]);
    /* every sample's family has HELP and TYPE before it */
    for (const char *p = t; *p;) {
        const char *e = strchr(p, '\n');
        cr_assert_not_null(e);
        if (*p != '#') {
            char name[128];
            size_t n = strcspn(p, "{ ");
            snprintf(name, sizeof name, "%.*s", (int)n, p);
            /* the histogram's samples carry suffixes */
            static const char hist[] = "foreshock_commit_duration_seconds";
            if (strncmp(name, hist, sizeof hist - 1) == 0)
                name[sizeof hist - 1] = '\0';
            char help[160];
            snprintf(help, sizeof help, "# HELP %s ", name);
            cr_expect(strstr(t, help), "no HELP for %s", name);
        }
        p = e + 1;
    }
    metrics_buf_free(&b);
}

Test(metrics, buffer_grows_and_bounds)
{
    struct metrics_buf b = {0};
    for (int i = 0; i < 10000; i++)
        metrics_printf(&b, "line %d\n", i);
    cr_expect_eq(b.err, 0);
    cr_expect(strstr(b.p, "line 9999\n"));
    cr_expect_eq(strlen(b.p), b.len);
    char chunk[1 << 16];
    memset(chunk, 'x', sizeof chunk - 1);
    chunk[sizeof chunk - 1] = '\0';
    for (int i = 0; i < 300 && b.err == 0; i++)
        metrics_printf(&b, "%s", chunk);
    cr_expect_eq(b.err, -E2BIG);
    cr_expect(b.len <= METRICS_MAX_BYTES);
    metrics_buf_free(&b);
}

Test(metrics, db_families)
{
    struct tmpdb tmp;
    tmpdb_make(&tmp, "metrics");
    sqlite3 *db;
    cr_assert_eq(sqlite3_open(tmp.path, &db), SQLITE_OK);
    db_apply_schema(db, false, false);
    double now = 10000;
    /* r-new and r-mid are recent; r-old is too old; r-none has no reports */
    db_exec(db, "INSERT INTO runs(id, name, created_at, last_seen_at, world_size, last_step,"
                " reports) VALUES (1, 'r-old', 0, 100, 1, 5, 1), (2, 'r-mid', 0, 9000, 1, 50, 10),"
                " (3, 'r-new', 0, 9990, 1, 70, 10), (4, 'r-none', 0, 9999, 1, NULL, 0)");
    db_exec(db, "INSERT INTO series(id, run_id, name, layer, head, window, rank, last_step) VALUES"
                " (1, 3, 'loss', -1, -1, 0, 1, 70), (2, 3, 'loss', -1, -1, 0, 0, 69),"
                " (3, 3, 'qk.d2.erank.min', 2, -1, 8, -1, 70)," /* per layer: shown */
                " (4, 3, 'qk.d2.erank', 2, 5, 8, -1, 70),"      /* per head: not */
                " (5, 3, 'router.maxvio', 1, -1, 0, -1, 70),"   /* per layer, no window */
                " (6, 3, 'weight_norm', 0, -1, 0, 0, 70),"      /* per rank: not */
                " (7, 2, 'loss', -1, -1, 0, 0, 50),"
                " (8, 3, 'qk.d2.erank.argmin', 2, -1, 8, -1, 70)"); /* a head index: not */
    db_exec(db, "INSERT INTO points(series_id, step, value, time) VALUES (1, 70, 9.5, 0),"
                " (2, 69, 2.25, 0), (3, 70, 3.5, 0), (4, 70, 1, 0), (5, 70, NULL, 0),"
                " (6, 70, 1, 0),"
                " (7, 50, 4, 0), (8, 70, 3, 0)");
    db_exec(db, "INSERT INTO alerts(id, run_id, rule, alert_key, dedup_key, state, severity,"
                " family, attribution, last_step, created_at, updated_at) VALUES"
                " (1, 3, 'loss', 'k1', 'd1', 2, 'critical', 'f', 'loss-spike', 1, 0, 0),"
                " (2, 3, 'loss', 'k2', 'd2', 2, 'critical', 'f', 'loss-spike', 1, 0, 0),"
                " (3, 3, 'loss', 'k3', 'd3', 1, 'warning', 'f', 'loss-spike', 1, 0, 0),"
                " (4, 3, 'loss', 'k4', 'd4', 3, 'warning', 'f', 'loss-spike', 1, 0, 0)");
    db_exec(db, "INSERT INTO silences(matchers_json, starts_at, ends_at, created_by, comment,"
                " created_at, updated_at) VALUES ('[]', 0, 20000, 'a', '', 0, 0),"
                " ('[]', 11000, 20000, 'a', '', 0, 0), ('[]', 0, 5000, 'a', '', 0, 0)");

    struct metrics_buf b = {0};
    struct fs_err err = {0};
    struct metrics_opts o = {.max_runs = 8, .run_max_age = 3600};
    cr_assert_eq(metrics_write_db(&b, db, &o, now, &err), 0, "%s", err.msg);
    const char *t = b.p;
    static const char *const want[] = {
        "foreshock_alerts{state=\"firing\",severity=\"critical\"} 2",
        "foreshock_alerts{state=\"pending\",severity=\"warning\"} 1",
        "foreshock_alerts{state=\"firing\",severity=\"warning\"} 0",
        "foreshock_silences_active 1",
        "foreshock_run_last_step{run=\"r-new\"} 70",
        "foreshock_run_last_step{run=\"r-mid\"} 50",
        "foreshock_run_loss{run=\"r-new\"} 2.25",
        "foreshock_run_loss{run=\"r-mid\"} 4",
        "foreshock_monitor_value{run=\"r-new\",layer=\"2\",monitor=\"qk.d2.erank.min\","
        "window=\"8\"} 3.5",
        "foreshock_monitor_value{run=\"r-new\",layer=\"1\",monitor=\"router.maxvio\"} NaN",
    };
    for (size_t i = 0; i < N(want); i++)
        cr_expect(has_line(t, want[i]), "missing: %s\n%s", want[i], t);
    cr_expect(!(strstr(t, "r-old")), "a run too old is shown");
    cr_expect(!(strstr(t, "r-none")), "a run without reports is shown");
    cr_expect(!(strstr(t, "monitor=\"qk.d2.erank\"")), "a per-head series is shown");
    cr_expect(!(strstr(t, "weight_norm")), "a per-rank series is shown");
    cr_expect(!(strstr(t, "argmin")), "an argmin (head index) series is shown");
    metrics_buf_free(&b);

    /* max_runs bounds the runs: only the most recent */
    o.max_runs = 1;
    cr_assert_eq(metrics_write_db(&b, db, &o, now, &err), 0, "%s", err.msg);
    cr_expect(strstr(b.p, "r-new"));
    cr_expect(!(strstr(b.p, "r-mid")));
    metrics_buf_free(&b);

    sqlite3_close(db);
    tmpdb_remove(&tmp);
}
