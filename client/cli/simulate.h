#ifndef FORESHOCK_CLI_SIMULATE_H
#define FORESHOCK_CLI_SIMULATE_H

/* `foreshock simulate` in three pieces:
 *   scenario.c  the scenario table: pure functions that shape the learning
 *               rate, the weight updates and the loss (plus the rng);
 *   simrank.c   one simulated rank: its weights, router and tokens, turned
 *               into scalars and sketches handed to a sink. No I/O, no
 *               clock, no threads: tests/unit/test_scenario.c runs it
 *               against the daemon's monitor code;
 *   simulate.c  the command: options, one thread and one libforeshock
 *               client per rank, a sink that fills reports.
 * Adding a scenario is adding a table entry in scenario.c.
 *
 * Threads: nothing here has global state. The scenario functions and
 * sim_params_resolve are pure and may run on any thread; an rng, a
 * sim_params being resolved and a sim_rank each belong to one thread. */

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "foreshock.h"

#define SIM_NEVER UINT64_MAX /* fault_step / diverge_step of a run without one */

/* Per-step update of every weight element, relative to its initial std
 * (1/sqrt(d)), at the scenario's reference learning rate. */
#define SIM_UPDATE_SCALE 0.002
#define SIM_DEFAULT_EXPERTS 8 /* MoE scenarios without --experts */
#define SIM_DEFAULT_TOP_K 2
#define SIM_DEFAULT_TOKENS 256 /* routed tokens per rank, MoE layer and step */
#define SIM_FAULT_A_MAX 0.95   /* attention-numerics: final share of the coherent update */
#define SIM_MAX_RAMP 50        /* longest fault ramp, steps */
#define SIM_MAX_DH 512         /* largest head dim (FSC_MAX_DH) */
#define SIM_MAX_SNAPSHOTS 64   /* window / sketch_every + 2: the windows accepted */
#define SIM_MAX_FLOATS_PER_RANK ((size_t)1 << 28) /* 1 GiB of simulated weights per rank */
#define SIM_MAX_REPORT_BYTES ((size_t)60 << 20)   /* below the daemon's 64 MiB frames */
/* The loss: from DIVERGE_STEP - SIM_DIVERGE_LEAD on it grows 10x every
 * SIM_DIVERGE_TENFOLD steps, crossing 10x its healthy value exactly at the
 * diverge step (the relative noise is below 1 %), and is NaN from
 * DIVERGE_STEP + SIM_DIVERGE_NAN_AFTER on. */
#define SIM_DIVERGE_LEAD 3
#define SIM_DIVERGE_TENFOLD 3.0
#define SIM_DIVERGE_NAN_AFTER 12
#define SIM_ROUTER_JITTER 0.05 /* router rows as observed: +-5 % jitter per step (simrank.c) */
#define SIM_LOSS_NOISE 0.01    /* bounded relative noise of loss (triangular) */
#define SIM_GRAD_NOISE 0.03    /* same for grad norm */

/* Per-rank random numbers (splitmix64 + polar Box-Muller); no shared state. */
struct sim_rng {
    uint64_t s;
    int has_spare;
    double spare;
};

void sim_rng_seed(struct sim_rng *r, uint64_t seed);
double sim_uniform(struct sim_rng *r);    /* [0, 1) */
double sim_normal(struct sim_rng *r);     /* N(0, 1) */
double sim_triangular(struct sim_rng *r); /* in (-1, 1), peak at 0: bounded noise */
/* A seed for the stream named by (seed, a, b, c): the same on every rank. */
uint64_t sim_seed_mix(uint64_t seed, uint64_t a, uint64_t b, uint64_t c);

