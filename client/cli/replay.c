/* `foreshock replay FILE...`: streams recordings (foreshock.h, "Recordings")
 * into a daemon through libforeshock, one client per file, as fast as the
 * daemon acknowledges or at the recorded pace.
 *
 * Several files (one per rank of a run) are interleaved by step, lowest
 * first, so the daemon sees the ranks of a step together as it would from a
 * live job; a step's shards never wait for a whole other file. Nothing is
 * dropped: when a client's replay buffer is half full, replay waits for
 * acknowledgements instead of submitting more. Single-threaded (each
 * client has its own I/O thread). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "foreshock.h"
#include "foreshock.pb-c.h"
#include "recording.h"

#define REPLAY_MAX_FILES 1024                   /* files (ranks) in one replay */
#define REPLAY_BUFFER_BYTES ((size_t)256 << 20) /* per client: unacknowledged reports */
#define REPLAY_WAIT_MS 50                       /* one wait for acknowledgements */
#define REPLAY_RECORDED_ATTEMPT UINT64_MAX      /* --attempt not given */

struct replay_settings {
    const char *endpoint, *run, *token;
    uint64_t attempt; /* REPLAY_RECORDED_ATTEMPT: the recorded one */
    int pace;
    double speed, timeout;
};

static const struct opt replay_opts[] = {
    {.name = "endpoint",
     .kind = OPT_HOSTPORT,
     .offset = offsetof(struct replay_settings, endpoint),
     .arg = "HOST:PORT",
     .help = "daemon ingest address (default " CLI_DEFAULT_ENDPOINT ")"},
    {.name = "run",
     .kind = OPT_STR,
     .offset = offsetof(struct replay_settings, run),
     .arg = "ID",
     .help = "run id to replay into (default: the recorded one)"},
    {.name = "attempt",
     .kind = OPT_U64,
     .offset = offsetof(struct replay_settings, attempt),
     .arg = "N",
     .help = "attempt to replay as (default: the recorded one)",
     .max = UINT32_MAX},
    {.name = "token",
     .kind = OPT_STR,
     .offset = offsetof(struct replay_settings, token),
     .arg = "TOKEN",
     .help = "ingest token (default $FORESHOCK_TOKEN; recordings hold none)"},
    {.name = "pace",
     .kind = OPT_FLAG,
     .offset = offsetof(struct replay_settings, pace),
     .help = "send at the recorded pace (report times) instead of as fast as possible"},
    {.name = "speed",
     .kind = OPT_DOUBLE,
     .offset = offsetof(struct replay_settings, speed),
     .arg = "X",
     .help = "with --pace: X times the recorded pace (default 1)",
     .dmin = 1e-3,
     .dmax = 1e6},
    {.name = "timeout",
     .kind = OPT_DOUBLE,
     .offset = offsetof(struct replay_settings, timeout),
     .arg = "SECONDS",
     .help = "wait at most this long for the last acknowledgements (default 60)",
     .dmin = 0,
     .dmax = 86400},
};

static const struct command_help replay_help = {
    .usage = "foreshock replay FILE [FILE...] [options]",
    .summary =
        "Stream recordings (Monitor(record=...), FORESHOCK_RECORD, fsc_options.record_path)\n"
        "into a daemon: one connection per file, reports interleaved by step. Exit 0 when\n"
        "every report was acknowledged as committed. A report the daemon refuses is named\n"
        "and makes the exit status 1; one it would refuse even as an empty placeholder (a\n"
        "step not below 2^63, a time that is not finite) stops the replay at once with an\n"
        "error naming the file and the report.",
};

/* One recording being replayed. */
struct source {
    const char *path;
    FILE *f;
    struct recording rec;
    Foreshock__Frame *next; /* the next Report frame, NULL at the end */
    fsc_client *client;
    uint64_t submitted;
    int truncation_noted;
};

/* Loads the next Report frame into s->next (NULL at the end). 0 or -1
 * (message printed). */
