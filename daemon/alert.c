/* Alert lifecycle, identity and attribution. See alert.h. */
#include "alert.h"
#include "fs_index.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

void alert_state_init(struct alert_state *st)
{
    memset(st, 0, sizeof(*st));
    st->state = ALERT_INACTIVE;
    st->first_breach_step = -1;
    st->fired_step = -1;
    st->resolved_step = -1;
}

bool alert_is_open(const struct alert_state *st)
{
    return st && (st->state == ALERT_PENDING || st->state == ALERT_FIRING);
}

void alert_evidence_init(struct alert_evidence *e)
{
    for (size_t i = 0; i < DETECT_FAMILY_COUNT; i++)
        e->first[i] = -1;
    e->nonfinite = false;
}

bool alert_evidence_add(struct alert_evidence *e, const struct alert_state *st,
                        enum detect_family family)
{
    if (!alert_is_open(st) || (unsigned)family >= DETECT_FAMILY_COUNT)
        return false;
    e->nonfinite = e->nonfinite || st->nonfinite;
    /* An open incident always has a first breach; be safe with old blobs. */
    int64_t first = st->first_breach_step >= 0 ? st->first_breach_step : INT64_MAX;
    if (e->first[family] >= 0 && e->first[family] <= first)
        return false;
    e->first[family] = first;
    return true;
}

static void enter(struct alert_state *st, enum alert_state_id to, double now)
{
    st->state = (uint8_t)to;
    st->since = now;
}

/* Opens a new incident on a breaching sample. */
static void open_incident(struct alert_state *st, const struct detect_rule *rule,
                          const struct detect_verdict *v, int64_t step)
{
    st->breach_run = 0;
    st->normal_run = 0;
    st->first_breach_step = step;
    st->fired_step = -1;
    st->resolved_step = -1;
    st->nonfinite = false;
    st->severity = (uint8_t)rule->severity;
    st->breach_kind = (uint8_t)v->breach_kind;
}

/* Has the open breach persisted long enough to fire? persistence counts
 * consecutive breaching samples; for a windowed series (a Delta over
 * `window` steps) they must also span (persistence - 1) windows, because
 * samples of overlapping windows (a 25-step window sketched every 5 steps)
 * share most of their updates and are not independent evidence: three
 * such samples of one 25-step transient would otherwise confirm it 10 steps
 * after it began. Needs no state beyond the first breach step. */
static bool persisted(const struct alert_state *st, const struct detect_rule *rule,
                      const struct alert_scope *scope, const struct detect_verdict *v, int64_t step)
{
    uint32_t need = rule->persistence;
    /* Another layer's breach of size confirms this one (evaluate.c:
     * cross_layer_confirms): the evidence persistence waits for is there. */
    if (v->confirmed && detect_breach_of_size(v->breach_kind))
        return true;
    /* Breaches of size (detect.h: magnitude_persistence) at both ends of
     * the run: the incident opened on one and this sample is one. */
    if (rule->magnitude_persistence > 0 && rule->magnitude_persistence < need &&
        detect_breach_of_size(st->breach_kind) && detect_breach_of_size(v->breach_kind))
        need = rule->magnitude_persistence;
    if (st->breach_run < need)
        return false;
    if (scope->window <= 0 || need <= 1)
        return true;
    int64_t span = (int64_t)(need - 1) * (int64_t)scope->window;
    return step - st->first_breach_step >= span;
}

