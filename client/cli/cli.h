#ifndef FORESHOCK_CLI_H
#define FORESHOCK_CLI_H

/* The `foreshock` command-line tool: shared pieces. Single-threaded except
 * `simulate`, which runs one thread per simulated rank. */

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define CLI_DEFAULT_HTTP "127.0.0.1:7782"     /* the daemon's HTTP default */
#define CLI_DEFAULT_ENDPOINT "127.0.0.1:7781" /* the daemon's ingest default */
#define CLI_MAX_HOSTPORT 300
#define CLI_ERR_LEN 512

/* Exit codes. */
#define CLI_OK 0
#define CLI_FAIL 1  /* the server said no, the network failed, not everything acked */
#define CLI_USAGE 2 /* bad command line */

/* ---- options (args.c): a table per command, parsed into a settings struct --- */

enum opt_kind {
    OPT_FLAG,     /* int, set to 1 */
    OPT_STR,      /* const char * (points into argv) */
    OPT_U64,      /* uint64_t in [min, max] */
    OPT_U32,      /* uint32_t in [min, max] */
    OPT_DOUBLE,   /* double, finite, in [dmin, dmax] */
    OPT_HOSTPORT, /* const char *, checked as HOST:PORT */
};

struct opt {
    const char *name; /* long name without "--" */
    enum opt_kind kind;
    size_t offset;     /* of the field in the settings struct */
    const char *arg;   /* placeholder in help, e.g. "ID"; NULL for flags */
    const char *help;  /* one line; mention the default */
    uint64_t min, max; /* integer kinds */
    double dmin, dmax; /* OPT_DOUBLE */
    int required;
};

#define CLI_MAX_OPTS 64 /* options per command */

struct command_help {
    const char *usage;   /* "foreshock runs [options]" */
    const char *summary; /* a sentence or two */
};

/* Parses argv[0..argc) (after the command name) as --name VALUE,
 * --name=VALUE or --flag into `settings`. Returns 0, 1 when --help/-h was
 * given (help printed to stdout), or CLI_USAGE with a message in err. */
int args_parse(const struct opt *opts, size_t n, int argc, char **argv, void *settings,
               const struct command_help *help, char *err, size_t errlen);

/* Prints the usage text built from the table. */
void args_usage(FILE *out, const struct opt *opts, size_t n, const struct command_help *help);

/* Splits "HOST:PORT" (port 1..65535). Returns 0, or -EINVAL. */
int args_hostport(const char *s, char *host, size_t hostlen, uint16_t *port);

/* ---- HTTP API client (api.c) ------------------------------------------------ */

struct api;
struct json_t;

/* http is "HOST:PORT". Returns 0 and *out, or CLI_FAIL with err. */
int api_open(const char *http, struct api **out, char *err, size_t errlen);
void api_close(struct api *a);

/* GETs base + path (path already escaped) and parses the JSON body. On a 4xx
 * or 5xx the server's error message goes to err. Returns 0 and *out (a new
 * reference), or CLI_FAIL. */
int api_get(struct api *a, const char *path, struct json_t **out, char *err, size_t errlen);

/* Sends method (GET, POST, DELETE) to base + path with an optional JSON
 * body; otherwise like api_get. */
int api_request(struct api *a, const char *method, const char *path, const char *body,
                struct json_t **out, char *err, size_t errlen);

/* Sends "Authorization: Bearer token" from now on (NULL or "": none).
 * api_open starts with $FORESHOCK_TOKEN. */
#define CLI_MAX_TOKEN 256
void api_set_token(struct api *a, const char *token);

/* URL-escapes s into a new string (caller frees with api_free_escaped). */
char *api_escape(struct api *a, const char *s);
void api_free_escaped(char *s);

/* ---- aligned tables (table.c) -------------------------------------------------- */

struct table;
/* ncols headers; right[i] != 0 right-aligns column i (numbers). NULL on ENOMEM. */
struct table *table_new(size_t ncols, const char *const *headers, const int *right);
/* Appends a row of ncols cells (copied). Returns 0 or -ENOMEM. */
int table_add(struct table *t, const char *const *cells);
void table_print(const struct table *t, FILE *out);
void table_free(struct table *t);

/* ---- commands ---------------------------------------------------------------------- */

/* Each returns an exit code. `http` is the global --http value. */
int cmd_runs(const char *http, int argc, char **argv);
int cmd_series(const char *http, int argc, char **argv);
int cmd_points(const char *http, int argc, char **argv);
int cmd_alerts(const char *http, int argc, char **argv);
int cmd_silence(const char *http, int argc, char **argv);
int cmd_maintenance(const char *http, int argc, char **argv);
/* `foreshock runs delete|end RUN` (op "delete" or "end"), from cmd_runs. */
int cmd_run_op(const char *http, const char *op, int argc, char **argv);
int cmd_simulate(int argc, char **argv);
int cmd_replay(int argc, char **argv);
int cmd_backtest(int argc, char **argv);
int cmd_archive(int argc, char **argv);

#endif
