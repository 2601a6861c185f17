/* ingest.c against real loopback sockets: the conversation, protocol errors
 * (Error then close), the connection limit, backpressure, orderly stop. The
 * loop runs in a thread of the test process; the test is the client. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "decode.h"
#include "ingest.h"
#include "store.h"

#define E(x) FORESHOCK__ERROR_CODE__ERROR_##x

struct server {
    char dir[64], path[128];
    struct fs_stats stats;
    struct store *store;
    struct ingest_opts io;
    struct ingest *ing;
    uv_loop_t loop;
    uv_async_t stopper;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started;       /* 1 ok, -1 failed */
    int loop_close_rc; /* checked by the test thread: Criterion asserts there only */
    uint16_t port;
};

static void on_stopped(void *ctx)
{
    struct server *sv = ctx;
    uv_close((uv_handle_t *)&sv->stopper, NULL);
}

static void on_stop(uv_async_t *a)
{
    struct server *sv = a->data;
    ingest_stop(sv->ing, on_stopped, sv);
}

static void *loop_main(void *arg)
{
    struct server *sv = arg;
    struct fs_err err = {0};
    uv_loop_init(&sv->loop);
    uv_async_init(&sv->loop, &sv->stopper, on_stop);
    sv->stopper.data = sv;
    int rc = ingest_start(&sv->loop, &sv->io, &sv->ing, &err);
    pthread_mutex_lock(&sv->mu);
    sv->started = rc == 0 ? 1 : -1;
    if (rc == 0)
        sv->port = ingest_port(sv->ing);
    pthread_cond_signal(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
    if (rc != 0) {
        uv_close((uv_handle_t *)&sv->stopper, NULL);
        uv_run(&sv->loop, UV_RUN_DEFAULT);
        uv_loop_close(&sv->loop);
        return NULL;
    }
    uv_run(&sv->loop, UV_RUN_DEFAULT);
    ingest_free(sv->ing);
    sv->loop_close_rc = uv_loop_close(&sv->loop);
    return NULL;
}

/* Starts store + ingest; tweak(opts) may change limits before start. */
static void server_start(struct server *sv, uint64_t queue_items, uint64_t batch,
                         uint64_t max_conns, const char *token)
{
    memset(sv, 0, sizeof(*sv));
    snprintf(sv->dir, sizeof(sv->dir), "/tmp/fs-ingest-XXXXXX");
    cr_assert_not_null(mkdtemp(sv->dir));
    snprintf(sv->path, sizeof(sv->path), "%s/t.db", sv->dir);
    struct store_opts so = {.max_runs = 10,
                            .queue_max_items = queue_items,
                            .queue_max_bytes = 1 << 24,
                            .batch_max_items = batch,
                            .stats = &sv->stats};
    struct fs_err err = {0};
    cr_assert_eq(store_open(sv->path, &so, &sv->store, &err), 0, "%s", err.msg);
    sv->io = (struct ingest_opts){.host = "127.0.0.1",
                                  .port = 0,
                                  .max_connections = max_conns,
                                  .max_conn_buffer_bytes = 1 << 20,
                                  .token = token,
                                  .store = sv->store,
                                  .stats = &sv->stats};
    decode_limits_default(&sv->io.limits, 1 << 20);
    pthread_mutex_init(&sv->mu, NULL);
    pthread_cond_init(&sv->cv, NULL);
    cr_assert_eq(pthread_create(&sv->thread, NULL, loop_main, sv), 0);
    pthread_mutex_lock(&sv->mu);
    while (!sv->started)
        pthread_cond_wait(&sv->cv, &sv->mu);
    pthread_mutex_unlock(&sv->mu);
    cr_assert_eq(sv->started, 1, "ingest_start failed");
}

static void server_stop(struct server *sv)
{
    uv_async_send(&sv->stopper);
    pthread_join(sv->thread, NULL);
    cr_expect_eq(sv->loop_close_rc, 0, "handles left on the loop");
    store_close(sv->store);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", sv->dir);
    cr_expect_eq(system(cmd), 0);
}

/* --- a blocking client ------------------------------------------------------ */

static int client(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0, "connect: %s", strerror(errno));
    struct timeval tv = {.tv_sec = 60};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

static void send_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        cr_assert_gt(w, 0, "send: %s", strerror(errno));
        b += w;
        n -= (size_t)w;
    }
}

