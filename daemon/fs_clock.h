#ifndef FORESHOCK_FS_CLOCK_H
#define FORESHOCK_FS_CLOCK_H

#include <time.h>

/* The two clocks the daemon reads, as seconds in a double. Any thread.
 * fs_clock_unix: wall time (UNIX seconds) for what is stored or shown;
 * it can step. fs_clock_mono: for intervals, timeouts and backoff. */
static inline double fs_clock_unix(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline double fs_clock_mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
