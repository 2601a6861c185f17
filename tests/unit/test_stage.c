/* The monitor stage (daemon/stage.c) in-process with a real store: reports
 * are built in memory, spooled and fed the way ingest does, the loop runs
 * the workers, and the outcome is read back from SQLite.
 *
 * Detection tables through the whole path (spectrum sketches give exact
 * Delta2 spectra, router Grams built from explicit expert rows): a
 * transient low-rank dip does not fire, a sustained collapse fires after
 * the persistence count with the collapsing head as evidence, recovery
 * resolves, a NaN loss fires at once, a router similarity ramp fires
 * optimizer-hyperparameter, both faults together are combined. Each case
 * also runs with a crash in the middle (a child process that spooled and
 * fed part of the run exits without evaluating it) and with a clean stop
 * and restart: the alert history must be identical. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "detect.h"
#include "fstest.h"
#include "stage.h"
#include "store.h"

#define T_DH 4
#define T_E 4 /* experts */
#define T_D 8 /* router model dim */
#define T_STEPS 70
#define T_FAULT 30
#define T_RUN "stage-run"

/* F_STEP: the gradient norm and the per-step update ratio both 4x from the
 * fault on (an attention fault under SGD, or a rate fault that lifts the
 * gradient); F_SGD: the trainer's Hello names SGD as its optimizer. */
enum fault {
    F_NONE = 0,
    F_DIP = 1,
    F_COLLAPSE = 2,
    F_RECOVER = 4,
    F_NAN = 8,
    F_RAMP = 16,
    F_STEP = 32,
    F_SGD = 64
};

/* The detection tables run T_STEPS steps with detection from step 1; the
 * progress test runs longer, with an LR warm-up and detection starting by
 * training progress (evaluate.h). Set before a run, per test process. */
static uint64_t g_steps = T_STEPS, g_fault = T_FAULT;
static bool g_progress;
static const char *g_optimizer; /* the next h_open's Hello names it (NULL: none) */
#define T_LR_WARMUP 40          /* progress runs: the LR rises for 40 steps, then stays */

struct harness {
    uv_loop_t loop;
    struct store *store;
    struct stage *stage;
    struct detect_rules rules;
    struct fs_stats stats;
    int64_t run_id, stream_id;
    uint64_t seq;
};

/* --- the daemon side --------------------------------------------------------------- */

static uint64_t t_head_points_every; /* stage_opts.head_points_every of the next h_open */

static void h_open(struct harness *h, const char *path)
{
    memset(h, 0, sizeof(*h));
    cr_assert_eq(uv_loop_init(&h->loop), 0);
    struct store_opts so = {.max_runs = 10,
                            .queue_max_items = 100000,
                            .queue_max_bytes = 1ull << 30,
                            .batch_max_items = 64,
                            .stats = &h->stats};
    struct fs_err err = {0};
    cr_assert_eq(store_open(path, &so, &h->store, &err), 0, "%s", err.msg);
    detect_rules_default(&h->rules);
    struct stage_opts sto = {.loop = &h->loop,
                             .store = h->store,
                             .stats = &h->stats,
                             .rules = &h->rules,
                             .reduce_timeout_s = 60,
                             .reduce_max_bytes = 1ull << 30,
                             .spool_max_bytes = 1ull << 30,
                             .max_chunks = 2,
                             .head_points_every = t_head_points_every,
                             /* The tables test detection itself, not when
                              * training progress starts it (evaluate.h). */
                             .detect_from_step = g_progress ? 0 : 1};
    cr_assert_eq(stage_create(&sto, &h->stage, &err), 0, "%s", err.msg);
    cr_assert_eq(stage_load(h->stage, path, &err), 0, "%s", err.msg);
    /* the Hello: run and stream rows, then the Welcome's registration */
    struct store_item *it = store_item_new(STORE_ITEM_HELLO);
    snprintf(it->hello.run, sizeof(it->hello.run), "%s", T_RUN);
    it->hello.world_size = 1;
    if (g_optimizer) { /* as ingest stores the model shape */
        char json[128];
        snprintf(json, sizeof(json), "{\"optimizer\":\"%s\"}", g_optimizer);
        it->hello.model_json = strdup(json);
        cr_assert_not_null(it->hello.model_json);
    }
    it->conn_id = 1;
    cr_assert_eq(store_submit(h->store, it), 0);
    store_flush(h->store);
    struct store_result *res;
    size_t n = store_take_results(h->store, &res);
    cr_assert_eq(n, 1);
    cr_assert_eq(res[0].error_code, 0);
    h->run_id = res[0].run_id;
    h->stream_id = res[0].stream_id;
    h->seq = res[0].seq;
    free(res);
    struct run_hello rh = {.rank = 0,
                           .world_size = 1,
                           .has_n_layers = true,
                           .n_layers = 1,
                           .has_n_heads = true,
                           .n_heads = 2,
                           .optimizer = g_optimizer};
    cr_assert_eq(stage_hello(h->stage, h->run_id, T_RUN, h->stream_id, h->seq, &rh), 0);
}

