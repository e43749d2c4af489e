/* fields.c — the request-field tables of the five APIs and the one check that reads them
** (fields.h).  A row is the field's contract: a parser never reads a field that has no row, and
** a field with a row is never accepted and ignored unless its note says why that is by design. */
#include "fields.h"

#include "serve.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#define C FIELD_API_CHAT
#define P FIELD_API_COMPLETIONS
#define N FIELD_API_NATIVE
#define R FIELD_API_RESPONSES
#define A FIELD_API_ANTHROPIC
#define H FIELD_HONOURED
#define Z FIELD_NEUTRAL
#define X FIELD_REFUSED
#define E FIELD_NO_EFFECT

/* clang-format off */
static const struct serve_field OPENAI[] = {
    { "model",                 FT_STR,          C|P|N, E, NULL, "one model per server: any name is accepted (GET /v1/models lists it)" },
    { "messages",              FT_ARR,          C,     H, NULL, "the conversation; a session holds its KV between requests" },
    { "prompt",                FT_STR|FT_ARR|FT_OBJ, P|N, H, NULL, "one prompt: text, token ids, or ids and text mixed; several prompts: llama-server's native batch" },
    { "max_tokens",            FT_INT,          C|P|N, H, NULL, "tokens generated at most" },
    { "max_completion_tokens", FT_INT,          C,     H, NULL, "as max_tokens" },
    { "n_predict",             FT_INT,          N,     H, NULL, "as max_tokens; -1 or absent: the server's -n / --max-tokens, or with neither given, what the prompt leaves of the budget" },
    { "temperature",           FT_NUM,          C|P|N, H, NULL, "0: greedy" },
    { "top_p",                 FT_NUM,          C|P|N, H, NULL, "nucleus sampling" },
    { "top_k",                 FT_INT,          N,     H, NULL, "sampling among the k most likely" },
    { "min_p",                 FT_NUM,          N,     H, NULL, "sampling among tokens at least min_p times the most likely's probability" },
    { "seed",                  FT_INT,          C|P|N, H, NULL, "a seeded reply is the same alone or batched (each generation draws from its own generator, seeded as a llama-server slot's)" },
    { "n",                     FT_INT,          C|P,   H, NULL, "choices per request" },
    { "stop",                  FT_STR|FT_ARR,   C|P|N, H, NULL, "stop strings (up to 4)" },
    { "stream",                FT_BOOL,         C|P|N, H, NULL, "server-sent events" },
    { "stream_options",        FT_OBJ,          C|P,   H, NULL, "include_usage" },
    { "logprobs",              FT_BOOL|FT_INT,  C|P,   H, NULL, "chat: true/false; completions' integer form: 0 only (send top_logprobs)" },
    { "top_logprobs",          FT_INT,          C|P,   H, NULL, "0..20 alternatives a token" },
    { "n_probs",               FT_INT,          N,     H, NULL, "0..100 alternatives a token" },
    { "post_sampling_probs",   FT_BOOL,         N,     H, NULL, "probabilities after the sampler chain" },
    { "return_tokens",         FT_BOOL,         N,     H, NULL, "the generated token ids" },
    { "tools",                 FT_ARR,          C,     H, NULL, "function tools; the call is constrained by a grammar" },
    { "tool_choice",           FT_STR|FT_OBJ,   C,     H, NULL, "auto, none, required or one function" },
    { "parallel_tool_calls",   FT_BOOL,         C,     H, NULL, "several calls in one reply" },
    { "functions",             FT_ARR,          C,     X, NULL, "the deprecated function-calling API: send tools" },
    { "function_call",         FT_STR|FT_OBJ,   C,     X, NULL, "the deprecated function-calling API: send tool_choice" },
    { "response_format",       FT_OBJ,          C,     H, NULL, "text, json_object or json_schema (compiled to a grammar; a schema keyword not compiled is a 400 naming it)" },
    { "json_schema",           FT_OBJ,          N,     H, NULL, "a JSON schema (compiled to a grammar; a keyword not compiled is a 400 naming it)" },
    { "grammar",               FT_STR,          N,     H, NULL, "a GBNF grammar" },
    { "logit_bias",            FT_OBJ|FT_ARR,   C|P|N, H, NULL, "token ids (or, in llama-server's pair form, text) to bias or ban" },
    { "cache_prompt",          FT_BOOL,         N,     H, NULL, "false: the prompt is prefilled whole, no cached blocks used" },
    { "timings_per_token",     FT_BOOL,         N,     H, NULL, "llama-server's timings in each event" },
    { "return_progress",       FT_BOOL,         N,     H, NULL, "prefill progress events" },
    { "verbose",               FT_BOOL,         N,     H, NULL, "the prompt and settings in the reply" },
    { "continue_final_message",FT_BOOL,         C,     H, NULL, "vLLM's: continue the final assistant message" },
    { "add_generation_prompt", FT_BOOL,         C,     H, NULL, "false: continue the final assistant message" },
    { "user",                  FT_STR,          C|P,   E, NULL, "an end-user id for the caller's own records; kvtier's tenants are API keys" },
    { "metadata",              FT_OBJ,          C,     E, NULL, "tags for stored completions, which kvtier does not list" },
    { "safety_identifier",     FT_STR,          C,     E, NULL, "an end-user id for abuse detection; kvtier runs none" },
    { "prompt_cache_key",      FT_STR,          C,     E, NULL, "kvtier finds cached prompts by their content (block keys), with or without it" },
    { "service_tier",          FT_STR,          C,     E, NULL, "one tier: every request is served the same way" },
    { "prediction",            FT_OBJ,          C,     E, NULL, "a speculative-decoding hint: the reply is the same without it" },
    { "backend_sampling",      FT_BOOL,         N,     E, NULL, "kvtier samples on the host either way, with the same result" },
    { "id_slot",               FT_INT,          N,     H, NULL, "N >= 0 without X-Session-Id: the session \"slot-N\" (its KV kept between the requests naming it, as slot N's); -1: chosen by prefix" },
    { "store",                 FT_BOOL,         C,     Z, "false", "stored chat completions cannot be listed here: use /v1/responses (store true) for state kept by the server" },
    { "ignore_eos",            FT_BOOL,         N,     Z, "false", "it would change the reply" },
    { "frequency_penalty",     FT_NUM,          C|P|N, H, NULL, "-2..2 (default: --frequency-penalty, 0): a token's logit minus this times its count in the last repeat_last_n tokens of prompt and reply (llama.cpp's penalties sampler)" },
    { "presence_penalty",      FT_NUM,          C|P|N, H, NULL, "-2..2 (default: --presence-penalty, 0): minus this once for a token in that window" },
    { "repeat_penalty",        FT_NUM,          C|P|N, H, NULL, "(0, 10], 1 = off (default: --repeat-penalty, 1): a token in that window has its logit divided by it (multiplied when negative)" },
    { "repeat_last_n",         FT_INT,          C|P|N, H, NULL, "the penalties' window in tokens (default: --repeat-last-n, 64; -1: the context; 0: no penalty)" },
    { "typical_p",             FT_NUM,          N,     H, NULL, "(0, 1], 1 = off (default: --typical): locally typical sampling (llama.cpp's typical sampler, after top_k; applies at temperature 0 too)" },
    { "mirostat",              FT_INT,          N,     H, NULL, "0 (off), 1 or 2 (default: --mirostat): Mirostat 1.0 / 2.0 (llama.cpp's; its generator and mu per generation), after logit_bias and the temperature in place of the other samplers and the penalties, as llama-server runs it; greedy at temperature 0" },
    { "mirostat_tau",          FT_NUM,          N,     H, NULL, "(0, 100] (default: --mirostat-ent, 5): Mirostat's target surprise in bits" },
    { "mirostat_eta",          FT_NUM,          N,     H, NULL, "(0, 10] (default: --mirostat-lr, 0.1): Mirostat's learning rate" },
    { "dry_multiplier",        FT_NUM,          N,     H, NULL, "0..100, 0 = off (default: --dry-multiplier): DRY, a token that would extend a repeat of the last dry_penalty_last_n tokens of prompt and reply past dry_allowed_length has its logit lowered by dry_multiplier x dry_base ^ (length - allowed) (llama.cpp's DRY, after the penalties; not with mirostat)" },
    { "dry_base",              FT_NUM,          N,     H, NULL, "1..10 (default: --dry-base, 1.75)" },
    { "dry_allowed_length",    FT_INT,          N,     H, NULL, "0..n_ctx (default: --dry-allowed-length, 2): repeats up to this length go free" },
    { "dry_penalty_last_n",    FT_INT,          N,     H, NULL, "-1..n_ctx (default: --dry-penalty-last-n, 64, llama-server's; -1: the context, which llama-server refuses; 0: no DRY): the tokens DRY scans" },
    { "dry_sequence_breakers", FT_ARR,          N,     H, NULL, "1..16 strings of 1..40 bytes, 128 in all (default: llama-server's [\"\\n\", \":\", \"\\\"\", \"*\"]): a token holding one ends a repeat (llama.cpp's DRY maps them over the vocabulary)" },
    { "xtc_probability",       FT_NUM,          N,     H, NULL, "0..1, 0 = off (default: --xtc-probability): the chance that a draw drops every token of probability >= xtc_threshold but the least likely of them (llama.cpp's XTC, after min_p; a generator per generation, seeded by seed; applies at temperature 0 too)" },
    { "xtc_threshold",         FT_NUM,          N,     H, NULL, "0..1, above 0.5 = off (default: --xtc-threshold, 0.1)" },
    { "top_n_sigma",           FT_NUM,          N,     H, NULL, "-1..100, -1 or 0 = off (default: --top-nsigma): sampling among the logits within n standard deviations of the largest (llama.cpp's top-n-sigma, before top_k)" },
    { "dynatemp_range",        FT_NUM,          N,     H, NULL, "0..2, 0 = off (default: --dynatemp-range): the temperature within +-range by the distribution's entropy (llama.cpp's temp_ext); a 400 with temperature 0 (greedy; the server's --dynatemp-range does not apply there)" },
    { "dynatemp_exponent",     FT_NUM,          N,     H, NULL, "(0, 10] (default: --dynatemp-exp, 1): the entropy's exponent in the dynamic temperature" },
    { "min_keep",              FT_INT,          N,     Z, "0|1", "the samplers keep one token at least" },
    { "n_keep",                FT_INT,          N,     Z, "0|-1", "kvtier never shifts the context: evicted blocks go to the store and come back" },
    { "n_indent",              FT_INT,          N,     Z, "0", "indentation stops are not implemented" },
    { "t_max_predict_ms",      FT_INT,          N,     Z, "0", "a time limit on generation is not implemented (use max_tokens; the server's --request-timeout-s)" },
    { "samplers",              FT_STR|FT_ARR,   N,     Z, "\"edkypmxt\"|\"kpmt\"|[\"penalties\",\"dry\",\"top_n_sigma\",\"top_k\",\"typ_p\",\"top_p\",\"min_p\",\"xtc\",\"temperature\"]|[\"dry\",\"top_k\",\"typ_p\",\"top_p\",\"min_p\",\"xtc\",\"temperature\"]|[\"top_k\",\"top_p\",\"min_p\",\"temperature\"]",
      "kvtier's chain is llama-server's default order (penalties, dry, top_n_sigma, top_k, typical_p, top_p, min_p, xtc, temperature): another order is not implemented" },
    { "lora",                  FT_ARR,          N,     Z, "[]", "LoRA adapters are not served" },
    { "chat_template_kwargs",  FT_OBJ,          C|N,   Z, "{}", "the model's own template is applied without extra arguments" },
    { "reasoning_format",      FT_STR,          C|N,   Z, "\"none\"", "the reply is not split into reasoning and content" },
    { "echo",                  FT_BOOL,         P,     Z, "false", "the prompt is not echoed back" },
    { "best_of",               FT_INT,          P,     Z, "1", "best-of sampling is not implemented (n is)" },
    { "suffix",                FT_STR,          P,     Z, "\"\"", "insertion (fill in the middle) is not implemented" },
    { "modalities",            FT_ARR,          C,     Z, "[\"text\"]", "kvtier serves text" },
    { "reasoning_effort",      FT_STR,          C,     X, NULL, "kvtier's models do not reason apart" },
    { "verbosity",             FT_STR,          C,     X, NULL, "not implemented (it would change the reply)" },
    { "audio",                 FT_OBJ,          C,     X, NULL, "kvtier serves text" },
    { "web_search_options",    FT_OBJ,          C,     X, NULL, "kvtier searches nothing" },
    { "response_fields",       FT_ARR,          N,     H, NULL, "unstreamed: only these fields of the reply, \"a/b\" a nested one (named \"a/b\"), as llama-server; streamed: refused" },
    { "session",               FT_STR,          N,     X, NULL, "send the session in the X-Session-Id header" },
    { "session_id",            FT_STR,          N,     X, NULL, "send the session in the X-Session-Id header" },
};

