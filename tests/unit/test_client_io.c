/* libforeshock's I/O thread against a scripted fake daemon: the test thread
 * plays the daemon on a loopback socket, frame by frame, so every protocol
 * path (resume, seq continuation, fatal errors, poison reports, frame limit,
 * Bye) is exercised without the real daemon. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"

/* Bound on every wait for the client, so a broken client fails the test
 * instead of hanging it. */
#define WAIT_MS 30000

struct fake {
    int lfd;
    uint16_t port;
};

static void fake_listen(struct fake *f)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    f->lfd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(f->lfd >= 0);
    cr_assert_eq(bind(f->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(f->lfd, 8), 0);
    cr_assert_eq(getsockname(f->lfd, (struct sockaddr *)&a, &len), 0);
    f->port = ntohs(a.sin_port);
}

static int fake_accept(struct fake *f)
{
    struct pollfd p = {.fd = f->lfd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "the client never connected");
    int fd = accept(f->lfd, NULL, NULL);
    cr_assert(fd >= 0);
    return fd;
}

/* 1 read, 0 EOF. */
static int read_full(int fd, uint8_t *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "the client sent nothing");
        ssize_t k = read(fd, buf + got, n - got);
        if (k == 0)
            return 0;
        cr_assert(k > 0, "read: %s", strerror(errno));
        got += (size_t)k;
    }
    return 1;
}

/* The next frame from the client, or NULL at EOF. */
static Foreshock__Frame *read_frame(int fd)
{
    uint8_t hdr[4];
    if (!read_full(fd, hdr, 4))
        return NULL;
    uint32_t n = (uint32_t)hdr[0] << 24 | (uint32_t)hdr[1] << 16 | (uint32_t)hdr[2] << 8 | hdr[3];
    cr_assert(n > 0 && n < (64u << 20), "frame length %u", n);
    uint8_t *body = malloc(n);
    cr_assert(read_full(fd, body, n), "EOF inside a frame");
    Foreshock__Frame *f = foreshock__frame__unpack(NULL, n, body);
    free(body);
    cr_assert(f, "client frame does not decode");
    return f;
}

static void send_frame(int fd, const Foreshock__Frame *f)
{
    size_t n = foreshock__frame__get_packed_size(f);
    uint8_t *buf = malloc(4 + n);
    buf[0] = (uint8_t)(n >> 24), buf[1] = (uint8_t)(n >> 16), buf[2] = (uint8_t)(n >> 8),
    buf[3] = (uint8_t)n;
    foreshock__frame__pack(f, buf + 4);
    cr_assert_eq(write(fd, buf, 4 + n), (ssize_t)(4 + n));
    free(buf);
}

static void send_welcome(int fd, uint64_t last_seq, uint32_t max_frame)
{
    Foreshock__Welcome w = FORESHOCK__WELCOME__INIT;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    w.protocol_version = 1;
    w.last_seq = last_seq;
    w.server_version = "fake";
    w.max_frame_bytes = max_frame;
    f.body_case = FORESHOCK__FRAME__BODY_WELCOME;
    f.welcome = &w;
    send_frame(fd, &f);
}

static void send_ack(int fd, uint64_t seq)
{
    Foreshock__Ack a = FORESHOCK__ACK__INIT;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    a.seq = seq;
    f.body_case = FORESHOCK__FRAME__BODY_ACK;
    f.ack = &a;
    send_frame(fd, &f);
}

/* Error{code, msg}, and Error.seq when seq > 0. */
static void send_error_seq(int fd, Foreshock__ErrorCode code, const char *msg, uint64_t seq)
{
    Foreshock__Error e = FORESHOCK__ERROR__INIT;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    e.code = code;
    e.message = (char *)msg;
    e.has_seq = seq > 0;
    e.seq = seq;
    f.body_case = FORESHOCK__FRAME__BODY_ERROR;
    f.error = &e;
    send_frame(fd, &f);
}

