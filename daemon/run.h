#ifndef FORESHOCK_RUN_H
#define FORESHOCK_RUN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "foreshock.pb-c.h"
#include "fs_index.h"
#include "fs_limits.h"
#include "monitor_qk.h"
#include "monitor_router.h"

/* The run registry: per run, the shard and rank reduction of the sketches
 * of each step (docs/monitors.md 1.1, 3.1, 3.2). A pure data structure: no
 * libuv, no SQLite, no clocks (`now` is an input, seconds on any monotonic
 * clock), no threads. In the daemon the loop thread owns the registry and
 * everything in it; a bucket taken out with run_take_ready belongs to the
 * caller (the monitor stage) until run_bucket_free.
 *
 * Groups, keyed within a (run, step) bucket:
 *  - attention (layer, head, window): Gram shards summed into double
 *    triangles; complete when shard_count distinct shard indices arrived.
 *    A SpectrumSketch is complete at once (its qk_head is computed on
 *    arrival: O(dh), no LAPACK).
 *  - router_gram (layer): GR shards summed likewise.
 *  - router_tokens (layer): n_tok, sums, load[], sum_p[] summed over
 *    ranks; complete when every rank that announced the layer in its Hello
 *    (ModelShape.moe_layers) has reported it, plus one per rank of the
 *    world not heard from yet (it may announce the layer too), or
 *    world_size ranks when no rank announced anything (run_tokens_want).
 *    When ranks declare a local group (Hello.local_ranks: a daemon per
 *    node hears only its node's ranks), "the world" is the union of the
 *    declared groups and the ranks heard, not world_size.
 * A group is never computed from part of its data: one still incomplete
 * reduce_timeout_s after its first piece is dropped and becomes a
 * struct run_incomplete record of its bucket.
 *
 * Buckets of a run are taken in step order: run_take_ready only ever
 * returns the run's earliest bucket, once every group in it is complete or
 * timed out and, when the run declared n_layers and n_heads, every
 * (layer, head) of each window seen is present (missing ones time out with
 * the bucket). Data for a step at or below the last taken step is late and
 * ignored (counted). */

#define RUN_TIMEOUT_MIN_S 0.001
#define RUN_MAX_STREAMS_PER_RUN 65536u /* resend-dedup entries per run */
#define RUN_MAX_BUCKETS_PER_RUN 65536u /* steps in reduction at once, per run */
#define RUN_MAX_MISSING_RECORDS 4096u  /* incomplete rows for absent groups per bucket */
#define RUN_MAX_LOCAL_GROUPS 64u       /* distinct local groups held per run (then replaced) */
#define RUN_MAX_LOCAL_RANKS 65536u     /* ranks over a run's local groups (256 KB) */

enum run_group_kind {
    RUN_GROUP_ATTENTION = 0,
    RUN_GROUP_ROUTER_GRAM = 1,
    RUN_GROUP_ROUTER_TOKENS = 2,
};

/* What the worker computed for a group (written off the loop thread while
 * the bucket is out; read on the loop thread after the join). */
struct run_result {
    int rc; /* of the compute call */
    bool done;
    struct qk_head qk;
    struct router_weight rw;
    struct router_decision rd;
};

struct run_group {
    enum run_group_kind kind;
    uint32_t layer, head, window; /* head, window 0 for router groups */
    uint32_t kv_head;             /* attention: the key head (= head when not sent) */
    bool spectrum;                /* attention from a SpectrumSketch */
    uint32_t size;                /* dh (attention) or n_experts (router) */
    uint32_t have;                /* distinct shards / ranks summed */
    uint32_t want;                /* shard_count; tokens: fixed when taken */
    uint32_t seen_bits;           /* bitmap size in bits */
    uint8_t *seen;                /* shard indices (gram) or ranks (tokens) seen */
    double first_seen;
    double *a, *b;  /* attention: GA, GB; router gram: a = GR (triangles) */
    uint64_t n_tok; /* router tokens */
    double sum_h, sum_h2, sum_lse2;
    uint64_t *load;
    double *sum_p;
    size_t bytes; /* accounted to the registry */
    struct run_result res;
};

struct run_incomplete {
    enum run_group_kind kind;
    uint32_t layer;
    int32_t head;    /* -1 for router groups */
    uint32_t window; /* 0 for router groups */
    uint32_t have, want;
};

struct run_window_count {
    uint32_t window;
    uint32_t count; /* attention groups of this window */
};

struct run_registry;

