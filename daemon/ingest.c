/* Ingest: libuv TCP server, per-connection protocol state machine. This
 * file: the connection lifecycle (accept, the connection table, deadlines,
 * the close sequence) and the server's start and orderly stop; the other
 * parts are listed in ingest_internal.h. */
#include "ingest_internal.h"

#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tls.h"

/* --- connection table -------------------------------------------------------- */

struct conn *conn_find(struct ingest *ing, uint64_t id)
{
    for (struct conn *c = ing->hash[id % CONN_HASH]; c; c = c->hnext)
        if (c->id == id)
            return c;
    return NULL;
}

static void hash_remove(struct conn *c)
{
    struct conn **p = &c->ing->hash[c->id % CONN_HASH];
    while (*p && *p != c)
        p = &(*p)->hnext;
    if (*p)
        *p = c->hnext;
    c->hnext = NULL;
}

static void on_conn_closed(uv_handle_t *h)
{
    struct conn *c = (struct conn *)h;
    struct ingest *ing = c->ing;
    if (c->prev)
        c->prev->next = c->next;
    else
        ing->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        ing->tail = c->prev;
    if (!c->rejected) {
        ing->nactive--;
        atomic_fetch_sub(&ing->opts.stats->connections_current, 1);
    }
    store_item_free(c->pending);
    decode_frame_free(c->pending_frame);
    ingest_hello_release(&c->hello);
    conn_job_release(c);
    conn_rbuf_drop(c);
    tls_conn_free(c->tls);
    free(c->tbuf);
    advice_conn_free(&c->advice);
    free(c->rbuf);
    free(c);
    ingest_check_stop(ing);
}

/* Closes now. Results still in flight for this id are ignored later. */
void conn_close(struct conn *c)
{
    if (c->closing)
        return;
    conn_authenticated(c);
    conn_defer_remove(c);
    c->closing = 1;
    c->reading = 0; /* uv_close stops reading */
    c->state = CLOSING;
    hash_remove(c);
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    (void)status;
    free(req);
}

/* The writes of c have completed. A CLOSING peer that has not sent EOF gets
 * a FIN and is drained (on_read discards) until its EOF or the linger
 * deadline (on_sweep): closing a socket with unread input sends RST, which
 * can destroy replies the peer has not read yet (an Error, the last Acks
 * before a stop). Anything else closes now. */
void conn_finish(struct conn *c)
{
    if (c->state == CLOSING && !c->eof) {
        if (c->fin_sent)
            return;
        c->fin_sent = 1;
        if (c->tls && tls_conn_ready(c->tls)) { /* close_notify goes before the FIN */
            tls_conn_shutdown(c->tls);
            if (conn_tls_flush(c) < 0)
                return;
        }
        uv_shutdown_t *sh = malloc(sizeof(*sh));
        if (!sh || uv_shutdown(sh, (uv_stream_t *)&c->tcp, on_shutdown) < 0) {
            free(sh);
            conn_close(c);
        }
        return;
    }
    conn_close(c);
}

/* Finishes once every queued write has completed (or the linger deadline). */
void conn_close_when_flushed(struct conn *c)
{
    if (!c->linger_deadline_ms)
        c->linger_deadline_ms = uv_now(c->ing->loop) + FS_INGEST_LINGER_MS;
    if (c->wpending == 0) {
        c->close_after_write = 0;
        conn_finish(c);
        return;
    }
    c->close_after_write = 1;
}

/* Stops serving a connection that did nothing wrong (the daemon is
 * stopping): unread input is dropped (never acked, so the client resends
 * it), replies flush, then conn_finish's FIN and drain. */
void conn_linger(struct conn *c)
{
    if (c->state != CLOSING) {
        c->state = CLOSING;
        conn_authenticated(c);
        conn_rbuf_drop(c);
    }
    conn_close_when_flushed(c);
    conn_update_reading(c);
}

/* --- accepting ------------------------------------------------------------------ */

/* c proved who it is (its Hello's token was accepted), or stops being
 * served: it no longer counts against max_unauthenticated. */
