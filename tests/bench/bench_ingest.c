/* bench_ingest: ingest and storage throughput of foreshockd, each figure set
 * beside a reference measured in the same run on the same machine:
 *
 *   loopback_tcp   one 127.0.0.1 TCP stream, writer thread -> reader thread
 *                  that discards: the ceiling of any socket ingest here.
 *   ingest_small   K libforeshock clients (ranks of one run) submitting
 *                  scalar-only reports (6 points each) as fast as their
 *                  replay buffers allow, until every report is acked
 *                  (= committed by the daemon).
 *   ingest_gram    K clients submitting reports that carry attention Gram
 *                  sketches (8 heads, dh 64: ~530 KB per report).
 *   points_daemon  points committed per second in ingest_small.
 *   points_bare    a bare batched SQLite insert loop into the same schema
 *                  (embedded migrations, WAL, synchronous=NORMAL, one
 *                  prepared INSERT INTO points), committing as many rows
 *                  per transaction as the daemon did on average in
 *                  ingest_small (its points committed / commits, from
 *                  /metrics around that phase): the same batching, so the
 *                  ratio is the daemon's overhead over SQLite itself. (It
 *                  committed every 1,000 rows until 2026-12-03, against the
 *                  daemon's ~6,000, which flattered the daemon ~2x.)
 *
 * MB is 10^6 bytes. Wire bytes are the report frames only (length prefix
 * included; Hello/Welcome/Ack are left out), computed with the generated
 * protobuf-c get_packed_size on a Frame equal to what libforeshock sends.
 * No thresholds: this is a benchmark, it fails only when something does not
 * work (every report must be acked and stored; nothing may be dropped).
 *
 * The daemon runs as a child process on ephemeral ports with a database in a
 * fresh temporary directory, its stderr in a log file there (printed on a
 * failure); it is stopped with SIGTERM and must exit 0. Everything runs on
 * the main thread except the loopback reader and the client workers. */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"
#include "schema.h"

/* --- named limits and sizes --------------------------------------------------- */
#define BENCH_ERR_LEN 512
#define BENCH_PATH_MAX 4096
#define BENCH_MAX_CLIENTS 256u
#define BENCH_MAX_REPORTS 10000000u /* per client */
#define BENCH_MAX_LOOPBACK_MB 65536u
#define BENCH_MAX_GRAM_TOTAL_BYTES 800000000ull /* under the daemon's 1 GiB default spool bound */

#define BENCH_DEF_CLIENTS 8u
#define BENCH_DEF_REPORTS 20000u
#define BENCH_DEF_GRAM_CLIENTS 4u
#define BENCH_DEF_GRAM_REPORTS 128u
#define BENCH_DEF_LOOPBACK_MB 2048u
#define BENCH_QUICK_REPORTS 500u
#define BENCH_QUICK_GRAM_REPORTS 8u
#define BENCH_QUICK_LOOPBACK_MB 128u

#define BENCH_LOOPBACK_CHUNK (256u << 10)
#define BENCH_NSCALARS 6u /* loss, grad_norm, lr, loss_scale, tokens, step_time */
#define BENCH_GRAM_HEADS 8u
#define BENCH_GRAM_DH 64u
#define BENCH_GRAM_D 256u /* model-dimension shard of the synthetic weights */
#define BENCH_GRAM_WINDOW 16u

#define BENCH_READY_TIMEOUT_MS 20000
#define BENCH_STOP_TIMEOUT_MS 30000
#define BENCH_CONNECT_TIMEOUT_MS 10000
#define BENCH_FLUSH_TIMEOUT_MS 600000
#define BENCH_CLOSE_TIMEOUT_MS 5000
#define BENCH_POLL_MS 10
/* Back-off after fsc_submit refuses with -ENOBUFS (replay buffer full): a
 * refused report is freed and rebuilt, so Gram reports wait longer. */
#define BENCH_ENOBUFS_SLEEP_US 200
#define BENCH_ENOBUFS_SLEEP_GRAM_US 1000
#define BENCH_HTTP_MAX_RESPONSE (1u << 20)
#define BENCH_LOG_TAIL_BYTES 4096

#define SMALL_RUN "bench-small"
#define GRAM_RUN "bench-gram"

/* --- small helpers ------------------------------------------------------------ */

/* Formats into err (errlen bytes) and returns rc. */
static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return rc;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_us(long us)
{
    struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static int parse_uint(const char *s, unsigned long long lo, unsigned long long hi,
                      unsigned long long *out)
{
    if (!s || !*s || *s == '-')
        return -EINVAL;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return -EINVAL;
    *out = v;
    return 0;
}

/* --- loopback reference ------------------------------------------------------- */

struct loop_reader {
    int fd;
    uint64_t want, got;
    double t_end;
    int rc; /* 0 or -errno */
};

static void *loop_read(void *arg)
{
    struct loop_reader *lr = arg;
    char *buf = malloc(BENCH_LOOPBACK_CHUNK);
    if (!buf) {
        lr->rc = -ENOMEM;
        return NULL;
    }
    while (lr->got < lr->want) {
        ssize_t n = read(lr->fd, buf, BENCH_LOOPBACK_CHUNK);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            lr->rc = n < 0 ? -errno : -ECONNRESET;
            break;
        }
        lr->got += (uint64_t)n;
    }
    lr->t_end = now_s();
    free(buf);
    return NULL;
}

/* A connected pair of TCP sockets over 127.0.0.1 (ephemeral port). */
static int tcp_pair(int *wfd, int *rfd, char *err, size_t errlen)
{
    int lfd = -1, a = -1, b = -1, rc;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    socklen_t sl = sizeof(sa);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if ((lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
        bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 1) < 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl) < 0 ||
        (a = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
        connect(a, (struct sockaddr *)&sa, sizeof(sa)) < 0 || (b = accept(lfd, NULL, NULL)) < 0) {
        rc = fail(err, errlen, -errno, "loopback socket setup: %s", strerror(errno));
        goto out;
    }
    *wfd = a;
    *rfd = b;
    a = b = -1;
    rc = 0;
out:
    if (lfd >= 0)
        close(lfd);
    if (a >= 0)
        close(a);
    if (b >= 0)
        close(b);
    return rc;
}

/* Writes `total` bytes in BENCH_LOOPBACK_CHUNK chunks over a loopback TCP
 * connection to a reader thread that discards them; *mb_s and *secs from the
 * first write to the last byte read. Main thread. */
