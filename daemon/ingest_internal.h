#ifndef FORESHOCK_INGEST_INTERNAL_H
#define FORESHOCK_INGEST_INTERNAL_H

/* What the files of the ingest share (ingest.h is the API): the connection
 * and server structs and the functions one file calls in another. Not for
 * use outside daemon/ingest*.c. Everything here runs on the loop thread.
 *
 *   ingest.c         connection lifecycle: accept, deadlines, close, start/stop
 *   ingest_read.c    reading: frame buffers and their bound, the loop's frame
 *                    budget, framing, large frames decoded in the thread
 *                    pool, dispatch of each frame by type
 *   ingest_tls.c     TLS glue: ciphertext in, plaintext out, records flushed
 *   ingest_send.c    writing: frames and raw bytes out, Error then close
 *   ingest_admit.c   admission: Hello (token, normalisation) -> Welcome
 *   ingest_report.c  reports to the writer, parking under backpressure, Acks,
 *                    advice, and the writer's results (on_async)
 */

#include "ingest.h"

#include "admit.h"
#include "advice.h"
#include "fs_limits.h"
#include "log.h"

#define E(x) FORESHOCK__ERROR_CODE__ERROR_##x
#define CONN_HASH 1024u /* buckets of the conn_id -> conn table */

struct decode_job; /* a large frame decoding in the thread pool (ingest_read.c) */

enum conn_state { AWAIT_HELLO, AWAIT_WELCOME, STREAMING, CLOSING };

struct conn {
    uv_tcp_t tcp; /* first: handle->data is not needed to get back here */
    struct ingest *ing;
    uint64_t id;
    struct conn *prev, *next;   /* all connections, oldest first */
    struct conn *hnext;         /* hash chain; unlinked when closing starts */
    struct conn *dprev, *dnext; /* the deferred list, while deferred */
    int deferred;               /* a complete frame waits for the next loop iteration's budget */
    enum conn_state state;
    int rejected; /* refused at accept (admit.h): not counted as a connection */
    /* Not yet authenticated (TLS handshake, or before an accepted Hello):
     * on the ingest's unauthenticated list, counted for its address. */
    int unauth;
    struct conn *uprev, *unext;
    struct admit_addr addr;
    int reading; /* uv_read_start is active */
    int eof;     /* the client will send nothing more (EOF or Bye) */
    int closing; /* uv_close called */
    int close_after_write;
    uint64_t linger_deadline_ms; /* CLOSING: close by then whatever happens */
    int fin_sent;                /* uv_shutdown issued (conn_finish) */
    char peer[64];
    uint8_t *rbuf;
    size_t rlen, rcap;
    uint64_t fbuf;      /* length of the large frame rbuf was grown for (0: none) */
    struct conn *wnext; /* waiting for frame buffer room (ingest.wait_head) */
    int waiting;
    int tls_kick; /* granted frame buffer room: pull from TLS on the next on_async */
    size_t discarded;
    struct store_item *pending;           /* refused with -EAGAIN; resubmitted on RESUME */
    Foreshock__Frame *pending_frame;      /* the decoded report of `pending`, for the stage */
    char run_name[FS_MAX_RUN_ID_LEN + 1]; /* from the Hello, for the stage */
    struct run_hello hello;               /* from the Hello until the Welcome; moe_layers owned */
    char optimizer[FS_MAX_OPTIMIZER_LEN + 1]; /* hello.optimizer points here when sent */
    uint64_t inflight;                        /* items submitted, result not yet seen */
    int64_t run_id, stream_id;
    uint64_t stream_key; /* store_stream_key of the Hello's (run, attempt, rank) */
    uint32_t rank;
    uint64_t acked;
    /* Sequence numbers of this stream on this connection: seq_base is the
     * Welcome's last committed seq, seq_last the highest accepted since. */
    uint64_t seq_base, seq_last;
    size_t wpending;           /* bytes in uv_write requests not yet completed */
    struct tls_conn *tls;      /* NULL: plain TCP */
    uint8_t *tbuf;             /* TLS: ciphertext read buffer, FS_INGEST_TLS_READ_BYTES */
    uint64_t accepted_ms;      /* loop time the connection was accepted */
    uint64_t frame_started_ms; /* loop time an unfinished frame began (0: none) */
    struct advice_conn advice; /* capability and advices awaiting this stream's ack */
    struct decode_job *job;    /* its frame, decoding off the loop (ingest_read.c), or NULL */
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
    struct admit_limits admit;
    struct conn *unauth_head, *unauth_tail; /* unauthenticated connections, oldest first */
    uint64_t nunauth;
    struct admit_table addrs; /* unauthenticated connections per source address */
    struct conn *head, *tail;
    struct conn *hash[CONN_HASH];
    int paused;     /* the writer refused an item: nobody reads until RESUME */
    int stage_full; /* the monitor stage's reduction memory is full */
    int stopping;
    int handles_open;    /* of listener, async, sweep, prepare, idle */
    uint64_t fbuf_total; /* sum of conn.fbuf and decode_job.fbuf: at most frame_buffer_max_bytes */
    uint64_t njobs;      /* decode jobs not yet freed, orphans included: stop waits for 0 */
    struct conn *wait_head, *wait_tail; /* connections waiting for frame buffer room, FIFO */
    int handles_closing;                /* async, sweep, prepare and idle are being closed */
    void (*done)(void *ctx);
    void *done_ctx;
    uint8_t discard[16384]; /* read target for closing connections */
    struct log_ratelimit rl_proto, rl_backpressure, rl_slow, rl_limit, rl_io, rl_advice, rl_admit;
};

