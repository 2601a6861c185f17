/* HTTP writes that do not park a server thread. A write route hands its
 * item to the writer thread (store_submit) with http_write_submit() and
 * returns with c->write set instead of a reply; the request state machine
 * (http.c) then suspends the connection (MHD_suspend_connection) and queues
 * the write here with http_write_park(). One thread of ours, the write
 * waiter, waits for each outcome in turn (store_waiter_wait, until
 * HTTP_WRITE_WAIT_MS after the submit) and resumes the connection
 * (MHD_resume_connection, which any thread may call); libmicrohttpd then
 * calls the request back on a server thread, which answers it through the
 * route's done function (http_write_finish). A write is still answered only
 * once it is durable (or refused, or past its deadline: the route's 503),
 * but while the writer is slow the server threads go on answering reads and
 * probes: before, each write held one for up to 10 s, and as many writes as
 * threads stopped /healthz.
 *
 * Order: the writer settles items batch by batch in the order it takes
 * them, so waiting on the oldest write first delays no outcome by more than
 * the skew between two submits.
 *
 * Stopping: http_writes_stop() lets the waiter finish its queue (each write
 * at most until its deadline, as long as a parked server thread waited
 * before), joins it, and gives the resumed requests up to
 * HTTP_WRITE_STOP_ANSWER_MS to be answered, before MHD_stop_daemon, which
 * must find no suspended connection (and would close a resumed one
 * unanswered). A write dispatched after that waits on its server thread,
 * as every write did before.
 *
 * Threads: http_write_submit, http_write_park, http_write_finish and
 * http_write_free run on a libmicrohttpd server thread, inside a request;
 * the waiter is its own thread; init and stop run on the main thread. */

#include "http_internal.h"

#include "store.h"

struct http_write {
    struct http_writes *q;       /* parked on q (counted in q->parked); NULL: never parked */
    struct http_write *next;     /* the waiter's queue, under q->mu */
    struct MHD_Connection *conn; /* suspended while queued */
    struct store_waiter *waiter; /* our reference */
    double deadline;             /* fs_clock_mono(): HTTP_WRITE_WAIT_MS after the submit */
    http_write_done_fn done;
    int64_t arg;
    /* the outcome, set once (by the waiter, or inline when stopping) */
    bool settled;
    int rc;
    int64_t id;
};

/* Milliseconds left until deadline (fs_clock_mono), 0 when past. */
static unsigned ms_left(double deadline)
{
    double left = (deadline - fs_clock_mono()) * 1000.0;
    return left <= 0 ? 0u : left >= HTTP_WRITE_WAIT_MS ? HTTP_WRITE_WAIT_MS : (unsigned)left;
}

/* Waits for w's outcome until its deadline and records it. Any thread but
 * the writer's; w is not shared while this runs. */
static void settle(struct http_write *w)
{
    int64_t id = 0;
    w->rc = store_waiter_wait(w->waiter, ms_left(w->deadline), &id);
    w->id = id;
    w->settled = true;
}

