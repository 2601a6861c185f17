/* bench_monitor: heads per second of the QK monitor math (Gram kind).
 *
 * For each head dim it times, on the same random Grams (d = 4 dh, updates
 * 1e-2 of the weights), one OpenBLAS thread throughout:
 *   module   qk_head_from_grams: unpack, norms, c_qk, four spectra, scalars;
 *   floor    the bare LAPACK/BLAS calls of the same (Cholesky) route on
 *            ready full matrices: dpotrf, 2 dtrmm, dsyev('N') per spectrum
 *            (one dpotrf shared by d2 and d1), plus the copies LAPACK needs
 *            because it overwrites its input;
 *   eig      the bare calls of docs/monitors.md's eigen route, for comparison:
 *            dsyevd('V') of G1, C = L^1/2 V^T G2 V L^1/2 (2 dgemm), dsyev('N');
 *   numpy    tests/bench/monitor_numpy.py on the same Grams (written to a
 *            temporary file), the same math, both routes, in heads/s. The
 *            baseline does the same work as the C code, call for call:
 *            its Cholesky route is dpotrf, two dtrmm (scipy's BLAS wrapper)
 *            and dsyevd without vectors, as the module's is dpotrf, two
 *            dtrmm and dsyev('N') (the same tridiagonal reduction and
 *            dsterf); its eigen route is the eig column's dsyevd('V') and
 *            two dgemm. So mod/numpy is what C saves over Python driving
 *            the same LAPACK, not a cheaper algorithm. (Before 2026-12-03
 *            the numpy route formed C with two dense GEMMs, twice the
 *            flops of the triangular products, and the ratio was ~2x.)
 * Each figure is heads per CPU second of the measuring thread (C:
 * CLOCK_THREAD_CPUTIME_ID; numpy: time.thread_time), the best of 3 rounds
 * of --seconds of CPU each: on a shared machine wall time would count the
 * other processes' turns too (measured: ratios swinging 0.5x-1.8x between
 * runs at load 4 on 2 cores).
 *
 * With --sketch-heads N it also prints, per head dim, what one sketch step
 * of N heads costs (N = layers x query heads: 1,024 for the 7B shape, 32 x
 * 32): the LAPACK floor and the module in CPU seconds, and the module's
 * wall time spread over the online CPUs as the daemon's math workers
 * (`workers = 0`, one per CPU) would at best, with nothing else running.
 *
 * usage: bench_monitor [--dh 64,128] [--heads 8] [--seconds 0.5]
 *                      [--numpy PATH|none] [--python /usr/bin/python3]
 *                      [--sketch-heads N] */
#include <cblas.h>
#include <errno.h>
#include <lapacke.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "monitor_qk.h"

#define BENCH_MAX_HEADS 64
#define BENCH_ROUNDS 3
#define BENCH_MAX_DHS 8
#define BENCH_PATH_MAX 4096
#define BENCH_MAX_SKETCH_HEADS (1u << 20)

/* CPU time of this thread: every figure is heads per CPU second (OpenBLAS
 * runs on this one thread). The machine is shared; wall time would also
 * count the turns other processes take on the core, differently for each
 * column, and the ratios would measure the neighbours. */
static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double gauss(uint64_t *s)
{
    double u = ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
    double v = (double)(rng_next(s) >> 11) / 9007199254740992.0;
    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

struct head_in {
    double *ga, *gb; /* upper triangles, the module's input */
    double *fa, *fb; /* the same, full column-major, the floor's input */
};

/* Grams of A = [dWq; Wq], B = [Wk; dWk] for random weights. */
static int head_make(struct head_in *h, size_t dh, uint64_t *seed)
{
    size_t n = 2 * dh, d = 4 * dh, len = monitor_tri_len(n);
    double *a = malloc(n * d * sizeof(*a)), *b = malloc(n * d * sizeof(*b));
    h->ga = malloc(len * sizeof(double));
    h->gb = malloc(len * sizeof(double));
    h->fa = malloc(n * n * sizeof(double));
    h->fb = malloc(n * n * sizeof(double));
    if (!a || !b || !h->ga || !h->gb || !h->fa || !h->fb) {
        free(a);
        free(b);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++)
        for (size_t c = 0; c < d; c++) {
            double scale_a = i < dh ? 1e-2 : 1.0, scale_b = i < dh ? 1.0 : 1e-2;
            a[i * d + c] = scale_a * gauss(seed);
            b[i * d + c] = scale_b * gauss(seed);
        }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)d, 1.0, a, (int)d, a,
                (int)d, 0.0, h->fa, (int)n);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)n, (int)d, 1.0, b, (int)d, b,
                (int)d, 0.0, h->fb, (int)n);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = i; j < n; j++, k++) {
            h->ga[k] = h->fa[i * n + j];
            h->gb[k] = h->fb[i * n + j];
        }
    free(a);
    free(b);
    return 0;
}

