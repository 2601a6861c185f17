#ifndef FSC_BACKOFF_H
#define FSC_BACKOFF_H

/* Reconnect delays: exponential with jitter. Pure. */

#include <stdint.h>

#include "internal.h"

/* splitmix64: advances *state and returns 64 random bits. */
FSC_HIDDEN uint64_t fsc_rand_next(uint64_t *state);

/* Delay before connection attempt `attempt` (0: the first, no delay). For
 * attempt >= 1, base = min(max_ms, min_ms * 2^(attempt-1)) and the result is
 * uniform in [base/2, base] ("equal jitter": never zero, so a crowd of ranks
 * that lost the daemon together does not reconnect in lockstep). */
FSC_HIDDEN unsigned fsc_backoff_delay(unsigned attempt, unsigned min_ms, unsigned max_ms,
                                      uint64_t *rng);

#endif