/* Runs the loop until no work is on the workers and the writer is idle. */
static void h_settle(struct harness *h)
{
    do {
        uv_run(&h->loop, UV_RUN_NOWAIT);
        stage_poll(h->stage);
        if (stage_inflight(h->stage))
            usleep(500);
    } while (stage_inflight(h->stage));
    uv_run(&h->loop, UV_RUN_NOWAIT);
    store_flush(h->store);
}

static void h_close(struct harness *h)
{
    stage_stop(h->stage, NULL, NULL);
    uv_run(&h->loop, UV_RUN_DEFAULT);
    stage_free(h->stage);
    store_close(h->store);
    cr_assert_eq(uv_loop_close(&h->loop), 0);
}

/* --- the trainer side: one report per step ------------------------------------------- */

static double noise(uint64_t step, unsigned k)
{
    uint64_t x = (step + 1) * 0x9e3779b97f4a7c15ull + k * 0xbf58476d1ce4e5b9ull;
    x ^= x >> 31;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 29;
    return (double)(x % 10000) / 10000.0 - 0.5;
}

static bool collapsed(int faults, uint64_t step)
{
    if (faults & F_DIP)
        return step == g_fault;
    if (faults & F_RECOVER)
        return step >= g_fault && step < g_fault + 5;
    return (faults & F_COLLAPSE) && step >= g_fault;
}

/* Feeds the report of `step` as ingest does: the REPORT item (with the
 * frame for the spool) first, then the stage. */
