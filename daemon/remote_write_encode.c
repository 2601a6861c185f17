/* Remote write: the [remote_write] settings, label and metric names, and the
 * request body (WriteRequest protobuf, snappy compressed). See
 * remote_write.h. */
#include "remote_write.h"

_Static_assert(RW_MAX_TARGETS == STATS_MAX_RW_TARGETS, "a stats slot per target");
_Static_assert(RW_NAME_MAX == sizeof(((struct fs_rw_stats *)0)->name), "target names fit");

#include <curl/curl.h>
#include <errno.h>
#include <snappy-c.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fs_grow.h"
#include "fs_index.h"
#include "remote_write.pb-c.h"

/* --- configuration ----------------------------------------------------------------------- */

#define RFIELD(f)                                                                                  \
    .offset = offsetof(struct rw_target, f), .size = sizeof(((struct rw_target *)0)->f)

static const char *const bool_names[] = {"false", "true", NULL};

static const struct config_key rw_keys[] = {
    {.name = "url",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_URL_MAX - 1,
     RFIELD(url),
     .help = "remote-write endpoint, e.g. http://prometheus:9090/api/v1/write (required)"},
    {.name = "bearer_token_file",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_PATH_MAX - 1,
     RFIELD(bearer_token_file),
     .help = "file holding a bearer token sent as Authorization: Bearer"},
    {.name = "basic_auth_user",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_AUTH_MAX - 1,
     RFIELD(basic_user),
     .help = "HTTP basic auth user (with basic_auth_password_file)"},
    {.name = "basic_auth_password_file",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_PATH_MAX - 1,
     RFIELD(basic_password_file),
     .help = "file holding the basic auth password"},
    {.name = "tenant",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_AUTH_MAX - 1,
     RFIELD(tenant),
     .help = "tenant sent as X-Scope-OrgID (Mimir, Cortex; empty: none)"},
    {.name = "tls_ca",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_PATH_MAX - 1,
     RFIELD(tls_ca),
     .help = "CA bundle (PEM) that verifies the receiver (empty: the system's)"},
    {.name = "tls_cert",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_PATH_MAX - 1,
     RFIELD(tls_cert),
     .help = "client certificate (PEM), with tls_key"},
    {.name = "tls_key",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_PATH_MAX - 1,
     RFIELD(tls_key),
     .help = "client key (PEM), with tls_cert"},
    {.name = "batch_samples",
     .type = CONFIG_UINT,
     .def = "5000",
     .min = 1,
     .max = 1000000,
     RFIELD(batch_samples),
     .help = "samples per request (whole steps, so a step above it goes whole)"},
    {.name = "timeout",
     .type = CONFIG_DOUBLE,
     .def = "30",
     .min = 0.1,
     .max = 600,
     RFIELD(timeout_s),
     .help = "seconds one request may take"},
    {.name = "labels",
     .type = CONFIG_STRING,
     .def = "",
     .max = RW_LABELS_MAX - 1,
     RFIELD(labels),
     .help = "job labels on every series, e.g. cluster=a,team=b"},
    {.name = "per_head",
     .type = CONFIG_ENUM,
     .def = "false",
     .choices = bool_names,
     RFIELD(per_head),
     .help = "also send each head's own series (cardinality: layers x heads x windows)"},
};

static void *target_open(void *ctx, const char *sub, struct fs_err *why)
{
    struct rw_config *rc = ctx;
    const char *name = sub ? sub : "default";
    if (!name[0] || strlen(name) >= RW_NAME_MAX) {
        fs_err_set(why, -EINVAL, "name empty or longer than %u bytes", RW_NAME_MAX - 1);
        return NULL;
    }
    for (const char *c = name; *c; c++) {
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '_' || *c == '-' || *c == '.')) {
            fs_err_set(why, -EINVAL, "name may hold letters, digits, '_', '-' and '.' only");
            return NULL;
        }
    }
    for (size_t i = 0; i < rc->n; i++) {
        if (strcmp(rc->t[i].name, name) == 0) {
            fs_err_set(why, -EINVAL, "remote write target '%s' defined twice", name);
            return NULL;
        }
    }
    if (rc->n >= RW_MAX_TARGETS) {
        fs_err_set(why, -EINVAL, "more than %u remote write targets", RW_MAX_TARGETS);
        return NULL;
    }
    struct rw_target *t = &rc->t[rc->n];
    memset(t, 0, sizeof(*t));
    if (config_apply_defaults(rw_keys, sizeof(rw_keys) / sizeof(rw_keys[0]), t, why) < 0)
        return NULL;
    snprintf(t->name, sizeof(t->name), "%s", name);
    rc->n++;
    return t;
}

