#ifndef FORESHOCK_ATTEMPTS_H
#define FORESHOCK_ATTEMPTS_H

#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>

/* Attempts of a run (schema/007_attempts.sql), kept by the writer thread
 * inside its open transaction. A Hello whose attempt is above every earlier
 * attempt of its run starts that attempt; with a resume step it is a
 * rewind to that step (stage.h says what the monitor stage does then). */

struct attempts_store;

/* Prepares the statements on db (the writer's, migrated). 0 or a negative
 * errno-style code. Main thread at store_open. */
int attempts_store_open(sqlite3 *db, struct attempts_store **out);
void attempts_store_close(struct attempts_store *as);

/* The run's current attempt after a Hello of `attempt`. */
struct attempt_info {
    uint32_t attempt; /* the run's latest attempt */
    bool has_resume;  /* ... is a rewind to resume_step */
    uint64_t resume_step;
    bool started; /* this Hello started the latest attempt */
    bool rewind;  /* ... and it rewinds an earlier attempt */
};

/* Records the Hello of (run_id, attempt[, resume_step]) at now and fills
 * *out. A Hello of an attempt already started, or of an older one, changes
 * nothing. SQLite rc. */
int attempts_store_hello(struct attempts_store *as, int64_t run_id, uint32_t attempt,
                         bool has_resume, uint64_t resume_step, double now,
                         struct attempt_info *out);

/* Whether a Hello of `attempt` may be taken for run_id (0: a run not stored
 * yet): a new attempt at most FS_MAX_ATTEMPT_JUMP above the run's latest
 * (above 0 for its first). A rewind needs an attempt above the latest, so
 * one Hello of attempt 2^32-1 would otherwise end every later rewind of the
 * run; now that takes 2^32 / FS_MAX_ATTEMPT_JUMP accepted Hellos, each
 * one a new attempt in /api/v1/runs. *latest: the run's latest attempt
 * (0 when none). SQLite rc. */
int attempts_store_admit(struct attempts_store *as, int64_t run_id, uint32_t attempt, bool *admit,
                         uint32_t *latest);

/* The rewind of (run_id, attempt) was rebuilt at now; so were the run's
 * earlier rewinds still without a rebuild (a newer rewind superseded them
 * first: this rebuild stands for them). SQLite rc. */
int attempts_store_rebuilt(struct attempts_store *as, int64_t run_id, uint32_t attempt, double now);

#endif
