/* Ingest, admission: a Hello is checked (token), turned into the writer's
 * Hello item and the stage's run_hello; its result becomes the Welcome. */
#include "ingest_internal.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ranks.h"
#include "run_auth.h"

/* The arrays a connection's Hello carried for the stage (run_hello copies
 * what it keeps). */
void ingest_hello_release(struct run_hello *h)
{
    free((void *)h->moe_layers);
    free((void *)h->local_ranks);
    h->moe_layers = h->local_ranks = NULL;
    h->n_moe_layers = h->n_local_ranks = 0;
}

static char *model_json(const Foreshock__ModelShape *m)
{
    if (!m)
        return NULL;
    json_t *o = json_object();
    if (!o)
        return NULL;
    const struct {
        const char *key;
        int has;
        uint32_t v;
    } f[] = {
        {"n_layers", m->has_n_layers, m->n_layers},
        {"n_heads", m->has_n_heads, m->n_heads},
        {"n_kv_heads", m->has_n_kv_heads, m->n_kv_heads},
        {"d_model", m->has_d_model, m->d_model},
        {"d_head", m->has_d_head, m->d_head},
        {"n_experts", m->has_n_experts, m->n_experts},
        {"top_k", m->has_top_k, m->top_k},
    };
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        if (f[i].has)
            json_object_set_new(o, f[i].key, json_integer(f[i].v));
    if (m->n_moe_layers) {
        json_t *a = json_array();
        for (size_t i = 0; i < m->n_moe_layers; i++)
            json_array_append_new(a, json_integer(m->moe_layers[i]));
        json_object_set_new(o, "moe_layers", a);
    }
    /* Printable ASCII (decode.c checked it): jansson escapes '"' and '\\'. */
    if (m->optimizer)
        json_object_set_new(o, "optimizer", json_string(m->optimizer));
    char *s = json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(o);
    if (s && strlen(s) > FS_STORE_MODEL_JSON_MAX) {
        free(s);
        s = NULL;
    }
    return s;
}

/* Constant-time comparison: the token is a secret. */
static int token_ok(const char *want, const char *got)
{
    if (!want[0])
        return 1;
    if (!got)
        return 0;
    size_t n = strlen(want), m = strlen(got);
    unsigned char diff = (unsigned char)(n != m);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)(want[i] ^ (i < m ? got[i] : 0));
    return diff == 0;
}

void conn_on_hello(struct conn *c, const Foreshock__Hello *h)
{
    struct ingest *ing = c->ing;
    if (c->state != AWAIT_HELLO) {
        conn_protocol_error(c, E(SEQUENCE), "second Hello on this connection");
        return;
    }
    if (!token_ok(run_auth_token(ing->opts.run_auth, h->run_id, ing->token), h->token)) {
        conn_protocol_error(c, E(AUTH), "token missing or wrong");
        return;
    }
    conn_authenticated(c); /* no longer a stranger: off max_unauthenticated */
    struct store_item *it = store_item_new(STORE_ITEM_HELLO);
    if (!it) {
        conn_protocol_error(c, E(INTERNAL), "out of memory");
        return;
    }
    it->conn_id = c->id;
    snprintf(it->hello.run, sizeof(it->hello.run), "%s", h->run_id);
    snprintf(it->hello.owner, sizeof(it->hello.owner), "%s",
             run_auth_owner(ing->opts.run_auth, h->run_id));
    it->hello.attempt = h->has_attempt ? h->attempt : 0;
    it->hello.rank = h->rank;
    it->hello.world_size = h->world_size;
    it->hello.has_detect_from_step = h->has_detect_from_step;
    it->hello.detect_from_step = h->detect_from_step;
    it->hello.model_json = model_json(h->model);
    /* Only a client that says it knows Advice gets one (proto: capabilities). */
    c->advice.enabled =
        h->has_capabilities && (h->capabilities & FORESHOCK__CAPABILITY__CAPABILITY_ADVICE);
    it->hello.advice = c->advice.enabled;
    it->hello.has_resume_step = h->has_resume_step;
    it->hello.resume_step = h->resume_step;
    if (h->n_local_ranks) {
        /* Normalised once here, for the store (text) and the stage. */
        uint32_t *local = malloc(h->n_local_ranks * sizeof(*local));
        if (local) {
            memcpy(local, h->local_ranks, h->n_local_ranks * sizeof(*local));
            c->hello.n_local_ranks = ranks_normalize(local, h->n_local_ranks);
            c->hello.local_ranks = local;
            it->hello.local_ranks = ranks_format(local, c->hello.n_local_ranks);
        }
        if (!local || !it->hello.local_ranks) {
            store_item_free(it);
            conn_protocol_error(c, E(INTERNAL), "out of memory");
            return;
        }
    }
    it->hello.stream_key = store_stream_key(h->run_id, it->hello.attempt, h->rank);
    c->stream_key = it->hello.stream_key;
    c->rank = h->rank;
    snprintf(c->run_name, sizeof(c->run_name), "%s", h->run_id);
    c->hello.rank = h->rank;
    c->hello.world_size = h->world_size;
    c->hello.has_detect_from_step = h->has_detect_from_step;
    c->hello.detect_from_step = h->detect_from_step;
    if (h->model) {
        c->hello.has_n_layers = h->model->has_n_layers;
        c->hello.n_layers = h->model->n_layers;
        c->hello.has_n_heads = h->model->has_n_heads;
        c->hello.n_heads = h->model->n_heads;
        if (h->model->optimizer) { /* decode checked it: 1..FS_MAX_OPTIMIZER_LEN printable */
            snprintf(c->optimizer, sizeof(c->optimizer), "%s", h->model->optimizer);
            c->hello.optimizer = c->optimizer;
        }
        if (h->model->n_moe_layers) {
            uint32_t *moe = malloc(h->model->n_moe_layers * sizeof(*moe));
            if (moe) { /* without it the stage waits for world_size ranks */
                memcpy(moe, h->model->moe_layers, h->model->n_moe_layers * sizeof(*moe));
                c->hello.moe_layers = moe;
                c->hello.n_moe_layers = h->model->n_moe_layers;
            }
        }
    }
    /* The run budget (max_run_bytes) before anything is allocated for the shape. */
    char why[256];
    if (ing->opts.stage && stage_shape_check(ing->opts.stage, &c->hello, why, sizeof(why)) < 0) {
        store_item_free(it);
        conn_protocol_error(c, E(LIMIT), why);
        return;
    }
    c->state = AWAIT_WELCOME;
    log_debug("ingest", "conn %llu %s: hello run=%s attempt=%u rank=%u/%u",
              (unsigned long long)c->id, c->peer, h->run_id, it->hello.attempt, h->rank,
              h->world_size);
    conn_submit(c, it, NULL);
}