static void head_free(struct head_in *h)
{
    free(h->ga);
    free(h->gb);
    free(h->fa);
    free(h->fb);
}

/* Scratch for the floor and eigen-route timings. */
struct scratch {
    double *f, *c, *t, *v, *w, *work;
    lapack_int lwork, liwork;
    lapack_int *iwork;
};

static int scratch_make(struct scratch *s, size_t n)
{
    s->f = malloc(n * n * sizeof(double));
    s->c = malloc(n * n * sizeof(double));
    s->t = malloc(n * n * sizeof(double));
    s->v = malloc(n * n * sizeof(double));
    s->w = malloc(n * sizeof(double));
    double q1 = 0, q2 = 0;
    lapack_int iq = 0;
    if (!s->f || !s->c || !s->t || !s->v || !s->w)
        return -ENOMEM;
    LAPACKE_dsyev_work(LAPACK_COL_MAJOR, 'N', 'L', (lapack_int)n, s->c, (lapack_int)n, s->w, &q1,
                       -1);
    LAPACKE_dsyevd_work(LAPACK_COL_MAJOR, 'V', 'L', (lapack_int)n, s->c, (lapack_int)n, s->w, &q2,
                        -1, &iq, -1);
    s->lwork = (lapack_int)fmax(q1, q2);
    s->liwork = iq;
    s->work = malloc((size_t)s->lwork * sizeof(double));
    s->iwork = malloc((size_t)s->liwork * sizeof(lapack_int));
    return s->work && s->iwork ? 0 : -ENOMEM;
}

static void scratch_free(struct scratch *s)
{
    free(s->f);
    free(s->c);
    free(s->t);
    free(s->v);
    free(s->w);
    free(s->work);
    free(s->iwork);
}

static void copy_block(const double *g, size_t ld, size_t m, double *dst)
{
    for (size_t j = 0; j < m; j++)
        memcpy(dst + j * m, g + j * ld, m * sizeof(double));
}

/* Floor, Cholesky route: lambda(G1 G2) given the factor in s->f. */
static void floor_project(struct scratch *s, const double *g2, size_t ld, size_t m)
{
    copy_block(g2, ld, m, s->c);
    cblas_dtrmm(CblasColMajor, CblasRight, CblasLower, CblasNoTrans, CblasNonUnit, (int)m, (int)m,
                1.0, s->f, (int)m, s->c, (int)m);
    cblas_dtrmm(CblasColMajor, CblasLeft, CblasLower, CblasTrans, CblasNonUnit, (int)m, (int)m, 1.0,
                s->f, (int)m, s->c, (int)m);
    LAPACKE_dsyev_work(LAPACK_COL_MAJOR, 'N', 'L', (lapack_int)m, s->c, (lapack_int)m, s->w,
                       s->work, s->lwork);
}

static void floor_factor(struct scratch *s, const double *g1, size_t ld, size_t m)
{
    copy_block(g1, ld, m, s->f);
    LAPACKE_dpotrf_work(LAPACK_COL_MAJOR, 'L', (lapack_int)m, s->f, (lapack_int)m);
}

