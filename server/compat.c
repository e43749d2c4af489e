/* compat.c — llama-server's own endpoints and shapes, for clients and scripts written against
** it: llama.cpp's native /completion API (n_predict, token-id prompts, its reply, stream and
** timings), /tokenize, /detokenize, /apply-template, /props, /slots and the model list with
** --alias/--tags.  Field names follow llama.cpp's tools/server (the vendored tree's README); what
** kvtier holds differently is shown as what it is: a "slot" is a session's KV stream of --budget
** resident tokens, and each one names its session.  Called on HTTP threads: the engine is used
** only through its thread-safe text functions (kvt_tokenize, kvt_detokenize, kvt_chat_format). */
#include "api.h"
#include "fields.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------------------------------- */
/* native /completion                                                                       */

int compat_native_params(struct server *srv, json_t *root, struct job *j, struct serve_error *e) {
    json_t *v;
    j->req.llama_probs = true;                                                       /* probabilities in llama-server's shape */
    if (serve_fields_check(FIELD_TABLE_OPENAI, root, &j->req.ignored, e)) return -1; /* types, refused and neutral fields */
    if ((v = json_object_get(root, "n_predict")) && !json_is_null(v)) {
        serve_error_param(e, "n_predict");
        if (!json_is_integer(v)) return serve_bad(e, "'n_predict' must be an integer, got %s", serve_json_type(v));
        json_int_t n = json_integer_value(v);
        if (n == 0 || n < -1 || n > srv->n_ctx)
            return serve_bad(e, "'n_predict' %lld is outside 1..%d, or -1 for the server's limit", (long long) n, srv->n_ctx);
        if (n > 0 && !json_object_get(root, "max_tokens") && json_object_set(root, "max_tokens", v)) return serve_error_oom(e);
    }
    if ((v = json_object_get(root, "n_probs")) && !json_is_null(v)) {
        serve_error_param(e, "n_probs");
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 100)
            return serve_bad(e, "'n_probs' must be an integer in 0..100");
        j->req.logprobs = j->req.logprobs || json_integer_value(v) > 0;
        j->req.top_logprobs = (int32_t) json_integer_value(v);
    }
    if ((v = json_object_get(root, "post_sampling_probs")) && !json_is_null(v)) {
        serve_error_param(e, "post_sampling_probs");
        j->req.post_sampling = json_is_true(v);
    }
    if ((v = json_object_get(root, "response_fields")) && json_array_size(v) > 0) {
        serve_error_param(e, "response_fields");
        if (json_array_size(v) > 64) return serve_bad(e, "'response_fields' has %zu names; at most 64", json_array_size(v));
        size_t i;
        const json_t *f;
        json_array_foreach(v, i, f) if (!json_is_string(f)) return serve_bad(e, "'response_fields[%zu]' must be a string", i);
        if (json_is_true(json_object_get(root, "stream")))
            return serve_bad(e, "'response_fields' is not supported with stream: true (the whole events are sent)");
        if (!(j->req.resp_fields = json_deep_copy(v))) return serve_error_oom(e);
    }
    if ((v = json_object_get(root, "return_tokens")) && !json_is_null(v)) {
        serve_error_param(e, "return_tokens");
        j->req.return_tokens = json_is_true(v);
    }
    serve_error_param(e, NULL);
    return 0;
}

static const char *stop_type(const struct job *j) {
    if (!strcmp(j->finish ? j->finish : "", "length")) return "limit";
    return j->stop_word ? "word" : "eos";
}

