#ifndef FORESHOCK_DBLOCK_H
#define FORESHOCK_DBLOCK_H

#include <stddef.h>

#include "fs_err.h"

/* One daemon per database: an exclusive flock(2) on "<db>.lock", held for
 * the daemon's lifetime (the kernel drops it when the process ends, however
 * it ends). Two daemons on one database would both accept a stream, each
 * store part of it, and both page. Readers (HTTP connections, `foreshock
 * backtest`) take no lock. Main thread, at startup and exit. */

/* Takes the lock. Returns the lock's descriptor (>= 0), or a negative errno
 * with a reason in err: -EBUSY when another process holds it (err names its
 * pid when the file says). */
int dblock_acquire(const char *db_path, struct fs_err *err);

/* Releases the lock (fd < 0: nothing). The file stays: removing it would
 * race with a daemon starting. */
void dblock_release(int fd);

#endif
