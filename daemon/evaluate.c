/* Detection and alert lifecycle of a run's detected series (see evaluate.h):
 * the track table, feeding one sample, and per-incident labels. */
#include "evaluate.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "fs_grow.h"
#include "fs_limits.h"

/* --- track table: an fs_index on an FNV-1a hash of the series key ---------------------- */

#define TRACK_INDEX_MIN_SLOTS 64u /* slots of a run's first index */

static uint64_t key_hash(const struct store_series_key *k)
{
    int32_t nums[4] = {k->layer, k->head, k->window, k->rank};
    return fs_fnv1a(fs_fnv1a(FS_FNV1A_BASIS, nums, sizeof(nums)), k->name, strlen(k->name));
}

static bool key_eq(const struct store_series_key *a, const struct store_series_key *b)
{
    return a->layer == b->layer && a->head == b->head && a->window == b->window &&
           a->rank == b->rank && strcmp(a->name, b->name) == 0;
}

static uint64_t track_hash(const void *owner, size_t pos)
{
    return ((const struct eval_run *)owner)->tracks[pos]->hash;
}

static struct eval_track *find(const struct eval_run *er, const struct store_series_key *k,
                               uint64_t hash)
{
    uint32_t at;
    for (size_t j = fs_index_start(&er->index, hash); (at = fs_index_at(&er->index, j));
         j = fs_index_next(&er->index, j)) {
        struct eval_track *t = er->tracks[at - 1];
        if (t->hash == hash && key_eq(&t->key, k))
            return t;
    }
    return NULL;
}

void eval_run_init(struct eval_run *er, const struct detect_rules *rules)
{
    memset(er, 0, sizeof(*er));
    er->rules = rules;
    er->progress.warmup_end = -1;
    er->progress.lr_last_step = -1;
    er->progress.grad_last_step = -1;
    for (size_t i = 0; i < EVAL_CROSS_LAYER_MAX; i++)
        er->size_breach[i].step = -1;
}

void eval_run_clear(struct eval_run *er)
{
    for (size_t i = 0; i < er->n_tracks; i++)
        free(er->tracks[i]);
    free(er->tracks);
    fs_index_free(&er->index);
    size_t max_tracks = er->max_tracks;
    eval_run_init(er, er->rules);
    er->max_tracks = max_tracks;
}

struct eval_track *eval_track_get(struct eval_run *er, const struct store_series_key *k,
                                  const char *rule_name)
{
    uint64_t hash = key_hash(k);
    struct eval_track *t = find(er, k, hash);
    if (t)
        return t;
    const struct detect_rule *rule = detect_rules_match(er->rules, rule_name);
    if (!rule)
        return NULL;
    if (er->max_tracks && er->n_tracks >= er->max_tracks) {
        er->capped++;
        return NULL;
    }
    if (fs_index_reserve(&er->index, er->n_tracks, TRACK_INDEX_MIN_SLOTS, track_hash, er) < 0)
        return NULL;
    struct eval_track **p = fs_grow(er->tracks, &er->cap_tracks, er->n_tracks + 1, sizeof(*p), 64);
    if (!p)
        return NULL;
    er->tracks = p;
    t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->key = *k;
    t->hash = hash;
    snprintf(t->rule_name, sizeof(t->rule_name), "%s", rule_name);
    t->rule = rule;
    detect_state_init(&t->ds);
    alert_state_init(&t->as);
    alert_state_encode(&t->as, t->row_blob, sizeof(t->row_blob));
    t->last_step = -1;
    t->ev_value = t->ev_median = t->ev_mad = t->ev_z = NAN;
    er->tracks[er->n_tracks] = t;
    fs_index_add(&er->index, hash, er->n_tracks);
    er->n_tracks++;
    return t;
}

void eval_rule_of_series(const char *series, char *rule, size_t len)
{
    snprintf(rule, len, "%s", series);
    size_t n = strlen(rule);
    if (strncmp(rule, "qk.", 3) == 0 && n > 4 &&
        (strcmp(rule + n - 4, ".min") == 0 || strcmp(rule + n - 4, ".max") == 0))
        rule[n - 4] = '\0';
}

