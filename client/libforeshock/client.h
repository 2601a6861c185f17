#ifndef FSC_CLIENT_H
#define FSC_CLIENT_H

/* The client object, shared by the public API (client.c, caller threads) and
 * the I/O thread (io.c).
 *
 * Ownership: fields in the first block are written by fsc_open only and
 * read by both sides afterwards. Fields under `mu` are read and written by
 * both, only with mu held. The I/O thread's own state (socket, read buffer,
 * write cursor) lives in struct fsc_io, which nothing else touches. */

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "advice.h"
#include "foreshock.h"
#include "internal.h"
#include "record.h"
#include "replay.h"
#include "tls.h"

/* After Bye: how long the I/O thread waits for the daemon's last acks and
 * its close before giving up. */
#define FSC_BYE_WAIT_MS 1000

struct fsc_io;

struct fsc_client {
    /* Immutable after fsc_open. */
    char *host;
    uint16_t port;
    char *run_id;
    uint32_t attempt, rank, world_size;
    size_t max_report_bytes;
    unsigned backoff_min_ms, backoff_max_ms;
    unsigned connect_timeout_ms, handshake_timeout_ms;
    fsc_log_fn log;
    void *log_ctx;
    uint8_t *hello; /* the Hello frame, length-prefixed */
    size_t hello_len;
    int wake_rd, wake_wr;    /* self-pipe: caller threads -> I/O thread */
    atomic_int wake_pending; /* a byte is in the pipe, or the I/O thread is about to look */
    int record_only;         /* no I/O thread: reports only go to rec */
    struct fsc_tls tls;      /* ctx NULL: plain TCP */
    int advice_on;           /* options.advice: the Hello declared CAPABILITY_ADVICE */
    pthread_t thread;
    struct fsc_io *io;

    /* Under mu. */
    pthread_mutex_t mu;
    pthread_cond_t drained; /* broadcast when the replay buffer empties or the client fails */
    struct fsc_replay replay;
    uint64_t submitted, acked, dropped, sent, resent, reconnects, connect_failures;
    uint64_t daemon_refused; /* of dropped: refused by the daemon (io.c, refuse_entry) */
    uint64_t acked_seq;      /* highest client seq the daemon acknowledged */
    uint64_t seq_offset;     /* wire seq = client seq + seq_offset */
    int offset_known;        /* set by the first Welcome */
    int connected, failed, closing;
    char last_error[FSC_ERROR_LEN];
    struct fsc_recorder rec;      /* record_path's writer (rec.f NULL: not recording) */
    struct fsc_advice_box advice; /* allocated only with advice_on */
};

/* I/O thread: allocates its private state (called by fsc_open before the
 * thread starts; seed 0 derives the jitter seed from time and address;
 * 0 or -ENOMEM), the thread body, and the release. */
FSC_HIDDEN int fsc_io_create(struct fsc_client *c, uint64_t seed);
FSC_HIDDEN void *fsc_io_main(void *client);
FSC_HIDDEN void fsc_io_destroy(struct fsc_client *c);

/* Wakes the I/O thread (new report, closing). Any thread; never blocks. */
FSC_HIDDEN void fsc_io_wake(struct fsc_client *c);

#endif
