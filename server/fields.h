/* fields.h — the request fields of every API kvtier serve speaks, as tables: each field's JSON
** types and what kvtier does with it (honoured; accepted only at the value that leaves the reply
** unchanged; refused; accepted with no effect by design, and why).  The parsers check a request
** against its API's table before they read it, so a field is never accepted and silently ignored
** (a field no specification names is ignored as llama-server does, and listed back to the client
** in usage.kvtier.ignored_fields).  docs/API.md is printed from these tables (`kvtier serve
** --print-api`), so the documentation is the code. */
#ifndef KVT_SERVER_FIELDS_H
#define KVT_SERVER_FIELDS_H

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>

struct serve_error;

/* The APIs (a bitmask in a field's row: the specifications that name the field). */
enum {
    FIELD_API_CHAT = 1,        /* OpenAI Chat Completions, POST /v1/chat/completions */
    FIELD_API_COMPLETIONS = 2, /* OpenAI Completions (legacy), POST /v1/completions */
    FIELD_API_NATIVE = 4,      /* llama-server's POST /completion and its extensions on the OpenAI routes */
    FIELD_API_RESPONSES = 8,   /* OpenAI Responses, POST /v1/responses */
    FIELD_API_ANTHROPIC = 16,  /* Anthropic Messages, POST /v1/messages */
};

/* The JSON types a field may have (a bitmask; null always means "absent"). */
enum {
    FT_BOOL = 1,
    FT_INT = 2,
    FT_NUM = 4 | 2, /* a number, integer or real */
    FT_STR = 8,
    FT_ARR = 16,
    FT_OBJ = 32,
};

enum field_status {
    FIELD_HONOURED,  /* applied: the reply follows it */
    FIELD_NEUTRAL,   /* not implemented: accepted only at a value that leaves the reply unchanged */
    FIELD_REFUSED,   /* not implemented: any value but null is a 400 naming it */
    FIELD_NO_EFFECT, /* accepted; no effect on the reply by design (the note says why) */
};

struct serve_field {
    const char *name;
    unsigned types; /* FT_* */
    unsigned apis;  /* FIELD_API_*: the specifications that name it */
    enum field_status status;
    const char *neutral; /* FIELD_NEUTRAL: the values (JSON, '|' between) that leave the reply unchanged */
    const char *note;    /* what kvtier does with it, or why it refuses it / why it has no effect */
};

/* The tables: the OpenAI routes and llama-server's native routes share one parser (request.c),
** so one table (FIELD_TABLE_OPENAI); Responses and Anthropic are translated to it. */
enum field_table { FIELD_TABLE_OPENAI, FIELD_TABLE_RESPONSES, FIELD_TABLE_ANTHROPIC, FIELD_N_TABLES };

/* The rows of table t, *n of them.  Static; never freed. */
const struct serve_field *serve_fields(enum field_table t, size_t *n);

/* Check the top-level fields of request object `root` against table t, before any is read: a
** field of a wrong type, a refused field, or a neutral one at another value is a 400 in e
** naming it (returns -1).  The names of the fields no table row names are appended to *ignored
** (created on the first, at most 16 names, each cut to 63 printable bytes; the caller owns it)
** and logged once per name on stderr.  Returns 0 when the request may be read.  Thread-safe. */
int serve_fields_check(enum field_table t, const json_t *root, json_t **ignored, struct serve_error *e);

/* docs/API.md: the routes and every table as Markdown on f. */
void serve_fields_print_md(FILE *f);

#endif
