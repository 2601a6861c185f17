/* Silence sets: a build compiles only the rows new to it (a table of reads
 * in turn, each with the compiles it may cost), a stored row over today's
 * bounds kept as matching nothing and reported once, bad row orders and
 * counts, and the cache shared by threads that build in turn (ASan checks
 * the reference counting). */
#include <criterion/criterion.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "silence_set.h"

#define N(a) (sizeof(a) / sizeof((a)[0]))

static const char *const M_RUN_A = "[{\"name\":\"run\",\"value\":\"a\"}]";
static const char *const M_QK =
    "[{\"name\":\"alertname\",\"value\":\"qk\\\\..*\",\"isRegex\":true}]";
static const char *const M_NOT_WARN = "[{\"name\":\"run\",\"value\":\"b\"},"
                                      "{\"name\":\"severity\",\"value\":\"warn.*\","
                                      "\"isRegex\":true,\"isEqual\":false}]";
/* glibc took 40 s and 11.8 GB for the middle group alone; PCRE2 refuses
 * the whole as too large: a row an older version stored */
static const char *const M_HOSTILE =
    "[{\"name\":\"alertname\",\"value\":\"x\"},"
    "{\"name\":\"run\",\"value\":\"((a{0,255}){0,255}){0,255}\",\"isRegex\":true}]";

static struct silence_row row(int64_t id, const char *json, double ends_at)
{
    return (struct silence_row){
        .id = id, .starts_at = 10, .ends_at = ends_at, .json = json, .len = strlen(json)};
}

/* Builds rows[0..n) on top of prev; *parsed, *reported: rows parsed, rows
 * reported as matching nothing. */
static struct silence_set *build(struct silence_set *prev, const struct silence_row *rows, size_t n,
                                 unsigned *parsed, unsigned *reported)
{
    struct silence_build b;
    silence_build_start(&b, prev, 100);
    *reported = 0;
    for (size_t i = 0; i < n; i++) {
        struct fs_err why = {0};
        int rc = silence_build_row(&b, &rows[i], &why);
        cr_assert(rc == 0 || rc == 1, "row %zu: %d", i, rc);
        if (rc == 1) {
            cr_expect(strstr(why.msg, "too large"), "row %zu: %s", i, why.msg);
            (*reported)++;
        }
    }
    *parsed = b.parsed;
    struct silence_set *s = silence_build_finish(&b);
    cr_assert_not_null(s);
    return s;
}

/* ids of the silences of s that match the labels at now=50 */
static size_t matching(const struct silence_set *s, const char *alertname, const char *run,
                       const char *severity, int64_t *ids)
{
    struct silence_label l[] = {{"alertname", alertname}, {"run", run}, {"severity", severity}};
    size_t k = 0;
    for (size_t i = 0; i < s->n; i++)
        if (silence_matches(&s->v[i], l, N(l), 50))
            ids[k++] = s->v[i].id;
    return k;
}

#define MAX_ROWS 5
struct read_case {
    const char *what;
    size_t n;
    struct silence_row rows[MAX_ROWS];
    unsigned parsed;   /* rows compiled by this read's build */
    unsigned reported; /* rows reported as matching nothing */
    int same;          /* 1: the previous set itself */
};

