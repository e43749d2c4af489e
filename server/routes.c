/* routes.c — the route table, the one place that says what `kvtier serve` answers: the router,
** the header-time checks (server/http.c), --help and docs/API.md read it.  A generation route
** names its API module (api.h); the other handlers are here: the tokenizer routes, sessions,
** stored responses, /models, /props, /slots, /metrics. */
#include "api.h"
#include "fields.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The text routes (/tokenize, /detokenize, /apply-template, the token counts) are answered on
** the connection's thread, outside the queue: at most TEXT_WORKERS of them work at once (each may
** hold a reply of a few bytes per token of a --max-body-mb body), the others wait for a turn,
** at most TEXT_WAIT_S, then get a 503.  Six concurrent /tokenize with_pieces of 3.5M tokens once
** grew the server by 10.9 GB (issue #38). */
enum { TEXT_WORKERS = 2, TEXT_WAIT_S = 30 };
static pthread_mutex_t text_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t text_cv = PTHREAD_COND_INITIALIZER;
static int text_busy;

static int text_work_begin(struct server *srv, struct serve_error *e) {
    (void) srv;
    const struct timespec until = serve_realtime_in_ms(TEXT_WAIT_S * 1000L);
    pthread_mutex_lock(&text_mu);
    int w = 0;
    while (text_busy >= TEXT_WORKERS && w == 0) w = pthread_cond_timedwait(&text_cv, &text_mu, &until);
    const bool ok = text_busy < TEXT_WORKERS;
    if (ok) text_busy++;
    pthread_mutex_unlock(&text_mu);
    if (ok) return 0;
    return serve_error_set(e, 503, "server_error", "server_busy",
                           "%d tokenizer requests are being answered and others waited %d s for a turn; retry later", TEXT_WORKERS,
                           TEXT_WAIT_S);
}

static void text_work_end(struct server *srv) {
    (void) srv;
    pthread_mutex_lock(&text_mu);
    text_busy--;
    pthread_cond_signal(&text_cv);
    pthread_mutex_unlock(&text_mu);
}

/* POST /tokenize, /detokenize, /apply-template: answered here (server/compat.c), no job. */
static enum MHD_Result post_text(struct server *srv, struct MHD_Connection *c, struct req *rq,
                                 int (*fn)(struct server *, json_t *, json_t **, struct serve_error *)) {
    json_t *root, *out = NULL;
    enum MHD_Result bad = serve_body_json(srv, c, rq, &root);
    if (!root) return bad;
    struct serve_error e = { 0 };
    int rc = -1;
    if (!text_work_begin(srv, &e)) {
        rc = fn(srv, root, &out, &e);
        text_work_end(srv);
    }
    json_decref(root);
    if (rc) {
        if (!e.status) serve_error_oom(&e);
        return serve_send_err(srv, c, &e, NULL);
    }
    return serve_send_json(srv, c, 200, out, NULL);
}

/* POST /tokenize: its reply is written as text (server/compat.c), not built as JSON objects. */
static enum MHD_Result post_tokenize(struct server *srv, struct MHD_Connection *c, struct req *rq) {
    json_t *root;
    enum MHD_Result bad = serve_body_json(srv, c, rq, &root);
    if (!root) return bad;
    struct serve_error e = { 0 };
    char *out = NULL;
    int rc = -1;
    if (!text_work_begin(srv, &e)) {
        rc = compat_tokenize(srv, root, &out, &e);
        text_work_end(srv);
    }
    json_decref(root);
    if (rc) {
        if (!e.status) serve_error_oom(&e);
        return serve_send_err(srv, c, &e, NULL);
    }
    return serve_send_text(srv, c, 200, "application/json", out, NULL);
}
/* POST /chat/completions/input_tokens (llama-server's): the template's tokens of a chat request. */
static int do_input_tokens(struct server *srv, json_t *root, json_t **out, struct serve_error *e) {
    int32_t n = 0;
    if (compat_chat_tokens(srv, root, &n, e)) return -1;
    return (*out = json_pack("{s:i}", "input_tokens", n)) ? 0 : serve_error_oom(e);
}

static int do_detokenize(struct server *srv, json_t *root, json_t **out, struct serve_error *e) {
    return compat_detokenize(srv, root, out, e);
}

static enum MHD_Result get_sessions(struct server *srv, struct MHD_Connection *c, const char *ns) {
    json_t *data = json_array();
    pthread_mutex_lock(&srv->mu);
    for (int32_t i = 0; i < srv->n_views; i++) {
        const struct sess_view *v = &srv->views[i];
        if (strcmp(v->ns, ns)) continue;
        json_array_append_new(data, json_pack("{s:s, s:s, s:i, s:i, s:i, s:I, s:I, s:I, s:b, s:b}", "id", v->id, "object",
                                              "session", "messages", v->n_messages, "total_tokens", v->total_tokens,
                                              "resident_tokens", v->resident_tokens, "evictions", (json_int_t) v->evictions,
                                              "recoveries", (json_int_t) v->recoveries, "last_used", (json_int_t) v->last_used,
                                              "busy", v->busy, "parked", v->parked));
    }
    pthread_mutex_unlock(&srv->mu);
    return serve_send_json(srv, c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data), NULL);
}

