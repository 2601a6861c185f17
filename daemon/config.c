/* Table-driven INI-style configuration parser. Pure except config_load_file. */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "fs_grow.h"
#include "log.h"

#define FIELD(type, f) .offset = offsetof(type, f), .size = sizeof(((type *)0)->f)
#define CORE(f) FIELD(struct fs_config, f)

static const char *const sync_names[] = {
    [CONFIG_SYNC_NORMAL] = "normal", [CONFIG_SYNC_FULL] = "full", NULL};

static const struct config_key core_keys[] = {
    /* Defaults are text in file syntax; test_config checks them against FS_DEF_*. */
    {.name = "listen",
     .type = CONFIG_ENDPOINT,
     .def = FS_DEF_LISTEN,
     CORE(listen),
     .help = "ingest address HOST:PORT for trainer ranks (port 0: pick one)"},
    {.name = "http",
     .type = CONFIG_ENDPOINT,
     .def = FS_DEF_HTTP,
     CORE(http),
     .help = "HTTP API address HOST:PORT (port 0: pick one)"},
    {.name = "db",
     .type = CONFIG_STRING,
     .def = FS_DEF_DB,
     .min = 1,
     .max = FS_CONFIG_MAX_PATH - 1,
     CORE(db),
     .help = "SQLite database file (created if absent)"},
    {.name = "synchronous",
     .type = CONFIG_ENUM,
     .def = "normal",
     .choices = sync_names,
     CORE(synchronous),
     .help = "SQLite synchronous mode: normal | full (fsync every commit)"},
    {.name = "http_threads",
     .type = CONFIG_UINT,
     .def = "4",
     .min = FS_MIN_HTTP_THREADS,
     .max = FS_CAP_HTTP_THREADS,
     CORE(http_threads),
     .help = "HTTP worker threads, each with a read-only database connection"},
    {.name = "max_connections",
     .type = CONFIG_UINT,
     .def = "1024",
     .min = FS_MIN_MAX_CONNECTIONS,
     .max = FS_CAP_MAX_CONNECTIONS,
     CORE(max_connections),
     .help = "ingest connections; one more is refused with Error{ERROR_LIMIT}"},
    {.name = "max_unauthenticated",
     .type = CONFIG_UINT,
     .def = "256",
     .min = FS_MIN_MAX_CONNECTIONS,
     .max = FS_CAP_MAX_CONNECTIONS,
     CORE(max_unauthenticated),
     .help = "ingest connections in TLS handshake or before an accepted Hello, all "
             "addresses together; when full, the address holding the most loses its oldest"},
    {.name = "max_unauthenticated_per_address",
     .type = CONFIG_UINT,
     .def = "128",
     .min = FS_MIN_MAX_CONNECTIONS,
     .max = FS_CAP_MAX_CONNECTIONS,
     CORE(max_unauthenticated_per_address),
     .help = "of those, from one source address; one more from it is refused"},
    {.name = "max_frame_bytes",
     .type = CONFIG_BYTES,
     .def = "64M",
     .min = FS_MIN_MAX_FRAME_BYTES,
     .max = FS_CAP_MAX_FRAME_BYTES,
     CORE(max_frame_bytes),
     .help = "largest frame accepted, refused from its length prefix"},
    {.name = "max_runs",
     .type = CONFIG_UINT,
     .def = "10000",
     .min = FS_MIN_MAX_RUNS,
     .max = FS_CAP_MAX_RUNS,
     CORE(max_runs),
     .help = "live runs (reported, not ended); a Hello that would make one more gets "
             "ERROR_LIMIT"},
    {.name = "max_conn_buffer_bytes",
     .type = CONFIG_BYTES,
     .def = "1M",
     .min = FS_MIN_MAX_CONN_BUFFER_BYTES,
     .max = FS_CAP_MAX_CONN_BUFFER_BYTES,
     CORE(max_conn_buffer_bytes),
     .help = "unsent reply bytes per connection; a client that does not read is closed"},
    {.name = "frame_buffer_max_bytes",
     .type = CONFIG_BYTES,
     .def = "256M",
     .min = FS_MIN_FRAME_BUFFER_MAX_BYTES,
     .max = FS_CAP_FRAME_BUFFER_MAX_BYTES,
     CORE(frame_buffer_max_bytes),
     .help = "frames above 64K being read, total over all connections (>= max_frame_bytes); "
             "past it a connection waits for others to finish theirs"},
    {.name = "writer_queue_max_items",
     .type = CONFIG_UINT,
     .def = "16384",
     .min = FS_MIN_WRITER_QUEUE_MAX_ITEMS,
     .max = FS_CAP_WRITER_QUEUE_MAX_ITEMS,
     CORE(writer_queue_max_items),
     .help = "writer queue high watermark, items (ingest pauses; resumes at half)"},
    {.name = "writer_queue_max_bytes",
     .type = CONFIG_BYTES,
     .def = "256M",
     .min = FS_MIN_WRITER_QUEUE_MAX_BYTES,
     .max = FS_CAP_WRITER_QUEUE_MAX_BYTES,
     CORE(writer_queue_max_bytes),
     .help = "writer queue high watermark, bytes (ingest pauses; resumes at half)"},
    {.name = "writer_batch_max_items",
     .type = CONFIG_UINT,
     .def = "1024",
     .min = FS_MIN_WRITER_BATCH_MAX_ITEMS,
     .max = FS_CAP_WRITER_BATCH_MAX_ITEMS,
     CORE(writer_batch_max_items),
     .help = "items per write transaction at most"},
    {.name = "spool_max_bytes",
     .type = CONFIG_BYTES,
     .def = "1G",
     .min = FS_MIN_SPOOL_MAX_BYTES,
     .max = FS_CAP_SPOOL_MAX_BYTES,
     CORE(spool_max_bytes),
     .help = "spooled frames of steps not yet evaluated (in <db>.spool/); past it only ranks "
             "that complete the oldest step are read"},
    {.name = "spool_run_max_bytes",
     .type = CONFIG_BYTES,
     .def = "256M",
     .min = 0,
     .max = FS_CAP_SPOOL_MAX_BYTES,
     CORE(spool_run_max_bytes),
     .help = "spooled frames of one run's steps not yet evaluated (0: only spool_max_bytes); "
             "past it only that run's ranks that complete its oldest step are read"},
    {.name = "log_level",
     .type = CONFIG_ENUM,
     .def = "info",
     .choices = log_level_names,
     CORE(log_level),
     .help = "debug | info | warn | error"},
    {.name = "token",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_MAX_TOKEN_LEN,
     CORE(token),
     .help = "shared secret; when set, Hello.token must match (empty: none)"},
    {.name = "tls_cert",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_CONFIG_MAX_PATH - 1,
     CORE(tls_cert),
     .help = "PEM certificate (chain) of ingest; set with tls_key: ingest speaks only TLS"},
    {.name = "tls_key",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_CONFIG_MAX_PATH - 1,
     CORE(tls_key),
     .help = "PEM private key of tls_cert"},
    {.name = "tls_client_ca",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_CONFIG_MAX_PATH - 1,
     CORE(tls_client_ca),
     .help = "PEM CA bundle; set: every rank needs a client certificate it signed (mutual TLS)"},
    {.name = "http_tls_cert",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_CONFIG_MAX_PATH - 1,
     CORE(http_tls_cert),
     .help = "PEM certificate of the HTTP API; set with http_tls_key: HTTPS only"},
    {.name = "http_tls_key",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_CONFIG_MAX_PATH - 1,
     CORE(http_tls_key),
     .help = "PEM private key of http_tls_cert"},
    {.name = "reduce_timeout_s",
     .type = CONFIG_DOUBLE,
     .def = "120",
     .min = FS_MIN_REDUCE_TIMEOUT_S,
     .max = FS_CAP_REDUCE_TIMEOUT_S,
     CORE(reduce_timeout_s),
     .help = "seconds a step's shards/ranks may take before it is recorded incomplete"},
    {.name = "hello_timeout_s",
     .type = CONFIG_DOUBLE,
     .def = "10",
     .min = 0,
     .max = FS_CAP_INGEST_TIMEOUT_S,
     CORE(hello_timeout_s),
     .help = "seconds a new connection may take to send its Hello (0: no limit)"},
    {.name = "frame_timeout_s",
     .type = CONFIG_DOUBLE,
     .def = "120",
     .min = 0,
     .max = FS_CAP_INGEST_TIMEOUT_S,
     CORE(frame_timeout_s),
     .help = "seconds a begun frame may take to arrive whole (0: no limit)"},
    {.name = "shutdown_timeout_s",
     .type = CONFIG_DOUBLE,
     .def = "30",
     .min = 0,
     .max = FS_CAP_INGEST_TIMEOUT_S,
     CORE(shutdown_timeout_s),
     .help = "on SIGTERM, monitor math not started by then stays spooled for the next start "
             "(0: finish it all)"},
    {.name = "reduce_max_bytes",
     .type = CONFIG_BYTES,
     .def = "1G",
     .min = FS_MIN_REDUCE_MAX_BYTES,
     .max = FS_CAP_REDUCE_MAX_BYTES,
     CORE(reduce_max_bytes),
     .help = "memory for partial shard/rank sums; past it ingest pauses"},
    {.name = "max_run_bytes",
     .type = CONFIG_BYTES,
     .def = "64M",
     .min = FS_MIN_MAX_RUN_BYTES,
     .max = FS_CAP_MAX_RUN_BYTES,
     CORE(max_run_bytes),
     .help = "monitor memory per run: half for its detected series, a quarter for queued "
             "scalars; a Hello declaring a larger shape gets ERROR_LIMIT"},
    {.name = "detect_from_step",
     .type = CONFIG_UINT,
     .def = "0",
     .min = 0,
     .max = FS_CAP_DETECT_FROM_STEP,
     CORE(detect_from_step),
     .help = "detection starts at this step (0: by training progress, from the LR "
             "warm-up; a run's Hello overrides it)"},
    {.name = "monitor_threads",
     .type = CONFIG_UINT,
     .def = "0",
     .min = 0,
     .max = FS_CAP_MONITOR_THREADS,
     CORE(monitor_threads),
     .help = "worker threads for the monitor math (0: one per online CPU)"},
    {.name = "head_points_every",
     .type = CONFIG_UINT,
     .def = "1",
     .min = 1,
     .max = FS_CAP_HEAD_POINTS_EVERY,
     CORE(head_points_every),
     .help = "store per-head monitor points only at steps that are multiples of this (1: "
             "every sketch step); per-layer aggregates and detection always see every step"},
    /* HTTP auth and /metrics (http.c, metrics.c) */
    {.name = "http_write_token",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_MAX_TOKEN_LEN,
     CORE(http_write_token),
     .help = "bearer token for HTTP writes (silences); empty: writes answer 403"},
    {.name = "http_read_token",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_MAX_TOKEN_LEN,
     CORE(http_read_token),
     .help = "bearer token (or the write token) every route but /healthz, /readyz needs"},
    {.name = "metrics_max_runs",
     .type = CONFIG_UINT,
     .def = "8",
     .min = 0,
     .max = FS_CAP_METRICS_MAX_RUNS,
     CORE(metrics_max_runs),
     .help = "/metrics: per-run gauges for at most this many most recently active runs"},
    {.name = "metrics_run_max_age",
     .type = CONFIG_DOUBLE,
     .def = "3600",
     .min = 1,
     .max = 31536000,
     CORE(metrics_run_max_age),
     .help = "/metrics: ... that had a report in the last this many seconds"},
    /* retention (store_prune.c) */
    {.name = "outbox_retention",
     .type = CONFIG_DOUBLE,
     .def = "604800",
     .min = 1,
     .max = 315360000,
     CORE(outbox_retention),
     .help = "seconds finished pages (delivered, given up, skipped) stay in the outbox"},
    {.name = "silence_retention",
     .type = CONFIG_DOUBLE,
     .def = "2592000",
     .min = 1,
     .max = 315360000,
     CORE(silence_retention),
     .help = "seconds expired silences are kept"},
    /* the run lifecycle (store_runs.c) */
    {.name = "run_idle_end_s",
     .type = CONFIG_DOUBLE,
     .def = "86400",
     .min = 0,
     .max = 315360000,
     CORE(run_idle_end_s),
     .help = "seconds without a report after which a run ends (stops counting against "
             "max_runs; 0: never)"},
    {.name = "run_retention_s",
     .type = CONFIG_DOUBLE,
     .def = "2592000",
     .min = 0,
     .max = 315360000,
     CORE(run_retention_s),
     .help = "seconds an ended run is kept; then it is deleted with all its data (0: kept)"},
    {.name = "run_hello_grace_s",
     .type = CONFIG_DOUBLE,
     .def = "3600",
     .min = 0,
     .max = 315360000,
     CORE(run_hello_grace_s),
     .help = "a run that never sent a report is deleted this many seconds after its last "
             "Hello (0: kept)"},
    {.name = "max_runs_per_token",
     .type = CONFIG_UINT,
     .def = "0",
     .min = 0,
     .max = FS_CAP_MAX_RUNS,
     CORE(max_runs_per_token),
     .help = "live runs per ingest token ([run] section, or the global token); 0: only "
             "max_runs"},
    /* pager */
    {.name = "public_url",
     .type = CONFIG_STRING,
     .def = "",
     .min = 0,
     .max = FS_CONFIG_MAX_URL - 1,
     CORE(public_url),
     .help = "base URL of links in pages (empty: http://<http address>)"},
};