static void h_step(struct harness *h, int faults, uint64_t step)
{
    Foreshock__Report r = FORESHOCK__REPORT__INIT;
    Foreshock__Scalars sc = FORESHOCK__SCALARS__INIT;
    Foreshock__AttentionSketch att[2], *attp[2];
    Foreshock__SpectrumSketch spec[2];
    float d2[2][2 * T_DH];
    r.seq = ++h->seq;
    r.step = step;
    r.has_time_unix = 1;
    r.time_unix = 1.7e9 + (double)step;
    r.scalars = &sc;
    sc.has_loss = 1;
    sc.loss = ((faults & F_NAN) && step == g_fault) ? NAN : 3.0 + 0.01 * noise(step, 99);
    if (faults & F_STEP) {
        double m = step >= g_fault ? 4.0 : 1.0;
        sc.has_grad_norm = 1;
        sc.grad_norm = m * (1.0 + 0.05 * noise(step, 77));
        sc.has_step_update_ratio = 1;
        sc.step_update_ratio = m * 1e-3 * (1.0 + 0.05 * noise(step, 78));
    }
    if (g_progress) {
        sc.has_lr = 1;
        sc.lr = 1e-3 * (step < T_LR_WARMUP ? (double)(step + 1) / T_LR_WARMUP : 1.0);
    }
    for (int hd = 0; hd < 2; hd++) {
        foreshock__attention_sketch__init(&att[hd]);
        foreshock__spectrum_sketch__init(&spec[hd]);
        att[hd].layer = 0;
        att[hd].head = (uint32_t)hd;
        att[hd].window = 1;
        att[hd].kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_SPECTRUM;
        att[hd].spectrum = &spec[hd];
        for (int i = 0; i < 2 * T_DH; i++)
            d2[hd][i] = (float)(1.0 + 0.05 * noise(step, (unsigned)(hd * 16 + i)));
        if (hd == 1 && collapsed(faults, step))
            for (int i = 1; i < 2 * T_DH; i++)
                d2[hd][i] = 1e-4f * (float)(i + 1);
        spec[hd].d2 = d2[hd];
        spec[hd].n_d2 = 2 * T_DH;
        attp[hd] = &att[hd];
    }
    r.attention = attp;
    r.n_attention = 2;
    /* Router rows: fixed random directions; under F_RAMP they lean
     * towards a common direction, more every step. */
    Foreshock__RouterGram rg = FORESHOCK__ROUTER_GRAM__INIT, *rgp = &rg;
    float gr[T_E * (T_E + 1) / 2];
    double w[T_E][T_D];
    double a = (faults & F_RAMP) && step >= g_fault ? 0.04 * (double)(step - g_fault + 1) : 0.0;
    if (a > 0.9)
        a = 0.9;
    for (int e = 0; e < T_E; e++)
        for (int k = 0; k < T_D; k++)
            w[e][k] = (1 - a) * (noise(0, (unsigned)(e * T_D + k)) +
                                 0.01 * noise(step, (unsigned)(200 + e * T_D + k))) +
                      a * 0.5;
    size_t n = 0;
    for (int i = 0; i < T_E; i++)
        for (int j = i; j < T_E; j++) {
            double s = 0;
            for (int k = 0; k < T_D; k++)
                s += w[i][k] * w[j][k];
            gr[n++] = (float)s;
        }
    rg.layer = 0;
    rg.n_experts = T_E;
    rg.gram.data = (uint8_t *)gr;
    rg.gram.len = sizeof(gr);
    r.router_gram = &rgp;
    r.n_router_gram = 1;

    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_REPORT;
    f.report = &r;
    struct store_item *it = store_item_new(STORE_ITEM_REPORT);
    struct store_report *rp = &it->report;
    rp->run_id = h->run_id;
    rp->stream_id = h->stream_id;
    rp->seq = r.seq;
    rp->step = step;
    rp->time = rp->received_at = r.time_unix;
    rp->present = 1u << STORE_LOSS;
    rp->scalars[STORE_LOSS] = sc.loss;
    if (sc.has_lr) {
        rp->present |= 1u << STORE_LR;
        rp->scalars[STORE_LR] = sc.lr;
    }
    if (sc.has_grad_norm) {
        rp->present |= 1u << STORE_GRAD_NORM | 1u << STORE_STEP_UPDATE_RATIO;
        rp->scalars[STORE_GRAD_NORM] = sc.grad_norm;
        rp->scalars[STORE_STEP_UPDATE_RATIO] = sc.step_update_ratio;
    }
    rp->sketch_len = foreshock__frame__get_packed_size(&f);
    rp->sketch_body = malloc(rp->sketch_len);
    foreshock__frame__pack(&f, rp->sketch_body);
    rp->frame_bytes = (uint32_t)rp->sketch_len + 4;
    cr_assert(stage_wants_spool(h->stage, h->run_id, 0, &r));
    size_t spooled = rp->sketch_len; /* the store owns the item once submitted */
    cr_assert_eq(store_submit(h->store, it), 0);
    struct stage_report in = {.run_id = h->run_id,
                              .stream_id = h->stream_id,
                              .rank = 0,
                              .seq = r.seq,
                              .step = step,
                              .time = r.time_unix,
                              .report = &r,
                              .spool_bytes = spooled};
    cr_assert_eq(stage_feed(h->stage, &in), 0);
}

/* --- reading the outcome ---------------------------------------------------------------- */

struct event {
    char line[1024]; /* rule|layer|head|window|rank|change|step|attribution|evidence */
};

static size_t read_events(const char *path, struct event **out)
{
    sqlite3 *db;
    cr_assert_eq(sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_stmt *q;
    cr_assert_eq(
        sqlite3_prepare_v2(db,
                           "SELECT a.rule, a.layer, a.head, a.\"window\", a.rank, e.change, "
                           "e.step, e.attribution, e.evidence_json FROM alert_events e "
                           "JOIN alerts a ON a.id = e.alert_id ORDER BY a.rule, a.layer, "
                           "a.head, a.\"window\", a.rank, e.id",
                           -1, &q, NULL),
        SQLITE_OK, "%s", sqlite3_errmsg(db));
    size_t n = 0, cap = 0;
    struct event *ev = NULL;
    while (sqlite3_step(q) == SQLITE_ROW) {
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            ev = realloc(ev, cap * sizeof(*ev));
        }
        snprintf(ev[n].line, sizeof(ev[n].line), "%s|%d|%d|%d|%d|%s|%lld|%s|%s",
                 sqlite3_column_text(q, 0), sqlite3_column_int(q, 1), sqlite3_column_int(q, 2),
                 sqlite3_column_int(q, 3), sqlite3_column_int(q, 4), sqlite3_column_text(q, 5),
                 (long long)sqlite3_column_int64(q, 6), sqlite3_column_text(q, 7),
                 sqlite3_column_text(q, 8));
        n++;
    }
    sqlite3_finalize(q);
    sqlite3_close(db);
    *out = ev;
    return n;
}

