#ifndef FORESHOCK_CLIENT_H
#define FORESHOCK_CLIENT_H

/* libforeshock: the trainer-side client of foreshockd.
 *
 * A client streams per-step reports (scalars and weight sketches) of one
 * (run, attempt, rank) stream to the daemon over TCP. fsc_submit() never
 * blocks on the network: it serializes the report into a bounded in-memory
 * replay buffer and returns. A background I/O thread per client connects
 * (with exponential backoff and jitter), sends Hello, resumes from the
 * daemon's Welcome, streams reports in order and frees them once the daemon
 * acknowledges that they are durably committed. If the daemon restarts, the
 * client reconnects and resends whatever was not committed; the daemon
 * ignores duplicates, so nothing is lost or counted twice.
 *
 * ABI: all types are opaque except the option and statistics structs, which
 * start with a `size` field (set it to sizeof) so they can grow. No protobuf
 * type appears here.
 *
 * Return values: 0 on success or a negative errno value (-EINVAL, -ENOMEM,
 * -ENOBUFS, ...). Nothing here sets errno for the caller or prints.
 *
 * Threads: fsc_submit, fsc_flush, fsc_stats and fsc_poll_advice may be called
 * concurrently from any threads on the same client. fsc_close must be called exactly once,
 * after every other call on that client has returned. A report (fsc_report)
 * belongs to one thread until it is submitted or freed. The Gram helpers are
 * pure functions and may run on any thread. */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FSC_VERSION "0.1.0"

/* Defaults (used when the corresponding option is 0 / NULL). */
#define FSC_DEFAULT_HOST "127.0.0.1"
#define FSC_DEFAULT_PORT 7781
#define FSC_DEFAULT_REPLAY_MAX_BYTES ((size_t)64 << 20)
#define FSC_DEFAULT_MAX_REPORT_BYTES ((size_t)16 << 20)
#define FSC_DEFAULT_BACKOFF_MIN_MS 100u
#define FSC_DEFAULT_BACKOFF_MAX_MS 5000u
#define FSC_DEFAULT_CONNECT_TIMEOUT_MS 5000u
#define FSC_DEFAULT_HANDSHAKE_TIMEOUT_MS 10000u

/* Limits, checked before anything is allocated. The protocol limits mirror
 * the daemon's (daemon/fs_limits.h, FS_MAX_*): a report the daemon would refuse
 * is refused here, at the setter, instead of being dropped later. */
#define FSC_MAX_RUN_ID_LEN 128 /* Hello.run_id: 1..128 of [A-Za-z0-9._:-] */
#define FSC_MAX_TOKEN_LEN 256
#define FSC_MAX_HOST_LEN 255
#define FSC_MAX_CLIENT_NAME_LEN 256
#define FSC_MAX_OPTIMIZER_LEN 64 /* ModelShape.optimizer: 1..64 bytes of printable ASCII */
#define FSC_MAX_WORLD_SIZE (1u << 20)
#define FSC_MAX_MOE_LAYERS 4096
#define FSC_MAX_LOCAL_RANKS 4096 /* Hello.local_ranks values */
#define FSC_MIN_REPLAY_BYTES ((size_t)64 << 10)
#define FSC_MAX_REPLAY_BYTES ((size_t)1 << 36)       /* 64 GiB */
#define FSC_MAX_REPORT_BYTES_LIMIT ((size_t)1 << 30) /* largest max_report_bytes */
#define FSC_MAX_BACKOFF_MS 600000u                   /* 10 minutes */
#define FSC_MAX_TIMEOUT_MS 600000u
#define FSC_MAX_DH 512            /* GramSketch.dh */
#define FSC_MAX_EXPERTS 1024      /* router n_experts */
#define FSC_MAX_LAYERS 4096       /* layer index bound, per-layer value count */
#define FSC_MAX_HEADS 1024        /* head / kv_head index bound */
#define FSC_MAX_WINDOW (1u << 20) /* window in steps, >= 1 */
#define FSC_MAX_SHARDS 65536      /* shard_count */
#define FSC_MAX_ATTENTION_PER_REPORT 65536
#define FSC_MAX_ROUTER_PER_REPORT 4096 /* each of router grams, router tokens */
#define FSC_MAX_GRAM_ROWS 8192         /* rows of X in fsc_gram_upper */
#define FSC_MAX_GRAM_COLS ((size_t)1 << 24)
#define FSC_ERROR_LEN 256 /* size of error text buffers */

