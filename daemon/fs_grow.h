#ifndef FORESHOCK_FS_GROW_H
#define FORESHOCK_FS_GROW_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* Growing a dense array by doubling: the one copy of "cap ? cap * 2 : N,
 * realloc, check". Any thread; the array belongs to the caller.
 *
 * fs_grow returns a block of at least need elements of elem bytes:
 *  - p itself when *cap >= need already (and p is not NULL);
 *  - else p realloc'd to the first of min_cap (when *cap is 0) or 2 * *cap,
 *    doubled again until it holds need, and *cap set to that;
 *  - NULL when the size passes PTRDIFF_MAX or realloc fails: p and *cap
 *    are left as they were, p still valid and still the caller's to free.
 *
 * Appending one element:
 *
 *     struct item *v = fs_grow(a->v, &a->cap, a->n + 1, sizeof(*v), 16);
 *     if (!v)
 *         return -ENOMEM;
 *     a->v = v;
 *     a->v[a->n++] = x;
 */
static inline void *fs_grow(void *p, size_t *cap, size_t need, size_t elem, size_t min_cap)
{
    if (p && need <= *cap)
        return p;
    size_t c = !*cap ? (min_cap ? min_cap : 1) : *cap > SIZE_MAX / 2 ? SIZE_MAX : *cap * 2;
    while (c < need)
        c = c > SIZE_MAX / 2 ? SIZE_MAX : c * 2;
    if (!elem || c > (size_t)PTRDIFF_MAX / elem) /* no object is larger */
        return NULL;
    void *q = realloc(p, c * elem);
    if (!q)
        return NULL;
    *cap = c;
    return q;
}

#endif
