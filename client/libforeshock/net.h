#ifndef FSC_NET_H
#define FSC_NET_H

/* Socket helpers for the I/O thread: resolve, non-blocking connect, options. */

#include <netdb.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* Resolves host (name or numeric) and port for TCP. May block on DNS.
 * Returns 0 and *out (release with freeaddrinfo), or -EHOSTUNREACH with a
 * message in err. */
FSC_HIDDEN int fsc_net_resolve(const char *host, uint16_t port, struct addrinfo **out, char *err,
                               size_t errlen);

/* Creates a non-blocking, close-on-exec socket for ai and starts connecting.
 * Returns 1 and *fd when connected at once, 0 and *fd when in progress (poll
 * for POLLOUT, then fsc_net_connect_finish), or -errno (no fd). */
FSC_HIDDEN int fsc_net_connect_start(const struct addrinfo *ai, int *fd);

/* After the socket polled writable: returns 0 when connected (and sets
 * TCP_NODELAY and keepalive), or the connect error as -errno. */
FSC_HIDDEN int fsc_net_connect_finish(int fd);

/* Sets O_NONBLOCK and FD_CLOEXEC. Returns 0 or -errno. */
FSC_HIDDEN int fsc_net_nonblock_cloexec(int fd);

#endif
