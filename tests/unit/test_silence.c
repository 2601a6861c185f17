/* Silences: matcher parsing/validation and matching, as tables; hostile
 * regexes refused or compiled within the bounds, under a lowered address
 * space limit; pathological matches ended by the match limit. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <jansson.h>

#include "silence.h"

#define N(a) (sizeof(a) / sizeof((a)[0]))

/* Lowers this process's address space limit to 256 MiB above what it maps
 * now (Criterion runs each test in its own process). glibc's regcomp took
 * 8 GB for a{1,1000}{1,1000} and 11.8 GB for (a{0,255}){0,255}: under this
 * limit it fails, where the PCRE2 bounds keep a compile under 8 KiB. */
static void limit_address_space(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    cr_assert_not_null(f);
    unsigned long pages = 0;
    cr_assert_eq(fscanf(f, "%lu", &pages), 1);
    fclose(f);
    rlim_t lim = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)256 << 20);
    struct rlimit r = {.rlim_cur = lim, .rlim_max = lim};
    cr_assert_eq(setrlimit(RLIMIT_AS, &r), 0);
}

/* Matchers JSON: a regex matcher on run (negated if !is_equal) beside
 * alertname="x", so that a pattern matching "" is still selective. The
 * caller frees. */
static char *regex_silence_json(const char *pattern, bool is_equal, size_t copies)
{
    json_t *arr = json_pack("[{s:s, s:s}]", "name", "alertname", "value", "x");
    cr_assert_not_null(arr);
    for (size_t i = 0; i < copies; i++)
        cr_assert_eq(
            json_array_append_new(arr, json_pack("{s:s, s:s, s:b, s:b}", "name", "run", "value",
                                                 pattern, "isRegex", 1, "isEqual", is_equal)),
            0);
    char *js = json_dumps(arr, JSON_COMPACT);
    json_decref(arr);
    cr_assert_not_null(js);
    return js;
}

/* n opening parentheses, x, n closing ones */
static const char *nested(size_t n)
{
    static char buf[2 * 64 + 2];
    cr_assert(n <= 64);
    memset(buf, '(', n);
    buf[n] = 'x';
    memset(buf + n + 1, ')', n);
    buf[2 * n + 1] = '\0';
    return buf;
}

struct parse_case {
    const char *json;
    int ok;              /* 1: parses */
    const char *why_has; /* for failures: a substring of the reason */
};

static const struct parse_case parse_cases[] = {
    {"[{\"name\":\"run\",\"value\":\"gpt\"}]", 1, NULL},
    {"[{\"name\":\"run\",\"value\":\"gpt-.*\",\"isRegex\":true}]", 1, NULL},
    {"[{\"name\":\"run\",\"value\":\"a\",\"isEqual\":false},{\"name\":\"layer\",\"value\":\"3\"}]",
     1, NULL},
    {"[]", 0, "1 to"},
    {"{}", 0, "array"},
    {"not json", 0, "not JSON"},
    {"[1]", 0, "not an object"},
    {"[{\"name\":\"run\"}]", 0, "\"value\""},
    {"[{\"value\":\"x\"}]", 0, "\"name\""},
    {"[{\"name\":\"9run\",\"value\":\"x\"}]", 0, "name must match"},
    {"[{\"name\":\"run\",\"value\":\"x\",\"extra\":1}]", 0, "unknown field"},
    {"[{\"name\":\"run\",\"value\":\"x\",\"isRegex\":\"yes\"}]", 0, "isRegex"},
    {"[{\"name\":\"run\",\"value\":\"(\",\"isRegex\":true}]", 0, "regular expression"},
    /* matches everything: rejected */
    {"[{\"name\":\"run\",\"value\":\".*\",\"isRegex\":true}]", 0, "every alert"},
    {"[{\"name\":\"run\",\"value\":\"x\",\"isEqual\":false}]", 0, "every alert"},
    {"[{\"name\":\"run\",\"value\":\"\"}]", 0, "every alert"},
};