/* A JOB_DELETE for session id of namespace ns (erase: POST /slots/N?action=erase's), run on the
** engine thread between steps; answers its error, or 200 with reply(j).  */
static enum MHD_Result run_delete(struct server *srv, struct MHD_Connection *c, const char *ns, const char *id, bool erase,
                                  json_t *(*reply)(const struct job *j)) {
    struct job *j = calloc(1, sizeof *j);
    if (!j) return MHD_NO;
    j->kind = JOB_DELETE;
    j->erase_slot = erase;
    snprintf(j->req.ns, sizeof j->req.ns, "%s", ns);
    snprintf(j->req.session_id, sizeof j->req.session_id, "%s", id);
    j->req.t_arrival = serve_mono_ms();
    pthread_cond_init(&j->cv, NULL);
    if (serve_submit(srv, j)) {
        serve_job_free(j);
        return serve_send_error(srv, c, 503, "server_error", NULL, "the server is shutting down");
    }
    pthread_mutex_lock(&srv->mu);
    WAIT_UNTIL(j->state == JOB_DONE);
    pthread_mutex_unlock(&srv->mu);
    enum MHD_Result r;
    if (j->err.status) r = serve_send_err(srv, c, &j->err, NULL);
    else r = serve_send_json(srv, c, 200, reply(j), NULL);
    serve_job_release(srv, j);
    return r;
}
static json_t *deleted_reply(const struct job *j) {
    return json_pack("{s:s, s:s, s:b}", "id", j->req.session_id, "object", "session", "deleted", 1);
}
static json_t *erased_reply(const struct job *j) {
    return json_pack("{s:i, s:I}", "id_slot", atoi(j->req.session_id + 5 /* "slot-" */), "n_erased", (json_int_t) j->n_erased);
}
static enum MHD_Result delete_session(struct server *srv, struct MHD_Connection *c, const char *ns, const char *id) {
    return run_delete(srv, c, ns, id, false, deleted_reply);
}

static time_t t_started; /* when the server started listening (/metrics' Process-Start-Time-Unix) */
void serve_routes_started(void) { t_started = time(NULL); }

static enum MHD_Result get_metrics(struct server *srv, struct MHD_Connection *c) {
    char *text = serve_metrics_text(srv);
    if (!text) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    char ts[32];
    snprintf(ts, sizeof ts, "%lld", (long long) t_started);
    MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4");
    MHD_add_response_header(r, "Process-Start-Time-Unix", ts); /* llama-server's */
    serve_add_cors(srv, c, r);
    serve_count_status(srv, 200);
    return serve_queue_reply(c, 200, r);
}

/* ---------------------------------------------------------------------------------------- */
/* The routes: one table, the one place that says what the server answers (dispatch, the       */
/* header-time checks, --help and docs/API.md read it).                                        */

/* A route's handler: rest is what follows the route's path ("ID" of "/responses/ID"), or "". */
typedef enum MHD_Result (*route_fn)(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest);

enum { M_GET = 1, M_POST = 2, M_DELETE = 4, M_ANY = 7 };
enum { AT_V1 = 1, AT_ROOT = 2, AT_BOTH = 3 }; /* answered under /v1, without it (llama-server's), or both */

