/* `foreshock backtest`: re-evaluates stored runs with the daemon's own
 * detection and alert code (daemon/evaluate.c, the engine the live monitor
 * stage runs) under any settings, and prints the alerts they would have
 * raised. The input is a Foreshock database (read-only, safe beside a
 * running daemon) or recordings, which are first streamed into a throwaway
 * daemon (foreshockd beside this binary, or on PATH) that computes their
 * monitors. That daemon and its temporary directory never outlive the
 * command: SIGINT, SIGTERM or SIGHUP kill it by its PID and remove the
 * directory, and it dies with this process (PR_SET_PDEATHSIG) even of
 * SIGKILL.
 *
 * Settings: the rule table starts from the built-in defaults; --config
 * reads a daemon configuration file ([detect "RULE"] sections and
 * detect_from_step count, everything else is accepted and ignored) and
 * --set RULE.KEY=VALUE overrides one rule key, as a [detect] line would.
 * Single-threaded. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "foreshock.h"
#include "config.h"
#include "detect.h"
#include "detect_config.h"
#include "evaluate.h"
#include "pager.h"
#include "run_auth.h"
#include "stage.h"
#include "store_read.h"

#define BACKTEST_MAX_SETS 256  /* --set options */
#define BACKTEST_MAX_RUNS 4096 /* --run options */
#define BACKTEST_MAX_RECORDINGS 1024
#define BACKTEST_DAEMON_WAIT_S 30 /* for the throwaway daemon's ready line */

#define BACKTEST_MAX_WINDOWS 16

struct backtest_settings {
    const char *db, *config;
    int json, all_events;
    /* What a trainer with other Monitor settings would have sent: only these
     * windows (n_windows 0: all) and sketch steps that are multiples of
     * every (0: all). Recordings made rich (several windows, a short
     * cadence) can so be replayed as any subset. */
    int32_t windows[BACKTEST_MAX_WINDOWS];
    size_t n_windows;
    uint64_t every;
};

struct incident {
    const struct eval_track *t;
    struct alert_transition fired;
    enum alert_attribution attr;
    char why[EVAL_WHY_MAX];
    int64_t resolved_step; /* -1: still firing at the end */
};

struct run_ctx {
    const struct backtest_settings *st;
    struct eval_run er;
    struct eval_batch batch;
    int64_t detect_from;
    uint32_t lead_rank; /* whose scalars the daemon detected (store_run_info) */
    /* Detected series --windows left out, and their distinct windows (the
     * first BACKTEST_MAX_WINDOWS): said on stderr, since a run sent at
     * other windows than those asked for loses its attention series. */
    uint32_t dropped;
    int32_t dropped_windows[BACKTEST_MAX_WINDOWS];
    size_t n_dropped_windows;
};

/* ---- settings ---------------------------------------------------------------- */

/* RULE.KEY=VALUE -> rule (up to the last '.' before '='), key, value. */
static int apply_set(struct detect_rules *rules, struct fs_config *cfg, const char *arg, char *err,
                     size_t errlen)
{
    char buf[DETECT_NAME_MAX + DETECT_VALUE_MAX + 64];
    if (strlen(arg) >= sizeof(buf)) {
        snprintf(err, errlen, "--set '%.40s...': too long", arg);
        return -EINVAL;
    }
    snprintf(buf, sizeof(buf), "%s", arg);
    char *eq = strchr(buf, '=');
    if (!eq) {
        snprintf(err, errlen, "--set '%s': want RULE.KEY=VALUE or detect_from_step=N", arg);
        return -EINVAL;
    }
    *eq = '\0';
    char *dot = strrchr(buf, '.');
    if (!dot) { /* a top-level daemon key (detect_from_step) */
        struct fs_err ce = {0};
        if (config_set(cfg, buf, eq + 1, "--set", &ce) < 0) {
            snprintf(err, errlen, "%.500s", ce.msg);
            return -EINVAL;
        }
        return 0;
    }
    *dot = '\0';
    struct fs_err de = {0};
    int rc = detect_rules_set(rules, buf, dot + 1, eq + 1, &de);
    if (rc == -ENOENT)
        snprintf(err, errlen, "--set '%s': no rule '%s' (rules: foreshockd --help)", arg, buf);
    else if (rc < 0)
        snprintf(err, errlen, "--set '%s': %.160s", arg, de.msg);
    return rc;
}