/* The samplers kvt_sampling adds to llama-server's basic ones, under llama-server's names and with its
** "off" values (top_n_sigma -1, typical_p 1), added to obj (generation_settings, /props). */
static json_t *more_samplers(json_t *obj, const struct kvt_sampling *p) {
    json_t *x = json_pack("{s:f, s:f, s:f, s:f, s:f, s:f}", "top_n_sigma", p->top_n_sigma > 0 ? (double) p->top_n_sigma : -1.0,
                          "typical_p", p->typical_p > 0 ? (double) p->typical_p : 1.0, "xtc_probability",
                          (double) p->xtc_probability, "xtc_threshold", (double) p->xtc_threshold, "dynatemp_range",
                          (double) p->dynatemp_range, "dynatemp_exponent",
                          p->dynatemp_exponent > 0 ? (double) p->dynatemp_exponent : 1.0);
    json_t *m = json_pack("{s:i, s:f, s:f}", "mirostat", p->mirostat, "mirostat_tau",
                          p->mirostat_tau > 0 ? (double) p->mirostat_tau : 5.0, "mirostat_eta",
                          p->mirostat_eta > 0 ? (double) p->mirostat_eta : 0.1);
    json_t *brk = p->dry_sequence_breakers ? json_array() : json_pack("[s, s, s, s]", "\n", ":", "\"", "*");
    for (int32_t i = 0; brk && p->dry_sequence_breakers && i < p->n_dry_sequence_breakers; i++)
        json_array_append_new(brk, json_string(p->dry_sequence_breakers[i]));
    json_t *dry = json_pack("{s:f, s:f, s:i, s:i, s:o}", "dry_multiplier", (double) p->dry_multiplier, "dry_base",
                            p->dry_base > 0 ? (double) p->dry_base : 1.75, "dry_allowed_length", p->dry_allowed_length,
                            "dry_penalty_last_n", p->dry_penalty_last_n, "dry_sequence_breakers", brk);
    if (x && dry) json_object_update(x, dry);
    json_decref(dry);
    if (x && m) json_object_update(x, m);
    json_decref(m);
    if (obj && x) json_object_update(obj, x);
    json_decref(x);
    return obj;
}

static json_t *gen_settings(struct server *srv, const struct job *j) {
    json_t *stop = json_array();
    for (int32_t i = 0; i < j->req.n_stop; i++) json_array_append_new(stop, json_string(j->req.stop[i]));
    const struct kvt_sampling *p = &j->req.smp;
    return more_samplers(json_pack("{s:i, s:I, s:f, s:i, s:f, s:f, s:f, s:f, s:f, s:i, s:o, s:b, s:s, s:i}", "n_predict",
                                   j->req.max_tokens, "seed", (json_int_t) p->seed, "temperature", (double) p->temperature, "top_k",
                                   p->top_k, "top_p", (double) p->top_p, "min_p", (double) p->min_p, "repeat_penalty",
                                   p->repeat_penalty > 0 ? (double) p->repeat_penalty : 1.0, "frequency_penalty",
                                   (double) p->frequency_penalty, "presence_penalty", (double) p->presence_penalty, "repeat_last_n",
                                   j->req.repeat_last_n, "stop", stop, "stream", j->req.stream, "model", srv->model_name, "n_ctx",
                                   srv->budget),
                         p);
}

json_t *compat_response_fields(const struct job *j, json_t *reply) {
    if (!j->req.resp_fields || !reply) return reply;
    json_t *out = json_object();
    size_t i;
    const json_t *f;
    json_array_foreach(j->req.resp_fields, i, f) {
        const char *path = json_string_value(f);
        char key[256];
        const json_t *at = reply;
        for (const char *p = path; at && *p;) {
            size_t n = strcspn(p, "/");
            snprintf(key, sizeof key, "%.*s", (int) KVT_MIN(n, sizeof key - 1), p);
            at = json_is_object(at) ? json_object_get(at, key) : NULL;
            p += n + (p[n] == '/');
        }
        if (at && at != reply && out) json_object_set(out, path, (json_t *) at);
    }
    json_decref(reply);
    return out;
}

