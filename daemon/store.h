#ifndef FORESHOCK_STORE_H
#define FORESHOCK_STORE_H

#include <sqlite3.h>
#include <stddef.h>
#include <stdint.h>

#include "advice.h"
#include "attempts.h"
#include "fs_err.h"
#include "fs_limits.h"
#include "stats.h"

/* Storage: the writer thread and the only read-write SQLite connection.
 *
 * Other threads hand the writer owned items through a bounded FIFO queue
 * (store_submit, never blocks). The writer takes everything queued, up to
 * batch_max_items, into one transaction and only AFTER COMMIT announces the
 * results (Welcome data, Acks) through a second queue that the owner of the
 * connections drains with store_take_results(); opts.notify wakes it up
 * (the ingest passes a uv_async_send wrapper). A failed commit (disk full,
 * I/O error, busy) is rolled back and retried with backoff, keeping the
 * items: nothing is announced until it is committed, and the queue filling
 * up is what pushes back on the clients. While commits fail, stats->
 * storage_failing holds the SQLite result code (SQLITE_FULL: disk full) and
 * every HELLO, of the failing batch or queued, is answered at once with
 * ERROR_INTERNAL naming the failure (a Welcome needs a written stream row;
 * a Hello left queued would get no answer for as long as the disk is full).
 * The first commit that succeeds clears it. Past the stop deadline
 * (store_set_stop_deadline) a batch that fails is given up instead of
 * retried, as a crash at that point would lose it: none of it was acked.
 *
 * Backpressure: store_submit refuses REPORT items with -EAGAIN once the
 * queue holds queue_max_items items or queue_max_bytes bytes (items in the
 * transaction being written count until they commit); it keeps refusing
 * until the writer has drained to half of both bounds, then announces
 * STORE_RESULT_RESUME. Other item kinds are never refused: the stages that
 * free space must not be blocked by the lack of it, and a Hello must be
 * answered while ingest is saturated (one per connection, bounded).
 *
 * Fair admission: queued HELLO items are written first, in a transaction of
 * their own, so a Welcome waits for at most the commit in progress; a
 * transaction takes at most FS_STORE_BATCH_MAX_BYTES of items (at least
 * one), so that commit is short. A Hello whose stream still has REPORT
 * items queued ahead of it (a trainer reconnecting; same stream_key, or a
 * key of 0) keeps its place: its Welcome's last_seq then covers them, as
 * it always did, and the trainer does not resend them.
 *
 * The sketch spool: a REPORT's sketch_body goes to the spool log beside the
 * database (spool.h), not into it; the transaction that commits the
 * report's rows also records where the log ends, after the log was synced
 * by the synchronous policy. Evaluated steps (spool_done, below) are
 * recorded per run in the same transaction as the monitor rows, and only
 * after that COMMIT are the spool segments they free deleted. The database
 * file so holds no raw sketches. */

enum store_item_kind {
    STORE_ITEM_HELLO = 1,
    STORE_ITEM_REPORT = 2,
    STORE_ITEM_SPOOL_DONE =
        3, /* monitors are done with a run's steps <= step (runs.spool_done_step) */
    STORE_ITEM_MONITOR = 4,   /* the monitor stage's output for one run (below) */
    STORE_ITEM_SILENCE = 5,   /* create or expire a silence (HTTP API, below) */
    STORE_ITEM_OUTBOX = 6,    /* the pager's outcome of one outbox row (below) */
    STORE_ITEM_ADVICE = 7,    /* an advice sent to or acknowledged by a stream (below) */
    STORE_ITEM_RUN = 8,       /* end or delete a run (HTTP API, below) */
    STORE_ITEM_RW_CURSOR = 9, /* remote write acknowledged up to here (remote_write.h) */
};

/* Scalars of a report, by index into store_report.scalars. */
enum store_scalar {
    STORE_LOSS,
    STORE_GRAD_NORM,
    STORE_LR,
    STORE_LOSS_SCALE,
    STORE_TOKENS,
    STORE_STEP_TIME,
    STORE_STEP_UPDATE_RATIO,
    STORE_NSCALARS
};

