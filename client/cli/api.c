/* GET + JSON against the daemon's HTTP API (libcurl, jansson). */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* Largest response body accepted (a page of 10,000 points is ~400 KB). */
#define API_MAX_BODY ((size_t)256 << 20)
#define API_TIMEOUT_S 120L
#define API_CONNECT_TIMEOUT_S 10L

struct api {
    CURL *curl;
    char base[CLI_MAX_HOSTPORT + 16]; /* "http://HOST:PORT" */
    char auth[CLI_MAX_TOKEN + 32];    /* "Authorization: Bearer T", or "" */
};

struct body {
    char *data;
    size_t len, cap;
    int too_big;
};

static size_t on_data(char *p, size_t size, size_t nmemb, void *ud)
{
    struct body *b = ud;
    size_t n = size * nmemb;

    if (n > API_MAX_BODY - b->len) {
        b->too_big = 1;
        return 0; /* aborts the transfer */
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 16384;
        char *d;
        while (cap < b->len + n + 1)
            cap *= 2;
        d = realloc(b->data, cap);
        if (!d)
            return 0;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
    return n;
}

int api_open(const char *http, struct api **out, char *err, size_t errlen)
{
    struct api *a;
    char host[CLI_MAX_HOSTPORT];
    uint16_t port;

    if (args_hostport(http, host, sizeof(host), &port) < 0) {
        snprintf(err, errlen, "--http '%s' is not HOST:PORT", http);
        return CLI_FAIL;
    }
    a = calloc(1, sizeof(*a));
    if (!a || !(a->curl = curl_easy_init())) {
        free(a);
        snprintf(err, errlen, "cannot initialise libcurl");
        return CLI_FAIL;
    }
    snprintf(a->base, sizeof(a->base), "http://%s:%u", host, (unsigned)port);
    api_set_token(a, getenv("FORESHOCK_TOKEN"));
    *out = a;
    return 0;
}

void api_set_token(struct api *a, const char *token)
{
    if (token && *token && strlen(token) <= CLI_MAX_TOKEN)
        snprintf(a->auth, sizeof(a->auth), "Authorization: Bearer %s", token);
    else
        a->auth[0] = '\0';
}

void api_close(struct api *a)
{
    if (!a)
        return;
    curl_easy_cleanup(a->curl);
    free(a);
}

char *api_escape(struct api *a, const char *s)
{
    return curl_easy_escape(a->curl, s, 0);
}

void api_free_escaped(char *s)
{
    curl_free(s);
}

/* The server's {"error":{"message":...}} text, or a generic one. */
static void error_text(const struct body *b, long status, char *err, size_t errlen)
{
    json_t *doc = b->data ? json_loadb(b->data, b->len, 0, NULL) : NULL;
    const char *msg = NULL;

    if (doc)
        msg = json_string_value(json_object_get(json_object_get(doc, "error"), "message"));
    if (msg)
        snprintf(err, errlen, "%s (HTTP %ld)", msg, status);
    else
        snprintf(err, errlen, "server answered HTTP %ld", status);
    json_decref(doc);
}

int api_get(struct api *a, const char *path, json_t **out, char *err, size_t errlen)
{
    return api_request(a, "GET", path, NULL, out, err, errlen);
}

int api_request(struct api *a, const char *method, const char *path, const char *body, json_t **out,
                char *err, size_t errlen)
{
    struct curl_slist *hdr = NULL;
    struct body b = {0};
    char url[8192];
    long status = 0;
    json_error_t jerr;
    CURLcode cc;
    int rc = CLI_FAIL;

    if ((size_t)snprintf(url, sizeof(url), "%s%s", a->base, path) >= sizeof(url)) {
        snprintf(err, errlen, "request URL too long");
        return CLI_FAIL;
    }
    curl_easy_reset(a->curl);
    curl_easy_setopt(a->curl, CURLOPT_URL, url);
    curl_easy_setopt(a->curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(a->curl, CURLOPT_TIMEOUT, API_TIMEOUT_S);
    curl_easy_setopt(a->curl, CURLOPT_CONNECTTIMEOUT, API_CONNECT_TIMEOUT_S);
    curl_easy_setopt(a->curl, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(a->curl, CURLOPT_WRITEDATA, &b);
    if (strcmp(method, "GET") != 0)
        curl_easy_setopt(a->curl, CURLOPT_CUSTOMREQUEST, method);
    if (body) {
        hdr = curl_slist_append(hdr, "Content-Type: application/json");
        curl_easy_setopt(a->curl, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(a->curl, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    }
    if (a->auth[0])
        hdr = curl_slist_append(hdr, a->auth);
    if (hdr)
        curl_easy_setopt(a->curl, CURLOPT_HTTPHEADER, hdr);
    cc = curl_easy_perform(a->curl);
    if (cc != CURLE_OK) {
        if (b.too_big)
            snprintf(err, errlen, "response from %s larger than %zu bytes", a->base, API_MAX_BODY);
        else
            snprintf(err, errlen, "cannot reach %s: %s", a->base, curl_easy_strerror(cc));
        goto out;
    }
    curl_easy_getinfo(a->curl, CURLINFO_RESPONSE_CODE, &status);
    if (status >= 400) {
        error_text(&b, status, err, errlen);
        goto out;
    }
    *out = json_loadb(b.data ? b.data : "", b.len, 0, &jerr);
    if (!*out) {
        snprintf(err, errlen, "invalid JSON from %s%s: %s", a->base, path, jerr.text);
        goto out;
    }
    rc = 0;
out:
    curl_slist_free_all(hdr);
    free(b.data);
    return rc;
}
