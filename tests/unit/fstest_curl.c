/* fstest.h: HTTP requests through libcurl, answers parsed by jansson. */
#include "fstest.h"

#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

size_t on_body(char *p, size_t sz, size_t n, void *ud)
{
    struct resp *r = ud;
    size_t add = sz * n;
    if (r->len + add > RESP_MAX_BODY)
        return 0;
    char *b = realloc(r->body, r->len + add + 1);
    if (!b)
        return 0;
    memcpy(b + r->len, p, add);
    r->len += add;
    b[r->len] = '\0';
    r->body = b;
    return add;
}

/* "Name: value\r\n" into out (cap bytes) when line is the header `name`. */
static void header_value(const char *line, size_t len, const char *name, char *out, size_t cap)
{
    size_t nl = strlen(name);
    if (len <= nl || strncasecmp(line, name, nl) != 0)
        return;
    const char *v = line + nl;
    size_t vl = len - nl;
    while (vl > 0 && (*v == ' '))
        v++, vl--;
    while (vl > 0 && (v[vl - 1] == '\r' || v[vl - 1] == '\n'))
        vl--;
    if (vl >= cap)
        vl = cap - 1;
    memcpy(out, v, vl);
    out[vl] = '\0';
}

static size_t on_header(char *p, size_t sz, size_t n, void *ud)
{
    struct resp *r = ud;
    header_value(p, sz * n, "Allow:", r->allow, sizeof(r->allow));
    header_value(p, sz * n, "Content-Type:", r->ctype, sizeof(r->ctype));
    return sz * n;
}

void resp_free(struct resp *r)
{
    json_decref(r->json);
    free(r->body);
    memset(r, 0, sizeof(*r));
}

void request_at(unsigned short port, CURL *h, const char *method, const char *path,
                const char *body, struct resp *r)
{
    memset(r, 0, sizeof(*r));
    CURL *c = h ? h : curl_easy_init();
    cr_assert_not_null(c);
    char url[2048];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u%s", port, path);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 60L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    if (body) {
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    } else {
        curl_easy_setopt(c, CURLOPT_HTTPGET, 1L); /* also resets NOBODY: set below */
    }
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(c, CURLOPT_NOBODY, method && strcmp(method, "HEAD") == 0 ? 1L : 0L);
    CURLcode rc = curl_easy_perform(c);
    cr_assert_eq(rc, CURLE_OK, "%s: %s", path, curl_easy_strerror(rc));
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    curl_easy_getinfo(c, CURLINFO_NUM_CONNECTS, &r->new_conns);
    if (!h)
        curl_easy_cleanup(c);
    if (r->body) {
        json_error_t e;
        r->json = json_loads(r->body, 0, &e);
    }
}

json_t *get_json_at(unsigned short port, const char *path, long status, struct resp *r)
{
    request_at(port, NULL, NULL, path, NULL, r);
    cr_assert_eq(r->status, status, "GET %s: status %ld, expected %ld: %s", path, r->status, status,
                 r->body ? r->body : "");
    cr_assert_not_null(r->json, "GET %s: body is not JSON: %s", path, r->body ? r->body : "");
    cr_assert_str_eq(r->ctype, "application/json", "GET %s: content type %s", path, r->ctype);
    return r->json;
}

int64_t jint(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_integer(v), "'%s' is not an integer", key);
    return (int64_t)json_integer_value(v);
}

double jnum(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "'%s' is not a number", key);
    return json_number_value(v);
}

const char *jstr(json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    cr_assert_not_null(s, "'%s' is not a string", key);
    return s;
}
