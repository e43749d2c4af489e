/* http.c — the HTTP side of `kvtier serve`: libmicrohttpd (one thread per connection),
** OpenAI-style request validation with jansson, JSON and server-sent-event responses, metrics.
** These threads never touch the engine: they queue jobs (server/sched.c) and wait on them. */
#include "serve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <poll.h>
#include <sys/socket.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct req {
    char  *body;
    size_t n, cap;
    bool   too_big;
};

static double mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Length of the longest prefix of s[0..n) made of complete, valid UTF-8 sequences. */
static size_t utf8_prefix(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *) s, *e = p + n, *b = p;
    while (p < e) {
        unsigned c = *p;
        int len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
        if (len == 0 || p + len > e) break;
        bool ok = true;
        for (int k = 1; ok && k < len; k++) ok = (p[k] & 0xC0) == 0x80;
        if (ok && len == 3) ok = !(c == 0xE0 && p[1] < 0xA0) && !(c == 0xED && p[1] >= 0xA0);
        if (ok && len == 4) ok = !(c == 0xF0 && p[1] < 0x90) && !(c == 0xF4 && p[1] >= 0x90);
        if (!ok) break;
        p += len;
    }
    return (size_t) (p - b);
}

/* ---------------------------------------------------------------------------------------- */
/* responses                                                                                */

static void count_status(struct server *srv, int status) {
    pthread_mutex_lock(&srv->mu);
    srv->m.requests++;
    if (status >= 100 && status < 600) srv->m.by_status[status / 100]++;
    pthread_mutex_unlock(&srv->mu);
}

static enum MHD_Result send_text(struct server *srv, struct MHD_Connection *c, int status, const char *ctype, char *text,
                                 const char *session_id) {
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) { free(text); return MHD_NO; }
    MHD_add_response_header(r, "Content-Type", ctype);
    if (session_id && *session_id) MHD_add_response_header(r, "X-Session-Id", session_id);
    count_status(srv, status);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned) status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_json(struct server *srv, struct MHD_Connection *c, int status, json_t *obj, const char *sid) {
    char *txt = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!txt) return MHD_NO;
    return send_text(srv, c, status, "application/json", txt, sid);
}

static json_t *error_obj(const char *msg, const char *type, const char *param, const char *code) {
    char *clean = app_utf8_clean(msg);
    json_t *o = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", clean ? clean : "error", "type", type, "param",
                          param ? json_string(param) : json_null(), "code", code && *code ? json_string(code) : json_null());
    free(clean);
    return o;
}

