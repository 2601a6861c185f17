#ifndef FORESHOCK_LIMITS_H
#define FORESHOCK_LIMITS_H

/* Every input the daemon accepts has a named bound, checked at the edge and
 * before any allocation sized by it. Two kinds live here:
 *  - FS_MAX_*: hard protocol limits (decode.c), not configurable; a frame
 *    beyond them is ERROR_MALFORMED or ERROR_LIMIT.
 *  - FS_DEF_* / FS_MIN_* / FS_CAP_*: the default and the accepted range of a
 *    configuration key (config.c). */

/* --- wire protocol, per frame ---------------------------------------------- */
#define FS_MAX_RUN_ID_LEN 128u       /* Hello.run_id bytes, [A-Za-z0-9._:-] */
#define FS_MAX_TOKEN_LEN 256u        /* Hello.token bytes */
#define FS_MAX_CLIENT_NAME_LEN 256u  /* Hello.client_name bytes */
#define FS_MAX_OPTIMIZER_LEN 64u     /* ModelShape.optimizer bytes, printable ASCII */
#define FS_MAX_WORLD_SIZE (1u << 20) /* Hello.world_size */
#define FS_MAX_LAYERS 4096u          /* layer index < this */
#define FS_MAX_HEADS 1024u           /* head / kv_head index < this */
#define FS_MAX_DH 512u               /* GramSketch.dh; Gram side n = 2*dh */
#define FS_MAX_EXPERTS 1024u         /* RouterGram / RouterTokens n_experts */
#define FS_MAX_WINDOW (1u << 20)     /* AttentionSketch.window, steps */
#define FS_MAX_SHARDS 65536u         /* shard_count */
#define FS_MAX_ATTENTION_PER_REPORT 65536u
#define FS_MAX_ROUTER_PER_REPORT 4096u /* router_gram and router_tokens, each */
#define FS_MAX_SPECTRUM_LEN (2u * FS_MAX_DH)
#define FS_MAX_MOE_LAYERS FS_MAX_LAYERS
#define FS_MAX_LOCAL_RANKS 4096u    /* Hello.local_ranks values (a node's group) */
#define FS_MAX_ERROR_MESSAGE 256u   /* Error.message we send, bytes with NUL */
#define FS_MAX_ADVICE_ACK_IDS 1024u /* AdviceAck.advice_id per frame */
/* Hello.attempt may start a run's attempt at most this far above its latest
 * (a restart counter goes up by one; attempts.h says why it is bounded). */
#define FS_MAX_ATTEMPT_JUMP 1024u

/* Unpacking may allocate at most this much per frame: protobuf-c allocates
 * sub-message structs far larger than their wire size (an 8-byte empty
 * AttentionSketch becomes ~64 bytes plus a pointer), so the bound is on the
 * allocator, not only on the frame length. */
#define FS_DECODE_ALLOC_FACTOR 4u
#define FS_DECODE_ALLOC_SLACK (64u * 1024u)
/* ... plus, for each sketch the limits allow (max_attention_per_report and
 * twice max_router_per_report, at most one per FS_DECODE_MIN_SKETCH_WIRE
 * bytes of frame), the structs protobuf-c makes for it: an AttentionSketch
 * with its SpectrumSketch or GramSketch and the pointer to it take under
 * 512 bytes. A report of 4,000 tiny spectrum sketches (155 KB, 39 bytes a
 * sketch) needs about 7x its size, above the flat factor: it was refused
 * though every count was within the documented limits. */
#define FS_DECODE_SKETCH_STRUCT_BYTES 512u
#define FS_DECODE_MIN_SKETCH_WIRE 8u

/* --- configuration keys: default, minimum, maximum ------------------------- */
#define FS_DEF_LISTEN "127.0.0.1:7781"
#define FS_DEF_HTTP "127.0.0.1:7782"
#define FS_DEF_DB "./foreshock.db"

#define FS_DEF_HTTP_THREADS 4u
#define FS_MIN_HTTP_THREADS 1u
#define FS_CAP_HTTP_THREADS 64u /* http.h HTTP_MAX_THREADS */

/* metrics_max_runs: per-run gauges of /metrics (metrics.h METRICS_MAX_RUNS) */
#define FS_DEF_METRICS_MAX_RUNS 8u
#define FS_CAP_METRICS_MAX_RUNS 64u

