/* Unit tests for libforeshock's advice box (client/libforeshock/advice.c):
 * what the I/O thread keeps, what the trainer takes, resends, and the acks
 * it writes. */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "../../client/libforeshock/advice.h"
#include "foreshock.pb-c.h"

static Foreshock__Advice advice(uint64_t id, int action)
{
    Foreshock__Advice a = FORESHOCK__ADVICE__INIT;
    a.advice_id = id;
    a.action = (Foreshock__AdviceAction)action;
    a.alert_id = 100 + id;
    a.rule = "qk.d2.erank";
    a.label = "attention-numerics";
    a.has_step = 1;
    a.step = 320;
    a.has_rollback_step = 1;
    a.rollback_step = 300;
    a.has_window = 1;
    a.window = 10;
    return a;
}

/* The acks of the next AdviceAck frame, decoded. */
static size_t packed_acks(struct fsc_advice_box *b, uint64_t *ids, size_t max)
{
    uint8_t *buf;
    size_t len, n;
    cr_assert_eq(fsc_advice_box_pack_acks(b, &buf, &len, &n), 0);
    if (!n) {
        cr_expect_null(buf);
        return 0;
    }
    Foreshock__Frame *f = foreshock__frame__unpack(NULL, len - 4, buf + 4);
    cr_assert_not_null(f);
    cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_ADVICE_ACK);
    cr_assert_eq(f->advice_ack->n_advice_id, n);
    for (size_t i = 0; i < n && i < max; i++)
        ids[i] = f->advice_ack->advice_id[i];
    foreshock__frame__free_unpacked(f, NULL);
    free(buf);
    return n;
}

Test(client_advice, keep_take_ack)
{
    struct fsc_advice_box b;
    cr_assert_eq(fsc_advice_box_init(&b), 0);
    Foreshock__Advice a1 = advice(1, FSC_ADVICE_CHECKPOINT), a2 = advice(2, 2);
    cr_expect_eq(fsc_advice_box_put(&b, &a1), 1);
    cr_expect_eq(fsc_advice_box_put(&b, &a2), 1);
    cr_expect_eq(fsc_advice_box_put(&b, &a1), 0, "pending already");
    cr_expect_eq(b.n, 2);
    cr_expect_eq(b.received, 3);
    uint64_t ids[8];
    cr_expect_eq(packed_acks(&b, ids, 8), 0, "nothing taken, nothing acknowledged");
    struct fsc_advice out = {.size = sizeof out};
    cr_assert_eq(fsc_advice_box_take(&b, &out), 1);
    cr_expect_eq(out.advice_id, 1);
    cr_expect_eq(out.action, FSC_ADVICE_CHECKPOINT);
    cr_expect_eq(out.alert_id, 101);
    cr_expect_str_eq(out.rule, "qk.d2.erank");
    cr_expect_str_eq(out.label, "attention-numerics");
    cr_expect_str_eq(out.severity, "");
    cr_expect_eq(out.step, 320);
    cr_expect_eq(out.rollback_step, 300);
    cr_expect_eq(out.first_breach_step, -1);
    cr_expect_eq(out.fired_step, -1);
    cr_expect_eq(out.window, 10);
    cr_expect_eq(out.layer, -1);
    cr_expect_eq(out.rank, -1);
    cr_expect_eq(packed_acks(&b, ids, 8), 1);
    cr_expect_eq(ids[0], 1);
    /* Resent after its ack was written: not handed over again, acked again. */
    fsc_advice_box_acks_sent(&b, 1);
    cr_expect_eq(fsc_advice_box_put(&b, &a1), 0);
    cr_expect_eq(b.n, 1);
    cr_expect_eq(packed_acks(&b, ids, 8), 1);
    cr_expect_eq(ids[0], 1);
    /* A connection ended before the ack was written: still queued. */
    cr_assert_eq(fsc_advice_box_take(&b, &out), 1);
    cr_expect_eq(out.advice_id, 2);
    cr_expect_eq(out.action, FSC_ADVICE_CHECKPOINT_AND_STOP);
    cr_expect_eq(packed_acks(&b, ids, 8), 2);
    fsc_advice_box_acks_sent(&b, 1);
    cr_expect_eq(packed_acks(&b, ids, 8), 1);
    cr_expect_eq(ids[0], 2);
    cr_expect_eq(fsc_advice_box_take(&b, &out), 0, "nothing pending");
    cr_expect_eq(b.taken, 2);
    fsc_advice_box_free(&b);
}

Test(client_advice, bounded)
{
    struct fsc_advice_box b;
    cr_assert_eq(fsc_advice_box_init(&b), 0);
    for (uint64_t i = 1; i <= FSC_MAX_PENDING_ADVICE; i++) {
        Foreshock__Advice a = advice(i, FSC_ADVICE_CHECKPOINT);
        cr_assert_eq(fsc_advice_box_put(&b, &a), 1);
    }
    Foreshock__Advice extra = advice(FSC_MAX_PENDING_ADVICE + 1, FSC_ADVICE_CHECKPOINT);
    cr_expect_eq(fsc_advice_box_put(&b, &extra), -ENOBUFS);
    cr_expect_eq(b.dropped, 1);
    /* Taken in order; a frame holds at most FSC_ADVICE_ACKS_PER_FRAME acks. */
    struct fsc_advice out = {.size = sizeof out};
    for (uint64_t i = 1; i <= FSC_MAX_PENDING_ADVICE; i++) {
        cr_assert_eq(fsc_advice_box_take(&b, &out), 1);
        cr_assert_eq(out.advice_id, i);
    }
    uint64_t ids[1];
    cr_expect_eq(packed_acks(&b, ids, 1), FSC_MAX_PENDING_ADVICE < FSC_ADVICE_ACKS_PER_FRAME
                                              ? FSC_MAX_PENDING_ADVICE
                                              : FSC_ADVICE_ACKS_PER_FRAME);
    /* Now there is room for the one that was dropped (the daemon resends it). */
    cr_expect_eq(fsc_advice_box_put(&b, &extra), 1);
    fsc_advice_box_free(&b);
}

Test(client_advice, older_struct_size)
{
    struct fsc_advice_box b;
    cr_assert_eq(fsc_advice_box_init(&b), 0);
    Foreshock__Advice a = advice(5, FSC_ADVICE_RESOLVED);
    cr_assert_eq(fsc_advice_box_put(&b, &a), 1);
    /* A caller built with a shorter struct gets only its fields. */
    struct fsc_advice out;
    memset(&out, 0xAB, sizeof out);
    out.size = offsetof(struct fsc_advice, rule);
    cr_assert_eq(fsc_advice_box_take(&b, &out), 1);
    cr_expect_eq(out.advice_id, 5);
    cr_expect_eq(out.action, FSC_ADVICE_RESOLVED);
    cr_expect_eq(out.size, offsetof(struct fsc_advice, rule));
    cr_expect_eq((unsigned char)out.rule[0], 0xAB, "written past the caller's size");
    fsc_advice_box_free(&b);
}

Test(client_advice, poll_without_advice)
{
    cr_expect_str_eq(fsc_advice_action_name(FSC_ADVICE_CHECKPOINT_AND_STOP), "checkpoint_and_stop");
    cr_expect_str_eq(fsc_advice_action_name(0), "unknown");
    struct fsc_advice out = {.size = sizeof out};
    cr_expect_eq(fsc_poll_advice(NULL, &out), -EINVAL);
}