static int advance(struct source *s)
{
    char err[CLI_ERR_LEN];

    if (s->next)
        foreshock__frame__free_unpacked(s->next, NULL);
    s->next = NULL;
    int rc = recording_next(&s->rec, &s->next, err, sizeof(err));
    if (rc < 0) {
        fprintf(stderr, "replay: %s\n", err);
        return -1;
    }
    if (rc == 0 && s->rec.truncated && !s->truncation_noted) {
        fprintf(stderr, "replay: %s: ends with a partial frame after %llu reports (cut short?)\n",
                s->path, (unsigned long long)s->rec.reports);
        s->truncation_noted = 1;
    }
    return 0;
}

static void log_cb(void *ctx, int level, const char *msg)
{
    const struct source *s = ctx;
    if (level >= FSC_LOG_WARN)
        fprintf(stderr, "replay: %s: %s\n", s->path, msg);
}

/* Opens the file, checks the magic, reads the Hello and opens a client with
 * its identity. 0 or -1 (message printed). */
static int source_open(struct source *s, const struct replay_settings *st)
{
    char err[CLI_ERR_LEN], host[CLI_MAX_HOSTPORT];
    Foreshock__Frame *f = NULL;
    struct fsc_options o;
    uint16_t port;
    int rc = -1;

    if (!(s->f = fopen(s->path, "rbe"))) {
        fprintf(stderr, "replay: %s: %s\n", s->path, strerror(errno));
        return -1;
    }
    s->rec = (struct recording){.path = s->path, .f = s->f};
    if (recording_start(&s->rec, &f, err, sizeof(err)) < 0) {
        fprintf(stderr, "replay: %s\n", err);
        return -1;
    }
    const Foreshock__Hello *h = f->hello;
    const Foreshock__ModelShape *m = h->model;
    fsc_options_init(&o);
    args_hostport(st->endpoint, host, sizeof(host), &port); /* checked by args_parse */
    o.host = host;
    o.port = port;
    o.run_id = st->run ? st->run : h->run_id;
    o.attempt = st->attempt == REPLAY_RECORDED_ATTEMPT ? h->attempt : (uint32_t)st->attempt;
    o.rank = h->rank;
    o.world_size = h->world_size;
    o.token = st->token;
    o.detect_from_step = h->has_detect_from_step ? h->detect_from_step : 0;
    o.replay_max_bytes = REPLAY_BUFFER_BYTES;
    o.max_report_bytes = FSC_MAX_REPORT_BYTES_LIMIT;
    o.client_name = h->client_name; /* the recorded trainer's name, for the daemon's log */
    o.log = log_cb;
    o.log_ctx = s;
    if (m) {
        o.model = (struct fsc_model_shape){.n_layers = m->n_layers,
                                           .n_heads = m->n_heads,
                                           .n_kv_heads = m->n_kv_heads,
                                           .d_model = m->d_model,
                                           .d_head = m->d_head,
                                           .n_experts = m->n_experts,
                                           .top_k = m->top_k,
                                           .moe_layers = m->moe_layers,
                                           .n_moe_layers = m->n_moe_layers};
        o.optimizer = m->optimizer; /* NULL when the recording has none */
    }
    if (fsc_open(&o, &s->client, err, sizeof(err)) < 0) {
        fprintf(stderr, "replay: %s: %s\n", s->path, err);
        goto out;
    }
    rc = advance(s);
out:
    if (f)
        foreshock__frame__free_unpacked(f, NULL);
    return rc;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    if (s <= 0)
        return;
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - floor(s)) * 1e9)};
    nanosleep(&ts, NULL);
}

/* Submits s->next, waiting for acknowledgements while the client's buffer
 * is half full. 0 or -1 (message printed). */
