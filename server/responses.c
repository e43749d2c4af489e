/* responses.c — OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/ID) on
** the chat path, with the conversation state held by the server: a stored response keeps the
** chat messages of its turn (the new input items and the reply) and its parent's id, so that a
** request naming previous_response_id sends only its new input; the server rebuilds the
** conversation and runs it as a chat request, whose session's KV already holds every earlier
** turn: only the new tail is decoded (usage.input_tokens_details.cached_tokens says how many were
** reused).  Two responses continuing the same parent fork the conversation: each is a chat of
** its own history, and the prompt blocks they share come from the block store (kvtier's
** copy-on-write).  Instructions are not carried over (as OpenAI documents): each request's
** stand first, as the system message.
**
** Stored responses live in host RAM, per API key (another key's id is a 404), and, with a block
** store, on disk in its index (respdb.c: they outlive a restart; RAM is then the cache in front of
** it, filled on a miss).  In RAM: at most
** --max-responses in all and --responses-per-key of one key; past its share a key's own least
** recently used response goes (never another key's), past the total the server's.  Since a
** response's ancestors are touched whenever it is stored or continued, a response's whole chain
** stays stored while it does.  A stored response is never changed after it is stored: a replay
** works on copies of its messages.  Lookup is a hash of (key, id), O(1); a replay is linear in
** its chain.  Ids are 128 random bits.  store: false replies are not kept.  Shapes as
** platform.openai.com documents them. */
#include "api.h"
#include "fields.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

enum { RESP_MAX_DEPTH = 100000 };

/* One stored response: in the hash chain of its (ns, id), in its key's LRU list and in the
** server's (most recently used first).  turn and obj are never changed once stored. */
struct resp {
    char id[48], parent[48];
    json_t *turn;    /* the chat messages this response added: its input items, then the reply */
    json_t *obj;     /* the Response object, as GET returns it */
    int64_t expires; /* unix seconds (--response-ttl after it was made); 0: never */
    bool shared;     /* its copy is in Redis (respdb.c), where a DELETE on another server shows */
    struct tenant_lru *tn;
    struct resp *hnext, *kprev, *knext, *gprev, *gnext;
};
struct tenant_lru { /* one API key's stored responses */
    char ns[40];
    int32_t n;
    struct resp *head, *tail;
    struct tenant_lru *next;
};

static pthread_mutex_t resp_mu = PTHREAD_MUTEX_INITIALIZER;
static struct resp **buckets; /* [n_buckets], a power of two >= 2 x --max-responses */
static size_t n_buckets;
static struct tenant_lru *tenants;
static struct resp *g_head, *g_tail;
static int32_t n_resps;

static size_t bucket(const char *ns, const char *id) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a over ns, a separator, id */
    for (const char *p = ns; *p; p++) h = (h ^ (unsigned char) *p) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
    for (const char *p = id; *p; p++) h = (h ^ (unsigned char) *p) * 1099511628211ull;
    return (size_t) (h & (n_buckets - 1));
}

static struct resp *find(const char *ns, const char *id) {
    if (!buckets) return NULL;
    for (struct resp *r = buckets[bucket(ns, id)]; r; r = r->hnext)
        if (!strcmp(r->id, id) && !strcmp(r->tn->ns, ns)) return r;
    return NULL;
}

static void unlink_lru(struct resp *r) {
    struct tenant_lru *t = r->tn;
    *(r->kprev ? &r->kprev->knext : &t->head) = r->knext;
    *(r->knext ? &r->knext->kprev : &t->tail) = r->kprev;
    *(r->gprev ? &r->gprev->gnext : &g_head) = r->gnext;
    *(r->gnext ? &r->gnext->gprev : &g_tail) = r->gprev;
}

static void push_front(struct resp *r) {
    struct tenant_lru *t = r->tn;
    r->kprev = NULL;
    r->knext = t->head;
    *(t->head ? &t->head->kprev : &t->tail) = r;
    t->head = r;
    r->gprev = NULL;
    r->gnext = g_head;
    *(g_head ? &g_head->gprev : &g_tail) = r;
    g_head = r;
}

/* Used now: r and then each ancestor of r to the front, so that an ancestor is always more
** recent than its descendants (the LRU end is never the ancestor of a stored response). */
static void touch_chain(struct resp *r) {
    for (int depth = 0; r && depth < RESP_MAX_DEPTH; depth++) {
        unlink_lru(r);
        push_front(r);
        r = r->parent[0] ? find(r->tn->ns, r->parent) : NULL;
    }
}

static void drop(struct resp *r) {
    struct resp **pp = &buckets[bucket(r->tn->ns, r->id)];
    while (*pp != r) pp = &(*pp)->hnext;
    *pp = r->hnext;
    unlink_lru(r);
    r->tn->n--;
    n_resps--;
    json_decref(r->turn);
    json_decref(r->obj);
    free(r);
}

