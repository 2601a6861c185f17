/* Query commands: runs, series, points. Each follows the API's pagination,
 * then prints an aligned table or (--json) the server's JSON with the pages
 * joined. */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

#define PAGE_LIMIT 1000         /* runs/series per request, default */
#define PAGE_MAX 10000          /* the server's largest ?limit= */
#define POINTS_PAGE_MAX 10000   /* the server's largest ?limit= */
#define POINTS_DEFAULT 1000     /* --limit default for points */
#define POINTS_MAX 100000000ull /* largest --limit */
#define MAX_PAGES 1000000       /* a server that never ends pagination */
#define UNSET32 UINT32_MAX
#define UNSET64 UINT64_MAX

/* ---- cells --------------------------------------------------------------------- */

/* Unix seconds as UTC ISO-8601, to the second. */
static void fmt_time(double t, char *out, size_t len)
{
    time_t s = (time_t)t;
    struct tm tm;

    if (!isfinite(t) || !gmtime_r(&s, &tm) || !strftime(out, len, "%Y-%m-%dT%H:%M:%SZ", &tm))
        snprintf(out, len, "%.3f", t);
}

/* A JSON value as table text: null "-", numbers, strings, {k:v} as k=v,... */
static void fmt_cell(const json_t *v, int is_time, char *out, size_t len)
{
    const char *k;
    json_t *x;
    size_t used = 0;

    if (!v || json_is_null(v)) {
        snprintf(out, len, "-");
    } else if (json_is_integer(v)) {
        if (is_time)
            fmt_time((double)json_integer_value(v), out, len);
        else
            snprintf(out, len, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    } else if (json_is_real(v)) {
        if (is_time)
            fmt_time(json_real_value(v), out, len);
        else
            snprintf(out, len, "%.9g", json_real_value(v));
    } else if (json_is_string(v)) {
        snprintf(out, len, "%s", json_string_value(v));
    } else if (json_is_object(v)) {
        out[0] = '\0';
        json_object_foreach((json_t *)v, k, x)
        {
            char val[64];
            fmt_cell(x, 0, val, sizeof(val));
            used += (size_t)snprintf(out + used, used < len ? len - used : 0, "%s%s=%s",
                                     used ? "," : "", k, val);
            if (used >= len)
                break;
        }
        if (!used)
            snprintf(out, len, "-");
    } else {
        snprintf(out, len, "?");
    }
}

static void print_json(json_t *doc)
{
    json_dumpf(doc, stdout, JSON_COMPACT);
    fputc('\n', stdout);
}

/* ---- pagination ------------------------------------------------------------------- */

/* GETs path (which already has a '?'), then path&after=<next> until "next"
 * is null; appends every item of array `key` to `all`. */
static int fetch_all(struct api *a, const char *path, const char *key, json_t *all, char *err,
                     size_t errlen)
{
    char *cursor = NULL, full[4096];
    int rc = 0;

    for (int page = 0;; page++) {
        json_t *doc = NULL, *items, *next;
        char *esc = NULL;
        size_t n_items;

        if (page >= MAX_PAGES) {
            snprintf(err, errlen, "server pagination did not end after %d pages", MAX_PAGES);
            rc = CLI_FAIL;
            break;
        }
        if (cursor && !(esc = api_escape(a, cursor))) {
            snprintf(err, errlen, "out of memory");
            rc = CLI_FAIL;
            break;
        }
        snprintf(full, sizeof(full), "%s%s%s", path, esc ? "&after=" : "", esc ? esc : "");
        api_free_escaped(esc);
        if ((rc = api_get(a, full, &doc, err, errlen)) != 0)
            break;
        items = json_object_get(doc, key);
        if (!json_is_array(items)) {
            snprintf(err, errlen, "server answer has no '%s' array", key);
            json_decref(doc);
            rc = CLI_FAIL;
            break;
        }
        n_items = json_array_size(items);
        json_array_extend(all, items);
        next = json_object_get(doc, "next");
        free(cursor);
        cursor = NULL;
        if (json_is_string(next)) {
            cursor = strdup(json_string_value(next));
        } else if (json_is_integer(next)) {
            char num[32];
            snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(next));
            cursor = strdup(num);
        }
        json_decref(doc);
        if (!cursor || n_items == 0)
            break;
    }
    free(cursor);
    return rc;
}