struct store_hello {
    char run[FS_MAX_RUN_ID_LEN + 1];
    uint32_t attempt;
    uint32_t rank;
    uint32_t world_size;
    int has_detect_from_step;
    uint64_t detect_from_step;
    char *model_json;    /* owned (malloc), may be NULL */
    char *local_ranks;   /* Hello.local_ranks as ranges ("4-7"), owned; NULL: none */
    int advice;          /* the client takes Advice: its owed advices follow the result */
    int has_resume_step; /* Hello.resume_step: the attempt restarts from a checkpoint */
    uint64_t resume_step;
    uint64_t stream_key; /* store_stream_key of (run, attempt, rank); 0: unknown */
    /* who admitted it: the [run "PATTERN"] whose token it carried, "" for
     * the global token (max_runs_per_token counts live runs per owner) */
    char owner[FS_MAX_RUN_ID_LEN + 1];
};

struct store_report {
    int64_t run_id;       /* from the HELLO result */
    int64_t stream_id;    /* from the HELLO result */
    uint64_t stream_key;  /* the stream's store_stream_key (0: unknown) */
    uint32_t rank;        /* label of the per-rank series */
    uint64_t seq;         /* 1..INT64_MAX */
    uint64_t step;        /* 0..INT64_MAX */
    double time;          /* sample time, unix seconds (Report.time_unix or receipt) */
    double received_at;   /* unix seconds */
    uint32_t frame_bytes; /* wire size of the frame, for reports.bytes */
    unsigned present;     /* bit i set: scalars[i] is present */
    double scalars[STORE_NSCALARS];
    uint32_t n_weight_norm; /* per-layer, index = layer */
    uint32_t n_update_ratio;
    float *weight_norm;   /* owned (malloc), n_weight_norm values */
    float *update_ratio;  /* owned (malloc) */
    uint8_t *sketch_body; /* the Frame body as received, when the stage needs it spooled
                             (stage_wants_spool); appended to the spool log. Owned, unless
                             sketch_alloc is set: then it points into that allocation */
    size_t sketch_len;
    uint8_t *sketch_alloc; /* owned: the buffer sketch_body lies in, or NULL */
    /* Writer thread: where spool_batch appended the frame (spooled: 1), for
     * its spool_frames row. */
    int spooled;
    uint64_t spool_seg, spool_off;
};

struct store_spool_done {
    int64_t run_id;
    uint64_t step; /* spooled frames of steps <= step are no longer needed */
};

/* --- STORE_ITEM_MONITOR: what the monitor stage derived, in ONE transaction:
 * monitor points, detector states, alert rows with their transitions,
 * incomplete reductions and the run's evaluated step (spool_done_step: the
 * spool may then drop the frames of steps <= it). Series are named by
 * (name, labels) and created as needed; the writer resolves series ids. */
#define STORE_SERIES_NAME_MAX 48  /* series names, bytes with NUL */
#define STORE_RULE_MAX 64         /* = DETECT_NAME_MAX */
#define STORE_ALERT_KEY_MAX 1120  /* >= ALERT_KEY_MAX */
#define STORE_DEDUP_KEY_MAX 24    /* >= ALERT_DEDUP_MAX */
#define STORE_STATE_BLOB_MAX 4160 /* >= DETECT_STATE_ENCODED_MAX (4144) */
#define STORE_ALERT_BLOB_MAX 64   /* >= ALERT_STATE_ENCODED_BYTES */

struct store_series_key {
    char name[STORE_SERIES_NAME_MAX];
    int32_t layer, head, window, rank; /* -1 (window: 0) = not applicable */
};

struct store_point {
    struct store_series_key key;
    uint64_t step;
    double value; /* NaN: absent (stored as NULL) */
};