static enum MHD_Result send_error(struct server *srv, struct MHD_Connection *c, int status, const char *type,
                                  const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static enum MHD_Result send_error(struct server *srv, struct MHD_Connection *c, int status, const char *type,
                                  const char *param, const char *code, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return send_json(srv, c, status, error_obj(msg, type, param, code), NULL);
}

#define BAD(param, ...) send_error(srv, c, 400, "invalid_request_error", param, NULL, __VA_ARGS__)

/* ---------------------------------------------------------------------------------------- */
/* request validation                                                                       */

const char *serve_json_type(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE: case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* Fill the sampling / length / stop / stream fields shared by both endpoints.  On a bad field,
** writes a message into err (and the field's name into *param) and returns -1. */
static int parse_common(struct server *srv, json_t *root, struct job *j, char *err, size_t n_err, const char **param) {
    json_t *v;
    j->max_tokens = srv->max_tokens_default;
    j->smp = (struct kvt_sampling){ 1.0f, 1.0f, 0, 0, NULL };
    const char *len_keys[] = { "max_tokens", "max_completion_tokens" };
    for (int i = 0; i < 2; i++)
        if ((v = json_object_get(root, len_keys[i])) && !json_is_null(v)) {
            *param = len_keys[i];
            if (!json_is_integer(v)) { snprintf(err, n_err, "'%s' must be an integer, got %s", len_keys[i], serve_json_type(v)); return -1; }
            json_int_t x = json_integer_value(v);
            if (x < 1 || x > srv->n_ctx) { snprintf(err, n_err, "'%s' %lld is outside 1..%d", len_keys[i], (long long) x, srv->n_ctx); return -1; }
            j->max_tokens = (int32_t) x;
        }
    if ((v = json_object_get(root, "temperature")) && !json_is_null(v)) {
        *param = "temperature";
        if (!json_is_number(v)) { snprintf(err, n_err, "'temperature' must be a number, got %s", serve_json_type(v)); return -1; }
        double t = json_number_value(v);
        if (!(t >= 0 && t <= 2)) { snprintf(err, n_err, "'temperature' %g is outside 0..2", t); return -1; }
        j->smp.temperature = (float) t;
    }
    if ((v = json_object_get(root, "top_p")) && !json_is_null(v)) {
        *param = "top_p";
        if (!json_is_number(v)) { snprintf(err, n_err, "'top_p' must be a number, got %s", serve_json_type(v)); return -1; }
        double p = json_number_value(v);
        if (!(p > 0 && p <= 1)) { snprintf(err, n_err, "'top_p' %g is outside (0, 1]", p); return -1; }
        j->smp.top_p = (float) p;
    }
    if ((v = json_object_get(root, "seed")) && !json_is_null(v)) {
        *param = "seed";
        if (!json_is_integer(v)) { snprintf(err, n_err, "'seed' must be an integer, got %s", serve_json_type(v)); return -1; }
        j->smp.seed = (uint32_t) json_integer_value(v);
        j->seeded = true;
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        j->smp.seed = (uint32_t) (ts.tv_nsec ^ ts.tv_sec);
    }
    if ((v = json_object_get(root, "n")) && !json_is_null(v)) {
        *param = "n";
        if (!json_is_integer(v) || json_integer_value(v) != 1) { snprintf(err, n_err, "'n' must be 1 (one choice per request)"); return -1; }
    }
    if ((v = json_object_get(root, "stop")) && !json_is_null(v)) {
        *param = "stop";
        if (json_is_string(v)) {
            if (!(j->stop[j->n_stop++] = strdup(json_string_value(v)))) return -1;
        } else if (json_is_array(v)) {
            if (json_array_size(v) > SERVE_MAX_STOP) { snprintf(err, n_err, "'stop' has %zu strings; at most %d", json_array_size(v), SERVE_MAX_STOP); return -1; }
            size_t i;
            json_t *s;
            json_array_foreach(v, i, s) {
                if (!json_is_string(s)) { snprintf(err, n_err, "'stop[%zu]' must be a string, got %s", i, serve_json_type(s)); return -1; }
                if (!(j->stop[j->n_stop++] = strdup(json_string_value(s)))) return -1;
            }
        } else { snprintf(err, n_err, "'stop' must be a string or an array of strings, got %s", serve_json_type(v)); return -1; }
        for (int32_t i = 0; i < j->n_stop; i++)
            if (!j->stop[i][0]) { snprintf(err, n_err, "'stop' strings must not be empty"); return -1; }
    }
    if ((v = json_object_get(root, "stream")) && !json_is_null(v)) {
        *param = "stream";
        if (!json_is_boolean(v)) { snprintf(err, n_err, "'stream' must be a boolean, got %s", serve_json_type(v)); return -1; }
        j->stream = json_is_true(v);
    }
    if ((v = json_object_get(root, "stream_options")) && !json_is_null(v)) {
        *param = "stream_options";
        if (!json_is_object(v)) { snprintf(err, n_err, "'stream_options' must be an object, got %s", serve_json_type(v)); return -1; }
        json_t *u = json_object_get(v, "include_usage");
        if (u && !json_is_boolean(u)) { snprintf(err, n_err, "'stream_options.include_usage' must be a boolean, got %s", serve_json_type(u)); return -1; }
        j->include_usage = u && json_is_true(u);
    }
    if ((v = json_object_get(root, "model")) && !json_is_null(v) && !json_is_string(v)) {
        *param = "model";
        snprintf(err, n_err, "'model' must be a string, got %s", serve_json_type(v));
        return -1;
    }
    if ((v = json_object_get(root, "logprobs")) && json_is_true(v)) {
        *param = "logprobs";
        snprintf(err, n_err, "'logprobs' is not supported");
        return -1;
    }
    *param = NULL;
    return 0;
}

/* The text of messages[i].content: a string, or text parts joined; NULL (allowed only where
** *optional) when absent or null.  Returns -1 on a bad shape. */
static int content_text(const json_t *ct, size_t i, char **out, bool optional, char *err, size_t n_err) {
    *out = NULL;
    if ((!ct || json_is_null(ct)) && optional) return 0;
    if (ct && json_is_string(ct)) {
        *out = strdup(json_string_value(ct));
    } else if (ct && json_is_array(ct)) { /* content parts: text only, joined */
        size_t total = 1, k;
        json_t *part;
        json_array_foreach(ct, k, part) {
            json_t *ty = json_is_object(part) ? json_object_get(part, "type") : NULL, *tx = json_is_object(part) ? json_object_get(part, "text") : NULL;
            if (!ty || !json_is_string(ty) || strcmp(json_string_value(ty), "text") || !tx || !json_is_string(tx)) {
                snprintf(err, n_err, "'messages[%zu].content[%zu]' must be {\"type\": \"text\", \"text\": string}; other parts are not supported", i, k);
                return -1;
            }
            total += strlen(json_string_value(tx));
        }
        if ((*out = malloc(total))) {
            (*out)[0] = '\0';
            json_array_foreach(ct, k, part) strcat(*out, json_string_value(json_object_get(part, "text")));
        }
    } else {
        snprintf(err, n_err, "'messages[%zu].content' must be a string or an array of text parts, got %s", i, ct ? serve_json_type(ct) : "nothing");
        return -1;
    }
    if (!*out) { snprintf(err, n_err, "out of memory"); return -1; }
    return 0;
}

/* Append a message (role and content owned by the job from here on). */
static int push_msg(struct job *j, const char *role, char *content) {
    j->msgs[j->n_msgs].role = strdup(role);
    j->msgs[j->n_msgs].content = content;
    j->n_msgs++;
    return j->msgs[j->n_msgs - 1].role && content ? 0 : -1;
}

/* messages[] into owned (role, content) pairs; "developer" is a system message.  Tool calling
** (server/tools.c): an assistant message's tool_calls become the JSON text the model generates,
** and "tool" results become user messages (consecutive ones joined), naming the tool called by
** the matching tool_call_id.  sys_extra (the tools' description) is appended to the system
** message, or becomes one at the start. */
static int parse_messages(json_t *root, struct job *j, const char *sys_extra, char *err, size_t n_err, const char **param) {
    json_t *ms = json_object_get(root, "messages");
    *param = "messages";
    if (!ms) { snprintf(err, n_err, "'messages' is required"); return -1; }
    if (!json_is_array(ms)) { snprintf(err, n_err, "'messages' must be an array, got %s", serve_json_type(ms)); return -1; }
    size_t n = json_array_size(ms);
    if (n == 0) { snprintf(err, n_err, "'messages' must not be empty"); return -1; }
    if (!(j->msgs = calloc(n + 1, sizeof *j->msgs))) { snprintf(err, n_err, "out of memory"); return -1; }
    size_t i;
    json_t *m;
    bool last_tool = false;
    json_array_foreach(ms, i, m) {
        if (!json_is_object(m)) { snprintf(err, n_err, "'messages[%zu]' must be an object, got %s", i, serve_json_type(m)); return -1; }
        json_t *r = json_object_get(m, "role"), *ct = json_object_get(m, "content"), *calls = json_object_get(m, "tool_calls");
        if (!r || !json_is_string(r)) { snprintf(err, n_err, "'messages[%zu].role' must be a string", i); return -1; }
        const char *role = json_string_value(r);
        if (!strcmp(role, "developer")) role = "system";
        bool tool = !strcmp(role, "tool");
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") && !tool) {
            snprintf(err, n_err, "'messages[%zu].role' '%.40s' is not supported; expected system, developer, user, assistant or tool", i, role);
            return -1;
        }
        bool has_calls = calls && !json_is_null(calls) && !(json_is_array(calls) && json_array_size(calls) == 0);
        if (has_calls && strcmp(role, "assistant")) {
            snprintf(err, n_err, "'messages[%zu]' is a %s message with 'tool_calls'; only assistant messages make tool calls", i, role);
            return -1;
        }
        char *content = NULL;
        if (content_text(ct, i, &content, has_calls, err, n_err)) return -1;
        if (has_calls) { /* the call as generated; any text beside it is dropped (the model emits one JSON object) */
            free(content);
            if (!(content = tools_render_calls(calls, i, err, n_err))) return -1;
        }
        if (tool) {
            json_t *id = json_object_get(m, "tool_call_id"), *nm = json_object_get(m, "name");
            const char *name = nm && json_is_string(nm) ? json_string_value(nm) : NULL;
            if (!id || !json_is_string(id)) {
                free(content);
                snprintf(err, n_err, "'messages[%zu].tool_call_id' must be a string (the id of the call it answers)", i);
                return -1;
            }
            /* the tool's name: from the assistant message that made the call */
            for (size_t k = 0; !name && k < i; k++) {
                json_t *cs = json_object_get(json_array_get(ms, k), "tool_calls"), *c;
                size_t q;
                json_array_foreach(cs, q, c) {
                    json_t *cid = json_object_get(c, "id");
                    if (cid && json_is_string(cid) && !strcmp(json_string_value(cid), json_string_value(id))) {
                        json_t *fn = json_object_get(c, "function"), *fnm = fn ? json_object_get(fn, "name") : NULL;
                        if (fnm && json_is_string(fnm)) name = json_string_value(fnm);
                    }
                }
            }
            char *t = tools_render_result(name, content);
            free(content);
            if (!(content = t)) { snprintf(err, n_err, "out of memory"); return -1; }
            if (last_tool) { /* results of one turn's calls: one user message */
                struct kvt_chat_msg *prev = &j->msgs[j->n_msgs - 1];
                size_t np = strlen(prev->content), nc = strlen(content);
                char *joined = realloc((char *) prev->content, np + nc + 2);
                if (!joined) { free(content); snprintf(err, n_err, "out of memory"); return -1; }
                joined[np] = '\n';
                memcpy(joined + np + 1, content, nc + 1);
                prev->content = joined;
                free(content);
                continue;
            }
            role = "user";
        }
        last_tool = tool;
        if (push_msg(j, role, content)) { snprintf(err, n_err, "out of memory"); return -1; }
    }
    if (sys_extra) {
        if (!strcmp(j->msgs[0].role, "system")) {
            size_t a = strlen(j->msgs[0].content), b = strlen(sys_extra);
            char *c = realloc((char *) j->msgs[0].content, a + b + 3);
            if (!c) { snprintf(err, n_err, "out of memory"); return -1; }
            if (a) memcpy(c + a, "\n\n", 2), a += 2;
            memcpy(c + a, sys_extra, b + 1);
            j->msgs[0].content = c;
        } else {
            memmove(j->msgs + 1, j->msgs, sizeof *j->msgs * (size_t) j->n_msgs);
            j->msgs[0].role = strdup("system");
            j->msgs[0].content = strdup(sys_extra);
            j->n_msgs++;
            if (!j->msgs[0].role || !j->msgs[0].content) { snprintf(err, n_err, "out of memory"); return -1; }
        }
    }
    if (strcmp(j->msgs[j->n_msgs - 1].role, "user")) {
        snprintf(err, n_err, "the last message is '%s'; it must be a user or tool message", j->msgs[j->n_msgs - 1].role);
        return -1;
    }
    *param = NULL;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* replies                                                                                  */

static json_t *usage_obj(const struct job *j) {
    return json_pack("{s:i, s:i, s:i, s:{s:I, s:I, s:I, s:I, s:i, s:s}}", "prompt_tokens", j->prompt_tokens,
                     "completion_tokens", j->completion_tokens, "total_tokens", j->prompt_tokens + j->completion_tokens,
                     "kvtier", "prompt_tokens_reused", (json_int_t) j->sync.tokens_reused, "prompt_tokens_decoded",
                     (json_int_t) j->sync.tokens_decoded, "evictions", (json_int_t) j->sync.evictions, "recoveries",
                     (json_int_t) j->sync.recoveries, "resident_tokens", j->resident_tokens, "session_id", j->out_session);
}

static json_t *final_obj(struct server *srv, const struct job *j) {
    char id[64];
    snprintf(id, sizeof id, "%s-%llu", j->kind == JOB_CHAT ? "chatcmpl" : "cmpl", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    json_t *choice;
    if (j->kind == JOB_CHAT) {
        const char *fin = j->finish;
        json_t *msg = tools_reply(srv, j->text ? j->text : "", j->format, &fin);
        choice = json_pack("{s:i, s:o, s:s, s:n}", "index", 0, "message", msg, "finish_reason", fin, "logprobs");
    } else {
        char *text = app_utf8_clean(j->text ? j->text : "");
        choice = json_pack("{s:i, s:s, s:s, s:n}", "index", 0, "text", text ? text : "", "finish_reason", j->finish, "logprobs");
        free(text);
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o}", "id", id, "object",
                     j->kind == JOB_CHAT ? "chat.completion" : "text_completion", "created", (json_int_t) time(NULL),
                     "model", srv->model_name, "choices", choice, "usage", usage_obj(j));
}

/* Wait (under srv->mu) until the job satisfies cond. */
#define WAIT_UNTIL(cond)                                                                       \
    do {                                                                                       \
        while (!(cond)) pthread_cond_wait(&j->cv, &srv->mu);                                   \
    } while (0)

/* The client closed its end (a recv that peeks at end-of-file or fails)?  A client that sent more
** bytes (pipelining) is still there.  A client that only shut down its sending half after the
** request (legal, rare) looks the same and is taken as gone. */
static bool peer_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return false;
    struct pollfd p = { .fd = ci->connect_fd, .events = POLLIN };
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLHUP | POLLERR)) return true;
    char b;
    ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* Wait (under srv->mu) for a non-streamed job to finish, checking every 100 ms that the client
** is still connected: one that went away cancels the job at its next token (as a dropped stream
** does), so its slot is not held to max_tokens for nobody. */
static void wait_watching(struct server *srv, struct MHD_Connection *c, struct job *j) {
    while (j->state != JOB_DONE) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&j->cv, &srv->mu, &ts);
        if (j->state != JOB_DONE && !j->cancelled && peer_gone(c)) j->cancelled = true;
    }
}

