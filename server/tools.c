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
** JSON schema subset turned into grammar: type (string, number, integer, boolean, null,
** array with items/minItems, object with properties/required/additionalProperties, a list of
** types), enum, const, anyOf/oneOf.  Anything else (e.g. $ref, pattern, format) is accepted as
** any JSON value of the right kind.  Objects are generated with their properties in schema
** order, required ones always, optional ones in order and skippable (at most 256 properties an
** object, 1 MiB of grammar in all); minItems counts only as "non-empty", maxItems and string
** formats are not enforced.  No whitespace and no \u escapes are generated (non-ASCII text is
** raw UTF-8): the reply is canonical JSON, so a client echoing it back matches the session's
** tokens. */
#include "serve.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------------------------------- */
/* a growing string                                                                          */

/* A GBNF string literal matching exactly the bytes of s. */
static void bput_lit(struct serve_buf *b, const char *s) {
    serve_buf_printf(b, "\"");
    for (const unsigned char *p = (const unsigned char *) s; *p; p++) {
        if (*p == '"' || *p == '\\') serve_buf_printf(b, "\\%c", *p);
        else if (*p == '\n') serve_buf_printf(b, "\\n");
        else if (*p == '\r') serve_buf_printf(b, "\\r");
        else if (*p == '\t') serve_buf_printf(b, "\\t");
        else if (*p < 0x20) serve_buf_printf(b, "\\x%02X", *p);
        else serve_buf_printf(b, "%c", *p);
    }
    serve_buf_printf(b, "\"");
}

/* A GBNF literal matching the compact JSON text of v. */
static void bput_json_lit(struct serve_buf *b, const json_t *v) {
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!t) {
        b->oom = true;
        return;
    }
    bput_lit(b, t);
    free(t);
}

/* ---------------------------------------------------------------------------------------- */
/* JSON schema -> GBNF                                                                       */

static const char GBNF_PRIMITIVES[] =
    "value ::= object | array | string | number | boolean | null\n"
    "object ::= \"{\" ( string \":\" value ( \",\" string \":\" value )* )? \"}\"\n"
    "array ::= \"[\" ( value ( \",\" value )* )? \"]\"\n"
    "string ::= \"\\\"\" char* \"\\\"\"\n"
    "char ::= [^\"\\\\\\x00-\\x1F\\x7F] | \"\\\\\" [\"\\\\bfnrt]\n"
    "integer ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n"
    "number ::= integer ( \".\" [0-9]+ )? ( [eE] [-+]? [0-9]+ )?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n"
    "date ::= [0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )\n"
    "time ::= ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,9} )? "
    "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )\n";

enum { SCHEMA_MAX_PROPS = 256, GBNF_MAX_BYTES = 1 << 20 };

struct gram {
    struct serve_buf rules; /* extra rules, one per line */
    int n_rules;
    int depth;
    int64_t work, max_work;   /* schema nodes expanded so far / allowed (--max-schema-nodes) */
    int32_t max_alt;          /* entries of one enum / anyOf / oneOf (--max-schema-alternatives) */
    const json_t *root;       /* the schema local $refs ("#/$defs/...", "#/definitions/...") resolve in */
    const json_t *ref_at[64]; /* the schemas $refs reached, each one rule (a recursive schema stays finite) */
    int ref_rule[64], n_refs;
    char msg[512]; /* why it failed */
    bool failed;
};

static void gfail(struct gram *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void gfail(struct gram *g, const char *fmt, ...) {
    if (g->failed) return;
    g->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->msg, sizeof g->msg, fmt, ap);
    va_end(ap);
}

static void schema_expr(struct gram *g, const json_t *sc, struct serve_buf *out);

/* JSON schema keywords that constrain a value and are not compiled into the grammar: a schema
** holding one is refused naming it (a reply that ignored it could break the client's schema). */
static const char *const SCHEMA_REFUSED[] = {
    "pattern",
    "patternProperties",
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "prefixItems",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "multipleOf",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "contentSchema",
};

enum { SCHEMA_MAX_REPEAT = 1024 }; /* minLength/maxLength/minItems/maxItems compiled: each repeat is grammar */

/* An optional non-negative integer keyword of sc into *v (-1 when absent); false (and the request
** refused) when present but not an integer in 0..SCHEMA_MAX_REPEAT. */
static bool count_kw(struct gram *g, const json_t *sc, const char *kw, long long *v) {
    const json_t *x = json_object_get(sc, kw);
    *v = -1;
    if (!x || json_is_null(x)) return true;
    if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > SCHEMA_MAX_REPEAT) {
        gfail(g, "'%s' must be an integer in 0..%d", kw, SCHEMA_MAX_REPEAT);
        return false;
    }
    *v = json_integer_value(x);
    return true;
}