static int fail(const char *err)
{
    fprintf(stderr, "foreshock: %s\n", err);
    return CLI_FAIL;
}

/* ---- what every command shares -------------------------------------------------------- */

#define GO_ON (-1) /* begin(): the command goes on */

/* Parses argv into settings, then opens the API at *http (a member of
 * settings, so read after parsing). Returns GO_ON with *a open, or the
 * command's exit status: CLI_OK after --help, CLI_USAGE or CLI_FAIL with
 * the reason on stderr. */
static int begin(const char *cmd, const struct opt *opts, size_t n, int argc, char **argv,
                 void *settings, const struct command_help *help, const char *const *http,
                 struct api **a)
{
    char err[CLI_ERR_LEN];
    int rc = args_parse(opts, n, argc, argv, settings, help, err, sizeof(err));

    if (rc == 1)
        return CLI_OK;
    if (rc != 0) {
        fprintf(stderr, "foreshock %s: %s (see --help)\n", cmd, err);
        return rc;
    }
    if (api_open(*http, a, err, sizeof(err)) != 0)
        return fail(err);
    return GO_ON;
}

/* Prints a table of the given columns of `items` (keys may be "a.b" for a
 * member of an object member). */
static int print_rows(json_t *items, size_t ncols, const char *const *hdr, const int *right,
                      const char *const *keys, const int *is_time)
{
    struct table *t = table_new(ncols, hdr, right);
    json_t *it;
    size_t i;

    if (!t)
        return fail("out of memory");
    json_array_foreach(items, i, it)
    {
        char cells[16][256];
        const char *row[16];
        for (size_t k = 0; k < ncols && k < 16; k++) {
            const char *dot = strchr(keys[k], '.');
            json_t *v;
            if (dot) {
                char outer[64];
                snprintf(outer, sizeof(outer), "%.*s", (int)(dot - keys[k]), keys[k]);
                v = json_object_get(json_object_get(it, outer), dot + 1);
            } else {
                v = json_object_get(it, keys[k]);
            }
            fmt_cell(v, is_time[k], cells[k], sizeof(cells[k]));
            row[k] = cells[k];
        }
        table_add(t, row);
    }
    table_print(t, stdout);
    table_free(t);
    return CLI_OK;
}

/* Every page of path's array `key`; then with json the server's document
 * with the pages joined ({key: [...], "next": null}), else a table of the
 * given columns. Returns the command's exit status. */
static int list_all(struct api *a, const char *path, const char *key, int json, size_t ncols,
                    const char *const *hdr, const int *right, const char *const *keys,
                    const int *is_time)
{
    char err[CLI_ERR_LEN];
    json_t *all = json_array();
    int rc;

    if (!all)
        return fail("out of memory");
    if (fetch_all(a, path, key, all, err, sizeof(err)) != 0) {
        rc = fail(err);
    } else if (json) {
        json_t *doc = json_pack("{s:O,s:n}", key, all, "next");
        print_json(doc);
        json_decref(doc);
        rc = CLI_OK;
    } else {
        rc = print_rows(all, ncols, hdr, right, keys, is_time);
    }
    json_decref(all);
    return rc;
}

/* ---- runs ------------------------------------------------------------------------- */

struct runs_settings {
    const char *http;
    uint32_t page_size;
    int json;
};

static const struct opt runs_opts[] = {
    {.name = "http",
     .kind = OPT_HOSTPORT,
     .offset = offsetof(struct runs_settings, http),
     .arg = "HOST:PORT",
     .help = "daemon HTTP address (default " CLI_DEFAULT_HTTP ")"},
    {.name = "json",
     .kind = OPT_FLAG,
     .offset = offsetof(struct runs_settings, json),
     .help = "print the server's JSON (all pages joined)"},
    {.name = "page-size",
     .kind = OPT_U32,
     .offset = offsetof(struct runs_settings, page_size),
     .arg = "N",
     .help = "runs per request (default 1000)",
     .min = 1,
     .max = PAGE_MAX},
};

static const struct command_help runs_help = {
    .usage = "foreshock [--http HOST:PORT] runs [--json] [--page-size N]",
    .summary = "List the runs the daemon knows, oldest first.",
};