static const struct serve_field RESPONSES[] = {
    { "model",                 FT_STR,          R, E, NULL, "one model per server: any name is accepted" },
    { "input",                 FT_STR|FT_ARR,   R, H, NULL, "text, or message, function_call and function_call_output items" },
    { "instructions",          FT_STR,          R, H, NULL, "the system message (not carried to the next response)" },
    { "previous_response_id",  FT_STR,          R, H, NULL, "continue a stored response; its session's KV is reused" },
    { "max_output_tokens",     FT_INT,          R, H, NULL, "tokens generated at most" },
    { "temperature",           FT_NUM,          R, H, NULL, "0: greedy" },
    { "top_p",                 FT_NUM,          R, H, NULL, "nucleus sampling" },
    { "stream",                FT_BOOL,         R, H, NULL, "the Responses events" },
    { "store",                 FT_BOOL,         R, H, NULL, "keep the response for previous_response_id and GET (default true)" },
    { "tools",                 FT_ARR,          R, H, NULL, "function tools" },
    { "tool_choice",           FT_STR|FT_OBJ,   R, H, NULL, "auto, none, required or one function" },
    { "parallel_tool_calls",   FT_BOOL,         R, H, NULL, "several calls in one reply" },
    { "text",                  FT_OBJ,          R, H, NULL, "format: text, json_object or json_schema; verbosity: medium only" },
    { "reasoning",             FT_OBJ,          R, H, NULL, "effort: refused (kvtier's models do not reason apart); summary: no effect (no reasoning to summarise)" },
    { "timings_per_token",     FT_BOOL,         R, H, NULL, "llama-server's timings" },
    { "return_progress",       FT_BOOL,         R, H, NULL, "prefill progress" },
    { "metadata",              FT_OBJ,          R, E, NULL, "tags for the caller's records; stored with nothing else" },
    { "user",                  FT_STR,          R, E, NULL, "an end-user id for the caller's records; kvtier's tenants are API keys" },
    { "safety_identifier",     FT_STR,          R, E, NULL, "an end-user id for abuse detection; kvtier runs none" },
    { "prompt_cache_key",      FT_STR,          R, E, NULL, "kvtier finds cached prompts by their content (block keys)" },
    { "service_tier",          FT_STR,          R, E, NULL, "one tier" },
    { "truncation",            FT_STR,          R, E, NULL, "kvtier never drops input items: a long conversation's KV is evicted to the store and recalled" },
    { "stream_options",        FT_OBJ,          R, E, NULL, "include_obfuscation: the events carry no padding either way" },
    { "background",            FT_BOOL,         R, Z, "false", "send the request and wait (or stream)" },
    { "include",               FT_ARR,          R, Z, "[]", "no extra output data is produced" },
    { "top_logprobs",          FT_INT,          R, Z, "0", "log-probabilities are served on the chat and completion routes" },
    { "max_tool_calls",        FT_INT,          R, X, NULL, "not implemented" },
    { "conversation",          FT_STR|FT_OBJ,   R, X, NULL, "conversations are not implemented: use previous_response_id" },
    { "prompt",                FT_OBJ,          R, X, NULL, "stored prompt templates are not implemented" },
};

