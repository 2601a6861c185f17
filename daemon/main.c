/* foreshockd: configuration, startup, the loop, orderly shutdown. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "advice.h"
#include "config.h"
#include "dblock.h"
#include "detect.h"
#include "detect_config.h"
#include "http.h"
#include "ingest.h"
#include "log.h"
#include "monitor_qk.h"
#include "pager.h"
#include "remote_write.h"
#include "run_auth.h"
#include "schema.h"
#include "stage.h"
#include "stats.h"
#include "store.h"
#include "store_read.h"
#include "tls.h"

#define EXIT_OK 0
#define EXIT_RUNTIME 1
#define EXIT_USAGE 2
#define MAX_OVERRIDES 64

static void usage(FILE *f)
{
    fprintf(
        f, "NAME\n"
           "    foreshockd - training-run instability monitor (sidecar daemon)\n"
           "\n"
           "SYNOPSIS\n"
           "    foreshockd [--listen HOST:PORT] [--http HOST:PORT] [--db PATH]\n"
           "               [--config FILE] [--log-level LEVEL] [--set KEY=VALUE ...]\n"
           "    foreshockd --read-only --db ARCHIVE [--http HOST:PORT] [--config FILE] ...\n"
           "    foreshockd --help | --version\n"
           "\n"
           "DESCRIPTION\n"
           "    Receives sketches from trainer ranks over TCP (length-prefixed protobuf,\n"
           "    proto/foreshock.proto), stores them in SQLite (WAL), acknowledges each\n"
           "    report only after it is committed, and serves a JSON API over HTTP.\n"
           "    Once both listeners are bound and the database is open it logs one line:\n"
           "        foreshockd ready ingest=HOST:PORT http=HOST:PORT db=PATH pid=PID\n"
           "    Logs go to stderr, one line each: TIME(UTC) LEVEL MODULE: MESSAGE.\n"
           "\n"
           "OPTIONS\n"
           "    --listen HOST:PORT   ingest address (default " FS_DEF_LISTEN "); port 0 picks one\n"
           "    --http HOST:PORT     HTTP API address (default " FS_DEF_HTTP "); port 0 picks one\n"
           "    --db PATH            database file, created if absent (default " FS_DEF_DB ")\n"
           "    --config FILE        read settings from FILE (INI style, see below)\n"
           "    --log-level LEVEL    debug | info | warn | error (default info)\n"
           "    --set KEY=VALUE      set any configuration key (repeatable)\n"
           "    --read-only          serve the database (an archive: foreshock archive) over\n"
           "                         HTTP only: API, dashboard, /metrics. No ingest, no writer,\n"
           "                         no monitors, no pager, no lock; write routes answer 403.\n"
           "                         The ready line reads `foreshockd ready read-only http=...`\n"
           "    -h, --help           print this text and exit 0\n"
           "    -V, --version        print the version and exit 0\n"
           "    Command-line options override the configuration file.\n"
           "\n"
           "CONFIGURATION FILE\n"
           "    Lines of `key = value`; `#` or `;` starts a comment; [section] headers\n"
           "    hold per-module settings. Keys:\n");
    config_print_keys(f);
    fprintf(f, "    Byte sizes accept K, M, G, T suffixes (binary multiples).\n"
               "    Detector rules (docs/monitors.md section 4) are tuned per rule in\n"
               "    sections [detect \"RULE\"], RULE one of qk.d2.erank, qk.d2.entropy,\n"
               "    qk.d2.srank, qk.cqk, router.similarity, router.centered_energy,\n"
               "    router.zloss, router.maxvio, router.load_entropy, weight_norm,\n"
               "    update_ratio, step_update_ratio, lr, loss, grad_norm; keys: warmup,\n"
               "    warmup_steps, window, z, floor, ceiling, spike_ratio, rise_ratio,\n"
               "    floor_rel, persistence, magnitude_persistence, cross_layer_windows,\n"
               "    early_grad_rise, nonfinite_persistence, scale_rel, scale_rel_long,\n"
               "    resolve_after,\n"
               "    severity, enabled, trend,\n"
               "    early_baseline, per_lr, within_peak, still_rewarms.\n"
               "    Paging targets (up to 16) are sections [target \"NAME\"] with keys type\n"
               "    (alertmanager | pagerduty | webhook), url, routing_key, secret,\n"
               "    min_severity, match, timeout, connect_timeout, backoff_initial,\n"
               "    backoff_max, give_up_after, resend_interval (seconds); docs/alerting.md.\n"
               "    Advice to trainers (docs/alerting.md) is section [advice] with keys\n"
               "    enabled (true | false) and LABEL or LABEL.SEVERITY = checkpoint |\n"
               "    checkpoint_and_stop | none, LABEL an attribution (attention-numerics,\n"
               "    optimizer-hyperparameter, combined, router-balance, non-finite,\n"
               "    loss-spike, none), SEVERITY warning or critical.\n"
               "\n"
               "SIGNALS\n"
               "    SIGTERM, SIGINT  orderly stop: stop accepting, commit and ack what was\n"
               "                     received, close connections, stop HTTP, close the database.\n"
               "                     A second signal during the stop exits at once with status 1.\n"
               "    SIGPIPE          ignored.\n"
               "\n"
               "EXIT STATUS\n"
               "    0  clean stop after a signal\n"
               "    1  runtime failure (cannot bind, cannot open the database, ...)\n"
               "    2  bad usage or configuration (the message names the key and line)\n");
}

struct app {
    uv_loop_t loop;
    uv_signal_t sig_term, sig_int;
    struct fs_config cfg;
    struct fs_stats stats;
    struct store *store;
    struct ingest *ingest;
    struct http *http;
    struct stage *stage;
    struct detect_rules rules; /* defaults + [detect "RULE"] overrides; read-only once running */
    struct pager_config pager_cfg; /* [target "NAME"] sections */
    struct advice_policy advice;   /* [advice]; read-only once running */
    struct pager *pager;
    struct rw_config rw_cfg;                              /* [remote_write] */
    struct remote_write *rw;                              /* NULL: remote write off */
    char rw_json[RW_MAX_TARGETS * (RW_NAME_MAX + 3) + 3]; /* the targets' names, JSON */
    struct run_auth run_auth; /* [run "PATTERN"] tokens; read-only once running */
    struct tls_server *tls;   /* ingest TLS, NULL: plain TCP */
    int dblock;               /* descriptor of the database lock, -1: not held */
    int stopping;
    int read_only; /* --read-only: HTTP over an archive, nothing else */
    int loop_ok;   /* the event loop was created: close it at the end */
    int status;    /* the exit status so far (a stop step may change it) */
};

