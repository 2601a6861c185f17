/* `foreshock simulate`: N ranks (threads), each with its own libforeshock
 * client, stream one report per step with scalars and, every K steps,
 * partial attention Grams of simulated weights.
 *
 * Weights: every rank holds its own slice of the model dimension d
 * (FSDP-style shard_index = rank, shard_count = N) of every head's Wq and
 * Wk (dh x d_shard, PyTorch [out, in] layout). They are advanced lazily:
 * only at steps where a sketch or a window-base snapshot needs them, by the
 * accumulated update of the steps in between. A sketch at step t with window
 * W needs the weights at t - W; those are kept in a small ring of snapshots. */
#include <cblas.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "foreshock.h"
#include "simulate.h"

#define SIM_MAX_RANKS 1024
#define SIM_MAX_STEPS 1000000000000ull
#define SIM_MAX_SNAPSHOTS 64                     /* window / sketch_every + 2 */
#define SIM_MAX_FLOATS_PER_RANK ((size_t)1 << 28) /* 1 GiB of simulated weights */
#define SIM_MAX_REPORT_BYTES ((size_t)60 << 20)   /* below the daemon's 64 MiB frames */
#define SIM_UPDATE_SCALE 0.002                   /* per-step update std, relative to init */

struct sim_settings {
    const char *endpoint, *run, *scenario, *token;
    uint64_t steps, seed;
    uint32_t ranks, attempt, layers, heads, dh, d, sketch_every, window, replay_mb;
    double rate, flush_timeout;
    int no_sketches, verbose;
};

static const struct opt sim_opts[] = {
#define O(n, k, f, a, h, lo, hi) \
    {.name = n, .kind = k, .offset = offsetof(struct sim_settings, f), .arg = a, .help = h, .min = lo, .max = hi}
    O("endpoint", OPT_HOSTPORT, endpoint, "HOST:PORT", "daemon ingest address (default " CLI_DEFAULT_ENDPOINT ")", 0, 0),
    {.name = "run", .kind = OPT_STR, .offset = offsetof(struct sim_settings, run), .arg = "ID",
     .help = "run id, 1..128 of [A-Za-z0-9._:-]", .required = 1},
    O("ranks", OPT_U32, ranks, "N", "simulated ranks, one client each (default 1)", 1, SIM_MAX_RANKS),
    O("steps", OPT_U64, steps, "M", "reports per rank, steps 0..M-1 (default 100)", 1, SIM_MAX_STEPS),
    O("attempt", OPT_U32, attempt, "A", "trainer restart counter (default 0)", 0, UINT32_MAX),
    O("layers", OPT_U32, layers, "L", "attention layers (default 4)", 1, FSC_MAX_LAYERS),
    O("heads", OPT_U32, heads, "H", "heads per layer (default 4)", 1, FSC_MAX_HEADS),
    O("dh", OPT_U32, dh, "DH", "head dimension (default 32)", 1, FSC_MAX_DH),
    O("d", OPT_U32, d, "D", "model dimension, split across ranks (default 256)", 1, 1u << 20),
    O("sketch-every", OPT_U32, sketch_every, "K", "attention sketches every K steps (default 10)", 1, 1u << 20),
    O("window", OPT_U32, window, "W", "sketch window in steps (default K)", 1, FSC_MAX_WINDOW),
    {.name = "no-sketches", .kind = OPT_FLAG, .offset = offsetof(struct sim_settings, no_sketches),
     .help = "scalars only"},
    O("seed", OPT_U64, seed, "S", "random seed (default 1)", 0, UINT64_MAX),
    {.name = "rate", .kind = OPT_DOUBLE, .offset = offsetof(struct sim_settings, rate), .arg = "R",
     .help = "reports per second per rank, 0 = as fast as possible (default 0)", .dmin = 0, .dmax = 1e9},
    {.name = "flush-timeout", .kind = OPT_DOUBLE, .offset = offsetof(struct sim_settings, flush_timeout),
     .arg = "S", .help = "seconds to wait for the last acks (default 120)", .dmin = 0, .dmax = 86400},
    {.name = "scenario", .kind = OPT_STR, .offset = offsetof(struct sim_settings, scenario),
     .arg = "NAME", .help = "how the run evolves: healthy (default)"},
    {.name = "token", .kind = OPT_STR, .offset = offsetof(struct sim_settings, token), .arg = "T",
     .help = "shared secret the daemon expects, if any"},
    O("replay-mb", OPT_U32, replay_mb, "MB", "per-rank replay buffer, MiB (default 64)", 1, 65536),
    {.name = "verbose", .kind = OPT_FLAG, .offset = offsetof(struct sim_settings, verbose),
     .help = "print every client event (default: warnings and errors)"},
#undef O
};

