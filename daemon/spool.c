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

#include "fs_grow.h"
#include "fs_limits.h"
#include "log.h"

#define SPOOL_MAGIC 0x31525346u       /* "FSR1" read as little-endian */
#define SPOOL_CHECK_BYTES 44u         /* the header bytes the check covers */
#define SPOOL_NAME_LEN 20u            /* 16 hex digits + ".seg" */
#define SPOOL_MAX_SEGMENTS (1u << 20) /* directory entries looked at, at most */

_Static_assert(SPOOL_CHECK_BYTES + 4 == SPOOL_HEADER_BYTES, "the check ends the header");
_Static_assert(FS_SPOOL_MAX_RECORD_BYTES <= UINT32_MAX, "record length is a u32");

struct seg_run {
    int64_t run_id;
    int64_t max_step; /* highest step of a record of run_id in the segment */
};

struct seg {
    uint64_t no;
    uint64_t bytes; /* file size (as far as indexed) */
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

/* FNV-1a over the header: catches a torn or zeroed header (a power cut
 * under synchronous=normal), not a malicious one (the directory is ours). */
static uint32_t check_of(const uint8_t *p)
{
    uint32_t h = 2166136261u;
    for (unsigned i = 0; i < SPOOL_CHECK_BYTES; i++)
        h = (h ^ p[i]) * 16777619u;
    return h;
}

/* magic u32 | len u32 | run i64 | stream i64 | seq u64 | step u64 | rank u32 | check u32 */
static void header_encode(const struct spool_rec *r, uint8_t *p)
{
    put32(p, SPOOL_MAGIC);
    put32(p + 4, r->len);
    put64(p + 8, (uint64_t)r->run_id);
    put64(p + 16, (uint64_t)r->stream_id);
    put64(p + 24, r->seq);
    put64(p + 32, r->step);
    put32(p + 40, r->rank);
    put32(p + 44, check_of(p));
}

static int header_decode(const uint8_t *p, struct spool_rec *r)
{
    if (get32(p) != SPOOL_MAGIC || get32(p + 44) != check_of(p))
        return -EBADMSG;
    r->len = get32(p + 4);
    r->run_id = (int64_t)get64(p + 8);
    r->stream_id = (int64_t)get64(p + 16);
    r->seq = get64(p + 24);
    r->step = get64(p + 32);
    r->rank = get32(p + 40);
    if (r->len == 0 || r->len > FS_SPOOL_MAX_RECORD_BYTES)
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

static int pread_all(int fd, void *buf, size_t len, uint64_t off)
{
    uint8_t *p = buf;
    while (len) {
        ssize_t k = pread(fd, p, len, (off_t)off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno;
        if (k == 0)
            return -ENODATA; /* cut short */
        p += k;
        len -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
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

/* Indexes the records of segment g (open as fd) up to `end` bytes. A
 * header that does not check cuts the segment there (it is what a replay
 * would read too). */
static int index_segment(struct spool *sp, struct seg *g, int fd, uint64_t end)
{
    uint64_t off = 0;
    uint8_t h[SPOOL_HEADER_BYTES];
    while (off + SPOOL_HEADER_BYTES <= end) {
        struct spool_rec r;
        if (pread_all(fd, h, sizeof(h), off) < 0 || header_decode(h, &r) < 0 ||
            off + SPOOL_HEADER_BYTES + r.len > end)
            break;
        if (seg_note(g, r.run_id, (int64_t)r.step) < 0)
            return -ENOMEM;
        off += SPOOL_HEADER_BYTES + r.len;
    }
    if (off < end)
        log_warn("spool",
                 "%s: segment %016llx: unreadable record at byte %llu; the %llu bytes "
                 "after it are not replayed",
                 sp->dir, (unsigned long long)g->no, (unsigned long long)off,
                 (unsigned long long)(end - off));
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
    struct seg *g = seg_add(sp, sp->next_no);
    if (!g) {
        close(fd);
        unlinkat(sp->dirfd, name, 0);
        return -ENOMEM;
    }
    sp->next_no++;
    sp->fd = fd;
    sp->dir_dirty = 1;
    return 0;
}

int spool_append(struct spool *sp, const struct spool_rec *rec, const uint8_t *body)
{
    if (rec->len == 0 || rec->len > FS_SPOOL_MAX_RECORD_BYTES)
        return -EINVAL;
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
    header_encode(rec, h);
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

static int replay_segment(const char *dir, uint64_t no, uint64_t end,
                          const struct spool_replay_ops *ops, struct spool_replay_stats *st,
                          uint8_t **buf, size_t *cap, struct fs_err *err)
{
    char path[SPOOL_PATH_MAX + SPOOL_NAME_LEN + 2], name[SPOOL_NAME_LEN + 1];
    seg_name(no, name, sizeof(name));
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return 0; /* released meanwhile: nothing in it was needed */
        int rc = -errno;
        fs_err_set(err, 0, "spool: cannot open %s: %s", path, strerror(errno));
        return rc;
    }
    struct stat stt;
    if (fstat(fd, &stt) == 0 && (uint64_t)stt.st_size < end)
        end = (uint64_t)stt.st_size;
    uint64_t off = 0;
    int rc = 0;
    while (off + SPOOL_HEADER_BYTES <= end) {
        uint8_t h[SPOOL_HEADER_BYTES];
        struct spool_rec r;
        if (pread_all(fd, h, sizeof(h), off) < 0 || header_decode(h, &r) < 0 ||
            off + SPOOL_HEADER_BYTES + r.len > end) {
            st->unreadable++;
            break;
        }
        st->records++;
        off += SPOOL_HEADER_BYTES;
        if (ops->want(ops->ctx, &r)) {
            if (r.len > *cap) {
                uint8_t *p = realloc(*buf, r.len);
                if (!p) {
                    fs_err_set(err, 0, "spool: out of memory reading a %u-byte record", r.len);
                    rc = -ENOMEM;
                    break;
                }
                *buf = p;
                *cap = r.len;
            }
            if (pread_all(fd, *buf, r.len, off) < 0) {
                st->unreadable++;
                break;
            }
            st->fed++;
            st->bytes_fed += r.len;
            if ((rc = ops->feed(ops->ctx, &r, *buf)) < 0) {
                fs_err_set(err, 0, "spool: replay stopped at %s byte %llu: %s", path,
                           (unsigned long long)(off - SPOOL_HEADER_BYTES), strerror(-rc));
                break;
            }
            rc = 0;
        }
        off += r.len;
    }
    close(fd);
    return rc;
}

int spool_replay(const char *dir, const struct spool_pos *head, const struct spool_replay_ops *ops,
                 struct spool_replay_stats *st, struct fs_err *err)
{
    memset(st, 0, sizeof(*st));
    uint64_t *nos;
    size_t n;
    int rc = list_segments(dir, &nos, &n, err);
    if (rc == -ENOENT)
        return 0; /* no spool yet */
    if (rc < 0)
        return rc;
    uint8_t *buf = NULL;
    size_t cap = 0;
    for (size_t i = 0; i < n && rc == 0 && nos[i] <= head->seg; i++)
        rc = replay_segment(dir, nos[i], nos[i] == head->seg ? head->off : UINT64_MAX, ops, st,
                            &buf, &cap, err);
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