static int loopback_measure(uint64_t total, double *mb_s, double *secs, char *err, size_t errlen)
{
    int wfd = -1, rc;
    struct loop_reader lr = {.fd = -1, .want = total};
    char *buf = calloc(1, BENCH_LOOPBACK_CHUNK);
    if (!buf)
        return fail(err, errlen, -ENOMEM, "loopback: out of memory");
    if ((rc = tcp_pair(&wfd, &lr.fd, err, errlen)) < 0)
        goto out;
    memset(buf, 0x5a, BENCH_LOOPBACK_CHUNK);
    pthread_t th;
    double t0 = now_s();
    if ((rc = pthread_create(&th, NULL, loop_read, &lr)) != 0) {
        rc = fail(err, errlen, -rc, "loopback: pthread_create: %s", strerror(rc));
        goto out;
    }
    uint64_t sent = 0;
    int werr = 0;
    while (sent < total) {
        size_t n =
            total - sent < BENCH_LOOPBACK_CHUNK ? (size_t)(total - sent) : BENCH_LOOPBACK_CHUNK;
        ssize_t w = write(wfd, buf, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            werr = errno;
            break;
        }
        sent += (uint64_t)w;
    }
    if (werr)
        shutdown(wfd, SHUT_RDWR); /* unblocks the reader */
    pthread_join(th, NULL);
    if (werr) {
        rc = fail(err, errlen, -werr, "loopback: write: %s", strerror(werr));
        goto out;
    }
    if (lr.rc < 0) {
        rc = fail(err, errlen, lr.rc, "loopback: read after %" PRIu64 " of %" PRIu64 " bytes: %s",
                  lr.got, total, strerror(-lr.rc));
        goto out;
    }
    *secs = lr.t_end - t0;
    *mb_s = (double)total / 1e6 / *secs;
    rc = 0;
out:
    if (wfd >= 0)
        close(wfd);
    if (lr.fd >= 0)
        close(lr.fd);
    free(buf);
    return rc;
}

/* --- the daemon child ---------------------------------------------------------- */

struct daemon {
    pid_t pid; /* 0: not running */
    char log_path[BENCH_PATH_MAX];
    char ingest_host[64], http_host[64];
    uint16_t ingest_port, http_port;
};

/* Prints the last BENCH_LOG_TAIL_BYTES of the daemon's log to stderr. */
static void daemon_print_log(const struct daemon *d)
{
    FILE *f = fopen(d->log_path, "r");
    if (!f)
        return;
    char buf[BENCH_LOG_TAIL_BYTES + 1];
    if (fseek(f, 0, SEEK_END) == 0) {
        long end = ftell(f);
        if (end > BENCH_LOG_TAIL_BYTES)
            fseek(f, end - BENCH_LOG_TAIL_BYTES, SEEK_SET);
        else
            fseek(f, 0, SEEK_SET);
    }
    size_t n = fread(buf, 1, BENCH_LOG_TAIL_BYTES, f);
    buf[n] = '\0';
    fclose(f);
    fprintf(stderr, "--- foreshockd log (%s), last %zu bytes ---\n%s%s--- end of log ---\n",
            d->log_path, n, buf, n && buf[n - 1] != '\n' ? "\n" : "");
}

/* Parses "KEY=HOST:PORT" at the start of s (up to a space or the end). */
static int parse_endpoint(const char *s, const char *key, char *host, size_t hostlen,
                          uint16_t *port)
{
    const char *p = strstr(s, key);
    if (!p)
        return -EINVAL;
    p += strlen(key);
    size_t len = strcspn(p, " \r\n");
    const char *colon = NULL;
    for (size_t i = 0; i < len; i++)
        if (p[i] == ':')
            colon = p + i;
    if (!colon || colon == p || (size_t)(colon - p) >= hostlen)
        return -EINVAL;
    memcpy(host, p, (size_t)(colon - p));
    host[colon - p] = '\0';
    char num[8];
    size_t nlen = len - (size_t)(colon + 1 - p);
    if (nlen == 0 || nlen >= sizeof(num))
        return -EINVAL;
    memcpy(num, colon + 1, nlen);
    num[nlen] = '\0';
    unsigned long long v;
    if (parse_uint(num, 1, 65535, &v) < 0)
        return -EINVAL;
    *port = (uint16_t)v;
    return 0;
}

/* Looks for the ready line in the log; 1 found (endpoints filled), 0 not
 * yet, -EPROTO found but unparsable. */
static int daemon_scan_ready(struct daemon *d)
{
    FILE *f = fopen(d->log_path, "r");
    if (!f)
        return 0;
    char line[2048];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f)) {
        const char *p = strstr(line, "foreshockd ready ");
        if (!p)
            continue;
        found = parse_endpoint(p, "ingest=", d->ingest_host, sizeof(d->ingest_host),
                               &d->ingest_port) == 0 &&
                        parse_endpoint(p, "http=", d->http_host, sizeof(d->http_host),
                                       &d->http_port) == 0
                    ? 1
                    : -EPROTO;
    }
    fclose(f);
    return found;
}

/* Starts exe on ephemeral loopback ports with database db, stderr and stdout
 * into d->log_path, and waits for its ready line. On failure the child is
 * reaped (or killed) and d->pid is 0. Main thread. */
static int daemon_start(const char *exe, const char *db, struct daemon *d, char *err, size_t errlen)
{
    if (access(exe, X_OK) != 0)
        return fail(err, errlen, -ENOENT,
                    "foreshockd not found or not executable at %s (%s): build it, or pass "
                    "--daemon PATH",
                    exe, strerror(errno));
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0)
        return fail(err, errlen, -errno, "fork: %s", strerror(errno));
    if (pid == 0) {
        /* If the bench dies (Ctrl-C, crash), do not leave the daemon behind. */
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || getppid() != parent)
            _exit(125);
        int fd = open(d->log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 || dup2(fd, STDERR_FILENO) < 0 || dup2(fd, STDOUT_FILENO) < 0)
            _exit(126);
        char *const argv[] = {(char *)exe,   "--listen", "127.0.0.1:0", "--http",
                              "127.0.0.1:0", "--db",     (char *)db,    NULL};
        execv(exe, argv);
        dprintf(STDERR_FILENO, "bench_ingest: execv %s: %s\n", exe, strerror(errno));
        _exit(127);
    }
    d->pid = pid;
    double deadline = now_s() + BENCH_READY_TIMEOUT_MS / 1000.0;
    for (;;) {
        int st, r = daemon_scan_ready(d);
        if (r == 1)
            return 0;
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid) {
            d->pid = 0;
            return fail(err, errlen, -ECHILD, "foreshockd exited before it was ready (%s %d)",
                        WIFEXITED(st) ? "status" : "signal",
                        WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
        }
        if (r < 0 || now_s() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            d->pid = 0;
            return fail(err, errlen, r < 0 ? r : -ETIMEDOUT,
                        r < 0 ? "cannot parse foreshockd's ready line"
                              : "foreshockd did not log its ready line within %d ms",
                        BENCH_READY_TIMEOUT_MS);
        }
        sleep_us(BENCH_POLL_MS * 1000L);
    }
}

/* SIGTERM, then waits up to BENCH_STOP_TIMEOUT_MS for exit status 0 (SIGKILL
 * after that). d->pid is 0 afterwards. No-op when not running. Main thread. */
