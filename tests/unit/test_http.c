/* HTTP API tests: a temp database with the real schema, rows written by a
 * read-write connection of the test's own, the server on 127.0.0.1:0, and
 * real requests through libcurl checked with jansson. */

#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <curl/curl.h>
#include <jansson.h>
#include <sqlite3.h>

#include "fstest.h"
#include "http.h"

/* --- database fixture (fstest.h: http_fx) ------------------------------------------------ */

static void exec(const char *sql)
{
    db_exec(http_fx.rw, sql);
}

static void insert_point(int64_t series, int64_t step, const double *value)
{
    sqlite3_stmt *st;
    cr_assert_eq(sqlite3_prepare_v2(http_fx.rw,
                                    "INSERT INTO points(series_id, step, value, time) "
                                    "VALUES (?1, ?2, ?3, 0)",
                                    -1, &st, NULL),
                 SQLITE_OK);
    sqlite3_bind_int64(st, 1, series);
    sqlite3_bind_int64(st, 2, step);
    if (value)
        sqlite3_bind_double(st, 3, *value);
    cr_assert_eq(sqlite3_step(st), SQLITE_DONE, "%s", sqlite3_errmsg(http_fx.rw));
    sqlite3_finalize(st);
}

/* Value of series 1 (loss, rank 0) at step s: s/2, except 50 (SQL NULL),
 * 60 (+Inf) and 61 (-Inf). Series 2: s. */
static int loss_value(int64_t s, double *v)
{
    if (s == 50)
        return 0;
    *v = s == 60 ? INFINITY : s == 61 ? -INFINITY : (double)s * 0.5;
    return 1;
}

static void insert_base_data(void)
{
    exec("BEGIN");
    exec("INSERT INTO runs(id, name, created_at, last_seen_at, world_size, detect_from_step, "
         "model_json, last_step, reports) VALUES "
         "(1, 'run-a', 1000.5, 2000.25, 2, 10, '{\"layers\":4,\"heads\":8}', 99, 200),"
         "(2, 'run-b', 3000, 3000, 1, 0, NULL, NULL, 0)");
    /* scrambled so that the (attempt, rank) order is the server's work */
    exec("INSERT INTO streams(run_id, attempt, rank, last_seq, reports, created_at, last_seen_at)"
         " VALUES (1, 1, 0, 7, 7, 1500, 1600), (1, 0, 1, 100, 100, 1000, 1400),"
         " (1, 0, 0, 93, 93, 1000, 1300)");
    exec("INSERT INTO series(id, run_id, name, layer, head, window, rank, points, first_step, "
         "last_step) VALUES "
         "(1, 1, 'loss', -1, -1, 0, 0, 99, 0, 99),"
         "(2, 1, 'loss', -1, -1, 0, 1, 100, 0, 99),"
         "(3, 1, 'qk.d2.entropy', 0, 1, 10, -1, 0, NULL, NULL),"
         "(4, 1, 'qk.d2.erank', 1, 0, 10, -1, 0, NULL, NULL),"
         "(5, 1, 'router.load', 2, -1, 0, -1, 0, NULL, NULL),"
         "(6, 1, 'empty', -1, -1, 0, -1, 0, NULL, NULL)");
    for (int64_t s = 0; s < 100; s++) {
        double v;
        insert_point(1, s, loss_value(s, &v) ? &v : NULL);
        v = (double)s;
        insert_point(2, s, &v);
    }
    exec("COMMIT");
}

static void setup(void)
{
    http_fixture_open("http");
    insert_base_data();
    http_fixture_start(2);
}

TestSuite(http, .init = setup, .fini = http_fixture_close);

/* --- simple routes ------------------------------------------------------------------------- */

Test(http, healthz)
{
    struct resp r;
    json_t *doc = get_json("/healthz", 200, &r);
    cr_assert_str_eq(json_string_value(json_object_get(doc, "status")), "ok");
    resp_free(&r);
}

Test(http, readyz_follows_stats)
{
    static const struct {
        int ready, failing;
        long status;
        const char *mention;
    } cases[] = {
        {.ready = 1, .failing = 0, .status = 200},
        {.ready = 0, .failing = 0, .status = 503, .mention = "not ready"},
        {.ready = 1, .failing = SQLITE_IOERR, .status = 503, .mention = "storage: disk I/O error"},
        /* The writer clears ready while commits fail: the reason still shows. */
        {.ready = 0,
         .failing = SQLITE_FULL,
         .status = 503,
         .mention = "storage: database or disk is full"},
    };
    for (size_t i = 0; i < N(cases); i++) {
        atomic_store(&http_fx.stats.ready, cases[i].ready);
        atomic_store(&http_fx.stats.storage_failing, cases[i].failing);
        if (cases[i].status == 200) {
            struct resp r;
            json_t *doc = get_json("/readyz", 200, &r);
            cr_assert_str_eq(json_string_value(json_object_get(doc, "status")), "ready");
            resp_free(&r);
        } else {
            expect_error(NULL, "/readyz", 503, "unavailable", cases[i].mention);
        }
    }
}

