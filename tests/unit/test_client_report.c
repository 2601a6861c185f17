/* libforeshock pure parts: report building and serialization, the replay
 * buffer, backoff, framing, option validation. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "foreshock.h"
#include "foreshock.pb-c.h"
/* libforeshock's private headers (pure modules under test). */
#include "../../client/libforeshock/backoff.h"
#include "../../client/libforeshock/replay.h"
#include "../../client/libforeshock/report_pack.h"
#include "../../client/libforeshock/wire.h"

/* ---- report round trip ------------------------------------------------------ */

/* Packs r with seq and decodes the whole frame with protobuf-c. */
static Foreshock__Frame *roundtrip(const fsc_report *r, uint64_t seq, uint8_t **frame_out,
                                   size_t *frame_len)
{
    struct fsc_entry *e;
    uint8_t hdr[FSC_WIRE_REPORT_HDR_MAX];
    size_t h;
    uint8_t *frame;
    Foreshock__Frame *f;

    cr_assert_eq(fsc_report_pack(r, seq, 1u << 26, &e), 0);
    cr_assert_eq(e->seq, seq);
    h = fsc_wire_report_header(seq, e->len, hdr);
    frame = malloc(h + e->len);
    memcpy(frame, hdr, h);
    memcpy(frame + h, e->body, e->len);
    cr_assert_eq(fsc_wire_get_be32(frame), h + e->len - 4, "length prefix");
    f = foreshock__frame__unpack(NULL, h + e->len - 4, frame + 4);
    cr_assert(f, "frame does not decode");
    *frame_out = frame;
    *frame_len = h + e->len;
    free(e);
    return f;
}

static float le_float(const uint8_t *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float v;
    memcpy(&v, &u, sizeof(v));
    return v;
}

