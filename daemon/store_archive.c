/* Online copies of a database (see store_archive.h). */
#include "store_archive.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "fs_limits.h"
#include "schema.h"

/* The source is busy only while a WAL is being recovered (a daemon
 * starting); retry for this long before giving up. */
#define ARCHIVE_BUSY_MS FS_STORE_BUSY_TIMEOUT_MS
#define ARCHIVE_RETRY_MS 50
#define ARCHIVE_MAX_TABLES 128 /* tables examined when cutting down to one run */
#define ARCHIVE_SQL_MAX 512
#define ARCHIVE_SQLITE_HEADER 100 /* bytes of a SQLite file header */

static int fail_db(sqlite3 *db, int rc, struct fs_err *err, const char *what)
{
    return fs_err_set(err, rc, "%s: %s", what, db ? sqlite3_errmsg(db) : "out of memory");
}

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

static int exec(sqlite3 *db, const char *sql, struct fs_err *err)
{
    if (sqlite3_exec(db, sql, NULL, NULL, NULL) != SQLITE_OK)
        return fail_db(db, -EIO, err, sql);
    return 0;
}

/* One integer from sql (with ?1 = run id when bound >= 0). */
static int query_int(sqlite3 *db, const char *sql, int64_t bind, int64_t *out)
{
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(db, sql, -1, &q, NULL) != SQLITE_OK)
        return -EIO;
    if (bind >= 0)
        sqlite3_bind_int64(q, 1, bind);
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW)
        *out = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    return rc == SQLITE_ROW ? 0 : rc == SQLITE_DONE ? -ENOENT : -EIO;
}

/* Every page of src into dst, from one read transaction of src. */
static int copy_pages(sqlite3 *src, sqlite3 *dst, struct fs_err *err)
{
    sqlite3_backup *b = sqlite3_backup_init(dst, "main", src, "main");
    if (!b)
        return fail_db(dst, -EIO, err, "backup");
    int rc;
    long waited = 0;
    /* -1: all pages in one step, so the copy is one snapshot; a step
     * split over several would restart whenever the daemon commits. */
    while ((rc = sqlite3_backup_step(b, -1)) == SQLITE_BUSY || rc == SQLITE_LOCKED) {
        if (waited >= ARCHIVE_BUSY_MS)
            break;
        sleep_ms(ARCHIVE_RETRY_MS);
        waited += ARCHIVE_RETRY_MS;
    }
    int frc = sqlite3_backup_finish(b);
    if (rc == SQLITE_BUSY || rc == SQLITE_LOCKED)
        return fs_err_set(err, -EBUSY, "the source stayed locked for %ld ms", waited);
    if (rc != SQLITE_DONE || frc != SQLITE_OK)
        return fail_db(dst, -EIO, err, "backup");
    return 0;
}

/* How a table's rows belong to a run, by its columns: run_id directly, or
 * through an alert, a series or a stream. Tables with none (silences) are
 * shared by every run and kept. Deciding by column, not by a list of table
 * names, keeps this right when a migration adds a table. */
enum owner { OWN_NONE, OWN_RUN, OWN_ALERT, OWN_SERIES, OWN_STREAM, OWN_RUNS_TABLE };

static enum owner table_owner(sqlite3 *db, const char *table)
{
    if (strcmp(table, "runs") == 0)
        return OWN_RUNS_TABLE;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(db, "SELECT name FROM pragma_table_info(?1)", -1, &q, NULL) != SQLITE_OK)
        return OWN_NONE;
    sqlite3_bind_text(q, 1, table, -1, SQLITE_STATIC);
    int run = 0, alert = 0, series = 0, stream = 0;
    while (sqlite3_step(q) == SQLITE_ROW) {
        const char *c = (const char *)sqlite3_column_text(q, 0);
        run |= c && strcmp(c, "run_id") == 0;
        alert |= c && strcmp(c, "alert_id") == 0;
        series |= c && strcmp(c, "series_id") == 0;
        stream |= c && strcmp(c, "stream_id") == 0;
    }
    sqlite3_finalize(q);
    return run ? OWN_RUN : alert ? OWN_ALERT : series ? OWN_SERIES : stream ? OWN_STREAM : OWN_NONE;
}

