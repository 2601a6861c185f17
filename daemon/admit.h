#ifndef FORESHOCK_ADMIT_H
#define FORESHOCK_ADMIT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* Admission of ingest connections: which new connection gets a slot, and
 * which connection that has not proved who it is gives its slot up. Pure
 * (no I/O, no clock): ingest.c counts, this decides.
 *
 * A connection is unauthenticated from its accept until its Hello's token
 * was accepted: the TLS handshake and the wait for the Hello. Strangers can
 * open such connections as fast as the daemon closes them (an outside probe
 * held every slot of max_connections with ~1,080 sockets from one address,
 * and trainers got "connection limit reached"), so:
 *   - at most max_unauthenticated of them at once, all addresses together;
 *     the rest of max_connections is room only authenticated streams take;
 *   - at most max_unauthenticated_per_address of them from one address;
 *   - when the budget (or max_connections) is full, a newcomer whose address
 *     holds fewer unauthenticated connections than the address holding the
 *     most takes the slot of that address's oldest one (evicted); one from
 *     the heaviest address itself is refused. A flood from one address thus
 *     never pushes out a trainer from another, and a trainer gets in while
 *     the flood goes on.
 * Authenticated streams are never evicted: when every slot is theirs, a
 * newcomer is refused (max_connections). */

struct admit_limits {
    uint64_t max_connections;                 /* every connection counted */
    uint64_t max_unauthenticated;             /* in TLS handshake or before an accepted Hello */
    uint64_t max_unauthenticated_per_address; /* of those, from one source address */
};

/* What ingest counts when a connection arrives (the newcomer excluded). */
struct admit_counts {
    uint64_t connections;     /* counted connections, authenticated or not */
    uint64_t unauthenticated; /* of those, not yet authenticated */
    uint64_t address;         /* unauthenticated ones from the newcomer's address */
    uint64_t heaviest;        /* the most unauthenticated ones any one address holds */
};

enum admit_verdict {
    ADMIT_ACCEPT,
    ADMIT_EVICT,                  /* close the oldest unauthenticated connection of the heaviest
                                   * address, then accept the newcomer */
    ADMIT_REFUSE_FULL,            /* max_connections, every slot authenticated */
    ADMIT_REFUSE_ADDRESS,         /* its address holds max_unauthenticated_per_address */
    ADMIT_REFUSE_UNAUTHENTICATED, /* budget full; its address holds the most */
};

enum admit_verdict admit_decide(const struct admit_limits *l, const struct admit_counts *n);

/* The verdict as a metric label and log word ("max_connections",
 * "per_address", "unauthenticated"; "" for accept and evict). */
const char *admit_reason(enum admit_verdict v);

/* A source address: IPv6, or IPv4 as its IPv4-mapped IPv6 form, so that a
 * dual-stack listener counts one client once. */
struct admit_addr {
    uint8_t b[16];
};

/* 0, or -EAFNOSUPPORT for a family other than AF_INET and AF_INET6. */
int admit_addr_from(const struct sockaddr *sa, struct admit_addr *out);

/* Unauthenticated connections per address: open addressing, linear probing,
 * fixed capacity (at least twice the most distinct addresses it will hold:
 * max_unauthenticated), so it never grows while a flood goes on. */
struct admit_slot {
    struct admit_addr addr;
    uint64_t count; /* 0: empty */
};

struct admit_table {
    struct admit_slot *slots;
    size_t mask;    /* capacity - 1, capacity a power of two */
    size_t entries; /* slots in use */
    size_t max_entries;
};

/* Room for max_entries distinct addresses. 0 or -ENOMEM. */
int admit_table_init(struct admit_table *t, size_t max_entries);
void admit_table_free(struct admit_table *t);
uint64_t admit_table_count(const struct admit_table *t, const struct admit_addr *a);
/* One more for a. 0, or -ENOSPC when a is new and max_entries are in use. */
int admit_table_add(struct admit_table *t, const struct admit_addr *a);
/* One fewer for a (gone at 0); an address not in the table is ignored. */
void admit_table_remove(struct admit_table *t, const struct admit_addr *a);
/* The most any one address holds (0 when empty). Scans the table. */
uint64_t admit_table_heaviest(const struct admit_table *t);

#endif
