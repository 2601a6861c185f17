#ifndef FORESHOCK_STORE_STMT_H
#define FORESHOCK_STORE_STMT_H

/* Helpers every store_* file shares for its table of prepared statements
 * (an enum of ids, a const table of SQL, an array of sqlite3_stmt *): the
 * prepare-all loop, the finalize-all loop, and binding an optional step.
 * Header only; any thread that owns the connection. */

#include <sqlite3.h>
#include <stddef.h>
#include <stdint.h>

/* Prepares sql[0..n) on db into st[0..n), persistent (each is prepared
 * once per connection and stepped many times). Returns n when all are
 * ready, else the index of the first that failed (st[] before it is
 * prepared: the caller finalizes, store_finalize_all). */
static inline int store_prepare_all(sqlite3 *db, const char *const *sql, int n, sqlite3_stmt **st)
{
    for (int i = 0; i < n; i++)
        if (sqlite3_prepare_v3(db, sql[i], -1, SQLITE_PREPARE_PERSISTENT, &st[i], NULL) !=
            SQLITE_OK)
            return i;
    return n;
}

/* Finalizes st[0..n) (NULL entries are fine). */
static inline void store_finalize_all(sqlite3_stmt **st, int n)
{
    for (int i = 0; i < n; i++)
        sqlite3_finalize(st[i]);
}

/* Binds a step that may be absent: v < 0 binds NULL. */
static inline int store_bind_opt_step(sqlite3_stmt *st, int i, int64_t v)
{
    return v < 0 ? sqlite3_bind_null(st, i) : sqlite3_bind_int64(st, i, v);
}

#endif