void rw_config_section(struct rw_config *rc, struct config_section *out)
{
    memset(rc, 0, sizeof(*rc));
    *out = (struct config_section){.name = "remote_write",
                                   .keys = rw_keys,
                                   .nkeys = sizeof(rw_keys) / sizeof(rw_keys[0]),
                                   .open = target_open,
                                   .ctx = rc};
}

static const char *const reserved_labels[] = {"run",    "attempt",    "layer",      "head",
                                              "window", "rank",       "alertname",  "severity",
                                              "family", "alertstate", "job_attempt"};

static int label_name_ok(const char *s, size_t n)
{
    if (n == 0 || n >= RW_LABEL_NAME_MAX)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        if (!alpha && !(i > 0 && c >= '0' && c <= '9'))
            return 0;
    }
    return 1;
}

int rw_parse_labels(const char *text, struct rw_label *out, size_t max, struct fs_err *err)
{
    size_t n = 0;
    const char *p = text;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        if (!eq)
            return fs_err_set(err, -EINVAL, "label '%.*s' is not name=value", (int)len, p);
        size_t nlen = (size_t)(eq - p), vlen = len - nlen - 1;
        if (!label_name_ok(p, nlen) || (nlen >= 2 && p[0] == '_' && p[1] == '_'))
            return fs_err_set(err, -EINVAL,
                              "label name '%.*s' is not [a-zA-Z_][a-zA-Z0-9_]* "
                              "(at most %u bytes, no leading __)",
                              (int)nlen, p, RW_LABEL_NAME_MAX - 1);
        if (vlen == 0 || vlen >= RW_LABEL_VALUE_MAX)
            return fs_err_set(err, -EINVAL, "label '%.*s': value empty or over %u bytes", (int)nlen,
                              p, RW_LABEL_VALUE_MAX - 1);
        for (size_t i = 0; i < sizeof(reserved_labels) / sizeof(reserved_labels[0]); i++)
            if (strlen(reserved_labels[i]) == nlen && memcmp(reserved_labels[i], p, nlen) == 0)
                return fs_err_set(err, -EINVAL, "label '%s' is set by the daemon",
                                  reserved_labels[i]);
        for (size_t i = 0; i < n; i++)
            if (strlen(out[i].name) == nlen && memcmp(out[i].name, p, nlen) == 0)
                return fs_err_set(err, -EINVAL, "label '%.*s' given twice", (int)nlen, p);
        if (n == max)
            return fs_err_set(err, -EINVAL, "more than %zu labels", max);
        memcpy(out[n].name, p, nlen);
        out[n].name[nlen] = '\0';
        memcpy(out[n].value, eq + 1, vlen);
        out[n].value[vlen] = '\0';
        n++;
        p += len;
        if (*p == ',') {
            p++;
            if (!*p)
                return fs_err_set(err, -EINVAL, "labels end with ','");
        }
    }
    return (int)n;
}

static int file_ok(const char *path, const char *key, const char *where, struct fs_err *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return fs_err_set(err, -EINVAL, "%s %s: cannot read %s: %s", where, key, path,
                          strerror(errno));
    fclose(f);
    return 0;
}