/* ---- evaluation of one run ------------------------------------------------------- */

/* The lead rank's learning rate: training progress, as the live stage sees it. */
static bool is_lr(const struct run_ctx *rc, const struct store_series_key *k)
{
    return strcmp(k->name, "lr") == 0 && k->rank == (int32_t)rc->lead_rank && k->layer == -1;
}

static void note_dropped(struct run_ctx *rc, int32_t window)
{
    rc->dropped++;
    for (size_t i = 0; i < rc->n_dropped_windows; i++)
        if (rc->dropped_windows[i] == window)
            return;
    if (rc->n_dropped_windows < BACKTEST_MAX_WINDOWS)
        rc->dropped_windows[rc->n_dropped_windows++] = window;
}

static bool want_series(void *ctx, const struct store_series_key *k)
{
    struct run_ctx *rc = ctx;
    char rule[DETECT_NAME_MAX];
    if (is_lr(rc, k))
        return true;
    if (!eval_input_rule(rc->er.rules, k, rc->lead_rank, rule, sizeof(rule)))
        return false;
    if (k->window > 0 && rc->st->n_windows) {
        bool kept = false;
        for (size_t i = 0; i < rc->st->n_windows && !kept; i++)
            kept = rc->st->windows[i] == k->window;
        if (!kept)
            note_dropped(rc, k->window);
        return kept;
    }
    return true;
}

/* Sent only at sketch steps: attention aggregates, router series, and the
 * per-layer norms the Monitor sends with each sketch. */
static bool sketch_series(const struct store_series_key *k)
{
    return k->window > 0 || strncmp(k->name, "router.", 7) == 0 ||
           strcmp(k->name, "weight_norm") == 0 || strcmp(k->name, "update_ratio") == 0;
}

static int feed_point(void *ctx, const struct store_series_key *k, uint64_t step, double value,
                      bool present)
{
    struct run_ctx *rc = ctx;
    if (rc->st->every && sketch_series(k) && step % rc->st->every != 0)
        return 0;
    /* The daemon's own path (a rewind rebuilds its state with it too). */
    int r = eval_feed_stored(&rc->er, &rc->batch, k, step, value, present, rc->lead_rank,
                             rc->detect_from);
    return r < 0 ? r : 0;
}

