/* tools.c — tool calling and structured output for `kvtier serve`.
**
** Gemma's chat template (and many others llama.cpp's built-in formatter knows) has no tool
** syntax.  We do what llama-server does for such templates (its "generic" tool-call format,
** common/chat.cpp): the tools are described in the system message, the reply is constrained by
** a GBNF grammar (kvt_grammar, llama.cpp's grammar sampler): a call is one JSON object
**     {"tool_call":{"name":"NAME","arguments":{...}}}
** parsed into OpenAI `tool_calls`.  Under tool_choice "auto" the grammar lets the reply be plain
** text instead, chosen by its first character ('{' starts a call; text may not start with '{' or
** a blank), like llama-server's lazy grammars for templates that have a tool syntax: the model
** answers in its own words unless it starts a call.  llama-server's generic format held every
** reply to {"tool_call": ...} or {"response": "text"}; on Gemma 3 270M and SmolLM2-135M that
** made "auto" answer none of the questions needing no tool in text ("Who wrote Hamlet?" got a
** get_weather call; docs/BENCHMARKS.md, Tool calls).  "none" allows only the plain text.  The arguments follow each
** tool's JSON schema (the subset below); a history the client sends back renders assistant tool
** calls in the same JSON and tool results as user messages
**     {"tool_response":{"tool":"NAME","content":...}}
** (minja's polyfill for templates without a tool role).
**
** The tools' parameters and response_format's schemas become grammar in server/schema.c. */
#include "schema.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------------------------------- */
/* request                                                                                   */