/* "{m,n}" / "{m,}" after an element; lo >= 0, hi -1: unbounded */
static void bput_repeat(struct serve_buf *out, long long lo, long long hi) {
    if (hi < 0) serve_buf_printf(out, "{%lld,}", lo);
    else serve_buf_printf(out, "{%lld,%lld}", lo, hi);
}

/* The strings of a "format": RFC 3339's full-date, partial-time with an offset, and RFC 4122's uuid. */
static const char *format_expr(const char *fmt) {
    static const char *const F[][2] = {
        { "date", "\"\\\"\" date \"\\\"\"" },
        { "time", "\"\\\"\" time \"\\\"\"" },
        { "date-time", "\"\\\"\" date \"T\" time \"\\\"\"" },
        { "uuid",
          "\"\\\"\" [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{12} \"\\\"\"" },
    };
    for (size_t i = 0; i < sizeof F / sizeof F[0]; i++)
        if (!strcmp(fmt, F[i][0])) return F[i][1];
    return NULL;
}

static void string_expr(struct gram *g, const json_t *sc, struct serve_buf *out) {
    const json_t *f = json_object_get(sc, "format");
    long long lo, hi;
    if (!count_kw(g, sc, "minLength", &lo) || !count_kw(g, sc, "maxLength", &hi)) return;
    if (f && !json_is_null(f)) {
        const char *e = json_is_string(f) ? format_expr(json_string_value(f)) : NULL;
        if (!e) {
            gfail(g, "'format' '%.40s' is not supported in JSON schemas (date, time, date-time and uuid are)",
                  json_is_string(f) ? json_string_value(f) : "(not a string)");
            return;
        }
        if (lo >= 0 || hi >= 0) {
            gfail(g, "'minLength'/'maxLength' beside 'format' are not supported in JSON schemas");
            return;
        }
        serve_buf_printf(out, "%s", e);
        return;
    }
    if (lo < 0 && hi < 0) {
        serve_buf_printf(out, "string");
        return;
    }
    if (hi >= 0 && lo > hi) {
        gfail(g, "'minLength' %lld is above 'maxLength' %lld", lo, hi);
        return;
    }
    serve_buf_printf(out, "\"\\\"\" char");
    bput_repeat(out, lo < 0 ? 0 : lo, hi);
    serve_buf_printf(out, " \"\\\"\"");
}

/* integer / number with "minimum": 0 or 1 (a non-negative or positive integer part, the shapes
** generated for counts and ids); any other bound is refused naming it */
static void number_expr(struct gram *g, const json_t *sc, bool integer, struct serve_buf *out) {
    const json_t *mn = json_object_get(sc, "minimum"), *mx = json_object_get(sc, "maximum");
    if (mx && !json_is_null(mx)) {
        gfail(g, "'maximum' is not supported in JSON schemas");
        return;
    }
    if (!mn || json_is_null(mn)) {
        serve_buf_printf(out, integer ? "integer" : "number");
        return;
    }
    if (!json_is_number(mn) || (json_number_value(mn) != 0 && !(integer && json_number_value(mn) == 1))) {
        gfail(g, "'minimum' other than 0 (or 1 for an integer) is not supported in JSON schemas");
        return;
    }
    const char *digits = json_number_value(mn) == 1 ? "[1-9] [0-9]{0,15}" : "( \"0\" | [1-9] [0-9]{0,15} )";
    if (integer) serve_buf_printf(out, "%s", digits);
    else serve_buf_printf(out, "%s ( \".\" [0-9]+ )? ( [eE] [-+]? [0-9]+ )?", digits);
}

