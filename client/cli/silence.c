/* `foreshock silence add|list|expire`, `foreshock maintenance RUN` and
 * `foreshock runs delete|end RUN`: the daemon's write API (POST/GET/DELETE
 * /api/v1/silences, POST /api/v1/runs/{run}/maintenance, DELETE
 * /api/v1/runs/{run}, POST /api/v1/runs/{run}/end). Writes need the
 * daemon's http_write_token: --token or $FORESHOCK_TOKEN. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#define SIL_PAGE 1000           /* silences per request */
#define SIL_MAX_PAGES 100000    /* a server that never ends pagination */
#define SIL_MAX_MATCH_TEXT 4096 /* --match text, bytes */

struct silence_settings {
    const char *http, *token, *match, *matchers_json, *duration, *starts_at, *ends_at;
    const char *created_by, *comment, *state;
    uint64_t id;
    int json;
};

#define SOFF(f) offsetof(struct silence_settings, f)
#define HTTP_OPT                                                                                   \
    {                                                                                              \
        .name = "http", .kind = OPT_HOSTPORT, .offset = SOFF(http), .arg = "HOST:PORT",            \
        .help = "daemon HTTP address (default " CLI_DEFAULT_HTTP ")"                               \
    }
#define TOKEN_OPT                                                                                  \
    {                                                                                              \
        .name = "token", .kind = OPT_STR, .offset = SOFF(token), .arg = "T",                       \
        .help = "bearer token (default $FORESHOCK_TOKEN)"                                          \
    }
#define JSON_OPT                                                                                   \
    {                                                                                              \
        .name = "json", .kind = OPT_FLAG, .offset = SOFF(json), .help = "print the server's JSON"  \
    }

static const struct opt add_opts[] = {
    HTTP_OPT,
    TOKEN_OPT,
    JSON_OPT,
    {.name = "match",
     .kind = OPT_STR,
     .offset = SOFF(match),
     .arg = "M",
     .help = "matchers, comma-separated: name=value, name!=value, name=~regex, name!~regex"},
    {.name = "matchers-json",
     .kind = OPT_STR,
     .offset = SOFF(matchers_json),
     .arg = "JSON",
     .help = "matchers as the API's JSON array (instead of --match)"},
    {.name = "duration",
     .kind = OPT_STR,
     .offset = SOFF(duration),
     .arg = "D",
     .help = "how long: 90m, 2h, 1h30m, 1d or seconds"},
    {.name = "starts-at",
     .kind = OPT_STR,
     .offset = SOFF(starts_at),
     .arg = "T",
     .help = "RFC 3339 or UNIX seconds (default now)"},
    {.name = "ends-at",
     .kind = OPT_STR,
     .offset = SOFF(ends_at),
     .arg = "T",
     .help = "RFC 3339 or UNIX seconds (instead of --duration)"},
    {.name = "created-by",
     .kind = OPT_STR,
     .offset = SOFF(created_by),
     .arg = "NAME",
     .help = "who (default $USER)"},
    {.name = "comment", .kind = OPT_STR, .offset = SOFF(comment), .arg = "TEXT", .help = "why"},
};

static const struct opt list_opts[] = {
    HTTP_OPT,
    TOKEN_OPT,
    JSON_OPT,
    {.name = "state",
     .kind = OPT_STR,
     .offset = SOFF(state),
     .arg = "S",
     .help = "active, pending, expired (comma-separated; default all)"},
};

static const struct opt expire_opts[] = {
    HTTP_OPT,
    TOKEN_OPT,
    JSON_OPT,
    {.name = "id",
     .kind = OPT_U64,
     .offset = SOFF(id),
     .arg = "ID",
     .help = "the silence",
     .min = 1,
     .max = INT64_MAX,
     .required = 1},
};

static const struct opt maint_opts[] = {
    HTTP_OPT,
    TOKEN_OPT,
    JSON_OPT,
    {.name = "duration",
     .kind = OPT_STR,
     .offset = SOFF(duration),
     .arg = "D",
     .help = "how long: 90m, 2h, 1h30m, 1d or seconds",
     .required = 1},
    {.name = "starts-at",
     .kind = OPT_STR,
     .offset = SOFF(starts_at),
     .arg = "T",
     .help = "RFC 3339 or UNIX seconds (default now)"},
    {.name = "created-by",
     .kind = OPT_STR,
     .offset = SOFF(created_by),
     .arg = "NAME",
     .help = "who (default $USER)"},
    {.name = "comment", .kind = OPT_STR, .offset = SOFF(comment), .arg = "TEXT", .help = "why"},
};