struct stream {
    struct server *srv;
    struct MHD_Connection *c; /* to notice a client that leaves while nothing is sent */
    struct job    *j;
    char           id[64];
    int            phase;   /* 0 role chunk, 1 content, 2 done */
    char          *out;     /* pending bytes */
    size_t         n_out, off;
};

static void stream_emit(struct stream *st, json_t *obj) {
    char *txt = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!txt) return;
    size_t n = strlen(txt);
    char *o = realloc(st->out, st->n_out + n + 9);
    if (o) {
        st->out = o;
        memcpy(o + st->n_out, "data: ", 6);
        memcpy(o + st->n_out + 6, txt, n);
        memcpy(o + st->n_out + 6 + n, "\n\n", 3);
        st->n_out += n + 8;
    }
    free(txt);
}

/* delta: the chat delta to send as is (stolen), else built from role/content. */
static json_t *chunk_delta(struct stream *st, json_t *delta, const char *content, const char *finish, bool role) {
    const struct job *j = st->j;
    json_t *choice;
    if (j->kind == JOB_CHAT) {
        if (!delta) {
            delta = json_object();
            if (role) json_object_set_new(delta, "role", json_string("assistant"));
            if (content) json_object_set_new(delta, "content", json_string(content));
        }
        choice = json_pack("{s:i, s:o, s:o, s:n}", "index", 0, "delta", delta, "finish_reason",
                           finish ? json_string(finish) : json_null(), "logprobs");
    } else {
        choice = json_pack("{s:i, s:s, s:o, s:n}", "index", 0, "text", content ? content : "", "finish_reason",
                           finish ? json_string(finish) : json_null(), "logprobs");
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", st->id, "object",
                     j->kind == JOB_CHAT ? "chat.completion.chunk" : "text_completion", "created", (json_int_t) time(NULL),
                     "model", st->srv->model_name, "choices", choice);
}