/* What a rank sends per attention head (docs/monitors.md 1.1 and 1.2).
 *   SIM_ROUTE_GRAM      FSDP-style: every rank holds its slice of d of every
 *                       head's Wq and Wk (as floats that really evolve) and
 *                       sends partial Grams; the daemon sums and solves.
 *                       With sim_params.split_heads, tensor-parallel style
 *                       instead: every rank holds all of d of whole heads
 *                       (sim_rank_heads' blocks) and sends their whole
 *                       Grams (shard 0 of 1); the daemon solves each as it
 *                       comes. A head's weights then come from streams of
 *                       its own, so a head evolves alike whichever rank,
 *                       and however many ranks, hold it.
 *   SIM_ROUTE_SPECTRUM  tensor-parallel style: every rank holds whole heads
 *                       (query heads split over the ranks in contiguous
 *                       blocks per layer) and sends the spectra a trainer
 *                       would have solved. They are synthesised from the
 *                       scenario's update statistics, not from weights, so
 *                       that full 7B and 70B shapes fit in memory and in
 *                       CPU time (simrank.c says how). */
enum sim_route { SIM_ROUTE_GRAM = 0, SIM_ROUTE_SPECTRUM = 1 };

/* "gram" / "spectrum" <-> enum sim_route. parse returns 0 or -EINVAL. */
int sim_route_parse(const char *name, enum sim_route *out);
const char *sim_route_name(enum sim_route r);

/* Everything a simulated rank and a scenario may look at. Filled by the
 * caller, then completed by sim_params_resolve. */
struct sim_params {
    uint64_t steps, seed;
    uint32_t ranks, layers, heads, dh, d;
    uint32_t kv_heads; /* key/value heads (GQA); 0 or heads: plain multi-head */
    enum sim_route route;
    int split_heads;               /* Gram route: whole heads per rank, not a slice of d */
    uint32_t sketch_every, window; /* attention Gram cadence and window, steps */
    int sketches;                  /* 0: scalars only (no weights, router or tokens) */
    int layer_norms;               /* send per-layer |W| and update ratio */
    uint64_t fault_step;           /* first faulty step, SIM_NEVER for none */
    uint64_t diverge_step;         /* first step with loss > 10x healthy or NaN (may be >= steps) */
    uint64_t fault_until;          /* first healthy step after the fault; 0: it never stops */
    uint64_t step_size_step;       /* first step of a too-large-step fault (SIM_NEVER: none) */
    uint32_t ramp;                 /* steps a fault takes to reach full strength */
    uint32_t experts, top_k;       /* experts 0: dense model, no router */
    uint32_t tokens;               /* routed tokens per rank, MoE layer and step */
    const uint8_t *moe;            /* layers flags, 1 = MoE layer; NULL: all layers */
};

struct scenario {
    const char *name;
    const char *help;
    int faulty;      /* has a fault step and a diverge step */
    int moe_default; /* implies MoE (SIM_DEFAULT_EXPERTS) unless --experts says otherwise */
    /* The too-large-step part of the fault starts once the attention part
     * is at full strength (fault_step + ramp), not at the fault step. */
    int step_size_late;
    /* Learning rate at `step`; lr_ref is the rate at which one step moves
     * each weight by SIM_UPDATE_SCALE of its initial std. */
    double (*lr)(const struct sim_params *p, uint64_t step);
    double lr_ref;
    /* Applies the updates of steps [from, to) to one attention weight block
     * (a head's Wq or Wk shard, rows x cols, row-major, rows = dh). is_k: 0
     * for Wq, 1 for Wk; `head` is the query head, for Wk the first query
     * head of its key group. rng is the rank's own. Returns 0 or -ENOMEM. */
    int (*attn_update)(const struct scenario *sc, const struct sim_params *p, struct sim_rng *rng,
                       uint32_t layer, uint32_t head, int is_k, uint64_t from, uint64_t to,
                       float *w, size_t rows, size_t cols);
    /* Applies the update of step `step` to the whole router weight WR of a
     * MoE layer (experts x d, row-major). rng is the layer's, the same
     * stream on every rank, so every rank holds the same WR. Returns 0 or
     * -ENOMEM. */
    int (*router_update)(const struct scenario *sc, const struct sim_params *p, struct sim_rng *rng,
                         uint32_t layer, uint64_t step, float *wr, size_t experts, size_t d);
    /* Factor on loss and grad norm at `step`: 1, growing, or NaN. NULL: 1. */
    double (*divergence)(const struct sim_params *p, uint64_t step);
    /* The share a(t) in [0, 1) of the update of step t that attn_update
     * makes coherent in head (layer, head) (the key side of a group uses
     * its first query head); NULL: none. What the spectrum route
     * synthesises from. Pure. */
    double (*coherent)(const struct sim_params *p, uint32_t layer, uint32_t head, uint64_t t);
};