/* A local $ref, "#/$defs/NAME" or "#/definitions/NAME" (RFC 6901 escapes ~0 ~1), as one rule per
** target: a recursive schema refers to its own rule. */
static void ref_expr(struct gram *g, const json_t *ref, struct serve_buf *out) {
    const char *r = json_is_string(ref) ? json_string_value(ref) : "";
    const json_t *at = g->root;
    if (strncmp(r, "#/", 2) && strcmp(r, "#")) {
        gfail(g, "'$ref' '%.60s' is not supported in JSON schemas (local references '#/...' are)", r);
        return;
    }
    for (const char *p = r + 1; at && *p == '/';) {
        char part[128];
        size_t n = 0;
        for (p++; *p && *p != '/' && n + 1 < sizeof part; p++) {
            if (p[0] == '~' && (p[1] == '0' || p[1] == '1')) part[n++] = *++p == '0' ? '~' : '/';
            else part[n++] = *p;
        }
        part[n] = '\0';
        at = json_is_object(at) ? json_object_get(at, part) : NULL;
    }
    if (!at) {
        gfail(g, "'$ref' '%.60s' names nothing in the schema", r);
        return;
    }
    for (int i = 0; i < g->n_refs; i++)
        if (g->ref_at[i] == at) {
            serve_buf_printf(out, "r%d", g->ref_rule[i]);
            return;
        }
    if (g->n_refs == (int) (sizeof g->ref_at / sizeof g->ref_at[0])) {
        gfail(g, "the schema's '$ref's reach more than %d schemas", (int) (sizeof g->ref_at / sizeof g->ref_at[0]));
        return;
    }
    int id = g->n_rules++, k = g->n_refs++;
    g->ref_at[k] = at;
    g->ref_rule[k] = id;
    struct serve_buf body = { 0 };
    schema_expr(g, at, &body);
    serve_buf_printf(&g->rules, "r%d ::= %s\n", id, body.s ? body.s : "value");
    if (body.oom) g->rules.oom = true;
    free(body.s);
    serve_buf_printf(out, "r%d", id);
}


/* A new rule "rN ::= <expr of sc>"; writes its name into out. */
static void schema_rule(struct gram *g, const json_t *sc, struct serve_buf *out) {
    struct serve_buf body = { 0 };
    schema_expr(g, sc, &body);
    int id = g->n_rules++;
    serve_buf_printf(&g->rules, "r%d ::= %s\n", id, body.s ? body.s : "value");
    if (body.oom) g->rules.oom = true;
    free(body.s);
    serve_buf_printf(out, "r%d", id);
}

static void object_expr(struct gram *g, const json_t *sc, struct serve_buf *out) {
    const json_t *props = json_object_get(sc, "properties"), *req = json_object_get(sc, "required");
    if (!props || !json_is_object(props) || json_object_size(props) == 0) {
        const json_t *ap = json_object_get(sc, "additionalProperties");
        serve_buf_printf(out, ap && json_is_false(ap) ? "\"{}\"" : "object");
        return;
    }
    if (req && !json_is_array(req)) {
        gfail(g, "'required' must be an array of property names");
        return;
    }
    size_t n = json_object_size(props), i = 0;
    if (n > SCHEMA_MAX_PROPS) {
        gfail(g, "an object schema has %zu properties; at most %d", n, SCHEMA_MAX_PROPS);
        return;
    }
    size_t r;
    const json_t *rn;
    json_array_foreach(req, r, rn) if (!json_is_string(rn) || !json_object_get(props, json_string_value(rn))) {
        gfail(g, "'required' names '%.64s', which is not in 'properties'",
              json_is_string(rn) ? json_string_value(rn) : "(not a string)");
        return;
    }
    /* property i: "key":value as one rule name; required flag */
    char **kv = calloc(n, sizeof *kv);
    bool *must = calloc(n, sizeof *must);
    if (!kv || !must) {
        free(kv);
        free(must);
        out->oom = true;
        return;
    }
    const char *key;
    const json_t *ps;
    json_object_foreach((json_t *) props, key, ps) {
        if (g->failed) break;
        struct serve_buf one = { 0 };
        json_t *k = json_string(key);
        bput_json_lit(&one, k);
        json_decref(k);
        serve_buf_printf(&one, " \":\" ");
        schema_rule(g, ps, &one);
        kv[i] = one.s;
        if (one.oom) out->oom = true;
        json_array_foreach(req, r, rn) if (!strcmp(json_string_value(rn), key)) must[i] = true;
        i++;
    }
    int n_must = 0;
    for (i = 0; i < n; i++) n_must += must[i];
    serve_buf_printf(out, "\"{\" ");
    if (n_must > 0) { /* the required ones in order, each optional one after them, skippable */
        bool first = true;
        for (i = 0; i < n; i++)
            if (must[i]) {
                serve_buf_printf(out, "%s%s ", first ? "" : "\",\" ", kv[i]);
                first = false;
            }
        for (i = 0; i < n; i++)
            if (!must[i]) serve_buf_printf(out, "( \",\" %s )? ", kv[i]);
    } else { /* all optional: the first present one, then any later ones in order, through one
             ** rule per suffix, tail_i ::= ( "," kv_i )? tail_i+1, so the grammar stays linear */
        int *tail = calloc(n + 1, sizeof *tail);
        if (!tail) out->oom = true;
        for (size_t k = n; tail && k-- > 1;) {
            tail[k] = g->n_rules++;
            if (k + 1 < n) serve_buf_printf(&g->rules, "r%d ::= ( \",\" %s )? r%d\n", tail[k], kv[k], tail[k + 1]);
            else serve_buf_printf(&g->rules, "r%d ::= ( \",\" %s )?\n", tail[k], kv[k]);
        }
        serve_buf_printf(out, "( ");
        for (i = 0; tail && i < n; i++) {
            serve_buf_printf(out, "%s%s", i ? " | " : "", kv[i]);
            if (i + 1 < n) serve_buf_printf(out, " r%d", tail[i + 1]);
        }
        serve_buf_printf(out, " )? ");
        free(tail);
    }
    serve_buf_printf(out, "\"}\"");
    for (i = 0; i < n; i++) free(kv[i]);
    free(kv);
    free(must);
}

