#ifndef FORESHOCK_FSTEST_H
#define FORESHOCK_FSTEST_H

/* What the unit tests share, in the spirit of libuv's test/task.h: the
 * fixtures and helpers that several test files used to copy.
 *
 *   tmpdb_*          a temporary directory with a database path in it, removed
 *                    with everything the test left there (-wal, -shm, spool)
 *   db_*, q1, qd     SQL on a connection of the test's own: exec, prepare,
 *                    one-value queries, the daemon's migrations
 *   rng_next ...     seeded random numbers (the same seed, the same numbers)
 *   gram_tri_add     random SPD matrices: packed upper triangles of M M^T,
 *                    whole or per column shard, as a trainer sends them;
 *                    tri_to_f32le, their float32 wire bytes
 *   ref_scalars      the spectrum scalars of docs/monitors.md 1.3, computed directly
 *   rule_named       a default detector rule by name; same_double
 *   request ...      HTTP requests through libcurl, answers parsed by jansson
 *   http_fixture_*   the HTTP API server on 127.0.0.1:0 over a temporary
 *                    database with every migration applied
 *
 * Contract: every helper asserts (cr_assert) instead of returning an error,
 * so a fixture that cannot be built fails the test that asked for it, with
 * the reason. Criterion runs each test in its own process: the one global
 * (http_fx) is per test, and nothing here locks. The helpers run on the
 * test's thread unless a comment says otherwise. The names that the tests
 * already used (rng_next, gauss, request, get_json, ...) are kept, so a
 * test reads as it did before its copy went. Built into the static library
 * fs_test (tests/CMakeLists.txt) that every unit test links. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <curl/curl.h>
#include <jansson.h>
#include <sqlite3.h>

#include "http.h"

#define N(a) (sizeof(a) / sizeof((a)[0]))

/* ---- temporary database ---------------------------------------------------------------- */

struct tmpdb {
    char dir[64];   /* /tmp/fs-TAG-XXXXXX, made by mkdtemp */
    char path[128]; /* dir/t.db: nothing is created there */
};

/* Makes a fresh directory /tmp/fs-TAG-XXXXXX (tag: a few letters that say
 * which test file left it behind) and sets t->path to t.db inside it. */
void tmpdb_make(struct tmpdb *t, const char *tag);

/* Removes t->dir and everything in it (the database, its -wal and -shm, a
 * spool log beside it). Expects (cr_expect) that it worked. */
void tmpdb_remove(const struct tmpdb *t);

/* ---- SQL on the test's own connection -------------------------------------------------- */

/* sqlite3_exec of sql; asserts SQLITE_OK and names the statement if not. */
void db_exec(sqlite3 *db, const char *sql);

/* sqlite3_prepare_v2 of sql; asserts success. The caller finalizes. */
sqlite3_stmt *db_prep(sqlite3 *db, const char *sql);

/* Steps st to SQLITE_DONE (asserted), then resets it and clears its
 * bindings for the next row. */
void db_step_done(sqlite3 *db, sqlite3_stmt *st);

/* The first column of the first row of sql (asserted to exist). */
int64_t q1(sqlite3 *db, const char *sql);
double qd(sqlite3 *db, const char *sql);

/* q1 on a read-only connection of its own to the database at path. */
int64_t q1_path(const char *path, const char *sql);

/* The daemon's migrations (schema_migrations[]) in order, as the writer
 * applies them. wal: journal_mode=WAL first (a server reads beside the
 * test's connection); user_version: set PRAGMA user_version after each. */
void db_apply_schema(sqlite3 *db, bool wal, bool user_version);

/* ---- seeded random numbers -------------------------------------------------------------- */

/* splitmix64: the next 64 random bits of the stream *s. */
uint64_t rng_next(uint64_t *s);

/* Uniform in [0, 1), 53 bits, from rng_next. */
double uniform01(uint64_t *s);

/* Standard normal (Box-Muller on two rng_next draws). */
double gauss(uint64_t *s);

/* len values of scale * gauss (malloc'd; the caller frees). */
double *randn(size_t len, double scale, uint64_t *seed);

/* xorshift64* noise, uniform in [-1, 1): the detector and lifecycle tests'
 * own stream (their expected verdicts are tuned to it). *s must not be 0. */
double uniform(uint64_t *s);

/* ---- random SPD matrices ----------------------------------------------------------------- */

