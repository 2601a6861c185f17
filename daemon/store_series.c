/* Series and points inside the writer's transaction: the series id cache
 * (writer thread only) and the point rows. See store_internal.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fs_grow.h"
#include "store_internal.h"

/* --- series cache ------------------------------------------------------------ */

static uint64_t series_hash(int64_t run_id, const char *name, int32_t l, int32_t h, int32_t w,
                            int32_t r)
{
    int64_t nums[5] = {run_id, l, h, w, r};
    return fs_fnv1a(fs_fnv1a(FS_FNV1A_BASIS, nums, sizeof(nums)), name, strlen(name));
}

void store_cache_clear(struct series_cache *c)
{
    c->n = 0;
    c->ndirty = 0;
    fs_index_clear(&c->index);
}

void store_cache_free(struct series_cache *c)
{
    free(c->ents);
    fs_index_free(&c->index);
    free(c->dirty);
    memset(c, 0, sizeof(*c));
}

static uint64_t entry_hash(const void *owner, size_t pos)
{
    return ((const struct series_cache *)owner)->ents[pos].hash;
}

/* Returns the index of the cached entry, or -1. */
static long cache_find(const struct series_cache *c, uint64_t hash, int64_t run_id,
                       const char *name, int32_t l, int32_t h, int32_t w, int32_t r)
{
    const struct fs_index *ix = &c->index;
    uint32_t at;
    for (size_t j = fs_index_start(ix, hash); (at = fs_index_at(ix, j)); j = fs_index_next(ix, j)) {
        const struct series_entry *e = &c->ents[at - 1];
        if (e->hash == hash && e->run_id == run_id && e->layer == l && e->head == h &&
            e->window == w && e->rank == r && strcmp(e->name, name) == 0)
            return (long)(at - 1);
    }
    return -1;
}

static long cache_add(struct series_cache *c, const struct series_entry *e)
{
    if (fs_index_reserve(&c->index, c->n, SERIES_INDEX_MIN_SLOTS, entry_hash, c) < 0)
        return -1;
    struct series_entry *ents = fs_grow(c->ents, &c->cap, c->n + 1, sizeof(*ents), 256);
    if (!ents)
        return -1;
    c->ents = ents;
    c->ents[c->n] = *e;
    fs_index_add(&c->index, e->hash, c->n);
    return (long)c->n++;
}

static int bind_series_key(sqlite3_stmt *st, int64_t run_id, const char *name, int32_t l, int32_t h,
                           int32_t w, int32_t r)
{
    int rc = sqlite3_bind_int64(st, 1, run_id);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_text(st, 2, name, -1, SQLITE_STATIC);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 3, l);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 4, h);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 5, w);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_int(st, 6, r);
    return rc;
}

/* Finds or creates the series; *idx is its cache entry. SQLite rc. */
int store_series_get(struct store *s, int64_t run_id, const char *name, int32_t l, int32_t h,
                     int32_t w, int32_t r, long *idx)
{
    uint64_t hash = series_hash(run_id, name, l, h, w, r);
    *idx = cache_find(&s->cache, hash, run_id, name, l, h, w, r);
    if (*idx >= 0)
        return SQLITE_OK;
    int64_t id = 0;
    int rc = bind_series_key(s->st[ST_SERIES_FIND], run_id, name, l, h, w, r);
    if (rc != SQLITE_OK)
        return rc;
    rc = exec1(s->st[ST_SERIES_FIND], &id, 1);
    if (rc == SQLITE_DONE) {
        rc = bind_series_key(s->st[ST_SERIES_INSERT], run_id, name, l, h, w, r);
        if (rc != SQLITE_OK)
            return rc;
        rc = exec1(s->st[ST_SERIES_INSERT], &id, 1);
        if (rc == SQLITE_DONE)
            return SQLITE_ERROR; /* RETURNING gave no row */
    }
    if (rc != SQLITE_ROW)
        return rc;
    struct series_entry e = {
        .run_id = run_id, .id = id, .layer = l, .head = h, .window = w, .rank = r, .hash = hash};
    snprintf(e.name, sizeof(e.name), "%s", name);
    *idx = cache_add(&s->cache, &e);
    return *idx < 0 ? SQLITE_NOMEM : SQLITE_OK;
}

/* Stores value at step in the series of cache entry idx; a re-done step
 * replaces its value without adding a point. */
int store_point_put(struct store *s, long idx, uint64_t step, double value, double t,
                    uint64_t *points)
{
    int64_t id = s->cache.ents[idx].id;
    sqlite3_stmt *st = s->st[ST_POINT_INSERT];
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, (int64_t)step);
    bind_value(st, 3, value);
    sqlite3_bind_double(st, 4, t);
    int rc = exec1(st, NULL, 0);
    if (!ok(rc))
        return rc;
    if (sqlite3_changes(s->db) == 0) {
        st = s->st[ST_POINT_UPDATE];
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_int64(st, 2, (int64_t)step);
        bind_value(st, 3, value);
        sqlite3_bind_double(st, 4, t);
        rc = exec1(st, NULL, 0);
        return ok(rc) ? SQLITE_OK : rc;
    }
    struct series_cache *c = &s->cache;
    struct series_entry *e = &c->ents[idx];
    if (!e->dirty) {
        uint32_t *d = fs_grow(c->dirty, &c->capdirty, c->ndirty + 1, sizeof(*d), 256);
        if (!d)
            return SQLITE_NOMEM;
        c->dirty = d;
        c->dirty[c->ndirty++] = (uint32_t)idx;
        e->dirty = 1;
        e->add_points = 0;
        e->min_step = e->max_step = (int64_t)step;
    }
    e->add_points++;
    if ((int64_t)step < e->min_step)
        e->min_step = (int64_t)step;
    if ((int64_t)step > e->max_step)
        e->max_step = (int64_t)step;
    (*points)++;
    return SQLITE_OK;
}

/* Writes the batch's point counts and step ranges into series rows. */
int store_series_flush(struct store *s)
{
    struct series_cache *c = &s->cache;
    for (size_t i = 0; i < c->ndirty; i++) {
        struct series_entry *e = &c->ents[c->dirty[i]];
        sqlite3_stmt *st = s->st[ST_SERIES_BUMP];
        sqlite3_bind_int64(st, 1, e->id);
        sqlite3_bind_int64(st, 2, e->add_points);
        sqlite3_bind_int64(st, 3, e->min_step);
        sqlite3_bind_int64(st, 4, e->max_step);
        int rc = exec1(st, NULL, 0);
        if (!ok(rc))
            return rc;
    }
    for (size_t i = 0; i < c->ndirty; i++)
        c->ents[c->dirty[i]].dirty = 0;
    c->ndirty = 0;
    return SQLITE_OK;
}