/* Keep (id, parent, turn, obj) in RAM, making room first (the key's own least recently used past
** its share, the server's past the total); new references taken.  Under resp_mu.  NULL: out of
** memory.  The entries dropped for room may include any but the new one: callers hold no other
** struct resp pointer across this call. */
static struct resp *cache_add(struct server *srv, const char *ns, const char *id, const char *parent, json_t *turn, json_t *obj,
                              int64_t expires, bool shared) {
    struct resp *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    if (!buckets) {
        for (n_buckets = 64; n_buckets < 2 * (size_t) srv->max_responses; n_buckets *= 2) {}
        if (!(buckets = calloc(n_buckets, sizeof *buckets))) {
            free(r);
            return NULL;
        }
    }
    struct tenant_lru *t = tenants;
    while (t && strcmp(t->ns, ns)) t = t->next;
    if (!t) {
        if (!(t = calloc(1, sizeof *t))) {
            free(r);
            return NULL;
        }
        snprintf(t->ns, sizeof t->ns, "%s", ns);
        t->next = tenants;
        tenants = t;
    }
    snprintf(r->id, sizeof r->id, "%s", id);
    snprintf(r->parent, sizeof r->parent, "%s", parent ? parent : "");
    r->turn = json_incref(turn);
    r->obj = json_incref(obj);
    r->expires = expires;
    r->shared = shared;
    while (t->n >= srv->responses_per_key && t->tail) drop(t->tail);
    while (n_resps >= srv->max_responses && g_tail) drop(g_tail);
    r->tn = t;
    size_t b = bucket(ns, r->id);
    r->hnext = buckets[b];
    buckets[b] = r;
    t->n++;
    n_resps++;
    push_front(r);
    touch_chain(r); /* ancestors stay newer than their descendants */
    return r;
}

/* The live response (ns, id): from RAM, else from disk or Redis (then kept in RAM).  Under
** resp_mu.  NULL when absent or expired; *bad set (with why) when a row exists but cannot be
** served.  head: the response a request names (GET, previous_response_id): a copy kept here is
** checked against Redis, where another server of the fleet may have deleted it (one GET; the
** ancestors are not checked, as a deleted ancestor in RAM is served until it leaves RAM). */
static struct resp *lookup(struct server *srv, const char *ns, const char *id, bool head, bool *bad, char *why, size_t n_why) {
    *bad = false;
    struct resp *r = find(ns, id);
    if (r && r->expires > 0 && r->expires <= (int64_t) time(NULL)) {
        drop(r);
        r = NULL;
    }
    if (r && head && r->shared && respdb_remote(ns, id) == 0) { /* deleted on another server of the fleet (or expired in Redis) */
        drop(r);
        respdb_del(ns, id);
        return NULL;
    }
    if (r || !respdb_on()) return r;
    char parent[48];
    json_t *turn = NULL, *obj = NULL;
    int64_t expires = 0;
    bool shared = false;
    int got = respdb_get(ns, id, parent, sizeof parent, &turn, &obj, &expires, &shared, why, n_why);
    if (got == 1) r = cache_add(srv, ns, id, parent, turn, obj, expires, shared);
    *bad = got < 0;
    json_decref(turn);
    json_decref(obj);
    return r;
}

void resp_new_id(char *id, size_t n) {
    unsigned char b[16];
    if (getrandom(b, sizeof b, 0) != (ssize_t) sizeof b) { /* no entropy source: still unique, not secret */
        static uint64_t ctr;
        uint64_t c = __atomic_add_fetch(&ctr, 1, __ATOMIC_RELAXED), t = (uint64_t) time(NULL);
        memcpy(b, &c, 8);
        memcpy(b + 8, &t, 8);
    }
    char hex[33];
    for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", b[i]);
    snprintf(id, n, "resp_%s", hex);
}

/* ---------------------------------------------------------------------------------------- */
/* request: input items -> chat messages                                                    */

/* The text of an item's content: a string, or input_text/output_text parts joined. */
static char *content_text(const json_t *c, const char *where, int32_t max_parts, struct serve_error *e) {
    if (json_is_string(c)) return strdup(json_string_value(c));
    if (!json_is_array(c)) {
        serve_error_param(e, "input");
        serve_bad(e, "'%s' must be a string or an array of content parts, got %s", where, serve_json_type(c));
        return NULL;
    }
    if (json_array_size(c) > (size_t) max_parts) { /* before any work on them */
        serve_error_param(e, "input");
        serve_bad(e, "'%s' has %zu parts; at most %d (--max-content-parts)", where, json_array_size(c), max_parts);
        return NULL;
    }
    size_t n = 1, i;
    const json_t *p;
    json_array_foreach(c, i, p) n += json_string_length(json_object_get(p, "text")) + 1;
    char *out = malloc(n);
    if (!out) {
        serve_error_oom(e);
        return NULL;
    }
    size_t len = 0;
    out[0] = '\0';
    json_array_foreach(c, i, p) {
        const char *type = json_string_value(json_object_get(p, "type"));
        const json_t *t = json_object_get(p, "text");
        if (type && (!strcmp(type, "input_text") || !strcmp(type, "output_text") || !strcmp(type, "text")) && json_is_string(t)) {
            if (len) out[len++] = '\n';
            memcpy(out + len, json_string_value(t), json_string_length(t) + 1);
            len += json_string_length(t);
            continue;
        }
        free(out);
        serve_error_param(e, "input");
        if (type && (!strcmp(type, "input_image") || !strcmp(type, "input_file") || !strcmp(type, "input_audio")))
            serve_bad(e, "'%s[%zu]' is %s: image, file and audio input are not supported (kvtier serves text models)", where, i,
                      type);
        else serve_bad(e, "'%s[%zu]' has type '%s'; expected input_text or output_text", where, i, type ? type : "(none)");
        return NULL;
    }
    return out;
}

