#include "fs_err.h"

#include <stdio.h>

int fs_err_vset(struct fs_err *err, int rc, const char *fmt, va_list ap)
{
    if (err)
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    return rc;
}

int fs_err_set(struct fs_err *err, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fs_err_vset(err, rc, fmt, ap);
    va_end(ap);
    return rc;
}