/* --- runs ---------------------------------------------------------------------------------- */

Test(http, runs_shape_and_values)
{
    struct resp r;
    json_t *doc = get_json("/api/v1/runs", 200, &r);
    json_t *runs = json_object_get(doc, "runs");
    cr_assert_eq(json_array_size(runs), 2);
    cr_assert(json_is_null(json_object_get(doc, "next")));

    json_t *a = json_array_get(runs, 0);
    cr_assert_str_eq(json_string_value(json_object_get(a, "id")), "run-a");
    cr_assert_float_eq(jnum(a, "created_at"), 1000.5, 1e-9);
    cr_assert_float_eq(jnum(a, "last_seen_at"), 2000.25, 1e-9);
    cr_assert_eq(jint(a, "world_size"), 2);
    cr_assert_eq(jint(a, "detect_from_step"), 10);
    cr_assert_eq(jint(a, "last_step"), 99);
    cr_assert_eq(jint(a, "reports"), 200);
    cr_assert_eq(jint(a, "streams"), 3);
    cr_assert_eq(jint(a, "series"), 6);
    json_t *model = json_object_get(a, "model");
    cr_assert(json_is_object(model));
    cr_assert_eq(jint(model, "layers"), 4);
    cr_assert_eq(jint(model, "heads"), 8);

    json_t *b = json_array_get(runs, 1);
    cr_assert_str_eq(json_string_value(json_object_get(b, "id")), "run-b");
    cr_assert(json_is_null(json_object_get(b, "last_step")));
    cr_assert(json_is_null(json_object_get(b, "model")));
    cr_assert_eq(jint(b, "streams"), 0);
    cr_assert_eq(jint(b, "series"), 0);
    resp_free(&r);
}

Test(http, runs_keyset_pagination_covers_all_once)
{
    exec("BEGIN");
    for (int i = 0; i < 25; i++) {
        char sql[256];
        snprintf(sql, sizeof sql,
                 "INSERT INTO runs(name, created_at, last_seen_at, world_size) "
                 "VALUES ('page-%02d', 1, 1, 1)",
                 i);
        exec(sql);
    }
    exec("COMMIT");

    static const int limits[] = {1, 7, 27, 1000};
    for (size_t li = 0; li < N(limits); li++) {
        int seen[64] = {0};
        int total = 0, pages = 0;
        char after[32] = "";
        int64_t prev_id = 0;
        for (;;) {
            char path[128];
            if (after[0])
                snprintf(path, sizeof path, "/api/v1/runs?limit=%d&after=%s", limits[li], after);
            else
                snprintf(path, sizeof path, "/api/v1/runs?limit=%d", limits[li]);
            struct resp r;
            json_t *doc = get_json(path, 200, &r);
            json_t *runs = json_object_get(doc, "runs");
            cr_assert_leq(json_array_size(runs), (size_t)limits[li]);
            pages++;
            size_t i;
            json_t *run;
            json_array_foreach(runs, i, run)
            {
                const char *name = json_string_value(json_object_get(run, "id"));
                int k = strcmp(name, "run-a") == 0   ? 0
                        : strcmp(name, "run-b") == 0 ? 1
                                                     : 2 + atoi(name + 5);
                cr_assert_lt(k, 27);
                seen[k]++;
                total++;
            }
            json_t *next = json_object_get(doc, "next");
            if (json_is_null(next)) {
                resp_free(&r);
                break;
            }
            cr_assert(json_is_string(next));
            cr_assert_eq(json_array_size(runs), (size_t)limits[li], "short page with a cursor");
            int64_t id = atoll(json_string_value(next));
            cr_assert_gt(id, prev_id, "cursor does not advance");
            prev_id = id;
            snprintf(after, sizeof after, "%s", json_string_value(next));
            resp_free(&r);
            cr_assert_lt(pages, 100);
        }
        cr_assert_eq(total, 27, "limit %d: %d runs", limits[li], total);
        for (int k = 0; k < 27; k++)
            cr_assert_eq(seen[k], 1, "limit %d: run %d seen %d times", limits[li], k, seen[k]);
        cr_assert_eq(pages, (27 + limits[li] - 1) / limits[li], "limit %d: %d pages", limits[li],
                     pages);
    }
}

