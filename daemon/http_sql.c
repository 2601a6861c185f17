/* Where SQL lives: with the owner of the connection that runs it, one home
 * per connection, and nowhere else.
 *  - The writer's connection (the writer thread): the store_* files
 *    (store_open.c, store_apply.c, store_series.c, store_silence.c,
 *    store_advice.c, store_attempts.c, ...), helpers in store_stmt.h.
 *  - The HTTP read connections (the API and /metrics): this file.
 *  - The pager's connection: pager_outbox.c.
 *  - A reader with its own connection on its own thread outside the HTTP
 *    server (the remote-write sender): a store_<name>.c file of its own
 *    (store_rw.c), because its library does not link the HTTP server's;
 *    its header says it only reads.
 *
 * This file: the SQL of the HTTP API's prepared statements: every read
 * connection prepares all of them when it opens (http.c, dbconn_open),
 * which also checks that the schema is there. Ids and the shared column
 * lists with their positions are in http_internal.h. And /metrics'
 * queries (metrics.h), prepared per scrape. */

#include "http_internal.h"
#include "metrics.h"

/* Alert listings share their parameters (bound by http_alerts_list):
 *   ?1 run id, ?2 ids below this (keyset, newest first), ?3..?6 one state
 *   per arm (NULL: arm unused), ?7 severity, ?8 attribution, ?9 rule,
 *   ?10 layer, ?11 head, ?12 window, ?13 rank, ?14/?15 updated_at range,
 *   ?16/?17 first_breach_step range, ?18 rows wanted (limit + 1), ?19 an
 *   attempt the alert has a transition in, ?20 the fifth state arm.
 * CROSS JOIN keeps alerts the outer loop, so the index order is the output
 * order and no sort happens. */
#define ALERTS_FROM " FROM alerts a CROSS JOIN runs r ON r.id = a.run_id "
#define ALERTS_POST                                                                                \
    "AND (?7 IS NULL OR a.severity = ?7) AND (?8 IS NULL OR a.attribution = ?8) "                  \
    "AND (?9 IS NULL OR a.rule = ?9) AND (?10 IS NULL OR a.layer = ?10) "                          \
    "AND (?11 IS NULL OR a.head = ?11) AND (?12 IS NULL OR a.\"window\" = ?12) "                   \
    "AND (?13 IS NULL OR a.rank = ?13) "                                                           \
    "AND (?14 IS NULL OR a.updated_at >= ?14) AND (?15 IS NULL OR a.updated_at <= ?15) "           \
    "AND (?16 IS NULL OR a.first_breach_step >= ?16) "                                             \
    "AND (?17 IS NULL OR a.first_breach_step <= ?17) "                                             \
    "AND (?19 IS NULL OR EXISTS (SELECT 1 FROM alert_events e WHERE e.alert_id = a.id "            \
    "AND e.attempt = ?19)) "
#define ALERTS_ORDER "ORDER BY a.id DESC LIMIT ?18"
/* A state filter is a union of states: IN (...) on alerts_by_state would
 * sort every matching row, so each state is its own index range, already
 * in id order, at most ?18 rows, and the arms are merged (MERGE (UNION
 * ALL): each arm sorts at most ?18 rows). */
#define ALERTS_ARM(run, n)                                                                         \
    "SELECT * FROM (SELECT " ALERT_COLUMNS ALERTS_FROM "WHERE " run "a.state = ?" n                \
    " AND a.id < ?2 " ALERTS_POST ALERTS_ORDER ")"
#define ALERTS_ARMS(run)                                                                           \
    ALERTS_ARM(run, "3")                                                                           \
    " UNION ALL " ALERTS_ARM(run, "4") " UNION ALL " ALERTS_ARM(                                   \
        run, "5") " UNION ALL " ALERTS_ARM(run,                                                    \
                                           "6") " UNION ALL " ALERTS_ARM(run,                      \
                                                                         "20") " ORDER BY 1 DESC " \
                                                                               "LIMIT ?18"

