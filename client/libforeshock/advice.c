/* The advice box (advice.h) and the actions' names. Below the I/O thread:
 * fsc_poll_advice, which wakes it for the ack, is in io.c. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "advice.h"
#include "wire.h"

_Static_assert(
    (int)FSC_ADVICE_CHECKPOINT == (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_CHECKPOINT &&
        (int)FSC_ADVICE_CHECKPOINT_AND_STOP ==
            (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_CHECKPOINT_AND_STOP &&
        (int)FSC_ADVICE_RESOLVED == (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_RESOLVED &&
        (int)FSC_ADVICE_SUPERSEDED == (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_SUPERSEDED,
    "actions are the wire's numbers");

int fsc_advice_box_init(struct fsc_advice_box *b)
{
    memset(b, 0, sizeof(*b));
    b->pending = calloc(FSC_MAX_PENDING_ADVICE, sizeof(*b->pending));
    b->seen = calloc(FSC_ADVICE_SEEN, sizeof(*b->seen));
    b->acks = calloc(FSC_ADVICE_MAX_ACKS, sizeof(*b->acks));
    if (!b->pending || !b->seen || !b->acks) {
        fsc_advice_box_free(b);
        return -ENOMEM;
    }
    return 0;
}

void fsc_advice_box_free(struct fsc_advice_box *b)
{
    free(b->pending);
    free(b->seen);
    free(b->acks);
    memset(b, 0, sizeof(*b));
}

static int taken_before(const struct fsc_advice_box *b, uint64_t id)
{
    for (size_t i = 0; i < b->n_seen; i++)
        if (b->seen[i] == id)
            return 1;
    return 0;
}

static void queue_ack(struct fsc_advice_box *b, uint64_t id)
{
    for (size_t i = 0; i < b->n_acks; i++)
        if (b->acks[i] == id)
            return;
    /* Full: this ack waits; the daemon sends the advice again after the
     * next reconnect, and it is acknowledged then (taken_before). */
    if (b->n_acks < FSC_ADVICE_MAX_ACKS)
        b->acks[b->n_acks++] = id;
}

static void copy_text(char *dst, size_t len, const char *src)
{
    snprintf(dst, len, "%s", src ? src : "");
}

int fsc_advice_box_put(struct fsc_advice_box *b, const Foreshock__Advice *a)
{
    b->received++;
    if (taken_before(b, a->advice_id)) {
        queue_ack(b, a->advice_id);
        return 0;
    }
    for (size_t i = 0; i < b->n; i++)
        if (b->pending[(b->head + i) % FSC_MAX_PENDING_ADVICE].advice_id == a->advice_id)
            return 0;
    if (b->n == FSC_MAX_PENDING_ADVICE) {
        b->dropped++;
        return -ENOBUFS;
    }
    struct fsc_advice *p = &b->pending[(b->head + b->n) % FSC_MAX_PENDING_ADVICE];
    *p = (struct fsc_advice){
        .size = sizeof(*p),
        .advice_id = a->advice_id,
        .action = (int)a->action,
        .alert_id = a->alert_id,
        .step = a->has_step ? (int64_t)a->step : -1,
        .first_breach_step = a->has_first_breach_step ? (int64_t)a->first_breach_step : -1,
        .fired_step = a->has_fired_step ? (int64_t)a->fired_step : -1,
        .rollback_step = a->has_rollback_step ? (int64_t)a->rollback_step : -1,
        .layer = a->has_layer ? a->layer : -1,
        .head = a->has_head ? a->head : -1,
        .window = a->has_window ? a->window : 0,
        .rank = a->has_rank ? a->rank : -1,
    };
    copy_text(p->rule, sizeof(p->rule), a->rule);
    copy_text(p->label, sizeof(p->label), a->label);
    copy_text(p->severity, sizeof(p->severity), a->severity);
    b->n++;
    return 1;
}

int fsc_advice_box_take(struct fsc_advice_box *b, struct fsc_advice *out)
{
    if (!b->n)
        return 0;
    struct fsc_advice *p = &b->pending[b->head];
    size_t n = out->size && out->size < sizeof(*p) ? out->size : sizeof(*p);
    uint64_t id = p->advice_id;
    p->size = n;
    memcpy(out, p, n);
    b->head = (b->head + 1) % FSC_MAX_PENDING_ADVICE;
    b->n--;
    b->taken++;
    b->seen[b->seen_next] = id;
    b->seen_next = (b->seen_next + 1) % FSC_ADVICE_SEEN;
    if (b->n_seen < FSC_ADVICE_SEEN)
        b->n_seen++;
    queue_ack(b, id);
    return 1;
}

int fsc_advice_box_pack_acks(struct fsc_advice_box *b, uint8_t **buf, size_t *len, size_t *n)
{
    Foreshock__AdviceAck a = FORESHOCK__ADVICE_ACK__INIT;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;

    *buf = NULL;
    *len = 0;
    *n = b->n_acks < FSC_ADVICE_ACKS_PER_FRAME ? b->n_acks : FSC_ADVICE_ACKS_PER_FRAME;
    if (!*n)
        return 0;
    a.n_advice_id = *n;
    a.advice_id = b->acks;
    f.body_case = FORESHOCK__FRAME__BODY_ADVICE_ACK;
    f.advice_ack = &a;
    return fsc_wire_pack(&f, buf, len);
}

void fsc_advice_box_acks_sent(struct fsc_advice_box *b, size_t n)
{
    if (n > b->n_acks)
        n = b->n_acks;
    memmove(b->acks, b->acks + n, (b->n_acks - n) * sizeof(*b->acks));
    b->n_acks -= n;
}

const char *fsc_advice_action_name(int action)
{
    switch (action) {
    case FSC_ADVICE_CHECKPOINT:
        return "checkpoint";
    case FSC_ADVICE_CHECKPOINT_AND_STOP:
        return "checkpoint_and_stop";
    case FSC_ADVICE_RESOLVED:
        return "resolved";
    case FSC_ADVICE_SUPERSEDED:
        return "superseded";
    }
    return "unknown";
}
