/* The client's I/O thread: connect with backoff, Hello -> Welcome, stream
 * the replay buffer, apply Acks, handle Error frames, Bye on close.
 *
 * One thread per client, blocking only in poll() on two descriptors: the
 * socket (non-blocking) and the self-pipe the caller threads write to when
 * there is something new (a report, closing). The replay buffer and counters
 * are shared with the caller threads under c->mu; the socket, read buffer
 * and write cursor below belong to this thread alone.
 *
 * Poison reports: the daemon answers a report it will never take (over its
 * limits, undecodable) with Error{MALFORMED, LIMIT or TOO_LARGE} and closes.
 * Resending it would hit the same wall forever, so it is dropped, counted
 * (dropped, daemon_refused) and logged, and replaced by a placeholder that
 * keeps its seq: a Report with its step (and time) only. The daemon takes a
 * stream's seqs only in order, so without it every later report would be
 * refused too. The daemon names the report (Error.seq); a daemon that does
 * not (or an error it could not tie to a report) leaves only MALFORMED and
 * TOO_LARGE to go on: then the client sends one report at a time (waiting
 * for its ack) until it is past the reports that were in flight, and a
 * report refused on its own is the one. A report above the daemon's
 * max_frame_bytes (Welcome) is replaced before it is sent. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "backoff.h"
#include "client.h"
#include "net.h"
#include "tls.h"
#include "wire.h"

#include <openssl/ssl.h>

struct fsc_io {
    struct fsc_client *c;
    int fd;
    SSL *ssl;                 /* TLS on fd, or NULL */
    int tls_read_wants_write; /* a TLS read waits for the socket to be writable */
    uint64_t rng;
    unsigned fail_streak; /* connect failures since the last handshake */
    uint64_t sessions;    /* handshakes completed */
    uint64_t max_sent;    /* highest client seq ever written: later writes are resends */

    /* Per connection. */
    int welcomed, bye_queued, bye_sent, progress;
    uint32_t max_frame;  /* Welcome.max_frame_bytes, 0: no limit known */
    int64_t deadline_ms; /* handshake, or Bye wait; 0: none */
    const uint8_t *ctrl; /* Hello or Bye being written */
    size_t ctrl_len, ctrl_off;
    struct fsc_entry *cur; /* report being written */
    uint8_t hdr[FSC_WIRE_REPORT_HDR_MAX];
    size_t hdr_len, cur_off; /* cur_off counts hdr then body */
    uint64_t taken_max;      /* highest client seq taken on this connection */

    /* Across connections: probe mode (see the file comment). */
    int probe;
    uint64_t probe_until;
    char refused_note[FSC_ERROR_LEN]; /* set under mu, logged once mu is released */

    uint8_t *bye;
    size_t bye_len;
    uint8_t *ackbuf; /* AdviceAck frame being written (ctrl), owned */
    size_t ack_n;    /* acks it holds */
    struct fsc_wire_reader rd;
};

/* ---- small helpers ------------------------------------------------------------ */

