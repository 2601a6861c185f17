/* `foreshock simulate`: N ranks (threads), each with its own libforeshock
 * client, stream one report per step: scalars, and the sketches of a
 * simulated model (simrank.c) whose weights, routers and loss follow a
 * scenario (scenario.c). This file is the command: options, threads,
 * clients, and a sink that turns a rank's output into reports. */
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
#define SIM_MAX_TOKENS (1u << 20) /* --tokens-per-step */
#define SIM_MAX_MOE_SPEC 4096     /* --moe-layers text */
/* The daemon's detectors only build baselines over the first 20 samples of
 * a series (docs/monitors.md section 4, DETECT_DEFAULT_WARMUP); a fault before
 * that many sketches cannot be scored against a healthy baseline. */
#define SIM_DETECT_WARMUP_SAMPLES 20

struct sim_settings {
    const char *endpoint, *run, *scenario, *token, *moe_layers, *route;
    const char *tls_ca, *tls_cert, *tls_key, *tls_name;
    uint64_t steps, seed, fault_step, diverge_after, fault_until, resume_step;
    uint32_t ranks, attempt, layers, heads, kv_heads, dh, d, sketch_every, window, replay_mb;
    uint32_t experts, top_k, tokens;
    uint32_t world_size, first_rank;
    double rate, flush_timeout, advice_wait;
    int no_sketches, layer_norms, verbose, local_group, tls, stop_on_advice, resume, split_heads;
};