static void floor_head(struct scratch *s, const struct head_in *h, size_t dh)
{
    size_t n = 2 * dh;
    floor_factor(s, h->fa, n, n); /* d2 and d1 share it */
    floor_project(s, h->fb, n, n);
    floor_project(s, h->fb, n, n);
    floor_factor(s, h->fa, n, dh); /* Qdd, Kdd */
    floor_project(s, h->fb + dh + dh * n, n, dh);
    floor_factor(s, h->fa + dh + dh * n, n, dh); /* Qww, Kww */
    floor_project(s, h->fb, n, dh);
}

/* Eigen route: G1 = V L V^T once, then C = (V L^1/2)^T G2 (V L^1/2). */
static void eig_factor(struct scratch *s, const double *g1, size_t ld, size_t m)
{
    copy_block(g1, ld, m, s->v);
    LAPACKE_dsyevd_work(LAPACK_COL_MAJOR, 'V', 'L', (lapack_int)m, s->v, (lapack_int)m, s->w,
                        s->work, s->lwork, s->iwork, s->liwork);
    for (size_t j = 0; j < m; j++) {
        double r = s->w[j] > 0 ? sqrt(s->w[j]) : 0.0;
        for (size_t i = 0; i < m; i++)
            s->v[i + j * m] *= r;
    }
}

static void eig_project(struct scratch *s, const double *g2, size_t ld, size_t m)
{
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)m, (int)m, 1.0, g2, (int)ld,
                s->v, (int)m, 0.0, s->t, (int)m);
    cblas_dgemm(CblasColMajor, CblasTrans, CblasNoTrans, (int)m, (int)m, (int)m, 1.0, s->v, (int)m,
                s->t, (int)m, 0.0, s->c, (int)m);
    LAPACKE_dsyev_work(LAPACK_COL_MAJOR, 'N', 'L', (lapack_int)m, s->c, (lapack_int)m, s->w,
                       s->work, s->lwork);
}

static void eig_head(struct scratch *s, const struct head_in *h, size_t dh)
{
    size_t n = 2 * dh;
    eig_factor(s, h->fa, n, n);
    eig_project(s, h->fb, n, n);
    eig_project(s, h->fb, n, n);
    eig_factor(s, h->fa, n, dh);
    eig_project(s, h->fb + dh + dh * n, n, dh);
    eig_factor(s, h->fa + dh + dh * n, n, dh);
    eig_project(s, h->fb, n, dh);
}

enum kind { KIND_MODULE, KIND_FLOOR, KIND_EIG };

struct run {
    enum kind kind;
    size_t dh, heads;
    struct head_in *in;
    struct qk_workspace *ws;
    struct scratch *s;
    double checksum;
};

/* Heads per second over one round of at least `seconds`. */
static double round_rate(struct run *r, double seconds)
{
    size_t done = 0;
    double t0 = now(), t;
    r->checksum = 0;
    do {
        for (size_t i = 0; i < r->heads; i++, done++) {
            const struct head_in *h = &r->in[i];
            if (r->kind == KIND_MODULE) {
                struct qk_head out;
                qk_head_from_grams(r->ws, (unsigned)r->dh, h->ga, h->gb, &out);
                if (done < r->heads)
                    for (int k = 0; k < QK_NSPECTRA; k++)
                        r->checksum += out.spec[k].erank2;
            } else if (r->kind == KIND_FLOOR) {
                floor_head(r->s, h, r->dh);
            } else {
                eig_head(r->s, h, r->dh);
            }
        }
        t = now();
    } while (t - t0 < seconds);
    return (double)done / (t - t0);
}

static double best_rate(struct run *r, double seconds)
{
    double best = 0;
    for (int i = 0; i < BENCH_ROUNDS; i++)
        best = fmax(best, round_rate(r, seconds));
    return best;
}

/* Grams file for the numpy script: "FSGRAMS1", u32 dh, u32 heads, then per
 * head GA and GB upper triangles as float64 little-endian (this host). */
