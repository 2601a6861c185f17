#ifndef FSC_ADVICE_H
#define FSC_ADVICE_H

/* The client's advice box: advices the I/O thread received and the trainer
 * has not taken yet, the ids it took (so a resent advice is not handed over
 * twice), and the acknowledgements waiting to be written. Every function
 * here is called with the client's mu held (client.h); the box belongs to
 * the client. Pure data: no I/O. */

#include <stddef.h>
#include <stdint.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"
#include "internal.h"

/* Ids of taken advices remembered (oldest forgotten first): an advice sent
 * again after its ack was lost is acknowledged again, not handed over. */
#define FSC_ADVICE_SEEN 4096
/* Acknowledgements waiting to be written, at most (a frame holds 1024). */
#define FSC_ADVICE_MAX_ACKS 4096
#define FSC_ADVICE_ACKS_PER_FRAME 1024

struct fsc_advice_box {
    struct fsc_advice *pending; /* FIFO, FSC_MAX_PENDING_ADVICE slots */
    size_t head, n;
    uint64_t *seen; /* ring of FSC_ADVICE_SEEN taken ids */
    size_t seen_next, n_seen;
    uint64_t *acks; /* FIFO of ids to acknowledge */
    size_t n_acks;
    uint64_t received, taken, dropped;
};

FSC_HIDDEN int fsc_advice_box_init(struct fsc_advice_box *b); /* 0 or -ENOMEM */
FSC_HIDDEN void fsc_advice_box_free(struct fsc_advice_box *b);

/* An Advice frame arrived. Returns 1 when it is new and pending, 0 when it
 * was pending or taken already (taken: its ack is queued again), -ENOBUFS
 * when FSC_MAX_PENDING_ADVICE are pending (counted as dropped: the daemon
 * sends it again after a reconnect). I/O thread. */
FSC_HIDDEN int fsc_advice_box_put(struct fsc_advice_box *b, const Foreshock__Advice *a);

/* Moves the oldest pending advice into *out (out->size bytes) and queues
 * its ack. 1, or 0 when none is pending. Caller threads. */
FSC_HIDDEN int fsc_advice_box_take(struct fsc_advice_box *b, struct fsc_advice *out);

/* Packs up to FSC_ADVICE_ACKS_PER_FRAME queued acks into a length-prefixed
 * AdviceAck frame (*buf malloc'd, caller frees) and says how many in *n.
 * 0, or -ENOMEM. Nothing queued: 0 with *n = 0 and *buf NULL. I/O thread. */
FSC_HIDDEN int fsc_advice_box_pack_acks(struct fsc_advice_box *b, uint8_t **buf, size_t *len,
                                        size_t *n);

/* The first n queued acks were written: forgets them. I/O thread. */
FSC_HIDDEN void fsc_advice_box_acks_sent(struct fsc_advice_box *b, size_t n);

#endif
