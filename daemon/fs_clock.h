#ifndef FORESHOCK_FS_CLOCK_H
#define FORESHOCK_FS_CLOCK_H

#include <time.h>

/* The clocks the daemon reads, as seconds in a double. Any thread.
 * fs_clock_unix: wall time (UNIX seconds) for what is stored or shown;
 * it can step. fs_clock_mono: for intervals, timeouts and backoff.
 * fs_clock_thread_cpu: CPU time of the calling thread, for CPU metrics. */
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

/* CPU time the calling thread has used, seconds: what a "CPU seconds"
 * metric must count. Wall time over the same code also counts the time the
 * thread waited for a core (up to 16x more on a loaded 2-core host). */
static inline double fs_clock_thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The CLOCK_MONOTONIC time `seconds` from now, as the absolute deadline
 * pthread_cond_timedwait takes on a condition variable set to that clock.
 * seconds <= 0 (or NaN) is now; more than FS_CLOCK_MAX_WAIT_S is capped. */
#define FS_CLOCK_MAX_WAIT_S 1e9
static inline struct timespec fs_clock_mono_after(double seconds)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (!(seconds > 0))
        return ts;
    if (seconds > FS_CLOCK_MAX_WAIT_S)
        seconds = FS_CLOCK_MAX_WAIT_S;
    time_t whole = (time_t)seconds;
    ts.tv_sec += whole;
    ts.tv_nsec += (long)((seconds - (double)whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

#endif