Test(http, run_detail_and_streams_order)
{
    struct resp r;
    json_t *doc = get_json("/api/v1/runs/run-a", 200, &r);
    json_t *run = json_object_get(doc, "run");
    cr_assert_str_eq(json_string_value(json_object_get(run, "id")), "run-a");
    cr_assert_eq(jint(run, "reports"), 200);
    json_t *st = json_object_get(run, "streams_detail");
    cr_assert_eq(json_array_size(st), 3);
    static const struct {
        int attempt, rank, last_seq;
        double created;
    } want[] = {{0, 0, 93, 1000}, {0, 1, 100, 1000}, {1, 0, 7, 1500}};
    for (size_t i = 0; i < N(want); i++) {
        json_t *s = json_array_get(st, i);
        cr_assert_eq(jint(s, "attempt"), want[i].attempt);
        cr_assert_eq(jint(s, "rank"), want[i].rank);
        cr_assert_eq(jint(s, "last_seq"), want[i].last_seq);
        cr_assert_eq(jint(s, "reports"), want[i].last_seq);
        cr_assert_float_eq(jnum(s, "created_at"), want[i].created, 1e-9);
        cr_assert(json_is_number(json_object_get(s, "last_seen_at")));
    }
    resp_free(&r);

    /* names are URL-decoded */
    exec("INSERT INTO runs(name, created_at, last_seen_at, world_size) VALUES ('a:b.c', 1, 1, 4)");
    doc = get_json("/api/v1/runs/a%3Ab.c", 200, &r);
    run = json_object_get(doc, "run");
    cr_assert_str_eq(json_string_value(json_object_get(run, "id")), "a:b.c");
    cr_assert_eq(json_array_size(json_object_get(run, "streams_detail")), 0);
    resp_free(&r);
}

/* --- series -------------------------------------------------------------------------------- */

static void expect_series_ids(const char *path, const int *ids, size_t n)
{
    struct resp r;
    json_t *doc = get_json(path, 200, &r);
    json_t *arr = json_object_get(doc, "series");
    cr_assert_eq(json_array_size(arr), n, "%s: %zu series, expected %zu: %s", path,
                 json_array_size(arr), n, r.body);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(jint(json_array_get(arr, i), "id"), ids[i], "%s: item %zu", path, i);
    resp_free(&r);
}

Test(http, series_filters)
{
    static const struct {
        const char *query;
        int ids[8];
        size_t n;
    } cases[] = {
        {"run=run-a", {1, 2, 3, 4, 5, 6}, 6},
        {"run=run-a&name=loss", {1, 2}, 2},
        {"run=run-a&name=loss&rank=1", {2}, 1},
        {"run=run-a&rank=0", {1}, 1},
        {"run=run-a&prefix=qk.", {3, 4}, 2},
        {"run=run-a&prefix=qk.d2.en", {3}, 1},
        {"run=run-a&prefix=z", {0}, 0},
        {"run=run-a&layer=1", {4}, 1},
        {"run=run-a&head=1", {3}, 1},
        {"run=run-a&window=10", {3, 4}, 2},
        {"run=run-a&prefix=qk.&layer=0&head=1&window=10", {3}, 1},
        {"run=run-a&name=nope", {0}, 0},
        {"run=run-b", {0}, 0},
        {"run=run-a&after=4", {5, 6}, 2},
        {"run=run-a&name=loss&after=1", {2}, 1},
    };
    for (size_t i = 0; i < N(cases); i++) {
        char path[256];
        snprintf(path, sizeof path, "/api/v1/series?%s", cases[i].query);
        expect_series_ids(path, cases[i].ids, cases[i].n);
    }
}

Test(http, series_object_shape)
{
    struct resp r;
    json_t *doc = get_json("/api/v1/series?run=run-a", 200, &r);
    json_t *arr = json_object_get(doc, "series");
    cr_assert(json_is_null(json_object_get(doc, "next")));

    json_t *loss = json_array_get(arr, 0);
    cr_assert_str_eq(json_string_value(json_object_get(loss, "run")), "run-a");
    cr_assert_str_eq(json_string_value(json_object_get(loss, "name")), "loss");
    cr_assert_eq(jint(loss, "points"), 99);
    cr_assert_eq(jint(loss, "first_step"), 0);
    cr_assert_eq(jint(loss, "last_step"), 99);
    json_t *labels = json_object_get(loss, "labels");
    cr_assert_eq(json_object_size(labels), 1, "labels: only rank applies");
    cr_assert_eq(jint(labels, "rank"), 0);

    json_t *qk = json_array_get(arr, 2);
    labels = json_object_get(qk, "labels");
    cr_assert_eq(json_object_size(labels), 3);
    cr_assert_eq(jint(labels, "layer"), 0);
    cr_assert_eq(jint(labels, "head"), 1);
    cr_assert_eq(jint(labels, "window"), 10);

    json_t *router = json_array_get(arr, 4);
    labels = json_object_get(router, "labels");
    cr_assert_eq(json_object_size(labels), 1);
    cr_assert_eq(jint(labels, "layer"), 2);

    json_t *empty = json_array_get(arr, 5);
    cr_assert_eq(json_object_size(json_object_get(empty, "labels")), 0);
    cr_assert(json_is_null(json_object_get(empty, "first_step")));
    cr_assert(json_is_null(json_object_get(empty, "last_step")));
    resp_free(&r);
}