void conn_authenticated(struct conn *c)
{
    struct ingest *ing = c->ing;
    if (!c->unauth)
        return;
    if (c->uprev)
        c->uprev->unext = c->unext;
    else
        ing->unauth_head = c->unext;
    if (c->unext)
        c->unext->uprev = c->uprev;
    else
        ing->unauth_tail = c->uprev;
    c->uprev = c->unext = NULL;
    c->unauth = 0;
    admit_table_remove(&ing->addrs, &c->addr);
    ing->nunauth--;
    atomic_fetch_sub(&ing->opts.stats->unauthenticated, 1);
}

/* Counts c as unauthenticated. 0, or -ENOSPC (the table holds
 * max_unauthenticated addresses; admit_decide keeps it below). */
static int unauth_add(struct conn *c)
{
    struct ingest *ing = c->ing;
    if (admit_table_add(&ing->addrs, &c->addr) < 0)
        return -ENOSPC;
    c->unauth = 1;
    c->unext = NULL;
    c->uprev = ing->unauth_tail;
    if (ing->unauth_tail)
        ing->unauth_tail->unext = c;
    else
        ing->unauth_head = c;
    ing->unauth_tail = c;
    ing->nunauth++;
    atomic_fetch_add(&ing->opts.stats->unauthenticated, 1);
    return 0;
}

/* The oldest unauthenticated connection of an address holding `most`. */
static struct conn *evict_victim(struct ingest *ing, uint64_t most)
{
    for (struct conn *c = ing->unauth_head; c; c = c->unext)
        if (admit_table_count(&ing->addrs, &c->addr) == most)
            return c;
    return NULL;
}

/* Refuses a new connection at accept: Error{LIMIT} (a TLS connection, with
 * no handshake yet to carry it, is closed), counted and logged. */
static void refuse(struct conn *c, enum admit_verdict v)
{
    struct ingest *ing = c->ing;
    const struct admit_limits *l = &ing->admit;
    atomic_fetch_add(&ing->opts.stats->connections_rejected, 1);
    char msg[160];
    switch (v) {
    case ADMIT_REFUSE_ADDRESS:
        atomic_fetch_add(&ing->opts.stats->refused_address, 1);
        snprintf(msg, sizeof(msg),
                 "connection limit reached (max_unauthenticated_per_address %llu: this address's "
                 "connections not yet past their Hello)",
                 (unsigned long long)l->max_unauthenticated_per_address);
        break;
    case ADMIT_REFUSE_UNAUTHENTICATED:
        atomic_fetch_add(&ing->opts.stats->refused_unauth, 1);
        snprintf(msg, sizeof(msg),
                 "connection limit reached (max_unauthenticated %llu, this address holds the "
                 "most of them)",
                 (unsigned long long)l->max_unauthenticated);
        break;
    default:
        atomic_fetch_add(&ing->opts.stats->refused_full, 1);
        snprintf(msg, sizeof(msg), "connection limit reached (max_connections %llu)",
                 (unsigned long long)l->max_connections);
        break;
    }
    log_limited(&ing->rl_limit, LOG_LEVEL_WARN, "ingest", "%s: refusing %s", msg, c->peer);
    conn_protocol_error(c, E(LIMIT), msg);
}

