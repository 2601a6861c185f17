/* Silences: parsing, validation and matching of label matchers. Pure. */

#include "silence.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>

/* Anchoring, '$' as Go's, and byte-wise matching that a pattern cannot
 * switch to UTF (where an invalid byte sequence in a label value would be
 * a match error) or to Unicode properties; \C is refused with them. */
#define SILENCE_RE_OPTIONS                                                                         \
    (PCRE2_ANCHORED | PCRE2_ENDANCHORED | PCRE2_DOLLAR_ENDONLY | PCRE2_NEVER_UTF |                 \
     PCRE2_NEVER_UCP | PCRE2_NEVER_BACKSLASH_C)

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

/* The compiler's allocator. For a pattern of at most SILENCE_MAX_VALUE
 * bytes PCRE2 keeps its work areas on the stack and allocates only the
 * compiled pattern (and the contexts), so refusing any block larger than
 * SILENCE_RE_MAX_COMPILED bounds what one compile can take, whatever
 * PCRE2's own ceiling (64 KiB of code with the default LINK_SIZE 2, none
 * worth the name with LINK_SIZE 4). The compiled pattern keeps this
 * allocator for pcre2_code_copy and pcre2_code_free, so it holds no state:
 * data is NULL. */
static void *re_malloc(PCRE2_SIZE size, void *data)
{
    (void)data;
    return size > SILENCE_RE_MAX_COMPILED ? NULL : malloc(size);
}

static void re_free(void *p, void *data)
{
    (void)data;
    free(p);
}

struct compile {
    pcre2_general_context *gen;
    pcre2_compile_context *cc;
    size_t total; /* compiled bytes of the silence so far */
};

static int compile_init(struct compile *c)
{
    c->gen = pcre2_general_context_create(re_malloc, re_free, NULL);
    c->cc = c->gen != NULL ? pcre2_compile_context_create(c->gen) : NULL;
    if (!c->cc)
        return -ENOMEM;
    pcre2_set_parens_nest_limit(c->cc, SILENCE_RE_MAX_NEST);
    pcre2_set_max_pattern_length(c->cc, SILENCE_MAX_VALUE);
    return 0;
}

static void compile_done(struct compile *c)
{
    pcre2_compile_context_free(c->cc);
    pcre2_general_context_free(c->gen);
}

/* The match limits of a silence with regexes (read-only once made). */
static pcre2_match_context *limits_new(void)
{
    pcre2_match_context *mc = pcre2_match_context_create(NULL);
    if (mc) {
        pcre2_set_match_limit(mc, SILENCE_RE_MATCH_LIMIT);
        pcre2_set_depth_limit(mc, SILENCE_RE_DEPTH_LIMIT);
        pcre2_set_heap_limit(mc, SILENCE_RE_HEAP_LIMIT_KIB);
    }
    return mc;
}

/* Does matcher m hold for value v (the label's value, "" when absent)?
 * *md: match data, made on first use, the caller frees it. A regex match
 * that hits a limit, or finds no memory, is undecided: the matcher does
 * not hold, for !~ as for =~ (silence.h says why). limits is not const
 * only because pcre2_match's prototype says so: PCRE2 documents that a
 * context nobody changes may be used by several threads at once. */
static bool matcher_holds(const struct silence_matcher *m, const char *v,
                          pcre2_match_context *limits, pcre2_match_data **md)
{
    bool hit;
    if (!m->is_regex) {
        hit = strcmp(m->value, v) == 0;
    } else {
        if (!m->re || !limits)
            return false;
        if (!*md && !(*md = pcre2_match_data_create(1, NULL)))
            return false;
        int rc = pcre2_match(m->re, (PCRE2_SPTR)v, strlen(v), 0, 0, *md, limits);
        if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)
            return false;
        hit = rc >= 0; /* 0: matched, the one-pair ovector too small for the groups */
    }
    return m->is_equal ? hit : !hit;
}

void silence_free(struct silence *s)
{
    for (size_t i = 0; i < s->n; i++) {
        pcre2_code_free(s->m[i].re);
        s->m[i].re = NULL;
    }
    s->n = 0;
    pcre2_match_context_free(s->limits);
    s->limits = NULL;
}

