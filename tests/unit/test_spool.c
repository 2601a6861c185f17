/* spool.c: the append-only log of report frames. Round trip in order
 * across segments, what a reopen cuts (records past the committed end,
 * later segments), rewinding a failed batch, which segments release
 * deletes (a table), damage (a header that does not check is passed over
 * to the next record, a body that fails its CRC is not replayed, v1
 * records of an older foreshockd are read), the acknowledged frames the
 * replay checks (a table: intact, missing, damaged), spool_check noticing
 * the log deleted or replaced under its owner, the in-memory reader, and a
 * large record written in pieces with the yield hook between them. Small
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

#include "crc32c.h"
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
 * leave zeros) is passed over: the replay goes on at the next record, in
 * the same segment, and says how much it skipped; a reopen keeps the file
 * whole. Four records in one segment, the second's header zeroed. */
static void fx_open_big(struct fx *f, const struct spool_pos *head)
{
    struct fs_err err = {0};
    struct spool_opts o = {.sync_full = 1, .segment_bytes = 16 * T_REC};
    cr_assert_eq(spool_open(f->dir, head, &o, &f->sp, &err), 0, "%s", err.msg);
}

static void patch(const struct fx *f, uint64_t seg, uint64_t off, const void *b, size_t n)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/" SPOOL_SEGMENT_NAME, f->dir, (unsigned long long)seg);
    int fd = open(path, O_WRONLY);
    cr_assert_geq(fd, 0, "%s", path);
    cr_assert_eq(pwrite(fd, b, n, (off_t)off), (ssize_t)n);
    close(fd);
}

Test(spool, a_damaged_header_is_passed_over_to_the_next_record)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open_big(&f, &none);
    for (unsigned i = 1; i <= 4; i++)
        append(&f, i);
    struct spool_pos head = spool_head(f.sp);
    spool_close(f.sp);
    static const uint8_t zeros[8];
    patch(&f, 1, T_REC + 8, zeros, sizeof(zeros));
    struct spool_replay_stats st;
    struct got g = replay(&f, &head, 0, &st);
    static const unsigned left[] = {1, 3, 4};
    expect_seqs(&g, left, 3);
    cr_expect_eq(st.unreadable, 1);
    cr_expect_eq(st.skipped_bytes, T_REC, "the damaged record's bytes, no more");
    fx_open_big(&f, &head);
    cr_expect_eq(spool_bytes(f.sp), 4 * T_REC, "the file is kept whole");
    cr_expect_eq(spool_set_done(f.sp, 1, 1000), 0);
    cr_expect_eq(spool_set_done(f.sp, 2, 1000), 0);
    spool_release(f.sp, &head);
    cr_expect_eq(segment_files(f.dir), 0);
    fx_fini(&f);
}

/* One flipped bit in a body: that record is not replayed (its header still
 * checks, so the next one is found where it should be). */
Test(spool, a_body_that_fails_its_crc_is_not_replayed)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open_big(&f, &none);
    for (unsigned i = 1; i <= 3; i++)
        append(&f, i);
    struct spool_pos head = spool_head(f.sp);
    spool_close(f.sp);
    f.sp = NULL;
    uint8_t flipped = 2 ^ 0x10; /* record 2's body is all 2s */
    patch(&f, 1, T_REC + SPOOL_HEADER_BYTES + T_BODY / 2, &flipped, 1);
    struct spool_replay_stats st;
    struct got g = replay(&f, &head, 0, &st);
    static const unsigned left[] = {1, 3};
    expect_seqs(&g, left, 2);
    cr_expect_eq(st.records, 3);
    cr_expect_eq(st.unreadable, 1);
    cr_expect_eq(st.skipped_bytes, 0);
    fx_fini(&f);
}

/* A v1 record as foreshockd wrote them before CRCs: 48-byte header,
 * FNV-1a of its first 44 bytes, no body check. */
