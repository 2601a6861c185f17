/* Per-run ingest tokens (daemon/run_auth.c): the glob, the first matching
 * section naming the token, the [run "PATTERN"] section's parsing and its
 * bounds. */
#include <criterion/criterion.h>
#include <string.h>

#include "config.h"
#include "run_auth.h"

static const struct {
    const char *pattern, *run;
    bool match;
} glob_cases[] = {
    {"team-a-*", "team-a-7", true},
    {"team-a-*", "team-a-", true},
    {"team-a-*", "team-b-7", false},
    {"team-a-*", "xteam-a-7", false}, /* anchored at the start */
    {"*-7", "team-a-7", true},
    {"*-7", "team-a-70", false}, /* and at the end */
    {"gpt-?b", "gpt-7b", true},
    {"gpt-?b", "gpt-70b", false},
    {"*", "anything", true},
    {"a*b*c", "axxbyyc", true},
    {"a*b*c", "axxbyy", false},
    {"exact", "exact", true},
    {"exact", "exactly", false},
    /* many stars: retried from the last one only, no blow-up */
    {"*a*a*a*a*a*a*a*a*b", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", false},
};

Test(run_auth, glob)
{
    for (size_t i = 0; i < sizeof(glob_cases) / sizeof(glob_cases[0]); i++)
        cr_expect_eq(run_auth_match(glob_cases[i].pattern, glob_cases[i].run), glob_cases[i].match,
                     "case %zu: %s vs %s", i, glob_cases[i].pattern, glob_cases[i].run);
}

static int parse(struct run_auth *ra, const char *text, struct fs_err *err)
{
    static struct fs_config cfg;
    struct config_section sec;
    config_defaults(&cfg);
    memset(ra, 0, sizeof(*ra));
    run_auth_section(ra, &sec);
    return config_parse(text, strlen(text), "t.conf", &cfg, &sec, 1, err);
}

Test(run_auth, first_matching_section_names_the_token)
{
    static struct run_auth ra;
    struct fs_err err = {0};
    cr_assert_eq(parse(&ra,
                       "[run \"team-a-special\"]\ntoken = s\n"
                       "[run \"team-a-*\"]\ntoken = a\n",
                       &err),
                 0, "%s", err.msg);
    struct fs_err why = {0};
    cr_assert_eq(run_auth_check(&ra, &why), 0);
    cr_expect_str_eq(run_auth_token(&ra, "team-a-special", "g"), "s");
    cr_expect_str_eq(run_auth_token(&ra, "team-a-1", "g"), "a");
    cr_expect_str_eq(run_auth_token(&ra, "other", "g"), "g");
    cr_expect_str_eq(run_auth_token(&ra, "other", ""), "");
    cr_expect_str_eq(run_auth_token(NULL, "other", "g"), "g");
}

static const struct {
    const char *text, *says;
} bad_cases[] = {
    {"[run]\ntoken = x\n", "pattern"},
    {"[run \"a b\"]\ntoken = x\n", "characters"},
    {"[run \"a\"]\ntoken = x\n[run \"a\"]\ntoken = y\n", "twice"},
    {"[run \"a\"]\ntoken =\n", "token"},
    {"[run \"a\"]\nsecret = x\n", "secret"},
};

Test(run_auth, bad_sections_are_refused_by_name)
{
    static struct run_auth ra;
    for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
        struct fs_err err = {0};
        cr_expect_neq(parse(&ra, bad_cases[i].text, &err), 0, "case %zu accepted", i);
        cr_expect(strstr(err.msg, bad_cases[i].says), "case %zu: %s", i, err.msg);
    }
    /* A section without its token passes the parser; the check names it. */
    struct fs_err err = {0};
    cr_assert_eq(parse(&ra, "[run \"a*\"]\n", &err), 0);
    struct fs_err why = {0};
    cr_expect_neq(run_auth_check(&ra, &why), 0);
    cr_expect(strstr(why.msg, "a*") && strstr(why.msg, "token"), "%s", why.msg);
}

Test(run_auth, sections_are_bounded)
{
    static char text[RUN_AUTH_MAX * 40 + 64];
    size_t off = 0;
    for (unsigned i = 0; i <= RUN_AUTH_MAX; i++)
        off += (size_t)snprintf(text + off, sizeof(text) - off, "[run \"r%u\"]\ntoken = t\n", i);
    static struct run_auth ra;
    struct fs_err err = {0};
    cr_expect_neq(parse(&ra, text, &err), 0);
    cr_expect(strstr(err.msg, "more than"), "%s", err.msg);
}

/* A section shadowed by an earlier one (the earlier pattern matches every
 * run id the later one does) could never name a token: refused, with both
 * sections and lines (issue 22). One that only overlaps is kept: each
 * still decides some runs. */
static const struct {
    const char *first, *later;
    bool shadowed;
} shadow_cases[] = {
    {"team-a-*", "team-a-7", true},
    {"*", "anything", true},
    {"*", "a*", true},
    {"a*", "a?c", true},
    {"a*", "a*b", true},
    {"a?c", "abc", true},
    {"*-7", "team-*-7", true},
    {"a*b*c", "a-b-c", true},
    {"team-a-7", "team-a-*", false}, /* the narrower one first: both used */
    {"a?", "a*", false},             /* "abc" matches only the later */
    {"a?c", "a*", false},
    {"a*", "b*", false},
    {"*-7", "*-70", false},
    {"abc", "abd", false},
    {"?", "*", false},
    {"a*c", "a*b", false},
};

Test(run_auth, a_shadowed_section_is_refused)
{
    static struct run_auth ra;
    for (size_t i = 0; i < sizeof(shadow_cases) / sizeof(shadow_cases[0]); i++) {
        char text[256];
        snprintf(text, sizeof(text), "[run \"%s\"]\ntoken = x\n\n[run \"%s\"]\ntoken = y\n",
                 shadow_cases[i].first, shadow_cases[i].later);
        struct fs_err err = {0};
        int rc = parse(&ra, text, &err);
        if (!shadow_cases[i].shadowed) {
            cr_expect_eq(rc, 0, "case %zu: %s", i, err.msg);
            continue;
        }
        char want[160];
        snprintf(want, sizeof(want),
                 "t.conf:4: section [run \"%s\"]: never used: [run \"%s\"] (line 1)",
                 shadow_cases[i].later, shadow_cases[i].first);
        cr_expect_neq(rc, 0, "case %zu accepted", i);
        cr_expect(strstr(err.msg, want), "case %zu: %s", i, err.msg);
    }
}
