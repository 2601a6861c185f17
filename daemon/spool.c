/* The sketch spool: an append-only log of report frames in segment files.
 * See spool.h for the contract with the database. */
#include "spool.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include "crc32c.h"
#include "fs_grow.h"
#include "fs_limits.h"
#include "log.h"

#define SPOOL_MAGIC_V1 0x31525346u        /* "FSR1" read as little-endian */
#define SPOOL_MAGIC 0x32525346u           /* "FSR2" */
#define SPOOL_V1_CHECK_BYTES 44u          /* the v1 header bytes its FNV-1a check covers */
#define SPOOL_CHECK_BYTES 52u             /* the v2 header bytes its CRC-32C covers */
#define SPOOL_NAME_LEN 20u                /* 16 hex digits + ".seg" */
#define SPOOL_MAX_SEGMENTS (1u << 20)     /* directory entries looked at, at most */
#define SPOOL_SCAN_BYTES (16u << 10)      /* read at a time looking for the next record */
#define SPOOL_BODY_CHECK_BYTES (1u << 20) /* read at a time checking a body not replayed */

_Static_assert(SPOOL_V1_CHECK_BYTES + 4 == SPOOL_V1_HEADER_BYTES, "the check ends the header");
_Static_assert(SPOOL_CHECK_BYTES + 4 == SPOOL_HEADER_BYTES, "the check ends the header");
_Static_assert(SPOOL_V1_HEADER_BYTES <= SPOOL_HEADER_BYTES, "v2 headers are the larger");
_Static_assert(FS_SPOOL_MAX_RECORD_BYTES <= UINT32_MAX, "record length is a u32");

struct seg_run {
    int64_t run_id;
    int64_t max_step; /* highest step of a record of run_id in the segment */
};

struct seg {
    uint64_t no;
    uint64_t bytes; /* file size (as far as indexed) */
    uint64_t ino;   /* the file's inode: spool_check notices a replaced file */
    struct seg_run *runs;
    size_t nruns, cap;
};

struct done {
    int64_t run_id;
    int64_t step;
};

struct spool {
    char dir[SPOOL_PATH_MAX];
    int dirfd;
    int sync_full;
    uint64_t segment_bytes;
    struct seg *segs; /* ascending number; the last is the append segment when fd >= 0 */
    size_t nsegs, cap;
    int fd;                    /* append segment, -1: none (the next append creates one) */
    uint64_t next_no;          /* number of the next segment created */
    int dir_dirty;             /* a segment was created since the last sync */
    struct spool_pos idle_end; /* the end of the log while no segment is open for appending */
    struct done *done;
    size_t ndone, capdone;
    uint64_t bytes;
    void (*yield)(void *ctx); /* spool_set_yield: between the pieces of an append */
    void *yield_ctx;
    struct spool_pos last; /* where the last record appended starts */
    dev_t dir_dev;         /* the directory opened (spool_check: still there, still it) */
    ino_t dir_ino;
    size_t check_next; /* the closed segment spool_check looks at next (one per call) */
    int fault;         /* enum spool_fault; sticky */
};

/* --- header encoding (little-endian, whatever the host) --------------------------- */

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* v1's check, FNV-1a over the header: catches a torn or zeroed header (a
 * power cut under synchronous=normal), not a changed body. Read, never
 * written any more. */
static uint32_t v1_check_of(const uint8_t *p)
{
    uint32_t h = 2166136261u;
    for (unsigned i = 0; i < SPOOL_V1_CHECK_BYTES; i++)
        h = (h ^ p[i]) * 16777619u;
    return h;
}

/* v2: magic u32 | len u32 | run i64 | stream i64 | seq u64 | step u64 |
 * rank u32 | body CRC-32C u32 | flags u32 (0) | CRC-32C of the 52 bytes
 * before it. The header's CRC covers the body's, so one flipped bit
 * anywhere in the record fails a check; the header's alone lets a reader
 * trust a length (and skip a body) before it reads the body.
 * v1 (48 bytes): magic "FSR1" | len | run | stream | seq | step | rank |
 * FNV-1a of the 44 bytes before it; the body has no check. */
static void header_encode(const struct spool_rec *r, uint32_t body_crc, uint8_t *p)
{
    put32(p, SPOOL_MAGIC);
    put32(p + 4, r->len);
    put64(p + 8, (uint64_t)r->run_id);
    put64(p + 16, (uint64_t)r->stream_id);
    put64(p + 24, r->seq);
    put64(p + 32, r->step);
    put32(p + 40, r->rank);
    put32(p + 44, body_crc);
    put32(p + 48, 0);
    put32(p + 52, crc32c(p, SPOOL_CHECK_BYTES));
}

/* A header that checks, decoded. */
struct hdr {
    struct spool_rec r;
    unsigned bytes;    /* header bytes: SPOOL_HEADER_BYTES or SPOOL_V1_HEADER_BYTES */
    int v1;            /* no body check */
    uint32_t body_crc; /* v2 */
};

