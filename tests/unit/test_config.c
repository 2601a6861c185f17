/* config.c: defaults, every key, errors with file:line, comments, sections. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "log.h"

Test(config, defaults)
{
    struct fs_config c;
    config_defaults(&c);
    cr_expect_str_eq(c.listen.host, "127.0.0.1");
    cr_expect_eq(c.listen.port, 7781);
    cr_expect_str_eq(c.http.host, "127.0.0.1");
    cr_expect_eq(c.http.port, 7782);
    cr_expect_str_eq(c.db, "./foreshock.db");
    cr_expect_eq(c.synchronous, CONFIG_SYNC_NORMAL);
    cr_expect_eq(c.http_threads, FS_DEF_HTTP_THREADS);
    cr_expect_eq(c.max_connections, FS_DEF_MAX_CONNECTIONS);
    cr_expect_eq(c.max_unauthenticated, FS_DEF_MAX_UNAUTHENTICATED);
    cr_expect_eq(c.max_unauthenticated_per_address, FS_DEF_MAX_UNAUTHENTICATED_PER_ADDRESS);
    cr_expect_eq(c.max_frame_bytes, FS_DEF_MAX_FRAME_BYTES);
    cr_expect_eq(c.max_runs, FS_DEF_MAX_RUNS);
    cr_expect_eq(c.max_conn_buffer_bytes, FS_DEF_MAX_CONN_BUFFER_BYTES);
    cr_expect_eq(c.frame_buffer_max_bytes, FS_DEF_FRAME_BUFFER_MAX_BYTES);
    cr_expect_eq(c.writer_queue_max_items, FS_DEF_WRITER_QUEUE_MAX_ITEMS);
    cr_expect_eq(c.writer_queue_max_bytes, FS_DEF_WRITER_QUEUE_MAX_BYTES);
    cr_expect_eq(c.writer_batch_max_items, FS_DEF_WRITER_BATCH_MAX_ITEMS);
    cr_expect_eq(c.spool_max_bytes, FS_DEF_SPOOL_MAX_BYTES);
    cr_expect_eq(c.log_level, LOG_LEVEL_INFO);
    cr_expect_str_eq(c.token, "");
    cr_expect_eq(c.reduce_timeout_s, FS_DEF_REDUCE_TIMEOUT_S);
    cr_expect_eq(c.reduce_max_bytes, FS_DEF_REDUCE_MAX_BYTES);
    cr_expect_eq(c.detect_from_step, 0);
    cr_expect_eq(c.monitor_threads, 0);
    cr_expect_eq(c.head_points_every, 1);
    cr_expect_eq(c.metrics_max_runs, FS_DEF_METRICS_MAX_RUNS);
    struct fs_err err = {0};
    cr_expect_eq(config_check(&c, "defaults", &err), 0, "%s", err.msg);
    /* Every default in the table parses (config_defaults ignores errors). */
    size_t n;
    const struct config_key *keys = config_keys(&n);
    struct fs_config d;
    cr_expect_eq(config_apply_defaults(keys, n, &d, &err), 0, "%s", err.msg);
}

/* One case per valid setting: text, then a check of the field. */
struct ok_case {
    const char *text;
    size_t offset; /* field to check */
    int kind;      /* 0: uint64, 1: int, 2: string, 3: endpoint, 4: double (u / 1000) */
    uint64_t u;
    const char *s;
};

#define OFF(f) offsetof(struct fs_config, f)