static const struct serve_field ANTHROPIC[] = {
    { "model",                 FT_STR,          A, E, NULL, "one model per server: any name is accepted" },
    { "messages",              FT_ARR,          A, H, NULL, "text, tool_use and tool_result blocks" },
    { "system",                FT_STR|FT_ARR,   A, H, NULL, "the system prompt" },
    { "max_tokens",            FT_INT,          A, H, NULL, "tokens generated at most" },
    { "stop_sequences",        FT_ARR,          A, H, NULL, "stop strings" },
    { "temperature",           FT_NUM,          A, H, NULL, "0: greedy" },
    { "top_p",                 FT_NUM,          A, H, NULL, "nucleus sampling" },
    { "top_k",                 FT_INT,          A, H, NULL, "sampling among the k most likely" },
    { "stream",                FT_BOOL,         A, H, NULL, "Anthropic's events" },
    { "tools",                 FT_ARR,          A, H, NULL, "tools; the call is constrained by a grammar" },
    { "tool_choice",           FT_OBJ,          A, H, NULL, "auto, any, tool or none" },
    { "metadata",              FT_OBJ,          A, E, NULL, "user_id for the caller's records; kvtier's tenants are API keys" },
    { "service_tier",          FT_STR,          A, E, NULL, "one tier" },
    { "thinking",              FT_OBJ,          A, E, NULL, "the models kvtier serves do not think apart: the reply has no thinking block either way (as llama-server's with such a model)" },
    { "output_config",         FT_OBJ,          A, Z, "{}|{\"format\":null}", "structured output is served on /v1/chat/completions (response_format)" },
    { "container",             FT_STR|FT_OBJ,   A, X, NULL, "code execution containers are not implemented" },
    { "mcp_servers",           FT_ARR,          A, X, NULL, "MCP servers are not called" },
    { "context_management",    FT_OBJ,          A, X, NULL, "kvtier manages context itself (eviction to the store): not configurable per request" },
};
/* clang-format on */

