/* Ingest, reading: the per-connection read buffer and the daemon-wide bound
 * on large frame buffers, the frame budget of a loop iteration, framing and
 * dispatch of each complete frame by type, and when a connection is read. */
#include "ingest_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tls.h"

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

void conn_defer_remove(struct conn *c)
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

static void on_idle(uv_idle_t *h)
{
    (void)h;
}

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

void ingest_on_prepare(uv_prepare_t *h)
{
    struct ingest *ing = h->data;
    ing->budget = FS_INGEST_LOOP_FRAME_BYTES;
    /* Served in order; one that runs out of budget again goes to the back. */
    struct conn *last = ing->def_tail;
    while (ing->def_head && ing->budget > 0) {
        struct conn *c = ing->def_head;
        conn_defer_remove(c);
        if (!c->closing) {
            conn_process(c);
            conn_update_reading(c);
        }
        if (c == last)
            break;
    }
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
        conn_protocol_error(c, E(INTERNAL), "out of memory for a frame buffer");
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
    while ((c = ing->wait_head)) {
        uint32_t len = large_frame(c);
        if (len && ing->fbuf_total - c->fbuf + len > ing->opts.frame_buffer_max_bytes)
            return;
        wait_remove(c);
        if (len && rbuf_grow(c, len) < 0)
            continue;
        conn_update_reading(c);
        if (c->tls) {
            /* Its frame may already sit decrypted or encrypted inside
             * OpenSSL, with no socket read to come: pull it on the next
             * loop turn (ingest_on_async), not from inside another connection's
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
    conn_update_reading(c);
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
    if (c->fbuf && c->rcap <= FS_INGEST_RBUF_INITIAL && !c->pending && !c->job) {
        fbuf_set(c, 0);
        grant_waiting(c->ing);
    }
}

/* The buffered input is dropped (an error, a stop, a close): nothing of it
 * was acked; the client resends it. */
void conn_rbuf_drop(struct conn *c)
{
    c->rlen = 0;
    wait_remove(c);
    if (c->rcap > FS_INGEST_RBUF_INITIAL) {
        free(c->rbuf); /* on_alloc makes a new initial one if needed */
        c->rbuf = NULL;
        c->rcap = 0;
    }
    if (c->fbuf && !c->job) { /* a decode job still holds its frame's room */
        fbuf_set(c, 0);
        grant_waiting(c->ing);
    }
}

/* May this connection take another frame from its buffer now? */
static int can_process(const struct conn *c)
{
    return !c->closing && !c->pending && !c->eof && !c->job &&
           (c->state == AWAIT_HELLO || c->state == STREAMING);
}

/* Hands a frame to its handler by type, or refuses it when it did not
 * decode (rc < 0: err). body, len: the frame as it arrived, in c's read
 * buffer. Takes f. */
static void dispatch_frame(struct conn *c, int rc, Foreshock__Frame *f, const uint8_t *body,
                           size_t len, const struct decode_info *info, const struct fs_err *err)
{
    struct ingest *ing = c->ing;
    if (rc < 0) {
        atomic_fetch_add(&ing->opts.stats->decode_errors, 1);
        /* A report refused for what it holds is named, so that the client
         * drops it instead of resending it forever. */
        uint64_t seq = 0;
        if (c->state == STREAMING && decode_peek_report_seq(body, len, &seq) < 0)
            seq = 0;
        conn_refuse(c, err->code, err->msg, seq);
        return;
    }
    switch (f->body_case) {
    case FORESHOCK__FRAME__BODY_HELLO:
        conn_on_hello(c, f->hello);
        break;
    case FORESHOCK__FRAME__BODY_REPORT:
        conn_on_report(c, &f, body, len, info);
        break;
    case FORESHOCK__FRAME__BODY_BYE:
        conn_on_bye(c, f->bye);
        break;
    case FORESHOCK__FRAME__BODY_ADVICE_ACK:
        conn_on_advice_ack(c, f->advice_ack);
        break;
    default:
        conn_protocol_error(c, E(SEQUENCE), "Welcome, Ack and Error are daemon-to-client frames");
        break;
    }
    decode_frame_free(f);
}

static void handle_frame(struct conn *c, const uint8_t *body, size_t len)
{
    struct ingest *ing = c->ing;
    atomic_fetch_add(&ing->opts.stats->frames_in, 1);
    Foreshock__Frame *f;
    struct decode_info info;
    struct fs_err err;
    int rc = decode_frame(body, len, &ing->opts.limits, &f, &info, &err);
    dispatch_frame(c, rc, f, body, len, &info, &err);
}

/* --- decoding off the loop -------------------------------------------------------
 * Unpacking and validating a 59 MB report took the loop thread 0.05-0.45 s
 * on a busy 2-core host, and the stage's reduction of it as long again: a
 * Hello read or a Welcome sent behind one such frame waited over a second.
 * A frame that needed a buffer of its own (larger than
 * FS_INGEST_RBUF_INITIAL) is decoded in libuv's thread pool instead
 * (decode.c is pure): the buffer leaves the connection for the job, the
 * connection reads and handles nothing meanwhile (its frames stay in
 * order), and the loop serves the others. Decoded, the frame goes back to
 * its connection and is handled on the loop like any other, within the
 * loop iteration's frame budget (deferred when that is spent), or dropped
 * when the connection stopped being served meanwhile (never acked: the
 * client resends it). Until then the job holds its frame's room in the
 * frame buffer bound; a job whose connection closed (an orphan) gives it
 * back when it completes, and the ingest stops only once no job is left. */

struct decode_job {
    uv_work_t work;
    struct ingest *ing;
    struct conn *c; /* NULL once its connection closed */
    uint8_t *buf;   /* the frame with its prefix: what was the connection's read buffer */
    size_t len;     /* body bytes */
    uint64_t fbuf;  /* room in the frame buffer bound it holds as an orphan */
    int done;       /* decoded; for the loop to handle or drop */
    int rc;         /* decode_frame's result, with frame, info and err */
    Foreshock__Frame *frame;
    struct decode_info info;
    struct fs_err err;
};

/* Thread pool: decode_frame is pure and reads only the job and the limits,
 * which do not change after ingest_start. */
static void decode_work(uv_work_t *w)
{
    struct decode_job *j = (struct decode_job *)w;
    j->rc = decode_frame(j->buf + DECODE_PREFIX_BYTES, j->len, &j->ing->opts.limits, &j->frame,
                         &j->info, &j->err);
}

static void job_free(struct decode_job *j)
{
    struct ingest *ing = j->ing;
    decode_frame_free(j->frame);
    free(j->buf);
    ing->njobs--;
    if (j->fbuf) {
        ing->fbuf_total -= j->fbuf;
        atomic_store(&ing->opts.stats->frame_buffer_bytes, ing->fbuf_total);
        grant_waiting(ing);
    }
    free(j);
}

static void decode_done(uv_work_t *w, int status)
{
    (void)status; /* jobs are never cancelled */
    struct decode_job *j = (struct decode_job *)w;
    struct ingest *ing = j->ing;
    j->done = 1;
    struct conn *c = j->c;
    if (!c) {
        job_free(j);
        ingest_check_stop(ing);
        return;
    }
    conn_process(c);
    conn_update_reading(c);
}

/* Starts decoding the frame that fills c's buffer (len body bytes) in the
 * thread pool. 0, or a negative errno: the caller decodes it here. */
static int decode_start(struct conn *c, uint32_t len)
{
    struct ingest *ing = c->ing;
    struct decode_job *j = calloc(1, sizeof(*j));
    if (!j)
        return -ENOMEM;
    j->ing = ing;
    j->c = c;
    j->buf = c->rbuf;
    j->len = len;
    int rc = uv_queue_work(ing->loop, &j->work, decode_work, decode_done);
    if (rc < 0) {
        free(j);
        return rc;
    }
    atomic_fetch_add(&ing->opts.stats->frames_in, 1);
    ing->njobs++;
    c->job = j;
    c->rbuf = NULL;
    c->rcap = c->rlen = 0;
    c->frame_started_ms = 0;
    return 0;
}

/* c's decoded frame: back into its buffer and to its handler, within the
 * loop iteration's budget; dropped if c is no longer served. Returns 1 when
 * the job is gone, 0 when it waits for the next iteration. */
static int job_finish(struct conn *c)
{
    struct ingest *ing = c->ing;
    struct decode_job *j = c->job;
    if (c->closing || c->state != STREAMING || ing->stopping) {
        c->job = NULL;
        job_free(j);
        conn_rbuf_drop(c); /* gives the frame's room back */
        return 1;
    }
    if (ing->budget == 0) {
        defer_add(c);
        return 0;
    }
    size_t need = DECODE_PREFIX_BYTES + j->len;
    ing->budget -= need < ing->budget ? need : ing->budget;
    c->job = NULL;
    c->rbuf = j->buf;
    c->rcap = c->rlen = need;
    Foreshock__Frame *f = j->frame;
    j->buf = NULL;
    j->frame = NULL;
    dispatch_frame(c, j->rc, f, c->rbuf + DECODE_PREFIX_BYTES, j->len, &j->info, &j->err);
    job_free(j);
    if (c->state != CLOSING && c->rbuf) /* not handed over with its buffer: consumed */
        c->rlen = 0;
    return 1;
}

void conn_job_release(struct conn *c)
{
    struct decode_job *j = c->job;
    if (!j)
        return;
    c->job = NULL;
    if (j->done) {
        job_free(j); /* the connection's own release gives the room back */
        return;
    }
    j->c = NULL;
    j->fbuf = c->fbuf; /* the room goes with the job: c->fbuf no longer counts it */
    c->fbuf = 0;
}

/* Handles every complete frame in the read buffer that the state allows.
 * Returns whether it took any frame or made room for one. */
static int process_frames(struct conn *c)
{
    struct ingest *ing = c->ing;
    size_t pos = 0;
    int took = 0;
    if (c->job) {
        if (!c->job->done || !job_finish(c))
            return 0;
        if (c->state == CLOSING)
            return 1;
        took = 1;
    }
    while (can_process(c) && !ing->stopping && c->rlen - pos >= DECODE_PREFIX_BYTES) {
        uint32_t len;
        struct fs_err err;
        if (decode_prefix(c->rbuf + pos, &ing->opts.limits, &len, &err) < 0) {
            atomic_fetch_add(&ing->opts.stats->decode_errors, 1);
            conn_protocol_error(c, err.code, err.msg);
            return 1;
        }
        /* Before the Hello is accepted a peer is unauthenticated: it may not
         * make the daemon hold a large frame for it. */
        if (c->state == AWAIT_HELLO && len > FS_MAX_HELLO_FRAME_BYTES) {
            atomic_fetch_add(&ing->opts.stats->decode_errors, 1);
            char msg[128];
            snprintf(msg, sizeof(msg), "frame of %u bytes before Hello (at most %u)", len,
                     FS_MAX_HELLO_FRAME_BYTES);
            conn_protocol_error(c, E(TOO_LARGE), msg);
            return 1;
        }
        size_t need = DECODE_PREFIX_BYTES + (size_t)len;
        if (c->rlen - pos < need)
            break;
        if (c->state == STREAMING && ing->budget == 0) {
            defer_add(c); /* the next loop iteration, before new reads */
            break;
        }
        /* A frame that has a buffer of its own fills it: decoded off the loop. */
        if (c->state == STREAMING && need > FS_INGEST_RBUF_INITIAL && pos == 0 && c->rlen == need &&
            decode_start(c, len) == 0) {
            took = 1;
            break;
        }
        handle_frame(c, c->rbuf + pos + DECODE_PREFIX_BYTES, len);
        took = 1;
        if (c->state == STREAMING)
            ing->budget -= need < ing->budget ? need : ing->budget;
        if (c->state == CLOSING)
            return 1;   /* conn_protocol_error reset the buffer */
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
int conn_rbuf_initial(struct conn *c)
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
void conn_peer_eof(struct conn *c)
{
    c->eof = 1;
    conn_update_reading(c);
    if (c->state == CLOSING || (c->inflight == 0 && !c->pending))
        conn_close_when_flushed(c);
}

/* Handles what the connection's buffer (and, with TLS, its decrypted
 * input) holds, as far as its state allows. */
void conn_process(struct conn *c)
{
    /* A frame decoding off the loop keeps the connection's place: nothing is
     * pulled into a buffer or handled before it. */
    if (c->job && (!c->job->done || (process_frames(c), c->job)))
        return;
    if (!c->tls) {
        (void)process_frames(c);
        return;
    }
    for (;;) {
        int pulled = conn_tls_pull(c);
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
    if (c->job)
        return 0; /* read on once its frame is handled */
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
    if (c->tls) { /* ciphertext; conn_tls_pull fills the plaintext buffer */
        *buf = uv_buf_init((char *)c->tbuf, FS_INGEST_TLS_READ_BYTES);
        return;
    }
    if (conn_rbuf_initial(c) < 0) {
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
        conn_peer_eof(c);
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
    conn_process(c);
    conn_update_reading(c);
}

void conn_update_reading(struct conn *c)
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
