/* libforeshock against the real daemon (build/foreshockd, next to this
 * test binary, or $FORESHOCKD): delivery, a daemon that starts late, and a
 * daemon SIGKILLed and restarted mid-stream. The daemon's own HTTP count of
 * stored reports must equal what the client submitted: nothing lost,
 * nothing stored twice. Skipped when the daemon binary does not exist. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "foreshock.h"
#include "fstest.h"

#define WAIT_MS 60000 /* bound on any wait for the daemon or the client */
#define PATH_LEN 4096

struct daemon {
    char bin[PATH_LEN], dir[PATH_LEN], db[PATH_LEN + 16];
    pid_t pid;
    uint16_t ingest, http;
    int starts;
};

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* $FORESHOCKD, else foreshockd next to this executable. 0 when found. */
static int find_daemon(char *out, size_t len)
{
    const char *env = getenv("FORESHOCKD");
    char self[PATH_LEN - 16]; /* room for "/foreshockd" in out */
    ssize_t n;

    if (env && *env) {
        snprintf(out, len, "%s", env);
    } else {
        n = readlink("/proc/self/exe", self, sizeof(self) - 1);
        if (n <= 0)
            return -1;
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (!slash)
            return -1;
        *slash = '\0';
        snprintf(out, len, "%s/foreshockd", self);
    }
    return access(out, X_OK) == 0 ? 0 : -1;
}

static void daemon_init(struct daemon *d)
{
    memset(d, 0, sizeof(*d));
    if (find_daemon(d->bin, sizeof(d->bin)) < 0)
        cr_skip_test("no foreshockd binary next to the test (or $FORESHOCKD)");
    snprintf(d->dir, sizeof(d->dir), "/tmp/fsc-daemon-XXXXXX");
    cr_assert(mkdtemp(d->dir), "mkdtemp: %s", strerror(errno));
    snprintf(d->db, sizeof(d->db), "%s/fs.db", d->dir);
}

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "r");
    char *buf;
    long n;

    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = calloc(1, (size_t)(n > 0 ? n : 0) + 1);
    if (buf && n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n)
        buf[0] = '\0';
    fclose(f);
    return buf;
}

/* "key=HOST:PORT" in line -> port. */
static uint16_t port_after(const char *line, const char *key)
{
    const char *p = strstr(line, key), *colon;
    if (!p)
        return 0;
    p += strlen(key);
    colon = strchr(p, ':');
    return colon ? (uint16_t)atoi(colon + 1) : 0;
}

