/* anthropic.c — Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the
** chat path: a request is translated into the chat completion request it means (system, text,
** tool_use and tool_result blocks, tools with input_schema, tool_choice, stop_sequences) and
** parsed and run as one, in a session like any chat (its KV kept between turns: usage's
** cache_read_input_tokens are the prompt tokens reused, input_tokens the ones decoded); the reply
** is a Message (text and tool_use blocks, stop_reason) and a stream its events (message_start,
** content_block_start/delta/stop, message_delta, message_stop; written here for server/stream.c).
** Shapes as docs.anthropic.com documents them.  Images and documents are refused with a 400:
** kvtier serves text models. */
#include "api.h"
#include "fields.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The text of a block list's text blocks, joined with "\n" (a string content as it is).  Other
** block types: a 400 naming where, unless allowed (skipped).  New string; NULL with e filled. */
static char *blocks_text(const json_t *content, const char *where, int32_t max_parts, struct serve_error *e) {
    if (json_is_string(content)) return strdup(json_string_value(content));
    if (!json_is_array(content)) {
        serve_error_param(e, "messages");
        serve_bad(e, "'%s' must be a string or an array of content blocks, got %s", where, serve_json_type(content));
        return NULL;
    }
    if (json_array_size(content) > (size_t) max_parts) { /* before any work on them */
        serve_error_param(e, "messages");
        serve_bad(e, "'%s' has %zu blocks; at most %d (--max-content-parts)", where, json_array_size(content), max_parts);
        return NULL;
    }
    size_t cap = 1, n = 0, i;
    for (i = 0; i < json_array_size(content); i++) {
        const json_t *t = json_object_get(json_array_get(content, i), "text");
        if (json_is_string(t)) cap += json_string_length(t) + 1;
    }
    char *out = malloc(cap);
    if (!out) {
        serve_error_oom(e);
        return NULL;
    }
    out[0] = '\0';
    const json_t *b;
    json_array_foreach(content, i, b) {
        const char *type = json_string_value(json_object_get(b, "type"));
        if (type && !strcmp(type, "text") && json_is_string(json_object_get(b, "text"))) {
            const json_t *t = json_object_get(b, "text");
            if (n) out[n++] = '\n';
            memcpy(out + n, json_string_value(t), json_string_length(t));
            n += json_string_length(t);
            out[n] = '\0';
        } else if (type && (!strcmp(type, "image") || !strcmp(type, "document"))) {
            free(out);
            serve_error_param(e, "messages");
            serve_bad(e, "'%s[%zu]' is an %s block: image input is not supported (kvtier serves text models)", where, i, type);
            return NULL;
        } else if (!type || strcmp(type, "thinking")) { /* earlier thinking is not replayed */
            free(out);
            serve_error_param(e, "messages");
            serve_bad(e, "'%s[%zu]' has type '%s'; expected text here", where, i, type ? type : "(none)");
            return NULL;
        }
    }
    return out;
}