int tools_parse(json_t *root, struct job *j, const struct serve_limits *lim, char **sys_extra, struct serve_error *e) {
    *sys_extra = NULL;
    j->req.format = REPLY_TEXT;
    const json_t *tools = json_object_get(root, "tools"), *choice = json_object_get(root, "tool_choice"),
                 *rf = json_object_get(root, "response_format");
    /* the field table (server/fields.c) refused functions / function_call and checked the types */
    struct gram g = { .max_work = lim->max_schema_nodes, .max_alt = lim->max_alternatives };
    struct serve_buf root_rule = { 0 };
    int rc = 0;
    /* tools */
    const char *mode = "auto", *forced = NULL;
    if (tools && json_is_null(tools)) tools = NULL;
    if (tools) {
        serve_error_param(e, "tools");
        if (!json_is_array(tools)) {
            serve_bad(e, "'tools' must be an array, got %s", serve_json_type(tools));
            return -1;
        }
        if (json_array_size(tools) > (size_t) lim->max_tools) {
            serve_bad(e, "'tools' has %zu entries; at most %d (--max-tools)", json_array_size(tools), lim->max_tools);
            return -1;
        }
        if (json_array_size(tools) == 0) tools = NULL;
    }
    if (choice && !json_is_null(choice)) {
        serve_error_param(e, "tool_choice");
        if (json_is_string(choice)) {
            mode = json_string_value(choice);
            if (strcmp(mode, "none") && strcmp(mode, "auto") && strcmp(mode, "required")) {
                serve_bad(e, "'tool_choice' '%.40s' is not one of none, auto, required or {\"type\": \"function\", ...}", mode);
                return -1;
            }
        } else if (json_is_object(choice)) {
            const json_t *fn = json_object_get(choice, "function"), *nm = fn ? json_object_get(fn, "name") : NULL;
            if (!nm || !json_is_string(nm)) {
                serve_bad(e, "'tool_choice' object must be {\"type\": \"function\", \"function\": {\"name\": string}}");
                return -1;
            }
            mode = "function";
            forced = json_string_value(nm);
        } else {
            serve_bad(e, "'tool_choice' must be a string or an object, got %s", serve_json_type(choice));
            return -1;
        }
        if (!tools && strcmp(mode, "none") && strcmp(mode, "auto")) {
            serve_bad(e, "'tool_choice' '%s' needs 'tools'", forced ? forced : mode);
            return -1;
        }
    }
    if (tools) { /* described whatever tool_choice says, so the system message (and the session's
                 ** tokens) stay the same from turn to turn; "none" only drops the grammar */
        bool none = !strcmp(mode, "none");
        serve_error_param(e, "tools");
        json_t *desc = json_array();
        struct serve_buf calls = { 0 };
        size_t i;
        const json_t *t;
        bool found = !forced;
        json_array_foreach(tools, i, t) {
            const json_t *ty = json_is_object(t) ? json_object_get(t, "type") : NULL,
                         *fn = json_is_object(t) ? json_object_get(t, "function") : NULL;
            const json_t *nm = fn && json_is_object(fn) ? json_object_get(fn, "name") : NULL;
            if (!ty || !json_is_string(ty) || strcmp(json_string_value(ty), "function") || !nm || !json_is_string(nm) ||
                !json_string_length(nm)) {
                serve_bad(e, "'tools[%zu]' must be {\"type\": \"function\", \"function\": {\"name\": non-empty string, ...}}", i);
                rc = -1;
                break;
            }
            const char *name = json_string_value(nm);
            for (const char *p = name; *p; p++)
                if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_' || *p == '-')) {
                    serve_bad(e, "'tools[%zu].function.name' '%.64s' may hold only a-z, A-Z, 0-9, _ and -", i, name);
                    rc = -1;
                    break;
                }
            if (rc) break;
            const json_t *params = json_object_get(fn, "parameters"), *d = json_object_get(fn, "description");
            if (params && !json_is_object(params)) {
                serve_bad(e, "'tools[%zu].function.parameters' must be a JSON schema object, got %s", i, serve_json_type(params));
                rc = -1;
                break;
            }
            json_t *one = json_pack("{s:s}", "name", name);
            if (d && json_is_string(d)) json_object_set(one, "description", (json_t *) d);
            if (params) json_object_set(one, "parameters", (json_t *) params);
            json_array_append_new(desc, one);
            if (none || (forced && strcmp(forced, name))) continue;
            found = true;
            /* "{\"tool_call\":{\"name\":\"NAME\",\"arguments\":" ARGS "}}" */
            serve_buf_printf(&calls, "%s", calls.n ? " | " : "");
            struct serve_buf lit = { 0 };
            serve_buf_printf(&lit, "{\"tool_call\":{\"name\":\"%s\",\"arguments\":", name);
            schema_lit(&calls, lit.s ? lit.s : "");
            free(lit.s);
            serve_buf_printf(&calls, " ");
            bool untyped = !params || json_object_size(params) == 0; /* arguments are an object anyway */
            json_t *obj = untyped ? json_pack("{s:s}", "type", "object") : NULL;
            serve_error_param(e, "tools");
            g.root = untyped ? obj : params; /* its $refs resolve in its own parameters */
            schema_rule(&g, untyped ? obj : params, &calls);
            json_decref(obj);
            serve_buf_printf(&calls, " \"}}\"");
            if (g.failed) {
                serve_bad(e, "'tools[%zu].function.parameters': %s", i, g.msg);
                rc = -1;
                break;
            }
        }
        if (rc == 0 && !found && !none) {
            serve_error_param(e, "tool_choice");
            serve_bad(e, "'tool_choice' names the function '%.64s', which is not in 'tools'", forced);
            rc = -1;
        }
        if (rc == 0) {
            bool must = !strcmp(mode, "required") || forced;
            /* "auto": the model's first character chooses: '{' begins a call, anything else
            ** (not blank) is a plain-text answer.  "none": the same system message, plain text only */
            if (none) serve_buf_printf(&root_rule, "root ::= plain\n");
            else serve_buf_printf(&root_rule, "root ::= %s%s\n", calls.s ? calls.s : "", must ? "" : " | plain");
            if (!must) serve_buf_printf(&root_rule, "plain ::= [^{ \\t\\r\\n] [^\\x00]*\n");
            j->req.format = REPLY_TOOLS;
            char *list = json_dumps(desc, JSON_COMPACT);
            struct serve_buf sys = { 0 };
            serve_buf_printf(&sys, "You can call any of the following tools to satisfy the user's requests: %s\n\n",
                             list ? list : "[]");
            serve_buf_printf(&sys,
                             "To call a tool, respond with only a JSON object, for example {\"tool_call\":{\"name\":\"tool_name\","
                             "\"arguments\":{\"arg1\":\"value\"}}}. To answer the user directly, respond in plain text.");
            free(list);
            if (sys.oom) rc = -1;
            *sys_extra = sys.s;
        }
        free(calls.s);
        json_decref(desc);
        if (calls.oom || root_rule.oom) rc = -1;
    }
    /* llama-server's two other spellings of a constraint, never ignored: a top-level
    ** "json_schema" (a JSON schema) and "grammar" (GBNF text, used as given) */
    const json_t *top_schema = json_object_get(root, "json_schema"), *gbnf = json_object_get(root, "grammar");
    if (top_schema && json_is_null(top_schema)) top_schema = NULL;
    if (gbnf && json_is_null(gbnf)) gbnf = NULL;
    if (rc == 0 && (top_schema || gbnf)) {
        const char *name = top_schema ? "json_schema" : "grammar";
        serve_error_param(e, name);
        if (top_schema && gbnf) {
            serve_bad(e, "'json_schema' and 'grammar' both constrain the reply: send one");
            rc = -1;
        } else if (j->req.format == REPLY_TOOLS || (rf && !json_is_null(rf))) {
            serve_bad(e, "'%s' cannot be combined with '%s' (one constraint per reply)", name,
                      j->req.format == REPLY_TOOLS ? "tools" : "response_format");
            rc = -1;
        } else if (top_schema && !json_is_object(top_schema)) {
            serve_bad(e, "'json_schema' must be a JSON schema object, got %s", serve_json_type(top_schema));
            rc = -1;
        } else if (gbnf && !json_is_string(gbnf)) {
            serve_bad(e, "'grammar' must be a string of GBNF rules, got %s", serve_json_type(gbnf));
            rc = -1;
        } else if (gbnf && json_string_length(gbnf) > GBNF_MAX_BYTES) {
            serve_bad(e, "'grammar' has %zu bytes; at most %d", json_string_length(gbnf), GBNF_MAX_BYTES);
            rc = -1;
        } else if (gbnf) {
            if (json_string_length(gbnf) > 0) { /* "" is llama-server's "no grammar" */
                if (!(j->req.grammar = strdup(json_string_value(gbnf)))) {
                    serve_error_oom(e);
                    rc = -1;
                }
                j->req.grammar_user = true;
            }
        } else {
            rc = schema_root(&g, top_schema, &root_rule, "json_schema", e);
            j->req.format = REPLY_JSON;
        }
    }
    /* response_format (only when no tool call is possible: one grammar per reply) */
    if (rc == 0 && rf && !json_is_null(rf)) {
        serve_error_param(e, "response_format");
        const json_t *ty = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
        const char *t = ty && json_is_string(ty) ? json_string_value(ty) : NULL;
        if (!t || (strcmp(t, "text") && strcmp(t, "json_object") && strcmp(t, "json_schema"))) {
            serve_bad(e, "'response_format.type' %s%.40s%s is not one of text, json_object, json_schema", t ? "'" : "",
                      t ? t : "(missing)", t ? "'" : "");
            rc = -1;
        } else if (strcmp(t, "text") && j->req.format == REPLY_TOOLS) {
            serve_bad(e, "'response_format' %s cannot be combined with 'tools' (the reply is a tool call or a response)", t);
            rc = -1;
        } else if (!strcmp(t, "json_object") && json_object_get(rf, "schema") && !json_is_null(json_object_get(rf, "schema"))) {
            /* llama-server's form: {"type": "json_object", "schema": {...}} */
            const json_t *sc = json_object_get(rf, "schema");
            if (!json_is_object(sc)) {
                serve_bad(e, "'response_format.schema' must be a JSON schema object, got %s", serve_json_type(sc));
                rc = -1;
            } else {
                rc = schema_root(&g, sc, &root_rule, "response_format.schema", e);
                j->req.format = REPLY_JSON;
            }
        } else if (!strcmp(t, "json_object")) {
            serve_buf_printf(&root_rule, "root ::= object\n");
            j->req.format = REPLY_JSON;
        } else if (!strcmp(t, "json_schema")) {
            const json_t *js = json_object_get(rf, "json_schema"),
                         *sc = js && json_is_object(js) ? json_object_get(js, "schema") : NULL;
            if (!sc) {
                serve_bad(e, "'response_format' json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}");
                rc = -1;
            } else {
                rc = schema_root(&g, sc, &root_rule, "response_format.json_schema.schema", e);
                j->req.format = REPLY_JSON;
            }
        }
    }
    if (rc == 0 && root_rule.n) {
        struct serve_buf all = { 0 };
        serve_buf_printf(&all, "%s%s%s", root_rule.s, g.rules.s ? g.rules.s : "", GBNF_PRIMITIVES);
        if (all.oom || g.rules.oom) {
            free(all.s);
            rc = -1;
            serve_error_oom(e);
        } else if (all.n > GBNF_MAX_BYTES) {
            free(all.s);
            rc = -1;
            serve_error_param(e, j->req.format == REPLY_TOOLS ? "tools" : top_schema ? "json_schema" : "response_format");
            serve_bad(e, "the schemas make a grammar of %zu bytes; at most %d", all.n, GBNF_MAX_BYTES);
        } else j->req.grammar = all.s;
    }
    free(root_rule.s);
    free(g.rules.s);
    if (rc) {
        free(*sys_extra);
        *sys_extra = NULL;
        return -1;
    }
    serve_error_param(e, NULL);
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* history                                                                                   */

