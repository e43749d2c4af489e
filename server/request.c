/* request.c — the body of an OpenAI-style request into a job (HTTP threads): sampling, length,
** stop strings and streaming fields shared by both endpoints, the chat messages (with tool calls
** and tool results, server/tools.c) or the completion prompt.  Every error names the field and
** the bad value, as the 400 reply the client gets. */
#include "fields.h"
#include "serve.h"

#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

bool serve_penalized(const struct kvt_sampling *s) {
    return (s->repeat_penalty > 0 && s->repeat_penalty != 1.0f) || s->frequency_penalty != 0 || s->presence_penalty != 0;
}

int32_t serve_history_window(const struct kvt_sampling *s) {
    const int32_t p = serve_penalized(s) && s->mirostat == 0 ? s->penalty_last_n : 0;
    const int32_t d = s->dry_multiplier > 0 && s->mirostat == 0 ? s->dry_penalty_last_n : 0;
    return p > d ? p : d;
}

struct kvt_sampling serve_sampling_defaults(const struct server *srv) {
    return (struct kvt_sampling){ .temperature = srv->temp_default,
                                  .top_p = srv->top_p_default,
                                  .top_k = srv->top_k_default,
                                  .min_p = srv->min_p_default,
                                  .top_n_sigma = srv->top_n_sigma_default,
                                  .typical_p = srv->typical_p_default,
                                  .xtc_probability = srv->xtc_probability_default,
                                  .xtc_threshold = srv->xtc_threshold_default,
                                  .dynatemp_range = srv->dynatemp_range_default,
                                  .dynatemp_exponent = srv->dynatemp_exponent_default,
                                  .mirostat = srv->mirostat_default,
                                  .mirostat_tau = srv->mirostat_tau_default,
                                  .mirostat_eta = srv->mirostat_eta_default,
                                  .dry_multiplier = srv->dry_multiplier_default,
                                  .dry_base = srv->dry_base_default,
                                  .dry_allowed_length = srv->dry_allowed_length_default,
                                  .dry_penalty_last_n = srv->dry_penalty_last_n_default < 0 ? srv->n_ctx
                                                                                            : srv->dry_penalty_last_n_default,
                                  .repeat_penalty = srv->repeat_penalty_default,
                                  .frequency_penalty = srv->frequency_penalty_default,
                                  .presence_penalty = srv->presence_penalty_default };
}