/* One Anthropic message as chat messages, appended to msgs. */
static int add_message(const json_t *m, size_t mi, json_t *msgs, int32_t max_parts, struct serve_error *e) {
    char where[48];
    snprintf(where, sizeof where, "messages[%zu].content", mi);
    const char *role = json_string_value(json_object_get(m, "role"));
    const json_t *content = json_object_get(m, "content");
    serve_error_param(e, "messages");
    if (!role || (strcmp(role, "user") && strcmp(role, "assistant")))
        return serve_bad(e, "'messages[%zu].role' must be user or assistant", mi);
    if (json_is_string(content))
        return json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", role, "content", content)) ? serve_error_oom(e) : 0;
    if (!json_is_array(content))
        return serve_bad(e, "'%s' must be a string or an array of content blocks, got %s", where, serve_json_type(content));
    if (json_array_size(content) > (size_t) max_parts) /* before any work on them */
        return serve_bad(e, "'%s' has %zu blocks; at most %d (--max-content-parts)", where, json_array_size(content), max_parts);
    bool assistant = !strcmp(role, "assistant");
    json_t *text = json_array(), *calls = json_array();
    int rc = text && calls ? 0 : serve_error_oom(e);
    size_t i;
    const json_t *b;
    json_array_foreach(content, i, b) {
        if (rc) break;
        const char *type = json_string_value(json_object_get(b, "type"));
        if (assistant && type && !strcmp(type, "tool_use")) {
            const char *id = json_string_value(json_object_get(b, "id")), *name = json_string_value(json_object_get(b, "name"));
            const json_t *input = json_object_get(b, "input");
            if (!id || !name || !json_is_object(input)) {
                rc = serve_bad(e, "'%s[%zu]' (tool_use) needs a string id and name and an object input", where, i);
                break;
            }
            char *args = json_dumps(input, JSON_COMPACT);
            json_t *call = args ? json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function", "function", "name", name,
                                            "arguments", args)
                                : NULL;
            free(args);
            if (!call || json_array_append_new(calls, call)) rc = serve_error_oom(e);
        } else if (!assistant && type && !strcmp(type, "tool_result")) {
            const char *id = json_string_value(json_object_get(b, "tool_use_id"));
            if (!id) {
                rc = serve_bad(e, "'%s[%zu]' (tool_result) needs a string tool_use_id", where, i);
                break;
            }
            char w2[96];
            snprintf(w2, sizeof w2, "%s[%zu].content", where, i);
            const json_t *rc_content = json_object_get(b, "content");
            char *t = rc_content ? blocks_text(rc_content, w2, max_parts, e) : strdup("");
            if (!t) {
                rc = e->status ? -1 : serve_error_oom(e);
                break;
            }
            bool err = json_is_true(json_object_get(b, "is_error"));
            size_t need = strlen(t) + 8;
            char *body = malloc(need);
            if (body) snprintf(body, need, "%s%s", err ? "Error: " : "", t);
            free(t);
            json_t *tm = body ? json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id", id, "content", body) : NULL;
            free(body);
            if (!tm || json_array_append_new(msgs, tm)) rc = serve_error_oom(e);
        } else {
            json_t *one = json_array();
            if (!one || json_array_append(one, (json_t *) b)) {
                json_decref(one);
                rc = serve_error_oom(e);
                break;
            }
            char w2[96];
            snprintf(w2, sizeof w2, "messages[%zu].content", mi);
            char *t = blocks_text(one, w2, max_parts, e);
            json_decref(one);
            if (!t) {
                rc = e->status ? -1 : serve_error_oom(e);
                break;
            }
            if (*t) json_array_append_new(text, json_string(t));
            free(t);
        }
    }
    if (rc == 0 && (json_array_size(text) || json_array_size(calls) || !json_array_size(content))) {
        size_t n = 1, k;
        json_t *t;
        json_array_foreach(text, k, t) n += json_string_length(t) + 1;
        char *joined = malloc(n);
        if (!joined) rc = serve_error_oom(e);
        else {
            size_t len = 0; /* linear: each piece copied once at the end (strcat would scan from the start) */
            json_array_foreach(text, k, t) {
                if (k) joined[len++] = '\n';
                memcpy(joined + len, json_string_value(t), json_string_length(t));
                len += json_string_length(t);
            }
            joined[len] = '\0';
            json_t *cm = json_pack("{s:s, s:s}", "role", role, "content", joined);
            if (cm && json_array_size(calls)) json_object_set(cm, "tool_calls", calls);
            if (!cm || json_array_append_new(msgs, cm)) rc = serve_error_oom(e);
            free(joined);
        }
    }
    json_decref(text);
    json_decref(calls);
    return rc;
}