bool eval_input_rule(const struct detect_rules *rules, const struct store_series_key *k,
                     uint32_t lead_rank, char *rule, size_t len)
{
    /* The per-layer aggregate each attention rule watches: the min over
     * heads, or the max for c_qk (rise is bad): a collapse shows first in a
     * minority of heads. */
    static const char *const qk_inputs[] = {"qk.d2.erank.min", "qk.d2.entropy.min",
                                            "qk.d2.srank.min", "qk.cqk.max"};
    static const char *const lead_scalars[] = {"loss", "grad_norm", "lr", "step_update_ratio"};
    static const char *const lead_layered[] = {"weight_norm", "update_ratio"};

    if (strncmp(k->name, "qk.", 3) == 0) {
        if (k->head != -1 || k->window <= 0 || k->layer < 0)
            return false;
        for (size_t i = 0; i < sizeof(qk_inputs) / sizeof(qk_inputs[0]); i++)
            if (strcmp(k->name, qk_inputs[i]) == 0) {
                eval_rule_of_series(k->name, rule, len);
                return detect_rules_match(rules, rule) != NULL;
            }
        return false;
    }
    if (strncmp(k->name, "router.", 7) == 0) {
        snprintf(rule, len, "%s", k->name);
        return k->layer >= 0 && detect_rules_match(rules, rule);
    }
    for (size_t i = 0; i < sizeof(lead_scalars) / sizeof(lead_scalars[0]); i++)
        if (strcmp(k->name, lead_scalars[i]) == 0 && k->rank == (int32_t)lead_rank &&
            k->layer == -1) {
            snprintf(rule, len, "%s", k->name);
            return detect_rules_match(rules, rule) != NULL;
        }
    for (size_t i = 0; i < sizeof(lead_layered) / sizeof(lead_layered[0]); i++)
        if (strcmp(k->name, lead_layered[i]) == 0 && k->rank == (int32_t)lead_rank &&
            k->layer >= 0) {
            snprintf(rule, len, "%s", k->name);
            return detect_rules_match(rules, rule) != NULL;
        }
    return false;
}

/* --- labels ------------------------------------------------------------------------------ */

/* "name layer=L head=H window=W" with only the labels the series has. */
static void describe(const struct store_series_key *k, char *out, size_t len)
{
    int n = snprintf(out, len, "%s", k->name);
    if (k->layer >= 0 && n >= 0 && (size_t)n < len)
        n += snprintf(out + n, len - (size_t)n, " layer=%d", k->layer);
    if (k->head >= 0 && n >= 0 && (size_t)n < len)
        n += snprintf(out + n, len - (size_t)n, " head=%d", k->head);
    if (k->window > 0 && n >= 0 && (size_t)n < len)
        snprintf(out + n, len - (size_t)n, " window=%d", k->window);
}

/* Total order on series keys, so that which of several series opened at
 * the same step is named does not depend on the order tracks were made (a
 * restart makes them in another order). */
static int key_cmp(const struct store_series_key *a, const struct store_series_key *b)
{
    int c = strcmp(a->name, b->name);
    if (c)
        return c;
    if (a->layer != b->layer)
        return a->layer < b->layer ? -1 : 1;
    if (a->window != b->window)
        return a->window < b->window ? -1 : 1;
    if (a->head != b->head)
        return a->head < b->head ? -1 : 1;
    return (a->rank > b->rank) - (a->rank < b->rank);
}

/* The first breach of the run's loss jump: its `loss` incident while it
 * is firing (INT64_MAX: none). Attention and router-balance evidence that
 * opens from there on is the jump's consequence, not its cause: a switch
 * to harder data (the ninth held-out look) lifted the loss z 15-18 at once
 * and then rewired attention (Delta2, c_qk) and the routers' load, which
 * read attention-numerics. Only the loss: an attention fault lifts the
 * gradient norm at once, before Delta2 moves, but in no corpus did its
 * loss page first. Step-size evidence keeps its meaning (an LR fault's
 * loss may page before the next sketch shows the step). */
#define EVAL_LOSS_RULE "loss"

static int64_t loss_jump_from(const struct eval_run *er)
{
    int64_t from = INT64_MAX;
    for (size_t i = 0; i < er->n_tracks; i++) {
        const struct eval_track *t = er->tracks[i];
        if (strcmp(t->rule->name, EVAL_LOSS_RULE) == 0 && t->as.state == ALERT_FIRING &&
            t->as.first_breach_step >= 0 && t->as.first_breach_step < from)
            from = t->as.first_breach_step;
    }
    return from;
}

/* Is t's open incident evidence for a label given before step `before`
 * and a loss jump from `jump`? Finite mechanism evidence counts when it
 * opened before `before`; the scalar loss family and non-finite values
 * whenever they opened; attention and router-balance evidence not from the
 * loss jump on (loss_jump_from). */
static bool evidence_in_time(const struct eval_track *t, int64_t before, int64_t jump)
{
    enum detect_family f = t->rule->family;
    if (f != DETECT_FAMILY_SCALAR_LOSS && !t->as.nonfinite && t->as.first_breach_step >= before)
        return false;
    return !((f == DETECT_FAMILY_ATTENTION_D2 || f == DETECT_FAMILY_ROUTER_BALANCE) &&
             !t->as.nonfinite && t->as.first_breach_step >= jump);
}

/* How many layers corroborate a Delta2 breach in a run of `layers` layers:
 * one up to 15, one more for every EVAL_CROSS_LAYER_PER (evaluate.h).
 * cross_layer_confirms asks it of other layers' breaches of size,
 * d2_pending_counts of layers with open incidents. */