struct run_bucket {
    struct run_registry *reg;
    int64_t run_id;
    uint64_t step;
    double first_seen;         /* `now` of its first piece */
    double time;               /* latest report time (unix seconds) */
    struct run_group **groups; /* complete groups once taken, in arrival order */
    size_t n, cap;
    struct fs_index index; /* over groups, by mix64 of the group key */
    struct run_window_count *windows;
    size_t n_windows;
    struct run_incomplete *incomplete; /* filled by run_take_ready */
    size_t n_incomplete;
    size_t bytes;
    struct run_bucket *next; /* the run's list, step order */
};

struct run_announce { /* one per rank heard from (a Hello), announcing or not */
    uint32_t rank;
    uint32_t n;
    uint32_t *layers; /* sorted, distinct MoE layers; NULL when n == 0 */
    int32_t decl;     /* its local group: index in run->decls, -1 for none */
};

/* A distinct local group some ranks declared (or the one restored from the
 * database at start, held by no rank: refs 0, restored). */
struct run_local_decl {
    uint32_t *ranks; /* sorted, distinct */
    uint32_t n;
    uint32_t refs; /* ranks whose latest Hello declared it */
    bool restored;
    uint64_t used; /* run->decl_clock when last declared (replacement order) */
};

struct run_stream {
    int64_t stream_id;
    uint64_t fed_seq; /* highest seq fed (or committed before a restart) */
    bool has_step;
    uint64_t fed_step; /* step of the last report fed */
};

struct run {
    int64_t run_id;
    char name[FS_MAX_RUN_ID_LEN + 1];
    uint32_t world_size;
    uint32_t n_layers, n_heads; /* 0: not declared */
    /* The trainer's optimizer steps by the rate times the gradient
     * (Hello's ModelShape.optimizer: eval_optimizer_follows_grad). */
    bool update_follows_grad;
    /* Its orthogonalized update was said once in the log (stage_hello:
     * eval_optimizer_orthogonalizes). */
    bool orthogonal_said;
    bool has_detect_from_step;
    uint64_t detect_from_step;
    int64_t done_step;          /* last step taken (-1: none); later data at or below it is late */
    struct run_bucket *buckets; /* pending, ascending step */
    size_t n_buckets;
    struct run_announce *ann; /* per rank heard from */
    size_t n_ann;
    uint32_t *moe_want; /* per layer: announcing ranks */
    size_t n_moe_want;
    struct run_local_decl *decls; /* distinct declared local groups, <= RUN_MAX_LOCAL_GROUPS;
                                     a slot with ranks NULL is free */
    size_t n_decls;
    size_t n_decl_ranks; /* ranks over decls, <= RUN_MAX_LOCAL_RANKS */
    uint64_t decl_clock;
    uint32_t *local; /* union of decls, sorted; NULL: none declared (the whole world) */
    size_t n_local;
    uint32_t lead_rank; /* rank whose loss, grad_norm, lr are detected: local[0], else 0 */
    /* Kept by run_hello, of ranks below world_size: in local, heard (a
     * Hello), heard and in local, heard and announcing MoE layers. */
    uint32_t local_world, heard, heard_local, announcing;
    struct run_stream *streams;
    size_t n_streams, cap_streams;
    void *user; /* the stage's per-run state */
};

struct run_limits {
    double timeout_s;   /* reduce_timeout_s */
    uint64_t max_bytes; /* reduce_max_bytes: run_registry_full past it */
};

/* What one run_add did, for counters and logs. */
struct run_add_stats {
    uint32_t groups_new;
    uint32_t pieces;     /* shards / rank contributions summed */
    uint32_t duplicates; /* shard index or rank already summed: ignored */
    uint32_t mismatched; /* dh / n_experts / shard_count differs from the group's: ignored */
    uint32_t late;       /* step already taken: ignored */
    uint32_t limit;      /* a per-run bound was reached: ignored */
    uint32_t nonfinite_spectra;
};

struct run_hello {
    uint32_t rank;
    uint32_t world_size;
    bool has_n_layers, has_n_heads;
    uint32_t n_layers, n_heads;
    const uint32_t *moe_layers; /* announced MoE layers; NULL/0: none */
    size_t n_moe_layers;
    bool has_detect_from_step;
    uint64_t detect_from_step;
    const char *optimizer;       /* ModelShape.optimizer (validated); NULL: not sent */
    const uint32_t *local_ranks; /* Hello.local_ranks (validated); NULL/0: none */
    size_t n_local_ranks;
};

/* Creates an empty registry. 0, -EINVAL (timeout below RUN_TIMEOUT_MIN_S)
 * or -ENOMEM. Owner thread (the loop thread). */
int run_registry_create(const struct run_limits *lim, struct run_registry **out);

/* Frees the registry, its runs and their pending buckets (not buckets
 * taken out). NULL is a no-op. */
void run_registry_destroy(struct run_registry *reg);

/* Bytes of reduction data held (pending and taken-but-not-freed buckets). */
uint64_t run_registry_bytes(const struct run_registry *reg);