static json_t *chunk(struct stream *st, const char *content, const char *finish, bool role) {
    return chunk_delta(st, NULL, content, finish, role);
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    struct stream *st = cls;
    struct server *srv = st->srv;
    struct job *j = st->j;
    (void) pos;
    while (st->off == st->n_out) {
        st->off = st->n_out = 0;
        if (st->phase == 3) return MHD_CONTENT_READER_END_OF_STREAM;
        if (st->phase == 0) {
            st->phase = 1;
            if (j->kind == JOB_CHAT) { stream_emit(st, chunk(st, NULL, NULL, true)); continue; }
        }
        /* a tool-call reply is one JSON object: parsed and sent whole when it is complete */
        bool whole = j->kind == JOB_CHAT && j->format == REPLY_TOOLS;
        pthread_mutex_lock(&srv->mu);
        if (whole) wait_watching(srv, st->c, j); /* nothing is written meanwhile: watch the socket */
        else WAIT_UNTIL(j->state == JOB_DONE || j->n_text > j->n_sent);
        bool done = j->state == JOB_DONE;
        const char *fin = j->finish;
        if (whole) {
            pthread_mutex_unlock(&srv->mu);
            if (!(j->http_status && j->http_status != 200)) {
                json_t *msg = tools_reply(srv, j->text ? j->text : "", j->format, &fin);
                if (msg) {
                    json_object_del(msg, "role");
                    if (json_is_null(json_object_get(msg, "content"))) json_object_del(msg, "content");
                    stream_emit(st, chunk_delta(st, msg, NULL, NULL, false));
                }
            }
            pthread_mutex_lock(&srv->mu);
            j->n_sent = j->text ? strlen(j->text) : 0;
        }
        size_t upto = done ? (j->text ? strlen(j->text) : 0) : j->n_text;
        size_t ok = upto > j->n_sent ? utf8_prefix(j->text + j->n_sent, upto - j->n_sent) : 0;
        char *piece = NULL;
        if (done && upto > j->n_sent) { /* the rest, bad bytes replaced */
            char *rest = strndup(j->text + j->n_sent, upto - j->n_sent);
            piece = rest ? app_utf8_clean(rest) : NULL;
            free(rest);
            j->n_sent = upto;
        } else if (ok > 0) {
            piece = strndup(j->text + j->n_sent, ok);
            j->n_sent += ok;
        }
        pthread_mutex_unlock(&srv->mu);
        if (piece && *piece) stream_emit(st, chunk(st, piece, NULL, false));
        free(piece);
        if (!done) {
            if (st->n_out == 0) { /* an incomplete UTF-8 character: wait for more */
                pthread_mutex_lock(&srv->mu);
                size_t seen = j->n_text;
                WAIT_UNTIL(j->state == JOB_DONE || j->n_text != seen);
                pthread_mutex_unlock(&srv->mu);
            }
            continue;
        }
        if (j->http_status && j->http_status != 200) {
            stream_emit(st, error_obj(j->err_msg, j->err_type, NULL, j->err_code));
        } else {
            stream_emit(st, chunk(st, NULL, fin, false));
            if (j->include_usage) {
                json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", st->id, "object",
                                      j->kind == JOB_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                                      (json_int_t) time(NULL), "model", srv->model_name, "choices", "usage", usage_obj(j));
                stream_emit(st, u);
            }
        }
        char *o = realloc(st->out, st->n_out + 15);
        if (o) {
            st->out = o;
            memcpy(o + st->n_out, "data: [DONE]\n\n", 15);
            st->n_out += 14;
        }
        st->phase = 3;
    }
    size_t n = KVT_MIN(max, st->n_out - st->off);
    memcpy(buf, st->out + st->off, n);
    st->off += n;
    return (ssize_t) n;
}

