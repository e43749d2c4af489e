/* fuzz_server.h — the server configuration the request harnesses parse under: `kvtier serve`'s
** default caps (struct serve_limits, cli/cmd_serve.c), no engine (nothing is tokenized). */
#ifndef KVT_FUZZ_SERVER_H
#define KVT_FUZZ_SERVER_H
#include "serve.h"

#include <stdio.h>

static inline void fuzz_server_defaults(struct server *srv) {
    srv->n_ctx = 4096;
    srv->max_tokens_default = 16;
    srv->temp_default = 1.0f;
    srv->top_p_default = 1.0f;
    srv->repeat_penalty_default = 1.0f; /* the server flags' defaults (cli/cmd_serve.c) */
    srv->repeat_last_n_default = 64;
    srv->seed_default = -1;
    snprintf(srv->model_name, sizeof srv->model_name, "fuzz");
    srv->budget = 512;
    srv->max_sessions = 4; /* --parallel 2 with its parked sessions: GET /slots lists 0 .. 3 */
    srv->max_responses = 64;
    srv->responses_per_key = 64;
    srv->lim = (struct serve_limits){ .max_body = 8 << 20,
                                      .max_messages = 4096,
                                      .max_parts = 1024,
                                      .max_tools = 128,
                                      .max_schema_nodes = 10000,
                                      .max_alternatives = 1024 };
}
#endif
