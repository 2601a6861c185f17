#ifndef FORESHOCK_PAGE_FORMAT_H
#define FORESHOCK_PAGE_FORMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "silence.h"

/* What the pager sends, and how it decides: pure functions (no I/O, no
 * clocks: time is an argument, no globals). Payload builders return a
 * malloc'd NUL-terminated JSON document (jansson: every string escaped by
 * the library) that the caller frees, or NULL when out of memory. Any
 * thread, on its own structs.
 *
 * Labels (Alertmanager labels, silence matching, the `match` route filter):
 *   alertname (the rule, e.g. qk.d2.srank), run, severity, family,
 *   signature and attribution (both the incident's attribution label, e.g.
 *   attention-numerics), and layer, head, window, rank where the alert has
 *   that scope. */

#define PAGE_RUN_MAX 257  /* run name bytes with NUL (>= ALERT_RUN_MAX + 1) */
#define PAGE_RULE_MAX 64  /* = DETECT_NAME_MAX */
#define PAGE_KEY_MAX 1120 /* alert_key, >= ALERT_KEY_MAX */
#define PAGE_DEDUP_MAX 24 /* >= ALERT_DEDUP_MAX */
#define PAGE_WORD_MAX 40  /* severity, family, attribution */
#define PAGE_URL_MAX 1024 /* target url, public_url */
#define PAGE_MAX_LABELS 10
#define PAGE_AM_ENDS_INTERVALS 4 /* a firing alert's endsAt: this many resend intervals ahead */
#define PAGE_ERROR_MAX 256       /* one-line reason of a failed attempt */

enum page_kind { PAGE_TRIGGER = 1, PAGE_RESOLVE = 2 };

/* One page: an alert at one of its transitions (to_firing or to_resolved). */
struct page_alert {
    int64_t alert_id;
    enum page_kind kind;
    char run[PAGE_RUN_MAX];
    char rule[PAGE_RULE_MAX];
    char alert_key[PAGE_KEY_MAX];
    char dedup_key[PAGE_DEDUP_MAX];
    char severity[PAGE_WORD_MAX];                         /* "warning" | "critical" */
    char family[PAGE_WORD_MAX];                           /* detector family, e.g. attention_d2 */
    char attribution[PAGE_WORD_MAX];                      /* e.g. attention-numerics */
    int32_t layer, head, window, rank;                    /* -1 (window: 0) = not applicable */
    int64_t step;                                         /* the transition's step */
    int64_t first_breach_step, fired_step, resolved_step; /* -1 = none */
    double value, median, mad, z; /* evidence at the transition; NaN = none */
    double fired_at;              /* unix seconds of the to_firing transition */
    double resolved_at;           /* unix seconds of the to_resolved one (resolve) */
    uint64_t incidents;
    int64_t series_id;             /* 0 = none */
    double created_at, updated_at; /* of the alert row */
};

/* Label set of a page. Pointers go into a and into num: valid while both
 * live and are unchanged. */
struct page_labels {
    struct silence_label l[PAGE_MAX_LABELS];
    size_t n;
    char num[4][24];
};
void page_labels(const struct page_alert *a, struct page_labels *out);

/* Fills the evidence fields of a (value, median, mad, z, first_breach_step,
 * fired_step, step) from an alert_events.evidence_json document; fields it
 * lacks are left as they are. 0, or -EINVAL when json is not an object. */
int page_alert_evidence(struct page_alert *a, const char *json);

/* One human line: "qk.d2.srank firing: run gpt-7 layer 3 head 5: value
 * 1.02 (median 4.1, MAD 0.2, z -9.3) attention-numerics". */
void page_summary(const struct page_alert *a, char *out, size_t len);

/* RFC 3339 UTC with milliseconds: "2026-12-02T12:00:00.123Z". */
void page_rfc3339(double unix_s, char *out, size_t len);

/* public_url + "/api/v1/alerts/" + id (one '/' between them). */
void page_generator_url(const char *public_url, int64_t alert_id, char *out, size_t len);

/* Alertmanager API v2 (POST {url}/api/v2/alerts): a JSON array with one
 * alert. startsAt = fired_at; a trigger (or re-send) has endsAt = now +
 * PAGE_AM_ENDS_INTERVALS * resend_interval, a resolve endsAt = resolved_at. */
char *page_alertmanager_body(const struct page_alert *a, const char *public_url, double now,
                             double resend_interval);

/* PagerDuty Events API v2: {routing_key, event_action trigger|resolve,
 * dedup_key, payload{summary, source, severity, component, group, class,
 * custom_details}, links[{href,text}], client, client_url}; a resolve
 * carries routing_key, event_action and dedup_key only. */
char *page_pagerduty_body(const struct page_alert *a, const char *routing_key,
                          const char *public_url);

/* Generic webhook: {version:"1", status firing|resolved, alert{the HTTP
 * API's ALERT fields, evidence at this transition}, labels{...}, url}. */
char *page_webhook_body(const struct page_alert *a, const char *public_url);
#define PAGE_WEBHOOK_VERSION "1"

/* hex(HMAC-SHA256(key, msg)) into out (65 bytes). 0 or -EIO. */
int page_hmac_sha256_hex(const void *key, size_t keylen, const void *msg, size_t len, char out[65]);

/* What an HTTP status means for a delivery. */
enum page_verdict { PAGE_DELIVERED = 0, PAGE_RETRY = 1, PAGE_GIVE_UP = 2 };

/* 2xx delivered; 400, 401, 403, 404, 405, 409, 410, 413, 414, 415, 422 (and
 * other 4xx but 408, 425, 429) given up; 408, 425, 429, 5xx and anything
 * else (1xx, 3xx: redirects are not followed) retried. */
enum page_verdict page_classify(long status);

/* Seconds to wait after the attempts-th failed attempt (attempts >= 1):
 * d = min(max_s, initial_s * 2^(attempts-1)), then "equal jitter": d/2 +
 * u01 * d/2 with u01 in [0,1), so the result is in [d/2, d]. */
double page_backoff(double initial_s, double max_s, uint32_t attempts, double u01);

/* Routing filter of a target. */
struct page_route {
    int min_critical;     /* 1: only critical pages pass */
    struct silence match; /* n == 0: any labels pass */
};

/* Parses a `match` value: comma-separated NAME=VALUE, NAME!=VALUE,
 * NAME=~REGEX, NAME!~REGEX (regexes anchored, as in Alertmanager; a value
 * cannot contain ','). Empty text = no filter. 0 or -EINVAL with why.
 * The caller frees with silence_free. */
int page_parse_match(const char *text, struct silence *out, struct fs_err *why);

/* Whether page a goes to a target with route r. */
bool page_route_matches(const struct page_route *r, const struct page_alert *a);

/* Whether an active silence (at now) of sils[0..n) matches a. */
bool page_silenced(const struct silence *sils, size_t n, const struct page_alert *a, double now);

#endif
