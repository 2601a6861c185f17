/* Attempts of a run, on the writer's connection (attempts.h). */
#include "attempts.h"

#include <errno.h>
#include <stdlib.h>

#include "fs_limits.h"
#include "store_stmt.h"

enum { AT_LATEST, AT_INSERT, AT_REBUILT, AT_COUNT };

static const char *const at_sql[AT_COUNT] = {
    [AT_LATEST] = "SELECT attempt, resume_step FROM attempts WHERE run_id = ?1 "
                  "ORDER BY attempt DESC LIMIT 1",
    [AT_INSERT] = "INSERT INTO attempts (run_id, attempt, resume_step, started_at) "
                  "VALUES (?1, ?2, ?3, ?4)",
    /* Earlier rewinds superseded before their own rebuild was stored never
     * will be: this rebuild replays their stored points too (steps <= its
     * step), so it is theirs as well. */
    [AT_REBUILT] = "UPDATE attempts SET rebuilt_at = ?3 WHERE run_id = ?1 AND (attempt = ?2 OR "
                   "(attempt < ?2 AND resume_step IS NOT NULL AND rebuilt_at IS NULL))",
};

struct attempts_store {
    sqlite3_stmt *st[AT_COUNT];
};

int attempts_store_open(sqlite3 *db, struct attempts_store **out)
{
    struct attempts_store *as = calloc(1, sizeof(*as));
    if (!as)
        return -ENOMEM;
    if (store_prepare_all(db, at_sql, AT_COUNT, as->st) < AT_COUNT) {
        attempts_store_close(as);
        return -EIO;
    }
    *out = as;
    return 0;
}

void attempts_store_close(struct attempts_store *as)
{
    if (!as)
        return;
    store_finalize_all(as->st, AT_COUNT);
    free(as);
}

static int done(sqlite3_stmt *st, int rc)
{
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc;
}

int attempts_store_hello(struct attempts_store *as, int64_t run_id, uint32_t attempt,
                         bool has_resume, uint64_t resume_step, double now,
                         struct attempt_info *out)
{
    *out = (struct attempt_info){
        .attempt = attempt, .has_resume = has_resume, .resume_step = resume_step};
    sqlite3_stmt *st = as->st[AT_LATEST];
    sqlite3_bind_int64(st, 1, run_id);
    int rc = sqlite3_step(st);
    bool any = rc == SQLITE_ROW;
    if (any && sqlite3_column_int64(st, 0) >= (int64_t)attempt) {
        /* Started already (another rank's Hello), or an older attempt. */
        out->attempt = (uint32_t)sqlite3_column_int64(st, 0);
        out->has_resume = sqlite3_column_type(st, 1) != SQLITE_NULL;
        out->resume_step = out->has_resume ? (uint64_t)sqlite3_column_int64(st, 1) : 0;
        return done(st, SQLITE_OK);
    }
    if ((rc = done(st, rc)) != SQLITE_ROW && rc != SQLITE_DONE)
        return rc;
    st = as->st[AT_INSERT];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, attempt);
    if (has_resume)
        sqlite3_bind_int64(st, 3, (int64_t)resume_step);
    sqlite3_bind_double(st, 4, now);
    rc = done(st, sqlite3_step(st));
    if (rc != SQLITE_DONE)
        return rc;
    out->started = true;
    /* A resume step on a run's first attempt rewinds nothing. */
    out->rewind = has_resume && any;
    return SQLITE_OK;
}

int attempts_store_admit(struct attempts_store *as, int64_t run_id, uint32_t attempt, bool *admit,
                         uint32_t *latest)
{
    *latest = 0;
    *admit = attempt <= FS_MAX_ATTEMPT_JUMP;
    if (run_id <= 0)
        return SQLITE_OK;
    sqlite3_stmt *st = as->st[AT_LATEST];
    sqlite3_bind_int64(st, 1, run_id);
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        *latest = (uint32_t)sqlite3_column_int64(st, 0);
        /* An attempt started already or older changes nothing: admitted. */
        *admit = attempt <= *latest || attempt - *latest <= FS_MAX_ATTEMPT_JUMP;
    }
    rc = done(st, rc);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? SQLITE_OK : rc;
}

int attempts_store_rebuilt(struct attempts_store *as, int64_t run_id, uint32_t attempt, double now)
{
    sqlite3_stmt *st = as->st[AT_REBUILT];
    sqlite3_bind_int64(st, 1, run_id);
    sqlite3_bind_int64(st, 2, attempt);
    sqlite3_bind_double(st, 3, now);
    int rc = done(st, sqlite3_step(st));
    return rc == SQLITE_DONE ? SQLITE_OK : rc;
}