static int daemon_stop(struct daemon *d, char *err, size_t errlen)
{
    if (d->pid <= 0)
        return 0;
    pid_t pid = d->pid;
    d->pid = 0;
    if (kill(pid, SIGTERM) != 0)
        return fail(err, errlen, -errno, "kill(%ld, SIGTERM): %s", (long)pid, strerror(errno));
    double deadline = now_s() + BENCH_STOP_TIMEOUT_MS / 1000.0;
    int st;
    for (;;) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            break;
        if (w < 0)
            return fail(err, errlen, -errno, "waitpid: %s", strerror(errno));
        if (now_s() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return fail(err, errlen, -ETIMEDOUT,
                        "foreshockd did not exit within %d ms of SIGTERM (killed)",
                        BENCH_STOP_TIMEOUT_MS);
        }
        sleep_us(BENCH_POLL_MS * 1000L);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        return fail(err, errlen, -EIO, "foreshockd stopped with %s %d (expected exit status 0)",
                    WIFEXITED(st) ? "exit status" : "signal",
                    WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
    return 0;
}

/* GET /api/v1/runs/{run} over HTTP/1.0 and returns run.reports. Main thread. */
/* GET path from the daemon's HTTP listener (HTTP/1.0, read to EOF). On 0,
 * *resp is a malloc'ed NUL-terminated response (headers included) and
 * *body points into it, after a 200 status. Main thread. */
static int http_get(const struct daemon *d, const char *path, char **resp, const char **body,
                    char *err, size_t errlen)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(d->http_port)};
    *resp = NULL;
    if (inet_pton(AF_INET, d->http_host, &sa.sin_addr) != 1)
        return fail(err, errlen, -EINVAL, "http: not an IPv4 address: %s", d->http_host);
    char *buf = malloc(BENCH_HTTP_MAX_RESPONSE + 1);
    if (!buf)
        return fail(err, errlen, -ENOMEM, "http: out of memory");
    int rc, fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        rc = fail(err, errlen, -errno, "http: connect %s:%u: %s", d->http_host, d->http_port,
                  strerror(errno));
        goto out;
    }
    char req[512];
    int rl = snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: %s:%u\r\n\r\n", path,
                      d->http_host, d->http_port);
    for (int off = 0; off < rl;) {
        ssize_t w = write(fd, req + off, (size_t)(rl - off));
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            rc = fail(err, errlen, -errno, "http: write: %s", strerror(errno));
            goto out;
        }
        off += (int)w;
    }
    size_t len = 0;
    for (;;) {
        if (len == BENCH_HTTP_MAX_RESPONSE) {
            rc = fail(err, errlen, -EMSGSIZE, "http: response over %u bytes",
                      BENCH_HTTP_MAX_RESPONSE);
            goto out;
        }
        ssize_t n = read(fd, buf + len, BENCH_HTTP_MAX_RESPONSE - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rc = fail(err, errlen, -errno, "http: read: %s", strerror(errno));
            goto out;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    int status = 0;
    const char *b = strstr(buf, "\r\n\r\n");
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1 || !b) {
        rc = fail(err, errlen, -EPROTO, "http: GET %s: not an HTTP response", path);
        goto out;
    }
    b += 4;
    if (status != 200) {
        rc = fail(err, errlen, -EPROTO, "http: GET %s: status %d: %.200s", path, status, b);
        goto out;
    }
    *resp = buf;
    *body = b;
    buf = NULL;
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    free(buf);
    return rc;
}

static int http_run_reports(const struct daemon *d, const char *run, int64_t *reports, char *err,
                            size_t errlen)
{
    char path[256], *resp = NULL;
    const char *body;
    json_t *doc = NULL;
    int rc;
    snprintf(path, sizeof(path), "/api/v1/runs/%s", run);
    if ((rc = http_get(d, path, &resp, &body, err, errlen)) < 0)
        return rc;
    json_error_t je;
    doc = json_loads(body, 0, &je);
    json_t *jr = doc ? json_object_get(json_object_get(doc, "run"), "reports") : NULL;
    if (!json_is_integer(jr)) {
        rc = fail(err, errlen, -EPROTO, "http: GET %s: no run.reports in %.200s", path, body);
        goto out;
    }
    *reports = (int64_t)json_integer_value(jr);
    rc = 0;
out:
    json_decref(doc);
    free(resp);
    return rc;
}

/* The daemon's write transactions and points committed so far (/metrics:
 * foreshock_commits_total, foreshock_points_committed_total). */
static int http_commit_counts(const struct daemon *d, uint64_t *commits, uint64_t *points,
                              char *err, size_t errlen)
{
    static const char *const names[2] = {"foreshock_commits_total",
                                         "foreshock_points_committed_total"};
    uint64_t *out[2] = {commits, points};
    char *resp = NULL;
    const char *body;
    int rc = http_get(d, "/metrics", &resp, &body, err, errlen);
    if (rc < 0)
        return rc;
    for (int i = 0; i < 2; i++) {
        size_t nl = strlen(names[i]);
        const char *line = body;
        int found = 0;
        while (line && *line && !found) {
            unsigned long long v;
            if (strncmp(line, names[i], nl) == 0 && line[nl] == ' ' &&
                sscanf(line + nl + 1, "%llu", &v) == 1) {
                *out[i] = v;
                found = 1;
            }
            line = strchr(line, '\n');
            line = line ? line + 1 : NULL;
        }
        if (!found) {
            rc = fail(err, errlen, -EPROTO, "http: /metrics has no %s", names[i]);
            break;
        }
    }
    free(resp);
    return rc;
}

/* Scalar points (series with a rank label) stored for run `run` in the
 * database at path (read-only); the monitor series the daemon derives from
 * Gram reports carry no rank and are not counted. */
static int db_count_points(const char *path, const char *run, int64_t *count, char *err,
                           size_t errlen)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL);
    if (rc == SQLITE_OK)
        rc = sqlite3_prepare_v2(db,
                                "SELECT count(*) FROM points WHERE series_id IN (SELECT s.id FROM "
                                "series s JOIN runs r ON r.id = s.run_id WHERE r.name = ?1 AND "
                                "s.rank >= 0)",
                                -1, &st, NULL);
    if (rc == SQLITE_OK)
        rc = sqlite3_bind_text(st, 1, run, -1, SQLITE_STATIC);
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        *count = sqlite3_column_int64(st, 0);
        rc = SQLITE_OK;
    }
    int ret = 0;
    if (rc != SQLITE_OK)
        ret = fail(err, errlen, -EIO, "%s: counting points of run %s: %s", path, run,
                   db ? sqlite3_errmsg(db) : sqlite3_errstr(rc));
    sqlite3_finalize(st);
    sqlite3_close(db);
    return ret;
}

/* --- client workers ------------------------------------------------------------- */

struct phase {
    const char *name;
    const char *host;
    uint16_t port;
    const char *run;
    unsigned clients;
    uint64_t reports;   /* per client */
    const float *grams; /* NULL: scalar-only; else heads x (ga, gb) triangles */
    size_t tri;         /* floats per triangle */
    /* start gate: 0 wait, 1 go, -1 abort */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int gate;
};

struct worker {
    struct phase *ph;
    unsigned rank;
    fsc_client *c;
    uint64_t enobufs; /* fsc_submit refusals retried */
    int rc;
    char err[BENCH_ERR_LEN];
};

static double scalar_loss(unsigned rank, uint64_t step)
{
    double jitter = (double)((step * 2654435761u + rank * 40503u) % 1000u) / 1000.0 - 0.5;
    return 2.0 + 1.5 * exp(-(double)step / 2000.0) + 0.02 * jitter;
}

