/* spool.c: the append-only log of report frames. Round trip in order
 * across segments, what a reopen cuts (records past the committed end,
 * later segments), rewinding a failed batch, which segments release
 * deletes (a table), a damaged header ending its segment, and a large
 * record written in pieces with the yield hook between them. Small
 * segments (spool_opts.segment_bytes) so that rotation happens at test
 * sizes. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fs_limits.h"
#include "spool.h"

#define T_BODY 100u                         /* body bytes of every test record */
#define T_REC (SPOOL_HEADER_BYTES + T_BODY) /* record bytes on disk */
#define T_SEG (2 * T_REC)                   /* two records per segment */
#define T_MAX_RECS 32

struct fx {
    char dir[64];
    struct spool *sp;
};

static void fx_init(struct fx *f)
{
    snprintf(f->dir, sizeof(f->dir), "/tmp/fs-spool-XXXXXX");
    cr_assert_not_null(mkdtemp(f->dir));
    f->sp = NULL;
}

static void fx_open(struct fx *f, const struct spool_pos *head)
{
    struct fs_err err = {0};
    struct spool_opts o = {.sync_full = 1, .segment_bytes = T_SEG};
    int rc = spool_open(f->dir, head, &o, &f->sp, &err);
    cr_assert_eq(rc, 0, "spool_open: %d %s", rc, err.msg);
}

static void fx_fini(struct fx *f)
{
    spool_close(f->sp);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
    cr_expect_eq(system(cmd), 0);
}

/* Record i: run 1 + i % 2, step 10 * i, seq i, body filled with byte i. */
static void append(struct fx *f, unsigned i)
{
    uint8_t body[T_BODY];
    memset(body, (int)i, sizeof(body));
    struct spool_rec r = {.run_id = 1 + i % 2,
                          .stream_id = 7,
                          .rank = i % 3,
                          .seq = i,
                          .step = 10 * i,
                          .len = T_BODY};
    cr_assert_eq(spool_append(f->sp, &r, body), 0);
}

static size_t segment_files(const char *dir)
{
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += strstr(e->d_name, ".seg") != NULL;
    closedir(d);
    return n;
}

struct got {
    unsigned seqs[T_MAX_RECS];
    size_t n;
    int64_t only_run; /* 0: every record */
};

static int want(void *ctx, const struct spool_rec *r)
{
    const struct got *g = ctx;
    return !g->only_run || r->run_id == g->only_run;
}

static int feed(void *ctx, const struct spool_rec *r, const uint8_t *body)
{
    struct got *g = ctx;
    cr_assert_lt(g->n, T_MAX_RECS);
    cr_expect_eq(r->len, T_BODY);
    cr_expect_eq(r->run_id, 1 + (int64_t)(r->seq % 2));
    cr_expect_eq(r->step, 10 * r->seq);
    cr_expect_eq(r->rank, r->seq % 3);
    cr_expect_eq(r->stream_id, 7);
    cr_expect(body[0] == (uint8_t)r->seq && body[T_BODY - 1] == (uint8_t)r->seq, "body of seq %llu",
              (unsigned long long)r->seq);
    g->seqs[g->n++] = (unsigned)r->seq;
    return 0;
}

static struct got replay(struct fx *f, const struct spool_pos *head, int64_t only_run,
                         struct spool_replay_stats *st)
{
    struct got g = {.only_run = only_run};
    struct spool_replay_ops ops = {.want = want, .feed = feed, .ctx = &g};
    struct spool_replay_stats own;
    struct fs_err err = {0};
    cr_assert_eq(spool_replay(f->dir, head, &ops, st ? st : &own, &err), 0, "%s", err.msg);
    return g;
}

static void expect_seqs(const struct got *g, const unsigned *want_seqs, size_t n)
{
    cr_assert_eq(g->n, n, "replayed %zu records, expected %zu", g->n, n);
    for (size_t i = 0; i < n; i++)
        cr_expect_eq(g->seqs[i], want_seqs[i], "record %zu", i);
}