/* kv_head value meaning "not sent" (plain multi-head attention). */
#define FSC_KV_HEAD_NONE UINT32_MAX

typedef struct fsc_client fsc_client;
typedef struct fsc_report fsc_report;

enum fsc_log_level { FSC_LOG_DEBUG = 0, FSC_LOG_INFO = 1, FSC_LOG_WARN = 2, FSC_LOG_ERROR = 3 };

/* Connection events and errors, called on the client's I/O thread. Must not
 * call back into the same client except fsc_stats. `message` is only valid
 * during the call. */
typedef void (*fsc_log_fn)(void *ctx, int level, const char *message);

/* Optional model shape sent in Hello. All-zero (and no options.optimizer):
 * not sent. The optimizer's name travels in the same ModelShape but is set
 * with options.optimizer: a field added here would move every option after
 * `model` and break callers built against an older header. */
struct fsc_model_shape {
    uint32_t n_layers, n_heads, n_kv_heads, d_model, d_head, n_experts, top_k;
    const uint32_t *moe_layers; /* n_moe_layers values, copied by fsc_open */
    size_t n_moe_layers;
};

struct fsc_options {
    size_t size;               /* sizeof(struct fsc_options) */
    const char *host;          /* daemon address or name; NULL: FSC_DEFAULT_HOST */
    uint16_t port;             /* 0: FSC_DEFAULT_PORT */
    const char *run_id;        /* required */
    uint32_t attempt;          /* trainer restart counter; a restarted trainer should bump it */
    uint32_t rank;             /* < world_size */
    uint32_t world_size;       /* 1..FSC_MAX_WORLD_SIZE */
    const char *token;         /* shared secret, or NULL */
    uint64_t detect_from_step; /* sent in Hello when non-zero */
    size_t replay_max_bytes;   /* bound on buffered, unacknowledged reports; 0: default */
    size_t max_report_bytes;   /* largest single serialized report; 0: default */
    unsigned backoff_min_ms, backoff_max_ms; /* reconnect delays; 0: defaults */
    unsigned connect_timeout_ms;             /* per TCP connect; 0: default */
    unsigned handshake_timeout_ms;           /* Hello -> Welcome; 0: default */
    struct fsc_model_shape model;
    const char *client_name; /* NULL: "libforeshock/" FSC_VERSION */
    fsc_log_fn log;          /* optional */
    void *log_ctx;
    uint64_t seed; /* backoff jitter seed; 0: derived from time and address */
    /* Fields below were added in 0.2; a caller built against 0.1 passes a
     * smaller size and gets them as zero. */
    const char *record_path; /* also write every submitted report to this file (see
                                "Recordings" below); NULL: no recording */
    int record_only;         /* with record_path: no daemon at all, nothing is sent */
    /* Added after record_only (older callers get them as zero). A daemon
     * per node hears only its node's ranks: name them
     * (this rank included, each below world_size; copied by fsc_open) and
     * it reduces router token statistics over exactly these ranks and
     * detects loss/grad_norm/lr from the lowest of them. NULL / 0: the
     * daemon hears the whole job. At most FSC_MAX_LOCAL_RANKS values. */
    const uint32_t *local_ranks;
    size_t n_local_ranks;
    /* TLS to a daemon whose ingest has tls_cert (added with local_ranks;
     * older callers get plain TCP). The daemon's certificate is always
     * verified, against tls_ca_file (PEM) or the system's CA store, for the
     * name tls_server_name (NULL: host; an IP address is checked as one).
     * tls_cert_file + tls_key_file (PEM): this rank's client certificate,
     * for a daemon with tls_client_ca. Files are read by fsc_open (a bad one
     * is -EINVAL, named in err). A handshake that fails (untrusted daemon,
     * refused certificate) is logged and retried with backoff like any
     * failed connection. */
    int tls;
    const char *tls_ca_file;
    const char *tls_cert_file;
    const char *tls_key_file;
    const char *tls_server_name;
    /* Added after tls_server_name (older callers get them as zero). */
    int advice; /* non-zero: take Advice from the daemon (see "Advice" below) */
    int resume; /* non-zero: this attempt restarts from a checkpoint taken at
                   resume_step (bump `attempt` too); the daemon evaluates the
                   steps after it as this attempt's, from the run's state at
                   resume_step (docs/alerting.md "Rewind") */
    uint64_t resume_step;
    /* Added after resume_step (older callers get it as NULL). The training
     * optimizer's class name as the trainer knows it ("SGD", "AdamW",
     * "Lion", ...), sent in Hello's ModelShape (alone if no other shape field
     * is set): 1..FSC_MAX_OPTIMIZER_LEN bytes of printable ASCII (0x20..0x7e),
     * else fsc_open returns -EINVAL. Copied by fsc_open. NULL: unknown, not
     * sent. */
    const char *optimizer;
};

