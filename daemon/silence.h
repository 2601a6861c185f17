#ifndef FORESHOCK_SILENCE_H
#define FORESHOCK_SILENCE_H

#include <regex.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Silences: Alertmanager-style label matchers with a time range. Pure: no
 * I/O, no clocks (now is an argument); any thread may call these on its own
 * structs. The HTTP API validates with silence_parse(); the pager matches
 * alerts against the active ones with silence_matches().
 *
 * Matchers JSON (the silences.matchers_json column and the HTTP body):
 *   [{"name":"run","value":"gpt-7b","isRegex":false,"isEqual":true}, ...]
 * isRegex and isEqual are optional (false, true). A regex matcher is a POSIX
 * extended regular expression anchored at both ends, as in Alertmanager.
 * isEqual false negates the matcher (!= or !~). A silence needs at least one
 * matcher that does not match the empty string (else it would silence every
 * alert). A label an alert does not carry has the value "". */

#define SILENCE_MAX_MATCHERS 16u
#define SILENCE_MAX_NAME 64u          /* label name bytes, [A-Za-z_][A-Za-z0-9_]* */
#define SILENCE_MAX_VALUE 256u        /* matcher value bytes */
#define SILENCE_MAX_JSON 8192u        /* matchers_json bytes */

/* Label names an alert carries (the same set the pager sends to
 * Alertmanager): alertname (the rule), run, severity, family, signature
 * and attribution (both the alert's attribution, e.g. attention-numerics),
 * and layer, head, window, rank where the alert has that scope
 * (page_format.c, page_labels, builds it). */
struct silence_label {
    const char *name;
    const char *value;
};

struct silence_matcher {
    char name[SILENCE_MAX_NAME + 1];
    char value[SILENCE_MAX_VALUE + 1];
    bool is_regex;
    bool is_equal;
    bool compiled; /* re holds a compiled pattern (is_regex) */
    regex_t re;
};

struct silence {
    int64_t id;
    double starts_at, ends_at; /* unix seconds */
    size_t n;
    struct silence_matcher m[SILENCE_MAX_MATCHERS];
};

/* Parses and validates a matchers JSON array (len bytes) into s->m / s->n,
 * compiling regexes. s->id and the times are left as they are. Returns 0,
 * or -EINVAL with a one-line reason in why (s then holds nothing to free).
 * On success the caller owns the compiled regexes: silence_free(). */
int silence_parse(const char *json, size_t len, struct silence *s, char *why, size_t whylen);

/* Releases the compiled regexes of s (s stays a valid empty silence). */
void silence_free(struct silence *s);

/* True if s is active at now and every matcher matches labels[0..n). */
bool silence_matches(const struct silence *s, const struct silence_label *labels, size_t n,
                     double now);

/* Writes s's matchers back as canonical JSON (every field present) into
 * out (NUL-terminated). Returns 0, or -ENOSPC if outlen is too small. */
int silence_matchers_json(const struct silence *s, char *out, size_t outlen);

#endif