/* The connection is gone (or the stream ended): a job still running is cancelled at once. */
static void stream_free(void *cls) {
    struct stream *st = cls;
    pthread_mutex_lock(&st->srv->mu);
    if (st->j->state != JOB_DONE) st->j->cancelled = true;
    pthread_mutex_unlock(&st->srv->mu);
    serve_job_release(st->srv, st->j);
    free(st->out);
    free(st);
}

static enum MHD_Result run_job(struct server *srv, struct MHD_Connection *c, struct job *j) {
    j->t_arrival = mono_ms();
    pthread_cond_init(&j->cv, NULL);
    int q = serve_submit(srv, j);
    if (q) {
        serve_job_free(j);
        if (q == 429)
            return send_error(srv, c, 429, "rate_limit_error", NULL, "queue_full", "the request queue is full (%d waiting); retry later", srv->max_queue);
        return send_error(srv, c, 503, "server_error", NULL, NULL, "the server is shutting down");
    }
    pthread_mutex_lock(&srv->mu);
    if (j->stream) WAIT_UNTIL(j->state == JOB_DONE || j->started); /* prompt accepted: headers can go */
    else wait_watching(srv, c, j);
    bool failed = j->state == JOB_DONE && j->http_status && j->http_status != 200;
    pthread_mutex_unlock(&srv->mu);
    if (failed) {
        enum MHD_Result r = send_json(srv, c, j->http_status, error_obj(j->err_msg, j->err_type, NULL, j->err_code), NULL);
        serve_job_release(srv, j);
        return r;
    }
    if (!j->stream) {
        enum MHD_Result r = send_json(srv, c, 200, final_obj(srv, j), j->out_session);
        serve_job_release(srv, j);
        return r;
    }
    struct stream *st = calloc(1, sizeof *st);
    if (!st) { serve_job_release(srv, j); return MHD_NO; }
    st->srv = srv;
    st->c = c;
    st->j = j;
    snprintf(st->id, sizeof st->id, "%s-%llu", j->kind == JOB_CHAT ? "chatcmpl" : "cmpl", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, st, stream_free);
    if (!r) { stream_free(st); return MHD_NO; }
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    pthread_mutex_lock(&srv->mu);
    if (j->out_session[0]) MHD_add_response_header(r, "X-Session-Id", j->out_session);
    pthread_mutex_unlock(&srv->mu);
    count_status(srv, 200);
    enum MHD_Result ret = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    return ret;
}

