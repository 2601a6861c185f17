/* Unit tests for daemon/advice.c: the [advice] policy, the rollback step,
 * the Advice frame, a connection's unacknowledged set, and what the advice
 * rows owe each stream (on an in-memory database with the real
 * migrations). */
#include <criterion/criterion.h>
#include <errno.h>
#include <sqlite3.h>
#include <stdio.h>
#include <string.h>

#include "advice.h"
#include "alert.h"
#include "decode.h"
#include "fstest.h"

/* ---- policy ------------------------------------------------------------------ */

Test(advice, default_policy)
{
    static const struct {
        const char *label, *severity;
        enum advice_action want;
    } cases[] = {
        {"attention-numerics", "warning", ADVICE_CHECKPOINT},
        {"attention-numerics", "critical", ADVICE_CHECKPOINT},
        {"optimizer-hyperparameter", "warning", ADVICE_CHECKPOINT},
        {"combined", "critical", ADVICE_CHECKPOINT},
        {"router-balance", "warning", ADVICE_CHECKPOINT},
        {"non-finite", "critical", ADVICE_CHECKPOINT_AND_STOP},
        {"non-finite", "warning", ADVICE_CHECKPOINT_AND_STOP},
        {"loss-spike", "warning", ADVICE_NONE},
        {"none", "critical", ADVICE_NONE},
        {"no-such-label", "warning", ADVICE_NONE},
        {"combined", "fatal", ADVICE_NONE},
    };
    struct advice_policy p;
    advice_policy_default(&p);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_eq(advice_decide(&p, cases[i].label, cases[i].severity), cases[i].want, "%s/%s",
                     cases[i].label, cases[i].severity);
    cr_expect_eq(advice_decide(NULL, "non-finite", "critical"), ADVICE_NONE);
}

/* Keys applied in order over the defaults, then one decision checked. */
static const struct set_case {
    const char *keys[3][2];
    int rc; /* of the last key */
    const char *label, *severity;
    enum advice_action want;
} set_cases[] = {
    {{{"attention-numerics", "checkpoint_and_stop"}},
     0,
     "attention-numerics",
     "warning",
     ADVICE_CHECKPOINT_AND_STOP},
    {{{"attention-numerics.critical", "checkpoint_and_stop"}},
     0,
     "attention-numerics",
     "warning",
     ADVICE_CHECKPOINT},
    {{{"attention-numerics.critical", "checkpoint_and_stop"}},
     0,
     "attention-numerics",
     "critical",
     ADVICE_CHECKPOINT_AND_STOP},
    {{{"loss-spike", "checkpoint"}}, 0, "loss-spike", "warning", ADVICE_CHECKPOINT},
    {{{"non-finite", "none"}}, 0, "non-finite", "critical", ADVICE_NONE},
    {{{"combined", "none"}, {"combined.critical", "checkpoint"}},
     0,
     "combined",
     "warning",
     ADVICE_NONE},
    {{{"combined", "none"}, {"combined.critical", "checkpoint"}},
     0,
     "combined",
     "critical",
     ADVICE_CHECKPOINT},
    {{{"enabled", "false"}}, 0, "non-finite", "critical", ADVICE_NONE},
    {{{"enabled", "false"}, {"enabled", "true"}},
     0,
     "non-finite",
     "critical",
     ADVICE_CHECKPOINT_AND_STOP},
    {{{"enabled", "yes"}}, -EINVAL, "non-finite", "critical", ADVICE_CHECKPOINT_AND_STOP},
    {{{"attention-numerics", "stop"}}, -EINVAL, "attention-numerics", "warning", ADVICE_CHECKPOINT},
    {{{"attention", "checkpoint"}}, -EINVAL, "attention-numerics", "warning", ADVICE_CHECKPOINT},
    {{{"combined.fatal", "none"}}, -EINVAL, "combined", "warning", ADVICE_CHECKPOINT},
    {{{"combined.", "none"}}, -EINVAL, "combined", "warning", ADVICE_CHECKPOINT},
};

Test(advice, policy_keys)
{
    for (size_t i = 0; i < sizeof set_cases / sizeof set_cases[0]; i++) {
        const struct set_case *c = &set_cases[i];
        struct advice_policy p;
        advice_policy_default(&p);
        int rc = 0;
        struct fs_err why = {0};
        for (size_t k = 0; k < 3 && c->keys[k][0]; k++)
            rc = advice_policy_set(&p, c->keys[k][0], c->keys[k][1], &why);
        cr_expect_eq(rc, c->rc, "case %zu: rc %d (%s)", i, rc, why.msg);
        if (rc < 0)
            cr_expect(strlen(why.msg) > 0, "case %zu: no reason", i);
        cr_expect_eq(advice_decide(&p, c->label, c->severity), c->want, "case %zu", i);
    }
}

