/* Query parameters of the HTTP API: lookup and strict parsing.
 * http_dispatch (http_routes.c) has collected them and checked their names
 * against the route row; a reader here answers garbage with a 400 that
 * names the parameter. */

#include "http_internal.h"

const char *http_param_get(const struct ctx *c, const char *name)
{
    for (unsigned i = 0; i < c->nparams; i++)
        if (strcmp(c->params[i].name, name) == 0)
            return c->params[i].value;
    return NULL;
}

/* Strict integer: optional '-', then digits only, no blanks, no '+'. */
int http_parse_int64(const char *s, int64_t *out)
{
    if (!s || *s == '\0')
        return -EINVAL;
    const char *p = s[0] == '-' ? s + 1 : s;
    if (*p == '\0')
        return -EINVAL;
    for (const char *q = p; *q; q++)
        if (*q < '0' || *q > '9')
            return -EINVAL;
    errno = 0;
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    if (errno == ERANGE)
        return -ERANGE;
    if (end == s || *end != '\0')
        return -EINVAL;
    *out = (int64_t)v;
    return 0;
}

/* Reads integer parameter `name` in [min, max]. Absent: *out = def and
 * *present = false. Garbage: a 400 naming the parameter, returns -EINVAL. */
int http_param_int(struct ctx *c, const char *name, int64_t min, int64_t max, int64_t def,
                   int64_t *out, bool *present)
{
    const char *s = http_param_get(c, name);
    if (present)
        *present = s != NULL;
    if (!s) {
        *out = def;
        return 0;
    }
    int64_t v = 0;
    if (http_parse_int64(s, &v) != 0 || v < min || v > max) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "parameter '%s' must be an integer in %" PRId64 "..%" PRId64, name, min,
                         max);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

int http_param_limit(struct ctx *c, int64_t *out)
{
    return http_param_int(c, "limit", 1, HTTP_MAX_LIMIT, HTTP_DEFAULT_LIMIT, out, NULL);
}

/* Keyset cursor: the last id of the previous page, as a decimal string. */
int http_param_after(struct ctx *c, int64_t *out)
{
    const char *s = http_param_get(c, "after");
    int64_t v = 0;
    if (!s) {
        *out = 0;
        return 0;
    }
    if (http_parse_int64(s, &v) != 0 || v < 0) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                         "parameter 'after' must be a cursor returned as 'next' by an "
                         "earlier page");
        return -EINVAL;
    }
    *out = v;
    return 0;
}

/* A text parameter; empty is garbage (every text filter names something). */
int http_param_text(struct ctx *c, const char *name, bool required, const char **out)
{
    const char *s = http_param_get(c, name);
    *out = s;
    if (!s && !required)
        return 0;
    if (!s) {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request", "parameter '%s' is required",
                         name);
        return -EINVAL;
    }
    if (*s == '\0') {
        http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request", "parameter '%s' must not be empty",
                         name);
        return -EINVAL;
    }
    return 0;
}

/* Newest-first keyset cursor: absent -> INT64_MAX (no upper bound). */
int http_param_before(struct ctx *c, int64_t *out)
{
    if (!(http_param_get(c, "after"))) {
        *out = INT64_MAX;
        return 0;
    }
    return http_param_after(c, out);
}

/* Writes "a, b, c" of names[0..n) into buf (for error messages). */
void http_join_names(const char *const *names, size_t n, char *buf, size_t len)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n && used < len; i++) {
        int w = snprintf(buf + used, len - used, "%s%s", i > 0 ? ", " : "", names[i]);
        if (w < 0)
            break;
        used += (size_t)w;
    }
}

/* A text parameter that must be one of names[0..n). Absent: *out = NULL. */
int http_param_enum(struct ctx *c, const char *name, const char *const *names, size_t n,
                    const char **out)
{
    const char *s = http_param_get(c, name);
    *out = s;
    if (!s)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0)
            return 0;
    char list[256];
    http_join_names(names, n, list, sizeof list);
    http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request", "parameter '%s' must be one of: %s",
                     name, list);
    return -EINVAL;
}

int http_param_enum_set(struct ctx *c, const char *name, const char *const *names, size_t n,
                        uint32_t *set)
{
    *set = 0;
    for (unsigned i = 0; i < c->nparams; i++) {
        if (strcmp(c->params[i].name, name) != 0)
            continue;
        const char *p = c->params[i].value;
        for (;;) {
            size_t len = strcspn(p, ",");
            size_t k = 0;
            while (k < n && (strlen(names[k]) != len || strncmp(p, names[k], len) != 0))
                k++;
            if (k == n || k >= 32) {
                char list[256];
                http_join_names(names, n, list, sizeof list);
                http_reply_error(c, MHD_HTTP_BAD_REQUEST, "bad_request",
                                 "parameter '%s' must be one of: %s (repeated or "
                                 "comma-separated)",
                                 name, list);
                return -EINVAL;
            }
            *set |= 1u << k;
            if (p[len] == '\0')
                break;
            p += len + 1;
        }
    }
    return 0;
}