struct route {
    const char *path; /* without /v1; "/responses/" with has_id: "/responses/ID" */
    unsigned at, methods;
    bool has_id;                 /* the path is a prefix followed by an id */
    bool open;                   /* answered without an API key (/metrics: with --metrics-public) */
    route_fn fn;                 /* the handler, or NULL: a generation route of api */
    const struct serve_api *api; /* a generation route: the API module that parses and answers (api.h) */
    const char *what;            /* --help and docs/API.md */
};

static enum MHD_Result r_health(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rq, (void) rest;
    pthread_mutex_lock(&srv->mu);
    bool stopping = srv->stopping;
    pthread_mutex_unlock(&srv->mu);
    return serve_send_json(srv, c, stopping ? 503 : 200, json_pack("{s:s}", "status", stopping ? "shutting down" : "ok"), NULL);
}
static enum MHD_Result r_metrics(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    if (!rq->authorized && !srv->lim.metrics_public) return serve_send_unauthorized(srv, c);
    if (srv->no_metrics)
        return serve_send_error(srv, c, 501, "not_supported_error", NULL, "this server runs with --no-metrics: no /metrics");
    return get_metrics(srv, c);
}
static enum MHD_Result r_input_tokens(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, do_input_tokens);
}
static enum MHD_Result r_response_id(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *id) {
    if (rq->get) {
        json_t *o = resp_get(srv, rq->ns, id);
        if (!o) return serve_send_error(srv, c, 404, "invalid_request_error", "not_found", "no stored response '%.60s'", id);
        return serve_send_json(srv, c, 200, o, NULL);
    }
    if (!resp_delete(rq->ns, id))
        return serve_send_error(srv, c, 404, "invalid_request_error", "not_found", "no stored response '%.60s'", id);
    return serve_send_json(srv, c, 200, json_pack("{s:s, s:s, s:b}", "id", id, "object", "response.deleted", "deleted", 1), NULL);
}
static enum MHD_Result r_count_tokens(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, anth_count_tokens);
}
static enum MHD_Result r_tokenize(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_tokenize(srv, c, rq);
}
static enum MHD_Result r_detokenize(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, do_detokenize);
}
static enum MHD_Result r_template(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return post_text(srv, c, rq, compat_apply_template);
}
static enum MHD_Result r_models(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rq, (void) rest;
    return serve_send_json(srv, c, 200, compat_models(srv), NULL);
}
static enum MHD_Result r_props(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rq, (void) rest;
    return serve_send_json(srv, c, 200, compat_props(srv), NULL);
}
static enum MHD_Result r_slots(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    if (srv->no_slots)
        return serve_send_error(srv, c, 501, "not_supported_error", NULL, "this server runs with --no-slots: no /slots");
    return serve_send_json(srv, c, 200, compat_slots(srv, rq->ns), NULL);
}
/* POST /slots/ID?action=erase (save, restore: 501): llama-server's slot actions (compat.c).  Slot N
** is the caller's session "slot-N", the one a chat with id_slot N runs in. */
static enum MHD_Result r_slot_action(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    if (srv->no_slots)
        return serve_send_error(srv, c, 501, "not_supported_error", NULL, "this server runs with --no-slots: no /slots");
    json_t *root = NULL;
    if (rq->n > 0 || rq->too_big) { /* llama-server's clients send none, or {} */
        enum MHD_Result bad = serve_body_json(srv, c, rq, &root);
        if (!root) return bad;
    }
    struct serve_error e = { 0 };
    int32_t slot;
    const int rc = compat_slot_action(srv, rest, MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "action"), root, &slot, &e);
    json_decref(root);
    if (rc) return serve_send_err(srv, c, &e, NULL);
    char id[32];
    snprintf(id, sizeof id, "slot-%d", slot);
    return run_delete(srv, c, rq->ns, id, true, erased_reply);
}
static enum MHD_Result r_not_served(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return serve_send_error(srv, c, 501, "not_supported_error", NULL,
                            "%s: kvtier serves chat and text completions only (no embeddings, reranking or infill)", rq->url_now);
}
static enum MHD_Result r_sessions(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *rest) {
    (void) rest;
    return get_sessions(srv, c, rq->ns);
}
static enum MHD_Result r_session_id(struct server *srv, struct MHD_Connection *c, struct req *rq, const char *id) {
    return delete_session(srv, c, rq->ns, id);
}