static json_t *jnum(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static json_t *jopt(int32_t v, int32_t none)
{
    return v == none ? json_null() : json_integer(v);
}

/* "layer=L head=H window=W" with the labels the series has, or "-". Three
 * labels of at most 18 bytes each always fit the callers' 96 bytes. */
static void scope_text(const struct store_series_key *k, char *out, size_t len)
{
    char layer[24] = "", head[24] = "", window[24] = "";
    if (k->layer >= 0)
        snprintf(layer, sizeof(layer), "layer=%d", k->layer);
    if (k->head >= 0)
        snprintf(head, sizeof(head), "%shead=%d", layer[0] ? " " : "", k->head);
    if (k->window > 0)
        snprintf(window, sizeof(window), "%swindow=%d", layer[0] || head[0] ? " " : "", k->window);
    snprintf(out, len, "%s%s%s", layer, head, window);
    if (!out[0])
        snprintf(out, len, "-");
}

/* Evaluates one run and prints (or appends to arr) its incidents. Returns 0
 * or a negative errno with err. */
static int backtest_run(struct store_reader *rd, const struct store_run_info *run,
                        const struct detect_rules *rules, int64_t detect_from,
                        const struct backtest_settings *st, json_t *arr, struct table *tab,
                        char *err, size_t errlen)
{
    struct run_ctx rc = {.st = st, .detect_from = detect_from, .lead_rank = run->lead_rank};
    struct incident *inc = NULL;
    size_t n_inc = 0;
    int r;

    eval_run_init(&rc.er, rules);
    rc.er.update_follows_grad = eval_optimizer_follows_grad(run->optimizer);
    struct fs_err rerr = {0};
    r = store_reader_points(rd, run->id, want_series, feed_point, &rc, &rerr);
    if (r < 0)
        snprintf(err, errlen, "%.511s", rerr.msg);
    if (r == -ENOMEM && !err[0])
        snprintf(err, errlen, "out of memory");
    if (r < 0)
        goto out;
    if (rc.dropped) {
        char list[BACKTEST_MAX_WINDOWS * 12] = "";
        size_t used = 0;
        for (size_t i = 0; i < rc.n_dropped_windows && used < sizeof(list); i++)
            used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%d", i ? "," : "",
                                     rc.dropped_windows[i]);
        fprintf(stderr,
                "foreshock backtest: run %s: %u detected series of window(s) %s left out "
                "(not in --windows)\n",
                run->name, rc.dropped, list);
    }
    eval_label_all(&rc.er, &rc.batch);
    if (rc.batch.oom) {
        snprintf(err, errlen, "run %s: out of memory recording alert events", run->name);
        r = -ENOMEM;
        goto out;
    }
    inc = calloc(rc.batch.n ? rc.batch.n : 1, sizeof(*inc));
    if (!inc) {
        snprintf(err, errlen, "out of memory");
        r = -ENOMEM;
        goto out;
    }
    for (size_t i = 0; i < rc.batch.n; i++) {
        const struct eval_event *e = &rc.batch.ev[i];
        if (!e->has_event)
            continue;
        if (e->tr.change == ALERT_CHANGE_TO_FIRING) {
            inc[n_inc++] =
                (struct incident){.t = e->t, .fired = e->tr, .attr = e->attr, .resolved_step = -1};
            memcpy(inc[n_inc - 1].why, e->why, sizeof(e->why));
        } else if (e->tr.change == ALERT_CHANGE_TO_RESOLVED) {
            for (size_t j = n_inc; j-- > 0;)
                if (inc[j].t == e->t && inc[j].resolved_step < 0) {
                    inc[j].resolved_step = e->tr.step;
                    break;
                }
        }
        if (st->all_events && !st->json) {
            char scope[96];
            scope_text(&e->t->key, scope, sizeof(scope));
            printf("event %s %s %s %s step=%lld value=%g z=%.3g label=%s\n", run->name,
                   e->t->rule_name, scope, alert_change_name(e->tr.change), (long long)e->tr.step,
                   e->tr.value, e->tr.z, alert_attribution_name(e->attr));
        }
    }
    for (size_t i = 0; i < n_inc; i++) {
        const struct incident *x = &inc[i];
        const struct store_series_key *k = &x->t->key;
        if (arr) {
            json_t *o = json_pack(
                "{s:s, s:s, s:s, s:s, s:o, s:o, s:o, s:o, s:I, s:I, s:o, s:s, s:s, s:o, s:o, "
                "s:o, s:o, s:s}",
                "run", run->name, "rule", x->t->rule_name, "series", k->name, "severity",
                detect_severity_name(x->fired.severity), "layer", jopt(k->layer, -1), "head",
                jopt(k->head, -1), "window", jopt(k->window, 0), "rank", jopt(k->rank, -1),
                "first_breach_step", (json_int_t)x->fired.first_breach_step, "fired_step",
                (json_int_t)x->fired.step, "resolved_step",
                x->resolved_step >= 0 ? json_integer(x->resolved_step) : json_null(), "label",
                alert_attribution_name(x->attr), "label_series", x->why, "value",
                jnum(x->fired.value), "median", jnum(x->fired.median), "mad", jnum(x->fired.mad),
                "z", jnum(x->fired.z), "breach_kind",
                detect_breach_kind_name(x->fired.breach_kind));
            if (!o || json_array_append_new(arr, o) != 0) {
                snprintf(err, errlen, "out of memory");
                r = -ENOMEM;
                goto out;
            }
        } else {
            char scope[96], first[24], fired[24], res[24], z[32];
            scope_text(k, scope, sizeof(scope));
            snprintf(first, sizeof(first), "%lld", (long long)x->fired.first_breach_step);
            snprintf(fired, sizeof(fired), "%lld", (long long)x->fired.step);
            if (x->resolved_step >= 0)
                snprintf(res, sizeof(res), "%lld", (long long)x->resolved_step);
            else
                snprintf(res, sizeof(res), "-");
            snprintf(z, sizeof(z), "%.3g", x->fired.z);
            const char *cells[] = {run->name,
                                   x->t->rule_name,
                                   scope,
                                   first,
                                   fired,
                                   res,
                                   alert_attribution_name(x->attr),
                                   z,
                                   x->why};
            if (table_add(tab, cells) < 0) {
                snprintf(err, errlen, "out of memory");
                r = -ENOMEM;
                goto out;
            }
        }
    }
    r = 0;
out:
    free(inc);
    eval_batch_free(&rc.batch);
    eval_run_clear(&rc.er);
    return r;
}

