/* The replay buffer (see replay.h): a FIFO of serialized reports with a send
 * cursor. Pure: no I/O, no locking. */
#include "replay.h"

#include <errno.h>
#include <stdlib.h>

size_t fsc_replay_cost(const struct fsc_entry *e)
{
    return sizeof(*e) + (size_t)(e->body - e->data) + e->len;
}

void fsc_replay_init(struct fsc_replay *r, size_t max_bytes)
{
    *r = (struct fsc_replay){.max_bytes = max_bytes};
}

int fsc_replay_push(struct fsc_replay *r, struct fsc_entry *e)
{
    size_t cost = fsc_replay_cost(e);

    /* bytes <= max_bytes always holds, so the subtraction cannot wrap. */
    if (cost > r->max_bytes - r->bytes)
        return -ENOBUFS;
    e->next = NULL;
    if (r->tail)
        r->tail->next = e;
    else
        r->head = e;
    r->tail = e;
    if (!r->next_send)
        r->next_send = e;
    r->count++;
    r->bytes += cost;
    return 0;
}

/* Unlinks and frees the head entry; the caller checked it may go. */
static void free_head(struct fsc_replay *r)
{
    struct fsc_entry *e = r->head;

    if (e == r->next_send)
        r->next_send = e->next;
    else
        r->in_flight--;
    if (e == r->last_taken)
        r->last_taken = NULL;
    r->head = e->next;
    if (!r->head)
        r->tail = NULL;
    r->count--;
    r->bytes -= fsc_replay_cost(e);
    r->placeholders -= e->placeholder != 0;
    free(e);
}

size_t fsc_replay_ack(struct fsc_replay *r, uint64_t seq)
{
    size_t n = 0;

    while (r->head && r->head->seq <= seq && r->head != r->sending) {
        free_head(r);
        n++;
    }
    return n;
}

struct fsc_entry *fsc_replay_find(const struct fsc_replay *r, uint64_t seq)
{
    struct fsc_entry *e;

    for (e = r->head; e && e->seq <= seq; e = e->next)
        if (e->seq == seq)
            return e;
    return NULL;
}

int fsc_replay_replace(struct fsc_replay *r, struct fsc_entry *e, struct fsc_entry *n)
{
    struct fsc_entry *prev = NULL, *p;

    if (e == r->sending)
        return -EBUSY;
    for (p = r->head; p && p != e; p = p->next)
        prev = p;
    if (!p)
        return -ENOENT;
    n->next = e->next;
    if (prev)
        prev->next = n;
    else
        r->head = n;
    if (r->tail == e)
        r->tail = n;
    if (r->next_send == e)
        r->next_send = n;
    if (r->last_taken == e)
        r->last_taken = n;
    r->bytes = r->bytes - fsc_replay_cost(e) + fsc_replay_cost(n);
    r->placeholders += (n->placeholder != 0) - (e->placeholder != 0);
    free(e);
    return 0;
}

void fsc_replay_rewind(struct fsc_replay *r)
{
    r->next_send = r->head;
    r->last_taken = NULL;
    r->sending = NULL;
    r->in_flight = 0;
}

struct fsc_entry *fsc_replay_take(struct fsc_replay *r)
{
    struct fsc_entry *e = r->next_send;

    if (!e)
        return NULL;
    r->last_taken = e;
    r->next_send = e->next;
    r->in_flight++;
    r->sending = e;
    return e;
}

void fsc_replay_sent(struct fsc_replay *r)
{
    r->sending = NULL;
}

void fsc_replay_clear(struct fsc_replay *r)
{
    struct fsc_entry *e = r->head;

    while (e) {
        struct fsc_entry *next = e->next;
        free(e);
        e = next;
    }
    fsc_replay_init(r, r->max_bytes);
}
