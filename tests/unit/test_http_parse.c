/* Pure parsers of the HTTP write API, as tables: bearer headers, token
 * comparison, durations, times (both ways) and silence bodies. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "http_parse.h"

#define N(a) (sizeof(a) / sizeof((a)[0]))

Test(http_parse, bearer_table)
{
    static const struct {
        const char *header;
        const char *token; /* NULL: refused */
    } cases[] = {
        {"Bearer abc", "abc"},
        {"bearer abc", "abc"},
        {"BEARER   abc  ", "abc"},
        {"\tBearer\tabc", "abc"},
        {"Bearer a.b-c_d~+/=", "a.b-c_d~+/="},
        {"Bearer", NULL},
        {"Bearer ", NULL},
        {"Bearerabc", NULL},
        {"Basic YWJjOmRlZg==", NULL},
        {"Bearer abc def", NULL},
        {"", NULL},
        {"abc", NULL},
    };
    for (size_t i = 0; i < N(cases); i++) {
        const char *tok = NULL;
        size_t len = 0;
        int rc = http_bearer_parse(cases[i].header, &tok, &len);
        if (!cases[i].token) {
            cr_expect_eq(rc, -EINVAL, "'%s' accepted", cases[i].header);
            continue;
        }
        cr_assert_eq(rc, 0, "'%s' refused", cases[i].header);
        cr_expect_eq(len, strlen(cases[i].token), "'%s'", cases[i].header);
        cr_expect_eq(strncmp(tok, cases[i].token, len), 0, "'%s'", cases[i].header);
    }
    const char *tok;
    size_t len;
    cr_expect_eq(http_bearer_parse(NULL, &tok, &len), -EINVAL);
}

Test(http_parse, token_equal_table)
{
    static const struct {
        const char *given, *secret;
        bool eq;
    } cases[] = {
        {"s3cret", "s3cret", true},  {"s3cre", "s3cret", false}, {"s3crett", "s3cret", false},
        {"S3cret", "s3cret", false}, {"", "s3cret", false},      {"x", "x", true},
        {"s3creT", "s3cret", false},
    };
    for (size_t i = 0; i < N(cases); i++)
        cr_expect_eq(http_token_equal(cases[i].given, strlen(cases[i].given), cases[i].secret),
                     cases[i].eq, "'%s' vs '%s'", cases[i].given, cases[i].secret);
    /* the length given counts, not a NUL */
    cr_expect(http_token_equal("abcdef", 3, "abc"));
    cr_expect(!http_token_equal("abc", 3, "abcdef"));
}

Test(http_parse, duration_table)
{
    static const struct {
        const char *text;
        double seconds; /* < 0: refused */
    } cases[] = {
        {"90s", 90},
        {"15m", 900},
        {"2h", 7200},
        {"1d", 86400},
        {"1w", 604800},
        {"1h30m", 5400},
        {"1d2h3m4s", 93784},
        {"3600", 3600},
        {"1.5h", 5400},
        {"0.5", 0.5},
        {"", -1},
        {"h", -1},
        {"2x", -1},
        {"30m1h", -1},
        {"1h1h", -1},
        {"-5m", -1},
        {"0", -1},
        {"0s", -1},
        {"1.h", -1},
        {" 2h", -1},
        {"2h ", -1},
        {"1e3", -1},
        {"99999999999999999999999999999999999h", -1},
    };
    for (size_t i = 0; i < N(cases); i++) {
        double v = -7;
        int rc = http_duration_parse(cases[i].text, &v);
        if (cases[i].seconds < 0) {
            cr_expect_eq(rc, -EINVAL, "'%s' accepted as %g", cases[i].text, v);
        } else {
            cr_expect_eq(rc, 0, "'%s' refused", cases[i].text);
            cr_expect_float_eq(v, cases[i].seconds, 1e-9, "'%s' -> %g", cases[i].text, v);
        }
    }
}

Test(http_parse, time_parse_table)
{
    static const struct {
        const char *text;
        double t; /* < 0: refused */
    } cases[] = {
        {"1970-01-01T00:00:00Z", 0},
        {"2026-01-02T03:04:05Z", 1767323045},
        {"2026-01-02t03:04:05z", 1767323045},
        {"2026-01-02T03:04:05.25Z", 1767323045.25},
        {"2026-01-02T05:04:05+02:00", 1767323045},
        {"2026-01-01T22:04:05-05:00", 1767323045},
        {"2024-02-29T00:00:00Z", 1709164800},
        {"1767323045", 1767323045},
        {"1767323045.5", 1767323045.5},
        {"2023-02-29T00:00:00Z", -1}, /* not a leap year */
        {"2026-13-01T00:00:00Z", -1},
        {"2026-01-02T24:00:00Z", -1},
        {"2026-01-02T03:04:05", -1}, /* no zone */
        {"2026-01-02 03:04:05Z", -1},
        {"2026-01-02T03:04:05.Z", -1},
        {"2026-01-02T03:04:05Zjunk", -1},
        {"-5", -1},
        {"", -1},
        {"tomorrow", -1},
        {"1e9", -1},
    };
    for (size_t i = 0; i < N(cases); i++) {
        double v = -7;
        int rc = http_time_parse(cases[i].text, &v);
        if (cases[i].t < 0) {
            cr_expect_eq(rc, -EINVAL, "'%s' accepted as %f", cases[i].text, v);
        } else {
            cr_expect_eq(rc, 0, "'%s' refused", cases[i].text);
            cr_expect_float_eq(v, cases[i].t, 1e-6, "'%s' -> %f", cases[i].text, v);
        }
    }
}