int anth_to_chat(const json_t *in, const struct serve_limits *lim, json_t **out, json_t **ignored, struct serve_error *e) {
    *out = NULL;
    const json_t *ms = json_object_get(in, "messages");
    if (json_array_size(ms) > (size_t) lim->max_messages) { /* before any work on them */
        serve_error_param(e, "messages");
        return serve_bad(e, "'messages' has %zu entries; at most %d (--max-messages)", json_array_size(ms), lim->max_messages);
    }
    if (serve_fields_check(FIELD_TABLE_ANTHROPIC, in, ignored, e)) return -1; /* types, refused and neutral fields */
    json_t *o = json_object(), *msgs = json_array();
    if (!o || !msgs || json_object_set_new(o, "messages", msgs)) {
        json_decref(o);
        return serve_error_oom(e);
    }
    int rc = 0;
    const json_t *v;
    if ((v = json_object_get(in, "system")) && !json_is_null(v)) {
        char *t = blocks_text(v, "system", lim->max_parts, e);
        if (!t) rc = e->status ? -1 : serve_error_oom(e);
        else if (json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", t))) rc = serve_error_oom(e);
        if (!strcmp(e->param, "messages")) serve_error_param(e, "system");
        free(t);
    }
    if (rc == 0 && !json_is_array(ms)) {
        serve_error_param(e, "messages");
        rc = serve_bad(e, "'messages' must be an array of messages, got %s", serve_json_type(ms));
    }
    size_t i;
    const json_t *m;
    if (rc == 0) json_array_foreach(ms, i, m) {
            if (!json_is_object(m)) {
                serve_error_param(e, "messages");
                rc = serve_bad(e, "'messages[%zu]' must be an object, got %s", i, serve_json_type(m));
            } else rc = add_message(m, i, msgs, lim->max_parts, e);
            if (rc) break;
        }
    /* the fields that mean the same under another name, and those with the same name */
    static const char *const same[][2] = {
        { "max_tokens", "max_tokens" }, { "stop_sequences", "stop" }, { "temperature", "temperature" },
        { "top_p", "top_p" },           { "top_k", "top_k" },         { "stream", "stream" },
        { "model", "model" },           { "metadata", "metadata" }
    };
    for (size_t k = 0; rc == 0 && k < sizeof same / sizeof same[0]; k++)
        if ((v = json_object_get(in, same[k][0])) && json_object_set(o, same[k][1], (json_t *) v)) rc = serve_error_oom(e);
    if (rc == 0 && (v = json_object_get(in, "tools")) && !json_is_null(v)) {
        serve_error_param(e, "tools");
        if (!json_is_array(v)) rc = serve_bad(e, "'tools' must be an array, got %s", serve_json_type(v));
        json_t *tools = json_array();
        const json_t *t;
        if (rc == 0) json_array_foreach(v, i, t) {
                const char *name = json_string_value(json_object_get(t, "name"));
                const json_t *schema = json_object_get(t, "input_schema"), *desc = json_object_get(t, "description");
                if (!name) {
                    rc = serve_bad(e, "'tools[%zu].name' must be a string", i);
                    break;
                }
                if (compat_function_tool(tools, name, desc, schema)) rc = serve_error_oom(e);
            }
        if (rc == 0 && json_object_set_new(o, "tools", tools)) rc = serve_error_oom(e);
        else if (rc) json_decref(tools);
    }
    if (rc == 0 && (v = json_object_get(in, "tool_choice")) && !json_is_null(v)) {
        serve_error_param(e, "tool_choice");
        const char *type = json_string_value(json_object_get(v, "type"));
        json_t *tc = NULL;
        if (type && !strcmp(type, "auto")) tc = json_string("auto");
        else if (type && !strcmp(type, "any")) tc = json_string("required");
        else if (type && !strcmp(type, "none")) tc = json_string("none");
        else if (type && !strcmp(type, "tool") && json_is_string(json_object_get(v, "name")))
            tc = json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", json_object_get(v, "name"));
        else rc = serve_bad(e, "'tool_choice' must be {\"type\": auto, any, none, or tool with a name}");
        if (tc && json_object_set_new(o, "tool_choice", tc)) rc = serve_error_oom(e);
        if (rc == 0 && json_is_true(json_object_get(v, "disable_parallel_tool_use")))
            json_object_set_new(o, "parallel_tool_calls", json_false());
    }
    if (rc) {
        json_decref(o);
        return -1;
    }
    serve_error_param(e, NULL);
    *out = o;
    return 0;
}

static const char *stop_reason(const struct job *j, const char *fin) {
    if (!strcmp(fin, "tool_calls")) return "tool_use";
    if (!strcmp(fin, "length")) return "max_tokens";
    return j->stop_word ? "stop_sequence" : "end_turn";
}

json_t *anth_usage(const struct job *j, bool final) {
    int64_t reused = j->sync.tokens_reused;
    json_t *u = json_pack("{s:I, s:I, s:i, s:i}", "input_tokens", (json_int_t) (j->prompt_tokens - reused),
                          "cache_read_input_tokens", (json_int_t) reused, "cache_creation_input_tokens", 0, "output_tokens",
                          final ? j->completion_tokens : 0);
    if (u && json_array_size(j->req.ignored)) /* the request's fields no table knows */
        json_object_set_new(u, "kvtier", json_pack("{s:O}", "ignored_fields", j->req.ignored));
    return u;
}

json_t *anth_blocks(const json_t *msg) {
    json_t *blocks = json_array();
    const json_t *c = json_object_get(msg, "content"), *calls = json_object_get(msg, "tool_calls");
    if (json_is_string(c) && json_string_length(c))
        json_array_append_new(blocks, json_pack("{s:s, s:O}", "type", "text", "text", c));
    size_t i;
    const json_t *call;
    json_array_foreach(calls, i, call) {
        const json_t *fn = json_object_get(call, "function");
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        json_t *input = args ? json_loads(args, 0, NULL) : NULL;
        json_array_append_new(blocks, json_pack("{s:s, s:O, s:O, s:o}", "type", "tool_use", "id", json_object_get(call, "id"),
                                                "name", json_object_get(fn, "name"), "input", input ? input : json_object()));
    }
    return blocks;
}

json_t *anth_message(struct server *srv, const struct job *j, const json_t *msg, const char *fin) {
    char id[48];
    snprintf(id, sizeof id, "msg_%llu", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    json_t *blocks = msg ? anth_blocks(msg) : json_array();
    if (blocks && fin && json_array_size(blocks) == 0)
        json_array_append_new(blocks, json_pack("{s:s, s:s}", "type", "text", "text", ""));
    const char *sr = fin ? stop_reason(j, fin) : NULL;
    return json_pack("{s:s, s:s, s:s, s:s, s:o, s:o, s:o, s:o}", "id", id, "type", "message", "role", "assistant", "model",
                     srv->model_name, "content", blocks ? blocks : json_array(), "stop_reason", sr ? json_string(sr) : json_null(),
                     "stop_sequence",
                     sr && !strcmp(sr, "stop_sequence") && j->req.n_stop == 1 ? json_string(j->req.stop[0]) : json_null(), "usage",
                     anth_usage(j, fin != NULL));
}

const char *anth_stop_reason(const struct job *j, const char *fin) { return stop_reason(j, fin); }

json_t *anth_error(const struct serve_error *e) {
    const char *t = e->type ? e->type : "api_error";
    if (!strcmp(t, "server_error")) t = "api_error";
    else if (!strcmp(t, "rate_limit_error")) t = "rate_limit_error";
    else if (e->status == 404) t = "not_found_error";
    char *clean = app_utf8_clean(e->msg);
    json_t *o = json_pack("{s:s, s:{s:s, s:s}}", "type", "error", "error", "type", t, "message", clean ? clean : "error");
    free(clean);
    return o;
}

int anth_count_tokens(struct server *srv, json_t *root, json_t **out, struct serve_error *e) {
    json_t *chat = NULL, *ignored = NULL;
    int32_t n = 0;
    int rc = anth_to_chat(root, &srv->lim, &chat, &ignored, e);
    json_decref(ignored); /* count_tokens' reply has no usage to list them in (they were logged) */
    if (rc) return -1;
    rc = compat_chat_tokens(srv, chat, &n, e);
    json_decref(chat);
    if (rc) return -1;
    return (*out = json_pack("{s:i}", "input_tokens", n)) ? 0 : serve_error_oom(e);
}

/* ---- the stream's content blocks ---- */

static void anth_close_block(struct stream *st) {
    if (st->u.anth.open < 0) return;
    sse_event(st, json_pack("{s:s, s:i}", "type", "content_block_stop", "index", st->u.anth.open));
    st->u.anth.open = -1;
}

/* Anthropic: text as a text_delta of the open text block (opened first if needed). */
static void anth_text(struct stream *st, const char *text) {
    if (st->u.anth.open < 0) {
        st->u.anth.open = st->u.anth.next++;
        sse_event(st, json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_start", "index", st->u.anth.open,
                                "content_block", "type", "text", "text", ""));
    }
    sse_event(st, json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_delta", "index", st->u.anth.open, "delta", "type",
                            "text_delta", "text", text));
}