static void send_error(int fd, Foreshock__ErrorCode code, const char *msg)
{
    send_error_seq(fd, code, msg, 0);
}

/* Accepts a connection and checks its Hello; returns the socket. */
static int accept_hello(struct fake *fk)
{
    int fd = fake_accept(fk);
    Foreshock__Frame *f = read_frame(fd);
    cr_assert(f && f->body_case == FORESHOCK__FRAME__BODY_HELLO, "expected Hello");
    foreshock__frame__free_unpacked(f, NULL);
    return fd;
}

/* Reads one Report and returns its seq (and step). */
static uint64_t read_report(int fd, uint64_t *step)
{
    Foreshock__Frame *f = read_frame(fd);
    cr_assert(f, "EOF, expected a Report");
    cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_REPORT);
    uint64_t seq = f->report->seq;
    if (step)
        *step = f->report->step;
    foreshock__frame__free_unpacked(f, NULL);
    return seq;
}

/* Reads the placeholder of a refused report: its seq and step, nothing
 * else. Returns the seq. */
static uint64_t read_placeholder(int fd, uint64_t want_step)
{
    Foreshock__Frame *f = read_frame(fd);
    cr_assert(f, "EOF, expected a placeholder Report");
    cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_REPORT);
    const Foreshock__Report *r = f->report;
    cr_expect_eq(r->step, want_step);
    cr_expect(!r->scalars && !r->n_attention && !r->n_router_gram && !r->n_router_tokens,
              "a placeholder carries nothing but its step");
    uint64_t seq = r->seq;
    foreshock__frame__free_unpacked(f, NULL);
    return seq;
}

/* Nothing more is waiting on fd right now (a short look, not a timing claim:
 * a correct client never sends here, a broken one usually already has). */
static int quiet(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 100) == 0;
}

struct logs {
    atomic_int errors, warnings;
};

static void count_log(void *ctx, int level, const char *msg)
{
    struct logs *l = ctx;
    (void)msg;
    if (level == FSC_LOG_ERROR)
        atomic_fetch_add(&l->errors, 1);
    else if (level == FSC_LOG_WARN)
        atomic_fetch_add(&l->warnings, 1);
}

static fsc_client *open_client(struct fake *fk, size_t replay_bytes, struct logs *logs)
{
    struct fsc_options o;
    fsc_client *c = NULL;
    char err[FSC_ERROR_LEN];
    fsc_options_init(&o);
    o.port = fk->port;
    o.run_id = "io-test";
    o.attempt = 2;
    o.rank = 1;
    o.world_size = 4;
    o.backoff_min_ms = 5;
    o.backoff_max_ms = 40;
    if (replay_bytes)
        o.replay_max_bytes = replay_bytes;
    if (logs) {
        o.log = count_log;
        o.log_ctx = logs;
    }
    cr_assert_eq(fsc_open(&o, &c, err, sizeof(err)), 0, "%s", err);
    return c;
}

static int submit_step(fsc_client *c, uint64_t step, uint32_t dh)
{
    fsc_report *r = fsc_report_new(step);
    cr_assert(r);
    fsc_report_set_loss(r, 1.0 / (double)(step + 1));
    if (dh) {
        size_t tri = fsc_tri_len(2 * (size_t)dh);
        float *g = calloc(tri, sizeof(float));
        cr_assert_eq(fsc_report_add_attention_gram(r, 0, 0, FSC_KV_HEAD_NONE, 1, dh, 0, 1, g, g),
                     0);
        free(g);
    }
    return fsc_submit(c, r);
}

static struct fsc_stats stats(fsc_client *c)
{
    struct fsc_stats s = {.size = sizeof(s)};
    fsc_stats(c, &s);
    return s;
}

/* Accepts the client's connection, reads its Hello and answers Welcome. */
static int accept_welcome(struct fake *fk, uint64_t last_seq, uint32_t max_frame)
{
    int fd = accept_hello(fk);
    send_welcome(fd, last_seq, max_frame);
    return fd;
}

