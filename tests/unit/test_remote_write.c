/* remote_write_encode.c: the [remote_write] settings, job labels, metric
 * names, how a status is handled, and the request body decoded back with
 * snappy and protobuf-c; store_rw.c: the labels an alert event is sent
 * with. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <snappy-c.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "fstest.h"
#include "remote_write.h"
#include "remote_write.pb-c.h"
#include "store_rw.h"
#include "store_stmt.h"

static int parse(const char *text, struct rw_config *rc, struct fs_err *err)
{
    struct fs_config cfg;
    struct config_section sec;
    config_defaults(&cfg);
    rw_config_section(rc, &sec);
    if (config_parse(text, strlen(text), "t.conf", &cfg, &sec, 1, err) < 0)
        return -1;
    return rw_config_check(rc, err);
}

Test(remote_write, defaults_are_off)
{
    struct rw_config rc;
    struct fs_err err = {0};
    cr_assert_eq(parse("", &rc, &err), 0, "%s", err.msg);
    cr_expect_eq(rc.n, 0);
    cr_assert_eq(parse("[remote_write]\nurl = http://h/api/v1/write\n", &rc, &err), 0, "%s",
                 err.msg);
    cr_assert_eq(rc.n, 1);
    cr_expect_str_eq(rc.t[0].name, "default");
    cr_expect_eq(rc.t[0].batch_samples, 5000);
    cr_expect_eq(rc.t[0].timeout_s, 30);
    cr_expect_eq(rc.t[0].per_head, 0);
    cr_expect_eq(rc.t[0].n_job_labels, 0);
}

Test(remote_write, settings_and_labels)
{
    struct rw_config rc;
    struct fs_err err = {0};
    cr_assert_eq(parse("[remote_write \"prom\"]\nurl = http://127.0.0.1:9090/api/v1/write\n"
                       "labels = cluster=a,team=ml_infra\nper_head = true\nbatch_samples = 7\n"
                       "[remote_write \"vm\"]\nurl = http://127.0.0.1:8428/api/v1/write\n",
                       &rc, &err),
                 0, "%s", err.msg);
    cr_assert_eq(rc.n, 2);
    cr_expect_str_eq(rc.t[0].name, "prom");
    cr_expect_str_eq(rc.t[1].name, "vm");
    cr_expect_eq(rc.t[1].per_head, 0);
    struct rw_target *t = &rc.t[0];
    cr_expect_eq(t->per_head, 1);
    cr_expect_eq(t->batch_samples, 7);
    cr_assert_eq(t->n_job_labels, 2);
    cr_expect_str_eq(t->job_labels[0].name, "cluster");
    cr_expect_str_eq(t->job_labels[0].value, "a");
    cr_expect_str_eq(t->job_labels[1].name, "team");
    cr_expect_str_eq(t->job_labels[1].value, "ml_infra");
}

struct bad_case {
    const char *text;
    const char *says;
};

Test(remote_write, bad_settings_say_why)
{
    static const struct bad_case cases[] = {
        {"[remote_write]\nurl = ftp://x/\n", "must start with http"},
        {"[remote_write]\nurl = http://x/\nlabels = run=a\n", "set by the daemon"},
        {"[remote_write]\nurl = http://x/\nlabels = 9x=a\n", "is not [a-zA-Z_]"},
        {"[remote_write]\nurl = http://x/\nlabels = __x=a\n", "no leading __"},
        {"[remote_write]\nurl = http://x/\nlabels = a=1,a=2\n", "given twice"},
        {"[remote_write]\nurl = http://x/\nlabels = a\n", "not name=value"},
        {"[remote_write]\nurl = http://x/\nlabels = a=\n", "value empty"},
        {"[remote_write]\nurl = http://x/\nlabels = a=1,\n", "end with ','"},
        {"[remote_write]\nurl = http://x/\nbasic_auth_user = u\n", "go together"},
        {"[remote_write]\nurl = http://x/\ntls_cert = /etc/hostname\n", "go together"},
        {"[remote_write]\nurl = http://x/\nbearer_token_file = /nonexistent/t\n", "cannot read"},
        {"[remote_write]\nper_head = maybe\n", "per_head"},
        {"[remote_write]\nbatch_samples = 0\n", "batch_samples"},
        {"[remote_write]\nlabels = a=1\n", "'url' is required"},
        {"[remote_write]\nurl = http://x/\ntenant = a b\n", "tenant holds a space"},
        {"[remote_write \"a\"]\nurl = http://x/\n[remote_write \"a\"]\n", "given twice"},
        {"[remote_write \"a b\"]\nurl = http://x/\n", "name may hold"},
        {"[remote_write \"a\"]\nurl = http://x/\n[remote_write \"b\"]\nurl = http://x/\n"
         "[remote_write \"c\"]\nurl = http://x/\n[remote_write \"d\"]\nurl = http://x/\n"
         "[remote_write \"e\"]\nurl = http://x/\n",
         "more than 4"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct rw_config rc;
        struct fs_err err = {0};
        cr_expect_neq(parse(cases[i].text, &rc, &err), 0, "case %zu accepted", i);
        cr_expect(strstr(err.msg, cases[i].says) != NULL, "case %zu: '%s' lacks '%s'", i, err.msg,
                  cases[i].says);
    }
}

Test(remote_write, metric_names)
{
    char out[64];
    cr_assert_eq(rw_metric_name("qk.d2.erank", "_max", out, sizeof(out)), 0);
    cr_expect_str_eq(out, "foreshock_qk_d2_erank_max");
    cr_assert_eq(rw_metric_name("loss", "", out, sizeof(out)), 0);
    cr_expect_str_eq(out, "foreshock_loss");
    cr_assert_eq(rw_metric_name("router.load-max", "", out, sizeof(out)), 0);
    cr_expect_str_eq(out, "foreshock_router_load_max");
    cr_expect_eq(rw_metric_name("a_very_long_series_name_indeed", "_mean", out, 16), -ENOSPC);
}

Test(remote_write, status_outcomes)
{
    static const struct {
        long status;
        enum rw_outcome o;
    } cases[] = {{200, RW_SENT},     {204, RW_SENT},     {0, RW_RETRY},      {429, RW_RETRY},
                 {500, RW_RETRY},    {503, RW_RETRY},    {400, RW_REJECTED}, {401, RW_REJECTED},
                 {404, RW_REJECTED}, {413, RW_REJECTED}, {302, RW_REJECTED}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_expect_eq(rw_classify(cases[i].status), cases[i].o, "status %ld", cases[i].status);
}

static void lab(struct rw_label *l, const char *n, const char *v)
{
    snprintf(l->name, sizeof(l->name), "%s", n);
    snprintf(l->value, sizeof(l->value), "%s", v);
}

Test(remote_write, body_decodes_to_sorted_series)
{
    struct rw_batch *b = rw_batch_new();
    cr_assert_not_null(b);
    struct rw_label a[3], c[3];
    lab(&a[0], "run", "r1");
    lab(&a[1], "__name__", "foreshock_loss");
    lab(&a[2], "rank", "0");
    lab(&c[0], "rank", "1");
    lab(&c[1], "run", "r1");
    lab(&c[2], "__name__", "foreshock_loss");
    cr_assert_eq(rw_batch_add(b, a, 3, 2000, 1.5), 0);
    cr_assert_eq(rw_batch_add(b, c, 3, 2000, 2.5), 0);
    /* the same labels in another order are the same series */
    struct rw_label a2[3] = {a[2], a[0], a[1]};
    cr_assert_eq(rw_batch_add(b, a2, 3, 3000, NAN), 0);
    cr_expect_eq(rw_batch_series(b), 2);
    cr_expect_eq(rw_batch_samples(b), 3);

    uint8_t *body;
    size_t len;
    cr_assert_eq(rw_batch_encode(b, &body, &len), 0);
    size_t rawlen;
    cr_assert_eq(snappy_uncompressed_length((char *)body, len, &rawlen), SNAPPY_OK);
    char *raw = malloc(rawlen);
    cr_assert_eq(snappy_uncompress((char *)body, len, raw, &rawlen), SNAPPY_OK);
    Fsrw__WriteRequest *req = fsrw__write_request__unpack(NULL, rawlen, (uint8_t *)raw);
    cr_assert_not_null(req);
    cr_assert_eq(req->n_timeseries, 2);
    Fsrw__TimeSeries *s0 = req->timeseries[0];
    cr_assert_eq(s0->n_labels, 3);
    cr_expect_str_eq(s0->labels[0]->name, "__name__");
    cr_expect_str_eq(s0->labels[1]->name, "rank");
    cr_expect_str_eq(s0->labels[1]->value, "0");
    cr_expect_str_eq(s0->labels[2]->name, "run");
    cr_assert_eq(s0->n_samples, 2);
    cr_expect_eq(s0->samples[0]->timestamp, 2000);
    cr_expect_eq(s0->samples[0]->value, 1.5);
    cr_expect_eq(s0->samples[1]->timestamp, 3000);
    cr_expect(isnan(s0->samples[1]->value));
    cr_expect_str_eq(req->timeseries[1]->labels[1]->value, "1");
    cr_expect_eq(req->timeseries[1]->samples[0]->value, 2.5);
    fsrw__write_request__free_unpacked(req, NULL);
    free(raw);
    free(body);

    rw_batch_clear(b);
    cr_expect_eq(rw_batch_samples(b), 0);
    cr_assert_eq(rw_batch_add(b, c, 3, 5, 1), 0);
    cr_expect_eq(rw_batch_series(b), 1);
    cr_expect_eq(rw_batch_samples(b), 1);
    rw_batch_free(b);
}