int alert_step(struct alert_state *st, const struct detect_rule *rule,
               const struct alert_scope *scope, const struct detect_verdict *v, int64_t step,
               double now, struct alert_transition *out)
{
    if (!st || !rule || !scope || !v || !out)
        return -EINVAL;
    memset(out, 0, sizeof(*out));
    enum alert_state_id from = (enum alert_state_id)st->state;
    enum alert_state_id to = from;
    enum alert_change change = ALERT_CHANGE_NONE;

    if (v->present) {
        if (v->breach) {
            if (st->state == ALERT_INACTIVE || st->state == ALERT_RESOLVED)
                open_incident(st, rule, v, step);
            st->normal_run = 0;
            st->breach_run++;
            if (v->non_finite) {
                st->nonfinite = true;
                st->severity = DETECT_SEVERITY_CRITICAL;
            }
            if (st->state != ALERT_FIRING) {
                /* A non-finite value cannot become "more" confirmed: page
                 * now, or after nonfinite_persistence breaches in a row
                 * (grad_norm: a loss scaler's skipped overflows). */
                uint32_t nf = rule->nonfinite_persistence > 1 ? rule->nonfinite_persistence : 1;
                if (v->non_finite ? st->breach_run >= nf : persisted(st, rule, scope, v, step))
                    to = ALERT_FIRING;
                else
                    to = ALERT_PENDING;
            }
        } else if (st->state == ALERT_PENDING) {
            /* A transient dip: forget it. */
            st->breach_run = 0;
            to = ALERT_INACTIVE;
        } else if (st->state == ALERT_FIRING) {
            st->breach_run = 0;
            if (++st->normal_run >= rule->resolve_after)
                to = ALERT_RESOLVED;
        }
    }

    if (to != from) {
        switch (to) {
        case ALERT_PENDING:
            change = ALERT_CHANGE_TO_PENDING;
            break;
        case ALERT_FIRING:
            change = ALERT_CHANGE_TO_FIRING;
            st->fired_step = step;
            st->incidents++;
            break;
        case ALERT_RESOLVED:
            change = ALERT_CHANGE_TO_RESOLVED;
            st->resolved_step = step;
            st->normal_run = 0;
            break;
        case ALERT_INACTIVE:
            change = ALERT_CHANGE_TO_INACTIVE;
            break;
        case ALERT_SUPERSEDED: /* never a lifecycle target: rows only */
            break;
        }
        enter(st, to, now);
    }

    out->change = change;
    out->from = from;
    out->to = (enum alert_state_id)st->state;
    snprintf(out->rule, sizeof out->rule, "%s", rule->name);
    out->family = rule->family;
    out->severity = (enum detect_severity)st->severity;
    out->breach_kind = v->present ? v->breach_kind : DETECT_BREACH_NONE;
    out->scope = *scope;
    out->step = step;
    out->time = now;
    out->value = v->value;
    out->median = v->median;
    out->mad = v->mad;
    out->z = v->z;
    out->non_finite = v->present && v->non_finite;
    out->first_breach_step = st->first_breach_step;
    out->fired_step = st->fired_step;
    out->incident = st->incidents;
    return 0;
}

/* Earliest of two first-breach steps (-1: none). */
static int64_t earliest(int64_t a, int64_t b)
{
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return a < b ? a : b;
}

/* Which mechanism the open evidence of a run points at. Delta2 collapse is
 * attention evidence; router weight growth and the trainer's learning rate
 * rising after warm-up are step-size evidence. Order decides what a pair
 * means, because each mechanism can produce the other's symptom:
 *   - a Delta2 collapse that opens after step-size evidence may be its
 *     consequence (on the corpus, every LR ramp collapsed Delta2 30-130
 *     steps later): optimizer-hyperparameter;
 *   - both opening at the same step: optimizer-hyperparameter, the one
 *     fault that explains both (a step several times too large collapses
 *     Delta2 within a sketch: a hidden 10x LR jump opened both at the
 *     first sketch after it; an attention fault does not triple the update
 *     ratio nor grow router weights at once);
 *   - a collapse first, then router growth: a degrading model grows router
 *     logits after the fact, attention-numerics;
 *   - a collapse first, then the learning rate rising: the trainer's own
 *     step size is an input no attention fault can move, so it is
 *     independent evidence of a second fault, combined. */
enum alert_attribution alert_attribute(const struct alert_evidence *e)
{
    int64_t attention = e->first[DETECT_FAMILY_ATTENTION_D2];
    int64_t lr = e->first[DETECT_FAMILY_STEP_SIZE];
    int64_t step_size = earliest(e->first[DETECT_FAMILY_ROUTER_WEIGHT], lr);