/* An Error that is neither fatal nor about one report (no seq): the client
 * reconnects and resends; nothing is dropped, refused or failed. */
static void error_reconnects_and_resends(Foreshock__ErrorCode code, const char *msg)
{
    struct fake fk;
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, NULL);
    cr_assert_eq(submit_step(c, 0, 0), 0);
    int fd = accept_welcome(&fk, 0, 1u << 20);
    cr_expect_eq(read_report(fd, NULL), 1);
    send_error(fd, code, msg);
    close(fd);
    fd = accept_welcome(&fk, 0, 1u << 20);
    cr_expect_eq(read_report(fd, NULL), 1);
    send_ack(fd, 1);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.failed, 0);
    cr_expect_eq(s.dropped, 0);
    cr_expect_eq(s.daemon_refused, 0);
    cr_expect_eq(s.acked, 1);
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

Test(client_io, hello_carries_the_stream_identity)
{
    struct fake fk;
    struct fsc_options o;
    fsc_client *c;
    uint32_t moe[2] = {1, 3};
    fake_listen(&fk);
    fsc_options_init(&o);
    o.port = fk.port;
    o.run_id = "exp-7.a:b_c";
    o.attempt = 3;
    o.rank = 2;
    o.world_size = 8;
    o.token = "sekrit";
    o.detect_from_step = 500;
    o.model = (struct fsc_model_shape){.n_layers = 12,
                                       .n_heads = 8,
                                       .d_model = 512,
                                       .d_head = 64,
                                       .n_experts = 16,
                                       .top_k = 2,
                                       .moe_layers = moe,
                                       .n_moe_layers = 2};
    cr_assert_eq(fsc_open(&o, &c, NULL, 0), 0);
    int fd = fake_accept(&fk);
    Foreshock__Frame *f = read_frame(fd);
    cr_assert(f && f->body_case == FORESHOCK__FRAME__BODY_HELLO);
    Foreshock__Hello *h = f->hello;
    cr_expect_eq(h->protocol_version, 1);
    cr_expect_str_eq(h->run_id, "exp-7.a:b_c");
    cr_expect(h->has_attempt && h->attempt == 3);
    cr_expect(h->rank == 2 && h->world_size == 8);
    cr_expect_str_eq(h->token, "sekrit");
    cr_expect(h->has_detect_from_step && h->detect_from_step == 500);
    cr_expect_str_eq(h->client_name, "libforeshock/" FSC_VERSION);
    cr_assert(h->model);
    cr_expect(h->model->n_layers == 12 && h->model->d_head == 64 && h->model->top_k == 2);
    cr_expect(!h->model->has_n_kv_heads);
    cr_expect(h->model->n_moe_layers == 2 && h->model->moe_layers[1] == 3);
    foreshock__frame__free_unpacked(f, NULL);
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

/* options.optimizer travels in Hello's ModelShape, also when it is the only
 * shape field set; without it and without a shape no ModelShape is sent. */
Test(client_io, hello_carries_the_optimizer)
{
    static const struct {
        const char *optimizer;
        uint32_t n_layers;
    } cases[] = {{"AdamW", 0}, {"My \"Lion\" \\ v2", 6}, {NULL, 6}, {NULL, 0}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct fake fk;
        struct fsc_options o;
        fsc_client *c;
        char err[FSC_ERROR_LEN] = "";
        fake_listen(&fk);
        fsc_options_init(&o);
        o.port = fk.port;
        o.run_id = "opt";
        o.model.n_layers = cases[i].n_layers;
        o.optimizer = cases[i].optimizer;
        cr_assert_eq(fsc_open(&o, &c, err, sizeof(err)), 0, "case %zu: %s", i, err);
        int fd = fake_accept(&fk);
        Foreshock__Frame *f = read_frame(fd);
        cr_assert(f && f->body_case == FORESHOCK__FRAME__BODY_HELLO, "case %zu", i);
        const Foreshock__ModelShape *m = f->hello->model;
        if (!cases[i].optimizer && !cases[i].n_layers) {
            cr_expect_null(m, "case %zu: a ModelShape with nothing in it", i);
        } else {
            cr_assert_not_null(m, "case %zu: no ModelShape", i);
            cr_expect_eq(m->has_n_layers, cases[i].n_layers != 0, "case %zu", i);
            if (cases[i].optimizer)
                cr_expect_str_eq(m->optimizer, cases[i].optimizer, "case %zu", i);
            else
                cr_expect_null(m->optimizer, "case %zu", i);
        }
        foreshock__frame__free_unpacked(f, NULL);
        close(fd);
        fsc_close(c);
        close(fk.lfd);
    }
}

/* The replay bound: past replay_max_bytes, fsc_submit drops and counts,
 * and the seqs that reach the daemon stay dense. */
Test(client_io, replay_bound_drops_and_keeps_seqs_dense)
{
    struct fake fk;
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, FSC_MIN_REPLAY_BYTES, NULL);
    uint64_t accepted = 0, refused = 0;

    /* No Welcome yet, so nothing leaves the buffer. */
    for (uint64_t step = 0; step < 40; step++) {
        int rc = submit_step(c, step, 16); /* ~4 KiB each */
        if (rc == 0)
            accepted++;
        else {
            cr_assert_eq(rc, -ENOBUFS);
            refused++;
        }
    }
    cr_assert(accepted > 0 && refused > 0, "accepted %llu refused %llu",
              (unsigned long long)accepted, (unsigned long long)refused);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.submitted, accepted);
    cr_expect_eq(s.dropped, refused);
    cr_expect_eq(s.buffered_reports, accepted);
    cr_expect(s.buffered_bytes <= FSC_MIN_REPLAY_BYTES);
    cr_expect_str_eq(s.last_error, "replay buffer full (65536 bytes): report dropped");

    int fd = accept_welcome(&fk, 0, 1u << 20);
    for (uint64_t seq = 1; seq <= accepted; seq++)
        cr_assert_eq(read_report(fd, NULL), seq, "seqs must be dense");
    send_ack(fd, accepted);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    /* Room again: the next report gets the next seq. */
    cr_assert_eq(submit_step(c, 99, 0), 0);
    cr_expect_eq(read_report(fd, NULL), accepted + 1);
    send_ack(fd, accepted + 1);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    s = stats(c);
    cr_expect_eq(s.acked, accepted + 1);
    cr_expect_eq(s.buffered_reports, 0);
    cr_expect_eq(s.connected, 1);
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