Test(client_report, full_report_round_trips_through_protobuf_c)
{
    const uint32_t dh = 2, n = 4, tri = 10;
    float ga[10], gb[10], rg[6], norms[3] = {1.5f, 2.5f, NAN}, ratios[2] = {0.01f, 0.02f};
    float d2[4] = {4, 3, 2, 1}, d3[2] = {0.5f, 0.25f};
    uint64_t load[3] = {10, 0, 7};
    double sum_p[3] = {5.5, 1.25, 10.25};
    struct fsc_spectrum sp = {.d2 = d2,
                              .n_d2 = 4,
                              .d3 = d3,
                              .n_d3 = 2,
                              .q_sq = 2.0,
                              .cqk = 0.125,
                              .has = FSC_SPECTRUM_HAS_Q_SQ | FSC_SPECTRUM_HAS_CQK};
    fsc_report *r = fsc_report_new(1234);
    uint8_t *frame;
    size_t frame_len;

    (void)n;
    for (uint32_t i = 0; i < tri; i++) {
        ga[i] = (float)i + 0.5f;
        gb[i] = -(float)i;
    }
    for (int i = 0; i < 6; i++)
        rg[i] = (float)(i * i);
    cr_assert(r);
    cr_assert_eq(fsc_report_set_loss(r, NAN), 0);
    cr_assert_eq(fsc_report_set_grad_norm(r, 2.75), 0);
    cr_assert_eq(fsc_report_set_lr(r, 3e-4), 0);
    cr_assert_eq(fsc_report_set_loss_scale(r, 65536), 0);
    cr_assert_eq(fsc_report_set_tokens(r, 1u << 20), 0);
    cr_assert_eq(fsc_report_set_step_time(r, 0.125), 0);
    cr_assert_eq(fsc_report_set_time(r, 1.7e9), 0);
    cr_assert_eq(fsc_report_set_layer_weight_norms(r, norms, 3), 0);
    cr_assert_eq(fsc_report_set_layer_update_ratios(r, ratios, 2), 0);
    cr_assert_eq(fsc_report_set_step_update_ratio(r, 0.0025), 0);
    cr_assert_eq(fsc_report_add_attention_gram(r, 3, 1, FSC_KV_HEAD_NONE, 10, dh, 1, 4, ga, gb), 0);
    cr_assert_eq(fsc_report_add_attention_spectrum(r, 2, 5, 1, 20, &sp), 0);
    cr_assert_eq(fsc_report_add_router_gram(r, 7, 3, 0, 1, rg), 0);
    cr_assert_eq(fsc_report_add_router_tokens(r, 7, 3, 17, 1.5, 2.5, 3.5, load, sum_p), 0);

    Foreshock__Frame *f = roundtrip(r, 300, &frame, &frame_len);
    cr_assert_eq(f->body_case, FORESHOCK__FRAME__BODY_REPORT);
    Foreshock__Report *m = f->report;
    cr_expect_eq(m->seq, 300);
    cr_expect_eq(m->step, 1234);
    cr_expect(m->has_time_unix && m->time_unix == 1.7e9);
    cr_assert(m->scalars);
    cr_expect(m->scalars->has_loss && isnan(m->scalars->loss));
    cr_expect(m->scalars->has_grad_norm && m->scalars->grad_norm == 2.75);
    cr_expect(m->scalars->has_lr && m->scalars->lr == 3e-4);
    cr_expect(m->scalars->has_loss_scale && m->scalars->loss_scale == 65536);
    cr_expect(m->scalars->has_tokens && m->scalars->tokens == 1u << 20);
    cr_expect(m->scalars->has_step_time_s && m->scalars->step_time_s == 0.125);
    cr_assert_eq(m->scalars->n_layer_weight_norm, 3);
    cr_expect(m->scalars->layer_weight_norm[1] == 2.5f && isnan(m->scalars->layer_weight_norm[2]));
    cr_assert_eq(m->scalars->n_layer_update_ratio, 2);
    cr_expect(m->scalars->layer_update_ratio[1] == 0.02f);
    cr_expect(m->scalars->has_step_update_ratio && m->scalars->step_update_ratio == 0.0025);

    cr_assert_eq(m->n_attention, 2);
    Foreshock__AttentionSketch *a = m->attention[0];
    cr_expect(a->layer == 3 && a->head == 1 && a->window == 10 && !a->has_kv_head);
    cr_assert_eq(a->kind_case, FORESHOCK__ATTENTION_SKETCH__KIND_GRAM);
    cr_expect(a->gram->dh == dh && a->gram->shard_index == 1 && a->gram->shard_count == 4);
    cr_assert(a->gram->ga.len == tri * 4 && a->gram->gb.len == tri * 4);
    for (uint32_t i = 0; i < tri; i++) {
        cr_expect(le_float(a->gram->ga.data + 4 * i) == ga[i], "ga[%u]", i);
        cr_expect(le_float(a->gram->gb.data + 4 * i) == gb[i], "gb[%u]", i);
    }
    a = m->attention[1];
    cr_expect(a->layer == 2 && a->head == 5 && a->window == 20 && a->has_kv_head &&
              a->kv_head == 1);
    cr_assert_eq(a->kind_case, FORESHOCK__ATTENTION_SKETCH__KIND_SPECTRUM);
    cr_assert(a->spectrum->n_d2 == 4 && a->spectrum->n_d3 == 2 && a->spectrum->n_d1 == 0);
    cr_expect(a->spectrum->d2[0] == 4 && a->spectrum->d3[1] == 0.25f);
    cr_expect(a->spectrum->has_q_sq && a->spectrum->q_sq == 2.0);
    cr_expect(a->spectrum->has_cqk && a->spectrum->cqk == 0.125);
    cr_expect(!a->spectrum->has_q_delta_sq && !a->spectrum->has_k_sq &&
              !a->spectrum->has_k_delta_sq);

    cr_assert_eq(m->n_router_gram, 1);
    cr_expect(m->router_gram[0]->layer == 7 && m->router_gram[0]->n_experts == 3);
    cr_assert_eq(m->router_gram[0]->gram.len, 24);
    cr_expect(le_float(m->router_gram[0]->gram.data + 20) == 25.0f);
    cr_assert_eq(m->n_router_tokens, 1);
    Foreshock__RouterTokens *t = m->router_tokens[0];
    cr_expect(t->n_tok == 17 && t->sum_h == 1.5 && t->sum_h2 == 2.5 && t->sum_lse2 == 3.5);
    cr_assert(t->n_load == 3 && t->n_sum_p == 3);
    cr_expect(t->load[2] == 7 && t->sum_p[2] == 10.25);

    /* Our header + stored body is byte-identical to protobuf-c packing the
     * whole frame: the daemon sees an ordinary Frame. */
    size_t n2 = foreshock__frame__get_packed_size(f);
    uint8_t *again = malloc(n2);
    cr_assert_eq(foreshock__frame__pack(f, again), n2);
    cr_assert_eq(n2, frame_len - 4);
    cr_expect(memcmp(again, frame + 4, n2) == 0, "bytes differ from protobuf-c's packing");
    free(again);
    free(frame);
    foreshock__frame__free_unpacked(f, NULL);
    fsc_report_free(r);
}

Test(client_report, seq_header_for_every_varint_width)
{
    static const uint64_t seqs[] = {1, 127, 128, 16383, 16384, 1ull << 35, UINT64_MAX};
    fsc_report *r = fsc_report_new(5);
    cr_assert_eq(fsc_report_set_loss(r, 1.0), 0);
    for (size_t i = 0; i < sizeof(seqs) / sizeof(seqs[0]); i++) {
        uint8_t *frame;
        size_t len;
        Foreshock__Frame *f = roundtrip(r, seqs[i], &frame, &len);
        cr_expect_eq(f->report->seq, seqs[i]);
        cr_expect_eq(f->report->step, 5);
        foreshock__frame__free_unpacked(f, NULL);
        free(frame);
    }
    fsc_report_free(r);
}

