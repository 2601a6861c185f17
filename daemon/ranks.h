#ifndef FORESHOCK_RANKS_H
#define FORESHOCK_RANKS_H

#include <stddef.h>
#include <stdint.h>

/* Rank lists (a daemon's local group, Hello.local_ranks) as sorted, distinct
 * uint32 arrays and as text ranges, "0-3,8" (the form stored in the
 * database, shown by the API and accepted by --local-ranks). Pure: no I/O,
 * no global state; any thread. */

/* Sorts v and drops duplicates in place. Returns the new count. */
size_t ranks_normalize(uint32_t *v, size_t n);

/* Formats the sorted, distinct ranks v[0..n) as ranges into a new string
 * (caller frees), "" for n == 0. NULL on out of memory. */
char *ranks_format(const uint32_t *v, size_t n);

/* Parses a range list: comma-separated R or LO-HI, any order, overlaps
 * allowed (the result is their union). Every value must be below
 * max_value and the ranges name at most max_n ranks (overlaps counted
 * twice: the bound is checked before anything is allocated). Returns 0 with *out
 * (sorted, distinct; caller frees; NULL when empty) and *n; -EINVAL
 * (bad syntax or a value out of range), -E2BIG (more than max_n ranks) or
 * -ENOMEM. "" is the empty list. */
int ranks_parse(const char *s, uint32_t max_value, size_t max_n, uint32_t **out, size_t *n);

/* Whether rank is in the sorted array v[0..n). */
int ranks_contains(const uint32_t *v, size_t n, uint32_t rank);

#endif