static const struct command_help sim_help = {
    .usage = "foreshock simulate --run ID [--endpoint HOST:PORT] [--ranks N] [--steps M] "
             "[--attempt A] [--layers L] [--heads H] [--dh DH] [--d D] [--sketch-every K] "
             "[--window W] [--no-sketches] [--seed S] [--rate R] [--flush-timeout S] "
             "[--scenario NAME]",
    .summary = "Simulate N trainer ranks streaming to foreshockd: per step loss, grad norm, lr, "
               "loss scale, tokens and step time; every K steps partial attention Gram sketches "
               "of L x H heads computed from evolving random weights, each rank holding 1/N of "
               "the model dimension. Rides through daemon restarts. Prints one line per rank and\n"
               "  simulate: run=ID ranks=N steps=M submitted=X acked=Y dropped=Z reconnects=R\n"
               "Exit status 0 when every report was acknowledged, 1 otherwise, 2 on bad usage.",
};

struct rank_ctx {
    const struct sim_settings *s;
    const struct scenario *sc;
    struct sim_params p;
    char host[CLI_MAX_HOSTPORT];
    uint16_t port;
    uint32_t rank, nsnap;
    size_t ds, block;       /* shard columns; floats per head block (dh x ds) */
    float *wq, *wk;         /* layers*heads blocks each */
    float *snap_q, *snap_k; /* nsnap copies of wq, wk */
    float *ga, *gb;         /* one head's Gram triangles */
    uint64_t w_step;        /* the step wq, wk correspond to */
    struct sim_rng rng;
    struct fsc_stats st;
    int started, ok;
    char err[CLI_ERR_LEN];
};

static void on_log(void *ctx, int level, const char *msg)
{
    struct rank_ctx *r = ctx;
    static const char *const names[] = {"debug", "info", "warn", "error"};

    if (level >= FSC_LOG_WARN || r->s->verbose)
        fprintf(stderr, "foreshock simulate: rank %u: %s: %s\n", r->rank,
                names[level >= 0 && level <= 3 ? level : 3], msg);
}

/* Per-element std of the random walk's sum over steps [from, to): each
 * step moves a weight by SIM_UPDATE_SCALE of its initial std, times
 * lr / lr_ref. */
static double walk_scale(const struct rank_ctx *r, uint64_t from, uint64_t to)
{
    double sum = 0;

    for (uint64_t t = from; t < to; t++) {
        double x = r->sc->lr(&r->p, t) / r->sc->lr_ref;
        sum += x * x;
    }
    return SIM_UPDATE_SCALE / sqrt((double)r->p.d) * sqrt(sum);
}

/* Brings the weights from w_step to `step`. */
static void advance(struct rank_ctx *r, uint64_t step)
{
    double scale;

    if (step <= r->w_step)
        return;
    scale = walk_scale(r, r->w_step, step);
    for (uint32_t l = 0; l < r->p.layers; l++)
        for (uint32_t h = 0; h < r->p.heads; h++) {
            size_t off = ((size_t)l * r->p.heads + h) * r->block;
            r->sc->update(&r->p, &r->rng, l, h, 0, r->w_step, step, scale, r->wq + off, r->p.dh, r->ds);
            r->sc->update(&r->p, &r->rng, l, h, 1, r->w_step, step, scale, r->wk + off, r->p.dh, r->ds);
        }
    r->w_step = step;
}

