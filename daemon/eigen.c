/* Eigenvalues of small symmetric matrices into buffers sized once. See
 * eigen.h. */
#include "eigen.h"

#include <errno.h>
#include <lapacke.h>
#include <stdlib.h>

int monitor_eig_init(struct monitor_eig *e, size_t n, double *a)
{
    *e = (struct monitor_eig){0};
    e->w = malloc(n * sizeof(double));
    if (!e->w)
        goto fail;
    /* dsyev wants the most work at the largest size; dpstrf (monitor_qk.c)
     * wants 2n. */
    double query = 0.0;
    if (LAPACKE_dsyev_work(LAPACK_COL_MAJOR, 'N', 'L', (lapack_int)n, a, (lapack_int)n, e->w,
                           &query, -1) != 0)
        goto fail;
    size_t lwork = (size_t)query;
    if (lwork < 3 * n)
        lwork = 3 * n;
    e->work = malloc(lwork * sizeof(double));
    if (!e->work)
        goto fail;
    e->lwork = lwork;
    return 0;
fail:
    monitor_eig_free(e);
    return -ENOMEM;
}

void monitor_eig_free(struct monitor_eig *e)
{
    free(e->w);
    free(e->work);
    *e = (struct monitor_eig){0};
}

int monitor_eig_solve(struct monitor_eig *e, size_t m, double *a)
{
    lapack_int info = LAPACKE_dsyev_work(LAPACK_COL_MAJOR, 'N', 'L', (lapack_int)m, a,
                                         (lapack_int)m, e->w, e->work, (lapack_int)e->lwork);
    return info == 0 ? 0 : -EDOM;
}