static void send_frame(int fd, const Foreshock__Frame *f)
{
    uint8_t *buf;
    size_t n;
    cr_assert_eq(decode_encode(f, &buf, &n), 0);
    send_all(fd, buf, n);
    free(buf);
}

static int read_all(int fd, uint8_t *p, size_t n)
{
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Next frame from the daemon, or NULL at EOF. */
static Foreshock__Frame *recv_frame(int fd)
{
    uint8_t hdr[4];
    if (read_all(fd, hdr, 4) < 0)
        return NULL;
    struct decode_limits lim;
    decode_limits_default(&lim, 1 << 20);
    uint32_t len;
    struct fs_err err;
    cr_assert_eq(decode_prefix(hdr, &lim, &len, &err), 0);
    uint8_t *body = malloc(len);
    cr_assert_eq(read_all(fd, body, len), 0, "EOF inside a frame");
    Foreshock__Frame *f;
    cr_assert_eq(decode_frame(body, len, &lim, &f, NULL, &err), 0, "%s", err.msg);
    free(body);
    return f;
}

static void send_hello(int fd, const char *run, uint32_t version, const char *token)
{
    Foreshock__Hello h = FORESHOCK__HELLO__INIT;
    h.protocol_version = version;
    h.run_id = (char *)run;
    h.world_size = 1;
    h.token = (char *)token;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_HELLO;
    f.hello = &h;
    send_frame(fd, &f);
}

static void send_report(int fd, uint64_t seq)
{
    Foreshock__Scalars s = FORESHOCK__SCALARS__INIT;
    s.has_loss = 1;
    s.loss = 1.0 / (double)seq;
    Foreshock__Report r = FORESHOCK__REPORT__INIT;
    r.seq = seq;
    r.step = seq;
    r.scalars = &s;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_REPORT;
    f.report = &r;
    send_frame(fd, &f);
}

static uint64_t expect_welcome(int fd)
{
    Foreshock__Frame *f = recv_frame(fd);
    cr_assert_not_null(f, "closed instead of Welcome");
    cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_WELCOME, "got body %d", f->body_case);
    cr_expect_eq(f->welcome->max_frame_bytes, 1u << 20);
    uint64_t seq = f->welcome->last_seq;
    decode_frame_free(f);
    return seq;
}

/* Reads Acks until one says seq (or EOF); returns the last acked seq. */
static uint64_t read_acks(int fd, uint64_t until)
{
    uint64_t last = 0;
    while (last < until) {
        Foreshock__Frame *f = recv_frame(fd);
        if (!f)
            break;
        cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_ACK, "got body %d", f->body_case);
        cr_expect_geq(f->ack->seq, last, "acks went backwards");
        last = f->ack->seq;
        decode_frame_free(f);
    }
    return last;
}

static void expect_error_then_eof(int fd, int code, const char *name)
{
    Foreshock__Frame *f = recv_frame(fd);
    while (f && f->body_case == FORESHOCK__FRAME__BODY_WELCOME) {
        decode_frame_free(f);
        f = recv_frame(fd);
    }
    cr_assert_not_null(f, "%s: closed without Error", name);
    cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_ERROR, "%s: body %d", name, f->body_case);
    cr_expect_eq(f->error->code, code, "%s: code %d (%s)", name, f->error->code, f->error->message);
    cr_expect(f->error->message[0] != '\0', "%s: empty message", name);
    decode_frame_free(f);
    shutdown(fd, SHUT_WR); /* the daemon drains until our EOF, then closes */
    cr_expect_null(recv_frame(fd), "%s: not closed after Error", name);
}

