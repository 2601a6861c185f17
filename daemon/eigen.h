#ifndef FORESHOCK_EIGEN_H
#define FORESHOCK_EIGEN_H

#include <stddef.h>

/* Eigenvalues of small symmetric matrices (LAPACK's dsyev) into buffers
 * sized once, so the monitors' hot path never allocates. Ground floor: it
 * includes no other module of the daemon.
 *
 * struct monitor_eig is embedded in struct qk_workspace (monitor_qk.c) and
 * struct router_workspace (monitor_router.c), and owned by the workspace's
 * thread. */

/* The eigen-solver buffers of one workspace. */
struct monitor_eig {
    double *w;    /* n eigenvalues, ascending (dsyev's order) */
    double *work; /* at least 3n doubles, or what dsyev asked for at n */
    size_t lwork;
};

/* Sizes e for matrices up to n x n (n > 0); a: an n x n buffer the caller
 * owns, used only for dsyev's size query. Returns 0 or -ENOMEM (e then
 * holds nothing; monitor_eig_free is still safe). */
int monitor_eig_init(struct monitor_eig *e, size_t n, double *a);

/* Frees e's buffers (a zeroed e is fine). */
void monitor_eig_free(struct monitor_eig *e);

/* Eigenvalues of the symmetric m x m matrix a (lower triangle read,
 * overwritten; column-major, leading dimension m; m <= e's n) into e->w,
 * ascending. Returns 0 or -EDOM (dsyev did not converge). */
int monitor_eig_solve(struct monitor_eig *e, size_t m, double *a);

#endif
