/* Ingest: libuv TCP server, per-connection protocol state machine. */
#include "ingest.h"
#include "fs_clock.h"

#include <errno.h>
#include <jansson.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "advice.h"
#include "fs_limits.h"
#include "log.h"
#include "ranks.h"
#include "run_auth.h"
#include "tls.h"

#define E(x) FORESHOCK__ERROR_CODE__ERROR_##x
#define CONN_HASH 1024u /* buckets of the conn_id -> conn table */

enum conn_state { AWAIT_HELLO, AWAIT_WELCOME, STREAMING, CLOSING };

struct conn {
    uv_tcp_t tcp; /* first: handle->data is not needed to get back here */
    struct ingest *ing;
    uint64_t id;
    struct conn *prev, *next; /* all connections, oldest first */
    struct conn *hnext;       /* hash chain; unlinked when closing starts */
    struct conn *dprev, *dnext; /* the deferred list, while deferred */
    int deferred;   /* a complete frame waits for the next loop iteration's budget */
    enum conn_state state;
    int rejected;   /* over max_connections: not counted as a connection */
    int reading;    /* uv_read_start is active */
    int eof;        /* the client will send nothing more (EOF or Bye) */
    int closing;    /* uv_close called */
    int close_after_write;
    uint64_t linger_deadline_ms; /* CLOSING: close by then whatever happens */
    int fin_sent;                /* uv_shutdown issued (conn_finish) */
    char peer[64];
    uint8_t *rbuf;
    size_t rlen, rcap;
    uint64_t fbuf;       /* length of the large frame rbuf was grown for (0: none) */
    struct conn *wnext;  /* waiting for frame buffer room (ingest.wait_head) */
    int waiting;
    int tls_kick; /* granted frame buffer room: pull from TLS on the next on_async */
    size_t discarded;
    struct store_item *pending; /* refused with -EAGAIN; resubmitted on RESUME */
    Foreshock__Frame *pending_frame; /* the decoded report of `pending`, for the stage */
    char run_name[FS_MAX_RUN_ID_LEN + 1]; /* from the Hello, for the stage */
    struct run_hello hello;     /* from the Hello until the Welcome; moe_layers owned */
    uint64_t inflight;          /* items submitted, result not yet seen */
    int64_t run_id, stream_id;
    uint64_t stream_key; /* store_stream_key of the Hello's (run, attempt, rank) */
    uint32_t rank;
    uint64_t acked;
    /* Sequence numbers of this stream on this connection: seq_base is the
     * Welcome's last committed seq, seq_last the highest accepted since. */
    uint64_t seq_base, seq_last;
    size_t wpending; /* bytes in uv_write requests not yet completed */
    struct tls_conn *tls;      /* NULL: plain TCP */
    uint8_t *tbuf;             /* TLS: ciphertext read buffer, FS_INGEST_TLS_READ_BYTES */
    uint64_t accepted_ms;      /* loop time the connection was accepted */
    uint64_t frame_started_ms; /* loop time an unfinished frame began (0: none) */
    struct advice_conn advice; /* capability and advices awaiting this stream's ack */
};

struct write_req {
    uv_write_t req;
    struct conn *c;
    size_t len;
    uint8_t *buf;
};

struct ingest {
    uv_loop_t *loop;
    struct ingest_opts opts;
    char token[FS_MAX_TOKEN_LEN + 1];
    char host[FS_CONFIG_MAX_HOST];
    uv_tcp_t listener;
    uv_async_t async;
    uv_timer_t sweep;
    uv_prepare_t prepare; /* each loop iteration: a fresh frame budget, deferred frames first */
    uv_idle_t idle;       /* active while frames are deferred: the poll must not block */
    uint64_t budget;      /* frame bytes this loop iteration may still handle */
    struct conn *def_head, *def_tail; /* deferred connections, oldest first */
    uint16_t port;
    uint64_t next_id;
    uint64_t nactive; /* accepted, not rejected, not yet closed */
    struct conn *head, *tail;
    struct conn *hash[CONN_HASH];
    int paused;   /* the writer refused an item: nobody reads until RESUME */
    int stage_full; /* the monitor stage's reduction memory is full */
    int stopping;
    int handles_open; /* of listener, async, sweep, prepare, idle */
    uint64_t fbuf_total; /* sum of conn.fbuf: at most opts.frame_buffer_max_bytes */
    struct conn *wait_head, *wait_tail; /* connections waiting for frame buffer room, FIFO */
    int handles_closing; /* async, sweep, prepare and idle are being closed */
    void (*done)(void *ctx);
    void *done_ctx;
    uint8_t discard[16384]; /* read target for closing connections */
    struct log_ratelimit rl_proto, rl_backpressure, rl_slow, rl_limit, rl_io, rl_advice;
};

static void process(struct conn *c);
static int tls_flush(struct conn *c);
static void update_reading(struct conn *c);
static void rbuf_drop(struct conn *c);
static void on_shutdown(uv_shutdown_t *req, int status);
static void check_stop(struct ingest *ing);

/* --- connection table -------------------------------------------------------- */

static struct conn *conn_find(struct ingest *ing, uint64_t id)
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


/* The arrays a connection's Hello carried for the stage (run_hello copies
 * what it keeps). */
static void hello_release(struct run_hello *h)
{
    free((void *)h->moe_layers);
    free((void *)h->local_ranks);
    h->moe_layers = h->local_ranks = NULL;
    h->n_moe_layers = h->n_local_ranks = 0;
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
    hello_release(&c->hello);
    rbuf_drop(c);
    tls_conn_free(c->tls);
    free(c->tbuf);
    advice_conn_free(&c->advice);
    free(c->rbuf);
    free(c);
    check_stop(ing);
}

/* --- fair reading: a frame budget per loop iteration ---------------------------
 * Decoding and reducing a 59 MB Gram report takes the loop thread a good
 * fraction of a second; handling every complete frame of every readable
 * connection in one iteration left accepts, Hellos and the writer's
 * results (Welcomes, Acks) waiting for all of them: a new trainer got no
 * Welcome within 10 s while ingest was saturated. Each iteration now
 * handles report frames up to FS_INGEST_LOOP_FRAME_BYTES (at least one);
 * a connection whose complete frame did not fit stops reading and waits in
 * the deferred list, oldest first, for the next iteration (whose prepare
 * callback serves it before new reads). Hellos are exempt: they are small,
 * bounded (FS_MAX_HELLO_FRAME_BYTES) and what fairness is for. */

static void defer_remove(struct conn *c)
{
    struct ingest *ing = c->ing;
    if (!c->deferred)
        return;
    if (c->dprev)
        c->dprev->dnext = c->dnext;
    else
        ing->def_head = c->dnext;
    if (c->dnext)
        c->dnext->dprev = c->dprev;
    else
        ing->def_tail = c->dprev;
    c->dprev = c->dnext = NULL;
    c->deferred = 0;
    if (!ing->def_head && !ing->handles_closing)
        uv_idle_stop(&ing->idle);
}

static void on_idle(uv_idle_t *h) { (void)h; }

static void defer_add(struct conn *c)
{
    struct ingest *ing = c->ing;
    if (c->deferred)
        return;
    c->deferred = 1;
    c->dnext = NULL;
    c->dprev = ing->def_tail;
    if (ing->def_tail)
        ing->def_tail->dnext = c;
    else
        ing->def_head = c;
    ing->def_tail = c;
    uv_idle_start(&ing->idle, on_idle);
}