static int target_check(struct rw_target *t, const char *where, struct fs_err *err)
{
    t->n_job_labels = 0;
    if (!t->url[0])
        return fs_err_set(err, -EINVAL, "%s key 'url' is required", where);
    if (strncmp(t->url, "http://", 7) != 0 && strncmp(t->url, "https://", 8) != 0)
        return fs_err_set(err, -EINVAL, "%s url must start with http:// or https://", where);
    CURLU *u = curl_url();
    int bad = !u || curl_url_set(u, CURLUPART_URL, t->url, 0) != CURLUE_OK;
    curl_url_cleanup(u);
    if (bad)
        return fs_err_set(err, -EINVAL, "%s url is not a valid URL", where);
    if (t->bearer_token_file[0] && t->basic_user[0])
        return fs_err_set(err, -EINVAL,
                          "%s bearer_token_file and basic_auth_user exclude each other", where);
    if (!t->basic_user[0] != !t->basic_password_file[0])
        return fs_err_set(err, -EINVAL,
                          "%s basic_auth_user and basic_auth_password_file go together", where);
    for (const char *c = t->tenant; *c; c++)
        if ((unsigned char)*c <= ' ' || *c == 0x7f)
            return fs_err_set(err, -EINVAL, "%s tenant holds a space or control byte", where);
    if (!t->tls_cert[0] != !t->tls_key[0])
        return fs_err_set(err, -EINVAL, "%s tls_cert and tls_key go together", where);
    const struct {
        const char *key, *path;
    } files[] = {{"bearer_token_file", t->bearer_token_file},
                 {"basic_auth_password_file", t->basic_password_file},
                 {"tls_ca", t->tls_ca},
                 {"tls_cert", t->tls_cert},
                 {"tls_key", t->tls_key}};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++)
        if (files[i].path[0] && file_ok(files[i].path, files[i].key, where, err) < 0)
            return -EINVAL;
    struct fs_err why = {0};
    int n = rw_parse_labels(t->labels, t->job_labels, RW_JOB_LABELS_MAX, &why);
    if (n < 0)
        return fs_err_set(err, -EINVAL, "%s labels: %s", where, why.msg);
    t->n_job_labels = (size_t)n;
    return 0;
}

int rw_config_check(struct rw_config *rc, struct fs_err *err)
{
    for (size_t i = 0; i < rc->n; i++) {
        char where[FS_CONFIG_MAX_PATH + RW_NAME_MAX + 64];
        snprintf(where, sizeof(where), "config: %s: [remote_write \"%s\"]",
                 rc->origin[0] ? rc->origin : "config", rc->t[i].name);
        if (target_check(&rc->t[i], where, err) < 0)
            return -EINVAL;
    }
    return 0;
}

int rw_metric_name(const char *series, const char *suffix, char *out, size_t len)
{
    int n = snprintf(out, len, "foreshock_%s%s", series, suffix);
    if (n < 0 || (size_t)n >= len)
        return -ENOSPC;
    for (char *c = out; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '_'))
            *c = '_';
    return 0;
}

enum rw_outcome rw_classify(long http_status)
{
    if (http_status >= 200 && http_status < 300)
        return RW_SENT;
    if (http_status == 0 || http_status == 429 || http_status >= 500)
        return RW_RETRY;
    return RW_REJECTED; /* 1xx, 3xx (not followed), other 4xx: resending would not help */
}

/* --- the batch --------------------------------------------------------------------------- */

struct rw_series {
    size_t nlabels;
    struct rw_label *labels; /* sorted by name */
    uint64_t hash;
    size_t nsamples, cap;
    Fsrw__Sample *samples;
};

/* The last timestamp sent for a series (by label hash). */
struct rw_last {
    uint64_t hash;
    int64_t ts;
};

struct rw_batch {
    size_t n, cap;
    struct rw_series *s;
    struct fs_index ix; /* over s, by hash */
    size_t samples;
    /* Kept across batches (rw_batch_clear leaves them): a series'
     * timestamps must rise (rw_batch_add). At most RW_LAST_TS_MAX, then
     * all forgotten. */
    size_t nlast, caplast;
    struct rw_last *last;
    struct fs_index last_ix; /* over last, by hash */
};

