/* Rank lists: sorted arrays and range text. See ranks.h. */
#include "ranks.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

size_t ranks_normalize(uint32_t *v, size_t n)
{
    if (n < 2)
        return n;
    qsort(v, n, sizeof(*v), cmp_u32);
    size_t k = 1;
    for (size_t i = 1; i < n; i++)
        if (v[i] != v[k - 1])
            v[k++] = v[i];
    return k;
}

char *ranks_format(const uint32_t *v, size_t n)
{
    /* "4294967295-4294967295," is 22 bytes: a range per value at most. */
    size_t cap = n * 22 + 1, off = 0;
    char *s = malloc(cap);
    if (!s)
        return NULL;
    s[0] = '\0';
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j + 1 < n && v[j + 1] == v[j] + 1)
            j++;
        int w = j == i ? snprintf(s + off, cap - off, "%s%u", off ? "," : "", v[i])
                       : snprintf(s + off, cap - off, "%s%u-%u", off ? "," : "", v[i], v[j]);
        off += (size_t)w;
        i = j + 1;
    }
    return s;
}

/* One decimal number below max_value at *p; advances *p. */
static int number(const char **p, uint32_t max_value, uint32_t *out)
{
    const char *c = *p;
    uint64_t v = 0;
    if (*c < '0' || *c > '9')
        return -EINVAL;
    for (; *c >= '0' && *c <= '9'; c++) {
        v = v * 10 + (uint64_t)(*c - '0');
        if (v >= max_value)
            return -EINVAL;
    }
    *p = c;
    *out = (uint32_t)v;
    return 0;
}

int ranks_parse(const char *s, uint32_t max_value, size_t max_n, uint32_t **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    if (!s)
        return -EINVAL;
    /* First pass: syntax and the size of the expansion (before allocating
     * anything sized by it: a range can name a million ranks). */
    uint64_t total = 0;
    for (const char *c = s; *c;) {
        uint32_t lo, hi;
        if (number(&c, max_value, &lo) < 0)
            return -EINVAL;
        hi = lo;
        if (*c == '-') {
            c++;
            if (number(&c, max_value, &hi) < 0 || hi < lo)
                return -EINVAL;
        }
        total += (uint64_t)hi - lo + 1;
        if (total > max_n)
            return -E2BIG;
        if (*c == ',' && c[1])
            c++;
        else if (*c)
            return -EINVAL;
    }
    if (!total)
        return 0;
    uint32_t *v = malloc((size_t)total * sizeof(*v));
    if (!v)
        return -ENOMEM;
    size_t k = 0;
    for (const char *c = s; *c;) {
        uint32_t lo = 0, hi;
        (void)number(&c, max_value, &lo);
        hi = lo;
        if (*c == '-') {
            c++;
            (void)number(&c, max_value, &hi);
        }
        for (uint64_t r = lo; r <= hi; r++)
            v[k++] = (uint32_t)r;
        if (*c == ',')
            c++;
    }
    *n = ranks_normalize(v, k);
    *out = v;
    return 0;
}

int ranks_contains(const uint32_t *v, size_t n, uint32_t rank)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v[mid] == rank)
            return 1;
        if (v[mid] < rank)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}