/* Decodes the header at p, of which avail bytes are readable: 0 and *h,
 * or -EBADMSG (no magic, a check that fails, a length out of range, or
 * fewer bytes than the header). Pure. */
static int header_decode(const uint8_t *p, size_t avail, struct hdr *h)
{
    if (avail < SPOOL_V1_HEADER_BYTES)
        return -EBADMSG;
    uint32_t magic = get32(p);
    if (magic == SPOOL_MAGIC) {
        if (avail < SPOOL_HEADER_BYTES || get32(p + 48) != 0 ||
            get32(p + 52) != crc32c(p, SPOOL_CHECK_BYTES))
            return -EBADMSG;
        h->bytes = SPOOL_HEADER_BYTES;
        h->v1 = 0;
        h->body_crc = get32(p + 44);
    } else if (magic == SPOOL_MAGIC_V1) {
        if (get32(p + 44) != v1_check_of(p))
            return -EBADMSG;
        h->bytes = SPOOL_V1_HEADER_BYTES;
        h->v1 = 1;
        h->body_crc = 0;
    } else {
        return -EBADMSG;
    }
    h->r.len = get32(p + 4);
    h->r.run_id = (int64_t)get64(p + 8);
    h->r.stream_id = (int64_t)get64(p + 16);
    h->r.seq = get64(p + 24);
    h->r.step = get64(p + 32);
    h->r.rank = get32(p + 40);
    if (h->r.len == 0 || h->r.len > FS_SPOOL_MAX_RECORD_BYTES)
        return -EBADMSG;
    return 0;
}

/* --- segment files ------------------------------------------------------------------ */

int spool_dir_of(const char *db_path, char *out, size_t outlen)
{
    int n = snprintf(out, outlen, "%s%s", db_path, SPOOL_DIR_SUFFIX);
    return n < 0 || (size_t)n >= outlen ? -ENAMETOOLONG : 0;
}

static void seg_name(uint64_t no, char *out, size_t len)
{
    snprintf(out, len, SPOOL_SEGMENT_NAME, (unsigned long long)no);
}

/* The segment number of a directory entry's name, or -1. */
static int parse_name(const char *name, uint64_t *no)
{
    if (strlen(name) != SPOOL_NAME_LEN || strcmp(name + 16, ".seg") != 0)
        return -1;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = name[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v << 4 | (uint64_t)d;
    }
    *no = v;
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Segment numbers in dir, ascending, in *out (malloc'd; NULL when none). */
static int list_segments(const char *dir, uint64_t **out, size_t *n, struct fs_err *err)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) {
        int rc = -errno;
        fs_err_set(err, 0, "spool %s: %s", dir, strerror(errno));
        return rc;
    }
    size_t cap = 0;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        uint64_t no;
        if (parse_name(e->d_name, &no) < 0)
            continue;
        if (*n == SPOOL_MAX_SEGMENTS) {
            fs_err_set(err, 0, "spool %s: more than %u segment files", dir, SPOOL_MAX_SEGMENTS);
            rc = -E2BIG;
            break;
        }
        uint64_t *p = fs_grow(*out, &cap, *n + 1, sizeof(*p), 64);
        if (!p) {
            fs_err_set(err, 0, "out of memory");
            rc = -ENOMEM;
            break;
        }
        *out = p;
        (*out)[(*n)++] = no;
    }
    closedir(d);
    if (rc < 0) {
        free(*out);
        *out = NULL;
        *n = 0;
        return rc;
    }
    if (*n)
        qsort(*out, *n, sizeof(**out), cmp_u64);
    return 0;
}

/* Where a walk reads: a segment file, or (spool_scan) memory. */
struct src {
    int fd; /* -1: mem */
    const uint8_t *mem;
    uint64_t size; /* mem's bytes */
};

/* Reads up to len bytes at off: the count (less only at the end of the
 * file), or a negative errno. */
static ssize_t src_read(const struct src *s, void *buf, size_t len, uint64_t off)
{
    if (s->fd < 0) {
        size_t n = off >= s->size ? 0 : s->size - off < len ? (size_t)(s->size - off) : len;
        if (n)
            memcpy(buf, s->mem + off, n);
        return (ssize_t)n;
    }
    uint8_t *p = buf;
    size_t got = 0;
    while (got < len) {
        ssize_t k = pread(s->fd, p + got, len - got, (off_t)(off + got));
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno;
        if (k == 0)
            break;
        got += (size_t)k;
    }
    return (ssize_t)got;
}

/* A segment read record by record up to end. What does not read as a
 * record (a header that does not check, a body past the end) is passed
 * over to the next offset where a header checks and its body fits: one
 * damaged stretch, its bytes skipped. */
struct walk {
    const struct src *src;
    uint64_t end;
    uint64_t off;     /* where the next record is looked for */
    uint64_t damaged; /* stretches passed over */
    uint64_t skipped; /* their bytes */
};

struct found {
    uint64_t off; /* where the record starts */
    struct hdr h;
};