static uint32_t layers_to_corroborate(uint32_t layers)
{
    return 1 + layers / EVAL_CROSS_LAYER_PER;
}

/* Does a pending (not yet fired) Delta2 incident count as evidence? An
 * unfired incident is a breaching sample or two of one layer, and a
 * deep narrow model holds one somewhere much of the time: the nineteenth look's
 * healthy 24-layer GPT (heads of 16) kept each layer's srank at 1.3-2.5 on
 * average, dipping to 1.04-1.67, and its hidden 5x LR jump at step 500
 * found layer 3's window-50 srank pending since 490 alone, so its
 * step-size page read combined. Pending Delta2 evidence counts when
 * open Delta2 incidents span at least 1 + layers / EVAL_CROSS_LAYER_PER
 * layers, what cross_layer_confirms asks of a breach: any one up to 15
 * layers (every corpus before that look: nothing changes), two from 16. A
 * fired incident always counts. */
static bool d2_pending_counts(const struct eval_run *er, int64_t before, int64_t jump)
{
    uint8_t seen[FS_MAX_LAYERS / 8] = {0};
    uint32_t layers = 0, open = 0;
    for (size_t i = 0; i < er->n_tracks; i++) {
        const struct eval_track *t = er->tracks[i];
        int32_t l = t->key.layer;
        if (t->rule->family != DETECT_FAMILY_ATTENTION_D2 || l < 0 || l >= (int32_t)FS_MAX_LAYERS)
            continue;
        if ((uint32_t)l + 1 > layers)
            layers = (uint32_t)l + 1;
        if (!alert_is_open(&t->as) || !evidence_in_time(t, before, jump) ||
            (seen[l / 8] & (1u << (l % 8))))
            continue;
        seen[l / 8] |= (uint8_t)(1u << (l % 8));
        open++;
    }
    return open >= layers_to_corroborate(layers);
}

/* The label the run's open evidence gives, and into why the series that
 * decided it: the evidence in time (evidence_in_time), pending Delta2
 * incidents only when corroborated (d2_pending_counts). */
static enum alert_attribution attribute_before(const struct eval_run *er, int64_t before, char *why,
                                               size_t whylen)
{
    struct alert_evidence e;
    const struct eval_track *first[DETECT_FAMILY_COUNT] = {0};
    int64_t jump = loss_jump_from(er);
    bool d2_pending = d2_pending_counts(er, before, jump);
    alert_evidence_init(&e);
    for (size_t i = 0; i < er->n_tracks; i++) {
        const struct eval_track *t = er->tracks[i];
        enum detect_family f = t->rule->family;
        if (!evidence_in_time(t, before, jump))
            continue;
        if (f == DETECT_FAMILY_ATTENTION_D2 && !d2_pending && !t->as.nonfinite &&
            t->as.state == ALERT_PENDING)
            continue;
        if (alert_evidence_add(&e, &t->as, f))
            first[f] = t;
        else if (alert_is_open(&t->as) && first[f] &&
                 t->as.first_breach_step == first[f]->as.first_breach_step &&
                 key_cmp(&t->key, &first[f]->key) < 0)
            first[f] = t;
    }
    enum alert_attribution attr = alert_attribute(&e);
    if (why && whylen) {
        /* The series behind the label: the earliest open one of each
         * family the label rests on. */
        static const enum detect_family order[] = {
            DETECT_FAMILY_ATTENTION_D2,   DETECT_FAMILY_ROUTER_WEIGHT, DETECT_FAMILY_STEP_SIZE,
            DETECT_FAMILY_ROUTER_BALANCE, DETECT_FAMILY_SCALAR_LOSS,   DETECT_FAMILY_WEIGHT_NORM};
        bool uses[DETECT_FAMILY_COUNT] = {false};
        switch (attr) {
        case ALERT_ATTR_COMBINED:
            uses[DETECT_FAMILY_ATTENTION_D2] = true;
            /* fall through */
        case ALERT_ATTR_OPTIMIZER_HYPERPARAMETER:
            uses[DETECT_FAMILY_ROUTER_WEIGHT] = uses[DETECT_FAMILY_STEP_SIZE] = true;
            break;
        case ALERT_ATTR_ATTENTION_NUMERICS:
            uses[DETECT_FAMILY_ATTENTION_D2] = true;
            break;
        case ALERT_ATTR_ROUTER_BALANCE:
            uses[DETECT_FAMILY_ROUTER_BALANCE] = true;
            break;
        case ALERT_ATTR_LOSS_SPIKE:
            uses[DETECT_FAMILY_SCALAR_LOSS] = true;
            break;
        case ALERT_ATTR_NON_FINITE:
        case ALERT_ATTR_NONE:
            for (size_t f = 0; f < DETECT_FAMILY_COUNT; f++)
                uses[f] = true;
            break;
        }
        size_t n = 0;
        why[0] = '\0';
        for (size_t i = 0; i < sizeof(order) / sizeof(order[0]); i++) {
            const struct eval_track *t = first[order[i]];
            if (!t || !uses[order[i]] || n + 2 >= whylen)
                continue;
            if (attr == ALERT_ATTR_NON_FINITE && !t->as.nonfinite)
                continue;
            if (n) {
                snprintf(why + n, whylen - n, "; ");
                n += 2;
            }
            describe(&t->key, why + n, whylen - n);
            n += strlen(why + n);
        }
    }
    return attr;
}

