/* fuzz_api.c — the translators of the server's other APIs and the writers of their replies
** (issue #38), untrusted on both sides: a request body comes from any client with a key, and a
** reply's text from a model a prompt can steer.  The first byte picks the path, the rest is the
** input:
**   0  a Responses request (server/responses.c) continuing a stored conversation of three
**      responses with a tool call: the chat request it means, or its error;
**   1  an Anthropic Messages request (server/anthropic.c) -> a chat request, or its error;
**   2  llama-server's native /completion fields (compat_native_params) then the completion
**      parser (server/request.c), as /completion runs them;
**   3  a model's reply text through tools_reply (tool calls parsed out of it, the three reply
**      formats), then every writer of a finished reply: the Responses output items and object,
**      the Anthropic Message and its blocks, llama-server's native reply; each is written out.
**   4  llama-server's slot action (compat_slot_action): the path's slot id, NUL, the action query
**      parameter (absent without a second NUL), NUL, the JSON body (none when empty): erase of a
**      slot 0 .. --parallel sessions - 1, or its error.
** Invariants: a translation either fails with its error filled (status >= 400, type, message),
** or gives an object with messages; a stored response is never changed by a request (its JSON
** text is compared before and after every input); every reply object is written as JSON. */
#include "fuzz.h"
#include "fuzz_server.h"
#include "fields.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static struct server srv;
static char stored_text[3][4096]; /* the stored responses' GET objects, as written before the input */
static char ids[3][48];

static void setup(void) {
    fuzz_server_defaults(&srv);
    /* a conversation of three stored responses: a question, a tool call, its answer */
    const char *replies[3] = { "{\"role\":\"assistant\",\"content\":\"Hello.\"}",
                               ("{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\","
                                "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]}"),
                               "{\"role\":\"assistant\",\"content\":\"It is sunny.\"}" };
    for (int i = 0; i < 3; i++) {
        resp_new_id(ids[i], sizeof ids[i]);
        json_t *msg = json_loads(replies[i], 0, NULL), *turn = json_pack("[{s:s, s:s}]", "role", "user", "content", "q");
        FUZZ_CHECK(msg && turn);
        json_t *obj = resp_object(&srv, NULL, ids[i], i ? ids[i - 1] : "", resp_output(&srv, msg, "msg_1"), "completed");
        resp_store(&srv, "", ids[i], i ? ids[i - 1] : "", turn, msg, obj);
        json_decref(obj);
        json_decref(turn);
        json_decref(msg);
    }
    for (int i = 0; i < 3; i++) {
        json_t *o = resp_get(&srv, "", ids[i]);
        char *t = json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS);
        FUZZ_CHECK(o && t && strlen(t) < sizeof stored_text[i]);
        strcpy(stored_text[i], t);
        free(t);
        json_decref(o);
    }
}

static void written(json_t *o) { /* a reply object exists and is written out as JSON */
    FUZZ_CHECK(o != NULL);
    char *t = json_dumps(o, JSON_COMPACT | JSON_ENCODE_ANY);
    FUZZ_CHECK(t != NULL);
    free(t);
    json_decref(o);
}

static void translate(int api, json_t *root) {
    json_t *chat = NULL, *turn = NULL, *ign = NULL;
    char parent[48];
    struct serve_error se = { 0 };
    if (api == 0 && json_is_object(root) && !json_object_get(root, "previous_response_id") && (json_object_size(root) & 1))
        json_object_set_new(root, "previous_response_id", json_string(ids[2])); /* half the inputs continue the stored chain */
    int rc = api == 0 ? resp_to_chat(&srv, "", root, &chat, &turn, parent, sizeof parent, &ign, &se)
                      : anth_to_chat(root, &srv.lim, &chat, &ign, &se);
    FUZZ_CHECK(rc == 0 || (se.status >= 400 && se.type && se.msg[0]));
    if (rc == 0) FUZZ_CHECK(json_is_object(chat) && json_is_array(json_object_get(chat, "messages")));
    if (rc == 0 && api == 0) FUZZ_CHECK(json_is_array(turn));
    if (rc == 0) { /* then parsed as /v1/chat/completions parses it */
        struct job *j = calloc(1, sizeof *j);
        FUZZ_CHECK(j != NULL);
        struct serve_error pe = { 0 };
        int prc = serve_fields_check(FIELD_TABLE_OPENAI, chat, &j->req.ignored, &pe);
        if (prc == 0) prc = serve_request_parse(&srv, chat, j, true, &pe);
        FUZZ_CHECK(prc == 0 || (pe.status >= 400 && pe.type && pe.msg[0]));
        pthread_cond_init(&j->cv, NULL);
        serve_job_free(j);
    }
    json_decref(chat);
    json_decref(turn);
    FUZZ_CHECK(json_array_size(ign) <= 16); /* the names listed back: capped */
    json_decref(ign);
    for (int i = 0; i < 3; i++) { /* the stored conversation is as it was stored */
        json_t *o = resp_get(&srv, "", ids[i]);
        char *t = json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS);
        FUZZ_CHECK(o && t && !strcmp(t, stored_text[i]));
        free(t);
        json_decref(o);
    }
}

