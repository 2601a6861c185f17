/* store.c: migrations, the writer queue, commit-then-announce, dedup,
 * re-done steps, backpressure, Hellos first, the spool log. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "foreshock.pb-c.h"
#include "fstest.h"
#include "schema.h"
#include "spool.h"
#include "store.h"

struct fixture {
    struct tmpdb db;
    struct fs_stats stats;
    struct store *s;
};

static struct store_opts opts_for(struct fixture *f)
{
    return (struct store_opts){
        .max_runs = 100,
        .queue_max_items = 1000,
        .queue_max_bytes = 1 << 24,
        .batch_max_items = 64,
        .stats = &f->stats,
    };
}

static void fx_init(struct fixture *f)
{
    memset(f, 0, sizeof(*f));
    tmpdb_make(&f->db, "store");
}

static void fx_open(struct fixture *f, const struct store_opts *o)
{
    struct fs_err err = {0};
    int rc = store_open(f->db.path, o, &f->s, &err);
    cr_assert_eq(rc, 0, "store_open: %d %s", rc, err.msg);
}

static void fx_fini(struct fixture *f)
{
    store_close(f->s);
    f->s = NULL;
    tmpdb_remove(&f->db);
}

static sqlite3 *ro(struct fixture *f)
{
    sqlite3 *db;
    struct fs_err err = {0};
    cr_assert_eq(store_open_readonly(f->db.path, &db, &err), 0, "%s", err.msg);
    return db;
}

static void submit_ok(struct store *s, struct store_item *it)
{
    int rc = store_submit(s, it);
    cr_assert_eq(rc, 0, "store_submit: %d", rc);
}

static struct store_item *hello(uint64_t conn, const char *run, uint32_t attempt, uint32_t rank)
{
    struct store_item *it = store_item_new(STORE_ITEM_HELLO);
    cr_assert_not_null(it);
    it->conn_id = conn;
    snprintf(it->hello.run, sizeof(it->hello.run), "%s", run);
    it->hello.attempt = attempt;
    it->hello.rank = rank;
    it->hello.world_size = rank + 1;
    it->hello.model_json = strdup("{\"n_layers\":2}");
    return it;
}

static struct store_item *report(uint64_t conn, const struct store_result *h, uint64_t seq,
                                 uint64_t step, double loss)
{
    struct store_item *it = store_item_new(STORE_ITEM_REPORT);
    cr_assert_not_null(it);
    it->conn_id = conn;
    it->report.run_id = h->run_id;
    it->report.stream_id = h->stream_id;
    it->report.rank = 0;
    it->report.seq = seq;
    it->report.step = step;
    it->report.time = 1000.0 + (double)step;
    it->report.received_at = 2000.0;
    it->report.frame_bytes = 42;
    it->report.present = 1u << STORE_LOSS | 1u << STORE_GRAD_NORM;
    it->report.scalars[STORE_LOSS] = loss;
    it->report.scalars[STORE_GRAD_NORM] = 1.0;
    it->report.n_weight_norm = 2;
    it->report.weight_norm = malloc(2 * sizeof(float));
    it->report.weight_norm[0] = 3.0f;
    it->report.weight_norm[1] = 4.0f;
    return it;
}

/* Flushes and returns all results (caller frees). */
static size_t results(struct store *s, struct store_result **out)
{
    store_flush(s);
    return store_take_results(s, out);
}

static struct store_result hello_done(struct store *s, uint64_t conn)
{
    struct store_result *r;
    size_t n = results(s, &r);
    struct store_result h = {0};
    int found = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[i].kind == STORE_RESULT_HELLO && r[i].conn_id == conn) {
            h = r[i];
            found = 1;
        }
    }
    free(r);
    cr_assert(found, "no HELLO result for conn %llu", (unsigned long long)conn);
    return h;
}

/* Highest acked seq and number of settled items for conn in results. */
static uint64_t acked(const struct store_result *r, size_t n, uint64_t conn, uint64_t *items)
{
    uint64_t seq = 0;
    *items = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[i].kind == STORE_RESULT_ACK && r[i].conn_id == conn) {
            cr_expect_eq(r[i].error_code, 0, "%s", r[i].message);
            if (r[i].seq > seq)
                seq = r[i].seq;
            *items += r[i].items;
        }
    }
    return seq;
}