static int write_grams(const char *path, size_t dh, const struct head_in *in, size_t heads)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -errno;
    uint32_t hdr[2] = {(uint32_t)dh, (uint32_t)heads};
    size_t len = monitor_tri_len(2 * dh);
    int ok = fwrite("FSGRAMS1", 1, 8, f) == 8 && fwrite(hdr, sizeof hdr, 1, f) == 1;
    for (size_t i = 0; ok && i < heads; i++)
        ok = fwrite(in[i].ga, sizeof(double), len, f) == len &&
             fwrite(in[i].gb, sizeof(double), len, f) == len;
    if (fclose(f) != 0)
        ok = 0;
    return ok ? 0 : -EIO;
}

struct numpy_result {
    double chol, eig, checksum;
    int ok;
};

static struct numpy_result run_numpy(const char *python, const char *script, const char *grams,
                                     double seconds)
{
    struct numpy_result r = {0};
    char cmd[3 * BENCH_PATH_MAX];
    snprintf(cmd, sizeof cmd,
             "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 '%s' '%s' --input '%s' --seconds %g "
             "--rounds %d",
             python, script, grams, seconds, BENCH_ROUNDS);
    FILE *p = popen(cmd, "r");
    if (!p)
        return r;
    char line[512];
    while (fgets(line, sizeof line, p)) {
        double rate, sum;
        char route[16];
        if (sscanf(line, "route=%15s heads_per_s=%lf checksum=%lf", route, &rate, &sum) == 3) {
            if (strcmp(route, "chol") == 0)
                r.chol = rate;
            else if (strcmp(route, "eig") == 0)
                r.eig = rate;
            r.checksum = sum;
        } else {
            fputs(line, stderr);
        }
    }
    r.ok = pclose(p) == 0 && r.chol > 0;
    return r;
}

static void default_script(char *out, size_t size)
{
    /* The script sits next to this source file. */
    const char *src = __FILE__;
    const char *slash = strrchr(src, '/');
    if (!slash) {
        snprintf(out, size, "monitor_numpy.py");
        return;
    }
    snprintf(out, size, "%.*s/monitor_numpy.py", (int)(slash - src), src);
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_monitor [--dh 64,128] [--heads 8] [--seconds 0.5] "
                    "[--numpy PATH|none] [--python /usr/bin/python3] [--sketch-heads N]\n");
}

