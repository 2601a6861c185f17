#ifndef FORESHOCK_ERR_H
#define FORESHOCK_ERR_H

#include <stdarg.h>

#include "fs_limits.h"

/* Error detail, the daemon's one shape for it (docs/style.md 8: a caller-owned
 * struct, never a global). A function that can fail with a reason takes a
 * `struct fs_err *err` (NULL: the caller does not want the reason), returns
 * 0 or a negative errno-style code, and on failure leaves a complete,
 * printable message in err->msg. The caller declares `struct fs_err err =
 * {0};` and reads err.msg; a message is never longer than FS_ERR_MSG_MAX - 1
 * bytes (longer ones are cut, never overrun).
 *
 * Two optional fields serve the callers that need more than text; a setter
 * never touches them, the module that documents them fills them:
 *  - code: a code for the peer. decode.c puts the FORESHOCK__ERROR_CODE__*
 *    the Error frame carries here.
 *  - line: config.c's line number of the offending line, 0 when the error is
 *    not tied to a line.
 *
 * Pure: no I/O, no allocation; any thread, one err per thread at a time. */

/* Long enough for the longest message: config's, which quote a whole line
 * (FS_CONFIG_MAX_LINE) behind "config: FILE:LINE: key 'NAME': ". */
#define FS_ERR_MSG_MAX (FS_CONFIG_MAX_LINE + 256u)

struct fs_err {
    int code; /* optional: see above (decode: the Error frame's code) */
    int line; /* optional: see above (config: the line, 0 when none) */
    char msg[FS_ERR_MSG_MAX];
};

/* Formats the message into err->msg (nothing when err is NULL) and returns
 * rc, so a failure reads `return fs_err_set(err, -EINVAL, "...", ...);`. */
int fs_err_set(struct fs_err *err, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* fs_err_set with a va_list, for modules that wrap it (decode.c's fail). */
int fs_err_vset(struct fs_err *err, int rc, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

#endif