/* clang-format off */
static const struct route ROUTES[] = {
    { "/health",                         AT_BOTH,  M_GET,             false,  true,   r_health,        NULL,                   "200 {\"status\":\"ok\"}; 503 while shutting down" },
    { "/metrics",                        AT_ROOT,  M_GET,             false,  false,  r_metrics,       NULL,                   "Prometheus text (open with --metrics-public)" },
    { "/chat/completions",               AT_BOTH,  M_POST,            false,  false,  NULL,            &serve_api_chat,        "OpenAI Chat Completions" },
    { "/chat/completions/input_tokens",  AT_BOTH,  M_POST,            false,  false,  r_input_tokens,  NULL,                   "the prompt's token count" },
    { "/completions",                    AT_V1,    M_POST,            false,  false,  NULL,            &serve_api_completions, "OpenAI Completions" },
    { "/completions",                    AT_ROOT,  M_POST,            false,  false,  NULL,            &serve_api_native,      "llama-server's native completion (as /completion)" },
    { "/completion",                     AT_ROOT,  M_POST,            false,  false,  NULL,            &serve_api_native,      "llama-server's native completion" },
    { "/responses",                      AT_BOTH,  M_POST,            false,  false,  NULL,            &serve_api_responses,   "OpenAI Responses (previous_response_id held by the server)" },
    { "/responses/",                     AT_BOTH,  M_GET | M_DELETE,  true,   false,  r_response_id,   NULL,                   "a stored response: read or delete (with the ones that continue it)" },
    { "/messages",                       AT_V1,    M_POST,            false,  false,  NULL,            &serve_api_anthropic,   "Anthropic Messages" },
    { "/messages/count_tokens",          AT_V1,    M_POST,            false,  false,  r_count_tokens,  NULL,                   "Anthropic's token count" },
    { "/tokenize",                       AT_ROOT,  M_POST,            false,  false,  r_tokenize,      NULL,                   "llama-server's tokenizer" },
    { "/detokenize",                     AT_ROOT,  M_POST,            false,  false,  r_detokenize,    NULL,                   "llama-server's detokenizer" },
    { "/apply-template",                 AT_ROOT,  M_POST,            false,  false,  r_template,      NULL,                   "the chat template applied to messages" },
    { "/models",                         AT_BOTH,  M_GET,             false,  false,  r_models,        NULL,                   "the model served" },
    { "/props",                          AT_ROOT,  M_GET,             false,  false,  r_props,         NULL,                   "llama-server's server properties (kvtier's are flags: GET only)" },
    { "/slots",                          AT_ROOT,  M_GET,             false,  false,  r_slots,         NULL,                   "the caller's sessions as llama-server's slots" },
    { "/slots/",                         AT_ROOT,  M_POST,            true,   false,  r_slot_action,   NULL,                   "?action=erase: the caller's session slot-ID and completion caches (save, restore: 501)" },
    { "/sessions",                       AT_V1,    M_GET,             false,  false,  r_sessions,      NULL,                   "the caller's sessions" },
    { "/sessions/",                      AT_V1,    M_DELETE,          true,   false,  r_session_id,    NULL,                   "end a session" },
    { "/embedding",                      AT_BOTH,  M_ANY,             false,  false,  r_not_served,    NULL,                   "501: not served" },
    { "/embeddings",                     AT_BOTH,  M_ANY,             false,  false,  r_not_served,    NULL,                   "501: not served" },
    { "/rerank",                         AT_BOTH,  M_ANY,             false,  false,  r_not_served,    NULL,                   "501: not served" },
    { "/reranking",                      AT_BOTH,  M_ANY,             false,  false,  r_not_served,    NULL,                   "501: not served" },
    { "/infill",                         AT_BOTH,  M_ANY,             false,  false,  r_not_served,    NULL,                   "501: not served" },
};
/* clang-format on */

