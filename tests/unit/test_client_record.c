/* libforeshock recordings: the file a client writes (record_path), read back
 * frame by frame with protobuf-c, in record-only mode and beside an
 * unreachable daemon; fsc_submit_packed takes a recorded report back. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"

/* A file in the test's own temporary directory (Criterion forks per test). */
static void temp_path(char *out, size_t len)
{
    snprintf(out, len, "/tmp/fsc-record-%ld.fsrec", (long)getpid());
}

/* Reads the whole file; *n frames (Hello first) decoded into frames[]. */
static size_t read_frames(const char *path, Foreshock__Frame **frames, size_t max)
{
    FILE *f = fopen(path, "rb");
    char magic[FSC_RECORD_MAGIC_LEN];
    size_t n = 0;

    cr_assert_not_null(f);
    cr_assert_eq(fread(magic, 1, sizeof(magic), f), sizeof(magic));
    cr_assert_eq(memcmp(magic, FSC_RECORD_MAGIC, sizeof(magic)), 0, "magic");
    for (;;) {
        uint8_t be[4];
        if (fread(be, 1, 4, f) != 4)
            break;
        uint32_t len = (uint32_t)be[0] << 24 | (uint32_t)be[1] << 16 | (uint32_t)be[2] << 8 | be[3];
        uint8_t *buf = malloc(len);
        cr_assert_eq(fread(buf, 1, len, f), len, "frame %zu truncated", n);
        cr_assert_lt(n, max);
        frames[n] = foreshock__frame__unpack(NULL, len, buf);
        cr_assert_not_null(frames[n], "frame %zu does not decode", n);
        free(buf);
        n++;
    }
    fclose(f);
    return n;
}

static fsc_report *report_at(uint64_t step, double loss)
{
    fsc_report *r = fsc_report_new(step);
    cr_assert_not_null(r);
    cr_assert_eq(fsc_report_set_loss(r, loss), 0);
    return r;
}

/* Record-only and "daemon unreachable" write the same file: the Hello
 * without the token, then every report with seq 1..n in submission order. */
