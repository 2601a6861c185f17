/* TLS over memory buffers (see tls.h). */
#include "tls.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

/* Depth of a client's chain below the CA, intermediates included. */
#define TLS_VERIFY_DEPTH 4

struct tls_server {
    SSL_CTX *ctx;
};

struct tls_conn {
    SSL *ssl;
    BIO *in, *out; /* the socket's side: ciphertext read / to send */
    bool failed;
};

/* The first queued OpenSSL error as text, the queue emptied. */
static void ssl_reason(char *out, size_t len)
{
    unsigned long e = ERR_get_error();
    if (e)
        ERR_error_string_n(e, out, len);
    else
        snprintf(out, len, "unknown TLS error");
    ERR_clear_error();
}

int tls_server_new(const struct tls_server_opts *o, struct tls_server **out, struct fs_err *err)
{
    char why[256];
    *out = NULL;
    if (!o->cert_file || !o->cert_file[0] || !o->key_file || !o->key_file[0])
        return fs_err_set(err, -EINVAL, "tls: a certificate and a key are both required");
    struct tls_server *s = calloc(1, sizeof(*s));
    if (!s || !(s->ctx = SSL_CTX_new(TLS_server_method()))) {
        free(s);
        return fs_err_set(err, -ENOMEM, "tls: out of memory");
    }
    int rc = -EINVAL;
    SSL_CTX_set_min_proto_version(s->ctx, TLS1_2_VERSION);
    if (SSL_CTX_use_certificate_chain_file(s->ctx, o->cert_file) != 1) {
        ssl_reason(why, sizeof(why));
        fs_err_set(err, rc, "tls: certificate %s: %s", o->cert_file, why);
        goto fail;
    }
    if (SSL_CTX_use_PrivateKey_file(s->ctx, o->key_file, SSL_FILETYPE_PEM) != 1) {
        ssl_reason(why, sizeof(why));
        fs_err_set(err, rc, "tls: key %s: %s", o->key_file, why);
        goto fail;
    }
    if (SSL_CTX_check_private_key(s->ctx) != 1) {
        ssl_reason(why, sizeof(why));
        fs_err_set(err, rc, "tls: key %s does not match certificate %s: %s", o->key_file,
                   o->cert_file, why);
        goto fail;
    }
    if (o->ca_file && o->ca_file[0]) {
        STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(o->ca_file);
        if (SSL_CTX_load_verify_locations(s->ctx, o->ca_file, NULL) != 1 || !names) {
            sk_X509_NAME_pop_free(names, X509_NAME_free);
            ssl_reason(why, sizeof(why));
            fs_err_set(err, rc, "tls: client CA %s: %s", o->ca_file, why);
            goto fail;
        }
        SSL_CTX_set_client_CA_list(s->ctx, names);
        /* Mutual TLS: a rank without a certificate signed by the CA never
         * gets as far as its Hello. */
        SSL_CTX_set_verify(s->ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
        SSL_CTX_set_verify_depth(s->ctx, TLS_VERIFY_DEPTH);
    }
    *out = s;
    return 0;
fail:
    tls_server_free(s);
    return rc;
}

void tls_server_free(struct tls_server *s)
{
    if (!s)
        return;
    SSL_CTX_free(s->ctx);
    free(s);
}

struct tls_conn *tls_conn_new(struct tls_server *s)
{
    struct tls_conn *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->ssl = SSL_new(s->ctx);
    t->in = BIO_new(BIO_s_mem());
    t->out = BIO_new(BIO_s_mem());
    if (!t->ssl || !t->in || !t->out) {
        SSL_free(t->ssl);
        BIO_free(t->in);
        BIO_free(t->out);
        free(t);
        return NULL;
    }
    /* An empty memory BIO means "nothing yet", not end of file. */
    BIO_set_mem_eof_return(t->in, -1);
    BIO_set_mem_eof_return(t->out, -1);
    SSL_set_bio(t->ssl, t->in, t->out); /* the SSL owns both now */
    SSL_set_accept_state(t->ssl);
    return t;
}

void tls_conn_free(struct tls_conn *t)
{
    if (!t)
        return;
    SSL_free(t->ssl);
    free(t);
}

int tls_conn_feed(struct tls_conn *t, const uint8_t *p, size_t n)
{
    while (n) {
        int chunk = n > (1u << 30) ? (1 << 30) : (int)n;
        int w = BIO_write(t->in, p, chunk);
        if (w <= 0)
            return -ENOMEM;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void verify_reason(const struct tls_conn *t, struct fs_err *err)
{
    long v = SSL_get_verify_result(t->ssl);
    char why[256];
    ssl_reason(why, sizeof(why));
    if (v != X509_V_OK)
        fs_err_set(err, 0, "TLS handshake failed: client certificate: %s",
                   X509_verify_cert_error_string(v));
    else
        fs_err_set(err, 0, "TLS handshake failed: %s", why);
}

ssize_t tls_conn_read(struct tls_conn *t, uint8_t *out, size_t cap, struct fs_err *err)
{
    if (t->failed)
        return fs_err_set(err, -EPROTO, "TLS connection failed earlier");
    if (!SSL_is_init_finished(t->ssl)) {
        ERR_clear_error();
        int r = SSL_do_handshake(t->ssl);
        if (r != 1) {
            int e = SSL_get_error(t->ssl, r);
            if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
                return 0;
            t->failed = true;
            verify_reason(t, err);
            return -EPROTO;
        }
    }
    if (cap == 0)
        return 0;
    size_t got = 0;
    ERR_clear_error();
    int r = SSL_read_ex(t->ssl, out, cap, &got);
    if (r == 1)
        return (ssize_t)got;
    int e = SSL_get_error(t->ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
        return 0;
    if (e == SSL_ERROR_ZERO_RETURN)
        return TLS_CLOSED;
    t->failed = true;
    char why[256];
    ssl_reason(why, sizeof(why));
    return fs_err_set(err, -EPROTO, "TLS: %s", why);
}

int tls_conn_write(struct tls_conn *t, const uint8_t *p, size_t n)
{
    if (t->failed || !SSL_is_init_finished(t->ssl))
        return -EPROTO;
    while (n) {
        size_t done = 0;
        ERR_clear_error();
        /* Memory BIO: a write never waits for the peer, it only grows the
         * output buffer that the caller accounts for. */
        if (SSL_write_ex(t->ssl, p, n, &done) != 1) {
            t->failed = true;
            ERR_clear_error();
            return -ENOMEM;
        }
        p += done;
        n -= done;
    }
    return 0;
}

void tls_conn_shutdown(struct tls_conn *t)
{
    if (!t->failed && SSL_is_init_finished(t->ssl)) {
        (void)SSL_shutdown(t->ssl);
        ERR_clear_error();
    }
}

int tls_conn_take_output(struct tls_conn *t, uint8_t **buf, size_t *len)
{
    *buf = NULL;
    *len = 0;
    size_t n = BIO_ctrl_pending(t->out);
    if (!n)
        return 0;
    uint8_t *b = malloc(n);
    if (!b)
        return -ENOMEM;
    int r = BIO_read(t->out, b, (int)n);
    if (r <= 0) {
        free(b);
        return 0;
    }
    *buf = b;
    *len = (size_t)r;
    return 0;
}

bool tls_conn_ready(const struct tls_conn *t)
{
    return !t->failed && SSL_is_init_finished(t->ssl);
}

void tls_conn_peer_subject(const struct tls_conn *t, char *out, size_t len)
{
    if (len)
        out[0] = '\0';
    X509 *x = SSL_get1_peer_certificate(t->ssl);
    if (!x)
        return;
    X509_NAME_oneline(X509_get_subject_name(x), out, (int)len);
    X509_free(x);
}