#define FS_DEF_MAX_CONNECTIONS 1024u
#define FS_MIN_MAX_CONNECTIONS 1u
#define FS_CAP_MAX_CONNECTIONS 65536u
/* Ingest connections not yet authenticated (TLS handshake, or before an
 * accepted Hello), all addresses together and from one address (admit.h).
 * In effect at most max_connections (and the per-address one at most
 * max_unauthenticated). A trainer's connection is unauthenticated for one
 * round trip or a handshake, so these are about bursts of connects: a
 * burst beyond them waits out the client's backoff. */
#define FS_DEF_MAX_UNAUTHENTICATED 256u
#define FS_DEF_MAX_UNAUTHENTICATED_PER_ADDRESS 128u

#define FS_DEF_MAX_FRAME_BYTES (64u << 20)
#define FS_MIN_MAX_FRAME_BYTES (4u << 10)
#define FS_CAP_MAX_FRAME_BYTES (1u << 30) /* Welcome.max_frame_bytes is a u32 */

#define FS_DEF_MAX_RUNS 10000u
#define FS_MIN_MAX_RUNS 1u
#define FS_CAP_MAX_RUNS 1000000u

/* Frames larger than the initial read buffer (FS_INGEST_RBUF_INITIAL) get a
 * buffer of their own while they are read; the total of their lengths over
 * all connections is bounded (a connection whose frame would pass it waits,
 * not reading, until others finish theirs). At least max_frame_bytes, so a
 * lone connection can always read a frame of the largest size. */
#define FS_DEF_FRAME_BUFFER_MAX_BYTES (256ull << 20)
#define FS_MIN_FRAME_BUFFER_MAX_BYTES FS_MIN_MAX_FRAME_BYTES
#define FS_CAP_FRAME_BUFFER_MAX_BYTES (64ull << 30)

/* Outgoing bytes queued on one connection (Welcome, Acks, Error) that the
 * client has not read yet; past it the client is closed. */
#define FS_DEF_MAX_CONN_BUFFER_BYTES (1u << 20)
#define FS_MIN_MAX_CONN_BUFFER_BYTES (4u << 10)
#define FS_CAP_MAX_CONN_BUFFER_BYTES (1u << 30)

#define FS_DEF_WRITER_QUEUE_MAX_ITEMS 16384u
#define FS_MIN_WRITER_QUEUE_MAX_ITEMS 2u
#define FS_CAP_WRITER_QUEUE_MAX_ITEMS (1u << 24)

#define FS_DEF_WRITER_QUEUE_MAX_BYTES (256ull << 20)
#define FS_MIN_WRITER_QUEUE_MAX_BYTES (64ull << 10)
#define FS_CAP_WRITER_QUEUE_MAX_BYTES (64ull << 30)

#define FS_DEF_WRITER_BATCH_MAX_ITEMS 1024u
#define FS_MIN_WRITER_BATCH_MAX_ITEMS 1u
#define FS_CAP_WRITER_BATCH_MAX_ITEMS (1u << 20)

#define FS_DEF_SPOOL_MAX_BYTES (1ull << 30)
#define FS_MIN_SPOOL_MAX_BYTES (1ull << 20)
#define FS_CAP_SPOOL_MAX_BYTES (1ull << 40)

/* Monitor stage: a reduction (shards / ranks of one group) not complete
 * this long after its first piece is recorded as incomplete. */
#define FS_DEF_REDUCE_TIMEOUT_S 120.0
#define FS_MIN_REDUCE_TIMEOUT_S 0.01
#define FS_CAP_REDUCE_TIMEOUT_S 86400.0
/* Ingest deadlines (ingest_opts): a Hello after accept, the rest of a begun
 * frame. 0 disables; a 64 MiB frame at 1 MB/s takes about 64 s. */
#define FS_DEF_HELLO_TIMEOUT_S 10.0
#define FS_DEF_FRAME_TIMEOUT_S 120.0
#define FS_CAP_INGEST_TIMEOUT_S 86400.0

/* Reduction memory (partial Gram sums, token sums); past it ingest pauses. */
#define FS_DEF_REDUCE_MAX_BYTES (1ull << 30)
#define FS_MIN_REDUCE_MAX_BYTES (1ull << 20)
#define FS_CAP_REDUCE_MAX_BYTES (1ull << 40)

/* Monitor worker threads (the libuv threadpool); 0 = one per online CPU. */
#define FS_CAP_MONITOR_THREADS 1024u /* libuv's own cap */

#define FS_CAP_DETECT_FROM_STEP ((double)(1ull << 53)) /* exact in the range check */