static const struct ok_case ok_cases[] = {
    {"listen = 0.0.0.0:9000", OFF(listen), 3, 9000, "0.0.0.0"},
    {"listen = [::1]:0", OFF(listen), 3, 0, "::1"},
    {"http = localhost:8080", OFF(http), 3, 8080, "localhost"},
    {"db = /var/lib/foreshock/x.db", OFF(db), 2, 0, "/var/lib/foreshock/x.db"},
    {"db = \"/path with # hash\"  # comment", OFF(db), 2, 0, "/path with # hash"},
    {"synchronous = full", OFF(synchronous), 1, CONFIG_SYNC_FULL, NULL},
    {"synchronous=normal", OFF(synchronous), 1, CONFIG_SYNC_NORMAL, NULL},
    {"http_threads = 64", OFF(http_threads), 0, 64, NULL},
    {"max_connections = 1", OFF(max_connections), 0, 1, NULL},
    {"max_unauthenticated = 16", OFF(max_unauthenticated), 0, 16, NULL},
    {"max_unauthenticated_per_address = 4", OFF(max_unauthenticated_per_address), 0, 4, NULL},
    {"max_frame_bytes = 16M", OFF(max_frame_bytes), 0, 16u << 20, NULL},
    {"max_frame_bytes = 8KiB", OFF(max_frame_bytes), 0, 8u << 10, NULL},
    {"max_frame_bytes = 1048576", OFF(max_frame_bytes), 0, 1u << 20, NULL},
    {"max_runs = 5", OFF(max_runs), 0, 5, NULL},
    {"max_conn_buffer_bytes = 64k", OFF(max_conn_buffer_bytes), 0, 64u << 10, NULL},
    {"writer_queue_max_items = 100", OFF(writer_queue_max_items), 0, 100, NULL},
    {"writer_queue_max_bytes = 2G", OFF(writer_queue_max_bytes), 0, 2ull << 30, NULL},
    {"writer_batch_max_items = 7", OFF(writer_batch_max_items), 0, 7, NULL},
    {"spool_max_bytes = 1T", OFF(spool_max_bytes), 0, 1ull << 40, NULL},
    {"log_level = debug", OFF(log_level), 1, LOG_LEVEL_DEBUG, NULL},
    {"log_level = error", OFF(log_level), 1, LOG_LEVEL_ERROR, NULL},
    {"token = s3cr#t", OFF(token), 2, 0, "s3cr#t"},
    {"token = abc # trailing comment", OFF(token), 2, 0, "abc"},
    {"  \t token\t=\tx  \r", OFF(token), 2, 0, "x"},
    {"reduce_timeout_s = 2.5", OFF(reduce_timeout_s), 4, 2500, NULL},
    {"reduce_timeout_s = 600", OFF(reduce_timeout_s), 4, 600000, NULL},
    {"reduce_max_bytes = 2G", OFF(reduce_max_bytes), 0, 2ull << 30, NULL},
    {"detect_from_step = 1000", OFF(detect_from_step), 0, 1000, NULL},
    {"monitor_threads = 16", OFF(monitor_threads), 0, 16, NULL},
    {"head_points_every = 100", OFF(head_points_every), 0, 100, NULL},
};

Test(config, every_key_table)
{
    for (size_t i = 0; i < sizeof(ok_cases) / sizeof(ok_cases[0]); i++) {
        const struct ok_case *c = &ok_cases[i];
        struct fs_config cfg;
        config_defaults(&cfg);
        struct fs_err err = {0};
        int rc = config_parse(c->text, strlen(c->text), "t.conf", &cfg, NULL, 0, &err);
        cr_expect_eq(rc, 0, "'%s': %s", c->text, err.msg);
        const char *field = (const char *)&cfg + c->offset;
        switch (c->kind) {
        case 0:
            cr_expect_eq(*(const uint64_t *)field, c->u, "'%s'", c->text);
            break;
        case 1:
            cr_expect_eq(*(const int *)field, (int)c->u, "'%s'", c->text);
            break;
        case 2:
            cr_expect_str_eq(field, c->s, "'%s'", c->text);
            break;
        case 3: {
            const struct config_endpoint *ep = (const void *)field;
            cr_expect_str_eq(ep->host, c->s, "'%s'", c->text);
            cr_expect_eq(ep->port, c->u, "'%s'", c->text);
            break;
        }
        case 4:
            cr_expect_eq(*(const double *)field, (double)c->u / 1000, "'%s'", c->text);
            break;
        }
    }
}

