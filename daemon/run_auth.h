#ifndef FORESHOCK_RUN_AUTH_H
#define FORESHOCK_RUN_AUTH_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "fs_limits.h"

/* Per-run ingest tokens: `[run "PATTERN"]` sections with a `token` key, so
 * that one job (holding its own token) cannot write into another's runs on
 * a daemon shared by several jobs:
 *
 *   [run "team-a-*"]
 *   token = 3f1c...
 *
 * PATTERN is a glob over run ids: `*` any run of characters, `?` one, every
 * other character itself. A Hello's run id is checked against the sections
 * in file order; the first that matches names the token it must carry; a
 * run no section matches needs the global `token` (none when it is empty).
 * A section an earlier one shadows (the earlier pattern matches every run
 * id the later one does: "team-a-*" before "team-a-7") could never be used
 * and is refused, naming the earlier one and its line.
 * Pure: filled by the config parser at startup, read-only afterwards (the
 * loop thread reads it). */

#define RUN_AUTH_MAX 256u /* [run "PATTERN"] sections */

struct run_auth_entry {
    char pattern[FS_MAX_RUN_ID_LEN + 1];
    char token[FS_MAX_TOKEN_LEN + 1];
    int line; /* of its section header (0: not from a file) */
};

struct run_auth {
    struct run_auth_entry e[RUN_AUTH_MAX];
    size_t n;
};

/* The config section [run "PATTERN"] filling ra (zero it first). */
void run_auth_section(struct run_auth *ra, struct config_section *out);

/* Every section has a token. 0, or -EINVAL with a message in why. */
int run_auth_check(const struct run_auth *ra, struct fs_err *why);

/* Does the glob match the whole run id? O(len(pattern) x len(run)). */
bool run_auth_match(const char *pattern, const char *run);

/* The token a Hello for run must carry ("" for none): the first matching
 * section's, else global. */
const char *run_auth_token(const struct run_auth *ra, const char *run, const char *global);

/* Who a run belongs to, for max_runs_per_token: the pattern of the first
 * matching section (the token it must carry), "" for the global token. */
const char *run_auth_owner(const struct run_auth *ra, const char *run);

#endif
