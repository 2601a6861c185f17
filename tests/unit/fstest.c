/* fstest.h: the temporary database, SQL helpers, seeded random numbers,
 * random SPD matrices and the spectrum reference. */
#include "fstest.h"

#include <criterion/criterion.h>

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "detect.h"
#include "schema.h"
#include "spectrum.h"

/* ---- temporary database ---------------------------------------------------------------- */

void tmpdb_make(struct tmpdb *t, const char *tag)
{
    memset(t, 0, sizeof(*t));
    int n = snprintf(t->dir, sizeof(t->dir), "/tmp/fs-%s-XXXXXX", tag);
    cr_assert(n > 0 && (size_t)n < sizeof(t->dir), "tmpdb tag too long: %s", tag);
    cr_assert_not_null(mkdtemp(t->dir), "mkdtemp %s: %s", t->dir, strerror(errno));
    snprintf(t->path, sizeof(t->path), "%s/t.db", t->dir);
}

void tmpdb_remove(const struct tmpdb *t)
{
    if (!t->dir[0])
        return;
    char cmd[sizeof(t->dir) + 16];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", t->dir);
    cr_expect_eq(system(cmd), 0, "%s", cmd);
}

/* ---- SQL on the test's own connection -------------------------------------------------- */

void db_exec(sqlite3 *db, const char *sql)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    cr_assert_eq(rc, SQLITE_OK, "sql failed: %s: %s", sql, msg ? msg : "?");
}

sqlite3_stmt *db_prep(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *st = NULL;
    cr_assert_eq(sqlite3_prepare_v2(db, sql, -1, &st, NULL), SQLITE_OK, "%s: %s", sql,
                 sqlite3_errmsg(db));
    return st;
}

void db_step_done(sqlite3 *db, sqlite3_stmt *st)
{
    cr_assert_eq(sqlite3_step(st), SQLITE_DONE, "%s", sqlite3_errmsg(db));
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
}

/* sql prepared and stepped to its first row (asserted); the caller finalizes. */
static sqlite3_stmt *first_row(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *st = db_prep(db, sql);
    int rc = sqlite3_step(st);
    cr_assert_eq(rc, SQLITE_ROW, "%s: no row (%s)", sql, sqlite3_errmsg(db));
    return st;
}

int64_t q1(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *st = first_row(db, sql);
    int64_t v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return v;
}

double qd(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *st = first_row(db, sql);
    double v = sqlite3_column_double(st, 0);
    sqlite3_finalize(st);
    return v;
}

int64_t q1_path(const char *path, const char *sql)
{
    sqlite3 *db;
    cr_assert_eq(sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL), SQLITE_OK, "open %s",
                 path);
    int64_t v = q1(db, sql);
    sqlite3_close(db);
    return v;
}

void db_apply_schema(sqlite3 *db, bool wal, bool user_version)
{
    if (wal)
        db_exec(db, "PRAGMA journal_mode=WAL");
    for (int i = 0; i < schema_migration_count; i++) {
        db_exec(db, schema_migrations[i].sql);
        if (!user_version)
            continue;
        char pragma[64];
        snprintf(pragma, sizeof(pragma), "PRAGMA user_version=%d", schema_migrations[i].version);
        db_exec(db, pragma);
    }
}

/* ---- seeded random numbers -------------------------------------------------------------- */

uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double uniform01(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) / 9007199254740992.0;
}

double gauss(uint64_t *s)
{
    double u = ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
    double v = (double)(rng_next(s) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

double *randn(size_t len, double scale, uint64_t *seed)
{
    double *x = malloc(len * sizeof(*x));
    cr_assert_not_null(x);
    for (size_t i = 0; i < len; i++)
        x[i] = scale * gauss(seed);
    return x;
}

double uniform(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    uint64_t r = *s * 0x2545F4914F6CDD1Dull;
    return (double)(r >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* ---- random SPD matrices ----------------------------------------------------------------- */

void gram_tri_add(const double *m, size_t n, size_t d, size_t c0, size_t c1, double *tri)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = i; j < n; j++, k++) {
            double s = 0;
            for (size_t c = c0; c < c1; c++)
                s += m[i * d + c] * m[j * d + c];
            tri[k] += s;
        }
}

unsigned char *tri_to_f32le(const double *tri, size_t len)
{
    unsigned char *b = malloc(len * 4);
    cr_assert_not_null(b);
    for (size_t k = 0; k < len; k++) {
        float f = (float)tri[k];
        uint32_t u;
        memcpy(&u, &f, 4);
        b[4 * k] = (unsigned char)u;
        b[4 * k + 1] = (unsigned char)(u >> 8);
        b[4 * k + 2] = (unsigned char)(u >> 16);
        b[4 * k + 3] = (unsigned char)(u >> 24);
    }
    return b;
}

/* ---- spectrum reference ------------------------------------------------------------------- */

struct spectrum_scalars ref_scalars(const double *s, size_t count, size_t m)
{
    struct spectrum_scalars o = {0};
    double mx = 0;
    for (size_t i = 0; i < count; i++)
        mx = fmax(mx, s[i]);
    if (!(mx > 0))
        return o;
    double floor = mx * (double)m * DBL_EPSILON;
    long double sum = 0, sig = 0;
    for (size_t i = 0; i < count; i++)
        if (s[i] >= floor) {
            sum += s[i];
            sig += sqrtl(s[i]);
            o.rank++;
        }
    long double h2 = 0, h1 = 0;
    for (size_t i = 0; i < count; i++)
        if (s[i] >= floor) {
            long double p2 = s[i] / sum, p1 = sqrtl(s[i]) / sig;
            h2 -= p2 * logl(p2);
            h1 -= p1 * logl(p1);
        }
    o.present = true;
    o.entropy2 = (double)h2;
    o.entropy1 = (double)h1;
    o.erank2 = (double)expl(h2);
    o.erank1 = (double)expl(h1);
    o.srank = (double)(sum / mx);
    o.fro = (double)sqrtl(sum);
    o.smax = sqrt(mx);
    return o;
}

/* ---- detector rules ----------------------------------------------------------------------- */

struct detect_rule rule_named(const char *name)
{
    struct detect_rules rules;
    detect_rules_default(&rules);
    const struct detect_rule *r = detect_rules_find(&rules, name);
    cr_assert_not_null(r, "no default rule %s", name);
    return *r;
}

bool same_double(double a, double b)
{
    return memcmp(&a, &b, sizeof(a)) == 0;
}