json_t *compat_native_reply(struct server *srv, const struct job *j, const char *content, bool final, double t_done) {
    json_t *toks = json_array();
    if (final && j->req.return_tokens)
        for (int32_t i = 0; i < j->n_gen; i++) json_array_append_new(toks, json_integer(j->gen[i]));
    /* the text as valid UTF-8: a reply cut inside a character (a token of a character's first
    ** bytes, then the length limit) made the whole reply NULL and the connection was dropped
    ** without an answer (found by fuzz_api) */
    char *clean = app_utf8_clean(content);
    json_t *o = json_pack("{s:i, s:s, s:o, s:i, s:b, s:s}", "index", 0, "content", clean ? clean : "", "tokens", toks, "id_slot",
                          -1, "stop", final, "model", srv->model_name);
    free(clean);
    if (!o || !final) return o;
    const char *text = j->text ? j->text : "";
    json_t *timings = serve_timings(j, t_done);
    json_object_set_new(o, "tokens_predicted", json_integer(j->n_gen));
    json_object_set_new(o, "tokens_evaluated", json_integer(j->prompt_tokens));
    json_object_set_new(o, "tokens_cached", json_integer((json_int_t) j->sync.tokens_reused));
    json_object_set_new(o, "generation_settings", gen_settings(srv, j));
    if (j->req.prompt) {
        char *p = app_utf8_clean(j->req.prompt);
        json_object_set_new(o, "prompt", json_string(p ? p : ""));
        free(p);
    }
    json_object_set_new(o, "has_new_line", json_boolean(strchr(text, '\n') != NULL));
    json_object_set_new(o, "truncated", json_false());
    json_object_set_new(o, "stop_type", json_string(stop_type(j)));
    json_object_set_new(o, "stopping_word", json_string(""));
    json_object_set_new(o, "timings", timings);
    if (j->req.verbose) { /* llama-server's "__verbose": the prompt as the model saw it */
        char *p = app_utf8_clean(j->req.prompt ? j->req.prompt : "");
        json_object_set_new(o, "__verbose", json_pack("{s:s}", "prompt", p ? p : ""));
        free(p);
    }
    json_t *lps = final ? serve_logprobs_json(srv, j) : NULL;
    if (lps) json_object_set_new(o, "completion_probabilities", lps);
    return o;
}

/* ---------------------------------------------------------------------------------------- */
/* shared by the Anthropic and Responses translations                                       */

int compat_function_tool(json_t *tools, const char *name, const json_t *desc, const json_t *params) {
    json_t *fn = json_pack("{s:s}", "name", name);
    if (fn && json_is_string(desc)) json_object_set(fn, "description", (json_t *) desc);
    if (fn && params && !json_is_null(params)) json_object_set(fn, "parameters", (json_t *) params);
    return !fn || json_array_append_new(tools, json_pack("{s:s, s:o}", "type", "function", "function", fn)) ? -1 : 0;
}

int compat_chat_tokens(struct server *srv, json_t *chat, int32_t *n, struct serve_error *e) {
    *n = 0;
    struct job *j = calloc(1, sizeof *j);
    if (!j) return serve_error_oom(e);
    pthread_cond_init(&j->cv, NULL);
    json_object_del(chat, "stream");
    json_object_del(chat, "max_tokens"); /* not needed to count */
    int rc = serve_request_parse(srv, chat, j, true, e);
    kvt_token *t = NULL;
    if (rc == 0) {
        int r = kvt_chat_tokenize(srv->eng, j->req.msgs, j->req.n_msgs, !j->req.prefill,
                                  kvt_session_default_params().template_fallback, &t, n);
        if (r) {
            serve_error_lib(e, "chat template", r);
            rc = -1;
        }
    }
    free(t);
    serve_job_free(j);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* text endpoints                                                                           */

static bool opt_bool(const json_t *root, const char *k, bool dflt, bool *out, struct serve_error *e) {
    const json_t *v = json_object_get(root, k);
    *out = dflt;
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) {
        serve_error_param(e, k);
        serve_bad(e, "'%s' must be a boolean, got %s", k, serve_json_type(v));
        return false;
    }
    *out = json_is_true(v);
    return true;
}