Test(http, series_pagination)
{
    struct resp r;
    json_t *doc = get_json("/api/v1/series?run=run-a&limit=4", 200, &r);
    cr_assert_eq(json_array_size(json_object_get(doc, "series")), 4);
    cr_assert_str_eq(json_string_value(json_object_get(doc, "next")), "4");
    resp_free(&r);
    doc = get_json("/api/v1/series?run=run-a&limit=4&after=4", 200, &r);
    cr_assert_eq(json_array_size(json_object_get(doc, "series")), 2);
    cr_assert(json_is_null(json_object_get(doc, "next")));
    resp_free(&r);
    /* exactly limit left: no empty trailing page */
    doc = get_json("/api/v1/series?run=run-a&limit=2&after=4", 200, &r);
    cr_assert_eq(json_array_size(json_object_get(doc, "series")), 2);
    cr_assert(json_is_null(json_object_get(doc, "next")));
    resp_free(&r);
}

/* --- points -------------------------------------------------------------------------------- */

Test(http, points_values_nulls_and_nonfinite)
{
    struct resp r;
    json_t *doc = get_json("/api/v1/series/1/points", 200, &r);
    cr_assert_eq(jint(json_object_get(doc, "series"), "id"), 1);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(doc, "series"), "run")),
                     "run-a");
    cr_assert(json_is_false(json_object_get(doc, "downsampled")));
    cr_assert(json_is_null(json_object_get(doc, "next_from")));
    json_t *pts = json_object_get(doc, "points");
    cr_assert_eq(json_array_size(pts), 100);
    for (int64_t s = 0; s < 100; s++) {
        json_t *p = json_array_get(pts, (size_t)s);
        cr_assert_eq(json_array_size(p), 2);
        cr_assert(json_is_integer(json_array_get(p, 0)), "step must be an integer");
        cr_assert_eq(json_integer_value(json_array_get(p, 0)), s);
        double v;
        json_t *jv = json_array_get(p, 1);
        if (loss_value(s, &v) && isfinite(v)) {
            cr_assert(json_is_real(jv), "step %lld: value must be a double", (long long)s);
            cr_assert_float_eq(json_real_value(jv), v, 1e-12);
        } else {
            cr_assert(json_is_null(jv), "step %lld: expected null", (long long)s);
        }
    }
    resp_free(&r);
}

Test(http, points_range_limit_next_from)
{
    static const struct {
        const char *query;
        int64_t first;
        size_t count;
        int64_t next_from; /* -1: null */
    } cases[] = {
        {"", 0, 100, -1},
        {"?limit=10", 0, 10, 10},
        {"?from=95", 95, 5, -1},
        {"?from=95&limit=5", 95, 5, -1},
        {"?from=95&limit=4", 95, 4, 99},
        {"?from=10&to=19", 10, 10, -1},
        {"?from=10&to=19&limit=3", 10, 3, 13},
        {"?from=99&to=99", 99, 1, -1},
        {"?from=100", 0, 0, -1},
        {"?to=0", 0, 1, -1},
        {"?from=9223372036854775807", 0, 0, -1},
    };
    for (size_t i = 0; i < N(cases); i++) {
        char path[128];
        snprintf(path, sizeof path, "/api/v1/series/2/points%s", cases[i].query);
        struct resp r;
        json_t *doc = get_json(path, 200, &r);
        json_t *pts = json_object_get(doc, "points");
        cr_assert_eq(json_array_size(pts), cases[i].count, "%s: %zu points", path,
                     json_array_size(pts));
        for (size_t k = 0; k < cases[i].count; k++) {
            json_t *p = json_array_get(pts, k);
            int64_t step = json_integer_value(json_array_get(p, 0));
            cr_assert_eq(step, cases[i].first + (int64_t)k, "%s", path);
            cr_assert_float_eq(json_real_value(json_array_get(p, 1)), (double)step, 1e-12);
        }
        json_t *nf = json_object_get(doc, "next_from");
        if (cases[i].next_from < 0)
            cr_assert(json_is_null(nf), "%s: next_from should be null", path);
        else
            cr_assert_eq(jint(doc, "next_from"), cases[i].next_from, "%s", path);
        resp_free(&r);
    }
}

Test(http, points_pages_cover_range_exactly_once)
{
    static const int limits[] = {1, 7, 30, 100, 10000};
    for (size_t li = 0; li < N(limits); li++) {
        int64_t from = 0, expect = 0;
        bool more = true;
        while (more) {
            char path[128];
            snprintf(path, sizeof path, "/api/v1/series/1/points?from=%lld&limit=%d",
                     (long long)from, limits[li]);
            struct resp r;
            json_t *doc = get_json(path, 200, &r);
            json_t *pts = json_object_get(doc, "points");
            size_t i;
            json_t *p;
            json_array_foreach(pts, i, p)
            {
                cr_assert_eq(json_integer_value(json_array_get(p, 0)), expect);
                expect++;
            }
            json_t *nf = json_object_get(doc, "next_from");
            more = !json_is_null(nf);
            if (more)
                from = json_integer_value(nf);
            resp_free(&r);
            cr_assert_leq(expect, 100);
        }
        cr_assert_eq(expect, 100, "limit %d: saw %lld points", limits[li], (long long)expect);
    }
}