int cmd_runs(const char *http, int argc, char **argv)
{
    struct runs_settings s = {.http = http, .page_size = PAGE_LIMIT};
    static const char *const hdr[] = {"RUN",     "WORLD",  "LAST_STEP", "REPORTS",
                                      "STREAMS", "SERIES", "LAST_SEEN"};
    static const int right[] = {0, 1, 1, 1, 1, 1, 0};
    static const char *const keys[] = {"id",      "world_size", "last_step",   "reports",
                                       "streams", "series",     "last_seen_at"};
    static const int is_time[] = {0, 0, 0, 0, 0, 0, 1};
    char path[64];
    struct api *a = NULL;
    if (argc >= 1 && (!strcmp(argv[0], "delete") || !strcmp(argv[0], "end")))
        return cmd_run_op(http, argv[0], argc - 1, argv + 1);
    int rc = begin("runs", runs_opts, sizeof(runs_opts) / sizeof(runs_opts[0]), argc, argv, &s,
                   &runs_help, &s.http, &a);

    if (rc == GO_ON) {
        snprintf(path, sizeof(path), "/api/v1/runs?limit=%u", s.page_size);
        rc = list_all(a, path, "runs", s.json, 7, hdr, right, keys, is_time);
    }
    api_close(a);
    return rc;
}

/* ---- series ------------------------------------------------------------------------ */

struct series_settings {
    const char *http, *run, *name, *prefix;
    uint32_t layer, head, window, rank, page_size;
    int json;
};

#define SERIES_LABEL(field, what)                                                                  \
    {                                                                                              \
        .name = #field, .kind = OPT_U32, .offset = offsetof(struct series_settings, field),        \
        .arg = "N", .help = "only series with this " what " label", .min = 0,                      \
        .max = UINT32_MAX - 1                                                                      \
    }

static const struct opt series_opts[] = {
    {.name = "http",
     .kind = OPT_HOSTPORT,
     .offset = offsetof(struct series_settings, http),
     .arg = "HOST:PORT",
     .help = "daemon HTTP address (default " CLI_DEFAULT_HTTP ")"},
    {.name = "run",
     .kind = OPT_STR,
     .offset = offsetof(struct series_settings, run),
     .arg = "ID",
     .help = "the run",
     .required = 1},
    {.name = "name",
     .kind = OPT_STR,
     .offset = offsetof(struct series_settings, name),
     .arg = "NAME",
     .help = "only series with this name (e.g. loss, qk.d2.erank)"},
    {.name = "prefix",
     .kind = OPT_STR,
     .offset = offsetof(struct series_settings, prefix),
     .arg = "P",
     .help = "only series whose name starts with P (e.g. qk.)"},
    SERIES_LABEL(layer, "layer"),
    SERIES_LABEL(head, "head"),
    SERIES_LABEL(window, "window"),
    SERIES_LABEL(rank, "rank"),
    {.name = "json",
     .kind = OPT_FLAG,
     .offset = offsetof(struct series_settings, json),
     .help = "print the server's JSON (all pages joined)"},
    {.name = "page-size",
     .kind = OPT_U32,
     .offset = offsetof(struct series_settings, page_size),
     .arg = "N",
     .help = "series per request (default 1000)",
     .min = 1,
     .max = PAGE_MAX},
};

static const struct command_help series_help = {
    .usage = "foreshock [--http HOST:PORT] series --run ID [--name N] [--prefix P] [--layer L] "
             "[--head H] [--window W] [--rank R] [--json] [--page-size N]",
    .summary = "List the series (a name plus labels) stored for a run, with point counts and "
               "step ranges.",
};

/* Appends &key=escaped(value) to path. */
static void add_param(struct api *a, char *path, size_t len, const char *key, const char *value)
{
    char *esc = api_escape(a, value);
    size_t used = strlen(path);

    if (esc)
        snprintf(path + used, len - used, "&%s=%s", key, esc);
    api_free_escaped(esc);
}

static void add_u32(struct api *a, char *path, size_t len, const char *key, uint32_t v)
{
    char buf[16];

    if (v == UNSET32)
        return;
    snprintf(buf, sizeof(buf), "%u", v);
    add_param(a, path, len, key, buf);
}

