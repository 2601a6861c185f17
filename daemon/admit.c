/* Admission of ingest connections: the policy and the per-address table
 * (admit.h says why). */
#include "admit.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

enum admit_verdict admit_decide(const struct admit_limits *l, const struct admit_counts *n)
{
    if (n->address >= l->max_unauthenticated_per_address)
        return ADMIT_REFUSE_ADDRESS;
    if (n->connections < l->max_connections && n->unauthenticated < l->max_unauthenticated)
        return ADMIT_ACCEPT;
    if (n->unauthenticated == 0)
        return ADMIT_REFUSE_FULL;
    /* Someone holds more strangers' slots than the newcomer's address: the
     * oldest of them goes. Equal shares refuse, so two floods do not evict
     * each other's connections in turn. */
    if (n->heaviest > n->address)
        return ADMIT_EVICT;
    return ADMIT_REFUSE_UNAUTHENTICATED;
}

const char *admit_reason(enum admit_verdict v)
{
    switch (v) {
    case ADMIT_REFUSE_FULL:
        return "max_connections";
    case ADMIT_REFUSE_ADDRESS:
        return "per_address";
    case ADMIT_REFUSE_UNAUTHENTICATED:
        return "unauthenticated";
    case ADMIT_ACCEPT:
    case ADMIT_EVICT:
        break;
    }
    return "";
}

int admit_addr_from(const struct sockaddr *sa, struct admit_addr *out)
{
    memset(out, 0, sizeof(*out));
    if (sa->sa_family == AF_INET6) {
        memcpy(out->b, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
        return 0;
    }
    if (sa->sa_family == AF_INET) {
        out->b[10] = out->b[11] = 0xff;
        memcpy(out->b + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
        return 0;
    }
    return -EAFNOSUPPORT;
}

/* FNV-1a over the 16 bytes: addresses are not secret, and a client cannot
 * pick many of them (each is a source address it must own). */
static size_t addr_hash(const struct admit_addr *a)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < sizeof(a->b); i++)
        h = (h ^ a->b[i]) * 1099511628211ull;
    return (size_t)(h ^ (h >> 32));
}

int admit_table_init(struct admit_table *t, size_t max_entries)
{
    size_t cap = 8;
    while (cap < 2 * max_entries)
        cap *= 2;
    memset(t, 0, sizeof(*t));
    t->slots = calloc(cap, sizeof(*t->slots));
    if (!t->slots)
        return -ENOMEM;
    t->mask = cap - 1;
    t->max_entries = max_entries;
    return 0;
}

void admit_table_free(struct admit_table *t)
{
    free(t->slots);
    memset(t, 0, sizeof(*t));
}

/* The slot holding a, or the empty slot where it would go. The table is
 * never full (max_entries is at most half the capacity). */
static size_t find(const struct admit_table *t, const struct admit_addr *a)
{
    size_t i = addr_hash(a) & t->mask;
    while (t->slots[i].count && memcmp(&t->slots[i].addr, a, sizeof(*a)) != 0)
        i = (i + 1) & t->mask;
    return i;
}

uint64_t admit_table_count(const struct admit_table *t, const struct admit_addr *a)
{
    return t->slots ? t->slots[find(t, a)].count : 0;
}

int admit_table_add(struct admit_table *t, const struct admit_addr *a)
{
    size_t i = find(t, a);
    if (!t->slots[i].count) {
        if (t->entries >= t->max_entries)
            return -ENOSPC;
        t->slots[i].addr = *a;
        t->entries++;
    }
    t->slots[i].count++;
    return 0;
}

void admit_table_remove(struct admit_table *t, const struct admit_addr *a)
{
    size_t i = find(t, a);
    if (!t->slots[i].count || --t->slots[i].count)
        return;
    t->entries--;
    /* Backward-shift deletion: entries after the hole that probed past it
     * move into it, so that every lookup still finds them. */
    size_t hole = i;
    for (size_t j = (i + 1) & t->mask; t->slots[j].count; j = (j + 1) & t->mask) {
        size_t home = addr_hash(&t->slots[j].addr) & t->mask;
        /* j moves unless its home lies cyclically in (hole, j]. */
        if (((j - home) & t->mask) >= ((j - hole) & t->mask)) {
            t->slots[hole] = t->slots[j];
            t->slots[j].count = 0;
            hole = j;
        }
    }
}

uint64_t admit_table_heaviest(const struct admit_table *t)
{
    uint64_t most = 0;
    if (!t->slots)
        return 0;
    for (size_t i = 0; i <= t->mask; i++)
        if (t->slots[i].count > most)
            most = t->slots[i].count;
    return most;
}