/* Is s[0..n) valid UTF-8?  (A token's piece may be part of a character.) */
static bool valid_utf8(const char *s) {
    char *c = app_utf8_clean(s);
    bool ok = c && !strcmp(c, s);
    free(c);
    return ok;
}

/* The /tokenize reply is written as text (server/buf.c): a few bytes per token, where a JSON
** object per token held ~300 bytes of the allocator's until the reply was written (issue #38). */
static void jt_str(struct serve_buf *t, const char *s) { /* a JSON string of valid UTF-8 s */
    serve_buf_add(t, "\"", 1);
    for (const char *r = s; *r;) {
        size_t k = strcspn(r, "\"\\\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f\x10\x11\x12\x13\x14"
                              "\x15\x16\x17\x18\x19\x1a\x1b\x1c\x1d\x1e\x1f");
        serve_buf_add(t, r, k);
        r += k;
        if (!*r) break;
        char esc[8];
        snprintf(esc, sizeof esc, "\\u%04x", (unsigned char) *r++);
        serve_buf_add(t, esc, 6);
    }
    serve_buf_add(t, "\"", 1);
}

int compat_tokenize(struct server *srv, const json_t *root, char **out, struct serve_error *e) {
    *out = NULL;
    const json_t *c = json_object_get(root, "content");
    serve_error_param(e, "content");
    if (!json_is_string(c)) return serve_bad(e, "'content' must be a string, got %s", serve_json_type(c));
    bool add_special, parse_special, pieces;
    if (!opt_bool(root, "add_special", false, &add_special, e) || !opt_bool(root, "parse_special", true, &parse_special, e) ||
        !opt_bool(root, "with_pieces", false, &pieces, e))
        return -1;
    kvt_token *t = NULL;
    int32_t n = 0;
    int rc = kvt_tokenize(srv->eng, json_string_value(c), add_special, parse_special, &t, &n);
    if (rc) {
        serve_error_lib(e, "tokenize", rc);
        return -1;
    }
    struct serve_buf o = { 0 };
    serve_buf_add(&o, "{\"tokens\":[", 11);
    for (int32_t i = 0; i < n && !o.oom && rc == 0; i++) {
        char num[48];
        if (i) serve_buf_add(&o, ",", 1);
        if (!pieces) {
            serve_buf_add(&o, num, (size_t) snprintf(num, sizeof num, "%d", t[i]));
            continue;
        }
        char *piece = NULL;
        if ((rc = kvt_detokenize(srv->eng, &t[i], 1, true, &piece))) break;
        serve_buf_add(&o, num, (size_t) snprintf(num, sizeof num, "{\"id\":%d,\"piece\":", t[i]));
        if (valid_utf8(piece)) jt_str(&o, piece);
        else { /* part of a character: its bytes, as llama-server lists them */ serve_buf_add(&o, "[", 1);
            for (const unsigned char *b = (const unsigned char *) piece; *b; b++)
                serve_buf_add(&o, num,
                              (size_t) snprintf(num, sizeof num, "%s%u", b == (const unsigned char *) piece ? "" : ",", *b));
            serve_buf_add(&o, "]", 1);
        }
        serve_buf_add(&o, "}", 1);
        free(piece);
    }
    serve_buf_add(&o, "]}", 2);
    free(t);
    if (rc || o.oom) {
        free(o.s);
        if (rc) serve_error_lib(e, "tokenize", rc);
        else serve_error_oom(e);
        return -1;
    }
    serve_error_param(e, NULL);
    *out = o.s;
    return 0;
}

