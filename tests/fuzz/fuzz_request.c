/* fuzz_request.c — the body of POST /v1/chat/completions and /v1/completions (untrusted: any
** client with a key sends it) through the server's parser: JSON, then server/request.c
** (sampling and its repetition penalties, stop, messages, tool calls and results) and server/tools.c (tools, tool_choice,
** response_format: JSON schema to GBNF, bounded by the caps of struct serve_limits).  Each input
** is parsed as a chat and as a completion, by the API modules' parse (server/api_openai.c: the
** field table first).  Invariants: a parse either fails with its error
** filled (status, type, message), or succeeds with messages whose last one is from the user and a grammar within
** 1 MiB; the work per input is bounded by the caps (libFuzzer's -timeout catches a bomb). */
#include "fuzz.h"
#include "fuzz_server.h"
#include "api.h"

#include <jansson.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static struct server srv;
    if (!srv.n_ctx) fuzz_server_defaults(&srv);
    json_error_t e;
    json_t *root = json_loadb((const char *) data, size, 0, &e);
    if (!root) return 0;
    if (!json_is_object(root)) {
        json_decref(root);
        return 0;
    }
    for (int chat = 0; chat < 2; chat++) {
        struct job *j = calloc(1, sizeof *j);
        FUZZ_CHECK(j != NULL);
        struct serve_error se = { 0 };
        j->req.api = chat ? &serve_api_chat : &serve_api_completions;
        int rc = j->req.api->parse(&srv, root, j, &se);
        FUZZ_CHECK(rc == 0 || (se.status >= 400 && se.type && se.msg[0])); /* no failure without its error */
        if (rc == 0 && chat) {
            FUZZ_CHECK(j->req.n_msgs > 0); /* ends with the user's message, or the assistant's to continue (a prefill) */
            FUZZ_CHECK(!strcmp(j->req.msgs[j->req.n_msgs - 1].role, j->req.prefill ? "assistant" : "user"));
            for (int32_t i = 0; i < j->req.n_msgs; i++) FUZZ_CHECK(j->req.msgs[i].role && j->req.msgs[i].content);
        }
        if (rc == 0 && !chat) FUZZ_CHECK(j->req.prompt != NULL || (j->req.prompt_ids && j->req.n_prompt_ids > 0));
        if (rc == 0) { /* repetition penalties within their fields' ranges, a window of 1 .. n_ctx tokens */
            const struct kvt_sampling *p = &j->req.smp;
            FUZZ_CHECK(p->frequency_penalty >= -2 && p->frequency_penalty <= 2 && p->presence_penalty >= -2 && p->presence_penalty <= 2);
            FUZZ_CHECK(p->repeat_penalty >= 0 && p->repeat_penalty <= 10);
            FUZZ_CHECK(p->penalty_last_n >= 1 && p->penalty_last_n <= srv.n_ctx);
        }
        if (rc == 0 && j->req.grammar) FUZZ_CHECK(strlen(j->req.grammar) <= (1u << 20) && strstr(j->req.grammar, "root ::= "));
        /* a refused request's job is freed unused: its limits are checked where it would run */
        if (rc == 0) FUZZ_CHECK(j->req.max_tokens >= 1 && j->req.max_tokens <= srv.n_ctx);
        FUZZ_CHECK(j->req.n_stop <= SERVE_MAX_STOP);
        pthread_cond_init(&j->cv, NULL);
        serve_job_free(j);
    }
    /* the same body as an Anthropic Messages and a Responses request: translated into a chat
    ** request (an object with messages) or refused with its error, nothing else */
    for (int api = 0; api < 2; api++) {
        json_t *chat = NULL, *turn = NULL, *ign = NULL;
        char parent[48];
        struct serve_error se = { 0 };
        int rc = api ? resp_to_chat(&srv, "", root, &chat, &turn, parent, sizeof parent, &ign, &se)
                     : anth_to_chat(root, &srv.lim, &chat, &ign, &se);
        FUZZ_CHECK(rc == 0 || (se.status >= 400 && se.type && se.msg[0]));
        if (rc == 0) FUZZ_CHECK(json_is_object(chat) && json_is_array(json_object_get(chat, "messages")));
        if (rc == 0 && api) FUZZ_CHECK(json_is_array(turn));
        json_decref(chat);
        json_decref(turn);
        FUZZ_CHECK(json_array_size(ign) <= 16); /* the names listed back: capped */
        json_decref(ign);
    }
    json_decref(root);
    return 0;
}