/* Functions one part calls in another; each definition's comment gives
 * its contract. All on the loop thread. */

/* --- connection lifecycle (ingest.c) */
struct conn *conn_find(struct ingest *ing, uint64_t id); /* NULL once closing started */
void conn_close(struct conn *c);              /* now; results in flight are ignored later */
void conn_finish(struct conn *c);             /* writes done: FIN and drain, or close */
void conn_close_when_flushed(struct conn *c); /* conn_finish once every write completed */
void conn_linger(struct conn *c);             /* stop serving (daemon stopping), then close */
void conn_authenticated(struct conn *c);    /* proved who it is, or closing: off the unauth list */
void ingest_check_stop(struct ingest *ing); /* stopping: close what is done, then handles */

/* --- reading and frame buffers (ingest_read.c) */
void conn_defer_remove(struct conn *c);   /* off the deferred list, if on it */
void ingest_on_prepare(uv_prepare_t *h);  /* a loop iteration's fresh frame budget */
void conn_rbuf_drop(struct conn *c);      /* buffered input dropped; its room given back */
int conn_rbuf_initial(struct conn *c);    /* the initial read buffer, if none; -ENOMEM */
void conn_peer_eof(struct conn *c);       /* the peer sends nothing more */
void conn_process(struct conn *c);        /* handle what the buffer holds */
void conn_update_reading(struct conn *c); /* start or stop reading as want_read says */
void conn_job_release(struct conn *c);    /* the connection closed: its decode job orphaned */

/* --- TLS glue (ingest_tls.c) */
int conn_tls_flush(struct conn *c); /* send pending records; <0: the connection closed */
int conn_tls_pull(struct conn *c);  /* decrypted bytes into rbuf: 1 some, 0 none, -1 ended */

/* --- writing and refusing (ingest_send.c); the send functions take buf */
int conn_send_raw(struct conn *c, uint8_t *buf, size_t len);
int conn_send_buf(struct conn *c, uint8_t *buf, size_t len);
int conn_send_frame(struct conn *c, const Foreshock__Frame *f);
void conn_refuse(struct conn *c, int code, const char *message, uint64_t seq);
void conn_protocol_error(struct conn *c, int code, const char *message);

/* --- admission: Hello -> Welcome (ingest_admit.c) */
void ingest_hello_release(struct run_hello *h);
void conn_on_hello(struct conn *c, const Foreshock__Hello *h);
void conn_on_hello_done(struct conn *c, const struct store_result *r);

/* --- reports, Acks, advice and the writer's results (ingest_report.c) */
int conn_submit(struct conn *c, struct store_item *it, Foreshock__Frame *f);
void conn_on_report(struct conn *c, Foreshock__Frame **fp, const uint8_t *body, size_t len,
                    const struct decode_info *info);
void conn_on_advice_ack(struct conn *c, const Foreshock__AdviceAck *a);
void conn_on_bye(struct conn *c, const Foreshock__Bye *b);
void ingest_on_async(uv_async_t *a);
void ingest_on_stage_pressure(void *ctx, int full);
void ingest_notify_loop(void *ctx);

#endif