Test(ingest, conversation)
{
    struct server sv;
    server_start(&sv, 1000, 64, 16, NULL);
    int fd = client(sv.port);
    send_hello(fd, "conv", 1, NULL);
    cr_expect_eq(expect_welcome(fd), 0);
    for (uint64_t s = 1; s <= 20; s++)
        send_report(fd, s);
    cr_expect_eq(read_acks(fd, 20), 20);
    Foreshock__Bye b = FORESHOCK__BYE__INIT;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_BYE;
    f.bye = &b;
    send_frame(fd, &f);
    cr_expect_null(recv_frame(fd), "not closed after Bye");
    close(fd);
    /* Reconnect: Welcome carries the resume point. */
    fd = client(sv.port);
    send_hello(fd, "conv", 1, NULL);
    cr_expect_eq(expect_welcome(fd), 20);
    close(fd);
    cr_expect_eq(atomic_load(&sv.stats.reports_in), 20);
    cr_expect_geq(atomic_load(&sv.stats.acks_out), 1);
    server_stop(&sv);
}

struct error_case {
    const char *name;
    const uint8_t *raw; /* sent as is when non-NULL */
    size_t rawlen;
    int hello_first;   /* a valid Hello (and its Welcome) first */
    int hello_version; /* a Hello with this version (0: none) */
    const char *token; /* token in that Hello */
    int then;          /* 1: Report, 2: Ack, 3: second Hello */
    int code;
};

static const uint8_t zero_len[] = {0, 0, 0, 0};
static const uint8_t huge_len[] = {0xff, 0xff, 0xff, 0xff};
static const uint8_t garbage[] = {0, 0, 0, 6, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

Test(ingest, protocol_errors_table)
{
    const struct error_case cases[] = {
        {"zero length", zero_len, sizeof(zero_len), 0, 0, NULL, 0, E(TOO_LARGE)},
        {"oversized length", huge_len, sizeof(huge_len), 0, 0, NULL, 0, E(TOO_LARGE)},
        {"garbage", garbage, sizeof(garbage), 0, 0, NULL, 0, E(MALFORMED)},
        {"wrong version", NULL, 0, 0, 2, "tok", 0, E(PROTOCOL_VERSION)},
        {"wrong token", NULL, 0, 0, 1, "nope", 0, E(AUTH)},
        {"missing token", NULL, 0, 0, 1, NULL, 0, E(AUTH)},
        {"report before hello", NULL, 0, 0, 0, NULL, 1, E(SEQUENCE)},
        {"ack from a client", NULL, 0, 0, 0, NULL, 2, E(SEQUENCE)},
        {"second hello", NULL, 0, 1, 0, NULL, 3, E(SEQUENCE)},
    };
    struct server sv;
    server_start(&sv, 1000, 64, 64, "tok");
    int good = client(sv.port);
    send_hello(good, "good", 1, "tok");
    expect_welcome(good);
    uint64_t seq = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct error_case *c = &cases[i];
        int fd = client(sv.port);
        if (c->raw)
            send_all(fd, c->raw, c->rawlen);
        if (c->hello_first)
            send_hello(fd, "bad", 1, "tok");
        if (c->hello_version)
            send_hello(fd, "bad", (uint32_t)c->hello_version, c->token);
        if (c->then == 1)
            send_report(fd, 1);
        if (c->then == 3)
            send_hello(fd, "bad", 1, "tok");
        if (c->then == 2) {
            Foreshock__Ack a = FORESHOCK__ACK__INIT;
            Foreshock__Frame f = FORESHOCK__FRAME__INIT;
            f.body_case = FORESHOCK__FRAME__BODY_ACK;
            f.ack = &a;
            send_frame(fd, &f);
        }
        expect_error_then_eof(fd, c->code, c->name);
        close(fd);
        /* The well-behaved connection is unaffected. */
        send_report(good, ++seq);
        cr_expect_eq(read_acks(good, seq), seq, "%s: good connection stalled", c->name);
    }
    close(good);
    cr_expect_geq(atomic_load(&sv.stats.protocol_errors), sizeof(cases) / sizeof(cases[0]));
    server_stop(&sv);
}