/* Fill the sampling / length / stop / stream fields shared by both endpoints.  On a bad field,
** fills e (e->param: the field's name) and returns -1. */
static int parse_common(struct server *srv, json_t *root, struct job *j, struct serve_error *e) {
    json_t *v;
    j->req.max_tokens = srv->max_tokens_default;
    j->req.smp = serve_sampling_defaults(srv); /* the same on every route */
    json_int_t last_n = srv->repeat_last_n_default;
    const char *len_keys[] = { "max_tokens", "max_completion_tokens" };
    for (int i = 0; i < 2; i++)
        if ((v = json_object_get(root, len_keys[i])) && !json_is_null(v)) {
            serve_error_param(e, len_keys[i]);
            if (!json_is_integer(v)) {
                serve_bad(e, "'%s' must be an integer, got %s", len_keys[i], serve_json_type(v));
                return -1;
            }
            json_int_t x = json_integer_value(v);
            if (x < 1 || x > srv->n_ctx) {
                serve_bad(e, "'%s' %lld is outside 1..%d", len_keys[i], (long long) x, srv->n_ctx);
                return -1;
            }
            j->req.max_tokens = (int32_t) x;
            j->req.max_tokens_given = true;
        }
    if ((v = json_object_get(root, "temperature")) && !json_is_null(v)) {
        serve_error_param(e, "temperature");
        if (!json_is_number(v)) {
            serve_bad(e, "'temperature' must be a number, got %s", serve_json_type(v));
            return -1;
        }
        double t = json_number_value(v);
        if (!(t >= 0 && t <= 2)) {
            serve_bad(e, "'temperature' %g is outside 0..2", t);
            return -1;
        }
        j->req.smp.temperature = (float) t;
    }
    if ((v = json_object_get(root, "top_p")) && !json_is_null(v)) {
        serve_error_param(e, "top_p");
        if (!json_is_number(v)) {
            serve_bad(e, "'top_p' must be a number, got %s", serve_json_type(v));
            return -1;
        }
        double p = json_number_value(v);
        if (!(p > 0 && p <= 1)) {
            serve_bad(e, "'top_p' %g is outside (0, 1]", p);
            return -1;
        }
        j->req.smp.top_p = (float) p;
    }
    if ((v = json_object_get(root, "min_p")) && !json_is_null(v)) {
        serve_error_param(e, "min_p");
        if (!json_is_number(v)) return serve_bad(e, "'min_p' must be a number, got %s", serve_json_type(v));
        double p = json_number_value(v);
        if (!(p >= 0 && p <= 1)) return serve_bad(e, "'min_p' %g is outside 0..1 (0 = off)", p);
        j->req.smp.min_p = (float) p;
    }
    /* llama-server's other samplers (kvtier.h struct kvt_sampling): each a number in its range, else a
    ** 400 naming it; typical_p 1 and top_n_sigma <= 0 are off, as in llama-server */
    static const struct {
        const char *name, *range;
        double lo, hi;
        bool lo_open;
        size_t off; /* the float of struct kvt_sampling */
    } X[] = {
        { "top_n_sigma", "-1..100 (-1 or 0 = off)", -1, 100, false, offsetof(struct kvt_sampling, top_n_sigma) },
        { "typical_p", "(0, 1] (1 = off)", 0, 1, true, offsetof(struct kvt_sampling, typical_p) },
        { "xtc_probability", "0..1 (0 = off)", 0, 1, false, offsetof(struct kvt_sampling, xtc_probability) },
        { "xtc_threshold", "0..1 (above 0.5 = off)", 0, 1, false, offsetof(struct kvt_sampling, xtc_threshold) },
        { "dynatemp_range", "0..2 (0 = off)", 0, 2, false, offsetof(struct kvt_sampling, dynatemp_range) },
        { "dynatemp_exponent", "(0, 10]", 0, 10, true, offsetof(struct kvt_sampling, dynatemp_exponent) },
        { "mirostat_tau", "(0, 100] bits", 0, 100, true, offsetof(struct kvt_sampling, mirostat_tau) },
        { "mirostat_eta", "(0, 10]", 0, 10, true, offsetof(struct kvt_sampling, mirostat_eta) },
        { "dry_multiplier", "0..100 (0 = off)", 0, 100, false, offsetof(struct kvt_sampling, dry_multiplier) },
        { "dry_base", "1..10", 1, 10, false, offsetof(struct kvt_sampling, dry_base) },
    };
    bool sent_dyn = false;
    for (size_t i = 0; i < sizeof X / sizeof X[0]; i++)
        if ((v = json_object_get(root, X[i].name)) && !json_is_null(v)) {
            serve_error_param(e, X[i].name);
            if (!json_is_number(v)) return serve_bad(e, "'%s' must be a number, got %s", X[i].name, serve_json_type(v));
            const double x = json_number_value(v);
            if (!(x <= X[i].hi && (X[i].lo_open ? x > X[i].lo : x >= X[i].lo)))
                return serve_bad(e, "'%s' %g is outside %s", X[i].name, x, X[i].range);
            *(float *) ((char *) &j->req.smp + X[i].off) = (float) x;
            sent_dyn |= X[i].off == offsetof(struct kvt_sampling, dynatemp_range);
        }
    if ((v = json_object_get(root, "mirostat")) && !json_is_null(v)) {
        serve_error_param(e, "mirostat");
        if (!json_is_integer(v)) return serve_bad(e, "'mirostat' must be an integer, got %s", serve_json_type(v));
        const json_int_t m = json_integer_value(v);
        if (m < 0 || m > 2) return serve_bad(e, "'mirostat' %lld is not 0 (off), 1 or 2", (long long) m);
        j->req.smp.mirostat = (int32_t) m;
    }
    /* DRY's integers: the allowed length, and its window (-1: the context; 0: no DRY, as llama.cpp's) */
    json_int_t dry_n = srv->dry_penalty_last_n_default;
    static const char *const dry_keys[] = { "dry_allowed_length", "dry_penalty_last_n" };
    for (int i = 0; i < 2; i++)
        if ((v = json_object_get(root, dry_keys[i])) && !json_is_null(v)) {
            serve_error_param(e, dry_keys[i]);
            if (!json_is_integer(v)) return serve_bad(e, "'%s' must be an integer, got %s", dry_keys[i], serve_json_type(v));
            const json_int_t x = json_integer_value(v), lo = i == 0 ? 0 : -1;
            if (x < lo || x > srv->n_ctx)
                return serve_bad(e, "'%s' %lld is outside %lld..%d%s", dry_keys[i], (long long) x, (long long) lo, srv->n_ctx,
                                 i == 1 ? " (-1: the context, 0: no DRY)" : "");
            if (i == 0) j->req.smp.dry_allowed_length = (int32_t) x;
            else dry_n = x;
        }
    /* DRY's sequence breakers: llama-server's field, a non-empty array of strings (a token holding one ends a
    ** repeat); each 1..40 bytes, at most 16 and 128 bytes in all (serve.h) */
    if ((v = json_object_get(root, "dry_sequence_breakers")) && !json_is_null(v)) {
        serve_error_param(e, "dry_sequence_breakers");
        if (!json_is_array(v) || json_array_size(v) == 0)
            return serve_bad(e, "'dry_sequence_breakers' must be a non-empty array of strings, got %s",
                             json_is_array(v) ? "an empty array" : serve_json_type(v));
        if (json_array_size(v) > SERVE_MAX_DRY_BREAKERS)
            return serve_bad(e, "'dry_sequence_breakers' has %zu strings, more than %d", json_array_size(v),
                             SERVE_MAX_DRY_BREAKERS);
        size_t all = 0;
        for (size_t i = 0; i < json_array_size(v); i++) {
            json_t *b = json_array_get(v, i);
            if (!json_is_string(b))
                return serve_bad(e, "'dry_sequence_breakers'[%zu] must be a string, got %s", i, serve_json_type(b));
            const size_t len = json_string_length(b); /* no zero byte inside: bodies are read without JSON_ALLOW_NUL */
            if (len == 0 || len > SERVE_MAX_DRY_BREAKER_BYTES) {
                char shown[48];
                serve_printable(shown, sizeof shown, json_string_value(b));
                return serve_bad(e, "'dry_sequence_breakers'[%zu] \"%s%s\" is %zu bytes: a breaker is 1..%d bytes", i, shown,
                                 strlen(shown) < len ? "..." : "", len, SERVE_MAX_DRY_BREAKER_BYTES);
            }
            if ((all += len) > SERVE_MAX_DRY_BREAKERS_BYTES)
                return serve_bad(e, "'dry_sequence_breakers' has more than %d bytes in all", SERVE_MAX_DRY_BREAKERS_BYTES);
            if (!(j->req.dry_breakers[j->req.n_dry_breakers] = strdup(json_string_value(b)))) return serve_error_oom(e);
            j->req.n_dry_breakers++;
        }
        j->req.smp.dry_sequence_breakers = (const char *const *) j->req.dry_breakers;
        j->req.smp.n_dry_sequence_breakers = j->req.n_dry_breakers;
    }
    if (dry_n == 0) j->req.smp.dry_multiplier = 0;
    j->req.smp.dry_penalty_last_n = dry_n < 0 ? srv->n_ctx : (int32_t) dry_n;
    if (j->req.smp.typical_p >= 1) j->req.smp.typical_p = 0; /* off, as kvt_sampling has it */
    if (j->req.smp.top_n_sigma < 0) j->req.smp.top_n_sigma = 0;
    /* greedy has no temperature to vary: a request's range is refused, the server's --dynatemp-range not applied */
    if (sent_dyn && j->req.smp.dynatemp_range > 0 && j->req.smp.temperature <= 0) {
        serve_error_param(e, "dynatemp_range");
        return serve_bad(e, "'dynatemp_range' %g needs a temperature above 0 (temperature 0 is greedy)",
                         (double) j->req.smp.dynatemp_range);
    }
    /* repetition penalties, llama.cpp's penalties sampler as llama-server runs it (over the last
    ** repeat_last_n tokens of prompt and reply; kvtier_int.h kvt_penalty_window) */
    static const char *const pen_keys[] = { "frequency_penalty", "presence_penalty", "repeat_penalty" };
    float *pen[] = { &j->req.smp.frequency_penalty, &j->req.smp.presence_penalty, &j->req.smp.repeat_penalty };
    for (int i = 0; i < 3; i++)
        if ((v = json_object_get(root, pen_keys[i])) && !json_is_null(v)) {
            serve_error_param(e, pen_keys[i]);
            if (!json_is_number(v)) return serve_bad(e, "'%s' must be a number, got %s", pen_keys[i], serve_json_type(v));
            const double x = json_number_value(v);
            if (i < 2 && !(x >= -2 && x <= 2)) return serve_bad(e, "'%s' %g is outside -2..2 (0 = off)", pen_keys[i], x);
            if (i == 2 && !(x > 0 && x <= 10)) return serve_bad(e, "'repeat_penalty' %g is outside (0, 10] (1 = off)", x);
            *pen[i] = (float) x;
        }
    if ((v = json_object_get(root, "repeat_last_n")) && !json_is_null(v)) {
        serve_error_param(e, "repeat_last_n");
        if (!json_is_integer(v)) return serve_bad(e, "'repeat_last_n' must be an integer, got %s", serve_json_type(v));
        const json_int_t n = json_integer_value(v);
        if (n < -1 || n > srv->n_ctx)
            return serve_bad(e, "'repeat_last_n' %lld is outside -1..%d (-1: the context, 0: no penalty)", (long long) n,
                             srv->n_ctx);
        last_n = n;
    }
    /* a window of 0 (the request's, or the server's --repeat-last-n that a request did not replace):
    ** no penalty, as llama.cpp's penalties sampler over no token */
    if (last_n == 0) j->req.smp.repeat_penalty = 1, j->req.smp.frequency_penalty = j->req.smp.presence_penalty = 0;
    j->req.repeat_last_n = last_n < 0 ? srv->n_ctx : (int32_t) last_n;
    j->req.smp.penalty_last_n = j->req.repeat_last_n > 0 ? j->req.repeat_last_n : 64;
    if ((v = json_object_get(root, "top_k")) && !json_is_null(v)) {
        serve_error_param(e, "top_k");
        if (!json_is_integer(v)) {
            serve_bad(e, "'top_k' must be an integer, got %s", serve_json_type(v));
            return -1;
        }
        json_int_t k = json_integer_value(v);
        if (k < 0 || k > 1000000) {
            serve_bad(e, "'top_k' %lld is outside 0..1000000 (0 = off)", (long long) k);
            return -1;
        }
        j->req.smp.top_k = (int32_t) k;
    }
    if ((v = json_object_get(root, "seed")) && !json_is_null(v)) {
        serve_error_param(e, "seed");
        if (!json_is_integer(v)) {
            serve_bad(e, "'seed' must be an integer, got %s", serve_json_type(v));
            return -1;
        }
        j->req.smp.seed = (uint32_t) json_integer_value(v);
        j->req.seeded = true;
    } else if (srv->seed_default >= 0) { /* --seed */
        j->req.smp.seed = (uint32_t) srv->seed_default;
        j->req.seeded = true;
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        j->req.smp.seed = (uint32_t) (ts.tv_nsec ^ ts.tv_sec);
    }
    if ((v = json_object_get(root, "n")) && !json_is_null(v)) { /* n > 1: server/api_openai.c runs one job per choice */
        serve_error_param(e, "n");
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > SERVE_MAX_CHOICES) {
            if (json_is_integer(v)) serve_bad(e, "'n' %lld is outside 1..%d", (long long) json_integer_value(v), SERVE_MAX_CHOICES);
            else serve_bad(e, "'n' must be an integer from 1 to %d, got %s", SERVE_MAX_CHOICES, serve_json_type(v));
            return -1;
        }
        if (json_integer_value(v) > 1) {
            serve_bad(e, "'n' %lld: several choices are served on /v1/chat/completions and /v1/completions, not here",
                      (long long) json_integer_value(v));
            return -1;
        }
    }
    if ((v = json_object_get(root, "stop")) && !json_is_null(v)) {
        serve_error_param(e, "stop");
        if (json_is_string(v)) {
            if (!(j->req.stop[j->req.n_stop++] = strdup(json_string_value(v)))) return serve_error_oom(e);
        } else if (json_is_array(v)) {
            if (json_array_size(v) > SERVE_MAX_STOP) {
                serve_bad(e, "'stop' has %zu strings; at most %d", json_array_size(v), SERVE_MAX_STOP);
                return -1;
            }
            size_t i;
            json_t *s;
            json_array_foreach(v, i, s) {
                if (!json_is_string(s)) {
                    serve_bad(e, "'stop[%zu]' must be a string, got %s", i, serve_json_type(s));
                    return -1;
                }
                if (!(j->req.stop[j->req.n_stop++] = strdup(json_string_value(s)))) return serve_error_oom(e);
            }
        } else {
            serve_bad(e, "'stop' must be a string or an array of strings, got %s", serve_json_type(v));
            return -1;
        }
        for (int32_t i = 0; i < j->req.n_stop; i++)
            if (!j->req.stop[i][0]) {
                serve_bad(e, "'stop' strings must not be empty");
                return -1;
            }
    }
    if ((v = json_object_get(root, "stream")) && !json_is_null(v)) {
        serve_error_param(e, "stream");
        j->req.stream = json_is_true(v);
    }
    if ((v = json_object_get(root, "stream_options")) && !json_is_null(v)) {
        serve_error_param(e, "stream_options");
        json_t *u = json_object_get(v, "include_usage");
        if (u && !json_is_boolean(u)) {
            serve_bad(e, "'stream_options.include_usage' must be a boolean, got %s", serve_json_type(u));
            return -1;
        }
        j->req.include_usage = u && json_is_true(u);
    }
    j->req.verbose = srv->verbose;
    if ((v = json_object_get(root, "timings_per_token")) && !json_is_null(v)) {
        serve_error_param(e, "timings_per_token");
        j->req.timings = json_is_true(v);
    }
    if ((v = json_object_get(root, "cache_prompt")) && !json_is_null(v)) {
        serve_error_param(e, "cache_prompt");
        j->req.no_prompt_cache = json_is_false(v);
    }
    if ((v = json_object_get(root, "return_progress")) && !json_is_null(v)) {
        serve_error_param(e, "return_progress");
        j->req.return_progress = json_is_true(v);
    }
    if ((v = json_object_get(root, "verbose")) && !json_is_null(v)) {
        serve_error_param(e, "verbose");
        j->req.verbose = json_is_true(v);
    }
    if ((v = json_object_get(root, "logprobs")) && !json_is_null(v)) {
        serve_error_param(e, "logprobs");
        if (!json_is_boolean(v) && !(json_is_integer(v) && json_integer_value(v) == 0)) {
            serve_bad(e, "'logprobs' must be a boolean, got %s", serve_json_type(v));
            return -1;
        }
        j->req.logprobs = json_is_true(v);
    }
    if ((v = json_object_get(root, "top_logprobs")) && !json_is_null(v)) {
        serve_error_param(e, "top_logprobs");
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 20) {
            serve_bad(e, "'top_logprobs' must be an integer in 0..20");
            return -1;
        }
        if (json_integer_value(v) > 0 && !j->req.logprobs) {
            serve_bad(e, "'top_logprobs' %lld needs 'logprobs': true", (long long) json_integer_value(v));
            return -1;
        }
        j->req.top_logprobs = (int32_t) json_integer_value(v);
    }
    serve_error_param(e, NULL);
    return 0;
}