int cmd_series(const char *http, int argc, char **argv)
{
    struct series_settings s = {.http = http,
                                .layer = UNSET32,
                                .head = UNSET32,
                                .window = UNSET32,
                                .rank = UNSET32,
                                .page_size = PAGE_LIMIT};
    static const char *const hdr[] = {"ID", "NAME", "LABELS", "POINTS", "FIRST", "LAST"};
    static const int right[] = {1, 0, 0, 1, 1, 1};
    static const char *const keys[] = {"id", "name", "labels", "points", "first_step", "last_step"};
    static const int is_time[6] = {0};
    char path[2048];
    struct api *a = NULL;
    int rc = begin("series", series_opts, sizeof(series_opts) / sizeof(series_opts[0]), argc, argv,
                   &s, &series_help, &s.http, &a);

    if (rc != GO_ON)
        goto out;
    snprintf(path, sizeof(path), "/api/v1/series?limit=%u", s.page_size);
    add_param(a, path, sizeof(path), "run", s.run);
    if (s.name)
        add_param(a, path, sizeof(path), "name", s.name);
    if (s.prefix)
        add_param(a, path, sizeof(path), "prefix", s.prefix);
    add_u32(a, path, sizeof(path), "layer", s.layer);
    add_u32(a, path, sizeof(path), "head", s.head);
    add_u32(a, path, sizeof(path), "window", s.window);
    add_u32(a, path, sizeof(path), "rank", s.rank);
    rc = list_all(a, path, "series", s.json, 6, hdr, right, keys, is_time);
out:
    api_close(a);
    return rc;
}

/* ---- points -------------------------------------------------------------------------- */

struct points_settings {
    const char *http;
    uint64_t series, from, to, limit;
    uint32_t page_size;
    int json;
};

static const struct opt points_opts[] = {
    {.name = "http",
     .kind = OPT_HOSTPORT,
     .offset = offsetof(struct points_settings, http),
     .arg = "HOST:PORT",
     .help = "daemon HTTP address (default " CLI_DEFAULT_HTTP ")"},
    {.name = "series",
     .kind = OPT_U64,
     .offset = offsetof(struct points_settings, series),
     .arg = "ID",
     .help = "series id (from `foreshock series`)",
     .min = 1,
     .max = INT64_MAX,
     .required = 1},
    {.name = "from",
     .kind = OPT_U64,
     .offset = offsetof(struct points_settings, from),
     .arg = "STEP",
     .help = "first step, inclusive (default: the first)",
     .max = INT64_MAX},
    {.name = "to",
     .kind = OPT_U64,
     .offset = offsetof(struct points_settings, to),
     .arg = "STEP",
     .help = "last step, inclusive (default: the last)",
     .max = INT64_MAX},
    {.name = "limit",
     .kind = OPT_U64,
     .offset = offsetof(struct points_settings, limit),
     .arg = "N",
     .help = "at most N points in all (default 1000)",
     .min = 1,
     .max = POINTS_MAX},
    {.name = "json",
     .kind = OPT_FLAG,
     .offset = offsetof(struct points_settings, json),
     .help = "print the server's JSON (pages joined; next_from says where to go on)"},
    {.name = "page-size",
     .kind = OPT_U32,
     .offset = offsetof(struct points_settings, page_size),
     .arg = "N",
     .help = "points per request (default 10000)",
     .min = 1,
     .max = POINTS_PAGE_MAX},
};

static const struct command_help points_help = {
    .usage = "foreshock [--http HOST:PORT] points --series ID [--from S] [--to S] [--limit N] "
             "[--json] [--page-size N]",
    .summary = "Print the points (step, value) of one series in step order. An absent value "
               "(no spectrum that step) prints as '-' (null in JSON).",
};

