/* fuzz_stream.c — the streaming event writers of the server (server/stream.c driving the API
** modules: OpenAI's chat and completion chunks, llama-server's native events, the Responses
** events, Anthropic's events)
** over a reply text a model wrote (a prompt can steer it to any bytes: cut characters, control
** characters, JSON that is almost a tool call).  stream.c's reader is static there, so the
** harness is compiled with it.  The first byte picks the API (2 bits), a tool-call reply format,
** chat or completion, finish "length", a failed job, Responses' tool calls; the rest is the
** reply text.  The job is done before the stream starts (nothing waits).
** Invariants: the stream ends (bounded reads); every "data: " line is JSON (or [DONE]); each API
** ends with its closing event — a choice with a finish_reason (OpenAI), stop true (native),
** response.completed / incomplete or an error (Responses), message_stop or an error
** (Anthropic). */
#include "fuzz.h"
#include "fuzz_server.h"

#include "../../server/stream.c" /* its reader is static there */

static struct server fsrv;

static bool ends_well(int api, const json_t *last, bool failed) {
    const char *type = json_string_value(json_object_get(last, "type"));
    if (failed) return json_object_get(last, "error") || (type && !strcmp(type, "error"));
    switch (api) {
        case 0: {
            const json_t *c = json_array_get(json_object_get(last, "choices"), 0);
            return json_is_string(json_object_get(c, "finish_reason"));
        }
        case 1: return json_is_true(json_object_get(last, "stop"));
        case 2: return type && (!strcmp(type, "response.completed") || !strcmp(type, "response.incomplete"));
        default: return type && !strcmp(type, "message_stop");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!fsrv.n_ctx) {
        fuzz_server_defaults(&fsrv);
        pthread_mutex_init(&fsrv.mu, NULL);
    }
    if (size < 1 || size > 65536) return 0;
    const int flags = data[0], api = flags & 3; /* 0 OpenAI, 1 native, 2 Responses, 3 Anthropic */
    struct job *j = calloc(1, sizeof *j);
    FUZZ_CHECK(j != NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->state = JOB_DONE;
    j->kind = api >= 2 || (flags & 8) ? JOB_CHAT : JOB_COMPLETION;
    j->req.stream = true;
    static const struct serve_api *const apis[] = { &serve_api_completions, &serve_api_native, &serve_api_responses,
                                                    &serve_api_anthropic };
    j->req.api = api == 0 && j->kind == JOB_CHAT ? &serve_api_chat : apis[api];
    j->req.llama_probs = api == 1;
    j->req.format = (flags & 4) && j->kind == JOB_CHAT ? REPLY_TOOLS : REPLY_TEXT;
    j->req.max_tokens = 16;
    j->finish = flags & 16 ? "length" : "stop";
    snprintf(j->req.resp_id, sizeof j->req.resp_id, "resp_fuzz");
    if (flags & 32) serve_error_set(&j->err, 500, "server_error", NULL, "the engine failed");
    j->text = malloc(size);
    FUZZ_CHECK(j->text != NULL);
    memcpy(j->text, data + 1, size - 1);
    j->text[size - 1] = '\0';
    j->n_text = strlen(j->text);
    struct stream *st = calloc(1, sizeof *st);
    FUZZ_CHECK(st != NULL);
    st->srv = &fsrv;
    st->j = j;
    st->peer_fd = -1;
    pthread_mutex_init(&st->qmu, NULL);
    st->refs = 1;
    st->tools_text = -1;
    /* the whole stream */
    struct serve_buf out = { 0 };
    char buf[4096];
    ssize_t n;
    int reads = 0;
    while ((n = stream_read(st, 0, buf, sizeof buf)) != (ssize_t) MHD_CONTENT_READER_END_OF_STREAM) {
        FUZZ_CHECK(n > 0 && ++reads < 100000);
        serve_buf_add(&out, buf, (size_t) n);
    }
    FUZZ_CHECK(!out.oom && out.n > 0);
    /* its events: every data line JSON, the last one the API's closing event */
    json_t *last = NULL;
    for (char *line = out.s, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        if (strncmp(line, "data: ", 6) || !strcmp(line + 6, "[DONE]")) continue;
        json_error_t e;
        json_t *ev = json_loads(line + 6, 0, &e);
        FUZZ_CHECK(ev != NULL);
        json_decref(last);
        last = ev;
    }
    FUZZ_CHECK(last != NULL && ends_well(api, last, (flags & 32) != 0));
    json_decref(last);
    free(out.s);
    stream_unref(st); /* frees the job */
    return 0;
}
