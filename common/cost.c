/* cost.c — see cost.h. */
#include "common/cost.h"

#include <errno.h>

double rekv_linear_eval(const rekv_linear *m, double n)
{
    return n > 0 ? m->a + m->b * n : 0.0;
}

int rekv_linear_fit(const double *xs, const double *ys, size_t n, double *a, double *b,
                    rekv_err *err)
{
    if (!xs || !ys || !a || !b)
        return rekv_errf(err, -EINVAL, "linear fit: NULL argument");
    if (n < 2)
        return rekv_errf(err, -EINVAL, "linear fit: %zu samples, need at least 2", n);
    /* Centred sums: token counts in the thousands make sum(x^2) - n*mean^2 cancel badly. */
    double mx = 0, my = 0;
    for (size_t i = 0; i < n; i++) {
        mx += xs[i];
        my += ys[i];
    }
    mx /= (double)n;
    my /= (double)n;
    double sxx = 0, sxy = 0;
    for (size_t i = 0; i < n; i++) {
        double dx = xs[i] - mx;
        sxx += dx * dx;
        sxy += dx * (ys[i] - my);
    }
    if (!(sxx > 0))
        return rekv_errf(err, -EINVAL, "linear fit: all %zu samples have the same x", n);
    *b = sxy / sxx;
    *a = my - *b * mx;
    return 0;
}