Test(remote_write, many_series_grow_the_index)
{
    struct rw_batch *b = rw_batch_new();
    for (int i = 0; i < 5000; i++) {
        struct rw_label l[2];
        lab(&l[0], "__name__", "m");
        char v[16];
        snprintf(v, sizeof(v), "%d", i % 1000);
        lab(&l[1], "layer", v);
        cr_assert_eq(rw_batch_add(b, l, 2, i, i), 0);
    }
    cr_expect_eq(rw_batch_series(b), 1000);
    cr_expect_eq(rw_batch_samples(b), 5000);
    rw_batch_free(b);
}

Test(remote_write, a_series_timestamps_rise_across_batches)
{
    struct rw_batch *b = rw_batch_new();
    struct rw_label l[2];
    lab(&l[0], "__name__", "foreshock_loss");
    lab(&l[1], "run", "r");
    cr_assert_eq(rw_batch_add(b, l, 2, 1000, 1), 0);
    cr_assert_eq(rw_batch_add(b, l, 2, 1000, 2), 0); /* same millisecond: 1001 */
    cr_assert_eq(rw_batch_add(b, l, 2, 1001, 3), 0); /* 1002 */
    rw_batch_clear(b);
    cr_assert_eq(rw_batch_add(b, l, 2, 1002, 4), 0); /* next batch: 1003 */
    cr_assert_eq(rw_batch_add(b, l, 2, 2000, 5), 0); /* later: as it is */
    uint8_t *body;
    size_t len, rawlen;
    cr_assert_eq(rw_batch_encode(b, &body, &len), 0);
    cr_assert_eq(snappy_uncompressed_length((char *)body, len, &rawlen), SNAPPY_OK);
    char *raw = malloc(rawlen);
    cr_assert_eq(snappy_uncompress((char *)body, len, raw, &rawlen), SNAPPY_OK);
    Fsrw__WriteRequest *req = fsrw__write_request__unpack(NULL, rawlen, (uint8_t *)raw);
    cr_assert_not_null(req);
    cr_assert_eq(req->n_timeseries, 1);
    cr_assert_eq(req->timeseries[0]->n_samples, 2);
    cr_expect_eq(req->timeseries[0]->samples[0]->timestamp, 1003);
    cr_expect_eq(req->timeseries[0]->samples[1]->timestamp, 2000);
    fsrw__write_request__free_unpacked(req, NULL);
    free(raw);
    free(body);
    rw_batch_free(b);
}