static const struct opt sim_opts[] = {
#define O(n, k, f, a, h, lo, hi)                                                                   \
    {                                                                                              \
        .name = n, .kind = k, .offset = offsetof(struct sim_settings, f), .arg = a, .help = h,     \
        .min = lo, .max = hi                                                                       \
    }
    O("endpoint", OPT_HOSTPORT, endpoint, "HOST:PORT",
      "daemon ingest address (default " CLI_DEFAULT_ENDPOINT ")", 0, 0),
    {.name = "run",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, run),
     .arg = "ID",
     .help = "run id, 1..128 of [A-Za-z0-9._:-]",
     .required = 1},
    O("ranks", OPT_U32, ranks, "N", "simulated ranks, one client each (default 1)", 1,
      SIM_MAX_RANKS),
    O("world-size", OPT_U32, world_size, "W",
      "ranks of the whole job (default N): these N are ranks R..R+N-1 of W, the model sharded over "
      "them (a node's tensor-parallel group)",
      1, FSC_MAX_WORLD_SIZE),
    O("first-rank", OPT_U32, first_rank, "R", "rank of the first simulated rank (default 0)", 0,
      FSC_MAX_WORLD_SIZE - 1),
    {.name = "local-group",
     .kind = OPT_FLAG,
     .offset = offsetof(struct sim_settings, local_group),
     .help = "declare ranks R..R+N-1 as the daemon's local group (Hello.local_ranks): a daemon per "
             "node"},
    O("steps", OPT_U64, steps, "M", "reports per rank, steps 0..M-1 (default 100)", 1,
      SIM_MAX_STEPS),
    O("attempt", OPT_U32, attempt, "A", "trainer restart counter (default 0)", 0, UINT32_MAX),
    O("resume-step", OPT_U64, resume_step, "S",
      "restart from a checkpoint at step S: the ranks replay steps 0..S without sending and send "
      "S+1.. as a new attempt (give --attempt)",
      0, SIM_MAX_STEPS),
    O("layers", OPT_U32, layers, "L", "attention layers (default 4)", 1, FSC_MAX_LAYERS),
    O("heads", OPT_U32, heads, "H", "query heads per layer (default 4)", 1, FSC_MAX_HEADS),
    O("kv-heads", OPT_U32, kv_heads, "G",
      "key/value heads per layer, dividing H (grouped-query attention; default H)", 1,
      FSC_MAX_HEADS),
    O("dh", OPT_U32, dh, "DH", "head dimension (default 32)", 1, FSC_MAX_DH),
    O("d", OPT_U32, d, "D", "model dimension, split across ranks (default 256)", 1, 1u << 20),
    O("sketch-every", OPT_U32, sketch_every, "K",
      "attention and router Grams, layer norms every K steps (default 10)", 1, 1u << 20),
    O("window", OPT_U32, window, "W", "attention sketch window in steps (default K)", 1,
      FSC_MAX_WINDOW),
    {.name = "route",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, route),
     .arg = "R",
     .help = "gram (default): every rank sends partial Grams of its slice of d of every head; "
             "spectrum: every rank holds whole heads and sends their spectra (synthesised; fits "
             "7B/70B shapes)"},
    {.name = "split-heads",
     .kind = OPT_FLAG,
     .offset = offsetof(struct sim_settings, split_heads),
     .help =
         "gram route: every rank holds all of d of whole heads (the H query heads of every "
         "layer split into N blocks, tensor-parallel style) and sends their whole Grams, the same "
         "monitors as one rank holding them all (the spectrum route always splits heads)"},
    {.name = "no-sketches",
     .kind = OPT_FLAG,
     .offset = offsetof(struct sim_settings, no_sketches),
     .help = "scalars only: no weights, Grams, router tokens or layer norms"},
    O("seed", OPT_U64, seed, "S", "random seed (default 1)", 0, UINT64_MAX),
    {.name = "rate",
     .kind = OPT_DOUBLE,
     .offset = offsetof(struct sim_settings, rate),
     .arg = "R",
     .help = "reports per second per rank, 0 = as fast as possible (default 0)",
     .dmin = 0,
     .dmax = 1e9},
    {.name = "flush-timeout",
     .kind = OPT_DOUBLE,
     .offset = offsetof(struct sim_settings, flush_timeout),
     .arg = "S",
     .help = "seconds to wait for the last acks (default 120)",
     .dmin = 0,
     .dmax = 86400},
    {.name = "scenario",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, scenario),
     .arg = "NAME",
     .help = "healthy (default), attention-numerics, lr-spike or combined (below)"},
    O("fault-step", OPT_U64, fault_step, "S",
      "faulty scenarios: first faulty step (default 40% of --steps)", 0, SIM_MAX_STEPS),
    O("fault-until", OPT_U64, fault_until, "S",
      "faulty scenarios: the fault stops at step S (healthy again; alerts resolve; default never)",
      1, SIM_MAX_STEPS),
    O("diverge-after", OPT_U64, diverge_after, "N",
      "faulty scenarios: steps from the fault to diverge_step (default max(30% of the steps after "
      "the fault, 6 K))",
      1, SIM_MAX_STEPS),
    O("experts", OPT_U32, experts, "E",
      "MoE experts per router, 0 = dense (default 0; 8 for lr-spike, combined)", 0,
      FSC_MAX_EXPERTS),
    O("top-k", OPT_U32, top_k, "TOPK", "experts each token is routed to (default 2)", 1,
      FSC_MAX_EXPERTS),
    {.name = "moe-layers",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, moe_layers),
     .arg = "LIST",
     .help = "layers with a router, e.g. 1,3-5 (default: all)"},
    O("tokens-per-step", OPT_U32, tokens, "T",
      "routed tokens per rank, MoE layer and step (default 256)", 1, SIM_MAX_TOKENS),
    {.name = "layer-norms",
     .kind = OPT_FLAG,
     .offset = offsetof(struct sim_settings, layer_norms),
     .help = "send per-layer |W| and update ratios, and every step's step_update_ratio "
             "(default: on except for scenario healthy)"},
    {.name = "token",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, token),
     .arg = "T",
     .help = "shared secret the daemon expects, if any"},
    {.name = "tls",
     .kind = OPT_FLAG,
     .offset = offsetof(struct sim_settings, tls),
     .help = "TLS to the daemon (implied by the --tls-* options); its certificate is verified"},
    {.name = "tls-ca",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, tls_ca),
     .arg = "FILE",
     .help = "PEM CA the daemon's certificate must chain to (default: the system's)"},
    {.name = "tls-cert",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, tls_cert),
     .arg = "FILE",
     .help = "PEM client certificate, for a daemon with tls_client_ca"},
    {.name = "tls-key",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, tls_key),
     .arg = "FILE",
     .help = "PEM private key of --tls-cert"},
    {.name = "tls-server-name",
     .kind = OPT_STR,
     .offset = offsetof(struct sim_settings, tls_name),
     .arg = "NAME",
     .help = "name the daemon's certificate must carry (default: the endpoint host)"},
    O("replay-mb", OPT_U32, replay_mb, "MB", "per-rank replay buffer, MiB (default 64)", 1, 65536),
    {.name = "verbose",
     .kind = OPT_FLAG,
     .offset = offsetof(struct sim_settings, verbose),
     .help = "print every client event (default: warnings and errors)"},
    {.name = "advice-wait",
     .kind = OPT_DOUBLE,
     .offset = offsetof(struct sim_settings, advice_wait),
     .arg = "S",
     .help = "after the last ack, wait up to S seconds for advice (default 0); a rank "
             "stops waiting once told checkpoint_and_stop",
     .dmin = 0,
     .dmax = 86400},
    {.name = "stop-on-advice",
     .kind = OPT_FLAG,
     .offset = offsetof(struct sim_settings, stop_on_advice),
     .help = "a rank told checkpoint_and_stop stops there, as a trainer would"},