/* The first event of rule (prefix "rule|layer|") with `change`, or NULL. */
static const struct event *find(const struct event *ev, size_t n, const char *key,
                                const char *change)
{
    char want[96];
    snprintf(want, sizeof(want), "|%s|", change);
    for (size_t i = 0; i < n; i++)
        if (strncmp(ev[i].line, key, strlen(key)) == 0 && strstr(ev[i].line, want))
            return &ev[i];
    return NULL;
}

static long event_step(const struct event *e)
{
    /* rule|layer|head|window|rank|change|STEP|... */
    const char *p = e->line;
    for (int bars = 0; bars < 6; p++)
        bars += *p == '|';
    return strtol(p, NULL, 10);
}

static void rm_db(const char *path)
{
    char x[300];
    unlink(path);
    snprintf(x, sizeof(x), "%s-wal", path);
    unlink(x);
    snprintf(x, sizeof(x), "%s-shm", path);
    unlink(x);
    snprintf(x, sizeof(x), "rm -rf %s.spool", path); /* the spool log beside it */
    cr_expect_eq(system(x), 0);
}

static void tmp_db(char *path, size_t len, const char *tag)
{
    snprintf(path, len, "/tmp/test_stage_%d_%s.db", (int)getpid(), tag);
    rm_db(path);
}

/* Uninterrupted run of the scenario into path. */
static void run_plain(const char *path, int faults)
{
    struct harness h;
    h_open(&h, path);
    for (uint64_t s = 0; s < g_steps; s++) {
        h_step(&h, faults, s);
        if (s % 7 == 0)
            h_settle(&h);
    }
    h_settle(&h);
    h_close(&h);
}

/* The same with a clean stop and restart at `at`. */
static void run_restart(const char *path, int faults, uint64_t at)
{
    struct harness h;
    h_open(&h, path);
    for (uint64_t s = 0; s < at; s++)
        h_step(&h, faults, s);
    h_close(&h); /* SIGTERM-like: in-flight steps finish, the rest stays spooled */
    h_open(&h, path);
    for (uint64_t s = at; s < g_steps; s++)
        h_step(&h, faults, s);
    h_settle(&h);
    h_close(&h);
}

/* The same with a crash at `at`: a child spools and feeds the first part,
 * lets the first `settled` steps be evaluated, and exits without running
 * the loop again (SIGKILL-like). */
static void run_crash(const char *path, int faults, uint64_t settled, uint64_t at)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        struct harness h;
        h_open(&h, path);
        for (uint64_t s = 0; s < at; s++) {
            h_step(&h, faults, s);
            if (s + 1 == settled)
                h_settle(&h);
        }
        store_flush(h.store); /* the reports are committed (acked) ... */
        _exit(0);             /* ... and the daemon dies */
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    struct harness h;
    h_open(&h, path);
    h.seq = at; /* the Welcome's last_seq: the client resends from there */
    for (uint64_t s = at; s < g_steps; s++)
        h_step(&h, faults, s);
    h_settle(&h);
    h_close(&h);
}

static void expect_same(const char *what, const struct event *a, size_t na, const struct event *b,
                        size_t nb)
{
    for (size_t i = 0; i < na || i < nb; i++) {
        const char *x = i < na ? a[i].line : "(none)", *y = i < nb ? b[i].line : "(none)";
        cr_assert_str_eq(x, y, "%s: event %zu differs:\n  uninterrupted %s\n  restarted     %s",
                         what, i, x, y);
    }
}

/* --- the table ------------------------------------------------------------------------ */

static void restart_keeps_training_progress(void);

struct stage_case {
    const char *name;
    int faults;
    /* expectations on the uninterrupted run */
    const char *fires;    /* "rule|layer|head|window|rank|" prefix that must fire, or NULL */
    long fire_step;       /* its to_firing step (-1: any) */
    const char *label;    /* attribution of that to_firing event */
    const char *evidence; /* substring of its evidence */
    const char *resolves; /* prefix that must resolve, or NULL */
    long resolve_step;
    const char *never_fires; /* prefix that must not fire, or NULL */
};