/* A reconnect resends only what Welcome says is not committed. */
Test(client_io, reconnect_resumes_from_welcome)
{
    struct fake fk;
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, NULL);
    for (uint64_t step = 0; step < 5; step++)
        cr_assert_eq(submit_step(c, step, 0), 0);

    int fd = accept_welcome(&fk, 0, 1u << 20);
    for (uint64_t seq = 1; seq <= 5; seq++)
        cr_assert_eq(read_report(fd, NULL), seq);
    send_ack(fd, 2);
    close(fd); /* the "daemon" crashes; it had committed 3 without acking */

    fd = accept_welcome(&fk, 3, 1u << 20);
    uint64_t step;
    cr_expect_eq(read_report(fd, &step), 4);
    cr_expect_eq(step, 3);
    cr_expect_eq(read_report(fd, NULL), 5);
    cr_assert_eq(submit_step(c, 5, 0), 0);
    cr_expect_eq(read_report(fd, NULL), 6);
    send_ack(fd, 6);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.submitted, 6);
    cr_expect_eq(s.acked, 6);
    cr_expect_eq(s.reconnects, 1);
    cr_expect_eq(s.sent, 8);
    cr_expect_eq(s.resent, 2);
    cr_expect_eq(s.dropped, 0);
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

/* A new process on a stream that already has committed reports continues
 * the numbering instead of being ignored as duplicates. */