/* Starts the daemon on ingest port `port` (0: any) and waits for its ready line. */
static void daemon_start(struct daemon *d, uint16_t port)
{
    char log[PATH_LEN + 32], listen[64];
    int64_t waited = 0;

    snprintf(log, sizeof(log), "%s/daemon.%d.log", d->dir, ++d->starts);
    snprintf(listen, sizeof(listen), "127.0.0.1:%u", (unsigned)port);
    d->pid = fork();
    cr_assert(d->pid >= 0);
    if (d->pid == 0) {
        /* A failed assertion ends the test process: take the daemon along. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == 1)
            _exit(127);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0)
            _exit(127);
        dup2(fd, 1);
        dup2(fd, 2);
        execl(d->bin, d->bin, "--listen", listen, "--http", "127.0.0.1:0", "--db", d->db,
              (char *)NULL);
        _exit(127);
    }
    for (;;) {
        char *text = read_file(log), *line = text ? strstr(text, "foreshockd ready ") : NULL;
        int status;
        if (line) {
            d->ingest = port_after(line, "ingest=");
            d->http = port_after(line, "http=");
            free(text);
            cr_assert(d->ingest && d->http, "cannot parse the ready line");
            return;
        }
        if (waitpid(d->pid, &status, WNOHANG) == d->pid)
            cr_assert_fail("foreshockd exited before ready:\n%s", text ? text : "");
        free(text);
        cr_assert(waited < WAIT_MS, "foreshockd never logged its ready line");
        sleep_ms(20);
        waited += 20;
    }
}

/* Sends sig and reaps the process (SIGKILL after WAIT_MS). */
static void daemon_stop(struct daemon *d, int sig)
{
    int status;

    if (d->pid <= 0)
        return;
    kill(d->pid, sig);
    for (int64_t waited = 0; waitpid(d->pid, &status, WNOHANG) != d->pid; waited += 20) {
        if (waited >= WAIT_MS) {
            kill(d->pid, SIGKILL);
            waitpid(d->pid, &status, 0);
            break;
        }
        sleep_ms(20);
    }
    d->pid = 0;
}

static void daemon_cleanup(struct daemon *d)
{
    DIR *dir;
    struct dirent *e;

    daemon_stop(d, SIGTERM);
    if (!d->dir[0] || !(dir = opendir(d->dir)))
        return;
    while ((e = readdir(dir))) {
        char path[PATH_LEN + 300];
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(path, sizeof(path), "%s/%s", d->dir, e->d_name);
        unlink(path);
    }
    closedir(dir);
    rmdir(d->dir);
}

/* GET path from the daemon's HTTP API: a JSON document (status 200). */
static json_t *http_get(const struct daemon *d, const char *path)
{
    struct resp r;
    json_t *doc = json_incref(get_json_at(d->http, path, 200, &r));
    resp_free(&r);
    return doc;
}

/* The daemon's count of stored reports of a run, and its streams' last seq. */
static void stored(const struct daemon *d, const char *run, int64_t *reports, int64_t *last_seq)
{
    char path[256];
    snprintf(path, sizeof(path), "/api/v1/runs/%s", run);
    json_t *doc = http_get(d, path), *r = json_object_get(doc, "run");
    cr_assert(json_is_integer(json_object_get(r, "reports")), "no run.reports");
    *reports = json_integer_value(json_object_get(r, "reports"));
    json_t *streams = json_object_get(r, "streams_detail");
    *last_seq = -1;
    if (json_array_size(streams) == 1)
        *last_seq = json_integer_value(json_object_get(json_array_get(streams, 0), "last_seq"));
    json_decref(doc);
}

static uint16_t free_port(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static fsc_client *open_client(uint16_t port, const char *run)
{
    struct fsc_options o;
    fsc_client *c = NULL;
    char err[FSC_ERROR_LEN];
    fsc_options_init(&o);
    o.port = port;
    o.run_id = run;
    o.world_size = 1;
    o.backoff_min_ms = 10;
    o.backoff_max_ms = 200;
    cr_assert_eq(fsc_open(&o, &c, err, sizeof(err)), 0, "%s", err);
    return c;
}

/* One report per step; every 10th carries a small Gram sketch. */
static void submit_steps(fsc_client *c, uint64_t from, uint64_t to)
{
    static float g[36]; /* fsc_tri_len(2 * dh), dh = 4 */
    for (uint64_t step = from; step < to; step++) {
        fsc_report *r = fsc_report_new(step);
        cr_assert(r);
        fsc_report_set_loss(r, 5.0 / (double)(step + 1));
        fsc_report_set_grad_norm(r, 1.0);
        fsc_report_set_lr(r, 1e-4);
        if (step % 10 == 0)
            cr_assert_eq(
                fsc_report_add_attention_gram(r, 0, 0, FSC_KV_HEAD_NONE, 10, 4, 0, 1, g, g), 0);
        cr_assert_eq(fsc_submit(c, r), 0, "step %llu", (unsigned long long)step);
    }
}

static struct fsc_stats stats(fsc_client *c)
{
    struct fsc_stats s = {.size = sizeof(s)};
    fsc_stats(c, &s);
    return s;
}

Test(client_daemon, everything_submitted_is_stored_once, .timeout = 180)
{
    struct daemon d;
    int64_t reports, last_seq;
    daemon_init(&d);
    daemon_start(&d, 0);
    fsc_client *c = open_client(d.ingest, "deliver");
    submit_steps(c, 0, 300);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0, "last error: %s", stats(c).last_error);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.acked, 300);
    cr_expect_eq(s.dropped, 0);
    cr_expect_eq(s.connected, 1);
    stored(&d, "deliver", &reports, &last_seq);
    cr_expect_eq(reports, 300);
    cr_expect_eq(last_seq, 300);
    cr_expect_eq(fsc_close_timeout(c, WAIT_MS), 0);
    daemon_cleanup(&d);
}

Test(client_daemon, client_waits_for_a_daemon_that_starts_late, .timeout = 180)
{
    struct daemon d;
    int64_t reports, last_seq;
    daemon_init(&d);
    uint16_t port = free_port();
    fsc_client *c = open_client(port, "late");
    submit_steps(c, 0, 50);
    cr_expect_eq(fsc_flush(c, 0), -ETIMEDOUT);
    daemon_start(&d, port);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0, "last error: %s", stats(c).last_error);
    cr_expect_eq(stats(c).acked, 50);
    stored(&d, "late", &reports, &last_seq);
    cr_expect_eq(reports, 50);
    fsc_close(c);
    daemon_cleanup(&d);
}