static const char *const stmt_sql[STMT__COUNT] = {
    [STMT_BEGIN] = "BEGIN",
    [STMT_COMMIT] = "COMMIT",
    [STMT_ROLLBACK] = "ROLLBACK",
    [STMT_READY] = "SELECT 1 FROM runs LIMIT 1",
    [STMT_RUNS_PAGE] = "SELECT " RUN_COLUMNS " FROM runs r WHERE r.id > ?1 ORDER BY r.id LIMIT ?2",
    [STMT_RUN_BY_NAME] = "SELECT " RUN_COLUMNS " FROM runs r WHERE r.name = ?1",
    [STMT_RUN_STREAMS] = "SELECT attempt, rank, last_seq, reports, created_at, last_seen_at "
                         "FROM streams WHERE run_id = ?1 ORDER BY attempt, rank LIMIT ?2",
    [STMT_RUN_ID] = "SELECT id FROM runs WHERE name = ?1",
    [STMT_RUN_ATTEMPTS] = "SELECT attempt, resume_step, started_at, rebuilt_at FROM attempts "
                          "WHERE run_id = ?1 ORDER BY attempt LIMIT ?2",
    /* name given: a range scan of series_by_name (run_id, name, rowid),
     * already in id order. */
    [STMT_SERIES_BY_NAME] = "SELECT " SERIES_COLUMNS " FROM series s "
                            "WHERE s.run_id = ?1 AND s.name = ?2 AND s.id > ?3 "
                            "AND (?4 IS NULL OR s.layer = ?4) AND (?5 IS NULL OR s.head = ?5) "
                            "AND (?6 IS NULL OR s.\"window\" = ?6) "
                            "AND (?7 IS NULL OR s.rank = ?7) "
                            "ORDER BY s.id LIMIT ?8",
    /* prefix as a name range [?2, ?2 || 0xFF): 0xFF never occurs in UTF-8, so
     * the range holds exactly the names that start with ?2. */
    [STMT_SERIES_FILTER] = "SELECT " SERIES_COLUMNS " FROM series s "
                           "WHERE s.run_id = ?1 AND s.id > ?3 "
                           "AND (?2 IS NULL OR (s.name >= ?2 AND s.name < ?9)) "
                           "AND (?4 IS NULL OR s.layer = ?4) AND (?5 IS NULL OR s.head = ?5) "
                           "AND (?6 IS NULL OR s.\"window\" = ?6) "
                           "AND (?7 IS NULL OR s.rank = ?7) "
                           "ORDER BY s.id LIMIT ?8",
    [STMT_SERIES_ONE] = "SELECT " SERIES_COLUMNS ", r.name FROM series s "
                        "JOIN runs r ON r.id = s.run_id WHERE s.id = ?1",
    [STMT_POINTS_PAGE] = "SELECT step, value FROM points "
                         "WHERE series_id = ?1 AND step BETWEEN ?2 AND ?3 "
                         "ORDER BY step LIMIT ?4",
    /* Two scalar subqueries: each is a single index probe (min/max
     * optimisation), unlike min() and max() in one SELECT. */
    [STMT_POINTS_SPAN] = "SELECT (SELECT min(step) FROM points WHERE series_id = ?1 "
                         "AND step BETWEEN ?2 AND ?3), "
                         "(SELECT max(step) FROM points WHERE series_id = ?1 "
                         "AND step BETWEEN ?2 AND ?3)",
    /* Bucket b holds steps lo + b*w .. lo + (b+1)*w - 1; min(.., n-1) keeps
     * the count at n even where w was clamped. */
    [STMT_POINTS_BUCKETS] = "SELECT min(step), avg(value), min(value), max(value) FROM points "
                            "WHERE series_id = ?1 AND step BETWEEN ?2 AND ?3 "
                            "GROUP BY min((step - ?2) / ?4, ?5) ORDER BY 1",
    /* Counts for /runs/{run}. The alert counts are covering-index counts
     * with an index on alerts (run_id, state); without one they walk the
     * open alerts of every run (alerts_by_state). */
    [STMT_RUN_COUNTS] = "SELECT (SELECT count(*) FROM alerts WHERE run_id = ?1 AND state = ?2), "
                        "(SELECT count(*) FROM alerts WHERE run_id = ?1 AND state = ?3), "
                        "(SELECT count(*) FROM incomplete WHERE run_id = ?1)",
    [STMT_ALERTS_ALL] =
        "SELECT " ALERT_COLUMNS ALERTS_FROM "WHERE a.id < ?2 " ALERTS_POST ALERTS_ORDER,
    [STMT_ALERTS_RUN] = "SELECT " ALERT_COLUMNS ALERTS_FROM
                        "WHERE a.run_id = ?1 AND a.id < ?2 " ALERTS_POST ALERTS_ORDER,
    [STMT_ALERTS_STATE] = ALERTS_ARMS(""),
    [STMT_ALERTS_RUN_STATE] = ALERTS_ARMS("a.run_id = ?1 AND "),
    [STMT_ALERT_ONE] = "SELECT " ALERT_COLUMNS ALERTS_FROM "WHERE a.id = ?1",
    /* newest first so that LIMIT keeps the latest; reversed in C */
    /* an event's severity as it was (schema/012; older rows: the alert's) */
    [STMT_ALERT_HISTORY] = "SELECT id, change, from_state, to_state, step, at, attribution, "
                           "evidence_json, attempt, COALESCE(severity, (SELECT severity FROM "
                           "alerts WHERE id = ?1)) FROM alert_events WHERE alert_id = ?1 "
                           "ORDER BY id DESC LIMIT ?2",
    /* newest first so that LIMIT keeps the latest; regrouped in C */
    [STMT_ALERT_ADVICE] = "SELECT a.id, a.action, a.step, a.rule, a.label, a.severity, "
                          "a.first_breach_step, a.fired_step, a.rollback_step, a.created_at, "
                          "a.closed_at, s.attempt, s.rank, d.first_sent_at, d.last_sent_at, "
                          "d.sends, d.acked_at FROM advice a "
                          "LEFT JOIN advice_deliveries d ON d.advice_id = a.id "
                          "LEFT JOIN streams s ON s.id = d.stream_id WHERE a.alert_id = ?1 "
                          "ORDER BY a.id DESC, s.attempt DESC, s.rank DESC LIMIT ?2",
    /* primary-key order; the cursor is the last key (row-value comparison,
     * a range of the primary key) */
    [STMT_INCOMPLETE_FIRST] = "SELECT " INCOMPLETE_COLUMNS " FROM incomplete WHERE run_id = ?1 "
                              "ORDER BY step, kind, layer, head, \"window\" LIMIT ?7",
    [STMT_INCOMPLETE_AFTER] = "SELECT " INCOMPLETE_COLUMNS " FROM incomplete WHERE run_id = ?1 "
                              "AND (step, kind, layer, head, \"window\") > (?2, ?3, ?4, ?5, ?6) "
                              "ORDER BY step, kind, layer, head, \"window\" LIMIT ?7",
    [STMT_SILENCE_ONE] = "SELECT " SILENCE_COLUMNS " FROM silences WHERE id = ?1",
    /* newest first; ?2..?4: states wanted (1/0) at time ?5; the state
     * filter is checked on the rows walked (the table stays small) */
    [STMT_SILENCES_PAGE] = "SELECT " SILENCE_COLUMNS " FROM silences WHERE id < ?1 AND ("
                           "(?2 AND starts_at <= ?5 AND ends_at > ?5) OR "
                           "(?3 AND starts_at > ?5 AND ends_at > ?5) OR (?4 AND ends_at <= ?5)) "
                           "ORDER BY id DESC LIMIT ?6",
    /* silences_by_end: only those not yet ended are walked */
    [STMT_SILENCES_ACTIVE] = "SELECT id, matchers_json, starts_at, ends_at FROM silences "
                             "WHERE ends_at > ?1 AND starts_at <= ?1 ORDER BY id LIMIT ?2",
};