static void on_stage_done(void *ctx)
{
    struct app *app = ctx;
    uv_close((uv_handle_t *)&app->sig_term, NULL);
    uv_close((uv_handle_t *)&app->sig_int, NULL);
}

/* Ingest has committed and acked what it received: let the monitor jobs
 * already on the workers finish and queue their rows before the loop ends
 * (the store drains after it). */
static void on_ingest_done(void *ctx)
{
    struct app *app = ctx;
    stage_stop(app->stage, on_stage_done, app);
}

static void on_signal(uv_signal_t *h, int signum)
{
    struct app *app = h->data;
    if (app->stopping) {
        log_error("main", "%s during shutdown: exiting now", strsignal(signum));
        _exit(EXIT_RUNTIME);
    }
    app->stopping = 1;
    log_info("main", "%s: stopping", strsignal(signum));
    if (app->read_only) { /* nothing to drain: the loop ends with the signals */
        atomic_store(&app->stats.ready, 0);
        on_stage_done(app);
        return;
    }
    store_set_serving(app->store, 0);
    /* A full disk must not hold the stop forever: past the bound, what
     * cannot be committed is given up (never acked: clients resend it). */
    store_set_stop_deadline(app->store, app->cfg.shutdown_timeout_s);
    atomic_store(&app->stats.ready, 0);
    ingest_stop(app->ingest, on_ingest_done, app);
}

/* One --set KEY=VALUE or named flag (--listen, --http, --db, --log-level),
 * applied over the file's settings. */
struct override {
    const char *key;
    const char *value;
    char buf[FS_CONFIG_MAX_LINE];
};

/* Reads the command line's flags: the overrides into ov[*n] (at most
 * MAX_OVERRIDES), the config file's path, --read-only. Returns -1 to continue,
 * or an exit status (--help, --version, bad usage: the message printed). */