/* The request's input (a string or a list of items) as chat messages appended to msgs, whose
** first `replayed` messages are previous_response_id's conversation (copies). */
static int input_messages(struct server *srv, const json_t *input, json_t *msgs, size_t replayed, struct serve_error *e) {
    serve_error_param(e, "input");
    if (json_is_string(input))
        return json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "user", "content", input)) ? serve_error_oom(e) : 0;
    if (!json_is_array(input)) return serve_bad(e, "'input' must be a string or an array of items, got %s", serve_json_type(input));
    if (json_array_size(input) > (size_t) srv->lim.max_messages) /* before any work on them */
        return serve_bad(e, "'input' has %zu items; at most %d (--max-messages)", json_array_size(input), srv->lim.max_messages);
    size_t i;
    const json_t *it;
    json_array_foreach(input, i, it) {
        char where[48];
        snprintf(where, sizeof where, "input[%zu].content", i);
        const char *type = json_string_value(json_object_get(it, "type"));
        const char *role = json_string_value(json_object_get(it, "role"));
        if (!json_is_object(it)) return serve_bad(e, "'input[%zu]' must be an object, got %s", i, serve_json_type(it));
        if ((!type || !strcmp(type, "message")) && role) {
            if (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") && strcmp(role, "developer"))
                return serve_bad(e, "'input[%zu].role' '%.40s' is not user, assistant, system or developer", i, role);
            char *t = content_text(json_object_get(it, "content"), where, srv->lim.max_parts, e);
            if (!t) return e->status ? -1 : serve_error_oom(e);
            json_t *m = json_pack("{s:s, s:s}", "role", !strcmp(role, "developer") ? "system" : role, "content", t);
            free(t);
            if (!m || json_array_append_new(msgs, m)) return serve_error_oom(e);
        } else if (type && !strcmp(type, "function_call")) {
            const char *cid = json_string_value(json_object_get(it, "call_id")),
                       *name = json_string_value(json_object_get(it, "name")),
                       *args = json_string_value(json_object_get(it, "arguments"));
            if (!cid || !name || !args)
                return serve_bad(e, "'input[%zu]' (function_call) needs string call_id, name and arguments", i);
            json_t *m = json_pack("{s:s, s:s, s:[{s:s, s:s, s:{s:s, s:s}}]}", "role", "assistant", "content", "", "tool_calls",
                                  "id", cid, "type", "function", "function", "name", name, "arguments", args);
            /* consecutive calls of one turn: one assistant message */
            size_t n_msgs = json_array_size(msgs);
            json_t *last = n_msgs ? json_array_get(msgs, n_msgs - 1) : NULL, *calls = json_object_get(last, "tool_calls");
            const char *lrole = json_string_value(json_object_get(last, "role"));
            bool calls_last = m && json_is_array(calls) && lrole && !strcmp(lrole, "assistant"), resent = false;
            bool merge = calls_last && n_msgs > replayed; /* never into a replayed message: this turn's own */
            if (calls_last && n_msgs <= replayed) {       /* the previous response's own call, sent again: once is enough */
                size_t k;
                const json_t *call;
                json_array_foreach(calls, k, call)
                    resent = resent || !strcmp(json_string_value(json_object_get(call, "id")) ?: "", cid);
            }
            if (resent) json_decref(m);
            else if (merge) {
                int x = json_array_extend(calls, json_object_get(m, "tool_calls"));
                json_decref(m);
                if (x) return serve_error_oom(e);
            } else if (!m || json_array_append_new(msgs, m)) return serve_error_oom(e);
        } else if (type && !strcmp(type, "function_call_output")) {
            const char *cid = json_string_value(json_object_get(it, "call_id"));
            const json_t *out = json_object_get(it, "output");
            if (!cid || !out) return serve_bad(e, "'input[%zu]' (function_call_output) needs a string call_id and an output", i);
            char *t = json_is_string(out) ? strdup(json_string_value(out)) : content_text(out, where, srv->lim.max_parts, e);
            if (!t) return e->status ? -1 : serve_error_oom(e);
            json_t *m = json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id", cid, "content", t);
            free(t);
            if (!m || json_array_append_new(msgs, m)) return serve_error_oom(e);
        } else if (type && !strcmp(type, "reasoning")) {
            continue; /* kvtier's models do not reason apart: nothing to replay */
        } else
            return serve_bad(e, "'input[%zu]' has type '%s'; expected message, function_call or function_call_output", i,
                             type ? type : "(none)");
    }
    return 0;
}