Test(store, migrates_empty_db)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    sqlite3 *db = ro(&f);
    cr_expect_eq(q1(db, "PRAGMA user_version"), schema_migration_count);
    const char *tables[] = {"runs", "streams", "reports", "series", "points", "spool_log"};
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++) {
        char sql[128];
        snprintf(sql, sizeof(sql),
                 "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '%s'",
                 tables[i]);
        cr_expect_eq(q1(db, sql), 1, "table %s missing", tables[i]);
    }
    cr_expect_eq(q1(db, "SELECT count(*) FROM runs"), 0);
    char *mode = NULL;
    sqlite3_stmt *st;
    sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &st, NULL);
    cr_assert_eq(sqlite3_step(st), SQLITE_ROW);
    mode = strdup((const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    cr_expect_str_eq(mode, "wal");
    free(mode);
    /* Read-only really is read-only. */
    cr_expect_neq(sqlite3_exec(db, "DELETE FROM runs", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    fx_fini(&f);
}

Test(store, reopen_is_a_noop)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "keep", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    cr_assert_eq(h.error_code, 0, "%s", h.message);
    store_close(f.s);
    fx_open(&f, &o);
    sqlite3 *db = ro(&f);
    cr_expect_eq(q1(db, "PRAGMA user_version"), schema_migration_count);
    cr_expect_eq(q1(db, "SELECT count(*) FROM runs WHERE name = 'keep'"), 1);
    sqlite3_close(db);
    /* The same stream comes back with the same ids. */
    submit_ok(f.s, hello(2, "keep", 0, 0));
    struct store_result h2 = hello_done(f.s, 2);
    cr_expect_eq(h2.run_id, h.run_id);
    cr_expect_eq(h2.stream_id, h.stream_id);
    fx_fini(&f);
}

Test(store, refuses_newer_schema)
{
    struct fixture f;
    fx_init(&f);
    sqlite3 *db;
    cr_assert_eq(sqlite3_open(f.db.path, &db), SQLITE_OK);
    char sql[64];
    snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", schema_migration_count + 1);
    cr_assert_eq(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    struct store_opts o = opts_for(&f);
    struct fs_err err = {0};
    struct store *s = NULL;
    int rc = store_open(f.db.path, &o, &s, &err);
    cr_expect_lt(rc, 0);
    cr_expect_null(s);
    cr_expect(strstr(err.msg, "newer"), "%s", err.msg);
    fx_fini(&f);
}

Test(store, report_commits_and_points_are_readable)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    sqlite3 *db = ro(&f); /* opened before anything is written */
    submit_ok(f.s, hello(7, "r1", 0, 0));
    struct store_result h = hello_done(f.s, 7);
    cr_assert_eq(h.error_code, 0);
    cr_expect_eq(h.seq, 0, "a new stream starts at last_seq 0");
    cr_expect_gt(h.stream_id, 0);

    submit_ok(f.s, report(7, &h, 1, 10, 2.5));
    struct store_result *r;
    size_t n = results(f.s, &r);
    uint64_t items;
    cr_expect_eq(acked(r, n, 7, &items), 1);
    cr_expect_eq(items, 1);
    free(r);
    /* Announced means committed: the other connection sees it. */
    cr_expect_eq(qd(db, "SELECT p.value FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'loss' AND s.rank = 0 AND p.step = 10"),
                 2.5);
    cr_expect_eq(qd(db, "SELECT p.time FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'loss'"),
                 1010.0);
    cr_expect_eq(qd(db, "SELECT p.value FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'weight_norm' AND s.layer = 1"),
                 4.0);
    cr_expect_eq(q1(db, "SELECT count(*) FROM series"), 4); /* loss, grad_norm, 2 layers */
    cr_expect_eq(q1(db, "SELECT points FROM series WHERE name = 'loss'"), 1);
    cr_expect_eq(q1(db, "SELECT first_step FROM series WHERE name = 'loss'"), 10);
    cr_expect_eq(q1(db, "SELECT last_seq FROM streams"), 1);
    cr_expect_eq(q1(db, "SELECT reports FROM streams"), 1);
    cr_expect_eq(q1(db, "SELECT reports FROM runs"), 1);
    cr_expect_eq(q1(db, "SELECT last_step FROM runs"), 10);
    cr_expect_eq(q1(db, "SELECT count(*) FROM reports"), 1);
    cr_expect_eq(q1(db, "SELECT count(*) FROM runs WHERE model_json = '{\"n_layers\":2}'"), 1);
    cr_expect_eq(atomic_load(&f.stats.reports_committed), 1);
    cr_expect_eq(atomic_load(&f.stats.points_committed), 4);
    cr_expect_geq(atomic_load(&f.stats.commits), 2);
    cr_expect_eq(atomic_load(&f.stats.commit_seconds_bucket[STATS_COMMIT_BUCKETS]),
                 atomic_load(&f.stats.commits), "+Inf bucket counts every commit");
    sqlite3_close(db);
    fx_fini(&f);
}

Test(store, resent_report_is_a_noop_but_acked)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "dup", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    for (uint64_t seq = 1; seq <= 3; seq++)
        submit_ok(f.s, report(1, &h, seq, seq, 1.0));
    struct store_result *r;
    size_t n = results(f.s, &r);
    free(r);
    sqlite3 *db = ro(&f);
    int64_t points = q1(db, "SELECT count(*) FROM points");
    /* Reconnect and resend seq 2..3 with different values: stored once. */
    submit_ok(f.s, hello(2, "dup", 0, 0));
    struct store_result h2 = hello_done(f.s, 2);
    cr_expect_eq(h2.seq, 3);
    submit_ok(f.s, report(2, &h2, 2, 2, 9.0));
    submit_ok(f.s, report(2, &h2, 3, 3, 9.0));
    n = results(f.s, &r);
    uint64_t items;
    cr_expect_eq(acked(r, n, 2, &items), 3, "duplicates are still acked");
    cr_expect_eq(items, 2);
    free(r);
    cr_expect_eq(q1(db, "SELECT count(*) FROM points"), points);
    cr_expect_eq(q1(db, "SELECT reports FROM runs"), 3);
    cr_expect_eq(q1(db, "SELECT reports FROM streams"), 3);
    cr_expect_eq(qd(db, "SELECT p.value FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'loss' AND p.step = 3"),
                 1.0, "the resend did not overwrite");
    cr_expect_eq(atomic_load(&f.stats.reports_duplicate), 2);
    sqlite3_close(db);
    fx_fini(&f);
}

Test(store, redone_step_replaces_its_value)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "redo", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    submit_ok(f.s, report(1, &h, 1, 5, 1.0));
    submit_ok(f.s, report(1, &h, 2, 6, 2.0));
    store_flush(f.s);
    /* The trainer restarts from the checkpoint at step 5: new seqs, old steps. */
    submit_ok(f.s, report(1, &h, 3, 5, 7.0));
    submit_ok(f.s, report(1, &h, 4, 6, 8.0));
    store_flush(f.s);
    sqlite3 *db = ro(&f);
    cr_expect_eq(q1(db, "SELECT count(*) FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'loss'"),
                 2);
    cr_expect_eq(qd(db, "SELECT p.value FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'loss' AND p.step = 5"),
                 7.0);
    cr_expect_eq(q1(db, "SELECT points FROM series WHERE name = 'loss'"), 2);
    cr_expect_eq(q1(db, "SELECT first_step FROM series WHERE name = 'loss'"), 5);
    cr_expect_eq(q1(db, "SELECT last_step FROM series WHERE name = 'loss'"), 6);
    cr_expect_eq(q1(db, "SELECT reports FROM runs"), 4);
    sqlite3_close(db);
    fx_fini(&f);
}

