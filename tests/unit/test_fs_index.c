/* daemon/fs_index.h: FNV-1a, and the slot index over an owner's dense array
 * (insert, find, growth at the load factor, collisions, rebuild after a
 * compaction, clear). Pure. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fs_index.h"

/* --- FNV-1a -------------------------------------------------------------------------- */

Test(fs_index, fnv1a_known_values)
{
    /* Published FNV-1a 64 test vectors. */
    static const struct {
        const char *in;
        uint64_t want;
    } cases[] = {
        {"", 0xcbf29ce484222325ull},
        {"a", 0xaf63dc4c8601ec8cull},
        {"foobar", 0x85944171f73967e8ull},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_expect_eq(fs_fnv1a(FS_FNV1A_BASIS, cases[i].in, strlen(cases[i].in)), cases[i].want,
                     "fnv1a(\"%s\")", cases[i].in);
}

Test(fs_index, fnv1a_chains)
{
    uint64_t whole = fs_fnv1a(FS_FNV1A_BASIS, "foobar", 6);
    for (size_t cut = 0; cut <= 6; cut++)
        cr_expect_eq(fs_fnv1a(fs_fnv1a(FS_FNV1A_BASIS, "foobar", cut), "foobar" + cut, 6 - cut),
                     whole, "cut at %zu", cut);
}

/* --- an owner: keys in a dense array, equality by value ---------------------------- */

enum hash_kind {
    HASH_SPREAD,   /* FNV-1a of the key: few collisions */
    HASH_CONSTANT, /* every key collides: one probe chain holds them all */
    HASH_HIGH,     /* differs only above the slot bits: collisions until the slots are many */
};

struct owner {
    enum hash_kind kind;
    uint64_t *keys;
    size_t n;
    struct fs_index ix;
};

static uint64_t key_hash(enum hash_kind kind, uint64_t key)
{
    switch (kind) {
    case HASH_SPREAD:
        return fs_fnv1a(FS_FNV1A_BASIS, &key, sizeof(key));
    case HASH_CONSTANT:
        return 42;
    case HASH_HIGH:
        return key << 40;
    }
    return 0;
}

static uint64_t owner_hash(const void *owner, size_t pos)
{
    const struct owner *o = owner;
    return key_hash(o->kind, o->keys[pos]);
}

static long owner_find(const struct owner *o, uint64_t key)
{
    uint32_t at;
    for (size_t j = fs_index_start(&o->ix, key_hash(o->kind, key)); (at = fs_index_at(&o->ix, j));
         j = fs_index_next(&o->ix, j))
        if (o->keys[at - 1] == key)
            return (long)(at - 1);
    return -1;
}

static int owner_add(struct owner *o, uint64_t key, size_t min_slots)
{
    int rc = fs_index_reserve(&o->ix, o->n, min_slots, owner_hash, o);
    if (rc < 0)
        return rc;
    o->keys[o->n] = key;
    fs_index_add(&o->ix, key_hash(o->kind, key), o->n);
    o->n++;
    return 0;
}

static size_t used_slots(const struct fs_index *ix)
{
    size_t used = 0;
    for (size_t j = 0; j < ix->nslots; j++)
        used += ix->slots[j] != 0;
    return used;
}

/* Keys 1000 + 7i: none is 0, none repeats. */
static uint64_t key_at(size_t i)
{
    return 1000 + 7 * (uint64_t)i;
}

static const struct insert_case {
    enum hash_kind kind;
    size_t n, min_slots;
} insert_cases[] = {
    {HASH_SPREAD, 1, 64},  {HASH_SPREAD, 44, 64}, /* 44 fit 64 slots at 0.7; 45 do not */
    {HASH_SPREAD, 45, 64}, {HASH_SPREAD, 3000, 64}, {HASH_SPREAD, 2000, 1024},
    {HASH_CONSTANT, 1, 8}, {HASH_CONSTANT, 300, 8}, {HASH_HIGH, 500, 16},
};

Test(fs_index, insert_find_grow)
{
    for (size_t c = 0; c < sizeof(insert_cases) / sizeof(insert_cases[0]); c++) {
        const struct insert_case *tc = &insert_cases[c];
        struct owner o = {.kind = tc->kind, .keys = calloc(tc->n, sizeof(uint64_t))};
        cr_assert_not_null(o.keys);
        cr_expect_eq(owner_find(&o, key_at(0)), -1, "case %zu: empty index finds nothing", c);
        size_t want_slots = 0;
        for (size_t i = 0; i < tc->n; i++) {
            /* The slots double exactly when one more entry would pass 0.7. */
            if ((i + 1) * 10 > want_slots * 7)
                want_slots = want_slots ? want_slots * 2 : tc->min_slots;
            cr_assert_eq(owner_add(&o, key_at(i), tc->min_slots), 0, "case %zu add %zu", c, i);
            cr_assert_eq(o.ix.nslots, want_slots, "case %zu after %zu: %zu slots, want %zu", c,
                         i + 1, o.ix.nslots, want_slots);
            cr_assert(o.n * FS_INDEX_LOAD_DEN <= o.ix.nslots * FS_INDEX_LOAD_NUM,
                      "case %zu: load above the factor at %zu", c, o.n);
        }
        cr_expect_eq(used_slots(&o.ix), tc->n, "case %zu: one slot per entry", c);
        for (size_t i = 0; i < tc->n; i++)
            cr_expect_eq(owner_find(&o, key_at(i)), (long)i, "case %zu: key %zu", c, i);
        for (size_t i = tc->n; i < tc->n + 50; i++)
            cr_expect_eq(owner_find(&o, key_at(i)), -1, "case %zu: absent key %zu", c, i);
        cr_expect_eq(owner_find(&o, 3), -1, "case %zu: absent key off the grid", c);
        fs_index_free(&o.ix);
        cr_expect_null(o.ix.slots);
        cr_expect_eq(o.ix.nslots, 0);
        free(o.keys);
    }
}

/* A removal is a compaction plus a rebuild at the same size, as
 * run_bucket.c does when it drops incomplete groups. */
Test(fs_index, rebuild_after_compaction)
{
    static const enum hash_kind kinds[] = {HASH_SPREAD, HASH_CONSTANT, HASH_HIGH};
    for (size_t c = 0; c < sizeof(kinds) / sizeof(kinds[0]); c++) {
        struct owner o = {.kind = kinds[c], .keys = calloc(200, sizeof(uint64_t))};
        cr_assert_not_null(o.keys);
        for (size_t i = 0; i < 200; i++)
            cr_assert_eq(owner_add(&o, key_at(i), 64), 0);
        size_t nslots = o.ix.nslots, k = 0;
        for (size_t i = 0; i < o.n; i++)
            if (i % 3 != 1)
                o.keys[k++] = o.keys[i];
        o.n = k;
        cr_assert_eq(fs_index_rebuild(&o.ix, o.ix.nslots, o.n, owner_hash, &o), 0);
        cr_expect_eq(o.ix.nslots, nslots, "kind %zu: same size", c);
        cr_expect_eq(used_slots(&o.ix), k);
        for (size_t i = 0; i < 200; i++) {
            long at = owner_find(&o, key_at(i));
            if (i % 3 == 1)
                cr_expect_eq(at, -1, "kind %zu: dropped key %zu found", c, i);
            else
                cr_expect(at >= 0 && o.keys[at] == key_at(i), "kind %zu: key %zu lost", c, i);
        }
        fs_index_free(&o.ix);
        free(o.keys);
    }
}

Test(fs_index, rebuild_refuses_bad_sizes)
{
    uint64_t keys[4] = {1, 2, 3, 4};
    struct owner o = {.kind = HASH_SPREAD, .keys = keys, .n = 4};
    static const struct {
        size_t nslots, n;
    } cases[] = {
        {4, 4},                  /* no free slot */
        {2, 4},                  /* fewer slots than entries */
        {12, 4},                 /* not a power of two */
        {0, 0},                  /* no slots at all */
        {8, (size_t)UINT32_MAX}, /* a position that does not fit a slot */
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        cr_expect_eq(fs_index_rebuild(&o.ix, cases[c].nslots, cases[c].n, owner_hash, &o), -E2BIG,
                     "case %zu", c);
        cr_expect_null(o.ix.slots, "case %zu: the index is left as it was", c);
        cr_expect_eq(o.ix.nslots, 0);
    }
    cr_assert_eq(fs_index_rebuild(&o.ix, 8, 4, owner_hash, &o), 0);
    uint32_t *slots = o.ix.slots;
    cr_expect_eq(fs_index_rebuild(&o.ix, 6, 4, owner_hash, &o), -E2BIG);
    cr_expect_eq(o.ix.slots, slots, "a refused rebuild keeps the old slots");
    cr_expect_eq(o.ix.nslots, 8);
    for (size_t i = 0; i < 4; i++)
        cr_expect_eq(owner_find(&o, keys[i]), (long)i);
    fs_index_free(&o.ix);
}

Test(fs_index, clear_keeps_slots)
{
    struct owner o = {.kind = HASH_SPREAD, .keys = calloc(100, sizeof(uint64_t))};
    cr_assert_not_null(o.keys);
    for (size_t i = 0; i < 100; i++)
        cr_assert_eq(owner_add(&o, key_at(i), 64), 0);
    size_t nslots = o.ix.nslots;
    fs_index_clear(&o.ix);
    o.n = 0;
    cr_expect_eq(o.ix.nslots, nslots);
    cr_expect_eq(used_slots(&o.ix), 0);
    cr_expect_eq(owner_find(&o, key_at(5)), -1);
    /* Refilled without growing: the slots were already enough. */
    for (size_t i = 0; i < 100; i++)
        cr_assert_eq(owner_add(&o, key_at(i + 100), 64), 0);
    cr_expect_eq(o.ix.nslots, nslots);
    cr_expect_eq(owner_find(&o, key_at(150)), 50);
    cr_expect_eq(owner_find(&o, key_at(5)), -1);
    fs_index_free(&o.ix);
    fs_index_clear(&o.ix); /* harmless on a freed index */
    free(o.keys);
}
