#ifndef FORESHOCK_CONFIG_H
#define FORESHOCK_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fs_err.h"
#include "fs_limits.h"

/* Configuration: an INI-style file of `key = value` lines, `#` or `;`
 * comments (whole line, or after whitespace), `[section]` and
 * `[section "name"]` headers. Keys are described by tables (struct
 * config_key) so that a later module registers its own section, e.g.
 *   [detect "qk.d2.erank"]
 *   z = 5
 * by passing a struct config_section to config_parse(). Parsing is a pure
 * function: text in, struct and error out. Everything here is called from
 * the main thread at startup (or from tests); nothing keeps state. */

enum config_type {
    CONFIG_STRING,   /* char[size]; min/max bound the length in bytes */
    CONFIG_UINT,     /* uint64_t, decimal */
    CONFIG_BYTES,    /* uint64_t, decimal with optional K/M/G/T (binary) suffix */
    CONFIG_DOUBLE,   /* double, finite */
    CONFIG_ENUM,     /* int: index into choices[] */
    CONFIG_ENDPOINT, /* struct config_endpoint: HOST:PORT, [v6]:PORT; port 0 = pick */
};

struct config_endpoint {
    char host[FS_CONFIG_MAX_HOST];
    uint16_t port;
};

struct config_key {
    const char *name;
    enum config_type type;
    const char *def;            /* default, in file syntax; NULL: leave the field as is */
    double min, max;            /* value range (UINT, BYTES, DOUBLE) or length range (STRING) */
    size_t offset;              /* of the field in the section's target struct */
    size_t size;                /* of the field */
    const char *const *choices; /* CONFIG_ENUM: NULL-terminated */
    const char *help;           /* one line for --help */
};

/* A section of keys. name "" holds the top-level keys (before any header).
 * open() is called at each `[name]` / `[name "sub"]` header (sub NULL for
 * the former) and returns the struct the keys' offsets apply to, or NULL
 * after writing a reason into why. For the top-level section open is NULL
 * and ctx is the target struct. */
struct config_section {
    const char *name;
    const struct config_key *keys;
    size_t nkeys;
    void *(*open)(void *ctx, const char *sub, struct fs_err *why);
    void *ctx;
    /* Optional: a section whose keys are not a table (e.g. [detect "RULE"],
     * whose keys the detector parses). When set, keys/nkeys are ignored and
     * every `key = value` of the section goes here with the target open()
     * returned; returns 0, or -EINVAL after writing a reason into why. */
    int (*set)(void *ctx, void *target, const char *key, const char *value, struct fs_err *why);
};

/* Error detail is a struct fs_err (fs_err.h). The functions below leave in
 * err->msg a message complete and ready to print, e.g.
 *   config: /etc/foreshock.conf:12: key 'max_runs': 0 is below the minimum 1
 * and in err->line the line (0 when not tied to a line). A section's open()
 * and set() write only the reason into why; the parser adds the place. */

#define FS_CONFIG_MAX_URL 1024u /* public_url bytes with NUL */

enum config_sync { CONFIG_SYNC_NORMAL = 0, CONFIG_SYNC_FULL = 1 };