Test(store, welcome_seq_includes_earlier_queued_reports)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "fifo", 2, 0));
    struct store_result h = hello_done(f.s, 1);
    /* A reconnecting stream's Hello keeps its place behind the stream's
     * queued reports (store.h): its Welcome covers them. */
    uint64_t key = store_stream_key("fifo", 2, 0);
    for (uint64_t seq = 1; seq <= 5; seq++) {
        struct store_item *it = report(1, &h, seq, seq, 1.0);
        it->report.stream_key = key;
        submit_ok(f.s, it);
    }
    struct store_item *again = hello(2, "fifo", 2, 0); /* queued behind the reports */
    again->hello.stream_key = key;
    submit_ok(f.s, again);
    struct store_result *r;
    size_t n = results(f.s, &r);
    uint64_t items;
    cr_expect_eq(acked(r, n, 1, &items), 5);
    cr_expect_eq(items, 5);
    int seen = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[i].kind == STORE_RESULT_HELLO && r[i].conn_id == 2) {
            cr_expect_eq(r[i].seq, 5);
            cr_expect_eq(r[i].stream_id, h.stream_id);
            seen = 1;
        }
    }
    cr_expect(seen);
    free(r);
    /* A different attempt is a different stream. */
    submit_ok(f.s, hello(3, "fifo", 3, 0));
    struct store_result h3 = hello_done(f.s, 3);
    cr_expect_neq(h3.stream_id, h.stream_id);
    cr_expect_eq(h3.seq, 0);
    fx_fini(&f);
}

/* One report of the stream h names, committed. */
static void report_done(struct store *s, uint64_t conn, const struct store_result *h)
{
    submit_ok(s, report(conn, h, h->seq + 1, 0, 1.0));
    store_flush(s);
    struct store_result *r;
    size_t n = results(s, &r);
    free(r);
    (void)n;
}

/* max_runs counts live runs (a report sent, not ended): a Hello that
 * could make one more live is refused, a live run's Hello never, and runs
 * that never sent a report hold no slot (issue 22). */
static const struct {
    const char *name;
    int report_first; /* "first" sends a report */
    int second_ok;    /* then a Hello of "second" is welcomed */
} live_cases[] = {
    {"live run holds the slot", 1, 0},
    {"Hello alone holds no slot", 0, 1},
};

Test(store, max_runs_counts_live_runs)
{
    for (size_t k = 0; k < sizeof(live_cases) / sizeof(live_cases[0]); k++) {
        struct fixture f;
        fx_init(&f);
        struct store_opts o = opts_for(&f);
        o.max_runs = 1;
        fx_open(&f, &o);
        submit_ok(f.s, hello(1, "first", 0, 0));
        struct store_result h1 = hello_done(f.s, 1);
        cr_expect_eq(h1.error_code, 0);
        if (live_cases[k].report_first)
            report_done(f.s, 1, &h1);
        submit_ok(f.s, hello(2, "second", 0, 0));
        struct store_result h = hello_done(f.s, 2);
        if (live_cases[k].second_ok) {
            cr_expect_eq(h.error_code, 0, "%s: %s", live_cases[k].name, h.message);
        } else {
            cr_expect_eq(h.error_code, FORESHOCK__ERROR_CODE__ERROR_LIMIT, "%s",
                         live_cases[k].name);
            cr_expect(strstr(h.message, "max_runs"), "%s", h.message);
        }
        submit_ok(f.s, hello(3, "first", 0, 1));
        cr_expect_eq(hello_done(f.s, 3).error_code, 0, "%s: an existing live run is admitted",
                     live_cases[k].name);
        fx_fini(&f);
    }
}

/* max_runs_per_token: live runs per owner ([run] pattern), others unaffected. */
Test(store, max_runs_per_token_is_per_owner)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    o.max_runs_per_token = 1;
    fx_open(&f, &o);
    struct store_item *it = hello(1, "a-1", 0, 0);
    snprintf(it->hello.owner, sizeof(it->hello.owner), "a-*");
    submit_ok(f.s, it);
    struct store_result h1 = hello_done(f.s, 1);
    cr_assert_eq(h1.error_code, 0);
    report_done(f.s, 1, &h1);
    it = hello(2, "a-2", 0, 0);
    snprintf(it->hello.owner, sizeof(it->hello.owner), "a-*");
    submit_ok(f.s, it);
    struct store_result h2 = hello_done(f.s, 2);
    cr_expect_eq(h2.error_code, FORESHOCK__ERROR_CODE__ERROR_LIMIT);
    cr_expect(strstr(h2.message, "max_runs_per_token"), "%s", h2.message);
    it = hello(3, "b-1", 0, 0);
    snprintf(it->hello.owner, sizeof(it->hello.owner), "b-*");
    submit_ok(f.s, it);
    cr_expect_eq(hello_done(f.s, 3).error_code, 0, "another token's run is admitted");
    fx_fini(&f);
}

/* store_run_delete_rows leaves no row of the run in any table that names
 * a run, stream, series or alert, and leaves the other run alone; a new
 * row never takes a deleted id. */
