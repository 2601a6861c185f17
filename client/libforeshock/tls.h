#ifndef FSC_TLS_H
#define FSC_TLS_H

/* TLS to the daemon (OpenSSL) on the I/O thread's non-blocking socket. The
 * context (CA, client certificate, name to verify) is built by fsc_open, so
 * a bad file fails there, named; each connection then gets its own SSL.
 * The daemon's certificate is always verified: against tls_ca_file, or the
 * system's CA store, and for the name tls_server_name (default: host; an IP
 * address is checked as one). */

#include <stddef.h>
#include <sys/types.h>

#include "foreshock.h"
#include "internal.h"

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

struct fsc_tls {
    SSL_CTX *ctx; /* NULL: plain TCP */
    char *name;   /* verified against the daemon's certificate */
    int is_ip;
};

/* From the options (o->tls 0: nothing to do). 0, or -EINVAL / -ENOMEM with
 * the reason in err. Caller thread (fsc_open). */
FSC_HIDDEN int fsc_tls_init(struct fsc_tls *t, const struct fsc_options *o, char *err,
                            size_t errlen);
FSC_HIDDEN void fsc_tls_free(struct fsc_tls *t);

#define FSC_TLS_WANT_READ 1
#define FSC_TLS_WANT_WRITE 2

/* A client SSL on the connected fd. NULL on out of memory. */
FSC_HIDDEN SSL *fsc_tls_new(const struct fsc_tls *t, int fd);
FSC_HIDDEN void fsc_tls_close(SSL *ssl); /* frees; no close_notify (the socket goes too) */

/* Drives the handshake: 0 done, FSC_TLS_WANT_READ / _WRITE (poll, call
 * again), or -EPROTO with the reason (a certificate that does not verify,
 * a peer that is not TLS) in err. */
FSC_HIDDEN int fsc_tls_handshake(SSL *ssl, char *err, size_t errlen);

/* Like recv/send on a non-blocking socket: bytes (> 0); recv 0 on a clean
 * close; -EAGAIN when it would block (*want says for what); -EPROTO with
 * err (the daemon refused our certificate, say). */
FSC_HIDDEN ssize_t fsc_tls_recv(SSL *ssl, void *buf, size_t n, int *want, char *err, size_t errlen);
FSC_HIDDEN ssize_t fsc_tls_send(SSL *ssl, const void *buf, size_t n, int *want, char *err,
                                size_t errlen);

#endif
