#ifndef FORESHOCK_SPOOL_H
#define FORESHOCK_SPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fs_err.h"

/* The sketch spool: report frames the monitors still need, durable before
 * their Ack, deleted once the monitors of their steps are stored.
 *
 * Why not SQLite: raw sketches are inputs, not history (a 7B-like Gram
 * report is 59 MB per rank per step). As BLOBs they went through the WAL,
 * were copied again into the database at checkpoint, and left the file
 * full of free pages once deleted: commits of 3.2 s on average and a 473 MB
 * file for 1.2 MB of live data. Here a frame is written once, with one
 * write(2), into a file that is unlinked as a whole.
 *
 * Layout: an append-only log of records in numbered segment files
 * (SPOOL_SEGMENT_NAME, 16 hex digits) in one directory beside the database
 * ("<db>.spool"). A record is a SPOOL_HEADER_BYTES header (magic, body
 * length, run, stream, rank, seq, step, a check of the header) and the
 * Frame body as it arrived. A new segment starts when the next record
 * would take the current one past FS_SPOOL_SEGMENT_BYTES.
 *
 * Durability, with the database (store.c): the writer appends a batch's
 * records, calls spool_sync (synchronous=full: fdatasync of the segment,
 * and fsync of the directory after a segment was created; normal: nothing,
 * exactly as SQLite's WAL commit under NORMAL survives a process crash but
 * not a power cut), then commits the transaction holding the reports' rows
 * and the log's new end (spool_head, table spool_log). The log is valid up
 * to the committed end: spool_open cuts off what lies past it (appended by
 * a transaction that never committed), so a record exists after a crash
 * exactly when its report's row does, and a report is acked only after
 * that commit.
 *
 * Release: each run has an evaluated step (runs.spool_done_step, committed
 * with the monitor rows derived from those steps). A segment is deleted
 * when every record in it is at or below its run's evaluated step. The
 * replay at startup reads the segments still present, oldest first, and
 * skips records at or below their run's evaluated step.
 *
 * Threads: one owner (the writer thread; the main thread at open and
 * close) for a struct spool. spool_replay opens its own descriptors and may
 * run beside the owner: the owner only deletes segments whose every record
 * the replay would skip, and a segment deleted under an open descriptor
 * still reads to its end. */

#define SPOOL_HEADER_BYTES 48u
#define SPOOL_SEGMENT_NAME "%016llx.seg"
#define SPOOL_DIR_SUFFIX ".spool"
#define SPOOL_PATH_MAX 4160u /* directory (FS_CONFIG_MAX_PATH + suffix) and segment name */

/* A position in the log: segment number and byte offset in it. */
struct spool_pos {
    uint64_t seg;
    uint64_t off;
};

/* What a record says about its frame. */
struct spool_rec {
    int64_t run_id;
    int64_t stream_id;
    uint32_t rank;
    uint64_t seq;
    uint64_t step;
    uint32_t len; /* body bytes, 1..FS_SPOOL_MAX_RECORD_BYTES */
};

struct spool;

struct spool_opts {
    int sync_full;          /* spool_sync's policy: 1 synchronous=full, 0 normal */
    uint64_t segment_bytes; /* a new segment past this (0: FS_SPOOL_SEGMENT_BYTES) */
};

/* Opens the spool in dir (created, mode 0700, if absent) whose committed
 * end is *head ({0, 0}: empty): deletes segments after head.seg, cuts
 * head.seg to head.off, and indexes the records of the segments left (a
 * record whose header does not check ends its segment, with a warning).
 * Appends go to a new segment. Returns 0 and *out, or a negative
 * errno-style code with err. Owner thread. */
int spool_open(const char *dir, const struct spool_pos *head, const struct spool_opts *opts,
               struct spool **out, struct fs_err *err);

/* Closes descriptors and frees; the files stay. NULL is a no-op. */
void spool_close(struct spool *sp);

/* Appends one record (body: rec->len bytes, the Frame body). 0, or a
 * negative errno (ENOSPC, EIO, ...; -EINVAL for a length out of range);
 * after a failure the caller rewinds to its committed end. Owner thread. */
int spool_append(struct spool *sp, const struct spool_rec *rec, const uint8_t *body);

/* Sets (NULL: clears) a hook that spool_append calls between the pieces
 * (FS_SPOOL_WRITE_CHUNK_BYTES) of a record it writes, on the owner thread:
 * the store commits queued Hellos there while a large batch is written to
 * the log. The hook must not call into this spool; the record is
 * incomplete meanwhile, past the committed end. Owner thread. */
void spool_set_yield(struct spool *sp, void (*yield)(void *ctx), void *ctx);

/* Makes the records appended so far durable by the open policy (see the
 * top). 0 or a negative errno. Owner thread. */
int spool_sync(struct spool *sp);

/* The end of the log: where the next record goes. Owner thread. */
struct spool_pos spool_head(const struct spool *sp);

/* The transaction that was to record the appends after *to failed: they
 * are undone (segments created since are deleted, the segment holding *to
 * is cut back to it). 0 or a negative errno. Owner thread. */
int spool_rewind(struct spool *sp, const struct spool_pos *to);

/* Raises run_id's evaluated step to step (committed: the monitors of every
 * step <= step are stored). 0 or -ENOMEM. Owner thread. */
int spool_set_done(struct spool *sp, int64_t run_id, int64_t step);

/* Deletes every segment whose records are all evaluated, the one being
 * appended to included when nothing appended to it is uncommitted (it is
 * closed, and the next append starts a new segment). commit_end: the end
 * the database holds. Returns the number of segments deleted; a segment
 * that cannot be deleted stays (warned once per call). Owner thread. */
size_t spool_release(struct spool *sp, const struct spool_pos *commit_end);

/* Every run of a record in the log that known(ctx, run_id) says is gone
 * (deleted with its rows: the run lifecycle) counts as evaluated, so its
 * records go with spool_release. 0 or -ENOMEM. Owner thread. */
int spool_forget_runs(struct spool *sp, bool (*known)(void *ctx, int64_t run_id), void *ctx);

/* Bytes in the segment files. Owner thread. */
uint64_t spool_bytes(const struct spool *sp);

/* Replay (restart): the records of dir's segments up to head, oldest
 * first. For each record want(ctx, rec) decides; when it returns true the
 * body is read and feed(ctx, rec, body) called (body valid during the call;
 * a negative return stops the replay with that code). A header that does
 * not check, or a body cut short, ends that segment (counted in
 * st->unreadable). Returns 0 or a negative errno-style code with err. Any
 * thread (see the top). */
struct spool_replay_ops {
    int (*want)(void *ctx, const struct spool_rec *rec);
    int (*feed)(void *ctx, const struct spool_rec *rec, const uint8_t *body);
    void *ctx;
};
struct spool_replay_stats {
    uint64_t records, fed, unreadable, bytes_fed;
};
int spool_replay(const char *dir, const struct spool_pos *head, const struct spool_replay_ops *ops,
                 struct spool_replay_stats *st, struct fs_err *err);

/* "<db_path>.spool" into out (outlen bytes). 0, or -ENAMETOOLONG. Pure. */
int spool_dir_of(const char *db_path, char *out, size_t outlen);

#endif
