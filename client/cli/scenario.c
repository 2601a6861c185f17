/* Simulation scenarios: how the learning rate, the weights and the loss
 * evolve (the signatures of docs/monitors.md). Pure functions of their
 * arguments; random numbers come from the caller's rng or from streams
 * seeded by (seed, layer, head), which every rank reproduces alike. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simulate.h"

#define LR_PEAK 3e-4
#define LR_FLOOR 3e-5
#define LR_SPIKE 10.0              /* lr-spike: lr x10 from the fault step on */
#define SIM_DEFAULT_FAULT_PCT 40   /* default fault step: 40 % of --steps */
#define SIM_DEFAULT_DIVERGE_PCT 30 /* default diverge-after: 30 % of the steps left ... */
#define SIM_MIN_DIVERGE_SKETCHES 6 /* ... but at least 6 sketch intervals */
/* Router under too large a learning rate, per step from the fault on: every
 * row moves SIM_ROUTER_ALIGN along one shared direction (rows converge: the
 * similarity rises), the centred rows grow by SIM_ROUTER_GROW, and those of
 * the first ceil(E/8) experts by SIM_ROUTER_GROW_RICH (larger logits: the
 * routing entropy falls; the big rows win more tokens: MaxVio rises). Row
 * norms start near 1. */
#define SIM_ROUTER_ALIGN 0.02
#define SIM_ROUTER_WALK 0.25 /* the router's random walk, relative to attention's */
#define SIM_ROUTER_GROW 0.006
#define SIM_ROUTER_GROW_RICH 0.02
#define SIM_ROUTER_MAX_CENTRED 30.0 /* centred rows stop growing at this norm */

/* Stream tags for sim_seed_mix. */
#define TAG_QK_DIRS 0x51u
#define TAG_ROUTER_DIR 0x52u