/* The daemon's own keys (the top-level section). */
struct fs_config {
    struct config_endpoint listen;
    struct config_endpoint http;
    char db[FS_CONFIG_MAX_PATH];
    int synchronous; /* enum config_sync */
    uint64_t http_threads;
    uint64_t max_connections;
    uint64_t max_unauthenticated;             /* ingest: in TLS handshake or before a Hello */
    uint64_t max_unauthenticated_per_address; /* ingest: of those, from one address */
    uint64_t max_frame_bytes;
    uint64_t max_runs;
    uint64_t max_conn_buffer_bytes;
    uint64_t frame_buffer_max_bytes; /* ingest: large frames being read, all connections */
    uint64_t writer_queue_max_items;
    uint64_t writer_queue_max_bytes;
    uint64_t writer_batch_max_items;
    uint64_t spool_max_bytes;
    int log_level;                    /* enum log_level */
    char token[FS_MAX_TOKEN_LEN + 1]; /* "" = no token required */
    double reduce_timeout_s;          /* monitor stage: incomplete reductions after this */
    double hello_timeout_s;           /* ingest: a connection's Hello within this (0: none) */
    double frame_timeout_s;           /* ingest: a begun frame complete within this (0: none) */
    double shutdown_timeout_s;    /* monitor math not started by then is left spooled (0: none) */
    uint64_t reduce_max_bytes;    /* monitor stage: reduction memory bound */
    uint64_t max_run_bytes;       /* monitor stage: per-run budget (detected series, scalars) */
    uint64_t spool_run_max_bytes; /* monitor stage: spooled bytes of one run (0: none) */
    uint64_t detect_from_step;    /* runs whose Hello does not say */
    uint64_t monitor_threads;     /* worker threads for the monitor math; 0 = CPUs */
    uint64_t head_points_every;   /* per-head points at multiples of this step only */
    /* HTTP auth and /metrics */
    char http_write_token[FS_MAX_TOKEN_LEN + 1]; /* "" = HTTP writes disabled */
    char http_read_token[FS_MAX_TOKEN_LEN + 1];  /* "" = reads need no token */
    uint64_t metrics_max_runs;
    double metrics_run_max_age; /* seconds */
    /* retention, seconds: finished outbox rows, expired silences */
    double outbox_retention;
    double silence_retention;
    /* the run lifecycle, seconds (0: never), and the per-token quota (0: none) */
    double run_idle_end_s;
    double run_retention_s;
    double run_hello_grace_s;
    uint64_t max_runs_per_token;
    /* pager: base of generatorURL and links in pages ("" = http://<http address>) */
    char public_url[FS_CONFIG_MAX_URL];
    /* TLS (PEM files; "" = off): ingest, its client CA (mutual TLS), HTTPS */
    char tls_cert[FS_CONFIG_MAX_PATH];
    char tls_key[FS_CONFIG_MAX_PATH];
    char tls_client_ca[FS_CONFIG_MAX_PATH];
    char http_tls_cert[FS_CONFIG_MAX_PATH];
    char http_tls_key[FS_CONFIG_MAX_PATH];
};

/* The table of the daemon's keys (for --help and tests). */
const struct config_key *config_keys(size_t *n);

/* Fills cfg with every key's default. */
void config_defaults(struct fs_config *cfg);

/* Sets every key of a table to its default in target. Returns 0, or -EINVAL
 * if a default does not parse (a programming error; err says which). */
int config_apply_defaults(const struct config_key *keys, size_t nkeys, void *target,
                          struct fs_err *err);

/* Parses text (len bytes, need not be NUL-terminated) over cfg, which holds
 * defaults or earlier values. extra/nextra: sections registered by other
 * modules (may be NULL/0). origin names the text in messages (a file name).
 * Returns 0, or -EINVAL with err filled; cfg may then be partly updated. */
int config_parse(const char *text, size_t len, const char *origin, struct fs_config *cfg,
                 const struct config_section *extra, size_t nextra, struct fs_err *err);

/* The generic parser behind config_parse: sections[] must contain one with
 * name "" for keys before any header. */
int config_parse_sections(const char *text, size_t len, const char *origin,
                          const struct config_section *sections, size_t nsections,
                          struct fs_err *err);

/* Sets one top-level key from text, as a command-line flag does. origin
 * names the source ("command line"). 0 or -EINVAL (unknown key, bad value). */
int config_set(struct fs_config *cfg, const char *key, const char *value, const char *origin,
               struct fs_err *err);

/* Checks rules between keys (batch <= queue items, ...). 0 or -EINVAL. */
int config_check(const struct fs_config *cfg, const char *origin, struct fs_err *err);

/* Reads path (at most FS_CONFIG_MAX_FILE_BYTES) and parses it like
 * config_parse. -ENOENT etc. when unreadable, -EFBIG when too large,
 * -EINVAL on a parse error; err says which. */
int config_load_file(const char *path, struct fs_config *cfg, const struct config_section *extra,
                     size_t nextra, struct fs_err *err);

/* Writes `  key = default    help` lines for every key to f (for --help). */
void config_print_keys(FILE *f);

#endif