static const struct command_help add_help = {
    .usage = "foreshock [--http HOST:PORT] silence add --match M | --matchers-json JSON "
             "--duration D | --ends-at T [--starts-at T] [--created-by NAME] [--comment TEXT] "
             "[--token T] [--json]",
    .summary = "Create a silence: alerts whose labels (alertname, run, severity, family, "
               "signature, layer, head, window, rank) match every matcher are stored and shown "
               "but not paged while it is active.",
};
static const struct command_help list_help = {
    .usage = "foreshock [--http HOST:PORT] silence list [--state S] [--token T] [--json]",
    .summary = "List silences, newest first.",
};
static const struct command_help expire_help = {
    .usage = "foreshock [--http HOST:PORT] silence expire --id ID [--token T] [--json]",
    .summary = "Expire a silence now.",
};
static const struct command_help maint_help = {
    .usage = "foreshock [--http HOST:PORT] maintenance RUN --duration D [--starts-at T] "
             "[--created-by NAME] [--comment TEXT] [--token T] [--json]",
    .summary = "Silence every alert of run RUN for a planned restart (a silence with the one "
               "matcher run=RUN).",
};

static int fail(const char *what, const char *err)
{
    fprintf(stderr, "foreshock %s: %s\n", what, err);
    return CLI_FAIL;
}

/* "a=b,c!=d,e=~f,g!~h" -> JSON array of matchers. NULL with err. */
static json_t *parse_match(const char *text, char *err, size_t errlen)
{
    if (strlen(text) > SIL_MAX_MATCH_TEXT) {
        snprintf(err, errlen, "--match longer than %d bytes", SIL_MAX_MATCH_TEXT);
        return NULL;
    }
    char *copy = strdup(text), *save = NULL;
    json_t *arr = json_array();
    if (!copy || !arr) {
        snprintf(err, errlen, "out of memory");
        goto bad;
    }
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        size_t n = strcspn(tok, "=!");
        const char *op = tok + n;
        int is_equal = 1, is_regex = 0;
        size_t oplen;
        if (!strncmp(op, "!=", 2)) {
            is_equal = 0, oplen = 2;
        } else if (!strncmp(op, "!~", 2)) {
            is_equal = 0, is_regex = 1, oplen = 2;
        } else if (!strncmp(op, "=~", 2)) {
            is_regex = 1, oplen = 2;
        } else if (*op == '=') {
            oplen = 1;
        } else {
            snprintf(err, errlen,
                     "--match '%s': expected name=value, name!=value, name=~re "
                     "or name!~re",
                     tok);
            goto bad;
        }
        json_t *m = json_pack("{s:s%, s:s, s:b, s:b}", "name", tok, n, "value", op + oplen,
                              "isRegex", is_regex, "isEqual", is_equal);
        if (!m || json_array_append_new(arr, m) != 0) {
            snprintf(err, errlen, "--match '%s': not valid UTF-8", tok);
            goto bad;
        }
    }
    free(copy);
    return arr;
bad:
    free(copy);
    json_decref(arr);
    return NULL;
}

/* Sets a time field from RFC 3339 text or UNIX seconds: the server parses
 * both; digits go as a number. */
static int set_time(json_t *o, const char *key, const char *v)
{
    char *end = NULL;
    double x = strtod(v, &end);
    if (end != v && *end == '\0')
        return json_object_set_new(o, key, json_real(x));
    return json_object_set_new(o, key, json_string(v));
}

static void print_silence(const json_t *s)
{
    char *m = json_dumps(json_object_get(s, "matchers"), JSON_COMPACT);
    printf("silence %" JSON_INTEGER_FORMAT " %s from %s until %s by %s: %s\n",
           json_integer_value(json_object_get(s, "id")),
           json_string_value(json_object_get(json_object_get(s, "status"), "state")),
           json_string_value(json_object_get(s, "startsAt")),
           json_string_value(json_object_get(s, "endsAt")),
           json_string_value(json_object_get(s, "createdBy")), m ? m : "?");
    free(m);
}

