#ifndef FORESHOCK_INGEST_H
#define FORESHOCK_INGEST_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "decode.h"
#include "stage.h"
#include "stats.h"
#include "store.h"

/* The ingest TCP server (libuv). Everything here runs on the loop thread,
 * which owns the sockets and per-connection state; the writer thread talks
 * back only through store results and a uv_async wakeup.
 *
 * Per connection: AWAIT_HELLO -> AWAIT_WELCOME (Hello queued to the writer;
 * no further frame is read until the Welcome) -> STREAMING -> CLOSING.
 * Reports become writer items; Acks go out only after their COMMIT. A
 * protocol violation gets Error{code, message}, then a close once the write
 * completed; other connections are unaffected. When the writer pushes back
 * (-EAGAIN) the frame stays pending on its connection and every streaming
 * connection stops reading until the writer announces RESUME; connections
 * awaiting their Hello are still read (the store never refuses a Hello and
 * writes it first), so a new trainer is answered while ingest is
 * saturated. Each loop iteration handles report frames up to
 * FS_INGEST_LOOP_FRAME_BYTES (at least one); a connection whose complete
 * frame did not fit waits, reading stopped, for the next iteration, oldest
 * first. A frame larger than FS_INGEST_RBUF_INITIAL is decoded in libuv's
 * thread pool, its connection neither read nor handled meanwhile. */

struct ingest_opts {
    const char *host; /* bind address */
    uint16_t port;    /* 0: pick an ephemeral port */
    uint64_t max_connections;
    /* Connections not yet authenticated, in all and per source address
     * (admit.h); 0: FS_DEF_MAX_UNAUTHENTICATED(_PER_ADDRESS). */
    uint64_t max_unauthenticated;
    uint64_t max_unauthenticated_per_address;
    uint64_t max_conn_buffer_bytes; /* unsent reply bytes per connection */
    /* Frames larger than FS_INGEST_RBUF_INITIAL are read into a buffer of
     * their own; the sum of their lengths over all connections stays at
     * most this. A stream whose next frame would pass it stops reading and
     * waits in line (oldest first) until others have finished theirs.
     * 0: FS_DEF_FRAME_BUFFER_MAX_BYTES; raised to limits.max_frame_bytes
     * when below, so that any one frame can always be read. */
    uint64_t frame_buffer_max_bytes;
    struct decode_limits limits; /* limits.max_frame_bytes bounds the read buffer */
    const char *token;           /* NULL or "": no token required */
    struct store *store;         /* results of its items come back to this ingest */
    struct fs_stats *stats;
    /* The monitor stage, or NULL (no monitors). Each report is fed to it
     * right after store_submit accepted it; Welcomes register the stream.
     * While stage_full() holds, only streams stage_may_read() names are
     * read (those that can complete a run's oldest step). */
    struct stage *stage;
    /* Deadlines (seconds; 0: none): for a Hello after the connection is
     * accepted, and for the rest of a frame whose first bytes arrived
     * (counted only while the daemon reads from the connection). An idle
     * stream between frames has none: training steps can be long. */
    double hello_timeout_s;
    double frame_timeout_s;
    /* TLS (tls.h), or NULL: plain TCP. Owned by the caller, read-only. The
     * handshake counts against hello_timeout_s. */
    struct tls_server *tls;
    /* Per-run tokens ([run "PATTERN"] sections), or NULL: `token` for all. */
    const struct run_auth *run_auth;
};

struct ingest;

/* Binds and listens on loop, and takes over the store's notify callback.
 * Returns 0 and *out, or a negative errno-style code with a message in err;
 * nothing is left running on failure. Loop thread (before uv_run). */
int ingest_start(uv_loop_t *loop, const struct ingest_opts *opts, struct ingest **out,
                 struct fs_err *err);

/* The port actually bound. */
uint16_t ingest_port(const struct ingest *ing);

/* Begins the orderly shutdown: closes the listener, stops reading, lets
 * frames already received commit and sends their Acks (and Welcomes), then
 * closes every connection, detaches from the store and closes its own
 * handles; done(ctx) is called on the loop thread when nothing of the
 * ingest is left on the loop. A second call is a no-op. Loop thread. */
void ingest_stop(struct ingest *ing, void (*done)(void *ctx), void *ctx);

/* Frees the ingest after done was called (or after ingest_start failed to
 * return one: NULL is a no-op). Loop thread, loop no longer running it. */
void ingest_free(struct ingest *ing);

#endif