static void fill_scalars(struct rank_ctx *r, fsc_report *rep, uint64_t step)
{
    double tau = r->p.steps > 5 ? (double)r->p.steps / 5.0 : 1.0;
    struct timespec now;

    clock_gettime(CLOCK_REALTIME, &now);
    fsc_report_set_loss(rep, r->sc->loss(&r->p, step) + 0.02 * sim_normal(&r->rng));
    fsc_report_set_grad_norm(rep, 0.5 + 1.5 * exp(-(double)step / tau) +
                                      0.05 * fabs(sim_normal(&r->rng)));
    fsc_report_set_lr(rep, r->sc->lr(&r->p, step));
    fsc_report_set_loss_scale(rep, 65536.0);
    fsc_report_set_tokens(rep, 8 * 2048);
    fsc_report_set_step_time(rep, 0.25 + 0.01 * fabs(sim_normal(&r->rng)));
    fsc_report_set_time(rep, (double)now.tv_sec + (double)now.tv_nsec * 1e-9);
}

/* Sketch and snapshot duties of `step`. Returns 0 or a negative errno. */
static int add_sketches(struct rank_ctx *r, fsc_report *rep, uint64_t step)
{
    uint64_t k = r->s->sketch_every, w = r->s->window;
    int sketch = step % k == 0 && step >= w, snap = (step + w) % k == 0;
    size_t all = (size_t)r->p.layers * r->p.heads * r->block;
    int rc;

    if (!sketch && !snap)
        return 0;
    advance(r, step);
    if (sketch) {
        size_t slot = (size_t)((step / k) % r->nsnap) * all;
        for (uint32_t l = 0; l < r->p.layers; l++)
            for (uint32_t h = 0; h < r->p.heads; h++) {
                size_t off = ((size_t)l * r->p.heads + h) * r->block;
                rc = fsc_attention_grams(r->wq + off, r->wk + off, r->snap_q + slot + off,
                                         r->snap_k + slot + off, r->p.dh, r->ds, r->ga, r->gb);
                if (rc == 0)
                    rc = fsc_report_add_attention_gram(rep, l, h, FSC_KV_HEAD_NONE, (uint32_t)w,
                                                       r->p.dh, r->rank, r->p.ranks, r->ga, r->gb);
                if (rc < 0)
                    return rc;
            }
    }
    if (snap) {
        /* Needed at step + w; slots of pending snapshots never collide
         * because nsnap > w / k + 1. */
        size_t slot = (size_t)(((step + w) / k) % r->nsnap) * all;
        memcpy(r->snap_q + slot, r->wq, all * sizeof(float));
        memcpy(r->snap_k + slot, r->wk, all * sizeof(float));
    }
    return 0;
}

static void sleep_until(const struct timespec *start, double seconds)
{
    struct timespec t = *start;
    double whole = floor(seconds);

    t.tv_sec += (time_t)whole;
    t.tv_nsec += (long)((seconds - whole) * 1e9);
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR)
        ;
}

static int alloc_weights(struct rank_ctx *r)
{
    size_t all = (size_t)r->p.layers * r->p.heads * r->block;
    size_t tri = fsc_tri_len(2 * (size_t)r->p.dh);
    double init = 1.0 / sqrt((double)r->p.d);

    r->wq = malloc(all * sizeof(float));
    r->wk = malloc(all * sizeof(float));
    r->snap_q = malloc(all * r->nsnap * sizeof(float));
    r->snap_k = malloc(all * r->nsnap * sizeof(float));
    r->ga = malloc(tri * sizeof(float));
    r->gb = malloc(tri * sizeof(float));
    if (!r->wq || !r->wk || !r->snap_q || !r->snap_k || !r->ga || !r->gb)
        return -ENOMEM;
    for (size_t i = 0; i < all; i++) {
        r->wq[i] = (float)(init * sim_normal(&r->rng));
        r->wk[i] = (float)(init * sim_normal(&r->rng));
    }
    return 0;
}

static void free_weights(struct rank_ctx *r)
{
    free(r->wq);
    free(r->wk);
    free(r->snap_q);
    free(r->snap_k);
    free(r->ga);
    free(r->gb);
}