int cmd_points(const char *http, int argc, char **argv)
{
    struct points_settings s = {.http = http,
                                .from = UNSET64,
                                .to = UNSET64,
                                .limit = POINTS_DEFAULT,
                                .page_size = POINTS_PAGE_MAX};
    static const char *const hdr[] = {"STEP", "VALUE"};
    static const int right[] = {1, 1};
    char err[CLI_ERR_LEN], path[512];
    struct api *a = NULL;
    json_t *all = json_array(), *series = NULL, *next_from = json_null();
    uint64_t from;
    int rc = begin("points", points_opts, sizeof(points_opts) / sizeof(points_opts[0]), argc, argv,
                   &s, &points_help, &s.http, &a);

    if (rc != GO_ON)
        goto out;
    from = s.from;
    for (int page = 0; json_array_size(all) < s.limit && page < MAX_PAGES; page++) {
        uint64_t want = s.limit - json_array_size(all);
        json_t *doc, *pts, *nf;
        size_t n_pts;
        int n = snprintf(path, sizeof(path), "/api/v1/series/%" PRIu64 "/points?limit=%" PRIu64,
                         s.series, want < s.page_size ? want : (uint64_t)s.page_size);
        if (from != UNSET64)
            n += snprintf(path + n, sizeof(path) - (size_t)n, "&from=%" PRIu64, from);
        if (s.to != UNSET64)
            snprintf(path + n, sizeof(path) - (size_t)n, "&to=%" PRIu64, s.to);
        if ((rc = api_get(a, path, &doc, err, sizeof(err))) != 0) {
            rc = fail(err);
            goto out;
        }
        pts = json_object_get(doc, "points");
        if (!json_is_array(pts)) {
            json_decref(doc);
            rc = fail("server answer has no 'points' array");
            goto out;
        }
        if (!series)
            series = json_incref(json_object_get(doc, "series"));
        n_pts = json_array_size(pts);
        json_array_extend(all, pts);
        nf = json_object_get(doc, "next_from");
        json_decref(next_from);
        next_from = json_incref(nf ? nf : json_null());
        json_decref(doc);
        if (!json_is_integer(next_from) || n_pts == 0)
            break;
        from = (uint64_t)json_integer_value(next_from);
    }
    while (json_array_size(all) > s.limit) /* a server that ignores ?limit= */
        json_array_remove(all, json_array_size(all) - 1);
    if (s.json) {
        json_t *doc = json_pack("{s:O,s:O,s:O}", "series", series ? series : json_null(), "points",
                                all, "next_from", next_from);
        print_json(doc);
        json_decref(doc);
        goto out;
    }
    struct table *t = table_new(2, hdr, right);
    if (!t) {
        rc = fail("out of memory");
        goto out;
    }
    size_t i;
    json_t *p;
    json_array_foreach(all, i, p)
    {
        char step[32], value[64];
        const char *row[2] = {step, value};
        fmt_cell(json_array_get(p, 0), 0, step, sizeof(step));
        fmt_cell(json_array_get(p, 1), 0, value, sizeof(value));
        table_add(t, row);
    }
    table_print(t, stdout);
    table_free(t);
out:
    api_close(a);
    json_decref(all);
    json_decref(series);
    json_decref(next_from);
    return rc;
}

/* ---- alerts ---------------------------------------------------------------------------- */

struct alerts_settings {
    const char *http, *run, *state, *severity, *label, *rule;
    uint64_t id;
    uint32_t layer, page_size;
    int json;
};

static const struct opt alerts_opts[] = {
    {.name = "http",
     .kind = OPT_HOSTPORT,
     .offset = offsetof(struct alerts_settings, http),
     .arg = "HOST:PORT",
     .help = "daemon HTTP address (default " CLI_DEFAULT_HTTP ")"},
    {.name = "run",
     .kind = OPT_STR,
     .offset = offsetof(struct alerts_settings, run),
     .arg = "ID",
     .help = "only alerts of this run"},
    {.name = "state",
     .kind = OPT_STR,
     .offset = offsetof(struct alerts_settings, state),
     .arg = "S",
     .help = "pending, firing, resolved, inactive or open (comma-separated list)"},
    {.name = "severity",
     .kind = OPT_STR,
     .offset = offsetof(struct alerts_settings, severity),
     .arg = "S",
     .help = "warning or critical"},
    {.name = "label",
     .kind = OPT_STR,
     .offset = offsetof(struct alerts_settings, label),
     .arg = "L",
     .help = "attribution, e.g. attention-numerics, optimizer-hyperparameter"},
    {.name = "rule",
     .kind = OPT_STR,
     .offset = offsetof(struct alerts_settings, rule),
     .arg = "NAME",
     .help = "detector rule, e.g. qk.d2.erank"},
    {.name = "layer",
     .kind = OPT_U32,
     .offset = offsetof(struct alerts_settings, layer),
     .arg = "N",
     .help = "only alerts of this layer",
     .min = 0,
     .max = UINT32_MAX - 1},
    {.name = "id",
     .kind = OPT_U64,
     .offset = offsetof(struct alerts_settings, id),
     .arg = "ID",
     .help = "show one alert: its evidence and the history of its transitions",
     .min = 1,
     .max = INT64_MAX},
    {.name = "json",
     .kind = OPT_FLAG,
     .offset = offsetof(struct alerts_settings, json),
     .help = "print the server's JSON (all pages joined)"},
    {.name = "page-size",
     .kind = OPT_U32,
     .offset = offsetof(struct alerts_settings, page_size),
     .arg = "N",
     .help = "alerts per request (default 1000)",
     .min = 1,
     .max = PAGE_MAX},
};