static size_t v1_record(uint8_t *out, unsigned i)
{
    uint64_t v[6] = {T_BODY, 1 + i % 2, 7, i, 10 * i, i % 3};
    size_t o = 0;
    for (int b = 0; b < 4; b++)
        out[o++] = (uint8_t)(0x31525346u >> (8 * b));
    for (int b = 0; b < 4; b++)
        out[o++] = (uint8_t)(v[0] >> (8 * b));
    for (int k = 1; k <= 4; k++)
        for (int b = 0; b < 8; b++)
            out[o++] = (uint8_t)(v[k] >> (8 * b));
    for (int b = 0; b < 4; b++)
        out[o++] = (uint8_t)(v[5] >> (8 * b));
    uint32_t h = 2166136261u;
    for (size_t k = 0; k < 44; k++)
        h = (h ^ out[k]) * 16777619u;
    for (int b = 0; b < 4; b++)
        out[o++] = (uint8_t)(h >> (8 * b));
    memset(out + o, (int)i, T_BODY);
    return o + T_BODY;
}

/* An upgrade: a segment an older foreshockd wrote (v1 records) is indexed
 * and replayed, and the records appended after the upgrade (v2, in a new
 * segment) follow them. */
Test(spool, v1_records_of_an_older_spool_are_replayed)
{
    struct fx f;
    fx_init(&f);
    uint8_t seg[2 * (SPOOL_V1_HEADER_BYTES + T_BODY)];
    size_t n = v1_record(seg, 1);
    n += v1_record(seg + n, 2);
    char path[128];
    snprintf(path, sizeof(path), "%s/" SPOOL_SEGMENT_NAME, f.dir, 1ull);
    FILE *fp = fopen(path, "wb");
    cr_assert_not_null(fp);
    cr_assert_eq(fwrite(seg, 1, n, fp), n);
    fclose(fp);
    struct spool_pos head = {1, n};
    fx_open_big(&f, &head);
    cr_expect_eq(spool_bytes(f.sp), n);
    append(&f, 3);
    head = spool_head(f.sp);
    cr_expect_eq(head.seg, 2, "appends go to a new segment");
    struct spool_replay_stats st;
    struct got g = replay(&f, &head, 0, &st);
    static const unsigned all[] = {1, 2, 3};
    expect_seqs(&g, all, 3);
    cr_expect_eq(st.v1_records, 2);
    cr_expect_eq(st.unreadable, 0);
    /* Released like any other once evaluated. */
    cr_expect_eq(spool_set_done(f.sp, 1, 1000), 0);
    cr_expect_eq(spool_set_done(f.sp, 2, 1000), 0);
    spool_release(f.sp, &head);
    cr_expect_eq(segment_files(f.dir), 0);
    fx_fini(&f);
}

/* The acknowledged frames the replay is given: records 1..4 in segments 1
 * and 2 (two per segment, T_SEG), each acked; one damage per case. */
enum damage { D_NONE, D_SEG_GONE, D_DIR_GONE, D_TRUNCATED, D_BODY, D_HEADER, D_WRONG_ROW };

struct ack_case {
    const char *name;
    enum damage d;
    uint64_t missing, damaged;
    size_t fed;
};

static const struct ack_case ack_cases[] = {
    {"intact", D_NONE, 0, 0, 4},
    {"first segment deleted", D_SEG_GONE, 2, 0, 2},
    {"directory deleted", D_DIR_GONE, 4, 0, 0},
    {"last segment cut after its first record", D_TRUNCATED, 1, 0, 3},
    {"a body byte flipped", D_BODY, 0, 1, 3},
    {"a header byte flipped", D_HEADER, 0, 1, 3},
    {"the row names another frame", D_WRONG_ROW, 0, 1, 4},
};