/* Deletes every row of runs other than run_id, in an order where each
 * subquery still sees its parent rows: children first, runs last. */
static int keep_one_run(sqlite3 *db, int64_t run_id, struct fs_err *err)
{
    static const char *const where[] = {
        [OWN_ALERT] = "alert_id IN (SELECT id FROM alerts WHERE run_id <> ?1)",
        [OWN_SERIES] = "series_id IN (SELECT id FROM series WHERE run_id <> ?1)",
        [OWN_STREAM] = "stream_id IN (SELECT id FROM streams WHERE run_id <> ?1)",
        [OWN_RUN] = "run_id <> ?1",
        [OWN_RUNS_TABLE] = "id <> ?1",
    };
    static const enum owner pass[] = {OWN_ALERT, OWN_SERIES, OWN_STREAM, OWN_RUN, OWN_RUNS_TABLE};
    char names[ARCHIVE_MAX_TABLES][FS_CONFIG_MAX_HOST];
    enum owner own[ARCHIVE_MAX_TABLES];
    size_t n = 0;
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(db,
                           "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT "
                           "LIKE 'sqlite_%' ORDER BY name",
                           -1, &q, NULL) != SQLITE_OK)
        return fail_db(db, -EIO, err, "listing tables");
    while (sqlite3_step(q) == SQLITE_ROW && n < ARCHIVE_MAX_TABLES) {
        const char *t = (const char *)sqlite3_column_text(q, 0);
        if (!t || strlen(t) >= sizeof(names[0]) || strchr(t, '"'))
            continue; /* not one of ours */
        snprintf(names[n], sizeof(names[n]), "%s", t);
        n++;
    }
    sqlite3_finalize(q);
    for (size_t i = 0; i < n; i++)
        own[i] = table_owner(db, names[i]);
    int rc = exec(db, "BEGIN IMMEDIATE", err);
    for (size_t p = 0; rc == 0 && p < sizeof(pass) / sizeof(pass[0]); p++) {
        for (size_t i = 0; rc == 0 && i < n; i++) {
            if (own[i] != pass[p])
                continue;
            char sql[ARCHIVE_SQL_MAX];
            int len =
                snprintf(sql, sizeof(sql), "DELETE FROM \"%s\" WHERE %s", names[i], where[own[i]]);
            if (len < 0 || (size_t)len >= sizeof(sql) ||
                sqlite3_prepare_v2(db, sql, -1, &q, NULL) != SQLITE_OK) {
                rc = fail_db(db, -EIO, err, sql);
                break;
            }
            sqlite3_bind_int64(q, 1, run_id);
            if (sqlite3_step(q) != SQLITE_DONE)
                rc = fail_db(db, -EIO, err, sql);
            sqlite3_finalize(q);
        }
    }
    if (rc == 0)
        return exec(db, "COMMIT", err);
    sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    return rc;
}