/* The scenario called `name`, or NULL. */
const struct scenario *scenario_find(const char *name);

/* Comma-separated names, for help and errors. Static storage. */
const char *scenario_names(void);

/* Prints every scenario with its help text (wrapped) for --help. */
void scenario_print_help(FILE *out);

/* Query heads per key head: heads / kv_heads (1 without GQA). */
uint32_t sim_group(const struct sim_params *p);

/* Completes p for scenario sc: fault_step (given, or SIM_NEVER to take the
 * default, 40 % of steps), diverge_step = fault_step + diverge_after (given,
 * or SIM_NEVER for the default max(30 % of the remaining steps, 6 sketch
 * intervals)), the ramp (diverge_after / 2 in 1..SIM_MAX_RAMP) and the MoE
 * step where a too-large step starts (the fault step; fault_step + ramp
 * for a scenario with step_size_late), the MoE
 * fields left at SIM_UINT32_UNSET: experts (the scenario's default: 0, or
 * SIM_DEFAULT_EXPERTS), top_k (SIM_DEFAULT_TOP_K, at most experts), tokens
 * (SIM_DEFAULT_TOKENS). A healthy scenario takes no fault options. Returns 0
 * or -EINVAL with the reason in err. Pure, any thread. */
#define SIM_UINT32_UNSET UINT32_MAX
int sim_params_resolve(const struct scenario *sc, struct sim_params *p, uint64_t fault_step,
                       uint64_t diverge_after, char *err, size_t errlen);

/* The healthy, noise-free loss and grad norm at `step`; faulty runs
 * multiply both by the scenario's divergence factor. */
double sim_healthy_loss(const struct sim_params *p, uint64_t step);
double sim_healthy_grad_norm(const struct sim_params *p, uint64_t step);

/* The scenario's factor on loss and grad norm at `step` (1 when none). */
double sim_divergence(const struct scenario *sc, const struct sim_params *p, uint64_t step);

/* Per-element standard deviation of one step's update at `step`:
 * SIM_UPDATE_SCALE / sqrt(d) * lr(step) / lr_ref. Pure. */
double sim_step_sd(const struct scenario *sc, const struct sim_params *p, uint64_t step);

/* 1 when `layer` has a router (MoE layer): experts > 0 and the moe flags
 * say so. */
int sim_is_moe(const struct sim_params *p, uint32_t layer);

/* ---- one simulated rank (simrank.c) ------------------------------------- */

struct sim_scalars {
    double loss, grad_norm, lr, loss_scale, step_time;
    /* |W(t) - W(t-1)| / |W(t-1)| over the attention weights, as the
     * Python client's step_ratio sends it; NAN: not sent (layer norms off). */
    double step_update_ratio;
    uint64_t tokens;
};

struct sim_tokens {
    uint64_t n_tok;
    double sum_h, sum_h2, sum_lse2;
    const uint64_t *load; /* experts values */
    const double *sum_p;  /* experts values */
};

/* Where a rank's output goes. Every callback returns 0 or a negative errno,
 * which stops the step and is returned by sim_rank_step. Arrays are only
 * valid during the call. NULL callbacks are skipped. */