#define BENCH_TOKENS_PER_STEP 524288u

/* A report for (rank, step): the six scalars, plus the Gram sketches of
 * BENCH_GRAM_HEADS heads when ph->grams is set (rank's d-shard of each). */
static int report_build(const struct phase *ph, unsigned rank, uint64_t step, fsc_report **out)
{
    fsc_report *r = fsc_report_new(step);
    if (!r)
        return -ENOMEM;
    double loss = scalar_loss(rank, step);
    int rc;
    if ((rc = fsc_report_set_loss(r, loss)) < 0 ||
        (rc = fsc_report_set_grad_norm(r, 0.8 + 0.1 * (loss - 2.0))) < 0 ||
        (rc = fsc_report_set_lr(r, 3e-4)) < 0 || (rc = fsc_report_set_loss_scale(r, 65536.0)) < 0 ||
        (rc = fsc_report_set_tokens(r, BENCH_TOKENS_PER_STEP)) < 0 ||
        (rc = fsc_report_set_step_time(r, 0.35)) < 0)
        goto fail;
    for (unsigned h = 0; ph->grams && h < BENCH_GRAM_HEADS; h++) {
        const float *ga = ph->grams + (size_t)h * 2 * ph->tri;
        if ((rc = fsc_report_add_attention_gram(r, 0, h, FSC_KV_HEAD_NONE, BENCH_GRAM_WINDOW,
                                                BENCH_GRAM_DH, rank, ph->clients, ga,
                                                ga + ph->tri)) < 0)
            goto fail;
    }
    *out = r;
    return 0;
fail:
    fsc_report_free(r);
    return rc;
}

/* Wire bytes of report (rank, seq = step) as libforeshock frames it: the
 * same Frame packed by protobuf-c, plus the 4-byte length prefix. */
static size_t report_wire_bytes(const struct phase *ph, unsigned rank, uint64_t step)
{
    Foreshock__Scalars sc = FORESHOCK__SCALARS__INIT;
    double loss = scalar_loss(rank, step);
    sc.has_loss = sc.has_grad_norm = sc.has_lr = sc.has_loss_scale = 1;
    sc.has_tokens = sc.has_step_time_s = 1;
    sc.loss = loss;
    sc.grad_norm = 0.8 + 0.1 * (loss - 2.0);
    sc.lr = 3e-4;
    sc.loss_scale = 65536.0;
    sc.tokens = BENCH_TOKENS_PER_STEP;
    sc.step_time_s = 0.35;
    Foreshock__GramSketch g[BENCH_GRAM_HEADS];
    Foreshock__AttentionSketch a[BENCH_GRAM_HEADS];
    Foreshock__AttentionSketch *ap[BENCH_GRAM_HEADS];
    Foreshock__Report rep = FORESHOCK__REPORT__INIT;
    rep.seq = step;
    rep.step = step;
    rep.scalars = &sc;
    for (unsigned h = 0; ph->grams && h < BENCH_GRAM_HEADS; h++) {
        const float *ga = ph->grams + (size_t)h * 2 * ph->tri;
        foreshock__gram_sketch__init(&g[h]);
        g[h].dh = BENCH_GRAM_DH;
        g[h].has_shard_index = g[h].has_shard_count = 1;
        g[h].shard_index = rank;
        g[h].shard_count = ph->clients;
        g[h].ga.len = g[h].gb.len = ph->tri * sizeof(float);
        g[h].ga.data = (uint8_t *)ga;
        g[h].gb.data = (uint8_t *)(ga + ph->tri);
        foreshock__attention_sketch__init(&a[h]);
        a[h].layer = 0;
        a[h].head = h;
        a[h].window = BENCH_GRAM_WINDOW;
        a[h].kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_GRAM;
        a[h].gram = &g[h];
        ap[h] = &a[h];
        rep.n_attention = h + 1;
        rep.attention = ap;
    }
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_REPORT;
    f.report = &rep;
    return 4 + foreshock__frame__get_packed_size(&f);
}

static void client_log(void *ctx, int level, const char *message)
{
    const struct worker *w = ctx;
    if (level >= FSC_LOG_WARN)
        fprintf(stderr, "bench_ingest: %s client rank %u: %s\n", w->ph->name, w->rank, message);
}

/* Worker thread: waits at the gate, submits reports 1..N (retrying a step
 * refused with -ENOBUFS after a short sleep), then flushes. */
static void *worker_run(void *arg)
{
    struct worker *w = arg;
    struct phase *ph = w->ph;
    pthread_mutex_lock(&ph->mu);
    while (ph->gate == 0)
        pthread_cond_wait(&ph->cv, &ph->mu);
    int go = ph->gate > 0;
    pthread_mutex_unlock(&ph->mu);
    if (!go)
        return NULL;
    for (uint64_t step = 1; step <= ph->reports; step++) {
        for (;;) {
            fsc_report *r;
            int rc = report_build(ph, w->rank, step, &r);
            if (rc < 0) {
                w->rc = fail(w->err, sizeof(w->err), rc, "building report %" PRIu64 ": %s", step,
                             strerror(-rc));
                return NULL;
            }
            /* fsc_submit owns r from here, freed even on refusal: rebuild to retry. */
            rc = fsc_submit(w->c, r);
            if (rc == 0)
                break;
            if (rc != -ENOBUFS) {
                w->rc = fail(w->err, sizeof(w->err), rc, "fsc_submit report %" PRIu64 ": %s", step,
                             strerror(-rc));
                return NULL;
            }
            w->enobufs++;
            sleep_us(ph->grams ? BENCH_ENOBUFS_SLEEP_GRAM_US : BENCH_ENOBUFS_SLEEP_US);
        }
    }
    int rc = fsc_flush(w->c, BENCH_FLUSH_TIMEOUT_MS);
    if (rc < 0)
        w->rc = fail(w->err, sizeof(w->err), rc, "fsc_flush: %s", strerror(-rc));
    return NULL;
}

struct phase_result {
    uint64_t reports;    /* acked, all clients */
    uint64_t wire_bytes; /* report frames */
    uint64_t enobufs;
    uint64_t reconnects;
    double secs;
};

/* Opens ph->clients clients as ranks 0..K-1 of ph->run, waits until all are
 * connected, then times first submit -> every report acked. Main thread. */
