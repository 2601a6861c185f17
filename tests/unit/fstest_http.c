/* fstest.h: the HTTP API server on 127.0.0.1:0 over a temporary database,
 * and requests to it. */
#include "fstest.h"

#include <criterion/criterion.h>

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

struct http_fixture http_fx;

void http_fixture_open(const char *tag)
{
    memset(&http_fx, 0, sizeof(http_fx));
    tmpdb_make(&http_fx.db, tag);
    cr_assert_eq(sqlite3_open(http_fx.db.path, &http_fx.rw), SQLITE_OK);
    db_apply_schema(http_fx.rw, true, true);
    atomic_store(&http_fx.stats.ready, 1);
    cr_assert_eq(curl_global_init(CURL_GLOBAL_DEFAULT), 0);
}

void http_fixture_start(unsigned threads)
{
    struct http_opts o = {.host = "127.0.0.1",
                          .port = 0,
                          .db_path = http_fx.db.path,
                          .threads = threads,
                          .stats = &http_fx.stats};
    struct fs_err err = {0};
    int rc = http_start(&o, &http_fx.srv, &err);
    cr_assert_eq(rc, 0, "http_start: %d %s", rc, err.msg);
    http_fx.port = http_port(http_fx.srv);
    cr_assert_neq(http_fx.port, 0);
}

void http_fixture_close(void)
{
    if (http_fx.srv)
        http_stop(http_fx.srv);
    http_fx.srv = NULL;
    sqlite3_close(http_fx.rw);
    http_fx.rw = NULL;
    tmpdb_remove(&http_fx.db);
    curl_global_cleanup();
}

void request(CURL *h, const char *method, const char *path, const char *body, struct resp *r)
{
    request_at(http_fx.port, h, method, path, body, r);
}

json_t *get_json(const char *path, long status, struct resp *r)
{
    return get_json_at(http_fx.port, path, status, r);
}

void expect_error(const char *method, const char *path, long status, const char *code,
                  const char *mention)
{
    struct resp r;
    request(NULL, method, path, NULL, &r);
    cr_assert_eq(r.status, status, "%s %s: status %ld, expected %ld: %s", method ? method : "GET",
                 path, r.status, status, r.body ? r.body : "");
    cr_assert_not_null(r.json, "%s: error body is not JSON: %s", path, r.body ? r.body : "");
    json_t *err = json_object_get(r.json, "error");
    cr_assert(json_is_object(err), "%s: no error object", path);
    cr_assert_str_eq(json_string_value(json_object_get(err, "code")), code, "%s", path);
    const char *msg = json_string_value(json_object_get(err, "message"));
    cr_assert_not_null(msg, "%s: no message", path);
    if (mention)
        cr_assert(strstr(msg, mention), "%s: message '%s' does not mention %s", path, msg, mention);
    resp_free(&r);
}