const struct config_key *config_keys(size_t *n)
{
    *n = sizeof(core_keys) / sizeof(core_keys[0]);
    return core_keys;
}

static void fail(struct fs_err *err, const char *origin, int line, const char *key, const char *fmt,
                 ...) __attribute__((format(printf, 5, 6)));

static void fail(struct fs_err *err, const char *origin, int line, const char *key, const char *fmt,
                 ...)
{
    char *m = err->msg;
    size_t cap = sizeof(err->msg), off = 0;
    int k = line > 0 ? snprintf(m, cap, "config: %s:%d: ", origin, line)
                     : snprintf(m, cap, "config: %s: ", origin);
    off = k > 0 && (size_t)k < cap ? (size_t)k : cap - 1;
    if (key) {
        k = snprintf(m + off, cap - off, "key '%s': ", key);
        off = k > 0 && (size_t)k < cap - off ? off + (size_t)k : cap - 1;
    }
    va_list ap;
    va_start(ap, fmt);
    k = vsnprintf(m + off, cap - off, fmt, ap);
    va_end(ap);
    (void)k;
    err->line = line;
}

/* Unsigned decimal, whole string, no sign; with_suffix accepts K/M/G/T,
 * optionally followed by "iB" or "B" (binary multiples). */
static int parse_u64(const char *s, int with_suffix, uint64_t *out, struct fs_err *why)
{
    if (!isdigit((unsigned char)s[0]))
        return fs_err_set(why, -EINVAL, "'%s' is not an unsigned integer", s);
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno == ERANGE)
        return fs_err_set(why, -EINVAL, "'%s' is too large", s);
    unsigned shift = 0;
    if (with_suffix && *end) {
        const char *units = "KMGT";
        const char *u = strchr(units, toupper((unsigned char)*end));
        if (u) {
            shift = 10u * (unsigned)(u - units + 1);
            end++;
            if (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0)
                end += strlen(end);
        } else if (strcmp(end, "B") == 0) {
            end++;
        }
    }
    if (*end)
        return fs_err_set(why, -EINVAL, "'%s' is not %s", s,
                          with_suffix ? "a byte count (e.g. 4096, 64K, 16M, 1G)"
                                      : "an unsigned integer");
    if (shift && v > (UINT64_MAX >> shift))
        return fs_err_set(why, -EINVAL, "'%s' is too large", s);
    *out = (uint64_t)v << shift;
    return 0;
}