static const struct stage_case cases[] = {
    {"transient dip", F_DIP, NULL, 0, NULL, NULL, NULL, 0, "qk.d2."},
    /* The collapse is below the rank-one floor: two breaches of size fire
     * it (detect.h magnitude_persistence). */
    {"sustained collapse", F_COLLAPSE, "qk.d2.erank|0|-1|1|-1|", T_FAULT + 1, "attention-numerics",
     "\"argmin_head\":1", NULL, 0, "router."},
    {"collapse then recovery", F_RECOVER, "qk.d2.erank|0|-1|1|-1|", T_FAULT + 1,
     "attention-numerics", "\"breach_kind\":\"floor\"", "qk.d2.erank|0|-1|1|-1|", T_FAULT + 5 + 4,
     NULL},
    {"NaN loss", F_NAN, "loss|-1|-1|0|0|", T_FAULT, "non-finite", "\"value\":null", NULL, 0,
     "qk.d2."},
    {"router similarity ramp", F_RAMP, "router.similarity|0|-1|0|-1|", -1,
     "optimizer-hyperparameter", "\"breach_kind\":\"z\"", NULL, 0, "qk.d2."},
    /* Both at once: the step size explains both (alert.c alert_attribute). */
    {"both", F_COLLAPSE | F_RAMP, "qk.d2.erank|0|-1|1|-1|", T_FAULT + 1, "optimizer-hyperparameter",
     NULL, NULL, 0, NULL},
    /* The step 4x with the gradient 4x: too large a step under an
     * adaptive optimizer (or one not named); under SGD the gradient's
     * rise is credited (evaluate.c per_grad_credit: 4x / 2, under 2.5x),
     * and a restart restores the gradient norms it is judged against. */
    {"step with the gradient", F_STEP, "step_update_ratio|-1|-1|0|0|", T_FAULT + 4,
     "optimizer-hyperparameter", NULL, NULL, 0, NULL},
    {"step with the gradient under SGD", F_STEP | F_SGD, "grad_norm|-1|-1|0|0|", T_FAULT + 2,
     "loss-spike", NULL, NULL, 0, "step_update_ratio|"},
};

/* head_points_every thins the per-head series only: the per-layer
 * aggregates keep every step and detection (what fires, when, why) is the
 * same as with every point stored. */
Test(stage, head_points_every_thins_per_head_series_only)
{
    char all[256], thin[256];
    tmp_db(all, sizeof(all), "allpoints");
    tmp_db(thin, sizeof(thin), "thinpoints");
    run_plain(all, F_COLLAPSE);
    t_head_points_every = 10;
    run_plain(thin, F_COLLAPSE);
    t_head_points_every = 0;
    static const char heads[] = "SELECT count(*) FROM points p JOIN series s ON s.id = p.series_id "
                                "WHERE s.head >= 0";
    static const char off_grid[] = "SELECT count(*) FROM points p JOIN series s ON "
                                   "s.id = p.series_id WHERE s.head >= 0 AND p.step % 10 != 0";
    static const char layers[] =
        "SELECT count(*) FROM points p JOIN series s ON s.id = p.series_id "
        "WHERE s.head = -1 AND s.layer >= 0 AND s.rank = -1";
    cr_expect_gt(q1_path(all, heads), 0);
    cr_expect_eq(q1_path(thin, off_grid), 0, "per-head points off the grid");
    cr_expect_eq(q1_path(thin, heads) * 10, q1_path(all, heads), "one step in ten");
    cr_expect_eq(q1_path(thin, layers), q1_path(all, layers), "aggregates at every step");
    struct event *a, *b;
    size_t na = read_events(all, &a), nb = read_events(thin, &b);
    cr_expect_gt(na, 0);
    expect_same("head_points_every", a, na, b, nb);
    free(a);
    free(b);
    rm_db(all);
    rm_db(thin);
}

/* foreshock_monitor_heads_total counts the heads sent as spectrum sketches
 * too: their QK math runs when they arrive, not on a worker, and the
 * counter once saw only the workers' heads (0 for a spectrum-only run). */
Test(stage, spectrum_heads_are_counted)
{
    char path[256];
    tmp_db(path, sizeof(path), "heads");
    struct harness h;
    h_open(&h, path);
    for (uint64_t s = 0; s < 10; s++)
        h_step(&h, F_NONE, s);
    h_settle(&h);
    h_close(&h);
    uint64_t buckets = atomic_load(&h.stats.buckets_evaluated);
    cr_expect_gt(buckets, 0);
    cr_expect_eq(atomic_load(&h.stats.heads_computed), 2 * buckets, "2 heads a step");
    rm_db(path);
}

