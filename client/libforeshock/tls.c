/* TLS to the daemon (see tls.h). */
#include "tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

static void reason(char *err, size_t errlen, const char *what)
{
    unsigned long e = ERR_get_error();
    char buf[256] = "unknown error";
    if (e)
        ERR_error_string_n(e, buf, sizeof(buf));
    ERR_clear_error();
    fsc_err(err, errlen, -EPROTO, "%s: %s", what, buf);
}

int fsc_tls_init(struct fsc_tls *t, const struct fsc_options *o, char *err, size_t errlen)
{
    memset(t, 0, sizeof(*t));
    if (!o->tls)
        return 0;
    if (!o->tls_cert_file != !o->tls_key_file)
        return fsc_err(err, errlen, -EINVAL, "tls_cert_file and tls_key_file go together");
    const char *name = o->tls_server_name && o->tls_server_name[0] ? o->tls_server_name : o->host;
    unsigned char ip[16];
    t->is_ip = inet_pton(AF_INET, name, ip) == 1 || inet_pton(AF_INET6, name, ip) == 1;
    t->name = strdup(name);
    t->ctx = SSL_CTX_new(TLS_client_method());
    if (!t->name || !t->ctx) {
        fsc_tls_free(t);
        return fsc_err(err, errlen, -ENOMEM, "out of memory");
    }
    SSL_CTX_set_min_proto_version(t->ctx, TLS1_2_VERSION);
    /* A report is written from where the last partial write stopped. */
    SSL_CTX_set_mode(t->ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_verify(t->ctx, SSL_VERIFY_PEER, NULL);
    int ok = o->tls_ca_file && o->tls_ca_file[0]
                 ? SSL_CTX_load_verify_locations(t->ctx, o->tls_ca_file, NULL)
                 : SSL_CTX_set_default_verify_paths(t->ctx);
    if (ok != 1) {
        char what[FSC_ERROR_LEN];
        snprintf(what, sizeof(what), "tls_ca_file %s",
                 o->tls_ca_file ? o->tls_ca_file : "(system store)");
        reason(err, errlen, what);
        fsc_tls_free(t);
        return -EINVAL;
    }
    if (o->tls_cert_file) {
        if (SSL_CTX_use_certificate_chain_file(t->ctx, o->tls_cert_file) != 1) {
            reason(err, errlen, o->tls_cert_file);
            fsc_tls_free(t);
            return -EINVAL;
        }
        if (SSL_CTX_use_PrivateKey_file(t->ctx, o->tls_key_file, SSL_FILETYPE_PEM) != 1 ||
            SSL_CTX_check_private_key(t->ctx) != 1) {
            reason(err, errlen, o->tls_key_file);
            fsc_tls_free(t);
            return -EINVAL;
        }
    }
    return 0;
}

void fsc_tls_free(struct fsc_tls *t)
{
    SSL_CTX_free(t->ctx);
    free(t->name);
    memset(t, 0, sizeof(*t));
}

SSL *fsc_tls_new(const struct fsc_tls *t, int fd)
{
    SSL *ssl = SSL_new(t->ctx);
    if (!ssl)
        return NULL;
    int ok = SSL_set_fd(ssl, fd) == 1;
    if (t->is_ip) {
        ok = ok && X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), t->name) == 1;
    } else {
        ok = ok && SSL_set_tlsext_host_name(ssl, t->name) == 1 && SSL_set1_host(ssl, t->name) == 1;
    }
    if (!ok) {
        SSL_free(ssl);
        ERR_clear_error();
        return NULL;
    }
    SSL_set_connect_state(ssl);
    return ssl;
}

void fsc_tls_close(SSL *ssl)
{
    SSL_free(ssl);
}

/* The outcome of an SSL call that returned r. */
static int outcome(SSL *ssl, int r, int *want, char *err, size_t errlen, const char *what)
{
    int e = SSL_get_error(ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        *want = e == SSL_ERROR_WANT_READ ? FSC_TLS_WANT_READ : FSC_TLS_WANT_WRITE;
        return -EAGAIN;
    }
    if (e == SSL_ERROR_ZERO_RETURN)
        return 0;
    if (e == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
        int saved = errno;
        ERR_clear_error();
        fsc_err(err, errlen, -ECONNRESET, "%s: %s", what,
                saved ? strerror(saved) : "connection closed during TLS");
        return -ECONNRESET;
    }
    long v = SSL_get_verify_result(ssl);
    if (v != X509_V_OK) {
        ERR_clear_error();
        fsc_err(err, errlen, -EPROTO, "%s: the daemon's certificate: %s", what,
                X509_verify_cert_error_string(v));
        return -EPROTO;
    }
    reason(err, errlen, what);
    return -EPROTO;
}

int fsc_tls_handshake(SSL *ssl, char *err, size_t errlen)
{
    ERR_clear_error();
    int r = SSL_do_handshake(ssl);
    if (r == 1)
        return 0;
    int want = 0;
    int rc = outcome(ssl, r, &want, err, errlen, "TLS handshake");
    if (rc == -EAGAIN)
        return want;
    return rc == 0 ? -ECONNRESET : rc;
}

ssize_t fsc_tls_recv(SSL *ssl, void *buf, size_t n, int *want, char *err, size_t errlen)
{
    size_t got = 0;
    ERR_clear_error();
    int r = SSL_read_ex(ssl, buf, n, &got);
    if (r == 1)
        return (ssize_t)got;
    return outcome(ssl, r, want, err, errlen, "TLS receive");
}

ssize_t fsc_tls_send(SSL *ssl, const void *buf, size_t n, int *want, char *err, size_t errlen)
{
    size_t done = 0;
    ERR_clear_error();
    int r = SSL_write_ex(ssl, buf, n, &done);
    if (r == 1)
        return (ssize_t)done;
    ssize_t rc = outcome(ssl, r, want, err, errlen, "TLS send");
    return rc == 0 ? -ECONNRESET : rc;
}