#undef C
#undef P
#undef N
#undef R
#undef A
#undef H
#undef Z
#undef X
#undef E

static const struct {
    const struct serve_field *rows;
    size_t n;
    const char *title;
} TABLES[FIELD_N_TABLES] = {
    { OPENAI, sizeof OPENAI / sizeof OPENAI[0], "OpenAI Chat Completions and Completions, llama-server's /completion" },
    { RESPONSES, sizeof RESPONSES / sizeof RESPONSES[0], "OpenAI Responses" },
    { ANTHROPIC, sizeof ANTHROPIC / sizeof ANTHROPIC[0], "Anthropic Messages" },
};

const struct serve_field *serve_fields(enum field_table t, size_t *n) {
    *n = TABLES[t].n;
    return TABLES[t].rows;
}

static const struct serve_field *find(enum field_table t, const char *name) {
    for (size_t i = 0; i < TABLES[t].n; i++)
        if (!strcmp(TABLES[t].rows[i].name, name)) return &TABLES[t].rows[i];
    return NULL;
}

static const char *type_names(unsigned types, char *buf, size_t cap) {
    static const struct {
        unsigned bit;
        const char *name;
    } T[] = { { FT_BOOL, "a boolean" }, { FT_NUM, "a number" }, { FT_INT, "an integer" },
              { FT_STR, "a string" },   { FT_ARR, "an array" }, { FT_OBJ, "an object" } };
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++) {
        if ((types & T[i].bit) != T[i].bit || (T[i].bit == FT_INT && (types & FT_NUM) == FT_NUM)) continue;
        int w = snprintf(buf + at, cap - at, "%s%s", at ? " or " : "", T[i].name);
        if (w < 0 || (size_t) w >= cap - at) break;
        at += (size_t) w;
    }
    return buf;
}

