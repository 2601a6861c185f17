#ifndef FORESHOCK_ADVICE_H
#define FORESHOCK_ADVICE_H

#include <sqlite3.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"

/* Advice: what a trainer is told when an alert of its run fires or
 * resolves (proto/foreshock.proto, Advice). Three parts:
 *
 *  - the policy: which alerts advise what, from the `[advice]` section
 *    (label and severity -> checkpoint | checkpoint_and_stop | none). Pure,
 *    read-only once the daemon runs.
 *  - storage (writer thread): for every to_firing / to_resolved transition
 *    the policy advises on, one `advice` row in the transaction that
 *    commits the transition (persist first, then announce). What a stream
 *    is owed is derived from those rows and the `advice_deliveries` of the
 *    stream, so it survives reconnects and daemon restarts:
 *      - a firing advice while its incident is still open (no later advice
 *        of the alert closed it): to every stream of the run that has not
 *        acknowledged it;
 *      - a resolving advice: to the streams that were sent the firing
 *        advice it answers, until they acknowledge it.
 *    Streams are (run, attempt, rank): a new attempt is owed every open
 *    firing advice again (at least once per attempt).
 *  - the frame (any thread): an advice_msg packed as an Advice frame.
 *
 * Pinned numbers: enum advice_action is advice.action in the database and
 * AdviceAction on the wire. */

enum advice_action {
    ADVICE_NONE = 0,
    ADVICE_CHECKPOINT = 1,
    ADVICE_CHECKPOINT_AND_STOP = 2,
    ADVICE_RESOLVED = 3,
    ADVICE_SUPERSEDED = 4,
};

#define ADVICE_LABELS 7     /* = the alert_attribution values (alert.h) */
#define ADVICE_SEVERITIES 2 /* = the detect_severity values (detect.h) */

/* action[label][severity]; label and severity index the pinned enums
 * alert_attribution and detect_severity. */
struct advice_policy {
    bool enabled;
    uint8_t action[ADVICE_LABELS][ADVICE_SEVERITIES];
};

/* Defaults: checkpoint on every mechanism label (attention-numerics,
 * optimizer-hyperparameter, combined, router-balance), checkpoint_and_stop
 * on non-finite, nothing for loss-spike and none; enabled. */
void advice_policy_default(struct advice_policy *p);

/* One `[advice]` key: `enabled = true|false`, or `LABEL = ACTION` (both
 * severities) or `LABEL.SEVERITY = ACTION`, ACTION one of checkpoint,
 * checkpoint_and_stop, none. 0, or -EINVAL with a reason in why. */
int advice_policy_set(struct advice_policy *p, const char *key, const char *value,
                      struct fs_err *why);

/* The `[advice]` section over p, for config_load_file's extra sections. */
void advice_section(struct advice_policy *p, struct config_section *out);

/* What the policy advises when an alert with this label and severity (their
 * names, as stored: "attention-numerics", "critical") fires. ADVICE_NONE for
 * unknown names or a disabled policy. Pure. */
enum advice_action advice_decide(const struct advice_policy *p, const char *label,
                                 const char *severity);

/* "checkpoint", "checkpoint_and_stop", "resolved", "superseded"; "none" for
 * ADVICE_NONE and "unknown" out of range. Static strings. */
const char *advice_action_name(int action);

#define ADVICE_RULE_MAX 64 /* = DETECT_NAME_MAX */
#define ADVICE_LABEL_MAX 32
#define ADVICE_SEVERITY_MAX 16
/* Advices sent on one connection and not yet acknowledged that its acks
 * are matched against (an ack for anything else is ignored): bounds what a
 * client can make the writer do. */
#define ADVICE_MAX_UNACKED_PER_CONN 4096u
/* Owed advices sent after one Welcome; more wait for the next connection
 * (logged). Firing advices are at most one per alert identity of the run. */
#define ADVICE_MAX_OWED_PER_HELLO 1024u

/* One advice as the writer announces it and the frame carries it. */
struct advice_msg {
    int64_t id;
    int64_t run_id;
    int64_t alert_id;
    int action; /* enum advice_action */
    char rule[ADVICE_RULE_MAX];
    char label[ADVICE_LABEL_MAX];
    char severity[ADVICE_SEVERITY_MAX];
    int64_t step, first_breach_step, fired_step, rollback_step; /* -1: none */
    int32_t layer, head, window, rank;                          /* -1 (window: 0): not applicable */
    int64_t fire_id; /* an answer (resolved, superseded): the firing advice it answers; 0: none */
};