/* The text of messages[i].content: a string, or text parts joined; NULL (allowed only where
** *optional) when absent or null.  Returns -1 on a bad shape. */
static int content_text(const json_t *ct, size_t i, char **out, bool optional, int32_t max_parts, struct serve_error *e) {
    *out = NULL;
    if ((!ct || json_is_null(ct)) && optional) return 0;
    if (ct && json_is_string(ct)) {
        *out = strdup(json_string_value(ct));
    } else if (ct && json_is_array(ct)) { /* content parts: text only, joined */
        size_t total = 1, k;
        if (json_array_size(ct) > (size_t) max_parts) {
            serve_bad(e, "'messages[%zu].content' has %zu parts; at most %d (--max-content-parts)", i, json_array_size(ct),
                      max_parts);
            return -1;
        }
        json_t *part;
        json_array_foreach(ct, k, part) {
            json_t *ty = json_is_object(part) ? json_object_get(part, "type") : NULL,
                   *tx = json_is_object(part) ? json_object_get(part, "text") : NULL;
            if (!ty || !json_is_string(ty) || strcmp(json_string_value(ty), "text") || !tx || !json_is_string(tx)) {
                serve_bad(
                    e, "'messages[%zu].content[%zu]' must be {\"type\": \"text\", \"text\": string}; other parts are not supported",
                    i, k);
                return -1;
            }
            total += json_string_length(tx) + 2;
        }
        if ((*out = malloc(total))) { /* one pass: strcat would rescan the text joined so far */
            size_t at = 0;
            json_array_foreach(ct, k, part) { /* parts joined by a blank line (llama-server's rule) */
                const json_t *tx = json_object_get(part, "text");
                if (k) memcpy(*out + at, "\n\n", 2), at += 2;
                memcpy(*out + at, json_string_value(tx), json_string_length(tx));
                at += json_string_length(tx);
            }
            (*out)[at] = '\0';
        }
    } else {
        serve_bad(e, "'messages[%zu].content' must be a string or an array of text parts, got %s", i,
                  ct ? serve_json_type(ct) : "nothing");
        return -1;
    }
    if (!*out) {
        serve_error_oom(e);
        return -1;
    }
    return 0;
}