int resp_to_chat(struct server *srv, const char *ns, const json_t *in, json_t **out, json_t **turn, char *parent, size_t n_parent,
                 json_t **ignored, struct serve_error *e) {
    *out = *turn = NULL;
    parent[0] = '\0';
    if (serve_fields_check(FIELD_TABLE_RESPONSES, in, ignored, e)) return -1; /* types, refused and neutral fields */
    const json_t *reasoning = json_object_get(in, "reasoning");
    if (reasoning && json_object_get(reasoning, "effort") && !json_is_null(json_object_get(reasoning, "effort"))) {
        serve_error_param(e, "reasoning");
        return serve_bad(e, "'reasoning.effort' is not supported: kvtier's models do not reason apart");
    }
    const json_t *verb = json_object_get(json_object_get(in, "text"), "verbosity");
    if (verb && !json_is_null(verb) && !(json_is_string(verb) && !strcmp(json_string_value(verb), "medium"))) {
        serve_error_param(e, "text");
        return serve_bad(e, "'text.verbosity' other than \"medium\" is not supported: it would change the reply");
    }
    json_t *o = json_object(), *msgs = json_array(), *t = json_array();
    if (!o || !msgs || !t || json_object_set_new(o, "messages", msgs)) {
        json_decref(o);
        json_decref(t);
        return serve_error_oom(e);
    }
    int rc = 0;
    const json_t *v;
    if ((v = json_object_get(in, "instructions")) && !json_is_null(v)) {
        if (!json_is_string(v)) {
            serve_error_param(e, "instructions");
            rc = serve_bad(e, "'instructions' must be a string, got %s", serve_json_type(v));
        } else if (json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "system", "content", v))) rc = serve_error_oom(e);
    }
    /* the conversation so far: the turns of previous_response_id's chain, oldest first */
    if (rc == 0 && (v = json_object_get(in, "previous_response_id")) && !json_is_null(v)) {
        serve_error_param(e, "previous_response_id");
        if (!json_is_string(v)) rc = serve_bad(e, "'previous_response_id' must be a string, got %s", serve_json_type(v));
        else {
            snprintf(parent, n_parent, "%s", json_string_value(v));
            pthread_mutex_lock(&resp_mu);
            json_t *chain = json_array(); /* the turns, newest first */
            size_t n_ids = 0, cap_ids = 0;
            char(*ids)[48] = NULL; /* the chain's ids, newest first (their use on disk) */
            bool bad = false;
            char why[200] = "", missing[48] = "", bad_id[48] = "";
            struct resp *r = lookup(srv, ns, parent, true, &bad, why, sizeof why);
            if (bad) snprintf(bad_id, sizeof bad_id, "%s", parent);
            bool found = r != NULL, oom = !chain;
            for (int depth = 0; r && !oom && depth < RESP_MAX_DEPTH; depth++) {
                oom = json_array_append(chain, r->turn) != 0;
                if (!oom && respdb_on() && n_ids == cap_ids) {
                    size_t c = cap_ids ? 2 * cap_ids : 16;
                    void *ni = realloc(ids, c * sizeof *ids);
                    if (!(oom = !ni)) ids = ni, cap_ids = c;
                }
                if (!oom && respdb_on()) snprintf(ids[n_ids++], 48, "%s", r->id);
                if (!r->parent[0]) break;
                char next[48]; /* r may be dropped for room by the lookup of its parent */
                snprintf(next, sizeof next, "%s", r->parent);
                r = lookup(srv, ns, next, false, &bad, why, sizeof why);
                if (!r) snprintf(bad ? bad_id : missing, 48, "%s", next);
            }
            if (found && (r = find(ns, parent))) touch_chain(r); /* the chain stays while it is continued */
            if (found && !oom) respdb_touch(ns, (const char(*)[48]) ids, n_ids);
            pthread_mutex_unlock(&resp_mu);
            free(ids);
            if (oom) rc = serve_error_oom(e);
            else if (bad_id[0])
                rc = serve_error_set(e, 500, "server_error", NULL, "stored response '%.60s'%s%.60s%s cannot be served: %s", bad_id,
                                     strcmp(bad_id, parent) ? ", earlier in the conversation of '" : "",
                                     strcmp(bad_id, parent) ? parent : "", strcmp(bad_id, parent) ? "'," : "", why);
            else if (!found || missing[0]) {
                if (!found)
                    rc = serve_error_set(
                        e, 404, "invalid_request_error", "not_found",
                        "previous response '%.60s' was not found (never stored, store: false, deleted, or expired)", parent);
                else /* never a conversation with a hole in it */
                    rc = serve_error_set(e, 404, "invalid_request_error", "not_found",
                                         "response '%.60s', earlier in the conversation of '%.60s', was deleted", missing, parent);
            } else /* copies, oldest turn first: what this request does to its messages never reaches a stored response */
                for (size_t i = json_array_size(chain); rc == 0 && i-- > 0;) {
                    size_t mi;
                    json_t *m;
                    json_array_foreach(json_array_get(chain, i), mi, m) {
                        if (json_array_append_new(msgs, json_deep_copy(m))) {
                            rc = serve_error_oom(e);
                            break;
                        }
                    }
                }
            json_decref(chain);
        }
    }
    size_t before = json_array_size(msgs);
    if (rc == 0) {
        const json_t *input = json_object_get(in, "input");
        if (!input) {
            serve_error_param(e, "input");
            rc = serve_bad(e, "'input' is missing: a string or an array of items");
        } else rc = input_messages(srv, input, msgs, before, e);
    }
    for (size_t i = before; rc == 0 && i < json_array_size(msgs); i++) json_array_append(t, json_array_get(msgs, i));
    static const char *const same[][2] = { { "max_output_tokens", "max_tokens" },
                                           { "temperature", "temperature" },
                                           { "top_p", "top_p" },
                                           { "stream", "stream" },
                                           { "model", "model" },
                                           { "user", "user" },
                                           { "parallel_tool_calls", "parallel_tool_calls" },
                                           { "timings_per_token", "timings_per_token" },
                                           { "return_progress", "return_progress" } };
    for (size_t i = 0; rc == 0 && i < sizeof same / sizeof same[0]; i++)
        if ((v = json_object_get(in, same[i][0])) && json_object_set(o, same[i][1], (json_t *) v)) rc = serve_error_oom(e);
    if (rc == 0 && (v = json_object_get(in, "tools")) && !json_is_null(v)) {
        serve_error_param(e, "tools");
        json_t *tools = json_array();
        size_t i;
        const json_t *tl;
        if (!json_is_array(v)) rc = serve_bad(e, "'tools' must be an array, got %s", serve_json_type(v));
        else json_array_foreach(v, i, tl) {
                const char *type = json_string_value(json_object_get(tl, "type")),
                           *name = json_string_value(json_object_get(tl, "name"));
                if (!type || strcmp(type, "function")) {
                    rc = serve_bad(e, "'tools[%zu]' has type '%.40s'; kvtier runs function tools only (the client runs them)", i,
                                   type ? type : "(none)");
                    break;
                }
                if (!name) {
                    rc = serve_bad(e, "'tools[%zu].name' must be a string", i);
                    break;
                }
                if (compat_function_tool(tools, name, json_object_get(tl, "description"), json_object_get(tl, "parameters")))
                    rc = serve_error_oom(e);
            }
        if (rc == 0 && json_object_set_new(o, "tools", tools)) rc = serve_error_oom(e);
        else if (rc) json_decref(tools);
    }
    if (rc == 0 && (v = json_object_get(in, "tool_choice")) && !json_is_null(v)) {
        serve_error_param(e, "tool_choice");
        json_t *tc = NULL;
        const char *type = json_string_value(json_object_get(v, "type"));
        if (json_is_string(v)) tc = json_copy((json_t *) v);
        else if (type && !strcmp(type, "function") && json_is_string(json_object_get(v, "name")))
            tc = json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", json_object_get(v, "name"));
        else rc = serve_bad(e, "'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}");
        if (tc && json_object_set_new(o, "tool_choice", tc)) rc = serve_error_oom(e);
    }
    if (rc == 0 && (v = json_object_get(in, "text")) && (v = json_object_get(v, "format")) && !json_is_null(v)) {
        /* text.format: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name", "schema", "strict"} */
        serve_error_param(e, "text.format");
        const char *type = json_string_value(json_object_get(v, "type"));
        json_t *rf = NULL;
        if (type && !strcmp(type, "json_schema"))
            rf = json_pack("{s:s, s:{s:O*, s:O*}}", "type", "json_schema", "json_schema", "name", json_object_get(v, "name"),
                           "schema", json_object_get(v, "schema"));
        else if (type && !strcmp(type, "json_object")) rf = json_pack("{s:s}", "type", "json_object");
        else if (!type || strcmp(type, "text")) rc = serve_bad(e, "'text.format.type' must be text, json_object or json_schema");
        if (rf && json_object_set_new(o, "response_format", rf)) rc = serve_error_oom(e);
    }
    if (rc) {
        json_decref(o);
        json_decref(t);
        return -1;
    }
    serve_error_param(e, NULL);
    *out = o;
    *turn = t;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* reply                                                                                    */