Test(store, run_delete_rows_every_table)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    store_close(f.s);
    f.s = NULL;
    sqlite3 *db;
    cr_assert_eq(sqlite3_open(f.db.path, &db), SQLITE_OK);
    const char *fill =
        "PRAGMA foreign_keys = ON;"
        "INSERT INTO runs (id, name, created_at, last_seen_at, world_size) VALUES "
        "(1, 'a', 0, 0, 1), (2, 'b', 0, 0, 1);"
        "INSERT INTO streams (id, run_id, attempt, rank, created_at, last_seen_at) VALUES "
        "(1, 1, 0, 0, 0, 0), (2, 2, 0, 0, 0, 0);"
        "INSERT INTO reports VALUES (1, 1, 0, 0, 1), (2, 1, 0, 0, 1);"
        "INSERT INTO series (id, run_id, name) VALUES (1, 1, 'loss'), (2, 2, 'loss');"
        "INSERT INTO points VALUES (1, 0, 1, 0), (2, 0, 1, 0);"
        "INSERT INTO detector_state VALUES (1, 0, x'00'), (2, 0, x'00');"
        "INSERT INTO incomplete (run_id, step, kind, layer, have, want, recorded_at) VALUES "
        "(1, 0, 'attention', 0, 1, 2, 0), (2, 0, 'attention', 0, 1, 2, 0);"
        "INSERT INTO alerts (id, run_id, rule, alert_key, dedup_key, state, severity, family, "
        "attribution, last_step, created_at, updated_at) VALUES "
        "(1, 1, 'loss', 'k1', 'd1', 2, 'critical', 'f', 'a', 0, 0, 0), "
        "(2, 2, 'loss', 'k2', 'd2', 2, 'critical', 'f', 'a', 0, 0, 0);"
        "INSERT INTO alert_events (id, alert_id, change, from_state, to_state, step, at, "
        "attribution, evidence_json) VALUES (1, 1, 'to_firing', 1, 2, 0, 0, 'a', '{}'), "
        "(2, 2, 'to_firing', 1, 2, 0, 0, 'a', '{}');"
        "INSERT INTO outbox (id, alert_id, event_id, target, kind, severity, attribution, "
        "created_at, updated_at) VALUES (1, 2, 2, 't', 1, 'critical', 'a', 0, 0), "
        "(2, 1, 1, 't', 1, 'critical', 'a', 0, 0);"
        "INSERT INTO advice (id, run_id, alert_id, event_id, action, rule, label, severity, "
        "step, created_at) VALUES (1, 1, 1, 1, 1, 'loss', 'a', 'critical', 0, 0), "
        "(2, 2, 2, 2, 1, 'loss', 'a', 'critical', 0, 0);"
        "INSERT INTO advice_deliveries (advice_id, stream_id) VALUES (1, 1), (2, 2);"
        "INSERT INTO attempts VALUES (1, 0, NULL, 0, NULL), (2, 0, NULL, 0, NULL);"
        "INSERT INTO spool_frames VALUES (1, 0, 1, 1, 1, 0), (1, 64, 2, 2, 1, 0);"
        "INSERT INTO remote_write_cursor VALUES ('t', 0, 1, 5, 0), ('t', 0, 2, 5, 0);";
    char *msg = NULL;
    cr_assert_eq(sqlite3_exec(db, fill, NULL, NULL, &msg), SQLITE_OK, "%s", msg);
    cr_assert_eq(sqlite3_exec(db, "BEGIN", NULL, NULL, NULL), SQLITE_OK);
    cr_assert_eq(store_run_delete_rows(db, 1), SQLITE_OK, "%s", sqlite3_errmsg(db));
    cr_assert_eq(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    /* Every table of the schema: one row of run 2 left, none of run 1. */
    sqlite3_stmt *t;
    cr_assert_eq(sqlite3_prepare_v2(db,
                                    "SELECT name FROM sqlite_master WHERE type = 'table' AND "
                                    "name NOT IN ('spool', 'spool_log', 'silences', 'id_floor')",
                                    -1, &t, NULL),
                 SQLITE_OK);
    size_t tables = 0;
    while (sqlite3_step(t) == SQLITE_ROW) {
        char q[128];
        snprintf(q, sizeof(q), "SELECT count(*) FROM %s", (const char *)sqlite3_column_text(t, 0));
        cr_expect_eq(q1(db, q), 1, "%s", q);
        tables++;
    }
    sqlite3_finalize(t);
    cr_expect_eq(tables, 15, "tables holding run rows: a new one needs a DELETE in store_runs.c");
    cr_expect_eq(q1(db, "SELECT id FROM runs"), 2);
    cr_expect_eq(q1(db, "SELECT id FROM outbox"), 1, "run b's page stays");
    cr_expect_eq(q1(db, "SELECT id FROM id_floor WHERE tbl = 'outbox'"), 2,
                 "the deleted highest outbox id is a floor");
    sqlite3_close(db);
    tmpdb_remove(&f.db);
}

/* Replays the spool log the way stage_load does: the end the database
 * recorded, records of steps > skip_to only. Returns the steps fed. */
struct replayed {
    uint64_t steps[16];
    size_t n;
    int64_t skip_to;
};

static int want_after(void *ctx, const struct spool_rec *r)
{
    return (int64_t)r->step > ((struct replayed *)ctx)->skip_to;
}

static int note_step(void *ctx, const struct spool_rec *r, const uint8_t *body)
{
    struct replayed *rp = ctx;
    cr_assert_lt(rp->n, 16);
    cr_expect_eq(body[0], (uint8_t)r->seq, "body of seq %llu", (unsigned long long)r->seq);
    rp->steps[rp->n++] = r->step;
    return 0;
}

static struct replayed replay(struct fixture *f, int64_t skip_to)
{
    sqlite3 *db = ro(f);
    struct spool_pos head = {(uint64_t)q1(db, "SELECT segment FROM spool_log"),
                             (uint64_t)q1(db, "SELECT byte_offset FROM spool_log")};
    sqlite3_close(db);
    char dir[256];
    struct fs_err err = {0};
    spool_dir_of(f->db.path, dir, sizeof(dir));
    struct replayed rp = {.skip_to = skip_to};
    struct spool_replay_ops ops = {.want = want_after, .feed = note_step, .ctx = &rp};
    struct spool_replay_stats st;
    cr_assert_eq(spool_replay(dir, &head, &ops, &st, &err), 0, "%s", err.msg);
    cr_expect_eq(st.unreadable, 0);
    return rp;
}

/* The monitors are done with run_id's steps <= step (STORE_ITEM_SPOOL_DONE). */
static struct store_item *spool_done(int64_t run_id, uint64_t step)
{
    struct store_item *it = store_item_new(STORE_ITEM_SPOOL_DONE);
    cr_assert_not_null(it);
    it->spool_done.run_id = run_id;
    it->spool_done.step = step;
    return it;
}