Test(silence, parse_table)
{
    for (size_t i = 0; i < sizeof parse_cases / sizeof parse_cases[0]; i++) {
        const struct parse_case *c = &parse_cases[i];
        struct silence s = {0};
        struct fs_err why = {0};
        int rc = silence_parse(c->json, strlen(c->json), &s, &why);
        if (c->ok) {
            cr_expect_eq(rc, 0, "case %zu (%s): %s", i, c->json, why.msg);
        } else {
            cr_expect_eq(rc, -EINVAL, "case %zu (%s) parsed", i, c->json);
            cr_expect(strstr(why.msg, c->why_has), "case %zu: reason '%s' lacks '%s'", i, why.msg,
                      c->why_has);
            cr_expect_eq(s.n, 0u, "case %zu: failed parse keeps matchers", i);
        }
        silence_free(&s);
    }
}

Test(silence, too_many_matchers)
{
    char json[4096] = "[";
    for (unsigned i = 0; i <= SILENCE_MAX_MATCHERS; i++)
        strcat(json,
               i ? ",{\"name\":\"run\",\"value\":\"x\"}" : "{\"name\":\"run\",\"value\":\"x\"}");
    strcat(json, "]");
    struct silence s = {0};
    struct fs_err why = {0};
    cr_expect_eq(silence_parse(json, strlen(json), &s, &why), -EINVAL);
}

struct match_case {
    const char *json;
    const char *run, *layer; /* alert labels; NULL: absent */
    double now;
    int match;
};

static const struct match_case match_cases[] = {
    {"[{\"name\":\"run\",\"value\":\"gpt\"}]", "gpt", "3", 50, 1},
    {"[{\"name\":\"run\",\"value\":\"gpt\"}]", "gpt2", "3", 50, 0},
    {"[{\"name\":\"run\",\"value\":\"gpt\"}]", "gpt", "3", 9, 0},   /* before starts_at */
    {"[{\"name\":\"run\",\"value\":\"gpt\"}]", "gpt", "3", 100, 0}, /* ends_at is exclusive */
    {"[{\"name\":\"run\",\"value\":\"g.t\",\"isRegex\":true}]", "gpt", NULL, 50, 1},
    {"[{\"name\":\"run\",\"value\":\"g\",\"isRegex\":true}]", "gpt", NULL, 50, 0}, /* anchored */
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\"}]", "gpt", "3", 50,
     1},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\"}]", "gpt", "4", 50,
     0},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\"}]", "gpt", NULL, 50,
     0},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\",\"isEqual\":false}"
     "]",
     "gpt", "4", 50, 1},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"\"}]", "gpt", NULL, 50,
     1}, /* absent label = "" */
};

Test(silence, match_table)
{
    for (size_t i = 0; i < sizeof match_cases / sizeof match_cases[0]; i++) {
        const struct match_case *c = &match_cases[i];
        struct silence s = {.starts_at = 10, .ends_at = 100};
        struct fs_err why = {0};
        cr_assert_eq(silence_parse(c->json, strlen(c->json), &s, &why), 0, "case %zu: %s", i,
                     why.msg);
        struct silence_label labels[3] = {{"alertname", "qk.d2.srank"}};
        size_t n = 1;
        if (c->run)
            labels[n++] = (struct silence_label){"run", c->run};
        if (c->layer)
            labels[n++] = (struct silence_label){"layer", c->layer};
        cr_expect_eq(silence_matches(&s, labels, n, c->now), (bool)c->match, "case %zu", i);
        silence_free(&s);
    }
}

Test(silence, canonical_json_round_trip)
{
    const char *in = "[{\"name\":\"run\",\"value\":\"a\\\"b\",\"isRegex\":false}]";
    struct silence s = {0};
    struct fs_err why = {0};
    char out[512], small[8];
    cr_assert_eq(silence_parse(in, strlen(in), &s, &why), 0, "%s", why.msg);
    cr_assert_eq(silence_matchers_json(&s, out, sizeof out), 0);
    cr_expect_str_eq(
        out, "[{\"name\":\"run\",\"value\":\"a\\\"b\",\"isRegex\":false,\"isEqual\":true}]");
    cr_expect_eq(silence_matchers_json(&s, small, sizeof small), -ENOSPC);
    struct silence t = {0};
    cr_expect_eq(silence_parse(out, strlen(out), &t, &why), 0);
    silence_free(&s);
    silence_free(&t);
}

