/* Ingest, TLS glue: moves ciphertext between the socket and tls.c's memory
 * BIOs and plaintext into the connection's read buffer. */
#include "ingest_internal.h"

#include <errno.h>
#include <stdlib.h>

#include "tls.h"

/* TLS: sends the records waiting (handshake messages, encrypted frames,
 * alerts). 0, or a negative errno after closing the connection. */
int conn_tls_flush(struct conn *c)
{
    uint8_t *out;
    size_t n;
    if (tls_conn_take_output(c->tls, &out, &n) < 0) {
        conn_close(c);
        return -ENOMEM;
    }
    return n ? conn_send_raw(c, out, n) : 0;
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
    conn_authenticated(c); /* no longer holds an unauthenticated slot */
    c->rlen = 0;
    if (conn_tls_flush(c) < 0)
        return;
    if (!c->linger_deadline_ms)
        c->linger_deadline_ms = uv_now(ing->loop) + FS_INGEST_LINGER_MS;
    conn_close_when_flushed(c);
    conn_update_reading(c);
}

/* TLS: moves decrypted bytes into the read buffer, as many as it has room
 * for (a large frame's room comes from rbuf_room, as for a plain read; a
 * full buffer stops the pull until then), and sends what the handshake
 * wants sent. Returns 1 when bytes came, 0 when none, -1 when the
 * connection ended (closed, closing or at EOF). The rest stays decrypted
 * or encrypted inside OpenSSL, bounded by what was fed: one read. */
int conn_tls_pull(struct conn *c)
{
    int got = 0;
    struct fs_err why; /* set by tls_conn_read whenever it returns -EPROTO */
    while (!c->closing && c->state != CLOSING) {
        if (conn_rbuf_initial(c) < 0) {
            conn_close(c);
            return -1;
        }
        ssize_t n = c->rcap > c->rlen
                        ? tls_conn_read(c->tls, c->rbuf + c->rlen, c->rcap - c->rlen, &why)
                        : 0;
        if (n == -EPROTO) {
            tls_failed(c, why.msg);
            return -1;
        }
        if (conn_tls_flush(c) < 0)
            return -1;
        if (n == TLS_CLOSED) {
            conn_peer_eof(c);
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