/* Append a message (role and content owned by the job from here on). */
static int push_msg(struct job *j, const char *role, char *content) {
    j->req.msgs[j->req.n_msgs].role = strdup(role);
    j->req.msgs[j->req.n_msgs].content = content;
    j->req.n_msgs++;
    return j->req.msgs[j->req.n_msgs - 1].role && content ? 0 : -1;
}

/* messages[] into owned (role, content) pairs; "developer" is a system message.  Tool calling
** (server/tools.c): an assistant message's tool_calls become the JSON text the model generates,
** and "tool" results become user messages (consecutive ones joined), naming the tool called by
** the matching tool_call_id.  sys_extra (the tools' description) is appended to the system
** message, or becomes one at the start. */
static int parse_messages(json_t *root, struct job *j, const struct serve_limits *lim, const char *sys_extra,
                          struct serve_error *e) {
    json_t *ms = json_object_get(root, "messages");
    serve_error_param(e, "messages");
    if (!ms) {
        serve_bad(e, "'messages' is required");
        return -1;
    }
    if (!json_is_array(ms)) {
        serve_bad(e, "'messages' must be an array, got %s", serve_json_type(ms));
        return -1;
    }
    size_t n = json_array_size(ms);
    if (n == 0) {
        serve_bad(e, "'messages' must not be empty");
        return -1;
    }
    if (n > (size_t) lim->max_messages) {
        serve_bad(e, "'messages' has %zu entries; at most %d (--max-messages)", n, lim->max_messages);
        return -1;
    }
    if (!(j->req.msgs = calloc(n + 1, sizeof *j->req.msgs))) {
        serve_error_oom(e);
        return -1;
    }
    size_t i;
    json_t *m;
    bool last_tool = false;
    size_t joined_len = 0, joined_cap = 0; /* the last message while it joins tool results */
    json_t *call_names = json_object();    /* tool_call id -> function name, from the calls seen so far */
    if (!call_names) {
        serve_error_oom(e);
        return -1;
    }
    int rc = -1;
    json_array_foreach(ms, i, m) {
        if (!json_is_object(m)) {
            serve_bad(e, "'messages[%zu]' must be an object, got %s", i, serve_json_type(m));
            goto out;
        }
        json_t *r = json_object_get(m, "role"), *ct = json_object_get(m, "content"), *calls = json_object_get(m, "tool_calls");
        if (!r || !json_is_string(r)) {
            serve_bad(e, "'messages[%zu].role' must be a string", i);
            goto out;
        }
        const char *role = json_string_value(r);
        if (!strcmp(role, "developer")) role = "system";
        bool tool = !strcmp(role, "tool");
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant") && !tool) {
            serve_bad(e, "'messages[%zu].role' '%.40s' is not supported; expected system, developer, user, assistant or tool", i,
                      role);
            goto out;
        }
        bool has_calls = calls && !json_is_null(calls) && !(json_is_array(calls) && json_array_size(calls) == 0);
        if (has_calls && strcmp(role, "assistant")) {
            serve_bad(e, "'messages[%zu]' is a %s message with 'tool_calls'; only assistant messages make tool calls", i, role);
            goto out;
        }
        char *content = NULL;
        if (content_text(ct, i, &content, has_calls, lim->max_parts, e)) goto out;
        if (has_calls) { /* the call as generated; any text beside it is dropped (the model emits one JSON object) */
            free(content);
            if (!(content = tools_render_calls(calls, i, e))) goto out;
            size_t q;
            json_t *c;
            json_array_foreach(calls, q, c) { /* remembered for the "tool" messages answering them */
                json_t *cid = json_object_get(c, "id"), *fn = json_object_get(c, "function"),
                       *fnm = fn ? json_object_get(fn, "name") : NULL;
                if (cid && json_is_string(cid) && fnm && json_is_string(fnm) &&
                    !json_object_get(call_names, json_string_value(cid)))
                    json_object_set(call_names, json_string_value(cid), fnm);
            }
        }
        if (tool) {
            json_t *id = json_object_get(m, "tool_call_id"), *nm = json_object_get(m, "name");
            const char *name = nm && json_is_string(nm) ? json_string_value(nm) : NULL;
            if (!id || !json_is_string(id)) {
                free(content);
                serve_bad(e, "'messages[%zu].tool_call_id' must be a string (the id of the call it answers)", i);
                goto out;
            }
            /* the tool's name: from the assistant message that made the call (one lookup) */
            const json_t *called = name ? NULL : json_object_get(call_names, json_string_value(id));
            if (called) name = json_string_value(called);
            char *t = tools_render_result(name, content);
            free(content);
            if (!(content = t)) {
                serve_error_oom(e);
                goto out;
            }
            if (last_tool) { /* results of one turn's calls: one user message, grown by doubling */
                struct kvt_chat_msg *prev = &j->req.msgs[j->req.n_msgs - 1];
                size_t nc = strlen(content);
                if (joined_len + nc + 2 > joined_cap) {
                    size_t cap = KVT_MAX(2 * joined_cap, joined_len + nc + 2);
                    char *joined = realloc((char *) prev->content, cap);
                    if (!joined) {
                        free(content);
                        serve_error_oom(e);
                        goto out;
                    }
                    prev->content = joined;
                    joined_cap = cap;
                }
                char *joined = (char *) prev->content;
                joined[joined_len] = '\n';
                memcpy(joined + joined_len + 1, content, nc + 1);
                joined_len += nc + 1;
                free(content);
                continue;
            }
            joined_len = strlen(content); /* the first result of a run: it may be joined to */
            joined_cap = joined_len + 1;
            role = "user";
        }
        last_tool = tool;
        if (push_msg(j, role, content)) {
            serve_error_oom(e);
            goto out;
        }
    }
    rc = 0;
