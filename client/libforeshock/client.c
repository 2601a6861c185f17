/* The public client API: options, fsc_open, fsc_submit, fsc_flush,
 * fsc_stats, fsc_close. Runs on caller threads; the network side is io.c. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client.h"
#include "foreshock.pb-c.h"
#include "net.h"
#include "record.h"
#include "report_pack.h"
#include "wire.h"

const char *fsc_version(void)
{
    return FSC_VERSION;
}

void fsc_options_init(struct fsc_options *o)
{
    *o = (struct fsc_options){
        .size = sizeof(*o),
        .host = FSC_DEFAULT_HOST,
        .port = FSC_DEFAULT_PORT,
        .world_size = 1,
        .replay_max_bytes = FSC_DEFAULT_REPLAY_MAX_BYTES,
        .max_report_bytes = FSC_DEFAULT_MAX_REPORT_BYTES,
        .backoff_min_ms = FSC_DEFAULT_BACKOFF_MIN_MS,
        .backoff_max_ms = FSC_DEFAULT_BACKOFF_MAX_MS,
        .connect_timeout_ms = FSC_DEFAULT_CONNECT_TIMEOUT_MS,
        .handshake_timeout_ms = FSC_DEFAULT_HANDSHAKE_TIMEOUT_MS,
    };
}

/* ---- options ------------------------------------------------------------------ */

/* Copies the caller's options (whatever size they were compiled with) and
 * fills zero fields with defaults. */
static int copy_options(const struct fsc_options *in, struct fsc_options *o, char *err,
                        size_t errlen)
{
    if (!in)
        return fsc_err(err, errlen, -EINVAL, "options are NULL");
    if (in->size < FSC_OPTIONS_MIN_SIZE) /* the 0.1 layout is the smallest there is */
        return fsc_err(err, errlen, -EINVAL, "options.size %zu is below %zu", in->size,
                       (size_t)FSC_OPTIONS_MIN_SIZE);
    /* A newer caller may pass a larger struct; that is fine as long as it
     * asks for nothing this library does not know about. */
    for (size_t i = sizeof(*o); i < in->size; i++)
        if (((const unsigned char *)in)[i])
            return fsc_err(err, errlen, -E2BIG, "options.size %zu: unknown non-zero fields",
                           in->size);
    /* An older caller's struct is shorter: the fields it lacks are zero. */
    memset(o, 0, sizeof(*o));
    memcpy(o, in, in->size < sizeof(*o) ? in->size : sizeof(*o));
    if (!o->host)
        o->host = FSC_DEFAULT_HOST;
    if (!o->port)
        o->port = FSC_DEFAULT_PORT;
    if (!o->replay_max_bytes)
        o->replay_max_bytes = FSC_DEFAULT_REPLAY_MAX_BYTES;
    if (!o->max_report_bytes)
        o->max_report_bytes = FSC_DEFAULT_MAX_REPORT_BYTES;
    if (!o->backoff_min_ms)
        o->backoff_min_ms = FSC_DEFAULT_BACKOFF_MIN_MS;
    if (!o->backoff_max_ms)
        o->backoff_max_ms = FSC_DEFAULT_BACKOFF_MAX_MS;
    if (!o->connect_timeout_ms)
        o->connect_timeout_ms = FSC_DEFAULT_CONNECT_TIMEOUT_MS;
    if (!o->handshake_timeout_ms)
        o->handshake_timeout_ms = FSC_DEFAULT_HANDSHAKE_TIMEOUT_MS;
    return 0;
}