int silence_copy(struct silence *dst, const struct silence *src)
{
    *dst = *src;
    dst->n = 0;
    dst->limits = NULL;
    if (src->limits && !(dst->limits = pcre2_match_context_copy(src->limits)))
        return -ENOMEM;
    for (size_t i = 0; i < src->n; i++) {
        dst->m[i].re = NULL;
        /* the copy allocates through re_malloc again, and src's pattern fit */
        if (src->m[i].re && !(dst->m[i].re = pcre2_code_copy(src->m[i].re))) {
            silence_free(dst);
            return -ENOMEM;
        }
        dst->n = i + 1;
    }
    return 0;
}

/* Compiles m->value into m->re within the bounds of silence.h. */
static int compile_one(struct compile *c, size_t i, struct silence_matcher *m, struct fs_err *why)
{
    if (!c->cc && compile_init(c) != 0)
        return -ENOMEM;
    int err;
    PCRE2_SIZE off;
    m->re = pcre2_compile((PCRE2_SPTR)m->value, strlen(m->value), SILENCE_RE_OPTIONS, &err, &off,
                          c->cc);
    if (!m->re) {
        /* re_malloc's refusal and a failed malloc look the same; with
         * blocks of at most 8 KiB the first is the likely one, and
         * refusing the silence is the safe side of the second. */
        if (err == PCRE2_ERROR_HEAP_FAILED)
            return fs_err_set(why, -EINVAL,
                              "matchers[%zu]: regular expression compiles to more than %u bytes", i,
                              SILENCE_RE_MAX_COMPILED);
        if (err == PCRE2_ERROR_PARENTHESES_NEST_TOO_DEEP)
            return fs_err_set(why, -EINVAL,
                              "matchers[%zu]: bad regular expression: parentheses nested deeper "
                              "than %u",
                              i, SILENCE_RE_MAX_NEST);
        PCRE2_UCHAR msg[128];
        if (pcre2_get_error_message(err, msg, sizeof msg) < 0)
            snprintf((char *)msg, sizeof msg, "error %d", err);
        return fs_err_set(why, -EINVAL, "matchers[%zu]: bad regular expression at offset %zu: %s",
                          i, (size_t)off, (const char *)msg);
    }
    size_t size = 0;
    pcre2_pattern_info(m->re, PCRE2_INFO_SIZE, &size);
    c->total += size;
    if (size > SILENCE_RE_MAX_COMPILED || c->total > SILENCE_RE_MAX_COMPILED_SILENCE) {
        pcre2_code_free(m->re);
        m->re = NULL;
        return fs_err_set(why, -EINVAL,
                          "matchers[%zu]: regular expressions compile to more than %u bytes per "
                          "silence (this one to %zu)",
                          i, SILENCE_RE_MAX_COMPILED_SILENCE, size);
    }
    return 0;
}

static int parse_one(json_t *o, size_t i, struct silence_matcher *m, struct compile *c,
                     struct fs_err *why)
{
    m->re = NULL;
    if (!json_is_object(o))
        return fs_err_set(why, -EINVAL, "matchers[%zu]: not an object", i);
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        if (strcmp(key, "name") != 0 && strcmp(key, "value") != 0 && strcmp(key, "isRegex") != 0 &&
            strcmp(key, "isEqual") != 0)
            return fs_err_set(why, -EINVAL, "matchers[%zu]: unknown field '%.32s'", i, key);
    }
    json_t *name = json_object_get(o, "name");
    json_t *value = json_object_get(o, "value");
    json_t *is_regex = json_object_get(o, "isRegex");
    json_t *is_equal = json_object_get(o, "isEqual");
    if (!json_is_string(name))
        return fs_err_set(why, -EINVAL, "matchers[%zu]: \"name\" must be a string", i);
    if (!json_is_string(value))
        return fs_err_set(why, -EINVAL, "matchers[%zu]: \"value\" must be a string", i);
    if (is_regex && !json_is_boolean(is_regex))
        return fs_err_set(why, -EINVAL, "matchers[%zu]: \"isRegex\" must be true or false", i);
    if (is_equal && !json_is_boolean(is_equal))
        return fs_err_set(why, -EINVAL, "matchers[%zu]: \"isEqual\" must be true or false", i);
    size_t nlen = json_string_length(name), vlen = json_string_length(value);
    if (!name_valid(json_string_value(name), nlen))
        return fs_err_set(why, -EINVAL,
                          "matchers[%zu]: name must match [A-Za-z_][A-Za-z0-9_]* and be at most %u "
                          "bytes",
                          i, SILENCE_MAX_NAME);
    if (vlen > SILENCE_MAX_VALUE || memchr(json_string_value(value), '\0', vlen))
        return fs_err_set(why, -EINVAL, "matchers[%zu]: value longer than %u bytes or holds NUL", i,
                          SILENCE_MAX_VALUE);
    memcpy(m->name, json_string_value(name), nlen + 1);
    memcpy(m->value, json_string_value(value), vlen + 1);
    m->is_regex = is_regex != NULL && json_is_true(is_regex);
    m->is_equal = !is_equal || json_is_true(is_equal);
    return m->is_regex ? compile_one(c, i, m, why) : 0;
}