static int fits(const struct hdr *h, uint64_t off, uint64_t end)
{
    return off <= end && h->bytes + (uint64_t)h->r.len <= end - off;
}

/* The first offset >= from where a record starts (w->end: none). 0, or a
 * negative errno. */
static int resync(const struct walk *w, uint64_t from, uint64_t *next)
{
    uint8_t buf[SPOOL_SCAN_BYTES + SPOOL_HEADER_BYTES];
    for (uint64_t base = from; base < w->end; base += SPOOL_SCAN_BYTES) {
        size_t want = w->end - base < sizeof(buf) ? (size_t)(w->end - base) : sizeof(buf);
        ssize_t k = src_read(w->src, buf, want, base);
        if (k < 0)
            return (int)k;
        size_t n = (size_t)k, lim = n < SPOOL_SCAN_BYTES ? n : SPOOL_SCAN_BYTES;
        for (size_t i = 0; i < lim; i++) {
            const uint8_t *q = memchr(buf + i, 'F', lim - i); /* both magics start "FSR" */
            if (!q)
                break;
            i = (size_t)(q - buf);
            struct hdr h;
            if (header_decode(q, n - i, &h) == 0 && fits(&h, base + i, w->end)) {
                *next = base + i;
                return 0;
            }
        }
        if (n < want)
            break; /* the file ends before w->end */
    }
    *next = w->end;
    return 0;
}

/* The next record: 1 and *f, 0 at the end, or a negative errno. */
static int walk_next(struct walk *w, struct found *f)
{
    uint8_t b[SPOOL_HEADER_BYTES];
    while (w->off < w->end) {
        size_t want = w->end - w->off < sizeof(b) ? (size_t)(w->end - w->off) : sizeof(b);
        ssize_t k = src_read(w->src, b, want, w->off);
        if (k < 0)
            return (int)k;
        if (header_decode(b, (size_t)k, &f->h) == 0 && fits(&f->h, w->off, w->end)) {
            f->off = w->off;
            w->off += f->h.bytes + (uint64_t)f->h.r.len;
            return 1;
        }
        uint64_t next;
        int rc = resync(w, w->off + 1, &next);
        if (rc < 0)
            return rc;
        w->damaged++;
        w->skipped += next - w->off;
        w->off = next;
    }
    return 0;
}

/* Reads f's body into buf (f->h.r.len bytes) and checks it (v2): 0,
 * -EBADMSG when the CRC does not match or the file ends first, or a
 * negative errno. */
static int body_read(const struct src *s, const struct found *f, uint8_t *buf)
{
    ssize_t k = src_read(s, buf, f->h.r.len, f->off + f->h.bytes);
    if (k < 0)
        return (int)k;
    if ((size_t)k < f->h.r.len)
        return -EBADMSG;
    if (!f->h.v1 && crc32c(buf, f->h.r.len) != f->h.body_crc)
        return -EBADMSG;
    return 0;
}

int spool_scan(const uint8_t *p, size_t n,
               int (*on_rec)(void *ctx, uint64_t off, const struct spool_rec *r, int intact),
               void *ctx, struct spool_scan_stats *st)
{
    memset(st, 0, sizeof(*st));
    struct src s = {.fd = -1, .mem = p, .size = n};
    struct walk w = {.src = &s, .end = n};
    struct found f;
    int rc;
    while ((rc = walk_next(&w, &f)) == 1) {
        int intact = f.h.v1 || crc32c(p + f.off + f.h.bytes, f.h.r.len) == f.h.body_crc;
        st->records++;
        st->v1_records += f.h.v1;
        st->record_bytes += f.h.bytes + (uint64_t)f.h.r.len;
        st->bad_bodies += !intact;
        if (on_rec && (rc = on_rec(ctx, f.off, &f.h.r, intact)) < 0)
            return rc;
    }
    st->damaged = w.damaged;
    st->skipped_bytes = w.skipped;
    return rc;
}

/* --- the in-memory index ------------------------------------------------------------ */

static int seg_note(struct seg *g, int64_t run_id, int64_t step)
{
    for (size_t i = 0; i < g->nruns; i++) {
        if (g->runs[i].run_id == run_id) {
            if (step > g->runs[i].max_step)
                g->runs[i].max_step = step;
            return 0;
        }
    }
    struct seg_run *r = fs_grow(g->runs, &g->cap, g->nruns + 1, sizeof(*r), 4);
    if (!r)
        return -ENOMEM;
    g->runs = r;
    g->runs[g->nruns++] = (struct seg_run){.run_id = run_id, .max_step = step};
    return 0;
}

static struct seg *seg_add(struct spool *sp, uint64_t no)
{
    struct seg *s = fs_grow(sp->segs, &sp->cap, sp->nsegs + 1, sizeof(*s), 16);
    if (!s)
        return NULL;
    sp->segs = s;
    struct seg *g = &sp->segs[sp->nsegs++];
    memset(g, 0, sizeof(*g));
    g->no = no;
    return g;
}