static const struct command_help alerts_help = {
    .usage = "foreshock [--http HOST:PORT] alerts [--run ID] [--state S] [--severity S] "
             "[--label L] [--rule NAME] [--layer N] [--json] [--page-size N]\n"
             "       foreshock [--http HOST:PORT] alerts --id ID [--json]",
    .summary = "List alerts, newest first, with their attribution and evidence (value, robust z, "
               "the step the breach began and the step the alert fired); or show one alert "
               "with the history of its transitions.",
};

static int show_alert(struct api *a, uint64_t id, int json)
{
    static const char *const hdr[] = {"STEP", "CHANGE", "FROM", "TO", "ATTRIBUTION", "AT"};
    static const int right[] = {1, 0, 0, 0, 0, 0};
    static const char *const keys[] = {"step", "change", "from", "to", "attribution", "at"};
    static const int is_time[] = {0, 0, 0, 0, 0, 1};
    char err[CLI_ERR_LEN], path[64], cell[256];
    json_t *doc = NULL, *al;
    int rc;

    snprintf(path, sizeof(path), "/api/v1/alerts/%" PRIu64, id);
    if ((rc = api_get(a, path, &doc, err, sizeof(err))) != 0)
        return fail(err);
    if (json) {
        print_json(doc);
        json_decref(doc);
        return CLI_OK;
    }
    al = json_object_get(doc, "alert");
    static const char *const fields[] = {"id",        "run",         "rule",   "state",
                                         "severity",  "attribution", "family", "labels",
                                         "dedup_key", "incidents"};
    for (size_t k = 0; k < sizeof(fields) / sizeof(fields[0]); k++) {
        fmt_cell(json_object_get(al, fields[k]), 0, cell, sizeof(cell));
        printf("%-12s %s\n", fields[k], cell);
    }
    fmt_cell(json_object_get(al, "evidence"), 0, cell, sizeof(cell));
    printf("%-12s %s\n\n", "evidence", cell);
    rc = print_rows(json_object_get(al, "history"), 6, hdr, right, keys, is_time);
    json_decref(doc);
    return rc;
}

int cmd_alerts(const char *http, int argc, char **argv)
{
    struct alerts_settings s = {.http = http, .layer = UNSET32, .page_size = PAGE_LIMIT};
    static const char *const hdr[] = {"ID",       "RUN",         "RULE",   "STATE",
                                      "SEVERITY", "ATTRIBUTION", "LABELS", "BREACH",
                                      "FIRED",    "VALUE",       "Z"};
    static const int right[] = {1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1};
    static const char *const keys[] = {"id",
                                       "run",
                                       "rule",
                                       "state",
                                       "severity",
                                       "attribution",
                                       "labels",
                                       "evidence.first_breach_step",
                                       "evidence.fired_step",
                                       "evidence.value",
                                       "evidence.z"};
    static const int is_time[11] = {0};
    char path[2048];
    struct api *a = NULL;
    int rc = begin("alerts", alerts_opts, sizeof(alerts_opts) / sizeof(alerts_opts[0]), argc, argv,
                   &s, &alerts_help, &s.http, &a);

    if (rc != GO_ON)
        goto out;
    if (s.id) {
        rc = show_alert(a, s.id, s.json);
        goto out;
    }
    snprintf(path, sizeof(path), "/api/v1/alerts?limit=%u", s.page_size);
    if (s.run)
        add_param(a, path, sizeof(path), "run", s.run);
    if (s.state)
        add_param(a, path, sizeof(path), "state", s.state);
    if (s.severity)
        add_param(a, path, sizeof(path), "severity", s.severity);
    if (s.label)
        add_param(a, path, sizeof(path), "label", s.label);
    if (s.rule)
        add_param(a, path, sizeof(path), "rule", s.rule);
    add_u32(a, path, sizeof(path), "layer", s.layer);
    rc = list_all(a, path, "alerts", s.json, 11, hdr, right, keys, is_time);
out:
    api_close(a);
    return rc;
}