/* Anthropic: a whole reply under tools, as its blocks (text, then each tool_use with its input
** as one input_json_delta). */
static void anth_whole(struct stream *st, const json_t *msg) {
    json_t *blocks = anth_blocks(msg);
    size_t i;
    json_t *b;
    json_array_foreach(blocks, i, b) {
        const char *type = json_string_value(json_object_get(b, "type"));
        if (!strcmp(type, "text")) {
            anth_text(st, json_string_value(json_object_get(b, "text")));
            continue;
        }
        anth_close_block(st);
        int idx = st->u.anth.next++;
        char *input = json_dumps(json_object_get(b, "input"), JSON_COMPACT);
        sse_event(st, json_pack("{s:s, s:i, s:{s:s, s:O, s:O, s:{}}}", "type", "content_block_start", "index", idx, "content_block",
                                "type", "tool_use", "id", json_object_get(b, "id"), "name", json_object_get(b, "name"), "input"));
        sse_event(st, json_pack("{s:s, s:i, s:{s:s, s:s}}", "type", "content_block_delta", "index", idx, "delta", "type",
                                "input_json_delta", "partial_json", input ? input : "{}"));
        free(input);
        sse_event(st, json_pack("{s:s, s:i}", "type", "content_block_stop", "index", idx));
    }
    json_decref(blocks);
}