json_t *resp_output(struct server *srv, const json_t *msg, const char *item_id) {
    json_t *out = json_array();
    const json_t *c = json_object_get(msg, "content"), *calls = json_object_get(msg, "tool_calls");
    if (json_is_string(c) && (json_string_length(c) || !json_array_size(calls)))
        json_array_append_new(out, json_pack("{s:s, s:s, s:s, s:s, s:[{s:s, s:O, s:[]}]}", "type", "message", "id", item_id,
                                             "status", "completed", "role", "assistant", "content", "type", "output_text", "text",
                                             c, "annotations"));
    size_t i;
    const json_t *call;
    json_array_foreach(calls, i, call) {
        char fid[48];
        snprintf(fid, sizeof fid, "fc_%llu", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
        const json_t *fn = json_object_get(call, "function");
        json_array_append_new(out, json_pack("{s:s, s:s, s:O, s:O, s:O, s:s}", "type", "function_call", "id", fid, "call_id",
                                             json_object_get(call, "id"), "name", json_object_get(fn, "name"), "arguments",
                                             json_object_get(fn, "arguments"), "status", "completed"));
    }
    return out;
}

json_t *resp_usage(const struct job *j) {
    json_t *u = json_pack("{s:i, s:{s:I}, s:i, s:{s:i}, s:i}", "input_tokens", j->prompt_tokens, "input_tokens_details",
                          "cached_tokens",
                          (json_int_t) (j->sync.tokens_reused + j->sync.tokens_from_store + j->sync.tokens_from_chunks),
                          "output_tokens", j->completion_tokens, "output_tokens_details", "reasoning_tokens", 0, "total_tokens",
                          j->prompt_tokens + j->completion_tokens);
    if (u && json_array_size(j->req.ignored)) /* the request's fields no table knows */
        json_object_set_new(u, "kvtier", json_pack("{s:O}", "ignored_fields", j->req.ignored));
    return u;
}

json_t *resp_object(struct server *srv, const struct job *j, const char *id, const char *parent, json_t *output,
                    const char *status) {
    bool incomplete = !strcmp(status, "incomplete");
    return json_pack(
        "{s:s, s:s, s:I, s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:i, s:f, s:f, s:b, s:o}", "id", id, "object", "response", "created_at",
        (json_int_t) time(NULL), "status", status, "model", srv->model_name, "output", output ? output : json_array(), "usage",
        j ? resp_usage(j) : json_null(), "previous_response_id", parent && *parent ? json_string(parent) : json_null(),
        "incomplete_details", incomplete ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null(), "error", json_null(),
        "max_output_tokens", j ? j->req.max_tokens : 0, "temperature", j ? (double) j->req.smp.temperature : 1.0, "top_p",
        j ? (double) j->req.smp.top_p : 1.0, "parallel_tool_calls", 1, "text", json_pack("{s:{s:s}}", "format", "type", "text"));
}

void resp_store(struct server *srv, const char *ns, const char *id, const char *parent, json_t *turn, const json_t *msg,
                json_t *obj) {
    /* the reply as the chat message the next turn replays (its tool calls with their ids) */
    json_t *content = json_object_get(msg, "content");
    json_t *am = json_pack("{s:s, s:o}", "role", "assistant", "content",
                           json_is_string(content) ? json_incref(content) : json_string(""));
    if (am && json_array_size(json_object_get(msg, "tool_calls")))
        json_object_set(am, "tool_calls", json_object_get(msg, "tool_calls"));
    if (!am || json_array_append_new(turn, am)) return;
    const int64_t expires = srv->response_ttl_s > 0 ? (int64_t) time(NULL) + srv->response_ttl_s : 0;
    pthread_mutex_lock(&resp_mu);
    bool shared = false;
    respdb_put(ns, id, parent ? parent : "", turn, obj, &shared); /* on disk and in Redis too (a failure is logged; RAM has it) */
    if (!cache_add(srv, ns, id, parent, turn, obj, expires, shared))
        fprintf(stderr, "kvtier serve: out of memory keeping response '%s'\n", id);
    pthread_mutex_unlock(&resp_mu);
}

json_t *resp_get(struct server *srv, const char *ns, const char *id) {
    pthread_mutex_lock(&resp_mu);
    bool bad;
    char why[200];
    struct resp *r = lookup(srv, ns, id, true, &bad, why, sizeof why);
    json_t *o = r ? json_incref(r->obj) : NULL;
    pthread_mutex_unlock(&resp_mu);
    return o;
}

bool resp_delete(const char *ns, const char *id) {
    pthread_mutex_lock(&resp_mu);
    struct resp *r = find(ns, id);
    bool live = r && !(r->expires > 0 && r->expires <= (int64_t) time(NULL));
    if (r) drop(r);
    bool on_disk = respdb_del(ns, id);
    pthread_mutex_unlock(&resp_mu);
    return live || on_disk;
}

int32_t resp_count(const char *ns) {
    pthread_mutex_lock(&resp_mu);
    int32_t n = n_resps;
    if (ns) {
        struct tenant_lru *t = tenants;
        while (t && strcmp(t->ns, ns)) t = t->next;
        n = t ? t->n : 0;
    }
    pthread_mutex_unlock(&resp_mu);
    return n;
}

void resp_free_all(void) {
    pthread_mutex_lock(&resp_mu);
    while (g_head) drop(g_head);
    while (tenants) {
        struct tenant_lru *t = tenants;
        tenants = t->next;
        free(t);
    }
    free(buckets);
    buckets = NULL;
    n_buckets = 0;
    pthread_mutex_unlock(&resp_mu);
}

/* ---- the stream's events ---- */

/* A Responses event: "event: TYPE", and its data with the next sequence_number. */
static void resp_event(struct stream *st, json_t *obj) {
    if (obj) json_object_set_new(obj, "sequence_number", json_integer(st->u.resp.seq++));
    sse_event(st, obj);
}

static json_t *resp_msg_item(struct stream *st, const char *status, const char *text) {
    json_t *content = json_array();
    if (text) json_array_append_new(content, json_pack("{s:s, s:s, s:[]}", "type", "output_text", "text", text, "annotations"));
    return json_pack("{s:s, s:s, s:s, s:s, s:o}", "type", "message", "id", st->u.resp.item, "status", status, "role", "assistant",
                     "content", content);
}

/* Responses: text as an output_text delta of the message item (announced first if needed). */
static void resp_text(struct stream *st, const char *text) {
    if (!st->u.resp.open) {
        st->u.resp.open = true;
        resp_event(st, json_pack("{s:s, s:i, s:o}", "type", "response.output_item.added", "output_index", st->u.resp.items, "item",
                                 resp_msg_item(st, "in_progress", NULL)));
        resp_event(st, json_pack("{s:s, s:s, s:i, s:i, s:{s:s, s:s, s:[]}}", "type", "response.content_part.added", "item_id",
                                 st->u.resp.item, "output_index", st->u.resp.items, "content_index", 0, "part", "type",
                                 "output_text", "text", "", "annotations"));
    }
    json_t *ev = json_pack("{s:s, s:s, s:i, s:i, s:s, s:[]}", "type", "response.output_text.delta", "item_id", st->u.resp.item,
                           "output_index", st->u.resp.items, "content_index", 0, "delta", text, "logprobs");
    if (ev && st->u.resp.timings) json_object_set(ev, "timings", st->u.resp.timings);
    resp_event(st, ev);
}

/* Responses: the message item's end (its whole text), if it was opened. */
static void resp_text_done(struct stream *st, const char *text) {
    if (!st->u.resp.open) return;
    st->u.resp.open = false;
    resp_event(st, json_pack("{s:s, s:s, s:i, s:i, s:s, s:[]}", "type", "response.output_text.done", "item_id", st->u.resp.item,
                             "output_index", st->u.resp.items, "content_index", 0, "text", text, "logprobs"));
    resp_event(st, json_pack("{s:s, s:s, s:i, s:i, s:{s:s, s:s, s:[]}}", "type", "response.content_part.done", "item_id",
                             st->u.resp.item, "output_index", st->u.resp.items, "content_index", 0, "part", "type", "output_text",
                             "text", text, "annotations"));
    resp_event(st, json_pack("{s:s, s:i, s:o}", "type", "response.output_item.done", "output_index", st->u.resp.items, "item",
                             resp_msg_item(st, "completed", text)));
    st->u.resp.items++;
}

/* Responses: the reply's output items that were not streamed as text (function calls, or a
** reply under tools sent whole), each announced, its arguments or text, and done. */
static void resp_items(struct stream *st, json_t *output) {
    size_t i;
    json_t *it;
    json_array_foreach(output, i, it) {
        const char *type = json_string_value(json_object_get(it, "type"));
        if (!strcmp(type, "message")) {
            if (st->u.resp.open) continue; /* streamed already */
            const char *text = json_string_value(json_object_get(json_array_get(json_object_get(it, "content"), 0), "text"));
            resp_text(st, text ? text : "");
            resp_text_done(st, text ? text : "");
            continue;
        }
        json_t *added = json_deep_copy(it);
        json_object_set_new(added, "arguments", json_string(""));
        json_object_set_new(added, "status", json_string("in_progress"));
        resp_event(st, json_pack("{s:s, s:i, s:o}", "type", "response.output_item.added", "output_index", st->u.resp.items, "item",
                                 added));
        resp_event(st, json_pack("{s:s, s:O, s:i, s:O}", "type", "response.function_call_arguments.delta", "item_id",
                                 json_object_get(it, "id"), "output_index", st->u.resp.items, "delta",
                                 json_object_get(it, "arguments")));
        resp_event(st, json_pack("{s:s, s:O, s:i, s:O, s:O}", "type", "response.function_call_arguments.done", "item_id",
                                 json_object_get(it, "id"), "output_index", st->u.resp.items, "arguments",
                                 json_object_get(it, "arguments"), "name", json_object_get(it, "name")));
        resp_event(st,
                   json_pack("{s:s, s:i, s:O}", "type", "response.output_item.done", "output_index", st->u.resp.items, "item", it));
        st->u.resp.items++;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* the module (api.h): parse, reply, the stream's events                                     */

static int parse(struct server *srv, json_t *root, struct job *j, struct serve_error *e) {
    json_t *chat = NULL;
    char parent[48] = "";
    j->kind = JOB_CHAT;
    j->req.resp_store = !json_is_false(json_object_get(root, "store"));
    if (resp_to_chat(srv, j->req.ns, root, &chat, &j->req.resp_turn, parent, sizeof parent, &j->req.ignored, e)) return -1;
    snprintf(j->req.resp_parent, sizeof j->req.resp_parent, "%s", parent);
    resp_new_id(j->req.resp_id, sizeof j->req.resp_id);
    return serve_request_parse_chat(srv, chat, j, e);
}

static json_t *reply(struct server *srv, struct job *j) {
    const char *fin = j->finish;
    json_t *msg = tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
    char item[48];
    snprintf(item, sizeof item, "msg_%llu", __atomic_add_fetch(&srv->n_replies, 1, __ATOMIC_RELAXED));
    json_t *r = resp_object(srv, j, j->req.resp_id, j->req.resp_parent, resp_output(srv, msg, item),
                            !strcmp(fin ? fin : "", "length") ? "incomplete" : "completed");
    if (j->req.resp_store && msg && r) resp_store(srv, j->req.ns, j->req.resp_id, j->req.resp_parent, j->req.resp_turn, msg, r);
    json_decref(msg);
    return r;
}

static void s_start(struct stream *st) {
    const struct job *j = st->j;
    snprintf(st->u.resp.item, sizeof st->u.resp.item, "msg_%llu", __atomic_add_fetch(&st->srv->n_replies, 1, __ATOMIC_RELAXED));
    json_t *r0 = resp_object(st->srv, NULL, j->req.resp_id, j->req.resp_parent, NULL, "in_progress");
    resp_event(st, json_pack("{s:s, s:o}", "type", "response.created", "response", json_deep_copy(r0)));
    resp_event(st, json_pack("{s:s, s:o}", "type", "response.in_progress", "response", r0));
}

/* return_progress: a response.in_progress event carrying llama-server's "prompt_progress" */
static void s_progress(struct stream *st, const struct prompt_progress *p) {
    const struct job *j = st->j;
    json_t *ev = json_pack("{s:s, s:{s:s, s:s, s:s}}", "type", "response.in_progress", "response", "id", j->req.resp_id, "object",
                           "response", "status", "in_progress");
    serve_progress_attach(ev, j, p);
    resp_event(st, ev);
}

/* a reply under tools, whole: its items (kept, so that the final response names the same call ids) */
static void s_whole(struct stream *st, json_t *msg, const char **fin) {
    (void) fin;
    st->u.resp.out = resp_output(st->srv, msg, st->u.resp.item);
    st->u.resp.msg = msg;
    resp_items(st, st->u.resp.out);
}

static void s_piece(struct stream *st, const char *piece, json_t *tm, json_t *lps) {
    (void) lps;
    st->u.resp.timings = tm;
    if (*piece) resp_text(st, piece);
    st->u.resp.timings = NULL;
}

/* the message item done, the items not streamed, response.completed (or .incomplete) with the
** whole response, stored for previous_response_id; or the error event */
static void s_end(struct stream *st, const char *fin) {
    struct server *srv = st->srv;
    const struct job *j = st->j;
    if (j->err.status && j->err.status != 200) {
        json_t *err = serve_error_json(&j->err), *eo = json_object_get(err, "error");
        json_object_set_new(eo, "type", json_string("error"));
        resp_event(st, json_incref(eo));
        json_decref(err);
        return;
    }
    json_t *msg = st->u.resp.msg ? json_incref(st->u.resp.msg) : tools_reply(srv, j->text ? j->text : "", j->req.format, &fin);
    json_t *output = st->u.resp.out ? json_incref(st->u.resp.out) : resp_output(srv, msg, st->u.resp.item);
    if (st->u.resp.msg && !strcmp(fin ? fin : "", "stop") && json_array_size(json_object_get(msg, "tool_calls")))
        fin = "tool_calls";
    if (st->u.resp.open) { /* the text streamed: its whole, cleaned */
        const json_t *t = json_object_get(json_array_get(json_object_get(json_array_get(output, 0), "content"), 0), "text");
        resp_text_done(st, json_is_string(t) ? json_string_value(t) : "");
    } else if (j->req.format != REPLY_TOOLS || st->tools_text > 0) resp_items(st, output);
    const char *status = !strcmp(fin ? fin : "", "length") ? "incomplete" : "completed";
    json_t *obj = resp_object(srv, j, j->req.resp_id, j->req.resp_parent, output, status);
    if (j->req.resp_store && msg && obj) resp_store(srv, j->req.ns, j->req.resp_id, j->req.resp_parent, j->req.resp_turn, msg, obj);
    json_t *ev = json_pack("{s:s, s:o}", "type", !strcmp(status, "completed") ? "response.completed" : "response.incomplete",
                           "response", obj);
    if (ev && j->req.timings) json_object_set_new(ev, "timings", serve_timings(j, serve_mono_ms()));
    resp_event(st, ev);
    json_decref(msg);
}

static void s_free(struct stream *st) {
    json_decref(st->u.resp.msg);
    json_decref(st->u.resp.out);
}

const struct serve_api serve_api_responses = {
    .name = "responses",
    .parse = parse,
    .reply = reply,
    .error = serve_error_json,
    .s_start = s_start,
    .s_progress = s_progress,
    .s_whole = s_whole,
    .s_piece = s_piece,
    .s_end = s_end,
    .s_free = s_free,
};