/* Admission (admit.h): 1 when c takes a slot, 0 when it was refused. */
static int admit(struct conn *c)
{
    struct ingest *ing = c->ing;
    struct admit_counts n = {.connections = ing->nactive,
                             .unauthenticated = ing->nunauth,
                             .address = admit_table_count(&ing->addrs, &c->addr)};
    n.heaviest = n.address; /* the table is scanned only under pressure */
    if (ing->nactive >= ing->admit.max_connections ||
        ing->nunauth >= ing->admit.max_unauthenticated)
        n.heaviest = admit_table_heaviest(&ing->addrs);
    enum admit_verdict v = admit_decide(&ing->admit, &n);
    struct conn *victim = v == ADMIT_EVICT ? evict_victim(ing, n.heaviest) : NULL;
    if (v == ADMIT_EVICT && !victim)
        v = ADMIT_REFUSE_UNAUTHENTICATED; /* cannot happen: heaviest came from the list */
    if (v != ADMIT_ACCEPT && v != ADMIT_EVICT) {
        refuse(c, v);
        return 0;
    }
    if (victim) {
        atomic_fetch_add(&ing->opts.stats->evicted, 1);
        log_limited(&ing->rl_admit, LOG_LEVEL_WARN, "ingest",
                    "conn %llu %s: not authenticated while max_unauthenticated (%llu) is full "
                    "and %s waits; closing the oldest of the address holding the most (%llu)",
                    (unsigned long long)victim->id, victim->peer,
                    (unsigned long long)ing->admit.max_unauthenticated, c->peer,
                    (unsigned long long)n.heaviest);
        /* No Error frame: a stranger gets nothing more (and a handshake in
         * progress could not carry one). Its slot is free at once. */
        conn_close(victim);
    }
    if (unauth_add(c) < 0) {
        refuse(c, ADMIT_REFUSE_UNAUTHENTICATED);
        return 0;
    }
    return 1;
}

static void on_connection(uv_stream_t *server, int status)
{
    struct ingest *ing = server->data;
    if (status < 0) {
        log_limited(&ing->rl_io, LOG_LEVEL_WARN, "ingest", "accept: %s", uv_strerror(status));
        return;
    }
    struct conn *c = calloc(1, sizeof(*c));
    if (!c || uv_tcp_init(ing->loop, &c->tcp) < 0) {
        free(c);
        log_limited(&ing->rl_io, LOG_LEVEL_ERROR, "ingest", "accept: out of memory");
        return;
    }
    c->ing = ing;
    c->id = ++ing->next_id;
    c->accepted_ms = uv_now(ing->loop);
    if (ing->tail)
        ing->tail->next = c;
    else
        ing->head = c;
    c->prev = ing->tail;
    ing->tail = c;
    c->hnext = ing->hash[c->id % CONN_HASH];
    ing->hash[c->id % CONN_HASH] = c;
    c->rejected = 1; /* until counted below */
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0) {
        conn_close(c);
        return;
    }
    struct sockaddr_storage sa;
    int salen = sizeof(sa);
    char ip[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    memset(&sa, 0, sizeof(sa));
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&sa, &salen) == 0) {
        if (sa.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&sa, ip, sizeof(ip));
            port = ntohs(((struct sockaddr_in6 *)&sa)->sin6_port);
        } else {
            uv_ip4_name((struct sockaddr_in *)&sa, ip, sizeof(ip));
            port = ntohs(((struct sockaddr_in *)&sa)->sin_port);
        }
    }
    snprintf(c->peer, sizeof(c->peer), "%s:%d", ip, port);
    /* No address (the peer already gone): counted as the all-zero one. */
    (void)admit_addr_from((struct sockaddr *)&sa, &c->addr);
    uv_tcp_nodelay(&c->tcp, 1);
    if (ing->opts.tls && (!(c->tls = tls_conn_new(ing->opts.tls)) ||
                          !(c->tbuf = malloc(FS_INGEST_TLS_READ_BYTES)))) {
        log_limited(&ing->rl_io, LOG_LEVEL_ERROR, "ingest", "accept: out of memory");
        conn_close(c);
        return;
    }
    atomic_fetch_add(&ing->opts.stats->connections_total, 1);
    if (ing->stopping) {
        conn_protocol_error(c, E(SHUTTING_DOWN), "daemon is stopping; reconnect later");
        return;
    }
    if (!admit(c))
        return;
    c->rejected = 0;
    ing->nactive++;
    atomic_fetch_add(&ing->opts.stats->connections_current, 1);
    log_debug("ingest", "conn %llu %s: connected", (unsigned long long)c->id, c->peer);
    conn_update_reading(c);
}

/* Has the connection overstayed a deadline (ingest_opts)? Writes the
 * reason into why. */