static int parse_endpoint(const char *s, struct config_endpoint *ep, struct fs_err *why)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s)
        return fs_err_set(why, -EINVAL, "'%s' is not HOST:PORT", s);
    const char *h = s;
    size_t hlen = (size_t)(colon - s);
    if (h[0] == '[') { /* [v6]:port */
        if (hlen < 3 || h[hlen - 1] != ']')
            return fs_err_set(why, -EINVAL, "'%s' is not [IPv6]:PORT", s);
        h++;
        hlen -= 2;
    } else if (memchr(h, ':', hlen)) {
        return fs_err_set(why, -EINVAL, "'%s': write an IPv6 address as [ADDR]:PORT", s);
    }
    if (hlen >= sizeof(ep->host))
        return fs_err_set(why, -EINVAL, "host is longer than %zu bytes", sizeof(ep->host) - 1);
    uint64_t port;
    if (parse_u64(colon + 1, 0, &port, why) < 0 || port > 65535)
        return fs_err_set(why, -EINVAL, "'%s' is not a port number 0..65535", colon + 1);
    memcpy(ep->host, h, hlen);
    ep->host[hlen] = '\0';
    ep->port = (uint16_t)port;
    return 0;
}

/* Sets one key of target from text; why gets the reason on -EINVAL. */
static int key_set(const struct config_key *k, void *target, const char *v, struct fs_err *why)
{
    char *field = (char *)target + k->offset;
    switch (k->type) {
    case CONFIG_STRING: {
        size_t n = strlen(v);
        if (n < (size_t)k->min || n > (size_t)k->max || n >= k->size)
            return fs_err_set(why, -EINVAL, "length %zu is outside %.0f..%.0f bytes", n, k->min,
                              fmin(k->max, (double)(k->size - 1)));
        memcpy(field, v, n + 1);
        return 0;
    }
    case CONFIG_UINT:
    case CONFIG_BYTES: {
        uint64_t x;
        if (parse_u64(v, k->type == CONFIG_BYTES, &x, why) < 0)
            return -EINVAL;
        if ((double)x < k->min || (double)x > k->max)
            return fs_err_set(why, -EINVAL, "%s is outside the range %.0f..%.0f", v, k->min,
                              k->max);
        memcpy(field, &x, sizeof(x));
        return 0;
    }
    case CONFIG_DOUBLE: {
        char *end;
        errno = 0;
        double x = strtod(v, &end);
        if (!*v || *end || errno == ERANGE || !isfinite(x))
            return fs_err_set(why, -EINVAL, "'%s' is not a finite number", v);
        if (x < k->min || x > k->max)
            return fs_err_set(why, -EINVAL, "%s is outside the range %g..%g", v, k->min, k->max);
        memcpy(field, &x, sizeof(x));
        return 0;
    }
    case CONFIG_ENUM:
        for (int i = 0; k->choices[i]; i++) {
            if (strcmp(v, k->choices[i]) == 0) {
                memcpy(field, &i, sizeof(i));
                return 0;
            }
        }
        {
            char *m = why->msg;
            size_t cap = sizeof(why->msg);
            size_t off = (size_t)snprintf(m, cap, "'%s' is not one of", v);
            for (int i = 0; k->choices[i] && off < cap; i++)
                off += (size_t)snprintf(m + off, cap - off, "%s %s", i ? " |" : "", k->choices[i]);
        }
        return -EINVAL;
    case CONFIG_ENDPOINT: {
        struct config_endpoint ep;
        if (parse_endpoint(v, &ep, why) < 0)
            return -EINVAL;
        memcpy(field, &ep, sizeof(ep));
        return 0;
    }
    }
    return fs_err_set(why, -EINVAL, "unknown key type");
}