Test(spool, records_replay_in_order_across_segments)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open(&f, &none);
    for (unsigned i = 1; i <= 5; i++)
        append(&f, i);
    cr_expect_eq(spool_sync(f.sp), 0);
    struct spool_pos head = spool_head(f.sp);
    cr_expect_eq(spool_bytes(f.sp), 5 * T_REC);
    cr_expect_eq(segment_files(f.dir), 3, "two records per segment");
    cr_expect_eq(head.off, T_REC, "the fifth record opened the third segment");
    static const unsigned all[] = {1, 2, 3, 4, 5}, odd_runs[] = {2, 4};
    struct spool_replay_stats st;
    struct got g = replay(&f, &head, 0, &st);
    expect_seqs(&g, all, 5);
    cr_expect_eq(st.records * 10 + st.fed, 55);
    /* Records not wanted are passed over unread. */
    g = replay(&f, &head, 1, &st);
    expect_seqs(&g, odd_runs, 2);
    cr_expect_eq(st.records * 10 + st.fed, 52);
    cr_expect_eq(st.unreadable, 0);
    fx_fini(&f);
}

/* A reopen trusts the database's end: what lies after it was appended by a
 * transaction that never committed. */
Test(spool, reopen_cuts_what_was_not_committed)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open(&f, &none);
    append(&f, 1);
    struct spool_pos committed = spool_head(f.sp);
    append(&f, 2); /* same segment, after the end */
    append(&f, 3); /* a later segment */
    spool_close(f.sp);
    cr_expect_eq(segment_files(f.dir), 2);
    fx_open(&f, &committed);
    cr_expect_eq(segment_files(f.dir), 1);
    cr_expect_eq(spool_bytes(f.sp), T_REC);
    static const unsigned one[] = {1};
    struct got g = replay(&f, &committed, 0, NULL);
    expect_seqs(&g, one, 1);
    /* Appends go to a new segment after it. */
    append(&f, 4);
    struct spool_pos head = spool_head(f.sp);
    cr_expect_gt(head.seg, committed.seg);
    static const unsigned later[] = {1, 4};
    g = replay(&f, &head, 0, NULL);
    expect_seqs(&g, later, 2);
    fx_fini(&f);
}

/* A failed transaction's records go, also across a segment change; the
 * retry's records follow the committed ones directly. */
Test(spool, rewind_undoes_a_failed_batch)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open(&f, &none);
    append(&f, 1);
    struct spool_pos committed = spool_head(f.sp);
    append(&f, 2);
    append(&f, 3);
    append(&f, 4);
    cr_expect_eq(segment_files(f.dir), 2);
    cr_assert_eq(spool_rewind(f.sp, &committed), 0);
    struct spool_pos head = spool_head(f.sp);
    cr_expect(head.seg == committed.seg && head.off == committed.off);
    cr_expect_eq(segment_files(f.dir), 1);
    cr_expect_eq(spool_bytes(f.sp), T_REC);
    append(&f, 5);
    head = spool_head(f.sp);
    static const unsigned kept[] = {1, 5};
    struct got g = replay(&f, &head, 0, NULL);
    expect_seqs(&g, kept, 2);
    /* Rewinding to a fresh spool's empty end. */
    cr_assert_eq(spool_rewind(f.sp, &none), 0);
    cr_expect_eq(spool_bytes(f.sp), 0);
    cr_expect_eq(segment_files(f.dir), 0);
    fx_fini(&f);
}

/* Which segments release deletes: records 1..n (run 1 + i % 2, step 10 i,
 * two per segment), runs evaluated up to done[run], the committed end at
 * the head or one record before it. */
struct release_case {
    const char *name;
    unsigned n;
    int64_t done1, done2; /* evaluated steps of runs 1 and 2 (-1: none) */
    int committed_behind; /* the last record is not committed yet */
    size_t segments_left;
    uint64_t bytes_left;
};

