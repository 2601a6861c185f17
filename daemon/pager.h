#ifndef FORESHOCK_PAGER_H
#define FORESHOCK_PAGER_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "page_format.h"
#include "stats.h"
#include "store.h"

/* The pager: delivers committed alert transitions to on-call targets
 * (Alertmanager API v2, PagerDuty Events API v2, a JSON webhook), at least
 * once, surviving restarts.
 *
 *   writer: to_firing / to_resolved committed -> outbox rows (one per target,
 *     same transaction) -> after COMMIT pager_announce(max_id)
 *   pager thread: loads undone rows (read-only connection) -> route filter
 *     -> active silences -> libcurl POST -> outcome (delivered / retry at
 *     next_attempt_at / given up / silenced / skipped) -> STORE_ITEM_OUTBOX
 *     through the writer (the pager never writes SQLite itself).
 *
 * Order per (alert, target) is the outbox id order: a resolve waits for its
 * trigger. A trigger held by a silence is sent when the silence ends while
 * the alert still fires; if the alert resolves meanwhile, nothing of that
 * incident is sent. Alertmanager targets get firing alerts re-sent every
 * resend_interval (endsAt a few intervals ahead) until the resolve.
 *
 * Threads: pager_target_section and pager_config_check run on the main
 * thread at startup; pager_start / pager_stop on the main thread;
 * pager_announce on any thread (the writer); everything else on the pager
 * thread. */

#define PAGER_MAX_ROWS                                                                             \
    1024u                    /* undone outbox rows held in memory, shared equally by the           \
                              * targets; more wait in the table */
#define PAGER_MAX_OPEN 8192u /* paged, unresolved incidents tracked (resolves, re-sends) */
#define PAGER_MAX_SILENCES FS_STORE_MAX_LIVE_SILENCES /* active or future silences loaded */
#define PAGER_SILENCE_RELOAD_S 1.0                    /* silences are re-read this often */
#define PAGER_RESPONSE_KEEP 200u /* response body bytes kept for the error message */
#define PAGER_MATCH_MAX 1024u    /* `match` value bytes */
#define PAGER_ROUTING_KEY_MAX 128u
#define PAGER_SECRET_MAX 256u
#define PAGER_DEFAULT_PAGERDUTY_URL "https://events.pagerduty.com/v2/enqueue"

enum pager_type { PAGER_ALERTMANAGER = 0, PAGER_PAGERDUTY = 1, PAGER_WEBHOOK = 2 };

/* One `[target "NAME"]` section. */
struct pager_target_cfg {
    char name[STATS_TARGET_NAME_MAX];
    int type; /* enum pager_type; -1 until `type` is given */
    char url[PAGE_URL_MAX];
    char routing_key[PAGER_ROUTING_KEY_MAX];
    char secret[PAGER_SECRET_MAX];
    int min_severity; /* 0 warning, 1 critical */
    char match[PAGER_MATCH_MAX];
    double timeout;                      /* seconds, whole request */
    double connect_timeout;              /* seconds */
    double backoff_initial, backoff_max; /* seconds */
    double give_up_after;                /* seconds from the transition */
    double resend_interval;              /* seconds (alertmanager) */
    int line;                            /* config line of the header, for messages */
};

struct pager_config {
    size_t n;
    struct pager_target_cfg t[STATS_MAX_TARGETS];
    char origin[FS_CONFIG_MAX_PATH]; /* file name, for messages */
};

/* The `[target "NAME"]` config section over pc (zeroed by the caller),
 * for config_load_file's extra sections. */
void pager_target_section(struct pager_config *pc, struct config_section *out);

/* Checks each target once the file is read (type given, url present and
 * http(s), routing_key for pagerduty, match parses, backoff_initial <=
 * backoff_max). 0, or -EINVAL with a message naming the target. */
int pager_config_check(const struct pager_config *pc, struct fs_err *err);

/* Names the kind of a type ("alertmanager", ...). */
const char *pager_type_name(int type);

struct pager_opts {
    const struct pager_config *cfg; /* copied */
    const char *public_url;         /* copied; base of generatorURL and links */
    const char *db_path;            /* read-only connection of the pager thread */
    struct store *store;            /* outcomes go through the writer */
    struct fs_stats *stats;         /* targets[] named by the caller (pager_name_stats) */
};

/* Writes the targets' names and kinds into stats->targets[] and ntargets.
 * Main thread, before any thread starts. */
void pager_name_stats(const struct pager_config *cfg, struct fs_stats *stats);

struct pager;

/* Names the targets to the store (store_set_pager, no announce yet), so that
 * transitions committed before pager_start (the spool re-feed at startup)
 * have their outbox rows. Main thread, before the monitor stage starts. */
void pager_register(const struct pager_config *cfg, struct store *store);

/* Opens the read-only connection, initialises libcurl and starts the pager
 * thread, which first loads the undone outbox rows and the paged, still
 * open incidents. Also registers the targets and pager_announce with the
 * store (store_set_pager); rows committed earlier are found by that load. With no targets, does
 * nothing and sets *out to NULL. 0 or a negative errno-style code with err. Main thread. */
int pager_start(const struct pager_opts *opts, struct pager **out, struct fs_err *err);

/* The writer committed outbox rows up to max_id: wake the pager. Never
 * blocks for long (one mutex). Any thread. */
void pager_announce(void *ctx, int64_t max_id);

/* Stops the thread (a request in flight is abandoned within about a
 * second, its row left as it was),
 * after submitting the outcomes it has to the store, which must still be
 * open; then frees everything. Rows not delivered stay in the outbox for
 * the next start. NULL is a no-op. Main thread. */
void pager_stop(struct pager *p);

#endif
