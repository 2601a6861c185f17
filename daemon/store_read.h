#ifndef FORESHOCK_STORE_READ_H
#define FORESHOCK_STORE_READ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store.h"

/* Read-only access to a Foreshock database for offline tools (`foreshock
 * backtest`): the runs and the stored points of their series, in step order.
 * Opens its own read-only connection, so it is safe beside a running daemon
 * (WAL readers never block the writer). Single-threaded: the caller's. */

struct store_reader;

struct store_run_info {
    int64_t id;
    char name[FS_MAX_RUN_ID_LEN + 1];
    uint64_t detect_from_step; /* 0: not set by the run's Hello */
    int64_t last_step;         /* -1: none */
    uint32_t lead_rank;        /* whose loss/grad_norm/lr were detected: the lowest rank of
                                  the local group its daemon heard, else 0 */
    char optimizer[FS_MAX_OPTIMIZER_LEN + 1]; /* the stored model shape's; "": not known */
};

/* Opens path read-only. Returns 0 and *out, or a negative errno with a
 * reason in err (missing file, not a Foreshock database, newer schema). */
int store_reader_open(const char *path, struct store_reader **out, struct fs_err *err);
void store_reader_close(struct store_reader *r);

/* The database's schema version (PRAGMA user_version, 1..this build's). */
int store_reader_version(const struct store_reader *r);

/* Calls cb for every run, by id. cb returns 0 to go on, anything else to
 * stop (returned). Returns 0, a negative errno with err, or cb's value. */
int store_reader_runs(struct store_reader *r,
                      int (*cb)(void *ctx, const struct store_run_info *run), void *ctx,
                      struct fs_err *err);

/* Calls cb for every stored point of run_id's series that `want` accepts
 * (want may be NULL: all), ordered by step, then learning rates ("lr")
 * before the rest, then by series id. present is
 * false for a NULL value (an absent point: no spectrum, or a non-finite
 * value, which SQLite cannot hold). Returns like store_reader_runs. */
int store_reader_points(struct store_reader *r, int64_t run_id,
                        bool (*want)(void *ctx, const struct store_series_key *k),
                        int (*cb)(void *ctx, const struct store_series_key *k, uint64_t step,
                                  double value, bool present),
                        void *ctx, struct fs_err *err);

/* store_reader_points for the points at or below max_step only. */
int store_reader_points_upto(struct store_reader *r, int64_t run_id, int64_t max_step,
                             bool (*want)(void *ctx, const struct store_series_key *k),
                             int (*cb)(void *ctx, const struct store_series_key *k, uint64_t step,
                                       double value, bool present),
                             void *ctx, struct fs_err *err);

#endif