/* ---- recordings: a throwaway daemon computes their monitors ------------------- */

/* foreshockd beside this executable, else the name for execvp's PATH search. */
static void daemon_path(char *out, size_t len)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (slash) {
            *slash = '\0';
            snprintf(out, len, "%s/foreshockd", self);
            if (access(out, X_OK) == 0)
                return;
        }
    }
    snprintf(out, len, "foreshockd");
}

struct throwaway {
    char dir[PATH_MAX], db[PATH_MAX + 32], log[PATH_MAX + 32];
    char ingest[CLI_MAX_HOSTPORT], http[CLI_MAX_HOSTPORT];
    pid_t pid;
};

/* The throwaway daemon and its directory while they exist, for the signal
 * handler: a backtest stopped by SIGINT, SIGTERM or SIGHUP kills the daemon
 * (by its PID), reaps it, removes the directory and then dies of the signal
 * as it would have. Everything the handler calls is async-signal-safe. */
static struct throwaway *volatile live_throwaway;
static const int stop_signals[] = {SIGINT, SIGTERM, SIGHUP};

/* Removes everything in the directory open as dfd (its own subdirectories
 * too, up to depth more levels: the daemon makes one, its spool), then
 * closes dfd. Raw getdents64: opendir may allocate, which a signal handler
 * must not. */
static void remove_contents(int dfd, int depth)
{
    static char buf[4096]; /* only ever one caller: the main flow or the handler */
    long n;
    while ((n = syscall(SYS_getdents64, dfd, buf, sizeof(buf))) > 0) {
        for (long off = 0; off < n;) {
            struct linux_dirent64 {
                uint64_t d_ino;
                int64_t d_off;
                unsigned short d_reclen;
                unsigned char d_type;
                char d_name[];
            } *e = (void *)(buf + off);
            off += e->d_reclen;
            const char *name = e->d_name;
            if (!strcmp(name, ".") || !strcmp(name, ".."))
                continue;
            if (e->d_type == DT_DIR) {
                int sub = depth > 0 ? openat(dfd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
                if (sub >= 0)
                    remove_contents(sub, depth - 1);
                unlinkat(dfd, name, AT_REMOVEDIR);
            } else {
                unlinkat(dfd, name, 0);
            }
        }
    }
    close(dfd);
}

/* Kills (SIGKILL: nothing of it is kept) and reaps the daemon, removes its
 * directory. Async-signal-safe. */
static void throwaway_abort(struct throwaway *d)
{
    if (d->pid > 0) {
        int status;
        kill(d->pid, SIGKILL);
        while (waitpid(d->pid, &status, 0) < 0 && errno == EINTR)
            ;
        d->pid = 0;
    }
    if (d->dir[0]) {
        int dfd = open(d->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0)
            remove_contents(dfd, 1);
        rmdir(d->dir);
        d->dir[0] = '\0';
    }
}

static void on_stop_signal(int sig)
{
    int saved = errno;
    struct throwaway *d = live_throwaway;
    if (d)
        throwaway_abort(d);
    errno = saved;
    signal(sig, SIG_DFL);
    raise(sig); /* delivered on return: the exit status says which signal */
}

static void catch_stop_signals(struct throwaway *d)
{
    struct sigaction sa = {.sa_handler = on_stop_signal};
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof(stop_signals) / sizeof(stop_signals[0]); i++)
        sigaddset(&sa.sa_mask, stop_signals[i]); /* one handler runs at a time */
    live_throwaway = d;
    for (size_t i = 0; i < sizeof(stop_signals) / sizeof(stop_signals[0]); i++)
        sigaction(stop_signals[i], &sa, NULL);
}