char *tools_render_calls(const json_t *calls, size_t msg, struct serve_error *e) {
    if (!json_is_array(calls) || json_array_size(calls) == 0) {
        serve_bad(e, "'messages[%zu].tool_calls' must be a non-empty array", msg);
        return NULL;
    }
    json_t *out = json_array();
    size_t i;
    const json_t *c;
    json_array_foreach(calls, i, c) {
        const json_t *fn = json_is_object(c) ? json_object_get(c, "function") : NULL;
        const json_t *nm = fn ? json_object_get(fn, "name") : NULL, *ar = fn ? json_object_get(fn, "arguments") : NULL;
        if (!nm || !json_is_string(nm) || !ar || !json_is_string(ar)) {
            serve_bad(e, "'messages[%zu].tool_calls[%zu]' must be {\"function\": {\"name\": string, \"arguments\": string}}", msg,
                      i);
            json_decref(out);
            return NULL;
        }
        json_error_t je;
        json_t *args = json_loads(json_string_value(ar), JSON_DECODE_ANY, &je);
        if (!args) {
            serve_bad(e, "'messages[%zu].tool_calls[%zu].function.arguments' is not JSON: %s", msg, i, je.text);
            json_decref(out);
            return NULL;
        }
        json_array_append_new(out, json_pack("{s:O, s:o}", "name", nm, "arguments", args));
    }
    json_t *wrap = json_array_size(out) == 1 ? json_pack("{s:O}", "tool_call", json_array_get(out, 0))
                                             : json_pack("{s:O}", "tool_calls", out);
    json_decref(out);
    char *t = wrap ? json_dumps(wrap, JSON_COMPACT) : NULL;
    json_decref(wrap);
    if (!t) serve_error_oom(e);
    return t;
}

