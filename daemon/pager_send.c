/* One delivery: the receiver's payload (page_format.c) POSTed with
 * libcurl, cut short by pager_stop. See pager_internal.h. */
#include "fs_clock.h"

#include <curl/curl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager_internal.h"

/* --- HTTP ------------------------------------------------------------------------------------- */

struct resp {
    char body[PAGER_RESPONSE_KEEP + 1];
    size_t len;
};

static size_t on_body(char *data, size_t size, size_t n, void *ctx)
{
    struct resp *r = ctx;
    size_t b = size * n, keep = PAGER_RESPONSE_KEEP - r->len;
    if (keep > b)
        keep = b;
    memcpy(r->body + r->len, data, keep);
    r->len += keep;
    r->body[r->len] = '\0';
    return b;
}

/* libcurl's progress hook (at least once a second, also while waiting for
 * an answer): pager_stop ends a request in flight instead of waiting out
 * its timeout. */
static int on_progress(void *ctx, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow)
{
    (void)dltotal, (void)dlnow, (void)ultotal, (void)ulnow;
    struct pager *p = ctx;
    return atomic_load(&p->stopping) ? 1 : 0;
}

/* Printable one-line copy of a response body for messages. */
static void oneline(char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || (unsigned char)*s >= 0x7f)
            *s = ' ';
}

/* POSTs body; *status is the HTTP status, or 0 after a transport error
 * (err says which; *permanent when retrying cannot help). */
static void post(struct pager *p, const struct pager_target_cfg *t, const char *url,
                 const char *body, long *status, int *permanent, char *err, size_t errlen)
{
    *status = 0;
    *permanent = 0;
    err[0] = '\0';
    CURL *c = p->curl;
    curl_easy_reset(c);
    struct curl_slist *h = NULL, *h2;
    struct resp resp = {.len = 0};
    char sig[128], ts[64], ua[64];
    snprintf(ua, sizeof(ua), "User-Agent: foreshockd/%s", FORESHOCK_VERSION);
    h2 = curl_slist_append(h, "Content-Type: application/json");
    if (h2)
        h = h2;
    if ((h2 = curl_slist_append(h, ua)))
        h = h2;
    if ((h2 = curl_slist_append(h, "Expect:")))
        h = h2;
    if (t->type == PAGER_WEBHOOK && t->secret[0]) {
        char hex[65];
        if (page_hmac_sha256_hex(t->secret, strlen(t->secret), body, strlen(body), hex) < 0) {
            snprintf(err, errlen, "HMAC failed");
            curl_slist_free_all(h);
            return;
        }
        snprintf(sig, sizeof(sig), "X-Foreshock-Signature: sha256=%s", hex);
        snprintf(ts, sizeof(ts), "X-Foreshock-Timestamp: %lld", (long long)fs_clock_unix());
        if ((h2 = curl_slist_append(h, sig)))
            h = h2;
        if ((h2 = curl_slist_append(h, ts)))
            h = h2;
    }
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)(t->connect_timeout * 1000));
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)(t->timeout * 1000));
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &resp);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_XFERINFODATA, p);
    CURLcode rc = curl_easy_perform(c);
    curl_slist_free_all(h);
    if (rc != CURLE_OK) {
        snprintf(err, errlen, "%s", curl_easy_strerror(rc));
        *permanent = rc == CURLE_URL_MALFORMAT || rc == CURLE_UNSUPPORTED_PROTOCOL;
        return;
    }
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    if (*status < 200 || *status >= 300) {
        oneline(resp.body);
        snprintf(err, errlen, "HTTP %ld: %s", *status, resp.body);
    }
}

/* Builds the payload of page a for target t and sends it. Returns the
 * verdict; status/err as for post. */
enum page_verdict pager_send_page(struct pager *p, const struct pager_target_cfg *t,
                                  const struct page_alert *a, long *status, char *err,
                                  size_t errlen)
{
    char url[PAGE_URL_MAX + 32];
    char *body = NULL;
    double now = fs_clock_unix();
    switch (t->type) {
    case PAGER_ALERTMANAGER: {
        size_t n = strlen(t->url);
        while (n > 0 && t->url[n - 1] == '/')
            n--;
        snprintf(url, sizeof(url), "%.*s/api/v2/alerts", (int)n, t->url);
        body = page_alertmanager_body(a, p->public_url, now, t->resend_interval);
        break;
    }
    case PAGER_PAGERDUTY:
        snprintf(url, sizeof(url), "%s", t->url[0] ? t->url : PAGER_DEFAULT_PAGERDUTY_URL);
        body = page_pagerduty_body(a, t->routing_key, p->public_url);
        break;
    default:
        snprintf(url, sizeof(url), "%s", t->url);
        body = page_webhook_body(a, p->public_url);
        break;
    }
    if (!body) {
        *status = 0;
        snprintf(err, errlen, "out of memory building the payload");
        return PAGE_RETRY;
    }
    int permanent;
    post(p, t, url, body, status, &permanent, err, errlen);
    free(body);
    if (*status == 0)
        return permanent ? PAGE_GIVE_UP : PAGE_RETRY;
    return page_classify(*status);
}
