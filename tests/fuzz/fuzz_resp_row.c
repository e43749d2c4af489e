/* fuzz_resp_row.c — a stored response's row body read back from the block store's index, and its
** copy read back from Redis (respdb_parse_record: the JSON wrapper around parent, times, body and
** MAC; then the body as a row's)
** (server/respdb.c: untrusted as disk bytes are; the MAC is checked before it, but a store
** written under a leaked secret, or a bug, must still not crash the server): the body through
** respdb_decode_row, then, as a continuation would, the decoded turn replayed as the chat
** messages of a request and parsed by the chat API (server/api_openai.c, server/request.c).
** Invariants: a decode either fails with its reason or gives an array of messages with string
** roles and an object; the chat parse either succeeds or fails with its error filled; nothing is
** kept (LeakSanitizer). */
#include "fuzz.h"
#include "fuzz_server.h"
#include "api.h"

#include <jansson.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static struct server srv;
    if (!srv.n_ctx) fuzz_server_defaults(&srv);
    json_t *turn = NULL, *obj = NULL;
    char why[200] = "";
    { /* as a Redis copy: parsed whole or refused with its reason */
        char parent[48];
        int64_t created = 0, expires = 0;
        char *body = NULL;
        unsigned char mac[32];
        int pr = respdb_parse_record(data, size, parent, sizeof parent, &created, &expires, &body, mac, why, sizeof why);
        FUZZ_CHECK((pr == 1 && body && strlen(parent) < sizeof parent) || (pr == -1 && !body && why[0]));
        if (pr == 1 && respdb_decode_row(body, strlen(body), &turn, &obj, why, sizeof why) == 0) {
            json_decref(turn);
            json_decref(obj);
        }
        free(body);
        turn = obj = NULL;
        why[0] = '\0';
    }
    int rc = respdb_decode_row(data, size, &turn, &obj, why, sizeof why);
    FUZZ_CHECK(rc == 0 || (rc == -1 && why[0] && !turn && !obj));
    if (rc) return 0;
    FUZZ_CHECK(json_is_array(turn) && json_is_object(obj));
    size_t i;
    json_t *m;
    json_array_foreach(turn, i, m) FUZZ_CHECK(json_is_string(json_object_get(m, "role")));
    json_t *msgs = json_deep_copy(turn);
    json_t *root = json_pack("{s:s, s:o}", "model", "m", "messages", msgs ? msgs : json_array());
    if (root) json_array_append_new(json_object_get(root, "messages"), json_pack("{s:s, s:s}", "role", "user", "content", "next"));
    struct job *j = calloc(1, sizeof *j);
    FUZZ_CHECK(j != NULL);
    struct serve_error se = { 0 };
    j->req.api = &serve_api_chat;
    if (root) {
        int prc = j->req.api->parse(&srv, root, j, &se);
        FUZZ_CHECK(prc == 0 || (se.status >= 400 && se.type && se.msg[0]));
    }
    pthread_cond_init(&j->cv, NULL);
    serve_job_free(j);
    json_decref(root);
    json_decref(turn);
    json_decref(obj);
    return 0;
}
