/* The outbox side of the writer (store.c): rows inserted in the
 * transition's transaction, one per target, announced after COMMIT; no rows
 * without a paging transition; STORE_ITEM_OUTBOX outcomes update them. And
 * the [target "NAME"] config section (pager.c). */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fstest.h"
#include "pager.h"
#include "store.h"

struct fixture {
    struct tmpdb db;
    struct fs_stats stats;
    struct store *s;
};

static void fx_open(struct fixture *f)
{
    memset(f, 0, sizeof(*f));
    tmpdb_make(&f->db, "pager");
    struct store_opts o = {.max_runs = 10,
                           .queue_max_items = 100,
                           .queue_max_bytes = 1 << 24,
                           .batch_max_items = 16,
                           .stats = &f->stats};
    struct fs_err err = {0};
    cr_assert_eq(store_open(f->db.path, &o, &f->s, &err), 0, "%s", err.msg);
}

static void fx_fini(struct fixture *f)
{
    store_close(f->s);
    tmpdb_remove(&f->db);
}

static int64_t run_id(struct fixture *f)
{
    struct store_item *it = store_item_new(STORE_ITEM_HELLO);
    it->conn_id = 1;
    snprintf(it->hello.run, sizeof(it->hello.run), "r1");
    it->hello.world_size = 1;
    cr_assert_eq(store_submit(f->s, it), 0);
    store_flush(f->s);
    struct store_result *r;
    size_t n = store_take_results(f->s, &r);
    cr_assert_eq(n, 1);
    int64_t id = r[0].run_id;
    free(r);
    return id;
}

/* One alert row; change NULL = no transition. */
static struct store_item *alert_item(int64_t run, int to_state, const char *change)
{
    struct store_item *it = store_item_new(STORE_ITEM_MONITOR);
    struct store_monitor *m = &it->monitor;
    m->run_id = run;
    m->time = 100;
    m->n_alerts = 1;
    m->alerts = calloc(1, sizeof(*m->alerts));
    struct store_alert_row *a = &m->alerts[0];
    a->series =
        (struct store_series_key){.name = "loss", .layer = -1, .head = -1, .window = 0, .rank = 0};
    snprintf(a->rule, sizeof(a->rule), "loss");
    snprintf(a->alert_key, sizeof(a->alert_key), "run=r1,rule=loss,rank=0");
    snprintf(a->dedup_key, sizeof(a->dedup_key), "fs-00000000000000aa");
    a->state = to_state;
    a->severity = "critical";
    a->family = "scalar_loss";
    a->attribution = "non-finite";
    a->value = a->median = a->mad = a->z = NAN;
    a->first_breach_step = a->fired_step = a->resolved_step = -1;
    a->last_step = 5;
    a->blob_len = 1;
    a->has_event = change != NULL;
    a->change = change;
    a->from_state = 1;
    a->to_state = to_state;
    a->event_step = 5;
    a->evidence_json = strdup("{}");
    return it;
}

struct announced {
    atomic_llong max;
    atomic_int calls;
};

static void on_announce(void *ctx, int64_t max_id)
{
    struct announced *a = ctx;
    atomic_store(&a->max, max_id);
    atomic_fetch_add(&a->calls, 1);
}