/* Errors: the message names file, line and key with the reason. */
struct bad_case {
    const char *text;
    const char *want; /* substring of the message */
};

static const struct bad_case bad_cases[] = {
    {"nosuchkey = 1", "config: t.conf:1: key 'nosuchkey': unknown key"},
    {"\n\nmax_runs = 0", "config: t.conf:3: key 'max_runs': 0 is outside the range"},
    {"max_runs = 1000001", "key 'max_runs': 1000001 is outside"},
    {"max_runs = -1", "key 'max_runs': '-1' is not an unsigned integer"},
    {"max_runs = 12abc", "key 'max_runs': '12abc' is not an unsigned integer"},
    {"max_runs = 99999999999999999999999",
     "key 'max_runs': '99999999999999999999999' is too large"},
    {"max_runs =", "key 'max_runs': '' is not an unsigned integer"},
    {"http_threads = 65", "key 'http_threads': 65 is outside"},
    {"max_unauthenticated = 0", "key 'max_unauthenticated': 0 is outside"},
    {"max_unauthenticated_per_address = 0", "key 'max_unauthenticated_per_address': 0 is outside"},
    {"metrics_max_runs = 65", "key 'metrics_max_runs': 65 is outside"},
    {"max_frame_bytes = 2G", "key 'max_frame_bytes': 2G is outside"},
    {"max_frame_bytes = 1k", "key 'max_frame_bytes': 1k is outside"},
    {"max_frame_bytes = 5X", "key 'max_frame_bytes': '5X' is not a byte count"},
    {"spool_max_bytes = 99999999999999T", "key 'spool_max_bytes': '99999999999999T' is too large"},
    {"synchronous = off", "key 'synchronous': 'off' is not one of normal | full"},
    {"log_level = verbose", "key 'log_level': 'verbose' is not one of debug | info | warn | error"},
    {"listen = 127.0.0.1", "key 'listen': '127.0.0.1' is not HOST:PORT"},
    {"listen = :80", "key 'listen': ':80' is not HOST:PORT"},
    {"listen = host:65536", "key 'listen': '65536' is not a port number"},
    {"listen = ::1:80", "key 'listen': '::1:80': write an IPv6 address as [ADDR]:PORT"},
    {"db = ", "key 'db': length 0 is outside"},
    {"db = \"unterminated", "key 'db': bad quoted value"},
    {"just words", "config: t.conf:1: expected 'key = value'"},
    {"[nosuch]\nx = 1", "config: t.conf:1: unknown section [nosuch]"},
    {"[broken", "config: t.conf:1: bad section header"},
    {"reduce_timeout_s = 0", "key 'reduce_timeout_s': 0 is outside the range"},
    {"reduce_timeout_s = soon", "key 'reduce_timeout_s': 'soon' is not a finite number"},
    {"reduce_max_bytes = 1K", "key 'reduce_max_bytes': 1K is outside"},
    {"detect_from_step = -5", "key 'detect_from_step': '-5' is not an unsigned integer"},
    {"monitor_threads = 1025", "key 'monitor_threads': 1025 is outside"},
    {"head_points_every = 0", "key 'head_points_every': 0 is outside"},
    /* A key given twice is refused, naming both lines (it used to be taken,
     * the last one winning, while a section given twice was refused). */
    {"max_runs = 10\nmax_runs = 20", "t.conf:2: key 'max_runs': given twice in this section "
                                     "(first at line 1)"},
    {"max_runs = 10\n# x\n\n  max_runs=10", "t.conf:4: key 'max_runs': given twice"},
    /* A byte order mark only at the very start (below: accepted there). */
    {"max_runs = 1\n\xEF\xBB\xBF"
     "db = x",
     "t.conf:2: expected 'key = value'"},
    {"\xEF\xBB\xBF\xEF\xBB\xBFmax_runs = 1", "t.conf:1: expected 'key = value'"},
};