/* The smallest options struct fsc_open accepts (the 0.1 layout). */
#define FSC_OPTIONS_MIN_SIZE offsetof(struct fsc_options, record_path)

struct fsc_stats {
    size_t size;         /* caller sets sizeof(struct fsc_stats) before the call */
    uint64_t submitted;  /* reports accepted by fsc_submit (= last assigned seq) */
    uint64_t acked;      /* reports the daemon acknowledged as committed */
    uint64_t dropped;    /* refused by fsc_submit, or by the daemon (daemon_refused) */
    uint64_t sent;       /* report frames written to a socket, resends included */
    uint64_t resent;     /* of which resends after a reconnect */
    uint64_t reconnects; /* successful handshakes after the first */
    uint64_t connect_failures;
    uint64_t buffered_reports; /* submitted, not yet acknowledged nor dropped */
    uint64_t buffered_bytes;
    uint64_t seq_offset;            /* wire seq = client seq + seq_offset (see fsc_open) */
    int connected;                  /* 1 while a connection has completed its handshake */
    int failed;                     /* 1 after a fatal error: the client stopped trying */
    char last_error[FSC_ERROR_LEN]; /* most recent error text, "" if none */
    uint64_t recorded;              /* reports written to record_path */
    int record_failed;              /* 1 after a write to record_path failed: recording stopped */
    /* Added after the fields above: a caller built against an older header passes a
     * smaller size and does not get it. */
    uint64_t daemon_refused; /* of `dropped`: reports the daemon will never take (over
                                its limits, undecodable, above its max_frame_bytes).
                                Not resent; each is logged once with the daemon's
                                reason, and its seq goes as an empty report (step and
                                time only), so later reports still flow. */
    /* Added after daemon_refused. */
    uint64_t advice_received; /* Advice frames received, resends included */
    uint64_t advice_pending;  /* received, not yet taken with fsc_poll_advice */
    uint64_t advice_taken;    /* taken with fsc_poll_advice (and acknowledged) */
    uint64_t advice_dropped;  /* not kept: FSC_MAX_PENDING_ADVICE were pending (the daemon
                                 sends them again after the next reconnect) */
};

/* Library version string, e.g. "0.1.0". Static storage, any thread. */
const char *fsc_version(void);

/* Fills *o with the defaults (size set, run_id NULL, world_size 1). Caller
 * owns *o; any thread. */
void fsc_options_init(struct fsc_options *o);

/* Validates *o, copies everything it needs (strings included: the caller's
 * memory may go away after the call) and starts the client's I/O thread,
 * which connects in the background. Does not wait for a connection.
 *
 * Returns 0 and *out, or -EINVAL (bad option: the reason is written to err
 * when err is not NULL), -E2BIG (o->size larger than this library knows,
 * with non-zero bytes beyond), -ENOMEM, or another -errno from thread/pipe
 * creation. Nothing is started on failure.
 *
 * Sequence numbers: reports are numbered 1, 2, ... in submission order. If on
 * the client's first handshake the daemon already holds committed reports of
 * this (run, attempt, rank) stream (a previous process that did not bump
 * `attempt`), the numbering continues after them (seq_offset in fsc_stats)
 * instead of being ignored as duplicates. Any thread. */
int fsc_open(const struct fsc_options *o, fsc_client **out, char *err, size_t errlen);