Test(pager_store, outbox_rows_per_target_with_the_transition)
{
    struct fixture f;
    fx_open(&f);
    struct announced an = {0};
    const char *names[] = {"am", "pd"};
    store_set_pager(f.s, names, 2, on_announce, &an);
    int64_t run = run_id(&f);
    struct {
        int to_state;
        const char *change;
        int64_t rows_after; /* outbox rows in total */
    } steps[] = {
        {1, "to_pending", 0},  /* not paged */
        {2, "to_firing", 2},   /* a trigger per target */
        {2, NULL, 2},          /* no transition */
        {3, "to_resolved", 4}, /* a resolve per target */
        {0, "to_inactive", 4},
    };
    sqlite3 *db;
    struct fs_err err = {0};
    cr_assert_eq(store_open_readonly(f.db.path, &db, &err), 0, "%s", err.msg);
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        int calls = atomic_load(&an.calls);
        cr_assert_eq(store_submit(f.s, alert_item(run, steps[i].to_state, steps[i].change)), 0);
        store_flush(f.s);
        cr_expect_eq(q1(db, "SELECT count(*) FROM outbox"), steps[i].rows_after, "step %zu", i);
        int grew = i > 0 && steps[i].rows_after > steps[i - 1].rows_after;
        cr_expect_eq(atomic_load(&an.calls), calls + grew, "step %zu: announce calls", i);
        if (grew)
            cr_expect_eq(atomic_load(&an.max), q1(db, "SELECT max(id) FROM outbox"));
    }
    cr_expect_eq(q1(db, "SELECT count(*) FROM outbox o JOIN alert_events e ON e.id = o.event_id "
                        "WHERE (o.kind = 1 AND e.change = 'to_firing') OR "
                        "(o.kind = 2 AND e.change = 'to_resolved')"),
                 4, "rows name their transition");
    cr_expect_eq(q1(db, "SELECT count(*) FROM outbox WHERE state = 0 AND attempts = 0 AND "
                        "severity = 'critical' AND attribution = 'non-finite' AND "
                        "target IN ('am', 'pd')"),
                 4);

    /* Outcomes through the writer. */
    struct store_item *it = store_item_new(STORE_ITEM_OUTBOX);
    it->outbox = (struct store_outbox_outcome){.outbox_id = 1,
                                               .state = STORE_OUTBOX_PENDING,
                                               .attempts = 2,
                                               .next_attempt_at = 12345.5,
                                               .http_status = 503};
    snprintf(it->outbox.last_error, sizeof(it->outbox.last_error), "HTTP 503: busy");
    cr_assert_eq(store_submit(f.s, it), 0);
    it = store_item_new(STORE_ITEM_OUTBOX);
    it->outbox = (struct store_outbox_outcome){.outbox_id = 2,
                                               .state = STORE_OUTBOX_DELIVERED,
                                               .next_attempt_at = NAN,
                                               .http_status = 202};
    cr_assert_eq(store_submit(f.s, it), 0);
    store_flush(f.s);
    cr_expect_eq(q1(db, "SELECT state = 0 AND attempts = 2 AND next_attempt_at = 12345.5 AND "
                        "last_status = 503 AND last_error = 'HTTP 503: busy' AND done_at IS NULL "
                        "FROM outbox WHERE id = 1"),
                 1);
    cr_expect_eq(q1(db, "SELECT state = 1 AND next_attempt_at IS NULL AND last_error IS NULL AND "
                        "done_at IS NOT NULL FROM outbox WHERE id = 2"),
                 1);
    sqlite3_close(db);
    fx_fini(&f);
}

Test(pager_store, no_targets_no_rows)
{
    struct fixture f;
    fx_open(&f);
    int64_t run = run_id(&f);
    cr_assert_eq(store_submit(f.s, alert_item(run, 2, "to_firing")), 0);
    store_flush(f.s);
    sqlite3 *db;
    struct fs_err err = {0};
    cr_assert_eq(store_open_readonly(f.db.path, &db, &err), 0, "%s", err.msg);
    cr_expect_eq(q1(db, "SELECT count(*) FROM outbox"), 0);
    cr_expect_eq(q1(db, "SELECT count(*) FROM alert_events"), 1);
    sqlite3_close(db);
    fx_fini(&f);
}