/* Hello.run_id: 1..FSC_MAX_RUN_ID_LEN bytes of [A-Za-z0-9._:-]. */
static int run_id_ok(const char *s)
{
    size_t n = 0;

    if (!s)
        return 0;
    for (; s[n]; n++) {
        char ch = s[n];
        int ok = (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
                 ch == '.' || ch == '_' || ch == ':' || ch == '-';
        if (!ok || n >= FSC_MAX_RUN_ID_LEN)
            return 0;
    }
    return n > 0;
}

/* options.optimizer: 1..FSC_MAX_OPTIMIZER_LEN bytes of printable ASCII. */
static int optimizer_ok(const char *s)
{
    size_t n = 0;

    for (; s[n]; n++) {
        unsigned char ch = (unsigned char)s[n];
        if (n >= FSC_MAX_OPTIMIZER_LEN || ch < ' ' || ch > '~')
            return 0;
    }
    return n > 0;
}

static int validate(const struct fsc_options *o, char *err, size_t errlen)
{
    if (!run_id_ok(o->run_id))
        return fsc_err(err, errlen, -EINVAL, "run_id must be 1..%d characters of [A-Za-z0-9._:-]",
                       FSC_MAX_RUN_ID_LEN);
    if (o->world_size < 1 || o->world_size > FSC_MAX_WORLD_SIZE || o->rank >= o->world_size)
        return fsc_err(err, errlen, -EINVAL, "rank %u must be below world_size %u (1..%u)", o->rank,
                       o->world_size, FSC_MAX_WORLD_SIZE);
    if (!o->host[0] || strnlen(o->host, FSC_MAX_HOST_LEN + 1) > FSC_MAX_HOST_LEN)
        return fsc_err(err, errlen, -EINVAL, "host must be 1..%d bytes", FSC_MAX_HOST_LEN);
    if (o->token && strnlen(o->token, FSC_MAX_TOKEN_LEN + 1) > FSC_MAX_TOKEN_LEN)
        return fsc_err(err, errlen, -EINVAL, "token longer than %d bytes", FSC_MAX_TOKEN_LEN);
    if (o->client_name &&
        strnlen(o->client_name, FSC_MAX_CLIENT_NAME_LEN + 1) > FSC_MAX_CLIENT_NAME_LEN)
        return fsc_err(err, errlen, -EINVAL, "client_name longer than %d bytes",
                       FSC_MAX_CLIENT_NAME_LEN);
    if (o->replay_max_bytes < FSC_MIN_REPLAY_BYTES || o->replay_max_bytes > FSC_MAX_REPLAY_BYTES)
        return fsc_err(err, errlen, -EINVAL, "replay_max_bytes must be in %zu..%zu",
                       FSC_MIN_REPLAY_BYTES, FSC_MAX_REPLAY_BYTES);
    if (o->max_report_bytes > FSC_MAX_REPORT_BYTES_LIMIT)
        return fsc_err(err, errlen, -EINVAL, "max_report_bytes above %zu",
                       FSC_MAX_REPORT_BYTES_LIMIT);
    if (o->backoff_min_ms > o->backoff_max_ms || o->backoff_max_ms > FSC_MAX_BACKOFF_MS)
        return fsc_err(err, errlen, -EINVAL, "backoff_min_ms %u must be <= backoff_max_ms %u <= %u",
                       o->backoff_min_ms, o->backoff_max_ms, FSC_MAX_BACKOFF_MS);
    if (o->connect_timeout_ms > FSC_MAX_TIMEOUT_MS || o->handshake_timeout_ms > FSC_MAX_TIMEOUT_MS)
        return fsc_err(err, errlen, -EINVAL, "timeouts must be <= %u ms", FSC_MAX_TIMEOUT_MS);
    if (o->model.n_moe_layers > FSC_MAX_MOE_LAYERS ||
        (o->model.n_moe_layers && !o->model.moe_layers))
        return fsc_err(err, errlen, -EINVAL, "model.moe_layers: at most %d values, non-NULL",
                       FSC_MAX_MOE_LAYERS);
    if (o->optimizer && !optimizer_ok(o->optimizer))
        return fsc_err(err, errlen, -EINVAL,
                       "optimizer must be 1..%d bytes of printable ASCII (0x20..0x7e)",
                       FSC_MAX_OPTIMIZER_LEN);
    if (o->n_local_ranks > FSC_MAX_LOCAL_RANKS || (o->n_local_ranks && !o->local_ranks))
        return fsc_err(err, errlen, -EINVAL, "local_ranks: at most %d values, non-NULL",
                       FSC_MAX_LOCAL_RANKS);
    if (o->n_local_ranks) {
        int self = 0;
        for (size_t i = 0; i < o->n_local_ranks; i++) {
            if (o->local_ranks[i] >= o->world_size)
                return fsc_err(err, errlen, -EINVAL,
                               "local_ranks[%zu] = %u is not below "
                               "world_size %u",
                               i, o->local_ranks[i], o->world_size);
            self |= o->local_ranks[i] == o->rank;
        }
        if (!self)
            return fsc_err(err, errlen, -EINVAL, "local_ranks does not include rank %u itself",
                           o->rank);
    }
    if (!o->tls && (o->tls_ca_file || o->tls_cert_file || o->tls_key_file || o->tls_server_name))
        return fsc_err(err, errlen, -EINVAL, "tls_* files or name given without tls = 1");
    if (o->record_only && !(o->record_path && o->record_path[0]))
        return fsc_err(err, errlen, -EINVAL, "record_only needs record_path");
    if (o->resume && o->resume_step > INT64_MAX)
        return fsc_err(err, errlen, -EINVAL, "resume_step must be below 2^63");
    return 0;
}

/* Whether Hello carries a ModelShape: any shape field, or the optimizer. */
static int model_given(const struct fsc_options *o)
{
    const struct fsc_model_shape *m = &o->model;
    return m->n_layers || m->n_heads || m->n_kv_heads || m->d_model || m->d_head || m->n_experts ||
           m->top_k || m->n_moe_layers || o->optimizer;
}

/* The Hello frame never changes for a client: packed once here (and once
 * more without the token for a recording). */
static int pack_hello(const struct fsc_options *o, int with_token, uint8_t **out, size_t *len)
{
    Foreshock__Hello h = FORESHOCK__HELLO__INIT;
    Foreshock__ModelShape m = FORESHOCK__MODEL_SHAPE__INIT;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    const struct fsc_model_shape *ms = &o->model;

    h.protocol_version = FORESHOCK__PROTOCOL_VERSION__PROTOCOL_VERSION_CURRENT;
    h.run_id = (char *)o->run_id;
    h.has_attempt = 1;
    h.attempt = o->attempt;
    h.rank = o->rank;
    h.world_size = o->world_size;
    if (with_token && o->token && o->token[0])
        h.token = (char *)o->token;
    if (o->detect_from_step) {
        h.has_detect_from_step = 1;
        h.detect_from_step = o->detect_from_step;
    }
    h.client_name = (char *)(o->client_name ? o->client_name : "libforeshock/" FSC_VERSION);
    h.n_local_ranks = o->n_local_ranks;
    h.local_ranks = (uint32_t *)o->local_ranks;
    if (o->advice) {
        h.has_capabilities = 1;
        h.capabilities = FORESHOCK__CAPABILITY__CAPABILITY_ADVICE;
    }
    if (o->resume) {
        h.has_resume_step = 1;
        h.resume_step = o->resume_step;
    }
    if (model_given(o)) {
#define SET(field)                                                                                 \
    do {                                                                                           \
        if (ms->field) {                                                                           \
            m.has_##field = 1;                                                                     \
            m.field = ms->field;                                                                   \
        }                                                                                          \
    } while (0)
        SET(n_layers);
        SET(n_heads);
        SET(n_kv_heads);
        SET(d_model);
        SET(d_head);
        SET(n_experts);
        SET(top_k);
#undef SET
        m.n_moe_layers = ms->n_moe_layers;
        m.moe_layers = (uint32_t *)ms->moe_layers;
        m.optimizer = (char *)o->optimizer;
        h.model = &m;
    }
    f.body_case = FORESHOCK__FRAME__BODY_HELLO;
    f.hello = &h;
    return fsc_wire_pack(&f, out, len);
}

/* ---- lifecycle ------------------------------------------------------------------- */

/* Frees whatever fsc_open got to; `sync` says whether mu/drained exist. */
static void release(fsc_client *c, int sync)
{
    fsc_replay_clear(&c->replay);
    fsc_advice_box_free(&c->advice);
    fsc_io_destroy(c);
    fsc_record_close(&c->rec);
    fsc_tls_free(&c->tls);
    if (sync) {
        pthread_cond_destroy(&c->drained);
        pthread_mutex_destroy(&c->mu);
    }
    if (c->wake_rd >= 0)
        close(c->wake_rd);
    if (c->wake_wr >= 0)
        close(c->wake_wr);
    free(c->hello);
    free(c->host);
    free(c->run_id);
    free(c);
}

static int init_sync(fsc_client *c)
{
    pthread_condattr_t ca;
    int rc;

    if ((rc = pthread_condattr_init(&ca)) != 0)
        return -rc;
    /* Flush deadlines are monotonic: wall-clock jumps must not matter. */
    rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(&c->drained, &ca);
    pthread_condattr_destroy(&ca);
    if (rc != 0)
        return -rc;
    if ((rc = pthread_mutex_init(&c->mu, NULL)) != 0) {
        pthread_cond_destroy(&c->drained);
        return -rc;
    }
    return 0;
}

int fsc_open(const struct fsc_options *in, fsc_client **out, char *err, size_t errlen)
{
    struct fsc_options o;
    fsc_client *c;
    int fds[2], rc, sync = 0;

    if (!out)
        return fsc_err(err, errlen, -EINVAL, "out is NULL");
    *out = NULL;
    if ((rc = copy_options(in, &o, err, errlen)) < 0 || (rc = validate(&o, err, errlen)) < 0)
        return rc;
    c = calloc(1, sizeof(*c));
    if (!c)
        return fsc_err(err, errlen, -ENOMEM, "out of memory");
    c->wake_rd = c->wake_wr = -1;
    fsc_replay_init(&c->replay, o.replay_max_bytes);
    c->host = strdup(o.host);
    c->run_id = strdup(o.run_id);
    rc = -ENOMEM;
    if (!c->host || !c->run_id)
        goto fail;
    c->port = o.port;
    c->attempt = o.attempt;
    c->rank = o.rank;
    c->world_size = o.world_size;
    c->max_report_bytes = o.max_report_bytes;
    c->backoff_min_ms = o.backoff_min_ms;
    c->backoff_max_ms = o.backoff_max_ms;
    c->connect_timeout_ms = o.connect_timeout_ms;
    c->handshake_timeout_ms = o.handshake_timeout_ms;
    c->log = o.log;
    c->log_ctx = o.log_ctx;
    if (!o.record_only && (rc = fsc_tls_init(&c->tls, &o, err, errlen)) < 0) {
        release(c, sync);
        return rc;
    }
    c->advice_on = o.advice && !o.record_only;
    if (c->advice_on && (rc = fsc_advice_box_init(&c->advice)) < 0)
        goto fail;
    if ((rc = pack_hello(&o, 1, &c->hello, &c->hello_len)) < 0)
        goto fail;
    if (o.record_path && o.record_path[0]) {
        uint8_t *h;
        size_t hlen;
        if ((rc = pack_hello(&o, 0, &h, &hlen)) < 0)
            goto fail;
        rc = fsc_record_open(&c->rec, o.record_path, h, hlen, err, errlen);
        free(h);
        if (rc < 0) {
            release(c, sync);
            return rc;
        }
    }
    c->record_only = o.record_only;
    if (pipe(fds) < 0) {
        rc = -errno;
        goto fail;
    }
    c->wake_rd = fds[0];
    c->wake_wr = fds[1];
    if ((rc = fsc_net_nonblock_cloexec(c->wake_rd)) < 0 ||
        (rc = fsc_net_nonblock_cloexec(c->wake_wr)) < 0)
        goto fail;
    if ((rc = init_sync(c)) < 0)
        goto fail;
    sync = 1;
    if (c->record_only) { /* nothing to send: no I/O thread */
        *out = c;
        return 0;
    }
    if ((rc = fsc_io_create(c, o.seed)) < 0)
        goto fail;
    if ((rc = pthread_create(&c->thread, NULL, fsc_io_main, c)) != 0) {
        rc = -rc;
        goto fail;
    }
    *out = c;
    return 0;
fail:
    release(c, sync);
    return fsc_err(err, errlen, rc, "cannot start client: %s", strerror(-rc));
}

/* Queues a packed entry (rc: the packing's result) under the client's
 * mutex: recorded first (the recording is what the trainer produced, even
 * what the replay buffer then refuses), then pushed unless record-only. */
static int submit_entry(fsc_client *c, int rc, struct fsc_entry *e)
{
    pthread_mutex_lock(&c->mu);
    if (rc == 0 && c->failed)
        rc = -EPIPE;
    if (rc == 0 && c->rec.f) {
        int wr = fsc_record_report(&c->rec, e);
        if (wr < 0) {
            fsc_err(c->last_error, sizeof(c->last_error), 0, "recording stopped: write failed: %s",
                    strerror(-wr));
            if (c->log)
                c->log(c->log_ctx, FSC_LOG_ERROR, c->last_error);
        }
    }
    if (rc == 0 && c->record_only) {
        c->submitted++;
    } else if (rc == 0) {
        e->seq = c->submitted + 1;
        rc = fsc_replay_push(&c->replay, e);
        if (rc == 0) {
            c->submitted++;
            e = NULL;
        }
    }
    if (rc < 0) {
        c->dropped++;
        if (rc == -ENOBUFS)
            fsc_err(c->last_error, sizeof(c->last_error), 0,
                    "replay buffer full (%zu bytes): report dropped", c->replay.max_bytes);
        else if (rc == -ERANGE)
            fsc_err(c->last_error, sizeof(c->last_error), 0,
                    "report step not below 2^63 or time not finite (the daemon refuses "
                    "both): dropped");
        else if (rc == -EMSGSIZE)
            fsc_err(c->last_error, sizeof(c->last_error), 0,
                    "report larger than max_report_bytes %zu: dropped", c->max_report_bytes);
    }
    pthread_mutex_unlock(&c->mu);
    free(e);
    if (rc == 0 && !c->record_only)
        fsc_io_wake(c);
    return rc;
}

int fsc_submit(fsc_client *c, fsc_report *r)
{
    struct fsc_entry *e = NULL;
    int rc;

    if (!c) {
        fsc_report_free(r);
        return -EINVAL;
    }
    /* Serialize outside the lock: it copies the whole report. */
    rc = r ? fsc_report_pack(r, 0, c->max_report_bytes, &e) : -EINVAL;
    fsc_report_free(r);
    return submit_entry(c, rc, e);
}

int fsc_submit_packed(fsc_client *c, const void *report, size_t len)
{
    struct fsc_entry *e = NULL;
    Foreshock__Report *m = NULL;
    int rc = 0;

    if (!c)
        return -EINVAL;
    /* The seq field (at most 11 bytes) is replaced, so allow for it. */
    if (!report || len > c->max_report_bytes + 11)
        rc = report ? -EMSGSIZE : -EINVAL;
    else if (!(m = foreshock__report__unpack(NULL, len, report)))
        rc = -EBADMSG;
    else
        rc = fsc_report_pack_msg(m, c->max_report_bytes, &e);
    if (m)
        foreshock__report__free_unpacked(m, NULL);
    return submit_entry(c, rc, e);
}

int fsc_flush(fsc_client *c, int timeout_ms)
{
    struct timespec dl;
    int rc = 0;

    if (!c)
        return -EINVAL;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    if (timeout_ms > 0) {
        dl.tv_sec += timeout_ms / 1000;
        dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&c->mu);
    while (c->replay.count > 0 && !c->failed) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&c->drained, &c->mu);
        } else if (pthread_cond_timedwait(&c->drained, &c->mu, &dl) == ETIMEDOUT) {
            if (c->replay.count > 0 && !c->failed)
                rc = -ETIMEDOUT;
            break;
        }
    }
    if (rc == 0 && c->replay.count > 0)
        rc = -EPIPE;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void fsc_stats(fsc_client *c, struct fsc_stats *s)
{
    struct fsc_stats t = {.size = sizeof(t)};
    size_t n;

    if (!c || !s)
        return;
    n = s->size && s->size < sizeof(t) ? s->size : sizeof(t);
    pthread_mutex_lock(&c->mu);
    t.submitted = c->submitted;
    t.acked = c->acked;
    t.dropped = c->dropped;
    t.sent = c->sent;
    t.resent = c->resent;
    t.reconnects = c->reconnects;
    t.connect_failures = c->connect_failures;
    t.buffered_reports = c->replay.count - c->replay.placeholders;
    t.buffered_bytes = c->replay.bytes;
    t.seq_offset = c->seq_offset;
    t.connected = c->connected;
    t.failed = c->failed;
    t.recorded = c->rec.written;
    t.record_failed = c->rec.failed;
    t.daemon_refused = c->daemon_refused;
    t.advice_received = c->advice.received;
    t.advice_pending = c->advice.n;
    t.advice_taken = c->advice.taken;
    t.advice_dropped = c->advice.dropped;
    memcpy(t.last_error, c->last_error, sizeof(t.last_error));
    pthread_mutex_unlock(&c->mu);
    t.size = n;
    memcpy(s, &t, n);
}

int fsc_close_timeout(fsc_client *c, int timeout_ms)
{
    int rc, rec_rc;

    if (!c)
        return 0;
    rc = fsc_flush(c, timeout_ms);
    pthread_mutex_lock(&c->mu);
    c->closing = 1;
    pthread_mutex_unlock(&c->mu);
    if (!c->record_only) {
        fsc_io_wake(c);
        pthread_join(c->thread, NULL);
    }
    rec_rc = fsc_record_close(&c->rec);
    if (rc == 0)
        rc = rec_rc;
    release(c, 1);
    return rc;
}

void fsc_close(fsc_client *c)
{
    (void)fsc_close_timeout(c, 0);
}
