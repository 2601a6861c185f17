#ifndef FSC_RECORD_H
#define FSC_RECORD_H

/* Recording: the stream a client produces, written to a file as it is
 * submitted, so that it can be replayed into a daemon later (`foreshock
 * replay`) or attached to a bug report. File format in foreshock.h
 * (FSC_RECORD_MAGIC).
 *
 * Threads: the writer is owned by one client and called under that
 * client's mutex (so file order is submission order). */

#include <stdint.h>
#include <stdio.h>

#include "internal.h"
#include "replay.h"

struct fsc_recorder {
    FILE *f;          /* NULL: not recording (never opened, or stopped by an error) */
    uint64_t written; /* reports written; also the seq of the last (1, 2, ... in file order) */
    int failed;       /* a write failed: recording stopped, the file ends early */
};

/* Creates (truncates) path and writes the magic and the Hello frame
 * (hello, hello_len: a length-prefixed frame as fsc_wire_pack makes it).
 * Returns 0, or a negative errno with a reason in err. */
FSC_HIDDEN int fsc_record_open(struct fsc_recorder *r, const char *path, const uint8_t *hello,
                               size_t hello_len, char *err, size_t errlen);

/* Appends e as a Report frame with the recorder's next seq. Returns 0,
 * -EBADF when not recording, or the -errno of a failed write (the recorder
 * then stops: a partial frame at the end is the only damage, and readers
 * stop at it). */
FSC_HIDDEN int fsc_record_report(struct fsc_recorder *r, const struct fsc_entry *e);

/* Flushes and closes the file. Returns 0 or the -errno of the last flush. */
FSC_HIDDEN int fsc_record_close(struct fsc_recorder *r);

#endif