static uint64_t series_hash(const void *owner, size_t pos)
{
    return ((const struct rw_series *)owner)[pos].hash;
}

static uint64_t last_hash(const void *owner, size_t pos)
{
    return ((const struct rw_last *)owner)[pos].hash;
}

struct rw_batch *rw_batch_new(void)
{
    return calloc(1, sizeof(struct rw_batch));
}

void rw_batch_clear(struct rw_batch *b)
{
    for (size_t i = 0; i < b->n; i++) {
        free(b->s[i].labels);
        free(b->s[i].samples);
    }
    b->n = 0;
    b->samples = 0;
    fs_index_clear(&b->ix);
}

void rw_batch_free(struct rw_batch *b)
{
    if (!b)
        return;
    rw_batch_clear(b);
    free(b->s);
    fs_index_free(&b->ix);
    free(b->last);
    fs_index_free(&b->last_ix);
    free(b);
}

size_t rw_batch_samples(const struct rw_batch *b)
{
    return b->samples;
}

size_t rw_batch_series(const struct rw_batch *b)
{
    return b->n;
}

static int label_cmp(const void *a, const void *b)
{
    return strcmp(((const struct rw_label *)a)->name, ((const struct rw_label *)b)->name);
}

static int same_labels(const struct rw_series *s, const struct rw_label *l, size_t n)
{
    if (s->nlabels != n)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (strcmp(s->labels[i].name, l[i].name) || strcmp(s->labels[i].value, l[i].value))
            return 0;
    return 1;
}

/* The last-timestamp entry of hash h, added with INT64_MIN when new; NULL
 * when out of memory. */
static struct rw_last *last_of(struct rw_batch *b, uint64_t h)
{
    uint32_t at;
    for (size_t j = fs_index_start(&b->last_ix, h); (at = fs_index_at(&b->last_ix, j));
         j = fs_index_next(&b->last_ix, j))
        if (b->last[at - 1].hash == h)
            return &b->last[at - 1];
    if (b->nlast >= RW_LAST_TS_MAX) { /* bounded memory: forget them all */
        b->nlast = 0;
        fs_index_clear(&b->last_ix);
    }
    struct rw_last *v = fs_grow(b->last, &b->caplast, b->nlast + 1, sizeof(*v), 1024);
    if (!v)
        return NULL;
    b->last = v;
    if (fs_index_reserve(&b->last_ix, b->nlast, 2048, last_hash, b->last) < 0)
        return NULL;
    b->last[b->nlast] = (struct rw_last){.hash = h, .ts = INT64_MIN};
    fs_index_add(&b->last_ix, h, b->nlast);
    return &b->last[b->nlast++];
}

/* The series of these sorted labels, added empty when new; NULL when out of
 * memory. */
static struct rw_series *series_of(struct rw_batch *b, const struct rw_label *l, size_t n,
                                   uint64_t h)
{
    uint32_t at;
    for (size_t j = fs_index_start(&b->ix, h); (at = fs_index_at(&b->ix, j));
         j = fs_index_next(&b->ix, j))
        if (b->s[at - 1].hash == h && same_labels(&b->s[at - 1], l, n))
            return &b->s[at - 1];
    struct rw_series *v = fs_grow(b->s, &b->cap, b->n + 1, sizeof(*v), 64);
    if (!v)
        return NULL;
    b->s = v;
    if (fs_index_reserve(&b->ix, b->n, 128, series_hash, b->s) < 0)
        return NULL;
    struct rw_series *s = &b->s[b->n];
    memset(s, 0, sizeof(*s));
    s->labels = malloc(n * sizeof(*s->labels));
    if (!s->labels)
        return NULL;
    memcpy(s->labels, l, n * sizeof(*l));
    s->nlabels = n;
    s->hash = h;
    fs_index_add(&b->ix, h, b->n++);
    return s;
}