/* Hostile patterns: refused with the reason, or compiled within the
 * bounds. Measured (PCRE2 10.42, this machine): (a{0,255}){0,255} compiles
 * in 0.16 ms to 4982 bytes; every refusal below takes under 0.02 ms. */
struct hostile_case {
    const char *pattern; /* NULL: nested(nest) */
    size_t nest;
    size_t copies; /* regex matchers with this pattern in one silence */
    int ok;
    const char *why_has; /* refusals: a substring of the reason */
};

static const struct hostile_case hostile_cases[] = {
    /* glibc: 8.5 s and 8 GB; PCRE2, as RE2: not a pattern */
    {"a{1,1000}{1,1000}", 0, 1, 0, "quantifier does not follow a repeatable item"},
    {"x{0,255}{0,255}", 0, 1, 0, "quantifier does not follow a repeatable item"},
    /* glibc: 40 s and 11.8 GB; PCRE2: 255 copies of the group, 4982 bytes */
    {"(a{0,255}){0,255}", 0, 1, 1, NULL},
    {"(?:a{0,255}){0,255}", 0, 1, 1, NULL},
    /* ... but not four of them in one silence */
    {"(a{0,255}){0,255}", 0, 4, 0, "more than 16384 bytes per silence"},
    /* past PCRE2's own ceiling: refused before anything is allocated */
    {"((a{0,255}){0,255}){0,255}", 0, 1, 0, "too large"},
    {"(?:(?:a{2}){100}){100}", 0, 1, 0, "too large"},
    {"(.*){1,32000}", 0, 1, 0, "too large"},
    /* under PCRE2's ceiling, over ours (13652 bytes) */
    {"([a-z]{0,255}){0,255}", 0, 1, 0, "compiles to more than 8192 bytes"},
    {NULL, 32, 1, 1, NULL},
    {NULL, 33, 1, 0, "parentheses nested deeper than 32"},
    {NULL, 64, 1, 0, "parentheses nested deeper than 32"},
    {"(x(?1)?){0,50}", 0, 1, 1, NULL}, /* recursion: bounded at match time */
    {"a\\C", 0, 1, 0, "\\C is disabled"},
    {"(*UTF)a", 0, 1, 0, "UTF is disabled"},
    {"(*LIMIT_MATCH=99999999)a", 0, 1, 1, NULL}, /* may only lower our limit */
};

Test(silence, hostile_patterns_refused_or_bounded)
{
    limit_address_space();
    for (size_t i = 0; i < N(hostile_cases); i++) {
        const struct hostile_case *c = &hostile_cases[i];
        const char *pat = c->pattern != NULL ? c->pattern : nested(c->nest);
        char *js = regex_silence_json(pat, true, c->copies);
        struct silence s = {0};
        struct fs_err why = {0};
        int rc = silence_parse(js, strlen(js), &s, &why);
        if (c->ok) {
            cr_expect_eq(rc, 0, "case %zu (%s): %s", i, pat, why.msg);
            cr_expect_eq(s.n, 1 + c->copies, "case %zu", i);
        } else {
            cr_expect_eq(rc, -EINVAL, "case %zu (%s): parsed", i, pat);
            cr_expect(strstr(why.msg, c->why_has), "case %zu (%s): reason '%s' lacks '%s'", i, pat,
                      why.msg, c->why_has);
        }
        silence_free(&s);
        free(js);
    }
}

/* Matches that backtrack without end are cut off by the match limit and
 * count as "does not hold", for =~ and for !~ alike: a silence never
 * silences more than its author meant. Asserted by the result, not by
 * time. The label value is (unit x reps) + tail, at most 256 bytes. */
struct slow_case {
    const char *pattern;
    bool is_equal; /* false: !~ */
    const char *unit;
    unsigned reps;
    const char *tail;
    int match; /* the silence matches the alert */
};

