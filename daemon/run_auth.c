/* Per-run ingest tokens (see run_auth.h). */
#include "run_auth.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static const struct config_key run_keys[] = {
    {.name = "token",
     .type = CONFIG_STRING,
     .def = "",
     .min = 1,
     .max = FS_MAX_TOKEN_LEN,
     .offset = offsetof(struct run_auth_entry, token),
     .size = sizeof(((struct run_auth_entry *)0)->token),
     .help = "the token a Hello for a run matching the section's pattern must carry"},
};

static bool pattern_char(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == ':' || c == '-' || c == '*' || c == '?';
}

/* Whether every run id pattern b matches, pattern a matches too ('*' and
 * '?' only). Sound, not complete: true only when each piece of b is taken
 * by a piece of a at least as general (a literal by itself, '?' or '*';
 * b's '?' by a's '?' or '*'; b's '*' by a's '*'), so a shadowed section is
 * never reported wrongly; a rare one written otherwise ("?*" over "*?")
 * goes unreported. ok[i][j]: a[i..] covers b[j..]. */
static bool pattern_covers(const char *a, const char *b)
{
    static bool ok[FS_MAX_RUN_ID_LEN + 2][FS_MAX_RUN_ID_LEN + 2]; /* main thread, at start */
    size_t la = strlen(a), lb = strlen(b);
    if (la > FS_MAX_RUN_ID_LEN || lb > FS_MAX_RUN_ID_LEN)
        return false;
    for (size_t i = la + 1; i-- > 0;) {
        for (size_t j = lb + 1; j-- > 0;) {
            if (i == la)
                ok[i][j] = j == lb;
            else if (a[i] == '*')
                ok[i][j] = ok[i + 1][j] || (j < lb && ok[i][j + 1]);
            else if (j == lb || b[j] == '*')
                ok[i][j] = false;
            else if (a[i] == '?')
                ok[i][j] = ok[i + 1][j + 1];
            else
                ok[i][j] = a[i] == b[j] && ok[i + 1][j + 1];
        }
    }
    return ok[0][0];
}

static void *run_open(void *ctx, const char *sub, struct fs_err *why)
{
    struct run_auth *ra = ctx;
    if (!sub || !sub[0]) {
        fs_err_set(why, -EINVAL, "needs a run id pattern: [run \"PATTERN\"]");
        return NULL;
    }
    if (strlen(sub) > FS_MAX_RUN_ID_LEN) {
        fs_err_set(why, -EINVAL, "pattern longer than %u bytes", FS_MAX_RUN_ID_LEN);
        return NULL;
    }
    for (const char *c = sub; *c; c++) {
        if (!pattern_char(*c)) {
            fs_err_set(why, -EINVAL,
                       "a pattern holds run id characters [A-Za-z0-9._:-], '*' "
                       "and '?' only");
            return NULL;
        }
    }
    for (size_t i = 0; i < ra->n; i++) {
        if (strcmp(ra->e[i].pattern, sub) == 0) {
            fs_err_set(why, -EINVAL, "pattern defined twice");
            return NULL;
        }
        /* The first matching section decides a run's token, so this one
         * would never be used: refused, as a section given twice is. */
        if (pattern_covers(ra->e[i].pattern, sub)) {
            char at[32] = "";
            if (ra->e[i].line > 0)
                snprintf(at, sizeof(at), " (line %d)", ra->e[i].line);
            fs_err_set(why, -EINVAL,
                       "never used: [run \"%s\"]%s comes first and matches every run id this "
                       "pattern matches (put the narrower section first)",
                       ra->e[i].pattern, at);
            return NULL;
        }
    }
    if (ra->n >= RUN_AUTH_MAX) {
        fs_err_set(why, -EINVAL, "more than %u [run] sections", RUN_AUTH_MAX);
        return NULL;
    }
    struct run_auth_entry *e = &ra->e[ra->n++];
    memset(e, 0, sizeof(*e));
    snprintf(e->pattern, sizeof(e->pattern), "%s", sub);
    e->line = why->line; /* config.c gives the header's line here */
    return e;
}

void run_auth_section(struct run_auth *ra, struct config_section *out)
{
    *out = (struct config_section){.name = "run",
                                   .keys = run_keys,
                                   .nkeys = sizeof(run_keys) / sizeof(run_keys[0]),
                                   .open = run_open,
                                   .ctx = ra};
}

int run_auth_check(const struct run_auth *ra, struct fs_err *why)
{
    for (size_t i = 0; i < ra->n; i++) {
        if (!ra->e[i].token[0])
            return fs_err_set(why, -EINVAL, "config: [run \"%s\"]: key 'token' is required",
                              ra->e[i].pattern);
    }
    return 0;
}

bool run_auth_match(const char *p, const char *s)
{
    /* Greedy with one backtrack point (the last '*'): each character of s
     * is retried against at most the part of p after that star. */
    const char *star = NULL, *resume = NULL;
    while (*s) {
        if (*p == '*') {
            star = p++;
            resume = s;
        } else if (*p && (*p == '?' || *p == *s)) {
            p++;
            s++;
        } else if (star) {
            p = star + 1;
            s = ++resume;
        } else {
            return false;
        }
    }
    while (*p == '*')
        p++;
    return *p == '\0';
}

const char *run_auth_token(const struct run_auth *ra, const char *run, const char *global)
{
    for (size_t i = 0; ra && i < ra->n; i++)
        if (run_auth_match(ra->e[i].pattern, run))
            return ra->e[i].token;
    return global ? global : "";
}

const char *run_auth_owner(const struct run_auth *ra, const char *run)
{
    for (size_t i = 0; ra && i < ra->n; i++)
        if (run_auth_match(ra->e[i].pattern, run))
            return ra->e[i].pattern;
    return "";
}