Test(stage, detection_table_and_restarts, .timeout = 240)
{
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const struct stage_case *sc = &cases[c];
        g_optimizer = sc->faults & F_SGD ? "SGD" : NULL;
        char plain[256], term[256], kill[256];
        tmp_db(plain, sizeof(plain), "plain");
        tmp_db(term, sizeof(term), "term");
        tmp_db(kill, sizeof(kill), "kill");
        run_plain(plain, sc->faults);
        struct event *ev;
        size_t n = read_events(plain, &ev);
        if (sc->fires) {
            const struct event *e = find(ev, n, sc->fires, "to_firing");
            cr_assert_not_null(e, "%s: %s never fired (%zu events)", sc->name, sc->fires, n);
            if (sc->fire_step >= 0)
                cr_expect_eq(event_step(e), sc->fire_step, "%s: %s", sc->name, e->line);
            char lab[64];
            snprintf(lab, sizeof(lab), "|%s|", sc->label);
            cr_expect(strstr(e->line, lab), "%s: want attribution %s: %s", sc->name, sc->label,
                      e->line);
            if (sc->evidence)
                cr_expect(strstr(e->line, sc->evidence), "%s: want %s in %s", sc->name,
                          sc->evidence, e->line);
        } else {
            cr_expect_null(find(ev, n, "", "to_firing"), "%s: something fired", sc->name);
        }
        if (sc->resolves) {
            const struct event *e = find(ev, n, sc->resolves, "to_resolved");
            cr_assert_not_null(e, "%s: %s never resolved", sc->name, sc->resolves);
            cr_expect_eq(event_step(e), sc->resolve_step, "%s: %s", sc->name, e->line);
        }
        if (sc->never_fires)
            cr_expect_null(find(ev, n, sc->never_fires, "to_firing"), "%s: %s fired", sc->name,
                           sc->never_fires);
        if (sc->faults == F_DIP)
            cr_expect_not_null(find(ev, n, "qk.d2.erank|", "to_pending"),
                               "%s: the dip did not even go pending", sc->name);

        /* A restart in the middle of the fault changes nothing. */
        run_restart(term, sc->faults, T_FAULT + 1);
        struct event *ev2;
        size_t n2 = read_events(term, &ev2);
        expect_same(sc->name, ev, n, ev2, n2);
        free(ev2);
        run_crash(kill, sc->faults, T_FAULT - 3, T_FAULT + 1);
        n2 = read_events(kill, &ev2);
        expect_same(sc->name, ev, n, ev2, n2);
        free(ev2);
        free(ev);
        rm_db(plain);
        rm_db(term);
        rm_db(kill);
    }
    g_optimizer = NULL;
    /* In the same test, not a Test of its own: two of these forking tests
     * in parallel Criterion workers made Criterion's runner leak 48 bytes
     * under LeakSanitizer (not with -j1). */
    restart_keeps_training_progress();
}

/* Detection started by training progress survives a crash that left most
 * of the run unevaluated: the LR warm-up ends at step 40, so detection
 * starts at step 120 (EVAL_START_WARMUPS x 40). The crashed daemon
 * evaluated steps up to 50 only (no series had started) and had acked up
 * to 150; the restart re-feeds 50-149 from the spool. It must start them at
 * 120, as the uninterrupted run did, from the learning rates it stored, not
 * from the re-fed steps' constant rate (which would put the warm-up end at
 * 51 and the start at 153: other baselines, other evidence). */
static void restart_keeps_training_progress(void)
{
    char plain[256], kill[256];
    g_progress = true;
    g_steps = 200;
    g_fault = 170;
    tmp_db(plain, sizeof(plain), "progress-plain");
    tmp_db(kill, sizeof(kill), "progress-kill");
    run_plain(plain, F_COLLAPSE);
    struct event *ev, *ev2;
    size_t n = read_events(plain, &ev);
    const struct event *e = find(ev, n, "qk.d2.erank|0|-1|1|-1|", "to_firing");
    cr_assert_not_null(e, "the collapse never fired (%zu events)", n);
    cr_expect_eq(event_step(e), (long)g_fault + 1, "%s", e->line);
    run_crash(kill, F_COLLAPSE, 50, 150);
    size_t n2 = read_events(kill, &ev2);
    expect_same("progress across a crash", ev, n, ev2, n2);
    free(ev);
    free(ev2);
    rm_db(plain);
    rm_db(kill);
}