/* --- downsampling -------------------------------------------------------------------------- */

struct bucket {
    int64_t step;
    double mean, min, max;
};

static void expect_buckets(const char *path, const struct bucket *b, size_t n, int64_t width)
{
    struct resp r;
    json_t *doc = get_json(path, 200, &r);
    cr_assert(json_is_true(json_object_get(doc, "downsampled")), "%s", path);
    cr_assert(json_is_null(json_object_get(doc, "next_from")), "%s", path);
    if (width > 0)
        cr_assert_eq(jint(doc, "bucket_width"), width, "%s", path);
    json_t *pts = json_object_get(doc, "points");
    cr_assert_eq(json_array_size(pts), n, "%s: %zu buckets, expected %zu", path,
                 json_array_size(pts), n);
    for (size_t i = 0; i < n; i++) {
        json_t *p = json_array_get(pts, i);
        cr_assert_eq(json_array_size(p), 4, "%s", path);
        cr_assert_eq(json_integer_value(json_array_get(p, 0)), b[i].step, "%s: bucket %zu", path,
                     i);
        const double want[3] = {b[i].mean, b[i].min, b[i].max};
        for (int k = 0; k < 3; k++) {
            json_t *v = json_array_get(p, (size_t)k + 1);
            if (isnan(want[k]))
                cr_assert(json_is_null(v), "%s: bucket %zu field %d should be null", path, i, k);
            else
                cr_assert_float_eq(json_number_value(v), want[k], 1e-9, "%s: bucket %zu field %d",
                                   path, i, k);
        }
    }
    resp_free(&r);
}

Test(http, downsampling_bucket_means)
{
    /* series 2: value == step, steps 0..99 */
    struct bucket ten[10];
    for (int i = 0; i < 10; i++)
        ten[i] = (struct bucket){10 * i, 10 * i + 4.5, 10 * i, 10 * i + 9};
    expect_buckets("/api/v1/series/2/points?max_points=10", ten, 10, 10);

    /* 100 steps / 3 buckets: width ceil(100/3) = 34 */
    const struct bucket three[] = {{0, 16.5, 0, 33}, {34, 50.5, 34, 67}, {68, 83.5, 68, 99}};
    expect_buckets("/api/v1/series/2/points?max_points=3", three, 3, 34);

    /* a sub-range: [10, 19] into 5 buckets of 2 */
    const struct bucket sub[] = {{10, 10.5, 10, 11},
                                 {12, 12.5, 12, 13},
                                 {14, 14.5, 14, 15},
                                 {16, 16.5, 16, 17},
                                 {18, 18.5, 18, 19}};
    expect_buckets("/api/v1/series/2/points?from=10&to=19&max_points=5", sub, 5, 2);

    /* one bucket */
    const struct bucket one[] = {{0, 49.5, 0, 99}};
    expect_buckets("/api/v1/series/2/points?max_points=1", one, 1, 100);

    /* more buckets than points: one bucket per point */
    struct bucket all[100];
    for (int i = 0; i < 100; i++)
        all[i] = (struct bucket){i, i, i, i};
    expect_buckets("/api/v1/series/2/points?max_points=5000", all, 100, 1);

    /* no points at all */
    expect_buckets("/api/v1/series/6/points?max_points=10", NULL, 0, 0);
    expect_buckets("/api/v1/series/2/points?from=500&max_points=10", NULL, 0, 0);
}

Test(http, downsampling_nulls_and_infinities)
{
    /* series 1 at width 1: step 50 is SQL NULL, 60/61 are +-Inf: all null */
    struct bucket b[100];
    for (int64_t s = 0; s < 100; s++) {
        double v;
        bool num = loss_value(s, &v) && isfinite(v);
        b[s] = (struct bucket){s, num ? v : NAN, num ? v : NAN, num ? v : NAN};
    }
    expect_buckets("/api/v1/series/1/points?max_points=100", b, 100, 1);

    /* [50, 51]: the NULL is skipped by avg/min/max */
    const struct bucket skip[] = {{50, 25.5, 25.5, 25.5}};
    expect_buckets("/api/v1/series/1/points?from=50&to=51&max_points=1", skip, 1, 2);

    /* [59, 61]: +Inf and -Inf in one bucket: no mean, no finite min/max */
    const struct bucket inf[] = {{59, NAN, NAN, NAN}};
    expect_buckets("/api/v1/series/1/points?from=59&to=61&max_points=1", inf, 1, 3);
}

/* --- errors -------------------------------------------------------------------------------- */