static void native(json_t *root) {
    struct job *j = calloc(1, sizeof *j);
    FUZZ_CHECK(j != NULL);
    struct serve_error se = { 0 };
    int rc = compat_native_params(&srv, root, j, &se);
    if (rc == 0) rc = serve_request_parse(&srv, root, j, false, &se);
    FUZZ_CHECK(rc == 0 || (se.status >= 400 && se.type && se.msg[0]));
    if (rc == 0) {
        FUZZ_CHECK(j->req.llama_probs && j->req.top_logprobs >= 0 && j->req.top_logprobs <= 100);
        FUZZ_CHECK(j->req.max_tokens >= 1 && j->req.max_tokens <= srv.n_ctx);
    }
    pthread_cond_init(&j->cv, NULL);
    serve_job_free(j);
}

static void slot_action(const uint8_t *data, size_t size) {
    char *in = malloc(size + 1);
    FUZZ_CHECK(in != NULL);
    memcpy(in, data, size);
    in[size] = '\0';
    const char *id = in, *action = NULL, *body = NULL;
    size_t n_id = strlen(in), n_body = 0;
    if (n_id < size) {
        action = in + n_id + 1;
        size_t n_act = strlen(action);
        if (n_id + 1 + n_act < size) {
            body = action + n_act + 1;
            n_body = size - (n_id + 1 + n_act + 1);
        }
    }
    json_t *root = n_body ? json_loadb(body, n_body, 0, NULL) : NULL;
    if (n_body && !json_is_object(root)) { /* the route answers these before the parser */
        json_decref(root);
        free(in);
        return;
    }
    struct serve_error se = { 0 };
    int32_t slot = -2;
    const int rc = compat_slot_action(&srv, id, action, root, &slot, &se);
    FUZZ_CHECK(rc == 0 || ((se.status == 400 || se.status == 501) && se.type && se.msg[0]));
    if (rc == 0) FUZZ_CHECK(slot >= 0 && slot < srv.max_sessions && action && !strcmp(action, "erase") && !json_object_size(root));
    else FUZZ_CHECK(slot == -1);
    json_t *err = serve_error_json(&se); /* what the client gets: JSON, its text printable */
    if (rc) written(err);
    else json_decref(err);
    json_decref(root);
    free(in);
}

static void replies(const char *text) {
    struct job j;
    memset(&j, 0, sizeof j);
    j.kind = JOB_CHAT;
    j.finish = "stop";
    j.req.max_tokens = 16;
    j.text = (char *) text;
    for (int format = REPLY_TEXT; format <= REPLY_TOOLS; format++) {
        j.req.format = (enum reply_format) format;
        const char *fin = "stop";
        json_t *msg = tools_reply(&srv, text, format, &fin);
        FUZZ_CHECK(msg != NULL && json_is_object(msg) && fin != NULL);
        FUZZ_CHECK(json_is_string(json_object_get(msg, "content")) || json_is_null(json_object_get(msg, "content")));
        written(resp_output(&srv, msg, "msg_1"));
        written(resp_object(&srv, &j, "resp_x", "", resp_output(&srv, msg, "msg_1"), "completed"));
        written(anth_message(&srv, &j, msg, fin));
        written(anth_blocks(msg));
        json_decref(msg);
    }
    written(compat_native_reply(&srv, &j, text, true, 1.0));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!srv.n_ctx) setup();
    if (size < 1) return 0;
    int path = data[0] & 7;
    if (path > 4) path &= 3;
    if (path == 4) {
        slot_action(data + 1, size - 1);
        return 0;
    }
    if (path == 3) {
        char *text = malloc(size);
        FUZZ_CHECK(text != NULL);
        memcpy(text, data + 1, size - 1);
        text[size - 1] = '\0';
        replies(text);
        free(text);
        return 0;
    }
    json_t *root = json_loadb((const char *) data + 1, size - 1, 0, NULL);
    if (!root) return 0;
    if (json_is_object(root)) {
        if (path == 2) native(root);
        else translate(path, root);
    }
    json_decref(root);
    return 0;
}