/* Any thread: the table is constant. */
const char *http_stmt_sql(enum stmt_id id)
{
    return stmt_sql[id];
}

/* /metrics' queries (metrics.c, metrics_write_db), prepared per scrape on
 * the scraping HTTP read connection. */
static const char *const metrics_sql[METRICS_Q__COUNT] = {
    /* state numbers pinned in alert.h: 1 pending, 2 firing */
    [METRICS_Q_ALERTS] = "SELECT state, severity, count(*) FROM alerts WHERE state IN (1, 2) "
                         "GROUP BY state, severity",
    /* silences_by_end: only silences that have not ended are walked */
    [METRICS_Q_SILENCES] = "SELECT count(*) FROM silences WHERE ends_at > ?1 AND starts_at <= ?1",
    /* The most recently active runs: a scan of runs (at most max_runs rows,
     * the daemon's bound) sorted by last report, LIMIT max_runs. */
    [METRICS_Q_RUNS] = "SELECT id, name, last_step FROM runs WHERE last_seen_at >= ?1 "
                       "AND reports > 0 ORDER BY last_seen_at DESC, id DESC LIMIT ?2",
    /* Latest loss: the lowest rank's loss series, its last point. */
    [METRICS_Q_LOSS] = "SELECT p.value FROM series s JOIN points p ON p.series_id = s.id "
                       "AND p.step = s.last_step WHERE s.run_id = ?1 AND s.name = 'loss' "
                       "ORDER BY s.rank LIMIT 1",
    /* Per-layer aggregates: layer set, no head, no rank; not the argmin
     * series (a head index, not a value to graph or alert on). The inner
     * LIMIT bounds the rows walked per run (series_by_run order). */
    [METRICS_Q_MONITOR_VALUES] = "SELECT s.name, s.layer, s.\"window\", p.value FROM "
                                 "(SELECT id, name, layer, head, \"window\", rank, last_step "
                                 "FROM series WHERE run_id = ?1 ORDER BY id LIMIT ?2) s "
                                 "JOIN points p ON p.series_id = s.id AND p.step = s.last_step "
                                 "WHERE s.layer >= 0 AND s.head = -1 AND s.rank = -1 "
                                 "AND s.name NOT LIKE '%.argmin' LIMIT ?3",
};

/* Any thread: the table is constant. */
const char *metrics_query_sql(enum metrics_query q)
{
    return metrics_sql[q];
}