Test(http, garbage_parameters_are_400_naming_the_parameter)
{
    static const struct {
        const char *path;
        const char *mention;
    } cases[] = {
        {"/api/v1/runs?limit=abc", "'limit'"},
        {"/api/v1/runs?limit=0", "'limit'"},
        {"/api/v1/runs?limit=-1", "'limit'"},
        {"/api/v1/runs?limit=10001", "'limit'"},
        {"/api/v1/runs?limit=99999999999999999999", "'limit'"},
        {"/api/v1/runs?limit=", "'limit'"},
        {"/api/v1/runs?limit", "'limit'"},
        {"/api/v1/runs?limit=%2010", "'limit'"},
        {"/api/v1/runs?limit=10%20", "'limit'"},
        {"/api/v1/runs?limit=+10", "'limit'"},
        {"/api/v1/runs?limit=0x10", "'limit'"},
        {"/api/v1/runs?limit=1e3", "'limit'"},
        {"/api/v1/runs?after=zz", "'after'"},
        {"/api/v1/runs?after=-3", "'after'"},
        {"/api/v1/runs?bogus=1", "'bogus'"},
        {"/api/v1/runs?limit=5&limit=6", "'limit'"},
        {"/api/v1/series", "'run'"},
        {"/api/v1/series?run=", "'run'"},
        {"/api/v1/series?run=run-a&layer=-5", "'layer'"},
        {"/api/v1/series?run=run-a&layer=x", "'layer'"},
        {"/api/v1/series?run=run-a&head=1.5", "'head'"},
        {"/api/v1/series?run=run-a&window=0", "'window'"},
        {"/api/v1/series?run=run-a&rank=-1", "'rank'"},
        {"/api/v1/series?run=run-a&rank=4294967296", "'rank'"},
        {"/api/v1/series?run=run-a&name=", "'name'"},
        {"/api/v1/series?run=run-a&name=loss&prefix=l", "'prefix'"},
        {"/api/v1/series?run=run-a&after=zz", "'after'"},
        {"/api/v1/series/1/points?from=1x", "'from'"},
        {"/api/v1/series/1/points?from=-1", "'from'"},
        {"/api/v1/series/1/points?to=", "'to'"},
        {"/api/v1/series/1/points?from=5&to=4", "'from'"},
        {"/api/v1/series/1/points?max_points=0", "'max_points'"},
        {"/api/v1/series/1/points?max_points=5001", "'max_points'"},
        {"/api/v1/series/1/points?max_points=10&limit=5", "'max_points'"},
        {"/api/v1/series/1/points?limit=0", "'limit'"},
        {"/api/v1/series/abc/points", "'id'"},
        {"/api/v1/series/0/points", "'id'"},
        {"/api/v1/series/-1/points", "'id'"},
        {"/api/v1/series/99999999999999999999/points", "'id'"},
        {"/api/v1/runs/run-a?x=1", "'x'"},
    };
    for (size_t i = 0; i < N(cases); i++)
        expect_error(NULL, cases[i].path, 400, "bad_request", cases[i].mention);

    /* an over-long value */
    char path[1024];
    int n = snprintf(path, sizeof path, "/api/v1/series?run=");
    memset(path + n, 'x', 300);
    path[n + 300] = '\0';
    expect_error(NULL, path, 400, "bad_request", "'run'");
}

Test(http, not_found)
{
    static const struct {
        const char *path;
        const char *mention;
    } cases[] = {
        {"/static/nope.js", "/static/nope.js"}, /* "/" is the dashboard (test_dashboard.py) */
        {"/nope", "/nope"},
        {"/api/v1", NULL},
        {"/api/v1/runs/", NULL},
        {"/api/v1/runs/nosuch", "nosuch"},
        {"/api/v1/runs/run-a/extra", NULL},
        {"/api/v1/series?run=nosuch", "nosuch"},
        {"/api/v1/series/9999/points", "9999"},
        {"/api/v1/series/1", NULL},
        {"/api/v2/runs", NULL},
    };
    for (size_t i = 0; i < N(cases); i++)
        expect_error(NULL, cases[i].path, 404, "not_found", cases[i].mention);
}

Test(http, other_methods_are_405_with_allow)
{
    static const char *const methods[] = {"POST", "PUT", "DELETE", "PATCH"};
    for (size_t i = 0; i < N(methods); i++) {
        expect_error(methods[i], "/api/v1/runs", 405, "method_not_allowed", methods[i]);
        struct resp r;
        request(NULL, methods[i], "/healthz", NULL, &r);
        cr_assert_eq(r.status, 405);
        cr_assert_str_eq(r.allow, "GET, HEAD", "%s: Allow '%s'", methods[i], r.allow);
        resp_free(&r);
    }
    /* a small body is read and ignored; the answer is still 405 */
    struct resp r;
    request(NULL, "POST", "/api/v1/runs", "{\"x\":1}", &r);
    cr_assert_eq(r.status, 405);
    cr_assert_str_eq(r.allow, "GET, HEAD");
    resp_free(&r);

    /* a large body is refused */
    char *big = malloc(64 * 1024 + 1);
    memset(big, 'a', 64 * 1024);
    big[64 * 1024] = '\0';
    request(NULL, "POST", "/api/v1/runs", big, &r);
    cr_assert_eq(r.status, 413, "status %ld", r.status);
    cr_assert_not_null(r.json);
    resp_free(&r);

    /* a chunked body (no Content-Length) that grows past the bound: the
     * connection is closed; the server keeps serving */
    CURL *c = curl_easy_init();
    char url[128];
    snprintf(url, sizeof url, "http://127.0.0.1:%u/api/v1/runs", http_fx.port);
    struct curl_slist *hdr = curl_slist_append(NULL, "Transfer-Encoding: chunked");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, big);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 60L);
    CURLcode cc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    cr_assert(cc != CURLE_OK || status != 405, "oversized chunked body was accepted");
    curl_easy_cleanup(c);
    curl_slist_free_all(hdr);
    resp_free(&r);
    free(big);

    struct resp ok;
    json_t *doc = get_json("/healthz", 200, &ok);
    cr_assert_not_null(doc);
    resp_free(&ok);
}

