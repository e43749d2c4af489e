/* api_openai.c — OpenAI's Chat Completions (POST /v1/chat/completions) and Completions
** (POST /v1/completions) as two modules of api.h: the request parsed by server/request.c (every
** field checked against the OpenAI table of server/fields.c first), the reply a chat.completion
** or text_completion with kvtier's usage, the stream its chunks ending in "data: [DONE]", errors
** in the server's one form.  n > 1 runs one job per choice side by side. */
#include "api.h"
#include "fields.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static bool is_chat(const struct job *j) { return j->req.api == &serve_api_chat; }

static json_t *usage_obj(const struct job *j) {
    json_t *u = json_pack(
        "{s:i, s:i, s:i, s:{s:I, s:I, s:I, s:I, s:I, s:i, s:s, s:s, s:I, s:I, s:I, s:i}}", "prompt_tokens", j->prompt_tokens,
        "completion_tokens", j->completion_tokens, "total_tokens", j->prompt_tokens + j->completion_tokens, "kvtier",
        "prompt_tokens_reused", (json_int_t) j->sync.tokens_reused, "prompt_tokens_decoded", (json_int_t) j->sync.tokens_decoded,
        "evictions", (json_int_t) j->sync.evictions, "recoveries", (json_int_t) j->sync.recoveries, "recomputes",
        (json_int_t) j->sync.recomputes, "resident_tokens", j->resident_tokens, "session_id", j->out_session, "store",
        kvt_route_name(j->sync.route), "prompt_tokens_from_store", (json_int_t) j->sync.tokens_from_store,
        "prompt_tokens_from_chunks", (json_int_t) j->sync.tokens_from_chunks, "prompt_tokens_chunk_recomputed",
        (json_int_t) j->sync.chunk_recompute_tokens, "decode_steps_shared", j->shared_steps);
    json_t *kv = json_object_get(u, "kvtier");
    if (kv && json_array_size(j->req.ignored)) json_object_set(kv, "ignored_fields", j->req.ignored); /* fields no table knows */
    return u;
}

/* The reply of a finished job (its id numbered from srv->n_replies). */
static json_t *final_obj(struct server *srv, const struct job *j) {
    char id[64];
    snprintf(id, sizeof id, "%s-%llu", is_chat(j) ? "chatcmpl" : "cmpl", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    json_t *choice;
    if (is_chat(j)) {
        const char *fin = j->finish;
        json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
        choice = json_pack("{s:i, s:o, s:s, s:n}", "index", 0, "message", msg, "finish_reason", fin, "logprobs");
    } else {
        char *text = app_utf8_clean(j->text ? j->text : "");
        choice = json_pack("{s:i, s:s, s:s, s:n}", "index", 0, "text", text ? text : "", "finish_reason", j->finish, "logprobs");
        free(text);
    }
    json_t *lps = choice ? serve_logprobs_json(srv, j) : NULL;
    if (lps) json_object_set_new(choice, "logprobs", json_pack("{s:o}", "content", lps));
    json_t *verbose = NULL;
    if (j->req.verbose) { /* llama-server's "__verbose": the prompt as the model saw it */
        char *text = NULL;
        if (j->kind == JOB_CHAT)
            kvt_chat_format(srv->eng, j->req.msgs, j->req.n_msgs, true, kvt_session_default_params().template_fallback, &text);
        char *clean = app_utf8_clean(text ? text : j->req.prompt ? j->req.prompt : "");
        verbose = json_pack("{s:s}", "prompt", clean ? clean : "");
        free(clean);
        free(text);
    }
    json_t *reply = json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", id, "object",
                              is_chat(j) ? "chat.completion" : "text_completion", "created", (json_int_t) time(NULL), "model",
                              srv->model_name, "choices", choice, "usage", usage_obj(j));
    if (reply && verbose) json_object_set_new(reply, "__verbose", verbose);
    else json_decref(verbose);
    return reply;
}

/* delta: the chat delta to send as is (stolen), else built from role/content. */
static json_t *chunk_delta(struct stream *st, json_t *delta, const char *content, const char *finish, bool role) {
    const struct job *j = st->j;
    json_t *choice;
    if (is_chat(j)) {
        if (!delta) {
            delta = json_object();
            if (role) json_object_set_new(delta, "role", json_string("assistant"));
            if (content) json_object_set_new(delta, "content", json_string(content));
            else if (role) json_object_set_new(delta, "content", json_null()); /* the role chunk: no text yet */
        }
        choice = json_pack("{s:i, s:o, s:o, s:n}", "index", 0, "delta", delta, "finish_reason",
                           finish ? json_string(finish) : json_null(), "logprobs");
    } else {
        choice = json_pack("{s:i, s:s, s:o, s:n}", "index", 0, "text", content ? content : "", "finish_reason",
                           finish ? json_string(finish) : json_null(), "logprobs");
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", st->id, "object",
                     is_chat(j) ? "chat.completion.chunk" : "text_completion", "created", (json_int_t) time(NULL), "model",
                     st->srv->model_name, "choices", choice);
}