static void io_log(struct fsc_io *io, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Reports an event: WARN and ERROR also become last_error. Takes mu. */
static void io_log(struct fsc_io *io, int level, const char *fmt, ...)
{
    struct fsc_client *c = io->c;
    char msg[FSC_ERROR_LEN];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (level >= FSC_LOG_WARN) {
        pthread_mutex_lock(&c->mu);
        memcpy(c->last_error, msg, sizeof(msg));
        pthread_mutex_unlock(&c->mu);
    }
    if (c->log)
        c->log(c->log_ctx, level, msg);
}

void fsc_io_wake(struct fsc_client *c)
{
    /* One byte in the pipe is enough; the flag keeps a fast submitter from
     * making a syscall per report. */
    if (atomic_exchange(&c->wake_pending, 1) == 0) {
        ssize_t n = write(c->wake_wr, "w", 1);
        (void)n; /* EAGAIN: the pipe is full, so a wakeup is pending anyway */
    }
}

/* The trainer takes an advice (advice.c's box) and the I/O thread is woken
 * to write its ack. */
int fsc_poll_advice(fsc_client *c, struct fsc_advice *out)
{
    int rc;

    if (!c || !out)
        return -EINVAL;
    pthread_mutex_lock(&c->mu);
    rc = fsc_advice_box_take(&c->advice, out);
    pthread_mutex_unlock(&c->mu);
    if (rc > 0 && !c->record_only)
        fsc_io_wake(c); /* the ack */
    return rc;
}

/* Empties the pipe, then clears the flag; callers look at the shared state
 * afterwards. In this order a wake that finds the flag still set (and so
 * writes nothing) always happens before that look. Clearing first would let
 * this read swallow a byte written after the clear, leaving the flag set
 * with an empty pipe: every later wake, fsc_close's included, would then
 * write nothing and the thread would sleep in poll() for good. */
static void drain_wake(struct fsc_client *c)
{
    char buf[64];

    while (read(c->wake_rd, buf, sizeof(buf)) > 0)
        ;
    /* An exchange, not a store: it reads the waker's exchange, so the
     * waker's earlier writes (the report it queued) are visible here. */
    (void)atomic_exchange(&c->wake_pending, 0);
}

static int closing(struct fsc_client *c)
{
    int v;

    pthread_mutex_lock(&c->mu);
    v = c->closing;
    pthread_mutex_unlock(&c->mu);
    return v;
}

/* Remaining milliseconds until deadline (>= 0), for poll. */
static int remaining(int64_t deadline)
{
    int64_t left = deadline - fsc_now_ms();

    if (left <= 0)
        return 0;
    return left > 600000 ? 600000 : (int)left;
}

/* Sleeps up to ms (< 0: forever) unless the client starts closing. Returns 1
 * when closing. */
static int wait_or_close(struct fsc_client *c, int ms)
{
    int64_t deadline = ms >= 0 ? fsc_now_ms() + ms : 0;

    for (;;) {
        struct pollfd p = {.fd = c->wake_rd, .events = POLLIN};
        if (closing(c))
            return 1;
        if (ms >= 0 && fsc_now_ms() >= deadline)
            return 0;
        if (poll(&p, 1, ms >= 0 ? remaining(deadline) : -1) > 0)
            drain_wake(c);
    }
}

/* Under mu: the replay buffer emptied or the client failed. */
static void signal_drained(struct fsc_client *c)
{
    if (c->replay.count == 0 || c->failed)
        pthread_cond_broadcast(&c->drained);
}

/* ---- connecting --------------------------------------------------------------- */

/* Waits for a non-blocking connect on fd. 0 connected, -ECANCELED closing,
 * -ETIMEDOUT, or the connect error. */
static int await_connect(struct fsc_client *c, int fd)
{
    int64_t deadline = fsc_now_ms() + c->connect_timeout_ms;

    for (;;) {
        struct pollfd p[2] = {{.fd = fd, .events = POLLOUT}, {.fd = c->wake_rd, .events = POLLIN}};
        int n;

        if (closing(c))
            return -ECANCELED;
        if (fsc_now_ms() >= deadline)
            return -ETIMEDOUT;
        n = poll(p, 2, remaining(deadline));
        if (n < 0 && errno != EINTR)
            return -errno;
        if (n > 0 && (p[1].revents & POLLIN))
            drain_wake(c);
        if (n > 0 && p[0].revents)
            return fsc_net_connect_finish(fd);
    }
}

/* TLS handshake on the connected io->fd within the handshake timeout. 0
 * and io->ssl, or -ECANCELED, -ETIMEDOUT, -ENOMEM, -EPROTO (text in err). */
static int tls_connect(struct fsc_io *io, char *err, size_t errlen)
{
    struct fsc_client *c = io->c;
    int64_t deadline = fsc_now_ms() + c->handshake_timeout_ms;
    int rc;

    if (!(io->ssl = fsc_tls_new(&c->tls, io->fd)))
        return fsc_err(err, errlen, -ENOMEM, "TLS: out of memory");
    while ((rc = fsc_tls_handshake(io->ssl, err, errlen)) > 0) {
        struct pollfd p[2] = {{.fd = io->fd, .events = rc == FSC_TLS_WANT_WRITE ? POLLOUT : POLLIN},
                              {.fd = c->wake_rd, .events = POLLIN}};
        int n;

        if (closing(c)) {
            rc = -ECANCELED;
            break;
        }
        if (fsc_now_ms() >= deadline) {
            rc = fsc_err(err, errlen, -ETIMEDOUT,
                         "TLS handshake with %s:%u: no answer within "
                         "%u ms",
                         c->host, (unsigned)c->port, c->handshake_timeout_ms);
            break;
        }
        n = poll(p, 2, remaining(deadline));
        if (n < 0 && errno != EINTR) {
            rc = fsc_err(err, errlen, -errno, "poll: %s", strerror(errno));
            break;
        }
        if (n > 0 && (p[1].revents & POLLIN))
            drain_wake(c);
    }
    if (rc == 0)
        return 0;
    fsc_tls_close(io->ssl);
    io->ssl = NULL;
    return rc;
}

/* Tries every address of host:port in turn. 0 and io->fd, -ECANCELED, or
 * the last error (text in err). */
static int connect_any(struct fsc_io *io, char *err, size_t errlen)
{
    struct fsc_client *c = io->c;
    struct addrinfo *ai, *a;
    int rc, fd = -1, tls_failed = 0;

    if ((rc = fsc_net_resolve(c->host, c->port, &ai, err, errlen)) < 0)
        return rc;
    rc = -EHOSTUNREACH;
    for (a = ai; a; a = a->ai_next) {
        rc = fsc_net_connect_start(a, &fd);
        if (rc == 0)
            rc = await_connect(c, fd);
        if (rc >= 0) {
            io->fd = fd;
            if (!c->tls.ctx || (rc = tls_connect(io, err, errlen)) == 0)
                break;
            io->fd = -1;
            close(fd);
            fd = -1;
            if (rc == -ECANCELED)
                break;
            tls_failed = 1; /* err says why; a later address may still do */
            continue;
        }
        if (fd >= 0)
            close(fd);
        fd = -1;
        if (rc == -ECANCELED)
            break;
    }
    freeaddrinfo(ai);
    if (rc < 0 && rc != -ECANCELED && !tls_failed)
        fsc_err(err, errlen, rc, "cannot connect to %s:%u: %s", c->host, (unsigned)c->port,
                strerror(-rc));
    return rc;
}

/* ---- frames from the daemon ------------------------------------------------------ */

/* Client seq covered by a wire seq. */
static uint64_t to_client_seq(struct fsc_client *c, uint64_t wire)
{
    uint64_t s = wire > c->seq_offset ? wire - c->seq_offset : 0;

    return s > c->submitted ? c->submitted : s;
}

/* Under mu: everything up to client seq s is committed. */
static void apply_ack(struct fsc_io *io, uint64_t s)
{
    struct fsc_client *c = io->c;
    size_t placeholders = c->replay.placeholders;
    size_t n = fsc_replay_ack(&c->replay, s);

    /* A placeholder's ack commits a seq, not a report. */
    c->acked += n - (placeholders - c->replay.placeholders);
    if (n)
        io->progress = 1;
    if (s > c->acked_seq)
        c->acked_seq = s;
    if (io->probe && c->acked_seq >= io->probe_until)
        io->probe = 0;
    signal_drained(c);
}

static int on_welcome(struct fsc_io *io, const Foreshock__Welcome *w)
{
    struct fsc_client *c = io->c;
    uint64_t s, lost = 0;

    if (io->welcomed)
        return -EPROTO;
    if (w->protocol_version != FORESHOCK__PROTOCOL_VERSION__PROTOCOL_VERSION_CURRENT) {
        pthread_mutex_lock(&c->mu);
        c->failed = 1;
        signal_drained(c);
        pthread_mutex_unlock(&c->mu);
        io_log(io, FSC_LOG_ERROR, "daemon speaks protocol version %u, this client %u: giving up",
               w->protocol_version, FORESHOCK__PROTOCOL_VERSION__PROTOCOL_VERSION_CURRENT);
        return -EPROTO;
    }
    io->welcomed = 1;
    io->deadline_ms = 0;
    io->max_frame = w->max_frame_bytes;
    pthread_mutex_lock(&c->mu);
    if (!c->offset_known) {
        /* First handshake of this client: whatever the stream already holds
         * came from an earlier process, so our numbering continues after it. */
        c->offset_known = 1;
        c->seq_offset = w->last_seq;
    }
    s = to_client_seq(c, w->last_seq);
    if (s < c->acked_seq)
        lost = c->acked_seq - s;
    apply_ack(io, s);
    fsc_replay_rewind(&c->replay);
    c->connected = 1;
    if (io->sessions++ > 0)
        c->reconnects++;
    pthread_mutex_unlock(&c->mu);
    io->fail_streak = 0;
    io_log(io, FSC_LOG_INFO, "connected to %s:%u, resuming after seq %llu", c->host,
           (unsigned)c->port, (unsigned long long)w->last_seq);
    if (lost)
        io_log(io, FSC_LOG_WARN,
               "daemon's last_seq %llu is %llu below what it acknowledged before: it lost data",
               (unsigned long long)w->last_seq, (unsigned long long)lost);
    return 0;
}

/* Under mu: the daemon will never take report e. Replaces it by its
 * placeholder (see the file comment) and counts it. 0, or < 0 when it
 * stays as it is (-ENOMEM, -EBUSY: it is being written; -EPROTO). */
static int refuse_entry(struct fsc_client *c, struct fsc_entry *e)
{
    uint8_t body[FSC_WIRE_PLACEHOLDER_MAX];
    size_t n = fsc_wire_report_placeholder(e->body, e->len, body);
    struct fsc_entry *p;
    int rc;

    if (!n)
        return -EPROTO;
    if (!(p = malloc(sizeof(*p) + n)))
        return -ENOMEM;
    memcpy(p->data, body, n);
    p->next = NULL;
    p->seq = e->seq;
    p->placeholder = 1;
    p->len = n;
    p->body = p->data;
    if ((rc = fsc_replay_replace(&c->replay, e, p)) < 0) {
        free(p);
        return rc;
    }
    c->dropped++;
    c->daemon_refused++;
    return 0;
}

/* Error{seq}: the daemon names the report it refuses (*seq: ours). 0 when
 * that report was replaced by its placeholder, -EEXIST when it was that
 * placeholder already, -ENOENT when it is not one we hold. */
static int refuse_named(struct fsc_io *io, uint64_t wire_seq, const char *msg, uint64_t *seq)
{
    struct fsc_client *c = io->c;
    struct fsc_entry *e = NULL;
    uint64_t s = 0;
    int rc = -ENOENT;

    pthread_mutex_lock(&c->mu);
    if (wire_seq > c->seq_offset && wire_seq - c->seq_offset <= c->submitted) {
        s = wire_seq - c->seq_offset;
        e = fsc_replay_find(&c->replay, s);
    }
    /* The connection ends: nothing is being written any more. */
    fsc_replay_sent(&c->replay);
    *seq = s;
    if (e && !e->placeholder)
        rc = refuse_entry(c, e);
    else if (e)
        rc = -EEXIST; /* its placeholder: nothing smaller to send */
    pthread_mutex_unlock(&c->mu);
    if (rc == 0)
        io_log(io, FSC_LOG_WARN,
               "daemon refused report seq %llu (%s): dropped; an empty report keeps its seq",
               (unsigned long long)s, msg);
    return rc == 0 || rc == -EEXIST ? rc : -ENOENT;
}

/* The daemon refuses even the placeholder of report seq: the stream can
 * never move past it (every later seq waits for it), so resending would
 * loop for ever. The client fails, saying which report. -EPERM. */
static int placeholder_refused(struct fsc_io *io, uint64_t seq, const char *msg)
{
    struct fsc_client *c = io->c;
    pthread_mutex_lock(&c->mu);
    c->failed = 1;
    signal_drained(c);
    pthread_mutex_unlock(&c->mu);
    io_log(io, FSC_LOG_ERROR,
           "daemon refused report seq %llu even as an empty placeholder (%s): "
           "giving up",
           (unsigned long long)seq, msg);
    return -EPERM;
}

static int on_error(struct fsc_io *io, const Foreshock__Error *e)
{
    struct fsc_client *c = io->c;
    const char *msg = e->message ? e->message : "";

    switch (e->code) {
    case FORESHOCK__ERROR_CODE__ERROR_PROTOCOL_VERSION:
    case FORESHOCK__ERROR_CODE__ERROR_AUTH:
        break; /* fatal, below */
    case FORESHOCK__ERROR_CODE__ERROR_MALFORMED:
    case FORESHOCK__ERROR_CODE__ERROR_TOO_LARGE:
    case FORESHOCK__ERROR_CODE__ERROR_LIMIT:
        if (io->welcomed && e->has_seq) {
            uint64_t seq;
            int rn = refuse_named(io, e->seq, msg, &seq);
            if (rn == 0)
                return -EPROTO; /* the rest is resent on the next connection */
            if (rn == -EEXIST)
                return placeholder_refused(io, seq, msg);
        }
        if (e->code == FORESHOCK__ERROR_CODE__ERROR_LIMIT) {
            /* About the connection (max_connections, max_runs, deadlines):
             * later it may pass. */
            io_log(io, FSC_LOG_WARN, "daemon error %d: %s; reconnecting", (int)e->code, msg);
            return -ECONNRESET;
        }
        if (!io->welcomed)
            break; /* our Hello was refused: retrying cannot help */
        pthread_mutex_lock(&c->mu);
        if (io->probe && c->replay.in_flight == 1) {
            /* Sent alone: this report is the one the daemon refuses. */
            uint64_t seq = c->replay.head->seq;
            fsc_replay_sent(&c->replay);
            if (c->replay.head->placeholder) {
                pthread_mutex_unlock(&c->mu);
                return placeholder_refused(io, seq, msg);
            }
            int rc = refuse_entry(c, c->replay.head);
            pthread_mutex_unlock(&c->mu);
            if (rc == 0)
                io_log(io, FSC_LOG_WARN,
                       "daemon refused report seq %llu (%s): dropped; an empty report keeps its "
                       "seq",
                       (unsigned long long)seq, msg);
            return -EPROTO;
        }
        pthread_mutex_unlock(&c->mu);
        if (!io->probe) {
            io->probe = 1;
            io->probe_until = io->taken_max;
        }
        io_log(io, FSC_LOG_WARN, "daemon refused a report (%s): resending one at a time", msg);
        return -EPROTO;
    default:
        io_log(io, FSC_LOG_WARN, "daemon error %d: %s; reconnecting", (int)e->code, msg);
        return -ECONNRESET;
    }
    pthread_mutex_lock(&c->mu);
    c->failed = 1;
    signal_drained(c);
    pthread_mutex_unlock(&c->mu);
    io_log(io, FSC_LOG_ERROR, "daemon refused this client (error %d: %s): giving up", (int)e->code,
           msg);
    return -EPERM;
}

/* Keeps an advice for fsc_poll_advice (never a callback from here). */
static int on_advice(struct fsc_io *io, const Foreshock__Advice *a)
{
    struct fsc_client *c = io->c;
    int rc;

    pthread_mutex_lock(&c->mu);
    rc = fsc_advice_box_put(&c->advice, a);
    pthread_mutex_unlock(&c->mu);
    if (rc == -ENOBUFS)
        io_log(io, FSC_LOG_WARN,
               "advice %llu (%s, alert %llu) not kept: %d advices are pending untaken; the "
               "daemon sends it again after a reconnect",
               (unsigned long long)a->advice_id, fsc_advice_action_name((int)a->action),
               (unsigned long long)a->alert_id, FSC_MAX_PENDING_ADVICE);
    else if (rc == 1)
        io_log(io, FSC_LOG_INFO, "advice %llu: %s (alert %llu, %s, step %lld)",
               (unsigned long long)a->advice_id, fsc_advice_action_name((int)a->action),
               (unsigned long long)a->alert_id, a->rule, a->has_step ? (long long)a->step : -1LL);
    return 0;
}

/* Handles one frame. 0 to go on, < 0 to end the connection. */
static int on_frame(struct fsc_io *io, const Foreshock__Frame *f)
{
    struct fsc_client *c = io->c;

    switch (f->body_case) {
    case FORESHOCK__FRAME__BODY_WELCOME:
        return on_welcome(io, f->welcome);
    case FORESHOCK__FRAME__BODY_ACK:
        if (!io->welcomed)
            break;
        pthread_mutex_lock(&c->mu);
        apply_ack(io, to_client_seq(c, f->ack->seq));
        pthread_mutex_unlock(&c->mu);
        return 0;
    case FORESHOCK__FRAME__BODY_ERROR:
        return on_error(io, f->error);
    case FORESHOCK__FRAME__BODY_BYE:
        io_log(io, FSC_LOG_INFO, "daemon said bye");
        return -ECONNRESET;
    case FORESHOCK__FRAME__BODY_ADVICE:
        if (!io->welcomed || !c->advice_on)
            break;
        return on_advice(io, f->advice);
    default:
        break;
    }
    io_log(io, FSC_LOG_WARN, "unexpected frame %d from daemon; reconnecting", (int)f->body_case);
    return -EPROTO;
}

/* Reads what is available and handles complete frames. */
static int do_read(struct fsc_io *io)
{
    struct fsc_wire_reader *rd = &io->rd;
    Foreshock__Frame *f;
    int rc;

    for (;;) {
        ssize_t n;

        while ((rc = fsc_wire_next(rd, &f)) == 1) {
            rc = on_frame(io, f);
            foreshock__frame__free_unpacked(f, NULL);
            if (rc < 0)
                return rc;
        }
        if (rc < 0) {
            io_log(io, FSC_LOG_WARN, "undecodable frame from daemon; reconnecting");
            return rc;
        }
        /* fsc_wire_next consumed or refused any full buffer, so there is room. */
        if (io->ssl) {
            char why[FSC_ERROR_LEN];
            int want = 0;
            n = fsc_tls_recv(io->ssl, rd->buf + rd->len, sizeof(rd->buf) - rd->len, &want, why,
                             sizeof(why));
            io->tls_read_wants_write = n == -EAGAIN && want == FSC_TLS_WANT_WRITE;
            if (n == -EAGAIN)
                return 0;
            if (n < 0) {
                /* The daemon refusing our certificate shows here, at the
                 * first read after a TLS 1.3 handshake. */
                io_log(io, FSC_LOG_WARN, "%s", why);
                return (int)n;
            }
        } else {
            n = recv(io->fd, rd->buf + rd->len, sizeof(rd->buf) - rd->len, 0);
        }
        if (n == 0) {
            if (!io->bye_sent)
                io_log(io, FSC_LOG_WARN, "daemon closed the connection");
            return -ECONNRESET;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            io_log(io, FSC_LOG_WARN, "receive failed: %s", strerror(errno));
            return -errno;
        }
        rd->len += (size_t)n;
    }
}

/* ---- writing ------------------------------------------------------------------ */

/* The length prefix's value for e on the wire (what max_frame_bytes bounds). */
static uint64_t frame_len(const struct fsc_io *io, const struct fsc_entry *e)
{
    uint8_t hdr[FSC_WIRE_REPORT_HDR_MAX];

    return fsc_wire_report_header(e->seq + io->c->seq_offset, e->len, hdr) - 4 + (uint64_t)e->len;
}

/* Under mu: the next report to write, or NULL. A report above the
 * daemon's frame limit (it would refuse it forever) goes as its
 * placeholder; io->refused_note says so for the caller to log. */
static struct fsc_entry *next_report(struct fsc_io *io)
{
    struct fsc_client *c = io->c;
    struct fsc_entry *e;

    if (!io->welcomed || io->bye_queued || (io->probe && c->replay.in_flight > 0))
        return NULL;
    e = c->replay.next_send;
    if (e && io->max_frame && !e->placeholder && frame_len(io, e) > io->max_frame) {
        uint64_t seq = e->seq;
        size_t len = e->len;
        if (refuse_entry(c, e) == 0) {
            snprintf(io->refused_note, sizeof(io->refused_note),
                     "report seq %llu (%zu bytes) exceeds the daemon's max_frame_bytes %u: "
                     "dropped; an empty report keeps its seq",
                     (unsigned long long)seq, len, io->max_frame);
        }
    }
    return fsc_replay_take(&c->replay);
}

/* Under mu: acknowledgements of taken advices wait to be written. */
static int acks_ready(struct fsc_io *io)
{
    struct fsc_client *c = io->c;

    return c->advice_on && io->welcomed && !io->bye_sent && c->advice.n_acks > 0;
}

/* Makes the AdviceAck frame of the queued acks the control frame to write.
 * 1 when there is one. */
static int pick_acks(struct fsc_io *io)
{
    struct fsc_client *c = io->c;
    int rc = 0;

    pthread_mutex_lock(&c->mu);
    if (acks_ready(io) &&
        fsc_advice_box_pack_acks(&c->advice, &io->ackbuf, &io->ctrl_len, &io->ack_n) == 0 &&
        io->ackbuf) {
        io->ctrl = io->ackbuf;
        io->ctrl_off = 0;
        rc = 1;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Picks the next thing to write. 1 when there is one, 0 when idle. */
static int pick_write(struct fsc_io *io)
{
    struct fsc_client *c = io->c;
    struct fsc_entry *e;

    if (io->ctrl || io->cur)
        return 1;
    /* Acks first: they are small, and before a Bye they are the trainer's
     * last word on its advice. */
    if (pick_acks(io))
        return 1;
    if (io->bye_queued) {
        if (io->bye_sent)
            return 0;
        io->ctrl = io->bye;
        io->ctrl_len = io->bye_len;
        io->ctrl_off = 0;
        return 1;
    }
    pthread_mutex_lock(&c->mu);
    e = next_report(io);
    pthread_mutex_unlock(&c->mu);
    if (io->refused_note[0]) {
        io_log(io, FSC_LOG_WARN, "%s", io->refused_note);
        io->refused_note[0] = '\0';
    }
    if (!e)
        return 0;
    io->cur = e;
    io->cur_off = 0;
    io->hdr_len = fsc_wire_report_header(e->seq + c->seq_offset, e->len, io->hdr);
    if (e->seq > io->taken_max)
        io->taken_max = e->seq;
    return 1;
}

static void finish_report(struct fsc_io *io)
{
    struct fsc_client *c = io->c;
    uint64_t seq = io->cur->seq;

    pthread_mutex_lock(&c->mu);
    fsc_replay_sent(&c->replay);
    c->sent++;
    if (seq <= io->max_sent)
        c->resent++;
    /* An ack may have covered it while it was being written. */
    apply_ack(io, c->acked_seq);
    pthread_mutex_unlock(&c->mu);
    if (seq > io->max_sent)
        io->max_sent = seq;
    io->cur = NULL;
}

static void drop_ackbuf(struct fsc_io *io)
{
    free(io->ackbuf);
    io->ackbuf = NULL;
    io->ack_n = 0;
}

/* Writes until the socket would block or nothing is left. */
static int do_write(struct fsc_io *io)
{
    while (pick_write(io)) {
        ssize_t n;

        if (io->ssl) {
            /* One buffer per write: header, then body (each may be partial). */
            const void *p;
            size_t len;
            char why[FSC_ERROR_LEN];
            int want = 0;
            if (io->ctrl) {
                p = io->ctrl + io->ctrl_off;
                len = io->ctrl_len - io->ctrl_off;
            } else if (io->cur_off < io->hdr_len) {
                p = io->hdr + io->cur_off;
                len = io->hdr_len - io->cur_off;
            } else {
                p = io->cur->body + (io->cur_off - io->hdr_len);
                len = io->cur->len - (io->cur_off - io->hdr_len);
            }
            n = fsc_tls_send(io->ssl, p, len, &want, why, sizeof(why));
            if (n == -EAGAIN)
                return 0;
            if (n < 0) {
                io_log(io, FSC_LOG_WARN, "%s", why);
                return (int)n;
            }
        } else if (io->ctrl) {
            n = send(io->fd, io->ctrl + io->ctrl_off, io->ctrl_len - io->ctrl_off,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
        } else {
            struct iovec iov[2];
            struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
            if (io->cur_off < io->hdr_len) {
                iov[0] = (struct iovec){io->hdr + io->cur_off, io->hdr_len - io->cur_off};
                iov[1] = (struct iovec){(void *)io->cur->body, io->cur->len};
            } else {
                size_t off = io->cur_off - io->hdr_len;
                iov[0] = (struct iovec){(void *)(io->cur->body + off), io->cur->len - off};
                mh.msg_iovlen = 1;
            }
            n = sendmsg(io->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        if (n < 0 && !io->ssl) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            io_log(io, FSC_LOG_WARN, "send failed: %s", strerror(errno));
            return -errno;
        }
        if (io->ctrl) {
            io->ctrl_off += (size_t)n;
            if (io->ctrl_off == io->ctrl_len) {
                if (io->ctrl == io->bye) {
                    io->bye_sent = 1;
                    if (io->ssl)
                        (void)SSL_shutdown(io->ssl); /* close_notify; best effort */
                    shutdown(io->fd, SHUT_WR);
                } else if (io->ctrl == io->ackbuf) {
                    pthread_mutex_lock(&io->c->mu);
                    fsc_advice_box_acks_sent(&io->c->advice, io->ack_n);
                    pthread_mutex_unlock(&io->c->mu);
                    drop_ackbuf(io);
                }
                io->ctrl = NULL;
            }
        } else {
            io->cur_off += (size_t)n;
            if (io->cur_off == io->hdr_len + io->cur->len)
                finish_report(io);
        }
    }
    return 0;
}

/* ---- one connection ------------------------------------------------------------- */

/* Under mu: would pick_write find a report? */
static int reports_ready(struct fsc_io *io)
{
    struct fsc_client *c = io->c;

    return io->welcomed && !io->bye_queued && c->replay.next_send &&
           !(io->probe && c->replay.in_flight > 0);
}

static void session(struct fsc_io *io)
{
    struct fsc_client *c = io->c;

    io->welcomed = io->bye_queued = io->bye_sent = io->progress = 0;
    io->max_frame = 0;
    io->rd.len = 0;
    io->cur = NULL;
    io->taken_max = 0;
    io->ctrl = c->hello;
    io->ctrl_len = c->hello_len;
    io->ctrl_off = 0;
    io->deadline_ms = fsc_now_ms() + c->handshake_timeout_ms;

    for (;;) {
        struct pollfd p[2] = {{.fd = c->wake_rd, .events = POLLIN},
                              {.fd = io->fd, .events = POLLIN}};
        int want_write, n, is_closing;

        pthread_mutex_lock(&c->mu);
        is_closing = c->closing;
        want_write = io->ctrl || io->cur || reports_ready(io) || acks_ready(io);
        pthread_mutex_unlock(&c->mu);
        if (is_closing && !io->bye_queued) {
            if (!io->welcomed)
                return;
            /* Finish the frame in progress, then Bye, then wait briefly
             * for the daemon's last acks and its close. */
            io->bye_queued = 1;
            io->deadline_ms = fsc_now_ms() + FSC_BYE_WAIT_MS;
        }
        if (io->bye_queued && !io->bye_sent)
            want_write = 1;
        if (io->ssl && io->tls_read_wants_write)
            want_write = 1;
        if (want_write)
            p[1].events |= POLLOUT;
        if (io->deadline_ms && fsc_now_ms() >= io->deadline_ms) {
            if (!io->welcomed)
                io_log(io, FSC_LOG_WARN, "no Welcome from %s:%u within %u ms; reconnecting",
                       c->host, (unsigned)c->port, c->handshake_timeout_ms);
            return;
        }
        n = poll(p, 2, io->deadline_ms ? remaining(io->deadline_ms) : -1);
        if (n < 0 && errno != EINTR) {
            io_log(io, FSC_LOG_ERROR, "poll failed: %s", strerror(errno));
            return;
        }
        if (n <= 0)
            continue;
        if (p[0].revents & POLLIN)
            drain_wake(c);
        if ((p[1].revents & (POLLIN | POLLHUP | POLLERR)) && do_read(io) < 0)
            return;
        if (io->tls_read_wants_write && (p[1].revents & POLLOUT) && do_read(io) < 0)
            return;
        if ((p[1].revents & POLLOUT) && do_write(io) < 0)
            return;
    }
}

/* Ends a connection: the buffer is resent from its head on the next one. */
static void end_session(struct fsc_io *io)
{
    struct fsc_client *c = io->c;

    if (io->ssl)
        fsc_tls_close(io->ssl);
    io->ssl = NULL;
    io->tls_read_wants_write = 0;
    close(io->fd);
    io->fd = -1;
    io->cur = NULL;
    io->ctrl = NULL;
    drop_ackbuf(io); /* its acks stay queued: written on the next connection */
    pthread_mutex_lock(&c->mu);
    fsc_replay_sent(&c->replay);
    c->connected = 0;
    pthread_mutex_unlock(&c->mu);
}

void *fsc_io_main(void *arg)
{
    struct fsc_client *c = arg;
    struct fsc_io *io = c->io;
    unsigned attempt = 0;
    char err[FSC_ERROR_LEN];

    for (;;) {
        int failed, rc;

        pthread_mutex_lock(&c->mu);
        failed = c->failed;
        pthread_mutex_unlock(&c->mu);
        if (failed) {
            if (wait_or_close(c, -1))
                break;
            continue;
        }
        if (wait_or_close(
                c, (int)fsc_backoff_delay(attempt, c->backoff_min_ms, c->backoff_max_ms, &io->rng)))
            break;
        attempt++;
        rc = connect_any(io, err, sizeof(err));
        if (rc == -ECANCELED)
            break;
        if (rc < 0) {
            pthread_mutex_lock(&c->mu);
            c->connect_failures++;
            memcpy(c->last_error, err, sizeof(err));
            pthread_mutex_unlock(&c->mu);
            /* The first failure of a streak is news; the rest is noise. */
            if (c->log)
                c->log(c->log_ctx, io->fail_streak++ ? FSC_LOG_DEBUG : FSC_LOG_WARN, err);
            continue;
        }
        session(io);
        end_session(io);
        /* A connection that got reports committed resets the backoff; one
         * that did not (refused at once, say) keeps growing it. */
        if (io->progress)
            attempt = 0;
    }
    return NULL;
}

/* ---- setup ----------------------------------------------------------------------- */

int fsc_io_create(struct fsc_client *c, uint64_t seed)
{
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    Foreshock__Bye bye = FORESHOCK__BYE__INIT;
    struct fsc_io *io = calloc(1, sizeof(*io));
    struct timespec ts;
    int rc;

    if (!io)
        return -ENOMEM;
    io->c = c;
    io->fd = -1;
    clock_gettime(CLOCK_REALTIME, &ts);
    io->rng = seed ? seed
                   : (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ (uint64_t)(uintptr_t)io ^
                         ((uint64_t)c->rank << 40);
    bye.reason = "client closing";
    f.body_case = FORESHOCK__FRAME__BODY_BYE;
    f.bye = &bye;
    if ((rc = fsc_wire_pack(&f, &io->bye, &io->bye_len)) < 0) {
        free(io);
        return rc;
    }
    c->io = io;
    return 0;
}

void fsc_io_destroy(struct fsc_client *c)
{
    if (!c->io)
        return;
    if (c->io->ssl)
        fsc_tls_close(c->io->ssl);
    if (c->io->fd >= 0)
        close(c->io->fd);
    free(c->io->bye);
    free(c->io->ackbuf);
    free(c->io);
    c->io = NULL;
}