int config_apply_defaults(const struct config_key *keys, size_t nkeys, void *target,
                          struct fs_err *err)
{
    struct fs_err why = {0};
    for (size_t i = 0; i < nkeys; i++) {
        if (keys[i].def && key_set(&keys[i], target, keys[i].def, &why) < 0) {
            fail(err, "default", 0, keys[i].name, "%.255s", why.msg);
            return -EINVAL;
        }
    }
    return 0;
}

void config_defaults(struct fs_config *cfg)
{
    struct fs_err err;
    memset(cfg, 0, sizeof(*cfg));
    /* Defaults are compile-time constants checked by the unit tests. */
    (void)config_apply_defaults(core_keys, sizeof(core_keys) / sizeof(core_keys[0]), cfg, &err);
}

static const struct config_key *find_key(const struct config_section *sec, const char *name)
{
    for (size_t i = 0; i < sec->nkeys; i++)
        if (strcmp(sec->keys[i].name, name) == 0)
            return &sec->keys[i];
    return NULL;
}

static int is_name_char(char c)
{
    return isalnum((unsigned char)c) || c == '_' || c == '-' || c == '.';
}

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r'))
        s[--n] = '\0';
    return s;
}

/* Reads a double-quoted string at *p (\" and \\ escapes) into out (in place
 * is fine: out <= *p); leaves *p after the closing quote. */
