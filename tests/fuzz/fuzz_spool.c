/* libFuzzer target: the spool's record reader (spool.h) on arbitrary
 * segment bytes. The first input byte picks how the segment is made:
 *  - even: the rest of the input is the segment, as found on disk;
 *  - odd: records are appended through spool_append (bodies cut from the
 *    input, up to FUZZ_RECORDS), then bytes of the written segment are
 *    flipped where the input's tail says: valid records with damage in
 *    them, so that resynchronisation and the CRCs are reached at once.
 * Each segment is read twice: in memory (spool_scan) and as a file
 * (spool_replay, with every record the scan found given as acknowledged).
 * Failures: a crash or sanitizer report, a byte neither in a record nor
 * passed over, records out of order or overlapping, and the two readers
 * disagreeing about records, damage, skipped bytes or lost frames. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "spool.h"

#define FUZZ_MAX_BYTES (1u << 20) /* segments larger are not read */
#define FUZZ_RECORDS 8            /* records appended in the odd mode */
#define FUZZ_MAX_FOUND 4096       /* acknowledged frames handed to the replay */

static char dir[64];
static char seg_path[128];

struct found {
    struct spool_frame f[FUZZ_MAX_FOUND];
    size_t n;     /* kept in f */
    size_t count; /* records seen */
    size_t intact;
    uint64_t end; /* where the last record ended */
};

static int on_rec(void *ctx, uint64_t off, const struct spool_rec *r, int intact)
{
    struct found *fd = ctx;
    if (off < fd->end) /* out of order or overlapping */
        abort();
    fd->end = off + r->len; /* at least; the header adds more */
    fd->count++;
    if (fd->n < FUZZ_MAX_FOUND)
        fd->f[fd->n++] = (struct spool_frame){.seg = 1,
                                              .off = off,
                                              .run_id = r->run_id,
                                              .stream_id = r->stream_id,
                                              .seq = r->seq,
                                              .step = r->step};
    fd->intact += (size_t)intact;
    return 0;
}

static int want_all(void *ctx, const struct spool_rec *r)
{
    (void)ctx;
    (void)r;
    return 1;
}

static int feed_none(void *ctx, const struct spool_rec *r, const uint8_t *body)
{
    (void)r;
    (void)body;
    ++*(uint64_t *)ctx;
    return 0;
}

static void write_file(const uint8_t *p, size_t n)
{
    FILE *f = fopen(seg_path, "wb");
    if (!f || (n && fwrite(p, 1, n, f) != n) || fclose(f) != 0)
        abort();
}

/* The odd mode: records through spool_append, then flips. Returns the
 * segment's bytes (malloc'd) and *n, or NULL. */
static uint8_t *appended(const uint8_t *data, size_t size, size_t *n)
{
    /* Opened at the empty end: the segments of the last input are cut. */
    struct spool *sp;
    struct fs_err err = {0};
    struct spool_pos none = {0, 0};
    struct spool_opts o = {.sync_full = 0, .segment_bytes = FUZZ_MAX_BYTES};
    if (spool_open(dir, &none, &o, &sp, &err) < 0)
        abort();
    size_t at = 0;
    for (unsigned i = 0; i < FUZZ_RECORDS && at < size; i++) {
        size_t len = 1 + data[at++] % 64;
        if (len > size - at)
            len = size - at;
        if (!len)
            break;
        struct spool_rec r = {.run_id = 1 + i % 3,
                              .stream_id = 7,
                              .rank = i,
                              .seq = i + 1,
                              .step = 10 * i,
                              .len = (uint32_t)len};
        if (spool_append(sp, &r, data + at) < 0)
            abort();
        at += len;
    }
    spool_close(sp);
    FILE *f = fopen(seg_path, "rb");
    if (!f)
        return NULL; /* nothing appended */
    uint8_t *p = malloc(FUZZ_MAX_BYTES);
    if (!p)
        abort();
    *n = fread(p, 1, FUZZ_MAX_BYTES, f);
    fclose(f);
    /* The tail: pairs (position, xor mask). */
    for (; at + 2 <= size && *n; at += 2)
        p[(data[at] * 131u + at) % *n] ^= data[at + 1] ? data[at + 1] : 1;
    return p;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct found fd;
    if (!dir[0]) {
        snprintf(dir, sizeof(dir), "/tmp/fuzz-spool-XXXXXX");
        if (!mkdtemp(dir))
            abort();
        snprintf(seg_path, sizeof(seg_path), "%s/" SPOOL_SEGMENT_NAME, dir, 1ull);
    }
    if (size < 1 || size > FUZZ_MAX_BYTES)
        return 0;
    uint8_t *owned = NULL;
    const uint8_t *seg = data + 1;
    size_t n = size - 1;
    if (data[0] & 1) {
        owned = appended(data + 1, size - 1, &n);
        if (!owned)
            return 0;
        seg = owned;
    }

    memset(&fd, 0, sizeof(fd));
    struct spool_scan_stats sc;
    if (spool_scan(seg, n, on_rec, &fd, &sc) != 0)
        abort();
    if (sc.record_bytes + sc.skipped_bytes != n || sc.records != fd.count ||
        sc.records - sc.bad_bodies != fd.intact)
        abort();

    /* The same bytes as a file, through the replay. */
    write_file(seg, n);
    uint64_t fed = 0;
    struct spool_replay_ops ops = {.want = want_all,
                                   .feed = feed_none,
                                   .ctx = &fed,
                                   .acked = fd.count == fd.n ? fd.f : NULL,
                                   .nacked = fd.count == fd.n ? fd.n : 0};
    struct spool_replay_stats st;
    struct fs_err err = {0};
    struct spool_pos head = {1, n};
    if (spool_replay(dir, &head, &ops, &st, &err) != 0)
        abort();
    if (st.records != sc.records || st.fed != fed || fed != fd.intact ||
        st.unreadable != sc.damaged + sc.bad_bodies || st.skipped_bytes != sc.skipped_bytes ||
        st.v1_records != sc.v1_records || st.lost_missing != 0 ||
        st.lost_damaged != (ops.acked ? sc.bad_bodies : 0))
        abort();
    free(owned);
    return 0;
}