static struct store_item *sketch_report(uint64_t conn, const struct store_result *h, uint64_t seq,
                                        uint64_t step, size_t len)
{
    struct store_item *it = report(conn, h, seq, step, 1.0);
    it->report.sketch_len = len;
    it->report.sketch_body = calloc(1, len);
    it->report.sketch_body[0] = (uint8_t)seq;
    return it;
}

/* The API deletes a run (STORE_ITEM_RUN): its rows go, its Hellos are
 * refused while it is marked, a Hello after that starts it anew with a new
 * id, and its spooled frames go with it. A run deleted while the daemon was
 * down (its rows gone, its records still in a segment) loses them at the
 * next start. */
Test(store, deleted_run_takes_its_spool_records)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "gone", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    for (uint64_t seq = 1; seq <= 3; seq++)
        submit_ok(f.s, sketch_report(1, &h, seq, seq * 10, 100));
    store_flush(f.s);
    cr_assert_gt(store_spool_bytes(f.s), 0);
    struct store_item *it = store_item_new(STORE_ITEM_RUN);
    it->run.op = STORE_RUN_DELETE;
    snprintf(it->run.run, sizeof(it->run.run), "gone");
    it->run.waiter = store_waiter_new();
    struct store_waiter *w = store_waiter_ref(it->run.waiter);
    submit_ok(f.s, it);
    int64_t id = 0;
    cr_expect_eq(store_waiter_wait(w, 10000, &id), 0);
    cr_expect_eq(id, h.run_id);
    store_waiter_put(w);
    sqlite3 *db = ro(&f);
    for (int tries = 0; tries < 1000 && q1(db, "SELECT count(*) FROM runs") != 0; tries++)
        usleep(10000);
    cr_expect_eq(q1(db, "SELECT count(*) FROM runs"), 0);
    cr_expect_eq(q1(db, "SELECT count(*) FROM reports"), 0);
    sqlite3_close(db);
    for (int tries = 0; tries < 1000 && store_spool_bytes(f.s) != 0; tries++) {
        store_flush(f.s);
        usleep(10000);
    }
    cr_expect_eq(store_spool_bytes(f.s), 0, "the deleted run's records are released");
    submit_ok(f.s, hello(2, "gone", 0, 0));
    struct store_result again = hello_done(f.s, 2);
    cr_expect_eq(again.error_code, 0);
    cr_expect_gt(again.run_id, h.run_id, "a deleted run's id is not handed out again");

    /* Deleted while down: rows gone, records left; the next open drops them. */
    for (uint64_t seq = 1; seq <= 3; seq++)
        submit_ok(f.s, sketch_report(2, &again, seq, seq * 10, 100));
    store_flush(f.s);
    cr_assert_gt(store_spool_bytes(f.s), 0);
    store_close(f.s);
    f.s = NULL;
    cr_assert_eq(sqlite3_open(f.db.path, &db), SQLITE_OK);
    cr_assert_eq(sqlite3_exec(db, "PRAGMA foreign_keys = ON; BEGIN", NULL, NULL, NULL), SQLITE_OK);
    cr_assert_eq(store_run_delete_rows(db, again.run_id), SQLITE_OK);
    cr_assert_eq(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    fx_open(&f, &o);
    cr_expect_eq(store_spool_bytes(f.s), 0, "records of a run deleted while down are released");
    fx_fini(&f);
}

/* Frames go to the spool log beside the database, not into it; the
 * database records where the log ends, where each acked frame lies
 * (spool_frames, until its step is evaluated) and how far the run is
 * evaluated; a segment goes once all its steps are evaluated; a restart
 * replays what is left up to the recorded end. */
Test(store, spool_log_holds_frames_until_evaluated)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "spool", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    for (uint64_t seq = 1; seq <= 3; seq++)
        submit_ok(f.s, sketch_report(1, &h, seq, seq * 10, 100));
    store_flush(f.s);
    const uint64_t rec = SPOOL_HEADER_BYTES + 100;
    cr_expect_eq(store_spool_bytes(f.s), 3 * rec);
    cr_expect_eq(atomic_load(&f.stats.spool_bytes), 3 * rec);
    sqlite3 *db = ro(&f);
    cr_expect_eq(q1(db, "SELECT count(*) FROM spool"), 0, "no frames in the database");
    cr_expect_eq(q1(db, "SELECT byte_offset FROM spool_log"), (int64_t)(3 * rec));
    cr_expect_eq(q1(db, "SELECT count(*) FROM spool_frames"), 3);
    cr_expect_eq(q1(db, "SELECT byte_offset FROM spool_frames WHERE seq = 3"), (int64_t)(2 * rec));
    cr_expect_eq(q1(db, "SELECT step FROM spool_frames WHERE byte_offset = 0"), 10);
    cr_expect_eq(q1(db, "SELECT count(*) FROM pragma_foreign_key_list('spool_frames') "
                        "WHERE \"table\" = 'runs' AND on_delete = 'CASCADE'"),
                 1, "a deleted run takes its rows along");
    sqlite3_close(db);
    struct replayed rp = replay(&f, -1);
    cr_expect_eq(rp.n, 3);
    cr_expect_eq(rp.steps[0] * 100 + rp.steps[2], 10 * 100 + 30, "oldest first");

    /* Steps <= 20 evaluated: recorded; the one segment still holds step 30. */
    submit_ok(f.s, spool_done(h.run_id, 20));
    store_flush(f.s);
    db = ro(&f);
    cr_expect_eq(q1(db, "SELECT spool_done_step FROM runs"), 20);
    cr_expect_eq(q1(db, "SELECT count(*) FROM spool_frames"), 1, "rows of evaluated steps go");
    cr_expect_eq(q1(db, "SELECT step FROM spool_frames"), 30);
    sqlite3_close(db);
    cr_expect_eq(store_spool_bytes(f.s), 3 * rec);

    /* A restart keeps it, and replays only the step not evaluated. */
    store_close(f.s);
    fx_open(&f, &o);
    cr_expect_eq(store_spool_bytes(f.s), 3 * rec);
    rp = replay(&f, 20);
    cr_expect_eq(rp.n, 1);
    cr_expect_eq(rp.steps[0], 30);

    /* Everything evaluated: the segment is deleted. */
    submit_ok(f.s, spool_done(h.run_id, 30));
    store_flush(f.s);
    cr_expect_eq(store_spool_bytes(f.s), 0);
    cr_expect_eq(replay(&f, -1).n, 0);
    fx_fini(&f);
}