/* Sends the request and prints the answer's "silence". */
static int write_one(const struct silence_settings *s, const char *what, const char *method,
                     const char *path, json_t *body)
{
    char err[CLI_ERR_LEN];
    struct api *a = NULL;
    json_t *doc = NULL;
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    int rc;
    if (body && !text)
        return fail(what, "out of memory");
    if ((rc = api_open(s->http, &a, err, sizeof(err))) != 0) {
        free(text);
        return fail(what, err);
    }
    if (s->token)
        api_set_token(a, s->token);
    rc = api_request(a, method, path, text, &doc, err, sizeof(err));
    free(text);
    api_close(a);
    if (rc != 0)
        return fail(what, err);
    if (s->json) {
        char *out = json_dumps(doc, JSON_INDENT(2));
        printf("%s\n", out ? out : "null");
        free(out);
    } else {
        print_silence(json_object_get(doc, "silence"));
    }
    json_decref(doc);
    return CLI_OK;
}

/* createdBy, comment, startsAt, duration into body. */
static int common_fields(const struct silence_settings *s, json_t *body)
{
    const char *by = s->created_by ? s->created_by : getenv("USER");
    int rc = json_object_set_new(body, "createdBy", json_string(by && *by ? by : "foreshock-cli"));
    if (s->comment)
        rc |= json_object_set_new(body, "comment", json_string(s->comment));
    if (s->starts_at)
        rc |= set_time(body, "startsAt", s->starts_at);
    if (s->duration)
        rc |= json_object_set_new(body, "duration", json_string(s->duration));
    return rc;
}

static int silence_add(const char *http, int argc, char **argv)
{
    struct silence_settings s = {.http = http};
    char err[CLI_ERR_LEN];
    int rc = args_parse(add_opts, sizeof(add_opts) / sizeof(add_opts[0]), argc, argv, &s, &add_help,
                        err, sizeof(err));
    if (rc == 1)
        return CLI_OK;
    if (rc == 0 && !s.match == !s.matchers_json)
        snprintf(err, sizeof(err), "give --match or --matchers-json"), rc = CLI_USAGE;
    if (rc == 0 && !s.duration == !s.ends_at)
        snprintf(err, sizeof(err), "give --duration or --ends-at"), rc = CLI_USAGE;
    if (rc != 0) {
        fprintf(stderr, "foreshock silence add: %s (see --help)\n", err);
        return CLI_USAGE;
    }
    json_t *matchers;
    if (s.match) {
        matchers = parse_match(s.match, err, sizeof(err));
    } else {
        json_error_t jerr;
        matchers = json_loads(s.matchers_json, 0, &jerr);
        if (!matchers)
            snprintf(err, sizeof(err), "--matchers-json: %s", jerr.text);
    }
    if (!matchers) {
        fprintf(stderr, "foreshock silence add: %s\n", err);
        return CLI_USAGE;
    }
    json_t *body = json_object();
    if (!body || json_object_set_new(body, "matchers", matchers) != 0 ||
        common_fields(&s, body) != 0 || (s.ends_at && set_time(body, "endsAt", s.ends_at) != 0)) {
        json_decref(body);
        return fail("silence add", "out of memory");
    }
    rc = write_one(&s, "silence add", "POST", "/api/v1/silences", body);
    json_decref(body);
    return rc;
}

static int silence_expire(const char *http, int argc, char **argv)
{
    struct silence_settings s = {.http = http};
    char err[CLI_ERR_LEN], path[64];
    int rc = args_parse(expire_opts, sizeof(expire_opts) / sizeof(expire_opts[0]), argc, argv, &s,
                        &expire_help, err, sizeof(err));
    if (rc == 1)
        return CLI_OK;
    if (rc != 0) {
        fprintf(stderr, "foreshock silence expire: %s (see --help)\n", err);
        return CLI_USAGE;
    }
    snprintf(path, sizeof(path), "/api/v1/silences/%" PRIu64, s.id);
    return write_one(&s, "silence expire", "DELETE", path, NULL);
}