struct store_detector_row {
    struct store_series_key key;
    uint64_t step; /* last step fed to the detector */
    uint32_t len;
    uint8_t *blob; /* into store_monitor.blobs */
};

struct store_alert_row {
    struct store_series_key series; /* alerts.series_id */
    char rule[STORE_RULE_MAX];
    char alert_key[STORE_ALERT_KEY_MAX];
    char dedup_key[STORE_DEDUP_KEY_MAX];
    int state;            /* enum alert_state_id */
    const char *severity; /* static strings */
    const char *family;
    const char *attribution;
    const char *event_attribution; /* label at this event's step (has_event) */
    double value, median, mad, z;  /* NaN: NULL */
    int64_t first_breach_step, fired_step, resolved_step; /* -1: NULL */
    int64_t last_step;
    uint64_t incidents;
    uint32_t attempt; /* of the transition (alert_events.attempt), when has_event */
    uint32_t blob_len;
    uint8_t blob[STORE_ALERT_BLOB_MAX]; /* alerts.state_blob */
    /* The transition, when this row changes because of one. */
    int has_event;
    const char *change; /* static: "to_pending", ... */
    int from_state, to_state;
    int64_t event_step;
    char *evidence_json; /* owned (malloc) */
};

struct store_incomplete_row {
    const char *kind; /* static: "attention" | "router_gram" | "router_tokens" */
    uint64_t step;
    int32_t layer, head, window;
    uint32_t have, want;
};

struct store_monitor {
    int64_t run_id;
    double time; /* point time, unix seconds */
    size_t n_points;
    struct store_point *points; /* owned */
    size_t n_states;
    struct store_detector_row *states; /* owned */
    uint8_t *blobs;                    /* owned: the states' blobs */
    size_t n_alerts;
    struct store_alert_row *alerts; /* owned */
    size_t n_incomplete;
    struct store_incomplete_row *incomplete; /* owned */
    int has_spool_done;
    uint64_t spool_done_step;
    /* A rewind to spool_rewind_step (stage.h): the run's evaluated step is
     * lowered to it before spool_done_step is applied. The old attempt's
     * steps after it are no longer the run's history, and the new
     * attempt's frames of those steps are still to be evaluated: they must
     * neither be released nor skipped by a restart (spool.h, "Release"). */
    int has_spool_rewind;
    uint64_t spool_rewind_step;
    /* A rewind's rebuilt state (stage.h): attempts.rebuilt_at of the run's
     * attempt `rebuilt_attempt` is set in the same transaction. */
    int has_rebuilt;
    uint32_t rebuilt_attempt;
};

/* --- STORE_ITEM_SILENCE: the HTTP API's writes. The HTTP thread waits on a
 * store_waiter for the outcome, which is set only after COMMIT (or when the
 * item is refused or freed unwritten). The waiter is reference counted so
 * that a waiter that gave up (timeout) and the writer can release it in
 * either order. */
enum store_silence_op { STORE_SILENCE_INSERT = 1, STORE_SILENCE_EXPIRE = 2 };

struct store_waiter;

struct store_silence {
    enum store_silence_op op;
    int64_t id;                  /* EXPIRE: the silence to expire */
    char *matchers_json;         /* INSERT: owned (malloc), validated canonical JSON */
    char *created_by;            /* INSERT: owned */
    char *comment;               /* INSERT: owned */
    double starts_at, ends_at;   /* INSERT: UNIX seconds */
    struct store_waiter *waiter; /* one reference, owned; released by store_item_free */
    /* writer thread: outcome of the latest attempt, published after COMMIT */
    int status;
    int64_t out_id;
};

/* A new waiter holding one reference (the caller's); NULL when out of
 * memory. Any thread. */