static int unquote(char **p, char *out)
{
    char *s = *p + 1;
    while (*s && *s != '"') {
        if (*s == '\\' && (s[1] == '"' || s[1] == '\\'))
            s++;
        *out++ = *s++;
    }
    if (*s != '"')
        return -EINVAL;
    *out = '\0';
    *p = s + 1;
    return 0;
}

/* After a value: only whitespace or a comment may follow. */
static int only_comment(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    return *s == '\0' || *s == '#' || *s == ';';
}

/* What one parse has seen, to refuse what a file gives twice: section
 * headers (name and sub) and the keys of the section being read, each with
 * its line. A key or a section given twice would otherwise be taken
 * silently, the last one winning, or the first: [run] and [target]
 * refused a second section of theirs while [detect] and [advice] did not. */
struct seen_item {
    char *text; /* "name\037sub" (a header) or the key */
    int line;
};
struct seen {
    struct seen_item *headers, *keys;
    size_t n_headers, cap_headers, n_keys, cap_keys;
};

static void seen_free(struct seen *sn)
{
    for (size_t i = 0; i < sn->n_headers; i++)
        free(sn->headers[i].text);
    for (size_t i = 0; i < sn->n_keys; i++)
        free(sn->keys[i].text);
    free(sn->headers);
    free(sn->keys);
}