/* A rewind to step R makes the run's later steps unevaluated again
 * (spool.h, "Release"): the Hello that starts it lowers the evaluated step
 * to R; rows of the old attempt the monitor stage queued before it knew
 * raise it again, and the stage's own rewind item (has_spool_rewind) lowers
 * it once more. The new attempt's frames of steps the old one had evaluated
 * stay in the log, and a start replays them. */
Test(store, a_rewind_lowers_the_evaluated_step)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "rw", 0, 0));
    struct store_result h0 = hello_done(f.s, 1);
    for (uint64_t seq = 1; seq <= 3; seq++)
        submit_ok(f.s, sketch_report(1, &h0, seq, seq * 10, 100));
    submit_ok(f.s, spool_done(h0.run_id, 30));
    store_flush(f.s);
    sqlite3 *db = ro(&f);
    cr_assert_eq(q1(db, "SELECT spool_done_step FROM runs"), 30);
    sqlite3_close(db);

    struct store_item *it = hello(2, "rw", 1, 0);
    it->hello.has_resume_step = 1;
    it->hello.resume_step = 10;
    submit_ok(f.s, it);
    struct store_result h1 = hello_done(f.s, 2);
    cr_assert_eq(h1.error_code, 0, "%s", h1.message);
    db = ro(&f);
    cr_expect_eq(q1(db, "SELECT spool_done_step FROM runs"), 10, "the Hello lowers it");
    sqlite3_close(db);

    /* A row of the old attempt queued before the stage knew, then the
     * stage's rewind item. */
    submit_ok(f.s, spool_done(h0.run_id, 30));
    it = store_item_new(STORE_ITEM_MONITOR);
    it->monitor.run_id = h0.run_id;
    it->monitor.time = 1.0;
    it->monitor.has_spool_rewind = 1;
    it->monitor.spool_rewind_step = 10;
    submit_ok(f.s, it);
    for (uint64_t seq = 1; seq <= 2; seq++) /* attempt 1's steps 20 and 30 */
        submit_ok(f.s, sketch_report(2, &h1, seq, 10 + seq * 10, 100));
    store_flush(f.s);
    db = ro(&f);
    cr_expect_eq(q1(db, "SELECT spool_done_step FROM runs"), 10, "lowered again after the raise");
    cr_expect_eq(q1(db, "SELECT count(*) FROM spool_frames WHERE stream_id = "
                        "(SELECT max(id) FROM streams)"),
                 2, "the new attempt's frames are recorded");
    sqlite3_close(db);
    cr_expect_gt(store_spool_bytes(f.s), 0, "the new attempt's records are kept");

    /* A start replays them (the old attempt's records went when it was
     * evaluated to 30, before the rewind). */
    store_close(f.s);
    fx_open(&f, &o);
    db = ro(&f);
    int64_t at = q1(db, "SELECT spool_done_step FROM runs");
    sqlite3_close(db);
    cr_expect_eq(at, 10);
    struct replayed rp = replay(&f, at);
    cr_expect_eq(rp.n, 2, "the new attempt's steps 20 and 30 replayed");
    cr_expect_eq(rp.steps[0] * 100 + rp.steps[1], 20 * 100 + 30);
    fx_fini(&f);
}

/* A database written by an older foreshockd keeps frames in the spool
 * table: the first open moves them into the log, in order, and the
 * evaluated step says which of them a replay skips. */
Test(store, legacy_spool_rows_move_into_the_log)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "old", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    store_close(f.s);
    sqlite3 *db;
    cr_assert_eq(sqlite3_open(f.db.path, &db), SQLITE_OK);
    for (int seq = 1; seq <= 3; seq++) {
        char sql[256];
        snprintf(sql, sizeof(sql),
                 "INSERT INTO spool (run_id, stream_id, seq, step, bytes, body) VALUES "
                 "(%lld, %lld, %d, %d, 8, x'%02x00000000000000')",
                 (long long)h.run_id, (long long)h.stream_id, seq, seq * 10, seq);
        cr_assert_eq(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK, "%s", sqlite3_errmsg(db));
    }
    /* ... as schema version 7 (before the spool log, spool_frames, the
     * run lifecycle, remote write and events' severities) had them. */
    cr_assert_eq(sqlite3_exec(db,
                              "ALTER TABLE alert_events DROP COLUMN severity; "
                              "DROP TABLE remote_write_cursor; "
                              "DROP INDEX runs_live; DROP TABLE id_floor; "
                              "ALTER TABLE runs DROP COLUMN ended_at; "
                              "ALTER TABLE runs DROP COLUMN owner; "
                              "ALTER TABLE runs DROP COLUMN deleting; "
                              "DROP TABLE spool_frames; "
                              "DROP TABLE spool_log; ALTER TABLE runs DROP COLUMN "
                              "spool_done_step; PRAGMA user_version = 7",
                              NULL, NULL, NULL),
                 SQLITE_OK, "%s", sqlite3_errmsg(db));
    sqlite3_close(db);
    fx_open(&f, &o);
    db = ro(&f);
    cr_expect_eq(q1(db, "SELECT count(*) FROM spool"), 0);
    cr_expect_eq(q1(db, "SELECT spool_done_step FROM runs"), 9, "evaluated below the first row");
    sqlite3_close(db);
    struct replayed rp = replay(&f, 9);
    cr_expect_eq(rp.n, 3);
    cr_expect_eq(rp.steps[0] * 10000 + rp.steps[1] * 100 + rp.steps[2], 102030);
    fx_fini(&f);
}