    if (e->nonfinite)
        return ALERT_ATTR_NON_FINITE;
    if (attention >= 0 && step_size >= 0) {
        if (step_size <= attention)
            return ALERT_ATTR_OPTIMIZER_HYPERPARAMETER;
        if (lr >= 0)
            return ALERT_ATTR_COMBINED;
        return ALERT_ATTR_ATTENTION_NUMERICS;
    }
    if (attention >= 0)
        return ALERT_ATTR_ATTENTION_NUMERICS;
    if (step_size >= 0)
        return ALERT_ATTR_OPTIMIZER_HYPERPARAMETER;
    if (e->first[DETECT_FAMILY_ROUTER_BALANCE] >= 0)
        return ALERT_ATTR_ROUTER_BALANCE;
    if (e->first[DETECT_FAMILY_SCALAR_LOSS] >= 0)
        return ALERT_ATTR_LOSS_SPIKE;
    return ALERT_ATTR_NONE;
}

/* Appends s to key at *pos with %-escaping; false when it does not fit. */
static bool append_escaped(char *key, size_t len, size_t *pos, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        bool esc = *p == '%' || *p == ',' || *p == '=' || *p < 0x20 || *p == 0x7f;
        size_t need = esc ? 3 : 1;
        if (*pos + need >= len)
            return false;
        if (esc) {
            key[(*pos)++] = '%';
            key[(*pos)++] = hex[*p >> 4];
            key[(*pos)++] = hex[*p & 0xf];
        } else {
            key[(*pos)++] = (char)*p;
        }
    }
    key[*pos] = '\0';
    return true;
}

static bool append_raw(char *key, size_t len, size_t *pos, const char *s)
{
    size_t n = strlen(s);
    if (*pos + n >= len)
        return false;
    memcpy(key + *pos, s, n + 1);
    *pos += n;
    return true;
}

int alert_key(const char *run, const char *rule, const struct alert_scope *scope, char *key,
              size_t len)
{
    if (!run || !rule || !scope || !key)
        return -EINVAL;
    if (strnlen(run, ALERT_RUN_MAX + 1) > ALERT_RUN_MAX ||
        strnlen(rule, DETECT_NAME_MAX) >= DETECT_NAME_MAX)
        return -EINVAL;
    if (len == 0)
        return -ENOSPC;
    char labels[96];
    snprintf(labels, sizeof labels,
             ",layer=%" PRId32 ",head=%" PRId32 ",window=%" PRId32 ",rank=%" PRId32, scope->layer,
             scope->head, scope->window, scope->rank);
    size_t pos = 0;
    key[0] = '\0';
    if (!append_raw(key, len, &pos, "run=") || !append_escaped(key, len, &pos, run) ||
        !append_raw(key, len, &pos, ",rule=") || !append_escaped(key, len, &pos, rule) ||
        !append_raw(key, len, &pos, labels)) {
        key[0] = '\0';
        return -ENOSPC;
    }
    return (int)pos;
}