Test(client_report, empty_report_has_no_scalars)
{
    fsc_report *r = fsc_report_new(0);
    uint8_t *frame;
    size_t len;
    Foreshock__Frame *f = roundtrip(r, 1, &frame, &len);
    cr_expect_null(f->report->scalars);
    cr_expect_eq(f->report->n_attention, 0);
    foreshock__frame__free_unpacked(f, NULL);
    free(frame);
    fsc_report_free(r);
}

Test(client_report, pack_refuses_reports_above_the_size_limit)
{
    static float g[64 * 65 / 2]; /* dh 32: n = 64 */
    struct fsc_entry *e = NULL;
    fsc_report *r = fsc_report_new(0);
    cr_assert_eq(fsc_report_add_attention_gram(r, 0, 0, FSC_KV_HEAD_NONE, 1, 32, 0, 1, g, g), 0);
    cr_expect_eq(fsc_report_pack(r, 1, 1000, &e), -EMSGSIZE);
    cr_expect_null(e);
    fsc_report_free(r);
}

/* Setters refuse what the daemon would refuse (daemon/decode.c). */
Test(client_report, setters_validate_values)
{
    float ok2[2] = {1, 2}, neg[2] = {1, -1}, inf2[2] = {INFINITY, 1}, g[10] = {0};
    float d2[4] = {1, 1, 1, 1}, d3[2] = {1, 1}, d3neg[2] = {1, -0.5f};
    uint64_t load[2] = {1, 2};
    double sp[2] = {0.5, 0.5}, spneg[2] = {0.5, -0.5}, spnan[2] = {NAN, 0};
    fsc_report *r = fsc_report_new(1);
    struct fsc_spectrum s = {.d2 = d2, .n_d2 = 4, .d3 = d3, .n_d3 = 2};
    struct fsc_spectrum s_odd = {.d2 = d2, .n_d2 = 3, .d3 = d3, .n_d3 = 2};
    struct fsc_spectrum s_neg = {.d2 = d2, .n_d2 = 4, .d3 = d3neg, .n_d3 = 2};
    struct fsc_spectrum s_cqk = {
        .d2 = d2, .n_d2 = 4, .d3 = d3, .n_d3 = 2, .cqk = 1.5, .has = FSC_SPECTRUM_HAS_CQK};
    struct {
        const char *what;
        int got, want;
    } cases[] = {
        {"loss inf", fsc_report_set_loss(r, INFINITY), 0},
        {"grad_norm nan", fsc_report_set_grad_norm(r, NAN), 0},
        {"lr nan", fsc_report_set_lr(r, NAN), -EINVAL},
        {"lr ok", fsc_report_set_lr(r, 1e-3), 0},
        {"loss_scale inf", fsc_report_set_loss_scale(r, INFINITY), -EINVAL},
        {"step_time nan", fsc_report_set_step_time(r, NAN), -EINVAL},
        {"step ratio 0", fsc_report_set_step_update_ratio(r, 0), 0},
        {"step ratio nan accepted", fsc_report_set_step_update_ratio(r, NAN), 0},
        {"step ratio negative", fsc_report_set_step_update_ratio(r, -1e-3), -EINVAL},
        {"time inf", fsc_report_set_time(r, -INFINITY), -EINVAL},
        {"norms ok", fsc_report_set_layer_weight_norms(r, ok2, 2), 0},
        {"norms inf accepted", fsc_report_set_layer_weight_norms(r, inf2, 2), 0},
        {"norms negative", fsc_report_set_layer_weight_norms(r, neg, 2), -EINVAL},
        {"norms too many", fsc_report_set_layer_weight_norms(r, ok2, FSC_MAX_LAYERS + 1), -EINVAL},
        {"ratios NULL", fsc_report_set_layer_update_ratios(r, NULL, 2), -EINVAL},
        {"ratios clear", fsc_report_set_layer_update_ratios(r, NULL, 0), 0},
        {"gram ok", fsc_report_add_attention_gram(r, 0, 0, 0, 1, 1, 0, 1, g, g), 0},
        {"gram dh 0", fsc_report_add_attention_gram(r, 0, 0, 0, 1, 0, 0, 1, g, g), -EINVAL},
        {"gram dh big", fsc_report_add_attention_gram(r, 0, 0, 0, 1, FSC_MAX_DH + 1, 0, 1, g, g),
         -EINVAL},
        {"gram window 0", fsc_report_add_attention_gram(r, 0, 0, 0, 0, 1, 0, 1, g, g), -EINVAL},
        {"gram shard idx", fsc_report_add_attention_gram(r, 0, 0, 0, 1, 1, 2, 2, g, g), -EINVAL},
        {"gram shard 0", fsc_report_add_attention_gram(r, 0, 0, 0, 1, 1, 0, 0, g, g), -EINVAL},
        {"gram layer", fsc_report_add_attention_gram(r, FSC_MAX_LAYERS, 0, 0, 1, 1, 0, 1, g, g),
         -EINVAL},
        {"gram head", fsc_report_add_attention_gram(r, 0, FSC_MAX_HEADS, 0, 1, 1, 0, 1, g, g),
         -EINVAL},
        {"gram kv_head", fsc_report_add_attention_gram(r, 0, 0, FSC_MAX_HEADS, 1, 1, 0, 1, g, g),
         -EINVAL},
        {"gram NULL", fsc_report_add_attention_gram(r, 0, 0, 0, 1, 1, 0, 1, NULL, g), -EINVAL},
        {"spectrum ok", fsc_report_add_attention_spectrum(r, 0, 0, 0, 1, &s), 0},
        {"spectrum d2 != 2*d3", fsc_report_add_attention_spectrum(r, 0, 0, 0, 1, &s_odd), -EINVAL},
        {"spectrum negative", fsc_report_add_attention_spectrum(r, 0, 0, 0, 1, &s_neg), -EINVAL},
        {"spectrum cqk > 1", fsc_report_add_attention_spectrum(r, 0, 0, 0, 1, &s_cqk), -EINVAL},
        {"spectrum NULL", fsc_report_add_attention_spectrum(r, 0, 0, 0, 1, NULL), -EINVAL},
        {"router gram ok", fsc_report_add_router_gram(r, 0, 2, 0, 1, g), 0},
        {"router gram E 0", fsc_report_add_router_gram(r, 0, 0, 0, 1, g), -EINVAL},
        {"router gram E big", fsc_report_add_router_gram(r, 0, FSC_MAX_EXPERTS + 1, 0, 1, g),
         -EINVAL},
        {"tokens ok", fsc_report_add_router_tokens(r, 0, 2, 9, 1, 1, 1, load, sp), 0},
        {"tokens sum_h nan", fsc_report_add_router_tokens(r, 0, 2, 9, NAN, 1, 1, load, sp),
         -EINVAL},
        {"tokens sum_h2 < 0", fsc_report_add_router_tokens(r, 0, 2, 9, 1, -1, 1, load, sp),
         -EINVAL},
        {"tokens sum_p < 0", fsc_report_add_router_tokens(r, 0, 2, 9, 1, 1, 1, load, spneg),
         -EINVAL},
        {"tokens sum_p nan", fsc_report_add_router_tokens(r, 0, 2, 9, 1, 1, 1, load, spnan),
         -EINVAL},
        {"tokens NULL load", fsc_report_add_router_tokens(r, 0, 2, 9, 1, 1, 1, NULL, sp), -EINVAL},
        {"NULL report", fsc_report_set_loss(NULL, 1), -EINVAL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        cr_expect_eq(cases[i].got, cases[i].want, "%s: got %d want %d", cases[i].what, cases[i].got,
                     cases[i].want);
    fsc_report_free(r);
    fsc_report_free(NULL);
}

/* ---- replay buffer ------------------------------------------------------------ */

static struct fsc_entry *entry(uint64_t seq, size_t len)
{
    struct fsc_entry *e = calloc(1, sizeof(*e) + len);
    cr_assert(e);
    e->seq = seq;
    e->body = e->data;
    e->len = len;
    return e;
}

Test(client_replay, push_is_bounded_by_bytes)
{
    struct fsc_replay r;
    size_t cost = sizeof(struct fsc_entry) + 100;
    fsc_replay_init(&r, 3 * cost);
    for (uint64_t s = 1; s <= 3; s++)
        cr_assert_eq(fsc_replay_push(&r, entry(s, 100)), 0);
    struct fsc_entry *e = entry(4, 100);
    cr_expect_eq(fsc_replay_push(&r, e), -ENOBUFS);
    cr_expect_eq(r.count, 3);
    cr_expect_eq(r.bytes, 3 * cost);
    /* An ack frees room. */
    cr_expect_eq(fsc_replay_ack(&r, 1), 1);
    cr_expect_eq(fsc_replay_push(&r, e), 0);
    cr_expect_eq(r.count, 3);
    fsc_replay_clear(&r);
    cr_expect_eq(r.count, 0);
    cr_expect_eq(r.bytes, 0);
}

Test(client_replay, take_ack_rewind)
{
    struct fsc_replay r;
    fsc_replay_init(&r, 1 << 20);
    for (uint64_t s = 1; s <= 5; s++)
        cr_assert_eq(fsc_replay_push(&r, entry(s, 10)), 0);
    for (uint64_t s = 1; s <= 3; s++) {
        struct fsc_entry *e = fsc_replay_take(&r);
        cr_assert(e);
        cr_expect_eq(e->seq, s);
        fsc_replay_sent(&r);
    }
    cr_expect_eq(r.in_flight, 3);
    cr_expect_eq(fsc_replay_ack(&r, 2), 2);
    cr_expect_eq(r.in_flight, 1);
    cr_expect_eq(r.head->seq, 3);
    /* Reconnect: resend from the oldest unacknowledged. */
    fsc_replay_rewind(&r);
    cr_expect_eq(r.in_flight, 0);
    cr_expect_eq(fsc_replay_take(&r)->seq, 3);
    fsc_replay_sent(&r);
    /* An ack beyond what was sent (Welcome after a crash) skips unsent ones. */
    cr_expect_eq(fsc_replay_ack(&r, 4), 2);
    cr_expect_eq(fsc_replay_take(&r)->seq, 5);
    fsc_replay_sent(&r);
    cr_expect_null(fsc_replay_take(&r));
    cr_expect_eq(fsc_replay_ack(&r, 100), 1);
    cr_expect_eq(r.count, 0);
    cr_expect_null(r.head);
    cr_expect_null(r.tail);
    /* Still usable after emptying. */
    cr_assert_eq(fsc_replay_push(&r, entry(6, 10)), 0);
    cr_expect_eq(fsc_replay_take(&r)->seq, 6);
    fsc_replay_sent(&r);
    fsc_replay_clear(&r);
}

Test(client_replay, entry_being_written_is_not_freed)
{
    struct fsc_replay r;
    fsc_replay_init(&r, 1 << 20);
    cr_assert_eq(fsc_replay_push(&r, entry(1, 10)), 0);
    cr_assert_eq(fsc_replay_push(&r, entry(2, 10)), 0);
    struct fsc_entry *e = fsc_replay_take(&r);
    cr_expect_eq(fsc_replay_ack(&r, 2), 0, "must stop at the entry being written");
    struct fsc_entry *p = entry(1, 2);
    cr_expect_eq(fsc_replay_replace(&r, e, p), -EBUSY);
    cr_expect_eq(e->seq, 1);
    fsc_replay_sent(&r);
    cr_expect_eq(fsc_replay_replace(&r, e, p), 0);
    cr_expect_eq(fsc_replay_ack(&r, 2), 2);
    fsc_replay_clear(&r);
}

/* A placeholder for entry seq: 2 bytes, marked. */
static struct fsc_entry *placeholder(uint64_t seq)
{
    struct fsc_entry *e = entry(seq, 2);
    e->placeholder = 1;
    return e;
}

Test(client_replay, replace_keeps_order_cursor_and_counts)
{
    struct fsc_replay r;
    fsc_replay_init(&r, 1 << 20);
    for (uint64_t s = 1; s <= 4; s++)
        cr_assert_eq(fsc_replay_push(&r, entry(s, 10)), 0);
    size_t cost10 = r.bytes / 4, cost2 = cost10 - 8;
    for (int i = 0; i < 2; i++) {
        fsc_replay_take(&r);
        fsc_replay_sent(&r);
    }
    cr_expect_eq(fsc_replay_find(&r, 3)->seq, 3);
    cr_expect_null(fsc_replay_find(&r, 9));
    /* 2, in flight, was refused by the daemon. */
    cr_expect_eq(fsc_replay_replace(&r, fsc_replay_find(&r, 2), placeholder(2)), 0);
    cr_expect_eq(r.head->next->seq, 2);
    cr_expect(r.head->next->placeholder);
    cr_expect_eq(r.in_flight, 2);
    cr_expect_eq(r.placeholders, 1);
    cr_expect_eq(r.bytes, 3 * cost10 + cost2);
    /* 3, next to send, is above the daemon's frame limit. */
    cr_expect_eq(fsc_replay_replace(&r, r.next_send, placeholder(3)), 0);
    struct fsc_entry *t = fsc_replay_take(&r);
    cr_expect(t->seq == 3 && t->placeholder, "the placeholder goes out in its place");
    fsc_replay_sent(&r);
    /* The tail, then a push links after the new tail. */
    cr_expect_eq(fsc_replay_replace(&r, r.tail, placeholder(4)), 0);
    cr_assert_eq(fsc_replay_push(&r, entry(5, 10)), 0);
    cr_expect_eq(r.tail->seq, 5);
    struct fsc_entry *stray = entry(7, 10), *p = placeholder(7);
    cr_expect_eq(fsc_replay_replace(&r, stray, p), -ENOENT);
    free(stray);
    free(p);
    /* Rewind resends the placeholders in order. */
    fsc_replay_rewind(&r);
    for (uint64_t s = 1; s <= 5; s++) {
        struct fsc_entry *e = fsc_replay_take(&r);
        cr_assert(e);
        cr_expect_eq(e->seq, s);
        cr_expect_eq(e->placeholder, s >= 2 && s <= 4);
        fsc_replay_sent(&r);
    }
    cr_expect_eq(fsc_replay_ack(&r, 5), 5);
    cr_expect_eq(r.count, 0);
    cr_expect_eq(r.bytes, 0);
    cr_expect_eq(r.placeholders, 0);
    fsc_replay_clear(&r);
}

/* Placeholders: a packed report's body cut to its step (and time). */
Test(client_wire, placeholder_keeps_step_and_time_only)
{
    static const uint8_t no_step[] = {0x22, 0x00};
    static const uint8_t long_varint[] = {0x10, 0x80, 0x80, 0x80, 0x80, 0x80,
                                          0x80, 0x80, 0x80, 0x80, 0x80, 0x01};
    static const uint8_t short_time[] = {0x10, 0x01, 0x19, 0, 0, 0};
    uint8_t out[FSC_WIRE_PLACEHOLDER_MAX];
    cr_expect_eq(fsc_wire_report_placeholder(no_step, sizeof(no_step), out), 0);
    cr_expect_eq(fsc_wire_report_placeholder(long_varint, sizeof(long_varint), out), 0);
    cr_expect_eq(fsc_wire_report_placeholder(short_time, sizeof(short_time), out), 0);
    cr_expect_eq(fsc_wire_report_placeholder(no_step, 0, out), 0);

    for (int with_time = 0; with_time < 2; with_time++) {
        fsc_report *r = fsc_report_new(123456789);
        float norms[3] = {1, 2, 3};
        cr_assert_eq(fsc_report_set_loss(r, 2.5), 0);
        cr_assert_eq(fsc_report_set_layer_weight_norms(r, norms, 3), 0);
        if (with_time)
            cr_assert_eq(fsc_report_set_time(r, 1700000000.25), 0);
        struct fsc_entry *e;
        cr_assert_eq(fsc_report_pack(r, 7, 1u << 20, &e), 0);
        size_t n = fsc_wire_report_placeholder(e->body, e->len, out);
        cr_assert_gt(n, 0);
        /* The placeholder with a seq in front is a Report of that step only. */
        uint8_t msg[2 + FSC_WIRE_PLACEHOLDER_MAX] = {0x08, 0x07};
        memcpy(msg + 2, out, n);
        Foreshock__Report *m = foreshock__report__unpack(NULL, 2 + n, msg);
        cr_assert_not_null(m);
        cr_expect_eq(m->seq, 7);
        cr_expect_eq(m->step, 123456789);
        cr_expect_eq(m->has_time_unix, with_time);
        if (with_time)
            cr_expect_eq(m->time_unix, 1700000000.25);
        cr_expect_null(m->scalars);
        cr_expect_eq(m->n_attention + m->n_router_gram + m->n_router_tokens, 0);
        foreshock__report__free_unpacked(m, NULL);
        free(e);
        fsc_report_free(r);
    }
}

/* ---- backoff ------------------------------------------------------------------- */

Test(client_backoff, delays_grow_and_stay_within_bounds)
{
    static const struct {
        unsigned attempt, min, max, lo, hi;
    } cases[] = {
        {0, 100, 5000, 0, 0},          {1, 100, 5000, 50, 100},    {2, 100, 5000, 100, 200},
        {4, 100, 5000, 400, 800},      {7, 100, 5000, 2500, 5000}, {60, 100, 5000, 2500, 5000},
        {1000, 100, 5000, 2500, 5000}, {3, 250, 250, 125, 250},    {1, 1, 1, 0, 1},
    };
    uint64_t rng = 1;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        for (int k = 0; k < 200; k++) {
            unsigned d = fsc_backoff_delay(cases[i].attempt, cases[i].min, cases[i].max, &rng);
            cr_assert(d >= cases[i].lo && d <= cases[i].hi, "attempt %u: %u not in [%u, %u]",
                      cases[i].attempt, d, cases[i].lo, cases[i].hi);
        }
}

Test(client_backoff, jitter_varies)
{
    uint64_t rng = 12345;
    unsigned first = fsc_backoff_delay(5, 100, 5000, &rng);
    int differs = 0;
    for (int k = 0; k < 50; k++)
        differs |= fsc_backoff_delay(5, 100, 5000, &rng) != first;
    cr_expect(differs, "jitter never changed the delay");
}

/* ---- framing ------------------------------------------------------------------- */

static size_t put_frame(uint8_t *out, const Foreshock__Frame *f)
{
    size_t n = foreshock__frame__get_packed_size(f);
    fsc_wire_put_be32(out, (uint32_t)n);
    foreshock__frame__pack(f, out + 4);
    return 4 + n;
}

Test(client_wire, reader_splits_and_joins_frames)
{
    Foreshock__Ack ack = FORESHOCK__ACK__INIT;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    uint8_t stream[256];
    size_t len = 0;
    struct fsc_wire_reader *rd = calloc(1, sizeof(*rd));
    Foreshock__Frame *got;

    f.body_case = FORESHOCK__FRAME__BODY_ACK;
    f.ack = &ack;
    for (uint64_t s = 1; s <= 3; s++) {
        ack.seq = s * 1000;
        len += put_frame(stream + len, &f);
    }
    /* Byte by byte: a frame appears exactly when its last byte arrives. */
    uint64_t next = 1000;
    for (size_t i = 0; i < len; i++) {
        rd->buf[rd->len++] = stream[i];
        int rc;
        while ((rc = fsc_wire_next(rd, &got)) == 1) {
            cr_expect_eq(got->ack->seq, next);
            next += 1000;
            foreshock__frame__free_unpacked(got, NULL);
        }
        cr_assert_eq(rc, 0);
    }
    cr_expect_eq(next, 4000);
    cr_expect_eq(rd->len, 0);
    free(rd);
}

Test(client_wire, reader_refuses_bad_lengths_and_garbage)
{
    static const uint8_t cases[][8] = {
        {0, 0, 0, 0},                   /* zero length */
        {0, 1, 0, 1},                   /* above FSC_WIRE_MAX_INBOUND */
        {0xff, 0xff, 0xff, 0xff},       /* huge */
        {0, 0, 0, 3, 0xff, 0xff, 0xff}, /* undecodable body */
    };
    static const size_t lens[] = {4, 4, 4, 7};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        struct fsc_wire_reader *rd = calloc(1, sizeof(*rd));
        Foreshock__Frame *got = NULL;
        memcpy(rd->buf, cases[i], lens[i]);
        rd->len = lens[i];
        cr_expect_eq(fsc_wire_next(rd, &got), -EPROTO, "case %zu", i);
        free(rd);
    }
}

/* ---- options ------------------------------------------------------------------- */

enum opt_case {
    OK,
    NULL_OPTS,
    SMALL_SIZE,
    BIG_SIZE_NONZERO,
    NO_RUN,
    EMPTY_RUN,
    BAD_CHARS,
    LONG_RUN,
    WORLD_0,
    RANK_EQ_WORLD,
    BACKOFF_ORDER,
    BACKOFF_MAX,
    REPLAY_SMALL,
    REPLAY_BIG,
    TOKEN_LONG,
    HOST_EMPTY,
    MOE_NULL,
    REPORT_BIG,
    OLD_SIZE,
    RECORD_ONLY_NO_PATH,
    RECORD_BAD_DIR
};

Test(client_options, open_validates)
{
    static const struct {
        enum opt_case c;
        int want;
    } cases[] = {
        {NULL_OPTS, -EINVAL},
        {SMALL_SIZE, -EINVAL},
        {BIG_SIZE_NONZERO, -E2BIG},
        {NO_RUN, -EINVAL},
        {EMPTY_RUN, -EINVAL},
        {BAD_CHARS, -EINVAL},
        {LONG_RUN, -EINVAL},
        {WORLD_0, -EINVAL},
        {RANK_EQ_WORLD, -EINVAL},
        {BACKOFF_ORDER, -EINVAL},
        {BACKOFF_MAX, -EINVAL},
        {REPLAY_SMALL, -EINVAL},
        {REPLAY_BIG, -EINVAL},
        {TOKEN_LONG, -EINVAL},
        {HOST_EMPTY, -EINVAL},
        {MOE_NULL, -EINVAL},
        {REPORT_BIG, -EINVAL},
        {OK, 0},
        {OLD_SIZE, 0},
        {RECORD_ONLY_NO_PATH, -EINVAL},
        {RECORD_BAD_DIR, -ENOENT},
    };
    static char long_run[FSC_MAX_RUN_ID_LEN + 2], long_token[FSC_MAX_TOKEN_LEN + 2];
    memset(long_run, 'a', FSC_MAX_RUN_ID_LEN + 1);
    memset(long_token, 't', FSC_MAX_TOKEN_LEN + 1);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct {
            struct fsc_options o;
            unsigned char extra[16];
        } big;
        struct fsc_options *o = &big.o;
        fsc_client *c = (fsc_client *)&big; /* must be reset to NULL on failure */
        char err[FSC_ERROR_LEN] = "";
        memset(&big, 0, sizeof(big));
        fsc_options_init(o);
        o->run_id = "run-1";
        o->port = 1; /* nothing listens there; the client only tries */
        switch (cases[i].c) {
        case OK:
            break;
        case NULL_OPTS:
            o = NULL;
            break;
        case SMALL_SIZE:
            o->size = FSC_OPTIONS_MIN_SIZE - 8;
            break;
        /* A caller built against 0.1 (no record_* fields): accepted, the
         * missing fields read as zero even when the bytes beyond hold junk. */
        case OLD_SIZE:
            o->size = FSC_OPTIONS_MIN_SIZE;
            o->record_only = 1;
            break;
        case RECORD_ONLY_NO_PATH:
            o->record_only = 1;
            break;
        case RECORD_BAD_DIR:
            o->record_path = "/nonexistent-dir/run.fsrec";
            break;
        case BIG_SIZE_NONZERO:
            o->size = sizeof(big);
            big.extra[3] = 1;
            break;
        case NO_RUN:
            o->run_id = NULL;
            break;
        case EMPTY_RUN:
            o->run_id = "";
            break;
        case BAD_CHARS:
            o->run_id = "run 1";
            break;
        case LONG_RUN:
            o->run_id = long_run;
            break;
        case WORLD_0:
            o->world_size = 0;
            break;
        case RANK_EQ_WORLD:
            o->world_size = 4;
            o->rank = 4;
            break;
        case BACKOFF_ORDER:
            o->backoff_min_ms = 500;
            o->backoff_max_ms = 100;
            break;
        case BACKOFF_MAX:
            o->backoff_max_ms = FSC_MAX_BACKOFF_MS + 1;
            break;
        case REPLAY_SMALL:
            o->replay_max_bytes = FSC_MIN_REPLAY_BYTES - 1;
            break;
        case REPLAY_BIG:
            o->replay_max_bytes = FSC_MAX_REPLAY_BYTES + 1;
            break;
        case TOKEN_LONG:
            o->token = long_token;
            break;
        case HOST_EMPTY:
            o->host = "";
            break;
        case MOE_NULL:
            o->model.n_moe_layers = 2;
            break;
        case REPORT_BIG:
            o->max_report_bytes = FSC_MAX_REPORT_BYTES_LIMIT + 1;
            break;
        }
        int rc = fsc_open(o, &c, err, sizeof(err));
        cr_expect_eq(rc, cases[i].want, "case %zu: got %d want %d (%s)", i, rc, cases[i].want, err);
        if (rc == 0) {
            cr_expect_not_null(c);
            fsc_close(c);
        } else {
            cr_expect_null(c, "case %zu: *out not reset", i);
            cr_expect(err[0] != '\0', "case %zu: no error text", i);
        }
    }
    cr_expect_eq(fsc_open(NULL, NULL, NULL, 0), -EINVAL);
}