static void block_stop_signals(int how, sigset_t *old)
{
    sigset_t set;
    sigemptyset(&set);
    for (size_t i = 0; i < sizeof(stop_signals) / sizeof(stop_signals[0]); i++)
        sigaddset(&set, stop_signals[i]);
    sigprocmask(how, &set, old);
}

/* Reads "ingest=HOST:PORT http=HOST:PORT" from the daemon's ready line. */
static int read_ready(const char *log, char *ingest, char *http)
{
    FILE *f = fopen(log, "r");
    char line[1024];
    int found = 0;
    if (!f)
        return 0;
    while (!found && fgets(line, sizeof(line), f)) {
        const char *a = strstr(line, "ready ingest="), *b = strstr(line, " http=");
        if (a && b && sscanf(a, "ready ingest=%299s", ingest) == 1 &&
            sscanf(b, " http=%299s", http) == 1)
            found = 1;
    }
    fclose(f);
    return found;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int throwaway_start(struct throwaway *d, char *err, size_t errlen)
{
    char bin[PATH_MAX + 16], dir[PATH_MAX];
    const char *tmp = getenv("TMPDIR");
    sigset_t old;
    pid_t pid;
    int e;
    snprintf(dir, sizeof(dir), "%s/foreshock-backtest-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    daemon_path(bin, sizeof(bin));
    /* The directory and the child exist only where the handler sees them. */
    catch_stop_signals(d);
    block_stop_signals(SIG_BLOCK, &old);
    if (!mkdtemp(dir)) {
        e = errno;
        block_stop_signals(SIG_SETMASK, NULL);
        snprintf(err, errlen, "cannot make a temporary directory: %s", strerror(e));
        return -e;
    }
    memcpy(d->dir, dir, sizeof(dir));
    snprintf(d->db, sizeof(d->db), "%s/backtest.db", d->dir);
    snprintf(d->log, sizeof(d->log), "%s/foreshockd.log", d->dir);
    pid = fork();
    e = errno;
    if (pid > 0)
        d->pid = pid;
    if (pid != 0)
        sigprocmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        snprintf(err, errlen, "fork: %s", strerror(e));
        return -e;
    }
    if (pid == 0) {
        /* The daemon dies with this process, even of SIGKILL. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (size_t i = 0; i < sizeof(stop_signals) / sizeof(stop_signals[0]); i++)
            signal(stop_signals[i], SIG_DFL);
        sigprocmask(SIG_SETMASK, &old, NULL);
        FILE *f = freopen(d->log, "w", stderr);
        (void)f;
        execlp(bin, bin, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", d->db,
               "--log-level", "info", (char *)NULL);
        fprintf(stderr, "cannot run %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    for (int i = 0; i < BACKTEST_DAEMON_WAIT_S * 20; i++) {
        int status;
        pid_t gone;
        if (read_ready(d->log, d->ingest, d->http))
            return 0;
        block_stop_signals(SIG_BLOCK, &old); /* reaped and forgotten at once */
        if ((gone = waitpid(d->pid, &status, WNOHANG)) == d->pid)
            d->pid = 0;
        sigprocmask(SIG_SETMASK, &old, NULL);
        if (gone == pid) {
            snprintf(err, errlen, "%.200s exited before it was ready (log: %.200s)", bin, d->log);
            return -ECHILD;
        }
        sleep_ms(50);
    }
    snprintf(err, errlen, "%.200s not ready after %d s (log: %.200s)", bin, BACKTEST_DAEMON_WAIT_S,
             d->log);
    return -ETIMEDOUT;
}

/* Stops the daemon (SIGTERM, then waits: it finishes the math of what it
 * was sent before it exits). */
static void throwaway_stop(struct throwaway *d)
{
    if (d->pid > 0) {
        siginfo_t info;
        sigset_t old;
        int status;
        kill(d->pid, SIGTERM);
        /* Waits without reaping, so that the PID the handler may kill is
         * never another process's; reaps with the handler held off. */
        while (waitid(P_PID, (id_t)d->pid, &info, WEXITED | WNOWAIT) < 0 && errno == EINTR)
            ;
        block_stop_signals(SIG_BLOCK, &old);
        waitpid(d->pid, &status, 0);
        d->pid = 0;
        sigprocmask(SIG_SETMASK, &old, NULL);
    }
}

/* Removes the directory and all the daemon left in it (database, log,
 * lock file, spool directory). */
static void throwaway_remove(struct throwaway *d)
{
    sigset_t old;
    block_stop_signals(SIG_BLOCK, &old);
    throwaway_abort(d);
    live_throwaway = NULL;
    sigprocmask(SIG_SETMASK, &old, NULL);
}

/* Every run of the database, for --run checks and ordering. */
struct run_list {
    struct store_run_info *v;
    size_t n, cap;
};

static int collect(void *ctx, const struct store_run_info *run)
{
    struct run_list *all = ctx;
    if (all->n == all->cap) {
        size_t c = all->cap ? all->cap * 2 : 16;
        struct store_run_info *p = realloc(all->v, c * sizeof(*p));
        if (!p)
            return -ENOMEM;
        all->v = p;
        all->cap = c;
    }
    all->v[all->n++] = *run;
    return 0;
}

/* "5,25" -> st->windows. 0 or -EINVAL. */
static int parse_windows(const char *text, struct backtest_settings *st)
{
    const char *p = text;
    st->n_windows = 0;
    while (*p) {
        char *end;
        errno = 0;
        long w = strtol(p, &end, 10);
        if (errno || end == p || w < 1 || w > (long)FSC_MAX_WINDOW ||
            st->n_windows == BACKTEST_MAX_WINDOWS || (*end && *end != ','))
            return -EINVAL;
        st->windows[st->n_windows++] = (int32_t)w;
        p = *end ? end + 1 : end;
    }
    return st->n_windows ? 0 : -EINVAL;
}

/* ---- the command -------------------------------------------------------------------- */

static const struct command_help backtest_help = {
    .usage = "foreshock backtest (--db PATH | RECORDING...) [options]",
    .summary =
        "Re-evaluate stored runs (a foreshockd database, read-only; safe while the daemon\n"
        "runs) or recordings (streamed first into a throwaway foreshockd that computes their\n"
        "monitors) with the daemon's own detection and alert code under the given settings,\n"
        "and print the alerts that would have fired: rule, scope, first breach, fired and\n"
        "resolved step, label, z, and the series the label rests on.\n\n"
        "Settings start from the built-in defaults. --config reads a foreshockd configuration\n"
        "file ([detect \"RULE\"] sections, detect_from_step; other keys are ignored); --set\n"
        "RULE.KEY=VALUE (repeatable) sets one rule key, e.g. --set qk.d2.srank.z=4 or\n"
        "--set grad_norm.enabled=false; --set detect_from_step=N applies to runs whose\n"
        "trainer did not set it. Exit 0 on success, 1 on an error, 2 on bad usage.",
};

int cmd_backtest(int argc, char **argv)
{
    struct backtest_settings st = {0};
    const char *sets[BACKTEST_MAX_SETS], *runs[BACKTEST_MAX_RUNS], *recs[BACKTEST_MAX_RECORDINGS];
    size_t n_sets = 0, n_runs = 0, n_recs = 0;
    char err[CLI_ERR_LEN] = "";
    int rc = CLI_FAIL;

    /* Repeatable options and positional recordings are taken here; the
     * table-driven parser has neither. */
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: %s\n\n%s\n\noptions:\n", backtest_help.usage, backtest_help.summary);
            printf("  --db PATH                a foreshockd database to read\n"
                   "  --run NAME               only this run (repeatable; default: all)\n"
                   "  --config FILE            foreshockd configuration file\n"
                   "  --set RULE.KEY=VALUE     rule override (repeatable)\n"
                   "  --windows LIST           only these sketch windows, e.g. 5,25\n"
                   "  --every N                only sketch steps that are multiples of N\n"
                   "  --json                   print a JSON array of incidents\n"
                   "  --events                 also print every alert transition (text mode)\n"
                   "  --help                   show this help\n");
            return CLI_OK;
        }
        if ((!strcmp(a, "--db") || !strcmp(a, "--config") || !strcmp(a, "--run") ||
             !strcmp(a, "--set") || !strcmp(a, "--windows") || !strcmp(a, "--every")) &&
            !v) {
            fprintf(stderr, "foreshock backtest: %s needs a value\n", a);
            return CLI_USAGE;
        }
        if (!strcmp(a, "--db")) {
            st.db = argv[++i];
        } else if (!strcmp(a, "--config")) {
            st.config = argv[++i];
        } else if (!strcmp(a, "--run")) {
            if (n_runs == BACKTEST_MAX_RUNS) {
                fprintf(stderr, "foreshock backtest: at most %d --run\n", BACKTEST_MAX_RUNS);
                return CLI_USAGE;
            }
            runs[n_runs++] = argv[++i];
        } else if (!strcmp(a, "--set")) {
            if (n_sets == BACKTEST_MAX_SETS) {
                fprintf(stderr, "foreshock backtest: at most %d --set\n", BACKTEST_MAX_SETS);
                return CLI_USAGE;
            }
            sets[n_sets++] = argv[++i];
        } else if (!strcmp(a, "--windows")) {
            if (parse_windows(argv[++i], &st) < 0) {
                fprintf(stderr,
                        "foreshock backtest: --windows wants up to %d window lengths "
                        "like 5,25\n",
                        BACKTEST_MAX_WINDOWS);
                return CLI_USAGE;
            }
        } else if (!strcmp(a, "--every")) {
            char *end;
            errno = 0;
            unsigned long long e = strtoull(argv[++i], &end, 10);
            if (errno || *end || e < 1 || e > FSC_MAX_WINDOW) {
                fprintf(stderr, "foreshock backtest: --every wants a step count\n");
                return CLI_USAGE;
            }
            st.every = e;
        } else if (!strcmp(a, "--json")) {
            st.json = 1;
        } else if (!strcmp(a, "--events")) {
            st.all_events = 1;
        } else if (!strncmp(a, "--", 2)) {
            fprintf(stderr, "foreshock backtest: unknown option '%s' (see --help)\n", a);
            return CLI_USAGE;
        } else {
            if (n_recs == BACKTEST_MAX_RECORDINGS) {
                fprintf(stderr, "foreshock backtest: at most %d recordings\n",
                        BACKTEST_MAX_RECORDINGS);
                return CLI_USAGE;
            }
            recs[n_recs++] = a;
        }
    }
    if (!!st.db == !!n_recs) {
        fprintf(stderr, "foreshock backtest: give --db PATH or recording files (see --help)\n");
        return CLI_USAGE;
    }

    /* The rule table and detect_from_step, as the daemon would build them. */
    static struct detect_rules rules;
    static struct fs_config cfg;
    static struct pager_config pager_cfg;
    static struct run_auth run_auth; /* parsed so that [run] sections are accepted; unused */
    struct config_section sections[3];
    struct fs_err ce = {0};
    config_defaults(&cfg);
    detect_rules_default(&rules);
    detect_config_section(&rules, &sections[0]);
    pager_target_section(&pager_cfg, &sections[1]);
    run_auth_section(&run_auth, &sections[2]);
    if (st.config && config_load_file(st.config, &cfg, sections, 3, &ce) < 0) {
        fprintf(stderr, "foreshock backtest: %s\n", ce.msg);
        return CLI_USAGE;
    }
    for (size_t i = 0; i < n_sets; i++)
        if (apply_set(&rules, &cfg, sets[i], err, sizeof(err)) < 0) {
            fprintf(stderr, "foreshock backtest: %s\n", err);
            return CLI_USAGE;
        }

    struct throwaway d = {0};
    const char *db = st.db;
    if (n_recs) {
        if (throwaway_start(&d, err, sizeof(err)) < 0) {
            fprintf(stderr, "foreshock backtest: %s\n", err);
            goto cleanup;
        }
        /* Every recording in one replay: ranks of a run go together. */
        char **rargv = calloc(n_recs + 3, sizeof(*rargv));
        if (!rargv)
            goto cleanup;
        for (size_t i = 0; i < n_recs; i++)
            rargv[i] = (char *)recs[i];
        rargv[n_recs] = "--endpoint";
        rargv[n_recs + 1] = d.ingest;
        /* replay prints one line per file to stdout: keep it off JSON output. */
        fflush(stdout);
        int saved = dup(STDOUT_FILENO);
        if (saved >= 0)
            dup2(STDERR_FILENO, STDOUT_FILENO);
        int rrc = cmd_replay((int)n_recs + 2, rargv);
        fflush(stdout);
        if (saved >= 0) {
            dup2(saved, STDOUT_FILENO);
            close(saved);
        }
        free(rargv);
        if (rrc != CLI_OK) {
            fprintf(stderr, "foreshock backtest: replay into the throwaway daemon failed\n");
            goto cleanup;
        }
        /* Every report is acknowledged, so every one was fed to the monitor
         * stage; a SIGTERM lets it finish the math of every complete step
         * and commit it before the daemon exits. */
        throwaway_stop(&d);
        db = d.db;
    }

    struct store_reader *rd = NULL;
    struct fs_err rerr = {0};
    if (store_reader_open(db, &rd, &rerr) < 0) {
        fprintf(stderr, "foreshock backtest: %s\n", rerr.msg);
        goto cleanup;
    }
    struct run_list all = {0};
    if (store_reader_runs(rd, collect, &all, &rerr) < 0) {
        fprintf(stderr, "foreshock backtest: %s\n", rerr.msg);
        goto close_reader;
    }
    for (size_t i = 0; i < n_runs; i++) {
        bool found = false;
        for (size_t j = 0; j < all.n && !found; j++)
            found = strcmp(all.v[j].name, runs[i]) == 0;
        if (!found) {
            fprintf(stderr, "foreshock backtest: no run '%s' in %s\n", runs[i], db);
            goto close_reader;
        }
    }
    static const char *const headers[] = {"RUN",      "RULE",  "SCOPE", "FIRST_BREACH", "FIRED",
                                          "RESOLVED", "LABEL", "Z",     "LABEL_SERIES"};
    static const int right[] = {0, 0, 0, 1, 1, 1, 0, 1, 0};
    struct table *tab = st.json ? NULL : table_new(9, headers, right);
    json_t *arr = st.json ? json_array() : NULL;
    if ((st.json && !arr) || (!st.json && !tab)) {
        fprintf(stderr, "foreshock backtest: out of memory\n");
        goto free_out;
    }
    for (size_t j = 0; j < all.n; j++) {
        const struct store_run_info *run = &all.v[j];
        bool selected = n_runs == 0;
        for (size_t i = 0; i < n_runs && !selected; i++)
            selected = strcmp(run->name, runs[i]) == 0;
        if (!selected)
            continue;
        int64_t from =
            (int64_t)(run->detect_from_step ? run->detect_from_step : cfg.detect_from_step);
        err[0] = '\0';
        if (backtest_run(rd, run, &rules, from, &st, arr, tab, err, sizeof(err)) < 0) {
            fprintf(stderr, "foreshock backtest: run %s: %s\n", run->name, err);
            goto free_out;
        }
    }
    if (arr) {
        char *text = json_dumps(arr, JSON_INDENT(2));
        if (!text) {
            fprintf(stderr, "foreshock backtest: out of memory\n");
            goto free_out;
        }
        printf("%s\n", text);
        free(text);
    } else {
        table_print(tab, stdout);
    }
    rc = CLI_OK;
free_out:
    json_decref(arr);
    table_free(tab);
close_reader:
    free(all.v);
    store_reader_close(rd);
cleanup:
    throwaway_stop(&d);
    throwaway_remove(&d);
    return rc;
}