Test(http, head_has_headers_only)
{
    struct resp r;
    request(NULL, "HEAD", "/api/v1/runs", NULL, &r);
    cr_assert_eq(r.status, 200);
    cr_assert_eq(r.len, 0);
    cr_assert_str_eq(r.ctype, "application/json");
    resp_free(&r);
}

/* --- connections, counters, concurrency ----------------------------------------------------- */

Test(http, keep_alive_reuses_the_connection)
{
    CURL *h = curl_easy_init();
    cr_assert_not_null(h);
    static const char *const paths[] = {"/healthz", "/api/v1/runs", "/api/v1/series/1/points",
                                        "/nope", "/api/v1/runs?limit=abc"};
    for (size_t i = 0; i < N(paths); i++) {
        struct resp r;
        request(h, NULL, paths[i], NULL, &r);
        cr_assert_eq(r.new_conns, i == 0 ? 1 : 0, "%s: %ld new connections", paths[i], r.new_conns);
        resp_free(&r);
    }
    curl_easy_cleanup(h);
}

Test(http, counts_requests_and_errors)
{
    static const struct {
        const char *path;
        long status;
    } cases[] = {
        {"/healthz", 200},
        {"/api/v1/runs", 200},
        {"/nope", 404},
        {"/api/v1/runs?limit=0", 400},
        {"/api/v1/runs/run-a", 200},
    };
    uint64_t errors = 0;
    for (size_t i = 0; i < N(cases); i++) {
        struct resp r;
        request(NULL, NULL, cases[i].path, NULL, &r);
        cr_assert_eq(r.status, cases[i].status, "%s", cases[i].path);
        errors += cases[i].status >= 400;
        resp_free(&r);
    }
    cr_assert_eq(atomic_load(&http_fx.stats.http_requests), N(cases));
    cr_assert_eq(atomic_load(&http_fx.stats.http_errors), errors);
}

#define WRITER_BATCHES 40
#define WRITER_BATCH 50

static atomic_int writer_done; /* 1 ok, -1 failed */

static void *writer_main(void *arg)
{
    (void)arg;
    /* its own connection: the fixture's rw belongs to the test thread */
    sqlite3 *w = NULL;
    if (sqlite3_open(http_fx.db.path, &w) != SQLITE_OK) {
        atomic_store(&writer_done, -1);
        return NULL;
    }
    sqlite3_busy_timeout(w, 10000);
    sqlite3_stmt *ins = NULL, *upd = NULL;
    int bad = sqlite3_prepare_v2(w,
                                 "INSERT INTO points(series_id, step, value, time) "
                                 "VALUES (7, ?1, ?1, 0)",
                                 -1, &ins, NULL) != SQLITE_OK ||
              sqlite3_prepare_v2(w,
                                 "UPDATE series SET points = points + ?1, "
                                 "first_step = coalesce(first_step, 0), last_step = ?2 "
                                 "WHERE id = 7",
                                 -1, &upd, NULL) != SQLITE_OK;
    for (int b = 0; !bad && b < WRITER_BATCHES; b++) {
        bad |= sqlite3_exec(w, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK;
        for (int i = 0; !bad && i < WRITER_BATCH; i++) {
            sqlite3_bind_int64(ins, 1, (int64_t)b * WRITER_BATCH + i);
            bad |= sqlite3_step(ins) != SQLITE_DONE;
            sqlite3_reset(ins);
        }
        sqlite3_bind_int64(upd, 1, WRITER_BATCH);
        sqlite3_bind_int64(upd, 2, (int64_t)(b + 1) * WRITER_BATCH - 1);
        bad |= sqlite3_step(upd) != SQLITE_DONE;
        sqlite3_reset(upd);
        bad |= sqlite3_exec(w, "COMMIT", NULL, NULL, NULL) != SQLITE_OK;
    }
    sqlite3_finalize(ins);
    sqlite3_finalize(upd);
    sqlite3_close(w);
    atomic_store(&writer_done, bad ? -1 : 1);
    return NULL;
}

Test(http, readers_beside_a_committing_writer)
{
    exec("INSERT INTO series(id, run_id, name, rank) VALUES (7, 1, 'live', 3)");
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, writer_main, NULL), 0);
    /* Each response is one committed snapshot: the series row's count
     * equals the points returned, and counts never go backwards. */
    int64_t last = -1;
    bool done = false;
    CURL *h = curl_easy_init();
    for (int i = 0; !done || last < WRITER_BATCHES * WRITER_BATCH; i++) {
        /* read the flag before the request: once it is set, this request
         * sees every batch */
        int state = atomic_load(&writer_done);
        cr_assert_geq(state, 0, "writer failed");
        done = state == 1;
        struct resp r;
        request(h, NULL, "/api/v1/series/7/points?limit=10000", NULL, &r);
        cr_assert_eq(r.status, 200, "%s", r.body);
        cr_assert_not_null(r.json);
        int64_t count = jint(json_object_get(r.json, "series"), "points");
        size_t got = json_array_size(json_object_get(r.json, "points"));
        cr_assert_eq((int64_t)got, count, "snapshot: series says %lld, points %zu",
                     (long long)count, got);
        cr_assert_eq(count % WRITER_BATCH, 0, "a batch seen half-committed");
        cr_assert_geq(count, last);
        last = count;
        resp_free(&r);
        cr_assert(!done || last == WRITER_BATCHES * WRITER_BATCH, "missed committed batches");
        cr_assert_lt(i, 1000000);
    }
    pthread_join(t, NULL);
    curl_easy_cleanup(h);
    cr_assert_eq(last, WRITER_BATCHES * WRITER_BATCH);
}