static void *rank_main(void *arg)
{
    struct rank_ctx *r = arg;
    const struct sim_settings *s = r->s;
    struct fsc_options o;
    struct timespec start;
    fsc_client *c = NULL;
    int rc;

    if (!s->no_sketches && alloc_weights(r) < 0) {
        snprintf(r->err, sizeof(r->err), "out of memory for simulated weights");
        return NULL;
    }
    fsc_options_init(&o);
    o.host = r->host;
    o.port = r->port;
    o.run_id = s->run;
    o.attempt = s->attempt;
    o.rank = r->rank;
    o.world_size = s->ranks;
    o.token = s->token;
    o.replay_max_bytes = (size_t)s->replay_mb << 20;
    o.max_report_bytes = SIM_MAX_REPORT_BYTES;
    o.model = (struct fsc_model_shape){.n_layers = s->layers, .n_heads = s->heads,
                                       .d_model = s->d, .d_head = s->dh};
    o.client_name = "foreshock-simulate/" FSC_VERSION;
    o.log = on_log;
    o.log_ctx = r;
    o.seed = s->seed * 0x9e3779b97f4a7c15ull + r->rank + 1;
    if ((rc = fsc_open(&o, &c, r->err, sizeof(r->err))) < 0) {
        free_weights(r);
        return NULL;
    }
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (uint64_t step = 0; step < s->steps; step++) {
        fsc_report *rep;
        if (s->rate > 0)
            sleep_until(&start, (double)step / s->rate);
        rep = fsc_report_new(step);
        if (!rep) {
            fsc_submit(c, NULL); /* counted as dropped */
            continue;
        }
        fill_scalars(r, rep, step);
        if (!s->no_sketches && (rc = add_sketches(r, rep, step)) < 0) {
            snprintf(r->err, sizeof(r->err), "step %" PRIu64 ": sketch: %s", step, strerror(-rc));
            fsc_report_free(rep);
            break;
        }
        fsc_submit(c, rep); /* -ENOBUFS etc. are counted in the stats */
    }
    rc = fsc_flush(c, (int)(s->flush_timeout * 1000.0));
    r->st.size = sizeof(r->st);
    fsc_stats(c, &r->st);
    fsc_close(c);
    if (rc < 0 && !r->err[0])
        snprintf(r->err, sizeof(r->err), "flush: %s%s%s", strerror(-rc),
                 r->st.last_error[0] ? "; last error: " : "", r->st.last_error);
    r->ok = !r->err[0] && r->st.submitted == s->steps && r->st.acked == s->steps &&
            r->st.dropped == 0;
    free_weights(r);
    return NULL;
}

/* Checks what the table cannot: cross-option constraints and sizes. */
static int check_settings(struct sim_settings *s, char *err, size_t errlen)
{
    size_t ds, tri, floats;

    if (!s->window)
        s->window = s->sketch_every;
    if (s->d < s->ranks) {
        snprintf(err, errlen, "--d %u must be at least --ranks %u (each rank holds a slice)", s->d,
                 s->ranks);
        return CLI_USAGE;
    }
    if (s->no_sketches)
        return 0;
    if (s->window / s->sketch_every + 2 > SIM_MAX_SNAPSHOTS) {
        snprintf(err, errlen, "--window %u is more than %d x --sketch-every", s->window,
                 SIM_MAX_SNAPSHOTS - 2);
        return CLI_USAGE;
    }
    ds = (s->d + s->ranks - 1) / s->ranks;
    floats = (size_t)s->layers * s->heads * s->dh * ds * 2 * (s->window / s->sketch_every + 3);
    if (floats / ((size_t)s->layers * s->heads) != (size_t)s->dh * ds * 2 * (s->window / s->sketch_every + 3) ||
        floats > SIM_MAX_FLOATS_PER_RANK) {
        snprintf(err, errlen, "simulated weights would need more than %zu floats per rank",
                 SIM_MAX_FLOATS_PER_RANK);
        return CLI_USAGE;
    }
    tri = fsc_tri_len(2 * (size_t)s->dh);
    if ((size_t)s->layers * s->heads * tri * 8 + 4096 > SIM_MAX_REPORT_BYTES ||
        (size_t)s->layers * s->heads * tri * 8 + 4096 > ((size_t)s->replay_mb << 20)) {
        snprintf(err, errlen, "a sketch report (%u x %u heads, dh %u) would not fit in a frame "
                 "or the replay buffer", s->layers, s->heads, s->dh);
        return CLI_USAGE;
    }
    return 0;
}