/* The label of event ev. A loss or gradient-norm incident is explained
 * only by mechanism evidence that opened before it did: one that opens
 * with it or after may be its consequence. A corrupted batch (the sixth
 * held-out look: three steps of random tokens) jolts the sketch that holds
 * it, so c_qk breached at the very sketch the loss spike opened at, and the
 * spike's page read attention-numerics. Mechanism incidents are labelled
 * from all open evidence as before (a collapse after a spike is still
 * attention-numerics). */
static enum alert_attribution event_attribute(const struct eval_run *er,
                                              const struct eval_event *ev, char *why, size_t whylen)
{
    int64_t before = INT64_MAX;
    if (ev->t->rule->family == DETECT_FAMILY_SCALAR_LOSS && ev->tr.first_breach_step >= 0)
        before = ev->tr.first_breach_step;
    return attribute_before(er, before, why, whylen);
}

/* Labels the events of b raised before `step` (every sample of their step
 * is in). An incident takes its label when it opens and again when it
 * fires (what was known then); a resolve or a lapse records the label of
 * its own step in the event only. */
static void label_before(struct eval_run *er, struct eval_batch *b, uint64_t step)
{
    /* Events are appended in feeding order, which is step order: the
     * unlabeled ones are a suffix, and those before `step` its head. */
    for (; b->next_label < b->n; b->next_label++) {
        struct eval_event *ev = &b->ev[b->next_label];
        if ((uint64_t)ev->tr.step >= step)
            break;
        if (!ev->has_event)
            continue;
        ev->attr = event_attribute(er, ev, ev->why, sizeof(ev->why));
        if (ev->tr.change == ALERT_CHANGE_TO_PENDING || ev->tr.change == ALERT_CHANGE_TO_FIRING) {
            ev->t->ev_attr = ev->attr;
            memcpy(ev->t->ev_why, ev->why, sizeof(ev->t->ev_why));
        }
    }
}

void eval_label_all(struct eval_run *er, struct eval_batch *b)
{
    label_before(er, b, UINT64_MAX);
}

/* --- progress ------------------------------------------------------------------------------ */

/* Appends (step, value) to h; the caller keeps steps increasing. */
static void history_push(struct eval_history *h, int64_t step, double value)
{
    h->value[h->head] = value;
    h->step[h->head] = step;
    h->head = (h->head + 1) % EVAL_LR_HISTORY;
    if (h->count < EVAL_LR_HISTORY)
        h->count++;
}

void eval_progress_lr(struct eval_run *er, uint64_t step, double lr)
{
    struct eval_progress *p = &er->progress;
    if (!isfinite(lr) || (int64_t)step <= p->lr_last_step)
        return;
    if (p->lr_seen && p->warmup_end < 0 && lr <= p->lr_last)
        p->warmup_end = (int64_t)step; /* the first step it did not rise */
    if (p->warmup_end < 0 && lr > p->lr_peak)
        p->lr_peak = lr; /* the warm-up's peak: at warmup_end - 1 */
    if (!p->lr_seen)
        p->lr_first_step = (int64_t)step;
    p->lr_seen = true;
    p->lr_last = lr;
    p->lr_last_step = (int64_t)step;
    history_push(&p->lr_hist, (int64_t)step, lr);
}

bool eval_optimizer_follows_grad(const char *name)
{
    /* Optimizers whose step is the rate times the gradient (or its momentum
     * average): torch.optim.SGD and ASGD, apex's FusedSGD, SGDW variants.
     * Adaptive and sign-based ones (Adam, AdamW, Adagrad, RMSprop, Lion,
     * Adafactor, Muon, ...) normalise the gradient away. */
    static const char *const names[] = {"SGD", "ASGD", "SGDW", "FusedSGD"};
    if (!name)
        return false;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcasecmp(name, names[i]) == 0)
            return true;
    return false;
}

bool eval_optimizer_orthogonalizes(const char *name)
{
    static const char needle[] = "muon";
    for (const char *p = name; p && *p; p++)
        if (strncasecmp(p, needle, sizeof needle - 1) == 0)
            return true;
    return false;
}