/* ---------------------------------------------------------------------------------------- */
/* endpoints                                                                                */

static enum MHD_Result post_generate(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *ns, bool chat) {
    if (rq->too_big)
        return send_error(srv, c, 413, "invalid_request_error", NULL, "request_too_large", "the request body is over the limit of %d bytes", SERVE_MAX_BODY);
    size_t ok = utf8_prefix(rq->body ? rq->body : "", rq->n);
    if (ok < rq->n) return BAD(NULL, "the request body is not valid UTF-8 (byte %zu)", ok);
    json_error_t e;
    json_t *root = json_loadb(rq->body ? rq->body : "", rq->n, 0, &e);
    if (!root) return BAD(NULL, "the request body is not valid JSON: %s (line %d, column %d)", e.text, e.line, e.column);
    if (!json_is_object(root)) {
        enum MHD_Result r = BAD(NULL, "the request body must be a JSON object, got %s", serve_json_type(root));
        json_decref(root);
        return r;
    }
    struct job *j = calloc(1, sizeof *j);
    if (!j) { json_decref(root); return MHD_NO; }
    j->kind = chat ? JOB_CHAT : JOB_COMPLETION;
    snprintf(j->ns, sizeof j->ns, "%s", ns);
    const char *sid = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Session-Id");
    if (sid) snprintf(j->session_id, sizeof j->session_id, "%s", sid);
    char err[1024] = "";
    const char *param = NULL;
    int rc = parse_common(srv, root, j, err, sizeof err, &param);
    char *sys_extra = NULL;
    if (rc == 0 && chat) rc = tools_parse(root, j, &sys_extra, err, sizeof err, &param);
    if (rc == 0 && chat) rc = parse_messages(root, j, sys_extra, err, sizeof err, &param);
    free(sys_extra);
    if (rc == 0 && !chat) {
        const char *chat_only[] = { "tools", "tool_choice", "functions", "function_call", "response_format" };
        for (int i = 0; rc == 0 && i < 5; i++) {
            json_t *v = json_object_get(root, chat_only[i]);
            if (v && !json_is_null(v)) {
                param = chat_only[i];
                snprintf(err, sizeof err, "'%s' is not supported on /v1/completions; use /v1/chat/completions", chat_only[i]);
                rc = -1;
            }
        }
    }
    if (rc == 0 && !chat) {
        json_t *p = json_object_get(root, "prompt");
        param = "prompt";
        if (p && json_is_array(p) && json_array_size(p) == 1) p = json_array_get(p, 0);
        if (!p || !json_is_string(p)) { snprintf(err, sizeof err, "'prompt' must be a string"); rc = -1; }
        else if (!(j->prompt = strdup(json_string_value(p)))) rc = -1;
    }
    json_decref(root);
    if (rc) {
        pthread_cond_init(&j->cv, NULL);
        serve_job_free(j);
        return BAD(param, "%s", err[0] ? err : "out of memory");
    }
    return run_job(srv, c, j);
}

static enum MHD_Result get_sessions(struct server *srv, struct MHD_Connection *c, const char *ns) {
    json_t *data = json_array();
    pthread_mutex_lock(&srv->mu);
    for (int32_t i = 0; i < srv->n_views; i++) {
        const struct sess_view *v = &srv->views[i];
        if (strcmp(v->ns, ns)) continue;
        json_array_append_new(data, json_pack("{s:s, s:s, s:i, s:i, s:i, s:I, s:I, s:I, s:b, s:b}", "id", v->id, "object", "session",
                                              "messages", v->n_messages, "total_tokens", v->total_tokens, "resident_tokens",
                                              v->resident_tokens, "evictions", (json_int_t) v->evictions, "recoveries",
                                              (json_int_t) v->recoveries, "last_used", (json_int_t) v->last_used, "busy", v->busy,
                                              "parked", v->parked));
    }
    pthread_mutex_unlock(&srv->mu);
    return send_json(srv, c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data), NULL);
}

