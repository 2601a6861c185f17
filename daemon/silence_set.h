#ifndef FORESHOCK_SILENCE_SET_H
#define FORESHOCK_SILENCE_SET_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "silence.h"

/* Silence sets: the silences read from the silences table, parsed (their
 * regexes compiled) once and then shared, so that matching alerts against
 * them costs no compile as long as the rows stay the same.
 *
 * A set is immutable once built and reference-counted: any thread may
 * match against a set it holds a reference to, while another thread
 * builds the next one. A build takes the rows of one read, in ascending
 * id order, and reuses what it can of the previous set:
 *  - rows exactly those of prev (ids, times, matchers_json): prev itself;
 *  - a row whose id and matchers_json are in prev: prev's silence copied,
 *    compiled regexes included (pcre2_code_copy: a memcpy, no compile);
 *  - any other row: parsed (silence_parse), counted in parsed.
 * A stored row that no longer parses (written by an older version, or
 * over today's regex bounds) stays in the set as a silence without
 * matchers, which matches nothing; the build reports it when it parses it,
 * not again when it copies it.
 *
 * Silences never change their matchers (the writer only inserts and
 * expires), but ids can be reused after retention deletes the newest
 * rows, hence the matchers_json comparison. Pure: no I/O, no clocks. */

/* One row of the silences table. json: len bytes, need not be NUL-terminated. */
struct silence_row {
    int64_t id;
    double starts_at, ends_at;
    const char *json;
    size_t len;
};

struct silence_set {
    atomic_uint refs;
    size_t n;
    size_t cap_v, cap_key; /* capacities of v and key (set_reserve) */
    struct silence *v;     /* n silences, ids ascending */
    struct silence_set_key {
        char *json; /* the matchers_json v[i] was made from */
        size_t len;
    } * key;
};

/* Another reference to s (NULL passes). Any thread. */
struct silence_set *silence_set_ref(struct silence_set *s);

/* Drops a reference; the last one frees s. NULL passes. Any thread. */
void silence_set_unref(struct silence_set *s);

/* A build in progress: owned by the one thread that runs it. */
struct silence_build {
    struct silence_set *prev; /* borrowed: the caller keeps its reference */
    struct silence_set *next; /* NULL while every row so far is prev's */
    size_t given;             /* rows given */
    size_t max;               /* rows allowed */
    int64_t last_id;
    int err;         /* the first failure; finish then returns NULL */
    unsigned parsed; /* rows parsed, not copied: regexes compiled */
};

/* Starts a build of at most max rows on top of prev (NULL: none). */
void silence_build_start(struct silence_build *b, struct silence_set *prev, size_t max);

/* Adds row r. Returns 0; 1 when r's matchers did not parse now (why says
 * why; r is kept as a silence that matches nothing); or -ENOSPC (max rows
 * given), -EINVAL (id not above the last), -ENOMEM: the build has then
 * failed, and finish returns NULL. */
int silence_build_row(struct silence_build *b, const struct silence_row *r, struct fs_err *why);

/* Ends the build: a reference to the set of the rows given (prev, with a
 * new reference, when they were exactly prev's), or NULL if the build
 * failed. Either way b holds nothing afterwards. */
struct silence_set *silence_build_finish(struct silence_build *b);

/* The latest set, for threads that build in turn (the HTTP handlers):
 * mu guards cur. Each thread compares its own read with a set it got from
 * here, so a set put by a slower thread from an older read costs a later
 * build, never a wrong answer. Holds at most one set; each in-flight
 * reader may hold one more. */
struct silence_cache {
    pthread_mutex_t mu;
    struct silence_set *cur; /* NULL: none yet */
};

/* 0 or -errno from pthread_mutex_init. Before any thread uses c. */
int silence_cache_init(struct silence_cache *c);

/* Drops the cached set. After every thread is done with c. */
void silence_cache_destroy(struct silence_cache *c);

/* A reference to the cached set, or NULL. Any thread. */
struct silence_set *silence_cache_get(struct silence_cache *c);

/* Makes s (NULL passes: nothing) the cached set; the cache takes its own
 * reference. Any thread. */
void silence_cache_put(struct silence_cache *c, struct silence_set *s);

#endif