/* True while run_registry_bytes >= max_bytes: the caller stops reading. */
bool run_registry_full(const struct run_registry *reg);

/* The run, or NULL. */
struct run *run_find(struct run_registry *reg, int64_t run_id);

/* Finds or creates the run (name is copied on creation, may be NULL then
 * set later with run_set_name). 0 and *out, -ENOMEM. */
int run_open(struct run_registry *reg, int64_t run_id, const char *name, struct run **out);
void run_set_name(struct run *run, const char *name);

/* Removes the run from the registry and frees it with its pending buckets
 * (run->user must be freed by its owner first). Invalidates run_at
 * indices. */
void run_remove(struct run_registry *reg, struct run *run);

/* Number of runs and the i-th, for iteration (order unspecified). */
size_t run_count(const struct run_registry *reg);
struct run *run_at(struct run_registry *reg, size_t i);

/* Applies a Hello: world size, declared shape (latest wins), the rank's
 * announced MoE layers and local group (each replacing what that rank said
 * before) and detect_from_step. Returns 1 when the union of local groups
 * changed, 0 when not, -ENOMEM, or -ENOSPC when the group alone has more
 * than RUN_MAX_LOCAL_RANKS ranks (nothing applied). A new group when the
 * run holds RUN_MAX_LOCAL_GROUPS (or RUN_MAX_LOCAL_RANKS ranks over them)
 * replaces the group fewest ranks declare, the longest undeclared first:
 * stale groups never lock a run's real ones out. */
int run_hello(struct run *run, const struct run_hello *h);

/* At start, the local group stored for the run (ranks need not be sorted;
 * copied): held until the daemon stops, whatever ranks declare later, so
 * that spooled token statistics re-fed before the ranks reconnect reduce
 * over the group they were sent for. 0, -ENOMEM or -ENOSPC. */
int run_restore_local(struct run *run, const uint32_t *ranks, size_t n);

/* Ranks expected to report router tokens of `layer`. */
uint32_t run_tokens_want(const struct run *run, uint32_t layer);

/* Resend dedup: returns true (and records seq) when seq is above every seq
 * fed on this stream, false for a resend. */
bool run_stream_fresh(struct run *run, int64_t stream_id, uint64_t seq);

/* Records the step of the report just fed on the stream. */
void run_stream_fed_step(struct run *run, int64_t stream_id, uint64_t step);

/* Under memory pressure, whether the stream should still be read: the run
 * has a bucket still reducing and the stream has fed nothing at or beyond
 * its step (its next reports may complete it). Others wait. */
bool run_stream_needed(const struct run *run, int64_t stream_id);

/* Raises the stream's fed seq to at least seq (a Welcome's last_seq, or a
 * spooled report at restart). 0 or -ENOMEM / -ENOSPC. */
int run_stream_seen(struct run *run, int64_t stream_id, uint64_t seq);

/* Adds the sketches of one report (attention, router_gram, router_tokens;
 * scalars are not reduced) of `rank` for `step`. time: the report's time
 * (unix seconds), kept as the bucket's point time. now: monotonic seconds.
 * Returns 0 (counts in *st, which is zeroed first; may be NULL) or
 * -ENOMEM (groups added before the failure stay). */
int run_add(struct run_registry *reg, struct run *run, uint64_t step, double time, uint32_t rank,
            const Foreshock__Report *r, double now, struct run_add_stats *st);

/* The run's earliest bucket if it is ready at `now` (see the top comment),
 * removed from the run, else NULL. Groups that timed out are freed and
 * listed in bucket->incomplete; missing expected attention groups too
 * (have 0, at most RUN_MAX_MISSING_RECORDS). Caller owns the bucket. */
struct run_bucket *run_take_ready(struct run_registry *reg, struct run *run, double now);

/* Takes the run's earliest bucket whatever its state (for tests and
 * draining), marking incomplete groups as run_take_ready would at timeout.
 * NULL when the run has none. */
struct run_bucket *run_take_front(struct run_registry *reg, struct run *run);

/* Sets the last taken step (restart: the run's evaluated history), so that
 * data at or below it counts as late. */
void run_set_done_step(struct run *run, int64_t step);

/* A rewind to step (rewind.h): frees the run's pending buckets of steps
 * after step and lowers the last taken step to step when it was above, so
 * that re-done steps are not late. Returns the buckets dropped. */
size_t run_drop_after(struct run *run, uint64_t step);

/* Frees a taken bucket and returns its bytes to the registry. NULL is a
 * no-op. Owner thread. */
void run_bucket_free(struct run_bucket *b);

/* Static name of a group kind as in the incomplete table ("attention",
 * "router_gram", "router_tokens"). */
const char *run_group_kind_name(enum run_group_kind k);

#endif
