#ifndef FORESHOCK_HTTP_PARSE_H
#define FORESHOCK_HTTP_PARSE_H

/* Pure parsers behind the HTTP write API: bearer tokens, durations, times
 * and silence request bodies. No I/O, no clocks (now is an argument), no
 * globals: any thread may call them on its own arguments. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "silence.h"

#define HTTP_SILENCE_MAX_DURATION_S (90.0 * 86400.0) /* a silence lasts 90 days at most */
#define HTTP_SILENCE_MAX_CREATED_BY 256u             /* createdBy bytes */
#define HTTP_SILENCE_MAX_COMMENT 1024u               /* comment bytes */
#define HTTP_MAX_DURATION_TEXT 32u                   /* "1h30m" style text, bytes */
#define HTTP_MAX_TIME_TEXT 40u                       /* RFC 3339 text, bytes */
#define HTTP_TIME_MAX_UNIX 253402300799.0            /* 9999-12-31T23:59:59Z */

/* Authorization header value -> the token of "Bearer <token>" (scheme
 * case-insensitive, blanks around the token ignored). Returns 0 with
 * *tok and *len pointing into header, or -EINVAL (absent, other scheme, empty
 * token, or blanks inside the token). */
int http_bearer_parse(const char *header, const char **tok, size_t *len);

/* True when given[0..glen) equals secret (NUL-terminated). The time taken
 * depends only on strlen(secret), never on where the bytes differ. */
bool http_token_equal(const char *given, size_t glen, const char *secret);

/* A duration: "90s", "15m", "2h", "1d", "1w", combinations such as
 * "1h30m", or plain seconds "3600" (fractions allowed: "1.5h"). Returns 0
 * with *out seconds (> 0), or -EINVAL. */
int http_duration_parse(const char *s, double *out);

/* A time: RFC 3339 ("2026-01-02T03:04:05Z", "...05.25+02:00") or UNIX
 * seconds as digits with an optional fraction. Returns 0 with *out UNIX
 * seconds, or -EINVAL. */
int http_time_parse(const char *s, double *out);

/* RFC 3339 UTC: "2026-01-02T03:04:05Z", with ".mmm" when t has a
 * fraction of a millisecond or more. Returns 0, or -ENOSPC/-EINVAL. */
int http_time_format(double t, char *out, size_t outlen);

/* A validated silence request. */
struct silence_req {
    char matchers_json[SILENCE_MAX_JSON]; /* canonical (silence_matchers_json) */
    double starts_at, ends_at;            /* UNIX seconds, ends_at > starts_at, ends_at > now */
    char created_by[HTTP_SILENCE_MAX_CREATED_BY + 1];
    char comment[HTTP_SILENCE_MAX_COMMENT + 1];
};

/* Parses a silence body (len bytes of JSON):
 *   {"matchers":[...], "startsAt"?: RFC3339|unix, "endsAt": ... | "duration": "2h"|seconds,
 *    "createdBy": "...", "comment"?: "..."}
 * When run is not NULL (a run's maintenance silence) "matchers" is not
 * accepted and the single matcher run=<run> is used instead. now: the
 * current UNIX time (startsAt defaults to it). Returns 0, or -EINVAL with
 * a one-line reason in why that starts with the field at fault, e.g.
 * "field 'endsAt': must be after startsAt". */
int http_silence_req_parse(const char *body, size_t len, const char *run, double now,
                           struct silence_req *out, struct fs_err *why);

#endif