static int silence_list(const char *http, int argc, char **argv)
{
    struct silence_settings s = {.http = http};
    char err[CLI_ERR_LEN], path[512];
    int rc = args_parse(list_opts, sizeof(list_opts) / sizeof(list_opts[0]), argc, argv, &s,
                        &list_help, err, sizeof(err));
    if (rc == 1)
        return CLI_OK;
    if (rc != 0) {
        fprintf(stderr, "foreshock silence list: %s (see --help)\n", err);
        return CLI_USAGE;
    }
    struct api *a = NULL;
    json_t *all = json_array();
    char *next = NULL, *state = NULL;
    if (!all)
        return fail("silence list", "out of memory");
    if ((rc = api_open(s.http, &a, err, sizeof(err))) != 0) {
        rc = fail("silence list", err);
        goto out;
    }
    if (s.token)
        api_set_token(a, s.token);
    if (s.state && !(state = api_escape(a, s.state))) {
        rc = fail("silence list", "out of memory");
        goto out;
    }
    for (int page = 0; page < SIL_MAX_PAGES; page++) {
        json_t *doc = NULL;
        snprintf(path, sizeof(path), "/api/v1/silences?limit=%d%s%s%s%s", SIL_PAGE,
                 state ? "&state=" : "", state ? state : "", next ? "&after=" : "",
                 next ? next : "");
        if ((rc = api_get(a, path, &doc, err, sizeof(err))) != 0) {
            rc = fail("silence list", err);
            goto out;
        }
        json_array_extend(all, json_object_get(doc, "silences"));
        const char *n = json_string_value(json_object_get(doc, "next"));
        free(next);
        next = n ? strdup(n) : NULL;
        json_decref(doc);
        if (!next)
            break;
    }
    if (s.json) {
        json_t *doc = json_pack("{s:O,s:n}", "silences", all, "next");
        char *out = doc ? json_dumps(doc, JSON_INDENT(2)) : NULL;
        printf("%s\n", out ? out : "null");
        free(out);
        json_decref(doc);
        goto out;
    }
    static const char *const hdr[] = {"ID",         "STATE",    "STARTS", "ENDS",
                                      "CREATED_BY", "MATCHERS", "COMMENT"};
    static const int right[] = {1, 0, 0, 0, 0, 0, 0};
    struct table *t = table_new(7, hdr, right);
    if (!t) {
        rc = fail("silence list", "out of memory");
        goto out;
    }
    size_t i;
    json_t *x;
    json_array_foreach(all, i, x)
    {
        char id[32];
        snprintf(id, sizeof(id), "%" JSON_INTEGER_FORMAT,
                 json_integer_value(json_object_get(x, "id")));
        char *m = json_dumps(json_object_get(x, "matchers"), JSON_COMPACT);
        const char *row[7] = {
            id,
            json_string_value(json_object_get(json_object_get(x, "status"), "state")),
            json_string_value(json_object_get(x, "startsAt")),
            json_string_value(json_object_get(x, "endsAt")),
            json_string_value(json_object_get(x, "createdBy")),
            m ? m : "?",
            json_string_value(json_object_get(x, "comment"))};
        for (int k = 0; k < 7; k++)
            if (!row[k] || !*row[k])
                row[k] = "-";
        table_add(t, row);
        free(m);
    }
    table_print(t, stdout);
    table_free(t);
out:
    api_free_escaped(state);
    free(next);
    api_close(a);
    json_decref(all);
    return rc;
}

int cmd_silence(const char *http, int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*fn)(const char *http, int argc, char **argv);
    } subs[] = {{"add", silence_add}, {"list", silence_list}, {"expire", silence_expire}};
    if (argc >= 1 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
        printf("usage: foreshock [--http HOST:PORT] silence add|list|expire [options]\n"
               "       (`foreshock silence SUBCOMMAND --help` for its options)\n");
        return CLI_OK;
    }
    for (size_t i = 0; argc >= 1 && i < sizeof(subs) / sizeof(subs[0]); i++)
        if (!strcmp(argv[0], subs[i].name))
            return subs[i].fn(http, argc - 1, argv + 1);
    fprintf(stderr, "foreshock silence: expected add, list or expire (see --help)\n");
    return CLI_USAGE;
}

