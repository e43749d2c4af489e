/* schema.h — JSON schema to GBNF (server/schema.c), for server/tools.c. */
#ifndef KVT_SERVER_SCHEMA_H
#define KVT_SERVER_SCHEMA_H

#include "serve.h"

enum { SCHEMA_MAX_PROPS = 256, GBNF_MAX_BYTES = 1 << 20 };

/* A schema's translation: the rules it needs beyond the one it was asked for, and its budget. */
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

/* The rules every translation may use (JSON's strings, numbers, values): appended once. */
extern const char GBNF_PRIMITIVES[];
/* A GBNF string literal matching exactly the bytes of s, appended to b. */
void schema_lit(struct serve_buf *b, const char *s);
/* The expression of schema sc appended to out, as one rule of g (g->root: where $refs resolve);
** g->failed and g->msg say why a schema cannot be translated. */
void schema_rule(struct gram *g, const json_t *sc, struct serve_buf *out);
/* "root ::= " the grammar of sc, into root_rule; 0, or -1 with a 400 naming field in e. */
int schema_root(struct gram *g, const json_t *sc, struct serve_buf *root_rule, const char *field, struct serve_error *e);

#endif