struct store_waiter *store_waiter_new(void);
/* Adds a reference and returns w. Any thread. */
struct store_waiter *store_waiter_ref(struct store_waiter *w);
/* Drops a reference; the last one frees w. NULL is a no-op. Any thread. */
void store_waiter_put(struct store_waiter *w);
/* Waits up to timeout_ms for the outcome: 0 (committed; *id = the
 * silence's id), -ENOENT (EXPIRE: no such silence), -EALREADY (EXPIRE:
 * already expired), -ENOSPC (INSERT: FS_STORE_MAX_LIVE_SILENCES silences
 * are active or pending already), -EIO (storage refused it), -ECANCELED (freed unwritten,
 * e.g. at shutdown) or -ETIMEDOUT (no outcome yet; the write may still
 * happen). Does not drop the caller's reference. Any thread but the
 * writer's. */
int store_waiter_wait(struct store_waiter *w, unsigned timeout_ms, int64_t *id);

/* --- Outbox (schema/004_outbox.sql). For every to_firing / to_resolved
 * transition of a STORE_ITEM_MONITOR, the writer inserts one outbox row per
 * target named with store_set_pager, in the same transaction; after COMMIT
 * it calls announce_fn(ctx, max_id) with the highest outbox id committed. The
 * pager records each delivery outcome with a STORE_ITEM_OUTBOX item. States
 * are pinned numbers (outbox.state). */
#define STORE_OUTBOX_PENDING_N 0 /* the numbers, for SQL text (STORE_OUTBOX_SQL_* below) */
#define STORE_OUTBOX_DELIVERED_N 1
#define STORE_OUTBOX_GIVEN_UP_N 2
#define STORE_OUTBOX_SILENCED_N 3
#define STORE_OUTBOX_SKIPPED_N 4
enum store_outbox_state {
    STORE_OUTBOX_PENDING = STORE_OUTBOX_PENDING_N,
    STORE_OUTBOX_DELIVERED = STORE_OUTBOX_DELIVERED_N,
    STORE_OUTBOX_GIVEN_UP = STORE_OUTBOX_GIVEN_UP_N,
    /* held: a silence matched; may become pending again */
    STORE_OUTBOX_SILENCED = STORE_OUTBOX_SILENCED_N,
    /* closed without sending (route, resolved while silenced) */
    STORE_OUTBOX_SKIPPED = STORE_OUTBOX_SKIPPED_N,
};
#define STORE_OUTBOX_TRIGGER 1 /* outbox.kind */
#define STORE_OUTBOX_RESOLVE 2

/* Sets of outbox states as SQL text ("(1, 2, 4)"), built from the numbers
 * the enum is built from, so that the queries (store_open.c, store_prune.c,
 * pager_outbox.c) cannot drift from it. */
#define STORE_SQL_NUM_(n) #n
#define STORE_SQL_NUM(n) STORE_SQL_NUM_(n) /* a macro's number as a string literal */
/* finished: delivered, given up or skipped (done_at set; retention may delete it) */
#define STORE_OUTBOX_SQL_FINISHED                                                                  \
    "(" STORE_SQL_NUM(STORE_OUTBOX_DELIVERED_N) ", " STORE_SQL_NUM(                                \
        STORE_OUTBOX_GIVEN_UP_N) ", " STORE_SQL_NUM(STORE_OUTBOX_SKIPPED_N) ")"
/* sent to the end: delivered or given up (a trigger so opened an incident at its target) */
#define STORE_OUTBOX_SQL_SENT                                                                      \
    "(" STORE_SQL_NUM(STORE_OUTBOX_DELIVERED_N) ", " STORE_SQL_NUM(STORE_OUTBOX_GIVEN_UP_N) ")"
/* undone: pending or silenced (the pager holds the row) */
#define STORE_OUTBOX_SQL_UNDONE                                                                    \
    "(" STORE_SQL_NUM(STORE_OUTBOX_PENDING_N) ", " STORE_SQL_NUM(STORE_OUTBOX_SILENCED_N) ")"
/* outbox.kind of a trigger */
#define STORE_OUTBOX_SQL_TRIGGER STORE_SQL_NUM(STORE_OUTBOX_TRIGGER)
#define STORE_OUTBOX_ERROR_MAX 256