Test(client_record, writes_hello_and_every_report)
{
    static const struct {
        int record_only;
        const char *what;
    } cases[] = {
        {1, "record only"},
        {0, "daemon unreachable"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        char path[128], err[FSC_ERROR_LEN] = "";
        struct fsc_options o;
        fsc_client *c = NULL;
        Foreshock__Frame *frames[16];

        temp_path(path, sizeof(path));
        fsc_options_init(&o);
        o.run_id = "rec-1";
        o.rank = 1;
        o.world_size = 2;
        o.token = "secret-token";
        o.port = 1; /* nothing listens there */
        o.record_path = path;
        o.record_only = cases[k].record_only;
        cr_assert_eq(fsc_open(&o, &c, err, sizeof(err)), 0, "%s: %s", cases[k].what, err);
        for (uint64_t s = 10; s < 15; s++)
            cr_assert_eq(fsc_submit(c, report_at(s, (double)s / 2)), 0);
        struct fsc_stats st = {.size = sizeof(st)};
        fsc_stats(c, &st);
        cr_expect_eq(st.recorded, 5, "%s", cases[k].what);
        cr_expect_eq(st.record_failed, 0);
        cr_expect_eq(st.submitted, 5);
        fsc_close(c);

        size_t n = read_frames(path, frames, 16);
        cr_assert_eq(n, 6, "%s: %zu frames", cases[k].what, n);
        cr_assert_eq(frames[0]->body_case, FORESHOCK__FRAME__BODY_HELLO);
        cr_expect_str_eq(frames[0]->hello->run_id, "rec-1");
        cr_expect_eq(frames[0]->hello->rank, 1);
        cr_expect_eq(frames[0]->hello->world_size, 2);
        cr_expect(!frames[0]->hello->token || frames[0]->hello->token[0] == '\0',
                  "%s: the token must not be recorded", cases[k].what);
        for (size_t i = 1; i < n; i++) {
            cr_assert_eq(frames[i]->body_case, FORESHOCK__FRAME__BODY_REPORT);
            cr_expect_eq(frames[i]->report->seq, i);
            cr_expect_eq(frames[i]->report->step, 9 + i);
            cr_expect_float_eq(frames[i]->report->scalars->loss, (double)(9 + i) / 2, 1e-12);
        }
        for (size_t i = 0; i < n; i++)
            foreshock__frame__free_unpacked(frames[i], NULL);
        unlink(path);
    }
}

/* A recorded Report goes back in through fsc_submit_packed and comes out of
 * the next recording identical but for its seq; garbage is refused. */
Test(client_record, submit_packed_round_trip)
{
    char path[128], err[FSC_ERROR_LEN] = "";
    struct fsc_options o;
    fsc_client *c = NULL;
    Foreshock__Frame *frames[4];
    Foreshock__Report r = FORESHOCK__REPORT__INIT;
    Foreshock__Scalars sc = FORESHOCK__SCALARS__INIT;
    uint8_t buf[256];
    static const uint8_t garbage[] = {0xff, 0xff, 0xff, 0x07, 0x01};

    temp_path(path, sizeof(path));
    fsc_options_init(&o);
    o.run_id = "rec-2";
    o.record_path = path;
    o.record_only = 1;
    cr_assert_eq(fsc_open(&o, &c, err, sizeof(err)), 0, "%s", err);
    r.seq = 77; /* replaced */
    r.step = 42;
    sc.has_loss = 1;
    sc.loss = 2.5;
    r.scalars = &sc;
    size_t len = foreshock__report__pack(&r, buf);
    cr_expect_eq(fsc_submit_packed(c, buf, len), 0);
    cr_expect_eq(fsc_submit_packed(c, garbage, sizeof(garbage)), -EBADMSG);
    cr_expect_eq(fsc_submit_packed(c, NULL, 3), -EINVAL);
    fsc_close(c);

    cr_assert_eq(read_frames(path, frames, 4), 2);
    cr_expect_eq(frames[1]->report->seq, 1);
    cr_expect_eq(frames[1]->report->step, 42);
    cr_expect_float_eq(frames[1]->report->scalars->loss, 2.5, 1e-12);
    foreshock__frame__free_unpacked(frames[0], NULL);
    foreshock__frame__free_unpacked(frames[1], NULL);
    unlink(path);
}

/* A write failure (a full device) stops the recording, says so and leaves
 * the client working. /dev/full fails every write with ENOSPC. */
Test(client_record, write_failure_stops_recording)
{
    char err[FSC_ERROR_LEN] = "";
    struct fsc_options o;
    fsc_client *c = NULL;

    if (access("/dev/full", W_OK) != 0)
        cr_skip_test("no /dev/full");
    fsc_options_init(&o);
    o.run_id = "rec-3";
    o.record_path = "/dev/full";
    o.record_only = 1;
    /* The magic and Hello are flushed at open: the failure shows there. */
    cr_expect_eq(fsc_open(&o, &c, err, sizeof(err)), -ENOSPC, "%s", err);
    cr_expect_null(c);
    cr_expect(strstr(err, "/dev/full"), "err names the file: %s", err);
}

/* A write failure after the start (the file may grow no more: EFBIG here,
 * ENOSPC on a full disk) stops the recording, counts it, and the client
 * keeps taking reports. */
Test(client_record, write_failure_midway_stops_recording)
{
    char path[128], err[FSC_ERROR_LEN] = "";
    struct fsc_options o;
    fsc_client *c = NULL;
    struct rlimit lim = {.rlim_cur = 64 << 10, .rlim_max = RLIM_INFINITY};
    float w[1024] = {0};

    temp_path(path, sizeof(path));
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    fsc_options_init(&o);
    o.run_id = "rec-4";
    o.record_path = path;
    o.record_only = 1;
    cr_assert_eq(fsc_open(&o, &c, err, sizeof(err)), 0, "%s", err);
    /* 4 KB of weight norms per report: 64 KiB hold about 16 of them. */
    for (uint64_t s = 1; s <= 64; s++) {
        fsc_report *r = report_at(s, 1.0);
        cr_assert_eq(fsc_report_set_layer_weight_norms(r, w, 1024), 0);
        cr_assert_eq(fsc_submit(c, r), 0, "step %llu", (unsigned long long)s);
    }
    struct fsc_stats st = {.size = sizeof(st)};
    fsc_stats(c, &st);
    cr_expect_eq(st.record_failed, 1);
    cr_expect_gt(st.recorded, 0);
    cr_expect_lt(st.recorded, 64);
    cr_expect_eq(st.submitted, 64);
    cr_expect(strstr(st.last_error, "recording stopped"), "%s", st.last_error);
    fsc_close(c);
    unlink(path);
}