static int fsync_path(const char *path, int dir)
{
    int fd = open(path, (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) < 0 ? -errno : 0;
    close(fd);
    return rc;
}

/* Opens src read-only and checks that it is a whole Foreshock database this
 * build reads; sb is src's stat. Returns 0 with *s open and *version its
 * schema version, or a negative errno with a reason in err: -EIO (SQLite
 * failure, or a truncated or damaged file), -EPROTO (a schema version this
 * build does not read). *s may be open on failure too: the caller closes it. */
static int open_source(const char *src, const struct stat *sb, sqlite3 **s, int64_t *version,
                       struct fs_err *err)
{
    if (sqlite3_open_v2(src, s, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK)
        return fail_db(*s, -EIO, err, src);
    sqlite3_busy_timeout(*s, ARCHIVE_BUSY_MS);
    *version = 0;
    if (query_int(*s, "PRAGMA user_version", -1, version) < 0) {
        /* SQLite's own reason: a truncated or damaged file is not "not a
         * Foreshock database" (SQLITE_CORRUPT: damaged or cut short;
         * SQLITE_NOTADB: no SQLite header at all). */
        int code = sqlite3_errcode(*s);
        return fs_err_set(err, -EIO, "%s: %s (SQLite)%s", src, sqlite3_errmsg(*s),
                          code == SQLITE_CORRUPT  ? ": the database is truncated or damaged"
                          : code == SQLITE_NOTADB ? ": not a SQLite database"
                                                  : "");
    }
    if (*version == 0 && sb->st_size > 0 && sb->st_size < ARCHIVE_SQLITE_HEADER) {
        /* SQLite reads a file shorter than its header as an empty one. */
        return fs_err_set(err, -EIO,
                          "%s: %lld bytes, shorter than a SQLite header (%d): the database is "
                          "truncated or damaged",
                          src, (long long)sb->st_size, ARCHIVE_SQLITE_HEADER);
    }
    int64_t page = 0;
    if (*version > 0 && query_int(*s, "PRAGMA page_size", -1, &page) == 0 && page > 0 &&
        sb->st_size % page != 0) {
        /* SQLite reads the missing end of a last page as zeros. */
        return fs_err_set(err, -EIO,
                          "%s: %lld bytes, not a whole number of its %lld-byte pages: the "
                          "database is truncated or damaged",
                          src, (long long)sb->st_size, (long long)page);
    }
    if (*version < 1 || *version > schema_migration_count)
        return fs_err_set(err, -EPROTO,
                          "%s: schema version %lld: not a Foreshock database this build "
                          "reads (1..%d)",
                          src, (long long)*version, schema_migration_count);
    return 0;
}

/* The id of the run named `run` in src's database s. Returns 0 and
 * *run_id, or -ENOENT (no such run) or -EIO with a reason in err. */
static int find_run(sqlite3 *s, const char *src, const char *run, int64_t *run_id,
                    struct fs_err *err)
{
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(s, "SELECT id FROM runs WHERE name = ?1", -1, &q, NULL) != SQLITE_OK)
        return fail_db(s, -EIO, err, "runs");
    sqlite3_bind_text(q, 1, run, -1, SQLITE_STATIC);
    *run_id = -1;
    if (sqlite3_step(q) == SQLITE_ROW)
        *run_id = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    if (*run_id < 0)
        return fs_err_set(err, -ENOENT, "%s: no run named '%s'", src, run);
    return 0;
}

/* Creates the archive's temporary file tmp (any left over from an earlier
 * attempt by this pid is removed first) as an empty database. Returns 0
 * with *d open, or -EIO with a reason in err (*d may then be open: the
 * caller closes it). */
static int create_copy(const char *tmp, sqlite3 **d, struct fs_err *err)
{
    (void)unlink(tmp);
    if (sqlite3_open_v2(tmp, d, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL) != SQLITE_OK)
        return fail_db(*d, -EIO, err, tmp);
    return 0;
}

/* Makes the filled copy d one self-contained file, durable once renamed
 * into place, cut down to run_id when it is >= 0 (other runs' rows
 * deleted, then VACUUM). Returns 0, or -EIO with a reason in err. */
static int settle_copy(sqlite3 *d, int64_t run_id, struct fs_err *err)
{
    int rc;
    if ((rc = exec(d, "PRAGMA journal_mode = DELETE", err)) < 0 ||
        (rc = exec(d, "PRAGMA synchronous = FULL", err)) < 0)
        return rc;
    if (run_id >= 0 &&
        ((rc = keep_one_run(d, run_id, err)) < 0 || (rc = exec(d, "VACUUM", err)) < 0))
        return rc;
    return 0;
}

/* PRAGMA quick_check of the copy d (in file tmp). Returns 0 when it says
 * "ok", else -EIO with its verdict (or SQLite's error) in err. */
static int check_copy(sqlite3 *d, const char *tmp, struct fs_err *err)
{
    sqlite3_stmt *q;
    if (sqlite3_prepare_v2(d, "PRAGMA quick_check", -1, &q, NULL) != SQLITE_OK)
        return fail_db(d, -EIO, err, "quick_check");
    int step = sqlite3_step(q);
    const char *verdict = step == SQLITE_ROW ? (const char *)sqlite3_column_text(q, 0) : NULL;
    int healthy = verdict && strcmp(verdict, "ok") == 0;
    if (!healthy)
        fs_err_set(err, -EIO, "%s: quick_check: %s", tmp, verdict ? verdict : sqlite3_errmsg(d));
    sqlite3_finalize(q);
    return healthy ? 0 : -EIO;
}

/* The accounting: version and the copy's row counts into res. Returns 0,
 * or -EIO with a reason in err. */
static int count_copy(sqlite3 *d, int64_t version, struct store_archive_result *res,
                      struct fs_err *err)
{
    res->schema_version = (int)version;
    if (query_int(d, "SELECT count(*) FROM runs", -1, &res->runs) < 0 ||
        query_int(d, "SELECT count(*) FROM series", -1, &res->series) < 0 ||
        query_int(d, "SELECT count(*) FROM points", -1, &res->points) < 0 ||
        query_int(d, "SELECT count(*) FROM alerts", -1, &res->alerts) < 0)
        return fail_db(d, -EIO, err, "counting the copy");
    return 0;
}

/* Puts the closed copy tmp in place as dst: synced, linked to dst, tmp
 * removed, dst's directory synced, dst's size into res->bytes. Returns 0
 * once dst exists (tmp is then gone), or a negative errno with a reason in
 * err (tmp is then left for the caller to remove). */
static int publish_copy(const char *tmp, const char *dst, struct store_archive_result *res,
                        struct fs_err *err)
{
    int rc;
    if ((rc = fsync_path(tmp, 0)) < 0)
        return fs_err_set(err, rc, "fsync %s: %s", tmp, strerror(-rc));
    /* link(2) refuses an existing dst, which a rename would replace: an
     * archive that appeared meanwhile is not overwritten either. */
    if (link(tmp, dst) < 0) {
        rc = -errno;
        fs_err_set(err, rc, "%s: %s", dst, strerror(errno));
        return rc;
    }
    (void)unlink(tmp);
    char dir[FS_CONFIG_MAX_PATH];
    snprintf(dir, sizeof(dir), "%s", dst);
    (void)fsync_path(dirname(dir), 1);
    struct stat sb;
    if (stat(dst, &sb) == 0)
        res->bytes = (uint64_t)sb.st_size;
    return 0;
}

/* Removes what an unfinished archive left: tmp and its rollback journal. */
static void remove_partial(const char *tmp)
{
    (void)unlink(tmp);
    char journal[FS_CONFIG_MAX_PATH + 16];
    snprintf(journal, sizeof(journal), "%s-journal", tmp);
    (void)unlink(journal);
}

int store_archive(const char *src, const char *dst, const char *run,
                  struct store_archive_result *res, struct fs_err *err)
{
    sqlite3 *s = NULL, *d = NULL;
    char tmp[FS_CONFIG_MAX_PATH];
    int rc, made = 0;
    int64_t version = 0, run_id = -1;
    memset(res, 0, sizeof(*res));
    if ((size_t)snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", dst, (long)getpid()) >= sizeof(tmp))
        return fs_err_set(err, -ENAMETOOLONG, "%s: path too long", dst);
    struct stat sb;
    if (stat(dst, &sb) == 0)
        return fs_err_set(err, -EEXIST, "%s exists: an archive is never overwritten", dst);
    if (stat(src, &sb) < 0)
        return fs_err_set(err, -ENOENT, "%s: %s", src, strerror(errno));
    if ((rc = open_source(src, &sb, &s, &version, err)) < 0 ||
        (run && (rc = find_run(s, src, run, &run_id, err)) < 0) ||
        (rc = create_copy(tmp, &d, err)) < 0)
        goto out;
    made = 1;
    if ((rc = copy_pages(s, d, err)) < 0)
        goto out;
    sqlite3_close(s);
    s = NULL;
    if ((rc = settle_copy(d, run_id, err)) < 0 || (rc = check_copy(d, tmp, err)) < 0 ||
        (rc = count_copy(d, version, res, err)) < 0)
        goto out;
    if (sqlite3_close(d) != SQLITE_OK) {
        rc = fail_db(d, -EIO, err, "closing the copy");
        goto out;
    }
    d = NULL;
    if ((rc = publish_copy(tmp, dst, res, err)) < 0)
        goto out;
    made = 0;
out:
    sqlite3_close(s);
    sqlite3_close(d);
    if (made)
        remove_partial(tmp);
    return rc;
}