static int phase_run(struct phase *ph, struct phase_result *res, char *err, size_t errlen)
{
    int rc = 0;
    unsigned started = 0;
    struct worker *ws = calloc(ph->clients, sizeof(*ws));
    pthread_t *th = calloc(ph->clients, sizeof(*th));
    if (!ws || !th) {
        rc = fail(err, errlen, -ENOMEM, "%s: out of memory", ph->name);
        goto out;
    }
    for (unsigned i = 0; i < ph->clients; i++) {
        struct fsc_options o;
        fsc_options_init(&o);
        o.host = ph->host;
        o.port = ph->port;
        o.run_id = ph->run;
        o.rank = i;
        o.world_size = ph->clients;
        o.client_name = "bench_ingest";
        o.log = client_log;
        o.log_ctx = &ws[i];
        ws[i].ph = ph;
        ws[i].rank = i;
        char oerr[FSC_ERROR_LEN] = "";
        if ((rc = fsc_open(&o, &ws[i].c, oerr, sizeof(oerr))) < 0) {
            rc = fail(err, errlen, rc, "%s: fsc_open rank %u: %s %s", ph->name, i, strerror(-rc),
                      oerr);
            goto out;
        }
    }
    /* Connect and handshake outside the timed section. */
    double deadline = now_s() + BENCH_CONNECT_TIMEOUT_MS / 1000.0;
    for (unsigned i = 0; i < ph->clients;) {
        struct fsc_stats s = {.size = sizeof(s)};
        fsc_stats(ws[i].c, &s);
        if (s.connected) {
            i++;
            continue;
        }
        if (s.failed || now_s() > deadline) {
            rc = fail(err, errlen, -ETIMEDOUT, "%s: rank %u %s: %s", ph->name, i,
                      s.failed ? "failed" : "did not connect in time",
                      s.last_error[0] ? s.last_error : "no error text");
            goto out;
        }
        sleep_us(BENCH_POLL_MS * 1000L);
    }
    for (; started < ph->clients; started++) {
        if ((rc = pthread_create(&th[started], NULL, worker_run, &ws[started])) != 0) {
            rc = fail(err, errlen, -rc, "%s: pthread_create: %s", ph->name, strerror(rc));
            break;
        }
    }
    double t0 = now_s();
    pthread_mutex_lock(&ph->mu);
    ph->gate = rc == 0 ? 1 : -1;
    pthread_cond_broadcast(&ph->cv);
    pthread_mutex_unlock(&ph->mu);
    for (unsigned i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    res->secs = now_s() - t0;
    if (rc < 0)
        goto out;
    memset(res, 0, offsetof(struct phase_result, secs));
    for (unsigned i = 0; i < ph->clients; i++) {
        struct worker *w = &ws[i];
        if (w->rc < 0) {
            rc = fail(err, errlen, w->rc, "%s: rank %u: %s", ph->name, i, w->err);
            goto out;
        }
        struct fsc_stats s = {.size = sizeof(s)};
        fsc_stats(w->c, &s);
        if (s.failed || s.acked != ph->reports || s.buffered_reports != 0) {
            rc =
                fail(err, errlen, -EIO,
                     "%s: rank %u: acked %" PRIu64 " of %" PRIu64 " reports (buffered %" PRIu64
                     ", failed %d): %s",
                     ph->name, i, s.acked, ph->reports, s.buffered_reports, s.failed, s.last_error);
            goto out;
        }
        res->reports += s.acked;
        res->enobufs += w->enobufs;
        res->reconnects += s.reconnects;
        for (uint64_t step = 1; step <= ph->reports; step++)
            res->wire_bytes += report_wire_bytes(ph, i, step);
    }
out:
    for (unsigned i = 0; ws && i < ph->clients; i++) {
        if (!ws[i].c)
            continue;
        int crc = fsc_close_timeout(ws[i].c, rc == 0 ? BENCH_CLOSE_TIMEOUT_MS : 0);
        if (crc < 0 && rc == 0)
            rc = fail(err, errlen, crc, "%s: fsc_close rank %u: %s", ph->name, i, strerror(-crc));
    }
    free(ws);
    free(th);
    return rc;
}

/* --- bare SQLite reference ------------------------------------------------------- */

static int sql_exec(sqlite3 *db, const char *sql, const char *what, char *err, size_t errlen)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK)
        fail(err, errlen, -EIO, "bare sqlite: %s: %s", what, msg ? msg : sqlite3_errstr(rc));
    sqlite3_free(msg);
    return rc == SQLITE_OK ? 0 : -EIO;
}

static const char *const scalar_names[BENCH_NSCALARS] = {"loss",       "grad_norm", "lr",
                                                         "loss_scale", "tokens",    "step_time"};

/* Fresh database at path with the daemon's embedded migrations, WAL,
 * synchronous=NORMAL, foreign keys on; the same series the daemon creates
 * for `ranks` ranks; then times inserting steps x ranks x 6 points through
 * one prepared INSERT INTO points, txn_rows per transaction (the daemon's
 * own mean points per commit, measured in the same run: the same batching,
 * so that the ratio compares the code, not the transaction size). Main
 * thread. */
static int bare_insert(const char *path, unsigned ranks, uint64_t steps, uint64_t txn_rows,
                       uint64_t *points, double *secs, char *err, size_t errlen)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int64_t *series = calloc((size_t)ranks * BENCH_NSCALARS, sizeof(*series));
    int rc;
    if (!series) {
        rc = fail(err, errlen, -ENOMEM, "bare sqlite: out of memory");
        goto out;
    }
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL) != SQLITE_OK) {
        rc = fail(err, errlen, -EIO, "bare sqlite: open %s: %s", path,
                  db ? sqlite3_errmsg(db) : "out of memory");
        goto out;
    }
    const unsigned char *mode = NULL;
    if (sqlite3_prepare_v2(db, "PRAGMA journal_mode = WAL", -1, &st, NULL) != SQLITE_OK ||
        sqlite3_step(st) != SQLITE_ROW || !(mode = sqlite3_column_text(st, 0)) ||
        strcmp((const char *)mode, "wal") != 0) {
        rc = fail(err, errlen, -EIO, "bare sqlite: cannot enable WAL: %s", sqlite3_errmsg(db));
        goto out;
    }
    sqlite3_finalize(st);
    st = NULL;
    if ((rc = sql_exec(db, "PRAGMA synchronous = NORMAL", "synchronous", err, errlen)) < 0 ||
        (rc = sql_exec(db, "PRAGMA foreign_keys = ON", "foreign_keys", err, errlen)) < 0)
        goto out;
    for (int i = 0; i < schema_migration_count; i++) {
        const struct schema_migration *m = &schema_migrations[i];
        char uv[64];
        snprintf(uv, sizeof(uv), "PRAGMA user_version = %d", m->version);
        if ((rc = sql_exec(db, "BEGIN IMMEDIATE", m->name, err, errlen)) < 0 ||
            (rc = sql_exec(db, m->sql, m->name, err, errlen)) < 0 ||
            (rc = sql_exec(db, uv, m->name, err, errlen)) < 0 ||
            (rc = sql_exec(db, "COMMIT", m->name, err, errlen)) < 0)
            goto out;
    }
    char sql[256];
    snprintf(sql, sizeof(sql),
             "INSERT INTO runs (name, created_at, last_seen_at, world_size) "
             "VALUES ('bench-bare', 0, 0, %u)",
             ranks);
    if ((rc = sql_exec(db, sql, "insert run", err, errlen)) < 0)
        goto out;
    int64_t run_id = sqlite3_last_insert_rowid(db);
    if (sqlite3_prepare_v2(db, "INSERT INTO series (run_id, name, rank) VALUES (?1, ?2, ?3)", -1,
                           &st, NULL) != SQLITE_OK) {
        rc = fail(err, errlen, -EIO, "bare sqlite: prepare series: %s", sqlite3_errmsg(db));
        goto out;
    }
    for (unsigned r = 0; r < ranks; r++) {
        for (unsigned k = 0; k < BENCH_NSCALARS; k++) {
            if (sqlite3_bind_int64(st, 1, run_id) != SQLITE_OK ||
                sqlite3_bind_text(st, 2, scalar_names[k], -1, SQLITE_STATIC) != SQLITE_OK ||
                sqlite3_bind_int64(st, 3, r) != SQLITE_OK || sqlite3_step(st) != SQLITE_DONE ||
                sqlite3_reset(st) != SQLITE_OK) {
                rc = fail(err, errlen, -EIO, "bare sqlite: insert series: %s", sqlite3_errmsg(db));
                goto out;
            }
            series[(size_t)r * BENCH_NSCALARS + k] = sqlite3_last_insert_rowid(db);
        }
    }
    sqlite3_finalize(st);
    st = NULL;
    if (sqlite3_prepare_v2(db,
                           "INSERT INTO points (series_id, step, value, time) "
                           "VALUES (?1, ?2, ?3, ?4)",
                           -1, &st, NULL) != SQLITE_OK) {
        rc = fail(err, errlen, -EIO, "bare sqlite: prepare points: %s", sqlite3_errmsg(db));
        goto out;
    }
    uint64_t rows = 0;
    double t0 = now_s();
    if ((rc = sql_exec(db, "BEGIN", "begin", err, errlen)) < 0)
        goto out;
    for (uint64_t step = 1; step <= steps; step++) {
        for (unsigned r = 0; r < ranks; r++) {
            double v = scalar_loss(r, step);
            for (unsigned k = 0; k < BENCH_NSCALARS; k++) {
                if (sqlite3_bind_int64(st, 1, series[(size_t)r * BENCH_NSCALARS + k]) !=
                        SQLITE_OK ||
                    sqlite3_bind_int64(st, 2, (sqlite3_int64)step) != SQLITE_OK ||
                    sqlite3_bind_double(st, 3, v + k) != SQLITE_OK ||
                    sqlite3_bind_double(st, 4, 1.7e9 + (double)step) != SQLITE_OK ||
                    sqlite3_step(st) != SQLITE_DONE || sqlite3_reset(st) != SQLITE_OK) {
                    rc = fail(err, errlen, -EIO, "bare sqlite: insert point: %s",
                              sqlite3_errmsg(db));
                    sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
                    goto out;
                }
                if (++rows % txn_rows == 0 &&
                    ((rc = sql_exec(db, "COMMIT", "commit", err, errlen)) < 0 ||
                     (rc = sql_exec(db, "BEGIN", "begin", err, errlen)) < 0))
                    goto out;
            }
        }
    }
    if ((rc = sql_exec(db, "COMMIT", "commit", err, errlen)) < 0)
        goto out;
    *secs = now_s() - t0;
    *points = rows;
    rc = 0;