static bool type_ok(unsigned types, const json_t *v) {
    switch (json_typeof(v)) {
        case JSON_TRUE:
        case JSON_FALSE: return types & FT_BOOL;
        case JSON_INTEGER: return types & FT_INT;
        case JSON_REAL: return (types & FT_NUM) == FT_NUM;
        case JSON_STRING: return types & FT_STR;
        case JSON_ARRAY: return types & FT_ARR;
        case JSON_OBJECT: return types & FT_OBJ;
        default: return true;
    }
}

/* v equal to a neutral value: numbers by value (1 and 1.0 alike), the rest by json_equal */
static bool same_value(const json_t *v, const json_t *n) {
    if (json_is_number(v) && json_is_number(n)) return json_number_value(v) == json_number_value(n);
    return json_equal((json_t *) v, (json_t *) n);
}

static bool is_neutral(const struct serve_field *f, const json_t *v) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", f->neutral);
    bool ok = false;
    /* '|' separates the values (no neutral value holds one) */
    for (char *s = buf, *bar; s && !ok; s = bar ? bar + 1 : NULL) {
        if ((bar = strchr(s, '|'))) *bar = '\0';
        json_t *n = json_loads(s, JSON_DECODE_ANY, NULL);
        ok = n && same_value(v, n);
        json_decref(n);
    }
    return ok;
}

static pthread_mutex_t logged_mu = PTHREAD_MUTEX_INITIALIZER;
static char logged[64][48]; /* unknown names already logged (the first 64) */
static int n_logged;

