/* decode.c: frame length checks, unpack under an allocation cap, validation. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "fs_limits.h"

#define E(x) FORESHOCK__ERROR_CODE__ERROR_##x

static struct decode_limits lim(void)
{
    struct decode_limits l;
    decode_limits_default(&l, 1u << 20);
    return l;
}

/* Owned body bytes (no prefix) of a frame. */
struct bytes {
    uint8_t *p;
    size_t n;
};

static struct bytes pack(const Foreshock__Frame *f)
{
    struct bytes b = {.n = foreshock__frame__get_packed_size(f)};
    b.p = malloc(b.n ? b.n : 1);
    cr_assert_not_null(b.p);
    foreshock__frame__pack(f, b.p);
    return b;
}

/* --- frame builders: each case starts from a valid message and breaks one thing. */

struct hello_case {
    const char *name;
    uint32_t version;
    const char *run_id;
    uint32_t rank, world;
    int want_rc;       /* 0 or negative */
    int want_code;     /* when want_rc < 0 */
    uint32_t local[4]; /* Hello.local_ranks, n_local values */
    size_t n_local;
};

static struct bytes hello_bytes(const struct hello_case *c)
{
    Foreshock__Hello h = FORESHOCK__HELLO__INIT;
    h.protocol_version = c->version;
    h.run_id = (char *)c->run_id;
    h.rank = c->rank;
    h.world_size = c->world;
    h.local_ranks = (uint32_t *)c->local;
    h.n_local_ranks = c->n_local;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_HELLO;
    f.hello = &h;
    return pack(&f);
}

static const struct hello_case hello_cases[] = {
    {"valid", 1, "run-1.a:b_c", 3, 4, 0, 0, {0}, 0},
    {"wrong protocol version", 2, "run", 0, 1, -EINVAL, E(PROTOCOL_VERSION), {0}, 0},
    {"version 0", 0, "run", 0, 1, -EINVAL, E(PROTOCOL_VERSION), {0}, 0},
    {"rank >= world_size", 1, "run", 4, 4, -EINVAL, E(MALFORMED), {0}, 0},
    {"world_size 0", 1, "run", 0, 0, -EINVAL, E(MALFORMED), {0}, 0},
    {"bad run_id chars", 1, "no spaces/allowed", 0, 1, -EINVAL, E(MALFORMED), {0}, 0},
    {"empty run_id", 1, "", 0, 1, -EINVAL, E(MALFORMED), {0}, 0},
    {"run_id too long",
     1,
     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
     0,
     1,
     -EINVAL,
     E(MALFORMED),
     {0},
     0},
    {"local group with itself", 1, "run", 3, 8, 0, 0, {2, 3}, 2},
    {"local group out of order, repeated", 1, "run", 3, 8, 0, 0, {3, 2, 3}, 3},
    {"local group without itself", 1, "run", 3, 8, -EINVAL, E(MALFORMED), {4, 5}, 2},
    {"local rank >= world_size", 1, "run", 3, 4, -EINVAL, E(MALFORMED), {3, 4}, 2},
};

Test(decode, hello_table)
{
    struct decode_limits l = lim();
    for (size_t i = 0; i < sizeof(hello_cases) / sizeof(hello_cases[0]); i++) {
        const struct hello_case *c = &hello_cases[i];
        struct bytes b = hello_bytes(c);
        Foreshock__Frame *f = NULL;
        struct fs_err err = {0};
        int rc = decode_frame(b.p, b.n, &l, &f, NULL, &err);
        cr_expect_eq(rc, c->want_rc, "%s: rc %d (%s)", c->name, rc, err.msg);
        if (c->want_rc < 0) {
            cr_expect_null(f, "%s", c->name);
            cr_expect_eq(err.code, c->want_code, "%s: code %d", c->name, err.code);
            cr_expect(err.msg[0] != '\0', "%s: empty message", c->name);
        } else {
            cr_assert_not_null(f, "%s", c->name);
            cr_expect_eq(f->body_case, FORESHOCK__FRAME__BODY_HELLO);
            cr_expect_str_eq(f->hello->run_id, c->run_id);
            cr_expect_eq(f->hello->rank, c->rank);
        }
        decode_frame_free(f);
        free(b.p);
    }
}