out:
    json_decref(call_names);
    if (rc) return -1;
    if (sys_extra) {
        if (!strcmp(j->req.msgs[0].role, "system")) {
            size_t a = strlen(j->req.msgs[0].content), b = strlen(sys_extra);
            char *c = realloc((char *) j->req.msgs[0].content, a + b + 3);
            if (!c) {
                serve_error_oom(e);
                return -1;
            }
            if (a) memcpy(c + a, "\n\n", 2), a += 2;
            memcpy(c + a, sys_extra, b + 1);
            j->req.msgs[0].content = c;
        } else {
            memmove(j->req.msgs + 1, j->req.msgs, sizeof *j->req.msgs * (size_t) j->req.n_msgs);
            j->req.msgs[0].role = strdup("system");
            j->req.msgs[0].content = strdup(sys_extra);
            j->req.n_msgs++;
            if (!j->req.msgs[0].role || !j->req.msgs[0].content) {
                serve_error_oom(e);
                return -1;
            }
        }
    }
    const json_t *cont = json_object_get(root, "continue_final_message"), *agp = json_object_get(root, "add_generation_prompt");
    if (json_is_true(cont) && json_is_true(agp)) {
        serve_error_param(e, "continue_final_message");
        return serve_bad(e, "'continue_final_message' and 'add_generation_prompt' cannot both be true");
    }
    if (!strcmp(j->req.msgs[j->req.n_msgs - 1].role, "assistant") && !json_is_false(cont)) {
        if (json_is_true(agp) && !json_is_true(cont)) { /* the template's semantics: a new turn after it */
            serve_error_param(e, "add_generation_prompt");
            return serve_bad(e, "'add_generation_prompt' true after a final assistant message begins a new turn after it, which "
                                "kvtier does not do: it continues a final assistant message (llama-server's prefill); send "
                                "false, or end with a user message");
        }
        if (j->req.n_msgs >= 2 && !strcmp(j->req.msgs[j->req.n_msgs - 2].role, "assistant"))
            return serve_bad(e, "the last two messages are the assistant's: only one final assistant message can be continued");
        j->req.prefill = true; /* llama-server's assistant prefill (vLLM's continue_final_message) */
    } else if (strcmp(j->req.msgs[j->req.n_msgs - 1].role, "user")) {
        serve_bad(e, "the last message is '%s'; it must be a user or tool message (or an assistant message to continue)",
                  j->req.msgs[j->req.n_msgs - 1].role);
        return -1;
    } else if (json_is_true(cont)) {
        serve_error_param(e, "continue_final_message");
        return serve_bad(e, "'continue_final_message' is true but the last message is not the assistant's");
    } else if (json_is_false(agp)) {
        serve_error_param(e, "add_generation_prompt");
        return serve_bad(e, "'add_generation_prompt' false is supported only with a final assistant message to continue");
    }
    serve_error_param(e, NULL);
    return 0;
}