Test(spool, acknowledged_frames_are_found_intact_damaged_or_missing)
{
    for (size_t c = 0; c < sizeof(ack_cases) / sizeof(ack_cases[0]); c++) {
        const struct ack_case *k = &ack_cases[c];
        struct fx f;
        fx_init(&f);
        struct spool_pos none = {0, 0};
        fx_open(&f, &none);
        struct spool_frame acked[4];
        for (unsigned i = 1; i <= 4; i++) {
            append(&f, i);
            struct spool_pos at = spool_last(f.sp);
            acked[i - 1] = (struct spool_frame){.seg = at.seg,
                                                .off = at.off,
                                                .run_id = 1 + i % 2,
                                                .stream_id = 7,
                                                .seq = i,
                                                .step = 10 * i};
        }
        struct spool_pos head = spool_head(f.sp);
        spool_close(f.sp);
        f.sp = NULL;
        char path[160];
        uint8_t x = 0xee;
        switch (k->d) {
        case D_NONE:
            break;
        case D_SEG_GONE:
            snprintf(path, sizeof(path), "%s/" SPOOL_SEGMENT_NAME, f.dir, 1ull);
            cr_assert_eq(unlink(path), 0);
            break;
        case D_DIR_GONE:
            snprintf(path, sizeof(path), "rm -rf %s", f.dir);
            cr_assert_eq(system(path), 0);
            break;
        case D_TRUNCATED:
            snprintf(path, sizeof(path), "%s/" SPOOL_SEGMENT_NAME, f.dir, 2ull);
            cr_assert_eq(truncate(path, T_REC), 0);
            break;
        case D_BODY:
            patch(&f, 1, SPOOL_HEADER_BYTES + 3, &x, 1);
            break;
        case D_HEADER:
            patch(&f, 2, T_REC + 30, &x, 1);
            break;
        case D_WRONG_ROW:
            acked[2].seq = 99;
            break;
        }
        struct got g = {.only_run = 0};
        struct spool_replay_ops ops = {
            .want = want, .feed = feed, .ctx = &g, .acked = acked, .nacked = 4};
        struct spool_replay_stats st;
        struct fs_err err = {0};
        cr_assert_eq(spool_replay(f.dir, &head, &ops, &st, &err), 0, "%s: %s", k->name, err.msg);
        cr_expect_eq(st.acked, 4, "%s", k->name);
        cr_expect_eq(st.lost_missing, k->missing, "%s: missing %llu", k->name,
                     (unsigned long long)st.lost_missing);
        cr_expect_eq(st.lost_damaged, k->damaged, "%s: damaged %llu", k->name,
                     (unsigned long long)st.lost_damaged);
        cr_expect_eq(g.n, k->fed, "%s: fed %zu", k->name, g.n);
        fx_fini(&f);
    }
}

/* The log deleted or replaced under its owner: the first check that sees
 * it faults, appends and syncs fail from then on, and it stays. */
enum under { U_APPEND_SEG, U_CLOSED_SEG, U_DIR, U_DIR_REPLACED };

struct fault_case {
    const char *name;
    enum under what;
    int fault;
};

static const struct fault_case fault_cases[] = {
    {"the append segment deleted", U_APPEND_SEG, SPOOL_FAULT_SEGMENT_REMOVED},
    {"a closed segment deleted", U_CLOSED_SEG, SPOOL_FAULT_SEGMENT_REMOVED},
    {"the directory deleted", U_DIR, SPOOL_FAULT_DIR_REMOVED},
    {"the directory replaced", U_DIR_REPLACED, SPOOL_FAULT_DIR_REPLACED},
};