#undef O
};

static const struct command_help sim_help = {
    .usage = "foreshock simulate --run ID [--endpoint HOST:PORT] [--ranks N] [--steps M] "
             "[--world-size W] [--first-rank R] [--local-group] [--tls] [--tls-ca F] "
             "[--tls-cert F --tls-key F] [--attempt A] [--resume-step S] [--layers L] "
             "[--heads H] [--kv-heads G] "
             "[--dh DH] [--d D] [--sketch-every K] [--window W] [--route gram|spectrum] "
             "[--split-heads] [--no-sketches] [--seed S] [--rate R] [--flush-timeout S] "
             "[--scenario NAME] [--fault-step S] [--fault-until S] [--diverge-after N] [--experts "
             "E] [--top-k TOPK] "
             "[--moe-layers LIST] [--tokens-per-step T] [--layer-norms] [--advice-wait S] "
             "[--stop-on-advice]",
    .summary =
        "Simulate N trainer ranks streaming to foreshockd. Per step: loss, grad norm, lr, loss\n"
        "scale, tokens and step time, and per MoE layer the routing statistics of T simulated\n"
        "tokens (x ~ N(0, I_d), z = WR x: entropy, logsumexp, top-k loads, sum of p). Every K\n"
        "steps: partial attention Gram sketches of L x H heads (window W) and partial router\n"
        "Grams, each rank holding 1/N of the model dimension, and per-layer |W| and update\n"
        "ratios (of the rank's own shard). Weights evolve as the scenario says. With\n"
        "--split-heads each rank holds all of d of whole heads instead (the H query heads of\n"
        "every layer split into N blocks, as tensor parallelism does) and sends their whole\n"
        "Grams: the full 7B shape (32 x 32 heads, --kv-heads 8, dh 128, d 4096) fits over 8\n"
        "ranks. With --route spectrum each rank holds whole heads and sends their spectrum\n"
        "sketches, synthesised from the scenario's update statistics rather than from weights:\n"
        "full 7B and 70B (80 x 64, 8, 128, 8192) shapes fit. Rides through daemon\n"
        "restarts. First prints the ground truth\n"
        "  simulate: scenario=NAME fault_step=S diverge_step=D\n"
        "(S and D are 'none' without a fault; D is the first step whose loss exceeds 10x its\n"
        "healthy value or is not finite, 'none' when that is past the last step), at the end one\n"
        "line per rank and\n"
        "  simulate: run=ID ranks=N steps=M submitted=X acked=Y dropped=Z reconnects=R\n"
        "Each rank takes the daemon's advice (docs/alerting.md) and prints one line per advice\n"
        "  simulate: advice rank=R step=S action=A alert=ID rule=RULE label=L rollback=B at=T\n"
        "(S: the alert's transition step, B: the suggested rollback step or 'none', T: the\n"
        "rank's step when it took the advice). With --stop-on-advice a rank told\n"
        "checkpoint_and_stop stops, printing 'simulate: rank=R stopped at step T by advice'.\n"
        "The daemon's detectors spend their first 20 samples of a series building a baseline:\n"
        "put the fault after 20 K steps (a warning says so otherwise).\n"
        "Exit status 0 when every report was acknowledged, 1 otherwise, 2 on bad usage.",
};