Test(client_io, first_welcome_sets_the_seq_offset)
{
    struct fake fk;
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, NULL);
    cr_assert_eq(submit_step(c, 0, 0), 0);
    cr_assert_eq(submit_step(c, 1, 0), 0);

    int fd = accept_welcome(&fk, 100, 1u << 20);
    cr_expect_eq(read_report(fd, NULL), 101);
    cr_expect_eq(read_report(fd, NULL), 102);
    send_ack(fd, 101);
    close(fd);
    /* A later Welcome does not move the offset again. */
    fd = accept_welcome(&fk, 101, 1u << 20);
    cr_expect_eq(read_report(fd, NULL), 102);
    send_ack(fd, 102);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.seq_offset, 100);
    cr_expect_eq(s.acked, 2);
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

Test(client_io, auth_error_is_fatal)
{
    struct fake fk;
    struct logs logs = {0};
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, &logs);
    cr_assert_eq(submit_step(c, 0, 0), 0);
    int fd = accept_hello(&fk);
    send_error(fd, FORESHOCK__ERROR_CODE__ERROR_AUTH, "bad token");
    cr_expect_null(read_frame(fd), "client should close after a fatal error");
    close(fd);
    cr_expect_eq(fsc_flush(c, WAIT_MS), -EPIPE);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.failed, 1);
    cr_expect_eq(s.connected, 0);
    cr_expect(strstr(s.last_error, "bad token"), "last_error: %s", s.last_error);
    cr_expect_eq(submit_step(c, 1, 0), -EPIPE);
    cr_expect_eq(stats(c).dropped, 1);
    cr_expect_eq(atomic_load(&logs.errors), 1);
    fsc_close(c);
    close(fk.lfd);
}

/* Other errors reconnect. */
Test(client_io, internal_error_reconnects)
{
    error_reconnects_and_resends(FORESHOCK__ERROR_CODE__ERROR_INTERNAL, "disk full");
}

/* A report the daemon refuses without naming it is found by sending one at
 * a time after the error, dropped and counted; its seq goes as a
 * placeholder (the daemon takes seqs only in order); the stream then goes
 * on at full speed. */
Test(client_io, refused_report_is_isolated_and_replaced)
{
    struct fake fk;
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, NULL);
    for (uint64_t step = 0; step < 3; step++)
        cr_assert_eq(submit_step(c, step, 0), 0);

    int fd = accept_welcome(&fk, 0, 1u << 20);
    for (uint64_t seq = 1; seq <= 3; seq++)
        cr_assert_eq(read_report(fd, NULL), seq);
    send_error(fd, FORESHOCK__ERROR_CODE__ERROR_MALFORMED, "report 2 is bad");
    close(fd);

    fd = accept_welcome(&fk, 0, 1u << 20);
    cr_expect_eq(read_report(fd, NULL), 1);
    cr_expect(quiet(fd), "probing: only one report may be in flight");
    send_ack(fd, 1);
    cr_expect_eq(read_report(fd, NULL), 2);
    send_error(fd, FORESHOCK__ERROR_CODE__ERROR_MALFORMED, "report 2 is bad");
    close(fd);

    fd = accept_welcome(&fk, 1, 1u << 20);
    cr_expect_eq(read_placeholder(fd, 1), 2);
    send_ack(fd, 2);
    cr_expect_eq(read_report(fd, NULL), 3);
    send_ack(fd, 3);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    /* Past the suspects: back to streaming without waiting for acks. */
    cr_assert_eq(submit_step(c, 3, 0), 0);
    cr_assert_eq(submit_step(c, 4, 0), 0);
    cr_expect_eq(read_report(fd, NULL), 4);
    cr_expect_eq(read_report(fd, NULL), 5);
    send_ack(fd, 5);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.dropped, 1);
    cr_expect_eq(s.daemon_refused, 1);
    cr_expect_eq(s.acked, 4, "a placeholder's ack is not a report's");
    cr_expect_eq(s.submitted, 5);
    cr_expect(strstr(s.last_error, "seq 2"), "last_error: %s", s.last_error);
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