Test(config, errors_table)
{
    for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
        const struct bad_case *c = &bad_cases[i];
        struct fs_config cfg;
        config_defaults(&cfg);
        struct fs_err err = {0};
        int rc = config_parse(c->text, strlen(c->text), "t.conf", &cfg, NULL, 0, &err);
        cr_expect_eq(rc, -EINVAL, "'%s' parsed", c->text);
        cr_expect(strstr(err.msg, c->want), "'%s': got '%s', want '%s'", c->text, err.msg, c->want);
    }
}

Test(config, comments_and_blank_lines)
{
    const char *text = "# a comment\n"
                       "; another\n"
                       "\n"
                       "   # indented comment\n"
                       "max_runs = 20   ; a comment after a value\n"
                       "db = a.db\n";
    struct fs_config cfg;
    config_defaults(&cfg);
    struct fs_err err = {0};
    cr_assert_eq(config_parse(text, strlen(text), "t", &cfg, NULL, 0, &err), 0, "%s", err.msg);
    cr_expect_eq(cfg.max_runs, 20);
    cr_expect_str_eq(cfg.db, "a.db");
    cr_expect_eq(cfg.listen.port, 7781, "untouched keys keep defaults");
}

/* A UTF-8 byte order mark at the start of the file (some editors write
 * one) is not text: the file parses as without it. */
Test(config, utf8_bom_at_start)
{
    const char *texts[] = {"\xEF\xBB\xBFmax_runs = 7\n", "\xEF\xBB\xBF# comment\nmax_runs = 7",
                           "\xEF\xBB\xBF\nmax_runs = 7"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        struct fs_config cfg;
        config_defaults(&cfg);
        struct fs_err err = {0};
        cr_expect_eq(config_parse(texts[i], strlen(texts[i]), "t", &cfg, NULL, 0, &err), 0,
                     "case %zu: %s", i, err.msg);
        cr_expect_eq(cfg.max_runs, 7, "case %zu", i);
    }
    struct fs_config cfg;
    config_defaults(&cfg);
    struct fs_err err = {0};
    const char bom_only[] = "\xEF\xBB\xBF";
    cr_expect_eq(config_parse(bom_only, 3, "t", &cfg, NULL, 0, &err), 0, "%s", err.msg);
}

Test(config, line_too_long_and_nul)
{
    static char text[FS_CONFIG_MAX_LINE + 32];
    memset(text, 'a', sizeof(text) - 1);
    text[sizeof(text) - 1] = '\0';
    struct fs_config cfg;
    config_defaults(&cfg);
    struct fs_err err = {0};
    cr_expect_eq(config_parse(text, strlen(text), "t", &cfg, NULL, 0, &err), -EINVAL);
    cr_expect(strstr(err.msg, "line longer than"), "%s", err.msg);
    const char nul[] = "max_runs = 1\0 0";
    cr_expect_eq(config_parse(nul, sizeof(nul) - 1, "t", &cfg, NULL, 0, &err), -EINVAL);
    cr_expect(strstr(err.msg, "NUL"), "%s", err.msg);
}

/* A later module's section: [detect "name"] with its own keys. */
struct detect_rule {
    char name[64];
    double z;
    uint64_t hold;
};

struct detect_table {
    struct detect_rule rules[4];
    int n;
};

static const struct config_key detect_keys[] = {
    {.name = "z",
     .type = CONFIG_DOUBLE,
     .min = 0.5,
     .max = 100,
     .offset = offsetof(struct detect_rule, z),
     .size = sizeof(double),
     .help = "z threshold"},
    {.name = "hold",
     .type = CONFIG_UINT,
     .min = 1,
     .max = 1000,
     .offset = offsetof(struct detect_rule, hold),
     .size = sizeof(uint64_t),
     .help = "samples"},
};