Test(spool, a_log_deleted_under_its_owner_stops_appends)
{
    for (size_t c = 0; c < sizeof(fault_cases) / sizeof(fault_cases[0]); c++) {
        const struct fault_case *k = &fault_cases[c];
        struct fx f;
        fx_init(&f);
        struct spool_pos none = {0, 0};
        fx_open(&f, &none);
        for (unsigned i = 1; i <= 3; i++) /* segments 1 (closed) and 2 (appending) */
            append(&f, i);
        cr_expect_eq(spool_check(f.sp), 0, "%s: nothing wrong yet", k->name);
        char cmd[200];
        switch (k->what) {
        case U_APPEND_SEG:
        case U_CLOSED_SEG:
            snprintf(cmd, sizeof(cmd), "%s/" SPOOL_SEGMENT_NAME, f.dir,
                     k->what == U_APPEND_SEG ? 2ull : 1ull);
            cr_assert_eq(unlink(cmd), 0);
            break;
        case U_DIR:
            snprintf(cmd, sizeof(cmd), "rm -rf %s", f.dir);
            cr_assert_eq(system(cmd), 0);
            break;
        case U_DIR_REPLACED:
            snprintf(cmd, sizeof(cmd), "rm -rf %s && mkdir %s", f.dir, f.dir);
            cr_assert_eq(system(cmd), 0);
            break;
        }
        int rc = 0;
        for (int i = 0; i < 4 && rc == 0; i++) /* one closed segment per check */
            rc = spool_check(f.sp);
        cr_expect_eq(rc, -ESTALE, "%s", k->name);
        cr_expect_eq(spool_fault(f.sp), k->fault, "%s: %s", k->name,
                     spool_fault_name(spool_fault(f.sp)));
        uint8_t body[T_BODY] = {0};
        struct spool_rec r = {.run_id = 1, .stream_id = 7, .seq = 9, .step = 90, .len = T_BODY};
        cr_expect_eq(spool_append(f.sp, &r, body), -ESTALE, "%s: appends stop", k->name);
        cr_expect_eq(spool_sync(f.sp), -ESTALE, "%s: syncs stop", k->name);
        fx_fini(&f);
    }
}

/* The in-memory reader: every byte is in a record or a stretch passed
 * over, whatever the garbage between records. */
static int count_intact(void *ctx, uint64_t off, const struct spool_rec *r, int intact)
{
    (void)off;
    (void)r;
    *(unsigned *)ctx += (unsigned)intact;
    return 0;
}

Test(spool, the_reader_accounts_for_every_byte)
{
    struct fx f;
    fx_init(&f);
    struct spool_pos none = {0, 0};
    fx_open_big(&f, &none);
    for (unsigned i = 1; i <= 3; i++)
        append(&f, i);
    spool_close(f.sp);
    f.sp = NULL;
    char path[128];
    snprintf(path, sizeof(path), "%s/" SPOOL_SEGMENT_NAME, f.dir, 1ull);
    uint8_t seg[3 * T_REC], buf[3 * T_REC + 200];
    FILE *fp = fopen(path, "rb");
    cr_assert_not_null(fp);
    cr_assert_eq(fread(seg, 1, sizeof(seg), fp), sizeof(seg));
    fclose(fp);
    /* garbage (77 bytes, an "FSR2" among them) | record 1 | 123 bytes | records 2, 3 */
    memset(buf, 0x46, 77);
    memcpy(buf + 10, "FSR2", 4);
    memcpy(buf + 77, seg, T_REC);
    memset(buf + 77 + T_REC, 0, 123);
    memcpy(buf + 200 + T_REC, seg + T_REC, 2 * T_REC);
    buf[200 + 2 * T_REC + 70] ^= 1; /* record 3's body */
    struct spool_scan_stats st;
    unsigned intact = 0;
    cr_assert_eq(spool_scan(buf, sizeof(buf), count_intact, &intact, &st), 0);
    cr_expect_eq(st.records, 3);
    cr_expect_eq(intact, 2);
    cr_expect_eq(st.bad_bodies, 1);
    cr_expect_eq(st.damaged, 2);
    cr_expect_eq(st.skipped_bytes, 200);
    cr_expect_eq(st.record_bytes + st.skipped_bytes, sizeof(buf));
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
