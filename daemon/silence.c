/* Silences: parsing, validation and matching of label matchers. Pure. */

#include "silence.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>

/* Anchored pattern: "^(" + value + ")$" */
#define SILENCE_ANCHOR_EXTRA 5u

static int why_set(char *why, size_t whylen, const char *fmt, ...)
{
    if (why != NULL && whylen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, whylen, fmt, ap);
        va_end(ap);
    }
    return -EINVAL;
}

static bool name_valid(const char *s, size_t n)
{
    if (n == 0 || n > SILENCE_MAX_NAME)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
        bool digit = c >= '0' && c <= '9';
        if (!alpha && !(digit && i > 0))
            return false;
    }
    return true;
}

/* Does matcher m match value v (the label's value, "" when absent)? */
static bool matcher_matches(const struct silence_matcher *m, const char *v)
{
    bool hit;
    if (m->is_regex)
        hit = m->compiled && regexec(&m->re, v, 0, NULL, 0) == 0;
    else
        hit = strcmp(m->value, v) == 0;
    return m->is_equal ? hit : !hit;
}

void silence_free(struct silence *s)
{
    for (size_t i = 0; i < s->n; i++) {
        if (s->m[i].compiled)
            regfree(&s->m[i].re);
        s->m[i].compiled = false;
    }
    s->n = 0;
}

static int parse_one(json_t *o, size_t i, struct silence_matcher *m, char *why, size_t whylen)
{
    if (!json_is_object(o))
        return why_set(why, whylen, "matchers[%zu]: not an object", i);
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        if (strcmp(key, "name") != 0 && strcmp(key, "value") != 0 &&
            strcmp(key, "isRegex") != 0 && strcmp(key, "isEqual") != 0)
            return why_set(why, whylen, "matchers[%zu]: unknown field '%.32s'", i, key);
    }
    json_t *name = json_object_get(o, "name");
    json_t *value = json_object_get(o, "value");
    json_t *is_regex = json_object_get(o, "isRegex");
    json_t *is_equal = json_object_get(o, "isEqual");
    if (!json_is_string(name))
        return why_set(why, whylen, "matchers[%zu]: \"name\" must be a string", i);
    if (!json_is_string(value))
        return why_set(why, whylen, "matchers[%zu]: \"value\" must be a string", i);
    if (is_regex != NULL && !json_is_boolean(is_regex))
        return why_set(why, whylen, "matchers[%zu]: \"isRegex\" must be true or false", i);
    if (is_equal != NULL && !json_is_boolean(is_equal))
        return why_set(why, whylen, "matchers[%zu]: \"isEqual\" must be true or false", i);
    size_t nlen = json_string_length(name), vlen = json_string_length(value);
    if (!name_valid(json_string_value(name), nlen))
        return why_set(why, whylen,
                       "matchers[%zu]: name must match [A-Za-z_][A-Za-z0-9_]* and be at most %u "
                       "bytes",
                       i, SILENCE_MAX_NAME);
    if (vlen > SILENCE_MAX_VALUE || memchr(json_string_value(value), '\0', vlen) != NULL)
        return why_set(why, whylen, "matchers[%zu]: value longer than %u bytes or holds NUL", i,
                       SILENCE_MAX_VALUE);
    memcpy(m->name, json_string_value(name), nlen + 1);
    memcpy(m->value, json_string_value(value), vlen + 1);
    m->is_regex = is_regex != NULL && json_is_true(is_regex);
    m->is_equal = is_equal == NULL || json_is_true(is_equal);
    m->compiled = false;
    if (m->is_regex) {
        char pat[SILENCE_MAX_VALUE + SILENCE_ANCHOR_EXTRA + 1];
        snprintf(pat, sizeof pat, "^(%s)$", m->value);
        int rc = regcomp(&m->re, pat, REG_EXTENDED | REG_NOSUB);
        if (rc != 0) {
            char msg[128];
            regerror(rc, &m->re, msg, sizeof msg);
            return why_set(why, whylen, "matchers[%zu]: bad regular expression: %s", i, msg);
        }
        m->compiled = true;
    }
    return 0;
}

int silence_parse(const char *json, size_t len, struct silence *s, char *why, size_t whylen)
{
    s->n = 0;
    if (len > SILENCE_MAX_JSON)
        return why_set(why, whylen, "matchers: longer than %u bytes", SILENCE_MAX_JSON);
    json_error_t jerr;
    json_t *doc = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (doc == NULL)
        return why_set(why, whylen, "matchers: not JSON: %s", jerr.text);
    int rc = 0;
    if (!json_is_array(doc)) {
        rc = why_set(why, whylen, "matchers: must be an array");
        goto out;
    }
    size_t n = json_array_size(doc);
    if (n == 0 || n > SILENCE_MAX_MATCHERS) {
        rc = why_set(why, whylen, "matchers: need 1 to %u matchers, got %zu", SILENCE_MAX_MATCHERS,
                     n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        rc = parse_one(json_array_get(doc, i), i, &s->m[i], why, whylen);
        if (rc != 0)
            goto out;
        s->n = i + 1;
    }
    /* A silence whose every matcher matches an absent label would match
     * every alert. */
    bool selective = false;
    for (size_t i = 0; i < s->n && !selective; i++)
        selective = !matcher_matches(&s->m[i], "");
    if (!selective)
        rc = why_set(why, whylen, "matchers: at least one must not match the empty string "
                                  "(this silence would match every alert)");
out:
    if (rc != 0)
        silence_free(s);
    json_decref(doc);
    return rc;
}

bool silence_matches(const struct silence *s, const struct silence_label *labels, size_t n,
                     double now)
{
    if (!(s->starts_at <= now && now < s->ends_at) || s->n == 0)
        return false;
    for (size_t i = 0; i < s->n; i++) {
        const char *v = "";
        for (size_t j = 0; j < n; j++) {
            if (strcmp(labels[j].name, s->m[i].name) == 0) {
                v = labels[j].value;
                break;
            }
        }
        if (!matcher_matches(&s->m[i], v))
            return false;
    }
    return true;
}

int silence_matchers_json(const struct silence *s, char *out, size_t outlen)
{
    json_t *arr = json_array();
    if (arr == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < s->n; i++) {
        json_t *o = json_pack("{s:s, s:s, s:b, s:b}", "name", s->m[i].name, "value",
                              s->m[i].value, "isRegex", s->m[i].is_regex, "isEqual",
                              s->m[i].is_equal);
        if (o == NULL || json_array_append_new(arr, o) != 0) {
            json_decref(arr);
            return -ENOMEM;
        }
    }
    size_t need = json_dumpb(arr, NULL, 0, JSON_COMPACT);
    int rc = 0;
    if (need == 0 || need + 1 > outlen) {
        rc = -ENOSPC;
    } else {
        json_dumpb(arr, out, outlen, JSON_COMPACT);
        out[need] = '\0';
    }
    json_decref(arr);
    return rc;
}