int compat_detokenize(struct server *srv, const json_t *root, json_t **out, struct serve_error *e) {
    const json_t *a = json_object_get(root, "tokens");
    serve_error_param(e, "tokens");
    if (!json_is_array(a)) return serve_bad(e, "'tokens' must be an array of token ids, got %s", serve_json_type(a));
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    size_t n = json_array_size(a);
    if (n > (size_t) 1 << 24) return serve_bad(e, "'tokens' has %zu ids; at most %d", n, 1 << 24);
    kvt_token *t = malloc(sizeof *t * (n ? n : 1));
    if (!t) return serve_error_oom(e);
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= I.n_vocab) {
            free(t);
            if (!json_is_integer(v)) return serve_bad(e, "'tokens[%zu]' must be a token id, got %s", i, serve_json_type(v));
            return serve_bad(e, "'tokens[%zu]' %lld is outside 0..%d (the model's vocabulary)", i,
                             (long long) json_integer_value(v), I.n_vocab - 1);
        }
        t[i] = (kvt_token) json_integer_value(v);
    }
    char *text = NULL;
    int rc = kvt_detokenize(srv->eng, t, (int32_t) n, false, &text);
    free(t);
    if (rc) {
        serve_error_lib(e, "detokenize", rc);
        return -1;
    }
    char *clean = app_utf8_clean(text);
    free(text);
    if (!clean) return serve_error_oom(e);
    *out = json_pack("{s:s}", "content", clean);
    free(clean);
    serve_error_param(e, NULL);
    return *out ? 0 : serve_error_oom(e);
}

int compat_apply_template(struct server *srv, json_t *root, json_t **out, struct serve_error *e) {
    struct job *j = calloc(1, sizeof *j);
    if (!j) return serve_error_oom(e);
    pthread_cond_init(&j->cv, NULL);
    int rc = serve_request_parse(srv, root, j, true, e);
    char *text = NULL;
    if (rc == 0) {
        int r = kvt_chat_format(srv->eng, j->req.msgs, j->req.n_msgs, true, kvt_session_default_params().template_fallback, &text);
        if (r) {
            serve_error_param(e, "messages");
            serve_error_lib(e, "chat template", r);
            rc = -1;
        }
    }
    serve_job_free(j);
    if (rc) return -1;
    char *clean = app_utf8_clean(text);
    free(text);
    if (!clean) return serve_error_oom(e);
    *out = json_pack("{s:s}", "prompt", clean);
    free(clean);
    return *out ? 0 : serve_error_oom(e);
}

/* ---------------------------------------------------------------------------------------- */
/* server description                                                                       */

static json_t *comma_list(const char *s) {
    json_t *a = json_array();
    for (const char *p = s; p && *p;) {
        size_t n = strcspn(p, ",");
        if (n) json_array_append_new(a, json_stringn(p, n));
        p += n + (p[n] == ',');
    }
    return a;
}

json_t *compat_models(struct server *srv) {
    json_t *m = json_pack("{s:s, s:s, s:I, s:s}", "id", srv->model_name, "object", "model", "created", (json_int_t) time(NULL),
                          "owned_by", "kvtier");
    if (m && srv->aliases) json_object_set_new(m, "aliases", comma_list(srv->aliases));
    if (m && srv->tags) json_object_set_new(m, "tags", comma_list(srv->tags));
    return json_pack("{s:s, s:[o]}", "object", "list", "data", m);
}