/* n > 1 on /v1/chat/completions and /v1/completions (OpenAI's choices): one job per choice, run
** side by side.  A chat's first choice runs in its session, which keeps it as the conversation's
** reply (a client that goes on with another choice sends it back: the session then takes that
** history); the others are completions of the template's text (serve_request_detach) in scratch
** sequences, whose prompt cache lets each reuse the prompt another decoded.  Choice i samples with
** the request's seed + i (the same seed would give n equal choices).  Not streamed, no tools. */
static enum MHD_Result post_choices(struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid, json_t *root,
                                    const struct serve_api *api, int n) {
    const bool chat = api == &serve_api_chat;
    struct serve_error e = { 0 };
    serve_error_param(&e, "n");
    /* its jobs wait in the queue together: more than one API key may queue never fits (a 400, not a
    ** 429 to retry); fewer may still find the queue full now (429) */
    const int32_t cap = KVT_MIN(srv->max_queue, srv->queue_per_key);
    if (json_is_true(json_object_get(root, "stream")))
        serve_bad(&e, "'n' %d: several choices are not streamed (send stream false)", n);
    else if (n > cap)
        serve_bad(&e, "'n' %d is more than this server queues at once for one API key (%d, --queue%s)", n, cap,
                  srv->queue_per_key < srv->max_queue ? "-per-key" : "");
    struct job *jobs[SERVE_MAX_CHOICES] = { 0 };
    size_t k = 0;
    for (; !e.status && k < (size_t) n; k++) {
        json_t *one = json_copy(root);
        struct job *j = calloc(1, sizeof *j);
        if (one) json_object_del(one, "n");
        if (!one || !j) {
            json_decref(one);
            free(j);
            serve_error_oom(&e);
            break;
        }
        jobs[k] = j;
        j->kind = chat ? JOB_CHAT : JOB_COMPLETION;
        j->req.api = api;
        snprintf(j->req.ns, sizeof j->req.ns, "%s", ns);
        if (sid && k == 0) snprintf(j->req.session_id, sizeof j->req.session_id, "%s", sid);
        pthread_cond_init(&j->cv, NULL);
        if (serve_fields_check(FIELD_TABLE_OPENAI, one, &j->req.ignored, &e) == 0 &&
            serve_request_parse(srv, one, j, chat, &e) == 0 && k > 0)
            serve_request_detach(srv, j, &e);
        j->req.smp.seed += (uint32_t) k;
        json_decref(one);
    }
    json_decref(root);
    size_t submitted = e.status ? 0 : serve_run_jobs(srv, c, jobs, k, &e);
    json_t *reply = NULL, *choices = json_array();
    int64_t completion_tokens = 0;
    for (size_t i = 0; i < k; i++) {
        struct job *j = jobs[i];
        if (!j) continue;
        if (i >= submitted) { /* parsed, never queued */
            serve_job_free(j);
            continue;
        }
        if (!e.status) {
            json_t *r = final_obj(srv, j), *ch = json_array_get(json_object_get(r, "choices"), 0);
            if (ch) json_object_set_new(ch, "index", json_integer((json_int_t) i));
            if (ch && choices) json_array_append(choices, ch);
            completion_tokens += j->completion_tokens;
            if (i == 0) reply = r; /* its id, model and usage (the prompt's tokens) */
            else json_decref(r);
        }
        serve_job_release(srv, j);
    }
    if (e.status || !reply || !choices) {
        json_decref(reply);
        json_decref(choices);
        if (!e.status) serve_error_oom(&e);
        return serve_send_err(srv, c, &e, NULL);
    }
    json_object_set_new(reply, "choices", choices);
    json_t *u = json_object_get(reply, "usage");
    json_int_t pt = json_integer_value(json_object_get(u, "prompt_tokens"));
    json_object_set_new(u, "completion_tokens", json_integer(completion_tokens));
    json_object_set_new(u, "total_tokens", json_integer(pt + completion_tokens));
    return serve_send_json(srv, c, 200, reply, NULL);
}

static json_t *chunk(struct stream *st, const char *content, const char *finish, bool role) {
    return chunk_delta(st, NULL, content, finish, role);
}

/* ---- the module: parse, fan out, reply ---- */