Test(client_daemon, daemon_killed_and_restarted_mid_stream, .timeout = 180)
{
    struct daemon d;
    int64_t reports, last_seq;
    daemon_init(&d);
    daemon_start(&d, 0);
    uint16_t port = d.ingest;
    fsc_client *c = open_client(port, "crash");
    submit_steps(c, 0, 200);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0);
    submit_steps(c, 200, 400); /* in flight when the daemon dies */
    daemon_stop(&d, SIGKILL);
    submit_steps(c, 400, 600); /* buffered while it is down */
    daemon_start(&d, port);    /* same port, same database */
    submit_steps(c, 600, 800);
    cr_assert_eq(fsc_flush(c, WAIT_MS), 0, "last error: %s", stats(c).last_error);
    struct fsc_stats s = stats(c);
    cr_expect_eq(s.submitted, 800);
    cr_expect_eq(s.acked, 800);
    cr_expect_eq(s.dropped, 0);
    cr_expect_geq(s.reconnects, 1);
    stored(&d, "crash", &reports, &last_seq);
    cr_expect_eq(reports, 800, "lost or duplicated reports: %lld stored", (long long)reports);
    cr_expect_eq(last_seq, 800);
    fsc_close(c);
    daemon_cleanup(&d);
}

/* ---- the foreshock CLI against the same daemon ------------------------------------ */

/* Runs `foreshock ARGS` (the binary next to this test), returns its exit
 * status and its stdout+stderr (caller frees). */
