#ifndef FORESHOCK_PAGER_INTERNAL_H
#define FORESHOCK_PAGER_INTERNAL_H

/* Inside the pager: the thread's state, shared by its files only (other
 * modules use pager.h). Split by job:
 *
 *   pager.c          the thread: scheduling each row (order, silences,
 *                    routes, backoff), Alertmanager re-sends, start / stop
 *   pager_outbox.c   what it reads (undone outbox rows per target, paged
 *                    open incidents, silences, alert state) over its
 *                    read-only connection, and outcomes through the writer
 *   pager_send.c     one delivery: the receiver's payload (page_format.c)
 *                    POSTed with libcurl
 *   pager_config.c   the [target "NAME"] config section and its checks
 *
 * Everything here runs on the pager thread. */
#include <curl/curl.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"
#include "page_format.h"
#include "pager.h"
#include "silence_set.h"

/* An undone outbox row. */
struct prow {
    int64_t id;
    int64_t event_id;
    int target;  /* index into cfg.t, -1 = no longer configured */
    int state;   /* STORE_OUTBOX_PENDING or _SILENCED while held here */
    int done;    /* reached a final state; removed at the next compaction */
    int blocked; /* waits for an earlier row of its alert and target */
    uint32_t attempts;
    double next_at; /* unix seconds */
    double created_at;
    int logged; /* a failure of this row was logged */
    struct page_alert a;
};

/* A paged incident not yet resolved at one target: its resolve is sent;
 * Alertmanager targets get it re-sent. */
struct popen {
    int target;
    int resolving;      /* its resolve row is queued: no more re-sends */
    int silenced;       /* the last re-send was held by a silence */
    int failing;        /* the last re-send failed (logged once) */
    double next_resend; /* monotonic seconds: a wall clock step back must not stall re-sends
                         * (Alertmanager would end the alert after endsAt) */
    struct page_alert a;
};

struct pager {
    struct pager_config cfg;
    struct page_route routes[STATS_MAX_TARGETS];
    char public_url[PAGE_URL_MAX];
    struct store *store;
    struct fs_stats *stats;
    sqlite3 *db;
    CURL *curl;
    int curl_global;

    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC */
    int64_t announced; /* guarded by mu */
    atomic_int stopping;

    /* pager thread only */
    struct prow *rows;
    size_t nrows;
    struct popen *open;
    size_t nopen, capopen;
    /* Per target: rows are loaded per target into a share of the memory
     * (quota rows each), so a target that is down, or a silence holding
     * many triggers, never keeps another target's pages in the table. */
    size_t quota;                         /* PAGER_MAX_ROWS / targets */
    size_t count[STATS_MAX_TARGETS];      /* undone rows in memory */
    int64_t watermark[STATS_MAX_TARGETS]; /* highest outbox id loaded */
    int backlog[STATS_MAX_TARGETS];       /* the last load filled the share */
    int load_error;           /* the last load failed (retried at the next wake, not at once) */
    struct silence_set *sils; /* compiled once per silence (silence_set.h); NULL: none read */
    double sil_next;          /* monotonic seconds of the next reload */
    int sil_fresh;            /* silences were read during this pass of the loop */
    int sil_ok;               /* the last silence read succeeded: triggers may be sent */
    /* Targets that failed a retryable attempt during this pass, and when
     * that row retries: their other due rows wait until then instead of
     * each waiting out a timeout (one thread sends for every target). */
    int down[STATS_MAX_TARGETS];
    double down_until[STATS_MAX_TARGETS];
    uint64_t rng;
    struct log_ratelimit rl_fail, rl_giveup, rl_resend, rl_db, rl_store, rl_sil;
};

/* --- pager_outbox.c ------------------------------------------------------------ */

/* Submits the outcome of row r (state: enum store_outbox_state, status:
 * the HTTP status or 0, err: NULL or why) to the writer; a failure is
 * logged (the row is retried after a restart). */
void pager_record(struct pager *p, const struct prow *r, int state, int status, const char *err);

/* The tracked open incident of (alert_id, target), or NULL. */
struct popen *pager_open_find(struct pager *p, int64_t alert_id, int target);

/* Tracks a paged incident (replacing an older one of the same alert and
 * target), re-sent at next_resend (monotonic seconds). Returns 0 or
 * -ENOSPC / -ENOMEM (logged). */
int pager_open_add(struct pager *p, const struct page_alert *a, int target, double next_resend);

/* Stops tracking o (the incident was resolved at its target). */
void pager_open_remove(struct pager *p, struct popen *o);

/* Loads the paged incidents of the previous run (at start). */
void pager_load_open(struct pager *p);

/* Loads every target's undone rows above its watermark into its share of
 * memory; sets p->load_error when a read failed. */
void pager_load_rows(struct pager *p);

/* Whether a target has rows waiting in the table and room for them now. */
int pager_more_to_load(const struct pager *p);

/* Gives up the undone rows of targets no longer configured (at start). */
void pager_close_unconfigured(struct pager *p);

/* Whether an active silence of the last read holds a at now (unix s). */
int pager_silenced(const struct pager *p, const struct page_alert *a, double now);

/* Re-reads the silences active at now or later; p->sil_ok says whether the
 * read was whole. */
void pager_load_silences(struct pager *p, double now);

/* Whether the alert still fires in the incident that event_id opened: 1,
 * 0, or -1 when it cannot be read (logged). */
int pager_still_firing(struct pager *p, int64_t alert_id, int64_t event_id);

/* --- pager_send.c -------------------------------------------------------------- */

/* Builds the payload of page a for target t and POSTs it. Returns the
 * verdict; *status is the HTTP status (0 after a transport error) and err
 * says what failed. */
enum page_verdict pager_send_page(struct pager *p, const struct pager_target_cfg *t,
                                  const struct page_alert *a, long *status, char *err,
                                  size_t errlen);

#endif