/* options.optimizer: 1..FSC_MAX_OPTIMIZER_LEN bytes of printable ASCII,
 * refused by fsc_open with a reason (nothing started), never a crash. */
Test(client_options, optimizer_name_validated)
{
    static char longest[FSC_MAX_OPTIMIZER_LEN + 1], too_long[FSC_MAX_OPTIMIZER_LEN + 2];
    memset(longest, 'a', FSC_MAX_OPTIMIZER_LEN);
    memset(too_long, 'a', FSC_MAX_OPTIMIZER_LEN + 1);
    const struct {
        const char *name, *optimizer;
        int want;
    } cases[] = {
        {"unset", NULL, 0},
        {"class name", "SGD", 0},
        {"longest", longest, 0},
        {"quotes and backslash", "My \"Lion\" \\ v2", 0},
        {"one byte too long", too_long, -EINVAL},
        {"empty", "", -EINVAL},
        {"newline", "Adam\n", -EINVAL},
        {"escape", "\x1b[31mAdam", -EINVAL},
        {"DEL", "Adam\x7f", -EINVAL},
        {"UTF-8", "Ad\xc3\xa4m", -EINVAL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct fsc_options o;
        fsc_client *c = NULL;
        char err[FSC_ERROR_LEN] = "";
        fsc_options_init(&o);
        o.run_id = "run-1";
        o.port = 1; /* nothing listens there; the client only tries */
        o.optimizer = cases[i].optimizer;
        int rc = fsc_open(&o, &c, err, sizeof(err));
        cr_expect_eq(rc, cases[i].want, "%s: got %d (%s)", cases[i].name, rc, err);
        if (rc == 0) {
            fsc_close(c);
        } else {
            cr_expect_null(c, "%s", cases[i].name);
            cr_expect(strstr(err, "optimizer") != NULL, "%s: error '%s'", cases[i].name, err);
        }
    }
}

Test(client_options, defaults_and_version)
{
    struct fsc_options o;
    fsc_options_init(&o);
    cr_expect_eq(o.size, sizeof(o));
    cr_expect_str_eq(o.host, "127.0.0.1");
    cr_expect_eq(o.port, 7781);
    cr_expect_eq(o.world_size, 1);
    cr_expect_eq(o.replay_max_bytes, (size_t)64 << 20);
    cr_expect_str_eq(fsc_version(), FSC_VERSION);
}

/* What the daemon refuses in every report, its empty placeholder included
 * (which keeps step and time): refused at packing, or a recording holding
 * it would be resent for ever (issue 22). */
Test(client_report, pack_refuses_what_even_the_placeholder_cannot_carry)
{
    struct {
        uint64_t step;
        int has_time;
        double time;
        int rc;
    } cases[] = {
        {(uint64_t)INT64_MAX, 1, 1.7e9, 0},
        {(uint64_t)INT64_MAX + 1, 0, 0, -ERANGE},
        {UINT64_MAX, 0, 0, -ERANGE},
        {7, 1, NAN, -ERANGE},
        {7, 1, INFINITY, -ERANGE},
        {7, 1, -INFINITY, -ERANGE},
        {7, 0, NAN, 0}, /* no time: nothing to refuse */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        Foreshock__Report m = FORESHOCK__REPORT__INIT;
        struct fsc_entry *e = NULL;
        m.step = cases[i].step;
        m.has_time_unix = cases[i].has_time;
        m.time_unix = cases[i].time;
        cr_expect_eq(fsc_report_pack_msg(&m, 1000, &e), cases[i].rc, "case %zu", i);
        cr_expect_eq(e != NULL, cases[i].rc == 0, "case %zu", i);
        free(e);
    }
}
