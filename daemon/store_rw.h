#ifndef FORESHOCK_STORE_RW_H
#define FORESHOCK_STORE_RW_H

/* The remote-write sender's SQL (remote_write.c): the statements its own
 * read-only connection prepares once and steps on the sender thread, and
 * the read transaction each pass runs in. A reader's file, not the
 * writer's: http_sql.c says where each connection's SQL lives. */

#include <sqlite3.h>

enum rw_stmt {
    RW_Q_RUNS,
    RW_Q_CURSORS,
    RW_Q_LIVE_MIN,
    RW_Q_SPOOL_MIN,
    RW_Q_POINTS,
    RW_Q_HEADS,
    RW_Q_ALERTS,
    RW_Q_ALERT_MAX,
    RW_Q__COUNT
};

/* Prepares every statement on db (read-only, migrated) into st. SQLITE_OK,
 * or the failing prepare's code (st before it prepared: the caller
 * finalizes, store_finalize_all in store_stmt.h). */
int store_rw_prepare(sqlite3 *db, sqlite3_stmt *st[RW_Q__COUNT]);

/* Opens a pass's read transaction on db (one snapshot for the pass).
 * Returns sqlite3_exec's code. */
int store_rw_begin(sqlite3 *db);

/* Ends the pass's read transaction (nothing was written). */
void store_rw_end(sqlite3 *db);

#endif
