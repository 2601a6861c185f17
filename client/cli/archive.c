/* `foreshock archive`: a consistent copy of a foreshockd database, or of one
 * run, taken while the daemon runs (daemon/store_archive.c does the work:
 * SQLite's online backup API, then a single-file database renamed into
 * place). Serve the copy with `foreshockd --read-only --db DST`. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "store_archive.h"

struct archive_settings {
    const char *db, *out, *run;
};

static const struct opt archive_opts[] = {
    {.name = "db",
     .kind = OPT_STR,
     .offset = offsetof(struct archive_settings, db),
     .arg = "SRC",
     .help = "the daemon's database (read; the daemon may be running)",
     .required = 1},
    {.name = "out",
     .kind = OPT_STR,
     .offset = offsetof(struct archive_settings, out),
     .arg = "DST",
     .help = "the archive to write; must not exist",
     .required = 1},
    {.name = "run",
     .kind = OPT_STR,
     .offset = offsetof(struct archive_settings, run),
     .arg = "RUN",
     .help = "only this run (its series, alerts, history; silences are kept)"},
};

static const struct command_help archive_help = {
    .usage = "foreshock archive --db SRC --out DST [--run RUN]",
    .summary =
        "Copy a foreshockd database (or one run of it) into DST, consistently, while the\n"
        "daemon keeps running: every page from one read transaction (SQLite's online backup),\n"
        "a single file (no -wal), checked, written under a temporary name and renamed into\n"
        "place. Prints\n"
        "  archive: DST runs=N series=N points=N alerts=N bytes=B\n"
        "Serve it with `foreshockd --read-only --db DST`, or `foreshock backtest --db DST`.\n"
        "Exit status 0 on success, 1 on failure, 2 on bad usage (DST exists too).",
};

int cmd_archive(int argc, char **argv)
{
    struct archive_settings s = {0};
    char err[CLI_ERR_LEN] = "";
    int rc = args_parse(archive_opts, sizeof(archive_opts) / sizeof(archive_opts[0]), argc, argv,
                        &s, &archive_help, err, sizeof(err));
    if (rc == 1)
        return CLI_OK;
    if (rc != 0) {
        fprintf(stderr, "foreshock archive: %s (see --help)\n", err);
        return CLI_USAGE;
    }
    if (strcmp(s.db, s.out) == 0) {
        fprintf(stderr, "foreshock archive: --out is the database itself\n");
        return CLI_USAGE;
    }
    struct store_archive_result res;
    struct fs_err aerr = {0};
    rc = store_archive(s.db, s.out, s.run, &res, &aerr);
    if (rc < 0) {
        fprintf(stderr, "foreshock archive: %s\n", aerr.msg);
        return rc == -EEXIST ? CLI_USAGE : CLI_FAIL;
    }
    printf("archive: %s runs=%" PRId64 " series=%" PRId64 " points=%" PRId64 " alerts=%" PRId64
           " bytes=%" PRIu64 "\n",
           s.out, res.runs, res.series, res.points, res.alerts, res.bytes);
    return CLI_OK;
}