static int add_bias(struct server *srv, struct job *j, const json_t *key, const char *kstr, const json_t *val, const char *where,
                    bool text_only, struct serve_error *e) {
    float b;
    if (json_is_false(val)) b = -INFINITY;
    else if (json_is_number(val) && json_number_value(val) >= -100 && json_number_value(val) <= 100)
        b = (float) json_number_value(val);
    else
        return serve_bad(e, "'logit_bias' %s: the bias must be a number in -100..100 or false, got %s", where,
                         serve_json_type(val));
    kvt_token one, *toks = &one;
    int32_t n = 1;
    char *end = NULL;
    long id = -1;
    if (key && json_is_integer(key)) id = (long) json_integer_value(key);
    else if (kstr && *kstr && !text_only) id = strtol(kstr, &end, 10);
    struct kvt_engine_info I = { 0 };
    if (srv->eng) kvt_engine_info(srv->eng, &I);
    if ((key && json_is_integer(key)) || (end && !*end)) {
        if (id < 0 || (srv->eng && id >= I.n_vocab))
            return serve_bad(e, "'logit_bias' %s: token id %ld is outside 0..%d (the model's vocabulary)", where, id,
                             I.n_vocab - 1);
        one = (kvt_token) id;
    } else if (kstr && *kstr && srv->eng) { /* a text: every token of it */
        if (kvt_tokenize(srv->eng, kstr, false, false, &toks, &n))
            return serve_bad(e, "'logit_bias' %s: cannot tokenize the text", where);
    } else return serve_bad(e, "'logit_bias' %s: the key must be a token id or a text", where);
    int rc = 0;
    for (int32_t i = 0; rc == 0 && i < n; i++) {
        if (j->req.n_bias == 4096) {
            rc = serve_bad(e, "'logit_bias' biases more than 4096 tokens");
            break;
        }
        if (j->req.n_bias % 64 == 0) {
            struct kvt_logit_bias *nb = realloc(j->req.bias, sizeof *nb * (size_t) (j->req.n_bias + 64));
            if (!nb) {
                rc = serve_error_oom(e);
                break;
            }
            j->req.bias = nb;
        }
        j->req.bias[j->req.n_bias++] = (struct kvt_logit_bias){ toks[i], b };
    }
    if (toks != &one) free(toks);
    return rc;
}