struct rank_ctx {
    const struct sim_settings *s;
    const struct scenario *sc;
    const struct sim_params *p;
    char host[CLI_MAX_HOSTPORT];
    uint16_t port;
    uint32_t rank;
    const uint32_t *moe_list; /* for Hello */
    size_t n_moe;
    const uint32_t *local; /* Hello.local_ranks, NULL: none */
    size_t n_local;
    struct fsc_stats st;
    int started, ok;
    int stopped;         /* told checkpoint_and_stop */
    uint64_t stopped_at; /* the step it stopped after (with --stop-on-advice) */
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

/* ---- the sink: a rank's output into one report --------------------------------------- */

static int put_scalars(void *ctx, uint64_t step, const struct sim_scalars *s)
{
    fsc_report *rep = ctx;
    struct timespec now;
    int rc;

    (void)step;
    clock_gettime(CLOCK_REALTIME, &now);
    if ((rc = fsc_report_set_loss(rep, s->loss)) < 0 ||
        (rc = fsc_report_set_grad_norm(rep, s->grad_norm)) < 0 ||
        (rc = fsc_report_set_lr(rep, s->lr)) < 0 ||
        (rc = fsc_report_set_loss_scale(rep, s->loss_scale)) < 0 ||
        (rc = fsc_report_set_tokens(rep, s->tokens)) < 0 ||
        (rc = fsc_report_set_step_time(rep, s->step_time)) < 0 ||
        (isfinite(s->step_update_ratio) &&
         (rc = fsc_report_set_step_update_ratio(rep, s->step_update_ratio)) < 0))
        return rc;
    return fsc_report_set_time(rep, (double)now.tv_sec + (double)now.tv_nsec * 1e-9);
}

static int put_attention(void *ctx, uint64_t step, uint32_t layer, uint32_t head, uint32_t kv_head,
                         uint32_t window, uint32_t dh, uint32_t shard, uint32_t shards,
                         const float *ga, const float *gb)
{
    (void)step;
    return fsc_report_add_attention_gram(ctx, layer, head, kv_head, window, dh, shard, shards, ga,
                                         gb);
}

static int put_spectrum(void *ctx, uint64_t step, uint32_t layer, uint32_t head, uint32_t kv_head,
                        uint32_t window, const struct fsc_spectrum *sp)
{
    (void)step;
    return fsc_report_add_attention_spectrum(ctx, layer, head, kv_head, window, sp);
}

static int put_router_gram(void *ctx, uint64_t step, uint32_t layer, uint32_t experts,
                           uint32_t shard, uint32_t shards, const float *gr)
{
    (void)step;
    return fsc_report_add_router_gram(ctx, layer, experts, shard, shards, gr);
}

static int put_router_tokens(void *ctx, uint64_t step, uint32_t layer, uint32_t experts,
                             const struct sim_tokens *t)
{
    (void)step;
    return fsc_report_add_router_tokens(ctx, layer, experts, t->n_tok, t->sum_h, t->sum_h2,
                                        t->sum_lse2, t->load, t->sum_p);
}

static int put_layer_norms(void *ctx, uint64_t step, const float *norm, const float *ratio,
                           size_t layers)
{
    int rc;

    (void)step;
    if ((rc = fsc_report_set_layer_weight_norms(ctx, norm, layers)) < 0)
        return rc;
    return fsc_report_set_layer_update_ratios(ctx, ratio, layers);
}

/* Takes every pending advice of the rank's client, printing one line each.
 * `at` is the rank's current step. Returns 1 once told checkpoint_and_stop. */
static int take_advice(struct rank_ctx *r, fsc_client *c, uint64_t at)
{
    struct fsc_advice a = {.size = sizeof(a)};
    int stop = 0;

    while (fsc_poll_advice(c, &a) == 1) {
        char rb[24] = "none";
        if (a.rollback_step >= 0)
            snprintf(rb, sizeof(rb), "%" PRId64, a.rollback_step);
        /* One printf per line: stdio locks the stream per call. */
        printf("simulate: advice rank=%u step=%" PRId64 " action=%s alert=%" PRIu64
               " rule=%s label=%s rollback=%s at=%" PRIu64 "\n",
               r->rank, a.step, fsc_advice_action_name(a.action), a.alert_id, a.rule,
               a.label[0] ? a.label : "none", rb, at);
        fflush(stdout);
        if (a.action == FSC_ADVICE_CHECKPOINT_AND_STOP) {
            if (!r->stopped)
                r->stopped_at = at;
            r->stopped = 1;
            stop = 1;
        }
        a.size = sizeof(a);
    }
    return stop;
}

/* After the last ack: takes advice for up to s->advice_wait seconds, less
 * once told to stop. */
static void wait_advice(struct rank_ctx *r, fsc_client *c, uint64_t at)
{
    struct timespec t0, now;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        if (take_advice(r, c, at) || r->stopped)
            return;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((double)(now.tv_sec - t0.tv_sec) + (double)(now.tv_nsec - t0.tv_nsec) * 1e-9 >=
            r->s->advice_wait)
            return;
        struct timespec nap = {.tv_sec = 0, .tv_nsec = 20 * 1000000L};
        nanosleep(&nap, NULL);
    }
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

static void *rank_main(void *arg)
{
    struct rank_ctx *r = arg;
    const struct sim_settings *s = r->s;
    struct sim_sink sink = {.scalars = put_scalars,
                            .attention = put_attention,
                            .spectrum = put_spectrum,
                            .router_gram = put_router_gram,
                            .router_tokens = put_router_tokens,
                            .layer_norms = put_layer_norms};
    struct sim_rank *sim = NULL;
    struct fsc_options o;
    struct timespec start;
    fsc_client *c = NULL;
    int rc;

    /* The model is sharded over the simulated ranks: local index. */
    if ((rc = sim_rank_create(r->sc, r->p, r->rank - s->first_rank, &sim)) < 0) {
        snprintf(r->err, sizeof(r->err), "cannot set up the simulated model: %s", strerror(-rc));
        return NULL;
    }
    fsc_options_init(&o);
    o.host = r->host;
    o.port = r->port;
    o.run_id = s->run;
    o.attempt = s->attempt;
    o.rank = r->rank;
    o.world_size = s->world_size;
    o.local_ranks = r->local;
    o.n_local_ranks = r->n_local;
    o.tls = s->tls || s->tls_ca || s->tls_cert || s->tls_key || s->tls_name;
    o.tls_ca_file = s->tls_ca;
    o.tls_cert_file = s->tls_cert;
    o.tls_key_file = s->tls_key;
    o.tls_server_name = s->tls_name;
    o.token = s->token;
    o.replay_max_bytes = (size_t)s->replay_mb << 20;
    o.max_report_bytes = SIM_MAX_REPORT_BYTES;
    o.model = (struct fsc_model_shape){.n_layers = s->layers,
                                       .n_heads = s->heads,
                                       .n_kv_heads = r->p->heads / sim_group(r->p),
                                       .d_model = s->d,
                                       .d_head = s->dh,
                                       .n_experts = r->n_moe ? r->p->experts : 0,
                                       .top_k = r->n_moe ? r->p->top_k : 0,
                                       .moe_layers = r->moe_list,
                                       .n_moe_layers = r->n_moe};
    o.client_name = "foreshock-simulate/" FSC_VERSION;
    o.log = on_log;
    o.log_ctx = r;
    o.seed = s->seed * 0x9e3779b97f4a7c15ull + r->rank + 1;
    o.advice = 1;
    o.resume = s->resume;
    o.resume_step = s->resume_step;
    if ((rc = fsc_open(&o, &c, r->err, sizeof(r->err))) < 0) {
        sim_rank_destroy(sim);
        return NULL;
    }
    clock_gettime(CLOCK_MONOTONIC, &start);
    uint64_t last = 0, first = s->resume ? s->resume_step + 1 : 0;
    /* A restart from a checkpoint: the simulated model takes the steps up
     * to it again (the checkpoint's state), nothing is sent. */
    for (uint64_t step = 0; step < first && step < s->steps; step++) {
        struct sim_sink none = {0};
        if ((rc = sim_rank_step(sim, step, &none)) < 0) {
            snprintf(r->err, sizeof(r->err), "step %" PRIu64 ": %s", step, strerror(-rc));
            break;
        }
    }
    for (uint64_t step = first; step < s->steps && !r->err[0]; step++) {
        fsc_report *rep;
        last = step;
        if (take_advice(r, c, step) && s->stop_on_advice) {
            printf("simulate: rank=%u stopped at step %" PRIu64 " by advice\n", r->rank, step);
            fflush(stdout);
            break;
        }
        if (s->rate > 0)
            sleep_until(&start, (double)step / s->rate);
        rep = fsc_report_new(step);
        sink.ctx = rep;
        if (!rep) {
            /* The model still has to take the step; the report is lost
             * (counted as dropped). */
            struct sim_sink none = {0};
            fsc_submit(c, NULL);
            if ((rc = sim_rank_step(sim, step, &none)) < 0)
                break;
            continue;
        }
        if ((rc = sim_rank_step(sim, step, &sink)) < 0) {
            snprintf(r->err, sizeof(r->err), "step %" PRIu64 ": %s", step, strerror(-rc));
            fsc_report_free(rep);
            break;
        }
        fsc_submit(c, rep); /* -ENOBUFS etc. are counted in the stats */
    }
    rc = fsc_flush(c, (int)(s->flush_timeout * 1000.0));
    if (s->advice_wait > 0)
        wait_advice(r, c, last);
    else
        take_advice(r, c, last);
    r->st.size = sizeof(r->st);
    fsc_stats(c, &r->st);
    fsc_close(c);
    if (rc < 0 && !r->err[0])
        snprintf(r->err, sizeof(r->err), "flush: %s%s%s", strerror(-rc),
                 r->st.last_error[0] ? "; last error: " : "", r->st.last_error);
    /* A rank that stopped on advice did what a trainer does: not a failure. */
    r->ok = !r->err[0] &&
            (r->st.submitted == s->steps - first || (r->stopped && s->stop_on_advice)) &&
            r->st.acked == r->st.submitted && r->st.dropped == 0;
    sim_rank_destroy(sim);
    return NULL;
}

/* Parses "1,3-5" into flags[0..layers). Returns 0 or CLI_USAGE with err. */
static int parse_moe_layers(const char *spec, uint32_t layers, uint8_t *flags, char *err,
                            size_t errlen)
{
    const char *c = spec;

    if (strlen(spec) > SIM_MAX_MOE_SPEC)
        goto bad;
    memset(flags, 0, layers);
    while (*c) {
        char *end;
        unsigned long lo, hi;
        if (*c < '0' || *c > '9')
            goto bad;
        lo = hi = strtoul(c, &end, 10);
        c = end;
        if (*c == '-') {
            if (c[1] < '0' || c[1] > '9')
                goto bad;
            hi = strtoul(c + 1, &end, 10);
            c = end;
        }
        if (lo > hi || hi >= layers) {
            snprintf(err, errlen, "--moe-layers '%s': layers are 0..%u", spec, layers - 1);
            return CLI_USAGE;
        }
        for (unsigned long l = lo; l <= hi; l++)
            flags[l] = 1;
        if (*c == ',' && c[1])
            c++;
        else if (*c)
            goto bad;
    }
    return 0;
bad:
    snprintf(err, errlen, "--moe-layers '%.64s': expected a list like 1,3-5", spec);
    return CLI_USAGE;
}

/* Checks what the table cannot: cross-option constraints and sizes
 * (sim_params_check, unit-tested in test_scenario.c). */
static int check_settings(const struct sim_settings *s, const struct sim_params *p, char *err,
                          size_t errlen)
{
    return sim_params_check(p, (size_t)s->replay_mb << 20, err, errlen) < 0 ? CLI_USAGE : 0;
}

static void print_truth(const struct scenario *sc, const struct sim_params *p)
{
    char f[32] = "none", d[32] = "none";

    if (p->fault_step != SIM_NEVER)
        snprintf(f, sizeof(f), "%" PRIu64, p->fault_step);
    if (p->diverge_step != SIM_NEVER && p->diverge_step < p->steps)
        snprintf(d, sizeof(d), "%" PRIu64, p->diverge_step);
    printf("simulate: scenario=%s fault_step=%s diverge_step=%s\n", sc->name, f, d);
    fflush(stdout);
}

int cmd_simulate(int argc, char **argv)
{
    struct sim_settings s = {.endpoint = CLI_DEFAULT_ENDPOINT,
                             .scenario = "healthy",
                             .ranks = 1,
                             .steps = 100,
                             .layers = 4,
                             .heads = 4,
                             .dh = 32,
                             .d = 256,
                             .sketch_every = 10,
                             .seed = 1,
                             .flush_timeout = 120,
                             .replay_mb = 64,
                             .fault_step = SIM_NEVER,
                             .diverge_after = SIM_NEVER,
                             .resume_step = UINT64_MAX,
                             .experts = SIM_UINT32_UNSET,
                             .top_k = SIM_UINT32_UNSET,
                             .tokens = SIM_UINT32_UNSET};
    char err[CLI_ERR_LEN], host[CLI_MAX_HOSTPORT];
    struct rank_ctx *ranks = NULL;
    pthread_t *th = NULL;
    const struct scenario *sc = NULL;
    struct sim_params p;
    uint8_t *moe = NULL;
    uint32_t *moe_list = NULL, *local = NULL;
    size_t n_moe = 0;
    uint64_t sub = 0, ack = 0, drop = 0, rec = 0;
    enum sim_route route = SIM_ROUTE_GRAM;
    uint16_t port;
    int rc, all_ok = 1;

    rc = args_parse(sim_opts, sizeof(sim_opts) / sizeof(sim_opts[0]), argc, argv, &s, &sim_help,
                    err, sizeof(err));
    if (rc == 1) {
        scenario_print_help(stdout);
        return CLI_OK;
    }
    if (rc == 0 && !(sc = scenario_find(s.scenario))) {
        snprintf(err, sizeof(err), "--scenario '%s': known scenarios are %s", s.scenario,
                 scenario_names());
        rc = CLI_USAGE;
    }
    if (rc == 0 && !s.window)
        s.window = s.sketch_every;
    if (rc == 0 && s.route && sim_route_parse(s.route, &route) < 0) {
        snprintf(err, sizeof(err), "--route '%s': gram or spectrum", s.route);
        rc = CLI_USAGE;
    }
    if (rc == 0 && !s.world_size)
        s.world_size = s.ranks;
    if (rc == 0 && (uint64_t)s.first_rank + s.ranks > s.world_size) {
        snprintf(err, sizeof(err), "--first-rank %u + --ranks %u is more than --world-size %u",
                 s.first_rank, s.ranks, s.world_size);
        rc = CLI_USAGE;
    }
    if (rc == 0 && s.moe_layers) {
        if (!(moe = malloc(s.layers)))
            rc = CLI_FAIL;
        else
            rc = parse_moe_layers(s.moe_layers, s.layers, moe, err, sizeof(err));
    }
    p = (struct sim_params){.steps = s.steps,
                            .seed = s.seed,
                            .ranks = s.ranks,
                            .layers = s.layers,
                            .heads = s.heads,
                            .kv_heads = s.kv_heads,
                            .route = route,
                            .split_heads = s.split_heads,
                            .dh = s.dh,
                            .d = s.d,
                            .sketch_every = s.sketch_every,
                            .window = s.window,
                            .sketches = !s.no_sketches,
                            .experts = s.experts,
                            .top_k = s.top_k,
                            .tokens = s.tokens,
                            .moe = moe};
    if (rc == 0 && sim_params_resolve(sc, &p, s.fault_step, s.diverge_after, err, sizeof(err)) < 0)
        rc = CLI_USAGE;
    s.resume = s.resume_step != UINT64_MAX; /* the option's maximum is below it */
    if (rc == 0 && s.resume && s.resume_step + 1 >= s.steps) {
        snprintf(err, sizeof(err),
                 "--resume-step %" PRIu64 " leaves no step below --steps %" PRIu64, s.resume_step,
                 s.steps);
        rc = CLI_USAGE;
    }
    if (rc == 0 && s.fault_until) {
        if (!sc->faulty || s.fault_until <= p.fault_step) {
            snprintf(err, sizeof(err),
                     "--fault-until needs a faulty scenario and a step after "
                     "the fault step %" PRIu64,
                     p.fault_step);
            rc = CLI_USAGE;
        }
        p.fault_until = s.fault_until;
    }
    /* Layer norms add series per layer: opt-in for the healthy default, so
     * its output stays what earlier versions sent; on for the faults. */
    p.layer_norms = s.layer_norms || (sc && sc->faulty);
    if (rc == 0)
        rc = check_settings(&s, &p, err, sizeof(err));
    if (rc != 0) {
        fprintf(stderr, "foreshock simulate: %s (see --help)\n",
                rc == CLI_FAIL ? "out of memory" : err);
        free(moe);
        return rc;
    }
    if (p.experts && !s.no_sketches) {
        moe_list = malloc(s.layers * sizeof(*moe_list));
        if (!moe_list) {
            fprintf(stderr, "foreshock simulate: out of memory\n");
            free(moe);
            return CLI_FAIL;
        }
        for (uint32_t l = 0; l < s.layers; l++)
            if (sim_is_moe(&p, l))
                moe_list[n_moe++] = l;
    }
    if (sc->faulty && !s.no_sketches &&
        p.fault_step < (uint64_t)(SIM_DETECT_WARMUP_SAMPLES + 1) * s.sketch_every)
        fprintf(stderr,
                "foreshock simulate: warning: the fault at step %" PRIu64 " comes before "
                "%d sketches (step %" PRIu64 "): the daemon's detectors are still building their "
                "baselines then\n",
                p.fault_step, SIM_DETECT_WARMUP_SAMPLES + 1,
                (uint64_t)(SIM_DETECT_WARMUP_SAMPLES + 1) * s.sketch_every);
    print_truth(sc, &p);
    args_hostport(s.endpoint, host, sizeof(host), &port);
    /* Parallelism comes from the rank threads; BLAS threads on top of them
     * would only oversubscribe the cores. */
    openblas_set_num_threads(1);
    ranks = calloc(s.ranks, sizeof(*ranks));
    th = calloc(s.ranks, sizeof(*th));
    local = s.local_group ? calloc(s.ranks, sizeof(*local)) : NULL;
    if (!ranks || !th || (s.local_group && !local)) {
        fprintf(stderr, "foreshock simulate: out of memory\n");
        free(ranks);
        free(th);
        free(local);
        free(moe);
        free(moe_list);
        return CLI_FAIL;
    }
    for (uint32_t i = 0; local && i < s.ranks; i++)
        local[i] = s.first_rank + i;
    for (uint32_t i = 0; i < s.ranks; i++) {
        struct rank_ctx *r = &ranks[i];
        r->s = &s;
        r->sc = sc;
        r->p = &p;
        snprintf(r->host, sizeof(r->host), "%s", host);
        r->port = port;
        r->rank = s.first_rank + i;
        r->local = local;
        r->n_local = local ? s.ranks : 0;
        r->moe_list = moe_list;
        r->n_moe = n_moe;
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
               r->rank, r->st.submitted, r->st.acked, r->st.dropped, r->st.reconnects, r->st.resent,
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
    free(moe);
    free(moe_list);
    free(local);
    return all_ok ? CLI_OK : CLI_FAIL;
}
