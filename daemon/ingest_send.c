/* Ingest, writing: encoded frames and raw bytes to a connection's socket
 * (through TLS when it has it), bounded by max_conn_buffer_bytes, and the
 * Error-then-close of a refused connection. */
#include "ingest_internal.h"

#include <errno.h>
#include <stdlib.h>

#include "tls.h"

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
int conn_send_raw(struct conn *c, uint8_t *buf, size_t len)
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

/* Queues an encoded frame (encrypted first on a TLS connection); takes buf.
 * A TLS connection still in its handshake has no way to carry a frame (an
 * Error to a peer that never finished it): it is closed instead. */
int conn_send_buf(struct conn *c, uint8_t *buf, size_t len)
{
    if (!c->tls)
        return conn_send_raw(c, buf, len);
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
    return conn_tls_flush(c);
}

int conn_send_frame(struct conn *c, const Foreshock__Frame *f)
{
    uint8_t *buf;
    size_t len;
    int rc = decode_encode(f, &buf, &len);
    if (rc < 0) {
        conn_close(c);
        return rc;
    }
    return conn_send_buf(c, buf, len);
}

/* Error{code, message, seq} (seq 0: none), then close after the write. */
void conn_refuse(struct conn *c, int code, const char *message, uint64_t seq)
{
    struct ingest *ing = c->ing;
    if (c->state == CLOSING)
        return;
    atomic_fetch_add(&ing->opts.stats->protocol_errors, 1);
    log_limited(&ing->rl_proto, LOG_LEVEL_WARN, "ingest", "conn %llu %s: error %d: %s",
                (unsigned long long)c->id, c->peer, code, message);
    c->state = CLOSING;
    conn_authenticated(c); /* its slot among the unauthenticated is free */
    store_item_free(c->pending);
    c->pending = NULL;
    decode_frame_free(c->pending_frame);
    c->pending_frame = NULL;
    conn_rbuf_drop(c);
    uint8_t *buf;
    size_t len;
    if (decode_encode_error(code, message, seq, &buf, &len) < 0 || conn_send_buf(c, buf, len) < 0) {
        conn_close(c);
        return;
    }
    c->linger_deadline_ms = uv_now(ing->loop) + FS_INGEST_LINGER_MS;
    conn_close_when_flushed(c);
    conn_update_reading(c);
}

/* Error{code, message} about the connection, then close after the write. */
void conn_protocol_error(struct conn *c, int code, const char *message)
{
    conn_refuse(c, code, message, 0);
}