static void seg_remove(struct spool *sp, size_t i)
{
    sp->bytes -= sp->segs[i].bytes;
    free(sp->segs[i].runs);
    memmove(&sp->segs[i], &sp->segs[i + 1], (sp->nsegs - i - 1) * sizeof(*sp->segs));
    sp->nsegs--;
}

static int64_t done_of(const struct spool *sp, int64_t run_id)
{
    for (size_t i = 0; i < sp->ndone; i++)
        if (sp->done[i].run_id == run_id)
            return sp->done[i].step;
    return -1;
}

int spool_set_done(struct spool *sp, int64_t run_id, int64_t step)
{
    for (size_t i = 0; i < sp->ndone; i++) {
        if (sp->done[i].run_id == run_id) {
            if (step > sp->done[i].step)
                sp->done[i].step = step;
            return 0;
        }
    }
    struct done *d = fs_grow(sp->done, &sp->capdone, sp->ndone + 1, sizeof(*d), 16);
    if (!d)
        return -ENOMEM;
    sp->done = d;
    sp->done[sp->ndone++] = (struct done){.run_id = run_id, .step = step};
    return 0;
}

void spool_lower_done(struct spool *sp, int64_t run_id, int64_t step)
{
    for (size_t i = 0; i < sp->ndone; i++)
        if (sp->done[i].run_id == run_id && sp->done[i].step > step)
            sp->done[i].step = step;
}

/* Indexes the records of segment g (open as fd) up to `end` bytes. What
 * does not read as a record is passed over (the replay reports it). */
static int index_segment(struct spool *sp, struct seg *g, int fd, uint64_t end)
{
    struct src src = {.fd = fd};
    struct walk w = {.src = &src, .end = end};
    struct found f;
    int rc;
    while ((rc = walk_next(&w, &f)) == 1)
        if (seg_note(g, f.h.r.run_id, (int64_t)f.h.r.step) < 0)
            return -ENOMEM;
    if (rc < 0)
        log_warn("spool", "%s: segment %016llx: read error at byte %llu: %s", sp->dir,
                 (unsigned long long)g->no, (unsigned long long)w.off, strerror(-rc));
    g->bytes = end;
    sp->bytes += end;
    return 0;
}

/* --- open, append, sync, rewind, release ------------------------------------------------ */

int spool_open(const char *dir, const struct spool_pos *head, const struct spool_opts *opts,
               struct spool **out, struct fs_err *err)
{
    struct spool *sp = calloc(1, sizeof(*sp));
    if (!sp) {
        fs_err_set(err, 0, "out of memory");
        return -ENOMEM;
    }
    sp->fd = -1;
    sp->dirfd = -1;
    sp->sync_full = opts->sync_full;
    sp->segment_bytes = opts->segment_bytes ? opts->segment_bytes : FS_SPOOL_SEGMENT_BYTES;
    sp->idle_end = *head;
    uint64_t *nos = NULL;
    size_t n = 0;
    int rc;
    if (snprintf(sp->dir, sizeof(sp->dir), "%s", dir) >= (int)sizeof(sp->dir)) {
        fs_err_set(err, 0, "spool directory name too long: %s", dir);
        rc = -ENAMETOOLONG;
        goto fail;
    }
    if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
        rc = -errno;
        fs_err_set(err, 0, "cannot create spool directory %s: %s", dir, strerror(errno));
        goto fail;
    }
    sp->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (sp->dirfd < 0) {
        rc = -errno;
        fs_err_set(err, 0, "cannot open spool directory %s: %s", dir, strerror(errno));
        goto fail;
    }
    struct stat dst;
    if (fstat(sp->dirfd, &dst) < 0) {
        rc = -errno;
        fs_err_set(err, 0, "cannot stat spool directory %s: %s", dir, strerror(errno));
        goto fail;
    }
    sp->dir_dev = dst.st_dev;
    sp->dir_ino = dst.st_ino;
    if ((rc = list_segments(dir, &nos, &n, err)) < 0)
        goto fail;
    sp->next_no = head->seg + 1;
    for (size_t i = 0; i < n; i++) {
        char name[SPOOL_NAME_LEN + 1];
        seg_name(nos[i], name, sizeof(name));
        if (nos[i] > head->seg) {
            /* Appended by a transaction that never committed. */
            if (unlinkat(sp->dirfd, name, 0) < 0 && errno != ENOENT) {
                rc = -errno;
                fs_err_set(err, 0, "spool %s: cannot delete uncommitted segment %s: %s", dir, name,
                           strerror(errno));
                goto fail;
            }
            continue;
        }
        int fd = openat(sp->dirfd, name, O_RDWR | O_CLOEXEC);
        struct stat stt;
        if (fd < 0 || fstat(fd, &stt) < 0) {
            rc = -errno;
            fs_err_set(err, 0, "spool %s: cannot open segment %s: %s", dir, name, strerror(errno));
            if (fd >= 0)
                close(fd);
            goto fail;
        }
        uint64_t end = (uint64_t)stt.st_size;
        if (nos[i] == head->seg) {
            if (end > head->off && ftruncate(fd, (off_t)head->off) < 0) {
                rc = -errno;
                fs_err_set(err, 0, "spool %s: cannot cut segment %s to %llu bytes: %s", dir, name,
                           (unsigned long long)head->off, strerror(errno));
                close(fd);
                goto fail;
            }
            if (end < head->off)
                log_warn("spool",
                         "%s: segment %s holds %llu bytes, the database says %llu: "
                         "the records after byte %llu are lost",
                         dir, name, (unsigned long long)end, (unsigned long long)head->off,
                         (unsigned long long)end);
            else
                end = head->off;
        }
        struct seg *g = seg_add(sp, nos[i]);
        if (g)
            g->ino = (uint64_t)stt.st_ino;
        rc = g ? index_segment(sp, g, fd, end) : -ENOMEM;
        close(fd);
        if (rc < 0) {
            fs_err_set(err, 0, "out of memory indexing spool %s", dir);
            goto fail;
        }
    }
    free(nos);
    *out = sp;
    return 0;
