/* Socket helpers (see net.h). */
#include "net.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Keepalive: a peer that vanished without a FIN/RST (host down, cable) is
 * noticed after about KEEPIDLE + KEEPCNT * KEEPINTVL seconds. */
#define KEEPIDLE_S 10
#define KEEPINTVL_S 5
#define KEEPCNT 3

int fsc_net_resolve(const char *host, uint16_t port, struct addrinfo **out, char *err,
                    size_t errlen)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    char service[8];
    int rc;

    snprintf(service, sizeof(service), "%u", (unsigned)port);
    hints.ai_flags = AI_NUMERICSERV;
    rc = getaddrinfo(host, service, &hints, out);
    if (rc != 0)
        return fsc_err(err, errlen, -EHOSTUNREACH, "cannot resolve %s: %s", host, gai_strerror(rc));
    return 0;
}

int fsc_net_nonblock_cloexec(int fd)
{
    int fl = fcntl(fd, F_GETFL);

    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
        return -errno;
    fl = fcntl(fd, F_GETFD);
    if (fl < 0 || fcntl(fd, F_SETFD, fl | FD_CLOEXEC) < 0)
        return -errno;
    return 0;
}

int fsc_net_connect_start(const struct addrinfo *ai, int *fd)
{
    int s = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    int rc;

    if (s < 0)
        return -errno;
    rc = fsc_net_nonblock_cloexec(s);
    if (rc < 0)
        goto fail;
    if (connect(s, ai->ai_addr, ai->ai_addrlen) == 0) {
        rc = fsc_net_connect_finish(s);
        if (rc < 0)
            goto fail;
        *fd = s;
        return 1;
    }
    if (errno != EINPROGRESS) {
        rc = -errno;
        goto fail;
    }
    *fd = s;
    return 0;
fail:
    close(s);
    return rc;
}

int fsc_net_connect_finish(int fd)
{
    int soerr = 0, one = 1, idle = KEEPIDLE_S, intvl = KEEPINTVL_S, cnt = KEEPCNT;
    socklen_t len = sizeof(soerr);

    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) < 0)
        return -errno;
    if (soerr)
        return -soerr;
    /* Small frames (the last report before a flush, Bye) go out at once.
     * Options are best effort: failing to set them is not fatal. */
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
    (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
    return 0;
}
