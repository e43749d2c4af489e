/* error.c — the server's one error form (struct serve_error, serve.h): filled where an error
** arises, sent as an OpenAI error object (or in the API's own shape, server/api.h) by server/reply.c. */
#include "serve.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void set_msg(struct serve_error *e, const char *fmt, va_list ap) { vsnprintf(e->msg, sizeof e->msg, fmt, ap); }

int serve_error_set(struct serve_error *e, int status, const char *type, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_msg(e, fmt, ap);
    va_end(ap);
    e->status = status;
    e->type = type;
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    return -1;
}

void serve_printable(char *dst, size_t cap, const char *src) {
    size_t n = src ? strlen(src) : 0;
    if (n >= cap) {
        n = cap - 1;
        while (n > 0 && ((unsigned char) src[n] & 0xC0) == 0x80) n--; /* src[n] starts the first character left out */
    }
    for (size_t i = 0; i < n; i++) dst[i] = (unsigned char) src[i] < 0x20 || src[i] == 0x7f ? '?' : src[i];
    dst[n] = '\0';
}

void serve_error_param(struct serve_error *e, const char *name) { serve_printable(e->param, sizeof e->param, name); }

int serve_bad(struct serve_error *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set_msg(e, fmt, ap);
    va_end(ap);
    e->status = 400;
    e->type = "invalid_request_error";
    e->code[0] = '\0';
    return -1;
}

int serve_error_oom(struct serve_error *e) {
    serve_error_param(e, NULL);
    return serve_error_set(e, 500, "server_error", NULL, "out of memory");
}

void serve_error_lib(struct serve_error *e, const char *what, int rc) {
    if (rc == KVT_ECTX || rc == KVT_EBUDGET) /* llama-server's type, OpenAI's code */
        serve_error_set(e, 400, "exceed_context_size_error", "context_length_exceeded", "%s: %s", what, kvt_errmsg());
    else if (rc == KVT_EINVAL) serve_error_set(e, 400, "invalid_request_error", NULL, "%s: %s", what, kvt_errmsg());
    else serve_error_set(e, 500, "server_error", NULL, "%s: %s: %s", what, kvt_strerror(rc), kvt_errmsg());
}

json_t *serve_error_json(const struct serve_error *e) {
    char *clean = app_utf8_clean(e->msg);
    json_t *param = e->param[0] ? json_string(e->param) : NULL; /* NULL also for bytes that are not UTF-8 */
    json_t *o = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", clean ? clean : "error", "type",
                          e->type ? e->type : "server_error", "param", param ? param : json_null(), "code",
                          e->code[0] ? json_string(e->code) : json_null());
    free(clean);
    json_t *eo = json_object_get(o, "error");
    if (eo && e->n_prompt_tokens > 0) json_object_set_new(eo, "n_prompt_tokens", json_integer(e->n_prompt_tokens));
    if (eo && e->n_ctx > 0) json_object_set_new(eo, "n_ctx", json_integer(e->n_ctx));
    return o;
}

/* "an object", "a string", ... for the messages that say what a field was given. */
const char *serve_json_type(const json_t *v) {
    if (!v) return "nothing (the field is missing)";
    switch (json_typeof(v)) {
        case JSON_OBJECT: return "an object";
        case JSON_ARRAY: return "an array";
        case JSON_STRING: return "a string";
        case JSON_INTEGER: return "an integer";
        case JSON_REAL: return "a number";
        case JSON_TRUE:
        case JSON_FALSE: return "a boolean";
        default: return "null";
    }
}
