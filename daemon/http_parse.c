/* Pure parsers of the HTTP write API: bearer tokens, durations, times,
 * silence bodies. See http_parse.h. */

#include "http_parse.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <jansson.h>

/* --- auth ----------------------------------------------------------------------- */

int http_bearer_parse(const char *header, const char **tok, size_t *len)
{
    static const char scheme[] = "Bearer";
    if (!header)
        return -EINVAL;
    const char *p = header;
    while (*p == ' ' || *p == '\t')
        p++;
    if (strncasecmp(p, scheme, sizeof scheme - 1) != 0)
        return -EINVAL;
    p += sizeof scheme - 1;
    if (*p != ' ' && *p != '\t')
        return -EINVAL;
    while (*p == ' ' || *p == '\t')
        p++;
    size_t n = strcspn(p, " \t");
    const char *rest = p + n;
    while (*rest == ' ' || *rest == '\t')
        rest++;
    if (n == 0 || *rest != '\0')
        return -EINVAL;
    *tok = p;
    *len = n;
    return 0;
}

bool http_token_equal(const char *given, size_t glen, const char *secret)
{
    size_t slen = strlen(secret);
    /* Walk the secret's length whatever was given; fold the length
     * difference in so that a prefix never matches. */
    unsigned char acc = (unsigned char)(glen != slen);
    for (size_t i = 0; i < slen; i++) {
        unsigned char g = i < glen ? (unsigned char)given[i] : 0;
        acc |= (unsigned char)(g ^ (unsigned char)secret[i]);
    }
    return acc == 0;
}

/* --- durations and times ----------------------------------------------------------- */

/* Digits with an optional fraction at *p; advances *p. -EINVAL if none. */
static int number(const char **p, double *out)
{
    const char *s = *p;
    size_t ip = strspn(s, "0123456789");
    size_t fp = 0;
    if (s[ip] == '.') {
        fp = strspn(s + ip + 1, "0123456789");
        if (fp == 0)
            return -EINVAL;
    }
    if (ip == 0 || ip > 15)
        return -EINVAL;
    char buf[40];
    size_t n = ip + (fp > 0 ? 1 + fp : 0);
    if (n >= sizeof buf)
        return -EINVAL;
    memcpy(buf, s, n);
    buf[n] = '\0';
    *out = strtod(buf, NULL);
    *p = s + n;
    return 0;
}

int http_duration_parse(const char *s, double *out)
{
    static const struct {
        char unit;
        double seconds;
    } units[] = {{'s', 1}, {'m', 60}, {'h', 3600}, {'d', 86400}, {'w', 7 * 86400}};
    if (!s || *s == '\0' || strlen(s) > HTTP_MAX_DURATION_TEXT)
        return -EINVAL;
    const char *p = s;
    double v;
    if (number(&p, &v) != 0)
        return -EINVAL;
    if (*p == '\0') { /* plain seconds */
        if (!(v > 0) || !isfinite(v))
            return -EINVAL;
        *out = v;
        return 0;
    }
    double total = 0;
    int last = -1; /* units must decrease: "1h30m", not "30m1h" or "1h1h" */
    for (;;) {
        int k = -1;
        for (int i = 0; i < (int)(sizeof units / sizeof units[0]); i++)
            if (*p == units[i].unit)
                k = i;
        if (k < 0 || (last >= 0 && k >= last))
            return -EINVAL;
        total += v * units[k].seconds;
        last = k;
        p++;
        if (*p == '\0')
            break;
        if (number(&p, &v) != 0)
            return -EINVAL;
    }
    if (!(total > 0) || !isfinite(total))
        return -EINVAL;
    *out = total;
    return 0;
}

/* Exactly n digits at s into *out. */
static int digits(const char *s, int n, int *out)
{
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -EINVAL;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 0;
}

