#ifndef FORESHOCK_ALERT_H
#define FORESHOCK_ALERT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "detect.h"

/* The alert lifecycle per (run, rule, scope), its identity, and attribution
 * (docs/monitors.md section 4). Pure: no I/O, no clocks (time is an input), no
 * allocation. The loop thread owns every struct alert_state; the transitions
 * it returns go to the writer, and are announced only after they commit.
 *
 *   INACTIVE --breach--> PENDING --persistence consecutive breaches--> FIRING
 *     (for a windowed series, scope.window > 0, the breaches must also span
 *     (persistence - 1) * window steps: overlapping windows are not
 *     independent samples)
 *   PENDING  --normal sample--> INACTIVE
 *   FIRING   --resolve_after consecutive normal samples--> RESOLVED
 *   RESOLVED --breach--> PENDING (a new incident)
 *
 * A rewind (a trainer restarted from a checkpoint at step s, stage.h) ends
 * an incident that opened after s as SUPERSEDED: a state of the stored row
 * and its event only; the lifecycle state is then rebuilt as it was at s.
 *
 * A non-finite value, or a rule with persistence 1, goes straight to FIRING
 * from INACTIVE, RESOLVED or PENDING; a non-finite incident is critical.
 * Absent samples change nothing (they neither extend nor break a run of
 * breaches or of normal samples). Hysteresis is the rule's data:
 * rule->persistence and rule->resolve_after. */

/* Pinned numbers: stored in the alerts table and in state blobs. */
enum alert_state_id {
    ALERT_INACTIVE = 0,
    ALERT_PENDING = 1,
    ALERT_FIRING = 2,
    ALERT_RESOLVED = 3,
    ALERT_SUPERSEDED = 4, /* stored rows only: ended by a rewind (never in a blob) */
};
#define ALERT_STATE_COUNT (ALERT_SUPERSEDED + 1)

/* What one alert_step did. Pinned too (alert_events rows). */
enum alert_change {
    ALERT_CHANGE_NONE = 0,
    ALERT_CHANGE_TO_PENDING = 1,
    ALERT_CHANGE_TO_FIRING = 2,
    ALERT_CHANGE_TO_RESOLVED = 3,
    ALERT_CHANGE_TO_INACTIVE = 4,
    ALERT_CHANGE_TO_SUPERSEDED = 5, /* a rewind ended the incident (stage.h) */
};

/* Attribution labels. Pinned. */
enum alert_attribution {
    ALERT_ATTR_NONE = 0,
    ALERT_ATTR_ATTENTION_NUMERICS = 1,
    ALERT_ATTR_OPTIMIZER_HYPERPARAMETER = 2,
    ALERT_ATTR_COMBINED = 3,
    ALERT_ATTR_ROUTER_BALANCE = 4,
    ALERT_ATTR_NON_FINITE = 5,
    ALERT_ATTR_LOSS_SPIKE = 6,
};
#define ALERT_ATTR_COUNT (ALERT_ATTR_LOSS_SPIKE + 1)

/* Series labels, as in the series table: -1 (window: 0) means "none". */
struct alert_scope {
    int32_t layer;
    int32_t head;
    int32_t window;
    int32_t rank;
};
#define ALERT_SCOPE_NONE ((struct alert_scope){.layer = -1, .head = -1, .window = 0, .rank = -1})

#define ALERT_RUN_MAX 256 /* longest run name accepted by alert_key (bytes) */
/* Every byte of run and rule may be %-escaped (3x), plus four labels. */
#define ALERT_KEY_MAX (3 * ALERT_RUN_MAX + 3 * DETECT_NAME_MAX + 96)
#define ALERT_DEDUP_MAX 20 /* "fs-" + 16 hex digits + NUL */

struct alert_state {
    uint8_t state;             /* enum alert_state_id */
    uint8_t severity;          /* enum detect_severity of the current incident */
    uint8_t breach_kind;       /* enum detect_breach_kind that opened the incident */
    bool nonfinite;            /* the current incident saw a non-finite value */
    uint32_t breach_run;       /* consecutive breaching samples */
    uint32_t normal_run;       /* consecutive normal samples while firing */
    int64_t first_breach_step; /* -1 when none */
    int64_t fired_step;        /* -1 until the incident fires */
    int64_t resolved_step;     /* -1 until it resolves */
    double since;              /* time (caller's clock) the state was entered */
    uint64_t incidents;        /* incidents that fired, ever */
};

/* One transition with its evidence. rule and scope are copies. */
struct alert_transition {
    enum alert_change change;
    enum alert_state_id from, to;
    char rule[DETECT_NAME_MAX];
    enum detect_family family;
    enum detect_severity severity;
    enum detect_breach_kind breach_kind; /* of this sample (NONE if normal) */
    struct alert_scope scope;
    int64_t step;
    double time;
    double value, median, mad, z; /* this sample's evidence */
    bool non_finite;
    int64_t first_breach_step;
    int64_t fired_step; /* -1 if not fired */
    uint64_t incident;  /* 1-based number of the incident that fired */
};