/* ModelShape.optimizer: 1..FS_MAX_OPTIMIZER_LEN bytes of printable ASCII. */
#define OPT_64 "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-"
static const struct optimizer_case {
    const char *name, *optimizer;
    int want_rc;
} optimizer_cases[] = {
    {"class name", "AdamW", 0},
    {"64 bytes", OPT_64, 0},
    {"quotes, backslash, space", "My \"Lion\" \\ v2", 0},
    {"65 bytes", OPT_64 "x", -EINVAL},
    {"empty", "", -EINVAL},
    {"control character", "Ad\tamW", -EINVAL},
    {"DEL", "Adam\x7f", -EINVAL},
    {"not ASCII", "Adam\xc3\xa9", -EINVAL},
};

Test(decode, model_optimizer_table)
{
    struct decode_limits l = lim();
    cr_assert_eq(strlen(OPT_64), FS_MAX_OPTIMIZER_LEN);
    for (size_t i = 0; i < sizeof(optimizer_cases) / sizeof(optimizer_cases[0]); i++) {
        const struct optimizer_case *c = &optimizer_cases[i];
        Foreshock__ModelShape m = FORESHOCK__MODEL_SHAPE__INIT;
        m.optimizer = (char *)c->optimizer; /* the only field of the shape */
        Foreshock__Hello h = FORESHOCK__HELLO__INIT;
        h.protocol_version = 1;
        h.run_id = "run";
        h.world_size = 1;
        h.model = &m;
        Foreshock__Frame fr = FORESHOCK__FRAME__INIT;
        fr.body_case = FORESHOCK__FRAME__BODY_HELLO;
        fr.hello = &h;
        struct bytes b = pack(&fr);
        Foreshock__Frame *f = NULL;
        struct fs_err err = {0};
        int rc = decode_frame(b.p, b.n, &l, &f, NULL, &err);
        cr_expect_eq(rc, c->want_rc, "%s: rc %d (%s)", c->name, rc, err.msg);
        if (c->want_rc < 0) {
            cr_expect_null(f, "%s", c->name);
            cr_expect_eq(err.code, E(MALFORMED), "%s: code %d", c->name, err.code);
            cr_expect(strstr(err.msg, "optimizer") != NULL, "%s: message '%s'", c->name, err.msg);
        } else {
            cr_assert_not_null(f, "%s", c->name);
            cr_assert_not_null(f->hello->model, "%s", c->name);
            cr_expect_str_eq(f->hello->model->optimizer, c->optimizer, "%s", c->name);
        }
        decode_frame_free(f);
        free(b.p);
    }
}

Test(decode, version_error_names_both_versions)
{
    struct decode_limits l = lim();
    struct hello_case c = {"v7", 7, "run", 0, 1, 0, 0, {0}, 0};
    struct bytes b = hello_bytes(&c);
    Foreshock__Frame *f;
    struct fs_err err;
    cr_assert_eq(decode_frame(b.p, b.n, &l, &f, NULL, &err), -EINVAL);
    cr_expect(strstr(err.msg, "7") && strstr(err.msg, "1"), "%s", err.msg);
    free(b.p);
}

/* A report case mutates a valid report with one Gram, one spectrum, one
 * router gram and one router-tokens sketch. */
enum mutation {
    M_NONE,
    M_GRAM_SHORT, /* ga one float short for dh */
    M_GRAM_DH_ZERO,
    M_SHARD_INDEX, /* shard_index >= shard_count */
    M_LOAD_LEN,    /* load[] length != n_experts */
    M_SUMP_LEN,
    M_ROUTER_GRAM_LEN,
    M_LOSS_NAN,     /* accepted */
    M_GRAD_INF,     /* accepted */
    M_LR_NAN,       /* rejected */
    M_SUR_NAN,      /* step_update_ratio NaN: accepted, flagged */
    M_SUR_NEG,      /* step_update_ratio < 0: rejected */
    M_TIME_NAN,     /* rejected */
    M_TIME_INF,     /* rejected */
    M_SUM_H_INF,    /* rejected */
    M_GRAM_NAN,     /* accepted, flagged */
    M_SPECTRUM_NEG, /* rejected */
    M_SPECTRUM_INF, /* accepted, flagged */
    M_SEQ_ZERO,
    M_STEP_HUGE,
    M_WINDOW_ZERO,
    M_LAYER_BIG,
    M_NO_KIND,
};

struct report_case {
    const char *name;
    enum mutation m;
    int want_rc;
    int want_code;
    int want_nonfinite_sketch; /* -1: do not check */
    int want_nonfinite_scalars;
};

