/* Pager payloads and decisions (page_format.c), as tables: every builder's
 * JSON is parsed back with jansson and checked field by field. */
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "page_format.h"

static struct page_alert sample(enum page_kind kind)
{
    struct page_alert a;
    memset(&a, 0, sizeof(a));
    a.alert_id = 42;
    a.kind = kind;
    strcpy(a.run, "gpt-7b \"quoted\"");
    strcpy(a.rule, "qk.d2.srank");
    strcpy(a.alert_key, "run=gpt-7b,rule=qk.d2.srank,layer=3,head=-1,window=10,rank=-1");
    strcpy(a.dedup_key, "fs-0123456789abcdef");
    strcpy(a.severity, "critical");
    strcpy(a.family, "attention_d2");
    strcpy(a.attribution, "attention-numerics");
    a.layer = 3;
    a.head = -1;
    a.window = 10;
    a.rank = -1;
    a.step = 1200;
    a.first_breach_step = 1180;
    a.fired_step = 1190;
    a.resolved_step = kind == PAGE_RESOLVE ? 1300 : -1;
    a.value = 1.05;
    a.median = 4.25;
    a.mad = 0.5;
    a.z = -9.5;
    a.fired_at = 1764676800.25; /* 2025-12-02T12:00:00.250Z */
    a.resolved_at = kind == PAGE_RESOLVE ? 1764677400.0 : 0;
    a.incidents = 2;
    a.series_id = 7;
    a.created_at = 1764670000.0;
    a.updated_at = 1764677400.0;
    return a;
}

static json_t *parse(char *s)
{
    cr_assert_not_null(s, "builder returned NULL");
    json_error_t e;
    json_t *doc = json_loads(s, JSON_REJECT_DUPLICATES, &e);
    cr_assert_not_null(doc, "not JSON (%s): %s", e.text, s);
    free(s);
    return doc;
}

static const char *str(json_t *o, const char *path)
{
    /* "a.b.c" object path */
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", path);
    json_t *v = o;
    for (char *k = strtok(buf, "."); k && v; k = strtok(NULL, "."))
        v = json_object_get(v, k);
    cr_assert(json_is_string(v), "%s is not a string", path);
    return json_string_value(v);
}

static json_t *get(json_t *o, const char *path)
{
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", path);
    json_t *v = o;
    for (char *k = strtok(buf, "."); k && v; k = strtok(NULL, "."))
        v = json_object_get(v, k);
    return v;
}

struct field {
    const char *path;
    const char *want; /* string value, or NULL: the field must be absent */
};

static void expect_fields(json_t *o, const struct field *f, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (!f[i].want) {
            cr_expect_null(get(o, f[i].path), "%s: %s should be absent", what, f[i].path);
            continue;
        }
        cr_expect_str_eq(str(o, f[i].path), f[i].want, "%s: %s", what, f[i].path);
    }
}

Test(page_format, alertmanager_trigger_fields)
{
    struct page_alert a = sample(PAGE_TRIGGER);
    json_t *arr = parse(page_alertmanager_body(&a, "https://fs.example/", 1764676900.0, 60));
    cr_assert(json_is_array(arr) && json_array_size(arr) == 1);
    json_t *al = json_array_get(arr, 0);
    static const struct field f[] = {
        {"labels.alertname", "qk.d2.srank"},
        {"labels.run", "gpt-7b \"quoted\""},
        {"labels.severity", "critical"},
        {"labels.family", "attention_d2"},
        {"labels.signature", "attention-numerics"},
        {"labels.layer", "3"},
        {"labels.window", "10"},
        {"labels.head", NULL},
        {"labels.rank", NULL},
        {"annotations.value", "1.05"},
        {"annotations.median", "4.25"},
        {"annotations.mad", "0.5"},
        {"annotations.z", "-9.5"},
        {"annotations.first_breach_step", "1180"},
        {"annotations.fired_step", "1190"},
        {"annotations.dedup_key", "fs-0123456789abcdef"},
        {"startsAt", "2025-12-02T12:00:00.250Z"},
        /* now + 4 x 60 s */
        {"endsAt", "2025-12-02T12:05:40.000Z"},
        {"generatorURL", "https://fs.example/api/v1/alerts/42"},
    };
    expect_fields(al, f, sizeof(f) / sizeof(f[0]), "alertmanager trigger");
    const char *summary = str(al, "annotations.summary");
    cr_expect(strstr(summary, "qk.d2.srank firing") == summary, "summary: %s", summary);
    cr_expect(strstr(summary, "layer 3") && strstr(summary, "attention-numerics"), "%s", summary);
    cr_expect(strstr(str(al, "annotations.description"), "first breach at step 1180"));
    json_decref(arr);
}

