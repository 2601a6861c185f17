/* The pager's configuration: the [target "NAME"] section, its checks, and
 * the targets' names for the stats and the store. Main thread, at startup.
 * See pager.h. */
#include "pager.h"
#include "detect.h"

#include <curl/curl.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* --- configuration: [target "NAME"] ------------------------------------------------------ */

#define TFIELD(f)                                                                                  \
    .offset = offsetof(struct pager_target_cfg, f),                                                \
    .size = sizeof(((struct pager_target_cfg *)0)->f)

static const char *const type_names[] = {[PAGER_ALERTMANAGER] = "alertmanager",
                                         [PAGER_PAGERDUTY] = "pagerduty",
                                         [PAGER_WEBHOOK] = "webhook",
                                         NULL};

static const struct config_key target_keys[] = {
    {.name = "type",
     .type = CONFIG_ENUM,
     .def = NULL,
     .choices = type_names,
     TFIELD(type),
     .help = "alertmanager | pagerduty | webhook (required)"},
    {.name = "url",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = PAGE_URL_MAX - 1,
     TFIELD(url),
     .help = "Alertmanager base URL, PagerDuty events URL, or the webhook URL"},
    {.name = "routing_key",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = PAGER_ROUTING_KEY_MAX - 1,
     TFIELD(routing_key),
     .help = "PagerDuty integration (routing) key"},
    {.name = "secret",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = PAGER_SECRET_MAX - 1,
     TFIELD(secret),
     .help = "webhook HMAC-SHA256 key (empty: unsigned)"},
    {.name = "min_severity",
     .type = CONFIG_ENUM,
     .def = "warning",
     .choices = detect_severity_names,
     TFIELD(min_severity),
     .help = "warning | critical"},
    {.name = "match",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = PAGER_MATCH_MAX - 1,
     TFIELD(match),
     .help = "label filter, e.g. run=~gpt-.*,family=attention_d2"},
    {.name = "timeout",
     .type = CONFIG_DOUBLE,
     .def = "10",
     .min = 0.1,
     .max = 300,
     TFIELD(timeout),
     .help = "seconds a whole request may take"},
    {.name = "connect_timeout",
     .type = CONFIG_DOUBLE,
     .def = "5",
     .min = 0.1,
     .max = 300,
     TFIELD(connect_timeout),
     .help = "seconds to connect"},
    {.name = "backoff_initial",
     .type = CONFIG_DOUBLE,
     .def = "1",
     .min = 0.01,
     .max = 86400,
     TFIELD(backoff_initial),
     .help = "seconds before the first retry (doubles, jittered)"},
    {.name = "backoff_max",
     .type = CONFIG_DOUBLE,
     .def = "300",
     .min = 0.01,
     .max = 86400,
     TFIELD(backoff_max),
     .help = "longest wait between retries, seconds"},
    {.name = "give_up_after",
     .type = CONFIG_DOUBLE,
     .def = "86400",
     .min = 1,
     .max = 31536000,
     TFIELD(give_up_after),
     .help = "seconds after the transition a delivery is given up"},
    {.name = "resend_interval",
     .type = CONFIG_DOUBLE,
     .def = "60",
     .min = 0.1,
     .max = 86400,
     TFIELD(resend_interval),
     .help = "alertmanager: re-send firing alerts this often, seconds"},
};

const char *pager_type_name(int type)
{
    return type >= 0 && type <= PAGER_WEBHOOK ? type_names[type] : "unknown";
}

static void *target_open(void *ctx, const char *sub, struct fs_err *why)
{
    struct pager_config *pc = ctx;
    if (!sub || !sub[0]) {
        fs_err_set(why, -EINVAL, "needs a name: [target \"NAME\"]");
        return NULL;
    }
    if (strlen(sub) >= STATS_TARGET_NAME_MAX) {
        fs_err_set(why, -EINVAL, "name longer than %d bytes", STATS_TARGET_NAME_MAX - 1);
        return NULL;
    }
    for (const char *c = sub; *c; c++) {
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '_' || *c == '-' || *c == '.')) {
            fs_err_set(why, -EINVAL, "name may hold letters, digits, '_', '-' and '.' only");
            return NULL;
        }
    }
    for (size_t i = 0; i < pc->n; i++) {
        if (strcmp(pc->t[i].name, sub) == 0) {
            fs_err_set(why, -EINVAL, "target defined twice");
            return NULL;
        }
    }
    if (pc->n >= STATS_MAX_TARGETS) {
        fs_err_set(why, -EINVAL, "more than %d targets", STATS_MAX_TARGETS);
        return NULL;
    }
    struct pager_target_cfg *t = &pc->t[pc->n];
    memset(t, 0, sizeof(*t));
    t->type = -1;
    if (config_apply_defaults(target_keys, sizeof(target_keys) / sizeof(target_keys[0]), t, why) <
        0)
        return NULL;
    snprintf(t->name, sizeof(t->name), "%s", sub);
    pc->n++;
    return t;
}