static const struct release_case release_cases[] = {
    {"nothing evaluated", 4, -1, -1, 0, 2, 4 * T_REC},
    {"one run evaluated, the other not", 4, 100, -1, 0, 2, 4 * T_REC},
    {"first segment evaluated", 4, 20, 10, 0, 1, 2 * T_REC},
    {"everything, the append segment too", 4, 40, 30, 0, 0, 0},
    {"everything, but the append segment awaits a commit", 4, 40, 30, 1, 1, 2 * T_REC},
    {"a later step of one run is not evaluated", 3, 20, 10, 0, 1, T_REC},
};

Test(spool, release_deletes_evaluated_segments)
{
    for (size_t c = 0; c < sizeof(release_cases) / sizeof(release_cases[0]); c++) {
        const struct release_case *rc = &release_cases[c];
        struct fx f;
        fx_init(&f);
        struct spool_pos none = {0, 0};
        fx_open(&f, &none);
        struct spool_pos committed = none;
        for (unsigned i = 1; i <= rc->n; i++) {
            if (i == rc->n && rc->committed_behind)
                committed = spool_head(f.sp);
            append(&f, i);
        }
        if (!rc->committed_behind)
            committed = spool_head(f.sp);
        if (rc->done1 >= 0)
            cr_assert_eq(spool_set_done(f.sp, 1, rc->done1), 0);
        if (rc->done2 >= 0)
            cr_assert_eq(spool_set_done(f.sp, 2, rc->done2), 0);
        spool_release(f.sp, &committed);
        cr_expect_eq(segment_files(f.dir), rc->segments_left, "%s", rc->name);
        cr_expect_eq(spool_bytes(f.sp), rc->bytes_left, "%s", rc->name);
        /* Appending goes on after a release that closed the append segment. */
        append(&f, rc->n + 2);
        struct spool_pos head = spool_head(f.sp);
        struct got g = replay(&f, &head, 0, NULL);
        cr_expect_eq(g.seqs[g.n - 1], rc->n + 2, "%s", rc->name);
        fx_fini(&f);
    }
}

/* A header that does not check (a power cut under synchronous=normal can
 * leave zeros) ends its segment: the replay stops there and says so, the
 * next segment is read, and a reopen keeps what is before it. */
Test(spool, a_damaged_header_ends_its_segment)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open(&f, &none);
    for (unsigned i = 1; i <= 4; i++)
        append(&f, i);
    struct spool_pos head = spool_head(f.sp);
    spool_close(f.sp);
    char path[128];
    snprintf(path, sizeof(path), "%s/" SPOOL_SEGMENT_NAME, f.dir, 1ull);
    int fd = open(path, O_WRONLY);
    cr_assert_geq(fd, 0, "%s", path);
    static const uint8_t zeros[8];
    cr_assert_eq(pwrite(fd, zeros, sizeof(zeros), T_REC + 8), (ssize_t)sizeof(zeros));
    close(fd);
    struct spool_replay_stats st;
    struct got g = replay(&f, &head, 0, &st);
    static const unsigned left[] = {1, 3, 4};
    expect_seqs(&g, left, 3);
    cr_expect_eq(st.unreadable, 1);
    fx_open(&f, &head);
    cr_expect_eq(spool_bytes(f.sp), 4 * T_REC, "the file is kept whole");
    cr_expect_eq(spool_set_done(f.sp, 1, 1000), 0);
    cr_expect_eq(spool_set_done(f.sp, 2, 1000), 0);
    spool_release(f.sp, &head);
    cr_expect_eq(segment_files(f.dir), 0);
    fx_fini(&f);
}

Test(spool, lengths_out_of_range_are_refused)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open(&f, &none);
    uint8_t b[1] = {0};
    struct spool_rec r = {.run_id = 1, .len = 0};
    cr_expect_eq(spool_append(f.sp, &r, b), -EINVAL);
    cr_expect_eq(spool_bytes(f.sp), 0);
    char dir[16];
    cr_expect_eq(spool_dir_of("/a/b.db", dir, sizeof(dir)), 0);
    cr_expect_str_eq(dir, "/a/b.db.spool");
    cr_expect_eq(spool_dir_of("/a/long/name.db", dir, sizeof(dir)), -ENAMETOOLONG);
    fx_fini(&f);
}