/* Takes ownership of r in every case (r is freed, even on error) and queues
 * it for sending with the next seq. Never blocks on the network; takes a
 * mutex shared with the I/O thread for a short time.
 * Returns 0; -ENOBUFS when the replay buffer would exceed replay_max_bytes;
 * -EMSGSIZE when the serialized report exceeds max_report_bytes; -ERANGE
 * when its step is not below 2^63 (the daemon stores signed 64-bit steps and
 * refuses such a report, even as an empty placeholder); -EPIPE when
 * the client has failed fatally (see fsc_stats.failed); -ENOMEM; -EINVAL
 * (NULL argument). On any error the report is dropped and counted in
 * `dropped`, and no seq is consumed, so seqs stay dense. Any thread. */
int fsc_submit(fsc_client *c, fsc_report *r);

/* Like fsc_submit, for a Report message already serialized with protobuf
 * (len bytes at report; a frame of a recording, say). Its seq field is
 * ignored: the client numbers it like any other. The message is decoded
 * (and so validated) before it is queued; len above max_report_bytes is
 * refused before decoding. Returns what fsc_submit returns (-ERANGE also
 * for a time_unix that is not finite), or -EBADMSG for bytes that are not a
 * Report. Any thread. */
int fsc_submit_packed(fsc_client *c, const void *report, size_t len);

/* Waits until every report submitted so far has been acknowledged (or
 * dropped). timeout_ms < 0 waits without bound. Returns 0, -ETIMEDOUT, or
 * -EPIPE when the client failed fatally with reports still unacknowledged.
 * Any thread; blocks only the caller. */
int fsc_flush(fsc_client *c, int timeout_ms);

/* Copies the client's counters into *s (up to s->size bytes; s->size 0 is
 * taken as sizeof(struct fsc_stats)). Any thread. */
void fsc_stats(fsc_client *c, struct fsc_stats *s);

/* Waits up to timeout_ms (< 0: without bound) for outstanding reports to be
 * acknowledged, then sends Bye if connected (and waits at most a second for
 * the daemon's last acks), stops the I/O thread and frees the client.
 * Reports still unacknowledged are discarded. Returns what fsc_flush
 * returned, else the -errno of closing the recording (record_path). c may
 * be NULL (returns 0). A host name lookup in progress is not interrupted:
 * with a name instead of an address, closing can take as long as the
 * resolver's timeout. Call once, from the thread that owns the
 * client's lifetime. */
int fsc_close_timeout(fsc_client *c, int timeout_ms);

/* fsc_close_timeout(c, 0): does not wait for acknowledgements. */
void fsc_close(fsc_client *c);

/* ---- Advice -----------------------------------------------------------------
 * With options.advice set, the client tells the daemon (Hello capability)
 * that it takes Advice: when an alert of the run fires (or an advised one
 * resolves), the daemon sends an advice on every stream of the run. The I/O
 * thread keeps what arrives (at most FSC_MAX_PENDING_ADVICE, oldest first,
 * an advice_id once even when the daemon sends it again); the trainer takes
 * them with fsc_poll_advice on its own thread, never by a callback from the
 * I/O thread, so it may act on its training state right there. Taking an
 * advice acknowledges it to the daemon (alert history: acked_at); one the
 * trainer never took is sent again after a reconnect and to the next
 * attempt. */
#define FSC_MAX_PENDING_ADVICE 1024
#define FSC_ADVICE_RULE_LEN 64
#define FSC_ADVICE_LABEL_LEN 32
#define FSC_ADVICE_SEVERITY_LEN 16

enum fsc_advice_action {
    FSC_ADVICE_CHECKPOINT = 1,          /* save a checkpoint now, go on training */
    FSC_ADVICE_CHECKPOINT_AND_STOP = 2, /* save a checkpoint, then stop cleanly */
    FSC_ADVICE_RESOLVED = 3,            /* the alert of an earlier advice resolved */
    FSC_ADVICE_SUPERSEDED = 4,          /* ... or was superseded by a rewind */
};

struct fsc_advice {
    size_t size; /* caller sets sizeof(struct fsc_advice) before the call */
    uint64_t advice_id;
    int action;                             /* enum fsc_advice_action */
    uint64_t alert_id;                      /* /api/v1/alerts/{alert_id} */
    char rule[FSC_ADVICE_RULE_LEN];         /* detector rule, e.g. "qk.d2.erank" */
    char label[FSC_ADVICE_LABEL_LEN];       /* attribution, e.g. "attention-numerics" */
    char severity[FSC_ADVICE_SEVERITY_LEN]; /* "warning" | "critical" */
    /* Steps; -1 when the daemon did not say. rollback_step: the last step
     * before the span of the first breaching sample (a checkpoint at or
     * before it predates the evidence). */
    int64_t step, first_breach_step, fired_step, rollback_step;
    int32_t layer, head, window, rank; /* the alert's scope; -1 (window 0): none */
};