Test(http, many_sequential_requests_single_thread_server)
{
    http_stop(http_fx.srv);
    http_fx.srv = NULL;
    http_fixture_start(1);
    CURL *h = curl_easy_init();
    for (int i = 0; i < 200; i++) {
        struct resp r;
        request(h, NULL, i % 2 ? "/api/v1/runs" : "/api/v1/series?run=run-a", NULL, &r);
        cr_assert_eq(r.status, 200);
        resp_free(&r);
    }
    curl_easy_cleanup(h);
}

/* --- start-up errors ----------------------------------------------------------------------- */

Test(http, start_errors)
{
    char missing[160], empty[160];
    snprintf(missing, sizeof missing, "%s/missing.db", http_fx.db.dir);
    snprintf(empty, sizeof empty, "%s/empty.db", http_fx.db.dir);
    sqlite3 *e = NULL;
    cr_assert_eq(sqlite3_open(empty, &e), SQLITE_OK);
    cr_assert_eq(sqlite3_exec(e, "CREATE TABLE other(x)", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(e);

    static const struct {
        const char *host;
        int db; /* 0 good, 1 missing, 2 no schema */
        unsigned threads;
        int same_port;
        const char *mention;
    } cases[] = {
        {.host = "127.0.0.1", .db = 0, .threads = 0, .mention = "threads"},
        {.host = "127.0.0.1", .db = 0, .threads = HTTP_MAX_THREADS + 1, .mention = "threads"},
        {.host = "127.0.0.1", .db = 1, .threads = 1, .mention = "missing.db"},
        {.host = "127.0.0.1", .db = 2, .threads = 1, .mention = "schema"},
        {.host = "not an address", .db = 0, .threads = 1, .mention = "not an address"},
        {.host = "127.0.0.1", .db = 0, .threads = 1, .same_port = 1, .mention = "listen"},
    };
    for (size_t i = 0; i < N(cases); i++) {
        struct http_opts o = {.host = cases[i].host,
                              .port = cases[i].same_port ? http_fx.port : 0,
                              .db_path = cases[i].db == 0   ? http_fx.db.path
                                         : cases[i].db == 1 ? missing
                                                            : empty,
                              .threads = cases[i].threads,
                              .stats = &http_fx.stats};
        struct http *h = (struct http *)1;
        struct fs_err err = {0};
        int rc = http_start(&o, &h, &err);
        cr_assert_lt(rc, 0, "case %zu started", i);
        cr_assert_null(h, "case %zu", i);
        cr_assert(strstr(err.msg, cases[i].mention), "case %zu: '%s' lacks '%s'", i, err.msg,
                  cases[i].mention);
    }
    unlink(empty);
    http_stop(NULL);
}

Test(http, ipv6_loopback_and_stop_with_idle_connections)
{
    struct http_opts o = {.host = "::1",
                          .port = 0,
                          .db_path = http_fx.db.path,
                          .threads = 2,
                          .stats = &http_fx.stats};
    struct http *h6 = NULL;
    struct fs_err err = {0};
    int rc = http_start(&o, &h6, &err);
    if (rc != 0) {
        cr_log_warn("no IPv6 loopback here: %s", err.msg);
        return;
    }
    CURL *c = curl_easy_init();
    char url[128];
    snprintf(url, sizeof url, "http://[::1]:%u/healthz", http_port(h6));
    struct resp r = {0};
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    cr_assert_eq(curl_easy_perform(c), CURLE_OK);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
    cr_assert_eq(r.status, 200);
    /* the keep-alive connection is still open while the server stops */
    http_stop(h6);
    curl_easy_cleanup(c);
    free(r.body);
}