static void *detect_open(void *ctx, const char *sub, struct fs_err *why)
{
    struct detect_table *t = ctx;
    if (!sub) {
        fs_err_set(why, -EINVAL, "needs a monitor name, e.g. [detect \"qk.d2.erank\"]");
        return NULL;
    }
    if (t->n == 4) {
        fs_err_set(why, -EINVAL, "too many");
        return NULL;
    }
    struct detect_rule *r = &t->rules[t->n++];
    snprintf(r->name, sizeof(r->name), "%s", sub);
    r->z = 5;
    r->hold = 3;
    return r;
}

Test(config, registered_sections)
{
    const char *text = "max_runs = 9\n"
                       "[detect \"qk.d2.erank\"]\n"
                       "z = 4.5\n"
                       "[ detect \"loss\" ]  # spaces are fine\n"
                       "hold = 7\n"
                       "z = 3\n"; /* a key of another section: not given twice */
    struct detect_table t = {0};
    struct config_section sec = {
        .name = "detect", .keys = detect_keys, .nkeys = 2, .open = detect_open, .ctx = &t};
    struct fs_config cfg;
    config_defaults(&cfg);
    struct fs_err err = {0};
    cr_assert_eq(config_parse(text, strlen(text), "t", &cfg, &sec, 1, &err), 0, "%s", err.msg);
    cr_expect_eq(cfg.max_runs, 9);
    cr_assert_eq(t.n, 2);
    cr_expect_str_eq(t.rules[0].name, "qk.d2.erank");
    cr_expect_eq(t.rules[0].z, 4.5);
    cr_expect_eq(t.rules[0].hold, 3);
    cr_expect_str_eq(t.rules[1].name, "loss");
    cr_expect_eq(t.rules[1].hold, 7);
    cr_expect_eq(t.rules[1].z, 3);

    /* Top-level keys are not valid inside a section, and vice versa. */
    const struct bad_case bad[] = {
        {"[detect \"x\"]\nmax_runs = 1",
         "config: t:2: key 'max_runs': unknown key in section [detect]"},
        {"z = 1", "config: t:1: key 'z': unknown key"},
        {"[detect]\n", "config: t:1: section [detect]: needs a monitor name"},
        {"[detect \"x\"]\nz = 0.1", "config: t:2: key 'z': 0.1 is outside the range 0.5..100"},
        {"[detect \"x\"]\nz = nan", "key 'z': 'nan' is not a finite number"},
        /* Given twice: a section (any, not only [run] and [target]) and a
         * key within one section, each naming the first line. */
        {"[detect \"x\"]\nz = 4\n[detect \"y\"]\n[detect \"x\"]\nhold = 2",
         "config: t:4: section [detect \"x\"] given twice (first at line 1)"},
        {"[detect \"x\"]\nz = 4\nhold = 2\nz = 5",
         "config: t:4: key 'z': given twice in this section (first at line 2)"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&t, 0, sizeof(t));
        int rc = config_parse(bad[i].text, strlen(bad[i].text), "t", &cfg, &sec, 1, &err);
        cr_expect_eq(rc, -EINVAL, "'%s'", bad[i].text);
        cr_expect(strstr(err.msg, bad[i].want), "'%s': got '%s'", bad[i].text, err.msg);
    }
}