static int submit_next(struct source *s)
{
    const Foreshock__Report *r = s->next->report;
    size_t len = foreshock__report__get_packed_size(r);
    struct fsc_stats stats = {.size = sizeof(stats)};
    uint8_t *buf;
    int rc;

    for (;;) {
        fsc_stats(s->client, &stats);
        if (stats.failed) {
            fprintf(stderr, "replay: %s: client failed: %s\n", s->path, stats.last_error);
            return -1;
        }
        if (stats.buffered_bytes + len <= REPLAY_BUFFER_BYTES / 2 || stats.buffered_reports == 0)
            break;
        (void)fsc_flush(s->client, REPLAY_WAIT_MS);
    }
    if (!(buf = malloc(len ? len : 1))) {
        fprintf(stderr, "replay: %s: out of memory\n", s->path);
        return -1;
    }
    foreshock__report__pack(r, buf);
    rc = fsc_submit_packed(s->client, buf, len);
    free(buf);
    if (rc < 0) {
        fsc_stats(s->client, &stats);
        fprintf(stderr, "replay: %s: report %llu (step %llu) refused: %s\n", s->path,
                (unsigned long long)s->rec.reports, (unsigned long long)r->step,
                stats.last_error[0] ? stats.last_error : strerror(-rc));
        return -1;
    }
    s->submitted++;
    return 0;
}

int cmd_replay(int argc, char **argv)
{
    struct replay_settings st = {.endpoint = CLI_DEFAULT_ENDPOINT,
                                 .attempt = REPLAY_RECORDED_ATTEMPT,
                                 .speed = 1,
                                 .timeout = 60};
    struct source *src = NULL;
    char err[CLI_ERR_LEN];
    int nfiles = 0, rc = CLI_FAIL;

    while (nfiles < argc && strncmp(argv[nfiles], "--", 2) != 0 && strcmp(argv[nfiles], "-h"))
        nfiles++;
    int prc = args_parse(replay_opts, sizeof(replay_opts) / sizeof(replay_opts[0]), argc - nfiles,
                         argv + nfiles, &st, &replay_help, err, sizeof(err));
    if (prc == 1)
        return CLI_OK;
    if (prc != 0) {
        fprintf(stderr, "foreshock replay: %s\n", err);
        return CLI_USAGE;
    }
    if (nfiles == 0 || nfiles > REPLAY_MAX_FILES) {
        fprintf(stderr, "foreshock replay: give 1 to %d recording files (see --help)\n",
                REPLAY_MAX_FILES);
        return CLI_USAGE;
    }
    if (!st.token)
        st.token = getenv("FORESHOCK_TOKEN");
    if (!(src = calloc((size_t)nfiles, sizeof(*src)))) {
        fprintf(stderr, "foreshock replay: out of memory\n");
        return CLI_FAIL;
    }
    for (int i = 0; i < nfiles; i++) {
        src[i].path = argv[i];
        if (source_open(&src[i], &st) < 0)
            goto out;
    }

    double t0 = now_s(), rec0 = NAN;
    for (;;) {
        struct source *pick = NULL;
        for (int i = 0; i < nfiles; i++)
            if (src[i].next && (!pick || src[i].next->report->step < pick->next->report->step))
                pick = &src[i];
        if (!pick)
            break;
        const Foreshock__Report *r = pick->next->report;
        if (st.pace && r->has_time_unix && isfinite(r->time_unix)) {
            if (isnan(rec0))
                rec0 = r->time_unix;
            sleep_s(t0 + (r->time_unix - rec0) / st.speed - now_s());
        }
        if (submit_next(pick) < 0 || advance(pick) < 0)
            goto out;
    }

    rc = CLI_OK;
    for (int i = 0; i < nfiles; i++) {
        int frc = fsc_flush(src[i].client, (int)(st.timeout * 1000));
        struct fsc_stats s = {.size = sizeof(s)};
        fsc_stats(src[i].client, &s);
        printf("replay: %s: %llu reports, %llu acknowledged%s%s\n", src[i].path,
               (unsigned long long)src[i].submitted, (unsigned long long)s.acked,
               src[i].rec.truncated ? " (recording cut short)" : "",
               frc < 0 ? ": not all acknowledged" : "");
        if (frc < 0 || s.acked != src[i].submitted || s.dropped)
            rc = CLI_FAIL;
    }
out:
    for (int i = 0; i < nfiles; i++) {
        if (src[i].client)
            fsc_close_timeout(src[i].client, 0);
        if (src[i].next)
            foreshock__frame__free_unpacked(src[i].next, NULL);
        if (src[i].f)
            fclose(src[i].f);
        recording_free(&src[i].rec);
    }
    free(src);
    return rc;
}