/* The last step before the span of the first breaching sample: first_breach
 * - window for a windowed series (window > 0), else first_breach - 1; -1
 * when first_breach is unknown or the result would be negative. Pure. */
int64_t advice_rollback_step(int64_t first_breach_step, int32_t window);

/* Packs m as a length-prefixed Advice frame into a new malloc'd buffer.
 * 0, -ENOMEM. Any thread. */
int advice_encode(const struct advice_msg *m, uint8_t **out, size_t *len);

/* --- one connection (ingest, loop thread) -------------------------------------- */

/* The advices sent on a connection and not yet acknowledged: an AdviceAck
 * is forwarded to the writer only for these, once each. */
struct advice_conn {
    bool enabled; /* the Hello declared CAPABILITY_ADVICE */
    int64_t *ids;
    size_t n, cap;
};

/* Records that id was sent (again). 0, -ENOSPC when ADVICE_MAX_UNACKED_PER_CONN
 * ids are outstanding, -ENOMEM. */
int advice_conn_sent(struct advice_conn *ac, int64_t id);

/* True (and forgets id) when id was sent and not yet acknowledged. */
bool advice_conn_take(struct advice_conn *ac, int64_t id);

void advice_conn_free(struct advice_conn *ac);

/* --- storage (writer thread, inside the writer's open transaction) ----------- */

struct advice_store;

/* Prepares the statements on db (the writer's connection, schema migrated).
 * 0 and *out, or a negative errno-style code. Main thread at store_open. */
int advice_store_open(sqlite3 *db, struct advice_store **out);
void advice_store_close(struct advice_store *as);

/* One alert transition just stored (alert row alert_id, alert_events row
 * event_id): to_state is the row's new state (alert.h pinned numbers).
 * A firing transition the policy advises on closes the alert's earlier
 * advices and inserts a firing advice; a resolving one closes the open
 * firing advice of the alert and inserts the resolving advice that answers
 * it (none when the firing was not advised); a superseding one (a rewind)
 * likewise, with a superseded answer. *made is set and *out filled
 * when a row was inserted. SQLite rc. */
struct advice_event {
    int64_t run_id, alert_id, event_id;
    int to_state;
    const char *rule, *label, *severity;
    int64_t step, first_breach_step, fired_step;
    int32_t layer, head, window, rank;
};
int advice_store_event(struct advice_store *as, const struct advice_policy *p,
                       const struct advice_event *ev, double now, struct advice_msg *out,
                       bool *made);

/* A rewind of run_id to resume_step (attempts.h): every open firing advice
 * whose incident's first breach is after resume_step is closed and answered
 * with a superseded advice (owed to the streams that had it), in the
 * Hello's transaction, before the new attempt's owed advice is looked up.
 * cb gets each answer. SQLite rc (or cb's non-zero value). */
int advice_store_rewind(struct advice_store *as, int64_t run_id, uint64_t resume_step, double now,
                        int (*cb)(void *ctx, const struct advice_msg *m), void *ctx);

/* The streams that were sent the firing advice fire_id (an answer is owed
 * to those only): cb(ctx, stream_id) for each; cb returns 0 to go on.
 * SQLite rc (or cb's non-zero value). */
int advice_store_fire_streams(struct advice_store *as, int64_t fire_id,
                              int (*cb)(void *ctx, int64_t stream_id), void *ctx);

/* What stream_id (of run_id) is owed, oldest first: calls cb for at most
 * max advices; cb returns 0 to go on. *more is set when more were owed.
 * SQLite rc (or cb's non-zero value). */
int advice_store_owed(struct advice_store *as, int64_t run_id, int64_t stream_id, size_t max,
                      int (*cb)(void *ctx, const struct advice_msg *m), void *ctx, bool *more);

/* Records that advice_id was sent to stream_id (acked 0) or acknowledged by
 * it (acked 1) at now. An advice of another run, or an unknown id, is
 * ignored. SQLite rc. */
int advice_store_delivery(struct advice_store *as, int64_t advice_id, int64_t stream_id, int acked,
                          double now);

#endif