Test(page_format, alertmanager_resolve_ends_in_the_past)
{
    struct page_alert a = sample(PAGE_RESOLVE);
    json_t *arr = parse(page_alertmanager_body(&a, "http://127.0.0.1:7782", 1764680000.0, 60));
    json_t *al = json_array_get(arr, 0);
    static const struct field f[] = {
        {"startsAt", "2025-12-02T12:00:00.250Z"},
        {"endsAt", "2025-12-02T12:10:00.000Z"},
        {"labels.alertname", "qk.d2.srank"},
        {"labels.signature", "attention-numerics"},
        {"generatorURL", "http://127.0.0.1:7782/api/v1/alerts/42"},
    };
    expect_fields(al, f, sizeof(f) / sizeof(f[0]), "alertmanager resolve");
    json_decref(arr);
}

Test(page_format, pagerduty_trigger_and_resolve)
{
    struct page_alert a = sample(PAGE_TRIGGER);
    json_t *o = parse(page_pagerduty_body(&a, "KEY123", "http://h:1"));
    static const struct field f[] = {
        {"routing_key", "KEY123"},
        {"event_action", "trigger"},
        {"dedup_key", "fs-0123456789abcdef"},
        {"payload.source", "gpt-7b \"quoted\""},
        {"payload.severity", "critical"},
        {"payload.component", "qk.d2.srank layer 3 window 10"},
        {"payload.group", "attention_d2"},
        {"payload.class", "attention-numerics"},
        {"payload.timestamp", "2025-12-02T12:00:00.250Z"},
        {"payload.custom_details.rule", "qk.d2.srank"},
        {"payload.custom_details.labels.layer", "3"},
        {"client_url", "http://h:1/api/v1/alerts/42"},
    };
    expect_fields(o, f, sizeof(f) / sizeof(f[0]), "pagerduty trigger");
    cr_expect_float_eq(json_real_value(get(o, "payload.custom_details.z")), -9.5, 1e-12);
    cr_expect_eq(json_integer_value(get(o, "payload.custom_details.fired_step")), 1190);
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(get(o, "links"), 0), "href")),
                     "http://h:1/api/v1/alerts/42");
    json_decref(o);

    a = sample(PAGE_RESOLVE);
    strcpy(a.severity, "warning");
    o = parse(page_pagerduty_body(&a, "KEY123", "http://h:1"));
    static const struct field r[] = {
        {"routing_key", "KEY123"},
        {"event_action", "resolve"},
        {"dedup_key", "fs-0123456789abcdef"},
        {"payload", NULL},
    };
    expect_fields(o, r, sizeof(r) / sizeof(r[0]), "pagerduty resolve");
    json_decref(o);
}

