/* Pager payloads, routing, retry classification and backoff. Pure: see
 * page_format.h. */
#include "page_format.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void page_labels(const struct page_alert *a, struct page_labels *out)
{
    size_t n = 0;
    out->l[n++] = (struct silence_label){"alertname", a->rule};
    out->l[n++] = (struct silence_label){"run", a->run};
    out->l[n++] = (struct silence_label){"severity", a->severity};
    out->l[n++] = (struct silence_label){"family", a->family};
    out->l[n++] = (struct silence_label){"signature", a->attribution};
    out->l[n++] = (struct silence_label){"attribution", a->attribution};
    const struct {
        const char *name;
        int32_t v, none;
    } scope[4] = {{"layer", a->layer, -1},
                  {"head", a->head, -1},
                  {"window", a->window, 0},
                  {"rank", a->rank, -1}};
    for (int i = 0; i < 4; i++) {
        if (scope[i].v == scope[i].none || scope[i].v < 0)
            continue;
        snprintf(out->num[i], sizeof(out->num[i]), "%d", scope[i].v);
        out->l[n++] = (struct silence_label){scope[i].name, out->num[i]};
    }
    out->n = n;
}

static void ev_real(json_t *o, const char *k, double *out)
{
    json_t *v = json_object_get(o, k);
    if (json_is_number(v))
        *out = json_number_value(v);
    else if (json_is_null(v))
        *out = NAN;
}

static void ev_step(json_t *o, const char *k, int64_t *out)
{
    json_t *v = json_object_get(o, k);
    if (json_is_integer(v))
        *out = (int64_t)json_integer_value(v);
    else if (json_is_null(v))
        *out = -1;
}

int page_alert_evidence(struct page_alert *a, const char *json)
{
    json_t *o = json ? json_loads(json, 0, NULL) : NULL;
    if (!json_is_object(o)) {
        json_decref(o);
        return -EINVAL;
    }
    ev_real(o, "value", &a->value);
    ev_real(o, "median", &a->median);
    ev_real(o, "mad", &a->mad);
    ev_real(o, "z", &a->z);
    ev_step(o, "first_breach_step", &a->first_breach_step);
    ev_step(o, "fired_step", &a->fired_step);
    json_t *st = json_object_get(o, "step");
    if (json_is_integer(st))
        a->step = (int64_t)json_integer_value(st);
    json_decref(o);
    return 0;
}