Test(ingest, connection_limit)
{
    struct server sv;
    server_start(&sv, 1000, 64, 1, NULL);
    int a = client(sv.port);
    send_hello(a, "lim", 1, NULL);
    expect_welcome(a);
    int b = client(sv.port);
    expect_error_then_eof(b, E(LIMIT), "second connection");
    close(b);
    cr_expect_eq(atomic_load(&sv.stats.connections_rejected), 1);
    send_report(a, 1);
    cr_expect_eq(read_acks(a, 1), 1);
    close(a);
    server_stop(&sv);
}

/* A queue of 2 items committed one per transaction: the loop outruns the
 * writer and must pause and resume without losing or reordering anything. */
Test(ingest, backpressure_loses_nothing)
{
    struct server sv;
    server_start(&sv, 2, 1, 16, NULL);
    enum { N = 300, CLIENTS = 3 };
    int fds[CLIENTS];
    for (int k = 0; k < CLIENTS; k++) {
        char run[16];
        snprintf(run, sizeof(run), "bp%d", k);
        fds[k] = client(sv.port);
        send_hello(fds[k], run, 1, NULL);
        expect_welcome(fds[k]);
    }
    for (uint64_t s = 1; s <= N; s++)
        for (int k = 0; k < CLIENTS; k++)
            send_report(fds[k], s);
    for (int k = 0; k < CLIENTS; k++) {
        cr_expect_eq(read_acks(fds[k], N), N, "client %d", k);
        close(fds[k]);
    }
    cr_expect_eq(atomic_load(&sv.stats.reports_committed), (uint64_t)N * CLIENTS);
    server_stop(&sv);
}

/* Stopping with reports in flight: everything the daemon acked is
 * committed, everything it committed for the connection was acked, and the
 * connection is closed. */
Test(ingest, stop_acks_what_it_committed)
{
    struct server sv;
    server_start(&sv, 1000, 8, 16, NULL);
    int fd = client(sv.port);
    send_hello(fd, "stop", 1, NULL);
    expect_welcome(fd);
    for (uint64_t s = 1; s <= 200; s++)
        send_report(fd, s);
    cr_expect_geq(read_acks(fd, 1), 1);
    uv_async_send(&sv.stopper);
    uint64_t last = read_acks(fd, UINT64_MAX); /* until EOF */
    pthread_join(sv.thread, NULL);
    cr_expect_eq(sv.loop_close_rc, 0, "handles left on the loop");
    close(fd);
    store_flush(sv.store);
    sqlite3 *db;
    struct fs_err err = {0};
    cr_assert_eq(store_open_readonly(sv.path, &db, &err), 0, "%s", err.msg);
    sqlite3_stmt *st;
    sqlite3_prepare_v2(db, "SELECT last_seq FROM streams", -1, &st, NULL);
    cr_assert_eq(sqlite3_step(st), SQLITE_ROW);
    int64_t committed = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    if (last > 0)
        cr_expect_eq((uint64_t)committed, last, "committed %lld, acked %llu", (long long)committed,
                     (unsigned long long)last);
    store_close(sv.store);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", sv.dir);
    cr_expect_eq(system(cmd), 0);
}

/* ModelShape.optimizer reaches the run's model_json as a JSON string,
 * escaped; a shape of nothing but the optimizer is still stored. */
static void send_hello_model(int fd, const char *run, uint32_t n_layers, const char *optimizer)
{
    Foreshock__ModelShape m = FORESHOCK__MODEL_SHAPE__INIT;
    m.has_n_layers = n_layers != 0;
    m.n_layers = n_layers;
    m.optimizer = (char *)optimizer;
    Foreshock__Hello h = FORESHOCK__HELLO__INIT;
    h.protocol_version = 1;
    h.run_id = (char *)run;
    h.world_size = 1;
    h.model = &m;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_HELLO;
    f.hello = &h;
    send_frame(fd, &f);
}

