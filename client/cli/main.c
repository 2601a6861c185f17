/* `foreshock`: query a foreshockd over HTTP, or simulate trainer ranks.
 * Global options, then a command from the table below. */
#include <curl/curl.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "foreshock.h"

struct command {
    const char *name;
    const char *summary;
    int uses_http; /* takes the global --http */
    int (*run_http)(const char *http, int argc, char **argv);
    int (*run)(int argc, char **argv);
};

static const struct command commands[] = {
    {.name = "runs",
     .summary = "list runs (runs delete|end RUN: delete or end one)",
     .uses_http = 1,
     .run_http = cmd_runs},
    {.name = "series",
     .summary = "list the series of a run",
     .uses_http = 1,
     .run_http = cmd_series},
    {.name = "points",
     .summary = "print the points of a series",
     .uses_http = 1,
     .run_http = cmd_points},
    {.name = "alerts",
     .summary = "list alerts, or show one with its history",
     .uses_http = 1,
     .run_http = cmd_alerts},
    {.name = "silence",
     .summary = "add, list or expire silences (add|list|expire)",
     .uses_http = 1,
     .run_http = cmd_silence},
    {.name = "maintenance",
     .summary = "silence a run's alerts for a planned restart",
     .uses_http = 1,
     .run_http = cmd_maintenance},
    {.name = "simulate",
     .summary = "simulate trainer ranks streaming to the daemon",
     .run = cmd_simulate},
    {.name = "replay",
     .summary = "stream recordings of trainer reports into the daemon",
     .run = cmd_replay},
    {.name = "backtest",
     .summary = "re-evaluate stored runs or recordings under any settings",
     .run = cmd_backtest},
    {.name = "archive",
     .summary = "copy a database (or one run) consistently while it is in use",
     .run = cmd_archive},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: foreshock [--http HOST:PORT] COMMAND [options]\n"
                 "       foreshock --help | --version\n\n"
                 "Command-line client of foreshockd, the training-run instability monitor.\n\n"
                 "commands:\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        fprintf(out, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(out,
            "\nglobal options:\n"
            "  --http HOST:PORT  daemon HTTP API (default %s)\n"
            "  --help            this help; `foreshock COMMAND --help` for a command's options\n"
            "  --version         print the version\n\n"
            "Exit status: 0 success, 1 failure (server error, unreachable, reports not "
            "acknowledged), 2 bad usage.\n",
            CLI_DEFAULT_HTTP);
}

int main(int argc, char **argv)
{
    const char *http = CLI_DEFAULT_HTTP;
    char host[CLI_MAX_HOSTPORT];
    uint16_t port;
    int i = 1, rc;

    for (; i < argc && !strncmp(argv[i], "--", 2); i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help")) {
            usage(stdout);
            return CLI_OK;
        }
        if (!strcmp(a, "--version")) {
            printf("foreshock %s (libforeshock %s)\n", FORESHOCK_VERSION, fsc_version());
            return CLI_OK;
        }
        if (!strcmp(a, "--http") && i + 1 < argc) {
            http = argv[++i];
        } else if (!strncmp(a, "--http=", 7)) {
            http = a + 7;
        } else {
            fprintf(stderr, "foreshock: unknown or incomplete option '%s' (see --help)\n", a);
            return CLI_USAGE;
        }
        if (args_hostport(http, host, sizeof(host), &port) < 0) {
            fprintf(stderr, "foreshock: --http '%s' is not HOST:PORT\n", http);
            return CLI_USAGE;
        }
    }
    if (i >= argc) {
        usage(stderr);
        return CLI_USAGE;
    }
    for (size_t k = 0; k < sizeof(commands) / sizeof(commands[0]); k++) {
        const struct command *c = &commands[k];
        if (strcmp(argv[i], c->name) != 0)
            continue;
        if (!c->uses_http && strcmp(http, CLI_DEFAULT_HTTP) != 0)
            fprintf(stderr, "foreshock: --http is ignored by '%s'\n", c->name);
        if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
            fprintf(stderr, "foreshock: cannot initialise libcurl\n");
            return CLI_FAIL;
        }
        rc = c->uses_http ? c->run_http(http, argc - i - 1, argv + i + 1)
                          : c->run(argc - i - 1, argv + i + 1);
        curl_global_cleanup();
        return rc;
    }
    fprintf(stderr, "foreshock: unknown command '%s' (see --help)\n", argv[i]);
    return CLI_USAGE;
}