/* Appends printf text at *off (bounded; truncates quietly). */
static void add(char *out, size_t len, size_t *off, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void add(char *out, size_t len, size_t *off, const char *fmt, ...)
{
    if (*off >= len)
        return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(out + *off, len - *off, fmt, ap);
    va_end(ap);
    if (k > 0)
        *off = (size_t)k < len - *off ? *off + (size_t)k : len - 1;
}

static void scope_text(const struct page_alert *a, char *out, size_t len)
{
    size_t off = 0;
    out[0] = '\0';
    if (a->layer >= 0)
        add(out, len, &off, " layer %d", a->layer);
    if (a->head >= 0)
        add(out, len, &off, " head %d", a->head);
    if (a->window > 0)
        add(out, len, &off, " window %d", a->window);
    if (a->rank >= 0)
        add(out, len, &off, " rank %d", a->rank);
}

void page_summary(const struct page_alert *a, char *out, size_t len)
{
    char scope[96];
    scope_text(a, scope, sizeof(scope));
    size_t off = 0;
    out[0] = '\0';
    add(out, len, &off, "%s %s: run %s%s: value %.6g (median %.6g, MAD %.3g, z %.3g) %s", a->rule,
        a->kind == PAGE_RESOLVE ? "resolved" : "firing", a->run, scope, a->value, a->median, a->mad,
        a->z, a->attribution);
}

void page_rfc3339(double unix_s, char *out, size_t len)
{
    if (!isfinite(unix_s) || unix_s < 0)
        unix_s = 0;
    time_t sec = (time_t)floor(unix_s);
    long ms = (long)llround((unix_s - (double)sec) * 1000.0);
    if (ms >= 1000) {
        sec++;
        ms -= 1000;
    }
    struct tm tm;
    gmtime_r(&sec, &tm);
    snprintf(out, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900, tm.tm_mon + 1,
             tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

void page_generator_url(const char *public_url, int64_t alert_id, char *out, size_t len)
{
    size_t n = strlen(public_url);
    while (n > 0 && public_url[n - 1] == '/')
        n--;
    snprintf(out, len, "%.*s/api/v1/alerts/%lld", (int)n, public_url, (long long)alert_id);
}

static json_t *jnum(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}
static json_t *jstep(int64_t v)
{
    return v >= 0 ? json_integer(v) : json_null();
}

/* Sets k to v in o (v consumed); returns nonzero on failure. */
static int oset(json_t *o, const char *k, json_t *v)
{
    return !v || json_object_set_new(o, k, v) != 0;
}

static json_t *labels_object(const struct page_alert *a)
{
    struct page_labels pl;
    page_labels(a, &pl);
    json_t *o = json_object();
    int e = !o;
    for (size_t i = 0; !e && i < pl.n; i++)
        e |= oset(o, pl.l[i].name, json_string(pl.l[i].value));
    if (e) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static char *dump(json_t *doc)
{
    char *s = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    return s;
}

/* A number as annotation text ("" when absent). */
static json_t *jtext_num(double v)
{
    char b[40] = "";
    if (isfinite(v))
        snprintf(b, sizeof(b), "%.17g", v);
    return json_string(b);
}

static json_t *jtext_step(int64_t v)
{
    char b[24] = "";
    if (v >= 0)
        snprintf(b, sizeof(b), "%lld", (long long)v);
    return json_string(b);
}

char *page_alertmanager_body(const struct page_alert *a, const char *public_url, double now,
                             double resend_interval)
{
    char summary[512], desc[768], starts[40], ends[40], url[PAGE_URL_MAX + 64];
    page_summary(a, summary, sizeof(summary));
    size_t off = 0;
    desc[0] = '\0';
    add(desc, sizeof(desc), &off,
        "rule %s (%s) %s on run %s at step %lld: value %.6g, median %.6g, MAD %.3g, z %.3g; "
        "first breach at step %lld, fired at step %lld",
        a->rule, a->family, a->kind == PAGE_RESOLVE ? "resolved" : "firing", a->run,
        (long long)a->step, a->value, a->median, a->mad, a->z, (long long)a->first_breach_step,
        (long long)a->fired_step);
    page_rfc3339(a->fired_at, starts, sizeof(starts));
    double end =
        a->kind == PAGE_RESOLVE ? a->resolved_at : now + PAGE_AM_ENDS_INTERVALS * resend_interval;
    page_rfc3339(end, ends, sizeof(ends));
    page_generator_url(public_url, a->alert_id, url, sizeof(url));

    json_t *ann = json_object(), *al = json_object(), *arr = json_array();
    int e = !ann || !al || !arr;
    if (!e) {
        e |= oset(ann, "summary", json_string(summary));
        e |= oset(ann, "description", json_string(desc));
        e |= oset(ann, "value", jtext_num(a->value));
        e |= oset(ann, "median", jtext_num(a->median));
        e |= oset(ann, "mad", jtext_num(a->mad));
        e |= oset(ann, "z", jtext_num(a->z));
        e |= oset(ann, "first_breach_step", jtext_step(a->first_breach_step));
        e |= oset(ann, "fired_step", jtext_step(a->fired_step));
        e |= oset(ann, "dedup_key", json_string(a->dedup_key));
        e |= oset(al, "labels", labels_object(a));
        e |= oset(al, "annotations", ann);
        ann = NULL;
        e |= oset(al, "startsAt", json_string(starts));
        e |= oset(al, "endsAt", json_string(ends));
        e |= oset(al, "generatorURL", json_string(url));
        e |= json_array_append_new(arr, al) != 0;
        al = NULL;
    }
    json_decref(ann);
    json_decref(al);
    if (e) {
        json_decref(arr);
        return NULL;
    }
    return dump(arr);
}

char *page_pagerduty_body(const struct page_alert *a, const char *routing_key,
                          const char *public_url)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    int e = 0;
    e |= oset(o, "routing_key", json_string(routing_key));
    e |= oset(o, "event_action", json_string(a->kind == PAGE_RESOLVE ? "resolve" : "trigger"));
    e |= oset(o, "dedup_key", json_string(a->dedup_key));
    if (a->kind == PAGE_TRIGGER && !e) {
        char summary[512], scope[96], component[PAGE_RULE_MAX + 96], url[PAGE_URL_MAX + 64], ts[40];
        page_summary(a, summary, sizeof(summary));
        scope_text(a, scope, sizeof(scope));
        snprintf(component, sizeof(component), "%s%s", a->rule, scope);
        page_generator_url(public_url, a->alert_id, url, sizeof(url));
        page_rfc3339(a->fired_at, ts, sizeof(ts));
        json_t *cd = json_object(), *p = json_object(), *links = json_array(),
               *link = json_object();
        e |= !cd || !p || !links || !link;
        if (!e) {
            e |= oset(cd, "value", jnum(a->value));
            e |= oset(cd, "median", jnum(a->median));
            e |= oset(cd, "mad", jnum(a->mad));
            e |= oset(cd, "z", jnum(a->z));
            e |= oset(cd, "first_breach_step", jstep(a->first_breach_step));
            e |= oset(cd, "fired_step", jstep(a->fired_step));
            e |= oset(cd, "step", json_integer(a->step));
            e |= oset(cd, "rule", json_string(a->rule));
            e |= oset(cd, "run", json_string(a->run));
            e |= oset(cd, "labels", labels_object(a));
            e |= oset(p, "summary", json_string(summary));
            e |= oset(p, "source", json_string(a->run));
            e |= oset(p, "severity",
                      json_string(strcmp(a->severity, "critical") == 0 ? "critical" : "warning"));
            e |= oset(p, "timestamp", json_string(ts));
            e |= oset(p, "component", json_string(component));
            e |= oset(p, "group", json_string(a->family));
            e |= oset(p, "class", json_string(a->attribution));
            e |= oset(p, "custom_details", cd);
            cd = NULL;
            e |= oset(link, "href", json_string(url));
            e |= oset(link, "text", json_string("Foreshock alert"));
            e |= json_array_append_new(links, link) != 0;
            link = NULL;
            e |= oset(o, "payload", p);
            p = NULL;
            e |= oset(o, "links", links);
            links = NULL;
            e |= oset(o, "client", json_string("Foreshock"));
            e |= oset(o, "client_url", json_string(url));
        }
        json_decref(cd);
        json_decref(p);
        json_decref(links);
        json_decref(link);
    }
    if (e) {
        json_decref(o);
        return NULL;
    }
    return dump(o);
}

char *page_webhook_body(const struct page_alert *a, const char *public_url)
{
    char url[PAGE_URL_MAX + 64];
    page_generator_url(public_url, a->alert_id, url, sizeof(url));
    json_t *doc = json_object(), *al = json_object(), *ev = json_object(), *sl = json_object();
    int e = !doc || !al || !ev || !sl;
    if (!e) {
        e |= oset(ev, "value", jnum(a->value));
        e |= oset(ev, "median", jnum(a->median));
        e |= oset(ev, "mad", jnum(a->mad));
        e |= oset(ev, "z", jnum(a->z));
        e |= oset(ev, "first_breach_step", jstep(a->first_breach_step));
        e |= oset(ev, "fired_step", jstep(a->fired_step));
        e |= oset(ev, "resolved_step", jstep(a->resolved_step));
        e |= oset(ev, "last_step", json_integer(a->step));
        /* The scope labels as the HTTP API shows them (present when they apply). */
        if (a->layer >= 0)
            e |= oset(sl, "layer", json_integer(a->layer));
        if (a->head >= 0)
            e |= oset(sl, "head", json_integer(a->head));
        if (a->window > 0)
            e |= oset(sl, "window", json_integer(a->window));
        if (a->rank >= 0)
            e |= oset(sl, "rank", json_integer(a->rank));
        e |= oset(al, "id", json_integer(a->alert_id));
        e |= oset(al, "run", json_string(a->run));
        e |= oset(al, "rule", json_string(a->rule));
        e |= oset(al, "state", json_string(a->kind == PAGE_RESOLVE ? "resolved" : "firing"));
        e |= oset(al, "severity", json_string(a->severity));
        e |= oset(al, "family", json_string(a->family));
        e |= oset(al, "attribution", json_string(a->attribution));
        e |= oset(al, "labels", sl);
        sl = NULL;
        e |= oset(al, "dedup_key", json_string(a->dedup_key));
        e |= oset(al, "alert_key", json_string(a->alert_key));
        e |= oset(al, "evidence", ev);
        ev = NULL;
        e |= oset(al, "incidents", json_integer((json_int_t)a->incidents));
        e |= oset(al, "created_at", jnum(a->created_at));
        e |= oset(al, "updated_at", jnum(a->updated_at));
        e |= oset(al, "series_id", a->series_id > 0 ? json_integer(a->series_id) : json_null());
        e |= oset(al, "fired_at", jnum(a->fired_at));
        e |= oset(al, "resolved_at", a->kind == PAGE_RESOLVE ? jnum(a->resolved_at) : json_null());
        e |= oset(doc, "version", json_string(PAGE_WEBHOOK_VERSION));
        e |= oset(doc, "status", json_string(a->kind == PAGE_RESOLVE ? "resolved" : "firing"));
        e |= oset(doc, "alert", al);
        al = NULL;
        e |= oset(doc, "labels", labels_object(a));
        e |= oset(doc, "url", json_string(url));
    }
    json_decref(al);
    json_decref(ev);
    json_decref(sl);
    if (e) {
        json_decref(doc);
        return NULL;
    }
    return dump(doc);
}

int page_hmac_sha256_hex(const void *key, size_t keylen, const void *msg, size_t len, char out[65])
{
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int maclen = 0;
    if (!HMAC(EVP_sha256(), key, (int)keylen, msg, len, mac, &maclen) || maclen != 32)
        return -EIO;
    static const char hex[] = "0123456789abcdef";
    for (unsigned i = 0; i < maclen; i++) {
        out[2 * i] = hex[mac[i] >> 4];
        out[2 * i + 1] = hex[mac[i] & 15];
    }
    out[64] = '\0';
    return 0;
}

enum page_verdict page_classify(long status)
{
    if (status >= 200 && status < 300)
        return PAGE_DELIVERED;
    if (status == 408 || status == 425 || status == 429)
        return PAGE_RETRY;
    /* The receiver understood and refused: sending it again changes nothing. */
    if (status >= 400 && status < 500)
        return PAGE_GIVE_UP;
    return PAGE_RETRY;
}

double page_backoff(double initial_s, double max_s, uint32_t attempts, double u01)
{
    if (attempts < 1)
        attempts = 1;
    double d = initial_s;
    /* d > 0: a zero (or NaN) initial would otherwise loop `attempts` times */
    for (uint32_t i = 1; i < attempts && d > 0 && d < max_s; i++)
        d *= 2;
    if (d > max_s)
        d = max_s;
    if (!(u01 >= 0) || u01 >= 1)
        u01 = 0;
    return d / 2 + u01 * d / 2;
}

int page_parse_match(const char *text, struct silence *out, struct fs_err *why)
{
    out->n = 0;
    out->limits = NULL; /* silence_free frees it: set even when nothing is parsed */
    out->starts_at = -INFINITY;
    out->ends_at = INFINITY;
    if (!text || text[0] == '\0')
        return 0;
    json_t *arr = json_array();
    if (!arr)
        return fs_err_set(why, -ENOMEM, "out of memory");
    int rc = 0;
    const char *p = text;
    while (rc == 0) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        char item[SILENCE_MAX_NAME + SILENCE_MAX_VALUE + 8];
        if (n == 0 || n >= sizeof(item)) {
            rc = fs_err_set(why, -EINVAL, "match: empty or too long matcher at '%.40s'", p);
            break;
        }
        memcpy(item, p, n);
        item[n] = '\0';
        char *s = item;
        while (*s == ' ')
            s++;
        char *op = strpbrk(s, "=!");
        if (!op || op == s) {
            rc = fs_err_set(why, -EINVAL,
                            "match: '%s' is not NAME=VALUE, NAME!=VALUE, NAME=~RE or NAME!~RE", s);
            break;
        }
        int neg = op[0] == '!';
        if (neg && op[1] != '=' && op[1] != '~') {
            rc = fs_err_set(why, -EINVAL, "match: '%s': '!' must be followed by '=' or '~'", s);
            break;
        }
        /* "!=" / "!~" / "=~" take two bytes, "=" one. */
        int regex = op[1] == '~';
        const char *v = op + (neg || regex ? 2 : 1);
        char *ne = op;
        while (ne > s && ne[-1] == ' ')
            ne--;
        *ne = '\0';
        while (*v == ' ')
            v++;
        json_t *m = json_pack("{s:s, s:s, s:b, s:b}", "name", s, "value", v, "isRegex", regex,
                              "isEqual", !neg);
        if (!m || json_array_append_new(arr, m) != 0) {
            rc = fs_err_set(why, -ENOMEM, "out of memory");
            break;
        }
        if (!end)
            break;
        p = end + 1;
    }
    if (rc == 0) {
        char *js = json_dumps(arr, JSON_COMPACT);
        struct fs_err sub = {0};
        rc = js ? silence_parse(js, strlen(js), out, &sub) : -ENOMEM;
        if (rc < 0)
            fs_err_set(why, rc, "match: %.255s", js ? sub.msg : "out of memory");
        free(js);
        out->starts_at = -INFINITY;
        out->ends_at = INFINITY;
    }
    json_decref(arr);
    return rc;
}

bool page_route_matches(const struct page_route *r, const struct page_alert *a)
{
    if (r->min_critical && strcmp(a->severity, "critical") != 0)
        return false;
    if (r->match.n == 0)
        return true;
    struct page_labels pl;
    page_labels(a, &pl);
    return silence_matches(&r->match, pl.l, pl.n, 0.0);
}

bool page_silenced(const struct silence *sils, size_t n, const struct page_alert *a, double now)
{
    struct page_labels pl;
    page_labels(a, &pl);
    for (size_t i = 0; i < n; i++)
        if (silence_matches(&sils[i], pl.l, pl.n, now))
            return true;
    return false;
}