out:
    sqlite3_finalize(st);
    sqlite3_close(db);
    free(series);
    return rc;
}

/* --- synthetic Gram sketches ----------------------------------------------------- */

/* Heads' (ga, gb) triangles from random weights with a small update over the
 * window, as a trainer's shard would compute them. Caller frees *out. */
static int grams_make(float **out, size_t *tri, char *err, size_t errlen)
{
    size_t n = (size_t)BENCH_GRAM_DH * BENCH_GRAM_D, t = fsc_tri_len(2 * BENCH_GRAM_DH);
    float *w = malloc(4 * n * sizeof(float));
    float *g = malloc(BENCH_GRAM_HEADS * 2 * t * sizeof(float));
    int rc = 0;
    if (!w || !g) {
        rc = fail(err, errlen, -ENOMEM, "grams: out of memory");
        goto out;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (unsigned h = 0; h < BENCH_GRAM_HEADS && rc == 0; h++) {
        /* wq0, wk0 ~ U(-0.05, 0.05); wq, wk = those plus a 1% update. */
        for (size_t i = 0; i < 2 * n; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            w[2 * n + i] = (float)((double)(x >> 11) / 9007199254740992.0 - 0.5) * 0.1f;
            w[i] = w[2 * n + i] * (1.0f + 0.01f * (float)((i % 7) - 3.0));
        }
        float *ga = g + (size_t)h * 2 * t;
        if ((rc = fsc_attention_grams(w, w + n, w + 2 * n, w + 3 * n, BENCH_GRAM_DH, BENCH_GRAM_D,
                                      ga, ga + t)) < 0)
            fail(err, errlen, rc, "fsc_attention_grams: %s", strerror(-rc));
    }
out:
    free(w);
    if (rc < 0) {
        free(g);
        return rc;
    }
    *out = g;
    *tri = t;
    return 0;
}

/* --- temp directory --------------------------------------------------------------- */

/* Removes the files in dir (flat: the bench creates no subdirectories), then dir. */
static int tmpdir_remove(const char *dir, char *err, size_t errlen)
{
    DIR *d = opendir(dir);
    if (!d)
        return fail(err, errlen, -errno, "opendir %s: %s", dir, strerror(errno));
    int rc = 0;
    struct dirent *e;
    char p[BENCH_PATH_MAX];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
        if (unlink(p) != 0 && rc == 0)
            rc = fail(err, errlen, -errno, "unlink %s: %s", p, strerror(errno));
    }
    closedir(d);
    if (rmdir(dir) != 0 && rc == 0)
        rc = fail(err, errlen, -errno, "rmdir %s: %s", dir, strerror(errno));
    return rc;
}

/* --- options, output, main ----------------------------------------------------------- */

struct bench_cfg {
    char daemon[BENCH_PATH_MAX];
    unsigned clients, gram_clients;
    uint64_t reports, gram_reports, loopback_mb;
    int quick;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: bench_ingest [--daemon PATH] [--clients K] [--reports N]\n"
            "                    [--gram-clients K] [--gram-reports N] [--loopback-mb M]\n"
            "                    [--quick] [--help]\n"
            "\n"
            "Measures foreshockd ingest and storage throughput beside references taken in\n"
            "the same run (raw loopback TCP, a bare batched SQLite insert loop).\n"
            "\n"
            "  --daemon PATH      foreshockd binary (default: foreshockd next to this binary)\n"
            "  --clients K        scalar-report clients (default %u)\n"
            "  --reports N        scalar reports per client (default %u; --quick %u)\n"
            "  --gram-clients K   Gram-report clients (default %u)\n"
            "  --gram-reports N   Gram reports per client (default %u; --quick %u)\n"
            "  --loopback-mb M    bytes through the loopback reference, MB (default %u;\n"
            "                     --quick %u)\n"
            "  --quick            small sizes: the whole bench in a few seconds\n"
            "  --help             this text\n"
            "\n"
            "Exits 0 after printing the table and ratios, 1 on any failure.\n",
            BENCH_DEF_CLIENTS, BENCH_DEF_REPORTS, BENCH_QUICK_REPORTS, BENCH_DEF_GRAM_CLIENTS,
            BENCH_DEF_GRAM_REPORTS, BENCH_QUICK_GRAM_REPORTS, BENCH_DEF_LOOPBACK_MB,
            BENCH_QUICK_LOOPBACK_MB);
}