/* The line where text was seen in v[0..n), else 0; else records it at line
 * (-ENOMEM when it cannot). */
static int seen_check(struct seen_item **v, size_t *n, size_t *cap, const char *text, int line)
{
    for (size_t i = 0; i < *n; i++)
        if (strcmp((*v)[i].text, text) == 0)
            return (*v)[i].line;
    struct seen_item *p = fs_grow(*v, cap, *n + 1, sizeof(*p), 16);
    char *copy = p ? strdup(text) : NULL;
    if (!copy) {
        if (p)
            *v = p;
        return -ENOMEM;
    }
    *v = p;
    (*v)[(*n)++] = (struct seen_item){.text = copy, .line = line};
    return 0;
}

/* Parses a `[name]` or `[name "sub"]` line; selects the section and target. */
static int parse_header(char *s, const char *origin, int line,
                        const struct config_section *sections, size_t nsections,
                        const struct config_section **sec, void **target, struct seen *sn,
                        struct fs_err *err)
{
    char *p = s + 1;
    while (*p == ' ' || *p == '\t')
        p++;
    char *name = p;
    while (is_name_char(*p))
        p++;
    char *name_end = p;
    while (*p == ' ' || *p == '\t')
        p++;
    char *sub = NULL;
    if (*p == '"') {
        sub = p;
        if (unquote(&p, sub) < 0) {
            fail(err, origin, line, NULL, "section header: unterminated quote");
            return -EINVAL;
        }
        while (*p == ' ' || *p == '\t')
            p++;
    }
    if (name_end == name || *p != ']' || !only_comment(p + 1)) {
        fail(err, origin, line, NULL, "bad section header (expected [name] or [name \"sub\"])");
        return -EINVAL;
    }
    *name_end = '\0';
    char id[FS_CONFIG_MAX_LINE + 2];
    snprintf(id, sizeof(id), "%s\037%s", name, sub ? sub : "");
    int first = seen_check(&sn->headers, &sn->n_headers, &sn->cap_headers, id, line);
    if (first != 0) {
        if (first > 0)
            fail(err, origin, line, NULL, "section [%s%s%s%s] given twice (first at line %d)", name,
                 sub ? " \"" : "", sub ? sub : "", sub ? "\"" : "", first);
        else
            fail(err, origin, line, NULL, "out of memory");
        return first > 0 ? -EINVAL : -ENOMEM;
    }
    /* A new section: its keys are new. */
    for (size_t i = 0; i < sn->n_keys; i++)
        free(sn->keys[i].text);
    sn->n_keys = 0;
    for (size_t i = 0; i < nsections; i++) {
        if (sections[i].name[0] && strcmp(sections[i].name, name) == 0) {
            /* .line: the header's, for an open() that names it later. */
            struct fs_err why = {.line = line, .msg = "not accepted"};
            void *t =
                sections[i].open ? sections[i].open(sections[i].ctx, sub, &why) : sections[i].ctx;
            if (!t) {
                fail(err, origin, line, NULL, "section [%s%s%s%s]: %.255s", name, sub ? " \"" : "",
                     sub ? sub : "", sub ? "\"" : "", why.msg);
                return -EINVAL;
            }
            *sec = &sections[i];
            *target = t;
            return 0;
        }
    }
    fail(err, origin, line, NULL, "unknown section [%s]", name);
    return -EINVAL;
}