/* ---------------------------------------------------------------------------------------- */
/* the module (api.h): parse, reply, the stream's events                                     */

static int parse(struct server *srv, json_t *root, struct job *j, struct serve_error *e) {
    json_t *chat = NULL;
    j->kind = JOB_CHAT;
    if (anth_to_chat(root, &srv->lim, &chat, &j->req.ignored, e)) return -1;
    return serve_request_parse_chat(srv, chat, j, e);
}

static json_t *reply(struct server *srv, struct job *j) {
    const char *fin = j->finish;
    json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
    json_t *r = anth_message(srv, j, msg, fin ? fin : "stop");
    json_decref(msg);
    return r;
}

static void s_start(struct stream *st) {
    st->u.anth.open = -1;
    pthread_mutex_lock(&st->srv->mu);
    json_t *m = anth_message(st->srv, st->j, NULL, NULL);
    pthread_mutex_unlock(&st->srv->mu);
    sse_event(st, json_pack("{s:s, s:o}", "type", "message_start", "message", m));
}

static void s_whole(struct stream *st, json_t *msg, const char **fin) {
    (void) fin;
    anth_whole(st, msg);
    json_decref(msg);
}

static void s_piece(struct stream *st, const char *piece, json_t *tm, json_t *lps) {
    (void) tm, (void) lps; /* Anthropic's events carry neither */
    if (*piece) anth_text(st, piece);
}

/* the last block closed, the stop reason, message_stop; or the error event */
static void s_end(struct stream *st, const char *fin) {
    const struct job *j = st->j;
    if (j->err.status && j->err.status != 200) {
        sse_event(st, anth_error(&j->err));
        return;
    }
    if (st->u.anth.next == 0) anth_text(st, "");
    anth_close_block(st);
    sse_event(st, json_pack("{s:s, s:{s:s, s:n}, s:o}", "type", "message_delta", "delta", "stop_reason", anth_stop_reason(j, fin),
                            "stop_sequence", "usage", anth_usage(j, true)));
    sse_event(st, json_pack("{s:s}", "type", "message_stop"));
}

const struct serve_api serve_api_anthropic = {
    .name = "anthropic",
    .parse = parse,
    .reply = reply,
    .error = anth_error,
    .s_start = s_start,
    .s_whole = s_whole,
    .s_piece = s_piece,
    .s_end = s_end,
};