static void log_once(const char *name) {
    pthread_mutex_lock(&logged_mu);
    bool seen = false;
    for (int i = 0; !seen && i < n_logged; i++) seen = !strncmp(logged[i], name, sizeof logged[i] - 1);
    if (!seen && n_logged < 64) {
        char shown[41];
        snprintf(logged[n_logged++], sizeof logged[0], "%s", name);
        serve_printable(shown, sizeof shown, name); /* a client's bytes: no control character reaches the log */
        fprintf(stderr,
                "kvtier serve: request field '%s' is not one kvtier reads; ignored (listed in usage.kvtier.ignored_fields; logged "
                "once)\n",
                shown);
    }
    pthread_mutex_unlock(&logged_mu);
}

int serve_fields_check(enum field_table t, const json_t *root, json_t **ignored, struct serve_error *e) {
    if (!json_is_object(root)) return 0; /* the parser says what the body must be */
    const char *k;
    const json_t *v;
    char types[96];
    json_object_foreach((json_t *) root, k, v) {
        const struct serve_field *f = find(t, k);
        if (!f) {
            log_once(k);
            if (!*ignored) *ignored = json_array();
            if (*ignored && json_array_size(*ignored) < 16) {
                char name[64];
                serve_printable(name, sizeof name, k);
                json_array_append_new(*ignored, json_string(name));
            }
            continue;
        }
        if (json_is_null(v)) continue; /* null: absent */
        if (!type_ok(f->types, v)) {
            serve_error_param(e, f->name);
            return serve_bad(e, "'%s' must be %s, got %s", f->name, type_names(f->types, types, sizeof types), serve_json_type(v));
        }
        if (f->status == FIELD_REFUSED) {
            serve_error_param(e, f->name);
            return serve_bad(e, "'%s' is not supported by kvtier serve: %s", f->name, f->note);
        }
        if (f->status == FIELD_NEUTRAL && !is_neutral(f, v)) {
            char *got = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(15));
            char shown[64];
            serve_printable(shown, sizeof shown, got ? got : "?");
            free(got);
            serve_error_param(e, f->name);
            return serve_bad(e, "'%s' %s is not supported by kvtier serve: %s (send %s or leave it out)", f->name, shown, f->note,
                             f->neutral);
        }
    }
    return 0;
}

static void md_cell(FILE *f, const char *s) {
    for (; *s; s++) fputs(*s == '|' ? "\\|" : (char[]){ *s, '\0' }, f);
}

void serve_fields_print_md(FILE *f) {
    static const char *const status[] = { "honoured", "accepted at a neutral value only", "refused (400)",
                                          "accepted, no effect by design" };
    static const char *const api[] = { "chat", "completions", "native", "responses", "messages" };
    fprintf(f, "## Request fields\n\n"
               "Every field of each API is one of: **honoured** (the reply follows it); **accepted at a neutral\n"
               "value only** (not implemented: any other value is a 400 naming the field); **refused** (any value\n"
               "but null is a 400 naming the field); **accepted, no effect by design** (the note says why).  A\n"
               "wrong JSON type is a 400 naming the field.  A field no row names is ignored, as llama-server does,\n"
               "logged once, and listed back in the reply's `usage.kvtier.ignored_fields`.\n");
    for (int t = 0; t < FIELD_N_TABLES; t++) {
        fprintf(f, "\n### %s\n\n| field | type | APIs | status | neutral value | note |\n|---|---|---|---|---|---|\n",
                TABLES[t].title);
        for (size_t i = 0; i < TABLES[t].n; i++) {
            const struct serve_field *r = &TABLES[t].rows[i];
            char types[96], apis[96] = "";
            size_t at = 0;
            for (int b = 0; b < 5; b++)
                if (r->apis & (1u << b)) at += (size_t) snprintf(apis + at, sizeof apis - at, "%s%s", at ? ", " : "", api[b]);
            fprintf(f, "| `%s` | %s | %s | %s | ", r->name, type_names(r->types, types, sizeof types), apis, status[r->status]);
            if (r->neutral) {
                fputc('`', f);
                md_cell(f, r->neutral);
                fputc('`', f);
            }
            fputs(" | ", f);
            md_cell(f, r->note);
            fputs(" |\n", f);
        }
    }
}