Test(config, set_from_command_line_and_check)
{
    struct fs_config cfg;
    config_defaults(&cfg);
    struct fs_err err = {0};
    cr_expect_eq(config_set(&cfg, "listen", "127.0.0.1:0", "command line", &err), 0);
    cr_expect_eq(cfg.listen.port, 0);
    cr_expect_eq(config_set(&cfg, "log_level", "loud", "command line", &err), -EINVAL);
    cr_expect_str_eq(err.msg,
                     "config: command line: key 'log_level': 'loud' is not one of debug | info | "
                     "warn | error");
    cr_expect_eq(config_set(&cfg, "bogus", "1", "command line", &err), -EINVAL);
    cr_expect(strstr(err.msg, "key 'bogus': unknown key"), "%s", err.msg);

    cfg.writer_queue_max_items = 10;
    cfg.writer_batch_max_items = 11;
    cr_expect_eq(config_check(&cfg, "f.conf", &err), -EINVAL);
    cr_expect(strstr(err.msg, "config: f.conf: key 'writer_batch_max_items'"), "%s", err.msg);

    config_defaults(&cfg);
    cr_expect_eq(config_set(&cfg, "frame_buffer_max_bytes", "16M", "command line", &err), 0);
    cr_expect_eq(config_check(&cfg, "f.conf", &err), -EINVAL); /* below max_frame_bytes 64M */
    cr_expect(strstr(err.msg, "key 'frame_buffer_max_bytes'") &&
                  strstr(err.msg, "below max_frame_bytes"),
              "%s", err.msg);
    cr_expect_eq(config_set(&cfg, "max_frame_bytes", "16M", "command line", &err), 0);
    cr_expect_eq(config_check(&cfg, "f.conf", &err), 0, "%s", err.msg);
}

Test(config, load_file)
{
    char path[] = "/tmp/fs-config-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    const char *text = "db = from-file.db\nmax_runs = 0\n";
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    struct fs_config cfg;
    config_defaults(&cfg);
    struct fs_err err = {0};
    cr_expect_eq(config_load_file(path, &cfg, NULL, 0, &err), -EINVAL);
    char want[256];
    snprintf(want, sizeof(want), "config: %s:2: key 'max_runs'", path);
    cr_expect(strstr(err.msg, want), "%s", err.msg);
    cr_expect_str_eq(cfg.db, "from-file.db");
    unlink(path);
    cr_expect_eq(config_load_file(path, &cfg, NULL, 0, &err), -ENOENT);
    cr_expect(strstr(err.msg, "cannot open"), "%s", err.msg);
}

/* TLS keys come in pairs; a client CA needs ingest TLS. */
static const struct {
    const char *keys[3][2];
    const char *says; /* NULL: accepted */
} tls_cases[] = {
    {{{"tls_cert", "c.pem"}, {"tls_key", "k.pem"}, {NULL, NULL}}, NULL},
    {{{"tls_cert", "c.pem"}, {NULL, NULL}, {NULL, NULL}},
     "key 'tls_key': is needed with 'tls_cert'"},
    {{{"tls_key", "k.pem"}, {NULL, NULL}, {NULL, NULL}},
     "key 'tls_cert': is needed with 'tls_key'"},
    {{{"http_tls_cert", "c.pem"}, {NULL, NULL}, {NULL, NULL}}, "key 'http_tls_key'"},
    {{{"tls_client_ca", "ca.pem"}, {NULL, NULL}, {NULL, NULL}}, "key 'tls_client_ca'"},
    {{{"tls_cert", "c.pem"}, {"tls_key", "k.pem"}, {"tls_client_ca", "ca.pem"}}, NULL},
};

Test(config, tls_keys_checked_together)
{
    for (size_t i = 0; i < sizeof(tls_cases) / sizeof(tls_cases[0]); i++) {
        struct fs_config cfg;
        struct fs_err err = {0};
        config_defaults(&cfg);
        for (int k = 0; k < 3 && tls_cases[i].keys[k][0]; k++)
            cr_assert_eq(config_set(&cfg, tls_cases[i].keys[k][0], tls_cases[i].keys[k][1],
                                    "command line", &err),
                         0, "%s", err.msg);
        int rc = config_check(&cfg, "f.conf", &err);
        if (!tls_cases[i].says) {
            cr_expect_eq(rc, 0, "case %zu: %s", i, err.msg);
            continue;
        }
        cr_expect_eq(rc, -EINVAL, "case %zu accepted", i);
        cr_expect(strstr(err.msg, tls_cases[i].says), "case %zu: %s", i, err.msg);
    }
}