/* [target "NAME"] sections: accepted and refused configurations. */
Test(pager_store, target_config_table)
{
    static const struct {
        const char *text;
        int ok;
        const char *has; /* in the message */
    } cases[] = {
        {"[target \"a\"]\ntype = alertmanager\nurl = http://am:9093\n", 1, NULL},
        {"[target \"p\"]\ntype = pagerduty\nrouting_key = k\n", 1, NULL},
        {"[target \"w\"]\ntype = webhook\nurl = https://h/x\nsecret = s\nmatch = run=~gpt-.*\n"
         "min_severity = critical\ntimeout = 3\n",
         1, NULL},
        {"[target \"w\"]\nurl = http://h/\n", 0, "'type' is required"},
        {"[target \"w\"]\ntype = webhook\n", 0, "'url' is required"},
        {"[target \"w\"]\ntype = webhook\nurl = ftp://h/\n", 0, "http://"},
        {"[target \"w\"]\ntype = webhook\nurl = http://\n", 0, "url"},
        {"[target \"w\"]\ntype = webhook\nurl = https://h:99999/\n", 0, "url"},
        {"[target \"w\"]\ntype = webhook\nurl = http://h/x?k=v\n", 1, NULL},
        {"[target \"a\"]\ntype = alertmanager\nurl = http://am:9093/?x=1\n", 0, "query"},
        {"[target \"a\"]\ntype = alertmanager\nurl = http://am:9093/#f\n", 0, "query"},
        {"[target \"p\"]\ntype = pagerduty\nrouting_key = k\nurl = https://\n", 0, "url"},
        {"[target \"p\"]\ntype = pagerduty\n", 0, "routing_key"},
        {"[target \"a\"]\ntype = alertmanager\nurl = http://h\nsecret = x\n", 0, "webhook targets"},
        {"[target \"w\"]\ntype = webhook\nurl = http://h\nmatch = run=~(\n", 0, "match:"},
        {"[target \"w\"]\ntype = webhook\nurl = http://h\nbackoff_initial = 10\nbackoff_max = 1\n",
         0, "backoff_initial"},
        {"[target \"w\"]\ntype = teams\n", 0, "not one of"},
        {"[target \"w\"]\ntype = webhook\nurl = http://h\nbogus = 1\n", 0, "unknown key"},
        {"[target]\ntype = webhook\n", 0, "needs a name"},
        {"[target \"a b\"]\ntype = webhook\n", 0, "letters"},
        {"[target \"a\"]\ntype = webhook\nurl = http://h\n[target \"a\"]\n", 0, "twice"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct fs_config cfg;
        config_defaults(&cfg);
        static struct pager_config pc;
        memset(&pc, 0, sizeof(pc));
        struct config_section sec;
        pager_target_section(&pc, &sec);
        struct fs_err err = {0};
        int rc = config_parse(cases[i].text, strlen(cases[i].text), "t.conf", &cfg, &sec, 1, &err);
        if (rc == 0)
            rc = pager_config_check(&pc, &err);
        const char *msg = err.msg;
        if (cases[i].ok) {
            cr_expect_eq(rc, 0, "case %zu: %s", i, msg);
            cr_expect_eq(pc.n, 1u, "case %zu", i);
        } else {
            cr_expect_eq(rc, -EINVAL, "case %zu accepted", i);
            cr_expect(strstr(msg, cases[i].has), "case %zu: '%s' lacks '%s'", i, msg, cases[i].has);
        }
    }
}

/* --- retention (store_prune) ------------------------------------------------------------ */

/* A database with the daemon's schema, written directly (no writer). */
static sqlite3 *raw_db(struct fixture *f)
{
    fx_open(f);
    store_close(f->s);
    f->s = NULL;
    sqlite3 *db;
    cr_assert_eq(sqlite3_open(f->db.path, &db), SQLITE_OK);
    return db;
}

static void raw_fini(struct fixture *f, sqlite3 *db)
{
    sqlite3_close(db);
    tmpdb_remove(&f->db);
}

static void outbox_row(sqlite3 *db, int64_t id, int64_t alert, const char *target, int kind,
                       int state, double done_at)
{
    char sql[512];
    char done[32] = "NULL";
    if (!isnan(done_at))
        snprintf(done, sizeof(done), "%.3f", done_at);
    snprintf(sql, sizeof(sql),
             "INSERT INTO outbox (id, alert_id, event_id, target, kind, severity, attribution, "
             "created_at, state, updated_at, done_at) VALUES (%lld, %lld, 1, '%s', %d, "
             "'critical', 'x', 1, %d, 1, %s)",
             (long long)id, (long long)alert, target, kind, state, done);
    db_exec(db, sql);
}

static int64_t ids_left(sqlite3 *db)
{
    /* bit i set: outbox row i is still there */
    sqlite3_stmt *st;
    cr_assert_eq(sqlite3_prepare_v2(db, "SELECT id FROM outbox", -1, &st, NULL), SQLITE_OK);
    int64_t bits = 0;
    while (sqlite3_step(st) == SQLITE_ROW)
        bits |= (int64_t)1 << sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return bits;
}

#define B(i) ((int64_t)1 << (i))

/* What retention deletes and what it must keep. now = 10000, retention
 * 1000: rows finished before 9000 are old. */
Test(pager_store, prune_keeps_what_the_pager_needs)
{
    struct fixture f;
    sqlite3 *db = raw_db(&f);
    static const struct {
        int64_t id, alert;
        const char *target;
        int kind, state;
        double done_at;
        int kept;
        const char *why;
    } rows[] = {
        {1, 1, "t", 1, 1, 100, 0, "old trigger, its resolve done"},
        {2, 1, "t", 2, 1, 101, 0, "old resolve"},
        {3, 2, "t", 1, 1, 100, 1, "trigger of an incident still open"},
        {4, 2, "u", 1, 2, 100, 1, "given-up trigger still open at its target (resolve due)"},
        {5, 3, "t", 1, 4, 100, 0, "skipped trigger"},
        {6, 4, "t", 1, 1, 100, 1, "trigger whose resolve is still pending"},
        {7, 4, "t", 2, 0, NAN, 1, "pending resolve"},
        {8, 5, "t", 1, 1, 9500, 1, "young trigger"},
        {9, 5, "t", 2, 1, 9500, 1, "young resolve"},
        {10, 6, "t", 1, 3, NAN, 1, "held by a silence"},
        {11, 7, "t", 1, 4, 100, 1, "highest id: its id must not be handed out again"},
    };
    int64_t want = 0;
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        outbox_row(db, rows[i].id, rows[i].alert, rows[i].target, rows[i].kind, rows[i].state,
                   rows[i].done_at);
        if (rows[i].kept)
            want |= B(rows[i].id);
    }
    db_exec(db, "INSERT INTO silences (id, matchers_json, starts_at, ends_at, created_by, "
                "comment, created_at, updated_at) VALUES "
                "(1, '[]', 0, 100, 'a', '', 0, 0), (2, '[]', 0, 9500, 'a', '', 0, 0), "
                "(3, '[]', 0, 20000, 'a', '', 0, 0)");
    struct store_prune_counts c;
    cr_assert_eq(store_prune(db, 10000, 1000, 1000, 100, &c), 0, "%s", sqlite3_errmsg(db));
    cr_expect_eq(c.outbox, 3u);
    cr_expect_eq(c.silences, 1u);
    int64_t got = ids_left(db);
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
        cr_expect_eq((got & B(rows[i].id)) != 0, rows[i].kept, "row %lld (%s)",
                     (long long)rows[i].id, rows[i].why);
    cr_expect_eq(q1(db, "SELECT group_concat(id) FROM silences"), 2, "silence 1 only goes");
    /* Nothing more to do: a second pass deletes nothing. */
    cr_assert_eq(store_prune(db, 10000, 1000, 1000, 100, &c), 0);
    cr_expect_eq(c.outbox + c.silences, 0u);
    /* Retention 0 keeps everything. */
    cr_assert_eq(store_prune(db, 1e9, 0, 0, 100, &c), 0);
    cr_expect_eq(ids_left(db), want);
    raw_fini(&f, db);
}