/* An unknown key names every label and severity (from alert.c's and
 * detect.c's tables), labels in value order with "none" last. */
Test(advice, unknown_key_lists_the_names)
{
    struct advice_policy p;
    advice_policy_default(&p);
    struct fs_err why = {0};
    cr_assert_eq(advice_policy_set(&p, "combined.fatal", "none", &why), -EINVAL);
    cr_expect_str_eq(why.msg,
                     "unknown key 'combined.fatal': keys are enabled, LABEL or "
                     "LABEL.SEVERITY (labels: attention-numerics, optimizer-hyperparameter, "
                     "combined, router-balance, non-finite, loss-spike, none; severities: "
                     "warning, critical)");
}

Test(advice, section_in_a_config_file)
{
    struct fs_config cfg;
    config_defaults(&cfg);
    struct advice_policy p;
    advice_policy_default(&p);
    struct config_section sec;
    advice_section(&p, &sec);
    static const char good[] =
        "[advice]\nrouter-balance = none\nloss-spike.critical = checkpoint\n";
    struct fs_err err = {0};
    cr_assert_eq(config_parse(good, strlen(good), "t.conf", &cfg, &sec, 1, &err), 0, "%s", err.msg);
    cr_expect_eq(advice_decide(&p, "router-balance", "warning"), ADVICE_NONE);
    cr_expect_eq(advice_decide(&p, "loss-spike", "critical"), ADVICE_CHECKPOINT);
    cr_expect_eq(advice_decide(&p, "loss-spike", "warning"), ADVICE_NONE);
    static const char bad[] = "[advice]\nrouter = none\n";
    cr_expect_neq(config_parse(bad, strlen(bad), "t.conf", &cfg, &sec, 1, &err), 0);
    cr_expect(strstr(err.msg, "t.conf:2"), "%s", err.msg);
    static const char named[] = "[advice \"x\"]\n";
    cr_expect_neq(config_parse(named, strlen(named), "t.conf", &cfg, &sec, 1, &err), 0);
}