/* logit_bias: OpenAI's {"ID": bias} or llama-server's [[ID or text, bias or false], ...]. */
static int parse_logit_bias(struct server *srv, const json_t *v, struct job *j, struct serve_error *e) {
    serve_error_param(e, "logit_bias");
    char where[48];
    if (json_is_object(v)) {
        const char *k;
        json_t *b;
        json_object_foreach((json_t *) v, k, b) {
            snprintf(where, sizeof where, "'%.30s'", k);
            if (add_bias(srv, j, NULL, k, b, where, false, e)) return -1; /* OpenAI's keys: ids */
        }
    } else if (json_is_array(v)) {
        size_t i;
        json_t *p;
        json_array_foreach(v, i, p) {
            snprintf(where, sizeof where, "[%zu]", i);
            if (!json_is_array(p) || json_array_size(p) != 2 ||
                !(json_is_integer(json_array_get(p, 0)) || json_is_string(json_array_get(p, 0))))
                return serve_bad(e, "'logit_bias[%zu]' must be a pair [token id or text, bias]", i);
            /* llama-server's pairs: a number is an id, a string is text to tokenize ("123" too) */
            if (add_bias(srv, j, json_array_get(p, 0), json_string_value(json_array_get(p, 0)), json_array_get(p, 1), where, true,
                         e))
                return -1;
        }
    } else return serve_bad(e, "'logit_bias' must be an object {token id: bias} or an array of pairs, got %s", serve_json_type(v));
    j->req.smp.logit_bias = j->req.bias;
    j->req.smp.n_logit_bias = j->req.n_bias;
    serve_error_param(e, NULL);
    return 0;
}

/* An assistant prefill: the template's text of the messages before the last, with the assistant
** prefix, then the last message's text; the job becomes a completion of it (a scratch sequence,
** no session: its KV is not kept), replied in the chat shape. */
static int prefill_prompt(struct server *srv, struct job *j, struct serve_error *e) {
    if (j->req.format != REPLY_TEXT) {
        serve_error_param(e, "messages");
        return serve_bad(e, "an assistant prefill (the last message is the assistant's) cannot be combined with tools or "
                            "response_format");
    }
    if (!srv->eng) return 0; /* no model (the request fuzzer): parsed only */
    char *text = NULL;
    const struct kvt_chat_msg *last = &j->req.msgs[j->req.n_msgs - 1];
    int rc = kvt_chat_format(srv->eng, j->req.msgs, j->req.n_msgs - 1, true, kvt_session_default_params().template_fallback, &text);
    if (rc) {
        serve_error_param(e, "messages");
        serve_error_lib(e, "chat template", rc);
        return -1;
    }
    size_t a = strlen(text), b = strlen(last->content);
    char *p = realloc(text, a + b + 1);
    if (!p) {
        free(text);
        return serve_error_oom(e);
    }
    memcpy(p + a, last->content, b + 1);
    j->req.prompt = p;
    j->req.prompt_special = true;
    j->kind = JOB_COMPLETION;
    return 0;
}

int serve_request_detach(struct server *srv, struct job *j, struct serve_error *e) {
    if (j->kind != JOB_CHAT) return 0;
    if (j->req.format != REPLY_TEXT) {
        serve_error_param(e, "n");
        return serve_bad(e, "'n' > 1 cannot be combined with tools or response_format (one choice per request there)");
    }
    if (!srv->eng) return 0; /* no model (the request fuzzer): parsed only */
    char *text = NULL;
    int rc = kvt_chat_format(srv->eng, j->req.msgs, j->req.n_msgs, true, kvt_session_default_params().template_fallback, &text);
    if (rc) {
        serve_error_param(e, "messages");
        serve_error_lib(e, "chat template", rc);
        return -1;
    }
    j->req.prompt = text;
    j->req.prompt_special = true;
    j->req.prefill = true; /* replied in the chat shape */
    j->kind = JOB_COMPLETION;
    return 0;
}