/* Takes the oldest pending advice into *out (up to out->size bytes; 0 is
 * taken as sizeof(struct fsc_advice)) and queues its acknowledgement.
 * Returns 1 when one was taken, 0 when none is pending, -EINVAL. Never
 * blocks on the network. Any thread. */
int fsc_poll_advice(fsc_client *c, struct fsc_advice *out);

/* "checkpoint", "checkpoint_and_stop", "resolved", "superseded", or
 * "unknown". Static storage, any thread. */
const char *fsc_advice_action_name(int action);

/* ---- Reports ---------------------------------------------------------------
 * A report is one training step of one rank. Build it, then fsc_submit it.
 * Setters return 0 or -EINVAL (value refused: the report is unchanged);
 * adders also return -ENOMEM, or -E2BIG when a per-report count limit is
 * reached. All arrays are copied. The owner thread only. */

/* A new empty report for `step`, or NULL when out of memory. */
fsc_report *fsc_report_new(uint64_t step);

/* Frees r and everything it copied. NULL is a no-op. */
void fsc_report_free(fsc_report *r);

/* loss and grad_norm may be NaN or infinite (that is what the non-finite
 * detector looks for). */
int fsc_report_set_loss(fsc_report *r, double loss);
int fsc_report_set_grad_norm(fsc_report *r, double grad_norm);
/* These must be finite. */
int fsc_report_set_lr(fsc_report *r, double lr);
int fsc_report_set_loss_scale(fsc_report *r, double loss_scale);
int fsc_report_set_step_time(fsc_report *r, double seconds);
int fsc_report_set_time(fsc_report *r, double unix_seconds); /* default: daemon's clock */
int fsc_report_set_tokens(fsc_report *r, uint64_t tokens);
/* Per-layer ||W|| and update-to-weight ratio, index = layer; n <= FSC_MAX_LAYERS,
 * values >= 0 or non-finite. Replaces an earlier call (n = 0 clears). */
int fsc_report_set_layer_weight_norms(fsc_report *r, const float *v, size_t n);
int fsc_report_set_layer_update_ratios(fsc_report *r, const float *v, size_t n);
/* This step's update-to-weight ratio over the monitored weights that moved,
 * |W(t) - W(t-1)| / |W(t-1)|: >= 0 or non-finite (-EINVAL when negative). */
int fsc_report_set_step_update_ratio(fsc_report *r, double ratio);

/* Partial Gram sketch of one attention head (docs/monitors.md 1.1): ga_upper and
 * gb_upper are the upper triangles (row-major, row i holds columns i..n-1)
 * of GA = A A^T and GB = B B^T, n = 2*dh, fsc_tri_len(n) floats each, as
 * fsc_attention_grams() produces them. (shard_index, shard_count) names the
 * slice of the model dimension these partial Grams cover (0, 1: all of it).
 * kv_head: FSC_KV_HEAD_NONE when not grouped-query. window >= 1, in steps.
 * Values may be non-finite (non-finite weights must alert). */
int fsc_report_add_attention_gram(fsc_report *r, uint32_t layer, uint32_t head, uint32_t kv_head,
                                  uint32_t window, uint32_t dh, uint32_t shard_index,
                                  uint32_t shard_count, const float *ga_upper,
                                  const float *gb_upper);

/* Spectra a trainer computed itself (docs/monitors.md 1.2, last paragraph). Each
 * array holds sigma^2 values (>= 0 or non-finite), any order. d2 (2*dh
 * values) and d3 (dh values) are required, dh in 1..FSC_MAX_DH; d1 (2*dh)
 * and w (dh) may be NULL/0. The doubles (>= 0 or non-finite; cqk <= 1) are
 * sent only when their FSC_SPECTRUM_HAS_* bit is set. */
