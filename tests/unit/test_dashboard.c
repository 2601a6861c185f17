/* Dashboard assets: path lookup, content types, If-None-Match matching (as
 * tables), and the table embedded at build time. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "dashboard.h"

static const unsigned char a_index[] = "<html>";
static const unsigned char a_js[] = "x=1";
static const struct dashboard_asset fake[] = {
    {"index.html", a_index, sizeof a_index - 1, "\"i1\""},
    {"app.js", a_js, sizeof a_js - 1, "\"j1\""},
};

struct lookup_case {
    const char *path;
    const char *name; /* expected asset name; NULL: -ENOENT */
};

static const struct lookup_case lookup_cases[] = {
    {"/", "index.html"},
    {"/static/index.html", "index.html"},
    {"/static/app.js", "app.js"},
    {"/static/app.js/", NULL},
    {"/static/", NULL},
    {"/static", NULL},
    {"/static//app.js", NULL},
    {"/static/../static/app.js", NULL},
    {"/static/APP.JS", NULL},
    {"/static/app", NULL},
    {"/app.js", NULL},
    {"/index.html", NULL},
    {"", NULL},
    {"//", NULL},
    {"/static/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", NULL},
};

Test(dashboard, lookup_table)
{
    for (size_t i = 0; i < sizeof lookup_cases / sizeof lookup_cases[0]; i++) {
        const struct lookup_case *c = &lookup_cases[i];
        struct dashboard_file f = {0};
        int rc = dashboard_lookup_in(fake, 2, c->path, &f);
        if (!c->name) {
            cr_expect_eq(rc, -ENOENT, "case %zu (%s): rc %d", i, c->path, rc);
            continue;
        }
        cr_assert_eq(rc, 0, "case %zu (%s): rc %d", i, c->path, rc);
        const struct dashboard_asset *a = strcmp(c->name, "app.js") == 0 ? &fake[1] : &fake[0];
        cr_expect_eq(f.data, a->data, "case %zu: data", i);
        cr_expect_eq(f.len, a->len, "case %zu: len", i);
        cr_expect_str_eq(f.etag, a->etag, "case %zu: etag", i);
        cr_expect_str_eq(f.cache_control, DASHBOARD_CACHE_CONTROL, "case %zu", i);
        cr_expect_str_eq(f.content_type, dashboard_content_type(c->name), "case %zu", i);
    }
    struct dashboard_file f;
    cr_expect_eq(dashboard_lookup_in(fake, 2, NULL, &f), -ENOENT);
    cr_expect_eq(dashboard_lookup_in(fake, 0, "/", &f), -ENOENT);
}

struct type_case {
    const char *name;
    const char *type;
};

static const struct type_case type_cases[] = {
    {"index.html", "text/html; charset=utf-8"},
    {"app.js", "text/javascript; charset=utf-8"},
    {"dygraph.min.js", "text/javascript; charset=utf-8"},
    {"app.css", "text/css; charset=utf-8"},
    {"dygraph.min.css", "text/css; charset=utf-8"},
    {"x.svg", "image/svg+xml"},
    {"x.png", "image/png"},
    {"x.js.map", "application/json"},
    {"x.jsx", "application/octet-stream"},
    {"README", "application/octet-stream"},
    {"x.", "application/octet-stream"},
    {"", "application/octet-stream"},
    {NULL, "application/octet-stream"},
};

Test(dashboard, content_type_table)
{
    for (size_t i = 0; i < sizeof type_cases / sizeof type_cases[0]; i++)
        cr_expect_str_eq(dashboard_content_type(type_cases[i].name), type_cases[i].type,
                         "case %zu (%s)", i, type_cases[i].name ? type_cases[i].name : "NULL");
}

struct etag_case {
    const char *header; /* If-None-Match */
    const char *etag;
    bool match;
};