/* A report above Welcome.max_frame_bytes is never sent: its placeholder is. */
Test(client_io, report_above_daemon_frame_limit_goes_as_placeholder)
{
    struct fake fk;
    struct logs logs = {0};
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, &logs);
    cr_assert_eq(submit_step(c, 0, 16), 0); /* ~4 KiB */
    cr_assert_eq(submit_step(c, 1, 0), 0);  /* a few bytes */
    int fd = accept_welcome(&fk, 0, 1024);
    cr_expect_eq(read_placeholder(fd, 0), 1);
    cr_expect_eq(read_report(fd, NULL), 2);
    send_ack(fd, 2);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.dropped, 1);
    cr_expect_eq(s.daemon_refused, 1);
    cr_expect_eq(s.acked, 1);
    cr_expect_eq(s.reconnects, 0);
    cr_expect(strstr(s.last_error, "max_frame_bytes 1024"), "last_error: %s", s.last_error);
    cr_expect_eq(atomic_load(&logs.warnings), 1, "logged once");
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

/* Error{LIMIT, seq}: the daemon names the report it will never take. It is
 * replaced at once (no probing), the rest streams on; counted and logged
 * once. */
Test(client_io, named_refusal_is_replaced_without_probing)
{
    struct fake fk;
    struct logs logs = {0};
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, &logs);
    for (uint64_t step = 0; step < 3; step++)
        cr_assert_eq(submit_step(c, step, 0), 0);
    int fd = accept_welcome(&fk, 0, 1u << 20);
    for (uint64_t seq = 1; seq <= 3; seq++)
        cr_assert_eq(read_report(fd, NULL), seq);
    send_ack(fd, 1);
    send_error_seq(fd, FORESHOCK__ERROR_CODE__ERROR_LIMIT, "report has too many sketches", 2);
    close(fd);

    fd = accept_welcome(&fk, 1, 1u << 20);
    cr_expect_eq(read_placeholder(fd, 1), 2);
    cr_expect_eq(read_report(fd, NULL), 3, "no probing: 3 follows without an ack");
    send_ack(fd, 3);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.dropped, 1);
    cr_expect_eq(s.daemon_refused, 1);
    cr_expect_eq(s.acked, 2);
    cr_expect_eq(s.buffered_reports, 0);
    cr_expect_eq(s.reconnects, 1);
    cr_expect(strstr(s.last_error, "seq 2") && strstr(s.last_error, "too many sketches"),
              "last_error: %s", s.last_error);
    cr_expect_eq(atomic_load(&logs.warnings), 1, "logged once");
    close(fd);
    fsc_close(c);
    close(fk.lfd);
}

/* ERROR_LIMIT without a seq is about the connection (a deadline, the
 * connection limit): reconnect and resend, drop nothing. */
Test(client_io, limit_without_seq_reconnects_and_resends)
{
    error_reconnects_and_resends(FORESHOCK__ERROR_CODE__ERROR_LIMIT,
                                 "frame unfinished after 120 s");
}

static void *closer(void *c)
{
    return (void *)(intptr_t)fsc_close_timeout(c, WAIT_MS);
}

