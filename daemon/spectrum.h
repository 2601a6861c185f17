#ifndef FORESHOCK_SPECTRUM_H
#define FORESHOCK_SPECTRUM_H

#include <stdbool.h>
#include <stddef.h>

/* Scalars from a spectrum of squared singular values s_i = sigma_i^2
 * (docs/monitors.md section 1.3). Pure: no I/O, no allocation, no state;
 * any thread may call these at any time.
 *
 * Cleaning, in this order (the same for every caller, so the Gram path and
 * the spectrum-sketch path give the same series):
 *   1. any non-finite value: -EDOM, the result is absent;
 *   2. s_max = max s_i; s_max <= 0 (all zero, empty, or only negatives):
 *      the result is absent (not 0, not NaN) and the call returns 0;
 *   3. values below s_max * m * DBL_EPSILON are dropped, m = matrix_size
 *      (the side of the matrix the spectrum came from, at least `count`);
 *      this also drops negatives, i.e. negatives are clamped to 0.
 * The r values left give (p_i over the kept values only):
 *   entropy2 = H_2 = -sum p_i ln p_i, p_i = s_i / sum s          (nats)
 *   entropy1 = H_1 = -sum p_i ln p_i, p_i = sigma_i / sum sigma  (nats)
 *   erank2 = exp(H_2), erank1 = exp(H_1)       (in [1, r])
 *   srank  = sum s_i / s_max                   (stable rank)
 *   fro    = sqrt(sum s_i),  smax = sqrt(s_max)
 *   rank   = r
 * Sums run over s_i / s_max, so values near DBL_MAX do not overflow. */

#define SPECTRUM_MAX_VALUES 65536u /* longest spectrum accepted (-E2BIG) */

struct spectrum_scalars {
    bool present;  /* false: no spectrum (all zero / empty / non-finite) */
    unsigned rank; /* r, values kept after cleaning */
    double entropy2;
    double entropy1;
    double erank2;
    double erank1;
    double srank;
    double fro;
    double smax;
};

/* The drop floor of step 3: values below it do not count. Pure. */
double spectrum_drop_floor(double s_max, size_t matrix_size);

/* Scalars of `count` double values `s` (any order). `out` is always written
 * (absent on any error). Returns 0, -EINVAL (NULL out, or NULL s with count
 * > 0), -E2BIG (count or matrix_size above SPECTRUM_MAX_VALUES) or -EDOM (a
 * non-finite value). Reads s, keeps no pointer. Any thread. */
int spectrum_scalars_f64(const double *s, size_t count, size_t matrix_size,
                         struct spectrum_scalars *out);

/* Same for float values as they arrive in a SpectrumSketch; each value is
 * widened to double before use. Any thread. */
int spectrum_scalars_f32(const float *s, size_t count, size_t matrix_size,
                         struct spectrum_scalars *out);

#endif
