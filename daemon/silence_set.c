/* Silence sets: parsed silences built once per change of the rows, shared
 * by reference (silence_set.h). */

#include "silence_set.h"
#include "fs_grow.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct silence_set *silence_set_ref(struct silence_set *s)
{
    if (s)
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
    return s;
}

void silence_set_unref(struct silence_set *s)
{
    /* acq_rel: the thread that frees sees every other holder's reads done */
    if (!s || atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1)
        return;
    for (size_t i = 0; i < s->n; i++) {
        silence_free(&s->v[i]);
        free(s->key[i].json);
    }
    free(s->v);
    free(s->key);
    free(s);
}

static struct silence_set *set_new(void)
{
    struct silence_set *s = calloc(1, sizeof(*s));
    if (s)
        atomic_init(&s->refs, 1);
    return s;
}

/* Room for one more entry: grows by doubling (a set is rebuilt on every
 * change, so it is sized by its rows, not by the bound). */
static int set_reserve(struct silence_set *s)
{
    struct silence *v = fs_grow(s->v, &s->cap_v, s->n + 1, sizeof(*v), 16);
    if (!v)
        return -ENOMEM;
    s->v = v;
    struct silence_set_key *k = fs_grow(s->key, &s->cap_key, s->n + 1, sizeof(*k), 16);
    if (!k)
        return -ENOMEM;
    s->key = k;
    return 0;
}

static bool key_equal(const struct silence_set_key *k, const char *json, size_t len)
{
    return k->len == len && memcmp(k->json, json, len) == 0;
}

/* Appends a copy of from (no compile) with the given key and times. */
static int set_add_copy(struct silence_set *s, const struct silence *from, const char *json,
                        size_t len, double starts_at, double ends_at)
{
    if (set_reserve(s) != 0)
        return -ENOMEM;
    char *j = malloc(len + 1);
    if (!j)
        return -ENOMEM;
    struct silence *x = &s->v[s->n];
    if (silence_copy(x, from) != 0) {
        free(j);
        return -ENOMEM;
    }
    memcpy(j, json, len);
    j[len] = '\0';
    x->starts_at = starts_at;
    x->ends_at = ends_at;
    s->key[s->n++] = (struct silence_set_key){.json = j, .len = len};
    return 0;
}

/* Appends row r, parsed. Returns 0, 1 (kept without matchers: why), or
 * -ENOMEM. */
static int set_add_parsed(struct silence_set *s, const struct silence_row *r, struct fs_err *why)
{
    if (set_reserve(s) != 0)
        return -ENOMEM;
    char *j = malloc(r->len + 1);
    if (!j)
        return -ENOMEM;
    memcpy(j, r->json, r->len);
    j[r->len] = '\0';
    struct silence *x = &s->v[s->n];
    int rc = silence_parse(j, r->len, x, why);
    if (rc == -ENOMEM) {
        free(j);
        return rc;
    }
    /* a failed parse leaves x without matchers: it matches nothing */
    x->id = r->id;
    x->starts_at = r->starts_at;
    x->ends_at = r->ends_at;
    s->key[s->n++] = (struct silence_set_key){.json = j, .len = r->len};
    return rc == 0 ? 0 : 1;
}

/* Where id is or would be in prev (its ids ascend); *found: it is there. */
static size_t find(const struct silence_set *prev, int64_t id, bool *found)
{
    size_t lo = 0, hi = prev != NULL ? prev->n : 0;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (prev->v[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = prev != NULL && lo < prev->n && prev->v[lo].id == id;
    return lo;
}

void silence_build_start(struct silence_build *b, struct silence_set *prev, size_t max)
{
    *b = (struct silence_build){.prev = prev, .max = max, .last_id = INT64_MIN};
}

/* The rows so far were prev's first `given`: start next with copies. */
static int diverge(struct silence_build *b)
{
    if (!(b->next = set_new()))
        return -ENOMEM;
    for (size_t i = 0; i < b->given; i++) {
        const struct silence *p = &b->prev->v[i];
        const struct silence_set_key *k = &b->prev->key[i];
        if (set_add_copy(b->next, p, k->json, k->len, p->starts_at, p->ends_at) != 0)
            return -ENOMEM;
    }
    return 0;
}

int silence_build_row(struct silence_build *b, const struct silence_row *r, struct fs_err *why)
{
    if (b->err != 0)
        return b->err;
    if (b->given >= b->max)
        return b->err = -ENOSPC;
    if (b->given > 0 && r->id <= b->last_id)
        return b->err = -EINVAL;
    b->last_id = r->id;
    if (!b->next) {
        const struct silence_set *p = b->prev;
        if (p && b->given < p->n && p->v[b->given].id == r->id &&
            p->v[b->given].starts_at == r->starts_at && p->v[b->given].ends_at == r->ends_at &&
            key_equal(&p->key[b->given], r->json, r->len)) {
            b->given++;
            return 0;
        }
        if (diverge(b) != 0)
            return b->err = -ENOMEM;
    }
    b->given++;
    bool found;
    size_t at = find(b->prev, r->id, &found);
    if (found && key_equal(&b->prev->key[at], r->json, r->len)) {
        if (set_add_copy(b->next, &b->prev->v[at], r->json, r->len, r->starts_at, r->ends_at) != 0)
            return b->err = -ENOMEM;
        return 0;
    }
    b->parsed++;
    int rc = set_add_parsed(b->next, r, why);
    if (rc < 0)
        b->err = rc;
    return rc;
}

struct silence_set *silence_build_finish(struct silence_build *b)
{
    struct silence_set *out = NULL;
    if (b->err == 0 && !b->next) {
        if (b->prev && b->given == b->prev->n)
            out = silence_set_ref(b->prev);
        else if (!b->prev && b->given == 0)
            out = set_new(); /* nothing, then nothing: an empty set */
        else if (diverge(b) != 0)
            b->err = -ENOMEM; /* fewer rows than prev: its first ones */
    }
    if (b->err == 0 && !out)
        out = b->next;
    else
        silence_set_unref(b->next);
    *b = (struct silence_build){0};
    return out;
}

int silence_cache_init(struct silence_cache *c)
{
    c->cur = NULL;
    return -pthread_mutex_init(&c->mu, NULL);
}

void silence_cache_destroy(struct silence_cache *c)
{
    silence_set_unref(c->cur);
    c->cur = NULL;
    pthread_mutex_destroy(&c->mu);
}

struct silence_set *silence_cache_get(struct silence_cache *c)
{
    pthread_mutex_lock(&c->mu);
    struct silence_set *s = silence_set_ref(c->cur);
    pthread_mutex_unlock(&c->mu);
    return s;
}

void silence_cache_put(struct silence_cache *c, struct silence_set *s)
{
    if (!s)
        return;
    silence_set_ref(s);
    pthread_mutex_lock(&c->mu);
    struct silence_set *old = c->cur;
    c->cur = s;
    pthread_mutex_unlock(&c->mu);
    silence_set_unref(old); /* outside the lock: may free a whole set */
}