#define FSC_SPECTRUM_HAS_Q_DELTA_SQ 1u
#define FSC_SPECTRUM_HAS_Q_SQ 2u
#define FSC_SPECTRUM_HAS_K_SQ 4u
#define FSC_SPECTRUM_HAS_K_DELTA_SQ 8u
#define FSC_SPECTRUM_HAS_CQK 16u
struct fsc_spectrum {
    const float *d2;
    size_t n_d2;
    const float *d3;
    size_t n_d3;
    const float *d1;
    size_t n_d1;
    const float *w;
    size_t n_w;
    double q_delta_sq, q_sq, k_sq, k_delta_sq, cqk;
    unsigned has; /* FSC_SPECTRUM_HAS_* bits */
};
int fsc_report_add_attention_spectrum(fsc_report *r, uint32_t layer, uint32_t head,
                                      uint32_t kv_head, uint32_t window,
                                      const struct fsc_spectrum *s);

/* Router weight Gram GR = WR WR^T of one MoE layer (docs/monitors.md 3.1): upper
 * triangle, fsc_tri_len(n_experts) floats, additive over d-shards. */
int fsc_report_add_router_gram(fsc_report *r, uint32_t layer, uint32_t n_experts,
                               uint32_t shard_index, uint32_t shard_count, const float *gram_upper);

/* Router token statistics of one layer (docs/monitors.md 3.2), summed over this
 * rank's micro-batches: load and sum_p hold n_experts values each. The sums
 * must be finite, sum_h2, sum_lse2 and sum_p >= 0. */
int fsc_report_add_router_tokens(fsc_report *r, uint32_t layer, uint32_t n_experts, uint64_t n_tok,
                                 double sum_h, double sum_h2, double sum_lse2, const uint64_t *load,
                                 const double *sum_p);

/* ---- Gram helpers (OpenBLAS) --------------------------------------------------
 * Pure functions: read the inputs, write the caller's output, allocate only
 * scratch that they free. Float32 in and out. Any thread. */

/* n(n+1)/2: the number of floats in the upper triangle of an n x n matrix. */
size_t fsc_tri_len(size_t n);

/* X is rows x cols, row-major. Writes the upper triangle of X X^T (rows x
 * rows) to tri_out, row-major packed: fsc_tri_len(rows) floats.
 * rows in 1..FSC_MAX_GRAM_ROWS, cols in 1..FSC_MAX_GRAM_COLS.
 * Returns 0, -EINVAL or -ENOMEM. */
int fsc_gram_upper(const float *x, size_t rows, size_t cols, float *tri_out);

/* One attention head's sketch (docs/monitors.md 1.1). wq, wk are the head's
 * query and key rows at step t, wq0, wk0 the same at the window base t0; all
 * dh x d row-major in the PyTorch [out, in] layout (d may be this rank's
 * shard of the model dimension). Builds
 *     A = [Wq - Wq0 ; Wq0]   B = [Wk0 ; Wk - Wk0]   (2dh x d each)
 * and writes the upper triangles of GA = A A^T and GB = B B^T to ga and gb,
 * fsc_tri_len(2*dh) floats each. dh in 1..FSC_MAX_DH.
 * Returns 0, -EINVAL or -ENOMEM. */
int fsc_attention_grams(const float *wq, const float *wk, const float *wq0, const float *wk0,
                        size_t dh, size_t d, float *ga, float *gb);

/* Router Gram GR = WR WR^T (docs/monitors.md 3.1): wr is n_experts x d row-major;
 * writes fsc_tri_len(n_experts) floats. n_experts in 1..FSC_MAX_EXPERTS. */
int fsc_router_gram(const float *wr, size_t n_experts, size_t d, float *gram_out);

/* ---- Recordings --------------------------------------------------------------
 * With options.record_path set, the client writes what it submits to that
 * file whether or not a daemon is reachable (with record_only, there is no
 * daemon at all). `foreshock replay FILE` streams a recording into a daemon.
 *
 * Format: the 8 bytes FSC_RECORD_MAGIC, then frames exactly as on the wire
 * (a 4-byte big-endian length, then one serialized foreshock.Frame): first
 * the Hello (without its token: a recording may travel with a bug report),
 * then one Report frame per submitted report, seq 1, 2, ... in submission
 * order. Reports that the replay buffer refused are recorded too: the file is
 * what the trainer produced, not what reached a daemon. A recording cut short
 * (a crash, a full disk) ends with a partial frame; readers stop there. */
#define FSC_RECORD_MAGIC "FSREC01\n"
#define FSC_RECORD_MAGIC_LEN 8

#ifdef __cplusplus
}
#endif

#endif