static int days_in_month(int y, int m)
{
    static const int dm[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    return m == 2 && leap ? 29 : dm[m - 1];
}

/* Days since 1970-01-01 of a proleptic Gregorian date (no libc time zone). */
static int64_t days_from_civil(int64_t y, int m, int d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static int rfc3339(const char *s, double *out)
{
    /* YYYY-MM-DDTHH:MM:SS[.frac](Z|+HH:MM|-HH:MM) */
    int Y, M, D, h, mi, se;
    if (digits(s, 4, &Y) || s[4] != '-' || digits(s + 5, 2, &M) || s[7] != '-' ||
        digits(s + 8, 2, &D) || (s[10] != 'T' && s[10] != 't') || digits(s + 11, 2, &h) ||
        s[13] != ':' || digits(s + 14, 2, &mi) || s[16] != ':' || digits(s + 17, 2, &se))
        return -EINVAL;
    if (M < 1 || M > 12 || D < 1 || D > days_in_month(Y, M) || h > 23 || mi > 59 || se > 59)
        return -EINVAL;
    const char *p = s + 19;
    double frac = 0;
    if (*p == '.') {
        size_t n = strspn(p + 1, "0123456789");
        if (n == 0 || n > 9)
            return -EINVAL;
        char buf[16] = "0.";
        memcpy(buf + 2, p + 1, n);
        buf[2 + n] = '\0';
        frac = strtod(buf, NULL);
        p += 1 + n;
    }
    int offset = 0;
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        int oh, om;
        if (digits(p + 1, 2, &oh) || p[3] != ':' || digits(p + 4, 2, &om) || oh > 23 || om > 59)
            return -EINVAL;
        offset = (oh * 60 + om) * 60 * (*p == '-' ? -1 : 1);
        p += 6;
    } else {
        return -EINVAL;
    }
    if (*p != '\0')
        return -EINVAL;
    int64_t secs = days_from_civil(Y, M, D) * 86400 + h * 3600 + mi * 60 + se - offset;
    *out = (double)secs + frac;
    return 0;
}

int http_time_parse(const char *s, double *out)
{
    if (!s || *s == '\0' || strlen(s) > HTTP_MAX_TIME_TEXT)
        return -EINVAL;
    double v;
    if (strchr(s, '-') || strchr(s, 'T') || strchr(s, 't')) {
        if (rfc3339(s, &v) != 0)
            return -EINVAL;
    } else {
        const char *p = s;
        if (number(&p, &v) != 0 || *p != '\0')
            return -EINVAL;
    }
    if (!(v >= 0) || v > HTTP_TIME_MAX_UNIX)
        return -EINVAL;
    *out = v;
    return 0;
}

int http_time_format(double t, char *out, size_t outlen)
{
    if (!isfinite(t) || t < 0 || t > HTTP_TIME_MAX_UNIX)
        return -EINVAL;
    double whole = floor(t);
    long ms = lround((t - whole) * 1000.0);
    if (ms == 1000) {
        whole += 1;
        ms = 0;
    }
    time_t tt = (time_t)whole;
    struct tm tm;
    if (!(gmtime_r(&tt, &tm)))
        return -EINVAL;
    int n;
    if (ms != 0)
        n = snprintf(out, outlen, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
    else
        n = snprintf(out, outlen, "%04d-%02d-%02dT%02d:%02d:%02dZ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
    return n < 0 || (size_t)n >= outlen ? -ENOSPC : 0;
}

/* --- silence bodies ---------------------------------------------------------------- */

/* A time field: RFC 3339 string, digit string or JSON number (UNIX s). */
static int time_field(json_t *v, const char *name, double *out, struct fs_err *why)
{
    if (json_is_number(v)) {
        double x = json_number_value(v);
        if (x >= 0 && x <= HTTP_TIME_MAX_UNIX) {
            *out = x;
            return 0;
        }
    } else if (json_is_string(v) && http_time_parse(json_string_value(v), out) == 0) {
        return 0;
    }
    return fs_err_set(why, -EINVAL,
                      "field '%s': must be an RFC 3339 time (2026-01-02T03:04:05Z) or UNIX seconds",
                      name);
}

/* A text field of at most max bytes; required or "" by default. */
static int text_field(json_t *doc, const char *name, bool required, size_t max, char *out,
                      struct fs_err *why)
{
    json_t *v = json_object_get(doc, name);
    if (!v && !required) {
        out[0] = '\0';
        return 0;
    }
    if (!v)
        return fs_err_set(why, -EINVAL, "field '%s': is required", name);
    if (!json_is_string(v))
        return fs_err_set(why, -EINVAL, "field '%s': must be a string", name);
    size_t n = json_string_length(v);
    const char *s = json_string_value(v);
    if (n > max)
        return fs_err_set(why, -EINVAL, "field '%s': longer than %zu bytes", name, max);
    if (memchr(s, '\0', n))
        return fs_err_set(why, -EINVAL, "field '%s': must not contain NUL", name);
    if (required && n == 0)
        return fs_err_set(why, -EINVAL, "field '%s': must not be empty", name);
    memcpy(out, s, n);
    out[n] = '\0';
    return 0;
}

/* The field 'matchers' (or, with run, the one matcher run="RUN"), validated
 * and written back canonical by silence.c into out->matchers_json. */
static int silence_matchers_field(json_t *doc, const char *run, struct silence_req *out,
                                  struct fs_err *why)
{
    int rc = 0;
    struct silence sil = {0};
    struct fs_err swhy = {0};
    char *mjson = NULL;
    json_t *mv = json_object_get(doc, "matchers");
    if (run) {
        mv = json_pack("[{s:s, s:s}]", "name", "run", "value", run);
        if (!mv) {
            return fs_err_set(why, -EINVAL, "run: not a valid label value");
        }
        mjson = json_dumps(mv, JSON_COMPACT);
        json_decref(mv);
    } else if (!mv) {
        return fs_err_set(why, -EINVAL, "field 'matchers': is required");
    } else {
        mjson = json_dumps(mv, JSON_COMPACT | JSON_ENCODE_ANY);
    }
    if (!mjson) {
        return fs_err_set(why, -EINVAL, "body: out of memory");
    }
    rc = silence_parse(mjson, strlen(mjson), &sil, &swhy);
    free(mjson);
    if (rc != 0) {
        /* silence.c says "matchers: ..." or "matchers[i]: ..." */
        return fs_err_set(why, -EINVAL, "field '%s': %.255s", run ? "run" : "matchers", swhy.msg);
    }
    rc = silence_matchers_json(&sil, out->matchers_json, sizeof out->matchers_json);
    silence_free(&sil);
    if (rc != 0) {
        return fs_err_set(why, -EINVAL, "field 'matchers': longer than %u bytes", SILENCE_MAX_JSON);
    }
    return 0;
}

/* out->ends_at from 'endsAt' or 'duration' (one of them), after
 * out->starts_at, in the future, at most HTTP_SILENCE_MAX_DURATION_S long. */
static int silence_end_field(json_t *doc, double now, struct silence_req *out, struct fs_err *why)
{
    int rc = 0;
    json_t *ev = json_object_get(doc, "endsAt");
    json_t *dv = json_object_get(doc, "duration");
    if (ev && dv) {
        return fs_err_set(why, -EINVAL,
                          "field 'duration': give either endsAt or duration, not both");
    }
    if (!ev && !dv) {
        return fs_err_set(why, -EINVAL, "field 'endsAt': endsAt or duration is required");
    }
    if (ev) {
        if ((rc = time_field(ev, "endsAt", &out->ends_at, why)) != 0)
            return rc;
        if (!(out->ends_at > out->starts_at)) {
            return fs_err_set(why, -EINVAL, "field 'endsAt': must be after startsAt");
        }
        if (!(out->ends_at > now)) {
            return fs_err_set(why, -EINVAL, "field 'endsAt': must be in the future");
        }
    } else {
        double d = 0;
        bool good = false;
        if (json_is_number(dv)) {
            d = json_number_value(dv);
            good = d > 0 && isfinite(d);
        } else if (json_is_string(dv)) {
            good = http_duration_parse(json_string_value(dv), &d) == 0;
        }
        if (!good) {
            return fs_err_set(why, -EINVAL,
                              "field 'duration': must be positive seconds or text such as "
                              "\"90m\", \"2h\", \"1h30m\", \"1d\"");
        }
        if (d > HTTP_SILENCE_MAX_DURATION_S) {
            return fs_err_set(why, -EINVAL,
                              "field 'duration': longer than the maximum %.0f s (90 days)",
                              HTTP_SILENCE_MAX_DURATION_S);
        }
        out->ends_at = out->starts_at + d;
        if (!(out->ends_at > now)) {
            return fs_err_set(why, -EINVAL, "field 'duration': the silence would already be over");
        }
    }
    if (out->ends_at - out->starts_at > HTTP_SILENCE_MAX_DURATION_S) {
        return fs_err_set(why, -EINVAL, "field 'endsAt': more than %.0f s (90 days) after startsAt",
                          HTTP_SILENCE_MAX_DURATION_S);
    }
    return 0;
}

int http_silence_req_parse(const char *body, size_t len, const char *run, double now,
                           struct silence_req *out, struct fs_err *why)
{
    static const char *const fields[] = {"matchers", "startsAt",  "endsAt",
                                         "duration", "createdBy", "comment"};
    int rc = 0;
    json_error_t jerr;
    json_t *doc = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!doc)
        return fs_err_set(why, -EINVAL, "body: not valid JSON: %s (line %d, column %d)", jerr.text,
                          jerr.line, jerr.column);
    memset(out, 0, sizeof(*out));
    if (!json_is_object(doc)) {
        rc = fs_err_set(why, -EINVAL, "body: must be a JSON object");
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(doc, key, v)
    {
        bool known = false;
        for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
            known |= strcmp(key, fields[i]) == 0;
        if (run && strcmp(key, "matchers") == 0)
            known = false;
        if (!known) {
            rc = fs_err_set(why, -EINVAL, "field '%.64s': unknown field", key);
            goto out;
        }
    }

    /* matchers: validated and written back canonical by silence.c */
    if ((rc = silence_matchers_field(doc, run, out, why)) != 0)
        goto out;

    out->starts_at = now;
    json_t *sv = json_object_get(doc, "startsAt");
    if (sv && (rc = time_field(sv, "startsAt", &out->starts_at, why)) != 0)
        goto out;

    if ((rc = silence_end_field(doc, now, out, why)) != 0)
        goto out;
    if ((rc = text_field(doc, "createdBy", true, HTTP_SILENCE_MAX_CREATED_BY, out->created_by,
                         why)) != 0 ||
        (rc = text_field(doc, "comment", false, HTTP_SILENCE_MAX_COMMENT, out->comment, why)) != 0)
        goto out;
out:
    json_decref(doc);
    return rc;
}