int cmd_maintenance(const char *http, int argc, char **argv)
{
    struct silence_settings s = {.http = http};
    char err[CLI_ERR_LEN];
    if (argc >= 1 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
        args_usage(stdout, maint_opts, sizeof(maint_opts) / sizeof(maint_opts[0]), &maint_help);
        return CLI_OK;
    }
    if (argc < 1 || argv[0][0] == '-') {
        fprintf(stderr, "foreshock maintenance: expected RUN first (see --help)\n");
        return CLI_USAGE;
    }
    const char *run = argv[0];
    int rc = args_parse(maint_opts, sizeof(maint_opts) / sizeof(maint_opts[0]), argc - 1, argv + 1,
                        &s, &maint_help, err, sizeof(err));
    if (rc == 1)
        return CLI_OK;
    if (rc != 0) {
        fprintf(stderr, "foreshock maintenance: %s (see --help)\n", err);
        return CLI_USAGE;
    }
    struct api *a = NULL;
    if (api_open(s.http, &a, err, sizeof(err)) != 0)
        return fail("maintenance", err);
    char *esc = api_escape(a, run);
    api_close(a);
    json_t *body = json_object();
    char path[1024];
    if (!esc || !body || common_fields(&s, body) != 0) {
        api_free_escaped(esc);
        json_decref(body);
        return fail("maintenance", "out of memory");
    }
    snprintf(path, sizeof(path), "/api/v1/runs/%s/maintenance", esc);
    api_free_escaped(esc);
    rc = write_one(&s, "maintenance", "POST", path, body);
    json_decref(body);
    return rc;
}

/* ---- runs delete|end RUN -------------------------------------------------------------- */

static const struct opt run_op_opts[] = {HTTP_OPT, TOKEN_OPT, JSON_OPT};
static const struct command_help run_delete_help = {
    .usage = "foreshock [--http HOST:PORT] runs delete RUN [--token T] [--json]",
    .summary = "Delete run RUN with all its data (points, reports, alerts, ...); its trainers' "
               "connections are closed, and a trainer that connects again starts it anew.",
};
static const struct command_help run_end_help = {
    .usage = "foreshock [--http HOST:PORT] runs end RUN [--token T] [--json]",
    .summary = "End run RUN now: it stops counting against max_runs and is deleted "
               "run_retention_s later (a new report makes it live again).",
};

int cmd_run_op(const char *http, const char *op, int argc, char **argv)
{
    struct silence_settings s = {.http = http};
    char err[CLI_ERR_LEN], what[32];
    bool del = !strcmp(op, "delete");
    const struct command_help *help = del ? &run_delete_help : &run_end_help;
    size_t nopts = sizeof(run_op_opts) / sizeof(run_op_opts[0]);
    snprintf(what, sizeof(what), "runs %s", op);
    if (argc >= 1 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
        args_usage(stdout, run_op_opts, nopts, help);
        return CLI_OK;
    }
    if (argc < 1 || argv[0][0] == '-') {
        fprintf(stderr, "foreshock %s: expected RUN first (see --help)\n", what);
        return CLI_USAGE;
    }
    const char *run = argv[0];
    int rc = args_parse(run_op_opts, nopts, argc - 1, argv + 1, &s, help, err, sizeof(err));
    if (rc == 1)
        return CLI_OK;
    if (rc != 0) {
        fprintf(stderr, "foreshock %s: %s (see --help)\n", what, err);
        return CLI_USAGE;
    }
    struct api *a = NULL;
    if (api_open(s.http, &a, err, sizeof(err)) != 0)
        return fail(what, err);
    if (s.token)
        api_set_token(a, s.token);
    char *esc = api_escape(a, run);
    char path[1024];
    json_t *doc = NULL;
    if (!esc) {
        api_close(a);
        return fail(what, "out of memory");
    }
    snprintf(path, sizeof(path), "/api/v1/runs/%s%s", esc, del ? "" : "/end");
    api_free_escaped(esc);
    rc = api_request(a, del ? "DELETE" : "POST", path, NULL, &doc, err, sizeof(err));
    api_close(a);
    if (rc != 0)
        return fail(what, err);
    if (s.json) {
        char *out = json_dumps(doc, JSON_INDENT(2));
        printf("%s\n", out ? out : "null");
        free(out);
    } else {
        printf("run %s: %s\n", run, json_string_value(json_object_get(doc, "status")));
    }
    json_decref(doc);
    return CLI_OK;
}
