/* http.h — what the HTTP side of `kvtier serve` shares among its files (not installed).
**
**   http.c      connections: libmicrohttpd, deadlines, API keys, workers; calls routes.c
**   routes.c    the route table and the handlers that are not an API's (tokenizer, sessions, ...)
**   generate.c  a generation request: the API module's parse, the job, its reply or stream
**   stream.c    server-sent events: the job's text handed to the API module's stream writers
**   reply.c     replies (JSON, text, errors in the API's shape), waits that watch the socket
**   api.h       one module per API (api_openai.c, compat.c, anthropic.c, responses.c)
**
** Everything here runs on HTTP threads (connection or worker), never the engine thread. */
#ifndef KVT_SERVER_HTTP_H
#define KVT_SERVER_HTTP_H

#include "serve.h"

#include <microhttpd.h>
#include <time.h>

struct serve_api;
struct stream;

/* One request on one connection: its body as it arrives, the tenant and key check done when the
** headers arrived, and, on an event-driven connection, the reply a worker made for it. */
struct req {
    char *body;
    size_t n, cap;
    bool too_big;
    char ns[40];     /* the caller's tenant, from the headers */
    bool authorized; /* the key was checked when the headers arrived */
    /* event-driven connections (http.c, "workers"): a request that may wait is answered by a
    ** worker thread while its connection is suspended; the reply it made is queued when the
    ** connection is resumed */
    bool in_worker, reply_ready;
    unsigned reply_status;
    struct server *srv;
    struct MHD_Connection *c;
    struct MHD_Response *reply; /* NULL with reply_ready: close the connection (MHD_NO) */
    char *url, *method;         /* copies for the worker */
    /* set by the router for the route's handler */
    bool v1, get;        /* the URL had /v1; the method is GET */
    const char *url_now; /* the URL as requested */
};

/* Wait (under srv->mu) until the job satisfies cond. */
#define WAIT_UNTIL(cond)                                     \
    do {                                                     \
        while (!(cond)) pthread_cond_wait(&j->cv, &srv->mu); \
    } while (0)

/* ---- reply.c ---------------------------------------------------------------------------- */

size_t serve_utf8_prefix(const char *s, size_t n);       /* bytes of s[0..n) that are whole, valid UTF-8 */
int serve_conn_fd(struct MHD_Connection *c);             /* the connection's socket, or -1 */
void serve_count_status(struct server *srv, int status); /* /metrics' request counters */
void serve_add_cors(struct server *srv, struct MHD_Connection *c, struct MHD_Response *r);
/* Queue r (consumed) on c, or on a worker thread keep it for the connection's handler. */
enum MHD_Result serve_queue_reply(struct MHD_Connection *c, unsigned status, struct MHD_Response *r);
/* On a worker thread (http.c): replies are kept in *d, and a stream made meanwhile is produced by
** the worker after the reply is handed over (serve_defer_end returns it, or NULL). */
struct serve_deferred {
    unsigned status;
    struct MHD_Response *r;
};
void serve_defer_begin(struct serve_deferred *d);
struct stream *serve_defer_end(void);
bool serve_deferred_now(void);              /* on a worker thread */
void serve_defer_stream(struct stream *st); /* the stream the worker goes on producing */
/* text (consumed, malloc'd) as the reply; sid: X-Session-Id to send, or NULL */
enum MHD_Result serve_send_text(struct server *srv, struct MHD_Connection *c, int status, const char *ctype, char *text,
                                const char *sid);
enum MHD_Result serve_send_json(struct server *srv, struct MHD_Connection *c, int status, json_t *obj, const char *sid);
/* An error reply in api's shape (NULL: the server's one error form, serve.h). */
enum MHD_Result serve_send_err(struct server *srv, struct MHD_Connection *c, const struct serve_error *e,
                               const struct serve_api *api);
enum MHD_Result serve_send_error(struct server *srv, struct MHD_Connection *c, int status, const char *type, const char *code,
                                 const char *fmt, ...) __attribute__((format(printf, 6, 7)));
enum MHD_Result serve_send_unauthorized(struct server *srv, struct MHD_Connection *c);
#define BAD(...) serve_send_error(srv, c, 400, "invalid_request_error", NULL, __VA_ARGS__)
/* The request body as a JSON object (*root, a new reference), or the error reply already queued
** (*root NULL; the return value is the reply's). */
enum MHD_Result serve_body_json(struct server *srv, struct MHD_Connection *c, struct req *rq, json_t **root);
/* Wait (under srv->mu) for a job to finish, or with until_first_char only until its text has a
** non-blank byte, checking every 100 ms that the client on fd is still connected: one that went
** away cancels the job at its next token.  serve_first_char: that byte so far, or 0. */
void serve_wait_watching(struct server *srv, int fd, struct job *j, bool until_first_char);
char serve_first_char(const struct job *j);
/* CLOCK_REALTIME now + ms: the deadline pthread_cond_timedwait takes. */
struct timespec serve_realtime_in_ms(long ms);

/* ---- stream.c --------------------------------------------------------------------------- */

/* The reply of a streamed job (the job is the stream's from here): 200 with text/event-stream,
** its events written by the job's API module. */
enum MHD_Result serve_stream_reply(struct server *srv, struct MHD_Connection *c, struct job *j);
/* On a worker: produce the stream's events until it ends or the client leaves (then let it go). */
void serve_stream_produce(struct stream *st);

/* ---- generate.c ------------------------------------------------------------------------- */

/* POST of a generation route: the body parsed by api into a job, run, answered in api's shape. */
enum MHD_Result serve_post_generate(struct server *srv, struct MHD_Connection *c, struct req *rq, const struct serve_api *api);
/* Submit jobs[0..n) (each parsed, its cv not yet set up), wait for every one; the first error in
** *e (the rest are cancelled then).  Jobs never queued are freed; the others stay the caller's
** (serve_job_release).  Returns how many were queued. */
size_t serve_run_jobs(struct server *srv, struct MHD_Connection *c, struct job **jobs, size_t n, struct serve_error *e);

/* ---- routes.c --------------------------------------------------------------------------- */

/* The request's answer (the body is in): its route's handler, or 401/404/405. */
enum MHD_Result serve_dispatch(struct server *srv, struct MHD_Connection *c, const char *url, const char *method, struct req *rq);
/* A route answered without a key (its other methods get a 405 before any body byte). */
bool serve_route_open(struct server *srv, const char *url);
void serve_routes_started(void); /* the time /metrics gives as Process-Start-Time-Unix */

#endif