Test(http_parse, time_format_table)
{
    static const struct {
        double t;
        const char *text; /* NULL: refused */
    } cases[] = {
        {0, "1970-01-01T00:00:00Z"},
        {1767323045, "2026-01-02T03:04:05Z"},
        {1767323045.25, "2026-01-02T03:04:05.250Z"},
        {1767323045.9996, "2026-01-02T03:04:06Z"},
        {-1, NULL},
        {NAN, NULL},
        {INFINITY, NULL},
    };
    for (size_t i = 0; i < N(cases); i++) {
        char buf[48] = "";
        int rc = http_time_format(cases[i].t, buf, sizeof buf);
        if (!cases[i].text) {
            cr_expect_neq(rc, 0, "%f formatted as %s", cases[i].t, buf);
            continue;
        }
        cr_expect_eq(rc, 0);
        cr_expect_str_eq(buf, cases[i].text);
        double back = 0;
        cr_expect_eq(http_time_parse(buf, &back), 0, "'%s' does not parse back", buf);
    }
    char small[8];
    cr_expect_eq(http_time_format(0, small, sizeof small), -ENOSPC);
}

#define NOW 1767323045.0 /* 2026-01-02T03:04:05Z */
#define M1 "\"matchers\":[{\"name\":\"run\",\"value\":\"r1\"}]"