void eval_progress_grad(struct eval_run *er, uint64_t step, double grad_norm)
{
    struct eval_progress *p = &er->progress;
    if (!isfinite(grad_norm) || !(grad_norm > 0) || (int64_t)step <= p->grad_last_step)
        return;
    p->grad_last_step = (int64_t)step;
    history_push(&p->grad_hist, (int64_t)step, grad_norm);
}

/* h's slot of logical index k (0: the oldest held). */
static uint32_t history_slot(const struct eval_history *h, uint32_t k)
{
    return (h->head + EVAL_LR_HISTORY - h->count + k) % EVAL_LR_HISTORY;
}

/* The first logical index of h whose step is after `step` (h->count: none);
 * h's steps ascend. */
static uint32_t history_after(const struct eval_history *h, int64_t step)
{
    uint32_t lo = 0, hi = h->count;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (h->step[history_slot(h, mid)] <= step)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The mean value over steps (from, to] that h holds; else the newest one
 * at or before `to`. False when it holds none. Found by binary search: a
 * per-step series asks this every step, and only its last few steps count
 * (the whole history used to be scanned). The values are summed in slot
 * order, as that scan summed them. */
static bool history_over(const struct eval_history *h, int64_t from, int64_t to, double *mean)
{
    uint32_t end = history_after(h, to), begin = history_after(h, from);
    if (end == 0)
        return false;
    if (begin >= end) {
        *mean = h->value[history_slot(h, end - 1)];
        return true;
    }
    /* Slots begin..end-1, in slot order: a range that wraps past the last
     * slot starts again at slot 0, which the old scan reached first. */
    uint32_t first = history_slot(h, begin), n = end - begin;
    uint32_t tail = first + n > EVAL_LR_HISTORY ? EVAL_LR_HISTORY - first : n;
    double sum = 0;
    for (uint32_t i = 0; i < n - tail; i++)
        sum += h->value[i];
    for (uint32_t i = 0; i < tail; i++)
        sum += h->value[first + i];
    *mean = sum / n;
    return true;
}

/* The value in force at `step` (the newest at or before it) from h, whose
 * steps ascend. False when h holds none. */
static bool history_at(const struct eval_history *h, int64_t step, double *value)
{
    uint32_t k = history_after(h, step);
    if (k == 0)
        return false;
    *value = h->value[history_slot(h, k - 1)];
    return true;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0..n), n >= 1, sorting v. */
static double median_sorted(double *v, uint32_t n)
{
    qsort(v, n, sizeof(v[0]), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* A per_lr rule's credit for its sample at step (detect.h) of track t:
 * the rate at the baseline's samples (their median) over the logged rate
 * averaged over the steps (prev, step] the update covers (prev: the
 * track's previous sample), counting it only up to the warm-up's peak,
 * when that is below 1: the rise of the logged rate explains that much of
 * the step. 1 (none) for a run that logs no learning rate (none before
 * this step, or no warm-up peak yet: the baseline has not started then),
 * and while the history holds no rate of the baseline's steps. */
/* The median of h's values at the steps of t's baseline samples (those
 * h still holds). False when it holds none of them. */
static bool baseline_median(const struct eval_history *h, const struct eval_track *t,
                            double *median)
{
    double v[DETECT_MAX_WINDOW];
    int64_t steps[DETECT_MAX_WINDOW];
    uint32_t n = detect_baseline_steps(&t->ds, t->rule->window, steps), m = 0;
    for (uint32_t i = 0; i < n; i++)
        if (history_at(h, steps[i], &v[m]))
            m++;
    if (m == 0)
        return false;
    *median = median_sorted(v, m);
    return true;
}

static double per_lr_credit(const struct eval_progress *p, const struct eval_track *t,
                            uint64_t step)
{
    double ref, base;
    if (!p->lr_seen || p->lr_first_step > (int64_t)step || !(p->lr_peak > 0) ||
        !history_over(&p->lr_hist, t->last_step >= 0 ? t->last_step : (int64_t)step - 1,
                      (int64_t)step, &ref) ||
        !baseline_median(&p->lr_hist, t, &base))
        return 1;
    if (base < EVAL_LR_BASE_MIN_REL * p->lr_peak)
        base = EVAL_LR_BASE_MIN_REL * p->lr_peak;
    double now = ref < p->lr_peak ? ref : p->lr_peak;
    return now > base ? base / now : 1;
}

/* A per_lr rule's further credit for its sample at step in a run whose
 * update follows the gradient (eval_run.update_follows_grad): the square
 * root (EVAL_GRAD_CREDIT_POWER) of the gradient norm at the baseline's
 * samples (their median) over the norm averaged over the steps the update
 * covers, at least the last EVAL_GRAD_SPAN, when that is below 1. Under
 * SGD the step is the rate times the gradient, so an attention fault that
 * triples the gradient triples the step as a rate fault would; the rate
 * fault steps up against an unchanged gradient. 1 while the history holds
 * no norm of the baseline's steps. */
static double per_grad_credit(const struct eval_progress *p, const struct eval_track *t,
                              uint64_t step)
{
    double now, base;
    int64_t from = t->last_step >= 0 ? t->last_step : (int64_t)step - 1;
    if ((int64_t)step - from < EVAL_GRAD_SPAN)
        from = (int64_t)step - EVAL_GRAD_SPAN;
    if (!history_over(&p->grad_hist, from, (int64_t)step, &now) ||
        !baseline_median(&p->grad_hist, t, &base))
        return 1;
    return now > base ? pow(base / now, EVAL_GRAD_CREDIT_POWER) : 1;
}

/* The step training progress puts a start at, for a sample at `step`:
 * `warmups` x the LR warm-up end, at least `min`, both counted from the
 * run's origin (evaluate.h: step 0, or the first LR's step for a run first
 * seen late); `no_lr` for a trainer that reports no learning rate;
 * INT64_MAX while the LR still rises; detect_from_step > 0 wins.
 * Detection's start and an early baseline's differ only in those three
 * numbers. */
static int64_t progress_step(const struct eval_run *er, uint64_t step, int64_t detect_from_step,
                             int64_t warmups, int64_t min, int64_t no_lr)
{
    const struct eval_progress *p = &er->progress;
    if (detect_from_step > 0)
        return detect_from_step;
    /* Only what earlier steps said: warmup_end == step was learnt from this
     * step's own LR, which may be fed after this sample. */
    if (p->warmup_end >= 0 && p->warmup_end < (int64_t)step) {
        int64_t origin = p->lr_first_step >= EVAL_LATE_FIRST_STEP ? p->lr_first_step : 0;
        int64_t start = origin + warmups * (p->warmup_end - origin);
        return start > origin + min ? start : origin + min;
    }
    if (!p->lr_seen || p->lr_first_step >= (int64_t)step)
        return no_lr;
    return INT64_MAX; /* still warming up */
}

int64_t eval_start_step(const struct eval_run *er, uint64_t step, int64_t detect_from_step)
{
    return progress_step(er, step, detect_from_step, EVAL_START_WARMUPS, EVAL_START_MIN,
                         EVAL_START_NO_LR);
}

int64_t eval_baseline_step(const struct eval_run *er, uint64_t step, int64_t detect_from_step)
{
    return progress_step(er, step, detect_from_step, 1, EVAL_BASELINE_MIN, EVAL_BASELINE_MIN);
}

/* --- feeding ------------------------------------------------------------------------------- */

/* The median of h's values over steps (from, to]; false when it holds
 * fewer than `least` of them (and none). */
static bool history_median(const struct eval_history *h, int64_t from, int64_t to, uint32_t least,
                           double *median)
{
    double v[EVAL_LR_HISTORY];
    uint32_t begin = history_after(h, from), end = history_after(h, to), n = 0;
    for (uint32_t k = begin; k < end; k++)
        v[n++] = h->value[history_slot(h, k)];
    if (n == 0 || n < least)
        return false;
    *median = median_sorted(v, n);
    return true;
}

/* Before the start of detection, from the LR warm-up end (detect.h:
 * early_grad_rise): t's relative floor against a baseline of its own
 * samples since the warm-up end, a breach of size only while the gradient
 * norm (the median of the last EVAL_GRAD_SPAN steps) stands at least
 * early_grad_rise times its median since the warm-up end (up to a window
 * before this sample). An attention fault corrupts the backward pass: the
 * gradient jumps with the collapse. A healthy change of the data (a
 * sequence length doubled on learned positions, the twelfth held-out look)
 * moves Delta2 as far but leaves the gradient where it was. Sets *v to the
 * breach; a sample below the floor never joins the baseline. */
static void early_relative(const struct eval_run *er, struct eval_track *t, int64_t step,
                           double value, int64_t warm_end, struct detect_verdict *v)
{
    const struct detect_rule *r = t->rule;
    struct eval_early *e = &t->early;
    if (e->count >= EVAL_EARLY_MIN && step - e->first_step >= (int64_t)r->warmup_steps) {
        double tmp[EVAL_EARLY_RING], mad;
        memcpy(tmp, e->value, e->count * sizeof(double));
        double m = detect_median_mad(tmp, e->count, &mad), o = r->rel_origin;
        if (m - o > 0 && value - o <= r->floor_rel * (m - o)) {
            int64_t lag = t->key.window > 0 ? t->key.window : 1;
            double now, base;
            if (m - value >= DETECT_SIZE_NOISE_Z * DETECT_MAD_SCALE * mad &&
                history_median(&er->progress.grad_hist, step - EVAL_GRAD_SPAN, step, 1, &now) &&
                history_median(&er->progress.grad_hist, warm_end, step - lag, EVAL_GRAD_SPAN,
                               &base) &&
                now >= r->early_grad_rise * base) {
                v->breach = true;
                v->breach_kind = DETECT_BREACH_RELATIVE;
                v->median = m;
                v->mad = mad;
            }
            return;
        }
    }
    if (e->count == 0)
        e->first_step = step;
    e->value[e->head] = value;
    e->head = (e->head + 1) % EVAL_EARLY_RING;
    if (e->count < EVAL_EARLY_RING)
        e->count++;
}

/* The layers of the run's series of rules with cross_layer_windows over
 * `window` (the highest layer index + 1; 0: none). */
static int32_t cross_layer_layers(const struct eval_run *er, int32_t window)
{
    int32_t n = 0;
    for (size_t i = 0; i < er->n_tracks; i++) {
        const struct eval_track *t = er->tracks[i];
        if (t->rule->cross_layer_windows > 0 && t->key.window == window && t->key.layer >= n)
            n = t->key.layer + 1;
    }
    return n;
}

/* Do other layers confirm this sample's breach (detect.h:
 * cross_layer_windows)? True when the sample is a breach of size and at
 * least 1 + layers / EVAL_CROSS_LAYER_PER other layers had breaches of
 * size of rules with cross_layer_windows, over the same window and rank,
 * at most cross_layer_windows windows before this step (not at it: two
 * layers at one sample may share one odd batch). One other layer up to 15
 * layers, 6 of 80. The corpora's healthy runs hold a breach of size in
 * about 2 of 10,000 samples of a layer and window (p); with L layers one
 * other layer confirms a chance dip at about 2 (L p)^2 a sample: once in
 * 70,000 samples at 12 layers (the deepest corpus), once in 1,600 at 80,
 * where six others about never do. Remembers this breach. */
static bool cross_layer_confirms(struct eval_run *er, const struct eval_track *t, int64_t step,
                                 const struct detect_verdict *v)
{
    const struct store_series_key *k = &t->key;
    if (t->rule->cross_layer_windows == 0 || !v->present || !v->breach || k->window <= 0 ||
        k->layer < 0 || !detect_breach_of_size(v->breach_kind))
        return false;
    int64_t reach = (int64_t)t->rule->cross_layer_windows * k->window;
    int32_t seen[EVAL_CROSS_LAYER_MAX];
    uint32_t others = 0;
    for (size_t i = 0; i < EVAL_CROSS_LAYER_MAX; i++) {
        const struct eval_size_breach *b = &er->size_breach[i];
        if (b->step < 0 || b->window != k->window || b->rank != k->rank || b->layer == k->layer ||
            b->step >= step || step - b->step > reach)
            continue;
        bool dup = false;
        for (uint32_t j = 0; j < others && !dup; j++)
            dup = seen[j] == b->layer;
        if (!dup)
            seen[others++] = b->layer;
    }
    bool confirmed = others >= layers_to_corroborate((uint32_t)cross_layer_layers(er, k->window));
    er->size_breach[er->size_breach_next] = (struct eval_size_breach){
        .window = k->window, .rank = k->rank, .layer = k->layer, .step = step};
    er->size_breach_next = (er->size_breach_next + 1) % EVAL_CROSS_LAYER_MAX;
    return confirmed;
}

int eval_feed(struct eval_run *er, struct eval_batch *b, struct eval_track *t, uint64_t step,
              double value, bool present, int32_t argmin_head, int64_t detect_from_step, double now)
{
    if (!er || !b || !t)
        return -EINVAL;
    label_before(er, b, step);
    /* A replay (spool re-feed after a restart) of a step this series has
     * already seen changes nothing: that is what keeps restarts exact. */
    if ((int64_t)step <= t->last_step)
        return 0;
    struct detect_verdict v;
    struct alert_transition tr;
    struct alert_scope scope = {
        .layer = t->key.layer, .head = t->key.head, .window = t->key.window, .rank = t->key.rank};
    /* A series that has started (it holds baseline samples, maybe restored
     * after a restart) is past its start whatever progress says now. */
    /* The warm-up end as progress has it (EVAL_BASELINE_MIN at least):
     * where an early baseline starts, and where absolute bounds hold. */
    int64_t warm_end = eval_baseline_step(er, step, detect_from_step);
    int64_t from, base_from;
    if (t->rule->early_baseline) {
        /* Its baseline starts at the warm-up end and it detects once that
         * baseline is warm (detect_step_from), not 3 warm-ups later: the
         * schedule sets its level from the warm-up end on, and a fault
         * between the warm-up end and 3 warm-ups (a 300-step warm-up, a
         * step 10x too large at 700: the third held-out corpus) went
         * unjudged. Holding samples says nothing about the start: it comes
         * from progress, which a restart restores from the stored learning
         * rates (stage_load.c). */
        base_from = warm_end;
        from = base_from;
    } else {
        from = t->ds.accepted > 0 && detect_from_step <= 0
                   ? 0
                   : eval_start_step(er, step, detect_from_step);
        base_from = from;
    }
    /* A rule's absolute floor and ceiling hold from the warm-up end, as an
     * early baseline starts (evaluate.h EVAL_BASELINE_MIN), not 3 warm-ups
     * later: a value beyond them (the Delta2 rank-one floors) is no phase
     * of healthy training, and an attention fault soon after a long
     * warm-up (the twelfth held-out look: 500 steps, fault at 850, start of
     * detection 1,500) reached rank one at 1,050 and diverged at 1,090
     * unjudged. The z-scores and relative bounds still wait for the start:
     * a baseline of the early phase is too wide. */
    struct detect_judging j = {.baseline_from = base_from,
                               .detect_from = from,
                               .bounds_from = warm_end,
                               .ok_max = NAN,
                               .credit = 1};
    /* A long window's series may have its own z scale (detect.h:
     * scale_rel_long). */
    if (t->rule->scale_rel_long > 0 && t->key.window >= DETECT_LONG_WINDOW)
        j.scale_rel = t->rule->scale_rel_long;
    /* The logged rate explains a step up to its warm-up peak (detect.h:
     * per_lr, within_peak). */
    const struct eval_progress *p = &er->progress;
    if (t->rule->per_lr && present && isfinite(value)) {
        j.credit = per_lr_credit(p, t, step);
        if (er->update_follows_grad)
            j.credit *= per_grad_credit(p, t, step);
    }
    if (t->rule->within_peak && p->lr_peak > 0 && p->warmup_end >= 0 &&
        p->warmup_end < (int64_t)step)
        j.ok_max = p->lr_peak * (1 + EVAL_LR_PEAK_TOL);
    if (detect_step_judged(&t->ds, t->rule, (int64_t)step, value, present, &j, &v) < 0)
        return -EINVAL;
    if (t->rule->early_grad_rise > 0 && present && isfinite(value) && !v.breach &&
        warm_end < from && (int64_t)step > warm_end && (int64_t)step < from)
        early_relative(er, t, (int64_t)step, value, warm_end, &v);
    v.confirmed = cross_layer_confirms(er, t, (int64_t)step, &v);
    if (alert_step(&t->as, t->rule, &scope, &v, (int64_t)step, now, &tr) < 0)
        return -EINVAL;
    t->last_step = (int64_t)step;
    uint8_t blob[ALERT_STATE_ENCODED_BYTES];
    alert_state_encode(&t->as, blob, sizeof(blob));
    bool event = tr.change != ALERT_CHANGE_NONE;
    if (!event && memcmp(blob, t->row_blob, sizeof(blob)) == 0)
        return 1;
    if (event) {
        t->ev_value = tr.value;
        t->ev_median = tr.median;
        t->ev_mad = tr.mad;
        t->ev_z = tr.z;
    }
    struct eval_event *ev = fs_grow(b->ev, &b->cap, b->n + 1, sizeof(*ev), 16);
    if (!ev) {
        b->oom = 1;
        return -ENOMEM;
    }
    b->ev = ev;
    b->ev[b->n++] = (struct eval_event){
        .t = t, .has_event = event, .tr = tr, .argmin_head = argmin_head, .attr = t->ev_attr};
    memcpy(b->ev[b->n - 1].why, t->ev_why, sizeof(t->ev_why));
    return 1;
}

int eval_feed_stored(struct eval_run *er, struct eval_batch *b, const struct store_series_key *k,
                     uint64_t step, double value, bool present, uint32_t lead_rank,
                     int64_t detect_from_step)
{
    char rule[DETECT_NAME_MAX];
    if (strcmp(k->name, "lr") == 0 && k->rank == (int32_t)lead_rank && k->layer == -1 && present)
        eval_progress_lr(er, step, value);
    if (strcmp(k->name, "grad_norm") == 0 && k->rank == (int32_t)lead_rank && k->layer == -1 &&
        present)
        eval_progress_grad(er, step, value);
    if (!eval_input_rule(er->rules, k, lead_rank, rule, sizeof(rule)))
        return 0;
    struct eval_track *t = eval_track_get(er, k, rule);
    if (!t)
        return -ENOMEM;
    /* Time is not part of any decision: alert_step only stores it. */
    return eval_feed(er, b, t, step, value, present, -1, detect_from_step, 0);
}

void eval_batch_reset(struct eval_batch *b)
{
    b->n = 0;
    b->next_label = 0;
    b->oom = 0;
}

void eval_batch_free(struct eval_batch *b)
{
    free(b->ev);
    memset(b, 0, sizeof(*b));
}