fail:
    free(nos);
    spool_close(sp);
    return rc;
}

void spool_close(struct spool *sp)
{
    if (!sp)
        return;
    if (sp->fd >= 0)
        close(sp->fd);
    if (sp->dirfd >= 0)
        close(sp->dirfd);
    for (size_t i = 0; i < sp->nsegs; i++)
        free(sp->segs[i].runs);
    free(sp->segs);
    free(sp->done);
    free(sp);
}

static struct seg *cur_seg(struct spool *sp)
{
    return sp->fd >= 0 ? &sp->segs[sp->nsegs - 1] : NULL;
}

/* Closes the append segment (synced first under full: spool_sync only
 * syncs the segment it finds open) and creates the next. */
static int rotate(struct spool *sp)
{
    if (sp->fd >= 0) {
        if (sp->sync_full && fdatasync(sp->fd) < 0)
            return -errno;
        close(sp->fd);
        sp->fd = -1;
    }
    char name[SPOOL_NAME_LEN + 1];
    seg_name(sp->next_no, name, sizeof(name));
    int fd = openat(sp->dirfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return -errno;
    struct stat st;
    struct seg *g = fstat(fd, &st) == 0 ? seg_add(sp, sp->next_no) : NULL;
    if (!g) {
        int e = errno == 0 ? ENOMEM : errno;
        close(fd);
        unlinkat(sp->dirfd, name, 0);
        return -e;
    }
    g->ino = (uint64_t)st.st_ino;
    sp->next_no++;
    sp->fd = fd;
    sp->dir_dirty = 1;
    return 0;
}

int spool_append(struct spool *sp, const struct spool_rec *rec, const uint8_t *body)
{
    if (rec->len == 0 || rec->len > FS_SPOOL_MAX_RECORD_BYTES)
        return -EINVAL;
    int e = spool_check(sp);
    if (e < 0)
        return e;
    uint64_t need = SPOOL_HEADER_BYTES + (uint64_t)rec->len;
    struct seg *g = cur_seg(sp);
    if (!g || (g->bytes > 0 && g->bytes + need > sp->segment_bytes)) {
        int rc = rotate(sp);
        if (rc < 0)
            return rc;
        g = cur_seg(sp);
    }
    if (seg_note(g, rec->run_id, (int64_t)rec->step) < 0)
        return -ENOMEM;
    uint8_t h[SPOOL_HEADER_BYTES];
    header_encode(rec, crc32c(body, rec->len), h);
    sp->last = (struct spool_pos){.seg = g->no, .off = g->bytes};
    struct iovec iov[2] = {{.iov_base = h, .iov_len = sizeof(h)},
                           {.iov_base = (void *)body, .iov_len = rec->len}};
    uint64_t off = g->bytes, left = need;
    int iovcnt = 2;
    struct iovec *v = iov;
    while (left) {
        /* At most FS_SPOOL_WRITE_CHUNK_BYTES per call, the hook between. */
        struct iovec piece[2];
        int npiece = 0;
        for (size_t want = FS_SPOOL_WRITE_CHUNK_BYTES; npiece < iovcnt && want > 0; npiece++) {
            piece[npiece] = v[npiece];
            if (piece[npiece].iov_len > want)
                piece[npiece].iov_len = want;
            want -= piece[npiece].iov_len;
        }
        ssize_t k = pwritev(sp->fd, piece, npiece, (off_t)off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno; /* what was written is cut by the caller's rewind */
        off += (uint64_t)k;
        left -= (uint64_t)k;
        g->bytes += (uint64_t)k;
        sp->bytes += (uint64_t)k;
        if (left && sp->yield)
            sp->yield(sp->yield_ctx);
        while (k > 0 && iovcnt > 0) { /* a short write: skip what went out */
            if ((size_t)k >= v->iov_len) {
                k -= (ssize_t)v->iov_len;
                v++;
                iovcnt--;
            } else {
                v->iov_base = (uint8_t *)v->iov_base + k;
                v->iov_len -= (size_t)k;
                k = 0;
            }
        }
    }
    return 0;
}

void spool_set_yield(struct spool *sp, void (*yield)(void *ctx), void *ctx)
{
    sp->yield = yield;
    sp->yield_ctx = ctx;
}

int spool_sync(struct spool *sp)
{
    int e = spool_check(sp);
    if (e < 0)
        return e;
    if (!sp->sync_full)
        return 0;
    if (sp->fd >= 0 && fdatasync(sp->fd) < 0)
        return -errno;
    if (sp->dir_dirty) {
        /* A new segment's name must outlive a power cut with its records. */
        if (fsync(sp->dirfd) < 0)
            return -errno;
        sp->dir_dirty = 0;
    }
    return 0;
}

struct spool_pos spool_last(const struct spool *sp)
{
    return sp->last;
}

static const char *const fault_names[SPOOL_FAULT_COUNT] = {
    [SPOOL_FAULT_NONE] = "none",
    [SPOOL_FAULT_DIR_REMOVED] = "dir_removed",
    [SPOOL_FAULT_DIR_REPLACED] = "dir_replaced",
    [SPOOL_FAULT_SEGMENT_REMOVED] = "segment_removed",
    [SPOOL_FAULT_SEGMENT_REPLACED] = "segment_replaced",
};

const char *spool_fault_name(int fault)
{
    return fault >= 0 && fault < SPOOL_FAULT_COUNT ? fault_names[fault] : "unknown";
}

int spool_fault(const struct spool *sp)
{
    return sp->fault;
}

/* A closed segment still listed (its records are not all evaluated): is
 * the file still there, and still the one indexed? */
static int closed_fault(struct spool *sp, const struct seg *g)
{
    char name[SPOOL_NAME_LEN + 1];
    seg_name(g->no, name, sizeof(name));
    struct stat st;
    if (fstatat(sp->dirfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return errno == ENOENT ? SPOOL_FAULT_SEGMENT_REMOVED : SPOOL_FAULT_NONE;
    return (uint64_t)st.st_ino != g->ino ? SPOOL_FAULT_SEGMENT_REPLACED : SPOOL_FAULT_NONE;
}

int spool_check(struct spool *sp)
{
    if (sp->fault)
        return -ESTALE;
    struct stat st;
    int f = SPOOL_FAULT_NONE;
    uint64_t no = 0;
    if (stat(sp->dir, &st) < 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            f = SPOOL_FAULT_DIR_REMOVED;
    } else if (st.st_dev != sp->dir_dev || st.st_ino != sp->dir_ino) {
        f = SPOOL_FAULT_DIR_REPLACED;
    }
    if (!f && sp->fd >= 0 && fstat(sp->fd, &st) == 0 && st.st_nlink == 0) {
        f = SPOOL_FAULT_SEGMENT_REMOVED;
        no = sp->segs[sp->nsegs - 1].no;
    }
    /* The closed segments one per call, in turn: a check is a few system
     * calls whatever the number of segments. */
    size_t closed = sp->nsegs - (sp->fd >= 0);
    if (!f && closed) {
        const struct seg *g = &sp->segs[sp->check_next++ % closed];
        f = closed_fault(sp, g);
        no = g->no;
    }
    if (!f)
        return 0;
    sp->fault = f;
    if (f == SPOOL_FAULT_SEGMENT_REMOVED || f == SPOOL_FAULT_SEGMENT_REPLACED)
        log_error("spool",
                  "%s: segment " SPOOL_SEGMENT_NAME
                  " was %s under the running daemon: acknowledged "
                  "frames in it are lost; nothing more is acknowledged until foreshockd restarts "
                  "(the restart reports what was lost)",
                  sp->dir, (unsigned long long)no,
                  f == SPOOL_FAULT_SEGMENT_REMOVED ? "deleted" : "replaced");
    else
        log_error("spool",
                  "%s: the spool directory was %s under the running daemon: acknowledged frames in "
                  "it are lost; nothing more is acknowledged until foreshockd restarts (the "
                  "restart reports what was lost)",
                  sp->dir, f == SPOOL_FAULT_DIR_REMOVED ? "removed" : "replaced");
    return -ESTALE;
}

struct spool_pos spool_head(const struct spool *sp)
{
    if (sp->fd >= 0) {
        const struct seg *g = &sp->segs[sp->nsegs - 1];
        return (struct spool_pos){.seg = g->no, .off = g->bytes};
    }
    return sp->idle_end;
}

int spool_rewind(struct spool *sp, const struct spool_pos *to)
{
    int rc = 0;
    while (sp->nsegs && sp->segs[sp->nsegs - 1].no > to->seg) {
        struct seg *g = &sp->segs[sp->nsegs - 1];
        char name[SPOOL_NAME_LEN + 1];
        seg_name(g->no, name, sizeof(name));
        if (sp->fd >= 0) {
            close(sp->fd);
            sp->fd = -1;
        }
        if (unlinkat(sp->dirfd, name, 0) < 0 && errno != ENOENT && rc == 0)
            rc = -errno;
        seg_remove(sp, sp->nsegs - 1);
    }
    /* The segment holding *to: the append segment, or one closed by a
     * rotation in the failed batch. */
    struct seg *g = sp->nsegs ? &sp->segs[sp->nsegs - 1] : NULL;
    if (g && g->no == to->seg && g->bytes > to->off) {
        int fd = sp->fd;
        if (fd < 0) {
            char name[SPOOL_NAME_LEN + 1];
            seg_name(g->no, name, sizeof(name));
            fd = openat(sp->dirfd, name, O_WRONLY | O_CLOEXEC);
        }
        if (fd < 0 || ftruncate(fd, (off_t)to->off) < 0) {
            int e = -errno;
            if (fd >= 0 && fd != sp->fd)
                close(fd);
            return e;
        }
        if (fd != sp->fd)
            close(fd);
        /* The run index keeps the cut records' steps: that only holds the
         * segment a little longer. */
        sp->bytes -= g->bytes - to->off;
        g->bytes = to->off;
    }
    if (sp->fd < 0)
        sp->idle_end = *to;
    return rc;
}

static int seg_done(const struct spool *sp, const struct seg *g)
{
    for (size_t i = 0; i < g->nruns; i++)
        if (done_of(sp, g->runs[i].run_id) < g->runs[i].max_step)
            return 0;
    return 1;
}

size_t spool_release(struct spool *sp, const struct spool_pos *commit_end)
{
    size_t deleted = 0;
    int warned = 0;
    struct spool_pos head = spool_head(sp);
    for (size_t i = 0; i < sp->nsegs;) {
        struct seg *g = &sp->segs[i];
        int appending = sp->fd >= 0 && i == sp->nsegs - 1;
        /* The append segment goes only when nothing in it awaits a commit. */
        if (!seg_done(sp, g) ||
            (appending && (head.seg != commit_end->seg || head.off != commit_end->off))) {
            i++;
            continue;
        }
        char name[SPOOL_NAME_LEN + 1];
        seg_name(g->no, name, sizeof(name));
        if (unlinkat(sp->dirfd, name, 0) < 0 && errno != ENOENT) {
            if (!warned++)
                log_warn("spool", "%s: cannot delete segment %s: %s; kept", sp->dir, name,
                         strerror(errno));
            i++;
            continue;
        }
        if (appending) {
            close(sp->fd);
            sp->fd = -1;
            sp->idle_end = head;
        }
        seg_remove(sp, i);
        deleted++;
    }
    return deleted;
}

uint64_t spool_bytes(const struct spool *sp)
{
    return sp->bytes;
}

/* --- replay ---------------------------------------------------------------------------- */

static int same_frame(const struct spool_frame *a, const struct spool_rec *r)
{
    return a->run_id == r->run_id && a->stream_id == r->stream_id && a->seq == r->seq &&
           a->step == r->step;
}

static int grow_buf(uint8_t **buf, size_t *cap, uint32_t len)
{
    if (len <= *cap)
        return 0;
    uint8_t *p = realloc(*buf, len);
    if (!p)
        return -ENOMEM;
    *buf = p;
    *cap = len;
    return 0;
}

/* One segment: its records fed (those want() takes and whose bodies
 * check), and ack[0..nack) (the acknowledged frames the database places
 * in it, by offset) each found intact, damaged or missing. */
static int replay_segment(const char *dir, uint64_t no, uint64_t end,
                          const struct spool_replay_ops *ops, const struct spool_frame *ack,
                          size_t nack, struct spool_replay_stats *st, uint8_t **buf, size_t *cap,
                          struct fs_err *err)
{
    char path[SPOOL_PATH_MAX + SPOOL_NAME_LEN + 2], name[SPOOL_NAME_LEN + 1];
    seg_name(no, name, sizeof(name));
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) {
            /* Released meanwhile (nothing in it was needed), or lost. */
            st->lost_missing += nack;
            if (nack)
                log_error("spool", "%s: segment %s is missing: %zu acknowledged frames are lost",
                          dir, name, nack);
            return 0;
        }
        int rc = -errno;
        fs_err_set(err, 0, "spool: cannot open %s: %s", path, strerror(errno));
        return rc;
    }
    struct stat stt;
    if (fstat(fd, &stt) == 0 && (uint64_t)stt.st_size < end)
        end = (uint64_t)stt.st_size;
    struct src src = {.fd = fd};
    struct walk w = {.src = &src, .end = end};
    struct found f;
    size_t a = 0;
    uint64_t bad_bodies = 0, missing0 = st->lost_missing, damaged0 = st->lost_damaged;
    int rc;
    while ((rc = walk_next(&w, &f)) == 1) {
        st->records++;
        st->v1_records += f.h.v1;
        while (a < nack && ack[a].off < f.off) { /* in a damaged stretch, or inside a record */
            st->lost_damaged++;
            a++;
        }
        int acked = a < nack && ack[a].off == f.off;
        if (acked && !same_frame(&ack[a], &f.h.r)) {
            st->lost_damaged++;
            acked = 0;
        }
        a += a < nack && ack[a].off == f.off;
        int want = ops->want(ops->ctx, &f.h.r);
        if (!want && !acked)
            continue; /* passed over unread */
        if (grow_buf(buf, cap, f.h.r.len) < 0) {
            fs_err_set(err, 0, "spool: out of memory reading a %u-byte record", f.h.r.len);
            rc = -ENOMEM;
            break;
        }
        int e = body_read(&src, &f, *buf);
        if (e == -EBADMSG) {
            bad_bodies++;
            st->lost_damaged += acked;
            continue;
        }
        if (e < 0) {
            rc = e;
            break;
        }
        if (!want)
            continue;
        st->fed++;
        st->bytes_fed += f.h.r.len;
        if ((rc = ops->feed(ops->ctx, &f.h.r, *buf)) < 0) {
            fs_err_set(err, 0, "spool: replay stopped at %s byte %llu: %s", path,
                       (unsigned long long)f.off, strerror(-rc));
            break;
        }
    }
    if (rc < 0 && rc != -ENOMEM && !err->msg[0]) {
        /* A read error: what is left of the segment is not replayed. */
        log_error("spool", "%s: read error at byte %llu: %s; the rest of the segment is skipped",
                  path, (unsigned long long)w.off, strerror(-rc));
        w.skipped += end - w.off;
        w.damaged++;
        rc = 0;
    }
    if (rc == 0) {
        for (; a < nack; a++) {
            if (ack[a].off < end)
                st->lost_damaged++;
            else
                st->lost_missing++; /* the file is shorter */
        }
    }
    close(fd);
    st->unreadable += w.damaged + bad_bodies;
    st->skipped_bytes += w.skipped;
    if (w.damaged || bad_bodies || st->lost_missing > missing0 || st->lost_damaged > damaged0)
        log_error("spool",
                  "%s: %llu damaged stretches (%llu bytes skipped), %llu records whose body "
                  "fails its CRC; acknowledged frames lost: %llu damaged, %llu missing",
                  path, (unsigned long long)w.damaged, (unsigned long long)w.skipped,
                  (unsigned long long)bad_bodies, (unsigned long long)(st->lost_damaged - damaged0),
                  (unsigned long long)(st->lost_missing - missing0));
    return rc;
}

static int frame_cmp(const struct spool_frame *a, const struct spool_frame *b)
{
    return a->seg != b->seg ? (a->seg > b->seg) - (a->seg < b->seg)
                            : (a->off > b->off) - (a->off < b->off);
}

int spool_replay(const char *dir, const struct spool_pos *head, const struct spool_replay_ops *ops,
                 struct spool_replay_stats *st, struct fs_err *err)
{
    memset(st, 0, sizeof(*st));
    const struct spool_frame *ack = ops->acked;
    size_t nack = ack ? ops->nacked : 0;
    for (size_t i = 1; i < nack; i++)
        if (frame_cmp(&ack[i - 1], &ack[i]) >= 0)
            return fs_err_set(err, -EINVAL, "spool: acknowledged frames not in log order");
    st->acked = nack;
    uint64_t *nos;
    size_t n;
    int rc = list_segments(dir, &nos, &n, err);
    if (rc == -ENOENT) { /* no spool directory (any more) */
        err->msg[0] = '\0';
        nos = NULL;
        n = 0;
        rc = 0;
    }
    if (rc < 0)
        return rc;
    uint8_t *buf = NULL;
    size_t cap = 0, a = 0;
    for (size_t i = 0; i < n && rc == 0 && nos[i] <= head->seg; i++) {
        size_t gone = 0;
        for (; a < nack && ack[a].seg < nos[i]; a++)
            gone++;
        if (gone) {
            st->lost_missing += gone;
            log_error("spool", "%s: %zu acknowledged frames lie in segments that are missing", dir,
                      gone);
        }
        size_t b = a;
        while (b < nack && ack[b].seg == nos[i])
            b++;
        rc = replay_segment(dir, nos[i], nos[i] == head->seg ? head->off : UINT64_MAX, ops, ack + a,
                            b - a, st, &buf, &cap, err);
        a = b;
    }
    if (rc == 0 && a < nack) {
        st->lost_missing += nack - a;
        log_error("spool", "%s: %zu acknowledged frames lie in segments that are missing", dir,
                  nack - a);
    }
    free(buf);
    free(nos);
    return rc;
}

int spool_forget_runs(struct spool *sp, bool (*known)(void *ctx, int64_t run_id), void *ctx)
{
    for (size_t i = 0; i < sp->nsegs; i++)
        for (size_t k = 0; k < sp->segs[i].nruns; k++) {
            int64_t id = sp->segs[i].runs[k].run_id;
            if (done_of(sp, id) < INT64_MAX && !known(ctx, id) &&
                spool_set_done(sp, id, INT64_MAX) < 0)
                return -ENOMEM;
        }
    return 0;
}
