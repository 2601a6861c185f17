#ifndef FORESHOCK_CLI_SIMULATE_H
#define FORESHOCK_CLI_SIMULATE_H

/* `foreshock simulate`: pieces shared by the rank driver (simulate.c) and
 * the scenarios (scenario.c). A scenario is a small table entry of pure
 * functions that shape the loss curve, the learning rate and the weight
 * updates; adding one (attention-numerics, lr-spike, ...) is adding an entry. */

#include <stddef.h>
#include <stdint.h>

/* Per-rank random numbers (splitmix64 + Box-Muller); no shared state. */
struct sim_rng {
    uint64_t s;
    int has_spare;
    double spare;
};

void sim_rng_seed(struct sim_rng *r, uint64_t seed);
double sim_uniform(struct sim_rng *r); /* [0, 1) */
double sim_normal(struct sim_rng *r);  /* N(0, 1) */

/* What a scenario may look at. */
struct sim_params {
    uint64_t steps;
    uint32_t ranks, layers, heads, dh, d;
};

struct scenario {
    const char *name;
    const char *help;
    /* Noise-free loss at `step`. */
    double (*loss)(const struct sim_params *p, uint64_t step);
    /* Learning rate at `step`, and the rate at which one step moves each
     * weight by the simulator's nominal update size. */
    double (*lr)(const struct sim_params *p, uint64_t step);
    double lr_ref;
    /* Adds the accumulated update of one weight block (a head's Wq or Wk
     * shard, rows x cols, row-major) over steps [from, to) to w. `scale` is
     * the standard deviation a random walk with this scenario's learning
     * rates accumulates per element over the interval. `is_k`: 0 for Wq,
     * 1 for Wk. The rng is the rank's own. */
    void (*update)(const struct sim_params *p, struct sim_rng *rng, uint32_t layer, uint32_t head,
                   int is_k, uint64_t from, uint64_t to, double scale, float *w, size_t rows,
                   size_t cols);
};

/* The scenario called `name`, or NULL. */
const struct scenario *scenario_find(const char *name);

/* Comma-separated names, for help and errors. Static storage. */
const char *scenario_names(void);

#endif