/* A large record is written in pieces of FS_SPOOL_WRITE_CHUNK_BYTES with
 * the yield hook between them (the store commits queued Hellos there): the
 * hook sees the record growing on disk, never whole, and the record reads
 * back intact. */
#define Y_BODY (3 * FS_SPOOL_WRITE_CHUNK_BYTES + 1000u) /* four pieces with its header */

struct yields {
    char path[128];
    off_t sizes[8];
    size_t n;
};

static void on_yield(void *ctx)
{
    struct yields *y = ctx;
    struct stat st;
    cr_assert_lt(y->n, 8);
    cr_assert_eq(stat(y->path, &st), 0, "%s", y->path);
    y->sizes[y->n++] = st.st_size;
}

static int feed_large(void *ctx, const struct spool_rec *r, const uint8_t *body)
{
    int *ok = ctx;
    *ok = r->len == Y_BODY && r->seq == 9 && body[0] == 0x5a && body[Y_BODY / 2] == 0x5a &&
          body[Y_BODY - 1] == 0xa5;
    return 0;
}

static int want_all(void *ctx, const struct spool_rec *r)
{
    (void)ctx;
    (void)r;
    return 1;
}

Test(spool, a_large_record_yields_between_its_pieces)
{
    struct fx f;
    fx_init(&f);
    struct fs_err err = {0};
    struct spool_pos none = {0, 0};
    struct spool_opts o = {.sync_full = 0}; /* default segment size: the record fits one */
    cr_assert_eq(spool_open(f.dir, &none, &o, &f.sp, &err), 0, "%s", err.msg);
    uint8_t *body = malloc(Y_BODY);
    cr_assert_not_null(body);
    memset(body, 0x5a, Y_BODY);
    body[Y_BODY - 1] = 0xa5;
    struct yields y = {.n = 0};
    struct spool_rec r = {.run_id = 1, .stream_id = 2, .seq = 9, .step = 9, .len = Y_BODY};
    cr_assert_eq(spool_append(f.sp, &r, body), 0, "a first record opens the segment");
    spool_set_yield(f.sp, on_yield, &y);
    snprintf(y.path, sizeof(y.path), "%s/" SPOOL_SEGMENT_NAME, f.dir, 1ull); /* the first */
    const off_t rec = SPOOL_HEADER_BYTES + Y_BODY;
    cr_assert_eq(spool_append(f.sp, &r, body), 0);
    cr_expect_eq(y.n, 3, "hook calls between the four pieces of a record: %zu", y.n);
    for (size_t i = 0; i < y.n; i++) {
        cr_expect_eq(y.sizes[i], rec + (off_t)(i + 1) * FS_SPOOL_WRITE_CHUNK_BYTES,
                     "piece %zu: %lld bytes on disk", i, (long long)y.sizes[i]);
        cr_expect_lt(y.sizes[i], 2 * rec, "the record is not whole at a yield");
    }
    spool_set_yield(f.sp, NULL, NULL);
    y.n = 0;
    cr_assert_eq(spool_append(f.sp, &r, body), 0);
    cr_expect_eq(y.n, 0, "no hook once cleared");
    struct spool_pos head = spool_head(f.sp);
    int ok = 0;
    struct spool_replay_ops ops = {.want = want_all, .feed = feed_large, .ctx = &ok};
    struct spool_replay_stats rs;
    cr_assert_eq(spool_replay(f.dir, &head, &ops, &rs, &err), 0, "%s", err.msg);
    cr_expect_eq(rs.records, 3);
    cr_expect_eq(rs.unreadable, 0);
    cr_expect(ok, "the last record reads back intact");
    free(body);
    fx_fini(&f);
}