static const struct slow_case slow_cases[] = {
    /* undecided: neither =~ nor !~ holds */
    {"(a|aa)*", true, "a", 255, "!", 0},
    {"(a|aa)*", false, "a", 255, "!", 0}, /* glibc: no match, so !~ silenced */
    {"(a+)+", true, "a", 255, "c", 0},
    {"(a+)+", false, "a", 255, "c", 0},
    {"(.*a){20}", true, "a", 256, "", 0}, /* would match, given time */
    {"(.*a){20}", false, "a", 256, "", 0},
    {"(?:a?){0,20}a{255}", true, "a", 256, "", 0}, /* would match, given time */
    {"(a{0,255}){0,255}", true, "a", 255, "b", 0},
    /* decided quickly: the ordinary answers */
    {"(a|aa)*", true, "a", 256, "", 1},
    {"(a|aa)*", false, "a", 256, "", 0},
    {"(a{0,255}){0,255}", true, "a", 256, "", 1},
    {"gpt-.*", true, "x", 252, "", 0},
    {"x*", true, "x", 256, "", 1},
    {".*-(7b|13b)-.*", true, "x", 120, "-13b-yyyy", 1},
    {".*-(7b|13b)-.*", false, "x", 120, "-13b-yyyy", 0},
    {".*-(7b|13b)-.*", false, "x", 250, "", 1},
    /* anchored at both ends, '|' and '$' included */
    {"gpt|llama", true, "", 0, "gpt-7b", 0},
    {"gpt|llama", true, "", 0, "llama", 1},
    {"a$", true, "", 0, "a\n", 0},
    {"a", true, "", 0, "ba", 0},
};

Test(silence, pathological_matches_end_at_the_limit)
{
    limit_address_space();
    for (size_t i = 0; i < N(slow_cases); i++) {
        const struct slow_case *c = &slow_cases[i];
        char *js = regex_silence_json(c->pattern, c->is_equal, 1);
        struct silence s = {.starts_at = 0, .ends_at = 100};
        struct fs_err why = {0};
        cr_assert_eq(silence_parse(js, strlen(js), &s, &why), 0, "case %zu: %s", i, why.msg);
        char v[SILENCE_MAX_VALUE + 1] = "";
        size_t ul = strlen(c->unit), len = 0;
        for (unsigned k = 0; k < c->reps; k++, len += ul)
            memcpy(v + len, c->unit, ul);
        cr_assert(len + strlen(c->tail) <= SILENCE_MAX_VALUE, "case %zu", i);
        strcpy(v + len, c->tail);
        struct silence_label labels[] = {{"alertname", "x"}, {"run", v}};
        cr_expect_eq(silence_matches(&s, labels, N(labels), 50), (bool)c->match,
                     "case %zu (%s %s %zu bytes)", i, c->pattern, c->is_equal ? "=~" : "!~",
                     strlen(v));
        silence_free(&s);
        free(js);
    }
}

/* A copy needs no compile and outlives its original. */
Test(silence, copy_matches_after_the_original_is_freed)
{
    const char *in = "[{\"name\":\"run\",\"value\":\"gpt-.*\",\"isRegex\":true},"
                     "{\"name\":\"layer\",\"value\":\"[0-3]\",\"isRegex\":true,"
                     "\"isEqual\":false}]";
    struct silence s = {.id = 7, .starts_at = 10, .ends_at = 100}, t;
    struct fs_err why = {0};
    cr_assert_eq(silence_parse(in, strlen(in), &s, &why), 0, "%s", why.msg);
    cr_assert_eq(silence_copy(&t, &s), 0);
    silence_free(&s);
    cr_expect_eq(t.id, 7);
    cr_expect_eq(t.n, 2u);
    struct silence_label hit[] = {{"run", "gpt-7b"}, {"layer", "5"}};
    struct silence_label miss[] = {{"run", "gpt-7b"}, {"layer", "2"}};
    cr_expect(silence_matches(&t, hit, N(hit), 50));
    cr_expect(!silence_matches(&t, miss, N(miss), 50));
    silence_free(&t);
    cr_expect_eq(t.n, 0u);
}