json_t *compat_props(struct server *srv) {
    struct kvt_engine_info I;
    kvt_engine_info(srv->eng, &I);
    json_t *params = json_pack("{s:I, s:f, s:i, s:i, s:f, s:f}", "seed", (json_int_t) srv->seed_default, "temperature",
                               (double) srv->temp_default, "n_predict", srv->n_predict_cap > 0 ? srv->n_predict_cap : -1, "top_k",
                               srv->top_k_default, "top_p", (double) srv->top_p_default, "min_p", (double) srv->min_p_default);
    /* the penalties' defaults (--repeat-penalty, ...; llama-server's params) */
    json_t *pen = json_pack("{s:f, s:f, s:f, s:i}", "repeat_penalty", (double) srv->repeat_penalty_default, "frequency_penalty",
                            (double) srv->frequency_penalty_default, "presence_penalty", (double) srv->presence_penalty_default,
                            "repeat_last_n", srv->repeat_last_n_default < 0 ? srv->n_ctx : srv->repeat_last_n_default);
    if (params && pen) json_object_update(params, pen);
    json_decref(pen);
    const struct kvt_sampling d = serve_sampling_defaults(srv);
    more_samplers(params, &d);
    return json_pack("{s:{s:i, s:o}, s:i, s:s, s:s, s:s, s:{s:b, s:b}, s:s, s:{s:i, s:i, s:i, s:i, s:i, s:s, s:i}}",
                     "default_generation_settings", "n_ctx", srv->budget, "params", params, "total_slots", srv->max_sessions,
                     /* with API keys the server's directories are not the tenants' business: the file's name */
                     "model_path",
                     srv->n_keys && strrchr(srv->model_path, '/') ? strrchr(srv->model_path, '/') + 1 : srv->model_path,
                     "model_alias", srv->model_name, "chat_template",
                     srv->chat_template_src ? srv->chat_template_src : (I.has_chat_template ? "(the GGUF's)" : ""), "modalities",
                     "vision", 0, "audio", 0, "build_info", kvt_build_info(), "kvtier", "budget", srv->budget, "block", srv->block,
                     "sessions", srv->max_sessions, "parallel", srv->parallel, "ctx_size", srv->n_ctx, "device", I.device,
                     "n_layer_device", I.n_layer_device);
}

json_t *compat_slots(struct server *srv, const char *ns) {
    json_t *a = json_array();
    pthread_mutex_lock(&srv->mu);
    int32_t k = 0;
    for (int32_t s = 0; a && s < srv->max_sessions; s++) {
        const struct sess_view *v = NULL;
        while (k < srv->n_views && srv->views[k].parked) k++;
        if (k < srv->n_views) v = &srv->views[k++];
        /* another key's session is an idle slot to this caller: whether it is busy says what
        ** another tenant does (issue #38) */
        const bool mine = v && !strcmp(v->ns, ns);
        json_t *slot = json_pack("{s:i, s:i, s:i, s:b}", "id", s, "id_task", -1, "n_ctx", srv->budget, "is_processing",
                                 mine && v->busy);
        if (slot && mine) /* the caller's own sessions only are named */
            json_object_set_new(slot, "kvtier",
                                json_pack("{s:s, s:i, s:i, s:i, s:I, s:I}", "session_id", v->id, "messages", v->n_messages,
                                          "total_tokens", v->total_tokens, "resident_tokens", v->resident_tokens, "evictions",
                                          (json_int_t) v->evictions, "recoveries", (json_int_t) v->recoveries));
        json_array_append_new(a, slot);
    }
    pthread_mutex_unlock(&srv->mu);
    return a;
}

int compat_slot_action(const struct server *srv, const char *id, const char *action, const json_t *root, int32_t *slot,
                       struct serve_error *e) {
    char shown[41];
    *slot = -1;
    serve_error_param(e, "id_slot");
    size_t n = strspn(id, "0123456789");
    serve_printable(shown, sizeof shown, id);
    if (n == 0 || id[n] || n > 9)
        return serve_bad(e, "/slots/%s: the slot must be a number, 0 .. %d (GET /slots lists them)", shown, srv->max_sessions - 1);
    const long v = strtol(id, NULL, 10);
    if (v >= srv->max_sessions)
        return serve_bad(e, "/slots/%s: this server has %d slots, 0 .. %d (GET /slots lists them)", shown, srv->max_sessions,
                         srv->max_sessions - 1);
    serve_error_param(e, "action");
    serve_printable(shown, sizeof shown, action);
    if (!action) return serve_bad(e, "/slots/%ld needs ?action=erase (save and restore: kvtier keeps no slot files)", v);
    if (!strcmp(action, "save") || !strcmp(action, "restore"))
        return serve_error_set(e, 501, "not_supported_error", NULL,
                               "/slots/%ld?action=%s: kvtier keeps no slot files; a session's KV blocks stay in the block store "
                               "(--store, across restarts) and a request that starts with the same tokens finds them there "
                               "again by content",
                               v, action);
    if (strcmp(action, "erase")) return serve_bad(e, "/slots/%ld?action=%s: the actions are erase, save and restore", v, shown);
    const char *k = root ? json_object_iter_key(json_object_iter((json_t *) root)) : NULL;
    if (k) {
        serve_error_param(e, k);
        serve_printable(shown, sizeof shown, k);
        return serve_bad(e, "/slots/%ld?action=erase takes no fields; got '%s'", v, shown);
    }
    serve_error_param(e, NULL);
    *slot = (int32_t) v;
    return 0;
}

