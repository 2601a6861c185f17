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
 * ("<db>.spool"). A record is a SPOOL_HEADER_BYTES header (magic "FSR2",
 * body length, run, stream, seq, step, rank, the body's CRC-32C, and a
 * CRC-32C of the header before it) and the Frame body as it arrived: one
 * changed bit anywhere in a record fails a check. Records of the format
 * before (v1, magic "FSR1": SPOOL_V1_HEADER_BYTES, a check of the header
 * only) are still read, so that a spool written by an older foreshockd is
 * replayed after an upgrade; new records are always v2. A new segment
 * starts when the next record would take the current one past
 * FS_SPOOL_SEGMENT_BYTES.
 *
 * Damage: a reader that meets bytes that are not a record (a header whose
 * check fails) looks for the next offset where a header checks and its
 * body fits, and goes on from there (the stretch passed over is counted,
 * with its bytes); a record whose body fails its CRC is not replayed.
 * The database keeps where each acknowledged frame of a step not yet
 * evaluated lies (table spool_frames); the replay at startup compares the
 * two, and each such frame is found intact, damaged or missing.
 *
 * A spool removed under the running daemon: spool_check (at each append,
 * sync and batch) notices the directory or a segment with unevaluated
 * records deleted or replaced; from then on appends and syncs fail
 * (-ESTALE), so nothing more is acknowledged, until a restart.
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
 * when every record in it is at or below its run's evaluated step. It
 * rises with evaluation and falls only with a rewind to an earlier step
 * (spool_lower_done): the new attempt's records of steps the old one had
 * evaluated are unevaluated again. The
 * replay at startup reads the segments still present, oldest first, and
 * skips records at or below their run's evaluated step.
 *
 * Threads: one owner (the writer thread; the main thread at open and
 * close) for a struct spool. spool_replay opens its own descriptors and may
 * run beside the owner: the owner only deletes segments whose every record
 * the replay would skip, and a segment deleted under an open descriptor
 * still reads to its end. */

#define SPOOL_HEADER_BYTES 56u    /* v2, every record written */
#define SPOOL_V1_HEADER_BYTES 48u /* v1, read only */
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

/* Why appends stopped (spool_check). */
enum spool_fault {
    SPOOL_FAULT_NONE,
    SPOOL_FAULT_DIR_REMOVED,
    SPOOL_FAULT_DIR_REPLACED,
    SPOOL_FAULT_SEGMENT_REMOVED,
    SPOOL_FAULT_SEGMENT_REPLACED,
    SPOOL_FAULT_COUNT
};

/* Is the log still where it was opened? Looks at the directory (still
 * there, the same inode), the append segment (not unlinked) and one closed
 * segment (there, the same inode; each in turn over the calls). The first
 * fault found is logged once at ERROR and stays: this and every later
 * append, sync and check return -ESTALE. 0 or -ESTALE. Owner thread. */
int spool_check(struct spool *sp);

/* The fault spool_check found (SPOOL_FAULT_NONE: none), and its name for
 * logs and metrics ("dir_removed", ...). */
int spool_fault(const struct spool *sp);
const char *spool_fault_name(int fault);

/* Closes descriptors and frees; the files stay. NULL is a no-op. */
void spool_close(struct spool *sp);

/* Appends one record (body: rec->len bytes, the Frame body). 0, or a
 * negative errno (ENOSPC, EIO, ...; -EINVAL for a length out of range,
 * -ESTALE after a spool_check fault); after a failure the caller rewinds
 * to its committed end. Owner thread. */
int spool_append(struct spool *sp, const struct spool_rec *rec, const uint8_t *body);

/* Where the record the last successful spool_append wrote starts. Owner
 * thread. */
struct spool_pos spool_last(const struct spool *sp);

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

/* Lowers run_id's evaluated step to step (committed: a rewind to step made
 * the run's later records unevaluated again). Owner thread. */
void spool_lower_done(struct spool *sp, int64_t run_id, int64_t step);

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

/* An acknowledged frame the database places in the log (spool_frames). */
struct spool_frame {
    uint64_t seg, off; /* where its record starts */
    int64_t run_id, stream_id;
    uint64_t seq, step;
};

/* Replay (restart): the records of dir's segments up to head, oldest
 * first. For each record want(ctx, rec) decides; when it returns true the
 * body is read and checked, and feed(ctx, rec, body) called (body valid
 * during the call; a negative return stops the replay with that code). A
 * record whose body fails its CRC is not fed; bytes that are not a record
 * are passed over to the next record (both counted in st->unreadable, the
 * bytes in st->skipped_bytes, and logged per segment at ERROR).
 *
 * acked[0..nacked) (sorted by seg, off; may be NULL): the acknowledged
 * frames of steps not yet evaluated. Each is looked up at its place: a
 * record there with the same run, stream, seq and step whose body checks
 * is intact; a segment absent or shorter than the offset makes it missing;
 * anything else damaged (st->lost_missing, st->lost_damaged; logged).
 *
 * Returns 0 or a negative errno-style code with err. Any thread (see the
 * top). */
struct spool_replay_ops {
    int (*want)(void *ctx, const struct spool_rec *rec);
    int (*feed)(void *ctx, const struct spool_rec *rec, const uint8_t *body);
    void *ctx;
    const struct spool_frame *acked;
    size_t nacked;
};
struct spool_replay_stats {
    uint64_t records, fed, bytes_fed;
    uint64_t unreadable;    /* damaged records: stretches passed over, bodies failing the CRC */
    uint64_t skipped_bytes; /* bytes of the stretches passed over */
    uint64_t v1_records;    /* records of the format before CRCs (body unchecked) */
    uint64_t acked, lost_missing, lost_damaged; /* of ops->acked */
};
int spool_replay(const char *dir, const struct spool_pos *head, const struct spool_replay_ops *ops,
                 struct spool_replay_stats *st, struct fs_err *err);

/* The record reader over one segment's bytes in memory (the fuzzer's way
 * in; the same walk as the replay's): on_rec (may be NULL) for each record
 * whose header checks, with intact = its body checks too (v1: always);
 * a negative return stops the scan with it. Every byte of p ends up in a
 * record or in a stretch passed over: record_bytes + skipped_bytes == n.
 * Returns 0 or on_rec's code. Pure. */
struct spool_scan_stats {
    uint64_t records, v1_records, bad_bodies, record_bytes;
    uint64_t damaged, skipped_bytes;
};
int spool_scan(const uint8_t *p, size_t n,
               int (*on_rec)(void *ctx, uint64_t off, const struct spool_rec *r, int intact),
               void *ctx, struct spool_scan_stats *st);

/* "<db_path>.spool" into out (outlen bytes). 0, or -ENAMETOOLONG. Pure. */
int spool_dir_of(const char *db_path, char *out, size_t outlen);

#endif
