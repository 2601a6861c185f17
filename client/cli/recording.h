#ifndef FORESHOCK_CLI_RECORDING_H
#define FORESHOCK_CLI_RECORDING_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"

/* Reading a recording (foreshock.h, "Recordings": FSC_RECORD_MAGIC, then
 * frames as on the wire, a Hello first), for `foreshock replay` and
 * `backtest`. Every frame is bounded (RECORDING_MAX_FRAME) before it is
 * allocated; what the file holds is never trusted further than protobuf-c's
 * decoding. Pure over the FILE it is given (a fuzz target reads memory
 * through fmemopen); single-threaded. */

/* The largest frame a recording may hold: a report libforeshock would
 * accept at its largest max_report_bytes, plus the frame and seq header. */
#define RECORDING_MAX_FRAME (FSC_MAX_REPORT_BYTES_LIMIT + 64)

struct recording {
    const char *path; /* for messages */
    FILE *f;          /* the caller's: opened and closed by it */
    uint8_t *buf;
    size_t cap;
    uint64_t reports; /* Report frames read so far */
    int truncated;    /* it ended with a partial frame (a crash, a full disk) */
};

/* Checks the magic and reads the first frame, which must be a Hello.
 * Returns 0 and *hello (free with foreshock__frame__free_unpacked), or -1
 * with the reason in err. */
int recording_start(struct recording *r, Foreshock__Frame **hello, char *err, size_t errlen);

/* The next Report frame (Bye frames are skipped): 1 and *out (the caller
 * frees it), 0 at the end (r->truncated when the file ends inside a frame:
 * the reports before it are good), or -1 with the reason in err (a frame
 * over the bound, one that does not decode, another Hello, a read error). */
int recording_next(struct recording *r, Foreshock__Frame **out, char *err, size_t errlen);

/* Frees the read buffer (not f). */
void recording_free(struct recording *r);

#endif