int alert_dedup_key(const char *key, char *out, size_t len)
{
    if (!key || !out)
        return -EINVAL;
    if (len < ALERT_DEDUP_MAX)
        return -ENOSPC;
    snprintf(out, len, "fs-%016" PRIx64, fs_fnv1a(FS_FNV1A_BASIS, key, strlen(key)));
    return 0;
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

int alert_state_encode(const struct alert_state *st, uint8_t *buf, size_t len)
{
    if (!st || !buf)
        return -EINVAL;
    if (len < ALERT_STATE_ENCODED_BYTES)
        return -ENOSPC;
    uint64_t since;
    memcpy(&since, &st->since, sizeof since);
    put_le(buf + 0, ALERT_STATE_MAGIC, 4);
    put_le(buf + 4, ALERT_STATE_VERSION, 2);
    buf[6] = st->state;
    buf[7] = st->severity;
    buf[8] = st->breach_kind;
    buf[9] = st->nonfinite ? 1 : 0;
    put_le(buf + 10, 0, 2);
    put_le(buf + 12, st->breach_run, 4);
    put_le(buf + 16, st->normal_run, 4);
    put_le(buf + 20, (uint64_t)st->first_breach_step, 8);
    put_le(buf + 28, (uint64_t)st->fired_step, 8);
    put_le(buf + 36, (uint64_t)st->resolved_step, 8);
    put_le(buf + 44, since, 8);
    put_le(buf + 52, st->incidents, 8);
    return ALERT_STATE_ENCODED_BYTES;
}

int alert_state_decode(struct alert_state *st, const uint8_t *buf, size_t len)
{
    if (!st || !buf || len != ALERT_STATE_ENCODED_BYTES)
        return -EINVAL;
    if (get_le(buf, 4) != ALERT_STATE_MAGIC)
        return -EINVAL;
    if (get_le(buf + 4, 2) != ALERT_STATE_VERSION)
        return -ENOTSUP;
    struct alert_state s;
    alert_state_init(&s);
    s.state = buf[6];
    s.severity = buf[7];
    s.breach_kind = buf[8];
    if (s.state > ALERT_RESOLVED || s.severity > DETECT_SEVERITY_CRITICAL ||
        s.breach_kind > DETECT_BREACH_KIND_MAX || buf[9] > 1 || get_le(buf + 10, 2) != 0)
        return -EINVAL;
    s.nonfinite = buf[9] != 0;
    s.breach_run = (uint32_t)get_le(buf + 12, 4);
    s.normal_run = (uint32_t)get_le(buf + 16, 4);
    s.first_breach_step = (int64_t)get_le(buf + 20, 8);
    s.fired_step = (int64_t)get_le(buf + 28, 8);
    s.resolved_step = (int64_t)get_le(buf + 36, 8);
    uint64_t since = get_le(buf + 44, 8);
    memcpy(&s.since, &since, sizeof s.since);
    s.incidents = get_le(buf + 52, 8);
    /* An open incident always has a first breach; a fired one a fired step. */
    if ((s.state == ALERT_PENDING && (s.breach_run == 0 || s.first_breach_step < 0)) ||
        ((s.state == ALERT_FIRING || s.state == ALERT_RESOLVED) &&
         (s.fired_step < 0 || s.incidents == 0)))
        return -EINVAL;
    *st = s;
    return 0;
}

/* The names of the pinned numbers, one table per enum, indexed by value. */
static const char *const state_names[ALERT_STATE_COUNT] = {
    [ALERT_INACTIVE] = "inactive", [ALERT_PENDING] = "pending",       [ALERT_FIRING] = "firing",
    [ALERT_RESOLVED] = "resolved", [ALERT_SUPERSEDED] = "superseded",
};

static const char *const change_names[] = {
    [ALERT_CHANGE_NONE] = "none",
    [ALERT_CHANGE_TO_PENDING] = "to_pending",
    [ALERT_CHANGE_TO_FIRING] = "to_firing",
    [ALERT_CHANGE_TO_RESOLVED] = "to_resolved",
    [ALERT_CHANGE_TO_INACTIVE] = "to_inactive",
    [ALERT_CHANGE_TO_SUPERSEDED] = "to_superseded",
};

static const char *const attribution_names[ALERT_ATTR_COUNT] = {
    [ALERT_ATTR_NONE] = "none",
    [ALERT_ATTR_ATTENTION_NUMERICS] = "attention-numerics",
    [ALERT_ATTR_OPTIMIZER_HYPERPARAMETER] = "optimizer-hyperparameter",
    [ALERT_ATTR_COMBINED] = "combined",
    [ALERT_ATTR_ROUTER_BALANCE] = "router-balance",
    [ALERT_ATTR_NON_FINITE] = "non-finite",
    [ALERT_ATTR_LOSS_SPIKE] = "loss-spike",
};

#define NAMES_OF(t) (sizeof(t) / sizeof((t)[0]))

const char *alert_state_name(enum alert_state_id s)
{
    return (unsigned)s < NAMES_OF(state_names) ? state_names[s] : "unknown";
}

const char *alert_change_name(enum alert_change c)
{
    return (unsigned)c < NAMES_OF(change_names) ? change_names[c] : "unknown";
}

const char *alert_attribution_name(enum alert_attribution a)
{
    return (unsigned)a < NAMES_OF(attribution_names) ? attribution_names[a] : "unknown";
}

int alert_attribution_parse(const char *s, size_t len, enum alert_attribution *out)
{
    for (size_t i = 0; s && i < NAMES_OF(attribution_names); i++) {
        if (strlen(attribution_names[i]) == len && memcmp(attribution_names[i], s, len) == 0) {
            *out = (enum alert_attribution)i;
            return 0;
        }
    }
    return -EINVAL;
}