enum { BATCH_MAX = 16 };

static int parse(struct server *srv, json_t *root, struct job *j, struct serve_error *e);

/* llama.cpp's batch completion: "prompt" holding several prompts (texts, id lists or
** {prompt_string} objects) on /completion answers a list, one reply per prompt, each prompt a
** job of its own run side by side.  Not streamed. */
static enum MHD_Result post_native_batch(struct server *srv, struct MHD_Connection *c, const char *ns, json_t *root) {
    json_t *prompts = json_object_get(root, "prompt");
    size_t k = json_array_size(prompts);
    struct serve_error e = { 0 };
    serve_error_param(&e, "prompt");
    /* its jobs wait in the queue together: more than one API key may queue never fits (a 400, as
    ** for n; a 429 would say retry to a request that cannot succeed) */
    const int32_t cap = KVT_MIN(srv->max_queue, srv->queue_per_key);
    if (k > BATCH_MAX) serve_bad(&e, "'prompt' holds %zu prompts; at most %d in one request", k, BATCH_MAX);
    else if (k > (size_t) cap)
        serve_bad(&e, "'prompt' holds %zu prompts, more than this server queues at once for one API key (%d, --queue%s)", k, cap,
                  srv->queue_per_key < srv->max_queue ? "-per-key" : "");
    else if (json_is_true(json_object_get(root, "stream"))) serve_bad(&e, "several prompts in one request are not streamed");
    struct job *jobs[BATCH_MAX] = { 0 };
    size_t n = 0;
    for (; !e.status && n < k; n++) {
        json_t *one = json_copy(root);
        struct job *j = calloc(1, sizeof *j);
        if (one) json_object_set(one, "prompt", json_array_get(prompts, n));
        if (!one || !j) {
            json_decref(one);
            free(j);
            serve_error_oom(&e);
            break;
        }
        jobs[n] = j;
        j->kind = JOB_COMPLETION;
        j->req.api = &serve_api_native;
        snprintf(j->req.ns, sizeof j->req.ns, "%s", ns);
        pthread_cond_init(&j->cv, NULL);
        parse(srv, one, j, &e);
        json_decref(one);
    }
    json_decref(root);
    size_t submitted = e.status ? 0 : serve_run_jobs(srv, c, jobs, n, &e);
    json_t *out = e.status ? NULL : json_array();
    for (size_t i = 0; i < n; i++) {
        struct job *j = jobs[i];
        if (!j) continue;
        if (i >= submitted) { /* parsed, never queued */
            serve_job_free(j);
            continue;
        }
        if (!e.status && out) {
            json_t *r = compat_native_reply(srv, j, "", true, serve_mono_ms());
            char *clean = app_utf8_clean(j->text ? j->text : "");
            if (r && clean) json_object_set_new(r, "content", json_string(clean));
            if (r) json_object_set_new(r, "index", json_integer((json_int_t) i));
            free(clean);
            json_array_append_new(out, compat_response_fields(j, r));
        }
        serve_job_release(srv, j);
    }
    if (e.status) {
        json_decref(out);
        return serve_send_err(srv, c, &e, NULL);
    }
    return serve_send_json(srv, c, 200, out, NULL);
}

