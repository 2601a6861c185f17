#ifndef FORESHOCK_STATS_H
#define FORESHOCK_STATS_H

#include <stdatomic.h>
#include <stdint.h>

/* Process-wide counters and gauges. One instance is created by main() and
 * handed by pointer to every module; any thread may update or read it.
 * Relaxed atomics: these are observability numbers, not synchronisation. */

/* Paging targets (pager thread writes the counters; main() names the
 * targets before any thread starts, so name/kind are then read-only). */
#define STATS_MAX_TARGETS 16
#define STATS_TARGET_NAME_MAX 64

struct fs_target_stats {
    char name[STATS_TARGET_NAME_MAX]; /* "" = slot unused */
    char kind[16];                    /* "alertmanager" | "pagerduty" | "webhook" */
    atomic_uint_fast64_t sent;        /* deliveries the target accepted */
    atomic_uint_fast64_t failed;      /* attempts that failed and will be retried */
    atomic_uint_fast64_t dropped;     /* deliveries given up (permanent error) */
    atomic_uint_fast64_t silenced;    /* deliveries not made: a silence matched */
};

/* Commit latency histogram buckets, seconds (upper bounds, +Inf implied). */
/* A [remote_write "NAME"] target's sender (remote_write.c). */
#define STATS_MAX_RW_TARGETS 4 /* = RW_MAX_TARGETS */
struct fs_rw_stats {
    char name[32];                       /* the section's name, set before the thread starts */
    atomic_uint_fast64_t samples_sent;   /* samples a receiver acknowledged (2xx) */
    atomic_uint_fast64_t samples_failed; /* samples a receiver refused for good (4xx) */
    atomic_uint_fast64_t retries;        /* requests retried (network, 5xx, 429) */
    atomic_uint_fast64_t pending;        /* gauge: steps and alert events not yet sent */
    atomic_uint_fast64_t last_success;   /* gauge: unix seconds of the last 2xx, 0: none */
};

#define STATS_COMMIT_BUCKETS 10
extern const double stats_commit_bucket_le[STATS_COMMIT_BUCKETS];

struct fs_stats {
    /* ingest (loop thread writes) */
    atomic_uint_fast64_t connections_current;
    atomic_uint_fast64_t connections_total;
    atomic_uint_fast64_t connections_rejected; /* refused at accept, any admission limit */
    atomic_uint_fast64_t refused_full;         /* max_connections, every slot authenticated */
    atomic_uint_fast64_t refused_address;      /* max_unauthenticated_per_address */
    atomic_uint_fast64_t refused_unauth;       /* max_unauthenticated, its address the heaviest */
    atomic_uint_fast64_t evicted;              /* unauthenticated, closed to admit another */
    atomic_uint_fast64_t unauthenticated;      /* gauge: connections not yet authenticated */
    atomic_uint_fast64_t frames_in;
    atomic_uint_fast64_t bytes_in;
    atomic_uint_fast64_t decode_errors;
    atomic_uint_fast64_t protocol_errors; /* Error frames sent, any code */
    atomic_uint_fast64_t tls_failures;    /* ingest TLS handshakes that failed */
    atomic_uint_fast64_t reports_in;
    atomic_uint_fast64_t acks_out;
    atomic_uint_fast64_t backpressure_pauses; /* times ingest stopped reading */
    atomic_uint_fast64_t frame_buffer_bytes;  /* gauge: lengths of large frames being read */
    atomic_uint_fast64_t frame_buffer_waits;  /* a connection waited for frame_buffer_max_bytes */
    atomic_uint_fast64_t advice_out;          /* Advice frames sent (resends included) */
    atomic_uint_fast64_t advice_acked;        /* advices acknowledged by a stream */

    /* writer thread writes */
    atomic_uint_fast64_t reports_committed;
    atomic_uint_fast64_t reports_duplicate; /* resent, already committed */
    atomic_uint_fast64_t points_committed;
    atomic_uint_fast64_t commits;
    atomic_uint_fast64_t commit_errors;
    atomic_uint_fast64_t writer_queue_items; /* gauge */
    atomic_uint_fast64_t writer_queue_bytes; /* gauge */
    atomic_uint_fast64_t spool_bytes;        /* gauge: bytes in the spool log's segments */
    /* The spool as the start's replay found it (stage_load): acknowledged
     * frames lost, records damaged, bytes passed over. */
    atomic_uint_fast64_t spool_lost_missing;
    atomic_uint_fast64_t spool_lost_damaged;
    atomic_uint_fast64_t spool_damaged_records;
    atomic_uint_fast64_t spool_skipped_bytes;
    atomic_uint_fast64_t commit_seconds_bucket[STATS_COMMIT_BUCKETS + 1];
    atomic_uint_fast64_t commit_seconds_sum_us;

    /* monitor stage (loop thread writes) */
    atomic_uint_fast64_t buckets_evaluated;      /* (run, step) buckets whose monitors ran */
    atomic_uint_fast64_t heads_computed;         /* attention heads through the QK math */
    atomic_uint_fast64_t monitor_seconds_sum_us; /* worker CPU time in the monitor math */
    atomic_uint_fast64_t incomplete_total;       /* reductions recorded as incomplete */
    atomic_uint_fast64_t alerts_fired;           /* transitions to firing */
    atomic_uint_fast64_t sketches_late;          /* sketches for a step already evaluated */
    atomic_uint_fast64_t reports_superseded;     /* reports of an attempt a rewind abandoned */
    atomic_uint_fast64_t rewinds;                /* rewinds whose state was rebuilt */
    atomic_uint_fast64_t sketches_duplicate;     /* shard index / rank already summed */
    atomic_uint_fast64_t reports_resent;         /* seq already fed: not fed again */
    atomic_uint_fast64_t reduce_bytes;           /* gauge: reduction memory held */
    atomic_uint_fast64_t reduce_pauses; /* times reduce_max_bytes or spool_max_bytes held */

    /* pager thread writes */
    atomic_uint_fast64_t outbox_pending;         /* gauge: deliveries not yet done */
    atomic_uint_fast64_t silence_compiles_pager; /* silences parsed for matching */
    unsigned ntargets;                           /* set before threads start */
    struct fs_target_stats targets[STATS_MAX_TARGETS];

    /* remote-write sender threads write, each its own slot (remote_write.h) */
    unsigned n_rw; /* set before the senders start */
    struct fs_rw_stats rw[STATS_MAX_RW_TARGETS];

    /* http threads write */
    atomic_uint_fast64_t http_requests;
    atomic_uint_fast64_t http_errors;           /* responses with status >= 400 */
    atomic_uint_fast64_t silence_compiles_http; /* silences parsed for silenced_by */

    /* lifecycle: 1 once storage is open and both listeners are bound,
     * 0 again when shutdown starts or the writer cannot commit. */
    atomic_int ready;
    /* 0, or while commits fail (disk full, I/O) the SQLite primary result
     * code they fail with (store_failure_text names it). */
    atomic_int storage_failing;
    /* 0, or the enum spool_fault that stopped commits (the spool log was
     * deleted or replaced under the daemon); stays until a restart. */
    atomic_int spool_fault;
};

#endif