/* Blob: u32 magic 'FSAS', u16 version, u8 state, u8 severity, u8 breach_kind,
 * u8 flags (bit0 nonfinite), u16 zero, u32 breach_run, u32 normal_run,
 * i64 first_breach_step, i64 fired_step, i64 resolved_step, f64 since,
 * u64 incidents; little-endian. */
#define ALERT_STATE_MAGIC 0x53415346u /* "FSAS" little-endian */
#define ALERT_STATE_VERSION 1
#define ALERT_STATE_ENCODED_BYTES 60

/* Resets to INACTIVE with no history. Caller owns st. */
void alert_state_init(struct alert_state *st);

/* Advances the lifecycle by one detector verdict for `step` at time `now`.
 * Fills *out (out->change == ALERT_CHANGE_NONE when nothing changed) and
 * returns 0, or -EINVAL for NULL arguments. Loop thread (owner of st). */
int alert_step(struct alert_state *st, const struct detect_rule *rule,
               const struct alert_scope *scope, const struct detect_verdict *v, int64_t step,
               double now, struct alert_transition *out);

/* True while an incident is open (PENDING or FIRING). */
bool alert_is_open(const struct alert_state *st);

/* Evidence for attribution (docs/monitors.md section 4): for each family, the
 * first-breach step of the earliest open incident (-1: none open), and
 * whether an open incident saw a non-finite value. Caller-owned; fill with
 * alert_evidence_init and alert_evidence_add over a run's alerts. */
struct alert_evidence {
    int64_t first[DETECT_FAMILY_COUNT];
    bool nonfinite;
};

void alert_evidence_init(struct alert_evidence *e);

/* Adds st's incident when it is open (PENDING or FIRING). Returns true when
 * it is now the earliest open incident of its family. */
bool alert_evidence_add(struct alert_evidence *e, const struct alert_state *st,
                        enum detect_family family);

/* The label the evidence gives, from the mechanisms and which came first:
 *  - a non-finite value explains everything else: non-finite;
 *  - Delta2 collapse (attention_d2) is attention-numerics evidence; router
 *    weight growth (router_weight), the learning rate rising after
 *    warm-up and the update ratio tripling (step_size: the `lr` and
 *    `update_ratio` rules) are too-large-step evidence;
 *  - both open: step-size evidence first -> optimizer-hyperparameter (a
 *    collapse that follows large steps may be their consequence; nothing
 *    tells it apart), and so do both at the same step; Delta2 first, then
 *    step-size evidence -> combined (the trainer's own rate is an input
 *    no attention fault moves); Delta2 first, then router growth
 *    only -> attention-numerics (a degrading model grows router logits);
 *  - one of them alone: attention-numerics or optimizer-hyperparameter;
 *  - symptoms alone: router balance -> router-balance, loss or grad norm ->
 *    loss-spike; weight norms name no mechanism (both faults grow them):
 *    none.
 * Pure. The caller picks the evidence: evaluate.c labels a loss or grad-norm
 * incident from the mechanism evidence that opened before it only, and
 * leaves out attention and balance evidence that opened while a loss
 * incident fires (the loss jump's consequence). */
enum alert_attribution alert_attribute(const struct alert_evidence *e);

/* Stable identity. Writes "run=R,rule=N,layer=L,head=H,window=W,rank=K"
 * into key (len bytes), with '%', ',', '=' and control bytes of R and N
 * %-escaped, so distinct inputs give distinct keys. Returns the length, or
 * -EINVAL (NULL, run longer than ALERT_RUN_MAX, rule not shorter than
 * DETECT_NAME_MAX), -ENOSPC (len too small; ALERT_KEY_MAX always fits). */
int alert_key(const char *run, const char *rule, const struct alert_scope *scope, char *key,
              size_t len);

/* Dedup key (PagerDuty dedup_key, Alertmanager fingerprint label):
 * "fs-" + 16 lowercase hex digits of FNV-1a 64 over the alert_key string.
 * Depends only on its input, so it is the same across daemon and trainer
 * restarts. Returns 0, -EINVAL, or -ENOSPC (len < ALERT_DEDUP_MAX). */
int alert_dedup_key(const char *key, char *out, size_t len);

/* State blobs for restart. encode returns bytes written
 * (ALERT_STATE_ENCODED_BYTES) or -ENOSPC; decode returns 0, -EINVAL for a
 * malformed blob or -ENOTSUP for an unknown version, leaving *st untouched
 * on error. */
int alert_state_encode(const struct alert_state *st, uint8_t *buf, size_t len);
int alert_state_decode(struct alert_state *st, const uint8_t *buf, size_t len);

/* Names of the pinned numbers, as stored, logged and served: "inactive"..
 * "superseded", "to_pending".. "to_superseded", "none", "attention-numerics"..
 * "loss-spike". Static strings; "unknown" for values out of range. These are
 * the only tables of these names: other modules call these. Pure; any
 * thread. */
const char *alert_state_name(enum alert_state_id s);
const char *alert_change_name(enum alert_change c);
const char *alert_attribution_name(enum alert_attribution a);

/* The attribution called s (len bytes, no NUL needed): 0 with *out, or
 * -EINVAL for any other text. Pure; any thread. */
int alert_attribution_parse(const char *s, size_t len, enum alert_attribution *out);

#endif
