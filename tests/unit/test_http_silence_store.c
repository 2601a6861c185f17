/* The silences API's store item: insert and expire through the writer
 * thread with a waiter, the outcomes (0, -EALREADY, -ENOENT, -ECANCELED),
 * and a waiter released before the writer settles it (ASan checks the
 * reference counting). */
#include <criterion/criterion.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fstest.h"
#include "store.h"

static struct tmpdb db;
static struct fs_stats stats;
static struct store *s;

static void setup(void)
{
    tmpdb_make(&db, "silstore");
    struct store_opts o = {.max_runs = 10,
                           .queue_max_items = 100,
                           .queue_max_bytes = 1 << 20,
                           .batch_max_items = 16,
                           .stats = &stats};
    struct fs_err err = {0};
    cr_assert_eq(store_open(db.path, &o, &s, &err), 0, "%s", err.msg);
}

static void teardown(void)
{
    store_close(s);
    tmpdb_remove(&db);
}

static struct store_item *insert_item(void)
{
    struct store_item *it = store_item_new(STORE_ITEM_SILENCE);
    cr_assert_not_null(it);
    it->silence.op = STORE_SILENCE_INSERT;
    it->silence.matchers_json = strdup("[{\"name\":\"run\",\"value\":\"r\"}]");
    it->silence.created_by = strdup("me");
    it->silence.comment = strdup("");
    it->silence.starts_at = 1000;
    it->silence.ends_at = 4e9;
    return it;
}

static struct store_item *expire_item(int64_t id)
{
    struct store_item *it = store_item_new(STORE_ITEM_SILENCE);
    cr_assert_not_null(it);
    it->silence.op = STORE_SILENCE_EXPIRE;
    it->silence.id = id;
    return it;
}

/* Submits it and waits; returns the outcome and *id. */
static int run(struct store_item *it, int64_t *id)
{
    struct store_waiter *w = store_waiter_new();
    cr_assert_not_null(w);
    it->silence.waiter = store_waiter_ref(w);
    cr_assert_eq(store_submit(s, it), 0);
    int rc = store_waiter_wait(w, 30000, id);
    store_waiter_put(w);
    return rc;
}

Test(silence_store, outcomes_table, .init = setup, .fini = teardown)
{
    int64_t id = 0;
    cr_expect_eq(run(insert_item(), &id), 0);
    cr_expect_eq(id, 1);
    cr_expect_eq(run(insert_item(), &id), 0);
    cr_expect_eq(id, 2);
    static const struct {
        int64_t id;
        int want;
    } cases[] = {{1, 0}, {1, -EALREADY}, {99, -ENOENT}, {2, 0}, {2, -EALREADY}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t got = -1;
        cr_expect_eq(run(expire_item(cases[i].id), &got), cases[i].want, "case %zu", i);
    }
}

Test(silence_store, freed_unwritten_is_canceled, .init = setup, .fini = teardown)
{
    struct store_waiter *w = store_waiter_new();
    struct store_item *it = insert_item();
    it->silence.waiter = store_waiter_ref(w);
    store_item_free(it); /* e.g. store_submit refused it */
    int64_t id = 0;
    cr_expect_eq(store_waiter_wait(w, 1000, &id), -ECANCELED);
    store_waiter_put(w);
}

Test(silence_store, waiter_gone_first, .init = setup, .fini = teardown)
{
    /* The HTTP side gives up at once; the writer settles and frees later. */
    for (int i = 0; i < 50; i++) {
        struct store_waiter *w = store_waiter_new();
        struct store_item *it = insert_item();
        it->silence.waiter = store_waiter_ref(w);
        cr_assert_eq(store_submit(s, it), 0);
        int64_t id;
        int rc = store_waiter_wait(w, 0, &id);
        cr_expect(rc == -ETIMEDOUT || rc == 0, "rc %d", rc);
        store_waiter_put(w);
    }
    store_flush(s);
    /* everything was written all the same */
    int64_t id = 0;
    cr_expect_eq(run(insert_item(), &id), 0);
    cr_expect_eq(id, 51);
}

/* The pager matches at most FS_STORE_MAX_LIVE_SILENCES active or future
 * silences: the writer refuses one more (-ENOSPC) rather than store a
 * silence that would hold nothing; an expired one does not count. */
Test(silence_store, live_silences_bounded, .init = setup, .fini = teardown)
{
    for (unsigned i = 0; i + 1 < FS_STORE_MAX_LIVE_SILENCES; i++)
        cr_assert_eq(store_submit(s, insert_item()), 0);
    store_flush(s);
    int64_t id = 0;
    cr_expect_eq(run(insert_item(), &id), 0, "the last one that fits");
    cr_expect_eq(id, (int64_t)FS_STORE_MAX_LIVE_SILENCES);
    cr_expect_eq(run(insert_item(), &id), -ENOSPC, "one more than the pager loads");
    struct store_item *past = insert_item();
    past->silence.starts_at = 100;
    past->silence.ends_at = 200; /* already over: holds nothing, costs the pager nothing */
    cr_expect_eq(run(past, &id), 0);
    cr_expect_eq(run(expire_item(7), &id), 0);
    cr_expect_eq(run(insert_item(), &id), 0, "room again after an expiry");
    cr_expect_eq(run(insert_item(), &id), -ENOSPC);
}