static int parse(struct server *srv, json_t *root, struct job *j, struct serve_error *e) {
    j->kind = is_chat(j) ? JOB_CHAT : JOB_COMPLETION;
    serve_request_slot(j, root);
    if (serve_fields_check(FIELD_TABLE_OPENAI, root, &j->req.ignored, e)) return -1; /* types, refused and neutral fields */
    return serve_request_parse(srv, root, j, is_chat(j), e);
}

static int fan_out_as(const struct serve_api *api, struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid,
                      json_t *root, enum MHD_Result *ret) {
    const json_t *nv = json_object_get(root, "n");
    if (!json_is_integer(nv) || json_integer_value(nv) <= 1 || json_integer_value(nv) > SERVE_MAX_CHOICES) return 0;
    *ret = post_choices(srv, c, ns, sid, root, api, (int) json_integer_value(nv));
    return 1;
}
static int fan_out_chat(struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid, json_t *root,
                        enum MHD_Result *ret) {
    return fan_out_as(&serve_api_chat, srv, c, ns, sid, root, ret);
}
static int fan_out_completions(struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid, json_t *root,
                               enum MHD_Result *ret) {
    return fan_out_as(&serve_api_completions, srv, c, ns, sid, root, ret);
}

static json_t *reply(struct server *srv, struct job *j) { return final_obj(srv, j); }

/* ---- the module: the stream ---- */

static void s_start(struct stream *st) {
    const struct job *j = st->j;
    snprintf(st->id, sizeof st->id, "%s-%llu", is_chat(j) ? "chatcmpl" : "cmpl",
             __atomic_add_fetch(&st->srv->n_replies, 1, __ATOMIC_RELAXED));
    /* a chat's first chunk carries the role; with return_progress each progress chunk does */
    if (is_chat(j) && !j->req.return_progress) sse_data(st, chunk(st, NULL, NULL, true));
}

/* return_progress: a chunk with no text carrying llama-server's "prompt_progress" (and "timings"
** with timings_per_token). */
static void s_progress(struct stream *st, const struct prompt_progress *p) {
    const struct job *j = st->j;
    json_t *ev = chunk(st, is_chat(j) ? NULL : "", NULL, is_chat(j)); /* a chat's carries the role */
    serve_progress_attach(ev, j, p);
    sse_data(st, ev);
}

/* a reply under tools, whole: one delta with its tool_calls (or content) */
static void s_whole(struct stream *st, json_t *msg, const char **fin) {
    (void) fin;
    json_object_del(msg, "role");
    if (json_is_null(json_object_get(msg, "content"))) json_object_del(msg, "content");
    sse_data(st, chunk_delta(st, msg, NULL, NULL, false));
}

static void s_piece(struct stream *st, const char *piece, json_t *tm, json_t *lps) {
    json_t *ch = chunk(st, piece, NULL, false);
    if (ch && tm) json_object_set(ch, "timings", tm);
    if (ch && lps)
        json_object_set_new(json_array_get(json_object_get(ch, "choices"), 0), "logprobs", json_pack("{s:O}", "content", lps));
    sse_data(st, ch);
}

/* the last chunk with the finish reason (or the error), usage with stream_options.include_usage,
** and "data: [DONE]" */
static void s_end(struct stream *st, const char *fin) {
    const struct job *j = st->j;
    if (j->err.status && j->err.status != 200) sse_data(st, serve_error_json(&j->err));
    else {
        sse_data(st, chunk(st, NULL, fin, false));
        if (j->req.include_usage) {
            json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", st->id, "object",
                                  is_chat(j) ? "chat.completion.chunk" : "text_completion", "created", (json_int_t) time(NULL),
                                  "model", st->srv->model_name, "choices", "usage", usage_obj(j));
            if (u && j->req.timings) json_object_set_new(u, "timings", serve_timings(j, serve_mono_ms()));
            sse_data(st, u);
        }
    }
    sse_raw(st, "data: [DONE]\n\n");
}

const struct serve_api serve_api_chat = {
    .name = "chat",
    .parse = parse,
    .fan_out = fan_out_chat,
    .reply = reply,
    .error = serve_error_json,
    .s_start = s_start,
    .s_progress = s_progress,
    .s_whole = s_whole,
    .s_piece = s_piece,
    .s_end = s_end,
};

const struct serve_api serve_api_completions = {
    .name = "completions",
    .parse = parse,
    .fan_out = fan_out_completions,
    .reply = reply,
    .error = serve_error_json,
    .s_start = s_start,
    .s_progress = s_progress,
    .s_piece = s_piece,
    .s_end = s_end,
};