/* STORE_ITEM_MONITOR: points, detector state, alert upsert + event,
 * incomplete rows and the spool deletion in one item; a later item updates
 * the same alert row (identity by alert_key) and keeps the history. */
static struct store_item *monitor_item(int64_t run_id, int state, int with_event, uint64_t step)
{
    struct store_item *it = store_item_new(STORE_ITEM_MONITOR);
    struct store_monitor *m = &it->monitor;
    m->run_id = run_id;
    m->time = 5000.0;
    m->n_points = 2;
    m->points = calloc(2, sizeof(*m->points));
    m->points[0].key = (struct store_series_key){
        .name = "qk.d2.erank.min", .layer = 1, .head = -1, .window = 10, .rank = -1};
    m->points[0].step = step;
    m->points[0].value = 1.25;
    m->points[1].key = m->points[0].key;
    snprintf(m->points[1].key.name, sizeof(m->points[1].key.name), "qk.d2.fro.max");
    m->points[1].step = step;
    m->points[1].value = NAN; /* absent */
    m->n_states = 1;
    m->states = calloc(1, sizeof(*m->states));
    m->blobs = malloc(3);
    memcpy(m->blobs, "abc", 3);
    m->states[0] = (struct store_detector_row){
        .key = m->points[0].key, .step = step, .len = 3, .blob = m->blobs};
    m->n_alerts = 1;
    m->alerts = calloc(1, sizeof(*m->alerts));
    struct store_alert_row *a = &m->alerts[0];
    a->series = m->points[0].key;
    snprintf(a->rule, sizeof(a->rule), "qk.d2.erank");
    snprintf(a->alert_key, sizeof(a->alert_key), "run=x,rule=qk.d2.erank,layer=1");
    snprintf(a->dedup_key, sizeof(a->dedup_key), "fs-0123456789abcdef");
    a->state = state;
    a->severity = "warning";
    a->family = "attention_d2";
    a->attribution = "attention-numerics";
    a->value = 1.25;
    a->median = 7.5;
    a->mad = 0.5;
    a->z = NAN;
    a->first_breach_step = 30;
    a->fired_step = state == 2 ? 32 : -1;
    a->resolved_step = -1;
    a->last_step = (int64_t)step;
    a->incidents = state == 2;
    a->blob_len = 4;
    memcpy(a->blob, "FSAS", 4);
    a->has_event = with_event;
    a->change = "to_firing";
    a->from_state = 1;
    a->to_state = 2;
    a->event_step = (int64_t)step;
    a->evidence_json = strdup("{\"value\":1.25}");
    m->n_incomplete = 1;
    m->incomplete = calloc(1, sizeof(*m->incomplete));
    m->incomplete[0] = (struct store_incomplete_row){.kind = "router_tokens",
                                                     .step = step,
                                                     .layer = 2,
                                                     .head = -1,
                                                     .window = 0,
                                                     .have = 3,
                                                     .want = 4};
    m->has_spool_done = 1;
    m->spool_done_step = 20;
    return it;
}

Test(store, monitor_item_commits_rows_and_the_evaluated_step)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "mon", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    for (uint64_t seq = 1; seq <= 3; seq++)
        submit_ok(f.s, sketch_report(1, &h, seq, seq * 10, 100));
    submit_ok(f.s, monitor_item(h.run_id, 1, 1, 32));
    store_flush(f.s);
    sqlite3 *db = ro(&f);
    cr_expect_eq(q1(db, "SELECT spool_done_step FROM runs"), 20, "steps <= 20 evaluated");
    cr_expect_eq(replay(&f, 20).n, 1, "step 30 still to replay");
    cr_expect_eq(q1(db, "SELECT count(*) FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'qk.d2.erank.min' AND s.layer = 1 AND s.head = -1 "
                        "AND s.\"window\" = 10 AND s.rank = -1 AND p.step = 32"),
                 1);
    cr_expect_eq(q1(db, "SELECT count(*) FROM points p JOIN series s ON s.id = p.series_id "
                        "WHERE s.name = 'qk.d2.fro.max' AND p.value IS NULL"),
                 1, "NaN is stored as an absent point");
    cr_expect_eq(q1(db, "SELECT d.step FROM detector_state d JOIN series s ON s.id = "
                        "d.series_id WHERE s.name = 'qk.d2.erank.min'"),
                 32);
    cr_expect_eq(q1(db, "SELECT length(state) FROM detector_state"), 3);
    cr_expect_eq(q1(db, "SELECT state FROM alerts"), 1);
    cr_expect_eq(q1(db, "SELECT a.series_id = s.id FROM alerts a JOIN series s ON "
                        "s.name = 'qk.d2.erank.min'"),
                 1);
    cr_expect_eq(q1(db, "SELECT z IS NULL AND fired_step IS NULL AND first_breach_step = 30 "
                        "FROM alerts"),
                 1);
    cr_expect_eq(q1(db,
                    "SELECT count(*) FROM alert_events WHERE change = 'to_firing' AND "
                    "attribution = 'attention-numerics' AND evidence_json = '{\"value\":1.25}'"),
                 1);
    cr_expect_eq(q1(db, "SELECT have * 10 + want FROM incomplete WHERE kind = 'router_tokens' "
                        "AND layer = 2 AND step = 32"),
                 34);
    /* The same identity again, firing, without a transition: one row, one event. */
    submit_ok(f.s, monitor_item(h.run_id, 2, 0, 33));
    store_flush(f.s);
    cr_expect_eq(q1(db, "SELECT count(*) FROM alerts"), 1);
    cr_expect_eq(q1(db, "SELECT state * 100 + fired_step FROM alerts"), 232);
    cr_expect_eq(q1(db, "SELECT last_step FROM alerts"), 33);
    cr_expect_eq(q1(db, "SELECT count(*) FROM alert_events"), 1);
    cr_expect_eq(q1(db, "SELECT count(*) FROM incomplete"), 2);
    sqlite3_close(db);
    fx_fini(&f);
}

