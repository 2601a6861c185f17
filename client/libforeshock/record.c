/* Recording writer (see record.h): the magic, the Hello, then every
 * submitted report as a wire frame. Buffered stdio: a report costs one
 * memcpy into the FILE buffer plus a write(2) per few KB, on the caller's
 * thread. */
#include "record.h"

#include <errno.h>
#include <string.h>

#include "foreshock.h"
#include "wire.h"

/* A recording is for the trainer's eyes and for bug reports: its FILE
 * buffer is large enough that a sketch report is a handful of writes. */
#define RECORD_BUFFER_BYTES (1u << 20)

static int fail(struct fsc_recorder *r, int rc)
{
    if (r->f)
        fclose(r->f);
    r->f = NULL;
    r->failed = 1;
    return rc;
}

int fsc_record_open(struct fsc_recorder *r, const char *path, const uint8_t *hello,
                    size_t hello_len, char *err, size_t errlen)
{
    *r = (struct fsc_recorder){0};
    r->f = fopen(path, "wbe");
    if (!r->f)
        return fsc_err(err, errlen, -errno, "cannot create recording '%s': %s", path,
                       strerror(errno));
    setvbuf(r->f, NULL, _IOFBF, RECORD_BUFFER_BYTES);
    errno = 0;
    if (fwrite(FSC_RECORD_MAGIC, 1, FSC_RECORD_MAGIC_LEN, r->f) != FSC_RECORD_MAGIC_LEN ||
        fwrite(hello, 1, hello_len, r->f) != hello_len || fflush(r->f) != 0) {
        int rc = errno ? -errno : -EIO;
        fail(r, rc);
        return fsc_err(err, errlen, rc, "cannot write recording '%s': %s", path, strerror(-rc));
    }
    return 0;
}

int fsc_record_report(struct fsc_recorder *r, const struct fsc_entry *e)
{
    uint8_t hdr[FSC_WIRE_REPORT_HDR_MAX];
    size_t h;

    if (!r->f)
        return -EBADF;
    h = fsc_wire_report_header(r->written + 1, e->len, hdr);
    errno = 0;
    if (fwrite(hdr, 1, h, r->f) != h || fwrite(e->body, 1, e->len, r->f) != e->len)
        return fail(r, errno ? -errno : -EIO);
    r->written++;
    return 0;
}

int fsc_record_close(struct fsc_recorder *r)
{
    int rc = 0;

    if (!r->f)
        return 0;
    errno = 0;
    if (fclose(r->f) != 0)
        rc = errno ? -errno : -EIO;
    r->f = NULL;
    return rc;
}