/* Parses one `key = value` line into the current section. */
static int parse_assignment(char *s, const char *origin, int line, const struct config_section *sec,
                            void *target, struct seen *sn, struct fs_err *err)
{
    char *p = s;
    while (is_name_char(*p))
        p++;
    char *key_end = p;
    while (*p == ' ' || *p == '\t')
        p++;
    if (key_end == s || *p != '=') {
        fail(err, origin, line, NULL, "expected 'key = value'");
        return -EINVAL;
    }
    *key_end = '\0';
    int first = seen_check(&sn->keys, &sn->n_keys, &sn->cap_keys, s, line);
    if (first != 0) {
        if (first > 0)
            fail(err, origin, line, s, "given twice in this section (first at line %d)", first);
        else
            fail(err, origin, line, NULL, "out of memory");
        return first > 0 ? -EINVAL : -ENOMEM;
    }
    p++;
    while (*p == ' ' || *p == '\t')
        p++;
    char *value = p;
    if (*p == '"') {
        if (unquote(&p, value) < 0 || !only_comment(p)) {
            fail(err, origin, line, s, "bad quoted value");
            return -EINVAL;
        }
    } else {
        /* An unquoted value ends at a comment that follows whitespace, so
         * "a#b" keeps its '#'. */
        for (char *c = value; *c; c++) {
            if ((*c == '#' || *c == ';') && c > value && (c[-1] == ' ' || c[-1] == '\t')) {
                *c = '\0';
                break;
            }
        }
        value = trim(value);
    }
    struct fs_err why = {0};
    if (sec->set) {
        if (sec->set(sec->ctx, target, s, value, &why) < 0) {
            fail(err, origin, line, s, "%s", why.msg);
            return -EINVAL;
        }
        return 0;
    }
    const struct config_key *k = find_key(sec, s);
    if (!k) {
        fail(err, origin, line, s, "unknown key%s%s%s", sec->name[0] ? " in section [" : "",
             sec->name, sec->name[0] ? "]" : "");
        return -EINVAL;
    }
    if (key_set(k, target, value, &why) < 0) {
        fail(err, origin, line, s, "%s", why.msg);
        return -EINVAL;
    }
    return 0;
}

int config_parse_sections(const char *text, size_t len, const char *origin,
                          const struct config_section *sections, size_t nsections,
                          struct fs_err *err)
{
    const struct config_section *sec = NULL;
    for (size_t i = 0; i < nsections; i++)
        if (sections[i].name[0] == '\0')
            sec = &sections[i];
    if (!sec) {
        fail(err, origin, 0, NULL, "no top-level section registered");
        return -EINVAL;
    }
    void *target = sec->ctx;
    char buf[FS_CONFIG_MAX_LINE + 1];
    struct seen sn = {0};
    int line = 0, rc = 0;
    size_t pos = 0;
    /* A UTF-8 byte order mark, which some editors write: not text. */
    if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0)
        pos = 3;
    while (pos < len) {
        line++;
        const char *start = text + pos;
        const char *nl = memchr(start, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - start) : len - pos;
        pos += n + (nl ? 1 : 0);
        if (n > FS_CONFIG_MAX_LINE) {
            fail(err, origin, line, NULL, "line longer than %u bytes", FS_CONFIG_MAX_LINE);
            rc = -EINVAL;
            break;
        }
        if (memchr(start, '\0', n)) {
            fail(err, origin, line, NULL, "NUL byte in line");
            rc = -EINVAL;
            break;
        }
        memcpy(buf, start, n);
        buf[n] = '\0';
        char *s = trim(buf);
        if (*s == '\0' || *s == '#' || *s == ';')
            continue;
        rc = *s == '[' ? parse_header(s, origin, line, sections, nsections, &sec, &target, &sn, err)
                       : parse_assignment(s, origin, line, sec, target, &sn, err);
        if (rc < 0)
            break;
    }
    seen_free(&sn);
    return rc < 0 ? rc : 0;
}

int config_parse(const char *text, size_t len, const char *origin, struct fs_config *cfg,
                 const struct config_section *extra, size_t nextra, struct fs_err *err)
{
    enum { MAX_SECTIONS = 32 };
    struct config_section all[MAX_SECTIONS];
    if (nextra >= MAX_SECTIONS) {
        fail(err, origin, 0, NULL, "too many registered sections");
        return -EINVAL;
    }
    all[0] = (struct config_section){.name = "",
                                     .keys = core_keys,
                                     .nkeys = sizeof(core_keys) / sizeof(core_keys[0]),
                                     .ctx = cfg};
    for (size_t i = 0; i < nextra; i++)
        all[i + 1] = extra[i];
    return config_parse_sections(text, len, origin, all, nextra + 1, err);
}