struct store_outbox_outcome {
    int64_t outbox_id;
    int state;                               /* enum store_outbox_state */
    uint32_t attempts;                       /* failed attempts so far */
    double next_attempt_at;                  /* unix seconds; NaN: NULL */
    int http_status;                         /* of the last attempt; 0: NULL */
    char last_error[STORE_OUTBOX_ERROR_MAX]; /* "" : NULL */
};

/* --- STORE_ITEM_ADVICE: ingest's record of one advice on one stream
 * (advice.h, advice_store_delivery). Never refused: the connections it
 * comes from are bounded by ADVICE_MAX_UNACKED_PER_CONN. */
struct store_advice_delivery {
    int64_t advice_id;
    int64_t stream_id;
    int acked; /* 0: sent, 1: acknowledged */
};

/* --- STORE_ITEM_RUN: the run lifecycle's API (store_runs.c). END ends a
 * live run now (it stops counting against max_runs; retention runs from
 * now); DELETE marks it for deletion: the writer deletes every row of it
 * in its own transactions right after, announces STORE_RESULT_RUN_GONE,
 * and refuses its Hellos until then. The waiter (as for silences) gets 0
 * once the batch committed, -ENOENT when no run has that name, -EIO when
 * storage refused it. */
enum store_run_op { STORE_RUN_END = 1, STORE_RUN_DELETE = 2 };

struct store_run_req {
    enum store_run_op op;
    char run[FS_MAX_RUN_ID_LEN + 1];
    struct store_waiter *waiter; /* one reference, owned; released by store_item_free */
    int status;                  /* writer thread: outcome of the latest attempt */
    int64_t out_id;              /* the run's id */
};

/* --- STORE_ITEM_RW_CURSOR: the remote-write sender's cursor, after a 2xx
 * (schema/011_remote_write.sql). It only moves forward. */
struct store_rw_cursor {
    char target[32]; /* the [remote_write "NAME"] section's name (RW_NAME_MAX) */
    int kind;        /* 0: run_id's points up to step pos; 1: alert events up to id pos */
    int64_t run_id;  /* kind 1: 0 */
    int64_t pos;
};

struct store_item {
    struct store_item *next; /* queue link: the store's while queued */
    enum store_item_kind kind;
    uint64_t conn_id; /* the submitter's tag, returned in the result; 0 = no result wanted */
    size_t bytes;     /* accounted size, computed by store_submit */
    union {
        struct store_hello hello;
        struct store_report report;
        struct store_spool_done spool_done;
        struct store_monitor monitor;
        struct store_silence silence;
        struct store_outbox_outcome outbox;
        struct store_advice_delivery advice;
        struct store_run_req run;
        struct store_rw_cursor rw_cursor;
    };
};

/* The stream key of (run, attempt, rank): a nonzero hash that HELLO and
 * REPORT items of one stream carry (collisions only cost a Hello its
 * place ahead). Pure; any thread. */
uint64_t store_stream_key(const char *run, uint32_t attempt, uint32_t rank);

/* Allocates a zeroed item of the kind; NULL when out of memory. Any thread. */
struct store_item *store_item_new(enum store_item_kind kind);
/* Frees an item and what it owns. NULL is a no-op. Any thread. */
void store_item_free(struct store_item *item);

enum store_result_kind {
    STORE_RESULT_HELLO = 1,  /* run_id, stream_id, seq = last committed seq of the stream */
    STORE_RESULT_ACK = 2,    /* seq = highest seq of this conn's reports in the commit */
    STORE_RESULT_RESUME = 3, /* the queue drained below its low watermark */
    /* advice: committed. conn_id 0: new, for the connections of run_id
     * that take advice (stream_id 0: all; else that stream's only); else
     * owed to that connection's stream (after its HELLO result, items 0). */
    STORE_RESULT_ADVICE = 4,
    /* run_id and every row of it were deleted (store_runs.c): its
     * connections close, the monitor stage forgets it */
    STORE_RESULT_RUN_GONE = 5,
};