static const struct etag_case etag_cases[] = {
    {NULL, "\"abc\"", false},
    {"\"abc\"", "\"abc\"", true},
    {"W/\"abc\"", "\"abc\"", true}, /* weak comparison */
    {"\"abc\"", "W/\"abc\"", true},
    {"\"abd\"", "\"abc\"", false},
    {"\"ab\"", "\"abc\"", false},
    {"\"abcd\"", "\"abc\"", false},
    {"abc", "\"abc\"", false}, /* unquoted: malformed */
    {"\"x\", \"abc\"", "\"abc\"", true},
    {"\"x\",\"abc\"", "\"abc\"", true},
    {" \"x\" ,  W/\"abc\" ", "\"abc\"", true},
    {"\"x\", \"y\"", "\"abc\"", false},
    {"\"x\" junk, \"abc\"", "\"abc\"", false}, /* malformed list: no match */
    {"\"abc", "\"abc\"", false},
    {"*", "\"abc\"", true},
    {" * ", "\"abc\"", true},
    {"*, \"x\"", "\"abc\"", false},
    {"\"x\", *", "\"abc\"", false},
    {"", "\"abc\"", false},
    {",,", "\"abc\"", false},
    {"\"\"", "\"\"", true},
    {"\"abc\"", NULL, false},
    {"\"abc\"", "abc", false},
};

Test(dashboard, etag_match_table)
{
    for (size_t i = 0; i < sizeof etag_cases / sizeof etag_cases[0]; i++) {
        const struct etag_case *c = &etag_cases[i];
        cr_expect_eq(dashboard_etag_match(c->header, c->etag), c->match, "case %zu: '%s' vs %s", i,
                     c->header ? c->header : "NULL", c->etag ? c->etag : "NULL");
    }
}

Test(dashboard, etag_header_bound)
{
    /* a list longer than the bound matches nothing, even if the tag is in it */
    static char big[DASHBOARD_MAX_IF_NONE_MATCH + 16];
    memset(big, ' ', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    memcpy(big + sizeof big - 8, "\"abc\"", 5);
    cr_expect(!dashboard_etag_match(big, "\"abc\""));
    big[DASHBOARD_MAX_IF_NONE_MATCH - 10] = '\0';
    memcpy(big, "\"abc\"", 5);
    cr_expect(dashboard_etag_match(big, "\"abc\""));
}

static bool contains(const unsigned char *hay, size_t n, const char *needle)
{
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(hay + i, needle, k) == 0)
            return true;
    return false;
}

/* The table embedded by dashboard/embed.cmake: the page, its code and
 * dygraphs are there, each with a distinct strong ETag. */
Test(dashboard, embedded_table)
{
    static const char *const want[] = {"index.html", "app.js", "app.css", "dygraph.min.js",
                                       "dygraph.min.css"};
    cr_assert_geq(dashboard_asset_count, sizeof want / sizeof want[0]);
    for (size_t w = 0; w < sizeof want / sizeof want[0]; w++) {
        char path[128];
        snprintf(path, sizeof path, "/static/%s", want[w]);
        struct dashboard_file f;
        cr_assert_eq(dashboard_lookup(path, &f), 0, "%s is not embedded", want[w]);
        cr_expect_gt(f.len, 0u, "%s is empty", want[w]);
        size_t n = strlen(f.etag);
        cr_expect(n > 2 && f.etag[0] == '"' && f.etag[n - 1] == '"', "%s: etag %s", want[w],
                  f.etag);
        cr_expect(strncmp(f.etag, "W/", 2) != 0, "%s: weak etag", want[w]);
    }
    for (size_t i = 0; i < dashboard_asset_count; i++)
        for (size_t j = i + 1; j < dashboard_asset_count; j++) {
            cr_expect_str_neq(dashboard_assets[i].name, dashboard_assets[j].name);
            cr_expect_str_neq(dashboard_assets[i].etag, dashboard_assets[j].etag);
        }

    struct dashboard_file idx;
    cr_assert_eq(dashboard_lookup("/", &idx), 0);
    cr_expect_str_eq(idx.content_type, "text/html; charset=utf-8");
    /* the page loads its code from the daemon itself, nothing from elsewhere */
    const char *needles[] = {"/static/app.js", "/static/dygraph.min.js", "/static/app.css"};
    for (size_t k = 0; k < 3; k++)
        cr_expect(contains(idx.data, idx.len, needles[k]), "index.html does not load %s",
                  needles[k]);
    cr_expect(!contains(idx.data, idx.len, "http://"), "index.html names a remote URL");
    cr_expect(!contains(idx.data, idx.len, "https://"), "index.html names a remote URL");
}