static int read_flags(int argc, char **argv, struct override *ov, int *n_out,
                      const char **config_path, int *read_only)
{
    static const struct option longopts[] = {
        {"listen", required_argument, NULL, 'l'},
        {"http", required_argument, NULL, 't'},
        {"db", required_argument, NULL, 'd'},
        {"config", required_argument, NULL, 'c'},
        {"log-level", required_argument, NULL, 'L'},
        {"set", required_argument, NULL, 's'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {"read-only", no_argument, NULL, 'R'},
        {NULL, 0, NULL, 0},
    };
    int n = 0, status = -1;
    int opt;
    while (status < 0 && (opt = getopt_long(argc, argv, "hV", longopts, NULL)) != -1) {
        const char *key = NULL;
        switch (opt) {
        case 'h':
            usage(stdout);
            status = EXIT_OK;
            continue;
        case 'V':
            printf("foreshockd %s\n", FORESHOCK_VERSION);
            status = EXIT_OK;
            continue;
        case 'c':
            *config_path = optarg;
            continue;
        case 'R':
            *read_only = 1;
            continue;
        case 'l':
            key = "listen";
            break;
        case 't':
            key = "http";
            break;
        case 'd':
            key = "db";
            break;
        case 'L':
            key = "log_level";
            break;
        case 's':
            break;
        default:
            fprintf(stderr, "foreshockd: try --help\n");
            status = EXIT_USAGE;
            continue;
        }
        if (n == MAX_OVERRIDES) {
            fprintf(stderr, "foreshockd: more than %d options\n", MAX_OVERRIDES);
            status = EXIT_USAGE;
            continue;
        }
        snprintf(ov[n].buf, sizeof(ov[n].buf), "%s", optarg);
        if (key) {
            ov[n].key = key;
            ov[n].value = ov[n].buf;
        } else {
            char *eq = strchr(ov[n].buf, '=');
            if (!eq) {
                fprintf(stderr, "foreshockd: --set needs KEY=VALUE, got '%s'\n", optarg);
                status = EXIT_USAGE;
                continue;
            }
            *eq = '\0';
            ov[n].key = ov[n].buf;
            ov[n].value = eq + 1;
        }
        n++;
    }
    if (status < 0 && optind < argc) {
        fprintf(stderr, "foreshockd: unexpected argument '%s'; try --help\n", argv[optind]);
        status = EXIT_USAGE;
    }
    *n_out = n;
    return status;
}

/* Reads options into cfg (file first, then flags). Returns -1 to continue,
 * or an exit status. */
static int parse_args(int argc, char **argv, struct fs_config *cfg, struct detect_rules *rules,
                      struct pager_config *pager_cfg, struct run_auth *run_auth, int *read_only,
                      struct advice_policy *advice, struct rw_config *rw_cfg)
{
    struct override *ov = calloc(MAX_OVERRIDES, sizeof(*ov));
    if (!ov)
        return EXIT_RUNTIME;
    int n = 0;
    const char *config_path = NULL;
    int status = read_flags(argc, argv, ov, &n, &config_path, read_only);
    struct fs_err err = {0};
    config_defaults(cfg);
    detect_rules_default(rules);
    advice_policy_default(advice);
    struct config_section sections[5];
    detect_config_section(rules, &sections[0]);
    pager_target_section(pager_cfg, &sections[1]);
    run_auth_section(run_auth, &sections[2]);
    advice_section(advice, &sections[3]);
    rw_config_section(rw_cfg, &sections[4]);
    if (config_path) {
        snprintf(pager_cfg->origin, sizeof(pager_cfg->origin), "%s", config_path);
        snprintf(rw_cfg->origin, sizeof(rw_cfg->origin), "%s", config_path);
    }
    if (status < 0 && config_path && config_load_file(config_path, cfg, sections, 5, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        status = EXIT_USAGE;
    }
    for (int i = 0; status < 0 && i < n; i++) {
        if (config_set(cfg, ov[i].key, ov[i].value, "command line", &err) < 0) {
            fprintf(stderr, "%s\n", err.msg);
            status = EXIT_USAGE;
        }
    }
    if (status < 0 && config_check(cfg, config_path ? config_path : "command line", &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        status = EXIT_USAGE;
    }
    if (status < 0 && run_auth_check(run_auth, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        status = EXIT_USAGE;
    }
    if (status < 0 && rw_config_check(rw_cfg, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        status = EXIT_USAGE;
    }
    if (status < 0 && pager_config_check(pager_cfg, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        status = EXIT_USAGE;
    }
    if (status < 0 && cfg->public_url[0] && strncmp(cfg->public_url, "http://", 7) != 0 &&
        strncmp(cfg->public_url, "https://", 8) != 0) {
        fprintf(stderr, "config: %s: key 'public_url': must start with http:// or https://\n",
                config_path ? config_path : "command line");
        status = EXIT_USAGE;
    }
    free(ov);
    return status;
}

static void endpoint_text(char *out, size_t len, const char *host, unsigned port)
{
    snprintf(out, len, strchr(host, ':') ? "[%s]:%u" : "%s:%u", host, port);
}

/* What the HTTP server takes from the configuration, in both modes. */
static struct http_opts http_opts_of(const struct fs_config *cfg, struct app *app)
{
    return (struct http_opts){
        .host = cfg->http.host,
        .port = cfg->http.port,
        .db_path = cfg->db,
        .threads = (unsigned)cfg->http_threads,
        .stats = &app->stats,
        .read_token = cfg->http_read_token,
        .write_token = cfg->http_write_token,
        .metrics_max_runs = (unsigned)cfg->metrics_max_runs,
        .metrics_run_max_age = cfg->metrics_run_max_age,
        .tls_cert_file = cfg->http_tls_cert,
        .tls_key_file = cfg->http_tls_key,
    };
}

/* SIGTERM and SIGINT start the orderly stop (on_signal), in both modes. */
static void start_signals(struct app *app)
{
    uv_signal_init(&app->loop, &app->sig_term);
    uv_signal_init(&app->loop, &app->sig_int);
    app->sig_term.data = app->sig_int.data = app;
    uv_signal_start(&app->sig_term, on_signal, SIGTERM);
    uv_signal_start(&app->sig_int, on_signal, SIGINT);
}

/* --read-only: the HTTP threads over an archive, until a signal. The
 * database is never written (opened read-only, not migrated, not locked:
 * many such daemons may serve one archive, beside a live daemon too).
 * Returns an exit status. */
static int serve_read_only(struct app *app)
{
    const struct fs_config *cfg = &app->cfg;
    struct fs_err err = {0};
    struct store_reader *rd;
    if (store_reader_open(cfg->db, &rd, &err) < 0) {
        log_error("main", "--read-only: %s", err.msg);
        return EXIT_RUNTIME;
    }
    int version = store_reader_version(rd);
    store_reader_close(rd);
    /* The HTTP queries name this build's columns; an older archive is
     * migrated by a read-write daemon on a copy, never here. */
    if (version != schema_migration_count) {
        log_error("main",
                  "--read-only: %s has schema version %d, this foreshockd reads %d: "
                  "migrate a copy first (foreshockd --db COPY, then stop it)",
                  cfg->db, version, schema_migration_count);
        return EXIT_RUNTIME;
    }
    struct http_opts ho = http_opts_of(cfg, app);
    ho.read_only = true;
    if (http_start(&ho, &app->http, &err) < 0) {
        log_error("main", "%s", err.msg);
        return EXIT_RUNTIME;
    }
    start_signals(app);
    atomic_store(&app->stats.ready, 1);
    char http_ep[FS_CONFIG_MAX_HOST + 16];
    endpoint_text(http_ep, sizeof(http_ep), cfg->http.host, http_port(app->http));
    log_info("main",
             "read-only: serving %s over HTTP (API, dashboard, metrics); no ingest, "
             "writer, monitors or pager; write routes answer 403",
             cfg->db);
    log_info("main", "foreshockd ready read-only http=%s db=%s pid=%ld", http_ep, cfg->db,
             (long)getpid());
    uv_run(&app->loop, UV_RUN_DEFAULT);
    return EXIT_OK;
}

/* The start steps of the read-write daemon, in order (below). Each returns 0,
 * or a negative code with err filled: main logs err.msg and exits
 * EXIT_RUNTIME after the stop steps. */

/* Ingest TLS (cert and key read now, so that a bad file fails the start), and
 * a note on the [run] token sections. */
static int start_ingest_auth(struct app *app, struct fs_err *err)
{
    const struct fs_config *cfg = &app->cfg;
    if (cfg->tls_cert[0]) {
        struct tls_server_opts to = {
            .cert_file = cfg->tls_cert, .key_file = cfg->tls_key, .ca_file = cfg->tls_client_ca};
        int rc = tls_server_new(&to, &app->tls, err);
        if (rc < 0)
            return rc;
        log_info("main", "ingest: TLS (%s)%s", cfg->tls_cert,
                 cfg->tls_client_ca[0] ? "; client certificates required (tls_client_ca)" : "");
    }
    if (app->run_auth.n)
        log_info("main", "ingest: %zu [run] token sections; other runs %s", app->run_auth.n,
                 cfg->token[0] ? "need the global token" : "need no token (token is empty)");
    return 0;
}

/* One daemon per database: the second would split streams and page twice. */
static int start_dblock(struct app *app, struct fs_err *err)
{
    app->dblock = dblock_acquire(app->cfg.db, err);
    return app->dblock < 0 ? -1 : 0;
}

/* The writer, with the pager's and the advice's rows registered before the
 * first transition. */
static int start_store(struct app *app, struct fs_err *err)
{
    const struct fs_config *cfg = &app->cfg;
    /* Retention keeps a run until every remote-write target sent it. */
    size_t jl = (size_t)snprintf(app->rw_json, sizeof(app->rw_json), "[");
    for (size_t i = 0; i < app->rw_cfg.n; i++) /* names are [A-Za-z0-9_.-]: no escapes */
        jl += (size_t)snprintf(app->rw_json + jl, sizeof(app->rw_json) - jl, "%s\"%s\"",
                               i ? "," : "", app->rw_cfg.t[i].name);
    snprintf(app->rw_json + jl, sizeof(app->rw_json) - jl, "]");
    struct store_opts so = {
        .synchronous_full = cfg->synchronous == CONFIG_SYNC_FULL,
        .max_runs = cfg->max_runs,
        .queue_max_items = cfg->writer_queue_max_items,
        .queue_max_bytes = cfg->writer_queue_max_bytes,
        .batch_max_items = cfg->writer_batch_max_items,
        .stats = &app->stats,
        .outbox_retention_s = cfg->outbox_retention,
        .silence_retention_s = cfg->silence_retention,
        .run_idle_end_s = cfg->run_idle_end_s,
        .run_retention_s = cfg->run_retention_s,
        .rw_targets_json = app->rw_json,
        .run_hello_grace_s = cfg->run_hello_grace_s,
        .max_runs_per_token = cfg->max_runs_per_token,
    };
    int rc = store_open(cfg->db, &so, &app->store, err);
    if (rc < 0)
        return rc;
    /* Outbox rows for the targets from the first transition on (the spool
     * re-feed below included); the pager thread starts once HTTP is bound. */
    pager_name_stats(&app->pager_cfg, &app->stats);
    pager_register(&app->pager_cfg, app->store);
    /* Advice rows for the transitions from the first one on, likewise. */
    store_set_advice(app->store, &app->advice);
    return 0;
}

/* The monitor stage and its workers. Persisted detector/alert state and the
 * spool re-feed come before ingest accepts a connection. */
static int start_stage(struct app *app, struct fs_err *err)
{
    const struct fs_config *cfg = &app->cfg;
    monitor_init(); /* one OpenBLAS thread: parallelism comes from the workers */
    /* The workers are libuv's threadpool, sized once by the environment
     * before its first use (the stage's first job). */
    long threads =
        cfg->monitor_threads ? (long)cfg->monitor_threads : sysconf(_SC_NPROCESSORS_ONLN);
    if (threads < 1)
        threads = 1;
    if (threads > (long)FS_CAP_MONITOR_THREADS)
        threads = FS_CAP_MONITOR_THREADS;
    char nthreads[16];
    snprintf(nthreads, sizeof(nthreads), "%ld", threads);
    if (cfg->monitor_threads || !getenv("UV_THREADPOOL_SIZE"))
        setenv("UV_THREADPOOL_SIZE", nthreads, 1);
    struct stage_opts sto = {
        .loop = &app->loop,
        .store = app->store,
        .stats = &app->stats,
        .rules = &app->rules,
        .reduce_timeout_s = cfg->reduce_timeout_s,
        .reduce_max_bytes = cfg->reduce_max_bytes,
        .max_run_bytes = cfg->max_run_bytes,
        .spool_max_bytes = cfg->spool_max_bytes,
        .spool_run_max_bytes = cfg->spool_run_max_bytes,
        .head_points_every = cfg->head_points_every,
        .detect_from_step = cfg->detect_from_step,
        .max_chunks = (unsigned)(2 * threads), /* two per thread evens out uneven heads */
        .stop_timeout_s = cfg->shutdown_timeout_s,
    };
    int rc = stage_create(&sto, &app->stage, err);
    return rc < 0 ? rc : stage_load(app->stage, cfg->db, err);
}

static int start_ingest(struct app *app, struct fs_err *err)
{
    const struct fs_config *cfg = &app->cfg;
    struct ingest_opts io = {
        .host = cfg->listen.host,
        .port = cfg->listen.port,
        .max_connections = cfg->max_connections,
        .max_unauthenticated = cfg->max_unauthenticated,
        .max_unauthenticated_per_address = cfg->max_unauthenticated_per_address,
        .max_conn_buffer_bytes = cfg->max_conn_buffer_bytes,
        .frame_buffer_max_bytes = cfg->frame_buffer_max_bytes,
        .token = cfg->token,
        .store = app->store,
        .stats = &app->stats,
        .stage = app->stage,
        .hello_timeout_s = cfg->hello_timeout_s,
        .frame_timeout_s = cfg->frame_timeout_s,
        .tls = app->tls,
        .run_auth = &app->run_auth,
    };
    decode_limits_default(&io.limits, (uint32_t)cfg->max_frame_bytes);
    return ingest_start(&app->loop, &io, &app->ingest, err);
}

static int start_http(struct app *app, struct fs_err *err)
{
    struct http_opts ho = http_opts_of(&app->cfg, app);
    ho.store = app->store; /* silences API, auth, /metrics */
    return http_start(&ho, &app->http, err);
}

/* The pager thread, once HTTP is bound: its pages link to the bound port
 * unless public_url is set. */
static int start_pager(struct app *app, struct fs_err *err)
{
    const struct fs_config *cfg = &app->cfg;
    char public_url[FS_CONFIG_MAX_URL + FS_CONFIG_MAX_HOST + 16];
    if (cfg->public_url[0]) {
        snprintf(public_url, sizeof(public_url), "%s", cfg->public_url);
    } else {
        char ep[FS_CONFIG_MAX_HOST + 16];
        endpoint_text(ep, sizeof(ep), cfg->http.host, http_port(app->http));
        snprintf(public_url, sizeof(public_url), "%s://%s",
                 cfg->http_tls_cert[0] ? "https" : "http", ep);
    }
    struct pager_opts po = {.cfg = &app->pager_cfg,
                            .public_url = public_url,
                            .db_path = cfg->db,
                            .store = app->store,
                            .stats = &app->stats};
    return pager_start(&po, &app->pager, err);
}

static int start_remote_write(struct app *app, struct fs_err *err)
{
    return remote_write_start(&app->rw_cfg, app->cfg.db, app->store, &app->stats, &app->rw, err);
}

struct start_step {
    const char *name; /* what starts, for the reader */
    int (*start)(struct app *app, struct fs_err *err);
};

/* In this order: each step uses what the ones above it started. */
static const struct start_step start_steps[] = {
    {.name = "ingest TLS and tokens", .start = start_ingest_auth},
    {.name = "database lock", .start = start_dblock},
    {.name = "store (writer)", .start = start_store},
    {.name = "monitor stage", .start = start_stage},
    {.name = "ingest", .start = start_ingest},
    {.name = "http", .start = start_http},
    {.name = "pager", .start = start_pager},
    {.name = "remote write", .start = start_remote_write},
};

/* The stop steps, in this order, after the loop ended or a start step failed;
 * each is a no-op for what never started. Not the start order reversed: HTTP
 * stops first (no request reaches a stopping writer), ingest and the stage
 * before the pager and remote write (these send what the stage's last
 * transitions queued, and go through the writer), the writer after them. */

static void stop_http(struct app *app)
{
    http_stop(app->http);
}

/* Startup failed after ingest bound or the stage started: close their
 * handles, then let the loop finish. Both before the one uv_run: the stage's
 * repeating sweep timer kept a loop run for ingest alone going for ever (an
 * HTTP port in use hung the start instead of exiting 1). */
static void stop_loop_handles(struct app *app)
{
    if (app->status == EXIT_OK || (!app->ingest && !app->stage))
        return;
    if (app->ingest)
        ingest_stop(app->ingest, NULL, NULL);
    if (app->stage)
        stage_stop(app->stage, NULL, NULL);
    uv_run(&app->loop, UV_RUN_DEFAULT);
}

static void stop_ingest(struct app *app)
{
    ingest_free(app->ingest);
}

static void stop_stage(struct app *app)
{
    stage_free(app->stage);
}

/* The pager's last outcomes and the remote-write cursors go through the
 * writer: stop them before it. */
static void stop_remote_write(struct app *app)
{
    remote_write_stop(app->rw);
}

static void stop_pager(struct app *app)
{
    pager_stop(app->pager);
}

static void stop_store(struct app *app)
{
    if (store_close(app->store) < 0 && app->status == EXIT_OK) {
        log_error("main", "stopped, but storage failed: what was received after the last "
                          "commit was not written (never acknowledged; clients resend it)");
        app->status = EXIT_RUNTIME;
    }
}

static void stop_ingest_tls(struct app *app)
{
    tls_server_free(app->tls);
}

static void stop_dblock(struct app *app)
{
    dblock_release(app->dblock);
}

static void stop_event_loop(struct app *app)
{
    if (app->loop_ok && uv_loop_close(&app->loop) != 0)
        log_warn("main", "event loop closed with handles still open");
}

struct stop_step {
    const char *name; /* what stops, for the reader */
    void (*stop)(struct app *app);
};

static const struct stop_step stop_steps[] = {
    {.name = "http", .stop = stop_http},
    {.name = "ingest and stage handles (failed start)", .stop = stop_loop_handles},
    {.name = "ingest", .stop = stop_ingest},
    {.name = "monitor stage", .stop = stop_stage},
    {.name = "remote write", .stop = stop_remote_write},
    {.name = "pager", .stop = stop_pager},
    {.name = "store (writer)", .stop = stop_store},
    {.name = "ingest TLS", .stop = stop_ingest_tls},
    {.name = "database lock", .stop = stop_dblock},
    {.name = "event loop", .stop = stop_event_loop},
};

/* The read-write daemon: the start steps, then the loop until ingest and the
 * signals are closed. Returns an exit status. */
static int serve(struct app *app)
{
    const struct fs_config *cfg = &app->cfg;
    struct fs_err err = {0};
    for (size_t i = 0; i < sizeof(start_steps) / sizeof(start_steps[0]); i++) {
        if (start_steps[i].start(app, &err) < 0) {
            log_error("main", "%s", err.msg);
            return EXIT_RUNTIME;
        }
    }
    start_signals(app);

    store_set_serving(app->store, 1);
    atomic_store(&app->stats.ready, 1);
    char ingest_ep[FS_CONFIG_MAX_HOST + 16], http_ep[FS_CONFIG_MAX_HOST + 16];
    endpoint_text(ingest_ep, sizeof(ingest_ep), cfg->listen.host, ingest_port(app->ingest));
    endpoint_text(http_ep, sizeof(http_ep), cfg->http.host, http_port(app->http));
    log_info("main", "foreshockd ready ingest=%s http=%s db=%s pid=%ld", ingest_ep, http_ep,
             cfg->db, (long)getpid());

    uv_run(&app->loop, UV_RUN_DEFAULT); /* until ingest and signals are closed */
    return EXIT_OK;
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    struct app *app = calloc(1, sizeof(*app));
    if (!app) {
        fprintf(stderr, "foreshockd: out of memory\n");
        return EXIT_RUNTIME;
    }
    int status = parse_args(argc, argv, &app->cfg, &app->rules, &app->pager_cfg, &app->run_auth,
                            &app->read_only, &app->advice, &app->rw_cfg);
    if (status >= 0) {
        free(app);
        return status;
    }
    log_set_level((enum log_level)app->cfg.log_level);
    app->status = EXIT_RUNTIME;
    app->dblock = -1;
    app->loop_ok = uv_loop_init(&app->loop) == 0;
    if (!app->loop_ok)
        log_error("main", "cannot create the event loop");
    else if (app->read_only)
        app->status = serve_read_only(app);
    else
        app->status = serve(app);
    for (size_t i = 0; i < sizeof(stop_steps) / sizeof(stop_steps[0]); i++)
        stop_steps[i].stop(app);
    if (app->status == EXIT_OK)
        log_info("main", "stopped");
    status = app->status;
    free(app);
    return status;
}