struct store_result {
    enum store_result_kind kind;
    uint64_t conn_id;
    uint64_t items; /* submitted items of conn_id this result settles */
    int64_t run_id;
    int64_t stream_id;
    uint64_t seq;
    int error_code;           /* 0, or FORESHOCK__ERROR_CODE__* when the item was refused */
    char message[160];        /* when error_code != 0 */
    struct advice_msg advice; /* STORE_RESULT_ADVICE */
    /* STORE_RESULT_HELLO: the stream's attempt, and the run's latest one */
    uint32_t attempt;
    struct attempt_info run_attempt;
};

struct store_opts {
    int synchronous_full; /* 0: synchronous=NORMAL, 1: FULL */
    uint64_t max_runs;
    uint64_t queue_max_items; /* high watermark; low = half */
    uint64_t queue_max_bytes;
    uint64_t batch_max_items;
    struct fs_stats *stats; /* may be NULL (tests) */
    /* Called on the writer thread, without blocking, after results were
     * appended (and after RESUME). May be NULL; see store_set_notify. */
    void (*notify)(void *ctx);
    void *notify_ctx;
    /* Retention (store_prune, run by the writer every prune_interval_s,
     * default FS_STORE_PRUNE_INTERVAL_S): finished outbox rows and expired
     * silences older than these many seconds are deleted. 0: kept forever. */
    double outbox_retention_s;
    double silence_retention_s;
    double prune_interval_s;
    /* The run lifecycle (store_runs.c), seconds, 0: never. A live run with
     * no report for run_idle_end_s ends; an ended run is deleted with every
     * row of it run_retention_s after it ended; a run without any report
     * run_hello_grace_s after its last Hello. max_runs counts live runs
     * (reports > 0, not ended), max_runs_per_token (0: no quota) those of
     * one owner (store_hello.owner). Checked every prune_interval_s, or a
     * quarter of the shortest of these when that is shorter. */
    double run_idle_end_s;
    double run_retention_s;
    double run_hello_grace_s;
    uint64_t max_runs_per_token;
    /* Remote write (remote_write.h): a JSON array of the [remote_write]
     * targets' names. Retention deletes an ended run only once every one
     * of them acknowledged its last step and its alert transitions (their
     * remote_write_cursor rows); a deletion through the API does not wait.
     * NULL: none. Must outlive the store. */
    const char *rw_targets_json;
};

struct store;

/* Opens (creating if needed) the database at path, sets WAL, synchronous,
 * foreign keys and a busy timeout, applies the embedded migrations in order
 * under PRAGMA user_version (each in its own transaction), prepares the
 * statements, opens the spool log "<path>.spool" (spool_open at the end the
 * database recorded; frames an older version kept in the spool table are
 * moved into it; segments of evaluated steps are deleted) and starts the
 * writer thread. Refuses a database whose
 * user_version is newer than the migrations we know. Returns 0 and *out, or
 * a negative errno-style code with a message in err; nothing
 * is left open on failure. Main thread. */
int store_open(const char *path, const struct store_opts *opts, struct store **out,
               struct fs_err *err);

/* Queues item; on 0 the store owns it. -EAGAIN: backpressure (HELLO and
 * REPORT only; the caller keeps the item and retries after RESUME).
 * -ESHUTDOWN: store_close has begun (caller keeps the item). Never blocks.
 * Any thread; in the daemon, the loop thread. */
int store_submit(struct store *s, struct store_item *item);

/* Moves every announced result to the caller: returns the count and a
 * malloc'd array in *out (NULL when 0) that the caller frees. Results of
 * one connection are in submission order. Any thread; in the daemon, the
 * loop thread. */
size_t store_take_results(struct store *s, struct store_result **out);

/* Replaces the notify callback (NULL detaches it; after this returns the
 * old callback is not running and will not be called again). Any thread. */
