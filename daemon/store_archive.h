#ifndef FORESHOCK_STORE_ARCHIVE_H
#define FORESHOCK_STORE_ARCHIVE_H

#include <stddef.h>
#include <stdint.h>

#include "fs_err.h"

/* A consistent copy of a Foreshock database, whole or one run, taken while
 * the daemon runs (`foreshock archive`). History must outlive the job: the
 * pod's volume goes with it, and a multi-node run's history is split over
 * as many databases as nodes.
 *
 * Consistent: SQLite's online backup API copies every page in one step from
 * one read transaction of the source, so the copy is the database as of one
 * commit (in WAL mode the daemon's writer goes on meanwhile; it is never
 * blocked). The daemon's lock (<db>.lock) is not taken: reading is what
 * every HTTP thread does.
 *
 * The copy is written to "<dst>.tmp.<pid>", turned into a single-file
 * database (journal_mode DELETE: no -wal beside it), cut down to the run
 * when one is named (rows of other runs deleted, then VACUUM), checked
 * (PRAGMA quick_check), synced, and only then renamed to dst: an
 * interrupted archive never leaves a partial dst. An existing dst is
 * refused. Serve it with `foreshockd --read-only --db DST`; `foreshock
 * backtest --db DST` reads it too.
 *
 * Single-threaded: the caller's. Opens its own connections. */

struct store_archive_result {
    int64_t runs, series, points, alerts; /* in the copy */
    uint64_t bytes;                       /* size of dst */
    int schema_version;
};

/* Copies src to dst (whole, or only the run named `run` when not NULL).
 * Returns 0 and *res, or a negative errno with a reason in err: -EEXIST
 * (dst exists), -ENOENT (src missing, or no such run), -EPROTO (not a
 * Foreshock database this build reads), -EBUSY (the source stayed locked),
 * -EIO (SQLite or file system failure). */
int store_archive(const char *src, const char *dst, const char *run,
                  struct store_archive_result *res, struct fs_err *err);

#endif