static const struct report_case report_cases[] = {
    {"valid", M_NONE, 0, 0, 0, 0},
    {"gram bytes do not match dh", M_GRAM_SHORT, -EINVAL, E(MALFORMED), -1, 0},
    {"gram dh 0", M_GRAM_DH_ZERO, -EINVAL, E(MALFORMED), -1, 0},
    {"shard_index >= shard_count", M_SHARD_INDEX, -EINVAL, E(MALFORMED), -1, 0},
    {"load length != n_experts", M_LOAD_LEN, -EINVAL, E(MALFORMED), -1, 0},
    {"sum_p length != n_experts", M_SUMP_LEN, -EINVAL, E(MALFORMED), -1, 0},
    {"router gram bytes != E(E+1)/2*4", M_ROUTER_GRAM_LEN, -EINVAL, E(MALFORMED), -1, 0},
    {"NaN loss accepted", M_LOSS_NAN, 0, 0, 0, 1},
    {"Inf grad_norm accepted", M_GRAD_INF, 0, 0, 0, 1},
    {"NaN lr rejected", M_LR_NAN, -EINVAL, E(MALFORMED), -1, 0},
    {"NaN step_update_ratio accepted", M_SUR_NAN, 0, 0, 0, 1},
    {"negative step_update_ratio rejected", M_SUR_NEG, -EINVAL, E(MALFORMED), -1, 0},
    {"NaN time_unix rejected", M_TIME_NAN, -EINVAL, E(MALFORMED), -1, 0},
    {"Inf time_unix rejected", M_TIME_INF, -EINVAL, E(MALFORMED), -1, 0},
    {"Inf sum_h rejected", M_SUM_H_INF, -EINVAL, E(MALFORMED), -1, 0},
    {"NaN in Gram accepted and flagged", M_GRAM_NAN, 0, 0, 2, 0},
    {"negative spectrum value", M_SPECTRUM_NEG, -EINVAL, E(MALFORMED), -1, 0},
    {"Inf spectrum value flagged", M_SPECTRUM_INF, 0, 0, 1, 0},
    {"seq 0", M_SEQ_ZERO, -EINVAL, E(MALFORMED), -1, 0},
    {"step >= 2^63", M_STEP_HUGE, -EINVAL, E(MALFORMED), -1, 0},
    {"window 0", M_WINDOW_ZERO, -EINVAL, E(MALFORMED), -1, 0},
    {"layer beyond limit", M_LAYER_BIG, -EINVAL, E(MALFORMED), -1, 0},
    {"attention without a kind", M_NO_KIND, -EINVAL, E(MALFORMED), -1, 0},
};

static void le_floats(uint8_t *out, size_t n, float v)
{
    for (size_t i = 0; i < n; i++)
        memcpy(out + 4 * i, &v, 4); /* the test host is little-endian (x86-64/arm64) */
}

static struct bytes report_bytes(enum mutation m)
{
    enum { DH = 2, N = 2 * DH, TRI = N * (N + 1) / 2, EXP = 4, ETRI = EXP * (EXP + 1) / 2 };
    uint8_t ga[TRI * 4], gb[TRI * 4], rg[ETRI * 4];
    le_floats(ga, TRI, 1.0f);
    le_floats(gb, TRI, 2.0f);
    le_floats(rg, ETRI, 0.5f);
    if (m == M_GRAM_NAN) {
        float nan = NAN;
        memcpy(ga + 8, &nan, 4);
        memcpy(gb + 12, &nan, 4);
    }

    Foreshock__Scalars sc = FORESHOCK__SCALARS__INIT;
    sc.has_loss = sc.has_grad_norm = sc.has_lr = 1;
    sc.loss = m == M_LOSS_NAN ? NAN : 2.5;
    sc.grad_norm = m == M_GRAD_INF ? INFINITY : 1.0;
    sc.lr = m == M_LR_NAN ? NAN : 1e-4;
    sc.has_step_update_ratio = 1;
    sc.step_update_ratio = m == M_SUR_NAN ? NAN : (m == M_SUR_NEG ? -0.5 : 2e-3);