void store_set_notify(struct store *s, void (*notify)(void *ctx), void *ctx);

/* Outbox: names (n <= STATS_MAX_TARGETS, copied) of the targets that get
 * a row per to_firing / to_resolved transition from now on, and
 * announce(ctx, max_id), called on the writer thread without blocking after
 * a COMMIT that inserted outbox rows (announce_fn NULL: none). Call before the monitor
 * stage submits anything (main thread, at startup). */
void store_set_pager(struct store *s, const char *const *targets, size_t n,
                     void (*announce_fn)(void *ctx, int64_t max_id), void *ctx);

/* Advice (advice.h): the policy that decides which committed firing and
 * resolving transitions get an advice row (NULL: none). p must outlive the
 * store. Call before the monitor stage submits anything (main thread, at
 * startup). */
void store_set_advice(struct store *s, const struct advice_policy *p);

/* While serving is 1, the writer restores stats->ready to 1 after a commit
 * failure clears; main sets it once the daemon is ready and clears it when
 * shutdown begins. Any thread. */
void store_set_serving(struct store *s, int serving);

/* Shutdown has begun: from timeout_s seconds from now on, a batch whose
 * commit fails is given up (its submitters get ERROR_SHUTTING_DOWN results,
 * store_close returns -EIO) instead of retried until the storage recovers,
 * so that a full disk cannot hold the stop forever. timeout_s <= 0: retry
 * without bound. Any thread. */
void store_set_stop_deadline(struct store *s, double timeout_s);

/* The text of a stats->storage_failing code, e.g. "database or disk is
 * full". Static storage. Any thread. */
const char *store_failure_text(int code);

/* Blocks until every item submitted before the call is committed (or
 * refused) and announced. Tests and shutdown; not the loop thread. */
void store_flush(struct store *s);

/* Bytes in the spool log's segment files, as of the last commit (also
 * stats->spool_bytes). Any thread. */
uint64_t store_spool_bytes(struct store *s);

/* Drains the queue (commits and announces everything submitted), stops and
 * joins the writer thread, finalizes statements and closes the database.
 * Undelivered results are discarded. Returns 0, or -EIO when items were
 * given up at the stop deadline (store_set_stop_deadline). NULL is a no-op
 * (0). Main thread. */
int store_close(struct store *s);

/* Retention, one bounded transaction on db (the writer's connection; tests
 * may pass their own): deletes at most max_rows outbox rows that finished
 * (delivered, given up, skipped) before now - outbox_retention_s, and at
 * most max_rows silences that ended before now - silence_retention_s (a
 * retention of 0 deletes nothing of that kind). Never deletes the outbox
 * row with the highest id (SQLite would hand its id out again, below the
 * pager's watermark) nor the trigger of an incident still open at its
 * target (no later row of that alert and target finished: the pager needs
 * it to send the resolve and, for Alertmanager, the re-sends). Oldest ids
 * first, so a trigger never outlives its resolve. Returns 0 with the counts
 * deleted, or a negative errno-style code (rolled back). Writer thread. */
struct store_prune_counts {
    uint64_t outbox, silences;
};
int store_prune(sqlite3 *db, double now, double outbox_retention_s, double silence_retention_s,
                unsigned max_rows, struct store_prune_counts *out);

/* Deletes every row of run run_id, in every table, inside the caller's
 * open transaction on db (the writer's; tests may pass their own). Ids of
 * the deleted rows are never handed out again (id_floor). SQLite rc.
 * Writer thread. */
int store_run_delete_rows(sqlite3 *db, int64_t run_id);

/* A read-only connection to the daemon's database for another thread (the
 * HTTP module): SQLITE_OPEN_READONLY, busy timeout, PRAGMA query_only. The
 * caller owns *out (sqlite3_close). 0 or a negative errno-style code with a
 * message in err. Any thread. */
int store_open_readonly(const char *path, sqlite3 **out, struct fs_err *err);

#endif