void pager_target_section(struct pager_config *pc, struct config_section *out)
{
    *out = (struct config_section){.name = "target",
                                   .keys = target_keys,
                                   .nkeys = sizeof(target_keys) / sizeof(target_keys[0]),
                                   .open = target_open,
                                   .ctx = pc};
}

/* NULL when url parses with a host (and, for Alertmanager, a base URL
 * that "/api/v2/alerts" can follow: no query or fragment), else why not. */
static const char *url_problem(const char *url, int type)
{
    CURLU *u = curl_url();
    if (!u)
        return "out of memory checking 'url'";
    const char *why = NULL;
    char *host = NULL, *query = NULL, *frag = NULL;
    if (curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK)
        why = "key 'url' is not a valid URL";
    else if (curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK || !host || !host[0])
        why = "key 'url' has no host";
    else if (type == PAGER_ALERTMANAGER &&
             (curl_url_get(u, CURLUPART_QUERY, &query, 0) == CURLUE_OK ||
              curl_url_get(u, CURLUPART_FRAGMENT, &frag, 0) == CURLUE_OK))
        why = "key 'url': an Alertmanager base URL has no query or fragment";
    curl_free(host);
    curl_free(query);
    curl_free(frag);
    curl_url_cleanup(u);
    return why;
}

int pager_config_check(const struct pager_config *pc, struct fs_err *err)
{
    const char *origin = pc->origin[0] ? pc->origin : "config";
    for (size_t i = 0; i < pc->n; i++) {
        const struct pager_target_cfg *t = &pc->t[i];
        const char *why = NULL;
        struct fs_err buf = {0};
        struct silence m;
        if (t->type < 0)
            why = "key 'type' is required (alertmanager | pagerduty | webhook)";
        else if (t->type != PAGER_PAGERDUTY && !t->url[0])
            why = "key 'url' is required";
        else if (t->url[0] && strncmp(t->url, "http://", 7) != 0 &&
                 strncmp(t->url, "https://", 8) != 0)
            why = "key 'url' must start with http:// or https://";
        else if (t->url[0] && (why = url_problem(t->url, t->type)))
            ;
        else if (t->type == PAGER_PAGERDUTY && !t->routing_key[0])
            why = "key 'routing_key' is required for pagerduty";
        else if (t->type != PAGER_PAGERDUTY && t->routing_key[0])
            why = "key 'routing_key' applies to pagerduty targets only";
        else if (t->type != PAGER_WEBHOOK && t->secret[0])
            why = "key 'secret' applies to webhook targets only";
        else if (t->backoff_initial > t->backoff_max)
            why = "backoff_initial is larger than backoff_max";
        else if (page_parse_match(t->match, &m, &buf) < 0)
            why = buf.msg;
        else
            silence_free(&m);
        if (why)
            return fs_err_set(err, -EINVAL, "config: %s: [target \"%s\"]: %.299s", origin, t->name,
                              why);
    }
    return 0;
}

void pager_name_stats(const struct pager_config *cfg, struct fs_stats *stats)
{
    for (size_t i = 0; i < cfg->n && i < STATS_MAX_TARGETS; i++) {
        snprintf(stats->targets[i].name, sizeof(stats->targets[i].name), "%s", cfg->t[i].name);
        snprintf(stats->targets[i].kind, sizeof(stats->targets[i].kind), "%s",
                 pager_type_name(cfg->t[i].type));
    }
    stats->ntargets = (unsigned)(cfg->n < STATS_MAX_TARGETS ? cfg->n : STATS_MAX_TARGETS);
}

void pager_register(const struct pager_config *cfg, struct store *store)
{
    const char *names[STATS_MAX_TARGETS];
    for (size_t i = 0; i < cfg->n; i++)
        names[i] = cfg->t[i].name;
    store_set_pager(store, names, cfg->n, NULL, NULL);
}