/* A prompt given as token ids, or as ids and texts in one sequence (each text tokenized without
** BOS, control tokens not parsed): [int | string, ...].  Ids are checked against the vocabulary
** on the engine thread. */
static int parse_prompt_ids(struct server *srv, const json_t *p, struct job *j, struct serve_error *e) {
    size_t n = json_array_size(p), cap = n;
    if (n > (size_t) 1 << 24) return serve_bad(e, "'prompt' has %zu token ids; at most %d", n, 1 << 24);
    if (!(j->req.prompt_ids = malloc(sizeof(kvt_token) * (cap ? cap : 1)))) return serve_error_oom(e);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *t = json_array_get(p, i);
        if (json_is_string(t) && srv->eng) {
            kvt_token *tt = NULL;
            int32_t m = 0;
            if (kvt_tokenize(srv->eng, json_string_value(t), false, false, &tt, &m)) {
                return serve_bad(e, "'prompt[%zu]': cannot tokenize the text", i);
            }
            if (at + (size_t) m + (n - i) > cap) {
                size_t nc = at + (size_t) m + (n - i);
                kvt_token *g = realloc(j->req.prompt_ids, sizeof *g * nc);
                if (!g) {
                    free(tt);
                    return serve_error_oom(e);
                }
                j->req.prompt_ids = g;
                cap = nc;
            }
            memcpy(j->req.prompt_ids + at, tt, sizeof *tt * (size_t) m);
            at += (size_t) m;
            free(tt);
            continue;
        }
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX)
            return serve_bad(e, "'prompt[%zu]' must be a token id (a non-negative integer) or a text, got %s", i,
                             serve_json_type(t));
        j->req.prompt_ids[at++] = (kvt_token) json_integer_value(t);
    }
    if (at > (size_t) 1 << 24) return serve_bad(e, "'prompt' has %zu tokens; at most %d", at, 1 << 24);
    j->req.n_prompt_ids = (int32_t) at;
    return 0;
}

int serve_request_parse(struct server *srv, json_t *root, struct job *j, bool chat, struct serve_error *e) {
    serve_error_param(e, NULL);
    /* every field was checked against the API's table (types, refused fields, neutral values) by
    ** the API's module before this reads any */
    int rc = parse_common(srv, root, j, e);
    const json_t *lb = json_object_get(root, "logit_bias");
    if (rc == 0 && lb && !json_is_null(lb)) rc = parse_logit_bias(srv, lb, j, e);
    char *sys_extra = NULL;
    if (rc == 0 && chat) rc = tools_parse(root, j, &srv->lim, &sys_extra, e);
    if (rc == 0 && chat) rc = parse_messages(root, j, &srv->lim, sys_extra, e);
    free(sys_extra);
    if (rc == 0 && chat && j->req.prefill) rc = prefill_prompt(srv, j, e);
    if (rc == 0 && !chat) {
        const char *chat_only[] = { "tools",           "tool_choice", "functions", "function_call",
                                    "response_format", "json_schema", "grammar" };
        for (int i = 0; rc == 0 && i < 7; i++) {
            json_t *v = json_object_get(root, chat_only[i]);
            if (v && !json_is_null(v)) {
                serve_error_param(e, chat_only[i]);
                serve_bad(e, "'%s' is not supported on /v1/completions; use /v1/chat/completions", chat_only[i]);
                rc = -1;
            }
        }
    }
    if (rc == 0 && !chat) {
        json_t *p = json_object_get(root, "prompt");
        serve_error_param(e, "prompt");
        if (p && json_is_array(p) && json_array_size(p) == 1 && !json_is_integer(json_array_get(p, 0))) p = json_array_get(p, 0);
        if (p && json_is_object(p)) { /* llama.cpp's {"prompt_string": ..., "multimodal_data": ...} */
            if (json_object_get(p, "multimodal_data")) {
                serve_bad(e, "'prompt.multimodal_data': image and audio input are not supported (kvtier serves text models)");
                return -1;
            }
            p = json_object_get(p, "prompt_string");
        }
        bool ids = false; /* token ids, or ids and texts mixed in one sequence (llama.cpp's) */
        for (size_t i = 0; p && json_is_array(p) && i < json_array_size(p); i++) ids |= json_is_integer(json_array_get(p, i));
        if (p && json_is_array(p) && json_array_size(p) > 1 && !ids) {
            serve_bad(e, "'prompt' holds %zu prompts; kvtier serves one prompt per request", json_array_size(p));
            return -1;
        }
        if (ids) rc = parse_prompt_ids(srv, p, j, e); /* token ids (both APIs take them) */
        else if (!p || !json_is_string(p)) {
            serve_bad(e, "'prompt' must be a string or an array of token ids (one prompt per request)");
            rc = -1;
        } else if (!(j->req.prompt = strdup(json_string_value(p)))) rc = serve_error_oom(e);
    }
    return rc;
}

void serve_request_slot(struct job *j, const json_t *root) {
    const json_t *slot = json_object_get(root, "id_slot");
    if (!j->req.session_id[0] && json_is_integer(slot) && json_integer_value(slot) >= 0)
        snprintf(j->req.session_id, sizeof j->req.session_id, "slot-%lld", (long long) json_integer_value(slot));
}

int serve_request_parse_chat(struct server *srv, json_t *chat, struct job *j, struct serve_error *e) {
    int rc = serve_fields_check(FIELD_TABLE_OPENAI, chat, &j->req.ignored, e);
    if (rc == 0) rc = serve_request_parse(srv, chat, j, true, e);
    json_decref(chat);
    return rc;
}