Test(page_format, webhook_document)
{
    struct page_alert a = sample(PAGE_RESOLVE);
    a.value = NAN;
    json_t *o = parse(page_webhook_body(&a, "http://h:1/"));
    static const struct field f[] = {
        {"version", PAGE_WEBHOOK_VERSION},
        {"status", "resolved"},
        {"url", "http://h:1/api/v1/alerts/42"},
        {"labels.alertname", "qk.d2.srank"},
        {"alert.run", "gpt-7b \"quoted\""},
        {"alert.rule", "qk.d2.srank"},
        {"alert.state", "resolved"},
        {"alert.severity", "critical"},
        {"alert.family", "attention_d2"},
        {"alert.attribution", "attention-numerics"},
        {"alert.dedup_key", "fs-0123456789abcdef"},
        {"alert.alert_key", "run=gpt-7b,rule=qk.d2.srank,layer=3,head=-1,window=10,rank=-1"},
    };
    expect_fields(o, f, sizeof(f) / sizeof(f[0]), "webhook");
    cr_expect_eq(json_integer_value(get(o, "alert.id")), 42);
    cr_expect_eq(json_integer_value(get(o, "alert.labels.layer")), 3);
    cr_expect_null(get(o, "alert.labels.head"));
    cr_expect(json_is_null(get(o, "alert.evidence.value")), "NaN value must be null");
    cr_expect_eq(json_integer_value(get(o, "alert.evidence.resolved_step")), 1300);
    cr_expect_eq(json_integer_value(get(o, "alert.evidence.first_breach_step")), 1180);
    cr_expect_eq(json_integer_value(get(o, "alert.incidents")), 2);
    cr_expect_float_eq(json_real_value(get(o, "alert.resolved_at")), 1764677400.0, 1e-6);
    json_decref(o);
}

Test(page_format, evidence_from_event_json)
{
    struct page_alert a = sample(PAGE_TRIGGER);
    cr_assert_eq(page_alert_evidence(&a, "{\"value\":null,\"median\":2.5,\"mad\":0.25,\"z\":7,"
                                         "\"first_breach_step\":10,\"fired_step\":null,"
                                         "\"step\":12}"),
                 0);
    cr_expect(isnan(a.value));
    cr_expect_float_eq(a.median, 2.5, 0);
    cr_expect_float_eq(a.z, 7.0, 0);
    cr_expect_eq(a.first_breach_step, 10);
    cr_expect_eq(a.fired_step, -1);
    cr_expect_eq(a.step, 12);
    cr_expect_eq(page_alert_evidence(&a, "[1]"), -EINVAL);
    cr_expect_eq(page_alert_evidence(&a, NULL), -EINVAL);
}