/* Adds the Gram matrix M M^T of the n x d row-major M, over the columns
 * [c0, c1) only, to tri: its upper triangle, row-major, n(n+1)/2 values
 * (the layout of fsc_gram_upper and monitor_tri_accumulate). Summing the
 * shards [0, c1) + [c1, d) gives the whole Gram, as the daemon sums a
 * model-parallel trainer's shards. With M drawn by randn the result is a
 * random symmetric positive semi-definite matrix (definite when d >= n). */
void gram_tri_add(const double *m, size_t n, size_t d, size_t c0, size_t c1, double *tri);

/* The len values of tri as float32 little-endian bytes, the wire form of a
 * Gram (malloc'd, 4 * len bytes; the caller frees). */
unsigned char *tri_to_f32le(const double *tri, size_t len);

/* ---- spectrum reference ------------------------------------------------------------------- */

struct spectrum_scalars; /* spectrum.h */

/* docs/monitors.md 1.3 evaluated directly from the squared singular values
 * s[0..count): drop those below s_max * m * DBL_EPSILON, then the
 * entropies, effective ranks, stable rank, Frobenius norm and s_max in long
 * double. The independent reference for the monitor modules. */
struct spectrum_scalars ref_scalars(const double *s, size_t count, size_t m);

/* ---- detector rules ----------------------------------------------------------------------- */

struct detect_rule; /* detect.h */

/* The default rule called name (asserted to exist), by value. */
struct detect_rule rule_named(const char *name);

/* a and b are the same bits (NaN equals NaN, -0 differs from +0): for
 * comparing a replayed computation with the first. */
bool same_double(double a, double b);

/* ---- HTTP requests ------------------------------------------------------------------------ */

#define RESP_MAX_BODY (8u << 20) /* a larger answer fails the request */

struct resp {
    long status;
    json_t *json; /* NULL if the body is not JSON (or empty) */
    char *body;   /* NUL-terminated; NULL if empty */
    size_t len;
    char allow[64]; /* Allow: header, "" if absent */
    char ctype[64]; /* Content-Type: header, "" if absent */
    long new_conns; /* CURLINFO_NUM_CONNECTS */
};

/* One request to http://127.0.0.1:port/path on handle h (NULL: a fresh
 * handle, cleaned up after). method NULL: GET (HEAD sends no body back);
 * body non-NULL: sent as the request body. Asserts that the transfer
 * worked; any status is returned in r, which resp_free releases. */
void request_at(unsigned short port, CURL *h, const char *method, const char *path,
                const char *body, struct resp *r);

/* GET path on port; asserts the status, a JSON body and its content type.
 * Returns r->json (owned by r). */
json_t *get_json_at(unsigned short port, const char *path, long status, struct resp *r);

void resp_free(struct resp *r);

/* libcurl CURLOPT_WRITEFUNCTION that appends to the struct resp in its
 * CURLOPT_WRITEDATA (up to RESP_MAX_BODY), for tests that drive a handle
 * themselves. */
size_t on_body(char *p, size_t sz, size_t n, void *ud);

/* Member key of object o, asserted to be an integer / a number / a string. */
int64_t jint(json_t *o, const char *key);
double jnum(json_t *o, const char *key);
const char *jstr(json_t *o, const char *key);

/* ---- the HTTP API server fixture ---------------------------------------------------------- */

struct http_fixture {
    struct tmpdb db;       /* db.dir, db.path: the server's database */
    sqlite3 *rw;           /* the test's own read-write connection to it */
    struct fs_stats stats; /* the server's counters; ready = 1 */
    struct http *srv;      /* NULL when stopped */
    unsigned short port;   /* the port srv bound */
};

/* The fixture of the running test: request, get_json and expect_error
 * talk to http_fx.port. */
extern struct http_fixture http_fx;

/* A temporary database (tag as for tmpdb_make) with every migration
 * applied in WAL mode, http_fx.rw open on it, stats zeroed with ready = 1,
 * libcurl initialized. The test then writes its rows and starts the
 * server. */
void http_fixture_open(const char *tag);

/* Starts the server on 127.0.0.1:0 with `threads` threads over http_fx's
 * database; sets http_fx.srv and http_fx.port. */
void http_fixture_start(unsigned threads);

/* Stops the server (if running), closes rw, removes the database. */
void http_fixture_close(void);

/* request_at / get_json_at on http_fx.port. */
void request(CURL *h, const char *method, const char *path, const char *body, struct resp *r);
json_t *get_json(const char *path, long status, struct resp *r);

/* method (NULL: GET) on path answers `status` with the JSON error object
 * {"error": {"code": code, "message": ...}}, the message mentioning
 * `mention` (if not NULL). */
void expect_error(const char *method, const char *path, long status, const char *code,
                  const char *mention);

#endif