struct sim_sink {
    void *ctx;
    int (*scalars)(void *ctx, uint64_t step, const struct sim_scalars *s);
    /* Gram route: partial Grams of one query head over this rank's shard
     * of d: upper triangles, fsc_tri_len(2 dh) floats each; kv_head is the
     * key head it reads (FSC_KV_HEAD_NONE without GQA). */
    int (*attention)(void *ctx, uint64_t step, uint32_t layer, uint32_t head, uint32_t kv_head,
                     uint32_t window, uint32_t dh, uint32_t shard_index, uint32_t shard_count,
                     const float *ga, const float *gb);
    /* Spectrum route: one whole query head's spectra (2dh, dh, 2dh, dh
     * values), four norms and c_qk, as fsc_report_add_attention_spectrum
     * takes them. */
    int (*spectrum)(void *ctx, uint64_t step, uint32_t layer, uint32_t head, uint32_t kv_head,
                    uint32_t window, const struct fsc_spectrum *s);
    /* Partial router Gram over this rank's shard: fsc_tri_len(experts) floats. */
    int (*router_gram)(void *ctx, uint64_t step, uint32_t layer, uint32_t experts,
                       uint32_t shard_index, uint32_t shard_count, const float *gr);
    int (*router_tokens)(void *ctx, uint64_t step, uint32_t layer, uint32_t experts,
                         const struct sim_tokens *t);
    /* Per attention layer: |W| of this rank's Wq and Wk shards, and the
     * update-to-weight ratio of this step (layers values each). */
    int (*layer_norms)(void *ctx, uint64_t step, const float *norm, const float *ratio,
                       size_t layers);
};

struct sim_rank;

/* A rank of a run described by p (resolved, see sim_params_resolve; p and
 * sc must outlive the rank). Its shard of d: rank * d / ranks, as evenly as
 * possible (the Gram route's attention weights unless split_heads, and
 * every route's router Grams); on the spectrum route and with split_heads
 * its query heads are sim_rank_heads' (and the key heads they read).
 * Returns 0 and *out, -EINVAL (rank >= ranks, d < ranks where d is
 * sharded, kv_heads not dividing heads) or -ENOMEM. Any thread; the rank
 * then belongs to that thread. */
int sim_rank_create(const struct scenario *sc, const struct sim_params *p, uint32_t rank,
                    struct sim_rank **out);

/* Produces step `step`'s output into sink. Steps must come in order 0, 1,
 * ..., each once. Per step: scalars and, unless p->sketches is 0, per MoE
 * layer router tokens; every sketch_every steps (step % sketch_every == 0)
 * router Grams and, with p->layer_norms, the layer norms; attention Grams
 * on those steps from step `window` on. Returns 0, -EINVAL (out of order,
 * or past p->steps) or the first negative value a callback returned.
 * Owner thread. */
int sim_rank_step(struct sim_rank *r, uint64_t step, const struct sim_sink *sink);

/* Frees the rank (NULL is fine). Owner thread. */
void sim_rank_destroy(struct sim_rank *r);

/* Floats the largest rank holds for weights, snapshots and routers, for
 * limit checks before creating one (0 when the count would overflow
 * size_t). The spectrum route holds no attention weights; with split_heads
 * a rank holds its heads' whole rows. */
size_t sim_rank_floats(const struct sim_params *p);

/* Spectrum route and split_heads: the query heads [*h0, *h1) of every
 * layer that `rank` holds: contiguous blocks, as even as possible, rank 0's
 * never empty;
 * with more ranks than heads the extra ranks hold none (they send
 * scalars and router statistics only). Pure. */
void sim_rank_heads(const struct sim_params *p, uint32_t rank, uint32_t *h0, uint32_t *h1);

/* Bytes of the largest report a rank sends (attention sketches, router
 * Grams and token statistics, plus headroom), for the frame and replay
 * checks; 0 when the count would overflow. Pure. */
size_t sim_report_bytes(const struct sim_params *p);

/* Whether a resolved p can run: kv_heads divides heads; d >= ranks where d
 * is split (the Gram route without split_heads, routers); the window's
 * snapshots, the floats a rank holds (SIM_MAX_FLOATS_PER_RANK) and its
 * largest report (below SIM_MAX_REPORT_BYTES and replay_bytes) within
 * their limits. The spectrum route holds no attention weights, so full 7B
 * and 70B shapes pass; the Gram route passes the full 7B shape over 8
 * ranks with split_heads (a rank holds 1/8 of the heads, and its report
 * carries only theirs), not without. Returns 0 or -EINVAL with the reason
 * in err. Pure, any thread. */
int sim_params_check(const struct sim_params *p, size_t replay_bytes, char *err, size_t errlen);

#endif