/* ---------------------------------------------------------------------------------------- */
/* the module (api.h): llama-server's native /completion                                    */

/* grammar and json_schema (llama-server's constraints of a completion): compiled as on the chat
** route (server/tools.c), then taken out of root so that the completion parser sees none */
static int native_constraint(struct server *srv, json_t *root, struct job *j, struct serve_error *e) {
    json_t *js = json_object_get(root, "json_schema"), *g = json_object_get(root, "grammar");
    if ((!js || json_is_null(js)) && (!g || json_is_null(g))) return 0;
    json_t *only = json_object();
    char *sys_extra = NULL;
    if (!only || (js && json_object_set(only, "json_schema", js)) || (g && json_object_set(only, "grammar", g))) {
        json_decref(only);
        return serve_error_oom(e);
    }
    int rc = tools_parse(only, j, &srv->lim, &sys_extra, e);
    free(sys_extra); /* no tools: none */
    json_decref(only);
    j->req.format = REPLY_TEXT; /* the reply is the text as generated (the grammar shapes it) */
    if (rc == 0) {
        json_object_del(root, "json_schema");
        json_object_del(root, "grammar");
    }
    return rc;
}

static int parse(struct server *srv, json_t *root, struct job *j, struct serve_error *e) {
    j->kind = JOB_COMPLETION;
    serve_request_slot(j, root);
    if (compat_native_params(srv, root, j, e)) return -1;
    if (native_constraint(srv, root, j, e)) return -1;
    return serve_request_parse(srv, root, j, false, e);
}

static int fan_out(struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid, json_t *root,
                   enum MHD_Result *ret) {
    (void) sid;
    const json_t *pr = json_object_get(root, "prompt");
    bool batch = json_array_size(pr) > 1;
    for (size_t i = 0; batch && i < json_array_size(pr); i++) batch = !json_is_integer(json_array_get(pr, i));
    if (!batch) return 0; /* one prompt (ids and texts mixed are one sequence) */
    *ret = post_native_batch(srv, c, ns, root);
    return 1;
}

static json_t *reply(struct server *srv, struct job *j) {
    return compat_response_fields(j, compat_native_reply(srv, j, j->text ? j->text : "", true, serve_mono_ms()));
}

static void s_start(struct stream *st) { (void) st; } /* llama-server's stream begins with the text */

static void s_progress(struct stream *st, const struct prompt_progress *p) {
    const struct job *j = st->j;
    json_t *ev = compat_native_reply(st->srv, j, "", false, 0);
    serve_progress_attach(ev, j, p);
    sse_data(st, ev);
}

static void s_piece(struct stream *st, const char *piece, json_t *tm, json_t *lps) {
    json_t *ch = compat_native_reply(st->srv, st->j, piece, false, 0);
    if (ch && tm) json_object_set(ch, "timings", tm);
    if (ch && lps) json_object_set(ch, "completion_probabilities", lps);
    sse_data(st, ch);
}

/* llama.cpp's last event: stop true and the timings, no [DONE]; an error is followed by one */
static void s_end(struct stream *st, const char *fin) {
    (void) fin;
    const struct job *j = st->j;
    if (j->err.status && j->err.status != 200) {
        sse_data(st, serve_error_json(&j->err));
        sse_raw(st, "data: [DONE]\n\n");
    } else sse_data(st, compat_native_reply(st->srv, j, "", true, serve_mono_ms()));
}

const struct serve_api serve_api_native = {
    .name = "native",
    .parse = parse,
    .fan_out = fan_out,
    .reply = reply,
    .error = serve_error_json,
    .s_start = s_start,
    .s_progress = s_progress,
    .s_piece = s_piece,
    .s_end = s_end,
};