/* Bounded work per transaction, oldest ids first (a trigger never outlives
 * its resolve, so it never looks like an open incident again). */
Test(pager_store, prune_in_bounded_batches_oldest_first)
{
    struct fixture f;
    sqlite3 *db = raw_db(&f);
    for (int i = 1; i <= 10; i += 2) {
        outbox_row(db, i, i, "t", 1, 1, 100);
        outbox_row(db, i + 1, i, "t", 2, 1, 100);
    }
    outbox_row(db, 11, 99, "t", 1, 0, NAN); /* pending, highest id */
    struct store_prune_counts c;
    int64_t expect_left = B(11);
    for (int i = 10; i >= 1; i--)
        expect_left |= B(i);
    static const unsigned want[] = {3, 3, 3, 1, 0};
    for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++) {
        cr_assert_eq(store_prune(db, 10000, 1000, 0, 3, &c), 0);
        cr_expect_eq(c.outbox, want[k], "pass %zu", k);
        for (unsigned j = 0; j < c.outbox; j++) {
            /* the lowest remaining id went */
            int64_t low = expect_left & -expect_left;
            expect_left &= ~low;
        }
        cr_expect_eq(ids_left(db), expect_left, "pass %zu", k);
    }
    cr_expect_eq(ids_left(db), B(11));
    raw_fini(&f, db);
}