/* RFC 4231 test case 2. */
Test(page_format, hmac_rfc4231_case2)
{
    char hex[65];
    const char *msg = "what do ya want for nothing?";
    cr_assert_eq(page_hmac_sha256_hex("Jefe", 4, msg, strlen(msg), hex), 0);
    cr_expect_str_eq(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

Test(page_format, classify_table)
{
    static const struct {
        long status;
        enum page_verdict v;
    } cases[] = {
        {200, PAGE_DELIVERED}, {202, PAGE_DELIVERED}, {204, PAGE_DELIVERED}, {400, PAGE_GIVE_UP},
        {401, PAGE_GIVE_UP},   {403, PAGE_GIVE_UP},   {404, PAGE_GIVE_UP},   {413, PAGE_GIVE_UP},
        {422, PAGE_GIVE_UP},   {408, PAGE_RETRY},     {429, PAGE_RETRY},     {500, PAGE_RETRY},
        {502, PAGE_RETRY},     {503, PAGE_RETRY},     {504, PAGE_RETRY},     {301, PAGE_RETRY},
        {100, PAGE_RETRY},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_expect_eq(page_classify(cases[i].status), cases[i].v, "status %ld", cases[i].status);
}

Test(page_format, backoff_bounds)
{
    static const struct {
        double initial, max;
        uint32_t attempts;
        double lo, hi; /* [d/2, d] */
    } cases[] = {
        {1, 300, 1, 0.5, 1},        {1, 300, 2, 1, 2},
        {1, 300, 5, 8, 16},         {1, 300, 9, 128, 256},
        {1, 300, 10, 150, 300},     {1, 300, 1000, 150, 300},
        {0.2, 0.5, 3, 0.25, 0.5},   {2, 2, 1, 1, 2},
        {1, 300, 0, 0.5, 1},        {1, 300, UINT32_MAX, 150, 300},
        {0, 300, UINT32_MAX, 0, 0}, /* no 2^32 loop */
    };
    static const double us[] = {0, 0.25, 0.5, 0.999999};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        for (size_t j = 0; j < sizeof(us) / sizeof(us[0]); j++) {
            double d = page_backoff(cases[i].initial, cases[i].max, cases[i].attempts, us[j]);
            cr_expect(d >= cases[i].lo - 1e-9 && d <= cases[i].hi + 1e-9,
                      "case %zu u %g: %g not in [%g, %g]", i, us[j], d, cases[i].lo, cases[i].hi);
        }
        /* jitter spreads: u = 0 gives the low end */
        cr_expect_float_eq(page_backoff(cases[i].initial, cases[i].max, cases[i].attempts, 0),
                           cases[i].lo, 1e-9, "case %zu", i);
    }
}

Test(page_format, route_table)
{
    static const struct {
        const char *match;
        int min_critical;
        const char *severity;
        int want;
    } cases[] = {
        {"", 0, "warning", 1},
        {"", 1, "warning", 0},
        {"", 1, "critical", 1},
        {"run=~gpt-.*", 0, "warning", 1},
        {"run=~llama-.*", 0, "warning", 0},
        {"run=~gpt-.*,family=attention_d2", 0, "warning", 1},
        {"run=~gpt-.*,family=router_weight", 0, "warning", 0},
        {"alertname!=loss, layer=3", 0, "warning", 1},
        {"signature!~attention-.*,run=~gpt.*", 0, "warning", 0},
        {"head=1", 0, "warning", 0}, /* the alert has no head label: "" */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct page_alert a = sample(PAGE_TRIGGER);
        strcpy(a.severity, cases[i].severity);
        struct page_route r = {.min_critical = cases[i].min_critical};
        /* as pager_config_check's uninitialised struct: the parse sets all
         * that silence_free reads, "" (no filter) included */
        memset(&r.match, 0xa5, sizeof(r.match));
        struct fs_err why = {0};
        cr_assert_eq(page_parse_match(cases[i].match, &r.match, &why), 0, "case %zu: %s", i,
                     why.msg);
        cr_expect_eq(page_route_matches(&r, &a), cases[i].want, "case %zu (%s)", i, cases[i].match);
        silence_free(&r.match);
    }
}

Test(page_format, bad_match_values)
{
    static const char *bad[] = {"run", "=x", "run!x", "run=~(", "run=x,,family=y", "run=~.*"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct silence s;
        struct fs_err why = {0};
        cr_expect_eq(page_parse_match(bad[i], &s, &why), -EINVAL, "'%s' parsed", bad[i]);
        cr_expect(strncmp(why.msg, "match:", 6) == 0, "'%s': reason '%s'", bad[i], why.msg);
    }
}

Test(page_format, silenced_by_active_silence_only)
{
    struct page_alert a = sample(PAGE_TRIGGER);
    struct silence s[2];
    memset(s, 0, sizeof(s));
    struct fs_err why = {0};
    const char *m0 = "[{\"name\":\"run\",\"value\":\"gpt-.*\",\"isRegex\":true}]";
    const char *m1 = "[{\"name\":\"signature\",\"value\":\"attention-numerics\"}]";
    cr_assert_eq(silence_parse(m0, strlen(m0), &s[0], &why), 0, "%s", why.msg);
    cr_assert_eq(silence_parse(m1, strlen(m1), &s[1], &why), 0, "%s", why.msg);
    s[0].starts_at = 100;
    s[0].ends_at = 200;
    s[1].starts_at = 300;
    s[1].ends_at = 400;
    cr_expect(page_silenced(s, 2, &a, 150));
    cr_expect(!page_silenced(s, 2, &a, 250), "between the silences");
    cr_expect(page_silenced(s, 2, &a, 350));
    cr_expect(!page_silenced(s, 2, &a, 400), "ends_at is exclusive");
    strcpy(a.attribution, "combined");
    cr_expect(!page_silenced(s, 2, &a, 350));
    silence_free(&s[0]);
    silence_free(&s[1]);
}

Test(page_format, rfc3339_and_url)
{
    char b[64];
    page_rfc3339(0, b, sizeof(b));
    cr_expect_str_eq(b, "1970-01-01T00:00:00.000Z");
    page_rfc3339(1764676800.9996, b, sizeof(b));
    cr_expect_str_eq(b, "2025-12-02T12:00:01.000Z");
    page_generator_url("http://a:1///", 7, b, sizeof(b));
    cr_expect_str_eq(b, "http://a:1/api/v1/alerts/7");
}
