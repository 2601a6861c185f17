/* Silences: matcher parsing/validation and matching, as tables. */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "silence.h"

struct parse_case {
    const char *json;
    int ok;              /* 1: parses */
    const char *why_has; /* for failures: a substring of the reason */
};

static const struct parse_case parse_cases[] = {
    {"[{\"name\":\"run\",\"value\":\"gpt\"}]", 1, NULL},
    {"[{\"name\":\"run\",\"value\":\"gpt-.*\",\"isRegex\":true}]", 1, NULL},
    {"[{\"name\":\"run\",\"value\":\"a\",\"isEqual\":false},{\"name\":\"layer\",\"value\":\"3\"}]", 1,
     NULL},
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
        char why[256] = "";
        int rc = silence_parse(c->json, strlen(c->json), &s, why, sizeof why);
        if (c->ok) {
            cr_expect_eq(rc, 0, "case %zu (%s): %s", i, c->json, why);
        } else {
            cr_expect_eq(rc, -EINVAL, "case %zu (%s) parsed", i, c->json);
            cr_expect(strstr(why, c->why_has) != NULL, "case %zu: reason '%s' lacks '%s'", i, why,
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
        strcat(json, i ? ",{\"name\":\"run\",\"value\":\"x\"}" : "{\"name\":\"run\",\"value\":\"x\"}");
    strcat(json, "]");
    struct silence s = {0};
    char why[256];
    cr_expect_eq(silence_parse(json, strlen(json), &s, why, sizeof why), -EINVAL);
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
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\"}]", "gpt", "3", 50, 1},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\"}]", "gpt", "4", 50, 0},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\"}]", "gpt", NULL, 50, 0},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"3\",\"isEqual\":false}]",
     "gpt", "4", 50, 1},
    {"[{\"name\":\"run\",\"value\":\"gpt\"},{\"name\":\"layer\",\"value\":\"\"}]", "gpt", NULL, 50,
     1}, /* absent label = "" */
};

Test(silence, match_table)
{
    for (size_t i = 0; i < sizeof match_cases / sizeof match_cases[0]; i++) {
        const struct match_case *c = &match_cases[i];
        struct silence s = {.starts_at = 10, .ends_at = 100};
        char why[256] = "";
        cr_assert_eq(silence_parse(c->json, strlen(c->json), &s, why, sizeof why), 0, "case %zu: %s",
                     i, why);
        struct silence_label labels[3] = {{"alertname", "qk.d2.srank"}};
        size_t n = 1;
        if (c->run != NULL)
            labels[n++] = (struct silence_label){"run", c->run};
        if (c->layer != NULL)
            labels[n++] = (struct silence_label){"layer", c->layer};
        cr_expect_eq(silence_matches(&s, labels, n, c->now), (bool)c->match, "case %zu", i);
        silence_free(&s);
    }
}

Test(silence, canonical_json_round_trip)
{
    const char *in = "[{\"name\":\"run\",\"value\":\"a\\\"b\",\"isRegex\":false}]";
    struct silence s = {0};
    char why[256], out[512], small[8];
    cr_assert_eq(silence_parse(in, strlen(in), &s, why, sizeof why), 0, "%s", why);
    cr_assert_eq(silence_matchers_json(&s, out, sizeof out), 0);
    cr_expect_str_eq(out, "[{\"name\":\"run\",\"value\":\"a\\\"b\",\"isRegex\":false,\"isEqual\":true}]");
    cr_expect_eq(silence_matchers_json(&s, small, sizeof small), -ENOSPC);
    struct silence t = {0};
    cr_expect_eq(silence_parse(out, strlen(out), &t, why, sizeof why), 0);
    silence_free(&s);
    silence_free(&t);
}
