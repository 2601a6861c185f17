/* Reading a recording (recording.h). */
#include "recording.h"

#include <stdlib.h>
#include <string.h>

/* One frame: 1 and *out, 0 at a clean end or a partial last frame
 * (r->truncated), -1 with err. */
static int read_frame(struct recording *r, Foreshock__Frame **out, char *err, size_t errlen)
{
    uint8_t be[4];
    size_t got = fread(be, 1, 4, r->f);
    uint32_t len;

    if (got == 0 && feof(r->f))
        return 0;
    if (got != 4)
        goto partial;
    len = (uint32_t)be[0] << 24 | (uint32_t)be[1] << 16 | (uint32_t)be[2] << 8 | be[3];
    if (len == 0 || len > RECORDING_MAX_FRAME) {
        snprintf(err, errlen, "%s: frame of %u bytes (limit %zu): not a recording?", r->path, len,
                 (size_t)RECORDING_MAX_FRAME);
        return -1;
    }
    if (len > r->cap) {
        uint8_t *nb = realloc(r->buf, len);
        if (!nb) {
            snprintf(err, errlen, "%s: out of memory for a %u-byte frame", r->path, len);
            return -1;
        }
        r->buf = nb;
        r->cap = len;
    }
    if (fread(r->buf, 1, len, r->f) != len)
        goto partial;
    *out = foreshock__frame__unpack(NULL, len, r->buf);
    if (!*out) {
        snprintf(err, errlen, "%s: frame %llu does not decode", r->path,
                 (unsigned long long)r->reports + 1);
        return -1;
    }
    return 1;
partial:
    if (ferror(r->f)) {
        snprintf(err, errlen, "%s: read error", r->path);
        return -1;
    }
    r->truncated = 1;
    return 0;
}

int recording_start(struct recording *r, Foreshock__Frame **hello, char *err, size_t errlen)
{
    char magic[FSC_RECORD_MAGIC_LEN];
    Foreshock__Frame *f = NULL;

    *hello = NULL;
    if (fread(magic, 1, sizeof(magic), r->f) != sizeof(magic) ||
        memcmp(magic, FSC_RECORD_MAGIC, sizeof(magic)) != 0) {
        snprintf(err, errlen, "%s: not a foreshock recording (bad magic)", r->path);
        return -1;
    }
    int rc = read_frame(r, &f, err, errlen);
    if (rc < 0)
        return -1;
    if (rc == 0 || f->body_case != FORESHOCK__FRAME__BODY_HELLO) {
        if (f)
            foreshock__frame__free_unpacked(f, NULL);
        snprintf(err, errlen, "%s: the first frame is not a Hello", r->path);
        return -1;
    }
    *hello = f;
    return 0;
}

int recording_next(struct recording *r, Foreshock__Frame **out, char *err, size_t errlen)
{
    Foreshock__Frame *f = NULL;
    int rc;

    *out = NULL;
    for (;;) {
        if ((rc = read_frame(r, &f, err, errlen)) <= 0)
            return rc;
        if (f->body_case == FORESHOCK__FRAME__BODY_REPORT) {
            r->reports++;
            *out = f;
            return 1;
        }
        int body = (int)f->body_case;
        foreshock__frame__free_unpacked(f, NULL);
        if (body != FORESHOCK__FRAME__BODY_BYE) {
            snprintf(err, errlen, "%s: unexpected frame (body %d) after the Hello", r->path, body);
            return -1;
        }
    }
}

void recording_free(struct recording *r)
{
    free(r->buf);
    r->buf = NULL;
    r->cap = 0;
}