static int overdue(const struct conn *c, uint64_t now, char *why, size_t len)
{
    const struct ingest_opts *o = &c->ing->opts;
    if (c->state == AWAIT_HELLO && o->hello_timeout_s > 0 &&
        (double)(now - c->accepted_ms) >= o->hello_timeout_s * 1000) {
        snprintf(why, len, "no Hello within %g s (hello_timeout)", o->hello_timeout_s);
        return 1;
    }
    if ((c->state == AWAIT_HELLO || c->state == STREAMING) && c->reading && c->frame_started_ms &&
        o->frame_timeout_s > 0 &&
        (double)(now - c->frame_started_ms) >= o->frame_timeout_s * 1000) {
        snprintf(why, len, "frame unfinished after %g s (frame_timeout)", o->frame_timeout_s);
        return 1;
    }
    return 0;
}

static void on_sweep(uv_timer_t *t)
{
    struct ingest *ing = t->data;
    uint64_t now = uv_now(ing->loop);
    char why[96];
    for (struct conn *c = ing->head; c; c = c->next) {
        if (c->closing)
            continue;
        if (c->linger_deadline_ms && now >= c->linger_deadline_ms) {
            conn_close(c);
        } else if (overdue(c, now, why, sizeof(why))) {
            /* Idle and trickling sockets would otherwise hold every slot
             * (max_connections) and lock real trainers out. */
            log_limited(&ing->rl_io, LOG_LEVEL_WARN, "ingest", "conn %llu %s: %s; closing",
                        (unsigned long long)c->id, c->peer, why);
            conn_protocol_error(c, E(LIMIT), why);
        }
    }
}

/* --- lifecycle ---------------------------------------------------------------------- */

static void on_handle_closed(uv_handle_t *h)
{
    struct ingest *ing = h->data;
    if (--ing->handles_open == 0 && ing->done)
        ing->done(ing->done_ctx);
}

void ingest_check_stop(struct ingest *ing)
{
    if (!ing->stopping || ing->handles_closing)
        return;
    for (struct conn *c = ing->head; c; c = c->next)
        if (!c->closing && c->inflight == 0 && !c->pending)
            conn_linger(c);
    if (ing->head || ing->njobs) /* an orphaned decode job still uses ing */
        return;
    /* Last connection gone: detach from the writer before closing the
     * async handle it wakes. */
    ing->handles_closing = 1;
    store_set_notify(ing->opts.store, NULL, NULL);
    if (ing->opts.stage)
        stage_set_pressure(ing->opts.stage, NULL, NULL);
    uv_close((uv_handle_t *)&ing->async, on_handle_closed);
    uv_close((uv_handle_t *)&ing->sweep, on_handle_closed);
    uv_close((uv_handle_t *)&ing->prepare, on_handle_closed);
    uv_close((uv_handle_t *)&ing->idle, on_handle_closed);
}

void ingest_stop(struct ingest *ing, void (*done)(void *ctx), void *ctx)
{
    if (ing->stopping)
        return;
    ing->stopping = 1;
    ing->done = done;
    ing->done_ctx = ctx;
    log_info("ingest", "stopping: no new connections; committing and acking what was received");
    uv_close((uv_handle_t *)&ing->listener, on_handle_closed);
    for (struct conn *c = ing->head; c; c = c->next) {
        conn_rbuf_drop(c); /* partial or unread frames were never acked: the client resends */
        conn_defer_remove(c);
        conn_update_reading(c);
    }
    ingest_check_stop(ing);
}

static int resolve(const char *host, uint16_t port, struct sockaddr_storage *sa, struct fs_err *err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    char ps[8];
    snprintf(ps, sizeof(ps), "%u", port);
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc != 0 || !ai) {
        fs_err_set(err, 0, "cannot resolve listen address %s: %s", host, gai_strerror(rc));
        return -EINVAL;
    }
    memcpy(sa, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    return 0;
}