/* The writer runs retention by itself (outbox_retention_s, prune_interval_s). */
Test(pager_store, writer_prunes_periodically)
{
    struct fixture f;
    memset(&f, 0, sizeof(f));
    tmpdb_make(&f.db, "pager");
    struct store_opts o = {.max_runs = 10,
                           .queue_max_items = 100,
                           .queue_max_bytes = 1 << 24,
                           .batch_max_items = 16,
                           .stats = &f.stats,
                           .outbox_retention_s = 0.2,
                           .silence_retention_s = 0.2,
                           .prune_interval_s = 0.05};
    struct fs_err err = {0};
    cr_assert_eq(store_open(f.db.path, &o, &f.s, &err), 0, "%s", err.msg);
    const char *names[] = {"t"};
    store_set_pager(f.s, names, 1, NULL, NULL);
    int64_t run = run_id(&f);
    cr_assert_eq(store_submit(f.s, alert_item(run, 2, "to_firing")), 0);
    cr_assert_eq(store_submit(f.s, alert_item(run, 3, "to_resolved")), 0);
    cr_assert_eq(store_submit(f.s, alert_item(run, 2, "to_firing")), 0);
    for (int64_t id = 1; id <= 2; id++) {
        struct store_item *it = store_item_new(STORE_ITEM_OUTBOX);
        it->outbox = (struct store_outbox_outcome){
            .outbox_id = id, .state = STORE_OUTBOX_DELIVERED, .next_attempt_at = NAN};
        cr_assert_eq(store_submit(f.s, it), 0);
    }
    struct store_item *it = store_item_new(STORE_ITEM_SILENCE);
    it->silence.op = STORE_SILENCE_INSERT;
    it->silence.matchers_json = strdup("[{\"name\":\"run\",\"value\":\"r\"}]");
    it->silence.created_by = strdup("me");
    it->silence.comment = strdup("");
    it->silence.starts_at = 1;
    it->silence.ends_at = 2;
    cr_assert_eq(store_submit(f.s, it), 0);
    store_flush(f.s);
    sqlite3 *db;
    cr_assert_eq(store_open_readonly(f.db.path, &db, &err), 0, "%s", err.msg);
    int gone = 0;
    for (int i = 0; i < 600 && !gone; i++) { /* a deadline of 30 s, not a timing assertion */
        gone = q1(db, "SELECT count(*) FROM outbox") == 1 &&
               q1(db, "SELECT count(*) FROM silences") == 0;
        if (!gone)
            usleep(50000);
    }
    cr_expect(gone, "retention did not run: %lld outbox rows, %lld silences",
              (long long)q1(db, "SELECT count(*) FROM outbox"),
              (long long)q1(db, "SELECT count(*) FROM silences"));
    cr_expect_eq(q1(db, "SELECT id FROM outbox"), 3, "the pending trigger stays");
    sqlite3_close(db);
    fx_fini(&f);
}