void conn_on_hello_done(struct conn *c, const struct store_result *r)
{
    if (r->error_code) {
        conn_protocol_error(c, r->error_code, r->message);
        return;
    }
    if (c->state != AWAIT_WELCOME)
        return;
    c->run_id = r->run_id;
    c->stream_id = r->stream_id;
    c->seq_base = c->seq_last = r->seq;
    c->state = STREAMING;
    int rc = c->ing->opts.stage ? stage_hello(c->ing->opts.stage, r->run_id, c->run_name,
                                              r->stream_id, r->seq, &c->hello)
                                : 0;
    ingest_hello_release(&c->hello);
    if (rc == -ENOSPC) {
        char msg[FS_MAX_ERROR_MESSAGE];
        snprintf(msg, sizeof(msg),
                 "run %s: more than %u distinct local groups declared to this "
                 "daemon; ranks of one daemon declare the same local_ranks",
                 c->run_name, RUN_MAX_LOCAL_GROUPS);
        conn_protocol_error(c, E(LIMIT), msg);
        return;
    }
    if (rc < 0)
        log_limited(&c->ing->rl_limit, LOG_LEVEL_ERROR, "ingest",
                    "conn %llu: out of memory registering run %s with the monitors",
                    (unsigned long long)c->id, c->run_name);
    else if (c->ing->opts.stage && stage_attempt(c->ing->opts.stage, r->run_id, r->stream_id,
                                                 r->attempt, &r->run_attempt) < 0)
        log_limited(&c->ing->rl_limit, LOG_LEVEL_ERROR, "ingest",
                    "conn %llu: out of memory registering the attempt of run %s",
                    (unsigned long long)c->id, c->run_name);
    Foreshock__Welcome w = FORESHOCK__WELCOME__INIT;
    w.protocol_version = FORESHOCK__PROTOCOL_VERSION__PROTOCOL_VERSION_CURRENT;
    w.last_seq = r->seq;
    w.server_version = FORESHOCK_VERSION;
    w.max_frame_bytes = c->ing->opts.limits.max_frame_bytes;
    w.has_stream_id = 1;
    w.stream_id = (uint64_t)r->stream_id;
    Foreshock__Frame f = FORESHOCK__FRAME__INIT;
    f.body_case = FORESHOCK__FRAME__BODY_WELCOME;
    f.welcome = &w;
    conn_send_frame(c, &f);
}