Test(silence_set, reads_in_turn_compile_only_what_is_new)
{
    const struct read_case reads[] = {
        {"first read",
         3,
         {row(1, M_RUN_A, 100), row(2, M_QK, 100), row(5, M_HOSTILE, 100)},
         3,
         1,
         0},
        {"the same rows",
         3,
         {row(1, M_RUN_A, 100), row(2, M_QK, 100), row(5, M_HOSTILE, 100)},
         0,
         0,
         1},
        {"one new row",
         4,
         {row(1, M_RUN_A, 100), row(2, M_QK, 100), row(5, M_HOSTILE, 100), row(6, M_NOT_WARN, 100)},
         1,
         0,
         0},
        {"one gone",
         3,
         {row(2, M_QK, 100), row(5, M_HOSTILE, 100), row(6, M_NOT_WARN, 100)},
         0,
         0,
         0},
        {"the last gone", 2, {row(2, M_QK, 100), row(5, M_HOSTILE, 100)}, 0, 0, 0},
        {"expired: new times", 2, {row(2, M_QK, 40), row(5, M_HOSTILE, 100)}, 0, 0, 0},
        {"an id reused, new matchers", 2, {row(2, M_QK, 40), row(5, M_RUN_A, 100)}, 1, 0, 0},
        {"none", 0, {{0}}, 0, 0, 0},
        {"none again", 0, {{0}}, 0, 0, 1},
    };
    struct silence_set *prev = NULL;
    for (size_t i = 0; i < N(reads); i++) {
        const struct read_case *r = &reads[i];
        unsigned parsed, reported;
        struct silence_set *s = build(prev, r->rows, r->n, &parsed, &reported);
        cr_expect_eq(parsed, r->parsed, "read %zu (%s): parsed %u", i, r->what, parsed);
        cr_expect_eq(reported, r->reported, "read %zu (%s)", i, r->what);
        cr_expect_eq(s == prev, (bool)r->same, "read %zu (%s)", i, r->what);
        cr_assert_eq(s->n, r->n, "read %zu (%s)", i, r->what);
        for (size_t k = 0; k < r->n; k++) {
            cr_expect_eq(s->v[k].id, r->rows[k].id, "read %zu row %zu", i, k);
            cr_expect_eq(s->v[k].ends_at, r->rows[k].ends_at, "read %zu row %zu", i, k);
        }
        silence_set_unref(prev); /* s must not depend on it */
        prev = s;
        if (i == 3) {
            int64_t ids[MAX_ROWS];
            /* the stored hostile row matches nothing, whatever the labels */
            cr_expect_eq(matching(s, "x", "a", "warning", ids), 0u);
            cr_expect_eq(matching(s, "qk.d2.erank", "b", "critical", ids), 2u);
            cr_expect_eq(ids[0], 2);
            cr_expect_eq(ids[1], 6);
            cr_expect_eq(matching(s, "qk.d2.erank", "b", "warning", ids), 1u);
        }
        if (i == 5) {
            int64_t ids[MAX_ROWS];
            cr_expect_eq(matching(s, "qk.d2.erank", "b", "warning", ids), 0u, "expired at 40");
        }
    }
    silence_set_unref(prev);
}

Test(silence_set, bad_row_order_or_count_fails_the_build)
{
    static const struct {
        int64_t ids[3];
        size_t n, max;
        int want; /* of the last row */
    } cases[] = {
        {{1, 2, 2}, 3, 10, -EINVAL},
        {{3, 2, 0}, 2, 10, -EINVAL},
        {{1, 2, 3}, 3, 2, -ENOSPC},
    };
    for (size_t i = 0; i < N(cases); i++) {
        struct silence_build b;
        silence_build_start(&b, NULL, cases[i].max);
        int rc = 0;
        for (size_t k = 0; k < cases[i].n; k++)
            rc = silence_build_row(
                &b,
                &(struct silence_row){
                    .id = cases[i].ids[k], .ends_at = 100, .json = M_RUN_A, .len = strlen(M_RUN_A)},
                NULL);
        cr_expect_eq(rc, cases[i].want, "case %zu", i);
        cr_expect_null(silence_build_finish(&b), "case %zu", i);
    }
}

/* HTTP handler threads in turn: each gets the cached set, builds on it from
 * its own read, puts the result and matches with it, while the reads keep
 * changing. */
#define CACHE_THREADS 4
#define CACHE_ROUNDS 200

static struct silence_cache cache;

static void *reader(void *arg)
{
    size_t t = (size_t)arg;
    for (size_t r = 0; r < CACHE_ROUNDS; r++) {
        /* two reads alternate: with and without silence 3 */
        struct silence_row rows[] = {row(1, M_RUN_A, 100), row(2, M_QK, 100),
                                     row(3, M_NOT_WARN, 100)};
        size_t n = (r + t) % 2 == 0 ? 3 : 2;
        struct silence_set *prev = silence_cache_get(&cache);
        struct silence_build b;
        silence_build_start(&b, prev, 10);
        for (size_t i = 0; i < n; i++)
            if (silence_build_row(&b, &rows[i], NULL) != 0)
                return "row";
        struct silence_set *s = silence_build_finish(&b);
        if (!s)
            return "finish";
        if (s != prev)
            silence_cache_put(&cache, s);
        silence_set_unref(prev);
        int64_t ids[3];
        size_t k = matching(s, "qk.x", "b", "critical", ids);
        silence_set_unref(s);
        if (k != n - 1)
            return "match";
    }
    return NULL;
}

Test(silence_set, cache_shared_by_threads_building_in_turn)
{
    cr_assert_eq(silence_cache_init(&cache), 0);
    pthread_t th[CACHE_THREADS];
    for (size_t i = 0; i < CACHE_THREADS; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, reader, (void *)i), 0);
    for (size_t i = 0; i < CACHE_THREADS; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        cr_expect_null(ret, "thread %zu: %s", i, ret ? (const char *)ret : "");
    }
    struct silence_set *s = silence_cache_get(&cache);
    cr_expect_not_null(s);
    silence_set_unref(s);
    silence_cache_destroy(&cache);
}