static void on_prepare(uv_prepare_t *h)
{
    struct ingest *ing = h->data;
    ing->budget = FS_INGEST_LOOP_FRAME_BYTES;
    /* Served in order; one that runs out of budget again goes to the back. */
    struct conn *last = ing->def_tail;
    while (ing->def_head && ing->budget > 0) {
        struct conn *c = ing->def_head;
        defer_remove(c);
        if (!c->closing) {
            process(c);
            update_reading(c);
        }
        if (c == last)
            break;
    }
}

/* Closes now. Results still in flight for this id are ignored later. */
static void conn_close(struct conn *c)
{
    if (c->closing)
        return;
    defer_remove(c);
    c->closing = 1;
    c->reading = 0; /* uv_close stops reading */
    c->state = CLOSING;
    hash_remove(c);
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

/* The writes of c have completed. A CLOSING peer that has not sent EOF gets
 * a FIN and is drained (on_read discards) until its EOF or the linger
 * deadline (on_sweep): closing a socket with unread input sends RST, which
 * can destroy replies the peer has not read yet (an Error, the last Acks
 * before a stop). Anything else closes now. */
static void conn_finish(struct conn *c)
{
    if (c->state == CLOSING && !c->eof) {
        if (c->fin_sent)
            return;
        c->fin_sent = 1;
        if (c->tls && tls_conn_ready(c->tls)) { /* close_notify goes before the FIN */
            tls_conn_shutdown(c->tls);
            if (tls_flush(c) < 0)
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
static void conn_close_when_flushed(struct conn *c)
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
static void conn_linger(struct conn *c)
{
    if (c->state != CLOSING) {
        c->state = CLOSING;
        rbuf_drop(c);
    }
    conn_close_when_flushed(c);
    update_reading(c);
}

/* --- writing ------------------------------------------------------------------ */

static void on_shutdown(uv_shutdown_t *req, int status)
{
    (void)status;
    free(req);
}

static void on_write(uv_write_t *req, int status)
{
    struct write_req *w = (struct write_req *)req;
    struct conn *c = w->c;
    c->wpending -= w->len;
    free(w->buf);
    free(w);
    if (c->closing)
        return;
    if (status < 0) {
        log_debug("ingest", "conn %llu %s: write failed: %s", (unsigned long long)c->id, c->peer,
                  uv_strerror(status));
        conn_close(c);
        return;
    }
    if (c->close_after_write && c->wpending == 0) {
        c->close_after_write = 0;
        conn_finish(c);
    }
}

/* Queues bytes for the socket; takes buf. Closes a client that does not read. */
static int send_raw(struct conn *c, uint8_t *buf, size_t len)
{
    struct ingest *ing = c->ing;
    if (c->closing) {
        free(buf);
        return -ECANCELED;
    }
    if (c->wpending + len > ing->opts.max_conn_buffer_bytes) {
        log_limited(&ing->rl_slow, LOG_LEVEL_WARN, "ingest",
                    "conn %llu %s: %zu reply bytes unread (max_conn_buffer_bytes %llu); closing",
                    (unsigned long long)c->id, c->peer, c->wpending + len,
                    (unsigned long long)ing->opts.max_conn_buffer_bytes);
        free(buf);
        conn_close(c);
        return -ENOBUFS;
    }
    struct write_req *w = malloc(sizeof(*w));
    if (!w) {
        free(buf);
        conn_close(c);
        return -ENOMEM;
    }
    w->c = c;
    w->len = len;
    w->buf = buf;
    uv_buf_t b = uv_buf_init((char *)buf, (unsigned)len);
    int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
    if (rc < 0) {
        free(buf);
        free(w);
        conn_close(c);
        return rc;
    }
    c->wpending += len;
    return 0;
}

/* TLS: sends the records waiting (handshake messages, encrypted frames,
 * alerts). 0, or a negative errno after closing the connection. */
static int tls_flush(struct conn *c)
{
    uint8_t *out;
    size_t n;
    if (tls_conn_take_output(c->tls, &out, &n) < 0) {
        conn_close(c);
        return -ENOMEM;
    }
    return n ? send_raw(c, out, n) : 0;
}

/* Queues an encoded frame (encrypted first on a TLS connection); takes buf.
 * A TLS connection still in its handshake has no way to carry a frame (an
 * Error to a peer that never finished it): it is closed instead. */
static int send_buf(struct conn *c, uint8_t *buf, size_t len)
{
    if (!c->tls)
        return send_raw(c, buf, len);
    if (c->closing) {
        free(buf);
        return -ECANCELED;
    }
    int rc = tls_conn_ready(c->tls) ? tls_conn_write(c->tls, buf, len) : -ENOTCONN;
    free(buf);
    if (rc < 0) {
        conn_close(c);
        return rc;
    }
    return tls_flush(c);
}

static int send_frame(struct conn *c, const Foreshock__Frame *f)
{
    uint8_t *buf;
    size_t len;
    int rc = decode_encode(f, &buf, &len);
    if (rc < 0) {
        conn_close(c);
        return rc;
    }
    return send_buf(c, buf, len);
}

/* Error{code, message, seq} (seq 0: none), then close after the write. */
static void refuse(struct conn *c, int code, const char *message, uint64_t seq)
{
    struct ingest *ing = c->ing;
    if (c->state == CLOSING)
        return;
    atomic_fetch_add(&ing->opts.stats->protocol_errors, 1);
    log_limited(&ing->rl_proto, LOG_LEVEL_WARN, "ingest", "conn %llu %s: error %d: %s",
                (unsigned long long)c->id, c->peer, code, message);
    c->state = CLOSING;
    store_item_free(c->pending);
    c->pending = NULL;
    decode_frame_free(c->pending_frame);
    c->pending_frame = NULL;
    rbuf_drop(c);
    uint8_t *buf;
    size_t len;
    if (decode_encode_error(code, message, seq, &buf, &len) < 0 || send_buf(c, buf, len) < 0) {
        conn_close(c);
        return;
    }
    c->linger_deadline_ms = uv_now(ing->loop) + FS_INGEST_LINGER_MS;
    conn_close_when_flushed(c);
    update_reading(c);
}

/* Error{code, message} about the connection, then close after the write. */
static void protocol_error(struct conn *c, int code, const char *message)
{
    refuse(c, code, message, 0);
}

/* --- frames ----------------------------------------------------------------------- */

static char *model_json(const Foreshock__ModelShape *m)
{
    if (!m)
        return NULL;
    json_t *o = json_object();
    if (!o)
        return NULL;
    const struct {
        const char *key;
        int has;
        uint32_t v;
    } f[] = {
        {"n_layers", m->has_n_layers, m->n_layers},   {"n_heads", m->has_n_heads, m->n_heads},
        {"n_kv_heads", m->has_n_kv_heads, m->n_kv_heads}, {"d_model", m->has_d_model, m->d_model},
        {"d_head", m->has_d_head, m->d_head},       {"n_experts", m->has_n_experts, m->n_experts},
        {"top_k", m->has_top_k, m->top_k},
    };
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        if (f[i].has)
            json_object_set_new(o, f[i].key, json_integer(f[i].v));
    if (m->n_moe_layers) {
        json_t *a = json_array();
        for (size_t i = 0; i < m->n_moe_layers; i++)
            json_array_append_new(a, json_integer(m->moe_layers[i]));
        json_object_set_new(o, "moe_layers", a);
    }
    char *s = json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(o);
    if (s && strlen(s) > FS_STORE_MODEL_JSON_MAX) {
        free(s);
        s = NULL;
    }
    return s;
}

/* Constant-time comparison: the token is a secret. */
static int token_ok(const char *want, const char *got)
{
    if (!want[0])
        return 1;
    if (!got)
        return 0;
    size_t n = strlen(want), m = strlen(got);
    unsigned char diff = (unsigned char)(n != m);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)(want[i] ^ (i < m ? got[i] : 0));
    return diff == 0;
}

static void pause_all(struct ingest *ing)
{
    if (!ing->paused) {
        ing->paused = 1;
        atomic_fetch_add(&ing->opts.stats->backpressure_pauses, 1);
        log_limited(&ing->rl_backpressure, LOG_LEVEL_WARN, "ingest",
                    "writer queue full: ingest paused until it drains");
    }
    for (struct conn *c = ing->head; c; c = c->next)
        update_reading(c);
}

/* Hands a report the store accepted to the monitor stage: only after
 * store_submit, so that its spool append is queued before anything the
 * stage queues about the step. Takes f. */
static void feed_stage(struct conn *c, Foreshock__Frame *f, double time, size_t spooled)
{
    struct ingest *ing = c->ing;
    if (ing->opts.stage && f && f->body_case == FORESHOCK__FRAME__BODY_REPORT) {
        struct stage_report in = {.run_id = c->run_id, .stream_id = c->stream_id, .rank = c->rank,
                                  .seq = f->report->seq, .step = f->report->step, .time = time,
                                  .report = f->report, .spool_bytes = spooled};
        stage_feed(ing->opts.stage, &in);
    }
    decode_frame_free(f);
}

/* Submits or parks the item (with its decoded frame f for the stage, which
 * submit takes; NULL for a Hello). Returns 0 when the connection may go on. */
static int submit(struct conn *c, struct store_item *it, Foreshock__Frame *f)
{
    double time = it->kind == STORE_ITEM_REPORT ? it->report.time : 0;
    size_t spooled = it->kind == STORE_ITEM_REPORT ? it->report.sketch_len : 0;
    int rc = store_submit(c->ing->opts.store, it);
    if (rc == 0) {
        c->inflight++;
        feed_stage(c, f, time, spooled);
        return 0;
    }
    int failing = atomic_load(&c->ing->opts.stats->storage_failing);
    if (rc == -EAGAIN && it->kind == STORE_ITEM_HELLO && failing) {
        /* The queue is full because commits fail: parked, this Hello would
         * get no answer for as long as the disk is full. */
        char msg[160];
        snprintf(msg, sizeof(msg), "storage is failing (%s); retry later",
                 store_failure_text(failing));
        store_item_free(it);
        protocol_error(c, E(INTERNAL), msg);
        return -EIO;
    }
    if (rc == -EAGAIN) {
        c->pending = it;
        c->pending_frame = f;
        pause_all(c->ing);
        return -EAGAIN;
    }
    decode_frame_free(f);
    store_item_free(it);
    protocol_error(c, E(SHUTTING_DOWN), "daemon is stopping; reconnect later");
    return rc;
}

static void on_hello(struct conn *c, const Foreshock__Hello *h)
{
    struct ingest *ing = c->ing;
    if (c->state != AWAIT_HELLO) {
        protocol_error(c, E(SEQUENCE), "second Hello on this connection");
        return;
    }
    if (!token_ok(run_auth_token(ing->opts.run_auth, h->run_id, ing->token), h->token)) {
        protocol_error(c, E(AUTH), "token missing or wrong");
        return;
    }
    struct store_item *it = store_item_new(STORE_ITEM_HELLO);
    if (!it) {
        protocol_error(c, E(INTERNAL), "out of memory");
        return;
    }
    it->conn_id = c->id;
    snprintf(it->hello.run, sizeof(it->hello.run), "%s", h->run_id);
    it->hello.attempt = h->has_attempt ? h->attempt : 0;
    it->hello.rank = h->rank;
    it->hello.world_size = h->world_size;
    it->hello.has_detect_from_step = h->has_detect_from_step;
    it->hello.detect_from_step = h->detect_from_step;
    it->hello.model_json = model_json(h->model);
    /* Only a client that says it knows Advice gets one (proto: capabilities). */
    c->advice.enabled = h->has_capabilities &&
                        (h->capabilities & FORESHOCK__CAPABILITY__CAPABILITY_ADVICE);
    it->hello.advice = c->advice.enabled;
    it->hello.has_resume_step = h->has_resume_step;
    it->hello.resume_step = h->resume_step;
    if (h->n_local_ranks) {
        /* Normalised once here, for the store (text) and the stage. */
        uint32_t *local = malloc(h->n_local_ranks * sizeof(*local));
        if (local) {
            memcpy(local, h->local_ranks, h->n_local_ranks * sizeof(*local));
            c->hello.n_local_ranks = ranks_normalize(local, h->n_local_ranks);
            c->hello.local_ranks = local;
            it->hello.local_ranks = ranks_format(local, c->hello.n_local_ranks);
        }
        if (!local || !it->hello.local_ranks) {
            store_item_free(it);
            protocol_error(c, E(INTERNAL), "out of memory");
            return;
        }
    }
    it->hello.stream_key = store_stream_key(h->run_id, it->hello.attempt, h->rank);
    c->stream_key = it->hello.stream_key;
    c->rank = h->rank;
    snprintf(c->run_name, sizeof(c->run_name), "%s", h->run_id);
    c->hello.rank = h->rank;
    c->hello.world_size = h->world_size;
    c->hello.has_detect_from_step = h->has_detect_from_step;
    c->hello.detect_from_step = h->detect_from_step;
    if (h->model) {
        c->hello.has_n_layers = h->model->has_n_layers;
        c->hello.n_layers = h->model->n_layers;
        c->hello.has_n_heads = h->model->has_n_heads;
        c->hello.n_heads = h->model->n_heads;
        if (h->model->n_moe_layers) {
            uint32_t *moe = malloc(h->model->n_moe_layers * sizeof(*moe));
            if (moe) { /* without it the stage waits for world_size ranks */
                memcpy(moe, h->model->moe_layers, h->model->n_moe_layers * sizeof(*moe));
                c->hello.moe_layers = moe;
                c->hello.n_moe_layers = h->model->n_moe_layers;
            }
        }
    }
    c->state = AWAIT_WELCOME;
    log_debug("ingest", "conn %llu %s: hello run=%s attempt=%u rank=%u/%u",
              (unsigned long long)c->id, c->peer, h->run_id, it->hello.attempt, h->rank,
              h->world_size);
    submit(c, it, NULL);
}

static float *copy_floats(const float *v, size_t n)
{
    if (!n)
        return NULL;
    float *p = malloc(n * sizeof(*p));
    if (p)
        memcpy(p, v, n * sizeof(*p));
    return p;
}

/* Takes *fp (the decoded frame) for the stage; sets it NULL. */
static void on_report(struct conn *c, Foreshock__Frame **fp, const uint8_t *body, size_t len,
                      const struct decode_info *info)
{
    const Foreshock__Report *r = (*fp)->report;
    if (c->state != STREAMING) {
        protocol_error(c, E(SEQUENCE), "Report before Hello");
        return;
    }
    /* A stream's seqs increase by one (proto/foreshock.proto). At or below
     * the Welcome's last_seq a report is a resend of a committed one
     * (acknowledged, not stored again); above it each must be the next:
     * after a gap (1, 2, 5) an Ack of 5 would cover reports never stored,
     * and a step back would be acknowledged by an earlier Ack. */
    if (r->seq > c->seq_base) {
        if (r->seq != c->seq_last + 1) {
            char msg[128];
            snprintf(msg, sizeof(msg), "report seq %llu after %llu: seqs must increase by one",
                     (unsigned long long)r->seq, (unsigned long long)c->seq_last);
            protocol_error(c, E(SEQUENCE), msg);
            return;
        }
        c->seq_last = r->seq;
    }
    atomic_fetch_add(&c->ing->opts.stats->reports_in, 1);
    struct store_item *it = store_item_new(STORE_ITEM_REPORT);
    if (!it) {
        protocol_error(c, E(INTERNAL), "out of memory");
        return;
    }
    struct store_report *rp = &it->report;
    it->conn_id = c->id;
    rp->run_id = c->run_id;
    rp->stream_id = c->stream_id;
    rp->stream_key = c->stream_key;
    rp->rank = c->rank;
    rp->seq = r->seq;
    rp->step = r->step;
    rp->received_at = fs_clock_unix();
    rp->time = r->has_time_unix ? r->time_unix : rp->received_at;
    rp->frame_bytes = (uint32_t)(len + DECODE_PREFIX_BYTES);
    const Foreshock__Scalars *s = r->scalars;
    int oom = 0;
    if (s) {
        const struct {
            int has;
            double v;
        } sc[STORE_NSCALARS] = {
            [STORE_LOSS] = {s->has_loss, s->loss},
            [STORE_GRAD_NORM] = {s->has_grad_norm, s->grad_norm},
            [STORE_LR] = {s->has_lr, s->lr},
            [STORE_LOSS_SCALE] = {s->has_loss_scale, s->loss_scale},
            [STORE_TOKENS] = {s->has_tokens, (double)s->tokens},
            [STORE_STEP_TIME] = {s->has_step_time_s, s->step_time_s},
        };
        for (int i = 0; i < STORE_NSCALARS; i++) {
            if (sc[i].has) {
                rp->present |= 1u << i;
                rp->scalars[i] = sc[i].v;
            }
        }
        rp->n_weight_norm = (uint32_t)s->n_layer_weight_norm;
        rp->n_update_ratio = (uint32_t)s->n_layer_update_ratio;
        rp->weight_norm = copy_floats(s->layer_weight_norm, s->n_layer_weight_norm);
        rp->update_ratio = copy_floats(s->layer_update_ratio, s->n_layer_update_ratio);
        oom |= (rp->n_weight_norm && !rp->weight_norm) || (rp->n_update_ratio && !rp->update_ratio);
    }
    if (info->sketches ||
        (c->ing->opts.stage && stage_wants_spool(c->ing->opts.stage, c->run_id, c->rank, r))) {
        /* The spool keeps the frame as it arrived for the monitor stage. A
         * large frame that is all the read buffer holds (on_alloc sized the
         * buffer to it) is handed over whole: copying 59 MB cost the loop
         * thread as much as decoding it. process() sees rbuf gone. */
        if (len >= FS_INGEST_RBUF_INITIAL && body == c->rbuf + DECODE_PREFIX_BYTES &&
            c->rlen == len + DECODE_PREFIX_BYTES) {
            rp->sketch_alloc = c->rbuf;
            rp->sketch_body = c->rbuf + DECODE_PREFIX_BYTES;
            rp->sketch_len = len;
            c->rbuf = NULL;
            c->rcap = c->rlen = 0;
        } else if ((rp->sketch_body = malloc(len)) != NULL) {
            memcpy(rp->sketch_body, body, len);
            rp->sketch_len = len;
        }
        oom |= !rp->sketch_body;
    }
    if (oom) {
        store_item_free(it);
        protocol_error(c, E(INTERNAL), "out of memory");
        return;
    }
    Foreshock__Frame *f = *fp;
    *fp = NULL;
    submit(c, it, f);
}

/* Records one advice on the stream (sent or acknowledged) with the writer. */
static void advice_record(struct conn *c, int64_t advice_id, int acked)
{
    struct store_item *it = store_item_new(STORE_ITEM_ADVICE);
    if (it) {
        it->advice = (struct store_advice_delivery){
            .advice_id = advice_id, .stream_id = c->stream_id, .acked = acked};
        if (store_submit(c->ing->opts.store, it) == 0)
            return;
        store_item_free(it);
    }
    log_limited(&c->ing->rl_advice, LOG_LEVEL_WARN, "ingest",
                "conn %llu: advice %lld %s on stream %lld not recorded (%s); it stays owed",
                (unsigned long long)c->id, (long long)advice_id, acked ? "acknowledged" : "sent",
                (long long)c->stream_id, it ? "daemon stopping" : "out of memory");
}

/* The trainer took these advices. Ids this connection was not sent (or
 * acknowledged already) are ignored: each sent advice is acknowledged once. */
static void on_advice_ack(struct conn *c, const Foreshock__AdviceAck *a)
{
    if (c->state != STREAMING) {
        protocol_error(c, E(SEQUENCE), "AdviceAck before Welcome");
        return;
    }
    size_t ignored = 0;
    for (size_t i = 0; i < a->n_advice_id; i++) {
        int64_t id = a->advice_id[i] > INT64_MAX ? -1 : (int64_t)a->advice_id[i];
        if (!advice_conn_take(&c->advice, id)) {
            ignored++;
            continue;
        }
        atomic_fetch_add(&c->ing->opts.stats->advice_acked, 1);
        advice_record(c, id, 1);
    }
    if (ignored)
        log_debug("ingest", "conn %llu: %zu advice acks for nothing outstanding ignored",
                  (unsigned long long)c->id, ignored);
}

static void on_bye(struct conn *c)
{
    c->eof = 1;
    update_reading(c);
    if (c->inflight == 0 && !c->pending)
        conn_close_when_flushed(c);
}

static void handle_frame(struct conn *c, const uint8_t *body, size_t len)
{
    struct ingest *ing = c->ing;
    atomic_fetch_add(&ing->opts.stats->frames_in, 1);
    Foreshock__Frame *f;
    struct decode_info info;
    struct fs_err err;
    if (decode_frame(body, len, &ing->opts.limits, &f, &info, &err) < 0) {
        atomic_fetch_add(&ing->opts.stats->decode_errors, 1);
        /* A report refused for what it holds is named, so that the client
         * drops it instead of resending it forever. */
        uint64_t seq = 0;
        if (c->state == STREAMING && decode_peek_report_seq(body, len, &seq) < 0)
            seq = 0;
        refuse(c, err.code, err.msg, seq);
        return;
    }
    switch (f->body_case) {
    case FORESHOCK__FRAME__BODY_HELLO:
        on_hello(c, f->hello);
        break;
    case FORESHOCK__FRAME__BODY_REPORT:
        on_report(c, &f, body, len, &info);
        break;
    case FORESHOCK__FRAME__BODY_BYE:
        on_bye(c);
        break;
    case FORESHOCK__FRAME__BODY_ADVICE_ACK:
        on_advice_ack(c, f->advice_ack);
        break;
    default:
        protocol_error(c, E(SEQUENCE), "Welcome, Ack and Error are daemon-to-client frames");
        break;
    }
    decode_frame_free(f);
}

/* --- frame buffers ---------------------------------------------------------------
 *
 * Every connection reads into a buffer of FS_INGEST_RBUF_INITIAL bytes
 * (max_connections of them at most). A larger frame needs a buffer of its
 * own, for as long as it is being read: those are what an authenticated
 * peer could multiply (24 connections announcing 63 MB each took 1.5 GB),
 * so the lengths of the frames they hold count against one daemon-wide
 * bound, frame_buffer_max_bytes. A stream whose next frame does not fit
 * stops reading and waits in line; room is handed out oldest waiter first,
 * and nobody passes a waiter (a large frame is not starved by small ones).
 * A holder always finishes: it reads its frame whole even while ingest is
 * paused (writer or stage backpressure; deadline: frame_timeout_s), and
 * gives the room back once the frame has left the connection: handed to
 * the writer (a frame parked by writer backpressure keeps its room until
 * it is resubmitted, so parked frames are within the bound too), or
 * dropped. The bound is at least max_frame_bytes, so a lone frame always
 * fits. Nothing is refused: waiting loses no data, and cannot deadlock, as
 * no holder waits for anything but the writer, which needs no ingest. */

static void fbuf_set(struct conn *c, uint64_t len)
{
    struct ingest *ing = c->ing;
    ing->fbuf_total = ing->fbuf_total - c->fbuf + len;
    c->fbuf = len;
    atomic_store(&ing->opts.stats->frame_buffer_bytes, ing->fbuf_total);
}

/* Length of the frame whose prefix starts the buffer, for a stream whose
 * buffer cannot hold it whole; 0 when nothing needs to grow. */
static uint32_t large_frame(const struct conn *c)
{
    uint32_t len;
    struct fs_err err;
    if (c->closing || c->state != STREAMING || c->rlen < DECODE_PREFIX_BYTES ||
        decode_prefix(c->rbuf, &c->ing->opts.limits, &len, &err) < 0 ||
        DECODE_PREFIX_BYTES + (size_t)len <= c->rcap)
        return 0;
    return len;
}

static void wait_remove(struct conn *c)
{
    struct ingest *ing = c->ing;
    if (!c->waiting)
        return;
    struct conn **p = &ing->wait_head, *prev = NULL;
    while (*p && *p != c) {
        prev = *p;
        p = &(*p)->wnext;
    }
    if (*p)
        *p = c->wnext;
    if (ing->wait_tail == c)
        ing->wait_tail = prev;
    c->wnext = NULL;
    c->waiting = 0;
}

/* Gives c's frame of len bytes a buffer of its own. 0, or -ENOMEM (the
 * connection is then refused: never acked, the client resends). */
static int rbuf_grow(struct conn *c, uint32_t len)
{
    uint8_t *p = realloc(c->rbuf, DECODE_PREFIX_BYTES + (size_t)len);
    if (!p) {
        protocol_error(c, E(INTERNAL), "out of memory for a frame buffer");
        return -ENOMEM;
    }
    c->rbuf = p;
    c->rcap = DECODE_PREFIX_BYTES + (size_t)len;
    fbuf_set(c, len);
    return 0;
}

/* Hands freed room to the waiters, oldest first, while their frames fit. */
static void grant_waiting(struct ingest *ing)
{
    struct conn *c;
    while ((c = ing->wait_head) != NULL) {
        uint32_t len = large_frame(c);
        if (len && ing->fbuf_total - c->fbuf + len > ing->opts.frame_buffer_max_bytes)
            return;
        wait_remove(c);
        if (len && rbuf_grow(c, len) < 0)
            continue;
        update_reading(c);
        if (c->tls) {
            /* Its frame may already sit decrypted or encrypted inside
             * OpenSSL, with no socket read to come: pull it on the next
             * loop turn (on_async), not from inside another connection's
             * processing. */
            c->tls_kick = 1;
            uv_async_send(&ing->async);
        }
    }
}

/* A frame larger than the buffer starts it: grow the buffer if the bound
 * allows (and nobody waits already), else wait in line, not reading.
 * Returns 1 when the buffer grew (there is room to read into). */
static int rbuf_room(struct conn *c)
{
    struct ingest *ing = c->ing;
    uint32_t len = large_frame(c);
    if (!len || c->waiting)
        return 0;
    if (!ing->wait_head && ing->fbuf_total - c->fbuf + len <= ing->opts.frame_buffer_max_bytes)
        return rbuf_grow(c, len) == 0;
    c->waiting = 1;
    if (ing->wait_tail)
        ing->wait_tail->wnext = c;
    else
        ing->wait_head = c;
    ing->wait_tail = c;
    atomic_fetch_add(&ing->opts.stats->frame_buffer_waits, 1);
    log_limited(&ing->rl_backpressure, LOG_LEVEL_INFO, "ingest",
                "conn %llu %s: a %u-byte frame waits for frame buffer room "
                "(%llu of frame_buffer_max_bytes %llu in use)",
                (unsigned long long)c->id, c->peer, len, (unsigned long long)ing->fbuf_total,
                (unsigned long long)ing->opts.frame_buffer_max_bytes);
    update_reading(c);
    return 0;
}

/* Bytes the frame that starts the buffer takes (0: its prefix is not in). */
static size_t head_need(const struct conn *c)
{
    if (c->rlen < DECODE_PREFIX_BYTES)
        return 0;
    const uint8_t *p = c->rbuf;
    return DECODE_PREFIX_BYTES +
           ((size_t)p[0] << 24 | (size_t)p[1] << 16 | (size_t)p[2] << 8 | (size_t)p[3]);
}

/* After frames were handled: once the large frame is out of the buffer,
 * back to the initial buffer; once it has also left the connection (not
 * parked), its room goes to the waiters. */
static void rbuf_settle(struct conn *c)
{
    if (c->rcap > FS_INGEST_RBUF_INITIAL && c->rlen <= FS_INGEST_RBUF_INITIAL &&
        head_need(c) <= FS_INGEST_RBUF_INITIAL) {
        uint8_t *p = realloc(c->rbuf, FS_INGEST_RBUF_INITIAL);
        if (!p)
            return; /* still held, still counted; tried again next time */
        c->rbuf = p;
        c->rcap = FS_INGEST_RBUF_INITIAL;
    }
    if (c->fbuf && c->rcap <= FS_INGEST_RBUF_INITIAL && !c->pending) {
        fbuf_set(c, 0);
        grant_waiting(c->ing);
    }
}

/* The buffered input is dropped (an error, a stop, a close): nothing of it
 * was acked; the client resends it. */
static void rbuf_drop(struct conn *c)
{
    c->rlen = 0;
    wait_remove(c);
    if (c->rcap > FS_INGEST_RBUF_INITIAL) {
        free(c->rbuf); /* on_alloc makes a new initial one if needed */
        c->rbuf = NULL;
        c->rcap = 0;
    }
    if (c->fbuf) {
        fbuf_set(c, 0);
        grant_waiting(c->ing);
    }
}

/* May this connection take another frame from its buffer now? */
static int can_process(const struct conn *c)
{
    return !c->closing && !c->pending && !c->eof &&
           (c->state == AWAIT_HELLO || c->state == STREAMING);
}

/* Handles every complete frame in the read buffer that the state allows.
 * Returns whether it took any frame or made room for one. */
static int process_frames(struct conn *c)
{
    struct ingest *ing = c->ing;
    size_t pos = 0;
    int took = 0;
    while (can_process(c) && !ing->stopping && c->rlen - pos >= DECODE_PREFIX_BYTES) {
        uint32_t len;
        struct fs_err err;
        if (decode_prefix(c->rbuf + pos, &ing->opts.limits, &len, &err) < 0) {
            atomic_fetch_add(&ing->opts.stats->decode_errors, 1);
            protocol_error(c, err.code, err.msg);
            return 1;
        }
        /* Before the Hello is accepted a peer is unauthenticated: it may not
         * make the daemon hold a large frame for it. */
        if (c->state == AWAIT_HELLO && len > FS_MAX_HELLO_FRAME_BYTES) {
            atomic_fetch_add(&ing->opts.stats->decode_errors, 1);
            char msg[128];
            snprintf(msg, sizeof(msg), "frame of %u bytes before Hello (at most %u)", len,
                     FS_MAX_HELLO_FRAME_BYTES);
            protocol_error(c, E(TOO_LARGE), msg);
            return 1;
        }
        size_t need = DECODE_PREFIX_BYTES + (size_t)len;
        if (c->rlen - pos < need)
            break;
        if (c->state == STREAMING && ing->budget == 0) {
            defer_add(c); /* the next loop iteration, before new reads */
            break;
        }
        handle_frame(c, c->rbuf + pos + DECODE_PREFIX_BYTES, len);
        took = 1;
        if (c->state == STREAMING)
            ing->budget -= need < ing->budget ? need : ing->budget;
        if (c->state == CLOSING)
            return 1; /* protocol_error reset the buffer */
        if (!c->rbuf) { /* the store item took the buffer (on_report): it held this frame only */
            pos = 0;
            c->frame_started_ms = 0;
            break;
        }
        pos += need;
    }
    if (pos) {
        memmove(c->rbuf, c->rbuf + pos, c->rlen - pos);
        c->rlen -= pos;
        /* What is left is the start of the next frame. */
        c->frame_started_ms = c->rlen ? uv_now(ing->loop) : 0;
    }
    rbuf_settle(c);
    /* A frame handed over with its buffer (pos back at 0) was taken too. */
    return rbuf_room(c) || took;
}


/* The initial read buffer, when the connection has none; a large frame's
 * own is made by rbuf_room, within frame_buffer_max_bytes. 0 or -ENOMEM. */
static int rbuf_initial(struct conn *c)
{
    if (c->rcap)
        return 0;
    uint8_t *p = malloc(FS_INGEST_RBUF_INITIAL);
    if (!p)
        return -ENOMEM;
    c->rbuf = p;
    c->rcap = FS_INGEST_RBUF_INITIAL;
    return 0;
}

/* The peer will send nothing more (EOF, or TLS close_notify): answer what
 * it sent, then close. */
static void peer_eof(struct conn *c)
{
    c->eof = 1;
    update_reading(c);
    if (c->state == CLOSING || (c->inflight == 0 && !c->pending))
        conn_close_when_flushed(c);
}

/* TLS failed (a handshake without a trusted certificate, not TLS at all):
 * the alert OpenSSL queued goes out, then the connection closes. No Error
 * frame: there is no channel to carry one. */
static void tls_failed(struct conn *c, const char *why)
{
    struct ingest *ing = c->ing;
    atomic_fetch_add(&ing->opts.stats->tls_failures, 1);
    log_limited(&ing->rl_proto, LOG_LEVEL_WARN, "ingest", "conn %llu %s: %s; closing",
                (unsigned long long)c->id, c->peer, why);
    c->state = CLOSING;
    c->rlen = 0;
    if (tls_flush(c) < 0)
        return;
    if (!c->linger_deadline_ms)
        c->linger_deadline_ms = uv_now(ing->loop) + FS_INGEST_LINGER_MS;
    conn_close_when_flushed(c);
    update_reading(c);
}

/* TLS: moves decrypted bytes into the read buffer, as many as it has room
 * for (a large frame's room comes from rbuf_room, as for a plain read; a
 * full buffer stops the pull until then), and sends what the handshake
 * wants sent. Returns 1 when bytes came, 0 when none, -1 when the
 * connection ended (closed, closing or at EOF). The rest stays decrypted
 * or encrypted inside OpenSSL, bounded by what was fed: one read. */
static int tls_pull(struct conn *c)
{
    int got = 0;
    while (!c->closing && c->state != CLOSING) {
        if (rbuf_initial(c) < 0) {
            conn_close(c);
            return -1;
        }
        char why[256];
        ssize_t n = c->rcap > c->rlen
                        ? tls_conn_read(c->tls, c->rbuf + c->rlen, c->rcap - c->rlen, why,
                                        sizeof(why))
                        : 0;
        if (n == -EPROTO) {
            tls_failed(c, why);
            return -1;
        }
        if (tls_flush(c) < 0)
            return -1;
        if (n == TLS_CLOSED) {
            peer_eof(c);
            return -1;
        }
        if (n <= 0)
            return got;
        c->rlen += (size_t)n;
        if (!c->frame_started_ms)
            c->frame_started_ms = uv_now(c->ing->loop);
        got = 1;
    }
    return -1;
}

/* Handles what the connection's buffer (and, with TLS, its decrypted
 * input) holds, as far as its state allows. */
static void process(struct conn *c)
{
    if (!c->tls) {
        (void)process_frames(c);
        return;
    }
    for (;;) {
        int pulled = tls_pull(c);
        if (pulled < 0)
            return;
        int used = process_frames(c);
        if ((!pulled && !used) || !can_process(c))
            return;
    }
}

static int want_read(const struct conn *c)
{
    if (c->closing)
        return 0;
    if (c->state == CLOSING)
        return !c->eof; /* discard until EOF after an Error */
    /* Reduction memory full: only streams whose next reports can complete
     * the oldest reducing step are read. */
    int stage_ok = !c->ing->stage_full || c->state != STREAMING ||
                   stage_may_read(c->ing->opts.stage, c->run_id, c->stream_id);
    /* A large frame's buffer is read to its end whatever pauses: its room
     * must come back (see "frame buffers"). */
    if (can_process(c) && !c->waiting && !c->deferred && !c->ing->stopping && c->fbuf &&
        c->rcap > FS_INGEST_RBUF_INITIAL && c->rlen < c->rcap)
        return 1;
    /* A new connection's Hello is read while the writer pushes back: it is
     * small and bounded (FS_MAX_HELLO_FRAME_BYTES), never parked, and written
     * first (store.h), so a trainer is answered while ingest is saturated,
     * or refused at once while storage fails. */
    int writer_ok = !c->ing->paused || c->state == AWAIT_HELLO;
    return can_process(c) && !c->deferred && writer_ok && stage_ok && !c->waiting &&
           !c->ing->stopping;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    struct conn *c = (struct conn *)h;
    struct ingest *ing = c->ing;
    if (c->state == CLOSING) {
        *buf = uv_buf_init((char *)ing->discard, sizeof(ing->discard));
        return;
    }
    if (c->tls) { /* ciphertext; tls_pull fills the plaintext buffer */
        *buf = uv_buf_init((char *)c->tbuf, FS_INGEST_TLS_READ_BYTES);
        return;
    }
    if (rbuf_initial(c) < 0) {
        *buf = uv_buf_init(NULL, 0); /* libuv reports UV_ENOBUFS */
        return;
    }
    *buf = uv_buf_init((char *)c->rbuf + c->rlen, (unsigned)(c->rcap - c->rlen));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    struct conn *c = (struct conn *)s;
    struct ingest *ing = c->ing;
    if (nread == 0)
        return;
    if (nread < 0) {
        if (nread != UV_EOF) {
            log_limited(&ing->rl_io, LOG_LEVEL_INFO, "ingest", "conn %llu %s: read: %s",
                        (unsigned long long)c->id, c->peer, uv_strerror((int)nread));
            conn_close(c);
            return;
        }
        /* The client is done sending: answer what it sent, then close. */
        peer_eof(c);
        return;
    }
    atomic_fetch_add(&ing->opts.stats->bytes_in, (uint64_t)nread);
    if (c->state == CLOSING) {
        c->discarded += (size_t)nread;
        if (c->discarded > FS_INGEST_DISCARD_MAX)
            conn_close(c);
        return;
    }
    if (c->tls) {
        if (tls_conn_feed(c->tls, (const uint8_t *)buf->base, (size_t)nread) < 0) {
            conn_close(c);
            return;
        }
    } else {
        c->rlen += (size_t)nread;
        if (!c->frame_started_ms)
            c->frame_started_ms = uv_now(ing->loop);
    }
    process(c);
    update_reading(c);
}

static void update_reading(struct conn *c)
{
    int want = want_read(c);
    if (want && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) == 0)
            c->reading = 1;
        /* While the daemon did not read, a stalled frame was its doing. */
        if (c->frame_started_ms)
            c->frame_started_ms = uv_now(c->ing->loop);
    } else if (!want && c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = 0;
    }
}

/* --- results from the writer ---------------------------------------------------- */

static void on_hello_done(struct conn *c, const struct store_result *r)
{
    if (r->error_code) {
        protocol_error(c, r->error_code, r->message);
        return;
    }
    if (c->state != AWAIT_WELCOME)
        return;
    c->run_id = r->run_id;
    c->stream_id = r->stream_id;
    c->seq_base = c->seq_last = r->seq;
    c->state = STREAMING;
    int rc = c->ing->opts.stage ? stage_hello(c->ing->opts.stage, r->run_id, c->run_name,
                                              r->stream_id, r->seq, &c->hello)
                                : 0;
    hello_release(&c->hello);
    if (rc == -ENOSPC) {
        char msg[FS_MAX_ERROR_MESSAGE];
        snprintf(msg, sizeof(msg), "run %s: more than %u distinct local groups declared to this "
                 "daemon; ranks of one daemon declare the same local_ranks",
                 c->run_name, RUN_MAX_LOCAL_GROUPS);
        protocol_error(c, E(LIMIT), msg);
        return;
    }
    if (rc < 0)
        log_limited(&c->ing->rl_limit, LOG_LEVEL_ERROR, "ingest",
                    "conn %llu: out of memory registering run %s with the monitors",
                    (unsigned long long)c->id, c->run_name);
    else if (c->ing->opts.stage &&
             stage_attempt(c->ing->opts.stage, r->run_id, r->stream_id, r->attempt,
                           &r->run_attempt) < 0)
        log_limited(&c->ing->rl_limit, LOG_LEVEL_ERROR, "ingest",
                    "conn %llu: out of memory registering the attempt of run %s",
                    (unsigned long long)c->id, c->run_name);
    Foreshock__Welcome w = FORESHOCK__WELCOME__INIT;
    w.protocol_version = FORESHOCK__PROTOCOL_VERSION__PROTOCOL_VERSION_CURRENT;
    w.last_seq = r->seq;
    w.server_version = FORESHOCK_VERSION;
    w.max_frame_bytes = c->ing->opts.limits.max_frame_bytes;
    w.has_stream_id = 1;
    w.stream_id = (uint64_t)r->stream_id;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_WELCOME;
    f.welcome = &w;
    send_frame(c, &f);
}

static void on_ack(struct conn *c, const struct store_result *r)
{
    if (r->error_code) {
        protocol_error(c, r->error_code, r->message);
        return;
    }
    if (c->state != STREAMING)
        return;
    if (r->seq > c->acked)
        c->acked = r->seq;
    Foreshock__Ack a = FORESHOCK__ACK__INIT;
    a.seq = c->acked;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_ACK;
    f.ack = &a;
    if (send_frame(c, &f) == 0)
        atomic_fetch_add(&c->ing->opts.stats->acks_out, 1);
}

/* Sends one committed advice on c and records the send. */
static void send_advice(struct conn *c, const struct advice_msg *m)
{
    struct ingest *ing = c->ing;
    int rc = advice_conn_sent(&c->advice, m->id);
    if (rc < 0) {
        log_limited(&ing->rl_advice, LOG_LEVEL_WARN, "ingest",
                    "conn %llu: advice %lld not sent: %s (%u unacknowledged at most); it stays "
                    "owed to the stream",
                    (unsigned long long)c->id, (long long)m->id,
                    rc == -ENOSPC ? "too many unacknowledged" : "out of memory",
                    ADVICE_MAX_UNACKED_PER_CONN);
        return;
    }
    uint8_t *buf;
    size_t len;
    if (advice_encode(m, &buf, &len) < 0) {
        log_limited(&ing->rl_advice, LOG_LEVEL_ERROR, "ingest",
                    "conn %llu: out of memory encoding advice %lld", (unsigned long long)c->id,
                    (long long)m->id);
        return;
    }
    if (send_buf(c, buf, len) < 0)
        return; /* closed: the advice stays owed to the stream */
    atomic_fetch_add(&ing->opts.stats->advice_out, 1);
    log_debug("ingest", "conn %llu: advice %lld %s alert %lld step %lld",
              (unsigned long long)c->id, (long long)m->id, advice_action_name(m->action),
              (long long)m->alert_id, (long long)m->step);
    advice_record(c, m->id, 0);
}

/* A committed advice: owed to one connection's stream (conn_id, right
 * after its Welcome), or new, for the connections of its run that take
 * advice (all, or those of one stream: an answer to a firing advice). */
static void deliver_advice(struct ingest *ing, const struct store_result *r)
{
    if (r->conn_id) {
        struct conn *c = conn_find(ing, r->conn_id);
        if (c && !c->closing && c->state == STREAMING && c->advice.enabled)
            send_advice(c, &r->advice);
        return;
    }
    for (struct conn *c = ing->head; c; c = c->next)
        if (!c->closing && c->state == STREAMING && c->advice.enabled &&
            c->run_id == r->run_id && (!r->stream_id || r->stream_id == c->stream_id))
            send_advice(c, &r->advice);
}

/* Resubmits parked items and reads again, oldest connection first. */
static void resume(struct ingest *ing)
{
    ing->paused = 0;
    for (struct conn *c = ing->head; c && !ing->paused; c = c->next) {
        if (c->closing)
            continue;
        if (c->pending) {
            struct store_item *it = c->pending;
            Foreshock__Frame *f = c->pending_frame;
            c->pending = NULL;
            c->pending_frame = NULL;
            if (submit(c, it, f) == -EAGAIN)
                break; /* pushed back again: the rest stays parked */
        }
        process(c);
    }
    for (struct conn *c = ing->head; c; c = c->next)
        update_reading(c);
}

static void on_async(uv_async_t *a)
{
    struct ingest *ing = a->data;
    struct store_result *res;
    size_t n = store_take_results(ing->opts.store, &res);
    int resumed = 0;
    for (size_t i = 0; i < n; i++) {
        const struct store_result *r = &res[i];
        if (r->kind == STORE_RESULT_RESUME) {
            resumed = 1;
            continue;
        }
        if (r->kind == STORE_RESULT_ADVICE) {
            deliver_advice(ing, r);
            continue;
        }
        struct conn *c = conn_find(ing, r->conn_id);
        if (!c)
            continue; /* closed meanwhile: the data is committed anyway */
        c->inflight -= r->items <= c->inflight ? r->items : c->inflight;
        if (r->kind == STORE_RESULT_HELLO)
            on_hello_done(c, r);
        else
            on_ack(c, r);
        if (c->closing)
            continue;
        if (c->state == STREAMING && !c->eof) {
            process(c);
            update_reading(c);
        }
        if (c->eof && c->inflight == 0 && !c->pending)
            conn_close_when_flushed(c);
        else if (ing->stopping && c->inflight == 0 && !c->pending)
            conn_linger(c);
    }
    free(res);
    /* Connections granted frame buffer room (grant_waiting) while their
     * frame is inside OpenSSL. */
    for (struct conn *c = ing->head; c; c = c->next) {
        if (!c->tls_kick)
            continue;
        c->tls_kick = 0;
        if (!c->closing && c->state == STREAMING) {
            process(c);
            update_reading(c);
        }
    }
    if (resumed && !ing->stopping)
        resume(ing);
    else if (resumed) {
        /* Stopping: parked items were received in full; they still commit. */
        ing->paused = 0;
        for (struct conn *c = ing->head; c && !ing->paused; c = c->next) {
            if (c->pending && !c->closing) {
                struct store_item *it = c->pending;
                Foreshock__Frame *f = c->pending_frame;
                c->pending = NULL;
                c->pending_frame = NULL;
                submit(c, it, f);
            }
        }
    }
    check_stop(ing);
}

/* The stage's reduction memory filled (stop reading) or drained (go on). */
static void on_stage_pressure(void *ctx, int full)
{
    struct ingest *ing = ctx;
    ing->stage_full = full;
    for (struct conn *c = ing->head; c; c = c->next) {
        if (!full && !c->closing && c->state == STREAMING)
            process(c);
        update_reading(c);
    }
}

static void notify_loop(void *ctx)
{
    struct ingest *ing = ctx;
    uv_async_send(&ing->async);
}

/* --- accepting ------------------------------------------------------------------ */

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
    uv_tcp_nodelay(&c->tcp, 1);
    if (ing->opts.tls && (!(c->tls = tls_conn_new(ing->opts.tls)) ||
                          !(c->tbuf = malloc(FS_INGEST_TLS_READ_BYTES)))) {
        log_limited(&ing->rl_io, LOG_LEVEL_ERROR, "ingest", "accept: out of memory");
        conn_close(c);
        return;
    }
    atomic_fetch_add(&ing->opts.stats->connections_total, 1);
    if (ing->stopping) {
        protocol_error(c, E(SHUTTING_DOWN), "daemon is stopping; reconnect later");
        return;
    }
    if (ing->nactive >= ing->opts.max_connections) {
        atomic_fetch_add(&ing->opts.stats->connections_rejected, 1);
        char msg[96];
        snprintf(msg, sizeof(msg), "connection limit reached (max_connections %llu)",
                 (unsigned long long)ing->opts.max_connections);
        log_limited(&ing->rl_limit, LOG_LEVEL_WARN, "ingest", "%s: refusing %s", msg, c->peer);
        protocol_error(c, E(LIMIT), msg);
        return;
    }
    c->rejected = 0;
    ing->nactive++;
    atomic_fetch_add(&ing->opts.stats->connections_current, 1);
    log_debug("ingest", "conn %llu %s: connected", (unsigned long long)c->id, c->peer);
    update_reading(c);
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
    if ((c->state == AWAIT_HELLO || c->state == STREAMING) && c->reading &&
        c->frame_started_ms && o->frame_timeout_s > 0 &&
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
            protocol_error(c, E(LIMIT), why);
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

static void check_stop(struct ingest *ing)
{
    if (!ing->stopping || ing->handles_closing)
        return;
    for (struct conn *c = ing->head; c; c = c->next)
        if (!c->closing && c->inflight == 0 && !c->pending)
            conn_linger(c);
    if (ing->head)
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
        rbuf_drop(c); /* partial or unread frames were never acked: the client resends */
        defer_remove(c);
        update_reading(c);
    }
    check_stop(ing);
}

static int resolve(const char *host, uint16_t port, struct sockaddr_storage *sa, char *err,
                   size_t errlen)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    char ps[8];
    snprintf(ps, sizeof(ps), "%u", port);
    struct addrinfo *ai = NULL;
    int rc = getaddrinfo(host, ps, &hints, &ai);
    if (rc != 0 || !ai) {
        snprintf(err, errlen, "cannot resolve listen address %s: %s", host, gai_strerror(rc));
        return -EINVAL;
    }
    memcpy(sa, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    return 0;
}

int ingest_start(uv_loop_t *loop, const struct ingest_opts *opts, struct ingest **out, char *err,
                 size_t errlen)
{
    struct ingest *ing = calloc(1, sizeof(*ing));
    if (!ing) {
        snprintf(err, errlen, "out of memory");
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
    struct sockaddr_storage sa;
    int rc = resolve(opts->host, opts->port, &sa, err, errlen);
    if (rc < 0) {
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
        snprintf(err, errlen, "cannot listen on %s:%u: %s", opts->host, opts->port,
                 uv_strerror(rc));
        goto fail;
    }
    struct sockaddr_storage bound;
    int len = sizeof(bound);
    uv_tcp_getsockname(&ing->listener, (struct sockaddr *)&bound, &len);
    ing->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                  : ((struct sockaddr_in *)&bound)->sin_port);
    if ((rc = uv_async_init(loop, &ing->async, on_async)) < 0) {
        snprintf(err, errlen, "uv_async_init: %s", uv_strerror(rc));
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
    uv_prepare_start(&ing->prepare, on_prepare);
    uv_idle_init(loop, &ing->idle);
    ing->idle.data = ing;
    ing->handles_open++;
    ing->budget = FS_INGEST_LOOP_FRAME_BYTES;
    store_set_notify(opts->store, notify_loop, ing);
    if (opts->stage) {
        stage_set_pressure(opts->stage, on_stage_pressure, ing);
        ing->stage_full = stage_full(opts->stage);
    }
    *out = ing;
    return 0;
fail:
    /* Let the loop finish closing the listener before freeing it. */
    uv_close((uv_handle_t *)&ing->listener, NULL);
    uv_run(loop, UV_RUN_NOWAIT);
    free(ing);
    return rc < 0 ? rc : -EIO;
}

uint16_t ingest_port(const struct ingest *ing) { return ing->port; }

void ingest_free(struct ingest *ing) { free(ing); }
