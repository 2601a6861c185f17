#ifndef FORESHOCK_SILENCE_H
#define FORESHOCK_SILENCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fs_err.h"

/* Silences: Alertmanager-style label matchers with a time range. Pure: no
 * I/O, no clocks (now is an argument); any thread may call these on its own
 * structs, and several threads may match against one parsed silence at once
 * (silence_matches only reads it). The HTTP API validates with
 * silence_parse(); silence_set.h keeps parsed silences for matching.
 *
 * Matchers JSON (the silences.matchers_json column and the HTTP body):
 *   [{"name":"run","value":"gpt-7b","isRegex":false,"isEqual":true}, ...]
 * isRegex and isEqual are optional (false, true). isEqual false negates the
 * matcher (!= or !~). A silence needs at least one matcher that does not
 * match the empty string (else it would silence every alert). A label an
 * alert does not carry has the value "".
 *
 * Regular expressions are PCRE2 (8-bit, byte-wise: no UTF or Unicode
 * properties), anchored at both ends as in Alertmanager: the whole label
 * value must match (PCRE2_ANCHORED | PCRE2_ENDANCHORED, so a ')' or '|' in
 * the value cannot undo the anchoring), and '$' matches only at the very
 * end (PCRE2_DOLLAR_ENDONLY, as Go's '$'). Alertmanager uses Go's RE2
 * syntax; PCRE2 accepts all of it that we have seen in silences, and more
 * (backreferences, lookaround, possessive quantifiers, recursion), but a
 * quantifier must follow a repeatable item (`a{1,3}{2}` is an error here,
 * as in RE2) and `\C`, `(*UTF)` and `(*UCP)` are refused.
 *
 * Bounds: every regex is refused at parse time if it nests parentheses
 * deeper than SILENCE_RE_MAX_NEST or compiles to more than
 * SILENCE_RE_MAX_COMPILED bytes (SILENCE_RE_MAX_COMPILED_SILENCE for all
 * of one silence's regexes); the compiler never allocates more than
 * SILENCE_RE_MAX_COMPILED for one pattern, so a refused pattern costs no
 * more either. Measured with PCRE2 10.42 (silence_parse, best of 200 on
 * the 2-core dev VM): `(a{0,255}){0,255}` (glibc regcomp: 40 s, 11.8 GB)
 * compiles in 0.16 ms to 4982 bytes; `a{1,1000}{1,1000}` (glibc: 8.5 s,
 * 8 GB) is a syntax error, `((a{0,255}){0,255}){0,255}` too large for
 * PCRE2, `([a-z]{0,255}){0,255}` over SILENCE_RE_MAX_COMPILED, 33 nested
 * groups too deep: each refused in under 5 us.
 *
 * A match runs under SILENCE_RE_MATCH_LIMIT backtracking steps,
 * SILENCE_RE_DEPTH_LIMIT nested backtracking frames and
 * SILENCE_RE_HEAP_LIMIT_KIB of frame memory. A match that hits one of
 * them is undecided, and an undecided matcher does not hold, whether it
 * is =~ or !~: the silence then does not match the alert. A silence must
 * never silence more than its author meant; the price of an undecided
 * match is a page that the silence might have held (and, for a target's
 * `match` route, a page not routed there). Measured the same way: the
 * worst pattern found, `(?:a?){0,20}a{255}` against 256 'a's, hits the
 * match limit after 6 ms (up to 14 ms in single runs; each step re-scans
 * up to the value's length); `(a{0,255}){0,255}` against 255 'a's and a
 * '!' gives up after 2.7 ms, `(a|aa)*` and `(a+)+` after 0.2 ms. */

#define SILENCE_MAX_MATCHERS 16u
#define SILENCE_MAX_NAME 64u   /* label name bytes, [A-Za-z_][A-Za-z0-9_]* */
#define SILENCE_MAX_VALUE 256u /* matcher value bytes (so regex pattern bytes too) */
#define SILENCE_MAX_JSON 8192u /* matchers_json bytes */

#define SILENCE_RE_MAX_NEST 32u                /* parentheses nesting depth */
#define SILENCE_RE_MAX_COMPILED 8192u          /* compiled bytes of one regex */
#define SILENCE_RE_MAX_COMPILED_SILENCE 16384u /* compiled bytes of one silence's regexes */
#define SILENCE_RE_MATCH_LIMIT 10000u          /* backtracking steps of one match */
#define SILENCE_RE_DEPTH_LIMIT 1000u           /* nested backtracking frames of one match */
#define SILENCE_RE_HEAP_LIMIT_KIB 1024u        /* frame memory of one match, KiB */

/* Label names an alert carries (the same set the pager sends to
 * Alertmanager): alertname (the rule), run, severity, family, signature
 * and attribution (both the alert's attribution, e.g. attention-numerics),
 * and layer, head, window, rank where the alert has that scope
 * (page_format.c, page_labels, builds it). */
struct silence_label {
    const char *name;
    const char *value;
};

/* PCRE2's own types, by their struct tags, so that includers need not
 * include pcre2.h (pcre2_code_8 and pcre2_match_context_8). */
struct pcre2_real_code_8;
struct pcre2_real_match_context_8;

struct silence_matcher {
    char name[SILENCE_MAX_NAME + 1];
    char value[SILENCE_MAX_VALUE + 1];
    bool is_regex;
    bool is_equal;
    struct pcre2_real_code_8 *re; /* is_regex: the compiled pattern; else NULL */
};

struct silence {
    int64_t id;
    double starts_at, ends_at; /* unix seconds */
    size_t n;
    struct silence_matcher m[SILENCE_MAX_MATCHERS];
    struct pcre2_real_match_context_8 *limits; /* the match limits; NULL without regexes */
};

/* Parses and validates a matchers JSON array (len bytes) into s->m / s->n,
 * compiling regexes within the bounds above. s->id and the times are left
 * as they are. Returns 0, -EINVAL with a one-line reason in why (s then
 * holds nothing to free), or -ENOMEM. On success the caller owns the
 * compiled regexes: silence_free(). */
int silence_parse(const char *json, size_t len, struct silence *s, struct fs_err *why);

/* Makes dst a copy of src (id, times, matchers) without compiling again:
 * the compiled regexes are copied byte for byte. dst is overwritten, not
 * freed first. Returns 0 or -ENOMEM (dst then holds nothing to free). */
int silence_copy(struct silence *dst, const struct silence *src);

/* Releases the compiled regexes of s (s stays a valid empty silence). */
void silence_free(struct silence *s);

/* True if s is active at now and every matcher matches labels[0..n). A
 * silence without matchers matches nothing. Reads s only. */
bool silence_matches(const struct silence *s, const struct silence_label *labels, size_t n,
                     double now);

/* Writes s's matchers back as canonical JSON (every field present) into
 * out (NUL-terminated). Returns 0, or -ENOSPC if outlen is too small. */
int silence_matchers_json(const struct silence *s, char *out, size_t outlen);

#endif