static void *waiter_main(void *arg)
{
    struct http_writes *q = arg;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->head && !q->stop)
            pthread_cond_wait(&q->cv, &q->mu);
        struct http_write *w = q->head;
        if (!w)
            break; /* stopping, and nothing is left */
        /* Only this thread takes from the queue: w stays at its head while
         * we wait unlocked, and later writes queue up behind it. */
        pthread_mutex_unlock(&q->mu);
        settle(w);
        struct MHD_Connection *conn = w->conn;
        pthread_mutex_lock(&q->mu);
        q->head = w->next;
        if (!q->head)
            q->tail = NULL;
        pthread_mutex_unlock(&q->mu);
        /* From here w belongs to the request again: the server thread that
         * takes the resumed connection finishes and frees it. */
        MHD_resume_connection(conn);
        pthread_mutex_lock(&q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

int http_writes_init(struct http_writes *q)
{
    memset(q, 0, sizeof(*q));
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0)
        return -ENOMEM;
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* fs_clock_mono_after deadlines */
    if (pthread_mutex_init(&q->mu, NULL) != 0) {
        pthread_condattr_destroy(&ca);
        return -ENOMEM;
    }
    int ce = pthread_cond_init(&q->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (ce != 0) {
        pthread_mutex_destroy(&q->mu);
        return -ENOMEM;
    }
    int e = pthread_create(&q->thread, NULL, waiter_main, q);
    if (e != 0) {
        pthread_cond_destroy(&q->cv);
        pthread_mutex_destroy(&q->mu);
        return -e;
    }
    q->started = true;
    return 0;
}

void http_writes_stop(struct http_writes *q)
{
    if (!q->started || q->joined)
        return;
    pthread_mutex_lock(&q->mu);
    q->stop = true;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->thread, NULL);
    q->joined = true;
    /* Every parked connection is resumed now; let the server threads
     * answer them (a reply queued is sent before libmicrohttpd stops). */
    struct timespec deadline = fs_clock_mono_after(HTTP_WRITE_STOP_ANSWER_MS / 1000.0);
    pthread_mutex_lock(&q->mu);
    while (q->parked > 0)
        if (pthread_cond_timedwait(&q->cv, &q->mu, &deadline) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&q->mu);
}

void http_writes_destroy(struct http_writes *q)
{
    if (!q->started)
        return;
    http_writes_stop(q);
    pthread_cond_destroy(&q->cv);
    pthread_mutex_destroy(&q->mu);
    q->started = false;
}

int http_write_submit(struct ctx *c, struct store_item *it, http_write_done_fn done, int64_t arg)
{
    struct http_write *w = calloc(1, sizeof(*w));
    struct store_waiter *sw = w != NULL ? store_waiter_new() : NULL;
    if (!sw) {
        free(w);
        store_item_free(it);
        http_reply_oom(c);
        return -ENOMEM;
    }
    if (it->kind == STORE_ITEM_RUN)
        it->run.waiter = store_waiter_ref(sw);
    else
        it->silence.waiter = store_waiter_ref(sw);
    int rc = store_submit(c->h->store, it);
    if (rc != 0) {
        store_item_free(it); /* settles sw with -ECANCELED, drops its reference */
        store_waiter_put(sw);
        free(w);
        http_reply_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, "unavailable",
                         "storage is not accepting writes (shutting down)");
        return rc;
    }
    /* The writer holds the item's reference; if the request goes first it
     * still settles and frees the waiter safely. */
    w->waiter = sw;
    w->deadline = fs_clock_mono() + HTTP_WRITE_WAIT_MS / 1000.0;
    w->done = done;
    w->arg = arg;
    c->write = w;
    return 0;
}

bool http_write_park(struct http_writes *q, struct MHD_Connection *conn, struct http_write *w)
{
    pthread_mutex_lock(&q->mu);
    bool parked = q->started && !q->stop;
    if (parked) {
        /* Suspended before it is queued: the waiter resumes only what it
         * took from the queue, so never a connection not yet suspended. */
        MHD_suspend_connection(conn);
        w->q = q;
        q->parked++;
        w->conn = conn;
        w->next = NULL;
        if (q->tail)
            q->tail->next = w;
        else
            q->head = w;
        q->tail = w;
        pthread_cond_broadcast(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
    return parked;
}

int http_write_finish(struct ctx *c, struct http_write *w)
{
    if (!w->settled)
        settle(w); /* not parked (stopping): wait here */
    return w->done(c, w->rc, w->id, w->arg);
}

void http_write_free(struct http_write *w)
{
    if (!w)
        return;
    if (w->q) {
        pthread_mutex_lock(&w->q->mu);
        if (--w->q->parked == 0)
            pthread_cond_broadcast(&w->q->cv);
        pthread_mutex_unlock(&w->q->mu);
    }
    store_waiter_put(w->waiter);
    free(w);
}
