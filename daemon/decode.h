#ifndef FORESHOCK_DECODE_H
#define FORESHOCK_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "foreshock.pb-c.h"
#include "fs_err.h"

/* Frame decoding and validation: pure functions (no libuv, no SQLite), safe
 * from any thread. A frame on the wire is a 4-byte big-endian length N and N
 * bytes of one serialized Frame. Nothing here allocates by a length it has
 * not checked against a limit first. */

#define DECODE_PREFIX_BYTES 4u

struct decode_limits {
    uint32_t max_frame_bytes; /* N above this (or N == 0): ERROR_TOO_LARGE */
    uint32_t max_world_size;
    uint32_t max_layers; /* layer index < max_layers */
    uint32_t max_heads;  /* head, kv_head < max_heads */
    uint32_t max_dh;
    uint32_t max_experts;
    uint32_t max_window;
    uint32_t max_shards;
    uint32_t max_attention_per_report;
    uint32_t max_router_per_report; /* router_gram and router_tokens, each */
    uint32_t max_run_id_len;
    uint32_t max_spectrum_len; /* per spectrum array; also <= 2*max_dh */
    uint32_t max_token_len;
};

/* Fills lim with the FS_MAX_* values of fs_limits.h and the given frame size. */
void decode_limits_default(struct decode_limits *lim, uint32_t max_frame_bytes);

/* Error detail is a struct fs_err, owned by the caller: on failure err->code
 * is a FORESHOCK__ERROR_CODE__* value and err->msg (at most
 * FS_MAX_ERROR_MESSAGE bytes with NUL) the message, both ready to send back
 * in an Error frame. */

/* What validation saw, for the caller's counters and later stages. */
struct decode_info {
    size_t alloc_bytes;               /* bytes the unpack allocated */
    uint32_t sketches;                /* attention + router_gram + router_tokens */
    uint64_t nonfinite_sketch_values; /* NaN/Inf in Gram bytes and spectra (accepted) */
    int nonfinite_scalars;            /* loss or grad_norm is NaN/Inf (accepted) */
};

/* A Report's scalars as the daemon reads them, translated from the wire in
 * one place (decode_scalars) for the writer's row and the stage's detectors:
 * v[DECODE_SCALAR_*], bit i of present set when the report carries scalar i
 * (v[i] is the wire's value either way, 0 when absent). The order is the
 * store's (store.h enum store_scalar). */
enum decode_scalar {
    DECODE_SCALAR_LOSS,
    DECODE_SCALAR_GRAD_NORM,
    DECODE_SCALAR_LR,
    DECODE_SCALAR_LOSS_SCALE,
    DECODE_SCALAR_TOKENS,
    DECODE_SCALAR_STEP_TIME,
    DECODE_SCALAR_STEP_UPDATE_RATIO,
    DECODE_NSCALARS
};

struct decode_scalars {
    unsigned present; /* bit i: v[i] was sent */
    double v[DECODE_NSCALARS];
};

/* Fills *out from s (NULL: nothing present). Pure. */
void decode_scalars(const Foreshock__Scalars *s, struct decode_scalars *out);

/* Checks a length prefix. hdr: the 4 bytes as received. On success *len
 * is N (1..max_frame_bytes) and 0 is returned; otherwise -EMSGSIZE with
 * err->code = ERROR_TOO_LARGE. */
int decode_prefix(const uint8_t hdr[DECODE_PREFIX_BYTES], const struct decode_limits *lim,
                  uint32_t *len, struct fs_err *err);

/* Unpacks and validates one frame body (the N bytes after the prefix).
 * On success returns 0 and *out, which the caller frees with
 * decode_frame_free(); info (may be NULL) is filled. On failure returns
 * -EMSGSIZE (length), -EINVAL (undecodable or invalid), -ENOMEM (the unpack
 * would exceed its allocation cap) and sets err; *out is NULL.
 * Any body type decodes; which types a peer may send is the caller's rule. */
int decode_frame(const uint8_t *body, size_t len, const struct decode_limits *lim,
                 Foreshock__Frame **out, struct decode_info *info, struct fs_err *err);

/* Frees a frame from decode_frame(). NULL is a no-op. */
void decode_frame_free(Foreshock__Frame *f);

/* Validates a Hello / Report already unpacked (decode_frame calls these). */
int decode_check_hello(const Foreshock__Hello *h, const struct decode_limits *lim,
                       struct fs_err *err);
int decode_check_report(const Foreshock__Report *r, const struct decode_limits *lim,
                        struct decode_info *info, struct fs_err *err);

/* Serialises f with its length prefix into a new malloc'd buffer that the
 * caller frees. Returns 0, -ENOMEM, or -EMSGSIZE if the body exceeds
 * UINT32_MAX. */
int decode_encode(const Foreshock__Frame *f, uint8_t **out, size_t *outlen);

/* Convenience: an Error frame (code, message, and Error.seq when seq > 0)
 * encoded with its prefix. */
int decode_encode_error(int code, const char *message, uint64_t seq, uint8_t **out, size_t *outlen);

/* The seq of the Report in a frame body that decode_frame refused, read
 * straight from the wire (the first Frame.report field and, in it, the
 * first Report.seq), so that the Error can name the report even when it
 * does not unpack (the decode allocation cap, a bad field after the seq).
 * Returns 0 and *seq >= 1, or -ENOENT (no report, no seq, or bytes that do
 * not parse that far). Bounded by len; no allocation. */
int decode_peek_report_seq(const uint8_t *body, size_t len, uint64_t *seq);

/* A run id is 1..max_len bytes of [A-Za-z0-9._:-]. Returns 1 if valid. */
int decode_run_id_valid(const char *s, size_t max_len);

#endif