int silence_parse(const char *json, size_t len, struct silence *s, struct fs_err *why)
{
    s->n = 0;
    s->limits = NULL;
    if (len > SILENCE_MAX_JSON)
        return fs_err_set(why, -EINVAL, "matchers: longer than %u bytes", SILENCE_MAX_JSON);
    json_error_t jerr;
    json_t *doc = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!doc)
        return fs_err_set(why, -EINVAL, "matchers: not JSON: %s", jerr.text);
    struct compile c = {0};
    pcre2_match_data *md = NULL;
    int rc = 0;
    if (!json_is_array(doc)) {
        rc = fs_err_set(why, -EINVAL, "matchers: must be an array");
        goto out;
    }
    size_t n = json_array_size(doc);
    if (n == 0 || n > SILENCE_MAX_MATCHERS) {
        rc = fs_err_set(why, -EINVAL, "matchers: need 1 to %u matchers, got %zu",
                        SILENCE_MAX_MATCHERS, n);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        rc = parse_one(json_array_get(doc, i), i, &s->m[i], &c, why);
        if (rc != 0)
            goto out;
        s->n = i + 1;
    }
    if (c.cc && !(s->limits = limits_new())) {
        rc = -ENOMEM;
        goto out;
    }
    /* A silence whose every matcher matches an absent label would match
     * every alert. (An undecided match of "" counts as selective: such a
     * matcher never holds, so the silence cannot match every alert.) */
    bool selective = false;
    for (size_t i = 0; i < s->n && !selective; i++)
        selective = !matcher_holds(&s->m[i], "", s->limits, &md);
    if (!selective)
        rc = fs_err_set(why, -EINVAL,
                        "matchers: at least one must not match the empty string "
                        "(this silence would match every alert)");
out:
    if (rc != 0)
        silence_free(s);
    pcre2_match_data_free(md);
    compile_done(&c);
    json_decref(doc);
    return rc;
}

bool silence_matches(const struct silence *s, const struct silence_label *labels, size_t n,
                     double now)
{
    if (!(s->starts_at <= now && now < s->ends_at) || s->n == 0)
        return false;
    pcre2_match_data *md = NULL; /* per call: s may be matched on several threads at once */
    bool all = true;
    for (size_t i = 0; i < s->n && all; i++) {
        const char *v = "";
        for (size_t j = 0; j < n; j++) {
            if (strcmp(labels[j].name, s->m[i].name) == 0) {
                v = labels[j].value;
                break;
            }
        }
        all = matcher_holds(&s->m[i], v, s->limits, &md);
    }
    pcre2_match_data_free(md);
    return all;
}

int silence_matchers_json(const struct silence *s, char *out, size_t outlen)
{
    json_t *arr = json_array();
    if (!arr)
        return -ENOMEM;
    for (size_t i = 0; i < s->n; i++) {
        json_t *o = json_pack("{s:s, s:s, s:b, s:b}", "name", s->m[i].name, "value", s->m[i].value,
                              "isRegex", s->m[i].is_regex, "isEqual", s->m[i].is_equal);
        if (!o || json_array_append_new(arr, o) != 0) {
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
