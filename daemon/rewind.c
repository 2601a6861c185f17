/* Rewind: rebuilding a run's detection at a step, and what becomes of its
 * alerts (rewind.h). */
#include "rewind.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "store_read.h"

struct rebuild {
    struct eval_run *er;
    struct eval_batch batch; /* the replay's own transitions: history, not kept */
    int64_t detect_from;
    uint32_t lead_rank;
    size_t fed;
};

static int feed(void *ctx, const struct store_series_key *k, uint64_t step, double value,
                bool present)
{
    struct rebuild *rb = ctx;
    int r = eval_feed_stored(rb->er, &rb->batch, k, step, value, present, rb->lead_rank,
                             rb->detect_from);
    if (r < 0)
        return r;
    rb->fed += (size_t)r;
    /* The transitions are not needed, only the states they leave; labels
     * are decided as the live stage decides them (eval_label_all). */
    eval_label_all(rb->er, &rb->batch);
    eval_batch_reset(&rb->batch);
    return 0;
}

int rewind_rebuild(const char *db_path, int64_t run_id, uint64_t step, uint32_t lead_rank,
                   int64_t detect_from_step, struct eval_run *er, struct fs_err *err)
{
    struct store_reader *rd;
    int rc = store_reader_open(db_path, &rd, err);
    if (rc < 0)
        return rc;
    struct rebuild rb = {.er = er, .detect_from = detect_from_step, .lead_rank = lead_rank};
    rc = store_reader_points_upto(rd, run_id, step > INT64_MAX ? INT64_MAX : (int64_t)step, NULL,
                                  feed, &rb, err);
    if (rc == -ENOMEM && !err->msg[0])
        fs_err_set(err, rc, "out of memory rebuilding run %lld at step %llu", (long long)run_id,
                   (unsigned long long)step);
    eval_batch_free(&rb.batch);
    store_reader_close(rd);
    return rc < 0 ? rc : 0;
}

static bool open_state(const struct alert_state *a)
{
    return a->state == ALERT_PENDING || a->state == ALERT_FIRING;
}

enum rewind_fate rewind_fate(const struct alert_state *old, const struct alert_state *rebuilt,
                             int64_t step)
{
    if (open_state(old)) {
        if (old->first_breach_step > step)
            return REWIND_SUPERSEDE;
        if (open_state(rebuilt) && rebuilt->first_breach_step == old->first_breach_step)
            return REWIND_ROW;
        return REWIND_CONTINUE;
    }
    /* The time a state was entered is only stored (a replay has none). */
    struct alert_state x = *old, y = *rebuilt;
    x.since = y.since = 0;
    uint8_t a[ALERT_STATE_ENCODED_BYTES], b[ALERT_STATE_ENCODED_BYTES];
    alert_state_encode(&x, a, sizeof(a));
    alert_state_encode(&y, b, sizeof(b));
    return memcmp(a, b, sizeof(a)) == 0 ? REWIND_KEEP : REWIND_ROW;
}

int rewind_row_state(enum rewind_fate f, const struct alert_state *old,
                     const struct alert_state *rebuilt)
{
    switch (f) {
    case REWIND_SUPERSEDE:
        return open_state(rebuilt) ? rebuilt->state : ALERT_SUPERSEDED;
    case REWIND_CONTINUE:
        return old->state;
    case REWIND_KEEP:
    case REWIND_ROW:
        break;
    }
    /* Here old is not open, or it is the rebuilt incident itself. */
    return open_state(rebuilt) ? rebuilt->state : old->state;
}