static void type_expr(struct gram *g, const json_t *sc, const char *type, struct serve_buf *out) {
    if (!strcmp(type, "string")) string_expr(g, sc, out);
    else if (!strcmp(type, "integer")) number_expr(g, sc, true, out);
    else if (!strcmp(type, "number")) number_expr(g, sc, false, out);
    else if (!strcmp(type, "boolean")) serve_buf_printf(out, "boolean");
    else if (!strcmp(type, "null")) serve_buf_printf(out, "null");
    else if (!strcmp(type, "object")) object_expr(g, sc, out);
    else if (!strcmp(type, "array")) {
        const json_t *items = json_object_get(sc, "items");
        long long lo, hi;
        if (!count_kw(g, sc, "minItems", &lo) || !count_kw(g, sc, "maxItems", &hi)) return;
        if (hi >= 0 && lo > hi) {
            gfail(g, "'minItems' %lld is above 'maxItems' %lld", lo, hi);
            return;
        }
        struct serve_buf item = { 0 };
        if (items && json_is_object(items)) schema_rule(g, items, &item);
        else serve_buf_printf(&item, "value");
        const char *it = item.s ? item.s : "value";
        if (hi == 0) serve_buf_printf(out, "\"[\" \"]\"");
        else { /* the first item, then the rest: {lo-1, hi-1} more; optional as a whole when lo is 0 */ bool nonempty = lo >= 1;
            serve_buf_printf(out, "\"[\" %s%s ( \",\" %s )", nonempty ? "" : "( ", it, it);
            if (lo <= 1 && hi < 0) serve_buf_printf(out, "*");
            else bput_repeat(out, lo >= 1 ? lo - 1 : 0, hi < 0 ? -1 : hi - 1);
            serve_buf_printf(out, "%s \"]\"", nonempty ? "" : " )?");
        }
        if (item.oom) out->oom = true;
        free(item.s);
    } else gfail(g, "unknown JSON schema type '%.40s'", type);
}

