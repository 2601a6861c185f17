#ifndef FORESHOCK_TLS_H
#define FORESHOCK_TLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "fs_err.h"

/* TLS for ingest (OpenSSL), driven by whoever owns the socket: the
 * connection's records go in and out through memory buffers, never through
 * a descriptor, so the libuv loop keeps owning every socket and read/write
 * (ingest_tls.c) and this file stays free of I/O. A rank's certificate is
 * checked against tls_client_ca when one is configured (mutual TLS).
 *
 * Threads: a tls_server is built by main() before the loop runs and is
 * read-only after; a tls_conn belongs to the thread of its connection (the
 * loop thread). */

struct tls_server_opts {
    const char *cert_file; /* PEM certificate chain of the daemon (required) */
    const char *key_file;  /* PEM private key (required) */
    const char *ca_file;   /* PEM CA bundle client certificates must chain to; NULL or "":
                              clients present none */
};

struct tls_server;
struct tls_conn;

/* Loads and checks the files (the key matches the certificate). Returns 0
 * and *out, or -EINVAL / -ENOMEM with a message naming the file in err. */
int tls_server_new(const struct tls_server_opts *o, struct tls_server **out, struct fs_err *err);
void tls_server_free(struct tls_server *s);

/* A server-side connection in its handshake. NULL on out of memory. */
struct tls_conn *tls_conn_new(struct tls_server *s);
void tls_conn_free(struct tls_conn *t);

/* Hands over n bytes read from the socket. 0 or -ENOMEM. */
int tls_conn_feed(struct tls_conn *t, const uint8_t *p, size_t n);

#define TLS_CLOSED (-1000) /* tls_conn_read: the peer sent close_notify */

/* Decrypts into out (at most cap bytes), driving the handshake first.
 * Returns the bytes written (> 0), 0 when more input is needed, TLS_CLOSED,
 * or -EPROTO with the reason in err (a failed handshake: a bad or missing
 * client certificate, not TLS at all). Output may be pending after any
 * call (tls_conn_take_output). */
ssize_t tls_conn_read(struct tls_conn *t, uint8_t *out, size_t cap, struct fs_err *err);

/* Encrypts n bytes of plaintext. 0, -ENOMEM, or -EPROTO (the connection
 * failed or the handshake is not done: plaintext is sent only after it). */
int tls_conn_write(struct tls_conn *t, const uint8_t *p, size_t n);

/* Queues close_notify. */
void tls_conn_shutdown(struct tls_conn *t);

/* Moves the records waiting to be sent into a new buffer (*buf, caller
 * frees; NULL and 0 when none). 0 or -ENOMEM. */
int tls_conn_take_output(struct tls_conn *t, uint8_t **buf, size_t *len);

/* Handshake done: plaintext may flow both ways. */
bool tls_conn_ready(const struct tls_conn *t);

/* The verified client certificate's subject ("CN=rank-3,O=..."), or "" when
 * there is none; after the handshake. */
void tls_conn_peer_subject(const struct tls_conn *t, char *out, size_t len);

#endif