int config_set(struct fs_config *cfg, const char *key, const char *value, const char *origin,
               struct fs_err *err)
{
    struct config_section top = {
        .name = "", .keys = core_keys, .nkeys = sizeof(core_keys) / sizeof(core_keys[0])};
    const struct config_key *k = find_key(&top, key);
    if (!k) {
        fail(err, origin, 0, key, "unknown key");
        return -EINVAL;
    }
    struct fs_err why = {0};
    if (key_set(k, cfg, value, &why) < 0) {
        fail(err, origin, 0, key, "%s", why.msg);
        return -EINVAL;
    }
    return 0;
}

int config_check(const struct fs_config *cfg, const char *origin, struct fs_err *err)
{
    if (cfg->writer_batch_max_items > cfg->writer_queue_max_items) {
        fail(err, origin, 0, "writer_batch_max_items",
             "%llu is larger than writer_queue_max_items (%llu)",
             (unsigned long long)cfg->writer_batch_max_items,
             (unsigned long long)cfg->writer_queue_max_items);
        return -EINVAL;
    }
    if (cfg->frame_buffer_max_bytes < cfg->max_frame_bytes) {
        fail(err, origin, 0, "frame_buffer_max_bytes",
             "%llu is below max_frame_bytes (%llu): one frame of the largest size must fit",
             (unsigned long long)cfg->frame_buffer_max_bytes,
             (unsigned long long)cfg->max_frame_bytes);
        return -EINVAL;
    }
    /* A certificate without its key (or the other way round) is a typo,
     * not a wish for plaintext. */
    static const struct {
        const char *a, *b;
        size_t oa, ob;
    } pairs[] = {
        {"tls_cert", "tls_key", offsetof(struct fs_config, tls_cert),
         offsetof(struct fs_config, tls_key)},
        {"http_tls_cert", "http_tls_key", offsetof(struct fs_config, http_tls_cert),
         offsetof(struct fs_config, http_tls_key)},
    };
    for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
        const char *a = (const char *)cfg + pairs[i].oa, *b = (const char *)cfg + pairs[i].ob;
        if (!a[0] != !b[0]) {
            fail(err, origin, 0, a[0] ? pairs[i].b : pairs[i].a, "is needed with '%s'",
                 a[0] ? pairs[i].a : pairs[i].b);
            return -EINVAL;
        }
    }
    if (cfg->tls_client_ca[0] && !cfg->tls_cert[0]) {
        fail(err, origin, 0, "tls_client_ca", "needs tls_cert and tls_key (ingest TLS)");
        return -EINVAL;
    }
    return 0;
}

int config_load_file(const char *path, struct fs_config *cfg, const struct config_section *extra,
                     size_t nextra, struct fs_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        fail(err, path, 0, NULL, "cannot open: %s", strerror(e));
        return -e;
    }
    int rc = 0;
    char *text = malloc(FS_CONFIG_MAX_FILE_BYTES + 1);
    if (!text) {
        fail(err, path, 0, NULL, "out of memory");
        rc = -ENOMEM;
        goto out;
    }
    size_t n = fread(text, 1, FS_CONFIG_MAX_FILE_BYTES + 1, f);
    if (ferror(f)) {
        fail(err, path, 0, NULL, "read error");
        rc = -EIO;
        goto out;
    }
    if (n > FS_CONFIG_MAX_FILE_BYTES) {
        fail(err, path, 0, NULL, "larger than %u bytes", FS_CONFIG_MAX_FILE_BYTES);
        rc = -EFBIG;
        goto out;
    }
    rc = config_parse(text, n, path, cfg, extra, nextra, err);
out:
    free(text);
    fclose(f);
    return rc;
}

void config_print_keys(FILE *f)
{
    for (size_t i = 0; i < sizeof(core_keys) / sizeof(core_keys[0]); i++) {
        const struct config_key *k = &core_keys[i];
        char def[64];
        snprintf(def, sizeof(def), "%s", k->def && k->def[0] ? k->def : "(none)");
        fprintf(f, "    %-24s default %-16s %s\n", k->name, def, k->help);
    }
}