static void schema_expr(struct gram *g, const json_t *sc, struct serve_buf *out) {
    if (g->failed) return;
    /* bounded work before any error: every node expanded counts (a node reached twice counts
    ** twice), and the grammar's size is checked as it grows, not once it is built */
    if (++g->work > g->max_work) {
        gfail(g, "the JSON schemas expand to more than %lld nodes (--max-schema-nodes)", (long long) g->max_work);
        return;
    }
    if (g->rules.n + out->n > GBNF_MAX_BYTES) {
        gfail(g, "the schemas make a grammar of more than %d bytes", GBNF_MAX_BYTES);
        return;
    }
    if (++g->depth > 32) {
        gfail(g, "the JSON schema nests deeper than 32 levels");
        g->depth--;
        return;
    }
    const json_t *v;
    for (size_t i = 0; json_is_object(sc) && i < sizeof SCHEMA_REFUSED / sizeof SCHEMA_REFUSED[0]; i++)
        if (json_object_get(sc, SCHEMA_REFUSED[i])) {
            gfail(g, "'%s' is not supported in JSON schemas (it is not compiled into the grammar)", SCHEMA_REFUSED[i]);
            g->depth--;
            return;
        }
    const json_t *all = json_is_object(sc) ? json_object_get(sc, "allOf") : NULL;
    size_t n_notes = (size_t) !!json_object_get(sc, "description") + !!json_object_get(sc, "title") +
                     !!json_object_get(sc, "default");
    if (all && !(json_is_array(all) && json_array_size(all) == 1 && json_object_size(sc) == 1 + n_notes)) {
        gfail(g, "'allOf' is supported in JSON schemas only as one schema alone (as generators write a $ref)");
        g->depth--;
        return;
    }
    if (all) schema_expr(g, json_array_get(all, 0), out);
    else if (json_is_object(sc) && (v = json_object_get(sc, "$ref"))) ref_expr(g, v, out);
    else if (json_is_true(sc) || (json_is_object(sc) && json_object_size(sc) == 0)) serve_buf_printf(out, "value");
    else if (!json_is_object(sc)) gfail(g, "a JSON schema must be an object, got %s", json_is_array(sc) ? "an array" : "a scalar");
    else if ((v = json_object_get(sc, "const"))) bput_json_lit(out, v);
    else if ((v = json_object_get(sc, "enum"))) {
        if (!json_is_array(v) || json_array_size(v) == 0) gfail(g, "'enum' must be a non-empty array");
        else if (json_array_size(v) > (size_t) g->max_alt)
            gfail(g, "'enum' has %zu values; at most %d (--max-schema-alternatives)", json_array_size(v), g->max_alt);
        size_t i;
        const json_t *x;
        serve_buf_printf(out, "( ");
        json_array_foreach(v, i, x) {
            if (g->failed) break;
            if (i) serve_buf_printf(out, " | ");
            bput_json_lit(out, x);
        }
        serve_buf_printf(out, " )");
    } else if ((v = json_object_get(sc, "anyOf")) || (v = json_object_get(sc, "oneOf"))) {
        if (!json_is_array(v) || json_array_size(v) == 0) gfail(g, "'anyOf'/'oneOf' must be a non-empty array");
        else if (json_array_size(v) > (size_t) g->max_alt)
            gfail(g, "'anyOf'/'oneOf' has %zu schemas; at most %d (--max-schema-alternatives)", json_array_size(v), g->max_alt);
        size_t i;
        const json_t *x;
        serve_buf_printf(out, "( ");
        json_array_foreach(v, i, x) {
            if (g->failed) break;
            if (i) serve_buf_printf(out, " | ");
            schema_rule(g, x, out);
        }
        serve_buf_printf(out, " )");
    } else if ((v = json_object_get(sc, "type"))) {
        if (json_is_string(v)) type_expr(g, sc, json_string_value(v), out);
        else if (json_is_array(v) && json_array_size(v) > 8)
            gfail(g, "'type' lists %zu types; JSON schema has 7", json_array_size(v));
        else if (json_is_array(v) && json_array_size(v) > 0) {
            size_t i, k;
            const json_t *t;
            serve_buf_printf(out, "( ");
            json_array_foreach(v, i, t) {
                if (!json_is_string(t)) {
                    gfail(g, "'type' lists must hold strings");
                    break;
                }
                if (g->failed) break;
                /* each type once: ["object","object"] nested 31 deep would otherwise expand the
                ** same properties 2^31 times (issue #24) */
                for (k = 0; k < i && strcmp(json_string_value(json_array_get(v, k)), json_string_value(t)); k++) {}
                if (k < i) continue;
                if (i) serve_buf_printf(out, " | ");
                type_expr(g, sc, json_string_value(t), out);
            }
            serve_buf_printf(out, " )");
        } else gfail(g, "'type' must be a string or a non-empty array of strings");
    } else if (json_object_get(sc, "properties")) object_expr(g, sc, out);
    else serve_buf_printf(out, "value"); /* annotations only (title, description, default, ...): any JSON value */
    g->depth--;
}

/* ---------------------------------------------------------------------------------------- */
/* request                                                                                   */

/* root ::= the grammar of JSON schema sc; a 400 naming field when the schema cannot be translated. */
static int schema_root(struct gram *g, const json_t *sc, struct serve_buf *root_rule, const char *field, struct serve_error *e) {
    serve_buf_printf(root_rule, "root ::= ");
    g->root = sc;
    schema_expr(g, sc, root_rule);
    serve_buf_printf(root_rule, "\n");
    if (!g->failed) return 0;
    serve_bad(e, "'%s': %s", field, g->msg);
    return -1;
}

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
            bput_lit(&calls, lit.s ? lit.s : "");
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
