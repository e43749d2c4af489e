/* schema.c — JSON schema to GBNF for `kvtier serve`'s structured output and tool arguments
** (server/tools.c), the grammar llama.cpp's grammar sampler (kvt_grammar) constrains a reply with.
**
** The JSON schema subset turned into grammar: type (string, number, integer, boolean, null, array
** with items, minItems/maxItems, object with properties/required/additionalProperties, a list of
** types), enum, const, anyOf/oneOf, allOf of one schema, string minLength/maxLength (at most 1024)
** and format (date, time, date-time, uuid), integer minimum 0 or 1, local $ref into $defs or
** definitions (recursive schemas stay finite: one rule per schema reached, at most 64).  Any other
** keyword that constrains a value (pattern, maximum, not, ...) is refused with a 400 naming it,
** never taken as "any value".  Objects are generated with their properties in schema order,
** required ones always, optional ones in order and skippable (at most 256 properties an object,
** 1 MiB of grammar in all).  No whitespace and no \u escapes are generated (non-ASCII text is raw
** UTF-8): the reply is canonical JSON, so a client echoing it back matches the session's tokens. */
#include "schema.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------- */
/* a growing string                                                                          */

/* A GBNF string literal matching exactly the bytes of s. */
void schema_lit(struct serve_buf *b, const char *s) {
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
    schema_lit(b, t);
    free(t);
}

/* ---------------------------------------------------------------------------------------- */
/* JSON schema -> GBNF                                                                       */

const char GBNF_PRIMITIVES[] =
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
void schema_rule(struct gram *g, const json_t *sc, struct serve_buf *out) {
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
int schema_root(struct gram *g, const json_t *sc, struct serve_buf *root_rule, const char *field, struct serve_error *e) {
    serve_buf_printf(root_rule, "root ::= ");
    g->root = sc;
    schema_expr(g, sc, root_rule);
    serve_buf_printf(root_rule, "\n");
    if (!g->failed) return 0;
    serve_bad(e, "'%s': %s", field, g->msg);
    return -1;
}
