/* Spectrum scalars (entropies, effective and stable rank, norms, rank) from
 * squared singular values, cleaned the same way for every caller. See spectrum.h. */
#include "spectrum.h"

#include <errno.h>
#include <float.h>
#include <math.h>

/* One reader for both element types keeps the f32 and f64 paths identical,
 * bit for bit, once a value is widened. */
struct values {
    const double *d;
    const float *f;
};

static double value_at(struct values v, size_t i)
{
    return v.d ? v.d[i] : (double)v.f[i];
}

double spectrum_drop_floor(double s_max, size_t matrix_size)
{
    return s_max * (double)matrix_size * DBL_EPSILON;
}

static int scalars(struct values v, size_t count, size_t matrix_size, struct spectrum_scalars *out)
{
    if (!out)
        return -EINVAL;
    *out = (struct spectrum_scalars){0};
    if (count > 0 && !v.d && !v.f)
        return -EINVAL;
    if (count > SPECTRUM_MAX_VALUES || matrix_size > SPECTRUM_MAX_VALUES)
        return -E2BIG;
    if (matrix_size < count)
        matrix_size = count;

    double s_max = 0.0;
    for (size_t i = 0; i < count; i++) {
        double x = value_at(v, i);
        if (!isfinite(x))
            return -EDOM;
        if (x > s_max)
            s_max = x;
    }
    if (!(s_max > 0.0))
        return 0;

    double floor = spectrum_drop_floor(s_max, matrix_size);
    /* Normalised by s_max: every term is in [0, 1], sums are <= count. */
    double sum2 = 0.0, sum1 = 0.0;
    unsigned r = 0;
    for (size_t i = 0; i < count; i++) {
        double x = value_at(v, i);
        if (x < floor)
            continue;
        double u = x / s_max;
        sum2 += u;
        sum1 += sqrt(u);
        r++;
    }
    double h2 = 0.0, h1 = 0.0;
    for (size_t i = 0; i < count; i++) {
        double x = value_at(v, i);
        if (x < floor)
            continue;
        double u = x / s_max;
        double p2 = u / sum2, p1 = sqrt(u) / sum1;
        if (p2 > 0.0)
            h2 -= p2 * log(p2);
        if (p1 > 0.0)
            h1 -= p1 * log(p1);
    }
    out->present = true;
    out->rank = r;
    out->entropy2 = h2;
    out->entropy1 = h1;
    out->erank2 = exp(h2);
    out->erank1 = exp(h1);
    out->srank = sum2;
    out->smax = sqrt(s_max);
    out->fro = sqrt(sum2) * out->smax;
    return 0;
}

int spectrum_scalars_f64(const double *s, size_t count, size_t matrix_size,
                         struct spectrum_scalars *out)
{
    return scalars((struct values){.d = s}, count, matrix_size, out);
}

int spectrum_scalars_f32(const float *s, size_t count, size_t matrix_size,
                         struct spectrum_scalars *out)
{
    return scalars((struct values){.f = s}, count, matrix_size, out);
}