/* 0: run; 1: --help printed; -EINVAL: message printed. */
static int parse_args(int argc, char **argv, struct bench_cfg *cfg)
{
    static const struct option opts[] = {
        {"daemon", required_argument, NULL, 'd'},
        {"clients", required_argument, NULL, 'c'},
        {"reports", required_argument, NULL, 'n'},
        {"gram-clients", required_argument, NULL, 'C'},
        {"gram-reports", required_argument, NULL, 'N'},
        {"loopback-mb", required_argument, NULL, 'l'},
        {"quick", no_argument, NULL, 'q'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    unsigned long long v;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'd':
            if (strlen(optarg) >= sizeof(cfg->daemon)) {
                fprintf(stderr, "bench_ingest: --daemon path too long\n");
                return -EINVAL;
            }
            snprintf(cfg->daemon, sizeof(cfg->daemon), "%s", optarg);
            break;
        case 'c':
        case 'C':
            if (parse_uint(optarg, 1, BENCH_MAX_CLIENTS, &v) < 0) {
                fprintf(stderr, "bench_ingest: --%s wants 1..%u, got '%s'\n",
                        c == 'c' ? "clients" : "gram-clients", BENCH_MAX_CLIENTS, optarg);
                return -EINVAL;
            }
            *(c == 'c' ? &cfg->clients : &cfg->gram_clients) = (unsigned)v;
            break;
        case 'n':
        case 'N':
            if (parse_uint(optarg, 1, BENCH_MAX_REPORTS, &v) < 0) {
                fprintf(stderr, "bench_ingest: --%s wants 1..%u, got '%s'\n",
                        c == 'n' ? "reports" : "gram-reports", BENCH_MAX_REPORTS, optarg);
                return -EINVAL;
            }
            *(c == 'n' ? &cfg->reports : &cfg->gram_reports) = v;
            break;
        case 'l':
            if (parse_uint(optarg, 1, BENCH_MAX_LOOPBACK_MB, &v) < 0) {
                fprintf(stderr, "bench_ingest: --loopback-mb wants 1..%u, got '%s'\n",
                        BENCH_MAX_LOOPBACK_MB, optarg);
                return -EINVAL;
            }
            cfg->loopback_mb = v;
            break;
        case 'q':
            cfg->quick = 1;
            break;
        case 'h':
            usage(stdout);
            return 1;
        default:
            usage(stderr);
            return -EINVAL;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "bench_ingest: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return -EINVAL;
    }
    if (!cfg->clients)
        cfg->clients = BENCH_DEF_CLIENTS;
    if (!cfg->gram_clients)
        cfg->gram_clients = BENCH_DEF_GRAM_CLIENTS;
    if (!cfg->reports)
        cfg->reports = cfg->quick ? BENCH_QUICK_REPORTS : BENCH_DEF_REPORTS;
    if (!cfg->gram_reports)
        cfg->gram_reports = cfg->quick ? BENCH_QUICK_GRAM_REPORTS : BENCH_DEF_GRAM_REPORTS;
    if (!cfg->loopback_mb)
        cfg->loopback_mb = cfg->quick ? BENCH_QUICK_LOOPBACK_MB : BENCH_DEF_LOOPBACK_MB;
    return 0;
}

/* The default daemon: foreshockd in this binary's directory. */
static int default_daemon(char *out, size_t len, char *err, size_t errlen)
{
    char self[BENCH_PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n < 0)
        return fail(err, errlen, -errno, "readlink /proc/self/exe: %s (pass --daemon PATH)",
                    strerror(errno));
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash)
        *slash = '\0';
    if ((size_t)snprintf(out, len, "%s/foreshockd", slash ? self : ".") >= len)
        return fail(err, errlen, -ENAMETOOLONG, "path of this binary too long");
    return 0;
}

static void row(const char *name, double amount, const char *unit, double secs, double per_s,
                double mb_s)
{
    char ps[32] = "-", mb[32] = "-";
    if (per_s >= 0)
        snprintf(ps, sizeof(ps), "%.1f", per_s);
    if (mb_s >= 0)
        snprintf(mb, sizeof(mb), "%.2f", mb_s);
    printf("%-15s %14.0f %-8s %10.4f %14s %11s\n", name, amount, unit, secs, ps, mb);
}

