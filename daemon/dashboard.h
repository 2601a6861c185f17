#ifndef FORESHOCK_DASHBOARD_H
#define FORESHOCK_DASHBOARD_H

#include <stdbool.h>
#include <stddef.h>

/* The dashboard's static files (dashboard/ and the Debian libjs-dygraphs
 * files), embedded into the binary at build time by dashboard/embed.cmake.
 * Everything here is pure and read-only: any thread may call it. */

#define DASHBOARD_STATIC_PREFIX "/static/"
#define DASHBOARD_INDEX "index.html"      /* the asset served at "/" */
#define DASHBOARD_MAX_NAME 64u            /* bytes of an asset name; longer is "no such asset" */
#define DASHBOARD_MAX_IF_NONE_MATCH 1024u /* bytes of If-None-Match examined; past it: no match */

/* Revalidate every time: asset names carry no version, so a daemon upgrade
 * must not leave a stale app.js cached; the ETag keeps revalidation cheap
 * (304, no body). */
#define DASHBOARD_CACHE_CONTROL "no-cache"

/* Content-Security-Policy of every dashboard file: the page loads nothing
 * from anywhere but this daemon (dygraphs sets inline styles). */
#define DASHBOARD_CSP                                                                              \
    "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "                 \
    "frame-ancestors 'none'"

struct dashboard_asset {
    const char *name;          /* file name, served as /static/NAME */
    const unsigned char *data; /* static storage, never freed */
    size_t len;
    const char *etag; /* strong ETag, quoted: "\"0123...\"" */
};

/* Generated table (build tree: dashboard_assets.c). */
extern const struct dashboard_asset dashboard_assets[];
extern const size_t dashboard_asset_count;

/* What a request path resolves to. Every pointer is static storage. */
struct dashboard_file {
    const unsigned char *data;
    size_t len;
    const char *content_type;
    const char *etag;
    const char *cache_control;
};

/* Resolves a request path in assets[0..n): "/" is DASHBOARD_INDEX,
 * "/static/NAME" is the asset NAME (one path segment). Returns 0 and fills
 * *out, or -ENOENT for anything else. Pure. */
int dashboard_lookup_in(const struct dashboard_asset *assets, size_t n, const char *path,
                        struct dashboard_file *out);

/* dashboard_lookup_in() over the embedded table. */
int dashboard_lookup(const char *path, struct dashboard_file *out);

/* Content-Type for a file name, by its extension (with a charset for text);
 * "application/octet-stream" when unknown. Returns static storage. */
const char *dashboard_content_type(const char *name);

/* True when an If-None-Match header value (NULL: absent) matches etag under
 * the weak comparison RFC 9110 section 13.1.2 prescribes for it: "*", or any
 * listed entity-tag whose opaque part equals etag's (a W/ prefix ignored on
 * either side). A malformed list matches nothing, so the full body is sent. */
bool dashboard_etag_match(const char *if_none_match, const char *etag);

#endif