/* The run's model_json, malloc'd; NULL when the row holds NULL. */
static char *stored_model_json(const char *path, const char *run)
{
    sqlite3 *db;
    sqlite3_stmt *st;
    struct fs_err err = {0};
    cr_assert_eq(store_open_readonly(path, &db, &err), 0, "%s", err.msg);
    cr_assert_eq(
        sqlite3_prepare_v2(db, "SELECT model_json FROM runs WHERE name = ?1", -1, &st, NULL),
        SQLITE_OK);
    sqlite3_bind_text(st, 1, run, -1, SQLITE_STATIC);
    cr_assert_eq(sqlite3_step(st), SQLITE_ROW, "run %s not stored", run);
    const char *text = (const char *)sqlite3_column_text(st, 0);
    char *out = text ? strdup(text) : NULL;
    sqlite3_finalize(st);
    sqlite3_close(db);
    return out;
}

Test(ingest, model_json_carries_the_optimizer)
{
    static const struct {
        const char *run;
        uint32_t n_layers; /* 0: not sent */
        const char *optimizer;
        const char *want_json;
    } cases[] = {
        {"opt-escaped", 2, "My \"Lion\" \\ v2",
         "{\"n_layers\":2,\"optimizer\":\"My \\\"Lion\\\" \\\\ v2\"}"},
        {"opt-alone", 0, "SGD", "{\"optimizer\":\"SGD\"}"},
        {"opt-none", 2, NULL, "{\"n_layers\":2}"},
    };
    struct server sv;
    server_start(&sv, 1000, 64, 16, NULL);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int fd = client(sv.port);
        send_hello_model(fd, cases[i].run, cases[i].n_layers, cases[i].optimizer);
        expect_welcome(fd); /* sent once the Hello's run row is committed */
        close(fd);
        char *got = stored_model_json(sv.path, cases[i].run);
        cr_assert_not_null(got, "%s: model_json is NULL", cases[i].run);
        cr_expect_str_eq(got, cases[i].want_json, "%s", cases[i].run);
        json_error_t je;
        json_t *o = json_loads(got, 0, &je);
        cr_assert_not_null(o, "%s: not JSON: %s", cases[i].run, je.text);
        json_t *v = json_object_get(o, "optimizer");
        if (cases[i].optimizer)
            cr_expect_str_eq(json_string_value(v), cases[i].optimizer, "%s", cases[i].run);
        else
            cr_expect_null(v, "%s: an optimizer key without an optimizer", cases[i].run);
        json_decref(o);
        free(got);
    }
    /* One run, Hellos in turn: a shape without an optimizer keeps the one
     * an earlier Hello named (the live run keeps it too); another name
     * replaces it. */
    static const struct {
        uint32_t n_layers;
        const char *optimizer, *want_json;
    } seq[] = {
        {2, "SGD", "{\"n_layers\":2,\"optimizer\":\"SGD\"}"},
        {3, NULL, "{\"n_layers\":3,\"optimizer\":\"SGD\"}"},
        {3, "AdamW", "{\"n_layers\":3,\"optimizer\":\"AdamW\"}"},
    };
    for (size_t i = 0; i < sizeof(seq) / sizeof(seq[0]); i++) {
        int fd = client(sv.port);
        send_hello_model(fd, "opt-kept", seq[i].n_layers, seq[i].optimizer);
        expect_welcome(fd);
        close(fd);
        char *got = stored_model_json(sv.path, "opt-kept");
        cr_assert_not_null(got, "Hello %zu: model_json is NULL", i);
        cr_expect_str_eq(got, seq[i].want_json, "Hello %zu", i);
        free(got);
    }
    server_stop(&sv);
}
