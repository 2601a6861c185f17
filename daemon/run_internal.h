#ifndef FORESHOCK_RUN_INTERNAL_H
#define FORESHOCK_RUN_INTERNAL_H

/* Inside the run registry, for its files only (other modules use run.h):
 * run.c keeps the runs (shape, MoE announcements, local groups, resend
 * dedup); run_bucket.c the per-step buckets and the groups reduced in them
 * (adding pieces, readiness, taking). Owner thread only, as run.h says. */
#include <stddef.h>
#include <stdint.h>

#include "run.h"

struct run_registry {
    struct run_limits lim;
    struct run **runs;
    size_t n, cap;
    uint64_t bytes;
};

#endif