int main(int argc, char **argv)
{
    size_t dhs[BENCH_MAX_DHS] = {64, 128}, n_dh = 2, heads = 8, sketch_heads = 0;
    double seconds = 0.5;
    char script[BENCH_PATH_MAX];
    const char *python = "/usr/bin/python3";
    default_script(script, sizeof script);
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            usage();
            return 2;
        }
        if (strcmp(argv[i], "--dh") == 0) {
            n_dh = 0;
            for (char *p = (char *)v; *p && n_dh < BENCH_MAX_DHS;) {
                char *end;
                unsigned long x = strtoul(p, &end, 10);
                if (end == p || x == 0 || x > QK_MAX_DH) {
                    usage();
                    return 2;
                }
                dhs[n_dh++] = x;
                p = *end == ',' ? end + 1 : end;
            }
        } else if (strcmp(argv[i], "--heads") == 0) {
            heads = strtoul(v, NULL, 10);
            if (heads == 0 || heads > BENCH_MAX_HEADS) {
                usage();
                return 2;
            }
        } else if (strcmp(argv[i], "--sketch-heads") == 0) {
            char *end;
            sketch_heads = strtoul(v, &end, 10);
            if (*end || sketch_heads == 0 || sketch_heads > BENCH_MAX_SKETCH_HEADS) {
                usage();
                return 2;
            }
        } else if (strcmp(argv[i], "--seconds") == 0) {
            seconds = strtod(v, NULL);
        } else if (strcmp(argv[i], "--numpy") == 0) {
            snprintf(script, sizeof script, "%s", v);
        } else if (strcmp(argv[i], "--python") == 0) {
            python = v;
        } else {
            usage();
            return 2;
        }
        i++;
    }
    monitor_init();
    const char *core = getenv("OPENBLAS_CORETYPE");
    printf("bench_monitor: Gram kind, d = 4 dh, %zu distinct heads, best of %d rounds of %.2f "
           "CPU s, heads per CPU second, OpenBLAS 1 thread%s%s\n",
           heads, BENCH_ROUNDS, seconds, core ? ", OPENBLAS_CORETYPE=" : "", core ? core : "");
    printf("%5s %12s %12s %12s %12s %12s %10s %10s\n", "dh", "module/s", "floor/s", "eig/s",
           "numpy/s", "numpy-eig/s", "floor/mod", "mod/numpy");
    int status = 0;
    uint64_t seed = 2024;
    for (size_t di = 0; di < n_dh; di++) {
        size_t dh = dhs[di];
        struct head_in in[BENCH_MAX_HEADS] = {0};
        struct scratch s = {0};
        struct qk_workspace *ws = NULL;
        int rc = qk_workspace_create((unsigned)dh, &ws);
        if (rc == 0)
            rc = scratch_make(&s, 2 * dh);
        for (size_t i = 0; rc == 0 && i < heads; i++)
            rc = head_make(&in[i], dh, &seed);
        if (rc != 0) {
            fprintf(stderr, "bench_monitor: setup failed: %s\n", strerror(-rc));
            return 1;
        }
        struct run mod = {KIND_MODULE, dh, heads, in, ws, &s, 0};
        struct run flo = {KIND_FLOOR, dh, heads, in, ws, &s, 0};
        struct run eig = {KIND_EIG, dh, heads, in, ws, &s, 0};
        double r_mod = best_rate(&mod, seconds);
        double r_floor = best_rate(&flo, seconds);
        double r_eig = best_rate(&eig, seconds);

        struct numpy_result np = {0};
        if (strcmp(script, "none") != 0) {
            char path[] = "/tmp/bench_monitor_XXXXXX";
            int fd = mkstemp(path);
            if (fd >= 0) {
                close(fd);
                if (write_grams(path, dh, in, heads) == 0)
                    np = run_numpy(python, script, path, seconds);
                unlink(path);
            }
            if (!np.ok) {
                fprintf(stderr, "bench_monitor: numpy run failed (%s %s)\n", python, script);
                status = 1;
            } else if (fabs(np.checksum - mod.checksum) > 1e-6 * fabs(mod.checksum)) {
                fprintf(stderr, "bench_monitor: numpy checksum %.12g != module %.12g\n",
                        np.checksum, mod.checksum);
                status = 1;
            }
        }
        char npc[32] = "-", npe[32] = "-", vs[32] = "-";
        if (np.ok) {
            snprintf(npc, sizeof npc, "%.1f", np.chol);
            snprintf(npe, sizeof npe, "%.1f", np.eig);
            snprintf(vs, sizeof vs, "%.2fx", r_mod / np.chol);
        }
        printf("%5zu %12.1f %12.1f %12.1f %12s %12s %9.2fx %10s\n", dh, r_mod, r_floor, r_eig, npc,
               npe, r_floor / r_mod, vs);
        printf("      module %.3f ms/head; floor %.3f ms; eigen route %.3f ms (%.2fx the floor)"
               "; checksum %.12g\n",
               1e3 / r_mod, 1e3 / r_floor, 1e3 / r_eig, r_floor / r_eig, mod.checksum);
        if (sketch_heads) {
            long cpus = sysconf(_SC_NPROCESSORS_ONLN);
            double load[1] = {-1};
            if (cpus < 1)
                cpus = 1;
            (void)getloadavg(load, 1);
            printf("      sketch step of %zu heads: LAPACK floor %.2f CPU s, module %.2f CPU s "
                   "(%.2f s wall at best on %ld CPUs); load average %.1f\n",
                   sketch_heads, (double)sketch_heads / r_floor, (double)sketch_heads / r_mod,
                   (double)sketch_heads / r_mod / (double)cpus, cpus, load[0]);
        }
        fflush(stdout);
        for (size_t i = 0; i < heads; i++)
            head_free(&in[i]);
        scratch_free(&s);
        qk_workspace_destroy(ws);
    }
    return status;
}