int ingest_start(uv_loop_t *loop, const struct ingest_opts *opts, struct ingest **out,
                 struct fs_err *err)
{
    struct ingest *ing = calloc(1, sizeof(*ing));
    if (!ing) {
        fs_err_set(err, 0, "out of memory");
        return -ENOMEM;
    }
    ing->loop = loop;
    ing->opts = *opts;
    snprintf(ing->token, sizeof(ing->token), "%s", opts->token ? opts->token : "");
    snprintf(ing->host, sizeof(ing->host), "%s", opts->host);
    ing->opts.token = ing->token;
    ing->opts.host = ing->host;
    if (!ing->opts.frame_buffer_max_bytes)
        ing->opts.frame_buffer_max_bytes = FS_DEF_FRAME_BUFFER_MAX_BYTES;
    if (ing->opts.frame_buffer_max_bytes < ing->opts.limits.max_frame_bytes)
        ing->opts.frame_buffer_max_bytes = ing->opts.limits.max_frame_bytes;
    struct admit_limits *al = &ing->admit;
    al->max_connections = opts->max_connections;
    al->max_unauthenticated =
        opts->max_unauthenticated ? opts->max_unauthenticated : FS_DEF_MAX_UNAUTHENTICATED;
    al->max_unauthenticated_per_address = opts->max_unauthenticated_per_address
                                              ? opts->max_unauthenticated_per_address
                                              : FS_DEF_MAX_UNAUTHENTICATED_PER_ADDRESS;
    if (al->max_unauthenticated > al->max_connections)
        al->max_unauthenticated = al->max_connections;
    if (al->max_unauthenticated_per_address > al->max_unauthenticated)
        al->max_unauthenticated_per_address = al->max_unauthenticated;
    if (admit_table_init(&ing->addrs, (size_t)al->max_unauthenticated) < 0) {
        free(ing);
        fs_err_set(err, 0, "out of memory");
        return -ENOMEM;
    }
    struct sockaddr_storage sa;
    int rc = resolve(opts->host, opts->port, &sa, err);
    if (rc < 0) {
        admit_table_free(&ing->addrs);
        free(ing);
        return rc;
    }
    uv_tcp_init(loop, &ing->listener);
    ing->listener.data = ing;
    ing->handles_open = 1;
    rc = uv_tcp_bind(&ing->listener, (struct sockaddr *)&sa, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&ing->listener, FS_INGEST_BACKLOG, on_connection);
    if (rc < 0) {
        fs_err_set(err, 0, "cannot listen on %s:%u: %s", opts->host, opts->port, uv_strerror(rc));
        goto fail;
    }
    struct sockaddr_storage bound;
    int len = sizeof(bound);
    uv_tcp_getsockname(&ing->listener, (struct sockaddr *)&bound, &len);
    ing->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                  : ((struct sockaddr_in *)&bound)->sin_port);
    if ((rc = uv_async_init(loop, &ing->async, ingest_on_async)) < 0) {
        fs_err_set(err, 0, "uv_async_init: %s", uv_strerror(rc));
        goto fail;
    }
    ing->async.data = ing;
    ing->handles_open++;
    uv_timer_init(loop, &ing->sweep);
    ing->sweep.data = ing;
    ing->handles_open++;
    uv_timer_start(&ing->sweep, on_sweep, FS_INGEST_SWEEP_MS, FS_INGEST_SWEEP_MS);
    uv_prepare_init(loop, &ing->prepare);
    ing->prepare.data = ing;
    ing->handles_open++;
    uv_prepare_start(&ing->prepare, ingest_on_prepare);
    uv_idle_init(loop, &ing->idle);
    ing->idle.data = ing;
    ing->handles_open++;
    ing->budget = FS_INGEST_LOOP_FRAME_BYTES;
    store_set_notify(opts->store, ingest_notify_loop, ing);
    if (opts->stage) {
        stage_set_pressure(opts->stage, ingest_on_stage_pressure, ing);
        ing->stage_full = stage_full(opts->stage);
    }
    *out = ing;
    return 0;
fail:
    /* Let the loop finish closing the listener before freeing it. */
    uv_close((uv_handle_t *)&ing->listener, NULL);
    uv_run(loop, UV_RUN_NOWAIT);
    admit_table_free(&ing->addrs);
    free(ing);
    return rc < 0 ? rc : -EIO;
}

uint16_t ingest_port(const struct ingest *ing)
{
    return ing->port;
}

void ingest_free(struct ingest *ing)
{
    if (ing)
        admit_table_free(&ing->addrs);
    free(ing);
}