    Foreshock__GramSketch g = FORESHOCK__GRAM_SKETCH__INIT;
    g.dh = m == M_GRAM_DH_ZERO ? 0 : DH;
    g.has_shard_index = g.has_shard_count = 1;
    g.shard_index = m == M_SHARD_INDEX ? 2 : 1;
    g.shard_count = 2;
    g.ga = (ProtobufCBinaryData){m == M_GRAM_SHORT ? sizeof(ga) - 4 : sizeof(ga), ga};
    g.gb = (ProtobufCBinaryData){sizeof(gb), gb};
    Foreshock__AttentionSketch a0 = FORESHOCK__ATTENTION_SKETCH__INIT;
    a0.layer = m == M_LAYER_BIG ? FS_MAX_LAYERS : 1;
    a0.head = 0;
    a0.window = m == M_WINDOW_ZERO ? 0 : 10;
    if (m != M_NO_KIND) {
        a0.kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_GRAM;
        a0.gram = &g;
    }

    float d2[4] = {3, 2, 1, m == M_SPECTRUM_NEG ? -1.0f : (m == M_SPECTRUM_INF ? INFINITY : 0)};
    float d3[2] = {1, 0.5f};
    Foreshock__SpectrumSketch sp = FORESHOCK__SPECTRUM_SKETCH__INIT;
    sp.n_d2 = 4;
    sp.d2 = d2;
    sp.n_d3 = 2;
    sp.d3 = d3;
    Foreshock__AttentionSketch a1 = FORESHOCK__ATTENTION_SKETCH__INIT;
    a1.layer = 1;
    a1.head = 1;
    a1.window = 10;
    a1.kind_case = FORESHOCK__ATTENTION_SKETCH__KIND_SPECTRUM;
    a1.spectrum = &sp;
    Foreshock__AttentionSketch *att[2] = {&a0, &a1};

    Foreshock__RouterGram r = FORESHOCK__ROUTER_GRAM__INIT;
    r.layer = 0;
    r.n_experts = EXP;
    r.gram = (ProtobufCBinaryData){m == M_ROUTER_GRAM_LEN ? sizeof(rg) - 4 : sizeof(rg), rg};
    Foreshock__RouterGram *rgs[1] = {&r};

    uint64_t load[EXP] = {5, 6, 7, 8};
    double sump[EXP] = {1, 2, 3, 4};
    Foreshock__RouterTokens t = FORESHOCK__ROUTER_TOKENS__INIT;
    t.layer = 0;
    t.n_experts = EXP;
    t.n_tok = 26;
    t.sum_h = m == M_SUM_H_INF ? INFINITY : 10;
    t.sum_h2 = 20;
    t.sum_lse2 = 30;
    t.n_load = m == M_LOAD_LEN ? EXP - 1 : EXP;
    t.load = load;
    t.n_sum_p = m == M_SUMP_LEN ? EXP + 0 - 2 : EXP;
    t.sum_p = sump;
    Foreshock__RouterTokens *rts[1] = {&t};

    Foreshock__Report rep = FORESHOCK__REPORT__INIT;
    rep.seq = m == M_SEQ_ZERO ? 0 : 7;
    rep.step = m == M_STEP_HUGE ? UINT64_MAX : 100;
    rep.has_time_unix = 1;
    rep.time_unix = m == M_TIME_NAN ? NAN : (m == M_TIME_INF ? INFINITY : 1.7e9);
    rep.scalars = &sc;
    rep.n_attention = 2;
    rep.attention = att;
    rep.n_router_gram = 1;
    rep.router_gram = rgs;
    rep.n_router_tokens = 1;
    rep.router_tokens = rts;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_REPORT;
    f.report = &rep;
    return pack(&f);
}

Test(decode, report_table)
{
    struct decode_limits l = lim();
    for (size_t i = 0; i < sizeof(report_cases) / sizeof(report_cases[0]); i++) {
        const struct report_case *c = &report_cases[i];
        struct bytes b = report_bytes(c->m);
        Foreshock__Frame *f = NULL;
        struct decode_info info;
        struct fs_err err = {0};
        int rc = decode_frame(b.p, b.n, &l, &f, &info, &err);
        cr_expect_eq(rc, c->want_rc, "%s: rc %d (%s)", c->name, rc, err.msg);
        if (c->want_rc < 0) {
            cr_expect_null(f, "%s", c->name);
            cr_expect_eq(err.code, c->want_code, "%s: code %d (%s)", c->name, err.code, err.msg);
        } else {
            cr_assert_not_null(f, "%s", c->name);
            cr_expect_eq(info.sketches, 4, "%s", c->name);
            cr_expect_eq(f->report->seq, 7);
            cr_expect_eq(info.nonfinite_scalars, c->want_nonfinite_scalars, "%s", c->name);
            if (c->want_nonfinite_sketch >= 0)
                cr_expect_eq(info.nonfinite_sketch_values, (uint64_t)c->want_nonfinite_sketch,
                             "%s: %llu", c->name, (unsigned long long)info.nonfinite_sketch_values);
        }
        decode_frame_free(f);
        free(b.p);
    }
}

