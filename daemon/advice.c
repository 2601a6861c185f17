/* Advice: the [advice] policy, the Advice frame, and a connection's
 * bookkeeping. See advice.h; the writer's advice rows are in
 * store_advice.c. */
#include "advice.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alert.h"
#include "decode.h"
#include "detect.h"
#include "foreshock.pb-c.h"
#include "fs_grow.h"

_Static_assert(ADVICE_RULE_MAX == DETECT_NAME_MAX, "rule names fit");
_Static_assert(ADVICE_LABELS == ALERT_ATTR_LOSS_SPIKE + 1, "one policy row per label");
_Static_assert(ADVICE_SEVERITIES == DETECT_SEVERITY_CRITICAL + 1, "one column per severity");
_Static_assert((int)ADVICE_CHECKPOINT == (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_CHECKPOINT &&
                   (int)ADVICE_CHECKPOINT_AND_STOP ==
                       (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_CHECKPOINT_AND_STOP &&
                   (int)ADVICE_RESOLVED == (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_RESOLVED &&
                   (int)ADVICE_SUPERSEDED ==
                       (int)FORESHOCK__ADVICE_ACTION__ADVICE_ACTION_SUPERSEDED,
               "pinned actions are the wire's");

/* --- policy ------------------------------------------------------------------------ */

/* Label and severity names are alert.c's and detect.c's tables
 * (alert_attribution_parse, detect_severity_parse). */
static const struct {
    enum alert_attribution label;
    enum advice_action action;
} default_actions[] = {
    {ALERT_ATTR_ATTENTION_NUMERICS, ADVICE_CHECKPOINT},
    {ALERT_ATTR_OPTIMIZER_HYPERPARAMETER, ADVICE_CHECKPOINT},
    {ALERT_ATTR_COMBINED, ADVICE_CHECKPOINT},
    {ALERT_ATTR_ROUTER_BALANCE, ADVICE_CHECKPOINT},
    {ALERT_ATTR_NON_FINITE, ADVICE_CHECKPOINT_AND_STOP},
};

static int index_of(const char *const *names, size_t n, const char *s, size_t len)
{
    for (size_t i = 0; s && i < n; i++)
        if (strlen(names[i]) == len && strncmp(names[i], s, len) == 0)
            return (int)i;
    return -1;
}

/* "attention-numerics, ..., loss-spike, none; severities: warning, critical"
 * for a message: the labels in value order with "none" last. */
static void names_text(char *buf, size_t len)
{
    size_t off = 0;
    buf[0] = '\0';
    for (int i = 1; i <= ADVICE_LABELS && off < len; i++)
        off +=
            (size_t)snprintf(buf + off, len - off, "%s%s", i > 1 ? ", " : "",
                             alert_attribution_name((enum alert_attribution)(i % ADVICE_LABELS)));
    for (int i = 0; i < ADVICE_SEVERITIES && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, "%s%s", i ? ", " : "; severities: ",
                                detect_severity_name((enum detect_severity)i));
}

void advice_policy_default(struct advice_policy *p)
{
    memset(p, 0, sizeof(*p));
    p->enabled = true;
    for (size_t i = 0; i < sizeof(default_actions) / sizeof(default_actions[0]); i++)
        for (int s = 0; s < ADVICE_SEVERITIES; s++)
            p->action[default_actions[i].label][s] = (uint8_t)default_actions[i].action;
}

int advice_policy_set(struct advice_policy *p, const char *key, const char *value,
                      struct fs_err *why)
{
    if (strcmp(key, "enabled") == 0) {
        if (strcmp(value, "true") == 0 || strcmp(value, "false") == 0) {
            p->enabled = value[0] == 't';
            return 0;
        }
        return fs_err_set(why, -EINVAL, "key 'enabled': '%s' is not true or false", value);
    }
    static const char *const actions[] = {"none", "checkpoint", "checkpoint_and_stop"};
    int a = index_of(actions, sizeof(actions) / sizeof(actions[0]), value, strlen(value));
    const char *dot = strchr(key, '.');
    enum alert_attribution l;
    enum detect_severity sev;
    int s = -1;
    bool label_ok = alert_attribution_parse(key, dot ? (size_t)(dot - key) : strlen(key), &l) == 0;
    if (dot && detect_severity_parse(dot + 1, strlen(dot + 1), &sev) == 0)
        s = (int)sev;
    if (!label_ok || (dot && s < 0)) {
        char names[256];
        names_text(names, sizeof(names));
        return fs_err_set(why, -EINVAL,
                          "unknown key '%s': keys are enabled, LABEL or LABEL.SEVERITY "
                          "(labels: %s)",
                          key, names);
    }
    if (a < 0)
        return fs_err_set(why, -EINVAL,
                          "key '%s': '%s' is not checkpoint, checkpoint_and_stop or none", key,
                          value);
    for (int i = 0; i < ADVICE_SEVERITIES; i++)
        if (s < 0 || s == i)
            p->action[l][i] = (uint8_t)a;
    return 0;
}

static void *section_open(void *ctx, const char *sub, struct fs_err *why)
{
    if (sub) {
        fs_err_set(why, -EINVAL, "[advice] takes no name");
        return NULL;
    }
    return ctx;
}

static int section_set(void *ctx, void *target, const char *key, const char *value,
                       struct fs_err *why)
{
    (void)ctx;
    return advice_policy_set(target, key, value, why);
}

void advice_section(struct advice_policy *p, struct config_section *out)
{
    *out = (struct config_section){
        .name = "advice", .open = section_open, .set = section_set, .ctx = p};
}

enum advice_action advice_decide(const struct advice_policy *p, const char *label,
                                 const char *severity)
{
    if (!p || !p->enabled || !label || !severity)
        return ADVICE_NONE;
    enum alert_attribution l;
    enum detect_severity s;
    if (alert_attribution_parse(label, strlen(label), &l) != 0 ||
        detect_severity_parse(severity, strlen(severity), &s) != 0)
        return ADVICE_NONE;
    return (enum advice_action)p->action[l][s];
}

const char *advice_action_name(int action)
{
    switch (action) {
    case ADVICE_NONE:
        return "none";
    case ADVICE_CHECKPOINT:
        return "checkpoint";
    case ADVICE_CHECKPOINT_AND_STOP:
        return "checkpoint_and_stop";
    case ADVICE_RESOLVED:
        return "resolved";
    case ADVICE_SUPERSEDED:
        return "superseded";
    }
    return "unknown";
}

int64_t advice_rollback_step(int64_t first_breach_step, int32_t window)
{
    if (first_breach_step < 0)
        return -1;
    /* A windowed sample measures W(t) against W(t - window): the fault may
     * have begun anywhere after t - window. */
    int64_t back = window > 0 ? window : 1;
    return first_breach_step >= back ? first_breach_step - back : -1;
}

/* --- the frame ------------------------------------------------------------------------ */

int advice_encode(const struct advice_msg *m, uint8_t **out, size_t *len)
{
    Foreshock__Advice a = FORESHOCK__ADVICE__INIT;
    a.advice_id = (uint64_t)m->id;
    a.action = (Foreshock__AdviceAction)m->action;
    a.alert_id = (uint64_t)m->alert_id;
    a.rule = (char *)m->rule;
    if (m->label[0])
        a.label = (char *)m->label;
    if (m->severity[0])
        a.severity = (char *)m->severity;
        /* Optional fields: set (has_) only when the message holds a value. */
#define STEP(f)                                                                                    \
    do {                                                                                           \
        if (m->f >= 0) {                                                                           \
            a.has_##f = 1;                                                                         \
            a.f = (uint64_t)m->f;                                                                  \
        }                                                                                          \
    } while (0)
    STEP(step);
    STEP(first_breach_step);
    STEP(fired_step);
    STEP(rollback_step);
#undef STEP
#define LABEL(f, none)                                                                             \
    do {                                                                                           \
        if (m->f != (none)) {                                                                      \
            a.has_##f = 1;                                                                         \
            a.f = m->f;                                                                            \
        }                                                                                          \
    } while (0)
    LABEL(layer, -1);
    LABEL(head, -1);
    LABEL(window, 0);
    LABEL(rank, -1);
#undef LABEL
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_ADVICE;
    f.advice = &a;
    return decode_encode(&f, out, len);
}

/* --- one connection ----------------------------------------------------------------- */

int advice_conn_sent(struct advice_conn *ac, int64_t id)
{
    for (size_t i = 0; i < ac->n; i++)
        if (ac->ids[i] == id)
            return 0;
    if (ac->n >= ADVICE_MAX_UNACKED_PER_CONN)
        return -ENOSPC;
    int64_t *ids = fs_grow(ac->ids, &ac->cap, ac->n + 1, sizeof(*ids), 16);
    if (!ids)
        return -ENOMEM;
    ac->ids = ids;
    ac->ids[ac->n++] = id;
    return 0;
}

bool advice_conn_take(struct advice_conn *ac, int64_t id)
{
    for (size_t i = 0; i < ac->n; i++) {
        if (ac->ids[i] == id) {
            ac->ids[i] = ac->ids[--ac->n];
            return true;
        }
    }
    return false;
}

void advice_conn_free(struct advice_conn *ac)
{
    free(ac->ids);
    ac->ids = NULL;
    ac->n = ac->cap = 0;
}