char *tools_render_result(const char *name, const char *content) {
    json_error_t e;
    json_t *c = json_loads(content, JSON_DECODE_ANY, &e); /* a JSON result stays structured */
    if (!c) c = json_string(content);
    json_t *o = json_pack("{s:{s:s, s:o}}", "tool_response", "tool", name ? name : "", "content", c);
    char *t = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return t;
}

bool tools_same_reply(const char *stored, const char *echo) {
    if (!strcmp(stored, echo)) return true;
    json_error_t e;
    json_t *a = json_loads(stored, 0, &e);
    if (!a) return false;
    bool same = false;
    json_t *b = json_loads(echo, 0, &e);
    if (b) same = json_equal(a, b);
    else { /* a plain reply echoed back, stored in the former format {"response": text} */
        const json_t *r = json_object_get(a, "response");
        same = json_object_size(a) == 1 && r && json_is_string(r) && !strcmp(json_string_value(r), echo);
    }
    json_decref(a);
    json_decref(b);
    return same;
}

/* ---------------------------------------------------------------------------------------- */
/* reply                                                                                     */

json_t *tools_reply(struct server *srv, const char *text, int format, const char **finish) {
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    if (!msg) return NULL;
    json_t *o = format == REPLY_TOOLS ? json_loads(text, 0, NULL) : NULL;
    const json_t *tc = o ? json_object_get(o, "tool_call") : NULL, *r = o ? json_object_get(o, "response") : NULL;
    const json_t *many = o ? json_object_get(o, "tool_calls") : NULL;
    if (tc || (many && json_is_array(many))) {
        json_t *calls = json_array();
        size_t i;
        const json_t *c;
        json_t *one = tc ? json_pack("[O]", tc) : NULL;
        json_array_foreach(tc ? one : many, i, c) {
            const json_t *nm = json_object_get(c, "name"), *ar = json_object_get(c, "arguments");
            char *args = ar ? json_dumps(ar, JSON_COMPACT | JSON_ENCODE_ANY) : strdup("{}");
            char id[48];
            snprintf(id, sizeof id, "call_%llx%llu", (unsigned long long) time(NULL),
                     __atomic_add_fetch(&srv->n_calls, 1, __ATOMIC_RELAXED));
            json_array_append_new(calls, json_pack("{s:i, s:s, s:s, s:{s:s, s:s}}", "index", (int) i, "id", id, "type", "function",
                                                   "function", "name", nm && json_is_string(nm) ? json_string_value(nm) : "",
                                                   "arguments", args ? args : "{}"));
            free(args);
        }
        json_decref(one);
        json_object_set_new(msg, "content", json_null());
        json_object_set_new(msg, "tool_calls", calls);
        if (!strcmp(*finish, "stop")) *finish = "tool_calls";
    } else if (r && json_is_string(r)) {
        json_object_set_new(msg, "content", json_string(json_string_value(r)));
    } else { /* unfinished (max_tokens) or free text: as generated */
        char *clean = app_utf8_clean(text);
        json_object_set_new(msg, "content", json_string(clean ? clean : ""));
        free(clean);
    }
    json_decref(o);
    return msg;
}
