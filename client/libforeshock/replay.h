#ifndef FSC_REPLAY_H
#define FSC_REPLAY_H

/* The replay buffer: serialized reports in seq order, kept until the daemon
 * acknowledges them, so that a reconnect can resend what was not committed.
 * Pure data structure, no locking: the client serializes access with its
 * mutex. Entries are immutable once pushed; only fsc_replay_* functions free
 * them. */

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

struct fsc_entry {
    struct fsc_entry *next;
    uint64_t seq;        /* client seq (1, 2, ...) */
    int placeholder;     /* stands for a report the daemon refused (fsc_replay_replace) */
    size_t len;          /* bytes at body */
    const uint8_t *body; /* Report message bytes without its seq field (see wire.h) */
    uint8_t data[];      /* storage that body points into */
};

struct fsc_replay {
    struct fsc_entry *head, *tail;
    struct fsc_entry *next_send;  /* first entry not yet sent on this connection */
    struct fsc_entry *last_taken; /* entry just before next_send, NULL when next_send == head */
    struct fsc_entry *sending;    /* taken, write in progress: must not be freed */
    size_t count, bytes, max_bytes;
    size_t in_flight;    /* entries before next_send: sent, not yet acked */
    size_t placeholders; /* entries with placeholder set */
};

/* Memory an entry is charged against max_bytes. */
FSC_HIDDEN size_t fsc_replay_cost(const struct fsc_entry *e);

FSC_HIDDEN void fsc_replay_init(struct fsc_replay *r, size_t max_bytes);

/* Appends e (takes ownership on success). Returns 0, or -ENOBUFS when it
 * would exceed max_bytes (caller keeps e). */
FSC_HIDDEN int fsc_replay_push(struct fsc_replay *r, struct fsc_entry *e);

/* Frees entries from the head while their seq <= seq, stopping at the one
 * being written. Returns how many were freed. */
FSC_HIDDEN size_t fsc_replay_ack(struct fsc_replay *r, uint64_t seq);

/* The entry with this seq, or NULL. */
FSC_HIDDEN struct fsc_entry *fsc_replay_find(const struct fsc_replay *r, uint64_t seq);

/* Puts n (same seq; ownership taken on success) where e is, keeping the
 * send cursor and in-flight count as they were, and frees e: a refused
 * report becomes its placeholder. Charged n's cost instead of e's, even
 * past max_bytes (n is never the larger in use). Returns 0, -ENOENT (e not
 * in r) or -EBUSY (e is being written; caller keeps n). */
FSC_HIDDEN int fsc_replay_replace(struct fsc_replay *r, struct fsc_entry *e, struct fsc_entry *n);

/* A new connection: everything unacknowledged is to be sent again. */
FSC_HIDDEN void fsc_replay_rewind(struct fsc_replay *r);

/* The next entry to send, or NULL. Marks it taken and being written. */
FSC_HIDDEN struct fsc_entry *fsc_replay_take(struct fsc_replay *r);

/* The write of the taken entry finished (or was abandoned). */
FSC_HIDDEN void fsc_replay_sent(struct fsc_replay *r);

/* Frees every entry. */
FSC_HIDDEN void fsc_replay_clear(struct fsc_replay *r);

#endif
