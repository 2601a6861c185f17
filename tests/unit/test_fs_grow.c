/* daemon/fs_grow.h: growing a dense array by doubling; the block and its
 * capacity are left alone when the size would overflow. Pure. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fs_grow.h"

static const struct grow_case {
    size_t cap, need, min_cap; /* cap 0: start from NULL */
    size_t want_cap;
} grow_cases[] = {
    {0, 1, 16, 16},    /* first block: min_cap */
    {0, 100, 16, 128}, /* min_cap doubled until need fits */
    {0, 1, 0, 1},      /* min_cap 0 counts as 1 */
    {0, 0, 8, 8},      /* even for nothing, a block (so NULL only means failure) */
    {16, 16, 16, 16},  /* room already: the same block */
    {16, 3, 16, 16},    {16, 17, 16, 32}, /* one more: doubles */
    {16, 100, 16, 128}, {4, 5, 64, 8},    /* min_cap only for the first block: doubling from cap */
    {3, 4, 1, 6},
};

Test(fs_grow, table)
{
    for (size_t c = 0; c < sizeof(grow_cases) / sizeof(grow_cases[0]); c++) {
        const struct grow_case *tc = &grow_cases[c];
        size_t cap = tc->cap;
        int *p = NULL;
        if (cap) {
            p = malloc(cap * sizeof(*p));
            cr_assert_not_null(p);
            for (size_t i = 0; i < cap; i++)
                p[i] = (int)(i * 3 + 1);
        }
        int *q = fs_grow(p, &cap, tc->need, sizeof(*q), tc->min_cap);
        cr_assert_not_null(q, "case %zu", c);
        cr_expect_eq(cap, tc->want_cap, "case %zu: cap %zu, want %zu", c, cap, tc->want_cap);
        if (tc->cap && tc->need <= tc->cap)
            cr_expect_eq(q, p, "case %zu: room already, same block", c);
        for (size_t i = 0; i < tc->cap; i++)
            cr_expect_eq(q[i], (int)(i * 3 + 1), "case %zu: element %zu kept", c, i);
        for (size_t i = 0; i < cap; i++) /* every element of the new cap is writable */
            q[i] = -1;
        free(q);
    }
}

Test(fs_grow, append_loop)
{
    struct {
        uint64_t *v;
        size_t n, cap;
    } a = {0};
    size_t grows = 0;
    for (uint64_t x = 0; x < 10000; x++) {
        size_t before = a.cap;
        uint64_t *v = fs_grow(a.v, &a.cap, a.n + 1, sizeof(*v), 16);
        cr_assert_not_null(v);
        a.v = v;
        a.v[a.n++] = x * x;
        grows += a.cap != before;
    }
    cr_expect_eq(a.cap, 16384);
    cr_expect_eq(grows, 11, "16, 32, ... 16384: %zu reallocations", grows);
    for (uint64_t x = 0; x < 10000; x++)
        cr_expect_eq(a.v[x], x * x);
    free(a.v);
}

/* Sizes past PTRDIFF_MAX fail before realloc is asked: p and *cap stay. */
Test(fs_grow, overflow_leaves_block)
{
    static const struct {
        size_t need, elem;
    } cases[] = {
        {SIZE_MAX / 16 + 1, 16}, {SIZE_MAX, 1}, {SIZE_MAX / 2 + 2, 2},
        {5, SIZE_MAX / 2},       {8, 0}, /* elem 0 is no size at all */
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        size_t cap = 4;
        char *p = malloc(cap);
        cr_assert_not_null(p);
        memcpy(p, "abc", 4);
        cr_expect_null(fs_grow(p, &cap, cases[c].need, cases[c].elem, 1), "case %zu", c);
        cr_expect_eq(cap, 4, "case %zu: cap untouched", c);
        cr_expect_str_eq(p, "abc", "case %zu: block still the caller's", c);
        free(p);

        size_t none = 0;
        cr_expect_null(fs_grow(NULL, &none, cases[c].need, cases[c].elem, 1), "case %zu", c);
        cr_expect_eq(none, 0);
    }
}