static enum MHD_Result delete_session(struct server *srv, struct MHD_Connection *c, const char *ns, const char *id) {
    struct job *j = calloc(1, sizeof *j);
    if (!j) return MHD_NO;
    j->kind = JOB_DELETE;
    snprintf(j->ns, sizeof j->ns, "%s", ns);
    snprintf(j->session_id, sizeof j->session_id, "%s", id);
    j->t_arrival = mono_ms();
    pthread_cond_init(&j->cv, NULL);
    if (serve_submit(srv, j)) {
        serve_job_free(j);
        return send_error(srv, c, 503, "server_error", NULL, NULL, "the server is shutting down");
    }
    pthread_mutex_lock(&srv->mu);
    WAIT_UNTIL(j->state == JOB_DONE);
    pthread_mutex_unlock(&srv->mu);
    enum MHD_Result r;
    if (j->http_status) r = send_json(srv, c, j->http_status, error_obj(j->err_msg, j->err_type, NULL, j->err_code), NULL);
    else r = send_json(srv, c, 200, json_pack("{s:s, s:s, s:b}", "id", id, "object", "session", "deleted", 1), NULL);
    serve_job_release(srv, j);
    return r;
}

static void hist_text(FILE *f, const char *name, const char *help, const struct hist *h) {
    fprintf(f, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    int64_t cum = 0;
    for (int i = 0; i < HIST_N; i++) {
        cum += h->bucket[i];
        fprintf(f, "%s_bucket{le=\"%g\"} %lld\n", name, serve_hist_bounds[i] / 1e3, (long long) cum);
    }
    cum += h->bucket[HIST_N];
    fprintf(f, "%s_bucket{le=\"+Inf\"} %lld\n%s_sum %.6f\n%s_count %lld\n", name, (long long) cum, name, h->sum / 1e3, name,
            (long long) h->count);
}

static enum MHD_Result get_metrics(struct server *srv, struct MHD_Connection *c) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return MHD_NO;
    pthread_mutex_lock(&srv->mu);
    struct metrics m = srv->m;
    pthread_mutex_unlock(&srv->mu);
    fprintf(f, "# HELP kvtier_requests_total HTTP responses by status class.\n# TYPE kvtier_requests_total counter\n");
    for (int i = 1; i < 6; i++) fprintf(f, "kvtier_requests_total{status=\"%dxx\"} %lld\n", i, (long long) m.by_status[i]);
#define COUNTER(name, help, v) fprintf(f, "# HELP " name " " help "\n# TYPE " name " counter\n" name " %lld\n", (long long) (v))
#define GAUGE(name, help, v) fprintf(f, "# HELP " name " " help "\n# TYPE " name " gauge\n" name " %lld\n", (long long) (v))
    COUNTER("kvtier_prompt_tokens_total", "Prompt tokens of finished requests.", m.prompt_tokens);
    COUNTER("kvtier_generated_tokens_total", "Generated tokens.", m.completion_tokens);
    COUNTER("kvtier_prompt_tokens_reused_total", "Prompt tokens found in a session's cache.", m.prompt_reused);
    COUNTER("kvtier_prompt_tokens_decoded_total", "Prompt tokens run through the model.", m.prompt_decoded);
    COUNTER("kvtier_evictions_total", "KV block evictions.", m.evictions);
    COUNTER("kvtier_recoveries_total", "KV block recoveries (kv_restore loads).", m.recoveries);
    GAUGE("kvtier_resident_tokens", "KV cells held by all sessions.", m.resident_tokens);
    GAUGE("kvtier_sessions", "Open sessions (resident and parked).", m.n_sessions);
    GAUGE("kvtier_sessions_parked", "Sessions parked whole in the host tiers.", m.n_parked);
    GAUGE("kvtier_queue_length", "Requests waiting for a slot.", m.queue_len);
    GAUGE("kvtier_active_requests", "Requests being served.", m.active);
    GAUGE("kvtier_pool_ram_bytes", "Evicted KV bytes in the host RAM tier.", m.pool_ram);
    GAUGE("kvtier_pool_spill_bytes", "Evicted KV bytes in spill files.", m.pool_spill);
    hist_text(f, "kvtier_ttft_seconds", "Time to first token.", &m.ttft);
    hist_text(f, "kvtier_token_latency_seconds", "Time between generated tokens.", &m.per_token);
    fclose(f);
    return send_text(srv, c, 200, "text/plain; version=0.0.4", buf, NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* dispatch                                                                                 */

/* a == b in time that depends only on the lengths (keys are not leaked by timing) */
static bool same_secret(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    unsigned char d = na != nb;
    for (size_t i = 0; i < na; i++) d |= (unsigned char) (a[i] ^ b[i % (nb ? nb : 1)]);
    return d == 0;
}

/* The caller's namespace: "" without keys; "key<i>" for the i-th key; NULL if unauthorised. */
static const char *auth(struct server *srv, struct MHD_Connection *c, char *ns, size_t n) {
    if (!srv->keys) { ns[0] = '\0'; return ns; }
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!h || strncmp(h, "Bearer ", 7)) return NULL;
    for (int32_t i = 0; i < srv->n_keys; i++)
        if (same_secret(h + 7, srv->keys[i])) { snprintf(ns, n, "key%d", i); return ns; }
    return NULL;
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url, const char *method, const char *version,
                               const char *upload, size_t *upload_size, void **con_cls) {
    struct server *srv = cls;
    (void) version;
    struct req *rq = *con_cls;
    if (!rq) {
        if (!(rq = calloc(1, sizeof *rq))) return MHD_NO;
        *con_cls = rq;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!rq->too_big && rq->n + *upload_size > SERVE_MAX_BODY) {
            rq->too_big = true;
            free(rq->body);
            rq->body = NULL;
            rq->n = rq->cap = 0;
        }
        if (!rq->too_big) {
            if (rq->n + *upload_size + 1 > rq->cap) {
                size_t cap = KVT_MAX(rq->cap * 2, rq->n + *upload_size + 1);
                char *b = realloc(rq->body, cap);
                if (!b) return MHD_NO;
                rq->body = b;
                rq->cap = cap;
            }
            memcpy(rq->body + rq->n, upload, *upload_size);
            rq->n += *upload_size;
            rq->body[rq->n] = '\0';
        }
        *upload_size = 0;
        return MHD_YES;
    }
    bool get = !strcmp(method, "GET"), post = !strcmp(method, "POST"), del = !strcmp(method, "DELETE");
    if (get && !strcmp(url, "/health")) {
        pthread_mutex_lock(&srv->mu);
        bool stopping = srv->stopping;
        pthread_mutex_unlock(&srv->mu);
        return send_json(srv, c, stopping ? 503 : 200, json_pack("{s:s}", "status", stopping ? "shutting down" : "ok"), NULL);
    }
    if (get && !strcmp(url, "/metrics")) return get_metrics(srv, c);
    char ns[32];
    if (!auth(srv, c, ns, sizeof ns))
        return send_error(srv, c, 401, "invalid_request_error", NULL, "invalid_api_key",
                          "missing or incorrect API key (send Authorization: Bearer KEY)");
    if (!strcmp(url, "/v1/chat/completions") || !strcmp(url, "/v1/completions")) {
        if (!post) return send_error(srv, c, 405, "invalid_request_error", NULL, NULL, "%s %s: use POST", method, url);
        return post_generate(srv, c, rq, ns, url[4] == 'c' && url[5] == 'h');
    }
    if (!strcmp(url, "/v1/models")) {
        if (!get) return send_error(srv, c, 405, "invalid_request_error", NULL, NULL, "%s %s: use GET", method, url);
        return send_json(srv, c, 200,
                         json_pack("{s:s, s:[{s:s, s:s, s:I, s:s}]}", "object", "list", "data", "id", srv->model_name, "object",
                                   "model", "created", (json_int_t) time(NULL), "owned_by", "kvtier"),
                         NULL);
    }
    if (!strcmp(url, "/v1/sessions")) {
        if (!get) return send_error(srv, c, 405, "invalid_request_error", NULL, NULL, "%s %s: use GET", method, url);
        return get_sessions(srv, c, ns);
    }
    if (!strncmp(url, "/v1/sessions/", 13) && url[13]) {
        if (!del) return send_error(srv, c, 405, "invalid_request_error", NULL, NULL, "%s %s: use DELETE", method, url);
        return delete_session(srv, c, ns, url + 13);
    }
    return send_error(srv, c, 404, "invalid_request_error", NULL, "not_found", "no endpoint %s %s", method, url);
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void) cls;
    (void) c;
    (void) toe;
    struct req *rq = *con_cls;
    if (rq) {
        free(rq->body);
        free(rq);
    }
    *con_cls = NULL;
}

struct MHD_Daemon *serve_http_start(struct server *srv, const char *host, int32_t port, int32_t *bound_port) {
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t) port);
    if (!strcmp(host, "localhost")) host = "127.0.0.1";
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        fprintf(stderr, "kvtier serve: --host '%s' is not an IPv4 address\n", host);
        return NULL;
    }
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_ERROR_LOG,
        (uint16_t) port, NULL, NULL, handler, srv, MHD_OPTION_SOCK_ADDR, (struct sockaddr *) &sa,
        MHD_OPTION_NOTIFY_COMPLETED, completed, NULL, MHD_OPTION_CONNECTION_LIMIT, (unsigned) 256,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned) 600, MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "kvtier serve: cannot listen on %s:%d (in use, or not allowed)\n", host, port);
        return NULL;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    *bound_port = info ? info->port : port;
    return d;
}