static int cli(const struct daemon *d, char **out, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int cli(const struct daemon *d, char **out, const char *fmt, ...)
{
    char bin[PATH_LEN], args[1024], cmd[PATH_LEN + 1200], chunk[4096];
    struct resp b = {0};
    va_list ap;
    FILE *p;
    size_t n;
    int status;

    snprintf(bin, sizeof(bin), "%s", d->bin);
    char *slash = strrchr(bin, '/');
    cr_assert(slash);
    snprintf(slash + 1, sizeof(bin) - (size_t)(slash + 1 - bin), "foreshock");
    if (access(bin, X_OK) != 0)
        cr_skip_test("no foreshock CLI next to foreshockd");
    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "'%s' %s 2>&1", bin, args);
    p = popen(cmd, "r");
    cr_assert(p);
    while ((n = fread(chunk, 1, sizeof(chunk), p)) > 0)
        cr_assert_eq(on_body(chunk, 1, n, &b), n, "output over %u bytes", RESP_MAX_BODY);
    status = pclose(p);
    *out = b.body ? b.body : strdup("");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static json_t *cli_json(const struct daemon *d, const char *args)
{
    char *out;
    json_error_t e;
    int rc = cli(d, &out, "--http 127.0.0.1:%u %s --json", (unsigned)d->http, args);
    cr_assert_eq(rc, 0, "foreshock %s: exit %d: %s", args, rc, out);
    json_t *doc = json_loads(out, 0, &e);
    cr_assert(doc, "foreshock %s: not JSON (%s): %s", args, e.text, out);
    free(out);
    return doc;
}

Test(client_daemon, cli_simulates_and_queries_with_pagination, .timeout = 180)
{
    struct daemon d;
    char *out;
    unsigned long long sub, ack, drop, rec;
    daemon_init(&d);
    daemon_start(&d, 0);

    int rc = cli(&d, &out,
                 "simulate --endpoint 127.0.0.1:%u --run cli-run --ranks 2 --steps 30 "
                 "--layers 1 --heads 2 --dh 4 --d 8 --sketch-every 5 --window 7",
                 (unsigned)d.ingest);
    cr_assert_eq(rc, 0, "simulate exit %d: %s", rc, out);
    char *sum = strstr(out, "simulate: run=cli-run ranks=2 steps=30 ");
    cr_assert(sum, "no summary line: %s", out);
    cr_assert_eq(sscanf(sum,
                        "simulate: run=cli-run ranks=2 steps=30 submitted=%llu acked=%llu "
                        "dropped=%llu reconnects=%llu",
                        &sub, &ack, &drop, &rec),
                 4);
    cr_expect(sub == 60 && ack == 60 && drop == 0, "%s", sum);
    free(out);
    rc = cli(&d, &out, "simulate --endpoint 127.0.0.1:%u --run cli-other --steps 3 --no-sketches",
             (unsigned)d.ingest);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);

    /* runs: two pages of one, joined. */
    json_t *doc = cli_json(&d, "runs --page-size 1"), *runs = json_object_get(doc, "runs");
    cr_assert_eq(json_array_size(runs), 2);
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(runs, 0), "id")), "cli-run");
    cr_expect_eq(json_integer_value(json_object_get(json_array_get(runs, 0), "reports")), 60);
    cr_expect(json_is_null(json_object_get(doc, "next")));
    json_decref(doc);

    /* series: 6 scalar series per rank, pages of 5; the monitor stage's
     * series (no rank label) come on top of them. */
    doc = cli_json(&d, "series --run cli-run --page-size 5");
    json_t *series = json_object_get(doc, "series"), *s;
    size_t i, ranked = 0;
    json_int_t loss_id = 0;
    json_array_foreach(series, i, s) ranked +=
        json_object_get(json_object_get(s, "labels"), "rank") != NULL;
    cr_expect_eq(ranked, 12);
    json_array_foreach(series, i, s)
    {
        json_t *rank = json_object_get(json_object_get(s, "labels"), "rank");
        if (!strcmp(json_string_value(json_object_get(s, "name")), "loss") &&
            json_integer_value(rank) == 1)
            loss_id = json_integer_value(json_object_get(s, "id"));
    }
    cr_assert(loss_id > 0, "no loss series for rank 1");
    json_decref(doc);

    /* points: pages of 7 up to --limit 25, resumable from next_from. */
    char args[128];
    snprintf(args, sizeof(args), "points --series %lld --page-size 7 --limit 25",
             (long long)loss_id);
    doc = cli_json(&d, args);
    json_t *pts = json_object_get(doc, "points");
    cr_assert_eq(json_array_size(pts), 25);
    for (i = 0; i < 25; i++)
        cr_expect_eq(json_integer_value(json_array_get(json_array_get(pts, i), 0)), (json_int_t)i);
    cr_expect_eq(json_integer_value(json_object_get(doc, "next_from")), 25);
    json_decref(doc);
    snprintf(args, sizeof(args), "points --series %lld --from 25", (long long)loss_id);
    doc = cli_json(&d, args);
    cr_expect_eq(json_array_size(json_object_get(doc, "points")), 5);
    cr_expect(json_is_null(json_object_get(doc, "next_from")));
    json_decref(doc);

    /* Tables: a header, then one line per item. */
    rc = cli(&d, &out, "--http 127.0.0.1:%u runs", (unsigned)d.http);
    cr_assert_eq(rc, 0, "%s", out);
    cr_expect(!strncmp(out, "RUN ", 4), "%s", out);
    cr_expect(strstr(out, "\ncli-run ") && strstr(out, "\ncli-other "), "%s", out);
    free(out);

    /* Errors: the server's message and exit 1; bad usage exit 2. */
    rc = cli(&d, &out, "--http 127.0.0.1:%u points --series 99999999", (unsigned)d.http);
    cr_expect_eq(rc, 1, "%s", out);
    cr_expect(strstr(out, "foreshock: ") && strstr(out, "404"), "%s", out);
    free(out);
    rc = cli(&d, &out, "--http 127.0.0.1:%u series --run no-such-run", (unsigned)d.http);
    cr_expect_eq(rc, 1, "%s", out);
    free(out);
    rc = cli(&d, &out, "runs --bogus");
    cr_expect_eq(rc, 2, "%s", out);
    free(out);
    rc = cli(&d, &out, "simulate --run x --ranks 2 --d 1");
    cr_expect_eq(rc, 2, "%s", out);
    free(out);
    daemon_cleanup(&d);
}