/* An event is sent with the severity its alert had at that event, whatever
 * the alert's is now: a resend (a cursor moved back) must land in the series
 * the first send made. Rows from before the event kept it (NULL) read the
 * alert's. */
Test(remote_write, an_event_keeps_its_severity)
{
    sqlite3 *db = NULL;
    cr_assert_eq(sqlite3_open(":memory:", &db), SQLITE_OK);
    db_apply_schema(db, false, true);
    const char *fill =
        "INSERT INTO runs (id, name, created_at, last_seen_at, world_size) VALUES "
        "(1, 'a', 0, 0, 1);"
        "INSERT INTO alerts (id, run_id, rule, alert_key, dedup_key, state, severity, family, "
        "attribution, last_step, created_at, updated_at) VALUES "
        "(1, 1, 'loss', 'k1', 'd1', 2, 'critical', 'f', 'a', 0, 0, 0);"
        "INSERT INTO alert_events (id, alert_id, change, from_state, to_state, step, at, "
        "attribution, evidence_json, severity) VALUES "
        "(1, 1, 'to_pending', 0, 1, 0, 0, 'a', '{}', 'warning'), "
        "(2, 1, 'to_firing', 1, 2, 5, 1, 'a', '{}', 'warning'), "
        "(3, 1, 'to_resolved', 2, 3, 9, 2, 'a', '{}', NULL);";
    char *msg = NULL;
    cr_assert_eq(sqlite3_exec(db, fill, NULL, NULL, &msg), SQLITE_OK, "%s", msg);
    sqlite3_stmt *st[RW_Q__COUNT] = {0};
    cr_assert_eq(store_rw_prepare(db, st), SQLITE_OK, "%s", sqlite3_errmsg(db));
    sqlite3_stmt *q = st[RW_Q_ALERTS];
    sqlite3_bind_int64(q, 1, 0);
    sqlite3_bind_int64(q, 2, 10);
    static const char *const want[] = {"warning", "warning", "critical"};
    size_t n = 0;
    while (sqlite3_step(q) == SQLITE_ROW) {
        cr_assert_lt(n, 3);
        cr_expect_str_eq((const char *)sqlite3_column_text(q, 4), want[n], "event %lld",
                         (long long)sqlite3_column_int64(q, 0));
        n++;
    }
    cr_expect_eq(n, 3);
    store_finalize_all(st, RW_Q__COUNT);
    sqlite3_close(db);
}
