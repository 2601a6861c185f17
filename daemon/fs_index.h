#ifndef FORESHOCK_FS_INDEX_H
#define FORESHOCK_FS_INDEX_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A hash index over a dense array the owner keeps: open addressing, linear
 * probing, a power-of-two number of uint32 slots, each 0 (empty) or 1 + a
 * position in the owner's array. The index stores no keys and no hashes:
 * the owner compares keys while it walks a probe chain, and says how to
 * hash an entry again when the index is rebuilt. The series cache
 * (store_series.c), the track table (evaluate.c) and a bucket's groups
 * (run_bucket.c) use it.
 *
 * Contract:
 *  - Positions are < UINT32_MAX. The index never moves the owner's entries;
 *    the owner appends, and rebuilds the index when it compacts or reorders.
 *  - Entries are only added, never removed one by one: a removal means
 *    compacting the array and calling fs_index_rebuild.
 *  - The load stays at most FS_INDEX_LOAD_NUM / FS_INDEX_LOAD_DEN when the
 *    owner calls fs_index_reserve before every fs_index_add.
 *  - Not thread-safe: it belongs to whoever owns the array.
 *
 * Finding a key of hash h (the owner's equality, here `same`):
 *
 *     uint32_t at;
 *     for (size_t j = fs_index_start(ix, h); (at = fs_index_at(ix, j)); j = fs_index_next(ix, j))
 *         if (same(&owner[at - 1], key))
 *             return at - 1;
 *
 * fs_index_start and fs_index_at are safe on an empty index (no slots). */

#define FS_INDEX_LOAD_NUM 7u /* grow past a load of 0.7 */
#define FS_INDEX_LOAD_DEN 10u

/* FNV-1a 64 over n bytes, starting from h: FS_FNV1A_BASIS for a fresh hash,
 * or the result of an earlier call to chain fields. Pure. */
#define FS_FNV1A_BASIS 0xcbf29ce484222325ull
#define FS_FNV1A_PRIME 0x100000001b3ull

static inline uint64_t fs_fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * FS_FNV1A_PRIME;
    return h;
}

struct fs_index {
    uint32_t *slots; /* 1 + position; 0 = empty */
    size_t nslots;   /* 0 or a power of two */
};

/* The hash of the entry at pos, for rebuilding. */
typedef uint64_t (*fs_index_hash_fn)(const void *owner, size_t pos);

/* The first slot of hash's probe chain. */
static inline size_t fs_index_start(const struct fs_index *ix, uint64_t hash)
{
    return ix->nslots ? (size_t)(hash & (ix->nslots - 1)) : 0;
}

static inline size_t fs_index_next(const struct fs_index *ix, size_t j)
{
    return (j + 1) & (ix->nslots - 1);
}

/* Slot j's content: 0 ends the chain, else 1 + a position. */
static inline uint32_t fs_index_at(const struct fs_index *ix, size_t j)
{
    return ix->nslots ? ix->slots[j] : 0;
}

/* Points slot chain of hash at pos. There must be a free slot: call
 * fs_index_reserve first. */
static inline void fs_index_add(struct fs_index *ix, uint64_t hash, size_t pos)
{
    size_t j = fs_index_start(ix, hash);
    while (ix->slots[j])
        j = fs_index_next(ix, j);
    ix->slots[j] = (uint32_t)pos + 1;
}

/* Replaces the index by one of nslots slots (a power of two, > n) over
 * positions 0 .. n-1, hashed by hash_of. 0, -E2BIG when a position does
 * not fit a slot, or -ENOMEM leaving the index as it was. */
static inline int fs_index_rebuild(struct fs_index *ix, size_t nslots, size_t n,
                                   fs_index_hash_fn hash_of, const void *owner)
{
    if (n >= UINT32_MAX || nslots <= n || (nslots & (nslots - 1)))
        return -E2BIG;
    struct fs_index fresh = {.slots = calloc(nslots, sizeof(*fresh.slots)), .nslots = nslots};
    if (!fresh.slots)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        fs_index_add(&fresh, hash_of(owner, i), i);
    free(ix->slots);
    *ix = fresh;
    return 0;
}

/* Makes room for entry n (the owner holds n entries 0 .. n-1 and adds one):
 * rebuilds at twice the slots, or min_slots (a power of two) on the first
 * entry, when one more would pass the load factor. 0, or what
 * fs_index_rebuild returns, leaving the index as it was. */
static inline int fs_index_reserve(struct fs_index *ix, size_t n, size_t min_slots,
                                   fs_index_hash_fn hash_of, const void *owner)
{
    if ((n + 1) * FS_INDEX_LOAD_DEN <= ix->nslots * FS_INDEX_LOAD_NUM)
        return 0;
    size_t nslots = ix->nslots ? ix->nslots * 2 : min_slots;
    while ((n + 1) * FS_INDEX_LOAD_DEN > nslots * FS_INDEX_LOAD_NUM && nslots <= SIZE_MAX / 4)
        nslots *= 2;
    return fs_index_rebuild(ix, nslots, n, hash_of, owner);
}

/* Empties every slot, keeping the allocation (the owner dropped all its
 * entries). */
static inline void fs_index_clear(struct fs_index *ix)
{
    if (ix->slots)
        memset(ix->slots, 0, ix->nslots * sizeof(*ix->slots));
}

static inline void fs_index_free(struct fs_index *ix)
{
    free(ix->slots);
    ix->slots = NULL;
    ix->nslots = 0;
}

#endif