/* Per-head monitor points are most of a large run's database
 * (docs/configuration.md "Storage budget"): they may be kept at every N-th step only. */
#define FS_CAP_HEAD_POINTS_EVERY 1000000u

/* --- configuration file ---------------------------------------------------- */
#define FS_CONFIG_MAX_FILE_BYTES (1u << 20)
#define FS_CONFIG_MAX_LINE 4096u
#define FS_CONFIG_MAX_HOST 256u         /* bytes with NUL */
#define FS_CONFIG_MAX_PATH 4096u        /* bytes with NUL */
#define FS_TLS_MAX_PEM_BYTES (1u << 20) /* a certificate chain or key file, read whole */

/* --- writer ---------------------------------------------------------------- */
/* Bytes of REPORT items one transaction takes (at least one item): a
 * commit, and so a Hello's wait behind it (store.c), stays short however
 * large the frames. */
#define FS_STORE_BATCH_MAX_BYTES (64u << 20)
#define FS_STORE_INTERLUDE_HELLOS 64u /* Hellos one interlude (store.c) commits, at most */
#define FS_STORE_BUSY_TIMEOUT_MS 5000
#define FS_STORE_RETRY_MIN_MS 100
#define FS_STORE_RETRY_MAX_MS 5000
#define FS_STORE_SERIES_CACHE_MAX (1u << 20) /* cached series ids; cleared when full */
#define FS_STORE_MODEL_JSON_MAX (64u << 10)  /* Hello.model as JSON */
#define FS_STORE_PRUNE_INTERVAL_S 60.0       /* retention runs this often */
#define FS_STORE_PRUNE_BATCH 512u            /* rows of each kind per retention transaction */
#define FS_MIN_MAX_RUN_BYTES (1ull << 20)    /* max_run_bytes: per-run monitor memory budget */
#define FS_CAP_MAX_RUN_BYTES (1ull << 36)
#define FS_STORE_RUN_DELETE_BATCH 16u    /* runs deleted per lifecycle transaction (store_runs.c) */
#define FS_STORE_RUN_CHECK_MIN_S 0.05    /* the lifecycle pass runs at most this often */
#define FS_STORE_MAX_LIVE_SILENCES 1024u /* active or future silences; more are refused */

/* --- sketch spool (spool.h) ------------------------------------------------- */
#define FS_SPOOL_SEGMENT_BYTES (64ull << 20)             /* a new segment starts past this */
#define FS_SPOOL_MAX_RECORD_BYTES FS_CAP_MAX_FRAME_BYTES /* one frame body */
/* Bytes of a record written per pwritev (spool_set_yield's hook runs
 * between): on a slow or busy disk 59 MB take seconds to write, and the
 * writer answers queued Hellos between these pieces. */
#define FS_SPOOL_WRITE_CHUNK_BYTES (4u << 20)

/* --- ingest ---------------------------------------------------------------- */
#define FS_INGEST_RBUF_INITIAL (64u << 10) /* read buffer; grows to one frame, shrinks back */
/* Largest frame a connection may announce before its Hello is accepted: a
 * Hello with every field at its limit (4096 MoE layers, run id, token,
 * client name) is under 16 KiB. Unauthenticated peers so never grow a read
 * buffer past FS_INGEST_RBUF_INITIAL. */
#define FS_MAX_HELLO_FRAME_BYTES (32u << 10)
_Static_assert(FS_MAX_HELLO_FRAME_BYTES + 4 <= FS_INGEST_RBUF_INITIAL, "pre-Hello frames fit");
#define FS_INGEST_BACKLOG 511
#define FS_INGEST_TLS_READ_BYTES (16u << 10) /* ciphertext per read; one TLS record */
#define FS_INGEST_LINGER_MS 5000             /* a closing connection's writes/discard, at most */
#define FS_INGEST_DISCARD_MAX (1u << 20)     /* bytes read and dropped after an Error */
#define FS_INGEST_SWEEP_MS 1000              /* how often lingering connections are checked */
/* Report frame bytes one loop iteration handles (at least one frame): the
 * loop gets back to accepts, Hellos and Welcomes between large frames. */
#define FS_INGEST_LOOP_FRAME_BYTES (8u << 20)

/* --- logging --------------------------------------------------------------- */
#define FS_LOG_LINE_MAX 2048u         /* longer messages are truncated */
#define FS_LOG_RATE_INTERVAL_MS 10000 /* one line per kind per interval */

#endif
