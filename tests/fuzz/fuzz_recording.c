/* libFuzzer target: the recording reader `foreshock replay` and `backtest`
 * use (client/cli/recording.c) on arbitrary bytes, and what replay does
 * with each report: libforeshock packs it as fsc_submit_packed would, and
 * the Hello goes through the daemon's check (its newer fields: local_ranks,
 * capabilities, resume_step, client_name).
 *
 * Beyond crashes, leaks and sanitizer reports, one property is checked: a
 * report libforeshock takes has a placeholder (io.c: what is sent instead
 * of a report the daemon refuses) the daemon takes. A report whose
 * placeholder the daemon refuses used to be resent for ever (issue 22:
 * a NaN time, a step >= 2^63). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../client/cli/recording.h"
#include "../../client/libforeshock/report_pack.h"
#include "../../client/libforeshock/wire.h"
#include "decode.h"

#define FUZZ_MAX_REPORT_BYTES (1u << 20)

static void check_report(const Foreshock__Report *m, const struct decode_limits *lim)
{
    struct fsc_entry *e = NULL;
    if (fsc_report_pack_msg(m, FUZZ_MAX_REPORT_BYTES, &e) != 0)
        return;
    /* The seq field goes in front at send time (wire.c): 08 01 is seq 1. */
    uint8_t ph[2 + FSC_WIRE_PLACEHOLDER_MAX] = {0x08, 0x01};
    size_t n = fsc_wire_report_placeholder(e->body, e->len, ph + 2);
    free(e);
    if (n == 0)
        return; /* no step field: sent as the report itself */
    Foreshock__Report *p = foreshock__report__unpack(NULL, 2 + n, ph);
    if (!p)
        abort(); /* a placeholder that is not a Report */
    struct decode_info info;
    struct fs_err err;
    if (decode_check_report(p, lim, &info, &err) != 0) {
        fprintf(stderr, "placeholder refused by the daemon: %s\n", err.msg);
        abort();
    }
    foreshock__report__free_unpacked(p, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0; /* fmemopen wants a buffer */
    FILE *f = fmemopen((void *)data, size, "rb");
    if (!f)
        return 0;
    struct decode_limits lim;
    decode_limits_default(&lim, FUZZ_MAX_REPORT_BYTES);
    struct recording r = {.path = "fuzz", .f = f};
    Foreshock__Frame *hello = NULL, *fr = NULL;
    char err[512];
    if (recording_start(&r, &hello, err, sizeof(err)) == 0) {
        struct fs_err ferr;
        (void)decode_check_hello(hello->hello, &lim, &ferr);
        foreshock__frame__free_unpacked(hello, NULL);
        while (recording_next(&r, &fr, err, sizeof(err)) == 1) {
            check_report(fr->report, &lim);
            foreshock__frame__free_unpacked(fr, NULL);
        }
    }
    recording_free(&r);
    fclose(f);
    return 0;
}