static void count_notify(void *ctx)
{
    atomic_fetch_add((atomic_int *)ctx, 1);
}

/* Another connection holds the write lock: the writer cannot commit, so
 * nothing is acked, the queue fills and submit pushes back; once the lock
 * goes, everything commits, is acked, and RESUME is announced. */
Test(store, backpressure_and_no_ack_before_commit)
{
    struct fixture f;
    fx_init(&f);
    atomic_int notified = 0;
    struct store_opts o = opts_for(&f);
    o.queue_max_items = 4;
    o.batch_max_items = 4;
    o.notify = count_notify;
    o.notify_ctx = &notified;
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "bp", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    cr_expect_gt(atomic_load(&notified), 0);

    sqlite3 *blocker;
    cr_assert_eq(sqlite3_open(f.db.path, &blocker), SQLITE_OK);
    cr_assert_eq(sqlite3_exec(blocker, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
    for (uint64_t seq = 1; seq <= 4; seq++)
        submit_ok(f.s, report(1, &h, seq, seq, 1.0));
    struct store_item *extra = report(1, &h, 5, 5, 1.0);
    cr_expect_eq(store_submit(f.s, extra), -EAGAIN);
    struct store_result *r;
    size_t n = store_take_results(f.s, &r);
    uint64_t items;
    cr_expect_eq(acked(r, n, 1, &items), 0, "acked before commit");
    free(r);
    cr_expect_eq(atomic_load(&f.stats.writer_queue_items), 4);

    cr_assert_eq(sqlite3_exec(blocker, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(blocker);
    n = results(f.s, &r);
    cr_expect_eq(acked(r, n, 1, &items), 4);
    int resumed = 0;
    for (size_t i = 0; i < n; i++)
        resumed |= r[i].kind == STORE_RESULT_RESUME;
    cr_expect(resumed, "no RESUME after draining");
    free(r);
    submit_ok(f.s, extra);
    n = results(f.s, &r);
    cr_expect_eq(acked(r, n, 1, &items), 5);
    free(r);
    cr_expect_eq(atomic_load(&f.stats.storage_failing), 0);
    fx_fini(&f);
}

/* Fair admission: while the queue is full and the writer busy, a Hello is
 * still accepted, and it is written before the reports queued ahead of it
 * (its result comes before the Ack of the last of them). */
Test(store, hello_is_accepted_when_full_and_written_first)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    o.queue_max_items = 6;
    o.batch_max_items = 2;
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "fair", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    sqlite3 *blocker;
    cr_assert_eq(sqlite3_open(f.db.path, &blocker), SQLITE_OK);
    cr_assert_eq(sqlite3_exec(blocker, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
    for (uint64_t seq = 1; seq <= 6; seq++)
        submit_ok(f.s, report(1, &h, seq, seq, 1.0));
    struct store_item *extra = report(1, &h, 7, 7, 1.0);
    cr_expect_eq(store_submit(f.s, extra), -EAGAIN, "reports are refused");
    store_item_free(extra);
    struct store_item *newcomer = hello(2, "newcomer", 0, 0);
    newcomer->hello.stream_key = store_stream_key("newcomer", 0, 0);
    submit_ok(f.s, newcomer);
    cr_assert_eq(sqlite3_exec(blocker, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(blocker);
    struct store_result *r;
    size_t n = results(f.s, &r);
    long hello_at = -1, last_ack_at = -1;
    for (size_t i = 0; i < n; i++) {
        if (r[i].kind == STORE_RESULT_HELLO && r[i].conn_id == 2)
            hello_at = (long)i;
        if (r[i].kind == STORE_RESULT_ACK && r[i].conn_id == 1 && r[i].seq == 6)
            last_ack_at = (long)i;
    }
    cr_assert_geq(hello_at, 0, "no Welcome result");
    cr_assert_geq(last_ack_at, 0, "report 6 not acked");
    cr_expect_eq(r[hello_at].error_code, 0);
    cr_expect_lt(hello_at, last_ack_at, "the Hello waited for the queued reports");
    free(r);
    fx_fini(&f);
}

Test(store, bad_item_is_refused_alone)
{
    struct fixture f;
    fx_init(&f);
    struct store_opts o = opts_for(&f);
    fx_open(&f, &o);
    submit_ok(f.s, hello(1, "ok", 0, 0));
    struct store_result h = hello_done(f.s, 1);
    /* A run id that does not exist violates a foreign key (its series). */
    struct store_result bogus = h;
    bogus.run_id = 999999;
    /* A stream that does not exist (its run was deleted) is refused by name. */
    struct store_result gone = h;
    gone.stream_id = 999999;
    submit_ok(f.s, report(1, &h, 1, 1, 1.0));
    submit_ok(f.s, report(2, &bogus, 7, 1, 1.0)); /* a seq of its own: not a resend */
    submit_ok(f.s, report(3, &gone, 1, 1, 1.0));
    submit_ok(f.s, report(1, &h, 2, 2, 1.0));
    struct store_result *r;
    size_t n = results(f.s, &r);
    uint64_t items;
    cr_expect_eq(acked(r, n, 1, &items), 2);
    int refused = 0, deleted = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[i].conn_id == 2 && r[i].error_code == FORESHOCK__ERROR_CODE__ERROR_INTERNAL)
            refused++;
        if (r[i].conn_id == 3 && r[i].error_code == FORESHOCK__ERROR_CODE__ERROR_LIMIT &&
            strstr(r[i].message, "run deleted"))
            deleted++;
    }
    cr_expect_eq(refused, 1);
    cr_expect_eq(deleted, 1);
    free(r);
    sqlite3 *db = ro(&f);
    cr_expect_eq(q1(db, "SELECT reports FROM runs"), 2);
    sqlite3_close(db);
    fx_fini(&f);
}