int main(int argc, char **argv)
{
    struct bench_cfg cfg = {0};
    int prc = parse_args(argc, argv, &cfg);
    if (prc != 0)
        return prc > 0 ? 0 : 1;
    signal(SIGPIPE, SIG_IGN);

    char err[BENCH_ERR_LEN] = "", dir[] = "/tmp/foreshock-bench-XXXXXX";
    char db_path[BENCH_PATH_MAX], bare_path[BENCH_PATH_MAX];
    struct daemon d = {0};
    float *grams = NULL;
    size_t tri = 0;
    int have_dir = 0, rc = 0, show_log = 0;
    struct phase small = {.name = "ingest_small",
                          .run = SMALL_RUN,
                          .clients = cfg.clients,
                          .reports = cfg.reports,
                          .mu = PTHREAD_MUTEX_INITIALIZER,
                          .cv = PTHREAD_COND_INITIALIZER};
    struct phase gram = {.name = "ingest_gram",
                         .run = GRAM_RUN,
                         .clients = cfg.gram_clients,
                         .reports = cfg.gram_reports,
                         .mu = PTHREAD_MUTEX_INITIALIZER,
                         .cv = PTHREAD_COND_INITIALIZER};
    struct phase_result rs = {0}, rg = {0};
    double loop_mb_s = 0, loop_secs = 0, bare_secs = 0;
    uint64_t bare_points = 0;

    if (!cfg.daemon[0] &&
        (rc = default_daemon(cfg.daemon, sizeof(cfg.daemon), err, sizeof(err))) < 0)
        goto out;
    /* Fail before the loopback run when the daemon is missing. */
    if (access(cfg.daemon, X_OK) != 0) {
        rc = fail(err, sizeof(err), -ENOENT,
                  "foreshockd not found or not executable at %s (%s): build it, or pass "
                  "--daemon PATH",
                  cfg.daemon, strerror(errno));
        goto out;
    }
    if ((rc = grams_make(&grams, &tri, err, sizeof(err))) < 0)
        goto out;
    gram.grams = grams;
    gram.tri = tri;
    uint64_t gram_total = (uint64_t)cfg.gram_clients * cfg.gram_reports *
                          report_wire_bytes(&gram, cfg.gram_clients - 1, cfg.gram_reports);
    /* The daemon spools sketches until its monitor stage consumes them and
     * pushes back at its spool bound: stay well below the default bound. */
    if (gram_total > BENCH_MAX_GRAM_TOTAL_BYTES) {
        rc = fail(err, sizeof(err), -EINVAL,
                  "--gram-clients x --gram-reports is %" PRIu64 " MB of sketches, above the "
                  "bench's bound of %llu MB (the daemon's spool bound is 1 GiB by default)",
                  gram_total / 1000000, BENCH_MAX_GRAM_TOTAL_BYTES / 1000000);
        goto out;
    }
    if (!mkdtemp(dir)) {
        rc = fail(err, sizeof(err), -errno, "mkdtemp %s: %s", dir, strerror(errno));
        goto out;
    }
    have_dir = 1;
    snprintf(db_path, sizeof(db_path), "%s/daemon.db", dir);
    snprintf(bare_path, sizeof(bare_path), "%s/bare.db", dir);
    snprintf(d.log_path, sizeof(d.log_path), "%s/foreshockd.log", dir);

    printf("bench_ingest: daemon %s, %u clients x %" PRIu64 " scalar reports, %u clients x %" PRIu64
           " Gram reports (%u heads, dh %u), loopback %" PRIu64 " MB%s\n",
           cfg.daemon, cfg.clients, cfg.reports, cfg.gram_clients, cfg.gram_reports,
           BENCH_GRAM_HEADS, BENCH_GRAM_DH, cfg.loopback_mb, cfg.quick ? " (quick)" : "");
    fflush(stdout);

    if ((rc = loopback_measure(cfg.loopback_mb * 1000000ull, &loop_mb_s, &loop_secs, err,
                               sizeof(err))) < 0)
        goto out;

    if ((rc = daemon_start(cfg.daemon, db_path, &d, err, sizeof(err))) < 0) {
        show_log = 1;
        goto out;
    }
    small.host = gram.host = d.ingest_host;
    small.port = gram.port = d.ingest_port;
    show_log = 1; /* from here on a failure shows the daemon's log */
    uint64_t commits0, points0, commits1, points1;
    if ((rc = http_commit_counts(&d, &commits0, &points0, err, sizeof(err))) < 0 ||
        (rc = phase_run(&small, &rs, err, sizeof(err))) < 0 ||
        (rc = http_commit_counts(&d, &commits1, &points1, err, sizeof(err))) < 0 ||
        (rc = phase_run(&gram, &rg, err, sizeof(err))) < 0)
        goto out;
    if (commits1 <= commits0 || points1 <= points0) {
        rc = fail(err, sizeof(err), -EIO,
                  "the daemon committed nothing in ingest_small "
                  "(commits %" PRIu64 " -> %" PRIu64 ", points %" PRIu64 " -> %" PRIu64 ")",
                  commits0, commits1, points0, points1);
        goto out;
    }
    uint64_t txn_rows = ((points1 - points0) + (commits1 - commits0) / 2) / (commits1 - commits0);
    if (txn_rows < 1)
        txn_rows = 1;
    int64_t http_small, http_gram;
    if ((rc = http_run_reports(&d, SMALL_RUN, &http_small, err, sizeof(err))) < 0 ||
        (rc = http_run_reports(&d, GRAM_RUN, &http_gram, err, sizeof(err))) < 0)
        goto out;
    if ((uint64_t)http_small != rs.reports || (uint64_t)http_gram != rg.reports) {
        rc = fail(err, sizeof(err), -EIO,
                  "daemon reports %" PRId64 " (%s) and %" PRId64 " (%s) committed reports, "
                  "clients had %" PRIu64 " and %" PRIu64 " acked",
                  http_small, SMALL_RUN, http_gram, GRAM_RUN, rs.reports, rg.reports);
        goto out;
    }
    if ((rc = daemon_stop(&d, err, sizeof(err))) < 0)
        goto out;
    int64_t pts_small, pts_gram;
    if ((rc = db_count_points(db_path, SMALL_RUN, &pts_small, err, sizeof(err))) < 0 ||
        (rc = db_count_points(db_path, GRAM_RUN, &pts_gram, err, sizeof(err))) < 0)
        goto out;
    if ((uint64_t)pts_small != BENCH_NSCALARS * rs.reports ||
        (uint64_t)pts_gram != BENCH_NSCALARS * rg.reports) {
        rc = fail(err, sizeof(err), -EIO,
                  "daemon stored %" PRId64 " and %" PRId64 " points, expected %" PRIu64
                  " and %" PRIu64,
                  pts_small, pts_gram, BENCH_NSCALARS * rs.reports, BENCH_NSCALARS * rg.reports);
        goto out;
    }
    show_log = 0;

    if ((rc = bare_insert(bare_path, cfg.clients, cfg.reports, txn_rows, &bare_points, &bare_secs,
                          err, sizeof(err))) < 0)
        goto out;

    double small_mb_s = (double)rs.wire_bytes / 1e6 / rs.secs;
    double gram_mb_s = (double)rg.wire_bytes / 1e6 / rg.secs;
    double daemon_pts_s = (double)(BENCH_NSCALARS * rs.reports) / rs.secs;
    double bare_pts_s = (double)bare_points / bare_secs;
    printf("\n%-15s %14s %-8s %10s %14s %11s\n", "measurement", "amount", "unit", "seconds",
           "per_second", "MB/s");
    row("loopback_tcp", (double)cfg.loopback_mb, "MB", loop_secs, -1, loop_mb_s);
    row("ingest_small", (double)rs.reports, "reports", rs.secs, (double)rs.reports / rs.secs,
        small_mb_s);
    row("ingest_gram", (double)rg.reports, "reports", rg.secs, (double)rg.reports / rg.secs,
        gram_mb_s);
    row("points_daemon", (double)(BENCH_NSCALARS * rs.reports), "points", rs.secs, daemon_pts_s,
        -1);
    row("points_bare", (double)bare_points, "points", bare_secs, bare_pts_s, -1);
    printf("\nwire bytes per report: small %.1f, gram %.1f; ENOBUFS retries: small %" PRIu64
           ", gram %" PRIu64 "; reconnects: %" PRIu64 "\n",
           (double)rs.wire_bytes / (double)rs.reports, (double)rg.wire_bytes / (double)rg.reports,
           rs.enobufs, rg.enobufs, rs.reconnects + rg.reconnects);
    printf("points_bare commits every %" PRIu64 " rows: the daemon's mean in ingest_small (%" PRIu64
           " points in %" PRIu64 " commits, one per writer batch)\n",
           txn_rows, points1 - points0, commits1 - commits0);
    printf("ratio ingest_small_mb_s/loopback_mb_s = %.4g\n", small_mb_s / loop_mb_s);
    printf("ratio ingest_gram_mb_s/loopback_mb_s = %.4g\n", gram_mb_s / loop_mb_s);
    printf("ratio points_daemon_per_s/points_bare_per_s = %.4g\n", daemon_pts_s / bare_pts_s);
    rc = 0;
out:
    if (rc < 0)
        fprintf(stderr, "bench_ingest: %s\n", err);
    if (d.pid > 0) {
        char serr[BENCH_ERR_LEN];
        if (daemon_stop(&d, serr, sizeof(serr)) < 0) {
            fprintf(stderr, "bench_ingest: %s\n", serr);
            show_log = 1;
            rc = rc < 0 ? rc : -EIO;
        }
    }
    if (show_log && rc < 0)
        daemon_print_log(&d);
    if (have_dir) {
        char terr[BENCH_ERR_LEN];
        if (tmpdir_remove(dir, terr, sizeof(terr)) < 0) {
            fprintf(stderr, "bench_ingest: removing %s: %s\n", dir, terr);
            rc = rc < 0 ? rc : -EIO;
        }
    }
    free(grams);
    return rc < 0 ? 1 : 0;
}