int cmd_simulate(int argc, char **argv)
{
    struct sim_settings s = {.endpoint = CLI_DEFAULT_ENDPOINT, .scenario = "healthy", .ranks = 1,
                             .steps = 100, .layers = 4, .heads = 4, .dh = 32, .d = 256,
                             .sketch_every = 10, .seed = 1, .flush_timeout = 120, .replay_mb = 64};
    char err[CLI_ERR_LEN], host[CLI_MAX_HOSTPORT];
    struct rank_ctx *ranks;
    pthread_t *th;
    const struct scenario *sc;
    uint64_t sub = 0, ack = 0, drop = 0, rec = 0;
    uint16_t port;
    int rc, all_ok = 1;

    rc = args_parse(sim_opts, sizeof(sim_opts) / sizeof(sim_opts[0]), argc, argv, &s, &sim_help,
                    err, sizeof(err));
    if (rc == 1)
        return CLI_OK;
    if (rc == 0 && !(sc = scenario_find(s.scenario))) {
        snprintf(err, sizeof(err), "--scenario '%s': known scenarios are %s", s.scenario,
                 scenario_names());
        rc = CLI_USAGE;
    }
    if (rc == 0)
        rc = check_settings(&s, err, sizeof(err));
    if (rc != 0) {
        fprintf(stderr, "foreshock simulate: %s (see --help)\n", err);
        return rc;
    }
    args_hostport(s.endpoint, host, sizeof(host), &port);
    /* Parallelism comes from the rank threads; BLAS threads on top of them
     * would only oversubscribe the cores. */
    openblas_set_num_threads(1);
    ranks = calloc(s.ranks, sizeof(*ranks));
    th = calloc(s.ranks, sizeof(*th));
    if (!ranks || !th) {
        fprintf(stderr, "foreshock simulate: out of memory\n");
        free(ranks);
        free(th);
        return CLI_FAIL;
    }
    for (uint32_t i = 0; i < s.ranks; i++) {
        struct rank_ctx *r = &ranks[i];
        r->s = &s;
        r->sc = sc;
        r->p = (struct sim_params){.steps = s.steps, .ranks = s.ranks, .layers = s.layers,
                                   .heads = s.heads, .dh = s.dh, .d = s.d};
        snprintf(r->host, sizeof(r->host), "%s", host);
        r->port = port;
        r->rank = i;
        r->ds = s.d / s.ranks + (i < s.d % s.ranks ? 1 : 0);
        r->block = (size_t)s.dh * r->ds;
        r->nsnap = s.window / s.sketch_every + 2;
        sim_rng_seed(&r->rng, s.seed * 0x2545f4914f6cdd1dull + i);
        if ((rc = pthread_create(&th[i], NULL, rank_main, r)) != 0)
            snprintf(r->err, sizeof(r->err), "cannot start thread: %s", strerror(rc));
        else
            r->started = 1;
    }
    for (uint32_t i = 0; i < s.ranks; i++) {
        struct rank_ctx *r = &ranks[i];
        if (r->started)
            pthread_join(th[i], NULL);
        printf("simulate: rank=%u submitted=%" PRIu64 " acked=%" PRIu64 " dropped=%" PRIu64
               " reconnects=%" PRIu64 " resent=%" PRIu64 "%s%s\n",
               i, r->st.submitted, r->st.acked, r->st.dropped, r->st.reconnects, r->st.resent,
               r->err[0] ? " error: " : "", r->err);
        sub += r->st.submitted;
        ack += r->st.acked;
        drop += r->st.dropped;
        rec += r->st.reconnects;
        all_ok &= r->ok;
    }
    printf("simulate: run=%s ranks=%u steps=%" PRIu64 " submitted=%" PRIu64 " acked=%" PRIu64
           " dropped=%" PRIu64 " reconnects=%" PRIu64 "\n",
           s.run, s.ranks, s.steps, sub, ack, drop, rec);
    fflush(stdout);
    free(ranks);
    free(th);
    return all_ok ? CLI_OK : CLI_FAIL;
}