Test(client_io, close_flushes_then_says_bye)
{
    struct fake fk;
    pthread_t th;
    void *rc;
    fake_listen(&fk);
    fsc_client *c = open_client(&fk, 0, NULL);
    cr_assert_eq(submit_step(c, 0, 0), 0);
    int fd = accept_welcome(&fk, 0, 1u << 20);
    cr_assert_eq(pthread_create(&th, NULL, closer, c), 0);
    cr_expect_eq(read_report(fd, NULL), 1);
    send_ack(fd, 1); /* the close's flush completes, then Bye */
    Foreshock__Frame *f = read_frame(fd);
    cr_assert(f, "expected Bye, got EOF");
    cr_expect_eq(f->body_case, FORESHOCK__FRAME__BODY_BYE);
    foreshock__frame__free_unpacked(f, NULL);
    cr_expect_null(read_frame(fd), "client half-closes after Bye");
    close(fd);
    pthread_join(th, &rc);
    cr_expect_eq((intptr_t)rc, 0);
    close(fk.lfd);
}

Test(client_io, flush_times_out_without_a_daemon)
{
    struct fake fk;
    fake_listen(&fk);
    close(fk.lfd); /* the port is free now: connections are refused */
    fsc_client *c = open_client(&fk, 0, NULL);
    cr_assert_eq(submit_step(c, 0, 0), 0);
    cr_expect_eq(fsc_flush(c, 50), -ETIMEDOUT);
    cr_expect_eq(fsc_flush(c, 0), -ETIMEDOUT);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.connected, 0);
    cr_expect_eq(s.acked, 0);
    cr_expect_eq(s.buffered_reports, 1);
    cr_expect_eq(fsc_close_timeout(c, 0), -ETIMEDOUT);
}

/* A fake daemon that acks every report at once until Bye or EOF. */
struct acker {
    struct fake *fk;
    uint64_t reports;
    int saw_bye;
};

static void *acker_main(void *arg)
{
    struct acker *a = arg;
    int fd = accept_welcome(a->fk, 0, 1u << 20);
    Foreshock__Frame *f;

    while ((f = read_frame(fd))) {
        if (f->body_case == FORESHOCK__FRAME__BODY_REPORT) {
            a->reports++;
            send_ack(fd, f->report->seq);
        } else if (f->body_case == FORESHOCK__FRAME__BODY_BYE) {
            a->saw_bye = 1;
        }
        foreshock__frame__free_unpacked(f, NULL);
        if (a->saw_bye)
            break;
    }
    close(fd);
    return NULL;
}

struct racer {
    struct fake fk;
    struct acker a;
    pthread_t acker;
    int close_rc;
};

static void *racer_main(void *arg)
{
    struct racer *r = arg;
    fsc_client *c = open_client(&r->fk, 0, NULL);
    for (uint64_t step = 0; step < 5000; step++)
        if (submit_step(c, step, 0) != 0)
            break;
    r->close_rc = fsc_close_timeout(c, WAIT_MS);
    return NULL;
}

/* Fast submits from several clients at once race the I/O threads' wakeups;
 * a lost wakeup shows as a close that never returns (the test's timeout). */
Test(client_io, close_after_fast_submits_never_hangs, .timeout = 120)
{
    enum { CLIENTS = 8, ROUNDS = 4 };
    for (int round = 0; round < ROUNDS; round++) {
        struct racer r[CLIENTS];
        pthread_t th[CLIENTS];
        memset(r, 0, sizeof(r));
        for (int i = 0; i < CLIENTS; i++) {
            fake_listen(&r[i].fk);
            r[i].a.fk = &r[i].fk;
            cr_assert_eq(pthread_create(&r[i].acker, NULL, acker_main, &r[i].a), 0);
            cr_assert_eq(pthread_create(&th[i], NULL, racer_main, &r[i]), 0);
        }
        for (int i = 0; i < CLIENTS; i++) {
            pthread_join(th[i], NULL);
            pthread_join(r[i].acker, NULL);
            cr_expect_eq(r[i].close_rc, 0, "round %d client %d", round, i);
            cr_expect_eq(r[i].a.reports, 5000, "round %d client %d", round, i);
            cr_expect(r[i].a.saw_bye, "round %d client %d", round, i);
            close(r[i].fk.lfd);
        }
    }
}