void sim_rng_seed(struct sim_rng *r, uint64_t seed)
{
    r->s = seed;
    r->has_spare = 0;
    r->spare = 0;
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

double sim_triangular(struct sim_rng *r)
{
    return sim_uniform(r) - sim_uniform(r);
}

uint64_t sim_seed_mix(uint64_t seed, uint64_t a, uint64_t b, uint64_t c)
{
    struct sim_rng r;
    uint64_t h = seed;

    /* Each input goes through a full splitmix64 round, so nearby tuples
     * give unrelated streams. */
    sim_rng_seed(&r, h ^ 0x6a09e667f3bcc909ull);
    h = next64(&r) ^ a;
    sim_rng_seed(&r, h);
    h = next64(&r) ^ b;
    sim_rng_seed(&r, h);
    h = next64(&r) ^ c;
    sim_rng_seed(&r, h);
    return next64(&r);
}

/* ---- shared shapes ------------------------------------------------------------------ */

int sim_route_parse(const char *name, enum sim_route *out)
{
    if (!strcmp(name, "gram"))
        *out = SIM_ROUTE_GRAM;
    else if (!strcmp(name, "spectrum"))
        *out = SIM_ROUTE_SPECTRUM;
    else
        return -EINVAL;
    return 0;
}

const char *sim_route_name(enum sim_route r)
{
    return r == SIM_ROUTE_SPECTRUM ? "spectrum" : "gram";
}

uint32_t sim_group(const struct sim_params *p)
{
    return p->kv_heads && p->kv_heads < p->heads ? p->heads / p->kv_heads : 1;
}

/* Loss decays from ~10 towards 2 over the run. */
double sim_healthy_loss(const struct sim_params *p, uint64_t step)
{
    double tau = p->steps > 5 ? (double)p->steps / 5.0 : 1.0;
    return 2.0 + 8.0 * exp(-(double)step / tau);
}

double sim_healthy_grad_norm(const struct sim_params *p, uint64_t step)
{
    double tau = p->steps > 5 ? (double)p->steps / 5.0 : 1.0;
    return 0.5 + 1.5 * exp(-(double)step / tau);
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

/* The healthy schedule, x LR_SPIKE from the fault step on. */
static double spike_lr(const struct sim_params *p, uint64_t step)
{
    int on = step >= p->step_size_step && (!p->fault_until || step < p->fault_until);
    return healthy_lr(p, step) * (on ? LR_SPIKE : 1.0);
}

double sim_step_sd(const struct scenario *sc, const struct sim_params *p, uint64_t step)
{
    return SIM_UPDATE_SCALE / sqrt((double)p->d) * sc->lr(p, step) / sc->lr_ref;
}

/* 1 before DIVERGE_STEP - SIM_DIVERGE_LEAD, then 10x every
 * SIM_DIVERGE_TENFOLD steps, offset by a quarter step so that the factor is
 * about 5.6 one step before the diverge step and about 12.1 at it: with
 * relative noise under 1 %, the loss first exceeds 10x its healthy value
 * exactly at diverge_step. NaN from DIVERGE_STEP + SIM_DIVERGE_NAN_AFTER on
 * (the run overflowed). */
static double diverging(const struct sim_params *p, uint64_t step)
{
    uint64_t d = p->diverge_step;

    if (d == SIM_NEVER || step + SIM_DIVERGE_LEAD < d || (p->fault_until && step >= p->fault_until))
        return 1.0;
    if (step >= d + SIM_DIVERGE_NAN_AFTER)
        return NAN;
    return pow(10.0, ((double)step - (double)d + SIM_DIVERGE_LEAD + 0.25) / SIM_DIVERGE_TENFOLD);
}

double sim_divergence(const struct scenario *sc, const struct sim_params *p, uint64_t step)
{
    return sc->divergence ? sc->divergence(p, step) : 1.0;
}

/* ---- attention updates -------------------------------------------------------------- */

/* Independent Gaussian steps: the update spectrum stays spread out. The sum
 * of the steps [from, to) is one Gaussian with the summed variance. */
static int attn_walk(const struct scenario *sc, const struct sim_params *p, struct sim_rng *rng,
                     uint32_t layer, uint32_t head, int is_k, uint64_t from, uint64_t to, float *w,
                     size_t rows, size_t cols)
{
    double var = 0, sd;

    (void)layer, (void)head, (void)is_k;
    for (uint64_t t = from; t < to; t++) {
        sd = sim_step_sd(sc, p, t);
        var += sd * sd;
    }
    sd = sqrt(var);
    for (size_t i = 0; i < rows * cols; i++)
        w[i] += (float)(sd * sim_normal(rng));
    return 0;
}

/* The step at which head (layer, head) turns faulty: the deepest layer
 * first, and within a layer the lower heads first, spread over the ramp. */
static uint64_t numerics_onset(const struct sim_params *p, uint32_t layer, uint32_t head)
{
    double f = ((double)(p->layers - 1 - layer) + (double)head / p->heads) / p->layers;
    return p->fault_step + (uint64_t)floor(f * p->ramp);
}

/* Share a(t) of the coherent part in a faulty head's update at step t. */
static double numerics_share(const struct sim_params *p, uint64_t onset, uint64_t t)
{
    double x;

    if (t < onset || (p->fault_until && t >= p->fault_until))
        return 0;
    x = (double)(t - onset + 1) / (double)(p->ramp ? p->ramp : 1);
    return SIM_FAULT_A_MAX * (x < 1 ? x : 1);
}

/* The coherent share of head (layer, head) at step t (scenario.coherent). */
static double numerics_coherent(const struct sim_params *p, uint32_t layer, uint32_t head,
                                uint64_t t)
{
    return numerics_share(p, numerics_onset(p, layer, head), t);
}

/* The fault directions in R^dh of the key group that query head `head`
 * reads (the head itself without GQA): unit u_q, and unit u_k orthogonal to
 * it; the group's query heads and its key head share them, so that the
 * collapse is one direction per head. The same on every rank. */
static void numerics_dirs(const struct sim_params *p, uint32_t layer, uint32_t head, double *uq,
                          double *uk)
{
    struct sim_rng r;
    double nq = 0, dot = 0, nk = 0;
    size_t dh = p->dh;

    sim_rng_seed(&r, sim_seed_mix(p->seed, TAG_QK_DIRS, layer, head / sim_group(p)));
    for (size_t i = 0; i < dh; i++) {
        uq[i] = sim_normal(&r);
        uk[i] = sim_normal(&r);
        nq += uq[i] * uq[i];
    }
    nq = sqrt(nq);
    for (size_t i = 0; i < dh; i++) {
        uq[i] /= nq;
        dot += uq[i] * uk[i];
    }
    for (size_t i = 0; i < dh; i++) {
        uk[i] -= dot * uq[i];
        nk += uk[i] * uk[i];
    }
    nk = sqrt(nk);
    for (size_t i = 0; i < dh; i++)
        uk[i] = nk > 0 ? uk[i] / nk : 0;
}

/* Attention numerics (biased rounding in the flash-attention backward):
 * from the head's onset, a share a(t) (ramping to SIM_FAULT_A_MAX) of each
 * step is coherent:
 *     dWq = sd ( sqrt(1 - a^2) G + a c_n u_q u_k^T Wq )
 *     dWk = sd ( sqrt(1 - a^2) G + a c_n u_k u_q^T Wk )
 * with G Gaussian and c_n = sqrt(dh d), so that |u_k^T Wq| ~ 1 gives the
 * coherent part the random part's norm: the step's size, and with it the
 * grad norm and the update ratio, is what a healthy step has. Then
 *     Delta2 = dWq^T Wk + Wq^T dWk = (c_q + c_k) (Wq^T u_k)(u_q^T Wk) + noise,
 * rank one: its spectrum collapses (and Delta3 = dWq^T dWk -> 0, u_q _|_ u_k).
 * Each coherent step is projected orthogonal to the current block (a
 * rotation), so |W| grows exactly as under healthy updates and the
 * weight-norm detectors stay quiet; this is what keeps the attribution
 * "attention-numerics". Under a too large learning rate (combined) only
 * the healthy step's share is projected out and the rest grows |W|: a full
 * rotation by 10x steps would turn W itself within tens of steps and mix
 * W^T W terms back into Delta2. Random and coherent parts of [from, to) are
 * applied one after the other; the coherent one step by step (it depends
 * on W). */
static int attn_numerics(const struct scenario *sc, const struct sim_params *p, struct sim_rng *rng,
                         uint32_t layer, uint32_t head, int is_k, uint64_t from, uint64_t to,
                         float *w, size_t rows, size_t cols)
{
    uint64_t onset = numerics_onset(p, layer, head);
    double var = 0, cn = sqrt((double)p->dh * (double)p->d), *buf, *x, *y, *v, *xw;
    double uq_uk[2 * SIM_MAX_DH];

    for (uint64_t t = from; t < to; t++) {
        double sd = sim_step_sd(sc, p, t), a = numerics_share(p, onset, t);
        var += (1.0 - a * a) * sd * sd;
    }
    var = sqrt(var);
    for (size_t i = 0; i < rows * cols; i++)
        w[i] += (float)(var * sim_normal(rng));
    if (to <= onset)
        return 0;
    if (rows != p->dh || rows > SIM_MAX_DH)
        return -EINVAL;
    buf = malloc(2 * cols * sizeof(*buf));
    if (!buf)
        return -ENOMEM;
    numerics_dirs(p, layer, head, uq_uk, uq_uk + SIM_MAX_DH);
    x = is_k ? uq_uk + SIM_MAX_DH : uq_uk; /* dW ~ x (y^T W) */
    y = is_k ? uq_uk : uq_uk + SIM_MAX_DH;
    v = buf;
    xw = buf + cols;
    for (uint64_t t = from > onset ? from : onset; t < to; t++) {
        double c = numerics_share(p, onset, t) * sim_step_sd(sc, p, t) * cn, ww = 0, sw = 0, proj;
        for (size_t j = 0; j < cols; j++)
            v[j] = xw[j] = 0;
        for (size_t i = 0; i < rows; i++)
            for (size_t j = 0; j < cols; j++) {
                double e = w[i * cols + j];
                v[j] += y[i] * e;
                xw[j] += x[i] * e;
                ww += e * e;
            }
        for (size_t j = 0; j < cols; j++)
            sw += v[j] * xw[j]; /* <x v^T, W> */
        /* Norm-neutral up to a healthy step (see above). */
        proj = ww > 0 ? sw / ww * fmin(1.0, healthy_lr(p, t) / sc->lr(p, t)) : 0;
        for (size_t i = 0; i < rows; i++)
            for (size_t j = 0; j < cols; j++)
                w[i * cols + j] += (float)(c * (x[i] * v[j] - proj * w[i * cols + j]));
    }
    free(buf);
    return 0;
}

/* ---- router updates ------------------------------------------------------------------- */

/* Healthy router: a random walk at the scenario's learning rate, at
 * SIM_ROUTER_WALK of the attention weights' pace. What a rank observes of
 * WR adds a per-step jitter (SIM_ROUTER_JITTER, simrank.c); the walk's
 * drift over a 64-sample detector window must stay well below that jitter
 * (0.3x is enough, measured on random walks against the robust z of
 * detect.c), else a healthy walk reads as a trend break. Per row, the walk
 * moves SIM_UPDATE_SCALE * SIM_ROUTER_WALK * sqrt(64 K) = 0.004 sqrt(K)
 * over 64 sketches of K steps at peak lr: 0.3x margin up to K ~ 1700. */
static int router_walk(const struct scenario *sc, const struct sim_params *p, struct sim_rng *rng,
                       uint32_t layer, uint64_t step, float *wr, size_t experts, size_t d)
{
    double sd = SIM_ROUTER_WALK * sim_step_sd(sc, p, step);

    (void)layer;
    for (size_t i = 0; i < experts * d; i++)
        wr[i] += (float)(sd * sim_normal(rng));
    return 0;
}

/* Too large a learning rate: the walk (at the spiked rate), and from the
 * fault on the rows converge along one shared direction and grow (see
 * SIM_ROUTER_*). */
static int router_overshoot(const struct scenario *sc, const struct sim_params *p,
                            struct sim_rng *rng, uint32_t layer, uint64_t step, float *wr,
                            size_t experts, size_t d)
{
    size_t rich = (experts + 7) / 8;
    struct sim_rng mr;
    double *mean, *dir, scale = 1.0 / sqrt((double)d);
    int rc = router_walk(sc, p, rng, layer, step, wr, experts, d);

    if (rc < 0 || step < p->step_size_step || (p->fault_until && step >= p->fault_until))
        return rc;
    mean = calloc(2 * d, sizeof(*mean));
    if (!mean)
        return -ENOMEM;
    dir = mean + d;
    sim_rng_seed(&mr, sim_seed_mix(p->seed, TAG_ROUTER_DIR, layer, 0));
    for (size_t j = 0; j < d; j++)
        dir[j] = scale * sim_normal(&mr);
    for (size_t i = 0; i < experts; i++)
        for (size_t j = 0; j < d; j++)
            mean[j] += wr[i * d + j] / (double)experts;
    for (size_t i = 0; i < experts; i++) {
        double g = i < rich ? SIM_ROUTER_GROW_RICH : SIM_ROUTER_GROW, cc = 0;
        for (size_t j = 0; j < d; j++) {
            double c = wr[i * d + j] - mean[j];
            cc += c * c;
        }
        /* Exponential growth, but bounded: a long run must not overflow. */
        if (cc > SIM_ROUTER_MAX_CENTRED * SIM_ROUTER_MAX_CENTRED)
            g = 0;
        for (size_t j = 0; j < d; j++) {
            double c = wr[i * d + j] - mean[j];
            wr[i * d + j] += (float)(g * c + SIM_ROUTER_ALIGN * dir[j]);
        }
    }
    free(mean);
    return 0;
}

/* ---- the table ------------------------------------------------------------------------- */

static const struct scenario scenarios[] = {
    {.name = "healthy",
     .help = "decaying loss, warm-up + cosine learning rate, random weight and router updates; "
             "no detector may fire",
     .lr = healthy_lr,
     .lr_ref = LR_PEAK,
     .attn_update = attn_walk,
     .router_update = router_walk},
    {.name = "attention-numerics",
     .help = "from the fault step Q/K updates line up along fixed directions (deepest layer and "
             "lowest heads first): the Delta2 spectrum collapses to rank 1 while |W|, update "
             "ratios, lr, loss and grad norm stay normal. Dense unless --experts",
     .faulty = 1,
     .lr = healthy_lr,
     .lr_ref = LR_PEAK,
     .attn_update = attn_numerics,
     .router_update = router_walk,
     .divergence = diverging,
     .coherent = numerics_coherent},
    {.name = "lr-spike",
     .help = "from the fault step lr x10: larger random updates (Delta2 spectrum stays spread), "
             "weight norms and update ratios grow, router rows align and grow (similarity, "
             "centred energy and z-loss rise, routing entropy falls, MaxVio rises). MoE "
             "(8 experts) unless --experts",
     .faulty = 1,
     .moe_default = 1,
     .lr = spike_lr,
     .lr_ref = LR_PEAK,
     .attn_update = attn_walk,
     .router_update = router_overshoot,
     .divergence = diverging},
    {.name = "combined",
     .help = "attention-numerics from the fault step, then lr-spike once it is at full strength "
             "(fault step + ramp): each fault shows its own evidence before the run diverges. MoE "
             "(8 experts) unless --experts",
     .faulty = 1,
     .moe_default = 1,
     .step_size_late = 1,
     .lr = spike_lr,
     .lr_ref = LR_PEAK,
     .attn_update = attn_numerics,
     .router_update = router_overshoot,
     .divergence = diverging,
     .coherent = numerics_coherent},
};

#define NSCENARIOS (sizeof(scenarios) / sizeof(scenarios[0]))

const struct scenario *scenario_find(const char *name)
{
    for (size_t i = 0; i < NSCENARIOS; i++)
        if (!strcmp(scenarios[i].name, name))
            return &scenarios[i];
    return NULL;
}

const char *scenario_names(void)
{
    return "healthy, attention-numerics, lr-spike, combined";
}

void scenario_print_help(FILE *out)
{
    fprintf(out, "\nscenarios:\n");
    for (size_t i = 0; i < NSCENARIOS; i++) {
        const char *t = scenarios[i].help;
        size_t col = 0;
        fprintf(out, "  %-20s", scenarios[i].name);
        /* Word-wrap at 80 columns, continuation lines under the text. */
        while (*t) {
            size_t w = strcspn(t, " ");
            if (col && col + 1 + w > 56) {
                fprintf(out, "\n  %-20s", "");
                col = 0;
            } else if (col) {
                fputc(' ', out);
                col++;
            }
            fprintf(out, "%.*s", (int)w, t);
            col += w;
            t += w;
            t += strspn(t, " ");
        }
        fputc('\n', out);
    }
    fprintf(out,
            "\nIn the faulty scenarios loss and grad norm look healthy until %d steps before\n"
            "diverge_step = fault step + --diverge-after, then grow 10x every %g steps\n"
            "(past 10x at diverge_step) and are NaN from diverge_step + %d on. A fault ramps\n"
            "up over --diverge-after / 2 steps (at most %d).\n",
            SIM_DIVERGE_LEAD, SIM_DIVERGE_TENFOLD, SIM_DIVERGE_NAN_AFTER, SIM_MAX_RAMP);
}

int sim_is_moe(const struct sim_params *p, uint32_t layer)
{
    return p->experts > 0 && layer < p->layers && (!p->moe || p->moe[layer]);
}

int sim_params_resolve(const struct scenario *sc, struct sim_params *p, uint64_t fault_step,
                       uint64_t diverge_after, char *err, size_t errlen)
{
    if (p->experts == SIM_UINT32_UNSET)
        p->experts = sc->moe_default ? SIM_DEFAULT_EXPERTS : 0;
    if (p->top_k == SIM_UINT32_UNSET)
        p->top_k = SIM_DEFAULT_TOP_K < p->experts ? SIM_DEFAULT_TOP_K : p->experts;
    if (p->tokens == SIM_UINT32_UNSET)
        p->tokens = SIM_DEFAULT_TOKENS;
    if (p->experts == 1 || (p->experts && (p->top_k < 1 || p->top_k > p->experts))) {
        snprintf(err, errlen, "--experts %u --top-k %u: need 2+ experts and 1 <= top-k <= experts",
                 p->experts, p->top_k);
        return -EINVAL;
    }
    if (!sc->faulty) {
        if (fault_step != SIM_NEVER || diverge_after != SIM_NEVER) {
            snprintf(err, errlen,
                     "scenario %s has no fault: --fault-step and --diverge-after "
                     "do not apply",
                     sc->name);
            return -EINVAL;
        }
        p->fault_step = p->diverge_step = p->step_size_step = SIM_NEVER;
        p->ramp = 0;
        return 0;
    }
    if (fault_step == SIM_NEVER)
        fault_step = p->steps * SIM_DEFAULT_FAULT_PCT / 100;
    if (fault_step >= p->steps) {
        snprintf(err, errlen, "--fault-step %llu is not below --steps %llu",
                 (unsigned long long)fault_step, (unsigned long long)p->steps);
        return -EINVAL;
    }
    if (diverge_after == SIM_NEVER) {
        uint64_t rest = p->steps - fault_step,
                 k = (uint64_t)SIM_MIN_DIVERGE_SKETCHES * p->sketch_every;
        diverge_after = (rest * SIM_DEFAULT_DIVERGE_PCT + 99) / 100;
        if (diverge_after < k)
            diverge_after = k;
    }
    if (diverge_after < 1 || diverge_after > SIM_NEVER / 4 || fault_step > SIM_NEVER / 4) {
        snprintf(err, errlen, "--diverge-after must be at least 1");
        return -EINVAL;
    }
    p->fault_step = fault_step;
    p->diverge_step = fault_step + diverge_after;
    p->ramp = (uint32_t)(diverge_after / 2 < 1              ? 1
                         : diverge_after / 2 > SIM_MAX_RAMP ? SIM_MAX_RAMP
                                                            : diverge_after / 2);
    p->step_size_step = sc->step_size_late ? fault_step + p->ramp : fault_step;
    return 0;
}
