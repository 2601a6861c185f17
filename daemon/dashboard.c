/* The dashboard's static files: path -> embedded bytes, content type and
 * ETag, and the If-None-Match comparison. No I/O: http.c serves what this
 * returns. */

#include "dashboard.h"

#include <errno.h>
#include <string.h>

static const struct {
    const char *ext;
    const char *type;
} content_types[] = {
    {.ext = ".html", .type = "text/html; charset=utf-8"},
    {.ext = ".js", .type = "text/javascript; charset=utf-8"},
    {.ext = ".css", .type = "text/css; charset=utf-8"},
    {.ext = ".json", .type = "application/json"},
    {.ext = ".map", .type = "application/json"},
    {.ext = ".svg", .type = "image/svg+xml"},
    {.ext = ".png", .type = "image/png"},
    {.ext = ".ico", .type = "image/x-icon"},
    {.ext = ".txt", .type = "text/plain; charset=utf-8"},
};

/* Any thread. */
const char *dashboard_content_type(const char *name)
{
    const char *dot = name != NULL ? strrchr(name, '.') : NULL;
    if (dot)
        for (size_t i = 0; i < sizeof content_types / sizeof content_types[0]; i++)
            if (strcmp(dot, content_types[i].ext) == 0)
                return content_types[i].type;
    return "application/octet-stream";
}

/* Any thread. */
int dashboard_lookup_in(const struct dashboard_asset *assets, size_t n, const char *path,
                        struct dashboard_file *out)
{
    if (!path)
        return -ENOENT;
    const char *name;
    if (strcmp(path, "/") == 0)
        name = DASHBOARD_INDEX;
    else if (strncmp(path, DASHBOARD_STATIC_PREFIX, strlen(DASHBOARD_STATIC_PREFIX)) == 0)
        name = path + strlen(DASHBOARD_STATIC_PREFIX);
    else
        return -ENOENT;
    /* Names are plain file names: the table never holds '/' or "..", so an
     * exact match is the whole traversal defence. */
    size_t len = strnlen(name, DASHBOARD_MAX_NAME + 1);
    if (len == 0 || len > DASHBOARD_MAX_NAME)
        return -ENOENT;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(assets[i].name, name) != 0)
            continue;
        *out = (struct dashboard_file){.data = assets[i].data,
                                       .len = assets[i].len,
                                       .content_type = dashboard_content_type(name),
                                       .etag = assets[i].etag,
                                       .cache_control = DASHBOARD_CACHE_CONTROL};
        return 0;
    }
    return -ENOENT;
}

/* Any thread. */
int dashboard_lookup(const char *path, struct dashboard_file *out)
{
    return dashboard_lookup_in(dashboard_assets, dashboard_asset_count, path, out);
}

/* The opaque part of an entity-tag at *p ("xyz" including the quotes, after
 * an optional W/). Returns its length and sets *start, or 0 if malformed. */
static size_t opaque_tag(const char *p, const char **start)
{
    if (p[0] == 'W' && p[1] == '/')
        p += 2;
    if (*p != '"')
        return 0;
    const char *q = p + 1;
    /* etagc: any visible byte but DQUOTE, and obs-text */
    while (*q != '\0' && *q != '"' && ((unsigned char)*q > 0x20 && (unsigned char)*q != 0x7f))
        q++;
    if (*q != '"')
        return 0;
    *start = p;
    return (size_t)(q + 1 - p);
}

/* Any thread. */
bool dashboard_etag_match(const char *if_none_match, const char *etag)
{
    if (!if_none_match || !etag)
        return false;
    if (strnlen(if_none_match, DASHBOARD_MAX_IF_NONE_MATCH + 1) > DASHBOARD_MAX_IF_NONE_MATCH)
        return false;
    const char *want = NULL;
    size_t want_len = opaque_tag(etag, &want);
    if (want_len == 0)
        return false;
    const char *p = if_none_match;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == ',')
            p++;
        if (*p == '\0')
            return false;
        if (*p == '*') {
            /* "*" only stands alone */
            const char *q = p + 1;
            while (*q == ' ' || *q == '\t')
                q++;
            return *q == '\0' && p == if_none_match + strspn(if_none_match, " \t");
        }
        const char *tag = NULL;
        size_t len = opaque_tag(p, &tag);
        if (len == 0)
            return false;
        if (len == want_len && memcmp(tag, want, len) == 0)
            return true;
        p = tag + len;
        while (*p == ' ' || *p == '\t')
            p++;
        if (*p != ',' && *p != '\0')
            return false;
    }
}
