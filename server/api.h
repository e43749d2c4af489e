/* api.h — one module per API that `kvtier serve` speaks, behind one struct of functions.
**
** A generation route names its module in the route table (server/routes.c); generate.c and
** stream.c call the module and nothing else that knows the API: parse the request into the
** common job, write the final reply, write the stream's events, write an error in the API's
** shape.  Adding an API is one new module and one row of the route table.  The modules:
**
**   serve_api_chat, serve_api_completions   OpenAI Chat Completions, Completions (api_openai.c)
**   serve_api_native                        llama-server's native /completion (compat.c)
**   serve_api_anthropic                     Anthropic Messages (anthropic.c)
**   serve_api_responses                     OpenAI Responses (responses.c)
**
** All run on HTTP threads; the engine thread hands out text, token ids and probabilities only. */
#ifndef KVT_SERVER_API_H
#define KVT_SERVER_API_H

#include "http.h"

/* A streamed reply (stream.c): the job, the events written so far, and the module's own state. */
struct stream {
    struct server *srv;
    struct MHD_Connection *c; /* the connection (event-driven: resumed when bytes are produced) */
    int peer_fd;              /* a dup of the client's socket: to notice a client that leaves while
                              ** nothing is sent (the connection may be gone when it is read) */
    struct job *j;
    /* event-driven: the worker produces the events (stream.c) into q; libmicrohttpd's thread
    ** takes them, suspending the connection when q is empty */
    pthread_mutex_t qmu;
    char *q;
    size_t q_n, q_off, q_cap;
    bool eof, closed, suspended;
    int refs;       /* the response's and the producer's (event-driven); under qmu */
    int phase;      /* 0 start, 1 text, 3 done */
    int tools_text; /* a reply under tools: -1 not known yet, 1 plain text (streamed), 0 a call or JSON (sent whole) */
    char *out;      /* events written, not yet handed out */
    size_t n_out, off;
    char id[64]; /* OpenAI: the chunks' id */
    union {      /* the module's state */
        struct {
            int open; /* index of the content block open (-1 none) */
            int next; /* the next block's index */
        } anth;
        struct {
            int seq;           /* the next event's sequence_number */
            int items;         /* output items announced so far */
            bool open;         /* the message item's output_text part is open */
            char item[48];     /* the message item's id */
            json_t *timings;   /* with timings_per_token: what the next output_text delta carries (borrowed) */
            json_t *msg, *out; /* a reply sent whole (under tools): its message and items (owned) */
        } resp;
    } u;
};

/* Write one event: "data: JSON\n\n" (obj consumed; NULL writes nothing). */
void sse_data(struct stream *st, json_t *obj);
/* Write "event: TYPE\n" (obj's "type") and its data. */
void sse_event(struct stream *st, json_t *obj);
/* Write raw bytes (a terminator such as "data: [DONE]\n\n"). */
void sse_raw(struct stream *st, const char *s);

struct serve_api {
    const char *name;
    /* Parse root (borrowed) into j: j->req.ns, session_id and api are set.  0, or -1 with e. */
    int (*parse)(struct server *srv, json_t *root, struct job *j, struct serve_error *e);
    /* A request that is several jobs (OpenAI's n > 1, llama-server's batch of prompts): answered
    ** whole here (root consumed) and 1 returned with the reply's result in *ret; 0: one job. */
    int (*fan_out)(struct server *srv, struct MHD_Connection *c, const char *ns, const char *sid, json_t *root,
                   enum MHD_Result *ret);
    json_t *(*reply)(struct server *srv, struct job *j); /* the unstreamed reply of a finished job */
    json_t *(*error)(const struct serve_error *e);       /* an error body in the API's shape */
    /* the stream: its first events; a prompt-progress event (NULL: none are sent); a reply under
    ** tools sent whole (msg: tools_reply's message, consumed); a piece of text (piece may be
    ** empty when only timings or probabilities are new; timings and lps borrowed, may be NULL);
    ** the last events (the job's error, or its end with finish reason fin); its state freed */
    void (*s_start)(struct stream *st);
    void (*s_progress)(struct stream *st, const struct prompt_progress *p);
    void (*s_whole)(struct stream *st, json_t *msg, const char **fin);
    void (*s_piece)(struct stream *st, const char *piece, json_t *timings, json_t *lps);
    void (*s_end)(struct stream *st, const char *fin);
    void (*s_free)(struct stream *st);
};

extern const struct serve_api serve_api_chat, serve_api_completions, serve_api_native, serve_api_anthropic, serve_api_responses;

#endif
