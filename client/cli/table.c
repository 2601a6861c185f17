/* Aligned text tables: collect rows, then print with column widths. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

struct table {
    size_t ncols, nrows, cap;
    const char *const *headers;
    const int *right;
    char **cells; /* nrows * ncols, row-major, owned */
};

struct table *table_new(size_t ncols, const char *const *headers, const int *right)
{
    struct table *t = calloc(1, sizeof(*t));

    if (!t)
        return NULL;
    t->ncols = ncols;
    t->headers = headers;
    t->right = right;
    return t;
}

int table_add(struct table *t, const char *const *cells)
{
    if (t->nrows == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        char **c = realloc(t->cells, cap * t->ncols * sizeof(*c));
        if (!c)
            return -ENOMEM;
        t->cells = c;
        t->cap = cap;
    }
    for (size_t i = 0; i < t->ncols; i++) {
        char *s = strdup(cells[i] ? cells[i] : "");
        if (!s) {
            for (size_t k = 0; k < i; k++)
                free(t->cells[t->nrows * t->ncols + k]);
            return -ENOMEM;
        }
        t->cells[t->nrows * t->ncols + i] = s;
    }
    t->nrows++;
    return 0;
}

static void print_row(const struct table *t, const char *const *row, const size_t *w, FILE *out)
{
    for (size_t i = 0; i < t->ncols; i++) {
        int last = i + 1 == t->ncols;
        if (t->right && t->right[i])
            fprintf(out, "%*s", (int)w[i], row[i]);
        else if (last)
            fputs(row[i], out); /* no trailing blanks */
        else
            fprintf(out, "%-*s", (int)w[i], row[i]);
        fputs(last ? "\n" : "  ", out);
    }
}

void table_print(const struct table *t, FILE *out)
{
    size_t *w = calloc(t->ncols, sizeof(*w));

    if (!w)
        return;
    for (size_t i = 0; i < t->ncols; i++)
        w[i] = strlen(t->headers[i]);
    for (size_t r = 0; r < t->nrows; r++)
        for (size_t i = 0; i < t->ncols; i++) {
            size_t l = strlen(t->cells[r * t->ncols + i]);
            if (l > w[i])
                w[i] = l;
        }
    print_row(t, t->headers, w, out);
    for (size_t r = 0; r < t->nrows; r++)
        print_row(t, (const char *const *)&t->cells[r * t->ncols], w, out);
    free(w);
}

void table_free(struct table *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->nrows * t->ncols; i++)
        free(t->cells[i]);
    free(t->cells);
    free(t);
}