/* Raw byte inputs: garbage, truncation, empty. */
struct raw_case {
    const char *name;
    const uint8_t *bytes;
    size_t len;
    int want_code;
};

static const uint8_t garbage[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
static const uint8_t no_body[] = {0x32, 0x00}; /* field 6 (Bye) empty: valid */
static const uint8_t bad_wire_type[] = {0x0f};
/* Hello{version 1, run_id "nul\0x", rank 0, world 1}: a NUL inside a string. */
static const uint8_t nul_run_id[] = {0x0a, 0x0d, 0x08, 0x01, 0x12, 0x05, 'n', 'u',
                                     'l',  0x00, 'x',  0x20, 0x00, 0x28, 0x01};
/* The same Hello with run_id "nulrun" and token "s\0j". */
static const uint8_t nul_token[] = {0x0a, 0x13, 0x08, 0x01, 0x12, 0x06, 'n',  'u', 'l',  'r', 'u',
                                    'n',  0x20, 0x00, 0x28, 0x01, 0x32, 0x03, 's', 0x00, 'j'};

Test(decode, raw_bytes_table)
{
    struct decode_limits l = lim();
    const struct raw_case cases[] = {
        {"garbage bytes", garbage, sizeof(garbage), E(MALFORMED)},
        {"bad wire type", bad_wire_type, sizeof(bad_wire_type), E(MALFORMED)},
        {"zero length", garbage, 0, E(TOO_LARGE)},
        {"over max_frame_bytes", garbage, (size_t)l.max_frame_bytes + 1, E(TOO_LARGE)},
        {"NUL inside run_id", nul_run_id, sizeof(nul_run_id), E(MALFORMED)},
        {"NUL inside token", nul_token, sizeof(nul_token), E(MALFORMED)},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        Foreshock__Frame *f = NULL;
        struct fs_err err = {0};
        int rc = decode_frame(cases[i].bytes, cases[i].len, &l, &f, NULL, &err);
        cr_expect_lt(rc, 0, "%s", cases[i].name);
        cr_expect_null(f);
        cr_expect_eq(err.code, cases[i].want_code, "%s: code %d", cases[i].name, err.code);
    }
    Foreshock__Frame *f = NULL;
    struct fs_err err;
    cr_expect_eq(decode_frame(no_body, sizeof(no_body), &l, &f, NULL, &err), 0, "%s", err.msg);
    cr_expect_eq(f->body_case, FORESHOCK__FRAME__BODY_BYE);
    decode_frame_free(f);
}

Test(decode, truncated_frames)
{
    struct decode_limits l = lim();
    struct bytes b = report_bytes(M_NONE);
    /* Every strict prefix of a valid report fails cleanly (it may decode
     * only if it happens to end on a field boundary with all required
     * fields present, which this report's layout rules out). */
    size_t failures = 0;
    for (size_t n = 1; n < b.n; n++) {
        Foreshock__Frame *f = NULL;
        struct fs_err err;
        int rc = decode_frame(b.p, n, &l, &f, NULL, &err);
        if (rc < 0) {
            cr_expect_null(f);
            failures++;
        }
        decode_frame_free(f);
    }
    cr_expect_eq(failures, b.n - 1, "%zu of %zu prefixes decoded", b.n - 1 - failures, b.n - 1);
    free(b.p);
}

struct prefix_case {
    const char *name;
    uint8_t hdr[4];
    int want_rc;
    uint32_t want_len;
};

Test(decode, prefix_table)
{
    struct decode_limits l = lim(); /* 1 MiB */
    const struct prefix_case cases[] = {
        {"zero length", {0, 0, 0, 0}, -EMSGSIZE, 0},
        {"oversized", {0xff, 0xff, 0xff, 0xff}, -EMSGSIZE, 0},
        {"one over", {0x00, 0x10, 0x00, 0x01}, -EMSGSIZE, 0},
        {"at the limit", {0x00, 0x10, 0x00, 0x00}, 0, 1u << 20},
        {"one byte", {0, 0, 0, 1}, 0, 1},
        {"big-endian", {0, 0, 0x01, 0x02}, 0, 258},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint32_t len = 0;
        struct fs_err err = {0};
        int rc = decode_prefix(cases[i].hdr, &l, &len, &err);
        cr_expect_eq(rc, cases[i].want_rc, "%s", cases[i].name);
        if (rc == 0)
            cr_expect_eq(len, cases[i].want_len, "%s", cases[i].name);
        else
            cr_expect_eq(err.code, E(TOO_LARGE), "%s", cases[i].name);
    }
}

Test(decode, roundtrip_hello_and_report)
{
    struct decode_limits l = lim();
    Foreshock__ModelShape ms = FORESHOCK__MODEL_SHAPE__INIT;
    ms.has_n_layers = 1;
    ms.n_layers = 12;
    Foreshock__Hello h = FORESHOCK__HELLO__INIT;
    h.protocol_version = 1;
    h.run_id = "rt-run";
    h.has_attempt = 1;
    h.attempt = 3;
    h.rank = 1;
    h.world_size = 2;
    h.token = "secret";
    h.model = &ms;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_HELLO;
    f.hello = &h;
    uint8_t *buf;
    size_t n;
    cr_assert_eq(decode_encode(&f, &buf, &n), 0);
    uint32_t len;
    struct fs_err err;
    cr_assert_eq(decode_prefix(buf, &l, &len, &err), 0);
    cr_assert_eq(len + 4, n);
    Foreshock__Frame *g;
    cr_assert_eq(decode_frame(buf + 4, len, &l, &g, NULL, &err), 0, "%s", err.msg);
    cr_expect_str_eq(g->hello->run_id, "rt-run");
    cr_expect_eq(g->hello->attempt, 3);
    cr_expect_str_eq(g->hello->token, "secret");
    cr_expect_eq(g->hello->model->n_layers, 12);
    decode_frame_free(g);
    free(buf);

    struct bytes b = report_bytes(M_NONE);
    struct decode_info info;
    cr_assert_eq(decode_frame(b.p, b.n, &l, &g, &info, &err), 0, "%s", err.msg);
    cr_expect_eq(g->report->step, 100);
    cr_expect_eq(g->report->n_attention, 2);
    cr_expect_eq(g->report->attention[0]->gram->ga.len, 40);
    cr_expect_eq(g->report->router_tokens[0]->load[3], 8);
    cr_expect_eq(g->report->scalars->loss, 2.5);
    cr_expect_gt(info.alloc_bytes, 0);
    uint8_t *again;
    cr_assert_eq(decode_encode(g, &again, &n), 0);
    cr_expect_eq(n, b.n + 4);
    cr_expect_eq(memcmp(again + 4, b.p, b.n), 0, "re-encoded report differs");
    free(again);
    decode_frame_free(g);
    free(b.p);
}

Test(decode, error_frame_encodes)
{
    uint8_t *buf;
    size_t n;
    cr_assert_eq(decode_encode_error(E(LIMIT), "too many", 0, &buf, &n), 0);
    struct decode_limits l = lim();
    Foreshock__Frame *f;
    struct fs_err err;
    cr_assert_eq(decode_frame(buf + 4, n - 4, &l, &f, NULL, &err), 0);
    cr_expect_eq(f->body_case, FORESHOCK__FRAME__BODY_ERROR);
    cr_expect_eq(f->error->code, E(LIMIT));
    cr_expect_str_eq(f->error->message, "too many");
    cr_expect(!f->error->has_seq, "seq 0 means no Error.seq");
    decode_frame_free(f);
    free(buf);

    cr_assert_eq(decode_encode_error(E(LIMIT), "too many sketches", 9, &buf, &n), 0);
    cr_assert_eq(decode_frame(buf + 4, n - 4, &l, &f, NULL, &err), 0);
    cr_expect(f->error->has_seq && f->error->seq == 9, "Error.seq names the report");
    decode_frame_free(f);
    free(buf);
}

/* decode_peek_report_seq: the seq of a report that does not decode. */
static const uint8_t peek_step_first[] = {0x1a, 0x04, 0x10, 0x03, 0x08, 0x07};
static const uint8_t peek_bad_after_seq[] = {0x1a, 0x03, 0x08, 0x05, 0x0f};
static const uint8_t peek_hello[] = {0x0a, 0x02, 0x08, 0x01};
static const uint8_t peek_seq_zero[] = {0x1a, 0x02, 0x08, 0x00};
static const uint8_t peek_truncated[] = {0x1a, 0x05, 0x08};
static const uint8_t peek_no_seq[] = {0x1a, 0x02, 0x10, 0x01};
static const uint8_t peek_seq_wrong_type[] = {0x1a, 0x02, 0x0a, 0x00};
static const uint8_t peek_overlong_varint[] = {0x1a, 0x0c, 0x08, 0xff, 0xff, 0xff, 0xff,
                                               0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
static const uint8_t peek_after_other_field[] = {0x32, 0x00, 0x1a, 0x02, 0x08, 0x2a};

Test(decode, peek_report_seq_table)
{
    static const struct {
        const char *name;
        const uint8_t *p;
        size_t n;
        int rc;
        uint64_t seq;
    } cases[] = {
        {"step before seq", peek_step_first, sizeof(peek_step_first), 0, 7},
        {"bad wire type after the seq", peek_bad_after_seq, sizeof(peek_bad_after_seq), 0, 5},
        {"a Hello", peek_hello, sizeof(peek_hello), -ENOENT, 0},
        {"seq 0", peek_seq_zero, sizeof(peek_seq_zero), -ENOENT, 0},
        {"truncated", peek_truncated, sizeof(peek_truncated), -ENOENT, 0},
        {"no seq", peek_no_seq, sizeof(peek_no_seq), -ENOENT, 0},
        {"field 1 not a varint", peek_seq_wrong_type, sizeof(peek_seq_wrong_type), -ENOENT, 0},
        {"varint longer than 10 bytes", peek_overlong_varint, sizeof(peek_overlong_varint), -ENOENT,
         0},
        {"report after another field", peek_after_other_field, sizeof(peek_after_other_field), 0,
         42},
        {"garbage", garbage, sizeof(garbage), -ENOENT, 0},
        {"empty", garbage, 0, -ENOENT, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        uint64_t seq = 0;
        int rc = decode_peek_report_seq(cases[i].p, cases[i].n, &seq);
        cr_expect_eq(rc, cases[i].rc, "%s: rc %d", cases[i].name, rc);
        if (rc == 0)
            cr_expect_eq(seq, cases[i].seq, "%s: seq %llu", cases[i].name, (unsigned long long)seq);
    }
    /* A packed report, and one the limits refuse: named either way. */
    Foreshock__Report r = FORESHOCK__REPORT__INIT;
    r.seq = 1234567;
    r.step = 9;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_REPORT;
    f.report = &r;
    struct bytes b = pack(&f);
    uint64_t seq = 0;
    cr_expect_eq(decode_peek_report_seq(b.p, b.n, &seq), 0);
    cr_expect_eq(seq, 1234567);
    free(b.p);
}

/* Appends a varint. */
static size_t put_varint(uint8_t *b, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        b[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    b[n++] = (uint8_t)v;
    return n;
}

/* A Report frame (seq 1, step 0) whose body after seq/step is `count` copies
 * of `one`. Returns the frame length; *out is malloc'd. */
static size_t report_of_copies(const uint8_t *one, size_t one_len, size_t count, uint8_t **out)
{
    size_t inner = 4 + count * one_len;
    uint8_t *b = malloc(inner + 16);
    size_t n = 0;
    b[n++] = 0x1a; /* Frame.report, length-delimited */
    n += put_varint(b + n, inner);
    b[n++] = 0x08;
    b[n++] = 0x01; /* seq = 1 */
    b[n++] = 0x10;
    b[n++] = 0x00; /* step = 0 */
    for (size_t i = 0; i < count; i++) {
        memcpy(b + n, one, one_len);
        n += one_len;
    }
    *out = b;
    return n;
}

/* The allocation cap: protobuf-c makes sub-message structs far larger than
 * their wire size, so the allocator is capped, at 4x the frame plus, for
 * each sketch the count limits allow, the structs of one sketch. A valid
 * report of 4,000 tiny spectrum sketches (7x its size once unpacked)
 * decodes; minimal sketches up to the count limit unpack within the cap
 * (and are then refused for carrying no sketch); what expands without a
 * count limit (1-byte packed varints, 8 bytes each unpacked) is refused. */
Test(decode, allocation_cap_matches_the_documented_limits)
{
    struct decode_limits l = lim();
    uint8_t *b;
    Foreshock__Frame *f = NULL;
    struct decode_info info;
    struct fs_err err;

    /* AttentionSketch{layer 0, head 0, window 1, spectrum{d2: [1, 1]}}. */
    static const uint8_t spectrum[] = {0x2a, 0x12, 0x08, 0x00, 0x10, 0x00, 0x18, 0x01, 0x32, 0x0a,
                                       0x0a, 0x08, 0,    0,    0x80, 0x3f, 0,    0,    0x80, 0x3f};
    size_t n = report_of_copies(spectrum, sizeof(spectrum), 4000, &b);
    int rc = decode_frame(b, n, &l, &f, &info, &err);
    cr_expect(rc == 0 || err.code != E(LIMIT), "4,000 spectrum sketches refused: %s", err.msg);
    cr_expect_gt(info.alloc_bytes, FS_DECODE_ALLOC_FACTOR * n,
                 "the case no longer needs more than the flat factor (%zu for %zu bytes)",
                 info.alloc_bytes, n);
    decode_frame_free(f);
    free(b);

    /* 50,000 minimal sketches (8 wire bytes each): within the count limit,
     * unpacked within the cap, refused by validation. */
    static const uint8_t minimal[] = {0x2a, 0x06, 0x08, 0x00, 0x10, 0x00, 0x18, 0x01};
    n = report_of_copies(minimal, sizeof(minimal), 50000, &b);
    cr_assert_leq(n, l.max_frame_bytes);
    rc = decode_frame(b, n, &l, &f, &info, &err);
    cr_expect_eq(rc, -EINVAL, "rc %d: %s", rc, err.msg);
    cr_expect_eq(err.code, E(MALFORMED), "%s", err.msg);
    cr_expect_null(f);
    size_t sketches = (size_t)l.max_attention_per_report + 2u * l.max_router_per_report;
    if (sketches > n / FS_DECODE_MIN_SKETCH_WIRE)
        sketches = n / FS_DECODE_MIN_SKETCH_WIRE;
    cr_expect_leq(info.alloc_bytes, FS_DECODE_ALLOC_FACTOR * n + FS_DECODE_ALLOC_SLACK +
                                        sketches * FS_DECODE_SKETCH_STRUCT_BYTES);
    free(b);

    /* RouterTokens.load of 12 million one-byte varints: 96 MB once unpacked
     * from a 12 MB frame, beyond 4x the frame plus the sketch allowance. */
    struct decode_limits big;
    decode_limits_default(&big, 16u << 20);
    enum { VALUES = 12000000 };
    uint8_t *t = malloc(VALUES + 64);
    size_t m = 0;
    t[m++] = 0x08;
    t[m++] = 0x00; /* layer 0 */
    t[m++] = 0x10;
    t[m++] = 0x04; /* n_experts 4 */
    t[m++] = 0x18;
    t[m++] = 0x01; /* n_tok 1 */
    t[m++] = 0x21;
    memset(t + m, 0, 8);
    m += 8; /* sum_h */
    t[m++] = 0x29;
    memset(t + m, 0, 8);
    m += 8; /* sum_h2 */
    t[m++] = 0x31;
    memset(t + m, 0, 8);
    m += 8;        /* sum_lse2 */
    t[m++] = 0x3a; /* load, packed */
    m += put_varint(t + m, VALUES);
    memset(t + m, 0x01, VALUES);
    m += VALUES;
    uint8_t hdr[16];
    size_t h = 0;
    hdr[h++] = 0x3a; /* Report.router_tokens (field 7) */
    h += put_varint(hdr + h, m);
    uint8_t *one = malloc(h + m);
    memcpy(one, hdr, h);
    memcpy(one + h, t, m);
    n = report_of_copies(one, h + m, 1, &b);
    cr_assert_leq(n, big.max_frame_bytes);
    rc = decode_frame(b, n, &big, &f, &info, &err);
    cr_expect_eq(rc, -E2BIG, "rc %d: %s", rc, err.msg);
    cr_expect_eq(err.code, E(LIMIT));
    cr_expect_null(f);
    free(one);
    free(t);
    free(b);
}

Test(decode, run_id_rules)
{
    cr_expect(decode_run_id_valid("a", 128));
    cr_expect(decode_run_id_valid("A-z_0.9:x", 128));
    cr_expect_not(decode_run_id_valid("", 128));
    cr_expect_not(decode_run_id_valid("a b", 128));
    cr_expect_not(decode_run_id_valid("a/b", 128));
    cr_expect_not(decode_run_id_valid("abc", 2));
    cr_expect(decode_run_id_valid("ab", 2));
}