Test(http_parse, silence_body_table)
{
    static const struct {
        const char *body;
        const char *run; /* maintenance of this run */
        const char *why; /* NULL: accepted; else a substring of the reason */
        double starts, ends;
    } cases[] = {
        {"{" M1 ",\"duration\":\"2h\",\"createdBy\":\"me\"}", NULL, NULL, NOW, NOW + 7200},
        {"{" M1 ",\"duration\":60,\"createdBy\":\"me\",\"comment\":\"c\"}", NULL, NULL, NOW,
         NOW + 60},
        {"{" M1 ",\"endsAt\":\"2026-01-02T04:04:05Z\",\"createdBy\":\"me\"}", NULL, NULL, NOW,
         NOW + 3600},
        {"{" M1 ",\"startsAt\":1767326645,\"endsAt\":1767330245,\"createdBy\":\"me\"}", NULL, NULL,
         NOW + 3600, NOW + 7200},
        {"{" M1 ",\"startsAt\":\"2026-01-02T04:04:05Z\",\"duration\":\"1h\",\"createdBy\":\"x\"}",
         NULL, NULL, NOW + 3600, NOW + 7200},
        {"{\"duration\":\"30m\",\"createdBy\":\"ops\",\"comment\":\"restart\"}", "gpt-7b", NULL,
         NOW, NOW + 1800},
        /* refused, each naming its field */
        {"not json", NULL, "body: not valid JSON", 0, 0},
        {"[1]", NULL, "body: must be a JSON object", 0, 0},
        {"{\"duration\":\"2h\",\"createdBy\":\"me\"}", NULL, "field 'matchers': is required", 0, 0},
        {"{\"matchers\":[],\"duration\":\"2h\",\"createdBy\":\"me\"}", NULL, "field 'matchers'", 0,
         0},
        {"{\"matchers\":{},\"duration\":\"2h\",\"createdBy\":\"me\"}", NULL, "field 'matchers'", 0,
         0},
        {"{\"matchers\":[{\"name\":\"run\",\"value\":\".*\",\"isRegex\":true}],"
         "\"duration\":\"2h\",\"createdBy\":\"me\"}",
         NULL, "every alert", 0, 0},
        {"{" M1 ",\"createdBy\":\"me\"}", NULL, "field 'endsAt': endsAt or duration", 0, 0},
        {"{" M1 ",\"duration\":\"2h\",\"endsAt\":1767330245,\"createdBy\":\"me\"}", NULL,
         "field 'duration'", 0, 0},
        {"{" M1 ",\"duration\":\"2 hours\",\"createdBy\":\"me\"}", NULL, "field 'duration'", 0, 0},
        {"{" M1 ",\"duration\":-5,\"createdBy\":\"me\"}", NULL, "field 'duration'", 0, 0},
        {"{" M1 ",\"duration\":true,\"createdBy\":\"me\"}", NULL, "field 'duration'", 0, 0},
        {"{" M1 ",\"duration\":\"91d\",\"createdBy\":\"me\"}", NULL, "field 'duration'", 0, 0},
        {"{" M1 ",\"endsAt\":\"yesterday\",\"createdBy\":\"me\"}", NULL, "field 'endsAt'", 0, 0},
        {"{" M1 ",\"endsAt\":1767323000,\"createdBy\":\"me\"}", NULL, "field 'endsAt'", 0, 0},
        {"{" M1 ",\"startsAt\":1767330245,\"endsAt\":1767326645,\"createdBy\":\"me\"}", NULL,
         "field 'endsAt': must be after startsAt", 0, 0},
        {"{" M1 ",\"startsAt\":1767323045,\"endsAt\":1799999999,\"createdBy\":\"me\"}", NULL,
         "field 'endsAt': more than", 0, 0},
        {"{" M1 ",\"startsAt\":\"soon\",\"duration\":60,\"createdBy\":\"me\"}", NULL,
         "field 'startsAt'", 0, 0},
        {"{" M1 ",\"startsAt\":1,\"duration\":60,\"createdBy\":\"me\"}", NULL,
         "field 'duration': the silence would already be over", 0, 0},
        {"{" M1 ",\"duration\":60}", NULL, "field 'createdBy': is required", 0, 0},
        {"{" M1 ",\"duration\":60,\"createdBy\":\"\"}", NULL,
         "field 'createdBy': must not be empty", 0, 0},
        {"{" M1 ",\"duration\":60,\"createdBy\":7}", NULL, "field 'createdBy': must be a string", 0,
         0},
        {"{" M1 ",\"duration\":60,\"createdBy\":\"me\",\"comment\":[]}", NULL, "field 'comment'", 0,
         0},
        {"{" M1 ",\"duration\":60,\"createdBy\":\"me\",\"color\":\"red\"}", NULL,
         "field 'color': unknown", 0, 0},
        {"{" M1 ",\"duration\":60,\"createdBy\":\"me\",\"createdBy\":\"you\"}", NULL,
         "body: not valid JSON", 0, 0},
        /* maintenance takes no matchers */
        {"{" M1 ",\"duration\":60,\"createdBy\":\"me\"}", "r1", "field 'matchers': unknown", 0, 0},
        {"{\"createdBy\":\"me\"}", "r1", "field 'endsAt'", 0, 0},
    };
    for (size_t i = 0; i < N(cases); i++) {
        struct silence_req req;
        struct fs_err why = {0};
        int rc = http_silence_req_parse(cases[i].body, strlen(cases[i].body), cases[i].run, NOW,
                                        &req, &why);
        if (cases[i].why) {
            cr_expect_eq(rc, -EINVAL, "case %zu accepted: %s", i, cases[i].body);
            cr_expect(strstr(why.msg, cases[i].why), "case %zu: '%s' lacks '%s'", i, why.msg,
                      cases[i].why);
            continue;
        }
        cr_assert_eq(rc, 0, "case %zu refused: %s", i, why.msg);
        cr_expect_float_eq(req.starts_at, cases[i].starts, 1e-6, "case %zu", i);
        cr_expect_float_eq(req.ends_at, cases[i].ends, 1e-6, "case %zu", i);
        cr_expect(strstr(req.matchers_json, "\"isEqual\":true"), "case %zu: %s", i,
                  req.matchers_json);
    }
}

Test(http_parse, silence_body_canonical_and_bounded)
{
    struct silence_req req;
    struct fs_err why = {0};
    const char *b = "{\"duration\":60,\"createdBy\":\"me\"}";
    cr_assert_eq(http_silence_req_parse(b, strlen(b), "gpt-7b", NOW, &req, &why), 0, "%s", why.msg);
    cr_expect_str_eq(
        req.matchers_json,
        "[{\"name\":\"run\",\"value\":\"gpt-7b\",\"isRegex\":false,\"isEqual\":true}]");
    cr_expect_str_eq(req.created_by, "me");
    cr_expect_str_eq(req.comment, "");

    /* createdBy one byte over its bound */
    char body[2048];
    char by[HTTP_SILENCE_MAX_CREATED_BY + 2];
    memset(by, 'a', sizeof by - 1);
    by[sizeof by - 1] = '\0';
    snprintf(body, sizeof body, "{" M1 ",\"duration\":60,\"createdBy\":\"%s\"}", by);
    cr_expect_eq(http_silence_req_parse(body, strlen(body), NULL, NOW, &req, &why), -EINVAL);
    cr_expect(strstr(why.msg, "field 'createdBy': longer than"), "%s", why.msg);
    by[sizeof by - 2] = '\0'; /* exactly the bound */
    snprintf(body, sizeof body, "{" M1 ",\"duration\":60,\"createdBy\":\"%s\"}", by);
    cr_expect_eq(http_silence_req_parse(body, strlen(body), NULL, NOW, &req, &why), 0, "%s",
                 why.msg);
}