int rw_batch_add(struct rw_batch *b, const struct rw_label *labels, size_t n, int64_t ts_ms,
                 double value)
{
    struct rw_label sorted[RW_JOB_LABELS_MAX + 16];
    if (n > sizeof(sorted) / sizeof(sorted[0]))
        return -E2BIG;
    memcpy(sorted, labels, n * sizeof(*labels));
    qsort(sorted, n, sizeof(*sorted), label_cmp);
    uint64_t h = FS_FNV1A_BASIS;
    for (size_t i = 0; i < n; i++) /* names and values with their NULs: unambiguous */
        h = fs_fnv1a(fs_fnv1a(h, sorted[i].name, strlen(sorted[i].name) + 1), sorted[i].value,
                     strlen(sorted[i].value) + 1);
    struct rw_last *last = last_of(b, h);
    struct rw_series *s = last ? series_of(b, sorted, n, h) : NULL;
    if (!s)
        return -ENOMEM;
    if (ts_ms <= last->ts)
        ts_ms = last->ts + 1;
    Fsrw__Sample *v = fs_grow(s->samples, &s->cap, s->nsamples + 1, sizeof(*v), 8);
    if (!v)
        return -ENOMEM;
    s->samples = v;
    fsrw__sample__init(&s->samples[s->nsamples]);
    s->samples[s->nsamples].value = value;
    s->samples[s->nsamples].timestamp = ts_ms;
    s->nsamples++;
    b->samples++;
    last->ts = ts_ms;
    return 0;
}

int rw_batch_encode(const struct rw_batch *b, uint8_t **out, size_t *len)
{
    *out = NULL;
    *len = 0;
    int rc = -ENOMEM;
    size_t nlabels = 0;
    for (size_t i = 0; i < b->n; i++)
        nlabels += b->s[i].nlabels;
    Fsrw__TimeSeries *ts = calloc(b->n ? b->n : 1, sizeof(*ts));
    Fsrw__TimeSeries **tsp = calloc(b->n ? b->n : 1, sizeof(*tsp));
    Fsrw__Label *lab = calloc(nlabels ? nlabels : 1, sizeof(*lab));
    Fsrw__Label **labp = calloc(nlabels ? nlabels : 1, sizeof(*labp));
    Fsrw__Sample **sp = NULL;
    uint8_t *raw = NULL, *z = NULL;
    if (!ts || !tsp || !lab || !labp)
        goto out;
    sp = calloc(b->samples ? b->samples : 1, sizeof(*sp));
    if (!sp)
        goto out;
    size_t li = 0, si = 0;
    for (size_t i = 0; i < b->n; i++) {
        const struct rw_series *s = &b->s[i];
        fsrw__time_series__init(&ts[i]);
        tsp[i] = &ts[i];
        ts[i].n_labels = s->nlabels;
        ts[i].labels = &labp[li];
        for (size_t j = 0; j < s->nlabels; j++, li++) {
            fsrw__label__init(&lab[li]);
            lab[li].name = (char *)s->labels[j].name;
            lab[li].value = (char *)s->labels[j].value;
            labp[li] = &lab[li];
        }
        ts[i].n_samples = s->nsamples;
        ts[i].samples = &sp[si];
        for (size_t j = 0; j < s->nsamples; j++)
            sp[si++] = &s->samples[j];
    }
    Fsrw__WriteRequest req = FSRW__WRITE_REQUEST__INIT;
    req.n_timeseries = b->n;
    req.timeseries = tsp;
    size_t rawlen = fsrw__write_request__get_packed_size(&req);
    raw = malloc(rawlen ? rawlen : 1);
    if (!raw)
        goto out;
    fsrw__write_request__pack(&req, raw);
    size_t zlen = snappy_max_compressed_length(rawlen);
    z = malloc(zlen ? zlen : 1);
    if (!z)
        goto out;
    if (snappy_compress((const char *)raw, rawlen, (char *)z, &zlen) != SNAPPY_OK)
        goto out;
    *out = z;
    *len = zlen;
    z = NULL;
    rc = 0;
out:
    free(z);
    free(raw);
    free(sp);
    free(labp);
    free(lab);
    free(tsp);
    free(ts);
    return rc;
}
