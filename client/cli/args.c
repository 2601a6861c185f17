/* Table-driven option parsing and the help text built from the same table. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

void args_usage(FILE *out, const struct opt *opts, size_t n, const struct command_help *help)
{
    fprintf(out, "usage: %s\n\n%s\n\noptions:\n", help->usage, help->summary);
    for (size_t i = 0; i < n; i++) {
        char left[64];
        snprintf(left, sizeof(left), "--%s%s%s", opts[i].name, opts[i].arg ? " " : "",
                 opts[i].arg ? opts[i].arg : "");
        fprintf(out, "  %-24s %s%s\n", left, opts[i].help, opts[i].required ? " (required)" : "");
    }
    fprintf(out, "  %-24s %s\n", "--help", "show this help");
}

int args_hostport(const char *s, char *host, size_t hostlen, uint16_t *port)
{
    const char *colon = strrchr(s, ':');
    char *end;
    unsigned long p;
    size_t hl;

    if (!colon || colon == s)
        return -EINVAL;
    hl = (size_t)(colon - s);
    if (hl >= hostlen)
        return -EINVAL;
    errno = 0;
    p = strtoul(colon + 1, &end, 10);
    if (errno || end == colon + 1 || *end || p < 1 || p > 65535)
        return -EINVAL;
    memcpy(host, s, hl);
    host[hl] = '\0';
    *port = (uint16_t)p;
    return 0;
}

/* Stores one value. Returns 0 or CLI_USAGE with err. */
static int store(const struct opt *o, const char *val, void *settings, char *err, size_t errlen)
{
    char *field = (char *)settings + o->offset, *end, host[CLI_MAX_HOSTPORT];
    unsigned long long u;
    uint16_t port;
    double d;

    switch (o->kind) {
    case OPT_FLAG:
        *(int *)field = 1;
        return 0;
    case OPT_STR:
        if (!*val) {
            snprintf(err, errlen, "--%s: empty value", o->name);
            return CLI_USAGE;
        }
        *(const char **)field = val;
        return 0;
    case OPT_HOSTPORT:
        if (args_hostport(val, host, sizeof(host), &port) < 0) {
            snprintf(err, errlen, "--%s: '%s' is not HOST:PORT (port 1..65535)", o->name, val);
            return CLI_USAGE;
        }
        *(const char **)field = val;
        return 0;
    case OPT_U64:
    case OPT_U32:
        errno = 0;
        u = strtoull(val, &end, 10);
        if (errno || end == val || *end || val[0] == '-' || u < o->min || u > o->max) {
            snprintf(err, errlen, "--%s: '%s' is not an integer in %llu..%llu", o->name, val,
                     (unsigned long long)o->min, (unsigned long long)o->max);
            return CLI_USAGE;
        }
        if (o->kind == OPT_U64)
            *(uint64_t *)field = u;
        else
            *(uint32_t *)field = (uint32_t)u;
        return 0;
    case OPT_DOUBLE:
        errno = 0;
        d = strtod(val, &end);
        if (errno || end == val || *end || !isfinite(d) || d < o->dmin || d > o->dmax) {
            snprintf(err, errlen, "--%s: '%s' is not a number in %g..%g", o->name, val, o->dmin,
                     o->dmax);
            return CLI_USAGE;
        }
        *(double *)field = d;
        return 0;
    }
    return CLI_USAGE;
}

int args_parse(const struct opt *opts, size_t n, int argc, char **argv, void *settings,
               const struct command_help *help, char *err, size_t errlen)
{
    int seen[CLI_MAX_OPTS] = {0};

    if (n > CLI_MAX_OPTS) {
        snprintf(err, errlen, "internal: too many options");
        return CLI_USAGE;
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *name, *eq, *val = NULL;
        size_t nl, k;
        int rc;

        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            args_usage(stdout, opts, n, help);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) {
            snprintf(err, errlen, "unexpected argument '%s'", a);
            return CLI_USAGE;
        }
        name = a + 2;
        eq = strchr(name, '=');
        nl = eq ? (size_t)(eq - name) : strlen(name);
        for (k = 0; k < n; k++)
            if (strlen(opts[k].name) == nl && !strncmp(opts[k].name, name, nl))
                break;
        if (k == n) {
            snprintf(err, errlen, "unknown option '--%.*s'", (int)nl, name);
            return CLI_USAGE;
        }
        if (opts[k].kind == OPT_FLAG) {
            if (eq) {
                snprintf(err, errlen, "--%s takes no value", opts[k].name);
                return CLI_USAGE;
            }
        } else if (eq) {
            val = eq + 1;
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            snprintf(err, errlen, "--%s needs a value (%s)", opts[k].name, opts[k].arg);
            return CLI_USAGE;
        }
        if ((rc = store(&opts[k], val, settings, err, errlen)) != 0)
            return rc;
        seen[k] = 1;
    }
    for (size_t k = 0; k < n; k++)
        if (opts[k].required && !seen[k]) {
            snprintf(err, errlen, "--%s is required", opts[k].name);
            return CLI_USAGE;
        }
    return 0;
}
