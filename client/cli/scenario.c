/* Simulation scenarios: how loss, learning rate and weights evolve. Pure
 * functions of their arguments (the rng is the caller's). */
#include <math.h>
#include <string.h>

#include "simulate.h"

#define LR_PEAK 3e-4
#define LR_FLOOR 3e-5

void sim_rng_seed(struct sim_rng *r, uint64_t seed)
{
    r->s = seed;
    r->has_spare = 0;
}

static uint64_t next64(struct sim_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double sim_uniform(struct sim_rng *r)
{
    return (double)(next64(r) >> 11) * (1.0 / 9007199254740992.0);
}

double sim_normal(struct sim_rng *r)
{
    double u, v, s;

    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    do { /* Marsaglia's polar method */
        u = 2.0 * sim_uniform(r) - 1.0;
        v = 2.0 * sim_uniform(r) - 1.0;
        s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    s = sqrt(-2.0 * log(s) / s);
    r->spare = v * s;
    r->has_spare = 1;
    return u * s;
}

/* ---- healthy: the baseline every detector must stay quiet on ----------------------- */

/* Loss decays from ~10 towards 2 over the run. */
static double healthy_loss(const struct sim_params *p, uint64_t step)
{
    double tau = p->steps > 5 ? (double)p->steps / 5.0 : 1.0;
    return 2.0 + 8.0 * exp(-(double)step / tau);
}

/* Linear warm-up over the first 10% (at most 1000 steps), then cosine decay
 * to LR_FLOOR. */
static double healthy_lr(const struct sim_params *p, uint64_t step)
{
    uint64_t warm = p->steps / 10 < 1000 ? p->steps / 10 : 1000;
    double frac;

    if (warm && step < warm)
        return LR_PEAK * (double)(step + 1) / (double)warm;
    frac = p->steps > warm ? (double)(step - warm) / (double)(p->steps - warm) : 1.0;
    if (frac > 1.0)
        frac = 1.0;
    return LR_FLOOR + 0.5 * (LR_PEAK - LR_FLOOR) * (1.0 + cos(M_PI * frac));
}

/* Independent Gaussian steps: the update spectrum stays spread out. */
static void healthy_update(const struct sim_params *p, struct sim_rng *rng, uint32_t layer,
                           uint32_t head, int is_k, uint64_t from, uint64_t to, double scale,
                           float *w, size_t rows, size_t cols)
{
    (void)p, (void)layer, (void)head, (void)is_k, (void)from, (void)to;
    for (size_t i = 0; i < rows * cols; i++)
        w[i] += (float)(scale * sim_normal(rng));
}

static const struct scenario scenarios[] = {
    {.name = "healthy",
     .help = "decaying loss, warm-up + cosine learning rate, random weight updates",
     .loss = healthy_loss,
     .lr = healthy_lr,
     .lr_ref = LR_PEAK,
     .update = healthy_update},
};

const struct scenario *scenario_find(const char *name)
{
    for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++)
        if (!strcmp(scenarios[i].name, name))
            return &scenarios[i];
    return NULL;
}

const char *scenario_names(void)
{
    return "healthy";
}