/* The route of url (with or without /v1, as the route allows) and what follows its path; NULL
** when none. */
static const struct route *route_of(const char *url, const char **rest, bool *v1) {
    const char *u = !strncmp(url, "/v1/", 4) ? url + 3 : url;
    *v1 = u != url;
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++) {
        const struct route *r = &ROUTES[i];
        if (!(r->at & (*v1 ? AT_V1 : AT_ROOT))) continue;
        size_t n = strlen(r->path);
        if (r->has_id ? (!strncmp(u, r->path, n) && u[n]) : !strcmp(u, r->path)) {
            *rest = r->has_id ? u + n : "";
            return r;
        }
    }
    return NULL;
}

static unsigned method_bit(const char *m) {
    return !strcmp(m, "GET") ? M_GET : !strcmp(m, "POST") ? M_POST : !strcmp(m, "DELETE") ? M_DELETE : 0;
}

/* answered without a key: an open route, or /metrics with --metrics-public */
static bool route_is_open(struct server *srv, const struct route *r) {
    return r->open || (r->fn == r_metrics && srv->lim.metrics_public);
}

/* a route open without a key (its header-time checks: other methods get 405 before any body) */
bool serve_route_open(struct server *srv, const char *url) {
    const char *rest;
    bool v1;
    const struct route *r = route_of(url, &rest, &v1);
    return r && route_is_open(srv, r);
}

static void methods_text(unsigned m, char *buf, size_t cap) {
    snprintf(buf, cap, "%s%s%s%s%s", m & M_GET ? "GET" : "", (m & M_GET) && (m & ~M_GET) ? " or " : "", m & M_POST ? "POST" : "",
             (m & M_POST) && (m & M_DELETE) ? " or " : "", m & M_DELETE ? "DELETE" : "");
}

/* The request's answer (the body is in): its route's handler. */
enum MHD_Result serve_dispatch(struct server *srv, struct MHD_Connection *c, const char *url, const char *method, struct req *rq) {
    const char *rest;
    const struct route *r = route_of(url, &rest, &rq->v1);
    if (!r) {
        if (!rq->authorized) return serve_send_unauthorized(srv, c);
        return serve_send_error(srv, c, 404, "invalid_request_error", "not_found", "no endpoint %s %s", method, url);
    }
    bool open = route_is_open(srv, r);
    if (!open && !rq->authorized) return serve_send_unauthorized(srv, c);
    if (!(r->methods & method_bit(method))) {
        char m[32];
        methods_text(r->methods, m, sizeof m);
        return serve_send_error(srv, c, 405, "invalid_request_error", NULL, "%s %s: use %s", method, url, m);
    }
    rq->get = !strcmp(method, "GET");
    rq->url_now = url;
    return r->api ? serve_post_generate(srv, c, rq, r->api) : r->fn(srv, c, rq, rest);
}

void serve_routes_print(FILE *f, bool markdown) {
    if (markdown)
        fprintf(f, "# kvtier serve: routes and request fields\n\n"
                   "Generated by `kvtier serve --print-api` from the route table (server/routes.c) and the field tables\n"
                   "(server/fields.c): `make docs`; the suite checks that this file is current.\n\n");
    if (markdown) fprintf(f, "## Routes\n\n| method | path | key | what |\n|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof ROUTES / sizeof ROUTES[0]; i++) {
        const struct route *r = &ROUTES[i];
        char m[32], path[80];
        methods_text(r->methods, m, sizeof m);
        if (r->methods == M_ANY) snprintf(m, sizeof m, "any");
        snprintf(path, sizeof path, "%s%s%s%s",
                 r->at == AT_BOTH ? "[/v1]"
                 : r->at == AT_V1 ? "/v1"
                                  : "",
                 r->path, r->has_id ? "ID" : "", "");
        const char *key = r->open ? "no" : r->fn == r_metrics ? "yes (no with --metrics-public)" : "yes";
        if (markdown) fprintf(f, "| %s | `%s` | %s | %s |\n", m, path, key, r->what);
        else fprintf(f, "  %-15s %-40s %s\n", m, path, r->what);
    }
    if (markdown)
        fprintf(f, "\n`[/v1]`: answered with and without the prefix (llama-server's rule).  Without a key where one is "
                   "needed: 401, before any body byte is read; another method: 405 naming the ones the route takes.\n\n");
}

void serve_print_api(FILE *f) {
    serve_routes_print(f, true);
    serve_fields_print_md(f);
}