Test(advice, rollback_step)
{
    static const struct {
        int64_t first_breach;
        int32_t window;
        int64_t want;
    } cases[] = {
        {100, 0, 99}, {100, 25, 75}, {100, 1, 99}, {0, 0, -1},
        {10, 10, 0},  {9, 10, -1},   {-1, 0, -1},  {-1, 5, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_eq(advice_rollback_step(cases[i].first_breach, cases[i].window), cases[i].want,
                     "first breach %lld window %d", (long long)cases[i].first_breach,
                     cases[i].window);
}

Test(advice, action_names)
{
    cr_expect_str_eq(advice_action_name(ADVICE_CHECKPOINT), "checkpoint");
    cr_expect_str_eq(advice_action_name(ADVICE_CHECKPOINT_AND_STOP), "checkpoint_and_stop");
    cr_expect_str_eq(advice_action_name(ADVICE_RESOLVED), "resolved");
    cr_expect_str_eq(advice_action_name(ADVICE_SUPERSEDED), "superseded");
    cr_expect_str_eq(advice_action_name(ADVICE_NONE), "none");
    cr_expect_str_eq(advice_action_name(99), "unknown");
}

/* ---- the frame --------------------------------------------------------------- */

Test(advice, frame_round_trip)
{
    struct advice_msg m = {.id = 42,
                           .run_id = 3,
                           .alert_id = 7,
                           .action = ADVICE_CHECKPOINT,
                           .step = 320,
                           .first_breach_step = 310,
                           .fired_step = 320,
                           .rollback_step = 300,
                           .layer = 1,
                           .head = -1,
                           .window = 10,
                           .rank = -1};
    snprintf(m.rule, sizeof m.rule, "qk.d2.erank");
    snprintf(m.label, sizeof m.label, "attention-numerics");
    snprintf(m.severity, sizeof m.severity, "warning");
    uint8_t *buf;
    size_t len;
    cr_assert_eq(advice_encode(&m, &buf, &len), 0);
    struct decode_limits lim;
    decode_limits_default(&lim, 1 << 20);
    uint32_t n;
    struct fs_err err;
    cr_assert_eq(decode_prefix(buf, &lim, &n, &err), 0);
    cr_assert_eq(n + DECODE_PREFIX_BYTES, len);
    Foreshock__Frame *f;
    cr_assert_eq(decode_frame(buf + DECODE_PREFIX_BYTES, n, &lim, &f, NULL, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_ADVICE);
    const Foreshock__Advice *a = f->advice;
    cr_expect_eq(a->advice_id, 42);
    cr_expect_eq((int)a->action, ADVICE_CHECKPOINT);
    cr_expect_eq(a->alert_id, 7);
    cr_expect_str_eq(a->rule, "qk.d2.erank");
    cr_expect_str_eq(a->label, "attention-numerics");
    cr_expect_str_eq(a->severity, "warning");
    cr_expect(a->has_step && a->step == 320);
    cr_expect(a->has_first_breach_step && a->first_breach_step == 310);
    cr_expect(a->has_fired_step && a->fired_step == 320);
    cr_expect(a->has_rollback_step && a->rollback_step == 300);
    cr_expect(a->has_layer && a->layer == 1);
    cr_expect(!a->has_head && !a->has_rank);
    cr_expect(a->has_window && a->window == 10);
    decode_frame_free(f);
    free(buf);
    /* Unknown steps and scopes are absent, not 0 or -1. */
    m.rollback_step = m.first_breach_step = -1;
    m.window = 0;
    m.layer = -1;
    cr_assert_eq(advice_encode(&m, &buf, &len), 0);
    cr_assert_eq(
        decode_frame(buf + DECODE_PREFIX_BYTES, len - DECODE_PREFIX_BYTES, &lim, &f, NULL, &err),
        0);
    cr_expect(!f->advice->has_rollback_step && !f->advice->has_first_breach_step);
    cr_expect(!f->advice->has_window && !f->advice->has_layer);
    decode_frame_free(f);
    free(buf);
}

Test(advice, ack_frame_limit)
{
    Foreshock__AdviceAck a = FORESHOCK__ADVICE_ACK__INIT;
    uint64_t ids[FS_MAX_ADVICE_ACK_IDS + 1];
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        ids[i] = i + 1;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_ADVICE_ACK;
    f.advice_ack = &a;
    a.advice_id = ids;
    struct decode_limits lim;
    decode_limits_default(&lim, 1 << 20);
    for (size_t n = FS_MAX_ADVICE_ACK_IDS; n <= FS_MAX_ADVICE_ACK_IDS + 1; n++) {
        a.n_advice_id = n;
        uint8_t *buf;
        size_t len;
        cr_assert_eq(decode_encode(&f, &buf, &len), 0);
        Foreshock__Frame *out = NULL;
        struct fs_err err;
        int rc = decode_frame(buf + DECODE_PREFIX_BYTES, len - DECODE_PREFIX_BYTES, &lim, &out,
                              NULL, &err);
        if (n <= FS_MAX_ADVICE_ACK_IDS) {
            cr_expect_eq(rc, 0, "%zu ids: %s", n, err.msg);
        } else {
            cr_expect_eq(rc, -EINVAL, "%zu ids accepted", n);
            cr_expect_eq(err.code, FORESHOCK__ERROR_CODE__ERROR_LIMIT);
        }
        decode_frame_free(out);
        free(buf);
    }
}

/* ---- a connection's unacknowledged advices -------------------------------------- */

Test(advice, conn_set)
{
    struct advice_conn ac = {.enabled = true};
    cr_expect_not(advice_conn_take(&ac, 1), "nothing sent yet");
    cr_assert_eq(advice_conn_sent(&ac, 1), 0);
    cr_assert_eq(advice_conn_sent(&ac, 2), 0);
    cr_assert_eq(advice_conn_sent(&ac, 1), 0); /* sent again: still one entry */
    cr_expect_eq(ac.n, 2);
    cr_expect(advice_conn_take(&ac, 1));
    cr_expect_not(advice_conn_take(&ac, 1), "acknowledged twice");
    cr_expect(advice_conn_take(&ac, 2));
    for (uint32_t i = 0; i < ADVICE_MAX_UNACKED_PER_CONN; i++)
        cr_assert_eq(advice_conn_sent(&ac, 100 + i), 0);
    cr_expect_eq(advice_conn_sent(&ac, 99), -ENOSPC);
    cr_expect(advice_conn_take(&ac, 100));
    cr_expect_eq(advice_conn_sent(&ac, 99), 0);
    advice_conn_free(&ac);
    cr_expect_eq(ac.n, 0);
}

/* ---- storage: what each stream is owed ------------------------------------------- */

static sqlite3 *db;
static struct advice_store *as;
static struct advice_policy policy;

static void setup_db(void)
{
    cr_assert_eq(sqlite3_open(":memory:", &db), SQLITE_OK);
    db_exec(db, "PRAGMA foreign_keys = ON");
    db_apply_schema(db, false, false);
    /* Two runs; run 1 has streams 1, 2 (attempt 0, ranks 0-1) and 3
     * (attempt 1, rank 0); run 2 has stream 4. Alerts 1, 2 of run 1. */
    db_exec(db, "INSERT INTO runs (id, name, created_at, last_seen_at, world_size) VALUES "
                "(1, 'a', 0, 0, 2), (2, 'b', 0, 0, 1)");
    db_exec(db, "INSERT INTO streams (id, run_id, attempt, rank, created_at, last_seen_at) VALUES "
                "(1, 1, 0, 0, 0, 0), (2, 1, 0, 1, 0, 0), (3, 1, 1, 0, 0, 0), (4, 2, 0, 0, 0, 0)");
    db_exec(db, "INSERT INTO alerts (id, run_id, rule, alert_key, dedup_key, state, severity, "
                "family, attribution, last_step, created_at, updated_at, \"window\") VALUES "
                "(1, 1, 'qk.d2.erank', 'k1', 'd1', 2, 'warning', 'attention_d2', "
                "'attention-numerics', 0, 0, 0, 10), "
                "(2, 1, 'loss', 'k2', 'd2', 2, 'critical', 'loss', 'non-finite', 0, 0, 0, 0)");
    db_exec(db, "INSERT INTO alert_events (id, alert_id, change, from_state, to_state, step, at, "
                "attribution, evidence_json) VALUES (1, 1, 'to_firing', 1, 2, 0, 0, '', '{}'), "
                "(2, 2, 'to_firing', 0, 2, 0, 0, '', '{}'), "
                "(3, 1, 'to_resolved', 2, 3, 0, 0, '', '{}'), "
                "(4, 1, 'to_firing', 3, 2, 0, 0, '', '{}')");
    cr_assert_eq(advice_store_open(db, &as), 0);
    advice_policy_default(&policy);
}

static void teardown_db(void)
{
    advice_store_close(as);
    sqlite3_close(db);
}

static int64_t event(int64_t alert, int64_t event_id, int to_state, const char *label,
                     const char *severity, int64_t step, int64_t first_breach, int32_t window)
{
    struct advice_event ev = {.run_id = 1,
                              .alert_id = alert,
                              .event_id = event_id,
                              .to_state = to_state,
                              .rule = alert == 1 ? "qk.d2.erank" : "loss",
                              .label = label,
                              .severity = severity,
                              .step = step,
                              .first_breach_step = first_breach,
                              .fired_step = step,
                              .layer = -1,
                              .head = -1,
                              .window = window,
                              .rank = -1};
    struct advice_msg m;
    bool made = false;
    cr_assert_eq(advice_store_event(as, &policy, &ev, 1.0, &m, &made), SQLITE_OK, "%s",
                 sqlite3_errmsg(db));
    if (!made)
        return 0;
    cr_expect_eq(m.alert_id, alert);
    cr_expect_eq(m.rollback_step, advice_rollback_step(first_breach, window));
    return m.id;
}

struct owed {
    int64_t ids[16];
    int actions[16];
    size_t n;
};

static int collect(void *ctx, const struct advice_msg *m)
{
    struct owed *o = ctx;
    cr_assert_lt(o->n, 16);
    o->ids[o->n] = m->id;
    o->actions[o->n++] = m->action;
    return 0;
}

/* The ids owed to stream (of run) as a space-separated string. */
static const char *owed(int64_t run, int64_t stream)
{
    static char out[256];
    struct owed o = {0};
    bool more = false;
    cr_assert_eq(advice_store_owed(as, run, stream, 16, collect, &o, &more), SQLITE_OK);
    out[0] = '\0';
    for (size_t i = 0; i < o.n; i++)
        snprintf(out + strlen(out), sizeof out - strlen(out), "%s%lld", i ? " " : "",
                 (long long)o.ids[i]);
    return out;
}

static void delivery(int64_t advice, int64_t stream, int acked)
{
    cr_assert_eq(advice_store_delivery(as, advice, stream, acked, 2.0), SQLITE_OK, "%s",
                 sqlite3_errmsg(db));
}

Test(advice_store, owed_per_stream, .init = setup_db, .fini = teardown_db)
{
    int64_t fire = event(1, 1, ALERT_FIRING, "attention-numerics", "warning", 320, 310, 10);
    cr_assert_gt(fire, 0);
    /* Every stream of the run is owed it; the other run's is not. */
    cr_expect_str_eq(owed(1, 1), "1");
    cr_expect_str_eq(owed(1, 2), "1");
    cr_expect_str_eq(owed(1, 3), "1");
    cr_expect_str_eq(owed(2, 4), "");
    /* Sent is not enough; acknowledged is. */
    delivery(fire, 1, 0);
    cr_expect_str_eq(owed(1, 1), "1");
    delivery(fire, 1, 1);
    cr_expect_str_eq(owed(1, 1), "");
    cr_expect_str_eq(owed(1, 2), "1");
    /* A delivery for a stream of another run is not recorded. */
    delivery(fire, 4, 1);
    sqlite3_stmt *q;
    cr_assert_eq(sqlite3_prepare_v2(db,
                                    "SELECT count(*) FROM advice_deliveries WHERE "
                                    "stream_id = 4",
                                    -1, &q, NULL),
                 SQLITE_OK);
    cr_assert_eq(sqlite3_step(q), SQLITE_ROW);
    cr_expect_eq(sqlite3_column_int(q, 0), 0);
    sqlite3_finalize(q);
    /* Stream 2 was sent the firing advice, stream 3 never was. */
    delivery(fire, 2, 0);
    /* The alert resolves: the firing advice is closed (owed to nobody
     * new); the answer goes to the streams that were sent the firing. */
    int64_t res = event(1, 3, ALERT_RESOLVED, "attention-numerics", "warning", 400, 310, 10);
    cr_assert_gt(res, fire);
    cr_expect_str_eq(owed(1, 1), "2");
    cr_expect_str_eq(owed(1, 2), "2");
    cr_expect_str_eq(owed(1, 3), "");
    delivery(res, 1, 1);
    cr_expect_str_eq(owed(1, 1), "");
    /* A second alert, non-finite: checkpoint_and_stop. */
    int64_t nf = event(2, 2, ALERT_FIRING, "non-finite", "critical", 402, 402, 0);
    cr_expect_str_eq(owed(1, 3), "3");
    /* The first alert fires again: its resolve advice is replaced. */
    int64_t again = event(1, 4, ALERT_FIRING, "attention-numerics", "warning", 500, 490, 10);
    cr_expect_str_eq(owed(1, 2), "3 4");
    cr_expect_str_eq(owed(1, 3), "3 4");
    struct owed o = {0};
    bool more = true;
    cr_assert_eq(advice_store_owed(as, 1, 3, 16, collect, &o, &more), SQLITE_OK);
    cr_expect_not(more);
    cr_expect_eq(o.actions[0], ADVICE_CHECKPOINT_AND_STOP);
    cr_expect_eq(o.actions[1], ADVICE_CHECKPOINT);
    /* The bound: one of two, and `more` says so. */
    o.n = 0;
    cr_assert_eq(advice_store_owed(as, 1, 3, 1, collect, &o, &more), SQLITE_OK);
    cr_expect_eq(o.n, 1);
    cr_expect(more);
    (void)nf;
    (void)again;
}

Test(advice_store, policy_decides, .init = setup_db, .fini = teardown_db)
{
    /* Labels without advice make no row, and their resolve none either. */
    cr_expect_eq(event(2, 2, ALERT_FIRING, "loss-spike", "warning", 10, 9, 0), 0);
    cr_expect_eq(event(2, 2, ALERT_RESOLVED, "loss-spike", "warning", 20, 9, 0), 0);
    /* Pending and inactive transitions never advise. */
    cr_expect_eq(event(1, 1, ALERT_PENDING, "attention-numerics", "warning", 10, 9, 10), 0);
    cr_expect_eq(event(1, 1, ALERT_INACTIVE, "attention-numerics", "warning", 10, 9, 10), 0);
    policy.enabled = false;
    cr_expect_eq(event(1, 1, ALERT_FIRING, "attention-numerics", "warning", 10, 9, 10), 0);
    cr_expect_str_eq(owed(1, 1), "");
}
